/* support/tokenizer.c: a BPE tokenizer's tables, and decoding. Two sources of rules: OPT's
 * vocab.json / merges.txt, read as HF transformers' slow GPT2Tokenizer reads them, and a
 * tokenizer.json (tokenizer_json.c reads it into tok_rules and calls tokenizer_new,
 * tokenizer_add_token, tokenizer_add_merge and tokenizer_finish here):
 *   - the symbol table (every string BPE can hold, interned) and the merge table by rank;
 *   - bytes_to_unicode's byte symbols, and <0xNN> byte tokens for byte fallback;
 *   - special and added tokens (</s>, <|endoftext|>, ...): read from the special-token files
 *     beside vocab.json as GPT2Tokenizer.from_pretrained reads them, with their lstrip, rstrip
 *     and single_word flags (tokenizer_encode.c applies them);
 *   - the decode table: each id's bytes (raw bytes back from the byte map; a Metaspace decoder
 *     drops the first token's U+2581), and tokenizer_decode.
 * Encoding (pre-tokenization and the merge loop) is tokenizer_encode.c's.
 */
#define _POSIX_C_SOURCE 200809L
#include "support/support.h"
#include "support/tools.h"
#include "support/nfc.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "support/tokenizer.h"

#define MAX_TOKEN_ID ((1 << 24) - 1) /* far above any real vocab; bounds the id -> text table */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_u64(uint64_t x) { /* splitmix64's finalizer */
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void symtab_free(symtab *st) {
    free(st->pool);
    free(st->off);
    free(st->len);
    free(st->id);
    free(st->slots);
}

/* Slot of s in the table: where it is, or the empty slot where it would go. */
static size_t symtab_slot(const symtab *st, const char *s, size_t n) {
    size_t i = (size_t)hash_bytes(s, n) & st->mask;
    for (;;) {
        int32_t k = st->slots[i];
        if (k < 0) return i;
        if (st->len[k] == n && memcmp(st->pool + st->off[k], s, n) == 0) return i;
        i = (i + 1) & st->mask;
    }
}

/* Index of s, or -1 when it is not in the table (a table without slots holds nothing). */
int symtab_find(const symtab *st, const char *s, size_t n) {
    if (!st->slots) return -1;
    return st->slots[symtab_slot(st, s, n)];
}

static int symtab_rehash(symtab *st, size_t nslots) {
    int32_t *slots = malloc(nslots * sizeof *slots);
    if (!slots) return -1;
    for (size_t i = 0; i < nslots; i++) slots[i] = -1;
    free(st->slots);
    st->slots = slots;
    st->mask = nslots - 1;
    for (int k = 0; k < st->n; k++)
        st->slots[symtab_slot(st, st->pool + st->off[k], st->len[k])] = k;
    return 0;
}

static int symtab_grow(symtab *st, size_t extra) {
    if (!st->pool || st->pool_len + extra > st->pool_cap) { /* a pool even for "": never NULL + 0 */
        size_t cap = st->pool_cap ? st->pool_cap : 4096;
        while (cap < st->pool_len + extra) cap *= 2;
        char *pool = realloc(st->pool, cap);
        if (!pool) return -1;
        st->pool = pool;
        st->pool_cap = cap;
    }
    if (st->n == st->cap) {
        int cap = st->cap ? st->cap * 2 : 1024;
        size_t *off = realloc(st->off, (size_t)cap * sizeof *off);
        if (off) st->off = off;
        size_t *len = realloc(st->len, (size_t)cap * sizeof *len);
        if (len) st->len = len;
        int32_t *id = realloc(st->id, (size_t)cap * sizeof *id);
        if (id) st->id = id;
        if (!off || !len || !id) return -1;
        st->cap = cap;
    }
    if ((size_t)(st->n + 1) * 2 > st->mask + 1)
        return symtab_rehash(st, st->slots ? (st->mask + 1) * 2 : 2048);
    return 0;
}

/* Index of s, added (with no vocab id) when new; -1 when out of memory. */
static int symtab_intern(symtab *st, const char *s, size_t n) {
    int found = symtab_find(st, s, n);
    if (found >= 0) return found;
    if (st->n == 0x7fffffff || symtab_grow(st, n) != 0) return -1;
    int k = st->n++;
    memcpy(st->pool + st->pool_len, s, n);
    st->off[k] = st->pool_len;
    st->len[k] = n;
    st->id[k] = -1;
    st->pool_len += n;
    st->slots[symtab_slot(st, s, n)] = k;
    return k;
}

