/* support/jobs.c: batch jobs that lose nothing. A prompt file in JSONL, and an output in JSONL
 * that holds one record per prompt, appended as each round of blocks finishes, so that a job
 * killed at any moment keeps what it finished and --resume does the rest.
 *
 *   prompts (--prompt-file F.jsonl)   {"prompt": "text"} or {"prompt_ids": [2, 100, ...]}, each
 *                                     with an optional "id" (a string or a number; the line
 *                                     number when absent)
 *   output (--output F.jsonl)         first line {"flexgen_job": {...}}: what identifies the job
 *                                     (model, prompt file and a hash of its bytes, the flags that
 *                                     change the tokens); then a record a prompt:
 *                                     {"id", "prompt" or "prompt_ids", "completion", "tokens",
 *                                      "stop": "eos" or "length"}
 *
 * A round's records go out in one write() of whole lines, flushed to the disk (fdatasync) before
 * the next round starts; a write cut short by a crash can leave only a last line without its
 * newline, which --resume removes before appending. The paper's loop does not change: the
 * command line (cli.c) calls generate() a round at a time and hands the tokens here.
 */
#define _GNU_SOURCE
#include "support/tools.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- UTF-8: decoded tokens can end inside a character ---- */

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if it is not one (Unicode's "maximal
 * subpart" rule, which Python's errors="replace" follows: *bad is how many bytes one U+FFFD
 * replaces). */
static int utf8_sequence(const unsigned char *s, size_t n, int *bad) {
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    int need = c >= 0xc2 && c <= 0xdf ? 1 : c >= 0xe0 && c <= 0xef ? 2 : c >= 0xf0 && c <= 0xf4 ? 3 : 0;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
    int k = 0;
    while (k < need && (size_t)k + 1 < n && s[k + 1] >= (k ? 0x80 : lo) && s[k + 1] <= (k ? 0xbf : hi)) k++;
    *bad = k + 1;
    return need && k == need ? need + 1 : 0;
}

char *utf8_replace_invalid(const char *text, size_t len, size_t *out_len) {
    const unsigned char *s = (const unsigned char *)text;
    char *out = malloc(3 * len + 1), *o = out; /* each bad byte becomes 3 */
    if (!out) return NULL;
    for (size_t i = 0; i < len;) {
        int bad, ok = s[i] < 0x80 ? 1 : utf8_sequence(s + i, len - i, &bad);
        if (ok) memcpy(o, s + i, (size_t)ok), o += ok, i += (size_t)ok;
        else memcpy(o, "\xef\xbf\xbd", 3), o += 3, i += (size_t)bad;
    }
    *o = 0;
    if (out_len) *out_len = (size_t)(o - out);
    return out;
}

/* ---- prompts ---- */

int jsonl_prompt(const char *path, int line_no, const char *line, int vocab, int **ids, int *n, char **id,
                 char **text_out, char *err) {
    *ids = NULL, *id = NULL, *text_out = NULL;
    cJSON *o = cJSON_Parse(line);
    const cJSON *text = fg_json_get(o, "prompt");
    const cJSON *given = fg_json_get(o, "prompt_ids");
    const cJSON *name = fg_json_get(o, "id");
    int rc = 0;
    if (!o) rc = fg_fail(err, "%s line %d: malformed JSON", path, line_no);
    else if (!cJSON_IsObject(o)) rc = fg_fail(err, "%s line %d: not a JSON object", path, line_no);
    else if (!text == !given)
        rc = fg_fail(err, "%s line %d: give one of \"prompt\" (text) and \"prompt_ids\"", path, line_no);
    else if (text && !cJSON_IsString(text)) rc = fg_fail(err, "%s line %d: \"prompt\" is not a string", path, line_no);
    else if (given && (!cJSON_IsArray(given) || cJSON_GetArraySize(given) == 0))
        rc = fg_fail(err, "%s line %d: \"prompt_ids\" is not a list of token ids", path, line_no);
    else if (name && !cJSON_IsString(name) && !cJSON_IsNumber(name))
        rc = fg_fail(err, "%s line %d: \"id\" is neither a string nor a number", path, line_no);
    if (rc == 0 && given) {
        *n = cJSON_GetArraySize(given);
        *ids = malloc((size_t)*n * sizeof **ids);
        int k = 0;
        for (const cJSON *v = given->child; *ids && v && rc == 0; v = v->next, k++) {
            if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble < vocab) ||
                v->valuedouble != (int)v->valuedouble) /* range first: the cast needs it */
                rc = fg_fail(err, "%s line %d: \"prompt_ids\"[%d] is not a token id in [0, %d)", path, line_no, k, vocab);
            else (*ids)[k] = (int)v->valuedouble;
        }
    }
    if (rc == 0 && given && !*ids) rc = fg_fail(err, "out of memory");
    if (rc == 0) {
        char number[16];
        snprintf(number, sizeof number, "%d", line_no);
        *id = name ? cJSON_PrintUnformatted(name) : strdup(number);
        *text_out = text ? strdup(text->valuestring) : NULL;
        if (!*id || (text && !*text_out)) rc = fg_fail(err, "out of memory");
    }
    if (rc) free(*ids), free(*id), free(*text_out), *ids = NULL, *id = *text_out = NULL;
    cJSON_Delete(o);
    return rc;
}

