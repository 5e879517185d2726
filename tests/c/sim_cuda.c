/* Drives the simulated libcuda through the plain driver API, as a CUDA
 * program linked with -lcuda does. One mode per test:
 *   info                 devices, attributes, memory info (key=value lines)
 *   roundtrip            alloc, HtoD, memset, DtoD, DtoH, compare, free
 *   oom                  allocations past the card fail with OUT_OF_MEMORY
 *   saturate MS          launches ~1 ms kernels back to back for MS ms, prints
 *                        "done", then waits for stdin (to stay listed)
 *   procaddr             cuGetProcAddress / _v2: versions, flags, statuses
 *   nosyscall N          N launches, in rounds of 1000 between getppid() markers
 *   init                 cuInit only; prints its result
 *   priority             ten 1 ms kernels on a low-priority stream, one on a
 *                        high one; prints when each stream's work ended
 * Declares the entry points it needs itself (the common ones in
 * cuda_driver.h): the driver ABI is stable C. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_driver.h"

typedef void *CUevent;
typedef unsigned long long cuuint64_t;

CUresult cuDriverGetVersion(int *v);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice dev);
CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice dev);
CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *id);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *ctx);
CUresult cuCtxSynchronize(void);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n);
CUresult cuStreamQuery(CUstream s);
CUresult cuEventCreate(CUevent *e, unsigned int flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventSynchronize(CUevent e);
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b);
CUresult cuStreamCreateWithPriority(CUstream *s, unsigned int flags, int priority);
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest);
CUresult cuGetErrorString(CUresult err, const char **s);
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status);
/* Any other export links and loads; it answers NOT_SUPPORTED. */
CUresult cuDestroyExternalMemory(void *ext);

static void check(CUresult r, const char *what) {
  if (r != 0) {
    const char *name = "?";
    cuGetErrorName(r, &name);
    printf("FAIL %s: %s (%d)\n", what, name, r);
    fflush(stdout);
    exit(1);
  }
}

