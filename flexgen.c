/* flexgen.c: the runtime and the command line (paper §4.1, Fig. 4, §4.4).
 *
 *   generate()      prompts in blocks of gpu_batch_size x num_gpu_batches sequences; each block
 *                   walks token i, layer j, GPU batch k in the order of Fig. 4, so a layer's
 *                   weights are used by every GPU batch of the block before the next layer's
 *   pipeline        as one stage of mpirun -np M (§4.4): the same loop over the stage's share of
 *                   the layers, M blocks (micro-batches) in flight, activations to the next stage
 *                   and token ids back to the first through pipeline.c
 *   plan check      the whole plan (weights, KV cache, workspace) against the memory there is,
 *                   refused before any compute when it does not fit
 *   report          FlexGen's benchmark lines, or one JSON object with --json
 *   profile         this machine's constants for the cost model (§4.3), on the runtime's paths
 *   CLI             flexgen [run flags] | flexgen policy [flags] | flexgen profile |
 *                   flexgen tokenize --vocab F --merges F
 *
 * Everything that can fail on user input returns an error line; main prints it and exits 2.
 */
#define _GNU_SOURCE
#include "flexgen.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

/* ============================================================================================
 * Tiers (DESIGN.md, "Tiers"): one accounting point each. I/O threads move pages of the disk
 * tier in and out of memory, so the counters sit behind a lock.
 * ============================================================================================ */

const char *const fg_tier_names[N_TIERS] = {"gpu", "cpu", "disk"};
const char *const fg_link_names[N_LINKS] = {"disk->cpu", "cpu->gpu", "gpu->cpu", "cpu->disk"};
static const char *const tier_flags[N_TIERS] = {"--gpu-mem", "--cpu-mem", "--disk-mem"};

/* Threads: compute, and the two links (disk<->cpu, cpu<->gpu) once for weights and once for the
 * KV cache and activations, as FlexGen's separate CUDA streams: a layer's weights then load
 * while every GPU batch of the previous layer computes, without holding up those batches' I/O. */
enum { TRACK_COMPUTE, N_TRACKS = 5 };
static const char *const track_names[N_TRACKS] = {"compute", "disk<->cpu weights",
    "cpu<->gpu weights", "disk<->cpu cache+activations", "cpu<->gpu cache+activations"};

typedef struct {
    const char *name;
    int a, b;
    double start, end; /* seconds since the run began */
} trace_event;

typedef struct {
    trace_event *events;
    size_t n, cap;
} trace_track;

/* A task on an I/O link: fn(rt, arg), after task `after_seq` of link `after_link` is done. */
typedef struct io_task {
    void (*fn)(fg_runtime *rt, const struct io_task *t);
    const char *name;
    int after_link;
    uint64_t after_seq;
    void *ctx;      /* what the task works on (a model, a block) */
    int arg[6];
} io_task;

#define IO_QUEUE 64

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    io_task queue[IO_QUEUE];
    uint64_t submitted, done;
    int running, stop, track;
} io_link;

enum { IO_WEIGHT_DISK, IO_WEIGHT_HOST, IO_DISK, IO_HOST, N_IO }; /* the I/O threads */

struct fg_runtime {
    fg_policy policy;
    const fg_backend *backend;
    char offload_dir[4096], weight_dir[4096];
    pthread_mutex_t lock; /* the tier and link counters */
    double capacity[N_TIERS], current[N_TIERS], peak[N_TIERS], link_bytes[N_LINKS];
    double disk_read_seconds;
    io_link io[N_IO];
    trace_track tracks[N_TRACKS];
    double t0;
    fg_pipe *pipe;        /* to the other pipeline stages (§4.4); NULL: one stage */
};

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static const double GB = 1 << 30;

/* "1.50 GiB", "12.3 MiB", "4.0 KiB": sizes in error lines, readable at any scale. */
typedef struct { char s[32]; } size_text;
static size_text human(double bytes) {
    size_text t;
    if (bytes >= GB) snprintf(t.s, sizeof t.s, "%.2f GiB", bytes / GB);
    else if (bytes >= 1 << 20) snprintf(t.s, sizeof t.s, "%.1f MiB", bytes / (1 << 20));
    else snprintf(t.s, sizeof t.s, "%.1f KiB", bytes / 1024);
    return t;
}

/* Takes bytes from a tier, or fails naming the tier, what needed them, and what is left. */
static int tier_take(fg_runtime *rt, fg_tier t, double bytes, const char *what, char *err) {
    pthread_mutex_lock(&rt->lock);
    int fits = rt->current[t] + bytes <= rt->capacity[t];
    if (fits) {
        rt->current[t] += bytes;
        if (rt->current[t] > rt->peak[t]) rt->peak[t] = rt->current[t];
    }
    double in_use = rt->current[t];
    pthread_mutex_unlock(&rt->lock);
    if (fits) return 0;
    return fg_fail(err, "%s tier: %s needs %s more, %s of %s in use (%s)", fg_tier_names[t], what,
                   human(bytes).s, human(in_use).s, human(rt->capacity[t]).s, tier_flags[t]);
}

/* Transient use (pages of the disk tier in memory while they move): counted, never refused,
 * since the plan check already bounded it. */
static void tier_add(fg_runtime *rt, fg_tier t, double bytes) {
    pthread_mutex_lock(&rt->lock);
    rt->current[t] += bytes;
    if (rt->current[t] > rt->peak[t]) rt->peak[t] = rt->current[t];
    pthread_mutex_unlock(&rt->lock);
}

static void link_add(fg_runtime *rt, fg_link l, double bytes) {
    pthread_mutex_lock(&rt->lock);
    rt->link_bytes[l] += bytes;
    pthread_mutex_unlock(&rt->lock);
}

/* Memory of the gpu or cpu tier, zeroed (cpu-tier weights pinned with --pin-weight, the rest of
 * the cpu tier always: what moves over the cpu <-> gpu link). NULL (and err) when the tier or the
 * machine is full. */
static void *tier_alloc_pinned(fg_runtime *rt, fg_tier t, size_t bytes, const char *what,
                               int pinned, char *err) {
    if (bytes == 0) bytes = 64;
    if (tier_take(rt, t, (double)bytes, what, err)) return NULL;
    void *p = t == TIER_GPU ? rt->backend->alloc(bytes) : rt->backend->host_alloc(bytes, pinned);
    if (!p) {
        tier_add(rt, t, -(double)bytes);
        fg_fail(err, "%s tier: out of memory allocating %s for %s", fg_tier_names[t],
                human((double)bytes).s, what);
        return NULL;
    }
    return p;
}

static void *tier_alloc(fg_runtime *rt, fg_tier t, size_t bytes, const char *what, char *err) {
    return tier_alloc_pinned(rt, t, bytes, what, 1, err);
}

static void tier_free(fg_runtime *rt, fg_tier t, void *p, size_t bytes) {
    if (!p) return;
    if (bytes == 0) bytes = 64;
    if (t == TIER_GPU) rt->backend->free(p);
    else rt->backend->host_free(p);
    tier_add(rt, t, -(double)bytes);
}

/* ============================================================================================
 * The disk tier: files in the offload dir, mapped; created unnamed (or unlinked at once), so
 * nothing is left behind after an exit, an error or Ctrl-C. Pages come in with WILLNEED and a
 * touch (the disk->cpu link) and leave with msync and DONTNEED, so resident memory follows the
 * policy and not the page cache.
 * ============================================================================================ */

typedef struct {
    int fd;
    char *base;
    size_t size, used;
} disk_arena;

static size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }
static size_t page_up(size_t n) { return (n + page_size() - 1) & ~(page_size() - 1); }

/* An unnamed file in dir: O_TMPFILE where the file system has it, else mkstemp + unlink. */
static int unnamed_file(const char *dir, const char *flag, char *err) {
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
        char path[4200];
        snprintf(path, sizeof path, "%s/flexgen-XXXXXX", dir);
        fd = mkstemp(path);
        if (fd >= 0) unlink(path);
    }
    if (fd < 0) return fg_fail(err, "%s %s: cannot create a file: %s", flag, dir, strerror(errno));
    return fd;
}

/* Maps a file of `bytes`, reserving its blocks first so that a full disk is an error here and
 * not a SIGBUS later. Takes ownership of fd. */
static int arena_map(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir,
                     char *err) {
    memset(a, 0, sizeof *a);
    a->fd = -1;
    bytes = page_up(bytes ? bytes : 1);
    int rc = posix_fallocate(fd, 0, (off_t)bytes);
    if (rc) {
        close(fd);
        return fg_fail(err, "%s %s: cannot reserve %s: %s", flag, dir, human((double)bytes).s, strerror(rc));
    }
    a->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (a->base == MAP_FAILED) {
        a->base = NULL;
        close(fd);
        return fg_fail(err, "%s %s: cannot map %s: %s", flag, dir, human((double)bytes).s, strerror(errno));
    }
    a->fd = fd;
    a->size = bytes;
    return 0;
}

static void arena_close(disk_arena *a) {
    if (a->base) munmap(a->base, a->size);
    if (a->fd >= 0) close(a->fd);
    memset(a, 0, sizeof *a);
    a->fd = -1;
}

/* A page-aligned piece of the arena (the plan sized the arena, so this cannot run out). */
static void *arena_take(disk_arena *a, size_t bytes) {
    void *p = a->base + a->used;
    a->used += page_up(bytes);
    return p;
}

static void page_range(const disk_arena *a, const void *p, size_t bytes, size_t *off, size_t *len) {
    size_t start = (size_t)((const char *)p - a->base) & ~(page_size() - 1);
    size_t end = page_up((size_t)((const char *)p - a->base) + bytes);
    *off = start;
    *len = end > a->size ? a->size - start : end - start;
}

/* Reads len bytes of the arena at off into memory (and waits for them). */
static void disk_fetch_pages(const disk_arena *a, size_t off, size_t len) {
    madvise(a->base + off, len, MADV_WILLNEED);
    volatile const char *c = a->base + off;
    unsigned sum = 0;
    for (size_t i = 0; i < len; i += page_size()) sum += c[i];
    (void)sum;
}

/* disk -> cpu: bring the pages in (and wait for them), on the disk link's thread. */
static void disk_fetch(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes) {
    if (!bytes) return;
    size_t off, len;
    page_range(a, p, bytes, &off, &len);
    double t0 = now_seconds();
    disk_fetch_pages(a, off, len);
    double dt = now_seconds() - t0;
    pthread_mutex_lock(&rt->lock);
    rt->disk_read_seconds += dt;
    pthread_mutex_unlock(&rt->lock);
    link_add(rt, LINK_DISK_TO_CPU, (double)bytes);
    tier_add(rt, TIER_CPU, (double)bytes);
}

/* Writes the pages under p back (when dirty) and drops them from memory and the page cache. */
static void drop_pages(const disk_arena *a, const void *p, size_t bytes, int dirty) {
    size_t off, len;
    page_range(a, p, bytes, &off, &len);
    if (dirty) msync(a->base + off, len, MS_SYNC);
    madvise(a->base + off, len, MADV_DONTNEED);
    posix_fadvise(a->fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
}

/* Writes back what was written (cpu -> disk) and drops the pages from memory. */
static void disk_release(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes,
                         size_t written) {
    if (!bytes) return;
    drop_pages(a, p, bytes, written > 0);
    if (written) link_add(rt, LINK_CPU_TO_DISK, (double)written);
    tier_add(rt, TIER_CPU, -(double)bytes);
}

/* ============================================================================================
 * I/O links (Fig. 4's async loads and stores): one thread each for disk<->cpu and cpu<->gpu, for
 * weights and for the KV cache and activations, each running its tasks in order. A task may
 * wait for an earlier task of another link (a load from disk is read before it is copied to the
 * gpu tier; a store reaches the cpu tier before disk). Since a task only ever waits for one
 * submitted before it, the queues cannot deadlock.
 * With --overlap 0 every task runs at once on the compute thread: the same steps, in sequence.
 * ============================================================================================ */

static void trace_add(fg_runtime *rt, int track, const char *name, int a, int b, double start,
                      double end) {
    trace_track *t = &rt->tracks[track];
    if (!rt->policy.trace) return;
    if (t->n == t->cap) {
        size_t cap = t->cap * 2 + 1024;
        trace_event *grown = realloc(t->events, cap * sizeof *grown);
        if (!grown) return; /* a trace with gaps rather than a failed run */
        t->events = grown;
        t->cap = cap;
    }
    t->events[t->n++] = (trace_event){name, a, b, start - rt->t0, end - rt->t0};
}

static void run_task(fg_runtime *rt, int link, const io_task *t) {
    double start = now_seconds();
    t->fn(rt, t);
    trace_add(rt, rt->io[link].track, t->name, t->arg[0], t->arg[1], start, now_seconds());
}

static void io_wait(fg_runtime *rt, int link, uint64_t seq) {
    io_link *l = &rt->io[link];
    pthread_mutex_lock(&l->lock);
    while (l->done < seq) pthread_cond_wait(&l->changed, &l->lock);
    pthread_mutex_unlock(&l->lock);
}

static void *io_thread(void *arg) {
    fg_runtime *rt = ((void **)arg)[0];
    int link = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    io_link *l = &rt->io[link];
    pthread_mutex_lock(&l->lock);
    for (;;) {
        while (!l->stop && l->done == l->submitted) pthread_cond_wait(&l->changed, &l->lock);
        if (l->done == l->submitted) break;
        io_task t = l->queue[l->done % IO_QUEUE];
        pthread_mutex_unlock(&l->lock);
        if (t.after_seq) io_wait(rt, t.after_link, t.after_seq);
        run_task(rt, link, &t);
        pthread_mutex_lock(&l->lock);
        l->done++;
        pthread_cond_broadcast(&l->changed);
    }
    pthread_mutex_unlock(&l->lock);
    return NULL;
}

/* Queues a task on a link; returns its sequence number there (for io_wait and `after`). */
static uint64_t io_submit(fg_runtime *rt, int link, io_task t) {
    io_link *l = &rt->io[link];
    if (!l->running) { /* --overlap 0: in order, now */
        run_task(rt, link, &t);
        return ++l->done, ++l->submitted;
    }
    pthread_mutex_lock(&l->lock);
    while (l->submitted - l->done == IO_QUEUE) pthread_cond_wait(&l->changed, &l->lock);
    l->queue[l->submitted % IO_QUEUE] = t;
    uint64_t seq = ++l->submitted;
    pthread_cond_broadcast(&l->changed);
    pthread_mutex_unlock(&l->lock);
    return seq;
}

/* Fig. 4's "synchronize": the KV cache and activations that moved for this iteration are done;
 * with `weights` too, the next layer's weights (needed when the next iteration starts a layer),
 * but not the disk read of the layer after it, which may go on. */
static void io_sync(fg_runtime *rt, int weights) {
    for (int i = weights ? IO_WEIGHT_HOST : IO_DISK; i < N_IO; i++) io_wait(rt, i, rt->io[i].submitted);
}

static void io_stop(fg_runtime *rt) {
    for (int i = 0; i < N_IO; i++) {
        io_link *l = &rt->io[i];
        if (!l->running) continue;
        pthread_mutex_lock(&l->lock);
        l->stop = 1;
        pthread_cond_broadcast(&l->changed);
        pthread_mutex_unlock(&l->lock);
        pthread_join(l->thread, NULL);
        l->running = 0;
    }
}

/* ============================================================================================
 * The runtime: capacities, I/O threads, the trace.
 * ============================================================================================ */

#ifndef FLEXGEN_CUDA
int fg_cuda_compiled(void) { return 0; }
const fg_backend *fg_cuda_backend(char *err) {
    fg_fail(err, "this flexgen was built without CUDA (no nvcc at build time)");
    return NULL;
}
#endif

fg_policy fg_default_policy(void) {
    return (fg_policy){.device = FG_DEVICE_CPU, .gpu_batch_size = 16, .num_gpu_batches = 2,
                       .percent = {100, 0, 100, 0, 100, 0}, .overlap = 1, .pin_weight = 1,
                       .attn_sparsity = 1, .n_stages = 1};
}

static double mem_available_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    double kb = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
    if (f) fclose(f);
    if (kb > 0) return kb * 1024;
    return (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
}

static int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The offload dir must exist and be writable, whatever the plan puts on disk. */
static int check_dir(const char *flag, const char *dir, char *err) {
    if (!is_dir(dir)) return fg_fail(err, "%s %s: no such directory", flag, dir);
    if (access(dir, W_OK | X_OK) != 0) return fg_fail(err, "%s %s: not writable: %s", flag, dir, strerror(errno));
    return 0;
}

static void default_weight_dir(char *out, size_t n) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && *xdg) snprintf(out, n, "%s/flexgen", xdg);
    else if (home && *home) snprintf(out, n, "%s/.cache/flexgen", home);
    else snprintf(out, n, "%s/flexgen-weights", FG_DEFAULT_OFFLOAD_DIR);
}

/* The backend of a device: auto is CUDA when a GPU is there, else the CPU. NULL (and err) when
 * cuda is asked for and there is none. */
static const fg_backend *backend_for(fg_device device, char *err) {
    char why[FG_ERR_LEN];
    const fg_backend *cuda = device == FG_DEVICE_CPU ? NULL : fg_cuda_backend(why);
    if (cuda) return cuda;
    if (device == FG_DEVICE_CUDA) {
        fg_fail(err, "--device cuda: %s", why);
        return NULL;
    }
    return &fg_cpu_backend;
}

int fg_runtime_open(const fg_policy *p, fg_runtime **out, char *err) {
    *out = NULL;
    for (int kind = 0; kind < 3; kind++) {
        const int *pc = p->percent + 2 * kind;
        for (int i = 0; i < 2; i++)
            if (pc[i] < 0 || pc[i] > 100)
                return fg_fail(err, "--percent: %d is outside 0..100", pc[i]);
        if (pc[0] + pc[1] > 100)
            return fg_fail(err, "--percent: %s on gpu and cpu sum to %d%%, above 100",
                           (const char *[]){"weights", "KV cache", "activations"}[kind], pc[0] + pc[1]);
    }
    if (p->gpu_batch_size < 1 || p->num_gpu_batches < 1)
        return fg_fail(err, "--gpu-batch-size and --num-gpu-batches must be at least 1");
    if (!(p->attn_sparsity > 0 && p->attn_sparsity <= 1))
        return fg_fail(err, "--attn-sparsity: %g is outside (0, 1]", p->attn_sparsity);
    const char *offload = p->offload_dir ? p->offload_dir : FG_DEFAULT_OFFLOAD_DIR;
    if (check_dir("--offload-dir", offload, err)) return -1;
    const fg_backend *backend = backend_for(p->device, err);
    if (!backend) return -1;
    fg_runtime *rt = calloc(1, sizeof *rt);
    if (!rt) return fg_fail(err, "out of memory");
    rt->policy = *p;
    rt->backend = backend;
    snprintf(rt->offload_dir, sizeof rt->offload_dir, "%s", offload);
    if (p->weight_dir) snprintf(rt->weight_dir, sizeof rt->weight_dir, "%s", p->weight_dir);
    else default_weight_dir(rt->weight_dir, sizeof rt->weight_dir);
    pthread_mutex_init(&rt->lock, NULL);
    struct statvfs vfs;
    double disk_free = statvfs(offload, &vfs) == 0 ? (double)vfs.f_bavail * vfs.f_frsize : 0;
    double defaults[N_TIERS] = {mem_available_bytes(), mem_available_bytes(), disk_free};
    for (int t = 0; t < N_TIERS; t++) rt->capacity[t] = p->capacity[t] > 0 ? p->capacity[t] : defaults[t];
    rt->t0 = now_seconds();
    for (int i = 0; i < N_IO; i++) {
        io_link *l = &rt->io[i];
        l->track = 1 + i;
        pthread_mutex_init(&l->lock, NULL);
        pthread_cond_init(&l->changed, NULL);
        if (!p->overlap) continue;
        void **arg = malloc(2 * sizeof *arg);
        if (!arg) continue; /* runs without overlap rather than not at all */
        arg[0] = rt;
        arg[1] = (void *)(intptr_t)i;
        if (pthread_create(&l->thread, NULL, io_thread, arg) == 0) l->running = 1;
        else free(arg);
    }
    *out = rt;
    return 0;
}

void fg_runtime_close(fg_runtime *rt) {
    if (!rt) return;
    io_stop(rt);
    for (int i = 0; i < N_IO; i++) {
        pthread_mutex_destroy(&rt->io[i].lock);
        pthread_cond_destroy(&rt->io[i].changed);
    }
    for (int t = 0; t < N_TRACKS; t++) free(rt->tracks[t].events);
    pthread_mutex_destroy(&rt->lock);
    free(rt);
}

const fg_backend *fg_runtime_backend(const fg_runtime *rt) { return rt->backend; }

void fg_runtime_set_pipe(fg_runtime *rt, fg_pipe *p) { rt->pipe = p; }

void fg_runtime_stats(const fg_runtime *rt, fg_stats *s) {
    pthread_mutex_lock((pthread_mutex_t *)&rt->lock);
    for (int t = 0; t < N_TIERS; t++) {
        s->capacity[t] = rt->capacity[t];
        s->peak[t] = rt->peak[t];
        s->current[t] = rt->current[t];
    }
    for (int l = 0; l < N_LINKS; l++) s->link_bytes[l] = rt->link_bytes[l];
    pthread_mutex_unlock((pthread_mutex_t *)&rt->lock);
    s->host_memory = rt->backend->gpu_is_host ? mem_available_bytes() : 0;
}

