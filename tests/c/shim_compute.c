// A saturating CUDA workload for the compute-quota tests and benchmark:
// 1 ms kernels (86400 blocks of 256 threads: 100 waves of 10 us on the
// sim's A100) launched back to back on one stream, synchronising every few
// launches as real training loops do. Driver declarations: cuda_driver.h (via shim_common.h).
//
// usage: shim_compute saturate SECONDS [SYNC_EVERY]
//        shim_compute mixed SECONDS [SYNC_EVERY]
//          (two shapes: each 1 ms kernel is followed by five 0.1 ms kernels
//          of 34560 blocks of 32 threads -- 10 waves, the SM's 32-block
//          limit -- which take 1/10 of the time for 1/20 of the threads;
//          syncs every 6 launches by default)
//        shim_compute blockmix SECONDS [SYNC_EVERY]
//          (kernel sizes of a real program: each 10,000-block kernel -- 12
//          waves, 120 us -- is followed by four 1-block kernels of one wave,
//          10 us each; syncs every 10 launches by default)
//        shim_compute fork SECONDS      (the child saturates; the parent waits)
//        shim_compute tiny SECONDS
//          (rounds of 2000 one-thread kernels, a synchronize, 60 ms asleep:
//          ~25% busy on the sim's 10 us waves)
//        shim_compute first SECONDS
//          (1 ms kernels, 4 queued then a synchronize; prints first_ns, how
//          long the first launch call took, then saturates; exits 3 with
//          first_ns=timeout if that call has not returned in 30 s)
// Prints key=value words the tests parse: pid, launches, wall_ns, cpu_ns
// (user + system time of the whole process while saturating).
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shim_common.h"

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static long long cpu_ns(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1000000000LL +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1000LL;
}

// mixed 1: launch i is a 1 ms kernel when i % 6 == 0, else a 0.1 ms one;
// mixed 2 (blockmix): a 10,000-block kernel when i % 5 == 0, else 1 block.
// n0: launches already made (their count is included in the output).
static int saturate_from(CUfunction f, CUstream s, double seconds, int sync_every, int mixed,
                         long long n0) {
  long long t0 = now_ns(), c0 = cpu_ns(), end = t0 + (long long)(seconds * 1e9);
  long long n = n0;
  while (now_ns() < end) {
    if (mixed == 1 && n % 6 != 0)
      check(cuLaunchKernel(f, 34560, 1, 1, 32, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    else if (mixed == 2)
      check(cuLaunchKernel(f, n % 5 ? 1 : 10000, 1, 1, 256, 1, 1, 0, s, NULL, NULL),
            "cuLaunchKernel");
    else
      check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    if (++n % sync_every == 0) check(cuStreamSynchronize(s), "cuStreamSynchronize");
  }
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  printf("launches=%lld wall_ns=%lld cpu_ns=%lld\n", n, now_ns() - t0, cpu_ns() - c0);
  fflush(stdout);
  return 0;
}

static int saturate(double seconds, int sync_every, int mixed) {
  CUfunction f;
  CUstream s;
  setup_kernel("busy", &f, &s);
  printf("pid=%d start_ns=%lld\n", getpid(), now_ns());
  fflush(stdout);
  return saturate_from(f, s, seconds, sync_every, mixed, 0);
}

static int tiny(double seconds) {
  CUfunction f;
  CUstream s;
  setup_kernel("busy", &f, &s);
  printf("pid=%d start_ns=%lld\n", getpid(), now_ns());
  long long end = now_ns() + (long long)(seconds * 1e9), n = 0;
  struct timespec nap = {0, 60000000};
  while (now_ns() < end) {
    for (int i = 0; i < 2000; i++, n++)
      check(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    nanosleep(&nap, NULL);
  }
  printf("launches=%lld\n", n);
  return 0;
}

static void first_timeout(int sig) {
  (void)sig;
  static const char msg[] = "first_ns=timeout\n";
  if (write(1, msg, sizeof msg - 1)) {}
  _exit(3);
}

static int first(double seconds) {
  CUfunction f;
  CUstream s;
  setup_kernel("busy", &f, &s);
  printf("pid=%d start_ns=%lld\n", getpid(), now_ns());
  signal(SIGALRM, first_timeout);
  alarm(30);
  long long t0 = now_ns();
  check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
  printf("first_ns=%lld\n", now_ns() - t0);
  alarm(0);
  return saturate_from(f, s, seconds, 4, 0, 1);
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 3) {
    fprintf(stderr, "usage: shim_compute saturate|mixed|blockmix|fork|tiny|first SECONDS [SYNC_EVERY]\n");
    return 2;
  }
  double seconds = atof(argv[2]);
  int mixed = !strcmp(argv[1], "mixed") ? 1 : !strcmp(argv[1], "blockmix") ? 2 : 0;
  int sync_every = argc > 3 ? atoi(argv[3]) : mixed == 1 ? 6 : mixed == 2 ? 10 : 4;
  if (sync_every < 1) sync_every = 1;
  if (!strcmp(argv[1], "saturate") || mixed) return saturate(seconds, sync_every, mixed);
  if (!strcmp(argv[1], "tiny")) return tiny(seconds);
  if (!strcmp(argv[1], "first")) return first(seconds);
  if (!strcmp(argv[1], "fork")) {
    // The parent initialises (and so holds the controller lease) first.
    CUdevice dev;
    CUcontext ctx;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
    printf("parent_pid=%d\n", getpid());
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) _exit(saturate(seconds, sync_every, 0));
    int st;
    waitpid(c, &st, 0);
    printf("child_status=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return 0;
  }
  return 2;
}
