/* test_tokenizer.c: the tokenizer against HF's slow GPT2Tokenizer (tests/fixtures/tokenizer*,
 * written by scripts/make_tokenizer_fixture.py: plain text, whitespace, and special and added
 * tokens in the text as OPT's, GPT-2's and a newer checkpoint's files define them),
 * decode(encode(s)) == s on hand-picked, random and invalid UTF-8, the reference's merge order,
 * and tokenizer_load's errors on bad files. */
#define _POSIX_C_SOURCE 200809L
#include "flexgen.h"
#include "tests.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ------------------------------------------------------------------------------------------
 * Helpers.
 * ------------------------------------------------------------------------------------------ */
static fg_tokenizer *load_fixture_dir(const char *name) {
    char vocab[4096], merges[4096], err[FG_ERR_LEN] = "";
    snprintf(vocab, sizeof vocab, "%s/vocab.json", fixture(name));
    snprintf(merges, sizeof merges, "%s/merges.txt", fixture(name));
    fg_tokenizer *t = tokenizer_load(vocab, merges, err);
    if (!t) fprintf(stderr, "\n  tokenizer_load: %s\n", err);
    return t;
}

static fg_tokenizer *load_fixture_tokenizer(void) { return load_fixture_dir("tokenizer"); }

static void write_file(const char *dir, const char *name, const char *text) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs(text, f);
    fclose(f);
}

/* Encodes then decodes; returns whether the bytes came back unchanged. */
static int roundtrips(const fg_tokenizer *t, const char *s, size_t len) {
    int *ids = NULL, n = 0;
    char err[FG_ERR_LEN] = "";
    if (tokenizer_encode(t, s, len, &ids, &n, err) != 0) {
        fprintf(stderr, "\n  encode failed: %s\n", err);
        return 0;
    }
    size_t out_len = 0;
    char *out = tokenizer_decode(t, ids, n, &out_len);
    int ok = out && out_len == len && memcmp(out, s, len) == 0 && out[out_len] == '\0';
    free(out);
    free(ids);
    return ok;
}

/* ------------------------------------------------------------------------------------------
 * Against the reference.
 * ------------------------------------------------------------------------------------------ */
/* The case's ids, and its ids decoding to its "decoded" text (HF's decode), or to its text. */
static int case_matches(const fg_tokenizer *t, const cJSON *c) {
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(c, "text");
    const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, "ids");
    const cJSON *decoded = cJSON_GetObjectItemCaseSensitive(c, "decoded");
    if (!cJSON_IsString(text) || !cJSON_IsArray(want)) return 0;
    if (!decoded) decoded = text;
    int *ids = NULL, n = 0, ok;
    char err[FG_ERR_LEN] = "";
    ok = tokenizer_encode(t, text->valuestring, strlen(text->valuestring), &ids, &n, err) == 0;
    ok = ok && n == cJSON_GetArraySize(want);
    for (int i = 0; ok && i < n; i++)
        ok = ids[i] == cJSON_GetArrayItem(want, i)->valueint;
    if (!ok) fprintf(stderr, "\n  case \"%s\": ids differ (%s)\n", text->valuestring, err);
    size_t len = 0;
    char *out = ok ? tokenizer_decode(t, ids, n, &len) : NULL;
    if (ok && !(out && cJSON_IsString(decoded) && len == strlen(decoded->valuestring) &&
                memcmp(out, decoded->valuestring, len) == 0)) {
        fprintf(stderr, "\n  case \"%s\": decodes to \"%s\"\n", text->valuestring, out);
        ok = 0;
    }
    free(out);
    free(ids);
    return ok;
}

/* Every case of tests/fixtures/DIR/cases.json; at least `min` of them. */
static void check_reference_cases(const char *dir, int min) {
    char path[4096];
    snprintf(path, sizeof path, "%s/cases.json", fixture(dir));
    fg_tokenizer *t = load_fixture_dir(dir);
    char *json = slurp(path, NULL);
    cJSON *cases = json ? cJSON_Parse(json) : NULL;
    free(json);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    EXPECT(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) >= min, "%s: at least %d cases",
           path, min);
    int failures = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) failures += !case_matches(t, c);
    EXPECT(failures == 0, "%s: %d cases differ from HF", path, failures);
    cJSON_Delete(cases);
    tokenizer_free(t);
}

