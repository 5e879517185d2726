/* One rank of a tensor-parallel (TP = 2) model server, as vLLM's V1 worker
 * drives the CUDA driver through PyTorch and NCCL, against the driver API:
 * tests/shim_tp_serving.rs runs two (rank 0 on device 0, rank 1 on device
 * 1) in one container whose share spans both GPUs, beside a second tenant.
 *
 *   tp_serve RANK SOCK UTIL_PERCENT WEIGHTS_MIB SECONDS
 *
 * The steps, each from the source it imitates:
 *  1. vllm/v1/worker/gpu_worker.py (@v0.11.0) init_device: the device's
 *     primary context (torch.cuda.set_device), a memory snapshot
 *     (torch.cuda.mem_get_info: cuMemGetInfo), requested_memory =
 *     total x gpu_memory_utilization, refused when less is free.
 *  2. vllm/distributed/device_communicators/custom_all_reduce.py
 *     create_shared_buffer: a buffer per rank, its CUDA IPC handle
 *     all-gathered, every other rank's opened (cudaIpcOpenMemHandle with
 *     cudaIpcMemLazyEnablePeerAccess).
 *  3. NCCL's P2P transport over cuMem (nccl src/transport/p2p.cc
 *     @5067397 lines 232-236 and 284-290, src/include/alloc.h lines
 *     298-324): a cuMemCreate'd buffer exported as a POSIX fd, sent over
 *     the socket with SCM_RIGHTS, imported, mapped and made accessible to
 *     the importer's device (the peer reads it over P2P).
 *  4. gpu_worker.py determine_available_memory: the weights, a profiling
 *     forward pass at the largest batch, then available KV cache =
 *     requested_memory - what the process holds now (non-KV memory).
 *  5. gpu_model_runner.py _allocate_kv_cache_tensors under
 *     PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching
 *     allocator's ExpandableSegment (c10/cuda/CUDACachingAllocator.cpp)
 *     reserves the range once and maps 20 MiB handles one after another,
 *     cuMemSetAccess over each newly mapped piece.
 *  6. One allocation past the quota: CUDA_ERROR_OUT_OF_MEMORY at the call
 *     (torch.OutOfMemoryError), the server goes on.
 *  7. gpu_model_runner.py capture_model: CUDA graphs for batch sizes 8, 4,
 *     2, 1 (largest first), captured in the global mode torch.cuda.graph
 *     uses, each a few layers of attention (time grows with the batch),
 *     an MLP GEMM (grid grows with the batch) and the custom all-reduce
 *     reading the peer's IPC buffer.
 *  8. Serving for SECONDS: a graph replay per step at the step's batch
 *     size, then the ranks meet (the all-reduce makes TP ranks advance in
 *     lockstep).
 *
 * Prints `key=value` lines (`error WHAT=CODE` and exit 1 on a failed call).
 * After serving it prints `served=N` and the memory view, then waits for
 * a line on stdin before tearing down, so the test can read the ledgers
 * and NVML while everything is still held. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_driver.h"
#include "cuda_share.h"
#include "ipc_socket.h"

typedef void *CUgraph;
typedef void *CUgraphExec;

CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice dev);
CUresult cuStreamBeginCapture_v2(CUstream s, int mode);
CUresult cuStreamEndCapture(CUstream s, CUgraph *g);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec e, CUstream s);

#define MIB (1024ull * 1024ull)
/* The custom all-reduce's buffer (vLLM's default max_size, 8 MiB). */
#define AR_BYTES (8 * MIB)
/* NCCL's P2P buffer for one channel pair (NCCL_BUFFSIZE 4 MiB). */
#define NCCL_BYTES (4 * MIB)
/* The caching allocator's expandable segment step for the large pool. */
#define SEGMENT (20 * MIB)
#define MAX_SEGMENTS 4096
#define POSIX_FD 1
#define LOC_DEVICE 1
#define LAYERS 4
#define CAPTURE_GLOBAL 0

/* The model's kernels and the laws the simulator times them by (the
 * interposer never sees these): decode attention whose time grows with
 * the batch (its first parameter), a register-limited GEMM whose grid
 * grows with the batch, the all-reduce as a latency-bound copy. */
