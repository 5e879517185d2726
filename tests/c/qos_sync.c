// A latency-tier tenant on two GPUs, one step at a time, for a test that
// reads the GPUs' QoS pages between steps (which page a synchronize or
// query clears: crates/node/dra-driver/tests/sim_shares.rs). After each
// step it prints `step=NAME` and waits for a line on stdin.
// Driver declarations: cuda_driver.h (via shim_common.h).
//
// usage: qos_sync BLOCKS
//   launched  a kernel on device 0's stream and one on device 1's
//   ctx0      cuCtxSynchronize, device 0's context current
//   stream1   cuStreamSynchronize of device 1's stream, device 0's current
//   query0    a kernel on each device again; cuStreamQuery of device 0's
//             stream until done, device 1's context current
//   ctx1      cuCtxSynchronize, device 1's context current
//   one-of-two  kernels on two streams of device 0; cuStreamSynchronize
//             of the first
//   both      cuStreamQuery of the second until done
//   event-one-of-two  kernels on both streams of device 0; an event
//             recorded on the first, cuEventSynchronize
//   event-before-a-launch  the second synchronised; a kernel on the
//             first, the event recorded, another kernel, cuEventSynchronize
//   event-after-all  the event recorded again; cuEventQuery until done
#include <stdio.h>
#include <stdlib.h>

#include "shim_common.h"

CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuStreamQuery(CUstream s);
typedef void *CUevent;
CUresult cuEventCreate(CUevent *e, unsigned flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventSynchronize(CUevent e);
CUresult cuEventQuery(CUevent e);

static void step(const char *name) {
  char line[16];
  printf("step=%s\n", name);
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin)) exit(0);
}

int main(int argc, char **argv) {
  if (argc != 2 || atoi(argv[1]) < 1) {
    fprintf(stderr, "usage: qos_sync BLOCKS (>= 1)\n");
    return 2;
  }
  unsigned blocks = (unsigned)atoi(argv[1]);
  CUcontext ctx[2];
  CUfunction f[2];
  CUstream s[2], s0b;
  check(cuInit(0), "cuInit");
  for (int d = 0; d < 2; d++) {
    CUdevice dev;
    CUmodule m;
    check(cuDeviceGet(&dev, d), "cuDeviceGet");
    check(cuCtxCreate_v2(&ctx[d], 0, dev), "cuCtxCreate");
    check(cuModuleLoadData(&m, module_image()), "cuModuleLoadData");
    check(cuModuleGetFunction(&f[d], m, "busy"), "cuModuleGetFunction");
    check(cuStreamCreate(&s[d], 0), "cuStreamCreate");
  }
  for (int round = 0; round < 2; round++) {
    for (int d = 0; d < 2; d++) {
      check(cuCtxSetCurrent(ctx[d]), "cuCtxSetCurrent");
      check(cuLaunchKernel(f[d], blocks, 1, 1, 256, 1, 1, 0, s[d], NULL, NULL), "cuLaunchKernel");
    }
    if (round == 0) {
      step("launched");
      check(cuCtxSetCurrent(ctx[0]), "cuCtxSetCurrent");
      check(cuCtxSynchronize(), "cuCtxSynchronize");
      step("ctx0");
      check(cuStreamSynchronize(s[1]), "cuStreamSynchronize");
      step("stream1");
    } else {
      CUresult r;
      while ((r = cuStreamQuery(s[0])) == 600 /* CUDA_ERROR_NOT_READY */) {
      }
      check(r, "cuStreamQuery");
      step("query0");
      check(cuCtxSynchronize(), "cuCtxSynchronize");
      step("ctx1");
    }
  }
  check(cuCtxSetCurrent(ctx[0]), "cuCtxSetCurrent");
  check(cuStreamCreate(&s0b, 0), "cuStreamCreate");
  check(cuLaunchKernel(f[0], blocks, 1, 1, 256, 1, 1, 0, s[0], NULL, NULL), "cuLaunchKernel");
  check(cuLaunchKernel(f[0], blocks, 1, 1, 256, 1, 1, 0, s0b, NULL, NULL), "cuLaunchKernel");
  check(cuStreamSynchronize(s[0]), "cuStreamSynchronize");
  step("one-of-two");
  CUresult r;
  while ((r = cuStreamQuery(s0b)) == 600 /* CUDA_ERROR_NOT_READY */) {
  }
  check(r, "cuStreamQuery");
  step("both");
  // An event says done its stream's work up to its record, nothing else.
  CUevent ev;
  check(cuEventCreate(&ev, 0), "cuEventCreate");
  check(cuLaunchKernel(f[0], blocks, 1, 1, 256, 1, 1, 0, s[0], NULL, NULL), "cuLaunchKernel");
  check(cuLaunchKernel(f[0], blocks, 1, 1, 256, 1, 1, 0, s0b, NULL, NULL), "cuLaunchKernel");
  check(cuEventRecord(ev, s[0]), "cuEventRecord");
  check(cuEventSynchronize(ev), "cuEventSynchronize");
  step("event-one-of-two");
  check(cuStreamSynchronize(s0b), "cuStreamSynchronize");
  check(cuLaunchKernel(f[0], blocks, 1, 1, 256, 1, 1, 0, s[0], NULL, NULL), "cuLaunchKernel");
  check(cuEventRecord(ev, s[0]), "cuEventRecord");
  check(cuLaunchKernel(f[0], blocks, 1, 1, 256, 1, 1, 0, s[0], NULL, NULL), "cuLaunchKernel");
  check(cuEventSynchronize(ev), "cuEventSynchronize");
  step("event-before-a-launch");
  check(cuEventRecord(ev, s[0]), "cuEventRecord");
  while ((r = cuEventQuery(ev)) == 600 /* CUDA_ERROR_NOT_READY */) {
  }
  check(r, "cuEventQuery");
  step("event-after-all");
  return 0;
}
