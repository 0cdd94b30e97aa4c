/* model.h: the model and its compute, as every layer of the code sees them: OPT's config and
 * weights (§3), a GPU batch and the workspace that compute reads, the forward pass of one GPU batch
 * (opt_model.c), 4-bit group-wise compression and top-K attention (quant.c, §5), the three tiers,
 * and the operation table of a compute device (the CPU's in app/cpu_backend.c, CUDA's in
 * flexgen.cu). flexgen.h builds the runtime on top of it. Nothing here knows of the runtime, so the
 * support layer's kernels, checkpoints and buffers (support/support.h) use these types and the
 * runtime uses them in turn.
 *
 * Conventions: a function that can fail on bad input returns 0, or -1 after writing one line
 * into `err` (FG_ERR_LEN bytes) that names the file, tensor, tier or flag and what is wrong.
 */
#ifndef FLEXGEN_MODEL_H
#define FLEXGEN_MODEL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define FG_PATH_LEN 4200 /* a path as the runtime keeps it, with room for a suffix */
/* An error line: room for two long paths (an output and the input it would overwrite, 900 bytes
 * each) and the words around them, so that the reason at its end is not cut off. */
#define FG_ERR_LEN 2048

/* OPT's special tokens; learned positions are looked up at position + 2. */
enum { OPT_PAD_ID = 1, OPT_BOS_ID = 2, OPT_EOS_ID = 2, OPT_POS_OFFSET = 2 };

typedef uint16_t fp16;      /* weights and the KV cache are stored in IEEE fp16; compute is fp32 */
float fp16_to_fp32(fp16 h); /* exact (support/util.c) */

/* ---- The model (§3) ---- */
/* The two families the forward pass knows: OPT (opt_model.c) and LLaMA (llama_model.c: LLaMA 1
 * to 3, Mistral, Qwen2). A backend has one forward table per family (fg_backend.forward). */
typedef enum { FAMILY_OPT, FAMILY_LLAMA, N_FAMILIES } model_family;
extern const char *const model_family_names[N_FAMILIES];
/* RoPE's frequencies: as trained; positions divided by factor (linear); LLaMA 3.1's bands. */
typedef enum { ROPE_DEFAULT, ROPE_LINEAR, ROPE_LLAMA3 } rope_kind;
#define FG_MAX_EOS 8

typedef struct {
    char name[64];
    int n_layers, hidden, n_heads, ffn, vocab; /* hidden is h1 in the paper, ffn h2 */
    int max_pos;  /* OPT: 2048, the position table has max_pos + 2 rows; LLaMA: RoPE's longest */
    int word_dim; /* word_embed_proj_dim: == hidden except for opt-350m (512) */
    int pre_ln;   /* do_layer_norm_before: 1 for all sizes but opt-350m, and for LLaMA */
    model_family family;
    /* LLaMA's (0 in OPT's table: n_kv_heads then is n_heads, head_dim hidden / n_heads) */
    int n_kv_heads, head_dim;       /* grouped-query attention: heads share a K and V head */
    int qkv_bias, o_bias, mlp_bias; /* attention_bias (q, k, v, o); Qwen2: q, k, v; mlp_bias */
    float rms_eps;
    struct {
        rope_kind kind;
        float theta, factor, low_freq, high_freq;
        int original_max_pos;
    } rope;
    int bos_id, n_eos, eos_ids[FG_MAX_EOS]; /* LLaMA's special tokens (OPT's: the enum above) */
    int window; /* Mistral's sliding_window: every sequence must fit in it; 0: none */
    int untied; /* lm_head.weight is a tensor of its own, not the embedding's */
} model_config;

/* The attention's shape: heads of head_dim; q is n_heads of them wide, K and V n_kv_heads. */
static inline int cfg_head_dim(const model_config *c) {
    return c->head_dim ? c->head_dim : c->hidden / c->n_heads;
}
static inline int cfg_kv_heads(const model_config *c) {
    return c->n_kv_heads ? c->n_kv_heads : c->n_heads;
}
static inline int q_width(const model_config *c) { return c->n_heads * cfg_head_dim(c); }
static inline int kv_width(const model_config *c) { return cfg_kv_heads(c) * cfg_head_dim(c); }
/* A token's q, k and v together. */
static inline size_t qkv_width(const model_config *c) {
    return (size_t)q_width(c) + 2 * (size_t)kv_width(c);
}

