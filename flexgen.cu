/* flexgen.cu: the CUDA backend (paper §4.1, §5, §6; docs/DESIGN.md, "The backends' operation
 * table"), the second filling of the runtime's table of operations: opt_model.c's decoder layer
 * (and llama_model.c's) on fp16 hidden states, with cuBLAS and kernels of its own. The schedule
 * of flexgen.c is the same for both backends: it calls only the table. The layers and the table
 * stand first, under this map; the kernels and their launches follow in the order the layer
 * calls them, each kernel naming its CPU twin and its test; their device helpers are
 * support/cuda_kernels.h's. The plumbing beneath (streams, copies, memory, the kernels' tables,
 * CUDA Graphs, counters) is support/cuda_device.cu. Read it
 * top-down, by this map (scripts/check_layout.sh holds each line to the function's definition):
 *
 *   232  cuda_layer               an OPT decoder layer: opt_model.c's opt_layer, step for step
 *   292  cuda_llama_layer         a LLaMA decoder layer: llama_model.c's llama_layer
 *   212  cuda_embed               the input embedding; cuda_output, the logits, below cuda_layer
 *   387  fg_cuda_backend          the operation table, once a GPU is found
 *   414  gather_rows_kernel       a token's row of the embedding; add_positions_kernel below it
 *   470  layer_norm_kernel        layer norm, a product's bias added first where it comes with one
 *   536  linear                   the products: cuBLAS, or 4-bit weights (§5)
 *   631  q4_rows_kernel           decode's 4-bit product: the codes on the tensor cores
 *   680  dequant_kernel           4-bit codes widened to fp16, a slice at a time, for cuBLAS
 *   721  cache_attention          K, V into the cache, then attention: prefill, decode, delegated
 *   817  store_kv_kernel          the KV cache store, fp16 or 4-bit (§5)
 *   859  prefill_attention        a prompt's attention by cuBLAS, over the heads
 *   947  queue_attention          decode's: the split over keys, or a block a query for top-K
 *  1111  attend_query             a query's attention, with §5's top-K (attention_kernel, _q4_)
 *  1195  span_sums                a span's sums of the split, a block up to GQA_HEADS heads, merged
 *  1316  delegated_attention      a cache in host memory: attention by the CPU's code (§4.2)
 *  1361  lm_head                  the logits: cuBLAS, or from the 4-bit codes (q4_vocab_kernel)
 *  1454  rms_norm_kernel          LLaMA's RMSNorm; rope_kernel and swiglu_kernel below it
 *
 *   weights     fp16 on the device (weight_elem 2); 4-bit ones (§5) stay as they are stored,
 *               on the gpu tier and in staging alike
 *   activations fp16, as FlexGen keeps them (act_elem 2): hidden states, their homes on every
 *               tier, staging and workspace; products and reductions accumulate in fp32
 *   products    cuBLAS: fp16 weights times fp16 activations, fp32 accumulation; decode's
 *               through fp16_product, cuBLAS's default or the cublasLt algorithm timed fastest
 *               for the shape (support/cuda_device.cu); prefill attention as strided batched
 *               products over the heads of a sequence, scores and softmax in fp32. 4-bit
 *               weights: decode's few rows multiply the codes (lm_head's too), copied into
 *               shared memory steps ahead and widened in registers, on the tensor cores (no
 *               fp16 copy written or read); more rows widen a slice at a time into the
 *               workspace for cuBLAS
 *   kernels     embeddings, layer norm, bias (+ ReLU), the KV cache store (fp16 or 4-bit),
 *               causal and padding-masked softmax, decode attention (split over spans of keys
 *               and merged, or a block a query where §5's top-K selection applies), 4-bit
 *               products and widening
 *   delegation  sequences whose cache lives in host memory (--cpu-cache-compute, §4.2) get their
 *               attention from the CPU backend's code, on their q, k, v rows copied to the host
 *
 * The two backends differ by the fp16 rounding of the hidden states and of each operation's
 * output, and the order of sums (tests/test_cuda.c bounds it; --device cpu-fp16 runs the CPU
 * with the same activation format).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the plumbing: each thread's stream, copies, the workspace (cuda_ws) and the kernels' tables,
 * the checks of CUDA calls; and model.h and support.h as the device reads them */
#include "support/cuda_device.h"
/* the kernels' device helpers: the tensor cores, asynchronous copies and the 4-bit products'
 * rings, the KV cache's rows as attention reads them, a span's scores and values */
#include "support/cuda_kernels.h"

/* The types the layers and kernels pass between them (the workspace's and the tables' are
 * support/cuda_device.h's). */

/* An embedding table [len][dim] as the kernels read it: fp16, or 4-bit (q4: quant.c's layout
 * with outer 1, groups along len). */
typedef struct {
    const void *values;
    int q4;
    int len;
    int dim;
} table_view;

/* RoPE's inverse frequencies, by value (head_dim <= 1024). */
typedef struct {
    float f[512];
} rope_freqs;

/* A step's attention as its kernels take it, by value: store_kv_kernel's and attention_kernel's
 * arguments (q, k and v in qkv as `at` lays them out, the output rows attn, the cache table's rows,
 * pointers and pages of `batch` sequences), and the split's spans of span_keys keys and their
 * sums, for a run of the step's query rows (sequences first_b on, rows first_t on: the grid's y
 * and z): partials[((run row) heads + head) spans + span][hd + 2], a span's sum of weights times
 * values (hd floats), its max score and its sum of weights, the run's rows in grid order. Top-K's
 * scores and lists of kept keys, scores_apart floats a query head, lie there too where shared
 * memory cannot hold them or the split's spans score the keys (scores_in_workspace; scores_ready:
 * the spans have). */
typedef struct {
    const __half *qkv;
    qkv_layout at;
    __half *attn;
    const int *past;
    const int *pad;
    void *const *kc;
    void *const *vc;
    long long shift[2]; /* the cache table's: K's, V's */
    const int *pages;
    int max_pages, page_tokens, n_new, hd, heads, kv_heads, q4, spans, span_keys;
    float scale;
    float *partials;
    int batch, first_b, first_t;
    size_t scores_apart;
    int scores_in_workspace;
    int scores_ready;
} attention_split;

/* A 4-bit decode product as q4_rows_kernel takes it, by value: y[rows][out] (+ y with add) = x W,
 * W [in][out] of `parts` parts, in chunks of k_chunk rows of W, the codes copied copy_bytes at a
 * time; the chunks' partial sums in `partial`, each group's count of chunks done in `done`. */
typedef struct {
    const __half *x;
    int rows;
    int in;
    const uint8_t *W;
    int out;
    int parts;
    int k_chunk;
    int copy_bytes;
    float *partial;
    unsigned *done;
    __half *y;
    int add;
} q4_product_args;

/* What the layers call, defined below in the order they call it, and declared here. */

/* The embedding */
static table_view table_of(const void *values, int q4, int len, int dim);
__global__ void gather_rows_kernel(table_view table, const int *ids, __half *out);
__global__ void add_positions_kernel(__half *x, table_view pos, const int *past, const int *pad,
                                     int n_new);

/* A decoder layer: its norms, products (fp16, 4-bit) and attention (the cache's store, prefill,
 * decode, delegated) */
static void layer_norm(__half *x, int rows, int dim, const fp16 *w, const fp16 *b, __half *y);
static void bias_layer_norm(__half *x, int rows, int dim, const fp16 *bias, const fp16 *w,
                            const fp16 *b, __half *y);
__global__ void layer_norm_kernel(__half *x, int dim, const __half *add, const __half *w,
                                  const __half *b, __half *y);
static void linear(cuda_ws *d, const __half *x, int rows, int in, const void *W, int q4,
                   const fp16 *b, int out, __half *y, int mode);
__global__ void bias_kernel(__half *y, size_t n, int out, const __half *b, int relu);
static void q4_product(cuda_ws *d, const __half *x, int rows, int in, const void *W, int out,
                       int parts, __half *y, int add);
__global__ void q4_rows_kernel(q4_product_args p);
__global__ void q4_rows32_kernel(q4_product_args p);
static void widened_linear(cuda_ws *d, const __half *x, int rows, int in, const void *W, int out,
                           int parts, __half *y, float beta);
static void widen_slice(cuda_ws *d, const void *W, size_t len, size_t inner, size_t first,
                        size_t stride, size_t count, size_t width);
static void widen(__half *dst, const void *src, size_t len, size_t inner, size_t first,
                  size_t stride, size_t width, size_t n);
__global__ void dequant_kernel(const uint8_t *src, size_t len, size_t inner, size_t first,
                               size_t stride, size_t width, size_t n, __half *dst);
static unsigned blocks_for(size_t n, unsigned threads);
static void cache_attention(cuda_ws *d, const model_config *c, gpu_batch *gb, const cache_table *t,
                            const model_workspace *ws);
__host__ __device__ int store_kv_units(int hd, int q4);
__host__ __device__ size_t store_kv_threads(int rows, int kv_heads, int hd, int q4);
__global__ void store_kv_kernel(attention_split a, int rows);
static void prefill_attention(cuda_ws *d, const model_config *c, const gpu_batch *gb, int b);
__global__ void prefill_softmax_kernel(float *scores, __half *probs, int n, int pad);
static void queue_attention(attention_split a, int batch, const int *host_past, const int *host_pad,
                            float sparsity, float *partials, size_t span_slots, int fill_blocks);
static void row_runs(int batch, int n_new, size_t fit, int *run_seqs, int *run_rows);
static int top_k_in_shared(int heads, int kv_heads, int hd, int nk);
static void queue_attention_kernel(attention_split a, int seqs, int rows, int nk, float sparsity,
                                   int spans);
static void queue_split(attention_split a, int seqs, int rows, int nk, size_t span_slots,
                        int fill_blocks);
static void queue_spans(attention_split a, int seqs, int rows);
__global__ void attention_kernel(attention_split a, float sparsity);
__global__ void attention_q4_kernel(attention_split a, float sparsity);
__global__ void attention_gqa_kernel(attention_split a, float sparsity);
__global__ void attention_gqa_q4_kernel(attention_split a, float sparsity);
__global__ void attention_span_kernel(attention_split a);
__global__ void attention_span_q4_kernel(attention_split a);
__global__ void attention_span_gqa_kernel(attention_split a);
__global__ void attention_span_gqa_q4_kernel(attention_split a);
__global__ void attention_merge_kernel(attention_split a);
static void delegated_attention(cuda_ws *d, const model_config *c, gpu_batch *gb,
                                const model_workspace *ws);

/* The output */
static int last_rows(cuda_ws *d, const gpu_batch *gb, int h);
static void lm_head(cuda_ws *d, const model_weights *w, const __half *x, int rows, float *logits);
__global__ void q4_vocab_kernel(const __half *x, int rows, int dim, const uint8_t *E, int vocab,
                                int copy_bytes, float *logits);
__global__ void q4_vocab32_kernel(const __half *x, int rows, int dim, const uint8_t *E, int vocab,
                                  int copy_bytes, float *logits);
