// One process on every GPU it sees, under a share that spans several GPUs
// (tests/shim_multi_gpu.rs): per visible device, a context, the memory
// view, then allocations until the device's quota says no.
//
// usage: multi_gpu MODE CHUNK_MIB
//   alloc: cuMemAlloc in each device's own context, device after device,
//          nothing freed until every device is full;
//   vmm:   cuMemCreate with location.id = the device, all from the FIRST
//          device's context (the memory lives where the location says,
//          not in the current context's device).
//        multi_gpu hold MIB
//          a context and MIB on every visible device, `held=1`, then waits
//          for a line on stdin (the test restarts the manager meanwhile),
//          allocates MIB more on each device (dN_again=result) and exits.
//        multi_gpu compute SECONDS
//          one thread per visible device, each with its own context and
//          stream, saturating it with back-to-back 1 ms kernels (16000
//          blocks of 256 threads: 100 waves of 10 us on the node's T4s,
//          synchronising every 4 launches) for SECONDS; prints
//          pid and start_ns first, then dN_launches per device.
// Prints, per device ordinal D, `dN_KEY=VALUE` lines the test parses:
// bus (PCI bus id), ctx (the context call's result), total/free (the
// view after the context), filled (bytes allocated before the refusal),
// err (the refusal), full_free/full_total (the view when full), and
// nvml_total/nvml_used (nvmlDeviceGetMemoryInfo of the device found by
// its bus id, when full: the same GPU's view through NVML).
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_driver.h"

CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuStreamCreate(CUstream *s, unsigned int flags);
CUresult cuMemCreate(unsigned long long *h, size_t n, const CUmemAllocationProp *p,
                     unsigned long long flags);

#define MIB (1024ULL * 1024ULL)
#define MAX_DEV 16
#define MAX_CHUNKS 4096

static void view(int d, const char *what) {
  size_t f = 0, t = 0;
  CUresult r = cuMemGetInfo_v2(&f, &t);
  printf("d%d_%sfree=%zu\nd%d_%stotal=%zu\nd%d_%sinfo=%d\n", d, what, f, d, what, t, d, what, r);
}

typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;

// NVML's memory view of the device at PCI `bus` (the interposer's NVML,
// loaded by soname as tools do).
static void nvml_view(int d, const char *bus) {
  void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!h) {
    printf("d%d_nvml=%s\n", d, dlerror());
    return;
  }
  int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
  int (*by_bus)(const char *, void **) =
      (int (*)(const char *, void **))dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2");
  int (*info)(void *, nvmlMemory_t *) =
      (int (*)(void *, nvmlMemory_t *))dlsym(h, "nvmlDeviceGetMemoryInfo");
  void *dev = NULL;
  nvmlMemory_t m = {0, 0, 0};
  int r = init ? init() : -1;
  if (r == 0)
    r = by_bus(bus, &dev);
  if (r == 0)
    r = info(dev, &m);
  printf("d%d_nvml=%d\nd%d_nvml_total=%llu\nd%d_nvml_used=%llu\n", d, r, d, m.total, d, m.used);
}

static unsigned long long fill(int d, const char *mode, int dev, size_t chunk) {
  unsigned long long n = 0;
  CUresult r = 0;
  for (int i = 0; i < MAX_CHUNKS; i++) {
    if (strcmp(mode, "vmm") == 0) {
      CUmemAllocationProp p;
      unsigned long long h;
      memset(&p, 0, sizeof p);
      p.type = 1;          // CU_MEM_ALLOCATION_TYPE_PINNED
      p.location.type = 1; // CU_MEM_LOCATION_TYPE_DEVICE
      p.location.id = dev;
      r = cuMemCreate(&h, chunk, &p, 0);
    } else {
      CUdeviceptr ptr;
      r = cuMemAlloc_v2(&ptr, chunk);
    }
    if (r != 0)
      break;
    n += chunk;
  }
  printf("d%d_filled=%llu\nd%d_err=%d\n", d, n, d, r);
  return n;
}

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

struct worker {
  int dev;
  long long end;
  long long launches;
  CUresult err;
};

