/* support/util.c: what every other file uses: error lines (fg_fail), whole-file reads, fp16 and
 * bf16 conversions (F16C where the CPU has it), the CPU features the SIMD paths check, the names of
 * the tiers and links, JSON lookups as Python's json makes them; output files, temporaries and
 * the directories a run makes, with the signal handlers that remove them (and the SIGBUS watch of
 * mapped files); unnamed files; clocks, sizes, pages and available memory; and the stubs of a
 * build without CUDA.
 *
 * Weights and the KV cache are stored in IEEE fp16 (paper §3); compute is fp32. fp32_to_fp16
 * rounds to nearest even, as the hardware instruction and PyTorch's .half() do, so every path
 * (scalar, F16C, the CUDA backend) stores the same bits.
 */
#define _GNU_SOURCE
#include "support/support.h"
#include "support/tools.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

const char *const fg_tier_names[N_TIERS] = {"gpu", "cpu", "disk"};
const char *const fg_link_names[N_LINKS] = {"disk->cpu", "cpu->gpu", "gpu->cpu", "cpu->disk"};

/* ============================================================================================
 * Error lines and files
 * ============================================================================================ */

int fg_fail(char *err, const char *fmt, ...) {
    if (!err) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, FG_ERR_LEN, fmt, ap);
    va_end(ap);
    for (char *c = err; *c; c++) /* a name from the input may hold a newline: keep one line */
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    return -1;
}

int fg_fail_flag(char *err, const char *flag) {
    char why[FG_ERR_LEN];
    snprintf(why, sizeof why, "%s", err ? err : "");
    return fg_fail(err, "%s %s", flag, why);
}

char *fg_read_file(const char *path, size_t *len, char *err) {
    /* O_NONBLOCK: opening a FIFO with no writer returns at once, to be refused below */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        fg_fail(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    char *buf = NULL;
    size_t size = 0, n = 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        fg_fail(err, "%s: cannot read: not a regular file", path);
    else if ((size = (size_t)st.st_size) > FG_MAX_TEXT_FILE)
        fg_fail(err, "%s: %zu bytes, more than the %zu MiB a text file may have", path, size,
                FG_MAX_TEXT_FILE >> 20);
    else if (!(buf = malloc(size + 1))) fg_fail(err, "%s: out of memory", path);
    while (buf && n < size) { /* a file that shrinks meanwhile ends early */
        ssize_t got = read(fd, buf + n, size - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            fg_fail(err, "%s: cannot read: %s", path, strerror(errno));
            free(buf);
            buf = NULL;
        }
        if (got <= 0) break;
        n += (size_t)got;
    }
    close(fd);
    if (!buf) return NULL;
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

const char *fg_json_nul_escape(const char *text, size_t len) {
    for (size_t i = 0; i + 1 < len; i++)
        if (text[i] == '\\' && text[i + 1] == 'u' && i + 6 <= len &&
            !memcmp(text + i + 2, "0000", 4))
            return text + i;
        else if (text[i] == '\\') i++; /* an escaped character: \\u0000 is text */
    return NULL;
}

/* Line of the byte at `at` in text, for an error line. */
static int line_of(const char *text, const char *at) {
    int line = 1;
    for (const char *p = text; p < at; p++) line += *p == '\n';
    return line;
}

cJSON *fg_json_parse(const char *path, const char *text, size_t len, char *err) {
    const char *nul = memchr(text, 0, len), *end = NULL;
    if (nul) {
        fg_fail(err, "%s: a NUL byte at byte %zu: not JSON text", path, (size_t)(nul - text));
        return NULL;
    }
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    while (root && end < text + len &&
           (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n'))
        end++;
    const char *escape = root ? fg_json_nul_escape(text, len) : NULL;
    if (!root || end < text + len)
        fg_fail(err, "%s: malformed JSON near line %d%s", path, end ? line_of(text, end) : 1,
                root ? " (data after the value)" : "");
    else if (escape)
        fg_fail(err,
                "%s line %d: a string holds \\u0000 (NUL), which would cut its key or value "
                "short here; not read",
                path, line_of(text, escape));
    else return root;
    cJSON_Delete(root);
    return NULL;
}

cJSON *fg_json_read_file(const char *path, char *err) {
    size_t len;
    char *text = fg_read_file(path, &len, err);
    cJSON *root = text ? fg_json_parse(path, text, len, err) : NULL;
    free(text);
    return root;
}

/* ============================================================================================
 * fp16
 * ============================================================================================ */

float fp16_to_fp32(fp16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* Inf or NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: renormalize */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

fp16 fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (fp16)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (fp16)(sign | 0x7c00); /* rounds past 65504 */
    if (ax < 0x38800000u) { /* below fp16's normal range: round to a subnormal */
        if (ax < 0x33000000u) return (fp16)sign; /* below half the smallest subnormal */
        uint32_t man = (ax & 0x7fffff) | 0x800000, shift = 126 - (ax >> 23);
        uint32_t q = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (q & 1))) q++;
        return (fp16)(sign | q);
    }
    uint32_t q = ((ax >> 23) - 112) << 10 | ((ax >> 13) & 0x3ff), rest = ax & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (q & 1))) q++; /* may carry into the exponent: fine */
    return (fp16)(sign | q);
}