static const char image[] =
    ".version 8.0\n.target sm_80\n"
    "// gpu-sim kernel attn fixed ns=60000 arg_ns=50000 noise=0.05\n"
    "// gpu-sim kernel mlp waves block_ns=25000 regs=64 tail=0.4 noise=0.05\n"
    "// gpu-sim kernel allreduce bandwidth bytes_per_block=262144 gbps=100 "
    "saturate_threads=65536 launch_ns=8000\n";

static const int BATCHES[] = {8, 4, 2, 1};
#define N_BATCHES 4

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

static size_t free_now(const char *key) {
  size_t f = 0, t = 0;
  check(cuMemGetInfo_v2(&f, &t), "cuMemGetInfo");
  printf("%s_free=%zu\n", key, f);
  return f;
}

/* The ranks meet: each sends a byte and waits for the other's. */
static void barrier(int s) {
  char b = 'b';
  send_all(s, &b, 1);
  recv_all(s, &b, 1);
}

static CUmemAllocationProp device_prop(int dev, int types) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
  p.location.type = LOC_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes = types;
  return p;
}

struct rank {
  int id, sock;
  CUdevice dev;
  CUstream stream;
  CUfunction attn, mlp, allreduce;
  CUdeviceptr ar_own, ar_peer, nccl_peer;
  size_t total, requested;
};

/* Step 2: the custom all-reduce's buffers, exchanged as IPC handles. */
static void custom_all_reduce(struct rank *r) {
  CUipcMemHandle mine, theirs;
  check(cuMemAlloc_v2(&r->ar_own, AR_BYTES), "cuMemAlloc(all-reduce)");
  check(cuIpcGetMemHandle(&mine, r->ar_own), "cuIpcGetMemHandle");
  send_all(r->sock, &mine, sizeof mine);
  recv_all(r->sock, &theirs, sizeof theirs);
  size_t before = free_now("ipc_before");
  check(cuIpcOpenMemHandle_v2(&r->ar_peer, theirs, 1), "cuIpcOpenMemHandle");
  printf("ipc_charged=%lld\n", (long long)before - (long long)free_now("ipc_after"));
}

/* Step 3: NCCL's P2P buffer, exported as a POSIX fd, imported by the peer. */
static void nccl_p2p(struct rank *r) {
  CUmemAllocationProp prop = device_prop(r->dev, POSIX_FD);
  CUmemGenericAllocationHandle own, peer;
  CUdeviceptr own_va;
  CUmemAccessDesc access = {{LOC_DEVICE, r->dev}, 3};
  size_t gran;
  int fd = -1;
  check(cuMemGetAllocationGranularity(&gran, &prop, 0), "cuMemGetAllocationGranularity");
  check(cuMemCreate(&own, NCCL_BYTES, &prop, 0), "cuMemCreate(nccl)");
  check(cuMemAddressReserve(&own_va, NCCL_BYTES, gran, 0, 0), "cuMemAddressReserve(nccl)");
  check(cuMemMap(own_va, NCCL_BYTES, 0, own, 0), "cuMemMap(nccl)");
  check(cuMemSetAccess(own_va, NCCL_BYTES, &access, 1), "cuMemSetAccess(nccl)");
  check(cuMemExportToShareableHandle(&fd, own, POSIX_FD, 0), "cuMemExportToShareableHandle");
  send_fd(r->sock, fd);
  close(fd);
  fd = recv_fd(r->sock);
  size_t before = free_now("nccl_before");
  check(cuMemImportFromShareableHandle(&peer, (void *)(uintptr_t)fd, POSIX_FD),
        "cuMemImportFromShareableHandle");
  close(fd);
  check(cuMemAddressReserve(&r->nccl_peer, NCCL_BYTES, gran, 0, 0), "cuMemAddressReserve(peer)");
  check(cuMemMap(r->nccl_peer, NCCL_BYTES, 0, peer, 0), "cuMemMap(peer)");
  /* The importer's device reads the peer's memory (P2P). */
  check(cuMemSetAccess(r->nccl_peer, NCCL_BYTES, &access, 1), "cuMemSetAccess(peer)");
  printf("nccl_charged=%lld\n", (long long)before - (long long)free_now("nccl_after"));
}

/* One forward pass at batch `bs`: LAYERS x (attention, MLP, all-reduce). */
static void forward(struct rank *r, int bs) {
  for (int l = 0; l < LAYERS; l++) {
    void *attn_args[] = {&bs, &r->ar_own};
    void *ar_args[] = {&bs, &r->ar_peer};
    check(cuLaunchKernel(r->attn, 40, 1, 1, 128, 1, 1, 0, r->stream, attn_args, NULL), "attn");
    check(cuLaunchKernel(r->mlp, 160 * bs, 1, 1, 256, 1, 1, 0, r->stream, attn_args, NULL), "mlp");
    check(cuLaunchKernel(r->allreduce, 16, 1, 1, 512, 1, 1, 0, r->stream, ar_args, NULL),
          "allreduce");
  }
}

