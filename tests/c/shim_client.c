// A CUDA program linked with -lcuda, as users build them, driving the
// interposer's quota paths. Declarations by hand (no cuda.h here: the common
// ones in cuda_driver.h), with the versioned names cuda.h's macros map to.
//
// usage: shim_client MODE [ARGS]; prints key=value lines the tests parse.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shim_common.h"

typedef void *CUarray;
typedef void *CUmipmappedArray;

typedef struct {
  int allocType, handleTypes;
  struct {
    int type, id;
  } location;
  void *win32SecurityAttributes;
  size_t maxSize;
  unsigned short usage;
  unsigned char reserved[54];
} CUmemPoolProps;

typedef struct {
  size_t Width, Height;
  int Format;
  unsigned NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
  size_t Width, Height, Depth;
  int Format;
  unsigned NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned elem);
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned flags);
CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d);
CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d);
CUresult cuArrayDestroy(CUarray a);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray a);
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *p,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle h);
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s);
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s);

#define MIB (1024ULL * 1024ULL)
#define MAXP 4096

static CUcontext setup(void) {
  CUdevice dev;
  CUcontext ctx;
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  return ctx;
}

static void info(const char *tag) {
  size_t f = 0, t = 0, dt = 0;
  check(cuMemGetInfo_v2(&f, &t), "cuMemGetInfo");
  check(cuDeviceTotalMem_v2(&dt, 0), "cuDeviceTotalMem");
  printf("%s_total=%zu %s_free=%zu %s_device_total=%zu\n", tag, t, tag, f, tag, dt);
}

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

// Allocates `chunk` until an error; frees all; returns the count.
static int fill_plain(size_t chunk, CUresult *last) {
  static CUdeviceptr p[MAXP];
  int n = 0;
  CUresult r;
  while (n < MAXP && (r = cuMemAlloc_v2(&p[n], chunk)) == 0) n++;
  *last = r;
  info("full");
  // Free one, the next allocation fits again.
  if (n > 0) {
    check(cuMemFree_v2(p[n - 1]), "cuMemFree");
    printf("realloc=%d\n", cuMemAlloc_v2(&p[n - 1], chunk));
  }
  for (int i = 0; i < n; i++) check(cuMemFree_v2(p[i]), "cuMemFree");
  return n;
}

static int mode_quota(size_t chunk) {
  setup();
  info("start");
  CUresult last;
  int n = fill_plain(chunk, &last);
  printf("allocated=%d last=%d\n", n, last);
  info("end");
  return 0;
}

static CUmemAllocationProp vmm_prop(void) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = 1;           // CU_MEM_ALLOCATION_TYPE_PINNED
  p.location.type = 1;  // CU_MEM_LOCATION_TYPE_DEVICE
  p.location.id = 0;
  return p;
}

static int mode_vmm(size_t chunk) {
  static CUmemGenericAllocationHandle h[MAXP];
  setup();
  CUmemAllocationProp prop = vmm_prop();
  int n = 0;
  CUresult r;
  while (n < MAXP && (r = cuMemCreate(&h[n], chunk, &prop, 0)) == 0) n++;
  printf("allocated=%d last=%d\n", n, r);
  info("full");
  for (int i = 0; i < n; i++) check(cuMemRelease(h[i]), "cuMemRelease");
  info("end");
  return 0;
}

