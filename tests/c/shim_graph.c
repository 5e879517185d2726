// CUDA graphs for tests/shim_graph.rs and the graph_accuracy bench, on the
// simulated node (directly or under the interposer). Kernels are the sim's
// 1 ms shape (86400 blocks of 256 threads: 100 waves of 10 us on its A100).
// Driver declarations: cuda_driver.h (via shim_common.h); the graph API's below.
//
// usage: shim_graph explicit      graph built node by node; launched once
//        shim_graph capture       graph captured from two streams; launched once
//        shim_graph charge        (each step acknowledged on stdin) set up,
//                                 capture, instantiate (a module loaded and
//                                 unloaded), launch the graph 3 times, launch
//                                 one kernel directly, launch a graph of 2
//                                 kernel nodes, again after giving the
//                                 second 10x the blocks
//        shim_graph mem MIB...    (each step acknowledged on stdin) set up;
//                                 one exec per size with a graph alloc node;
//                                 destroy them all; trim
//        shim_graph loop SECONDS [GRID KERNELS]
//                                 a captured graph of KERNELS (10) kernels of
//                                 GRID (86400) blocks of 256 threads,
//                                 launched back to back, a sync every 2
//                                 (the bench)
// Prints key=value words; `phase=NAME` lines wait for a line on stdin.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim_common.h"

typedef void *CUgraph;
typedef void *CUgraphNode;
typedef void *CUgraphExec;
typedef void *CUevent;

typedef struct {
  CUfunction func;
  unsigned grid[3], block[3], shared;
  void **params, **extra;
  void *kern;
  CUcontext ctx;
} KernelParams; // CUDA_KERNEL_NODE_PARAMS_v2

typedef struct {
  int alloc_type, handle_types, location_type, location_id;
  void *win32;
  size_t max_size;
  unsigned short usage;
  unsigned char reserved[54];
} PoolProps; // CUmemPoolProps

typedef struct {
  PoolProps props;
  const void *access;
  size_t access_count, bytesize;
  CUdeviceptr dptr;
} AllocParams; // CUDA_MEM_ALLOC_NODE_PARAMS

typedef struct {
  int type, reserved0[3];
  union {
    long long reserved1[29];
    KernelParams kernel;
    AllocParams alloc;
  };
  long long reserved2;
} NodeParams; // CUgraphNodeParams

CUresult cuStreamBeginCapture_v2(CUstream s, int mode);
CUresult cuStreamEndCapture(CUstream s, CUgraph *g);
CUresult cuStreamIsCapturing(CUstream s, int *status);
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s);
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
CUresult cuEventCreate(CUevent *e, unsigned flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventSynchronize(CUevent e);
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b);
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags);
CUresult cuGraphCreate(CUgraph *g, unsigned flags);
CUresult cuGraphAddKernelNode_v2(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                 const KernelParams *p);
CUresult cuGraphAddMemAllocNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                                AllocParams *p);
CUresult cuGraphAddMemFreeNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd,
                               CUdeviceptr p);
CUresult cuGraphAddNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd, NodeParams *p);
CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *n);
CUresult cuGraphNodeGetType(CUgraphNode n, int *type);
CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode n, KernelParams *p);
CUresult cuGraphMemAllocNodeGetParams(CUgraphNode n, AllocParams *p);
CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec e, CUgraphNode n, const KernelParams *p);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec e, CUstream s);
CUresult cuGraphExecDestroy(CUgraphExec e);
CUresult cuGraphDestroy(CUgraph g);
CUresult cuDeviceGraphMemTrim(CUdevice d);
CUresult cuDeviceGetGraphMemAttribute(CUdevice d, int attr, void *value);

static CUfunction f;
static CUstream s, s2;

static void setup(void) {
  setup_kernel("kernel", &f, &s);
  check(cuStreamCreate(&s2, 0), "cuStreamCreate");
}

