/* flexgen.c: FlexGen's zig-zag block schedule (the paper's §4.2, "Compute schedule", Fig. 4):
 * the sequences of a block, in GPU batches, computed layer by layer, with the I/O of the next
 * layer and of the neighbouring GPU batches overlapping each computation.
 *
 *   block_schedule    Fig. 4's three loops, generation step, layer and GPU batch, over the
 *                     paper's verbs: load_weight, store_activation, store_cache, load_cache,
 *                     load_activation, compute, synchronize
 *   the verbs         each queues tasks on the I/O threads (tiers.c) that move one GPU batch's
 *                     KV cache and activations between their homes and a staging arena
 *   generate()        prompts in blocks of gpu_batch_size x num_gpu_batches sequences, sampling
 *
 * A layer's weights are loaded once and used by every GPU batch of the block before the next
 * layer's (§4.2: the block is a column of Fig. 3(b) walked in zig-zag), so the weights cross the
 * links once a block rather than once a batch. Where each tensor lives is weights.c's and
 * plan.c's business; a pipeline stage (§4.4) adds its messages through stage hooks (pipeline.c)
 * that do nothing in a single process.
 */
#define _GNU_SOURCE
#include "runtime.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The hooks at a stage's edges: a pipeline's (pipeline.c), or the single stage's, which do
 * nothing (defined at the end of this file). */
static const stage_hooks single_stage;
static const stage_hooks *stage_of(const fg_runtime *rt) { return rt->stage ? rt->stage : &single_stage; }

/* ============================================================================================
 * A block in flight (§4.1): its GPU batches, their KV cache and activations on the tiers
 * (homes, as plan.c sizes them), and the two staging arenas of the gpu tier that double-buffer
 * what moves: iteration t of the loop computes from arena t % 2 while the other is filled for
 * the next iteration and emptied from the previous one.
 * ============================================================================================ */

/* Sequence b's cache rows of `layer` in GPU batch k: K (kv 0) or V (kv 1), where they live. */
static char *kv_home_rows(const block *bl, int k, int layer, int kv, int b) {
    int r;
    fg_tier t = row_tier(&bl->s.cache, b, &r);
    size_t idx = (((size_t)k * bl->m->n_decoder + layer) * 2 + kv) * bl->s.cache.rows[t] + r;
    return bl->kv_home[t] + idx * bl->s.max_len * bl->s.kv_row;
}

/* The same rows in a KV cache staging arena, where sequences off the gpu tier are staged. */
static char *kv_stage_rows(const block *bl, int arena, int kv, int b) {
    int staged = bl->s.gbs - bl->s.cache.rows[TIER_GPU];
    size_t idx = (size_t)kv * staged + (b - bl->s.cache.rows[TIER_GPU]);
    return bl->kv_stage[arena] + idx * bl->s.stage_len * bl->s.kv_row;
}

/* Sequence b's activation rows in GPU batch k, where they live. */
static char *act_home_rows(const block *bl, int k, int b) {
    int r;
    fg_tier t = row_tier(&bl->s.act, b, &r);
    return bl->act_home[t] + ((size_t)k * bl->s.act.rows[t] + r) * bl->s.max_prompt * bl->s.act_row;
}

