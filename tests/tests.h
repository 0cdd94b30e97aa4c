/* tests.h: the CUnit suites of `make test` and helpers they share. */
#ifndef FLEXGEN_TESTS_H
#define FLEXGEN_TESTS_H

#include <CUnit/CUnit.h>
#include <stdint.h>

#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

void add_tokenizer_tests(void);  /* test_tokenizer.c */
void add_tokenizer_json_tests(void); /* test_tokenizer_json.c */
void add_model_tests(void);      /* test_model.c: forward pass against PyTorch fixtures */
void add_checkpoint_tests(void); /* test_checkpoint.c: loader and its bad input */
void add_cli_tests(void);        /* test_cli.c: ./flexgen end to end and its bad flags */
void add_job_tests(void);        /* test_jobs.c: batch jobs (--output, --resume) and their bad input */
void add_runtime_tests(void);    /* test_runtime.c: tiers, placement, the overlapped schedule */
void add_quant_tests(void);      /* test_quant.c: 4-bit group-wise compression */
void add_matmul_tests(void);     /* test_matmul.c: products with fp16 and 4-bit weights */
void add_compress_tests(void);   /* test_compress.c: compression end to end */
void add_lp_tests(void);         /* test_lp.c: the simplex against GLPK */
void add_cost_tests(void);       /* test_cost.c: the cost model of §4.3, by hand */
void add_policy_tests(void);     /* test_policy.c: the policy search against the plan check */
void add_cuda_tests(void);       /* test_cuda.c: the CUDA backend against the CPU (suite "gpu") */
void add_gpu_cli_tests(void);    /* test_gpu_cli.c: the whole program on the GPU against the CPU */
void add_pipeline_tests(void);   /* test_pipeline.c: mpirun -np 2 and 3 against one process */
void add_schedule_tests(void);   /* test_schedule.c: the diagonal schedule against the zig-zag one */
void add_kernel_tests(void);     /* test_kernels.cu: each CUDA kernel against its CPU reference */
void add_emu_tests(void);        /* cuda_emu/test_emu.cpp: the emulated GPU's own checks */

/* A check whose failure says what was expected and what came, in CUnit's list of failures:
 *   1. tests/test_runtime.c:191  - disk->cpu bytes: expected 18432, got 0
 * (printf-style message; formatted on every call, so keep it out of per-element loops). */
/* The running test ran nothing it could check (no GPU, no MPI: why): it counts as skipped, not
 * passed, and the test returns. */