float bf16_to_fp32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t fp32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    int nan = (bits & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)(nan ? (bits >> 16) | 0x40u : rounded); /* a NaN stays one */
}

void fp32_to_bf16_n(const float *src, uint16_t *dst, size_t n) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) dst[i] = fp32_to_bf16(src[i]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_F16C_PATH 1
__attribute__((target("f16c,avx"))) static void fp16_to_fp32_f16c(const fp16 *s, float *d,
                                                                  size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) d[i] = fp16_to_fp32(s[i]);
}
__attribute__((target("f16c,avx"))) static void fp32_to_fp16_f16c(const float *s, fp16 *d,
                                                                  size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) d[i] = fp32_to_fp16(s[i]);
}
static int cpu_has_f16c(void) {
    static int cached = -1; /* written once, same value from any thread */
    if (cached < 0) {
        unsigned a, b, c = 0, d;
        __get_cpuid(1, &a, &b, &c, &d);
        cached = __builtin_cpu_supports("avx") && (c & bit_F16C) /* avx: the OS saves ymm too */
                 && fg_isa_active() != FG_ISA_PORTABLE; /* lets the tests check the portable
                                                           paths */
    }
    return cached;
}
#endif

void fp16_to_fp32_n(const fp16 *src, float *dst, size_t n) {
#ifdef HAVE_F16C_PATH
    if (cpu_has_f16c()) {
        fp16_to_fp32_f16c(src, dst, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = fp16_to_fp32(src[i]);
}

void fp32_to_fp16_n(const float *src, fp16 *dst, size_t n) {
#ifdef HAVE_F16C_PATH
    if (cpu_has_f16c()) {
        fp32_to_fp16_f16c(src, dst, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = fp32_to_fp16(src[i]);
}

int fg_cpu_has_avx2(void) {
#ifdef HAVE_F16C_PATH
    static int cached = -1; /* written once, same value from any thread */
    if (cached < 0)
        cached = cpu_has_f16c() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return cached;
#else
    return 0;
#endif
}

/* ============================================================================================
 * The instruction set of the CPU kernels: cpuid (through GCC's __builtin_cpu_supports, which also
 * asks the OS whether it saves the wide registers), narrowed by FLEXGEN_ISA or FLEXGEN_NO_SIMD.
 * ============================================================================================ */

static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512", "avx512-simde"};

const char *fg_isa_name(fg_isa isa) { return ISA_NAMES[isa]; }

fg_isa fg_isa_of_cpu(void) {
    const unsigned avx2 = FG_CPU_AVX | FG_CPU_AVX2 | FG_CPU_FMA | FG_CPU_F16C;
    const unsigned avx512 =
        avx2 | FG_CPU_AVX512F | FG_CPU_AVX512BW | FG_CPU_AVX512DQ | FG_CPU_AVX512VL;
    static int cached = -1; /* written once, same value from any thread (cpuid is slow in a VM) */
    if (cached < 0) {
        unsigned f = fg_cpu_features();
        cached = (f & avx512) == avx512 ? FG_ISA_AVX512
                 : (f & avx2) == avx2   ? FG_ISA_AVX2
                                        : FG_ISA_PORTABLE;
    }
    return (fg_isa)cached;
}

/* FLEXGEN_ISA's value as an fg_isa: 0, or -1 where it names none. Unset: the CPU's.
 * FLEXGEN_NO_SIMD=1 makes it portable whatever FLEXGEN_ISA says. */
static int isa_from_env(fg_isa *isa) {
    const char *s = getenv("FLEXGEN_ISA");
    *isa = fg_isa_of_cpu();
    for (int i = 0; s && i < (int)(sizeof ISA_NAMES / sizeof *ISA_NAMES); i++)
        if (!strcmp(s, ISA_NAMES[i])) {
            *isa = (fg_isa)i;
            s = NULL;
        }
    if (getenv("FLEXGEN_NO_SIMD")) *isa = FG_ISA_PORTABLE;
    return s ? -1 : 0;
}

int fg_isa_check_env(char *err) {
    fg_isa isa, cpu = fg_isa_of_cpu();
    if (isa_from_env(&isa))
        return fg_fail(err,
                       "FLEXGEN_ISA: expected portable, avx2, avx512 or avx512-simde, got '%s'",
                       getenv("FLEXGEN_ISA"));
    if (isa != FG_ISA_AVX512_SIMDE && isa > cpu)
        return fg_fail(err, "FLEXGEN_ISA=%s: this CPU has no wider path than %s",
                       getenv("FLEXGEN_ISA"), fg_isa_name(cpu));
    return 0;
}

fg_isa fg_isa_active(void) {
    static int cached = -1; /* written once, same value from any thread */
    if (cached < 0) {
        fg_isa isa, cpu = fg_isa_of_cpu();
        if (isa_from_env(&isa) || (isa != FG_ISA_AVX512_SIMDE && isa > cpu))
            isa = cpu; /* main refused it */
        cached = (int)isa;
    }
    return (fg_isa)cached;
}

/* ============================================================================================
 * Output files, and what a signal leaves behind
 *
 * An output file (--dump-logits, --trace, the hardware file) is written under a temporary name
 * in its directory and renamed over its path when complete, so a failed run never leaves a
 * partial file. If SIGINT, SIGTERM or SIGHUP ends the process first, the handler removes the
 * temporary, and a job's output it made while that is still empty (a signal that comes while
 * the output is being made is put off until it is watched). A SIGBUS inside a mapped input file
 * (one truncated by someone else while it is read) ends the process with one line naming the
 * file, where it would die without a word.
 * ============================================================================================ */

#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { MAX_TEMPS = 8, MAX_MAPPED = 256 };
static char temp_names[MAX_TEMPS][FG_PATH_LEN];
static volatile sig_atomic_t temp_used[MAX_TEMPS];
static struct {
    const char *base;
    size_t size;
    char line[FG_ERR_LEN + 16];
    volatile sig_atomic_t used;
} mapped[MAX_MAPPED];
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

static char new_output_name[FG_PATH_LEN]; /* a job's output, made by this process */
static volatile sig_atomic_t new_output_fd = -1;
/* While fg_create_new_output makes the file (-1), a stop signal, on any thread, is put off (the
 * signal's number) until the file is watched: a process ended between the open and the watch
 * would leave the empty file behind. 0: no file being made. */
static atomic_int output_stop = 0;

/* The directories mkdir_p made, in the order made: a run that fails or is stopped takes away
 * those still empty (rmdir removes nothing else), a run that ends well keeps them. */
enum { MAX_MADE_DIRS = 16 };
static char made_dirs[MAX_MADE_DIRS][FG_PATH_LEN];
static volatile sig_atomic_t n_made_dirs;

void fg_remove_made_dirs(void) {
    for (int i = n_made_dirs - 1; i >= 0; i--) rmdir(made_dirs[i]); /* the deepest first */
    n_made_dirs = 0;
}

static void remove_temps(void) {
    for (int i = 0; i < MAX_TEMPS; i++)
        if (temp_used[i]) unlink(temp_names[i]);
    fg_remove_made_dirs();
    struct stat st; /* the job's output goes only while nothing is in it, and its path names it */
    struct stat at;
    if (new_output_fd >= 0 && fstat(new_output_fd, &st) == 0 && st.st_size == 0 &&
        stat(new_output_name, &at) == 0 && at.st_dev == st.st_dev && at.st_ino == st.st_ino)
        unlink(new_output_name);
}

void fg_unwatch_new_output(void) { new_output_fd = -1; }

static void on_stop(int sig) {
    int making = -1; /* a new output between its open and its watch: put off (output_stop) */
    if (atomic_compare_exchange_strong(&output_stop, &making, sig) || making > 0) return;
    remove_temps();
    signal(sig, SIG_DFL);
    raise(sig);
}

int fg_create_new_output(const char *path) {
    new_output_fd = -1;
    snprintf(new_output_name, sizeof new_output_name, "%s", path);
    atomic_store(&output_stop, -1);
    int fd = open(path, O_RDWR | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    int e = errno;
    new_output_fd = fd;
    int stop = atomic_exchange(&output_stop, 0);
    if (stop > 0) on_stop(stop); /* the file is watched now: removed, and the process ends */
    errno = e;
    return fd;
}

static struct sigaction bus_before; /* the handler in place before ours (e.g. a stage's) */

static void on_bus(int sig, siginfo_t *si, void *ctx) {
    (void)ctx;
    const char *at = si->si_addr;
    for (int i = 0; i < MAX_MAPPED; i++)
        if (mapped[i].used && at >= mapped[i].base && at < mapped[i].base + mapped[i].size) {
            if (write(2, mapped[i].line, strlen(mapped[i].line)) < 0) { /* nothing else to do */
            }
            remove_temps();
            _exit(2);
        }
    remove_temps();
    sigaction(sig, &bus_before, NULL); /* the access faults again, into that handler */
}

/* A stop signal that the parent set to be ignored stays ignored (nohup's SIGHUP, SIGINT in a
 * shell script's background job): this process was asked not to end on it. */
static void catch_unless_ignored(int sig, const struct sigaction *sa) {
    struct sigaction before;
    if (sigaction(sig, NULL, &before) == 0 && before.sa_handler == SIG_IGN) return;
    sigaction(sig, sa, NULL);
}

void fg_install_signal_handlers(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    int stops[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof stops / sizeof *stops; i++) catch_unless_ignored(stops[i], &sa);
    sa.sa_handler = NULL;
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGBUS, &sa, &bus_before);
}

void fg_watch_mapping(const void *base, size_t size, const char *path) {
    pthread_mutex_lock(&registry_lock);
    for (int i = 0; i < MAX_MAPPED; i++)
        if (!mapped[i].used) {
            mapped[i].base = base;
            mapped[i].size = size;
            snprintf(mapped[i].line, sizeof mapped[i].line,
                     "flexgen: %.400s: a mapped page cannot "
                     "be read: the file was truncated or its disk failed while it was in use\n",
                     path);
            mapped[i].used = 1;
            break;
        }
    pthread_mutex_unlock(&registry_lock);
}

void fg_unwatch_mapping(const void *base) {
    pthread_mutex_lock(&registry_lock);
    for (int i = 0; i < MAX_MAPPED; i++)
        if (mapped[i].used && mapped[i].base == base) mapped[i].used = 0;
    pthread_mutex_unlock(&registry_lock);
}

/* The process's umask, read without changing it (umask() sets it, which other threads would
 * see). */
static mode_t fg_umask(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[128];
    unsigned mask = 022;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "Umask: %o", &mask) == 1) break;
    if (f) fclose(f);
    return (mode_t)mask;
}

/* mkstemp of name (FG_PATH_LEN bytes; its XXXXXX replaced), the name registered as a temporary
 * the handlers remove from before the file exists (a signal in between finds nothing to remove).
 * *slot: its place in the registry; -1 where there is no file (errno EMFILE: no place free). */
static int registered_mkstemp(char *name, int *slot) {
    pthread_mutex_lock(&registry_lock);
    *slot = -1;
    for (int i = 0; i < MAX_TEMPS && *slot < 0; i++)
        if (!temp_used[i]) *slot = i;
    int fd = -1, e = EMFILE;
    if (*slot >= 0) {
        snprintf(temp_names[*slot], FG_PATH_LEN, "%s", name);
        temp_used[*slot] = 1;
        fd = mkstemp(temp_names[*slot]);
        e = errno;
        if (fd >= 0) {
            memcpy(name, temp_names[*slot], FG_PATH_LEN);
        } else {
            temp_used[*slot] = 0;
            *slot = -1;
        }
    }
    pthread_mutex_unlock(&registry_lock);
    errno = e;
    return fd;
}

static void release_temp(int slot) {
    pthread_mutex_lock(&registry_lock);
    if (slot >= 0) temp_used[slot] = 0;
    pthread_mutex_unlock(&registry_lock);
}

/* The named temporaries (outputs', and fg_new_file's where there is no O_TMPFILE): PARTIAL and 6
 * characters of mkstemp's. */
#define PARTIAL ".flexgen-partial-"

/* The temporaries in dir that a process ended without a handler (kill -9) left behind: each
 * temporary is held under flock by its process while it lives, so one that no process holds and
 * that is over a minute old (not one just made, before its lock) is removed. */
static void remove_dead_partials(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    time_t now = time(NULL);
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, PARTIAL, strlen(PARTIAL)) ||
            strlen(e->d_name) != strlen(PARTIAL) + 6)
            continue;
        int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        struct stat st;
        if (fd < 0) continue;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && now - st.st_mtime > 60 &&
            flock(fd, LOCK_EX | LOCK_NB) == 0)
            unlinkat(dirfd(d), e->d_name, 0);
        close(fd);
    }
    closedir(d);
}

