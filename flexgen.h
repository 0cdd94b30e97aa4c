/* flexgen.h: the one shared header of FlexGen in C.
 *
 * What lives where (see README.md for the map to the paper):
 *   opt_model.c  OPT configs, safetensors checkpoints (mmap), dummy weights, the CPU layer math,
 *                sampling (paper §3: the generative inference computation)
 *   tokenizer.c  GPT-2 byte-level BPE over OPT's vocab.json / merges.txt
 *   flexgen.c    the runtime: blocks of GPU batches walked in the order of Fig. 4, the report,
 *                the CLI (§4.1)
 *
 * Conventions: functions that can fail on bad input return 0 on success and -1 on failure, after
 * writing one line (no newline) into `err`, a buffer of FG_ERR_LEN bytes that names the file,
 * tensor or flag and what is wrong. Nothing here calls exit().
 */
#ifndef FLEXGEN_H
#define FLEXGEN_H

#include <stddef.h>
#include <stdint.h>

#define FG_ERR_LEN 512

/* OPT's special tokens (DESIGN.md, "OPT facts"). */
#define OPT_PAD_ID 1
#define OPT_BOS_ID 2 /* `</s>`, prepended to every prompt */
#define OPT_EOS_ID 2
#define OPT_POS_OFFSET 2 /* learned positions are looked up at position + 2 */

/* Writes one line into err (FG_ERR_LEN bytes; err may be NULL) and returns -1. */
int fg_fail(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A whole file, NUL-terminated (*len, if not NULL, excludes the NUL); NULL and err on failure. */
char *fg_read_file(const char *path, size_t *len, char *err);

/* ------------------------------------------------------------------------------------------
 * Half precision. Weights and the KV cache are stored as IEEE fp16; compute is fp32.
 * ------------------------------------------------------------------------------------------ */
typedef uint16_t fp16;

float fp16_to_fp32(fp16 h);
fp16 fp32_to_fp16(float f); /* round to nearest even; overflow gives +-Inf */
float bf16_to_fp32(uint16_t b);
void fp16_to_fp32_n(const fp16 *src, float *dst, size_t n); /* vectorized where F16C exists */
void fp32_to_fp16_n(const float *src, fp16 *dst, size_t n);

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
 * Weights, as the compute device holds them: fp32 working copies of fp16 values (checkpoints in
 * fp32 or bf16 are rounded to fp16 first, so every source gives the same numbers).
 * Linear weights are stored transposed, [in][out] (the checkpoint has [out][in]);
 * opt_weight_locate() says where any checkpoint tensor's elements are.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    float *attn_ln_w, *attn_ln_b; /* self_attn_layer_norm */
    float *wqkv, *bqkv;           /* [hidden][3 * hidden]: q_proj, k_proj, v_proj side by side */
    float *wo, *bo;               /* out_proj, [hidden][hidden] */
    float *ffn_ln_w, *ffn_ln_b;   /* final_layer_norm (of the layer) */
    float *fc1_w, *fc1_b;         /* [hidden][ffn] */
    float *fc2_w, *fc2_b;         /* [ffn][hidden] */
} opt_layer_weights;

typedef struct {
    opt_config cfg;
    float *embed_tokens;    /* [vocab][word_dim] (checkpoint layout: rows are looked up) */
    float *embed_positions; /* [max_pos + 2][hidden] */
    float *project_in;      /* [word_dim][hidden], NULL when word_dim == hidden */
    float *project_out;     /* [hidden][word_dim], NULL when word_dim == hidden */
    float *final_ln_w, *final_ln_b; /* NULL when !pre_ln (350m) */
    float *lm_head;         /* [vocab][word_dim]; == embed_tokens when tied */
    opt_layer_weights *layers;
    float *storage;         /* the one allocation all of the above point into */
    size_t storage_floats;
} opt_weights;

/* Dummy weights, deterministic from seed whatever the thread count, scaled so that activations
 * stay finite through every layer of every size. */
int opt_weights_dummy(const opt_config *cfg, uint64_t seed, opt_weights *w, char *err);
/* An HF checkpoint directory: config.json and model.safetensors, or the shards listed in
 * model.safetensors.index.json. Files are mapped, converted, and unmapped. */
int opt_weights_load(const char *dir, opt_weights *w, char *err);
void opt_weights_free(opt_weights *w);
/* Where checkpoint tensor `name` (HF name, with or without "model.") is held: its element [r][c]
 * is at first[r * row_stride + c * col_stride]. Returns -1 for a name the model does not have. */
