/* lp.c: the policy search of §4.3 and Appendix A.3: how fast a placement runs (the cost model),
 * how much of each tier it takes (the memory model), and the LP that picks the block shape and
 * placement, solved by a hand-written simplex; for both schedules (zig-zag, §4.2, and the
 * diagonal one of Appendix A.2). The search stands first, under this map; what it calls is
 * defined below it, bottom-up (C defines a function before its first use). Read it by this map
 * (scripts/check_layout.sh holds each line to the function's definition):
 *
 *    71  fg_policy_search       Eq. (1) for each block shape and schedule; read it first
 *  1114  best_policy            the shapes' LP optima, best first, rounded and checked
 *   825  solve_shape            Eq. (1) for one block shape: the LP's rows
 *   220  fg_cost_model_build    each latency term of a layer, linear in the placement x (A.3)
 *   305  fg_diagonal_rows       the diagonal's peak cache a sequence (A.2.1), and its warm-up
 *   325  fg_cost_per_token      T / bls for a placement: what the search minimizes
 *   387  fg_memory_model_build  each tier's peak bytes, linear in x, in the runtime's accounting
 *   754  lp_solve               a dense two-phase simplex
 */
#include "flexgen.h"
#include "support/support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ============================================================================================
 * The policy search (§4.3, "Policy Search"). For a block shape (gbs, ngb), whether decode
 * attention is delegated to the CPU, and whether weights pass through staging, Eq. (1) is the LP
 *     minimize   (l T_pre + l (n - 1) T_gen + n head) / bls
 *     subject to T_pre >= each prefill term, T_gen >= each decode term  (linear in x)
 *                wg + wc + wn = 1, cg + cc + cn = 1, hg + hc + hn = 1
 *                peak bytes of each tier (and of host memory) <= its capacity
 *                l T_pre + l (n - 1) T_gen + n head <= max_latency          (when asked)
 * over x (9 fractions) and T_pre, T_gen, once for each case of where the weights may go
 * (FG_W_GPU: wg = 1, FG_W_MOSTLY_GPU: wn = 0 and wc at most mostly_gpu_share, FG_W_MEMORY:
 * wn = 0, FG_W_DISK: anywhere), each with its own staging bytes (staging_arena). Its optimum is
 * rounded to integer percentages, the runtime realizes those at tensor and row granularity, and
 * that realized placement is what is checked and evaluated. The shapes' LP optima are tried best
 * first (equal ones: the smaller block first); a rounded plan that does not fit first has its
 * weight percentages stepped down to what the LP asked for (snap_weights), then is retried with a
 * GPU batch one smaller.
 * ============================================================================================ */

enum { V_PRE = N_X, V_GEN, N_VARS, MAX_ROWS = 2 * N_TERMS + 3 + N_TIERS + 4 };

typedef struct {
    int gbs, ngb, cpu_cache_compute, weights; /* weights: an FG_W_ case */
    double objective;                         /* the LP's T / bls */
    double x[N_X];
} candidate;

typedef struct {
    const model_config *cfg;   /* what the cost and memory models see: a pipeline stage's share of
                                the decoder layers (§4.4: a stage is an l/m-layer model) */
    const model_config *model; /* the whole model, which the runtime check opens (as its stage) */
    model_config stage_cfg;
    const fg_hardware *hw;
    const fg_policy *base;
    const fg_search_request *req;
    double capacity[N_TIERS], host_memory;
    int lps, checks;
} search;

static int search_init(search *S, const model_config *cfg, const fg_hardware *hw,
                       const fg_policy *base, const fg_search_request *req, char *err);
static int best_policy(search *S, fg_search_result *out, char *err);
static int explain_nothing_fits(search *S, char *err);
static int same_cost(double a, double b);

/* The best policy of each schedule the request allows (Appendix A.2: the diagonal's block may be
 * larger in the same memory, but pays its warm-up), and the better of them; zig-zag on a tie. */
int fg_policy_search(const model_config *cfg, const fg_hardware *hw, const fg_policy *base,
                     const fg_search_request *req, fg_search_result *out, char *err) {
    double t0 = now_seconds();
    int schedules = req->schedules ? req->schedules : 1 << base->schedule;
    fg_search_result best = {0}, r;
    /* S keeps a pointer to it, explain_nothing_fits too: the schedule searched */
    fg_policy b = *base;
    search S;
    memset(out, 0, sizeof *out);
    /* the capacities, whatever the schedule */
    if (search_init(&S, cfg, hw, &b, req, err)) return -1;
    for (int k = 0; k < FG_SCHEDULES; k++) {
        if (!(schedules & 1 << k)) continue;
        b.schedule = (fg_schedule)k;
        int rc = best_policy(&S, &r, err);
        if (rc < 0) return -1;
        if (rc == 0) continue;
        out->best[k].found = 1;
        out->best[k].policy = r.policy;
        out->best[k].throughput = r.throughput;
        out->best[k].block_latency = r.block_latency;
        if (r.throughput > best.throughput && !same_cost(r.throughput, best.throughput)) best = r;
    }
    if (best.throughput == 0) return explain_nothing_fits(&S, err);
    memcpy(best.best, out->best, sizeof best.best);
    *out = best;
    out->lps = S.lps;
    out->checks = S.checks;
    out->seconds = now_seconds() - t0;
    return 0;
}

/* ============================================================================================
 * The cost model (§4.3, Appendix A.3). Per layer, with h1 the hidden size, h2 the MLP's, s the
 * prompt length, n the generated tokens, bls = gbs x ngb the block:
 *   fp16 weights of a layer     8 h1^2 + 4 h1 h2 bytes
 *   activations of a layer      2 bls h1 bytes per token (2 s bls h1 in prefill)
 *   KV cache of a layer         4 bls (s + n/2) h1 bytes on average in decode
 * Each term is the bytes that cross one link (or the FLOPs of one device) divided by its rate,
 * summed over what goes that way; which fraction of weights, cache and activations a term
 * counts is the placement. T_pre and T_gen are the max of their terms (I/O overlaps compute).
 *
 * As in FlexGen, decode attention over a cache on cpu or disk runs on the CPU when delegated
 * (cpu_cache_compute); otherwise (A.3 does not write this case out) that cache crosses cpu -> gpu
 * every step and its new rows come back, and the compute device attends over all of it. 4-bit
 * compression (§5) scales the weight and cache bytes by 36/128 (a group of 64 values keeps 32
 * bytes and an fp16 min and scale) and adds the compute device's decompression of them, at
 * hw->dequant_bdw bytes of fp16 a second (--int8-activations' products read the codes, at their own
 * measured rates). Beyond A.3, too: the output layer's product per generated token (m->head),
 * and on a GPU the host's queueing of launches and its waits (host_terms).
 * ============================================================================================ */

const char *const fg_cost_term_names[N_TERMS] = {"ctog", "gtoc", "dtoc", "ctod", "comp", "host"};
const char *const fg_schedule_names[FG_SCHEDULES] = {"zigzag", "diagonal"};

/* Adds bytes / rate to term f: to its constant (k < 0), or to the coefficient of x_k. */
static void add(fg_linear *f, int k, double bytes, double rate) {
    if (k < 0) f->constant += bytes / rate;
    else f->coef[k] += bytes / rate;
}

/* Decode attention over one layer's KV cache (att FLOPs over all of it), by where the cache
 * lives (§4.2, "Computation delegation"): the gpu share (cg) is attended on the compute device;
 * the cpu and disk shares (cc, cn) either on the CPU where they live (delegation: no cache
 * crosses a link) or on the compute device, after cache_gen bytes of them cross cpu -> gpu and
 * before their cache_new new bytes cross back. §5's top-K scores every key and reads the kept V
 * rows: `kept`, (1 + F) / 2, of the FLOPs, and of the cpu tier's cache (its V read in place). */
static void decode_attention_terms(fg_linear *gen, const fg_workload *w, const fg_hardware *hw,
                                   double att, double cache_gen, double cache_new, double kept) {
    add(&gen[T_COMP], X_CG, att * kept, hw->bmm_flops_g);
    for (int k = X_CC; k <= X_CN; k++) {
        if (w->cpu_cache_compute) {
            add(&gen[T_COMP], k, att * kept, hw->cpu_flops);
        } else { /* the cache comes to the compute device and its new rows go back */
            add(&gen[T_CTOG], k, cache_gen * (k == X_CC ? kept : 1), hw->ctog_bdw);
            add(&gen[T_GTOC], k, cache_new, hw->gtoc_bdw_cache);
            add(&gen[T_COMP], k, att * kept, hw->bmm_flops_g);
        }
    }
}

