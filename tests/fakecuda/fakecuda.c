/* fakecuda: a stand-in libcuda.so.1 implementing the CUDA driver VMM entry points over
 * host memory, so cuda-python (cuda.bindings.driver) code can run on a machine without
 * an NVIDIA GPU. Physical allocations (cuMemCreate) are memfds committed with fallocate;
 * a reservation (cuMemAddressReserve) is a PROT_NONE anonymous mapping; cuMemMap maps the
 * memfd MAP_FIXED over it (still PROT_NONE), cuMemSetAccess mprotects it, cuMemUnmap puts
 * the PROT_NONE placeholder back. Touching an unmapped page from the CPU is SIGSEGV, as a
 * kernel touching it on a GPU is an illegal-address fault.
 *
 * Loaded the way cuda-bindings 12.6+/13.x loads the driver: dlopen("libcuda.so.1"), then
 * dlsym("cuGetProcAddress_v2") and every entry point through it. Functions not
 * implemented here are reported "not found" (cuda-bindings then raises only if called).
 *
 * Strict on purpose where the real driver is strict (documented behaviour):
 *  - every call before cuInit fails with CUDA_ERROR_NOT_INITIALIZED;
 *  - cuMemGetInfo needs a current context (CUDA_ERROR_INVALID_CONTEXT);
 *  - sizes/addresses must be multiples of the granularity (FAKECUDA_GRANULARITY, 2 MiB);
 *  - cuMemMap only into a reserved range, never over a mapped one;
 *  - cuMemSetAccess / cuMemUnmap only on ranges made of whole mappings, no holes;
 *  - cuMemAddressFree only of a whole reservation with nothing mapped in it;
 *  - cuMemCreate fails with CUDA_ERROR_OUT_OF_MEMORY above FAKECUDA_TOTAL_MB.
 * Build: cc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fakecuda.c -lpthread
 *   (the SONAME lets a test preload it in-process: ctypes.CDLL(path, RTLD_GLOBAL) before the
 *   first cuda-bindings call; cuda.pathfinder then finds it "already loaded", no LD_LIBRARY_PATH)
 * Env: FAKECUDA_DEVICES (1), FAKECUDA_TOTAL_MB (4096), FAKECUDA_GRANULARITY (2097152),
 *      FAKECUDA_STRICT_CTX (0: only cuMemGetInfo needs a context; 1: every cuMem* call),
 *      FAKECUDA_LOG (path: one line per call), FAKECUDA_DRIVER_VERSION (13000),
 *      FAKECUDA_FAIL (name:after:count:err,...: injected failures, see fakecuda_fail below).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;                 /* CUmemAllocationType: 1 = PINNED */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage;
             unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

enum {
    CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3, CUDA_ERROR_NO_DEVICE = 100, CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201, CUDA_ERROR_INVALID_HANDLE = 400, CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_PERMITTED = 800, CUDA_ERROR_NOT_SUPPORTED = 801,
};

#define MAXDEV 8
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized, ndev = 1, strict_ctx;
static size_t gran = 2u << 20, total_bytes = 4096ull << 20, used_bytes;
static FILE *logf_;
static int primary_refs[MAXDEV];
static char primary_ctx[MAXDEV]; /* CUcontext = &primary_ctx[dev] */
static __thread CUcontext current;

typedef struct Handle { int fd, device, released; size_t size; int maps; } Handle;
typedef struct { uintptr_t base; size_t size; } Reservation;
typedef struct { uintptr_t addr; size_t size; Handle *h; int prot; } Mapping;

static Reservation *resv; static size_t nresv, capresv;
static Mapping *maps; static size_t nmaps, capmaps;

static void lg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void lg(const char *fmt, ...) {
    if (!logf_) return;
    va_list ap; va_start(ap, fmt); vfprintf(logf_, fmt, ap); va_end(ap);
    fputc('\n', logf_); fflush(logf_);
}

