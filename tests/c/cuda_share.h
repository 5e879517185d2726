/* Sharing device memory between processes (CUDA IPC handles, VMM handles
 * exported as shareable handles) as the serving frameworks do: the driver
 * declarations ipc_pair.c and tp_serve.c share. Included as "cuda_share.h"
 * from tests/c, after "cuda_driver.h". */
#ifndef VCUDA_TESTS_CUDA_SHARE_H
#define VCUDA_TESTS_CUDA_SHARE_H

#include "cuda_driver.h"

typedef struct {
  char reserved[64];
} CUipcMemHandle;
typedef struct {
  struct {
    int type, id;
  } location;
  int flags;
} CUmemAccessDesc;

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr p);
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option);
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle h);
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr p, size_t size);
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr p, size_t size);
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                      unsigned long long flags);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type);

#endif