/* OPT's files: </s> and <pad> are special; plain text and whitespace as before. */
static void test_reference_cases(void) { check_reference_cases("tokenizer", 70); }

/* GPT-2's: <|endoftext|> special by GPT2Tokenizer's default; an added_tokens.json. */
static void test_reference_cases_gpt2(void) { check_reference_cases("tokenizer-gpt2", 10); }

/* added_tokens_decoder with lstrip, rstrip and single_word, overlapping tokens, ids past the
 * vocab, special and plain tokens decoding differently. */
static void test_reference_cases_added(void) { check_reference_cases("tokenizer-added", 30); }

static void test_vocab_size(void) {
    fg_tokenizer *t = load_fixture_tokenizer();
    char *json = slurp(fixture("tokenizer/vocab.json"), NULL);
    cJSON *vocab = json ? cJSON_Parse(json) : NULL;
    free(json);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_PTR_NOT_NULL_FATAL(vocab);
    CU_ASSERT_EQUAL(tokenizer_vocab_size(t), cJSON_GetArraySize(vocab)); /* ids are 0..n-1 */
    cJSON_Delete(vocab);
    tokenizer_free(t);
}

/* ------------------------------------------------------------------------------------------
 * Round trips.
 * ------------------------------------------------------------------------------------------ */
static void test_roundtrip_strings(void) {
    static const char *const texts[] = {
        "",
        "Hello, world!",
        "Ça va? Übermäßig große Füße. ñandú, Ærøskøbing, İstanbul",
        "東京タワーと富士山 中文字符 한국어 텍스트",
        "👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏾‍🚀 👍🏽👍🏿 🇫🇷🇩🇪",
        "a                                                  b",
        "\t\t\ttabs\t \t",
        "\n\n\nnewlines\n\n",
        "dos\r\nline\r\nends\r\n\r\n",
        " leading and trailing ",
        "mixed: αβγ абв 123 ١٢٣ ½ ⅷ ④ x²",
        "\x1c\x1d\x1e\x1f separators \x85 and \xc2\x85 nel",
        "don't won't shan't y'all 'tis rock'n'roll ''s '''",
        "\xe2\x80\xa8line separator\xe2\x80\xa9paragraph separator",
        "\xef\xbb\xbf\x42OM and U+FFFF \xef\xbf\xbf and U+10FFFF \xf4\x8f\xbf\xbf",
        "<s></s><pad><unk>: special tokens and text that looks like them",
        "</s", "<pad></s><</s>>", "x</s>y",
    };
    fg_tokenizer *t = load_fixture_tokenizer();
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        CU_ASSERT(roundtrips(t, texts[i], strlen(texts[i])));
    tokenizer_free(t);
}

