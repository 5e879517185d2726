/* The driver API's statuses without a GPU: every entry point the
 * interposer wraps (cuda-shim/src: memory, contexts, modules, launches,
 * streams, graphs; NVML's memory and per-process views), called through
 * whatever libcuda.so.1 / libnvidia-ml.so.1 the library path gives, before
 * cuInit, after cuInit (which fails without a GPU) and after nvmlInit_v2
 * (which fails too). tests/nvidia_real.rs runs it over NVIDIA's real
 * driver alone and over the interposer with the real driver beside it:
 * the two must print the same lines. cuGetProcAddress is checked by
 * tests/nvidia_oracle.rs.
 *
 * No CUDA headers: the prototypes are cuda.h's and nvml.h's, with opaque
 * handles as void * and structs as zeroed buffers of their size or more.
 * Prints "<phase> <function> <status>" per call, then "done". */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef unsigned long long u64;
static void *cuda, *nvml;

/* The function `name` of the loaded library `lib`, or exit 2. */
static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        printf("missing %s\n", name);
        fflush(stdout);
        _exit(2);
    }
    return p;
}

#define CALL(phase, lib, name, type, ...)                                     \
    do {                                                                      \
        int rc_ = ((type)sym(lib, #name))(__VA_ARGS__);                       \
        printf("%s %s %d\n", phase, #name, rc_);                              \
        fflush(stdout);                                                       \
    } while (0)

typedef int (*f_p)(void *);
typedef int (*f_ps)(void *, size_t);
typedef int (*f_pp)(void *, void *);
typedef int (*f_ppi)(void *, void *, unsigned);
typedef int (*f_d)(u64);
typedef int (*f_i)(int);
typedef int (*f_v)(void);

static void driver_calls(const char *ph) {
    u64 dptr = 0, pitch = 0, a = 0, b = 0, handle = 0;
    unsigned int dptr32 = 0;
    void *h = NULL, *ctx = NULL, *mod = NULL, *graph = NULL, *exec = NULL;
    unsigned char desc2[64], desc[64], prop[64], config[128];
    memset(desc2, 0, sizeof desc2);
    memset(desc, 0, sizeof desc);
    memset(prop, 0, sizeof prop);
    memset(config, 0, sizeof config);
    /* CUDA_ARRAY_DESCRIPTOR: Width, Height, Format (FLOAT=0x20), NumChannels. */
    ((size_t *)desc2)[0] = 256;
    ((size_t *)desc2)[1] = 256;
    ((int *)desc2)[4] = 0x20;
    ((unsigned *)desc2)[5] = 1;
    /* CUDA_ARRAY3D_DESCRIPTOR: Width, Height, Depth, Format, NumChannels. */
    ((size_t *)desc)[0] = 256;
    ((size_t *)desc)[1] = 256;
    ((int *)desc)[6] = 0x20;
    ((unsigned *)desc)[7] = 1;
    /* CUmemAllocationProp: type PINNED, location DEVICE 0. */
    ((int *)prop)[0] = 1;
    ((int *)prop)[2] = 1;
    /* CUlaunchConfig: 1 block of 1 thread. */
    for (int i = 0; i < 6; i++) ((unsigned *)config)[i] = 1;

    CALL(ph, cuda, cuMemAlloc_v2, int (*)(u64 *, size_t), &dptr, 1 << 20);
    CALL(ph, cuda, cuMemAlloc, int (*)(unsigned *, unsigned), &dptr32, 1 << 20);
    CALL(ph, cuda, cuMemAllocPitch_v2, int (*)(u64 *, u64 *, size_t, size_t, unsigned), &dptr,
         &pitch, 1024, 1024, 4);
    CALL(ph, cuda, cuMemAllocManaged, int (*)(u64 *, size_t, unsigned), &dptr, 1 << 20, 1);
    CALL(ph, cuda, cuMemFree_v2, f_d, 0);
    CALL(ph, cuda, cuMemGetInfo_v2, f_pp, &a, &b);
    CALL(ph, cuda, cuDeviceTotalMem_v2, int (*)(u64 *, int), &a, 0);
    CALL(ph, cuda, cuArrayCreate_v2, f_pp, &h, desc2);
    CALL(ph, cuda, cuArray3DCreate_v2, f_pp, &h, desc);
    CALL(ph, cuda, cuArrayDestroy, f_p, NULL);
    CALL(ph, cuda, cuMipmappedArrayCreate, f_ppi, &h, desc, 1);
    CALL(ph, cuda, cuMipmappedArrayDestroy, f_p, NULL);
    CALL(ph, cuda, cuMemCreate, int (*)(u64 *, size_t, void *, u64), &handle, 1 << 21, prop, 0);
    CALL(ph, cuda, cuMemRelease, f_d, 0);
    CALL(ph, cuda, cuMemMap, int (*)(u64, size_t, size_t, u64, u64), 0, 1 << 21, 0, 0, 0);
    CALL(ph, cuda, cuMemUnmap, int (*)(u64, size_t), 0, 1 << 21);
    CALL(ph, cuda, cuMemAllocAsync, int (*)(u64 *, size_t, void *), &dptr, 1 << 20, NULL);
    CALL(ph, cuda, cuMemAllocFromPoolAsync, int (*)(u64 *, size_t, void *, void *), &dptr,
         1 << 20, NULL, NULL);
    CALL(ph, cuda, cuMemFreeAsync, int (*)(u64, void *), 0, NULL);
    CALL(ph, cuda, cuMemPoolTrimTo, f_ps, NULL, 0);
    CALL(ph, cuda, cuMemPoolSetAttribute, int (*)(void *, int, void *), NULL, 4, &a);
    CALL(ph, cuda, cuMemPoolDestroy, f_p, NULL);
    CALL(ph, cuda, cuCtxCreate_v2, int (*)(void **, unsigned, int), &ctx, 0, 0);
    CALL(ph, cuda, cuCtxDestroy_v2, f_p, NULL);
    CALL(ph, cuda, cuCtxSynchronize, f_v);
    CALL(ph, cuda, cuCtxSetLimit, int (*)(int, size_t), 2, 1 << 20);
    CALL(ph, cuda, cuDevicePrimaryCtxRetain, int (*)(void **, int), &ctx, 0);
    CALL(ph, cuda, cuDevicePrimaryCtxRelease_v2, f_i, 0);
    CALL(ph, cuda, cuDevicePrimaryCtxReset_v2, f_i, 0);
    CALL(ph, cuda, cuModuleLoad, int (*)(void **, const char *), &mod, "/nonexistent.cubin");
    CALL(ph, cuda, cuModuleLoadData, int (*)(void **, const void *), &mod, "not an image");
    CALL(ph, cuda, cuModuleUnload, f_p, NULL);
    CALL(ph, cuda, cuLaunchKernel,
         int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                 void *, void **, void **),
         NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    CALL(ph, cuda, cuLaunchKernelEx, int (*)(void *, void *, void **, void **), config, NULL,
         NULL, NULL);
    CALL(ph, cuda, cuLaunchCooperativeKernel,
         int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                 void *, void **),
         NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL);
    CALL(ph, cuda, cuStreamSynchronize, f_p, NULL);
    CALL(ph, cuda, cuEventSynchronize, f_p, NULL);
    CALL(ph, cuda, cuStreamBeginCapture_v2, int (*)(void *, int), NULL, 0);
    CALL(ph, cuda, cuStreamEndCapture, f_pp, NULL, &graph);
    CALL(ph, cuda, cuGraphInstantiateWithFlags, int (*)(void **, void *, u64), &exec, NULL, 0);
    CALL(ph, cuda, cuGraphLaunch, f_pp, NULL, NULL);
    CALL(ph, cuda, cuGraphExecDestroy, f_p, NULL);
    CALL(ph, cuda, cuDeviceGraphMemTrim, f_i, 0);
}

static void nvml_calls(const char *ph) {
    unsigned char buf[4096];
    unsigned int n = 0;
    memset(buf, 0, sizeof buf);
    /* nvmlMemory_v2_t's version: sizeof | 2 << 24. */
    *(unsigned *)buf = 40 | (2u << 24);
    CALL(ph, nvml, nvmlDeviceGetMemoryInfo_v2, f_pp, NULL, buf);
    CALL(ph, nvml, nvmlDeviceGetMemoryInfo, f_pp, NULL, buf);
    CALL(ph, nvml, nvmlDeviceGetComputeRunningProcesses_v3, int (*)(void *, unsigned *, void *),
         NULL, &n, buf);
    CALL(ph, nvml, nvmlDeviceGetGraphicsRunningProcesses_v3, int (*)(void *, unsigned *, void *),
         NULL, &n, buf);
    CALL(ph, nvml, nvmlDeviceGetProcessUtilization,
         int (*)(void *, void *, unsigned *, u64), NULL, buf, &n, 0);
    CALL(ph, nvml, nvmlDeviceGetAccountingPids, int (*)(void *, unsigned *, unsigned *), NULL,
         &n, (unsigned *)buf);
    CALL(ph, nvml, nvmlDeviceGetAccountingStats, int (*)(void *, unsigned, void *), NULL, 1, buf);
    CALL(ph, nvml, nvmlSystemGetProcessName, int (*)(unsigned, char *, unsigned), 1,
         (char *)buf, 64);
}

int main(void) {
    cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cuda || !nvml) {
        printf("dlopen: %s\n", dlerror());
        return 1;
    }
    driver_calls("uninitialized");
    CALL("init", cuda, cuInit, int (*)(unsigned), 0);
    driver_calls("after-cuInit");
    nvml_calls("uninitialized");
    CALL("init", nvml, nvmlInit_v2, f_v);
    nvml_calls("after-nvmlInit");
    printf("done\n");
    return 0;
}
