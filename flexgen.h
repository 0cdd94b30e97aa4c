/* flexgen.h: the paper's types, shared by its five files (docs/DESIGN.md maps them to the paper):
 *   opt_model.c  the OPT forward pass of one GPU batch on the CPU, and the CPU backend (§3)
 *   quant.c      4-bit group-wise compression, top-K sparse attention (§5)
 *   flexgen.c    tiers, placement, the plan check, I/O threads, the block schedule (§4.1, §4.2)
 *   lp.c         the cost model, the simplex, the policy search (§4.3, Appendix A.3)
 *   flexgen.cu   the CUDA backend: the same operation table with cuBLAS
 * What they need from the support layer (errors, fp16, fast kernels, weight table): support/support.h.
 *
 * Conventions: a function that can fail on bad input returns 0, or -1 after writing one line
 * into `err` (FG_ERR_LEN bytes) that names the file, tensor, tier or flag and what is wrong.
 */
#ifndef FLEXGEN_H
#define FLEXGEN_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define FG_ERR_LEN 512
#define FG_PATH_LEN 4200 /* a path as the runtime keeps it, with room for a suffix */

/* OPT's special tokens; learned positions are looked up at position + 2. */
enum { OPT_PAD_ID = 1, OPT_BOS_ID = 2, OPT_EOS_ID = 2, OPT_POS_OFFSET = 2 };

typedef uint16_t fp16; /* weights and the KV cache are stored in IEEE fp16; compute is fp32 */
float fp16_to_fp32(fp16 h); /* exact (support/util.c) */

/* ---- The model (§3) ---- */
typedef struct {
    char name[64];
    int n_layers, hidden, n_heads, ffn, vocab; /* hidden is h1 in the paper, ffn h2 */
    int max_pos;  /* 2048; the position table has max_pos + 2 rows */
    int word_dim; /* word_embed_proj_dim: == hidden except for 350m (512) */
    int pre_ln;   /* do_layer_norm_before: 1 for all sizes but 350m */
} opt_config;

/* A decoder layer's weights as compute reads them: fp16, or 4-bit (§5) where opt_weights.q4.
 * Linear weights are stored transposed, [in][out]. */
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
    fp16 *embed_tokens;    /* [vocab][word_dim] */
    fp16 *embed_positions; /* [max_pos + 2][hidden] */
    fp16 *project_in;      /* [word_dim][hidden], NULL when word_dim == hidden */
    fp16 *project_out;     /* [hidden][word_dim], NULL when word_dim == hidden */
    fp16 *final_ln_w, *final_ln_b; /* NULL when !pre_ln (350m) */
    fp16 *lm_head;         /* [vocab][word_dim]; == embed_tokens when tied */
    opt_layer_weights *layers;
    int q4, q4_int8;       /* 4-bit matrices and tables (§5, quant.c); times int8 activations (int8.c) */
    fp16 *storage;         /* one allocation all of the above point into, or NULL */
    size_t storage_values;
} opt_weights;

/* A sequence's KV cache is pages of page_tokens tokens (vLLM's PagedAttention): token `slot` is row
 * kv_page_row(pages, page_tokens, slot), through its page table, or row `slot` (pages NULL: in order). */
#define FG_PAGE_TOKENS 16 /* a page's tokens, unless a tier's pool needs fewer rows with whole sequences */
#ifndef FG_HOST_DEVICE /* flexgen.cu defines both for the device, which runs these functions too */
#define FG_HOST_DEVICE
#define FG_HALF_TO_FLOAT(h) fp16_to_fp32(h)
#endif
static inline FG_HOST_DEVICE size_t kv_page_row(const int *pages, int page_tokens, int slot) {
    return pages ? (size_t)pages[slot / page_tokens] * page_tokens + (size_t)(slot % page_tokens) : (size_t)slot;
}

