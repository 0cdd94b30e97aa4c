/* opt_model.c: the OPT model's forward pass on the CPU (paper §3, "Background: LLM Inference"),
 * the computation that every block of FlexGen's schedule (flexgen.c) runs.
 *
 *   reference products  matmul_reference and embed_t_reference: a weight matrix stored as
 *                       FlexGen keeps it (fp16, or §5's 4-bit groups) times the activations, as
 *                       plain loops; the fast kernels (support/matmul.c) compute the same, and
 *                       tests/test_matmul.c holds them to these
 *   forward             opt_embed, opt_layer (layer norm, q k v, attention over the KV cache, out
 *                       projection, the MLP), opt_output: one GPU batch at a time
 *
 * The forward pass is the generative inference of §3: a prefill over the (left-padded) prompts
 * that fills the KV cache, then decode steps of one token per sequence that read it. Every
 * function below works on one GPU batch, so the schedule can walk the loop of Fig. 4 (token i,
 * layer j, GPU batch k) and call them in any order it needs. Read opt_layer first; the map
 * (scripts/check_layout.sh holds each line to the function's definition):
 *
 *   369  opt_layer                one decoder layer of a GPU batch, the steps in §3's order
 *    98  layer_norm               its layer norms
 *   164  store_kv                 this step's K and V into the cache (fp16, or 4-bit §5)
 *   310  attention                over the cache: prefill's two products, decode's dots, top-K
 *   123  opt_embed                token and position embeddings of a GPU batch
 *   408  opt_output               the logits of each sequence's last token
 *    50  matmul_reference         the products as plain loops, which the fast kernels are held to
 *
 * Weights are stored as FlexGen stores them: fp16 (or 4-bit, §5), linear layers transposed to
 * [in][out] so that every product is x[rows][in] times W[in][out]. Compute is fp32.
 */
#include "model.h"
#include "support/support.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ============================================================================================
 * Reference products
 * ============================================================================================ */

/* Row k of a linear weight [in][out] as fp32: fp16, or 4-bit in q4 parts grouped along out. */
static void weight_row(const void *W, int q4, int out, int k, float *row) {
    if (q4) q4_decompress((const uint8_t *)W + k * q4_bytes(q4, out / q4, 1), q4, out / q4, 1, row);
    else
        for (int i = 0; i < out; i++) row[i] = fp16_to_fp32(((const fp16 *)W)[(size_t)k * out + i]);
}

/* y[rows][out] (= or +=) x[rows][in] W[in][out]: each y summed over k in order. */
void matmul_reference(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                      float *y, int accumulate) {
    float *row = malloc((size_t)out * sizeof *row);
    if (!accumulate) memset(y, 0, (size_t)rows * out * sizeof *y);
    for (int k = 0; row && k < in; k++) {
        weight_row(W, q4_parts, out, k, row);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < out; i++) y[(size_t)r * out + i] += x[(size_t)r * in + k] * row[i];
    }
    free(row);
}

/* y[rows][n] = x[rows][dim] E^T for an embedding table E [n][dim]: fp16, or 4-bit [1][n][dim]
 * (the output layer: logits from the token embeddings). */
void embed_t_reference(const float *x, int rows, int dim, const void *E, int q4_parts, int n,
                       float *y) {
    float *e = malloc((size_t)dim * sizeof *e);
    for (int t = 0; e && t < n; t++) {
        if (q4_parts) q4_decompress_row(E, (size_t)n, (size_t)dim, (size_t)t, e);
        else
            for (int d = 0; d < dim; d++)
                e[d] = fp16_to_fp32(((const fp16 *)E)[(size_t)t * dim + d]);
        for (int r = 0; r < rows; r++) {
            float dot = 0;
            for (int d = 0; d < dim; d++) dot += x[(size_t)r * dim + d] * e[d];
            y[(size_t)r * n + t] = dot;
        }
    }
    free(e);
}

