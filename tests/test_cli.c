/* test_cli.c: the flexgen binary end to end, as a subprocess ($FLEXGEN_BIN, default ./flexgen).
 *
 * Bad input: every bad flag, prompt file or output path exits 2 with exactly one line on stderr,
 * "flexgen: ..." naming the flag or file, and leaves no partial --dump-logits file behind.
 * Good runs on the opt-tiny fixture: the --json report, the default report lines, --help, the
 * dumped logits against the PyTorch reference (tokens.txt, logits.bin), seeded sampling, greedy
 * decoding, --stop-at-eos; text generation from a checkpoint with a tokenizer against what HF
 * decodes; and `flexgen tokenize`.
 */
#define _GNU_SOURCE
#include "tests.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

enum { N_PROMPTS = 5, GEN_LEN = 8, VOCAB = 512, EOS_PROMPT = 3 /* line 4 of prompts.txt */ };

static char tiny_dir[4096], tiny_prompts[4096], tiny_tokens[4096], tiny_logits[4096];

static char kjv_dir[4096], kjv_text[4096], kjv_reference[4096];
/* The trained LLaMA (models/llama-kjv: grouped-query attention, a SentencePiece tokenizer.json). */
static char llama_kjv_dir[4096], llama_kjv_text[4096], llama_kjv_reference[4096];

static int cli_init(void) {
    snprintf(kjv_dir, sizeof kjv_dir, "%s", fixture("../../models/opt-kjv"));
    snprintf(kjv_text, sizeof kjv_text, "%s", fixture("opt-kjv/excerpt.txt"));
    snprintf(kjv_reference, sizeof kjv_reference, "%s", fixture("opt-kjv/reference.json"));
    snprintf(llama_kjv_dir, sizeof llama_kjv_dir, "%s", fixture("../../models/llama-kjv"));
    snprintf(llama_kjv_text, sizeof llama_kjv_text, "%s", fixture("llama-kjv/excerpt.txt"));
    snprintf(llama_kjv_reference, sizeof llama_kjv_reference, "%s", fixture("llama-kjv/reference.json"));
    /* Children must not spin-wait at OpenMP barriers: on a loaded machine (make -j, other test
     * runs) spinning threads of a 2-core box take seconds for the tiny model. */
    setenv("OMP_WAIT_POLICY", "passive", 0);
    snprintf(tiny_dir, sizeof tiny_dir, "%s", fixture("opt-tiny"));
    snprintf(tiny_prompts, sizeof tiny_prompts, "%s", fixture("opt-tiny/prompts.txt"));
    snprintf(tiny_tokens, sizeof tiny_tokens, "%s", fixture("opt-tiny/tokens.txt"));
    snprintf(tiny_logits, sizeof tiny_logits, "%s", fixture("opt-tiny/logits.bin"));
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Running the binary
 * --------------------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t len, cap;
} buffer;

/* Appends what fd has; returns 0 at end of file. */
static int drain(int fd, buffer *b) {
    if (b->len + 4096 > b->cap) b->data = realloc(b->data, b->cap = 2 * b->cap + 4096 + 1);
    ssize_t n = read(fd, b->data + b->len, b->cap - b->len - 1);
    if (n < 0 && errno == EINTR) return 1;
    if (n > 0) b->len += (size_t)n;
    b->data[b->len] = 0;
    return n > 0;
}

/* Runs $FLEXGEN_BIN with args (NULL-terminated, argv[0] left out), stdin_text (NULL: empty) on
 * its stdin. *out and *err get its stdout and stderr (malloc'd, NUL-terminated). Returns its exit
 * status, 128 + the signal when killed, or -1 when it could not start. */
static int sigint_after_ms; /* > 0: the next run gets SIGINT after this long */

static double ms_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

const char *flexgen_bin(void) {
    const char *bin = getenv("FLEXGEN_BIN");
    return bin && *bin ? bin : "./flexgen";
}

int run_flexgen(const char *const *args, const char *stdin_text, char **out, char **err) {
    int n = 0;
    while (args[n]) n++;
    const char **argv = calloc((size_t)n + 2, sizeof *argv);
    argv[0] = flexgen_bin();
    memcpy(argv + 1, args, (size_t)n * sizeof *argv);
    int rc = run_command(argv, stdin_text, out, err);
    free(argv);
    return rc;
}

int run_command(const char *const *argv, const char *stdin_text, char **out, char **err) {
    const char *bin = argv[0];
    int in[2], o[2], e[2];
    if (pipe(in) || pipe(o) || pipe(e)) abort();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, o[1], 1);
    posix_spawn_file_actions_adddup2(&fa, e[1], 2);
    int fds[6] = {in[0], in[1], o[0], o[1], e[0], e[1]};
    for (int i = 0; i < 6; i++) posix_spawn_file_actions_addclose(&fa, fds[i]);
    posix_spawnattr_t attr; /* the child gets SIGPIPE's default back */
    sigset_t dflt;
    sigemptyset(&dflt);
    sigaddset(&dflt, SIGPIPE);
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigdefault(&attr, &dflt);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    void (*old_pipe)(int) = signal(SIGPIPE, SIG_IGN); /* a child that exits before reading */
    pid_t pid;
    int spawned = posix_spawnp(&pid, bin, &fa, &attr, (char *const *)argv, environ) == 0;
    if (!spawned) fprintf(stderr, "\n    cannot run %s (set FLEXGEN_BIN)\n", bin);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    close(in[0]);
    close(o[1]);
    close(e[1]);
    buffer ob = {0}, eb = {0};
    const char *pending = stdin_text ? stdin_text : "";
    size_t left = strlen(pending);
    struct pollfd p[3] = {{o[0], POLLIN, 0}, {e[0], POLLIN, 0}, {in[1], POLLOUT, 0}};
    if (!spawned || left == 0) close(in[1]), p[2].fd = -1;
    double interrupt_at = sigint_after_ms > 0 ? ms_now() + sigint_after_ms : 0;
    while (spawned && (p[0].fd >= 0 || p[1].fd >= 0)) {
        if (interrupt_at && ms_now() >= interrupt_at) kill(pid, SIGINT), interrupt_at = 0;
        if (poll(p, 3, interrupt_at ? 20 : -1) < 0 && errno != EINTR) break;
        if (p[0].revents && !drain(o[0], &ob)) p[0].fd = -1;
        if (p[1].revents && !drain(e[0], &eb)) p[1].fd = -1;
        if (p[2].revents) {
            ssize_t w = (p[2].revents & POLLOUT) ? write(in[1], pending, left) : -1;
            if (w > 0) pending += w, left -= (size_t)w;
            if (w < 0 || left == 0) close(in[1]), p[2].fd = -1;
        }
    }
    if (p[2].fd >= 0) close(in[1]);
    close(o[0]);
    close(e[0]);
    int status = 0, rc = -1;
    if (spawned && waitpid(pid, &status, 0) == pid)
        rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    signal(SIGPIPE, old_pipe);
    drain(-1, &ob); /* makes sure both are allocated and terminated */
    drain(-1, &eb);
    *out = ob.data;
    *err = eb.data;
    return rc;
}

float logit_gap(float a, float b) {
    float gap = fabsf(a - b);
    return gap == gap ? gap : INFINITY;
}

int count_lines(const char *s) { /* NULL (no file yet): 0 */
    int n = 0;
    for (; s && *s; s++) n += *s == '\n';
    return n;
}

/* The run exited 2 with nothing on stdout and one stderr line "flexgen: ..." holding every
 * string of the NULL-terminated list. */
void expect_fail(const char *const *args, const char *stdin_text, ...) {
    char *out, *err;
    int rc = run_flexgen(args, stdin_text, &out, &err), ok = 1;
    va_list ap;
    va_start(ap, stdin_text);
    for (const char *s; (s = va_arg(ap, const char *));) ok &= strstr(err, s) != NULL;
    va_end(ap);
    ok &= rc == 2 && strncmp(err, "flexgen: ", 9) == 0 && count_lines(err) == 1 &&
          err[strlen(err) - 1] == '\n' && out[0] == 0;
    const char *first = args[0] ? args[0] : "", *second = args[0] && args[1] ? args[1] : "";
    EXPECT(ok, "flexgen %s %s ...: expected exit 2, one line on stderr; got exit %d, %.200s", first, second, rc, err);
    if (!ok) {
        fprintf(stderr, "\n    flexgen");
        for (int i = 0; args[i]; i++) fprintf(stderr, " %s", args[i]);
        fprintf(stderr, "\n    exit %d, stderr: %s    stdout: %.200s\n", rc, err, out);
    }
    free(out);
    free(err);
}

/* Runs opt-tiny on its prompts for GEN_LEN tokens with args after the common ones; expects exit
 * 0 and nothing on stderr. Returns stdout (malloc'd). */
static char *run_tiny(const char *const *extra) {
    const char *args[40] = {"--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "8",
                            "--quiet", "--device", "cpu"}; /* the GPU suite compares CUDA */
    int n = 9;
    while (*extra && n < 39) args[n++] = *extra++;
    args[n] = NULL;
    char *out, *err;
    int rc = run_flexgen(args, NULL, &out, &err);
    CU_ASSERT_EQUAL(rc, 0);
    CU_ASSERT_STRING_EQUAL(err, "");
    if (rc != 0) fprintf(stderr, "\n    exit %d: %s\n", rc, err);
    free(err);
    return out;
}

/* ---------------------------------------------------------------------------------------------
 * Files
 * --------------------------------------------------------------------------------------------- */


void write_text_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs(text, f);
    CU_ASSERT_EQUAL(fclose(f), 0);
}


/* The float32 file at path, which must hold exactly n floats. */
static float *read_floats(const char *path, size_t n) {
    size_t len = 0;
    char *data = slurp(path, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(data);
    CU_ASSERT_EQUAL(len, n * sizeof(float));
    if (len != n * sizeof(float)) {
        free(data);
        CU_FAIL_FATAL("logits file of the wrong size");
    }
    return (float *)(void *)data;
}


/* ---------------------------------------------------------------------------------------------
 * The PyTorch reference of opt-tiny
 * --------------------------------------------------------------------------------------------- */

typedef struct {
    float *logits; /* [N_PROMPTS][GEN_LEN][VOCAB] */
    int tokens[N_PROMPTS][GEN_LEN];
    float tol;     /* 1e-4 of the largest |logit| */
} reference;

static void load_reference(reference *r) {
    r->logits = read_floats(tiny_logits, (size_t)N_PROMPTS * GEN_LEN * VOCAB);
    float max = 0;
    for (size_t i = 0; i < (size_t)N_PROMPTS * GEN_LEN * VOCAB; i++)
        max = fmaxf(max, fabsf(r->logits[i]));
    r->tol = 1e-4f * max;
    FILE *f = fopen(tiny_tokens, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    for (int p = 0; p < N_PROMPTS; p++)
        for (int s = 0; s < GEN_LEN; s++) CU_ASSERT_EQUAL(fscanf(f, "%d", &r->tokens[p][s]), 1);
    fclose(f);
}

static const float *row(const float *logits, int prompt, int step) {
    return logits + ((size_t)prompt * GEN_LEN + step) * VOCAB;
}

static int argmax(const float *x) {
    int best = 0;
    for (int i = 1; i < VOCAB; i++) best = x[i] > x[best] ? i : best;
    return best;
}

/* Step `step` of `prompt` has the reference's logits and argmax. */
static int row_matches(const reference *r, const float *logits, int prompt, int step) {
    const float *got = row(logits, prompt, step), *want = row(r->logits, prompt, step);
    float diff = 0;
    for (int v = 0; v < VOCAB; v++) diff = fmaxf(diff, fabsf(got[v] - want[v]));
    int ok = diff <= r->tol && argmax(got) == r->tokens[prompt][step];
    if (!ok)
        fprintf(stderr, "\n    prompt %d step %d: max |dlogit| %g (tol %g), argmax %d, want %d\n",
                prompt + 1, step + 1, diff, r->tol, argmax(got), r->tokens[prompt][step]);
    return ok;
}

static int row_is_zero(const float *logits, int prompt, int step) {
    const float *x = row(logits, prompt, step);
    for (int v = 0; v < VOCAB; v++)
        if (x[v] != 0) return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Bad input
 * --------------------------------------------------------------------------------------------- */

static void test_bad_flag_values(void) {
    EXPECT_FAIL(ARGS("--bogus"), "--bogus", "unknown option");
    EXPECT_FAIL(ARGS("-x"), "-x", "unknown option");
    EXPECT_FAIL(ARGS("--gen-len"), "--gen-len", "missing value");
    EXPECT_FAIL(ARGS("--gen-len", "0"), "--gen-len", "'0'");
    EXPECT_FAIL(ARGS("--gen-len", "abc"), "--gen-len", "'abc'");
    EXPECT_FAIL(ARGS("--gen-len", "8x"), "--gen-len", "'8x'");
    EXPECT_FAIL(ARGS("--gen-len", ""), "--gen-len");
    EXPECT_FAIL(ARGS("--gen-len", "99999999999999"), "--gen-len", "99999999999999");
    EXPECT_FAIL(ARGS("--gpu-batch-size", "-1"), "--gpu-batch-size", "'-1'");
    EXPECT_FAIL(ARGS("--num-gpu-batches", "0"), "--num-gpu-batches", "'0'");
    EXPECT_FAIL(ARGS("--top-p", "0"), "--top-p", "'0'");
    EXPECT_FAIL(ARGS("--top-p", "1.5"), "--top-p", "'1.5'");
    EXPECT_FAIL(ARGS("--top-p", "nan"), "--top-p", "'nan'");
    EXPECT_FAIL(ARGS("--temperature", "-1"), "--temperature", "'-1'");
    EXPECT_FAIL(ARGS("--temperature", "1e-320"), "--temperature", "'1e-320' is too close to 0 to read");
    EXPECT_FAIL(ARGS("--top-p", "1e999"), "--top-p", "'1e999' is too large to read");
    EXPECT_FAIL(ARGS("--seed", "x"), "--seed", "'x'");
    EXPECT_FAIL(ARGS("--prompt-len", "0"), "--prompt-len", "'0'");
    EXPECT_FAIL(ARGS("--gpu-mem", "0.5"), "--gpu-mem", "'0.5'", "a byte at least");
    EXPECT_FAIL(ARGS("--gpu-mem", "16E"), "--gpu-mem", "'16E'", "1e18 bytes at most");
    EXPECT_FAIL(ARGS("--cpu-mem", "0x10G"), "--cpu-mem", "'0x10G'"); /* strtod reads hexadecimal */
    EXPECT_FAIL(ARGS("--gpu-batch-size", "65536", "--num-gpu-batches", "65536"),
                "--gpu-batch-size", "--num-gpu-batches", "65536 x 65536", "at most 1048576");
    /* the default --num-gpu-batches (2) is in the product too, and the message says so */
    EXPECT_FAIL(ARGS("--gpu-batch-size", "1048576"), "--gpu-batch-size", "1048576 x 2", "at most 1048576");
    /* a value or flag holding a newline or another control character still gives one line */
    EXPECT_FAIL(ARGS("--gpu-mem", "16\nflexgen: G"), "--gpu-mem", "'16?flexgen: G'");
    EXPECT_FAIL(ARGS("--bo\ngus"), "--bo?gus", "unknown option");
    EXPECT_FAIL(ARGS("--device", "cp\ru"), "--device", "'cp?u'");
    /* an empty input path names the flag and what it wants, as an empty output's does */
    static const char *const file_flags[] = {"--prompt-file", "--prompt-ids", "--tokenizer", "--vocab",
                                             "--merges",      "--hw",         "--text",      "--compare"};
    for (size_t i = 0; i < sizeof file_flags / sizeof *file_flags; i++)
        EXPECT_FAIL(ARGS(file_flags[i], ""), file_flags[i], "an empty path; give a file");
    EXPECT_FAIL(ARGS("--offload-dir", ""), "--offload-dir", "an empty path; give a directory");
    EXPECT_FAIL(ARGS("--path", ""), "--path", "an empty path; give a directory");
    /* a flag where a path belongs (its value forgotten) is not taken for a file to write or read */
    EXPECT_FAIL(ARGS("--dump-logits", "--quiet"), "--dump-logits", "got the flag --quiet", "./--quiet");
    EXPECT_FAIL(ARGS("--output", "--json"), "--output", "got the flag --json");
    EXPECT_FAIL(ARGS("--prompt-file", "--help"), "--prompt-file", "got the flag --help");
    EXPECT_FAIL(ARGS("--offload-dir", "--percent", "0", "0", "0", "0", "0", "0"), "--offload-dir",
                "expected a directory, got the flag --percent");
    EXPECT_FAIL(ARGS("--quiet", "--progress"), "--progress and --quiet", "only one");
}

static void test_bad_flag_combinations(void) {
    EXPECT_FAIL(ARGS("--model", "opt-7b"), "--model", "opt-7b", "opt-6.7b");
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--prompt", "Hello"), "--prompt", "tokenizer", "--tokenizer F.json",
                "--vocab and --merges", "tokenizer.json");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-file", tiny_prompts), "--prompt-file",
                "tokenizer");
    EXPECT_FAIL(ARGS("--prompt", "Hello", "--prompt-ids", tiny_prompts), "--prompt",
                "--prompt-ids", "only one");
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--vocab", tiny_prompts), "--vocab", "--merges");
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--merges", tiny_prompts), "--vocab", "--merges");
}

static void test_bad_model_dir(void) {
    char *dir = make_temp_dir();
    EXPECT_FAIL(ARGS("--model", dir), dir, "config.json");
    char *text = slurp(fixture("opt-tiny/config.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    write_text_file(join(dir, "config.json"), text);
    free(text);
    EXPECT_FAIL(ARGS("--model", dir, "--prompt-ids", tiny_prompts, "--gen-len", "2"), dir,
                "no model.safetensors");
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--vocab", join(dir, "v.json"), "--merges",
                     join(dir, "m.txt"), "--prompt", "Hi"), "v.json");
    rm_tree(dir);
    free(dir);
}

/* A --prompt-ids file holding `text` for opt-tiny fails with a message naming the file and
 * holding `a` and `b`. */
static void expect_bad_ids(const char *dir, const char *text, const char *a, const char *b) {
    const char *path = join(dir, "ids.txt");
    write_text_file(path, text);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", path, "--gen-len", "8"), path, a, b);
}

static void test_bad_prompt_ids(void) {
    char *dir = make_temp_dir();
    const char *missing = join(dir, "nonexistent.txt");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", missing), missing, "No such file");
    /* a file that cannot be read is named with its flag */
    char named[4300];
    snprintf(named, sizeof named, "--prompt-ids %s: cannot open", missing);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", missing), named);
    snprintf(named, sizeof named, "--prompt-file %s: cannot open", missing);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", missing), named);
    snprintf(named, sizeof named, "--tokenizer %s: cannot open", missing);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt", "x", "--tokenizer", missing), named);
    snprintf(named, sizeof named, "--hw %s: cannot open", missing);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--policy", "auto", "--hw", missing), named);
    snprintf(named, sizeof named, "--text %s: cannot open", missing);
    EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir, "--text", missing), named);
    /* and a vocab.json given as a tokenizer.json is said to be one */
    char vocab_json[4300];
    snprintf(vocab_json, sizeof vocab_json, "%s/vocab.json", kjv_dir);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt", "x", "--tokenizer", vocab_json), "--tokenizer", vocab_json,
                "not a tokenizer.json", "--vocab and --merges");
    expect_bad_ids(dir, "2 5\n2 512\n", "line 2", "512 out of range");
    expect_bad_ids(dir, "2 -1\n", "line 1", "-1 out of range");
    expect_bad_ids(dir, "2 5 abc 7\n", "line 1", "not a token id: 'abc");
    expect_bad_ids(dir, "2 5x\n", "line 1", "not a token id");
    expect_bad_ids(dir, "2 5\n\n2 6\n", "line 2", "empty prompt");
    expect_bad_ids(dir, "", "no prompts", "");
    const char *nul = join(dir, "nul.txt"); /* a NUL byte does not end the line quietly */
    FILE *f = fopen(nul, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fwrite("2 5 6\n2 7\0 9\n", 1, 13, f);
    fclose(f);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", nul, "--gen-len", "8"), nul, "line 2", "NUL");
    /* a read error is one, not "no prompts" */
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", dir, "--gen-len", "8"), dir, "cannot read");
    rm_tree(dir);
    free(dir);
}

/* An output given as a symbolic link is written through it: the file it names holds the output
 * and the link stays a link; a link to nothing is refused before the run, as --output's is. */
static void test_output_through_link(void) {
    char *dir = make_temp_dir(), target[4200], link_path[4200], dangling[4200], *out, *err;
    snprintf(target, sizeof target, "%s", join(dir, "trace.json"));
    snprintf(link_path, sizeof link_path, "%s", join(dir, "link.json"));
    snprintf(dangling, sizeof dangling, "%s", join(dir, "dangling.bin"));
    write_text_file(target, "old");
    CU_ASSERT_FATAL(symlink("trace.json", link_path) == 0 && symlink("none/l.bin", dangling) == 0);
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2", "--quiet",
                                     "--trace", link_path), NULL, &out, &err), 0);
    free(out), free(err);
    struct stat st;
    char *text = slurp(target, NULL);
    EXPECT(lstat(link_path, &st) == 0 && S_ISLNK(st.st_mode) && text && strstr(text, "traceEvents") &&
           dir_entries(dir) == 3, "--trace through a symbolic link: expected the link kept and the file it names "
           "holding the trace, got %s, '%.40s', %d files", S_ISLNK(st.st_mode) ? "a link" : "no link",
           text ? text : "(none)", dir_entries(dir));
    free(text);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--dump-logits", dangling), "--dump-logits",
                "a symbolic link to none/l.bin", "does not exist");
    EXPECT(dir_entries(dir) == 3, "a refused link to nothing: %d files (3 before)", dir_entries(dir));
    rm_tree(dir);
    free(dir);
}

/* A text prompt file whose lines end in \r\n (written on Windows) holds the prompts of the same
 * file with \n: the same logits, not a \r token at each prompt's end; an empty line is refused. */
static void test_prompt_file_crlf(void) {
    char *dir = make_temp_dir(), lf[4200], crlf[4200], logits[2][4200];
    snprintf(lf, sizeof lf, "%s", join(dir, "lf.txt"));
    snprintf(crlf, sizeof crlf, "%s", join(dir, "crlf.txt"));
    write_text_file(lf, "In the beginning\nAnd God said\n");
    write_text_file(crlf, "In the beginning\r\nAnd God said\r\n");
    const char *files[2] = {lf, crlf};
    for (int i = 0; i < 2; i++) {
        char *out, *err;
        snprintf(logits[i], sizeof logits[i], "%s/%d.bin", dir, i);
        CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", files[i], "--gen-len", "2", "--quiet",
                                         "--json", "--dump-logits", logits[i]), NULL, &out, &err), 0);
        free(out), free(err);
    }
    size_t n[2];
    char *a = slurp(logits[0], &n[0]), *b = slurp(logits[1], &n[1]);
    EXPECT(a && b && n[0] == n[1] && !memcmp(a, b, n[0]), "prompts of \\r\\n lines: their logits differ from "
           "those of \\n lines");
    free(a), free(b);
    /* an empty line (also one of \r\n alone) is refused, not run as a prompt of BOS alone */
    const char *blank[] = {"In the beginning\n\nAnd God said\n", "In the beginning\r\n\r\n"};
    for (int i = 0; i < 2; i++) {
        write_text_file(lf, blank[i]);
        EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", lf, "--gen-len", "2"), lf, "line 2", "empty prompt");
    }
    rm_tree(dir);
    free(dir);
}

