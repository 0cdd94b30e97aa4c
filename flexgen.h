/* flexgen.h: the runtime (§4.1, §4.2) and the policy search (§4.3), on tiers.h's state (the
 * policy, a run, a model placed on the tiers, a block of GPU batches in flight): generate() and
 * the tokens it takes, and the cost model, the simplex and the search of lp.c. docs/DESIGN.md maps
 * each file to the paper:
 *   opt_model.c    the OPT forward pass of one GPU batch on the CPU (§3)
 *   llama_model.c  the same step for LLaMA, Mistral and Qwen2 (§3)
 *   quant.c        4-bit group-wise compression, top-K sparse attention (§5)
 *   flexgen.c      the block schedule, its verbs, a block's step, generate() (§4.1, §4.2)
 *   tiers.c        the tiers, the weights' homes and staging, a block's plan and buffers (§4.2)
 *   lp.c           the cost model, the simplex, the policy search (§4.3, Appendix A.3)
 *   flexgen.cu     the CUDA backend: the same operation table with cuBLAS
 * What the runtime takes from the support layer (errors, the disk arena, the I/O threads, the
 * KV cache's pages, checkpoints, sampling, the trace): support/support.h.
 */
#ifndef FLEXGEN_H
#define FLEXGEN_H

#include "model.h"
#include "support/support.h"
#include "tiers.h"

struct gen_options {
    int gen_len;
    float temperature, top_p;
    uint64_t seed;
    int stop_at_eos, refill, verbose; /* refill: an ended sequence's slot takes the next prompt */
    int n_eos, eos_ids[FG_MAX_EOS];   /* the ids that end a sequence (n_eos 0: OPT's </s>) */
    const int *index;  /* NULL, or [n_prompts]: each prompt's place in the job (sampling's seed) */
    const int *forced; /* NULL, or [n_prompts][gen_len]: tokens fed back (teacher forcing) */
    float *prompt_logits; /* NULL, or [n_prompts][longest prompt][vocab]: prefill's logits */
    int *finish_step; /* NULL, or [n_prompts]: the step (counted over the job's blocks) after which
                         each prompt's last token was taken */
    void (*group_done)(void *ctx, int first, int count); /* NULL, or called (first stage) as a GPU
                             batch's group ends: prompts first .. first + count - 1 have their
                             tokens */
    void *group_ctx;
};

typedef struct {
    double prefill_latency, decode_latency;      /* seconds, summed over blocks */
    int64_t prefill_tokens, decode_tokens, rows; /* FlexGen's counts; token rows computed */
    int64_t cache_rows, cache_tokens; /* each sequence's KV cache at its end: rows of its pages,
                                         tokens */
    int page_tokens;                  /* tokens per page of the KV cache (of the last block) */
    int64_t cache_peak_rows[N_TIERS]; /* the most rows of pages each tier's cache held at once */
    int64_t completed;         /* sequences that took their last token (the gen_len-th, or with
                                  --stop-at-eos their </s>), and the seconds from */
    double completion_seconds; /* generate()'s start to each of those tokens, summed (Appendix
                                  A.2) */
    double compute_seconds, bubble_seconds, disk_read_seconds;
    int device_counted; /* the backend counts what the host asks of it (CUDA) */
    fg_device_counts prefill_counts, decode_counts; /* summed over prefill steps, decode steps */
    fg_device_counts decode_step_most;              /* the most of each in one decode step */
    int64_t decode_steps; /* decode steps counted (a block's step on this stage) */
} gen_timing;

/* gen_len tokens for each prompt, in blocks of gpu_batch_size x num_gpu_batches. out_tokens:
 * [n_prompts][gen_len] (OPT_PAD_ID after an EOS with stop_at_eos); logits: NULL or [..][vocab]. */
int generate(fg_model *m, const gen_options *opt, int n_prompts, int *const *prompts,
             const int *prompt_lens, int *out_tokens, float *logits, gen_timing *timing, char *err);

/* Bytes of GPU batch k's activations this step, all of its sequences'. */
size_t batch_act_bytes(const block *bl, int k);
/* Takes the tokens chosen for each slot (bl->ids) as its prompt's output and its next input;
 * returns how many sequences are still running. */
int take_tokens(block *bl, const gen_options *opt, int *out_tokens);
int gen_is_eos(const gen_options *opt, int tok); /* tok ends a sequence */

/* ---- Linear programs (lp.c, §4.3): minimize c.x subject to A_i . x {<=, =, >=} b_i, x >= 0
 * ---- */
typedef enum { LP_LE, LP_EQ, LP_GE } lp_sense;
typedef enum { LP_OPTIMAL, LP_INFEASIBLE, LP_UNBOUNDED } lp_status;
typedef struct {
    int n_vars, n_rows;
    const double *c, *A; /* [n_vars], [n_rows][n_vars] row-major */
    const lp_sense *sense;
    const double *b; /* [n_rows] */
} lp_problem;
/* x and *objective are set on LP_OPTIMAL; -1 (err) only for invalid input or no memory. */
int lp_solve(const lp_problem *p, lp_status *status, double *x, double *objective, char *err);

