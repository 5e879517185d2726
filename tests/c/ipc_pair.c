/* Two processes sharing device memory the ways serving frameworks do,
 * against the driver API: one exports (`serve`), the other opens
 * (`open`), over the unix socket SOCK. tests/sim_ipc.rs runs it on the
 * simulated driver, tests/shim_ipc.rs under the interposer.
 *
 *   ipc_pair serve SOCK MODE   # allocates, exports, waits for the opener
 *   ipc_pair open SOCK MODE    # opens, checks the bytes, prints `opened`,
 *                              # waits for a line on stdin, closes
 *   ipc_pair peer              # peer access on one process (4-GPU node)
 *   ipc_pair ncclfree          # NCCL's cuMem allocation and free sequence
 *   ipc_pair segments          # an expandable segment: handles mapped back
 *                              # to back, access set and copies across them
 *   ipc_pair quota             # device vs host-located cuMemCreate under a
 *                              # small quota: OUT_OF_MEMORY at the call
 *
 * MODE:
 *   ipc    CUDA IPC memory and event handles: vLLM's custom all-reduce
 *          (vllm/distributed/device_communicators/custom_all_reduce.py @00d618a,
 *          CustomAllreduce.create_shared_buffer: allocate_shared_buffer_and_handle
 *          -> all_gather of the handles -> open_mem_handle of every other rank's;
 *          csrc/custom_all_reduce.cuh: cudaIpcGetMemHandle / cudaIpcOpenMemHandle
 *          with cudaIpcMemLazyEnablePeerAccess) and NCCL's legacy P2P path
 *          (nccl src/transport/p2p.cc @5067397 lines 248 and 318).
 *   fd     a VMM allocation exported as a POSIX file descriptor sent with
 *          SCM_RIGHTS: NCCL's ncclCuMemAlloc (src/include/alloc.h @5067397
 *          lines 298-324: granularity, cuMemCreate with requestedHandleTypes,
 *          reserve, map, set access), p2p.cc lines 232-236 (export) and
 *          284-290 (import of the received fd), src/os/linux_ipcsocket.cc
 *          lines 140-231 (the fd over SCM_RIGHTS); PyTorch's expandable
 *          segments (c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment:
 *          cuMemCreate per segment, cuMemMap, cuMemSetAccess; shared with
 *          cuMemExportToShareableHandle(POSIX_FD)). Also a host-located
 *          handle as NCCL's ncclCuMemHostAlloc makes it (alloc.h lines 60-98:
 *          CU_MEM_LOCATION_TYPE_HOST_NUMA, access for the device and the host).
 *   fabric the same with a CU_MEM_HANDLE_TYPE_FABRIC handle sent as 64 bytes
 *          (p2p.cc line 293, src/mnnvl.cc line 81).
 *
 * Prints `key=value` lines; exits 1 with `error WHAT=CODE` on a failed call. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "cuda_driver.h"
#include "cuda_share.h"
#include "ipc_socket.h"

typedef void *CUevent;
typedef struct {
  char reserved[64];
} CUipcEventHandle;
typedef struct {
  unsigned char data[64];
} CUmemFabricHandle;

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n);
CUresult cuEventCreate(CUevent *e, unsigned int flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventSynchronize(CUevent e);
CUresult cuEventDestroy_v2(CUevent e);
CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e);
CUresult cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr);
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                CUmemGenericAllocationHandle h);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p);
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p);
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p);
CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer);
CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags);
CUresult cuCtxDisablePeerAccess(CUcontext peer);

#define MIB (1024ull * 1024ull)
#define IPC_BYTES (64 * MIB)
#define VMM_BYTES (32 * MIB)
#define POSIX_FD 1
#define FABRIC 8
#define LOC_DEVICE 1
#define LOC_HOST_NUMA 3

static void check(CUresult r, const char *what) {
  if (r != 0) {
    printf("error %s=%d\n", what, r);
    fflush(stdout);
    exit(1);
  }
}

static void expect(CUresult r, CUresult want, const char *what) {
  printf("%s=%d\n", what, r);
  if (r != want) {
    printf("error %s=%d (expected %d)\n", what, r, want);
    fflush(stdout);
    exit(1);
  }
}

static void mem_info(const char *who) {
  size_t free_b, total_b;
  check(cuMemGetInfo_v2(&free_b, &total_b), "cuMemGetInfo");
  printf("%s_free=%zu\n%s_total=%zu\n", who, free_b, who, total_b);
}

/* What NVML shows this process (dlopen: the node's libnvidia-ml.so.1, the
 * interposer's where it runs): the device's used memory and the sum of the
 * per-process numbers listed. */