/* ============================================================================================
 * The forward pass of one GPU batch (§3)
 * ============================================================================================ */

/* x[rows][in] times W[in][out] (weights are stored transposed, fp16 or 4-bit: support/matmul.c),
 * then the bias (widened once into ws->vec), and ReLU: matmul_weights' epilogue, in one pass over
 * y (in the int8 prefill product's finish, where that runs). The opt-in schemes take every
 * prompt (ws->prefill) in prefill's, however short: a prompt's numbers do not hang on its batch. */
void linear_layer(const float *x, int rows, int in, const fp16 *W, const fp16 *b, int out, float *y,
                  int mode, int q4, int products, model_workspace *ws) {
    matmul_epilogue after = {ws->vec, mode == OUT_RELU};
    if (b) fp16_to_fp32_n(b, ws->vec, (size_t)out);
    matmul_weights(x, rows, in, W, q4, out, y, mode == OUT_ADD, products, ws->prefill, ws->wide,
                   b ? &after : NULL, ws->int8_columns);
}

/* y = (x - mean) / sqrt(var + 1e-5) * w + b, row by row; y may alias x. */
static void layer_norm(const float *x, int rows, int dim, const fp16 *w16, const fp16 *b16,
                       float *y, model_workspace *ws) {
    float *w = ws->vec, *b = ws->vec + dim; /* widened once */
    fp16_to_fp32_n(w16, w, (size_t)dim);
    fp16_to_fp32_n(b16, b, (size_t)dim);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        float mean = 0, var = 0;
        for (int i = 0; i < dim; i++) mean += xr[i];
        mean /= dim;
        for (int i = 0; i < dim; i++) var += (xr[i] - mean) * (xr[i] - mean);
        float inv = 1.0f / sqrtf(var / dim + 1e-5f);
        for (int i = 0; i < dim; i++) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
    }
}

/* The position id of token row r of the GPU batch (model.h's position_of). */
static int row_position(const gpu_batch *gb, int r) {
    int b = r / gb->n_new;
    return position_of(gb->past[b], gb->pad[b], r % gb->n_new);
}

/* x = embed_tokens[token] (through project_in for 350m) + embed_positions[position]. */
void opt_embed(const model_weights *w, gpu_batch *gb, model_workspace *ws) {
    const model_config *c = &w->cfg;
    int rows = gb->batch * gb->n_new, wd = c->word_dim, h = c->hidden;
    float *x = gb->x, *words = w->project_in ? ws->h : x;
    ws->prefill = gb->n_new > 1;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        matmul_embed_row(w->embed_tokens, w->q4, c->vocab, wd, gb->tokens[r],
                         words + (size_t)r * wd);
    if (w->project_in)
        linear_layer(ws->h, rows, wd, w->project_in, NULL, h, x, OUT_SET, w->q4, w->products, ws);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *pos = ws->attn + (size_t)r * h, *xr = x + (size_t)r * h;
        matmul_embed_row(w->embed_positions, w->q4, c->max_pos + 2, h, row_position(gb, r), pos);
        for (int i = 0; i < h; i++) xr[i] += pos[i];
    }
}

/* Bytes of one token's K (or V) in the cache of one layer: fp16, or 4-bit (§5). */
size_t opt_kv_row_bytes(const model_config *c, int q4) {
    return q4 ? q4_bytes((size_t)cfg_kv_heads(c), (size_t)cfg_head_dim(c), 1)
              : 2 * (size_t)kv_width(c);
}

/* Rounds x to fp16 values (what an fp16 cache would hold), in place. */
static void round_to_fp16(float *x, size_t n) {
    fp16 tmp[256];
    for (size_t i = 0; i < n; i += 256) {
        size_t m = n - i < 256 ? n - i : 256;
        fp32_to_fp16_n(x + i, tmp, m);
        fp16_to_fp32_n(tmp, x + i, m);
    }
}

