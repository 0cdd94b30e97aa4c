/* support/tokenizer.h: what the tokenizer's two files share, and no other file includes:
 * tokenizer.c builds a tokenizer's tables (vocab, merges, added tokens, the decode table) and
 * decodes; tokenizer_encode.c encodes. Their interface is support/tools.h.
 */
#ifndef FLEXGEN_TOKENIZER_H
#define FLEXGEN_TOKENIZER_H

#include "support/support.h"
#include "support/tools.h"

#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------------------------------
 * Symbol table: every string BPE can hold (vocab tokens, byte symbols, merge parts), interned so
 * that symbols compare as ints. Open addressing over symbol indices.
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    char *pool;
    size_t pool_len, pool_cap;
    size_t *off, *len; /* per symbol: its text in pool */
    int32_t *id;       /* per symbol: its vocab id, or -1 */
    int n, cap;
    int32_t *slots; /* symbol index or -1 */
    size_t mask;
} symtab;

/* Index of s, or -1 when it is not in the table (a table without slots holds nothing). */
int symtab_find(const symtab *st, const char *s, size_t n);

/* ------------------------------------------------------------------------------------------
 * Merge table: (left symbol, right symbol) -> (rank, merged symbol).
 * ------------------------------------------------------------------------------------------ */
typedef struct {
    uint64_t key;
    int32_t rank; /* -1: empty slot */
    int32_t result;
} merge_slot;

typedef struct {
    merge_slot *slots;
    size_t mask, count;
} merge_map;

const merge_slot *merge_find(const merge_map *m, int a, int b);

/* ------------------------------------------------------------------------------------------
 * The tokenizer.
 * ------------------------------------------------------------------------------------------ */
/* An added token (HF's AddedToken): a text the encoder splits out before BPE, and its id. */
typedef struct {
    const char *text;
    size_t len;
    int id;
    int lstrip, rstrip, single_word; /* AddedToken's flags, applied by apply_token_flags() */
    int raw;     /* decodes to its own text; otherwise, like the vocab, through the byte map */
    int in_trie; /* the text is cut out wherever it is (else only a whole piece that is it) */
} added_token;

struct fg_tokenizer {
    symtab syms;
    merge_map merges;
    int byte_sym[256]; /* symbol of each byte's bytes_to_unicode character */
    int vocab_size;    /* one past the largest id, of the vocab or an added token */
    size_t *dec_off; /* [vocab_size + 1]: id's decoded bytes are dec[dec_off[id], dec_off[id+1]) */
    char *dec;
    size_t *first_off;  /* the same for the first token where the decoder treats it apart (a */
    char *first;        /* Metaspace decoder drops its U+2581s); NULL where it does not */
    added_token *added; /* by first byte, then longest first; texts in added_text */
    int n_added;
    int added_first[257]; /* added[added_first[b] .. added_first[b + 1]) start with byte b */
    char *added_text;
    int unk_id; /* for a byte the vocab lacks (unk_token's vocab id); -1: none, encoding fails */
    tok_rules rules;   /* how text becomes BPE's words (tokenizer.json's; GPT-2's for vocab.json) */
    int merge_rounds;  /* the slow tokenizer's order: every occurrence of the best pair at once */
    int unk_sym;       /* symbol of the unk token, or -1 */
    int byte_tok[256]; /* symbol of each byte's <0xNN> token (byte fallback), or -1 */
    int32_t *tok_sym;  /* while a tokenizer.json is read: each id's symbol, or -1 */
};

#endif