static void test_prompt_too_long(void) {
    char *dir = make_temp_dir(), ids[400] = "2";
    for (int i = 1; i < 60; i++)
        snprintf(ids + strlen(ids), sizeof ids - strlen(ids), " %d", 3 + i);
    strcat(ids, "\n");
    const char *path = join(dir, "long.txt");
    write_text_file(path, ids);
    /* a prompt of a file is named by its line */
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", path, "--gen-len", "8"), "long.txt line 1:",
                "60 tokens", "--gen-len 8", "need 67 positions", "the model has 64");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", path, "--prompt-len", "4"), "--prompt-len",
                "prompts are given");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt", "Hi", "--prompt-len", "4"), "--prompt-len", "prompts are given");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-len", "60", "--gen-len", "8"), "--prompt-len 60",
                "--gen-len 8", "need 67 positions", "the model has 64");
    /* the last token generated is not fed back: 60 + 5 tokens need positions 0 .. 63 */
    char *out, *err;
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", tiny_dir, "--prompt-len", "60", "--gen-len", "5",
                                     "--quiet", "--json"), NULL, &out, &err), 0);
    free(out), free(err);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-len", "60", "--gen-len", "6"), "--gen-len 6",
                "need 65 positions", "the model has 64");
    /* lengths whose sum overflows an int, or whose buffers would take gigabytes, are refused
     * against the model before anything is allocated */
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", path, "--gen-len", "2147483647"),
                "--gen-len 2147483647", "even a one-token prompt needs 2147483647 positions", "the model has 64");
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--gen-len", "2147483647"), "--gen-len 2147483647",
                "need 2147484158 positions", "the model has 2048");
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--prompt-len", "20000000"), "--prompt-len 20000000",
                "need 20000031 positions", "the model has 2048");
    /* `flexgen policy` holds the lengths to the model as a run does: no plan for a run that would be
     * refused, and no search sized by lengths whose sum overflows an int (it ran on for minutes) */
    const char *hw = join(dir, "hw.json");
    write_hw(hw);
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--hw", hw, "--prompt-len", "60", "--gen-len", "8"),
                "--prompt-len 60", "need 67 positions", "the model has 64");
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--hw", hw, "--prompt-ids", path, "--gen-len", "8"),
                "long.txt line 1:", "need 67 positions", "the model has 64");
    EXPECT_FAIL(ARGS("policy", "--model", "opt-125m", "--hw", hw, "--prompt-len", "2147483647", "--gen-len",
                     "2147483647"), "need 4294967293 positions", "the model has 2048");
    rm_tree(dir);
    free(dir);
}

/* A failed --dump-logits leaves nothing behind: neither the file nor a temporary. */
static void test_dump_logits_unwritable(void) {
    char *dir = make_temp_dir();
    const char *target = join(dir, "missing/l.bin");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2",
                     "--dump-logits", target), "--dump-logits", target, "No such file");
    CU_ASSERT_EQUAL(dir_entries(dir), 0);
    const char *sub = join(dir, "out"); /* the target is a directory: rename fails */
    CU_ASSERT_EQUAL_FATAL(mkdir(sub, 0755), 0);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2",
                     "--dump-logits", sub), "--dump-logits", sub);
    CU_ASSERT_EQUAL(dir_entries(dir), 1);
    CU_ASSERT_EQUAL(dir_entries(sub), 0);
    /* both outputs are checked before the model is touched: no dummy weights in --path */
    const char *path = join(dir, "weights");
    CU_ASSERT_EQUAL_FATAL(mkdir(path, 0755), 0);
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--percent", "0", "0", "100", "0", "100", "0", "--path", path,
                     "--dump-logits", target), "--dump-logits", target);
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--percent", "0", "0", "100", "0", "100", "0", "--path", path,
                     "--trace", sub), "--trace", sub, "not a regular file");
    CU_ASSERT_EQUAL(dir_entries(path), 0);
    rm_tree(dir);
    free(dir);
}

/* In a child process with the signal handlers: an output being written when SIGINT comes leaves
 * no temporary behind, and a mapped checkpoint truncated under the reader ends it with exit 2 and
 * one line naming the file, not a bare SIGBUS. Returns the child's status; *line gets its stderr. */
static int in_child(void (*body)(const char *), const char *arg, char *line, size_t n) {
    int fds[2];
    if (pipe(fds)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        fg_install_signal_handlers();
        body(arg);
        _exit(0);
    }
    close(fds[1]);
    ssize_t got = 0, r;
    while ((size_t)got < n - 1 && (r = read(fds[0], line + got, n - 1 - (size_t)got)) > 0) got += r;
    line[got > 0 ? got : 0] = 0;
    close(fds[0]);
    int status;
    waitpid(pid, &status, 0);
    return status;
}

static void interrupted_output(const char *path) {
    fg_output o;
    char err[FG_ERR_LEN];
    if (fg_output_open(&o, "--dump-logits", path, err)) _exit(3);
    fputs("half a file", o.f);
    fflush(o.f);
    raise(SIGINT);
    _exit(4); /* not reached: SIGINT ends the process */
}

static void truncated_checkpoint(const char *dir) {
    model_config cfg;
    st_archive a;
    char err[FG_ERR_LEN], file[4200];
    if (opt_checkpoint_open(dir, &cfg, &a, err)) _exit(3);
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    if (truncate(file, 0)) _exit(3);
    const st_tensor *t = &a.tensors[a.n_tensors - 1];
    volatile char sum = 0;
    for (size_t i = 0; i < t->nbytes; i++) sum += ((const char *)t->data)[i];
    (void)sum;
    _exit(4); /* not reached: the pages are gone */
}

static void test_signals_leave_no_files(void) {
    char *dir = make_temp_dir(), line[1024];
    int status = in_child(interrupted_output, join(dir, "l.bin"), line, sizeof line);
    CU_ASSERT(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT);
    EXPECT(dir_entries(dir) == 0, "SIGINT while an output is written: %d files left in its directory",
           dir_entries(dir));
    const char *names[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        char src[4200], dst[4200];
        snprintf(src, sizeof src, "%s/%s", fixture("opt-tiny"), names[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, names[i]);
        size_t len;
        char *data = slurp(src, &len);
        FILE *f = fopen(dst, "wb");
        CU_ASSERT_FATAL(data && f && fwrite(data, 1, len, f) == len);
        fclose(f);
        free(data);
    }
    status = in_child(truncated_checkpoint, dir, line, sizeof line);
    char want[4300];
    snprintf(want, sizeof want, "flexgen: %s/model.safetensors: ", dir);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 2 && !strncmp(line, want, strlen(want)) &&
           strstr(line, "truncated") && count_lines(line) == 1,
           "a checkpoint truncated while mapped: expected exit 2 and one line naming it, got %s %d, '%s'",
           WIFEXITED(status) ? "exit" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), line);
    rm_tree(dir);
    free(dir);
}

/* Whether process pid has a handler of its own for sig (SigCgt in /proc/PID/status). */
static int catches_signal(pid_t pid, int sig) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    unsigned long long mask = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "SigCgt: %llx", &mask) == 1) break;
    if (f) fclose(f);
    return (int)((mask >> (sig - 1)) & 1);
}

/* `flexgen tokenize` started as nohup starts a program: the signals in `ignored` (0-terminated)
 * set to SIG_IGN before the exec. Once it runs flexgen (the exec closed `ran`) and its handlers
 * are in place (it catches SIGTERM, which nothing here ignores), it gets each signal of `sent`
 * (0-terminated) while it waits for its input, then the input. Returns its wait status; *out gets
 * its stdout (malloc'd). */
static int tokenize_with_signals(const int *ignored, const int *sent, const char *input, char **out) {
    char vocab[4096], merges[4096], byte;
    snprintf(vocab, sizeof vocab, "%s", fixture("tokenizer/vocab.json"));
    snprintf(merges, sizeof merges, "%s", fixture("tokenizer/merges.txt"));
    int in[2], o[2], ran[2];
    if (pipe(in) || pipe(o) || pipe2(ran, O_CLOEXEC)) abort();
    pid_t pid = fork();
    if (pid == 0) {
        for (int i = 0; ignored[i]; i++) signal(ignored[i], SIG_IGN);
        dup2(in[0], 0);
        dup2(o[1], 1);
        close(in[0]);
        close(in[1]);
        close(o[0]);
        close(o[1]);
        close(ran[0]);
        execl(flexgen_bin(), flexgen_bin(), "tokenize", "--vocab", vocab, "--merges", merges, (char *)NULL);
        _exit(127);
    }
    close(in[0]);
    close(o[1]);
    close(ran[1]);
    while (read(ran[0], &byte, 1) < 0 && errno == EINTR) continue; /* end of file: the exec happened */
    close(ran[0]);
    for (int tries = 0; tries < 10000 && !catches_signal(pid, SIGTERM); tries++) usleep(1000);
    for (int i = 0; sent[i]; i++) kill(pid, sent[i]);
    usleep(100000); /* a signal that ends it has ended it by now */
    void (*old_pipe)(int) = signal(SIGPIPE, SIG_IGN); /* a child that died reads nothing */
    if (write(in[1], input, strlen(input)) < 0) { /* it died: its status says how */ }
    close(in[1]);
    signal(SIGPIPE, old_pipe);
    size_t len = 0, cap = 4096;
    char *text = malloc(cap);
    ssize_t got;
    while ((got = read(o[0], text + len, cap - len - 1)) > 0)
        if ((len += (size_t)got) + 1 == cap) text = realloc(text, cap *= 2);
    text[len] = 0;
    close(o[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    *out = text;
    return status;
}

/* A stop signal the parent set to be ignored stays ignored (nohup's SIGHUP, SIGINT in a script's
 * background job): the run gets it and finishes as it would have. One it did not ignore (SIGTERM)
 * still ends the run by that signal. */
static void test_ignored_signals_stay_ignored(void) {
    const char *input = "Hello world\nThe quick brown fox\n";
    char vocab[4096], merges[4096], *want, *err, *out;
    snprintf(vocab, sizeof vocab, "%s", fixture("tokenizer/vocab.json"));
    snprintf(merges, sizeof merges, "%s", fixture("tokenizer/merges.txt"));
    CU_ASSERT_EQUAL_FATAL(run_flexgen(ARGS("tokenize", "--vocab", vocab, "--merges", merges), input, &want, &err), 0);
    const int hup_int[] = {SIGHUP, SIGINT, 0}, hup[] = {SIGHUP, 0}, hup_term[] = {SIGHUP, SIGTERM, 0};
    int status = tokenize_with_signals(hup_int, hup_int, input, &out);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0 && !strcmp(out, want), "SIGHUP and SIGINT ignored by the "
           "parent, then sent: expected exit 0 and the ids of a plain run, got %s %d, \"%s\"",
           WIFEXITED(status) ? "exit" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), out);
    free(out);
    status = tokenize_with_signals(hup, hup_term, input, &out);
    EXPECT(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM, "SIGHUP ignored by the parent, SIGHUP and SIGTERM "
           "sent: expected the run ended by SIGTERM, got %s %d", WIFEXITED(status) ? "exit" : "signal",
           WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    free(out), free(want), free(err);
}

/* The descriptor this process has open on path, or -1. */
static int fd_of(const char *path) {
    for (int fd = 3; fd < 1024; fd++) {
        char link[64], target[4200];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n > 0 && (target[n] = 0, !strcmp(target, path))) return fd;
    }
    return -1;
}

/* From now on, system call nr fails with errno e in this process and those it execs (seccomp):
 * on descriptor fd (its first argument), or on any where fd < 0. */
static int fail_syscall_on_fd(int nr, int fd, int e) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nr, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)fd, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ((unsigned)e & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    if (fd < 0) /* no test of the descriptor: the call's number alone */
        f[1] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nr, 2, 3);
    struct sock_fprog prog = {(unsigned short)(sizeof f / sizeof *f), f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

/* An output whose writes (or, as on a file system that allocates late, whose fsync) fail with
 * ENOSPC: exit 2 with the error line on stderr, 0 if it was committed. */
static void output_on_full_device(const char *path, int nr) {
    fg_output o;
    char err[FG_ERR_LEN];
    if (fg_output_open(&o, "--dump-logits", path, err)) _exit(3);
    int fd = fd_of(o.tmp);
    if (fd < 0 || fail_syscall_on_fd(nr, fd, ENOSPC)) _exit(5);
    static char block[1 << 16];
    fwrite(block, 1, sizeof block, o.f);
    if (fg_output_commit(&o, err) == 0) _exit(0);
    fprintf(stderr, "%s\n", err);
    _exit(2);
}
static void write_on_full_device(const char *path) { output_on_full_device(path, __NR_write); }
static void fsync_on_full_device(const char *path) { output_on_full_device(path, __NR_fsync); }

/* A run's two files committed together (fg_outputs_commit), in dir: --dump-logits (a.bin) and
 * --trace (b.json), the one named by `failing` ("a", "b" or "none") finding its device full at
 * fsync. Exit 2 with the error line, 0 if both were committed. */
static void two_outputs(const char *dir, const char *failing) {
    fg_output a, b, *both[2] = {&a, &b};
    char err[FG_ERR_LEN], path_a[4200], path_b[4200];
    snprintf(path_a, sizeof path_a, "%s/a.bin", dir);
    snprintf(path_b, sizeof path_b, "%s/b.json", dir);
    if (fg_output_open(&a, "--dump-logits", path_a, err) || fg_output_open(&b, "--trace", path_b, err)) _exit(3);
    fputs("logits", a.f);
    fputs("{\"traceEvents\": []}", b.f);
    int fd = strcmp(failing, "none") ? fd_of(failing[0] == 'a' ? a.tmp : b.tmp) : -2;
    if (fd == -1 || (fd >= 0 && fail_syscall_on_fd(__NR_fsync, fd, ENOSPC))) _exit(5);
    if (fg_outputs_commit(both, 2, err) == 0) _exit(0);
    fprintf(stderr, "%s\n", err);
    _exit(2);
}
static void first_output_fails(const char *dir) { two_outputs(dir, "a"); }
static void second_output_fails(const char *dir) { two_outputs(dir, "b"); }
static void no_output_fails(const char *dir) { two_outputs(dir, "none"); }

/* A run leaves both of its files or neither: where the second cannot be written the first,
 * written already, is not put in place either (nor where the first fails), and no temporary is
 * left; with room for both, both are there. */
static void test_run_files_both_or_neither(void) {
    char *dir = make_temp_dir(), line[1024];
    void (*const bodies[2])(const char *) = {first_output_fails, second_output_fails};
    const char *const flags[2] = {"--dump-logits", "--trace"};
    for (int i = 0; i < 2; i++) {
        int status = in_child(bodies[i], dir, line, sizeof line);
        EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 2 && strstr(line, flags[i]) &&
               strstr(line, "no space left on the device") && dir_entries(dir) == 0,
               "%s finds the device full: expected exit 2, one line naming it and no file left, got %s %d, "
               "'%s', %d files", flags[i], WIFEXITED(status) ? "exit" : "signal",
               WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), line, dir_entries(dir));
    }
    int status = in_child(no_output_fails, dir, line, sizeof line);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0 && dir_entries(dir) == 2, "room for both: expected exit 0 "
           "and both files, got %d and %d files, '%s'", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
           dir_entries(dir), line);
    rm_tree(dir);
    free(dir);
}

/* A full device is named as such, with the output's flag and path, whether write or fsync
 * reports it, and no temporary is left; a file size limit (EFBIG) is told apart from I/O errors. */
static void test_output_on_full_device(void) {
    char *dir = make_temp_dir(), line[1024];
    const char *path = join(dir, "l.bin");
    void (*const bodies[2])(const char *) = {write_on_full_device, fsync_on_full_device};
    for (int i = 0; i < 2; i++) {
        int status = in_child(bodies[i], path, line, sizeof line);
        EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 2 && strstr(line, "--dump-logits") &&
               strstr(line, path) && strstr(line, "no space left on the device") && count_lines(line) == 1,
               "%s fails with ENOSPC: expected exit 2 and one line naming --dump-logits %s and \"no space "
               "left on the device\", got %s %d, '%s'", i ? "fsync" : "write", path,
               WIFEXITED(status) ? "exit" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
               line);
        EXPECT(dir_entries(dir) == 0, "%s fails with ENOSPC: %d files left", i ? "fsync" : "write",
               dir_entries(dir));
    }
    /* the whole binary under a file size limit smaller than the logits (5 x 8 x 512 floats) */
    char *out, *err;
    struct rlimit old, small = {4096, 4096};
    getrlimit(RLIMIT_FSIZE, &old);
    small.rlim_max = old.rlim_max;
    void (*old_xfsz)(int) = signal(SIGXFSZ, SIG_IGN); /* inherited: EFBIG instead of a kill */
    setrlimit(RLIMIT_FSIZE, &small);
    int rc = run_flexgen(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "8",
                              "--quiet", "--dump-logits", path), NULL, &out, &err);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, old_xfsz);
    char want[4300];
    snprintf(want, sizeof want, "flexgen: --dump-logits %s: ", path);
    EXPECT(rc == 2 && !strncmp(err, want, strlen(want)) && strstr(err, "file size limit") &&
           count_lines(err) == 1, "--dump-logits past the file size limit: expected exit 2 and one line "
           "'%s... file size limit ...', got %d, '%s'", want, rc, err);
    EXPECT(dir_entries(dir) == 0, "--dump-logits past the file size limit: %d files left", dir_entries(dir));
    free(out), free(err);
    rm_tree(dir);
    free(dir);
}

/* Dummy weights in --path that were changed on disk (header and size intact) are found out by
 * their checksums and written again: the run gives the tokens of a fresh file, says so in one
 * note, and the next run reuses the new file in silence. Damaged twice: 8 MiB in the middle,
 * then only the file's last page (the output layer's last tensor, the last layer checked); and
 * then cut short by a page, which the note says. */
static void test_damaged_weight_file(void) {
    enum { RUNS = 5 };
    char *path = make_temp_dir(), *out, *err, dumps[RUNS][4200];
    for (int i = 0; i < RUNS; i++) snprintf(dumps[i], sizeof dumps[i], "%s/run%d.bin", path, i);
    const char *weights = NULL;
    for (int run = 0; run < RUNS; run++) {
        int rc = run_flexgen(ARGS("--model", "opt-125m", "--percent", "0", "0", "100", "0", "100", "0",
                                  "--path", path, "--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size",
                                  "2", "--quiet", "--dump-logits", dumps[run]), NULL, &out, &err);
        CU_ASSERT_EQUAL(rc, 0);
        int damaged = run % 2 == 1, cut = run == 4;
        const char *note = cut ? "cut short" : "does not match its checksum";
        EXPECT(damaged || cut ? strstr(err, note) && count_lines(err) == 1 : !err[0],
               "run %d over %s weights: stderr '%s'", run, cut ? "cut short" : damaged ? "damaged" : "intact", err);
        free(out), free(err);
        if (run == 0) {
            DIR *d = opendir(path);
            for (struct dirent *e; d && (e = readdir(d));)
                if (strstr(e->d_name, ".fgw")) weights = join(path, e->d_name);
            if (d) closedir(d);
            CU_ASSERT_PTR_NOT_NULL_FATAL(weights);
        }
        if (run == 0 || run == 2) { /* zero 8 MiB in the middle of the file, then its last page */
            int fd = open(weights, O_WRONLY);
            struct stat st;
            CU_ASSERT_FATAL(fd >= 0 && fstat(fd, &st) == 0);
            static char zeros[8 << 20];
            size_t n = run == 0 ? sizeof zeros : 4096;
            CU_ASSERT(pwrite(fd, zeros, n, run == 0 ? st.st_size / 2 : st.st_size - 4096) == (ssize_t)n);
            close(fd);
        }
        if (run == 3) {
            struct stat st;
            CU_ASSERT_FATAL(stat(weights, &st) == 0 && truncate(weights, st.st_size - 4096) == 0);
        }
    }
    size_t n0, n;
    char *first = slurp(dumps[0], &n0);
    for (int run = 1; run < RUNS; run++) {
        char *again = slurp(dumps[run], &n);
        EXPECT(first && again && n == n0 && !memcmp(first, again, n), "run %d: logits differ from the "
               "first run's, over weights that were damaged before runs 1 and 3 and cut short before run 4", run);
        free(again);
    }
    free(first);
    rm_tree(path);
    free(path);
}

/* Without O_TMPFILE, weights are written under a temporary name (.flexgen-partial-XXXXXX), held
 * under flock while their process lives, and so is every output until it is renamed into place.
 * One that a killed process left (unlocked, over a minute old) is removed as the next file or
 * output is made there; one still held, one just made and a name of another length stay. */
static void test_dead_partial_removed(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN] = "";
    static const char *const names[] = {".flexgen-partial-Dead01", ".flexgen-partial-Held01",
                                        ".flexgen-partial-Young1", ".flexgen-partial-user-file"};
    struct timespec hour_ago[2] = {{time(NULL) - 3600, 0}, {time(NULL) - 3600, 0}};
    for (int i = 0; i < 4; i++) {
        write_text_file(join(dir, names[i]), "part of a file");
        if (i != 2) CU_ASSERT_FATAL(utimensat(AT_FDCWD, join(dir, names[i]), hour_ago, 0) == 0);
    }
    int held = open(join(dir, names[1]), O_RDONLY);
    CU_ASSERT_FATAL(held >= 0 && flock(held, LOCK_EX) == 0);
    setenv("FLEXGEN_TEST_NO_TMPFILE", "1", 1);
    fg_new made;
    int fd = fg_new_file(dir, "--path", &made, err);
    unsetenv("FLEXGEN_TEST_NO_TMPFILE");
    EXPECT(fd >= 0 && strstr(made.path, "/.flexgen-partial-"), "the new file: %s", fd >= 0 ? made.path : err);
    for (int i = 0; i < 4; i++) {
        int there = access(join(dir, names[i]), F_OK) == 0;
        EXPECT(there == (i != 0), "%s: %s", names[i], there ? "still there" : "removed");
    }
    if (fd >= 0) {
        fg_new_file_remove(&made);
        close(fd);
    }
    /* an output's temporary: the same name, the same sweep */
    write_text_file(join(dir, names[0]), "part of an output");
    CU_ASSERT_FATAL(utimensat(AT_FDCWD, join(dir, names[0]), hour_ago, 0) == 0);
    fg_output out;
    char logits[4200];
    snprintf(logits, sizeof logits, "%s", join(dir, "logits.bin"));
    int opened = fg_output_open(&out, "--dump-logits", logits, err) == 0;
    int probe = opened ? open(out.tmp, O_RDONLY) : -1; /* another open file: the lock is out.fd's */
    int locked = probe >= 0 && flock(probe, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    if (probe >= 0) close(probe);
    EXPECT(opened && strstr(out.tmp, "/.flexgen-partial-") && locked, "an output's temporary: %s, %s",
           opened ? out.tmp : err, locked ? "held" : "not held by its process");
    EXPECT(access(join(dir, names[0]), F_OK) != 0, "a dead temporary stays as an output is made beside it");
    if (opened) fg_output_abort(&out);
    close(held);
    rm_tree(dir);
    free(dir);
}

/* Two runs writing dummy weights into the same new --path: the one stopped first takes away the
 * folders it made while the other's weights are an unnamed file in them (which keeps no folder
 * from being removed). The other names its file all the same: the folders are made again. */
static void test_new_file_named_after_its_folder_went(void) {
    char *root = make_temp_dir(), dir[4200], path[4300], err[FG_ERR_LEN] = "";
    snprintf(dir, sizeof dir, "%s/made/here", root);
    snprintf(path, sizeof path, "%s/weights.fgw", dir);
    CU_ASSERT_FATAL(mkdir_p(dir) == 0);
    fg_new made;
    int fd = fg_new_file(dir, "--path", &made, err);
    CU_ASSERT_FATAL(fd >= 0);
    EXPECT(write(fd, "layers", 6) == 6 && !made.path[0], "the new file: %s", made.path[0] ? "named" : "not written");
    char parent[4200];
    snprintf(parent, sizeof parent, "%s/made", root);
    EXPECT(rmdir(dir) == 0 && rmdir(parent) == 0, "the folders of an unnamed file removed: %s", strerror(errno));
    int rc = fg_new_file_name(&made, fd, path);
    struct stat st;
    EXPECT(rc == 0 && stat(path, &st) == 0 && st.st_size == 6, "the file named after its folders went: %s",
           rc ? strerror(errno) : "named, but not there");
    close(fd);
    rm_tree(root);
    free(root);
}

/* Dummy weights on disk written where the file system has no O_TMPFILE (NFS, FUSE; here
 * FLEXGEN_TEST_NO_TMPFILE=1 takes that way): kept under their name, no temporary left beside them,
 * and reused by the next run without a note; that run's check of the file holds a layer at a time
 * in memory, so its peak resident memory is the first run's, not that and the file's (opt-350m's
 * 0.7 GB: 832 MB against 370 when the check kept every page it read). */
