/* tests/cuda_emu/emu.cpp: a CPU execution harness for flexgen.cu (docs/GPU.md, "The emulated
 * GPU"). It is test infrastructure, not a backend: it runs the same flexgen.cu that nvcc builds,
 * compiled by g++ against the headers beside this file, so that every kernel and CUDA call runs
 * in `make test` on a machine without a GPU. What it holds the code to:
 *
 *   kernels     each block's threads run as fibers on one host thread: __syncthreads is a
 *               barrier of the block, a warp shuffle a meeting of its 32 lanes; a warp runs a
 *               whole stretch between barriers before the next, and the warps, their lanes and
 *               the grid's blocks run in a chosen order: forward, reversed or shuffled
 *               (cuda_emu_set_order), so a race on shared memory changes the result; dynamic
 *               shared memory starts as NaN bytes and ends at a guard page, and a launch's
 *               bytes of it must be whole 16-byte groups (nvcc loads such a group at once); an
 *               asynchronous copy (cp.async) must lie on its size, poisons its destination and
 *               lands only when its thread waits for its group
 *   memory      each cudaMalloc is its own mapping, 256-byte aligned, ending at a guard page;
 *               its pages are closed to the host: a host access faults and is reported with the
 *               allocation; a kernel or copy opens them (on its first touch) and they close
 *               again when the host resumes; new device memory is NaN bytes; the bytes between
 *               an allocation's end and the guard are checked after every kernel
 *   arguments   a kernel's pointer arguments must be device (or pinned) memory; a copy's
 *               direction must match the kinds of its pointers, and its bytes lie inside their
 *               allocations; cudaMemGetInfo reports a device of a size a test sets
 *   streams     work on a stream runs in order, events order streams, and nothing on a stream
 *               runs before the host must wait for it: cudaStreamSynchronize,
 *               cudaEventSynchronize, a copy to pageable host memory, cudaFree, cudaFreeHost,
 *               cudaDeviceSynchronize; a copy from pageable memory reads it when it is issued
 *   graphs      a capturing stream's work joins its graph instead of its queue; the capturing
 *               thread may not make or free device memory or a cuBLAS handle (CUDA's
 *               "potentially unsafe" calls): the call fails and breaks the capture, as on a GPU
 *   cuBLAS      cublasGemmEx, cublasGemmStridedBatchedEx and cublasLtMatmul check their
 *               arguments and run in fp32 through OpenBLAS on their stream; each product moves its
 *               stream's clock, which events read, by its multiply-adds at its algorithm's rate; a
 *               cublasLt algorithm given a matrix less aligned than its heuristic was told (256
 *               bytes by default) writes NaN, where a GPU's gives wrong sums
 *
 * One host thread runs device work at a time (a device lock), so the device is a GPU with one
 * multiprocessor; what this cannot show is in docs/GPU.md.
 */
#define _GNU_SOURCE 1
#include "cublasLt.h"
#include "cublas_v2.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

thread_local uint3 threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;

/* ============================================================================================
 * Settings, errors, statistics
 * ============================================================================================ */

static struct {
    int order = CUDA_EMU_FORWARD;
    unsigned seed = 1;
    size_t device_bytes = (size_t)8 << 30;
    int major = 8, minor = 6, devices = 1;
    int multiprocessors = 1; /* as reported: the sizes of the kernels' grids follow it */
} settings;
static cuda_emu_stats stats;
static std::once_flag settings_once;

static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    double unit = *end == 'K' || *end == 'k' ? 1024.0 : *end == 'M' || *end == 'm' ? 1048576.0
                : *end == 'G' || *end == 'g' ? 1073741824.0 : 1.0;
    return (size_t)(v * unit);
}

static void parse_order(const char *s) {
    if (!strcmp(s, "forward")) settings.order = CUDA_EMU_FORWARD;
    else if (!strcmp(s, "reverse")) settings.order = CUDA_EMU_REVERSE;
    else if (!strncmp(s, "shuffle", 7)) {
        settings.order = CUDA_EMU_SHUFFLE;
        if (s[7] == ':') settings.seed = (unsigned)strtoul(s + 8, NULL, 10);
    } else fprintf(stderr, "cuda-emu: FLEXGEN_EMU_ORDER=%s: expected forward, reverse or shuffle[:SEED]\n", s);
}

/* FLEXGEN_EMU_STATS=FILE: the statistics, one line appended to FILE at exit. */
static const char *stats_file;
static void write_stats() {
    FILE *f = fopen(stats_file, "a");
    if (!f) return;
    fprintf(f, "kernels %lld blocks %lld gemms %lld copies %lld host_waits %lld async_bytes %lld kv_load_bytes %lld "
            "lt_matmuls %lld %lld %lld\n", stats.kernels, stats.blocks, stats.gemms, stats.copies, stats.host_waits,
            stats.async_bytes, stats.kv_load_bytes, stats.lt_matmuls[0], stats.lt_matmuls[1], stats.lt_matmuls[2]);
    fclose(f);
}

static void read_environment() {
    const char *v;
    if ((v = getenv("FLEXGEN_EMU_STATS")) && *v) {
        stats_file = v;
        atexit(write_stats);
    }
    if ((v = getenv("FLEXGEN_EMU_ORDER"))) parse_order(v);
    if ((v = getenv("FLEXGEN_EMU_MEMORY"))) settings.device_bytes = parse_size(v);
    if ((v = getenv("FLEXGEN_EMU_CC"))) sscanf(v, "%d.%d", &settings.major, &settings.minor);
    if ((v = getenv("FLEXGEN_EMU_DEVICES"))) settings.devices = atoi(v);
    if ((v = getenv("FLEXGEN_EMU_SMS")) && atoi(v) > 0) settings.multiprocessors = atoi(v);
}
static void install_fault_handler();
static void settings_ready() {
    std::call_once(settings_once, [] {
        read_environment();
        install_fault_handler();
    });
}

extern "C" void cuda_emu_set_order(int order, unsigned seed) {
    settings_ready();
    settings.order = order, settings.seed = seed;
}
extern "C" void cuda_emu_get_order(int *order, unsigned *seed) {
    settings_ready();
    *order = settings.order, *seed = settings.seed;
}
extern "C" const char *cuda_emu_order_name(void) {
    static char name[32];
    settings_ready();
    if (settings.order == CUDA_EMU_SHUFFLE) snprintf(name, sizeof name, "shuffle:%u", settings.seed);
    else snprintf(name, sizeof name, "%s", settings.order == CUDA_EMU_REVERSE ? "reverse" : "forward");
    return name;
}
extern "C" void cuda_emu_set_device_memory(size_t bytes) { settings_ready(); settings.device_bytes = bytes; }
extern "C" void cuda_emu_set_capability(int major, int minor) {
    settings_ready();
    settings.major = major, settings.minor = minor;
}
extern "C" void cuda_emu_get_stats(cuda_emu_stats *s) { *s = stats; }

/* One line on stderr, "cuda-emu: " and the message. */
static void say(const char *fmt, va_list ap) {
    fprintf(stderr, "cuda-emu: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
}

/* A misuse that a GPU would turn into a fault or undefined results: reported, then abort(). */
[[noreturn]] static void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    say(fmt, ap);
    va_end(ap);
    abort();
}

/* An API error: reported on stderr (the return code alone rarely says which argument), returned,
 * and kept for cudaGetLastError as CUDA keeps a launch's. */
static thread_local cudaError_t last_error = cudaSuccess;
static cudaError_t api_error(cudaError_t e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    say(fmt, ap);
    va_end(ap);
    last_error = e;
    return e;
}

/* ============================================================================================
 * Memory: device allocations closed to the host, pinned host memory
 * ============================================================================================ */

enum memory_kind { DEVICE, PINNED };
struct allocation {
    char *begin;            /* what the program got */
    size_t bytes;
    memory_kind kind;
    char *map;              /* device: the mapping, data pages then one guard page */
    size_t data_bytes;      /* device: the data pages */
    long id;                /* the n-th allocation of the process */
    bool open;              /* device: its pages are readable and writable now */
};
enum { ALIGN = 256, SLACK_BYTE = 0xa5 };

static std::mutex alloc_mutex;
/* by begin; never destroyed, so what the program leaves allocated at exit stays reachable (as
 * the driver's bookkeeping would) rather than reported by LeakSanitizer */
static std::map<uintptr_t, allocation *> &allocations = *new std::map<uintptr_t, allocation *>;
static size_t device_used;
static long next_id = 1;
static size_t page_size() { static size_t p = (size_t)sysconf(_SC_PAGESIZE); return p; }

/* The allocation that p points into (its guard page included for device memory), or NULL.
 * Callers hold alloc_mutex. */
