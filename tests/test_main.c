/* test_main.c: the CUnit suites of `make test`, each run in a process of its own so that a crash
 * hides nothing else, and the instruction-set matrix: the suites that reach a product run again
 * with each lower level forced (our kernels, oneDNN's, OpenBLAS's), as a machine without this
 * one's instructions runs them. Also the helpers the suites share (tests.h). */
#define _GNU_SOURCE
#include "tests.h"

#include <stdarg.h>

#include <CUnit/CUnit.h>
#include <cblas.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
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
    CU_ASSERT_EQUAL_FATAL(model_config_from_json(path, &f->cfg, err), 0);
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

/* setenv, or unsetenv where value is NULL; returns the value before (malloc'd; NULL: unset), for
 * env_restore. */
char *env_put(const char *name, const char *value) {
    const char *was = getenv(name);
    char *saved = was ? strdup(was) : NULL;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
    return saved;
}

void env_restore(const char *name, char *saved) {
    free(env_put(name, saved));
    free(saved);
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
    b.gpu_is_host = 0, b.reads_q4 = 1, b.act_elem = FG_CUDA_ACT_ELEM;
    b.workspace_bytes = fg_cuda_workspace_bytes, b.delegated_bytes = fg_cuda_delegated_bytes;
    b.device_reserve = FG_CUDA_RESERVE, b.host_reserve = FG_CUDA_HOST_RESERVE;
    return &b;
}

