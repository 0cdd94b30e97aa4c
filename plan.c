/* plan.c: a block's plan (the paper's §4.1 and §4.2): how its sequences split over the tiers,
 * the size of every buffer it holds on each tier, and the plan check that holds all of it,
 * weights included, against the capacities before anything is allocated or computed.
 *
 *   split_rows         KV cache and activations split along the batch dimension (§4.2): of a
 *                      GPU batch's sequences, the first go to the gpu tier, the next to cpu,
 *                      the rest to disk
 *   shape_block        the block's sizes; the runtime allocates exactly these
 *   fg_check_plan      the plan against --gpu-mem, --cpu-mem and --disk-mem: one line naming the
 *                      tier, what it needs and what is given, when it does not fit
 *   fg_runtime_check   the same for a policy, as the policy search asks it (policy.c)
 *
 * Activations are the hidden states between layers, in the backend's act_elem bytes a value:
 * fp32 on the CPU (what it computes in, so that placement cannot change a bit of the result),
 * fp16 on CUDA (as FlexGen keeps them). The workspace holds a chunk of a GPU batch's prompt
 * rows (FG_CHUNK_ROWS), not all of them.
 */
#define _GNU_SOURCE
#include "runtime.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* n sequences split by percentages (the rest to disk), each tier's count rounded. */
static row_split split_rows(int n, int gpu_pct, int cpu_pct) {
    int g = (int)lround(n * gpu_pct / 100.0), gc = (int)lround(n * (gpu_pct + cpu_pct) / 100.0);
    return (row_split){{g, gc - g, n - gc}};
}

fg_tier tier_of(const row_split *s, int b) {
    return b < s->rows[TIER_GPU] ? TIER_GPU : b < s->rows[TIER_GPU] + s->rows[TIER_CPU] ? TIER_CPU : TIER_DISK;
}

fg_tier row_tier(const row_split *s, int b, int *index) {
    fg_tier t = TIER_GPU;
    while (t < TIER_DISK && b >= s->rows[t]) b -= s->rows[t++];
    *index = b;
    return t;
}

size_t fg_workspace_rows(int gbs, int max_prompt) {
    int chunk = FG_CHUNK_ROWS / max_prompt;
    chunk = chunk < 1 ? 1 : chunk < gbs ? chunk : gbs;
    return (size_t)chunk * (size_t)max_prompt;
}

/* A pipeline of M stages keeps M micro-batches in flight (§4.4), each a block of at most
 * gpu_batch_size x num_gpu_batches sequences: prompts go in rounds of *count blocks of *size
 * (fewer prompts make smaller blocks rather than fewer). One process: blocks, one at a time. */
void micro_batches(const fg_model *m, int n_prompts, int *size, int *count) {
    const fg_policy *p = &m->rt->policy;
    int stages = p->n_stages > 1 ? p->n_stages : 1, block = p->gpu_batch_size * p->num_gpu_batches;
    int share = (n_prompts + stages - 1) / stages;
    *size = share < block ? share : block;
    int blocks = (n_prompts + *size - 1) / *size;
    *count = blocks < stages ? blocks : stages;
}