static uint64_t xorshift(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint32_t random_code_point(uint64_t *seed) {
    static const uint32_t spaces[] = {' ', '\t', '\n', '\r', 0x0B, 0x0C, 0x85, 0xA0, 0x2028, 0x3000};
    uint32_t r = (uint32_t)(xorshift(seed) % 100), x = (uint32_t)xorshift(seed);
    if (r < 40) return 0x20 + x % 0x5F;
    if (r < 52) return spaces[x % (sizeof spaces / sizeof spaces[0])];
    if (r < 65) return 0x80 + x % 0x1D0;
    if (r < 77) return 0x4E00 + x % 0x5200;
    if (r < 87) return r & 1 ? 0x200D : 0x1F300 + x % 0x800;
    uint32_t cp = 1 + x % 0x10FFFF;
    return (cp >= 0xD800 && cp <= 0xDFFF) ? 0xFFFD : cp;
}

static size_t put_utf8(char *dst, uint32_t cp) {
    if (cp < 0x80) { dst[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static void test_roundtrip_random_utf8(void) {
    fg_tokenizer *t = load_fixture_tokenizer();
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    char buf[4 * 200];
    int failures = 0;
    for (int k = 0; k < 500; k++) {
        size_t n = 0, chars = xorshift(&seed) % 200;
        for (size_t i = 0; i < chars; i++) n += put_utf8(buf + n, random_code_point(&seed));
        failures += !roundtrips(t, buf, n);
    }
    CU_ASSERT_EQUAL(failures, 0);
    tokenizer_free(t);
}

/* Invalid UTF-8 is still bytes, and byte-level BPE must give every byte back. */
static void test_invalid_utf8(void) {
    static const char *const texts[] = {
        "\xff", "\xfe\xff abc", "trunc\xe6\x97", "\xe6\x97 mid", "\xc0\xaf overlong",
        "\xed\xa0\x80 surrogate", "\xf4\x90\x80\x80 past U+10FFFF", "\x80\x80\x80",
        "a \xc3 b \xc3\xa9 c", "don\xff't", " \xff\xfe", "\xf0\x9f\x91 cut emoji",
    };
    fg_tokenizer *t = load_fixture_tokenizer();
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        CU_ASSERT(roundtrips(t, texts[i], strlen(texts[i])));
    uint64_t seed = 12345;
    char buf[300];
    int failures = 0;
    for (int k = 0; k < 300; k++) {
        size_t n = xorshift(&seed) % sizeof buf;
        for (size_t i = 0; i < n; i++) buf[i] = (char)(xorshift(&seed) & 0xFF); /* NULs too */
        failures += !roundtrips(t, buf, n);
    }
    CU_ASSERT_EQUAL(failures, 0);
    tokenizer_free(t);
}

/* Long single pre-tokens (a CJK run, a space run) must not go quadratic or overflow. */
static void test_long_input(void) {
    fg_tokenizer *t = load_fixture_tokenizer();
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    size_t n = 0, cap = 600000;
    char *buf = malloc(cap);
    CU_ASSERT_PTR_NOT_NULL_FATAL(buf);
    while (n + 3 <= 200000) n += put_utf8(buf + n, 0x65E5 + (uint32_t)(n % 7)); /* 日... */
    memset(buf + n, ' ', 100000);
    n += 100000;
    while (n + 64 < cap) n += (size_t)sprintf(buf + n, "the cache is offloaded to disk. ");
    CU_ASSERT(roundtrips(t, buf, n));
    free(buf);
    tokenizer_free(t);
}

static void test_decode(void) {
    fg_tokenizer *t = load_fixture_tokenizer();
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    int v = tokenizer_vocab_size(t);
    int ids[] = {-5, OPT_BOS_ID, v, INT_MAX, 999999, OPT_PAD_ID, INT_MIN};
    size_t len = 99;
    char *s = tokenizer_decode(t, ids, (int)(sizeof ids / sizeof ids[0]), &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    CU_ASSERT_STRING_EQUAL(s, "</s><pad>"); /* unknown ids decode to nothing */
    CU_ASSERT_EQUAL(len, 9);
    free(s);
    s = tokenizer_decode(t, NULL, 0, &len);
    CU_ASSERT(s && len == 0 && s[0] == '\0');
    free(s);

    int *enc = NULL, n = -1;
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL(tokenizer_encode(t, "", 0, &enc, &n, err), 0);
    CU_ASSERT(enc != NULL && n == 0);
    free(enc);
    tokenizer_free(t);
    tokenizer_free(NULL);
}

/* ------------------------------------------------------------------------------------------
 * Hand-made vocabularies.
 * ------------------------------------------------------------------------------------------ */
static fg_tokenizer *load_dir(const char *dir, char *err) {
    char vocab[4200], merges[4200];
    snprintf(vocab, sizeof vocab, "%s/vocab.json", dir);
    snprintf(merges, sizeof merges, "%s/merges.txt", dir);
    err[0] = '\0';
    return tokenizer_load(vocab, merges, err);
}

static int encodes_to(const fg_tokenizer *t, const char *s, const int *want, int n_want) {
    int *ids = NULL, n = 0;
    char err[FG_ERR_LEN];
    int ok = tokenizer_encode(t, s, strlen(s), &ids, &n, err) == 0 && n == n_want &&
             memcmp(ids, want, (size_t)n * sizeof *ids) == 0;
    free(ids);
    return ok;
}

/* A merges file that ranks "ab a" above "a b": the slow GPT2Tokenizer merges every "a b" of a
 * round before it looks at "ab a" (expected ids checked against it; HF's fast one differs). */
static void test_merge_order(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_file(dir, "vocab.json", "{\"a\":0,\"b\":1,\"ab\":2,\"aba\":3,\"c\":4,\"abc\":5}");
    write_file(dir, "merges.txt", "#version: 0.2\nab a\na b\nab c\n");
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NOT_NULL(t);
    if (t) {
        CU_ASSERT(encodes_to(t, "abab", (const int[]){2, 2}, 2));
        CU_ASSERT(encodes_to(t, "ababc", (const int[]){2, 5}, 2));
        CU_ASSERT(encodes_to(t, "aab", (const int[]){0, 2}, 2));
        CU_ASSERT(encodes_to(t, "abcab", (const int[]){5, 2}, 2));
        CU_ASSERT(encodes_to(t, "aaba", (const int[]){0, 3}, 2));
    }
    tokenizer_free(t);
    rm_tree(dir);
    free(dir);
}

/* A vocab of unusual tokens, no merges: "\u0100" is byte 0x00 in GPT-2's map, "\u00ff" byte
 * 0xFF; 日本 is not in the map. */
static void write_unusual_vocab(const char *dir) {
    write_file(dir, "vocab.json", "{\"\\u65e5\\u672c\":0,\"a\":1,\"\\u0100\":2,\"x\\u00ff\":3}");
    write_file(dir, "merges.txt", "");
}

/* Tokens outside the byte-level alphabet decode to their own UTF-8; a byte with no token makes
 * encoding fail cleanly. */
static void test_unusual_vocab(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_unusual_vocab(dir);
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    size_t len = 0;
    char *s = tokenizer_decode(t, (const int[]){0, 1, 2, 3}, 4, &len);
    CU_ASSERT(s && len == 10 && memcmp(s, "\xe6\x97\xa5\xe6\x9c\xac" "a\0x\xff", 10) == 0);
    free(s);
    CU_ASSERT(encodes_to(t, "aa", (const int[]){1, 1}, 2));
    int *ids = NULL, n = 0;
    CU_ASSERT_EQUAL(tokenizer_encode(t, "ab", 2, &ids, &n, err), -1);
    CU_ASSERT(ids == NULL && n == 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "0x62"));
    tokenizer_free(t);
    rm_tree(dir);
    free(dir);
}

/* The empty string is a valid vocab key (HF's reference never produces it): it loads, decodes to
 * nothing, and the symbol table handles a zero-length first entry. */
static void test_empty_vocab_key(void) {
    static const char *const merges[] = {"", "#version: 0.2\n"};
    for (size_t i = 0; i < sizeof merges / sizeof merges[0]; i++) {
        char *dir = make_temp_dir(), err[FG_ERR_LEN];
        CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
        write_file(dir, "vocab.json", "{\"\":0}");
        write_file(dir, "merges.txt", merges[i]);
        fg_tokenizer *t = load_dir(dir, err);
        EXPECT(t != NULL, "{\"\":0} with merges \"%s\": %s", merges[i], err);
        if (t) {
            size_t len = 99;
            char *s = tokenizer_decode(t, (const int[]){0, 0}, 2, &len);
            CU_ASSERT(s && len == 0 && s[0] == '\0');
            free(s);
            CU_ASSERT(encodes_to(t, "", (const int[]){0}, 0));
        }
        tokenizer_free(t);
        rm_tree(dir);
        free(dir);
    }
}

/* unk_token stands for a byte the vocab lacks (and, being special, is split out itself); without
 * any file, <|endoftext|> is special (GPT2Tokenizer's default), with the next id past the vocab.
 * Expected ids checked against HF's slow GPT2Tokenizer. */
static void test_unk_and_defaults(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_unusual_vocab(dir);
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT(encodes_to(t, "a<|endoftext|>", (const int[]){1, 4}, 2));
    CU_ASSERT(encodes_to(t, "ab", (const int[]){1}, 1) == 0); /* no unk_token in the vocab */
    CU_ASSERT_EQUAL(tokenizer_vocab_size(t), 5);
    size_t len = 0;
    char *s = tokenizer_decode(t, (const int[]){4, 1}, 2, &len);
    CU_ASSERT(s && len == 14 && !strcmp(s, "<|endoftext|>a"));
    free(s);
    tokenizer_free(t);
    /* a key given twice takes its last value, as Python's json: unk_token is "a" */
    write_file(dir, "special_tokens_map.json", "{\"unk_token\": \"<|endoftext|>\", \"unk_token\": \"a\"}");
    t = load_dir(dir, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT(encodes_to(t, "ab", (const int[]){1, 1}, 2));
    CU_ASSERT(encodes_to(t, "a<|endoftext|>", (const int[]){1, 4}, 2));
    tokenizer_free(t);
    rm_tree(dir);
    free(dir);
}

/* A special token that takes the id of an added one: the decoder entry is replaced, so the old
 * text is no longer cut out of the text, yet a piece that is exactly that text still maps to the
 * id (HF's trie holds the decoder's texts, its encoder keeps both). Checked against HF. */
static void test_replaced_added_token(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_file(dir, "vocab.json",
               "{\"a\":0,\"b\":1,\"ab\":2,\"c\":3,\"\\u0120\":4,\"<\":5,\"y\":6,\">\":7}");
    write_file(dir, "merges.txt", "#version: 0.2\na b\n");
    write_file(dir, "tokenizer_config.json",
               "{\"added_tokens_decoder\": {\"1\": {\"content\": \"<y>\", \"rstrip\": true}},"
               " \"pad_token\": \"b\"}");
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT(encodes_to(t, "<y> c", (const int[]){5, 6, 7, 4, 3}, 5));
    CU_ASSERT(encodes_to(t, "<y>", (const int[]){1}, 1));
    CU_ASSERT(encodes_to(t, "ab c", (const int[]){0, 1, 4, 3}, 4));
    CU_ASSERT(encodes_to(t, "<|endoftext|>", (const int[]){9}, 1)); /* 8 vocab texts + <y> */
    size_t len = 0;
    char *s = tokenizer_decode(t, (const int[]){1, 9}, 2, &len);
    CU_ASSERT(s && !strcmp(s, "b<|endoftext|>"));
    free(s);
    tokenizer_free(t);
    rm_tree(dir);
    free(dir);
}

/* The text id decodes to, as a string (static buffer). */
static const char *decoded(const fg_tokenizer *t, int id) {
    static char text[64];
    size_t len = 0;
    char *s = tokenizer_decode(t, &id, 1, &len);
    snprintf(text, sizeof text, "%.*s", (int)len, s ? s : "");
    free(s);
    return text;
}

/* A repeated token resolves as the reference's json.load does: it takes its last id. */
static void test_repeated_vocab_entries(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_file(dir, "merges.txt", "");
    write_file(dir, "vocab.json", "{\"a\":0,\"b\":0,\"b\":1}"); /* encoder {a: 0, b: 1} */
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT(encodes_to(t, "ab", (const int[]){0, 1}, 2));
    EXPECT(!strcmp(decoded(t, 0), "a"), "id 0: expected \"a\", got \"%s\"", decoded(t, 0));
    CU_ASSERT(roundtrips(t, "abba", 4));
    tokenizer_free(t);
    rm_tree(dir);
    free(dir);
}

/* ------------------------------------------------------------------------------------------
 * Bad files: NULL, and one line naming the file and the problem.
 * ------------------------------------------------------------------------------------------ */
#define GOOD_VOCAB "{\"a\":0,\"b\":1,\"ab\":2,\"c\":3}"
#define GOOD_MERGES "#version: 0.2\na b\n"

/* Loads dir's files (written only when not NULL) and checks the error names `file` and says
 * every one of the `what` strings. */
static void expect_load_error(const char *vocab, const char *merges, const char *file,
                              const char *what1, const char *what2) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    if (vocab) write_file(dir, "vocab.json", vocab);
    if (merges) write_file(dir, "merges.txt", merges);
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NULL(t);
    tokenizer_free(t);
    int ok = strstr(err, file) && strstr(err, what1) && (!what2 || strstr(err, what2)) &&
             !strchr(err, '\n') && strlen(err) < FG_ERR_LEN;
    if (!ok) fprintf(stderr, "\n  unexpected error: \"%s\"\n", err);
    CU_ASSERT(ok);
    rm_tree(dir);
    free(dir);
}

/* A bad special-token file beside good vocab.json and merges.txt. */
static void expect_special_error(const char *file, const char *text, const char *what1,
                                 const char *what2) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_file(dir, "vocab.json", GOOD_VOCAB);
    write_file(dir, "merges.txt", GOOD_MERGES);
    write_file(dir, file, text);
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NULL(t);
    tokenizer_free(t);
    int ok = strstr(err, file) && strstr(err, what1) && (!what2 || strstr(err, what2)) &&
             !strchr(err, '\n');
    EXPECT(ok, "%s \"%s\": unexpected error \"%s\"", file, text, err);
    rm_tree(dir);
    free(dir);
}

static void test_bad_special_files(void) {
    static const char *const files[] = {"tokenizer_config.json", "special_tokens_map.json",
                                        "added_tokens.json"};
    for (int i = 0; i < 3; i++) {
        expect_special_error(files[i], "{\"bos_token\": \"a\",\n \"x\"}", "malformed JSON",
                             "line 2");
        expect_special_error(files[i], "", "malformed JSON", NULL);
        expect_special_error(files[i], "{} {}", "malformed JSON", NULL);
        expect_special_error(files[i], "[\"a\"]", "not a JSON object", NULL);
    }
    expect_special_error("tokenizer_config.json", "{\"eos_token\": 5}", "eos_token", "string");
    expect_special_error("tokenizer_config.json", "{\"eos_token\": {\"lstrip\": true}}",
                         "eos_token", "content");
    expect_special_error("tokenizer_config.json",
                         "{\"mask_token\": {\"content\": \"<m>\", \"lstrip\": 1}}", "mask_token",
                         "\"lstrip\" is not true or false");
    expect_special_error("tokenizer_config.json", "{\"additional_special_tokens\": \"<x>\"}",
                         "additional_special_tokens", "not a list");
    expect_special_error("tokenizer_config.json", "{\"additional_special_tokens\": [3]}",
                         "additional_special_tokens", "string");
    expect_special_error("tokenizer_config.json", "{\"added_tokens_decoder\": []}",
                         "added_tokens_decoder", "not an object");
    expect_special_error("tokenizer_config.json", "{\"added_tokens_decoder\": null}",
                         "added_tokens_decoder", "not an object");
    expect_special_error("tokenizer_config.json",
                         "{\"added_tokens_decoder\": {\"x1\": {\"content\": \"<x>\"}}}",
                         "added_tokens_decoder \"x1\"", "not a token id");
    expect_special_error("tokenizer_config.json",
                         "{\"added_tokens_decoder\": {\"99999999999\": {\"content\": \"<x>\"}}}",
                         "99999999999", "not a token id");
    expect_special_error("tokenizer_config.json",
                         "{\"added_tokens_decoder\": {\"7\": \"<x>\"}}", "added_tokens_decoder \"7\"",
                         "content");
    expect_special_error("special_tokens_map.json", "{\"pad_token\": [\"<p>\"]}", "pad_token",
                         "string");
    expect_special_error("added_tokens.json", "{\"<x>\": \"5\"}", "\"<x>\"", "no id");
    expect_special_error("added_tokens.json", "{\"<x>\": -1}", "\"<x>\"", "no id");
    expect_special_error("added_tokens.json", "{\"<x>\": 1.5}", "\"<x>\"", "no id");
    expect_special_error("added_tokens.json", "{\"<x>\": 1e300}", "\"<x>\"", "no id");
}

/* An added token whose content is empty is refused naming the file and the id: it could never be
 * matched, and an empty text is no token. One that holds \u0000 is refused as every JSON file
 * refuses it. */
static void test_empty_added_token(void) {
    expect_special_error("tokenizer_config.json",
                         "{\"added_tokens_decoder\": {\"7\": {\"content\": \"\"}}}",
                         "added_tokens_decoder \"7\"", "empty");
    expect_special_error("tokenizer_config.json",
                         "{\"added_tokens_decoder\": {\"7\": {\"content\": \"\\u0000x\"}}}",
                         "tokenizer_config.json line 1", "\\u0000");
    expect_special_error("tokenizer_config.json",
                         "{\"eos_token\": \"a\", \"added_tokens_decoder\": {\"1\": "
                         "{\"content\": \"b\"}, \"9\": {\"content\": \"\"}}}",
                         "added_tokens_decoder \"9\"", "empty");
    expect_special_error("added_tokens.json", "{\"\": 5}", "id 5", "empty");
}

/* Two tokens sharing one id are refused, naming the file, the tokens and the id: in vocab.json
 * (once a repeated token took its last id; the reference would decode the id to one of them and
 * encode the other to it) and in added_tokens.json (HF keeps one of them, the other silently
 * stops being cut out). A repeated added token takes its last id, as in vocab.json. */
static void test_shared_ids(void) {
    expect_load_error("{\"a\":0,\"b\":1,\"c\":1}", "", "vocab.json", "\"b\" and \"c\"", "id 1");
    expect_load_error("{\"a\":0,\"a\":1,\"b\":1}", "", "vocab.json", "\"a\" and \"b\"", "id 1");
    expect_load_error("{\"b\":5,\"a\":5,\"b\":5,\"c\":0}", "", "vocab.json", "\"b\" and \"a\"",
                      "id 5");
    expect_special_error("added_tokens.json", "{\"<x>\": 5, \"<y>\": 5}", "\"<x>\" and \"<y>\"",
                         "id 5");
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_file(dir, "vocab.json", GOOD_VOCAB);
    write_file(dir, "merges.txt", GOOD_MERGES);
    write_file(dir, "added_tokens.json", "{\"<x>\": 5, \"<x>\": 6, \"<y>\": 5}");
    fg_tokenizer *t = load_dir(dir, err);
    EXPECT(t != NULL, "added_tokens.json with \"<x>\" repeated (its last id 6): %s", err);
    if (t) {
        CU_ASSERT(encodes_to(t, "<x><y>", (const int[]){6, 5}, 2));
        EXPECT(!strcmp(decoded(t, 5), "<y>"), "id 5: expected \"<y>\", got \"%s\"", decoded(t, 5));
    }
    tokenizer_free(t);
    rm_tree(dir);
    free(dir);
}

static void test_missing_files(void) {
    expect_load_error(NULL, GOOD_MERGES, "vocab.json", "cannot open", NULL);
    expect_load_error(GOOD_VOCAB, NULL, "merges.txt", "cannot open", NULL);
}

static void test_unreadable_file(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN], path[4200];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    snprintf(path, sizeof path, "%s/vocab.json", dir); /* a directory, not a file */
    CU_ASSERT_EQUAL_FATAL(mkdir(path, 0700), 0);
    write_file(dir, "merges.txt", GOOD_MERGES);
    CU_ASSERT_PTR_NULL(load_dir(dir, err));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "vocab.json"));
    CU_ASSERT(strstr(err, "cannot read") || strstr(err, "cannot open"));
    rm_tree(dir);
    free(dir);
}