static void load_env(void) {
    const char *s;
    if ((s = getenv("FAKECUDA_DEVICES"))) ndev = atoi(s);
    if (ndev > MAXDEV) ndev = MAXDEV;
    if ((s = getenv("FAKECUDA_TOTAL_MB"))) total_bytes = (size_t)atoll(s) << 20;
    if ((s = getenv("FAKECUDA_GRANULARITY"))) gran = (size_t)atoll(s);
    if ((s = getenv("FAKECUDA_STRICT_CTX"))) strict_ctx = atoi(s);
    if ((s = getenv("FAKECUDA_LOG")) && !logf_) logf_ = fopen(s, "a");
}

/* Test knobs (not CUDA APIs): per-entry-point call counters and fault injection.
 * fakecuda_fail(name, after, count, err): the next `after` calls of `name` run normally, the
 * `count` after those return `err` without doing anything (count < 0: every one). The same
 * from the environment, read at cuInit: FAKECUDA_FAIL=name:after:count:err[,name:...].
 * fakecuda_calls(name) counts calls since fakecuda_reset_calls() (failed ones included). */
static const char *const hooked[] = {
    "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuCtxSetCurrent", "cuCtxGetCurrent",
    "cuCtxSynchronize", "cuMemGetInfo", "cuMemGetAllocationGranularity", "cuMemAddressReserve",
    "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
    "cuMemGetAccess", "cuEventRecord", "cuEventSynchronize",
};
#define NHOOK ((int)(sizeof hooked / sizeof *hooked))
static struct { long calls, skip, fail; int err; } knob[sizeof hooked / sizeof *hooked];
static int hook_index(const char *name) {
    for (int i = 0; i < NHOOK; i++) if (name && !strcmp(hooked[i], name)) return i;
    return -1;
}
static CUresult hook_enter(int i) {
    pthread_mutex_lock(&mu);
    knob[i].calls++;
    CUresult rc = 0;
    if (knob[i].skip > 0) knob[i].skip--;
    else if (knob[i].fail != 0) { rc = knob[i].err; if (knob[i].fail > 0) knob[i].fail--; }
    pthread_mutex_unlock(&mu);
    if (rc) lg("%s: injected failure %d", hooked[i], rc);
    return rc;
}
#define HOOK(i) do { CUresult hook_rc_ = hook_enter(i); if (hook_rc_) return hook_rc_; } while (0)
int fakecuda_fail(const char *name, long after, long count, int err) {
    int i = hook_index(name);
    if (i < 0 || after < 0 || err <= 0) return -1;
    pthread_mutex_lock(&mu);
    knob[i].skip = after; knob[i].fail = count; knob[i].err = err;
    pthread_mutex_unlock(&mu);
    return 0;
}
long fakecuda_calls(const char *name) {
    int i = hook_index(name); if (i < 0) return -1;
    pthread_mutex_lock(&mu); long n = knob[i].calls; pthread_mutex_unlock(&mu); return n;
}
void fakecuda_reset_calls(void) {
    pthread_mutex_lock(&mu); for (int i = 0; i < NHOOK; i++) knob[i].calls = 0; pthread_mutex_unlock(&mu);
}
/* The device total (FAKECUDA_TOTAL_MB) changed at run time; refused below what is in use. */
int fakecuda_set_total_bytes(size_t total) {
    pthread_mutex_lock(&mu);
    int ok = total >= used_bytes; if (ok) total_bytes = total;
    pthread_mutex_unlock(&mu);
    return ok ? 0 : -1;
}
static void load_fail_env(void) {
    const char *s = getenv("FAKECUDA_FAIL");
    char name[64]; long after, count; int err, used;
    while (s && *s && sscanf(s, "%63[^:]:%ld:%ld:%d%n", name, &after, &count, &err, &used) == 4) {
        fakecuda_fail(name, after, count, err);
        s += used; if (*s == ',') s++;
    }
}

#define NEED_INIT() do { if (!initialized) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { if (strict_ctx && !current) return CUDA_ERROR_INVALID_CONTEXT; } while (0)

CUresult cuInit(unsigned int flags) {
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    int first = !initialized;
    if (!initialized) { load_env(); initialized = 1; }
    pthread_mutex_unlock(&mu);
    if (first) load_fail_env();
    lg("cuInit(%u)", flags);
    return ndev > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}
