/* tiers.h: the runtime's state on the tiers (§4.1, §4.2): the policy that places weights, KV
 * cache and activations; a run (fg_runtime: the tiers' accounting and the I/O threads); a model
 * placed on them (fg_model: each tensor's weight_home); a block of GPU batches with its buffers
 * (block_shape, block), which the loop of Fig. 4 reads; tiers.c's functions on them; and the
 * stage hooks, what the schedule (and tiers.c, as it opens a block) does at a pipeline stage's
 * edges. flexgen.h builds generate() and the policy search on it.
 */
#ifndef FLEXGEN_TIERS_H
#define FLEXGEN_TIERS_H

#include "model.h"
#include "support/support.h"

/* auto: CUDA where a GPU is present, else the CPU; cpu-fp16: the CPU with fp16 activations. */
typedef enum { FG_DEVICE_AUTO, FG_DEVICE_CPU, FG_DEVICE_CUDA, FG_DEVICE_CPU_FP16 } fg_device;

/* The placement in the paper's symbols: percent of the weights (w), KV cache (c) and hidden
 * states (h) on the gpu (g) and cpu (c) tiers; disk holds the rest (wn = 100 - wg - wc, ...). */
typedef struct {
    int wg, wc, cg, cc, hg, hc;
} fg_percent;

/* zig-zag: a block's GPU batches all at the same step (§4.2, Fig. 4); diagonal: staggered over the
 * steps, prompts streaming through them (Appendix A.2, Fig. 6). */
typedef enum { FG_SCHEDULE_ZIGZAG, FG_SCHEDULE_DIAGONAL, FG_SCHEDULES } fg_schedule;
extern const char *const fg_schedule_names[FG_SCHEDULES];

/* The diagonal schedule's staircase (Appendix A.2, Fig. 6): GPU batch k of `groups` takes its
 * first prompts at step diagonal_start and new ones every gen_len steps after, so the groups are
 * staggered by gen_len / groups steps. flexgen.c's diagonal_slots runs it; tiers.c sizes the KV
 * cache's pools on it (kv_pool_shape) and lp.c prices its warm-up. */
static inline int diagonal_start(int k, int groups, int gen_len) {
    return (int)((long)k * gen_len / groups);
}

typedef struct {
    fg_device device;
    int gpu_batch_size, num_gpu_batches; /* the block is their product (§4.2) */
    fg_percent percent;
    int overlap;           /* I/O on its own threads, overlapping compute (Fig. 4) */
    int cpu_cache_compute; /* decode attention over a cpu or disk cache runs on the CPU */
    int pin_weight;        /* pinned cpu-tier weights (CUDA) */
    int compress_weight, compress_cache; /* 4-bit group-wise (§5) */
    int int8_activations, bf16_prefill;  /* the CPU's int8 (support/int8.c) or bf16 prefill
                                            products */
    float attn_sparsity;      /* decode attention keeps this fraction of the past (§5); 1: all */
    double capacity[N_TIERS]; /* bytes; 0: what the machine has */
    const char *offload_dir;  /* disk tier files; NULL: FG_DEFAULT_OFFLOAD_DIR */
    const char *weight_dir;   /* where dummy weights on disk are kept; NULL: ~/.cache/flexgen */
    int trace, verbose;       /* record a Chrome trace; progress on stderr */
    int stage, n_stages;      /* pipeline stage `stage` of n_stages (§4.4); 1: the whole model */
    fg_schedule schedule;     /* the block's order: zig-zag (§4.2) or diagonal (Appendix A.2) */
} fg_policy;

typedef struct {
    double capacity[N_TIERS], peak[N_TIERS], current[N_TIERS], link_bytes[N_LINKS]; /* bytes */
    double host_memory; /* what gpu and cpu tiers share where the gpu tier is host memory */
} fg_stats;

/* ---- A run (flexgen.c, §4.1, §4.2; app/runtime.c opens and closes it: app/app.h) ---- */
typedef struct fg_runtime fg_runtime;   /* tiers with their accounting, the I/O threads */
typedef struct fg_model fg_model;       /* a model placed on the tiers */
typedef struct gen_options gen_options; /* generate()'s options (flexgen.h) */

/* ============================================================================================
 * The runtime's state (flexgen.c, §4.1, §4.2): what the loop of Fig. 4 reads, and what the
 * pipeline's stage hooks (app/pipeline.c) and the profiler see of it.
 * ============================================================================================ */

