// Memory nobody asks for by size, through the interposer: contexts, pools
// that keep freed memory, host VMM handles, handles released while mapped,
// context resets, the device heap and module images.
//
// usage: shim_memory MODE [ARGS]; prints key=value lines the tests parse.
// Sizes are in MiB.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shim_common.h"

typedef struct {
  struct {
    int type, id;
  } location;
  unsigned long long flags;
} CUmemAccessDesc;

CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxSetLimit(int limit, size_t value);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep);
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s);
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *p,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle h);
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr p, size_t n);
CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr p, size_t n);
CUresult cuModuleUnload(CUmodule m);

#define MIB (1024ULL * 1024ULL)
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define RELEASE_THRESHOLD 4
#define RESERVED_MEM_CURRENT 5

static CUdevice dev;

static CUcontext setup(void) {
  CUcontext ctx;
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  return ctx;
}

static size_t free_now(void) {
  size_t f = 0, t = 0;
  check(cuMemGetInfo_v2(&f, &t), "cuMemGetInfo");
  return f;
}

// Allocates `chunk` until refused, holds it all until stdin closes.
static int mode_fill(size_t chunk) {
  setup();
  static CUdeviceptr p[4096];
  int n = 0;
  CUresult r;
  while (n < 4096 && (r = cuMemAlloc_v2(&p[n], chunk)) == 0) n++;
  printf("pid=%d allocated=%d last=%d free=%zu\n", getpid(), n, r, free_now());
  fflush(stdout);
  char buf[16];
  while (fgets(buf, sizeof buf, stdin)) {
  }
  return 0;
}

