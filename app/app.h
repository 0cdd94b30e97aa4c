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
    int verbose; /* progress on stderr */
} ppl_options;

typedef struct {
    double nll;                  /* nats, summed over the scored tokens */
    long scored;                 /* tokens scored: every one but the first */
    double perplexity;           /* exp(nll / scored) */
    int windows, window, stride; /* how many, their size and advance */
    double seconds;
} ppl_result;

/* top1: NULL, or [n - 1]: the most likely token at each scored position, top1[t - 1] the
 * prediction of ids[t]. */
int fg_perplexity(fg_model *m, const int *ids, int n, const ppl_options *o, int *top1,
                  ppl_result *r, char *err);

int flexgen_main(int argc, char **argv);

/* ------------------------------------------------------------------------------------------
 * A run's runtime and model (runtime.c): the tiers and the I/O threads of flexgen.c opened for a
 * policy, a model opened on them, and the plan check the policy search calls (§4.3).
 * ------------------------------------------------------------------------------------------ */
fg_policy fg_default_policy(void); /* all on the gpu tier, overlap on, a 2 x 16 block, the CPU */
const fg_backend *backend_for(fg_device device, char *err);
const fg_backend *fg_cpu_fp16_backend(void); /* the CPU with fp16 activations (cpu_fp16.c) */
int fg_runtime_open(const fg_policy *p, fg_runtime **rt, char *err);
const fg_backend *fg_runtime_backend(const fg_runtime *rt);
void fg_runtime_close(fg_runtime *rt); /* removes every file the run made in the offload dir */
void fg_runtime_stats(const fg_runtime *rt, fg_stats *s);
void fg_runtime_trace_restart(fg_runtime *rt); /* the trace from now on (after a warm-up) */
/* `model`: an OPT size name (dummy weights from seed) or an HF checkpoint directory; its weights
 * go to their homes on the first generate() (or fg_model_load). */
int fg_model_open(fg_runtime *rt, const char *model, uint64_t seed, fg_model **m, char *err);
int fg_model_open_dummy(fg_runtime *rt, const model_config *cfg, uint64_t seed, fg_model **m,
                        char *err);
const model_config *fg_model_config(const fg_model *m);
int fg_model_load(fg_model *m, char *err);
void fg_model_close(fg_model *m);
/* The plan check of policy p for this runtime (fg_plan_check, flexgen.h). */
int fg_runtime_check(const model_config *model, uint64_t seed, const fg_policy *p, int sequences,
                     int s, int n, int check, double x[N_X], fg_stats *st, char *err);
void fg_plan_placement(const fg_model *m, int n_prompts, double x[N_X]);
/* --int8-activations' prefill (int8_columns.c): W's int8 columns (support/matmul.c) made once for
 * the 4-bit matrices resident on the gpu tier, where the plan of a generate has room for them
 * beside everything else; dropped where a later plan needs their room (the runtime's hooks). */
void keep_int8_columns(fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len);
void drop_int8_columns(fg_model *m);

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
int fg_pipe_rank(const fg_pipe *p); /* 0 for NULL */
int fg_pipe_size(const fg_pipe *p); /* 1 for NULL */
/* Non-blocking: returns a message handle at once; buf must stay until the message is released.
 * A message completes in posting order per (peer, tag), as MPI's are. */
int fg_pipe_send(fg_pipe *p, int to, int tag, const void *buf, size_t bytes);
int fg_pipe_recv(fg_pipe *p, int from, int tag, void *buf, size_t bytes);
void fg_pipe_release(fg_pipe *p, int msg); /* waits, then frees the handle */
double fg_pipe_bytes_sent(const fg_pipe *p);
/* Collective: 0 when rc is 0 on every rank. Otherwise -1 everywhere, and err holds the one line
 * of the job: the lowest failing rank's, prefixed with its rank, on that rank; "" elsewhere. */
