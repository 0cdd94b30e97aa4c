/* flexgen.h: the public interface of FlexGen in C: what the files offer each other and the
 * tests. The runtime's own state is in runtime.h; docs/DESIGN.md maps every file to the paper
 * and draws how they call each other. In the order of this header:
 *   util.c         error lines, whole-file reads, fp16 <-> fp32
 *   quant.c        4-bit group-wise compression, top-K selection for sparse attention (§5)
 *   matmul.c       the CPU's products with fp16 or 4-bit weights as stored
 *   opt_model.c    OPT configs, the weight table, the CPU forward pass and backend, sampling (§3)
 *   safetensors.c  checkpoints, mapped
 *   tokenizer.c    GPT-2 byte-level BPE over OPT's vocab.json / merges.txt, special tokens
 *   tiers.c, weights.c, plan.c, flexgen.c, trace.c
 *                  the runtime: tiers, placement, the plan check, the block schedule of Fig. 4
 *                  (§4.1, §4.2); flexgen.cu the CUDA backend
 *   pipeline.c     the link between pipeline stages (§4.4)
 *   lp.c, cost_model.c, policy.c, profile.c
 *                  the simplex, the cost model, the policy search, the machine's constants
 *                  (§4.3, Appendix A.3)
 *
 * Conventions: functions that can fail on bad input return 0 on success and -1 on failure, after
 * writing one line (no newline) into `err`, a buffer of FG_ERR_LEN bytes that names the file,
 * tensor or flag and what is wrong. Nothing here calls exit().
 */
#ifndef FLEXGEN_H
#define FLEXGEN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define FG_ERR_LEN 512
#define FG_PATH_LEN 4200 /* a path as the runtime keeps it, with room for a suffix */

/* OPT's special tokens (docs/DESIGN.md, "Conventions": OPT facts). */
#define OPT_PAD_ID 1
#define OPT_BOS_ID 2 /* `</s>`, prepended to every prompt */
#define OPT_EOS_ID 2
#define OPT_POS_OFFSET 2 /* learned positions are looked up at position + 2 */

/* Writes one line into err (FG_ERR_LEN bytes; err may be NULL) and returns -1. Control characters
 * (a newline in a tensor name or a flag's value, say) become '?', so the line stays one line. */
int fg_fail(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A whole file, NUL-terminated (*len, if not NULL, excludes the NUL); NULL and err on failure.
 * Only regular files of at most FG_MAX_TEXT_FILE bytes are read: a FIFO, a device or a directory is
 * refused without blocking, and so is a file too big to be one of the text files read whole
 * (config.json, vocab.json, merges.txt, the shard index, hardware files). */
char *fg_read_file(const char *path, size_t *len, char *err);
/* OPT's vocab.json is about 1 MB and its merges.txt 0.5 MB: 64 MiB leaves ample headroom and
 * stops a wrong path (a checkpoint, say) from being read into memory. */
#define FG_MAX_TEXT_FILE ((size_t)64 << 20)

/* ------------------------------------------------------------------------------------------
 * Half precision. Weights and the KV cache are stored as IEEE fp16; compute is fp32.
 * ------------------------------------------------------------------------------------------ */
typedef uint16_t fp16;

float fp16_to_fp32(fp16 h);
fp16 fp32_to_fp16(float f); /* round to nearest even; overflow gives +-Inf */
float bf16_to_fp32(uint16_t b);
void fp16_to_fp32_n(const fp16 *src, float *dst, size_t n); /* vectorized where F16C exists */
void fp32_to_fp16_n(const float *src, fp16 *dst, size_t n);
/* AVX2, FMA and F16C are there (and FLEXGEN_NO_SIMD, which tests the portable paths, is unset). */
int fg_cpu_has_avx2(void);

/* ------------------------------------------------------------------------------------------
 * Output files and signals (util.c). An output is written to a temporary beside its path and
 * renamed over it by commit; abort, an error or a signal that ends the process removes it.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    FILE *f;
    const char *flag, *path; /* for error lines: "--trace out.json: ..." */
    char tmp[FG_PATH_LEN];
    int slot;
} fg_output;
int fg_output_open(fg_output *o, const char *flag, const char *path, char *err);
int fg_output_commit(fg_output *o, char *err);
void fg_output_abort(fg_output *o);
/* Whether path can be written as an output, before the work that makes it. */
int fg_output_check(const char *flag, const char *path, char *err);
/* SIGINT, SIGTERM, SIGHUP remove the outputs' temporaries; a SIGBUS in a watched mapping ends
 * the process with one line naming its file and exit status 2. */
void fg_install_signal_handlers(void);
void fg_watch_mapping(const void *base, size_t size, const char *path);
void fg_unwatch_mapping(const void *base);

/* ------------------------------------------------------------------------------------------
 * 4-bit group-wise compression (quant.c, §5). A tensor [outer][len][inner] is grouped along len
 * in groups of Q4_GROUP values, each with an fp16 min and scale; quant.c's top comment gives the
 * byte layout. Decoding gives min + q * scale: a constant group comes back exactly.
 * ------------------------------------------------------------------------------------------ */
#define Q4_GROUP 64
size_t q4_bytes(size_t outer, size_t len, size_t inner);
void q4_compress(const float *src, size_t outer, size_t len, size_t inner, uint8_t *dst);
void q4_decompress(const uint8_t *src, size_t outer, size_t len, size_t inner, float *dst);
/* Row r of a tensor [1][len][inner] (an embedding table): its inner values, as q4_decompress
 * gives them. */
void q4_decompress_row(const uint8_t *src, size_t len, size_t inner, size_t r, float *dst);
/* Top-K selection of sparse attention (§5): the indices of the k largest of w[0 .. n), at most
 * n, in increasing order (ties go to the earlier index). Returns how many. scratch: n floats. */
int topk_keep(const float *w, int n, int k, int *keep, float *scratch);

/* ------------------------------------------------------------------------------------------
 * Products with weights as they are stored (matmul.c): fp32 activations times fp16 weights, or
 * 4-bit ones (q4, quant.c's layout), accumulated in fp32. Parallel over OpenMP's threads.
 * ------------------------------------------------------------------------------------------ */
