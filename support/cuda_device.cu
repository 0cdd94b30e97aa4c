/* support/cuda_device.cu: the CUDA backend's plumbing, beneath flexgen.cu's layers and kernels:
 * each runtime thread's stream, its copies between the tiers, the device's memory, the small
 * tables the kernels read, a decode layer's CUDA Graph, decode's fp16 products, the counters, and
 * the GPU found once (paper §4.1's tiers and §4.2's overlap of I/O with compute; docs/GPU.md). It
 * calls nothing of flexgen.cu; flexgen.cu's operation table lists its functions.
 *
 *   memory      the gpu tier is device memory; the cpu tier is pinned host memory (weights with
 *               --pin-weight); copies from pageable memory (the disk tier's mapped pages) go
 *               through two pinned bounce buffers per thread, one filling while the other moves
 *   streams     each runtime thread (compute, and the I/O links of Fig. 4) queues its work on a
 *               stream of its own, so that a layer's weights, the next batch's cache and the
 *               last batch's results move while the compute stream runs. No operation waits for
 *               the GPU: after the runtime's synchronize, join orders the streams on the device
 *               (each waits for an event of the others); the host waits only where it reads what
 *               the GPU wrote (the logits, a delegated attention's rows) or writes a host buffer
 *               a queued copy still reads (copies_done). A decode step on the gpu tier waits once.
 *   tables      the rows' layout, cache pointers and page tables that the kernels read go up
 *               from pinned memory once a step, not once a layer: a table already on the device
 *               serves the next layer, whose K rows lie a fixed distance on, and its V rows
 *               another (its shifts: staged K beside V read in place, say)
 *   counters    host waits, launches, graph launches, cuBLAS products, copies and allocations, on
 *               every thread, which the runtime reads per step (--json, the trace; docs/GPU.md)
 *   graphs      a decode step's layer is captured into a CUDA Graph, updated for each layer and
 *               step, and launched as one (layer_graph_begins)
 *   products    decode's fp16 products take, a shape at a time, cuBLAS's default or the
 *               cublasLt algorithm that a clock found faster (fp16_product)
 *
 * A failing CUDA or cuBLAS call ends the process with the call and the device's message: the
 * operations have no error path, and the disk tier's files are unnamed, so nothing is left.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support/cuda_device.h"

/* ============================================================================================
 * Counters: what the host asks of the GPU, on every thread (docs/GPU.md, "Where the host waits, and
 * the counters"). The runtime reads them at each step's edges, so that a step's waits, launches and
 * copies can be held to account on any machine, the emulated GPU's included.
 * ============================================================================================ */

fg_device_counts counts;

void count(int64_t *counter, int64_t n) { __atomic_fetch_add(counter, n, __ATOMIC_RELAXED); }

void cuda_counts(fg_device_counts *out) {
    const int64_t *from = (const int64_t *)&counts;
    int64_t *to = (int64_t *)out;
    for (size_t i = 0; i < sizeof counts / sizeof(int64_t); i++)
        to[i] = __atomic_load_n(&from[i], __ATOMIC_RELAXED);
}

/* ============================================================================================
 * Errors, threads, streams
 * ============================================================================================ */

/* A failed call ends the process (under mpirun, naming its stage; mpirun then ends the others). */
void cuda_fail(const char *call, const char *file, int line, const char *msg) {
    const char *rank = getenv("OMPI_COMM_WORLD_RANK"), *size = getenv("OMPI_COMM_WORLD_SIZE");
    char stage[96] = "";
    if (rank && size && atoi(size) > 1)
        snprintf(stage, sizeof stage, "rank %s (stage %d of %s): ", rank, atoi(rank) + 1, size);
    fprintf(stderr, "flexgen: %sCUDA: %s failed (%s:%d): %s\n", stage, call, file, line, msg);
    exit(3);
}

/* FLEXGEN_CUDA_SYNC=1: each launch waited for (LAUNCHED, BLAS_PRODUCT). */
int sync_each_kernel;

static int capturing(void);

/* After a launch (LAUNCHED): its error, counted, and waited for with FLEXGEN_CUDA_SYNC=1. */
void launched(const char *kernel, const char *file, int line) {
    if (!capturing()) count(&counts.launches, 1); /* a captured kernel runs in its graph's launch */
    note_queued();
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) cuda_fail(kernel, file, line, cudaGetErrorString(e));
    if (sync_each_kernel) wait_stream();
}

static pthread_key_t ctx_key;
static int device_index; /* this process's GPU: its pipeline stage's place on the machine (§4.4) */

/* Every thread's context, for join. */
enum { MAX_THREADS = 64 };
static thread_ctx *contexts[MAX_THREADS];
/* fp16_product's choices (below, "The fp16 products of decode's rows") */
static product_choices *products_make(int mode);
static void products_free(product_choices *pc);
static void products_time_deferred(cuda_ws *d);
static pthread_mutex_t contexts_lock = PTHREAD_MUTEX_INITIALIZER;

static void ctx_destroy(void *p) {
    thread_ctx *c = (thread_ctx *)p;
    pthread_mutex_lock(&contexts_lock);
    for (int i = 0; i < MAX_THREADS; i++)
        if (contexts[i] == c) contexts[i] = NULL;
    pthread_mutex_unlock(&contexts_lock);
    products_free(c->products);
    if (c->blas) cublasDestroy(c->blas);
    for (int i = 0; i < 2; i++) {
        if (c->bounce[i]) cudaFreeHost(c->bounce[i]);
        if (c->moved[i]) cudaEventDestroy(c->moved[i]);
    }
    cudaEventDestroy(c->host_copied);
    cudaEventDestroy(c->mark);
    cudaStreamDestroy(c->stream);
    free(c);
}

thread_ctx *ctx(void) {
    thread_ctx *c = (thread_ctx *)pthread_getspecific(ctx_key);
    if (c) return c;
    c = (thread_ctx *)calloc(1, sizeof *c);
    if (!c) cuda_fail("calloc", __FILE__, __LINE__, "out of host memory");
    CUDA_CHECK(cudaSetDevice(device_index)); /* each thread's own setting */
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->host_copied, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->mark, cudaEventDisableTiming));
    c->link = io_link_of_this_thread();
    if (c->link >= 0) { /* an I/O thread's stream: its first copy comes after all the work queued
                           before its task, which no join ordered before this stream was made */
        count(&counts.host_waits, 1);
        CUDA_CHECK(cudaDeviceSynchronize());
    }
    pthread_setspecific(ctx_key, c);
    pthread_mutex_lock(&contexts_lock);
    int slot = 0;
    while (slot < MAX_THREADS && contexts[slot]) slot++;
    if (slot < MAX_THREADS) contexts[slot] = c;
    pthread_mutex_unlock(&contexts_lock);
    if (slot == MAX_THREADS)
        cuda_fail("ctx", __FILE__, __LINE__, "more threads than the backend keeps streams for");
    return c;
}

