/* flexgen.c: FlexGen's runtime (§4.1, §4.2): the zig-zag block schedule of Fig. 4 (and, on the
 * same loop, the diagonal one of Appendix A.2), the paper's verbs it calls, a block's step and its
 * tokens, and generate(). It reads top-down in the loop's order: the two loops under this map,
 * then Fig. 4's verbs and, right below them, what they move (the rows of the KV cache and
 * activations) and the I/O tasks they hand the links' threads; then the step's edges, the tokens,
 * refill and the diagonal schedule, generate(). What the loops and verbs call from further down
 * is declared above them. The map (scripts/check_layout.sh holds each line to the function's
 * definition):
 *
 *   109  block_schedule           Fig. 4's loops (step, block, layer, GPU batch) over the verbs
 *   140  plain_schedule           the same without overlap (--overlap 0): FlexGen's plain loop
 *   183  at                       an iteration: layer j, GPU batch k, its arena; before, after
 *   225  load_weight              Fig. 4's load_weight; load_weight_now, the plain loop's
 *   244  load_cache               Fig. 4's load_cache; store_cache below it
 *   290  load_activation          Fig. 4's load_activation (its _at, _now); store_activation
 *   326  compute                  layer j of GPU batch k on the backend
 *   359  synchronize              Fig. 4's synchronize; the loop's prologue and epilogue
 *   484  cache_in_task            the verbs' I/O tasks: the cache's, then the activations'
 *   674  step_begins              a block's step: tokens back, pages; step_ends
 *   768  sample_tokens            a block's next tokens from its logits; take_tokens below it
 *   993  refill_slots             ended sequences' slots take the next prompts (--refill)
 *  1011  diagonal_slots           Appendix A.2: the GPU batches staggered, prompts streaming
 *  1170  generate                 prompts in rounds of blocks (run_round)
 *
 * A layer's weights are loaded once and used by every GPU batch of the block before the next
 * layer's (§4.2: the block is a column of Fig. 3(b) walked in zig-zag), so the weights cross the
 * links once a block rather than once a batch. The tiers that the verbs move data between, the
 * weights' homes and staging arenas, a block's plan and its buffers are tiers.c's. The types the
 * loop reads (fg_runtime, fg_model, weight_home, block_shape, block) are in tiers.h. Below this
 * file: tiers.c, the I/O threads and the KV cache's pages (support/io_links.c, kv_pages.c); above
 * it, opening a run and a model (app/runtime.c) and a pipeline's stage hooks (§4.4,
 * app/pipeline.c; in one process they do nothing, app/stage.c).
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ============================================================================================
 * The block schedule (§4.2, Fig. 4), first. Its verbs follow it, each load beside its store,
 * then compute and synchronize, declared here, and what they call from further down is declared
 * below them.
 * ============================================================================================ */

/* Two numberings of layers: the schedule's j runs over FlexGen's list (0 the input embedding,
 * 1 .. l the decoder layers, l + 1 the output embedding); a decoder layer d (0 .. l - 1, as HF
 * numbers model.decoder.layers) is the schedule's j = d + 1. */
typedef struct {
    int j, k;  /* the schedule's layer and GPU batch; j < 0: no such iteration on this stage */
    int arena; /* the staging arena of its activations and KV cache */
} iteration;

/* A generation's state that each round's blocks share. */
typedef struct {
    fg_model *m;
    const gen_options *opt;
    block *blocks; /* [P]: the stage's micro-batches (one block in one process) */
    int P, B;      /* micro-batches of a round, sequences each at most */
    int *out_tokens;
    float *logits, *scratch;
    gen_timing *timing;
    int base;            /* the round's first prompt */
    int *const *prompts; /* the job's prompts, their lengths and how many */
    const int *lens;
    int n_prompts;
    int refill, next;  /* refill (one block): finished sequences' slots take prompt `next` on */
    int diagonal;      /* the diagonal schedule: GPU batches staggered, prompts streaming through */
    int plain;         /* --overlap 0 in one process: the plain loop, plain_schedule */
    int pools_ran_out; /* a KV cache pool ran dry: the schedule held more than its pools' size */
    int steps;         /* the round's last step: gen_len, later where a refill started a prompt */
    int steps_before;  /* steps of the rounds before this one */
    long unit;         /* units (a block's step on this stage) begun this round */
    long end;          /* the round's layers that will run (unit L + j): weights load no further */
    int started, prefilled;    /* blocks of the round with prompts, and those past prefill */
    double t_prefill, t_start; /* when the last of them finished prefill; when generate() began */
    const char *progress;      /* a line on stderr for each step, or NULL */
} gen_run;

static iteration at(const block *bl, int j, int k);
static iteration before(const block *bl, iteration it);
static iteration after(const block *bl, iteration it);
static int step_begins(gen_run *run, int t, int i);
static void load_first_iteration(block *bl);
static void load_weight(gen_run *run, int next_j, int k);
static void load_weight_now(gen_run *run, int j);
static void load_cache(block *bl, iteration it);
static void load_activation(block *bl, iteration next);
static void load_activation_now(block *bl, iteration now);
static uint64_t load_activation_at(block *bl, iteration it);
static void compute(block *bl, iteration it);
static void store_activation(block *bl, iteration it);
static void store_cache(block *bl, iteration it);
static void synchronize(block *bl, iteration now);
static void store_last_iteration(block *bl);
static void step_ends(gen_run *run, int t, int i);

/* Fig. 4: for each generation step i, layer j and GPU batch k, the next layer's weights, the
 * previous batch's results and the next batch's inputs move on the I/O threads while batch k of
 * layer j computes. One process computes one block at a time; a pipeline stage takes the P
 * blocks (micro-batches) of a round in turn at each step, the loop that §4.4 adds. The diagonal
 * schedule of Appendix A.2 runs this same loop: its GPU batches start at staggered steps and take
 * new prompts as theirs end (diagonal_slots), so a step's batches are at different steps of
 * their sequences. */
static void block_schedule(gen_run *run) {
    int first = run->m->first_layer;
    int end = run->m->end_layer;
    for (int i = 0; i <= run->steps; i++)  /* generation step (+1: tokens back) */
        for (int t = 0; t < run->P; t++) { /* block (micro-batch) */
            if (!step_begins(run, t, i)) continue;
            block *bl = &run->blocks[t];
            load_first_iteration(bl);
            for (int j = first; j < end; j++)             /* layer */
                for (int k = 0; k < bl->n_batches; k++) { /* GPU batch */
                    iteration now = at(bl, j, k);
                    iteration prev = before(bl, now);
                    iteration next = after(bl, now);
                    load_weight(run, j + 1, k);
                    store_activation(bl, prev);
                    store_cache(bl, prev);
                    load_activation_now(bl, now); /* one GPU batch: just stored */
                    load_cache(bl, next);
                    load_activation(bl, next);
                    compute(bl, now);
                    synchronize(bl, now);
                }
            store_last_iteration(bl);
            step_ends(run, t, i);
        }
}

/* The same computation without overlap, FlexGen's plain loop (its generation_loop_normal),
 * which --overlap 0 runs in one process: each layer's weights load, then each GPU batch loads
 * its cache and input, computes, and stores both before the next begins. Every placement gives
 * Fig. 4's bits (tests/test_runtime.c, "the plain loop and Fig. 4's"). */
static void plain_schedule(gen_run *run) {
    block *bl = &run->blocks[0];
    for (int i = 0; i <= run->steps; i++) { /* generation step */
        if (!step_begins(run, 0, i)) continue;
        for (int j = run->m->first_layer; j < run->m->end_layer; j++) { /* layer */
            load_weight_now(run, j);
            for (int k = 0; k < bl->n_batches; k++) { /* GPU batch */
                iteration now = at(bl, j, k);
                load_cache(bl, now);
                load_activation_at(bl, now); /* load_activation, of this iteration */
                compute(bl, now);
                store_activation(bl, now);
                store_cache(bl, now);
            }
        }
        step_ends(run, 0, i);
    }
}