/* A decoder layer's weights as compute reads them: fp16, or 4-bit (§5) where model_weights.q4.
 * Linear weights are stored transposed, [in][out]. OPT's fields first, then LLaMA's. */
typedef struct {
    fp16 *attn_ln_w, *attn_ln_b; /* self_attn_layer_norm; LLaMA's input_layernorm (no bias) */
    fp16 *wqkv, *bqkv;           /* [hidden][3 * hidden]: q_proj, k_proj, v_proj side by side */
    fp16 *wo, *bo;               /* out_proj, [hidden][hidden]; LLaMA's o_proj [q_width][hidden] */
    fp16 *ffn_ln_w, *ffn_ln_b;   /* final_layer_norm (of the layer); LLaMA's
                                    post_attention_layernorm */
    fp16 *fc1_w, *fc1_b;         /* [hidden][ffn] */
    fp16 *fc2_w, *fc2_b;         /* [ffn][hidden] */
    fp16 *wq, *bq, *wk, *bk, *wv, *bv; /* LLaMA: [hidden][q_width], [hidden][kv_width] twice */
    fp16 *gate_w, *gate_b, *up_w, *up_b, *down_w, *down_b; /* LLaMA's MLP: [hidden][ffn] twice,
                                                              [ffn][hidden] */
} layer_weights;

typedef struct {
    model_config cfg;
    fp16 *embed_tokens;            /* [vocab][word_dim] */
    fp16 *embed_positions;         /* [max_pos + 2][hidden]; NULL for LLaMA (RoPE) */
    fp16 *project_in;              /* [word_dim][hidden], NULL when word_dim == hidden */
    fp16 *project_out;             /* [hidden][word_dim], NULL when word_dim == hidden */
    fp16 *final_ln_w, *final_ln_b; /* NULL when !pre_ln (350m); LLaMA's norm: no bias */
    fp16 *lm_head;                 /* [vocab][word_dim]; == embed_tokens when tied */
    layer_weights *layers;
    int q4, products; /* 4-bit matrices (§5, quant.c); the CPU's fg_products (support/support.h) */
    fp16 *storage;    /* one allocation all of the above point into, or NULL */
    size_t storage_values;
} model_weights;

/* A sequence's KV cache is pages of page_tokens tokens (vLLM's PagedAttention): token `slot` is row
 * kv_page_row(pages, page_tokens, slot), through its page table, or row `slot` (pages NULL: in
 * order). */
/* A page's tokens, unless a tier's pool needs fewer rows with whole sequences. */
#define FG_PAGE_TOKENS 16
/* flexgen.cu defines both for the device, which runs these functions too. */
#ifndef FG_HOST_DEVICE
#define FG_HOST_DEVICE
#define FG_HALF_TO_FLOAT(h) fp16_to_fp32(h)
#endif
static inline FG_HOST_DEVICE size_t kv_page_row(const int *pages, int page_tokens, int slot) {
    return pages ? (size_t)pages[slot / page_tokens] * page_tokens + (size_t)(slot % page_tokens)
                 : (size_t)slot;
}

/* One GPU batch (§4.1: the unit the schedule computes) for one layer: its sequences' hidden states
 * for the tokens in flight and, per sequence, where that layer's K and V cache rows are. A step's
 * rows are left-padded: sequence b's first pad[b] rows are padding, the rest its tokens, which go
 * to cache slots past[b] on. The cache holds no padding. */
