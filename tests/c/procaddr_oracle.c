/* Asks a libcuda (NVIDIA's real one, the interposer over it, or the
 * simulator's) cuGetProcAddress for every query on stdin and prints what it
 * answered, so tests/nvidia_procaddr.rs can compare two libraries' answers.
 *
 *   procaddr_oracle LIBCUDA < queries
 *   query:  NAME VERSION FLAGS           (one per line; NAME "-" = empty)
 *   answer: NAME VERSION FLAGS R2 STATUS2 WHAT2 R1 WHAT1
 *
 * R2/STATUS2: cuGetProcAddress_v2's CUresult and CUdriverProcAddressQueryResult
 * (-1 when it did not write it); R1: the CUDA 11.3 cuGetProcAddress's
 * CUresult. WHAT: "null", or "SYMBOL@FILE" where the pointer is exactly an
 * exported symbol of a loaded object (dladdr; FILE is the object's basename),
 * "internal:SYMBOL@FILE" where it is a `jmp` thunk to an export, or
 * "internal@FILE+0xOFFSET" where it is inside an object but no exported
 * symbol starts there, or "untouched" when it was not written. Signatures: cuda.h of CUDA 12.x
 * (cuGetProcAddress_v2(const char*, void**, int, cuuint64_t,
 * CUdriverProcAddressQueryResult*)). cuInit is called first when argv[2] is
 * "init" (its status is printed on stderr, as cuDriverGetVersion's always is:
 * "cuDriverGetVersion: RESULT VERSION").
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int (*get_v1)(const char *, void **, int, uint64_t);
typedef int (*get_v2)(const char *, void **, int, uint64_t, int *);
typedef int (*init_fn)(unsigned);
typedef int (*version_fn)(int *);

/* What the out-pointer holds before the call: "untouched" if left so. */
#define UNTOUCHED ((void *)0x1)

static void describe(void *p, char *out, size_t n) {
    Dl_info info;
    if (!p) {
        snprintf(out, n, "null");
        return;
    }
    if (p == UNTOUCHED) {
        snprintf(out, n, "untouched");
        return;
    }
    if (!dladdr(p, &info) || !info.dli_fname) {
        snprintf(out, n, "unmapped");
        return;
    }
    const char *file = strrchr(info.dli_fname, '/');
    file = file ? file + 1 : info.dli_fname;
    if (info.dli_sname && info.dli_saddr == p) {
        snprintf(out, n, "%s@%s", info.dli_sname, file);
        return;
    }
    /* A thunk `jmp rel32` to an export (the simulator's internal entries). */
    Dl_info to;
    const unsigned char *c = p;
    if (c[0] == 0xE9) {
        int32_t rel;
        memcpy(&rel, c + 1, 4);
        void *t = (void *)(c + 5 + rel);
        if (dladdr(t, &to) && to.dli_sname && to.dli_saddr == t) {
            snprintf(out, n, "internal:%s@%s", to.dli_sname, file);
            return;
        }
    }
        snprintf(out, n, "internal@%s+0x%lx", file,
                 (unsigned long)((char *)p - (char *)info.dli_fbase));
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s LIBCUDA [init] < queries\n", argv[0]);
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
        return 2;
    }
    get_v1 v1 = (get_v1)dlsym(h, "cuGetProcAddress");
    get_v2 v2 = (get_v2)dlsym(h, "cuGetProcAddress_v2");
    if (!v1 || !v2) {
        fprintf(stderr, "%s exports no cuGetProcAddress/_v2\n", argv[1]);
        return 2;
    }
    version_fn dv = (version_fn)dlsym(h, "cuDriverGetVersion");
    int driver = 0;
    int dr = dv ? dv(&driver) : -999;
    fprintf(stderr, "cuDriverGetVersion: %d %d\n", dr, driver);
    if (argc > 2 && strcmp(argv[2], "init") == 0) {
        init_fn init = (init_fn)dlsym(h, "cuInit");
        fprintf(stderr, "cuInit: %d\n", init ? init(0) : -999);
    }
    char name[256];
    int version;
    unsigned long long flags;
    while (scanf("%255s %d %llu", name, &version, &flags) == 3) {
        const char *sym = strcmp(name, "-") == 0 ? "" : name;
        void *p2 = UNTOUCHED, *p1 = UNTOUCHED;
        int status = -1;
        int r2 = v2(sym, &p2, version, flags, &status);
        int r1 = v1(sym, &p1, version, flags);
        char w2[512], w1[512];
        describe(p2, w2, sizeof w2);
        describe(p1, w1, sizeof w1);
        printf("%s %d %llu %d %d %s %d %s\n", name, version, flags, r2, status, w2, r1, w1);
    }
    return 0;
}
