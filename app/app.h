/* app/app.h: the interface of the program around the paper (app/), for its files and the tests:
 * the command line's main, perplexity, the link between pipeline stages and their hooks, the
 * hardware file and the profiler, batch jobs. The services' half is support/tools.h.
 */
#ifndef FLEXGEN_APP_H
#define FLEXGEN_APP_H

#include "flexgen.h"
#include "support/support.h"
#include "support/tools.h"

#include <stdio.h>

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

int fg_hardware_read(const char *path, fg_hardware *hw, char *err);
int fg_hardware_write(const char *path, const fg_hardware *hw, char *err);
/* Measures this machine's constants on the runtime's own paths (profile.c) with the backend of
 * `device`, with a 1 GiB file in offload_dir for the disk; progress on stderr when verbose. */
int fg_profile(const char *offload_dir, fg_device device, fg_hardware *hw, int verbose, char *err);

/* ------------------------------------------------------------------------------------------
 * Batch jobs (jobs.c): prompts in JSONL, records appended to --output as rounds finish, --resume.
 * ------------------------------------------------------------------------------------------ */
/* text's bytes with invalid UTF-8 replaced by U+FFFD (malloc'd, NUL-terminated; *out_len its bytes). */
char *utf8_replace_invalid(const char *text, size_t len, size_t *out_len);
/* One line of a JSONL prompt file: its "prompt" as *text, or its "prompt_ids" as *ids (*n of them,
 * checked against vocab), and *id, the record's id as JSON text; each malloc'd, the other of
 * *text and *ids NULL. */
int jsonl_prompt(const char *path, int line_no, const char *line, int vocab, int **ids, int *n, char **id,
                 char **text, char *err);
/* An id that two of the n prompts share (one of ids' strings), or NULL. */
const char *job_repeated_id(char *const *ids, int n);
/* A checkpoint directory named by its content, not its path: its config, its shard index, and
 * each .safetensors file: its name, its size and a hash of every byte. */
int job_checkpoint_hash(const char *dir, uint64_t *hash, char *err);
/* What a job's tokens depend on besides the flags: the model (a dummy model's name, or NULL and
 * a checkpoint's hash), the prompts (their ids and tokens, hashed), the device, and the kernels of
 * other libraries that sum in their own order: on the CPU devices OpenBLAS's core (its sgemm runs
 * prefill), and with --bf16-prefill the instruction set oneDNN's kernels use (NULL: not recorded).
 * Not the path of our own
 * kernels (FLEXGEN_ISA) nor the threads: they leave every bit as it is (docs/DESIGN.md, "Same
 * bits"). */
typedef struct {
    const char *model, *device, *blas_core, *prefill_library;
    uint64_t checkpoint_hash, prompts_hash;
    int n_prompts;
} job_identity;
/* The output's first line, which names the job (malloc'd): the identity, the flags that change
 * the tokens, and the block's shape (a batch's numbers depend on its rows). */
char *job_header(const job_identity *id, const gen_options *g, const fg_policy *p);
typedef struct {
    const char *path;
    char *header;      /* this job's first line (owned), written before its first record */
    cJSON *recorded;   /* an existing output's job ("flexgen_job"'s value), or NULL */
    int fd;            /* open and locked (flock) from job_output_open to job_output_close */
    int created;       /* made by this job: removed at close (or by a signal) while still empty */
    off_t size;        /* the output's bytes */
    int n_done;
    char **done;       /* the ids already in the output, sorted */
} job_output;
/* Opens path as a job's output, creating it if need be, and locks it for the whole job (a second
 * job on the file is refused); with resume, an existing output's job line and ids are read. */
int job_output_open(job_output *o, const char *path, int resume, char *err);
/* The block shape an existing output was made with (0 where none is recorded), and its schedule. */
void job_output_shape(const job_output *o, int *gpu_batch_size, int *num_gpu_batches, fg_schedule *schedule);
/* This job's first line (taken over): an existing output must hold the same job. */
int job_output_begin(job_output *o, char *header, char *err);
/* An id of the output's records that none of the n prompts has, or NULL. */
const char *job_output_stranger(const job_output *o, char *const *ids, int n);
int job_output_done(const job_output *o, const char *id);
/* Whole lines appended in one write and flushed to the disk; the first carries the header. The
 * path must still name the file the job holds. */
int job_output_append(job_output *o, const char *lines, size_t len, char *err);
void job_output_close(job_output *o);
char *job_record(const char *id, const char *text, const int *prompt, int prompt_len, const int *gen,
                 const gen_options *g, const fg_tokenizer *tok);

#endif
