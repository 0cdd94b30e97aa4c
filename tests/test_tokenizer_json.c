/* test_tokenizer_json.c: tokenizer.json (support/tokenizer_json.c) against its references, on three
 * real vocabularies (tests/fixtures/tokenizers/, written by scripts/make_tokenizer_json_fixture.py
 * and unpacked into build/tokenizers/ by make): LLaMA 2's SentencePiece BPE with byte fallback,
 * LLaMA 3's byte-level BPE (digits three at a time, ignore_merges) and Qwen2's (NFC, one digit at
 * a time).
 *   - llama.cpp's test strings and the ids the original tokenizers gave them;
 *   - 20,000 lines each, of many scripts, digits, whitespace runs, contractions and special tokens,
 *     against HF tokenizers' ids and decoding;
 *   - NFC against Python's unicodedata;
 *   - every field this project does not implement refused with one line. */
#define _POSIX_C_SOURCE 200809L
#include "flexgen.h"
#include "support/nfc.h"
#include "tests.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const VOCABS[3] = {"llama-spm", "llama-bpe", "qwen2"};

static fg_tokenizer *load_vocab(const char *name) {
    char path[4096], err[FG_ERR_LEN] = "";
    snprintf(path, sizeof path, "build/tokenizers/%s/tokenizer.json", name);
    fg_tokenizer *t = tokenizer_load_json(path, err);
    if (!t) fprintf(stderr, "\n  %s\n", err);
    return t;
}

static int same_ids(const int *a, int na, const int *b, int nb) {
    return na == nb && (na == 0 || !memcmp(a, b, (size_t)na * sizeof *a));
}

static void show_ids(const char *what, const int *ids, int n) {
    fprintf(stderr, "    %s:", what);
    for (int i = 0; i < n && i < 40; i++) fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "%s\n", n > 40 ? " ..." : "");
}

/* Encodes text and compares with want; prints the first few misses. */
static int encodes_to(const fg_tokenizer *t, const char *text, size_t len, const int *want, int n_want,
                      int *shown) {
    int *ids = NULL, n = 0;
    char err[FG_ERR_LEN] = "";
    int ok = tokenizer_encode(t, text, len, &ids, &n, err) == 0 && same_ids(ids, n, want, n_want);
    if (!ok && (*shown)++ < 5) {
        fprintf(stderr, "\n  \"%.*s\" %s\n", (int)(len < 120 ? len : 120), text, err);
        show_ids("got ", ids, n);
        show_ids("want", want, n_want);
    }
    free(ids);
    return ok;
}

/* ------------------------------------------------------------------------------------------
 * llama.cpp's pairs: .inp holds the strings, each followed by "\n__ggml_vocab_test__\n"; .out a
 * line of ids for each.
 * ------------------------------------------------------------------------------------------ */
static int parse_ids(char *line, int *ids, int cap) {
    int n = 0;
    for (char *tok = strtok(line, " "); tok && n < cap; tok = strtok(NULL, " ")) ids[n++] = atoi(tok);
    return n;
}

