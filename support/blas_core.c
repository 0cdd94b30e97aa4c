/* support/blas_core.c: the OpenBLAS core that runs the products, and a better one where the
 * library picked a core of an older instruction set than this CPU has; the CPU's instruction
 * sets, which the path of the CPU's own kernels (util.c's fg_isa_of_cpu) is read from too; and
 * the sgemm every product runs, in tiles that make its bits the same on any number of threads.
 *
 * OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels as it loads, from a table of CPU
 * model numbers; a CPU newer than its table gets a fallback, which can be a core of an older
 * instruction set: AVX2 kernels on an AVX-512 CPU, or SSE3 ones (Prescott) on an AVX2 one. It reads
 * OPENBLAS_CORETYPE only as it loads, so ./flexgen's main asks fg_blas_core_force whether a better
 * core is due and, if so, starts itself again with OPENBLAS_CORETYPE naming it
 * (docs/DESIGN.md, "Conventions"). A user's own OPENBLAS_CORETYPE is kept, where this CPU can
 * run that core and OpenBLAS knows it (fg_blas_core_check_env refuses it otherwise).
 */
#define _GNU_SOURCE
#include "support/tools.h"

#include <cblas.h>
#include <fcntl.h>
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <unistd.h>

/* Set beside OPENBLAS_CORETYPE when ./flexgen set it: the core the library had picked. Its
 * presence also stops a second start. */
#define FORCED "FLEXGEN_BLAS_CORE_FORCED"
/* Tests only: the OPENBLAS_CORETYPE given stands for the library's own pick, not a user's. */
#define TEST_LOW "FLEXGEN_TEST_BLAS_LOW"
/* Tests only: FLEXGEN_TEST_CPU=avx2 takes this CPU to stop at AVX2 (no AVX-512, no VNNI), so that
 * what is refused on such a CPU is tested on a wider one. */
#define TEST_CPU "FLEXGEN_TEST_CPU"

#define AVX2_SET (FG_CPU_AVX | FG_CPU_AVX2 | FG_CPU_FMA)
#define AVX512_SET (AVX2_SET | FG_CPU_AVX512F | FG_CPU_AVX512BW | FG_CPU_AVX512DQ | FG_CPU_AVX512VL)

/* The instruction sets, lowest first, each with the core forced for a CPU whose best set it is
 * (names OpenBLAS has known since 0.3.5; 0.3.21 does not take Cooperlake). */
static const struct {
    const char *name, *core;
    unsigned needs;
} LEVELS[] = {
    {"SSE", NULL, 0},
    {"AVX", "Sandybridge", FG_CPU_AVX},
    {"AVX2", "Haswell", AVX2_SET},
    {"AVX-512", "SkylakeX", AVX512_SET},
};
enum { N_LEVELS = sizeof LEVELS / sizeof LEVELS[0] };

/* OpenBLAS's x86 cores, as openblas_get_corename names them, each at the set of the CPUs it is
 * named after (Steamroller and Excavator both run Piledriver's kernels, but only Excavator CPUs,
 * which have AVX2, get Excavator). */
static const struct {
    const char *core;
    int level;
} CORES[] = {
    {"Katmai", 0},       {"Coppermine", 0},     {"Northwood", 0},
    {"Prescott", 0},     {"Banias", 0},         {"Atom", 0},
    {"Core2", 0},        {"Penryn", 0},         {"Dunnington", 0},
    {"Nehalem", 0},      {"Athlon", 0},         {"Opteron", 0},
    {"Opteron_SSE3", 0}, {"Barcelona", 0},      {"Nano", 0},
    {"Bobcat", 0},       {"Sandybridge", 1},    {"Bulldozer", 1},
    {"Piledriver", 1},   {"Steamroller", 1},    {"Haswell", 2},
    {"Zen", 2},          {"Excavator", 2},      {"SkylakeX", 3},
    {"Cooperlake", 3},   {"SapphireRapids", 3},
};