static void nvml_view(const char *who) {
  struct {
    unsigned long long total, free, used;
  } mem;
  struct {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi, ci;
  } procs[64];
  void *dev;
  unsigned int n = 64;
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  int (*init)(void) = lib ? (int (*)(void))dlsym(lib, "nvmlInit_v2") : NULL;
  int (*by_index)(unsigned, void **) = lib ? (int (*)(unsigned, void **))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2") : NULL;
  int (*info)(void *, void *) = lib ? (int (*)(void *, void *))dlsym(lib, "nvmlDeviceGetMemoryInfo") : NULL;
  int (*list)(void *, unsigned *, void *) =
      lib ? (int (*)(void *, unsigned *, void *))dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3") : NULL;
  if (!init || !by_index || !info || !list || init() || by_index(0, &dev) || info(dev, &mem) ||
      list(dev, &n, procs)) {
    printf("error nvml=1\n");
    exit(1);
  }
  unsigned long long sum = 0;
  for (unsigned i = 0; i < n; i++)
    sum += procs[i].used;
  printf("%s_nvml_used=%llu\n%s_nvml_procs=%u\n%s_nvml_procs_sum=%llu\n", who, mem.used, who, n, who, sum);
}

/* The primary context of device 0, current: what the CUDA runtime (and so
 * PyTorch, vLLM and NCCL) works in. */
static CUcontext primary(int ordinal) {
  CUdevice dev;
  CUcontext ctx;
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return ctx;
}

/* The opener's pause: `opened` is printed, the test inspects the node
 * (ledgers, the sim's own counts), waits until the manager has published
 * the container's PIDs (what NVML inside the share lists), and answers
 * with a line; NVML is read right after. */
static void pause_opened(void) {
  char line[16];
  printf("opened=1\n");
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin)) {
    /* no test driving us: go on */
  }
}

static void fill(CUdeviceptr p, unsigned char v, size_t n) {
  unsigned char *b = malloc(n);
  memset(b, v, n);
  check(cuMemcpyHtoD_v2(p, b, n), "cuMemcpyHtoD");
  free(b);
}

static int byte_at(CUdeviceptr p, size_t off) {
  unsigned char b;
  check(cuMemcpyDtoH_v2(&b, p + off, 1), "cuMemcpyDtoH");
  return b;
}

/* ---- CUDA IPC handles ---- */

static void serve_ipc(int s) {
  CUdeviceptr p;
  CUipcMemHandle h, again;
  CUipcEventHandle eh;
  CUevent ev, plain;
  CUdeviceptr self;
  primary(0);
  mem_info("before");
  check(cuMemAlloc_v2(&p, IPC_BYTES), "cuMemAlloc");
  fill(p, 0x5a, 4096);
  check(cuIpcGetMemHandle(&h, p), "cuIpcGetMemHandle");
  /* vLLM's register_graph_buffers: the buffer's allocation from
   * CU_POINTER_ATTRIBUTE_RANGE_START_ADDR (11), exported, sent with the
   * buffer's offset in it. */
  CUdeviceptr base = 0;
  size_t range = 0;
  unsigned type = 0;
  check(cuPointerGetAttribute(&base, 11, p + 4096), "cuPointerGetAttribute(RANGE_START_ADDR)");
  check(cuPointerGetAttribute(&range, 12, p + 4096), "cuPointerGetAttribute(RANGE_SIZE)");
  check(cuPointerGetAttribute(&type, 2, p + 4096), "cuPointerGetAttribute(MEMORY_TYPE)");
  printf("range_start_ok=%d\nrange_size=%zu\nmemory_type=%u\n", base == p, range, type);
  int attrs[1] = {2};
  void *outs[1] = {&type};
  check(cuPointerGetAttributes(1, attrs, outs, (CUdeviceptr)(uintptr_t)&type), "cuPointerGetAttributes(host)");
  printf("pageable_type=%u\n", type);
  check(cuIpcGetMemHandle(&again, base), "cuIpcGetMemHandle(base)");
  printf("same_handle=%d\n", memcmp(&h, &again, sizeof h) == 0);
  expect(cuIpcOpenMemHandle_v2(&self, h, 1), 201, "open_own");
  check(cuEventCreate(&plain, 0), "cuEventCreate");
  expect(cuIpcGetEventHandle(&eh, plain), 1, "event_not_interprocess");
  check(cuEventCreate(&ev, 0x4 | 0x2), "cuEventCreate(interprocess)");
  check(cuEventRecord(ev, NULL), "cuEventRecord");
  check(cuIpcGetEventHandle(&eh, ev), "cuIpcGetEventHandle");
  mem_info("exporter");
  fflush(stdout);
  send_all(s, &h, sizeof h);
  send_all(s, &eh, sizeof eh);
  char done;
  recv_all(s, &done, 1);
  printf("written_by_opener=%d\n", byte_at(p, 1));
  check(cuMemFree_v2(p), "cuMemFree");
  check(cuEventDestroy_v2(ev), "cuEventDestroy");
}