static void check_llamacpp(const char *name, int expect_strings) {
    char path[4096];
    fg_tokenizer *t = load_vocab(name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    snprintf(path, sizeof path, "%s/%s/llamacpp.inp", fixture("tokenizers"), name);
    char *inp = slurp(path, NULL);
    snprintf(path, sizeof path, "%s/%s/llamacpp.out", fixture("tokenizers"), name);
    char *out = slurp(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(inp);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    static const char SEP[] = "\n__ggml_vocab_test__\n";
    int strings = 0, agree = 0, shown = 0, *want = malloc(4096 * sizeof *want);
    char *s = inp, *line = out;
    for (char *end; (end = strstr(s, SEP)); s = end + strlen(SEP)) {
        char *nl = strchr(line, '\n');
        CU_ASSERT_PTR_NOT_NULL_FATAL(nl);
        *nl = '\0';
        int n_want = parse_ids(line, want, 4096);
        line = nl + 1;
        strings++;
        agree += encodes_to(t, s, (size_t)(end - s), want, n_want, &shown);
    }
    fprintf(stderr, "[%s: %d of %d llama.cpp strings agree] ", name, agree, strings);
    CU_ASSERT_EQUAL(strings, expect_strings);
    CU_ASSERT_EQUAL(agree, strings);
    free(want), free(inp), free(out);
    tokenizer_free(t);
}

static void test_llamacpp_spm(void) { check_llamacpp("llama-spm", 46); }
static void test_llamacpp_llama3(void) { check_llamacpp("llama-bpe", 46); }
static void test_llamacpp_qwen2(void) { check_llamacpp("qwen2", 46); }

/* ------------------------------------------------------------------------------------------
 * HF tokenizers on 20,000 lines each: {"text", "ids", and "decoded" where HF's decode is not the
 * text}.
 * ------------------------------------------------------------------------------------------ */
static int decodes_to(const fg_tokenizer *t, const cJSON *ids, const char *want, int *shown) {
    int n = cJSON_GetArraySize(ids), i = 0, *v = malloc((size_t)(n + 1) * sizeof *v);
    const cJSON *e;
    cJSON_ArrayForEach(e, ids) v[i++] = e->valueint;
    size_t len, clean_len;
    char *raw = tokenizer_decode(t, v, n, &len), *clean = utf8_replace_invalid(raw, len, &clean_len);
    int ok = clean && clean_len == strlen(want) && !memcmp(clean, want, clean_len);
    if (!ok && (*shown)++ < 5) fprintf(stderr, "\n  decoded \"%s\", want \"%s\"\n", clean, want);
    free(v), free(raw), free(clean);
    return ok;
}

static void check_cases(const char *name) {
    char path[4096];
    fg_tokenizer *t = load_vocab(name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    snprintf(path, sizeof path, "build/tokenizers/%s/cases.jsonl", name);
    FILE *f = fopen(path, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    char *line = NULL;
    size_t cap = 0;
    int lines = 0, encoded = 0, decoded = 0, shown = 0, *want = malloc(65536 * sizeof *want);
    while (getline(&line, &cap, f) > 0) {
        cJSON *c = cJSON_Parse(line);
        const cJSON *text = fg_json_get(c, "text"), *ids = fg_json_get(c, "ids"), *e;
        const cJSON *dec = fg_json_get(c, "decoded");
        CU_ASSERT_FATAL(cJSON_IsString(text) && cJSON_IsArray(ids));
        int n = 0;
        cJSON_ArrayForEach(e, ids) if (n < 65536) want[n++] = e->valueint;
        lines++;
        encoded += encodes_to(t, text->valuestring, strlen(text->valuestring), want, n, &shown);
        decoded += decodes_to(t, ids, cJSON_IsString(dec) ? dec->valuestring : text->valuestring, &shown);
        cJSON_Delete(c);
    }
    fprintf(stderr, "[%s: %d lines, %d encode and %d decode as HF] ", name, lines, encoded, decoded);
    CU_ASSERT(lines >= 20000);
    CU_ASSERT_EQUAL(encoded, lines);
    CU_ASSERT_EQUAL(decoded, lines);
    free(line), free(want);
    fclose(f);
    tokenizer_free(t);
}

static void test_cases_spm(void) { check_cases("llama-spm"); }
static void test_cases_llama3(void) { check_cases("llama-bpe"); }
static void test_cases_qwen2(void) { check_cases("qwen2"); }

/* BOS from the post_processor (and add_bos_token); decoding a continuation. */
static void test_bos_and_continuation(void) {
    const int bos[3] = {1, 128000, -1};
    for (int i = 0; i < 3; i++) {
        fg_tokenizer *t = load_vocab(VOCABS[i]);
        CU_ASSERT_PTR_NOT_NULL_FATAL(t);
        CU_ASSERT_EQUAL(tokenizer_bos_id(t), bos[i]);
        int *ids, n;
        char err[FG_ERR_LEN];
        CU_ASSERT_EQUAL_FATAL(tokenizer_encode(t, "Hello world", 11, &ids, &n, err), 0);
        CU_ASSERT_FATAL(n >= 2);
        size_t len;
        char *tail = tokenizer_decode_from(t, ids, n, n - 1, &len); /* " world", its space kept */
        CU_ASSERT_STRING_EQUAL(tail, " world");
        free(tail), free(ids);
        tokenizer_free(t);
    }
}

/* ------------------------------------------------------------------------------------------
 * The forms of tests/fixtures/tokenizer-forms/ (scripts/make_tokenizer_forms_fixture.py): small
 * tokenizer.json files with no tokenizer_config.json beside them, each holding a post_processor
 * template or a Metaspace decoder the real vocabularies leave out, and what HF tokenizers gives:
 * encode(text) with the template's BOS, decode(ids) with special tokens kept.
 * ------------------------------------------------------------------------------------------ */
static int json_ids(const cJSON *list, int *ids, int cap) {
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, list) if (n < cap) ids[n++] = e->valueint;
    return n;
}

/* One case of a form: the text's ids (BOS first where the template adds it) and their decoding,
 * or, for a case of ids alone, their decoding. */
static int form_case_agrees(const char *form, const fg_tokenizer *t, const cJSON *c) {
    int want[64], n_want = json_ids(cJSON_GetObjectItem(c, "ids"), want, 64), got[64], n = 0, *ids = NULL, n_ids = 0;
    const cJSON *text = cJSON_GetObjectItem(c, "text");
    const char *decoded = cJSON_GetObjectItem(c, "decoded")->valuestring;
    char err[FG_ERR_LEN] = "";
    int ok = 1;
    if (cJSON_IsString(text)) {
        if (tokenizer_bos_id(t) >= 0) got[n++] = tokenizer_bos_id(t);
        ok = tokenizer_encode(t, text->valuestring, strlen(text->valuestring), &ids, &n_ids, err) == 0 && n + n_ids <= 64;
        for (int i = 0; ok && i < n_ids; i++) got[n++] = ids[i];
        free(ids);
        ok = ok && same_ids(got, n, want, n_want);
    }
    size_t len;
    char *back = tokenizer_decode(t, want, n_want, &len);
    ok = ok && back && !strcmp(back, decoded);
    if (!ok) {
        fprintf(stderr, "\n  %s, %s \"%s\": decoded \"%s\", HF \"%s\" %s\n", form, cJSON_IsString(text) ? "text" : "ids",
                cJSON_IsString(text) ? text->valuestring : "", back ? back : "", decoded, err);
        if (cJSON_IsString(text)) show_ids("got ", got, n);
        show_ids("want", want, n_want);
    }
    free(back);
    return ok;
}

static void test_forms(void) {
    char *text = slurp(fixture("tokenizer-forms/cases.json"), NULL);
    cJSON *root = cJSON_Parse(text);
    const cJSON *forms = cJSON_GetObjectItem(root, "forms"), *form;
    CU_ASSERT_FATAL(cJSON_GetArraySize(forms) >= 8);
    cJSON_ArrayForEach(form, forms) {
        char path[4200], err[FG_ERR_LEN] = "";
        snprintf(path, sizeof path, "%s/%s.json", fixture("tokenizer-forms"), form->string);
        fg_tokenizer *t = tokenizer_load_json(path, err);
        EXPECT(t != NULL, "%s: %s", form->string, err);
        if (!t) continue;
        const cJSON *bos = cJSON_GetObjectItem(form, "bos"), *c;
        int want_bos = cJSON_IsNumber(bos) ? bos->valueint : -1;
        EXPECT(tokenizer_bos_id(t) == want_bos, "%s: BOS %d, HF's %d (-1: none)", form->string, tokenizer_bos_id(t),
               want_bos);
        int cases = 0, agree = 0;
        cJSON_ArrayForEach(c, cJSON_GetObjectItem(form, "cases")) {
            cases++;
            agree += form_case_agrees(form->string, t, c);
        }
        EXPECT(cases > 0 && agree == cases, "%s: %d of %d cases agree with HF tokenizers", form->string, agree, cases);
        tokenizer_free(t);
    }
    cJSON_Delete(root);
    free(text);
}

/* ------------------------------------------------------------------------------------------
 * NFC: tests/fixtures/nfc-cases.txt, "input hex \t NFC hex" from Python's unicodedata.
 * ------------------------------------------------------------------------------------------ */
static size_t unhex(const char *s, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i + 1 < n; i += 2) {
        unsigned v;
        if (sscanf(s + i, "%2x", &v) != 1) break;
        out[o++] = (char)v;
    }
    return o;
}

static void test_nfc(void) {
    FILE *f = fopen("build/tokenizers/nfc-cases.txt", "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    char *line = NULL, *in = malloc(1 << 16), *want = malloc(1 << 16);
    size_t cap = 0;
    int cases = 0, agree = 0;
    while (getline(&line, &cap, f) > 0) {
        char *tab = strchr(line, '\t');
        if (!tab) continue;
        size_t n_in = unhex(line, (size_t)(tab - line), in), n_want = unhex(tab + 1, strcspn(tab + 1, "\n"), want);
        size_t n;
        char *got = utf8_nfc(in, n_in, &n);
        cases++;
        agree += got && n == n_want && !memcmp(got, want, n);
        free(got);
    }
    fprintf(stderr, "[%d of %d NFC cases agree] ", agree, cases);
    CU_ASSERT(cases > 12000);
    CU_ASSERT_EQUAL(agree, cases);
    free(line), free(in), free(want);
    fclose(f);
}

/* ------------------------------------------------------------------------------------------
 * What is not implemented, refused with one line naming it.
 * ------------------------------------------------------------------------------------------ */
#define SPM_VOCAB "\"vocab\": {\"<unk>\": 0, \"a\": 1, \"b\": 2, \"ab\": 3}, \"merges\": [\"a b\"]"

static void refused(const char *json, const char *want) {
    char *dir = make_temp_dir(), path[4200], err[FG_ERR_LEN] = "";
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    fputs(json, f);
    fclose(f);
    fg_tokenizer *t = tokenizer_load_json(path, err);
    CU_ASSERT_PTR_NULL(t);
    if (!strstr(err, want) || strchr(err, '\n')) fprintf(stderr, "\n  got \"%s\", want \"%s\"\n", err, want);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, want));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "tokenizer.json"));
    tokenizer_free(t);
    remove(path);
    rmdir(dir);
    free(dir);
}

