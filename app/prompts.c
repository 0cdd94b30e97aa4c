/* app/prompts.c: the prompts of a run: --prompt texts, a --prompt-file of text or JSONL lines,
 * --prompt-ids, or FlexGen's synthetic ones; each tokenized after its BOS, and checked against
 * the model's vocab. The tokenizer a run opens is chosen here too.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

void prompts_free(prompt_set *p) {
    for (int i = 0; i < p->n; i++) free(p->ids[i]), free(p->record_ids[i]), free(p->texts[i]);
    free(p->ids);
    free(p->lens);
    free(p->index);
    free(p->record_ids);
    free(p->texts);
    memset(p, 0, sizeof *p);
}

/* Takes ids, id and text (id and text may be NULL), as prompt p->n of the file. */
static int prompts_add_record(prompt_set *p, int *ids, int len, char *id, char *text, char *err) {
    if (p->n == p->cap) {
        int cap = p->cap * 2 + 8, ok = 1;
        void **arrays[5] = {(void **)&p->ids, (void **)&p->lens, (void **)&p->index,
                            (void **)&p->record_ids, (void **)&p->texts};
        size_t sizes[5] = {sizeof *p->ids, sizeof *p->lens, sizeof *p->index, sizeof *p->record_ids,
                           sizeof *p->texts};
        for (int k = 0; k < 5 && ok; k++) {
            void *grown = realloc(*arrays[k], (size_t)cap * sizes[k]);
            if (grown) *arrays[k] = grown;
            ok = grown != NULL;
        }
        if (!ok) {
            free(ids);
            free(id);
            free(text);
            return fg_fail(err, "out of memory");
        }
        p->cap = cap;
    }
    p->ids[p->n] = ids;
    p->lens[p->n] = len;
    p->index[p->n] = p->n;
    p->record_ids[p->n] = id;
    p->texts[p->n] = text;
    p->n++;
    return 0;
}

int prompts_add(prompt_set *p, int *ids, int len, char *err) {
    return prompts_add_record(p, ids, len, NULL, NULL, err);
}

/* The tokenizer's BOS (if it has one) + the text's tokens; the record keeps the text (valid
 * UTF-8) and its id (taken; NULL: its number). */
int add_text_prompt(prompt_set *p, const fg_tokenizer *tok, const char *text, size_t len, char *id,
                    char *err) {
    int *ids, n;
    if (!id && (id = malloc(16))) snprintf(id, 16, "%d", p->n + 1);
    if (!id) return fg_fail(err, "out of memory");
    if (tokenizer_encode(tok, text, len, &ids, &n, err)) {
        free(id);
        return -1;
    }
    int *with_bos = malloc((size_t)(n + 1) * sizeof *with_bos), bos = tokenizer_bos_id(tok) >= 0;
    char *clean = utf8_replace_invalid(text, len, NULL);
    if (!with_bos || !clean) {
        free(ids);
        free(with_bos);
        free(clean);
        free(id);
        return fg_fail(err, "out of memory");
    }
    with_bos[0] = tokenizer_bos_id(tok);
    memcpy(with_bos + bos, ids, (size_t)n * sizeof *ids);
    free(ids);
    return prompts_add_record(p, with_bos, n + bos, id, clean, err);
}

static int is_jsonl(const char *path) { /* F.jsonl, or F.JSONL */
    size_t n = strlen(path);
    return n > 6 && !strcasecmp(path + n - 6, ".jsonl");
}

/* A JSONL line's prompt and its id (jobs.c parses the line): a text is tokenized as --prompt's. */
static int add_jsonl_prompt(prompt_set *p, const char *path, int line_no, const char *line,
                            const fg_tokenizer *tok, int vocab, char *err) {
    int *ids, n, rc;
    char *id, *text;
    if (jsonl_prompt(path, line_no, line, vocab, &ids, &n, &id, &text, err)) return -1;
    if (ids) return prompts_add_record(p, ids, n, id, NULL, err);
    if (!tok) {
        rc = fg_fail(err,
                     "%s line %d: a text prompt needs a tokenizer (the model directory's "
                     "tokenizer.json, or --vocab and --merges)",
                     path, line_no);
        free(id);
    } else rc = add_text_prompt(p, tok, text, strlen(text), id, err);
    free(text);
    return rc;
}