/* One GPU batch (§4.1: the unit the schedule computes) for one layer: its sequences' hidden states
 * for the tokens in flight and, per sequence, where that layer's K and V cache rows are. A step's
 * rows are left-padded: sequence b's first pad[b] rows are padding, the rest its tokens, which go
 * to cache slots past[b] on. The cache holds no padding. */
typedef struct {
    int batch;    /* sequences */
    int max_len, page_tokens; /* KV capacity of a sequence in tokens (prompt + generated); of a page */
    int n_new;    /* rows in flight per sequence this step: the longest prompt at prefill, 1 in decode */
    int all_rows; /* the output layer gives the logits of every token in flight */
    int *past, *pad; /* [batch]: tokens already in the sequence's cache; its padding rows */
    int *tokens;  /* [batch][n_new] input ids of this step */
    void *x;      /* [batch * n_new][hidden]: fp32 on the CPU, fp16 on CUDA (act_elem) */
    int kv_q4;    /* the cache is 4-bit (§5): each row [heads][head_dim] grouped along head_dim */
    float attn_sparsity;  /* decode attention keeps this fraction of the past (§5); 1: all */
    int64_t *v_rows_read; /* [batch]: V rows decode attention read (sparse or 4-bit cache) */
    void **k, **v;        /* [batch]: this layer's cache rows, opt_kv_row_bytes() each */
    const int **k_pages, **v_pages; /* [batch]: the page table of k[b] (v[b]); NULL: rows in order */
} gpu_batch;

/* Scratch of the compute device, shared by all GPU batches (support/workspace.c sizes it). */
typedef struct {
    size_t rows;           /* capacity in token rows */
    int max_len, n_threads;
    float *h, *attn;       /* [rows][hidden] */
    float *qkv;            /* [rows][3 * hidden]: q, k, v side by side */
    float *ffn;            /* [rows][max(ffn, hidden)] */
    float *thread_scratch; /* per thread: one (sequence, head)'s K, V and scores, or lm_head rows */
    size_t thread_floats;
    float *wide;           /* the fast products' scratch for prefill; NULL in decode */
    float *vec;            /* a bias, or a norm's weight and bias, widened to fp32 */
    float *x32;            /* fp16 hidden states widened (the cpu-fp16 device); NULL otherwise */
    void *device;          /* the CUDA backend's own buffers; NULL on the CPU */
} opt_workspace;

/* The forward pass (opt_model.c), one step of Fig. 4's innermost loop at a time. opt_layer writes
 * this step's K and V into the cache; the caller then advances past[b] by its n_new - pad[b]. */
void opt_embed(const opt_weights *w, gpu_batch *gb, opt_workspace *ws);
void opt_layer(const opt_weights *w, int layer, gpu_batch *gb, opt_workspace *ws);
void opt_cache_attention(const opt_config *c, gpu_batch *gb, opt_workspace *ws);
void opt_output(const opt_weights *w, gpu_batch *gb, opt_workspace *ws, float *logits);
size_t opt_kv_row_bytes(const opt_config *c, int q4); /* one token's K (or V) of one layer */

/* One head's keys (or values) as decode attention reads them: key j is row kv_page_row(pages,
 * page_tokens, j) of the cache (fp16 or 4-bit), but keys from first_fresh on: this step's fp32 rows. */
typedef struct {
    const char *rows;
    const int *pages; int page_tokens;
    size_t stride;
    int q4, head, head_dim, first_fresh;
    const float *fresh;
    size_t fresh_stride;
} opt_kv_rows;
/* One decode query over nk keys: softmax(scale q.K) V, with §5's top-K when sparsity < 1.
 * Returns the V rows read. scratch: 3 nk + head_dim floats. */
int opt_attend_decode(const float *q, const opt_kv_rows *K, const opt_kv_rows *V, int nk,
                      float scale, float sparsity, float *scratch, float *out);
/* The plain products that the fast kernels (support/matmul.c) are held to; q4 > 0: q4 4-bit parts. */
void matmul_reference(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                      int accumulate);
void embed_t_reference(const float *x, int rows, int dim, const void *E, int q4, int n, float *y);