/* y[rows][out] = x[rows][in] W[in][out], or y += that (accumulate). W: [in][out] fp16, or 4-bit
 * [in][out][1]. Up to MATMUL_DECODE_ROWS rows, each element of y is the same fused chain over k
 * on every path; more rows go through sgemm on widened panels, in scratch (matmul_scratch_floats
 * (in, out) floats; NULL will do for fewer rows). */
#define MATMUL_DECODE_ROWS 64
void matmul_weights(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                    int accumulate, float *scratch);
size_t matmul_scratch_floats(int in, int out);
/* y[rows][n] = x[rows][dim] E^T for a table E [n][dim]: fp16, or 4-bit [1][n][dim]. Up to
 * MATMUL_EMBED_DOT_ROWS rows, each row of E is widened and dotted with x's rows; more rows go
 * through sgemm on blocks of MATMUL_EMBED_BLOCK widened rows. scratch: MATMUL_EMBED_BLOCK x dim
 * floats for each of omp_get_max_threads() threads, scratch_stride floats apart. */
#define MATMUL_EMBED_DOT_ROWS 64
#define MATMUL_EMBED_BLOCK 64
void matmul_embed_t(const float *x, int rows, int dim, const void *E, int q4, int n, float *y,
                    float *scratch, size_t scratch_stride);
/* Row r of such a table as fp32: dim values. */
void matmul_embed_row(const void *E, int q4, int n, int dim, int r, float *dst);
/* For the tests: 1 makes every product take the portable C path even where AVX2 is there. */
void matmul_force_portable(int on);

/* ------------------------------------------------------------------------------------------
 * Model configuration.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    char name[64];
    int n_layers;
    int hidden;   /* h1 in the paper */
    int n_heads;
    int ffn;      /* h2 in the paper */
    int vocab;
    int max_pos;  /* 2048; the position table has max_pos + 2 rows */
    int word_dim; /* word_embed_proj_dim: == hidden except for 350m (512) */
    int pre_ln;   /* do_layer_norm_before: 1 for all sizes but 350m */
} opt_config;

/* "opt-125m" ... "opt-175b". Returns -1 (with a message listing the names) when unknown. */
int opt_config_by_name(const char *name, opt_config *cfg, char *err);
/* HF config.json. */
int opt_config_from_json(const char *path, opt_config *cfg, char *err);
size_t opt_param_count(const opt_config *cfg);
/* FlexGen's size formulas (flexgen/opt_config.py), in bytes of fp16. */
double opt_model_bytes(const opt_config *cfg);
double opt_cache_bytes(const opt_config *cfg, int batch, int seq_len);
double opt_hidden_bytes(const opt_config *cfg, int batch, int seq_len);

/* ------------------------------------------------------------------------------------------
 * Weights, as the compute device holds them: fp16 values, as stored (checkpoints in fp32 or bf16
 * are rounded to fp16 first, so every source gives the same numbers), which both backends'
 * products read as they are. With q4 set, the matrices and embedding tables hold their 4-bit
 * bytes instead (§5, quant.c's layout), which the CPU's products read as they are too.
 * Linear weights are stored transposed, [in][out] (the checkpoint has [out][in]);
 * opt_weight_locate() says where any checkpoint tensor's elements are.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    fp16 *attn_ln_w, *attn_ln_b; /* self_attn_layer_norm */
    fp16 *wqkv, *bqkv;           /* [hidden][3 * hidden]: q_proj, k_proj, v_proj side by side */
    fp16 *wo, *bo;               /* out_proj, [hidden][hidden] */
    fp16 *ffn_ln_w, *ffn_ln_b;   /* final_layer_norm (of the layer) */
    fp16 *fc1_w, *fc1_b;         /* [hidden][ffn] */
    fp16 *fc2_w, *fc2_b;         /* [ffn][hidden] */
} opt_layer_weights;

typedef struct {
    opt_config cfg;
    fp16 *embed_tokens;    /* [vocab][word_dim] (checkpoint layout: rows are looked up) */
    fp16 *embed_positions; /* [max_pos + 2][hidden] */
    fp16 *project_in;      /* [word_dim][hidden], NULL when word_dim == hidden */
    fp16 *project_out;     /* [hidden][word_dim], NULL when word_dim == hidden */
    fp16 *final_ln_w, *final_ln_b; /* NULL when !pre_ln (350m) */
    fp16 *lm_head;         /* [vocab][word_dim]; == embed_tokens when tied */
    opt_layer_weights *layers;
    int q4;                /* matrices and embedding tables are 4-bit (CPU backend, §5) */
    fp16 *storage;         /* the one allocation all of the above point into */
    size_t storage_values;
} opt_weights;

/* Dummy weights, deterministic from seed whatever the thread count, scaled so that activations
 * stay finite through every layer of every size. All tensors in one fp16 arena. */
int opt_weights_dummy(const opt_config *cfg, uint64_t seed, opt_weights *w, char *err);
/* An HF checkpoint directory, all tensors in one fp16 arena. */
int opt_weights_load(const char *dir, opt_weights *w, char *err);
void opt_weights_free(opt_weights *w);
/* Where checkpoint tensor `name` (HF name, with or without "model.") is held: its element [r][c]
 * is at first[r * row_stride + c * col_stride]. Returns -1 for a name the model does not have. */
int opt_weight_locate(const opt_weights *w, const char *name, const fp16 **first,
                      size_t *row_stride, size_t *col_stride);

/* ------------------------------------------------------------------------------------------
 * safetensors archives (mmap'd), used by the loader and by tests.
 * ------------------------------------------------------------------------------------------ */
typedef enum { ST_F16, ST_BF16, ST_F32 } st_dtype;

typedef struct {
    char name[160];
    st_dtype dtype;
    int ndim;
    int64_t shape[4];
    const void *data; /* inside the mapping */
    size_t nbytes;
    int file;         /* index into the archive's files */
} st_tensor;

typedef struct {
    int n_files;
    char **paths;
    void **maps;
    size_t *sizes;
    st_tensor *tensors;
    int n_tensors;
} st_archive;

int st_open_dir(const char *dir, st_archive *a, char *err);
int st_open_file(const char *path, st_archive *a, char *err); /* appends one file's tensors */
const st_tensor *st_find(const st_archive *a, const char *name);
void st_close(st_archive *a);
/* An HF checkpoint directory: its config.json (cfg->name becomes dir) and its archive, mapped. */
int opt_checkpoint_open(const char *dir, opt_config *cfg, st_archive *a, char *err);