cublasHandle_t blas(void) {
    thread_ctx *c = ctx();
    if (!c->blas) {
        BLAS_CHECK(cublasCreate(&c->blas));
        BLAS_CHECK(cublasSetStream(c->blas, c->stream));
        c->products = products_make(products_mode(NULL));
    }
    return c->blas;
}

/* The host waits for all this thread queued. */
void wait_stream(void) {
    thread_ctx *c = ctx();
    count(&counts.host_waits, 1);
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    c->finished = c->queued;
    c->host_copied_at = 0;
}

/* The host waits for this thread's work up to `at`, which event e was recorded after; none if
 * the host has seen that work end already. */
static void wait_event(cudaEvent_t e, uint64_t at) {
    thread_ctx *c = ctx();
    if (at <= c->finished) return;
    count(&counts.host_waits, 1);
    CUDA_CHECK(cudaEventSynchronize(e));
    c->finished = at;
    if (c->host_copied_at <= at) c->host_copied_at = 0;
}

/* Numbers a piece of work just put on this thread's stream (a kernel's, a copy's, a wait's). */
uint64_t note_queued(void) { return ++ctx()->queued; }

/* This thread's stream is being captured into a graph (layer_graph_begins). */
static int capturing(void) { return ctx()->capturing; }

/* What kind of memory p is in: cudaMemoryTypeDevice, cudaMemoryTypeHost (pinned), or
 * cudaMemoryTypeUnregistered (plain host memory). */
static cudaMemoryType memory_type(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* plain host memory on old drivers */
        return cudaMemoryTypeUnregistered;
    }
    return a.type;
}

/* The copy engines read and write it directly (device or pinned memory). */
static int is_pinned_or_device(const void *p) {
    return memory_type(p) != cudaMemoryTypeUnregistered;
}

/* The kernels read p where it lies: pinned host memory at the same address on the device (unified
 * addressing), each load crossing the link. Plain host memory (pinning refused) is not. */
int cuda_reads_in_place(const void *p) {
    cudaPointerAttributes a;
    ctx();
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeHost && a.devicePointer == p;
}

/* ============================================================================================
 * Memory and copies. A copy is queued on the calling thread's stream: one between the device
 * and host memory leaves that memory in use until the thread's copies_done (the runtime's tasks,
 * sampling's logits), one on the device needs no host at all.
 * ============================================================================================ */

/* Queues a copy of `rows` rows of `width` bytes (one row: a plain copy), counted. */
void queue_copy_rows(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                     size_t rows, int direction) {
    thread_ctx *c = ctx();
    if (rows == 1) CUDA_CHECK(cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, c->stream));
    else
        CUDA_CHECK(
            cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDefault, c->stream));
    uint64_t at = note_queued();
    size_t bytes = width * rows;
    if (direction == TO_DEVICE) {
        count(&counts.copies_in, 1);
        count(&counts.bytes_in, (int64_t)bytes);
    }
    if (direction == TO_HOST) {
        count(&counts.copies_out, 1);
        count(&counts.bytes_out, (int64_t)bytes);
    }
    if (direction == ON_DEVICE) count(&counts.copies_on_device, 1);
    if (direction == ON_DEVICE) return;
    CUDA_CHECK(cudaEventRecord(c->host_copied, c->stream));
    c->host_copied_at = at;
}

void queue_copy(void *dst, const void *src, size_t bytes, int direction) {
    queue_copy_rows(dst, bytes, src, bytes, bytes, 1, direction);
}

/* This thread's copies from and to host memory have run: their host buffers may be read and
 * written again. A decode step on the gpu tier waits here once, for its logits. */
void cuda_copies_done(void) {
    thread_ctx *c = ctx();
    if (c->host_copied_at) wait_event(c->host_copied, c->host_copied_at);
}

void cuda_finish(void) { wait_stream(); }

/* Fig. 4's synchronize on the device: the compute thread's stream and the streams of the I/O
 * threads of `links` (bits 1 << link; their tasks are done, so nothing more comes on them) each
 * wait for what the other has queued so far. No host thread waits. */
void cuda_join(unsigned links) {
    thread_ctx *me = ctx();
    CUDA_CHECK(cudaEventRecord(me->mark, me->stream));
    pthread_mutex_lock(&contexts_lock);
    for (int i = 0; i < MAX_THREADS; i++) {
        thread_ctx *c = contexts[i];
        if (!c || c == me || c->link < 0 || !(links >> c->link & 1)) continue;
        CUDA_CHECK(cudaEventRecord(c->mark, c->stream));
        CUDA_CHECK(cudaStreamWaitEvent(me->stream, c->mark, 0));
        CUDA_CHECK(cudaStreamWaitEvent(c->stream, me->mark, 0));
    }
    pthread_mutex_unlock(&contexts_lock);
    note_queued();
}

/* Allocations go through ctx() first: it selects this process's device on the calling thread. */
void *cuda_alloc(size_t bytes) {
    void *p = NULL;
    cudaStream_t s = ctx()->stream;
    count(&counts.allocations, 1);
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError(); /* out of memory: the runtime reports the tier */
        return NULL;
    }
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s)); /* the thread's stream: the legacy one would
                                                   not order with the non-blocking streams */
    note_queued();
    wait_stream();
    return p;
}

void cuda_free(void *p) {
    if (!p) return;
    ctx(); /* this process's device on the calling thread, as for the allocation */
    CUDA_CHECK(cudaFree(p));
}

void *cuda_host_alloc(size_t bytes, int pinned) {
    void *p = NULL;
    if (pinned) ctx();
    if (pinned && cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError(); /* too much to lock: pageable memory still works, more slowly */
        p = NULL;
    }
    if (!p) p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (p) memset(p, 0, bytes);
    return p;
}

void cuda_host_free(void *p) {
    if (!p) return;
    ctx(); /* the device whose context pinned it, before asking about p */
    if (is_pinned_or_device(p)) CUDA_CHECK(cudaFreeHost(p));
    else free(p);
}