/* generate() with `opt` on a checkpoint dir or dummy weights: generate_with and generate_forced. */
static int generate_opt(const char *dir, const model_config *cfg, uint64_t seed, const fg_policy *p,
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

int generate_with(const char *dir, const model_config *cfg, uint64_t seed, const fg_policy *p,
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

/* ============================================================================================
 * Running the suites
 *
 *   test_flexgen                   every suite, each in a process of its own
 *   test_flexgen --matrix          the same, then the instruction-set matrix (below)
 *   test_flexgen --matrix-only     the matrix alone
 *   test_flexgen SUITE [TEST...]   one suite, or those tests of it, in this process; a TEST that
 *                                  ends in * stands for every test whose name starts so
 *
 * A suite's process is this binary again, given the suite's name (and its tests' where not all
 * run) and FLEXGEN_TEST_REPORT=FILE, to which it adds a line as each test starts and as it ends,
 * and one a failed check. So the parent learns which test a crash (or a sanitizer's report) ended, counts that test
 * failed, names the signal or the exit status, and starts the suite again after it: a crash hides
 * neither the other suites nor the rest of its own. Each suite ends with a line of its counts and
 * seconds; the run ends with a recap of them, each failed check named again under its suite (a
 * long run's log may keep only its end), and a last line `N passed, N failed` (counting tests). A test that
 * calls test_skip (no GPU, no MPI) ends "skipped", is counted apart (its end record's 2) and named on the line
 * before the last. FLEXGEN_TEST_TALLY=FILE adds the three numbers to FILE instead of those lines, for make
 * test's total over both test binaries.
 * ============================================================================================ */

static int report_fd = -1;                       /* a suite's process: FLEXGEN_TEST_REPORT */
static unsigned tests_passed, tests_failed;      /* this process's tests */
static unsigned tests_skipped;                   /* ... those that ran nothing (test_skip) */
static double test_started;                      /* when the running test started (now_s) */
static char skip_why[200];                       /* the running test's test_skip reason */

void test_skip(const char *why) {
    if (!skip_why[0]) snprintf(skip_why, sizeof skip_why, "%s", why && *why ? why : "skipped");
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...) {
    if (report_fd < 0) return;
    char line[600];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0 && write(report_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1) < 0)
        perror("FLEXGEN_TEST_REPORT");
}

static int test_index(CU_pSuite suite, CU_pTest test) {
    int i = 0;
    for (CU_pTest t = suite->pTest; t && t != test; t = t->pNext) i++;
    return i;
}

static const char *status_text(int status) { /* "signal 6 (Aborted)", "exit status 1" (static) */
    static char text[80];
    if (WIFSIGNALED(status))
        snprintf(text, sizeof text, "signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        snprintf(text, sizeof text, "exit status %d", WEXITSTATUS(status));
    return text;
}

/* The paths that ran (FLEXGEN_TEST_PATHS, which the matrix sets): the report's after each test, so
 * that a test that ends its process leaves those of the tests before it, and printed at the end. */
static void report_paths(int print) {
    char line[600];
    snprintf(line, sizeof line, "kernels %s, int8 sums %s, int8 rounding %s, gemm_s8 %s, gemm_bf16 %s, OpenBLAS %s",
             matmul_path(), matmul_int8_path(), int8_rounding_path(), gemm_path(0), gemm_path(1),
             openblas_get_corename());
    if (print) printf("  ran on: %s\n", line);
    report("paths %s\n", line);
}

/* A failure's record in the report: "fail K FILE:LINE CONDITION", the condition on one line and
 * cut short, so that the recap at the end of a long run names what failed. */
static void report_failure(int test, const char *file, unsigned line, const char *condition) {
    char text[300];
    snprintf(text, sizeof text, "%s", condition);
    for (char *c = text; *c; c++)
        if (*c == '\n' || *c == '\r') *c = ' ';
    report("fail %d %s:%u %s\n", test, file, line, text);
}

/* CUnit's own verbose lines ("  Test: NAME ...passed", with the seconds it took), and the records
 * of the report. */
static void on_test_start(const CU_pTest test, const CU_pSuite suite) {
    printf("  Test: %s ...", test->pName);
    skip_why[0] = 0;
    report("start %d\n", test_index(suite, test));
    test_started = now_s();
}

static void on_test_complete(const CU_pTest test, const CU_pSuite suite, const CU_pFailureRecord failures) {
    if (!failures && skip_why[0]) {
        tests_skipped++;
        printf("skipped: %s\n", skip_why);
    } else if (!failures) {
        tests_passed++;
        printf("passed (%.1f s)\n", now_s() - test_started);
    } else {
        tests_failed++;
        printf("FAILED (%.1f s)\n", now_s() - test_started);
        int k = 1;
        for (CU_pFailureRecord f = failures; f; f = f->pNext) {
            const char *file = f->strFileName ? f->strFileName : "";
            const char *condition = f->strCondition ? f->strCondition : "";
            printf("    %d. %s:%u  - %s\n", k++, file, f->uiLineNumber, condition);
            report_failure(test_index(suite, test), file, f->uiLineNumber, condition);
        }
    }
    report("end %d %d\n", test_index(suite, test), failures ? 1 : skip_why[0] ? 2 : 0); /* 2: skipped */
    if (report_fd >= 0 && getenv("FLEXGEN_TEST_PATHS")) report_paths(0);
}

static void on_suite_init_failure(const CU_pSuite suite) {
    unsigned active = 0;
    for (CU_pTest t = suite->pTest; t; t = t->pNext) active += t->fActive != CU_FALSE;
    tests_failed += active;
    printf("  Suite %s: its initialization failed, so its %u tests did not run\n", suite->pName, active);
    report("init-failed\n");
}

static void on_suite_cleanup_failure(const CU_pSuite suite) {
    tests_failed++;
    printf("  Suite %s: its cleanup failed\n", suite->pName);
    report("cleanup-failed\n");
}

/* Whether `name` names the test: its whole name, or (ending in *) the start of it. */
static int names_test(const char *name, const char *test) {
    size_t n = strlen(name);
    return n > 0 && name[n - 1] == '*' ? !strncmp(test, name, n - 1) : !strcmp(test, name);
}

/* The tests of suite that names[0..n) select (n 0: all of them), in this process. Returns 2 where a
 * name selects none. */
static int run_here(CU_pSuite suite, char **names, int n) {
    for (int i = 0; i < n; i++) {
        int found = 0;
        for (CU_pTest t = suite->pTest; t && !found; t = t->pNext) found = names_test(names[i], t->pName);
        if (!found) {
            fprintf(stderr, "%s: no such test in suite %s\n", names[i], suite->pName);
            return 2;
        }
    }
    for (CU_pTest t = suite->pTest; n && t; t = t->pNext) {
        int wanted = 0;
        for (int i = 0; i < n && !wanted; i++) wanted = names_test(names[i], t->pName);
        CU_set_test_active(t, wanted ? CU_TRUE : CU_FALSE);
    }
    setvbuf(stdout, NULL, _IONBF, 0); /* what a crash leaves is on the screen */
    CU_set_fail_on_inactive(CU_FALSE);
    CU_set_test_start_handler(on_test_start);
    CU_set_test_complete_handler(on_test_complete);
    CU_set_suite_init_failure_handler(on_suite_init_failure);
    CU_set_suite_cleanup_failure_handler(on_suite_cleanup_failure);
    printf("\nSuite: %s\n", suite->pName);
    CU_run_suite(suite);
    if (getenv("FLEXGEN_TEST_PATHS")) report_paths(1);
    return 0;
}

/* One suite's run (a suite, or a cell's suite): its counts, time and what went wrong. */
typedef struct {
    char name[40], env[160], paths[600], trouble[400];
    char failures[6][240]; /* the first failed checks: the test, where, what (cut short) */
    unsigned n_failures;     /* all of them */
    unsigned passed, failed, skipped;
    double seconds, cpu_seconds; /* wall clock; user and system time of its processes, all told */
} outcome;

enum { MAX_OUTCOMES = 120, MAX_TESTS = 100 };
static outcome outcomes[MAX_OUTCOMES];
static int n_outcomes;

static void add_trouble(outcome *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_trouble(outcome *o, const char *fmt, ...) {
    size_t used = strlen(o->trouble);
    if (used && used + 2 < sizeof o->trouble) strcat(o->trouble, "; "), used += 2;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->trouble + used, sizeof o->trouble - used, fmt, ap);
    va_end(ap);
}

/* A command line as a shell takes it: the environment's changes, then the arguments. */
static void print_command(const char *env, char *const *argv) {
    printf("%s%s%s", env, *env ? " " : "", argv[0]);
    for (int i = 1; argv[i]; i++) {
        if (strpbrk(argv[i], " '*|&;()<>$\"\\")) {
            printf(" '");
            for (const char *c = argv[i]; *c; c++) printf(*c == '\'' ? "'\\''" : "%c", *c);
            printf("'");
        } else {
            printf(" %s", argv[i]);
        }
    }
    printf("\n");
}

/* Runs the tests of suite that names (NULL-terminated; NULL or empty: all) select in processes of
 * this binary, with env (space-separated NAME=VALUE) added to the environment: one process, and
 * one more after each test that ends its process, from the next test on. */
static void run_in_children(const char *argv0, CU_pSuite suite, const char *env, const char *const *names,
                            int paths) {
    if (n_outcomes == MAX_OUTCOMES) abort();
    outcome *o = &outcomes[n_outcomes++];
    memset(o, 0, sizeof *o);
    snprintf(o->name, sizeof o->name, "%s", suite->pName);
    snprintf(o->env, sizeof o->env, "%s", env);
    CU_pTest tests[MAX_TESTS];
    int n = 0, wanted[MAX_TESTS], done[MAX_TESTS] = {0};
    for (CU_pTest t = suite->pTest; t; t = t->pNext) {
        if (n == MAX_TESTS) abort();
        wanted[n] = !names || !names[0];
        for (int i = 0; names && names[i] && !wanted[n]; i++) wanted[n] = names_test(names[i], t->pName);
        tests[n++] = t;
    }
    for (int i = 0; names && names[i]; i++) { /* a selection that names no test fails the run */
        int found = 0;
        for (int k = 0; k < n && !found; k++) found = names_test(names[i], tests[k]->pName);
        if (!found) {
            o->failed++;
            add_trouble(o, "no test of %s is named '%s'", suite->pName, names[i]);
        }
    }
    char *dir = make_temp_dir(), report_path[4200];
    if (!dir) abort();
    snprintf(report_path, sizeof report_path, "%s/report", dir);
    double t0 = now_s();
    for (int first = 1;; first = 0) {
        char *argv[MAX_TESTS + 3];
        int argc = 0, left = 0;
        argv[argc++] = (char *)argv0;
        argv[argc++] = (char *)suite->pName;
        for (int k = 0; k < n; k++) left += wanted[k] && !done[k];
        if (!left) break;
        if (first) {
            for (int i = 0; names && names[i]; i++) argv[argc++] = (char *)names[i];
        } else {
            for (int k = 0; k < n; k++)
                if (wanted[k] && !done[k]) argv[argc++] = (char *)tests[k]->pName;
        }
        argv[argc] = NULL;
        if (*env || !first) print_command(env, argv);
        unlink(report_path);
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) abort();
        if (pid == 0) {
            char vars[sizeof o->env];
            snprintf(vars, sizeof vars, "%s", env);
            for (char *save, *v = strtok_r(vars, " ", &save); v; v = strtok_r(NULL, " ", &save)) {
                char *eq = strchr(v, '=');
                *eq = 0;
                setenv(v, eq + 1, 1);
            }
            setenv("FLEXGEN_TEST_REPORT", report_path, 1);
            if (paths) setenv("FLEXGEN_TEST_PATHS", "1", 1);
            else unsetenv("FLEXGEN_TEST_PATHS");
            unsetenv("FLEXGEN_TEST_TALLY");
            execv("/proc/self/exe", argv);
            fprintf(stderr, "%s: cannot start itself again: %s\n", argv0, strerror(errno));
            _exit(127);
        }
        int status = 0;
        struct rusage usage;
        while (wait4(pid, &status, 0, &usage) < 0 && errno == EINTR) {}
        o->cpu_seconds += (double)usage.ru_utime.tv_sec + 1e-6 * (double)usage.ru_utime.tv_usec +
                          (double)usage.ru_stime.tv_sec + 1e-6 * (double)usage.ru_stime.tv_usec;
        char *records = slurp(report_path, NULL), *save = NULL;
        int open_test = -1, init_failed = 0, failed_here = 0;
        for (char *line = records ? strtok_r(records, "\n", &save) : NULL; line; line = strtok_r(NULL, "\n", &save)) {
            int k, f, at = 0;
            if (sscanf(line, "start %d", &k) == 1 && k >= 0 && k < n) {
                open_test = k;
            } else if (sscanf(line, "end %d %d", &k, &f) == 2 && k >= 0 && k < n) {
                open_test = -1;
                done[k] = 1;
                if (f == 1) o->failed++, failed_here++;
                else if (f == 2) o->skipped++;
                else o->passed++;
            } else if (sscanf(line, "fail %d %n", &k, &at) == 1 && at > 0 && k >= 0 && k < n) {
                if (o->n_failures < sizeof o->failures / sizeof *o->failures)
                    snprintf(o->failures[o->n_failures], sizeof o->failures[0], "'%s' %s", tests[k]->pName, line + at);
                o->n_failures++;
            } else if (!strncmp(line, "paths ", 6)) {
                snprintf(o->paths, sizeof o->paths, "%s", line + 6);
            } else if (!strcmp(line, "init-failed")) {
                init_failed = 1;
            } else if (!strcmp(line, "cleanup-failed")) {
                o->failed++, failed_here++;
                add_trouble(o, "its cleanup failed");
            }
        }
        free(records);
        int clean = WIFEXITED(status) && WEXITSTATUS(status) == (failed_here ? 1 : 0); /* run_here's status */
        if (open_test >= 0) { /* a test ended its process: count it, and go on after it */
            done[open_test] = 1;
            o->failed++;
            add_trouble(o, "'%s' ended its process: %s", tests[open_test]->pName, status_text(status));
            printf("\n-- %s: '%s' ended its process (%s); the tests after it go on in a new one\n", suite->pName,
                   tests[open_test]->pName, status_text(status));
            continue;
        }
        left = 0;
        for (int k = 0; k < n; k++) left += wanted[k] && !done[k];
        if (init_failed) {
            o->failed += (unsigned)left;
            add_trouble(o, "its initialization failed");
        } else if (left) {
            o->failed += (unsigned)left;
            add_trouble(o, "its process ended before %d of its tests ran: %s", left, status_text(status));
        } else if (!clean) {
            o->failed++; /* e.g. the leak check at exit */
            add_trouble(o, "its process ended with %s after its tests", status_text(status));
        }
        break;
    }
    o->seconds = now_s() - t0;
    rm_tree(dir);
    free(dir);
    char skipped[32] = "";
    if (o->skipped) snprintf(skipped, sizeof skipped, ", %u skipped", o->skipped);
    printf("-- %s%s%s: %u passed, %u failed%s, %.1f s (%.1f s of CPU)%s%s\n", o->env, *o->env ? ": " : "", o->name,
           o->passed, o->failed, skipped, o->seconds, o->cpu_seconds, *o->trouble ? "; " : "", o->trouble);
}

/* ============================================================================================
 * The instruction-set matrix
 *
 * The machines here have AVX-512 with VNNI, BF16 and AMX; users' have less. Each cell runs the
 * tests that reach the products again with lower levels forced, in processes of their own (the
 * libraries read their variables once): FLEXGEN_ISA for our kernels (util.c), ONEDNN_MAX_CPU_ISA
 * for oneDNN's (the prefill schemes' gemm_s8 and gemm_bf16), OPENBLAS_CORETYPE for OpenBLAS's
 * (the fp32 products). A cell is skipped where its level is this CPU's own, which the suites
 * have just run, or one it cannot run. After each suite the cell's process names the paths that
 * ran. A cell by hand is its header's command: `ONEDNN_MAX_CPU_ISA=AVX2 ./build/test_flexgen
 * matmul 'gemm_s8*'`.
 * ============================================================================================ */

typedef struct {
    const char *suite;
    const char *tests[6]; /* NULL-terminated; none: the whole suite */
} selection;

/* What every product reaches: the products themselves, the prefill schemes and 4-bit weights end
 * to end (and the path each scheme names in the report), the forward pass against HF transformers,
 * perplexity against PyTorch (prefill's fp32 products and decode's), and every test that compares
 * bits across paths or threads. */
static const selection ALL_PRODUCTS[] = {
    {"matmul", {NULL}},
    {"compress", {"--compress-weight computes*", "--int8-activations*", "--bf16-prefill*", NULL}},
    {"model", {NULL}},
    {"cli", {"perplexity: the trained*", "perplexity: section 5*", "FLEXGEN_ISA*", "portable (non-SIMD)*",
             "--bf16-prefill, --int8-activations: the report*", NULL}},
    {"jobs", {"a job resumed on another FLEXGEN_ISA*", NULL}},
};
/* What OpenBLAS's core changes: whether the threads change a bit, of a product and of a job. */
static const selection THREAD_BITS[] = {
    {"matmul", {"prefill and lm_head*", NULL}},
    {"cli", {"FLEXGEN_ISA*", NULL}},
};
/* Our kernels alone, whose portable and SIMDe paths are slow: the products, the prefill schemes
 * end to end, and the forward pass against HF on OPT (pre-LN, and the trained checkpoint) and
 * LLaMA (MQA with biases), in prefill at every position and in decode against recomputation. */
static const selection KERNELS[] = {
    {"matmul", {NULL}},
    {"compress", {"--int8-activations*", "--bf16-prefill*", NULL}},
    {"model", {"pre-LN*", "the trained checkpoint*", "LLaMA, MQA*", "prefill's logits*", "KV-cache decode*", NULL}},
};
/* oneDNN's products alone: gemm_s8 and gemm_bf16, and the prefill schemes on them. */
static const selection ONEDNN[] = {
    {"matmul", {"gemm_s8*", "gemm_bf16*", "int8 prefill*", "bf16 prefill*", NULL}},
    {"compress", {"--int8-activations*", "--bf16-prefill*", NULL}},
};

/* Whether the first CPU's flags in /proc/cpuinfo hold every one of `names` (space-separated). */
static int cpu_flags_have(const char *names) {
    static char *flags;
    if (!flags) {
        char *info = slurp("/proc/cpuinfo", NULL), *line = info ? strstr(info, "\nflags") : NULL;
        char *colon = line ? strchr(line, ':') : NULL, *end = colon ? strchr(colon, '\n') : NULL;
        size_t len = colon ? (end ? (size_t)(end - colon) : strlen(colon)) : 0;
        flags = calloc(len + 2, 1);
        if (len) memcpy(flags, colon + 1, len - 1), strcat(flags, " ");
        free(info);
    }
    char want[200];
    snprintf(want, sizeof want, "%s", names);
    for (char *save, *w = strtok_r(want, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
        char word[64];
        snprintf(word, sizeof word, " %s ", w);
        if (!strstr(flags, word)) return 0;
    }
    return 1;
}

/* oneDNN's levels (ONEDNN_MAX_CPU_ISA), lowest first, each with the flags it adds. */
static const struct { const char *level, *flags; } ONEDNN_LEVELS[] = {
    {"AVX2", "avx avx2 fma"},
    {"AVX512_CORE", "avx512f avx512bw avx512vl avx512dq"},
    {"AVX512_CORE_VNNI", "avx512_vnni"},
    {"AVX512_CORE_BF16", "avx512_bf16"},
    {"AVX512_CORE_AMX", "amx_tile amx_int8 amx_bf16"},
};
enum { N_ONEDNN_LEVELS = sizeof ONEDNN_LEVELS / sizeof ONEDNN_LEVELS[0] };

static void run_cell(const char *argv0, const char *title, const char *env, const selection *sel, int n_sel) {
    printf("\n== matrix: %s: %s\n", title, env);
    for (int i = 0; i < n_sel; i++) {
        CU_pSuite suite = CU_get_suite(sel[i].suite);
        if (!suite) { /* a suite this binary lacks */
            outcome *o = &outcomes[n_outcomes++];
            memset(o, 0, sizeof *o);
            snprintf(o->name, sizeof o->name, "%s", sel[i].suite);
            snprintf(o->env, sizeof o->env, "%s", env);
            o->failed = 1;
            add_trouble(o, "no such suite");
            continue;
        }
        run_in_children(argv0, suite, env, sel[i].tests, 1);
    }
}

static void run_matrix(const char *argv0) {
    fg_isa cpu = fg_isa_of_cpu();
    int onednn_top = -1;
    for (int i = 0; i < N_ONEDNN_LEVELS && cpu_flags_have(ONEDNN_LEVELS[i].flags); i++) onednn_top = i;
#ifndef FLEXGEN_ONEDNN
    onednn_top = -1; /* no oneDNN in this build: the schemes run their plain loops */
#endif
    const char *blas_core = openblas_get_corename();
    printf("\n== the instruction-set matrix: this CPU runs FLEXGEN_ISA=%s, oneDNN up to %s, OpenBLAS's %s\n",
           fg_isa_name(cpu), onednn_top >= 0 ? ONEDNN_LEVELS[onednn_top].level : "(not built)", blas_core);
    /* A machine with AVX2 and no more: our AVX2 kernels without AVX-512 or either VNNI (the CPU
     * taken to stop at AVX2, FLEXGEN_TEST_CPU: int8 sums on vpmaddubsw, as a laptop's), oneDNN's
     * and OpenBLAS's (Haswell's). */
    char env[160] = "";
    if (cpu > FG_ISA_AVX2 || fg_cpu_features() & FG_CPU_AVXVNNI) strcat(env, " FLEXGEN_TEST_CPU=avx2");
    if (onednn_top > 0) strcat(env, " ONEDNN_MAX_CPU_ISA=AVX2");
    if (cpu >= FG_ISA_AVX2 && strcasecmp(blas_core, "Haswell")) strcat(env, " OPENBLAS_CORETYPE=Haswell");
    if (*env) run_cell(argv0, "an AVX2 machine", env + 1, ALL_PRODUCTS, sizeof ALL_PRODUCTS / sizeof *ALL_PRODUCTS);
    /* OpenBLAS's other cores this CPU can run (a laptop's Haswell is the AVX2 machine's, above;
     * AMD's Zen 1-3 run Zen's), each summing in its own order: none may let the threads change a
     * bit. */
    static const char *const blas_cores[] = {"Zen", "SkylakeX"};
    for (int i = 0; i < 2; i++) {
        int runs = i == 0 ? cpu >= FG_ISA_AVX2 : cpu >= FG_ISA_AVX512;
        if (!runs || !strcasecmp(blas_core, blas_cores[i])) continue;
        snprintf(env, sizeof env, "OPENBLAS_CORETYPE=%s", blas_cores[i]);
        run_cell(argv0, "OpenBLAS's core", env, THREAD_BITS, sizeof THREAD_BITS / sizeof *THREAD_BITS);
    }
    /* oneDNN's levels between AVX2 and this CPU's. */
    for (int i = 1; i < onednn_top; i++) {
        snprintf(env, sizeof env, "ONEDNN_MAX_CPU_ISA=%s", ONEDNN_LEVELS[i].level);
        run_cell(argv0, "oneDNN's level", env, ONEDNN, sizeof ONEDNN / sizeof *ONEDNN);
    }
    /* Our kernels' other paths: the portable C and SIMDe's AVX-512 (AVX2 is the AVX2 machine's,
     * above; this CPU's own, the suites'). */
    for (int isa = FG_ISA_PORTABLE; isa <= FG_ISA_AVX512_SIMDE; isa++) {
        if (isa == (int)cpu || isa == FG_ISA_AVX2 || (isa != FG_ISA_AVX512_SIMDE && isa > (int)cpu)) continue;
        snprintf(env, sizeof env, "FLEXGEN_ISA=%s", fg_isa_name((fg_isa)isa));
        run_cell(argv0, "our kernels' path", env, KERNELS, sizeof KERNELS / sizeof *KERNELS);
    }
}

/* The recap of a run and its last line; returns whether everything passed. */
static int recap(void) {
    unsigned passed = 0, failed = 0, skipped = 0;
    printf("\n== recap: each suite (and matrix cell) in processes of its own\n");
    for (int i = 0; i < n_outcomes; i++) {
        const outcome *o = &outcomes[i];
        passed += o->passed, failed += o->failed, skipped += o->skipped;
        printf("  %-6s %-14s %4u passed %3u failed %6.1f s %6.1f s CPU  %s", o->failed ? "FAILED" : "ok", o->name,
               o->passed, o->failed, o->seconds, o->cpu_seconds, o->env);
        if (o->skipped) printf("%s%u skipped (the suite says why)", *o->env ? "  " : "", o->skipped);
        printf("\n");
        if (*o->paths) printf("         ran on: %s\n", o->paths);
        if (*o->trouble) printf("         %s\n", o->trouble);
        unsigned shown = sizeof o->failures / sizeof *o->failures;
        for (unsigned k = 0; k < o->n_failures && k < shown; k++) printf("         %s\n", o->failures[k]);
        if (o->n_failures > shown) printf("         and %u more failed checks (above)\n", o->n_failures - shown);
    }
    tests_passed += passed, tests_failed += failed, tests_skipped += skipped;
    return failed == 0;
}

/* The run's last line, or its counts added to FLEXGEN_TEST_TALLY's file. */
static void closing_line(const char *argv0) {
    const char *tally = getenv("FLEXGEN_TEST_TALLY");
    FILE *f = tally ? fopen(tally, "a") : NULL;
    if (f) {
        fprintf(f, "%u %u %u\n", tests_passed, tests_failed, tests_skipped);
        fclose(f);
        printf("%s: %u passed, %u failed, %u skipped\n", argv0, tests_passed, tests_failed, tests_skipped);
    } else {
        if (tally) fprintf(stderr, "%s: cannot add to %s: %s\n", argv0, tally, strerror(errno));
        if (tests_skipped) printf("%u skipped (not counted as passed; the suites say why)\n", tests_skipped);
        printf("%u passed, %u failed\n", tests_passed, tests_failed);
    }
}

int main(int argc, char **argv) {
    /* A shell starts a job put in the background (`&`) with SIGINT and SIGQUIT ignored, and a
     * program keeps a stop signal ignored that it began with (support/util.c), as nohup's users
     * want. The tests stop the runs they start with SIGINT and expect them to stop, so the runs
     * begin as from a terminal, whatever started the tests. */
    signal(SIGINT, SIG_DFL);
    signal(SIGQUIT, SIG_DFL);
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
    int matrix = argc > 1 && !strcmp(argv[1], "--matrix"), matrix_only = argc > 1 && !strcmp(argv[1], "--matrix-only");
    int ok;
    if (argc > 1 && !matrix && !matrix_only) { /* one suite, in this process */
        CU_pSuite only = CU_get_suite(argv[1]);
        if (!only) {
            fprintf(stderr, "%s: no such suite; the suites:", argv[1]);
            for (CU_pSuite s = CU_get_registry()->pSuite; s; s = s->pNext) fprintf(stderr, " %s", s->pName);
            fprintf(stderr, "\n");
            return 2;
        }
        const char *path = getenv("FLEXGEN_TEST_REPORT");
        if (path && (report_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600)) < 0) {
            fprintf(stderr, "FLEXGEN_TEST_REPORT=%s: %s\n", path, strerror(errno));
            return 2;
        }
        if (run_here(only, argv + 2, argc - 2)) return 2;
        ok = tests_failed == 0 && tests_passed + tests_skipped > 0;
        if (report_fd < 0) printf("\n");
    } else if (argc > 2) {
        fprintf(stderr, "%s: %s takes no other argument\n", argv[0], argv[1]);
        return 2;
    } else {
        for (CU_pSuite s = CU_get_registry()->pSuite; s && !matrix_only; s = s->pNext)
            run_in_children(argv[0], s, "", NULL, 0);
        if (matrix || matrix_only) run_matrix(argv[0]);
        ok = recap();
    }
    if (report_fd < 0) closing_line(argv[0]);
    CU_cleanup_registry();
    return ok ? 0 : 1;
}