static allocation *find_locked(const void *p) {
    uintptr_t a = (uintptr_t)p;
    auto it = allocations.upper_bound(a);
    if (it == allocations.begin()) return NULL;
    allocation *al = (--it)->second;
    uintptr_t end = al->kind == DEVICE ? (uintptr_t)al->map + al->data_bytes + page_size()
                                       : (uintptr_t)al->begin + al->bytes;
    uintptr_t start = al->kind == DEVICE ? (uintptr_t)al->map : (uintptr_t)al->begin;
    return a >= start && a < end ? al : NULL;
}
/* The same, only where p is inside [begin, begin + bytes]; its end counts (a pointer one past). */
static allocation *find(const void *p) {
    std::lock_guard<std::mutex> lock(alloc_mutex);
    allocation *al = find_locked(p);
    if (al && ((const char *)p < al->begin || (const char *)p > al->begin + al->bytes)) return NULL;
    return al;
}

static void protect(allocation *al, int prot) {
    if (mprotect(al->map, al->data_bytes, prot)) fatal("mprotect: %s", strerror(errno));
    al->open = prot != PROT_NONE;
}

/* Device allocations opened to the device work now running; closed when the host resumes. */
static std::vector<allocation *> opened;
/* From the fault handler: the list has room already (reserved with the handler), so this takes no
 * memory there but in a run that touches more allocations than that at once. */
static void open_allocation(allocation *al) {
    if (al->open) return;
    protect(al, PROT_READ | PROT_WRITE);
    opened.push_back(al);
    stats.opened++;
}
static void close_opened() {
    for (allocation *al : opened)
        if (al->open) protect(al, PROT_NONE);
    opened.clear();
}

/* The bytes between an allocation's end and its guard page still hold SLACK_BYTE. */
static void check_slack(const allocation *al, const char *after) {
    for (const char *p = al->begin + al->bytes; p < al->map + al->data_bytes; p++)
        if ((unsigned char)*p != SLACK_BYTE)
            fatal("%s wrote %td bytes past the end of device allocation #%ld (%zu bytes)", after,
                  p - (al->begin + al->bytes) + 1, al->id, al->bytes);
}

static bool refused_while_capturing(const char *call);

cudaError_t cudaMalloc(void **p, size_t bytes) {
    settings_ready();
    *p = NULL;
    if (refused_while_capturing("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
    if (bytes == 0) return cudaSuccess;
    size_t rounded = (bytes + ALIGN - 1) / ALIGN * ALIGN, pg = page_size();
    size_t data = (rounded + pg - 1) / pg * pg;
    {
        std::lock_guard<std::mutex> lock(alloc_mutex);
        if (device_used + rounded > settings.device_bytes)
            return api_error(cudaErrorMemoryAllocation, "cudaMalloc(%zu bytes): out of memory on the device "
                             "(%zu of %zu bytes in use)", bytes, device_used, settings.device_bytes);
        device_used += rounded;
    }
    char *map = (char *)mmap(NULL, data + pg, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED) return api_error(cudaErrorMemoryAllocation, "cudaMalloc(%zu bytes): mmap failed", bytes);
    allocation *al = new allocation{map + data - rounded, bytes, DEVICE, map, data, 0, false};
    protect(al, PROT_READ | PROT_WRITE);
    memset(al->begin, 0xff, bytes); /* NaN in fp16 and fp32, -1 in integers */
    memset(al->begin + bytes, SLACK_BYTE, (size_t)(map + data - al->begin) - bytes);
    protect(al, PROT_NONE);
    std::lock_guard<std::mutex> lock(alloc_mutex);
    al->id = next_id++;
    allocations[(uintptr_t)al->begin] = al;
    *p = al->begin;
    return cudaSuccess;
}

static void drain_all();
static std::recursive_mutex device_mutex; /* the device lock: see "Streams and events" */

cudaError_t cudaFree(void *p) {
    if (refused_while_capturing("cudaFree")) return cudaErrorStreamCaptureUnsupported;
    if (!p) return cudaSuccess;
    std::lock_guard<std::recursive_mutex> device(device_mutex);
    drain_all(); /* cudaFree waits for the device */
    std::lock_guard<std::mutex> lock(alloc_mutex);
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end() || it->second->kind != DEVICE)
        return api_error(cudaErrorInvalidValue, "cudaFree(%p): not the start of a device allocation", p);
    allocation *al = it->second;
    protect(al, PROT_READ);
    check_slack(al, "a kernel");
    munmap(al->map, al->data_bytes + page_size());
    device_used -= (al->bytes + ALIGN - 1) / ALIGN * ALIGN;
    allocations.erase(it);
    delete al;
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags) {
    (void)flags;
    settings_ready();
    *p = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096 + (bytes == 0 ? 4096 : 0));
    if (!*p) return api_error(cudaErrorMemoryAllocation, "cudaHostAlloc(%zu bytes): out of host memory", bytes);
    std::lock_guard<std::mutex> lock(alloc_mutex);
    allocations[(uintptr_t)*p] = new allocation{(char *)*p, bytes, PINNED, NULL, 0, next_id++, true};
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }

cudaError_t cudaFreeHost(void *p) {
    if (!p) return cudaSuccess;
    drain_all();
    std::lock_guard<std::mutex> lock(alloc_mutex);
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end() || it->second->kind != PINNED)
        return api_error(cudaErrorInvalidValue, "cudaFreeHost(%p): not the start of pinned host memory", p);
    free(p);
    delete it->second;
    allocations.erase(it);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p) {
    allocation *al = find(p);
    memset(a, 0, sizeof *a);
    a->type = !al ? cudaMemoryTypeUnregistered : al->kind == DEVICE ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
    a->device = al ? 0 : -2;
    if (al) a->devicePointer = (void *)p, a->hostPointer = al->kind == PINNED ? (void *)p : NULL;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
    settings_ready();
    std::lock_guard<std::mutex> lock(alloc_mutex);
    *total = settings.device_bytes;
    *free_bytes = settings.device_bytes - device_used;
    return cudaSuccess;
}

/* ---- Faults: a host access to device memory, or a kernel past an allocation's end ---- */

static thread_local int device_mode;                 /* this thread runs device work now */
static thread_local const cuda_emu::launch_config *running_kernel;
static struct sigaction previous_segv, previous_bus;

static void describe_thread(char *out, size_t n) {
    if (running_kernel)
        snprintf(out, n, "kernel %s (launched at %s:%d), block (%u,%u,%u) thread (%u,%u,%u)",
                 running_kernel->name, running_kernel->file, running_kernel->line, blockIdx.x, blockIdx.y,
                 blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    else snprintf(out, n, "a copy or cuBLAS call");
}

/* The page after the running block's dynamic shared memory, closed (shared_ready), and its bytes. */
static char *shared_guard;
static size_t shared_bytes;

static void on_fault(int sig, siginfo_t *info, void *context) {
    (void)context;
    char *addr = (char *)info->si_addr;
    if (shared_guard && addr >= shared_guard && addr < shared_guard + sysconf(_SC_PAGESIZE)) {
        char who[256];
        describe_thread(who, sizeof who);
        fatal("%s accessed byte %td past the end of its dynamic shared memory (%zu bytes)", who,
              addr - shared_guard, shared_bytes);
    }
    allocation *al;
    { /* never held by this thread: no code that holds it touches closed pages */
        std::lock_guard<std::mutex> lock(alloc_mutex);
        al = find_locked(addr);
    }
    if (al && al->kind == DEVICE) {
        bool guard = addr >= al->map + al->data_bytes;
        char who[256];
        describe_thread(who, sizeof who);
        if (device_mode && !guard) {
            open_allocation(al);
            return; /* the access runs again, now allowed */
        }
        if (guard)
            fatal("%s accessed byte %td past the end of device allocation #%ld (%zu bytes)",
                  device_mode ? who : "host code", addr - (al->begin + al->bytes), al->id, al->bytes);
        fatal("host code touched device memory: byte %td of device allocation #%ld (%zu bytes); the host "
              "must copy it with cudaMemcpy", addr - al->begin, al->id, al->bytes);
    }
    /* not ours: the previous handler (the default ends the process; ASan reports) */
    sigaction(sig, sig == SIGSEGV ? &previous_segv : &previous_bus, NULL);
}

static void install_fault_handler() {
    opened.reserve(4096);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
    sigaction(SIGBUS, &sa, &previous_bus);
}

/* ============================================================================================
 * Streams and events: queued work that runs when the host waits
 * ============================================================================================ */

struct stream_state;
struct dependency { stream_state *stream; uint64_t upto; };
struct operation {
    std::function<void()> run;
    std::vector<dependency> after; /* work on other streams that must run first */
    const char *kind = "";         /* a kernel's name, or "copy", "memset", "gemm", "wait" */
};
/* A captured graph, or one instantiated from it (an exec): its operations in order. */
struct cuda_emu_graph {
    std::vector<operation> ops;
};
struct stream_state {
    std::deque<operation> queue;
    uint64_t queued = 0, done = 0; /* operations ever queued, and run */
    bool blocking;                 /* orders with the legacy stream (not cudaStreamNonBlocking) */
    cuda_emu_graph *capture = NULL; /* capturing: work goes here, not to the queue */
    pthread_t capture_thread{};     /* the thread that began the capture */
    bool capture_broken = false;    /* something not capturable was asked during the capture */
    double clock = 0;               /* ms: the products queued on it (product_time), which events read */
};
struct event_state {
    stream_state *stream = NULL;   /* NULL: never recorded, or its stream is gone */
    uint64_t upto = 0;
    double at = 0; /* its stream's clock when recorded */
};

/* device_mutex, the device lock: queues are changed and work runs under it. Recursive: a
 * waiting thread runs another stream's work first. */
static stream_state legacy{{}, 0, 0, true};
static std::vector<stream_state *> &streams = *new std::vector<stream_state *>; /* created ones; not
                                                                                 the legacy stream */
static std::vector<event_state *> &events = *new std::vector<event_state *>;

static stream_state *stream_of(cudaStream_t s) { return s ? (stream_state *)s : &legacy; }
static bool stream_exists(cudaStream_t s) { /* under the device lock: other threads make and end streams */
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    return !s || std::find(streams.begin(), streams.end(), (stream_state *)s) != streams.end();
}

/* Queues op on s with the legacy stream's implicit ordering; returns its sequence number. On a
 * stream that captures, op joins the graph instead; a dependency on other work cannot (the
 * harness captures one stream alone) and breaks the capture. */
static uint64_t enqueue(stream_state *s, operation op) {
    if (s->capture) {
        if (!op.after.empty() || s->blocking) s->capture_broken = true;
        s->capture->ops.push_back(std::move(op));
        return s->queued;
    }
    if (s == &legacy) {
        for (stream_state *t : streams)
            if (t->blocking) op.after.push_back({t, t->queued});
    } else if (s->blocking) op.after.push_back({&legacy, legacy.queued});
    s->queue.push_back(std::move(op));
    return ++s->queued;
}

static void run_until(stream_state *s, uint64_t upto);

static void run_next(stream_state *s) {
    operation op = std::move(s->queue.front());
    s->queue.pop_front();
    for (const dependency &d : op.after) run_until(d.stream, d.upto);
    device_mode++;
    op.run();
    device_mode--;
    s->done++;
}

/* Runs s's work up to operation `upto`, and what it waits for on other streams. */
static void run_until(stream_state *s, uint64_t upto) {
    while (s->done < upto) run_next(s);
}

/* The host waits here: the device work that must be done by now runs, then the host resumes and
 * device memory closes to it again. */
template <typename F> static void host_waits(F &&run) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    stats.host_waits++;
    run();
    if (!device_mode) close_opened();
}

