/* Allocates device memory through the driver API and holds it until stdin
 * closes (or a line arrives), printing what it did. Used to check, from
 * outside, what the driver reports about a process: inside a container, the
 * host must see it under its host PID. The driver entry points it needs are
 * in cuda_driver.h (the ABI is stable C). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <stdint.h>
#include <time.h>

#include "cuda_driver.h"

static void check(CUresult r, const char *what) {
  if (r != 0) {
    const char *name = "?";
    cuGetErrorName(r, &name);
    printf("FAIL %s: %s (%d)\n", what, name, r);
    fflush(stdout);
    exit(1);
  }
}

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 64;
  int count = 0;
  CUdevice dev;
  CUcontext ctx;
  CUdeviceptr ptr;
  size_t free_b = 0, total_b = 0;
  check(cuInit(0), "cuInit");
  check(cuDeviceGetCount(&count), "cuDeviceGetCount");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  check(cuMemAlloc_v2(&ptr, mib << 20), "cuMemAlloc");
  clock_gettime(CLOCK_MONOTONIC, &t1);
  long alloc_us = (t1.tv_sec - t0.tv_sec) * 1000000L + (t1.tv_nsec - t0.tv_nsec) / 1000;
  check(cuMemGetInfo_v2(&free_b, &total_b), "cuMemGetInfo");
  printf("pid=%d devices=%d allocated_mib=%zu free_mib=%zu total_mib=%zu alloc_us=%ld\n", (int)getpid(), count,
         mib, free_b >> 20, total_b >> 20, alloc_us);
  fflush(stdout);
  char line[16];
  if (fgets(line, sizeof line, stdin) == NULL) { /* EOF: release */ }
  check(cuMemFree_v2(ptr), "cuMemFree");
  printf("released\n");
  return 0;
}