/* A decoder layer's matrix values: OPT's 4 h1^2 + 2 h1 h2 (A.3); LLaMA's q and o h1 x q_width,
 * k and v h1 x kv_width (grouped-query attention), and three MLP matrices. */
static double layer_matrices(const model_config *c) {
    double h1 = c->hidden, h2 = c->ffn, q = q_width(c), kv = kv_width(c);
    return h1 * (2 * q + 2 * kv) + (c->family == FAMILY_LLAMA ? 3 : 2) * h1 * h2;
}

/* Kernels and cuBLAS products that one GPU batch's decoder layer queues on a GPU (docs/GPU.md,
 * "Where the host waits"): OPT's 7 and 4, LLaMA's 6 and 7 and a kernel a bias; and the
 * iteration's 5 more calls (its activations' two copies, its join's event and two waits).
 * Decode's attention is one more (its spans of keys, then their merge: host_terms). */
static double layer_launches(const model_config *c) {
    double kernels_and_products =
        c->family == FAMILY_OPT ? 11 : 13 + 3 * c->qkv_bias + c->o_bias + 3 * c->mlp_bias;
    return kernels_and_products + 5;
}

/* Beyond A.3, a GPU's host (hw->launch_seconds, hw->wait_seconds; 0 where not measured). Each GPU
 * batch's layer queues its launches while the GPU runs earlier ones: the term `host`, a bound on
 * the layer as each link and compute are (prefill's attention adds 3 a sequence: two products and
 * a softmax; decode's adds its merge). A step waits once, for its logits (m->head). The cache
 * that moves to the GPU goes in a copy a run of pages (a prompt's pages are one run, each page
 * grown in decode another: on average 1 + n / 32 a sequence), each a launch on its link;
 * delegated attention waits for its rows once a GPU batch. */
static void host_terms(const model_config *c, const fg_workload *w, const fg_hardware *hw,
                       double kept, fg_cost_model *m) {
    double launch = hw->launch_seconds, batches = w->ngb, sequences = (double)w->gbs * w->ngb;
    m->pre[T_HOST].constant += (batches * layer_launches(c) + 3 * sequences) * launch;
    m->gen[T_HOST].constant += batches * (layer_launches(c) + 1) * launch;
    m->head += hw->wait_seconds;
    double runs = sequences * (1 + w->n / (2.0 * FG_PAGE_TOKENS)); /* K's, and V's but top-K's */
    for (int k = X_CC; k <= X_CN; k++) {
        if (w->cpu_cache_compute) m->gen[T_COMP].coef[k] += batches * hw->wait_seconds;
        else m->gen[T_CTOG].coef[k] += (k == X_CC && kept < 1 ? 1 : 2) * runs * launch;
    }
}

/* The compute device's reads beyond its products, in prefill and decode: §5's decompression of
 * every 4-bit weight it uses and of the cache it reads (the rows it compresses are counted at
 * the same rate), and (beyond A.3) each GPU batch's read of the layer's working weights: fp16, or
 * the 4-bit bytes where the products read them as they are (the CPU always; CUDA in decode,
 * decoding them in registers, where its prefill widens them to fp16 first). A GPU's decode
 * attention decodes a 4-bit cache in registers too (its kernels take the codes), so there only
 * the shares the CPU attends (delegated) are decompressed. fp16_bytes: a layer's weights, the
 * cache written in prefill and the cache read per decode step, as fp16. */
static void compute_reads(fg_linear *pre, fg_linear *gen, const fg_workload *w,
                          const fg_hardware *hw, const double fp16_bytes[3], int int8) {
    double weights16 = fp16_bytes[0];
    if (hw->dequant_bdw > 0) {
        if (w->compress_weight && !int8) {
            add(&pre[T_COMP], -1, weights16, hw->dequant_bdw);
            if (hw->gpu_is_host) add(&gen[T_COMP], -1, weights16, hw->dequant_bdw);
        }
        if (w->compress_cache) {
            add(&pre[T_COMP], -1, fp16_bytes[1], hw->dequant_bdw);
            if (hw->gpu_is_host) add(&gen[T_COMP], -1, fp16_bytes[2], hw->dequant_bdw);
            for (int k = X_CC; k <= X_CN && !hw->gpu_is_host && w->cpu_cache_compute; k++)
                add(&gen[T_COMP], k, fp16_bytes[2], hw->dequant_bdw);
        }
    }
    if (hw->mem_bdw > 0) {
        double q4 = w->compress_weight ? 36.0 / 128 : 1;
        double prefill_working = weights16 * (hw->gpu_is_host ? q4 : 1);
        add(&pre[T_COMP], -1, w->ngb * prefill_working, hw->mem_bdw);
        add(&gen[T_COMP], -1, w->ngb * weights16 * q4, hw->mem_bdw);
    }
}

void fg_cost_model_build(const model_config *c, const fg_workload *w, const fg_hardware *hw,
                         fg_cost_model *m) {
    double h1 = c->hidden, n = w->n, bls = (double)w->gbs * w->ngb;
    double s = w->s_mean > 0 ? w->s_mean : w->s;
    double kvw = kv_width(c), qw = q_width(c); /* a token's K (or V), and q: h1 in OPT */
    double weights16 = 2 * layer_matrices(c);
    double weights = weights16 * (w->compress_weight ? 36.0 / 128 : 1);
    int int8 = w->int8 && hw->mm_flops_int8_g > 0;       /* its products' measured rates */
    double kv = w->compress_cache ? 36.0 / 128 : 1;      /* cache bytes per fp16 byte */
    double cache_pre = 4 * (s + 1) * kvw * bls * kv;     /* written in prefill (A.3) */
    double cache_gen = 4 * bls * (s + n / 2) * kvw * kv; /* read per decode step, on average */
    double cache_new = 4 * bls * kvw * kv;               /* written per decode step */
    double kept = w->attn_sparsity > 0 && w->attn_sparsity < 1 ? (1 + w->attn_sparsity) / 2 : 1;
    double hidden_pre = 2 * s * h1 * bls, hidden_gen = 2 * h1 * bls;
    memset(m, 0, sizeof *m);

    fg_linear *pre = m->pre; /* prefill */
    add(&pre[T_CTOG], X_WC, weights, hw->ctog_bdw);
    add(&pre[T_CTOG], X_WN, weights, hw->ctog_bdw);
    add(&pre[T_CTOG], X_HC, hidden_pre, hw->ctog_bdw);
    add(&pre[T_CTOG], X_HN, hidden_pre, hw->ctog_bdw);
    add(&pre[T_GTOC], X_CC, cache_pre, hw->gtoc_bdw_cache);
    add(&pre[T_GTOC], X_CN, cache_pre, hw->gtoc_bdw_cache);
    add(&pre[T_GTOC], X_HC, hidden_pre, hw->gtoc_bdw_hidden);
    add(&pre[T_GTOC], X_HN, hidden_pre, hw->gtoc_bdw_hidden);
    add(&pre[T_DTOC], X_WN, weights, hw->dtoc_bdw);
    add(&pre[T_DTOC], X_HN, hidden_pre, hw->dtoc_bdw);
    add(&pre[T_CTOD], X_CN, cache_pre, hw->ctod_bdw_cache_p);
    add(&pre[T_CTOD], X_HN, hidden_pre, hw->ctod_bdw_hidden_p);
    /* 2 FLOPs a value */
    add(&pre[T_COMP], -1, bls * s * weights16, int8 ? hw->mm_flops_int8_p : hw->mm_flops_p);
    add(&pre[T_COMP], -1, 4 * bls * s * s * qw, hw->bmm_flops_p);

    fg_linear *gen = m->gen; /* one decode step */
    add(&gen[T_CTOG], X_WC, weights, hw->ctog_bdw);
    add(&gen[T_CTOG], X_WN, weights, hw->ctog_bdw);
    add(&gen[T_CTOG], X_HC, hidden_gen, hw->ctog_bdw);
    add(&gen[T_CTOG], X_HN, hidden_gen, hw->ctog_bdw);
    add(&gen[T_GTOC], X_HC, hidden_gen, hw->gtoc_bdw_hidden);
    add(&gen[T_GTOC], X_HN, hidden_gen, hw->gtoc_bdw_hidden);
    add(&gen[T_DTOC], X_CN, cache_gen, hw->dtoc_bdw);
    add(&gen[T_DTOC], X_WN, weights, hw->dtoc_bdw);
    add(&gen[T_DTOC], X_HN, hidden_gen, hw->dtoc_bdw);
    add(&gen[T_CTOD], X_CN, cache_new, hw->ctod_bdw_g);
    add(&gen[T_CTOD], X_HN, hidden_gen, hw->ctod_bdw_g);
    add(&gen[T_COMP], -1, bls * weights16, int8 ? hw->mm_flops_int8_g : hw->mm_flops_g);
    /* attention: 4 bls (s + n/2) qw FLOPs over the whole cache (A.3 writes them as its bytes) */
    double att = 4 * bls * (s + n / 2) * qw;
    decode_attention_terms(gen, w, hw, att, cache_gen, cache_new, kept);
    double fp16_bytes[3] = {weights16, cache_pre / kv, cache_gen * kept / kv};
    compute_reads(pre, gen, w, hw, fp16_bytes, int8);
    /* the output layer, once per generated token: logits of the block's last tokens */
    m->head = 2 * bls * c->vocab * (double)c->word_dim / hw->mm_flops_g;
    if (!hw->gpu_is_host) host_terms(c, w, hw, kept, m);
}

