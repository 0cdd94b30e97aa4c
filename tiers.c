/* tiers.c: the memory hierarchy of the paper's §4.2 ("Search Space") as the runtime keeps it:
 * three tiers (gpu, cpu, disk) with one accounting point each, the disk tier as files in the
 * offload dir, and the I/O links of Fig. 4 as threads that run loads and stores while the
 * compute thread computes.
 *
 *   tier_take, tier_alloc   every byte a run holds is taken from its tier here, or refused with
 *                           one line naming the tier and its flag
 *   disk arenas             mapped files: pages come in (disk -> cpu) and go out (cpu -> disk)
 *   io_submit, io_sync      a thread per link, tasks in order, "synchronize"
 *   fg_runtime_open         a run: the backend, capacities, the threads
 *
 * Nothing here knows about models or blocks: weights.c and flexgen.c say what moves.
 */
#define _GNU_SOURCE
#include "runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

/* ============================================================================================
 * Tiers (docs/DESIGN.md, "Glossary": tier): one accounting point each. I/O threads move pages of the
 * disk tier in and out of memory, so the counters sit behind a lock.
 * ============================================================================================ */

const char *const fg_tier_flags[N_TIERS] = {"--gpu-mem", "--cpu-mem", "--disk-mem"};

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

size_text human(double bytes) {
    size_text t;
    if (bytes >= GB) snprintf(t.s, sizeof t.s, "%.2f GiB", bytes / GB);
    else if (bytes >= 1 << 20) snprintf(t.s, sizeof t.s, "%.1f MiB", bytes / (1 << 20));
    else snprintf(t.s, sizeof t.s, "%.1f KiB", bytes / 1024);
    return t;
}

/* Takes bytes from a tier, or fails naming the tier, what needed them, and what is left. */
int tier_take(fg_runtime *rt, fg_tier t, double bytes, const char *what, char *err) {
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
                   human(bytes).s, human(in_use).s, human(rt->capacity[t]).s, fg_tier_flags[t]);
}

/* Transient use (pages of the disk tier in memory while they move): counted, never refused,
 * since the plan check already bounded it. */
void tier_add(fg_runtime *rt, fg_tier t, double bytes) {
    pthread_mutex_lock(&rt->lock);
    rt->current[t] += bytes;
    if (rt->current[t] > rt->peak[t]) rt->peak[t] = rt->current[t];
    pthread_mutex_unlock(&rt->lock);
}

void link_add(fg_runtime *rt, fg_link l, double bytes) {
    pthread_mutex_lock(&rt->lock);
    rt->link_bytes[l] += bytes;
    pthread_mutex_unlock(&rt->lock);
}

/* Memory of the gpu or cpu tier, zeroed (cpu-tier weights pinned with --pin-weight, the rest of
 * the cpu tier always: what moves over the cpu <-> gpu link). NULL (and err) when the tier or the
 * machine is full. */