static uint64_t pair_key(int a, int b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

static size_t merge_slot_of(const merge_map *m, uint64_t key) {
    size_t i = (size_t)hash_u64(key) & m->mask;
    while (m->slots[i].rank >= 0 && m->slots[i].key != key) i = (i + 1) & m->mask;
    return i;
}

const merge_slot *merge_find(const merge_map *m, int a, int b) {
    if (!m->slots) return NULL;
    const merge_slot *s = &m->slots[merge_slot_of(m, pair_key(a, b))];
    return s->rank >= 0 ? s : NULL;
}

static int merge_rehash(merge_map *m, size_t nslots) {
    merge_slot *old = m->slots;
    size_t old_n = old ? m->mask + 1 : 0;
    m->slots = malloc(nslots * sizeof *m->slots);
    if (!m->slots) {
        m->slots = old;
        return -1;
    }
    m->mask = nslots - 1;
    for (size_t i = 0; i < nslots; i++) m->slots[i].rank = -1;
    for (size_t i = 0; i < old_n; i++)
        if (old[i].rank >= 0) m->slots[merge_slot_of(m, old[i].key)] = old[i];
    free(old);
    return 0;
}

/* A repeated pair takes the later rank, as the reference's dict(zip(merges, range(...))) does. */
static int merge_put(merge_map *m, int a, int b, int rank, int result) {
    if ((m->count + 1) * 2 > (m->slots ? m->mask + 1 : 0) &&
        merge_rehash(m, m->slots ? (m->mask + 1) * 2 : 4096) != 0)
        return -1;
    uint64_t key = pair_key(a, b);
    merge_slot *s = &m->slots[merge_slot_of(m, key)];
    if (s->rank < 0) m->count++;
    s->key = key;
    s->rank = rank;
    s->result = result;
    return 0;
}

/* A token as it can be quoted in a one-line message: control bytes become '?', long ones are
 * cut at a character boundary. */
static void quote_token(char *dst, size_t cap, const char *s, size_t n) {
    size_t k = n < cap - 1 ? n : cap - 1;
    if (k < n)
        while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
    for (size_t i = 0; i < k; i++) {
        unsigned char c = (unsigned char)s[i];
        dst[i] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
    }
    dst[k] = '\0';
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
 * map in order to U+0100.. so that no token contains whitespace or control characters. */
static void bytes_to_unicode(int32_t cp[256]) {
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        cp[b] = printable ? b : 256 + extra++;
    }
}

static size_t utf8_put(char *dst, int32_t cp) {
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    dst[0] = (char)(0xC0 | (cp >> 6)); /* bytes_to_unicode stays below U+0800 */
    dst[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

static int intern_byte_symbols(fg_tokenizer *t) {
    int32_t cp[256];
    bytes_to_unicode(cp);
    for (int b = 0; b < 256; b++) {
        char s[4];
        size_t n = utf8_put(s, cp[b]);
        if ((t->byte_sym[b] = symtab_intern(&t->syms, s, n)) < 0) return -1;
    }
    return 0;
}

/* ---- vocab.json ---- */

static int check_id(const cJSON *item, const char *path, char *err) {
    char tok[64];
    quote_token(tok, sizeof tok, item->string, strlen(item->string));
    if (!cJSON_IsNumber(item)) {
        fg_fail(err, "%s: token \"%s\" has a non-integer id (not a number)", path, tok);
        return -1;
    }
    double d = item->valuedouble;
    if (!(d >= -1e18 && d <= 1e18) || d != (double)(long long)d) {
        fg_fail(err, "%s: token \"%s\" has a non-integer id %g", path, tok, d);
        return -1;
    }
    if (d < 0 || d > MAX_TOKEN_ID) {
        fg_fail(err, "%s: token \"%s\" has id %.0f, out of range [0, %d]", path, tok, d,
                MAX_TOKEN_ID);
        return -1;
    }
    return 0;
}

/* Validates every entry and finds the largest id. */
static int scan_vocab(const cJSON *root, const char *path, int *max_id, char *err) {
    if (!cJSON_IsObject(root)) {
        fg_fail(err, "%s: not a JSON object mapping tokens to ids", path);
        return -1;
    }
    *max_id = -1;
    for (const cJSON *it = root->child; it; it = it->next) {
        if (check_id(it, path, err) != 0) return -1;
        if ((int)it->valuedouble > *max_id) *max_id = (int)it->valuedouble;
    }
    if (*max_id < 0) {
        fg_fail(err, "%s: the vocab is empty", path);
        return -1;
    }
    return 0;
}

/* Interns every token and records id -> symbol. A repeated token takes its last id, as the
 * reference's json.load does. Two tokens with one id are refused: the reference would decode the
 * id to one of them and encode the other to it. New symbols are numbered in the order of their
 * first entry. */
static int fill_vocab(fg_tokenizer *t, const cJSON *root, int32_t *tok_sym, const char *path,
                      char *err) {
    int first = t->syms.n;
    for (const cJSON *it = root->child; it; it = it->next) {
        int k = symtab_intern(&t->syms, it->string, strlen(it->string));
        if (k < 0) return fg_fail(err, "%s: out of memory", path);
        t->syms.id[k] = (int)it->valuedouble;
    }
    for (int k = first; k < t->syms.n; k++) {
        int id = t->syms.id[k], j = tok_sym[id];
        if (j >= 0) {
            char a[64], b[64];
            quote_token(a, sizeof a, t->syms.pool + t->syms.off[j], t->syms.len[j]);
            quote_token(b, sizeof b, t->syms.pool + t->syms.off[k], t->syms.len[k]);
            return fg_fail(err, "%s: tokens \"%s\" and \"%s\" share id %d", path, a, b, id);
        }
        tok_sym[id] = k;
    }
    return 0;
}

static int load_vocab(fg_tokenizer *t, const char *path, int32_t **tok_sym, char *err) {
    cJSON *root = fg_json_read_file(path, err);
    if (!root) return -1;
    int max_id, rc = scan_vocab(root, path, &max_id, err);
    if (rc == 0) {
        t->vocab_size = max_id + 1;
        *tok_sym = malloc((size_t)t->vocab_size * sizeof **tok_sym);
        if (!*tok_sym) {
            rc = fg_fail(err, "%s: out of memory", path);
        } else {
            for (int i = 0; i < t->vocab_size; i++) (*tok_sym)[i] = -1;
            rc = fill_vocab(t, root, *tok_sym, path, err);
        }
    }
    cJSON_Delete(root);
    return rc;
}

/* ---- merges.txt ---- */

static int is_field_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

/* Splits a line into at most 3 whitespace-separated fields; returns how many (3 means 3+). */
static int split_fields(const char *s, size_t n, const char *f[3], size_t flen[3]) {
    int count = 0;
    size_t i = 0;
    while (count < 3) {
        while (i < n && is_field_space(s[i])) i++;
        if (i == n) break;
        f[count] = s + i;
        while (i < n && !is_field_space(s[i])) i++;
        flen[count] = (size_t)(s + i - f[count]);
        count++;
    }
    return count;
}

/* One "a b" line: the pair gets rank `rank`; its concatenation must be a vocab token. */
static int add_merge(fg_tokenizer *t, const char *f[2], const size_t flen[2], int rank,
                     const char *where, char *err) {
    int a = symtab_intern(&t->syms, f[0], flen[0]);
    int b = symtab_intern(&t->syms, f[1], flen[1]);
    char *cat = malloc(flen[0] + flen[1]);
    if (a < 0 || b < 0 || !cat) {
        free(cat);
        fg_fail(err, "%s: out of memory", where);
        return -1;
    }
    memcpy(cat, f[0], flen[0]);
    memcpy(cat + flen[0], f[1], flen[1]);
    int r = symtab_find(&t->syms, cat, flen[0] + flen[1]);
    if (r < 0 || t->syms.id[r] < 0) {
        char tok[64];
        quote_token(tok, sizeof tok, cat, flen[0] + flen[1]);
        fg_fail(err, "%s: merge result \"%s\" is not in the vocab", where, tok);
        free(cat);
        return -1;
    }
    free(cat);
    if (merge_put(&t->merges, a, b, rank, r) != 0) {
        fg_fail(err, "%s: out of memory", where);
        return -1;
    }
    return 0;
}

static int parse_merges(fg_tokenizer *t, const char *path, const char *buf, size_t len, char *err) {
    int line = 0, rank = 0;
    for (size_t pos = 0; pos < len;) {
        const char *s = buf + pos, *nl = memchr(s, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - s) : len - pos;
        pos += n + 1;
        line++;
        if (line == 1 && n >= 8 && memcmp(s, "#version", 8) == 0) continue;
        const char *f[3];
        size_t flen[3];
        int count = split_fields(s, n, f, flen);
        if (count == 0) continue; /* blank line */
        char where[FG_ERR_LEN];
        snprintf(where, sizeof where, "%s line %d", path, line);
        if (count != 2) {
            fg_fail(err, "%s: expected two symbols separated by a space, found %s", where,
                    count == 1 ? "one" : "three or more");
            return -1;
        }
        if (rank == 0x7fffffff || add_merge(t, f, flen, rank++, where, err) != 0) return -1;
    }
    return 0;
}

static int load_merges(fg_tokenizer *t, const char *path, char *err) {
    size_t len;
    char *buf = fg_read_file(path, &len, err);
    if (!buf) return -1;
    int rc = parse_merges(t, path, buf, len, err);
    free(buf);
    return rc;
}

/* ---- special and added tokens: the files beside vocab.json ----
 *
 * HF's slow tokenizer keeps its added tokens in two maps: the decoder (id -> AddedToken: a text
 * and the flags lstrip, rstrip, single_word) and the encoder (text -> id). from_pretrained fills
 * them from the checkpoint's files:
 *   tokenizer_config.json   bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
 *                           mask_token (each a string, an AddedToken object or null), the list
 *                           additional_special_tokens, and in newer checkpoints
 *                           added_tokens_decoder (id -> AddedToken); when that is there, it is
 *                           the only file read;
 *   special_tokens_map.json otherwise: special tokens again, over the config's;
 *   added_tokens.json       otherwise: text -> id, flags off.
 * GPT2Tokenizer then makes bos, eos and unk <|endoftext|> where the files say nothing, and each
 * special token becomes an added token: its vocab id, or the next id past the vocab (HF's
 * _add_tokens). A special token given as an AddedToken brings its flags; a plain string keeps
 * those of the added token with its text. ("normalized" only matters to lowercasing tokenizers.)
 * While loading, texts point into the parsed files. */
typedef struct {
    added_token *v;
    int n, cap;
} token_list;

/* The last entry with this text (a decoder can hold a text under two ids). */
static const added_token *find_text(const token_list *l, const char *s, size_t n) {
    for (int i = l->n - 1; i >= 0; i--)
        if (l->v[i].len == n && memcmp(l->v[i].text, s, n) == 0) return &l->v[i];
    return NULL;
}

static const added_token *find_id(const token_list *l, int id) {
    for (int i = 0; i < l->n; i++)
        if (l->v[i].id == id) return &l->v[i];
    return NULL;
}

/* Stores tok under its id (by_id: the decoder) or its text (the encoder), replacing what was
 * there in place, as assigning to a Python dict key does. */
static int token_list_put(token_list *l, const added_token *tok, int by_id) {
    const added_token *old = by_id ? find_id(l, tok->id) : find_text(l, tok->text, tok->len);
    if (old) {
        l->v[old - l->v] = *tok;
        return 0;
    }
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        added_token *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) return -1;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = *tok;
    return 0;
}

enum { N_SPECIAL = 7, SPECIAL_UNK = 2, SPECIAL_PAD = 4 };
static const char *const special_keys[N_SPECIAL] = {
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"};
enum { CONFIG_FILE, MAP_FILE, ADDED_FILE };
const char *const fg_tokenizer_side_files[3] = {"tokenizer_config.json", "special_tokens_map.json",
                                                "added_tokens.json"};

/* A special token as the files give it. */
typedef struct {
    int given;  /* 0: not in the files, 1: null, 2: a token */
    int object; /* an AddedToken (its flags count), not a plain string */
    added_token tok;
} special_token;

typedef struct {
    char dir[4096];
    cJSON *files[3]; /* CONFIG_FILE, MAP_FILE, ADDED_FILE when present */
    special_token special[N_SPECIAL];
    special_token *extra; /* additional_special_tokens */
    int n_extra, cap_extra;
    token_list decoder, encoder;
} added_loader;

/* files[which], parsed when the file exists; a missing file is no error. */
static int read_added_file(added_loader *L, int which, char *err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", L->dir, fg_tokenizer_side_files[which]);
    if (access(path, F_OK) != 0) return 0;
    if (!(L->files[which] = fg_json_read_file(path, err))) return -1;
    if (!cJSON_IsObject(L->files[which])) return fg_fail(err, "%s: not a JSON object", path);
    return 0;
}

/* An AddedToken object {"content": ..., "lstrip": ..., "rstrip": ..., "single_word": ...} (other
 * fields ignored), or, where strings are allowed, a string. `what` names it in errors. */
static int parse_token(const cJSON *v, int strings, const added_loader *L, int which,
                       const char *what, special_token *out, char *err) {
    static const char *const flags[3] = {"lstrip", "rstrip", "single_word"};
    memset(out, 0, sizeof *out);
    out->given = 2;
    const cJSON *content = cJSON_IsObject(v) ? fg_json_get(v, "content") : v;
    if (!cJSON_IsString(content) || (!strings && content == v))
        return fg_fail(err, "%s/%s: %s is not %san object with a \"content\" string", L->dir,
                       fg_tokenizer_side_files[which], what, strings ? "a string or " : "");
    out->object = content != v;
    out->tok.text = content->valuestring;
    out->tok.len = strlen(content->valuestring);
    int *dst[3] = {&out->tok.lstrip, &out->tok.rstrip, &out->tok.single_word};
    for (int i = 0; i < 3 && out->object; i++) {
        const cJSON *f = fg_json_get(v, flags[i]);
        if (f && !cJSON_IsBool(f))
            return fg_fail(err, "%s/%s: %s: \"%s\" is not true or false", L->dir,
                           fg_tokenizer_side_files[which], what, flags[i]);
        *dst[i] = cJSON_IsTrue(f);
    }
    return 0;
}

/* The special tokens of tokenizer_config.json or special_tokens_map.json, over those read
 * before; its additional_special_tokens are appended to theirs. */
static int read_special_keys(added_loader *L, int which, char *err) {
    const cJSON *root = L->files[which];
    for (const cJSON *it = root ? root->child : NULL; it; it = it->next) {
        int k = 0;
        while (k < N_SPECIAL && strcmp(it->string, special_keys[k]) != 0) k++;
        if (k < N_SPECIAL && cJSON_IsNull(it)) {
            L->special[k] = (special_token){.given = 1};
        } else if (k < N_SPECIAL) {
            if (parse_token(it, 1, L, which, special_keys[k], &L->special[k], err)) return -1;
        } else if (!strcmp(it->string, "additional_special_tokens") && !cJSON_IsNull(it)) {
            if (!cJSON_IsArray(it))
                return fg_fail(err, "%s/%s: additional_special_tokens is not a list", L->dir,
                               fg_tokenizer_side_files[which]);
            const cJSON *e;
            cJSON_ArrayForEach(e, it) {
                if (L->n_extra == L->cap_extra) {
                    int cap = L->cap_extra ? 2 * L->cap_extra : 8;
                    special_token *v = realloc(L->extra, (size_t)cap * sizeof *v);
                    if (!v) return fg_fail(err, "tokenizer: out of memory");
                    L->extra = v;
                    L->cap_extra = cap;
                }
                if (parse_token(e, 1, L, which, "an additional_special_tokens entry",
                                &L->extra[L->n_extra++], err))
                    return -1;
            }
        }
    }
    return 0;
}

/* tokenizer_config.json's added_tokens_decoder: {"id": AddedToken, ...}. */
static int read_decoder(added_loader *L, const cJSON *dec, char *err) {
    if (!cJSON_IsObject(dec))
        return fg_fail(err, "%s/tokenizer_config.json: added_tokens_decoder is not an object",
                       L->dir);
    for (const cJSON *it = dec->child; it; it = it->next) {
        char what[80], key[48], *end;
        quote_token(key, sizeof key, it->string, strlen(it->string));
        snprintf(what, sizeof what, "added_tokens_decoder \"%s\"", key);
        errno = 0;
        long id = strtol(it->string, &end, 10);
        if (end == it->string || *end || errno || id < 0 || id > MAX_TOKEN_ID)
            return fg_fail(err, "%s/tokenizer_config.json: %s: not a token id in [0, %d]", L->dir,
                           what, MAX_TOKEN_ID);
        special_token s;
        if (parse_token(it, 0, L, CONFIG_FILE, what, &s, err)) return -1;
        if (s.tok.len == 0) /* no text to cut out */
            return fg_fail(err, "%s/tokenizer_config.json: %s: the content is empty", L->dir, what);
        s.tok.id = (int)id;
        if (token_list_put(&L->decoder, &s.tok, 1)) return fg_fail(err, "tokenizer: out of memory");
    }
    return 0;
}

/* added_tokens.json: {"text": id, ...}, flags off. A repeated text takes its last id (as
 * json.load does); two texts with one id are refused, since HF would keep only one of them. */
static int read_added_json(added_loader *L, char *err) {
    const cJSON *root = L->files[ADDED_FILE];
    for (const cJSON *it = root ? root->child : NULL; it; it = it->next) {
        double d = it->valuedouble;
        if (!cJSON_IsNumber(it) || !(d >= 0 && d <= MAX_TOKEN_ID) || d != (double)(int)d) {
            char tok[64];
            quote_token(tok, sizeof tok, it->string, strlen(it->string));
            return fg_fail(err, "%s/added_tokens.json: token \"%s\" has no id in [0, %d]", L->dir,
                           tok, MAX_TOKEN_ID);
        }
        if (!it->string[0])
            return fg_fail(err, "%s/added_tokens.json: the token with id %d is empty", L->dir,
                           (int)d);
        int repeated = 0;
        for (const cJSON *next = it->next; next && !repeated; next = next->next)
            repeated = !strcmp(next->string, it->string);
        if (repeated) continue;
        const added_token *old = find_id(&L->decoder, (int)d);
        if (old) {
            char a[64], b[64];
            quote_token(a, sizeof a, old->text, old->len);
            quote_token(b, sizeof b, it->string, strlen(it->string));
            return fg_fail(err, "%s/added_tokens.json: tokens \"%s\" and \"%s\" share id %d",
                           L->dir, a, b, (int)d);
        }
        added_token tok = {.text = it->string, .len = strlen(it->string), .id = (int)d};
        if (token_list_put(&L->decoder, &tok, 1)) return fg_fail(err, "tokenizer: out of memory");
    }
    return 0;
}

static int vocab_id(const fg_tokenizer *t, const char *s, size_t n) {
    int k = symtab_find(&t->syms, s, n);
    return k >= 0 ? t->syms.id[k] : -1;
}

/* Special token i: the seven keys, then additional_special_tokens. */
static const special_token *special_at(const added_loader *L, int i) {
    return i < N_SPECIAL ? &L->special[i] : &L->extra[i - N_SPECIAL];
}

/* The index of the first special token in [from, to) with this text, or -1. */
static int find_special(const added_loader *L, int from, int to, const char *s, size_t n) {
    for (int i = from; i < to; i++) {
        const special_token *o = special_at(L, i);
        if (o->given == 2 && o->tok.len == n && memcmp(o->tok.text, s, n) == 0) return i;
    }
    return -1;
}

/* GPT2Tokenizer.__init__ and _add_tokens: each special token (the first of equal texts) into the
 * decoder and the encoder. */
static int add_special_tokens(const fg_tokenizer *t, added_loader *L, int n_vocab_keys) {
    int next_id = n_vocab_keys; /* len(get_vocab()): the vocab's texts and the added ones */
    for (int i = 0; i < L->encoder.n; i++)
        next_id += vocab_id(t, L->encoder.v[i].text, L->encoder.v[i].len) < 0;
    for (int i = 0; i < N_SPECIAL + L->n_extra; i++) {
        const special_token *s = special_at(L, i);
        if (s->given != 2 || s->tok.len == 0 || find_special(L, 0, i, s->tok.text, s->tok.len) >= 0)
            continue;
        const added_token *have = find_text(&L->encoder, s->tok.text, s->tok.len);
        if (have && !s->object) continue;
        added_token tok = s->tok;
        tok.id = have ? have->id : vocab_id(t, tok.text, tok.len);
        if (tok.id < 0) tok.id = next_id++;
        if (token_list_put(&L->decoder, &tok, 1) || token_list_put(&L->encoder, &tok, 0)) return -1;
    }
    return 0;
}

/* Which decoder entries decode to their own text: HF's "legacy" added tokens, those with no
 * special token's text, and additional special tokens past the vocab. The others go through the
 * byte map like vocab tokens. */
static void mark_raw(added_loader *L, int n_vocab_keys) {
    for (int i = 0; i < L->decoder.n; i++) {
        added_token *d = &L->decoder.v[i];
        const added_token *e = find_text(&L->encoder, d->text, d->len);
        int keyed = find_special(L, 0, N_SPECIAL, d->text, d->len) >= 0;
        int extra = find_special(L, N_SPECIAL, N_SPECIAL + L->n_extra, d->text, d->len) >= 0;
        d->raw = (e && !keyed && !extra) || (extra && e && e->id >= n_vocab_keys);
    }
}

/* Fills L from the files in L->dir, as GPT2Tokenizer.from_pretrained does. */
static int read_added_tokens(const fg_tokenizer *t, added_loader *L, char *err) {
    if (read_added_file(L, CONFIG_FILE, err) || read_special_keys(L, CONFIG_FILE, err)) return -1;
    const cJSON *dec = fg_json_get(L->files[CONFIG_FILE], "added_tokens_decoder");
    if (dec) {
        if (read_decoder(L, dec, err)) return -1;
        for (int k = 0; k < N_SPECIAL; k++) { /* a special token that the decoder holds is it */
            special_token *s = &L->special[k];
            const added_token *a =
                s->given == 2 ? find_text(&L->decoder, s->tok.text, s->tok.len) : NULL;
            if (a) {
                s->tok = *a;
                s->object = 1;
            }
        }
    } else if (read_added_file(L, MAP_FILE, err) || read_special_keys(L, MAP_FILE, err) ||
               read_added_file(L, ADDED_FILE, err) || read_added_json(L, err)) {
        return -1;
    }
    for (int k = 0; k < N_SPECIAL; k++) { /* GPT2Tokenizer's defaults, and its AddedTokens */
        special_token *s = &L->special[k];
        if (k <= SPECIAL_UNK && s->given == 0)
            *s = (special_token){.given = 2, .tok = {.text = "<|endoftext|>", .len = 13}};
        if (k <= SPECIAL_UNK || k == SPECIAL_PAD) s->object = 1;
    }
    int n_vocab_keys = 0;
    for (int k = 0; k < t->syms.n; k++) n_vocab_keys += t->syms.id[k] >= 0;
    int rc = 0; /* the encoder: text -> id of the decoder's entries, the later of equal texts */
    for (int i = 0; rc == 0 && i < L->decoder.n; i++)
        rc = token_list_put(&L->encoder, &L->decoder.v[i], 0);
    if (rc || add_special_tokens(t, L, n_vocab_keys))
        return fg_fail(err, "tokenizer: out of memory");
    mark_raw(L, n_vocab_keys);
    for (int i = 0; i < L->encoder.n; i++) { /* what tokenize() looks up for an encoder text */
        added_token *e = &L->encoder.v[i];
        const added_token *d = find_id(&L->decoder, e->id);
        e->lstrip = d->lstrip;
        e->rstrip = d->rstrip;
        e->single_word = d->single_word;
        e->in_trie = find_text(&L->decoder, e->text, e->len) != NULL; /* HF's trie: decoder texts */
    }
    return 0;
}

/* ---- decode table ---- */

/* Bytes a token's text stands for: each bytes_to_unicode character becomes its byte; any other
 * character (a token outside the byte-level alphabet) is kept as its own UTF-8. */
static size_t token_bytes(const char *s, size_t n, const int16_t *inv, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        size_t len = utf8_next((const unsigned char *)s + i, n - i, &cp);
        if (cp >= 0 && cp < 0x144 && inv[cp] >= 0) {
            out[o++] = (char)inv[cp];
        } else {
            memcpy(out + o, s + i, len);
            o += len;
        }
        i += len;
    }
    return o;
}

/* A SentencePiece-style token's bytes: <0xNN> is that byte (byte fallback), U+2581 a space, or
 * nothing where drop_meta is set. */
static size_t meta_token_bytes(const fg_tokenizer *t, const char *s, size_t n, int drop_meta,
                               char *out) {
    unsigned v;
    if (t->rules.byte_fallback && n == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' &&
        isxdigit((unsigned char)s[3]) && isxdigit((unsigned char)s[4]) &&
        sscanf(s + 3, "%2x", &v) == 1) {
        out[0] = (char)v;
        return 1;
    }
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int meta = i + 2 < n && !memcmp(s + i, "\xE2\x96\x81", 3);
        if (!(meta && drop_meta)) out[o++] = meta ? ' ' : s[i];
        i += meta ? 2 : 0;
    }
    return o;
}

static size_t text_bytes(const fg_tokenizer *t, const char *s, size_t n, const int16_t *inv,
                         int drop_meta, char *out) {
    return t->rules.byte_level ? token_bytes(s, n, inv, out)
                               : meta_token_bytes(t, s, n, drop_meta, out);
}

/* One table of each id's bytes (total of them at most) into *off and *bytes, malloc'd; drop_meta:
 * U+2581 decodes to nothing (the first token under a Metaspace decoder), else to a space. */
static int fill_decode_table(const fg_tokenizer *t, const added_token *const *added,
                             const int32_t *tok_sym, int n_vocab, const int16_t *inv, int drop_meta,
                             size_t total, size_t **off, char **bytes) {
    *off = malloc(((size_t)t->vocab_size + 1) * sizeof **off);
    *bytes = malloc(total ? total : 1); /* decoding never lengthens a token */
    if (!*off || !*bytes) return -1;
    size_t o = 0;
    for (int id = 0; id < t->vocab_size; id++) {
        (*off)[id] = o;
        const added_token *a = added[id];
        if (a && a->raw) {
            memcpy(*bytes + o, a->text, a->len);
            o += a->len;
        } else if (a) {
            o += text_bytes(t, a->text, a->len, inv, drop_meta, *bytes + o);
        } else if (id < n_vocab && tok_sym[id] >= 0) {
            int k = tok_sym[id];
            o += text_bytes(t, t->syms.pool + t->syms.off[k], t->syms.len[k], inv, drop_meta,
                            *bytes + o);
        }
    }
    (*off)[t->vocab_size] = o;
    return 0;
}

/* Bytes of each id: a vocab token's through the byte map, an added token's (which wins, as in
 * HF's convert_ids_to_tokens) through it or as it is. n_vocab: ids tok_sym covers. */
static int build_decode_table(fg_tokenizer *t, const int32_t *tok_sym, int n_vocab,
                              const token_list *decoder) {
    int16_t inv[0x144];
    int32_t cp[256];
    for (int i = 0; i < 0x144; i++) inv[i] = -1;
    bytes_to_unicode(cp);
    for (int b = 0; b < 256; b++) inv[cp[b]] = (int16_t)b;
    t->vocab_size = n_vocab;
    for (int i = 0; i < decoder->n; i++)
        if (decoder->v[i].id >= t->vocab_size) t->vocab_size = decoder->v[i].id + 1;
    const added_token **added = calloc((size_t)t->vocab_size, sizeof *added);
    if (!added) return -1;
    for (int i = 0; i < decoder->n; i++) added[decoder->v[i].id] = &decoder->v[i];
    size_t total = 0;
    for (int id = 0; id < t->vocab_size; id++) {
        if (added[id]) total += added[id]->len;
        else if (id < n_vocab && tok_sym[id] >= 0) total += t->syms.len[tok_sym[id]];
    }
    int rc = fill_decode_table(t, added, tok_sym, n_vocab, inv, 0, total, &t->dec_off, &t->dec);
    if (rc == 0 && t->rules.drop_first_meta)
        rc = fill_decode_table(t, added, tok_sym, n_vocab, inv, 1, total, &t->first_off, &t->first);
    free(added);
    return rc;
}

/* Added tokens first by their first byte, then longest first, so that the first match at a
 * position is the longest. */
static int added_order(const void *pa, const void *pb) {
    const added_token *a = pa, *b = pb;
    unsigned char ca = (unsigned char)a->text[0], cb = (unsigned char)b->text[0];
    if (ca != cb) return ca < cb ? -1 : 1;
    return a->len != b->len ? (a->len > b->len ? -1 : 1) : 0;
}

/* The encoder's tokens (all but an empty text, which never matches) into t, texts copied. */
static int keep_encoder(fg_tokenizer *t, const token_list *encoder) {
    size_t total = 1;
    for (int i = 0; i < encoder->n; i++) total += encoder->v[i].len;
    t->added = malloc(((size_t)encoder->n + 1) * sizeof *t->added);
    t->added_text = malloc(total);
    if (!t->added || !t->added_text) return -1;
    size_t o = 0;
    for (int i = 0; i < encoder->n; i++) {
        if (encoder->v[i].len == 0) continue;
        added_token *a = &t->added[t->n_added++];
        *a = encoder->v[i];
        memcpy(t->added_text + o, a->text, a->len);
        a->text = t->added_text + o;
        o += a->len;
    }
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, added_order);
    for (int b = 0, i = 0; b <= 256; b++) {
        while (i < t->n_added && (unsigned char)t->added[i].text[0] < b) i++;
        t->added_first[b] = i;
    }
    return 0;
}