typedef struct {
    int batch;                /* sequences */
    int max_len, page_tokens; /* KV capacity of a sequence in tokens (prompt + generated); of a
                                 page */
    int n_new;       /* rows in flight per sequence this step: the longest prompt at prefill, 1 in
                        decode */
    int all_rows;    /* the output layer gives the logits of every token in flight */
    int *past, *pad; /* [batch]: tokens already in the sequence's cache; its padding rows */
    int *tokens;     /* [batch][n_new] input ids of this step */
    void *x;         /* [batch * n_new][hidden]: fp32 on the CPU, fp16 on CUDA (act_elem) */
    int kv_q4; /* the cache is 4-bit (§5): each row [heads][head_dim] grouped along head_dim */
    float attn_sparsity;  /* decode attention keeps this fraction of the past (§5); 1: all */
    int64_t *v_rows_read; /* [batch]: V rows decode attention read (sparse or 4-bit cache) */
    void **k, **v;        /* [batch]: this layer's cache rows, opt_kv_row_bytes() each */
    const int **k_pages, **v_pages; /* [batch]: the page table of k[b] (v[b]); NULL: rows in
                                       order */
    char *kv_in_host; /* [batch]: k[b], v[b] are host memory (cpu or disk tier, --cpu-cache-compute)
                         that a GPU's attention delegates to the CPU (§4.2); the CPU ignores it */
} gpu_batch;

/* Scratch of the compute device, shared by all GPU batches (support/workspace.c sizes it). */
typedef struct {
    size_t rows; /* capacity in token rows */
    int max_len, n_threads;
    float *h;              /* [rows][max(hidden, word_dim)]: the words before project_in */
    float *attn;           /* [rows][max(q_width, hidden)] */
    float *qkv;            /* [rows][max(q_width + 2 kv_width, word_dim)]: q, k, v; project_out */
    float *ffn;            /* [rows][max(ffn, hidden)]; LLaMA: [2][rows][ffn], gate and up */
    float *thread_scratch; /* per thread: one (sequence, head)'s K, V and scores, or lm_head rows */
    size_t thread_floats;
    float *wide; /* sgemm's panels of W (more than MATMUL_DECODE_ROWS rows); NULL where the
                    workspace holds no more rows than that */
    int prefill; /* this GPU batch's phase (more than one new token a sequence), set by each
                    layer: --int8-activations' and --bf16-prefill's prefill scheme takes it */
    float *vec;  /* a bias, or a norm's weight and bias, widened to fp32 */
    float *x32;  /* fp16 hidden states widened (the cpu-fp16 device); NULL otherwise */
    /* W's int8 columns made once with the resident 4-bit weights (--int8-activations' prefill,
     * support/matmul.c), or NULL: the products make them per call */
    const struct int8_column_set *int8_columns;
    void *device; /* the CUDA backend's own buffers; NULL on the CPU */
} model_workspace;

/* Where a step's q, k and v rows lie in ws->qkv (rows of the GPU batch): OPT's one product
 * writes them side by side, [rows][q|k|v]; LLaMA's three write planes, q's rows then k's then v's.
 */
typedef struct {
    size_t at[3], stride[3];
} qkv_layout;
static inline qkv_layout qkv_layout_of(const model_config *c, size_t rows) {
    size_t q = (size_t)q_width(c), kv = (size_t)kv_width(c);
    if (c->family == FAMILY_OPT)
        return (qkv_layout){{0, q, q + kv}, {q + 2 * kv, q + 2 * kv, q + 2 * kv}};
    return (qkv_layout){{0, rows * q, rows * (q + kv)}, {q, kv, kv}};
}

/* The forward pass (opt_model.c), one step of Fig. 4's innermost loop at a time. opt_layer writes
 * this step's K and V into the cache; the caller then advances past[b] by its n_new - pad[b]. */
void opt_embed(const model_weights *w, gpu_batch *gb, model_workspace *ws);
void opt_layer(const model_weights *w, int d, gpu_batch *gb, model_workspace *ws); /* decoder layer
                                                                                      d */
void opt_cache_attention(const model_config *c, gpu_batch *gb, model_workspace *ws); /* both
                                                                                        families' */
void opt_output(const model_weights *w, gpu_batch *gb, model_workspace *ws, float *logits);
size_t opt_kv_row_bytes(const model_config *c, int q4); /* one token's K (or V) of one layer */
/* What both families' layers do around attention (opt_model.c): a product with its bias and its
 * output's use (linear_layer), and the row positions a step computes (cache slots; padding: 0). */
