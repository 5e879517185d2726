/* A program of NVIDIA's CUDA runtime (linked with the real libcudart.so.12 or .13,
 * no CUDA headers needed): what tests/sim_cudart.rs runs on the simulated
 * node, directly and under the interposer.
 *
 * Its kernel comes the way nvcc's host code brings it: a fatbinary in
 * .nv_fatbin, its __fatBinC_Wrapper_t in .nvFatBinSegment, registered by a
 * constructor with __cudaRegisterFatBinary / __cudaRegisterFunction /
 * __cudaRegisterFatBinaryEnd, launched through a host stub that pops the
 * <<<>>> configuration and calls cudaLaunchKernel. The fatbinary holds the
 * kernel's PTX (a real GPU would JIT it; the simulator only times it).
 *
 * Modes (key=value lines on stdout; exit 1 on an unexpected error):
 *   info          device count, properties, memory info, versions
 *   oom MIB       cudaMalloc MIB-sized blocks until one fails
 *   kernel N      N launches of 4096 blocks x 256 threads, timed by events
 *   graph N K     N launches captured into a graph, replayed K times
 *   saturate S    launches for S seconds, synchronizing every 64 (a loop
 *                 that waits for its results, as training steps do)
 *   reset         a kernel, cudaDeviceReset, the kernel again (the runtime
 *                 drops its context state and reloads its modules)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

typedef struct { unsigned x, y, z; } dim3;
typedef void *stream_t;

extern int cudaGetDeviceCount(int *);
extern int cudaDeviceGetAttribute(int *, int, int);
extern int cudaMemGetInfo(size_t *, size_t *);
extern int cudaMalloc(void **, size_t);
extern int cudaFree(void *);
extern int cudaDriverGetVersion(int *);
extern int cudaRuntimeGetVersion(int *);
extern int cudaDeviceSynchronize(void);
extern int cudaDeviceReset(void);
extern int cudaGetLastError(void);
extern const char *cudaGetErrorName(int);
extern int cudaStreamCreate(stream_t *);
extern int cudaStreamSynchronize(stream_t);
extern int cudaStreamBeginCapture(stream_t, int);
extern int cudaStreamEndCapture(stream_t, void **);
extern int cudaGraphGetNodes(void *, void **, size_t *);
extern int cudaGraphInstantiate(void **, void *, unsigned long long);
extern int cudaGraphLaunch(void *, stream_t);
extern int cudaEventCreate(void **);
extern int cudaEventRecord(void *, stream_t);
extern int cudaEventSynchronize(void *);
extern int cudaEventElapsedTime(float *, void *, void *);
extern int cudaLaunchKernel(const void *, dim3, dim3, void **, size_t, stream_t);
extern void **__cudaRegisterFatBinary(void *);
extern void __cudaRegisterFatBinaryEnd(void **);
extern void __cudaUnregisterFatBinary(void **);
extern void __cudaRegisterFunction(void **, const char *, char *, const char *, int, void *,
                                   void *, void *, void *, int *);
extern unsigned __cudaPushCallConfiguration(dim3, dim3, size_t, stream_t);
extern int __cudaPopCallConfiguration(dim3 *, dim3 *, size_t *, stream_t *);

#define CHECK(call)                                                                     \
    do {                                                                                \
        int e_ = (call);                                                                \
        if (e_ != 0) {                                                                  \
            printf("error=%s call=%s line=%d\n", cudaGetErrorName(e_), #call, __LINE__); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

/* ---- the fatbinary, laid out as nvcc's fatbinary tool writes it ---- */

#define KERNEL_NAME "_Z4spinPfi"
#define PTX                                                        \
    ".version 7.0\n.target sm_50\n.address_size 64\n\n"            \
    ".visible .entry " KERNEL_NAME "(\n"                           \
    "\t.param .u64 " KERNEL_NAME "_param_0,\n"                     \
    "\t.param .u32 " KERNEL_NAME "_param_1\n)\n{\n\tret;\n}\n"
#define PTX_BYTES ((sizeof(PTX) + 7) / 8 * 8)

struct fatbin_entry { /* one file of the fatbinary: a PTX text here */
    uint16_t kind;    /* 1 PTX, 2 ELF */
    uint16_t version; /* 0x0101 */
    uint32_t header_size;
    uint64_t payload_size;
    uint32_t compressed_size;
    uint32_t unknown0;
    uint32_t unknown1;
    uint32_t sm_version; /* 50: compute_50 */
    uint32_t bit_width;
    uint32_t unknown2;
    uint64_t flags; /* 64-bit, Linux */
    uint64_t unknown3;
    uint64_t uncompressed_size;
};