static void drain_all() {
    host_waits([] {
        run_until(&legacy, legacy.queued);
        for (size_t i = 0; i < streams.size(); i++) run_until(streams[i], streams[i]->queued);
    });
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    settings_ready();
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    stream_state *st = new stream_state;
    st->blocking = !(flags & cudaStreamNonBlocking);
    streams.push_back(st);
    *s = (cudaStream_t)st;
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (!s || !stream_exists(s)) return api_error(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: no such stream");
    stream_state *st = (stream_state *)s;
    host_waits([st] { run_until(st, st->queued); }); /* its work still completes */
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    streams.erase(std::find(streams.begin(), streams.end(), st));
    for (stream_state *t : streams) /* what waited on it is done */
        for (operation &op : t->queue)
            op.after.erase(std::remove_if(op.after.begin(), op.after.end(),
                                          [st](const dependency &d) { return d.stream == st; }), op.after.end());
    for (event_state *e : events)
        if (e->stream == st) e->stream = NULL;
    delete st;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (!stream_exists(s)) return api_error(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: no such stream");
    stream_state *st = stream_of(s);
    if (st->capture) {
        st->capture_broken = true;
        return api_error(cudaErrorStreamCaptureUnsupported,
                         "cudaStreamSynchronize: the stream is capturing");
    }
    host_waits([st] { run_until(st, st->queued); });
    return cudaSuccess;
}
/* A query is a wait too: the harness has no other moment to run the work. */
cudaError_t cudaStreamQuery(cudaStream_t s) { return cudaStreamSynchronize(s); }
cudaError_t cudaDeviceSynchronize(void) { drain_all(); return cudaSuccess; }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    (void)flags;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    event_state *ev = new event_state;
    events.push_back(ev);
    *e = (cudaEvent_t)ev;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }

static event_state *event_of(cudaEvent_t e) {
    auto it = std::find(events.begin(), events.end(), (event_state *)e);
    return it == events.end() ? NULL : *it;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    event_state *ev = event_of(e);
    if (!ev) return api_error(cudaErrorInvalidResourceHandle, "cudaEventDestroy: no such event");
    events.erase(std::find(events.begin(), events.end(), ev));
    delete ev;
    return cudaSuccess;
}

/* The event stands for all work queued on s so far. */
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    event_state *ev = event_of(e);
    if (!ev || !stream_exists(s)) return api_error(cudaErrorInvalidResourceHandle, "cudaEventRecord: no such %s", ev ? "stream" : "event");
    if (stream_of(s)->capture) {
        stream_of(s)->capture_broken = true;
        return api_error(cudaErrorStreamCaptureUnsupported,
                         "cudaEventRecord: the stream is capturing");
    }
    ev->stream = stream_of(s), ev->upto = ev->stream->queued, ev->at = ev->stream->clock;
    return cudaSuccess;
}

/* ---- Graphs ---- */

/* A thread whose capture is under way may not call what could allocate or wait for the device
 * (under cudaStreamCaptureModeThreadLocal and Global, the CUDA runtime's "potentially unsafe API
 * calls": cudaMalloc, cudaFree, and cublasCreate, which calls them): the call fails, and the
 * capture is broken. */
static bool refused_while_capturing(const char *call) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    bool refused = false;
    for (stream_state *s : streams) {
        if (s->capture && pthread_equal(s->capture_thread, pthread_self())) {
            s->capture_broken = true;
            refused = true;
        }
    }
    if (refused)
        api_error(cudaErrorStreamCaptureUnsupported, "%s: this thread's stream is capturing", call);
    return refused;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    (void)mode;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    if (!s || !stream_exists(s))
        return api_error(cudaErrorInvalidResourceHandle, "cudaStreamBeginCapture: no such stream");
    stream_state *st = stream_of(s);
    if (st->capture)
        return api_error(cudaErrorStreamCaptureUnsupported,
                         "cudaStreamBeginCapture: already capturing");
    st->capture = new cuda_emu_graph;
    st->capture_thread = pthread_self();
    st->capture_broken = false;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    if (!s || !stream_exists(s) || !stream_of(s)->capture)
        return api_error(cudaErrorInvalidValue,
                         "cudaStreamEndCapture: the stream is not capturing");
    stream_state *st = stream_of(s);
    cuda_emu_graph *graph = st->capture;
    st->capture = NULL;
    if (st->capture_broken) {
        delete graph;
        *g = NULL;
        return api_error(cudaErrorStreamCaptureUnsupported,
                         "cudaStreamEndCapture: the capture was broken");
    }
    *g = graph;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags) {
    (void)flags;
    if (!g) return api_error(cudaErrorInvalidValue, "cudaGraphInstantiate: no graph");
    *e = new cuda_emu_graph(*g);
    return cudaSuccess;
}

