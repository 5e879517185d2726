// The kernel tests/c's programs launch as "busy" (qos_latency.c,
// shim_compute.c), for a GPU: every block spins 10 us of %globaltimer, so a
// kernel lasts 10 us a wave as on the simulator's GPUs (an H200 holds 1,056
// of these 256-thread blocks at once: 132 SMs x 8), whatever the clocks.
// Built by cases_qos.py: nvcc --fatbin -gencode arch=compute_XY,code=[sm_XY,compute_XY]
extern "C" __global__ void busy() {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < 10000ULL);
}
