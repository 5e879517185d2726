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
// Prints, per device ordinal D, `dN_KEY=VALUE` lines the test parses:
// bus (PCI bus id), ctx (the context call's result), total/free (the
// view after the context), filled (bytes allocated before the refusal),
// err (the refusal), free_full (the view when full).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_driver.h"

CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
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

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: multi_gpu alloc|vmm CHUNK_MIB\n");
    return 2;
  }
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
    cuCtxSetCurrent(ctx[d]);
    view(d, "full_");
  }
  fflush(stdout);
  return 0;
}