double fg_linear_eval(const fg_linear *f, const double x[N_X]) {
    double v = f->constant;
    for (int k = 0; k < N_X; k++) v += f->coef[k] * x[k];
    return v;
}

static double max_term(const fg_linear *terms, const double x[N_X]) {
    double t = 0;
    for (int i = 0; i < N_TERMS; i++) t = fmax(t, fg_linear_eval(&terms[i], x));
    return t;
}

/* ============================================================================================
 * The diagonal block schedule (Appendix A.2.1, Fig. 6). The block's ngb = K GPU batches are
 * groups staggered by n/K steps: group k takes prompts at step diagonal_start(k) = k n / K and
 * again every n steps, so that each step loads every layer's weights once and computes one step of
 * every group. A.2.1 counts, for n groups of a block of bls sequences, each layer's weights w:
 *   zig-zag    peak_mem = w + 2 h1 bls + 4 h1 bls l (s + n)
 *   diagonal   peak_mem = w + 2 h1 bls + 4 h1 bls l (2s + n)(n - 1) / (2n)
 * so that the same memory holds a block larger by about (2s + 2n) / (2s + n), while the I/O per
 * generated token is the zig-zag's for the same bls. In the runtime's accounting a sequence at
 * step j of its own holds s + j rows, and the peak is the step just before a group ends
 * (fg_diagonal_rows). The cost: after the one-time warm-up (the staircase until the last group has
 * started) and before the drain (the same staircase at the end) each step generates bls tokens, as
 * a zig-zag step does. A run of N prompts takes N / bls rounds of n steps and the staircase's
 * diagonal_start(K - 1) steps more, each priced as a full step (so with the weights' I/O bound:
 * compute-bound, a staircase step costs less).
 * ============================================================================================ */

double fg_diagonal_rows(int s, int n, int groups) {
    double most = 0;
    for (int e = 0; e < groups; e++) { /* just before group e ends, at step start_e - 1 (mod n) */
        int i = (diagonal_start(e, groups, n) + n - 1) % n;
        double rows = 0;
        for (int k = 0; k < groups; k++)
            rows += s + ((i - diagonal_start(k, groups, n)) % n + n) % n;
        most = fmax(most, rows);
    }
    return most / groups;
}

/* The diagonal's time for its prompts over that of as many full zig-zag blocks: the staircase's
 * steps over those of N / bls rounds. */
static double warmup_factor(const fg_workload *w) {
    if (w->schedule != FG_SCHEDULE_DIAGONAL) return 1;
    double bls = (double)w->gbs * w->ngb, prompts = w->prompts > 0 ? w->prompts : bls;
    return 1 + diagonal_start(w->ngb - 1, w->ngb, w->n) / (double)w->n * bls / prompts;
}

double fg_cost_per_token(const fg_cost_model *m, const model_config *c, const fg_workload *w,
                         const double x[N_X], double *t_pre, double *t_gen) {
    double pre = max_term(m->pre, x), gen = max_term(m->gen, x), l = c->n_layers;
    if (t_pre) *t_pre = pre;
    if (t_gen) *t_gen = gen;
    return (pre * l + gen * (w->n - 1) * l + m->head * w->n) * warmup_factor(w) /
           ((double)w->gbs * w->ngb);
}

/* ============================================================================================
 * Peak memory (§4.3's constraints), in the runtime's own accounting (fg_check_plan), so that a
 * placement the LP finds is one the runtime accepts, up to the rounding of its fractions to
 * tensors and rows. A.3 writes FlexGen's accounting instead (one working buffer per op); ours
 * holds activations as the backend does (fp16 on a GPU as in FlexGen, fp32 on the CPU), runs
 * prefill in chunks of the workspace's rows, double-buffers the staging of weights, cache and
 * activations, and keeps two layers of disk pages in flight on the cpu tier.
 * ============================================================================================ */

/* Adds bytes to tier term f: its constant (k < 0) or the coefficient of x_k. */
static void add_bytes(fg_linear *f, int k, double bytes) { add(f, k, bytes, 1); }

/* Layer j's vocabulary matrix: embed_tokens in the first, an untied lm_head in the last. */
static double vocab_params(const model_config *c, int j) {
    return j == 0 || (j > c->n_layers && c->untied) ? (double)c->vocab * c->word_dim : 0;
}

/* FG_W_MOSTLY_GPU: no weights on disk, and on cpu a share wc too small for any vocabulary matrix to
 * go there (place_tensors takes a layer's tensors off the gpu tier while each one's midpoint falls
 * within the share asked; a matrix's is at least half of its part of its layer). A staging arena
 * then holds a decoder layer's staged part, at most wc x (all stored bytes) / l, or an embedding
 * layer's other tensors: not the largest layer, often the embedding. This is that share. */
static double mostly_gpu_share(const model_config *c) {
    double share = 0.5;
    for (int j = 0; j < c->n_layers + 2; j += j == 0 ? c->n_layers + 1 : 1)
        if (vocab_params(c, j) > 0)
            share = fmin(share, vocab_params(c, j) / layer_param_count(c, j) / 2);
    return share;
}

int fg_weights_case(const model_config *c, const double x[N_X]) {
    if (x[X_WN] > 0) return FG_W_DISK;
    if (x[X_WG] == 1) return FG_W_GPU;
    return x[X_WC] <= mostly_gpu_share(c) ? FG_W_MOSTLY_GPU : FG_W_MEMORY;
}

/* A weight staging arena (tiers.c's place_weights): the largest layer in the form the products
 * read, 4-bit codes for its matrices and tables where the weights are compressed (its biases and
 * norms stay fp16), each of up to 16 tensors 64-byte aligned. With mostly_gpu, FG_W_MOSTLY_GPU's
 * constant part: an embedding layer's tensors but its vocabulary matrix, in fp16 at most. */
static double staging_arena(const model_config *c, int compress_weight, int mostly_gpu) {
    double arena = 0;
    for (int j = 0; j < c->n_layers + 2; j += j == 1 ? c->n_layers : 1) {
        double params = (double)layer_param_count(c, j);
        double vectors = (double)layer_vector_count(c, j);
        double codes = 2 * (params - vectors) * 36.0 / 128 + 2 * vectors;
        double bytes = compress_weight ? codes : 2 * params;
        if (mostly_gpu) bytes = j >= 1 && j <= c->n_layers ? 0 : 2 * (params - vocab_params(c, j));
        arena = fmax(arena, bytes + 16 * 64.0);
    }
    return arena;
}

