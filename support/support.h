/* support/support.h: what the paper's files take from the support layer, the one support header
 * they include: error lines and small services, fp16, the fast kernels (SIMD twins and the CPU's
 * products), the checkpoint's weight table and dummy weights, sampling, the trace; and the
 * runtime's state (flexgen.c) that the pipeline's stage hooks and the trace read.
 */
#ifndef FLEXGEN_SUPPORT_H
#define FLEXGEN_SUPPORT_H

#include "flexgen.h"

#include <pthread.h>
#include <stdio.h>

/* ---- Error lines and small services (util.c) ---- */
/* Writes one line into err (may be NULL) and returns -1; control characters become '?'. */
int fg_fail(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
double now_seconds(void); /* a monotonic clock */
#define GB ((double)(1 << 30))
typedef struct { char s[32]; } size_text;
size_text human(double bytes); /* "1.50 GiB", "12.3 MiB", "4.0 KiB" */
double mem_available_bytes(void);
int is_dir(const char *path);
int check_dir(const char *flag, const char *dir, char *err); /* exists and is writable */
int mkdir_p(const char *dir);                                 /* -1 (errno) on failure */
void default_weight_dir(char *out, size_t n);                 /* ~/.cache/flexgen */
int unnamed_file(const char *dir, const char *flag, char *err); /* an fd, removed at exit */
/* A SIGBUS in a watched mapping ends the process with one line naming its file. */
void fg_watch_mapping(const void *base, size_t size, const char *path);
void fg_unwatch_mapping(const void *base);
uint64_t fg_mix64(uint64_t x); /* a stateless 64-bit hash */
uint64_t fg_fnv64(const void *bytes, size_t n); /* FNV-1a: names, files */
#define FG_FNV64_START 0xcbf29ce484222325ULL
uint64_t fg_fnv64_more(uint64_t h, const void *bytes, size_t n); /* h: FG_FNV64_START, or an earlier result */

/* ---- fp16 (util.c): round to nearest even, as the hardware and PyTorch's .half() ---- */
fp16 fp32_to_fp16(float f); /* fp16_to_fp32 is in flexgen.h */
float bf16_to_fp32(uint16_t b);
void fp16_to_fp32_n(const fp16 *src, float *dst, size_t n); /* F16C where the CPU has it */
void fp32_to_fp16_n(const float *src, fp16 *dst, size_t n);
int fg_cpu_has_avx2(void); /* AVX2, FMA and F16C, and FLEXGEN_NO_SIMD unset */

/* ---- The SIMD twins of the paper's loops (simd.c): the same arithmetic, so the same bits.
 * An entry is NULL where the CPU lacks AVX2 (the plain loop runs then). ---- */
typedef struct {
    void (*q4_range)(const float *x, float *lo, float *hi);              /* 64 values */
    void (*q4_pack)(const float *x, float min, float inv, uint8_t *bytes); /* 64 values */
    size_t (*q4_decode_groups)(const uint8_t *bytes, const fp16 *mins, const fp16 *scales,
                               size_t len, float *out); /* whole groups; returns values done */
    void (*q4_decode_row)(const uint8_t *bytes, const fp16 *mins, const fp16 *scales, size_t r,
                          size_t inner, float *out);
    void (*dot_f16_rows)(const float *q, const fp16 *K, size_t stride, int nk, int hd,
                         float scale, float *scores);
    void (*axpy_f16_rows)(const float *p, const fp16 *V, size_t stride, int nk, int hd,
                          float *out);
} fg_simd;
const fg_simd *fg_simd_kernels(void);

/* ---- The CPU's products with weights as stored, fp16 or 4-bit (matmul.c): the fast twins of
 * opt_model.c's matmul_reference and embed_t_reference. q4 > 0: 4-bit, in q4 parts side by side
 * (q|k|v: 3), each grouped on its own ---- */
#define MATMUL_DECODE_ROWS 64
#define MATMUL_EMBED_DOT_ROWS 64
#define MATMUL_EMBED_BLOCK 64
void matmul_weights(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                    int accumulate, int int8, float *scratch); /* int8: int8.c's scheme (q4 only) */
void matmul_q4_int8(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                    int accumulate, int simd); /* int8.c */
size_t matmul_scratch_floats(int in, int out);
void matmul_embed_t(const float *x, int rows, int dim, const void *E, int q4, int n, float *y,
                    float *scratch, size_t scratch_stride);
void matmul_embed_row(const void *E, int q4, int n, int dim, int r, float *dst);

/* ---- Buffers of the forward pass (workspace.c) ---- */
#define FG_CUDA_ACT_ELEM 2 /* fp16 activations */
#define FG_CUDA_RESERVE (512.0 * (1 << 20)) /* context, cuBLAS, rounding: an estimate */
#define FG_CUDA_HOST_RESERVE (3 * 2 * 8.0 * (1 << 20)) /* 3 copying threads, 2 pinned 8 MiB each */
#define FG_CHUNK_ROWS 2048 /* prefill runs a layer on chunks of this many token rows at most */
size_t fg_workspace_rows(int gbs, int max_prompt);
int gpu_batch_init(gpu_batch *gb, int batch, int max_len, int max_new, char *err);
void gpu_batch_free(gpu_batch *gb);
void gpu_batch_advance(gpu_batch *gb); /* after a step: past[b] += its tokens; next, decode's rows */
/* The CPU's workspace: max_prompt is not used (decode's max_len keys are the most). */
size_t opt_workspace_bytes(const opt_config *cfg, size_t rows, int max_prompt, int max_len);
int opt_workspace_init(opt_workspace *ws, const opt_config *cfg, size_t rows, int max_prompt,
                       int max_len, char *err);
void opt_workspace_free(opt_workspace *ws);
enum { FG_CUDA_WS_PARTS = 9 };
size_t fg_cuda_workspace_parts(const opt_config *cfg, size_t rows, int max_prompt, int max_len,
                               size_t *sizes);
size_t fg_cuda_workspace_bytes(const opt_config *cfg, size_t rows, int max_prompt, int max_len);
size_t fg_cuda_delegated_bytes(const opt_config *cfg, size_t rows, int max_len);
const fg_backend *fg_cpu_fp16_backend(void); /* the CPU with fp16 activations (cpu_fp16.c) */

/* ---- Configs and the weight table (checkpoint.c, safetensors.c) ---- */
typedef enum { ST_F16, ST_BF16, ST_F32 } st_dtype;
typedef struct {
    char name[160];
    st_dtype dtype;
    int ndim;
    int64_t shape[4];
    const void *data; /* inside the mapping */
    size_t nbytes;
    int file;
} st_tensor;
typedef struct {
    int n_files, n_tensors;
    char **paths;
    void **maps;
    size_t *sizes;
    st_tensor *tensors;
} st_archive;
const st_tensor *st_find(const st_archive *a, const char *name);
void st_close(st_archive *a);

int opt_config_by_name(const char *name, opt_config *cfg, char *err); /* "opt-125m" ... */
/* An HF checkpoint directory: its config.json (cfg->name becomes dir) and its archive, mapped. */
int opt_checkpoint_open(const char *dir, opt_config *cfg, st_archive *a, char *err);
/* FlexGen's layer list (0 input embedding, 1 .. n_layers decoders, n_layers + 1 output
 * embedding) split over n pipeline stages: stage s has [*first, *end). */
void fg_stage_layers(const opt_config *c, int s, int n, int *first, int *end);
size_t opt_param_count(const opt_config *cfg);

/* The model's stored tensors, layer by layer (§4.2 places weights tensor by tensor within a
 * layer). A layer's tensors tile one arena of layer_floats[layer] values; tensor t starts at
 * offset and spans count (64-byte padding included). */
typedef struct {
    char name[96];        /* HF name without "model." (q_proj's for the fused q, k, v) */
    int layer;            /* FlexGen's layer */
    size_t offset, count; /* elements, within the layer's arena */
    fp16 **slot;          /* the field of the view that points at the tensor's working copy */
    size_t group_outer, group_len, group_inner; /* §5's grouping: [outer][len][inner] along
                                                   len; group_len 0: a vector, never 4-bit */
    int tied_to;          /* -1, or the tensor whose values and home it shares (tied lm_head) */
    int first_spec, n_specs; /* the checkpoint tensors that fill it (internal) */
} opt_tensor;
typedef struct {
    opt_weights *view;    /* the compute view whose fields the slots name */
    opt_tensor *tensors;
    int n_tensors;
    size_t *layer_floats; /* [n_layers + 2] */
    void *specs;          /* internal to checkpoint.c */
    int n_specs;
} opt_layout;
/* Where values come from: a checkpoint (archive) or dummy weights (archive NULL, seed). */
typedef struct {
    const st_archive *archive;
    uint64_t seed;
} weight_source;
int opt_layout_init(opt_layout *l, opt_weights *view, const opt_config *cfg, int has_lm_head,
                    char *err);
void opt_layout_free(opt_layout *l);
int opt_layout_check_archive(const opt_layout *l, const st_archive *a, const char *dir, char *err);
/* Tensor t's values rounded to fp16, in its stored layout, into dst32 (as fp32) or dst16; -1 with
 * a line naming the file, the tensor and the element where a checkpoint value is not a finite
 * fp16 (NaN, Inf, or beyond 65504). */
int opt_tensor_fill(const opt_layout *l, int t, const weight_source *src, float *dst32, fp16 *dst16,
                    char *err);

/* The dummy-weight file (weight_file.c): every tensor's stored bytes, page-aligned, with a
 * checksum per layer, written once into the weight dir and reused while intact. */
typedef struct {
    const char *dir;         /* the weight dir (--path) */
    const opt_config *cfg;   /* with seed and q4, what names the contents */
    uint64_t seed;
    int q4;
    const opt_layout *layout;
    const int *layer_first;  /* [n_layers + 3]: layer j's tensors are [j] .. [j + 1] - 1 */
    size_t (*bytes)(void *ctx, int i);                   /* tensor i's stored bytes */
    int (*fill)(void *ctx, int i, void *dst, char *err); /* ... and the bytes themselves */
    void *ctx;
    int verbose;
} weight_file;
void weight_file_path(const weight_file *f, char *path, size_t n);
size_t weight_file_offsets(const weight_file *f, size_t *offsets); /* the file's size */
int weight_file_find(const weight_file *f, int check); /* an fd of an intact file, or -1 */
int weight_file_write(const weight_file *f, char *err); /* an fd, or -1 */

/* ---- Sampling (sampling.c) ---- */
typedef struct { uint64_t s[2]; } fg_rng;
void rng_seed(fg_rng *r, uint64_t seed);
uint64_t rng_next(fg_rng *r);
float rng_uniform(fg_rng *r); /* [0, 1) */
int fg_argmax(const float *x, int n); /* the first of equal maxima, as torch.argmax */
/* temperature <= 0: argmax. Else softmax(logits / temperature), top-p. scratch: 2 n floats. */
int sample_token(const float *logits, int n, float temperature, float top_p, fg_rng *rng,
                 float *scratch);

/* ---- The trace (trace.c): one track per thread, one event per task or computation ---- */
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
 * The runtime's state (flexgen.c, §4.1, §4.2), as the pipeline's stage hooks (pipeline.c), the
 * profiler and the trace see it. flexgen.c's top comment walks through it.
 * ============================================================================================ */

/* A file of the disk tier, mapped: pieces of it are taken page-aligned, in order. */
typedef struct {
    int fd;
    char *base;
    size_t size, used;
} disk_arena;

size_t page_size(void);
size_t page_up(size_t n);
int arena_map(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir, char *err);
void arena_close(disk_arena *a);
void disk_fetch_pages(const disk_arena *a, size_t off, size_t len);
void drop_pages(const disk_arena *a, const void *p, size_t bytes, int dirty);

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
typedef struct fg_pipe fg_pipe;

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

void *tier_alloc(fg_runtime *rt, fg_tier t, size_t bytes, const char *what, char *err);
void tier_free(fg_runtime *rt, fg_tier t, void *p, size_t bytes);
void link_add(fg_runtime *rt, fg_link l, double bytes);
void disk_fetch(fg_runtime *rt, const disk_arena *a, const void *p, size_t bytes);
uint64_t io_submit(fg_runtime *rt, int link, io_task t);
void trace_add(fg_runtime *rt, int track, const char *name, int layer, int batch, double start,
               double end);
const fg_backend *backend_for(fg_device device, char *err);

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

void weight_bytes(const fg_model *m, double bytes[N_TIERS], double *max_layer_disk);
void weight_stored_bytes(const fg_model *m, double stored[N_TIERS]); /* each tier's stored bytes */
/* The bytes fg_check_plan holds against each tier's capacity, and of them the weights' (their
 * homes, staging arenas and the disk layers read ahead); the cache counts the pages of lens. */
void fg_plan_bytes(const fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len,
                   double total[N_TIERS], double weights[N_TIERS]);
size_t stored_bytes(const fg_model *m, int i); /* tensor i as its home stores it (fp16, or 4-bit) */
int fill_stored(const fg_model *m, int i, const weight_source *src, void *dst, char *err);
/* The model's dummy-weight file on disk (weight_file.c): counted where an earlier run wrote it,
 * mapped as the disk homes (found intact, or written now). */
void count_existing_weight_file(fg_model *m);
int open_weight_file(fg_model *m, size_t *offsets, char *err);

typedef struct {
    int rows[N_TIERS]; /* of a GPU batch's sequences: gpu first, then cpu, then disk */
} row_split;
fg_tier tier_of(const row_split *s, int b); /* the tier of a GPU batch's sequence b */

/* A stage of a pipeline holds `micro` blocks (its micro-batches, §4.4), each with its own KV
 * cache and activations; they compute one at a time, so staging, workspace and logits are
 * shared. */
typedef struct {
    int gbs, ngb, max_prompt, max_len, stage_len;
    int page_tokens;            /* tokens per page of the KV cache (kv_pool_shape) */
    int micro;                  /* blocks in flight on this stage */
    row_split cache, act;
    size_t act_row;             /* bytes per token of the activations: hidden x act_elem */
    size_t kv_row;              /* bytes per token of K (or V): fp16, or 4-bit with --compress-cache */
    int pool_pages[N_TIERS];    /* the KV cache's pages per tier (kv_pool_shape) */
    double kv_home[N_TIERS];    /* bytes per tier: the pool */
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
    int *prompt;     /* [gbs * ngb]: each slot's prompt (its index in generate()'s), -1: idle */
    int *step;       /* [gbs * ngb]: the tokens chosen so far for it */
    int borrowed;    /* staging, workspace, logits and inbox are another block's */
    int out_rows;    /* logits the last output layer gave per sequence (its tokens in flight
                        with prompt_logits, else 1) */
    int delegate;    /* this step's attention reads cpu and disk caches in place (§4.2) */
    int sparse_v;    /* this step's sparse attention reads the kept V rows of the cpu tier in
                        place, so only those cross the link (§5); disk rows move whole */
    opt_workspace own_ws, *ws;
    float *logits;   /* [gbs * ngb][logit_rows][vocab], on the gpu tier */
    float *host_logits; /* the same, where sampling reads them */
    char *kv_home[N_TIERS];   /* [the stage's decoder layers][K, V][pool pages][page_tokens] rows of kv_row bytes */
    int max_pages;            /* a slot's page table: the pages of max_len tokens */
    int *page_table;          /* [gbs * ngb][max_pages]: each slot's pages in its tier's pool */
    int *held;                /* [gbs * ngb]: how many pages each slot holds */
    int *free_pages[N_TIERS], n_free[N_TIERS]; /* each tier's pages held by no slot (a stack) */
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

/* The KV cache's pages (kv_pages.c): the pools' sizes for a job, a block's page tables. */
static inline int kv_pages_for(int tokens, int page_tokens) { return (tokens + page_tokens - 1) / page_tokens; }
void kv_pool_shape(block_shape *s, int n, const int *lens, int gen_len);
int kv_pages_init(block *bl, char *err);
void kv_pages_free(block *bl);
void kv_pages_reset(block *bl);
fg_tier slot_tier(const block *bl, int slot);
const int *slot_pages(const block *bl, int slot);
void kv_pages_grow(block *bl, int slot, int tokens);
void kv_pages_give_back(block *bl, int slot);
void kv_pages_promisable(const block *bl, const int *lens, int gen_len, int promise[N_TIERS]);
/* Slot s holds a sequence that has not ended (by </s> with --stop-at-eos, or by --gen-len). */
static inline int slot_running(const block *bl, int s, int gen_len) {
    return bl->prompt[s] >= 0 && !bl->done[s] && bl->step[s] < gen_len;
}

/* Bytes of GPU batch k's activations this step, all of its sequences'. */
size_t batch_act_bytes(const block *bl, int k);
/* Every prompt is a non-empty run of token ids in the vocab that fits the model's positions with
 * gen_len more. */
int check_prompts(const opt_config *c, int n, int *const *prompts, const int *lens, int gen_len,
                  char *err);
int check_forced(const opt_config *c, const gen_options *opt, int n_prompts, char *err); /* ids of the vocab */
/* The last stage chooses each sequence's next token from the block's logits (into bl->ids). */
void sample_tokens(block *bl, const gen_options *opt, float *logits_out, float *scratch);
/* Takes the tokens chosen for each slot (bl->ids) as its prompt's output and its next input;
 * returns how many sequences are still running. */
int take_tokens(block *bl, const gen_options *opt, int *out_tokens);

/* What the schedule does at the edges of a pipeline stage (§4.4): pipeline.c's hooks, or, in one
 * process, flexgen.c's, which do nothing. */
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