static void expect(int cond, const char *what) {
  if (!cond) {
    printf("FAIL %s\n", what);
    fflush(stdout);
    exit(1);
  }
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static CUcontext setup(CUfunction *f) {
  CUdevice dev;
  CUcontext ctx;
  CUmodule m;
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  if (f) {
    static const char image[] = "fake cubin";
    check(cuModuleLoadData(&m, image), "cuModuleLoadData");
    check(cuModuleGetFunction(f, m, "busy"), "cuModuleGetFunction");
  }
  return ctx;
}

static int info(void) {
  int count = 0, version = 0;
  check(cuInit(0), "cuInit");
  check(cuDriverGetVersion(&version), "cuDriverGetVersion");
  check(cuDeviceGetCount(&count), "cuDeviceGetCount");
  printf("version=%d\ncount=%d\n", version, count);
  for (int i = 0; i < count; i++) {
    CUdevice dev;
    char name[96], bus[32];
    unsigned char u[16];
    size_t total;
    int sms, major, minor, back;
    check(cuDeviceGet(&dev, i), "cuDeviceGet");
    check(cuDeviceGetName(name, sizeof name, dev), "cuDeviceGetName");
    check(cuDeviceGetUuid_v2(u, dev), "cuDeviceGetUuid_v2");
    check(cuDeviceTotalMem_v2(&total, dev), "cuDeviceTotalMem");
    check(cuDeviceGetAttribute(&sms, 16, dev), "SM count");
    check(cuDeviceGetAttribute(&major, 75, dev), "CC major");
    check(cuDeviceGetAttribute(&minor, 76, dev), "CC minor");
    check(cuDeviceGetPCIBusId(bus, sizeof bus, dev), "cuDeviceGetPCIBusId");
    check(cuDeviceGetByPCIBusId(&back, bus), "cuDeviceGetByPCIBusId");
    expect(back == dev, "bus id round trip");
    printf("dev%d.name=%s\ndev%d.uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", i, name, i,
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    printf("dev%d.total_mib=%zu\ndev%d.sms=%d\ndev%d.cc=%d.%d\ndev%d.bus=%s\n", i, total >> 20, i, sms, i, major, minor,
           i, bus);
  }
  if (count > 0) {
    size_t free_b, total_b;
    setup(NULL);
    check(cuMemGetInfo_v2(&free_b, &total_b), "cuMemGetInfo");
    printf("free_mib=%zu\ntotal_mib=%zu\n", free_b >> 20, total_b >> 20);
  }
  expect(cuDestroyExternalMemory(NULL) == 801, "unimplemented export answers NOT_SUPPORTED");
  return 0;
}

static int roundtrip(void) {
  enum { N = 1 << 20 };
  CUdeviceptr a, b;
  unsigned int *host = malloc(N * 4), *back = malloc(N * 4);
  size_t free0, free1, total;
  setup(NULL);
  for (unsigned i = 0; i < N; i++) host[i] = i * 2654435761u;
  check(cuMemGetInfo_v2(&free0, &total), "cuMemGetInfo");
  check(cuMemAlloc_v2(&a, N * 4), "cuMemAlloc a");
  check(cuMemAlloc_v2(&b, N * 4), "cuMemAlloc b");
  check(cuMemGetInfo_v2(&free1, &total), "cuMemGetInfo");
  expect(free0 - free1 == 2 * N * 4, "allocations counted");
  check(cuMemcpyHtoD_v2(a, host, N * 4), "HtoD");
  check(cuMemcpyDtoD_v2(b, a, N * 4), "DtoD");
  check(cuMemcpyDtoH_v2(back, b, N * 4), "DtoH");
  expect(memcmp(host, back, N * 4) == 0, "round trip preserves bytes");
  check(cuMemsetD32_v2(a + 4, 0xdeadbeef, 2), "memset");
  check(cuMemcpyDtoH_v2(back, a, 16), "DtoH after memset");
  expect(back[0] == host[0] && back[1] == 0xdeadbeef && back[2] == 0xdeadbeef && back[3] == host[3], "memset");
  expect(cuMemcpyDtoH_v2(back, a + N * 4 - 8, 16) == 1, "copy past the allocation is INVALID_VALUE");
  check(cuMemFree_v2(a), "cuMemFree a");
  check(cuMemFree_v2(b), "cuMemFree b");
  expect(cuMemFree_v2(b) == 1, "double free is INVALID_VALUE");
  check(cuMemGetInfo_v2(&free1, &total), "cuMemGetInfo");
  expect(free1 == free0, "freed");
  printf("roundtrip ok (%d MiB)\n", (int)(2 * N * 4 >> 20));
  return 0;
}

static int oom(void) {
  CUdeviceptr a, b;
  size_t free_b, total;
  const char *name = "?", *str = "?";
  setup(NULL);
  check(cuMemGetInfo_v2(&free_b, &total), "cuMemGetInfo");
  CUresult r = cuMemAlloc_v2(&a, total + 1);
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &str);
  printf("past_card=%s (%s)\n", name, str);
  expect(r == 2, "allocating more than the card is OUT_OF_MEMORY");
  check(cuMemAlloc_v2(&a, free_b), "allocating all that is free");
  r = cuMemAlloc_v2(&b, 1);
  expect(r == 2, "full card: even 1 byte is OUT_OF_MEMORY");
  check(cuMemFree_v2(a), "cuMemFree");
  check(cuMemAlloc_v2(&b, 1), "after free");
  printf("oom ok\n");
  return 0;
}

static int saturate(int ms) {
  CUfunction f;
  CUstream s;
  long launches = 0;
  setup(&f);
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  printf("ready\n");
  fflush(stdout);
  double end = now_ms() + ms;
  /* 86400 blocks of 256 threads on 108 SMs x 8 blocks: 100 waves, 1 ms. */
  while (now_ms() < end) {
    for (int k = 0; k < 2; k++, launches++)
      check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
  }
  printf("done launches=%ld\n", launches);
  fflush(stdout);
  char line[16];
  if (fgets(line, sizeof line, stdin) == NULL) { /* EOF */ }
  return 0;
}

/* Stream priorities: ten 1 ms kernels queued on a stream of the least
 * priority, then one on a stream of the greatest. Prints when each
 * stream's work ended, in ms of device time after the first kernel was
 * queued (events): the raised kernel runs ahead of the queue. */
static int priority(void) {
  CUfunction f;
  CUstream lo, hi;
  CUevent start, hi_end, lo_end;
  int least = 1, greatest = 1;
  float hi_ms = -1, lo_ms = -1;
  setup(&f);
  check(cuCtxGetStreamPriorityRange(&least, &greatest), "cuCtxGetStreamPriorityRange");
  check(cuStreamCreateWithPriority(&lo, 0, least), "cuStreamCreateWithPriority");
  check(cuStreamCreateWithPriority(&hi, 0, greatest), "cuStreamCreateWithPriority");
  check(cuEventCreate(&start, 0), "cuEventCreate");
  check(cuEventCreate(&hi_end, 0), "cuEventCreate");
  check(cuEventCreate(&lo_end, 0), "cuEventCreate");
  check(cuEventRecord(start, lo), "cuEventRecord");
  for (int k = 0; k < 10; k++)
    check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, lo, NULL, NULL), "cuLaunchKernel");
  check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, hi, NULL, NULL), "cuLaunchKernel");
  check(cuEventRecord(hi_end, hi), "cuEventRecord");
  check(cuEventRecord(lo_end, lo), "cuEventRecord");
  check(cuEventSynchronize(lo_end), "cuEventSynchronize");
  check(cuEventSynchronize(hi_end), "cuEventSynchronize");
  check(cuEventElapsedTime(&hi_ms, start, hi_end), "cuEventElapsedTime");
  check(cuEventElapsedTime(&lo_ms, start, lo_end), "cuEventElapsedTime");
  printf("least=%d greatest=%d hi_ms=%.3f lo_ms=%.3f\n", least, greatest, hi_ms, lo_ms);
  return 0;
}