/* A named temporary in dir, its name (FG_PATH_LEN bytes) in `name`, registered with the handlers
 * and held under flock while this process lives (the lock goes with the process, kill -9 too);
 * the dead ones in dir are removed first. -1 with errno where it cannot be made. */
static int partial_file(const char *dir, char *name, int *slot) {
    remove_dead_partials(dir);
    snprintf(name, FG_PATH_LEN, "%.4070s/" PARTIAL "XXXXXX", dir);
    int fd = registered_mkstemp(name, slot);
    if (fd >= 0) flock(fd, LOCK_EX | LOCK_NB);
    return fd;
}

/* The temporary of o->target, a named one beside it (-1: a name over NAME_MAX, none free, or it
 * cannot be created). */
static int output_temp(fg_output *o, char *err) {
    char dir[FG_PATH_LEN];
    if (strlen(path_folder(o->target, dir, sizeof dir)) > NAME_MAX) /* now, not after the run */
        return fg_fail(err, "%s %s: %s", o->flag, o->path, strerror(ENAMETOOLONG));
    int fd = partial_file(dir, o->tmp, &o->slot);
    if (fd < 0)
        return fg_fail(err, "%s %s: cannot create a file beside it: %s", o->flag, o->path,
                       strerror(errno));
    fchmod(fd, 0666 & ~fg_umask()); /* mkstemp's 0600 would outlive the rename */
    return fd;
}