static int core_level(const char *core) { /* -1: a core not in the table */
    for (size_t i = 0; core && i < sizeof CORES / sizeof CORES[0]; i++)
        if (!strcasecmp(core, CORES[i].core)) return CORES[i].level;
    return -1;
}

static int cpu_level(unsigned features) {
    int best = 0;
    for (int i = 1; i < N_LEVELS; i++)
        if ((features & LEVELS[i].needs) == LEVELS[i].needs) best = i;
    return best;
}

unsigned fg_cpu_features(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    unsigned a, b, c = 0, d;
    __get_cpuid(1, &a, &b, &c, &d);
    unsigned a7 = 0, b7, c7, d7; /* AVX-VNNI: leaf 7, subleaf 1, EAX bit 4 (not every compiler's
                                    builtin knows it) */
    int avx_vnni = __get_cpuid_count(7, 1, &a7, &b7, &c7, &d7) && (a7 >> 4 & 1) &&
                   __builtin_cpu_supports("avx2");
    const char *cap = getenv(TEST_CPU);
    return ((__builtin_cpu_supports("avx") ? FG_CPU_AVX : 0u) |
            (__builtin_cpu_supports("avx2") ? FG_CPU_AVX2 : 0u) |
            (__builtin_cpu_supports("fma") ? FG_CPU_FMA : 0u) | (c & bit_F16C ? FG_CPU_F16C : 0u) |
            (__builtin_cpu_supports("avx512f") ? FG_CPU_AVX512F : 0u) |
            (__builtin_cpu_supports("avx512bw") ? FG_CPU_AVX512BW : 0u) |
            (__builtin_cpu_supports("avx512dq") ? FG_CPU_AVX512DQ : 0u) |
            (__builtin_cpu_supports("avx512vl") ? FG_CPU_AVX512VL : 0u) |
            (__builtin_cpu_supports("avx512vnni") ? FG_CPU_AVX512VNNI : 0u) |
            (avx_vnni ? FG_CPU_AVXVNNI : 0u)) &
           (cap && !strcmp(cap, "avx2") ? AVX2_SET | FG_CPU_F16C : ~0u);
#else
    return 0;
#endif
}

const char *fg_blas_core_due(unsigned features, const char *picked, int user_set) {
    int have = cpu_level(features), got = core_level(picked);
    return user_set || got < 0 || got >= have ? NULL : LEVELS[have].core;
}

/* OpenBLAS takes a core it knows whatever the CPU, and its kernels then end the process with
 * SIGILL at the first product, with nothing said (an AVX2 CPU given SkylakeX; later versions
 * also know Cooperlake and SapphireRapids); a name it does not know it passes over, running its
 * own pick, in silence too. So a user's OPENBLAS_CORETYPE is refused where it names a core of a
 * wider instruction set than this CPU has, or a name that is neither a core of the table above
 * nor the one the library runs. */
static int refused(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int refused(char *err, const char *fmt, ...) { /* util.c's fg_fail, which calls into this
                                                         file */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, FG_ERR_LEN, fmt, ap);
    va_end(ap);
    for (char *c = err; *c; c++) /* the variable may hold a newline: keep one line */
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    return -1;
}

int fg_blas_core_check_env(char *err) {
    const char *env = getenv("OPENBLAS_CORETYPE");
    if (!env || getenv(FORCED) || getenv(TEST_LOW))
        return 0; /* ./flexgen's own pick, or the tests' */
    int level = core_level(env), have = cpu_level(fg_cpu_features());
    if (level > have)
        return refused(
            err,
            "OPENBLAS_CORETYPE=%s: its kernels need %s, which this CPU lacks (its best core is %s)",
            env, LEVELS[level].name, LEVELS[have].core ? LEVELS[have].core : "Prescott");
    const char *core = openblas_get_corename();
    if (level < 0 && strcasecmp(env, core))
        return refused(
            err,
            "OPENBLAS_CORETYPE=%s: OpenBLAS has no core of that name (it would run %s); x86's "
            "include Prescott, Nehalem, Sandybridge, Haswell, Zen and SkylakeX",
            env, core);
    return 0;
}