static void open_ipc(int s) {
  CUipcMemHandle h;
  CUipcEventHandle eh;
  CUdeviceptr p, q;
  CUevent ev;
  recv_all(s, &h, sizeof h);
  recv_all(s, &eh, sizeof eh);
  primary(0);
  check(cuIpcOpenMemHandle_v2(&p, h, 1), "cuIpcOpenMemHandle");
  check(cuIpcOpenMemHandle_v2(&q, h, 1), "cuIpcOpenMemHandle(again)");
  printf("same_pointer=%d\n", p == q);
  printf("byte=%d\n", byte_at(p, 0));
  fill(p + 1, 0x33, 1);
  check(cuIpcOpenEventHandle(&ev, eh), "cuIpcOpenEventHandle");
  check(cuEventSynchronize(ev), "cuEventSynchronize(opened)");
  mem_info("opener");
  pause_opened();
  nvml_view("opener");
  check(cuIpcCloseMemHandle(p), "cuIpcCloseMemHandle");
  check(cuIpcCloseMemHandle(p), "cuIpcCloseMemHandle(second)");
  expect(cuIpcCloseMemHandle(p), 1, "close_third");
  check(cuEventDestroy_v2(ev), "cuEventDestroy(opened)");
  send_all(s, "d", 1);
}

/* ---- VMM handles: POSIX fd or fabric ---- */

static CUmemAllocationProp prop_for(int loc_type, int id, int types) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
  prop.location.type = loc_type;
  prop.location.id = id;
  prop.requestedHandleTypes = types;
  return prop;
}

/* Reserve, map, grant the device read-write: ncclCuMemMapAndSetAccess. */
static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size, size_t gran) {
  CUdeviceptr p;
  CUmemAccessDesc a = {{LOC_DEVICE, 0}, 3};
  check(cuMemAddressReserve(&p, size, gran, 0, 0), "cuMemAddressReserve");
  check(cuMemMap(p, size, 0, h, 0), "cuMemMap");
  check(cuMemSetAccess(p, size, &a, 1), "cuMemSetAccess");
  return p;
}

/* NCCL's host-located allocation (ncclCuMemHostAlloc): takes no device
 * memory, so cuMemGetInfo's free does not move. */
static void host_located(size_t gran) {
  CUmemAllocationProp prop = prop_for(LOC_HOST_NUMA, 0, POSIX_FD);
  CUmemGenericAllocationHandle h;
  CUmemAccessDesc host = {{LOC_HOST_NUMA, 0}, 3};
  size_t hgran;
  check(cuMemGetAllocationGranularity(&hgran, &prop, 0), "cuMemGetAllocationGranularity(host)");
  mem_info("host_before");
  check(cuMemCreate(&h, VMM_BYTES, &prop, 0), "cuMemCreate(host)");
  CUdeviceptr p = map_rw(h, VMM_BYTES, hgran > gran ? hgran : gran);
  check(cuMemSetAccess(p, VMM_BYTES, &host, 1), "cuMemSetAccess(host)");
  mem_info("host_after");
  nvml_view("host");
  check(cuMemUnmap(p, VMM_BYTES), "cuMemUnmap(host)");
  check(cuMemAddressFree(p, VMM_BYTES), "cuMemAddressFree(host)");
  check(cuMemRelease(h), "cuMemRelease(host)");
}

