/* cost_model.c: the cost model of the paper's §4.3 and Appendix A.3, in the paper's symbols.
 *
 *   fg_hardware_read       a machine's constants (Table 7), from a hardware file
 *   fg_cost_model_build    each latency term of a layer, linear in the placement x
 *   fg_cost_per_token      T / bls for a placement: what the policy search minimizes
 *   fg_memory_model_build  each tier's peak bytes, linear in x, in the runtime's accounting
 */
#define _GNU_SOURCE
#include "flexgen.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
 * hw->dequant_bdw bytes of fp16 a second. Beyond A.3, too: the output layer's product per
 * generated token (m->head).
 * ============================================================================================ */

const char *const fg_cost_term_names[N_TERMS] = {"ctog", "gtoc", "dtoc", "ctod", "comp"};

static const char *const HW_KEYS[] = {"ctog_bdw", "gtoc_bdw_cache", "gtoc_bdw_hidden", "dtoc_bdw",
    "ctod_bdw_cache_p", "ctod_bdw_hidden_p", "ctod_bdw_g", "mm_flops_p", "mm_flops_g",
    "bmm_flops_p", "bmm_flops_g", "cpu_flops"};
enum { N_HW = sizeof HW_KEYS / sizeof HW_KEYS[0] };

/* The fields of fg_hardware, in HW_KEYS' order. */
static double *hw_field(fg_hardware *hw, int i) {
    double *const fields[N_HW] = {&hw->ctog_bdw, &hw->gtoc_bdw_cache, &hw->gtoc_bdw_hidden,
        &hw->dtoc_bdw, &hw->ctod_bdw_cache_p, &hw->ctod_bdw_hidden_p, &hw->ctod_bdw_g,
        &hw->mm_flops_p, &hw->mm_flops_g, &hw->bmm_flops_p, &hw->bmm_flops_g, &hw->cpu_flops};
    return fields[i];
}

/* A rate (bytes or FLOPs a second) outside [HW_MIN, HW_MAX] is no machine's: a bound keeps every
 * term bytes / rate of the cost model finite, so the LP gets finite coefficients. */
#define HW_MIN 1.0
#define HW_MAX 1e18

int fg_hardware_read(const char *path, fg_hardware *hw, char *err) {
    char *text = fg_read_file(path, NULL, err);
    if (!text) return -1;
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: not a JSON object", path);
    }
    memset(hw, 0, sizeof *hw);
    int rc = 0;
    for (int i = 0; i < N_HW && rc == 0; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, HW_KEYS[i]);
        if (!cJSON_IsNumber(v)) rc = fg_fail(err, "%s: \"%s\" is missing or not a number", path, HW_KEYS[i]);
        else if (!(v->valuedouble >= HW_MIN && v->valuedouble <= HW_MAX))
            rc = fg_fail(err, "%s: \"%s\" must be a rate in [%g, %g], got %g", path, HW_KEYS[i],
                         HW_MIN, HW_MAX, v->valuedouble);
        else *hw_field(hw, i) = v->valuedouble;
    }
    static const char *const OPTIONAL[] = {"dequant_bdw", "mem_bdw"};
    double *const optional[] = {&hw->dequant_bdw, &hw->mem_bdw};
    for (int i = 0; i < 2 && rc == 0; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, OPTIONAL[i]);
        if (v && (!cJSON_IsNumber(v) ||
                  !(v->valuedouble == 0 || (v->valuedouble >= HW_MIN && v->valuedouble <= HW_MAX))))
            rc = fg_fail(err, "%s: \"%s\" must be 0 or a rate in [%g, %g]", path, OPTIONAL[i],
                         HW_MIN, HW_MAX);
        else if (v) *optional[i] = v->valuedouble;
    }
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(root, "gpu_is_host");
    if (rc == 0 && host && !cJSON_IsBool(host))
        rc = fg_fail(err, "%s: \"gpu_is_host\" must be true or false", path);
    hw->gpu_is_host = cJSON_IsTrue(host);
    cJSON_Delete(root);
    return rc;
}

