/* support/tools.h: the services' interface beyond support.h, for the program around the paper
 * (app/) and the tests: whole files, output files and signals, checkpoints and dummy weights,
 * safetensors, the tokenizers, the trace file, OpenBLAS's core. It knows nothing of the runtime
 * (flexgen.h); app/app.h is the program's own half.
 */
#ifndef FLEXGEN_TOOLS_H
#define FLEXGEN_TOOLS_H

#include "support/support.h"

#include <stdio.h>
#include <sys/types.h>

/* A whole file, NUL-terminated (*len, if not NULL, excludes the NUL); NULL and err on failure.
 * Only regular files of at most FG_MAX_TEXT_FILE bytes are read: a FIFO, a device or a directory is
 * refused without blocking, and so is a file too big to be one of the text files read whole
 * (config.json, vocab.json, merges.txt, the shard index, hardware files). */
char *fg_read_file(const char *path, size_t *len, char *err);
/* OPT's vocab.json is about 1 MB and its merges.txt 0.5 MB: 64 MiB leaves ample headroom and
 * stops a wrong path (a checkpoint, say) from being read into memory. */
#define FG_MAX_TEXT_FILE ((size_t)64 << 20)
/* A JSON object's member `key`; where the key is repeated, its last value, as Python's json reads
 * it (cJSON's own lookup finds the first). Every JSON file read here goes through it. */
typedef struct cJSON cJSON;
const cJSON *fg_json_get(const cJSON *o, const char *key);
/* JSON text[0..len) of `path` read as Python's json reads it, or NULL with one line naming the
 * file: one value and only spaces after it; no NUL byte (JSON text has none); and no string
 * holding the escape \u0000, which Python reads but a C string cannot carry (cJSON would end a
 * key or a value there, and read it as another). Every JSON file read here goes through it. */
cJSON *fg_json_parse(const char *path, const char *text, size_t len, char *err);
/* fg_read_file, then fg_json_parse. */
cJSON *fg_json_read_file(const char *path, char *err);
/* The first escape \u0000 in JSON text[0..len), or NULL. */
const char *fg_json_nul_escape(const char *text, size_t len);

/* ------------------------------------------------------------------------------------------
 * Output files and signals (util.c). An output is written to a temporary beside its path and
 * renamed over it by commit; abort, an error or a signal that ends the process removes it.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    FILE *f;
    const char *flag, *path;  /* for error lines: "--trace out.json: ..." */
    char target[FG_PATH_LEN]; /* the file replaced: path, or the file its symbolic link names */
    char tmp[FG_PATH_LEN];
    int slot, fd;
    int error; /* errno of the first write that failed, 0 if none */
} fg_output;
int fg_output_open(fg_output *o, const char *flag, const char *path, char *err);
int fg_output_commit(fg_output *o, char *err);
void fg_output_abort(fg_output *o); /* its temporary removed, the path untouched */
/* Whether path is a symbolic link to nothing: err says so, naming flag. */
int fg_dangling_link(const char *flag, const char *path, char *err);
/* Outputs that stand or fall together (a run's --dump-logits and --trace): each written through
 * to the device first, then each renamed into place; where one cannot be written, none is. */
int fg_outputs_commit(fg_output *const *o, int n, char *err);
/* Why a write to path failed (errno e), in words: a full device, a quota, a file size limit. */
const char *fg_write_failure(const char *path, int e);
/* Whether path can be written as an output, before the work that makes it: also
 * fg_output_apart_from_std. */
int fg_output_check(const char *flag, const char *path, char *err);
/* Whether path is not the regular file standard output or standard error writes to (`> f`,
 * `2> f`, /dev/stdout), where the report would write over the output: -1 (err names flag, path
 * and the stream) where it is. */
int fg_output_apart_from_std(const char *flag, const char *path, char *err);
/* SIGINT, SIGTERM, SIGHUP remove the outputs' temporaries; a SIGBUS in a watched mapping ends
 * the process with one line naming its file and exit status 2. */
void fg_install_signal_handlers(void);
/* A job's output made by this process (open's O_CREAT | O_EXCL, for reading and appending; -1 and
 * errno where it cannot be), watched from the moment it exists: a signal that ends the process
 * removes it while it is still empty and its path still names it. One at a time. */
int fg_create_new_output(const char *path);
void fg_unwatch_new_output(void);
void fg_watch_mapping(const void *base, size_t size, const char *path);
void fg_unwatch_mapping(const void *base);