static void test_weight_file_kept(void) {
    char *path = make_temp_dir(), *out, *err;
    double peak[2] = {0, 0};
    setenv("FLEXGEN_TEST_NO_TMPFILE", "1", 1);
    for (int run = 0; run < 2; run++) {
        int rc = run_flexgen(ARGS("--model", "opt-350m", "--percent", "0", "0", "100", "0", "100", "0",
                                  "--path", path, "--offload-dir", path, "--prompt-len", "8", "--gen-len",
                                  "2", "--gpu-batch-size", "2", "--quiet", "--json"),
                             NULL, &out, &err);
        cJSON *o = rc == 0 ? cJSON_Parse(out) : NULL, *rss = cJSON_GetObjectItem(o, "peak_rss_bytes");
        peak[run] = cJSON_IsNumber(rss) ? rss->valuedouble : 0;
        EXPECT(rc == 0 && !err[0] && peak[run] > 0, "run %d over --path without O_TMPFILE: exit %d, stderr '%s'",
               run, rc, err);
        cJSON_Delete(o);
        free(out), free(err);
        int weights = 0, others = 0;
        DIR *d = opendir(path);
        for (struct dirent *e; d && (e = readdir(d));)
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
                *(strstr(e->d_name, ".fgw") ? &weights : &others) += 1;
        if (d) closedir(d);
        EXPECT(weights == 1 && others == 0, "run %d: %d weight files and %d others in --path", run, weights, others);
    }
    unsetenv("FLEXGEN_TEST_NO_TMPFILE");
    EXPECT(peak[1] < 1.25 * peak[0], "the run that reused the weights: peak resident memory %.0f MB, the first "
           "run's %.0f MB", peak[1] / 1e6, peak[0] / 1e6);
    rm_tree(path);
    free(path);
}

/* ---------------------------------------------------------------------------------------------
 * Batch jobs: JSONL prompts, --output records, --resume
 * --------------------------------------------------------------------------------------------- */

/* Each line of a file a whole JSON object (the records of an output). */
/* ---------------------------------------------------------------------------------------------
 * Good runs
 * --------------------------------------------------------------------------------------------- */

/* A --dump-logits file of opt-tiny's prompts matches the PyTorch reference, row by row. */
static void expect_reference_logits(const char *dump) {
    reference r;
    load_reference(&r);
    float *l = read_floats(dump, (size_t)N_PROMPTS * GEN_LEN * VOCAB);
    int bad = 0;
    for (int p = 0; p < N_PROMPTS; p++)
        for (int s = 0; s < GEN_LEN; s++) bad += !row_matches(&r, l, p, s);
    CU_ASSERT_EQUAL(bad, 0);
    free(l);
    free(r.logits);
}

static void test_json_run_matches_reference(void) {
    char *dir = make_temp_dir();
    const char *dump = join(dir, "l.bin");
    char *out = run_tiny(ARGS("--gpu-batch-size", "2", "--num-gpu-batches", "2", "--dump-logits",
                              dump, "--json"));
    static const char *const keys[] = {"model_size_bytes", "cache_size_bytes",
        "hidden_size_bytes", "prefill_latency", "prefill_throughput", "decode_latency",
        "decode_throughput", "total_latency", "total_throughput"};
    const char *end = NULL;
    cJSON *o = cJSON_ParseWithOpts(out, &end, 0);
    CU_ASSERT(cJSON_IsObject(o));
    CU_ASSERT(end && strcmp(end, "\n") == 0); /* one object, one line, nothing else */
    for (size_t i = 0; o && i < sizeof keys / sizeof keys[0]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, keys[i]);
        CU_ASSERT(cJSON_IsNumber(v) && v->valuedouble > 0);
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0))
            fprintf(stderr, "\n    %s: not a number > 0\n", keys[i]);
    }
    cJSON_Delete(o);
    free(out);
    expect_reference_logits(dump);
    CU_ASSERT_EQUAL(dir_entries(dir), 1); /* no temporary left beside it */
    rm_tree(dir);
    free(dir);
}

static void test_default_report(void) {
    static const char *const lines[] = {"model size:", "peak gpu mem:", "prefill latency:",
                                        "decode latency:", "total latency:",
                                        "mean time to a completed sequence:", "peak tiers:",
                                        "moved:", "compute:", "blas:"};
    char *out = run_tiny(ARGS("--gpu-batch-size", "4"));
    CU_ASSERT_EQUAL(count_lines(out), 10);
    const char *at = out;
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++) {
        const char *line = strstr(at, lines[i]);
        CU_ASSERT(line != NULL && (line == out || line[-1] == '\n'));
        if (!line) { fprintf(stderr, "\n    no \"%s\" in:\n%s", lines[i], out); break; }
        at = line;
    }
    free(out);
}

/* Every flag the CLI takes, with a value it accepts (NULL: takes none). */
static const struct { const char *flag, *value; } FLAGS[] = {
    {"--model", "opt-125m"}, {"--vocab", "v.json"}, {"--merges", "m.txt"}, {"--tokenizer", "t.json"}, {"--prompt", "Hi"},
    {"--prompt-file", "p.txt"}, {"--prompt-ids", "i.txt"}, {"--prompt-len", "4"},
    {"--gen-len", "4"}, {"--gpu-batch-size", "1"}, {"--num-gpu-batches", "1"},
    {"--temperature", "0.5"}, {"--top-p", "0.9"}, {"--seed", "3"}, {"--stop-at-eos", NULL}, {"--refill", NULL},
    {"--dump-logits", "l.bin"}, {"--json", NULL}, {"--quiet", NULL}, {"--progress", NULL}, {"--help", NULL},
    {"--path", "w"}, {"--overlap", "0"}, {"--cpu-cache-compute", NULL}, {"--pin-weight", "0"},
    {"--gpu-mem", "1G"}, {"--cpu-mem", "512M"}, {"--disk-mem", "2G"}, {"--offload-dir", "d"},
    {"--trace", "t.json"}, {"--percent", "1"}, {"--compress-weight", NULL},
    {"--compress-cache", NULL}, {"--int8-activations", NULL}, {"--bf16-prefill", NULL},
    {"--attn-sparsity", "0.5"}, {"--policy", "manual"},
    {"--hw", "hw.json"}, {"--max-latency", "10"}, {"--evaluate", NULL},
    {"--text", "t.txt"}, {"--window", "8"}, {"--stride", "4"}, {"--decode", NULL},
    {"--predictions", "p.txt"}, {"--compare", "p.txt"}, /* of `flexgen perplexity` */
    {"--device", "cpu"}, {"--out", "hw.json"}, /* of `flexgen profile` */
    {"--output", "o.jsonl"}, {"--resume", NULL}, {"--schedule", "diagonal"}, {"--warmup", NULL},
};
enum { N_FLAGS = sizeof FLAGS / sizeof FLAGS[0] };

static int known_flag(const char *s, size_t len) {
    for (int i = 0; i < N_FLAGS; i++)
        if (strlen(FLAGS[i].flag) == len && !strncmp(FLAGS[i].flag, s, len)) return 1;
    return 0;
}

static void test_help(void) {
    char *out, *err;
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--help"), NULL, &out, &err), 0);
    CU_ASSERT_STRING_EQUAL(err, "");
    for (int i = 0; i < N_FLAGS; i++) {
        const char *at = strstr(out, FLAGS[i].flag);
        size_t len = strlen(FLAGS[i].flag);
        while (at && (at[len] == '-' || (at[len] >= 'a' && at[len] <= 'z') || (at[len] >= '0' && at[len] <= '9')))
            at = strstr(at + 1, FLAGS[i].flag);
        CU_ASSERT_PTR_NOT_NULL(at);
        if (!at) fprintf(stderr, "\n    --help does not mention %s\n", FLAGS[i].flag);
    }
    for (const char *s = strstr(out, "--"); s; s = strstr(s + 2, "--")) { /* and no others */
        size_t len = 2 + strspn(s + 2, "abcdefghijklmnopqrstuvwxyz0123456789-");
        CU_ASSERT(known_flag(s, len));
        if (!known_flag(s, len))
            fprintf(stderr, "\n    --help mentions %.*s, not in FLAGS\n", (int)len, s);
        s += len - 2;
    }
    /* each subcommand takes -h and --help as the run does, on stdout, exit 0: policy and
     * perplexity (which take a run's flags) the usage, profile and tokenize their own text, which
     * names their flags and no others */
    static const char *const subcommands[] = {"policy", "profile", "tokenize", "perplexity"};
    static const char *const own_flags[4][5] = {
        {NULL}, {"--offload-dir", "--out", "--device", NULL}, {"--vocab", "--merges", "--tokenizer", "--model", NULL},
        {NULL}};
    for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++) {
            char *sub_out, *sub_err, usage_line[64];
            int rc = run_flexgen(ARGS(subcommands[i], h ? "--help" : "-h"), NULL, &sub_out, &sub_err);
            snprintf(usage_line, sizeof usage_line, "usage: flexgen %s ", subcommands[i]);
            int own = own_flags[i][0] != NULL;
            EXPECT(rc == 0 && (own ? !strncmp(sub_out, usage_line, strlen(usage_line)) : !strcmp(sub_out, out)),
                   "flexgen %s %s: expected %s and exit 0, got %d, '%.80s'", subcommands[i], h ? "--help" : "-h",
                   own ? "its own usage" : "the usage", rc, sub_out);
            for (const char *s = strstr(sub_out, "--"); own && s; s = strstr(s + 2, "--")) {
                size_t len = 2 + strspn(s + 2, "abcdefghijklmnopqrstuvwxyz-");
                int known = 0;
                for (int k = 0; own_flags[i][k]; k++)
                    known |= strlen(own_flags[i][k]) == len && !strncmp(own_flags[i][k], s, len);
                known |= !strncmp(s, "--policy auto", 13) || !strncmp(s, "--hw", 4); /* profile's purpose */
                EXPECT(known, "flexgen %s --help mentions %.*s, not one of its flags", subcommands[i], (int)len, s);
            }
            free(sub_out), free(sub_err);
        }
    /* --help asks for the text alone, whatever else is given: not a refusal of a flag beside it,
     * unless the "--help" is another flag's value */
    char *h_out, *h_err;
    int rc = run_flexgen(ARGS("policy", "--output", "x.jsonl", "--help"), NULL, &h_out, &h_err);
    EXPECT(rc == 0 && !strcmp(h_out, out), "flexgen policy --output x.jsonl --help: expected the usage, got %d '%s'",
           rc, h_err);
    free(h_out), free(h_err);
    EXPECT_FAIL(ARGS("policy", "--prompt", "--help", "--output", "x.jsonl"), "--output", "not a flag of `flexgen policy`");
    free(out);
    free(err);
}

/* Each flag the help lists is one the parser takes: what fails is the bad flag after it. */
static void test_flags_accepted(void) {
    for (int i = 0; i < N_FLAGS; i++) {
        if (!strcmp(FLAGS[i].flag, "--help") || !strcmp(FLAGS[i].flag, "--out")) continue;
        if (!strcmp(FLAGS[i].flag, "--percent")) { /* six values */
            EXPECT_FAIL(ARGS("--percent", "1", "2", "3", "4", "5", "6", "--zz-bogus"), "--zz-bogus",
                        "unknown option");
            continue;
        }
        if (FLAGS[i].value)
            EXPECT_FAIL(ARGS(FLAGS[i].flag, FLAGS[i].value, "--zz-bogus"), "--zz-bogus",
                        "unknown option");
        else
            EXPECT_FAIL(ARGS(FLAGS[i].flag, "--zz-bogus"), "--zz-bogus", "unknown option");
    }
}

/* ---------------------------------------------------------------------------------------------
 * The runtime's flags and the disk tier's files
 * --------------------------------------------------------------------------------------------- */

/* --device: a bad name is refused; cuda without a GPU is one line with the reason; with a GPU
 * the report names the device that ran, and --int8-activations (the CPU's scheme) is refused. */
static void test_device(void) {
    char why[FG_ERR_LEN];
    EXPECT_FAIL(ARGS("--device", "gpu"), "--device", "cuda, cpu, cpu-fp16 or auto", "'gpu'");
    EXPECT_FAIL(ARGS("profile", "--device", "tpu"), "--device", "'tpu'");
    if (!fg_cuda_backend(why)) {
        EXPECT_FAIL(ARGS("--device", "cuda", "--gen-len", "2", "--prompt-len", "4"), "--device cuda: ", why);
        char *out = run_tiny(ARGS("--json"));
        CU_ASSERT_PTR_NOT_NULL(strstr(out, "\"device\":\"cpu\""));
        free(out);
        return;
    }
    EXPECT_FAIL(ARGS("--device", "cuda", "--compress-weight", "--int8-activations", "--gen-len", "2", "--prompt-len", "4"),
                "--int8-activations", "--device cpu");
    EXPECT_FAIL(ARGS("--device", "cuda", "--bf16-prefill", "--gen-len", "2", "--prompt-len", "4"), "--bf16-prefill",
                "--device cpu");
    const char *args[] = {"--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "4",
                          "--quiet", "--device", "cuda", NULL};
    char *out, *err;
    CU_ASSERT_EQUAL(run_flexgen(args, NULL, &out, &err), 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "device: cuda"));
    free(out);
    free(err);
}

static void test_bad_policy(void) {
    EXPECT_FAIL(ARGS("--percent", "101", "0", "100", "0", "100", "0"), "--percent", "0..100");
    EXPECT_FAIL(ARGS("--percent", "100", "0", "-1", "0", "100", "0"), "--percent");
    EXPECT_FAIL(ARGS("--percent", "1", "2", "3", "4", "5"), "--percent", "six", "got only 5");
    EXPECT_FAIL(ARGS("--percent", "0", "50", "0", "100", "100", "101"), "--percent", "0..100", "got '101'");
    EXPECT_FAIL(ARGS("--max-latency", "-1"), "--max-latency", "(0, 1e9]", "'-1'");
    EXPECT_FAIL(ARGS("--max-latency", "0"), "--max-latency", "(0, 1e9]", "'0'");
    EXPECT_FAIL(ARGS("--percent", "60", "50", "100", "0", "100", "0"), "--percent", "weights",
                "110%");
    EXPECT_FAIL(ARGS("--percent", "100", "0", "70", "40", "100", "0"), "--percent", "KV cache");
    EXPECT_FAIL(ARGS("--percent", "100", "0", "100", "0", "99", "2"), "--percent", "activations");
    EXPECT_FAIL(ARGS("--overlap", "2"), "--overlap", "'2'");
    EXPECT_FAIL(ARGS("--pin-weight", "x"), "--pin-weight", "'x'");
    EXPECT_FAIL(ARGS("--gpu-mem", "abc"), "--gpu-mem", "'abc'");
    EXPECT_FAIL(ARGS("--cpu-mem", "0"), "--cpu-mem", "'0'");
    EXPECT_FAIL(ARGS("--disk-mem", "5Q"), "--disk-mem", "'5Q'");
    EXPECT_FAIL(ARGS("--gpu-mem", "-1G"), "--gpu-mem", "'-1G'");
    EXPECT_FAIL(ARGS("--attn-sparsity", "0"), "--attn-sparsity", "(0, 1]", "'0'");
    EXPECT_FAIL(ARGS("--int8-activations"), "--int8-activations", "--compress-weight");
    EXPECT_FAIL(ARGS("--compress-weight", "--int8-activations", "--bf16-prefill"), "--int8-activations",
                "--bf16-prefill", "give one");
    EXPECT_FAIL(ARGS("--refill"), "--refill", "--stop-at-eos");
    EXPECT_FAIL(ARGS("--schedule", "spiral"), "--schedule", "zigzag or diagonal", "'spiral'");
    EXPECT_FAIL(ARGS("--schedule", "diagonal", "--stop-at-eos", "--refill"), "--refill", "--schedule diagonal");
    EXPECT_FAIL(ARGS("--attn-sparsity", "1.5"), "--attn-sparsity", "(0, 1]", "'1.5'");
    EXPECT_FAIL(ARGS("--attn-sparsity", "-0.1"), "--attn-sparsity", "(0, 1]", "'-0.1'");
    EXPECT_FAIL(ARGS("--attn-sparsity", "nan"), "--attn-sparsity", "(0, 1]", "'nan'");
    /* under a float's least: read as 0 before, and refused as out of (0, 1] */
    EXPECT_FAIL(ARGS("--attn-sparsity", "1e-300"), "--attn-sparsity", "'1e-300' is too close to 0", "(0, 1]");
    EXPECT_FAIL(ARGS("--max-latency", "1e-300"), "--max-latency", "'1e-300' is too close to 0", "(0, 1e9]");
    /* strtod reads hexadecimal (0x10 as 16 seconds); sizes refuse it, and so do these */
    EXPECT_FAIL(ARGS("--max-latency", "0x10"), "--max-latency", "(0, 1e9]", "'0x10'");
    EXPECT_FAIL(ARGS("--temperature", "0X1p-1"), "--temperature", "'0X1p-1'");
    EXPECT_FAIL(ARGS("--offload-dir", "/nonexistent/flexgen"), "--offload-dir", "no such directory");
    EXPECT_FAIL(ARGS("--offload-dir", tiny_prompts), "--offload-dir", tiny_prompts, "not a directory");
    /* a plan that does not fit is refused before any compute, naming the tier and the bytes */
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gpu-mem", "64K"),
                "gpu tier: the plan needs", "--gpu-mem gives 64.0 KiB");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--percent", "0", "100",
                     "100", "0", "100", "0", "--cpu-mem", "100K"), "cpu tier: the plan needs");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--percent", "0", "0",
                     "0", "0", "0", "0", "--disk-mem", "4K"), "disk tier: the plan needs");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--cpu-mem", "1"), "--cpu-mem gives 1 B");
    /* on the CPU backend the gpu and cpu tiers share host memory, less the system's reserve */
    EXPECT_FAIL(ARGS("--model", "opt-175b", "--device", "cpu", "--gpu-mem", "1T", "--cpu-mem", "1T"),
                "gpu and cpu tiers: the plan needs", "of host memory",
                "a sixteenth of the machine's memory is kept for the system");
}

/* Runs opt-tiny with everything on disk in offload dir `off`; returns the exit status. */
static int run_on_disk(const char *off, const char *const *extra, char **out, char **err) {
    const char *args[40] = {"--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "8",
                            "--quiet", "--percent", "0", "0", "0", "0", "0", "0",
                            "--offload-dir", off};
    int n = 16;
    while (*extra && n < 39) args[n++] = *extra++;
    args[n] = NULL;
    return run_flexgen(args, NULL, out, err);
}

/* $FLEXGEN_BIN with args in a child under a limit of `bytes` on `resource` set there before exec
 * (RLIMIT_FSIZE: a shell's `ulimit -f`, with SIGXFSZ at its default as the shell leaves it,
 * exceeding the limit kills a process that does not ignore it; RLIMIT_AS: `ulimit -v`), and killed
 * by SIGALRM after two minutes; where full_call is a system call's number, every call of it there
 * fails with ENOSPC (__NR_fsync: a device that allocates late, found full when a finished output
 * is flushed; __NR_fallocate: a device full before the run). Returns the exit status or 128 + the
 * signal; *err gets its stderr (malloc'd), its stdout goes nowhere. */
static int run_under_limit(const char *const *args, int resource, rlim_t bytes, long full_call, char **err) {
    const char *argv[40] = {flexgen_bin()};
    int n = 1;
    while (*args && n < 39) argv[n++] = *args++;
    argv[n] = NULL;
    int e[2];
    if (pipe(e)) abort();
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) abort();
    if (pid == 0) {
        struct rlimit limit;
        getrlimit(resource, &limit);
        limit.rlim_cur = bytes;
        int null = open("/dev/null", O_WRONLY);
        if (null < 0 || dup2(null, 1) < 0 || dup2(e[1], 2) < 0 || setrlimit(resource, &limit) != 0) _exit(126);
        if (full_call && fail_syscall_on_fd(full_call, -1, ENOSPC) != 0) _exit(126);
        close(e[0]);
        signal(SIGXFSZ, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGALRM, SIG_DFL);
        alarm(120); /* kept across exec: a run that hangs is ended */
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(e[1]);
    buffer eb = {0};
    while (drain(e[0], &eb)) continue;
    drain(-1, &eb);
    close(e[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    *err = eb.data;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
static int run_limited(const char *const *args, rlim_t bytes, long full_call, char **err) {
    return run_under_limit(args, RLIMIT_FSIZE, bytes, full_call, err);
}
static int run_under_file_limit(const char *const *args, rlim_t bytes, char **err) {
    return run_limited(args, bytes, 0, err);
}

/* Under an address-space limit (ulimit -v) too small for OpenBLAS's start, which as it loads asks
 * for its buffers again for ever, the run exits 2 with one line at once rather than hanging
 * before main. The limits go up from 256 MiB in steps of 32 MiB: the first ones stop the loader
 * (the libraries do not fit: not flexgen's to say), then a few leave too little room for
 * OpenBLAS (the line), until --help runs; no run may be ended by the alarm. Not under the
 * sanitizers, whose shadow memory no such limit holds. */
static void test_address_space_limit(void) {
#ifdef __SANITIZE_ADDRESS__
    test_skip("AddressSanitizer reserves terabytes of address space: no ulimit -v runs it");
    return;
#endif
    int said = 0, hung = 0, ran = 0;
    for (rlim_t mib = 256; mib <= 8192 && !ran && !hung; mib += 32) {
        char *err;
        int rc = run_under_limit(ARGS("--help"), RLIMIT_AS, mib << 20, 0, &err);
        if (rc == 128 + SIGALRM) hung = 1;
        else if (rc == 2 && !strncmp(err, "flexgen: ulimit -v: ", 20)) {
            said++;
            EXPECT(count_lines(err) == 1 && strstr(err, "OpenBLAS") && strstr(err, "raise the limit"),
                   "ulimit -v %lu MiB: expected one line naming OpenBLAS and what to do, got '%s'",
                   (unsigned long)mib, err);
        } else ran = rc == 0;
        free(err);
    }
    EXPECT(!hung, "a run under an address-space limit did not end within two minutes");
    EXPECT(said > 0, "no address-space limit gave the line about OpenBLAS's start");
    EXPECT(ran, "--help never ran under an address-space limit of up to 8 GiB");
}

/* A file size limit (`ulimit -f`) is a full disk to every output, not SIGXFSZ's kill: the logits
 * past it exit 2 with one line and no temporary left; a job's records past it exit 2 with one
 * line and the output keeps whole records, those written before (or is removed). */
static void test_file_size_limit_is_a_full_disk(void) {
    char *dir = make_temp_dir(), *out, *err;
    char logits[4200], prompts[4200], output[4200];
    snprintf(logits, sizeof logits, "%s", join(dir, "l.bin"));
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    /* the logits: 5 x 8 x 512 floats, 80 KiB */
    int rc = run_under_file_limit(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "8", "--quiet",
                                       "--dump-logits", logits), 4096, &err);
    EXPECT(rc == 2 && strstr(err, "--dump-logits") && strstr(err, "file size limit") && count_lines(err) == 1,
           "--dump-logits past a file size limit (SIGXFSZ at its default): expected exit 2 and one line, got %d "
           "(153: killed by SIGXFSZ), '%s'", rc, err);
    EXPECT(dir_entries(dir) == 0, "--dump-logits past a file size limit: %d files left (a temporary)", dir_entries(dir));
    free(err);
    /* a step's logits larger than stdio's buffer, so that one write of them fails: 60 sequences
     * of LLaMA-kjv's vocabulary, 100 KiB allowed */
    rc = run_under_file_limit(ARGS("--model", llama_kjv_dir, "--prompt-len", "8", "--gpu-batch-size", "4",
                                   "--num-gpu-batches", "15", "--gen-len", "8", "--quiet", "--dump-logits", logits),
                              100 << 10, &err);
    EXPECT(rc == 2 && strstr(err, "--dump-logits") && strstr(err, "file size limit") && count_lines(err) == 1,
           "--dump-logits of 60 sequences past a file size limit of 100 KiB: expected exit 2 and one line, got %d "
           "(139: SIGSEGV), '%s'", rc, err);
    EXPECT(dir_entries(dir) == 0, "--dump-logits of 60 sequences past a file size limit: %d files left (a temporary)",
           dir_entries(dir));
    free(err);
    /* a job: its whole output, then a limit inside its records */
    char text[4 * N_PROMPTS * 80] = "";
    for (int i = 0; i < 4 * N_PROMPTS; i++)
        sprintf(text + strlen(text), "{\"prompt_ids\": [2, %d, %d]}\n", 10 + i, 100 + 3 * i);
    write_text_file(prompts, text);
    const char *const job[] = {"--model", tiny_dir, "--prompt-file", prompts, "--gen-len", "8", "--quiet",
                               "--gpu-batch-size", "1", "--output", output, NULL};
    CU_ASSERT_EQUAL_FATAL(run_flexgen(job, NULL, &out, &err), 0);
    free(out), free(err);
    size_t full_len = 0;
    char *full = slurp(output, &full_len);
    CU_ASSERT_FATAL(full && full_len > 200);
    unlink(output);
    rc = run_under_file_limit(job, full_len - 100, &err);
    char *kept = slurp(output, NULL);
    size_t kept_len = kept ? strlen(kept) : 0;
    int whole = !kept || (kept_len > 0 && kept[kept_len - 1] == '\n' && !strncmp(kept, full, kept_len));
    EXPECT(rc == 2 && strstr(err, "--output") && strstr(err, "file size limit") && count_lines(err) == 1 && whole,
           "--output past a file size limit of %zu bytes (SIGXFSZ at its default): expected exit 2, one line and "
           "whole records, got %d (153: killed by SIGXFSZ), '%s', %zu bytes%s", full_len - 100, rc, err, kept_len,
           whole ? "" : " ending mid-record");
    EXPECT(dir_entries(dir) <= 2, "--output past a file size limit: %d files in the directory", dir_entries(dir));
    free(err), free(kept), free(full);
    rm_tree(dir);
    free(dir);
}

/* The offload dir is empty after a normal run and after a failed one; a full disk (a device
 * found full when the logits are flushed after generating, and a file size limit during the run)
 * is one clear line, not a crash, and leaves no temporary beside the output. */
static void test_offload_dir_left_empty(void) {
    char *off = make_temp_dir(), *out, *err;
    CU_ASSERT_EQUAL(run_on_disk(off, ARGS("--json"), &out, &err), 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "\"peak_disk_bytes\":"));
    CU_ASSERT_PTR_NULL(strstr(out, "\"peak_disk_bytes\":0,"));
    CU_ASSERT_EQUAL(dir_entries(off), 0);
    free(out), free(err);
    /* fails after generating: the logits, written, find the device full when flushed */
    char *logits_dir = make_temp_dir();
    const char *logits = join(logits_dir, "l.bin");
    int rc = run_limited(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "8", "--percent",
                              "0", "0", "0", "0", "0", "0", "--offload-dir", off, "--dump-logits", logits),
                         RLIM_INFINITY, __NR_fsync, &err);
    EXPECT(rc == 2 && strstr(err, "--dump-logits") && strstr(err, logits) && strstr(err, "no space left") &&
               count_lines(err) == 1,
           "the logits on a full device after generating: expected exit 2 and one line naming --dump-logits %s, "
           "got %d, '%s'", logits, rc, err);
    EXPECT(dir_entries(off) == 0 && dir_entries(logits_dir) == 0,
           "the logits on a full device after generating: %d files left in the offload dir, %d beside the logits",
           dir_entries(off), dir_entries(logits_dir));
    free(err);
    rm_tree(logits_dir);
    free(logits_dir);
    struct rlimit old, small = {16384, 16384};
    getrlimit(RLIMIT_FSIZE, &old);
    small.rlim_max = old.rlim_max;
    void (*old_xfsz)(int) = signal(SIGXFSZ, SIG_IGN); /* inherited: EFBIG instead of a kill */
    setrlimit(RLIMIT_FSIZE, &small);
    rc = run_on_disk(off, ARGS("--json"), &out, &err);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, old_xfsz);
    CU_ASSERT_EQUAL(rc, 2);
    CU_ASSERT(strncmp(err, "flexgen: --offload-dir", 22) == 0 && count_lines(err) == 1);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "cannot reserve"));
    if (rc != 2) fprintf(stderr, "\n    full disk: exit %d, %s\n", rc, err);
    CU_ASSERT_EQUAL(dir_entries(off), 0);
    free(out), free(err);
    rm_tree(off);
    free(off);
}

