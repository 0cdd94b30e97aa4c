/* llama_model.c: the LLaMA family's forward pass on the CPU (LLaMA 1 to 3, TinyLlama, SmolLM2,
 * Mistral, Qwen2): the computation of §3 for these models, called by the same schedule
 * (flexgen.c) through the same operation table as OPT's (opt_model.c), one GPU batch at a time.
 *
 *   embed    x = embed_tokens[token]                                    (no position table)
 *   layer    y = RMSNorm(x);  q, k, v = y Wq, y Wk, y Wv;  q, k = RoPE(q), RoPE(k) at each
 *            token's position;  x += attention(q, K cache, V cache) Wo;
 *            y = RMSNorm(x);  x += (silu(y Wgate) * (y Wup)) Wdown       (SwiGLU)
 *   output   logits = RMSNorm(x of the last token) lm_head^T
 *
 * What the families share is written once, in opt_model.c: the products (linear_layer: fast kernels
 * or 4-bit §5), and attention over the paged KV cache with §5's 4-bit cache and top-K sparsity
 * (opt_cache_attention). Grouped-query attention lives there too: n_heads / n_kv_heads query
 * heads share one K and V head, so the cache is n_kv_heads wide. Compute is fp32, weights fp16.
 * docs/DESIGN.md has the two families side by side, step by step. The map
 * (scripts/check_layout.sh holds each line to the function's definition):
 *
 *   123  llama_layer              one decoder layer of a GPU batch, as above
 *    42  rms_norm                 its RMSNorm
 *    91  rope                     q and k rotated at each token's position
 *    31  llama_embed              the token embeddings
 *   150  llama_output             the logits of each sequence's last token
 */
#include "model.h"
#include "support/support.h"

#include <math.h>
#include <string.h>

/* x = embed_tokens[token], row by row. */
void llama_embed(const model_weights *w, gpu_batch *gb, model_workspace *ws) {
    (void)ws;
    const model_config *c = &w->cfg;
    int rows = gb->batch * gb->n_new, h = c->hidden;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        matmul_embed_row(w->embed_tokens, w->q4, c->vocab, h, gb->tokens[r],
                         (float *)gb->x + (size_t)r * h);
}

/* RMSNorm (HF's LlamaRMSNorm): y = x / sqrt(mean(x^2) + eps) * w, row by row; y may alias x. */
static void rms_norm(const float *x, int rows, int dim, const fp16 *w16, float eps, float *y,
                     model_workspace *ws) {
    float *w = ws->vec; /* widened once */
    fp16_to_fp32_n(w16, w, (size_t)dim);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim, squares = 0;
        for (int i = 0; i < dim; i++) squares += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(squares / dim + eps);
        for (int i = 0; i < dim; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* RoPE's inverse frequencies, as HF computes them in fp32: theta^(-2i/d), then rope_scaling's
 * change: all divided by factor (linear), or LLaMA 3.1's bands (llama3): wavelengths longer than
 * original / low_freq_factor slowed by factor, shorter than original / high_freq_factor kept,
 * and those between blended. */
void rope_frequencies(const model_config *c, float *inv_freq) {
    int d = cfg_head_dim(c);
    for (int i = 0; i < d / 2; i++) {
        float f = 1.0f / powf(c->rope.theta, (float)(2 * i) / (float)d);
        if (c->rope.kind == ROPE_LINEAR) f /= c->rope.factor;
        if (c->rope.kind == ROPE_LLAMA3) {
            float old = (float)c->rope.original_max_pos, wavelen = 2 * 3.14159265358979f / f;
            float low = old / c->rope.low_freq, high = old / c->rope.high_freq;
            float slow = wavelen > low ? f / c->rope.factor : f;
            float smooth =
                (old / wavelen - c->rope.low_freq) / (c->rope.high_freq - c->rope.low_freq);
            f = wavelen < high || wavelen > low
                    ? slow
                    : (1 - smooth) * slow / c->rope.factor + smooth * slow;
        }
        inv_freq[i] = f;
    }
}

/* One head's pairs turned by the row's angles: HF's rotate_half layout. */
static void rotate(float *v, int half, const float *cosines, const float *sines) {
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cosines[i] - b * sines[i];
        v[i + half] = b * cosines[i] + a * sines[i];
    }
}

/* RoPE in HF's layout (rotate_half: pair i is dimensions i and i + d/2 of a head, not 2i and
 * 2i + 1) on every head of q and k, each row at its position (its cache slot): the angles once
 * a row for both. */
static void rope(const model_config *c, const gpu_batch *gb, float *q, float *k,
                 const qkv_layout *at) {
    int d = cfg_head_dim(c), half = d / 2;
    float inv_freq[512]; /* head_dim <= 1024 (llama_fields) */
    rope_frequencies(c, inv_freq);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < gb->batch * gb->n_new; r++) {
        float angle_cos[512];
        float angle_sin[512];
        float pos = (float)slot_of(gb, r / gb->n_new, r % gb->n_new);
        for (int i = 0; i < half; i++) {
            float angle = pos * inv_freq[i];
            angle_cos[i] = cosf(angle);
            angle_sin[i] = sinf(angle);
        }
        for (int head = 0; head < c->n_heads; head++)
            rotate(q + (size_t)r * at->stride[0] + (size_t)head * d, half, angle_cos, angle_sin);
        for (int head = 0; head < cfg_kv_heads(c); head++)
            rotate(k + (size_t)r * at->stride[1] + (size_t)head * d, half, angle_cos, angle_sin);
    }
}