static void free_block(block *bl) {
    fg_runtime *rt = bl->rt;
    const block_shape *s = &bl->s;
    if (!rt) return;
    for (int k = 0; bl->gb && k < s->ngb; k++) gpu_batch_free(&bl->gb[k]);
    free(bl->gb);
    free(bl->done);
    free(bl->ids);
    stage_of(rt)->close_block(bl);
    if (!bl->borrowed) {
        if (bl->has_ws) rt->backend->workspace_free(bl->ws), tier_add(rt, TIER_GPU, -s->workspace);
        if (bl->has_delegated) tier_add(rt, TIER_CPU, -s->delegated);
        tier_free(rt, TIER_GPU, bl->logits, (size_t)s->logits);
        free(bl->host_logits);
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

/* A stage's buffers that its blocks share (they compute one at a time): staging, workspace,
 * logits. */
static int alloc_stage_buffers(block *bl, char *err) {
    fg_runtime *rt = bl->rt;
    const block_shape *s = &bl->s;
    for (int b = 0; b < 2; b++) {
        if (s->kv_stage && !(bl->kv_stage[b] = tier_alloc(rt, TIER_GPU, (size_t)s->kv_stage / 2, "KV cache staging", err))) return -1;
        if (!(bl->x_stage[b] = tier_alloc(rt, TIER_GPU, (size_t)s->x_stage / 2, "activation staging", err))) return -1;
    }
    if (!(bl->logits = tier_alloc(rt, TIER_GPU, (size_t)s->logits, "the logits", err))) return -1;
    if (s->logits && !(bl->host_logits = malloc((size_t)s->logits))) return fg_fail(err, "out of memory for the logits");
    if (tier_take(rt, TIER_CPU, s->delegated, "delegated attention's host rows", err)) return -1;
    bl->has_delegated = 1;
    if (tier_take(rt, TIER_GPU, s->workspace, "the workspace", err)) return -1;
    bl->ws = &bl->own_ws;
    if (rt->backend->workspace_init(bl->ws, &bl->m->view.cfg, s->workspace_rows, s->max_len, err)) {
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
    bl->s = shape_block(m, n_prompts, max_prompt, gen_len);
    const block_shape *s = &bl->s;
    int seqs = s->gbs * s->ngb;
    bl->gb = calloc((size_t)s->ngb, sizeof *bl->gb);
    bl->done = calloc((size_t)seqs, 1);
    bl->ids = calloc((size_t)seqs, sizeof *bl->ids);
    if (!bl->gb || !bl->done || !bl->ids) {
        free_block(bl);
        return fg_fail(err, "out of memory");
    }
    for (int k = 0; k < s->ngb; k++)
        if (gpu_batch_init(&bl->gb[k], s->gbs, s->max_len, max_prompt, err)) goto fail;
        else bl->gb[k].kv_q4 = rt->policy.compress_cache, bl->gb[k].attn_sparsity = rt->policy.attn_sparsity,
             bl->gb[k].all_rows = m->prompt_logits;
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
    if (!shared && alloc_stage_buffers(bl, err)) goto fail;
    if (shared) {
        bl->borrowed = 1;
        bl->ws = shared->ws;
        bl->logits = shared->logits, bl->host_logits = shared->host_logits;
        for (int b = 0; b < 2; b++) bl->kv_stage[b] = shared->kv_stage[b], bl->x_stage[b] = shared->x_stage[b];
    }
    if (stage_of(rt)->open_block(bl, shared, err) == 0) return 0;
fail:
    free_block(bl);
    return -1;
}


/* ============================================================================================
 * Moving the KV cache and activations (Fig. 4's load and store of cache and activation). Each
 * verb works on one iteration of the loop: layer j, GPU batch k, the staging arena it uses.
 * ============================================================================================ */

typedef struct {
    int j, k;   /* layer (FlexGen's list: 0 input embedding, 1 .. l decoder, l + 1 output) and
                   GPU batch; j < 0: no such iteration on this stage */
    int arena;  /* the staging arena of its activations and KV cache */
} iteration;

/* For each sequence b of GPU batch k whose rows live off the gpu tier, on tier t. */
#define FOR_OFF_GPU(split, bl, k, b, t)                                                         \
    for (int b = (split).rows[TIER_GPU]; b < (bl)->gb[k].batch; b++)                           \
        for (fg_tier t = tier_of(&(split), b), once_ = 1; once_; once_ = 0)

static int is_decoder_layer(const block *bl, int j) { return j >= 1 && j <= bl->m->view.cfg.n_layers; }
/* Decoder layer j's KV cache among this stage's. */
static int cache_layer(const block *bl, int j) { return j - 1 - bl->m->first_decoder; }
/* Sequence b's K (kv 0) or V (kv 1) rows of a task's layer and GPU batch, in their home. */
static char *task_kv_home(const block *bl, const io_task *task, int kv, int b) {
    return kv_home_rows(bl, task->batch, cache_layer(bl, task->layer), kv, b);
}

static void cache_fetch_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    size_t row = bl->s.kv_row;
    FOR_OFF_GPU(bl->s.cache, bl, task->batch, b, t)
        for (int kv = 0; kv < 2 && t == TIER_DISK; kv++)
            disk_fetch(rt, &bl->disk, task_kv_home(bl, task, kv, b) + (size_t)task->first * row,
                       (size_t)task->count * row);
}

/* V rows that sparse attention reads where they live (kv 1 on the cpu tier, §5). */
static int v_in_place(const block *bl, int kv, fg_tier t) { return bl->sparse_v && kv == 1 && t == TIER_CPU; }

static void cache_in_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    size_t bytes = (size_t)task->count * bl->s.kv_row;
    FOR_OFF_GPU(bl->s.cache, bl, task->batch, b, t)
        for (int kv = 0; kv < 2; kv++) {
            char *home = task_kv_home(bl, task, kv, b);
            if (v_in_place(bl, kv, t)) continue; /* counted as attention reads the kept rows */
            rt->backend->copy_in(kv_stage_rows(bl, task->arena, kv, b), home, bytes);
            link_add(rt, LINK_CPU_TO_GPU, (double)bytes);
            if (t == TIER_DISK) disk_release(rt, &bl->disk, home, bytes, 0);
        }
}

static void cache_out_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    size_t at = (size_t)task->first * bl->s.kv_row, bytes = (size_t)task->count * bl->s.kv_row;
    FOR_OFF_GPU(bl->s.cache, bl, task->batch, b, t)
        for (int kv = 0; kv < 2; kv++) {
            if (!v_in_place(bl, kv, t)) /* else attention wrote the row in place */
                rt->backend->copy_out(task_kv_home(bl, task, kv, b) + at,
                                      kv_stage_rows(bl, task->arena, kv, b) + at, bytes);
            link_add(rt, LINK_GPU_TO_CPU, (double)bytes);
            if (t == TIER_DISK) tier_add(rt, TIER_CPU, (double)bytes); /* until written back */
        }
}

