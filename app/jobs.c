/* app/jobs.c: batch jobs that lose nothing. A prompt file in JSONL, and an output in JSONL
 * that holds one record per prompt, appended as each window of rounds finishes, so that a job
 * killed at any moment keeps what it finished and --resume does the rest.
 *
 *   prompts (--prompt-file F.jsonl)   {"prompt": "text"} or {"prompt_ids": [2, 100, ...]}, each
 *                                     with an optional "id" (a string, or an integer of up to 15
 *                                     digits; the line number when absent): one JSON object a
 *                                     line, in UTF-8, whose values a record gives back (a numeric
 *                                     id as cJSON prints its value: 1.0 and 1e2 as 1 and 100)
 *   output (--output F.jsonl)         first line {"flexgen_job": {...}}: what the tokens depend
 *                                     on (the model and the prompts by content, the flags that
 *                                     change the tokens, the device, the block shape); then a
 *                                     record a prompt: {"id", "prompt" or "prompt_ids",
 *                                     "completion", "tokens", "stop": "eos" or "length"}
 *
 * The output is locked (flock) from the start of the job to its end, so two jobs never write one
 * file; the lock goes with the process, however it ends. A window's records (JOB_WINDOW rounds of
 * blocks) go out in one write() of whole lines, flushed to the disk (fdatasync) before the next
 * window starts; a write cut short by a crash can leave only a last line without its newline,
 * which --resume removes before appending. The paper's loop does not change: the command line
 * (job_run.c) calls generate() a round at a time and hands a window's tokens here.
 */
#define _GNU_SOURCE
#include "app/app.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- UTF-8: decoded tokens can end inside a character ---- */

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if it is not one (Unicode's "maximal
 * subpart" rule, which Python's errors="replace" follows: *bad is how many bytes one U+FFFD
 * replaces). */
static int utf8_sequence(const unsigned char *s, size_t n, int *bad) {
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    int need = c >= 0xc2 && c <= 0xdf   ? 1
               : c >= 0xe0 && c <= 0xef ? 2
               : c >= 0xf0 && c <= 0xf4 ? 3
                                        : 0;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
    int k = 0;
    while (k < need && (size_t)k + 1 < n && s[k + 1] >= (k ? 0x80 : lo) &&
           s[k + 1] <= (k ? 0xbf : hi))
        k++;
    *bad = k + 1;
    return need && k == need ? need + 1 : 0;
}

char *utf8_replace_invalid(const char *text, size_t len, size_t *out_len) {
    const unsigned char *s = (const unsigned char *)text;
    char *out = malloc(3 * len + 1), *o = out; /* each bad byte becomes 3 */
    if (!out) return NULL;
    for (size_t i = 0; i < len;) {
        int bad, ok = s[i] < 0x80 ? 1 : utf8_sequence(s + i, len - i, &bad);
        if (ok) {
            memcpy(o, s + i, (size_t)ok);
            o += ok;
            i += (size_t)ok;
        } else {
            memcpy(o, "\xef\xbf\xbd", 3);
            o += 3;
            i += (size_t)bad;
        }
    }
    *o = 0;
    if (out_len) *out_len = (size_t)(o - out);
    return out;
}

/* ---- prompts ---- */

size_t utf8_first_invalid(const char *text, size_t len) {
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        int bad, ok = s[i] < 0x80 ? 1 : utf8_sequence(s + i, len - i, &bad);
        if (!ok) return i;
        i += (size_t)ok;
    }
    return len;
}

/* Whether text[0..len) is UTF-8 (JSON text must be). */
static int utf8_valid(const char *text, size_t len) { return utf8_first_invalid(text, len) == len; }

/* One JSON object and nothing after it (but spaces), in valid UTF-8 without \u0000; NULL with
 * the reason in err. what: "F line N" for the error line. */
