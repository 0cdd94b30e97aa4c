/* fuzz_tokenizer_json.c: fuzzer bytes as a tokenizer.json and a text (split at FUZZ_SEP), loaded
 * with tokenizer_load_json; the text is encoded and its ids decoded. Loading and encoding may
 * fail only with their one error line; whatever loads encodes any bytes (invalid UTF-8 too)
 * without crashing, and every id it gives decodes. */
#define _GNU_SOURCE
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *part[2];
    size_t len[2];
    fuzz_split(data, size, 2, part, len);
    unlink(fuzz_write("tokenizer_config.json", "", 0));
    char err[FG_ERR_LEN] = "";
    fg_tokenizer *t = tokenizer_load_json(fuzz_write("tokenizer.json", part[0], len[0]), err);
    fuzz_check(!t, err, "tokenizer_load_json");
    if (!t) return 0;
    int *ids = NULL, n = 0;
    err[0] = 0;
    int rc = tokenizer_encode(t, part[1], len[1], &ids, &n, err);
    fuzz_check(rc, err, "tokenizer_encode");
    for (int i = 0; rc == 0 && i < n; i++)
        if (ids[i] < 0 || ids[i] >= tokenizer_vocab_size(t)) {
            fprintf(stderr, "id %d outside [0, %d)\n", ids[i], tokenizer_vocab_size(t));
            abort();
        }
    size_t out_len = 0;
    char *out = rc == 0 ? tokenizer_decode_from(t, ids, n, n / 2, &out_len) : NULL;
    if (rc == 0 && !out) abort();
    free(out);
    free(ids);
    tokenizer_free(t);
    return 0;
}