static void *sym(const char *name) {
  void *p = dlsym(RTLD_DEFAULT, name);
  if (!p) {
    printf("FAIL dlsym %s\n", name);
    exit(1);
  }
  return p;
}

/* What cuGetProcAddress hands out for the export `name`: like a real
 * driver, the sim answers with an internal entry point for most functions
 * (a distinct address that behaves the same), the export itself otherwise. */
static void *entry(const char *name) {
  void *(*internal)(const char *) = (void *(*)(const char *))sym("gpusim_cuda_internal_entry");
  void *p = internal(name);
  return p ? p : sym(name);
}

static void want(const char *base, int ver, cuuint64_t flags, const char *exported) {
  void *p = (void *)1;
  int status = -1;
  CUresult r = cuGetProcAddress_v2(base, &p, ver, flags, &status);
  if (r != 0 || status != 0 || p != entry(exported)) {
    printf("FAIL cuGetProcAddress_v2(%s, %d, %llu) = %d status %d, not %s\n", base, ver, flags, r, status, exported);
    exit(1);
  }
  printf("%s@%d/%llu -> %s\n", base, ver, flags, exported);
}

static int procaddr(void) {
  void *p;
  int status, version;
  CUresult r;
  /* Works before cuInit, as clients resolve everything first. */
  want("cuInit", 2000, 0, "cuInit");
  check(cuDriverGetVersion(&version), "cuDriverGetVersion");
  want("cuMemAlloc", 3020, 0, "cuMemAlloc_v2");
  want("cuMemAlloc", 2000, 0, "cuMemAlloc");
  want("cuCtxCreate", 3020, 0, "cuCtxCreate_v2");
  want("cuCtxCreate", 12050, 0, "cuCtxCreate_v4");
  want("cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2");
  want("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
  want("cuLaunchKernel", 4000, 0, "cuLaunchKernel");
  want("cuLaunchKernel", 7000, 2, "cuLaunchKernel_ptsz");
  want("cuLaunchKernel", 7000, 1, "cuLaunchKernel");
  want("cuMemcpyHtoD", 7000, 2, "cuMemcpyHtoD_v2_ptds");
  want("cuStreamSynchronize", 7000, 2, "cuStreamSynchronize_ptsz");
  want("cuMemAllocAsync", 11020, 2, "cuMemAllocAsync_ptsz");
  want("cuMemAlloc", 12000, 2, "cuMemAlloc_v2");

  /* As NVIDIA's 535 and 550 answer (crates/sim/gpu-sim-cuda/procaddr/, recorded
   * from them by tests/nvidia_oracle.rs): _v2 reports what it cannot hand
   * out through symbolStatus, with CUDA_SUCCESS and a NULL pointer. */
  p = (void *)1;
  status = -1;
  r = cuGetProcAddress_v2("cuNoSuchFunction", &p, 12000, 0, &status);
  expect(r == 0 && status == 1 && p == NULL, "unknown symbol: SUCCESS, SYMBOL_NOT_FOUND, NULL");
  p = (void *)1;
  r = cuGetProcAddress_v2("cuMemAllocAsync", &p, 11000, 0, &status);
  expect(r == 0 && status == 2 && p == NULL, "too old a version: VERSION_NOT_SUFFICIENT");
  p = (void *)1;
  r = cuGetProcAddress_v2("cuMemcpyHtoD", &p, 3020, 2, &status);
  expect(r == 0 && status == 2 && p == NULL, "per-thread below the _ptds variant's 7.0: VERSION_NOT_SUFFICIENT");
  p = (void *)1;
  r = cuGetProcAddress_v2("cuInit", &p, version + 10, 0, &status);
  expect(r == 0 && status == 0 && p == entry("cuInit"), "version newer than the driver: its newest");
  r = cuGetProcAddress_v2("cuInit", &p, 2000, 8, &status);
  expect(r == 1, "unknown flag bits: INVALID_VALUE");
  r = cuGetProcAddress_v2("cuInit", &p, 2000, 0, NULL);
  expect(r == 0 && p == entry("cuInit"), "NULL symbolStatus accepted");
  r = cuGetProcAddress("cuMemFree", &p, 3020, 0);
  expect(r == 0 && p == entry("cuMemFree_v2") && p != sym("cuMemFree_v2"),
         "11.3 cuGetProcAddress (an internal entry point, as real drivers do)");
  p = (void *)1;
  r = cuGetProcAddress("cuNoSuchFunction", &p, 3020, 0);
  expect(r == 500 && p == (void *)1, "11.3 cuGetProcAddress, unknown: NOT_FOUND, pointer untouched");

  /* The per-thread variant really runs on the per-thread default stream. */
  CUfunction f;
  typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               CUstream, void **, void **);
  typedef CUresult (*sync_t)(CUstream);
  launch_t launch;
  sync_t sync;
  setup(&f);
  check(cuGetProcAddress_v2("cuLaunchKernel", (void **)&launch, 7000, 2, NULL), "resolve launch");
  check(cuGetProcAddress_v2("cuStreamSynchronize", (void **)&sync, 7000, 2, NULL), "resolve sync");
  double t0 = now_ms();
  /* 100 waves = 1 ms, 20 times. */
  for (int i = 0; i < 20; i++) check(launch(f, 86400, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL), "ptsz launch");
  expect(cuStreamQuery((CUstream)1) == 0, "legacy stream idle: the work went to the per-thread stream");
  check(sync(NULL), "ptsz sync");
  double waited = now_ms() - t0;
  printf("ptsz waited_ms=%.1f\n", waited);
  expect(waited >= 19.0, "synchronising the per-thread stream waits for its kernels");
  printf("procaddr ok\n");
  return 0;
}