/* Chrome's trace event format: one complete ("X") event per task, one thread per track, one
 * process per pipeline stage. The events of this runtime as stage `stage` of n, one a line. */
static char *trace_events(const fg_runtime *rt, int stage, int n) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    int pid = stage + 1;
    if (n > 1)
        fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"stage %d of %d\"}},\n",
                pid, stage + 1, n);
    for (int t = 0; t < N_TRACKS; t++)
        fprintf(f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}},\n",
                pid, t, track_names[t]);
    for (int t = 0; t < N_TRACKS; t++)
        for (size_t i = 0; i < rt->tracks[t].n; i++) {
            const trace_event *e = &rt->tracks[t].events[i];
            fprintf(f, "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.1f,\"dur\":%.1f,"
                       "\"args\":{\"a\":%d,\"b\":%d}},\n",
                    e->name, pid, t, e->start * 1e6, (e->end - e->start) * 1e6, e->a, e->b);
        }
    if (fclose(f) != 0) { free(text); return NULL; }
    return text;
}

/* The trace file from every stage's events, written whole or not at all. */
static int write_trace(const char *path, const char *events, char *err) {
    char tmp[4200];
    if (!events) return fg_fail(err, "--trace %s: out of memory", path);
    snprintf(tmp, sizeof tmp, "%s.tmp-XXXXXX", path);
    int fd = mkstemp(tmp);
    if (fd < 0) return fg_fail(err, "--trace %s: %s", path, strerror(errno));
    FILE *f = fdopen(fd, "w");
    if (!f) { close(fd); unlink(tmp); return fg_fail(err, "--trace %s: %s", path, strerror(errno)); }
    fprintf(f, "{\"traceEvents\":[\n%s", events);
    fprintf(f, "{\"name\":\"end\",\"ph\":\"i\",\"pid\":1,\"tid\":0,\"ts\":0,\"s\":\"g\"}\n]}\n");
    int ok = !ferror(f);
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return fg_fail(err, "--trace %s: write failed: %s", path, strerror(e));
    }
    return 0;
}

int fg_trace_write(const fg_runtime *rt, const char *path, char *err) {
    char *events = trace_events(rt, 0, 1);
    int rc = write_trace(path, events, err);
    free(events);
    return rc;
}

/* ============================================================================================
 * Weights on the tiers (§4.2, "Placement"). Within each layer, tensors in order; each goes to
 * the tier in which the midpoint of its cumulative size falls, tiers ordered disk, cpu, gpu
 * (FlexGen's init_weight_list). The gpu tier holds fp32 working copies; cpu and disk hold fp16,
 * loaded into one of two staging arenas of the gpu tier while the previous layer computes.
 * ============================================================================================ */

typedef struct {
    long g;       /* the layer (as in staged), -1 for none */
    uint64_t seq; /* its task on the disk link */
    int used;     /* its conversion into the gpu tier is queued */
} weight_read;

typedef struct {
    fg_tier tier;
    int q4;       /* compressed (§5): 4-bit in any tier, decompressed into staging before use */
    float *gpu;   /* gpu tier, uncompressed: the working copy */
    void *stored; /* otherwise: fp16 or 4-bit, in the tier's memory or the disk arena */
    size_t bytes; /* of stored */
} weight_home;

struct fg_model {
    fg_runtime *rt;
    opt_weights view;     /* what compute reads: homes on the gpu tier, staging for the rest */
    opt_layout layout;
    st_archive archive;   /* open until the weights are in their homes */
    int has_archive, loaded;
    uint64_t seed;
    weight_home *homes;   /* [n_tensors] */
    int *layer_first;     /* [n_layers + 3]: tensors of layer j are layer_first[j] .. [j+1] - 1 */
    disk_arena disk;      /* disk homes: offloaded copies, or the dummy-weight file */
    double disk_bytes;    /* of the disk tier that the disk homes take */
    double reused_disk_bytes; /* of those, already on disk in --path (count_existing_weight_file) */
    char *staging[2];     /* working weights of a layer, then (CUDA) a 4-bit tensor's landing */
    size_t staging_bytes, landing_at; /* of each arena; where the 4-bit bytes land in it */
    long staged[2];       /* which layer g (step g / L, layer g % L) each staging arena holds, or -1 */
    weight_read reads[2]; /* disk reads of layers g, in slot g % 2 */
    int first_layer, end_layer; /* this pipeline stage's layers [first, end) (§4.4) */
    int first_decoder, n_decoder; /* its decoder layers: index of the first, how many */
};

static int n_flexgen_layers(const opt_config *c) { return c->n_layers + 2; }
static void count_existing_weight_file(fg_model *m);

void fg_stage_layers(const opt_config *c, int s, int n, int *first, int *end) {
    int L = c->n_layers;
    if (n < 1) n = 1;
    *first = s == 0 ? 0 : 1 + (int)((long)L * s / n);
    *end = s == n - 1 ? L + 2 : 1 + (int)((long)L * (s + 1) / n);
}

static int stage_layers(const fg_model *m) { return m->end_layer - m->first_layer; }
static int is_first_stage(const fg_model *m) { return m->first_layer == 0; }
static int is_last_stage(const fg_model *m) { return m->end_layer == n_flexgen_layers(&m->view.cfg); }
static int in_stage(const fg_model *m, int i) {
    int j = m->layout.tensors[i].layer;
    return j >= m->first_layer && j < m->end_layer;
}
/* The tensor whose home tensor i shares: its tie (lm_head to embed_tokens) when both are in this
 * stage, else -1 (the last stage of a pipeline keeps lm_head's own copy). */
static int tied_here(const fg_model *m, int i) {
    int t = m->layout.tensors[i].tied_to;
    return t >= 0 && in_stage(m, t) ? t : -1;
}

/* Tensor i is kept 4-bit (§5), and the bytes it is stored in (off the gpu tier, or 4-bit). */
static int is_q4(const fg_model *m, int i) {
    return m->rt->policy.compress_weight && m->layout.tensors[i].group_len > 0;
}
static size_t stored_bytes(const fg_model *m, int i) {
    const opt_tensor *t = &m->layout.tensors[i];
    return is_q4(m, i) ? q4_bytes(t->group_outer, t->group_len, t->group_inner) : 2 * t->count;
}

/* Compute reads a staging arena for this tensor: it lives off the gpu tier, or is compressed. */
static int is_staged(const weight_home *h) { return h->tier != TIER_GPU || h->q4; }

static void place_weights(fg_model *m) {
    const int *pc = m->rt->policy.percent;
    double disk_end = 100 - pc[0] - pc[1], cpu_end = disk_end + pc[1];
    const opt_layout *l = &m->layout;
    for (int j = m->first_layer; j < m->end_layer; j++) {
        double total = 0, before = 0;
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
            if (tied_here(m, i) < 0) total += (double)l->tensors[i].count;
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            const opt_tensor *t = &l->tensors[i];
            if (tied_here(m, i) >= 0) continue;
            double mid = 100 * (before + t->count / 2.0) / total;
            before += (double)t->count;
            m->homes[i].tier = mid < disk_end ? TIER_DISK : mid < cpu_end ? TIER_CPU : TIER_GPU;
        }
    }
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer]; i++) {
        weight_home *h = &m->homes[i];
        if (tied_here(m, i) >= 0) h->tier = m->homes[tied_here(m, i)].tier;
        h->q4 = is_q4(m, i);
        h->bytes = stored_bytes(m, i);
    }
    /* an arena holds the largest staged layer's working weights and, on a device that cannot
     * decompress host memory, the largest compressed tensor's bytes (one at a time: they land
     * and are decompressed in order on one stream) */
    const fg_backend *be = m->rt->backend;
    size_t working = 0, landing = 0;
    for (int j = m->first_layer; j < m->end_layer; j++)
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            const weight_home *h = &m->homes[i];
            if (!is_staged(h)) continue;
            if (l->layer_floats[j] * be->weight_elem > working) working = l->layer_floats[j] * be->weight_elem;
            if (!be->gpu_is_host && h->q4 && h->tier != TIER_GPU && h->bytes > landing) landing = h->bytes;
        }
    m->landing_at = working;
    m->staging_bytes = working + landing;
}

/* What a home takes of its tier. */
static double home_bytes(const fg_model *m, const weight_home *h, size_t count) {
    if (h->tier == TIER_GPU && !h->q4) return (double)m->rt->backend->weight_elem * count;
    return h->tier == TIER_DISK ? (double)page_up(h->bytes) : (double)h->bytes;
}

/* Bytes of the weights' homes per tier, and the largest disk share of one layer. */
static void weight_bytes(const fg_model *m, double bytes[N_TIERS], double *max_layer_disk) {
    memset(bytes, 0, N_TIERS * sizeof *bytes);
    *max_layer_disk = 0;
    for (int j = m->first_layer; j < m->end_layer; j++) {
        double layer_disk = 0;
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            const weight_home *h = &m->homes[i];
            double b = home_bytes(m, h, m->layout.tensors[i].count);
            if (tied_here(m, i) < 0) bytes[h->tier] += b;
            if (h->tier == TIER_DISK) layer_disk += b;
        }
        if (layer_disk > *max_layer_disk) *max_layer_disk = layer_disk;
    }
}

/* The table, the placement and nothing else: the weights move into their homes on first use. */
static int model_init(fg_model *m, const opt_config *cfg, int has_lm_head, const char *dir,
                      char *err) {
    m->disk.fd = -1;
    m->staged[0] = m->staged[1] = m->reads[0].g = m->reads[1].g = -1;
    if (opt_layout_init(&m->layout, &m->view, cfg, has_lm_head, err)) return -1;
    if (m->has_archive && opt_layout_check_archive(&m->layout, &m->archive, dir, err)) return -1;
    int L = n_flexgen_layers(cfg);
    m->homes = calloc((size_t)m->layout.n_tensors, sizeof *m->homes);
    m->layer_first = calloc((size_t)L + 1, sizeof *m->layer_first);
    if (!m->homes || !m->layer_first) return fg_fail(err, "out of memory");
    for (int i = 0, j = 0; j <= L; j++) {
        while (i < m->layout.n_tensors && m->layout.tensors[i].layer < j) i++;
        m->layer_first[j] = i;
    }
    const fg_policy *p = &m->rt->policy;
    fg_stage_layers(cfg, p->stage, p->n_stages, &m->first_layer, &m->end_layer);
    if (m->end_layer <= m->first_layer)
        return fg_fail(err, "%s has %d decoder layers: too few for %d pipeline stages", cfg->name,
                       cfg->n_layers, p->n_stages);
    m->first_decoder = m->first_layer > 0 ? m->first_layer - 1 : 0;
    int last_decoder = m->end_layer <= cfg->n_layers + 1 ? m->end_layer - 1 : cfg->n_layers;
    m->n_decoder = last_decoder - m->first_decoder;
    place_weights(m);
    count_existing_weight_file(m);
    return 0;
}

int fg_model_open_dummy(fg_runtime *rt, const opt_config *cfg, uint64_t seed, fg_model **out,
                        char *err) {
    fg_model *m = calloc(1, sizeof *m);
    *out = NULL;
    if (!m) return fg_fail(err, "out of memory");
    m->rt = rt;
    m->seed = seed;
    if (model_init(m, cfg, 0, NULL, err)) {
        fg_model_close(m);
        return -1;
    }
    *out = m;
    return 0;
}

int fg_model_open(fg_runtime *rt, const char *model, uint64_t seed, fg_model **out, char *err) {
    *out = NULL;
    if (!is_dir(model)) {
        opt_config cfg;
        if (opt_config_by_name(model, &cfg, err)) return -1;
        return fg_model_open_dummy(rt, &cfg, seed, out, err);
    }
    fg_model *m = calloc(1, sizeof *m);
    if (!m) return fg_fail(err, "out of memory");
    m->rt = rt;
    m->disk.fd = -1;
    opt_config cfg;
    int rc = opt_checkpoint_open(model, &cfg, &m->archive, err);
    m->has_archive = rc == 0;
    if (rc == 0) rc = model_init(m, &cfg, st_find(&m->archive, "lm_head.weight") != NULL, model, err);
    if (rc) {
        fg_model_close(m);
        return -1;
    }
    *out = m;
    return 0;
}

const opt_config *fg_model_config(const fg_model *m) { return &m->view.cfg; }

void fg_model_close(fg_model *m) {
    if (!m) return;
    for (int i = 0; m->homes && i < m->layout.n_tensors; i++) {
        const weight_home *h = &m->homes[i];
        size_t bytes = (size_t)home_bytes(m, h, m->layout.tensors[i].count);
        if (!in_stage(m, i) || tied_here(m, i) >= 0) continue;
        if (h->tier == TIER_GPU) tier_free(m->rt, TIER_GPU, h->q4 ? h->stored : h->gpu, bytes);
        if (h->tier == TIER_CPU) tier_free(m->rt, TIER_CPU, h->stored, bytes);
    }
    for (int b = 0; b < 2; b++) tier_free(m->rt, TIER_GPU, m->staging[b], m->staging_bytes);
    if (m->disk.base) tier_add(m->rt, TIER_DISK, -m->disk_bytes);
    m->rt->capacity[TIER_DISK] -= m->reused_disk_bytes;
    arena_close(&m->disk);
    if (m->has_archive) st_close(&m->archive);
    opt_layout_free(&m->layout);
    free(m->homes);
    free(m->layer_first);
    free(m);
}

/* ---- dummy weights on disk: written once to a file in the weight dir, reused after ---- */

typedef struct {
    char magic[16];
    opt_config cfg;
    uint64_t seed, bytes;
} weight_file_header;

/* Where each tensor sits in the dummy-weight file: all tensors, whatever the policy, so that
 * one file serves every placement. Returns the file's size. */
static size_t weight_file_offsets(const fg_model *m, size_t *offsets) {
    size_t at = page_up(sizeof(weight_file_header));
    for (int i = 0; i < m->layout.n_tensors; i++) {
        int tie = m->layout.tensors[i].tied_to;
        if (offsets) offsets[i] = tie >= 0 ? offsets[tie] : at; /* the same values, stored alike */
        if (tie < 0) at += page_up(stored_bytes(m, i));
    }
    return at;
}

static int mkdir_p(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    for (char *s = path + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            if (mkdir(path, 0755) && errno != EEXIST) return -1;
            *s = '/';
        }
    return mkdir(path, 0755) && errno != EEXIST ? -1 : 0;
}

static void progress(const fg_model *m, const char *what, int done, int total) {
    if (m->rt->policy.verbose) fprintf(stderr, "\r%s: layer %d/%d", what, done, total);
    if (m->rt->policy.verbose && done == total) fprintf(stderr, "\n");
}

/* Writes tensor i's values as its home stores them (fp16, or compressed once here, §5). */
static int fill_stored(const fg_model *m, int i, const weight_source *src, void *dst, char *err) {
    const opt_tensor *t = &m->layout.tensors[i];
    if (!m->homes[i].q4) {
        opt_tensor_fill(&m->layout, i, src, NULL, dst);
        return 0;
    }
    float *values = malloc(t->count * sizeof *values);
    if (!values) return fg_fail(err, "out of memory compressing %s", t->name);
    opt_tensor_fill(&m->layout, i, src, values, NULL);
    q4_compress(values, t->group_outer, t->group_len, t->group_inner, dst);
    free(values);
    return 0;
}

/* A home on the gpu tier: the stored form made in host memory, then through the backend, into
 * the working format (uncompressed) or as it is (4-bit, decompressed at each use). */
static int fill_gpu_home(const fg_model *m, int i, const weight_source *src, void *home, char *err) {
    const fg_backend *be = m->rt->backend;
    const weight_home *h = &m->homes[i];
    void *stored = malloc(h->bytes);
    if (!stored) return fg_fail(err, "out of memory loading %s", m->layout.tensors[i].name);
    int rc = fill_stored(m, i, src, stored, err);
    if (rc == 0 && h->q4) be->copy_in(home, stored, h->bytes);
    else if (rc == 0) be->weights_in(home, stored, m->layout.tensors[i].count);
    free(stored);
    return rc;
}

/* The dummy-weight file of this model in --path: its name and the header it starts with. */
static void weight_file_id(const fg_model *m, size_t size, char *path, size_t n, weight_file_header *want) {
    int q4 = m->rt->policy.compress_weight;
    snprintf(path, n, "%s/%s-seed%llu%s.fgw", m->rt->weight_dir, m->view.cfg.name,
             (unsigned long long)m->seed, q4 ? "-q4" : "");
    memset(want, 0, sizeof *want);
    snprintf(want->magic, sizeof want->magic, q4 ? "flexgen-q4-1" : "flexgen-wt-1");
    want->cfg = m->view.cfg;
    want->seed = m->seed;
    want->bytes = size;
}

/* That file, open, when it is there and complete; else -1. */
static int existing_weight_file(const fg_model *m, size_t size) {
    char path[4300];
    weight_file_header want, have;
    weight_file_id(m, size, path, sizeof path, &want);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size == size &&
        pread(fd, &have, sizeof have, 0) == (ssize_t)sizeof have && !memcmp(&have, &want, sizeof have))
        return fd;
    if (fd >= 0) close(fd);
    return -1;
}

/* Dummy weights that an earlier run wrote to --path take no new space. The default capacity of
 * the disk tier is the offload dir's free space, so there they count on top of it (given back
 * by fg_model_close). With --disk-mem the user's number stands. */
static void count_existing_weight_file(fg_model *m) {
    double bytes[N_TIERS], max_layer_disk;
    weight_bytes(m, bytes, &max_layer_disk);
    if (m->has_archive || m->rt->policy.capacity[TIER_DISK] > 0 || bytes[TIER_DISK] == 0) return;
    int fd = existing_weight_file(m, weight_file_offsets(m, NULL));
    if (fd < 0) return;
    close(fd);
    m->reused_disk_bytes = bytes[TIER_DISK];
    m->rt->capacity[TIER_DISK] += m->reused_disk_bytes;
}

static int open_weight_file(fg_model *m, size_t *offsets, char *err) {
    const opt_config *c = &m->view.cfg;
    size_t size = weight_file_offsets(m, offsets);
    char path[4300];
    weight_file_header want;
    weight_file_id(m, size, path, sizeof path, &want);
    int fd = existing_weight_file(m, size);
    if (fd >= 0) return arena_map(&m->disk, fd, size, "--path", m->rt->weight_dir, err);
    if (mkdir_p(m->rt->weight_dir))
        return fg_fail(err, "--path %s: cannot create it: %s", m->rt->weight_dir, strerror(errno));
    fd = unnamed_file(m->rt->weight_dir, "--path", err);
    if (fd < 0 || arena_map(&m->disk, fd, size, "--path", m->rt->weight_dir, err)) return -1;
    weight_source src = {NULL, m->seed};
    int L = n_flexgen_layers(c);
    for (int j = 0; j < L; j++) {
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            if (m->layout.tensors[i].tied_to >= 0) continue;
            char *dst = m->disk.base + offsets[i];
            if (fill_stored(m, i, &src, dst, err)) return -1;
            drop_pages(&m->disk, dst, m->homes[i].bytes, 1); /* memory to the policy */
        }
        progress(m, "writing dummy weights", j + 1, L);
    }
    memcpy(m->disk.base, &want, sizeof want);
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", m->disk.fd);
    unlink(path); /* a stale file of the same name */
    if (msync(m->disk.base, m->disk.size, MS_SYNC) ||
        linkat(AT_FDCWD, self, AT_FDCWD, path, AT_SYMLINK_FOLLOW))
        fprintf(stderr, "flexgen: note: could not keep the dummy weights as %s (%s); they are "
                        "written again next run\n", path, strerror(errno));
    return 0;
}

/* Writes every tensor into its home (§4.2) and points the view at those on the gpu tier. */
static int load_weights_into_homes(fg_model *m, char *err) {
    fg_runtime *rt = m->rt;
    const opt_layout *l = &m->layout;
    double bytes[N_TIERS], max_layer_disk;
    weight_bytes(m, bytes, &max_layer_disk);
    size_t *offsets = calloc((size_t)l->n_tensors, sizeof *offsets);
    if (!offsets) return fg_fail(err, "out of memory");
    int from_file = 0, rc = 0;
    if (bytes[TIER_DISK] > 0) {
        rc = tier_take(rt, TIER_DISK, bytes[TIER_DISK], "the weights", err);
        if (rc == 0) {
            m->disk_bytes = bytes[TIER_DISK];
            if (!m->has_archive) {
                rc = open_weight_file(m, offsets, err);
                from_file = 1;
            } else {
                int fd = unnamed_file(rt->offload_dir, "--offload-dir", err);
                rc = fd < 0 ? -1 : arena_map(&m->disk, fd, (size_t)bytes[TIER_DISK], "--offload-dir",
                                             rt->offload_dir, err);
            }
            if (rc) tier_add(rt, TIER_DISK, -m->disk_bytes), m->disk_bytes = 0;
        }
    }
    weight_source src = {m->has_archive ? &m->archive : NULL, m->seed};
    for (int j = m->first_layer; j < m->end_layer && rc == 0; j++) {
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1] && rc == 0; i++) {
            const opt_tensor *t = &l->tensors[i];
            weight_home *h = &m->homes[i];
            if (tied_here(m, i) >= 0) continue;
            if (h->tier == TIER_GPU) {
                void **home = h->q4 ? &h->stored : (void **)&h->gpu;
                *home = tier_alloc(rt, TIER_GPU, (size_t)home_bytes(m, h, t->count), "the weights", err);
                rc = *home ? fill_gpu_home(m, i, &src, *home, err) : -1;
            } else if (h->tier == TIER_CPU) {
                h->stored = tier_alloc_pinned(rt, TIER_CPU, h->bytes, "the weights", rt->policy.pin_weight, err);
                rc = h->stored ? fill_stored(m, i, &src, h->stored, err) : -1;
            } else if (from_file) {
                h->stored = m->disk.base + offsets[i];
            } else {
                h->stored = arena_take(&m->disk, h->bytes);
                rc = fill_stored(m, i, &src, h->stored, err);
                tier_add(rt, TIER_CPU, (double)h->bytes); /* written pages, until released */
                disk_release(rt, &m->disk, h->stored, h->bytes, 0);
            }
        }
        if (m->has_archive) progress(m, "placing weights", j + 1 - m->first_layer, stage_layers(m));
    }
    free(offsets);
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer] && rc == 0; i++) {
        if (tied_here(m, i) >= 0) m->homes[i] = m->homes[tied_here(m, i)];
        if (!is_staged(&m->homes[i])) *l->tensors[i].slot = m->homes[i].gpu;
    }
    for (int b = 0; b < 2 && rc == 0 && m->staging_bytes; b++)
        if (!(m->staging[b] = tier_alloc(rt, TIER_GPU, m->staging_bytes, "weight staging", err))) rc = -1;
    if (m->has_archive) { /* every value is in its home now */
        st_close(&m->archive);
        m->has_archive = 0;
    }
    m->loaded = rc == 0;
    return rc;
}