static void bounce_ready(thread_ctx *c) {
    if (c->bounce[0]) return;
    for (int i = 0; i < 2; i++) {
        CUDA_CHECK(cudaHostAlloc((void **)&c->bounce[i], BOUNCE, cudaHostAllocPortable));
        CUDA_CHECK(cudaEventCreateWithFlags(&c->moved[i], cudaEventDisableTiming));
    }
}

/* Bounce buffer b may be filled (or read) again: the copy that last used it has run. */
static void bounce_free(thread_ctx *c, int b) { wait_event(c->moved[b], c->moved_at[b]); }

/* The copy just queued uses bounce buffer b. */
static void bounce_used(thread_ctx *c, int b) {
    CUDA_CHECK(cudaEventRecord(c->moved[b], c->stream));
    c->moved_at[b] = c->queued;
}

/* Host -> device. A pinned source is read when the copy runs; a pageable one (the disk tier's
 * pages) before this returns, through the bounce buffers: piece i is copied into one while piece
 * i - 1 moves from the other. */
void cuda_copy_in(void *dst, const void *src, size_t bytes) {
    thread_ctx *c = ctx();
    if (bytes == 0) return;
    if (is_pinned_or_device(src)) {
        queue_copy(dst, src, bytes, TO_DEVICE);
        return;
    }
    count(&counts.pageable_copies, 1);
    bounce_ready(c);
    for (size_t at = 0, i = 0; at < bytes; at += BOUNCE, i++) {
        size_t n = bytes - at < (size_t)BOUNCE ? bytes - at : (size_t)BOUNCE;
        int b = (int)(i % 2);
        bounce_free(c, b); /* its last piece has left */
        memcpy(c->bounce[b], (const char *)src + at, n);
        queue_copy((char *)dst + at, c->bounce[b], n, TO_DEVICE);
        bounce_used(c, b);
    }
}

/* Device -> host. A pinned destination holds the bytes after copies_done; a pageable one when
 * this returns, the same way round through the bounce buffers. */
void cuda_copy_out(void *dst, const void *src, size_t bytes) {
    thread_ctx *c = ctx();
    if (bytes == 0) return;
    if (is_pinned_or_device(dst)) {
        queue_copy(dst, src, bytes, TO_HOST);
        return;
    }
    count(&counts.pageable_copies, 1);
    bounce_ready(c);
    size_t pieces = (bytes + BOUNCE - 1) / BOUNCE;
    for (size_t i = 0; i <= pieces; i++) {
        if (i < pieces) {
            size_t at = i * BOUNCE, n = bytes - at < (size_t)BOUNCE ? bytes - at : (size_t)BOUNCE;
            queue_copy(c->bounce[i % 2], (const char *)src + at, n, TO_HOST);
            bounce_used(c, (int)(i % 2));
        }
        if (i > 0) { /* piece i - 1 has arrived: out of its bounce buffer */
            size_t at = (i - 1) * BOUNCE,
                   n = bytes - at < (size_t)BOUNCE ? bytes - at : (size_t)BOUNCE;
            bounce_free(c, (int)((i - 1) % 2));
            memcpy((char *)dst + at, c->bounce[(i - 1) % 2], n);
        }
    }
}

void cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return;
    queue_copy(dst, src, bytes, ON_DEVICE);
}

void cuda_weights_in(void *dst, const fp16 *src, size_t n) { cuda_copy_in(dst, src, 2 * n); }

/* The bytes stay 4-bit: the products read them as they are, so nothing lands first. */
void cuda_weights_in_q4(void *dst, const void *src, void *landing, size_t outer, size_t len,
                        size_t inner) {
    (void)landing;
    cuda_copy_in(dst, src, q4_bytes(outer, len, inner));
}

/* ============================================================================================
 * Workspace: fp16 hidden states and products, as FlexGen keeps them, and the tables the kernels
 * read. fg_cuda_workspace_parts (support/workspace.c, so that the cost model has it without
 * CUDA) lays it out; this allocates exactly that. Delegated attention's host workspace is
 * allocated on first use, for the rows it needs: the plan counts it on the cpu tier
 * (fg_cuda_delegated_bytes).
 * ============================================================================================ */

/* n table slots of `bytes` each, their device parts from `device` on. 0, or -1 when out of
 * memory. */
static int table_slots_init(table_slot *slots, int n, char *device, size_t bytes) {
    for (int i = 0; i < n; i++) {
        memset(&slots[i], 0, sizeof slots[i]);
        slots[i].device = device + (size_t)i * bytes;
        slots[i].host = (char *)cuda_host_alloc(bytes, 1);
        if (!slots[i].host) return -1;
        CUDA_CHECK(cudaEventCreateWithFlags(&slots[i].uploaded, cudaEventDisableTiming));
    }
    return 0;
}

static void table_slots_free(table_slot *slots, int n) {
    for (int i = 0; i < n; i++) {
        cuda_host_free(slots[i].host);
        if (slots[i].uploaded) cudaEventDestroy(slots[i].uploaded);
        memset(&slots[i], 0, sizeof slots[i]);
    }
}

static void free_host_rows(cuda_ws *d) {
    if (d->host_rows) model_workspace_free(&d->host);
    cuda_host_free(d->host16);
    d->host16 = NULL;
    d->host_rows = 0;
}

static void cuda_ws_free(cuda_ws *d) {
    if (d->layer_graph) cudaGraphExecDestroy(d->layer_graph);
    table_slots_free(d->token_tables, FG_CUDA_TOKEN_TABLES);
    table_slots_free(d->cache_tables, FG_CUDA_CACHE_TABLES);
    cuda_free(d->block);
    cuda_free(d->grown_tables);
    free_host_rows(d);
    free(d->table);
    free(d);
}