static void *saturate(void *arg) {
  struct worker *w = arg;
  CUcontext ctx;
  CUmodule m;
  CUfunction f;
  CUstream s;
  static const char image[] = "fake image";
  w->err = cuCtxCreate_v2(&ctx, 0, w->dev);
  if (!w->err)
    w->err = cuModuleLoadData(&m, image);
  if (!w->err)
    w->err = cuModuleGetFunction(&f, m, "busy");
  if (!w->err)
    w->err = cuStreamCreate(&s, 0);
  while (!w->err && now_ns() < w->end) {
    w->err = cuLaunchKernel(f, 16000, 1, 1, 256, 1, 1, 0, s, NULL, NULL);
    if (!w->err && ++w->launches % 4 == 0)
      w->err = cuStreamSynchronize(s);
  }
  if (!w->err)
    w->err = cuStreamSynchronize(s);
  return NULL;
}

static int compute(double seconds) {
  int count = 0;
  CUresult r = cuInit(0);
  printf("init=%d\n", r);
  if (r != 0)
    return 1;
  cuDeviceGetCount(&count);
  if (count > MAX_DEV)
    count = MAX_DEV;
  struct worker w[MAX_DEV];
  pthread_t t[MAX_DEV];
  printf("count=%d pid=%d start_ns=%lld\n", count, getpid(), now_ns());
  fflush(stdout);
  long long end = now_ns() + (long long)(seconds * 1e9);
  for (int d = 0; d < count; d++) {
    w[d] = (struct worker){.dev = d, .end = end};
    pthread_create(&t[d], NULL, saturate, &w[d]);
  }
  for (int d = 0; d < count; d++) {
    pthread_join(t[d], NULL);
    printf("d%d_launches=%lld\nd%d_launch_err=%d\n", d, w[d].launches, d, w[d].err);
  }
  fflush(stdout);
  return 0;
}

static int hold(size_t bytes) {
  int count = 0;
  CUresult r = cuInit(0);
  printf("init=%d\n", r);
  if (r != 0)
    return 1;
  cuDeviceGetCount(&count);
  if (count > MAX_DEV)
    count = MAX_DEV;
  CUcontext ctx[MAX_DEV];
  for (int d = 0; d < count; d++) {
    CUdeviceptr p;
    r = cuCtxCreate_v2(&ctx[d], 0, d);
    if (!r)
      r = cuMemAlloc_v2(&p, bytes);
    printf("d%d_hold=%d\n", d, r);
  }
  printf("count=%d pid=%d held=1\n", count, getpid());
  fflush(stdout);
  char line[64];
  if (!fgets(line, sizeof line, stdin))
    line[0] = 0;
  for (int d = 0; d < count; d++) {
    CUdeviceptr p;
    cuCtxSetCurrent(ctx[d]);
    printf("d%d_again=%d\n", d, cuMemAlloc_v2(&p, bytes));
  }
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: multi_gpu alloc|vmm CHUNK_MIB | compute SECONDS\n");
    return 2;
  }
  if (strcmp(argv[1], "compute") == 0)
    return compute(atof(argv[2]));
  if (strcmp(argv[1], "hold") == 0)
    return hold((size_t)atoll(argv[2]) * MIB);
  const char *mode = argv[1];
  size_t chunk = (size_t)atoll(argv[2]) * MIB;
  int count = 0;
  CUresult r = cuInit(0);
  printf("init=%d\n", r);
  if (r != 0)
    return 0;
  cuDeviceGetCount(&count);
  printf("count=%d\n", count);
  CUcontext ctx[MAX_DEV] = {0};
  for (int d = 0; d < count && d < MAX_DEV; d++) {
    CUdevice dev;
    char bus[32] = {0};
    cuDeviceGet(&dev, d);
    cuDeviceGetPCIBusId(bus, sizeof bus, dev);
    r = cuCtxCreate_v2(&ctx[d], 0, dev);
    printf("d%d_bus=%s\nd%d_ctx=%d\n", d, bus, d, r);
    if (r != 0)
      ctx[d] = 0;
    else
      view(d, "");
  }
  for (int d = 0; d < count && d < MAX_DEV; d++) {
    if (!ctx[d])
      continue;
    // vmm: every handle is created from the first device's context.
    int current = strcmp(mode, "vmm") == 0 ? 0 : d;
    while (!ctx[current])
      current++;
    cuCtxSetCurrent(ctx[current]);
    fill(d, mode, d, chunk);
  }
  for (int d = 0; d < count && d < MAX_DEV; d++) {
    if (!ctx[d])
      continue;
    char bus[32] = {0};
    cuCtxSetCurrent(ctx[d]);
    view(d, "full_");
    cuDeviceGetPCIBusId(bus, sizeof bus, d);
    nvml_view(d, bus);
  }
  fflush(stdout);
  return 0;
}