void fg_memory_model_build(const model_config *c, const fg_workload *w, const fg_hardware *hw,
                           int weights, fg_memory_model *mm) {
    double h = c->hidden, s = w->s, len = s + w->n;
    double gbs = w->gbs, bls = (double)w->gbs * w->ngb, P = (double)opt_param_count(c);
    double q4 = w->compress_weight ? 36.0 / 128 : 1;
    double stored = 2 * P * q4; /* cpu and disk homes */
    double on_gpu = w->compress_weight ? stored : 2 * P;
    /* the largest layer: a decoder layer, or an embedding; its tensors' padding */
    double layer = 0;
    for (int j = 0; j < c->n_layers + 2; j += j == 1 ? c->n_layers : 1)
        layer = fmax(layer, (double)layer_param_count(c, j) + 16.0 * 15);
    double kv_row = (double)opt_kv_row_bytes(c, w->compress_cache);
    double act_row = h * (double)(hw->gpu_is_host ? FG_CPU_ACT_ELEM : FG_CUDA_ACT_ELEM);
    double micro = w->micro > 1 ? w->micro : 1; /* each micro-batch of a stage has its own */
    /* a sequence's cache: len rows, as kv_pool_shape's pools hold sequences all of length len
     * (the diagonal's: the mean at its peak) */
    double rows = w->schedule == FG_SCHEDULE_DIAGONAL ? fg_diagonal_rows(w->s, w->n, w->ngb) : len;
    double cache = 2 * kv_row * c->n_layers * bls * rows * micro, act = act_row * bls * s * micro;
    double stage_len = w->cpu_cache_compute ? s : len;
    memset(mm, 0, sizeof *mm);
    fg_linear *gpu = &mm->tier[TIER_GPU], *cpu = &mm->tier[TIER_CPU];
    const double homes[3] = {on_gpu, stored, stored};
    for (int t = 0; t < N_TIERS; t++) {
        add_bytes(&mm->tier[t], X_WG + t, homes[t]);
        add_bytes(&mm->tier[t], X_CG + t, cache);
        add_bytes(&mm->tier[t], X_HG + t, act);
    }
    if (weights != FG_W_GPU) /* two staging arenas */
        add_bytes(gpu, -1, 2 * staging_arena(c, w->compress_weight, weights == FG_W_MOSTLY_GPU));
    if (weights == FG_W_MOSTLY_GPU) add_bytes(gpu, X_WC, 2 * stored / c->n_layers);
    add_bytes(gpu, X_CC, 4 * kv_row * gbs * stage_len);
    add_bytes(gpu, X_CN, 4 * kv_row * gbs * stage_len);
    add_bytes(gpu, -1, 2 * act_row * gbs * s); /* activation staging */
    size_t (*workspace)(const model_config *, size_t, int, int) =
        hw->gpu_is_host ? model_workspace_bytes : fg_cuda_workspace_bytes;
    add_bytes(gpu, -1, (double)workspace(c, fg_workspace_rows(w->gbs, w->s), w->s, (int)len));
    add_bytes(gpu, -1, 4 * bls * c->vocab); /* logits */
    if (!hw->gpu_is_host) {
        /* held beyond */
        add_bytes(gpu, -1, FG_CUDA_RESERVE);
        add_bytes(cpu, -1, FG_CUDA_HOST_RESERVE);
        if (w->cpu_cache_compute)
            add_bytes(cpu, -1, (double)fg_cuda_delegated_bytes(c, (size_t)w->gbs, (int)len));
    }
    if (weights == FG_W_DISK) add_bytes(cpu, -1, 2 * 2 * layer * q4); /* two layers read ahead */
    add_bytes(cpu, X_CN, 2 * 2 * kv_row * gbs * len);
    add_bytes(cpu, X_HN, 2 * act_row * gbs * s);
    add_bytes(cpu, -1, 4 * 4096.0);
    if (hw->gpu_is_host)
        for (int t = TIER_GPU; t <= TIER_CPU; t++) {
            mm->host.constant += mm->tier[t].constant;
            for (int k = 0; k < N_X; k++) mm->host.coef[k] += mm->tier[t].coef[k];
        }
}

/* ============================================================================================
 * The simplex: a dense two-phase simplex (lp_solve), the solver of the placement LP.
 *
 * §4.3 enumerates the block shape (bls, gbs) and, for each, finds the placement
 * p = (wg, wc, wn, cg, cc, cn, hg, hc, hn) by linear programming, Eq. (1): minimize T / bls such
 * that each tier's peak memory fits its capacity and each triple sums to 1. A.3 writes T from
 * max(...)es of a layer's five latencies (ctog, gtoc, dtoc, ctod, comp) in prefill and in decode;
 * each max becomes linear as one more variable that is >= every one of its terms. That LP has a few
 * tens of variables and rows, all of them dense: a full tableau is the simplest method there is
 * and, at this size, also the fastest (no factorization to keep, nothing sparse to index).
 *
 * The problem (lp_problem in flexgen.h): minimize c.x subject to A_i . x {<=, =, >=} b_i, x >= 0.
 *
 * Standard form. Each row is negated when b_i < 0 (<= and >= swap), so that every right-hand side
 * is >= 0 (a >= row with b_i = 0 too: as a <= row it starts with its slack basic), and divided by
 * its largest |A_ij| (see Tolerances). Then
 *     a <= row gets a slack    s >= 0:   A_i . x + s = b_i    s is its first basic variable
 *     a >= row gets a surplus  s >= 0:   A_i . x - s = b_i    and an artificial a_i >= 0
 *     an = row                           A_i . x     = b_i    and an artificial a_i >= 0
 * The artificial is the first basic variable of its row: x = 0, s = b on the <= rows, a = b on the
 * others is a vertex of the enlarged problem, though a point of the real one only if every a = 0.
 *
 * The tableau: m constraint rows and one row of reduced costs, w = n + 1 doubles each, where n
 * counts the columns of x and then of the slacks and surpluses:
 *     row i < m:   T_ij, row i of B^-1 A  | B^-1 b_i, the value of row i's basic variable (rhs)
 *     row d:       reduced costs d_j      | -(the objective at the current vertex)
 * basis[i] names row i's basic variable: a column, or ART for row i's artificial. Artificial
 * columns are not stored: while an artificial is basic its column is a unit vector, and once it
 * has left the basis it is never let back in (it only served to find a first vertex), so nothing
 * would read them.
 *
 * A pivot on (p, q) makes column q basic in row p: row p is divided by T_pq, and T_iq times row p
 * is subtracted from every other row, the reduced costs included. Column q becomes a unit vector.
 *
 * Phase 1 minimizes the sum of the artificials from the slack/artificial basis; its reduced costs
 * are d_j = -(sum of T_ij over the rows whose basic variable is artificial). A minimum above zero
 * means no x satisfies the rows: LP_INFEASIBLE. At zero, artificials may still be basic, at value 0
 * (a degenerate vertex). Each is pivoted out on its row's largest entry, a pivot that moves nothing
 * since its rhs is 0; a row with no entry above the pivot tolerance is a combination of other rows
 * (a duplicated equality, say) and is dropped.
 *
 * Phase 2 minimizes c.x from phase 1's vertex, with d_j = c_j - sum_i c_basis(i) T_ij. When no
 * d_j < 0 the vertex is optimal. A column with d_j < 0 and no positive entry is a ray along which
 * c.x falls without end: LP_UNBOUNDED.
 *
 * Pivot rules. The entering column has the most negative d_j (Dantzig's rule, few pivots), except
 * right after a degenerate pivot (one whose step was 0, so the objective did not move), where it is
 * the first column with d_j < 0 (Bland's rule). The leaving row has the least ratio rhs_i / T_iq
 * over T_iq > 0, ties to the lowest basic variable (artificials first). Dantzig's rule alone can
 * cycle (Beale's example; tests/test_lp.c has an LP on which it cycles in this tableau), but only
 * through degenerate pivots: any other pivot lowers the objective strictly, so no earlier basis
 * can come back. A cycle would then be degenerate pivots each following a degenerate pivot, all of
 * them Bland's, and Bland's rule never cycles. So every solve ends, in about as many pivots as
 * Dantzig's rule alone takes (Bland's rule alone takes 2.7 times as many on the 40 x 40 LPs of
 * scripts/bench_lp.sh: 249 against 91).
 *
 * Tolerances (relative: 1e-9 for pivots and for values). Rounding in double precision is 1.1e-16
 * per operation and grows with the entries a pivot multiplies, so after the O(m) pivots of a solve
 * an entry that should be 0 is noise of around 1e-14 to 1e-12 of the largest numbers it was
 * computed from. Every comparison with 0 is therefore made relative to the scale of the numbers
 * compared, and each tolerance sits between that noise and the smallest real values:
 *     pivot entries T_iq   rows are divided by their largest |A_ij| up front; an entry at or under
 *                          1e-9 of the largest in its column is never a pivot (dividing by noise
 *                          makes x jump by 1e9 and more). The policy LP's widest spread in a row,
 *                          one token's activations against a layer's weights, 2 h1 / (8 h1^2 +
 *                          4 h1 h2), is 7e-6 for OPT-175B: far above 1e-9.
 *     right-hand sides     at or under 1e-9 x the largest |b_k| (of the scaled rows) that a
 *                          row's has been built from, its rhs_scale, are 0, and are set to 0:
 *                          below 0 it can only be rounding (or an entry under the pivot tolerance
 *                          that the ratio test skipped), and a vertex must stay in x >= 0; above
 *                          0, setting it makes the near-ties of a degenerate vertex exact ties,
 *                          with a step of exactly 0. (Reading it as 0 only in the ratio test would
 *                          step rhs / T_pq, far when T_pq is small, and push the other rows that
 *                          far below 0.) Per row, so that a bound no point nears (--max-latency
 *                          1e9) zeroes no row it never entered. Phase 1 is feasible when every
 *                          artificial ends at 0.
 *     reduced costs d_j    < -1e-9 x max|c_j| to enter (phase 1 costs are 1: 1e-9).
 * The values are those that sit mid-way in what the tests accept: on 30000 of tests/test_lp.c's
 * random LPs against GLPK, every answer agrees with a pivot tolerance anywhere from 1e-11 to 1e-7
 * (at 1e-12, 4 LPs pivot on noise) and a value tolerance from 1e-11 to 1e-7 (1 LP wrong at 1e-12,
 * 12 at 1e-6).
 ============================================================================================ */

