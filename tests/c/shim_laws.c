// Saturating workloads whose kernels declare their own timing laws to the
// simulator (a comment line per kernel in the module image, see
// crates/sim/gpu-sim-core/src/law.rs): the interposer prices a launch by its
// shape and never sees these laws, so its compute quota must learn what a
// launch really costs from NVML. For tests/shim_accuracy.rs and the
// accuracy_matrix bench. Driver declarations: cuda_driver.h.
//
// usage: shim_laws MIX SECONDS
//   uniform   one kernel shape; register-limited occupancy (2 blocks per SM
//             where the shape alone allows 8), a tail, 5 % jitter: 0.8 ms
//   blockmix  a 10,000-block GEMM (0.93 ms) then four 1-block reductions
//             that loop over a big array (0.15 ms each, 20 % jitter)
//   saturate  a memory-bound kernel at grids 108, 864, 3456 and 13824: the
//             three small ones are latency-bound (0.3 ms each, the price
//             says 1, 1 and 4 waves), the big one bandwidth-bound (1.2 ms)
//   graph     a captured graph of one of each of the above plus a gridless
//             kernel, replayed
//   gridless  a kernel whose time ignores its grid (0.4 ms, 30 % jitter)
//             launched with 1, 100, 10,000 and 100,000 blocks
//   phases    uniform for SECONDS / 2, then gridless (prints phase_ns=T at
//             the switch): the open-loop check's calibration and test mixes
//   burst     a fresh process that queues short 1-block kernels (50 us,
//             the price says 1 wave) as fast as it can and never waits
//             for them: the start-up check (the first launches, before the
//             quota's controller has any NVML sample)
//   burstlong the same with a kernel of one 0.4 ms wave (8 times what the
//             interposer assumes a wave takes before it has measured one)
// Prints `pid=N start_ns=T` when it starts launching, `launches=N` at exit.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim_common.h"

typedef void *CUgraph;
typedef void *CUgraphExec;
typedef void *CUevent;
CUresult cuEventCreate(CUevent *e, unsigned flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventSynchronize(CUevent e);
CUresult cuStreamBeginCapture_v2(CUstream s, int mode);
CUresult cuStreamEndCapture(CUstream s, CUgraph *g);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec e, CUstream s);

static const char image[] =
    ".version 8.0\n.target sm_80\n"
    "// gpu-sim kernel gemm waves block_ns=20000 regs=96 tail=0.3 noise=0.05\n"
    "// gpu-sim kernel reduce fixed ns=150000 noise=0.2\n"
    "// gpu-sim kernel stream bandwidth bytes_per_block=131072 gbps=1500 "
    "saturate_threads=884736 launch_ns=3000\n"
    "// gpu-sim kernel spin fixed ns=400000 noise=0.3\n"
    "// gpu-sim kernel tick fixed ns=50000 noise=0.1\n";

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static CUfunction gemm, reduce_, stream_, spin, tick;
static CUstream s;