/* Step 5: the KV cache in 20 MiB handles mapped back to back. */
static void kv_cache(struct rank *r, size_t bytes) {
  CUmemAllocationProp prop = device_prop(r->dev, 0);
  CUmemAccessDesc access = {{LOC_DEVICE, r->dev}, 3};
  CUdeviceptr base;
  size_t gran, n = bytes / SEGMENT;
  check(cuMemGetAllocationGranularity(&gran, &prop, 0), "cuMemGetAllocationGranularity");
  check(cuMemAddressReserve(&base, (n + 1) * SEGMENT, gran, 0, 0), "cuMemAddressReserve(kv)");
  size_t mapped = 0;
  CUresult err = 0;
  for (size_t i = 0; i < n && i < MAX_SEGMENTS; i++) {
    CUmemGenericAllocationHandle h;
    err = cuMemCreate(&h, SEGMENT, &prop, 0);
    if (err)
      break;
    check(cuMemMap(base + mapped, SEGMENT, 0, h, 0), "cuMemMap(kv)");
    check(cuMemSetAccess(base + mapped, SEGMENT, &access, 1), "cuMemSetAccess(kv)");
    mapped += SEGMENT;
  }
  printf("kv_bytes=%zu\nkv_handles=%zu\nkv_err=%d\n", mapped, (size_t)(mapped / SEGMENT), err);
}