#define LP_PIVOT_TOL 1e-9 /* see Tolerances above */
#define LP_ZERO_TOL 1e-9
#define ART (-1) /* basis[i] of a row whose artificial is basic; lowest in Bland's order */

typedef struct {
    int m;     /* constraint rows still in the tableau (redundant ones are dropped) */
    int n;     /* columns: n_vars of x, then the slacks and surpluses; column n is the rhs */
    int w;     /* row length, n + 1 */
    double *T; /* [m][w] constraint rows */
    double *d; /* [w] reduced costs; d[n] = -objective */
    double *rhs_scale; /* [m] the largest b_k in row i's rhs (see Tolerances) */
    int *basis;        /* [m] */
} tableau;

static int check_problem(const lp_problem *p, char *err) {
    if (!p) return fg_fail(err, "lp_solve: no problem");
    if (p->n_vars < 1) return fg_fail(err, "lp_solve: n_vars is %d, needs at least 1", p->n_vars);
    if (p->n_rows < 0) return fg_fail(err, "lp_solve: n_rows is %d, needs at least 0", p->n_rows);
    if (!p->c) return fg_fail(err, "lp_solve: c is NULL");
    if (p->n_rows > 0 && (!p->A || !p->sense || !p->b))
        return fg_fail(err, "lp_solve: A, sense or b is NULL with %d rows", p->n_rows);
    for (int j = 0; j < p->n_vars; j++)
        if (!isfinite(p->c[j])) return fg_fail(err, "lp_solve: c[%d] is not finite", j);
    for (int i = 0; i < p->n_rows; i++) {
        if (p->sense[i] != LP_LE && p->sense[i] != LP_EQ && p->sense[i] != LP_GE)
            return fg_fail(err, "lp_solve: sense[%d] is %d, not LP_LE, LP_EQ or LP_GE", i,
                           (int)p->sense[i]);
        if (!isfinite(p->b[i])) return fg_fail(err, "lp_solve: b[%d] is not finite", i);
        for (int j = 0; j < p->n_vars; j++)
            if (!isfinite(p->A[(size_t)i * p->n_vars + j]))
                return fg_fail(err, "lp_solve: A[%d][%d] is not finite", i, j);
    }
    return 0;
}

/* The standard form above, in one allocation: rows negated to b >= 0 and scaled to max |A_ij| 1,
 * a slack or surplus column per inequality, the slack/artificial basis. */
static int tableau_build(tableau *t, const lp_problem *p, char *err) {
    int nv = p->n_vars, m = p->n_rows, n_slack = 0;
    for (int i = 0; i < m; i++) n_slack += p->sense[i] != LP_EQ;
    t->m = m;
    t->n = nv + n_slack;
    t->w = t->n + 1;
    size_t doubles = (size_t)(m + 1) * t->w + m;
    t->T = calloc(1, doubles * sizeof(double) + (size_t)m * sizeof(int));
    if (!t->T) return fg_fail(err, "lp_solve: out of memory for a %d x %d tableau", m + 1, t->w);
    t->d = t->T + (size_t)m * t->w;
    t->rhs_scale = t->d + t->w;
    t->basis = (int *)(t->T + doubles);
    int s = nv; /* the next slack or surplus column */
    for (int i = 0; i < m; i++) {
        const double *a = p->A + (size_t)i * nv;
        double *row = t->T + (size_t)i * t->w;
        double amax = 0;
        for (int j = 0; j < nv; j++) amax = fmax(amax, fabs(a[j]));
        /* negated when b < 0, and also a >= row with b = 0: as a <= row it needs no artificial */
        lp_sense sense = p->sense[i];
        int negate = p->b[i] < 0 || (p->b[i] == 0 && sense == LP_GE);
        double scale = (amax > 0 ? 1 / amax : 1) * (negate ? -1 : 1);
        if (negate && sense != LP_EQ) sense = sense == LP_LE ? LP_GE : LP_LE;
        for (int j = 0; j < nv; j++) row[j] = a[j] * scale;
        row[t->n] = p->b[i] * scale;
        t->rhs_scale[i] = row[t->n];
        if (sense == LP_LE) { /* a slack, basic */
            row[s] = 1;
            t->basis[i] = s++;
        } else if (sense == LP_GE) { /* a surplus, and the artificial basic */
            row[s++] = -1;
            t->basis[i] = ART;
        } else {
            t->basis[i] = ART;
        }
    }
    return 0;
}

/* Subtracts f = row[q] times the pivot row rp from row, leaving row[q] exactly 0. */
static void eliminate(double *row, const double *rp, int q, int w) {
    double f = row[q];
    if (f == 0) return;
    for (int j = 0; j < w; j++) row[j] -= f * rp[j];
    row[q] = 0;
}

static void pivot(tableau *t, int p, int q) {
    int w = t->w;
    double *rp = t->T + (size_t)p * w, inv = 1 / rp[q];
    for (int j = 0; j < w; j++) rp[j] *= inv;
    rp[q] = 1;
    for (int i = 0; i < t->m; i++) {
        double *row = t->T + (size_t)i * w;
        if (i == p || row[q] == 0) continue;
        t->rhs_scale[i] = fmax(t->rhs_scale[i], t->rhs_scale[p]);
        eliminate(row, rp, q, w);
        if (row[t->n] <= LP_ZERO_TOL * t->rhs_scale[i]) row[t->n] = 0; /* see Tolerances */
    }
    eliminate(t->d, rp, q, w);
    t->basis[p] = q;
}

/* Dantzig: the most negative reduced cost; Bland: the first negative one. -1: optimal. */
static int entering(const tableau *t, double eps_d, int bland) {
    int q = -1;
    for (int j = 0; j < t->n; j++)
        if (t->d[j] < -eps_d && (q < 0 || t->d[j] < t->d[q])) {
            q = j;
            if (bland) break;
        }
    return q;
}