/* The exec takes g's arguments where g has the same operations in the same order. */
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t e, cudaGraph_t g,
                                cudaGraphExecUpdateResultInfo *info) {
    bool same = e && g && e->ops.size() == g->ops.size();
    for (size_t i = 0; same && i < g->ops.size(); i++)
        same = !strcmp(e->ops[i].kind, g->ops[i].kind);
    if (info) {
        memset(info, 0, sizeof *info);
        info->result = same ? 0 : 1;
    }
    if (!same) return cudaErrorGraphExecUpdateFailure; /* not sticky: instantiate anew */
    e->ops = g->ops;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    if (!e || !stream_exists(s))
        return api_error(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: no such graph or stream");
    stats.graph_launches++;
    for (const operation &op : e->ops) enqueue(stream_of(s), op);
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    delete g;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    std::unique_lock<std::recursive_mutex> lock(device_mutex);
    event_state *ev = event_of(e);
    if (!ev) return api_error(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: no such event");
    if (!ev->stream) return cudaSuccess; /* never recorded: nothing to wait for */
    stream_state *st = ev->stream;
    uint64_t upto = ev->upto;
    host_waits([st, upto] { run_until(st, upto); });
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaEventSynchronize(e); }
/* The harness's clock between the two events: the time of the products queued between them on
 * their stream (product_time); kernels and copies take none. Both must be recorded, on one stream,
 * and done. */
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    event_state *a = event_of(start), *b = event_of(end);
    if (!a || !b) return api_error(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: no such event");
    if (!a->stream || !b->stream || a->stream != b->stream)
        return api_error(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: events not recorded on one stream");
    if (a->stream->done < a->upto || b->stream->done < b->upto) return cudaErrorNotReady;
    *ms = (float)(b->at - a->at);
    return cudaSuccess;
}

/* Later work on s waits for what e stands for now. */
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)flags;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    event_state *ev = event_of(e);
    if (!ev || !stream_exists(s)) return api_error(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: no such %s", ev ? "stream" : "event");
    if (ev->stream) enqueue(stream_of(s), operation{[] {}, {{ev->stream, ev->upto}}});
    return cudaSuccess;
}

/* ============================================================================================
 * Copies
 * ============================================================================================ */

/* What kind of memory [p, p + bytes) is: device, pinned, or pageable host memory (-1: it starts
 * in an allocation and runs past its end). */
enum { PAGEABLE = 2, STRADDLES = -1 };
static int memory_of(const void *p, size_t bytes) {
    allocation *al = find(p);
    if (!al) return PAGEABLE;
    if ((const char *)p + bytes > al->begin + al->bytes) return STRADDLES;
    return al->kind;
}
static const char *const kind_names[] = {"device memory", "pinned host memory", "pageable host memory"};

/* Checks a copy of `bytes` (rows of `width` at pitches for 2D) against kcopy's direction; on
 * success *dst_kind and *src_kind are the kinds. */
static cudaError_t check_copy(const char *call, void *dst, size_t dst_extent, const void *src, size_t src_extent,
                              cudaMemcpyKind kind, int *dst_kind, int *src_kind) {
    *dst_kind = memory_of(dst, dst_extent), *src_kind = memory_of(src, src_extent);
    if (*dst_kind == STRADDLES || *src_kind == STRADDLES)
        return api_error(cudaErrorInvalidValue, "%s: the %s runs past the end of its allocation", call,
                         *dst_kind == STRADDLES ? "destination" : "source");
    bool dst_dev = *dst_kind == DEVICE, src_dev = *src_kind == DEVICE;
    bool ok = kind == cudaMemcpyDefault || (kind == cudaMemcpyHostToDevice && dst_dev && !src_dev) ||
              (kind == cudaMemcpyDeviceToHost && !dst_dev && src_dev) ||
              (kind == cudaMemcpyDeviceToDevice && dst_dev && src_dev) ||
              (kind == cudaMemcpyHostToHost && !dst_dev && !src_dev);
    static const char *const names[] = {"HostToHost", "HostToDevice", "DeviceToHost", "DeviceToDevice", "Default"};
    if (!ok)
        return api_error(cudaErrorInvalidMemcpyDirection, "%s: cudaMemcpy%s from %s to %s", call, names[kind],
                         kind_names[*src_kind], kind_names[*dst_kind]);
    return cudaSuccess;
}

/* Rows of `width` bytes; one row for a plain copy. A pageable source is read now (CUDA stages
 * it before returning); a pageable destination is a wait of the host for the copy. */
static cudaError_t copy_rows(const char *call, void *dst, size_t dpitch, const void *src, size_t spitch,
                             size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t s) {
    if (width == 0 || height == 0) return cudaSuccess;
    if (dpitch < width || spitch < width)
        return api_error(cudaErrorInvalidPitchValue, "%s: a pitch is smaller than the row's %zu bytes", call, width);
    if (!stream_exists(s)) return api_error(cudaErrorInvalidResourceHandle, "%s: no such stream", call);
    int dk, sk;
    cudaError_t e = check_copy(call, dst, dpitch * (height - 1) + width, src, spitch * (height - 1) + width, kind, &dk, &sk);
    if (e) return e;
    std::shared_ptr<std::vector<char>> staged;
    if (sk == PAGEABLE) {
        staged = std::make_shared<std::vector<char>>(width * height);
        for (size_t r = 0; r < height; r++) memcpy(staged->data() + r * width, (const char *)src + r * spitch, width);
        src = staged->data(), spitch = width;
    }
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    stream_state *st = stream_of(s);
    uint64_t at = enqueue(st, operation{[dst, dpitch, src, spitch, width, height, staged] {
        for (size_t r = 0; r < height; r++) memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
        stats.copies++;
    }, {}});
    if (dk == PAGEABLE) host_waits([st, at] { run_until(st, at); });
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
    return copy_rows("cudaMemcpyAsync", dst, bytes, src, bytes, bytes, 1, kind, s);
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                              size_t height, cudaMemcpyKind kind, cudaStream_t s) {
    return copy_rows("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height, kind, s);
}
/* The synchronous copy: on the legacy stream, and the host waits for it. */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    cudaError_t e = copy_rows("cudaMemcpy", dst, bytes, src, bytes, bytes, 1, kind, 0);
    if (!e) host_waits([] { run_until(&legacy, legacy.queued); });
    return e;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    if (bytes == 0) return cudaSuccess;
    if (memory_of(p, bytes) != DEVICE)
        return api_error(cudaErrorInvalidValue, "cudaMemsetAsync(%p, %zu bytes): not inside one device allocation", p, bytes);
    if (!stream_exists(s)) return api_error(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: no such stream");
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    enqueue(stream_of(s), operation{[=] { memset(p, value, bytes); }, {}, "memset"});
    return cudaSuccess;
}
cudaError_t cudaMemset(void *p, int value, size_t bytes) {
    cudaError_t e = cudaMemsetAsync(p, value, bytes, 0);
    if (!e) host_waits([] { run_until(&legacy, legacy.queued); });
    return e;
}

/* ============================================================================================
 * Kernels: blocks of fibers
 * ============================================================================================ */

/* A fiber's saved context, and the switch between two. On x86-64 a switch saves and restores the
 * callee-saved registers and the FP control words (a few nanoseconds); elsewhere it is ucontext's
 * swapcontext, which also makes a system call for the signal mask. */
#if defined(__x86_64__)
struct context { void *sp; };
extern "C" void cuda_emu_switch(void **save_sp, void *sp);
extern "C" void cuda_emu_fiber_start(void);
asm(".text\n"
    ".globl cuda_emu_switch\n.type cuda_emu_switch,@function\n"
    "cuda_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size cuda_emu_switch, .-cuda_emu_switch\n"
    ".globl cuda_emu_fiber_start\n.type cuda_emu_fiber_start,@function\n"
    "cuda_emu_fiber_start:\n  .cfi_startproc\n  .cfi_undefined rip\n  call *%r13\n  ud2\n  .cfi_endproc\n"
    ".size cuda_emu_fiber_start, .-cuda_emu_fiber_start\n");
static void switch_context(context *from, context *to) { cuda_emu_switch(&from->sp, to->sp); }
/* A context that starts entry() on the stack [stack, stack + bytes): the registers' slots as
 * cuda_emu_switch pops them, entry in r13, then cuda_emu_fiber_start as the return address. */
static void make_context(context *c, char *stack, size_t bytes, void (*entry)()) {
    uint64_t *top = (uint64_t *)((uintptr_t)(stack + bytes) & ~(uintptr_t)15), *sp = top - 10;
    uint32_t controls[2];
    asm volatile("stmxcsr %0\n fnstcw %1" : "=m"(controls[0]), "=m"(controls[1]));
    memset(sp, 0, 10 * sizeof *sp);
    memcpy(sp, controls, 8);
    sp[3] = (uint64_t)(uintptr_t)entry;                /* r13: after the FP words, r15, r14 */
    sp[7] = (uint64_t)(uintptr_t)cuda_emu_fiber_start; /* the return address of the first switch */
    c->sp = sp;
}
#else
struct context { ucontext_t uc; };
static void switch_context(context *from, context *to) { swapcontext(&from->uc, &to->uc); }
static void make_context(context *c, char *stack, size_t bytes, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = NULL;
    makecontext(&c->uc, entry, 0);
}
#endif

enum thread_state { RUNNABLE, AT_BARRIER, AT_SHUFFLE, AT_WARP_BARRIER, EXITED };
enum { MAX_ASYNC_COPIES = 64 };
struct fiber {
    context saved;
    char *stack;
    thread_state state;
    uint3 index;
    unsigned lane_mask;           /* the lanes the shuffle or warp barrier names */
    uint64_t shuffle_in, shuffle_out;
    int shuffle_from;             /* the lane this one reads */
    uint32_t mma_a[4], mma_b[2];  /* its fragments at a tensor-core product */
    void *asan_fake_stack;
    int copies, committed;        /* its asynchronous copies not landed, its groups committed */
    struct {
        void *dst;
        const void *src;
        int bytes, group;
    } copy[MAX_ASYNC_COPIES];
};
enum { STACK_BYTES = 128 << 10, MAX_THREADS = 1024 };

/* The block now running (one at a time: the device lock), its fibers and the scheduler's context. */
static struct {
    std::vector<fiber> fibers;
    int n;                         /* threads in the block */
    context scheduler;
    fiber *current;
    const std::function<void()> *body;
    char *shared;                  /* dynamic shared memory: its last byte next to shared_guard */
    const void *scheduler_stack;   /* for ASan's fiber switches */
    size_t scheduler_stack_bytes;
    void *scheduler_fake_stack;
} block;

static void fiber_stacks_ready(int n) {
    for (size_t i = block.fibers.size(); i < (size_t)n; i++) {
        fiber f;
        memset(&f, 0, sizeof f);
        f.stack = (char *)mmap(NULL, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f.stack == MAP_FAILED) fatal("cannot map a thread's stack");
        mprotect(f.stack, page_size(), PROT_NONE); /* a guard below the stack */
        block.fibers.push_back(f);
    }
}

/* Back to the scheduler; `exiting`: this fiber never resumes. */
static void to_scheduler(fiber *f, bool exiting) {
#if EMU_ASAN
    __sanitizer_start_switch_fiber(exiting ? NULL : &f->asan_fake_stack, block.scheduler_stack, block.scheduler_stack_bytes);
#endif
    switch_context(&f->saved, &block.scheduler);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake_stack, NULL, NULL);
#else
    (void)exiting;
#endif
}

static void fiber_main() {
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &block.scheduler_stack, &block.scheduler_stack_bytes);
#endif
    (*block.body)();
    block.current->state = EXITED;
    to_scheduler(block.current, true);
}

static void run_fiber(fiber *f) {
    block.current = f;
    threadIdx = f->index;
    stats.switches++;
#if EMU_ASAN
    __sanitizer_start_switch_fiber(&block.scheduler_fake_stack, f->stack, STACK_BYTES);
#endif
    switch_context(&block.scheduler, &f->saved);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(block.scheduler_fake_stack, NULL, NULL);
#endif
}

static fiber *this_thread(const char *call) {
    if (!block.current || !device_mode) fatal("%s called outside a kernel", call);
    return block.current;
}

void __syncthreads(void) {
    fiber *f = this_thread("__syncthreads");
    f->state = AT_BARRIER;
    to_scheduler(f, false);
}

static int lane_of(const fiber *f) { return (int)(f - block.fibers.data()) % 32; }

uint64_t cuda_emu::shuffle(unsigned mask, uint64_t bits, shuffle_kind kind, int arg, int width) {
    fiber *f = this_thread("__shfl_*_sync");
    int lane = lane_of(f), base = lane & ~(width - 1), from = lane;
    if (kind == SHFL_IDX) from = base + (arg & (width - 1));
    else if (kind == SHFL_UP) from = lane - arg >= base ? lane - arg : lane;
    else if (kind == SHFL_DOWN) from = lane + arg < base + width ? lane + arg : lane;
    else from = ((lane ^ arg) & ~(width - 1)) == base ? lane ^ arg : lane;
    if (!(mask >> lane & 1)) fatal("a warp shuffle in a lane (%d) its mask %#x leaves out", lane, mask);
    f->lane_mask = mask, f->shuffle_in = bits, f->shuffle_from = from;
    f->state = AT_SHUFFLE;
    to_scheduler(f, false);
    return f->shuffle_out;
}

void __syncwarp(unsigned mask) {
    fiber *f = this_thread("__syncwarp");
    f->lane_mask = mask;
    f->state = AT_WARP_BARRIER;
    to_scheduler(f, false);
}

static float half_bits_value(uint32_t pair, int high) {
    return cuda_emu_half_to_float((unsigned short)(high ? pair >> 16 : pair & 0xffff));
}

/* Each lane's d: its rows m and columns n of sum_k A[m][k] B[k][n] (fp32 sums in k order, on top
 * of d), A's and B's elements read from the lanes that hold them in mma_16x8x16's layout. */
void cuda_emu::mma_16x8x16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    fiber *f = this_thread("mma_16x8x16");
    memcpy(f->mma_a, a, sizeof f->mma_a);
    memcpy(f->mma_b, b, sizeof f->mma_b);
    __syncwarp(0xffffffffu);
    const fiber *lanes = f - lane_of(f);
    int gid = lane_of(f) / 4, tig = lane_of(f) % 4;
    float out[4];
    for (int i = 0; i < 4; i++) {
        int m = gid + 8 * (i / 2), n = 2 * tig + i % 2;
        float sum = d[i];
        for (int k = 0; k < 16; k++) {
            const fiber *holds_a = &lanes[(m % 8) * 4 + (k % 8) / 2];
            const fiber *holds_b = &lanes[n * 4 + (k % 8) / 2];
            float av = half_bits_value(holds_a->mma_a[2 * (k / 8) + m / 8], k % 2);
            float bv = half_bits_value(holds_b->mma_b[k / 8], k % 2);
            sum = fmaf(av, bv, sum);
        }
        out[i] = sum;
    }
    __syncwarp(0xffffffffu);
    memcpy(d, out, sizeof out);
}