/* ------------------------------------------------------------------------------------------
 * The weight table, for the runtime's placement.
 * ------------------------------------------------------------------------------------------ */
/* The model's stored tensors, layer by layer, as the runtime places them (§4.2: weights are placed
 * tensor by tensor within each layer). A layer's tensors tile one arena of layer_floats[layer]
 * floats; tensor t starts at element offset and spans count (64-byte padding included). */
typedef struct {
    char name[96];        /* HF name without "model." (q_proj's for the fused q, k, v) */
    int layer;            /* FlexGen's layer list: 0 input embedding, 1 .. n_layers decoder
                             layers, n_layers + 1 output embedding */
    size_t offset, count; /* elements, within the layer's arena */
    fp16 **slot;          /* the field of the view that points at the tensor's working copy */
    size_t group_outer, group_len, group_inner; /* §5's grouping of a matrix as stored: [outer]
                             [len][inner] in groups along len (a linear [in][out]: [in][out][1];
                             an embedding [vocab][dim]: [1][vocab][dim]); group_len 0: a vector */
    int tied_to;          /* -1, or the tensor whose values and home it shares (tied lm_head) */
    int first_spec, n_specs; /* the checkpoint tensors that fill it (internal) */
} opt_tensor;

typedef struct {
    opt_weights *view;    /* the compute view whose fields the slots name */
    opt_tensor *tensors;
    int n_tensors;
    size_t *layer_floats; /* [n_layers + 2] */
    void *specs;          /* the checkpoint tensor table (internal to opt_model.c) */
    int n_specs;
} opt_layout;

/* Where values come from: a checkpoint (archive) or dummy weights (archive NULL, seed). */
typedef struct {
    const st_archive *archive;
    uint64_t seed;
} weight_source;

/* Builds the table over view (view->cfg is set, view->layers allocated; opt_layout_free frees them
 * unless view is set to NULL first). has_lm_head: the checkpoint has its own lm_head.weight. */
int opt_layout_init(opt_layout *l, opt_weights *view, const opt_config *cfg, int has_lm_head,
                    char *err);
void opt_layout_free(opt_layout *l);
/* Every tensor the model needs is in the archive with its shape, and nothing else is. */
int opt_layout_check_archive(const opt_layout *l, const st_archive *a, const char *dir, char *err);
/* Writes tensor t's values, rounded to fp16, in its stored layout: into dst32 (as fp32) or, when
 * dst32 is NULL, into dst16. Both hold t's count elements. */
void opt_tensor_fill(const opt_layout *l, int t, const weight_source *src, float *dst32,
                     fp16 *dst16);

/* ------------------------------------------------------------------------------------------
 * One GPU batch (§4.1: the unit the schedule of Fig. 4 computes), as the compute device sees it
 * for one layer: its sequences' hidden states for the tokens in flight and, for each sequence,
 * where that layer's K and V cache rows are. The runtime points x, k and v at whichever tier
 * holds them. Prompts are left-padded: sequence b's real tokens start at cache slot pad[b];
 * position ids follow HF (slot - pad[b] + OPT_POS_OFFSET).
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    int batch;    /* sequences */
    int max_len;  /* KV capacity in tokens (padded prompt + generated) */
    int len;      /* slots already in the cache */
    int n_new;    /* tokens in flight this step: the padded prompt at prefill, 1 in decode */
    int all_rows; /* the output layer gives the logits of every token in flight, not only of
                     each sequence's last (perplexity through prefill) */
    int *pad;     /* [batch] */
    int *tokens;  /* [batch][n_new] input ids of this step */
    void *x;      /* [batch * n_new][hidden] hidden states, the backend's act_elem bytes each:
                     fp32 on the CPU, fp16 on CUDA (as FlexGen keeps them) */
    int kv_q4;    /* the cache is 4-bit (§5): each row [heads][head_dim] grouped along head_dim */
    float attn_sparsity; /* decode attention keeps this fraction of the past (§5); 1: all */
    int64_t *v_rows_read; /* [batch]: V rows (one head's each) decode attention read from the
                             cache with a 4-bit cache or sparsity; the caller resets it */
    void **k, **v; /* [batch]: sequence b's cache of this layer, max_len rows of
                      opt_kv_row_bytes() each: [hidden] fp16, or 4-bit */
} gpu_batch;

/* Bytes of one token's K (or V) row of one layer: fp16, or (q4) 4-bit group-wise. */
size_t opt_kv_row_bytes(const opt_config *c, int q4);

/* One head's keys (or values) as decode attention reads them: key j is row j of the cache at
 * rows + j * stride bytes (fp16, or 4-bit with the head's groups), except keys from first_fresh
 * on, which are fp32 rows of this step at fresh + (j - first_fresh) * fresh_stride. */
typedef struct {
    const char *rows;
    size_t stride;
    int q4, head, head_dim;
    int first_fresh;
    const float *fresh;
    size_t fresh_stride;
} opt_kv_rows;

/* One decode query of one head over keys 0 .. nk - 1 (the last is the new token): softmax(scale
 * q.K) over all of them, then out = sum of weight_j V_j over the kept keys. sparsity < 1 is §5's
 * top-K attention: keep the new token and the floor(sparsity (nk - 1)) earlier keys of largest
 * weight, weights not renormalized, and only their V rows read. The keys are the sequence's own
 * tokens, left padding excluded, so the result does not depend on which prompts share a block
 * (FlexGen counts the padding of its one common prompt length). Returns the V rows read.
 * scratch: 3 nk + head_dim floats. */
int opt_attend_decode(const float *q, const opt_kv_rows *K, const opt_kv_rows *V, int nk,
                      float scale, float sparsity, float *scratch, float *out);

/* Allocates pad, tokens (batch x max_new) and the k, v pointer arrays; x and the cache rows
 * belong to the caller. */
int gpu_batch_init(gpu_batch *gb, int batch, int max_len, int max_new, char *err);
void gpu_batch_free(gpu_batch *gb);