/* ---- 4-bit group-wise compression and top-K attention (quant.c, §5) ---- */
#define Q4_GROUP 64
size_t q4_bytes(size_t outer, size_t len, size_t inner);
void q4_compress(const float *src, size_t outer, size_t len, size_t inner, uint8_t *dst);
void q4_decompress(const uint8_t *src, size_t outer, size_t len, size_t inner, float *dst);
void q4_decompress_row(const uint8_t *src, size_t len, size_t inner, size_t r, float *dst);
int topk_keep(const float *w, int n, int k, int *keep, float *scratch);

/* Value e of a 4-bit tensor [outer][len][inner] (quant.c's layout): one thread of flexgen.cu's
 * decompression kernel, held on the host to q4_decompress's bits (exact fp16, one rounding). */
static inline FG_HOST_DEVICE float q4_value(const uint8_t *src, size_t len, size_t inner, size_t e) {
    size_t o = e / (len * inner), r = (e / inner) % len, i = e % inner;
    size_t G = (len + Q4_GROUP - 1) / Q4_GROUP, g = r / Q4_GROUP, p = (r % Q4_GROUP) / 2;
    const uint8_t *bytes = src + o * G * inner * (Q4_GROUP / 2 + 4);
    const fp16 *mins = (const fp16 *)(bytes + G * inner * (Q4_GROUP / 2)), *scales = mins + G * inner;
    int q = (bytes[(g * (Q4_GROUP / 2) + p) * inner + i] >> (r % 2 ? 0 : 4)) & 15;
    return fmaf((float)q, FG_HALF_TO_FLOAT(scales[g * inner + i]), FG_HALF_TO_FLOAT(mins[g * inner + i]));
}

/* ---- Tiers, policy and the backends' operation table (§4.2) ---- */
typedef enum { TIER_GPU, TIER_CPU, TIER_DISK, N_TIERS } fg_tier;
typedef enum { LINK_DISK_TO_CPU, LINK_CPU_TO_GPU, LINK_GPU_TO_CPU, LINK_CPU_TO_DISK, N_LINKS } fg_link;
extern const char *const fg_tier_names[N_TIERS], *const fg_link_names[N_LINKS], *const fg_tier_flags[N_TIERS];

/* auto: CUDA where a GPU is present, else the CPU; cpu-fp16: the CPU with fp16 activations. */
typedef enum { FG_DEVICE_AUTO, FG_DEVICE_CPU, FG_DEVICE_CUDA, FG_DEVICE_CPU_FP16 } fg_device;

/* The placement in the paper's symbols: percent of the weights (w), KV cache (c) and hidden
 * states (h) on the gpu (g) and cpu (c) tiers; disk holds the rest (wn = 100 - wg - wc, ...). */
typedef struct { int wg, wc, cg, cc, hg, hc; } fg_percent;

typedef struct {
    fg_device device;
    int gpu_batch_size, num_gpu_batches; /* the block is their product (§4.1) */
    fg_percent percent;
    int overlap;             /* I/O on its own threads, overlapping compute (Fig. 4) */
    int cpu_cache_compute;   /* decode attention over a cpu or disk cache runs on the CPU */
    int pin_weight;          /* pinned cpu-tier weights (CUDA) */
    int compress_weight, compress_cache; /* 4-bit group-wise (§5) */
    int int8_activations;    /* 4-bit matrices times int8 activations on the CPU (support/int8.c) */
    float attn_sparsity;     /* decode attention keeps this fraction of the past (§5); 1: all */
    double capacity[N_TIERS]; /* bytes; 0: what the machine has */
    const char *offload_dir; /* disk tier files; NULL: FG_DEFAULT_OFFLOAD_DIR */
    const char *weight_dir;  /* where dummy weights on disk are kept; NULL: ~/.cache/flexgen */
    int trace, verbose;      /* record a Chrome trace; progress on stderr */
    int stage, n_stages;     /* pipeline stage `stage` of n_stages (§4.4); 1: the whole model */
} fg_policy;
#define FG_DEFAULT_OFFLOAD_DIR "/var/tmp"
fg_policy fg_default_policy(void); /* all on the gpu tier, overlap on, a 2 x 16 block, the CPU */

