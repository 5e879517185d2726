// Stream capture modes for tests/shim_capture.rs, on the simulated node
// (directly or under the interposer). Kernels are the sim's 1 ms shape.
// Driver declarations: cuda_driver.h (via shim_common.h); the capture API's
// below.
//
// usage: shim_capture rules   the driver's capture-mode rules, one case per
//                             key (the sim must answer as NVIDIA's driver)
//        shim_capture shim    (each step acknowledged on stdin) a GLOBAL
//                             capture on this thread, launching and
//                             allocating into it, while another thread
//                             launches, allocates and replays a graph outside
//                             it (through the interposer's quotas, its
//                             watcher ticking);
//                             then the graph launched 3 times, then one
//                             kernel directly
// Prints key=value words; `phase=NAME` lines wait for a line on stdin.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim_common.h"

typedef void *CUgraph;
typedef void *CUgraphExec;
typedef void *CUevent;
typedef void *CUmemoryPool;

enum { GLOBAL = 0, THREAD_LOCAL = 1, RELAXED = 2 };

CUresult cuStreamBeginCapture_v2(CUstream s, int mode);
CUresult cuStreamEndCapture(CUstream s, CUgraph *g);
CUresult cuStreamIsCapturing(CUstream s, int *status);
CUresult cuThreadExchangeStreamCaptureMode(int *mode);
CUresult cuCtxGetCurrent(CUcontext *c);
CUresult cuCtxSetCurrent(CUcontext c);
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s);
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
CUresult cuDeviceGetMemPool(CUmemoryPool *p, CUdevice d);
CUresult cuMemPoolGetAttribute(CUmemoryPool p, int attr, void *value);
CUresult cuEventCreate(CUevent *e, unsigned flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventQuery(CUevent e);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec e, CUstream s);
CUresult cuGraphDestroy(CUgraph g);
CUresult cuGraphExecDestroy(CUgraphExec e);

static CUfunction f;
static CUstream s, s2;
static CUcontext ctx;

static CUresult launch(CUstream on) {
  return cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, on, NULL, NULL);
}

