/* compute_loop [HOLD_MIB]
 *
 * A training-like load for the demo: on every visible GPU, holds HOLD_MIB of
 * device memory and keeps the GPU busy with back-to-back 1 ms kernels (a few
 * queued per stream, then a synchronize), as fast as the driver takes them,
 * until SIGTERM. It asks for all the GPU time it can get, so what it achieves
 * is what its core quota lets it have.
 *
 * Prints "ready gpus=N ..." once every GPU ran a first batch, and
 * "done kernels=K seconds=S" at exit. */
#include "cuda_min.h"
#include <time.h>

#define MAX_GPUS 16
#define QUEUED 4 /* kernels in flight per stream before each synchronize */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  size_t hold_mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 0;
  static const char image[] = "demo cubin"; /* the simulated driver takes any image */
  CUcontext ctx[MAX_GPUS];
  CUstream stream[MAX_GPUS];
  CUfunction fn[MAX_GPUS];
  unsigned grid[MAX_GPUS];
  int n = 0;

  cu_handle_signals();
  cu_load();
  cu_check(cu.Init(0), "cuInit");
  cu_check(cu.DeviceGetCount(&n), "cuDeviceGetCount");
  if (n > MAX_GPUS) n = MAX_GPUS;
  for (int i = 0; i < n; i++) {
    CUdevice dev;
    CUmodule mod;
    CUdeviceptr mem;
    int sms = 0, threads = 0;
    cu_check(cu.DeviceGet(&dev, i), "cuDeviceGet");
    cu_check(cu.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
             "cuDeviceGetAttribute");
    cu_check(cu.DeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev),
             "cuDeviceGetAttribute");
    cu_check(cu.CtxCreate(&ctx[i], 0, dev), "cuCtxCreate");
    if (hold_mib > 0) cu_check(cu.MemAlloc(&mem, hold_mib << 20), "cuMemAlloc");
    cu_check(cu.ModuleLoadData(&mod, image), "cuModuleLoadData");
    cu_check(cu.ModuleGetFunction(&fn[i], mod, "busy"), "cuModuleGetFunction");
    cu_check(cu.StreamCreate(&stream[i], 0), "cuStreamCreate");
    /* 100 full waves of 256-thread blocks: about 1 ms on the simulated GPU. */
    int per_sm = threads / 256 > 0 ? threads / 256 : 1;
    grid[i] = (unsigned)(sms * per_sm * 100);
  }
  size_t free_b = 0, total_b = 0;
  cu_check(cu.MemGetInfo(&free_b, &total_b), "cuMemGetInfo");

  long long kernels = 0;
  double start = now_s();
  for (long batch = 0; !cu_stop; batch++) {
    for (int i = 0; i < n; i++) {
      cu_check(cu.CtxSetCurrent(ctx[i]), "cuCtxSetCurrent");
      for (int k = 0; k < QUEUED; k++) {
        cu_check(cu.LaunchKernel(fn[i], grid[i], 1, 1, 256, 1, 1, 0, stream[i], NULL, NULL),
                 "cuLaunchKernel");
        kernels++;
      }
    }
    for (int i = 0; i < n; i++) {
      cu_check(cu.CtxSetCurrent(ctx[i]), "cuCtxSetCurrent");
      cu_check(cu.StreamSynchronize(stream[i]), "cuStreamSynchronize");
    }
    if (batch == 0) {
      printf("ready gpus=%d hold_mib=%zu visible_total_mib=%zu\n", n, hold_mib, total_b >> 20);
      fflush(stdout);
    }
  }
  printf("done kernels=%lld seconds=%.1f\n", kernels, now_s() - start);
  return 0;
}
