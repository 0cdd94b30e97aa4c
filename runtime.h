/* runtime.h: the runtime's own types, shared by the files that implement it (not part of the
 * public interface, flexgen.h). Read it as the map of the runtime's state:
 *
 *   tiers.c     fg_runtime: the tiers' accounting, the disk tier's arenas, the I/O link threads
 *   trace.c     fg_trace: what each thread did when (Chrome's trace format)
 *   weights.c   fg_model: each weight tensor's home tier, staging arenas for the layer in use
 *   plan.c      block_shape: every buffer of a block, per tier; the plan check
 *   flexgen.c   block: a block of GPU batches in flight; the schedule of Fig. 4
 *   pipeline.c  stage_hooks: what a pipeline stage adds to the schedule (§4.4)
 *
 * docs/DESIGN.md draws how these files call each other.
 */
#ifndef FLEXGEN_RUNTIME_H
#define FLEXGEN_RUNTIME_H

#include "flexgen.h"

#include <pthread.h>
#include <stdint.h>

/* ============================================================================================
 * Small helpers (tiers.c)
 * ============================================================================================ */

double now_seconds(void); /* a monotonic clock */
#define GB ((double)(1 << 30))
/* "1.50 GiB", "12.3 MiB", "4.0 KiB": sizes in error lines, readable at any scale. */
typedef struct { char s[32]; } size_text;
size_text human(double bytes);
double mem_available_bytes(void);
int is_dir(const char *path);
/* A directory the run writes in must exist and be writable: one line naming the flag if not. */
int check_dir(const char *flag, const char *dir, char *err);
int mkdir_p(const char *dir); /* and its parents; -1 (errno) on failure */
/* The user's cache dir for flexgen: dummy weights, the hardware file (~/.cache/flexgen). */
void default_weight_dir(char *out, size_t n);

/* ============================================================================================
 * The trace (trace.c): one track per thread, one complete event per task or computation.
 * ============================================================================================ */

enum { TRACK_COMPUTE, N_TRACKS = 5 };

typedef struct {
    const char *name;
    int layer, batch;
    double start, end; /* seconds since the run began */
} trace_event;

typedef struct {
    trace_event *events;
    size_t n, cap;
} trace_track;

typedef struct {
    int on;
    double t0;
    trace_track tracks[N_TRACKS];
} fg_trace;

void trace_record(fg_trace *tr, int track, const char *name, int layer, int batch, double start,
                  double end);
void trace_free(fg_trace *tr);

/* ============================================================================================
 * Tiers (tiers.c, §4.2): one accounting point each. Memory of the gpu and cpu tiers comes from
 * the backend; the disk tier is files in the offload dir, mapped.
 * ============================================================================================ */

extern const char *const fg_tier_flags[N_TIERS]; /* "--gpu-mem", "--cpu-mem", "--disk-mem" */

/* A file of the disk tier, mapped: pieces of it are taken page-aligned, in order. */
typedef struct {
    int fd;
    char *base;
    size_t size, used;
} disk_arena;

size_t page_size(void);
size_t page_up(size_t n);
int unnamed_file(const char *dir, const char *flag, char *err);
int arena_map(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir, char *err);
void arena_close(disk_arena *a);
void *arena_take(disk_arena *a, size_t bytes);
void disk_fetch_pages(const disk_arena *a, size_t off, size_t len);
void drop_pages(const disk_arena *a, const void *p, size_t bytes, int dirty);

/* ============================================================================================
 * I/O links (tiers.c, Fig. 4's asynchronous loads and stores): a thread per link and kind of
 * data, each running its tasks in order.
 * ============================================================================================ */

typedef struct io_task io_task;
struct io_task {
    void (*fn)(fg_runtime *rt, const io_task *t);
    const char *name;
    int after_link;       /* the task waits for task after_seq of link after_link (0: none) */
    uint64_t after_seq;
    void *ctx;            /* what it works on: a model (weights) or a block */
    int layer;            /* FlexGen's layer j */
    int batch;            /* GPU batch k */
    int arena;            /* the staging arena it fills or empties */
    int first, count;     /* KV cache slots [first, first + count) */
    int msg;              /* a message between pipeline stages (pipeline.c) */
};

#define IO_QUEUE 64

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    io_task queue[IO_QUEUE];
    uint64_t submitted, done;
    int running, stop, track;
} io_link;

/* The I/O threads: disk <-> cpu and cpu <-> gpu, once for weights and once for the KV cache and
 * activations, as FlexGen's separate CUDA streams: a layer's weights then load while every GPU
 * batch of the previous layer computes, without holding up those batches' I/O. */
enum { IO_WEIGHT_DISK, IO_WEIGHT_HOST, IO_DISK, IO_HOST, N_IO };

typedef struct stage_hooks stage_hooks;

struct fg_runtime {
    fg_policy policy;
    const fg_backend *backend;
    char offload_dir[4096], weight_dir[4096];
    pthread_mutex_t lock; /* the tier and link counters */
    double capacity[N_TIERS], current[N_TIERS], peak[N_TIERS], link_bytes[N_LINKS];
    double disk_read_seconds;
    io_link io[N_IO];
    fg_trace trace;
    fg_pipe *pipe;              /* to the other pipeline stages (§4.4); NULL: one stage */
    const stage_hooks *stage;   /* what the schedule does at a stage's edges (pipeline.c) */
};