/* Scratch buffers of the compute device, shared by all GPU batches. */
typedef struct {
    size_t rows;            /* capacity in token rows */
    int max_len;            /* the longest KV cache it serves (a GPU batch's max_len at most) */
    int n_threads;
    float *h, *attn;        /* [rows][hidden] */
    float *qkv;             /* [rows][3 * hidden]: q, k, v side by side */
    float *ffn;             /* [rows][max(ffn, hidden)] */
    float *thread_scratch;  /* per thread: K, V slices and scores of one (sequence, head), or a
                               row of the embedding table (lm_head) */
    size_t thread_floats;
    float *wide;            /* matmul_weights' scratch for prefill's products; NULL when rows
                               <= MATMUL_DECODE_ROWS */
    float *vec;             /* a bias, or a norm's weight and bias, widened to fp32 */
    float *x32;             /* [rows][hidden]: fp16 hidden states widened for the CPU's fp32
                               operations (the cpu-fp16 device); NULL otherwise */
    void *device;           /* the CUDA backend's own buffers (flexgen.cu); NULL on the CPU */
} opt_workspace;

int opt_workspace_init(opt_workspace *ws, const opt_config *cfg, size_t rows, int max_len,
                       char *err);
size_t opt_workspace_bytes(const opt_config *cfg, size_t rows, int max_len);
void opt_workspace_free(opt_workspace *ws);

/* The forward pass, one step of Fig. 4's innermost loop at a time. gb->tokens, gb->len and
 * gb->n_new describe the step; the caller advances gb->len by n_new after the step. opt_layer
 * writes this step's K and V (rounded to fp16, or 4-bit with gb->kv_q4) into slots len .. len +
 * n_new - 1 of gb->k, gb->v. */
void opt_embed(const opt_weights *w, gpu_batch *gb, opt_workspace *ws);
void opt_layer(const opt_weights *w, int layer, gpu_batch *gb, opt_workspace *ws);
/* The attention of opt_layer, from ws->qkv (this step's q, k, v) to ws->attn: K and V into the
 * cache, then attention over it. The CUDA backend runs it for delegated sequences (§4.2). */
void opt_cache_attention(const opt_config *c, gpu_batch *gb, opt_workspace *ws);
/* Logits of the last token of each sequence, [batch][vocab]; with gb->all_rows of every token
 * in flight, [batch][n_new][vocab]. */
void opt_output(const opt_weights *w, gpu_batch *gb, opt_workspace *ws, float *logits);

/* ------------------------------------------------------------------------------------------
 * Sampling.
 * ------------------------------------------------------------------------------------------ */
typedef struct { uint64_t s[2]; } fg_rng;
void rng_seed(fg_rng *r, uint64_t seed);
uint64_t rng_next(fg_rng *r);
float rng_uniform(fg_rng *r); /* [0, 1) */
/* temperature <= 0: greedy (argmax). Otherwise softmax(logits / temperature), then nucleus
 * (top-p) filtering. `scratch` holds 2 * n floats. */
int sample_token(const float *logits, int n, float temperature, float top_p, fg_rng *rng,
                 float *scratch);

/* ------------------------------------------------------------------------------------------
 * Tokenizer: GPT-2 byte-level BPE (tokenizer.c).
 * ------------------------------------------------------------------------------------------ */
typedef struct fg_tokenizer fg_tokenizer;

/* Also reads the special and added tokens of the special_tokens_map.json, tokenizer_config.json
 * and added_tokens.json beside vocab_path, where present (as HF's from_pretrained does). */
fg_tokenizer *tokenizer_load(const char *vocab_path, const char *merges_path, char *err);
void tokenizer_free(fg_tokenizer *t);
/* One past the largest id: of the vocab, or of an added token. */
int tokenizer_vocab_size(const fg_tokenizer *t);
/* Encodes len bytes of text (no BOS added); special and added tokens in the text become their
 * ids, as HF's tokenizers split them out. *ids is malloc'd; the caller frees it. */
int tokenizer_encode(const fg_tokenizer *t, const char *text, size_t len, int **ids, int *n_ids,
                     char *err);
/* Decodes to a malloc'd NUL-terminated byte string; *out_len excludes the NUL. Ids the vocab
 * does not hold decode to nothing. Returns NULL only when out of memory. */
char *tokenizer_decode(const fg_tokenizer *t, const int *ids, int n_ids, size_t *out_len);

/* ------------------------------------------------------------------------------------------
 * The runtime (tiers.c, weights.c, plan.c, flexgen.c): tiers, placement, the plan check, the
 * overlapped block schedule (§4.1, §4.2).
 * ------------------------------------------------------------------------------------------ */
typedef enum { TIER_GPU, TIER_CPU, TIER_DISK, N_TIERS } fg_tier;
typedef enum { LINK_DISK_TO_CPU, LINK_CPU_TO_GPU, LINK_GPU_TO_CPU, LINK_CPU_TO_DISK, N_LINKS } fg_link;

/* A policy (§4.2, §4.3): the block shape, where weights, KV cache and activations live, and how
 * the schedule runs. */
/* The compute device: CUDA where a GPU is present, else the CPU (auto), or one of them. */
typedef enum { FG_DEVICE_AUTO, FG_DEVICE_CPU, FG_DEVICE_CUDA, FG_DEVICE_CPU_FP16 } fg_device;
/* FG_DEVICE_CPU_FP16 (--device cpu-fp16): the CPU backend holding activations in fp16, as the
 * CUDA backend does, so that the runtime's 2-byte activations run on any machine. */

/* The placement (§4.2), in the paper's symbols: the percentages of the weights (w), the KV cache
 * (c) and the activations, or hidden states (h), on the gpu (g) and cpu (c) tiers; the disk
 * tier holds the rest of each (wn = 100 - wg - wc, ...). The cost model's fractions x[X_WG ..]
 * are the same quantities over 1. */
typedef struct { int wg, wc, cg, cc, hg, hc; } fg_percent;