/* ============================================================================================
 * Fig. 4's verbs (§4.2): each works on one iteration of the loop (layer j, GPU batch k, the
 * staging arena it uses), submitting its moves to the I/O threads; the iteration's helpers first.
 * ============================================================================================ */

/* Defined below the verbs, with what they move. */
static int any_past(const gpu_batch *gb);
static size_t new_bytes(const block *bl, const gpu_batch *gb, int b);
static void cache_fetch_task(fg_runtime *rt, const io_task *task);
static void cache_in_task(fg_runtime *rt, const io_task *task);
static void cache_out_task(fg_runtime *rt, const io_task *task);
static void cache_writeback_task(fg_runtime *rt, const io_task *task);
static void act_fetch_task(fg_runtime *rt, const io_task *task);
static void act_in_task(fg_runtime *rt, const io_task *task);
static void act_out_task(fg_runtime *rt, const io_task *task);
static void act_writeback_task(fg_runtime *rt, const io_task *task);
static void bind_batch(block *bl, iteration it);

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

/* The schedule's layer j is a decoder layer (not an embedding). */
static int is_decoder_layer(const block *bl, int j) {
    return j >= 1 && j <= bl->m->view.cfg.n_layers;
}

static int decoder_of(int j) { return j - 1; } /* the schedule's layer j, as a decoder layer d */

/* A task of iteration `it` on the block. */
static io_task task_at(block *bl, iteration it, void (*fn)(fg_runtime *, const io_task *),
                       const char *name) {
    return (io_task){
        .fn = fn, .name = name, .ctx = bl, .layer = it.j, .batch = it.k, .arena = it.arena};
}

/* The same task, for another function that waits for one task of another I/O thread. */
static io_task task_after(io_task t, void (*fn)(fg_runtime *, const io_task *), const char *name,
                          int after_link, uint64_t after_seq) {
    t.fn = fn;
    t.name = name;
    t.after_link = after_link;
    t.after_seq = after_seq;
    return t;
}

/* Fig. 4's load_weight(i, j + 1, k), once a layer (k == 0): the weights of layer j + 1 (after
 * the stage's last layer, the next unit's first) start loading into the staging arena that
 * layer j does not use, and those of layer j + 2 start coming from disk; layer j's, loaded
 * while the layer before it computed, become what compute reads (bind_weights). Layers count
 * across the round's units, n = unit L + j, which is how the arena alternates. */
static void load_weight(gen_run *run, int next_j, int k) {
    if (k > 0) return;
    long next = run->unit * stage_layers(run->m) + (next_j - run->m->first_layer);
    bind_weights(run->m, next - 1);
    if (next < run->end) load_weight_at(run->m, next);
    if (next + 1 < run->end) read_weights(run->m, next + 1);
}

/* The plain loop's load_weight: layer j's weights (the unit's layer n = unit L + j) loaded now,
 * with no read-ahead, and what compute reads. */
static void load_weight_now(gen_run *run, int j) {
    long n = run->unit * stage_layers(run->m) + (j - run->m->first_layer);
    load_weight_at(run->m, n);
    bind_weights(run->m, n);
}

/* Fig. 4's load_cache: the past of layer j's cache for GPU batch k, into its staging arena
 * (nothing at prefill); with delegation, only disk pages come into memory, and attention reads
 * them in place. */
static void load_cache(block *bl, iteration it) {
    if (it.j < 0 || !is_decoder_layer(bl, it.j)) return;
    if (!any_past(&bl->gb[it.k]) || bl->shape.gbs == bl->shape.cache.rows[TIER_GPU]) return;
    io_task t = task_at(bl, it, cache_fetch_task, "read cache");
    uint64_t read = bl->shape.cache.rows[TIER_DISK] ? io_submit(&bl->rt->io, IO_DISK, t) : 0;
    if (bl->delegate) return;
    io_submit(&bl->rt->io, IO_HOST, task_after(t, cache_in_task, "load cache", IO_DISK, read));
}

/* Fig. 4's store_cache: this step's new rows of layer j's cache for GPU batch k, from its
 * staging arena to their home. */
static void store_cache(block *bl, iteration it) {
    if (it.j < 0 || !is_decoder_layer(bl, it.j)) return;
    const gpu_batch *gb = &bl->gb[it.k];
    if (bl->shape.gbs == bl->shape.cache.rows[TIER_GPU]) return;
    io_task t = task_at(bl, it, cache_out_task, "store cache");
    uint64_t copied = 0;
    if (!bl->delegate) {
        copied = io_submit(&bl->rt->io, IO_HOST, t);
    } else { /* attention wrote them in place: they came from the compute device all the same */
        for (int b = bl->shape.cache.rows[TIER_GPU]; b < gb->batch; b++) {
            size_t bytes = 2 * new_bytes(bl, gb, b);
            link_add(bl->rt, LINK_GPU_TO_CPU, (double)bytes);
            if (tier_of(&bl->shape.cache, b) == TIER_DISK)
                tier_add(bl->rt, TIER_CPU, (double)bytes);
        }
    }
    if (!bl->shape.cache.rows[TIER_DISK]) return;
    io_submit(&bl->rt->io, IO_DISK,
              task_after(t, cache_writeback_task, "write cache", IO_HOST, copied));
}

/* Fig. 4's load_activation of iteration `it`, which the two below call: its input (the output of
 * layer j - 1 for GPU batch k) into its staging arena; returns the task to wait for. The stage's
 * first layer takes its input from the stage hooks: in one process that is the input embedding,
 * which reads token ids and needs none. */
static uint64_t load_activation_at(block *bl, iteration it) {
    if (it.j == bl->m->first_layer) return bl->rt->stage->receive_activations(bl, it.k, it.arena);
    io_task t = task_at(bl, it, act_fetch_task, "read activations");
    uint64_t read = bl->shape.act.rows[TIER_DISK] ? io_submit(&bl->rt->io, IO_DISK, t) : 0;
    return io_submit(&bl->rt->io, IO_HOST,
                     task_after(t, act_in_task, "load activations", IO_DISK, read));
}

/* Fig. 4's load_activation, for the next iteration. With one GPU batch the next iteration's
 * input is the output this one computes: it loads once stored (load_activation_now). */
static void load_activation(block *bl, iteration next) {
    if (next.j >= 0 && bl->n_batches > 1) load_activation_at(bl, next);
}

/* Fig. 4's load_activation with one GPU batch: there is nothing to overlap an input with, as it
 * is the output just stored, so it loads now (as FlexGen's loop for one GPU batch does). */
static void load_activation_now(block *bl, iteration now) {
    if (bl->n_batches == 1 && now.j > bl->m->first_layer)
        io_wait(&bl->rt->io, IO_HOST, load_activation_at(bl, now));
}

/* Fig. 4's store_activation: the output of layer j for GPU batch k, from its staging arena to
 * its home, or (the stage's last layer) to the stage hooks: in one process that is the output
 * embedding, whose result, the logits, stays with the block. */
static void store_activation(block *bl, iteration it) {
    if (it.j < 0) return;
    if (it.j == bl->m->end_layer - 1) {
        bl->rt->stage->send_activations(bl, it.k, it.arena);
        return;
    }
    io_task t = task_at(bl, it, act_out_task, "store activations");
    uint64_t copied = io_submit(&bl->rt->io, IO_HOST, t);
    if (!bl->shape.act.rows[TIER_DISK]) return;
    t = task_after(t, act_writeback_task, "write activations", IO_HOST, copied);
    io_submit(&bl->rt->io, IO_DISK, t);
}

