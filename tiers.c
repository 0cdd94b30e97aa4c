/* tiers.c: the tiers and what lives on them (§4.1, §4.2, §5): each tier's accounting (every byte
 * taken there, or refused), the disk tier's pages in and out, the weights placed in their homes by
 * FlexGen's rule and staged a layer at a time for compute (4-bit where compressed, §5), a block's
 * plan (its buffers on each tier, held against the capacities before anything is allocated) and
 * those buffers allocated. flexgen.c's schedule moves data between what this file places. The map
 * (scripts/check_layout.sh holds each line to the function's definition):
 *
 *    43  tier_take                the tiers: every byte taken here, or refused
 *   107  disk_fetch               disk tier pages in (disk -> cpu); out: disk_release
 *   176  place_tensors            each tensor's home tier, by FlexGen's rule
 *   405  load_weights_into_homes  the weights written into their homes, once
 *   500  load_weight_at           a layer read ahead, converted into a staging arena
 *   604  shape_block              a block's buffers per tier; fg_check_plan below it
 *   890  alloc_block              a block's KV cache and activations on the tiers
 *
 * Below this file: the disk arena's mapping (support/disk_arena.c), the I/O threads
 * (support/io_links.c) and the KV cache's pages (support/kv_pages.c).
 */
#define _GNU_SOURCE
#include "tiers.h"
#include "support/support.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* ============================================================================================
 * Tiers (docs/DESIGN.md, "Glossary": tier): one accounting point each. I/O threads move pages of
 * the disk tier in and out of memory, so the counters sit behind a lock.
 * ============================================================================================ */

const char *const fg_tier_flags[N_TIERS] = {"--gpu-mem", "--cpu-mem", "--disk-mem"};

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
 * The disk tier (support/disk_arena.c maps its files): pages come into memory over the disk -> cpu
 * link and leave over cpu -> disk, counted on the cpu tier while they are in.
 * ============================================================================================ */

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

/* Writes back what was written (cpu -> disk) and drops the pages from memory. */
void disk_release(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes,
                  size_t written) {
    if (!bytes) return;
    drop_pages(a, p, bytes, written > 0);
    if (written) link_add(rt, LINK_CPU_TO_DISK, (double)written);
    tier_add(rt, TIER_CPU, -(double)bytes);
}

void trace_add(fg_runtime *rt, int track, const char *name, int layer, int batch, double start,
               double end) {
    trace_record(&rt->trace, track, name, layer, batch, start, end);
}

/* ============================================================================================
 * Weights on the tiers (§4.2, "Search Space": weight placement). The gpu tier holds fp16
 * working copies, or the 4-bit bytes, which both backends' products read as they are; cpu and
 * disk homes hold fp16 (or 4-bit), loaded into one of two staging arenas while the previous
 * layer computes.
 * ============================================================================================ */

static int in_stage(const fg_model *m, int i) {
    int j = m->layout.tensors[i].layer;
    return j >= m->first_layer && j < m->end_layer;
}

/* The tensor whose home tensor i shares: its tie (lm_head to embed_tokens) when both are in this
 * stage, else -1 (the last stage of a pipeline keeps lm_head's own copy). */
