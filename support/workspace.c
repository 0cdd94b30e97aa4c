/* support/workspace.c: the buffers the forward pass works in: a GPU batch's small arrays, the
 * CPU backend's workspace (model_workspace), and the sizes of the CUDA backend's, which the plan
 * check and the cost model's memory model count without a GPU.
 */
#include "support/support.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

static void *alloc_floats(size_t n) { return aligned_alloc(64, (n * 4 + 63) & ~(size_t)63); }

int gpu_batch_init(gpu_batch *gb, int batch, int max_len, int max_new, char *err) {
    memset(gb, 0, sizeof *gb);
    gb->batch = batch;
    gb->max_len = max_len;
    gb->page_tokens = FG_PAGE_TOKENS;
    gb->past = calloc((size_t)batch, sizeof *gb->past);
    gb->pad = calloc((size_t)batch, sizeof *gb->pad);
    gb->tokens = calloc((size_t)batch * max_new, sizeof *gb->tokens);
    gb->k = calloc((size_t)batch, sizeof *gb->k);
    gb->v = calloc((size_t)batch, sizeof *gb->v);
    gb->k_pages = calloc((size_t)batch, sizeof *gb->k_pages);
    gb->v_pages = calloc((size_t)batch, sizeof *gb->v_pages);
    gb->v_rows_read = calloc((size_t)batch, sizeof *gb->v_rows_read);
    gb->kv_in_host = calloc((size_t)batch, 1);
    gb->attn_sparsity = 1;
    if (!gb->past || !gb->pad || !gb->tokens || !gb->k || !gb->v || !gb->k_pages || !gb->v_pages ||
        !gb->v_rows_read || !gb->kv_in_host) {
        gpu_batch_free(gb);
        return fg_fail(err, "out of memory for a GPU batch of %d", batch);
    }
    return 0;
}

/* Sequences [first, first + n) of a GPU batch, as a GPU batch of their own: each per-sequence
 * array starts at sequence `first`, and x at its first row (act_row bytes a row). What every
 * sequence shares (max_len, page_tokens, n_new, all_rows, kv_q4, attn_sparsity) is the batch's.
 * The runtime cuts prefill into chunks with it (flexgen.c), and the CUDA backend the sequences
 * whose attention runs on the CPU (flexgen.cu); tests/test_runtime.c holds every field of
 * gpu_batch to being sliced here or named as shared. */
gpu_batch gpu_batch_slice(const gpu_batch *gb, int first, int n, size_t act_row) {
    gpu_batch s = *gb;
    s.batch = n;
    s.past = gb->past + first;
    s.pad = gb->pad + first;
    s.tokens = gb->tokens + (size_t)first * gb->n_new;
    s.x = (char *)gb->x + (size_t)first * gb->n_new * act_row;
    s.k = gb->k + first;
    s.v = gb->v + first;
    s.k_pages = gb->k_pages + first;
    s.v_pages = gb->v_pages + first;
    s.v_rows_read = gb->v_rows_read + first;
    s.kv_in_host = gb->kv_in_host + first;
    return s;
}

void gpu_batch_free(gpu_batch *gb) {
    free(gb->past);
    free(gb->pad);
    free(gb->tokens);
    free(gb->k);
    free(gb->v);
    free(gb->k_pages);
    free(gb->v_pages);
    free(gb->v_rows_read);
    free(gb->kv_in_host);
    memset(gb, 0, sizeof *gb);
}

void gpu_batch_advance(gpu_batch *gb) {
    for (int b = 0; b < gb->batch; b++) {
        gb->past[b] += gb->n_new - gb->pad[b];
        gb->pad[b] = 0; /* pad <= n_new */
    }
    gb->n_new = 1;
}

/* Per-thread scratch of attention: K and V slices and the scores of one (sequence, head), and
 * what decode needs besides (opt_attend_decode's scratch); or a block of rows of the
 * embedding table (matmul_embed_t's scratch). */
static size_t thread_floats(const model_config *cfg, int max_len) {
    size_t hd = (size_t)cfg_head_dim(cfg), n = (size_t)max_len;
    size_t attention = 2 * n * hd + n * n + 3 * n + hd,
           row = (size_t)MATMUL_EMBED_BLOCK * cfg->word_dim;
    return ((attention > row ? attention : row) + 15) & ~(size_t)15;
}