/* gate = silu(gate) * up, SwiGLU's product of the MLP's two halves. */
static void swiglu(float *gate, const float *up, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* One decoder layer for one GPU batch (HF's LlamaDecoderLayer, pre-norm):
 *   x += o_proj(attention(RoPE(q_proj(y)), RoPE(k_proj(y)), v_proj(y))),  y = RMSNorm(x)
 *   x += down_proj(silu(gate_proj(y)) * up_proj(y)),                       y = RMSNorm(x)
 * K and V are rounded to fp16 into the cache (after RoPE, as HF caches them) before attention. */
void llama_layer(const model_weights *w, int layer, gpu_batch *gb, model_workspace *ws) {
    const model_config *c = &w->cfg;
    const layer_weights *L = &w->layers[layer];
    int rows = gb->batch * gb->n_new, h = c->hidden, f = c->ffn, qw = q_width(c), kw = kv_width(c);
    int q4 = w->q4, products = w->products;
    float *x = gb->x, *gate = ws->ffn, *up = ws->ffn + (size_t)rows * f;
    ws->prefill = gb->n_new > 1; /* a prompt takes prefill's scheme (opt_model.c) */
    qkv_layout at = qkv_layout_of(c, (size_t)rows);
    float *q = ws->qkv + at.at[0], *k = ws->qkv + at.at[1], *v = ws->qkv + at.at[2];
    /* input_layernorm; the q, k and v projections */
    rms_norm(x, rows, h, L->attn_ln_w, c->rms_eps, ws->h, ws);
    linear_layer(ws->h, rows, h, L->wq, L->bq, qw, q, OUT_SET, q4, products, ws);
    linear_layer(ws->h, rows, h, L->wk, L->bk, kw, k, OUT_SET, q4, products, ws);
    linear_layer(ws->h, rows, h, L->wv, L->bv, kw, v, OUT_SET, q4, products, ws);
    rope(c, gb, q, k, &at);         /* positions into q, k */
    opt_cache_attention(c, gb, ws); /* K, V cached; attention */
    /* o_proj, the residual; post_attention_layernorm */
    linear_layer(ws->attn, rows, qw, L->wo, L->bo, h, x, OUT_ADD, q4, products, ws);
    rms_norm(x, rows, h, L->ffn_ln_w, c->rms_eps, ws->h, ws);
    /* the SwiGLU MLP: gate and up, silu(gate) up, down_proj and the residual */
    linear_layer(ws->h, rows, h, L->gate_w, L->gate_b, f, gate, OUT_SET, q4, products, ws);
    linear_layer(ws->h, rows, h, L->up_w, L->up_b, f, up, OUT_SET, q4, products, ws);
    swiglu(gate, up, (size_t)rows * f);
    linear_layer(gate, rows, f, L->down_w, L->down_b, h, x, OUT_ADD, q4, products, ws);
}

/* logits[b] = lm_head(RMSNorm(x of b's last token)); with all_rows, the same for every row of x. */
void llama_output(const model_weights *w, gpu_batch *gb, model_workspace *ws, float *logits) {
    const model_config *c = &w->cfg;
    int h = c->hidden, rows = output_rows(gb, h, ws->h);
    rms_norm(ws->h, rows, h, w->final_ln_w, c->rms_eps, ws->h, ws);
    matmul_embed_t(ws->h, rows, h, w->lm_head, w->q4, c->vocab, logits, ws->thread_scratch,
                   ws->thread_floats);
}