int cuda_workspace_init(model_workspace *ws, const model_config *cfg, size_t rows, int max_prompt,
                        int max_len, char *err) {
    memset(ws, 0, sizeof *ws);
    size_t sizes[FG_CUDA_WS_PARTS];
    size_t total = fg_cuda_workspace_parts(cfg, rows, max_prompt, max_len, sizes);
    cuda_ws *d = (cuda_ws *)calloc(1, sizeof *d);
    if (!d) return fg_fail(err, "out of memory");
    d->rows = rows;
    /* the most: a page has 16 tokens or max_len */
    d->max_pages = kv_pages_for(max_len, FG_PAGE_TOKENS);
    d->block = (char *)cuda_alloc(total);
    size_t token_bytes = fg_cuda_token_table_bytes(rows),
           cache_bytes = fg_cuda_cache_table_bytes(rows, d->max_pages);
    char *parts[FG_CUDA_WS_PARTS], *at = d->block;
    for (int i = 0; i < FG_CUDA_WS_PARTS && d->block; i++) {
        parts[i] = at;
        at += sizes[i];
    }
    d->table = (char *)malloc(cache_bytes > token_bytes ? cache_bytes : token_bytes);
    if (!d->block || !d->table ||
        table_slots_init(d->token_tables, FG_CUDA_TOKEN_TABLES, parts[5], token_bytes) ||
        table_slots_init(d->cache_tables, FG_CUDA_CACHE_TABLES, parts[6], cache_bytes)) {
        cuda_ws_free(d);
        return fg_fail(err, "gpu tier: cannot allocate the workspace for %zu token rows", rows);
    }
    d->h = (__half *)parts[0];
    d->qkv = (__half *)parts[1];
    d->attn = d->qkv + rows * qkv_width(cfg);
    d->ffn = d->qkv;
    d->scores = (float *)parts[2];
    d->probs = (__half *)parts[3];
    d->partials = (float *)parts[2]; /* over scores, probs and parts[4] */
    d->span_slots = fg_cuda_span_slots(cfg, rows, max_len);
    if (cudaDeviceGetAttribute(&d->multiprocessors, cudaDevAttrMultiProcessorCount, device_index) !=
        cudaSuccess)
        d->multiprocessors = 1;
    d->q4_scratch = (float *)parts[2];
    d->widen_values = (sizes[2] + sizes[3] + sizes[4]) / 2;
    d->q4_done = (unsigned *)(parts[5] + FG_CUDA_TOKEN_TABLES * token_bytes);
    CUDA_CHECK(cudaMemset(d->q4_done, 0, fg_cuda_q4_groups(cfg) * sizeof(unsigned)));
    const char *graphs = getenv("FLEXGEN_CUDA_GRAPHS");
    d->graphs = !sync_each_kernel && !(graphs && !strcmp(graphs, "0"));
    ws->rows = rows;
    ws->max_len = max_len;
    ws->device = d;
    return 0;
}

void cuda_workspace_free(model_workspace *ws) {
    if (ws->device) cuda_ws_free((cuda_ws *)ws->device);
    memset(ws, 0, sizeof *ws);
}

/* Room for page tables of the run's page size. The workspace's part holds tables of 16-token
 * pages, the smallest the runtime makes (support/kv_pages.c); smaller pages, as a test may give,
 * get cache tables of their own, outside the plan's count (4 bytes a page). */
static void cache_tables_ready(cuda_ws *d, const gpu_batch *gb) {
    int need = kv_pages_for(gb->max_len, gb->page_tokens);
    if (need <= d->max_pages) return;
    size_t bytes = fg_cuda_cache_table_bytes(d->rows, need);
    table_slots_free(d->cache_tables, FG_CUDA_CACHE_TABLES);
    cuda_free(d->grown_tables);
    free(d->table);
    d->grown_tables = (char *)cuda_alloc(FG_CUDA_CACHE_TABLES * bytes);
    d->table = (char *)malloc(bytes);
    if (!d->grown_tables || !d->table ||
        table_slots_init(d->cache_tables, FG_CUDA_CACHE_TABLES, d->grown_tables, bytes))
        cuda_fail("page tables", __FILE__, __LINE__, "out of memory");
    d->max_pages = need;
}

/* Whether slot s holds `want`, but that its cache pointers ([n_pointers] from byte
 * `pointers_at`, K's then V's; none in a token table) may lie shift[0] bytes (K's) and shift[1]
 * (V's) from the slot's, as the next layer's rows lie from this one's; NULL (a delegated
 * sequence) must stay NULL. */
static int table_matches(const table_slot *s, const char *want, size_t bytes, size_t pointers_at,
                         int n_pointers, long long shift[2]) {
    size_t pointers_end = pointers_at + (size_t)n_pointers * sizeof(void *);
    if (s->bytes != bytes || memcmp(s->host, want, pointers_at) ||
        memcmp(s->host + pointers_end, want + pointers_end, bytes - pointers_end))
        return 0;
    const uint64_t *have = (const uint64_t *)(s->host + pointers_at),
                   *now = (const uint64_t *)(want + pointers_at);
    uint64_t distance[2] = {0, 0};
    int seen[2] = {0, 0};
    for (int i = 0; i < n_pointers; i++) {
        int kv = i >= n_pointers / 2;
        if (!have[i] != !now[i]) return 0;
        if (!have[i]) continue;
        if (!seen[kv]++) distance[kv] = now[i] - have[i];
        else if (now[i] - have[i] != distance[kv]) return 0;
    }
    shift[0] = (long long)distance[0];
    shift[1] = (long long)distance[1];
    return 1;
}

/* The device's copy of the table `want` (built in d->table): a slot holding it, or else the one
 * used longest ago, uploaded on the compute stream, which runs the copy after the kernels that
 * read the slot's old content (queued before it). Its pinned source is written again only once
 * its last upload has run. */
static const char *device_table(cuda_ws *d, table_slot *slots, int n, size_t bytes,
                                size_t pointers_at, int n_pointers, long long shift[2]) {
    table_slot *s = NULL;
    shift[0] = shift[1] = 0;
    for (int i = 0; i < n && !s; i++)
        if (table_matches(&slots[i], d->table, bytes, pointers_at, n_pointers, shift))
            s = &slots[i];
    if (!s) {
        s = &slots[0];
        for (int i = 1; i < n; i++)
            if (slots[i].last_used < s->last_used) s = &slots[i];
        wait_event(s->uploaded, s->uploaded_at);
        memcpy(s->host, d->table, bytes);
        s->bytes = bytes;
        shift[0] = shift[1] = 0;
        queue_copy(s->device, s->host, bytes, TO_DEVICE);
        CUDA_CHECK(cudaEventRecord(s->uploaded, ctx()->stream));
        s->uploaded_at = ctx()->queued;
    }
    s->last_used = ++d->clock;
    return s->device;
}

token_table upload_tokens(cuda_ws *d, const gpu_batch *gb) {
    size_t B = (size_t)gb->batch, n_tokens = B * gb->n_new;
    int *t = (int *)d->table;
    memcpy(t, gb->pad, B * sizeof(int));
    memcpy(t + B, gb->past, B * sizeof(int));
    memcpy(t + 2 * B, gb->tokens, n_tokens * sizeof(int));
    long long shift[2];
    const int *dev = (const int *)device_table(d, d->token_tables, FG_CUDA_TOKEN_TABLES,
                                               (2 * B + n_tokens) * sizeof(int), 0, 0, shift);
    return (token_table){dev, dev + B, dev + 2 * B};
}

