// A CUDA C++ program compiled by NVIDIA's nvcc (PyPI's CUDA 13 toolchain
// wheels): its kernel is a real sm_80 cubin and PTX in the fatbinary nvcc
// embeds, registered and launched by nvcc's own host code through
// libcudart. On the simulated node the kernel computes nothing; the
// simulator times it. What tests/sim_cudart.rs runs, directly and under the
// interposer.
//
// Modes (key=value lines on stdout, "ok" last; exit 1 on an error):
//   kernel N     N launches of scale<<<4096, 256>>>, timed by events
//   graph N K    N launches captured into a graph, replayed K times
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(call)                                                                  \
    do {                                                                             \
        cudaError_t e_ = (call);                                                     \
        if (e_ != cudaSuccess) {                                                     \
            printf("error=%s call=%s line=%d\n", cudaGetErrorName(e_), #call, __LINE__); \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

__global__ void scale(float *p, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= a;
}

static const int N = 4096 * 256;

static void kernel(int launches) {
    float *p;
    CHECK(cudaMalloc(&p, N * sizeof(float)));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < launches; i++) scale<<<N / 256, 256>>>(p, 2.0f, N);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    printf("launches=%d\ndevice_ms=%.3f\n", launches, ms);
    CHECK(cudaFree(p));
}

static void graph(int n, int k) {
    float *p;
    CHECK(cudaMalloc(&p, N * sizeof(float)));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaGraph_t g;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; i++) scale<<<N / 256, 256, 0, s>>>(p, 2.0f, N);
    CHECK(cudaStreamEndCapture(s, &g));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start, s));
    for (int i = 0; i < k; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(stop, s));
    CHECK(cudaStreamSynchronize(s));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    printf("nodes=%zu\nreplays=%d\ndevice_ms=%.3f\n", nodes, k, ms);
    CHECK(cudaFree(p));
}

int main(int argc, char **argv) {
    setvbuf(stdout, nullptr, _IONBF, 0);
    if (argc > 2 && !strcmp(argv[1], "kernel")) {
        kernel(atoi(argv[2]));
    } else if (argc > 3 && !strcmp(argv[1], "graph")) {
        graph(atoi(argv[2]), atoi(argv[3]));
    } else {
        fprintf(stderr, "usage: sim_cudart_nvcc kernel N | graph N K\n");
        return 2;
    }
    printf("ok\n");
    return 0;
}