/* The logits the output layer gave each sequence of GPU batch k at this step: its rows in flight
 * with prompt_logits (a GPU batch's own, padded to its longest prompt), else 1. */
static int out_rows(const block *bl, int k) {
    const gpu_batch *gb = &bl->gb[k];
    return gb->all_rows ? gb->n_new : 1;
}

/* Fig. 4's compute: layer j of GPU batch k on the backend (opt_model.c or flexgen.cu), in
 * chunks of as many sequences as the workspace holds (prefill; decode is one chunk). */
static void compute(block *bl, iteration it) {
    static const char *const names[3] = {"input embedding", "decoder layer", "output embedding"};
    const model_weights *w = &bl->m->view;
    const fg_forward *f = &bl->rt->backend->forward[w->cfg.family];
    gpu_batch *gb = &bl->gb[it.k];
    if (gb->batch == 0) return; /* an idle GPU batch (the diagonal schedule's warm-up and end) */
    bind_batch(bl, it);
    int output = it.j > 0 && !is_decoder_layer(bl, it.j);
    size_t batch_logits = (size_t)bl->shape.gbs * bl->shape.logit_rows * w->cfg.vocab;
    float *logits = output ? bl->logits + (size_t)it.k * batch_logits : NULL;
    int chunk = (int)(bl->shape.workspace_rows / (size_t)gb->n_new);
    double start = now_seconds();
    for (int first = 0; first < gb->batch; first += chunk) {
        int n = gb->batch - first < chunk ? gb->batch - first : chunk;
        gpu_batch part = gpu_batch_slice(gb, first, n, bl->shape.act_row);
        if (it.j == 0) f->embed(w, &part, bl->ws);
        else if (!output) f->layer(w, decoder_of(it.j), &part, bl->ws);
        else
            f->output(w, &part, bl->ws, logits + (size_t)first * out_rows(bl, it.k) * w->cfg.vocab);
    }
    /* kept V rows */
    for (int b = 0; b < gb->batch && bl->sparse_v && is_decoder_layer(bl, it.j); b++)
        if (tier_of(&bl->shape.cache, b) == TIER_CPU)
            link_add(bl->rt, LINK_CPU_TO_GPU,
                     (double)gb->v_rows_read[b] * (double)bl->shape.kv_row / cfg_kv_heads(&w->cfg));
    double end = now_seconds();
    bl->compute_seconds += end - start;
    trace_add(bl->rt, TRACK_COMPUTE, names[it.j == 0 ? 0 : output ? 2 : 1], it.j, it.k, start, end);
}

/* Fig. 4's synchronize: this iteration's loads and stores of cache and activations are done
 * and, after a layer's last GPU batch, the next layer's weights too. On a pipeline stage the
 * compute thread first waits for the next GPU batch's input to arrive (the bubble). */
static void synchronize(block *bl, iteration now) {
    const stage_hooks *stage = bl->rt->stage;
    stage->await_input(bl, (now.k + 1) % bl->n_batches);
    io_sync(&bl->rt->io, now.k == bl->n_batches - 1);
    stage->input_taken(bl);
}

/* Fig. 4's prologue: the input and cache of the stage's first layer load for the first GPU
 * batch; each later one loads while the one before it computes. */
static void load_first_iteration(block *bl) {
    iteration start = at(bl, bl->m->first_layer, 0);
    load_cache(bl, start);
    load_activation_at(bl, start);
    io_sync(&bl->rt->io, 0);
    bl->rt->stage->input_taken(bl);
}

/* Fig. 4's epilogue: the last iteration's activations and cache are stored (each earlier one's
 * while the next computed). */
static void store_last_iteration(block *bl) {
    iteration last = at(bl, bl->m->end_layer - 1, bl->n_batches - 1);
    store_activation(bl, last);
    store_cache(bl, last);
}

/* ============================================================================================
 * What the verbs move (§4.1): a block's KV cache and activations on the tiers (homes, as
 * shape_block sizes them), and the two staging arenas of the gpu tier that double-buffer what
 * moves: iteration t of the loop computes from arena t % 2 while the other is filled for the next
 * iteration and emptied from the previous one. Where each row lives, then the verbs' I/O tasks.
 * ============================================================================================ */

/* The pool of `layer`'s K (kv 0) or V (kv 1) on tier t: page p holds rows p * page_tokens on. */
static char *kv_pool(const block *bl, fg_tier t, int layer, int kv) {
    const block_shape *s = &bl->shape;
    size_t pool_rows = (size_t)s->kv.pool_pages[t] * s->kv.page_tokens;
    return bl->kv_home[t] + ((size_t)layer * 2 + kv) * pool_rows * s->kv_row;
}

/* Token j of slot `slot`'s cache of `layer`, K or V, where it lives: through its page table. */
static char *kv_home_row(const block *bl, int slot, int layer, int kv, int j) {
    size_t row = kv_page_row(slot_pages(&bl->pages, slot), bl->shape.kv.page_tokens, j);
    return kv_pool(bl, slot_tier(&bl->pages, slot), layer, kv) + row * bl->shape.kv_row;
}

/* The tokens from j on that lie in order in the cache (to `end`, or the end of j's page). */
static int run_in_page(const block *bl, int j, int end) {
    int page_end = (j / bl->shape.kv.page_tokens + 1) * bl->shape.kv.page_tokens;
    return (page_end < end ? page_end : end) - j;
}

/* The tokens of slot `slot`'s cache from j on (to `end`) that lie one after another in its pool:
 * j's page and each next page that its table puts right after the one before. A run moves as one
 * copy, however many pages it spans. */
static int run_in_pool(const block *bl, int slot, int j, int end) {
    const int *pages = slot_pages(&bl->pages, slot);
    int page_tokens = bl->shape.kv.page_tokens;
    int n = run_in_page(bl, j, end);
    while (j + n < end && pages[(j + n) / page_tokens] == pages[(j + n) / page_tokens - 1] + 1)
        n += run_in_page(bl, j + n, end);
    return n;
}

/* The same rows in a KV cache staging arena, where sequences off the gpu tier are staged. */
static char *kv_stage_rows(const block *bl, int arena, int kv, int b) {
    int staged = bl->shape.gbs - bl->shape.cache.rows[TIER_GPU];
    size_t idx = (size_t)kv * staged + (b - bl->shape.cache.rows[TIER_GPU]);
    return bl->kv_stage[arena] + idx * bl->shape.stage_len * bl->shape.kv_row;
}

/* Sequence b's activation rows in GPU batch k, where they live: in batch k's part of its tier's
 * home (max_prompt rows a sequence), this step's rows of the tier's sequences one after another,
 * so that they move in one copy. */
static char *act_home_rows(const block *bl, int k, int b) {
    int r;
    fg_tier t = row_tier(&bl->shape.act, b, &r);
    size_t part = (size_t)k * bl->shape.act.rows[t] * bl->shape.max_prompt;
    return bl->act_home[t] + (part + (size_t)r * bl->gb[k].n_new) * bl->shape.act_row;
}

/* Layer j's KV cache among this stage's decoder layers'. */
static int cache_layer(const block *bl, int j) { return decoder_of(j) - bl->m->first_decoder; }

/* Sequence b of a task's GPU batch: its slot in the block. */
static int task_slot(const block *bl, const io_task *task, int b) {
    return task->batch * bl->shape.gbs + b;
}

/* Token j of sequence b's K (kv 0) or V (kv 1) of a task's layer and GPU batch, in its home. */
static char *task_kv_row(const block *bl, const io_task *task, int kv, int b, int j) {
    return kv_home_row(bl, task_slot(bl, task, b), cache_layer(bl, task->layer), kv, j);
}