CUresult cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    const char *s = getenv("FAKECUDA_DRIVER_VERSION"); *v = s ? atoi(s) : 13000; return 0;
}
CUresult cuDeviceGetCount(int *n) { NEED_INIT(); if (!n) return CUDA_ERROR_INVALID_VALUE; *n = ndev; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    NEED_INIT(); if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal; return 0;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    NEED_INIT(); if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "fakecuda device %d", d); return 0;
}
/* A fixed UUID per device ordinal: fa4ec0da-0000-4000-8000-0000000000<dd>; nvidia-smi -L
 * would print it as GPU-fa4ec0da-0000-4000-8000-0000000000<dd>. */
typedef struct { char bytes[16]; } CUuuid;
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice d) {
    NEED_INIT(); if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    static const unsigned char base[16] = {0xfa, 0x4e, 0xc0, 0xda, 0, 0, 0x40, 0, 0x80, 0,
                                           0, 0, 0, 0, 0, 0};
    memcpy(uuid->bytes, base, 16); uuid->bytes[15] = (char)d;
    lg("cuDeviceGetUuid(%d)", d); return 0;
}
CUresult cuDeviceTotalMem(size_t *b, CUdevice d) {
    NEED_INIT(); if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE; *b = total_bytes; return 0;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) { HOOK(0);
    NEED_INIT(); if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu); primary_refs[d]++; pthread_mutex_unlock(&mu);
    *ctx = &primary_ctx[d]; lg("cuDevicePrimaryCtxRetain(%d) refs=%d", d, primary_refs[d]); return 0;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { HOOK(1);
    NEED_INIT(); if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    if (primary_refs[d] <= 0) { pthread_mutex_unlock(&mu); return CUDA_ERROR_INVALID_CONTEXT; }
    primary_refs[d]--; pthread_mutex_unlock(&mu);
    lg("cuDevicePrimaryCtxRelease(%d) refs=%d", d, primary_refs[d]); return 0;
}
static int ctx_device(CUcontext c) {
    for (int d = 0; d < ndev; d++) if (c == (CUcontext)&primary_ctx[d]) return d;
    return -1;
}
CUresult cuCtxSetCurrent(CUcontext c) { HOOK(2);
    NEED_INIT();
    if (c && ctx_device(c) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    current = c; lg("cuCtxSetCurrent(dev %d)", c ? ctx_device(c) : -1); return 0;
}
CUresult cuCtxGetCurrent(CUcontext *c) { HOOK(3); NEED_INIT(); *c = current; return 0; }
CUresult cuCtxGetDevice(CUdevice *d) {
    NEED_INIT(); if (!current) return CUDA_ERROR_INVALID_CONTEXT; *d = ctx_device(current); return 0;
}
CUresult cuCtxSynchronize(void) { HOOK(4); NEED_INIT(); if (!current) return CUDA_ERROR_INVALID_CONTEXT; return 0; }

/* Events: nothing runs asynchronously here, so an event is only a flag ("recorded") on a
 * context; cuEventRecord (any stream) and cuEventSynchronize are hooked, so a test can make
 * them fail as a driver in error does. Like the real driver: a context must be current to
 * create one, synchronizing a never-recorded event returns at once. */
typedef void *CUevent;
typedef void *CUstream;
typedef struct { unsigned magic; int recorded; CUcontext ctx; } Event;
#define EVENT_MAGIC 0xe7e47u
static long live_events;
static Event *as_event(CUevent e) { Event *ev = e; return ev && ev->magic == EVENT_MAGIC ? ev : NULL; }
CUresult cuEventCreate(CUevent *e, unsigned int flags) {
    (void)flags; NEED_INIT(); if (!e) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    Event *ev = calloc(1, sizeof *ev); if (!ev) return CUDA_ERROR_OUT_OF_MEMORY;
    ev->magic = EVENT_MAGIC; ev->ctx = current;
    pthread_mutex_lock(&mu); live_events++; pthread_mutex_unlock(&mu);
    *e = ev; lg("cuEventCreate -> %p", (void *)ev); return 0;
}
CUresult cuEventRecord(CUevent e, CUstream s) { HOOK(15);
    (void)s; NEED_INIT(); Event *ev = as_event(e); if (!ev) return CUDA_ERROR_INVALID_HANDLE;
    ev->recorded = 1; return 0;
}
CUresult cuEventSynchronize(CUevent e) { HOOK(16);
    NEED_INIT(); return as_event(e) ? 0 : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuEventDestroy(CUevent e) {
    NEED_INIT(); Event *ev = as_event(e); if (!ev) return CUDA_ERROR_INVALID_HANDLE;
    ev->magic = 0; free(ev);
    pthread_mutex_lock(&mu); live_events--; pthread_mutex_unlock(&mu);
    return 0;
}

CUresult cuMemGetInfo(size_t *free_, size_t *total) { HOOK(5);
    NEED_INIT();
    if (!current) return CUDA_ERROR_INVALID_CONTEXT; /* the real driver needs a context here */
    pthread_mutex_lock(&mu);
    *free_ = total_bytes - used_bytes; *total = total_bytes;
    pthread_mutex_unlock(&mu);
    return 0;
}

static int check_prop(const CUmemAllocationProp *p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (p->type != 1) return CUDA_ERROR_INVALID_VALUE;           /* PINNED */
    if (p->location.type != 1) return CUDA_ERROR_INVALID_VALUE;  /* DEVICE */
    if (p->location.id < 0 || p->location.id >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    if (p->requestedHandleTypes & ~0xF) return CUDA_ERROR_INVALID_VALUE;
    return 0;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) { HOOK(6);
    NEED_INIT(); NEED_CTX();
    int rc = check_prop(p); if (rc) return rc;
    if (option != 0 && option != 1) return CUDA_ERROR_INVALID_VALUE;
    *g = gran; return 0;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) { HOOK(7);
    NEED_INIT(); NEED_CTX();
    if (!ptr || !size || size % gran || flags) return CUDA_ERROR_INVALID_VALUE;
    if (alignment == 0) alignment = gran;
    if (alignment % gran || (alignment & (alignment - 1))) return CUDA_ERROR_INVALID_VALUE;
    (void)addr; /* a hint only */
    size_t len = size + alignment;
    void *raw = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)raw + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    uintptr_t end = base + size, rawend = (uintptr_t)raw + len;
    if (rawend > end) munmap((void *)end, rawend - end);
    pthread_mutex_lock(&mu);
    if (nresv == capresv) { capresv = capresv ? 2 * capresv : 16; resv = realloc(resv, capresv * sizeof *resv); }
    resv[nresv++] = (Reservation){base, size};
    pthread_mutex_unlock(&mu);
    *ptr = base; lg("cuMemAddressReserve(%zu, %zu) = %#lx", size, alignment, (unsigned long)base);
    return 0;
}

static Reservation *find_resv(uintptr_t a, size_t size) {
    for (size_t i = 0; i < nresv; i++)
        if (a >= resv[i].base && a + size <= resv[i].base + resv[i].size) return &resv[i];
    return NULL;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { HOOK(8);
    NEED_INIT(); NEED_CTX();
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < nresv; i++) {
        if (resv[i].base == ptr && resv[i].size == size) {
            for (size_t j = 0; j < nmaps; j++)
                if (maps[j].addr >= ptr && maps[j].addr < ptr + size) {
                    pthread_mutex_unlock(&mu); lg("cuMemAddressFree: range still mapped");
                    return CUDA_ERROR_INVALID_VALUE;
                }
            munmap((void *)ptr, size);
            resv[i] = resv[--nresv];
            pthread_mutex_unlock(&mu); lg("cuMemAddressFree(%#llx, %zu)", ptr, size); return 0;
        }
    }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *p,
                     unsigned long long flags) { HOOK(9);
    NEED_INIT(); NEED_CTX();
    int rc = check_prop(p); if (rc) return rc;
    if (!out || !size || size % gran || flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (used_bytes + size > total_bytes) { pthread_mutex_unlock(&mu); return CUDA_ERROR_OUT_OF_MEMORY; }
    used_bytes += size;
    pthread_mutex_unlock(&mu);
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) || fallocate(fd, 0, 0, (off_t)size)) {
        if (fd >= 0) close(fd);
        pthread_mutex_lock(&mu); used_bytes -= size; pthread_mutex_unlock(&mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    Handle *h = calloc(1, sizeof *h);
    h->fd = fd; h->size = size; h->device = p->location.id;
    *out = (CUmemGenericAllocationHandle)(uintptr_t)h;
    lg("cuMemCreate(%zu, dev %d) = %p", size, h->device, (void *)h);
    return 0;
}

static void free_handle(Handle *h) {
    close(h->fd);
    pthread_mutex_lock(&mu); used_bytes -= h->size; pthread_mutex_unlock(&mu);
    h->fd = -1; h->size = 0; h->released = 2; /* keep the struct: a stale use is detectable */
}

CUresult cuMemRelease(CUmemGenericAllocationHandle hv) { HOOK(10);
    NEED_INIT(); NEED_CTX();
    Handle *h = (Handle *)(uintptr_t)hv;
    if (!h || h->released) { lg("cuMemRelease(%p): invalid or released twice", (void *)h); return CUDA_ERROR_INVALID_VALUE; }
    h->released = 1;
    lg("cuMemRelease(%p) maps=%d", (void *)h, h->maps);
    if (h->maps == 0) free_handle(h); /* else freed by the last cuMemUnmap */
    return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle hv,
                  unsigned long long flags) { HOOK(11);
    NEED_INIT(); NEED_CTX();
    Handle *h = (Handle *)(uintptr_t)hv;
    if (!h || h->released || flags) return CUDA_ERROR_INVALID_VALUE;
    if (!size || size % gran || ptr % gran || offset % gran || offset + size > h->size)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!find_resv(ptr, size)) { pthread_mutex_unlock(&mu); lg("cuMemMap: outside any reservation"); return CUDA_ERROR_INVALID_VALUE; }
    for (size_t j = 0; j < nmaps; j++)
        if (ptr < maps[j].addr + maps[j].size && maps[j].addr < ptr + size) {
            pthread_mutex_unlock(&mu); lg("cuMemMap: range already mapped"); return CUDA_ERROR_INVALID_VALUE;
        }
    void *m = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset);
    if (m == MAP_FAILED) { pthread_mutex_unlock(&mu); return CUDA_ERROR_OUT_OF_MEMORY; }
    if (nmaps == capmaps) { capmaps = capmaps ? 2 * capmaps : 64; maps = realloc(maps, capmaps * sizeof *maps); }
    maps[nmaps++] = (Mapping){ptr, size, h, 0};
    h->maps++;
    pthread_mutex_unlock(&mu);
    lg("cuMemMap(%#llx, %zu, %p)", ptr, size, (void *)h);
    return 0;
}

/* Indices of mappings exactly tiling [ptr, ptr+size), or -1 if it is not whole mappings. */
static long tile(uintptr_t ptr, size_t size, size_t *idx, size_t cap) {
    size_t n = 0; uintptr_t at = ptr, end = ptr + size;
    while (at < end) {
        size_t j;
        for (j = 0; j < nmaps; j++) if (maps[j].addr == at) break;
        if (j == nmaps || n == cap) return -1;
        idx[n++] = j; at += maps[j].size;
    }
    return at == end ? (long)n : -1;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) { HOOK(12);
    NEED_INIT(); NEED_CTX();
    if (!desc || count == 0 || !size) return CUDA_ERROR_INVALID_VALUE;
    int prot = -1;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != 1) return CUDA_ERROR_INVALID_VALUE;
        if (desc[i].location.id < 0 || desc[i].location.id >= ndev) return CUDA_ERROR_INVALID_DEVICE;
        int f = desc[i].flags;
        if (f != 0 && f != 1 && f != 3) return CUDA_ERROR_INVALID_VALUE;
        if (desc[i].location.id == 0 || ndev == 1) prot = f == 3 ? PROT_READ | PROT_WRITE : f == 1 ? PROT_READ : PROT_NONE;
    }
    pthread_mutex_lock(&mu);
    size_t cap = size / gran + 1, *idx = malloc(cap * sizeof *idx);
    long n = tile(ptr, size, idx, cap);
    if (n < 0) { pthread_mutex_unlock(&mu); free(idx); lg("cuMemSetAccess(%#llx, %zu): not whole mappings", ptr, size); return CUDA_ERROR_INVALID_VALUE; }
    if (prot >= 0) {
        if (mprotect((void *)ptr, size, prot)) { pthread_mutex_unlock(&mu); free(idx); return CUDA_ERROR_INVALID_VALUE; }
        for (long i = 0; i < n; i++) maps[idx[i]].prot = prot;
    }
    pthread_mutex_unlock(&mu); free(idx);
    lg("cuMemSetAccess(%#llx, %zu, n=%zu) over %ld mapping(s)", ptr, size, count, n);
    return 0;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { HOOK(13);
    NEED_INIT(); NEED_CTX();
    if (!size || ptr % gran || size % gran) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    size_t cap = size / gran + 1, *idx = malloc(cap * sizeof *idx);
    long n = tile(ptr, size, idx, cap);
    if (n < 0) { pthread_mutex_unlock(&mu); free(idx); lg("cuMemUnmap(%#llx, %zu): not whole mappings", ptr, size); return CUDA_ERROR_INVALID_VALUE; }
    void *m = mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) { pthread_mutex_unlock(&mu); free(idx); return CUDA_ERROR_INVALID_VALUE; }
    Handle *to_free[n > 0 ? n : 1]; long nf = 0;
    /* remove in descending index order so swap-removal keeps the others valid */
    for (long a = 0; a < n; a++) for (long b = a + 1; b < n; b++) if (idx[b] > idx[a]) { size_t t = idx[a]; idx[a] = idx[b]; idx[b] = t; }
    for (long i = 0; i < n; i++) {
        Handle *h = maps[idx[i]].h;
        if (--h->maps == 0 && h->released == 1) to_free[nf++] = h;
        maps[idx[i]] = maps[--nmaps];
    }
    pthread_mutex_unlock(&mu); free(idx);
    for (long i = 0; i < nf; i++) free_handle(to_free[i]);
    lg("cuMemUnmap(%#llx, %zu) %ld mapping(s)", ptr, size, n);
    return 0;
}

CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *loc, CUdeviceptr ptr) { HOOK(14);
    NEED_INIT(); (void)loc;
    pthread_mutex_lock(&mu);
    for (size_t j = 0; j < nmaps; j++)
        if (ptr >= maps[j].addr && ptr < maps[j].addr + maps[j].size) {
            int p = maps[j].prot; pthread_mutex_unlock(&mu);
            *flags = p == (PROT_READ | PROT_WRITE) ? 3 : p == PROT_READ ? 1 : 0; return 0;
        }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;
}

static const char *err_name(CUresult e) {
    switch (e) {
    case 0: return "CUDA_SUCCESS"; case 1: return "CUDA_ERROR_INVALID_VALUE";
    case 2: return "CUDA_ERROR_OUT_OF_MEMORY"; case 3: return "CUDA_ERROR_NOT_INITIALIZED";
    case 100: return "CUDA_ERROR_NO_DEVICE"; case 101: return "CUDA_ERROR_INVALID_DEVICE";
    case 201: return "CUDA_ERROR_INVALID_CONTEXT"; case 400: return "CUDA_ERROR_INVALID_HANDLE";
    case 500: return "CUDA_ERROR_NOT_FOUND"; case 800: return "CUDA_ERROR_NOT_PERMITTED";
    case 801: return "CUDA_ERROR_NOT_SUPPORTED"; case 719: return "CUDA_ERROR_LAUNCH_FAILED";
    default: return NULL;
    }
}
CUresult cuGetErrorName(CUresult e, const char **s) {
    const char *n = err_name(e); if (!n) { *s = NULL; return CUDA_ERROR_INVALID_VALUE; } *s = n; return 0;
}
CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