enum { OUT_SET, OUT_ADD, OUT_RELU }; /* y = xW + b;  y += xW + b (residual);  y = relu(xW + b) */
void linear_layer(const float *x, int rows, int in, const fp16 *W, const fp16 *b, int out, float *y,
                  int mode, int q4, int products, model_workspace *ws);
int output_rows(const gpu_batch *gb, int hidden, float *dst); /* the rows the output layer reads,
                                                                 into dst */
static inline int slot_of(const gpu_batch *gb, int b, int t) {
    return t < gb->pad[b] ? 0 : gb->past[b] + t - gb->pad[b];
}
/* OPT's position id of row t of a sequence this step (HF: cumsum(mask) * mask - 1 + 2): its cache
 * slot + 2. Padding rows get position 1, as in HF; no attention sees them anyway. Both backends'
 * input embedding reads it (opt_embed, flexgen.cu's add_positions_kernel). */
static inline FG_HOST_DEVICE int position_of(int past, int pad, int t) {
    return t < pad ? OPT_POS_OFFSET - 1 : past + t - pad + OPT_POS_OFFSET;
}

/* The LLaMA family's forward pass (llama_model.c), the same steps for the same schedule. */
void llama_embed(const model_weights *w, gpu_batch *gb, model_workspace *ws);
void llama_layer(const model_weights *w, int d, gpu_batch *gb, model_workspace *ws);
void llama_output(const model_weights *w, gpu_batch *gb, model_workspace *ws, float *logits);
/* RoPE's angle per pair i < head_dim / 2 at position 1 (HF's inv_freq, with rope_scaling). */
void rope_frequencies(const model_config *c, float *inv_freq);

/* One head's keys (or values) as decode attention reads them: key j is row kv_page_row(pages,
 * page_tokens, j) of the cache (fp16 or 4-bit), but keys from first_fresh on: this step's fp32
 * rows. */
typedef struct {
    const char *rows;
    const int *pages;
    int page_tokens;
    size_t stride;
    int q4, head, head_dim, first_fresh;
    const float *fresh;
    size_t fresh_stride;
} opt_kv_rows;
/* One decode query over nk keys: softmax(scale q.K) V, with §5's top-K when sparsity < 1.
 * Returns the V rows read. scratch: 3 nk + head_dim floats. */
int opt_attend_decode(const float *q, const opt_kv_rows *K, const opt_kv_rows *V, int nk,
                      float scale, float sparsity, float *scratch, float *out);
/* The plain products that the fast kernels (support/matmul.c) are held to; q4_parts > 0: 4-bit, in
 * q4_parts parts side by side (q|k|v: 3). */
void matmul_reference(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                      float *y, int accumulate);
void embed_t_reference(const float *x, int rows, int dim, const void *E, int q4_parts, int n,
                       float *y);

/* ---- 4-bit group-wise compression and top-K attention (quant.c, §5) ---- */
#define Q4_GROUP 64
/* Bytes of a 4-bit tensor [outer][len][inner]: per outer index, G groups of 32 bytes, min,
 * scale. */
static inline FG_HOST_DEVICE size_t q4_bytes(size_t outer, size_t len, size_t inner) {
    return outer * ((len + Q4_GROUP - 1) / Q4_GROUP) * inner * (Q4_GROUP / 2 + 2 * sizeof(fp16));
}
void q4_compress(const float *src, size_t outer, size_t len, size_t inner, uint8_t *dst);
int q4_compress_fp16(const fp16 *src, size_t outer, size_t len, size_t inner,
                     uint8_t *dst); /* -1: no memory */
void q4_decompress(const uint8_t *src, size_t outer, size_t len, size_t inner, float *dst);
/* The indices of w's k largest (n values; scratch: n floats) into keep, increasing, ties to the
 * earlier index; returns how many it kept: min(k, n), 0 where k <= 0 (a decode step whose
 * sparsity keeps none of the earlier tokens). */