struct fatbin {
    uint32_t magic; /* 0xBA55ED50 */
    uint16_t version;
    uint16_t header_size;
    uint64_t fat_size; /* bytes after this header */
    struct fatbin_entry entry;
    char ptx[PTX_BYTES];
};

__attribute__((section(".nv_fatbin"), aligned(8))) static const struct fatbin FATBIN = {
    .magic = 0xBA55ED50,
    .version = 1,
    .header_size = 16,
    .fat_size = sizeof(struct fatbin_entry) + PTX_BYTES,
    .entry = {.kind = 1,
              .version = 0x0101,
              .header_size = sizeof(struct fatbin_entry),
              .payload_size = PTX_BYTES,
              .sm_version = 50,
              .bit_width = 64,
              .flags = 0x11,
              .uncompressed_size = 0},
    .ptx = PTX,
};

struct fatbin_wrapper {
    uint32_t magic; /* 0x466243B1 */
    uint32_t version;
    const void *data;
    const void *filename_or_fatbins;
};

__attribute__((section(".nvFatBinSegment"), aligned(8))) static const struct fatbin_wrapper
    WRAPPER = {0x466243B1, 1, &FATBIN, 0};

static void **fatbin_handle;

/* The host stub nvcc generates for `__global__ void spin(float *, int)`. */
static void spin(float *p, int n) {
    void *args[] = {&p, &n};
    dim3 grid, block;
    size_t shmem;
    stream_t stream;
    if (__cudaPopCallConfiguration(&grid, &block, &shmem, &stream) != 0) return;
    cudaLaunchKernel((const void *)spin, grid, block, args, shmem, stream);
}

static void unregister(void) { __cudaUnregisterFatBinary(fatbin_handle); }

__attribute__((constructor)) static void register_fatbin(void) {
    fatbin_handle = __cudaRegisterFatBinary((void *)&WRAPPER);
    __cudaRegisterFunction(fatbin_handle, (const char *)spin, (char *)KERNEL_NAME, KERNEL_NAME,
                           -1, 0, 0, 0, 0, 0);
    __cudaRegisterFatBinaryEnd(fatbin_handle);
    atexit(unregister);
}

/* spin<<<4096, 256, 0, stream>>>(p, n) */
static void launch(stream_t stream, float *p, int n) {
    dim3 grid = {4096, 1, 1}, block = {256, 1, 1};
    if (__cudaPushCallConfiguration(grid, block, 0, stream) == 0) spin(p, n);
    CHECK(cudaGetLastError());
}

static double now_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, 0);
    return tv.tv_sec * 1e3 + tv.tv_usec / 1e3;
}

/* ---- modes ---- */

static void info(void) {
    int count = -1, driver = 0, runtime = 0;
    CHECK(cudaGetDeviceCount(&count));
    CHECK(cudaDriverGetVersion(&driver));
    CHECK(cudaRuntimeGetVersion(&runtime));
    printf("count=%d\ndriver=%d\nruntime=%d\n", count, driver, runtime);
    for (int d = 0; d < count; d++) {
        /* cudaDeviceProp of CUDA 12 and 13: name at 0, totalGlobalMem at 288.
         * 12's headers call cudaGetDeviceProperties_v2 (the unsuffixed one is
         * 11's), 13 has only the unsuffixed one. */
        static char prop[4096];
        int (*get_props)(void *, int) = dlsym(RTLD_DEFAULT, "cudaGetDeviceProperties_v2");
        if (!get_props) get_props = dlsym(RTLD_DEFAULT, "cudaGetDeviceProperties");
        CHECK(get_props(prop, d));
        size_t total_mem;
        memcpy(&total_mem, prop + 288, sizeof total_mem);
        int sms = 0, major = 0, minor = 0;
        CHECK(cudaDeviceGetAttribute(&sms, 16, d));   /* cudaDevAttrMultiProcessorCount */
        CHECK(cudaDeviceGetAttribute(&major, 75, d)); /* ComputeCapabilityMajor */
        CHECK(cudaDeviceGetAttribute(&minor, 76, d)); /* ComputeCapabilityMinor */
        printf("dev%d.name=%s\ndev%d.total_mib=%zu\ndev%d.sms=%d\ndev%d.cc=%d.%d\n", d, prop, d,
               total_mem >> 20, d, sms, d, major, minor);
    }
    size_t free_b = 0, total_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("free_mib=%zu\ntotal_mib=%zu\n", free_b >> 20, total_b >> 20);
}