/* The special and added tokens from the files beside vocab_path, and the decode table. */
static int load_added_tokens(fg_tokenizer *t, const char *vocab_path, const int32_t *tok_sym,
                             char *err) {
    added_loader L = {0};
    path_folder(vocab_path, L.dir, sizeof L.dir);
    int rc = read_added_tokens(t, &L, err);
    if (rc == 0 && (keep_encoder(t, &L.encoder) ||
                    build_decode_table(t, tok_sym, t->vocab_size, &L.decoder))) {
        fg_fail(err, "%s: out of memory", vocab_path);
        rc = -1;
    }
    const special_token *unk = &L.special[SPECIAL_UNK];
    t->unk_id = unk->given == 2 ? vocab_id(t, unk->tok.text, unk->tok.len) : -1;
    for (int i = 0; i < 3; i++) cJSON_Delete(L.files[i]);
    free(L.extra);
    free(L.decoder.v);
    free(L.encoder.v);
    return rc;
}

/* An empty tokenizer that follows these rules. */
static fg_tokenizer *new_tokenizer(const tok_rules *rules, char *err) {
    fg_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        fg_fail(err, "tokenizer: out of memory");
        return NULL;
    }
    t->rules = *rules;
    t->unk_id = t->unk_sym = -1;
    for (int b = 0; b < 256; b++) t->byte_tok[b] = -1;
    return t;
}