static char *given; /* OPENBLAS_CORETYPE before fg_blas_core_force set it (tests only) */

const char *fg_blas_core_force(void) {
    const char *env = getenv("OPENBLAS_CORETYPE");
    if (getenv(FORCED)) return NULL; /* this is the second start */
    const char *picked = openblas_get_corename();
    const char *core = fg_blas_core_due(fg_cpu_features(), picked, env && !getenv(TEST_LOW));
    if (!core) return NULL;
    given = env ? strdup(env) : NULL;
    setenv(FORCED, picked, 1);
    setenv("OPENBLAS_CORETYPE", core, 1);
    return core;
}

void fg_blas_core_unforce(const char *core, int errnum) {
    fprintf(stderr,
            "flexgen: OpenBLAS stays on %s: starting again with OPENBLAS_CORETYPE=%s failed: %s\n",
            openblas_get_corename(), core, strerror(errnum));
    if (given) setenv("OPENBLAS_CORETYPE", given, 1);
    else unsetenv("OPENBLAS_CORETYPE");
    unsetenv(FORCED);
    free(given);
    given = NULL;
}

void fg_blas_info_get(fg_blas_info *b) {
    const char *core = openblas_get_corename(), *env = getenv("OPENBLAS_CORETYPE");
    const char *picked = getenv(FORCED);
    int words = 0; /* the library: the first two words of its configuration, "OpenBLAS 0.3.21" */
    size_t n = 0;
    for (const char *c = openblas_get_config(); *c && n + 1 < sizeof b->library; c++) {
        if (*c == ' ' && ++words == 2) break;
        b->library[n++] = *c;
    }
    b->library[n] = 0;
    snprintf(b->core, sizeof b->core, "%s", core);
    int level = core_level(core);
    if (picked && env)
        snprintf(b->why, sizeof b->why, "chosen for %s; the library picked %s",
                 level >= 0 ? LEVELS[level].name : "this CPU", picked);
    else if (env && !getenv(TEST_LOW) && !strcasecmp(env, core))
        snprintf(b->why, sizeof b->why, "OPENBLAS_CORETYPE");
    else if (env && !getenv(TEST_LOW))
        snprintf(b->why, sizeof b->why, "OPENBLAS_CORETYPE=%.40s", env);
    else snprintf(b->why, sizeof b->why, "as the library picked");
}

/* ============================================================================================
 * OpenBLAS's start under an address-space limit
 * ============================================================================================ */

/* As it loads, OpenBLAS takes a buffer of BLAS_BUFFER bytes for each of its threads, and where the
 * address space (ulimit -v, RLIMIT_AS) has no room for one it asks again for ever: the program
 * hangs before main, silent. So the executable's pre-initialiser, which the loader runs before
 * any library's own, looks first: where the room left under the limit, past what is already
 * mapped (the libraries), is less than the buffers of OpenBLAS's threads, it says so in one line
 * and exits 2. OpenBLAS's threads: OPENBLAS_NUM_THREADS, else GOTO_NUM_THREADS, else
 * OMP_NUM_THREADS, at most the CPUs this process may run on. (Measured with OpenBLAS 0.3.21: one
 * thread started with 136 MiB of room and hung with 131; two started with 268 and hung with 258;
 * so 144 MiB a thread is asked.) */
enum { BLAS_BUFFER = 144 << 20 }; /* OpenBLAS 0.3's 128 MiB on x86-64, and a margin */

static long env_number(char **envp, const char *name) { /* 0: unset or not a number */
    size_t len = strlen(name);
    for (char **e = envp; e && *e; e++)
        if (!strncmp(*e, name, len) && (*e)[len] == '=') return strtol(*e + len + 1, NULL, 10);
    return 0;
}