typedef struct stage_hooks stage_hooks;
typedef struct fg_pipe fg_pipe;

struct fg_runtime {
    fg_policy policy;
    const fg_backend *backend;
    char offload_dir[4096], weight_dir[4096];
    pthread_mutex_t lock; /* the tier and link counters */
    double capacity[N_TIERS], current[N_TIERS], peak[N_TIERS], link_bytes[N_LINKS];
    double disk_read_seconds;
    io_links io; /* the I/O threads (support/io_links.c) */
    fg_trace trace;
    fg_pipe *pipe;            /* to the other pipeline stages (§4.4); NULL: one stage */
    const stage_hooks *stage; /* what the schedule does at a stage's edges (pipeline.c) */
    /* --int8-activations' W columns, kept where the plan of a generate has room and dropped where
     * it needs theirs (app/int8_columns.c; called through these, as the stage hooks are, the loop
     * names no app/ code); NULL: never kept */
    void (*keep_int8_columns)(fg_model *m, int n_prompts, const int *lens, int max_prompt,
                              int gen_len);
    void (*drop_int8_columns)(fg_model *m);
};

typedef struct {
    long n;       /* the round's layer n (as in staged), -1 for none */
    uint64_t seq; /* its task on the disk link */
    int used;     /* its conversion into the gpu tier is queued */
} weight_read;

typedef struct {
    fg_tier tier;
    int q4;       /* compressed (§5): 4-bit in any tier, read by the products as it is stored */
    fp16 *gpu;    /* gpu tier, uncompressed: the working copy */
    void *stored; /* otherwise: fp16 or 4-bit, in the tier's memory or the disk arena */
    size_t bytes; /* of stored */
    size_t staged_at; /* where it is in a staging arena, when staged */
} weight_home;

struct fg_model {
    fg_runtime *rt;
    model_weights view; /* what compute reads: homes on the gpu tier, staging for the rest */
    opt_layout layout;
    st_archive archive; /* open until the weights are in their homes */
    int has_archive, loaded;
    uint64_t seed;
    weight_home *homes; /* [n_tensors] */
    int *layer_first;   /* [n_layers + 3]: tensors of layer j are layer_first[j] .. [j+1] - 1 */
    disk_arena disk;    /* disk homes: offloaded copies, or the dummy-weight file */
    double disk_bytes;  /* of the disk tier that the disk homes take */
    double disk_weights_elsewhere; /* of those, not in --offload-dir's free space: the weight
                                      file in --path, found or on another file system */
    int weight_file_found;         /* an earlier run wrote that file (count_weight_file) */
    char *staging[2]; /* a layer's working weights, then a 4-bit landing (reads_q4 0) */
    size_t staging_bytes, landing_at; /* of each arena; where the 4-bit bytes land in it */
    long staged[2]; /* which layer n of the round (unit L + j) each staging arena holds, or -1 */
    weight_read reads[2];         /* disk reads of layers n, in slot n % 2 */
    int first_layer, end_layer;   /* this pipeline stage's layers [first, end) (§4.4) */
    int first_decoder, n_decoder; /* its decoder layers: index of the first, how many */
    int prompt_logits;            /* this generate() keeps the logits of every prompt position */
    /* --int8-activations: W's int8 columns of the resident 4-bit matrices, made once where the
     * plan has room for them (keep_int8_columns); int8_columns_bytes: theirs in the plan */
    int8_column_set int8_columns;
    double int8_columns_bytes;
};

/* FlexGen's layer list: the input embedding, the decoder layers, the output embedding. */
static inline int n_flexgen_layers(const model_config *c) { return c->n_layers + 2; }
static inline int stage_layers(const fg_model *m) { return m->end_layer - m->first_layer; }
static inline int is_first_stage(const fg_model *m) { return m->first_layer == 0; }
static inline int is_last_stage(const fg_model *m) {
    return m->end_layer == n_flexgen_layers(&m->view.cfg);
}

/* A stage of a pipeline holds `micro` blocks (its micro-batches, §4.4), each with its own KV
 * cache and activations; they compute one at a time, so staging, workspace and logits are
 * shared. */