static cJSON *parse_line(const char *what, const char *line, char *err) {
    const char *end = NULL;
    if (!utf8_valid(line, strlen(line))) {
        fg_fail(err, "%s: not valid UTF-8, as JSON must be", what);
        return NULL;
    }
    cJSON *o = cJSON_ParseWithOpts(line, &end, 0);
    while (o && end && (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n')) end++;
    if (!o) fg_fail(err, "%s: malformed JSON", what);
    else if (!cJSON_IsObject(o)) fg_fail(err, "%s: not a JSON object", what);
    else if (end && *end) fg_fail(err, "%s: text after the JSON object: '%.20s'", what, end);
    else if (fg_json_nul_escape(line, strlen(line)))
        fg_fail(err, "%s: a string holds \\u0000 (NUL), which no prompt or id may", what);
    else return o;
    cJSON_Delete(o);
    return NULL;
}

/* An id its record gives back: a string unchanged, or an integer of at most 15 digits by its
 * value, as cJSON prints it (1.0 as 1; it prints 15 significant digits, so longer integers,
 * fractions and 1e400 would come back as other values). */
static int id_round_trips(const cJSON *id) {
    if (cJSON_IsString(id)) return 1;
    double v = cJSON_IsNumber(id) ? id->valuedouble : NAN;
    return v == floor(v) && fabs(v) < 1e15;
}

int jsonl_prompt(const char *path, int line_no, const char *line, int vocab, int **ids, int *n,
                 char **id, char **text_out, char *err) {
    *ids = NULL;
    *id = NULL;
    *text_out = NULL;
    char what[FG_PATH_LEN + 32];
    snprintf(what, sizeof what, "%s line %d", path, line_no);
    cJSON *o = parse_line(what, line, err);
    const cJSON *text = fg_json_get(o, "prompt");
    const cJSON *given = fg_json_get(o, "prompt_ids");
    const cJSON *name = fg_json_get(o, "id");
    int rc = 0;
    if (!o) rc = -1;
    else if (!text == !given)
        rc = fg_fail(err, "%s: give one of \"prompt\" (text) and \"prompt_ids\"", what);
    else if (text && !cJSON_IsString(text))
        rc = fg_fail(err, "%s: \"prompt\" is not a string", what);
    else if (given && (!cJSON_IsArray(given) || cJSON_GetArraySize(given) == 0))
        rc = fg_fail(err, "%s: \"prompt_ids\" is not a list of token ids", what);
    else if (name && !cJSON_IsString(name) && !cJSON_IsNumber(name))
        rc = fg_fail(err, "%s: \"id\" is neither a string nor a number", what);
    else if (name && !id_round_trips(name))
        rc = fg_fail(
            err,
            "%s: \"id\" is a number a record could not give back as it is (an integer of up to "
            "15 digits can be); give it as a string",
            what);
    if (rc == 0 && given) {
        *n = cJSON_GetArraySize(given);
        *ids = malloc((size_t)*n * sizeof **ids);
        int k = 0;
        for (const cJSON *v = given->child; *ids && v && rc == 0; v = v->next, k++) {
            if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble < vocab) ||
                v->valuedouble != (int)v->valuedouble) /* range first: the cast needs it */
                rc = fg_fail(err, "%s: \"prompt_ids\"[%d] is not a token id in [0, %d)", what, k,
                             vocab);
            else (*ids)[k] = (int)v->valuedouble;
        }
    }
    if (rc == 0 && given && !*ids) rc = fg_fail(err, "out of memory");
    if (rc == 0) {
        char number[16];
        snprintf(number, sizeof number, "%d", line_no);
        int zero = cJSON_IsNumber(name) && name->valuedouble == 0; /* -0 is 0, as 1.0 is 1 */
        *id = zero ? strdup("0") : name ? cJSON_PrintUnformatted(name) : strdup(number);
        *text_out = text ? strdup(text->valuestring) : NULL;
        if (!*id || (text && !*text_out)) rc = fg_fail(err, "out of memory");
    }
    if (rc) {
        free(*ids);
        free(*id);
        free(*text_out);
        *ids = NULL;
        *id = *text_out = NULL;
    }
    cJSON_Delete(o);
    return rc;
}

/* ---- a job's identity ---- */

