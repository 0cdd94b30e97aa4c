/* support/tokenizer_json.c: HF tokenizers' tokenizer.json, the file LLaMA, Mistral and Qwen2
 * checkpoints carry, read into tokenizer.c's BPE. The parts read:
 *   model           BPE: vocab, merges ("a b" strings or [a, b] pairs), unk_token, fuse_unk,
 *                   byte_fallback, ignore_merges;
 *   normalizer      none, NFC, or SentencePiece's Prepend("▁") and Replace(" ", "▁"), alone or
 *                   in a Sequence;
 *   pre_tokenizer   none (the text between added tokens is one word), ByteLevel (with GPT-2's
 *                   regex or without), Metaspace (unsplit), or LLaMA 3's or Qwen2's Split regex
 *                   followed by ByteLevel;
 *   post_processor  the BOS of a TemplateProcessing "<bos> $A" (or none); add_bos_token in the
 *                   tokenizer_config.json beside the file has the last word, as in transformers;
 *   decoder         whether it strips the leading space that the SentencePiece prefix put there
 *                   (Strip), or every U+2581 of the first token (Metaspace);
 *   added_tokens    cut out of the text before all the rest.
 * Anything else gets one line naming the field and its value: a tokenizer this file cannot follow
 * is refused, never approximated.
 */
#define _POSIX_C_SOURCE 200809L
#include "support/support.h"
#include "support/tools.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define META "\xE2\x96\x81" /* U+2581, SentencePiece's space */
#define MAX_ID ((1 << 24) - 1)