/* The minimum ratio rhs_i / T_iq over T_iq > 0, ties to the lowest basic variable. -1: a ray. */
static int leaving(const tableau *t, int q) {
    double colmax = 1; /* see Tolerances */
    for (int i = 0; i < t->m; i++) colmax = fmax(colmax, fabs(t->T[(size_t)i * t->w + q]));
    int p = -1;
    double best = 0;
    for (int i = 0; i < t->m; i++) {
        const double *row = t->T + (size_t)i * t->w;
        if (row[q] <= LP_PIVOT_TOL * colmax) continue;
        double r = row[t->n] / row[q];
        if (p < 0 || r < best || (r == best && t->basis[i] < t->basis[p])) {
            p = i;
            best = r;
        }
    }
    return p;
}

/* Pivots until the current reduced costs say optimal (LP_OPTIMAL) or a ray shows (LP_UNBOUNDED).
 * Returns -1 past 1000 (m + n + 10) pivots, over 500 times the most any phase of the random LPs of
 * tests/test_lp.c takes: only numerical trouble could get there. */
static int simplex(tableau *t, double eps_d, lp_status *status) {
    long limit = 1000L * (t->m + t->n + 10);
    int degenerate = 0;
    for (long it = 0; it < limit; it++) {
        int q = entering(t, eps_d, degenerate);
        if (q < 0) {
            *status = LP_OPTIMAL;
            return 0;
        }
        int p = leaving(t, q);
        if (p < 0) {
            *status = LP_UNBOUNDED;
            return 0;
        }
        degenerate = t->T[(size_t)p * t->w + t->n] == 0;
        pivot(t, p, q);
    }
    return -1;
}

/* Phase 1's reduced costs: minus the sum of the rows whose artificial is basic. */
static void phase1_costs(tableau *t) {
    memset(t->d, 0, t->w * sizeof(double));
    for (int i = 0; i < t->m; i++)
        if (t->basis[i] == ART) {
            const double *row = t->T + (size_t)i * t->w;
            for (int j = 0; j < t->w; j++) t->d[j] -= row[j];
        }
}

/* Phase 1's objective at the current vertex, summed afresh (d[n] has it too, but without the
 * right-hand sides that pivots set to 0). */
static double artificial_sum(const tableau *t) {
    double sum = 0;
    for (int i = 0; i < t->m; i++)
        if (t->basis[i] == ART) sum += t->T[(size_t)i * t->w + t->n];
    return sum;
}

/* After a phase 1 that reached zero: every artificial still basic (at 0) is pivoted out on its
 * row's largest entry, or its row, all zeros, is dropped (the last row takes its place). */
static void drive_out_artificials(tableau *t) {
    for (int i = 0; i < t->m;) {
        double *row = t->T + (size_t)i * t->w;
        if (t->basis[i] != ART) {
            i++;
            continue;
        }
        int q = 0;
        for (int j = 1; j < t->n; j++)
            if (fabs(row[j]) > fabs(row[q])) q = j;
        row[t->n] = 0;
        if (fabs(row[q]) > LP_PIVOT_TOL) {
            pivot(t, i, q);
            i++;
        } else {
            t->m--;
            memmove(row, t->T + (size_t)t->m * t->w, t->w * sizeof(double));
            t->rhs_scale[i] = t->rhs_scale[t->m];
            t->basis[i] = t->basis[t->m];
        }
    }
}

/* Phase 2's reduced costs: c, minus c_basis(i) times row i for every row. */
static void phase2_costs(tableau *t, const double *c, int n_vars) {
    memset(t->d, 0, t->w * sizeof(double));
    memcpy(t->d, c, n_vars * sizeof(double));
    for (int i = 0; i < t->m; i++) {
        int k = t->basis[i];
        if (k >= n_vars) continue; /* a slack or surplus: cost 0 (no artificial is left) */
        const double *row = t->T + (size_t)i * t->w;
        for (int j = 0; j < t->w; j++) t->d[j] -= c[k] * row[j];
    }
}

/* Runs both phases on a built tableau. Returns -1 only past simplex()'s bound. */
static int solve_phases(tableau *t, const lp_problem *p, lp_status *status) {
    int has_artificial = 0;
    for (int i = 0; i < t->m; i++) has_artificial |= t->basis[i] == ART;
    if (has_artificial) {
        /* Phase 1 is bounded below by 0: a "ray" there can only be a column whose entries all
         * fell under the pivot tolerance, and phase 1 then ends where it is. */
        phase1_costs(t);
        if (simplex(t, LP_ZERO_TOL, status)) return -1;
        if (artificial_sum(t) > 0) {
            *status = LP_INFEASIBLE;
            return 0;
        }
        drive_out_artificials(t);
    }
    double cmax = 0;
    for (int j = 0; j < p->n_vars; j++) cmax = fmax(cmax, fabs(p->c[j]));
    phase2_costs(t, p->c, p->n_vars);
    return simplex(t, LP_ZERO_TOL * cmax, status);
}

int lp_solve(const lp_problem *p, lp_status *status, double *x, double *objective, char *err) {
    if (check_problem(p, err)) return -1;
    tableau t = {0};
    if (tableau_build(&t, p, err)) return -1;
    int rc = solve_phases(&t, p, status);
    if (rc)
        fg_fail(err,
                "lp_solve: the simplex did not end within its pivot bound on a %d x %d LP "
                "(numerical trouble)",
                p->n_rows, p->n_vars);
    else if (*status == LP_OPTIMAL) {
        memset(x, 0, p->n_vars * sizeof(double));
        for (int i = 0; i < t.m; i++) /* x_j is its row's rhs when basic, else 0 */
            if (t.basis[i] >= 0 && t.basis[i] < p->n_vars)
                x[t.basis[i]] = t.T[(size_t)i * t.w + t.n];
        double z = 0;
        for (int j = 0; j < p->n_vars; j++) z += p->c[j] * x[j];
        *objective = z;
    }
    free(t.T);
    return rc;
}

/* ============================================================================================
 * The policy search's steps (fg_policy_search, above): an LP per block shape, its optimum
 * rounded, realized and checked, the best shapes tried first
 * ============================================================================================ */

/* The prompts a run streams through a block of bls: those there are, up to stream_blocks blocks. */
static int streamed(const fg_search_request *r, int bls) {
    int prompts = r->max_block > 0 ? r->max_block : bls;
    return r->stream_blocks > 0 && prompts / r->stream_blocks > bls ? r->stream_blocks * bls
                                                                    : prompts;
}

static fg_workload workload_of(const search *S, int gbs, int ngb, int cpu_cache_compute) {
    return (fg_workload){.s = S->req->s,
                         .s_mean = S->req->s_mean,
                         .n = S->req->n,
                         .gbs = gbs,
                         .ngb = ngb,
                         .cpu_cache_compute = cpu_cache_compute,
                         .compress_weight = S->base->compress_weight,
                         .compress_cache = S->base->compress_cache,
                         .int8 = S->base->int8_activations,
                         .micro = S->base->n_stages,
                         .schedule = S->base->schedule,
                         .prompts = streamed(S->req, gbs * ngb),
                         .attn_sparsity = S->base->attn_sparsity};
}

/* The LP's rows, one at a time: coefficients over x (and T_pre, T_gen), sense, right side. */
typedef struct {
    double A[MAX_ROWS][N_VARS], b[MAX_ROWS];
    lp_sense sense[MAX_ROWS];
    int n;
} lp_rows;

static double *row_add(lp_rows *r, lp_sense sense, double b) {
    r->sense[r->n] = sense;
    r->b[r->n] = b;
    return r->A[r->n++];
}

/* coef . x (+ t T) <= bound - constant */
static void row_le(lp_rows *r, const fg_linear *f, int t_var, double bound) {
    double *a = row_add(r, LP_LE, bound - f->constant);
    memcpy(a, f->coef, sizeof f->coef);
    if (t_var >= 0) a[t_var] = -1;
}