/* An asynchronous copy of 4, 8 or 16 bytes, both ends on that many bytes (as the GPU requires):
 * its destination is poisoned (0xff bytes: NaN halves) until a wait covers its group. */
void cuda_emu::copy_async(void *shared, const void *global, int bytes) {
    fiber *f = this_thread("copy_async");
    if (bytes != 4 && bytes != 8 && bytes != 16) fatal("an asynchronous copy of %d bytes (4, 8 or 16)", bytes);
    if ((uintptr_t)shared % (unsigned)bytes || (uintptr_t)global % (unsigned)bytes)
        fatal("kernel %s: an asynchronous copy of %d bytes from %p to %p, not on %d bytes", running_kernel->name, bytes, global, shared, bytes);
    if (f->copies == MAX_ASYNC_COPIES) fatal("kernel %s: more than %d asynchronous copies of a thread in flight", running_kernel->name, (int)MAX_ASYNC_COPIES);
    memset(shared, 0xff, (size_t)bytes);
    stats.async_bytes += bytes;
    f->copy[f->copies].dst = shared;
    f->copy[f->copies].src = global;
    f->copy[f->copies].bytes = bytes;
    f->copy[f->copies].group = f->committed;
    f->copies++;
}

void cuda_emu::count_kv_load(int bytes) {
    this_thread("count_kv_load");
    stats.kv_load_bytes += bytes;
}

void cuda_emu::copy_async_commit(void) {
    this_thread("copy_async_commit")->committed++;
}

/* The thread's copies of every committed group but the newest `pending` land, in order. */
void cuda_emu::copy_async_wait(int pending) {
    fiber *f = this_thread("copy_async_wait");
    int kept = 0;
    for (int i = 0; i < f->copies; i++) {
        if (f->copy[i].group < f->committed - pending) memcpy(f->copy[i].dst, f->copy[i].src, (size_t)f->copy[i].bytes);
        else f->copy[kept++] = f->copy[i];
    }
    f->copies = kept;
}

void *cuda_emu::dynamic_shared(void) {
    this_thread("extern __shared__");
    return block.shared;
}

/* Lets warp w go on if the lanes its waiting lanes name all wait at one shuffle (or warp
 * barrier); returns whether it did. A named lane that exited, or is past the block, is a bug. */
static bool release_warp(int w, const char *kernel) {
    fiber *lanes = &block.fibers[(size_t)w * 32];
    int n = std::min(32, block.n - w * 32), first = -1;
    for (int l = 0; l < n && first < 0; l++)
        if (lanes[l].state == AT_SHUFFLE || lanes[l].state == AT_WARP_BARRIER) first = l;
    if (first < 0) return false;
    unsigned mask = lanes[first].lane_mask;
    thread_state kind = lanes[first].state;
    for (int l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        if (l >= n) fatal("kernel %s: a warp shuffle's mask %#x names lane %d of warp %d, past the block's %d threads", kernel, mask, l, w, block.n);
        if (lanes[l].state == EXITED) fatal("kernel %s: lane %d of warp %d exited before the warp shuffle or __syncwarp its mask %#x names it in", kernel, l, w, mask);
        if (lanes[l].state != kind || lanes[l].lane_mask != mask) return false;
    }
    for (int l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        if (kind == AT_SHUFFLE) {
            int from = lanes[l].shuffle_from;
            if (!(mask >> from & 1)) fatal("kernel %s: lane %d reads lane %d, which its shuffle's mask %#x leaves out", kernel, l, from, mask);
            lanes[l].shuffle_out = lanes[from].shuffle_in;
        }
        lanes[l].state = RUNNABLE;
    }
    return true;
}

/* Dynamic shared memory of `bytes` for the next block, NaN bytes until written: the end of one
 * mapping whose next page is closed, so a read or write past the launch's bytes faults. */
enum { SHARED_BYTES = 48 * 1024 }; /* a block's shared memory at most, as the device reports */

static char *shared_ready(size_t bytes) {
    if (!shared_guard) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        char *map = (char *)mmap(NULL, SHARED_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED || mprotect(map + SHARED_BYTES, page, PROT_NONE))
            fatal("mmap of dynamic shared memory: %s", strerror(errno));
        shared_guard = map + SHARED_BYTES;
    }
    shared_bytes = bytes;
    memset(shared_guard - bytes, 0xff, bytes);
    return shared_guard - bytes;
}

/* The order of n threads (or blocks) for one round: forward, reversed, or shuffled. */
static void order_of(std::vector<int> &order, int n, uint64_t salt) {
    order.resize((size_t)n);
    for (int i = 0; i < n; i++) order[(size_t)i] = settings.order == CUDA_EMU_REVERSE ? n - 1 - i : i;
    if (settings.order == CUDA_EMU_SHUFFLE) {
        std::mt19937_64 rng(settings.seed * 0x9e3779b97f4a7c15ull + salt);
        std::shuffle(order.begin(), order.end(), rng);
    }
}