static void widened_lm_head(cuda_ws *d, const __half *x, int rows, int dim, const void *E,
                            int vocab, float *logits);

/* The LLaMA family's steps */
static void rms_norm(const __half *x, int rows, int dim, const fp16 *w, float eps, __half *y);
__global__ void rms_norm_kernel(const __half *x, int dim, const __half *w, float eps, __half *y);
__global__ void rope_kernel(__half *qkv, qkv_layout at, int n_new, const int *past, const int *pad,
                            int hd, int heads, int kv_heads, rope_freqs freqs);
__global__ void swiglu_kernel(__half *gate, const __half *up, size_t n);

/* The profile's widening (the table's widen_q4) */
static void cuda_widen_q4(void *dst, const void *src, size_t outer, size_t len, size_t inner);

/* ============================================================================================
 * The forward pass: OPT's embedding, decoder layer and output (opt_model.c's, step for step,
 * on fp16 hidden states), then LLaMA's
 * ============================================================================================ */

/* x = embed_tokens[token] (through project_in for 350m) + embed_positions[position]. */
static void cuda_embed(const model_weights *w, gpu_batch *gb, model_workspace *ws) {
    const model_config *c = &w->cfg;
    cuda_ws *d = (cuda_ws *)ws->device;
    cudaStream_t s = ctx()->stream;
    int rows = gb->batch * gb->n_new;
    __half *x = (__half *)gb->x;
    __half *words = w->project_in ? d->h : x;
    token_table t = upload_tokens(d, gb);
    table_view tokens = table_of(w->embed_tokens, w->q4, c->vocab, c->word_dim);
    table_view positions = table_of(w->embed_positions, w->q4, c->max_pos + 2, c->hidden);
    gather_rows_kernel<<<rows, 256, 0, s>>>(tokens, t.tokens, words);
    LAUNCHED("gather_rows_kernel");
    if (w->project_in)
        linear(d, d->h, rows, c->word_dim, w->project_in, w->q4, NULL, c->hidden, x, OUT_SET);
    add_positions_kernel<<<rows, 256, 0, s>>>(x, positions, t.past, t.pad, gb->n_new);
    LAUNCHED("add_positions_kernel");
}

/* One decoder layer (opt_model.c's opt_layer, step for step, on fp16 hidden states). Its tables
 * go up first, outside the graph (an upload may wait for its slot's last one). */
static void cuda_layer(const model_weights *w, int layer, gpu_batch *gb, model_workspace *ws) {
    const model_config *c = &w->cfg;
    const layer_weights *L = &w->layers[layer];
    cuda_ws *d = (cuda_ws *)ws->device;
    int rows = gb->batch * gb->n_new;
    int h = c->hidden;
    int f = c->ffn;
    __half *x = (__half *)gb->x;
    const __half *in = x;
    cache_table t = upload_cache(d, gb);
    int graph = layer_graph_begins(d, gb, &t);
    if (c->pre_ln) {
        layer_norm(x, rows, h, L->attn_ln_w, L->attn_ln_b, d->h);
        in = d->h;
    }
    linear(d, in, rows, h, L->wqkv, 3 * w->q4, L->bqkv, (int)qkv_width(c), d->qkv, OUT_SET);
    cache_attention(d, c, gb, &t, ws);
    /* out_proj's bias comes with the norm: one launch */
    linear(d, d->attn, rows, h, L->wo, w->q4, NULL, h, x, OUT_ADD);
    if (c->pre_ln) bias_layer_norm(x, rows, h, L->bo, L->ffn_ln_w, L->ffn_ln_b, d->h);
    else bias_layer_norm(x, rows, h, L->bo, L->attn_ln_w, L->attn_ln_b, x);
    linear(d, c->pre_ln ? d->h : x, rows, h, L->fc1_w, w->q4, L->fc1_b, f, d->ffn, OUT_RELU);
    linear(d, d->ffn, rows, f, L->fc2_w, w->q4, L->fc2_b, h, x, OUT_ADD);
    if (!c->pre_ln) layer_norm(x, rows, h, L->ffn_ln_w, L->ffn_ln_b, x);
    layer_graph_ends(d, graph);
}

/* logits[b] = lm_head(project_out(final_LN(x of b's last token))), or of every row with
 * all_rows. */
static void cuda_output(const model_weights *w, gpu_batch *gb, model_workspace *ws, float *logits) {
    const model_config *c = &w->cfg;
    cuda_ws *d = (cuda_ws *)ws->device;
    int h = c->hidden;
    int rows = last_rows(d, gb, h);
    if (w->final_ln_w) layer_norm(d->h, rows, h, w->final_ln_w, w->final_ln_b, d->h);
    const __half *last = d->h;
    if (w->project_out) {
        linear(d, d->h, rows, h, w->project_out, w->q4, NULL, c->word_dim, d->qkv, OUT_SET);
        last = d->qkv;
    }
    lm_head(d, w, last, rows, logits);
}

/* ============================================================================================
 * The LLaMA family (llama_model.c's steps, on fp16 hidden states): RMSNorm, RoPE and SwiGLU
 * kernels of its own (below, after OPT's); the products, the cache and attention (grouped-query)
 * OPT's.
 * ============================================================================================ */

/* x = embed_tokens[token] (no position table). */
static void cuda_llama_embed(const model_weights *w, gpu_batch *gb, model_workspace *ws) {
    cuda_ws *d = (cuda_ws *)ws->device;
    int rows = gb->batch * gb->n_new;
    token_table t = upload_tokens(d, gb);
    table_view tokens = table_of(w->embed_tokens, w->q4, w->cfg.vocab, w->cfg.hidden);
    gather_rows_kernel<<<rows, 256, 0, ctx()->stream>>>(tokens, t.tokens, (__half *)gb->x);
    LAUNCHED("gather_rows_kernel");
}

/* One decoder layer (llama_model.c's llama_layer, step for step); its tables first, as OPT's. */
static void cuda_llama_layer(const model_weights *w, int layer, gpu_batch *gb,
                             model_workspace *ws) {
    const model_config *c = &w->cfg;
    const layer_weights *L = &w->layers[layer];
    cuda_ws *d = (cuda_ws *)ws->device;
    int rows = gb->batch * gb->n_new;
    int h = c->hidden;
    int f = c->ffn;
    int qw = q_width(c);
    int kw = kv_width(c);
    __half *x = (__half *)gb->x;
    __half *gate = d->ffn;
    __half *up = d->ffn + (size_t)rows * f;
    qkv_layout at = qkv_layout_of(c, (size_t)rows);
    rope_freqs freqs;
    rope_frequencies(c, freqs.f);
    cache_table t = upload_cache(d, gb);
    int graph = layer_graph_begins(d, gb, &t);
    /* input_layernorm, then the q, k, v projections */
    rms_norm(x, rows, h, L->attn_ln_w, c->rms_eps, d->h);
    linear(d, d->h, rows, h, L->wq, w->q4, L->bq, qw, d->qkv + at.at[0], OUT_SET);
    linear(d, d->h, rows, h, L->wk, w->q4, L->bk, kw, d->qkv + at.at[1], OUT_SET);
    linear(d, d->h, rows, h, L->wv, w->q4, L->bv, kw, d->qkv + at.at[2], OUT_SET);
    /* positions into q, k */
    int hd = cfg_head_dim(c);
    rope_kernel<<<rows, 128, 0, ctx()->stream>>>(d->qkv, at, gb->n_new, t.past, t.pad, hd,
                                                 c->n_heads, cfg_kv_heads(c), freqs);
    LAUNCHED("rope_kernel");
    /* K, V cached; attend; o_proj, residual */
    cache_attention(d, c, gb, &t, ws);
    linear(d, d->attn, rows, qw, L->wo, w->q4, L->bo, h, x, OUT_ADD);
    /* post-attention norm, the SwiGLU MLP */
    rms_norm(x, rows, h, L->ffn_ln_w, c->rms_eps, d->h);
    linear(d, d->h, rows, h, L->gate_w, w->q4, L->gate_b, f, gate, OUT_SET);
    linear(d, d->h, rows, h, L->up_w, w->q4, L->up_b, f, up, OUT_SET);
    size_t n = (size_t)rows * f;
    swiglu_kernel<<<blocks_for(n, 256), 256, 0, ctx()->stream>>>(gate, up, n);
    LAUNCHED("swiglu_kernel");
    /* down_proj, residual */
    linear(d, gate, rows, f, L->down_w, w->q4, L->down_b, h, x, OUT_ADD);
    layer_graph_ends(d, graph);
}

/* logits[b] = lm_head(RMSNorm(x of b's last token)), or of every row with all_rows. */
static void cuda_llama_output(const model_weights *w, gpu_batch *gb, model_workspace *ws,
                              float *logits) {
    const model_config *c = &w->cfg;
    cuda_ws *d = (cuda_ws *)ws->device;
    int h = c->hidden;
    int rows = last_rows(d, gb, h);
    rms_norm(d->h, rows, h, w->final_ln_w, c->rms_eps, d->h);
    lm_head(d, w, d->h, rows, logits);
}

/* ============================================================================================
 * The table, once a GPU is found
 * ============================================================================================ */

/* The fields in model.h's order, as app/cpu_backend.c's fg_cpu_backend lists them. */
static const fg_backend cuda_backend = {
    .name = "cuda",
    .gpu_is_host = 0,
    .weight_elem = 2,             /* fp16 */
    .act_elem = FG_CUDA_ACT_ELEM, /* fp16 */
    .alloc = cuda_alloc,
    .free = cuda_free,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .reads_in_place = cuda_reads_in_place,
    .weights_in = cuda_weights_in,
    .weights_in_q4 = cuda_weights_in_q4,
    .widen_q4 = cuda_widen_q4,
    .copy_in = cuda_copy_in,
    .copy_out = cuda_copy_out,
    .copy = cuda_copy,
    .copies_done = cuda_copies_done,
    .finish = cuda_finish,
    .join = cuda_join,
    .counts = cuda_counts,
    .workspace_bytes = fg_cuda_workspace_bytes,
    .workspace_init = cuda_workspace_init,
    .workspace_free = cuda_workspace_free,
    .forward = {{cuda_embed, cuda_layer, cuda_output},                    /* FAMILY_OPT */
                {cuda_llama_embed, cuda_llama_layer, cuda_llama_output}}, /* FAMILY_LLAMA */
    .device_memory = cuda_device_memory,
    .reads_q4 = 1, /* 4-bit weights stay 4-bit: the products read the codes */
    .device_reserve = FG_CUDA_RESERVE,
    .host_reserve = FG_CUDA_HOST_RESERVE, /* the bounce buffers */
    .delegated_bytes = fg_cuda_delegated_bytes,
};

extern "C" int fg_cuda_compiled(void) { return 1; }

extern "C" int fg_cuda_settings(char *err) { return cuda_settings(err); }

extern "C" const fg_backend *fg_cuda_backend(char *err) {
    if (cuda_device_open(err)) return NULL;
    return &cuda_backend;
}