/* Sequence b's page table of K (kv 0) or V (kv 1), or the rows in order, into `to`. */
static void page_table(const gpu_batch *gb, int kv, int b, int *to) {
    const int *pages = kv ? gb->v_pages[b] : gb->k_pages[b];
    int n = kv_pages_for(gb->max_len, gb->page_tokens);
    for (int i = 0; i < n; i++) to[i] = pages ? pages[i] : i;
}

/* Where the cache lives comes from the runtime's placement (gb->kv_in_host), not the driver. */
cache_table upload_cache(cuda_ws *d, const gpu_batch *gb) {
    cache_tables_ready(d, gb);
    size_t B = (size_t)gb->batch, P = (size_t)d->max_pages, pointers_at = 2 * B * sizeof(int);
    size_t pages_at = pointers_at + 2 * B * sizeof(void *),
           bytes = pages_at + 2 * B * P * sizeof(int);
    int *ints = (int *)d->table, *pages = (int *)(d->table + pages_at);
    void **k = (void **)(d->table + pointers_at), **v = k + B;
    cache_table t;
    memset(&t, 0, sizeof t);
    memset(d->table, 0, bytes);
    memcpy(ints, gb->pad, B * sizeof(int));
    memcpy(ints + B, gb->past, B * sizeof(int));
    for (size_t b = 0; b < B; b++) {
        int on_device = !gb->kv_in_host[b];
        k[b] = on_device ? gb->k[b] : NULL;
        v[b] = on_device ? gb->v[b] : NULL;
        t.on_device += on_device;
        for (int kv = 0; kv < 2 && on_device; kv++)
            page_table(gb, kv, (int)b, pages + ((size_t)kv * B + b) * P);
    }
    const char *dev = device_table(d, d->cache_tables, FG_CUDA_CACHE_TABLES, bytes, pointers_at,
                                   (int)(2 * B), t.shift);
    t.pad = (const int *)dev;
    t.past = t.pad + B;
    t.k = (void *const *)(dev + pointers_at);
    t.v = t.k + B;
    t.pages = (const int *)(dev + pages_at);
    t.max_pages = (int)P;
    return t;
}

/* The V rows decode attention on the device reads of each sequence (a query head's row each), as
 * the CPU counts them (opt_model.c's attention): with top-K its kept keys and the new token, with a
 * 4-bit cache every key. flexgen.c counts the kept rows of the cpu tier as bytes over the link. */
void count_v_rows(gpu_batch *gb, int heads) {
    for (int b = 0; b < gb->batch; b++) {
        int nk = gb->past[b] + 1;
        int decode = gb->n_new - gb->pad[b] == 1 && gb->past[b] > 0;
        if (!decode || gb->kv_in_host[b] || (gb->attn_sparsity >= 1 && !gb->kv_q4)) continue;
        int rows = nk;
        if (gb->attn_sparsity < 1) rows = (int)floorf(gb->attn_sparsity * (float)(nk - 1)) + 1;
        gb->v_rows_read[b] += (int64_t)heads * rows;
    }
}

/* The host rows of delegated attention, for `rows` token rows: the CPU backend's workspace and a
 * pinned fp16 buffer, (re)made when more rows are needed than they hold. */
void host_rows_ready(cuda_ws *d, const model_config *c, size_t rows, int max_len) {
    if (rows <= d->host_rows) return;
    free_host_rows(d);
    char err[FG_ERR_LEN];
    if (model_workspace_init(&d->host, c, rows, 0, max_len, err))
        cuda_fail("model_workspace_init", __FILE__, __LINE__, err);
    d->host_rows = rows;
    d->host16 = (fp16 *)cuda_host_alloc(rows * qkv_width(c) * sizeof(fp16), 1);
    if (!d->host16)
        cuda_fail("cuda_host_alloc", __FILE__, __LINE__,
                  "out of host memory for delegated attention");
}

/* ---- A decode layer as one CUDA Graph: the kernels (and cuBLAS products) of a layer are
 * captured from the compute stream instead of launched, and the graph is launched as one. Every
 * layer of a decode step has the same kernels in the same order with other arguments (weights,
 * cache pointers and shift, grid sizes as the batch and the keys grow), so one instantiated graph
 * serves them all: each layer's capture updates it (cudaGraphExecUpdate, which leaves launches
 * already queued as they were), and a capture whose kernels differ (the attention's split over
 * keys begins, say) instantiates it anew. The host queues one graph launch a layer for the ten
 * or so kernels (the counters' graph_launches). Not captured: prefill, a layer with delegated
 * sequences (their rows go to the host and back), FLEXGEN_CUDA_SYNC=1 and FLEXGEN_CUDA_GRAPHS=0. */
int layer_graph_begins(cuda_ws *d, const gpu_batch *gb, const cache_table *t) {
    products_settle(); /* outside any capture: the timed products' choices */
    if (!d->graphs || gb->n_new != 1 || t->on_device < gb->batch) return 0;
    thread_ctx *c = ctx();
    blas(); /* made before the capture: cublasCreate allocates, which a capture forbids */
    CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    c->capturing = 1;
    return 1;
}

void layer_graph_ends(cuda_ws *d, int captured) {
    if (!captured) return;
    thread_ctx *c = ctx();
    cudaGraph_t graph;
    cudaGraphExecUpdateResultInfo info;
    c->capturing = 0;
    CUDA_CHECK(cudaStreamEndCapture(c->stream, &graph));
    if (!d->layer_graph || cudaGraphExecUpdate(d->layer_graph, graph, &info) != cudaSuccess) {
        cudaGetLastError(); /* an update refused: other kernels; instantiated anew */
        if (d->layer_graph) CUDA_CHECK(cudaGraphExecDestroy(d->layer_graph));
        CUDA_CHECK(cudaGraphInstantiate(&d->layer_graph, graph, 0));
    }
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaGraphLaunch(d->layer_graph, c->stream));
    count(&counts.graph_launches, 1);
    note_queued();
    products_time_deferred(d);
}

/* ============================================================================================
 * The fp16 products of decode's rows: cuBLAS's default, or a cublasLt algorithm timed once a shape
 * ============================================================================================ */