/* Writes back the slots [first, first + count) of the disk rows; with delegation the past rows
 * [0, first) were read in place and leave memory too. */
static void cache_writeback_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    size_t row = bl->s.kv_row, from = bl->delegate ? 0 : (size_t)task->first;
    FOR_OFF_GPU(bl->s.cache, bl, task->batch, b, t)
        for (int kv = 0; kv < 2 && t == TIER_DISK; kv++)
            disk_release(rt, &bl->disk, task_kv_home(bl, task, kv, b) + from * row,
                         (task->first + task->count - from) * row, (size_t)task->count * row);
}

/* A task of iteration `it` on the block. */
static io_task task_at(block *bl, iteration it, void (*fn)(fg_runtime *, const io_task *),
                       const char *name) {
    return (io_task){.fn = fn, .name = name, .ctx = bl, .layer = it.j, .batch = it.k, .arena = it.arena};
}

/* Fig. 4's load_cache: the past of layer j's cache for GPU batch k, into its staging arena
 * (nothing at prefill); with delegation, only disk pages come into memory, and attention reads
 * them in place. */
static void load_cache(block *bl, iteration it) {
    if (it.j < 0 || !is_decoder_layer(bl, it.j)) return;
    const gpu_batch *gb = &bl->gb[it.k];
    if (gb->len == 0 || bl->s.gbs == bl->s.cache.rows[TIER_GPU]) return;
    io_task t = task_at(bl, it, cache_fetch_task, "read cache");
    t.first = 0, t.count = gb->len;
    uint64_t read = bl->s.cache.rows[TIER_DISK] ? io_submit(bl->rt, IO_DISK, t) : 0;
    if (bl->delegate) return;
    t.fn = cache_in_task, t.name = "load cache", t.after_link = IO_DISK, t.after_seq = read;
    io_submit(bl->rt, IO_HOST, t);
}

/* Fig. 4's store_cache: this step's new rows of layer j's cache for GPU batch k, from its
 * staging arena to their home. */
static void store_cache(block *bl, iteration it) {
    if (it.j < 0 || !is_decoder_layer(bl, it.j)) return;
    const gpu_batch *gb = &bl->gb[it.k];
    if (bl->s.gbs == bl->s.cache.rows[TIER_GPU]) return;
    io_task t = task_at(bl, it, cache_out_task, "store cache");
    t.first = gb->len, t.count = gb->n_new;
    uint64_t copied = 0;
    if (!bl->delegate) {
        copied = io_submit(bl->rt, IO_HOST, t);
    } else { /* attention wrote them in place: they came from the compute device all the same */
        size_t bytes = 2 * (size_t)gb->n_new * bl->s.kv_row;
        FOR_OFF_GPU(bl->s.cache, bl, it.k, b, tier) {
            link_add(bl->rt, LINK_GPU_TO_CPU, (double)bytes);
            if (tier == TIER_DISK) tier_add(bl->rt, TIER_CPU, (double)bytes);
        }
    }
    if (!bl->s.cache.rows[TIER_DISK]) return;
    t.fn = cache_writeback_task, t.name = "write cache", t.after_link = IO_HOST, t.after_seq = copied;
    io_submit(bl->rt, IO_DISK, t);
}

/* Activations: the rows of each sequence (n_new tokens) between its home and a staging arena. */
static size_t act_bytes(const block *bl, int k) { return (size_t)bl->gb[k].n_new * bl->s.act_row; }
size_t batch_act_bytes(const block *bl, int k) { return (size_t)bl->gb[k].batch * act_bytes(bl, k); }
static char *x_rows(const block *bl, int arena, int k, int b) { return bl->x_stage[arena] + (size_t)b * act_bytes(bl, k); }

static void act_fetch_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->batch;
    FOR_OFF_GPU(bl->s.act, bl, k, b, t)
        if (t == TIER_DISK) disk_fetch(rt, &bl->disk, act_home_rows(bl, k, b), act_bytes(bl, k));
}

/* Sequence rows of GPU batch k between a staging arena and their homes: in (home -> staging,
 * cpu -> gpu) or out (staging -> home, gpu -> cpu). Rows homed on the gpu tier move no link. */