static void serve_vmm(int s, int type) {
  CUmemAllocationProp prop = prop_for(LOC_DEVICE, 0, type);
  CUmemGenericAllocationHandle h, retained;
  size_t gran;
  primary(0);
  check(cuMemGetAllocationGranularity(&gran, &prop, 0), "cuMemGetAllocationGranularity");
  host_located(gran);
  mem_info("before");
  check(cuMemCreate(&h, VMM_BYTES, &prop, 0), "cuMemCreate");
  CUdeviceptr p = map_rw(h, VMM_BYTES, gran);
  fill(p, 0x6b, 4096);
  check(cuMemRetainAllocationHandle(&retained, (void *)(uintptr_t)(p + 4096)), "cuMemRetainAllocationHandle");
  printf("retained_same=%d\n", retained == h);
  check(cuMemRelease(retained), "cuMemRelease(retained)");
  expect(cuMemExportToShareableHandle(&gran, h, type == FABRIC ? POSIX_FD : FABRIC, 0), 1,
         "export_unrequested");
  mem_info("exporter");
  fflush(stdout);
  if (type == POSIX_FD) {
    int fd = -1;
    check(cuMemExportToShareableHandle(&fd, h, POSIX_FD, 0), "cuMemExportToShareableHandle(fd)");
    send_fd(s, fd);
    close(fd);
  } else {
    CUmemFabricHandle fh;
    check(cuMemExportToShareableHandle(&fh, h, FABRIC, 0), "cuMemExportToShareableHandle(fabric)");
    send_all(s, &fh, sizeof fh);
  }
  char done;
  recv_all(s, &done, 1);
  printf("written_by_opener=%d\n", byte_at(p, 1));
  check(cuMemUnmap(p, VMM_BYTES), "cuMemUnmap");
  check(cuMemAddressFree(p, VMM_BYTES), "cuMemAddressFree");
  check(cuMemRelease(h), "cuMemRelease");
}

static void open_vmm(int s, int type) {
  CUmemGenericAllocationHandle h;
  CUmemAllocationProp prop;
  int fd = -1;
  CUmemFabricHandle fh;
  if (type == POSIX_FD)
    fd = recv_fd(s);
  else
    recv_all(s, &fh, sizeof fh);
  primary(0);
  if (type == POSIX_FD) {
    check(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, POSIX_FD), "cuMemImportFromShareableHandle(fd)");
    close(fd); /* p2p.cc closes its copy after the import */
  } else {
    check(cuMemImportFromShareableHandle(&h, &fh, FABRIC), "cuMemImportFromShareableHandle(fabric)");
  }
  check(cuMemGetAllocationPropertiesFromHandle(&prop, h), "cuMemGetAllocationPropertiesFromHandle");
  printf("prop_location=%d:%d\n", prop.location.type, prop.location.id);
  size_t gran;
  check(cuMemGetAllocationGranularity(&gran, &prop, 0), "cuMemGetAllocationGranularity");
  CUdeviceptr p = map_rw(h, VMM_BYTES, gran);
  printf("byte=%d\n", byte_at(p, 0));
  fill(p + 1, 0x44, 1);
  mem_info("opener");
  pause_opened();
  nvml_view("opener");
  check(cuMemUnmap(p, VMM_BYTES), "cuMemUnmap");
  check(cuMemAddressFree(p, VMM_BYTES), "cuMemAddressFree");
  check(cuMemRelease(h), "cuMemRelease");
  send_all(s, "d", 1);
}

/* ---- peer access between the GPUs of one process ---- */