/* ============================================================================================
 * Kernels of the layer and their launches, in the order the layers call them: fp16 in and out,
 * fp32 inside. Each kernel names its CPU twin and the test of tests/test_kernels.cu that holds
 * the two together (the kernels suite, on a GPU or the emulated one).
 * ============================================================================================ */

/* ---- the embedding ---- */

static table_view table_of(const void *values, int q4, int len, int dim) {
    table_view t = {.values = values, .q4 = q4, .len = len, .dim = dim};
    return t;
}

/* Value i of row `row`, fp16: a 4-bit one widened as dequant_kernel widens it. */
__device__ __half table_value(table_view t, int row, int i) {
    size_t e = (size_t)row * t.dim + i;
    if (t.q4) return __float2half_rn(q4_value((const uint8_t *)t.values, t.len, t.dim, e));
    return ((const __half *)t.values)[e];
}

/* out = table[ids[row]], a block per row. CPU twin: opt_embed's matmul_embed_row of the token
 * table (llama_embed's too). Test: test_embed, bit for bit, fp16 and 4-bit. */
__global__ void gather_rows_kernel(table_view table, const int *ids, __half *out) {
    int dim = table.dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[(size_t)blockIdx.x * dim + i] = table_value(table, ids[blockIdx.x], i);
}

/* x += pos[position_of(row)], a block per row. CPU twin: opt_embed's positions. Test: test_embed,
 * bit for bit, fp16 and 4-bit. */
__global__ void add_positions_kernel(__half *x, table_view pos, const int *past, const int *pad,
                                     int n_new) {
    int r = blockIdx.x;
    int b = r / n_new;
    int h = pos.dim;
    int position = position_of(past[b], pad[b], r % n_new);
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        size_t at = (size_t)r * h + i;
        float p = __half2float(table_value(pos, position, i));
        x[at] = __float2half_rn(__half2float(x[at]) + p);
    }
}

/* ---- layer norm ---- */

/* A row's block: up to LN_THREADS threads, whole warps, each loading LN_AT_ONCE of its elements
 * (a block's width apart) before it uses any, so that a row of a few thousand takes one round of
 * loads a pass; a short row gets the warps it fills. */
#define LN_THREADS 1024
#define LN_AT_ONCE 4

static int ln_threads(int dim) {
    int warps = (dim + 32 * LN_AT_ONCE - 1) / (32 * LN_AT_ONCE);
    return warps * 32 < LN_THREADS ? warps * 32 : LN_THREADS;
}

static void layer_norm(__half *x, int rows, int dim, const fp16 *w, const fp16 *b, __half *y) {
    layer_norm_kernel<<<rows, ln_threads(dim), 0, ctx()->stream>>>(
        x, dim, (const __half *)NULL, (const __half *)w, (const __half *)b, y);
    LAUNCHED("layer_norm_kernel");
}

/* x += bias (the product just added into x, as linear's OUT_ADD adds it), then y =
 * layer_norm(x). */
static void bias_layer_norm(__half *x, int rows, int dim, const fp16 *bias, const fp16 *w,
                            const fp16 *b, __half *y) {
    layer_norm_kernel<<<rows, ln_threads(dim), 0, ctx()->stream>>>(
        x, dim, (const __half *)bias, (const __half *)w, (const __half *)b, y);
    LAUNCHED("layer_norm_kernel");
}

/* y = (x - mean) / sqrt(var + 1e-5) * w + b, a block per row, in three passes over the row
 * (the sum, the sum of squared differences, the output), each loading a thread's LN_AT_ONCE
 * elements before it uses them. CPU twin: opt_model.c's layer_norm. Test: test_layer_norm, within
 * its bound of a layer norm in double. With `add` (a product's bias, [dim]), x += add first,
 * rounded to fp16 and kept in x, the bits of bias_kernel's OUT_ADD before a separate norm (tested
 * bit for bit by test_bias_layer_norm): one launch for the two. y may alias x (each thread writes
 * only the elements it read). */
__global__ void layer_norm_kernel(__half *x, int dim, const __half *add, const __half *w,
                                  const __half *b, __half *y) {
    __shared__ float shared[32];
    __half *xr = x + (size_t)blockIdx.x * dim;
    __half *yr = y + (size_t)blockIdx.x * dim;
    int threads = (int)blockDim.x;
    int step = threads * LN_AT_ONCE;
    float s = 0;
    for (int i0 = threadIdx.x; i0 < dim; i0 += step) {
        float v[LN_AT_ONCE];
        float a[LN_AT_ONCE];
        for (int k = 0; k < LN_AT_ONCE; k++) {
            int i = i0 + k * threads;
            v[k] = i < dim ? __half2float(xr[i]) : 0;
            a[k] = add && i < dim ? __half2float(add[i]) : 0;
        }
        for (int k = 0; k < LN_AT_ONCE && i0 + k * threads < dim; k++) {
            if (add) {
                __half sum = __float2half_rn(v[k] + a[k]);
                xr[i0 + k * threads] = sum;
                v[k] = __half2float(sum);
            }
            s += v[k];
        }
    }
    float mean = block_sum(s, shared) / dim;
    s = 0;
    for (int i0 = threadIdx.x; i0 < dim; i0 += step) {
        float v[LN_AT_ONCE];
        for (int k = 0; k < LN_AT_ONCE; k++) {
            int i = i0 + k * threads;
            v[k] = i < dim ? __half2float(xr[i]) - mean : 0;
        }
        for (int k = 0; k < LN_AT_ONCE; k++) s += v[k] * v[k];
    }
    float inv = 1.0f / sqrtf(block_sum(s, shared) / dim + 1e-5f);
    for (int i0 = threadIdx.x; i0 < dim; i0 += step) {
        float v[LN_AT_ONCE];
        float scale[LN_AT_ONCE];
        float shift[LN_AT_ONCE];
        for (int k = 0; k < LN_AT_ONCE; k++) {
            int i = i0 + k * threads < dim ? i0 + k * threads : i0;
            v[k] = __half2float(xr[i]);
            scale[k] = __half2float(w[i]);
            shift[k] = __half2float(b[i]);
        }
        for (int k = 0; k < LN_AT_ONCE && i0 + k * threads < dim; k++)
            yr[i0 + k * threads] = __float2half_rn((v[k] - mean) * inv * scale[k] + shift[k]);
    }
}

/* ---- the products: fp16 weights by cuBLAS; 4-bit weights (§5; quant.c has the layout) stay as
 * they are stored, on the gpu tier and in staging (reads_q4) ---- */

/* 4-bit products (§5). Up to Q4_DIRECT_ROWS rows of x (decode's) multiply the codes as they are
 * stored, on the tensor cores; a product of more rows (prefill's) widens W into fp16 slices for
 * cuBLAS. Where the two cross on a given GPU is for scripts/gpu_check.sh to measure. A matrix W
 * [in][out] of `parts` parts side by side (q|k|v: 3) is stored as quant.c lays it out with outer
 * in parts, len out / parts, inner 1: row k is each part's codes in turn, 32 bytes a group of 64
 * columns (byte p: column 2p in its high half, 2p + 1 in its low), then the part's G mins and G
 * scales. */
#define Q4_DIRECT_ROWS FG_CUDA_Q4_DIRECT
/* y[rows][out] (=, +=) x[rows][in] W[in][out] + b (ReLU): W fp16 as stored ([in][out], row-major,
 * which cuBLAS sees as the column-major W^T), or 4-bit in q4 parts (opt_model.c's linear_layer's
 * q4: q|k|v 3; from the codes for decode's rows, widened for more), x and y fp16, fp32
 * accumulation. */
static void linear(cuda_ws *d, const __half *x, int rows, int in, const void *W, int q4,
                   const fp16 *b, int out, __half *y, int mode) {
    float beta = mode == OUT_ADD ? 1.0f : 0.0f;
    if (q4 && rows <= Q4_DIRECT_ROWS) q4_product(d, x, rows, in, W, out, q4, y, mode == OUT_ADD);
    else if (q4) widened_linear(d, x, rows, in, W, out, q4, y, beta);
    else fp16_product(d, CUBLAS_OP_N, out, rows, in, W, x, beta, y, CUDA_R_16F);
    if (!b) return;
    size_t m = (size_t)rows * out;
    bias_kernel<<<blocks_for(m, 256), 256, 0, ctx()->stream>>>(y, m, out, (const __half *)b,
                                                               mode == OUT_RELU);
    LAUNCHED("bias_kernel");
}

/* y += b[column], then ReLU if relu. CPU twin: opt_model.c's linear_layer, after its product.
 * Test: test_linear, every mode (and test_bias_layer_norm its OUT_ADD bits). */
__global__ void bias_kernel(__half *y, size_t n, int out, const __half *b, int relu) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = __half2float(y[i]) + __half2float(b[i % out]);
    y[i] = __float2half_rn(relu && v < 0 ? 0 : v);
}

/* y[rows][out] (=, + y with add) = x W for a 4-bit W [in][out] of `parts` parts and rows <=
 * Q4_DIRECT_ROWS, in one pass over the codes (q4_rows_kernel): each chunk's partial sums in the
 * workspace's scratch, which the last block of each group of columns adds. The codes are copied 16
 * bytes at a time where every row's groups lie on 16 bytes, else 4, else a byte (q4_stage_copy). */
static void q4_product(cuda_ws *d, const __half *x, int rows, int in, const void *W, int out,
                       int parts, __half *y, int add) {
    int k_chunk = fg_cuda_q4_k_chunk(in, out, rows);
    size_t part_bytes = q4_bytes(1, (size_t)(out / parts), 1);
    int copy_bytes = ((uintptr_t)W | part_bytes) % 16 == 0 ? 16 : (uintptr_t)W % 4 == 0 ? 4 : 1;
    q4_product_args p = {x,     rows,    in,         (const uint8_t *)W, out,
                         parts, k_chunk, copy_bytes, d->q4_scratch,      d->q4_done,
                         y,     add};
    dim3 grid(parts * blocks_for((size_t)(out / parts), Q4_GROUP), (in + k_chunk - 1) / k_chunk);
    if (rows <= 16) {
        q4_rows_kernel<<<grid, 32 * Q4_WARPS, Q4_SHARED_BYTES(1), ctx()->stream>>>(p);
        LAUNCHED("q4_rows_kernel");
    } else {
        q4_rows32_kernel<<<grid, 32 * Q4_WARPS, Q4_SHARED_BYTES(2), ctx()->stream>>>(p);
        LAUNCHED("q4_rows32_kernel");
    }
}