int fg_pipe_agree(fg_pipe *p, int rc, char *err);
void fg_pipe_bcast(fg_pipe *p, void *buf, size_t bytes);                    /* from rank 0 */
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
/* Two decode runs of a layer (t[i] seconds at gbs[i] sequences; working: its weights' bytes,
 * mm_token: its products' FLOPs a token) read as the line t = working / mem_bdw + gbs mm_token /
 * mm_flops_g. A layer bound by its arithmetic runs in times nearly proportional to gbs, which
 * leaves the weights' read (the intercept) in the noise: it is taken as at least 1% of t[0] and,
 * where the weights are in host memory (read_rate > 0, the memory's read rate), as at least the
 * time the memory takes to deliver them, so that no read is faster than the memory. */
typedef struct {
    double t[2];
    int gbs[2];
    double working, mm_token, read_rate;
} decode_runs;
void profile_decode_line(const decode_runs *r, double *mem_bdw, double *mm_flops_g);

/* ------------------------------------------------------------------------------------------
 * Batch jobs (jobs.c): prompts in JSONL, records appended to --output as rounds finish, --resume.
 * ------------------------------------------------------------------------------------------ */
/* text's bytes with invalid UTF-8 replaced by U+FFFD (malloc'd, NUL-terminated; *out_len its
 * bytes). */
char *utf8_replace_invalid(const char *text, size_t len, size_t *out_len);
/* The offset of text's first byte that is not part of valid UTF-8; len if there is none. */
size_t utf8_first_invalid(const char *text, size_t len);
/* One line of a JSONL prompt file: its "prompt" as *text, or its "prompt_ids" as *ids (*n of them,
 * checked against vocab), and *id, the record's id as JSON text; each malloc'd, the other of
 * *text and *ids NULL. */
int jsonl_prompt(const char *path, int line_no, const char *line, int vocab, int **ids, int *n,
                 char **id, char **text, char *err);
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
    char *header;    /* this job's first line (owned), written before its first record */
    cJSON *recorded; /* an existing output's job ("flexgen_job"'s value), or NULL */
    int fd;          /* open and locked (flock) from job_output_open to job_output_close */
    int created;     /* made by this job: removed at close (or by a signal) while still empty */
    off_t size;      /* the output's bytes, in whole lines */
    int partial;     /* a last line cut short follows them, cut off before the first append */
    int n_done;
    char **done; /* the ids already in the output, sorted */
} job_output;
/* Opens path as a job's output, creating it if need be, and locks it for the whole job (a second
 * job on the file is refused); with resume, an existing output's job line and ids are read. */
int job_output_open(job_output *o, const char *path, int resume, char *err);
/* The block shape an existing output was made with (0 where none is recorded), and its schedule. */
void job_output_shape(const job_output *o, int *gpu_batch_size, int *num_gpu_batches,
                      fg_schedule *schedule);
/* This job's first line (taken over): an existing output must hold the same job. */
int job_output_begin(job_output *o, char *header, char *err);
/* An id of the output's records that none of the n prompts has, or NULL. */
const char *job_output_stranger(const job_output *o, char *const *ids, int n);
int job_output_done(const job_output *o, const char *id);
/* The last line cut short by a crash (read_done noted it), cut off: done before the first append,
 * and by a resumed job that finds every record there. */
int job_output_cut_partial(job_output *o, char *err);
/* Whole lines appended in one write and flushed to the disk; the first carries the header. The
 * path must still name the file the job holds. */
int job_output_append(job_output *o, const char *lines, size_t len, char *err);
void job_output_close(job_output *o);
char *job_record(const char *id, const char *text, const int *prompt, int prompt_len,
                 const int *gen, const gen_options *g, const fg_tokenizer *tok);