/* For the tests: the products' path (an fg_isa; -1: fg_isa_active's). The caller makes sure the
 * CPU has it. */
void matmul_force_isa(int isa);

/* HF config.json. */
int model_config_from_json(const char *path, model_config *cfg, char *err);
/* FlexGen's size formulas (flexgen/model_config.py), in bytes of fp16. */
double opt_model_bytes(const model_config *cfg);
double opt_cache_bytes(const model_config *cfg, int batch, int seq_len);
double opt_hidden_bytes(const model_config *cfg, int batch, int seq_len);

/* An HF checkpoint directory, all tensors in one fp16 arena. */
int model_weights_load(const char *dir, model_weights *w, char *err);
void model_weights_free(model_weights *w);
/* Where checkpoint tensor `name` (HF name, with or without "model.") is held: its element [r][c]
 * is at first[r * row_stride + c * col_stride]. Returns -1 for a name the model does not have. */
int opt_weight_locate(const model_weights *w, const char *name, const fp16 **first,
                      size_t *row_stride, size_t *col_stride);

int st_open_dir(const char *dir, st_archive *a, char *err);
int st_open_file(const char *path, st_archive *a, char *err); /* appends one file's tensors */
/* The names of the files in dir that st_open_dir reads (malloc'd, each once, unsorted): the shard
 * index and the shards it names, or model.safetensors. The index is read, nothing else. */
int st_dir_files(const char *dir, char ***names, int *n, char *err);

/* ------------------------------------------------------------------------------------------
 * Tokenizers: BPE (tokenizer.c, tokenizer_encode.c), from OPT's vocab.json and merges.txt (GPT-2's
 * byte-level BPE) or from a tokenizer.json (tokenizer_json.c: LLaMA's, Mistral's and Qwen2's).
 * ------------------------------------------------------------------------------------------ */
typedef struct fg_tokenizer fg_tokenizer;

/* Also reads the special and added tokens of the special_tokens_map.json, tokenizer_config.json
 * and added_tokens.json beside vocab_path, where present (as HF's from_pretrained does). */
fg_tokenizer *tokenizer_load(const char *vocab_path, const char *merges_path, char *err);
/* Those files: tokenizer_config.json (which tokenizer_load_json reads too), special_tokens_map.json
 * and added_tokens.json. */
extern const char *const fg_tokenizer_side_files[3];
/* HF tokenizers' tokenizer.json, and add_bos_token of the tokenizer_config.json beside it. */
fg_tokenizer *tokenizer_load_json(const char *path, char *err);
/* A model directory's tokenizer: tokenizer.json, else vocab.json and merges.txt. NULL with an
 * empty err when it has neither. */
fg_tokenizer *tokenizer_load_dir(const char *dir, char *err);
void tokenizer_free(fg_tokenizer *t);
/* One past the largest id: of the vocab, or of an added token. */
int tokenizer_vocab_size(const fg_tokenizer *t);
/* The id a prompt starts with (BOS), or -1 for none. */
int tokenizer_bos_id(const fg_tokenizer *t);
/* Encodes len bytes of text (no BOS added); special and added tokens in the text become their
 * ids, as HF's tokenizers split them out. *ids is malloc'd; the caller frees it. */
int tokenizer_encode(const fg_tokenizer *t, const char *text, size_t len, int **ids, int *n_ids,
                     char *err);
/* Decodes to a malloc'd NUL-terminated byte string, as HF's decode does (special tokens kept);
 * *out_len excludes the NUL. Ids the vocab does not hold decode to nothing. Returns NULL only
 * when out of memory. */
char *tokenizer_decode(const fg_tokenizer *t, const int *ids, int n_ids, size_t *out_len);
/* The bytes that ids[from..n) add to the decoding of ids[0..from): a continuation's text. */
char *tokenizer_decode_from(const fg_tokenizer *t, const int *ids, int n_ids, int from,
                            size_t *out_len);

