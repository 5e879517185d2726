/* The few CUDA driver API entry points the demo workloads use, loaded the way
 * the CUDA runtime loads the driver: dlopen("libcuda.so.1") at run time, found
 * through LD_LIBRARY_PATH (/usr/local/nvidia/lib64 in a GPU container). In a
 * shared container that file is the vcuda interposer. The driver ABI is stable
 * C, so no CUDA headers are needed. */
#ifndef VCUDA_DEMO_CUDA_MIN_H
#define VCUDA_DEMO_CUDA_MIN_H

#include <dlfcn.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR 39

static struct {
  CUresult (*Init)(unsigned int);
  CUresult (*DeviceGetCount)(int *);
  CUresult (*DeviceGet)(CUdevice *, int);
  CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
  CUresult (*CtxCreate)(CUcontext *, unsigned int, CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*MemAlloc)(CUdeviceptr *, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemGetInfo)(size_t *, size_t *);
  CUresult (*ModuleLoadData)(CUmodule *, const void *);
  CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, CUstream, void **, void **);
  CUresult (*StreamCreate)(CUstream *, unsigned int);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*GetErrorName)(CUresult, const char **);
} cu;

static const char *cu_error_name(CUresult r) {
  const char *name = "CUDA_ERROR_UNKNOWN";
  if (cu.GetErrorName) cu.GetErrorName(r, &name);
  return name;
}

/* Exits with a line naming the call and the error. */
static void cu_check(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    printf("FAIL %s: %s (%d)\n", what, cu_error_name(r), r);
    fflush(stdout);
    exit(1);
  }
}

static void *cu_sym(void *lib, const char *name) {
  void *p = dlsym(lib, name);
  if (!p) {
    printf("FAIL dlsym %s: %s\n", name, dlerror());
    fflush(stdout);
    exit(1);
  }
  return p;
}

static void cu_load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    printf("FAIL dlopen libcuda.so.1: %s\n", dlerror());
    fflush(stdout);
    exit(1);
  }
  *(void **)&cu.Init = cu_sym(lib, "cuInit");
  *(void **)&cu.DeviceGetCount = cu_sym(lib, "cuDeviceGetCount");
  *(void **)&cu.DeviceGet = cu_sym(lib, "cuDeviceGet");
  *(void **)&cu.DeviceGetAttribute = cu_sym(lib, "cuDeviceGetAttribute");
  *(void **)&cu.CtxCreate = cu_sym(lib, "cuCtxCreate_v2");
  *(void **)&cu.CtxSetCurrent = cu_sym(lib, "cuCtxSetCurrent");
  *(void **)&cu.MemAlloc = cu_sym(lib, "cuMemAlloc_v2");
  *(void **)&cu.MemFree = cu_sym(lib, "cuMemFree_v2");
  *(void **)&cu.MemGetInfo = cu_sym(lib, "cuMemGetInfo_v2");
  *(void **)&cu.ModuleLoadData = cu_sym(lib, "cuModuleLoadData");
  *(void **)&cu.ModuleGetFunction = cu_sym(lib, "cuModuleGetFunction");
  *(void **)&cu.LaunchKernel = cu_sym(lib, "cuLaunchKernel");
  *(void **)&cu.StreamCreate = cu_sym(lib, "cuStreamCreate");
  *(void **)&cu.StreamSynchronize = cu_sym(lib, "cuStreamSynchronize");
  *(void **)&cu.GetErrorName = cu_sym(lib, "cuGetErrorName");
}

/* SIGTERM (docker stop, the demo's cleanup) and SIGINT end the workload
 * cleanly. A handler is needed anyway: as PID 1 of a container the default
 * action of SIGTERM would be ignored. */
static volatile sig_atomic_t cu_stop;

static void cu_on_signal(int sig) {
  (void)sig;
  cu_stop = 1;
}

static void cu_handle_signals(void) {
  struct sigaction sa = {0};
  sa.sa_handler = cu_on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
}

#endif
