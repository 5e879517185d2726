/* Driver-facing entry points of the interposer, as real programs reach them
 * (tests/shim_entry.rs). Prints key=value pairs on one line per mode.
 *
 *   procaddr MIB    allocate MIB-sized chunks through cuMemAlloc obtained from
 *                   cuGetProcAddress_v2 / cuGetProcAddress until refused;
 *                   which pointers came back as the interposer's exports;
 *                   the driver's NOT_FOUND statuses passed through
 *   exports         dlopen libnvidia-ml.so.1 / libcuda.so.1 as nvidia-smi and
 *                   cuda-gdb do: nvmlInternalGetExportTable, cudbg* functions
 *   sigpipe N       N children (default SIGPIPE disposition) call cuInit
 *                   while the manager closes every connection; how many died
 *                   of SIGPIPE
 *   nvmlonly        nvmlInit + memory info + process list, never cuInit
 *   tenants PID     every per-process NVML query: which PIDs each lists, and
 *                   accounting stats / process name of PID (another tenant)
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_driver.h"

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags);
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status);

#define MIB (1ull << 20)

typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*free_t)(CUdeviceptr);

/* The interposer's own export of `name` (what a substituted pointer is). */
static void *exported(const char *name) { return dlsym(RTLD_DEFAULT, name); }

static int mode_procaddr(size_t chunk) {
  void *p = NULL;
  int st = -1;
  CUresult r = cuGetProcAddress_v2("cuMemAlloc", &p, 12000, 0, &st);
  alloc_t alloc = (alloc_t)p;
  printf("gpa_r=%d gpa_status=%d alloc_is_export=%d ", r, st, p != NULL && p == exported("cuMemAlloc_v2"));
  void *f = NULL;
  r = cuGetProcAddress("cuMemFree", &f, 3020, 0);
  printf("v1_r=%d free_is_export=%d ", r, f != NULL && f == exported("cuMemFree_v2"));
  void *l = NULL;
  r = cuGetProcAddress_v2("cuLaunchKernel", &l, 12000, 2, &st);
  printf("launch_ptsz_is_export=%d ", r == 0 && l == exported("cuLaunchKernel_ptsz"));
  void *g = NULL;
  r = cuGetProcAddress_v2("cuGetProcAddress", &g, 12000, 0, &st);
  printf("gpa_is_export=%d ", r == 0 && g == exported("cuGetProcAddress_v2"));
  /* The driver's own refusals come back unchanged. */
  void *q = (void *)1;
  st = -1;
  r = cuGetProcAddress_v2("cuNoSuchFunction", &q, 12000, 0, &st);
  printf("unknown_r=%d unknown_status=%d unknown_null=%d ", r, st, q == NULL);
  q = (void *)1;
  st = -1;
  r = cuGetProcAddress_v2("cuMemAllocAsync", &q, 11000, 0, &st);
  printf("old_r=%d old_status=%d ", r, st);
  /* What a lookup costs (cuda-bindings makes ~500 at import). */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < 100000; i++) cuGetProcAddress_v2("cuMemAlloc", &q, 12000, 0, &st);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("gpa_ns=%.1f ", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / 100000.0);
  if (!alloc || !f) {
    printf("allocated=0 last=-1\n");
    return 0;
  }
  CUdevice dev;
  CUcontext ctx;
  if (cuInit(0) || cuDeviceGet(&dev, 0) || cuCtxCreate_v2(&ctx, 0, dev)) {
    printf("init_failed=1\n");
    return 1;
  }
  CUdeviceptr held[4096];
  int n = 0;
  CUresult last = 0;
  while (n < 4096) {
    last = alloc(&held[n], chunk);
    if (last != 0) break;
    n++;
  }
  for (int i = 0; i < n; i++) ((free_t)f)(held[i]);
  printf("allocated=%d last=%d\n", n, last);
  return 0;
}

