/* LD_PRELOAD probe: which private NVML tables nvidia-smi asks for, and what it
 * does without them.  nvidia-smi dlopens libnvidia-ml.so.1 and resolves its
 * functions with dlsym; this library replaces dlsym, hands out a wrapper for
 * nvmlInternalGetExportTable, logs each table id (16 bytes, hex) and the
 * status, and refuses (NULL, NVML_ERROR_NOT_SUPPORTED) the ids listed in
 * PROBE_REFUSE ("all" refuses every one).  PROBE_NAMES=1 logs every name
 * resolved.  Build: cc -shared -fPIC -o smi_tables.so smi_tables.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*get_table_t)(const void **, const unsigned char *);
static get_table_t real_get;

static void *real_dlsym(void *h, const char *name) {
    static void *(*f)(void *, const char *);
    if (!f)
        f = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!f)
        f = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    return f(h, name);
}

static int get_table(const void **table, const unsigned char *id) {
    char hex[33];
    for (int i = 0; i < 16; i++)
        sprintf(hex + 2 * i, "%02x", id ? id[i] : 0);
    const char *refuse = getenv("PROBE_REFUSE");
    int refused = refuse && (!strcmp(refuse, "all") || strstr(refuse, hex));
    int r;
    if (refused) {
        if (table)
            *table = NULL;
        r = 3; /* NVML_ERROR_NOT_SUPPORTED */
    } else {
        r = real_get(table, id);
    }
    fprintf(stderr, "probe: table %s -> %d%s\n", hex, r, refused ? " (refused)" : "");
    return r;
}

void *dlsym(void *h, const char *name) {
    void *p = real_dlsym(h, name);
    if (getenv("PROBE_NAMES"))
        fprintf(stderr, "probe: dlsym %s%s\n", name, p ? "" : " (missing)");
    if (p && !strcmp(name, "nvmlInternalGetExportTable")) {
        real_get = (get_table_t)p;
        return (void *)get_table;
    }
    return p;
}