int tied_here(const fg_model *m, int i) {
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

/* Compute reads a staging arena for this tensor: it lives off the gpu tier, or is compressed and
 * the backend's products cannot read it as it is (both of ours read the 4-bit bytes). */
int is_staged(const fg_model *m, const weight_home *h) {
    return h->tier != TIER_GPU || (h->q4 && !m->rt->backend->reads_q4);
}

/* FlexGen's placement rule (init_weight_list), for tensors [first, end) of one of FlexGen's
 * layers: in order, each goes to the tier in which the midpoint of its cumulative size (in
 * elements, as a percentage of the layer's) falls, the tiers taking the percentages in the order
 * disk, cpu, gpu: [0, wn) disk, [wn, wn + wc) cpu, the rest gpu (a midpoint at wn exactly is on
 * the cpu tier). A tied tensor (lm_head, the embedding's table again) is left out: it counts in
 * neither the layer's size nor the sums, and has no home of its own here. */
static void place_tensors(fg_model *m, int first, int end) {
    const fg_percent *pc = &m->rt->policy.percent;
    double disk_end = 100 - pc->wg - pc->wc;
    double cpu_end = disk_end + pc->wc;
    const opt_layout *l = &m->layout;
    double total = 0;
    double counted = 0;
    for (int i = first; i < end; i++)
        if (tied_here(m, i) < 0) total += (double)l->tensors[i].count;
    for (int i = first; i < end; i++) {
        const opt_tensor *t = &l->tensors[i];
        if (tied_here(m, i) >= 0) continue;
        double mid = 100 * (counted + t->count / 2.0) / total;
        counted += (double)t->count;
        m->homes[i].tier = mid < disk_end ? TIER_DISK : mid < cpu_end ? TIER_CPU : TIER_GPU;
    }
}

/* Layer j's tensors. FlexGen's list has an OPT decoder layer as two layers, its attention (q, k,
 * v, out_proj, their layer norm) and its MLP (fc1, fc2, their layer norm), each placed on its own:
 * at --percent 20 80 the out_proj of every layer goes to the gpu, fc2 does not. A LLaMA-family
 * decoder layer (no fc1; FlexGen has no such model) is placed as one list. */
static void place_layer(fg_model *m, int j) {
    int first = m->layer_first[j];
    int end = m->layer_first[j + 1];
    int mlp = first;
    const model_config *c = &m->view.cfg;
    if (j >= 1 && j <= c->n_layers)
        while (mlp < end && m->layout.tensors[mlp].slot != &m->view.layers[j - 1].fc1_w) mlp++;
    place_tensors(m, first, mlp);
    place_tensors(m, mlp, end);
}

/* Every tensor's home, its stored form, and the staging arenas' size. */
void place_weights(fg_model *m) {
    const opt_layout *l = &m->layout;
    for (int j = m->first_layer; j < m->end_layer; j++) place_layer(m, j);
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer]; i++) {
        weight_home *h = &m->homes[i];
        if (tied_here(m, i) >= 0) h->tier = m->homes[tied_here(m, i)].tier;
        h->q4 = is_q4(m, i);
        h->bytes = stored_bytes(m, i);
    }
    /* an arena holds the largest staged layer's working weights and, on a device whose products
     * cannot read 4-bit bytes, the largest compressed tensor's bytes (landing and decompressed in
     * order on one stream). The layer's staged tensors sit one after another, each 64-byte
     * aligned, in the form the products read: a 4-bit tensor as its 4-bit bytes where they read
     * those (a quarter of its fp16 and a little more: OPT-175B's layer takes 1.0 GB, not 3.6) */
    const fg_backend *be = m->rt->backend;
    size_t working = 0;
    size_t landing = 0;
    for (int j = m->first_layer; j < m->end_layer; j++) {
        size_t end = 0;
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            weight_home *h = &m->homes[i];
            if (!is_staged(m, h)) continue;
            int as_codes = h->q4 && be->reads_q4;
            size_t slot = as_codes ? h->bytes : l->tensors[i].count * be->weight_elem;
            h->staged_at = end;
            end += (slot + 63) & ~(size_t)63;
            if (!be->reads_q4 && h->q4 && h->tier != TIER_GPU && h->bytes > landing)
                landing = h->bytes;
        }
        working = end > working ? end : working;
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
void weight_bytes(const fg_model *m, double bytes[N_TIERS], double *max_layer_disk) {
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

void weight_stored_bytes(const fg_model *m, double stored[N_TIERS]) {
    memset(stored, 0, N_TIERS * sizeof *stored);
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer]; i++)
        if (tied_here(m, i) < 0) stored[m->homes[i].tier] += (double)m->homes[i].bytes;
}

static int fill_stored(const fg_model *m, int i, const weight_source *src, void *dst, char *err);

/* The model's dummy-weight file for disk homes (support/weight_file.c): written once to the
 * weight dir, reused after. */
static size_t tensor_stored_bytes(void *m, int i) { return stored_bytes(m, i); }
static int fill_dummy(void *ctx, int i, void *dst, char *err) {
    const fg_model *m = ctx;
    weight_source src = {NULL, m->seed};
    return fill_stored(m, i, &src, dst, err);
}

weight_file weight_file_of(fg_model *m) {
    return (weight_file){m->rt->weight_dir,
                         &m->view.cfg,
                         m->seed,
                         m->rt->policy.compress_weight,
                         &m->layout,
                         m->layer_first,
                         tensor_stored_bytes,
                         fill_dummy,
                         m,
                         m->rt->policy.verbose};
}

/* Frees every home of this stage's tensors (the disk homes' file unmapped) and staging arenas. */
void free_weight_homes(fg_model *m) {
    for (int i = 0; m->homes && i < m->layout.n_tensors; i++) {
        const weight_home *h = &m->homes[i];
        size_t bytes = (size_t)home_bytes(m, h, m->layout.tensors[i].count);
        if (!in_stage(m, i) || tied_here(m, i) >= 0) continue;
        if (h->tier == TIER_GPU) tier_free(m->rt, TIER_GPU, h->q4 ? h->stored : h->gpu, bytes);
        if (h->tier == TIER_CPU) tier_free(m->rt, TIER_CPU, h->stored, bytes);
    }
    for (int b = 0; b < 2; b++) tier_free(m->rt, TIER_GPU, m->staging[b], m->staging_bytes);
    if (m->disk.base) tier_add(m->rt, TIER_DISK, -m->disk_bytes);
    m->rt->capacity[TIER_DISK] -= m->disk_weights_elsewhere;
    arena_close(&m->disk);
}

/* Writes tensor i's values as its home stores them (fp16, or compressed once here, §5). */
static int fill_stored(const fg_model *m, int i, const weight_source *src, void *dst, char *err) {
    const opt_tensor *t = &m->layout.tensors[i];
    if (!m->homes[i].q4) return opt_tensor_fill(&m->layout, i, src, NULL, dst, err);
    if (!src->archive && q4_compress_dummy(&m->layout, i, src->seed, dst) == 0) return 0;
    if (!src->archive) return fg_fail(err, "out of memory compressing %s", t->name);
    /* as loaded: the fp32 values are these, widened */
    fp16 *values = malloc(t->count * sizeof *values);
    /* 1: out of memory */
    int rc = values ? opt_tensor_fill(&m->layout, i, src, NULL, values, err) : 1;
    if (rc == 0 && q4_compress_fp16(values, t->group_outer, t->group_len, t->group_inner, dst))
        rc = 1;
    if (rc == 1) rc = fg_fail(err, "out of memory compressing %s", t->name);
    free(values);
    return rc;
}