static int by_string(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

const char *job_repeated_id(char *const *ids, int n) {
    char **sorted = malloc((size_t)n * sizeof *sorted);
    const char *repeated = NULL;
    if (!sorted) return NULL;
    memcpy(sorted, ids, (size_t)n * sizeof *sorted);
    qsort(sorted, (size_t)n, sizeof *sorted, by_string);
    for (int i = 1; i < n && !repeated; i++)
        if (!strcmp(sorted[i], sorted[i - 1])) repeated = sorted[i];
    free(sorted);
    return repeated;
}

/* Every byte of a checkpoint hashed, fast enough to read a checkpoint at about the speed of the
 * page cache: 32-byte blocks through four lanes of 64-bit words, each word taken in by xxHash64's
 * round (a multiply, a rotation, a multiply), so that an edit anywhere in a tensor changes its
 * lane; the last block padded with zeros, the length counted apart. */
enum { HASH_BLOCK = 32, HASH_CHUNK = 1 << 22 };
static const uint64_t HASH_P1 = 0x9e3779b185ebca87ull, HASH_P2 = 0xc2b2ae3d27d4eb4full;

typedef struct {
    uint64_t lane[4];
} content_hash;

static uint64_t lane_round(uint64_t acc, uint64_t word) {
    acc += word * HASH_P2;
    acc = acc << 31 | acc >> 33;
    return acc * HASH_P1;
}

/* n bytes, a multiple of HASH_BLOCK, into the lanes. */
static void hash_blocks(content_hash *c, const unsigned char *bytes, size_t n) {
    for (size_t i = 0; i < n; i += HASH_BLOCK) {
        uint64_t w[4];
        memcpy(w, bytes + i, sizeof w);
        c->lane[0] = lane_round(c->lane[0], w[0]);
        c->lane[1] = lane_round(c->lane[1], w[1]);
        c->lane[2] = lane_round(c->lane[2], w[2]);
        c->lane[3] = lane_round(c->lane[3], w[3]);
    }
}

/* n bytes of fd at offset `at`; -1 with errno when a read fails or the file ends first. */
static int read_at(int fd, unsigned char *buf, size_t n, off_t at) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, at + (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) {
            errno = EIO; /* shorter than it was: truncated while it is read */
            return -1;
        }
        got += (size_t)r;
    }
    return 0;
}

/* The whole of fd (size bytes) into c; -1 with errno when a read fails. */
static int hash_contents(int fd, off_t size, content_hash *c, unsigned char *buf) {
    off_t at = 0;
    while (at < size) {
        size_t want = size - at < HASH_CHUNK ? (size_t)(size - at) : HASH_CHUNK;
        if (read_at(fd, buf, want, at) != 0) return -1;
        size_t whole = want / HASH_BLOCK * HASH_BLOCK;
        if (whole < want) { /* the file's last block */
            memset(buf + want, 0, whole + HASH_BLOCK - want);
            whole += HASH_BLOCK;
        }
        hash_blocks(c, buf, whole);
        at += (off_t)want;
    }
    return 0;
}

/* A file's name, size and every byte into h. O_NONBLOCK: a FIFO with no writer opens at once,
 * to be refused as the loader refuses it, where a plain open would wait for a writer for ever. */