static int mode_exports(void) {
  void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!nvml || !cuda) {
    printf("dlopen_failed=1 # %s\n", dlerror());
    return 1;
  }
  typedef int (*table_t)(const void **, const void *);
  table_t t = (table_t)dlsym(nvml, "nvmlInternalGetExportTable");
  printf("nvml_export_table=%d ", t != NULL);
  if (t) {
    const void *table = (const void *)1;
    unsigned char uuid[16] = {0};
    int (*init)(void) = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
    printf("nvml_init=%d ", init ? init() : -1);
    int r = t(&table, uuid);
    printf("table_r=%d table_null=%d ", r, table == NULL);
  }
  /* What cuda-gdb and the debugger API look up in libcuda. */
  static const char *fns[] = {"cudbgApiAttach", "cudbgApiDetach", "cudbgApiInit",
                              "cudbgGetAPI", "cudbgGetAPIVersion", "cudbgMain",
                              "cudbgReportDriverApiError", "cudbgReportDriverInternalError"};
  int found = 0;
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++) {
    if (dlsym(cuda, fns[i]))
      found++;
    else
      printf("missing_%s=1 ", fns[i]);
  }
  printf("cudbg_found=%d cudbg_wanted=%zu\n", found, sizeof fns / sizeof *fns);
  return 0;
}

static int mode_sigpipe(int n) {
  signal(SIGPIPE, SIG_DFL);
  int killed = 0, exited = 0;
  for (int i = 0; i < n; i++) {
    pid_t pid = fork();
    if (pid == 0) {
      signal(SIGPIPE, SIG_DFL);
      CUresult r = cuInit(0);
      _exit(r == 800 ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGPIPE) killed++;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) exited++;
  }
  printf("children=%d killed_by_sigpipe=%d refused_cleanly=%d\n", n, killed, exited);
  return 0;
}

typedef struct {
  unsigned long long total, free, used;
} nvml_memory_t;

static int mode_nvmlonly(void) {
  void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!nvml) {
    printf("dlopen_failed=1\n");
    return 1;
  }
  int (*init)(void) = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
  int (*handle)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
  int (*mem)(void *, nvml_memory_t *) = (int (*)(void *, nvml_memory_t *))dlsym(nvml, "nvmlDeviceGetMemoryInfo");
  int (*procs)(void *, unsigned *, void *) =
      (int (*)(void *, unsigned *, void *))dlsym(nvml, "nvmlDeviceGetComputeRunningProcesses_v3");
  void *h = NULL;
  nvml_memory_t m = {0};
  unsigned count = 0;
  int ri = init(), rh = handle(0, &h), rm = mem(h, &m), rp = procs(h, &count, NULL);
  printf("init=%d handle=%d mem=%d total=%llu used=%llu free=%llu procs_r=%d procs=%u\n", ri, rh, rm, m.total,
         m.used, m.free, rp, count);
  return 0;
}

/* NVML's per-process queries as nvidia-smi / pynvml make them (two-call
 * size protocol), printing the PIDs each one lists; then accounting stats and
 * the process name of PID `other`. */
typedef struct {
  unsigned pid;
  unsigned long long ts;
  unsigned sm, mem, enc, dec;
} util_sample_t;
typedef struct {
  unsigned long long ts;
  unsigned pid, sm, mem, enc, dec, jpg, ofa;
} util_info_t;
typedef struct {
  unsigned version, count;
  unsigned long long last_seen;
  util_info_t *array;
} utils_info_t;
typedef struct {
  unsigned pid;
  unsigned long long used;
  unsigned gi, ci;
  unsigned long long cc;
} detail_t;
typedef struct {
  unsigned version, mode, count;
  detail_t *array;
} detail_list_t;

static void *nvml_sym(void *h, const char *name) {
  void *p = dlsym(h, name);
  if (!p) {
    printf("missing_%s=1\n", name);
    exit(1);
  }
  return p;
}