/* A home on the gpu tier: written in place where it is host memory, else through the backend. */
static int fill_gpu_home(const fg_model *m, int i, const weight_source *src, void *home,
                         char *err) {
    const fg_backend *be = m->rt->backend;
    const weight_home *h = &m->homes[i];
    /* no second copy of a large tensor */
    if (be->gpu_is_host) return fill_stored(m, i, src, home, err);
    void *stored = malloc(h->bytes);
    if (!stored) return fg_fail(err, "out of memory loading %s", m->layout.tensors[i].name);
    int rc = fill_stored(m, i, src, stored, err);
    if (rc == 0 && h->q4) be->copy_in(home, stored, h->bytes); /* 4-bit as is */
    else if (rc == 0)
        be->weights_in(home, stored, m->layout.tensors[i].count); /* fp16 to working */
    free(stored);
    return rc;
}

void load_progress(const fg_model *m, const char *what, int done, int total) {
    if (m->rt->policy.verbose) fprintf(stderr, "\r%s: layer %d/%d", what, done, total);
    if (m->rt->policy.verbose && done == total) fprintf(stderr, "\n");
}

/* The disk tier's file of the weights' disk homes (`bytes` of them): the dummy-weight file,
 * whose tensors lie at `offsets` (*from_file), or an unnamed file that the checkpoint's values
 * are written into. */
static int map_disk_homes(fg_model *m, double bytes, size_t *offsets, int *from_file, char *err) {
    fg_runtime *rt = m->rt;
    if (tier_take(rt, TIER_DISK, bytes, "the weights", err)) return -1;
    m->disk_bytes = bytes;
    int rc;
    if (!m->has_archive) {
        weight_file f = weight_file_of(m);
        rc = weight_file_map(&f, &m->disk, offsets, err);
        *from_file = 1;
    } else {
        int fd = unnamed_file(rt->offload_dir, "--offload-dir", err);
        rc = -1;
        if (fd >= 0)
            rc = arena_map(&m->disk, fd, (size_t)bytes, "--offload-dir", rt->offload_dir, err);
    }
    if (rc) {
        tier_add(rt, TIER_DISK, -m->disk_bytes);
        m->disk_bytes = 0;
    }
    return rc;
}

/* Tensor i written into its home: allocated on the gpu or cpu tier, or taken from the disk
 * homes' file (offsets[i] into the dummy-weight file when from_file). */
static int fill_home(fg_model *m, int i, const weight_source *src, const size_t *offsets,
                     int from_file, char *err) {
    fg_runtime *rt = m->rt;
    weight_home *h = &m->homes[i];
    if (h->tier == TIER_GPU) {
        void **home = h->q4 ? &h->stored : (void **)&h->gpu;
        size_t bytes = (size_t)home_bytes(m, h, m->layout.tensors[i].count);
        *home = tier_alloc(rt, TIER_GPU, bytes, "the weights", err);
        return *home ? fill_gpu_home(m, i, src, *home, err) : -1;
    }
    if (h->tier == TIER_CPU) {
        int pin = rt->policy.pin_weight;
        h->stored = tier_alloc_pinned(rt, TIER_CPU, h->bytes, "the weights", pin, err);
        return h->stored ? fill_stored(m, i, src, h->stored, err) : -1;
    }
    if (from_file) {
        h->stored = m->disk.base + offsets[i];
        return 0;
    }
    h->stored = arena_take(&m->disk, h->bytes);
    int rc = fill_stored(m, i, src, h->stored, err);
    tier_add(rt, TIER_CPU, (double)h->bytes); /* written pages, until released */
    disk_release(rt, &m->disk, h->stored, h->bytes, 0);
    return rc;
}

/* Writes every tensor into its home (§4.2) and points the view at those on the gpu tier. */
int load_weights_into_homes(fg_model *m, char *err) {
    fg_runtime *rt = m->rt;
    const opt_layout *l = &m->layout;
    double bytes[N_TIERS], max_layer_disk;
    weight_bytes(m, bytes, &max_layer_disk);
    size_t *offsets = calloc((size_t)l->n_tensors, sizeof *offsets);
    if (!offsets) return fg_fail(err, "out of memory");
    int from_file = 0;
    int rc = 0;
    if (bytes[TIER_DISK] > 0) rc = map_disk_homes(m, bytes[TIER_DISK], offsets, &from_file, err);
    weight_source src = {m->has_archive ? &m->archive : NULL, m->seed};
    for (int j = m->first_layer; j < m->end_layer && rc == 0; j++) {
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1] && rc == 0; i++)
            if (tied_here(m, i) < 0) rc = fill_home(m, i, &src, offsets, from_file, err);
        if (m->has_archive)
            load_progress(m, "placing weights", j + 1 - m->first_layer, stage_layers(m));
    }
    free(offsets);
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer] && rc == 0; i++) {
        weight_home *h = &m->homes[i];
        if (tied_here(m, i) >= 0) { /* a tied tensor: its tie's home, staged where it is */
            size_t at = h->staged_at;
            *h = m->homes[tied_here(m, i)];
            h->staged_at = at;
        }
        if (!is_staged(m, h)) *l->tensors[i].slot = h->q4 ? h->stored : h->gpu;
    }
    for (int b = 0; b < 2 && rc == 0 && m->staging_bytes; b++) {
        m->staging[b] = tier_alloc(rt, TIER_GPU, m->staging_bytes, "weight staging", err);
        if (!m->staging[b]) rc = -1;
    }
    if (m->has_archive) { /* every value is in its home now */
        st_close(&m->archive);
        m->has_archive = 0;
    }
    m->loaded = rc == 0;
    return rc;
}