/* Sequence b's tokens in its cache before this step, and those this step adds (its rows that are
 * not padding), in bytes of one layer's K (or V). */
static size_t past_bytes(const block *bl, const gpu_batch *gb, int b) {
    return (size_t)gb->past[b] * bl->shape.kv_row;
}

static size_t new_bytes(const block *bl, const gpu_batch *gb, int b) {
    return (size_t)(gb->n_new - gb->pad[b]) * bl->shape.kv_row;
}

/* The verbs' tasks below walk a GPU batch's sequences whose rows live off the gpu tier: a split
 * (block_shape's cache and act) homes a GPU batch's first rows on the gpu tier, the next on cpu,
 * the rest on disk, so those are the sequences from split.rows[TIER_GPU] on. */

static void cache_fetch_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const gpu_batch *gb = &bl->gb[task->batch];
    for (int b = bl->shape.cache.rows[TIER_GPU]; b < gb->batch; b++) {
        if (tier_of(&bl->shape.cache, b) != TIER_DISK) continue;
        for (int kv = 0; kv < 2; kv++)
            for (int j = 0, n; j < gb->past[b]; j += n) {
                n = run_in_pool(bl, task_slot(bl, task, b), j, gb->past[b]);
                disk_fetch(rt, &bl->disk, task_kv_row(bl, task, kv, b, j), n * bl->shape.kv_row);
            }
    }
}

/* V rows that sparse attention reads where they live (kv 1 on the cpu tier, §5). */
static int v_in_place(const block *bl, int kv, fg_tier t) {
    return bl->sparse_v && kv == 1 && t == TIER_CPU;
}

static void cache_in_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const gpu_batch *gb = &bl->gb[task->batch];
    size_t row = bl->shape.kv_row;
    for (int b = bl->shape.cache.rows[TIER_GPU]; b < gb->batch; b++) {
        fg_tier t = tier_of(&bl->shape.cache, b);
        for (int kv = 0; kv < 2; kv++) {
            if (v_in_place(bl, kv, t)) continue; /* counted as attention reads the kept rows */
            char *stage = kv_stage_rows(bl, task->arena, kv, b);
            /* a run of pages at a time, into rows in order */
            for (int j = 0, n; j < gb->past[b]; j += n) {
                n = run_in_pool(bl, task_slot(bl, task, b), j, gb->past[b]);
                char *home = task_kv_row(bl, task, kv, b, j);
                rt->backend->copy_in(stage + j * row, home, n * row);
                if (t == TIER_DISK) disk_release(rt, &bl->disk, home, n * row, 0);
            }
            link_add(rt, LINK_CPU_TO_GPU, (double)past_bytes(bl, gb, b));
        }
    }
}

static void cache_out_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const gpu_batch *gb = &bl->gb[task->batch];
    size_t row = bl->shape.kv_row;
    for (int b = bl->shape.cache.rows[TIER_GPU]; b < gb->batch; b++) {
        fg_tier t = tier_of(&bl->shape.cache, b);
        for (int kv = 0; kv < 2; kv++) {
            size_t bytes = new_bytes(bl, gb, b);
            int end = gb->past[b] + (int)(bytes / row);
            char *stage = kv_stage_rows(bl, task->arena, kv, b);
            /* else attention wrote them in place */
            for (int j = gb->past[b], n; j < end && !v_in_place(bl, kv, t); j += n) {
                n = run_in_pool(bl, task_slot(bl, task, b), j, end);
                rt->backend->copy_out(task_kv_row(bl, task, kv, b, j), stage + j * row, n * row);
            }
            link_add(rt, LINK_GPU_TO_CPU, (double)bytes);
            if (t == TIER_DISK) tier_add(rt, TIER_CPU, (double)bytes); /* until written back */
        }
    }
    rt->backend->copies_done(); /* in their homes before they are read there or written to disk */
}

/* Writes back this step's new slots of the disk rows; with delegation the past rows were read
 * in place and leave memory too. */
static void cache_writeback_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    const gpu_batch *gb = &bl->gb[task->batch];
    for (int b = bl->shape.cache.rows[TIER_GPU]; b < gb->batch; b++) {
        if (tier_of(&bl->shape.cache, b) != TIER_DISK) continue;
        int past = gb->past[b];
        int from = bl->delegate ? 0 : past;
        int end = past + gb->n_new - gb->pad[b];
        for (int kv = 0; kv < 2; kv++)
            for (int j = from, n; j < end; j += n) {
                n = run_in_pool(bl, task_slot(bl, task, b), j, end);
                int written = j + n - (j > past ? j : past); /* of these rows, this step's */
                disk_release(rt, &bl->disk, task_kv_row(bl, task, kv, b, j), n * bl->shape.kv_row,
                             written > 0 ? written * bl->shape.kv_row : 0);
            }
    }
}

static int any_past(const gpu_batch *gb) {
    for (int b = 0; b < gb->batch; b++)
        if (gb->past[b] > 0) return 1;
    return 0;
}

/* Activations: the rows of each sequence (n_new tokens) between its home and a staging arena. */
static size_t act_bytes(const block *bl, int k) {
    return (size_t)bl->gb[k].n_new * bl->shape.act_row;
}

size_t batch_act_bytes(const block *bl, int k) {
    return (size_t)bl->gb[k].batch * act_bytes(bl, k);
}

static char *x_rows(const block *bl, int arena, int k, int b) {
    return bl->x_stage[arena] + (size_t)b * act_bytes(bl, k);
}

static void act_fetch_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->batch;
    for (int b = bl->shape.act.rows[TIER_GPU]; b < bl->gb[k].batch; b++)
        if (tier_of(&bl->shape.act, b) == TIER_DISK)
            disk_fetch(rt, &bl->disk, act_home_rows(bl, k, b), act_bytes(bl, k));
}

/* Sequence rows of GPU batch k between a staging arena and their homes: in (home -> staging,
 * cpu -> gpu) or out (staging -> home, gpu -> cpu), a tier's sequences at a time. Rows homed on
 * the gpu tier move no link. */
static void act_move(fg_runtime *rt, block *bl, int k, int arena, int out) {
    for (int b = 0, n; b < bl->gb[k].batch; b += n) {
        fg_tier t = tier_of(&bl->shape.act, b);
        for (n = 1; b + n < bl->gb[k].batch && tier_of(&bl->shape.act, b + n) == t; n++) {}
        size_t bytes = n * act_bytes(bl, k);
        char *home = act_home_rows(bl, k, b);
        char *x = x_rows(bl, arena, k, b);
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
    act_move(rt, task->ctx, task->batch, task->arena, 0);
}

static void act_out_task(fg_runtime *rt, const io_task *task) {
    act_move(rt, task->ctx, task->batch, task->arena, 1);
    rt->backend->copies_done(); /* in their homes before they are written to disk */
}

static void act_writeback_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->batch;
    size_t bytes = act_bytes(bl, k);
    for (int b = bl->shape.act.rows[TIER_GPU]; b < bl->gb[k].batch; b++)
        if (tier_of(&bl->shape.act, b) == TIER_DISK)
            disk_release(rt, &bl->disk, act_home_rows(bl, k, b), bytes, bytes);
}

/* Points GPU batch k at its iteration's activations and at layer j's cache rows: in their home
 * on the gpu tier (or, delegated, on cpu and disk), in the staging arena otherwise. */