static int mode_async(size_t chunk) {
  static CUdeviceptr p[MAXP];
  setup();
  CUstream s;
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  int n = 0;
  CUresult r;
  while (n < MAXP && (r = cuMemAllocAsync(&p[n], chunk, s)) == 0) n++;
  printf("async_allocated=%d async_last=%d\n", n, r);
  info("async_full");
  for (int i = 0; i < n; i++) check(cuMemFreeAsync(p[i], s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");

  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = 1;
  props.location.type = 1;
  CUmemoryPool pool;
  check(cuMemPoolCreate(&pool, &props), "cuMemPoolCreate");
  n = 0;
  while (n < MAXP && (r = cuMemAllocFromPoolAsync(&p[n], chunk, pool, s)) == 0) n++;
  printf("pool_allocated=%d pool_last=%d\n", n, r);
  info("pool_full");
  for (int i = 0; i < n; i++) check(cuMemFreeAsync(p[i], s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  info("end");
  return 0;
}

// Every other allocation path: prints how much each one charged.
static int mode_paths(void) {
  setup();
  size_t f0, t, f1;
  check(cuMemGetInfo_v2(&f0, &t), "cuMemGetInfo");
#define CHARGED(name, call, undo)                       \
  do {                                                  \
    check(call, #name);                                 \
    check(cuMemGetInfo_v2(&f1, &t), "cuMemGetInfo");    \
    printf("%s=%zu\n", #name, f0 - f1);                 \
    check(undo, #name "_free");                         \
    check(cuMemGetInfo_v2(&f1, &t), "cuMemGetInfo");    \
    printf("%s_after_free=%zu\n", #name, f0 - f1);      \
  } while (0)
  CUdeviceptr p;
  size_t pitch;
  CHARGED(pitch, cuMemAllocPitch_v2(&p, &pitch, 1000, 100, 4), cuMemFree_v2(p));
  CHARGED(managed, cuMemAllocManaged(&p, 3 * MIB, 1), cuMemFree_v2(p));
  CUarray a;
  CUDA_ARRAY_DESCRIPTOR d2 = {1024, 512, 0x20, 4};
  CHARGED(array, cuArrayCreate_v2(&a, &d2), cuArrayDestroy(a));
  CUDA_ARRAY3D_DESCRIPTOR d3 = {256, 256, 16, 0x01, 1, 0};
  CHARGED(array3d, cuArray3DCreate_v2(&a, &d3), cuArrayDestroy(a));
  CUmipmappedArray m;
  CUDA_ARRAY3D_DESCRIPTOR dm = {1024, 1024, 0, 0x01, 4, 0};
  CHARGED(mipmapped, cuMipmappedArrayCreate(&m, &dm, 3), cuMipmappedArrayDestroy(m));
  return 0;
}

struct race {
  int iters;
  size_t chunk;
  int ok, oom, other;
};

static void *racer(void *arg) {
  struct race *r = arg;
  CUdeviceptr held[16];
  int n = 0;
  unsigned seed = (unsigned)(size_t)pthread_self();
  for (int i = 0; i < r->iters; i++) {
    if (n < 16 && (rand_r(&seed) % 3 != 0 || n == 0)) {
      CUresult e = cuMemAlloc_v2(&held[n], r->chunk);
      if (e == 0) {
        n++;
        r->ok++;
      } else if (e == 2) {
        r->oom++;
      } else {
        r->other++;
      }
    } else if (n > 0) {
      check(cuMemFree_v2(held[--n]), "cuMemFree");
    }
  }
  while (n > 0) check(cuMemFree_v2(held[--n]), "cuMemFree");
  return NULL;
}

// Threads must set the context current themselves.
static CUcontext race_ctx;
static void *racer_ctx(void *arg) {
  cuCtxSetCurrent(race_ctx);
  return racer(arg);
}

// `wait`: once the context exists, print "ready" and start on a line from
// stdin (so that all processes have their contexts before anyone races).
static int mode_race_ctx(int threads, int iters, size_t chunk, int wait) {
  race_ctx = setup();
  if (wait) {
    char go[16];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(go, sizeof go, stdin)) return 1;
  }
  pthread_t t[64];
  struct race r[64];
  for (int i = 0; i < threads; i++) {
    r[i] = (struct race){iters, chunk, 0, 0, 0};
    pthread_create(&t[i], NULL, racer_ctx, &r[i]);
  }
  int ok = 0, oom = 0, other = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(t[i], NULL);
    ok += r[i].ok;
    oom += r[i].oom;
    other += r[i].other;
  }
  printf("ok=%d oom=%d other=%d\n", ok, oom, other);
  return other != 0;
}

static int mode_fork(size_t chunk) {
  setup();
  CUdeviceptr p;
  check(cuMemAlloc_v2(&p, chunk), "parent cuMemAlloc");
  // What the parent holds (its chunk and its context).
  size_t f0 = 0, t0 = 0;
  check(cuMemGetInfo_v2(&f0, &t0), "cuMemGetInfo");
  printf("parent_pid=%d\n", getpid());
  fflush(stdout);
  pid_t c = fork();
  if (c == 0) {
    // The child starts afresh: its own context, registration and watcher.
    setup();
    CUresult last;
    int n = fill_plain(chunk, &last);
    printf("child_pid=%d child_allocated=%d child_last=%d\n", getpid(), n, last);
    fflush(stdout);
    CUdeviceptr q;
    check(cuMemAlloc_v2(&q, chunk), "child hold");
    // Hold it while the test looks at the manager's view.
    usleep(300 * 1000);
    _exit(0);
  }
  int st;
  waitpid(c, &st, 0);
  printf("child_status=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  // The manager gives the child's bytes back when it sees its connection
  // close, which may come a moment after waitpid: wait for the view to
  // show only what the parent held before the fork in use (up to 2 s).
  for (int i = 0; i < 200; i++) {
    size_t f = 0, t = 0;
    check(cuMemGetInfo_v2(&f, &t), "cuMemGetInfo");
    if (t - f <= t0 - f0) break;
    usleep(10 * 1000);
  }
  CUresult last;
  int n = fill_plain(chunk, &last);
  printf("parent_allocated=%d parent_last=%d\n", n, last);
  return 0;
}

// Holds `chunk` until stdin closes (manager restart tests).
static int mode_hold(size_t chunk) {
  setup();
  CUdeviceptr p;
  check(cuMemAlloc_v2(&p, chunk), "cuMemAlloc");
  printf("holding pid=%d\n", getpid());
  fflush(stdout);
  char buf[64];
  while (fgets(buf, sizeof buf, stdin)) {
    if (strncmp(buf, "alloc", 5) == 0) {
      CUdeviceptr q;
      printf("alloc=%d\n", cuMemAlloc_v2(&q, chunk));
      fflush(stdout);
    }
  }
  return 0;
}

// Medians for the overhead benchmark: ROUNDS rounds of n one-thread
// launches then n/10 cuMemAlloc+cuMemFree, sleeping `sleep_ms` after each
// round (paced under a compute quota, a round finds its tokens there).
static int mode_bench(int n, int sleep_ms) {
  double t0 = now_ns();
  CUresult r = cuInit(0);
  double init_ns = now_ns() - t0;
  check(r, "cuInit");
  CUdevice dev;
  CUcontext ctx;
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  CUmodule m;
  CUfunction f;
  static const char image[] = "fake image";
  check(cuModuleLoadData(&m, image), "cuModuleLoadData");
  check(cuModuleGetFunction(&f, m, "noop"), "cuModuleGetFunction");
  CUstream s;
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  enum { ROUNDS = 31 };
  double launch[ROUNDS], alloc[ROUNDS];
  for (int k = 0; k < ROUNDS; k++) {
    double a = now_ns();
    for (int i = 0; i < n; i++) cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    launch[k] = (now_ns() - a) / n;
    cuStreamSynchronize(s);
    a = now_ns();
    for (int i = 0; i < n / 10; i++) {
      CUdeviceptr p;
      cuMemAlloc_v2(&p, 1 << 20);
      cuMemFree_v2(p);
    }
    alloc[k] = (now_ns() - a) / (n / 10);
    if (sleep_ms > 0) usleep(sleep_ms * 1000);
  }
  qsort(launch, ROUNDS, sizeof(double), cmp_double);
  qsort(alloc, ROUNDS, sizeof(double), cmp_double);
  printf("init_ns=%.0f launch_ns=%.1f alloc_free_ns=%.1f\n", init_ns, launch[ROUNDS / 2],
         alloc[ROUNDS / 2]);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) return 2;
  const char *m = argv[1];
  size_t chunk = (argc > 2 ? strtoull(argv[2], NULL, 10) : 64) * MIB;
  if (!strcmp(m, "init")) {
    printf("cuInit=%d\n", cuInit(0));
    return 0;
  }
  if (!strcmp(m, "quota")) return mode_quota(chunk);
  if (!strcmp(m, "vmm")) return mode_vmm(chunk);
  if (!strcmp(m, "async")) return mode_async(chunk);
  if (!strcmp(m, "paths")) return mode_paths();
  if (!strcmp(m, "race"))
    return mode_race_ctx(atoi(argv[2]), atoi(argv[3]), strtoull(argv[4], NULL, 10) * MIB,
                         argc > 5 && !strcmp(argv[5], "wait"));
  if (!strcmp(m, "fork")) return mode_fork(chunk);
  if (!strcmp(m, "hold")) return mode_hold(chunk);
  if (!strcmp(m, "bench"))
    return mode_bench(argc > 2 ? atoi(argv[2]) : 100000, argc > 3 ? atoi(argv[3]) : 0);
  return 2;
}