/* ---- loading a layer's weights: disk -> cpu, then cpu -> gpu (Fig. 4, "load weight") ----
 * flexgen.c's load_weight (and the plain loop's load_weight_now) call these for the round's layer
 * n = unit L + j: read_weights, load_weight_at, bind_weights.
 * Layer n (step n / L, layer n % L) is read from disk one layer earlier than Fig. 4 asks, while
 * layer n - 2 computes, so that the disk link reads back to back instead of waiting for each
 * conversion into the gpu tier; the plan counts those two layers of pages in the cpu tier. */

static void weights_fetch_task(fg_runtime *rt, const io_task *task) {
    fg_model *m = task->ctx;
    for (int i = m->layer_first[task->layer]; i < m->layer_first[task->layer + 1]; i++)
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
    char *staging = m->staging[task->arena], *landing = staging + m->landing_at;
    for (int i = m->layer_first[task->layer]; i < m->layer_first[task->layer + 1]; i++) {
        const weight_home *h = &m->homes[i];
        const opt_tensor *t = &m->layout.tensors[i];
        char *working = staging + h->staged_at;
        if (!is_staged(m, h)) continue;
        if (h->q4)
            be->weights_in_q4(working, h->stored, h->tier == TIER_GPU ? NULL : landing,
                              t->group_outer, t->group_len, t->group_inner);
        else be->weights_in(working, h->stored, t->count);
        if (h->tier != TIER_GPU) link_add(rt, LINK_CPU_TO_GPU, (double)h->bytes);
    }
    weights_release(rt, m, task->layer);
}

static void forget_read(fg_model *m, weight_read *r);

/* Starts reading the disk part of layer n into the cpu tier, unless it is read or has none. */
void read_weights(fg_model *m, long n) {
    int j = m->first_layer + (int)(n % stage_layers(m));
    int on_disk = 0;
    weight_read *r = &m->reads[n % 2];
    if (r->n == n) return;
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        on_disk |= m->homes[i].tier == TIER_DISK;
    if (!on_disk) return;
    forget_read(m, r); /* a layer read ahead for a unit that did not come */
    io_task t = {.fn = weights_fetch_task, .name = "read weights", .ctx = m, .layer = j};
    *r = (weight_read){n, io_submit(&m->rt->io, IO_WEIGHT_DISK, t), 0};
}

/* Starts loading layer n into staging arena n % 2 (reading it first if that has not begun). */
void load_weight_at(fg_model *m, long n) {
    int j = m->first_layer + (int)(n % stage_layers(m));
    int buf = (int)(n % 2);
    int staged = 0;
    if (m->staged[buf] == n) return;
    m->staged[buf] = n;
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        staged |= is_staged(m, &m->homes[i]);
    if (!staged) return;
    read_weights(m, n);
    weight_read *r = &m->reads[n % 2];
    uint64_t read = r->n == n ? r->seq : 0;
    if (r->n == n) r->used = 1;
    io_task t = {.fn = weights_in_task,
                 .name = "load weights",
                 .after_link = IO_WEIGHT_DISK,
                 .after_seq = read,
                 .ctx = m,
                 .layer = j,
                 .arena = buf};
    io_submit(&m->rt->io, IO_WEIGHT_HOST, t);
}

/* Points compute at layer n's staged weights (arena n % 2), as it starts: with one layer on a
 * pipeline stage, the arena the next layer loads into is this layer's other one. */
void bind_weights(fg_model *m, long n) {
    int j = m->first_layer + (int)(n % stage_layers(m));
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        if (is_staged(m, &m->homes[i]))
            *m->layout.tensors[i].slot = (fp16 *)(m->staging[n % 2] + m->homes[i].staged_at);
}

/* At the end of a block: layers read ahead for steps that did not come (every sequence
 * stopped) give their pages back. */
static void forget_read(fg_model *m, weight_read *r) {
    if (r->n >= 0 && !r->used) {
        io_wait(&m->rt->io, IO_WEIGHT_DISK, r->seq);
        weights_release(m->rt, m, m->first_layer + (int)(r->n % stage_layers(m)));
    }
    r->n = -1;
}

void forget_reads(fg_model *m) {
    for (int b = 0; b < 2; b++) forget_read(m, &m->reads[b]);
}

/* ============================================================================================
 * A block's plan (§4.1, §4.2): how its sequences split over the tiers, the size of every
 * buffer it holds on each tier, and the plan check that holds all of it, weights included,
 * against the capacities before anything is allocated.
 * ============================================================================================ */