void test_skip(const char *why);
void expect_(int ok, const char *file, unsigned line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define EXPECT(ok, ...) expect_((ok), __FILE__, __LINE__, __VA_ARGS__)

/* make test-san checks memory; make test has checked the numbers. Under the sanitizers (ten
 * times slower) a test whose cases form a matrix, placements by variants, may run one diagonal
 * of it: every row and every column once, so every code path still runs. */
#ifdef __SANITIZE_ADDRESS__
#define SANITIZERS_ONE_DIAGONAL 1
#else
#define SANITIZERS_ONE_DIAGONAL 0
#endif

/* Runs argv (argv[0] found on PATH) with stdin_text (NULL: empty); *out and *err get its stdout
 * and stderr (malloc'd). Returns its exit status, 128 + the signal, or -1 (test_cli.c). */
int run_command(const char *const *argv, const char *stdin_text, char **out, char **err);
const char *flexgen_bin(void); /* $FLEXGEN_BIN, or ./flexgen */
/* run_command on $FLEXGEN_BIN with args (NULL-terminated, argv[0] left out). */
int run_flexgen(const char *const *args, const char *stdin_text, char **out, char **err);
#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})
/* The run exits 2 with nothing on stdout and one stderr line "flexgen: ..." holding each string
 * of the NULL-terminated list (a failed check otherwise). */
void expect_fail(const char *const *args, const char *stdin_text, ...);
#define EXPECT_FAIL(args, ...) expect_fail(args, NULL, __VA_ARGS__, (const char *)NULL)
int count_lines(const char *s); /* newlines in s; 0 for NULL */
/* |a - b|, infinite where either is not a number: a NaN logit counts as the worst difference
 * (fmaxf passes over a NaN). */
float logit_gap(float a, float b);
/* text with its first `from` replaced by `to` (malloc'd); the test stops where text has no `from`. */
char *replaced(const char *text, const char *from, const char *to);
void write_text_file(const char *path, const char *text); /* the file is made, or the test stops */
/* A hardware file of plausible rates for the CPU backend (the gpu tier is host memory). */
void write_hw(const char *path);

/* Path of a file under tests/fixtures (static buffer, valid until the next call). */
const char *fixture(const char *rel);
/* Uniform in [0, 1), from a seeded 64-bit LCG: the same numbers on every machine. */
float test_uniform(uint64_t *s);
/* A fixture checkpoint (tests/fixtures/NAME) and the first n lines of its prompts.txt (token
 * ids), cycled when it has fewer; each prompt its own allocation. */
typedef struct {
    char dir[4096];
    model_config cfg;
    int n, **prompts, *lens;
} fixture_prompts;
void fixture_prompts_open(const char *name, int n, fixture_prompts *f);
void fixture_prompts_close(fixture_prompts *f);
/* fn(arg, err) in a child process killed after `seconds`, so that a call that blocks (an open()
 * of a FIFO that no one writes) fails its test instead of hanging the suite. Returns fn's result
 * with its error line in err (FG_ERR_LEN), or -2 with err saying the child did not finish. */
int run_bounded(int (*fn)(void *arg, char *err), void *arg, int seconds, char *err);
/* A fresh empty directory under $TMPDIR for one test; removed by rm_tree(). */
char *make_temp_dir(void);
void rm_tree(const char *dir);
/* setenv (unsetenv where value is NULL), handing back the value before (malloc'd; NULL: unset);
 * env_restore puts that back and frees it. */
char *env_put(const char *name, const char *value);
void env_restore(const char *name, char *saved);
/* dir/name in one of four static buffers (so a call may take the result of another); a whole
 * file (malloc'd, NUL-terminated, *len its bytes; NULL if it cannot be read); the names in dir
 * besides . and .. (-1: no such dir). */
const char *join(const char *dir, const char *name);
char *slurp(const char *path, size_t *len);
int dir_entries(const char *dir);

/* The CPU with fp16 activations and the CUDA backend's sizes (workspace, device reserve, copy
 * buffers, delegated host rows): put in place of a runtime's backend, its plan check is the one a
 * GPU runs, on a machine without one. */
const fg_backend *cuda_sized_backend(void);

/* generate() with policy p on a checkpoint dir, or (dir NULL) dummy weights of cfg from seed.
 * stats: NULL, or the runtime's tier peaks and link bytes after the run. Returns -1 when
 * generate (or opening) fails, with the error line in err (FG_ERR_LEN), or printed if err is NULL. */
int generate_with(const char *dir, const model_config *cfg, uint64_t seed, const fg_policy *p,
                  int gen_len, int n, int *const *prompts, const int *lens, int *tokens,
                  float *logits, fg_stats *stats, char *err);

/* The same, fed `forced` ([n][gen_len] tokens) instead of its own (teacher forcing). */
int generate_forced(const char *dir, const fg_policy *p, int gen_len, int n, int *const *prompts,
                    const int *lens, const int *forced, int *tokens, float *logits, fg_stats *stats,
                    char *err);

/* A command line built in pieces (v NULL-terminated), for run_command. */
enum { ARGLIST_MAX = 160 };
typedef struct {
    const char *v[ARGLIST_MAX];
    int n;
} arglist;
void arglist_add(arglist *a, const char *const *args); /* args NULL-terminated; NULL adds nothing */

#endif