static int hash_file(const char *dir, const char *name, uint64_t *h, unsigned char *buf,
                     char *err) {
    char path[FG_PATH_LEN + 256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    content_hash c = {{1, 2, 3, 4}};
    if (fd >= 0 && fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {
        close(fd);
        return fg_fail(err, "--model %s: not a regular file", path);
    }
    if (fd < 0 || fstat(fd, &st) != 0 || hash_contents(fd, st.st_size, &c, buf) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        return fg_fail(err, "--model %s: %s", path, strerror(e));
    }
    close(fd);
    *h = fg_fnv64_more(*h, name, strlen(name) + 1);
    *h = fg_fnv64_more(*h, &st.st_size, sizeof st.st_size);
    *h = fg_fnv64_more(*h, c.lane, sizeof c.lane);
    return 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* config.json, generation_config.json where there is one (its eos_token_id ends sequences), and
 * the files the loader reads (st_dir_files), in name order: a file the model does not use (a
 * stray `.safetensors`) is not read. */
int job_checkpoint_hash(const char *dir, uint64_t *hash, char *err) {
    char **names, generation[FG_PATH_LEN + 32];
    int n, rc = st_dir_files(dir, &names, &n, err);
    if (rc) return -1;
    snprintf(generation, sizeof generation, "%s/generation_config.json", dir);
    char **grown = realloc(names, (size_t)(n + 2) * sizeof *grown);
    if (grown) names = grown;
    if (grown && (names[n] = strdup("config.json"))) n++;
    else rc = fg_fail(err, "out of memory");
    if (rc == 0 && access(generation, F_OK) == 0 && (names[n] = strdup("generation_config.json")))
        n++;
    qsort(names, (size_t)n, sizeof *names, by_name);
    unsigned char *buf = malloc(HASH_CHUNK + HASH_BLOCK);
    if (rc == 0 && !buf) rc = fg_fail(err, "out of memory");
    *hash = FG_FNV64_START;
    for (int i = 0; i < n; i++) {
        if (rc == 0) rc = hash_file(dir, names[i], hash, buf, err);
        free(names[i]);
    }
    free(names);
    free(buf);
    return rc;
}

char *job_header(const job_identity *id, const gen_options *g, const fg_policy *p) {
    char hash[24];
    cJSON *job = cJSON_CreateObject(), *root = cJSON_CreateObject();
    if (id->model) cJSON_AddStringToObject(job, "model", id->model);
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)id->checkpoint_hash);
    if (!id->model) cJSON_AddStringToObject(job, "checkpoint_hash64", hash);
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)id->prompts_hash);
    cJSON_AddStringToObject(job, "prompts_fnv64", hash);
    cJSON_AddNumberToObject(job, "prompts", id->n_prompts);
    cJSON_AddNumberToObject(job, "gen_len", g->gen_len);
    cJSON_AddNumberToObject(job, "temperature", g->temperature);
    cJSON_AddNumberToObject(job, "top_p", g->top_p);
    cJSON_AddNumberToObject(job, "seed", (double)g->seed);
    cJSON_AddBoolToObject(job, "stop_at_eos", g->stop_at_eos);
    if (g->refill) cJSON_AddBoolToObject(job, "refill", 1); /* absent: off */
    cJSON_AddBoolToObject(job, "compress_weight", p->compress_weight);
    if (p->int8_activations) { /* with the range of W's integer columns in prefill (int8.c) */
        cJSON_AddBoolToObject(job, "int8_activations", 1);
        cJSON_AddNumberToObject(job, "int8_weight_max", INT8_W_MAX);
    }
    if (p->bf16_prefill) cJSON_AddBoolToObject(job, "bf16_prefill", 1);
    cJSON_AddBoolToObject(job, "compress_cache", p->compress_cache);
    cJSON_AddNumberToObject(job, "attn_sparsity", p->attn_sparsity);
    cJSON_AddStringToObject(job, "device", id->device);
    if (id->blas_core) cJSON_AddStringToObject(job, "blas_core", id->blas_core);
    if (id->prefill_library) cJSON_AddStringToObject(job, "prefill_library", id->prefill_library);
    cJSON_AddNumberToObject(job, "gpu_batch_size", p->gpu_batch_size);
    cJSON_AddNumberToObject(job, "num_gpu_batches", p->num_gpu_batches);
    if (p->schedule == FG_SCHEDULE_DIAGONAL)
        cJSON_AddStringToObject(job, "schedule", "diagonal"); /* absent: zig-zag */
    cJSON_AddItemToObject(root, "flexgen_job", job);
    char *line = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return line;
}

/* What a key that job_header leaves out means: its default. */
static const char *absent_value(const char *key) {
    if (!strcmp(key, "schedule")) return "\"zigzag\"";
    if (!strcmp(key, "refill") || !strcmp(key, "int8_activations") || !strcmp(key, "bf16_prefill"))
        return "false";
    return "none";
}

/* The first key whose value differs between two job lines (a key in one only differs), or NULL. */
static const char *header_differs(const cJSON *have, const cJSON *want, char *values, size_t n) {
    for (const cJSON *w = want->child; w; w = w->next) {
        const cJSON *h = fg_json_get(have, w->string);
        if (h && cJSON_Compare(h, w, 1)) continue;
        char *a = h ? cJSON_PrintUnformatted(h) : NULL, *b = cJSON_PrintUnformatted(w);
        snprintf(values, n, "%.100s there, %.100s here", a ? a : absent_value(w->string),
                 b ? b : "?");
        free(a);
        free(b);
        return w->string;
    }
    for (const cJSON *h = have->child; h; h = h->next) {
        if (fg_json_get(want, h->string)) continue;
        char *a = cJSON_PrintUnformatted(h);
        snprintf(values, n, "%.100s there, %s here", a ? a : "?", absent_value(h->string));
        free(a);
        return h->string;
    }
    return NULL;
}

/* ---- the output: one job's, locked while the job runs ---- */

/* Whether path names the open file fd (not removed, not replaced by another). */
static int names_file(const char *path, int fd) {
    struct stat a, b;
    return stat(path, &a) == 0 && fstat(fd, &b) == 0 && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}