static void oom(size_t mib) {
    size_t free_b = 0, total_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("free_mib=%zu\ntotal_mib=%zu\n", free_b >> 20, total_b >> 20);
    void *blocks[4096];
    int n = 0, e = 0;
    while (n < 4096 && (e = cudaMalloc(&blocks[n], mib << 20)) == 0) n++;
    printf("allocated_mib=%zu\nrefused=%s\n", (size_t)n * mib, cudaGetErrorName(e));
    /* The failed allocation is not sticky: the next call works. */
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("free_after_mib=%zu\n", free_b >> 20);
    for (int i = 0; i < n; i++) CHECK(cudaFree(blocks[i]));
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("free_end_mib=%zu\n", free_b >> 20);
}

static float *device_buffer(void) {
    void *p = 0;
    CHECK(cudaMalloc(&p, 1 << 20));
    return p;
}

static void kernel(int n) {
    float *p = device_buffer();
    void *start, *stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    double t0 = now_ms();
    CHECK(cudaEventRecord(start, 0));
    for (int i = 0; i < n; i++) launch(0, p, 1 << 18);
    CHECK(cudaEventRecord(stop, 0));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    CHECK(cudaDeviceSynchronize());
    printf("launches=%d\ndevice_ms=%.3f\nwall_ms=%.3f\n", n, ms, now_ms() - t0);
    CHECK(cudaFree(p));
}

static void graph(int n, int k) {
    float *p = device_buffer();
    stream_t s;
    CHECK(cudaStreamCreate(&s));
    void *g = 0, *exec = 0;
    CHECK(cudaStreamBeginCapture(s, 0 /* cudaStreamCaptureModeGlobal */));
    for (int i = 0; i < n; i++) launch(s, p, 1 << 18);
    CHECK(cudaStreamEndCapture(s, &g));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(g, 0, &nodes));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    void *start, *stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    double t0 = now_ms();
    CHECK(cudaEventRecord(start, s));
    for (int i = 0; i < k; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(stop, s));
    CHECK(cudaStreamSynchronize(s));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    printf("nodes=%zu\nreplays=%d\ndevice_ms=%.3f\nwall_ms=%.3f\n", nodes, k, ms, now_ms() - t0);
    CHECK(cudaFree(p));
}

static void saturate(double seconds) {
    float *p = device_buffer();
    double t0 = now_ms();
    long n = 0;
    while (now_ms() - t0 < seconds * 1e3) {
        for (int i = 0; i < 64; i++) launch(0, p, 1 << 18);
        CHECK(cudaStreamSynchronize(0));
        n += 64;
    }
    printf("launches=%ld\nwall_ms=%.3f\n", n, now_ms() - t0);
    CHECK(cudaFree(p));
}

static void reset(void) {
    size_t before = 0, after = 0, total = 0;
    for (int round = 0; round < 2; round++) {
        float *p = device_buffer();
        launch(0, p, 1 << 18);
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemGetInfo(round ? &after : &before, &total));
        CHECK(cudaDeviceReset());
    }
    printf("free_mib=%zu\nfree_again_mib=%zu\n", before >> 20, after >> 20);
}

int main(int argc, char **argv) {
    setvbuf(stdout, 0, _IONBF, 0);
    const char *mode = argc > 1 ? argv[1] : "info";
    if (!strcmp(mode, "info")) {
        info();
    } else if (!strcmp(mode, "oom") && argc > 2) {
        oom(strtoul(argv[2], 0, 10));
    } else if (!strcmp(mode, "kernel") && argc > 2) {
        kernel(atoi(argv[2]));
    } else if (!strcmp(mode, "graph") && argc > 3) {
        graph(atoi(argv[2]), atoi(argv[3]));
    } else if (!strcmp(mode, "reset")) {
        reset();
    } else if (!strcmp(mode, "saturate") && argc > 2) {
        saturate(atof(argv[2]));
    } else {
        fprintf(stderr, "usage: sim_cudart info | oom MIB | kernel N | graph N K | saturate S | reset\n");
        return 2;
    }
    printf("ok\n");
    return 0;
}