static void test_bad_vocab(void) {
    expect_load_error("{\"a\": 0,\n \"b\": 1,,\n \"c\": 2}", GOOD_MERGES, "vocab.json",
                      "malformed JSON", "line 2");
    expect_load_error("", GOOD_MERGES, "vocab.json", "malformed JSON", NULL);
    expect_load_error("{\"a\":0}\n\n{\"b\":1}", GOOD_MERGES, "vocab.json", "malformed JSON",
                      "line 3");
    expect_load_error("[\"a\", \"b\"]", GOOD_MERGES, "vocab.json", "not a JSON object", NULL);
    /* "<s\u0000x>" is a token of its own to Python; cJSON would read "<s" */
    expect_load_error("{\"a\": 0,\n \"<s\\u0000x>\": 1}", GOOD_MERGES, "vocab.json line 2",
                      "\\u0000", NULL);
    expect_load_error("{\"a\":0,\"b\":1.5}", GOOD_MERGES, "vocab.json", "non-integer", "\"b\"");
    expect_load_error("{\"a\":0,\"b\":\"1\"}", GOOD_MERGES, "vocab.json", "non-integer", "\"b\"");
    expect_load_error("{\"a\":0,\"b\":null}", GOOD_MERGES, "vocab.json", "non-integer", NULL);
    expect_load_error("{\"a\":0,\"b\":-1}", GOOD_MERGES, "vocab.json", "out of range", NULL);
    expect_load_error("{\"a\":1e12}", GOOD_MERGES, "vocab.json", "out of range", NULL);
    expect_load_error("{}", GOOD_MERGES, "vocab.json", "empty", NULL);
}