static void launch(CUstream on) {
  check(cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, on, NULL, NULL), "cuLaunchKernel");
}

// Prints `phase=NAME` and waits for a line on stdin.
static void phase(const char *name) {
  printf("phase=%s\n", name);
  fflush(stdout);
  int c;
  while ((c = getchar()) != EOF && c != '\n') {
  }
}

static unsigned long long attr(int a) {
  unsigned long long v = 0;
  check(cuDeviceGetGraphMemAttribute(0, a, &v), "cuDeviceGetGraphMemAttribute");
  return v;
}

// Launches `e` once on `s`; prints the simulated time it took.
static void timed_launch(CUgraphExec e) {
  CUevent a, b;
  float ms = 0;
  check(cuEventCreate(&a, 0), "cuEventCreate");
  check(cuEventCreate(&b, 0), "cuEventCreate");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  check(cuEventRecord(a, s), "cuEventRecord");
  check(cuGraphLaunch(e, s), "cuGraphLaunch");
  check(cuEventRecord(b, s), "cuEventRecord");
  check(cuEventSynchronize(b), "cuEventSynchronize");
  check(cuEventElapsedTime(&ms, a, b), "cuEventElapsedTime");
  printf("elapsed_us=%.0f\n", ms * 1000);
}

// Counts the graph's nodes by type: kernels=, allocs=, frees=, nodes=.
static void census(CUgraph g) {
  CUgraphNode nodes[64];
  size_t n = 64;
  int k = 0, a = 0, fr = 0;
  check(cuGraphGetNodes(g, nodes, &n), "cuGraphGetNodes");
  for (size_t i = 0; i < n; i++) {
    int t = -1;
    check(cuGraphNodeGetType(nodes[i], &t), "cuGraphNodeGetType");
    if (t == 0) {
      KernelParams p;
      check(cuGraphKernelNodeGetParams_v2(nodes[i], &p), "cuGraphKernelNodeGetParams");
      if (p.grid[0] != 86400 || p.block[0] != 256) {
        printf("error kernel_shape=%u,%u\n", p.grid[0], p.block[0]);
        exit(1);
      }
      k++;
    } else if (t == 10) {
      AllocParams p;
      check(cuGraphMemAllocNodeGetParams(nodes[i], &p), "cuGraphMemAllocNodeGetParams");
      printf("alloc_bytes=%zu\n", p.bytesize);
      a++;
    } else if (t == 11) {
      fr++;
    }
  }
  printf("nodes=%zu kernels=%d allocs=%d frees=%d\n", n, k, a, fr);
}

static AllocParams alloc_params(size_t bytes) {
  AllocParams p;
  memset(&p, 0, sizeof p);
  p.props.alloc_type = 1;    // CU_MEM_ALLOCATION_TYPE_PINNED
  p.props.location_type = 1; // CU_MEM_LOCATION_TYPE_DEVICE
  p.bytesize = bytes;
  return p;
}

// 4 kernel nodes (2 of them through cuGraphAddNode), a 64 MiB alloc node
// (cuGraphAddNode) and a 32 MiB one freed in the graph.
static CUgraph explicit_graph(void) {
  CUgraph g;
  CUgraphNode prev = NULL, n;
  KernelParams kp = {f, {86400, 1, 1}, {256, 1, 1}, 0, NULL, NULL, NULL, NULL};
  check(cuGraphCreate(&g, 0), "cuGraphCreate");
  NodeParams np;
  memset(&np, 0, sizeof np);
  np.type = 10;
  np.alloc = alloc_params(64 << 20);
  check(cuGraphAddNode(&n, g, NULL, 0, &np), "cuGraphAddNode(alloc)");
  printf("alloc_dptr_set=%d\n", np.alloc.dptr != 0);
  prev = n;
  AllocParams ap = alloc_params(32 << 20);
  check(cuGraphAddMemAllocNode(&n, g, &prev, 1, &ap), "cuGraphAddMemAllocNode");
  prev = n;
  for (int i = 0; i < 4; i++) {
    if (i % 2) {
      memset(&np, 0, sizeof np);
      np.type = 0;
      np.kernel = kp;
      check(cuGraphAddNode(&n, g, &prev, 1, &np), "cuGraphAddNode(kernel)");
    } else {
      check(cuGraphAddKernelNode_v2(&n, g, &prev, 1, &kp), "cuGraphAddKernelNode");
    }
    prev = n;
  }
  check(cuGraphAddMemFreeNode(&n, g, &prev, 1, ap.dptr), "cuGraphAddMemFreeNode");
  return g;
}