/* A device already full (not a block of it to be had) is said before the run, not after it: a
 * run's --dump-logits and --trace exit 2 with one line naming the flag, the path and the full
 * device, and leave nothing beside it (fg_output_check; profile's --out takes it too, before its
 * minute of measuring). */
static void test_output_on_device_full_before_run(void) {
    char *dir = make_temp_dir(), *err, path[4200];
    const char *const flags[] = {"--dump-logits", "--trace"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s", join(dir, i ? "trace.json" : "logits.bin"));
        int rc = run_limited(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "8", "--quiet",
                                  flags[i], path),
                             RLIM_INFINITY, __NR_fallocate, &err);
        EXPECT(rc == 2 && strstr(err, flags[i]) && strstr(err, path) && strstr(err, "no space left on the device") &&
                   count_lines(err) == 1,
               "%s on a device full before the run: expected exit 2 and one line naming it, %s and the full "
               "device; got %d, '%s'", flags[i], path, rc, err);
        EXPECT(dir_entries(dir) == 0, "%s on a device full before the run: %d files left", flags[i],
               dir_entries(dir));
        free(err);
    }
    rm_tree(dir);
    free(dir);
}

/* Ctrl-C while dummy weights are written leaves no partial file in --path; Ctrl-C mid-decode
 * leaves nothing in the offload dir; a finished file is reused by the next run. */
static void test_sigint_leaves_no_files(void) {
    char *off = make_temp_dir(), *path = make_temp_dir(), *out, *err, chain[4200];
    snprintf(chain, sizeof chain, "%s", join(path, "new/weights")); /* made by the run */
    const char *base[] = {"--model", "opt-125m", "--percent", "0", "0", "0", "0", "0", "0",
                          "--offload-dir", off, "--path", chain, "--quiet", "--prompt-len", "16",
                          "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--gen-len", NULL, NULL};
    base[21] = "400";
    sigint_after_ms = 150;
    int rc = run_flexgen(base, NULL, &out, &err);
    CU_ASSERT_EQUAL(rc, 128 + SIGINT);
    CU_ASSERT_EQUAL(dir_entries(path), 0); /* neither the weights nor the directories made for them */
    CU_ASSERT_EQUAL(dir_entries(off), 0);
    free(out), free(err);
    sigint_after_ms = 0;
    base[21] = "2";
    CU_ASSERT_EQUAL(run_flexgen(base, NULL, &out, &err), 0); /* writes the weights once */
    CU_ASSERT_EQUAL(dir_entries(chain), 1);
    free(out), free(err);
    base[21] = "400";
    sigint_after_ms = 2500; /* the weights are there: this is well into decode */
    rc = run_flexgen(base, NULL, &out, &err);
    sigint_after_ms = 0;
    CU_ASSERT_EQUAL(rc, 128 + SIGINT);
    CU_ASSERT_EQUAL(dir_entries(off), 0);
    CU_ASSERT_EQUAL(dir_entries(chain), 1);
    free(out), free(err);
    rm_tree(off);
    rm_tree(path);
    free(off);
    free(path);
}

static void test_trace(void) {
    char *off = make_temp_dir(), *out, *err;
    const char *trace = join(off, "../flexgen-trace.json");
    char trace_path[4200];
    snprintf(trace_path, sizeof trace_path, "%s", trace);
    CU_ASSERT_EQUAL(run_on_disk(off, ARGS("--trace", trace_path), &out, &err), 0);
    size_t len = 0;
    char *json = slurp(trace_path, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(json);
    static const char *const tracks[] = {"\"compute\"", "\"disk<->cpu weights\"",
                                         "\"cpu<->gpu cache+activations\"",
                                         "\"read weights\"", "\"load weights\"",
                                         "\"store cache\"", "\"decoder layer\""};
    for (size_t i = 0; i < sizeof tracks / sizeof tracks[0]; i++) CU_ASSERT_PTR_NOT_NULL(strstr(json, tracks[i]));
    CU_ASSERT_EQUAL(dir_entries(off), 0);
    free(json), free(out), free(err);
    unlink(trace_path);
    rm_tree(off);
    free(off);
}

/* The ids cases.json of tests/fixtures/DIR holds for text, as `flexgen tokenize` prints them
 * (appended to out). */
static void append_case_ids(const char *dir, const char *text, char *out, size_t cap) {
    char path[4200];
    snprintf(path, sizeof path, "%s/cases.json", fixture(dir));
    char *json = slurp(path, NULL);
    cJSON *root = json ? cJSON_Parse(json) : NULL, *c, *id;
    int found = 0;
    cJSON_ArrayForEach(c, root) {
        const cJSON *t = cJSON_GetObjectItem(c, "text");
        if (found || !cJSON_IsString(t) || strcmp(t->valuestring, text)) continue;
        found = 1;
        int first = 1;
        cJSON_ArrayForEach(id, cJSON_GetObjectItem(c, "ids")) {
            snprintf(out + strlen(out), cap - strlen(out), "%s%d", first ? "" : " ", id->valueint);
            first = 0;
        }
        snprintf(out + strlen(out), cap - strlen(out), "\n");
    }
    EXPECT(found, "%s has no case \"%s\"", path, text);
    cJSON_Delete(root);
    free(json);
}

/* `flexgen tokenize` on a fixture directory's files prints HF's ids for the lines of stdin. */
static void expect_tokenize(const char *dir, const char *const *lines) {
    char vocab[4200], merges[4200], in[4096] = "", want[8192] = "";
    snprintf(vocab, sizeof vocab, "%s/vocab.json", fixture(dir));
    snprintf(merges, sizeof merges, "%s/merges.txt", fixture(dir));
    for (; *lines; lines++) {
        snprintf(in + strlen(in), sizeof in - strlen(in), "%s\n", *lines);
        append_case_ids(dir, *lines, want, sizeof want);
    }
    char *out, *err;
    int rc = run_flexgen(ARGS("tokenize", "--vocab", vocab, "--merges", merges), in, &out, &err);
    CU_ASSERT_EQUAL(rc, 0);
    CU_ASSERT_STRING_EQUAL(err, "");
    EXPECT(!strcmp(out, want), "tokenize on %s: got\n%swanted\n%s", dir, out, want);
    free(out);
    free(err);
}

static void test_tokenize(void) {
    char vocab[4096], merges[4096];
    snprintf(vocab, sizeof vocab, "%s", fixture("tokenizer/vocab.json"));
    snprintf(merges, sizeof merges, "%s", fixture("tokenizer/merges.txt"));
    EXPECT_FAIL(ARGS("tokenize", "--vocab", vocab), "tokenize", "--merges");
    EXPECT_FAIL(ARGS("tokenize", "--merges", merges), "tokenize", "--vocab");
    EXPECT_FAIL(ARGS("tokenize", "--vocab", vocab, "--merges", merges, "--model", kjv_dir), "tokenize",
                "--vocab/--merges and --model", "only one");
    EXPECT_FAIL(ARGS("tokenize", "--tokenizer", vocab, "--model", kjv_dir), "tokenize", "--tokenizer and --model",
                "only one");
    EXPECT_FAIL(ARGS("tokenize"), "tokenize", "give --vocab and --merges, or --tokenizer");
    EXPECT_FAIL(ARGS("tokenize", "--vocab"), "--vocab", "missing value");
    EXPECT_FAIL(ARGS("tokenize", "--bogus", "x"), "--bogus");
    EXPECT_FAIL(ARGS("tokenize", "--vocab", vocab, "junk"), "junk", "unknown option");
    EXPECT_FAIL(ARGS("tokenize", "--vocab", "", "--merges", merges), "--vocab", "an empty path");
    EXPECT_FAIL(ARGS("tokenize", "--vocab", vocab, "--merges", "--model"), "--merges", "got the flag --model");
    EXPECT_FAIL(ARGS("profile", "--out", "x.json", "junk"), "junk", "unknown option");
    if (access(vocab, R_OK) || access(merges, R_OK)) {
        CU_PASS("tests/fixtures/tokenizer is not there yet: tokenize's output is not checked");
        return;
    }
    expect_tokenize("tokenizer", ARGS("Hello world", "The quick brown fox jumps over the lazy dog."));
    /* special tokens in the text: OPT's </s> and <pad>; GPT-2's <|endoftext|>; flags */
    expect_tokenize("tokenizer", ARGS("Hello</s>world", "\t</s>\t", "<s></s><pad><unk>",
                                      "in</s>side a wo</s>rd", "</s", ""));
    expect_tokenize("tokenizer-gpt2", ARGS("Hello <|endoftext|> world", "a<|im_start|>b"));
    expect_tokenize("tokenizer-added", ARGS("Hello <mask> world", "x <word>y", "a <eat>  b"));
    /* stdin's lines as --prompt-file's: a CR LF ending is the line's end, a NUL byte refused */
    char *crlf, *lf, *err;
    CU_ASSERT_EQUAL(run_flexgen(ARGS("tokenize", "--vocab", vocab, "--merges", merges), "Hello world\r\n", &crlf, &err), 0);
    free(err);
    CU_ASSERT_EQUAL(run_flexgen(ARGS("tokenize", "--vocab", vocab, "--merges", merges), "Hello world\n", &lf, &err), 0);
    free(err);
    EXPECT(!strcmp(crlf, lf), "tokenize: a CR LF line gave '%s', its LF form '%s'", crlf, lf);
    free(crlf), free(lf);
    static const char nul_line[] = "Hello\n"
                                   "a\0b\n";
    char *dir = make_temp_dir(), input[4200];
    snprintf(input, sizeof input, "%s", join(dir, "nul.txt"));
    FILE *f = fopen(input, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fwrite(nul_line, 1, sizeof nul_line - 1, f);
    fclose(f);
    const char *argv[] = {"/bin/sh", "-c", "exec \"$0\" tokenize --vocab \"$1\" --merges \"$2\" < \"$3\"",
                          flexgen_bin(), vocab, merges, input, NULL};
    char *out;
    int rc = run_command(argv, NULL, &out, &err);
    EXPECT(rc == 2 && count_lines(err) == 1 && strstr(err, "standard input line 2: a NUL byte"),
           "tokenize, a NUL byte on line 2: expected exit 2 and one line, got %d, '%s'", rc, err);
    free(out), free(err);
    rm_tree(dir);
    free(dir);
}

/* A bad special-token file beside vocab.json fails `flexgen tokenize` and a text prompt with one
 * line naming the file; a special token past the model's vocab fails a text prompt cleanly. */
static void test_tokenizer_special_files(void) {
    char *dir = make_temp_dir();
    char vocab[4200], merges[4200], text_dir[4096];
    snprintf(text_dir, sizeof text_dir, "%s", fixture("opt-tiny-text"));
    char *v = slurp(join(text_dir, "vocab.json"), NULL), *m = slurp(join(text_dir, "merges.txt"), NULL);
    CU_ASSERT_FATAL(v && m);
    snprintf(vocab, sizeof vocab, "%s", join(dir, "vocab.json"));
    snprintf(merges, sizeof merges, "%s", join(dir, "merges.txt"));
    write_text_file(vocab, v);
    write_text_file(merges, m);
    free(v);
    free(m);
    write_text_file(join(dir, "tokenizer_config.json"), "{\"eos_token\": \"</s>\",\n \"bos_token\"}");
    const char *lines = "Hello\n";
    expect_fail(ARGS("tokenize", "--vocab", vocab, "--merges", merges), lines,
                "tokenizer_config.json", "malformed JSON", "line 2", (const char *)NULL);
    EXPECT_FAIL(ARGS("--model", text_dir, "--vocab", vocab, "--merges", merges, "--prompt", "Hi",
                     "--gen-len", "2"),
                "tokenizer_config.json", "malformed JSON");
    write_text_file(join(dir, "tokenizer_config.json"), "{\"added_tokens_decoder\": 3}");
    expect_fail(ARGS("tokenize", "--vocab", vocab, "--merges", merges), lines,
                "tokenizer_config.json", "added_tokens_decoder", (const char *)NULL);
    unlink(join(dir, "tokenizer_config.json"));
    write_text_file(join(dir, "added_tokens.json"), "{\"<x>\": \"1000\"}");
    expect_fail(ARGS("tokenize", "--vocab", vocab, "--merges", merges), lines, "added_tokens.json",
                "<x>", (const char *)NULL);
    /* opt-tiny-text has 1000 ids and no special-token files: <|endoftext|> becomes id 1000 */
    unlink(join(dir, "added_tokens.json"));
    EXPECT_FAIL(ARGS("--model", text_dir, "--prompt", "Hi<|endoftext|>", "--gen-len", "2"),
                "prompt 1", "token id 1000", "out of range");
    const char *file = join(dir, "prompts.txt");
    write_text_file(file, "Hi\nthere<|endoftext|>\n");
    EXPECT_FAIL(ARGS("--model", text_dir, "--prompt-file", file, "--gen-len", "2"), "vocab.json: token id 1000 of",
                "prompts.txt line 2 is out of range");
    rm_tree(dir);
    free(dir);
}

/* A text prompt with special tokens is the prompt of HF's ids (BOS first): the same logits as
 * those ids given with --prompt-ids. */
static void test_special_tokens_in_prompts(void) {
    char *dir = make_temp_dir(), vocab[4200], merges[4200], text_dir[4096], ids_file[4200];
    char line[4096] = "2 ";
    snprintf(text_dir, sizeof text_dir, "%s", fixture("opt-tiny-text"));
    snprintf(vocab, sizeof vocab, "%s/vocab.json", fixture("tokenizer"));
    snprintf(merges, sizeof merges, "%s/merges.txt", fixture("tokenizer"));
    const char *text = "Hello</s>world";
    append_case_ids("tokenizer", text, line, sizeof line);
    snprintf(ids_file, sizeof ids_file, "%s", join(dir, "ids.txt"));
    write_text_file(ids_file, line);
    char dump_a[4200], dump_b[4200];
    snprintf(dump_a, sizeof dump_a, "%s", join(dir, "a.bin"));
    snprintf(dump_b, sizeof dump_b, "%s", join(dir, "b.bin"));
    char *out, *err;
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", text_dir, "--vocab", vocab, "--merges", merges,
                                     "--prompt", text, "--gen-len", "3", "--quiet",
                                     "--dump-logits", dump_a), NULL, &out, &err), 0);
    CU_ASSERT_EQUAL(strncmp(out, "[1] Hello</s>world", 18), 0);
    free(out), free(err);
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", text_dir, "--prompt-ids", ids_file, "--gen-len",
                                     "3", "--quiet", "--dump-logits", dump_b), NULL, &out, &err), 0);
    free(out), free(err);
    size_t na = 0, nb = 0;
    char *a = slurp(dump_a, &na), *b = slurp(dump_b, &nb);
    CU_ASSERT(a && b && na == nb && na > 0 && !memcmp(a, b, na));
    free(a), free(b);
    rm_tree(dir);
    free(dir);
}

/* The logits of a run with the given sampling args (plus blocks of 2 x 2). */
static float *run_dump(const char *dir, const char *name, const char *const *sampling) {
    const char *dump = join(dir, name), *args[16] = {"--gpu-batch-size", "2", "--num-gpu-batches",
                                                     "2", "--dump-logits", dump};
    int n = 6;
    while (*sampling && n < 15) args[n++] = *sampling++;
    args[n] = NULL;
    free(run_tiny(args));
    return read_floats(dump, (size_t)N_PROMPTS * GEN_LEN * VOCAB);
}

static const size_t DUMP_BYTES = (size_t)N_PROMPTS * GEN_LEN * VOCAB * sizeof(float);

static void test_sampling_is_seeded(void) {
    char *dir = make_temp_dir();
    float *a = run_dump(dir, "a.bin", ARGS("--seed", "7", "--temperature", "0.8"));
    float *b = run_dump(dir, "b.bin", ARGS("--seed", "7", "--temperature", "0.8"));
    float *c = run_dump(dir, "c.bin",
                        ARGS("--seed", "8", "--temperature", "0.8", "--top-p", "0.9"));
    CU_ASSERT(memcmp(a, b, DUMP_BYTES) == 0);
    CU_ASSERT(memcmp(a, c, DUMP_BYTES) != 0); /* it does sample: another seed, other tokens */
    for (int p = 0; p < N_PROMPTS; p++) /* the first step comes before any sampling */
        CU_ASSERT(memcmp(row(a, p, 0), row(c, p, 0), VOCAB * sizeof(float)) == 0);
    free(a);
    free(b);
    free(c);
    rm_tree(dir);
    free(dir);
}

static void test_greedy_ignores_seed(void) {
    char *dir = make_temp_dir();
    float *a = run_dump(dir, "a.bin", ARGS("--seed", "1", "--temperature", "0"));
    float *b = run_dump(dir, "b.bin", ARGS("--seed", "2", "--temperature", "0", "--top-p", "0.5"));
    CU_ASSERT(memcmp(a, b, DUMP_BYTES) == 0);
    reference r;
    load_reference(&r);
    int bad = 0;
    for (int p = 0; p < N_PROMPTS; p++)
        for (int s = 0; s < GEN_LEN; s++) bad += argmax(row(b, p, s)) != r.tokens[p][s];
    CU_ASSERT_EQUAL(bad, 0);
    free(r.logits);
    free(a);
    free(b);
    rm_tree(dir);
    free(dir);
}

/* Prompt 4 generates </s> first: with --stop-at-eos its later rows are never computed (0);
 * the other prompts, which never generate it, run on unchanged, also when --refill gives prompt
 * 4's slot to prompt 5, whose prefill then runs beside the decoding of prompts 1 to 3. */
static void test_stop_at_eos(void) {
    reference r;
    load_reference(&r);
    CU_ASSERT_EQUAL_FATAL(r.tokens[EOS_PROMPT][0], 2);
    for (int p = 0; p < N_PROMPTS; p++)
        for (int s = 0; s < GEN_LEN; s++) CU_ASSERT_FATAL(p == EOS_PROMPT || r.tokens[p][s] != 2);
    char *dir = make_temp_dir();
    for (int refill = 0; refill < 2; refill++) { /* with --refill prompt 5 takes prompt 4's slot */
        float *l = run_dump(dir, "l.bin", refill ? ARGS("--stop-at-eos", "--refill") : ARGS("--stop-at-eos"));
        int bad = 0;
        for (int p = 0; p < N_PROMPTS; p++)
            for (int s = 0; s < GEN_LEN; s++)
                bad += p == EOS_PROMPT && s > 0 ? !row_is_zero(l, p, s) : !row_matches(&r, l, p, s);
        EXPECT(bad == 0, "--stop-at-eos%s: %d logit rows differ from HF's (or are not zero after </s>)",
               refill ? " --refill" : "", bad);
        free(l);
    }
    free(r.logits);
    rm_tree(dir);
    free(dir);
}

/* The portable code paths (no F16C/AVX2 kernels, as on other CPUs) give the reference logits too. */
static void test_portable_paths_match_reference(void) {
    char *dir = make_temp_dir();
    const char *dump = join(dir, "l.bin");
    setenv("FLEXGEN_NO_SIMD", "1", 1);
    free(run_tiny(ARGS("--dump-logits", dump, "--json")));
    unsetenv("FLEXGEN_NO_SIMD");
    expect_reference_logits(dump);
    /* and the 4-bit and sparse paths give the same bits without SIMD as with it */
    float *simd = run_dump(dir, "simd.bin", ARGS("--compress-weight", "--compress-cache", "--attn-sparsity", "0.5"));
    setenv("FLEXGEN_NO_SIMD", "1", 1);
    float *plain = run_dump(dir, "plain.bin", ARGS("--compress-weight", "--compress-cache", "--attn-sparsity", "0.5"));
    unsetenv("FLEXGEN_NO_SIMD");
    size_t differ = 0;
    for (size_t i = 0; simd && plain && i < DUMP_BYTES / sizeof *simd; i++) differ += simd[i] != plain[i];
    EXPECT(simd && plain && differ == 0, "4-bit weights and cache, sparsity 0.5: %zu logits differ between "
           "FLEXGEN_NO_SIMD=1 and the SIMD paths (the 4-bit rounding of a value halfway between two levels goes "
           "up on both, (int)(t + 0.5f): quant.c's compress_group)", differ);
    free(simd);
    free(plain);
    rm_tree(dir);
    free(dir);
}

/* A checkpoint directory with vocab.json and merges.txt: text prompts in (--prompt and
 * --prompt-file), text out, equal to what HF's tokenizer decodes its reference tokens to
 * (tests/fixtures/opt-tiny-text/texts.json, written by scripts/make_reference.py). */