/* tokenizer_config.json's add_bos_token beside a tokenizer.json: true, false or null (as absent)
 * taken; any other value (0, "false") refused naming the file, where it was ignored and the BOS
 * kept. */
static void test_add_bos_token_values(void) {
    static const char *const values[] = {"true", "false", "null", "0", "\"false\"", "[]"};
    for (int i = 0; i < 6; i++) {
        char *dir = make_temp_dir(), path[4200], config[4200], err[FG_ERR_LEN] = "";
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        snprintf(config, sizeof config, "%s/tokenizer_config.json", dir);
        write_text_file(path, "{\"added_tokens\": [{\"id\": 4, \"content\": \"<s>\", \"special\": true}], "
                              "\"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}");
        char text[200];
        snprintf(text, sizeof text, "{\"bos_token\": \"<s>\", \"add_bos_token\": %s}", values[i]);
        write_text_file(config, text);
        fg_tokenizer *t = tokenizer_load_json(path, err);
        if (i < 3)
            EXPECT(t && tokenizer_bos_id(t) == (i == 0 ? 4 : -1), "add_bos_token %s: expected BOS %d, got %s %d",
                   values[i], i == 0 ? 4 : -1, t ? "" : err, t ? tokenizer_bos_id(t) : 0);
        else
            EXPECT(!t && strstr(err, "tokenizer_config.json") && strstr(err, "add_bos_token"),
                   "add_bos_token %s: expected it refused naming the file and key, got '%s'", values[i], err);
        tokenizer_free(t);
        rm_tree(dir);
        free(dir);
    }
}