/* The two Split patterns implemented (tokenizer_encode.c's split_end). */
static const char LLAMA3_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static const char *str_of(const cJSON *o, const char *key) {
    const cJSON *v = fg_json_get(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int is(const cJSON *o, const char *key, const char *value) {
    const char *s = str_of(o, key);
    return s && !strcmp(s, value);
}

static int flag(const cJSON *o, const char *key) { return cJSON_IsTrue(fg_json_get(o, key)); }

/* "PATH: FIELD type "X" is not implemented (WHAT)". */
static int refuse(const char *path, const char *field, const cJSON *o, const char *what,
                  char *err) {
    const char *type = str_of(o, "type");
    return fg_fail(err, "%s: %s %s%s%s is not implemented (%s)", path, field, type ? "\"" : "",
                   type ? type : "of this form", type ? "\"" : "", what);
}

/* *parts: a Sequence's list of parts (under `key`), or NULL where o is not a Sequence; -1 (err
 * set) where a Sequence has no list there: read as no parts, it would drop the rules silently. */
static int parts_of(const cJSON *o, const char *key, const cJSON **parts, const char *path,
                    char *err) {
    *parts = NULL;
    if (!is(o, "type", "Sequence")) return 0;
    const cJSON *list = fg_json_get(o, key);
    if (!cJSON_IsArray(list))
        return fg_fail(err, "%s: a Sequence's \"%s\" is not a list", path, key);
    *parts = list;
    return 0;
}

typedef int (*part_reader)(const cJSON *part, tok_rules *r, const char *path, char *err);

/* read(part) for each part of o (a Sequence under `key`, or o alone); nothing for null. */
static int read_parts(const cJSON *o, const char *key, part_reader read, tok_rules *r,
                      const char *path, char *err) {
    if (!o || cJSON_IsNull(o)) return 0;
    const cJSON *parts, *p;
    if (parts_of(o, key, &parts, path, err)) return -1;
    if (!parts) return read(o, r, path, err);
    cJSON_ArrayForEach(p, parts) if (read(p, r, path, err)) return -1;
    return 0;
}

/* ---- normalizer ---- */

static int read_normalizer_part(const cJSON *n, tok_rules *r, const char *path, char *err) {
    const cJSON *pattern = fg_json_get(n, "pattern");
    if (is(n, "type", "NFC")) r->nfc = 1;
    else if (is(n, "type", "Prepend") && is(n, "prepend", META)) r->prepend = PREPEND_EACH;
    else if (is(n, "type", "Replace") && is(pattern, "String", " ") && is(n, "content", META))
        r->spaces_to_meta = 1;
    else
        return refuse(path, "normalizer", n,
                      "NFC, Prepend(\"\u2581\") and Replace(\" \", \"\u2581\") are", err);
    return 0;
}

/* ---- pre_tokenizer ---- */

/* Metaspace with "split": false (before that field, it split the text at each U+2581); an older
 * add_prefix_space stands for prepend_scheme always or never. */
static int read_metaspace(const cJSON *m, tok_rules *r, const char *path, char *err) {
    const char *scheme = str_of(m, "prepend_scheme");
    if (!scheme) scheme = flag(m, "add_prefix_space") ? "always" : "never";
    if (!is(m, "replacement", META) || !cJSON_IsFalse(fg_json_get(m, "split")))
        return refuse(path, "pre_tokenizer", m, "Metaspace splits no words here: \"split\": false",
                      err);
    r->spaces_to_meta = 1;
    if (!strcmp(scheme, "always")) r->prepend = PREPEND_EACH_UNLESS_THERE;
    else if (!strcmp(scheme, "first")) r->prepend = PREPEND_FIRST_UNLESS_THERE;
    else if (strcmp(scheme, "never"))
        return refuse(path, "pre_tokenizer", m, "prepend_scheme", err);
    return 0;
}

static int read_byte_level(const cJSON *b, tok_rules *r, int regex_allowed, const char *path,
                           char *err) {
    if (flag(b, "add_prefix_space") || (flag(b, "use_regex") && !regex_allowed))
        return refuse(path, "pre_tokenizer", b, "ByteLevel adds no prefix space here", err);
    r->byte_level = 1;
    if (flag(b, "use_regex")) r->pretok = PRETOK_GPT2;
    return 0;
}

/* [Split(LLaMA 3's or Qwen2's regex, Isolated), ByteLevel(no regex)]. */
static int read_split_sequence(const cJSON *parts, tok_rules *r, const char *path, char *err) {
    const cJSON *split = cJSON_GetArrayItem(parts, 0), *bytes = cJSON_GetArrayItem(parts, 1);
    const char *regex = str_of(fg_json_get(split, "pattern"), "Regex");
    int ok = cJSON_GetArraySize(parts) == 2 && is(split, "type", "Split") && regex &&
             is(split, "behavior", "Isolated") && !flag(split, "invert") &&
             is(bytes, "type", "ByteLevel");
    if (ok && !strcmp(regex, LLAMA3_SPLIT)) r->pretok = PRETOK_LLAMA3;
    else if (ok && !strcmp(regex, QWEN2_SPLIT)) r->pretok = PRETOK_QWEN2;
    else
        return fg_fail(err,
                       "%s: pre_tokenizer: a Sequence other than LLaMA 3's or Qwen2's Split "
                       "regex and ByteLevel is not implemented",
                       path);
    return read_byte_level(bytes, r, 0, path, err);
}

static int read_pre_tokenizer(const cJSON *p, tok_rules *r, const char *path, char *err) {
    if (!p || cJSON_IsNull(p)) return 0;
    if (is(p, "type", "ByteLevel")) return read_byte_level(p, r, 1, path, err);
    if (is(p, "type", "Metaspace")) return read_metaspace(p, r, path, err);
    const cJSON *parts;
    if (parts_of(p, "pretokenizers", &parts, path, err)) return -1;
    if (parts) return read_split_sequence(parts, r, path, err);
    return refuse(path, "pre_tokenizer", p,
                  "ByteLevel, Metaspace and LLaMA 3's and Qwen2's Split are", err);
}

/* A token id: an integer in [0, MAX_ID], or -1. */
static int id_of(const cJSON *v) {
    double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
    return d >= 0 && d <= MAX_ID && d == (double)(int)d ? (int)d : -1;
}

/* ---- decoder and post_processor ---- */

/* A Metaspace decoder turns U+2581 into spaces and, unless its prepend_scheme is "never", drops
 * every U+2581 of the first token, HF tokenizers' rule; the older add_prefix_space stands for
 * "always" or "never". */
static int read_metaspace_decoder(const cJSON *d, tok_rules *r, const char *path, char *err) {
    const char *scheme = str_of(d, "prepend_scheme");
    if (!scheme) scheme = flag(d, "add_prefix_space") ? "always" : "never";
    if (!is(d, "replacement", META) ||
        (strcmp(scheme, "first") && strcmp(scheme, "always") && strcmp(scheme, "never")))
        return refuse(path, "decoder", d,
                      "Metaspace with the replacement \u2581 and a prepend_scheme of first, "
                      "always or never is",
                      err);
    r->drop_first_meta = strcmp(scheme, "never") != 0;
    return 0;
}

static int read_decoder_part(const cJSON *d, tok_rules *r, const char *path, char *err) {
    const cJSON *pattern = fg_json_get(d, "pattern"), *start = fg_json_get(d, "start");
    if (is(d, "type", "Strip") && is(d, "content", " ") && cJSON_IsNumber(start) &&
        start->valueint <= 1)
        r->strip_space = start->valueint == 1;
    else if (is(d, "type", "Metaspace")) return read_metaspace_decoder(d, r, path, err);
    else if (!is(d, "type", "ByteLevel") && !is(d, "type", "ByteFallback") &&
             !is(d, "type", "Fuse") &&
             !(is(d, "type", "Replace") && is(pattern, "String", META) && is(d, "content", " ")))
        return refuse(path, "decoder", d,
                      "ByteLevel, ByteFallback, Fuse, Replace(\"\u2581\", \" \"), "
                      "Strip(\" \", 1, 0) and Metaspace are",
                      err);
    return 0;
}

/* TemplateProcessing's single template: "$A" or "<bos> $A"; n_ids: one past the largest id of the
 * vocab and the added tokens. */
static int read_template(const cJSON *t, int n_ids, tok_rules *r, const char *path, char *err) {
    const cJSON *single = fg_json_get(t, "single");
    int n = cJSON_GetArraySize(single);
    const cJSON *first = fg_json_get(cJSON_GetArrayItem(single, 0), "SpecialToken");
    const cJSON *last = fg_json_get(cJSON_GetArrayItem(single, n - 1), "Sequence");
    const char *bos = str_of(first, "id");
    const cJSON *ids =
        fg_json_get(fg_json_get(fg_json_get(t, "special_tokens"), bos ? bos : ""), "ids");
    if (n == 1 && is(last, "id", "A")) return 0;
    if (n != 2 || !is(last, "id", "A") || !bos)
        return refuse(path, "post_processor", t, "templates \"$A\" and \"<bos> $A\" are", err);
    /* one id of a token: taken as it came, -5 would be no BOS at all and 1e30 INT_MAX */
    int id = id_of(cJSON_GetArrayItem(ids, 0));
    if (cJSON_GetArraySize(ids) != 1 || id < 0 || id >= n_ids)
        return fg_fail(
            err,
            "%s: post_processor.special_tokens[\"%s\"].ids: expected one token id, an integer in "
            "[0, %d)",
            path, bos, n_ids);
    r->bos_id = id;
    return 0;
}

static int read_post_processor(const cJSON *p, int n_ids, tok_rules *r, const char *path,
                               char *err) {
    if (!p || cJSON_IsNull(p) || is(p, "type", "ByteLevel")) return 0;
    if (is(p, "type", "TemplateProcessing")) return read_template(p, n_ids, r, path, err);
    const cJSON *parts, *q;
    if (parts_of(p, "processors", &parts, path, err)) return -1;
    if (!parts)
        return refuse(path, "post_processor", p, "TemplateProcessing and ByteLevel are", err);
    cJSON_ArrayForEach(q, parts) if (read_post_processor(q, n_ids, r, path, err)) return -1;
    return 0;
}

/* One past the largest id of model.vocab and added_tokens (ids out of range are refused where
 * they are read). */
static int ids_bound(const cJSON *root) {
    int bound = 0;
    const cJSON *vocab = fg_json_get(fg_json_get(root, "model"), "vocab"), *e;
    for (e = cJSON_IsObject(vocab) ? vocab->child : NULL; e; e = e->next)
        if (id_of(e) >= bound) bound = id_of(e) + 1;
    cJSON_ArrayForEach(e,
                       fg_json_get(root, "added_tokens")) if (id_of(fg_json_get(e, "id")) >= bound)
        bound = id_of(fg_json_get(e, "id")) + 1;
    return bound;
}

/* ---- model ---- */

static int check_model(const cJSON *m, const char *path, char *err) {
    const char *prefix = str_of(m, "continuing_subword_prefix"),
               *suffix = str_of(m, "end_of_word_suffix");
    const cJSON *dropout = fg_json_get(m, "dropout");
    if (!m) /* a vocab.json, say */
        return fg_fail(err,
                       "%s: not a tokenizer.json (it has no \"model\"); a vocab.json goes with "
                       "--vocab and --merges",
                       path);
    if (!is(m, "type", "BPE")) return refuse(path, "model", m, "BPE is", err);
    if (dropout && !cJSON_IsNull(dropout))
        return fg_fail(err, "%s: model.dropout: BPE dropout is not implemented", path);
    if ((prefix && *prefix) || (suffix && *suffix))
        return fg_fail(
            err, "%s: model: a continuing_subword_prefix or end_of_word_suffix is not implemented",
            path);
    if (!cJSON_IsObject(fg_json_get(m, "vocab")) || !cJSON_IsArray(fg_json_get(m, "merges")))
        return fg_fail(err, "%s: model: no \"vocab\" object or no \"merges\" list", path);
    if (!fg_json_get(m, "vocab")->child) return fg_fail(err, "%s: model.vocab is empty", path);
    return 0;
}

static int read_vocab(fg_tokenizer *t, const cJSON *vocab, const char *path, char *err) {
    for (const cJSON *v = vocab->child; v; v = v->next)
        if (tokenizer_add_token(t, v->string, strlen(v->string), id_of(v), path, err)) return -1;
    return 0;
}

/* One merge, "a b" or ["a", "b"]. */
static int read_merge(fg_tokenizer *t, const cJSON *e, int rank, const char *path, char *err) {
    char where[FG_ERR_LEN];
    snprintf(where, sizeof where, "%s: model.merges[%d]", path, rank);
    const char *a = cJSON_IsString(e) ? e->valuestring : NULL, *b = a ? strchr(a, ' ') : NULL;
    if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
        cJSON_IsString(e->child->next))
        return tokenizer_add_merge(t, e->child->valuestring, strlen(e->child->valuestring),
                                   e->child->next->valuestring, strlen(e->child->next->valuestring),
                                   rank, where, err);
    if (!b || strchr(b + 1, ' ')) return fg_fail(err, "%s: not \"a b\" or [\"a\", \"b\"]", where);
    return tokenizer_add_merge(t, a, (size_t)(b - a), b + 1, strlen(b + 1), rank, where, err);
}

static fg_tokenizer *read_model(const cJSON *m, const tok_rules *rules, const char *path,
                                char *err) {
    if (check_model(m, path, err)) return NULL;
    const cJSON *vocab = fg_json_get(m, "vocab"), *merges = fg_json_get(m, "merges"), *e;
    int n_vocab = 0;
    for (const cJSON *v = vocab->child; v; v = v->next) {
        if (id_of(v) < 0) {
            fg_fail(err, "%s: model.vocab: token %d has no id in [0, %d]", path, n_vocab, MAX_ID);
            return NULL;
        }
        if (id_of(v) >= n_vocab) n_vocab = id_of(v) + 1;
    }
    fg_tokenizer *t = tokenizer_new(rules, n_vocab, err);
    int rank = 0, rc = t ? read_vocab(t, vocab, path, err) : -1;
    cJSON_ArrayForEach(e, merges) if (rc == 0) rc = read_merge(t, e, rank++, path, err);
    if (rc) tokenizer_free(t);
    return rc ? NULL : t;
}

/* ---- added tokens, and the whole file ---- */

static int read_added(const cJSON *list, tok_added **out, int *n, const char *path, char *err) {
    *n = cJSON_GetArraySize(list);
    *out = calloc((size_t)(*n > 0 ? *n : 1), sizeof **out);
    if (!*out) return fg_fail(err, "%s: out of memory", path);
    const cJSON *a;
    int i = 0;
    cJSON_ArrayForEach(a, list) {
        const char *text = str_of(a, "content");
        if (!text || !*text || id_of(fg_json_get(a, "id")) < 0)
            return fg_fail(err, "%s: added_tokens[%d]: no \"content\" text or no \"id\" in [0, %d]",
                           path, i, MAX_ID);
        (*out)[i++] = (tok_added){text,
                                  strlen(text),
                                  id_of(fg_json_get(a, "id")),
                                  flag(a, "lstrip"),
                                  flag(a, "rstrip"),
                                  flag(a, "single_word")};
    }
    return 0;
}

/* add_bos_token in the tokenizer_config.json beside path: false drops the BOS; true, where the
 * post_processor has none, takes bos_token's id. */
static int read_add_bos(const char *path, const tok_added *added, int n_added, tok_rules *r,
                        char *err) {
    char cfg[FG_PATH_LEN + 64];
    path_beside(path, fg_tokenizer_side_files[0], cfg, sizeof cfg);
    if (access(cfg, F_OK) != 0) return 0;
    cJSON *root = fg_json_read_file(cfg, err);
    if (!root) return -1;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: not a JSON object", cfg);
    }
    const cJSON *add = fg_json_get(root, "add_bos_token"), *bos = fg_json_get(root, "bos_token");
    const char *text = cJSON_IsString(bos) ? bos->valuestring : str_of(bos, "content");
    if (add && !cJSON_IsBool(add) && !cJSON_IsNull(add)) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: add_bos_token is not true or false", cfg);
    }
    if (cJSON_IsFalse(add)) r->bos_id = -1;
    for (int i = 0; cJSON_IsTrue(add) && r->bos_id < 0 && text && i < n_added; i++)
        if (!strcmp(added[i].text, text)) r->bos_id = added[i].id;
    cJSON_Delete(root);
    return 0;
}