typedef struct {
    double capacity[N_TIERS], peak[N_TIERS], current[N_TIERS], link_bytes[N_LINKS]; /* bytes */
    double host_memory;      /* what gpu and cpu tiers share where the gpu tier is host memory */
} fg_stats;

/* The compute device's operations: the schedule calls only these, so one loop drives the CPU
 * (opt_model.c) and CUDA (flexgen.cu). Pointers to the gpu tier are the device's. */
typedef struct {
    const char *name;
    int gpu_is_host;         /* the gpu tier is host memory (the CPU) */
    size_t weight_elem;      /* bytes of one working weight value: 2 (fp16) on both */
    size_t act_elem;         /* bytes of one activation: 4 on the CPU, 2 on CUDA */
    void *(*alloc)(size_t bytes); /* gpu-tier memory, 64-byte aligned, zeroed */
    void (*free)(void *p);
    void *(*host_alloc)(size_t bytes, int pinned); /* cpu-tier memory, zeroed */
    void (*host_free)(void *p);
    void (*weights_in)(void *dst, const fp16 *src, size_t n); /* fp16 (host) -> working */
    void (*weights_in_q4)(void *dst, const void *src, void *landing, size_t outer, size_t len,
                          size_t inner); /* 4-bit -> working, landing first (gpu tier) if need be */
    void (*copy_in)(void *dst, const void *src, size_t bytes);  /* cpu -> gpu */
    void (*copy_out)(void *dst, const void *src, size_t bytes); /* gpu -> cpu */
    void (*copy)(void *dst, const void *src, size_t bytes);     /* gpu -> gpu */
    size_t (*workspace_bytes)(const opt_config *cfg, size_t rows, int max_prompt, int max_len);
    int (*workspace_init)(opt_workspace *ws, const opt_config *cfg, size_t rows, int max_prompt,
                          int max_len, char *err);
    void (*workspace_free)(opt_workspace *ws);
    void (*embed)(const opt_weights *w, gpu_batch *gb, opt_workspace *ws);
    void (*layer)(const opt_weights *w, int layer, gpu_batch *gb, opt_workspace *ws);
    void (*output)(const opt_weights *w, gpu_batch *gb, opt_workspace *ws, float *logits);
    double (*device_memory)(void); /* free device memory less a reserve; NULL: host memory */
    int reads_q4;            /* the products read 4-bit weights as stored (the CPU) */
    double device_reserve;   /* gpu-tier bytes held beyond the runtime's (CUDA's context) */
    double host_reserve;     /* cpu-tier bytes held beyond the runtime's (CUDA's copy buffers) */
    size_t (*delegated_bytes)(const opt_config *cfg, size_t rows, int max_len); /* cpu tier, §4.2; CPU: NULL */
} fg_backend;
extern const fg_backend fg_cpu_backend;
const fg_backend *fg_cuda_backend(char *err); /* NULL, with the reason, where there is no GPU */

/* ---- A run (flexgen.c, §4.1, §4.2) ---- */
typedef struct fg_runtime fg_runtime; /* tiers with their accounting, the I/O threads */
typedef struct fg_model fg_model;     /* a model placed on the tiers */
int fg_runtime_open(const fg_policy *p, fg_runtime **rt, char *err);
const fg_backend *fg_runtime_backend(const fg_runtime *rt);
void fg_runtime_close(fg_runtime *rt); /* removes every file the run made in the offload dir */
void fg_runtime_stats(const fg_runtime *rt, fg_stats *s);
/* `model`: an OPT size name (dummy weights from seed) or an HF checkpoint directory; its weights
 * go to their homes on the first generate() (or fg_model_load). */