/* n sequences split by percentages (the rest to disk), each tier's count rounded. */
static row_split split_rows(int n, int gpu_pct, int cpu_pct) {
    int gpu = (int)lround(n * gpu_pct / 100.0);
    int gc = (int)lround(n * (gpu_pct + cpu_pct) / 100.0);
    return (row_split){{gpu, gc - gpu, n - gc}};
}

fg_tier row_tier(const row_split *s, int b, int *index) {
    fg_tier t = TIER_GPU;
    while (t < TIER_DISK && b >= s->rows[t]) b -= s->rows[t++];
    *index = b;
    return t;
}

/* A pipeline of M stages keeps M micro-batches in flight (§4.4), each a block of at most
 * gpu_batch_size x num_gpu_batches sequences: prompts go in rounds of *count blocks of *size
 * (fewer prompts make smaller blocks rather than fewer). One process: blocks, one at a time. */
void micro_batches(const fg_model *m, int n_prompts, int *size, int *count) {
    const fg_policy *p = &m->rt->policy;
    int stages = p->n_stages > 1 ? p->n_stages : 1;
    int block = p->gpu_batch_size * p->num_gpu_batches;
    int share = (n_prompts + stages - 1) / stages;
    *size = share < block ? share : block;
    int blocks = (n_prompts + *size - 1) / *size;
    *count = blocks < stages ? blocks : stages;
}

/* A block's shape for a job (§4.2): its GPU batches (gbs sequences each, ngb of them), their rows
 * on each tier, and the bytes of every buffer it holds there. These are the runtime's side of
 * lp.c's memory model (fg_memory_model_build, which the search holds against the capacities, with
 * bls = gbs x ngb, s = max_prompt, len = max_len): each size below is one of its terms, counted
 * the same way, so that a placement the LP finds is one that this plan accepts. The factors:
 *   act_row     hidden x the backend's act_elem (fp16 on a GPU, fp32 on the CPU): lp.c's act_row;
 *   kv_row      one token's K (or V) of one layer, fp16 or 4-bit (opt_kv_row_bytes): its kv_row;
 *   kv_home     x 2 for K and V, x the stage's decoder layers, x the pool's rows (pages x tokens,
 *               kv_pool_shape: each sequence's max_len, or the diagonal's peak): its cache;
 *   act_home    ngb x a tier's rows x max_prompt: one step's activations (its act);
 *   kv_stage    x 2 staging arenas (the iteration computing, the next loading) x 2 for K and V,
 *               for the rows off the gpu tier, stage_len each (the prompt only, when decode reads
 *               the cache in place): its 4 kv_row gbs stage_len;
 *   x_stage     x 2 staging arenas of a GPU batch's rows: its activation staging;
 *   workspace   the backend's (workspace_bytes, prefill in chunks of workspace_rows), delegated
 *               the backend's (delegated_bytes): the same functions as lp.c calls;
 *   logits      x 4: fp32, for every sequence of the block (and each prompt position with
 *               prompt_logits, which lp.c does not plan for): its 4 bls vocab;
 *   transient_cpu  x 2: the disk rows of two iterations in memory at once (one loading, one
 *               storing), each x 2 for K and V, and 2 pages of rounding at their ends: its
 *               2 x 2 kv_row gbs len, 2 act_row gbs s and 4 pages;
 *   act_message, pipe_buffers  activations between pipeline stages (§4.4), not in lp.c's model.
 * The disk homes are rounded up to whole pages. plan_need adds the weights (homes, two staging
 * arenas, two layers read ahead from disk: lp.c's 2 arena and 2 x 2 layer terms) and each
 * micro-batch's own cache and activations (lp.c's micro). */
block_shape shape_block(const fg_model *m, int n_prompts, const int *lens, int max_prompt,
                        int gen_len) {
    const fg_runtime *rt = m->rt;
    const model_config *c = &m->view.cfg;
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
    s.cache = split_rows(s.gbs, p->percent.cg, p->percent.cc);
    s.act = split_rows(s.gbs, p->percent.hg, p->percent.hc);
    s.act_row = (size_t)c->hidden * rt->backend->act_elem;
    s.kv_row = opt_kv_row_bytes(c, p->compress_cache);
    double act_row = (double)s.act_row;
    double kv_row = (double)s.kv_row;
    double staged_rows = s.gbs - s.cache.rows[TIER_GPU];
    int diagonal_blocks = p->schedule == FG_SCHEDULE_DIAGONAL ? s.micro : 0;
    int starts[s.ngb];
    for (int k = 0; k < s.ngb; k++) starts[k] = diagonal_start(k, s.ngb, gen_len);
    /* the KV cache pools, in pages */
    s.kv = kv_pool_shape(&s.cache, s.gbs, s.gbs * s.ngb, s.max_len, n_prompts, lens, gen_len,
                         diagonal_blocks, starts);
    for (int t = 0; t < N_TIERS; t++) {
        s.kv_home[t] = kv_row * m->n_decoder * 2 * s.kv.pool_pages[t] * s.kv.page_tokens;
        s.act_home[t] = act_row * s.ngb * s.act.rows[t] * max_prompt;
    }
    s.kv_home[TIER_DISK] = (double)page_up((size_t)s.kv_home[TIER_DISK]);
    s.act_home[TIER_DISK] = (double)page_up((size_t)s.act_home[TIER_DISK]);
    s.kv_stage = staged_rows > 0 ? 2 * 2 * kv_row * staged_rows * s.stage_len : 0;
    s.x_stage = 2 * act_row * s.gbs * max_prompt;
    s.workspace_rows = fg_workspace_rows(s.gbs, max_prompt);
    s.workspace = (double)rt->backend->workspace_bytes(c, s.workspace_rows, max_prompt, s.max_len);
    if (p->cpu_cache_compute && rt->backend->delegated_bytes) /* decode delegates: a GPU batch */
        s.delegated = (double)rt->backend->delegated_bytes(c, (size_t)s.gbs, s.max_len);
    s.logit_rows = m->prompt_logits ? max_prompt : 1;
    s.logits = is_last_stage(m) ? 4.0 * s.gbs * s.ngb * s.logit_rows * c->vocab : 0;
    s.act_message = (size_t)s.gbs * max_prompt * s.act_row;
    s.pipe_buffers = (double)s.act_message *
                     ((is_last_stage(m) ? 0 : s.micro * s.ngb) + (is_first_stage(m) ? 0 : 2));
    /* a layer's disk cache rows (K and V) and a batch's disk activations, twice (load + store) */
    s.transient_cpu = 2 * (2 * kv_row * s.cache.rows[TIER_DISK] * s.max_len +
                           act_row * s.act.rows[TIER_DISK] * max_prompt + 2 * page_size());
    return s;
}

