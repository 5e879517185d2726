/* A steady GPU load on the simulated driver, for the display tests:
 *   display_load DUTY [MEM_MIB]
 * holds MEM_MIB of device memory, then in every 100 ms period (absolute
 * deadlines, so periods do not drift) launches DUTY kernels of 1 ms and
 * synchronizes: the process keeps the GPU busy DUTY percent of the time.
 * Prints "ready" after the first period; runs until killed. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_driver.h"

static void check(CUresult r, const char *what) {
  if (r != 0) {
    printf("FAIL %s: %d\n", what, r);
    fflush(stdout);
    exit(1);
  }
}

int main(int argc, char **argv) {
  int duty = argc > 1 ? atoi(argv[1]) : 10;
  long mem_mib = argc > 2 ? atol(argv[2]) : 0;
  CUdevice dev;
  CUcontext ctx;
  CUmodule m;
  CUfunction f;
  CUstream s;
  CUdeviceptr p;
  static const char image[] = "fake cubin";
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  if (mem_mib > 0) check(cuMemAlloc_v2(&p, (size_t)mem_mib << 20), "cuMemAlloc");
  check(cuModuleLoadData(&m, image), "cuModuleLoadData");
  check(cuModuleGetFunction(&f, m, "busy"), "cuModuleGetFunction");
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  struct timespec next;
  clock_gettime(CLOCK_MONOTONIC, &next);
  for (long period = 0;; period++) {
    /* 86400 blocks of 256 threads on 108 SMs x 8 blocks: 100 waves, 1 ms. */
    for (int k = 0; k < duty; k++)
      check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    if (period == 0) {
      printf("ready\n");
      fflush(stdout);
    }
    next.tv_nsec += 100000000L;
    if (next.tv_nsec >= 1000000000L) {
      next.tv_nsec -= 1000000000L;
      next.tv_sec += 1;
    }
    clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
  }
}