/* Step 6: past the quota, by both paths; the process goes on. */
static void past_quota(struct rank *r, size_t free_b) {
  CUmemAllocationProp prop = device_prop(r->dev, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr p;
  size_t over = (free_b / SEGMENT + 1) * SEGMENT;
  printf("over_create=%d\n", cuMemCreate(&h, over, &prop, 0));
  printf("over_alloc=%d\n", cuMemAlloc_v2(&p, free_b + 2 * MIB));
}

/* Step 7: one graph per batch size, largest first. */
static void capture(struct rank *r, CUgraphExec exec[N_BATCHES]) {
  for (int i = 0; i < N_BATCHES; i++) {
    CUgraph g;
    forward(r, BATCHES[i]); /* vLLM's warm-up runs before each capture */
    check(cuStreamSynchronize(r->stream), "cuStreamSynchronize(warm-up)");
    check(cuStreamBeginCapture_v2(r->stream, CAPTURE_GLOBAL), "cuStreamBeginCapture");
    forward(r, BATCHES[i]);
    check(cuStreamEndCapture(r->stream, &g), "cuStreamEndCapture");
    check(cuGraphInstantiateWithFlags(&exec[i], g, 0), "cuGraphInstantiateWithFlags");
  }
  printf("graphs=%d\n", N_BATCHES);
}

/* The ranks meet and agree whether to take another step: each says what
 * its own clock says, and both stop when either does, so both leave on the
 * same step. (Each rank deciding alone let one stop while the other took
 * one more step: the stopper read the other's step byte as its stop
 * answer, the other then waited forever for an answer to its own stop.) */
static int both_go_on(int s, int mine) {
  char b = mine ? 'c' : 's', theirs = 's';
  send_all(s, &b, 1);
  recv_all(s, &theirs, 1);
  return mine && theirs == 'c';
}

/* Step 8: replays at the steps' batch sizes, the ranks in lockstep. */
static void serve(struct rank *r, CUgraphExec exec[N_BATCHES], double seconds) {
  barrier(r->sock);
  long long start = now_ns(), end = start + (long long)(seconds * 1e9);
  printf("pid=%d\nserve_start_ns=%lld\n", getpid(), start);
  fflush(stdout);
  long long served = 0;
  while (both_go_on(r->sock, now_ns() < end)) {
    check(cuGraphLaunch(exec[served % N_BATCHES], r->stream), "cuGraphLaunch");
    check(cuStreamSynchronize(r->stream), "cuStreamSynchronize(step)");
    served++;
  }
  printf("served=%lld\nserve_end_ns=%lld\n", served, now_ns());
}

/* NVML's view of this rank's GPU, found by its bus id, from inside the
 * share: the device's used memory and the per-process figures' sum. */
static void nvml_view(struct rank *r) {
  struct {
    unsigned long long total, free, used;
  } mem = {0, 0, 0};
  struct {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi, ci;
  } procs[64];
  unsigned int n = 64;
  char bus[32] = {0};
  void *dev = NULL;
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  int (*init)(void) = lib ? (int (*)(void))dlsym(lib, "nvmlInit_v2") : NULL;
  int (*by_bus)(const char *, void **) =
      lib ? (int (*)(const char *, void **))dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2") : NULL;
  int (*info)(void *, void *) = lib ? (int (*)(void *, void *))dlsym(lib, "nvmlDeviceGetMemoryInfo") : NULL;
  int (*list)(void *, unsigned *, void *) =
      lib ? (int (*)(void *, unsigned *, void *))dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3") : NULL;
  check(cuDeviceGetPCIBusId(bus, sizeof bus, r->dev), "cuDeviceGetPCIBusId");
  if (!init || !by_bus || !info || !list || init() || by_bus(bus, &dev) || info(dev, &mem) ||
      list(dev, &n, procs)) {
    printf("error nvml=1\n");
    exit(1);
  }
  unsigned long long sum = 0;
  for (unsigned i = 0; i < n; i++)
    sum += procs[i].used;
  printf("bus=%s\nnvml_total=%llu\nnvml_used=%llu\nnvml_procs=%u\nnvml_procs_sum=%llu\n", bus, mem.total,
         mem.used, n, sum);
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s RANK SOCK UTIL_PERCENT WEIGHTS_MIB SECONDS\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  struct rank r = {.id = atoi(argv[1])};
  size_t util = (size_t)atoi(argv[3]), weights = (size_t)atoll(argv[4]) * MIB;
  CUcontext ctx;
  CUmodule m;
  CUdeviceptr w;
  CUgraphExec exec[N_BATCHES];

  /* 1. The device, the snapshot, what the server may use. */
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&r.dev, r.id), "cuDeviceGet");
  check(cuDevicePrimaryCtxRetain(&ctx, r.dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  size_t init_free;
  check(cuMemGetInfo_v2(&init_free, &r.total), "cuMemGetInfo");
  r.requested = r.total / 100 * util;
  printf("total=%zu\ninit_free=%zu\nrequested=%zu\n", r.total, init_free, r.requested);
  if (init_free < r.requested) {
    printf("error free_below_requested=1\n");
    return 1;
  }
  r.sock = r.id == 0 ? listen_on(argv[2]) : connect_to(argv[2]);

  /* 2, 3. The communicators' buffers. */
  custom_all_reduce(&r);
  nccl_p2p(&r);

  /* 4. Weights, a profiling pass, the KV cache's size. */
  check(cuMemAlloc_v2(&w, weights), "cuMemAlloc(weights)");
  check(cuModuleLoadData(&m, image), "cuModuleLoadData");
  check(cuModuleGetFunction(&r.attn, m, "attn"), "cuModuleGetFunction(attn)");
  check(cuModuleGetFunction(&r.mlp, m, "mlp"), "cuModuleGetFunction(mlp)");
  check(cuModuleGetFunction(&r.allreduce, m, "allreduce"), "cuModuleGetFunction(allreduce)");
  check(cuStreamCreate(&r.stream, 1), "cuStreamCreate");
  forward(&r, BATCHES[0]);
  check(cuStreamSynchronize(r.stream), "cuStreamSynchronize(profile)");
  size_t profiled = free_now("profiled");
  size_t held = r.total - profiled;
  size_t kv = r.requested > held ? r.requested - held : 0;
  printf("kv_target=%zu\n", kv);

  /* 5, 6. The KV cache, then one allocation too many. */
  kv_cache(&r, kv);
  size_t after_kv = free_now("kv");
  past_quota(&r, after_kv);
  free_now("refused");

  /* 7, 8. Graphs, then requests. */
  capture(&r, exec);
  serve(&r, exec, atof(argv[5]));
  free_now("end");
  nvml_view(&r);
  printf("paused=1\n");
  fflush(stdout);
  char line[16];
  if (!fgets(line, sizeof line, stdin)) {
    /* no test driving us: go on */
  }
  check(cuIpcCloseMemHandle(r.ar_peer), "cuIpcCloseMemHandle");
  close(r.sock);
  printf("ok=1\n");
  return 0;
}