int topk_keep(const float *w, int n, int k, int *keep, float *scratch);
/* Tensor t of a checkpoint's layout (support/support.h's opt_layout) as 4-bit dummy weights,
 * made a group at a time from the seed without an fp16 copy of the whole. */
struct opt_layout;
int q4_compress_dummy(const struct opt_layout *l, int t, uint64_t seed, uint8_t *dst);

/* Value e of a 4-bit tensor [outer][len][inner] (quant.c's layout): one thread of flexgen.cu's
 * decompression kernel, held on the host to q4_decompress's bits (exact fp16, one rounding). */
static inline FG_HOST_DEVICE float q4_value(const uint8_t *src, size_t len, size_t inner,
                                            size_t e) {
    size_t o = e / (len * inner);
    size_t r = (e / inner) % len;
    size_t i = e % inner;
    size_t G = (len + Q4_GROUP - 1) / Q4_GROUP;
    size_t g = r / Q4_GROUP;
    size_t p = (r % Q4_GROUP) / 2;
    const uint8_t *bytes = src + o * G * inner * (Q4_GROUP / 2 + 4);
    const fp16 *mins = (const fp16 *)(bytes + G * inner * (Q4_GROUP / 2));
    const fp16 *scales = mins + G * inner;
    int q = (bytes[(g * (Q4_GROUP / 2) + p) * inner + i] >> (r % 2 ? 0 : 4)) & 15;
    return fmaf((float)q, FG_HALF_TO_FLOAT(scales[g * inner + i]),
                FG_HALF_TO_FLOAT(mins[g * inner + i]));
}
/* Row r of a 4-bit tensor [1][len][inner] widened, by the groups' fp16 mins (q4_mins; the scales
 * follow them): the plain loop of support/simd.c's q4_decode_row, to the bit. */
static inline const fp16 *q4_mins(const uint8_t *src, size_t len, size_t inner) {
    return (const fp16 *)(src + (len + Q4_GROUP - 1) / Q4_GROUP * inner * (Q4_GROUP / 2));
}
static inline void q4_decompress_row(const uint8_t *src, size_t len, size_t inner, size_t r,
                                     float *dst) {
    const fp16 *mins = q4_mins(src, len, inner) + r / Q4_GROUP * inner;
    const fp16 *scales = mins + (len + Q4_GROUP - 1) / Q4_GROUP * inner;
    const uint8_t *b = src + (r / Q4_GROUP * (Q4_GROUP / 2) + (r % Q4_GROUP) / 2) * inner;
    for (size_t i = 0; i < inner; i++)
        dst[i] = fmaf((float)((b[i] >> (r % 2 ? 0 : 4)) & 15), FG_HALF_TO_FLOAT(scales[i]),
                      FG_HALF_TO_FLOAT(mins[i]));
}

/* ---- The tiers (§4.1) and a compute device's operation table (§4.2) ---- */
typedef enum { TIER_GPU, TIER_CPU, TIER_DISK, N_TIERS } fg_tier;
typedef enum {
    LINK_DISK_TO_CPU,
    LINK_CPU_TO_GPU,
    LINK_GPU_TO_CPU,
    LINK_CPU_TO_DISK,
    N_LINKS
} fg_link;
extern const char *const fg_tier_names[N_TIERS], *const fg_link_names[N_LINKS],
                                                     *const fg_tier_flags[N_TIERS];

/* One family's forward pass on a device: the input embedding, decoder layer d, the output layer. */
typedef struct {
    void (*embed)(const model_weights *w, gpu_batch *gb, model_workspace *ws);
    void (*layer)(const model_weights *w, int d, gpu_batch *gb, model_workspace *ws);
    void (*output)(const model_weights *w, gpu_batch *gb, model_workspace *ws, float *logits);
} fg_forward;

/* What the host asked of the compute device, counted by CUDA on every thread (docs/GPU.md,
 * "Counters"); the CPU counts nothing. */