/* ---- the output ---- */

static int by_string(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

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

/* The job's identity as its first line: what changes the tokens, and the prompt file's bytes. */
char *job_header(const char *model, const char *prompt_file, uint64_t file_hash, int n_prompts,
                 const gen_options *g, const fg_policy *p) {
    char hash[24];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)file_hash);
    cJSON *job = cJSON_CreateObject(), *root = cJSON_CreateObject();
    cJSON_AddStringToObject(job, "model", model);
    cJSON_AddStringToObject(job, "prompt_file", prompt_file ? prompt_file : "");
    cJSON_AddStringToObject(job, "prompt_file_fnv64", hash);
    cJSON_AddNumberToObject(job, "prompts", n_prompts);
    cJSON_AddNumberToObject(job, "gen_len", g->gen_len);
    cJSON_AddNumberToObject(job, "temperature", g->temperature);
    cJSON_AddNumberToObject(job, "top_p", g->top_p);
    cJSON_AddNumberToObject(job, "seed", (double)g->seed);
    cJSON_AddBoolToObject(job, "stop_at_eos", g->stop_at_eos);
    cJSON_AddBoolToObject(job, "compress_weight", p->compress_weight);
    if (p->int8_activations) cJSON_AddBoolToObject(job, "int8_activations", 1); /* absent: off */
    cJSON_AddBoolToObject(job, "compress_cache", p->compress_cache);
    cJSON_AddNumberToObject(job, "attn_sparsity", p->attn_sparsity);
    cJSON_AddItemToObject(root, "flexgen_job", job);
    char *line = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return line;
}

/* The first key whose value differs between two job headers (a key in one only differs), or NULL. */
static const char *header_differs(const cJSON *have, const cJSON *want, char *values, size_t n) {
    for (const cJSON *w = want->child; w; w = w->next) {
        const cJSON *h = fg_json_get(have, w->string);
        if (h && cJSON_Compare(h, w, 1)) continue;
        char *a = h ? cJSON_PrintUnformatted(h) : NULL, *b = cJSON_PrintUnformatted(w);
        snprintf(values, n, "%.100s there, %.100s here", a ? a : "none", b ? b : "?");
        free(a), free(b);
        return w->string;
    }
    for (const cJSON *h = have->child; h; h = h->next) {
        if (fg_json_get(want, h->string)) continue;
        char *a = cJSON_PrintUnformatted(h);
        snprintf(values, n, "%.100s there, none here", a ? a : "?");
        free(a);
        return h->string;
    }
    return NULL;
}

/* An existing output: its header against this job's, the ids of its records; a last line
 * without its newline (a write cut short) is cut off. */
static int read_done(job_output *o, FILE *f, char *err) {
    char *line = NULL, values[256];
    size_t cap = 0;
    ssize_t len;
    long at = 0, line_no = 0;
    int rc = 0;
    cJSON *want = cJSON_Parse(o->header);
    while (rc == 0 && (len = getline(&line, &cap, f)) > 0) {
        line_no++;
        if (line[len - 1] != '\n') { /* the crash's partial line: every byte before it stays */
            if (truncate(o->path, at) != 0) rc = fg_fail(err, "--output %s: %s", o->path, strerror(errno));
            break;
        }
        at += len;
        cJSON *rec = cJSON_Parse(line);
        if (line_no == 1) {
            const cJSON *job = fg_json_get(rec, "flexgen_job");
            const char *key = job ? header_differs(job, fg_json_get(want, "flexgen_job"), values, sizeof values) : NULL;
            if (!job) rc = fg_fail(err, "--resume: %s does not start with a flexgen job line", o->path);
            else if (key) rc = fg_fail(err, "--resume: %s is the output of another job: %s is %s", o->path, key, values);
        } else {
            const cJSON *id = fg_json_get(rec, "id");
            char **grown = id ? realloc(o->done, (size_t)(o->n_done + 1) * sizeof *grown) : NULL;
            if (!id) rc = fg_fail(err, "--resume: %s line %ld: not a record of this job", o->path, line_no);
            else if (!grown) rc = fg_fail(err, "out of memory");
            else if (!(grown[o->n_done] = cJSON_PrintUnformatted(id))) o->done = grown, rc = fg_fail(err, "out of memory");
            else o->done = grown, o->n_done++;
        }
        cJSON_Delete(rec);
    }
    free(line);
    cJSON_Delete(want);
    if (rc == 0) qsort(o->done, (size_t)o->n_done, sizeof *o->done, by_string);
    return rc;
}