/* matmul_weights' scratch, when the workspace serves products of more rows than decode's: the
 * most any of the model's weight matrices [in][out] asks for. */
static size_t wide_floats(const model_config *cfg, size_t rows) {
    if (rows <= MATMUL_DECODE_ROWS) return 0;
    int h = cfg->hidden, f = cfg->ffn, wd = cfg->word_dim, q = q_width(cfg), kv = kv_width(cfg);
    const int shapes[][2] = {{h, 3 * h}, {h, h}, {h, f},  {f, h}, {wd, h},
                             {h, wd},    {h, q}, {h, kv}, {q, h}};
    size_t most = 0;
    for (int i = 0; i < 9; i++) {
        size_t n = matmul_scratch_floats(shapes[i][0], shapes[i][1]);
        most = n > most ? n : most;
    }
    return most;
}

/* The widest vector of a layer (a bias, or a norm's weight and bias side by side). */
static size_t most(size_t a, size_t b) { return a > b ? a : b; }
static size_t vec_floats(const model_config *cfg) {
    size_t h = cfg->hidden,
           n = most(most(3 * h, (size_t)cfg->ffn), (size_t)(q_width(cfg) + 2 * kv_width(cfg)));
    return 2 * most(n, (size_t)cfg->word_dim);
}

/* A token row's floats in h, qkv, attn and ffn (model.h's model_workspace). h holds the words'
 * embeddings before project_in, qkv project_out's rows: word_dim may exceed hidden (and q + 2 kv)
 * in a checkpoint. */
static size_t h_floats(const model_config *c) {
    return most((size_t)c->hidden, (size_t)c->word_dim);
}
static size_t qkv_floats(const model_config *c) {
    return most((size_t)q_width(c) + 2 * (size_t)kv_width(c), (size_t)c->word_dim);
}
static size_t attn_floats(const model_config *c) {
    return most((size_t)q_width(c), (size_t)c->hidden);
}
static size_t ffn_floats(const model_config *c) {
    return c->family == FAMILY_LLAMA ? 2 * (size_t)c->ffn : most((size_t)c->ffn, (size_t)c->hidden);
}

size_t model_workspace_bytes(const model_config *cfg, size_t rows, int max_prompt, int max_len) {
    (void)max_prompt;
    size_t row = h_floats(cfg) + qkv_floats(cfg) + attn_floats(cfg) + ffn_floats(cfg);
    return 4 * (rows * row + thread_floats(cfg, max_len) * omp_get_max_threads() +
                wide_floats(cfg, rows) + vec_floats(cfg));
}

int model_workspace_init(model_workspace *ws, const model_config *cfg, size_t rows, int max_prompt,
                         int max_len, char *err) {
    (void)max_prompt;
    memset(ws, 0, sizeof *ws);
    ws->rows = rows;
    ws->max_len = max_len;
    ws->n_threads = omp_get_max_threads();
    ws->thread_floats = thread_floats(cfg, max_len);
    ws->h = alloc_floats(rows * h_floats(cfg));
    ws->qkv = alloc_floats(rows * qkv_floats(cfg));
    ws->attn = alloc_floats(rows * attn_floats(cfg));
    ws->ffn = alloc_floats(rows * ffn_floats(cfg));
    ws->thread_scratch = alloc_floats(ws->thread_floats * ws->n_threads);
    ws->wide = wide_floats(cfg, rows) ? alloc_floats(wide_floats(cfg, rows)) : NULL;
    ws->vec = alloc_floats(vec_floats(cfg));
    if (!ws->h || !ws->qkv || !ws->attn || !ws->ffn || !ws->thread_scratch || !ws->vec ||
        (wide_floats(cfg, rows) && !ws->wide)) {
        model_workspace_free(ws);
        return fg_fail(err, "gpu tier: cannot allocate the workspace for %zu token rows", rows);
    }
    return 0;
}