static void test_text_generation(void) {
    char *json = slurp(fixture("opt-tiny-text/texts.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(json);
    cJSON *cases = cJSON_Parse(json);
    CU_ASSERT_FATAL(cJSON_IsArray(cases));
    char dir_arg[4096], expected[8192] = "", prompts_text[4096] = "";
    snprintf(dir_arg, sizeof dir_arg, "%s", fixture("opt-tiny-text"));
    const char *args[40] = {"--model", dir_arg, "--gen-len", "8", "--quiet"};
    int n = 5, i = 0;
    for (const cJSON *c = cases->child; c && n < 37; c = c->next, i++) {
        const char *prompt = cJSON_GetObjectItem(c, "prompt")->valuestring;
        size_t len = strlen(expected);
        snprintf(expected + len, sizeof expected - len, "[%d] %s%s\n", i + 1, prompt,
                 cJSON_GetObjectItem(c, "generated")->valuestring);
        len = strlen(prompts_text);
        snprintf(prompts_text + len, sizeof prompts_text - len, "%s\n", prompt);
        args[n++] = "--prompt";
        args[n++] = prompt;
    }
    args[n] = NULL;
    char *out, *err;
    CU_ASSERT_EQUAL(run_flexgen(args, NULL, &out, &err), 0);
    CU_ASSERT_EQUAL(strncmp(out, expected, strlen(expected)), 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(out + strlen(expected), "total throughput:"));
    free(out);
    free(err);
    char *dir = make_temp_dir(); /* the same prompts from a file */
    const char *file = join(dir, "prompts.txt");
    write_text_file(file, prompts_text);
    const char *file_args[] = {"--model", dir_arg, "--prompt-file", file, "--gen-len", "8", "--quiet", NULL};
    CU_ASSERT_EQUAL(run_flexgen(file_args, NULL, &out, &err), 0);
    CU_ASSERT_EQUAL(strncmp(out, expected, strlen(expected)), 0);
    free(out);
    free(err);
    rm_tree(dir);
    free(dir);
    cJSON_Delete(cases);
    free(json);
}

/* --------------------------------------------------------------------------------------------- */


/* ---------------------------------------------------------------------------------------------
 * The policy search, `flexgen policy`, `--policy auto` and `flexgen profile`
 * --------------------------------------------------------------------------------------------- */

void write_hw(const char *path) {
    write_text_file(path, "{\"ctog_bdw\": 6e9, \"gtoc_bdw_cache\": 1.2e10, \"gtoc_bdw_hidden\": 1.2e10,"
                     " \"dtoc_bdw\": 1.4e9, \"ctod_bdw_cache_p\": 2.5e8, \"ctod_bdw_hidden_p\": 2.5e8,"
                     " \"ctod_bdw_g\": 2.5e8, \"mm_flops_p\": 1.3e11, \"mm_flops_g\": 1.7e11,"
                     " \"bmm_flops_p\": 1e11, \"bmm_flops_g\": 4e10, \"cpu_flops\": 4e10,"
                     " \"dequant_bdw\": 5e9, \"mem_bdw\": 8e9, \"gpu_is_host\": true}");
}

static const cJSON *json_item(const cJSON *o, const char *key) {
    return cJSON_GetObjectItemCaseSensitive(o, key);
}

/* flexgen policy reports the capacities it planned within: on this machine's CPU backend, --gpu-mem
 * and --cpu-mem of 1 TiB each are cut to the host memory they share (what is available less a
 * sixteenth of the machine's, read again here before and after the run), in --json and in a text
 * line; for another machine, the capacities given, and no host memory. */
static void policy_capacities(const char *dir, const char *hw) {
    double before = host_memory_for_plans(), slack = (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE) / 64;
    char *out, *err;
    const char *const big[] = {"policy", "--model", tiny_dir, "--prompt-len", "8", "--gen-len", "8", "--hw", hw,
                               "--offload-dir", dir, "--gpu-mem", "1T", "--cpu-mem", "1T", "--disk-mem", "5G", "--json",
                               NULL};
    CU_ASSERT_EQUAL(run_flexgen(big, NULL, &out, &err), 0);
    double after = host_memory_for_plans(), lo = fmin(before, after) - slack, hi = fmax(before, after) + slack;
    cJSON *o = cJSON_Parse(out);
    const cJSON *cap = json_item(o, "capacity"), *host = json_item(o, "host_memory");
    EXPECT(cJSON_IsNumber(json_item(cap, "gpu")) && json_item(cap, "gpu")->valuedouble == 0x1p40 &&
           cJSON_IsNumber(json_item(cap, "cpu")) && json_item(cap, "cpu")->valuedouble == 0x1p40 &&
           cJSON_IsNumber(json_item(cap, "disk")) && json_item(cap, "disk")->valuedouble == 5 * 0x1p30 &&
           cJSON_IsNumber(host) && host->valuedouble >= lo && host->valuedouble <= hi &&
           cJSON_IsTrue(json_item(o, "cut_to_host_memory")), "policy --json, --gpu-mem 1T --cpu-mem 1T: expected "
           "capacity 1 TiB, 1 TiB, 5 GiB and host_memory in [%.0f, %.0f], cut_to_host_memory true; got %s", lo, hi, out);
    cJSON_Delete(o);
    free(out), free(err);
    CU_ASSERT_EQUAL(run_flexgen(ARGS("policy", "--model", tiny_dir, "--prompt-len", "8", "--gen-len", "8", "--hw", hw,
                                     "--offload-dir", dir, "--gpu-mem", "1T", "--cpu-mem", "1T"), NULL, &out, &err), 0);
    char want[256];
    snprintf(want, sizeof want, "\ncapacity: gpu %s, cpu %s, disk ", human(0x1p40).s, human(0x1p40).s);
    EXPECT(strstr(out, want) && strstr(out, "the gpu and cpu tiers together within "), "policy, --gpu-mem 1T --cpu-mem "
           "1T: expected a line \"%s...\" saying the host memory cut them, got:\n%s", want + 1, strstr(out, "search: "));
    free(out), free(err);
    const char *const other[] = {"policy", "--model", tiny_dir, "--prompt-len", "8", "--gen-len", "8", "--hw",
                                 fixture("../../hardware/t4-flexgen.json"), "--gpu-mem", "1T", "--cpu-mem", "1T",
                                 "--disk-mem", "5G", "--json", NULL};
    CU_ASSERT_EQUAL(run_flexgen(other, NULL, &out, &err), 0);
    o = cJSON_Parse(out);
    cap = json_item(o, "capacity");
    EXPECT(cJSON_IsNumber(json_item(cap, "gpu")) && json_item(cap, "gpu")->valuedouble == 0x1p40 &&
           cJSON_IsNumber(json_item(cap, "cpu")) && json_item(cap, "cpu")->valuedouble == 0x1p40 &&
           cJSON_IsNull(json_item(o, "host_memory")) && cJSON_IsFalse(json_item(o, "cut_to_host_memory")),
           "policy --json for another machine: expected the capacities given and no host memory, got %s", out);
    cJSON_Delete(o);
    free(out), free(err);
}

static void test_policy_command(void) {
    char *dir = make_temp_dir(), *out, *err;
    const char *hw = join(dir, "hw.json");
    write_hw(hw);
    const char *const args[] = {"policy", "--model", tiny_dir, "--prompt-len", "8", "--gen-len", "8",
                                "--hw", hw, "--offload-dir", dir, "--gpu-mem", "3M", "--json", NULL};
    CU_ASSERT_EQUAL(run_flexgen(args, NULL, &out, &err), 0);
    CU_ASSERT_STRING_EQUAL(err, "");
    cJSON *o = cJSON_Parse(out);
    CU_ASSERT_FATAL(cJSON_IsObject(o));
    CU_ASSERT(cJSON_IsNumber(json_item(o, "gpu_batch_size")) && json_item(o, "gpu_batch_size")->valueint >= 1);
    CU_ASSERT(cJSON_IsNumber(json_item(o, "num_gpu_batches")));
    CU_ASSERT(cJSON_IsArray(json_item(o, "percent")) && cJSON_GetArraySize(json_item(o, "percent")) == 6);
    CU_ASSERT(cJSON_IsBool(json_item(o, "cpu_cache_compute")));
    CU_ASSERT(cJSON_IsNumber(json_item(o, "predicted_throughput")) &&
              json_item(o, "predicted_throughput")->valuedouble > 0);
    cJSON_Delete(o);
    free(out), free(err);
    /* the text form: the policy as flags, the prediction, the terms of both phases */
    const char *const text[] = {"policy", "--model", tiny_dir, "--prompt-len", "8", "--gen-len", "8",
                                "--hw", hw, "--offload-dir", dir, NULL};
    CU_ASSERT_EQUAL(run_flexgen(text, NULL, &out, &err), 0);
    static const char *const lines[] = {"policy: --gpu-batch-size ", "--percent ", "predicted: ",
                                        "token/s", "prefill ", "decode ", "ctog", "comp", "search: ",
                                        "schedules: zigzag: ", ", diagonal: "};
    for (size_t i = 0; i < sizeof lines / sizeof *lines; i++) CU_ASSERT_PTR_NOT_NULL(strstr(out, lines[i]));
    free(out), free(err);
    /* --schedule given: the search keeps it, and reports no other */
    const char *const diagonal[] = {"policy", "--model", tiny_dir, "--prompt-len", "8", "--gen-len", "8",
                                    "--hw", hw, "--offload-dir", dir, "--schedule", "diagonal", "--json", NULL};
    CU_ASSERT_EQUAL(run_flexgen(diagonal, NULL, &out, &err), 0);
    o = cJSON_Parse(out);
    CU_ASSERT_FATAL(cJSON_IsObject(o));
    const cJSON *each = json_item(o, "schedules");
    CU_ASSERT(cJSON_IsString(json_item(o, "schedule")) && !strcmp(json_item(o, "schedule")->valuestring, "diagonal"));
    CU_ASSERT(cJSON_IsNull(json_item(each, "zigzag")) && cJSON_IsObject(json_item(each, "diagonal")));
    CU_ASSERT(json_item(o, "num_gpu_batches")->valueint >= 2); /* one GPU batch staggers nothing */
    cJSON_Delete(o);
    free(out), free(err);
    /* --evaluate predicts the given policy */
    const char *const eval[] = {"policy", "--evaluate", "--model", tiny_dir, "--prompt-len", "8",
                                "--gen-len", "8", "--hw", hw, "--offload-dir", dir, "--gpu-batch-size",
                                "3", "--num-gpu-batches", "2", "--percent", "50", "50", "100", "0",
                                "100", "0", NULL};
    CU_ASSERT_EQUAL(run_flexgen(eval, NULL, &out, &err), 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "policy: --gpu-batch-size 3 --num-gpu-batches 2 --percent 50 50 100 0 100 0 "
                                       "--schedule zigzag\n"));
    CU_ASSERT_PTR_NULL(strstr(out, "search: "));
    free(out), free(err);
    policy_capacities(dir, hw);
    CU_ASSERT_EQUAL(dir_entries(dir), 1); /* hw.json only */
    rm_tree(dir);
    free(dir);
}

/* --policy auto on the fixture: the block holds no more sequences than there are prompts, the
 * chosen policy fits, and the tokens are the reference's whatever it chose. */
static void test_policy_auto_run(void) {
    char *dir = make_temp_dir();
    const char *hw = join(dir, "hw.json"), *dump = join(dir, "l.bin");
    write_hw(hw);
    char *out = run_tiny(ARGS("--policy", "auto", "--hw", hw, "--gpu-mem", "2M", "--cpu-mem", "1M",
                              "--offload-dir", dir, "--dump-logits", dump, "--json"));
    cJSON *o = cJSON_Parse(out);
    CU_ASSERT_FATAL(cJSON_IsObject(o));
    int bls = json_item(o, "gpu_batch_size")->valueint * json_item(o, "num_gpu_batches")->valueint;
    CU_ASSERT(bls >= 1 && bls <= N_PROMPTS);
    CU_ASSERT(json_item(o, "peak_gpu_bytes")->valuedouble <= 2 << 20);
    CU_ASSERT(json_item(o, "peak_cpu_bytes")->valuedouble <= 1 << 20);
    cJSON_Delete(o);
    free(out);
    expect_reference_logits(dump);
    /* the search kept to the diagonal schedule: its tokens are the reference's too */
    out = run_tiny(ARGS("--policy", "auto", "--schedule", "diagonal", "--hw", hw, "--gpu-mem", "2M", "--cpu-mem",
                        "1M", "--offload-dir", dir, "--dump-logits", dump, "--json"));
    o = cJSON_Parse(out);
    CU_ASSERT_FATAL(cJSON_IsObject(o));
    CU_ASSERT(json_item(o, "num_gpu_batches")->valueint >= 2);
    double completion = json_item(o, "mean_completion_seconds")->valuedouble; /* from the job's start */
    CU_ASSERT(completion > 0 && completion <= json_item(o, "total_latency")->valuedouble + 0.05);
    cJSON_Delete(o);
    free(out);
    expect_reference_logits(dump);
    /* a block or placement given beside it is the search's to choose: said in a line, not silently
     * dropped (run_tiny above: no line where none is given) */
    char *err;
    int rc = run_flexgen(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2", "--device", "cpu",
                              "--policy", "auto", "--hw", hw, "--gpu-batch-size", "3", "--quiet"), NULL, &out, &err);
    EXPECT(rc == 0 && strstr(err, "warning: --gpu-batch-size is not used") && count_lines(err) == 1,
           "--policy auto --gpu-batch-size 3: expected exit 0 and one warning line; got %d, '%s'", rc, err);
    free(out), free(err);
    /* all of them, each once, in the order given; and so `flexgen policy` without --evaluate */
    for (int evaluate = 0; evaluate < 2; evaluate++) {
        const char *command = evaluate ? "policy" : "--quiet";
        rc = run_flexgen(ARGS(command, "--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2", "--device",
                              "cpu", "--hw", hw, "--percent", "100", "0", "100", "0", "100", "0", "--num-gpu-batches",
                              "2", "--gpu-batch-size", "3", "--percent", "100", "0", "100", "0", "100", "0",
                              evaluate ? "--offload-dir" : "--policy", evaluate ? dir : "auto"),
                         NULL, &out, &err);
        const char *want = evaluate ? "warning: --percent, --num-gpu-batches and --gpu-batch-size are not used: the "
                                      "search chooses"
                                    : "warning: --percent, --num-gpu-batches and --gpu-batch-size are not used: "
                                      "--policy auto chose";
        EXPECT(rc == 0 && strstr(err, want) && count_lines(err) == 1, "%s: expected exit 0 and '%s'; got %d, '%s'",
               command, want, rc, err);
        free(out), free(err);
    }
    rm_tree(dir);
    free(dir);
}

/* The LLaMA family by name and by directory: the named sizes plan (llama-2-70b for a 16 GB GPU and
 * 200 GB of memory, on the T4's rates); a checkpoint generates; a config.json this project does
 * not follow is refused with its one line, exit 2, and nothing left in the offload dir. */
char *replaced(const char *text, const char *from, const char *to) {
    const char *at = text ? strstr(text, from) : NULL;
    CU_ASSERT_PTR_NOT_NULL_FATAL(at);
    char *out = malloc(strlen(text) + strlen(to) + 1);
    sprintf(out, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    return out;
}

static void test_llama_family(void) {
    char *dir = make_temp_dir(), *out, *err;
    char hw[4096], model[4096];
    snprintf(hw, sizeof hw, "%s", fixture("../../hardware/t4-flexgen.json"));
    static const char *const sizes[] = {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3.2-1b",
                                        "qwen2.5-0.5b", "mistral-7b", "tinyllama-1.1b"};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        int rc = run_flexgen(ARGS("policy", "--model", sizes[i], "--gpu-mem", "16G", "--cpu-mem", "200G",
                                  "--disk-mem", "1T", "--hw", hw, "--offload-dir", dir), NULL, &out, &err);
        EXPECT(rc == 0 && strstr(out, "policy: --gpu-batch-size "), "flexgen policy --model %s: exit %d, %s",
               sizes[i], rc, err);
        free(out), free(err);
    }
    snprintf(model, sizeof model, "%s", fixture("llama-tiny-gqa2-llama3"));
    int rc = run_flexgen(ARGS("--model", model, "--prompt-ids", fixture("llama-tiny-gqa2-llama3/prompts.txt"),
                              "--gen-len", "4", "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--percent", "0",
                              "50", "0", "50", "100", "0", "--device", "cpu", "--offload-dir", dir),
                         NULL, &out, &err);
    EXPECT(rc == 0 && strstr(out, "decode throughput"), "a LLaMA checkpoint off the gpu tier: exit %d, %s", rc, err);
    free(out), free(err);
    char *bad = make_temp_dir();
    for (const char *f = "config.json model.safetensors"; *f;) {
        char name[64], cmd[9000];
        int n = (int)strcspn(f, " ");
        snprintf(name, sizeof name, "%.*s", n, f);
        snprintf(cmd, sizeof cmd, "cp '%s/%s' '%s/'", model, name, bad);
        CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
        f += n + (f[n] == ' ');
    }
    char *text = slurp(join(bad, "config.json"), NULL), *at = strstr(text, "\"llama3\"");
    CU_ASSERT_PTR_NOT_NULL_FATAL(at);
    memcpy(at, "\"yarn\"  ", 8); /* rope_scaling's type */
    write_text_file(join(bad, "config.json"), text);
    free(text);
    EXPECT_FAIL(ARGS("--model", bad, "--prompt-len", "4", "--gen-len", "2", "--offload-dir", dir), "config.json",
                "\"rope_scaling\" type is \"yarn\"", "not implemented");
    /* special ids past vocab_size (256): the run goes on, with one line saying which */
    text = slurp(join(model, "config.json"), NULL);
    char *ids = replaced(text, "\"bos_token_id\": 1,", "\"bos_token_id\": 256,");
    char *both = replaced(ids, "\"eos_token_id\": 2,", "\"eos_token_id\": [2, 300],");
    write_text_file(join(bad, "config.json"), both);
    free(text), free(ids), free(both);
    rc = run_flexgen(ARGS("--model", bad, "--prompt-len", "4", "--gen-len", "2", "--device", "cpu", "--offload-dir",
                          dir, "--quiet"), NULL, &out, &err);
    EXPECT(rc == 0 && count_lines(err) == 1 && strstr(err, "flexgen: warning: ") && strstr(err, "config.json") &&
           strstr(err, "bos_token_id 256, eos_token_id 300 are not below vocab_size 256"),
           "bos_token_id and eos_token_id past vocab_size: expected exit 0 and one warning line, got %d, '%s'", rc, err);
    free(out), free(err);
    /* the eos ids of a generation_config.json beside it are named with that file, OPT's too */
    write_text_file(join(bad, "generation_config.json"), "{\"eos_token_id\": 99999}");
    rc = run_flexgen(ARGS("--model", bad, "--prompt-len", "4", "--gen-len", "2", "--device", "cpu", "--offload-dir",
                          dir, "--quiet"), NULL, &out, &err);
    EXPECT(rc == 0 && count_lines(err) == 2 && strstr(err, "config.json: bos_token_id 256 is not below") &&
           strstr(err, "generation_config.json: eos_token_id 99999 is not below vocab_size 256"),
           "generation_config.json's eos id past vocab_size: expected exit 0 and a line for each file, got %d, '%s'",
           rc, err);
    free(out), free(err);
    char *opt = make_temp_dir(), copy[9000];
    snprintf(copy, sizeof copy, "cp '%s'/* '%s/'", fixture("opt-tiny"), opt);
    CU_ASSERT_EQUAL_FATAL(system(copy), 0);
    write_text_file(join(opt, "generation_config.json"), "{\"eos_token_id\": 99999}");
    rc = run_flexgen(ARGS("--model", opt, "--prompt-len", "4", "--gen-len", "2", "--device", "cpu", "--offload-dir",
                          dir, "--quiet"), NULL, &out, &err);
    EXPECT(rc == 0 && count_lines(err) == 1 && strstr(err, "generation_config.json: eos_token_id 99999 is not below"),
           "OPT, generation_config.json's eos id past vocab_size: expected exit 0 and one warning, got %d, '%s'", rc,
           err);
    free(out), free(err);
    rm_tree(opt);
    free(opt);
    CU_ASSERT_EQUAL(dir_entries(dir), 0);
    rm_tree(bad), rm_tree(dir);
    free(bad), free(dir);
}

/* SentencePiece's normalizer: U+2581 before the text and for each space. */
static const char SPM_NORMALIZER[] = "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", "
                                     "\"prepend\": \"\u2581\"}, {\"type\": \"Replace\", \"pattern\": {\"String\": "
                                     "\" \"}, \"content\": \"\u2581\"}]}";

/* A SentencePiece tokenizer.json over the fixture's 256 ids: <unk> <s> </s>, U+2581, a..z, six
 * merges ("the" and "cat" whole), and the byte tokens of ASCII. `the_id`: the id of "▁the". */
static void write_small_tokenizer(const char *dir, const char *normalizer, int the_id) {
    char vocab[8192] = "", *v = vocab;
    v += sprintf(v, "\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"\u2581\": 3");
    for (int c = 'a'; c <= 'z'; c++) v += sprintf(v, ", \"%c\": %d", c, 4 + c - 'a');
    v += sprintf(v, ", \"\u2581t\": 30, \"he\": 31, \"\u2581the\": %d, \"ca\": 33, \"cat\": 34, \"\u2581cat\": 35", the_id);
    for (int b = 0; b < 128; b++) v += sprintf(v, ", \"<0x%02X>\": %d", b, 36 + b);
    char *json = malloc(16384);
    snprintf(json, 16384,
             "{\"added_tokens\": [{\"id\": 0, \"content\": \"<unk>\", \"special\": true}, {\"id\": 1, \"content\": \"<s>\", "
             "\"special\": true}, {\"id\": 2, \"content\": \"</s>\", \"special\": true}], \"normalizer\": %s, "
             "\"pre_tokenizer\": null, \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
             "[{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], "
             "\"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1], \"tokens\": [\"<s>\"]}}}, \"decoder\": "
             "{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"\u2581\"}, "
             "\"content\": \" \"}, {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}, {\"type\": \"Strip\", "
             "\"content\": \" \", \"start\": 1, \"stop\": 0}]}, \"model\": {\"type\": \"BPE\", \"dropout\": null, "
             "\"unk_token\": \"<unk>\", \"fuse_unk\": true, \"byte_fallback\": true, \"vocab\": {%s}, \"merges\": "
             "[\"\u2581 t\", \"h e\", \"\u2581t he\", \"c a\", \"ca t\", \"\u2581 cat\"]}}",
             normalizer, vocab);
    write_text_file(join(dir, "tokenizer.json"), json);
    free(json);
}

/* A LLaMA checkpoint with a tokenizer.json: --prompt runs it and prints the text, flexgen tokenize
 * reads it (--model, --tokenizer), and what it cannot follow, or an id past the model's vocab,
 * is refused with one line. */
static void test_llama_tokenizer_json(void) {
    char *dir = make_temp_dir(), *model = make_temp_dir(), *out, *err, cmd[9000];
    const char *spm = SPM_NORMALIZER;
    snprintf(cmd, sizeof cmd, "cp '%s'/config.json '%s'/model.safetensors '%s'/", fixture("llama-tiny-mha"),
             fixture("llama-tiny-mha"), model);
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    write_small_tokenizer(model, spm, 32);
    int rc = run_flexgen(ARGS("tokenize", "--model", model), "the cat\nthe\xc3\xa9\n", &out, &err);
    EXPECT(rc == 0 && !strcmp(out, "32 35\n32 0\n"), "tokenize --model: exit %d, \"%s\" %s", rc, out, err);
    free(out), free(err);
    rc = run_flexgen(ARGS("tokenize", "--tokenizer", join(model, "tokenizer.json")), "the cat\n", &out, &err);
    EXPECT(rc == 0 && !strcmp(out, "32 35\n"), "tokenize --tokenizer: exit %d, \"%s\" %s", rc, out, err);
    free(out), free(err);
    rc = run_flexgen(ARGS("--model", model, "--prompt", "the cat", "--gen-len", "3", "--device", "cpu",
                          "--offload-dir", dir), NULL, &out, &err);
    EXPECT(rc == 0 && strstr(out, "[1] the cat"), "--prompt with a LLaMA directory: exit %d, %s %s", rc, out, err);
    free(out), free(err);
    EXPECT_FAIL(ARGS("tokenize", "--model", dir), "--model", "no tokenizer.json");
    EXPECT_FAIL(ARGS("tokenize", "--tokenizer", join(model, "tokenizer.json"), "--model", model),
                "--tokenizer and --model", "only one");
    write_small_tokenizer(model, "{\"type\": \"NFKC\"}", 32);
    EXPECT_FAIL(ARGS("--model", model, "--prompt", "the cat", "--gen-len", "3", "--offload-dir", dir),
                "tokenizer.json", "normalizer \"NFKC\" is not implemented");
    write_small_tokenizer(model, spm, 300);
    EXPECT_FAIL(ARGS("--model", model, "--prompt", "the cat", "--gen-len", "3", "--device", "cpu",
                     "--offload-dir", dir), "300", "vocab");
    static const char *const empty[] = { /* an empty vocab, without and with an unk token */
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}",
        "{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"vocab\": {}, \"merges\": []}}",
    };
    for (int i = 0; i < 2; i++) {
        write_text_file(join(model, "tokenizer.json"), empty[i]);
        expect_fail(ARGS("tokenize", "--tokenizer", join(model, "tokenizer.json")), "the cat\n",
                    "tokenizer.json", "model.vocab is empty", (const char *)NULL);
        EXPECT_FAIL(ARGS("--model", model, "--prompt", "the cat", "--gen-len", "3", "--device", "cpu",
                         "--offload-dir", dir), "tokenizer.json", "model.vocab is empty");
    }
    CU_ASSERT_EQUAL(dir_entries(dir), 0);
    rm_tree(model), rm_tree(dir);
    free(model), free(dir);
}

