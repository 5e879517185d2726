// Spin kernel for the kernel-mix case: every block spins for `ns`
// nanoseconds of %globaltimer, so a kernel's device time is set by its launch
// shape (1 block: ns; 10,000 blocks: ns x waves) whatever the GPU's clocks.
// Built by cases_compute.py: nvcc --fatbin -gencode arch=compute_XY,code=[sm_XY,compute_XY]
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