fg_tokenizer *tokenizer_load(const char *vocab_path, const char *merges_path, char *err) {
    /* OPT's prompts start with </s> (id 2), as HF's OPT tokenizer files make it the BOS */
    const tok_rules gpt2 = {.byte_level = 1, .pretok = PRETOK_GPT2, .bos_id = OPT_BOS_ID};
    fg_tokenizer *t = new_tokenizer(&gpt2, err);
    int32_t *tok_sym = NULL;
    if (!t) return NULL;
    t->merge_rounds = 1;
    int rc = load_vocab(t, vocab_path, &tok_sym, err);
    if (rc == 0 && intern_byte_symbols(t) != 0) {
        fg_fail(err, "%s: out of memory", vocab_path);
        rc = -1;
    }
    if (rc == 0) rc = load_merges(t, merges_path, err);
    if (rc == 0) rc = load_added_tokens(t, vocab_path, tok_sym, err);
    free(tok_sym);
    if (rc != 0) {
        tokenizer_free(t);
        return NULL;
    }
    return t;
}

/* ---- built from a tokenizer.json (tokenizer_json.c reads it) ---- */

fg_tokenizer *tokenizer_new(const tok_rules *rules, int n_vocab, char *err) {
    fg_tokenizer *t = new_tokenizer(rules, err);
    if (!t) return NULL;
    t->vocab_size = n_vocab;
    t->tok_sym = malloc((size_t)(n_vocab > 0 ? n_vocab : 1) * sizeof *t->tok_sym);
    for (int i = 0; t->tok_sym && i < n_vocab; i++) t->tok_sym[i] = -1;
    if (!t->tok_sym || (rules->byte_level && intern_byte_symbols(t))) {
        fg_fail(err, "tokenizer: out of memory");
        tokenizer_free(t);
        return NULL;
    }
    return t;
}