/* The LLaMA family through the runtime's features, on the GQA-2 fixture (llama3 RoPE): its
 * config.json given an eos_token_id list of 2 and the ids HF's greedy run takes third in prompts
 * 2 and 3, so that prompt 4 ends at once, prompts 2 and 3 at their third token, and prompts 1
 * and 5 run to gen_len. With --stop-at-eos, in blocks run in turn, refilled (the cache on the
 * cpu tier; on disk with delegated attention), and under --policy auto in capacities that push
 * the weights off the gpu tier and part of the cache to disk: each row up to its sequence's end is HF's
 * (within 1e-4 x max|logit|, HF's argmax), each row after it zero. Sparse attention refilled
 * gives the rows of sparse attention in blocks run in turn. */
static void llama_rows_check(const char *what, const float *got, const float *want, const int *last, int n, int gen,
                             int vocab, float tol) {
    int bad = 0;
    for (int p = 0; p < n; p++)
        for (int s = 0; s < gen; s++) {
            const float *g = got + ((size_t)p * gen + s) * vocab, *w = want + ((size_t)p * gen + s) * vocab;
            int ok = 1, best = 0, want_best = 0;
            for (int v = 0; v < vocab; v++) {
                ok &= s > last[p] ? g[v] == 0 : fabsf(g[v] - w[v]) <= tol;
                best = g[v] > g[best] ? v : best, want_best = w[v] > w[want_best] ? v : want_best;
            }
            bad += !ok || (s <= last[p] && best != want_best);
        }
    EXPECT(bad == 0, "%s: %d of %d logit rows differ (beyond %g, or argmax, or not zero after the end)", what, bad,
           n * gen, tol);
}

static void test_llama_runtime_features(void) {
    enum { N = 5, G = 8, V = 256 };
    char *dir = make_temp_dir(), *model = make_temp_dir(), src[4096], prompts[4200], cmd[9000], hw[4200], dump[4200];
    snprintf(src, sizeof src, "%s", fixture("llama-tiny-gqa2-llama3"));
    snprintf(prompts, sizeof prompts, "%s/prompts.txt", src);
    snprintf(hw, sizeof hw, "%s", join(dir, "hw.json"));
    snprintf(dump, sizeof dump, "%s", join(dir, "l.bin"));
    write_hw(hw);
    snprintf(cmd, sizeof cmd, "cp '%s/config.json' '%s/model.safetensors' '%s/'", src, src, model);
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    int tokens[N][G], last[N], ends = 0;
    char path[4200];
    snprintf(path, sizeof path, "%s/tokens.txt", src);
    FILE *f = fopen(path, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    for (int i = 0; i < N * G; i++) CU_ASSERT_EQUAL_FATAL(fscanf(f, "%d", &tokens[i / G][i % G]), 1);
    fclose(f);
    snprintf(path, sizeof path, "%s/logits.bin", src);
    float *hf = read_floats(path, (size_t)N * G * V), max_abs = 0;
    for (size_t i = 0; i < (size_t)N * G * V; i++) max_abs = fmaxf(max_abs, fabsf(hf[i]));
    const int eos[3] = {2, tokens[1][2], tokens[2][2]};
    for (int p = 0; p < N; p++) {
        last[p] = G - 1;
        for (int s = G - 1; s >= 0; s--)
            if (tokens[p][s] == eos[0] || tokens[p][s] == eos[1] || tokens[p][s] == eos[2]) last[p] = s;
        ends += last[p] < G - 1;
    }
    CU_ASSERT_FATAL(last[3] == 0 && last[1] == 2 && last[2] == 2 && ends == 3); /* as above */
    char *config = slurp(join(model, "config.json"), NULL), *at = strstr(config, "\"eos_token_id\": 2,"), list[64];
    CU_ASSERT_PTR_NOT_NULL_FATAL(at);
    snprintf(list, sizeof list, "\"eos_token_id\": [%d, %d, %d],", eos[0], eos[1], eos[2]);
    size_t head = (size_t)(at - config), old = strlen("\"eos_token_id\": 2,");
    char *edited = malloc(strlen(config) + sizeof list);
    sprintf(edited, "%.*s%s%s", (int)head, config, list, at + old);
    write_text_file(join(model, "config.json"), edited);
    free(edited);
#define LLAMA_RUN(...) run_flexgen(ARGS("--model", model, "--prompt-ids", prompts, "--gen-len", "8", "--device", "cpu", \
                                        "--quiet", "--offload-dir", dir, "--dump-logits", dump, "--stop-at-eos", \
                                        __VA_ARGS__), NULL, &out, &err)
    static const char *const names[] = {"blocks of 2 in turn", "refilled, the cache on cpu",
                                        "refilled, the cache on disk, delegated", "--policy auto off the gpu tier"};
    for (int r = 0; r < 4; r++) {
        char *out = NULL, *err = NULL;
        /* the search's capacities are sized for 2 threads (each thread has its own scratch in the
           workspace; a laptop's 16 would not fit in 660K) */
        char *threads = r == 3 ? env_put("OMP_NUM_THREADS", "2") : NULL;
        if (r == 2) { /* the list in generation_config.json, config.json's eos_token_id 2 again, as HF's
                         generate() reads them (instruct models list more ids there) */
            char generation[128];
            snprintf(generation, sizeof generation, "{\"eos_token_id\": [%d, %d, %d]}", eos[0], eos[1], eos[2]);
            write_text_file(join(model, "generation_config.json"), generation);
            write_text_file(join(model, "config.json"), config);
        }
        int rc = r == 0   ? LLAMA_RUN("--gpu-batch-size", "2", "--num-gpu-batches", "1")
                 : r == 1 ? LLAMA_RUN("--refill", "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--percent", "100",
                                      "0", "0", "100", "100", "0")
                 : r == 2 ? LLAMA_RUN("--refill", "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--percent", "100",
                                      "0", "0", "0", "100", "0", "--cpu-cache-compute")
                          : LLAMA_RUN("--policy", "auto", "--hw", hw, "--gpu-mem", "660K", "--cpu-mem", "1M", "--json");
        if (r == 3) env_restore("OMP_NUM_THREADS", threads);
        EXPECT(rc == 0, "%s: exit %d, %s", names[r], rc, err);
        if (r == 3) { /* the search put the weights off the gpu tier, within the capacities. Where the
                         cache goes is not asserted: at these sizes every block is compute-bound, the
                         plans' predictions tie, and the last bits pick among them (1 x 5 with 71% of
                         the cache on disk on one machine, 1 x 2 with it on the gpu tier on another);
                         runs 1 and 2 above place the cache on cpu and on disk themselves */
            cJSON *o = cJSON_Parse(out), *pct = cJSON_GetObjectItem(o, "percent");
            EXPECT(cJSON_GetArraySize(pct) == 6 && cJSON_GetArrayItem(pct, 0)->valueint < 100 &&
                       json_item(o, "peak_gpu_bytes")->valuedouble <= 660 << 10 &&
                       json_item(o, "peak_cpu_bytes")->valuedouble <= 1 << 20,
                   "--policy auto: expected weights off the gpu tier, within 660K / 1M, got %s", out);
            cJSON_Delete(o);
        }
        free(out), free(err);
        float *got = read_floats(dump, (size_t)N * G * V);
        llama_rows_check(names[r], got, hf, last, N, G, V, 1e-4f * max_abs);
        free(got);
    }
    float *sparse[2];
    for (int refill = 0; refill < 2; refill++) {
        char *out = NULL, *err = NULL;
        int rc = refill ? LLAMA_RUN("--attn-sparsity", "0.5", "--refill", "--gpu-batch-size", "2", "--num-gpu-batches", "1")
                        : LLAMA_RUN("--attn-sparsity", "0.5", "--gpu-batch-size", "2", "--num-gpu-batches", "1");
        EXPECT(rc == 0, "sparse attention%s: exit %d, %s", refill ? ", refilled" : "", rc, err);
        free(out), free(err);
        sparse[refill] = read_floats(dump, (size_t)N * G * V);
    }
#undef LLAMA_RUN
    int sparse_last[N];
    for (int p = 0; p < N; p++) {
        sparse_last[p] = G - 1;
        for (int s = G - 1; s > 0; s--) /* a row of zeros follows the end */
            if (sparse[0][((size_t)p * G + s) * V] == 0 && sparse[0][((size_t)p * G + s) * V + 1] == 0) sparse_last[p] = s - 1;
    }
    llama_rows_check("sparse attention, refilled against blocks in turn", sparse[1], sparse[0], sparse_last, N, G, V,
                     1e-4f * max_abs);
    CU_ASSERT_EQUAL(dir_entries(dir), 2); /* hw.json and the dump */
    free(sparse[0]), free(sparse[1]), free(hf);
    free(config);
    rm_tree(model), rm_tree(dir);
    free(model), free(dir);
}

static void test_policy_bad_input(void) {
    char *dir = make_temp_dir();
    const char *hw = join(dir, "hw.json"), *bad = join(dir, "bad.json"), *missing = join(dir, "none.json");
    write_hw(hw);
    write_text_file(bad, "{\"ctog_bdw\": 6e9}");
    EXPECT_FAIL(ARGS("--policy", "fast"), "--policy", "'fast'");
    EXPECT_FAIL(ARGS("--max-latency", "0"), "--max-latency", "'0'");
    EXPECT_FAIL(ARGS("--max-latency", "soon"), "--max-latency", "'soon'");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-len", "8", "--max-latency", "60"), "--max-latency",
                "--policy auto"); /* bounds nothing in a run of the policy given */
    EXPECT_FAIL(ARGS("--evaluate"), "--evaluate", "flexgen policy");
    /* the search's flags where nothing searches: refused, not ignored */
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--hw", missing), "--hw", "--policy auto");
    EXPECT_FAIL(ARGS("policy", "--evaluate", "--model", tiny_dir, "--prompt-len", "8", "--hw", hw, "--max-latency", "1"),
                "--max-latency", "--evaluate");
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--prompt-len", "8", "--hw", bad), bad, "gtoc_bdw_cache");
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--prompt-len", "8", "--hw", missing), missing);
    /* the two rates of --int8-activations' products go together: one alone is named at load, not
     * left to the LP (a prefill term of bytes / 0) or to a silent fall back to the fp32 rates */
    char *whole = slurp(hw, NULL);
    static const char *const int8_rates[] = {"\"mm_flops_int8_g\": 2e11, ", "\"mm_flops_int8_p\": 2e11, "};
    for (int i = 0; i < 2; i++) {
        char with[64];
        snprintf(with, sizeof with, "%s\"gpu_is_host\"", int8_rates[i]);
        char *half = replaced(whole, "\"gpu_is_host\"", with);
        write_text_file(bad, half);
        EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--prompt-len", "8", "--hw", bad, "--offload-dir", dir, "--compress-weight",
                         "--int8-activations"), bad, "\"mm_flops_int8_p\"", "\"mm_flops_int8_g\"");
        free(half);
    }
    free(whole);
    write_text_file(bad, "{\"ctog_bdw\": 6e9}");
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--policy", "auto", "--hw", bad), bad);
    /* budgets nothing fits: the tier that cannot hold even one sequence is named (here a layer
     * of opt-175b, staged in fp32, is more than the gpu tier) */
    EXPECT_FAIL(ARGS("policy", "--model", "opt-175b", "--hw", hw, "--offload-dir", dir, "--path", dir,
                     "--gpu-mem", "1G", "--cpu-mem", "1G", "--disk-mem", "100G"),
                "no policy fits opt-175b", "gpu tier", "weight staging", "--gpu-mem gives 1.00 GiB");
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--prompt-len", "8", "--hw", hw, "--offload-dir", dir, "--gpu-mem", "64K",
                     "--cpu-mem", "64K", "--disk-mem", "16K"), "no policy fits", "tier: the plan needs");
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--prompt-len", "8", "--hw", hw, "--offload-dir", dir, "--max-latency", "1e-9"),
                "--max-latency");
    /* with --max-latency too, capacities nothing fits in are named as such, not the latency */
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--prompt-len", "8", "--hw", hw, "--offload-dir", dir, "--gpu-mem", "64K",
                     "--cpu-mem", "64K", "--disk-mem", "16K", "--max-latency", "60"), "no policy fits",
                "tier: the plan needs");
    /* a policy --evaluate cannot fit: the plan check's line */
    EXPECT_FAIL(ARGS("policy", "--evaluate", "--model", tiny_dir, "--prompt-len", "8", "--hw", hw, "--offload-dir", dir,
                     "--gpu-mem", "64K"), "gpu tier: the plan needs");
    EXPECT_FAIL(ARGS("profile", "--offload-dir", "/nonexistent/flexgen"), "--offload-dir", "no such directory");
    EXPECT_FAIL(ARGS("profile", "--offload-dir", tiny_prompts), "--offload-dir", "not a directory");
    EXPECT_FAIL(ARGS("profile", "--bogus", "x"), "--bogus", "profile");
    EXPECT_FAIL(ARGS("profile", "--out", "/nonexistent/hw.json", "--offload-dir", dir), "--out",
                "/nonexistent/hw.json");
    /* refused before a minute of measuring, as the output of a run is */
    EXPECT_FAIL(ARGS("profile", "--out", dir, "--offload-dir", dir), "--out", "not a regular file");
    EXPECT_FAIL(ARGS("profile", "--out", "", "--offload-dir", dir), "--out", "an empty path");
    EXPECT_FAIL(ARGS("profile", "--out", "--device", "cpu", "--offload-dir", dir), "--out", "got the flag --device");
    CU_ASSERT_EQUAL(dir_entries(dir), 2); /* hw.json and bad.json */
    /* a failed profile into the default hardware file leaves no directory of it behind: refused
     * before it is made, or taken away again (a GPU asked for where there is none) */
    char *cache = make_temp_dir(), *saved = env_put("XDG_CACHE_HOME", cache), why[FG_ERR_LEN];
    EXPECT_FAIL(ARGS("profile", "--offload-dir", "/nonexistent/flexgen"), "--offload-dir", "no such directory");
    EXPECT(dir_entries(cache) == 0, "profile refused: %d entries left in XDG_CACHE_HOME", dir_entries(cache));
    if (!fg_cuda_backend(why)) {
        EXPECT_FAIL(ARGS("profile", "--device", "cuda", "--offload-dir", dir), "--device cuda", why);
        EXPECT(dir_entries(cache) == 0, "profile on no GPU: %d entries left in XDG_CACHE_HOME", dir_entries(cache));
    }
    sigint_after_ms = 1000; /* stopped while it measures */
    char *out, *err;
    int rc = run_flexgen(ARGS("profile", "--offload-dir", dir), NULL, &out, &err);
    sigint_after_ms = 0;
    EXPECT(rc == 128 + SIGINT && dir_entries(cache) == 0, "profile stopped by SIGINT: expected exit %d and nothing "
           "in XDG_CACHE_HOME; got %d and %d entries", 128 + SIGINT, rc, dir_entries(cache));
    free(out), free(err);
    /* a default hardware file that cannot be written: said before a search measures the machine
     * (one line: no note of profiling, no steps) */
    char made[4200];
    snprintf(made, sizeof made, "%s", join(cache, "flexgen"));
    CU_ASSERT_EQUAL_FATAL(mkdir(made, 0755), 0);
    CU_ASSERT_EQUAL_FATAL(symlink("/nonexistent/flexgen/hw.json", join(made, "hardware.json")), 0);
    EXPECT_FAIL(ARGS("policy", "--model", "opt-125m", "--prompt-len", "8", "--gen-len", "4", "--offload-dir", dir),
                "hardware file", "hardware.json", "does not exist");
    env_restore("XDG_CACHE_HOME", saved);
    rm_tree(cache);
    free(cache);
    rm_tree(dir);
    free(dir);
}

/* flexgen profile (the CPU backend): a hardware file whose every rate is positive, --int8-activations'
 * products' too, read back as it was written, and nothing left in the offload dir. */
static void test_profile(void) {
    char *dir = make_temp_dir(), *off = make_temp_dir(), *out, *err;
    const char *hw = join(dir, "hw.json");
    CU_ASSERT_EQUAL(run_flexgen(ARGS("profile", "--device", "cpu", "--offload-dir", off, "--out", hw), NULL, &out, &err), 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "saved "));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "profile: disk"));
    fg_hardware h;
    char msg[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(fg_hardware_read(hw, &h, msg), 0);
    const double rates[] = {h.ctog_bdw, h.gtoc_bdw_cache, h.gtoc_bdw_hidden, h.dtoc_bdw,
        h.ctod_bdw_cache_p, h.ctod_bdw_hidden_p, h.ctod_bdw_g, h.mm_flops_p, h.mm_flops_g,
        h.bmm_flops_p, h.bmm_flops_g, h.cpu_flops, h.dequant_bdw, h.mem_bdw, h.mm_flops_int8_p, h.mm_flops_int8_g};
    for (size_t i = 0; i < sizeof rates / sizeof *rates; i++) CU_ASSERT(rates[i] > 0 && isfinite(rates[i]));
    CU_ASSERT_EQUAL(h.gpu_is_host, 1);
    EXPECT(h.blas_core[0] && strstr(out, h.blas_core), "the hardware file's \"blas_core\": expected the core "
           "the run names, got '%s' (%s)", h.blas_core, out);
    CU_ASSERT_EQUAL(dir_entries(off), 0);
    free(out), free(err);
    rm_tree(dir), rm_tree(off);
    free(dir), free(off);
}

/* ---------------------------------------------------------------------------------------------
 * flexgen perplexity, on the trained checkpoint against PyTorch
 * --------------------------------------------------------------------------------------------- */

/* flexgen perplexity of a model on a text with the extra flags: its --json object. */
static cJSON *perplexity_run_on(const char *model, const char *text, const char *const *extra) {
    const char *args[40] = {"perplexity", "--model", model, "--text", text, "--json",
                            "--quiet", "--device", "cpu"};
    int n = 9;
    while (*extra && n < 39) args[n++] = *extra++;
    args[n] = NULL;
    char *out, *err;
    int rc = run_flexgen(args, NULL, &out, &err);
    EXPECT(rc == 0 && err[0] == 0, "flexgen perplexity exited %d: %s", rc, err);
    cJSON *o = cJSON_Parse(out);
    CU_ASSERT_PTR_NOT_NULL(o);
    free(out);
    free(err);
    return o;
}

/* The same on opt-kjv's excerpt. */
static cJSON *perplexity_run(const char *const *extra) { return perplexity_run_on(kjv_dir, kjv_text, extra); }