/* partial[chunk][r][j] = sum over the chunk's rows k of W (k_chunk of them from chunk k_chunk) of
 * x[r][k] W[k][j], for r < rows <= 16 M_TILES, on the tensor cores (mma_16x8x16: fp16 values,
 * fp32 sums). A block a group of 64 columns of a part and a chunk; its warps take the chunk's
 * steps of 16 rows in turn. Each warp keeps a ring of Q4_STAGES steps in shared memory (q4_ring),
 * the codes, mins and scales of its next Q4_STAGES - 1 steps on their way by asynchronous copies
 * (q4_stage_copy) while it multiplies this one's: a lane copies 16 bytes, half a row's codes. A
 * lane (gid = lane / 4, tig = lane % 4) then reads 4 bytes of codes, columns 8 gid to 8 gid + 7,
 * of each of its 4 rows of the step (q4_stage_read). The group's 64 columns are 8 products of 8
 * columns, product t taking column 8 gid + t as its column gid, so that a lane widens only the
 * bytes it read (q4_pair, q4_step_multiply). The values are q4_value's rounded to fp16
 * (dequant_kernel's, to a rounding of the fma); the warps' sums meet in shared memory in a fixed
 * order (q4_sums_out); then y = the sum of the chunks' partial sums in chunk order, rounded to fp16
 * once, by the group's last block to count itself done (q4_chunk_sums), whichever that is. The
 * helpers are support/cuda_kernels.h's. Up to 16 rows (q4_rows_kernel) keep one tile's sums in
 * registers, up to 32 (q4_rows32_kernel) two. CPU twin: the product by q4_decompress's values
 * rounded to fp16. Test: test_q4_linear, within its bound of that product in double, every
 * copy_bytes, the same bits in every order of the blocks. */
template <int M_TILES> __device__ void q4_rows(const q4_product_args &p) {
    extern __shared__ q4_stage stages[]; /* [Q4_WARPS][Q4_STAGES], then the warps' sums */
    int part_cols = p.out / p.parts;
    int groups = (part_cols + Q4_GROUP - 1) / Q4_GROUP;
    int part = blockIdx.x / groups;
    int group = blockIdx.x % groups;
    size_t part_bytes = (size_t)groups * (Q4_GROUP / 2 + 4);
    const uint8_t *first_row = p.W + part * part_bytes;
    size_t stride = p.parts * part_bytes;
    size_t codes_at = (size_t)group * (Q4_GROUP / 2);
    size_t min_at = (size_t)groups * (Q4_GROUP / 2) + 2 * group;
    size_t scale_at = min_at + 2 * groups;
    int min_shift = min_at & 2 ? 16 : 0;
    int scale_shift = scale_at & 2 ? 16 : 0;
    int k_end = p.in < (int)(blockIdx.y + 1) * p.k_chunk ? p.in : (int)(blockIdx.y + 1) * p.k_chunk;
    float acc[M_TILES][8][4] = {};
    auto copy = [&](q4_stage *stage, int k0) {
        q4_stage_copy(stage, first_row, stride, k0, k_end, codes_at, min_at, scale_at,
                      p.copy_bytes);
    };
    auto multiply = [&](const q4_stage *stage, int k0) {
        q4_step now = q4_stage_read(stage, min_shift, scale_shift);
        q4_step_multiply<M_TILES>(now, p.x, p.rows, p.in, k_end, k0, acc);
    };
    q4_ring(stages, blockIdx.y * p.k_chunk, k_end, copy, multiply);
    size_t first_column = (size_t)part * part_cols + (size_t)group * Q4_GROUP;
    int columns = part_cols - group * Q4_GROUP < Q4_GROUP ? part_cols - group * Q4_GROUP : Q4_GROUP;
    q4_sums_out<M_TILES, 0>(acc, stages, p.rows, columns, p.out,
                            p.partial + (size_t)blockIdx.y * p.rows * p.out + first_column);
    if (q4_last_chunk(p.done + blockIdx.x))
        q4_chunk_sums(p.partial + first_column, gridDim.y, p.rows, columns, p.out,
                      p.y + first_column, p.add);
}

__global__ void q4_rows_kernel(q4_product_args p) { q4_rows<1>(p); }

__global__ void q4_rows32_kernel(q4_product_args p) { q4_rows<2>(p); }