/* The temporary is no longer the handlers' to remove (renamed, or removed here with remove). */
static void output_release(fg_output *o, int remove) {
    if (remove) unlink(o->tmp);
    release_temp(o->slot);
    o->slot = -1;
}

/* The output's stream writes straight to its descriptor and keeps the errno of the first write
 * that fails: stdio keeps only an error flag, and the cause (a full device, a file size limit)
 * would be lost. A failed write returns 0, never -1: fopencookie(3) forbids a negative count, and
 * glibc takes -1 as a count of bytes written, past the caller's buffer. Closing the stream closes
 * the descriptor. */
static ssize_t output_write(void *cookie, const char *buf, size_t n) {
    fg_output *o = cookie;
    for (size_t done = 0; done < n;) {
        ssize_t w = write(o->fd, buf + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            if (!o->error) o->error = w < 0 ? errno : EIO;
            return 0;
        }
        done += (size_t)w;
    }
    return (ssize_t)n;
}

static int output_close(void *cookie) { return close(((fg_output *)cookie)->fd); }

int fg_dangling_link(const char *flag, const char *path, char *err) {
    struct stat st;
    char target[FG_PATH_LEN];
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (lstat(path, &st) != 0 || !S_ISLNK(st.st_mode) || n < 0 || stat(path, &st) == 0) return 0;
    target[n] = 0;
    fg_fail(err,
            "%s %s: a symbolic link to %s, which does not exist; give that file's path, or "
            "another",
            flag, path, target);
    return 1;
}