int fg_model_load(fg_model *m, char *err) { return m->loaded ? 0 : load_weights_into_homes(m, err); }

/* ---- loading a layer's weights: disk -> cpu, then cpu -> gpu (Fig. 4, "load weight") ----
 * Layer g (step g / L, layer g % L) is read from disk one layer earlier than Fig. 4 asks, while
 * layer g - 2 computes, so that the disk link reads back to back instead of waiting for each
 * conversion into the gpu tier; the plan counts those two layers of pages in the cpu tier. */

static void weights_fetch_task(fg_runtime *rt, const io_task *task) {
    fg_model *m = task->ctx;
    for (int i = m->layer_first[task->arg[0]]; i < m->layer_first[task->arg[0] + 1]; i++)
        if (m->homes[i].tier == TIER_DISK)
            disk_fetch(rt, &m->disk, m->homes[i].stored, m->homes[i].bytes);
}

/* Drops layer j's pages that came from disk (after their conversion, or unused). */
static void weights_release(fg_runtime *rt, fg_model *m, int j) {
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        if (m->homes[i].tier == TIER_DISK)
            disk_release(rt, &m->disk, m->homes[i].stored, m->homes[i].bytes, 0);
}

static void weights_in_task(fg_runtime *rt, const io_task *task) {
    fg_model *m = task->ctx;
    const fg_backend *be = rt->backend;
    char *staging = m->staging[task->arg[1]], *landing = staging + m->landing_at;
    for (int i = m->layer_first[task->arg[0]]; i < m->layer_first[task->arg[0] + 1]; i++) {
        const weight_home *h = &m->homes[i];
        const opt_tensor *t = &m->layout.tensors[i];
        char *working = staging + t->offset * be->weight_elem;
        if (!is_staged(h)) continue;
        if (h->q4)
            be->weights_in_q4(working, h->stored, h->tier == TIER_GPU ? NULL : landing,
                              t->group_outer, t->group_len, t->group_inner);
        else
            be->weights_in(working, h->stored, t->count);
        if (h->tier != TIER_GPU) link_add(rt, LINK_CPU_TO_GPU, (double)h->bytes);
    }
    weights_release(rt, m, task->arg[0]);
}

static void forget_read(fg_model *m, weight_read *r);

/* Starts reading the disk part of layer g into the cpu tier, unless it is read or has none. */
static void read_weights(fg_model *m, long g) {
    int j = m->first_layer + (int)(g % stage_layers(m)), on_disk = 0;
    weight_read *r = &m->reads[g % 2];
    if (r->g == g) return;
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) on_disk |= m->homes[i].tier == TIER_DISK;
    if (!on_disk) return;
    forget_read(m, r); /* a layer read ahead for a unit that did not come */
    *r = (weight_read){g, io_submit(m->rt, IO_WEIGHT_DISK, (io_task){weights_fetch_task, "read weights", 0, 0, m, {j, 0}}), 0};
}

/* Starts loading layer g into staging arena g % 2 (reading it first if that has not begun). */
static void load_weights(fg_model *m, long g) {
    int j = m->first_layer + (int)(g % stage_layers(m)), buf = (int)(g % 2), staged = 0;
    if (m->staged[buf] == g) return;
    m->staged[buf] = g;
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) staged |= is_staged(&m->homes[i]);
    if (!staged) return;
    read_weights(m, g);
    weight_read *r = &m->reads[g % 2];
    uint64_t read = r->g == g ? r->seq : 0;
    if (r->g == g) r->used = 1;
    io_submit(m->rt, IO_WEIGHT_HOST, (io_task){weights_in_task, "load weights", IO_WEIGHT_DISK, read, m, {j, buf}});
}

/* Points compute at layer g's staged weights (arena g % 2), as it starts: with one layer on a
 * pipeline stage, the arena the next layer loads into is this layer's other one. */
static void bind_weights(fg_model *m, long g) {
    int j = m->first_layer + (int)(g % stage_layers(m));
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        if (is_staged(&m->homes[i]))
            *m->layout.tensors[i].slot = (float *)(m->staging[g % 2] + m->layout.tensors[i].offset * m->rt->backend->weight_elem);
}

/* At the end of a block: layers read ahead for steps that did not come (every sequence
 * stopped) give their pages back. */
static void forget_read(fg_model *m, weight_read *r) {
    if (r->g >= 0 && !r->used) {
        io_wait(m->rt, IO_WEIGHT_DISK, r->seq);
        weights_release(m->rt, m, m->first_layer + (int)(r->g % stage_layers(m)));
    }
    r->g = -1;
}

static void forget_reads(fg_model *m) {
    for (int b = 0; b < 2; b++) forget_read(m, &m->reads[b]);
}

/* ============================================================================================
 * A block in flight (§4.1): its GPU batches, their KV cache and activations on the tiers, and
 * the staging arenas of the gpu tier that double-buffer what moves.
 *
 * KV cache and activations are split by the percentages along the batch dimension (§4.2): of a
 * GPU batch's sequences, the first go to the gpu tier, the next to cpu, the rest to disk.
 * Activations are the hidden states between layers, kept in fp32 (what the CPU computes in), so
 * that placement cannot change a bit of the result.
 * ============================================================================================ */

typedef struct {
    int rows[N_TIERS]; /* of a GPU batch's sequences: gpu first, then cpu, then disk */
} row_split;

static row_split split_rows(int n, int gpu_pct, int cpu_pct) {
    int g = (int)lround(n * gpu_pct / 100.0), gc = (int)lround(n * (gpu_pct + cpu_pct) / 100.0);
    return (row_split){{g, gc - g, n - gc}};
}

static fg_tier tier_of(const row_split *s, int b) {
    return b < s->rows[TIER_GPU] ? TIER_GPU : b < s->rows[TIER_GPU] + s->rows[TIER_CPU] ? TIER_CPU : TIER_DISK;
}

static fg_tier row_tier(const row_split *s, int b, int *index) {
    fg_tier t = TIER_GPU;
    while (t < TIER_DISK && b >= s->rows[t]) b -= s->rows[t++];
    *index = b;
    return t;
}

/* The sizes every allocation of a block follows; the plan check uses the same numbers. A stage
 * of a pipeline holds `micro` blocks (its micro-batches, §4.4), each with its own KV cache and
 * activations; they compute one at a time, so staging, workspace and logits are shared. */
typedef struct {
    int gbs, ngb, max_prompt, max_len, stage_len;
    int micro;                  /* blocks in flight on this stage */
    row_split cache, act;
    size_t row_floats;          /* hidden: floats per token of the activations */
    size_t kv_row;              /* bytes per token of K (or V): fp16, or 4-bit with --compress-cache */
    double kv_home[N_TIERS];    /* bytes per tier */
    double act_home[N_TIERS];
    double kv_stage, x_stage, workspace, logits; /* gpu tier, all buffers together */
    double transient_cpu;       /* disk pages in memory while they move, at most */
    size_t act_message;         /* bytes of one GPU batch's activations between stages, at most */
    double pipe_buffers;        /* cpu tier: activations on their way out (each block's GPU
                                   batches) and in (two), when there is such a neighbour */
} block_shape;

/* A pipeline of M stages keeps M micro-batches in flight (§4.4), each a block of at most
 * gpu_batch_size x num_gpu_batches sequences: prompts go in rounds of *count blocks of *size
 * (fewer prompts make smaller blocks rather than fewer). One process: blocks, one at a time. */
static void micro_batches(const fg_model *m, int n_prompts, int *size, int *count) {
    const fg_policy *p = &m->rt->policy;
    int stages = p->n_stages > 1 ? p->n_stages : 1, block = p->gpu_batch_size * p->num_gpu_batches;
    int share = (n_prompts + stages - 1) / stages;
    *size = share < block ? share : block;
    int blocks = (n_prompts + *size - 1) / *size;
    *count = blocks < stages ? blocks : stages;
}

static block_shape shape_block(const fg_model *m, int n_prompts, int max_prompt, int gen_len) {
    const fg_runtime *rt = m->rt;
    const opt_config *c = &m->view.cfg;
    const fg_policy *p = &rt->policy;
    int size;
    block_shape s;
    memset(&s, 0, sizeof s);
    micro_batches(m, n_prompts, &size, &s.micro);
    s.gbs = size < p->gpu_batch_size ? size : p->gpu_batch_size;
    int batches = (size + p->gpu_batch_size - 1) / p->gpu_batch_size;
    s.ngb = batches < p->num_gpu_batches ? batches : p->num_gpu_batches;
    s.max_prompt = max_prompt;
    s.max_len = max_prompt + gen_len;
    /* With delegation, decode reads the cache where it lives: only the prefill stages it. */
    s.stage_len = p->cpu_cache_compute ? max_prompt : s.max_len;
    s.cache = split_rows(s.gbs, p->percent[2], p->percent[3]);
    s.act = split_rows(s.gbs, p->percent[4], p->percent[5]);
    s.row_floats = (size_t)c->hidden;
    s.kv_row = opt_kv_row_bytes(c, p->compress_cache);
    double h = c->hidden, kv_row = (double)s.kv_row, staged_rows = s.gbs - s.cache.rows[TIER_GPU];
    for (int t = 0; t < N_TIERS; t++) {
        s.kv_home[t] = kv_row * m->n_decoder * s.ngb * 2 * s.cache.rows[t] * s.max_len;
        s.act_home[t] = 4.0 * s.ngb * s.act.rows[t] * max_prompt * h;
    }
    s.kv_home[TIER_DISK] = (double)page_up((size_t)s.kv_home[TIER_DISK]);
    s.act_home[TIER_DISK] = (double)page_up((size_t)s.act_home[TIER_DISK]);
    s.kv_stage = staged_rows > 0 ? 2 * 2 * kv_row * staged_rows * s.stage_len : 0;
    s.x_stage = 2 * 4.0 * s.gbs * max_prompt * h;
    s.workspace = (double)rt->backend->workspace_bytes(c, (size_t)s.gbs * max_prompt, s.max_len);
    s.logits = is_last_stage(m) ? 4.0 * s.gbs * s.ngb * c->vocab : 0;
    s.act_message = (size_t)s.gbs * max_prompt * s.row_floats * sizeof(float);
    s.pipe_buffers = (double)s.act_message * ((is_last_stage(m) ? 0 : s.micro * s.ngb) +
                                              (is_first_stage(m) ? 0 : 2));
    /* a layer's disk cache rows (K and V) and a batch's disk activations, twice (load + store) */
    s.transient_cpu = 2 * (2 * kv_row * s.cache.rows[TIER_DISK] * s.max_len +
                           4.0 * s.act.rows[TIER_DISK] * max_prompt * h + 2 * page_size());
    return s;
}

typedef struct {
    fg_model *m;
    fg_runtime *rt;
    block_shape s;
    gpu_batch *gb;   /* [ngb] */
    int n_batches;   /* in this block (the last block may have fewer) */
    int count;       /* its sequences (0: an empty micro-batch of the last round) */
    int running;     /* some sequence of it is still generating */
    char *done;      /* [gbs * ngb]: the sequence has generated </s> (--stop-at-eos) */
    int *ids;        /* [gbs * ngb]: the tokens chosen at the last step, the next step's input */
    int ids_msg;     /* their message to the first stage, or -1 */
    float *outbox;   /* [ngb][gbs * max_prompt][hidden]: activations on their way to the next
                        stage (cpu tier), each GPU batch's slot until its message is sent */
    int *out_msg;    /* [ngb]: those messages, or -1 */
    float *inbox;    /* [2][gbs * max_prompt][hidden]: activations from the previous stage, by
                        staging arena (shared by the stage's blocks) */
    int in_msg, in_k; /* the receive of GPU batch in_k's activations, or -1 */
    double bubble;   /* seconds the compute thread waited for another stage */
    int borrowed;    /* staging, workspace, logits and inbox are another block's */
    int delegate;    /* this step's attention reads cpu and disk caches in place (§4.2) */
    int sparse_v;    /* this step's sparse attention reads the kept V rows of the cpu tier in
                        place, so only those cross the link (§5); disk rows move whole */
    opt_workspace own_ws, *ws;
    float *logits;   /* [gbs * ngb][vocab], on the gpu tier */
    float *host_logits; /* the same, where sampling reads them */
    char *kv_home[N_TIERS];   /* [ngb][the stage's decoder layers][K, V][rows][max_len] rows of kv_row bytes */
    float *act_home[N_TIERS]; /* [ngb][rows][max_prompt][hidden] */
    char *kv_stage[2];        /* [K, V][non-gpu rows][stage_len] rows of kv_row bytes */
    float *x_stage[2];        /* [gbs * max_prompt][hidden]: gb->x of the iteration */
    disk_arena disk;
    int has_ws;
} block;

/* Sequence b's cache rows of `layer` in GPU batch k: K (kv 0) or V (kv 1), where they live. */
static char *kv_home_rows(const block *bl, int k, int layer, int kv, int b) {
    int r;
    fg_tier t = row_tier(&bl->s.cache, b, &r);
    size_t idx = (((size_t)k * bl->m->n_decoder + layer) * 2 + kv) * bl->s.cache.rows[t] + r;
    return bl->kv_home[t] + idx * bl->s.max_len * bl->s.kv_row;
}

static char *kv_stage_rows(const block *bl, int buf, int kv, int b) {
    int staged = bl->s.gbs - bl->s.cache.rows[TIER_GPU];
    size_t idx = (size_t)kv * staged + (b - bl->s.cache.rows[TIER_GPU]);
    return bl->kv_stage[buf] + idx * bl->s.stage_len * bl->s.kv_row;
}

static float *act_home_rows(const block *bl, int k, int b) {
    int r;
    fg_tier t = row_tier(&bl->s.act, b, &r);
    return bl->act_home[t] + ((size_t)k * bl->s.act.rows[t] + r) * bl->s.max_prompt * bl->s.row_floats;
}

static void free_block(block *bl) {
    fg_runtime *rt = bl->rt;
    const block_shape *s = &bl->s;
    if (!rt) return;
    for (int k = 0; bl->gb && k < s->ngb; k++) gpu_batch_free(&bl->gb[k]);
    free(bl->gb);
    free(bl->done);
    free(bl->ids);
    free(bl->out_msg);
    if (bl->outbox) tier_free(rt, TIER_CPU, bl->outbox, s->act_message * s->ngb);
    if (!bl->borrowed) {
        if (bl->has_ws) rt->backend->workspace_free(bl->ws), tier_add(rt, TIER_GPU, -s->workspace);
        tier_free(rt, TIER_GPU, bl->logits, (size_t)s->logits);
        free(bl->host_logits);
        for (int b = 0; b < 2; b++) {
            tier_free(rt, TIER_GPU, bl->kv_stage[b], (size_t)s->kv_stage / 2);
            tier_free(rt, TIER_GPU, bl->x_stage[b], (size_t)s->x_stage / 2);
        }
        if (bl->inbox) tier_free(rt, TIER_CPU, bl->inbox, 2 * s->act_message);
    }
    for (int t = TIER_GPU; t <= TIER_CPU; t++) {
        tier_free(rt, (fg_tier)t, bl->kv_home[t], (size_t)s->kv_home[t]);
        tier_free(rt, (fg_tier)t, bl->act_home[t], (size_t)s->act_home[t]);
    }
    if (bl->disk.base) tier_add(rt, TIER_DISK, -(s->kv_home[TIER_DISK] + s->act_home[TIER_DISK]));
    arena_close(&bl->disk);
    memset(bl, 0, sizeof *bl);
}

/* A stage's buffers that its blocks share (they compute one at a time): staging, workspace,
 * logits, the inbox of activations from the previous stage. */
static int alloc_stage_buffers(block *bl, char *err) {
    fg_runtime *rt = bl->rt;
    const block_shape *s = &bl->s;
    for (int b = 0; b < 2; b++) {
        if (s->kv_stage && !(bl->kv_stage[b] = tier_alloc(rt, TIER_GPU, (size_t)s->kv_stage / 2, "KV cache staging", err))) return -1;
        if (!(bl->x_stage[b] = tier_alloc(rt, TIER_GPU, (size_t)s->x_stage / 2, "activation staging", err))) return -1;
    }
    if (!(bl->logits = tier_alloc(rt, TIER_GPU, (size_t)s->logits, "the logits", err))) return -1;
    if (s->logits && !(bl->host_logits = malloc((size_t)s->logits))) return fg_fail(err, "out of memory for the logits");
    if (!is_first_stage(bl->m) &&
        !(bl->inbox = tier_alloc(rt, TIER_CPU, 2 * s->act_message, "activations from the previous stage", err)))
        return -1;
    if (tier_take(rt, TIER_GPU, s->workspace, "the workspace", err)) return -1;
    bl->ws = &bl->own_ws;
    if (rt->backend->workspace_init(bl->ws, &bl->m->view.cfg, (size_t)s->gbs * s->max_prompt, s->max_len, err)) {
        tier_add(rt, TIER_GPU, -s->workspace);
        return -1;
    }
    bl->has_ws = 1;
    return 0;
}

/* A block (one micro-batch of a pipeline stage) with its KV cache and activations on the tiers;
 * the stage's shared buffers are allocated, or (shared != NULL) borrowed from another block. */
static int alloc_block(block *bl, fg_model *m, int n_prompts, int max_prompt, int gen_len,
                       const block *shared, char *err) {
    fg_runtime *rt = m->rt;
    memset(bl, 0, sizeof *bl);
    bl->disk.fd = -1;
    bl->m = m;
    bl->rt = rt;
    bl->in_msg = bl->ids_msg = -1;
    bl->s = shape_block(m, n_prompts, max_prompt, gen_len);
    const block_shape *s = &bl->s;
    int seqs = s->gbs * s->ngb;
    bl->gb = calloc((size_t)s->ngb, sizeof *bl->gb);
    bl->done = calloc((size_t)seqs, 1);
    bl->ids = calloc((size_t)seqs, sizeof *bl->ids);
    bl->out_msg = malloc((size_t)s->ngb * sizeof *bl->out_msg);
    if (!bl->gb || !bl->done || !bl->ids || !bl->out_msg) {
        free_block(bl);
        return fg_fail(err, "out of memory");
    }
    for (int k = 0; k < s->ngb; k++) bl->out_msg[k] = -1;
    for (int k = 0; k < s->ngb; k++)
        if (gpu_batch_init(&bl->gb[k], s->gbs, s->max_len, max_prompt, err)) goto fail;
        else bl->gb[k].kv_q4 = rt->policy.compress_cache, bl->gb[k].attn_sparsity = rt->policy.attn_sparsity;
    for (int t = TIER_GPU; t <= TIER_CPU; t++) {
        if (s->kv_home[t] && !(bl->kv_home[t] = tier_alloc(rt, (fg_tier)t, (size_t)s->kv_home[t], "the KV cache", err))) goto fail;
        if (s->act_home[t] && !(bl->act_home[t] = tier_alloc(rt, (fg_tier)t, (size_t)s->act_home[t], "the activations", err))) goto fail;
    }
    double on_disk = s->kv_home[TIER_DISK] + s->act_home[TIER_DISK];
    if (on_disk > 0) {
        if (tier_take(rt, TIER_DISK, on_disk, "the KV cache and activations", err)) goto fail;
        int fd = unnamed_file(rt->offload_dir, "--offload-dir", err);
        if (fd < 0 || arena_map(&bl->disk, fd, (size_t)on_disk, "--offload-dir", rt->offload_dir, err)) {
            tier_add(rt, TIER_DISK, -on_disk);
            goto fail;
        }
        bl->kv_home[TIER_DISK] = arena_take(&bl->disk, (size_t)s->kv_home[TIER_DISK]);
        bl->act_home[TIER_DISK] = arena_take(&bl->disk, (size_t)s->act_home[TIER_DISK]);
    }
    if (!is_last_stage(m) &&
        !(bl->outbox = tier_alloc(rt, TIER_CPU, s->act_message * s->ngb, "activations to the next stage", err)))
        goto fail;
    if (!shared) return alloc_stage_buffers(bl, err) ? (free_block(bl), -1) : 0;
    bl->borrowed = 1;
    bl->ws = shared->ws;
    bl->logits = shared->logits, bl->host_logits = shared->host_logits, bl->inbox = shared->inbox;
    for (int b = 0; b < 2; b++) bl->kv_stage[b] = shared->kv_stage[b], bl->x_stage[b] = shared->x_stage[b];
    return 0;
fail:
    free_block(bl);
    return -1;
}