/* A NUL byte inside a string of tokenizer.json or of the tokenizer_config.json beside it: refused
 * naming the file, where cJSON ended the string there and the rest of it was lost. */
static void test_nul_byte_refused(void) {
    static const char tokenizer[] = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"<unk>\": 0, \"a\": 1, "
                                    "\"b\": 2, \"ab\": 3, \"a\0b\": 4}, \"merges\": [\"a b\"]}}";
    static const char config[] = "{\"bos_token\": \"<s\0>\", \"add_bos_token\": true}";
    for (int i = 0; i < 2; i++) {
        char *dir = make_temp_dir(), path[4200], side[4200], err[FG_ERR_LEN] = "";
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        snprintf(side, sizeof side, "%s/tokenizer_config.json", dir);
        FILE *f = fopen(path, "wb");
        if (i == 0) fwrite(tokenizer, 1, sizeof tokenizer - 1, f);
        else fputs("{\"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", f);
        fclose(f);
        if (i == 1) {
            f = fopen(side, "wb");
            fwrite(config, 1, sizeof config - 1, f);
            fclose(f);
        }
        fg_tokenizer *t = tokenizer_load_json(path, err);
        EXPECT(!t && strstr(err, i ? "tokenizer_config.json" : "tokenizer.json") && strstr(err, "NUL byte"),
               "a NUL byte in %s: expected it refused naming the file, got '%s'", i ? side : path, err);
        tokenizer_free(t);
        rm_tree(dir);
        free(dir);
    }
}