/* Written through fg_output: a temporary beside path renamed over it, so an interrupted or failed
 * write leaves the previous file as it was. */
int fg_hardware_write(const char *path, const fg_hardware *hw, char *err) {
    cJSON *o = cJSON_CreateObject();
    for (int i = 0; i < N_HW; i++) cJSON_AddNumberToObject(o, HW_KEYS[i], *hw_field((fg_hardware *)hw, i));
    cJSON_AddNumberToObject(o, "dequant_bdw", hw->dequant_bdw);
    cJSON_AddNumberToObject(o, "mem_bdw", hw->mem_bdw);
    cJSON_AddBoolToObject(o, "gpu_is_host", hw->gpu_is_host);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    if (!text) return fg_fail(err, "%s: out of memory", path);
    fg_output out;
    int rc = fg_output_open(&out, "hardware file", path, err);
    if (rc == 0) {
        fprintf(out.f, "%s\n", text);
        rc = fg_output_commit(&out, err);
    }
    free(text);
    return rc;
}

/* Adds bytes / rate to term f: to its constant (k < 0), or to the coefficient of x_k. */
static void add(fg_linear *f, int k, double bytes, double rate) {
    if (k < 0) f->constant += bytes / rate;
    else f->coef[k] += bytes / rate;
}

/* Decode attention over one layer's KV cache (att FLOPs over all of it), by where the cache
 * lives (§4.2, "Computation delegation"): the gpu share (cg) is attended on the compute device;
 * the cpu and disk shares (cc, cn) either on the CPU where they live (delegation: no cache
 * crosses a link) or on the compute device, after cache_gen bytes of them cross cpu -> gpu and
 * before their cache_new new bytes cross back. */
static void decode_attention_terms(fg_linear *g, const fg_workload *w, const fg_hardware *hw,
                                   double att, double cache_gen, double cache_new) {
    add(&g[T_COMP], X_CG, att, hw->bmm_flops_g);
    for (int k = X_CC; k <= X_CN; k++) {
        if (w->cpu_cache_compute) {
            add(&g[T_COMP], k, att, hw->cpu_flops);
        } else { /* the cache comes to the compute device and its new rows go back */
            add(&g[T_CTOG], k, cache_gen, hw->ctog_bdw);
            add(&g[T_GTOC], k, cache_new, hw->gtoc_bdw_cache);
            add(&g[T_COMP], k, att, hw->bmm_flops_g);
        }
    }
}