static int parse_id_line(const char *path, int line_no, char *line, int vocab, int **out, int *n,
                         char *err) {
    int cap = 16, count = 0, *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return fg_fail(err, "out of memory");
    for (char *s = line, *end;; s = end) {
        while (*s == ' ' || *s == '\t' || *s == '\r') s++;
        if (!*s) break;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || (*end && *end != ' ' && *end != '\t' && *end != '\r')) {
            free(ids);
            return fg_fail(err, "%s line %d: not a token id: '%.20s'", path, line_no, s);
        }
        if (v < 0 || v >= vocab) {
            free(ids);
            return fg_fail(err, "%s line %d: token id %ld out of range [0, %d)", path, line_no, v,
                           vocab);
        }
        if (count == cap) {
            int *grown = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!grown) {
                free(ids);
                return fg_fail(err, "out of memory");
            }
            ids = grown;
        }
        ids[count++] = (int)v;
    }
    if (count == 0) {
        free(ids);
        return fg_fail(err, "%s line %d: empty prompt", path, line_no);
    }
    *out = ids;
    *n = count;
    return 0;
}

/* Where the tokenizer came from, as the user named it: the flag and its file, or the model
 * directory's file. */
void tokenizer_origin(const cli_args *a, char *out, size_t n) {
    char json[FG_PATH_LEN + 32];
    snprintf(json, sizeof json, "%s/tokenizer.json", a->model);
    if (a->tokenizer) snprintf(out, n, "--tokenizer %s", a->tokenizer);
    else if (a->vocab) snprintf(out, n, "--vocab %s", a->vocab);
    else if (access(json, F_OK) == 0) snprintf(out, n, "%s", json);
    else snprintf(out, n, "%s/vocab.json", a->model);
}

int check_tokenized_ids(const char *origin, const char *name, const int *ids, int n, int vocab,
                        char *err) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return fg_fail(err,
                           "%s: token id %d of %s is out of range [0, %d) (the model's vocab_size)",
                           origin, ids[i], name, vocab);
    return 0;
}

/* Reads one prompt a line from path: token ids (tok == NULL), text, or (a name ending in .jsonl)
 * JSON objects, whose blank lines are skipped; each checked as it is read (check_prompt), so that
 * a prompt too long for the model is named by its line. A line may end in \r\n (a file written on
 * Windows): the \r is no part of a text prompt. A NUL byte ends no line: it is refused, as it
 * could only be a damaged or binary file. An empty line of ids or text is refused too: it would
 * be a prompt of BOS alone, more likely a slip than a wish (--prompt "" asks for one). origin:
 * the tokenizer's, for the line of a tokenized prompt with an id past the model's vocab. */
static int read_prompt_lines(prompt_set *p, const char *flag, const char *path,
                             const fg_tokenizer *tok, const char *origin, const model_config *c,
                             int gen_len, char *err) {
    int vocab = c->vocab;
    size_t size;
    char *text = fg_read_file(path, &size, err);
    if (!text) return fg_fail_flag(err, flag);
    int line_no = 0, rc = 0, jsonl = is_jsonl(path);
    for (char *line = text, *end; rc == 0 && line < text + size; line = end + 1) {
        end = memchr(line, '\n', (size_t)(text + size - line));
        if (!end) end = text + size;
        *end = 0;
        size_t len = (size_t)(end - line);
        if (len > 0 && line[len - 1] == '\r') line[--len] = 0;
        line_no++;
        int before = p->n;
        if (memchr(line, 0, len)) {
            rc = fg_fail(err, "%s line %d: a NUL byte inside the line", path, line_no);
        } else if (jsonl) {
            rc = strspn(line, " \t\r") == len
                     ? 0
                     : add_jsonl_prompt(p, path, line_no, line, tok, vocab, err);
        } else if (tok) {
            rc = len == 0 ? fg_fail(err, "%s line %d: empty prompt", path, line_no)
                          : add_text_prompt(p, tok, line, len, NULL, err);
        } else {
            int *ids = NULL, n = 0;
            char *id = malloc(16);
            if (id) snprintf(id, 16, "%d", line_no);
            rc = id ? parse_id_line(path, line_no, line, vocab, &ids, &n, err)
                    : fg_fail(err, "out of memory");
            if (rc == 0) rc = prompts_add_record(p, ids, n, id, NULL, err);
            else free(id);
        }
        if (rc == 0 && p->n > before) {
            char name[4200];
            snprintf(name, sizeof name, "%s line %d", path, line_no);
            if (p->texts[before]) /* tokenized here */
                rc = check_tokenized_ids(origin, name, p->ids[before], p->lens[before], vocab, err);
            if (rc == 0) rc = check_prompt(c, p->ids[before], p->lens[before], gen_len, name, err);
        }
    }
    free(text);
    if (rc == 0 && p->n == 0) rc = fg_fail(err, "%s: no prompts in the file", path);
    return rc;
}