// On s: 3 kernels, a 16 MiB cuMemAllocAsync; forked onto s2 by an event: 2
// kernels; joined back; 1 more kernel and the free.
static CUgraph captured_graph(void) {
  CUgraph g;
  CUevent fork, join;
  CUdeviceptr p;
  int st = -1;
  check(cuEventCreate(&fork, 0), "cuEventCreate");
  check(cuEventCreate(&join, 0), "cuEventCreate");
  check(cuStreamBeginCapture_v2(s, 2), "cuStreamBeginCapture");
  for (int i = 0; i < 3; i++)
    launch(s);
  check(cuMemAllocAsync(&p, 16 << 20, s), "cuMemAllocAsync");
  check(cuEventRecord(fork, s), "cuEventRecord");
  check(cuStreamWaitEvent(s2, fork, 0), "cuStreamWaitEvent");
  check(cuStreamIsCapturing(s2, &st), "cuStreamIsCapturing");
  printf("forked_capturing=%d\n", st);
  launch(s2);
  launch(s2);
  check(cuEventRecord(join, s2), "cuEventRecord");
  check(cuStreamWaitEvent(s, join, 0), "cuStreamWaitEvent");
  launch(s);
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
  check(cuStreamEndCapture(s, &g), "cuStreamEndCapture");
  check(cuStreamIsCapturing(s2, &st), "cuStreamIsCapturing");
  printf("forked_capturing_after=%d\n", st);
  return g;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: shim_graph explicit|capture|charge|mem MIB...|loop SECONDS\n");
    return 2;
  }
  setup();
  const char *mode = argv[1];
  CUgraphExec e;
  if (!strcmp(mode, "explicit") || !strcmp(mode, "capture")) {
    CUgraph g = !strcmp(mode, "explicit") ? explicit_graph() : captured_graph();
    census(g);
    size_t free0, free1, total;
    check(cuMemGetInfo_v2(&free0, &total), "cuMemGetInfo");
    check(cuGraphInstantiateWithFlags(&e, g, 0), "cuGraphInstantiate");
    timed_launch(e);
    check(cuMemGetInfo_v2(&free1, &total), "cuMemGetInfo");
    printf("launch_took_bytes=%zu\n", free0 - free1);
    printf("reserved=%llu used=%llu\n", attr(2), attr(0));
    check(cuGraphExecDestroy(e), "cuGraphExecDestroy");
    printf("reserved_after_destroy=%llu used_after_destroy=%llu\n", attr(2), attr(0));
    check(cuDeviceGraphMemTrim(0), "cuDeviceGraphMemTrim");
    printf("reserved_after_trim=%llu reserved_high=%llu\n", attr(2), attr(3));
    check(cuGraphDestroy(g), "cuGraphDestroy");
  } else if (!strcmp(mode, "charge")) {
    phase("ready");
    CUgraph g = captured_graph();
    phase("captured");
    check(cuGraphInstantiateWithFlags(&e, g, 0), "cuGraphInstantiate");
    // A module loaded and unloaded: the interposer measures NVML right
    // after each (a reconcile before the first launch backs the exec).
    CUmodule m2;
    check(cuModuleLoadData(&m2, module_image()), "cuModuleLoadData");
    check(cuModuleUnload(m2), "cuModuleUnload");
    phase("instantiated");
    for (int i = 0; i < 3; i++)
      check(cuGraphLaunch(e, s), "cuGraphLaunch");
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    phase("graph");
    launch(s);
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    phase("direct");
    // Two kernel nodes; then the second gets 10x the blocks.
    CUgraph g2;
    CUgraphNode n1, n2;
    KernelParams kp = {f, {86400, 1, 1}, {256, 1, 1}, 0, NULL, NULL, NULL, NULL};
    check(cuGraphCreate(&g2, 0), "cuGraphCreate");
    check(cuGraphAddKernelNode_v2(&n1, g2, NULL, 0, &kp), "cuGraphAddKernelNode");
    check(cuGraphAddKernelNode_v2(&n2, g2, &n1, 1, &kp), "cuGraphAddKernelNode");
    CUgraphExec e2;
    check(cuGraphInstantiateWithFlags(&e2, g2, 0), "cuGraphInstantiate");
    check(cuGraphLaunch(e2, s), "cuGraphLaunch");
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    phase("explicit");
    kp.grid[0] = 864000;
    check(cuGraphExecKernelNodeSetParams_v2(e2, n2, &kp), "cuGraphExecKernelNodeSetParams");
    check(cuGraphLaunch(e2, s), "cuGraphLaunch");
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    phase("setparams");
  } else if (!strcmp(mode, "mem")) {
    CUgraphExec execs[16];
    int n = 0;
    phase("ready");
    for (int i = 2; i < argc && n < 16; i++) {
      CUgraph g;
      CUgraphNode a;
      AllocParams ap = alloc_params((size_t)atoll(argv[i]) << 20);
      check(cuGraphCreate(&g, 0), "cuGraphCreate");
      check(cuGraphAddMemAllocNode(&a, g, NULL, 0, &ap), "cuGraphAddMemAllocNode");
      CUresult r = cuGraphInstantiateWithFlags(&execs[n], g, 0);
      printf("instantiate%d=%d\n", i - 2, r);
      if (r == 0)
        check(cuGraphLaunch(execs[n++], s), "cuGraphLaunch");
      check(cuGraphDestroy(g), "cuGraphDestroy");
    }
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    phase("held");
    for (int i = 0; i < n; i++)
      check(cuGraphExecDestroy(execs[i]), "cuGraphExecDestroy");
    phase("destroyed");
    check(cuDeviceGraphMemTrim(0), "cuDeviceGraphMemTrim");
    phase("trimmed");
  } else if (!strcmp(mode, "loop") && argc > 2) {
    double secs = atof(argv[2]);
    unsigned grid = argc > 3 ? (unsigned)atoi(argv[3]) : 86400;
    int kernels = argc > 4 ? atoi(argv[4]) : 10;
    CUgraph g;
    check(cuStreamBeginCapture_v2(s, 0), "cuStreamBeginCapture");
    for (int i = 0; i < kernels; i++)
      check(cuLaunchKernel(f, grid, 1, 1, 256, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    check(cuStreamEndCapture(s, &g), "cuStreamEndCapture");
    check(cuGraphInstantiateWithFlags(&e, g, 0), "cuGraphInstantiate");
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long long start = t.tv_sec * 1000000000LL + t.tv_nsec, now = start;
    printf("pid=%d start_ns=%lld\n", getpid(), start);
    fflush(stdout);
    long launches = 0;
    while (now - start < (long long)(secs * 1e9)) {
      check(cuGraphLaunch(e, s), "cuGraphLaunch");
      if (++launches % 2 == 0)
        check(cuStreamSynchronize(s), "cuStreamSynchronize");
      clock_gettime(CLOCK_MONOTONIC, &t);
      now = t.tv_sec * 1000000000LL + t.tv_nsec;
    }
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    printf("graph_launches=%ld\n", launches);
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  printf("ok=1\n");
  return 0;
}