static long blas_threads(char **envp) {
    cpu_set_t cpus;
    long have = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    long want = env_number(envp, "OPENBLAS_NUM_THREADS");
    if (want <= 0) want = env_number(envp, "GOTO_NUM_THREADS");
    if (want <= 0) want = env_number(envp, "OMP_NUM_THREADS");
    return want > 0 && want < have ? want : have;
}

static long mapped_bytes(void) { /* the address space in use: /proc/self/statm's first field */
    char text[64] = {0};
    int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    return n > 0 ? strtol(text, NULL, 10) * sysconf(_SC_PAGESIZE) : 0;
}

static void blas_room_check(int argc, char **argv, char **envp) {
    (void)argc;
    (void)argv;
    struct rlimit limit;
    if (getrlimit(RLIMIT_AS, &limit) || limit.rlim_cur == RLIM_INFINITY) return;
    long threads = blas_threads(envp), used = mapped_bytes();
    long room = (long)limit.rlim_cur - used, need = threads * (long)BLAS_BUFFER;
    if (room >= need) return;
    dprintf(2,
            "flexgen: ulimit -v: the address-space limit of %ld MiB leaves %ld MiB past the "
            "libraries, less than the %ld MiB OpenBLAS takes as it starts (%ld thread%s, 144 MiB "
            "each), where it would wait for ever; raise the limit%s\n",
            (long)(limit.rlim_cur >> 20), room > 0 ? room >> 20 : 0, need >> 20, threads,
            threads == 1 ? "" : "s", threads == 1 ? "" : ", or set OMP_NUM_THREADS lower");
    _exit(2);
}

__attribute__((section(".preinit_array"),
               used)) static void (*const blas_room_first)(int, char **, char **) = blas_room_check;

/* ============================================================================================
 * Every sgemm of the products
 * ============================================================================================ */

/* c[m][n] (= or +=) a[m][k] b[k][n] on OpenBLAS, in tiles of c that the shape alone decides,
 * each summed by one thread (OpenBLAS runs on one thread inside a parallel region). A threaded
 * sgemm splits c where its thread count says, and its kernels sum a tile's edge rows and columns
 * in another order than its middle (OpenBLAS's Haswell and Zen cores on any k, every core on a k
 * that is not a multiple of 32): so one threaded sgemm's bits change with OMP_NUM_THREADS. Tiles
 * of SGEMM_TILE_ROWS x SGEMM_TILE_COLS repack each operand a few times (a few percent of the
 * product); narrower columns where the shape has fewer than SGEMM_MIN_TILES of them, so that a
 * small prefill still gives every core of a laptop a tile. */
enum { SGEMM_TILE_ROWS = 512, SGEMM_TILE_COLS = 1024, SGEMM_MIN_TILES = 8 };

void sgemm_fixed_tiles(int m, int n, int k, const float *a, int lda, const float *b, int ldb,
                       int accumulate, float *c, int ldc) {
    int row_tiles = (m + SGEMM_TILE_ROWS - 1) / SGEMM_TILE_ROWS;
    int tile_cols = SGEMM_TILE_COLS;
    while (tile_cols > 128 && row_tiles * ((n + tile_cols - 1) / tile_cols) < SGEMM_MIN_TILES)
        tile_cols /= 2;
    int col_tiles = (n + tile_cols - 1) / tile_cols;
#pragma omp parallel for schedule(dynamic)
    for (int tile = 0; tile < row_tiles * col_tiles; tile++) {
        int i0 = tile / col_tiles * SGEMM_TILE_ROWS;
        int j0 = tile % col_tiles * tile_cols;
        int mt = m - i0 < SGEMM_TILE_ROWS ? m - i0 : SGEMM_TILE_ROWS;
        int nt = n - j0 < tile_cols ? n - j0 : tile_cols;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mt, nt, k, 1.0f,
                    a + (size_t)i0 * lda, lda, b + j0, ldb, accumulate ? 1.0f : 0.0f,
                    c + (size_t)i0 * ldc + j0, ldc);
    }
}