typedef struct {
    fg_device device;
    int gpu_batch_size, num_gpu_batches; /* the block is their product (§4.1) */
    fg_percent percent;      /* where weights, KV cache and activations live */
    int overlap;             /* I/O on its own threads, overlapping compute (Fig. 4) */
    int cpu_cache_compute;   /* decode attention over a cpu or disk cache runs on the CPU */
    int pin_weight;          /* pinned cpu-tier weights (CUDA backend; no effect on the CPU) */
    int compress_weight;     /* weight matrices kept 4-bit group-wise in their tiers (§5) */
    int compress_cache;      /* the KV cache kept 4-bit group-wise in its tiers (§5) */
    float attn_sparsity;     /* decode attention keeps this fraction of the past (§5); 1: all */
    double capacity[N_TIERS]; /* bytes; 0: what the machine has */
    const char *offload_dir; /* disk tier files; NULL: FG_DEFAULT_OFFLOAD_DIR */
    const char *weight_dir;  /* dummy weights placed on disk are written (once) here; NULL: the
                                user's cache dir (~/.cache/flexgen) */
    int trace;               /* record a Chrome trace (fg_trace_write) */
    int verbose;             /* progress on stderr */
    int stage, n_stages;     /* this process runs pipeline stage `stage` of n_stages (§4.4): its
                                share of the layers (fg_stage_layers); 1 stage: the whole model */
} fg_policy;

/* The layers of stage s of n (FlexGen's list: 0 input embedding, 1 .. n_layers decoder layers,
 * n_layers + 1 output embedding): [*first, *end). Decoder layers split as evenly as they can;
 * the first stage adds the input embedding (the token ids are its input), the last the output
 * embedding (so only token ids travel back to the first stage). */
void fg_stage_layers(const opt_config *c, int s, int n, int *first, int *end);

#define FG_DEFAULT_OFFLOAD_DIR "/var/tmp"

/* FlexGen's default policy: everything on the gpu tier, overlap on, a 2 x 16 block; the CPU
 * backend (the command line's default is auto). */
fg_policy fg_default_policy(void);

typedef struct {
    double capacity[N_TIERS], peak[N_TIERS], current[N_TIERS]; /* bytes */
    double host_memory;      /* bytes the gpu and cpu tiers share when the gpu tier is host
                                memory (the CPU backend), else 0 */
    double link_bytes[N_LINKS];                               /* bytes moved over each link */
} fg_stats;

extern const char *const fg_tier_names[N_TIERS];
extern const char *const fg_link_names[N_LINKS];

/* The compute device's operations (docs/DESIGN.md, "The backends' operation table"). The schedule calls only these, so the
 * same loop drives the CPU backend (opt_model.c) and the CUDA backend (flexgen.cu). Pointers to
 * the gpu tier are the device's: on the CPU backend host memory, on CUDA device memory, which
 * only the backend's operations touch. Working weights on the gpu tier are weight_elem bytes a
 * value: fp16 on both backends, which opt_weights' pointers point at. */
typedef struct {
    const char *name;
    int gpu_is_host;                         /* the gpu tier is host memory (CPU backend) */
    size_t weight_elem;                      /* bytes of one working weight value */
    size_t act_elem;                         /* bytes of one activation value (gpu_batch.x, the
                                                activations' homes and staging, messages between
                                                stages): 4 (fp32) on the CPU, 2 (fp16) on CUDA */
    void *(*alloc)(size_t bytes);            /* gpu-tier memory, 64-byte aligned, zeroed */
    void (*free)(void *p);
    void *(*host_alloc)(size_t bytes, int pinned); /* cpu-tier memory, zeroed; pinned (page-
                                                      locked, for fast copies) where it can be */
    void (*host_free)(void *p);
    void (*weights_in)(void *dst, const fp16 *src, size_t n); /* fp16 (host) -> working */
    void (*weights_in_q4)(void *dst, const void *src, void *landing, size_t outer, size_t len,
                          size_t inner);
                                             /* the same from 4-bit (§5), decompressed; src is in
                                                host memory, or on the gpu tier when landing is
                                                NULL; otherwise the compressed bytes first land
                                                in `landing` (gpu tier) where the device needs */
    void (*copy_in)(void *dst, const void *src, size_t bytes);  /* cpu -> gpu */
    void (*copy_out)(void *dst, const void *src, size_t bytes); /* gpu -> cpu */
    void (*copy)(void *dst, const void *src, size_t bytes);     /* gpu -> gpu */
    size_t (*workspace_bytes)(const opt_config *cfg, size_t rows, int max_len);
    int (*workspace_init)(opt_workspace *ws, const opt_config *cfg, size_t rows, int max_len,
                          char *err);
    void (*workspace_free)(opt_workspace *ws);
    /* The forward pass: gb's x, k and v are where bind_batch put them (gpu tier, or with
     * delegation host memory), its pad and tokens in host memory; logits on the gpu tier. */
    void (*embed)(const opt_weights *w, gpu_batch *gb, opt_workspace *ws);
    void (*layer)(const opt_weights *w, int layer, gpu_batch *gb, opt_workspace *ws);
    void (*output)(const opt_weights *w, gpu_batch *gb, opt_workspace *ws, float *logits);
    /* The gpu tier's capacity when --gpu-mem is not given: the device's free memory less a
     * reserve; NULL where the gpu tier is host memory (then the host's available memory). */
    double (*device_memory)(void);
    int reads_q4;                            /* the products read 4-bit weights (§5) as they are
                                                stored: weights_in_q4 copies the bytes, and a
                                                4-bit home on the gpu tier is read in place */
    double device_reserve;                   /* gpu-tier bytes the process holds beyond what the
                                                runtime allocates (0 on the CPU) */
    /* Host bytes that delegated attention (§4.2) needs for `rows` token rows beside the
     * backend's workspace: counted on the cpu tier; NULL where the CPU's own workspace serves. */
    size_t (*delegated_bytes)(const opt_config *cfg, size_t rows, int max_len);
} fg_backend;

extern const fg_backend fg_cpu_backend;
extern const fg_backend fg_cpu_fp16_backend; /* the same with fp16 activations (cpu-fp16) */
#define FG_CUDA_ACT_ELEM 2                  /* the CUDA backend's act_elem, for the cost model */

/* Prefill runs a GPU batch's layer on chunks of its sequences, at most FG_CHUNK_ROWS token rows
 * each (one sequence when its prompt is longer), so that the workspace does not grow with the
 * GPU batch size times the prompt length: it holds fg_workspace_rows token rows. */