static void bind_batch(block *bl, iteration it) {
    gpu_batch *gb = &bl->gb[it.k];
    gb->x = bl->x_stage[it.arena];
    if (!is_decoder_layer(bl, it.j)) return;
    int layer = cache_layer(bl, it.j);
    for (int b = 0; b < gb->batch; b++) {
        int slot = it.k * bl->shape.gbs + b;
        fg_tier t = tier_of(&bl->shape.cache, b);
        int home = t == TIER_GPU || bl->delegate;
        int v_home = home || v_in_place(bl, 1, t);
        gb->k[b] = home ? kv_pool(bl, t, layer, 0) : kv_stage_rows(bl, it.arena, 0, b);
        gb->v[b] = v_home ? kv_pool(bl, t, layer, 1) : kv_stage_rows(bl, it.arena, 1, b);
        gb->k_pages[b] = home ? slot_pages(&bl->pages, slot) : NULL; /* staged rows are in order */
        gb->v_pages[b] = v_home ? slot_pages(&bl->pages, slot) : NULL;
        gb->kv_in_host[b] = bl->delegate && t != TIER_GPU;
        gb->v_rows_read[b] = 0;
    }
}

/* ============================================================================================
 * A block's step on this stage: it begins (the tokens of the step before taken, its pages grown,
 * how it reads chosen) and ends (what moved is in place, the next tokens chosen).
 * ============================================================================================ */

static void tokens_back(gen_run *run, block *bl, int i);
static void refill_slots(gen_run *run, block *bl, int i);
static void diagonal_slots(gen_run *run, block *bl, int i);
static void end_sequence(gen_run *run, block *bl, int s);
static void sample_tokens(block *bl, const gen_options *opt, float *logits_out, float *scratch);
static void tokens_of_last_step(gen_run *run, int t, int i);
static int grow_pages(block *bl);
static void choose_step_reads(gen_run *run, int t, int i);

/* The backend's counters of what the host asked of the device (CUDA's; zeros on the CPU). */
static void device_counts_now(const fg_runtime *rt, fg_device_counts *c) {
    memset(c, 0, sizeof *c);
    if (rt->backend->counts) rt->backend->counts(c);
}

/* A step's counts, from `start`, into the timing (prefill or decode steps) and the trace. */
static void count_step(fg_runtime *rt, gen_timing *t, const fg_device_counts *start, int decode) {
    if (!rt->backend->counts) return;
    fg_device_counts end;
    fg_device_counts step;
    device_counts_now(rt, &end);
    device_counts_diff(&end, start, &step);
    t->device_counted = 1;
    device_counts_add(decode ? &t->decode_counts : &t->prefill_counts, &step, 0);
    if (decode) device_counts_add(&t->decode_step_most, &step, 1);
    t->decode_steps += decode;
    trace_record_counts(&rt->trace, now_seconds(), &step);
}

/* Step i of block t begins on this stage, or returns 0 when it does not run. The first stage
 * first takes the block's tokens of step i - 1 (after the last step: only that); a later stage
 * waits for the step's input. */
static int step_begins(gen_run *run, int t, int i) {
    block *bl = &run->blocks[t];
    if (bl->running && i > 0) tokens_of_last_step(run, t, i);
    if (i == run->steps || !bl->running || !run->m->rt->stage->step_input(bl)) return 0;
    if (grow_pages(bl)) { /* a bug: the block stops */
        run->pools_ran_out = 1;
        bl->running = 0;
        return 0;
    }
    choose_step_reads(run, t, i);
    device_counts_now(run->m->rt, &bl->step_start);
    return 1;
}

/* The first stage takes step i - 1's tokens of block t; with refill or the diagonal schedule,
 * ended sequences' slots take new prompts (on every stage: each lays its GPU batches out alike);
 * the time of prefill and the progress line are noted. */
static void tokens_of_last_step(gen_run *run, int t, int i) {
    block *bl = &run->blocks[t];
    if (is_first_stage(run->m)) tokens_back(run, bl, i);
    if (run->diagonal) diagonal_slots(run, bl, i);
    else if (run->refill) refill_slots(run, bl, i);
    if (i == 1 && ++run->prefilled == run->started) run->t_prefill = now_seconds();
    if (run->progress && t == run->P - 1)
        fprintf(stderr, "\r%s: token %d/%d", run->progress, i, run->steps);
}

/* Each sequence's pages hold its tokens of this step. */
static int grow_pages(block *bl) {
    int rc = 0;
    for (int k = 0; k < bl->n_batches; k++)
        for (int b = 0; b < bl->gb[k].batch && rc == 0; b++)
            rc = kv_pages_grow(&bl->pages, k * bl->shape.gbs + b,
                               bl->gb[k].past[b] + bl->gb[k].n_new - bl->gb[k].pad[b]);
    return rc;
}

/* How step i reads: decode attention over cpu and disk caches in place (--cpu-cache-compute), the
 * kept V rows of sparse attention in place (where the device reads the cpu tier's pool: the CPU,
 * or a GPU from pinned memory; otherwise they are staged whole), and how far ahead the weights
 * load (no further than the round's last unit, unless a refill may start another). */
static void choose_step_reads(gen_run *run, int t, int i) {
    block *bl = &run->blocks[t];
    const fg_runtime *rt = run->m->rt;
    bl->delegate = rt->policy.cpu_cache_compute && i > 0;
    bl->sparse_v = rt->policy.attn_sparsity < 1 && i > 0 && !bl->delegate && bl->cpu_cache_in_place;
    int last_unit = i + 1 == run->steps && t == run->P - 1 && run->next == run->n_prompts;
    run->end = last_unit ? (run->unit + 1) * stage_layers(run->m) : LONG_MAX;
}

/* Step i of block t ends: what moved is in place, and the last stage chooses the next tokens
 * (and sends them back to the first stage, on a pipeline). */
static void step_ends(gen_run *run, int t, int i) {
    block *bl = &run->blocks[t];
    fg_model *m = run->m;
    io_sync(&m->rt->io, 0);
    run->unit++;
    if (is_last_stage(m)) {
        sample_tokens(bl, run->opt, run->logits, run->scratch);
        m->rt->stage->tokens_out(bl, run->opt, run->out_tokens);
    }
    count_step(m->rt, run->timing, &bl->step_start, i > 0); /* what the host asked of the device */
    for (int k = 0; k < bl->n_batches; k++) { /* with refill, refill_slots lays the next step out */
        run->timing->rows += (int64_t)bl->gb[k].batch * bl->gb[k].n_new;
        gpu_batch_advance(&bl->gb[k]);
    }
}

/* ---- A block's tokens, as its step ends (support/sampling.c chooses each from its logits) ---- */

/* The logits of sequence s's last token, and of its token t (with prompt_logits, at prefill). */
static const float *logits_row(const block *bl, int s, int t) {
    size_t batch_rows = (size_t)bl->shape.gbs * bl->shape.logit_rows;
    size_t row = (size_t)(s % bl->shape.gbs) * out_rows(bl, s / bl->shape.gbs) + t;
    size_t batch = (size_t)(s / bl->shape.gbs);
    return bl->host_logits + (batch * batch_rows + row) * bl->m->view.cfg.vocab;
}

/* Prefill's logits of every position of each prompt (its padding left out), in prompt order. */
static void keep_prompt_logits(const block *bl, const gen_options *opt) {
    int vocab = bl->m->view.cfg.vocab;
    int longest = bl->shape.max_prompt;
    for (int s = 0; s < bl->count; s++) {
        int pad = bl->gb[s / bl->shape.gbs].pad[s % bl->shape.gbs];
        int len = out_rows(bl, s / bl->shape.gbs) - pad;
        memcpy(opt->prompt_logits + (size_t)bl->prompt[s] * longest * vocab, logits_row(bl, s, pad),
               (size_t)len * vocab * sizeof(float));
    }
}

