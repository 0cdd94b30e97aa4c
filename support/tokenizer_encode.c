/* support/tokenizer_encode.c: text to token ids with a tokenizer that tokenizer.c built, as HF
 * runs its rules:
 *   - OPT's files, as the slow GPT2Tokenizer: GPT-2's pre-tokenizer regex
 *       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *     hand-coded over UTF-8, with \p{L}, \p{N} and \s taken from Python's `regex` module (the
 *     tables generated into support/unicode_tables.h); an invalid UTF-8 byte counts as one "other"
 * character; then BPE by rank, every occurrence of the best pair a round, as the slow tokenizer
 * does;
 *   - LLaMA 3's and Qwen2's Split regex (digits 3 and 1 at a time), then byte-level BPE, with
 *     ignore_merges (a word that is a token stays whole);
 *   - SentencePiece-style BPE (LLaMA 1-2, Mistral): the text between added tokens is one word of
 *     characters, U+2581 for spaces and before it; a character the vocab lacks becomes its
 *     <0xNN> byte tokens (byte fallback) or unk;
 *   - NFC first where the normalizer asks (nfc.c), and one merge at a time, the best rank first.
 * Special and added tokens are cut out of the text first (leftmost, then longest, as HF's Trie
 * does), with their lstrip, rstrip and single_word flags applied to the text around them.
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

/* ------------------------------------------------------------------------------------------
 * Unicode classes of the pre-tokenizer.
 * ------------------------------------------------------------------------------------------ */
enum { UC_O = 0, UC_L = 1, UC_N = 2, UC_S = 3 }; /* other, \p{L}, \p{N}, \s */

typedef struct {
    uint32_t lo, hi;
    uint8_t cls;
} uc_range;

#include "support/unicode_tables.h" /* uc_ascii_class, uc_ranges */

static int uc_class(int32_t cp) {
    if (cp < 0) return UC_O; /* an invalid UTF-8 byte */
    if (cp < 128) return uc_ascii_class[cp];
    size_t lo = 0, hi = sizeof uc_ranges / sizeof uc_ranges[0];
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if ((uint32_t)cp < uc_ranges[mid].lo) hi = mid;
        else if ((uint32_t)cp > uc_ranges[mid].hi) lo = mid + 1;
        else return uc_ranges[mid].cls;
    }
    return UC_O;
}

/* Class of the character at s[i] (i < n); *next gets the index just past it. */
static int class_at(const unsigned char *s, size_t n, size_t i, size_t *next) {
    int32_t cp;
    *next = i + utf8_next(s + i, n - i, &cp);
    return uc_class(cp);
}

/* ------------------------------------------------------------------------------------------
 * Pre-tokenization: the end of the GPT-2 regex match starting at i, alternatives in order.
 * ------------------------------------------------------------------------------------------ */
static size_t contraction_len(const unsigned char *s, size_t n) {
    static const char *const forms[] = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"};
    if (s[0] != '\'') return 0;
    for (size_t k = 0; k < sizeof forms / sizeof forms[0]; k++) {
        size_t len = strlen(forms[k]);
        if (len <= n && memcmp(s, forms[k], len) == 0) return len;
    }
    return 0;
}

/* End of the run of class cls that continues at j. */
static size_t run_end(const unsigned char *s, size_t n, size_t j, int cls) {
    while (j < n) {
        size_t next;
        if (class_at(s, n, j, &next) != cls) break;
        j = next;
    }
    return j;
}

/* Whitespace at i: `\s+(?!\S)` keeps the last whitespace character for the next token when a
 * non-space follows (so " word" stays together); a lone one falls through to `\s+`. */
static size_t space_end(const unsigned char *s, size_t n, size_t i) {
    size_t last = i, j = i;
    while (j < n) {
        size_t next;
        if (class_at(s, n, j, &next) != UC_S) break;
        last = j;
        j = next;
    }
    if (j == n || last == i) return j;
    return last;
}

