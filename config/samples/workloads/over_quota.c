/* over_quota [STEP_MIB]
 *
 * Allocates device memory STEP_MIB at a time until the driver refuses, as a
 * framework growing its memory pool would. Under the vcuda interposer the
 * refusal (CUDA_ERROR_OUT_OF_MEMORY) comes at the container's quota, far
 * below the card's size, and cuMemGetInfo reports the quota as the total.
 *
 * Prints "visible total_mib=T free_mib=F", one "allocated" line per step,
 * then "refused at_mib=A request_mib=R error=NAME" and "ready", and holds
 * what it got until SIGTERM. */
#include "cuda_min.h"
#include <unistd.h>

#define MAX_STEPS 256

int main(int argc, char **argv) {
  size_t step_mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 256;
  CUdevice dev;
  CUcontext ctx;
  CUdeviceptr ptr[MAX_STEPS];
  size_t free_b = 0, total_b = 0, held_mib = 0;
  int n = 0;

  cu_handle_signals();
  cu_load();
  cu_check(cu.Init(0), "cuInit");
  cu_check(cu.DeviceGet(&dev, 0), "cuDeviceGet");
  cu_check(cu.CtxCreate(&ctx, 0, dev), "cuCtxCreate");
  cu_check(cu.MemGetInfo(&free_b, &total_b), "cuMemGetInfo");
  printf("visible total_mib=%zu free_mib=%zu\n", total_b >> 20, free_b >> 20);
  for (;;) {
    if (n == MAX_STEPS) {
      printf("never refused after %zu MiB\n", held_mib);
      break;
    }
    CUresult r = cu.MemAlloc(&ptr[n], step_mib << 20);
    if (r != CUDA_SUCCESS) {
      printf("refused at_mib=%zu request_mib=%zu error=%s code=%d\n", held_mib, step_mib,
             cu_error_name(r), r);
      break;
    }
    n++;
    held_mib += step_mib;
    printf("allocated step=%d total_mib=%zu\n", n, held_mib);
  }
  printf("ready holding_mib=%zu\n", held_mib);
  fflush(stdout);
  while (!cu_stop) usleep(100000); /* no pause(): a signal before it would be missed */
  for (int i = 0; i < n; i++) cu_check(cu.MemFree(ptr[i]), "cuMemFree");
  printf("done released_mib=%zu\n", held_mib);
  return 0;
}