/* The last stage chooses each sequence's next token from its logits (into bl->ids), keeping
 * the logits of sequences still running; with teacher forcing the next token is given.
 * Sampling draws from a generator seeded by (seed, prompt, step), so the tokens do not depend
 * on the block shape, the number of stages or the slot a refill gave the prompt. */
static void sample_tokens(block *bl, const gen_options *opt, float *logits_out, float *scratch) {
    int vocab = bl->m->view.cfg.vocab;
    size_t rows = (size_t)bl->n_batches * bl->shape.gbs * bl->shape.logit_rows;
    if (bl->shape.logit_rows == 1) rows = (size_t)bl->count;
    bl->rt->backend->copy_out(bl->host_logits, bl->logits, rows * vocab * sizeof(float));
    bl->rt->backend->copies_done(); /* a decode step's one wait on the device, on a GPU */
    if (opt->prompt_logits && bl->step[0] == 0) keep_prompt_logits(bl, opt);
    for (int s = 0; s < bl->count; s++) {
        const float *row = logits_row(bl, s, out_rows(bl, s / bl->shape.gbs) - 1);
        int p = bl->prompt[s];
        int step = bl->step[s];
        if (p < 0) continue; /* an idle slot */
        if (logits_out && !bl->done[s]) {
            float *out = logits_out + ((size_t)p * opt->gen_len + step) * vocab;
            memcpy(out, row, vocab * sizeof(float));
        }
        if (opt->forced) {
            bl->ids[s] = opt->forced[(size_t)p * opt->gen_len + step];
            continue;
        }
        fg_rng rng;
        uint64_t place = opt->index ? (uint64_t)opt->index[p] : (uint64_t)p; /* in the job */
        rng_seed(&rng, opt->seed ^ ((place << 24) + (uint64_t)step) * 0x9e3779b97f4a7c15ULL);
        bl->ids[s] = sample_token(row, vocab, opt->temperature, opt->top_p, &rng, scratch);
    }
}

/* tok ends a sequence: one of the model's EOS ids, or OPT's. */
int gen_is_eos(const gen_options *opt, int tok) {
    if (opt->n_eos == 0) return tok == OPT_EOS_ID;
    for (int i = 0; i < opt->n_eos; i++)
        if (tok == opt->eos_ids[i]) return 1;
    return 0;
}

/* The first stage takes each sequence's token of the step just ended into out_tokens (padding
 * once it is done) and the next step's input; returns how many sequences run on. */
int take_tokens(block *bl, const gen_options *opt, int *out_tokens) {
    int running = 0;
    for (int s = 0; s < bl->count; s++) {
        int tok = bl->ids[s];
        if (bl->prompt[s] < 0) continue;
        size_t at = (size_t)bl->prompt[s] * opt->gen_len + bl->step[s]++;
        out_tokens[at] = bl->done[s] ? OPT_PAD_ID : tok;
        if (opt->stop_at_eos && gen_is_eos(opt, tok)) bl->done[s] = 1;
        running += slot_running(bl, s, opt->gen_len);
        bl->gb[s / bl->shape.gbs].tokens[s % bl->shape.gbs] = tok;
    }
    return running;
}

/* ============================================================================================
 * Generation: prompts in rounds of blocks, each through every step
 * ============================================================================================ */

/* GPU batch k's slots take prompts first .. first + count - 1, left-padded to `padded` tokens, as
 * their prefill's input; its other slots idle. */
static void start_batch(block *bl, int k, int *const *prompts, const int *lens, int first,
                        int count, int padded) {
    gpu_batch *gb = &bl->gb[k];
    gb->batch = count;
    gb->n_new = padded;
    for (int b = 0; b < bl->shape.gbs; b++) {
        int s = k * bl->shape.gbs + b;
        bl->prompt[s] = b < count ? first + b : -1;
        bl->step[s] = 0;
        bl->done[s] = 0;
        gb->past[b] = 0;
        if (b >= count) continue;
        int n = lens[first + b];
        int *row = gb->tokens + (size_t)b * padded;
        gb->pad[b] = padded - n;
        for (int t = 0; t < padded - n; t++) row[t] = OPT_PAD_ID;
        memcpy(row + padded - n, prompts[first + b], (size_t)n * sizeof(int));
    }
}

static int longest_of(const int *lens, int first, int count) {
    int longest = 0;
    for (int i = first; i < first + count; i++) longest = lens[i] > longest ? lens[i] : longest;
    return longest;
}

/* Loads a block's prompts as the prefill step's input, each GPU batch's left-padded to its own
 * longest (as the diagonal schedule and refill lay theirs out, so that a prompt meets the same
 * rows whichever schedule runs it). Returns the tokens laid out, padding included. */
static long start_block(block *bl, int *const *prompts, const int *lens, int first, int count) {
    int gbs = bl->shape.gbs;
    long tokens = 0;
    bl->count = count;
    bl->running = count > 0;
    bl->n_batches = (count + gbs - 1) / gbs;
    kv_pages_reset(&bl->pages);
    for (int k = 0; k < bl->n_batches; k++) {
        int batch = count - k * gbs < gbs ? count - k * gbs : gbs;
        int padded = longest_of(lens, first + k * gbs, batch);
        start_batch(bl, k, prompts, lens, first + k * gbs, batch, padded);
        tokens += (long)batch * padded;
    }
    return tokens;
}

/* The first stage takes step i - 1's tokens of a block (chosen here with one stage, or come back
 * from the last stage) and sees whether any sequence runs on; a block that stopped is passed on. */
static void tokens_back(gen_run *run, block *bl, int i) {
    const stage_hooks *stage = run->m->rt->stage;
    const gen_options *opt = run->opt;
    stage->receive_tokens(bl, i - 1);
    for (int s = 0; s < bl->count; s++) {
        if (bl->prompt[s] < 0 || bl->done[s]) continue; /* an idle slot, or one past its </s> */
        run->timing->decode_tokens += bl->step[s] > 0;
        int last =
            bl->step[s] == opt->gen_len - 1 || (opt->stop_at_eos && gen_is_eos(opt, bl->ids[s]));
        if (!last) continue;
        run->timing->completed++; /* its last token, taken now: the time to it */
        run->timing->completion_seconds += now_seconds() - run->t_start;
        if (opt->finish_step) opt->finish_step[bl->prompt[s]] = run->steps_before + i;
    }
    int more_prompts = run->diagonal && run->next < run->n_prompts;
    bl->running = take_tokens(bl, opt, run->out_tokens) > 0 || more_prompts;
    if (!bl->running && i < run->steps && !run->refill) stage->pass_stop(bl);
}

/* Slot s's sequence is done with its cache: the timing counts its pages and tokens, and the pages
 * go back to the pool. */
static void end_sequence(gen_run *run, block *bl, int s) {
    run->timing->cache_rows += (int64_t)bl->pages.held[s] * bl->shape.kv.page_tokens;
    run->timing->cache_tokens += bl->gb[s / bl->shape.gbs].past[s % bl->shape.gbs];
    kv_pages_give_back(&bl->pages, s);
}

/* The pages each tier can still promise a new sequence (a refill's admission): those free, less
 * what the running ones may yet take, each up to its prompt (of lens) + gen_len. */
static void promisable_pages(const block *bl, const int *lens, int gen_len, int promise[N_TIERS]) {
    const kv_pages *kp = &bl->pages;
    for (int t = 0; t < N_TIERS; t++) promise[t] = kp->n_free[t];
    for (int s = 0; s < bl->count; s++)
        if (slot_running(bl, s, gen_len))
            promise[slot_tier(kp, s)] -=
                kv_pages_for(lens[bl->prompt[s]] + gen_len, kp->pool.page_tokens) - kp->held[s];
}