/* One block, a warp at a time: each warp's threads run (in the chosen order) until they wait, its
 * shuffles complete as soon as its lanes meet, and it runs on so until its threads reach the
 * block's barrier or exit; then the next warp (warps in the chosen order too). So one warp gets a
 * whole stretch between barriers ahead of the others, and a race between warps on shared memory
 * shows when the warps' order changes. Then the barrier opens, until every thread exits. */
static void run_block(const cuda_emu::launch_config &c, const std::function<void()> &body, uint64_t block_number) {
    if (block.fibers.empty()) block.fibers.reserve(MAX_THREADS);
    block.n = (int)(c.block.x * c.block.y * c.block.z);
    fiber_stacks_ready(block.n);
    block.body = &body;
    block.shared = shared_ready(c.shared);
    for (int i = 0; i < block.n; i++) {
        fiber &f = block.fibers[(size_t)i];
        make_context(&f.saved, f.stack, STACK_BYTES, fiber_main);
        f.state = RUNNABLE;
        f.copies = f.committed = 0;
        f.index = uint3{(unsigned)i % c.block.x, (unsigned)i / c.block.x % c.block.y, (unsigned)i / (c.block.x * c.block.y)};
    }
    std::vector<int> warps, lanes;
    int n_warps = (block.n + 31) / 32;
    for (uint64_t round = 0;; round++) {
        order_of(warps, n_warps, block_number * 1000003u + round);
        for (int w : warps)
            for (uint64_t step = 0;; step++) {
                int n = std::min(32, block.n - w * 32);
                order_of(lanes, n, (block_number * 1000003u + round) * 4099u + (uint64_t)w * 131u + step);
                for (int l : lanes)
                    if (block.fibers[(size_t)(w * 32 + l)].state == RUNNABLE) run_fiber(&block.fibers[(size_t)(w * 32 + l)]);
                if (!release_warp(w, c.name)) break;
            }
        int exited = 0, at_barrier = 0;
        for (int i = 0; i < block.n; i++) {
            exited += block.fibers[(size_t)i].state == EXITED;
            at_barrier += block.fibers[(size_t)i].state == AT_BARRIER;
        }
        if (exited == block.n) break;
        if (at_barrier + exited < block.n)
            fatal("kernel %s, block (%u,%u,%u): threads wait at different barriers and shuffles (a deadlock on a GPU)",
                  c.name, blockIdx.x, blockIdx.y, blockIdx.z);
        for (int i = 0; i < block.n; i++) /* threads that exited count as arrived, as on the GPU */
            if (block.fibers[(size_t)i].state == AT_BARRIER) block.fibers[(size_t)i].state = RUNNABLE;
    }
    block.current = NULL;
    stats.blocks++;
    stats.threads += block.n;
}

/* The grid: its blocks in the chosen order, then the allocations it touched are checked past
 * their ends. */
static void run_grid(const cuda_emu::launch_config &c, const std::function<void()> &body) {
    unsigned nb = c.grid.x * c.grid.y * c.grid.z;
    std::vector<int> order;
    order_of(order, (int)nb, 0x5eed);
    running_kernel = &c;
    gridDim = c.grid, blockDim = c.block;
    for (int i : order) {
        unsigned b = (unsigned)i;
        blockIdx = uint3{b % c.grid.x, b / c.grid.x % c.grid.y, b / (c.grid.x * c.grid.y)};
        run_block(c, body, b);
    }
    running_kernel = NULL;
    char who[300];
    snprintf(who, sizeof who, "kernel %s (launched at %s:%d)", c.name, c.file, c.line);
    for (allocation *al : opened) check_slack(al, who);
    stats.kernels++;
}

static int has_code_for_device() {
    static const int built[] = {__CUDA_ARCH_LIST__};
    int cc = settings.major * 10 + settings.minor, newest = 0;
    for (int a : built) {
        a /= 10;
        newest = std::max(newest, a);
        if (a / 10 == settings.major && a <= cc) return 1; /* the architecture's own code */
    }
    return cc >= newest; /* PTX of the newest, compiled for later GPUs */
}

int cuda_emu::check_pointer_argument(const launch_config &c, int index, const void *p) {
    if (!p) return 0;
    allocation *al = find(p);
    if (al) return 0; /* device memory, or pinned host memory the GPU maps */
    api_error(cudaErrorInvalidValue, "kernel %s (%s:%d): argument %d, %p, is pageable host memory, which a GPU "
              "cannot read", c.name, c.file, c.line, index + 1, p);
    return 1;
}

void cuda_emu::enqueue_kernel(const launch_config &c, std::function<void()> body) {
    settings_ready();
    unsigned long threads = (unsigned long)c.block.x * c.block.y * c.block.z;
    if (!has_code_for_device()) {
        api_error(cudaErrorNoKernelImageForDevice, "kernel %s: no code for compute capability %d.%d in this build",
                  c.name, settings.major, settings.minor);
        return;
    }
    if (threads == 0 || threads > MAX_THREADS || c.block.z > 64 || c.grid.x == 0 || c.grid.y == 0 ||
        c.grid.z == 0 || c.grid.y > 65535 || c.grid.z > 65535 || c.shared > SHARED_BYTES) {
        api_error(cudaErrorInvalidConfiguration, "kernel %s (%s:%d): grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of "
                  "shared memory: not a launch a GPU takes", c.name, c.file, c.line, c.grid.x, c.grid.y, c.grid.z,
                  c.block.x, c.block.y, c.block.z, c.shared);
        return;
    }
    if (c.shared % 16)
        fatal("kernel %s (%s:%d): %zu bytes of dynamic shared memory, not whole 16-byte groups: nvcc may load "
              "a group's last bytes with its first (LDS.128), past the launch's bytes, which compute-sanitizer "
              "reports", c.name, c.file, c.line, c.shared);
    if (!stream_exists(c.stream)) {
        api_error(cudaErrorInvalidResourceHandle, "kernel %s: no such stream", c.name);
        return;
    }
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    enqueue(stream_of(c.stream), operation{[c, body] { run_grid(c, body); }, {}, c.name});
}

/* ============================================================================================
 * Devices and errors
 * ============================================================================================ */

cudaError_t cudaGetDeviceCount(int *n) {
    settings_ready();
    *n = 0;
    if (settings.devices <= 0) return cudaErrorNoDevice;
    *n = settings.devices;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
    settings_ready();
    return device >= 0 && device < settings.devices ? cudaSuccess : api_error(cudaErrorInvalidDevice, "cudaSetDevice(%d): no such device", device);
}
cudaError_t cudaGetDevice(int *device) { *device = 0; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
    settings_ready();
    if (device < 0 || device >= settings.devices) return api_error(cudaErrorInvalidDevice, "cudaGetDeviceProperties(%d): no such device", device);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "emulated GPU (tests/cuda_emu)");
    p->totalGlobalMem = settings.device_bytes;
    p->major = settings.major, p->minor = settings.minor;
    p->multiProcessorCount = settings.multiprocessors, p->warpSize = 32, p->maxThreadsPerBlock = MAX_THREADS;
    p->sharedMemPerBlock = SHARED_BYTES;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e) return e;
    *value = attr == cudaDevAttrComputeCapabilityMajor ? p.major : attr == cudaDevAttrComputeCapabilityMinor ? p.minor
           : attr == cudaDevAttrMultiProcessorCount ? p.multiProcessorCount : p.maxThreadsPerBlock;
    return cudaSuccess;
}
cudaError_t cuda_emu_func_attributes(cudaFuncAttributes *a) {
    settings_ready();
    memset(a, 0, sizeof *a);
    if (!has_code_for_device()) return cudaErrorNoKernelImageForDevice;
    a->maxThreadsPerBlock = MAX_THREADS;
    a->ptxVersion = a->binaryVersion = settings.major * 10 + settings.minor;
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void) { cudaError_t e = last_error; last_error = cudaSuccess; return e; }
cudaError_t cudaPeekAtLastError(void) { return last_error; }

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    default: return "cudaErrorUnknown";
    }
}
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    case cudaErrorGraphExecUpdateFailure:
        return "the graph update was not performed: it changed what an instantiated graph keeps";
    default: return "unknown error";
    }
}

/* ============================================================================================
 * cuBLAS: checked as documented, computed in fp32 through OpenBLAS on the handle's stream
 * ============================================================================================ */

struct cublasContext { cudaStream_t stream; };
static std::vector<cublasContext *> &handles = *new std::vector<cublasContext *>;