void model_workspace_free(model_workspace *ws) {
    free(ws->h);
    free(ws->qkv);
    free(ws->attn);
    free(ws->ffn);
    free(ws->thread_scratch);
    free(ws->wide);
    free(ws->vec);
    free(ws->x32);
    memset(ws, 0, sizeof *ws);
}

size_t fg_cuda_token_table_bytes(size_t rows) { return (2 * rows + rows) * sizeof(int); }

size_t fg_cuda_cache_table_bytes(size_t rows, int max_pages) {
    return 2 * rows * sizeof(int) + 2 * rows * sizeof(void *) +
           2 * rows * (size_t)max_pages * sizeof(int);
}

/* The rows of W a block of flexgen.cu's q4_rows_kernel sums (a multiple of 64: its 4 warps take
 * 16 at a time) for `rows` rows of x. The block's 64 columns' partial sums (rows of 64 floats) are
 * written once and read once: halving the chunk doubles them, so it halves only while the
 * product has fewer than 1,024 blocks (the card fills) and the sums stay at most about a fifth of
 * the chunk's codes (a chunk of at least 64 rows of W for each row of x). */
int fg_cuda_q4_k_chunk(int in, int out, int rows) {
    int groups = (out + 63) / 64;
    int k_chunk = (in + 63) / 64 * 64;
    while (k_chunk / 2 >= 256 && k_chunk / 2 >= 64 * rows &&
           groups * ((in + k_chunk - 1) / k_chunk) < 1024)
        k_chunk = (k_chunk / 2 + 63) / 64 * 64;
    return k_chunk;
}

/* CUDA's scratch for 4-bit products, whichever is larger: the fp32 partial sums of decode's rows
 * over the largest product ([chunks][rows][out], at the rows of the most), or a slice of fp16
 * values widened for a product of more rows (FG_CUDA_WIDEN_VALUES, or FG_CUDA_WIDEN_COLUMNS of the
 * longest rows of W; at most the largest matrix). */
size_t fg_cuda_q4_scratch_bytes(const model_config *cfg) {
    size_t h = cfg->hidden, wd = cfg->word_dim, f = cfg->ffn, qw = q_width(cfg);
    size_t shapes[][2] = {{h, qkv_width(cfg)}, {qw, h}, {h, f}, {f, h}, {wd, h}, {h, wd}};
    size_t matrix = (size_t)cfg->vocab * wd;
    size_t slice = FG_CUDA_WIDEN_VALUES;
    size_t partials = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        size_t in = shapes[i][0];
        size_t out = shapes[i][1];
        for (int rows = 1; rows <= FG_CUDA_Q4_DIRECT; rows++) {
            size_t k_chunk = (size_t)fg_cuda_q4_k_chunk((int)in, (int)out, rows);
            size_t chunks = (in + k_chunk - 1) / k_chunk;
            size_t bytes = chunks * rows * out * sizeof(float);
            partials = bytes > partials ? bytes : partials;
        }
        matrix = in * out > matrix ? in * out : matrix;
        slice = in * FG_CUDA_WIDEN_COLUMNS > slice ? in * FG_CUDA_WIDEN_COLUMNS : slice;
    }
    size_t widened = 2 * (matrix < slice ? matrix : slice);
    return widened > partials ? widened : partials;
}

/* The most groups of 64 columns a 4-bit product has, parts' last groups included (q|k|v: 3 parts):
 * its counts of chunks done, one a group. */
size_t fg_cuda_q4_groups(const model_config *cfg) {
    size_t outs[] = {qkv_width(cfg), q_width(cfg), cfg->hidden, cfg->ffn, cfg->word_dim};
    size_t most_groups = 0;
    for (size_t i = 0; i < sizeof outs / sizeof *outs; i++) {
        size_t groups = (outs[i] + 63) / 64 + 2;
        most_groups = groups > most_groups ? groups : most_groups;
    }
    return most_groups;
}

size_t fg_cuda_span_slots(const model_config *cfg, size_t rows, int max_len) {
    size_t split_rows = rows < FG_CUDA_SPLIT_ROWS ? rows : FG_CUDA_SPLIT_ROWS;
    size_t slots = split_rows * (size_t)cfg->n_heads * (size_t)fg_cuda_attention_spans(max_len);
    size_t top_k = fg_cuda_top_k_slots(cfg->n_heads, cfg_head_dim(cfg), max_len); /* a row's */
    slots = top_k > slots ? top_k : slots;
    return slots > FG_CUDA_MIN_SPAN_SLOTS ? slots : FG_CUDA_MIN_SPAN_SLOTS;
}