/* ============================================================================================
 * The plan check (§4.2): everything a run allocates, per tier, against the capacities, before
 * any of it is allocated.
 * ============================================================================================ */

int fg_check_plan(const fg_model *m, int n_prompts, int max_prompt, int gen_len, char *err) {
    const fg_runtime *rt = m->rt;
    block_shape s = shape_block(m, n_prompts, max_prompt, gen_len);
    if (rt->policy.n_stages > 1 && s.act_message > INT_MAX)
        return fg_fail(err, "--gpu-batch-size %d: a GPU batch's activations (%s at prompt length %d) "
                            "exceed what one MPI message carries (2 GiB)", s.gbs,
                       human((double)s.act_message).s, max_prompt);
    double w[N_TIERS], max_layer_disk;
    weight_bytes(m, w, &max_layer_disk);
    double staging = 2.0 * m->staging_bytes;
    enum { WEIGHTS, W_STAGING, CACHE, C_STAGING, ACTS, A_STAGING, WORK, IN_FLIGHT, PIPE, N_ITEMS };
    static const char *const items[N_ITEMS] = {"weights", "weight staging", "KV cache",
        "KV cache staging", "activations", "activation staging", "workspace and logits",
        "disk pages in flight", "activations between stages"};
    double need[N_TIERS][N_ITEMS] = {{0}};
    for (int t = 0; t < N_TIERS; t++) { /* each micro-batch of a pipeline stage has its own */
        need[t][WEIGHTS] = w[t];
        need[t][CACHE] = s.micro * s.kv_home[t];
        need[t][ACTS] = s.micro * s.act_home[t];
    }
    need[TIER_CPU][PIPE] = s.pipe_buffers;
    need[TIER_GPU][W_STAGING] = staging;
    need[TIER_GPU][C_STAGING] = s.kv_stage;
    need[TIER_GPU][A_STAGING] = s.x_stage;
    need[TIER_GPU][WORK] = s.workspace + s.logits;
    need[TIER_CPU][IN_FLIGHT] = 2 * max_layer_disk + s.transient_cpu;
    double total[N_TIERS] = {0};
    for (int t = 0; t < N_TIERS; t++) {
        for (int i = 0; i < N_ITEMS; i++) total[t] += need[t][i];
        if (total[t] <= rt->capacity[t]) continue;
        char detail[480] = "";
        for (int i = 0; i < N_ITEMS; i++) {
            size_t len = strlen(detail);
            if (need[t][i] > 0)
                snprintf(detail + len, sizeof detail - len, "%s%s %s", len ? ", " : "", items[i],
                         human(need[t][i]).s);
        }
        return fg_fail(err, "%s tier: the plan needs %s (%s), %s gives %s", fg_tier_names[t],
                       human(total[t]).s, detail, tier_flags[t], human(rt->capacity[t]).s);
    }
    double host = mem_available_bytes();
    if (rt->backend->gpu_is_host && total[TIER_GPU] + total[TIER_CPU] > host)
        return fg_fail(err, "gpu and cpu tiers: the plan needs %s of host memory (gpu %s, cpu %s), "
                            "%s available", human(total[TIER_GPU] + total[TIER_CPU]).s,
                       human(total[TIER_GPU]).s, human(total[TIER_CPU]).s, human(host).s);
    return 0;
}

void fg_plan_placement(const fg_model *m, int n_prompts, double x[N_X]) {
    double stored[N_TIERS] = {0}, total = 0;
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer]; i++) {
        const weight_home *h = &m->homes[i];
        if (tied_here(m, i) >= 0) continue;
        stored[h->tier] += (double)h->bytes;
        total += (double)h->bytes;
    }
    /* the rows of a full GPU batch (max_prompt and gen_len do not change the split) */
    block_shape s = shape_block(m, n_prompts, 1, 1);
    for (int t = 0; t < N_TIERS; t++) {
        x[X_WG + t] = stored[t] / total;
        x[X_CG + t] = (double)s.cache.rows[t] / s.gbs;
        x[X_HG + t] = (double)s.act.rows[t] / s.gbs;
    }
}

/* ============================================================================================
 * Moving the KV cache and activations (Fig. 4's load and store of cache and activations).
 * Task arguments: GPU batch k, layer, staging buffer, first slot, slots.
 * ============================================================================================ */

enum { A_BATCH, A_LAYER, A_BUF, A_FIRST, A_COUNT };

/* For each sequence b of GPU batch k whose rows live off the gpu tier, on tier t. */
#define FOR_OFF_GPU(split, bl, k, b, t)                                                         \
    for (int b = (split).rows[TIER_GPU]; b < (bl)->gb[k].batch; b++)                           \
        for (fg_tier t = tier_of(&(split), b), once_ = 1; once_; once_ = 0)

static void cache_fetch_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const int *a = task->arg;
    size_t row = bl->s.kv_row;
    FOR_OFF_GPU(bl->s.cache, bl, a[A_BATCH], b, t)
        for (int kv = 0; kv < 2 && t == TIER_DISK; kv++)
            disk_fetch(rt, &bl->disk, kv_home_rows(bl, a[A_BATCH], a[A_LAYER], kv, b) + (size_t)a[A_FIRST] * row,
                       (size_t)a[A_COUNT] * row);
}

/* V rows that sparse attention reads where they live (kv 1 on the cpu tier, §5). */
static int v_in_place(const block *bl, int kv, fg_tier t) { return bl->sparse_v && kv == 1 && t == TIER_CPU; }

static void cache_in_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const int *a = task->arg;
    size_t bytes = (size_t)a[A_COUNT] * bl->s.kv_row;
    FOR_OFF_GPU(bl->s.cache, bl, a[A_BATCH], b, t)
        for (int kv = 0; kv < 2; kv++) {
            char *home = kv_home_rows(bl, a[A_BATCH], a[A_LAYER], kv, b);
            if (v_in_place(bl, kv, t)) continue; /* counted as attention reads the kept rows */
            rt->backend->copy_in(kv_stage_rows(bl, a[A_BUF], kv, b), home, bytes);
            link_add(rt, LINK_CPU_TO_GPU, (double)bytes);
            if (t == TIER_DISK) disk_release(rt, &bl->disk, home, bytes, 0);
        }
}

static void cache_out_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const int *a = task->arg;
    size_t at = (size_t)a[A_FIRST] * bl->s.kv_row, bytes = (size_t)a[A_COUNT] * bl->s.kv_row;
    FOR_OFF_GPU(bl->s.cache, bl, a[A_BATCH], b, t)
        for (int kv = 0; kv < 2; kv++) {
            if (!v_in_place(bl, kv, t)) /* else attention wrote the row in place */
                rt->backend->copy_out(kv_home_rows(bl, a[A_BATCH], a[A_LAYER], kv, b) + at,
                                      kv_stage_rows(bl, a[A_BUF], kv, b) + at, bytes);
            link_add(rt, LINK_GPU_TO_CPU, (double)bytes);
            if (t == TIER_DISK) tier_add(rt, TIER_CPU, (double)bytes); /* until written back */
        }
}

/* Writes back the slots [first, first + count) of the disk rows; with delegation the past rows
 * [0, first) were read in place and leave memory too. */
static void cache_writeback_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const int *a = task->arg;
    size_t row = bl->s.kv_row, from = bl->delegate ? 0 : (size_t)a[A_FIRST];
    FOR_OFF_GPU(bl->s.cache, bl, a[A_BATCH], b, t)
        for (int kv = 0; kv < 2 && t == TIER_DISK; kv++)
            disk_release(rt, &bl->disk, kv_home_rows(bl, a[A_BATCH], a[A_LAYER], kv, b) + from * row,
                         (a[A_FIRST] + a[A_COUNT] - from) * row, (size_t)a[A_COUNT] * row);
}

static int is_decoder_layer(const block *bl, int j) { return j >= 1 && j <= bl->m->view.cfg.n_layers; }
/* Decoder layer j's KV cache among this stage's. */
static int cache_layer(const block *bl, int j) { return j - 1 - bl->m->first_decoder; }

/* The past of layer j's cache for GPU batch k, into staging arena buf (nothing at prefill);
 * with delegation, only disk pages come into memory, and attention reads them in place. */
static void load_cache(block *bl, int j, int k, int buf) {
    const gpu_batch *gb = &bl->gb[k];
    if (!is_decoder_layer(bl, j) || gb->len == 0 || bl->s.gbs == bl->s.cache.rows[TIER_GPU]) return;
    io_task t = {NULL, NULL, 0, 0, bl, {k, cache_layer(bl, j), buf, 0, gb->len}};
    uint64_t read = 0;
    if (bl->s.cache.rows[TIER_DISK]) {
        t.fn = cache_fetch_task, t.name = "read cache";
        read = io_submit(bl->rt, IO_DISK, t);
    }
    if (bl->delegate) return;
    t.fn = cache_in_task, t.name = "load cache", t.after_link = IO_DISK, t.after_seq = read;
    io_submit(bl->rt, IO_HOST, t);
}

/* This step's new rows of layer j's cache for GPU batch k, from staging arena buf to their home. */
static void store_cache(block *bl, int j, int k, int buf) {
    const gpu_batch *gb = &bl->gb[k];
    if (!is_decoder_layer(bl, j) || bl->s.gbs == bl->s.cache.rows[TIER_GPU]) return;
    io_task t = {NULL, NULL, 0, 0, bl, {k, cache_layer(bl, j), buf, gb->len, gb->n_new}};
    uint64_t copied = 0;
    if (!bl->delegate) {
        t.fn = cache_out_task, t.name = "store cache";
        copied = io_submit(bl->rt, IO_HOST, t);
    } else { /* attention wrote them in place: they came from the compute device all the same */
        size_t bytes = 2 * (size_t)gb->n_new * bl->s.kv_row;
        FOR_OFF_GPU(bl->s.cache, bl, k, b, tier) {
            link_add(bl->rt, LINK_GPU_TO_CPU, (double)bytes);
            if (tier == TIER_DISK) tier_add(bl->rt, TIER_CPU, (double)bytes);
        }
    }
    if (!bl->s.cache.rows[TIER_DISK]) return;
    t.fn = cache_writeback_task, t.name = "write cache", t.after_link = IO_HOST, t.after_seq = copied;
    io_submit(bl->rt, IO_DISK, t);
}

/* Activations: the rows of each sequence (n_new tokens) between its home and staging arena buf. */
static size_t act_bytes(const block *bl, int k) { return (size_t)bl->gb[k].n_new * bl->s.row_floats * sizeof(float); }
static float *x_rows(const block *bl, int buf, int k, int b) { return bl->x_stage[buf] + (size_t)b * bl->gb[k].n_new * bl->s.row_floats; }

static void act_fetch_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->arg[A_BATCH];
    FOR_OFF_GPU(bl->s.act, bl, k, b, t)
        if (t == TIER_DISK) disk_fetch(rt, &bl->disk, act_home_rows(bl, k, b), act_bytes(bl, k));
}

/* Sequence rows of GPU batch k between staging arena buf and their homes: in (home -> staging,
 * cpu -> gpu) or out (staging -> home, gpu -> cpu). Rows homed on the gpu tier move no link. */
static void act_move(fg_runtime *rt, block *bl, int k, int buf, int out) {
    size_t bytes = act_bytes(bl, k);
    for (int b = 0; b < bl->gb[k].batch; b++) {
        fg_tier t = tier_of(&bl->s.act, b);
        float *home = act_home_rows(bl, k, b), *x = x_rows(bl, buf, k, b);
        if (t == TIER_GPU) {
            rt->backend->copy(out ? home : x, out ? x : home, bytes);
        } else if (out) {
            rt->backend->copy_out(home, x, bytes);
            link_add(rt, LINK_GPU_TO_CPU, (double)bytes);
            if (t == TIER_DISK) tier_add(rt, TIER_CPU, (double)bytes); /* until written back */
        } else {
            rt->backend->copy_in(x, home, bytes);
            link_add(rt, LINK_CPU_TO_GPU, (double)bytes);
            if (t == TIER_DISK) disk_release(rt, &bl->disk, home, bytes, 0);
        }
    }
}

static void act_in_task(fg_runtime *rt, const io_task *task) {
    act_move(rt, task->ctx, task->arg[A_BATCH], task->arg[A_BUF], 0);
}

static void act_out_task(fg_runtime *rt, const io_task *task) {
    act_move(rt, task->ctx, task->arg[A_BATCH], task->arg[A_BUF], 1);
}

static void act_writeback_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->arg[A_BATCH];
    FOR_OFF_GPU(bl->s.act, bl, k, b, t)
        if (t == TIER_DISK)
            disk_release(rt, &bl->disk, act_home_rows(bl, k, b), act_bytes(bl, k), act_bytes(bl, k));
}

/* ---- Between pipeline stages (§4.4): a stage's first layer takes the previous stage's output
 * and its last layer gives its own to the next, through host buffers (the network is not assumed
 * to read device memory). Messages of one kind between two stages arrive in the order they were
 * sent, which is the order in which both stages walk the blocks and their GPU batches; a block
 * that stopped sends an empty message where its activations would be. ---- */

enum { TAG_ACTIVATIONS = 1, TAG_TOKENS = 2 };

static int rank_of(const block *bl) { return fg_pipe_rank(bl->rt->pipe); }
static int n_ranks(const block *bl) { return fg_pipe_size(bl->rt->pipe); }
static size_t batch_act_bytes(const block *bl, int k) { return (size_t)bl->gb[k].batch * act_bytes(bl, k); }
static float *inbox_slot(const block *bl, int buf) { return bl->inbox + buf * (bl->s.act_message / sizeof(float)); }
static float *outbox_slot(const block *bl, int k) { return bl->outbox + k * (bl->s.act_message / sizeof(float)); }

/* Posts the receive of GPU batch k's activations into inbox slot buf, unless it is posted. */
static void receive_hidden(block *bl, int k, int buf) {
    if (bl->in_msg >= 0) return;
    bl->in_k = k;
    bl->in_msg = fg_pipe_recv(bl->rt->pipe, rank_of(bl) - 1, TAG_ACTIVATIONS, inbox_slot(bl, buf),
                              bl->s.act_message);
}

/* The compute thread waits for the input of GPU batch k from the previous stage, if it is on its
 * way: the time is the pipeline's bubble. Returns the bytes that came (0: the block stopped). */
static size_t await_hidden(block *bl, int k) {
    size_t got = 0;
    if (bl->in_msg < 0 || bl->in_k != k) return 1;
    double start = now_seconds();
    bl->bubble += fg_pipe_wait(bl->rt->pipe, bl->in_msg, &got);
    trace_add(bl->rt, TRACK_COMPUTE, "wait for the previous stage", k, 0, start, now_seconds());
    return got;
}

/* After the copy of a received input: its message is done with. */
static void received_hidden(block *bl) {
    if (bl->in_msg >= 0) fg_pipe_release(bl->rt->pipe, bl->in_msg);
    bl->in_msg = -1;
}

static void act_receive_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->arg[A_BATCH], buf = task->arg[A_BUF];
    size_t want = batch_act_bytes(bl, k), got;
    fg_pipe_wait(rt->pipe, task->arg[A_FIRST], &got);
    if (got != want) { /* the stages disagree on the schedule: a bug, not bad input */
        fprintf(stderr, "flexgen: rank %d: %zu bytes of activations came from the previous stage, "
                        "%zu expected\n", rank_of(bl), got, want);
        abort();
    }
    rt->backend->copy_in(bl->x_stage[buf], inbox_slot(bl, buf), want);
    link_add(rt, LINK_CPU_TO_GPU, (double)want);
}

static void act_send_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->arg[A_BATCH], buf = task->arg[A_BUF];
    size_t bytes = batch_act_bytes(bl, k);
    if (bl->out_msg[k] >= 0) fg_pipe_release(rt->pipe, bl->out_msg[k]); /* the last step's left */
    rt->backend->copy_out(outbox_slot(bl, k), bl->x_stage[buf], bytes);
    link_add(rt, LINK_GPU_TO_CPU, (double)bytes);
    bl->out_msg[k] = fg_pipe_send(rt->pipe, rank_of(bl) + 1, TAG_ACTIVATIONS, outbox_slot(bl, k), bytes);
}

/* Tells the next stage that this block has stopped. */
static void pass_stop(block *bl) {
    if (!is_last_stage(bl->m))
        fg_pipe_release(bl->rt->pipe, fg_pipe_send(bl->rt->pipe, rank_of(bl) + 1, TAG_ACTIVATIONS, bl->ids, 0));
}

/* The messages a block has in flight, done (at the end of a round). */
static void finish_sends(block *bl) {
    for (int k = 0; k < bl->s.ngb; k++)
        if (bl->out_msg[k] >= 0) fg_pipe_release(bl->rt->pipe, bl->out_msg[k]), bl->out_msg[k] = -1;
    if (bl->ids_msg >= 0) fg_pipe_release(bl->rt->pipe, bl->ids_msg), bl->ids_msg = -1;
}

/* The input of layer j for GPU batch k (the output of layer j - 1) into staging arena buf.
 * Returns the task to wait for. The input embedding reads token ids, not activations; the first
 * layer of a later pipeline stage reads what the previous stage sent. */
static uint64_t load_hidden(block *bl, int j, int k, int buf) {
    if (j == bl->m->first_layer) {
        if (is_first_stage(bl->m)) return 0;
        receive_hidden(bl, k, buf);
        io_task t = {act_receive_task, "receive activations", 0, 0, bl, {k, j, buf, bl->in_msg}};
        return io_submit(bl->rt, IO_HOST, t);
    }
    io_task t = {act_fetch_task, "read activations", 0, 0, bl, {k, j, buf}};
    uint64_t read = bl->s.act.rows[TIER_DISK] ? io_submit(bl->rt, IO_DISK, t) : 0;
    t.fn = act_in_task, t.name = "load activations", t.after_link = IO_DISK, t.after_seq = read;
    return io_submit(bl->rt, IO_HOST, t);
}

/* The output of layer j for GPU batch k, from staging arena buf to its home, or (the stage's
 * last layer) to the next stage. The output embedding's result is the logits, which stay with
 * the block. */
static void store_hidden(block *bl, int j, int k, int buf) {
    if (j == bl->m->end_layer - 1) {
        if (!is_last_stage(bl->m))
            io_submit(bl->rt, IO_HOST, (io_task){act_send_task, "send activations", 0, 0, bl, {k, j, buf}});
        return;
    }
    io_task t = {act_out_task, "store activations", 0, 0, bl, {k, j, buf}};
    uint64_t copied = io_submit(bl->rt, IO_HOST, t);
    if (!bl->s.act.rows[TIER_DISK]) return;
    t.fn = act_writeback_task, t.name = "write activations", t.after_link = IO_HOST, t.after_seq = copied;
    io_submit(bl->rt, IO_DISK, t);
}

/* ============================================================================================
 * The block schedule (§4.1, Fig. 4)
 * ============================================================================================ */

/* Points GPU batch k at this iteration's activations and at layer j's cache rows: in their home
 * on the gpu tier (or, delegated, on cpu and disk), in staging otherwise. */
static void bind_batch(block *bl, int j, int k, int buf) {
    gpu_batch *gb = &bl->gb[k];
    gb->x = bl->x_stage[buf];
    if (!is_decoder_layer(bl, j)) return;
    for (int b = 0; b < gb->batch; b++) {
        fg_tier t = tier_of(&bl->s.cache, b);
        int home = t == TIER_GPU || bl->delegate;
        gb->k[b] = home ? kv_home_rows(bl, k, cache_layer(bl, j), 0, b) : kv_stage_rows(bl, buf, 0, b);
        gb->v[b] = home || v_in_place(bl, 1, t) ? kv_home_rows(bl, k, cache_layer(bl, j), 1, b) : kv_stage_rows(bl, buf, 1, b);
        gb->v_rows_read[b] = 0;
    }
}

static void compute_layer(block *bl, int j, int k, int buf) {
    static const char *const names[3] = {"input embedding", "decoder layer", "output embedding"};
    const fg_backend *be = bl->rt->backend;
    const opt_weights *w = &bl->m->view;
    gpu_batch *gb = &bl->gb[k];
    bind_batch(bl, j, k, buf);
    double start = now_seconds();
    if (j == 0) {
        be->embed(w, gb, bl->ws);
    } else if (is_decoder_layer(bl, j)) {
        be->layer(w, j - 1, gb, bl->ws);
        for (int b = 0; b < gb->batch && bl->sparse_v; b++) /* the kept V rows, gathered */
            if (tier_of(&bl->s.cache, b) == TIER_CPU)
                link_add(bl->rt, LINK_CPU_TO_GPU, (double)gb->v_rows_read[b] * (double)bl->s.kv_row / w->cfg.n_heads);
    } else {
        be->output(w, gb, bl->ws, bl->logits + (size_t)k * bl->s.gbs * w->cfg.vocab);
    }
    trace_add(bl->rt, TRACK_COMPUTE, names[j == 0 ? 0 : is_decoder_layer(bl, j) ? 1 : 2], j, k,
              start, now_seconds());
}

/* One generated token (step i) for the whole block on this stage's layers: the two inner loops
 * of Fig. 4. Weights of layer j are loaded once and used by every GPU batch of the block; while
 * batch k computes, the next layer's weights, batch k - 1's results and batch k + 1's inputs move
 * on the I/O links. Iteration t uses staging arena t % 2, so what moves never touches what
 * computes. u counts the stage's units (block steps) of the round: layer g = u L + j's weights
 * load while layer g - 1 computes, across units too. */