static int solve_shape(search *S, candidate *cd, char *err) {
    fg_workload w = workload_of(S, cd->gbs, cd->ngb, cd->cpu_cache_compute);
    fg_cost_model cm;
    fg_memory_model mm;
    fg_cost_model_build(S->cfg, &w, S->hw, &cm);
    fg_memory_model_build(S->cfg, &w, S->hw, cd->weights, &mm);
    double l = S->cfg->n_layers, n = w.n, bls = (double)w.gbs * w.ngb, f = warmup_factor(&w);
    lp_rows r = {.n = 0};
    for (int i = 0; i < N_TERMS; i++) {
        row_le(&r, &cm.pre[i], V_PRE, 0);
        row_le(&r, &cm.gen[i], V_GEN, 0);
    }
    for (int k = 0; k < 3; k++) {
        double *a = row_add(&r, LP_EQ, 1);
        a[3 * k] = a[3 * k + 1] = a[3 * k + 2] = 1;
    }
    for (int t = 0; t < N_TIERS; t++) row_le(&r, &mm.tier[t], -1, S->capacity[t]);
    if (S->host_memory > 0) row_le(&r, &mm.host, -1, S->host_memory);
    if (cd->weights == FG_W_GPU) row_add(&r, LP_EQ, 1)[X_WG] = 1;
    if (cd->weights == FG_W_MOSTLY_GPU) row_add(&r, LP_LE, mostly_gpu_share(S->cfg))[X_WC] = 1;
    if (cd->weights == FG_W_MOSTLY_GPU || cd->weights == FG_W_MEMORY)
        row_add(&r, LP_EQ, 0)[X_WN] = 1;
    if (S->req->max_latency > 0) {
        double *a = row_add(&r, LP_LE, S->req->max_latency / f - n * cm.head);
        a[V_PRE] = l;
        a[V_GEN] = l * (n - 1);
    }
    double c[N_VARS] = {0}, x[N_VARS], z;
    c[V_PRE] = f * l / bls;
    c[V_GEN] = f * l * (n - 1) / bls;
    /* Among placements of equal T (a term that does not bound T is free), prefer the faster
     * tiers: the model leaves out what each small transfer costs. The nudge is 1e-4 of the
     * compute time per tier step, and is not part of the objective reported. */
    double nudge = 1e-4 * (c[V_PRE] * cm.pre[T_COMP].constant + c[V_GEN] * cm.gen[T_COMP].constant);
    for (int k = 0; k < 3; k++) {
        c[3 * k + 1] = nudge;
        c[3 * k + 2] = 2 * nudge;
    }
    lp_problem p = {N_VARS, r.n, c, &r.A[0][0], r.sense, r.b};
    lp_status status;
    S->lps++;
    if (lp_solve(&p, &status, x, &z, err)) return -1;
    if (status != LP_OPTIMAL) return 0;
    cd->objective = c[V_PRE] * x[V_PRE] + c[V_GEN] * x[V_GEN] + f * n * cm.head / bls;
    memcpy(cd->x, x, sizeof cd->x);
    return 1;
}

/* Integer percentages near the fractions on the gpu and cpu tiers, the pair at most 100. */
void fg_round_pair(double gpu, double cpu, int *gpu_pct, int *cpu_pct) {
    *gpu_pct = (int)lround(100 * gpu);
    *cpu_pct = (int)lround(100 * cpu);
    *gpu_pct = *gpu_pct < 0 ? 0 : *gpu_pct > 100 ? 100 : *gpu_pct;
    *cpu_pct = *cpu_pct < 0 ? 0 : *cpu_pct > 100 - *gpu_pct ? 100 - *gpu_pct : *cpu_pct;
}

static fg_percent round_percent(const double x[N_X]) {
    fg_percent pc;
    fg_round_pair(x[X_WG], x[X_WC], &pc.wg, &pc.wc);
    fg_round_pair(x[X_CG], x[X_CC], &pc.cg, &pc.cc);
    fg_round_pair(x[X_HG], x[X_HC], &pc.hg, &pc.hc);
    return pc;
}

static fg_policy policy_of(const search *S, const candidate *cd) {
    fg_policy p = *S->base;
    p.gpu_batch_size = cd->gbs;
    p.num_gpu_batches = cd->ngb;
    p.cpu_cache_compute = cd->cpu_cache_compute;
    p.percent = round_percent(cd->x);
    return p;
}

/* This runtime's verdict on policy p (the check the search was given) for blocks of bls
 * sequences, one for each stage of a pipeline (§4.4). */
static int runtime_check(const search *S, const fg_policy *p, int bls, int check, double x[N_X],
                         fg_stats *st, char *err) {
    int sequences = bls * (p->n_stages > 1 ? p->n_stages : 1);
    if (S->req->check)
        return S->req->check(S->model, S->req->seed, p, sequences, S->req->s, S->req->n, check, x,
                             st, err);
    fg_policy there = *p; /* another machine: where this runtime would place the weights there */
    there.device = FG_DEVICE_CPU;
    return S->req->place(S->model, S->req->seed, &there, sequences, S->req->s, S->req->n, 0, x, st,
                         err);
}

/* x of the percentages: each triple's gpu and cpu shares (wg wc, cg cc, hg hc), disk the rest. */
static void percent_fractions(const fg_percent *pc, double x[N_X]) {
    const int gpu_cpu[3][2] = {{pc->wg, pc->wc}, {pc->cg, pc->cc}, {pc->hg, pc->hc}};
    for (int i = 0; i < 3; i++) {
        x[3 * i] = gpu_cpu[i][0] / 100.0;
        x[3 * i + 1] = gpu_cpu[i][1] / 100.0;
        x[3 * i + 2] = 1 - x[3 * i] - x[3 * i + 1];
    }
}

/* For another machine: the first tier whose memory model exceeds its capacity at the placement
 * the rounded percentages realize (N_TIERS: the host's memory), or -1; *need its bytes. */
static int tier_over(const search *S, const fg_policy *p, double x[N_X], double *need) {
    char err[FG_ERR_LEN];
    percent_fractions(&p->percent, x);
    if (S->req->place) runtime_check(S, p, p->gpu_batch_size * p->num_gpu_batches, 0, x, NULL, err);
    fg_workload w = workload_of(S, p->gpu_batch_size, p->num_gpu_batches, p->cpu_cache_compute);
    fg_memory_model mm;
    fg_memory_model_build(S->cfg, &w, S->hw, fg_weights_case(S->cfg, x), &mm);
    for (int t = 0; t < N_TIERS; t++)
        if ((*need = fg_linear_eval(&mm.tier[t], x)) > S->capacity[t]) return t;
    if (S->host_memory > 0 && (*need = fg_linear_eval(&mm.host, x)) > S->host_memory)
        return N_TIERS;
    return -1;
}

/* Does policy p fit? On this machine the runtime's plan check says, and x becomes the placement
 * it realizes; for another machine, the memory model at the rounded percentages. */
static int plan_fits(search *S, const fg_policy *p, double x[N_X]) {
    char err[FG_ERR_LEN];
    double need;
    S->checks++;
    if (S->req->check)
        return runtime_check(S, p, p->gpu_batch_size * p->num_gpu_batches, 1, x, NULL, err) == 0;
    return tier_over(S, p, x, &need) < 0;
}

/* Best objective first; among equal ones (to 1e-6: a compute-bound block gains nothing from
 * growing) the smaller block, whose latency and memory are less. */
static int same_cost(double a, double b) {
    return isfinite(a) && isfinite(b) && fabs(a - b) <= 1e-6 * fmax(a, b);
}
/* The runtime places whole tensors, each on the tier where its midpoint falls, so a weight
 * percentage can realize up to half a tensor more than asked on the gpu or cpu tier (a third of
 * a decoder layer, for fc1). When the rounded plan does not fit, its gpu, then cpu, percentage
 * steps down until the realized fraction is no more than the LP's. */
static void snap_weights(search *S, fg_policy *p, const double lp_x[N_X]) {
    char err[FG_ERR_LEN];
    double x[N_X];
    int bls = p->gpu_batch_size * p->num_gpu_batches;
    int *percent[2] = {&p->percent.wg, &p->percent.wc};
    for (int t = 0; t < 2; t++)
        while (*percent[t] > 0 && runtime_check(S, p, bls, 0, x, NULL, err) == 0 &&
               x[X_WG + t] > lp_x[X_WG + t] + 1e-9)
            (*percent[t])--;
}

static int by_objective(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (!same_cost(x->objective, y->objective)) return x->objective < y->objective ? -1 : 1;
    return x->gbs * x->ngb - y->gbs * y->ngb;
}