static size_t pretoken_end(const unsigned char *s, size_t n, size_t i) {
    size_t len = contraction_len(s + i, n - i);
    if (len) return i + len;
    size_t next;
    int cls = class_at(s, n, i, &next);
    if (cls != UC_S) return run_end(s, n, next, cls);
    if (s[i] == ' ' && next < n) { /* the optional leading space of ` ?\p{L}+` and friends */
        size_t after;
        int c2 = class_at(s, n, next, &after);
        if (c2 != UC_S) return run_end(s, n, after, c2);
    }
    return space_end(s, n, i);
}

/* LLaMA 3's and Qwen2's Split regex (max_digits 3 and 1), the end of its match at i:
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 *   \s*[\r\n]+|\s+(?!\S)|\s+
 * Its classes are the GPT-2 regex's; the contractions take either case (and U+017F, which folds
 * to s). */
static int is_crlf(unsigned char c) { return c == '\r' || c == '\n'; }

static size_t contraction_ci_len(const unsigned char *s, size_t n) {
    if (n < 2 || s[0] != '\'') return 0;
    int a = s[1] | 0x20, b = n > 2 ? s[2] | 0x20 : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (n > 2 && s[1] == 0xC5 && s[2] == 0xBF) return 3; /* 'ſ */
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

static size_t split_end(const unsigned char *s, size_t n, size_t i, int max_digits) {
    size_t len = contraction_ci_len(s + i, n - i), next, after;
    if (len) return i + len;
    int cls = class_at(s, n, i, &next);
    if (cls == UC_L) return run_end(s, n, next, UC_L);
    if (cls != UC_N && !is_crlf(s[i]) && next < n && class_at(s, n, next, &after) == UC_L)
        return run_end(s, n, after, UC_L); /* one non-letter, then letters */
    if (cls == UC_N) {
        for (int k = 1; k < max_digits && next < n && class_at(s, n, next, &after) == UC_N; k++)
            next = after;
        return next;
    }
    size_t j = s[i] == ' ' && next < n && class_at(s, n, next, &after) == UC_O ? next : i;
    if (class_at(s, n, j, &after) == UC_O) { /* ` ?[^\s\p{L}\p{N}]+[\r\n]*` */
        j = run_end(s, n, after, UC_O);
        while (j < n && is_crlf(s[j])) j++;
        return j;
    }
    size_t end = i, last_crlf = 0; /* whitespace: up to its last \r or \n, if it has one */
    while (end < n && class_at(s, n, end, &after) == UC_S) {
        if (is_crlf(s[end])) last_crlf = after;
        end = after;
    }
    return last_crlf ? last_crlf : space_end(s, n, i);
}

/* ------------------------------------------------------------------------------------------
 * Encoding: BPE over one pre-token at a time. The word is a linked list of symbols; candidate
 * pairs sit in a min-heap by (rank, position), checked against the list when popped.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    int32_t rank, pos, left, right, result;
} pair_entry;

typedef struct {
    int *sym, *prev, *next; /* per node; sym -1 once merged into its left neighbour */
    pair_entry *heap, *batch;
    size_t n_heap, cap; /* nodes; the heap and batch hold 3 * cap (m - 1 pairs + 2 a merge) */
    char *text;         /* [4 * cap]: a word through the byte map */
    int *ids;           /* the output */
    size_t n_ids, cap_ids;
} bpe_work;

static void work_free(bpe_work *w) {
    free(w->sym);
    free(w->prev);
    free(w->next);
    free(w->heap);
    free(w->batch);
    free(w->text);
    w->sym = w->prev = w->next = NULL;
    w->heap = w->batch = NULL;
    w->text = NULL;
    w->cap = 0;
}

static int work_reserve(bpe_work *w, size_t m) {
    if (m <= w->cap) return 0;
    size_t cap = w->cap ? w->cap : 64;
    while (cap < m) cap *= 2;
    work_free(w);
    w->sym = malloc(cap * sizeof *w->sym);
    w->prev = malloc(cap * sizeof *w->prev);
    w->next = malloc(cap * sizeof *w->next);
    w->heap = malloc(3 * cap * sizeof *w->heap);
    w->batch = malloc(3 * cap * sizeof *w->batch);
    w->text = malloc(4 * cap);
    w->cap = cap;
    if (w->sym && w->prev && w->next && w->heap && w->batch && w->text) return 0;
    work_free(w);
    return -1;
}