/* The staging arena of unit u's first iteration (iteration t uses arena t % 2). */
static int first_arena(const block *bl, long u) {
    return (int)((u * stage_layers(bl->m) * bl->n_batches) % 2);
}

static double generation_step(block *bl, long u, int last_unit) {
    fg_model *m = bl->m;
    int L = stage_layers(m), K = bl->n_batches, first = m->first_layer;
    long end = last_unit ? (u + 1) * L : LONG_MAX; /* the layers g = u L + j that will run */
    double compute = 0;
    /* the input and cache of the stage's first layer for the first GPU batch; each later one
     * loads while the one before computes */
    load_cache(bl, first, 0, first_arena(bl, u));
    load_hidden(bl, first, 0, first_arena(bl, u));
    io_sync(bl->rt, 0);
    received_hidden(bl);
    for (int jl = 0; jl < L; jl++) {
        int j = first + jl;
        long g = u * L + jl;
        for (int k = 0; k < K; k++) {
            long t = g * K + k;
            int prev_j = k > 0 ? j : j - 1, prev_k = k > 0 ? k - 1 : K - 1;
            int next_j = k + 1 < K ? j : j + 1, next_k = k + 1 < K ? k + 1 : 0;
            if (k == 0) bind_weights(m, g);
            if (k == 0 && g + 1 < end) load_weights(m, g + 1);
            if (k == 0 && g + 2 < end) read_weights(m, g + 2);
            if (prev_j >= first) {
                store_cache(bl, prev_j, prev_k, (int)((t + 1) % 2));
                store_hidden(bl, prev_j, prev_k, (int)((t + 1) % 2));
            }
            if (K == 1 && j > first) /* the input is the output just stored: nothing to overlap it with */
                io_wait(bl->rt, IO_HOST, load_hidden(bl, j, k, (int)(t % 2)));
            if (next_j < first + L) {
                load_cache(bl, next_j, next_k, (int)((t + 1) % 2));
                if (K > 1) load_hidden(bl, next_j, next_k, (int)((t + 1) % 2));
            }
            double start = now_seconds();
            compute_layer(bl, j, k, (int)(t % 2));
            compute += now_seconds() - start;
            await_hidden(bl, next_k);
            io_sync(bl->rt, k == K - 1);
            received_hidden(bl);
        }
    }
    /* the last iteration's results: its cache rows, and its activations for the next stage */
    long last = (u * L + L - 1) * K + K - 1;
    store_cache(bl, first + L - 1, K - 1, (int)(last % 2));
    store_hidden(bl, first + L - 1, K - 1, (int)(last % 2));
    io_sync(bl->rt, 0);
    for (int k = 0; k < K; k++) bl->gb[k].len += bl->gb[k].n_new, bl->gb[k].n_new = 1;
    return compute;
}

/* Loads a block's prompts, left-padded to the longest, as the prefill step's input. */
static void start_block(block *bl, int *const *prompts, const int *lens, int first, int count) {
    int padded = 0, gbs = bl->s.gbs;
    for (int i = 0; i < count; i++) padded = lens[first + i] > padded ? lens[first + i] : padded;
    bl->count = count;
    bl->running = count > 0;
    bl->n_batches = (count + gbs - 1) / gbs;
    memset(bl->done, 0, (size_t)bl->s.gbs * bl->s.ngb);
    for (int k = 0; k < bl->n_batches; k++) {
        gpu_batch *gb = &bl->gb[k];
        int base = first + k * gbs;
        gb->batch = count - k * gbs < gbs ? count - k * gbs : gbs;
        gb->len = 0;
        gb->n_new = padded;
        for (int b = 0; b < gb->batch; b++) {
            int n = lens[base + b], *row = gb->tokens + (size_t)b * padded;
            gb->pad[b] = padded - n;
            for (int t = 0; t < padded - n; t++) row[t] = OPT_PAD_ID;
            memcpy(row + padded - n, prompts[base + b], (size_t)n * sizeof(int));
        }
    }
}

/* The last stage chooses each sequence's next token from its logits (into bl->ids), keeping
 * the logits of sequences still running. Sampling draws from a generator seeded by (seed,
 * prompt, step), so the tokens do not depend on the block shape or the number of stages. */
static void sample_tokens(block *bl, const gen_options *opt, int step, int first,
                          float *logits_out, float *scratch) {
    int vocab = bl->m->view.cfg.vocab;
    if (bl->ids_msg >= 0) fg_pipe_release(bl->rt->pipe, bl->ids_msg), bl->ids_msg = -1; /* the ids' last trip */
    bl->rt->backend->copy_out(bl->host_logits, bl->logits, (size_t)bl->count * vocab * sizeof(float));
    for (int s = 0; s < bl->count; s++) {
        const float *row = bl->host_logits + (size_t)s * vocab;
        int p = first + s;
        if (logits_out && !bl->done[s])
            memcpy(logits_out + ((size_t)p * opt->gen_len + step) * vocab, row, vocab * sizeof(float));
        fg_rng rng;
        rng_seed(&rng, opt->seed ^ (((uint64_t)p << 24) + (uint64_t)step) * 0x9e3779b97f4a7c15ULL);
        bl->ids[s] = sample_token(row, vocab, opt->temperature, opt->top_p, &rng, scratch);
    }
}

/* Takes the tokens of step `step` (bl->ids) as the output and the next step's input. Returns how
 * many sequences are still running. */
static int take_tokens(block *bl, const gen_options *opt, int step, int first, int *out_tokens) {
    int running = 0;
    for (int s = 0; s < bl->count; s++) {
        int tok = bl->ids[s];
        out_tokens[(size_t)(first + s) * opt->gen_len + step] = bl->done[s] ? OPT_PAD_ID : tok;
        if (opt->stop_at_eos && tok == OPT_EOS_ID) bl->done[s] = 1;
        running += !bl->done[s];
        bl->gb[s / bl->s.gbs].tokens[s % bl->s.gbs] = tok;
    }
    return running;
}

/* The first stage's side of the token ids: those of step `step` come back from the last stage
 * (or were chosen here, with one stage); the time waiting for them is the pipeline's bubble. */
static int receive_tokens(block *bl, const gen_options *opt, int step, int first, int *out_tokens) {
    if (!is_last_stage(bl->m)) {
        double start = now_seconds();
        int msg = fg_pipe_recv(bl->rt->pipe, n_ranks(bl) - 1, TAG_TOKENS, bl->ids, (size_t)bl->count * sizeof(int));
        bl->bubble += fg_pipe_wait(bl->rt->pipe, msg, NULL);
        fg_pipe_release(bl->rt->pipe, msg);
        trace_add(bl->rt, TRACK_COMPUTE, "wait for the last stage", step, 0, start, now_seconds());
    }
    return take_tokens(bl, opt, step, first, out_tokens);
}

/* The last stage's side: the chosen ids go back to the first stage (which takes them itself
 * with one stage); its own copy of the outputs keeps --stop-at-eos's bookkeeping for the logits. */
static void send_tokens(block *bl, const gen_options *opt, int step, int first, int *out_tokens) {
    if (is_first_stage(bl->m)) return;
    take_tokens(bl, opt, step, first, out_tokens);
    bl->ids_msg = fg_pipe_send(bl->rt->pipe, 0, TAG_TOKENS, bl->ids, (size_t)bl->count * sizeof(int));
}

/* A later stage computes a step of a block when the previous stage's output arrives; an empty
 * message says the block stopped, which is passed on. */
static int input_arrives(block *bl, int buf) {
    receive_hidden(bl, 0, buf);
    if (await_hidden(bl, 0) > 0) return 1;
    received_hidden(bl);
    bl->running = 0;
    pass_stop(bl);
    return 0;
}

static int check_prompts(const opt_config *c, int n, int *const *prompts, const int *lens,
                         int gen_len, char *err) {
    if (n < 1) return fg_fail(err, "no prompts");
    for (int p = 0; p < n; p++) {
        if (lens[p] < 1) return fg_fail(err, "prompt %d is empty", p + 1);
        if (lens[p] + gen_len > c->max_pos)
            return fg_fail(err, "prompt %d: %d tokens + --gen-len %d exceed the model's %d positions",
                        p + 1, lens[p], gen_len, c->max_pos);
        for (int t = 0; t < lens[p]; t++)
            if (prompts[p][t] < 0 || prompts[p][t] >= c->vocab)
                return fg_fail(err, "prompt %d: token id %d out of range [0, %d)", p + 1,
                            prompts[p][t], c->vocab);
    }
    return 0;
}

static void free_blocks(block *blocks, int n) {
    for (int t = n - 1; t >= 0; t--) free_block(&blocks[t]); /* the owner of shared buffers last */
    free(blocks);
}

/* The blocks of a stage (§4.4's micro-batches; one block in one process), everything checked
 * and allocated: the plan, the weights in their homes. */
static block *open_blocks(fg_model *m, int n_prompts, int max_prompt, int gen_len, int *n_blocks,
                          char *err) {
    int size, count;
    micro_batches(m, n_prompts, &size, &count);
    block *blocks = calloc((size_t)count, sizeof *blocks);
    if (!blocks) { fg_fail(err, "out of memory"); return NULL; }
    int rc = fg_check_plan(m, n_prompts, max_prompt, gen_len, err);
    if (rc == 0 && !m->loaded) rc = load_weights_into_homes(m, err);
    for (int t = 0; t < count && rc == 0; t++)
        rc = alloc_block(&blocks[t], m, n_prompts, max_prompt, gen_len, t ? &blocks[0] : NULL, err);
    if (rc) { free_blocks(blocks, count); return NULL; }
    *n_blocks = count;
    return blocks;
}

/* A generation's state that each round's units share. */
typedef struct {
    fg_model *m;
    const gen_options *opt;
    block *blocks;   /* [P]: the stage's micro-batches (one block in one process) */
    int P, B;        /* micro-batches of a round, sequences each at most */
    int *out_tokens;
    float *logits, *scratch;
    gen_timing *timing;
} gen_run;

/* The first stage takes step i - 1's tokens of a block (from the last stage, or chosen here
 * with one stage) and sees whether any sequence runs on; a block that stopped is passed on. */
static void tokens_back(gen_run *g, block *bl, int i, int first) {
    bl->running = receive_tokens(bl, g->opt, i - 1, first, g->out_tokens) > 0;
    if (i > 1) g->timing->decode_tokens += bl->count;
    if (!bl->running && i < g->opt->gen_len) pass_stop(bl);
}

/* Step i of block bl on this stage, and on the last stage its next tokens. */
static void run_unit(gen_run *g, block *bl, int i, int first, long u, int last_unit) {
    const fg_policy *p = &g->m->rt->policy;
    bl->delegate = p->cpu_cache_compute && i > 0;
    /* a device that reads only its own memory gets the V rows whole (as they are staged) */
    bl->sparse_v = p->attn_sparsity < 1 && i > 0 && !bl->delegate && g->m->rt->backend->gpu_is_host;
    g->timing->compute_seconds += generation_step(bl, u, last_unit);
    if (!is_last_stage(g->m)) return;
    sample_tokens(bl, g->opt, i, first, g->logits, g->scratch);
    send_tokens(bl, g->opt, i, first, g->out_tokens);
}

/* A round: P micro-batches of prompts from `base` through every step. §4.4's iteration-level
 * pipeline: each stage runs step i of micro-batch t while the stage before it runs step i of
 * t + 1 and the one after it step i of t - 1; the first stage then waits for t's tokens of step
 * i to come back before it starts t's step i + 1 (with one stage: a block at a time, Fig. 4). */
static void run_round(gen_run *g, int *const *prompts, const int *lens, int n_prompts, int base,
                      const char *progress) {
    fg_model *m = g->m;
    int started = 0, prefilled = 0, gen_len = g->opt->gen_len;
    for (int t = 0; t < g->P; t++) {
        int first = base + t * g->B, count = n_prompts - first < g->B ? n_prompts - first : g->B;
        start_block(&g->blocks[t], prompts, lens, first, count > 0 ? count : 0);
        if (count > 0) g->timing->prefill_tokens += (int64_t)count * g->blocks[t].gb[0].n_new, started++;
    }
    double t0 = now_seconds(), t_prefill = t0;
    m->staged[0] = m->staged[1] = -1;
    load_weights(m, 0); /* the first layer; every later one is loaded while its predecessor computes */
    io_sync(m->rt, 1);
    long u = 0;
    for (int i = 0; i <= gen_len; i++) /* i == gen_len: the last tokens come back */
        for (int t = 0; t < g->P; t++) {
            block *bl = &g->blocks[t];
            int first = base + t * g->B;
            if (bl->running && is_first_stage(m) && i > 0) {
                tokens_back(g, bl, i, first);
                if (i == 1 && ++prefilled == started) t_prefill = now_seconds();
                if (progress && t == g->P - 1) fprintf(stderr, "\r%s: token %d/%d", progress, i, gen_len);
            }
            if (i == gen_len || !bl->running || (!is_first_stage(m) && !input_arrives(bl, first_arena(bl, u))))
                continue;
            run_unit(g, bl, i, first, u++, i + 1 == gen_len && t == g->P - 1);
        }
    if (is_first_stage(m)) {
        double t1 = now_seconds();
        g->timing->prefill_latency += t_prefill - t0;
        g->timing->decode_latency += t1 - t_prefill;
    }
    for (int t = 0; t < g->P; t++) {
        finish_sends(&g->blocks[t]);
        g->timing->bubble_seconds += g->blocks[t].bubble, g->blocks[t].bubble = 0;
    }
    forget_reads(m);
}

int generate(fg_model *m, const gen_options *opt, int n_prompts, int *const *prompts,
             const int *prompt_lens, int *out_tokens, float *logits, gen_timing *timing,
             char *err) {
    const opt_config *c = &m->view.cfg;
    fg_runtime *rt = m->rt;
    gen_run g = {.m = m, .opt = opt, .out_tokens = out_tokens, .logits = logits, .timing = timing};
    int max_prompt = 1;
    for (int p = 0; p < n_prompts; p++) max_prompt = prompt_lens[p] > max_prompt ? prompt_lens[p] : max_prompt;
    int rc = check_prompts(c, n_prompts, prompts, prompt_lens, opt->gen_len, err);
    if (rc == 0 && !(g.blocks = open_blocks(m, n_prompts, max_prompt, opt->gen_len, &g.P, err))) rc = -1;
    if (rc == 0 && !(g.scratch = malloc((size_t)2 * c->vocab * sizeof(float)))) rc = fg_fail(err, "out of memory");
    if (fg_pipe_agree(rt->pipe, rc, err)) { /* every stage is ready, or none starts */
        if (g.blocks) free_blocks(g.blocks, g.P);
        free(g.scratch);
        return -1;
    }
    if (logits) memset(logits, 0, (size_t)n_prompts * opt->gen_len * c->vocab * sizeof(float));
    for (size_t i = 0; i < (size_t)n_prompts * opt->gen_len; i++) out_tokens[i] = OPT_PAD_ID;
    memset(timing, 0, sizeof *timing);
    double disk_read_before = rt->disk_read_seconds;
    g.B = g.blocks[0].s.gbs * g.blocks[0].s.ngb;
    int rounds = (n_prompts + g.P * g.B - 1) / (g.P * g.B);
    for (int r = 0; r < rounds; r++) {
        char progress[64];
        snprintf(progress, sizeof progress, "block %d/%d", r + 1, rounds);
        run_round(&g, prompts, prompt_lens, n_prompts, r * g.P * g.B,
                  opt->verbose && is_first_stage(m) ? progress : NULL);
    }
    if (opt->verbose && is_first_stage(m)) fprintf(stderr, "\n");
    timing->disk_read_seconds = rt->disk_read_seconds - disk_read_before;
    free(g.scratch);
    free_blocks(g.blocks, g.P);
    return 0;
}

/* ============================================================================================
 * Profiling (§4.3: the cost model's constants, Table 7's symbols, for this machine). Each rate
 * is measured on the path the runtime takes: the backend's cpu -> gpu and gpu -> cpu copies,
 * the disk tier's mapped files in the offload dir (written back with msync, read by faulting
 * the pages in after dropping them from the page cache), and the backend's own layer for
 * compute: a layer's time is a sum of terms (weights read, FLOPs of the products, FLOPs of
 * attention), and runs that differ in one of them give its rate (profile_compute).
 * ============================================================================================ */

/* Seconds for fn(ctx): the median of five runs after one to warm up. Not the best: on a busy
 * machine, or beside the runtime's own I/O threads, the typical run is what a prediction needs. */
typedef void (*timed_fn)(void *ctx);
static int cmp_double(const void *a, const void *b) {
    double d = *(const double *)a - *(const double *)b;
    return d < 0 ? -1 : d > 0;
}
static double typical_time(timed_fn fn, void *ctx) {
    double t[5];
    fn(ctx);
    for (int r = 0; r < 5; r++) {
        double t0 = now_seconds();
        fn(ctx);
        t[r] = now_seconds() - t0;
    }
    qsort(t, 5, sizeof *t, cmp_double);
    return t[2];
}

typedef struct {
    const fg_backend *be;
    void *src, *dst, *landing;
    size_t n;
    opt_weights *w;
    gpu_batch *gb;
    opt_workspace *ws;
} profile_ctx;

static void time_weights_in(void *c) { profile_ctx *p = c; p->be->weights_in(p->dst, p->src, p->n); }
static void time_copy_out(void *c) { profile_ctx *p = c; p->be->copy_out(p->dst, p->src, p->n); }
static void time_dequant(void *c) { profile_ctx *p = c; p->be->weights_in_q4(p->dst, p->src, p->landing, 1, p->n, 1); }
static void time_layer(void *c) { profile_ctx *p = c; p->be->layer(p->w, 0, p->gb, p->ws); }

static void profile_step(int verbose, const char *what) {
    if (verbose) fprintf(stderr, "profile: %s\n", what);
}

/* Copies through the backend (from pinned host memory, as the cpu tier's), and 4-bit
 * decompression. */
static int profile_copies(const fg_backend *be, fg_hardware *hw, char *err) {
    size_t n = (size_t)64 << 20; /* 64 Mi values: 128 MiB of fp16, 256 MiB of fp32 */
    profile_ctx c = {.be = be, .n = n, .src = be->host_alloc(4 * n, 1), .dst = be->alloc(4 * n)};
    void *landing = be->alloc(q4_bytes(1, n, 1));
    int rc = 0;
    if (!c.src || !c.dst || !landing) rc = fg_fail(err, "profile: out of memory");
    else {
        memset(c.src, 0x3c, 4 * n);
        hw->ctog_bdw = 2.0 * n / typical_time(time_weights_in, &c);
        void *device = c.dst;
        c.dst = c.src, c.src = device, c.n = 4 * n;
        hw->gtoc_bdw_cache = hw->gtoc_bdw_hidden = 4.0 * n / typical_time(time_copy_out, &c);
        c.src = c.dst, c.dst = device, c.n = n, c.landing = landing;
        float *values = malloc(n * sizeof *values);
        if (!values) rc = fg_fail(err, "profile: out of memory");
        for (size_t i = 0; values && i < n; i++) values[i] = (float)(i % 251) * 0.01f;
        if (values) q4_compress(values, 1, n, 1, c.src);
        free(values);
        if (rc == 0) hw->dequant_bdw = 2.0 * n / typical_time(time_dequant, &c);
    }
    be->host_free(c.src), be->free(c.dst), be->free(landing);
    return rc;
}

/* The disk tier: cpu -> disk by writing a mapped file back, disk -> cpu by reading it in. */
static int profile_disk(const char *dir, fg_hardware *hw, char *err) {
    struct statvfs vfs;
    double free_bytes = statvfs(dir, &vfs) == 0 ? (double)vfs.f_bavail * vfs.f_frsize : 0;
    size_t bytes = (size_t)1 << 30;
    if (free_bytes / 4 < bytes) bytes = page_up((size_t)(free_bytes / 4));
    if (bytes < ((size_t)16 << 20))
        return fg_fail(err, "--offload-dir %s: %s free, too little to measure the disk", dir, human(free_bytes).s);
    disk_arena a;
    int fd = unnamed_file(dir, "--offload-dir", err);
    if (fd < 0 || arena_map(&a, fd, bytes, "--offload-dir", dir, err)) return -1;
    double t0 = now_seconds();
    memset(a.base, 0x5a, bytes);
    drop_pages(&a, a.base, bytes, 1);
    double t1 = now_seconds();
    for (size_t at = 0; at < bytes; at += (size_t)64 << 20) /* as disk_fetch: a tensor at a time */
        disk_fetch_pages(&a, at, bytes - at < ((size_t)64 << 20) ? bytes - at : (size_t)64 << 20);
    double t2 = now_seconds();
    arena_close(&a);
    hw->ctod_bdw_cache_p = hw->ctod_bdw_hidden_p = hw->ctod_bdw_g = bytes / (t1 - t0);
    hw->dtoc_bdw = bytes / (t2 - t1);
    return 0;
}

/* One decoder layer of opt-1.3b's width, timed in four decode runs and two prefills:
 *   decode, 8 and 128 sequences over 32 cached tokens: t = W / mem_bdw + gbs mm / mm_flops_g
 *     (W: the layer's working weights, read once per GPU batch; mm: FLOPs of a token), with
 *     attention negligible at this length
 *   decode, 32 sequences over 32 and over 1024 cached tokens: the difference is attention over
 *     992 more tokens, 4 gbs 992 h1 FLOPs at bmm_flops_g
 *   prefill of one sequence of 256 and of 1024 tokens: t = s mm / mm_flops_p + 4 s^2 h1 /
 *     bmm_flops_p
 * A difference is taken as at least 1% of the longer run, against noise. */