/* y[rows][out] (=, += with beta 1) x[rows][in] W, slices of columns of W (of `parts` parts). */
static void widened_linear(cuda_ws *d, const __half *x, int rows, int in, const void *W, int out,
                           int parts, __half *y, float beta) {
    int slice = (int)(d->widen_values / (size_t)in);
    float one = 1;
    if (slice < 1)
        cuda_fail("widened_linear", __FILE__, __LINE__, "a row of W past the workspace's slice");
    for (int j0 = 0; j0 < out; j0 += slice) {
        int cols = out - j0 < slice ? out - j0 : slice;
        widen_slice(d, W, (size_t)(out / parts), 1, (size_t)j0, (size_t)out, (size_t)in,
                    (size_t)cols);
        BLAS_PRODUCT(cublasGemmEx(blas(), CUBLAS_OP_N, CUBLAS_OP_N, cols, rows, in, &one,
                                  d->q4_scratch, CUDA_R_16F, cols, x, CUDA_R_16F, in, &beta, y + j0,
                                  CUDA_R_16F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
}

/* x times a 4-bit matrix for more rows than decode's: a slice at a time widened into the
 * workspace's scratch (dequant_kernel), then a cuBLAS product of it (fp16 inputs, fp32
 * accumulation), on the same stream. A slice is `count` stretches of `width` values, `stride`
 * apart from value `first` on (dst [count][width]): of a matrix W [in][out], columns j0 .. j0 +
 * width of every row; of a table E [vocab][dim], rows v0 .. v0 + count whole. */
static void widen_slice(cuda_ws *d, const void *W, size_t len, size_t inner, size_t first,
                        size_t stride, size_t count, size_t width) {
    widen((__half *)d->q4_scratch, W, len, inner, first, stride, width, count * width);
}

/* dequant_kernel's slice of src into dst, counted (the counters' `widened`). */
static void widen(__half *dst, const void *src, size_t len, size_t inner, size_t first,
                  size_t stride, size_t width, size_t n) {
    count(&counts.widened, 1);
    dequant_kernel<<<blocks_for(n, 256), 256, 0, ctx()->stream>>>((const uint8_t *)src, len, inner,
                                                                  first, stride, width, n, dst);
    LAUNCHED("dequant_kernel");
}

static unsigned blocks_for(size_t n, unsigned threads) {
    return (unsigned)((n + threads - 1) / threads);
}

/* dst[a][b] = value first + a stride + b of a 4-bit tensor [outer][len][inner], for b < width
 * and a width + b < n: a thread per value, min + q scale (model.h's q4_value, which the CPU builds
 * too) rounded to fp16, the device's working format (a whole tensor: first 0, stride = width = n).
 * CPU twin: quant.c's q4_decompress. Test: test_dequant, bit for bit after the fp16 rounding, whole
 * tensors and slices. */
__global__ void dequant_kernel(const uint8_t *src, size_t len, size_t inner, size_t first,
                               size_t stride, size_t width, size_t n, __half *dst) {
    size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    dst[e] = __float2half_rn(q4_value(src, len, inner, first + e / width * stride + e % width));
}

/* A whole 4-bit tensor to fp16 (the profile's decompression rate). */
static void cuda_widen_q4(void *dst, const void *src, size_t outer, size_t len, size_t inner) {
    size_t n = outer * len * inner;
    widen((__half *)dst, src, len, inner, 0, n, n, n);
}

/* ---- attention: the KV cache (§4.2; 4-bit §5), prefill, decode, delegated ---- */

/* The attention kernels' blocks: 256 threads, reading a head's rows 8 values at a time (16 bytes
 * of fp16, or 4 bytes of 4-bit codes with their group's min and scale), the lanes of a row side
 * by side, KEYS_AT_ONCE keys' loads in flight before any is used. Scores: a group of lanes a key
 * (lanes_per_key), their dot products added by shuffles. Values: a thread a chunk of the output,
 * the block's threads in groups of a row's chunks, each group summing its keys in registers; the
 * groups' sums are added in a fixed order through shared memory. The query waits in shared memory
 * as fp32, up to checkpoint.c's largest head. A span of the split (attention_span_kernel) is
 * FG_CUDA_MIN_SPAN_KEYS to FG_CUDA_SPAN_KEYS keys (support.h, which sizes the workspace's part for
 * their sums); queue_attention cuts a query's keys into more spans while the step's blocks are
 * fewer than FILL_BLOCKS_PER_SM a multiprocessor. attention_kernel holds a query's scores for
 * §5's top-K in shared memory up to TOP_K_SHARED_BYTES (a block has 48 KB without asking for
 * more, and its own arrays take 9.6 KB: 4,032 keys at one head of 128, with its query), in the
 * workspace beyond that (top_k_in_shared). A step whose sums (or scores) the workspace cannot
 * hold at once goes through in runs of its query rows (row_runs). Grouped-query attention: a
 * block of the split, or of top-K, takes up to GQA_HEADS query heads of one K/V head, and loads
 * each K row (and the split each V row) once for them all. GQA_HEADS, a query row's blocks
 * (row_head_blocks) and the helpers that read the rows (attention_scores, attention_values) are
 * support/cuda_kernels.h's. */
#define ATTENTION_THREADS 256
#define MAX_HEAD_DIM 1024
#define MERGE_THREADS 128
#define FILL_BLOCKS_PER_SM 8
#define TOP_K_SHARED_BYTES (32 * 1024)

/* This step's K and V into the cache, then attention: prefill by cuBLAS, the rest (decode, or
 * prefill after cached tokens) by queue_attention's kernels, delegated sequences on the CPU. */
static void cache_attention(cuda_ws *d, const model_config *c, gpu_batch *gb, const cache_table *t,
                            const model_workspace *ws) {
    cudaStream_t s = ctx()->stream;
    int rows = gb->batch * gb->n_new;
    int hd = cfg_head_dim(c);
    attention_split a = {.qkv = d->qkv,
                         .at = qkv_layout_of(c, (size_t)rows),
                         .attn = d->attn,
                         .past = t->past,
                         .pad = t->pad,
                         .kc = t->k,
                         .vc = t->v,
                         .shift = {t->shift[0], t->shift[1]},
                         .pages = t->pages,
                         .max_pages = t->max_pages,
                         .page_tokens = gb->page_tokens,
                         .n_new = gb->n_new,
                         .hd = hd,
                         .heads = c->n_heads,
                         .kv_heads = cfg_kv_heads(c),
                         .q4 = gb->kv_q4,
                         .spans = 0,
                         .span_keys = 0,
                         .scale = 1.0f / sqrtf((float)hd),
                         .partials = NULL,
                         .batch = gb->batch,
                         .first_b = 0,
                         .first_t = 0,
                         .scores_apart = 0,
                         .scores_in_workspace = 0,
                         .scores_ready = 0};
    size_t threads = store_kv_threads(rows, a.kv_heads, hd, a.q4);
    store_kv_kernel<<<blocks_for(threads, 128), 128, 0, s>>>(a, rows);
    LAUNCHED("store_kv_kernel");
    int prompts_only = gb->n_new > 1; /* prefill alone */
    for (int b = 0; b < gb->batch; b++) prompts_only &= gb->past[b] == 0;
    if (prompts_only) {
        for (int b = 0; b < gb->batch; b++)
            if (!gb->kv_in_host[b]) prefill_attention(d, c, gb, b);
    } else if (t->on_device > 0) {
        queue_attention(a, gb->batch, gb->past, gb->pad, gb->attn_sparsity, d->partials,
                        d->span_slots, FILL_BLOCKS_PER_SM * d->multiprocessors);
        count_v_rows(gb, c->n_heads);
    }
    /* its copies follow on this stream */
    if (t->on_device < gb->batch) delegated_attention(d, c, gb, ws);
}

/* ---- the KV cache store ---- */

/* One 4-bit group of a cache row: n values of one head, as quant.c's compress_group (inner 1),
 * without FMA contraction so that the levels are the CPU's (store_kv_kernel's test holds them). */
__device__ void compress_group(const float *x, int n, uint8_t *bytes, __half *min_out,
                               __half *scale_out) {
    float lo = x[0];
    float hi = x[0];
    for (int e = 1; e < n; e++) {
        lo = fminf(lo, x[e]);
        hi = fmaxf(hi, x[e]);
    }
    __half min16 = __float2half_rn(lo);
    float min = __half2float(min16);
    __half scale16 =
        hi > min ? half_at_least(__fdiv_rn(__fsub_rn(hi, min), 15.0f)) : __ushort_as_half(0);
    float scale = __half2float(scale16);
    float inv = scale > 0 ? __fdiv_rn(1.0f, scale) : 0;
    for (int p = 0; p < Q4_GROUP / 2; p++) {
        int q[2] = {0, 0};
        for (int half = 0; half < 2; half++) {
            int e = 2 * p + half;
            if (e >= n) break;
            float t = __fadd_rn(__fmul_rn(__fsub_rn(x[e], min), inv), 0.5f);
            q[half] = t <= 0 ? 0 : t >= 15 ? 15 : (int)t;
        }
        bytes[p] = (uint8_t)(q[0] << 4 | q[1]);
    }
    *min_out = min16;
    *scale_out = scale16;
}

/* The threads of store_kv_kernel: a thread per (row, K or V, head, unit), a unit an element of
 * an fp16 cache (a warp's stores side by side), or a group of a 4-bit one. */
__host__ __device__ int store_kv_units(int hd, int q4) {
    return q4 ? (hd + Q4_GROUP - 1) / Q4_GROUP : hd;
}

__host__ __device__ size_t store_kv_threads(int rows, int kv_heads, int hd, int q4) {
    return (size_t)rows * 2 * kv_heads * store_kv_units(hd, q4);
}

/* This step's K and V rows (those not padding) into the device caches at slots past[b] on,
 * through the page tables ([K, V][batch][max_pages]): a thread per (row, K or V, head, unit),
 * store_kv_threads' units: an element of an fp16 row, a group of a 4-bit one.
 * q, k and v sit in qkv as `at` lays them out (qkv_layout_of); a cache row is kv_heads x hd. CPU
 * twin: opt_model.c's store_kv (q4_compress for a 4-bit cache). Test: test_store_kv, byte for byte
 * at each row's page, fp16 and 4-bit. */
__global__ void store_kv_kernel(attention_split a, int rows) {
    int hd = a.hd;
    int heads = a.kv_heads;
    int G = (hd + Q4_GROUP - 1) / Q4_GROUP;
    int kvw = heads * hd;
    int units = store_kv_units(hd, a.q4);
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= store_kv_threads(rows, heads, hd, a.q4)) return;
    int unit = (int)(i % units);
    int head = (int)(i / units % heads);
    int kv = (int)(i / units / heads % 2);
    int r = (int)(i / units / heads / 2);
    int b = r / a.n_new;
    int slot = a.past[b] + r % a.n_new - a.pad[b];
    char *cache = (char *)(kv ? a.vc[b] : a.kc[b]);
    if (!cache || slot < a.past[b]) return; /* delegated (the CPU stores it), or padding */
    cache += a.shift[kv];
    const int *pages = a.pages + ((size_t)kv * (rows / a.n_new) + b) * a.max_pages;
    size_t row_at = kv_page_row(pages, a.page_tokens, slot);
    const __half *x = a.qkv + a.at.at[kv + 1] + (size_t)r * a.at.stride[kv + 1] + (size_t)head * hd;
    if (!a.q4) { /* element `unit` */
        __half *row = (__half *)(cache + row_at * 2 * kvw) + (size_t)head * hd;
        row[unit] = x[unit];
        return;
    }
    int g = unit;
    int n = hd - g * Q4_GROUP < Q4_GROUP ? hd - g * Q4_GROUP : Q4_GROUP;
    float group[Q4_GROUP];
    for (int e = 0; e < n; e++) group[e] = __half2float(x[g * Q4_GROUP + e]);
    size_t head_bytes = (size_t)G * (Q4_GROUP / 2 + 4);
    uint8_t *bytes = (uint8_t *)cache + row_at * heads * head_bytes + (size_t)head * head_bytes;
    __half *mins = (__half *)(bytes + (size_t)G * (Q4_GROUP / 2));
    __half *scales = mins + G;
    compress_group(group, n, bytes + g * (Q4_GROUP / 2), &mins[g], &scales[g]);
}

/* ---- prefill: a prompt's attention by cuBLAS ---- */

/* Prefill (len 0) of device sequence b: scores = scale Q K^T (fp32) and out = P V, products
 * batched over the query heads on fp16 inputs (cuBLAS sees row-major [n][width] slices as
 * column-major): one product over every head (OPT), or one per K/V head over the query heads that
 * share it, its K and V repeated by a batch stride of 0 (grouped-query attention). */
static void prefill_attention(cuda_ws *d, const model_config *c, const gpu_batch *gb, int b) {
    int n = gb->n_new;
    int H = c->n_heads;
    int hd = cfg_head_dim(c);
    int group = H / cfg_kv_heads(c);
    int qw = q_width(c);
    qkv_layout at = qkv_layout_of(c, (size_t)gb->batch * n);
    float scale = 1.0f / sqrtf((float)hd);
    float one = 1;
    float zero = 0;
    const __half *q = d->qkv + at.at[0] + (size_t)b * n * at.stride[0];
    const __half *k = d->qkv + at.at[1] + (size_t)b * n * at.stride[1];
    const __half *v = d->qkv + at.at[2] + (size_t)b * n * at.stride[2];
    int calls = group == 1 ? 1 : H / group;
    int batch = group == 1 ? H : group;
    long long kv_stride = group == 1 ? hd : 0;
    for (int j = 0; j < calls; j++) /* scores of query heads j batch .. (j + 1) batch - 1 */
        BLAS_PRODUCT(cublasGemmStridedBatchedEx(
            blas(), CUBLAS_OP_T, CUBLAS_OP_N, n, n, hd, &scale, k + (size_t)j * hd, CUDA_R_16F,
            (int)at.stride[1], kv_stride, q + (size_t)j * batch * hd, CUDA_R_16F, (int)at.stride[0],
            hd, &zero, d->scores + (size_t)j * batch * n * n, CUDA_R_32F, n, (long long)n * n,
            batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    dim3 grid(n, H);
    prefill_softmax_kernel<<<grid, 128, 0, ctx()->stream>>>(d->scores, d->probs, n, gb->pad[b]);
    LAUNCHED("prefill_softmax_kernel");
    for (int j = 0; j < calls; j++)
        BLAS_PRODUCT(cublasGemmStridedBatchedEx(
            blas(), CUBLAS_OP_N, CUBLAS_OP_N, hd, n, n, &one, v + (size_t)j * hd, CUDA_R_16F,
            (int)at.stride[2], kv_stride, d->probs + (size_t)j * batch * n * n, CUDA_R_16F, n,
            (long long)n * n, &zero, d->attn + (size_t)b * n * qw + (size_t)j * batch * hd,
            CUDA_R_16F, qw, hd, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* Prefill probabilities of one sequence: row t (query slot t) keeps keys [pad, t], softmaxed in
 * fp32 and stored fp16; others, and the rows of padding queries, are 0. A block per (query,
 * head). CPU twin: opt_model.c's softmax over a prompt's causal rows (attention). Test:
 * test_prefill, prefill_attention within its bound of softmax attention in double. */
__global__ void prefill_softmax_kernel(float *scores, __half *probs, int n, int pad) {
    __shared__ float shared[32];
    int t = blockIdx.x;
    size_t at = ((size_t)blockIdx.y * n + t) * n;
    float *row = scores + at;
    float m = -INFINITY;
    float sum = 0;
    for (int j = pad + threadIdx.x; j <= t; j += blockDim.x) m = fmaxf(m, row[j]);
    m = block_max(m, shared);
    for (int j = pad + threadIdx.x; j <= t; j += blockDim.x) sum += row[j] = expf(row[j] - m);
    sum = block_sum(sum, shared);
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        probs[at + j] = __float2half_rn(j >= pad && j <= t ? row[j] / sum : 0);
}

/* ---- decode (and prefill after cached tokens): the attention kernels ---- */

/* The keys of a span of the split for queries that see up to nk keys, `blocks` blocks a span:
 * the fewest spans of at most FG_CUDA_SPAN_KEYS keys (span_slots holds their sums: queue_attention
 * sizes its runs so), or more of them, down to FG_CUDA_MIN_SPAN_KEYS keys, while the step's blocks
 * (blocks x spans) are fewer than fill_blocks and span_slots holds the sums of its queries x
 * spans; keys cut evenly, rounded up to a multiple of 32. */
static int attention_span_keys(int nk, size_t queries, size_t blocks, size_t span_slots,
                               int fill_blocks) {
    size_t spans = (size_t)fg_cuda_attention_spans(nk);
    size_t most = ((size_t)nk + FG_CUDA_MIN_SPAN_KEYS - 1) / FG_CUDA_MIN_SPAN_KEYS;
    while (spans < most && blocks * spans < (size_t)fill_blocks &&
           queries * (spans + 1) <= span_slots)
        spans++;
    size_t keys = ((size_t)nk + spans - 1) / spans;
    return (int)((keys + 31) / 32 * 32);
}

/* The spans top-K's scores are cut into where its `blocks` (a query row's heads each: 128 at 4
 * sequences of opt-6.7b) would fill half the card or less: as many as fill_blocks holds, of
 * FG_CUDA_MIN_SPAN_KEYS keys at least; 1, none. */
static int top_k_spans(size_t blocks, int nk, int fill_blocks) {
    size_t want = (size_t)fill_blocks / blocks;
    size_t most = ((size_t)nk + FG_CUDA_MIN_SPAN_KEYS - 1) / FG_CUDA_MIN_SPAN_KEYS;
    return (int)(want < 1 ? 1 : want < most ? want : most);
}

/* Attention of a step's queries on the device (decode, or prefill after cached tokens): where §5's
 * top-K applies (sparsity < 1 and a sequence's one query after its prompt, host_past and
 * host_pad saying which) attention_kernel, a block a query, since the choice needs all of a
 * query's weights (queue_attention_kernel; the split's spans score the keys first where
 * top_k_spans says); otherwise the split over keys (queue_split). Each in runs of the step's query
 * rows whose spans' sums, or scores, `partials` holds: span_slots of head_dim + 2 floats (the
 * workspace holds FG_CUDA_SPLIT_ROWS rows' heads' spans of max_len keys and a row's top-K scores),
 * so one run but for steps of more query rows (a prompt refilled beside decoding sequences) or
 * top-K scores of long contexts. fill_blocks: the blocks that fill the card. */
static void queue_attention(attention_split a, int batch, const int *host_past, const int *host_pad,
                            float sparsity, float *partials, size_t span_slots, int fill_blocks) {
    int nk = 1;    /* the keys a query sees at most */
    int top_k = 0; /* a query takes top-K */
    for (int b = 0; b < batch; b++) {
        int keys = host_past[b] + a.n_new - host_pad[b];
        nk = keys > nk ? keys : nk;
        top_k |= sparsity < 1 && a.n_new - host_pad[b] == 1 && host_past[b] > 0;
    }
    a.batch = batch;
    a.partials = partials;
    size_t top_k_blocks = (size_t)batch * a.n_new * row_head_blocks(a.heads, a.kv_heads);
    int spans = top_k ? top_k_spans(top_k_blocks, nk, fill_blocks) : 1;
    size_t fit = (size_t)batch * a.n_new; /* query rows a run: all of them, top-K's in shared */
    if (!top_k) fit = span_slots / ((size_t)a.heads * fg_cuda_attention_spans(nk));
    else if (spans > 1 || !top_k_in_shared(a.heads, a.kv_heads, a.hd, nk))
        fit = span_slots / fg_cuda_top_k_slots(a.heads, a.hd, nk);
    if (fit == 0) cuda_fail("queue_attention", __FILE__, __LINE__, "no room for a row's attention");
    int run_seqs;
    int run_rows;
    row_runs(batch, a.n_new, fit, &run_seqs, &run_rows);
    for (a.first_b = 0; a.first_b < batch; a.first_b += run_seqs)
        for (a.first_t = 0; a.first_t < a.n_new; a.first_t += run_rows) {
            int seqs = batch - a.first_b < run_seqs ? batch - a.first_b : run_seqs;
            int rows = a.n_new - a.first_t < run_rows ? a.n_new - a.first_t : run_rows;
            if (top_k) queue_attention_kernel(a, seqs, rows, nk, sparsity, spans);
            else queue_split(a, seqs, rows, nk, span_slots, fill_blocks);
        }
}

/* The runs of a step's query rows (batch sequences of n_new rows), `fit` rows a run at most: whole
 * sequences, run_seqs at a time, where a sequence's rows fit; else run_rows of a sequence's rows
 * at a time. */
static void row_runs(int batch, int n_new, size_t fit, int *run_seqs, int *run_rows) {
    *run_rows = fit < (size_t)n_new ? (int)fit : n_new;
    *run_seqs = 1;
    if (*run_rows == n_new) *run_seqs = fit / n_new < (size_t)batch ? (int)(fit / n_new) : batch;
}

/* The split over keys for a run of query rows (rows of seqs sequences, from a.first_b and
 * a.first_t), queries that see up to nk keys: attention_span_kernel's block a span of each query
 * (of up to GQA_HEADS query heads of a K/V head; attention_span_keys: long contexts, and few
 * queries, fill the card with blocks), then attention_merge_kernel: two launches. */
static void queue_split(attention_split a, int seqs, int rows, int nk, size_t span_slots,
                        int fill_blocks) {
    size_t queries = (size_t)seqs * rows;
    size_t blocks = queries * row_head_blocks(a.heads, a.kv_heads); /* a span's */
    a.span_keys = attention_span_keys(nk, queries * a.heads, blocks, span_slots, fill_blocks);
    a.spans = (nk + a.span_keys - 1) / a.span_keys;
    queue_spans(a, seqs, rows);
    dim3 run(a.heads, seqs, rows);
    attention_merge_kernel<<<run, MERGE_THREADS, 0, ctx()->stream>>>(a);
    LAUNCHED("attention_merge_kernel");
}

/* The split's spans (a.spans of a.span_keys keys) of a run's query rows, a block a span of up to
 * GQA_HEADS query heads of a K/V head: their sums, or top-K's scores (scores_in_workspace). */
static void queue_spans(attention_split a, int seqs, int rows) {
    cudaStream_t s = ctx()->stream;
    int group = a.heads / a.kv_heads; /* query heads on a K/V head */
    dim3 spans(row_head_blocks(a.heads, a.kv_heads) * a.spans, seqs, rows);
    if (group > 1 && a.q4) {
        attention_span_gqa_q4_kernel<<<spans, ATTENTION_THREADS, 0, s>>>(a);
        LAUNCHED("attention_span_gqa_q4_kernel");
    } else if (group > 1) {
        attention_span_gqa_kernel<<<spans, ATTENTION_THREADS, 0, s>>>(a);
        LAUNCHED("attention_span_gqa_kernel");
    } else if (a.q4) {
        attention_span_q4_kernel<<<spans, ATTENTION_THREADS, 0, s>>>(a);
        LAUNCHED("attention_span_q4_kernel");
    } else {
        attention_span_kernel<<<spans, ATTENTION_THREADS, 0, s>>>(a);
        LAUNCHED("attention_span_kernel");
    }
}

/* The query heads a block of attention_kernel takes: up to GQA_HEADS of one K/V head where query
 * heads share it (grouped-query attention), else one. */
__host__ __device__ int top_k_heads(int heads, int kv_heads) {
    int group = heads / kv_heads;
    return group < GQA_HEADS ? group : GQA_HEADS;
}

/* Whether a block of attention_kernel holds its queries (fp32, head_dim rounded up to 8) and its
 * heads' scores and lists of kept keys (fg_cuda_top_k_bytes a head) for queries of up to nk keys
 * in TOP_K_SHARED_BYTES of shared memory; where not, the scores and lists are in the workspace. */
static int top_k_in_shared(int heads, int kv_heads, int hd, int nk) {
    int nh = top_k_heads(heads, kv_heads);
    size_t queries = query_floats(nh, hd) * sizeof(float);
    return queries + (size_t)nh * fg_cuda_top_k_bytes(nk) <= TOP_K_SHARED_BYTES;
}

/* attention_kernel (attention_q4_kernel for a 4-bit cache; attention_gqa_kernel and
 * attention_gqa_q4_kernel where query heads share a K/V head): a block the query heads
 * top_k_heads gives of a query row of a run of query rows (rows of seqs sequences, from a.first_b
 * and a.first_t) that see up to nk keys, their scores in shared memory where top_k_in_shared, else
 * in a.partials (queue_attention sizes the run for them). With spans > 1 the split's span kernels
 * put the scores there first (scores_ready), each block a span of keys: two launches. */
static void queue_attention_kernel(attention_split a, int seqs, int rows, int nk, float sparsity,
                                   int spans) {
    cudaStream_t s = ctx()->stream;
    int nh = top_k_heads(a.heads, a.kv_heads);
    dim3 queries(row_head_blocks(a.heads, a.kv_heads), seqs, rows);
    size_t shared = query_floats(nh, a.hd) * sizeof(float); /* the queries */
    a.scores_apart = fg_cuda_top_k_bytes(nk) / sizeof(float);
    a.scores_in_workspace = spans > 1 || !top_k_in_shared(a.heads, a.kv_heads, a.hd, nk);
    if (!a.scores_in_workspace) shared += nh * fg_cuda_top_k_bytes(nk);
    if (spans > 1) {
        a.span_keys = ((nk + spans - 1) / spans + 31) / 32 * 32;
        a.spans = (nk + a.span_keys - 1) / a.span_keys;
        queue_spans(a, seqs, rows);
        a.scores_ready = 1;
    }
    if (nh > 1 && a.q4) {
        attention_gqa_q4_kernel<<<queries, ATTENTION_THREADS, shared, s>>>(a, sparsity);
        LAUNCHED("attention_gqa_q4_kernel");
    } else if (nh > 1) {
        attention_gqa_kernel<<<queries, ATTENTION_THREADS, shared, s>>>(a, sparsity);
        LAUNCHED("attention_gqa_kernel");
    } else if (a.q4) {
        attention_q4_kernel<<<queries, ATTENTION_THREADS, shared, s>>>(a, sparsity);
        LAUNCHED("attention_q4_kernel");
    } else {
        attention_kernel<<<queries, ATTENTION_THREADS, shared, s>>>(a, sparsity);
        LAUNCHED("attention_kernel");
    }
}

/* Sequence b's keys (kv 0) or values (kv 1) of K/V head `head`, as a query of step `a` reads them:
 * the cache's rows through the page tables ([K, V][batch][max_pages]), and this step's rows of
 * qkv from the sequence's first, b n_new + pad[b], on. */
__device__ kv_head kv_head_of(const attention_split *a, int kv, int b, int head) {
    size_t first = (size_t)b * a->n_new + a->pad[b];
    kv_head h = {.cache = (const char *)(kv ? a->vc[b] : a->kc[b]) + a->shift[kv],
                 .pages = a->pages + ((size_t)kv * a->batch + b) * a->max_pages,
                 .page_tokens = a->page_tokens,
                 .fresh = a->qkv + a->at.at[1 + kv] + first * a->at.stride[1 + kv],
                 .stride = a->at.stride[1 + kv],
                 .past = a->past[b],
                 .head = head,
                 .hd = a->hd,
                 .heads = a->kv_heads};
    return h;
}

/* Attention of a query row (sequence first_b + y, row first_t + z of the run) for the block's
 * query heads (blockIdx.x: head_blocks of each K/V head in turn, HEADS query heads of it a block;
 * HEADS 1: a block a query head) over the keys it sees: [0, its slot]. softmax(scale q.K) V, with
 * §5's top-K in decode (a sequence's one query after its prompt; sparsity < 1): the new token plus
 * the floor(sparsity (nk - 1)) earlier keys of largest weight (ties to the earlier), weights not
 * renormalized, as opt_attend_decode (cuda_kernels.h's keep_largest lists them, a head at a time),
 * and only their rows of V read, as §5 loads them. The choice needs all of a query's weights, so
 * this kernel keeps one block a query row; steps without top-K take the split over keys below
 * (queue_attention). Grouped-query attention: heads / kv_heads query heads in a row share a K/V
 * head, and a block of several loads each K row once for them all (their kept V rows differ).
 * Shared (dynamic): the queries, then each head's scores and list of kept keys (in the
 * workspace where top_k_in_shared says they do not fit), scores_apart floats a head; and each
 * group's share of the output. CPU twin: opt_model.c's attention (opt_attend_decode in decode).
 * Tests: test_attention within its bound (scores in the workspace for 7,000 keys),
 * test_attention_ties (the same keys kept over exact ties, and only their V rows loaded),
 * test_top_k_select (keep_largest alone) and test_gqa_attention (grouped heads, bit for bit
 * against repeated ones, and the K rows each loaded once a block). attention_kernel takes an fp16
 * cache, attention_q4_kernel a 4-bit one; attention_gqa_kernel and attention_gqa_q4_kernel up to
 * GQA_HEADS query heads of a K/V head. */
template <int Q4, int HEADS> __device__ void attend_query(attention_split a, float sparsity) {
    extern __shared__ float dynamic[]; /* the queries, then the heads' scores and lists */
    __shared__ float shared[32];
    __shared__ float partial[ATTENTION_THREADS * 8];
    __shared__ top_k_select selection;
    int kvh;
    int nh;
    int head = block_heads<HEADS>(a.heads, a.kv_heads, blockIdx.x, &kvh, &nh);
    int b = a.first_b + blockIdx.y;
    int t = a.first_t + blockIdx.z;
    size_t run_row = (size_t)blockIdx.y * gridDim.z + blockIdx.z;
    int hd = a.hd;
    if (!a.kc[b]) return; /* delegated */
    int slot = a.past[b] + t - a.pad[b];
    int nk = slot + 1;
    int decode = a.n_new - a.pad[b] == 1 && a.past[b] > 0;
    size_t row = (size_t)b * a.n_new + t;
    __half *out = a.attn + row * a.heads * hd + (size_t)head * hd;
    if (t < a.pad[b]) { /* a padding query: zeros, as on the CPU */
        for (int d = threadIdx.x; d < nh * hd; d += blockDim.x) out[d] = __float2half_rn(0);
        return;
    }
    float *query = dynamic;
    float *scores = query + query_floats(top_k_heads(a.heads, a.kv_heads), hd);
    size_t apart = a.scores_apart; /* a head's scores and list */
    if (a.scores_in_workspace) scores = a.partials + (run_row * a.heads + head) * apart;
    const __half *q = a.qkv + a.at.at[0] + row * a.at.stride[0] + (size_t)head * hd;
    kv_head keys = kv_head_of(&a, 0, b, kvh);
    kv_head values = kv_head_of(&a, 1, b, kvh);
    if (!a.scores_ready) { /* else the split's spans scored the keys (span_sums) */
        query_to_shared(q, nh, hd, query);
        __syncthreads();
        attention_scores<Q4, HEADS>(query, nh, &keys, 0, nk, a.scale, scores, (int)apart);
    }
    __syncthreads();
    int top_k = decode && sparsity < 1;
    int keep = top_k ? (int)floorf(sparsity * (float)(nk - 1)) : nk - 1; /* earlier keys kept */
    for (int h = 0; h < nh; h++) { /* a head's weights, kept keys, and their rows of V alone */
        float *weights = scores + h * apart;
        int *kept = (int *)(weights + (nk + 3) / 4 * 4); /* after whole 16-byte groups of scores */
        softmax(weights, nk, shared);
        if (top_k) { /* the new token after the earlier keys; keep_largest's barriers publish it */
            if (threadIdx.x == 0) kept[keep] = nk - 1;
            keep_largest(weights, nk - 1, keep, kept, &selection);
        }
        attention_values<Q4, 1>(weights, 0, top_k ? kept : NULL, 1, &values, 0, keep + 1, partial,
                                out + h * hd, NULL, 0);
    }
}

__global__ void attention_kernel(attention_split a, float sparsity) {
    attend_query<0, 1>(a, sparsity);
}

__global__ void attention_q4_kernel(attention_split a, float sparsity) {
    attend_query<1, 1>(a, sparsity);
}

__global__ void __launch_bounds__(ATTENTION_THREADS, 2)
    attention_gqa_kernel(attention_split a, float sparsity) {
    attend_query<0, GQA_HEADS>(a, sparsity);
}

__global__ void __launch_bounds__(ATTENTION_THREADS, 2)
    attention_gqa_q4_kernel(attention_split a, float sparsity) {
    attend_query<1, GQA_HEADS>(a, sparsity);
}

/* A span's sums of a block's queries (the split over keys of flash-decoding: the keys of a query
 * cut into spans, each a block, whose partial softmax sums a second pass merges). Block (head
 * block x spans + span, sequence first_b + y, row first_t + z of the run) takes up to HEADS query
 * heads of one K/V head (the head_blocks of each K/V head in turn; HEADS 1: a block a query head),
 * each a query of row t, and keys [span span_keys, + span_keys) of those the query sees, [0, its
 * slot], as attention_kernel reads them, each key's and value's row loaded once for all its heads:
 * a query's scores s_j = scale q.K_j, their max m, l = sum_j e^(s_j - m) and sum_j e^(s_j - m) V_j
 * in fp32, into the span's partials. Padding queries, spans past a query's keys and delegated
 * sequences write nothing (the merge reads only the spans a query has). With top-K
 * (scores_in_workspace) a span's scores alone, into the workspace for attention_kernel. CPU twin:
 * opt_model.c's attention (opt_attend_decode in decode), with attention_merge_kernel. Tests:
 * test_attention (cases of two and more spans, a short last span, fp16 and 4-bit cache, padding, a
 * delegated sequence, runs of a row) within its bound, and test_gqa_attention (grouped heads,
 * GQA_HEADS at a time and fewer, bit for bit against repeated ones). attention_span_kernel takes an
 * fp16 cache, attention_span_q4_kernel a 4-bit one; attention_span_gqa_kernel and
 * attention_span_gqa_q4_kernel take GQA_HEADS query heads at a time. */
template <int Q4, int HEADS> __device__ void span_sums(attention_split a) {
    __shared__ float weights[HEADS * FG_CUDA_SPAN_KEYS];
    __shared__ float shared[32];
    __shared__ float query[HEADS * MAX_HEAD_DIM];
    __shared__ float partial[ATTENTION_THREADS * 8];
    int span = blockIdx.x % a.spans;
    int kvh;
    int nh;
    int head = block_heads<HEADS>(a.heads, a.kv_heads, blockIdx.x / a.spans, &kvh, &nh);
    int b = a.first_b + blockIdx.y;
    int t = a.first_t + blockIdx.z;
    size_t run_row = (size_t)blockIdx.y * gridDim.z + blockIdx.z;
    int hd = a.hd;
    int first = span * a.span_keys;
    if (!a.kc[b] || t < a.pad[b]) return; /* delegated; padding (the merge writes its zeros) */
    int nk = a.past[b] + t - a.pad[b] + 1;
    int n = nk - first < a.span_keys ? nk - first : a.span_keys;
    if (n <= 0) return; /* past the query's keys */
    size_t row = (size_t)b * a.n_new + t;
    const __half *q = a.qkv + a.at.at[0] + row * a.at.stride[0] + (size_t)head * hd;
    kv_head keys = kv_head_of(&a, 0, b, kvh);
    kv_head values = kv_head_of(&a, 1, b, kvh);
    float *sums = a.partials + ((run_row * a.heads + head) * a.spans + span) * (hd + 2);
    size_t sums_apart = (size_t)a.spans * (hd + 2); /* the next head's */
    query_to_shared(q, nh, hd, query);
    __syncthreads();
    float *scores = weights;
    int apart = FG_CUDA_SPAN_KEYS;
    if (a.scores_in_workspace) { /* top-K's: the span's scores, where attention_kernel reads them */
        scores = a.partials + (run_row * a.heads + head) * a.scores_apart + first;
        apart = (int)a.scores_apart;
    }
    attention_scores<Q4, HEADS>(query, nh, &keys, first, n, a.scale, scores, apart);
    if (a.scores_in_workspace) return;
    __syncthreads();
    float m[HEADS];
    float l[HEADS];
    FG_UNROLL
    for (int h = 0; h < HEADS; h++) {
        if (h >= nh) break;
        float *w = weights + h * FG_CUDA_SPAN_KEYS;
        m[h] = -INFINITY;
        l[h] = 0;
        for (int j = threadIdx.x; j < n; j += blockDim.x) m[h] = fmaxf(m[h], w[j]);
        m[h] = block_max(m[h], shared);
        for (int j = threadIdx.x; j < n; j += blockDim.x) l[h] += w[j] = expf(w[j] - m[h]);
        l[h] = block_sum(l[h], shared); /* its barriers publish the weights */
    }
    attention_values<Q4, HEADS>(weights, FG_CUDA_SPAN_KEYS, NULL, nh, &values, first, n, partial,
                                NULL, sums, sums_apart);
    if (threadIdx.x == 0) {
        FG_UNROLL
        for (int h = 0; h < HEADS; h++) {
            if (h >= nh) break;
            sums[h * sums_apart + hd] = m[h];
            sums[h * sums_apart + hd + 1] = l[h];
        }
    }
}

__global__ void attention_span_kernel(attention_split a) { span_sums<0, 1>(a); }

__global__ void attention_span_q4_kernel(attention_split a) { span_sums<1, 1>(a); }

/* Two blocks a multiprocessor at least (no more than 128 registers: 156 without the bound, and
 * one block, for the 4-bit form; no spills). */
__global__ void __launch_bounds__(ATTENTION_THREADS, 2)
    attention_span_gqa_kernel(attention_split a) {
    span_sums<0, GQA_HEADS>(a);
}

__global__ void __launch_bounds__(ATTENTION_THREADS, 2)
    attention_span_gqa_q4_kernel(attention_split a) {
    span_sums<1, GQA_HEADS>(a);
}

/* The second pass of the split: a block per (head, sequence, row) of the run merges the spans of
 * a query, M = max_s m_s, out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s (in span order,
 * so the result does not depend on which block ran first), rounded to fp16 into attn; a padding
 * query's row is zeros, as on the CPU, and a delegated sequence's is left as it is. CPU twin:
 * opt_model.c's attention (opt_attend_decode in decode), with attention_span_kernel. Test:
 * test_attention (a merge that reads only the first span fails its cases of two and more spans;
 * runs of a row). */
__global__ void attention_merge_kernel(attention_split a) {
    int head = blockIdx.x;
    int b = a.first_b + blockIdx.y;
    int t = a.first_t + blockIdx.z;
    size_t run_row = (size_t)blockIdx.y * gridDim.z + blockIdx.z;
    int hd = a.hd;
    if (!a.kc[b]) return; /* delegated */
    size_t row = (size_t)b * a.n_new + t;
    __half *out = a.attn + row * a.heads * hd + (size_t)head * hd;
    if (t < a.pad[b]) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) out[d] = __float2half_rn(0);
        return;
    }
    int nk = a.past[b] + t - a.pad[b] + 1;
    int used = (nk + a.span_keys - 1) / a.span_keys;
    const float *sums = a.partials + (run_row * a.heads + head) * a.spans * (hd + 2);
    float M = -INFINITY;
    float L = 0;
    for (int s = 0; s < used; s++) M = fmaxf(M, sums[(size_t)s * (hd + 2) + hd]);
    for (int s = 0; s < used; s++) {
        const float *span = sums + (size_t)s * (hd + 2);
        L += expf(span[hd] - M) * span[hd + 1];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float total = 0;
        for (int s = 0; s < used; s++) {
            const float *span = sums + (size_t)s * (hd + 2);
            total += expf(span[hd] - M) * span[d];
        }
        out[d] = __float2half_rn(total / L);
    }
}

/* ---- delegated attention: a cache in host memory (§4.2) ---- */

/* Delegated sequences (cache in host memory, §4.2): their q, k, v rows to the host (fp16, widened
 * there, in the layout the CPU gives that many rows), the CPU backend's store and attention, the
 * result back rounded to fp16. Runs of such sequences at a time. */
static void delegated_attention(cuda_ws *d, const model_config *c, gpu_batch *gb,
                                const model_workspace *ws) {
    size_t n = gb->n_new;
    size_t qw = q_width(c);
    size_t width = qkv_width(c);
    qkv_layout at = qkv_layout_of(c, (size_t)gb->batch * n);
    host_rows_ready(d, c, (size_t)gb->batch * n, ws->max_len);
    int b1 = 0; /* the end of the run that begins at b0 */
    for (int b0 = 0; b0 < gb->batch; b0 = b1) {
        for (b1 = b0; b1 < gb->batch && gb->kv_in_host[b1] == gb->kv_in_host[b0]; b1++) {}
        if (!gb->kv_in_host[b0]) continue;
        size_t first = (size_t)b0 * n;
        size_t count = (size_t)(b1 - b0) * n;
        if (at.stride[0] == width) /* rows of q, k and v together (OPT) */
            cuda_copy_out(d->host16, d->qkv + first * width, count * width * sizeof(fp16));
        else /* q, then k, then v, each its own block */
            for (int i = 0, o = 0; i < 3; o += (int)(count * at.stride[i]), i++)
                cuda_copy_out(d->host16 + o, d->qkv + at.at[i] + first * at.stride[i],
                              count * at.stride[i] * sizeof(fp16));
        cuda_copies_done(); /* the rows are on the host (and the last run's copy in has left) */
        model_workspace host = d->host;
        fp16_to_fp32_n(d->host16, host.qkv, count * width);
        gpu_batch part = gpu_batch_slice(gb, b0, b1 - b0, c->hidden * sizeof(__half));
        opt_cache_attention(c, &part, &host);
        fp32_to_fp16_n(host.attn, d->host16, count * qw);
        cuda_copy_in(d->attn + first * qw, d->host16, count * qw * sizeof(fp16));
    }
}

/* ---- the output: the last rows, lm_head ---- */

/* Into d->h: the last row of each sequence of x, or every row with all_rows; their count. */
static int last_rows(cuda_ws *d, const gpu_batch *gb, int h) {
    int rows = gb->all_rows ? gb->batch * gb->n_new : gb->batch;
    const __half *x = (const __half *)gb->x;
    size_t row = h * sizeof(__half);
    if (gb->all_rows) queue_copy(d->h, x, (size_t)rows * row, ON_DEVICE);
    else
        queue_copy_rows(d->h, row, x + (size_t)(gb->n_new - 1) * h, (size_t)gb->n_new * row, row,
                        rows, ON_DEVICE);
    return rows;
}

/* logits[rows][vocab] = x lm_head^T: lm_head is [vocab][word_dim], fp16 or 4-bit (from the codes
 * for decode's rows, widened for more); fp16 inputs, fp32 logits. */
static void lm_head(cuda_ws *d, const model_weights *w, const __half *x, int rows, float *logits) {
    const model_config *c = &w->cfg;
    if (w->q4 && rows <= Q4_DIRECT_ROWS) {
        const uint8_t *E = (const uint8_t *)w->lm_head;
        int copy_bytes = ((uintptr_t)E | (size_t)c->word_dim) % 16 == 0 ? 16 : 1;
        unsigned groups = blocks_for((size_t)c->vocab, Q4_GROUP);
        if (rows <= 16) {
            q4_vocab_kernel<<<groups, 32 * Q4_WARPS, Q4_SHARED_BYTES(1), ctx()->stream>>>(
                x, rows, c->word_dim, E, c->vocab, copy_bytes, logits);
            LAUNCHED("q4_vocab_kernel");
        } else {
            q4_vocab32_kernel<<<groups, 32 * Q4_WARPS, Q4_SHARED_BYTES(2), ctx()->stream>>>(
                x, rows, c->word_dim, E, c->vocab, copy_bytes, logits);
            LAUNCHED("q4_vocab32_kernel");
        }
        return;
    }
    if (w->q4) {
        widened_lm_head(d, x, rows, c->word_dim, w->lm_head, c->vocab, logits);
        return;
    }
    fp16_product(d, CUBLAS_OP_T, c->vocab, rows, c->word_dim, w->lm_head, x, 0, logits, CUDA_R_32F);
}

/* logits[r][v] = sum_i x[r][i] E[v][i], for r < rows <= 16 M_TILES, a 4-bit table E [vocab][dim]
 * as quant.c stores an embedding (outer 1, len vocab, inner dim): byte (32 g + p) dim + i holds
 * column i of rows 64 g + 2p (high half) and 64 g + 2p + 1 (low half), and the groups' mins and
 * scales follow, [G][dim] each. On the tensor cores, as q4_rows: a block a group of 64 rows of E,
 * its warps the group's steps of 16 columns in turn through their rings (q4_ring, q4_vocab_copy);
 * byte row 8 j + gid's high halves are product 2 j's column gid, its low halves product 2 j + 1's
 * (q4_vocab_multiply); the warps' sums meet in shared memory in a fixed order (q4_sums_out). Up
 * to 16 rows of x (q4_vocab_kernel) or 32 (q4_vocab32_kernel). CPU twin: lm_head's product by
 * q4_decompress's values rounded to fp16. Test: test_q4_lm_head, within its bound of that product
 * in double, both copy_bytes. */
template <int M_TILES> __device__ void q4_vocab(const __half *x, int rows, int dim,
                                                const uint8_t *E, int vocab, int copy_bytes,
                                                float *logits) {
    extern __shared__ q4_stage stages[]; /* [Q4_WARPS][Q4_STAGES], then the warps' sums */
    size_t G = (size_t)(vocab + Q4_GROUP - 1) / Q4_GROUP;
    size_t g = blockIdx.x;
    const uint8_t *codes = E + g * (Q4_GROUP / 2) * dim;
    const __half *mins = (const __half *)(E + G * (Q4_GROUP / 2) * dim) + g * dim;
    const __half *scales = mins + G * dim;
    float acc[M_TILES][8][4] = {};
    auto copy = [&](q4_stage *stage, int k0) {
        q4_vocab_copy(stage, codes, mins, scales, dim, k0, copy_bytes);
    };
    auto multiply = [&](const q4_stage *stage, int k0) {
        q4_vocab_multiply<M_TILES>(stage, x, rows, dim, k0, acc);
    };
    q4_ring(stages, 0, dim, copy, multiply);
    q4_sums_out<M_TILES, 1>(acc, stages, rows, vocab - (int)g * Q4_GROUP, vocab,
                            logits + g * Q4_GROUP);
}

__global__ void q4_vocab_kernel(const __half *x, int rows, int dim, const uint8_t *E, int vocab,
                                int copy_bytes, float *logits) {
    q4_vocab<1>(x, rows, dim, E, vocab, copy_bytes, logits);
}

__global__ void q4_vocab32_kernel(const __half *x, int rows, int dim, const uint8_t *E, int vocab,
                                  int copy_bytes, float *logits) {
    q4_vocab<2>(x, rows, dim, E, vocab, copy_bytes, logits);
}

/* logits[rows][vocab] = x[rows][dim] E^T, slices of rows of E. */
static void widened_lm_head(cuda_ws *d, const __half *x, int rows, int dim, const void *E,
                            int vocab, float *logits) {
    int slice = (int)(d->widen_values / (size_t)dim);
    float one = 1;
    float zero = 0;
    if (slice < 1)
        cuda_fail("widened_lm_head", __FILE__, __LINE__, "a row of lm_head past the slice");
    for (int v0 = 0; v0 < vocab; v0 += slice) {
        int n = vocab - v0 < slice ? vocab - v0 : slice;
        widen_slice(d, E, (size_t)vocab, (size_t)dim, (size_t)v0 * dim, (size_t)dim, (size_t)n,
                    (size_t)dim);
        BLAS_PRODUCT(cublasGemmEx(blas(), CUBLAS_OP_T, CUBLAS_OP_N, n, rows, dim, &one,
                                  d->q4_scratch, CUDA_R_16F, dim, x, CUDA_R_16F, dim, &zero,
                                  logits + v0, CUDA_R_32F, vocab, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
    }
}

/* ---- the LLaMA family's kernels: RMSNorm, RoPE, SwiGLU ---- */

static void rms_norm(const __half *x, int rows, int dim, const fp16 *w, float eps, __half *y) {
    rms_norm_kernel<<<rows, 256, 0, ctx()->stream>>>(x, dim, (const __half *)w, eps, y);
    LAUNCHED("rms_norm_kernel");
}

/* y = x / sqrt(mean(x^2) + eps) * w (HF's LlamaRMSNorm), a block per row; y may alias x. CPU
 * twin: llama_model.c's rms_norm. Test: test_rms_norm, within its bound of RMSNorm in double. */
__global__ void rms_norm_kernel(const __half *x, int dim, const __half *w, float eps, __half *y) {
    __shared__ float shared[32];
    const __half *xr = x + (size_t)blockIdx.x * dim;
    __half *yr = y + (size_t)blockIdx.x * dim;
    float s = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        s += __half2float(xr[i]) * __half2float(xr[i]);
    float inv = 1.0f / sqrtf(block_sum(s, shared) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = __float2half_rn(__half2float(w[i]) * (__half2float(xr[i]) * inv));
}

/* RoPE in HF's layout (pair i: dimensions i and i + hd/2 of a head) on the q heads and the k
 * heads of each row at its position (its cache slot; padding rows too, unread): a block per row.
 * CPU twin: llama_model.c's rope. Test: test_rope, within its bound of HF's rotation in double. */
__global__ void rope_kernel(__half *qkv, qkv_layout at, int n_new, const int *past, const int *pad,
                            int hd, int heads, int kv_heads, rope_freqs freqs) {
    int r = blockIdx.x;
    int b = r / n_new;
    int half = hd / 2;
    float pos = (float)(past[b] + r % n_new - pad[b]);
    for (int i = threadIdx.x; i < (heads + kv_heads) * half; i += blockDim.x) {
        int head = i / half;
        int p = i % half;
        int is_k = head >= heads;
        __half *v =
            qkv + at.at[is_k] + (size_t)r * at.stride[is_k] + (size_t)(head - is_k * heads) * hd;
        float angle = pos * freqs.f[p];
        float cosine = cosf(angle);
        float sine = sinf(angle);
        float a = __half2float(v[p]);
        float c = __half2float(v[p + half]);
        v[p] = __float2half_rn(a * cosine - c * sine);
        v[p + half] = __float2half_rn(c * cosine + a * sine);
    }
}

/* gate = silu(gate) * up, elementwise. CPU twin: llama_model.c's swiglu. Test: test_swiglu,
 * within its bound of silu(g) u in double. */
__global__ void swiglu_kernel(__half *gate, const __half *up, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = __half2float(gate[i]);
    gate[i] = __float2half_rn(g / (1.0f + expf(-g)) * __half2float(up[i]));
}