#define FG_CHUNK_ROWS 2048
size_t fg_workspace_rows(int gbs, int max_prompt);
/* The CUDA backend (flexgen.cu) on the first GPU, or NULL with the reason in err: built without
 * CUDA, no driver, no device. */
const fg_backend *fg_cuda_backend(char *err);
int fg_cuda_compiled(void); /* this build has the CUDA backend */
/* The CUDA backend's workspace (the cost model's memory model uses it for a GPU): the bytes of
 * each of its FG_CUDA_WS_PARTS parts, 64-byte multiples (sizes may be NULL), and their sum. */
enum { FG_CUDA_WS_PARTS = 8 };
size_t fg_cuda_workspace_parts(const opt_config *cfg, size_t rows, int max_len, size_t *sizes);
size_t fg_cuda_workspace_bytes(const opt_config *cfg, size_t rows, int max_len);
/* Delegated attention's host rows on CUDA: the CPU's workspace and an fp16 buffer of q, k, v. */
size_t fg_cuda_delegated_bytes(const opt_config *cfg, size_t rows, int max_len);
/* What a CUDA process holds on the device beyond the tiers' allocations, taken off --gpu-mem by
 * the plan check and the memory model: its context (a few hundred MiB with lazy module loading),
 * cuBLAS's workspace (up to 32 MiB a handle), and the rounding of allocations to the driver's
 * pages. An estimate, to be measured on each card (scripts/gpu_first_run.sh). */
#define FG_CUDA_RESERVE (512.0 * (1 << 20))

/* One run: tiers with their accounting, the I/O threads, the trace. */
typedef struct fg_runtime fg_runtime;
/* Opens a run on p->device: --device cuda without a usable GPU fails with the reason; auto takes
 * the CPU then (fg_runtime_backend says which it got). */
int fg_runtime_open(const fg_policy *p, fg_runtime **rt, char *err);
const fg_backend *fg_runtime_backend(const fg_runtime *rt);
void fg_runtime_close(fg_runtime *rt); /* removes every file the run made in the offload dir */
void fg_runtime_stats(const fg_runtime *rt, fg_stats *s);
int fg_trace_write(const fg_runtime *rt, const char *path, char *err);
/* The run's trace as stage `stage` of n (Chrome's trace events, one a line; malloc'd), and a
 * trace file made of every stage's events, written whole or not at all (trace.c). */
char *fg_trace_events(const fg_runtime *rt, int stage, int n);
int fg_trace_write_events(const char *path, const char *events, char *err);

/* The whole plan of a run (weights, KV cache, activations, staging, workspace, per tier) against
 * the capacities, before anything is allocated. */
typedef struct fg_model fg_model;
int fg_check_plan(const fg_model *m, int n_prompts, int max_prompt, int gen_len, char *err);

/* A model whose weights the runtime places on its tiers: `model` is an OPT size name (dummy
 * weights from seed) or an HF checkpoint directory. Opening validates and decides the placement;
 * the weights are written to their homes on the first generate(). */
int fg_model_open(fg_runtime *rt, const char *model, uint64_t seed, fg_model **m, char *err);
/* Dummy weights for any configuration (tests use thin, deep ones). */
int fg_model_open_dummy(fg_runtime *rt, const opt_config *cfg, uint64_t seed, fg_model **m,
                        char *err);
const opt_config *fg_model_config(const fg_model *m);
/* Writes the weights into their homes now (generate() does it on first use). */
int fg_model_load(fg_model *m, char *err);
void fg_model_close(fg_model *m);

typedef struct {
    int gen_len;
    float temperature, top_p;
    uint64_t seed;
    int stop_at_eos;
    int verbose; /* progress on stderr */
    const int *forced;    /* NULL, or [n_prompts][gen_len]: the tokens each step feeds back in
                             place of the chosen ones (teacher forcing: perplexity in decode) */
    float *prompt_logits; /* NULL, or [n_prompts][longest prompt][vocab]: prefill's logits at
                             every position, row t of prompt p the one after its token t */
} gen_options;

typedef struct {
    double prefill_latency, decode_latency; /* seconds, summed over blocks */
    int64_t prefill_tokens, decode_tokens;  /* FlexGen's counts: prompts x prompt_len, x (gen-1) */
    double compute_seconds;                 /* time the compute thread spent computing */
    double bubble_seconds;                  /* time it waited for another pipeline stage */
    double disk_read_seconds;               /* time the disk->cpu link spent reading */
} gen_timing;

/* Generates gen_len tokens for each prompt, in blocks of gpu_batch_size x num_gpu_batches, with
 * the model's runtime policy. out_tokens: [n_prompts][gen_len] (tokens after an EOS are
 * OPT_PAD_ID with stop_at_eos). logits: NULL, or [n_prompts][gen_len][vocab] (rows not computed
 * are 0). */
int generate(fg_model *m, const gen_options *opt, int n_prompts, int *const *prompts,
             const int *prompt_lens, int *out_tokens, float *logits, gen_timing *timing,
             char *err);

/* The perplexity of a token sequence under the model (perplexity.c, §6.2), through its runtime
 * and policy: windows of `window` tokens that advance by `stride`, each scoring the tokens no
 * earlier one did, in prefill, or (decode) token by token in decode steps fed the text's own
 * tokens, so that the KV cache is read as generation reads it. */
typedef struct {
    int window, stride; /* 0: the model's positions, and half the window */
    int decode;
    int verbose;        /* progress on stderr */
} ppl_options;

typedef struct {
    double nll;         /* nats, summed over the scored tokens */
    long scored;        /* tokens scored: every one but the first */
    double perplexity;  /* exp(nll / scored) */
    int windows, window, stride; /* how many, their size and advance */
    double seconds;
} ppl_result;

/* top1: NULL, or [n - 1]: the most likely token at each scored position, top1[t - 1] the
 * prediction of ids[t]. */
int fg_perplexity(fg_model *m, const int *ids, int n, const ppl_options *o, int *top1,
                  ppl_result *r, char *err);

int flexgen_main(int argc, char **argv);

/* ------------------------------------------------------------------------------------------
 * The link between pipeline stages (pipeline.c, §4.4): MPI where the build found mpicc. One
 * process per stage; the schedule sends activations forward and token ids back through it.
 * ------------------------------------------------------------------------------------------ */