static void phase(const char *name) {
  printf("phase=%s\n", name);
  fflush(stdout);
  int c;
  while ((c = getchar()) != EOF && c != '\n') {
  }
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

// ---- rules: one call on another thread while this thread captures ----

typedef CUresult (*Call)(void);
static Call other_call;
static int other_mode;
static CUevent before_ev;

static void *other(void *arg) {
  (void)arg;
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  int m = other_mode;
  check(cuThreadExchangeStreamCaptureMode(&m), "cuThreadExchangeStreamCaptureMode");
  CUresult *r = malloc(sizeof *r);
  *r = other_call();
  return r;
}

static CUresult on_other_thread(Call c, int mode) {
  pthread_t t;
  void *r;
  other_call = c;
  other_mode = mode;
  pthread_create(&t, NULL, other, NULL);
  pthread_join(t, &r);
  CUresult v = *(CUresult *)r;
  free(r);
  return v;
}

static CUresult alloc_free(void) {
  CUdeviceptr p = 0;
  CUresult r = cuMemAlloc_v2(&p, 1 << 20);
  if (r == 0)
    r = cuMemFree_v2(p);
  return r;
}

static CUresult query_before_event(void) { return cuEventQuery(before_ev); }

static CUresult pool_attr(void) {
  CUmemoryPool p;
  unsigned long long v;
  CUresult r = cuDeviceGetMemPool(&p, 0);
  return r ? r : cuMemPoolGetAttribute(p, 5, &v); // RESERVED_MEM_CURRENT
}

static CUresult outside_work(void) {
  CUdeviceptr p;
  int st = -1;
  CUresult r = launch(s2);
  if (!r)
    r = cuMemAllocAsync(&p, 2 << 20, s2);
  if (!r)
    r = cuMemFreeAsync(p, s2);
  if (!r)
    r = cuStreamIsCapturing(s2, &st);
  return r ? r : (CUresult)(st * 1000); // s2 must not capture
}

static CUresult end_here(void) {
  CUgraph g = NULL;
  return cuStreamEndCapture(s, &g);
}

static CUresult legacy_launch(void) { return launch(NULL); }

// Begins a `mode` capture on s, launches into it, runs `c` (on another
// thread in `other_mode`, or here), launches again; prints
// `<name>_call=` (c's result) `<name>_end=` (cuStreamEndCapture's) and
// `<name>_graph=` (1 if a graph came back).
static void rule(const char *name, int mode, Call c, int here, int omode) {
  CUgraph g = NULL;
  check(cuStreamBeginCapture_v2(s, mode), "cuStreamBeginCapture");
  check(launch(s), "cuLaunchKernel(captured)");
  CUresult r = here ? c() : on_other_thread(c, omode);
  CUresult after = launch(s);
  CUresult e = cuStreamEndCapture(s, &g);
  printf("%s_call=%d %s_after=%d %s_end=%d %s_graph=%d\n", name, r, name, after, name, e, name,
         g != NULL);
  if (g)
    cuGraphDestroy(g);
}

static void rules(void) {
  check(cuEventCreate(&before_ev, 0), "cuEventCreate");
  check(launch(s2), "cuLaunchKernel");
  check(cuEventRecord(before_ev, s2), "cuEventRecord");
  rule("global_other_alloc", GLOBAL, alloc_free, 0, GLOBAL);
  rule("global_other_threadlocal_alloc", GLOBAL, alloc_free, 0, THREAD_LOCAL);
  rule("global_other_relaxed_alloc", GLOBAL, alloc_free, 0, RELAXED);
  rule("threadlocal_other_alloc", THREAD_LOCAL, alloc_free, 0, GLOBAL);
  rule("threadlocal_own_alloc", THREAD_LOCAL, alloc_free, 1, 0);
  rule("relaxed_own_alloc", RELAXED, alloc_free, 1, 0);
  rule("global_other_event_query", GLOBAL, query_before_event, 0, GLOBAL);
  rule("global_other_pool_attr", GLOBAL, pool_attr, 0, GLOBAL);
  rule("global_other_outside_work", GLOBAL, outside_work, 0, GLOBAL);
  rule("global_own_legacy_launch", GLOBAL, legacy_launch, 1, 0);
  // Ended from another thread: refused (the capture stays open).
  check(cuStreamBeginCapture_v2(s, GLOBAL), "cuStreamBeginCapture");
  CUresult wrong = on_other_thread(end_here, GLOBAL);
  CUgraph g = NULL;
  CUresult e = cuStreamEndCapture(s, &g);
  printf("wrong_thread_end=%d then_end=%d\n", wrong, e);
}

// ---- shim: the interposer's calls during a GLOBAL capture ----

static volatile int outside_done;
static long outside_ops, outside_errors;
static CUresult outside_first_error;

static void outside_fail(CUresult r) {
  if (r && !outside_first_error)
    outside_first_error = r;
  outside_errors += r != 0;
}

static CUgraph outside_graph; // 2 kernels, captured on s2 before

// Another thread, GLOBAL mode (the default): launches on its own stream
// (throttled), stream-ordered allocations on it; synchronous allocations
// in RELAXED mode, as PyTorch's caching allocator makes them during a
// capture; every 4th round a graph instantiated (the interposer walks it),
// launched (charged its kernels) and destroyed. For `secs` seconds and at
// least MIN_OPS rounds (the watcher ticks every 20-100 ms meanwhile).
#define MIN_OPS 20
static void *outside(void *arg) {
  double secs = *(double *)arg, t0 = now_s();
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  while (now_s() - t0 < secs || outside_ops < MIN_OPS) {
    CUdeviceptr p;
    outside_fail(launch(s2));
    CUresult r = cuMemAllocAsync(&p, 4 << 20, s2);
    outside_fail(r);
    if (!r)
      outside_fail(cuMemFreeAsync(p, s2));
    int m = RELAXED;
    cuThreadExchangeStreamCaptureMode(&m);
    outside_fail(alloc_free());
    cuThreadExchangeStreamCaptureMode(&m);
    if (outside_ops % 4 == 0) {
      CUgraphExec ex;
      r = cuGraphInstantiateWithFlags(&ex, outside_graph, 0);
      outside_fail(r);
      if (!r) {
        outside_fail(cuGraphLaunch(ex, s2));
        outside_fail(cuGraphExecDestroy(ex));
      }
    }
    outside_ops++;
    usleep(2000);
  }
  outside_done = 1;
  return NULL;
}

static void shim(void) {
  CUdeviceptr p;
  // The pool is charged before the capture: the watcher's tick reads it.
  check(cuMemAllocAsync(&p, 8 << 20, s2), "cuMemAllocAsync");
  check(cuMemFreeAsync(p, s2), "cuMemFreeAsync");
  check(cuStreamSynchronize(s2), "cuStreamSynchronize");
  check(cuStreamBeginCapture_v2(s2, GLOBAL), "cuStreamBeginCapture");
  check(launch(s2), "cuLaunchKernel(captured)");
  check(launch(s2), "cuLaunchKernel(captured)");
  check(cuStreamEndCapture(s2, &outside_graph), "cuStreamEndCapture");
  phase("ready");
  double secs = 0.6;
  pthread_t t;
  CUgraph g = NULL;
  int n = 0;
  check(cuStreamBeginCapture_v2(s, GLOBAL), "cuStreamBeginCapture");
  pthread_create(&t, NULL, outside, &secs);
  while (!outside_done || n < MIN_OPS) {
    check(launch(s), "cuLaunchKernel(captured)");
    n++;
    if (n % 8 == 0) {
      check(cuMemAllocAsync(&p, 1 << 20, s), "cuMemAllocAsync(captured)");
      check(cuMemFreeAsync(p, s), "cuMemFreeAsync(captured)");
    }
    usleep(10000);
  }
  pthread_join(t, NULL);
  CUresult e = cuStreamEndCapture(s, &g);
  printf("captured=%d outside_ops=%ld outside_errors=%ld outside_first_error=%d end=%d\n", n,
         outside_ops, outside_errors, outside_first_error, e);
  check(e, "cuStreamEndCapture");
  check(cuStreamSynchronize(s2), "cuStreamSynchronize");
  phase("captured");
  CUgraphExec ex;
  check(cuGraphInstantiateWithFlags(&ex, g, 0), "cuGraphInstantiate");
  for (int i = 0; i < 3; i++)
    check(cuGraphLaunch(ex, s), "cuGraphLaunch");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  phase("graph");
  check(launch(s), "cuLaunchKernel");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  phase("direct");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: shim_capture rules|shim\n");
    return 2;
  }
  setup_kernel("kernel", &f, &s);
  check(cuStreamCreate(&s2, 0), "cuStreamCreate");
  check(cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!strcmp(argv[1], "rules"))
    rules();
  else if (!strcmp(argv[1], "shim"))
    shim();
  else {
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 2;
  }
  printf("ok=1\n");
  return 0;
}