int fg_output_open(fg_output *o, const char *flag, const char *path, char *err) {
    memset(o, 0, sizeof *o);
    o->flag = flag;
    o->path = path;
    o->fd = -1;
    if (!path[0]) return fg_fail(err, "%s: an empty path; give a file", flag);
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        return fg_fail(err, "%s %s: not a regular file", flag, path);
    /* a symbolic link is written through: the file it names is replaced, the link stays */
    if (fg_dangling_link(flag, path, err)) return -1;
    if (!realpath(path, o->target)) snprintf(o->target, sizeof o->target, "%s", path);
    if ((o->fd = output_temp(o, err)) < 0) return -1;
    cookie_io_functions_t io = {.write = output_write, .close = output_close};
    if (!(o->f = fopencookie(o, "w", io))) {
        int e = errno;
        close(o->fd);
        output_release(o, 1);
        return fg_fail(err, "%s %s: %s", flag, path, strerror(e));
    }
    return 0;
}

/* Why writing a file failed, in words. A full device is named as such also where the file
 * system reports it as EIO (at close or fsync, on some). */
const char *fg_write_failure(const char *tmp, int e) {
    struct statvfs sv;
    if (e == ENOSPC || (e == EIO && statvfs(tmp, &sv) == 0 && sv.f_bavail == 0))
        return "no space left on the device";
    if (e == EDQUOT) return "the disk quota is used up";
    if (e == EFBIG) return "larger than the file system or the file size limit (ulimit -f) allows";
    return strerror(e);
}