static double number(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

/* PyTorch's perplexity of the excerpt for each window setting (a reference.json). */
static cJSON *kjv_expected(const char *reference) {
    char *text = slurp(reference, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    cJSON *o = cJSON_Parse(text);
    free(text);
    CU_ASSERT_PTR_NOT_NULL_FATAL(o);
    return o;
}

/* The bound: each log-probability is a logit less a log-sum-exp, so it moves at most twice as
 * far as the largest logit does, and the reference suite holds logits within 1e-4 x max|logit|
 * of PyTorch's: |ln ppl - ln ppl_ref| <= 2e-4 x max|logit|. In prefill and in decode (teacher
 * forcing) alike, each window setting, two block shapes; OPT, and LLaMA with its tokenizer.json. */
static void perplexity_matches_pytorch(const char *model, const char *text, const char *reference) {
    cJSON *ref = kjv_expected(reference), *setting;
    cJSON_ArrayForEach(setting, cJSON_GetObjectItemCaseSensitive(ref, "perplexity")) {
        char window[16], stride[16];
        snprintf(window, sizeof window, "%d", (int)number(setting, "window"));
        snprintf(stride, sizeof stride, "%d", (int)number(setting, "stride"));
        double expected = number(setting, "perplexity"), bound = 2e-4 * number(setting, "max_abs_logit");
        static const char *const modes[][5] = {{"--gpu-batch-size", "4", "--num-gpu-batches", "2", NULL},
                                               {"--gpu-batch-size", "3", "--decode", NULL, NULL}};
        for (int m = 0; m < 2; m++) {
            const char *args[9] = {"--window", window, "--stride", stride};
            memcpy(args + 4, modes[m], sizeof modes[m]);
            cJSON *o = perplexity_run_on(model, text, args);
            double got = number(o, "perplexity");
            EXPECT(fabs(log(got) - log(expected)) <= bound, "%s, window %s, stride %s, %s: perplexity %.6f, "
                   "PyTorch's %.6f; allowed |ln ratio| <= %.3g", model, window, stride, m ? "decode" : "prefill",
                   got, expected, bound);
            CU_ASSERT_EQUAL(number(o, "scored_tokens"), number(setting, "scored_tokens"));
            cJSON_Delete(o);
        }
    }
    cJSON_Delete(ref);
}

static void test_perplexity_matches_pytorch(void) {
    perplexity_matches_pytorch(kjv_dir, kjv_text, kjv_reference);
    perplexity_matches_pytorch(llama_kjv_dir, llama_kjv_text, llama_kjv_reference);
}

/* A sliding window shorter than the model's positions (Mistral's) bounds the windows, since a
 * sequence must fit in it: by default they are that long, and the text is scored as the same
 * weights without a sliding window score it with that --window; a longer --window is refused
 * naming the sliding window (before, the default ran into generate()'s refusal of the prompt). */
static void test_perplexity_sliding_window(void) {
    char *dir = make_temp_dir(), cmd[9000];
    snprintf(cmd, sizeof cmd, "cp '%s'/* '%s'/", llama_kjv_dir, dir);
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    char *text = slurp(join(dir, "config.json"), NULL);
    cJSON *config = cJSON_Parse(text);
    CU_ASSERT_PTR_NOT_NULL_FATAL(config);
    cJSON_ReplaceItemInObject(config, "model_type", cJSON_CreateString("mistral"));
    cJSON_AddNumberToObject(config, "sliding_window", 16);
    char *edited = cJSON_Print(config);
    write_text_file(join(dir, "config.json"), edited);
    const char *none[] = {NULL}, *window16[] = {"--window", "16", NULL};
    cJSON *windowed = perplexity_run_on(dir, llama_kjv_text, none);
    cJSON *plain = perplexity_run_on(llama_kjv_dir, llama_kjv_text, window16);
    EXPECT(number(windowed, "window") == 16 && number(windowed, "perplexity") == number(plain, "perplexity"),
           "sliding_window 16: window %g, perplexity %.6f; the same weights with --window 16: %.6f",
           number(windowed, "window"), number(windowed, "perplexity"), number(plain, "perplexity"));
    EXPECT_FAIL(ARGS("perplexity", "--model", dir, "--text", llama_kjv_text, "--window", "17"), "--window 17",
                "16 positions", "sliding_window");
    cJSON_Delete(windowed), cJSON_Delete(plain), cJSON_Delete(config);
    free(edited), free(text);
    rm_tree(dir);
    free(dir);
}

/* A --text that is not UTF-8 is scored byte for byte, with a note naming its first such byte. */
static void test_perplexity_text_not_utf8(void) {
    char *dir = make_temp_dir(), *out, *err;
    const char *text = join(dir, "text.txt");
    write_text_file(text, "In the beginning \xff\xfe God created\n");
    int rc = run_flexgen(ARGS("perplexity", "--model", llama_kjv_dir, "--text", text), NULL, &out, &err);
    EXPECT(rc == 0 && strstr(out, "perplexity: ") && strstr(err, "not UTF-8 at byte 17") && count_lines(err) == 1,
           "a text with bytes 0xff 0xfe: exit %d, stdout '%s', stderr '%s'", rc, out, err);
    free(out), free(err);
    rm_tree(dir);
    free(dir);
}

/* Section 5 in the two modes: prefill attends to the fresh keys and values, so a 4-bit cache or
 * sparse attention cannot change its numbers; decode reads the cache, so both do. 4-bit weights
 * change both. */
static double perplexity_of(const char *const *extra) {
    cJSON *o = perplexity_run(extra);
    double v = number(o, "perplexity");
    cJSON_Delete(o);
    return v;
}

static void test_perplexity_approximations(void) {
    double base = perplexity_of(ARGS("--window", "64", "--stride", "16"));
#define PPL(...) perplexity_of(ARGS("--window", "64", "--stride", "16", __VA_ARGS__))
    double cache_prefill = PPL("--compress-cache"), sparse_prefill = PPL("--attn-sparsity", "0.2");
    double cache_decode = PPL("--compress-cache", "--decode"), sparse_decode = PPL("--attn-sparsity", "0.2", "--decode");
    double weights = PPL("--compress-weight");
#undef PPL
    EXPECT(cache_prefill == base && sparse_prefill == base, "prefill: fp16 %.6f, 4-bit cache %.6f, "
           "sparsity 0.2 %.6f: expected the same", base, cache_prefill, sparse_prefill);
    EXPECT(fabs(log(cache_decode / base)) > 1e-4 && fabs(log(sparse_decode / base)) > 1e-4,
           "decode: fp16 %.6f, 4-bit cache %.6f, sparsity 0.2 %.6f: expected both to differ", base,
           cache_decode, sparse_decode);
    EXPECT(fabs(log(weights / base)) > 1e-4, "4-bit weights: %.6f, fp16 %.6f", weights, base);
}

/* --predictions writes the top-1 token of every scored position; --compare counts agreement:
 * a run agrees with itself everywhere. */
static void test_perplexity_predictions(void) {
    char *dir = make_temp_dir();
    const char *path = join(dir, "top1.txt");
    cJSON *o = perplexity_run(ARGS("--window", "64", "--stride", "16", "--predictions", path));
    long scored = (long)number(o, "scored_tokens");
    cJSON_Delete(o);
    char *text = slurp(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    CU_ASSERT_EQUAL(count_lines(text), scored);
    free(text);
    o = perplexity_run(ARGS("--window", "64", "--stride", "16", "--compare", path));
    CU_ASSERT_EQUAL(number(o, "top1_agreement"), 1.0);
    cJSON_Delete(o);
    CU_ASSERT_EQUAL(dir_entries(dir), 1); /* no temporary left beside it */
    rm_tree(dir);
    free(dir);
}

static void test_perplexity_bad_input(void) {
    char *dir = make_temp_dir();
    const char *empty = join(dir, "empty.txt");
    write_text_file(empty, "");
    char nul_path[4200];
    snprintf(nul_path, sizeof nul_path, "%s", join(dir, "nul.txt"));
    FILE *f = fopen(nul_path, "wb"); /* not UTF-8 too: the refusal is still its one line */
    fwrite("In the\xff\0 beginning", 1, 18, f);
    fclose(f);
    char short_path[4200];
    snprintf(short_path, sizeof short_path, "%s", join(dir, "short.txt"));
    write_text_file(short_path, "1\n2\n");
#define PPL_ARGS(...) ARGS("perplexity", "--model", kjv_dir, __VA_ARGS__)
    EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir), "--text FILE is required");
    EXPECT_FAIL(PPL_ARGS("--text", join(dir, "missing.txt")), "missing.txt");
    EXPECT_FAIL(PPL_ARGS("--text", empty), "--text", "the text has 1 token");
    EXPECT_FAIL(PPL_ARGS("--text", nul_path), "--text", "NUL");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--window", "1"), "--window", "2..");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--window", "257"), "--window 257", "256 positions");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--window", "64", "--stride", "64"), "--stride 64");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--compare", short_path), "--compare", "2 predictions");
    write_text_file(short_path, "1\nx\n");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--compare", short_path), "--compare", "line 2", "token id");
    write_text_file(short_path, "");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--compare", short_path), "--compare", "0 predictions");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--compare", join(dir, "none.txt")), "--compare", "none.txt");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--gen-len", "4"), "--gen-len", "not a flag of `flexgen perplexity`");
    EXPECT_FAIL(PPL_ARGS("--text", kjv_text, "--predictions", join(dir, "no/such/dir/p.txt")), "--predictions");
    EXPECT_FAIL(ARGS("perplexity", "--model", tiny_dir, "--text", kjv_text), "needs a tokenizer");
    /* a tokenizer whose "▁the" is id 5000, past the trained LLaMA's 2048: named with the text,
     * given by --tokenizer and as the model directory's own */
    char *big = make_temp_dir(), text[4200], model_link[4200], want[9000];
    snprintf(text, sizeof text, "%s", join(big, "text.txt"));
    write_text_file(text, "the cat\n");
    write_small_tokenizer(big, SPM_NORMALIZER, 5000);
    snprintf(want, sizeof want, "--tokenizer %s: token id 5000 of --text %s is out of range [0, 2048) (the model's "
             "vocab_size)", join(big, "tokenizer.json"), text);
    EXPECT_FAIL(ARGS("perplexity", "--model", llama_kjv_dir, "--tokenizer", join(big, "tokenizer.json"), "--text", text),
                want);
    static const char *const weights[] = {"config.json", "model.safetensors"};
    char *llama = realpath(llama_kjv_dir, NULL);
    for (int i = 0; i < 2; i++) {
        snprintf(model_link, sizeof model_link, "%s/%s", llama, weights[i]);
        CU_ASSERT_EQUAL_FATAL(symlink(model_link, join(big, weights[i])), 0);
    }
    free(llama);
    snprintf(want, sizeof want, "%s: token id 5000 of --text %s is out of range [0, 2048)", join(big, "tokenizer.json"),
             text);
    EXPECT_FAIL(ARGS("perplexity", "--model", big, "--text", text), want);
    /* a run's prompts, as text and as a file's lines, name the tokenizer the same way */
    snprintf(want, sizeof want, "%s: token id 5000 of --prompt 2 is out of range [0, 2048)", join(big, "tokenizer.json"));
    EXPECT_FAIL(ARGS("--model", big, "--prompt", "a", "--prompt", "the cat", "--gen-len", "2", "--offload-dir", dir),
                want);
    snprintf(want, sizeof want, "%s: token id 5000 of %s line 1 is out of range [0, 2048)", join(big, "tokenizer.json"),
             text);
    EXPECT_FAIL(ARGS("--model", big, "--prompt-file", text, "--gen-len", "2", "--offload-dir", dir), want);
    rm_tree(big);
    free(big);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--decode"), "--decode", "a flag of `flexgen perplexity`");
    EXPECT_FAIL(ARGS("policy", "--model", kjv_dir, "--text", kjv_text), "--text", "a flag of `flexgen perplexity`");
#undef PPL_ARGS
    CU_ASSERT_EQUAL(dir_entries(dir), 3); /* nothing written */
    rm_tree(dir);
    free(dir);
}

/* Flags a subcommand has no use for are refused, not ignored. */
static void test_flags_of_other_commands(void) {
    static const char *const policy[] = {"--output", "--trace", "--dump-logits"};
    for (int i = 0; i < 3; i++)
        EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, policy[i], "x.out"), policy[i], "not a flag of `flexgen policy`");
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--resume"), "--resume", "not a flag of `flexgen policy`");
    /* a run's flags that no plan depends on: a warm-up run, sampling, --policy's choice (a
     * hardware file given, so that a run the refusal misses plans without measuring the machine) */
    char *dir = make_temp_dir(), hw[4200];
    snprintf(hw, sizeof hw, "%s", join(dir, "hw.json"));
    write_hw(hw);
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--hw", hw, "--warmup"), "--warmup", "not a flag of `flexgen policy`");
    /* in every position: right after the subcommand, between flags, last */
    EXPECT_FAIL(ARGS("policy", "--warmup", "--model", tiny_dir, "--hw", hw), "--warmup", "not a flag of `flexgen policy`");
    EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--warmup", "--hw", hw), "--warmup", "not a flag of `flexgen policy`");
    EXPECT_FAIL(ARGS("perplexity", "--warmup", "--model", kjv_dir, "--text", kjv_text), "--warmup",
                "not a flag of `flexgen perplexity`");
    EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir, "--warmup", "--text", kjv_text), "--warmup",
                "not a flag of `flexgen perplexity`");
    static const char *const policy_values[][2] = {{"--temperature", "0.7"}, {"--top-p", "0.9"}, {"--seed", "3"},
                                                   {"--policy", "auto"}};
    for (int i = 0; i < 4; i++)
        EXPECT_FAIL(ARGS("policy", "--model", tiny_dir, "--hw", hw, policy_values[i][0], policy_values[i][1]),
                    policy_values[i][0], "not a flag of `flexgen policy`");
    rm_tree(dir);
    free(dir);
    EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir, "--text", kjv_text, "--warmup"), "--warmup",
                "not a flag of `flexgen perplexity`");
    static const char *const perplexity[] = {"--output", "--trace"};
    for (int i = 0; i < 2; i++)
        EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir, "--text", kjv_text, perplexity[i], "x.out"), perplexity[i],
                    "not a flag of `flexgen perplexity`");
    EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir, "--text", kjv_text, "--resume"), "--resume", "flexgen perplexity");
}

/* Standard input that cannot be read (a directory, a closed descriptor) is an error in `flexgen
 * tokenize`, not an empty input: exit 2 with one line that says so. */
static void test_stdin_unreadable(void) {
    const char *const redirects[] = {"< /", "<&-"};
    for (int i = 0; i < 2; i++) {
        char cmd[8192], *out, *err;
        snprintf(cmd, sizeof cmd, "%s tokenize --model %s %s", flexgen_bin(), kjv_dir, redirects[i]);
        int rc = run_command(ARGS("sh", "-c", cmd), NULL, &out, &err);
        EXPECT(rc == 2 && strstr(err, "standard input: read failed") && count_lines(err) == 1 && !*out,
               "flexgen tokenize %s: expected exit 2 and one line; got %d, '%s', '%s'", redirects[i], rc, err, out);
        free(out), free(err);
    }
}

/* An output that is the file standard output or standard error writes to (`> f`, `2> f`,
 * /dev/stdout) is refused before the run, naming both: the report would write over it. The
 * shell's empty file is all that is there after. */
static void test_output_is_a_std_stream(void) {
    char *dir = make_temp_dir(), file[4200], cmd[16384];
    snprintf(file, sizeof file, "%s", join(dir, "o.out"));
    const char *const flags[] = {"--output", "--dump-logits", "--trace", "--dump-logits"};
    const char *const targets[] = {file, file, file, "/dev/stdout"};
    const char *const streams[] = {">", ">", "2>", ">"};
    for (int i = 0; i < 4; i++) {
        char *out, *err;
        unlink(file);
        snprintf(cmd, sizeof cmd, "%s --model %s --prompt-ids %s --gen-len 2 --quiet --device cpu %s '%s' %s '%s'",
                 flexgen_bin(), tiny_dir, tiny_prompts, flags[i], targets[i], streams[i], file);
        int rc = run_command(ARGS("sh", "-c", cmd), NULL, &out, &err);
        size_t len = 0;
        char *left = slurp(file, &len);
        const char *said = i == 2 ? left : err; /* 2> f: the line went to the file */
        const char *stream = i == 2 ? "standard error" : "standard output";
        EXPECT(rc == 2 && said && strstr(said, flags[i]) && strstr(said, stream) && count_lines(said) == 1 &&
                   (i == 2 || len == 0),
               "%s %s %s %s: expected exit 2, one line naming the flag and %s, and the file left empty; got %d, "
               "'%s', %zu bytes", flags[i], targets[i], streams[i], file, stream, rc, said ? said : "", len);
        free(out), free(err), free(left);
    }
    rm_tree(dir);
    free(dir);
}

/* Standard output that cannot be written (/dev/full): exit 1 with a line that says so. */
static void test_stdout_full(void) {
    char *dir = make_temp_dir(), hw[4200], cmd[16384];
    snprintf(hw, sizeof hw, "%s", join(dir, "hw.json"));
    write_hw(hw);
    const char *runs[] = {"--model %s --prompt-ids %s --gen-len 2 --quiet --device cpu",
                          "tokenize --vocab %s/vocab.json --merges %s/merges.txt",
                          "policy --model %s --hw %s --prompt-len 8 --gen-len 2", "perplexity --model %s --text %s --quiet",
                          "profile --help%.0s%.0s", "--help%.0s%.0s"};
    const char *first[] = {tiny_dir, kjv_dir, tiny_dir, kjv_dir, "", ""};
    const char *second[] = {tiny_prompts, kjv_dir, hw, kjv_text, "", ""};
    for (int i = 0; i < 6; i++) {
        char args[12000], *out, *err;
        snprintf(args, sizeof args, runs[i], first[i], second[i]);
        snprintf(cmd, sizeof cmd, "echo 'In the beginning' | %s %s > /dev/full", flexgen_bin(), args);
        int rc = run_command(ARGS("sh", "-c", cmd), NULL, &out, &err);
        EXPECT(rc == 1 && strstr(err, "flexgen: standard output: write failed") && count_lines(err) == 1,
               "flexgen %s > /dev/full: expected exit 1 and one line; got %d, '%s'", args, rc, err);
        free(out), free(err);
    }
    rm_tree(dir);
    free(dir);
}

/* A run started with standard error closed (`2>&-`): its files hold their own bytes only. The
 * first file opened used to take descriptor 2, and the job's progress and messages went into the
 * job's records. */
static void test_stderr_closed(void) {
    char *dir = make_temp_dir(), job[4200], logits[4200], prompts[4200], cmd[16384];
    snprintf(job, sizeof job, "%s", join(dir, "out.jsonl"));
    snprintf(logits, sizeof logits, "%s", join(dir, "l.bin"));
    snprintf(prompts, sizeof prompts, "%s", join(dir, "p.jsonl"));
    write_text_file(prompts, "{\"prompt_ids\": [2, 10]}\n{\"prompt_ids\": [2, 11, 12]}\n");
    snprintf(cmd, sizeof cmd, "%s --model %s --prompt-file %s --gen-len 2 --device cpu --progress --output %s 2>&-",
             flexgen_bin(), kjv_dir, prompts, job);
    char *out, *err;
    int rc = run_command(ARGS("sh", "-c", cmd), NULL, &out, &err);
    free(out), free(err);
    char *text = slurp(job, NULL);
    int records = 0, whole = text != NULL;
    for (char *line = text; line && *line; records++) { /* each line one JSON object */
        char *end = strchr(line, '\n');
        whole &= end && line[0] == '{' && end[-1] == '}';
        line = end ? end + 1 : line + strlen(line);
    }
    EXPECT(rc == 0 && whole && records == 3, "--output with stderr closed: exit %d, %d lines, expected 3 "
           "JSON lines: '%.300s'", rc, records, text ? text : "");
    free(text);
    snprintf(cmd, sizeof cmd, "%s --model %s --prompt-file %s --gen-len 2 --device cpu --progress --dump-logits %s 2>&-",
             flexgen_bin(), kjv_dir, prompts, logits);
    rc = run_command(ARGS("sh", "-c", cmd), NULL, &out, &err);
    free(out), free(err);
    struct stat st;
    long size = stat(logits, &st) == 0 ? (long)st.st_size : -1, want = 2L * 2 * 4096 * sizeof(float);
    EXPECT(rc == 0 && size == want, "--dump-logits with stderr closed: exit %d, %ld bytes, expected %ld", rc, size,
           want);
    rm_tree(dir);
    free(dir);
}

/* Every output file is made with the umask's mode, as --output's are (0644 under umask 022). */
static void test_output_modes(void) {
    char *dir = make_temp_dir(), logits[4200], trace[4200], job[4200], prompts[4200], predictions[4200];
    snprintf(logits, sizeof logits, "%s", join(dir, "l.bin"));
    snprintf(trace, sizeof trace, "%s", join(dir, "t.json"));
    snprintf(job, sizeof job, "%s", join(dir, "out.jsonl"));
    snprintf(prompts, sizeof prompts, "%s", join(dir, "p.jsonl"));
    snprintf(predictions, sizeof predictions, "%s", join(dir, "p.txt"));
    write_text_file(prompts, "{\"prompt_ids\": [2, 10]}\n");
    mode_t old = umask(022);
    free(run_tiny(ARGS("--dump-logits", logits, "--trace", trace)));
    char *out, *err;
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", job, "--gen-len", "2",
                                     "--quiet"), NULL, &out, &err), 0);
    free(out), free(err);
    CU_ASSERT_EQUAL(run_flexgen(ARGS("perplexity", "--model", kjv_dir, "--text", kjv_text, "--window", "32",
                                     "--predictions", predictions, "--quiet"), NULL, &out, &err), 0);
    free(out), free(err);
    umask(old);
    const char *files[] = {logits, trace, job, predictions};
    for (int i = 0; i < 4; i++) {
        struct stat st;
        int mode = stat(files[i], &st) == 0 ? (int)(st.st_mode & 0777) : -1;
        EXPECT(mode == 0644, "%s under umask 022: expected mode 644, got %o", files[i], (unsigned)mode);
    }
    rm_tree(dir);
    free(dir);
}

/* An output's name of NAME_MAX bytes is written (its temporary's name is cut to fit); a longer
 * one is refused before the run, and nothing is left. */
static void test_output_long_name(void) {
    char *dir = make_temp_dir(), name[NAME_MAX + 2], path[4200 + NAME_MAX];
    memset(name, 'a', NAME_MAX + 1);
    name[NAME_MAX + 1] = 0;
    memcpy(name + NAME_MAX - 5, ".json", 5); /* NAME_MAX bytes with the suffix */
    snprintf(path, sizeof path, "%s/%.*s", dir, NAME_MAX, name);
    free(run_tiny(ARGS("--trace", path)));
    EXPECT(access(path, F_OK) == 0 && dir_entries(dir) == 1, "--trace of a name of %d bytes: expected the file "
           "alone, got %d files", NAME_MAX, dir_entries(dir));
    unlink(path);
    name[NAME_MAX] = 'x'; /* one byte more */
    snprintf(path, sizeof path, "%s/%s", dir, name);
    EXPECT_FAIL(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2", "--trace", path), "--trace",
                "File name too long");
    EXPECT(dir_entries(dir) == 0, "a refused --trace of a name too long left %d files", dir_entries(dir));
    rm_tree(dir);
    free(dir);
}

/* ---------------------------------------------------------------------------------------------
 * OpenBLAS's core (support/blas_core.c)
 * --------------------------------------------------------------------------------------------- */

/* fg_blas_core_due over a table: the CPU's instruction sets x the core the library picked (x a
 * user's OPENBLAS_CORETYPE) -> the core forced, or none. */
static void test_blas_core_decision(void) {
    enum { AVX = FG_CPU_AVX, AVX2 = AVX | FG_CPU_AVX2 | FG_CPU_FMA,
           AVX512 = AVX2 | FG_CPU_AVX512F | FG_CPU_AVX512BW | FG_CPU_AVX512DQ | FG_CPU_AVX512VL };
    static const struct { unsigned cpu; const char *picked; int user; const char *want; } rows[] = {
        {AVX512, "Haswell", 0, "SkylakeX"}, /* an AVX-512 CPU newer than the library's table */
        {AVX512, "Prescott", 0, "SkylakeX"},
        {AVX512, "Zen", 0, "SkylakeX"},
        {AVX512, "haswell", 0, "SkylakeX"}, /* any case, as the library compares names */
        {AVX512, "SkylakeX", 0, NULL},      /* the best already */
        {AVX512, "Cooperlake", 0, NULL},
        {AVX512, "Haswell", 1, NULL},       /* the user's OPENBLAS_CORETYPE */
        {AVX512, "Prescott", 1, NULL},
        {AVX512, "NeoverseN1", 0, NULL},    /* a core not in the table */
        {AVX512, "", 0, NULL},
        {AVX2 | FG_CPU_AVX512F, "Haswell", 0, NULL}, /* AVX-512 F without BW, DQ, VL: AVX2 */
        {AVX2, "Prescott", 0, "Haswell"},
        {AVX2, "Sandybridge", 0, "Haswell"},
        {AVX2, "Steamroller", 0, "Haswell"},
        {AVX2, "Haswell", 0, NULL},
        {AVX2, "Excavator", 0, NULL},
        {AVX2, "SkylakeX", 0, NULL},        /* above what the CPU has: never lowered */
        {AVX | FG_CPU_AVX2, "Nehalem", 0, "Sandybridge"}, /* AVX2 without FMA: AVX */
        {AVX, "Core2", 0, "Sandybridge"},
        {AVX, "Bulldozer", 0, NULL},
        {0, "Prescott", 0, NULL},           /* no AVX: nothing better to force */
        {0, "Atom", 0, NULL},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        const char *got = fg_blas_core_due(rows[i].cpu, rows[i].picked, rows[i].user);
        EXPECT(got == rows[i].want || (got && rows[i].want && !strcmp(got, rows[i].want)),
               "CPU features 0x%x, the library's %s%s: expected %s, got %s", rows[i].cpu, rows[i].picked,
               rows[i].user ? ", the user's OPENBLAS_CORETYPE" : "", rows[i].want ? rows[i].want : "none",
               got ? got : "none");
    }
}

/* ./flexgen on opt-tiny with OPENBLAS_CORETYPE (NULL: unset), FLEXGEN_TEST_BLAS_LOW=1 where low,
 * FLEXGEN_BLAS_CORE_FORCED (NULL: unset) and the extra flags, under timeout(1), so that a run
 * that kept starting itself again fails instead of hanging. Returns its stdout; the check fails
 * unless it exits 0 with nothing on stderr. */
static char *blas_run(const char *coretype, int low, const char *forced, const char *const *extra) {
    static const char *const names[] = {"OPENBLAS_CORETYPE", "FLEXGEN_TEST_BLAS_LOW", "FLEXGEN_BLAS_CORE_FORCED"};
    const char *values[] = {coretype, low ? "1" : NULL, forced};
    char *saved[3];
    for (int i = 0; i < 3; i++) saved[i] = env_put(names[i], values[i]);
    const char *argv[40] = {"timeout", "120", flexgen_bin(), "--model", tiny_dir, "--prompt-ids",
                            tiny_prompts, "--gen-len", "2", "--quiet", "--device", "cpu"};
    int n = 12;
    while (*extra && n < 39) argv[n++] = *extra++;
    argv[n] = NULL;
    char *out, *err;
    int rc = run_command(argv, NULL, &out, &err);
    for (int i = 0; i < 3; i++) env_restore(names[i], saved[i]);
    EXPECT(rc == 0 && !err[0], "OPENBLAS_CORETYPE=%s%s%s: expected exit 0 and nothing on stderr, got %d "
           "(124: still running after 120 s): %s", coretype ? coretype : "(unset)",
           low ? " FLEXGEN_TEST_BLAS_LOW=1" : "", forced ? " FLEXGEN_BLAS_CORE_FORCED" : "", rc, err);
    free(err);
    return out;
}

static const char *last_line(const char *s) {
    size_t n = strlen(s);
    if (n > 0 && s[n - 1] == '\n') n--;
    while (n > 0 && s[n - 1] != '\n') n--;
    return s + n;
}