static fg_tokenizer *read_tokenizer(const cJSON *root, const char *path, char *err) {
    tok_rules rules = {.bos_id = -1};
    const cJSON *m = fg_json_get(root, "model");
    if (read_parts(fg_json_get(root, "normalizer"), "normalizers", read_normalizer_part, &rules,
                   path, err) ||
        read_pre_tokenizer(fg_json_get(root, "pre_tokenizer"), &rules, path, err) ||
        read_parts(fg_json_get(root, "decoder"), "decoders", read_decoder_part, &rules, path,
                   err) ||
        read_post_processor(fg_json_get(root, "post_processor"), ids_bound(root), &rules, path,
                            err))
        return NULL;
    if (rules.byte_level && (rules.prepend || rules.spaces_to_meta)) {
        fg_fail(err, "%s: a ByteLevel pre_tokenizer with SentencePiece's \u2581 is not implemented",
                path);
        return NULL;
    }
    rules.byte_fallback = flag(m, "byte_fallback");
    rules.fuse_unk = flag(m, "fuse_unk");
    rules.ignore_merges = flag(m, "ignore_merges");
    tok_added *added = NULL;
    int n_added = 0;
    if (read_added(fg_json_get(root, "added_tokens"), &added, &n_added, path, err) ||
        read_add_bos(path, added, n_added, &rules, err)) {
        free(added);
        return NULL;
    }
    fg_tokenizer *t = read_model(m, &rules, path, err);
    if (t && tokenizer_finish(t, added, n_added, str_of(m, "unk_token"), path, err)) {
        tokenizer_free(t);
        t = NULL;
    }
    free(added);
    return t;
}

fg_tokenizer *tokenizer_load_json(const char *path, char *err) {
    cJSON *root = fg_json_read_file(path, err);
    if (!root) return NULL;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        fg_fail(err, "%s: not a JSON object (malformed tokenizer.json)", path);
        return NULL;
    }
    fg_tokenizer *t = read_tokenizer(root, path, err);
    cJSON_Delete(root);
    return t;
}

fg_tokenizer *tokenizer_load_dir(const char *dir, char *err) {
    char json[4200], vocab[4200], merges[4200];
    snprintf(json, sizeof json, "%s/tokenizer.json", dir);
    snprintf(vocab, sizeof vocab, "%s/vocab.json", dir);
    snprintf(merges, sizeof merges, "%s/merges.txt", dir);
    err[0] = '\0';
    if (access(json, F_OK) == 0) return tokenizer_load_json(json, err);
    if (access(vocab, F_OK) == 0 && access(merges, F_OK) == 0)
        return tokenizer_load(vocab, merges, err);
    return NULL;
}