void fg_output_abort(fg_output *o) {
    if (o->f) fclose(o->f);
    output_release(o, 1);
}

/* o's temporary written through to the device and closed (0), or removed: the first error
 * named (-1). */
static int output_finish(fg_output *o, char *err) {
    int e = fflush(o->f) != 0 || ferror(o->f) ? (o->error ? o->error : EIO) : 0;
    if (!e && fsync(o->fd) != 0) e = errno; /* a file system that allocates late reports here */
    if (fclose(o->f) != 0 && !e) e = errno;
    o->f = NULL;
    if (!e) return 0;
    const char *why = fg_write_failure(o->tmp, e);
    output_release(o, 1);
    return fg_fail(err, "%s %s: write failed: %s", o->flag, o->path, why);
}

int fg_outputs_commit(fg_output *const *o, int n, char *err) {
    int failed = -1; /* the first that could not be written */
    for (int i = 0; i < n && failed < 0; i++)
        if (output_finish(o[i], err)) failed = i;
    for (int i = 0; i < n; i++) {
        if (failed >= 0) {
            if (i < failed) output_release(o[i], 1); /* written, and removed with the rest */
            if (i > failed) fg_output_abort(o[i]);
            continue;
        }
        int e = rename(o[i]->tmp, o[i]->target) != 0 ? errno : 0;
        output_release(o[i], e != 0);
        if (e) {
            failed = i;
            fg_fail(err, "%s %s: write failed: %s", o[i]->flag, o[i]->path, strerror(e));
        }
    }
    return failed >= 0 ? -1 : 0;
}

int fg_output_commit(fg_output *o, char *err) { return fg_outputs_commit(&o, 1, err); }

int fg_output_apart_from_std(const char *flag, const char *path, char *err) {
    struct stat at, std;
    if (stat(path, &at) != 0) return 0;
    for (int fd = 1; fd <= 2; fd++)
        if (fstat(fd, &std) == 0 && S_ISREG(std.st_mode) && std.st_dev == at.st_dev &&
            std.st_ino == at.st_ino)
            return fg_fail(err,
                           "%s %s: the same file as %s, which the run writes too; give another "
                           "file",
                           flag, path, fd == 1 ? "standard output" : "standard error");
    return 0;
}