typedef struct {
    int gbs, ngb, max_prompt, max_len, stage_len;
    int micro; /* blocks in flight on this stage */
    row_split cache, act;
    size_t act_row;          /* bytes per token of the activations: hidden x act_elem */
    size_t kv_row;           /* bytes per token of K (or V): fp16, or 4-bit with --compress-cache */
    kv_pool_size kv;         /* the KV cache's page size and pages per tier (kv_pool_shape) */
    double kv_home[N_TIERS]; /* bytes per tier: the pool */
    double act_home[N_TIERS];
    double kv_stage, x_stage, workspace, logits; /* gpu tier, all buffers together */
    size_t workspace_rows; /* token rows of the workspace: a chunk of prefill (FG_CHUNK_ROWS) */
    double delegated;      /* cpu tier: delegated attention's host rows (fg_backend's
                              delegated_bytes), with --cpu-cache-compute on a GPU */
    int logit_rows;        /* logits per sequence: 1, or the longest prompt's positions */
    double transient_cpu;  /* disk pages in memory while they move, at most */
    size_t act_message;    /* bytes of one GPU batch's activations between stages, at most */
    double pipe_buffers;   /* cpu tier: activations on their way out (each block's GPU
                              batches) and in (two), when there is such a neighbour */
} block_shape;

typedef struct {
    fg_model *m;
    fg_runtime *rt;
    block_shape shape;
    gpu_batch *gb; /* [ngb] */
    int n_batches; /* in this block (the last block may have fewer) */
    int count;     /* its sequences (0: an empty micro-batch of the last round) */
    int running;   /* some sequence of it is still generating */
    char *done;    /* [gbs * ngb]: the sequence has generated </s> (--stop-at-eos) */
    int *ids;      /* [gbs * ngb]: the tokens chosen at the last step, the next step's input */
    int *prompt;   /* [gbs * ngb]: each slot's prompt (its index in generate()'s), -1: idle */
    int *step;     /* [gbs * ngb]: the tokens chosen so far for it */
    int borrowed;  /* staging, workspace, logits and inbox are another block's */
    int delegate;  /* this step's attention reads cpu and disk caches in place (§4.2) */
    int sparse_v;  /* this step's sparse attention reads the kept V rows of the cpu tier in
                      place, so only those cross the link (§5); disk rows move whole */
    int cpu_cache_in_place; /* the device reads the cache's cpu-tier pool where it lies */
    model_workspace own_ws, *ws;
    float *logits;           /* [gbs * ngb][logit_rows][vocab], on the gpu tier */
    float *host_logits;      /* the same, where sampling reads them */
    char *kv_home[N_TIERS];  /* [the stage's decoder layers][K, V][pool pages][page_tokens] rows of
                                kv_row bytes */
    kv_pages pages;          /* each slot's pages in its tier's pool (support/kv_pages.c) */
    char *act_home[N_TIERS]; /* [ngb][rows][max_prompt] rows of act_row bytes */
    char *kv_stage[2];       /* [K, V][non-gpu rows][stage_len] rows of kv_row bytes */
    char *x_stage[2];        /* [gbs * max_prompt] rows of act_row bytes: gb->x of the iteration */
    disk_arena disk;
    int has_ws, has_delegated;
    /* between pipeline stages (pipeline.c) */
    int ids_msg;      /* the ids' message to the first stage, or -1 */
    char *outbox;     /* [ngb][gbs * max_prompt] rows of act_row bytes: activations on their way
                         to the next stage (cpu tier), each GPU batch's slot until it is sent */
    int *out_msg;     /* [ngb]: those messages, or -1 */
    char *inbox;      /* [2][gbs * max_prompt] rows of act_row bytes: activations from the
                         previous stage, by staging arena (shared by the stage's blocks) */
    int in_msg, in_k; /* the receive of GPU batch in_k's activations, or -1 */
    double bubble;    /* seconds the compute thread waited for another stage */
    fg_device_counts step_start; /* the backend's counters as this step began */
    double compute_seconds;      /* seconds it computed, this round */
} block;

/* Slot s holds a sequence that has not ended (by </s> with --stop-at-eos, or by --gen-len). */
static inline int slot_running(const block *bl, int s, int gen_len) {
    return bl->prompt[s] >= 0 && !bl->done[s] && bl->step[s] < gen_len;
}

