/* fuzz_tokenizer.c: fuzzer bytes as vocab.json, merges.txt, a text and, when the input has a
 * fourth part, tokenizer_config.json (split at FUZZ_SEP), loaded with tokenizer_load; the text is
 * encoded and decoded back. Encoding may fail only with its error line (a byte with no token).
 * Without a tokenizer_config.json, any bytes (invalid UTF-8 too) must come back unchanged when
 * the vocab is like a real one: its distinct tokens have the ids 0 .. n-1, so the reference's
 * decoder {v: k for k, v in encoder.items()} is one to one and its default special token
 * <|endoftext|> gets id n, and <|endoftext|> (GPT2Tokenizer's default unk_token, which a byte
 * without a token would become) is not in it. */
#define _GNU_SOURCE
#include "fuzz.h"

#include <cjson/cJSON.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    return 0;
}

typedef struct {
    const char *key;
    int id, order;
} entry;

static int by_key_then_order(const void *a, const void *b) {
    const entry *x = a, *y = b;
    int c = strcmp(x->key, y->key);
    return c ? c : x->order - y->order;
}

static int by_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return x < y ? -1 : x > y;
}

/* Whether the vocab (as tokenizer_load parsed it, a repeated token taking its last id) gives its n
 * distinct tokens the ids 0 .. n-1 and lacks <|endoftext|>. */
static int vocab_like_real(const char *vocab, size_t len) {
    cJSON *root = cJSON_ParseWithLengthOpts(vocab, len, NULL, 0);
    int n = 0, ok = !cJSON_GetObjectItemCaseSensitive(root, "<|endoftext|>");
    for (const cJSON *it = root ? root->child : NULL; it; it = it->next) n++;
    entry *e = malloc((size_t)n * sizeof *e + 1);
    int *ids = malloc((size_t)n * sizeof *ids + 1), m = 0;
    if (!e || !ids) abort();
    n = 0;
    for (const cJSON *it = root ? root->child : NULL; it; it = it->next, n++)
        e[n] = (entry){it->string, (int)it->valuedouble, n};
    qsort(e, (size_t)n, sizeof *e, by_key_then_order);
    for (int i = 0; i < n; i++)
        if (i == n - 1 || strcmp(e[i].key, e[i + 1].key)) ids[m++] = e[i].id; /* a key's last id */
    qsort(ids, (size_t)m, sizeof *ids, by_int);
    for (int i = 0; i < m && ok; i++) ok = ids[i] == i;
    free(e);
    free(ids);
    cJSON_Delete(root);
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *part[4];
    size_t len[4];
    fuzz_split(data, size, 4, part, len);
    int has_config = part[3] != part[2] + len[2]; /* a separator after the text */
    if (has_config) fuzz_write("tokenizer_config.json", part[3], len[3]);
    else unlink(fuzz_write("tokenizer_config.json", "", 0));
    char err[FG_ERR_LEN] = "";
    fg_tokenizer *t = tokenizer_load(fuzz_write("vocab.json", part[0], len[0]),
                                     fuzz_write("merges.txt", part[1], len[1]), err);
    fuzz_check(!t, err, "tokenizer_load");
    if (!t) return 0;
    int *ids = NULL, n = 0;
    err[0] = 0;
    int rc = tokenizer_encode(t, part[2], len[2], &ids, &n, err);
    fuzz_check(rc, err, "tokenizer_encode");
    if (rc == 0) {
        size_t out_len = 0;
        char *out = tokenizer_decode(t, ids, n, &out_len);
        if (!out) abort();
        if ((out_len != len[2] || memcmp(out, part[2], len[2])) && !has_config &&
            vocab_like_real(part[0], len[0])) {
            fprintf(stderr, "decode(encode(s)) != s: %zu bytes in, %zu out\n", len[2], out_len);
            abort();
        }
        free(out);
    }
    free(ids);
    tokenizer_free(t);
    return 0;
}
