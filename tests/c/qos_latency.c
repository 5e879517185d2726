// A latency-sensitive CUDA tenant for the QoS benchmark: requests of a few
// kernels arrive at a steady rate (open loop: a request's latency counts
// from when it was due, so falling behind shows), each launched on one
// stream and synchronised; at the end the request latencies' percentiles.
// Driver declarations: cuda_driver.h (via shim_common.h).
//
// usage: qos_latency SECONDS RATE_HZ KERNELS BLOCKS [graph] [priority] [poll] [warmup=S]
//   each request is KERNELS launches of BLOCKS blocks of 256 threads (the
//   sim's A100: 864 blocks a 10 us wave, so 17280 blocks = 200 us);
//   `graph`: the request's kernels captured once into a CUDA graph, one
//   cuGraphLaunch per request; `priority`: the stream at the context's
//   greatest priority; `poll`: a request's end found by cuStreamQuery
//   every 20 us (as servers that poll do), not cuStreamSynchronize; `warmup=S`: requests due in the first S seconds
//   run but are not counted (a quota controller's start-up).
// Prints `pid=N start_ns=T` when it starts, then at the end requests=,
// late= (requests that began after the next was due), p50_us=, p99_us=,
// max_us=, mean_us=.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim_common.h"

typedef void *CUgraph;
typedef void *CUgraphExec;
CUresult cuStreamBeginCapture_v2(CUstream s, int mode);
CUresult cuStreamEndCapture(CUstream s, CUgraph *g);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec e, CUstream s);
CUresult cuStreamCreateWithPriority(CUstream *s, unsigned flags, int priority);
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest);
CUresult cuStreamQuery(CUstream s);

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void sleep_until(long long t) {
  struct timespec ts = {t / 1000000000LL, t % 1000000000LL};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
  }
}

static int by_value(const void *a, const void *b) {
  long long x = *(const long long *)a, y = *(const long long *)b;
  return (x > y) - (x < y);
}

static void launch_request(CUfunction f, CUstream s, int kernels, unsigned blocks) {
  for (int k = 0; k < kernels; k++)
    check(cuLaunchKernel(f, blocks, 1, 1, 256, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr,
            "usage: qos_latency SECONDS RATE_HZ KERNELS BLOCKS [graph] [priority] [poll] [warmup=S]\n");
    return 2;
  }
  double seconds = atof(argv[1]), rate = atof(argv[2]);
  int kernels = atoi(argv[3]);
  unsigned blocks = (unsigned)atoi(argv[4]);
  int graph = 0, priority = 0, poll = 0;
  double warmup = 0;
  for (int i = 5; i < argc; i++) {
    graph |= strcmp(argv[i], "graph") == 0;
    priority |= strcmp(argv[i], "priority") == 0;
    poll |= strcmp(argv[i], "poll") == 0;
    if (strncmp(argv[i], "warmup=", 7) == 0) warmup = atof(argv[i] + 7);
  }
  if (seconds <= 0 || rate <= 0 || kernels < 1 || blocks < 1) {
    fprintf(stderr, "qos_latency: SECONDS and RATE_HZ must be > 0, KERNELS and BLOCKS >= 1\n");
    return 2;
  }
  CUfunction f;
  CUstream s;
  setup_kernel("busy", &f, &s);
  if (priority) {
    int least, greatest;
    check(cuCtxGetStreamPriorityRange(&least, &greatest), "cuCtxGetStreamPriorityRange");
    check(cuStreamCreateWithPriority(&s, 1, greatest), "cuStreamCreateWithPriority");
  }
  CUgraphExec exec = NULL;
  if (graph) {
    CUgraph g;
    check(cuStreamBeginCapture_v2(s, 2), "cuStreamBeginCapture");
    launch_request(f, s, kernels, blocks);
    check(cuStreamEndCapture(s, &g), "cuStreamEndCapture");
    check(cuGraphInstantiateWithFlags(&exec, g, 0), "cuGraphInstantiate");
  }
  // One warm request outside the measurement (first-launch costs).
  launch_request(f, s, kernels, blocks);
  check(cuStreamSynchronize(s), "cuStreamSynchronize");

  long long period = (long long)(1e9 / rate);
  long long n_max = (long long)(seconds * rate) + 1;
  long long *lat = calloc((size_t)n_max, sizeof *lat);
  long long t0 = now_ns() + 1000000, n = 0, late = 0, k = 0;
  long long counted_from = t0 + (long long)(warmup * 1e9);
  printf("pid=%d start_ns=%lld\n", getpid(), t0);
  fflush(stdout);
  for (;; k++) {
    long long due = t0 + k * period;
    if (due > t0 + (long long)(seconds * 1e9) || n >= n_max) break;
    int counted = due >= counted_from;
    if (now_ns() < due)
      sleep_until(due);
    else if (counted && k > 0)
      late++;
    if (graph)
      check(cuGraphLaunch(exec, s), "cuGraphLaunch");
    else
      launch_request(f, s, kernels, blocks);
    if (poll) {
      CUresult r;
      while ((r = cuStreamQuery(s)) == 600 /* CUDA_ERROR_NOT_READY */) usleep(20);
      check(r, "cuStreamQuery");
    } else {
      check(cuStreamSynchronize(s), "cuStreamSynchronize");
    }
    if (counted) lat[n++] = now_ns() - due;
  }
  if (n == 0) {
    printf("error no requests counted (warmup %.1f s of %.1f s)\n", warmup, seconds);
    return 1;
  }
  qsort(lat, (size_t)n, sizeof *lat, by_value);
  long long sum = 0;
  for (long long i = 0; i < n; i++) sum += lat[i];
  printf("requests=%lld late=%lld p50_us=%.1f p99_us=%.1f max_us=%.1f mean_us=%.1f\n", n, late,
         lat[n / 2] / 1e3, lat[(n * 99) / 100] / 1e3, lat[n - 1] / 1e3, sum / (double)n / 1e3);
  fflush(stdout);
  free(lat);
  return 0;
}