/* Dummy weights of cfg in the backend's working format on its gpu tier (view's pointers). */
static int device_weights(const fg_backend *be, const opt_config *cfg, opt_layout *l,
                          opt_weights *view, char *err) {
    memset(view, 0, sizeof *view);
    if (opt_layout_init(l, view, cfg, 0, err)) return -1;
    weight_source src = {NULL, 1};
    for (int i = 0; i < l->n_tensors; i++) {
        const opt_tensor *t = &l->tensors[i];
        if (t->tied_to >= 0) continue;
        fp16 *values = malloc(t->count * sizeof *values);
        void *working = be->alloc(t->count * be->weight_elem);
        if (values && working) {
            opt_tensor_fill(l, i, &src, NULL, values);
            be->weights_in(working, values, t->count);
            *t->slot = working;
        }
        free(values);
        if (!working) return fg_fail(err, "profile: out of memory on the gpu tier");
        if (!values) return fg_fail(err, "profile: out of memory");
    }
    for (int i = 0; i < l->n_tensors; i++)
        if (l->tensors[i].tied_to >= 0) *l->tensors[i].slot = *l->tensors[l->tensors[i].tied_to].slot;
    return 0;
}

static void device_weights_free(const fg_backend *be, opt_layout *l) {
    for (int i = 0; i < l->n_tensors; i++)
        if (l->tensors[i].tied_to < 0) be->free(*l->tensors[i].slot);
    opt_layout_free(l);
}

/* One decoder layer of opt-1.3b's width, timed in four decode runs and two prefills:
 *   decode, 8 and 128 sequences over 32 cached tokens: t = W / mem_bdw + gbs mm / mm_flops_g
 *     (W: the layer's working weights, read once per GPU batch; mm: FLOPs of a token), with
 *     attention negligible at this length
 *   decode, 32 sequences over 32 and over 1024 cached tokens: the difference is attention over
 *     992 more tokens, 4 gbs 992 h1 FLOPs at bmm_flops_g
 *   prefill of one sequence of 256 and of 1024 tokens: t = s mm / mm_flops_p + 4 s^2 h1 /
 *     bmm_flops_p
 * A difference is taken as at least 1% of the longer run, against noise. Delegated attention
 * (cpu_flops) is the CPU backend's decode attention. */
static int profile_compute(const fg_backend *be, fg_hardware *hw, int verbose, char *err) {
    opt_config c = {"profile", 1, 2048, 32, 8192, 64, 2048, 2048, 1};
    enum { LONG = 1024, MAX_GBS = 128, LONG_GBS = 32 };
    opt_weights w;
    opt_layout layout = {0};
    double h = c.hidden, mm_token = 8 * h * h + 4 * h * c.ffn; /* FLOPs of the products a token */
    double working = be->weight_elem * (4 * h * h + 2 * h * c.ffn); /* bytes of the products */
    gpu_batch gb = {0};
    opt_workspace ws = {0};
    size_t x_bytes = (size_t)LONG * c.hidden * sizeof(float); /* LONG >= MAX_GBS rows */
    size_t row = 2 * (size_t)c.hidden, rows = (size_t)2 * LONG_GBS * (LONG + 1);
    float *x = be->alloc(x_bytes), *x_host = malloc(x_bytes);
    char *cache = be->alloc(rows * row); /* K and V of 32 sequences of LONG + 1 slots, or of
                                            more sequences of fewer slots */
    int rc = device_weights(be, &c, &layout, &w, err), has_ws = 0;
    if (rc == 0) rc = gpu_batch_init(&gb, MAX_GBS, LONG + 1, LONG, err);
    if (rc == 0) rc = be->workspace_init(&ws, &c, LONG, LONG + 1, err), has_ws = rc == 0;
    if (rc == 0 && (!x || !x_host || !cache)) rc = fg_fail(err, "profile: out of memory");
    if (rc == 0) {
        for (size_t i = 0; i < (size_t)LONG * c.hidden; i++) x_host[i] = 0.01f * (float)((i * 7919) % 201) - 1;
        gb.x = x;
        gb.attn_sparsity = 1;
        profile_ctx ctx = {.be = be, .w = &w, .gb = &gb, .ws = &ws};
        profile_step(verbose, "matrix products and attention, decode");
        static const int runs[4][2] = {{8, 32}, {MAX_GBS, 32}, {LONG_GBS, 32}, {LONG_GBS, LONG}};
        double t[4]; /* runs: gbs, cached tokens */
        for (int i = 0; i < 4; i++) {
            be->copy_in(x, x_host, x_bytes); /* each run from the same activations */
            gb.batch = runs[i][0], gb.len = runs[i][1], gb.n_new = 1;
            size_t seq = row * (size_t)(runs[i][1] + 1);
            for (int b = 0; b < gb.batch; b++)
                gb.k[b] = cache + 2 * b * seq, gb.v[b] = cache + (2 * b + 1) * seq, gb.pad[b] = 0;
            t[i] = typical_time(time_layer, &ctx);
        }
        double per_seq = fmax((t[1] - t[0]) / (runs[1][0] - runs[0][0]), 1e-12);
        double fixed = fmax(t[0] - runs[0][0] * per_seq, 0.01 * t[0]);
        hw->mm_flops_g = mm_token / per_seq;
        hw->mem_bdw = working / fixed;
        double att = fmax(t[3] - t[2], 0.01 * t[3]);
        hw->bmm_flops_g = 4.0 * LONG_GBS * (runs[3][1] - runs[2][1]) * h / att;
        profile_step(verbose, "matrix products and attention, prefill");
        const double lens[2] = {256, LONG};
        double tp[2];
        for (int i = 0; i < 2; i++) {
            be->copy_in(x, x_host, x_bytes);
            gb.batch = 1, gb.len = 0, gb.n_new = (int)lens[i];
            tp[i] = typical_time(time_layer, &ctx);
        }
        /* t / s = mm / R_mm + 4 s h1 / R_bmm: a line in s through the two runs */
        double slope = fmax((tp[1] / lens[1] - tp[0] / lens[0]) / (lens[1] - lens[0]), 0.01 * tp[1] / (lens[1] * lens[1]));
        hw->bmm_flops_p = 4 * h / slope;
        hw->mm_flops_p = mm_token / fmax(tp[1] / lens[1] - slope * lens[1], 0.01 * tp[1] / lens[1]);
    }
    gpu_batch_free(&gb);
    if (has_ws) be->workspace_free(&ws);
    device_weights_free(be, &layout);
    be->free(x);
    be->free(cache);
    free(x_host);
    return rc;
}

int fg_profile(const char *offload_dir, fg_device device, fg_hardware *hw, int verbose, char *err) {
    const fg_backend *be = backend_for(device, err);
    if (!be) return -1;
    memset(hw, 0, sizeof *hw);
    hw->gpu_is_host = be->gpu_is_host;
    if (check_dir("--offload-dir", offload_dir, err)) return -1;
    profile_step(verbose, "cpu -> gpu and gpu -> cpu copies, 4-bit decompression");
    if (profile_copies(be, hw, err)) return -1;
    profile_step(verbose, "disk write and read in the offload dir (1 GiB)");
    if (profile_disk(offload_dir, hw, err)) return -1;
    if (profile_compute(be, hw, verbose, err)) return -1;
    hw->cpu_flops = hw->bmm_flops_g;
    if (be->gpu_is_host) return 0;
    fg_hardware cpu; /* delegated attention: the CPU backend's decode attention */
    profile_step(verbose, "the CPU's attention, for --cpu-cache-compute");
    if (profile_compute(&fg_cpu_backend, &cpu, 0, err)) return -1;
    hw->cpu_flops = cpu.bmm_flops_g;
    return 0;
}

/* ============================================================================================
 * Command line
 * ============================================================================================ */

typedef struct {
    const char *model, *prompt_file, *prompt_ids, *dump_logits, *vocab, *merges, *trace;
    const char *hw;      /* hardware file of the cost model (--hw) */
    const char **prompts;
    int n_prompt_texts, prompt_len, json;
    int auto_policy;     /* --policy auto: search for the policy (§4.3) */
    int evaluate;        /* flexgen policy --evaluate: predict the given policy, no search */
    double max_latency;  /* --max-latency: the search's bound on a block's latency */
    gen_options gen;
    fg_policy policy;
} cli_args;

static void usage(FILE *out) {
    fprintf(out,
"usage: flexgen [options]\n"
"       flexgen policy [options] [--evaluate]         (the policy search; no generation)\n"
"       flexgen profile [--offload-dir DIR] [--out FILE] [--device cuda|cpu|auto]\n"
"       flexgen tokenize --vocab FILE --merges FILE   (stdin lines -> token ids, no BOS)\n"
"\n"
"Generates text with an OPT model, placing weights, KV cache and activations on the gpu, cpu\n"
"and disk tiers and walking blocks of GPU batches in the order of the FlexGen paper's Fig. 4\n"
"with I/O overlapped, then prints FlexGen's benchmark report. On the CUDA backend the gpu tier\n"
"is device memory (fp16 weights); on the CPU backend it is the CPU's working set of fp32\n"
"weights and buffers.\n"
"\n"
"model\n"
"  --model NAME|DIR        opt-125m ... opt-175b with dummy weights, or an HF checkpoint\n"
"                          directory (config.json + model.safetensors or its shard index)\n"
"                          [opt-125m]\n"
"  --path DIR              dummy weights placed on disk are written here once and reused\n"
"                          [$XDG_CACHE_HOME/flexgen or ~/.cache/flexgen]\n"
"  --vocab F, --merges F   tokenizer files (default: vocab.json, merges.txt in DIR)\n"
"prompts (synthetic ones of --prompt-len tokens when none are given)\n"
"  --prompt TEXT           a prompt (repeatable); needs a tokenizer; BOS is prepended\n"
"  --prompt-file F         one prompt a line; needs a tokenizer; BOS is prepended\n"
"  --prompt-ids F          one prompt a line, space-separated token ids, used as given\n"
"  --prompt-len N          length of synthetic prompts [512]\n"
"generation\n"
"  --gen-len N             tokens to generate per prompt [32]\n"
"  --temperature T         0 is greedy; > 0 samples from softmax(logits / T) [0]\n"
"  --top-p P               nucleus sampling mass, in (0, 1] [1]\n"
"  --seed N                seed of dummy weights, synthetic prompts and sampling [0]\n"
"  --stop-at-eos           stop a sequence after it generates </s>\n"
"device\n"
"  --device cuda|cpu|auto  the compute device: auto is cuda where a GPU is present (this build:\n"
"                          %s), else the CPU [auto]\n"
"policy (paper section 4.2)\n"
"  --gpu-batch-size N      sequences per GPU batch [16]\n"
"  --num-gpu-batches N     GPU batches per block; a block is their product, and prompts are\n"
"                          processed a block at a time (the last may be partial) [2]\n"
"  --percent WG WC CG CC HG HC\n"
"                          percent of weights, KV cache and activations on the gpu and cpu\n"
"                          tiers; disk holds the rest of each [100 0 100 0 100 0]\n"
"  --overlap 0|1           I/O on its own threads, overlapped with compute [1]\n"
"  --cpu-cache-compute     decode attention over a cache on cpu or disk runs on the CPU where\n"
"                          the cache lives\n"
"  --pin-weight 0|1        page-locked cpu-tier weights, for fast copies to the GPU (CUDA only)\n"
"                          [1]\n"
"  --compress-weight       keep every weight matrix 4-bit, group-wise (section 5) in whichever\n"
"                          tier holds it; decompressed into the gpu tier just before use\n"
"  --compress-cache        keep the KV cache 4-bit, group-wise along each head (section 5)\n"
"  --attn-sparsity F       decode attention keeps the top F of the past tokens by weight and\n"
"                          reads only their V rows (section 5), 0 < F <= 1 [1]\n"
"  --gpu-mem SIZE, --cpu-mem SIZE, --disk-mem SIZE\n"
"                          tier capacities, e.g. 16G, 512M (K, M, G, T are powers of 1024)\n"
"                          [available memory; free space in the offload dir, plus dummy\n"
"                          weights already written to --path]\n"
"  --offload-dir DIR       the disk tier's files, removed as soon as they are mapped [%s]\n"
"pipeline parallelism (paper section 4.4; this build: %s)\n"
"  mpirun -np M flexgen [options]\n"
"                          M stages, one process each (one GPU each where there are GPUs): the\n"
"                          decoder layers split evenly, the input embedding with the first stage,\n"
"                          the output embedding with the last. Rank 0 reads the prompts and\n"
"                          prints the report; the other flags mean what they mean in one process\n"
"                          and must agree across stages, except the policy and capacities, which\n"
"                          are each stage's own (mpirun's `-np 1 flexgen ... : -np 1 flexgen ...`\n"
"                          gives stages different ones; --policy auto plans each stage)\n"
"policy search (paper section 4.3)\n"
"  --policy auto|manual    auto: choose the block shape, --percent and --cpu-cache-compute by\n"
"                          the cost model and LP for these capacities, prompts and --gen-len,\n"
"                          keeping the other flags; synthetic prompts fill the block it picks,\n"
"                          which can be thousands (bound it with --max-latency) [manual]\n"
"  --hw FILE               the cost model's hardware constants (JSON) [~/.cache/flexgen/\n"
"                          hardware.json, measured by `flexgen profile` the first time]\n"
"  --max-latency S         auto: a block may take at most S seconds (Fig. 1's trade-off)\n"
"  flexgen policy takes the flags of a run and prints the policy the search chooses, as flags,\n"
"  with its predicted throughput and each layer's latency terms (--json: one object);\n"
"  --evaluate predicts the policy given by the flags instead of searching.\n"
"  flexgen profile measures this machine (copies, the disk in --offload-dir, matrix products\n"
"  and attention) and writes the hardware file (--out FILE) [the default --hw]\n"
"output\n"
"  --dump-logits F         float32 [num_prompts][gen_len][vocab]: the logits each generated\n"
"                          token was chosen from, in prompt order\n"
"  --trace F               a Chrome trace (load it in Perfetto): one track per thread\n"
"  --json                  one JSON object on stdout instead of the report lines\n"
"  --quiet                 no progress on stderr\n"
"  --help                  this text\n"
"\n"
"Threads: OMP_NUM_THREADS (default: all cores). Bad input exits with status 2.\n",
            fg_cuda_compiled() ? "with CUDA" : "CPU only, no nvcc when it was built",
            FG_DEFAULT_OFFLOAD_DIR, fg_pipe_compiled() ? "with MPI" : "without MPI, no mpicc when it was built");
}

static int parse_int(const char *flag, const char *s, int min, int max, int *out, char *err) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || *s == 0 || *end || v < min || v > max)
        return fg_fail(err, "%s: expected an integer in %d..%d, got '%s'", flag, min, max, s ? s : "");
    *out = (int)v;
    return 0;
}

static int parse_float(const char *flag, const char *s, double lo, double hi, float *out,
                       char *err) {
    char *end;
    errno = 0;
    double v = s ? strtod(s, &end) : 0;
    if (!s || errno || *s == 0 || *end || !(v >= lo && v <= hi))
        return fg_fail(err, "%s: expected a number in [%g, %g], got '%s'", flag, lo, hi, s ? s : "");
    *out = (float)v;
    return 0;
}

/* "16G", "512M", "1.5G", "4096": K, M, G, T are powers of 1024; a trailing B is allowed. */
static int parse_size(const char *flag, const char *s, double *out, char *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    const char *units = "KMGT";
    const char *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
    if (u) v *= pow(1024, (double)(u - units + 1)), end++;
    if (*end == 'B' || *end == 'b') end++;
    if (errno || end == s || *end || !(v > 0) || v > 1e18)
        return fg_fail(err, "%s: expected a size such as 16G or 512M, got '%s'", flag, s);
    *out = v;
    return 0;
}

static int parse_device(const char *s, fg_device *d, char *err) {
    if (!strcmp(s, "auto")) *d = FG_DEVICE_AUTO;
    else if (!strcmp(s, "cpu")) *d = FG_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) *d = FG_DEVICE_CUDA;
    else return fg_fail(err, "--device: expected cuda, cpu or auto, got '%s'", s);
    return 0;
}

/* auto: CUDA when a GPU is there, else the CPU, saying why (with progress on, and when this
 * build has CUDA; the report names the device either way). */
static fg_device resolve_device(fg_device d, int verbose) {
    char why[FG_ERR_LEN];
    if (d != FG_DEVICE_AUTO) return d;
    if (fg_cuda_backend(why)) return FG_DEVICE_CUDA;
    if (verbose && fg_cuda_compiled()) fprintf(stderr, "flexgen: %s; running on the CPU backend\n", why);
    return FG_DEVICE_CPU;
}

static int is_value_flag(const char *f) {
    static const char *const flags[] = {"--model", "--prompt", "--prompt-file", "--prompt-ids",
        "--dump-logits", "--vocab", "--merges", "--prompt-len", "--gen-len", "--gpu-batch-size",
        "--num-gpu-batches", "--temperature", "--top-p", "--seed", "--overlap", "--pin-weight",
        "--gpu-mem", "--cpu-mem", "--disk-mem", "--offload-dir", "--path", "--trace", "--attn-sparsity",
        "--policy", "--hw", "--max-latency", "--device"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (!strcmp(f, flags[i])) return 1;
    return 0;
}

static int parse_args(int argc, char **argv, cli_args *a, char *err) {
    memset(a, 0, sizeof *a);
    a->model = "opt-125m";
    a->prompt_len = 512;
    a->gen = (gen_options){.gen_len = 32, .temperature = 0, .top_p = 1, .seed = 0, .verbose = isatty(2)};
    a->policy = fg_default_policy();
    a->policy.device = FG_DEVICE_AUTO;
    a->prompts = calloc((size_t)argc, sizeof *a->prompts);
    if (!a->prompts) return fg_fail(err, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes_value = 1, rc = 0, seed;
        fg_policy *p = &a->policy;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) return 1;
        else if (!strcmp(f, "--json")) a->json = 1, takes_value = 0;
        else if (!strcmp(f, "--stop-at-eos")) a->gen.stop_at_eos = 1, takes_value = 0;
        else if (!strcmp(f, "--quiet")) a->gen.verbose = 0, takes_value = 0;
        else if (!strcmp(f, "--cpu-cache-compute")) p->cpu_cache_compute = 1, takes_value = 0;
        else if (!strcmp(f, "--compress-weight")) p->compress_weight = 1, takes_value = 0;
        else if (!strcmp(f, "--compress-cache")) p->compress_cache = 1, takes_value = 0;
        else if (!strcmp(f, "--evaluate")) a->evaluate = 1, takes_value = 0;
        else if (!strcmp(f, "--percent")) {
            for (int j = 0; j < 6 && rc == 0; j++)
                rc = parse_int(f, i + 1 + j < argc ? argv[i + 1 + j] : NULL, 0, 100, &p->percent[j], err);
            if (rc) return fg_fail(err, "--percent: expected six integers in 0..100 (wg wc cg cc hg hc)");
            takes_value = 6;
        }
        else if (!is_value_flag(f)) return fg_fail(err, "%s: unknown option (see --help)", f);
        else if (!v) return fg_fail(err, "%s: missing value", f);
        else if (!strcmp(f, "--model")) a->model = v;
        else if (!strcmp(f, "--prompt")) a->prompts[a->n_prompt_texts++] = v;
        else if (!strcmp(f, "--prompt-file")) a->prompt_file = v;
        else if (!strcmp(f, "--prompt-ids")) a->prompt_ids = v;
        else if (!strcmp(f, "--dump-logits")) a->dump_logits = v;
        else if (!strcmp(f, "--trace")) a->trace = v, p->trace = 1;
        else if (!strcmp(f, "--vocab")) a->vocab = v;
        else if (!strcmp(f, "--merges")) a->merges = v;
        else if (!strcmp(f, "--offload-dir")) p->offload_dir = v;
        else if (!strcmp(f, "--device")) rc = parse_device(v, &p->device, err);
        else if (!strcmp(f, "--path")) p->weight_dir = v;
        else if (!strcmp(f, "--prompt-len")) rc = parse_int(f, v, 1, INT_MAX, &a->prompt_len, err);
        else if (!strcmp(f, "--gen-len")) rc = parse_int(f, v, 1, INT_MAX, &a->gen.gen_len, err);
        else if (!strcmp(f, "--gpu-batch-size")) rc = parse_int(f, v, 1, INT_MAX, &p->gpu_batch_size, err);
        else if (!strcmp(f, "--num-gpu-batches")) rc = parse_int(f, v, 1, INT_MAX, &p->num_gpu_batches, err);
        else if (!strcmp(f, "--overlap")) rc = parse_int(f, v, 0, 1, &p->overlap, err);
        else if (!strcmp(f, "--pin-weight")) rc = parse_int(f, v, 0, 1, &p->pin_weight, err);
        else if (!strcmp(f, "--gpu-mem")) rc = parse_size(f, v, &p->capacity[TIER_GPU], err);
        else if (!strcmp(f, "--cpu-mem")) rc = parse_size(f, v, &p->capacity[TIER_CPU], err);
        else if (!strcmp(f, "--disk-mem")) rc = parse_size(f, v, &p->capacity[TIER_DISK], err);
        else if (!strcmp(f, "--temperature")) rc = parse_float(f, v, 0, 1e6, &a->gen.temperature, err);
        else if (!strcmp(f, "--top-p")) rc = parse_float(f, v, 1e-9, 1, &a->gen.top_p, err);
        else if (!strcmp(f, "--attn-sparsity")) {
            rc = parse_float(f, v, 0, 1, &p->attn_sparsity, err);
            if (rc == 0 && !(p->attn_sparsity > 0))
                rc = fg_fail(err, "--attn-sparsity: expected a fraction in (0, 1], got '%s'", v);
        }
        else if (!strcmp(f, "--seed")) { rc = parse_int(f, v, 0, INT_MAX, &seed, err); a->gen.seed = (uint64_t)seed; }
        else if (!strcmp(f, "--hw")) a->hw = v;
        else if (!strcmp(f, "--policy")) {
            if (strcmp(v, "auto") && strcmp(v, "manual"))
                rc = fg_fail(err, "--policy: expected auto or manual, got '%s'", v);
            a->auto_policy = !strcmp(v, "auto");
        }
        else if (!strcmp(f, "--max-latency")) {
            float lat;
            rc = parse_float(f, v, 0, 1e9, &lat, err);
            if (rc == 0 && !(lat > 0)) rc = fg_fail(err, "--max-latency: expected seconds > 0, got '%s'", v);
            a->max_latency = lat;
        }
        if (rc) return -1;
        i += takes_value;
    }
    a->policy.verbose = a->gen.verbose;
    if ((a->prompt_file != NULL) + (a->prompt_ids != NULL) + (a->n_prompt_texts > 0) > 1)
        return fg_fail(err, "--prompt, --prompt-file and --prompt-ids: give only one of them");
    if ((long)a->policy.gpu_batch_size * a->policy.num_gpu_batches > 1 << 20)
        return fg_fail(err, "--gpu-batch-size x --num-gpu-batches: block of %ld sequences is too large",
                    (long)a->policy.gpu_batch_size * a->policy.num_gpu_batches);
    return 0;
}