/* cuBLAS picks one algorithm a shape by its heuristic; at decode's few rows, where a product reads
 * W once and multiplies little, that pick left opt-6.7b's products at 53 to 81% of an H200's read
 * rate (BENCHMARKS.md). cublasLt lists several for a shape (other tiles, splits of k), and which is
 * fastest on the GPU at hand only a clock says. So a shape of up to FG_CUDA_Q4_DIRECT rows
 * (FLEXGEN_CUDA_PRODUCTS=timed, the default) is timed once, the first time it comes: each
 * candidate, cuBLAS's default and up to CHOICE_ALGOS of cublasLt's heuristic, runs once and then
 * CHOICE_RUNS times between two events, on the stream before the product itself (into y where the
 * product sets it, else into the workspace's scratch). The host does not wait for them: at a later
 * layer's start, outside any capture, products_settle reads the events of the runs that are done
 * and keeps the fastest, cuBLAS's default unless another is CHOICE_MARGIN faster. In a layer being
 * captured into a CUDA Graph the runs come after the graph's launch (products_time_deferred).
 * Until a shape is settled its products take cuBLAS's default. Algorithms add in their own orders:
 * a product's last bits may differ between two runs whose choices differ (cublas: cuBLAS's
 * default always; cublaslt: cublasLt's first, untimed). The counters' products_timed counts the
 * timing runs, which are not blas_calls. A shape includes its operands' alignments (alignment_of):
 * cublasLt's heuristic lists algorithms for 256-byte aligned matrices unless told less, and such
 * an algorithm, given a small model's W or a part of the workspace at a smaller alignment, gave
 * wrong sums on an H200 with no error. */
enum { CHOICE_ALGOS = 8, CHOICE_CANDIDATES = 1 + CHOICE_ALGOS, CHOICE_RUNS = 5 };
enum { CHOICE_SHAPES = 64, CHOICE_DEFERRED = 16 };
#define CHOICE_MARGIN 0.97f
typedef enum { UNTIMED, DEFERRED, TIMING, SETTLED } choice_state;

/* A product's shape (fp16_product's arguments but the pointers, and whether it adds to y) and
 * what is known of its algorithms: candidate 0 is cuBLAS's default, 1 .. candidates - 1 cublasLt's
 * algo[i], each timed between start[i] and end[i] unless it failed. */
typedef struct {
    cublasOperation_t op_w;
    int m, n, k;
    cudaDataType y_type;
    int adds;
    unsigned align_w, align_x, align_y; /* the operands' alignments, up to 256 bytes */
    choice_state state;
    int candidates;
    int chosen;
    cublasLtMatmulAlgo_t algo[CHOICE_CANDIDATES];
    cudaEvent_t start[CHOICE_CANDIDATES], end[CHOICE_CANDIDATES];
    int failed[CHOICE_CANDIDATES];
    cublasLtMatmulDesc_t desc; /* cublasLt's view of the shape (lt_candidates) */
    cublasLtMatrixLayout_t w_layout, x_layout, y_layout;
} product_shape;

/* A thread's shapes, and the timing runs a capture put off (their operands then). */
struct product_choices {
    int mode;
    cublasLtHandle_t lt;
    void *workspace; /* cublasLt's, FG_CUDA_PRODUCT_WORKSPACE bytes (NULL: none) */
    int n_shapes;
    product_shape shape[CHOICE_SHAPES];
    int n_deferred;
    struct {
        product_shape *shape;
        const void *W, *x;
        float beta;
    } deferred[CHOICE_DEFERRED];
};

int products_mode(char *err) {
    const char *v = getenv("FLEXGEN_CUDA_PRODUCTS");
    if (!v || !*v || !strcmp(v, "timed")) return PRODUCTS_TIMED;
    if (!strcmp(v, "cublas")) return PRODUCTS_CUBLAS;
    if (!strcmp(v, "cublaslt")) return PRODUCTS_CUBLASLT;
    if (err) fg_fail(err, "FLEXGEN_CUDA_PRODUCTS=%s: expected timed, cublas or cublaslt", v);
    return -1;
}

/* A thread's choices in `mode` (-1, one FLEXGEN_CUDA_PRODUCTS does not name, was refused when the
 * device was opened: timed), made with its cuBLAS handle, outside any capture: with cublasLt's
 * workspace, which the device's reserve counts, unless nothing uses it (cublas), or the device
 * has no room for it (then cublasLt's algorithms that need none). */
static product_choices *products_make(int mode) {
    product_choices *pc = (product_choices *)calloc(1, sizeof *pc);
    if (!pc) cuda_fail("calloc", __FILE__, __LINE__, "out of host memory");
    pc->mode = mode < 0 ? PRODUCTS_TIMED : mode;
    BLAS_CHECK(cublasLtCreate(&pc->lt));
    if (pc->mode != PRODUCTS_CUBLAS) pc->workspace = cuda_alloc(FG_CUDA_PRODUCT_WORKSPACE);
    return pc;
}

static void shape_free(product_shape *s) {
    for (int i = 0; i < CHOICE_CANDIDATES; i++) {
        if (s->start[i]) cudaEventDestroy(s->start[i]);
        if (s->end[i]) cudaEventDestroy(s->end[i]);
        s->start[i] = s->end[i] = NULL;
    }
    if (s->desc) cublasLtMatmulDescDestroy(s->desc);
    if (s->w_layout) cublasLtMatrixLayoutDestroy(s->w_layout);
    if (s->x_layout) cublasLtMatrixLayoutDestroy(s->x_layout);
    if (s->y_layout) cublasLtMatrixLayoutDestroy(s->y_layout);
}

static void products_free(product_choices *pc) {
    if (!pc) return;
    for (int i = 0; i < pc->n_shapes; i++) shape_free(&pc->shape[i]);
    cublasLtDestroy(pc->lt);
    cuda_free(pc->workspace);
    free(pc);
}

void products_reset(int mode) {
    thread_ctx *c = ctx();
    blas();
    wait_stream(); /* timing runs still queued record the events */
    products_free(c->products);
    c->products = products_make(mode);
}

/* The largest power of two up to 256 that divides a device address: the alignment cublasLt's
 * heuristic is told of an operand. */
static unsigned alignment_of(const void *p) {
    unsigned align = 256;
    while (align > 1 && (uintptr_t)p % align) align /= 2;
    return align;
}