/* ------------------------------------------------------------------------------------------
 * The command line (cli.c and the files it splits into): its flags (args.c), the prompts
 * (prompts.c), the model, device and policy search a run and `flexgen policy` share (plan.c), a
 * run (run.c) and a batch job's rounds (job_run.c), the report (report.c), the subcommands
 * (commands.c).
 * ------------------------------------------------------------------------------------------ */
/* The flags of a command line, as parse_args reads them. */
typedef struct {
    const char *model, *prompt_file, *prompt_ids, *dump_logits, *vocab, *merges, *tokenizer, *trace;
    const char *output;  /* --output: the job's records, appended as rounds finish (jobs.c) */
    int resume, quiet;   /* --resume: finish the job of --output; --quiet: no progress at all */
    int progress;        /* --progress: progress on stderr even where it is not a terminal */
    int warmup;          /* --warmup: a short generate first, untimed (warm_up) */
    double cold_seconds; /* its latency: the cold first run's; < 0 without --warmup */
    double cold_prefill, cold_decode; /* the two parts of it: its prefill, its decode step */
    int job_finished;                 /* --resume found every prompt's record in --output */
    /* a pipeline's OpenBLAS cores and --bf16-prefill's oneDNN instruction sets, stage by stage,
     * where the stages' differ (rank 0; "" where they agree): run.c's share_libraries */
    char stage_cores[96], stage_prefill_libraries[96];
    int n_job_prompts;     /* the job's prompts, with those --output has records of */
    uint64_t prompts_hash; /* their ids and tokens (a job's identity) */
    const char *hw;        /* hardware file of the cost model (--hw) */
    const char **prompts;
    int n_prompt_texts, prompt_len, json;
    int auto_policy;         /* --policy auto: search for the policy (§4.3) */
    int schedule_given;      /* --schedule: the search keeps it (else it chooses, Appendix A.2) */
    int prompt_len_given;    /* --prompt-len: refused beside given prompts, which it cannot size */
    const char *searched[3]; /* those of --percent, --gpu-batch-size, --num-gpu-batches given,
                                in order: a search chooses them, and says so (warn_searched) */
    int n_searched;
    int evaluate;       /* flexgen policy --evaluate: predict the given policy, no search */
    double max_latency; /* --max-latency: the search's bound on a block's latency */
    const char *text, *predictions, *compare; /* flexgen perplexity's files */
    ppl_options ppl;
    const char *ppl_flag; /* the first flag given that only flexgen perplexity takes */
    gen_options gen;
    fg_policy policy;
} cli_args;

/* The prompts, and for a job's records (rank 0) each one's id (JSON text) and text as given
 * (NULL: given as ids); index: its place in the prompt file (a resumed job skips some). */
typedef struct {
    int n, cap;
    int **ids;
    int *lens, *index;
    char **record_ids, **texts;
} prompt_set;

/* What each stage of a pipeline tells rank 0 for the report (§4.4). */
typedef struct {
    int first_layer, end_layer;
    fg_percent percent;
    fg_stats st;
    double sent, compute, bubble, disk_read, peak_rss;
} stage_report;

enum { JOB_WINDOW = 8 }; /* a batch job's window: rounds of prompts (run_rounds) */

/* args.c: parse_args returns 0, 1 for --help, or -1 with err; usage prints --help's text. */
int parse_args(int argc, char **argv, cli_args *a, char *err);
void usage(FILE *out);
void usage_command(FILE *out, const char *command); /* profile's and tokenize's own; else usage */
int is_help(const char *arg);                       /* --help or -h */
int is_flag(const char *s);                         /* one of the program's flags */
/* A path flag's value that is one of the flags (`--out --device`): refused, naming both. */
int flag_for_path(const char *flag, const char *value, const char *kind, char *err);
int parse_device(const char *s, fg_device *d, char *err);
/* The flags that `flexgen policy` and `flexgen perplexity` have no use for, refused. */
int check_command_flags(const char *command, int argc, char **argv, char *err);
/* One warning line naming the block and placement flags given beside a search that chose them
 * (why: who chose them). */