static void peer(void) {
  CUcontext c[3];
  CUdevice dev[3];
  int can01, can02;
  check(cuInit(0), "cuInit");
  for (int i = 0; i < 3; i++) {
    check(cuDeviceGet(&dev[i], i), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&c[i], dev[i]), "cuDevicePrimaryCtxRetain");
  }
  check(cuDeviceCanAccessPeer(&can01, dev[0], dev[1]), "cuDeviceCanAccessPeer");
  check(cuDeviceCanAccessPeer(&can02, dev[0], dev[2]), "cuDeviceCanAccessPeer");
  printf("can_0_1=%d\ncan_0_2=%d\n", can01, can02);
  check(cuCtxSetCurrent(c[0]), "cuCtxSetCurrent");
  expect(cuCtxDisablePeerAccess(c[1]), 705, "disable_before");
  expect(cuCtxEnablePeerAccess(c[1], 0), 0, "enable_1");
  expect(cuCtxEnablePeerAccess(c[1], 0), 704, "enable_1_again");
  expect(cuCtxEnablePeerAccess(c[2], 0), 217, "enable_2");
  expect(cuCtxEnablePeerAccess(c[0], 0), 101, "enable_self");
  /* A VMM mapping on device 0 that device 1 (a peer) and device 2 (not) ask
   * to access. */
  CUmemAllocationProp prop = prop_for(LOC_DEVICE, 0, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v;
  size_t gran;
  check(cuMemGetAllocationGranularity(&gran, &prop, 0), "cuMemGetAllocationGranularity");
  check(cuMemCreate(&h, VMM_BYTES, &prop, 0), "cuMemCreate");
  v = map_rw(h, VMM_BYTES, gran);
  CUmemAccessDesc to1 = {{LOC_DEVICE, 1}, 3}, to2 = {{LOC_DEVICE, 2}, 3};
  expect(cuMemSetAccess(v, VMM_BYTES, &to1, 1), 0, "access_1");
  expect(cuMemSetAccess(v, VMM_BYTES, &to2, 1), 101, "access_2");
  /* cuMemcpyPeer between the two devices' allocations. */
  CUdeviceptr a, b;
  check(cuMemAlloc_v2(&a, 4096), "cuMemAlloc(0)");
  fill(a, 0x21, 4096);
  check(cuCtxSetCurrent(c[1]), "cuCtxSetCurrent");
  check(cuMemAlloc_v2(&b, 4096), "cuMemAlloc(1)");
  check(cuMemcpyPeer(b, c[1], a, c[0], 4096), "cuMemcpyPeer");
  printf("peer_copied=%d\n", byte_at(b, 7));
  check(cuCtxSetCurrent(c[0]), "cuCtxSetCurrent");
  expect(cuCtxDisablePeerAccess(c[1]), 0, "disable_1");
  expect(cuCtxDisablePeerAccess(c[1]), 705, "disable_1_again");
}

/* NCCL's ncclCuMemAlloc then ncclCuMemFree (src/include/alloc.h @5067397
 * lines 298-324 and 334-350): the free retains the handle from the address
 * and releases that reference, asks the mapping's size, unmaps, releases
 * the handle. The memory stays until that last release. */
static void ncclfree(void) {
  CUmemAllocationProp prop = prop_for(LOC_DEVICE, 0, POSIX_FD);
  CUmemGenericAllocationHandle h, again;
  size_t gran, size = 0;
  primary(0);
  check(cuMemGetAllocationGranularity(&gran, &prop, 0), "cuMemGetAllocationGranularity");
  mem_info("before");
  check(cuMemCreate(&h, VMM_BYTES, &prop, 0), "cuMemCreate");
  CUdeviceptr p = map_rw(h, VMM_BYTES, gran);
  mem_info("mapped");
  check(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)p), "cuMemRetainAllocationHandle");
  check(cuMemRelease(again), "cuMemRelease(retained)");
  check(cuMemGetAddressRange_v2(NULL, &size, p), "cuMemGetAddressRange");
  printf("range_size=%zu\n", size);
  check(cuMemUnmap(p, size), "cuMemUnmap");
  mem_info("unmapped");
  check(cuMemRelease(h), "cuMemRelease");
  mem_info("released");
  check(cuMemAddressFree(p, size), "cuMemAddressFree");
}

