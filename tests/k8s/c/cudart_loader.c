/* A CUDA program that reaches the driver the way the CUDA runtime (cudart)
 * does: never linked with -lcuda; dlopen("libcuda.so.1"), one dlsym of
 * cuGetProcAddress_v2, and every other entry point through it at the
 * runtime's CUDA version. Run in a pod of the real-node suite
 * (tests/k8s_node/main.rs): prints key=value words.
 *
 * usage: cudart_loader CHUNK_MIB
 *   total= device_total= free=  what the card looks like (the quota for a share)
 *   allocated=N last=R          cuMemAlloc of CHUNK_MIB until refused (R=2: OOM)
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long, int *);

#define MIB (1024ULL * 1024ULL)
#define CUDA_VERSION 12040

static gpa_t gpa;

static void *get(const char *name) {
  void *p = NULL;
  int status = -1;
  CUresult r = gpa(name, &p, CUDA_VERSION, 0, &status);
  if (r != 0 || p == NULL) {
    printf("error getprocaddress_%s=%d status=%d\n", name, r, status);
    exit(1);
  }
  return p;
}

static void check(CUresult r, const char *what) {
  if (r != 0) {
    printf("error %s=%d\n", what, r);
    exit(1);
  }
}

int main(int argc, char **argv) {
  size_t chunk = (argc > 1 ? strtoull(argv[1], NULL, 10) : 256) * MIB;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    printf("error dlopen=%s\n", dlerror());
    return 1;
  }
  gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
  if (!gpa) {
    printf("error dlsym_cuGetProcAddress_v2\n");
    return 1;
  }
  CUresult (*init)(unsigned) = get("cuInit");
  CUresult (*device_get)(CUdevice *, int) = get("cuDeviceGet");
  CUresult (*total_mem)(size_t *, CUdevice) = get("cuDeviceTotalMem");
  /* cudart's context: the primary one (cuCtxCreate at 12.x is _v3/_v4). */
  CUresult (*retain)(CUcontext *, CUdevice) = get("cuDevicePrimaryCtxRetain");
  CUresult (*set_current)(CUcontext) = get("cuCtxSetCurrent");
  CUresult (*mem_info)(size_t *, size_t *) = get("cuMemGetInfo");
  CUresult (*mem_alloc)(CUdeviceptr *, size_t) = get("cuMemAlloc");
  CUresult (*mem_free)(CUdeviceptr) = get("cuMemFree");

  CUdevice dev;
  CUcontext ctx;
  check(init(0), "cuInit");
  check(device_get(&dev, 0), "cuDeviceGet");
  check(retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(set_current(ctx), "cuCtxSetCurrent");
  size_t dt = 0, f = 0, t = 0;
  check(total_mem(&dt, dev), "cuDeviceTotalMem");
  check(mem_info(&f, &t), "cuMemGetInfo");
  printf("total=%zu device_total=%zu free=%zu\n", t, dt, f);
  static CUdeviceptr held[4096];
  int n = 0;
  CUresult last = 0;
  while (n < 4096 && (last = mem_alloc(&held[n], chunk)) == 0) n++;
  for (int i = 0; i < n; i++) mem_free(held[i]);
  printf("allocated=%d last=%d\n", n, last);
  fflush(stdout);
  return 0;
}
