/* What the interposer's C test programs (shim_client.c, shim_compute.c,
 * shim_graph.c, shim_memory.c) share: the driver declarations, the error
 * check whose `error WHAT=CODE` line the tests parse, and the set-up of a
 * context, a stream and a kernel of the sim's fake module (or, on a GPU, of
 * the fatbin VCUDA_TEST_MODULE names). Included as
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

/* The module image: the file VCUDA_TEST_MODULE names (a fatbin, on a GPU:
 * tests/gpu/workers/busy.cu), else the sim's fake one (any bytes). */
static inline const void *module_image(void) {
  static const char fake[] = "fake image";
  const char *path = getenv("VCUDA_TEST_MODULE");
  if (!path || !*path) return fake;
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    printf("error VCUDA_TEST_MODULE=%s unreadable\n", path);
    exit(1);
  }
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  char *buf = malloc(n > 0 ? (size_t)n : 1);
  if (!buf || n <= 0 || fread(buf, 1, (size_t)n, fp) != (size_t)n) {
    printf("error VCUDA_TEST_MODULE=%s short read\n", path);
    exit(1);
  }
  fclose(fp);
  return buf;
}

/* A context on device 0, a stream, and the module's kernel `name`. */
static inline void setup_kernel(const char *name, CUfunction *f, CUstream *s) {
  CUdevice dev;
  CUcontext ctx;
  CUmodule m;
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  check(cuModuleLoadData(&m, module_image()), "cuModuleLoadData");
  check(cuModuleGetFunction(f, m, name), "cuModuleGetFunction");
  check(cuStreamCreate(s, 0), "cuStreamCreate");
}

#endif