static int grow_ids(bpe_work *w) {
    size_t cap = w->cap_ids ? w->cap_ids * 2 : 256;
    int *ids = realloc(w->ids, cap * sizeof *ids);
    if (!ids) return -1;
    w->ids = ids;
    w->cap_ids = cap;
    return 0;
}

static int emit_id(bpe_work *w, int id) {
    if (w->n_ids == w->cap_ids && grow_ids(w) != 0) return -1;
    w->ids[w->n_ids++] = id;
    return 0;
}

static int entry_less(const pair_entry *a, const pair_entry *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(bpe_work *w, pair_entry e) {
    size_t i = w->n_heap++;
    while (i > 0 && entry_less(&e, &w->heap[(i - 1) / 2])) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = e;
}

static pair_entry heap_pop(bpe_work *w) {
    pair_entry top = w->heap[0], last = w->heap[--w->n_heap];
    size_t i = 0, n = w->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && entry_less(&w->heap[c + 1], &w->heap[c])) c++;
        if (!entry_less(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n > 0) w->heap[i] = last;
    return top;
}

/* Queues the pair starting at node p if it is a merge. */
static void push_pair(const fg_tokenizer *t, bpe_work *w, int p) {
    if (p < 0 || w->next[p] < 0) return;
    int a = w->sym[p], b = w->sym[w->next[p]];
    const merge_slot *m = merge_find(&t->merges, a, b);
    if (m) heap_push(w, (pair_entry){m->rank, p, a, b, m->result});
}

static void merge_at(const fg_tokenizer *t, bpe_work *w, const pair_entry *e) {
    int p = e->pos, q = w->next[p];
    if (w->sym[p] != e->left || q < 0 || w->sym[q] != e->right) return; /* stale */
    w->sym[p] = e->result;
    w->sym[q] = -1;
    w->next[p] = w->next[q];
    if (w->next[q] >= 0) w->prev[w->next[q]] = p;
    push_pair(t, w, w->prev[p]);
    push_pair(t, w, p);
}

/* Each round merges every occurrence of the best-ranked pair, left to right, before looking at
 * the pairs those merges create: the reference's order, which differs from one-merge-at-a-time
 * when a merges file ranks a pair above the merges that build its parts. */
static void bpe_rounds(const fg_tokenizer *t, bpe_work *w) {
    while (w->n_heap > 0) {
        size_t nb = 0;
        int32_t rank = w->heap[0].rank;
        while (w->n_heap > 0 && w->heap[0].rank == rank) w->batch[nb++] = heap_pop(w);
        for (size_t i = 0; i < nb; i++) merge_at(t, w, &w->batch[i]);
    }
}

/* HF tokenizers' order: one merge at a time, the best-ranked pair first, leftmost among equals. */
static void bpe_in_order(const fg_tokenizer *t, bpe_work *w) {
    while (w->n_heap > 0) {
        pair_entry e = heap_pop(w);
        merge_at(t, w, &e);
    }
}

/* BPE over the word in nodes 0..m-1 (w->sym set), then its ids. s: the word's bytes, for the
 * error a byte-level word can meet. */
static int bpe_merge_emit(const fg_tokenizer *t, bpe_work *w, size_t m, const unsigned char *s,
                          char *err) {
    for (size_t i = 0; i < m; i++) {
        w->prev[i] = (int)i - 1;
        w->next[i] = i + 1 < m ? (int)i + 1 : -1;
    }
    w->n_heap = 0;
    for (size_t i = 0; i + 1 < m; i++) push_pair(t, w, (int)i);
    if (t->merge_rounds) bpe_rounds(t, w);
    else bpe_in_order(t, w);
    for (int p = 0; m > 0 && p >= 0; p = w->next[p]) {
        int id = t->syms.id[w->sym[p]];
        if (id < 0) id = t->unk_id; /* only single bytes can lack a token: merges are checked */
        if (id < 0) return fg_fail(err, "tokenizer: byte 0x%02x has no token in the vocab", s[p]);
        if (emit_id(w, id) != 0) return fg_fail(err, "tokenizer: out of memory");
    }
    return 0;
}

/* The vocab id of a byte-level word as a whole (its bytes through the byte map), or -1. */
static int whole_word_id(const fg_tokenizer *t, bpe_work *w, const unsigned char *s, size_t m) {
    size_t n = 0;
    for (size_t i = 0; i < m; i++) {
        int k = t->byte_sym[s[i]];
        memcpy(w->text + n, t->syms.pool + t->syms.off[k], t->syms.len[k]);
        n += t->syms.len[k];
    }
    int k = symtab_find(&t->syms, w->text, n);
    return k >= 0 ? t->syms.id[k] : -1;
}

/* A byte-level word: one symbol per byte, or (ignore_merges) the word's own token. */
static int byte_level_word(const fg_tokenizer *t, bpe_work *w, const unsigned char *s, size_t m,
                           char *err) {
    if (work_reserve(w, m) != 0) return fg_fail(err, "tokenizer: out of memory");
    int id = t->rules.ignore_merges ? whole_word_id(t, w, s, m) : -1;
    if (id >= 0) return emit_id(w, id) ? fg_fail(err, "tokenizer: out of memory") : 0;
    for (size_t i = 0; i < m; i++) w->sym[i] = t->byte_sym[s[i]];
    return bpe_merge_emit(t, w, m, s, err);
}

/* Whether every byte of a character has a <0xNN> token. */
static int has_byte_tokens(const fg_tokenizer *t, const unsigned char *s, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (!t->rules.byte_fallback || t->byte_tok[s[i]] < 0) return 0;
    return 1;
}

/* A SentencePiece-style word: one symbol per character that is a token, else its byte tokens,
 * else the unk token (one for a run of them with fuse_unk), as HF's BPE.merge_word. */
static int char_word(const fg_tokenizer *t, bpe_work *w, const unsigned char *s, size_t n,
                     char *err) {
    if (work_reserve(w, n) != 0) return fg_fail(err, "tokenizer: out of memory");
    size_t m = 0;
    int in_unk = 0;
    for (size_t i = 0, len; i < n; i += len) {
        int32_t cp;
        len = utf8_next(s + i, n - i, &cp);
        int k = symtab_find(&t->syms, (const char *)s + i, len);
        if (k >= 0 && t->syms.id[k] >= 0) {
            w->sym[m++] = k;
        } else if (has_byte_tokens(t, s + i, len)) {
            for (size_t b = 0; b < len; b++) w->sym[m++] = t->byte_tok[s[i + b]];
        } else if (t->unk_sym >= 0) {
            if (!(in_unk && t->rules.fuse_unk)) w->sym[m++] = t->unk_sym;
            in_unk = 1;
            continue;
        } else {
            return fg_fail(err,
                           "tokenizer: the character at byte %zu has no token, and the vocab no "
                           "byte tokens or unk token",
                           i);
        }
        in_unk = 0;
    }
    return bpe_merge_emit(t, w, m, s, err);
}

/* ------------------------------------------------------------------------------------------
 * Added tokens in the text: the slow tokenizer's tokenize() cuts the text at them (its Trie: the
 * leftmost match, the longest there), applies their flags to the neighbouring pieces, then runs
 * BPE on each piece that is not an added token's text.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    const char *s;
    size_t n;
    char *own; /* s, when the piece was made by joining two */
} piece;