/* ---- The cost model (lp.c, §4.3, Appendix A.3), in the paper's symbols ---- */
/* A machine's constants (Table 8), bytes/s and FLOP/s (app/profile.c reads and writes them). */
typedef struct {
    double ctog_bdw, gtoc_bdw_cache, gtoc_bdw_hidden, dtoc_bdw;
    double ctod_bdw_cache_p, ctod_bdw_hidden_p, ctod_bdw_g;  /* cpu -> disk */
    double mm_flops_p, mm_flops_g, bmm_flops_p, bmm_flops_g; /* prefill / decode */
    double cpu_flops;                                        /* CPU attention (delegation) */
    double dequant_bdw, mem_bdw; /* 4-bit decompression (fp16 bytes out), reading a layer's working
                                    weights */
    double mm_flops_int8_p, mm_flops_int8_g; /* --int8-activations' products; these 4: 0, not
                                                modeled */
    double launch_seconds, wait_seconds; /* a GPU's host: queueing a launch; waiting for the GPU (0:
                                            not modeled) */
    int gpu_is_host;                     /* the gpu tier is host memory (the CPU backend) */
    char blas_core[32]; /* the OpenBLAS core the rates were measured on ("": not recorded) */
} fg_hardware;

enum { X_WG, X_WC, X_WN, X_CG, X_CC, X_CN, X_HG, X_HC, X_HN, N_X }; /* the placement x */
enum { T_CTOG, T_GTOC, T_DTOC, T_CTOD, T_COMP, T_HOST, N_TERMS };   /* a layer's latencies */
extern const char *const fg_cost_term_names[N_TERMS];
typedef struct {
    double constant, coef[N_X];
} fg_linear; /* seconds: constant + coef . x */

typedef struct {
    int s, n, gbs, ngb, s_mean; /* longest prompt, generated tokens, block shape; costs take s_mean
                                   (0: s) */
    int cpu_cache_compute, compress_weight, compress_cache, int8; /* int8: --int8-activations */
    int micro;            /* blocks a pipeline stage keeps in flight (§4.4); 0 or 1: one */
    fg_schedule schedule; /* the diagonal's smaller peak cache and its warm-up (Appendix A.2) */
    int prompts;          /* sequences the diagonal's block streams in one run; 0: one block */
    float attn_sparsity;  /* §5's top-K: the share of the past attention keeps; 0 or 1: all */
} fg_workload;
/* Appendix A.2: the rows a sequence of a diagonal block of `groups` GPU batches holds on average at
 * the block's peak (prompts of s tokens, n generated): s + n - 1 - about n (groups - 1) / (2
 * groups). */
double fg_diagonal_rows(int s, int n, int groups);

/* A layer's terms in prefill and decode, and the output layer of one token (head). */
typedef struct {
    fg_linear pre[N_TERMS], gen[N_TERMS];
    double head;
} fg_cost_model;
void fg_cost_model_build(const model_config *c, const fg_workload *w, const fg_hardware *hw,
                         fg_cost_model *m);
double fg_linear_eval(const fg_linear *f, const double x[N_X]);
/* T / bls, the seconds per sequence of the block for placement x; T_pre and T_gen if not NULL. */
double fg_cost_per_token(const fg_cost_model *m, const model_config *c, const fg_workload *w,
                         const double x[N_X], double *t_pre, double *t_gen);
/* Each tier's peak bytes, linear in x, in the runtime's accounting, for one case of where the
 * weights may go: all on the gpu tier, all but a little of them (fg_weights_case) with the rest in
 * memory, in memory, or any tier (lp.c explains). */
enum { FG_W_GPU, FG_W_MOSTLY_GPU, FG_W_MEMORY, FG_W_DISK, FG_W_CASES };
typedef struct {
    fg_linear tier[N_TIERS], host;
} fg_memory_model;
void fg_memory_model_build(const model_config *c, const fg_workload *w, const fg_hardware *hw,
                           int weights, fg_memory_model *mm);
int fg_weights_case(const model_config *c, const double x[N_X]);

/* This runtime's verdict on policy p (app/runtime.c's fg_runtime_check, handed to the search):
 * the plan check for `sequences` (with check), the placement it realizes (x), the capacities (st).
 */
typedef int (*fg_plan_check)(const model_config *model, uint64_t seed, const fg_policy *p,
                             int sequences, int s, int n, int check, double x[N_X], fg_stats *st,
                             char *err);

/* ---- The policy search (lp.c, §4.3) ---- */
typedef struct {
    int s, n, s_mean;   /* longest prompt, tokens generated each; the prompts' mean length (0: s) */
    int max_block;      /* sequences there are: a block holds no more; 0: no bound */
    double max_latency; /* seconds one block may take (Fig. 1's latency); 0: no bound */
    fg_plan_check check; /* check each choice with this runtime's plan; NULL for another machine */
    fg_plan_check place; /* for another machine: the placement a policy realizes there */
    uint64_t seed;       /* of the dummy weights */
    int gbs, ngb;        /* > 0: the block shape is given; only the placement is searched */
    int schedules;       /* 1 << fg_schedule for each schedule to search; 0: the base policy's */
    int stream_blocks;   /* > 0: one run streams at most this many blocks of prompts (a job's
                            window) */
} fg_search_request;

typedef struct {
    fg_policy policy; /* the choice */
    double x[N_X];    /* the placement it realizes */
    fg_workload workload;
    fg_cost_model cost;
    double t_pre, t_gen, block_latency, throughput; /* predicted */
    int lps, checks;                                /* LPs solved and plans checked */
    double seconds;                                 /* the search's own time */
    struct {
        int found;
        fg_policy policy;
        double throughput, block_latency;
    } best[FG_SCHEDULES]; /* each one's */
} fg_search_result;

int fg_policy_search(const model_config *cfg, const fg_hardware *hw, const fg_policy *base,
                     const fg_search_request *req, fg_search_result *out, char *err);
int fg_policy_evaluate(const model_config *cfg, const fg_hardware *hw, const fg_policy *p,
                       const fg_search_request *req, fg_search_result *out, char *err);
/* The LP's fractions of one kind of data on the gpu and cpu tiers as percentages, summing to <=
 * 100. */
void fg_round_pair(double gpu, double cpu, int *gpu_pct, int *cpu_pct);

#endif