static void act_move(fg_runtime *rt, block *bl, int k, int arena, int out) {
    size_t bytes = act_bytes(bl, k);
    for (int b = 0; b < bl->gb[k].batch; b++) {
        fg_tier t = tier_of(&bl->s.act, b);
        char *home = act_home_rows(bl, k, b), *x = x_rows(bl, arena, k, b);
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

static void act_in_task(fg_runtime *rt, const io_task *task) { act_move(rt, task->ctx, task->batch, task->arena, 0); }
static void act_out_task(fg_runtime *rt, const io_task *task) { act_move(rt, task->ctx, task->batch, task->arena, 1); }

static void act_writeback_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->batch;
    FOR_OFF_GPU(bl->s.act, bl, k, b, t)
        if (t == TIER_DISK)
            disk_release(rt, &bl->disk, act_home_rows(bl, k, b), act_bytes(bl, k), act_bytes(bl, k));
}

/* The input of iteration `it` (the output of layer j - 1 for GPU batch k) into its staging
 * arena; returns the task to wait for. The stage's first layer takes its input from the stage
 * hooks: in one process that is the input embedding, which reads token ids and needs none. */
static uint64_t activation_in(block *bl, iteration it) {
    if (it.j == bl->m->first_layer) return stage_of(bl->rt)->receive_activations(bl, it.k, it.arena);
    io_task t = task_at(bl, it, act_fetch_task, "read activations");
    uint64_t read = bl->s.act.rows[TIER_DISK] ? io_submit(bl->rt, IO_DISK, t) : 0;
    t.fn = act_in_task, t.name = "load activations", t.after_link = IO_DISK, t.after_seq = read;
    return io_submit(bl->rt, IO_HOST, t);
}

/* Fig. 4's load_activation, for the next iteration. With one GPU batch the next iteration's
 * input is the output this one computes: it loads once stored (load_input_now). */
static void load_activation(block *bl, iteration next) {
    if (next.j >= 0 && bl->n_batches > 1) activation_in(bl, next);
}

/* With one GPU batch there is nothing to overlap an input with: it is the output just stored,
 * loaded now (as FlexGen's loop for one GPU batch does). */
static void load_input_now(block *bl, iteration now) {
    if (bl->n_batches == 1 && now.j > bl->m->first_layer) io_wait(bl->rt, IO_HOST, activation_in(bl, now));
}

/* Fig. 4's store_activation: the output of layer j for GPU batch k, from its staging arena to
 * its home, or (the stage's last layer) to the stage hooks: in one process that is the output
 * embedding, whose result, the logits, stays with the block. */
static void store_activation(block *bl, iteration it) {
    if (it.j < 0) return;
    if (it.j == bl->m->end_layer - 1) {
        stage_of(bl->rt)->send_activations(bl, it.k, it.arena);
        return;
    }
    io_task t = task_at(bl, it, act_out_task, "store activations");
    uint64_t copied = io_submit(bl->rt, IO_HOST, t);
    if (!bl->s.act.rows[TIER_DISK]) return;
    t.fn = act_writeback_task, t.name = "write activations", t.after_link = IO_HOST, t.after_seq = copied;
    io_submit(bl->rt, IO_DISK, t);
}

/* ============================================================================================
 * Compute
 * ============================================================================================ */

/* Points GPU batch k at its iteration's activations and at layer j's cache rows: in their home
 * on the gpu tier (or, delegated, on cpu and disk), in the staging arena otherwise. */
static void bind_batch(block *bl, iteration it) {
    gpu_batch *gb = &bl->gb[it.k];
    gb->x = bl->x_stage[it.arena];
    if (!is_decoder_layer(bl, it.j)) return;
    int layer = cache_layer(bl, it.j);
    for (int b = 0; b < gb->batch; b++) {
        fg_tier t = tier_of(&bl->s.cache, b);
        int home = t == TIER_GPU || bl->delegate;
        gb->k[b] = home ? kv_home_rows(bl, it.k, layer, 0, b) : kv_stage_rows(bl, it.arena, 0, b);
        gb->v[b] = home || v_in_place(bl, 1, t) ? kv_home_rows(bl, it.k, layer, 1, b) : kv_stage_rows(bl, it.arena, 1, b);
        gb->v_rows_read[b] = 0;
    }
}

/* Sequences [first, first + n) of a GPU batch, as a GPU batch of their own. */
static gpu_batch chunk_of(const gpu_batch *gb, int first, int n, size_t act_row) {
    gpu_batch c = *gb;
    c.batch = n;
    c.pad = gb->pad + first;
    c.tokens = gb->tokens + (size_t)first * gb->n_new;
    c.x = (char *)gb->x + (size_t)first * gb->n_new * act_row;
    c.k = gb->k + first, c.v = gb->v + first;
    c.v_rows_read = gb->v_rows_read + first;
    return c;
}

/* Fig. 4's compute: layer j of GPU batch k on the backend (opt_model.c or flexgen.cu), in
 * chunks of as many sequences as the workspace holds (prefill; decode is one chunk). */
static void compute(block *bl, iteration it) {
    static const char *const names[3] = {"input embedding", "decoder layer", "output embedding"};
    const fg_backend *be = bl->rt->backend;
    const opt_weights *w = &bl->m->view;
    gpu_batch *gb = &bl->gb[it.k];
    bind_batch(bl, it);
    int output = it.j > 0 && !is_decoder_layer(bl, it.j);
    bl->out_rows = gb->all_rows ? gb->n_new : 1;
    float *logits = output ? bl->logits + (size_t)it.k * bl->s.gbs * bl->s.logit_rows * w->cfg.vocab : NULL;
    int chunk = (int)(bl->s.workspace_rows / (size_t)gb->n_new);
    double start = now_seconds();
    for (int first = 0; first < gb->batch; first += chunk) {
        gpu_batch part = chunk_of(gb, first, gb->batch - first < chunk ? gb->batch - first : chunk, bl->s.act_row);
        if (it.j == 0) be->embed(w, &part, bl->ws);
        else if (!output) be->layer(w, it.j - 1, &part, bl->ws);
        else be->output(w, &part, bl->ws, logits + (size_t)first * bl->out_rows * w->cfg.vocab);
    }
    for (int b = 0; b < gb->batch && bl->sparse_v && is_decoder_layer(bl, it.j); b++) /* kept V rows */
        if (tier_of(&bl->s.cache, b) == TIER_CPU)
            link_add(bl->rt, LINK_CPU_TO_GPU, (double)gb->v_rows_read[b] * (double)bl->s.kv_row / w->cfg.n_heads);
    double end = now_seconds();
    bl->compute_seconds += end - start;
    trace_add(bl->rt, TRACK_COMPUTE, names[it.j == 0 ? 0 : output ? 2 : 1], it.j, it.k,
              start, end);
}

/* ============================================================================================
 * The block schedule (§4.2, Fig. 4)
 * ============================================================================================ */

/* A generation's state that each round's blocks share. */
typedef struct {
    fg_model *m;
    const gen_options *opt;
    block *blocks;   /* [P]: the stage's micro-batches (one block in one process) */
    int P, B;        /* micro-batches of a round, sequences each at most */
    int *out_tokens;
    float *logits, *scratch;
    gen_timing *timing;
    int base;        /* the round's first prompt */
    long unit;       /* units (a block's step on this stage) begun this round */
    long end;        /* the round's layers that will run (unit L + j): weights load no further */
    int started, prefilled; /* blocks of the round with prompts, and those past prefill */
    double t_prefill;       /* when the last of them finished prefill */
    const char *progress;   /* a line on stderr for each step, or NULL */
} gen_run;

/* The first prompt of the round's block t. */
static int first_prompt(const gen_run *g, int t) { return g->base + t * g->B; }

/* The staging arena of iteration (j, k) of a step: iteration t = (j - first) K + k uses arena
 * t % 2, so the previous and next iterations use the other one. */
static int staging_arena(const block *bl, int j, int k) {
    return ((j - bl->m->first_layer) * bl->n_batches + k) % 2;
}

static iteration at(const block *bl, int j, int k) {
    int in_stage = j >= bl->m->first_layer && j < bl->m->end_layer;
    return in_stage ? (iteration){j, k, staging_arena(bl, j, k)} : (iteration){-1, 0, 0};
}
static iteration before(const block *bl, iteration it) {
    return it.k > 0 ? at(bl, it.j, it.k - 1) : at(bl, it.j - 1, bl->n_batches - 1);
}
static iteration after(const block *bl, iteration it) {
    return it.k + 1 < bl->n_batches ? at(bl, it.j, it.k + 1) : at(bl, it.j + 1, 0);
}

/* Fig. 4's load_weight(i, j + 1, k), once a layer (k == 0): the weights of layer j + 1 (after
 * the stage's last layer, the next unit's first) start loading into the staging arena that
 * layer j does not use, and those of layer j + 2 start coming from disk; layer j's, loaded
 * while the layer before it computed, become what compute reads (weights.c). Layers count
 * across the round's units, g = unit L + j, which is how the arena alternates. */
static void load_weight(gen_run *g, int next_j, int k) {
    if (k > 0) return;
    long next = g->unit * stage_layers(g->m) + (next_j - g->m->first_layer);
    bind_weights(g->m, next - 1);
    if (next < g->end) load_weights(g->m, next);
    if (next + 1 < g->end) read_weights(g->m, next + 1);
}

/* Fig. 4's synchronize: this iteration's loads and stores of cache and activations are done
 * and, after a layer's last GPU batch, the next layer's weights too. On a pipeline stage the
 * compute thread first waits for the next GPU batch's input to arrive (the bubble). */
static void synchronize(block *bl, iteration now) {
    const stage_hooks *stage = stage_of(bl->rt);
    stage->await_input(bl, (now.k + 1) % bl->n_batches);
    io_sync(bl->rt, now.k == bl->n_batches - 1);
    stage->input_taken(bl);
}

static void tokens_back(gen_run *g, block *bl, int i, int first);
static void sample_tokens(block *bl, const gen_options *opt, int step, int first, float *logits_out,
                          float *scratch);

/* Step i of block t begins on this stage, or returns 0 when it does not run. The first stage
 * first takes the block's tokens of step i - 1 (after the last step: only that); a later stage
 * waits for the step's input. Then the input and cache of the stage's first layer load for the
 * first GPU batch: each later one loads while the one before it computes. */
static int step_begins(gen_run *g, int t, int i) {
    block *bl = &g->blocks[t];
    fg_model *m = g->m;
    const fg_policy *p = &m->rt->policy;
    int gen_len = g->opt->gen_len, first = first_prompt(g, t);
    if (bl->running && is_first_stage(m) && i > 0) {
        tokens_back(g, bl, i, first);
        if (i == 1 && ++g->prefilled == g->started) g->t_prefill = now_seconds();
        if (g->progress && t == g->P - 1) fprintf(stderr, "\r%s: token %d/%d", g->progress, i, gen_len);
    }
    if (i == gen_len || !bl->running || !stage_of(m->rt)->step_input(bl)) return 0;
    bl->delegate = p->cpu_cache_compute && i > 0;
    /* a device that reads only its own memory gets the V rows whole (as they are staged) */
    bl->sparse_v = p->attn_sparsity < 1 && i > 0 && !bl->delegate && m->rt->backend->gpu_is_host;
    int last_unit = i + 1 == gen_len && t == g->P - 1;
    g->end = last_unit ? (g->unit + 1) * stage_layers(m) : LONG_MAX;
    iteration start = at(bl, m->first_layer, 0);
    load_cache(bl, start);
    activation_in(bl, start);
    io_sync(m->rt, 0);
    stage_of(m->rt)->input_taken(bl);
    return 1;
}

/* Step i of block t ends: the last iteration's cache and activations are stored, and the last
 * stage chooses the next tokens (and sends them back to the first stage, on a pipeline). */
static void step_ends(gen_run *g, int t, int i) {
    block *bl = &g->blocks[t];
    fg_model *m = g->m;
    iteration last = at(bl, m->end_layer - 1, bl->n_batches - 1);
    store_activation(bl, last);
    store_cache(bl, last);
    io_sync(m->rt, 0);
    for (int k = 0; k < bl->n_batches; k++) bl->gb[k].len += bl->gb[k].n_new, bl->gb[k].n_new = 1;
    g->unit++;
    if (!is_last_stage(m)) return;
    int first = first_prompt(g, t);
    sample_tokens(bl, g->opt, i, first, g->logits, g->scratch);
    stage_of(m->rt)->tokens_out(bl, g->opt, i, first, g->out_tokens);
}

/* Fig. 4: for each generation step i, layer j and GPU batch k, the next layer's weights, the
 * previous batch's results and the next batch's inputs move on the I/O threads while batch k of
 * layer j computes. One process computes one block at a time; a pipeline stage takes the P
 * blocks (micro-batches) of a round in turn at each step, the loop that §4.4 adds. */
static void block_schedule(gen_run *g) {
    int first = g->m->first_layer, end = g->m->end_layer;
    for (int i = 0; i <= g->opt->gen_len; i++)              /* generation step (+1: tokens back) */
        for (int t = 0; t < g->P; t++) {                    /* block (micro-batch) */
            if (!step_begins(g, t, i)) continue;
            block *bl = &g->blocks[t];
            for (int j = first; j < end; j++)               /* layer */
                for (int k = 0; k < bl->n_batches; k++) {   /* GPU batch */
                    iteration now = at(bl, j, k), prev = before(bl, now), next = after(bl, now);
                    load_weight(g, j + 1, k);
                    store_activation(bl, prev);
                    store_cache(bl, prev);
                    load_input_now(bl, now);                /* one GPU batch: just stored */
                    load_cache(bl, next);
                    load_activation(bl, next);
                    compute(bl, now);
                    synchronize(bl, now);
                }
            step_ends(g, t, i);
        }
}

/* ============================================================================================
 * Generation: prompts in rounds of blocks, each through every step
 * ============================================================================================ */

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

/* The logits of sequence s's last token, and of its token t (with prompt_logits, at prefill). */
static const float *logits_row(const block *bl, int s, int t) {
    size_t batch_rows = (size_t)bl->s.gbs * bl->s.logit_rows, row = (size_t)(s % bl->s.gbs) * bl->out_rows + t;
    return bl->host_logits + ((size_t)(s / bl->s.gbs) * batch_rows + row) * bl->m->view.cfg.vocab;
}

/* Prefill's logits of every position of each prompt (its padding left out), in prompt order. */
static void keep_prompt_logits(const block *bl, const gen_options *opt, int first) {
    int vocab = bl->m->view.cfg.vocab, longest = bl->s.max_prompt;
    for (int s = 0; s < bl->count; s++) {
        int pad = bl->gb[s / bl->s.gbs].pad[s % bl->s.gbs], len = bl->out_rows - pad;
        memcpy(opt->prompt_logits + (size_t)(first + s) * longest * vocab, logits_row(bl, s, pad),
               (size_t)len * vocab * sizeof(float));
    }
}

/* The last stage chooses each sequence's next token from its logits (into bl->ids), keeping
 * the logits of sequences still running; with teacher forcing the next token is given.
 * Sampling draws from a generator seeded by (seed, prompt, step), so the tokens do not depend
 * on the block shape or the number of stages. */
static void sample_tokens(block *bl, const gen_options *opt, int step, int first,
                          float *logits_out, float *scratch) {
    int vocab = bl->m->view.cfg.vocab;
    size_t rows = bl->s.logit_rows == 1 ? (size_t)bl->count : (size_t)bl->n_batches * bl->s.gbs * bl->s.logit_rows;
    bl->rt->backend->copy_out(bl->host_logits, bl->logits, rows * vocab * sizeof(float));
    if (opt->prompt_logits && step == 0) keep_prompt_logits(bl, opt, first);
    for (int s = 0; s < bl->count; s++) {
        const float *row = logits_row(bl, s, bl->out_rows - 1);
        int p = first + s;
        if (logits_out && !bl->done[s])
            memcpy(logits_out + ((size_t)p * opt->gen_len + step) * vocab, row, vocab * sizeof(float));
        if (opt->forced) {
            bl->ids[s] = opt->forced[(size_t)p * opt->gen_len + step];
            continue;
        }
        fg_rng rng;
        rng_seed(&rng, opt->seed ^ (((uint64_t)p << 24) + (uint64_t)step) * 0x9e3779b97f4a7c15ULL);
        bl->ids[s] = sample_token(row, vocab, opt->temperature, opt->top_p, &rng, scratch);
    }
}

int take_tokens(block *bl, const gen_options *opt, int step, int first, int *out_tokens) {
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

/* The first stage takes step i - 1's tokens of a block (chosen here with one stage, or come back
 * from the last stage) and sees whether any sequence runs on; a block that stopped is passed on. */
static void tokens_back(gen_run *g, block *bl, int i, int first) {
    const stage_hooks *stage = stage_of(g->m->rt);
    stage->receive_tokens(bl, i - 1);
    bl->running = take_tokens(bl, g->opt, i - 1, first, g->out_tokens) > 0;
    if (i > 1) g->timing->decode_tokens += bl->count;
    if (!bl->running && i < g->opt->gen_len) stage->pass_stop(bl);
}

int check_prompts(const opt_config *c, int n, int *const *prompts, const int *lens, int gen_len,
                  char *err) {
    if (n < 1) return fg_fail(err, "no prompts");
    for (int p = 0; p < n; p++) {
        if (lens[p] < 1) return fg_fail(err, "prompt %d is empty", p + 1);
        if (gen_len - 1 > c->max_pos - lens[p]) /* the last token is not fed back; the sum of
                                                   lens[p] and gen_len may not fit an int */
            return fg_fail(err, "prompt %d: %d tokens + --gen-len %d exceed the model's %d positions",
                        p + 1, lens[p], gen_len, c->max_pos);
        for (int t = 0; t < lens[p]; t++)
            if (prompts[p][t] < 0 || prompts[p][t] >= c->vocab)
                return fg_fail(err, "prompt %d: token id %d out of range [0, %d)", p + 1,
                            prompts[p][t], c->vocab);
    }
    return 0;
}

/* Teacher forcing feeds only ids of the vocab. */
static int check_forced(const opt_config *c, const gen_options *opt, int n_prompts, char *err) {
    for (int p = 0; p < n_prompts; p++)
        for (int i = 0; i < opt->gen_len; i++) {
            int id = opt->forced[(size_t)p * opt->gen_len + i];
            if (id < 0 || id >= c->vocab)
                return fg_fail(err, "prompt %d: forced token %d is id %d, out of range [0, %d)", p + 1,
                               i + 1, id, c->vocab);
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

/* A round: P micro-batches of prompts from g->base through every step (§4.4's iteration-level
 * pipeline: each stage runs step i of micro-batch t while the stage before it runs step i of
 * t + 1 and the one after it step i of t - 1; with one stage, one block, Fig. 4). */
static void run_round(gen_run *g, int *const *prompts, const int *lens, int n_prompts) {
    fg_model *m = g->m;
    g->started = g->prefilled = 0;
    g->unit = 0;
    for (int t = 0; t < g->P; t++) {
        int first = first_prompt(g, t), count = n_prompts - first < g->B ? n_prompts - first : g->B;
        start_block(&g->blocks[t], prompts, lens, first, count > 0 ? count : 0);
        if (count > 0) g->timing->prefill_tokens += (int64_t)count * g->blocks[t].gb[0].n_new, g->started++;
    }
    double t0 = now_seconds();
    g->t_prefill = t0;
    m->staged[0] = m->staged[1] = -1;
    load_weights(m, 0); /* the first layer; every later one is loaded while its predecessor computes */
    io_sync(m->rt, 1);
    block_schedule(g);
    if (is_first_stage(m)) {
        g->timing->prefill_latency += g->t_prefill - t0;
        g->timing->decode_latency += now_seconds() - g->t_prefill;
    }
    for (int t = 0; t < g->P; t++) {
        block *bl = &g->blocks[t];
        stage_of(m->rt)->end_round(bl);
        g->timing->bubble_seconds += bl->bubble, bl->bubble = 0;
        g->timing->compute_seconds += bl->compute_seconds, bl->compute_seconds = 0;
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
    if (rc == 0 && opt->forced) rc = check_forced(c, opt, n_prompts, err);
    m->prompt_logits = opt->prompt_logits != NULL;
    if (rc == 0 && !(g.blocks = open_blocks(m, n_prompts, max_prompt, opt->gen_len, &g.P, err))) rc = -1;
    if (rc == 0 && !(g.scratch = malloc((size_t)2 * c->vocab * sizeof(float)))) rc = fg_fail(err, "out of memory");
    if (stage_of(rt)->agree(rt, rc, err)) { /* every stage is ready, or none starts */
        if (g.blocks) free_blocks(g.blocks, g.P);
        free(g.scratch);
        m->prompt_logits = 0;
        return -1;
    }
    if (logits) memset(logits, 0, (size_t)n_prompts * opt->gen_len * c->vocab * sizeof(float));
    if (opt->prompt_logits) memset(opt->prompt_logits, 0, (size_t)n_prompts * max_prompt * c->vocab * sizeof(float));
    for (size_t i = 0; i < (size_t)n_prompts * opt->gen_len; i++) out_tokens[i] = OPT_PAD_ID;
    memset(timing, 0, sizeof *timing);
    double disk_read_before = rt->disk_read_seconds;
    g.B = g.blocks[0].s.gbs * g.blocks[0].s.ngb;
    int rounds = (n_prompts + g.P * g.B - 1) / (g.P * g.B);
    for (int r = 0; r < rounds; r++) {
        char progress[64];
        snprintf(progress, sizeof progress, "block %d/%d", r + 1, rounds);
        g.base = r * g.P * g.B;
        g.progress = opt->verbose && is_first_stage(m) ? progress : NULL;
        run_round(&g, prompts, prompt_lens, n_prompts);
    }
    if (opt->verbose && is_first_stage(m)) fprintf(stderr, "\n");
    timing->disk_read_seconds = rt->disk_read_seconds - disk_read_before;
    free(g.scratch);
    free_blocks(g.blocks, g.P);
    m->prompt_logits = 0;
    return 0;
}

/* ============================================================================================
 * One process is one stage: its first layer reads token ids, its last gives the logits, and
 * nothing travels between stages. Every hook does nothing.
 * ============================================================================================ */

static int single_agree(fg_runtime *rt, int rc, char *err) { (void)rt, (void)err; return rc ? -1 : 0; }
static int single_open_block(block *bl, const block *shared, char *err) { (void)bl, (void)shared, (void)err; return 0; }
static void single_block(block *bl) { (void)bl; }
static uint64_t single_receive(block *bl, int k, int arena) { (void)bl, (void)k, (void)arena; return 0; }
static void single_send(block *bl, int k, int arena) { (void)bl, (void)k, (void)arena; }
static void single_await(block *bl, int k) { (void)bl, (void)k; }
static int single_step_input(block *bl) { (void)bl; return 1; }
static void single_receive_tokens(block *bl, int step) { (void)bl, (void)step; }
static void single_tokens_out(block *bl, const gen_options *opt, int step, int first, int *out) {
    (void)bl, (void)opt, (void)step, (void)first, (void)out;
}

static const stage_hooks single_stage = {
    .agree = single_agree, .open_block = single_open_block, .close_block = single_block,
    .receive_activations = single_receive, .send_activations = single_send,
    .await_input = single_await, .input_taken = single_block, .step_input = single_step_input,
    .receive_tokens = single_receive_tokens, .tokens_out = single_tokens_out,
    .pass_stop = single_block, .end_round = single_block,
};