static bool handle_exists(cublasHandle_t h) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    return h && std::find(handles.begin(), handles.end(), h) != handles.end();
}

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    if (refused_while_capturing("cublasCreate")) return CUBLAS_STATUS_NOT_INITIALIZED;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    *h = new cublasContext{0};
    handles.push_back(*h);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
    if (!handle_exists(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    drain_all();
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    handles.erase(std::find(handles.begin(), handles.end(), h));
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    if (!handle_exists(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    if (!stream_exists(s)) {
        api_error(cudaErrorInvalidResourceHandle, "cublasSetStream: no such stream");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t *s) {
    if (!handle_exists(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    *s = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
    (void)mode;
    return handle_exists(h) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
const char *cublasGetStatusName(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}
const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_INVALID_VALUE: return "an unsupported value or parameter was passed to the function";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    default: return "an internal operation failed";
    }
}

/* One matrix operand: rows x cols, column-major at leading dimension ld, `batches` of them
 * `stride` elements apart. */
struct matrix {
    const char *name;
    void *data;
    cudaDataType type;
    int rows, cols, ld;
    long long stride;
};
static size_t type_bytes(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }
static float element(const matrix &m, size_t i) {
    if (m.type == CUDA_R_32F) return ((const float *)m.data)[i];
    unsigned short b = ((const unsigned short *)m.data)[i];
    if (m.type == CUDA_R_16F) return cuda_emu_half_to_float(b);
    uint32_t x = (uint32_t)b << 16; /* bf16 */
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static void set_element(const matrix &m, size_t i, float v) {
    if (m.type == CUDA_R_32F) ((float *)m.data)[i] = v;
    else if (m.type == CUDA_R_16F) ((unsigned short *)m.data)[i] = cuda_emu_float_to_half(v);
    else fatal("bf16 outputs are not emulated");
}
/* Elements the operand spans, over all its batches. */
static size_t extent(const matrix &m, int batches) {
    if (m.rows == 0 || m.cols == 0 || batches == 0) return 0;
    return (size_t)m.ld * (m.cols - 1) + m.rows + (size_t)(batches - 1) * (size_t)m.stride;
}

/* A refused cuBLAS call: "cuda-emu: CALL: " and why. */
static cublasStatus_t invalid(const char *call, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda-emu: %s: %s\n", call, why);
    return CUBLAS_STATUS_INVALID_VALUE;
}

/* The documented checks of cublasGemmEx (and its batched form), then the harness's own: each
 * operand is device memory and lies inside its allocation. */
static cublasStatus_t check_operands(const char *call, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                     int k, const matrix &A, const matrix &B, const matrix &C,
                                     cublasComputeType_t compute, int batches) {
    if (m < 0 || n < 0 || k < 0 || batches < 0) return invalid(call, "m %d, n %d, k %d, batches %d", m, n, k, batches);
    if (ta > CUBLAS_OP_C || tb > CUBLAS_OP_C) return invalid(call, "an operation that is not N, T or C");
    if (A.ld < std::max(1, A.rows)) return invalid(call, "lda %d < %d (%s of op(A))", A.ld, std::max(1, A.rows), ta == CUBLAS_OP_N ? "m, rows" : "k, rows");
    if (B.ld < std::max(1, B.rows)) return invalid(call, "ldb %d < %d (%s of op(B))", B.ld, std::max(1, B.rows), tb == CUBLAS_OP_N ? "k, rows" : "n, rows");
    if (C.ld < std::max(1, C.rows)) return invalid(call, "ldc %d < %d (m)", C.ld, std::max(1, C.rows));
    bool half_in = A.type == CUDA_R_16F && B.type == CUDA_R_16F, bf_in = A.type == CUDA_R_16BF && B.type == CUDA_R_16BF;
    bool ok = compute == CUBLAS_COMPUTE_32F || compute == CUBLAS_COMPUTE_32F_FAST_16F
                  ? (half_in && (C.type == CUDA_R_16F || C.type == CUDA_R_32F)) ||
                        (bf_in && (C.type == CUDA_R_16BF || C.type == CUDA_R_32F)) ||
                        (A.type == CUDA_R_32F && B.type == CUDA_R_32F && C.type == CUDA_R_32F)
                  : compute == CUBLAS_COMPUTE_16F && half_in && C.type == CUDA_R_16F;
    if (!ok) {
        fprintf(stderr, "cuda-emu: %s: types A %d, B %d, C %d with compute type %d: not a combination cuBLAS supports\n",
                call, A.type, B.type, C.type, compute);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    for (const matrix *x : {&A, &B, &C}) {
        size_t bytes = extent(*x, batches) * type_bytes(x->type);
        if (bytes && memory_of(x->data, bytes) != DEVICE) {
            fprintf(stderr, "cuda-emu: %s: %s (%zu bytes from %p) is %s (a GPU would fault)\n", call, x->name, bytes,
                    x->data, memory_of(x->data, 1) == DEVICE ? "not inside its device allocation" : "not device memory");
            return CUBLAS_STATUS_EXECUTION_FAILED;
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t check_gemm(const char *call, cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                 int m, int n, int k, const matrix &A, const matrix &B, const matrix &C,
                                 cublasComputeType_t compute, int batches) {
    if (!handle_exists(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream_exists(h->stream)) return invalid(call, "the handle's stream was destroyed");
    return check_operands(call, ta, tb, m, n, k, A, B, C, compute, batches);
}

/* op(A) op(B) of one batch in fp32 through OpenBLAS, C rounded once to its type. */
static void gemm_fp32(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha, matrix A,
                      matrix B, float beta, matrix C, int batch) {
    std::vector<float> a((size_t)A.ld * A.cols), b((size_t)B.ld * B.cols), c((size_t)C.ld * C.cols);
    auto widen = [batch](const matrix &x, std::vector<float> &out, bool needed) {
        if (!needed) return;
        for (int j = 0; j < x.cols; j++)
            for (int i = 0; i < x.rows; i++) {
                size_t at = (size_t)j * x.ld + i;
                out[at] = element(x, (size_t)batch * x.stride + at);
            }
    };
    widen(A, a, true), widen(B, b, true), widen(C, c, beta != 0); /* beta 0: C is not read */
    if (m && n)
        cblas_sgemm(CblasColMajor, ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                    m, n, k, alpha, a.data(), A.ld, b.data(), B.ld, beta, c.data(), C.ld);
    for (int j = 0; j < C.cols; j++)
        for (int i = 0; i < C.rows; i++) set_element(C, (size_t)batch * C.stride + (size_t)j * C.ld + i, c[(size_t)j * C.ld + i]);
    stats.gemms++;
}

/* The harness's clock: a product of m n k multiply-adds takes m n k picoseconds times its
 * algorithm's factor (cuBLAS's default 1; cublasLt's, lt_algos). Only products queued outside a
 * capture move it; events read it (cudaEventElapsedTime). */
static double product_time(int m, int n, int k, int batches, double factor) {
    return factor * (double)m * n * k * batches * 1e-9;
}

/* A product on stream s, computed when the stream's work runs (under the device lock). */
static void queue_product(stream_state *s, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al,
                          matrix a, matrix b, float be, matrix c, int batches, double factor) {
    if (!s->capture) s->clock += product_time(m, n, k, batches, factor);
    enqueue(s, operation{[=] {
        for (int i = 0; i < batches; i++) gemm_fp32(ta, tb, m, n, k, al, a, b, be, c, i);
    }, {}, "gemm"});
}

static cublasStatus_t gemm(const char *call, cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const void *alpha, const void *A, cudaDataType at, int lda, long long sa,
                           const void *B, cudaDataType bt, int ldb, long long sb, const void *beta, void *C,
                           cudaDataType ct, int ldc, long long sc, int batches, cublasComputeType_t compute) {
    matrix a{"A", (void *)A, at, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda, sa};
    matrix b{"B", (void *)B, bt, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb, sb};
    matrix c{"C", C, ct, m, n, ldc, sc};
    cublasStatus_t s = check_gemm(call, h, ta, tb, m, n, k, a, b, c, compute, batches);
    if (s) return s;
    if (!alpha || !beta) return invalid(call, "alpha or beta is NULL");
    float al = *(const float *)alpha, be = *(const float *)beta; /* the host's values now */
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    queue_product(stream_of(h->stream), ta, tb, m, n, k, al, a, b, be, c, batches, 1.0);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B,
                            cudaDataType bt, int ldb, const void *beta, void *C, cudaDataType ct, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    (void)algo;
    return gemm("cublasGemmEx", h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc, 0, 1, compute);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                          int n, int k, const void *alpha, const void *A, cudaDataType at,
                                          int lda, long long sa, const void *B, cudaDataType bt, int ldb,
                                          long long sb, const void *beta, void *C, cudaDataType ct, int ldc,
                                          long long sc, int batches, cublasComputeType_t compute,
                                          cublasGemmAlgo_t algo) {
    (void)algo;
    return gemm("cublasGemmStridedBatchedEx", h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C,
                ct, ldc, sc, batches, compute);
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc) {
    return gemm("cublasSgemm", h, ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B, CUDA_R_32F, ldb, 0, beta, C,
                CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F);
}

/* ---- cublasLt ---- */

/* The harness's algorithms, in the order its heuristic gives them: the workspace each needs and its
 * factor on the clock (product_time; cuBLAS's default is 1): the second is the fastest that fits
 * a workspace of a few MiB. */
static const struct {
    size_t workspace;
    double factor;
} lt_algos[] = {{0, 1.1}, {(size_t)1 << 20, 0.9}, {(size_t)64 << 20, 0.8}};

struct cublasLtContext {
    int unused;
};
struct cuda_emu_lt_desc {
    cublasComputeType_t compute;
    cudaDataType scale;
    cublasOperation_t ta, tb;
};
struct cuda_emu_lt_layout {
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
};
struct cuda_emu_lt_preference {
    size_t max_workspace;
    uint32_t min_alignment[4]; /* of A, B, C and D, in bytes */
};
static std::vector<const void *> &lt_live = *new std::vector<const void *>; /* made, not destroyed */

static bool lt_exists(const void *p) {
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    return p && std::find(lt_live.begin(), lt_live.end(), p) != lt_live.end();
}
template <typename T> static cublasStatus_t lt_make(T **p, T value) {
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    *p = new T(value);
    lt_live.push_back(*p);
    return CUBLAS_STATUS_SUCCESS;
}
template <typename T> static cublasStatus_t lt_destroy(T *p) {
    if (!lt_exists(p)) return CUBLAS_STATUS_NOT_INITIALIZED;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    lt_live.erase(std::find(lt_live.begin(), lt_live.end(), (const void *)p));
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) { return lt_make(h, cublasLtContext{0}); }
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { return lt_destroy(h); }
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
    return lt_make(d, cuda_emu_lt_desc{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N});
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { return lt_destroy(d); }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t bytes) {
    if (!lt_exists(d)) return CUBLAS_STATUS_NOT_INITIALIZED;
    int32_t op;
    if (bytes != sizeof op || !buf) return invalid("cublasLtMatmulDescSetAttribute", "%zu bytes", bytes);
    memcpy(&op, buf, sizeof op);
    if (op < CUBLAS_OP_N || op > CUBLAS_OP_C) return invalid("cublasLtMatmulDescSetAttribute", "operation %d", op);
    if (attr == CUBLASLT_MATMUL_DESC_TRANSA) d->ta = (cublasOperation_t)op;
    else if (attr == CUBLASLT_MATMUL_DESC_TRANSB) d->tb = (cublasOperation_t)op;
    else return invalid("cublasLtMatmulDescSetAttribute", "attribute %d is not emulated", attr);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    if (ld < (int64_t)std::max<uint64_t>(1, rows))
        return invalid("cublasLtMatrixLayoutCreate", "ld %lld < rows %llu", (long long)ld, (unsigned long long)rows);
    return lt_make(l, cuda_emu_lt_layout{type, rows, cols, ld});
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { return lt_destroy(l); }
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    return lt_make(p, cuda_emu_lt_preference{0, {256, 256, 256, 256}}); /* cublasLt's defaults */
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) { return lt_destroy(p); }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t bytes) {
    if (!lt_exists(p)) return CUBLAS_STATUS_NOT_INITIALIZED;
    const char *call = "cublasLtMatmulPreferenceSetAttribute";
    if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
        uint32_t align;
        if (bytes != sizeof align || !buf) return invalid(call, "attribute %d of %zu bytes", attr, bytes);
        memcpy(&align, buf, sizeof align);
        if (align == 0 || (align & (align - 1))) return invalid(call, "an alignment of %u bytes", align);
        p->min_alignment[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = align;
        return CUBLAS_STATUS_SUCCESS;
    }
    if (attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES || bytes != sizeof(uint64_t) || !buf)
        return invalid(call, "attribute %d of %zu bytes", attr, bytes);
    uint64_t v;
    memcpy(&v, buf, sizeof v);
    p->max_workspace = (size_t)v;
    return CUBLAS_STATUS_SUCCESS;
}

/* The product a descriptor and its layouts describe: D = op(A) op(B) is m x n with k between
 * them; refused unless the layouts agree with one another and the types are ones cublasLt takes
 * (checked again with the pointers by check_operands). */
static cublasStatus_t lt_shape(const char *call, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                               cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d, int *m,
                               int *n, int *k) {
    for (const void *x : {(const void *)desc, (const void *)a, (const void *)b, (const void *)c, (const void *)d})
        if (!lt_exists(x)) return invalid(call, "a descriptor or layout that was not made or was destroyed");
    if (desc->scale != CUDA_R_32F || desc->compute != CUBLAS_COMPUTE_32F)
        return invalid(call, "compute type %d with scale type %d: not emulated", desc->compute, desc->scale);
    *m = (int)d->rows, *n = (int)d->cols;
    *k = (int)(desc->ta == CUBLAS_OP_N ? a->cols : a->rows);
    uint64_t a_m = desc->ta == CUBLAS_OP_N ? a->rows : a->cols;
    uint64_t b_k = desc->tb == CUBLAS_OP_N ? b->rows : b->cols, b_n = desc->tb == CUBLAS_OP_N ? b->cols : b->rows;
    if (a_m != d->rows || b_k != (uint64_t)*k || b_n != d->cols || c->rows != d->rows || c->cols != d->cols ||
        c->type != d->type || c->ld != d->ld)
        return invalid(call, "layouts that do not agree: op(A) %llu x %d, op(B) %llu x %llu, C %llu x %llu, D %llu x "
                       "%llu", (unsigned long long)a_m, *k, (unsigned long long)b_k, (unsigned long long)b_n,
                       (unsigned long long)c->rows, (unsigned long long)c->cols, (unsigned long long)d->rows,
                       (unsigned long long)d->cols);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref,
                                              int requested, cublasLtMatmulHeuristicResult_t results[],
                                              int *returned) {
    const char *call = "cublasLtMatmulAlgoGetHeuristic";
    int m, n, k;
    if (!lt_exists(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!lt_exists(pref)) return invalid(call, "a preference that was not made or was destroyed");
    if (requested < 1 || !results || !returned) return invalid(call, "%d results asked", requested);
    cublasStatus_t s = lt_shape(call, desc, a, b, c, d, &m, &n, &k);
    if (s) return s;
    *returned = 0;
    for (int i = 0; i < (int)(sizeof lt_algos / sizeof *lt_algos) && *returned < requested; i++) {
        if (lt_algos[i].workspace > pref->max_workspace) continue;
        cublasLtMatmulHeuristicResult_t r = {};
        r.algo.data[0] = (uint64_t)i + 1;
        for (int j = 0; j < 4; j++) r.algo.data[1 + j] = pref->min_alignment[j]; /* what it assumes */
        r.workspaceSize = lt_algos[i].workspace;
        r.state = CUBLAS_STATUS_SUCCESS;
        r.wavesCount = 1;
        results[(*returned)++] = r;
    }
    return *returned ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
    const char *call = "cublasLtMatmul";
    int m, n, k;
    if (!lt_exists(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream_exists(stream)) return invalid(call, "no such stream");
    cublasStatus_t s = lt_shape(call, desc, a, b, c, d, &m, &n, &k);
    if (s) return s;
    int which = algo ? (int)algo->data[0] - 1 : -1;
    if (which < 0 || which >= (int)(sizeof lt_algos / sizeof *lt_algos))
        return invalid(call, "an algorithm that cublasLtMatmulAlgoGetHeuristic did not give");
    size_t need = lt_algos[which].workspace;
    if (workspace_bytes < need) return invalid(call, "a workspace of %zu bytes; the algorithm needs %zu", workspace_bytes, need);
    if (need && memory_of(workspace, workspace_bytes) != DEVICE)
        return invalid(call, "the workspace (%zu bytes from %p) is not inside a device allocation", workspace_bytes,
                       workspace);
    if (C != D) return invalid(call, "C and D apart: not emulated");
    matrix ma{"A", (void *)A, a->type, (int)a->rows, (int)a->cols, (int)a->ld, 0};
    matrix mb{"B", (void *)B, b->type, (int)b->rows, (int)b->cols, (int)b->ld, 0};
    matrix mc{"C", D, d->type, (int)d->rows, (int)d->cols, (int)d->ld, 0};
    s = check_operands(call, desc->ta, desc->tb, m, n, k, ma, mb, mc, desc->compute, 1);
    if (s) return s;
    if (!alpha || !beta) return invalid(call, "alpha or beta is NULL");
    float al = *(const float *)alpha, be = *(const float *)beta;
    std::lock_guard<std::recursive_mutex> lock(device_mutex);
    stats.lt_matmuls[which]++;
    queue_product(stream_of(stream), desc->ta, desc->tb, m, n, k, al, ma, mb, be, mc, 1, lt_algos[which].factor);
    const void *operands[4] = {A, B, C, D};
    for (int j = 0; j < 4; j++) {
        uint64_t assumed = algo->data[1 + j];
        if ((uintptr_t)operands[j] % assumed == 0) continue;
        fprintf(stderr, "cuda-emu: %s: %c at %p is not %llu-byte aligned, as its algorithm was chosen for: D's "
                "values are wrong\n", call, "ABCD"[j], operands[j], (unsigned long long)assumed);
        enqueue(stream_of(stream), operation{[=] {
            for (int col = 0; col < mc.cols; col++)
                for (int row = 0; row < mc.rows; row++) set_element(mc, (size_t)col * mc.ld + row, NAN);
        }, {}, "gemm"});
        break;
    }
    return CUBLAS_STATUS_SUCCESS;
}

/* At exit: what the harness itself holds, so that LeakSanitizer sees only the program's. */
static struct cleanup {
    ~cleanup() {
        for (fiber &f : block.fibers) munmap(f.stack, STACK_BYTES);
        block.fibers.clear();
    }
} at_exit;