/* ---- prompts ---- */

typedef struct {
    int n, cap;
    int **ids;
    int *lens;
} prompt_set;

static void prompts_free(prompt_set *p) {
    for (int i = 0; i < p->n; i++) free(p->ids[i]);
    free(p->ids);
    free(p->lens);
    memset(p, 0, sizeof *p);
}

static int prompts_add(prompt_set *p, int *ids, int len, char *err) {
    if (p->n == p->cap) {
        int cap = p->cap * 2 + 8;
        int **ni = realloc(p->ids, (size_t)cap * sizeof *ni);
        if (ni) p->ids = ni;
        int *nl = ni ? realloc(p->lens, (size_t)cap * sizeof *nl) : NULL;
        if (!nl) { free(ids); return fg_fail(err, "out of memory"); }
        p->lens = nl;
        p->cap = cap;
    }
    p->ids[p->n] = ids;
    p->lens[p->n++] = len;
    return 0;
}

/* BOS + the text's tokens. */
static int add_text_prompt(prompt_set *p, const fg_tokenizer *tok, const char *text, size_t len,
                           char *err) {
    int *ids, n;
    if (tokenizer_encode(tok, text, len, &ids, &n, err)) return -1;
    int *with_bos = malloc((size_t)(n + 1) * sizeof *with_bos);
    if (!with_bos) { free(ids); return fg_fail(err, "out of memory"); }
    with_bos[0] = OPT_BOS_ID;
    memcpy(with_bos + 1, ids, (size_t)n * sizeof *ids);
    free(ids);
    return prompts_add(p, with_bos, n + 1, err);
}

static int parse_id_line(const char *path, int line_no, char *line, int vocab, int **out, int *n,
                         char *err) {
    int cap = 16, count = 0, *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return fg_fail(err, "out of memory");
    for (char *s = line, *end;; s = end) {
        while (*s == ' ' || *s == '\t' || *s == '\r') s++;
        if (!*s) break;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || (*end && *end != ' ' && *end != '\t' && *end != '\r')) {
            free(ids);
            return fg_fail(err, "%s line %d: not a token id: '%.20s'", path, line_no, s);
        }
        if (v < 0 || v >= vocab) {
            free(ids);
            return fg_fail(err, "%s line %d: token id %ld out of range [0, %d)", path, line_no, v, vocab);
        }
        if (count == cap) {
            int *grown = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!grown) { free(ids); return fg_fail(err, "out of memory"); }
            ids = grown;
        }
        ids[count++] = (int)v;
    }
    if (count == 0) {
        free(ids);
        return fg_fail(err, "%s line %d: empty prompt", path, line_no);
    }
    *out = ids;
    *n = count;
    return 0;
}

/* Reads one prompt a line from path: token ids (tok == NULL) or text. */
static int read_prompt_lines(prompt_set *p, const char *path, const fg_tokenizer *tok, int vocab,
                             char *err) {
    FILE *f = fopen(path, "r");
    if (!f) return fg_fail(err, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int line_no = 0, rc = 0;
    while (rc == 0 && (len = getline(&line, &cap, f)) >= 0) {
        line_no++;
        if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
        if (tok) {
            rc = add_text_prompt(p, tok, line, (size_t)len, err);
        } else {
            int *ids = NULL, n = 0;
            rc = parse_id_line(path, line_no, line, vocab, &ids, &n, err);
            if (rc == 0) rc = prompts_add(p, ids, n, err);
        }
    }
    free(line);
    fclose(f);
    if (rc == 0 && p->n == 0) rc = fg_fail(err, "%s: no prompts in the file", path);
    return rc;
}

/* FlexGen's benchmark prompts: BOS and prompt_len - 1 pseudo-random ids, one block's worth for
 * each stage (a pipeline keeps that many micro-batches in flight, §4.4). */
static int synthetic_prompts(prompt_set *p, const cli_args *a, int stages, int vocab, char *err) {
    fg_rng rng;
    rng_seed(&rng, a->gen.seed ^ 0x5eedULL);
    int n = a->policy.gpu_batch_size * a->policy.num_gpu_batches * stages;
    for (int i = 0; i < n; i++) {
        int *ids = malloc((size_t)a->prompt_len * sizeof *ids);
        if (!ids) return fg_fail(err, "out of memory");
        ids[0] = OPT_BOS_ID;
        for (int t = 1; t < a->prompt_len; t++) ids[t] = 3 + (int)(rng_next(&rng) % (uint64_t)(vocab - 3));
        if (prompts_add(p, ids, a->prompt_len, err)) return -1;
    }
    return 0;
}

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

/* The tokenizer from --vocab/--merges or the model directory; NULL (no error) when there is
 * none and none is needed. */
static int open_tokenizer(const cli_args *a, fg_tokenizer **tok, char *err) {
    char vocab[4096], merges[4096];
    *tok = NULL;
    if (!a->vocab != !a->merges) return fg_fail(err, "--vocab and --merges go together");
    if (a->vocab) {
        snprintf(vocab, sizeof vocab, "%s", a->vocab);
        snprintf(merges, sizeof merges, "%s", a->merges);
    } else {
        if (!is_dir(a->model)) return 0;
        snprintf(vocab, sizeof vocab, "%s/vocab.json", a->model);
        snprintf(merges, sizeof merges, "%s/merges.txt", a->model);
        if (!file_exists(vocab) || !file_exists(merges)) return 0;
    }
    *tok = tokenizer_load(vocab, merges, err);
    return *tok ? 0 : -1;
}

static int gather_prompts(const cli_args *a, const fg_tokenizer *tok, int vocab, prompt_set *p,
                          char *err) {
    if ((a->n_prompt_texts || a->prompt_file) && !tok)
        return fg_fail(err, "%s needs a tokenizer: give --vocab and --merges, or a model directory "
                         "holding vocab.json and merges.txt", a->prompt_file ? "--prompt-file" : "--prompt");
    if (a->prompt_ids) return read_prompt_lines(p, a->prompt_ids, NULL, vocab, err);
    if (a->prompt_file) return read_prompt_lines(p, a->prompt_file, tok, vocab, err);
    for (int i = 0; i < a->n_prompt_texts; i++)
        if (add_text_prompt(p, tok, a->prompts[i], strlen(a->prompts[i]), err)) return -1;
    return 0;
}

/* ---- output ---- */

/* What each stage of a pipeline tells rank 0 for the report (§4.4). */
typedef struct {
    int first_layer, end_layer, percent[6];
    fg_stats st;
    double sent, compute, bubble, disk_read, peak_rss;
} stage_report;

/* Writes to a temporary name and renames, so a failed run never leaves a partial file. */
static int dump_logits(const char *path, const float *logits, size_t n, char *err) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp-XXXXXX", path);
    int fd = mkstemp(tmp);
    if (fd < 0) return fg_fail(err, "--dump-logits %s: %s", path, strerror(errno));
    FILE *f = fdopen(fd, "wb");
    int ok = f && fwrite(logits, sizeof(float), n, f) == n;
    ok = (f ? fclose(f) == 0 : (close(fd), 0)) && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return fg_fail(err, "--dump-logits %s: write failed: %s", path, strerror(e));
    }
    return 0;
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if it is not one (Unicode's "maximal
 * subpart" rule, which Python's errors="replace" follows: *bad is how many bytes one U+FFFD
 * replaces). */
static int utf8_sequence(const unsigned char *s, size_t n, int *bad) {
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    int need = c >= 0xc2 && c <= 0xdf ? 1 : c >= 0xe0 && c <= 0xef ? 2 : c >= 0xf0 && c <= 0xf4 ? 3 : 0;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
    int k = 0;
    while (k < need && (size_t)k + 1 < n && s[k + 1] >= (k ? 0x80 : lo) && s[k + 1] <= (k ? 0xbf : hi)) k++;
    *bad = k + 1;
    return need && k == need ? need + 1 : 0;
}

/* Writes decoded bytes as text: invalid UTF-8 (a token can end mid-character) becomes U+FFFD,
 * as in HF's tokenizer.decode. */
static void print_utf8(const char *text, size_t len) {
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        int bad, ok = s[i] < 0x80 ? 1 : utf8_sequence(s + i, len - i, &bad);
        if (ok) fwrite(s + i, 1, (size_t)ok, stdout), i += (size_t)ok;
        else fputs("\xef\xbf\xbd", stdout), i += (size_t)bad;
    }
}

/* "[i] prompt + generated text" for each prompt; with --stop-at-eos the text ends before </s>. */
static void print_texts(const fg_tokenizer *tok, const prompt_set *p, const int *tokens,
                        const gen_options *opt) {
    for (int i = 0; i < p->n; i++) {
        int skip = p->ids[i][0] == OPT_BOS_ID, n = 0;
        const int *gen = tokens + (size_t)i * opt->gen_len;
        while (n < opt->gen_len && !(opt->stop_at_eos && gen[n] == OPT_EOS_ID)) n++;
        size_t prompt_len, text_len;
        char *prompt = tokenizer_decode(tok, p->ids[i] + skip, p->lens[i] - skip, &prompt_len);
        char *text = tokenizer_decode(tok, gen, n, &text_len);
        printf("[%d] ", i + 1);
        if (prompt) print_utf8(prompt, prompt_len);
        if (text) print_utf8(text, text_len);
        printf("\n");
        free(prompt);
        free(text);
    }
}

static double peak_rss_bytes(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss * 1024.0;
}

/* FlexGen's numbers (flexgen/utils.py): sizes for the padded prompt + gen_len, throughputs per
 * generated (decode) or processed (prefill) token; then the tiers' peaks and the links' bytes. */
/* The report's per-stage entries (--json): the layers, the policy, peaks, bytes sent, times. */
static cJSON *stages_json(const stage_report *stages, int n) {
    cJSON *list = cJSON_CreateArray();
    for (int r = 0; r < n; r++) {
        const stage_report *s = &stages[r];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "first_layer", s->first_layer);
        cJSON_AddNumberToObject(o, "end_layer", s->end_layer);
        cJSON_AddItemToObject(o, "percent", cJSON_CreateIntArray(s->percent, 6));
        for (int i = 0; i < N_TIERS; i++) {
            char key[64];
            snprintf(key, sizeof key, "peak_%s_bytes", fg_tier_names[i]);
            cJSON_AddNumberToObject(o, key, s->st.peak[i]);
        }
        cJSON_AddNumberToObject(o, "bytes_sent", s->sent);
        cJSON_AddNumberToObject(o, "compute_seconds", s->compute);
        cJSON_AddNumberToObject(o, "bubble_seconds", s->bubble);
        cJSON_AddNumberToObject(o, "disk_read_seconds", s->disk_read);
        cJSON_AddNumberToObject(o, "peak_rss_bytes", s->peak_rss);
        cJSON_AddItemToArray(list, o);
    }
    return list;
}