/* Test hook (not a CUDA API): bytes held by live physical allocations. */
size_t fakecuda_used_bytes(void) { return used_bytes; }
int fakecuda_num_mappings(void) { return (int)nmaps; }
/* Test hooks: live address reservations, and the retain count of a device's primary
 * context (-1: no such device): a backend that retains must release, whatever failed. */
int fakecuda_num_reservations(void) {
    pthread_mutex_lock(&mu); int n = (int)nresv; pthread_mutex_unlock(&mu); return n;
}
long fakecuda_num_events(void) {
    pthread_mutex_lock(&mu); long n = live_events; pthread_mutex_unlock(&mu); return n;
}
int fakecuda_primary_refs(int dev) {
    if (dev < 0 || dev >= MAXDEV) return -1;
    pthread_mutex_lock(&mu); int n = primary_refs[dev]; pthread_mutex_unlock(&mu); return n;
}
/* Test hook: FAKECUDA_STRICT_CTX changed at run time (1: every cuMem* call needs a current
 * context, as a driver that insists does); returns the old value. */
int fakecuda_set_strict_ctx(int on) {
    pthread_mutex_lock(&mu); int old = strict_ctx; strict_ctx = on != 0; pthread_mutex_unlock(&mu);
    return old;
}
/* Test hook: the allocation granularity (FAKECUDA_GRANULARITY) changed at run time, as on a
 * device that reports another one; refused unless a power of two of at least 4096 bytes.
 * Reservations and mappings made before keep their sizes; new calls check the new value. */