/* Why path could not be opened: its directory, or the file itself. */
static int open_failed(const char *path, int e, char *err) {
    char dir[FG_PATH_LEN];
    path_folder(path, dir, sizeof dir);
    if (check_dir("--output", dir, err)) return -1;
    return fg_fail(err, "--output %s: %s", path, strerror(e));
}

/* The file at o->path, made if there is none, under an exclusive lock: flock's lock belongs to
 * the open file, so it goes with the process however it ends (kill -9 too). A file replaced
 * between the open and the lock is opened again. */
static int lock_output(job_output *o, char *err) {
    for (int tries = 0; tries < 8; tries++) {
        int fd = fg_create_new_output(o->path), created = fd >= 0;
        if (fd < 0 && errno == EEXIST) {
            fd = open(o->path, O_RDWR | O_APPEND | O_CLOEXEC);
            if (fd < 0 && errno == ENOENT && fg_dangling_link("--output", o->path, err)) return -1;
            if (fd < 0 && errno == ENOENT) continue; /* removed in between: made the next time */
        }
        if (fd < 0) return open_failed(o->path, errno, err);
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) { /* never removed here: it is the other job's */
            int e = errno;
            if (created) fg_unwatch_new_output();
            close(fd);
            if (e == EWOULDBLOCK)
                return fg_fail(
                    err,
                    "--output %s: another job holds it (a flexgen run is writing there); wait "
                    "for it to end, or give another file",
                    o->path);
            return fg_fail(err, "--output %s: cannot lock it: %s", o->path, strerror(e));
        }
        if (!names_file(o->path, fd)) {
            if (created) fg_unwatch_new_output();
            close(fd);
            continue;
        }
        o->fd = fd;
        o->created = created;
        return 0;
    }
    return fg_fail(err, "--output %s: replaced again and again while it was opened", o->path);
}

/* A record as job_output_append writes it: beside its id, the tokens and why they stopped. */
static int is_whole_record(const cJSON *rec) {
    const cJSON *stop = fg_json_get(rec, "stop");
    return cJSON_IsArray(fg_json_get(rec, "tokens")) && cJSON_IsString(stop) &&
           (!strcmp(stop->valuestring, "eos") || !strcmp(stop->valuestring, "length"));
}

/* An existing output: its job line, the ids of its records; a last line without its newline (a
 * write cut short) is noted, to be cut off before the first record is added (a file that is
 * refused stays as it was). A first line without its newline is no job line. */
static int read_done(job_output *o, char *err) {
    int fd = dup(o->fd);
    FILE *f = fd >= 0 ? fdopen(fd, "r") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        return fg_fail(err, "--output %s: %s", o->path, strerror(errno));
    }
    char *line = NULL, what[FG_PATH_LEN + 48];
    size_t cap = 0;
    ssize_t len;
    long at = 0, line_no = 0;
    int rc = 0;
    while (rc == 0 && (len = getline(&line, &cap, f)) > 0) {
        line_no++;
        if (line[len - 1] != '\n' && line_no == 1)
            rc = fg_fail(err, "--resume: %s does not start with a flexgen job line", o->path);
        if (line[len - 1] != '\n') { /* the crash's partial line: every byte before it stays */
            o->partial = 1;
            break;
        }
        at += len;
        snprintf(what, sizeof what, "--resume: %s line %ld", o->path, line_no);
        cJSON *rec = memchr(line, 0, (size_t)len) ? NULL : parse_line(what, line, err);
        cJSON *job = line_no == 1 ? cJSON_DetachItemFromObject(rec, "flexgen_job") : NULL;
        const cJSON *id = line_no > 1 ? fg_json_get(rec, "id") : NULL;
        int whole = id && is_whole_record(rec); /* grown only then: o->done stays valid */
        char **grown = whole ? realloc(o->done, (size_t)(o->n_done + 1) * sizeof *grown) : NULL;
        if (memchr(line, 0, (size_t)len)) rc = fg_fail(err, "%s: a NUL byte", what);
        else if (!rec) rc = -1;
        else if (line_no == 1 && !cJSON_IsObject(job))
            rc = fg_fail(err, "--resume: %s does not start with a flexgen job line", o->path);
        else if (line_no == 1) {
            o->recorded = job;
            job = NULL;
        } else if (!id) rc = fg_fail(err, "%s: not a record of a job (no \"id\")", what);
        else if (!whole)
            rc = fg_fail(err, "%s: not a whole record (its \"tokens\" or \"stop\" is missing)",
                         what);
        else if (!grown) rc = fg_fail(err, "out of memory");
        else if (!(grown[o->n_done] = cJSON_PrintUnformatted(id))) {
            o->done = grown;
            rc = fg_fail(err, "out of memory");
        } else {
            o->done = grown;
            o->n_done++;
        }
        cJSON_Delete(job);
        cJSON_Delete(rec);
    }
    free(line);
    fclose(f);
    int sortable = rc == 0 && o->n_done > 0; /* no record, no list: qsort and memcpy take no NULL,
                                                even of 0 items */
    if (sortable) qsort(o->done, (size_t)o->n_done, sizeof *o->done, by_string);
    const char *twice = sortable ? job_repeated_id(o->done, o->n_done) : NULL;
    if (twice) rc = fg_fail(err, "--resume: %s has two records of the id %.60s", o->path, twice);
    o->size = at;
    return rc;
}