typedef struct fg_pipe fg_pipe;
/* The kinds of message between stages (MPI tags). */
enum { FG_TAG_ACTIVATIONS = 1, FG_TAG_TOKENS = 2, FG_TAG_LOGITS = 3 };
int fg_pipe_compiled(void); /* this build has MPI */
/* Under mpirun with more than one process: MPI started, a thread for messages, a crash handler
 * that names the rank. *p is NULL without mpirun or with one process (nothing started). */
int fg_pipe_open(int *argc, char ***argv, fg_pipe **p, char *err);
void fg_pipe_close(fg_pipe *p);
int fg_pipe_rank(const fg_pipe *p);  /* 0 for NULL */
int fg_pipe_size(const fg_pipe *p);  /* 1 for NULL */
/* Non-blocking: returns a message handle at once; buf must stay until the message is released.
 * A message completes in posting order per (peer, tag), as MPI's are. */
int fg_pipe_send(fg_pipe *p, int to, int tag, const void *buf, size_t bytes);
int fg_pipe_recv(fg_pipe *p, int from, int tag, void *buf, size_t bytes);
/* Waits for a message (any thread may); returns the seconds waited, *bytes what arrived. */
double fg_pipe_wait(fg_pipe *p, int msg, size_t *bytes);
void fg_pipe_release(fg_pipe *p, int msg); /* waits, then frees the handle */
double fg_pipe_bytes_sent(const fg_pipe *p);
/* Collective: 0 when rc is 0 on every rank. Otherwise -1 everywhere, and err holds the one line
 * of the job: the lowest failing rank's, prefixed with its rank, on that rank; "" elsewhere. */
int fg_pipe_agree(fg_pipe *p, int rc, char *err);
void fg_pipe_bcast(fg_pipe *p, void *buf, size_t bytes);                  /* from rank 0 */
void fg_pipe_gather(fg_pipe *p, const void *mine, size_t bytes, void *all); /* to rank 0 */
char *fg_pipe_gather_text(fg_pipe *p, const char *mine); /* rank 0: all texts in rank order */

/* Makes the run one stage of the pipeline p (NULL: one stage): the schedule's stage hooks then
 * receive activations from the previous stage, send them to the next, and pass token ids back. */
void fg_pipeline_attach(fg_runtime *rt, fg_pipe *p);

/* ------------------------------------------------------------------------------------------
 * Linear programs (lp.c, §4.3): the placement LP of the policy search (Eq. (1), Appendix A.3)
 * is small and dense; lp.c solves such LPs with a dense two-phase simplex.
 * ------------------------------------------------------------------------------------------ */
typedef enum { LP_LE, LP_EQ, LP_GE } lp_sense;
typedef enum { LP_OPTIMAL, LP_INFEASIBLE, LP_UNBOUNDED } lp_status;
typedef struct {
    int n_vars, n_rows;
    const double *c;         /* [n_vars]: minimize c . x */
    const double *A;         /* [n_rows][n_vars], row-major */
    const lp_sense *sense;   /* [n_rows]: row i is A_i . x {<=, =, >=} b_i */
    const double *b;         /* [n_rows], any sign */
} lp_problem;                /* and x >= 0 */
/* Solves p. On LP_OPTIMAL, x [n_vars] and *objective hold an optimal vertex (otherwise they are
 * left as they were). Returns -1 (err) only when memory runs out or the sizes are invalid
 * (n_vars < 1, n_rows < 0), or the rest of the input is (a NULL array, a sense outside the enum,
 * a value that is not finite), or, a guard never seen to trip, the simplex passes its pivot
 * bound. */
int lp_solve(const lp_problem *p, lp_status *status, double *x, double *objective, char *err);

/* ------------------------------------------------------------------------------------------
 * The cost model (cost_model.c, §4.3 and Appendix A.3), in the paper's symbols. Every latency term of a
 * layer is linear in the placement x = (wg, wc, wn, cg, cc, cn, hg, hc, hn) (fractions, each
 * triple summing to 1), so the same coefficients serve the LP and the evaluation of a policy.
 * ------------------------------------------------------------------------------------------ */
/* A machine's constants (Table 7): bytes/s and FLOP/s, as `flexgen profile` measures them or a
 * hardware file gives them (hardware/NAME.json, keys named as the fields). */
typedef struct {
    double ctog_bdw;                          /* cpu -> gpu */
    double gtoc_bdw_cache, gtoc_bdw_hidden;   /* gpu -> cpu: KV cache, activations */
    double dtoc_bdw;                          /* disk -> cpu */
    double ctod_bdw_cache_p, ctod_bdw_hidden_p, ctod_bdw_g; /* cpu -> disk: prefill cache,
                                                 prefill activations, decode */
    double mm_flops_p, mm_flops_g;            /* compute device: matrix products, prefill/decode */
    double bmm_flops_p, bmm_flops_g;          /* compute device: attention's batched products */
    double cpu_flops;                         /* CPU attention (delegation) */
    double dequant_bdw;      /* 4-bit decompression on the compute device, in bytes of fp16 it
                                gives per second (§5); 0: not modeled (optional in the file) */
    double mem_bdw;          /* the compute device reading a layer's working weights, once per
                                GPU batch: what bounds small-batch decode; 0: not modeled
                                (optional in the file) */
    int gpu_is_host;         /* the gpu tier is host memory, as on the CPU backend: its products
                                read 4-bit weights as stored, and gpu and cpu tiers share the host's
                                memory (optional in the file, default false: a GPU) */
} fg_hardware;
int fg_hardware_read(const char *path, fg_hardware *hw, char *err);
int fg_hardware_write(const char *path, const fg_hardware *hw, char *err);
/* Measures this machine's constants on the runtime's own paths (profile.c) with the backend of
 * `device`, with a 1 GiB file in offload_dir for the disk; progress on stderr when verbose. */
int fg_profile(const char *offload_dir, fg_device device, fg_hardware *hw, int verbose, char *err);

enum { X_WG, X_WC, X_WN, X_CG, X_CC, X_CN, X_HG, X_HC, X_HN, N_X };
enum { T_CTOG, T_GTOC, T_DTOC, T_CTOD, T_COMP, N_TERMS };
extern const char *const fg_cost_term_names[N_TERMS]; /* "ctog", "gtoc", "dtoc", "ctod", "comp" */

