/* What the interposer's C test programs (shim_client.c, shim_compute.c,
 * shim_graph.c, shim_memory.c) share: the driver declarations, the error
 * check whose `error WHAT=CODE` line the tests parse, and the set-up of a
 * context, a stream and a kernel of the sim's fake module. Included as
 * "shim_common.h" from tests/c. */
#ifndef VCUDA_TESTS_SHIM_COMMON_H
#define VCUDA_TESTS_SHIM_COMMON_H

#include <stdio.h>
#include <stdlib.h>

#include "cuda_driver.h"

/* Prints `error WHAT=CODE` and exits 1 when `r` is not CUDA_SUCCESS. */
static inline void check(CUresult r, const char *what) {
  if (r != 0) {
    printf("error %s=%d\n", what, r);
    fflush(stdout);
    exit(1);
  }
}

/* A context on device 0, a stream, and the fake module's kernel `name`. */
static inline void setup_kernel(const char *name, CUfunction *f, CUstream *s) {
  CUdevice dev;
  CUcontext ctx;
  CUmodule m;
  static const char image[] = "fake image";
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  check(cuModuleLoadData(&m, image), "cuModuleLoadData");
  check(cuModuleGetFunction(f, m, name), "cuModuleGetFunction");
  check(cuStreamCreate(s, 0), "cuStreamCreate");
}

#endif