typedef struct {
    piece *v;
    int n, cap;
} piece_list;

static int piece_add(piece_list *l, const char *s, size_t n) {
    if (n == 0) return 0; /* the Trie's cut leaves no empty pieces */
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        piece *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) return -1;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = (piece){s, n, NULL};
    return 0;
}

/* The longest added token at the start of s[0..n) (exact: whose text is all of it), or NULL. */
static const added_token *added_at(const fg_tokenizer *t, const char *s, size_t n, int exact) {
    unsigned char b = (unsigned char)s[0];
    for (int i = t->added_first[b]; i < t->added_first[b + 1]; i++) {
        const added_token *a = &t->added[i];
        if ((exact ? a->len == n : a->len <= n && a->in_trie) && !memcmp(a->text, s, a->len))
            return a;
    }
    return NULL;
}

/* The added token that a piece is, or NULL: HF's `token in no_split_token`. */
static const added_token *added_exact(const fg_tokenizer *t, const piece *p) {
    return p->n ? added_at(t, p->s, p->n, 1) : NULL;
}

/* The text cut before and after each added token, leftmost first. HF's Trie cuts the same way
 * unless an added token's text holds another one after its first character; then it can miss a
 * match or cut where no token is, a quirk not copied here. */
static int split_added(const fg_tokenizer *t, const char *s, size_t n, piece_list *out) {
    size_t start = 0;
    for (size_t i = 0; i < n;) {
        const added_token *a = t->n_added ? added_at(t, s + i, n - i, 0) : NULL;
        if (!a) {
            i++;
            continue;
        }
        if (piece_add(out, s + start, i - start) || piece_add(out, s + i, a->len)) return -1;
        start = i += a->len;
    }
    return start < n ? piece_add(out, s + start, n - start) : 0;
}

