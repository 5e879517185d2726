/* The CUDA driver API declarations the C test programs share (no cuda.h
 * here: the driver ABI is stable C). Programs link with -lcuda and call the
 * versioned names cuda.h's macros map to; each declares what else it needs
 * next to its own code. Included as "cuda_driver.h" from tests/c. */
#ifndef VCUDA_TESTS_CUDA_DRIVER_H
#define VCUDA_TESTS_CUDA_DRIVER_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

/* Memory pools and VMM handles (shim_client.c, shim_memory.c). */
typedef void *CUmemoryPool;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
  int type, requestedHandleTypes;
  struct {
    int type, id;
  } location;
  void *win32HandleMetaData;
  unsigned char allocFlags[8];
} CUmemAllocationProp;

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDeviceGetCount(int *count);
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev);
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr ptr);
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
CUresult cuModuleLoadData(CUmodule *m, const void *image);
CUresult cuModuleUnload(CUmodule m);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream s, void **params, void **extra);
CUresult cuStreamCreate(CUstream *s, unsigned int flags);
CUresult cuStreamSynchronize(CUstream s);
CUresult cuGetErrorName(CUresult err, const char **name);

#endif