int fg_model_open(fg_runtime *rt, const char *model, uint64_t seed, fg_model **m, char *err);
int fg_model_open_dummy(fg_runtime *rt, const opt_config *cfg, uint64_t seed, fg_model **m, char *err);
const opt_config *fg_model_config(const fg_model *m);
int fg_model_load(fg_model *m, char *err);
void fg_model_close(fg_model *m);
/* The whole plan (weights, KV cache, activations, staging, workspace, per tier) against the
 * capacities, before anything is allocated; the cache counts the pages of lens (NULL: all max_prompt). */
int fg_check_plan(const fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len, char *err);

typedef struct {
    int gen_len;
    float temperature, top_p;
    uint64_t seed;
    int stop_at_eos, refill, verbose; /* refill: an ended sequence's slot takes the next prompt */
    const int *index;     /* NULL, or [n_prompts]: each prompt's place in the job (sampling's seed) */
    const int *forced;    /* NULL, or [n_prompts][gen_len]: tokens fed back (teacher forcing) */
    float *prompt_logits; /* NULL, or [n_prompts][longest prompt][vocab]: prefill's logits */
} gen_options;

typedef struct {
    double prefill_latency, decode_latency; /* seconds, summed over blocks */
    int64_t prefill_tokens, decode_tokens, rows; /* FlexGen's counts; token rows computed */
    int64_t cache_rows, cache_tokens; /* each sequence's KV cache at its end: rows of its pages, tokens */
    int page_tokens;      /* tokens per page of the KV cache (of the last block) */
    double compute_seconds, bubble_seconds, disk_read_seconds;
} gen_timing;

/* gen_len tokens for each prompt, in blocks of gpu_batch_size x num_gpu_batches. out_tokens:
 * [n_prompts][gen_len] (OPT_PAD_ID after an EOS with stop_at_eos); logits: NULL or [..][vocab]. */
int generate(fg_model *m, const gen_options *opt, int n_prompts, int *const *prompts,
             const int *prompt_lens, int *out_tokens, float *logits, gen_timing *timing, char *err);

/* ---- Linear programs (lp.c, §4.3): minimize c.x subject to A_i . x {<=, =, >=} b_i, x >= 0 ---- */
typedef enum { LP_LE, LP_EQ, LP_GE } lp_sense;
typedef enum { LP_OPTIMAL, LP_INFEASIBLE, LP_UNBOUNDED } lp_status;
typedef struct {
    int n_vars, n_rows;
    const double *c, *A;     /* [n_vars], [n_rows][n_vars] row-major */
    const lp_sense *sense; const double *b; /* [n_rows] */
} lp_problem;
/* x and *objective are set on LP_OPTIMAL; -1 (err) only for invalid input or no memory. */
int lp_solve(const lp_problem *p, lp_status *status, double *x, double *objective, char *err);

/* ---- The cost model (lp.c, §4.3, Appendix A.3), in the paper's symbols ---- */
/* A machine's constants (Table 7), bytes/s and FLOP/s (support/profile.c reads and writes them). */
typedef struct {
    double ctog_bdw, gtoc_bdw_cache, gtoc_bdw_hidden, dtoc_bdw;
    double ctod_bdw_cache_p, ctod_bdw_hidden_p, ctod_bdw_g; /* cpu -> disk */
    double mm_flops_p, mm_flops_g, bmm_flops_p, bmm_flops_g; /* prefill / decode */
    double cpu_flops;  /* CPU attention (delegation) */
    double dequant_bdw, mem_bdw; /* 4-bit decompression (fp16 bytes out), reading a layer's working weights */
    double mm_flops_int8_p, mm_flops_int8_g; /* --int8-activations' products; these 4: 0, not modeled */
    int gpu_is_host;    /* the gpu tier is host memory (the CPU backend) */
} fg_hardware;

enum { X_WG, X_WC, X_WN, X_CG, X_CC, X_CN, X_HG, X_HC, X_HN, N_X }; /* the placement x */
enum { T_CTOG, T_GTOC, T_DTOC, T_CTOD, T_COMP, N_TERMS };           /* a layer's latencies */
extern const char *const fg_cost_term_names[N_TERMS];
typedef struct { double constant, coef[N_X]; } fg_linear; /* seconds: constant + coef . x */