enum {
    WEIGHTS,
    W_STAGING,
    CACHE,
    C_STAGING,
    ACTS,
    A_STAGING,
    WORK,
    IN_FLIGHT,
    PIPE,
    DELEGATED,
    RESERVE,
    COPY_BUFFERS,
    INT8_COLUMNS,
    N_ITEMS
};
static const char *const plan_items[N_ITEMS] = {"weights",
                                                "weight staging",
                                                "KV cache",
                                                "KV cache staging",
                                                "activations",
                                                "activation staging",
                                                "workspace and logits",
                                                "disk pages in flight",
                                                "activations between stages",
                                                "delegated attention",
                                                "the device's context, cuBLAS and rounding",
                                                "pinned copy buffers",
                                                "int8 columns of the weights"};

/* Each tier's bytes of each item of the plan for a block of shape s (need, zeroed), their total,
 * and of it the weights' (homes, staging arenas, the two disk layers read ahead on the cpu
 * tier). */
static void plan_need(const fg_model *m, const block_shape *s, double need[N_TIERS][N_ITEMS],
                      double total[N_TIERS], double weights[N_TIERS]) {
    const fg_runtime *rt = m->rt;
    double w[N_TIERS], max_layer_disk;
    weight_bytes(m, w, &max_layer_disk);
    for (int t = 0; t < N_TIERS; t++) { /* each micro-batch of a pipeline stage has its own */
        need[t][WEIGHTS] = w[t];
        need[t][CACHE] = s->micro * s->kv_home[t];
        need[t][ACTS] = s->micro * s->act_home[t];
    }
    need[TIER_CPU][PIPE] = s->pipe_buffers;
    need[TIER_GPU][W_STAGING] = 2.0 * m->staging_bytes;
    need[TIER_GPU][C_STAGING] = s->kv_stage;
    need[TIER_GPU][A_STAGING] = s->x_stage;
    need[TIER_GPU][WORK] = s->workspace + s->logits;
    need[TIER_CPU][IN_FLIGHT] = 2 * max_layer_disk + s->transient_cpu;
    need[TIER_CPU][DELEGATED] = s->delegated;
    need[TIER_GPU][RESERVE] = rt->backend->device_reserve;
    need[TIER_CPU][COPY_BUFFERS] = rt->backend->host_reserve;
    need[TIER_GPU][INT8_COLUMNS] = m->int8_columns_bytes;
    for (int t = 0; t < N_TIERS; t++) {
        weights[t] = w[t] + need[t][W_STAGING] + (t == TIER_CPU ? 2 * max_layer_disk : 0);
        total[t] = 0;
        for (int i = 0; i < N_ITEMS; i++) total[t] += need[t][i];
    }
}

void fg_plan_bytes(const fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                   double total[N_TIERS], double weights[N_TIERS]) {
    block_shape s = shape_block(m, n_prompts, lens, max_prompt, gen_len);
    double need[N_TIERS][N_ITEMS] = {{0}};
    plan_need(m, &s, need, total, weights);
}

/* Where tier t's capacity came from: its flag, or fg_runtime_open's default (and on disk, the
 * weight file that count_weight_file set apart). */
static void capacity_source(const fg_model *m, fg_tier t, char *out, size_t len) {
    const fg_runtime *rt = m->rt;
    const char *what[N_TIERS] = {rt->backend->device_memory ? "the device's free memory"
                                                            : "available memory",
                                 "available memory", "the free space of --offload-dir "};
    const char *weight_file = "";
    if (t == TIER_DISK && m->disk_weights_elsewhere > 0)
        weight_file = m->weight_file_found ? " with the weight file already in --path"
                                           : " with the weight file going to --path's file system";
    size_text cap = human(rt->capacity[t]);
    if (rt->policy.capacity[t] > 0) snprintf(out, len, "%s gives %s", fg_tier_flags[t], cap.s);
    else
        snprintf(out, len, "%s%s%s is %s (%s overrides it)", what[t],
                 t == TIER_DISK ? rt->offload_dir : "", weight_file, cap.s, fg_tier_flags[t]);
}