/* GPU batch sizes tried: 1, 2, 4, 8, then steps of a quarter of the largest power of two at or
 * below: 10, 12, 14, 16, 20, ..., 32, 40, ... (from 16 on multiples of 4, as §4.3's are). */
static int next_gbs(int gbs) {
    if (gbs < 8) return 2 * gbs;
    int p = 1;
    while (2 * p <= gbs) p *= 2;
    return gbs + p / 4;
}

enum { MAX_NGB = 32, MAX_GBS = 4096, MAX_SHRINK = 16 };

/* Every shape's LP optimum, into *out (malloc'd); a shape given (a resumed job's) at any size. */
static int enumerate(search *S, candidate **out, int *n_out, char *err) {
    const fg_search_request *r = S->req;
    double max_block = r->max_block > 0 ? r->max_block : INFINITY;
    int cap = 256, n = 0;
    candidate *all = malloc(cap * sizeof *all);
    if (!all) return fg_fail(err, "out of memory");
    for (int gbs = r->gbs ? r->gbs : 1; gbs <= (r->gbs ? r->gbs : MAX_GBS) && gbs <= max_block;
         gbs = next_gbs(gbs)) {
        int any = 0;
        for (int ngb = r->ngb ? r->ngb : 1;
             ngb <= (r->ngb ? r->ngb : MAX_NGB) && (double)gbs * ngb <= max_block; ngb++) {
            int fits = 0;
            /* one group: zig-zag */
            if (ngb == 1 && S->base->schedule == FG_SCHEDULE_DIAGONAL) continue;
            for (int v = 0; v < 2 * FG_W_CASES; v++) {
                candidate cd = {
                    .gbs = gbs, .ngb = ngb, .cpu_cache_compute = v & 1, .weights = v >> 1};
                int rc = solve_shape(S, &cd, err);
                if (rc < 0) {
                    free(all);
                    return -1;
                }
                if (rc == 0) continue;
                fits = 1;
                if (n == cap) {
                    candidate *more = realloc(all, 2 * cap * sizeof *all);
                    if (!more) {
                        free(all);
                        return fg_fail(err, "out of memory");
                    }
                    all = more;
                    cap *= 2;
                }
                all[n++] = cd;
            }
            if (!fits) break; /* memory only grows with ngb */
            any = 1;
        }
        if (!any) break; /* and with gbs */
    }
    *out = all;
    *n_out = n;
    return 0;
}

/* The reason nothing fits: the plan check of the smallest block with everything off the gpu,
 * and where that fits, --max-latency's bound. */
static int explain_nothing_fits(search *S, char *err) {
    fg_policy p = *S->base;
    p.gpu_batch_size = p.num_gpu_batches = 1;
    p.percent = (fg_percent){0};
    char why[FG_ERR_LEN] = "";
    if (S->req->check && runtime_check(S, &p, 1, 1, NULL, NULL, why))
        return fg_fail(err,
                       "no policy fits %s: even one sequence with everything off the gpu tier: %s",
                       S->cfg->name, why);
    if (S->req->max_latency > 0)
        return fg_fail(err,
                       "--max-latency %g: no policy fits the capacities within that block latency",
                       S->req->max_latency);
    return fg_fail(
        err, "no policy fits %s in --gpu-mem, --cpu-mem and --disk-mem (prompt %d + %d tokens)",
        S->cfg->name, S->req->s, S->req->n);
}

/* The capacities the plan must fit: on this machine the runtime's (defaults filled in). */
static int search_init(search *S, const model_config *cfg, const fg_hardware *hw,
                       const fg_policy *base, const fg_search_request *req, char *err) {
    *S = (search){.cfg = cfg, .model = cfg, .stage_cfg = *cfg, .hw = hw, .base = base, .req = req};
    if (base->n_stages > 1) {
        int first, end;
        fg_stage_layers(cfg, base->stage, base->n_stages, &first, &end);
        S->stage_cfg.n_layers =
            (end > cfg->n_layers + 1 ? cfg->n_layers + 1 : end) - (first > 0 ? first : 1);
        S->cfg = &S->stage_cfg;
    }
    if (req->s < 1 || req->n < 1)
        return fg_fail(err, "policy search: prompt and generation lengths must be at least 1");
    if (!req->check) {
        for (int t = 0; t < N_TIERS; t++)
            if (!(base->capacity[t] > 0))
                return fg_fail(
                    err, "planning for another machine (the hardware file is not this one's): "
                         "give --gpu-mem, --cpu-mem and --disk-mem");
        memcpy(S->capacity, base->capacity, sizeof S->capacity);
        return 0;
    }
    fg_stats st = {0};
    int rc = runtime_check(S, base, 0, 0, NULL, &st, err);
    memcpy(S->capacity, st.capacity, sizeof S->capacity);
    S->host_memory = hw->gpu_is_host ? st.host_memory : 0;
    return rc;
}

/* Policy p's prediction at the placement it realizes, into *out; 0 when it does not fit. */
static int evaluate(search *S, const fg_policy *p, fg_search_result *out) {
    double x[N_X];
    if (!plan_fits(S, p, x)) return 0;
    out->policy = *p;
    memcpy(out->x, x, sizeof out->x);
    out->workload = workload_of(S, p->gpu_batch_size, p->num_gpu_batches, p->cpu_cache_compute);
    fg_cost_model_build(S->cfg, &out->workload, S->hw, &out->cost);
    double per_seq =
        fg_cost_per_token(&out->cost, S->cfg, &out->workload, x, &out->t_pre, &out->t_gen);
    out->block_latency = per_seq * p->gpu_batch_size * p->num_gpu_batches;
    out->throughput = S->req->n / per_seq;
    return 1;
}

int fg_policy_evaluate(const model_config *cfg, const fg_hardware *hw, const fg_policy *p,
                       const fg_search_request *req, fg_search_result *out, char *err) {
    search S;
    memset(out, 0, sizeof *out);
    if (search_init(&S, cfg, hw, p, req, err)) return -1;
    if (evaluate(&S, p, out)) return 0;
    if (req->check)
        return runtime_check(&S, p, p->gpu_batch_size * p->num_gpu_batches, 1, NULL, NULL, err);
    static const char *const flags[] = {"--gpu-mem", "--cpu-mem", "--disk-mem", "memory"};
    double x[N_X], need;
    int t = tier_over(&S, p, x, &need);
    if (t < 0) return fg_fail(err, "the policy does not fit"); /* not reached: evaluate() fit it */
    return fg_fail(err, "%s tier: the memory model needs %.2f GiB, %s gives %.2f GiB",
                   t < N_TIERS ? fg_tier_names[t] : "host", need / (1 << 30), flags[t],
                   (t < N_TIERS ? S.capacity[t] : S.host_memory) / (1 << 30));
}

/* Eq. (1) for S's schedule: its best policy into *out (1), none fits (0), or -1 (err). */
static int best_policy(search *S, fg_search_result *out, char *err) {
    const fg_search_request *req = S->req;
    candidate *all = NULL;
    int n = 0;
    if (enumerate(S, &all, &n, err)) return -1;
    qsort(all, (size_t)n, sizeof *all, by_objective);
    double best = INFINITY;
    for (int i = 0; i < n && all[i].objective < best && !same_cost(all[i].objective, best); i++) {
        candidate cd = all[i];
        int shrinks = req->gbs ? 1 : MAX_SHRINK; /* a given block shape stays */
        for (int shrink = 0; shrink < shrinks && cd.gbs >= 1; shrink++, cd.gbs--) {
            int rc = shrink ? solve_shape(S, &cd, err) : 1;
            if (rc < 0) {
                free(all);
                return -1;
            }
            fg_search_result r;
            fg_policy p = policy_of(S, &cd);
            if (rc == 0) continue;
            if (!evaluate(S, &p, &r)) {
                if (!req->check && !req->place) continue;
                snap_weights(S, &p, cd.x);
                if (!evaluate(S, &p, &r)) continue;
            }
            if (req->max_latency > 0 && r.block_latency > req->max_latency) continue;
            double per_seq = r.block_latency / (cd.gbs * cd.ngb);
            if (per_seq < best && !same_cost(per_seq, best)) {
                best = per_seq;
                *out = r;
            }
            break;
        }
    }
    free(all);
    return best < INFINITY;
}