typedef struct {
    int64_t host_waits;     /* stream, event and device synchronizations, copies that block */
    int64_t launches;       /* kernels */
    int64_t blas_calls;     /* cuBLAS products (each launches kernels of its own) */
    int64_t products_timed; /* cuBLAS products run to time an algorithm (not in blas_calls) */
    int64_t widened;        /* 4-bit slices widened to fp16 for a cuBLAS product (§5) */
    int64_t graph_launches; /* CUDA Graphs, each a decode layer's kernels (not in launches) */
    int64_t copies_in, copies_out, copies_on_device; /* host -> device, device -> host, device */
    int64_t pageable_copies; /* copies from or to pageable host memory (through the bounce
                                buffers) */
    int64_t allocations;     /* device allocations */
    int64_t bytes_in, bytes_out;
} fg_device_counts;

/* The compute device's operations: the schedule calls only these, so one loop drives the CPU
 * (app/cpu_backend.c) and CUDA (flexgen.cu). Pointers to the gpu tier are the device's.
 * CUDA queues its copies and kernels on the calling thread's stream and returns: a copy's host
 * buffer is in use until that thread's copies_done, and the I/O threads' work and the compute
 * thread's are ordered on the device by join (the I/O threads call it after each sync). */
typedef struct {
    const char *name;
    int gpu_is_host;              /* the gpu tier is host memory (the CPU) */
    size_t weight_elem;           /* bytes of one working weight value: 2 (fp16) on both */
    size_t act_elem;              /* bytes of one activation: 4 on the CPU, 2 on CUDA */
    void *(*alloc)(size_t bytes); /* gpu-tier memory, 64-byte aligned, zeroed */
    void (*free)(void *p);
    void *(*host_alloc)(size_t bytes, int pinned); /* cpu-tier memory, zeroed */
    void (*host_free)(void *p);
    /* its kernels read this cpu-tier memory where it lies (the CPU: all of it; CUDA: pinned
       memory mapped into the device's addresses), as §5's kept V rows are read */
    int (*reads_in_place)(const void *p);
    void (*weights_in)(void *dst, const fp16 *src, size_t n); /* fp16 (host) -> working */
    void (*weights_in_q4)(void *dst, const void *src, void *landing, size_t outer, size_t len,
                          size_t inner); /* 4-bit -> working, landing first (gpu tier) if need be */
    /* 4-bit on the gpu tier -> fp16, as a product of many rows reads it; NULL: none (the CPU) */
    void (*widen_q4)(void *dst, const void *src, size_t outer, size_t len, size_t inner);
    void (*copy_in)(void *dst, const void *src, size_t bytes);  /* cpu -> gpu */
    void (*copy_out)(void *dst, const void *src, size_t bytes); /* gpu -> cpu */
    void (*copy)(void *dst, const void *src, size_t bytes);     /* gpu -> gpu */
    void (*copies_done)(void);    /* this thread's copies from and to host memory have run */
    void (*finish)(void);         /* everything this thread queued has run */
    void (*join)(unsigned links); /* the compute thread's work and that of the I/O threads of these
                                     links (bits 1 << link), each after what the other queued */
    void (*counts)(fg_device_counts *c); /* the counters so far; NULL: not counted */
    size_t (*workspace_bytes)(const model_config *cfg, size_t rows, int max_prompt, int max_len);
    int (*workspace_init)(model_workspace *ws, const model_config *cfg, size_t rows, int max_prompt,
                          int max_len, char *err);
    void (*workspace_free)(model_workspace *ws);
    fg_forward forward[N_FAMILIES]; /* a family's forward pass; NULL entries: not on this device */
    double (*device_memory)(void);  /* free device memory less a reserve; NULL: host memory */
    int reads_q4;                   /* the products read 4-bit weights as stored (both backends) */
    double device_reserve;          /* gpu-tier bytes held beyond the runtime's (CUDA's context) */
    double host_reserve; /* cpu-tier bytes held beyond the runtime's (CUDA's copy buffers) */
    size_t (*delegated_bytes)(const model_config *cfg, size_t rows, int max_len); /* cpu tier, §4.2;
                                                                                     CPU: NULL */
} fg_backend;
extern const fg_backend fg_cpu_backend;
const fg_backend *fg_cuda_backend(char *err); /* NULL, with the reason, where there is no GPU */

#endif
