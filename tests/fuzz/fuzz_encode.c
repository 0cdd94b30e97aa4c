/* fuzz_encode.c: fuzzer bytes as a text for the fixture tokenizer (tests/fixtures/tokenizer,
 * loaded once): any bytes, invalid UTF-8 included, encode without error and decode back to the
 * same bytes. */
#define _GNU_SOURCE
#include "fuzz.h"

static fg_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    tok = fuzz_fixture_tokenizer();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int *ids = NULL, n = 0;
    char err[FG_ERR_LEN] = "";
    if (tokenizer_encode(tok, (const char *)data, size, &ids, &n, err)) {
        fprintf(stderr, "tokenizer_encode: %s\n", err);
        abort();
    }
    size_t out_len = 0;
    char *out = tokenizer_decode(tok, ids, n, &out_len);
    if (!out || out_len != size || memcmp(out, data, size) || out[out_len]) {
        fprintf(stderr, "decode(encode(s)) != s: %zu bytes in, %zu out\n", size, out_len);
        abort();
    }
    free(out);
    free(ids);
    return 0;
}