int job_output_open(job_output *o, const char *path, int resume, char *err) {
    *o = (job_output){.path = path, .fd = -1};
    if (!path[0]) return fg_fail(err, "--output: an empty path; give a file");
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        return fg_fail(err, "--output %s: not a regular file", path);
    if (lock_output(o, err)) return -1;
    if (fstat(o->fd, &st) != 0) return fg_fail(err, "--output %s: %s", path, strerror(errno));
    if (st.st_size == 0) return 0;
    if (!resume)
        return fg_fail(err, "--output %s: exists; --resume finishes its job, or give another file",
                       path);
    return read_done(o, err);
}

void job_output_shape(const job_output *o, int *gpu_batch_size, int *num_gpu_batches,
                      fg_schedule *schedule) {
    const cJSON *g = fg_json_get(o->recorded, "gpu_batch_size"),
                *n = fg_json_get(o->recorded, "num_gpu_batches");
    const cJSON *s = fg_json_get(o->recorded, "schedule");
    *gpu_batch_size = cJSON_IsNumber(g) ? g->valueint : 0;
    *num_gpu_batches = cJSON_IsNumber(n) ? n->valueint : 0;
    *schedule = cJSON_IsString(s) && !strcmp(s->valuestring, "diagonal") ? FG_SCHEDULE_DIAGONAL
                                                                         : FG_SCHEDULE_ZIGZAG;
}

int job_output_begin(job_output *o, char *header, char *err) {
    free(o->header);
    o->header = header;
    if (!o->recorded) return 0;
    if (fg_json_get(o->recorded, "checkpoint_fnv64"))
        return fg_fail(
            err,
            "--resume: %s was begun by an earlier flexgen, which named the checkpoint by samples "
            "of "
            "its bytes (checkpoint_fnv64), not by every byte; it cannot tell that this is the same "
            "checkpoint: finish the job with the flexgen that began it, or run it again into a new "
            "output",
            o->path);
    char values[256];
    cJSON *want = cJSON_Parse(header);
    const char *key =
        header_differs(o->recorded, fg_json_get(want, "flexgen_job"), values, sizeof values);
    int rc = key ? fg_fail(err, "--resume: %s is the output of another job: %s is %s", o->path, key,
                           values)
                 : 0;
    cJSON_Delete(want);
    return rc;
}

const char *job_output_stranger(const job_output *o, char *const *ids, int n) {
    char **sorted = malloc((size_t)(n ? n : 1) * sizeof *sorted);
    const char *stranger = NULL;
    if (!sorted) return o->n_done ? o->done[0] : NULL;
    memcpy(sorted, ids, (size_t)n * sizeof *sorted);
    qsort(sorted, (size_t)n, sizeof *sorted, by_string);
    for (int i = 0; i < o->n_done && !stranger; i++)
        if (!bsearch(&o->done[i], sorted, (size_t)n, sizeof *sorted, by_string))
            stranger = o->done[i];
    free(sorted);
    return stranger;
}

int job_output_done(const job_output *o, const char *id) {
    return o->n_done &&
           bsearch(&id, o->done, (size_t)o->n_done, sizeof *o->done, by_string) != NULL;
}

/* A write that failed part way is undone: the output keeps whole lines. */
static int append_failed(job_output *o, int e, char *err) {
    if (ftruncate(o->fd, o->size) != 0) { /* the reader drops a cut last line anyway */
    }
    return fg_fail(err, "--output %s: write failed: %s", o->path, fg_write_failure(o->path, e));
}