/* What tokenizer_json.c tells tokenizer.c: how text becomes BPE's words, and the vocab. */
typedef enum { PRETOK_NONE, PRETOK_GPT2, PRETOK_LLAMA3, PRETOK_QWEN2 } tok_pretok;
typedef enum {
    PREPEND_NONE,
    PREPEND_EACH,
    PREPEND_EACH_UNLESS_THERE,
    PREPEND_FIRST_UNLESS_THERE
} tok_prepend;
typedef struct {
    int byte_level;      /* bytes through GPT-2's byte map; else characters (SentencePiece-style) */
    tok_pretok pretok;   /* the Split regex (or none: the text between added tokens is one word) */
    int nfc;             /* the NFC normalizer */
    tok_prepend prepend; /* U+2581 before a text piece: SentencePiece's dummy prefix */
    int spaces_to_meta;  /* ' ' becomes U+2581 */
    int byte_fallback;   /* a character the vocab lacks becomes its <0xNN> tokens */
    int fuse_unk;        /* consecutive unknown characters make one unk token */
    int ignore_merges;   /* a word that is a vocab token is that token */
    int strip_space;     /* the decoder drops one leading space (Strip) */
    int drop_first_meta; /* the decoder drops every U+2581 of the first token (Metaspace) */
    int bos_id;          /* -1: none */
} tok_rules;
typedef struct {
    const char *text;
    size_t len;
    int id, lstrip, rstrip, single_word;
} tok_added;
fg_tokenizer *tokenizer_new(const tok_rules *rules, int n_vocab, char *err);
/* Token `id`'s text (each id once; ids below n_vocab). */
int tokenizer_add_token(fg_tokenizer *t, const char *s, size_t n, int id, const char *path,
                        char *err);
/* Merge number `rank`: a + b; both and their concatenation are tokens. */
int tokenizer_add_merge(fg_tokenizer *t, const char *a, size_t an, const char *b, size_t bn,
                        int rank, const char *where, char *err);
/* The added tokens, the unk token (NULL: none), and the decode table. */
int tokenizer_finish(fg_tokenizer *t, const tok_added *added, int n_added, const char *unk,
                     const char *path, char *err);

int fg_cuda_compiled(void); /* this build has the CUDA backend */
/* The CUDA backend's FLEXGEN_CUDA_* settings readable: 0, or -1 with err naming the one that is
 * not (a build without CUDA reads none). */
int fg_cuda_settings(char *err);

/* A run's trace (its fg_trace) as stage `stage` of n (trace.c; Chrome's trace events, one a
 * line; malloc'd), and a trace file of every stage's events written into an open output. */
char *fg_trace_events(const fg_trace *tr, int stage, int n);
void fg_trace_write_events(FILE *f, const char *events);

/* ------------------------------------------------------------------------------------------
 * OpenBLAS's core (blas_core.c): the one the library picked as it loaded, and a better one for
 * this CPU's instruction set, which ./flexgen's main starts itself again on.
 * ------------------------------------------------------------------------------------------ */
/* The core to force on a CPU of `features` where the library picked `picked`: the core of the
 * CPU's best instruction set (AVX-512 F/BW/DQ/VL: SkylakeX, AVX2 and FMA: Haswell, AVX:
 * Sandybridge) when `picked` is a known core of a lower one. NULL: nothing to force (the user set
 * OPENBLAS_CORETYPE, `picked` is as good or unknown, or the CPU has no AVX). */
const char *fg_blas_core_due(unsigned features, const char *picked, int user_set);
/* main's first step: when a core is due and the user has not set OPENBLAS_CORETYPE, sets it and
 * FLEXGEN_BLAS_CORE_FORCED (the core picked; it stops a second start) and returns the core, for
 * main to exec itself; NULL otherwise. fg_blas_core_unforce undoes it where the exec failed,
 * with one line on stderr. */
const char *fg_blas_core_force(void);
void fg_blas_core_unforce(const char *core, int errnum);
/* A user's OPENBLAS_CORETYPE checked, before OpenBLAS runs a product: 0, or -1 with err naming it
 * where it is a core of a wider instruction set than this CPU's, or not a core OpenBLAS has. */
int fg_blas_core_check_env(char *err);
/* c[m][n] (= or +=) a[m][k] b[k][n] on OpenBLAS in tiles fixed by the shape, each on one thread:
 * the same bits on any number of threads (blas_core.c) */
void sgemm_fixed_tiles(int m, int n, int k, const float *a, int lda, const float *b, int ldb,
                       int accumulate, float *c, int ldc);
/* What the report says: "OpenBLAS 0.3.21", the core running, and why it is that one ("chosen
 * for AVX-512; the library picked Haswell", "OPENBLAS_CORETYPE", "as the library picked"). */
typedef struct {
    char library[32], core[96], why[96];
} fg_blas_info;
void fg_blas_info_get(fg_blas_info *b);

#endif