/* Python's str.isspace(), what HF's lstrip and rstrip take away: \s and U+001C..U+001F. */
static int py_space(int32_t cp) { return uc_class(cp) == UC_S || (cp >= 0x1C && cp <= 0x1F); }

static void strip_left(piece *p) {
    while (p->n > 0) {
        int32_t cp;
        size_t len = utf8_next((const unsigned char *)p->s, p->n, &cp);
        if (!py_space(cp)) break;
        p->s += len;
        p->n -= len;
    }
}

static void strip_right(piece *p) {
    size_t keep = 0;
    for (size_t i = 0; i < p->n;) {
        int32_t cp;
        i += utf8_next((const unsigned char *)p->s + i, p->n - i, &cp);
        if (!py_space(cp)) keep = i;
    }
    p->n = keep;
}

/* dst = a + b (dst is one of them). */
static int join_pieces(piece *dst, const piece *a, const piece *b) {
    size_t n = a->n + b->n;
    char *s = malloc(n + 1);
    if (!s) return -1;
    memcpy(s, a->s, a->n);
    memcpy(s + a->n, b->s, b->n);
    free(dst->own);
    *dst = (piece){s, n, s};
    return 0;
}

/* The pass of tokenize() over the pieces: an rstrip token takes the whitespace off the start of
 * the next piece, an lstrip one off the end of the previous piece, and a single_word token that
 * a piece not ending (starting) in ' ' touches is joined to it, as text. Each step sees the
 * pieces as the steps before it left them; `left` and `right` are the neighbours before this
 * step, as the reference's tests read them. */
static int apply_token_flags(const fg_tokenizer *t, piece_list *l) {
    piece *p = l->v;
    for (int i = 0; i < l->n; i++) {
        const added_token *a = added_exact(t, &p[i]);
        if (!a) continue;
        piece none = {0}, left = i > 0 ? p[i - 1] : none, right = i + 1 < l->n ? p[i + 1] : none;
        if (a->rstrip && right.n) strip_left(&p[i + 1]);
        if (a->lstrip && left.n) strip_right(&p[i - 1]);
        if (a->single_word && left.n && left.s[left.n - 1] != ' ') {
            if (join_pieces(&p[i - 1], &p[i - 1], &p[i])) return -1;
            p[i].n = 0;
        } else if (a->single_word && right.n && right.s[0] != ' ') {
            if (join_pieces(&p[i + 1], &p[i], &p[i + 1])) return -1;
            p[i].n = 0;
        }
    }
    return 0;
}

/* End of the pre-token that starts at i. */
static size_t pretoken_at(const fg_tokenizer *t, const unsigned char *s, size_t n, size_t i) {
    switch (t->rules.pretok) {
    case PRETOK_GPT2: return pretoken_end(s, n, i);
    case PRETOK_LLAMA3: return split_end(s, n, i, 3);
    case PRETOK_QWEN2: return split_end(s, n, i, 1);
    default: return n;
    }
}

