/* A CUDA runtime program without a GPU: linked with NVIDIA's real
 * libcudart.so.12 (CUDA 12.4, Debian trixie's libcudart12), run by
 * tests/nvidia_real.rs over NVIDIA's real driver alone and over the
 * interposer as libcuda.so.1 with the real driver beside it.
 *
 * The runtime has no header here; the prototypes are those of CUDA 12's
 * cuda_runtime_api.h (cudaError_t is an int-sized enum).
 *
 * Prints one "<call> <rc> <name> <string>" line per call, the device count,
 * and "done" when it got to the end (a crash or abort never prints it). */
#include <stddef.h>
#include <stdio.h>

int cudaRuntimeGetVersion(int *v);
int cudaDriverGetVersion(int *v);
int cudaGetDeviceCount(int *n);
int cudaMalloc(void **p, size_t size);
int cudaFree(void *p);
int cudaGetLastError(void);
const char *cudaGetErrorName(int e);
const char *cudaGetErrorString(int e);

static void report(const char *call, int rc) {
    const char *name = cudaGetErrorName(rc);
    const char *str = cudaGetErrorString(rc);
    printf("%s %d %s %s\n", call, rc, name ? name : "(null)", str ? str : "(null)");
}

int main(void) {
    int rt = -1, drv = -1, n = -1;
    report("cudaRuntimeGetVersion", cudaRuntimeGetVersion(&rt));
    printf("runtime %d\n", rt);
    report("cudaDriverGetVersion", cudaDriverGetVersion(&drv));
    printf("driver %d\n", drv);
    report("cudaGetDeviceCount", cudaGetDeviceCount(&n));
    printf("count %d\n", n);
    void *p = NULL;
    report("cudaMalloc", cudaMalloc(&p, 1 << 20));
    printf("pointer %s\n", p ? "set" : "null");
    report("cudaFree", cudaFree(p));
    report("cudaGetLastError", cudaGetLastError());
    printf("done\n");
    fflush(stdout);
    return 0;
}