static int write_all(job_output *o, const char *bytes, size_t len, char *err) {
    for (size_t done = 0; done < len;) {
        ssize_t w = write(o->fd, bytes + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return append_failed(o, w < 0 ? errno : EIO, err);
        done += (size_t)w;
    }
    return 0;
}

int job_output_cut_partial(job_output *o, char *err) {
    if (o->partial && ftruncate(o->fd, o->size) != 0)
        return fg_fail(err, "--output %s: %s", o->path, strerror(errno));
    o->partial = 0;
    return 0;
}

int job_output_append(job_output *o, const char *lines, size_t len, char *err) {
    if (!names_file(o->path, o->fd))
        return fg_fail(
            err,
            "--output %s: removed or replaced while the job ran; the records written there "
            "went with it, so the job stops",
            o->path);
    if (job_output_cut_partial(o, err)) return -1;
    size_t h = o->size == 0 ? strlen(o->header) + 1 : 0; /* a new output's first line goes with
                                                            them */
    char *all = h ? malloc(h + len) : NULL;
    if (h && !all) return fg_fail(err, "out of memory");
    if (h) {
        memcpy(all, o->header, h - 1);
        all[h - 1] = '\n';
        memcpy(all + h, lines, len);
    }
    int rc = write_all(o, h ? all : lines, h + len, err);
    if (rc == 0 && fdatasync(o->fd) != 0) rc = append_failed(o, errno, err);
    if (rc == 0) o->size += (off_t)(h + len);
    free(all);
    return rc;
}

void job_output_close(job_output *o) {
    struct stat st;
    if (o->created && fstat(o->fd, &st) == 0 && st.st_size == 0 && names_file(o->path, o->fd))
        unlink(o->path); /* made for nothing, removed before the lock goes */
    if (o->created) fg_unwatch_new_output();
    if (o->fd >= 0) close(o->fd);
    for (int i = 0; i < o->n_done; i++) free(o->done[i]);
    free(o->done);
    free(o->header);
    cJSON_Delete(o->recorded);
    *o = (job_output){.fd = -1};
}

/* The text that gen[0..n) adds to the prompt's. */
static char *decode_continuation(const fg_tokenizer *tok, const int *prompt, int prompt_len,
                                 const int *gen, int n, size_t *len) {
    int *all = malloc((size_t)(prompt_len + n + 1) * sizeof *all);
    if (!all) return NULL;
    memcpy(all, prompt, (size_t)prompt_len * sizeof *all);
    memcpy(all + prompt_len, gen, (size_t)n * sizeof *all);
    char *text = tokenizer_decode_from(tok, all, prompt_len + n, prompt_len, len);
    free(all);
    return text;
}

/* One record, with its newline. text: the prompt as given (NULL: it came as ids); tok: NULL
 * where there is no tokenizer (no completion text then). */
char *job_record(const char *id, const char *text, const int *prompt, int prompt_len,
                 const int *gen, const gen_options *g, const fg_tokenizer *tok) {
    int n = 0, gen_len = g->gen_len;
    while (n < gen_len && !gen_is_eos(g, gen[n])) n++;
    const char *stop = n < gen_len ? "eos" : "length";
    if (!g->stop_at_eos) {
        n = gen_len;
        stop = "length";
    }
    cJSON *r = cJSON_CreateObject();
    cJSON_AddItemToObject(r, "id", cJSON_Parse(id));
    if (text) cJSON_AddStringToObject(r, "prompt", text);
    else cJSON_AddItemToObject(r, "prompt_ids", cJSON_CreateIntArray(prompt, prompt_len));
    if (tok) {
        size_t len, clean_len;
        char *raw = decode_continuation(tok, prompt, prompt_len, gen, n, &len);
        char *clean = raw ? utf8_replace_invalid(raw, len, &clean_len) : NULL;
        cJSON_AddStringToObject(r, "completion", clean ? clean : "");
        free(raw);
        free(clean);
    }
    cJSON_AddItemToObject(r, "tokens", cJSON_CreateIntArray(gen, n));
    cJSON_AddStringToObject(r, "stop", stop);
    char *line = cJSON_PrintUnformatted(r),
         *with_newline = line ? realloc(line, strlen(line) + 2) : NULL;
    if (with_newline) strcat(with_newline, "\n");
    else free(line);
    cJSON_Delete(r);
    return with_newline;
}