// The default pool with a release threshold of `keep`: a freed `chunk`
// stays in the pool through a synchronisation, so a plain allocation of
// `chunk` does not fit; a trim gives it back.
static int mode_pool(size_t keep, size_t chunk) {
  setup();
  CUstream s;
  CUmemoryPool pool;
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  check(cuDeviceGetDefaultMemPool(&pool, dev), "cuDeviceGetDefaultMemPool");
  unsigned long long threshold = keep;
  check(cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, &threshold), "set threshold");
  size_t f0 = free_now();
  CUdeviceptr a, b;
  check(cuMemAllocAsync(&a, chunk, s), "cuMemAllocAsync");
  check(cuMemFreeAsync(a, s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  unsigned long long reserved = 0;
  check(cuMemPoolGetAttribute(pool, RESERVED_MEM_CURRENT, &reserved), "get reserved");
  printf("kept_by_pool=%llu charged_while_kept=%zu\n", reserved, f0 - free_now());
  CUresult r = cuMemAlloc_v2(&b, chunk);
  printf("plain_while_kept=%d\n", r);
  if (r == 0) check(cuMemFree_v2(b), "cuMemFree");
  // The pool reuses what it keeps: no new charge.
  check(cuMemAllocAsync(&a, chunk, s), "cuMemAllocAsync again");
  printf("charged_reused=%zu\n", f0 - free_now());
  check(cuMemFreeAsync(a, s), "cuMemFreeAsync again");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  check(cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo");
  printf("charged_after_trim=%zu\n", f0 - free_now());
  r = cuMemAlloc_v2(&b, chunk);
  printf("plain_after_trim=%d\n", r);
  return 0;
}

static CUmemAllocationProp prop(int location_type) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = 1;  // CU_MEM_ALLOCATION_TYPE_PINNED
  p.location.type = location_type;
  p.location.id = 0;
  return p;
}

// A host-located cuMemCreate of `n` takes no device memory.
static int mode_vmmhost(size_t n) {
  setup();
  size_t f0 = free_now();
  CUmemAllocationProp p = prop(2);  // CU_MEM_LOCATION_TYPE_HOST
  CUmemGenericAllocationHandle h;
  CUresult r = cuMemCreate(&h, n, &p, 0);
  printf("host_create=%d host_charged=%zu\n", r, f0 - free_now());
  if (r == 0) check(cuMemRelease(h), "cuMemRelease");
  return 0;
}

// A device handle of `n` released while mapped keeps its bytes until the
// unmap.
static int mode_mapped(size_t n) {
  setup();
  size_t f0 = free_now();
  CUmemAllocationProp p = prop(1);
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  check(cuMemCreate(&h, n, &p, 0), "cuMemCreate");
  check(cuMemAddressReserve(&va, n, 0, 0, 0), "cuMemAddressReserve");
  check(cuMemMap(va, n, 0, h, 0), "cuMemMap");
  check(cuMemRelease(h), "cuMemRelease");
  printf("charged_after_release=%zu\n", f0 - free_now());
  check(cuMemUnmap(va, n), "cuMemUnmap");
  printf("charged_after_unmap=%zu\n", f0 - free_now());
  check(cuMemAddressFree(va, n), "cuMemAddressFree");
  return 0;
}

// Allocations in a destroyed context and in a reset primary context come
// back; an address the driver hands out again is not counted twice.
static int mode_reset(size_t chunk) {
  CUcontext own = setup();
  size_t f0 = free_now();
  CUdeviceptr a, b;
  check(cuMemAlloc_v2(&a, chunk), "cuMemAlloc in own");
  CUcontext primary;
  check(cuDevicePrimaryCtxRetain(&primary, dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
  size_t f1 = free_now();
  check(cuMemAlloc_v2(&b, chunk), "cuMemAlloc in primary");
  check(cuMemAlloc_v2(&b, chunk), "cuMemAlloc in primary");
  check(cuDevicePrimaryCtxReset_v2(dev), "cuDevicePrimaryCtxReset");
  printf("primary_kept_after_reset=%zd\n", (ssize_t)(f1 - free_now()));
  // Still retained: usable again; the sim hands out the addresses again.
  check(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
  check(cuMemAlloc_v2(&b, chunk), "cuMemAlloc after reset");
  printf("charged_after_realloc=%zd\n", (ssize_t)(f1 - free_now()));
  check(cuMemFree_v2(b), "cuMemFree after reset");
  printf("charged_after_free=%zd\n", (ssize_t)(f1 - free_now()));
  check(cuDevicePrimaryCtxRelease_v2(dev), "cuDevicePrimaryCtxRelease");
  check(cuCtxSetCurrent(own), "cuCtxSetCurrent own");
  check(cuCtxDestroy_v2(own), "cuCtxDestroy");
  // No context left: view the quota from a fresh one.
  CUcontext again;
  check(cuCtxCreate_v2(&again, 0, dev), "cuCtxCreate again");
  printf("own_kept_after_destroy=%zd\n", (ssize_t)(f0 - free_now()));
  return 0;
}

// The device heap: a `big` heap does not fit, a `small` one is charged.
static int mode_heap(size_t big, size_t small) {
  setup();
  size_t f0 = free_now();
  printf("heap_big=%d\n", cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, big));
  printf("heap_small=%d\n", cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, small));
  printf("heap_charged=%zd\n", (ssize_t)(f0 - free_now()));
  return 0;
}

// A module image (a fatbinary header saying `n` bytes) is charged while
// loaded.
static int mode_module(size_t n) {
  setup();
  size_t f0 = free_now();
  static unsigned char fatbin[16];
  unsigned magic = 0xba55ed50u;
  unsigned short header = 16;
  unsigned long long size = n - 16;
  memcpy(fatbin, &magic, 4);
  memcpy(fatbin + 6, &header, 2);
  memcpy(fatbin + 8, &size, 8);
  CUmodule m;
  CUresult r = cuModuleLoadData(&m, fatbin);
  printf("module_load=%d module_charged=%zd\n", r, (ssize_t)(f0 - free_now()));
  if (r == 0) {
    check(cuModuleUnload(m), "cuModuleUnload");
    printf("module_after_unload=%zd\n", (ssize_t)(f0 - free_now()));
  }
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) return 2;
  const char *m = argv[1];
  size_t a = (argc > 2 ? strtoull(argv[2], NULL, 10) : 64) * MIB;
  size_t b = (argc > 3 ? strtoull(argv[3], NULL, 10) : 64) * MIB;
  if (!strcmp(m, "fill")) return mode_fill(a);
  if (!strcmp(m, "pool")) return mode_pool(a, b);
  if (!strcmp(m, "vmmhost")) return mode_vmmhost(a);
  if (!strcmp(m, "mapped")) return mode_mapped(a);
  if (!strcmp(m, "reset")) return mode_reset(a);
  if (!strcmp(m, "heap")) return mode_heap(a, b);
  if (!strcmp(m, "module")) return mode_module(a);
  return 2;
}