static void test_refusals(void) {
    refused("{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", "model \"Unigram\" is not implemented");
    refused("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", "model \"WordPiece\"");
    refused("{\"normalizer\": {\"type\": \"NFKC\"}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}",
            "normalizer \"NFKC\"");
    refused("{\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Lowercase\"}]}, "
            "\"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", "normalizer \"Lowercase\"");
    refused("{\"pre_tokenizer\": {\"type\": \"Whitespace\"}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}",
            "pre_tokenizer \"Whitespace\"");
    /* a Sequence whose parts are not a list: no rules read, once, where they must be refused */
    refused("{\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": 5}, \"model\": {\"type\": \"BPE\", "
            SPM_VOCAB "}}", "a Sequence's \"normalizers\" is not a list");
    refused("{\"decoder\": {\"type\": \"Sequence\", \"decoders\": \"x\"}, \"model\": {\"type\": \"BPE\", "
            SPM_VOCAB "}}", "a Sequence's \"decoders\" is not a list");
    refused("{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": {}}, \"model\": {\"type\": "
            "\"BPE\", " SPM_VOCAB "}}", "a Sequence's \"pretokenizers\" is not a list");
    refused("{\"post_processor\": {\"type\": \"Sequence\", \"processors\": 1}, \"model\": {\"type\": \"BPE\", "
            SPM_VOCAB "}}", "a Sequence's \"processors\" is not a list");
    refused("{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
            "{\"Regex\": \"\\\\d+\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\"}]}, "
            "\"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", "LLaMA 3's or Qwen2's Split");
    refused("{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"prepend_scheme\": "
            "\"always\", \"split\": true}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", "pre_tokenizer \"Metaspace\"");
    refused("{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"add_prefix_space\": "
            "true}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", "pre_tokenizer \"Metaspace\"");
    refused("{\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true}, \"model\": {\"type\": \"BPE\", "
            SPM_VOCAB "}}", "pre_tokenizer \"ByteLevel\"");
    refused("{\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"Sequence\": {\"id\": \"A\"}}, "
            "{\"SpecialToken\": {\"id\": \"</s>\"}}]}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}",
            "post_processor \"TemplateProcessing\"");
    /* the template's BOS: one integer id of a token; -5 would drop the BOS, 1e30 become INT_MAX */
    static const char *const bos_ids[] = {"-5", "1e30", "1.5", "\"1\"", "4", "1, 2", ""};
    for (int i = 0; i < 7; i++) {
        char json[1024];
        snprintf(json, sizeof json, "{\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
                 "[{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", "
                 "\"type_id\": 0}}], \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [%s], "
                 "\"tokens\": [\"<s>\"]}}}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", bos_ids[i]);
        refused(json, "post_processor.special_tokens[\"<s>\"].ids");
    }
    refused("{\"post_processor\": {\"type\": \"RobertaProcessing\"}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}",
            "post_processor \"RobertaProcessing\"");
    refused("{\"decoder\": {\"type\": \"WordPiece\"}, \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}",
            "decoder \"WordPiece\"");
    refused("{\"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"prepend_scheme\": \"sometimes\"}, "
            "\"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", "decoder \"Metaspace\" is not implemented");
    refused("{\"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"_\", \"prepend_scheme\": \"first\"}, "
            "\"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", "decoder \"Metaspace\" is not implemented");
    refused("{\"model\": {\"type\": \"BPE\", \"dropout\": 0.1, " SPM_VOCAB "}}", "model.dropout");
    refused("{\"model\": {\"type\": \"BPE\", \"continuing_subword_prefix\": \"##\", " SPM_VOCAB "}}",
            "continuing_subword_prefix");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}",
            "model.merges[0]: merge result \"ab\" is not in the vocab");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"ab\": 1}, \"merges\": [\"a b\"]}}",
            "model.merges[0]: \"b\" is not in the vocab");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b c\"]}}",
            "model.merges[0]: not \"a b\"");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}}", "in the vocab twice");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}, \"merges\": []}}", "model.vocab");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}", "model.vocab is empty");
    refused("{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"vocab\": {}, \"merges\": []}}",
            "model.vocab is empty");
    refused("{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<u>\", " SPM_VOCAB "}}", "unk_token \"<u>\" is not in");
    refused("{\"added_tokens\": [{\"id\": 5}], \"model\": {\"type\": \"BPE\", " SPM_VOCAB "}}", "added_tokens[0]");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a a\"]", "malformed JSON");
    refused("[1, 2]", "not a JSON object");
}

/* Metaspace ("split": false) puts U+2581 for spaces, and before the text by its prepend_scheme, or
 * by the older add_prefix_space where that is absent. */