/* The stored shape of this product, added the first time (NULL where the table is full). */
static product_shape *shape_of(product_choices *pc, const product_shape *want) {
    for (int i = 0; i < pc->n_shapes; i++) {
        product_shape *s = &pc->shape[i];
        if (s->op_w == want->op_w && s->m == want->m && s->n == want->n && s->k == want->k &&
            s->y_type == want->y_type && s->adds == want->adds && s->align_w == want->align_w &&
            s->align_x == want->align_x && s->align_y == want->align_y)
            return s;
    }
    if (pc->n_shapes == CHOICE_SHAPES) return NULL;
    pc->shape[pc->n_shapes] = *want;
    return &pc->shape[pc->n_shapes++];
}

/* W's rows as cuBLAS sees it (column-major), which are its leading dimension: m x k, or k x m
 * transposed. */
static int w_rows(const product_shape *s) { return s->op_w == CUBLAS_OP_N ? s->m : s->k; }

/* Candidate i of shape s into y: cuBLAS's default (0) or cublasLt's algo[i]. */
static cublasStatus_t run_candidate(const product_shape *s, int i, const void *W, const void *x,
                                    float beta, void *y) {
    product_choices *pc = ctx()->products;
    float one = 1;
    int ldw = w_rows(s);
    if (i == 0)
        return cublasGemmEx(blas(), s->op_w, CUBLAS_OP_N, s->m, s->n, s->k, &one, W, CUDA_R_16F,
                            ldw, x, CUDA_R_16F, s->k, &beta, y, s->y_type, s->m, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT);
    return cublasLtMatmul(pc->lt, s->desc, &one, W, s->w_layout, x, s->x_layout, &beta, y,
                          s->y_layout, y, s->y_layout, &s->algo[i], pc->workspace,
                          pc->workspace ? FG_CUDA_PRODUCT_WORKSPACE : 0, ctx()->stream);
}

/* cublasLt's candidates for shape s, best first as its heuristic ranks them: those that fit the
 * thread's workspace (that need none, where it has none) and the operands' alignments. */
static void lt_candidates(product_shape *s) {
    product_choices *pc = ctx()->products;
    int32_t op = s->op_w;
    uint64_t room = pc->workspace ? FG_CUDA_PRODUCT_WORKSPACE : 0;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t found[CHOICE_ALGOS];
    int n = 0;
    s->candidates = 1;
    BLAS_CHECK(cublasLtMatmulDescCreate(&s->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    BLAS_CHECK(
        cublasLtMatmulDescSetAttribute(s->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof op));
    BLAS_CHECK(cublasLtMatrixLayoutCreate(&s->w_layout, CUDA_R_16F, w_rows(s),
                                          s->op_w == CUBLAS_OP_N ? s->k : s->m, w_rows(s)));
    BLAS_CHECK(cublasLtMatrixLayoutCreate(&s->x_layout, CUDA_R_16F, s->k, s->n, s->k));
    BLAS_CHECK(cublasLtMatrixLayoutCreate(&s->y_layout, s->y_type, s->m, s->n, s->m));
    BLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    BLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &room, sizeof room));
    const cublasLtMatmulPreferenceAttributes_t align_of[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    const uint32_t align[4] = {s->align_w, s->align_x, s->align_y, s->align_y};
    for (int i = 0; i < 4; i++)
        BLAS_CHECK(
            cublasLtMatmulPreferenceSetAttribute(pref, align_of[i], &align[i], sizeof align[i]));
    if (cublasLtMatmulAlgoGetHeuristic(pc->lt, s->desc, s->w_layout, s->x_layout, s->y_layout,
                                       s->y_layout, pref, CHOICE_ALGOS, found,
                                       &n) != CUBLAS_STATUS_SUCCESS)
        n = 0;
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; i < n; i++)
        if (found[i].state == CUBLAS_STATUS_SUCCESS) s->algo[s->candidates++] = found[i].algo;
}

/* The timing runs of shape s, queued on the stream into `out` (y, or the scratch): each candidate
 * once, then CHOICE_RUNS times between its events. Without `out`, or with one less aligned than y,
 * nowhere to time it: settled on cuBLAS's default. */
static void time_candidates(product_shape *s, const void *W, const void *x, float beta, void *out) {
    if (!out || alignment_of(out) < s->align_y) {
        s->state = SETTLED;
        return;
    }
    lt_candidates(s);
    for (int i = 0; i < s->candidates; i++) {
        CUDA_CHECK(cudaEventCreate(&s->start[i]));
        CUDA_CHECK(cudaEventCreate(&s->end[i]));
        s->failed[i] = run_candidate(s, i, W, x, beta, out) != CUBLAS_STATUS_SUCCESS;
        CUDA_CHECK(cudaEventRecord(s->start[i], ctx()->stream));
        for (int r = 0; r < CHOICE_RUNS && !s->failed[i]; r++)
            s->failed[i] = run_candidate(s, i, W, x, beta, out) != CUBLAS_STATUS_SUCCESS;
        CUDA_CHECK(cudaEventRecord(s->end[i], ctx()->stream));
        count(&counts.products_timed, 1 + CHOICE_RUNS);
    }
    note_queued();
    s->state = TIMING;
}

/* Where shape s's timing runs may write: the workspace's scratch, if it holds a y. */
static void *timing_scratch(cuda_ws *d, const product_shape *s) {
    size_t bytes = (size_t)s->m * s->n * (s->y_type == CUDA_R_32F ? 4 : 2);
    return d->q4_scratch && bytes <= d->widen_values * sizeof(__half) ? d->q4_scratch : NULL;
}

void fp16_product(cuda_ws *d, cublasOperation_t op_w, int m, int n, int k, const void *W,
                  const void *x, float beta, void *y, cudaDataType y_type) {
    thread_ctx *c = ctx();
    blas();
    product_choices *pc = c->products;
    product_shape here;
    memset(&here, 0, sizeof here); /* UNTIMED */
    here.op_w = op_w;
    here.m = m;
    here.n = n;
    here.k = k;
    here.y_type = y_type;
    here.adds = beta != 0;
    here.align_w = alignment_of(W);
    here.align_x = alignment_of(x);
    here.align_y = alignment_of(y);
    product_shape *s = NULL;
    if (pc->mode != PRODUCTS_CUBLAS && n <= FG_CUDA_Q4_DIRECT) s = shape_of(pc, &here);
    if (s && s->state == UNTIMED && pc->mode == PRODUCTS_CUBLASLT) {
        lt_candidates(s);
        s->chosen = s->candidates > 1 ? 1 : 0;
        s->state = SETTLED;
    }
    if (s && s->state == UNTIMED && !c->capturing) { /* timed first, into y or the scratch */
        void *out = beta == 0 ? y : timing_scratch(d, s);
        time_candidates(s, W, x, beta, out);
    }
    if (s && s->state == UNTIMED && pc->n_deferred < CHOICE_DEFERRED) { /* after the graph */
        pc->deferred[pc->n_deferred].shape = s;
        pc->deferred[pc->n_deferred].W = W;
        pc->deferred[pc->n_deferred].x = x;
        pc->deferred[pc->n_deferred].beta = beta;
        pc->n_deferred++;
        s->state = DEFERRED;
    }
    int chosen = s && s->state == SETTLED ? s->chosen : 0;
    BLAS_PRODUCT(run_candidate(s ? s : &here, chosen, W, x, beta, y));
}