int fg_check_plan(const fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                  char *err) {
    const fg_runtime *rt = m->rt;
    block_shape s = shape_block(m, n_prompts, lens, max_prompt, gen_len);
    if (rt->policy.n_stages > 1 && s.act_message > INT_MAX)
        return fg_fail(err,
                       "--gpu-batch-size %d: a GPU batch's activations (%s at prompt length %d) "
                       "exceed what one MPI message carries (2 GiB)",
                       s.gbs, human((double)s.act_message).s, max_prompt);
    double need[N_TIERS][N_ITEMS] = {{0}}, total[N_TIERS], weights[N_TIERS];
    plan_need(m, &s, need, total, weights);
    for (int t = 0; t < N_TIERS; t++) {
        if (total[t] <= rt->capacity[t]) continue;
        char detail[480] = "";
        for (int i = 0; i < N_ITEMS; i++) {
            size_t len = strlen(detail);
            if (need[t][i] > 0)
                snprintf(detail + len, sizeof detail - len, "%s%s %s", len ? ", " : "",
                         plan_items[i], human(need[t][i]).s);
        }
        char source[sizeof rt->offload_dir + 128];
        capacity_source(m, t, source, sizeof source);
        return fg_fail(err, "%s tier: the plan needs %s (%s), %s", fg_tier_names[t],
                       human(total[t]).s, detail, source);
    }
    /* before loading, a reserve is kept (host_memory_for_plans); after, the weights are resident */
    double made = m->int8_columns.n ? m->int8_columns_bytes : 0; /* resident, as the weights */
    double host =
        m->loaded ? mem_available_bytes() + need[TIER_GPU][WEIGHTS] + need[TIER_CPU][WEIGHTS] + made
                  : host_memory_for_plans();
    if (rt->backend->gpu_is_host && total[TIER_GPU] + total[TIER_CPU] > host)
        return fg_fail(err,
                       "gpu and cpu tiers: the plan needs %s of host memory (gpu %s, "
                       "cpu %s), %s available%s",
                       human(total[TIER_GPU] + total[TIER_CPU]).s, human(total[TIER_GPU]).s,
                       human(total[TIER_CPU]).s, human(host).s,
                       m->loaded ? ""
                                 : " (a sixteenth of the machine's memory is kept for the "
                                   "system)");
    return 0;
}

/* ============================================================================================
 * A block's buffers on the tiers (§4.1), as shape_block sizes them: the homes of its KV cache and
 * activations, and the stage's staging arenas, workspace and logits that its blocks share.
 * ============================================================================================ */

void free_block(block *bl) {
    fg_runtime *rt = bl->rt;
    const block_shape *s = &bl->shape;
    if (!rt) return;
    for (int k = 0; bl->gb && k < s->ngb; k++) gpu_batch_free(&bl->gb[k]);
    free(bl->gb);
    free(bl->done);
    free(bl->ids);
    free(bl->prompt);
    free(bl->step);
    kv_pages_free(&bl->pages);
    rt->stage->close_block(bl);
    if (!bl->borrowed) {
        if (bl->has_ws) {
            rt->backend->workspace_free(bl->ws);
            tier_add(rt, TIER_GPU, -s->workspace);
        }
        if (bl->has_delegated) tier_add(rt, TIER_CPU, -s->delegated);
        tier_free(rt, TIER_GPU, bl->logits, (size_t)s->logits);
        rt->backend->host_free(bl->host_logits);
        for (int b = 0; b < 2; b++) {
            tier_free(rt, TIER_GPU, bl->kv_stage[b], (size_t)s->kv_stage / 2);
            tier_free(rt, TIER_GPU, bl->x_stage[b], (size_t)s->x_stage / 2);
        }
    }
    for (int t = TIER_GPU; t <= TIER_CPU; t++) {
        tier_free(rt, (fg_tier)t, bl->kv_home[t], (size_t)s->kv_home[t]);
        tier_free(rt, (fg_tier)t, bl->act_home[t], (size_t)s->act_home[t]);
    }
    if (bl->disk.base) tier_add(rt, TIER_DISK, -(s->kv_home[TIER_DISK] + s->act_home[TIER_DISK]));
    arena_close(&bl->disk);
    memset(bl, 0, sizeof *bl);
}