static void test_bad_merges(void) {
    expect_load_error(GOOD_VOCAB, "#version: 0.2\na b\nab\n", "merges.txt", "line 3",
                      "two symbols");
    expect_load_error(GOOD_VOCAB, "#version: 0.2\na b c\n", "merges.txt", "line 2",
                      "two symbols");
    expect_load_error(GOOD_VOCAB, "a b\n\nb c\n", "merges.txt", "line 3", "\"bc\" is not in the vocab");
    expect_load_error(GOOD_VOCAB, "#version: 0.2\nab c\n", "merges.txt", "line 2",
                      "\"abc\" is not in the vocab");
}

/* Tolerated: no #version line, blank lines, CRLF, no final newline. */
static void test_merges_variants(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    write_file(dir, "vocab.json", "{\"a\":0,\"b\":1,\"ab\":2,\"c\":3,\"abc\":4}");
    write_file(dir, "merges.txt", "a b\r\n\r\n  \nab\tc");
    fg_tokenizer *t = load_dir(dir, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT(encodes_to(t, "abcab ", (const int[]){4, 2}, 2) == 0); /* ' ' has no token */
    CU_ASSERT(encodes_to(t, "abcab", (const int[]){4, 2}, 2));
    tokenizer_free(t);
    rm_tree(dir);
    free(dir);
}

void add_tokenizer_tests(void) {
    CU_pSuite s = CU_add_suite("tokenizer", NULL, NULL);
    if (!s) return;
    CU_add_test(s, "fixture cases match HF's slow GPT2Tokenizer", test_reference_cases);
    CU_add_test(s, "GPT-2's special token and added_tokens.json", test_reference_cases_gpt2);
    CU_add_test(s, "added tokens with lstrip, rstrip, single_word", test_reference_cases_added);
    CU_add_test(s, "vocab size", test_vocab_size);
    CU_add_test(s, "decode(encode(s)) == s, hand-picked", test_roundtrip_strings);
    CU_add_test(s, "decode(encode(s)) == s, random UTF-8", test_roundtrip_random_utf8);
    CU_add_test(s, "invalid UTF-8 and arbitrary bytes round-trip", test_invalid_utf8);
    CU_add_test(s, "long pre-tokens", test_long_input);
    CU_add_test(s, "decode: unknown ids, special tokens, empty", test_decode);
    CU_add_test(s, "merge order of the slow tokenizer", test_merge_order);
    CU_add_test(s, "tokens outside the byte map, bytes without a token", test_unusual_vocab);
    CU_add_test(s, "the empty string as a vocab key", test_empty_vocab_key);
    CU_add_test(s, "unk_token and GPT2Tokenizer's default special token", test_unk_and_defaults);
    CU_add_test(s, "a special token replacing an added token", test_replaced_added_token);
    CU_add_test(s, "repeated tokens and ids in vocab.json resolve as the reference", test_repeated_vocab_entries);
    CU_add_test(s, "missing files", test_missing_files);
    CU_add_test(s, "unreadable file", test_unreadable_file);
    CU_add_test(s, "bad vocab.json", test_bad_vocab);
    CU_add_test(s, "bad merges.txt", test_bad_merges);
    CU_add_test(s, "bad special-token files", test_bad_special_files);
    CU_add_test(s, "an empty added token is refused", test_empty_added_token);
    CU_add_test(s, "two tokens sharing one id are refused", test_shared_ids);
    CU_add_test(s, "merges.txt variants", test_merges_variants);
}
