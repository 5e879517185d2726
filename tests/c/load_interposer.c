/* Loads the interposer given as argv[1] the way a CUDA program's loader
 * would (dlopen, RTLD_NOW: every symbol and version resolved up front) and
 * calls one wrapped entry point (cuInit) and one forwarded one
 * (cuDriverGetVersion, through a trampoline and the resolver). Run by
 * tests/glibc_floor.rs inside an old distribution's root: built with
 * `zig cc -target x86_64-linux-gnu.2.17` so it loads there itself.
 * Prints "loaded", then "cuInit <rc>" and "cuDriverGetVersion <rc>". */
#include <dlfcn.h>
#include <stdio.h>

typedef int (*init_fn)(unsigned int);
typedef int (*version_fn)(int *);

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <libvcuda.so>\n", argv[0]);
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    printf("loaded\n");
    init_fn init = (init_fn)dlsym(h, "cuInit");
    version_fn version = (version_fn)dlsym(h, "cuDriverGetVersion");
    if (!init || !version) {
        fprintf(stderr, "dlsym failed: %s\n", dlerror());
        return 1;
    }
    printf("cuInit %d\n", init(0));
    int v = 0;
    printf("cuDriverGetVersion %d\n", version(&v));
    fflush(stdout);
    return 0;
}