/* The timing runs put off by a capture, queued after its graph's launch, into the scratch: the
 * weights and x they read are still allocated, and what they hold is no matter to a clock. */
static void products_time_deferred(cuda_ws *d) {
    product_choices *pc = ctx()->products;
    for (int i = 0; pc && i < pc->n_deferred; i++) {
        product_shape *s = pc->deferred[i].shape;
        time_candidates(s, pc->deferred[i].W, pc->deferred[i].x, pc->deferred[i].beta,
                        timing_scratch(d, s));
    }
    if (pc) pc->n_deferred = 0;
}

void products_settle(void) {
    product_choices *pc = ctx()->products;
    for (int i = 0; pc && i < pc->n_shapes; i++) {
        product_shape *s = &pc->shape[i];
        if (s->state != TIMING) continue;
        cudaError_t e = cudaEventQuery(s->end[s->candidates - 1]);
        if (e == cudaErrorNotReady) {
            cudaGetLastError(); /* not an error: the runs are still going */
            continue;
        }
        CUDA_CHECK(e);
        float best = 0;
        s->chosen = 0;
        for (int j = 0; j < s->candidates; j++) {
            float ms = 0;
            CUDA_CHECK(cudaEventElapsedTime(&ms, s->start[j], s->end[j]));
            if (j == 0) best = ms * CHOICE_MARGIN;
            else if (!s->failed[j] && ms < best) {
                best = ms;
                s->chosen = j;
            }
        }
        for (int j = 0; j < s->candidates; j++) {
            CUDA_CHECK(cudaEventDestroy(s->start[j]));
            CUDA_CHECK(cudaEventDestroy(s->end[j]));
            s->start[j] = s->end[j] = NULL;
        }
        s->state = SETTLED;
    }
}

/* ============================================================================================
 * The device: its free memory, and the GPU found once (fg_cuda_backend asks cuda_device_open)
 * ============================================================================================ */

/* The device's free memory (its context already made by ctx()), less 2% of the device for other
 * processes and the driver's own growth. The plan then takes FG_CUDA_RESERVE off it as it does
 * off --gpu-mem: the context, already out of this free memory, is counted twice, on the safe
 * side. */
double cuda_device_memory(void) {
    size_t free_bytes = 0, total = 0;
    ctx();
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    double margin = floor(0.02 * (double)total); /* whole bytes */
    return (double)free_bytes > margin ? (double)free_bytes - margin : 0;
}

static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static char probe_error[FG_ERR_LEN];

/* A kernel of this build, never launched: the driver says whether the build has code for the
 * device by its attributes (has_code_for_device). */
__global__ void code_probe_kernel(void) {}

/* Whether this build has code the GPU runs (its own architecture's, or PTX of an older one that the
 * driver compiles); if not, `why` names the GPU's compute capability and the ones built. A GTX 10xx
 * (6.1) or a V100 (7.0) gets this line rather than a failed first kernel. */
static int has_code_for_device(char *why, size_t n) {
    cudaFuncAttributes attr;
    cudaDeviceProp prop;
    if (cudaFuncGetAttributes(&attr, code_probe_kernel) != cudaErrorNoKernelImageForDevice)
        return 1;
    cudaGetLastError();
    if (cudaGetDeviceProperties(&prop, device_index) != cudaSuccess) {
        prop.major = 0;
        prop.minor = 0;
        prop.name[0] = 0;
    }
    static const int built[] = {__CUDA_ARCH_LIST__};
    char list[128] = "";
    for (size_t i = 0; i < sizeof built / sizeof *built; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d.%d", i ? ", " : "",
                 built[i] / 100, built[i] / 10 % 10);
    snprintf(why, n,
             "GPU %d (%s) has compute capability %d.%d; this build has code for %s and newer",
             device_index, prop.name, prop.major, prop.minor, list);
    return 0;
}

static void probe(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice) {
        snprintf(probe_error, sizeof probe_error,
                 "no GPU (no NVIDIA device, or no driver as new as "
                 "this CUDA %d.%d runtime)",
                 CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
        return;
    }
    if (e != cudaSuccess) {
        snprintf(probe_error, sizeof probe_error, "no usable GPU (%s)", cudaGetErrorString(e));
        return;
    }
    if (n == 0) {
        snprintf(probe_error, sizeof probe_error, "no GPU found");
        return;
    }
    /* stages of a pipeline that share a machine take its GPUs in turn, by their local rank */
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (!local) local = getenv("MPI_LOCALRANKID");
    device_index = local ? atoi(local) % n : 0;
    if (cudaSetDevice(device_index) != cudaSuccess)
        snprintf(probe_error, sizeof probe_error, "cannot use GPU %d", device_index);
    else if (!has_code_for_device(probe_error, sizeof probe_error))
        return; /* probe_error names the GPU's capability and the build's */
    else if (pthread_key_create(&ctx_key, ctx_destroy) != 0)
        snprintf(probe_error, sizeof probe_error, "cannot create a thread key");
    const char *sync = getenv("FLEXGEN_CUDA_SYNC");
    sync_each_kernel = sync && *sync && strcmp(sync, "0");
}

/* A switch of the environment: unset, empty, 0 or 1; -1 (and err) for any other value. */
static int switch_setting(const char *name, char *err) {
    const char *v = getenv(name);
    if (!v || !*v || !strcmp(v, "0") || !strcmp(v, "1")) return 0;
    return fg_fail(err, "%s=%s: expected 0 or 1", name, v);
}

int cuda_settings(char *err) {
    if (switch_setting("FLEXGEN_CUDA_SYNC", err) || switch_setting("FLEXGEN_CUDA_GRAPHS", err))
        return -1;
    return products_mode(err) < 0 ? -1 : 0;
}

int cuda_device_open(char *err) {
    pthread_once(&probe_once, probe);
    if (probe_error[0]) return fg_fail(err, "%s", probe_error);
    return cuda_settings(err);
}