int fg_output_check(const char *flag, const char *path, char *err) {
    if (fg_output_apart_from_std(flag, path, err)) return -1;
    fg_output o;
    if (fg_output_open(&o, flag, path, err)) return -1;
    /* a block of it taken now: a device already full is said before the run, not after it */
    int e = posix_fallocate(o.fd, 0, 1);
    if (e == ENOSPC || e == EDQUOT)
        fg_fail(err, "%s %s: %s", flag, path, fg_write_failure(o.tmp, e));
    fg_output_abort(&o);
    return e == ENOSPC || e == EDQUOT ? -1 : 0;
}

/* ============================================================================================
 * Small services: clocks, sizes, directories, the user's cache dir, unnamed files
 * ============================================================================================ */

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

size_text human(double bytes) {
    size_text t;
    if (bytes >= GB) snprintf(t.s, sizeof t.s, "%.2f GiB", bytes / GB);
    else if (bytes >= 1 << 20) snprintf(t.s, sizeof t.s, "%.1f MiB", bytes / (1 << 20));
    else if (bytes >= 1024) snprintf(t.s, sizeof t.s, "%.1f KiB", bytes / 1024);
    else snprintf(t.s, sizeof t.s, "%.0f B", bytes);
    return t;
}

void *line_alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }
size_t page_up(size_t n) { return (n + page_size() - 1) & ~(page_size() - 1); }

/* A new file in dir: unnamed (O_TMPFILE) where the file system has it, else a temporary named
 * .flexgen-partial-XXXXXX in t->path (the handlers' to remove until fg_new_file_name or _remove;
 * held under flock, so that a later run removes it if this process is killed), which file
 * systems without O_TMPFILE (NFS, FUSE) need for a file to be named later: an unnamed file made
 * by unlinking one cannot be linked back. FLEXGEN_TEST_NO_TMPFILE=1 takes the second way (the
 * tests). */
int fg_new_file(const char *dir, const char *flag, fg_new *t, char *err) {
    t->path[0] = 0;
    t->slot = -1;
    int fd = -1;
    errno = EOPNOTSUPP;
    if (!getenv("FLEXGEN_TEST_NO_TMPFILE")) fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
        fd = partial_file(dir, t->path, &t->slot);
        if (fd < 0) t->path[0] = 0;
    }
    if (fd < 0) return fg_fail(err, "%s %s: cannot create a file: %s", flag, dir, strerror(errno));
    return fd;
}

/* The folder path is in made again (mkdir_p), where another process took it away. */
static int remake_folder_of(const char *path) {
    char dir[FG_PATH_LEN];
    path_folder(path, dir, sizeof dir);
    if (!strcmp(dir, ".") || !strcmp(dir, "/")) return -1;
    return mkdir_p(dir);
}

/* The new file fd (fg_new_file's) given the name `path` once it is complete, in place of any file
 * of that name: the temporary renamed, or the unnamed file linked (-1 with errno where it cannot
 * be). An unnamed file keeps no folder from being removed: a run stopped beside this one, writing
 * into the same new folders, takes them away as it ends (fg_remove_made_dirs), so where path's
 * folder is gone it is made again. */
int fg_new_file_name(fg_new *t, int fd, const char *path) {
    int rc;
    if (t->path[0]) {
        rc = rename(t->path, path);
        if (rc == 0) t->path[0] = 0; /* the temporary's name is the file's now */
    } else {
        char self[64];
        snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
        unlink(path); /* a stale file of the same name */
        rc = linkat(AT_FDCWD, self, AT_FDCWD, path, AT_SYMLINK_FOLLOW);
        if (rc != 0 && errno == ENOENT && remake_folder_of(path) == 0)
            rc = linkat(AT_FDCWD, self, AT_FDCWD, path, AT_SYMLINK_FOLLOW);
    }
    int e = errno;
    fg_new_file_remove(t); /* what is left of a temporary that could not be renamed */
    errno = e;
    return rc;
}

/* A new file's temporary name removed (none: an unnamed file); its fd stays open. */
void fg_new_file_remove(fg_new *t) {
    if (t->path[0]) unlink(t->path);
    release_temp(t->slot);
    t->path[0] = 0;
    t->slot = -1;
}

/* An unnamed file in dir, removed when it is closed (or the process ends). */
int unnamed_file(const char *dir, const char *flag, char *err) {
    fg_new t;
    int fd = fg_new_file(dir, flag, &t, err);
    if (fd >= 0) fg_new_file_remove(&t);
    return fd;
}