static void print_pids(const char *key, int r, const unsigned *pids, size_t stride, unsigned n) {
  printf("%s_r=%d %s=", key, r, key);
  for (unsigned i = 0; i < n; i++)
    printf("%s%u", i ? "," : "", *(const unsigned *)((const char *)pids + i * stride));
  printf(" ");
}

static int mode_tenants(unsigned other) {
  void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!h) return 1;
  ((int (*)(void))nvml_sym(h, "nvmlInit_v2"))();
  void *dev = NULL;
  ((int (*)(unsigned, void **))nvml_sym(h, "nvmlDeviceGetHandleByIndex_v2"))(0, &dev);

  int (*util)(void *, util_sample_t *, unsigned *, unsigned long long) =
      (int (*)(void *, util_sample_t *, unsigned *, unsigned long long))nvml_sym(h, "nvmlDeviceGetProcessUtilization");
  unsigned n = 0;
  int r = util(dev, NULL, &n, 0);
  util_sample_t *samples = calloc(n + 1, sizeof *samples);
  if (r == 7) r = util(dev, samples, &n, 0);
  print_pids("util", r, &samples[0].pid, sizeof *samples, r == 0 ? n : 0);

  int (*infos)(void *, utils_info_t *) = (int (*)(void *, utils_info_t *))nvml_sym(h, "nvmlDeviceGetProcessesUtilizationInfo");
  utils_info_t ui = {sizeof(utils_info_t) | 1u << 24, 0, 0, NULL};
  r = infos(dev, &ui);
  if (r == 7) {
    ui.array = calloc(ui.count + 1, sizeof(util_info_t));
    r = infos(dev, &ui);
  }
  print_pids("info", r, ui.array ? &ui.array[0].pid : NULL, sizeof(util_info_t), r == 0 ? ui.count : 0);
  ui.version = 1;
  printf("info_bad_version_r=%d ", infos(dev, &ui));

  int (*details)(void *, detail_list_t *) = (int (*)(void *, detail_list_t *))nvml_sym(h, "nvmlDeviceGetRunningProcessDetailList");
  detail_list_t dl = {sizeof(detail_list_t) | 1u << 24, 0, 0, NULL};
  r = details(dev, &dl);
  if (r == 7) {
    dl.array = calloc(dl.count + 1, sizeof(detail_t));
    r = details(dev, &dl);
  }
  print_pids("detail", r, dl.array ? &dl.array[0].pid : NULL, sizeof(detail_t), r == 0 ? dl.count : 0);

  int (*acct)(void *, unsigned *, unsigned *) = (int (*)(void *, unsigned *, unsigned *))nvml_sym(h, "nvmlDeviceGetAccountingPids");
  unsigned pids[4096];
  n = 4096;
  r = acct(dev, &n, pids);
  print_pids("acct", r, pids, sizeof *pids, r == 0 ? n : 0);
  unsigned char stats[56];
  int (*st)(void *, unsigned, void *) = (int (*)(void *, unsigned, void *))nvml_sym(h, "nvmlDeviceGetAccountingStats");
  printf("other_stats_r=%d ", st(dev, other, stats));
  char name[256];
  int (*pname)(unsigned, char *, unsigned) = (int (*)(unsigned, char *, unsigned))nvml_sym(h, "nvmlSystemGetProcessName");
  printf("other_name_r=%d\n", pname(other, name, sizeof name));
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) return 2;
  const char *m = argv[1];
  if (!strcmp(m, "procaddr")) return mode_procaddr((argc > 2 ? strtoull(argv[2], NULL, 10) : 1024) * MIB);
  if (!strcmp(m, "exports")) return mode_exports();
  if (!strcmp(m, "sigpipe")) return mode_sigpipe(argc > 2 ? atoi(argv[2]) : 20);
  if (!strcmp(m, "nvmlonly")) return mode_nvmlonly();
  if (!strcmp(m, "tenants")) return mode_tenants(argc > 2 ? (unsigned)atoi(argv[2]) : 0);
  return 2;
}
