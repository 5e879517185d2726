// A saturating CUDA workload for the compute-quota tests and benchmark:
// 1 ms kernels (86400 blocks of 256 threads: 100 waves of 10 us on the
// sim's A100) launched back to back on one stream, synchronising every few
// launches as real training loops do. Declarations by hand (no cuda.h).
//
// usage: shim_compute saturate SECONDS [SYNC_EVERY]
//        shim_compute fork SECONDS      (the child saturates; the parent waits)
//        shim_compute launchcost ROUNDS N SLEEP_MS
//          (median ns per cuLaunchKernel over ROUNDS bursts of N one-block
//          kernels, sleeping between bursts so a quota keeps tokens)
// Prints key=value words the tests parse: pid, launches, wall_ns, cpu_ns
// (user + system time of the whole process while saturating).
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;

CUresult cuInit(unsigned flags);
CUresult cuDeviceGet(CUdevice *d, int ordinal);
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev);
CUresult cuStreamCreate(CUstream *s, unsigned flags);
CUresult cuStreamSynchronize(CUstream s);
CUresult cuModuleLoadData(CUmodule *m, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, CUstream s, void **params, void **extra);

static void check(CUresult r, const char *what) {
  if (r != 0) {
    printf("error %s=%d\n", what, r);
    fflush(stdout);
    exit(1);
  }
}

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

static int saturate(double seconds, int sync_every) {
  CUdevice dev;
  CUcontext ctx;
  CUmodule m;
  CUfunction f;
  CUstream s;
  static const char image[] = "fake image";
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  check(cuModuleLoadData(&m, image), "cuModuleLoadData");
  check(cuModuleGetFunction(&f, m, "busy"), "cuModuleGetFunction");
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  printf("pid=%d start_ns=%lld\n", getpid(), now_ns());
  fflush(stdout);
  long long t0 = now_ns(), c0 = cpu_ns(), end = t0 + (long long)(seconds * 1e9);
  long long n = 0;
  while (now_ns() < end) {
    check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    if (++n % sync_every == 0) check(cuStreamSynchronize(s), "cuStreamSynchronize");
  }
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  printf("launches=%lld wall_ns=%lld cpu_ns=%lld\n", n, now_ns() - t0, cpu_ns() - c0);
  fflush(stdout);
  return 0;
}

static int cmp_ll(const void *a, const void *b) {
  long long x = *(const long long *)a, y = *(const long long *)b;
  return (x > y) - (x < y);
}

static int launchcost(int rounds, int n, int sleep_ms) {
  CUdevice dev;
  CUcontext ctx;
  CUmodule m;
  CUfunction f;
  CUstream s;
  static const char image[] = "fake image";
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
  check(cuModuleLoadData(&m, image), "cuModuleLoadData");
  check(cuModuleGetFunction(&f, m, "noop"), "cuModuleGetFunction");
  check(cuStreamCreate(&s, 0), "cuStreamCreate");
  long long *per = calloc(rounds, sizeof *per);
  for (int k = 0; k < rounds; k++) {
    long long a = now_ns();
    for (int i = 0; i < n; i++) cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
    per[k] = (now_ns() - a) * 1000 / n;
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    usleep(sleep_ms * 1000);
  }
  qsort(per, rounds, sizeof *per, cmp_ll);
  printf("launch_ps=%lld min_ps=%lld\n", per[rounds / 2], per[0]);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 3) {
    fprintf(stderr, "usage: shim_compute saturate|fork SECONDS [SYNC_EVERY]\n");
    return 2;
  }
  double seconds = atof(argv[2]);
  int sync_every = argc > 3 ? atoi(argv[3]) : 4;
  if (sync_every < 1) sync_every = 1;
  if (!strcmp(argv[1], "saturate")) return saturate(seconds, sync_every);
  if (!strcmp(argv[1], "launchcost") && argc > 4)
    return launchcost(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]));
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
    if (c == 0) _exit(saturate(seconds, sync_every));
    int st;
    waitpid(c, &st, 0);
    printf("child_status=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return 0;
  }
  return 2;
}