/* The --json report's value of key ("" when it is not a string). */
static const char *json_text(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* The report's blas line: "blas: OpenBLAS ..., core <core> (<why>)\tcpu kernels: <path>". */
static void expect_blas_line(const char *out, const char *core, const char *why) {
    char want[200];
    snprintf(want, sizeof want, ", core %s (%s)\tcpu kernels: %s\n", core, why, matmul_path());
    const char *line = last_line(out), *at = strstr(line, want);
    EXPECT(!strncmp(line, "blas: OpenBLAS ", 15) && at && !at[strlen(want)],
           "the report's last line: expected 'blas: OpenBLAS ...%.*s', got '%s'", (int)strlen(want) - 1, want, line);
}

/* The library "picks" Prescott (OPENBLAS_CORETYPE=Prescott with FLEXGEN_TEST_BLAS_LOW=1, which
 * makes it stand for the library's own pick): ./flexgen starts itself again, once, on the core
 * fg_blas_core_due gives for this CPU, and the report says so; a CPU without AVX stays on
 * Prescott. With FLEXGEN_BLAS_CORE_FORCED set, as in the second start, it does not start again. */
static void test_blas_core_restart(void) {
#if defined(__x86_64__)
    const char *want = fg_blas_core_due(fg_cpu_features(), "Prescott", 0);
    char *out = blas_run("Prescott", 1, NULL, ARGS(NULL));
    if (want) {
        char why[100];
        snprintf(why, sizeof why, "chosen for %s; the library picked Prescott",
                 !strcmp(want, "SkylakeX") ? "AVX-512" : !strcmp(want, "Haswell") ? "AVX2" : "AVX");
        expect_blas_line(out, want, why);
    } else {
        expect_blas_line(out, "Prescott", "as the library picked");
    }
    free(out);
    out = blas_run("Prescott", 1, NULL, ARGS("--json"));
    cJSON *o = cJSON_Parse(out);
    EXPECT(!strcmp(json_text(o, "blas_core"), want ? want : "Prescott"), "--json: expected \"blas_core\" %s, got '%s'",
           want ? want : "Prescott", json_text(o, "blas_core"));
    cJSON_Delete(o);
    free(out);
    out = blas_run("Prescott", 1, "Prescott", ARGS("--json")); /* the marker: no second start */
    o = cJSON_Parse(out);
    EXPECT(!strcmp(json_text(o, "blas_core"), "Prescott"),
           "FLEXGEN_BLAS_CORE_FORCED set: expected no new start, on Prescott; got '%s'", json_text(o, "blas_core"));
    cJSON_Delete(o);
    free(out);
#endif
}

/* A user's OPENBLAS_CORETYPE is kept, even one the CPU could better (Haswell on an AVX-512 CPU,
 * Prescott elsewhere): the report names it, as the user's, and --json has it. */
static void test_blas_core_user(void) {
#if defined(__x86_64__)
    const char *mine = fg_blas_core_due(fg_cpu_features(), "Haswell", 0) ? "Haswell" : "Prescott";
    char *out = blas_run(mine, 0, NULL, ARGS(NULL));
    expect_blas_line(out, mine, "OPENBLAS_CORETYPE");
    free(out);
    out = blas_run(mine, 0, NULL, ARGS("--json"));
    cJSON *o = cJSON_Parse(out);
    EXPECT(!strcmp(json_text(o, "blas_core"), mine) && !strncmp(json_text(o, "blas_library"), "OpenBLAS ", 9),
           "--json with OPENBLAS_CORETYPE=%s: expected \"blas_core\" %s and \"blas_library\" OpenBLAS ..., got '%s' "
           "and '%s'", mine, mine, json_text(o, "blas_core"), json_text(o, "blas_library"));
    cJSON_Delete(o);
    free(out);
#endif
}

/* OPENBLAS_CORETYPE naming a core of a wider instruction set than the CPU's: OpenBLAS takes it,
 * and its first product ends the run with SIGILL, nothing said (SkylakeX on an AVX2 CPU; later
 * versions also know Cooperlake and SapphireRapids). A name OpenBLAS does not know it passes over
 * in silence, running its own pick. Each is one line naming the variable, exit 2, before any
 * product. The CPU is taken to stop at AVX2, as a laptop's (FLEXGEN_TEST_CPU=avx2): Haswell runs
 * there, and FLEXGEN_ISA=avx512 is refused there too. */
static void test_blas_core_refused(void) {
    char *isa = env_put("FLEXGEN_ISA", NULL), *core = env_put("OPENBLAS_CORETYPE", NULL);
    char *cpu = env_put("FLEXGEN_TEST_CPU", "avx2");
#define RUN_ARGS ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2", "--device", "cpu")
    static const char *const wider[] = {"SkylakeX", "Cooperlake", "SapphireRapids", "skylakex"};
    for (size_t i = 0; i < sizeof wider / sizeof *wider; i++) {
        setenv("OPENBLAS_CORETYPE", wider[i], 1);
        EXPECT_FAIL(RUN_ARGS, "OPENBLAS_CORETYPE=", wider[i], "AVX-512", "Haswell");
    }
    setenv("OPENBLAS_CORETYPE", "Haswell", 1);
    char *out, *err;
    int rc = run_flexgen(RUN_ARGS, NULL, &out, &err);
    EXPECT(rc == 0 && strstr(out, "core Haswell (OPENBLAS_CORETYPE)"), "OPENBLAS_CORETYPE=Haswell on an AVX2 CPU: "
           "expected exit 0 on Haswell, got %d: %s", rc, err);
    free(out), free(err);
    unsetenv("OPENBLAS_CORETYPE");
    setenv("FLEXGEN_ISA", "avx512", 1);
    EXPECT_FAIL(RUN_ARGS, "FLEXGEN_ISA=avx512", "avx2");
    unsetenv("FLEXGEN_ISA");
    env_restore("FLEXGEN_TEST_CPU", cpu);
    setenv("OPENBLAS_CORETYPE", "Haswel", 1); /* on the CPU as it is */
    EXPECT_FAIL(RUN_ARGS, "OPENBLAS_CORETYPE=Haswel", "no core of that name");
    unsetenv("OPENBLAS_CORETYPE");
    /* far more OpenMP threads than CPUs: refused before libgomp starts them (65,535 crashed it) */
    char *threads = env_put("OMP_NUM_THREADS", "65535");
    EXPECT_FAIL(RUN_ARGS, "OMP_NUM_THREADS=65535", "set it lower");
    env_restore("OMP_NUM_THREADS", threads);
#undef RUN_ARGS
    env_restore("OPENBLAS_CORETYPE", core);
    env_restore("FLEXGEN_ISA", isa);
}

/* ./flexgen on opt-tiny with FLEXGEN_ISA=isa (NULL: unset), OMP_NUM_THREADS=threads (NULL: as it
 * is) and the extra flags. */
static int isa_run(const char *isa, const char *threads, const char *const *extra, char **out, char **err) {
    char *saved = env_put("FLEXGEN_ISA", isa), *saved_threads = threads ? env_put("OMP_NUM_THREADS", threads) : NULL;
    const char *argv[40] = {flexgen_bin(), "--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "4",
                            "--quiet", "--device", "cpu"};
    int n = 10;
    while (*extra && n < 39) argv[n++] = *extra++;
    argv[n] = NULL;
    int rc = run_command(argv, NULL, out, err);
    env_restore("FLEXGEN_ISA", saved);
    if (threads) env_restore("OMP_NUM_THREADS", saved_threads);
    return rc;
}

/* --int8-activations and --bf16-prefill round a sequence the same way in GPU batches of up to 64:
 * a prompt takes prefill's scheme however short (a prompt of 40 tokens is 40 rows alone and
 * 2,560 beside 63 copies of itself), and decode steps of up to 64 rows decode's. models/opt-kjv,
 * 4-bit weights: the logits the same bits (lm_head's dots too, up to 64 rows). Chosen by rows,
 * the prompt alone took decode's scheme in prefill: 2.6e-2 (int8) and 4.0e-3 (bf16) x
 * max|logit| apart there. */
static void test_schemes_batch_invariant(void) {
    enum { SEQS = 64, PROMPT = 40, GEN = 4, VOCAB = 4096 };
    char *dir = make_temp_dir(), *out, *err;
    char one[4200], many[4200], alone[4200], batched[4200];
    snprintf(one, sizeof one, "%s", join(dir, "one.txt"));
    snprintf(many, sizeof many, "%s", join(dir, "many.txt"));
    char line[PROMPT * 6 + 2] = "", *at = line;
    uint64_t seed = 17;
    for (int t = 0; t < PROMPT; t++) at += sprintf(at, t ? " %d" : "%d", 4 + (int)(test_uniform(&seed) * 4000));
    strcat(line, "\n");
    write_text_file(one, line);
    FILE *f = fopen(many, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    for (int s = 0; s < SEQS; s++) fputs(line, f);
    fclose(f);
    static const char *const modes[] = {"--int8-activations", "--bf16-prefill"};
    for (int m = 0; m < 2; m++) {
        snprintf(alone, sizeof alone, "%s", join(dir, "alone.bin"));
        snprintf(batched, sizeof batched, "%s", join(dir, "batched.bin"));
        int rc = run_flexgen(ARGS("--model", kjv_dir, "--device", "cpu", "--prompt-ids", one, "--gen-len", "4",
                                  "--compress-weight", modes[m], "--quiet", "--dump-logits", alone), NULL, &out, &err);
        free(out), free(err);
        rc |= run_flexgen(ARGS("--model", kjv_dir, "--device", "cpu", "--prompt-ids", many, "--gen-len", "4",
                               "--gpu-batch-size", "64", "--compress-weight", modes[m], "--quiet", "--dump-logits",
                               batched), NULL, &out, &err);
        free(out), free(err);
        CU_ASSERT_EQUAL_FATAL(rc, 0);
        float *a = read_floats(alone, (size_t)GEN * VOCAB), *b = read_floats(batched, (size_t)SEQS * GEN * VOCAB);
        EXPECT(!memcmp(a, b, (size_t)GEN * VOCAB * sizeof *a), "%s: the logits of a prompt alone and in a GPU batch "
               "of %d differ (prefill's: %s)", modes[m], SEQS, memcmp(a, b, VOCAB * sizeof *a) ? "they differ" : "the same");
        free(a), free(b);
        unlink(alone), unlink(batched);
    }
    unlink(one), unlink(many);
    rm_tree(dir);
    free(dir);
}

/* FLEXGEN_ISA: every path this machine has (portable, avx2, avx512 where the CPU has it, and
 * avx512-simde everywhere) runs a whole job to the same logits, bit for bit: opt-tiny's five
 * prompts in one GPU batch (left-padded), prefill and three decode steps, with fp16 weights, 4-bit
 * ones, and 4-bit ones times int8 activations (whose rounding turns a last-bit difference anywhere
 * upstream, e.g. in decode attention, into a whole step of int8). The portable path also turns off
 * simd.c's AVX2 attention twins, so this holds opt_model.c's plain loops to them too. Nor do the
 * threads change a bit: the widest path on 1 and on 3 threads gives the same logits. --json and
 * the report name the path and the int8 sums' instructions; a name it does not know, or a path
 * wider than the CPU has, is one line and exit 2. */
static void test_isa_paths(void) {
    char *dir = make_temp_dir(), *out, *err;
    fg_isa cpu = fg_isa_of_cpu();
    unsigned features = fg_cpu_features();
    static const char *const modes[] = {"fp16 weights", "--compress-weight", "--compress-weight --int8-activations"};
    for (int mode = 0; mode < 3; mode++) {
        char *first = NULL;
        size_t first_len = 0;
        /* every path, then this CPU's widest on 1 and 3 threads: the threads split no sum */
        for (int run = FG_ISA_PORTABLE; run <= FG_ISA_AVX512_SIMDE + 2; run++) {
            int isa = run <= FG_ISA_AVX512_SIMDE ? run : (int)cpu;
            const char *threads = run <= FG_ISA_AVX512_SIMDE ? NULL : run == FG_ISA_AVX512_SIMDE + 1 ? "1" : "3";
            if (isa != FG_ISA_AVX512_SIMDE && isa > (int)cpu) continue;
            const char *name = fg_isa_name((fg_isa)isa);
            char logits[4200];
            snprintf(logits, sizeof logits, "%s%s", join(dir, name), threads ? threads : "");
            int rc = isa_run(name, threads,
                             mode == 0   ? ARGS("--json", "--dump-logits", logits)
                             : mode == 1 ? ARGS("--json", "--dump-logits", logits, "--compress-weight")
                                         : ARGS("--json", "--dump-logits", logits, "--compress-weight",
                                                "--int8-activations"),
                             &out, &err);
            cJSON *o = cJSON_Parse(out);
            EXPECT(rc == 0 && !strcmp(json_text(o, "cpu_kernels"), name), "FLEXGEN_ISA=%s, %s: expected exit 0 and "
                   "\"cpu_kernels\" %s, got %d and '%s': %s", name, modes[mode], name, rc, json_text(o, "cpu_kernels"),
                   err);
            const char *sums = isa == FG_ISA_PORTABLE ? "portable"
                               : isa == FG_ISA_AVX2   ? (features & FG_CPU_AVXVNNI ? "avx-vnni" : "avx2")
                               : isa == FG_ISA_AVX512 && !(features & FG_CPU_AVX512VNNI) ? "avx2"
                               : isa == FG_ISA_AVX512_SIMDE ? "avx512-vnni-simde" : "avx512-vnni";
            if (mode == 2)
                EXPECT(rc == 0 && !strcmp(json_text(o, "int8_sums"), sums), "FLEXGEN_ISA=%s --int8-activations: "
                       "expected \"int8_sums\" %s, got %d and '%s': %s", name, sums, rc, json_text(o, "int8_sums"), err);
            cJSON_Delete(o);
            free(out), free(err);
            size_t len = 0;
            char *bytes = slurp(logits, &len);
            if (!first) {
                first = bytes, first_len = len;
                continue;
            }
            EXPECT(bytes && len == first_len && len > 0 && !memcmp(bytes, first, len), "FLEXGEN_ISA=%s%s%s, %s: "
                   "the logits differ from FLEXGEN_ISA=%s's", name, threads ? " OMP_NUM_THREADS=" : "",
                   threads ? threads : "", modes[mode], fg_isa_name(FG_ISA_PORTABLE));
            free(bytes);
        }
        free(first);
    }
    int rc = isa_run("avx2", NULL, ARGS(NULL), &out, &err); /* the report's last line */
    if (cpu >= FG_ISA_AVX2)
        EXPECT(rc == 0 && strstr(last_line(out), "\tcpu kernels: avx2\n"), "FLEXGEN_ISA=avx2: the report's last "
               "line: expected '... cpu kernels: avx2', got '%s'", last_line(out));
    free(out), free(err);
    rc = isa_run("avx9", NULL, ARGS(NULL), &out, &err);
    EXPECT(rc == 2 && strstr(err, "FLEXGEN_ISA") && strstr(err, "'avx9'") && !strchr(err, '\n')[1],
           "FLEXGEN_ISA=avx9: expected exit 2 and one line naming it, got %d: %s", rc, err);
    free(out), free(err);
    if (cpu < FG_ISA_AVX512) { /* wider than the CPU */
        rc = isa_run("avx512", NULL, ARGS(NULL), &out, &err);
        EXPECT(rc == 2 && strstr(err, "FLEXGEN_ISA=avx512") && !strchr(err, '\n')[1],
               "FLEXGEN_ISA=avx512 on a CPU without AVX-512: expected exit 2 and one line, got %d: %s", rc, err);
        free(out), free(err);
    }
    rm_tree(dir);
    free(dir);
}

/* --bf16-prefill and --int8-activations: --json's prefill_products names the path prefill's last
 * product took (onednn.c's gemm_path), not one planned to name it: a path this CPU may run for
 * prompts of any length in GPU batches of any size (one prompt of 14 a batch, five a batch), and
 * "none ran" where every prompt is one token (a step of one token a sequence is decode's, whose
 * products take it). stderr: nothing, or the one line saying oneDNN has no bf16 product here. */
static void test_prefill_products(void) {
    char *dir = make_temp_dir(), one_token[4200];
    snprintf(one_token, sizeof one_token, "%s", join(dir, "one-token.txt"));
    write_text_file(one_token, "5\n7\n");
    for (int int8 = 0; int8 < 2; int8++)
        for (int batch = 0; batch <= 5; batch += batch ? 4 : 1) { /* 0: the one-token prompts */
            const char *args[] = {"--model", tiny_dir, "--prompt-ids", batch ? tiny_prompts : one_token, "--gen-len", "2",
                                  "--quiet", "--device", "cpu", "--json", "--gpu-batch-size", batch == 5 ? "5" : "1",
                                  int8 ? "--compress-weight" : "--bf16-prefill", int8 ? "--int8-activations" : NULL, NULL};
            char *out, *err;
            int rc = run_flexgen(args, NULL, &out, &err);
            cJSON *o = cJSON_Parse(out);
            const char *path = json_text(o, "prefill_products");
            int onednn = !strncmp(path, "onednn ", 7), named;
            /* int8: W's columns kept with the weights (the tiny model's plan has room for them) */
            const char *ours = fg_cpu_has_avx2() ? "avx2 (exact int16 pairs), W kept" : "portable, W kept";
            if (batch == 0)
                named = !strcmp(path, "none ran");
            else if (int8) /* oneDNN's kernels are all exact for W in 7 bits: VNNI's, AMX's, AVX2's gemm:jit */
                named = onednn ? !!strstr(path, ", W kept") : !strcmp(path, ours);
            else
                named = onednn || !strcmp(path, "fp32 sgemm of bf16 operands");
            int quiet = !err[0] || (!int8 && strstr(err, "--bf16-prefill") && count_lines(err) == 1);
            EXPECT(rc == 0 && named && quiet, "%s, %s: expected exit 0 and \"prefill_products\" %s, got %d and '%s': %s",
                   int8 ? "--int8-activations" : "--bf16-prefill",
                   batch == 0 ? "one-token prompts" : batch == 1 ? "one prompt a GPU batch" : "five a GPU batch",
                   batch == 0 ? "\"none ran\"" : "a path that ran", rc, path, err);
            cJSON_Delete(o);
            free(out), free(err);
        }
#ifdef FLEXGEN_ONEDNN
    /* oneDNN held to AVX2 has no bf16 product, whatever the CPU: the line names the cap */
    char *saved = env_put("ONEDNN_MAX_CPU_ISA", "AVX2"), *out, *err;
    int rc = run_flexgen(ARGS("--model", tiny_dir, "--prompt-ids", tiny_prompts, "--gen-len", "2", "--quiet", "--device",
                              "cpu", "--gpu-batch-size", "5", "--bf16-prefill"), NULL, &out, &err);
    env_restore("ONEDNN_MAX_CPU_ISA", saved);
    EXPECT(rc == 0 && count_lines(err) == 1 && strstr(err, "--bf16-prefill: oneDNN held to ONEDNN_MAX_CPU_ISA=AVX2"),
           "--bf16-prefill under ONEDNN_MAX_CPU_ISA=AVX2: expected exit 0 and one line naming the cap, got %d: %s", rc,
           err);
    free(out), free(err);
#endif
    rm_tree(dir);
    free(dir);
}

void add_cli_tests(void) {
    CU_pSuite s = CU_add_suite("cli", cli_init, NULL);
    CU_add_test(s, "bad flag values exit 2 with one line", test_bad_flag_values);
    CU_add_test(s, "bad flag combinations exit 2 with one line", test_bad_flag_combinations);
    CU_add_test(s, "bad --model directory or tokenizer files", test_bad_model_dir);
    CU_add_test(s, "flags a subcommand has no use for are refused", test_flags_of_other_commands);
    CU_add_test(s, "standard output that cannot be written: exit 1, one line", test_stdout_full);
    CU_add_test(s, "standard error closed: the files hold their own bytes only", test_stderr_closed);
    CU_add_test(s, "standard input that cannot be read: exit 2, one line", test_stdin_unreadable);
    CU_add_test(s, "an output that is standard output's or standard error's file is refused",
                test_output_is_a_std_stream);
    CU_add_test(s, "output files take the umask's mode", test_output_modes);
    CU_add_test(s, "an output's name of NAME_MAX bytes is written, a longer one refused", test_output_long_name);
    CU_add_test(s, "bad --prompt-ids files", test_bad_prompt_ids);
    CU_add_test(s, "an output through a symbolic link: the file it names, the link kept", test_output_through_link);
    CU_add_test(s, "a text prompt file of \\r\\n lines: the prompts of \\n lines", test_prompt_file_crlf);
    CU_add_test(s, "prompt too long for the positions", test_prompt_too_long);
    CU_add_test(s, "unwritable --dump-logits leaves no file", test_dump_logits_unwritable);
    CU_add_test(s, "--json run matches the reference", test_json_run_matches_reference);
    CU_add_test(s, "default report lines", test_default_report);
    CU_add_test(s, "--help lists every flag", test_help);
    CU_add_test(s, "every flag in --help is accepted", test_flags_accepted);
    CU_add_test(s, "tokenize", test_tokenize);
    CU_add_test(s, "perplexity: the trained OPT and LLaMA against PyTorch, prefill and decode",
                test_perplexity_matches_pytorch);
    CU_add_test(s, "flexgen perplexity: a sliding window bounds the windows", test_perplexity_sliding_window);
    CU_add_test(s, "flexgen perplexity: a text not in UTF-8 is scored with a note", test_perplexity_text_not_utf8);
    CU_add_test(s, "perplexity: section 5's approximations in prefill and in decode", test_perplexity_approximations);
    CU_add_test(s, "perplexity: top-1 predictions and agreement", test_perplexity_predictions);
    CU_add_test(s, "perplexity: bad input", test_perplexity_bad_input);
    CU_add_test(s, "bad special-token files, a special token past the model's vocab",
                test_tokenizer_special_files);
    CU_add_test(s, "special tokens in text prompts", test_special_tokens_in_prompts);
    CU_add_test(s, "bad policy flags, infeasible plans", test_bad_policy);
    CU_add_test(s, "--device cuda|cpu|auto", test_device);
    CU_add_test(s, "offload dir empty after runs, full disk is an error", test_offload_dir_left_empty);
    CU_add_test(s, "an output on a device full before the run: said before it", test_output_on_device_full_before_run);
    CU_add_test(s, "Ctrl-C leaves no files", test_sigint_leaves_no_files);
    CU_add_test(s, "signals: no output temporaries, a truncated checkpoint named", test_signals_leave_no_files);
    CU_add_test(s, "signals ignored by the parent (nohup) stay ignored", test_ignored_signals_stay_ignored);
    CU_add_test(s, "an output on a full device: named, no temporary left", test_output_on_full_device);
    CU_add_test(s, "a run's --dump-logits and --trace: both or neither", test_run_files_both_or_neither);
    CU_add_test(s, "a file size limit is a full disk, not SIGXFSZ's kill", test_file_size_limit_is_a_full_disk);
    CU_add_test(s, "an address-space limit too small for OpenBLAS: one line, not a hang", test_address_space_limit);
    CU_add_test(s, "damaged dummy weights are found and written again", test_damaged_weight_file);
    CU_add_test(s, "dummy weights kept without O_TMPFILE, reused a layer at a time in memory", test_weight_file_kept);
    CU_add_test(s, "a new file named after another run took its folders away",
                test_new_file_named_after_its_folder_went);
    CU_add_test(s, "a temporary a killed run left is removed as the next is made", test_dead_partial_removed);
    CU_add_test(s, "--trace writes a Chrome trace with a track per thread", test_trace);
    CU_add_test(s, "sampling is reproducible from --seed", test_sampling_is_seeded);
    CU_add_test(s, "greedy ignores --seed", test_greedy_ignores_seed);
    CU_add_test(s, "--stop-at-eos", test_stop_at_eos);
    CU_add_test(s, "text in, text out with the checkpoint's tokenizer", test_text_generation);
    CU_add_test(s, "portable (non-SIMD) paths match the reference", test_portable_paths_match_reference);
    CU_add_test(s, "flexgen policy: --json, text and --evaluate", test_policy_command);
    CU_add_test(s, "the LLaMA family: named sizes plan, a checkpoint runs, a bad config.json is refused",
                test_llama_family);
    CU_add_test(s, "a LLaMA directory's tokenizer.json: --prompt, tokenize, refusals", test_llama_tokenizer_json);
    CU_add_test(s, "the LLaMA family: an eos list, --stop-at-eos refilled, --policy auto, sparse attention",
                test_llama_runtime_features);
    CU_add_test(s, "--policy auto runs the fixture to the reference", test_policy_auto_run);
    CU_add_test(s, "policy search bad input: one line each", test_policy_bad_input);
    CU_add_test(s, "flexgen profile writes a hardware file", test_profile);
    CU_add_test(s, "OpenBLAS's core: the decision over a table", test_blas_core_decision);
    CU_add_test(s, "OpenBLAS's core: a low pick starts flexgen again, once, on the better core", test_blas_core_restart);
    CU_add_test(s, "OpenBLAS's core: the user's OPENBLAS_CORETYPE is kept and reported", test_blas_core_user);
    CU_add_test(s, "OpenBLAS's core this CPU cannot run or that is none, OpenMP's threads far past the CPUs: refused",
                test_blas_core_refused);
    CU_add_test(s, "--int8-activations and --bf16-prefill: a sequence's logits in GPU batches of up to 64",
                test_schemes_batch_invariant);
    CU_add_test(s, "FLEXGEN_ISA: every path to the same logits (fp16, 4-bit, int8), named in the report; bad names refused",
                test_isa_paths);
    CU_add_test(s, "--bf16-prefill, --int8-activations: the report names the path prefill's products took, or none",
                test_prefill_products);
}