int tier_take(fg_runtime *rt, fg_tier t, double bytes, const char *what, char *err);
void tier_add(fg_runtime *rt, fg_tier t, double bytes);
void link_add(fg_runtime *rt, fg_link l, double bytes);
void *tier_alloc_pinned(fg_runtime *rt, fg_tier t, size_t bytes, const char *what, int pinned,
                        char *err);
void *tier_alloc(fg_runtime *rt, fg_tier t, size_t bytes, const char *what, char *err);
void tier_free(fg_runtime *rt, fg_tier t, void *p, size_t bytes);
void disk_fetch(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes);
void disk_release(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes,
                  size_t written);

uint64_t io_submit(fg_runtime *rt, int link, io_task t);
void io_wait(fg_runtime *rt, int link, uint64_t seq);
void io_sync(fg_runtime *rt, int weights);
void trace_add(fg_runtime *rt, int track, const char *name, int layer, int batch, double start,
               double end);
const fg_backend *backend_for(fg_device device, char *err);

/* ============================================================================================
 * Weights on the tiers (weights.c, §4.2)
 * ============================================================================================ */

typedef struct {
    long g;       /* the layer (as in staged), -1 for none */
    uint64_t seq; /* its task on the disk link */
    int used;     /* its conversion into the gpu tier is queued */
} weight_read;

typedef struct {
    fg_tier tier;
    int q4;       /* compressed (§5): 4-bit in any tier, decompressed into staging before use */
    fp16 *gpu;    /* gpu tier, uncompressed: the working copy */
    void *stored; /* otherwise: fp16 or 4-bit, in the tier's memory or the disk arena */
    size_t bytes; /* of stored */
} weight_home;

struct fg_model {
    fg_runtime *rt;
    opt_weights view;     /* what compute reads: homes on the gpu tier, staging for the rest */
    opt_layout layout;
    st_archive archive;   /* open until the weights are in their homes */
    int has_archive, loaded;
    uint64_t seed;
    weight_home *homes;   /* [n_tensors] */
    int *layer_first;     /* [n_layers + 3]: tensors of layer j are layer_first[j] .. [j+1] - 1 */
    disk_arena disk;      /* disk homes: offloaded copies, or the dummy-weight file */
    double disk_bytes;    /* of the disk tier that the disk homes take */
    double reused_disk_bytes; /* of those, already on disk in --path (count_existing_weight_file) */
    char *staging[2];     /* working weights of a layer, then (CUDA) a 4-bit tensor's landing */
    size_t staging_bytes, landing_at; /* of each arena; where the 4-bit bytes land in it */
    long staged[2];       /* which layer g of the round each staging arena holds, or -1 */
    weight_read reads[2]; /* disk reads of layers g, in slot g % 2 */
    int first_layer, end_layer; /* this pipeline stage's layers [first, end) (§4.4) */
    int first_decoder, n_decoder; /* its decoder layers: index of the first, how many */
    int prompt_logits;    /* this generate() keeps the logits of every prompt position */
};

/* FlexGen's layer list: the input embedding, the decoder layers, the output embedding. */
static inline int n_flexgen_layers(const opt_config *c) { return c->n_layers + 2; }
static inline int stage_layers(const fg_model *m) { return m->end_layer - m->first_layer; }
static inline int is_first_stage(const fg_model *m) { return m->first_layer == 0; }
static inline int is_last_stage(const fg_model *m) { return m->end_layer == n_flexgen_layers(&m->view.cfg); }

/* Bytes of the weights' homes per tier, and the largest disk share of one layer. */
void weight_bytes(const fg_model *m, double bytes[N_TIERS], double *max_layer_disk);
/* Bytes of the weights as stored (fp16 or 4-bit) per tier, ties counted once. */
void weight_stored_bytes(const fg_model *m, double stored[N_TIERS]);
int load_weights_into_homes(fg_model *m, char *err);
/* The round's layer g (the stage's layer g % L of its unit g / L): read ahead from disk, loaded
 * into staging arena g % 2, bound for compute as it starts. */
void read_weights(fg_model *m, long g);
void load_weights(fg_model *m, long g);
void bind_weights(fg_model *m, long g);
void forget_reads(fg_model *m);

/* ============================================================================================
 * A block's shape (plan.c): the sizes every allocation follows; the plan check uses the same.
 * ============================================================================================ */

typedef struct {
    int rows[N_TIERS]; /* of a GPU batch's sequences: gpu first, then cpu, then disk */
} row_split;

fg_tier tier_of(const row_split *s, int b);
fg_tier row_tier(const row_split *s, int b, int *index); /* and b's index within its tier */

/* A stage of a pipeline holds `micro` blocks (its micro-batches, §4.4), each with its own KV
 * cache and activations; they compute one at a time, so staging, workspace and logits are
 * shared. */