/* ---- tiers.c: the tiers and what lives on them (§4.1, §4.2, §5) ---- */
void *tier_alloc(fg_runtime *rt, fg_tier t, size_t bytes, const char *what, char *err);
void tier_free(fg_runtime *rt, fg_tier t, void *p, size_t bytes);
void link_add(fg_runtime *rt, fg_link l, double bytes);
void disk_fetch(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes);
void trace_add(fg_runtime *rt, int track, const char *name, int layer, int batch, double start,
               double end);
void tier_add(fg_runtime *rt, fg_tier t, double bytes); /* counted, never refused */
void disk_release(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes, size_t written);
void weight_bytes(const fg_model *m, double bytes[N_TIERS], double *max_layer_disk);
void weight_stored_bytes(const fg_model *m, double stored[N_TIERS]); /* each tier's stored bytes */
/* The bytes fg_check_plan holds against each tier's capacity, and of them the weights' (their
 * homes, staging arenas and the disk layers read ahead); the cache counts the pages of lens. */
void fg_plan_bytes(const fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                   double total[N_TIERS], double weights[N_TIERS]);
/* The weights' homes: placed by FlexGen's rule, freed; the dummy-weight file. */
void place_weights(fg_model *m);
void free_weight_homes(fg_model *m);
weight_file weight_file_of(fg_model *m);
int load_weights_into_homes(fg_model *m, char *err);
/* The round's layer n (unit L + j) of the weights: its disk part read ahead, loaded into staging
 * arena n % 2, bound as what compute reads; the reads ahead that no step used given back. */
void read_weights(fg_model *m, long n);
void load_weight_at(fg_model *m, long n);
void bind_weights(fg_model *m, long n);
void forget_reads(fg_model *m);
fg_tier row_tier(const row_split *s, int b, int *index); /* row b's tier, its index there */
void micro_batches(const fg_model *m, int n_prompts, int *size, int *count);
/* A block's shape for a job: its GPU batches, their rows on each tier, every buffer's bytes. */
block_shape shape_block(const fg_model *m, int n_prompts, const int *lens, int max_prompt,
                        int gen_len);
/* Tensor i's tie whose home it shares, or -1; a home that compute reads through a staging arena;
 * progress on stderr (--quiet: none) of a pass over the layers, such as loading. */
int tied_here(const fg_model *m, int i);
int is_staged(const fg_model *m, const weight_home *h);
void load_progress(const fg_model *m, const char *what, int done, int total);
/* The whole plan (weights, KV cache, activations, staging, workspace, per tier) against the
 * capacities, before anything is allocated; the cache counts the pages of lens (NULL: all
 * max_prompt). */
int fg_check_plan(const fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                  char *err);
int alloc_block(block *bl, fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                const block *shared, char *err);
void free_block(block *bl);

/* What the schedule does at the edges of a pipeline stage (§4.4): pipeline.c's hooks, or, in one
 * process, app/stage.c's, which do nothing (fg_runtime_open sets them; fg_pipeline_attach
 * replaces them). */
struct stage_hooks {
    /* every stage reached rc == 0 (0), or none goes on (-1, with the job's one line) */
    int (*agree)(fg_runtime *rt, int rc, char *err);
    /* a block's buffers for messages (the shared ones borrowed from `shared`, if not NULL) */
    int (*open_block)(block *bl, const block *shared, char *err);
    void (*close_block)(block *bl);
    /* the stage's first layer's input of GPU batch k into staging arena `arena`: the task to
     * wait for (0: none) */
    uint64_t (*receive_activations)(block *bl, int k, int arena);
    /* the stage's last layer's output of GPU batch k, from staging arena `arena`, onwards */
    void (*send_activations)(block *bl, int k, int arena);
    /* the compute thread waits for GPU batch k's input to arrive (the bubble), and after the
     * iteration's synchronize lets its message go */
    void (*await_input)(block *bl, int k);
    void (*input_taken)(block *bl);
    /* a step of the block may begin: on a later stage its input arrived (0: the block stopped) */
    int (*step_input)(block *bl);
    /* the first stage: step's token ids come back from the last stage into bl->ids; the last
     * stage: they go (taking them for its own bookkeeping) */
    void (*receive_tokens)(block *bl, int step);
    void (*tokens_out)(block *bl, const gen_options *opt, int *out_tokens);
    /* a block stopped: tell the next stage */
    void (*pass_stop)(block *bl);
    /* the end of a round: the block's messages are done with */
    void (*end_round)(block *bl);
};
extern const stage_hooks fg_single_stage; /* one process: every hook does nothing (stage.c) */

#endif