int job_output_open(job_output *o, const char *path, char *header, int resume, char *err) {
    *o = (job_output){.path = path, .header = header, .fd = -1};
    struct stat st;
    if (stat(path, &st) != 0) { /* made by the first window: its directory must take it */
        char dir[FG_PATH_LEN];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (errno != ENOENT) return fg_fail(err, "--output %s: %s", path, strerror(errno));
        if (slash) *slash = 0;
        return check_dir("--output", !slash ? "." : slash == dir ? "/" : dir, err);
    }
    if (!S_ISREG(st.st_mode)) return fg_fail(err, "--output %s: not a regular file", path);
    if (st.st_size == 0) return 0;
    if (!resume) return fg_fail(err, "--output %s: exists; --resume finishes its job, or give another file", path);
    FILE *f = fopen(path, "r");
    if (!f) return fg_fail(err, "--output %s: %s", path, strerror(errno));
    int rc = read_done(o, f, err);
    fclose(f);
    o->exists = 1;
    return rc;
}

int job_output_done(const job_output *o, const char *id) {
    return o->n_done && bsearch(&id, o->done, (size_t)o->n_done, sizeof *o->done, by_string) != NULL;
}

/* A write that failed part way is undone: the output keeps whole lines, and a file this job made
 * with nothing whole in it is removed. */
static int append_failed(job_output *o, off_t before, int e, char *err) {
    if (before == 0 && !o->exists) unlink(o->path);
    else if (ftruncate(o->fd, before) != 0) { /* the reader drops a cut last line anyway */ }
    return fg_fail(err, "--output %s: write failed: %s", o->path, fg_write_failure(o->path, e));
}

int job_output_append(job_output *o, const char *lines, size_t len, char *err) {
    if (o->fd < 0) {
        o->fd = open(o->path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (o->fd < 0) return fg_fail(err, "--output %s: %s", o->path, strerror(errno));
        struct stat st;
        if (fstat(o->fd, &st) == 0 && st.st_size == 0) { /* a new file: its first window carries the header */
            size_t h = strlen(o->header);
            char *both = malloc(h + 1 + len);
            if (!both) return fg_fail(err, "out of memory");
            memcpy(both, o->header, h), both[h] = '\n', memcpy(both + h + 1, lines, len);
            int rc = job_output_append(o, both, h + 1 + len, err);
            free(both);
            return rc;
        }
    }
    off_t before = lseek(o->fd, 0, SEEK_END);
    for (size_t done = 0; done < len;) {
        ssize_t w = write(o->fd, lines + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return append_failed(o, before, w < 0 ? errno : EIO, err);
        done += (size_t)w;
    }
    if (fdatasync(o->fd) != 0) return append_failed(o, before, errno, err);
    o->exists = 1;
    return 0;
}

void job_output_close(job_output *o) {
    if (o->fd >= 0) close(o->fd);
    for (int i = 0; i < o->n_done; i++) free(o->done[i]);
    free(o->done);
    free(o->header);
    o->fd = -1, o->done = NULL, o->n_done = 0, o->header = NULL;
}

/* One record, with its newline. text: the prompt as given (NULL: it came as ids); tok: NULL
 * where there is no tokenizer (no completion text then). */
char *job_record(const char *id, const char *text, const int *prompt, int prompt_len, const int *gen,
                 int gen_len, int stop_at_eos, const fg_tokenizer *tok) {
    int n = 0;
    while (n < gen_len && gen[n] != OPT_EOS_ID) n++;
    const char *stop = n < gen_len ? "eos" : "length";
    if (!stop_at_eos) n = gen_len, stop = "length";
    cJSON *r = cJSON_CreateObject();
    cJSON_AddItemToObject(r, "id", cJSON_Parse(id));
    if (text) cJSON_AddStringToObject(r, "prompt", text);
    else cJSON_AddItemToObject(r, "prompt_ids", cJSON_CreateIntArray(prompt, prompt_len));
    if (tok) {
        size_t len, clean_len;
        char *raw = tokenizer_decode(tok, gen, n, &len);
        char *clean = raw ? utf8_replace_invalid(raw, len, &clean_len) : NULL;
        cJSON_AddStringToObject(r, "completion", clean ? clean : "");
        free(raw), free(clean);
    }
    cJSON_AddItemToObject(r, "tokens", cJSON_CreateIntArray(gen, n));
    cJSON_AddStringToObject(r, "stop", stop);
    char *line = cJSON_PrintUnformatted(r), *with_newline = line ? realloc(line, strlen(line) + 2) : NULL;
    if (with_newline) strcat(with_newline, "\n");
    else free(line);
    cJSON_Delete(r);
    return with_newline;
}