/* This step's K and V (its rows that are not padding) into the cache at slots past[b] on, through
 * each sequence's page table: fp16,
 * or 4-bit grouped along each head's dimension (§5).
 * With a 4-bit cache the step's own K and V stay in qkv, rounded to fp16: as in FlexGen, the
 * tokens being computed attend with their fp16 K and V, and only the past is read back from
 * the compressed cache. */
static void store_kv(const model_config *c, gpu_batch *gb, model_workspace *ws) {
    size_t kw = (size_t)kv_width(c), heads = (size_t)cfg_kv_heads(c), hd = (size_t)cfg_head_dim(c);
    size_t row = opt_kv_row_bytes(c, gb->kv_q4);
    qkv_layout at = qkv_layout_of(c, (size_t)gb->batch * gb->n_new);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < gb->batch * gb->n_new; r++) {
        int b = r / gb->n_new, slot = gb->past[b] + r % gb->n_new - gb->pad[b];
        if (slot < gb->past[b]) continue; /* padding */
        float *k_new = ws->qkv + at.at[1] + (size_t)r * at.stride[1];
        float *v_new = ws->qkv + at.at[2] + (size_t)r * at.stride[2];
        char *k = (char *)gb->k[b] + kv_page_row(gb->k_pages[b], gb->page_tokens, slot) * row;
        char *v = (char *)gb->v[b] + kv_page_row(gb->v_pages[b], gb->page_tokens, slot) * row;
        if (!gb->kv_q4) {
            fp32_to_fp16_n(k_new, (fp16 *)k, kw);
            fp32_to_fp16_n(v_new, (fp16 *)v, kw);
            continue;
        }
        round_to_fp16(k_new, kw);
        round_to_fp16(v_new, kw);
        q4_compress(k_new, heads, hd, 1, (uint8_t *)k);
        q4_compress(v_new, heads, hd, 1, (uint8_t *)v);
    }
}

