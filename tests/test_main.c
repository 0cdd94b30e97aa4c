/* test_main.c: runs every CUnit suite of `make test` and prints CUnit's run summary. */
#define _GNU_SOURCE
#include "tests.h"

#include <stdarg.h>

#include <CUnit/Basic.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

const char *fixture(const char *rel) {
    static char path[4096];
    const char *dir = getenv("FG_FIXTURES");
    snprintf(path, sizeof path, "%s/%s", dir ? dir : "tests/fixtures", rel);
    return path;
}

char *make_temp_dir(void) {
    const char *tmp = getenv("TMPDIR");
    char *dir = malloc(4096);
    snprintf(dir, 4096, "%s/flexgen-test-XXXXXX", tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) { free(dir); return NULL; }
    return dir;
}

float test_uniform(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL; /* Knuth's MMIX LCG */
    return (float)(*s >> 40) / (float)(1 << 24);
}

void fixture_prompts_open(const char *name, int n, fixture_prompts *f) {
    char path[4200], line[4096], err[FG_ERR_LEN];
    memset(f, 0, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "%s", fixture(name));
    snprintf(path, sizeof path, "%s/config.json", f->dir);
    CU_ASSERT_EQUAL_FATAL(opt_config_from_json(path, &f->cfg, err), 0);
    f->n = n;
    f->prompts = calloc((size_t)n, sizeof *f->prompts);
    f->lens = calloc((size_t)n, sizeof *f->lens);
    snprintf(path, sizeof path, "%s/prompts.txt", f->dir);
    FILE *in = fopen(path, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(in);
    int read = 0;
    for (; read < n && fgets(line, sizeof line, in); read++) {
        f->prompts[read] = malloc(64 * sizeof(int));
        for (char *s = strtok(line, " \n"); s && f->lens[read] < 64; s = strtok(NULL, " \n"))
            f->prompts[read][f->lens[read]++] = atoi(s);
    }
    fclose(in);
    CU_ASSERT_FATAL(read > 0);
    for (int p = read; p < n; p++) { /* fewer lines: cycle them */
        f->lens[p] = f->lens[p % read];
        f->prompts[p] = malloc(64 * sizeof(int));
        memcpy(f->prompts[p], f->prompts[p % read], f->lens[p] * sizeof(int));
    }
}

void fixture_prompts_close(fixture_prompts *f) {
    for (int p = 0; p < f->n; p++) free(f->prompts[p]);
    free(f->prompts);
    free(f->lens);
}

const char *join(const char *dir, const char *name) {
    static char paths[4][4200];
    static int next;
    char *path = paths[next++ % 4];
    CU_ASSERT_FATAL(snprintf(path, sizeof paths[0], "%s/%s", dir, name) < (int)sizeof paths[0]);
    return path;
}

char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t n = 0, cap = 0, got;
    do {
        if (n + 4096 > cap) buf = realloc(buf, cap = 2 * cap + 4096 + 1);
        got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
    } while (got > 0);
    fclose(f);
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

int dir_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

void rm_tree(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

int run_bounded(int (*fn)(void *arg, char *err), void *arg, int seconds, char *err) {
    int fds[2];
    if (pipe(fds)) abort();
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) abort();
    if (pid == 0) {
        close(fds[0]);
        alarm((unsigned)seconds);
        char line[FG_ERR_LEN] = "";
        int rc = fn(arg, line);
        _exit(write(fds[1], &rc, sizeof rc) == sizeof rc && write(fds[1], line, sizeof line) == sizeof line ? 0 : 1);
    }
    close(fds[1]);
    int rc = -2, status = 0;
    char line[FG_ERR_LEN];
    int got = read(fds[0], &rc, sizeof rc) == sizeof rc && read(fds[0], line, sizeof line) == sizeof line;
    close(fds[0]);
    waitpid(pid, &status, 0);
    if (got && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        snprintf(err, FG_ERR_LEN, "%s", line);
        return rc;
    }
    snprintf(err, FG_ERR_LEN, "the call did not finish in %d s (status %#x)", seconds, status);
    return -2;
}

void expect_(int ok, const char *file, unsigned line, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    CU_assertImplementation(ok ? CU_TRUE : CU_FALSE, line, msg, file, "", CU_FALSE);
}

const fg_backend *cuda_sized_backend(void) {
    static fg_backend b;
    b = *fg_cpu_fp16_backend();
    b.gpu_is_host = 0, b.reads_q4 = 0, b.act_elem = FG_CUDA_ACT_ELEM;
    b.workspace_bytes = fg_cuda_workspace_bytes, b.delegated_bytes = fg_cuda_delegated_bytes;
    b.device_reserve = FG_CUDA_RESERVE, b.host_reserve = FG_CUDA_HOST_RESERVE;
    return &b;
}

/* generate() with `opt` on a checkpoint dir or dummy weights: generate_with and generate_forced. */
static int generate_opt(const char *dir, const opt_config *cfg, uint64_t seed, const fg_policy *p,
                        const gen_options *opt, int n, int *const *prompts, const int *lens, int *tokens,
                        float *logits, fg_stats *stats, char *err_out) {
    char err[FG_ERR_LEN] = "";
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    gen_timing t;
    int rc = fg_runtime_open(p, &rt, err);
    if (rc == 0) rc = dir ? fg_model_open(rt, dir, seed, &m, err) : fg_model_open_dummy(rt, cfg, seed, &m, err);
    if (rc == 0) rc = generate(m, opt, n, prompts, lens, tokens, logits, &t, err);
    if (rc && err_out) snprintf(err_out, FG_ERR_LEN, "%s", err);
    else if (rc) fprintf(stderr, "\n  generate_with: %s\n", err);
    fg_model_close(m);
    if (stats && rt) fg_runtime_stats(rt, stats);
    fg_runtime_close(rt);
    return rc;
}

int generate_with(const char *dir, const opt_config *cfg, uint64_t seed, const fg_policy *p,
                  int gen_len, int n, int *const *prompts, const int *lens, int *tokens,
                  float *logits, fg_stats *stats, char *err_out) {
    gen_options opt = {.gen_len = gen_len, .top_p = 1};
    return generate_opt(dir, cfg, seed, p, &opt, n, prompts, lens, tokens, logits, stats, err_out);
}

int generate_forced(const char *dir, const fg_policy *p, int gen_len, int n, int *const *prompts,
                    const int *lens, const int *forced, int *tokens, float *logits, fg_stats *stats,
                    char *err_out) {
    gen_options opt = {.gen_len = gen_len, .top_p = 1, .forced = forced};
    return generate_opt(dir, NULL, 0, p, &opt, n, prompts, lens, tokens, logits, stats, err_out);
}

void arglist_add(arglist *a, const char *const *args) {
    for (int i = 0; args && args[i]; i++) {
        CU_ASSERT_FATAL(a->n < ARGLIST_MAX - 1);
        a->v[a->n++] = args[i];
    }
    a->v[a->n] = NULL;
}

int main(int argc, char **argv) {
    if (CU_initialize_registry() != CUE_SUCCESS) return 1;
#ifdef FLEXGEN_CUDA_EMU /* the emulated GPU's binary: its suites alone (the others run natively) */
    add_emu_tests();
    add_kernel_tests();
    add_cuda_tests();
    add_gpu_cli_tests();
#else
    add_tokenizer_tests();
    add_tokenizer_json_tests();
    add_model_tests();
    add_checkpoint_tests();
    add_cli_tests();
    add_job_tests();
    add_runtime_tests();
    add_schedule_tests();
    add_quant_tests();
    add_matmul_tests();
    add_compress_tests();
    add_lp_tests();
    add_cost_tests();
    add_policy_tests();
    add_cuda_tests();
    add_gpu_cli_tests();
#ifdef FLEXGEN_CUDA
    add_kernel_tests();
#endif
    add_pipeline_tests();
#endif
    CU_basic_set_mode(CU_BRM_VERBOSE);
    CU_pSuite only = argc > 1 ? CU_get_suite(argv[1]) : NULL; /* one suite, by its name */
    if (argc > 1 && !only) {
        fprintf(stderr, "%s: no such suite; the suites:", argv[1]);
        for (CU_pSuite s = CU_get_registry()->pSuite; s; s = s->pNext) fprintf(stderr, " %s", s->pName);
        fprintf(stderr, "\n");
        return 2;
    }
    CU_pTest test = only && argc > 2 ? CU_get_test(only, argv[2]) : NULL; /* one test of it, by its name */
    if (argc > 2 && !test) {
        fprintf(stderr, "%s: no such test in suite %s\n", argv[2], argv[1]);
        return 2;
    }
    if (test) CU_basic_run_test(only, test);
    else if (only) CU_basic_run_suite(only);
    else CU_basic_run_tests();
    unsigned failed = CU_get_number_of_failures() + CU_get_number_of_tests_failed();
    unsigned run = CU_get_number_of_tests_run();
    CU_cleanup_registry();
    return (failed == 0 && run > 0) ? 0 : 1;
}