int fakecuda_set_granularity(size_t g) {
    if (g < 4096 || (g & (g - 1))) return -1;
    pthread_mutex_lock(&mu); gran = g; pthread_mutex_unlock(&mu);
    return 0;
}
size_t fakecuda_granularity(void) { /* before cuInit: what cuInit will read */
    const char *s = getenv("FAKECUDA_GRANULARITY");
    pthread_mutex_lock(&mu);
    size_t g = !initialized && s ? (size_t)atoll(s) : gran;
    pthread_mutex_unlock(&mu);
    return g;
}
/* Test hook: whether one of this driver's mappings covers `ptr` (the driver's own state,
 * whatever a backend's books say; not a hooked entry point: no call counted). */
int fakecuda_mapped_at(CUdeviceptr ptr) {
    int found = 0;
    pthread_mutex_lock(&mu);
    for (size_t j = 0; j < nmaps && !found; j++)
        found = ptr >= maps[j].addr && ptr < maps[j].addr + maps[j].size;
    pthread_mutex_unlock(&mu);
    return found;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status);
static const struct { const char *name; void *fn; } table[] = {
    {"cuGetProcAddress", (void *)cuGetProcAddress_v2}, /* cuda-python 12.x asks for it by this name */
    {"cuInit", (void *)cuInit}, {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount}, {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetName", (void *)cuDeviceGetName},
    {"cuDeviceGetUuid", (void *)cuDeviceGetUuid}, {"cuDeviceGetUuid_v2", (void *)cuDeviceGetUuid}, {"cuDeviceTotalMem", (void *)cuDeviceTotalMem},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent}, {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuCtxGetDevice", (void *)cuCtxGetDevice}, {"cuCtxSynchronize", (void *)cuCtxSynchronize},
    {"cuMemGetInfo", (void *)cuMemGetInfo},
    {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity},
    {"cuMemAddressReserve", (void *)cuMemAddressReserve}, {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemCreate", (void *)cuMemCreate}, {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemMap", (void *)cuMemMap}, {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemSetAccess", (void *)cuMemSetAccess}, {"cuMemGetAccess", (void *)cuMemGetAccess},
    {"cuEventCreate", (void *)cuEventCreate}, {"cuEventRecord", (void *)cuEventRecord},
    {"cuEventSynchronize", (void *)cuEventSynchronize}, {"cuEventDestroy", (void *)cuEventDestroy},
    {"cuEventDestroy_v2", (void *)cuEventDestroy},
    {"cuGetErrorName", (void *)cuGetErrorName}, {"cuGetErrorString", (void *)cuGetErrorString},
};

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    (void)ver; (void)flags;
    if (!sym || !pfn) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (!strcmp(table[i].name, sym)) { *pfn = table[i].fn; if (status) *status = 0; return 0; }
    *pfn = NULL; if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
/* Versioned export names, for loaders that dlsym them directly (cuda-python 12.x fallback). */
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { return cuMemGetInfo(f, t); }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return cuDevicePrimaryCtxRelease(d); }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { return cuDeviceTotalMem(b, d); }
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }
CUresult cuEventDestroy_v2(CUevent e) { return cuEventDestroy(e); }