/* softmax over scores[0..n), in place. */
static void softmax(float *s, int n) {
    float m = s[0], sum = 0;
    for (int i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
    for (int i = 0; i < n; i++) sum += s[i] = expf(s[i] - m);
    for (int i = 0; i < n; i++) s[i] /= sum;
}

/* q . k over hd values, k fp16, summed as support/simd.c's dot_f16_rows sums them: 8 lanes (lane l
 * takes d = l mod 8) of fused multiply-adds in order, the lanes then added pairwise as AVX2's
 * halving reduction adds them. So where hd is a multiple of 8 this loop and the AVX2 twin give the
 * same bits, and a job's logits do not depend on which of the two the CPU runs. */
static float dot8_fma(const float *q, const fp16 *k, int hd) {
    float lane[8] = {0};
    for (int d = 0; d < hd; d++) lane[d % 8] = fmaf(q[d], fp16_to_fp32(k[d]), lane[d % 8]);
    float even_lanes = (lane[0] + lane[4]) + (lane[2] + lane[6]);
    float odd_lanes = (lane[1] + lane[5]) + (lane[3] + lane[7]);
    return even_lanes + odd_lanes;
}

/* One query over nk cached keys (fp16): out = softmax(scale q.K^T) V. Decode attention is pure
 * memory traffic over the cache, so it reads fp16 directly, a run of rows at a time, asking for
 * the next run's as it goes (kv_head_run says why); where the CPU has AVX2, support/simd.c's
 * twins run the two loops with the same arithmetic (dot8_fma's lanes, and one fmaf per value of
 * out), so every path gives the same bits. */
static void attend_one(const float *q, const opt_kv_rows *K, const opt_kv_rows *V, int nk,
                       float scale, float *scores, float *out) {
    const fg_simd *simd = fg_simd_kernels();
    int hd = K->head_dim, n, fast = hd % 8 == 0 && simd->dot_f16_rows;
    size_t stride = K->stride / sizeof(fp16);
    for (int j = 0; j < nk; j += n) {
        int n_ahead;
        const fp16 *k = kv_head_run(K, j, nk, &n), *ahead = kv_head_run(K, j + n, nk, &n_ahead);
        if (fast) simd->dot_f16_rows(q, k, stride, n, hd, scale, scores + j, ahead, n_ahead);
        for (int i = 0; i < n && !fast; i++) {
            fg_prefetch_ahead(ahead, n_ahead, i, stride, hd);
            scores[j + i] = dot8_fma(q, k + i * stride, hd) * scale;
        }
    }
    softmax(scores, nk);
    memset(out, 0, hd * sizeof *out);
    for (int j = 0; j < nk; j += n) {
        int n_ahead;
        const fp16 *v = kv_head_run(V, j, nk, &n), *ahead = kv_head_run(V, j + n, nk, &n_ahead);
        if (fast) simd->axpy_f16_rows(scores + j, v, stride, n, hd, out, ahead, n_ahead);
        for (int i = 0; i < n && !fast; i++) {
            fg_prefetch_ahead(ahead, n_ahead, i, stride, hd);
            for (int d = 0; d < hd; d++)
                out[d] = fmaf(scores[j + i], fp16_to_fp32(v[i * stride + d]), out[d]);
        }
    }
}

/* Key (or value) j of one head as fp32: this step's own row from qkv, or a cache row decoded. */
static const float *kv_row(const opt_kv_rows *r, int j, float *buf) {
    if (j >= r->first_fresh) return r->fresh + (size_t)(j - r->first_fresh) * r->fresh_stride;
    const char *row = r->rows + kv_page_row(r->pages, r->page_tokens, j) * r->stride;
    if (r->q4) {
        size_t head_bytes = q4_bytes(1, (size_t)r->head_dim, 1);
        q4_decompress((const uint8_t *)row + r->head * head_bytes, 1, (size_t)r->head_dim, 1, buf);
    } else {
        fp16_to_fp32_n((const fp16 *)row + (size_t)r->head * r->head_dim, buf, (size_t)r->head_dim);
    }
    return buf;
}

int opt_attend_decode(const float *q, const opt_kv_rows *K, const opt_kv_rows *V, int nk,
                      float scale, float sparsity, float *scratch, float *out) {
    int hd = K->head_dim;
    float *scores = scratch, *spare = scores + nk, *buf = spare + nk;
    int *keep = (int *)(buf + hd);
    for (int j = 0; j < nk; j++) {
        const float *k = kv_row(K, j, buf);
        float dot = 0;
        for (int d = 0; d < hd; d++) dot += q[d] * k[d];
        scores[j] = dot * scale;
    }
    softmax(scores, nk);
    int n_keep = nk;
    if (sparsity < 1) {
        n_keep = topk_keep(scores, nk - 1, (int)floorf(sparsity * (float)(nk - 1)), keep, spare);
        keep[n_keep++] = nk - 1; /* the new token always attends to itself */
    }
    memset(out, 0, hd * sizeof *out);
    for (int i = 0; i < n_keep; i++) {
        int j = sparsity < 1 ? keep[i] : i;
        const float *v = kv_row(V, j, buf);
        for (int d = 0; d < hd; d++) out[d] += scores[j] * v[d];
    }
    return n_keep;
}

/* One K and V head of sequence b's keys (kv 0) or values (kv 1): its rows in the cache, and with
 * a 4-bit cache this step's own rows from qkv. */
static opt_kv_rows head_rows(const model_config *c, const gpu_batch *gb, const model_workspace *ws,
                             int b, int kv_head, int kv) {
    int hd = cfg_head_dim(c);
    size_t row = opt_kv_row_bytes(c, gb->kv_q4), first = (size_t)b * gb->n_new + gb->pad[b];
    qkv_layout at = qkv_layout_of(c, (size_t)gb->batch * gb->n_new);
    opt_kv_rows r = {kv ? gb->v[b] : gb->k[b],
                     kv ? gb->v_pages[b] : gb->k_pages[b],
                     gb->page_tokens,
                     row,
                     gb->kv_q4,
                     kv_head,
                     hd,
                     INT_MAX,
                     NULL,
                     0};
    if (gb->kv_q4) {
        r.first_fresh = gb->past[b];
        r.fresh = ws->qkv + at.at[kv + 1] + first * at.stride[kv + 1] + (size_t)kv_head * hd;
        r.fresh_stride = at.stride[kv + 1];
    }
    return r;
}

/* Multi-head attention of this step's queries over the cache (fp16 or 4-bit), causal: the
 * query of sequence b at cache slot s sees its keys [0, s]; padding rows get zeros. A sequence's
 * one query after its prompt is decode, with gb->attn_sparsity < 1 §5's top-K sparse attention.
 * Grouped-query attention (LLaMA): n_heads / n_kv_heads query heads in a row share a K and V head.
 */
static void attention(const model_config *c, gpu_batch *gb, model_workspace *ws) {
    int hd = cfg_head_dim(c), qw = q_width(c), group = c->n_heads / cfg_kv_heads(c);
    int n_new = gb->n_new;
    float scale = 1.0f / sqrtf((float)hd);
    int fast = !gb->kv_q4 && gb->attn_sparsity >= 1; /* decode straight from the fp16 cache */
    qkv_layout at = qkv_layout_of(c, (size_t)gb->batch * n_new);
#pragma omp parallel for schedule(dynamic)
    for (int bh = 0; bh < gb->batch * c->n_heads; bh++) {
        int b = bh / c->n_heads, head = bh % c->n_heads, t0 = gb->pad[b], past = gb->past[b];
        int nq = n_new - t0, nk = past + nq; /* its queries (rows t0 on) and the keys they see */
        float *kf = ws->thread_scratch + ws->thread_floats * omp_get_thread_num();
        float *vf = kf + (size_t)ws->max_len * hd, *scores = vf + (size_t)ws->max_len * hd;
        float *out = ws->attn + (size_t)b * n_new * qw + head * hd;
        for (int t = 0; t < t0 && t < n_new; t++)
            memset(out + (size_t)t * qw, 0, hd * sizeof(float));
        if (nq <= 0) continue;
        out += (size_t)t0 * qw;
        const float *q = ws->qkv + at.at[0] + ((size_t)b * n_new + t0) * at.stride[0] + head * hd;
        opt_kv_rows K = head_rows(c, gb, ws, b, head / group, 0);
        opt_kv_rows V = head_rows(c, gb, ws, b, head / group, 1);
        if (nq == 1 && past > 0 && fast) {
            attend_one(q, &K, &V, nk, scale, scores, out);
            continue;
        }
        if (nq == 1 && past > 0) {
            int read = opt_attend_decode(q, &K, &V, nk, scale, gb->attn_sparsity, scores, out);
#pragma omp atomic
            gb->v_rows_read[b] += read;
            continue;
        }
        /* a prompt: many queries, so convert the slice once and use two matrix products */
        for (int j = 0; j < nk; j++) {
            const float *k = kv_row(&K, j, kf + (size_t)j * hd);
            const float *v = kv_row(&V, j, vf + (size_t)j * hd);
            if (k != kf + (size_t)j * hd) memcpy(kf + (size_t)j * hd, k, hd * sizeof *k);
            if (v != vf + (size_t)j * hd) memcpy(vf + (size_t)j * hd, v, hd * sizeof *v);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, hd, scale, q,
                    (int)at.stride[0], kf, hd, 0.0f, scores, nk);
        for (int t = 0; t < nq; t++) {
            int visible = past + t + 1; /* causal: keys up to this query's slot */
            float *row = scores + (size_t)t * nk;
            softmax(row, visible);
            for (int j = visible; j < nk; j++) row[j] = 0;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, hd, nk, 1.0f, scores, nk, vf, hd,
                    0.0f, out, qw);
    }
}

void opt_cache_attention(const model_config *c, gpu_batch *gb, model_workspace *ws) {
    store_kv(c, gb, ws);
    attention(c, gb, ws);
}

/* One decoder layer for one GPU batch (HF's OPTDecoderLayer):
 *   pre-LN:  x += out_proj(attn(LN(x)));  x += fc2(relu(fc1(LN(x))))
 *   post-LN: x = LN(x + out_proj(attn(x))); x = LN(x + fc2(relu(fc1(x))))   (opt-350m)
 * K and V are rounded to fp16 into the cache before attention reads them. */
void opt_layer(const model_weights *w, int layer, gpu_batch *gb, model_workspace *ws) {
    const model_config *c = &w->cfg;
    const layer_weights *L = &w->layers[layer];
    int rows = gb->batch * gb->n_new, h = c->hidden, f = c->ffn;
    float *x = gb->x;
    const float *in = x;
    ws->prefill = gb->n_new > 1;
    if (c->pre_ln) {
        layer_norm(x, rows, h, L->attn_ln_w, L->attn_ln_b, ws->h, ws);
        in = ws->h;
    }
    /* q|k|v in one product of 3 parts */
    linear_layer(in, rows, h, L->wqkv, L->bqkv, 3 * h, ws->qkv, OUT_SET, 3 * w->q4, w->products,
                 ws);
    opt_cache_attention(c, gb, ws);
    linear_layer(ws->attn, rows, h, L->wo, L->bo, h, x, OUT_ADD, w->q4, w->products, ws);
    if (c->pre_ln) {
        layer_norm(x, rows, h, L->ffn_ln_w, L->ffn_ln_b, ws->h, ws);
    } else {
        layer_norm(x, rows, h, L->attn_ln_w, L->attn_ln_b, x, ws);
    }
    linear_layer(c->pre_ln ? ws->h : x, rows, h, L->fc1_w, L->fc1_b, f, ws->ffn, OUT_RELU, w->q4,
                 w->products, ws);
    linear_layer(ws->ffn, rows, f, L->fc2_w, L->fc2_b, h, x, OUT_ADD, w->q4, w->products, ws);
    if (!c->pre_ln) layer_norm(x, rows, h, L->ffn_ln_w, L->ffn_ln_b, x, ws);
}

/* Each sequence's last row of x (every row, with all_rows) into dst; returns how many. */
int output_rows(const gpu_batch *gb, int hidden, float *dst) {
    int rows = gb->all_rows ? gb->batch * gb->n_new : gb->batch;
    for (int r = 0; r < rows; r++) {
        size_t from = gb->all_rows ? (size_t)r : (size_t)r * gb->n_new + gb->n_new - 1;
        memcpy(dst + (size_t)r * hidden, (const float *)gb->x + from * hidden,
               hidden * sizeof(float));
    }
    return rows;
}

/* logits[b] = lm_head(project_out(final_LN(x of b's last token))); all_rows: every row's. */
void opt_output(const model_weights *w, gpu_batch *gb, model_workspace *ws, float *logits) {
    const model_config *c = &w->cfg;
    int h = c->hidden, rows = output_rows(gb, h, ws->h);
    if (w->final_ln_w) layer_norm(ws->h, rows, h, w->final_ln_w, w->final_ln_b, ws->h, ws);
    const float *last = ws->h;
    if (w->project_out) {
        linear_layer(ws->h, rows, h, w->project_out, NULL, c->word_dim, ws->qkv, OUT_SET, w->q4,
                     w->products, ws);
        last = ws->qkv;
    }
    /* lm_head is the embedding table itself, [vocab][word_dim]: a product with its transpose */
    matmul_embed_t(last, rows, c->word_dim, w->lm_head, w->q4, c->vocab, logits, ws->thread_scratch,
                   ws->thread_floats);
}