int tokenizer_add_token(fg_tokenizer *t, const char *s, size_t n, int id, const char *path,
                        char *err) {
    int k = symtab_intern(&t->syms, s, n);
    if (k < 0) return fg_fail(err, "%s: out of memory", path);
    if (t->syms.id[k] >= 0 || t->tok_sym[id] >= 0) {
        char tok[64];
        quote_token(tok, sizeof tok, s, n);
        return fg_fail(err,
                       "%s: token \"%s\" with id %d: the token or the id is in the vocab twice",
                       path, tok, id);
    }
    t->syms.id[k] = id;
    t->tok_sym[id] = k;
    return 0;
}

int tokenizer_add_merge(fg_tokenizer *t, const char *a, size_t an, const char *b, size_t bn,
                        int rank, const char *where, char *err) {
    const char *f[2] = {a, b};
    size_t flen[2] = {an, bn};
    for (int i = 0; i < 2; i++)
        if (vocab_id(t, f[i], flen[i]) < 0) {
            char tok[64];
            quote_token(tok, sizeof tok, f[i], flen[i]);
            return fg_fail(err, "%s: \"%s\" is not in the vocab", where, tok);
        }
    return add_merge(t, f, flen, rank, where, err);
}

int tokenizer_finish(fg_tokenizer *t, const tok_added *added, int n_added, const char *unk,
                     const char *path, char *err) {
    token_list list = {0};
    int rc = 0;
    for (int i = 0; rc == 0 && i < n_added; i++) {
        const tok_added *a = &added[i];
        added_token tok = {a->text, a->len, a->id, a->lstrip, a->rstrip, a->single_word, 0, 1};
        rc = token_list_put(&list, &tok, 1);
    }
    if (rc || keep_encoder(t, &list) || build_decode_table(t, t->tok_sym, t->vocab_size, &list))
        rc = fg_fail(err, "%s: out of memory", path);
    free(list.v);
    free(t->tok_sym);
    t->tok_sym = NULL;
    if (rc == 0 && unk && (t->unk_sym = symtab_find(&t->syms, unk, strlen(unk))) >= 0)
        t->unk_id = t->syms.id[t->unk_sym];
    if (rc == 0 && unk && t->unk_id < 0)
        return fg_fail(err, "%s: model.unk_token \"%s\" is not in the vocab", path, unk);
    for (int b = 0; b < 256; b++) { /* the byte fallback's tokens */
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        int k = symtab_find(&t->syms, name, 6);
        t->byte_tok[b] = k >= 0 && t->syms.id[k] >= 0 ? k : -1;
    }
    return rc;
}