typedef struct {
    int s, n, gbs, ngb, s_mean; /* longest prompt, generated tokens, block shape; costs take s_mean (0: s) */
    int cpu_cache_compute, compress_weight, compress_cache, int8; /* int8: --int8-activations */
    int micro;            /* blocks a pipeline stage keeps in flight (§4.4); 0 or 1: one */
} fg_workload;

/* A layer's terms in prefill and decode, and the output layer of one token (head). */
typedef struct { fg_linear pre[N_TERMS], gen[N_TERMS]; double head; } fg_cost_model;
void fg_cost_model_build(const opt_config *c, const fg_workload *w, const fg_hardware *hw,
                         fg_cost_model *m);
double fg_linear_eval(const fg_linear *f, const double x[N_X]);
/* T / bls, the seconds per sequence of the block for placement x; T_pre and T_gen if not NULL. */
double fg_cost_per_token(const fg_cost_model *m, const opt_config *c, const fg_workload *w,
                         const double x[N_X], double *t_pre, double *t_gen);
/* Each tier's peak bytes, linear in x, in the runtime's accounting, for one case of where the
 * weights may go: all on the gpu tier, in memory, or any tier (lp.c explains). */
enum { FG_W_GPU, FG_W_MEMORY, FG_W_DISK, FG_W_CASES };
typedef struct { fg_linear tier[N_TIERS], host; } fg_memory_model;
void fg_memory_model_build(const opt_config *c, const fg_workload *w, const fg_hardware *hw,
                           int weights, fg_memory_model *mm);
int fg_weights_case(const double x[N_X], int staged_q4);

/* This runtime's verdict on policy p (flexgen.c's fg_runtime_check, handed to the search): the
 * plan check for `sequences` (with check), the placement it realizes (x), the capacities (st). */
typedef int (*fg_plan_check)(const opt_config *model, uint64_t seed, const fg_policy *p,
                             int sequences, int s, int n, int check, double x[N_X], fg_stats *st,
                             char *err);
int fg_runtime_check(const opt_config *model, uint64_t seed, const fg_policy *p, int sequences,
                     int s, int n, int check, double x[N_X], fg_stats *st, char *err);
void fg_plan_placement(const fg_model *m, int n_prompts, double x[N_X]);

/* ---- The policy search (lp.c, §4.3) ---- */
typedef struct {
    int s, n, s_mean;     /* longest prompt, tokens generated each; the prompts' mean length (0: s) */
    int max_block;        /* sequences there are: a block holds no more; 0: no bound */
    double max_latency;   /* seconds one block may take (Fig. 1's latency); 0: no bound */
    fg_plan_check check;  /* check each choice with this runtime's plan; NULL for another machine */
    fg_plan_check place;  /* for another machine: the placement a policy realizes there */
    uint64_t seed;        /* of the dummy weights */
    int gbs, ngb;         /* > 0: the block shape is given; only the placement is searched */
} fg_search_request;

typedef struct {
    fg_policy policy;     /* the choice */
    double x[N_X];        /* the placement it realizes */
    fg_workload workload;
    fg_cost_model cost;
    double t_pre, t_gen, block_latency, throughput; /* predicted */
    int lps, checks;      /* LPs solved and plans checked */
    double seconds;       /* the search's own time */
} fg_search_result;

int fg_policy_search(const opt_config *cfg, const fg_hardware *hw, const fg_policy *base,
                     const fg_search_request *req, fg_search_result *out, char *err);
int fg_policy_evaluate(const opt_config *cfg, const fg_hardware *hw, const fg_policy *p,
                       const fg_search_request *req, fg_search_result *out, char *err);
/* The LP's fractions of one kind of data on the gpu and cpu tiers as percentages, summing to <= 100. */
void fg_round_pair(double gpu, double cpu, int *g, int *c);

#endif