static void launch(CUfunction f, unsigned grid, unsigned threads) {
  check(cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
}

// One round of a mix: about 2 to 4 ms of device time. Up to LOOKAHEAD
// rounds (16 to 32 ms) stay queued, as in training loops that wait on an
// event of an earlier step, so the device has work while the host wakes up:
// a workload that drains the queue at every sync cannot keep a device 90 %
// busy on a loaded 2-core host, and the gate would measure the host. With 3
// rounds, hard 90 % blockmix came 4.8 points short in one run of five while
// the other core ran the real-node suite.
#define LOOKAHEAD 8
static void round_of(const char *mix, CUgraphExec g) {
  static CUevent ev[LOOKAHEAD];
  static long long n;
  static const unsigned stream_grids[] = {108, 864, 3456, 13824};
  static const unsigned spin_grids[] = {1, 100, 10000, 100000};
  if (!strcmp(mix, "uniform")) {
    for (int i = 0; i < 4; i++) launch(gemm, 8640, 256);
  } else if (!strcmp(mix, "blockmix")) {
    for (int r = 0; r < 2; r++) {
      launch(gemm, 10000, 256);
      for (int i = 0; i < 4; i++) launch(reduce_, 1, 256);
    }
  } else if (!strcmp(mix, "saturate")) {
    for (int i = 0; i < 4; i++) launch(stream_, stream_grids[i], 256);
  } else if (!strcmp(mix, "graph")) {
    check(cuGraphLaunch(g, s), "cuGraphLaunch");
  } else {
    for (int i = 0; i < 8; i++) launch(spin, spin_grids[i % 4], 128);
  }
  if (!ev[0])
    for (int i = 0; i < LOOKAHEAD; i++) check(cuEventCreate(&ev[i], 0), "cuEventCreate");
  // The slot of round n - LOOKAHEAD + 1: wait for it, then record round n.
  int slot = n % LOOKAHEAD;
  check(cuEventRecord(ev[slot], s), "cuEventRecord");
  if (n >= LOOKAHEAD - 1) check(cuEventSynchronize(ev[(n + 1) % LOOKAHEAD]), "cuEventSynchronize");
  n++;
}

static CUgraphExec capture(void) {
  CUgraph g;
  CUgraphExec e;
  check(cuStreamBeginCapture_v2(s, 0), "cuStreamBeginCapture");
  launch(gemm, 8640, 256);
  launch(reduce_, 1, 256);
  launch(stream_, 864, 256);
  launch(stream_, 13824, 256);
  launch(spin, 50000, 128);
  check(cuStreamEndCapture(s, &g), "cuStreamEndCapture");
  check(cuGraphInstantiateWithFlags(&e, g, 0), "cuGraphInstantiate");
  return e;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 3) {
    fprintf(stderr, "usage: shim_laws uniform|blockmix|saturate|graph|gridless|phases|burst|burstlong SECONDS\n");
    return 2;
  }
  const char *mix = argv[1];
  double seconds = atof(argv[2]);
  CUdevice dev;
  CUcontext ctx;
  CUmodule m;
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  check(cuModuleLoadData(&m, image), "cuModuleLoadData");
  check(cuModuleGetFunction(&gemm, m, "gemm"), "cuModuleGetFunction");
  check(cuModuleGetFunction(&reduce_, m, "reduce"), "cuModuleGetFunction");
  check(cuModuleGetFunction(&stream_, m, "stream"), "cuModuleGetFunction");
  check(cuModuleGetFunction(&spin, m, "spin"), "cuModuleGetFunction");
  check(cuModuleGetFunction(&tick, m, "tick"), "cuModuleGetFunction");
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  CUgraphExec g = !strcmp(mix, "graph") ? capture() : NULL;
  long long t0 = now_ns(), end = t0 + (long long)(seconds * 1e9);
  long long phase = !strcmp(mix, "phases") ? t0 + (long long)(seconds * 0.5e9) : 0;
  printf("pid=%d start_ns=%lld\n", getpid(), t0);
  long long rounds = 0;
  int switched = 0;
  if (!strncmp(mix, "burst", 5)) {
    // No sync until the end: only the driver's launch queue and the
    // quota's bucket hold the launches back.
    // At most 6 s of device time in all (120,000 launches of 50 us):
    // unthrottled, a queue without bound would take that long to drain.
    int lng = !strcmp(mix, "burstlong");
    CUfunction k = lng ? spin : tick;
    long long cap = lng ? 15000 : 120000;
    while (now_ns() < end && rounds < cap) {
      launch(k, 1, 128);
      rounds++;
    }
    printf("launched_ns=%lld\n", now_ns());
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    printf("rounds=%lld\n", rounds);
    return 0;
  }
  while (now_ns() < end) {
    const char *now_mix = mix;
    if (phase) {
      if (!switched && now_ns() >= phase) {
        switched = 1;
        printf("phase_ns=%lld\n", now_ns());
      }
      now_mix = switched ? "gridless" : "uniform";
    }
    round_of(now_mix, g);
    rounds++;
  }
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  printf("rounds=%lld\n", rounds);
  return 0;
}