double mem_available_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    double kb = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
    if (f) fclose(f);
    if (kb > 0) return kb * 1024;
    return (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
}

/* What a plan on the CPU backend may give its gpu and cpu tiers, which share host memory: what is
 * available less a sixteenth of the machine's memory, kept for the page cache that the disk tier's
 * reads pass through and for this process's memory outside its tiers (the loader's copy of the
 * tensor it fills, the BLAS's buffers). Without it a plan that fills the memory it found is refused
 * once the weights are loaded (seen with llama-2-13b's shape on 24 GiB: 1.3 GiB short). */
double host_memory_for_plans(void) {
    double total = (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
    double free_ = mem_available_bytes() - total / 16;
    return free_ > 0 ? free_ : 0;
}

int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The offload dir must exist and be writable, whatever the plan puts on disk. */
int check_dir(const char *flag, const char *dir, char *err) {
    struct stat st;
    if (stat(dir, &st) != 0)
        return fg_fail(err, "%s %s: %s", flag, dir,
                       errno == ENOENT ? "no such directory" : strerror(errno));
    if (!S_ISDIR(st.st_mode)) return fg_fail(err, "%s %s: not a directory", flag, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return fg_fail(err, "%s %s: not writable: %s", flag, dir, strerror(errno));
    return 0;
}

/* One directory of mkdir_p's chain, kept in made_dirs where this call makes it. */
static int make_dir(const char *path) {
    if (mkdir(path, 0755) != 0) return errno == EEXIST ? 0 : -1;
    pthread_mutex_lock(&registry_lock);
    if (n_made_dirs < MAX_MADE_DIRS) {
        snprintf(made_dirs[n_made_dirs], FG_PATH_LEN, "%s", path);
        n_made_dirs = n_made_dirs + 1;
    }
    pthread_mutex_unlock(&registry_lock);
    return 0;
}

const char *path_folder(const char *path, char *folder, size_t n) {
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(folder, n, ".");
    else if (slash == path) snprintf(folder, n, "/");
    else snprintf(folder, n, "%.*s", (int)(slash - path), path);
    return slash ? slash + 1 : path;
}

void path_beside(const char *path, const char *name, char *out, size_t n) {
    const char *slash = strrchr(path, '/');
    snprintf(out, n, "%.*s%s", slash ? (int)(slash + 1 - path) : 0, path, name);
}

int mkdir_p(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    for (char *s = path + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            if (make_dir(path)) return -1;
            *s = '/';
        }
    return make_dir(path);
}

/* $XDG_CACHE_HOME/flexgen where that is an absolute path (the XDG spec has a relative one
 * ignored), else ~/.cache/flexgen, else a directory under FG_DEFAULT_OFFLOAD_DIR. */
void default_weight_dir(char *out, size_t n) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && *xdg == '/') snprintf(out, n, "%s/flexgen", xdg);
    else if (home && *home) snprintf(out, n, "%s/.cache/flexgen", home);
    else snprintf(out, n, "%s/flexgen-weights", FG_DEFAULT_OFFLOAD_DIR);
}

#ifndef FLEXGEN_CUDA
int fg_cuda_compiled(void) { return 0; }
int fg_cuda_settings(char *err) {
    (void)err;
    return 0;
}
const fg_backend *fg_cuda_backend(char *err) {
    fg_fail(err, "this flexgen was built without CUDA (no nvcc at build time)");
    return NULL;
}
#endif

/* A stateless 64-bit hash (splitmix64's finalizer). */
uint64_t fg_fnv64_more(uint64_t h, const void *bytes, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)bytes)[i]) * 0x100000001b3ULL;
    return h;
}

uint64_t fg_fnv64(const void *bytes, size_t n) { return fg_fnv64_more(FG_FNV64_START, bytes, n); }

/* o's member `key`, the last of them when the key is repeated: Python's json (and so HF) keeps
 * the last value, where cJSON's lookup finds the first. */
const cJSON *fg_json_get(const cJSON *o, const char *key) {
    const cJSON *found = NULL;
    for (const cJSON *it = o ? o->child : NULL; it; it = it->next)
        if (it->string && !strcmp(it->string, key)) found = it;
    return found;
}