/* The CUDA backend's workspace (flexgen.cu), fp16 but for prefill's scores: h [rows][max(hidden,
 * word_dim)]; qkv and attn, whose space ffn takes after them, [rows][max(q + 2 kv + q widths
 * (OPT: 4 hidden), ffn (LLaMA: 2 ffn, gate and up), word_dim (project_out's rows))]; one sequence's
 * prefill scores (fp32) and probabilities (fp16), [heads][max_prompt][max_prompt]; then what decode
 * attention's spans (fg_cuda_span_slots x (head_dim + 2) floats) and the 4-bit products' scratch
 * (fg_cuda_q4_scratch_bytes) need beyond them, since both lie over the prefill scores, which no
 * product and no attention after cached tokens uses; the token tables (then the 4-bit products'
 * counts of chunks done) and the cache tables, of
 * page tables of a cache of max_len. Here so that the cost model has it without CUDA. */
size_t fg_cuda_workspace_parts(const model_config *cfg, size_t rows, int max_prompt, int max_len,
                               size_t *sizes) {
    size_t h = cfg->hidden, wd = cfg->word_dim, M = (size_t)max_prompt, H = cfg->n_heads;
    size_t f = (size_t)cfg->ffn * (cfg->family == FAMILY_OPT ? 1 : 2); /* SwiGLU: gate and up */
    size_t qkv_attn = qkv_width(cfg) + (size_t)q_width(cfg);           /* OPT: 4 h */
    size_t mixed = most(most(qkv_attn, f), wd);
    int pages = kv_pages_for(max_len, FG_PAGE_TOKENS);
    /* each span: its sum of weights times values, its max and its sum of weights */
    size_t spans = 4 * fg_cuda_span_slots(cfg, rows, max_len) * ((size_t)cfg_head_dim(cfg) + 2);
    size_t q4_scratch = fg_cuda_q4_scratch_bytes(cfg);
    size_t over = spans > q4_scratch ? spans : q4_scratch;
    size_t prefill = ((4 * H * M * M + 63) & ~(size_t)63) + ((2 * H * M * M + 63) & ~(size_t)63);
    size_t parts[FG_CUDA_WS_PARTS] = {2 * rows * (h > wd ? h : wd),
                                      2 * rows * mixed,
                                      4 * H * M * M,
                                      2 * H * M * M,
                                      over > prefill ? over - prefill : 0,
                                      FG_CUDA_TOKEN_TABLES * fg_cuda_token_table_bytes(rows) +
                                          fg_cuda_q4_groups(cfg) * sizeof(unsigned),
                                      FG_CUDA_CACHE_TABLES *
                                          fg_cuda_cache_table_bytes(rows, pages)};
    size_t total = 0;
    for (int i = 0; i < FG_CUDA_WS_PARTS; i++) {
        parts[i] = (parts[i] + 63) & ~(size_t)63;
        total += parts[i];
        if (sizes) sizes[i] = parts[i];
    }
    return total;
}

size_t fg_cuda_workspace_bytes(const model_config *cfg, size_t rows, int max_prompt, int max_len) {
    return fg_cuda_workspace_parts(cfg, rows, max_prompt, max_len, NULL);
}

size_t fg_cuda_delegated_bytes(const model_config *cfg, size_t rows, int max_len) {
    return model_workspace_bytes(cfg, rows, 0, max_len) + 2 * rows * qkv_width(cfg);
}

/* A workspace's token rows: prefill computes a layer on chunks of at most FG_CHUNK_ROWS rows,
 * whole sequences of max_prompt each, at most a GPU batch. */
size_t fg_workspace_rows(int gbs, int max_prompt) {
    int chunk = FG_CHUNK_ROWS / max_prompt;
    chunk = chunk < 1 ? 1 : chunk < gbs ? chunk : gbs;
    return (size_t)chunk * (size_t)max_prompt;
}