/* A stage's buffers that its blocks share (one computes at a time): staging, workspace, logits. */
static int alloc_stage_buffers(block *bl, char *err) {
    fg_runtime *rt = bl->rt;
    const block_shape *s = &bl->shape;
    for (int b = 0; b < 2; b++) {
        if (s->kv_stage) {
            bl->kv_stage[b] =
                tier_alloc(rt, TIER_GPU, (size_t)s->kv_stage / 2, "KV cache staging", err);
            if (!bl->kv_stage[b]) return -1;
        }
        bl->x_stage[b] =
            tier_alloc(rt, TIER_GPU, (size_t)s->x_stage / 2, "activation staging", err);
        if (!bl->x_stage[b]) return -1;
    }
    bl->logits = tier_alloc(rt, TIER_GPU, (size_t)s->logits, "the logits", err);
    if (!bl->logits) return -1;
    /* a step's logits: copied to in one piece; not every prompt position's */
    int pinned = s->logit_rows == 1;
    if (s->logits && !(bl->host_logits = rt->backend->host_alloc((size_t)s->logits, pinned)))
        return fg_fail(err, "out of memory for the logits");
    if (tier_take(rt, TIER_CPU, s->delegated, "delegated attention's host rows", err)) return -1;
    bl->has_delegated = 1;
    if (tier_take(rt, TIER_GPU, s->workspace, "the workspace", err)) return -1;
    bl->ws = &bl->own_ws;
    if (rt->backend->workspace_init(bl->ws, &bl->m->view.cfg, s->workspace_rows, s->max_prompt,
                                    s->max_len, err)) {
        tier_add(rt, TIER_GPU, -s->workspace);
        return -1;
    }
    bl->ws->int8_columns = &bl->m->int8_columns;
    bl->has_ws = 1;
    return 0;
}

/* A block's homes of its KV cache and activations on each tier; the disk tier's are a file of
 * their own in --offload-dir. */
static int alloc_homes(block *bl, char *err) {
    fg_runtime *rt = bl->rt;
    const block_shape *s = &bl->shape;
    for (int t = TIER_GPU; t <= TIER_CPU; t++) {
        if (s->kv_home[t]) {
            bl->kv_home[t] = tier_alloc(rt, (fg_tier)t, (size_t)s->kv_home[t], "the KV cache", err);
            if (!bl->kv_home[t]) return -1;
        }
        if (s->act_home[t]) {
            bl->act_home[t] =
                tier_alloc(rt, (fg_tier)t, (size_t)s->act_home[t], "the activations", err);
            if (!bl->act_home[t]) return -1;
        }
    }
    bl->cpu_cache_in_place =
        bl->kv_home[TIER_CPU] && rt->backend->reads_in_place(bl->kv_home[TIER_CPU]);
    double on_disk = s->kv_home[TIER_DISK] + s->act_home[TIER_DISK];
    if (on_disk <= 0) return 0;
    if (tier_take(rt, TIER_DISK, on_disk, "the KV cache and activations", err)) return -1;
    int fd = unnamed_file(rt->offload_dir, "--offload-dir", err);
    if (fd < 0 ||
        arena_map(&bl->disk, fd, (size_t)on_disk, "--offload-dir", rt->offload_dir, err)) {
        tier_add(rt, TIER_DISK, -on_disk);
        return -1;
    }
    bl->kv_home[TIER_DISK] = arena_take(&bl->disk, (size_t)s->kv_home[TIER_DISK]);
    bl->act_home[TIER_DISK] = arena_take(&bl->disk, (size_t)s->act_home[TIER_DISK]);
    return 0;
}

/* A block (one micro-batch of a pipeline stage) with its KV cache and activations on the tiers;
 * the stage's shared buffers are allocated, or (shared != NULL) borrowed from another block. */
int alloc_block(block *bl, fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                const block *shared, char *err) {
    fg_runtime *rt = m->rt;
    memset(bl, 0, sizeof *bl);
    bl->disk.fd = -1;
    bl->m = m;
    bl->rt = rt;
    bl->shape = shape_block(m, n_prompts, lens, max_prompt, gen_len);
    const block_shape *s = &bl->shape;
    int seqs = s->gbs * s->ngb;
    bl->gb = calloc((size_t)s->ngb, sizeof *bl->gb);
    bl->done = calloc((size_t)seqs, 1);
    bl->ids = calloc((size_t)seqs, sizeof *bl->ids);
    bl->prompt = calloc((size_t)seqs, sizeof *bl->prompt);
    bl->step = calloc((size_t)seqs, sizeof *bl->step);
    if (!bl->gb || !bl->done || !bl->ids || !bl->prompt || !bl->step) {
        free_block(bl);
        return fg_fail(err, "out of memory");
    }
    if (kv_pages_init(&bl->pages, &s->kv, &s->cache, s->gbs, seqs, s->max_len, err)) goto fail;
    for (int k = 0; k < s->ngb; k++) {
        gpu_batch *gb = &bl->gb[k];
        if (gpu_batch_init(gb, s->gbs, s->max_len, max_prompt, err)) goto fail;
        gb->kv_q4 = rt->policy.compress_cache;
        gb->attn_sparsity = rt->policy.attn_sparsity;
        gb->all_rows = m->prompt_logits;
        gb->page_tokens = s->kv.page_tokens;
    }
    if (alloc_homes(bl, err)) goto fail;
    if (!shared && alloc_stage_buffers(bl, err)) goto fail;
    if (shared) {
        bl->borrowed = 1;
        bl->ws = shared->ws;
        bl->logits = shared->logits;
        bl->host_logits = shared->host_logits;
        for (int b = 0; b < 2; b++) {
            bl->kv_stage[b] = shared->kv_stage[b];
            bl->x_stage[b] = shared->x_stage[b];
        }
    }
    if (rt->stage->open_block(bl, shared, err) == 0) return 0;
fail:
    free_block(bl);
    return -1;
}