void fg_cost_model_build(const opt_config *c, const fg_workload *w, const fg_hardware *hw,
                         fg_cost_model *m) {
    double h1 = c->hidden, h2 = c->ffn, s = w->s, n = w->n, bls = (double)w->gbs * w->ngb;
    double weights16 = 8 * h1 * h1 + 4 * h1 * h2;
    double weights = weights16 * (w->compress_weight ? 36.0 / 128 : 1);
    double kv = w->compress_cache ? 36.0 / 128 : 1;       /* cache bytes per fp16 byte */
    double cache_pre = 4 * (s + 1) * h1 * bls * kv;       /* written in prefill (A.3) */
    double cache_gen = 4 * bls * (s + n / 2) * h1 * kv;   /* read per decode step, on average */
    double cache_new = 4 * bls * h1 * kv;                 /* written per decode step */
    double hidden_pre = 2 * s * h1 * bls, hidden_gen = 2 * h1 * bls;
    memset(m, 0, sizeof *m);

    fg_linear *p = m->pre; /* prefill */
    add(&p[T_CTOG], X_WC, weights, hw->ctog_bdw), add(&p[T_CTOG], X_WN, weights, hw->ctog_bdw);
    add(&p[T_CTOG], X_HC, hidden_pre, hw->ctog_bdw), add(&p[T_CTOG], X_HN, hidden_pre, hw->ctog_bdw);
    add(&p[T_GTOC], X_CC, cache_pre, hw->gtoc_bdw_cache), add(&p[T_GTOC], X_CN, cache_pre, hw->gtoc_bdw_cache);
    add(&p[T_GTOC], X_HC, hidden_pre, hw->gtoc_bdw_hidden), add(&p[T_GTOC], X_HN, hidden_pre, hw->gtoc_bdw_hidden);
    add(&p[T_DTOC], X_WN, weights, hw->dtoc_bdw), add(&p[T_DTOC], X_HN, hidden_pre, hw->dtoc_bdw);
    add(&p[T_CTOD], X_CN, cache_pre, hw->ctod_bdw_cache_p), add(&p[T_CTOD], X_HN, hidden_pre, hw->ctod_bdw_hidden_p);
    add(&p[T_COMP], -1, bls * (8 * s * h1 * h1 + 4 * s * h1 * h2), hw->mm_flops_p);
    add(&p[T_COMP], -1, 4 * bls * s * s * h1, hw->bmm_flops_p);

    fg_linear *g = m->gen; /* one decode step */
    add(&g[T_CTOG], X_WC, weights, hw->ctog_bdw), add(&g[T_CTOG], X_WN, weights, hw->ctog_bdw);
    add(&g[T_CTOG], X_HC, hidden_gen, hw->ctog_bdw), add(&g[T_CTOG], X_HN, hidden_gen, hw->ctog_bdw);
    add(&g[T_GTOC], X_HC, hidden_gen, hw->gtoc_bdw_hidden), add(&g[T_GTOC], X_HN, hidden_gen, hw->gtoc_bdw_hidden);
    add(&g[T_DTOC], X_CN, cache_gen, hw->dtoc_bdw), add(&g[T_DTOC], X_WN, weights, hw->dtoc_bdw);
    add(&g[T_DTOC], X_HN, hidden_gen, hw->dtoc_bdw);
    add(&g[T_CTOD], X_CN, cache_new, hw->ctod_bdw_g), add(&g[T_CTOD], X_HN, hidden_gen, hw->ctod_bdw_g);
    add(&g[T_COMP], -1, bls * (8 * h1 * h1 + 4 * h1 * h2), hw->mm_flops_g);
    /* attention: 4 bls (s + n/2) h1 FLOPs over the whole cache (A.3 writes it as its bytes) */
    double att = 4 * bls * (s + n / 2) * h1;
    decode_attention_terms(g, w, hw, att, cache_gen, cache_new);
    /* §5: the compute device decompresses every weight it uses, and the cache it reads (the
     * rows it compresses are counted at the same rate) */
    if (hw->dequant_bdw > 0) {
        if (w->compress_weight) add(&p[T_COMP], -1, weights16, hw->dequant_bdw), add(&g[T_COMP], -1, weights16, hw->dequant_bdw);
        if (w->compress_cache) add(&p[T_COMP], -1, cache_pre / kv, hw->dequant_bdw), add(&g[T_COMP], -1, cache_gen / kv, hw->dequant_bdw);
    }
    /* beyond A.3: each GPU batch reads the layer's working weights: fp16, or on the CPU backend
     * the 4-bit bytes its products read as they are */
    if (hw->mem_bdw > 0) {
        double working = (8 * h1 * h1 + 4 * h1 * h2) * (w->compress_weight && hw->gpu_is_host ? 36.0 / 128 : 1);
        add(&p[T_COMP], -1, w->ngb * working, hw->mem_bdw), add(&g[T_COMP], -1, w->ngb * working, hw->mem_bdw);
    }
    /* the output layer, once per generated token: logits of the block's last tokens */
    m->head = 2 * bls * c->vocab * (double)c->word_dim / hw->mm_flops_g;
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

double fg_cost_per_token(const fg_cost_model *m, const opt_config *c, const fg_workload *w,
                         const double x[N_X], double *t_pre, double *t_gen) {
    double pre = max_term(m->pre, x), gen = max_term(m->gen, x), l = c->n_layers;
    if (t_pre) *t_pre = pre;
    if (t_gen) *t_gen = gen;
    return (pre * l + gen * (w->n - 1) * l + m->head * w->n) / ((double)w->gbs * w->ngb);
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

int fg_weights_case(const double x[N_X], int staged_q4) {
    if (x[X_WN] > 0) return FG_W_DISK;
    return x[X_WG] < 1 || staged_q4 ? FG_W_MEMORY : FG_W_GPU;
}

void fg_memory_model_build(const opt_config *c, const fg_workload *w, const fg_hardware *hw,
                           int weights, fg_memory_model *mm) {
    double h = c->hidden, f = c->ffn, s = w->s, len = w->s + w->n;
    double gbs = w->gbs, bls = (double)w->gbs * w->ngb, P = (double)opt_param_count(c);
    double q4 = w->compress_weight ? 36.0 / 128 : 1;
    double stored = 2 * P * q4;                                 /* cpu and disk homes */
    double on_gpu = w->compress_weight ? stored : 2 * P;
    double layer = fmax(4 * h * h + 2 * h * f + 10 * h + f,     /* a decoder layer, or */
                        (double)c->vocab * c->word_dim + (c->max_pos + 2) * h); /* the embeddings */
    double kv_row = (double)opt_kv_row_bytes(c, w->compress_cache);
    double act_row = h * (double)(hw->gpu_is_host ? fg_cpu_backend.act_elem : FG_CUDA_ACT_ELEM);
    double micro = w->micro > 1 ? w->micro : 1; /* each micro-batch of a stage has its own */
    double cache = 2 * kv_row * c->n_layers * bls * len * micro, act = act_row * bls * s * micro;
    double stage_len = w->cpu_cache_compute ? s : len;
    memset(mm, 0, sizeof *mm);
    fg_linear *gpu = &mm->tier[TIER_GPU], *cpu = &mm->tier[TIER_CPU];
    const double homes[3] = {on_gpu, stored, stored};
    for (int t = 0; t < N_TIERS; t++) {
        add_bytes(&mm->tier[t], X_WG + t, homes[t]);
        add_bytes(&mm->tier[t], X_CG + t, cache);
        add_bytes(&mm->tier[t], X_HG + t, act);
    }
    if (weights != FG_W_GPU) add_bytes(gpu, -1, 2 * 2 * layer);
    if (weights != FG_W_GPU && w->compress_weight && !hw->gpu_is_host) /* a 4-bit tensor lands */
        add_bytes(gpu, -1, 2 * 2 * q4 * fmax(h * f, (double)c->vocab * c->word_dim));
    add_bytes(gpu, X_CC, 4 * kv_row * gbs * stage_len), add_bytes(gpu, X_CN, 4 * kv_row * gbs * stage_len);
    add_bytes(gpu, -1, 2 * act_row * gbs * s);                   /* activation staging */
    size_t (*workspace)(const opt_config *, size_t, int) = hw->gpu_is_host ? opt_workspace_bytes : fg_cuda_workspace_bytes;
    add_bytes(gpu, -1, (double)workspace(c, fg_workspace_rows(w->gbs, w->s), (int)len));
    add_bytes(gpu, -1, 4 * bls * c->vocab);                      /* logits */
    if (!hw->gpu_is_host) {
        add_bytes(gpu, -1, FG_CUDA_RESERVE);                     /* context, cuBLAS, rounding */
        if (w->cpu_cache_compute) add_bytes(cpu, -1, (double)fg_cuda_delegated_bytes(c, (size_t)w->gbs, (int)len));
    }
    if (weights == FG_W_DISK) add_bytes(cpu, -1, 2 * 2 * layer * q4); /* two layers read ahead */
    add_bytes(cpu, X_CN, 2 * 2 * kv_row * gbs * len), add_bytes(cpu, X_HN, 2 * act_row * gbs * s);
    add_bytes(cpu, -1, 4 * 4096.0);
    if (hw->gpu_is_host)
        for (int t = TIER_GPU; t <= TIER_CPU; t++) {
            mm->host.constant += mm->tier[t].constant;
            for (int k = 0; k < N_X; k++) mm->host.coef[k] += mm->tier[t].coef[k];
        }
}