static void test_metaspace(void) {
    static const struct { const char *fields; int ids[2]; } cases[] = {
        {"\"prepend_scheme\": \"first\"", {3, 3}}, {"\"prepend_scheme\": \"always\"", {3, 3}},
        {"\"prepend_scheme\": \"never\"", {2, 3}}, {"\"add_prefix_space\": true", {3, 3}}, {"\"add_prefix_space\": false", {2, 3}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *dir = make_temp_dir(), path[4200], json[1024], err[FG_ERR_LEN] = "";
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        snprintf(json, sizeof json, "{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", %s, "
                 "\"split\": false}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"<unk>\": 0, \"\\u2581\": 1, \"a\": 2, "
                 "\"\\u2581a\": 3}, \"merges\": [\"\\u2581 a\"]}}", cases[i].fields);
        FILE *f = fopen(path, "w");
        fputs(json, f);
        fclose(f);
        fg_tokenizer *t = tokenizer_load_json(path, err);
        int *ids = NULL, n = 0;
        EXPECT(t && tokenizer_encode(t, "a a", 3, &ids, &n, err) == 0 && n == 2 && ids[0] == cases[i].ids[0] &&
               ids[1] == cases[i].ids[1], "Metaspace with %s: %s", cases[i].fields, err);
        free(ids);
        tokenizer_free(t);
        remove(path);
        rmdir(dir);
        free(dir);
    }
}

/* A tokenizer built with no tokens at all: every lookup in its empty symbol table finds nothing
 * (the unk token, the byte tokens, a character of the text), and each is one line, not a crash. */
static void test_no_tokens(void) {
    const tok_rules rules = {.bos_id = -1};
    char err[FG_ERR_LEN] = "";
    fg_tokenizer *t = tokenizer_new(&rules, 0, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    EXPECT(tokenizer_finish(t, NULL, 0, "<unk>", "empty.json", err) != 0 && strstr(err, "\"<unk>\" is not in the vocab"),
           "an unk token in a tokenizer of no tokens: expected it refused, got \"%s\"", err);
    tokenizer_free(t);
    t = tokenizer_new(&rules, 0, err);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_EQUAL_FATAL(tokenizer_finish(t, NULL, 0, NULL, "empty.json", err), 0);
    int *ids = NULL, n = -1;
    EXPECT(tokenizer_encode(t, "ab", 2, &ids, &n, err) != 0 && strstr(err, "has no token") && n == 0,
           "text through a tokenizer of no tokens: expected one line saying a character has no token, got \"%s\"", err);
    free(ids);
    tokenizer_free(t);
}

static void test_missing_file(void) {
    char err[FG_ERR_LEN] = "";
    CU_ASSERT_PTR_NULL(tokenizer_load_json("/nonexistent/tokenizer.json", err));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "/nonexistent/tokenizer.json"));
}

void add_tokenizer_json_tests(void) {
    CU_pSuite s = CU_add_suite("tokenizer-json", NULL, NULL);
    CU_add_test(s, "llama.cpp's strings, LLaMA 2's SentencePiece vocab", test_llamacpp_spm);
    CU_add_test(s, "llama.cpp's strings, LLaMA 3's byte-level vocab", test_llamacpp_llama3);
    CU_add_test(s, "llama.cpp's strings, Qwen2's byte-level vocab", test_llamacpp_qwen2);
    CU_add_test(s, "HF tokenizers on 20,000 lines, LLaMA 2", test_cases_spm);
    CU_add_test(s, "HF tokenizers on 20,000 lines, LLaMA 3", test_cases_llama3);
    CU_add_test(s, "HF tokenizers on 20,000 lines, Qwen2", test_cases_qwen2);
    CU_add_test(s, "BOS from the post_processor; a continuation's text", test_bos_and_continuation);
    CU_add_test(s, "templates' BOS with no tokenizer_config.json, Metaspace decoders: HF tokenizers' ids and text",
                test_forms);
    CU_add_test(s, "NFC against Python's unicodedata", test_nfc);
    CU_add_test(s, "unimplemented fields refused with one line", test_refusals);
    CU_add_test(s, "add_bos_token beside tokenizer.json: true, false or null; other values refused",
                test_add_bos_token_values);
    CU_add_test(s, "a NUL byte in tokenizer.json or tokenizer_config.json refused", test_nul_byte_refused);
    CU_add_test(s, "Metaspace: prepend_scheme first, always, never; the older add_prefix_space", test_metaspace);
    CU_add_test(s, "a tokenizer of no tokens: lookups find nothing", test_no_tokens);
    CU_add_test(s, "a missing tokenizer.json", test_missing_file);
}