void warn_searched(const cli_args *a, const char *why);

/* prompts.c */
/* What to give where a command needs a tokenizer and the model directory holds none. */
#define TOKENIZER_WAYS                                                             \
    "give --tokenizer F.json, --vocab and --merges, or a model directory holding " \
    "tokenizer.json, or vocab.json and merges.txt"
void prompts_free(prompt_set *p);
int prompts_add(prompt_set *p, int *ids, int len, char *err);
int add_text_prompt(prompt_set *p, const fg_tokenizer *tok, const char *text, size_t len, char *id,
                    char *err);
int synthetic_prompts(prompt_set *p, const cli_args *a, int stages, int vocab, char *err);
int open_run_tokenizer(const cli_args *a, fg_tokenizer **tok, char *err);
/* Where the tokenizer came from, as the user named it (for error lines). */
void tokenizer_origin(const cli_args *a, char *out, size_t n);
/* Every id of a tokenized text (name: "--text F", "F line 3") within the model's vocab; where one
 * is not, the line names the tokenizer, whose vocab is bigger than the model's. */
int check_tokenized_ids(const char *origin, const char *name, const int *ids, int n, int vocab,
                        char *err);
int gather_prompts(const cli_args *a, const fg_tokenizer *tok, const model_config *c, prompt_set *p,
                   char *err);
long prompt_tokens(const prompt_set *p);
int longest_prompt(const prompt_set *p);
int mean_prompt(const cli_args *a, const prompt_set *p);

/* plan.c */
int resolve_device(fg_device *d, int verbose, char *err);
const char *fg_device_name(fg_device d); /* as --device names it */
int resolve_model_config(const char *model, model_config *cfg, char *err);
int check_lengths(const cli_args *a, const model_config *cfg, char *err);
void warn_special_ids(const char *model, const model_config *cfg);
void default_hw_path(char *path, size_t n);
int default_hw_file(char *path, size_t n, char *err);
int load_hardware(const cli_args *a, fg_hardware *hw, char *err);
int search_policy(const cli_args *a, const fg_hardware *hw, const model_config *cfg, int n_prompts,
                  const int lengths[2], int gbs, int ngb, fg_search_result *res, char *err);
void print_policy_flags(FILE *out, const fg_policy *p);
void planned_capacities(const cli_args *a, const fg_hardware *hw, double cap[N_TIERS],
                        double *host);
int open_runtime(const fg_policy *p, fg_runtime **rt, char *err);

/* job_run.c: a batch job (--output) */
int begin_job(const cli_args *a, job_output *out, char *err);
int open_job_output(cli_args *a, prompt_set *p, job_output *out, char *err);
int run_rounds(const cli_args *a, fg_pipe *pipe, fg_model *m, const prompt_set *p,
               const fg_tokenizer *tok, job_output *out, int *tokens, gen_timing *t, char *err);

/* run.c: a run, one process or one stage of a pipeline (§4.4) */
int run_generation(cli_args *a, fg_pipe *pipe, char *err);

/* report.c */
cJSON *percent_json(const fg_percent *p);
int write_run_files(const cli_args *a, const float *logits, size_t n, const char *trace, char *err);
void print_texts(const fg_tokenizer *tok, const prompt_set *p, const int *tokens,
                 const gen_options *opt);
double peak_rss_bytes(void);
void report_run(const cli_args *a, const model_config *c, const prompt_set *p, const gen_timing *t,
                const fg_stats *st, int max_prompt, const char *device, const stage_report *stages,
                int n_stages);
void report_finished_job(const char *output, int records);

/* commands.c: flexgen policy, profile, tokenize, perplexity */
int policy_command(cli_args *a, char *err);
int profile_command(int argc, char **argv, char *err);
int tokenize_command(int argc, char **argv, char *err);
int perplexity_command(cli_args *a, char *err);

#endif