static void report(const cli_args *a, const opt_config *c, const prompt_set *p,
                   const gen_timing *t, const fg_stats *st, int max_prompt, const char *device,
                   const stage_report *stages, int n_stages) {
    const double GiB = 1 << 30;
    int seq = max_prompt + a->gen.gen_len;
    double model = opt_model_bytes(c), cache = opt_cache_bytes(c, p->n, seq);
    double hidden = opt_hidden_bytes(c, p->n, seq), total = t->prefill_latency + t->decode_latency;
    double prefill_tp = t->prefill_tokens / fmax(t->prefill_latency, 1e-10);
    double decode_tp = t->decode_tokens / fmax(t->decode_latency, 1e-10);
    double total_tp = (double)p->n * a->gen.gen_len / fmax(total, 1e-10);
    static const char *const link_keys[N_LINKS] = {"disk_to_cpu_bytes", "cpu_to_gpu_bytes",
                                                   "gpu_to_cpu_bytes", "cpu_to_disk_bytes"};
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", c->name);
        cJSON_AddStringToObject(o, "device", device);
        cJSON_AddNumberToObject(o, "num_prompts", p->n);
        cJSON_AddNumberToObject(o, "prompt_len", max_prompt);
        cJSON_AddNumberToObject(o, "gen_len", a->gen.gen_len);
        cJSON_AddNumberToObject(o, "gpu_batch_size", a->policy.gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", a->policy.num_gpu_batches);
        cJSON_AddItemToObject(o, "percent", cJSON_CreateIntArray(a->policy.percent, 6));
        cJSON_AddBoolToObject(o, "overlap", a->policy.overlap);
        cJSON_AddBoolToObject(o, "cpu_cache_compute", a->policy.cpu_cache_compute);
        cJSON_AddBoolToObject(o, "compress_weight", a->policy.compress_weight);
        cJSON_AddBoolToObject(o, "compress_cache", a->policy.compress_cache);
        cJSON_AddNumberToObject(o, "attn_sparsity", a->policy.attn_sparsity);
        cJSON_AddNumberToObject(o, "model_size_bytes", model);
        cJSON_AddNumberToObject(o, "cache_size_bytes", cache);
        cJSON_AddNumberToObject(o, "hidden_size_bytes", hidden);
        cJSON_AddNumberToObject(o, "peak_rss_bytes", peak_rss_bytes());
        for (int i = 0; i < N_TIERS; i++) {
            char key[64];
            snprintf(key, sizeof key, "peak_%s_bytes", fg_tier_names[i]);
            cJSON_AddNumberToObject(o, key, st->peak[i]);
            snprintf(key, sizeof key, "capacity_%s_bytes", fg_tier_names[i]);
            cJSON_AddNumberToObject(o, key, st->capacity[i]);
        }
        for (int i = 0; i < N_LINKS; i++) cJSON_AddNumberToObject(o, link_keys[i], st->link_bytes[i]);
        cJSON_AddNumberToObject(o, "compute_seconds", t->compute_seconds);
        cJSON_AddNumberToObject(o, "disk_read_seconds", t->disk_read_seconds);
        cJSON_AddNumberToObject(o, "prefill_latency", t->prefill_latency);
        cJSON_AddNumberToObject(o, "prefill_throughput", prefill_tp);
        cJSON_AddNumberToObject(o, "decode_latency", t->decode_latency);
        cJSON_AddNumberToObject(o, "decode_throughput", decode_tp);
        cJSON_AddNumberToObject(o, "total_latency", total);
        cJSON_AddNumberToObject(o, "total_throughput", total_tp);
        if (n_stages > 1) cJSON_AddItemToObject(o, "stages", stages_json(stages, n_stages));
        char *s = cJSON_PrintUnformatted(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
        return;
    }
    printf("model size: %.3f GB\tcache size: %.3f GB\thidden size (p): %.3f GB\n", model / GiB,
           cache / GiB, hidden / GiB);
    printf("peak gpu mem: %.3f GB\tprojected: False\n", st->peak[TIER_GPU] / GiB);
    printf("prefill latency: %.3f s\tprefill throughput: %.3f token/s\n", t->prefill_latency, prefill_tp);
    printf("decode latency: %.3f s\tdecode throughput: %.3f token/s\n", t->decode_latency, decode_tp);
    printf("total latency: %.3f s\ttotal throughput: %.3f token/s\n", total, total_tp);
    printf("peak tiers: gpu %.3f GB\tcpu %.3f GB\tdisk %.3f GB\n", st->peak[TIER_GPU] / GiB,
           st->peak[TIER_CPU] / GiB, st->peak[TIER_DISK] / GiB);
    printf("moved: disk->cpu %.3f GB\tcpu->gpu %.3f GB\tgpu->cpu %.3f GB\tcpu->disk %.3f GB\n",
           st->link_bytes[LINK_DISK_TO_CPU] / GiB, st->link_bytes[LINK_CPU_TO_GPU] / GiB,
           st->link_bytes[LINK_GPU_TO_CPU] / GiB, st->link_bytes[LINK_CPU_TO_DISK] / GiB);
    printf("compute: %.3f s\tdisk reads: %.3f s\tdevice: %s\n", t->compute_seconds,
           t->disk_read_seconds, device);
    for (int r = 0; n_stages > 1 && r < n_stages; r++) {
        const stage_report *s = &stages[r];
        printf("stage %d/%d (layers %d-%d): peak gpu %.3f GB\tcpu %.3f GB\tdisk %.3f GB\t"
               "sent %.3f GB\tcompute %.3f s\tbubble %.3f s\n", r + 1, n_stages, s->first_layer,
               s->end_layer - 1, s->st.peak[TIER_GPU] / GiB, s->st.peak[TIER_CPU] / GiB,
               s->st.peak[TIER_DISK] / GiB, s->sent / GiB, s->compute, s->bubble);
    }
}

/* The configuration of --model without opening its weights. */
static int model_config(const char *model, opt_config *cfg, char *err) {
    if (!is_dir(model)) return opt_config_by_name(model, cfg, err);
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", model);
    if (opt_config_from_json(path, cfg, err)) return -1;
    snprintf(cfg->name, sizeof cfg->name, "%s", model);
    return 0;
}

/* The default hardware file, ~/.cache/flexgen/hardware.json, its directory made if need be. */
static int default_hw_file(char *path, size_t n, char *err) {
    char dir[4096];
    default_weight_dir(dir, sizeof dir);
    if (mkdir_p(dir)) return fg_fail(err, "%s: cannot create: %s", dir, strerror(errno));
    snprintf(path, n, "%s/hardware.json", dir);
    return 0;
}

/* --hw FILE, or the default hardware file, measuring this machine once when there is none. */
static int load_hardware(const cli_args *a, fg_hardware *hw, char *err) {
    if (a->hw) return fg_hardware_read(a->hw, hw, err);
    char path[4200];
    if (default_hw_file(path, sizeof path, err)) return -1;
    if (file_exists(path)) return fg_hardware_read(path, hw, err);
    const char *offload = a->policy.offload_dir ? a->policy.offload_dir : FG_DEFAULT_OFFLOAD_DIR;
    fprintf(stderr, "flexgen: no hardware file yet: profiling this machine once (about 15 s), "
                    "saved to %s\n", path);
    if (fg_profile(offload, a->policy.device, hw, 1, err)) return -1;
    return fg_hardware_write(path, hw, err);
}

static int longest_prompt(const prompt_set *p) {
    int longest = 0;
    for (int i = 0; i < p->n; i++) longest = p->lens[i] > longest ? p->lens[i] : longest;
    return longest;
}

/* The policy search's request for this command line: n_prompts given (0: synthetic, any
 * block), the longest of them (0: --prompt-len). */
static int search_policy(const cli_args *a, const fg_hardware *hw, const opt_config *cfg,
                         int n_prompts, int max_prompt, int gbs, int ngb, fg_search_result *res,
                         char *err) {
    fg_search_request req = {.s = max_prompt ? max_prompt : a->prompt_len, .n = a->gen.gen_len,
                             .max_block = n_prompts, .max_latency = a->max_latency,
                             .verify = hw->gpu_is_host, .seed = a->gen.seed, .gbs = gbs, .ngb = ngb};
    if (a->evaluate) return fg_policy_evaluate(cfg, hw, &a->policy, &req, res, err);
    return fg_policy_search(cfg, hw, &a->policy, &req, res, err);
}

static void print_policy_flags(FILE *out, const fg_policy *p) {
    fprintf(out, "--gpu-batch-size %d --num-gpu-batches %d --percent %d %d %d %d %d %d%s",
            p->gpu_batch_size, p->num_gpu_batches, p->percent[0], p->percent[1], p->percent[2],
            p->percent[3], p->percent[4], p->percent[5], p->cpu_cache_compute ? " --cpu-cache-compute" : "");
}

/* ---- a run as one stage of a pipeline (§4.4): rank 0 reads the prompts and reports ---- */

/* Rank 0's prompts on every stage (the first needs the ids, every stage their lengths). */
static int share_prompts(fg_pipe *pipe, prompt_set *p, char *err) {
    int n = p->n, total = 0, rc = 0;
    fg_pipe_bcast(pipe, &n, sizeof n);
    int *lens = fg_pipe_rank(pipe) ? calloc((size_t)n, sizeof *lens) : p->lens;
    if (!lens) return fg_fail(err, "out of memory");
    fg_pipe_bcast(pipe, lens, (size_t)n * sizeof *lens);
    for (int i = 0; i < n; i++) total += lens[i];
    int *flat = malloc((size_t)total * sizeof *flat);
    if (!flat) return fg_fail(err, "out of memory"); /* every rank runs out alike, or aborts */
    for (int i = 0, at = 0; i < p->n; at += lens[i++]) memcpy(flat + at, p->ids[i], (size_t)lens[i] * sizeof *flat);
    fg_pipe_bcast(pipe, flat, (size_t)total * sizeof *flat);
    for (int i = 0, at = 0; fg_pipe_rank(pipe) && i < n && rc == 0; at += lens[i++]) {
        int *ids = malloc((size_t)lens[i] * sizeof *ids);
        if (!ids) rc = fg_fail(err, "out of memory");
        else memcpy(ids, flat + at, (size_t)lens[i] * sizeof *ids), rc = prompts_add(p, ids, lens[i], err);
    }
    if (fg_pipe_rank(pipe)) free(lens);
    free(flat);
    return rc;
}

/* --policy auto: each stage searches for its share of the layers (§4.4); the stages then take
 * the smallest GPU batch and number of GPU batches any of them chose (each fits where the larger
 * did) and place their tensors again for that block shape. */
static int plan_stages(cli_args *a, fg_pipe *pipe, const opt_config *cfg, int n_prompts,
                       int max_prompt, char *err) {
    fg_search_result res;
    fg_hardware hw;
    int rc = 0, n = fg_pipe_size(pipe);
    for (int r = 0; r < n; r++) { /* a machine without a hardware file measures itself once, a stage
                                     at a time: stages sharing a machine must not load each other */
        if (r == fg_pipe_rank(pipe)) rc = load_hardware(a, &hw, err);
        if (fg_pipe_agree(pipe, rc, err)) return -1;
    }
    rc = search_policy(a, &hw, cfg, n_prompts, max_prompt, 0, 0, &res, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    int shape[2] = {res.policy.gpu_batch_size, res.policy.num_gpu_batches};
    int *all = malloc((size_t)n * sizeof shape);
    if (!all) return fg_fail(err, "out of memory");
    fg_pipe_gather(pipe, shape, sizeof shape, all);
    for (int r = 1; fg_pipe_rank(pipe) == 0 && r < n; r++)
        for (int d = 0; d < 2; d++) shape[d] = all[2 * r + d] < shape[d] ? all[2 * r + d] : shape[d];
    free(all);
    fg_pipe_bcast(pipe, shape, sizeof shape);
    if (shape[0] != res.policy.gpu_batch_size || shape[1] != res.policy.num_gpu_batches)
        rc = search_policy(a, &hw, cfg, n_prompts, max_prompt, shape[0], shape[1], &res, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    a->policy = res.policy;
    if (a->gen.verbose) {
        fprintf(stderr, "policy auto: ");
        print_policy_flags(stderr, &a->policy);
        fprintf(stderr, " (predicted %.3f token/s, searched in %.2f s)\n", res.throughput, res.seconds);
    }
    return 0;
}

/* The last stage's logits (--dump-logits) to rank 0, in pieces that fit an MPI message. */
static void gather_logits(fg_pipe *pipe, float *logits, size_t count) {
    int last = fg_pipe_size(pipe) - 1, rank = fg_pipe_rank(pipe);
    if (last == 0 || (rank != 0 && rank != last)) return;
    size_t piece = (size_t)1 << 28; /* floats: 1 GiB */
    for (size_t at = 0; at < count; at += piece) {
        size_t n = count - at < piece ? count - at : piece;
        int msg = rank == 0 ? fg_pipe_recv(pipe, last, TAG_TOKENS + 1, logits + at, n * sizeof *logits)
                            : fg_pipe_send(pipe, 0, TAG_TOKENS + 1, logits + at, n * sizeof *logits);
        fg_pipe_release(pipe, msg);
    }
}

/* Rank 0's view of the whole job: peaks and bytes moved summed over the stages, the busiest
 * stage's compute and disk times. */
static void combine_stages(const stage_report *all, int n, fg_stats *st, gen_timing *t) {
    *st = all[0].st;
    for (int r = 1; r < n; r++) {
        for (int i = 0; i < N_TIERS; i++)
            st->peak[i] += all[r].st.peak[i], st->capacity[i] += all[r].st.capacity[i];
        for (int i = 0; i < N_LINKS; i++) st->link_bytes[i] += all[r].st.link_bytes[i];
    }
    for (int r = 0; r < n; r++) {
        t->compute_seconds = fmax(t->compute_seconds, all[r].compute);
        t->disk_read_seconds = fmax(t->disk_read_seconds, all[r].disk_read);
    }
}

/* The flags of the job, which every stage must share, against rank 0's; what rank 0 alone
 * writes (--dump-logits, --trace, --json) is taken from it. */
typedef struct {
    char model[256];
    int gen_len, stop_at_eos, prompt_len, gbs, ngb, auto_policy, dump, trace;
    float temperature, top_p;
    uint64_t seed;
} job_flags;

static int share_job(cli_args *a, fg_pipe *pipe, char *err) {
    job_flags mine = {.gen_len = a->gen.gen_len, .stop_at_eos = a->gen.stop_at_eos,
                      .prompt_len = a->prompt_len, .gbs = a->policy.gpu_batch_size,
                      .ngb = a->policy.num_gpu_batches, .auto_policy = a->auto_policy,
                      .dump = a->dump_logits != NULL, .trace = a->trace != NULL,
                      .temperature = a->gen.temperature, .top_p = a->gen.top_p, .seed = a->gen.seed};
    snprintf(mine.model, sizeof mine.model, "%s", a->model);
    job_flags job = mine;
    fg_pipe_bcast(pipe, &job, sizeof job);
    if (fg_pipe_rank(pipe)) { /* rank 0 writes them; the others send it what they need */
        a->dump_logits = job.dump ? "(rank 0's)" : NULL;
        a->trace = job.trace ? "(rank 0's)" : NULL;
        a->policy.trace = job.trace;
    }
    const char *differs = strcmp(job.model, mine.model) ? "--model"
        : job.gen_len != mine.gen_len ? "--gen-len" : job.stop_at_eos != mine.stop_at_eos ? "--stop-at-eos"
        : job.prompt_len != mine.prompt_len ? "--prompt-len" : job.seed != mine.seed ? "--seed"
        : job.temperature != mine.temperature ? "--temperature" : job.top_p != mine.top_p ? "--top-p"
        : job.auto_policy != mine.auto_policy ? "--policy"
        : !job.auto_policy && job.gbs != mine.gbs ? "--gpu-batch-size"
        : !job.auto_policy && job.ngb != mine.ngb ? "--num-gpu-batches" : NULL;
    if (differs) return fg_fail(err, "%s differs from rank 0's: the stages of a pipeline share it", differs);
    return 0;
}

/* The prompts of the job on every stage: read (and tokenized) by rank 0, or synthetic ones to
 * fill the block that --policy auto chooses for each stage. */
static int job_prompts(cli_args *a, fg_pipe *pipe, const opt_config *cfg, fg_tokenizer **tok,
                       prompt_set *p, char *err) {
    int rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe), rc = 0;
    if (rank == 0 && (open_tokenizer(a, tok, err) || gather_prompts(a, *tok, cfg->vocab, p, err))) rc = -1;
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    int given[2] = {p->n, longest_prompt(p)}; /* n 0: synthetic prompts, once the block is known */
    fg_pipe_bcast(pipe, given, sizeof given);
    if (a->auto_policy &&
        plan_stages(a, pipe, cfg, given[0] ? (given[0] + stages - 1) / stages : 0, given[1], err))
        return -1;
    if (rank == 0 && p->n == 0) rc = synthetic_prompts(p, a, stages, cfg->vocab, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    return share_prompts(pipe, p, err);
}

/* This stage's runtime and model, its plan checked, its weights in their homes. */
static int open_stage(cli_args *a, fg_pipe *pipe, const prompt_set *p, fg_runtime **rt,
                      fg_model **m, char *err) {
    int rc = fg_runtime_open(&a->policy, rt, err);
    if (rc == 0) fg_runtime_set_pipe(*rt, pipe), rc = fg_model_open(*rt, a->model, a->gen.seed, m, err);
    if (rc == 0) rc = check_prompts(fg_model_config(*m), p->n, p->ids, p->lens, a->gen.gen_len, err);
    if (rc == 0) rc = fg_check_plan(*m, p->n, longest_prompt(p), a->gen.gen_len, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    if (a->gen.verbose) fprintf(stderr, "%s: placing weights\n", fg_model_config(*m)->name);
    for (int r = 0; r < fg_pipe_size(pipe); r++) { /* a stage at a time: stages that share a machine
                                                      share its dummy-weight file, the first writes it */
        if (r == fg_pipe_rank(pipe)) rc = fg_model_load(*m, err);
        if (fg_pipe_agree(pipe, rc, err)) return -1;
    }
    return 0;
}

/* After the run: every stage's numbers and trace to rank 0, which writes the outputs and the
 * report. */
static int finish_job(const cli_args *a, fg_pipe *pipe, const fg_runtime *rt, const opt_config *cfg,
                      const prompt_set *p, const fg_tokenizer *tok, const int *tokens, float *logits,
                      gen_timing *t, stage_report *all, char *err) {
    int rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe);
    size_t n_logits = (size_t)p->n * a->gen.gen_len * cfg->vocab;
    gather_logits(pipe, logits, logits ? n_logits : 0);
    stage_report mine = {.sent = fg_pipe_bytes_sent(pipe), .compute = t->compute_seconds,
                         .bubble = t->bubble_seconds, .disk_read = t->disk_read_seconds,
                         .peak_rss = peak_rss_bytes()};
    fg_runtime_stats(rt, &mine.st);
    fg_stage_layers(cfg, rank, stages, &mine.first_layer, &mine.end_layer);
    memcpy(mine.percent, a->policy.percent, sizeof mine.percent);
    fg_pipe_gather(pipe, &mine, sizeof mine, all);
    char *events = a->trace ? trace_events(rt, rank, stages) : NULL;
    char *trace = a->trace ? fg_pipe_gather_text(pipe, events ? events : "") : NULL;
    free(events);
    int rc = 0;
    if (rank == 0) {
        if (a->dump_logits) rc = dump_logits(a->dump_logits, logits, n_logits, err);
        if (rc == 0 && a->trace) rc = write_trace(a->trace, trace, err);
        if (rc == 0 && tok && !a->json) print_texts(tok, p, tokens, &a->gen);
        fg_stats st;
        t->compute_seconds = t->disk_read_seconds = 0;
        combine_stages(all, stages, &st, t);
        if (rc == 0) report(a, cfg, p, t, &st, longest_prompt(p), fg_runtime_backend(rt)->name, all, stages);
    }
    free(trace);
    return rc;
}

/* A run: one process, or (under mpirun) one pipeline stage of the job (§4.4). */
static int run(cli_args *a, fg_pipe *pipe, char *err) {
    fg_tokenizer *tok = NULL;
    prompt_set p = {0};
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    int *tokens = NULL, rc = 0, rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe);
    float *logits = NULL;
    stage_report *all = NULL;
    gen_timing t;
    opt_config cfg;
    a->policy.stage = rank, a->policy.n_stages = stages;
    if (rank) a->gen.verbose = a->policy.verbose = 0; /* rank 0 speaks for the job */
    if (a->evaluate) rc = fg_fail(err, "--evaluate: a flag of `flexgen policy`");
    if (rc == 0 && pipe) rc = share_job(a, pipe, err);
    if (rc == 0) {
        a->policy.device = resolve_device(a->policy.device, a->gen.verbose);
        rc = model_config(a->model, &cfg, err);
    }
    if (fg_pipe_agree(pipe, rc, err) || job_prompts(a, pipe, &cfg, &tok, &p, err) ||
        open_stage(a, pipe, &p, &rt, &m, err)) {
        rc = -1;
        goto out;
    }
    int keeps_logits = a->dump_logits && (rank == 0 || rank == stages - 1);
    tokens = malloc((size_t)p.n * a->gen.gen_len * sizeof *tokens);
    if (keeps_logits) logits = malloc((size_t)p.n * a->gen.gen_len * cfg.vocab * sizeof *logits);
    all = calloc((size_t)stages, sizeof *all);
    rc = !tokens || (keeps_logits && !logits) || !all ? fg_fail(err, "out of memory") : 0;
    if (fg_pipe_agree(pipe, rc, err) || generate(m, &a->gen, p.n, p.ids, p.lens, tokens, logits, &t, err)) {
        rc = -1;
        goto out;
    }
    rc = finish_job(a, pipe, rt, fg_model_config(m), &p, tok, tokens, logits, &t, all, err);
out:
    fg_model_close(m);
    fg_runtime_close(rt);
    prompts_free(&p);
    if (tok) tokenizer_free(tok);
    free(tokens);
    free(logits);
    free(all);
    return rc;
}

/* flexgen policy: the search's choice, its prediction and the terms that bound it. */
static int policy_command(cli_args *a, char *err) {
    opt_config cfg;
    fg_search_result r;
    fg_tokenizer *tok = NULL;
    prompt_set prompts = {0};
    int rc = model_config(a->model, &cfg, err);
    if (rc == 0) rc = open_tokenizer(a, &tok, err);
    if (rc == 0) rc = gather_prompts(a, tok, cfg.vocab, &prompts, err); /* given ones bound the block */
    fg_hardware hw;
    if (rc == 0) rc = load_hardware(a, &hw, err);
    if (rc == 0) rc = search_policy(a, &hw, &cfg, prompts.n, longest_prompt(&prompts), 0, 0, &r, err);
    prompts_free(&prompts);
    if (tok) tokenizer_free(tok);
    if (rc) return -1;
    const fg_policy *p = &r.policy;
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "gpu_batch_size", p->gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", p->num_gpu_batches);
        cJSON_AddItemToObject(o, "percent", cJSON_CreateIntArray(p->percent, 6));
        cJSON_AddBoolToObject(o, "cpu_cache_compute", p->cpu_cache_compute);
        cJSON_AddNumberToObject(o, "predicted_throughput", r.throughput);
        cJSON_AddNumberToObject(o, "block_latency", r.block_latency);
        cJSON_AddNumberToObject(o, "t_pre", r.t_pre);
        cJSON_AddNumberToObject(o, "t_gen", r.t_gen);
        cJSON_AddItemToObject(o, "placement", cJSON_CreateDoubleArray(r.x, N_X));
        cJSON_AddNumberToObject(o, "search_seconds", r.seconds);
        cJSON_AddNumberToObject(o, "lps", r.lps);
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        return 0;
    }
    printf("policy: ");
    print_policy_flags(stdout, p);
    printf("\npredicted: %.4g token/s, a block of %d sequences in %.4g s\n", r.throughput,
           p->gpu_batch_size * p->num_gpu_batches, r.block_latency);
    printf("placement (gpu/cpu/disk %%): weights %.0f/%.0f/%.0f  cache %.0f/%.0f/%.0f  "
           "activations %.0f/%.0f/%.0f\n", 100 * r.x[0], 100 * r.x[1], 100 * r.x[2], 100 * r.x[3],
           100 * r.x[4], 100 * r.x[5], 100 * r.x[6], 100 * r.x[7], 100 * r.x[8]);
    printf("per layer (s)");
    for (int i = 0; i < N_TERMS; i++) printf("%11s", fg_cost_term_names[i]);
    printf("   bound\n");
    for (int phase = 0; phase < 2; phase++) {
        const fg_linear *terms = phase ? r.cost.gen : r.cost.pre;
        int arg = 0;
        printf("%-13s", phase ? "decode" : "prefill");
        for (int i = 0; i < N_TERMS; i++) {
            double v = fg_linear_eval(&terms[i], r.x);
            printf("%11.4g", v);
            if (v > fg_linear_eval(&terms[arg], r.x)) arg = i;
        }
        printf("   %s\n", fg_cost_term_names[arg]);
    }
    if (!a->evaluate) printf("search: %d LPs, %d plans checked, %.3f s\n", r.lps, r.checks, r.seconds);
    return 0;
}

/* flexgen profile: measures this machine and saves the hardware file. */
static int profile_command(int argc, char **argv, char *err) {
    const char *dir = FG_DEFAULT_OFFLOAD_DIR, *out = NULL;
    char path[4200];
    fg_device device = FG_DEVICE_AUTO;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(stdout); return 1; }
        if (i + 1 >= argc) return fg_fail(err, "%s: missing value", argv[i]);
        if (!strcmp(argv[i], "--offload-dir")) dir = argv[++i];
        else if (!strcmp(argv[i], "--out")) out = argv[++i];
        else if (!strcmp(argv[i], "--device")) {
            if (parse_device(argv[++i], &device, err)) return -1;
        }
        else return fg_fail(err, "%s: unknown option for profile", argv[i]);
    }
    if (!out) {
        if (default_hw_file(path, sizeof path, err)) return -1;
        out = path;
    }
    char parent[4200];
    snprintf(parent, sizeof parent, "%s", out);
    char *slash = strrchr(parent, '/');
    if (slash) *(slash == parent ? slash + 1 : slash) = 0;
    if (access(slash ? parent : ".", W_OK | X_OK) != 0) /* before a minute of measuring */
        return fg_fail(err, "--out %s: cannot write there: %s", out, strerror(errno));
    fg_hardware hw;
    if (check_dir("--offload-dir", dir, err)) return -1;
    device = resolve_device(device, 1);
    if (fg_profile(dir, device, &hw, 1, err) || fg_hardware_write(out, &hw, err)) return -1;
    const double G = 1 << 30;
    printf("cpu->gpu %.2f GiB/s, gpu->cpu %.2f GiB/s, disk->cpu %.3f GiB/s, cpu->disk %.3f GiB/s\n",
           hw.ctog_bdw / G, hw.gtoc_bdw_hidden / G, hw.dtoc_bdw / G, hw.ctod_bdw_g / G);
    printf("matrix products %.1f (prefill) %.1f (decode) GFLOP/s, attention %.1f (prefill) %.1f "
           "(decode) GFLOP/s, weights read %.2f GiB/s, 4-bit decompression %.2f GiB/s of fp16\n",
           hw.mm_flops_p / 1e9, hw.mm_flops_g / 1e9, hw.bmm_flops_p / 1e9, hw.bmm_flops_g / 1e9,
           hw.mem_bdw / G, hw.dequant_bdw / G);
    printf("saved %s\n", out);
    return 0;
}

static int tokenize_command(int argc, char **argv, char *err) {
    const char *vocab = NULL, *merges = NULL;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        if (i + 1 >= argc) return fg_fail(err, "%s: missing value", argv[i]);
        if (!strcmp(argv[i], "--vocab")) vocab = argv[++i];
        else if (!strcmp(argv[i], "--merges")) merges = argv[++i];
        else return fg_fail(err, "%s: unknown option for tokenize", argv[i]);
    }
    if (!vocab || !merges) return fg_fail(err, "tokenize: --vocab and --merges are required");
    fg_tokenizer *tok = tokenizer_load(vocab, merges, err);
    if (!tok) return -1;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = 0;
    while (rc == 0 && (len = getline(&line, &cap, stdin)) >= 0) {
        if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
        int *ids, n;
        rc = tokenizer_encode(tok, line, (size_t)len, &ids, &n, err);
        for (int i = 0; rc == 0 && i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        if (rc == 0) { printf("\n"); free(ids); }
    }
    free(line);
    tokenizer_free(tok);
    return rc;
}

int flexgen_main(int argc, char **argv) {
    char err[FG_ERR_LEN] = "";
    fg_pipe *pipe = NULL;
    int rc = fg_pipe_open(&argc, &argv, &pipe, err);
    const char *command = argc > 1 ? argv[1] : "";
    int one_process = !strcmp(command, "tokenize") || !strcmp(command, "profile") || !strcmp(command, "policy");
    if (rc == 0 && pipe && one_process) { /* every rank sees it; rank 0 says it */
        rc = fg_fail(err, "flexgen %s runs in one process: start it without mpirun", command);
        if (fg_pipe_rank(pipe)) err[0] = 0;
    }
    if (rc) {
    } else if (argc > 1 && !strcmp(argv[1], "tokenize")) {
        rc = tokenize_command(argc, argv, err);
    } else if (argc > 1 && !strcmp(argv[1], "profile")) {
        rc = profile_command(argc, argv, err);
        if (rc == 1) return 0;
    } else {
        int policy = argc > 1 && !strcmp(argv[1], "policy");
        cli_args a;
        rc = parse_args(argc - policy, argv + policy, &a, err);
        if (rc == 1) {
            if (fg_pipe_rank(pipe) == 0) usage(stdout);
            rc = 0;
        } else if (fg_pipe_agree(pipe, rc, err)) { /* a bad flag on any stage stops them all */
            rc = -1;
        } else {
            rc = policy ? policy_command(&a, err) : run(&a, pipe, err);
        }
        free(a.prompts);
    }
    fg_pipe_close(pipe);
    if (rc) {
        if (err[0]) fprintf(stderr, "flexgen: %s\n", err);
        return 2;
    }
    return fflush(stdout) == 0 ? 0 : 1;
}

#ifndef FLEXGEN_NO_MAIN
int main(int argc, char **argv) { return flexgen_main(argc, argv); }
#endif