/* The launch path makes no system call while the context's launch queue
 * has room: N launches in rounds of 1000 (below the 1024 pending launches a
 * real GPU queues before the launch call blocks), each round between two
 * getppid() markers, the queue drained between rounds. */
static int nosyscall(long n) {
  CUfunction f;
  setup(&f);
  /* Warm up: thread-locals, lazily bound PLT entries. */
  check(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "warm-up launch");
  check(cuCtxSynchronize(), "warm-up sync");
  for (long done = 0; done < n;) {
    long round = n - done < 1000 ? n - done : 1000;
    getppid(); /* marker: start */
    for (long i = 0; i < round; i++) {
      CUresult r = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
      if (r) return 1;
    }
    getppid(); /* marker: end */
    done += round;
    check(cuCtxSynchronize(), "drain between rounds");
  }
  printf("launched %ld\n", n);
  return 0;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "info";
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!strcmp(mode, "info")) return info();
  if (!strcmp(mode, "roundtrip")) return roundtrip();
  if (!strcmp(mode, "oom")) return oom();
  if (!strcmp(mode, "saturate")) return saturate(argc > 2 ? atoi(argv[2]) : 1000);
  if (!strcmp(mode, "priority")) return priority();
  if (!strcmp(mode, "procaddr")) return procaddr();
  if (!strcmp(mode, "nosyscall")) return nosyscall(argc > 2 ? atol(argv[2]) : 100000);
  if (!strcmp(mode, "init")) {
    CUresult r = cuInit(0);
    const char *name = "?";
    cuGetErrorName(r, &name);
    printf("cuInit=%d %s\n", r, name);
    return 0;
  }
  fprintf(stderr, "unknown mode %s\n", mode);
  return 2;
}