typedef struct {
    int gbs, ngb, max_prompt, max_len, stage_len;
    int micro;                  /* blocks in flight on this stage */
    row_split cache, act;
    size_t act_row;             /* bytes per token of the activations: hidden x act_elem */
    size_t kv_row;              /* bytes per token of K (or V): fp16, or 4-bit with --compress-cache */
    double kv_home[N_TIERS];    /* bytes per tier */
    double act_home[N_TIERS];
    double kv_stage, x_stage, workspace, logits; /* gpu tier, all buffers together */
    size_t workspace_rows;      /* token rows of the workspace: a chunk of prefill (FG_CHUNK_ROWS) */
    double delegated;           /* cpu tier: delegated attention's host rows (fg_backend's
                                   delegated_bytes), with --cpu-cache-compute on a GPU */
    int logit_rows;             /* logits per sequence: 1, or the longest prompt's positions */
    double transient_cpu;       /* disk pages in memory while they move, at most */
    size_t act_message;         /* bytes of one GPU batch's activations between stages, at most */
    double pipe_buffers;        /* cpu tier: activations on their way out (each block's GPU
                                   batches) and in (two), when there is such a neighbour */
} block_shape;

void micro_batches(const fg_model *m, int n_prompts, int *size, int *count);
block_shape shape_block(const fg_model *m, int n_prompts, int max_prompt, int gen_len);

/* ============================================================================================
 * A block in flight (flexgen.c, §4.1)
 * ============================================================================================ */

typedef struct {
    fg_model *m;
    fg_runtime *rt;
    block_shape s;
    gpu_batch *gb;   /* [ngb] */
    int n_batches;   /* in this block (the last block may have fewer) */
    int count;       /* its sequences (0: an empty micro-batch of the last round) */
    int running;     /* some sequence of it is still generating */
    char *done;      /* [gbs * ngb]: the sequence has generated </s> (--stop-at-eos) */
    int *ids;        /* [gbs * ngb]: the tokens chosen at the last step, the next step's input */
    int borrowed;    /* staging, workspace, logits and inbox are another block's */
    int out_rows;    /* logits the last output layer gave per sequence (its tokens in flight
                        with prompt_logits, else 1) */
    int delegate;    /* this step's attention reads cpu and disk caches in place (§4.2) */
    int sparse_v;    /* this step's sparse attention reads the kept V rows of the cpu tier in
                        place, so only those cross the link (§5); disk rows move whole */
    opt_workspace own_ws, *ws;
    float *logits;   /* [gbs * ngb][logit_rows][vocab], on the gpu tier */
    float *host_logits; /* the same, where sampling reads them */
    char *kv_home[N_TIERS];   /* [ngb][the stage's decoder layers][K, V][rows][max_len] rows of kv_row bytes */
    char *act_home[N_TIERS];  /* [ngb][rows][max_prompt] rows of act_row bytes */
    char *kv_stage[2];        /* [K, V][non-gpu rows][stage_len] rows of kv_row bytes */
    char *x_stage[2];         /* [gbs * max_prompt] rows of act_row bytes: gb->x of the iteration */
    disk_arena disk;
    int has_ws, has_delegated;
    /* between pipeline stages (pipeline.c) */
    int ids_msg;     /* the ids' message to the first stage, or -1 */
    char *outbox;    /* [ngb][gbs * max_prompt] rows of act_row bytes: activations on their way
                        to the next stage (cpu tier), each GPU batch's slot until it is sent */
    int *out_msg;    /* [ngb]: those messages, or -1 */
    char *inbox;     /* [2][gbs * max_prompt] rows of act_row bytes: activations from the
                        previous stage, by staging arena (shared by the stage's blocks) */
    int in_msg, in_k; /* the receive of GPU batch in_k's activations, or -1 */
    double bubble;   /* seconds the compute thread waited for another stage */
    double compute_seconds; /* seconds it computed, this round */
} block;

/* Bytes of GPU batch k's activations this step, all of its sequences'. */
size_t batch_act_bytes(const block *bl, int k);
/* Every prompt is a non-empty run of token ids in the vocab that fits the model's positions with
 * gen_len more. */
int check_prompts(const opt_config *c, int n, int *const *prompts, const int *lens, int gen_len,
                  char *err);
/* Takes the tokens of step `step` (bl->ids) as the output and the next step's input; returns how
 * many sequences are still running. */
int take_tokens(block *bl, const gen_options *opt, int step, int first, int *out_tokens);

/* ============================================================================================
 * Stage hooks (pipeline.c, §4.4): what the schedule does at the edges of a pipeline stage. In
 * one process (single_stage in flexgen.c) every hook does nothing: the first layer is the input
 * embedding, whose input is token ids, and the last layer is the output embedding, whose output
 * is the logits.
 * ============================================================================================ */

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
    void (*tokens_out)(block *bl, const gen_options *opt, int step, int first, int *out_tokens);
    /* a block stopped: tell the next stage */
    void (*pass_stop)(block *bl);
    /* the end of a round: the block's messages are done with */
    void (*end_round)(block *bl);
};

#endif