void *tier_alloc_pinned(fg_runtime *rt, fg_tier t, size_t bytes, const char *what,
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

void *tier_alloc(fg_runtime *rt, fg_tier t, size_t bytes, const char *what, char *err) {
    return tier_alloc_pinned(rt, t, bytes, what, 1, err);
}

void tier_free(fg_runtime *rt, fg_tier t, void *p, size_t bytes) {
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

size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }
size_t page_up(size_t n) { return (n + page_size() - 1) & ~(page_size() - 1); }

/* An unnamed file in dir: O_TMPFILE where the file system has it, else mkstemp + unlink. */
int unnamed_file(const char *dir, const char *flag, char *err) {
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
int arena_map(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir,
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

void arena_close(disk_arena *a) {
    if (a->base) fg_unwatch_mapping(a->base), munmap(a->base, a->size);
    if (a->fd >= 0) close(a->fd);
    memset(a, 0, sizeof *a);
    a->fd = -1;
}

/* A page-aligned piece of the arena (the plan sized the arena, so this cannot run out). */
void *arena_take(disk_arena *a, size_t bytes) {
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
void disk_fetch_pages(const disk_arena *a, size_t off, size_t len) {
    madvise(a->base + off, len, MADV_WILLNEED);
    volatile const char *c = a->base + off;
    unsigned sum = 0;
    for (size_t i = 0; i < len; i += page_size()) sum += c[i];
    (void)sum;
}

/* disk -> cpu: bring the pages in (and wait for them), on the disk link's thread. */
void disk_fetch(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes) {
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
void drop_pages(const disk_arena *a, const void *p, size_t bytes, int dirty) {
    size_t off, len;
    page_range(a, p, bytes, &off, &len);
    if (dirty) msync(a->base + off, len, MS_SYNC);
    madvise(a->base + off, len, MADV_DONTNEED);
    posix_fadvise(a->fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
}

/* Writes back what was written (cpu -> disk) and drops the pages from memory. */
void disk_release(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes,
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

void trace_add(fg_runtime *rt, int track, const char *name, int layer, int batch, double start,
               double end) {
    trace_record(&rt->trace, track, name, layer, batch, start, end);
}

static void run_task(fg_runtime *rt, int link, const io_task *t) {
    double start = now_seconds();
    t->fn(rt, t);
    trace_add(rt, rt->io[link].track, t->name, t->layer, t->batch, start, now_seconds());
}

void io_wait(fg_runtime *rt, int link, uint64_t seq) {
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
uint64_t io_submit(fg_runtime *rt, int link, io_task t) {
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
void io_sync(fg_runtime *rt, int weights) {
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
                       .percent = {.wg = 100, .cg = 100, .hg = 100}, .overlap = 1, .pin_weight = 1,
                       .attn_sparsity = 1, .n_stages = 1};
}

double mem_available_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    double kb = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
    if (f) fclose(f);
    if (kb > 0) return kb * 1024;
    return (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
}

int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The offload dir must exist and be writable, whatever the plan puts on disk. */
int check_dir(const char *flag, const char *dir, char *err) {
    if (!is_dir(dir)) return fg_fail(err, "%s %s: no such directory", flag, dir);
    if (access(dir, W_OK | X_OK) != 0) return fg_fail(err, "%s %s: not writable: %s", flag, dir, strerror(errno));
    return 0;
}

int mkdir_p(const char *dir) {
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

void default_weight_dir(char *out, size_t n) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && *xdg) snprintf(out, n, "%s/flexgen", xdg);
    else if (home && *home) snprintf(out, n, "%s/.cache/flexgen", home);
    else snprintf(out, n, "%s/flexgen-weights", FG_DEFAULT_OFFLOAD_DIR);
}

/* The backend of a device: auto is CUDA when a GPU is there, else the CPU. NULL (and err) when
 * cuda is asked for and there is none. */
const fg_backend *backend_for(fg_device device, char *err) {
    char why[FG_ERR_LEN];
    if (device == FG_DEVICE_CPU_FP16) return &fg_cpu_fp16_backend;
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
    const fg_percent *x = &p->percent;
    const int pairs[3][2] = {{x->wg, x->wc}, {x->cg, x->cc}, {x->hg, x->hc}};
    for (int kind = 0; kind < 3; kind++) {
        const int *pc = pairs[kind];
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
    double gpu_free = backend->device_memory ? backend->device_memory() : mem_available_bytes();
    double defaults[N_TIERS] = {gpu_free, mem_available_bytes(), disk_free};
    for (int t = 0; t < N_TIERS; t++) rt->capacity[t] = p->capacity[t] > 0 ? p->capacity[t] : defaults[t];
    rt->trace.on = p->trace;
    rt->trace.t0 = now_seconds();
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
    trace_free(&rt->trace);
    pthread_mutex_destroy(&rt->lock);
    free(rt);
}

const fg_backend *fg_runtime_backend(const fg_runtime *rt) { return rt->backend; }

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