int opt_weight_locate(const opt_weights *w, const char *name, const float **first,
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

/* ------------------------------------------------------------------------------------------
 * One GPU batch (§4.1: the unit the schedule of Fig. 4 computes): its sequences' hidden states
 * for the tokens in flight and its KV cache. Prompts are left-padded: sequence b's real tokens
 * start at cache slot pad[b]; position ids follow HF (slot - pad[b] + OPT_POS_OFFSET).
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    int batch;    /* sequences */
    int max_len;  /* KV capacity in tokens (padded prompt + generated) */
    int len;      /* slots already in the cache */
    int n_new;    /* tokens in flight this step: the padded prompt at prefill, 1 in decode */
    int *pad;     /* [batch] */
    int *tokens;  /* [batch][n_new] input ids of this step */
    float *x;     /* [batch * n_new][hidden] hidden states */
    fp16 *k, *v;  /* [n_layers][batch][max_len][hidden], rounded to fp16 as produced */
} gpu_batch;

int gpu_batch_init(gpu_batch *gb, const opt_config *cfg, int batch, int max_len, int max_new,
                   char *err);
void gpu_batch_free(gpu_batch *gb);

/* Scratch buffers of the compute device, shared by all GPU batches. */
typedef struct {
    size_t rows;            /* capacity in token rows */
    int max_len;            /* the longest KV cache it serves (a GPU batch's max_len at most) */
    int n_threads;
    float *h, *attn;        /* [rows][hidden] */
    float *qkv;             /* [rows][3 * hidden]: q, k, v side by side */
    float *ffn;             /* [rows][max(ffn, hidden)] */
    float *thread_scratch;  /* per thread: K, V slices and scores of one (sequence, head) */
    size_t thread_floats;
} opt_workspace;

int opt_workspace_init(opt_workspace *ws, const opt_config *cfg, size_t rows, int max_len,
                       char *err);
void opt_workspace_free(opt_workspace *ws);

/* The forward pass, one step of Fig. 4's innermost loop at a time. gb->tokens and gb->n_new
 * describe the step; opt_output() advances gb->len by n_new. */
void opt_embed(const opt_weights *w, gpu_batch *gb, opt_workspace *ws);
void opt_layer(const opt_weights *w, int layer, gpu_batch *gb, opt_workspace *ws);
/* Logits of the last token of each sequence: [batch][vocab]. */
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

fg_tokenizer *tokenizer_load(const char *vocab_path, const char *merges_path, char *err);
void tokenizer_free(fg_tokenizer *t);
int tokenizer_vocab_size(const fg_tokenizer *t);
/* Encodes len bytes of text (no BOS added). *ids is malloc'd; the caller frees it. */
int tokenizer_encode(const fg_tokenizer *t, const char *text, size_t len, int **ids, int *n_ids,
                     char *err);
/* Decodes to a malloc'd NUL-terminated byte string; *out_len excludes the NUL. Ids the vocab
 * does not hold decode to nothing. Returns NULL only when out of memory. */
char *tokenizer_decode(const fg_tokenizer *t, const int *ids, int n_ids, size_t *out_len);

/* ------------------------------------------------------------------------------------------
 * The runtime (flexgen.c).
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    int gpu_batch_size, num_gpu_batches; /* the block is their product (§4.1) */
    int gen_len;
    float temperature, top_p;
    uint64_t seed;
    int stop_at_eos;
    int verbose; /* progress on stderr */
} gen_options;

typedef struct {
    double prefill_latency, decode_latency; /* seconds, summed over blocks */
    int64_t prefill_tokens, decode_tokens;  /* FlexGen's counts: prompts x prompt_len, x (gen-1) */
} gen_timing;

/* Generates gen_len tokens for each prompt, in blocks of gpu_batch_size x num_gpu_batches.
 * out_tokens: [n_prompts][gen_len] (tokens after an EOS are OPT_PAD_ID with stop_at_eos).
 * logits: NULL, or [n_prompts][gen_len][vocab] (rows not computed are 0). */
int generate(const opt_weights *w, const gen_options *opt, int n_prompts, int *const *prompts,
             const int *prompt_lens, int *out_tokens, float *logits, gen_timing *timing,
             char *err);

int flexgen_main(int argc, char **argv);

#endif