block_shape shape_block(const fg_model *m, int n_prompts, int max_prompt, int gen_len) {
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
    s.cache = split_rows(s.gbs, p->percent.cg, p->percent.cc);
    s.act = split_rows(s.gbs, p->percent.hg, p->percent.hc);
    s.act_row = (size_t)c->hidden * rt->backend->act_elem;
    s.kv_row = opt_kv_row_bytes(c, p->compress_cache);
    double act_row = (double)s.act_row, kv_row = (double)s.kv_row, staged_rows = s.gbs - s.cache.rows[TIER_GPU];
    for (int t = 0; t < N_TIERS; t++) {
        s.kv_home[t] = kv_row * m->n_decoder * s.ngb * 2 * s.cache.rows[t] * s.max_len;
        s.act_home[t] = act_row * s.ngb * s.act.rows[t] * max_prompt;
    }
    s.kv_home[TIER_DISK] = (double)page_up((size_t)s.kv_home[TIER_DISK]);
    s.act_home[TIER_DISK] = (double)page_up((size_t)s.act_home[TIER_DISK]);
    s.kv_stage = staged_rows > 0 ? 2 * 2 * kv_row * staged_rows * s.stage_len : 0;
    s.x_stage = 2 * act_row * s.gbs * max_prompt;
    s.workspace_rows = fg_workspace_rows(s.gbs, max_prompt);
    s.workspace = (double)rt->backend->workspace_bytes(c, s.workspace_rows, s.max_len);
    if (p->cpu_cache_compute && rt->backend->delegated_bytes) /* decode delegates: a GPU batch */
        s.delegated = (double)rt->backend->delegated_bytes(c, (size_t)s.gbs, s.max_len);
    s.logit_rows = m->prompt_logits ? max_prompt : 1;
    s.logits = is_last_stage(m) ? 4.0 * s.gbs * s.ngb * s.logit_rows * c->vocab : 0;
    s.act_message = (size_t)s.gbs * max_prompt * s.act_row;
    s.pipe_buffers = (double)s.act_message * ((is_last_stage(m) ? 0 : s.micro * s.ngb) +
                                              (is_first_stage(m) ? 0 : 2));
    /* a layer's disk cache rows (K and V) and a batch's disk activations, twice (load + store) */
    s.transient_cpu = 2 * (2 * kv_row * s.cache.rows[TIER_DISK] * s.max_len +
                           act_row * s.act.rows[TIER_DISK] * max_prompt + 2 * page_size());
    return s;
}

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
    enum { WEIGHTS, W_STAGING, CACHE, C_STAGING, ACTS, A_STAGING, WORK, IN_FLIGHT, PIPE, DELEGATED,
           RESERVE, N_ITEMS };
    static const char *const items[N_ITEMS] = {"weights", "weight staging", "KV cache",
        "KV cache staging", "activations", "activation staging", "workspace and logits",
        "disk pages in flight", "activations between stages", "delegated attention",
        "the device's context, cuBLAS and rounding"};
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
    need[TIER_CPU][DELEGATED] = s.delegated;
    need[TIER_GPU][RESERVE] = rt->backend->device_reserve;
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
                       human(total[t]).s, detail, fg_tier_flags[t], human(rt->capacity[t]).s);
    }
    /* once the weights are in their homes they are resident already, not to be counted twice */
    double host = mem_available_bytes() + (m->loaded ? w[TIER_GPU] + w[TIER_CPU] : 0);
    if (rt->backend->gpu_is_host && total[TIER_GPU] + total[TIER_CPU] > host)
        return fg_fail(err, "gpu and cpu tiers: the plan needs %s of host memory (gpu %s, cpu %s), "
                            "%s available", human(total[TIER_GPU] + total[TIER_CPU]).s,
                       human(total[TIER_GPU]).s, human(total[TIER_CPU]).s, human(host).s);
    return 0;
}

void fg_plan_placement(const fg_model *m, int n_prompts, double x[N_X]) {
    double stored[N_TIERS];
    weight_stored_bytes(m, stored);
    double total = stored[TIER_GPU] + stored[TIER_CPU] + stored[TIER_DISK];
    /* the rows of a full GPU batch (max_prompt and gen_len do not change the split) */
    block_shape s = shape_block(m, n_prompts, 1, 1);
    for (int t = 0; t < N_TIERS; t++) {
        x[X_WG + t] = stored[t] / total;
        x[X_CG + t] = (double)s.cache.rows[t] / s.gbs;
        x[X_HG + t] = (double)s.act.rows[t] / s.gbs;
    }
}

int fg_runtime_check(const opt_config *model, uint64_t seed, const fg_policy *p, int sequences,
                     int s, int n, int check, double x[N_X], fg_stats *st, char *err) {
    fg_policy q = *p;
    q.overlap = q.trace = q.verbose = 0;
    fg_runtime *rt;
    fg_model *m = NULL;
    if (fg_runtime_open(&q, &rt, err)) return -1;
    int rc = fg_model_open_dummy(rt, model, seed, &m, err);
    if (rc == 0 && sequences > 0 && check) rc = fg_check_plan(m, sequences, s, n, err);
    if (rc == 0 && x) fg_plan_placement(m, sequences, x);
    if (st) fg_runtime_stats(rt, st);
    fg_model_close(m);
    fg_runtime_close(rt);
    return rc;
}