/* How many of GPU batch k's free slots take the next prompts at a refill, and *longest, their
 * longest: a free slot takes the next prompt if the tiers can still promise its pages (promise,
 * less what the slots before it took). They are taken when that padding costs no more rows than
 * the free slots would idle (one a step) until the batch's running sequences could end; then
 * promise loses their pages. */
static int prompts_to_take(const gen_run *run, const block *bl, int k, int promise[N_TIERS],
                           int *longest) {
    int gen_len = run->opt->gen_len;
    int running = 0;
    int free_slots = 0;
    int steps_left = 0;
    int fits = 1;
    int left[N_TIERS];
    memcpy(left, promise, sizeof left);
    *longest = 1;
    for (int s = k * bl->shape.gbs; s < k * bl->shape.gbs + bl->gb[k].batch; s++) {
        if (slot_running(bl, s, gen_len)) {
            running++;
            if (gen_len - bl->step[s] > steps_left) steps_left = gen_len - bl->step[s];
            continue;
        }
        if (!fits || run->next + free_slots >= run->n_prompts) continue;
        int len = run->lens[run->next + free_slots];
        int need = kv_pages_for(len + gen_len, bl->shape.kv.page_tokens);
        fg_tier t = slot_tier(&bl->pages, s);
        fits = left[t] >= need;
        if (!fits) continue;
        left[t] -= need;
        if (len > *longest) *longest = len;
        free_slots++;
    }
    int take = free_slots > 0 && (long)running * (*longest - 1) <= (long)free_slots * steps_left;
    if (!take) return 0;
    memcpy(promise, left, sizeof left);
    return free_slots;
}

/* GPU batch k's free slots: the first `taking` take the next prompts, whose prefill joins step
 * i; the others idle. */
static void assign_prompts(gen_run *run, block *bl, int k, int i, int taking) {
    gpu_batch *gb = &bl->gb[k];
    int gen_len = run->opt->gen_len;
    int taken = 0;
    for (int b = 0; b < gb->batch; b++) {
        int s = k * bl->shape.gbs + b;
        if (slot_running(bl, s, gen_len)) continue;
        bl->prompt[s] = -1;
        if (taken < taking) {
            bl->prompt[s] = run->next++;
            taken++;
        }
        bl->done[s] = 0;
        bl->step[s] = 0;
        gb->past[b] = 0;
        if (bl->prompt[s] < 0) continue;
        if (i + gen_len > run->steps) run->steps = i + gen_len;
        bl->running = 1;
    }
}

/* GPU batch k's rows for a refill step, n_new a sequence, left-padded: a new prompt's tokens, a
 * running sequence's last token, or an idle slot's padding. Row b covers tokens[b], the token
 * of sequence b that it keeps, so the rows are laid out from the last back. */
static void lay_out_rows(gen_run *run, block *bl, int k, int n_new) {
    gpu_batch *gb = &bl->gb[k];
    for (int b = gb->batch - 1; b >= 0; b--) {
        int s = k * bl->shape.gbs + b;
        int p = bl->prompt[s];
        int n = p < 0 ? 0 : bl->step[s] == 0 ? run->lens[p] : 1;
        int token = gb->tokens[b];
        int *row = gb->tokens + (size_t)b * n_new;
        for (int t = 0; t < n_new - n; t++) row[t] = OPT_PAD_ID;
        if (n == 1 && bl->step[s] > 0) row[n_new - 1] = token;
        else if (n) memcpy(row + n_new - n, run->prompts[p], (size_t)n * sizeof(int));
        gb->pad[b] = n_new - n;
        if (n && bl->step[s] == 0) run->timing->prefill_tokens += n_new;
    }
    gb->n_new = n_new;
}

/* Refill (one block, --stop-at-eos): ended sequences' slots take the next prompts, whose prefill
 * joins step i: the GPU batch computes rows for the longest, each running sequence its token last
 * after padding (prompts_to_take says when); a slot without a prompt idles. */
static void refill_slots(gen_run *run, block *bl, int i) {
    int gen_len = run->opt->gen_len;
    int promise[N_TIERS];
    for (int s = 0; s < bl->count; s++)
        if (!slot_running(bl, s, gen_len)) end_sequence(run, bl, s);
    promisable_pages(bl, run->lens, gen_len, promise);
    for (int k = 0; k < bl->n_batches; k++) {
        int longest;
        int taking = prompts_to_take(run, bl, k, promise, &longest);
        assign_prompts(run, bl, k, i, taking);
        lay_out_rows(run, bl, k, taking ? longest : 1);
    }
}

/* The diagonal schedule (Appendix A.2, Fig. 6): GPU batch k first takes prompts at step
 * diagonal_start(k) (the warm-up: the staircase of its figure) and then every gen_len steps,
 * as its sequences end, so that at each step the batches are at staggered steps of their
 * sequences: one prefills while the others decode, the layer's weights loaded once for all. */
static void diagonal_slots(gen_run *run, block *bl, int i) {
    int gen_len = run->opt->gen_len;
    int gbs = bl->shape.gbs;
    for (int k = 0; k < bl->n_batches; k++) {
        int start = diagonal_start(k, bl->n_batches, gen_len);
        if (i < start || (i - start) % gen_len != 0) continue;
        /* its tokens are all in */
        if (run->opt->group_done && bl->gb[k].batch && is_first_stage(run->m))
            run->opt->group_done(run->opt->group_ctx, bl->prompt[k * gbs], bl->gb[k].batch);
        for (int s = k * gbs; s < (k + 1) * gbs; s++)
            if (bl->prompt[s] >= 0) end_sequence(run, bl, s);
        int count = run->n_prompts - run->next < gbs ? run->n_prompts - run->next : gbs;
        int padded = longest_of(run->lens, run->next, count);
        start_batch(bl, k, run->prompts, run->lens, run->next, count, padded > 0 ? padded : 1);
        run->next += count;
        if (count == 0) continue;
        run->timing->prefill_tokens += (int64_t)count * padded;
        if (i + gen_len > run->steps) run->steps = i + gen_len;
        bl->running = 1;
    }
}

/* A block of a diagonal run: every GPU batch idle until diagonal_slots starts it. */
static void start_diagonal(gen_run *run, block *bl) {
    start_block(bl, run->prompts, run->lens, 0, 0);
    bl->n_batches = bl->shape.ngb;
    bl->count = bl->shape.ngb * bl->shape.gbs;
    for (int k = 0; k < bl->n_batches; k++) start_batch(bl, k, run->prompts, run->lens, 0, 0, 1);
    diagonal_slots(run, bl, 0);
}

static void free_blocks(block *blocks, int n) {
    for (int t = n - 1; t >= 0; t--) free_block(&blocks[t]); /* the owner of shared buffers last */
    free(blocks);
}

/* The blocks of a stage (§4.4's micro-batches; one block in one process), everything checked
 * and allocated: the plan, the weights in their homes. */
static block *open_blocks(fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                          int *n_blocks, char *err) {
    int size;
    int count;
    micro_batches(m, n_prompts, &size, &count);
    block *blocks = calloc((size_t)count, sizeof *blocks);
    if (!blocks) {
        fg_fail(err, "out of memory");
        return NULL;
    }
    int rc = fg_check_plan(m, n_prompts, lens, max_prompt, gen_len, err);
    if (rc && m->int8_columns.n) { /* their room, for this plan */
        m->rt->drop_int8_columns(m);
        rc = fg_check_plan(m, n_prompts, lens, max_prompt, gen_len, err);
    }
    if (rc == 0 && !m->loaded) rc = load_weights_into_homes(m, err);
    if (rc == 0 && m->rt->keep_int8_columns)
        m->rt->keep_int8_columns(m, n_prompts, lens, max_prompt, gen_len);
    for (int t = 0; t < count && rc == 0; t++)
        rc = alloc_block(&blocks[t], m, n_prompts, lens, max_prompt, gen_len, t ? &blocks[0] : NULL,
                         err);
    if (rc) {
        free_blocks(blocks, count);
        return NULL;
    }
    *n_blocks = count;
    return blocks;
}