int tokenizer_bos_id(const fg_tokenizer *t) { return t ? t->rules.bos_id : -1; }

void tokenizer_free(fg_tokenizer *t) {
    if (!t) return;
    free(t->tok_sym);
    symtab_free(&t->syms);
    free(t->merges.slots);
    free(t->dec_off);
    free(t->dec);
    free(t->first_off);
    free(t->first);
    free(t->added);
    free(t->added_text);
    free(t);
}

int tokenizer_vocab_size(const fg_tokenizer *t) { return t ? t->vocab_size : 0; }

/* Bytes of id's decoding (as the first token where `first`), or 0 for an id the vocab does not
 * hold. */
static size_t id_bytes(const fg_tokenizer *t, int id, int first, const char **bytes) {
    if (id < 0 || id >= t->vocab_size) return 0;
    if (first && t->first) {
        *bytes = t->first + t->first_off[id];
        return t->first_off[id + 1] - t->first_off[id];
    }
    *bytes = t->dec + t->dec_off[id];
    return t->dec_off[id + 1] - t->dec_off[id];
}

char *tokenizer_decode_from(const fg_tokenizer *t, const int *ids, int n_ids, int from,
                            size_t *out_len) {
    size_t total = 0, head = 0, len;
    const char *b = NULL;
    for (int i = 0; t && ids && i < n_ids; i++) {
        total += len = id_bytes(t, ids[i], i == 0, &b);
        if (i < from) head += len;
    }
    char *out = malloc(total + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (int i = 0; t && ids && i < n_ids; i++) {
        len = id_bytes(t, ids[i], i == 0, &b);
        memcpy(out + o, b, len);
        o += len;
    }
    size_t strip = t && t->rules.strip_space && o > 0 && out[0] == ' '; /* the decoder's Strip */
    size_t cut = head > strip ? head : strip;
    memmove(out, out + cut, o - cut);
    out[o - cut] = '\0';
    if (out_len) *out_len = o - cut;
    return out;
}

char *tokenizer_decode(const fg_tokenizer *t, const int *ids, int n_ids, size_t *out_len) {
    return tokenizer_decode_from(t, ids, n_ids, 0, out_len);
}