/* PyTorch's expandable segment (c10/cuda/CUDACachingAllocator.cpp,
 * ExpandableSegment: one address range reserved up front, a handle
 * created and mapped per step at the end of what is mapped, then one
 * cuMemSetAccess over the whole newly mapped range; v2.6.0 lines 401-411,
 * 553 and 559): access and copies span the handles. */
static void segments(void) {
  CUmemAllocationProp prop = prop_for(LOC_DEVICE, 0, POSIX_FD);
  CUmemGenericAllocationHandle h[2];
  CUmemAccessDesc a = {{LOC_DEVICE, 0}, 3};
  CUdeviceptr base;
  size_t gran;
  primary(0);
  check(cuMemGetAllocationGranularity(&gran, &prop, 0), "cuMemGetAllocationGranularity");
  mem_info("before");
  check(cuMemAddressReserve(&base, 4 * VMM_BYTES, gran, 0, 0), "cuMemAddressReserve");
  for (int i = 0; i < 2; i++) {
    check(cuMemCreate(&h[i], VMM_BYTES, &prop, 0), "cuMemCreate");
    check(cuMemMap(base + i * VMM_BYTES, VMM_BYTES, 0, h[i], 0), "cuMemMap");
  }
  check(cuMemSetAccess(base, 2 * VMM_BYTES, &a, 1), "cuMemSetAccess(across)");
  fill(base + VMM_BYTES - 2048, 0x7e, 4096);
  printf("across=%d\n", byte_at(base + VMM_BYTES + 1, 0));
  expect(cuMemSetAccess(base, 3 * VMM_BYTES, &a, 1), 1, "access_past_mapped");
  mem_info("mapped");
  for (int i = 0; i < 2; i++) {
    check(cuMemUnmap(base + i * VMM_BYTES, VMM_BYTES), "cuMemUnmap");
    check(cuMemRelease(h[i]), "cuMemRelease");
  }
  check(cuMemAddressFree(base, 4 * VMM_BYTES), "cuMemAddressFree");
  mem_info("after");
}

/* Under a quota that fits a context and a little more: host-located VMM
 * memory is not device memory (any size goes); device memory over the
 * quota is CUDA_ERROR_OUT_OF_MEMORY at the call, by every path, and the
 * process goes on. */
static void quota(void) {
  CUmemAllocationProp dev = prop_for(LOC_DEVICE, 0, POSIX_FD);
  CUmemAllocationProp host = prop_for(LOC_HOST_NUMA, 0, POSIX_FD);
  CUmemGenericAllocationHandle h;
  CUdeviceptr p;
  size_t gran;
  primary(0);
  check(cuMemGetAllocationGranularity(&gran, &dev, 0), "cuMemGetAllocationGranularity");
  mem_info("start");
  expect(cuMemCreate(&h, 4 * VMM_BYTES, &host, 0), 0, "create_host");
  mem_info("host");
  expect(cuMemCreate(&h, VMM_BYTES, &dev, 0), 2, "create_device");
  expect(cuMemAlloc_v2(&p, VMM_BYTES), 2, "alloc_device");
  expect(cuMemAlloc_v2(&p, 2 * MIB), 0, "alloc_small");
  check(cuMemFree_v2(p), "cuMemFree");
  mem_info("end");
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc == 2 && !strcmp(argv[1], "quota")) {
    quota();
  } else if (argc == 2 && !strcmp(argv[1], "ncclfree")) {
    ncclfree();
  } else if (argc == 2 && !strcmp(argv[1], "segments")) {
    segments();
  } else if (argc == 2 && !strcmp(argv[1], "peer")) {
    peer();
  } else if (argc == 4) {
    int serve = !strcmp(argv[1], "serve");
    const char *mode = argv[3];
    int s = serve ? listen_on(argv[2]) : connect_to(argv[2]);
    int type = !strcmp(mode, "fabric") ? FABRIC : POSIX_FD;
    if (!strcmp(mode, "ipc"))
      serve ? serve_ipc(s) : open_ipc(s);
    else
      serve ? serve_vmm(s, type) : open_vmm(s, type);
    close(s);
  } else {
    fprintf(stderr, "usage: %s serve|open SOCK ipc|fd|fabric, or %s peer\n", argv[0], argv[0]);
    return 2;
  }
  printf("ok=1\n");
  return 0;
}