/* Whether SentencePiece's U+2581 goes before this piece (at_start: it begins the text). */
static int prepends(const fg_tokenizer *t, const char *s, size_t n, int at_start) {
    int there =
        n > 0 && (s[0] == ' ' ? t->rules.spaces_to_meta : n >= 3 && !memcmp(s, "\xE2\x96\x81", 3));
    switch (t->rules.prepend) {
    case PREPEND_EACH: return n > 0;
    case PREPEND_EACH_UNLESS_THERE: return n > 0 && !there;
    case PREPEND_FIRST_UNLESS_THERE: return n > 0 && at_start && !there;
    default: return 0;
    }
}

/* The normalizers: NFC, then SentencePiece's U+2581 for spaces and before the piece. NULL and
 * *out = s where they change nothing; NULL and *out NULL when out of memory. */
static char *normalize(const fg_tokenizer *t, const char *s, size_t n, int at_start,
                       const char **out, size_t *out_n) {
    char *nfc = t->rules.nfc ? utf8_nfc(s, n, &n) : NULL;
    *out = t->rules.nfc ? nfc : s;
    *out_n = n;
    if (!*out || t->rules.byte_level) return nfc;
    s = *out;
    size_t spaces = 0;
    for (size_t i = 0; t->rules.spaces_to_meta && i < n; i++) spaces += s[i] == ' ';
    int lead = prepends(t, s, n, at_start);
    char *meta = malloc(n + 2 * spaces + 3 * (size_t)lead + 1), *o = meta;
    if (meta && lead) {
        o = memcpy(o, "\xE2\x96\x81", 3);
        o += 3;
    }
    for (size_t i = 0; meta && i < n; i++)
        if (s[i] == ' ' && t->rules.spaces_to_meta) {
            o = memcpy(o, "\xE2\x96\x81", 3);
            o += 3;
        } else {
            *o++ = s[i];
        }
    free(nfc);
    *out = meta;
    *out_n = meta ? (size_t)(o - meta) : 0;
    return meta;
}

/* BPE over a piece of text, normalized, one pre-token at a time. */
static int encode_text(const fg_tokenizer *t, bpe_work *w, const piece *p, int at_start,
                       char *err) {
    const char *text;
    size_t n;
    char *own = normalize(t, p->s, p->n, at_start, &text, &n);
    if (!text) return fg_fail(err, "tokenizer: out of memory");
    const unsigned char *s = (const unsigned char *)text;
    int rc = 0;
    for (size_t pos = 0, end; rc == 0 && pos < n; pos = end) {
        end = pretoken_at(t, s, n, pos);
        rc = t->rules.byte_level ? byte_level_word(t, w, s + pos, end - pos, err)
                                 : char_word(t, w, s + pos, end - pos, err);
    }
    free(own);
    return rc;
}

int tokenizer_encode(const fg_tokenizer *t, const char *text, size_t len, int **ids, int *n_ids,
                     char *err) {
    *ids = NULL;
    *n_ids = 0;
    if (!t || (!text && len > 0)) {
        fg_fail(err, "tokenizer_encode: no tokenizer or no text");
        return -1;
    }
    if (len > 0x7fffffff) {
        fg_fail(err, "tokenizer_encode: text of %zu bytes is too long", len);
        return -1;
    }
    bpe_work w = {0};
    piece_list pieces = {0};
    int rc = grow_ids(&w) || split_added(t, text, len, &pieces) || apply_token_flags(t, &pieces)
                 ? fg_fail(err, "tokenizer: out of memory") /* the output is never NULL */
                 : 0;
    for (int i = 0; rc == 0 && i < pieces.n; i++) {
        const added_token *a = added_exact(t, &pieces.v[i]);
        if (a && emit_id(&w, a->id)) rc = fg_fail(err, "tokenizer: out of memory");
        else if (!a) rc = encode_text(t, &w, &pieces.v[i], pieces.v[i].s == text, err);
    }
    for (int i = 0; i < pieces.n; i++) free(pieces.v[i].own);
    free(pieces.v);
    work_free(&w);
    if (rc != 0) {
        free(w.ids);
        return -1;
    }
    *ids = w.ids;
    *n_ids = (int)w.n_ids;
    return 0;
}