typedef struct { double constant, coef[N_X]; } fg_linear; /* seconds: constant + coef . x */

/* What a policy is evaluated for: prompt length s, n generated tokens, the block shape, and the
 * options that change the terms. */
typedef struct {
    int s, n, gbs, ngb;
    int cpu_cache_compute, compress_weight, compress_cache;
    int micro;            /* blocks a pipeline stage keeps in flight (§4.4); 0 or 1: one */
} fg_workload;

/* One layer's latency terms in prefill (pre) and decode (gen, averaged over the n - 1 steps), and
 * the output layer (lm_head) of one generated token, which A.3 leaves out (it is worth about two
 * decoder layers of opt-1.3b). */
typedef struct {
    fg_linear pre[N_TERMS], gen[N_TERMS];
    double head;
} fg_cost_model;

void fg_cost_model_build(const opt_config *c, const fg_workload *w, const fg_hardware *hw,
                         fg_cost_model *m);
double fg_linear_eval(const fg_linear *f, const double x[N_X]);
/* T / bls, the seconds per sequence of the block, for placement x (§4.3: T = T_pre l +
 * T_gen (n - 1) l + head n, each T the max of its terms, overlap assumed); T_pre and T_gen if not
 * NULL. The predicted throughput is n / (T / bls) generated tokens per second. */
double fg_cost_per_token(const fg_cost_model *m, const opt_config *c, const fg_workload *w,
                         const double x[N_X], double *t_pre, double *t_gen);

/* Peak bytes of each tier, linear in the placement, as the runtime accounts them (fg_check_plan):
 * homes of weights, KV cache and activations; on the gpu tier the staging buffers, workspace and
 * logits; on the cpu tier the disk pages in flight; `host` is gpu + cpu when the gpu tier is host
 * memory. Where the weights may go changes constants that are not linear in x (staging arenas
 * exist once any weight is staged; two whole layers are in flight once any is read from disk), so
 * the search solves each case (weights) on its own:
 *   FG_W_GPU      every weight on the gpu tier, read in place (uncompressed, or 4-bit where the
 *                 gpu tier is host memory: the CPU's products read 4-bit): no staging
 *   FG_W_MEMORY   gpu and cpu tiers (or 4-bit on a GPU): staging, nothing read from disk
 *   FG_W_DISK     any tier: staging, and the largest layer twice in flight on the cpu tier */
enum { FG_W_GPU, FG_W_MEMORY, FG_W_DISK, FG_W_CASES };
typedef struct { fg_linear tier[N_TIERS], host; } fg_memory_model;
void fg_memory_model_build(const opt_config *c, const fg_workload *w, const fg_hardware *hw,
                           int weights, fg_memory_model *mm);
/* The case a placement x is in. */
int fg_weights_case(const double x[N_X], int staged_q4); /* staged_q4: 4-bit weights are
                                                          decompressed into staging (a GPU) */

/* The placement a plan of n_prompts sequences realizes (tensor and row granularity), as the cost
 * model's fractions x[N_X]: weights by stored bytes, KV cache and activations by rows of a GPU
 * batch. */
void fg_plan_placement(const fg_model *m, int n_prompts, double x[N_X]);

/* This runtime's verdict on policy p for `model` (dummy weights of seed, placed but not written;
 * no I/O threads): with sequences > 0 and check != 0, the plan check (fg_check_plan) for that many
 * sequences of prompt length s generating n; the placement the plan realizes (x, if not NULL);
 * the capacities the runtime has (st, if not NULL). Defined in plan.c; the policy search is given
 * it (fg_search_request.check) and so does not depend on the runtime. */
typedef int (*fg_plan_check)(const opt_config *model, uint64_t seed, const fg_policy *p,
                             int sequences, int s, int n, int check, double x[N_X], fg_stats *st,
                             char *err);
int fg_runtime_check(const opt_config *model, uint64_t seed, const fg_policy *p, int sequences,
                     int s, int n, int check, double x[N_X], fg_stats *st, char *err);

/* The policy search of §4.3 (policy.c). */
typedef struct {
    int s, n;             /* prompt length, tokens generated per prompt */
    int max_block;        /* sequences there are to run: a block holds no more; 0: no bound */
    double max_latency;   /* seconds one block may take (Fig. 1's latency); 0: no bound */
    fg_plan_check check;  /* check each choice with this runtime's plan (fg_runtime_check); NULL
                             when planning for another machine (its hardware file says a GPU):
                             the memory model decides then */
    fg_plan_check place;  /* for another machine: the placement a policy realizes there
                             (fg_runtime_check, check 0), whole tensors on their tiers; NULL:
                             the percentages as given */
    uint64_t seed;        /* of the dummy weights: their file in the weight dir counts as disk */
    int gbs, ngb;         /* > 0: the block shape is given (the stages of a pipeline share it);
                             only the placement is searched */
} fg_search_request;

typedef struct {
    fg_policy policy;     /* the choice: base's fields with block shape, percent and
                             cpu_cache_compute set */
    double x[N_X];        /* the placement it realizes */
    fg_workload workload;
    fg_cost_model cost;
    double t_pre, t_gen, block_latency, throughput; /* predicted: s, s, s, generated tokens/s */
    int lps, checks;      /* LPs solved and plans checked on the way */
    double seconds;       /* the search's own time */
} fg_search_result;

/* Enumerates GPU batch sizes and numbers of GPU batches; for each, solves the LP that minimizes
 * T / bls under the tiers' capacities (base->capacity; 0: what this machine has), rounds its
 * placement to integer percentages, checks the plan (shrinking the GPU batch until it fits) and
 * keeps the best. Fails with one line when no block of one sequence fits. */
int fg_policy_search(const opt_config *cfg, const fg_hardware *hw, const fg_policy *base,
                     const fg_search_request *req, fg_search_result *out, char *err);
/* Policy p's prediction, at the placement it realizes (FlexGen's cost_model.py given a policy);
 * fails with the plan check's line when it does not fit. */
int fg_policy_evaluate(const opt_config *cfg, const fg_hardware *hw, const fg_policy *p,
                       const fg_search_request *req, fg_search_result *out, char *err);

#endif