/* The round's blocks take their prompts: P blocks of B from run->base on (with refill, the
 * prompts after the first B wait for free slots), or none yet in the diagonal schedule, whose
 * GPU batches start at their steps. */
static void start_round(gen_run *run) {
    run->started = 0;
    run->prefilled = 0;
    run->unit = 0;
    run->steps = run->opt->gen_len;
    for (int t = 0; t < run->P && !run->diagonal; t++) {
        int first = run->base + t * run->B;
        int count = run->n_prompts - first < run->B ? run->n_prompts - first : run->B;
        long tokens =
            start_block(&run->blocks[t], run->prompts, run->lens, first, count > 0 ? count : 0);
        if (count <= 0) continue;
        run->timing->prefill_tokens += tokens;
        run->started++;
    }
    if (run->diagonal) run->next = 0;
    else if (run->refill && run->B < run->n_prompts) run->next = run->B; /* the rest */
    else run->next = run->n_prompts;
    for (int t = 0; t < run->P && run->diagonal; t++) {
        start_diagonal(run, &run->blocks[t]);
        run->started += run->blocks[t].running;
    }
}

/* A round: P micro-batches of prompts from run->base through every step (§4.4's iteration-level
 * pipeline: each stage runs step i of micro-batch t while the stage before it runs step i of
 * t + 1 and the one after it step i of t - 1; with one stage, one block, Fig. 4). */
static void run_round(gen_run *run) {
    fg_model *m = run->m;
    start_round(run);
    double t0 = now_seconds();
    run->t_prefill = t0;
    m->staged[0] = -1;
    m->staged[1] = -1;
    /* the first layer; in Fig. 4's loop every later one loads while its predecessor computes */
    load_weight_at(m, 0);
    io_sync(&m->rt->io, 1);
    if (run->plain) plain_schedule(run);
    else block_schedule(run);
    run->steps_before += run->steps;
    for (int t = 0; t < run->P; t++)
        for (int s = 0; s < run->blocks[t].count; s++) end_sequence(run, &run->blocks[t], s);
    run->timing->page_tokens = run->blocks[0].shape.kv.page_tokens;
    for (int t = 0; t < N_TIERS; t++) /* the pools' most in use (the diagonal's staggered peak) */
        run->timing->cache_peak_rows[t] =
            (int64_t)run->blocks[0].pages.peak[t] * run->timing->page_tokens;
    if (is_first_stage(m)) {
        run->timing->prefill_latency += run->t_prefill - t0;
        run->timing->decode_latency += now_seconds() - run->t_prefill;
    }
    for (int t = 0; t < run->P; t++) {
        block *bl = &run->blocks[t];
        m->rt->stage->end_round(bl);
        run->timing->bubble_seconds += bl->bubble;
        bl->bubble = 0;
        run->timing->compute_seconds += bl->compute_seconds;
        bl->compute_seconds = 0;
    }
    forget_reads(m);
}

/* The job and the options checked: the prompts, the forced tokens, and what refill and the
 * diagonal schedule allow. */
static int check_job(const gen_run *run, const gen_options *opt, char *err) {
    const model_config *c = &run->m->view.cfg;
    int rc = check_prompts(c, run->n_prompts, run->prompts, run->lens, opt->gen_len, err);
    if (rc == 0 && opt->forced)
        rc = check_forced(c, opt->forced, run->n_prompts, opt->gen_len, err);
    if (rc == 0 && opt->refill && (!opt->stop_at_eos || opt->prompt_logits || run->m->rt->pipe))
        rc = fg_fail(err, "refill: needs stop_at_eos, one process and no prompt logits");
    if (rc == 0 && run->diagonal && (opt->refill || opt->prompt_logits))
        rc = fg_fail(err, "the diagonal schedule: refills its GPU batches itself, "
                          "keeps no prompt logits");
    return rc;
}

/* The outputs cleared before the first round: logits and prompt logits zero, tokens padding. */
static void clear_outputs(const gen_run *run, int max_prompt) {
    const gen_options *opt = run->opt;
    size_t vocab = (size_t)run->m->view.cfg.vocab;
    size_t tokens = (size_t)run->n_prompts * opt->gen_len;
    if (run->logits) memset(run->logits, 0, tokens * vocab * sizeof(float));
    if (opt->prompt_logits) {
        size_t rows = (size_t)run->n_prompts * max_prompt;
        memset(opt->prompt_logits, 0, rows * vocab * sizeof(float));
    }
    for (size_t i = 0; i < tokens; i++) run->out_tokens[i] = OPT_PAD_ID;
    memset(run->timing, 0, sizeof *run->timing);
}

int generate(fg_model *m, const gen_options *opt, int n_prompts, int *const *prompts,
             const int *prompt_lens, int *out_tokens, float *logits, gen_timing *timing,
             char *err) {
    const model_config *c = &m->view.cfg;
    fg_runtime *rt = m->rt;
    gen_run run = {.m = m,
                   .opt = opt,
                   .out_tokens = out_tokens,
                   .logits = logits,
                   .timing = timing,
                   .prompts = prompts,
                   .lens = prompt_lens,
                   .n_prompts = n_prompts,
                   .refill = opt->refill,
                   .diagonal = rt->policy.schedule == FG_SCHEDULE_DIAGONAL};
    int max_prompt = 1;
    for (int p = 0; p < n_prompts; p++)
        if (prompt_lens[p] > max_prompt) max_prompt = prompt_lens[p];
    int rc = check_job(&run, opt, err);
    m->prompt_logits = opt->prompt_logits != NULL;
    if (rc == 0) {
        run.blocks = open_blocks(m, n_prompts, prompt_lens, max_prompt, opt->gen_len, &run.P, err);
        if (!run.blocks) rc = -1;
    }
    if (rc == 0) {
        run.scratch = malloc((size_t)2 * c->vocab * sizeof(float));
        if (!run.scratch) rc = fg_fail(err, "out of memory");
    }
    if (rt->stage->agree(rt, rc, err)) { /* every stage is ready, or none starts */
        if (run.blocks) free_blocks(run.blocks, run.P);
        free(run.scratch);
        m->prompt_logits = 0;
        return -1;
    }
    clear_outputs(&run, max_prompt);
    run.plain = !rt->policy.overlap && !rt->pipe && run.P == 1;
    run.t_start = now_seconds();
    double disk_read_before = rt->disk_read_seconds;
    run.B = run.blocks[0].shape.gbs * run.blocks[0].shape.ngb;
    int rounds = run.refill || run.diagonal ? 1 : (n_prompts + run.P * run.B - 1) / (run.P * run.B);
    for (int r = 0; r < rounds && !run.pools_ran_out; r++) {
        char progress[64];
        snprintf(progress, sizeof progress, "block %d/%d", r + 1, rounds);
        run.base = r * run.P * run.B;
        run.progress = opt->verbose && is_first_stage(m) ? progress : NULL;
        run_round(&run);
    }
    if (opt->verbose && is_first_stage(m)) fprintf(stderr, "\n");
    timing->disk_read_seconds = rt->disk_read_seconds - disk_read_before;
    free(run.scratch);
    free_blocks(run.blocks, run.P);
    m->prompt_logits = 0;
    if (!run.pools_ran_out) return 0;
    return fg_fail(err, "internal error: a KV cache pool ran out: the schedule held more than its "
                        "pools were sized for");
}