/* FlexGen's benchmark prompts: BOS and prompt_len - 1 pseudo-random ids, one block's worth for
 * each stage (a pipeline keeps that many micro-batches in flight, §4.4). */
int synthetic_prompts(prompt_set *p, const cli_args *a, int stages, int vocab, char *err) {
    fg_rng rng;
    rng_seed(&rng, a->gen.seed ^ 0x5eedULL);
    int n = a->policy.gpu_batch_size * a->policy.num_gpu_batches * stages;
    for (int i = 0; i < n; i++) {
        int *ids = malloc((size_t)a->prompt_len * sizeof *ids);
        if (!ids) return fg_fail(err, "out of memory");
        ids[0] = OPT_BOS_ID;
        for (int t = 1; t < a->prompt_len; t++)
            ids[t] = 3 + (int)(rng_next(&rng) % (uint64_t)(vocab - 3));
        if (prompts_add(p, ids, a->prompt_len, err)) return -1;
    }
    return 0;
}

/* The tokenizer from --vocab/--merges or the model directory; NULL (no error) when there is
 * none and none is needed. */
int open_run_tokenizer(const cli_args *a, fg_tokenizer **tok, char *err) {
    char vocab[4096], merges[4096];
    *tok = NULL;
    if (!a->vocab != !a->merges) return fg_fail(err, "--vocab and --merges go together");
    if (a->vocab && a->tokenizer)
        return fg_fail(err, "--tokenizer: give it or --vocab and --merges, not both");
    if (a->tokenizer)
        return (*tok = tokenizer_load_json(a->tokenizer, err)) ? 0
                                                               : fg_fail_flag(err, "--tokenizer");
    if (a->vocab) {
        snprintf(vocab, sizeof vocab, "%s", a->vocab);
        snprintf(merges, sizeof merges, "%s", a->merges);
    } else {
        if (!is_dir(a->model)) return 0;
        *tok = tokenizer_load_dir(a->model, err);
        return *tok || !err[0] ? 0 : -1;
    }
    *tok = tokenizer_load(vocab, merges, err);
    return *tok ? 0 : -1;
}

int gather_prompts(const cli_args *a, const fg_tokenizer *tok, const model_config *c, prompt_set *p,
                   char *err) {
    int gen_len = a->gen.gen_len;
    if ((a->n_prompt_texts || (a->prompt_file && !is_jsonl(a->prompt_file))) && !tok)
        return fg_fail(err, "%s needs a tokenizer: " TOKENIZER_WAYS,
                       a->prompt_file ? "--prompt-file" : "--prompt");
    char origin[FG_PATH_LEN + 64];
    tokenizer_origin(a, origin, sizeof origin);
    if (a->prompt_ids)
        return read_prompt_lines(p, "--prompt-ids", a->prompt_ids, NULL, origin, c, gen_len, err);
    if (a->prompt_file)
        return read_prompt_lines(p, "--prompt-file", a->prompt_file, tok, origin, c, gen_len, err);
    for (int i = 0; i < a->n_prompt_texts; i++) {
        char name[32];
        snprintf(name, sizeof name, "--prompt %d", i + 1);
        if (add_text_prompt(p, tok, a->prompts[i], strlen(a->prompts[i]), NULL, err) ||
            check_tokenized_ids(origin, name, p->ids[p->n - 1], p->lens[p->n - 1], c->vocab, err))
            return -1;
    }
    return 0;
}

/* ---- output ---- */

/* The prompts' own tokens (prefill computes them and their padding). */
long prompt_tokens(const prompt_set *p) {
    long total = 0;
    for (int i = 0; i < p->n; i++) total += p->lens[i];
    return total;
}

int longest_prompt(const prompt_set *p) {
    int longest = 0;
    for (int i = 0; i < p->n; i++) longest = p->lens[i] > longest ? p->lens[i] : longest;
    return longest;
}

/* The prompts' mean length for the cost model: a job (--output) runs its prompts by length, so
 * that a block pads little. 0 otherwise: in file order a block pads to its longest prompt. */
int mean_prompt(const cli_args *a, const prompt_set *p) {
    return a->output && p->n ? (int)((prompt_tokens(p) + p->n - 1) / p->n) : 0;
}
