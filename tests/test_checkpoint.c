/* test_checkpoint.c: the checkpoint loader (opt_model.c) and its bad input, and fp16.
 *
 * Good checkpoints: the three fixtures load with the fp16 values of their tensors; F32 and BF16
 * copies of opt-tiny give the same (fp16-rounded) weights; OPTModel names without "model.";
 * tied and explicit lm_head; the sharded archive as st_open_dir maps it.
 * Bad checkpoints: every broken safetensors file, config.json or shard index, and a tied
 * lm_head.weight unlike the embedding, is refused with -1 and one line that names the file or
 * tensor and the problem.
 * fp16: the scalar conversions (round trip, round to nearest even, overflow, subnormals) and the
 * vector path against them.
 *
 * Broken checkpoints are made in a temp dir from a fixture: fixture_copy() copies its config.json
 * and reads its tensors into a tensor list, a test edits the list, and write_safetensors() writes
 * it back (with any header offsets a test overrides).
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "tests.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * Files
 * --------------------------------------------------------------------------------------------- */


static int write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(data, 1, n, f) == n;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}


static void write_text(const char *dir, const char *name, const char *text) {
    CU_ASSERT_EQUAL_FATAL(write_file(join(dir, name), text, strlen(text)), 0);
}

static void copy_file(const char *src, const char *dir, const char *name) {
    size_t n;
    char *data = slurp(src, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(data);
    CU_ASSERT_EQUAL(write_file(join(dir, name), data, n), 0);
    free(data);
}

/* A safetensors file by hand: the 8-byte header length hlen (true or not), `json`, then
 * data_len zero bytes. */
static void write_raw_safetensors(const char *path, uint64_t hlen, const char *json,
                                  size_t data_len) {
    size_t jlen = strlen(json), n = 8 + jlen + data_len;
    unsigned char *buf = calloc(1, n);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(buf + 8, json, jlen);
    CU_ASSERT_EQUAL(write_file(path, buf, n), 0);
    free(buf);
}

/* ---------------------------------------------------------------------------------------------
 * Tensor lists and write_safetensors
 * --------------------------------------------------------------------------------------------- */

typedef struct {
    char name[160];
    char dtype[8];
    int ndim;
    int64_t shape[4];
    unsigned char *data;
    size_t nbytes;
    int offsets_set;    /* header says data_offsets = off instead of where the bytes are */
    int64_t off[2];
} ttensor;

typedef struct {
    ttensor *t;
    int n;
} tlist;

static size_t dtype_bytes(const char *dtype) {
    if (!strcmp(dtype, "F32") || !strcmp(dtype, "I32")) return 4;
    if (!strcmp(dtype, "F64") || !strcmp(dtype, "I64")) return 8;
    return 2;
}

static size_t numel(const ttensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

static ttensor *tl_add(tlist *l, const char *name, const char *dtype, int ndim,
                       const int64_t *shape, const void *data) {
    l->t = realloc(l->t, (size_t)(l->n + 1) * sizeof *l->t);
    ttensor *t = memset(&l->t[l->n++], 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    snprintf(t->dtype, sizeof t->dtype, "%s", dtype);
    t->ndim = ndim;
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    t->nbytes = numel(t) * dtype_bytes(dtype);
    t->data = calloc(1, t->nbytes + 1);
    if (data) memcpy(t->data, data, t->nbytes);
    return t;
}

static int tl_index(const tlist *l, const char *name) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->t[i].name, name)) return i;
    return -1;
}

/* The named tensor; the test stops when the fixture lacks it. */
static ttensor *tl_get(tlist *l, const char *name) {
    int i = tl_index(l, name);
    CU_ASSERT_FATAL(i >= 0);
    return &l->t[i];
}

static void tl_remove(tlist *l, const char *name) {
    ttensor *t = tl_get(l, name);
    free(t->data);
    memmove(t, t + 1, (size_t)(l->t + l->n - (t + 1)) * sizeof *t);
    l->n--;
}

static void tl_free(tlist *l) {
    for (int i = 0; i < l->n; i++) free(l->t[i].data);
    free(l->t);
    l->t = NULL;
    l->n = 0;
}

/* New shape (and zeroed data of the matching size). */
static void tl_reshape(ttensor *t, int ndim, int64_t d0, int64_t d1) {
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->nbytes = numel(t) * dtype_bytes(t->dtype);
    t->data = realloc(t->data, t->nbytes + 1);
    memset(t->data, 0, t->nbytes);
}

static const char *st_dtype_name(st_dtype d) {
    return d == ST_F16 ? "F16" : d == ST_BF16 ? "BF16" : "F32";
}

/* Every tensor of the checkpoint in `dir`, in header order, via the public archive API. */
static void tl_from_dir(const char *dir, tlist *l) {
    st_archive a;
    char err[FG_ERR_LEN] = "";
    memset(l, 0, sizeof *l);
    CU_ASSERT_EQUAL_FATAL(st_open_dir(dir, &a, err), 0);
    for (int i = 0; i < a.n_tensors; i++) {
        const st_tensor *s = &a.tensors[i];
        tl_add(l, s->name, st_dtype_name(s->dtype), s->ndim, s->shape, s->data);
    }
    st_close(&a);
}

/* Byte offset of tensor i in the data section as write_safetensors lays it out. */
static int64_t packed_begin(const tlist *l, int i) {
    int64_t off = 0;
    for (int j = 0; j < i; j++) off += (int64_t)l->t[j].nbytes;
    return off;
}

/* Writes a safetensors file: every tensor's bytes packed in list order; the header gives each
 * tensor's dtype, shape and data_offsets (the packed range unless the test set other offsets),
 * padded with spaces to a multiple of 8 as the reference writer does. */
static int write_safetensors(const char *path, const tlist *l) {
    char *json = NULL;
    size_t jlen = 0;
    FILE *h = open_memstream(&json, &jlen);
    fprintf(h, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < l->n; i++) {
        const ttensor *t = &l->t[i];
        int64_t b = t->offsets_set ? t->off[0] : packed_begin(l, i);
        int64_t e = t->offsets_set ? t->off[1] : b + (int64_t)t->nbytes;
        fprintf(h, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name, t->dtype);
        for (int d = 0; d < t->ndim; d++)
            fprintf(h, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        fprintf(h, "],\"data_offsets\":[%lld,%lld]}", (long long)b, (long long)e);
    }
    fprintf(h, "}");
    while (ftell(h) % 8) fputc(' ', h);
    fclose(h);
    FILE *f = fopen(path, "wb");
    int ok = f != NULL;
    for (int i = 0; ok && i < 8; i++) ok = fputc((int)((uint64_t)jlen >> (8 * i)) & 0xff, f) != EOF;
    ok = ok && fwrite(json, 1, jlen, f) == jlen;
    for (int i = 0; ok && i < l->n; i++)
        ok = fwrite(l->t[i].data, 1, l->t[i].nbytes, f) == l->t[i].nbytes;
    if (f && fclose(f) != 0) ok = 0;
    free(json);
    return ok ? 0 : -1;
}

static void save_model(const char *dir, const tlist *l) {
    CU_ASSERT_EQUAL_FATAL(write_safetensors(join(dir, "model.safetensors"), l), 0);
}

/* A temp dir holding the fixture's config.json; *l gets the fixture's tensors. */
static char *fixture_copy(const char *name, tlist *l) {
    char src[4096];
    snprintf(src, sizeof src, "%s", fixture(name));
    char *dir = make_temp_dir();
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    copy_file(join(src, "config.json"), dir, "config.json");
    tl_from_dir(src, l);
    return dir;
}

/* A copy of the fixture with its tensors written back unchanged. */
static char *fixture_rewrite(const char *name) {
    tlist l;
    char *dir = fixture_copy(name, &l);
    save_model(dir, &l);
    tl_free(&l);
    return dir;
}

static void finish(char *dir, tlist *l) {
    if (l) tl_free(l);
    rm_tree(dir);
    free(dir);
}

/* ---------------------------------------------------------------------------------------------
 * Checking errors and weights
 * --------------------------------------------------------------------------------------------- */

/* err is one line holding every string of the NULL-terminated list. */
static void check_err(const char *err, ...) {
    va_list ap;
    va_start(ap, err);
    CU_ASSERT(err[0] != 0 && strchr(err, '\n') == NULL);
    for (const char *s; (s = va_arg(ap, const char *));) {
        int found = strstr(err, s) != NULL;
        CU_ASSERT(found);
        if (!found) fprintf(stderr, "\n    error \"%s\" lacks \"%s\"\n", err, s);
    }
    va_end(ap);
}

#define EXPECT_ERR(err, ...) check_err(err, __VA_ARGS__, (const char *)NULL)

/* model_weights_load(dir) fails and its message holds each string given. */
#define EXPECT_LOAD_FAIL(dir, ...)                                                           \
    do {                                                                                     \
        model_weights w_;                                                                      \
        char err_[FG_ERR_LEN] = "";                                                          \
        int rc_ = model_weights_load(dir, &w_, err_);                                          \
        CU_ASSERT_EQUAL(rc_, -1);                                                            \
        EXPECT_ERR(err_, __VA_ARGS__);                                                       \
        if (rc_ == 0) model_weights_free(&w_);                                                 \
        CU_ASSERT_PTR_NULL(w_.storage);                                                      \
    } while (0)

#define EXPECT_ST_FAIL(dir, ...)                                                             \
    do {                                                                                     \
        st_archive a_;                                                                       \
        char err_[FG_ERR_LEN] = "";                                                          \
        int rc_ = st_open_dir(dir, &a_, err_);                                               \
        CU_ASSERT_EQUAL(rc_, -1);                                                            \
        EXPECT_ERR(err_, __VA_ARGS__);                                                       \
        if (rc_ == 0) st_close(&a_);                                                         \
        CU_ASSERT_EQUAL(a_.n_files, 0);                                                      \
    } while (0)

static void load_ok(const char *dir, model_weights *w) {
    char err[FG_ERR_LEN] = "";
    int rc = model_weights_load(dir, w, err);
    if (rc) fprintf(stderr, "\n    %s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

static float source_value(const ttensor *t, size_t i) {
    uint16_t h;
    float f;
    if (!strcmp(t->dtype, "F32")) {
        memcpy(&f, t->data + 4 * i, 4);
        return f;
    }
    memcpy(&h, t->data + 2 * i, 2);
    return !strcmp(t->dtype, "BF16") ? bf16_to_fp32(h) : fp16_to_fp32(h);
}

/* Where the loader stored checkpoint tensor t in w. */
typedef struct {
    const fp16 *first;
    size_t row_stride, col_stride, cols;
} located;

static int locate(const model_weights *w, const ttensor *t, located *loc) {
    loc->cols = t->ndim == 2 ? (size_t)t->shape[1] : 1;
    int rc = opt_weight_locate(w, t->name, &loc->first, &loc->row_stride, &loc->col_stride);
    CU_ASSERT_EQUAL(rc, 0);
    if (rc) fprintf(stderr, "\n    %s not loaded\n", t->name);
    return rc == 0;
}

/* Element k, in checkpoint order. */
static float loaded_value(const located *loc, size_t k) {
    return fp16_to_fp32(loc->first[(k / loc->cols) * loc->row_stride + (k % loc->cols) * loc->col_stride]);
}

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Every tensor of l is in w as the fp16 rounding of its source values (bit for bit). Returns how
 * many floats that covers. */
static size_t check_weights_match(const model_weights *w, const tlist *l) {
    size_t covered = 0, bad = 0;
    for (int i = 0; i < l->n; i++) {
        const ttensor *t = &l->t[i];
        located loc;
        if (!locate(w, t, &loc)) continue;
        size_t n = numel(t), tbad = 0;
        for (size_t k = 0; k < n; k++) {
            float want = fp16_to_fp32(fp32_to_fp16(source_value(t, k)));
            tbad += float_bits(loaded_value(&loc, k)) != float_bits(want);
        }
        if (tbad) fprintf(stderr, "\n    %s: %zu of %zu values differ\n", t->name, tbad, n);
        bad += tbad;
        covered += n;
    }
    CU_ASSERT_EQUAL(bad, 0);
    return covered;
}

/* ---------------------------------------------------------------------------------------------
 * Good checkpoints
 * --------------------------------------------------------------------------------------------- */

static void test_fixture_opt_tiny(void) {
    model_weights w;
    tlist l;
    load_ok(fixture("opt-tiny"), &w);
    tl_from_dir(fixture("opt-tiny"), &l);
    CU_ASSERT_EQUAL(w.cfg.n_layers, 2);
    CU_ASSERT_EQUAL(w.cfg.hidden, 64);
    CU_ASSERT_EQUAL(w.cfg.vocab, 512);
    CU_ASSERT_EQUAL(w.cfg.max_pos, 64);
    CU_ASSERT_EQUAL(w.cfg.word_dim, 64);
    CU_ASSERT_EQUAL(w.cfg.pre_ln, 1);
    CU_ASSERT_PTR_NULL(w.project_in);
    CU_ASSERT_PTR_NULL(w.project_out);
    CU_ASSERT_PTR_NOT_NULL(w.final_ln_w);
    CU_ASSERT_EQUAL(tl_index(&l, "lm_head.weight"), -1);
    CU_ASSERT_PTR_EQUAL(w.lm_head, w.embed_tokens); /* tied */
    CU_ASSERT_EQUAL(check_weights_match(&w, &l), opt_param_count(&w.cfg));
    tl_free(&l);
    model_weights_free(&w);
}

static void test_fixture_opt_tiny_350m(void) {
    model_weights w;
    tlist l;
    load_ok(fixture("opt-tiny-350m"), &w);
    tl_from_dir(fixture("opt-tiny-350m"), &l);
    CU_ASSERT_EQUAL(w.cfg.pre_ln, 0);
    CU_ASSERT_EQUAL(w.cfg.hidden, 64);
    CU_ASSERT_EQUAL(w.cfg.word_dim, 32);
    CU_ASSERT_PTR_NOT_NULL(w.project_in);
    CU_ASSERT_PTR_NOT_NULL(w.project_out);
    CU_ASSERT_PTR_NULL(w.final_ln_w);
    CU_ASSERT_PTR_NULL(w.final_ln_b);
    CU_ASSERT_PTR_EQUAL(w.lm_head, w.embed_tokens);
    CU_ASSERT_EQUAL(check_weights_match(&w, &l), opt_param_count(&w.cfg));
    tl_free(&l);
    model_weights_free(&w);
}

static void test_fixture_opt_tiny_bf16(void) {
    model_weights w;
    tlist l;
    load_ok(fixture("opt-tiny-bf16"), &w);
    tl_from_dir(fixture("opt-tiny-bf16"), &l);
    CU_ASSERT_STRING_EQUAL(l.t[0].dtype, "BF16");
    CU_ASSERT_EQUAL(w.cfg.n_layers, 3);
    CU_ASSERT_EQUAL(w.cfg.hidden, 48);
    CU_ASSERT_EQUAL(w.cfg.n_heads, 6);
    CU_ASSERT_EQUAL(w.cfg.vocab, 384);
    CU_ASSERT_PTR_EQUAL(w.lm_head, w.embed_tokens);
    CU_ASSERT_EQUAL(check_weights_match(&w, &l), opt_param_count(&w.cfg));
    tl_free(&l);
    model_weights_free(&w);
}

static uint16_t bf16_round(float f) { /* round to nearest even; no NaN in weights */
    uint32_t u = float_bits(f);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* The F16 tensors of l rewritten as dtype (F32: exact; BF16: rounded to nearest even). */
static void convert_all(tlist *l, const char *dtype) {
    for (int i = 0; i < l->n; i++) {
        ttensor *t = &l->t[i];
        size_t n = numel(t), size = dtype_bytes(dtype);
        unsigned char *data = malloc(n * size + 1);
        for (size_t k = 0; k < n; k++) {
            float f = source_value(t, k);
            uint16_t b = bf16_round(f);
            memcpy(data + k * size, size == 4 ? (const void *)&f : (const void *)&b, size);
        }
        free(t->data);
        t->data = data;
        t->nbytes = n * size;
        snprintf(t->dtype, sizeof t->dtype, "%s", dtype);
    }
}

static void test_dtype_f32_equivalence(void) {
    model_weights w16, w32;
    tlist l;
    load_ok(fixture("opt-tiny"), &w16);
    char *dir = fixture_copy("opt-tiny", &l);
    convert_all(&l, "F32");
    save_model(dir, &l);
    load_ok(dir, &w32);
    /* opt-tiny's tensors are all multiples of 16 floats: the arena has no padding to skip, only
     * the slot a tied lm_head keeps for the runtime's staging. */
    CU_ASSERT_EQUAL(w32.storage_values, opt_param_count(&w32.cfg) +
                                            (size_t)w32.cfg.vocab * w32.cfg.word_dim);
    CU_ASSERT_EQUAL_FATAL(w32.storage_values, w16.storage_values);
    CU_ASSERT(memcmp(w32.storage, w16.storage, w16.storage_values * sizeof(fp16)) == 0);
    model_weights_free(&w16);
    model_weights_free(&w32);
    finish(dir, &l);
}

static void test_dtype_bf16_equivalence(void) {
    model_weights w;
    tlist orig, l;
    tl_from_dir(fixture("opt-tiny"), &orig);
    char *dir = fixture_copy("opt-tiny", &l);
    convert_all(&l, "BF16");
    save_model(dir, &l);
    load_ok(dir, &w);
    size_t bad = 0, changed = 0;
    for (int i = 0; i < orig.n; i++) {
        located loc;
        CU_ASSERT_FATAL(locate(&w, &orig.t[i], &loc));
        for (size_t k = 0; k < numel(&orig.t[i]); k++) {
            float x = source_value(&orig.t[i], k);
            float want = fp16_to_fp32(fp32_to_fp16(bf16_to_fp32(bf16_round(x))));
            bad += float_bits(loaded_value(&loc, k)) != float_bits(want);
            changed += want != x;
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(changed > 0); /* bf16 really rounded something: the test compares something */
    model_weights_free(&w);
    tl_free(&orig);
    finish(dir, &l);
}

/* Element k of t set to x in t's dtype (F16, BF16 or F32). */
static void set_value(ttensor *t, size_t k, float x) {
    uint16_t h = !strcmp(t->dtype, "F16") ? fp32_to_fp16(x) : 0;
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (!strcmp(t->dtype, "BF16")) h = (uint16_t)(bits >> 16);
    if (!strcmp(t->dtype, "F32")) memcpy(t->data + 4 * k, &x, 4);
    else memcpy(t->data + 2 * k, &h, 2);
}

/* A weight that is not a finite fp16 (NaN, Inf, or an fp32 value beyond 65504 that fp16 makes
 * Inf) is refused at load with one line naming the file, the tensor and its first such element,
 * in each dtype; ./flexgen, with the weights on disk, exits 2 with that line and leaves nothing in
 * the offload dir. (Every value is converted to fp16 at load: the check reads nothing more.) */
static void test_nonfinite_weights(void) {
    static const struct { const char *dtype, *tensor; size_t at; float x; const char *says; } cases[] = {
        {"F16", "model.decoder.layers.0.self_attn.q_proj.weight", 3 * 64 + 17, NAN, "element [3, 17] is NaN"},
        {"F32", "model.decoder.layers.1.final_layer_norm.weight", 5, INFINITY, "element [5] is Inf"},
        {"F32", "model.decoder.embed_tokens.weight", 7 * 64 + 2, 1e6f, "element [7, 2] is 1e+06, beyond fp16"},
        {"BF16", "model.decoder.layers.1.fc1.bias", 9, -INFINITY, "element [9] is -Inf"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        tlist l;
        char *dir = fixture_copy("opt-tiny", &l);
        if (strcmp(cases[i].dtype, "F16")) convert_all(&l, cases[i].dtype);
        ttensor *t = tl_get(&l, cases[i].tensor);
        set_value(t, cases[i].at, cases[i].x);
        set_value(t, cases[i].at + 3, NAN); /* a later one: the first is named */
        save_model(dir, &l);
        EXPECT_LOAD_FAIL(dir, "model.safetensors", cases[i].tensor, cases[i].says);
        const char *argv[] = {flexgen_bin(), "--model", dir, "--prompt-len", "4", "--gen-len", "2", "--device", "cpu",
                              "--percent", "0", "0", "100", "0", "100", "0", "--offload-dir", dir, "--quiet", NULL};
        char *out, *err;
        int rc = run_command(argv, NULL, &out, &err), entries = dir_entries(dir);
        EXPECT(rc == 2 && !strncmp(err, "flexgen: ", 9) && strchr(err, '\n') == err + strlen(err) - 1 &&
               strstr(err, cases[i].tensor) && strstr(err, cases[i].says) && entries == 2,
               "%s %s: expected exit 2, one line naming it and '%s', config.json and model.safetensors "
               "left; got %d, '%s', %d files", cases[i].dtype, cases[i].tensor, cases[i].says, rc, err, entries);
        free(out), free(err);
        finish(dir, &l);
    }
}

static void test_names_without_model_prefix(void) {
    model_weights w16, w;
    tlist l;
    load_ok(fixture("opt-tiny"), &w16);
    char *dir = fixture_copy("opt-tiny", &l);
    for (int i = 0; i < l.n; i++) {
        CU_ASSERT_FATAL(strncmp(l.t[i].name, "model.", 6) == 0);
        memmove(l.t[i].name, l.t[i].name + 6, strlen(l.t[i].name + 6) + 1);
    }
    save_model(dir, &l);
    load_ok(dir, &w);
    CU_ASSERT_EQUAL_FATAL(w.storage_values, w16.storage_values);
    CU_ASSERT(memcmp(w.storage, w16.storage, w.storage_values * sizeof(fp16)) == 0);
    model_weights_free(&w16);
    model_weights_free(&w);
    finish(dir, &l);
}

static void write_config_edit(const char *dir, const char *fix, const char *key, cJSON *value);

/* Greedy logits of two steps from prompts of 3 and 5 tokens, on checkpoint dir (the runtime). */
static void runtime_logits(const char *dir, float *logits) {
    int a[3] = {2, 100, 7}, b[5] = {2, 31, 400, 5, 9}, *prompts[2] = {a, b}, lens[2] = {3, 5}, tokens[4];
    fg_policy p = fg_default_policy();
    p.gpu_batch_size = 2, p.num_gpu_batches = 1;
    CU_ASSERT_EQUAL(generate_with(dir, NULL, 0, &p, 2, 2, prompts, lens, tokens, logits, NULL, NULL), 0);
}

/* opt-tiny with a lm_head.weight of its own (values unlike the embedding's), and config.json's
 * tie_word_embeddings set to `tie` (NULL: absent). */
static char *explicit_head_copy(cJSON *tie, tlist *l) {
    char *dir = fixture_copy("opt-tiny", l);
    int64_t shape[2] = {512, 64}; /* embed_tokens' */
    ttensor *head = tl_add(l, "lm_head.weight", "F16", 2, shape, NULL);
    for (size_t k = 0; k < numel(head); k++) {
        fp16 h = fp32_to_fp16((float)(k % 97) / 64.0f - 0.75f);
        memcpy(head->data + 2 * k, &h, 2);
    }
    save_model(dir, l);
    write_config_edit(dir, "opt-tiny", "tie_word_embeddings", tie);
    return dir;
}

/* "tie_word_embeddings": false with a lm_head.weight: the output layer is that tensor. */
static void test_explicit_lm_head(void) {
    model_weights w;
    tlist l;
    char *dir = explicit_head_copy(cJSON_CreateFalse(), &l);
    load_ok(dir, &w);
    CU_ASSERT_PTR_NOT_NULL(w.lm_head);
    CU_ASSERT(w.lm_head != w.embed_tokens);
    CU_ASSERT_EQUAL(fp16_to_fp32(w.lm_head[97 + 3]), 3.0f / 64.0f - 0.75f);
    CU_ASSERT_EQUAL(check_weights_match(&w, &l), opt_param_count(&w.cfg)); /* lm_head.weight counted */
    model_weights_free(&w);
    finish(dir, &l);
}

/* opt-tiny with a lm_head.weight holding the embedding's values in `dtype` (F16: its bytes, F32:
 * its values), element `changed` (-1: none) one step of that dtype away (its lowest bit flipped),
 * and config.json's tie_word_embeddings set to `tie` (NULL: absent). */
static char *embedding_head_copy(cJSON *tie, const char *dtype, long changed, tlist *l) {
    char *dir = fixture_copy("opt-tiny", l);
    int64_t shape[2] = {512, 64}; /* embed_tokens' */
    ttensor *head = tl_add(l, "lm_head.weight", dtype, 2, shape, NULL);
    const ttensor *embed = tl_get(l, "model.decoder.embed_tokens.weight");
    CU_ASSERT_FATAL(!strcmp(embed->dtype, "F16") && numel(embed) == numel(head));
    size_t size = dtype_bytes(dtype);
    for (size_t k = 0; k < numel(head); k++) {
        float x = source_value(embed, k);
        if (size == 2) memcpy(head->data + 2 * k, embed->data + 2 * k, 2);
        else memcpy(head->data + 4 * k, &x, 4);
    }
    if (changed >= 0) head->data[size * (size_t)changed] ^= 1; /* little-endian: the lowest bit */
    save_model(dir, l);
    write_config_edit(dir, "opt-tiny", "tie_word_embeddings", tie);
    return dir;
}

/* HF ties the output layer to the embedding unless config.json says "tie_word_embeddings": false
 * (absent, it is true), one tensor for both ends. A lm_head.weight in a tied checkpoint that holds
 * the embedding's values, byte for byte or as F32, is not read, and the logits are those of the
 * checkpoint without it; one that differs, in one element or all, is refused in one line naming
 * config.json, since which of the two the output layer uses is ambiguous. Untied without a
 * lm_head.weight is refused too. */
static void test_tied_lm_head(void) {
    static const struct { const char *dtype; long changed; } heads[] = {
        {"F16", -1}, {"F32", -1}, {"F16", 0}, {"F16", 512 * 64 - 1}, {"F32", 7 * 64 + 3}, {NULL, 0},
    };
    for (int i = 0; i < 2; i++)
        for (size_t h = 0; h < sizeof heads / sizeof *heads; h++) {
            tlist l;
            model_weights w;
            cJSON *tie = i ? cJSON_CreateTrue() : NULL;
            char *dir = heads[h].dtype ? embedding_head_copy(tie, heads[h].dtype, heads[h].changed, &l)
                                       : explicit_head_copy(tie, &l); /* unlike the embedding */
            char config[4200];
            snprintf(config, sizeof config, "%s", join(dir, "config.json"));
            if (heads[h].dtype && heads[h].changed < 0) {
                load_ok(dir, &w);
                EXPECT(w.lm_head == w.embed_tokens, "tie_word_embeddings %s and a %s lm_head.weight equal to "
                       "the embedding: expected the output layer tied to it, got a separate one",
                       i ? "true" : "absent", heads[h].dtype);
                model_weights_free(&w);
                float got[4 * 512], want[4 * 512];
                runtime_logits(dir, got);
                runtime_logits(fixture("opt-tiny"), want);
                EXPECT(!memcmp(got, want, sizeof got), "tie_word_embeddings %s: the runtime's logits differ "
                       "from those of the checkpoint without lm_head.weight", i ? "true" : "absent");
            } else {
                EXPECT_LOAD_FAIL(dir, config, "\"tie_word_embeddings\" is true",
                                 "lm_head.weight differs from model.decoder.embed_tokens.weight", "ambiguous");
            }
            finish(dir, &l);
        }
    tlist l;
    char *dir = fixture_copy("opt-tiny", &l);
    save_model(dir, &l);
    write_config_edit(dir, "opt-tiny", "tie_word_embeddings", cJSON_CreateFalse());
    EXPECT_LOAD_FAIL(dir, "config.json", "\"tie_word_embeddings\" is false", "no lm_head.weight");
    write_config_edit(dir, "opt-tiny", "tie_word_embeddings", cJSON_CreateString("no"));
    EXPECT_LOAD_FAIL(dir, "config.json", "\"tie_word_embeddings\" is \"no\"");
    finish(dir, &l);
}

/* The index's weight_map, tensor name -> file name. */
static cJSON *read_index(const char *dir) {
    char *text = slurp(join(dir, "model.safetensors.index.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    cJSON *root = cJSON_Parse(text);
    free(text);
    CU_ASSERT_FATAL(cJSON_IsObject(cJSON_GetObjectItem(root, "weight_map")));
    return root;
}

static void expect_shape(const st_archive *a, const char *name, int ndim, int64_t d0,
                         int64_t d1) {
    const st_tensor *t = st_find(a, name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    CU_ASSERT_EQUAL(t->ndim, ndim);
    CU_ASSERT_EQUAL(t->shape[0], d0);
    if (ndim == 2) CU_ASSERT_EQUAL(t->shape[1], d1);
}

static void test_sharded_archive(void) {
    char dir[4096], err[FG_ERR_LEN] = "";
    snprintf(dir, sizeof dir, "%s", fixture("opt-tiny-350m"));
    st_archive a;
    CU_ASSERT_EQUAL_FATAL(st_open_dir(dir, &a, err), 0);
    cJSON *root = read_index(dir);
    const cJSON *e, *wm = cJSON_GetObjectItem(root, "weight_map");
    CU_ASSERT_EQUAL(a.n_files, 3);
    CU_ASSERT_EQUAL(a.n_tensors, cJSON_GetArraySize(wm));
    cJSON_ArrayForEach(e, wm) {
        const st_tensor *t = st_find(&a, e->string);
        CU_ASSERT_PTR_NOT_NULL_FATAL(t);
        CU_ASSERT_EQUAL(t->dtype, ST_F32);
        CU_ASSERT(t->file >= 0 && t->file < a.n_files);
        const char *path = a.paths[t->file], *base = strrchr(path, '/');
        CU_ASSERT_STRING_EQUAL(base ? base + 1 : path, e->valuestring);
        const char *map = a.maps[t->file], *data = t->data;
        CU_ASSERT(data >= map + 8 && data + t->nbytes <= map + a.sizes[t->file]);
    }
    expect_shape(&a, "model.decoder.embed_tokens.weight", 2, 512, 32);
    expect_shape(&a, "model.decoder.embed_positions.weight", 2, 66, 64);
    expect_shape(&a, "model.decoder.project_in.weight", 2, 64, 32);
    expect_shape(&a, "model.decoder.project_out.weight", 2, 32, 64);
    expect_shape(&a, "model.decoder.layers.1.fc1.weight", 2, 128, 64);
    expect_shape(&a, "model.decoder.layers.1.fc2.weight", 2, 64, 128);
    expect_shape(&a, "model.decoder.layers.0.self_attn.q_proj.bias", 1, 64, 0);
    CU_ASSERT_PTR_NULL(st_find(&a, "model.decoder.final_layer_norm.weight"));
    CU_ASSERT_PTR_NULL(st_find(&a, "lm_head.weight"));
    cJSON_Delete(root);
    st_close(&a);
    CU_ASSERT_EQUAL(a.n_files, 0);
}

/* ---------------------------------------------------------------------------------------------
 * Bad tensors
 * --------------------------------------------------------------------------------------------- */

#define L0 "model.decoder.layers.0."
#define L1 "model.decoder.layers.1."

static void test_missing_tensor(void) {
    tlist l;
    char *dir = fixture_copy("opt-tiny", &l);
    tl_remove(&l, L1 "fc1.bias");
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, dir, "missing tensor", "decoder.layers.1.fc1.bias");
    finish(dir, &l);
}

static void test_extra_tensor(void) {
    tlist l;
    char *dir = fixture_copy("opt-tiny", &l);
    tl_add(&l, L0 "bogus.weight", "F16", 2, (const int64_t[]){4, 4}, NULL);
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, "unexpected tensor", L0 "bogus.weight");
    finish(dir, &l);
}

/* A layer number past any config's count (strtol clamps one too long to LONG_MAX) is an
 * unexpected tensor, and two tensors for one weight (with and without "model.", or one name
 * twice in the header) are refused, naming both, where the first was taken. */
static void test_tensor_names_refused(void) {
    static const char *const huge[] = {"model.decoder.layers.9223372036854775807.fc1.bias",
                                       "model.decoder.layers.99999999999999999999999.fc1.bias"};
    for (int i = 0; i < 2; i++) {
        tlist l;
        char *dir = fixture_copy("opt-tiny", &l);
        tl_add(&l, huge[i], "F16", 1, (const int64_t[]){4}, NULL);
        save_model(dir, &l);
        EXPECT_LOAD_FAIL(dir, "unexpected tensor", huge[i]);
        finish(dir, &l);
    }
    static const char *const twin[] = {"decoder.final_layer_norm.weight", "model.decoder.final_layer_norm.weight"};
    for (int i = 0; i < 2; i++) {
        tlist l;
        char *dir = fixture_copy("opt-tiny", &l);
        ttensor norm = *tl_get(&l, "model.decoder.final_layer_norm.weight"); /* tl_add moves it */
        tl_add(&l, twin[i], norm.dtype, norm.ndim, norm.shape, NULL);            /* zeros */
        save_model(dir, &l);
        EXPECT_LOAD_FAIL(dir, "one weight", "model.decoder.final_layer_norm.weight", twin[i]);
        finish(dir, &l);
    }
}

static void test_wrong_shape(void) {
    tlist l;
    char *dir = fixture_copy("opt-tiny", &l);
    tl_reshape(tl_get(&l, L0 "self_attn.q_proj.weight"), 2, 64, 32);
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, L0 "self_attn.q_proj.weight", "[64, 32]", "[64, 64]");
    finish(dir, &l);

    dir = fixture_copy("opt-tiny", &l); /* transposed */
    tl_reshape(tl_get(&l, L1 "fc1.weight"), 2, 64, 256);
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, L1 "fc1.weight", "[64, 256]", "[256, 64]");
    finish(dir, &l);
}

static void test_wrong_ndim(void) {
    tlist l;
    char *dir = fixture_copy("opt-tiny", &l);
    tl_reshape(tl_get(&l, L0 "self_attn.k_proj.bias"), 2, 1, 64);
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, L0 "self_attn.k_proj.bias", "[1, 64]", "[64]");
    finish(dir, &l);

    dir = fixture_copy("opt-tiny", &l);
    tl_reshape(tl_get(&l, L0 "fc2.weight"), 1, 64 * 256, 0);
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, L0 "fc2.weight", "[16384]", "[64, 256]");
    finish(dir, &l);
}

static void test_unsupported_dtype(void) {
    static const char *const dtypes[] = {"I64", "F64"};
    for (int i = 0; i < 2; i++) {
        tlist l;
        char *dir = fixture_copy("opt-tiny", &l);
        ttensor *t = tl_get(&l, L0 "fc1.bias");
        snprintf(t->dtype, sizeof t->dtype, "%s", dtypes[i]);
        tl_reshape(t, 1, t->shape[0], 0);
        save_model(dir, &l);
        EXPECT_LOAD_FAIL(dir, "model.safetensors", L0 "fc1.bias", "unsupported dtype", dtypes[i]);
        finish(dir, &l);
    }
}

static void test_truncated_data(void) {
    char *dir = fixture_rewrite("opt-tiny");
    const char *path = join(dir, "model.safetensors");
    size_t n;
    char *data = slurp(path, &n);
    CU_ASSERT_EQUAL(write_file(path, data, n - 1000), 0);
    free(data);
    EXPECT_LOAD_FAIL(dir, "model.safetensors", "out of bounds", "truncated");
    finish(dir, NULL);
}

static void test_header_length(void) {
    char *dir = make_temp_dir();
    write_raw_safetensors(join(dir, "model.safetensors"), (uint64_t)1 << 40, "{}", 64);
    EXPECT_ST_FAIL(dir, "model.safetensors", "header length 1099511627776", "beyond the file");
    write_raw_safetensors(join(dir, "model.safetensors"), UINT64_MAX, "{}", 0);
    EXPECT_ST_FAIL(dir, "model.safetensors", "header length", "beyond the file");
    write_raw_safetensors(join(dir, "model.safetensors"), 3, "{}", 0); /* one byte past the end */
    EXPECT_ST_FAIL(dir, "model.safetensors", "header length 3", "beyond the file");
    copy_file(fixture("opt-tiny/config.json"), dir, "config.json");
    EXPECT_LOAD_FAIL(dir, "model.safetensors", "header length 3", "beyond the file");
    finish(dir, NULL);
}

static void test_short_file(void) {
    char *dir = make_temp_dir();
    CU_ASSERT_EQUAL(write_file(join(dir, "model.safetensors"), "\x02\0\0\0\0", 5), 0);
    EXPECT_ST_FAIL(dir, "model.safetensors", "truncated file", "5 bytes");
    CU_ASSERT_EQUAL(write_file(join(dir, "model.safetensors"), "", 0), 0);
    EXPECT_ST_FAIL(dir, "model.safetensors", "truncated file", "0 bytes");
    finish(dir, NULL);
}

/* opt-tiny with tensor `name`'s header offsets set to [b, e] (relative to its packed begin when
 * rel) must fail to load with a message holding `what`. */
static void expect_offsets_fail(const char *name, int rel, int64_t b, int64_t e, const char *what) {
    tlist l;
    char *dir = fixture_copy("opt-tiny", &l);
    int i = tl_index(&l, name);
    CU_ASSERT_FATAL(i >= 0);
    int64_t base = rel ? packed_begin(&l, i) : 0;
    l.t[i].offsets_set = 1;
    l.t[i].off[0] = base + b;
    l.t[i].off[1] = base + e;
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, "model.safetensors", name, what);
    finish(dir, &l);
}

static void test_data_offsets(void) {
    expect_offsets_fail(L0 "fc1.bias", 0, 1000000000, 1000000512, "out of bounds");
    expect_offsets_fail(L0 "fc1.bias", 1, 512, 0, "bad data_offsets");  /* end < begin */
    expect_offsets_fail(L0 "fc1.bias", 0, -2, 510, "bad data_offsets"); /* negative */
    expect_offsets_fail(L0 "fc1.bias", 0, 0, (int64_t)1 << 62, "out of bounds");
    expect_offsets_fail(L0 "self_attn.q_proj.weight", 1, 0, 100, "hold 100 bytes");
    expect_offsets_fail(L0 "self_attn.q_proj.weight", 1, 0, 100, "need 8192");
    /* Beyond any integer type: refused (as bad or out of bounds), without undefined casts. */
    char *dir = make_temp_dir();
    static const char huge[] =
        "{\"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 1e30]}}";
    write_raw_safetensors(join(dir, "model.safetensors"), strlen(huge), huge, 4);
    EXPECT_ST_FAIL(dir, "model.safetensors", "tensor a", "data_offsets");
    finish(dir, NULL);
}

static void test_overlapping_offsets(void) {
    tlist l;
    char *dir = fixture_copy("opt-tiny", &l);
    int q = tl_index(&l, L0 "self_attn.q_proj.weight");
    int k = tl_index(&l, L0 "self_attn.k_proj.weight");
    CU_ASSERT_FATAL(q >= 0 && k >= 0);
    l.t[k].offsets_set = 1; /* k_proj starts in the middle of q_proj's bytes */
    l.t[k].off[0] = packed_begin(&l, q) + 4096;
    l.t[k].off[1] = l.t[k].off[0] + (int64_t)l.t[k].nbytes;
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, "model.safetensors", "overlap", L0 "self_attn.q_proj.weight",
                     L0 "self_attn.k_proj.weight");
    finish(dir, &l);
}

/* An empty tensor holds no bytes, so it overlaps nothing: not the tensor whose offset it shares
 * (either order in the header), nor one whose bytes its offset falls in. */
static void test_empty_tensor_overlaps_nothing(void) {
    static const char *const headers[] = {
        "{\"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 4]},"
        " \"e\": {\"dtype\": \"F16\", \"shape\": [0], \"data_offsets\": [0, 0]}}",
        "{\"e\": {\"dtype\": \"F32\", \"shape\": [3, 0], \"data_offsets\": [0, 0]},"
        " \"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 4]}}",
        "{\"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 4]},"
        " \"e\": {\"dtype\": \"F16\", \"shape\": [0], \"data_offsets\": [2, 2]}}",
    };
    char *dir = make_temp_dir();
    for (size_t i = 0; i < sizeof headers / sizeof *headers; i++) {
        write_raw_safetensors(join(dir, "model.safetensors"), strlen(headers[i]), headers[i], 4);
        st_archive a;
        char err[FG_ERR_LEN] = "";
        int rc = st_open_dir(dir, &a, err);
        EXPECT(rc == 0, "header %zu: expected it to open, got \"%s\"", i, err);
        if (rc) continue;
        const st_tensor *e = st_find(&a, "e");
        EXPECT(a.n_tensors == 2 && e && e->nbytes == 0, "header %zu: expected 2 tensors, e empty", i);
        st_close(&a);
    }
    finish(dir, NULL);
}

/* A shape whose element count overflows 64 bits (2^39 x 2^25 wraps to 0, which empty
 * data_offsets would match) is refused by the header parser itself. */
static void test_shape_overflow(void) {
    static const char *const headers[] = {
        "{\"a\": {\"dtype\": \"F16\", \"shape\": [549755813888, 33554432], \"data_offsets\": [0, 0]}}",
        "{\"a\": {\"dtype\": \"F32\", \"shape\": [33554432, 549755813888], \"data_offsets\": [0, 0]}}",
        "{\"a\": {\"dtype\": \"F16\", \"shape\": [1048576, 1048576, 2], \"data_offsets\": [0, 0]}}",
    };
    char *dir = make_temp_dir();
    for (size_t i = 0; i < sizeof headers / sizeof *headers; i++) {
        write_raw_safetensors(join(dir, "model.safetensors"), strlen(headers[i]), headers[i], 0);
        EXPECT_ST_FAIL(dir, "model.safetensors", "tensor a", "shape");
    }
    finish(dir, NULL);
}

/* A name taken from the file (a tensor, a dtype, model_type) that holds a newline or another
 * control character still gives one error line: each such byte shows as '?'. */
static void test_error_stays_one_line(void) {
    static const char header[] =
        "{\"a\\nflexgen: b\": {\"dtype\": \"F\\r64\", \"shape\": [2], \"data_offsets\": [0, 4]}}";
    char *dir = make_temp_dir();
    write_raw_safetensors(join(dir, "model.safetensors"), strlen(header), header, 4);
    EXPECT_ST_FAIL(dir, "tensor a?flexgen: b", "unsupported dtype F?64");
    write_text(dir, "config.json", "{\"model_type\": \"o\\npt\\t\"}");
    model_config cfg;
    char err[FG_ERR_LEN] = "";
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &cfg, err), -1);
    EXPECT_ERR(err, "config.json", "model_type is \"o\\npt\\t\""); /* as JSON writes it */
    finish(dir, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Files that are not regular files, or too big to be read whole
 * --------------------------------------------------------------------------------------------- */

static int open_archive(void *dir, char *err) {
    st_archive a;
    int rc = st_open_dir(dir, &a, err);
    if (rc == 0) st_close(&a);
    return rc;
}

static int open_config(void *dir, char *err) {
    model_config cfg;
    return model_config_from_json(join(dir, "config.json"), &cfg, err);
}

static int open_tokenizer(void *dir, char *err) {
    char vocab[4200];
    snprintf(vocab, sizeof vocab, "%s", join(dir, "vocab.json"));
    fg_tokenizer *t = tokenizer_load(vocab, join(dir, "merges.txt"), err);
    if (t) tokenizer_free(t);
    return t ? 0 : -1;
}

/* fn(dir) fails at once with one line naming `file` and saying `what`. */
static void expect_refused(int (*fn)(void *, char *), const char *dir, const char *file,
                           const char *what) {
    char err[FG_ERR_LEN] = "";
    int rc = run_bounded(fn, (void *)dir, 10, err);
    EXPECT(rc == -1, "%s: expected -1, got %d (%s)", file, rc, err);
    EXPECT_ERR(err, file, what);
}

/* A FIFO (no writer: opening it must not block), a device or a directory in place of a
 * checkpoint's file (config.json, the safetensors, the shard index, vocab.json, merges.txt) is
 * refused with one line naming it. */
static void test_not_regular_files(void) {
    char *dir = make_temp_dir();
    CU_ASSERT_EQUAL_FATAL(mkfifo(join(dir, "model.safetensors"), 0600), 0);
    expect_refused(open_archive, dir, "model.safetensors", "not a regular file");
    unlink(join(dir, "model.safetensors"));
    CU_ASSERT_EQUAL_FATAL(mkfifo(join(dir, "model.safetensors.index.json"), 0600), 0);
    expect_refused(open_archive, dir, "model.safetensors.index.json", "not a regular file");
    CU_ASSERT_EQUAL_FATAL(mkfifo(join(dir, "config.json"), 0600), 0);
    expect_refused(open_config, dir, "config.json", "not a regular file");
    unlink(join(dir, "config.json"));
    CU_ASSERT_EQUAL_FATAL(symlink("/dev/null", join(dir, "config.json")), 0);
    expect_refused(open_config, dir, "config.json", "not a regular file");
    unlink(join(dir, "config.json"));
    CU_ASSERT_EQUAL_FATAL(mkdir(join(dir, "config.json"), 0700), 0);
    expect_refused(open_config, dir, "config.json", "not a regular file");
    copy_file(fixture("tokenizer/merges.txt"), dir, "merges.txt");
    CU_ASSERT_EQUAL_FATAL(mkfifo(join(dir, "vocab.json"), 0600), 0);
    expect_refused(open_tokenizer, dir, "vocab.json", "not a regular file");
    unlink(join(dir, "vocab.json"));
    copy_file(fixture("tokenizer/vocab.json"), dir, "vocab.json");
    unlink(join(dir, "merges.txt"));
    CU_ASSERT_EQUAL_FATAL(mkfifo(join(dir, "merges.txt"), 0600), 0);
    expect_refused(open_tokenizer, dir, "merges.txt", "not a regular file");
    finish(dir, NULL);
}

/* A text file read whole (config.json, the shard index) bigger than FG_MAX_TEXT_FILE is refused
 * before it is read (the files here are sparse). */
static void test_text_file_too_big(void) {
    char *dir = make_temp_dir();
    static const char *const names[] = {"config.json", "model.safetensors.index.json"};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(join(dir, names[i]), "w");
        CU_ASSERT_PTR_NOT_NULL_FATAL(f);
        CU_ASSERT_EQUAL(ftruncate(fileno(f), (off_t)FG_MAX_TEXT_FILE + 1), 0);
        fclose(f);
    }
    expect_refused(open_config, dir, "config.json", "more than the 64 MiB");
    expect_refused(open_archive, dir, "model.safetensors.index.json", "more than the 64 MiB");
    finish(dir, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Bad JSON: the safetensors header, config.json, the shard index
 * --------------------------------------------------------------------------------------------- */

static void test_malformed_header(void) {
    static const char *const headers[] = {"{\"a\": {\"dtype\": \"F16\", ", "[1, 2, 3]",
                                          "\"text\"", ""};
    char *dir = make_temp_dir();
    for (size_t i = 0; i < sizeof headers / sizeof headers[0]; i++) {
        write_raw_safetensors(join(dir, "model.safetensors"), strlen(headers[i]), headers[i], 4);
        EXPECT_ST_FAIL(dir, "model.safetensors", "header: malformed JSON");
    }
    static const char entry[] = "{\"a\": 7}"; /* valid JSON, but a tensor that is no object */
    write_raw_safetensors(join(dir, "model.safetensors"), strlen(entry), entry, 0);
    EXPECT_ST_FAIL(dir, "model.safetensors", "tensor a", "not an object");
    finish(dir, NULL);
}

/* The JSON header must be all of the header: nothing but padding may follow it. */
static void test_header_trailing_garbage(void) {
    static const char header[] =
        "{\"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 4]}}garbage";
    char *dir = make_temp_dir();
    write_raw_safetensors(join(dir, "model.safetensors"), strlen(header), header, 4);
    EXPECT_ST_FAIL(dir, "model.safetensors", "header: malformed JSON");
    finish(dir, NULL);
}

/* Header entries with a field missing or of the wrong form. */
static void test_bad_header_fields(void) {
    static const struct { const char *json, *what; } cases[] = {
        {"{\"a\": {\"shape\": [2], \"data_offsets\": [0, 4]}}", "missing dtype"},
        {"{\"a\": {\"dtype\": 16, \"shape\": [2], \"data_offsets\": [0, 4]}}", "missing dtype"},
        {"{\"a\": {\"dtype\": \"F16\", \"data_offsets\": [0, 4]}}", "bad shape"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [1,1,1,1,2], \"data_offsets\": [0, 4]}}",
         "bad shape"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [-2], \"data_offsets\": [0, 4]}}", "bad shape"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [2.5], \"data_offsets\": [0, 4]}}", "bad shape"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [2]}}", "bad data_offsets"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 2, 4]}}",
         "bad data_offsets"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [\"0\", 4]}}",
         "bad data_offsets"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0.5, 4]}}",
         "bad data_offsets"},
    };
    char *dir = make_temp_dir();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *json = cases[i].json;
        write_raw_safetensors(join(dir, "model.safetensors"), strlen(json), json, 4);
        EXPECT_ST_FAIL(dir, "model.safetensors", "tensor a", cases[i].what);
    }
    char json[400];
    snprintf(json, sizeof json, "{\"%0200d\": {\"dtype\": \"F16\", \"shape\": [2], "
             "\"data_offsets\": [0, 4]}}", 7);
    write_raw_safetensors(join(dir, "model.safetensors"), strlen(json), json, 4);
    EXPECT_ST_FAIL(dir, "model.safetensors", "tensor name too long", "00000000");
    finish(dir, NULL);
}

/* The fixture's config.json with `key` set to `value` (removed when value is NULL) in dir. */
static void write_config_edit(const char *dir, const char *fix, const char *key, cJSON *value) {
    char src[4096];
    snprintf(src, sizeof src, "%s/config.json", fixture(fix));
    char *text = slurp(src, NULL);
    cJSON *root = cJSON_Parse(text);
    CU_ASSERT_PTR_NOT_NULL_FATAL(root);
    if (value && cJSON_GetObjectItem(root, key)) cJSON_ReplaceItemInObject(root, key, value);
    else if (value) cJSON_AddItemToObject(root, key, value);
    else cJSON_DeleteItemFromObject(root, key);
    char *out = cJSON_Print(root);
    write_text(dir, "config.json", out);
    free(out);
    free(text);
    cJSON_Delete(root);
}

#define EXPECT_CONFIG_FAIL(path, ...)                                                        \
    do {                                                                                     \
        model_config c_;                                                                       \
        char err_[FG_ERR_LEN] = "";                                                          \
        CU_ASSERT_EQUAL(model_config_from_json(path, &c_, err_), -1);                          \
        EXPECT_ERR(err_, __VA_ARGS__);                                                       \
    } while (0)

static void test_malformed_config(void) {
    char *dir = fixture_rewrite("opt-tiny");
    write_text(dir, "config.json", "{\"model_type\": \"opt\", \"hidden_size\": 64,");
    EXPECT_LOAD_FAIL(dir, "config.json", "malformed JSON");
    write_text(dir, "config.json", "[\"opt\"]");
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "config.json", "not a JSON object");
    /* no tensors at all: said so, not as a layer count config.json would have wrong */
    char *config = slurp(join(fixture("opt-tiny"), "config.json"), &(size_t){0});
    CU_ASSERT_PTR_NOT_NULL_FATAL(config);
    write_text(dir, "config.json", config);
    free(config);
    write_raw_safetensors(join(dir, "model.safetensors"), 2, "{}", 0);
    EXPECT_LOAD_FAIL(dir, "the checkpoint holds no tensors");
    finish(dir, NULL);
}

static char *sharded_copy(void (*edit)(cJSON *weight_map));

/* A JSON file's text with `insert` put just after its first '{'. */
static void insert_after_brace(const char *dir, const char *name, const char *insert) {
    size_t n;
    char *text = slurp(join(dir, name), &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    char *brace = strchr(text, '{');
    CU_ASSERT_PTR_NOT_NULL_FATAL(brace);
    size_t head = (size_t)(brace + 1 - text), add = strlen(insert);
    char *edited = malloc(n + add + 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(edited);
    memcpy(edited, text, head);
    memcpy(edited + head, insert, add);
    memcpy(edited + head + add, text + head, n - head + 1);
    write_text(dir, name, edited);
    free(edited);
    free(text);
}

/* Python reads "a\u0000b" whole, and cJSON would cut a key or a value at the NUL: a key
 * "model_type\u0000x" would be read as model_type, a second one, whose value (the last) wins.
 * Every JSON file of a checkpoint refuses it, naming the file and line, and data after the value
 * too. */
static void test_json_nul_escape(void) {
    char *dir = fixture_rewrite("opt-tiny");
    char *config = slurp(join(dir, "config.json"), &(size_t){0});
    CU_ASSERT_PTR_NOT_NULL_FATAL(config);
    insert_after_brace(dir, "config.json", "\n\"model_type\\u0000x\": \"gpt2\",");
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "config.json line 2", "\\u0000");
    write_text(dir, "config.json", config);
    insert_after_brace(dir, "config.json", "\"note\": \"a\\\\u0000 is text\",");
    model_config c;
    char err[FG_ERR_LEN] = "";
    EXPECT(model_config_from_json(join(dir, "config.json"), &c, err) == 0,
           "an escaped backslash before u0000 is text, not a NUL: %s", err);
    write_text(dir, "config.json", config);
    FILE *f = fopen(join(dir, "config.json"), "a");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs(" trailing words", f);
    fclose(f);
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "config.json", "malformed JSON",
                       "data after the value");
    write_text(dir, "config.json", config);
    write_text(dir, "generation_config.json", "{\"eos_token_id\\u0000x\": 7, \"eos_token_id\": 2}");
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "generation_config.json line 1", "\\u0000");
    remove(join(dir, "generation_config.json"));
    static const char header[] =
        "{\"a\\u0000b\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 4]}}";
    write_raw_safetensors(join(dir, "model.safetensors"), strlen(header), header, 4);
    EXPECT_ST_FAIL(dir, "model.safetensors header line 1", "\\u0000");
    free(config);
    finish(dir, NULL);
    dir = sharded_copy(NULL);
    insert_after_brace(dir, "model.safetensors.index.json", "\"weight_map\\u0000x\": {},");
    EXPECT_ST_FAIL(dir, "model.safetensors.index.json line 1", "\\u0000");
    finish(dir, NULL);
}

static void test_unknown_architecture(void) {
    char *dir = fixture_rewrite("opt-tiny");
    write_config_edit(dir, "opt-tiny", "model_type", cJSON_CreateString("gpt2"));
    EXPECT_LOAD_FAIL(dir, "config.json", "unknown architecture", "gpt2");
    write_config_edit(dir, "opt-tiny", "model_type", NULL);
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "config.json", "unknown architecture", "missing");
    finish(dir, NULL);
}

/* Each LLaMA-family fixture's config.json as transformers 5 saves it (tests/fixtures/config-v5,
 * scripts/make_config_v5.py: RoPE's theta and scaling in one "rope_parameters" object) is the same
 * model as the fixture's own, field for field; so is a config holding both forms, read as HF reads
 * it (a rope_scaling that is not null first, a rope_theta inside the object over the top level). */
static void test_config_v5(void) {
    static const char *const names[] = {"llama-tiny-mha",    "llama-tiny-gqa2-llama3", "llama-tiny-gqa4-linear",
                                        "llama-tiny-mqa-bias", "mistral-tiny-gqa8",      "qwen2-tiny"};
    int scaled = 0;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        model_config v4, v5;
        char err[FG_ERR_LEN] = "", path[4200];
        memset(&v4, 0, sizeof v4), memset(&v5, 0, sizeof v5);
        snprintf(path, sizeof path, "%s/config.json", fixture(names[i]));
        CU_ASSERT_EQUAL_FATAL(model_config_from_json(path, &v4, err), 0);
        snprintf(path, sizeof path, "%s/%s.json", fixture("config-v5"), names[i]);
        int rc = model_config_from_json(path, &v5, err);
        memcpy(v5.name, v4.name, sizeof v4.name);
        EXPECT(rc == 0 && !memcmp(&v4, &v5, sizeof v4), "%s: transformers 5's config.json: exit %d (%s), RoPE %d "
               "theta %g factor %g against %d %g %g", names[i], rc, err, v5.rope.kind, v5.rope.theta, v5.rope.factor,
               v4.rope.kind, v4.rope.theta, v4.rope.factor);
        scaled += v4.rope.kind != ROPE_DEFAULT || v4.rope.theta != 10000;
    }
    CU_ASSERT_EQUAL(scaled, 4); /* llama3, linear, and two thetas of 1e6: the files say something */
    char *dir = fixture_rewrite("llama-tiny-mha");
    write_config_edit(dir, "llama-tiny-gqa4-linear", "rope_parameters",
                      cJSON_Parse("{\"rope_type\": \"default\", \"rope_theta\": 500}"));
    model_config c;
    char err[FG_ERR_LEN] = "";
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    EXPECT(c.rope.kind == ROPE_LINEAR && c.rope.factor == 2 && c.rope.theta == 10000,
           "rope_scaling (linear, 2) beside rope_parameters: expected rope_scaling's, got %d, factor %g, theta %g",
           c.rope.kind, c.rope.factor, c.rope.theta);
    char *text = slurp(join(dir, "config.json"), NULL);
    cJSON *root = cJSON_Parse(text);
    CU_ASSERT_PTR_NOT_NULL_FATAL(root);
    cJSON_ReplaceItemInObject(root, "rope_scaling", cJSON_CreateNull());
    char *edited = cJSON_Print(root);
    write_text(dir, "config.json", edited);
    free(edited), free(text);
    cJSON_Delete(root);
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    EXPECT(c.rope.kind == ROPE_DEFAULT && c.rope.theta == 500,
           "rope_scaling null beside rope_parameters: expected theta 500 from rope_parameters, got %d, theta %g",
           c.rope.kind, c.rope.theta);
    /* an empty rope_parameters is the default RoPE, as HF reads it */
    write_config_edit(dir, "llama-tiny-mha", "rope_parameters", cJSON_CreateObject());
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    EXPECT(c.rope.kind == ROPE_DEFAULT && c.rope.theta == 10000, "rope_parameters {}: expected the default RoPE, "
           "got %d, theta %g: %s", c.rope.kind, c.rope.theta, err);
    finish(dir, NULL);
}

/* generation_config.json's eos_token_id is taken over config.json's (HF's generate() reads it),
 * for OPT too; a file without one, or with null, names none (the id -1: HF's generate() then stops
 * on no id), and one that is not JSON, or whose ids are not ids, is refused naming it. */
static void test_generation_config_eos(void) {
    static const char *const fixtures[] = {"llama-tiny-mha", "opt-tiny"};
    for (int i = 0; i < 2; i++) {
        char *dir = fixture_rewrite(fixtures[i]), err[FG_ERR_LEN] = "";
        model_config c;
        CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
        int n_config = c.n_eos, first = c.eos_ids[0];
        write_text(dir, "generation_config.json", "{\"eos_token_id\": [2, 193], \"pad_token_id\": 0}");
        CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
        EXPECT(c.n_eos == 2 && c.eos_ids[0] == 2 && c.eos_ids[1] == 193, "%s: generation_config.json's [2, 193]: "
               "got %d ids, %d %d", fixtures[i], c.n_eos, c.eos_ids[0], c.eos_ids[1]);
        EXPECT(n_config == 0 || first >= 0, "%s: config.json's eos_token_id: %d ids, the first %d", fixtures[i],
               n_config, first);
        static const char *const without[] = {"{\"pad_token_id\": 0}", "{\"eos_token_id\": null}"};
        for (int k = 0; k < 2; k++) {
            write_text(dir, "generation_config.json", without[k]);
            CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
            EXPECT(c.n_eos == 1 && c.eos_ids[0] == -1, "%s: generation_config.json %s: expected no eos id (-1), "
                   "got %d ids, the first %d", fixtures[i], without[k], c.n_eos, c.eos_ids[0]);
        }
        write_text(dir, "generation_config.json", "{\"eos_token_id\": ");
        EXPECT_CONFIG_FAIL(join(dir, "config.json"), "generation_config.json", "malformed JSON");
        write_text(dir, "generation_config.json", "{\"eos_token_id\": \"</s>\"}");
        EXPECT_CONFIG_FAIL(join(dir, "config.json"), "generation_config.json", "\"eos_token_id\"", "token id");
        write_text(dir, "generation_config.json", "{\"eos_token_id\": 1e999}"); /* not "null" */
        EXPECT_CONFIG_FAIL(join(dir, "config.json"), "generation_config.json",
                           "\"eos_token_id\" is a number past a double's range");
        /* a link to nothing is a file that cannot be read, not a file that is not there */
        remove(join(dir, "generation_config.json"));
        CU_ASSERT_EQUAL_FATAL(symlink("/nonexistent/generation_config.json", join(dir, "generation_config.json")), 0);
        EXPECT_CONFIG_FAIL(join(dir, "config.json"), "generation_config.json", "cannot open");
        finish(dir, NULL);
    }
}

/* OPT's config.json names the ids that end a sequence too (OPTConfig's eos_token_id, 2 where it
 * is absent), as HF's generate() reads them without a generation_config.json. */
static void test_opt_config_eos(void) {
    char *dir = fixture_rewrite("opt-tiny"), err[FG_ERR_LEN] = "";
    model_config c;
    write_config_edit(dir, "opt-tiny", "eos_token_id", cJSON_CreateNumber(79));
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    EXPECT(c.n_eos == 1 && c.eos_ids[0] == 79, "OPT's eos_token_id 79: got %d ids, the first %d (%s)", c.n_eos,
           c.eos_ids[0], err);
    write_config_edit(dir, "opt-tiny", "eos_token_id", NULL);
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    EXPECT(c.n_eos == 1 && c.eos_ids[0] == 2, "OPT without eos_token_id: expected </s> (2), got %d ids, the "
           "first %d", c.n_eos, c.eos_ids[0]);
    finish(dir, NULL);
}

/* The LLaMA family's config: each value this project does not implement is refused with one line
 * naming the field and the value, never run as something else. */
static void test_llama_config_refusals(void) {
    char *dir = fixture_rewrite("llama-tiny-mha");
    static const struct { const char *key, *json, *want[3]; } cases[] = {
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4}", {"\"rope_scaling\" type", "yarn", "not implemented"}},
        {"rope_scaling", "{\"rope_type\": \"linear\"}", {"missing \"factor\""}},
        {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4, \"high_freq_factor\": 1, "
                         "\"original_max_position_embeddings\": 32}", {"high_freq_factor 1", "low_freq_factor 4"}},
        {"rope_scaling", "[]", {"\"rope_scaling\" is []", "null or an object"}},
        {"hidden_act", "\"gelu\"", {"\"hidden_act\" is \"gelu\"", "only \"silu\""}},
        {"num_key_value_heads", "3", {"num_attention_heads 2", "not a multiple of num_key_value_heads 3"}},
        {"head_dim", "7", {"head_dim 7", "not implemented"}},
        {"rope_theta", "-1", {"\"rope_theta\" is -1"}},
        {"rms_norm_eps", "\"small\"", {"\"rms_norm_eps\" is \"small\""}},
        /* numbers that fp32 makes 0 (or subnormal): every logit would be NaN */
        {"rope_theta", "1e-50", {"\"rope_theta\" is 1e-50", "fp32"}},
        {"rms_norm_eps", "1e-50", {"\"rms_norm_eps\" is 1e-50", "fp32"}},
        {"rms_norm_eps", "1e-40", {"\"rms_norm_eps\" is 1e-40", "fp32"}},
        {"rope_scaling", "{\"rope_type\": \"linear\", \"factor\": 1e-50}", {"\"factor\" is 1e-50", "fp32"}},
        {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1e-50, \"high_freq_factor\": 4, "
                         "\"original_max_position_embeddings\": 32}", {"\"low_freq_factor\" is 1e-50", "fp32"}},
        /* fp32 numbers each, whose frequencies are not: 1 / 1e-37 at position 127 */
        {"rope_scaling", "{\"rope_type\": \"linear\", \"factor\": 1e-37}", {"\"rope_theta\" 10000", "\"rope_scaling\"",
                         "not a finite fp32"}},
        {"eos_token_id", "[2, \"x\"]", {"\"eos_token_id\"", "token id"}},
        {"model_type", "\"gemma\"", {"model_type is \"gemma\"", "unknown architecture"}},
        /* fields within their bounds whose sizes together are not: q's width past an int's 2^24
         * (2^22 x 1024 heads would wrap to 0), a depth no model has, no token beyond the special ids */
        {"num_attention_heads", "4194304", {"num_attention_heads 4194304 x head_dim 64", "at most 2^24"}},
        {"num_hidden_layers", "262144", {"num_hidden_layers 262144", "at most 1024"}},
        {"vocab_size", "3", {"vocab_size 3", "at least 4"}},
        /* transformers 5's rope_parameters, as its rope_scaling */
        {"rope_parameters", "{\"rope_type\": \"yarn\", \"factor\": 4, \"rope_theta\": 10000}",
         {"\"rope_parameters\" type", "yarn", "not implemented"}},
        {"rope_parameters", "{\"full_attention\": {\"rope_type\": \"default\", \"rope_theta\": 10000}}",
         {"\"rope_parameters\" is", "by layer type", "not implemented"}},
        {"rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": 1e-50}", {"\"rope_theta\" is 1e-50", "fp32"}},
        {"rope_parameters", "5", {"\"rope_parameters\" is 5", "null or an object"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_config_edit(dir, "llama-tiny-mha", cases[i].key, cJSON_Parse(cases[i].json));
        model_config c;
        char err[FG_ERR_LEN] = "";
        CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), -1);
        for (int k = 0; k < 3 && cases[i].want[k]; k++)
            EXPECT(strstr(err, cases[i].want[k]) && strstr(err, "config.json"), "%s = %s: expected \"%s\" in: %s",
                   cases[i].key, cases[i].json, cases[i].want[k], err);
    }
    /* Qwen2 with its sliding window on; Mistral's window is kept (generate() holds prompts to it) */
    write_config_edit(dir, "qwen2-tiny", "use_sliding_window", cJSON_CreateTrue());
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "\"use_sliding_window\" is true", "not implemented");
    write_config_edit(dir, "mistral-tiny-gqa8", "sliding_window", cJSON_CreateNumber(12));
    model_config c;
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    CU_ASSERT_EQUAL(c.window, 12);
    int ids[10] = {1, 5, 6, 7, 8, 9, 10, 11, 12, 13}, *prompts[1] = {ids}, len = 10;
    CU_ASSERT_EQUAL(check_prompts(&c, 1, prompts, &len, 3, err), 0); /* 12 positions */
    CU_ASSERT_EQUAL(check_prompts(&c, 1, prompts, &len, 4, err), -1);
    EXPECT_ERR(err, "need 13 positions", "sliding_window 12", "not implemented");
    /* synthetic prompts too, in a run and in `flexgen policy`, before anything is planned */
    const char *hw = join(dir, "hw.json");
    write_hw(hw);
    EXPECT_FAIL(ARGS("--model", dir, "--prompt-len", "10", "--gen-len", "4"), "--prompt-len 10",
                "need 13 positions", "sliding_window 12");
    EXPECT_FAIL(ARGS("policy", "--model", dir, "--hw", hw, "--prompt-len", "10", "--gen-len", "4"),
                "--prompt-len 10", "need 13 positions", "sliding_window 12");
    finish(dir, NULL);
}

/* The LLaMA family's fields where config.json leaves them out, or says less than HF reads, as
 * transformers 5 reads them: Mistral's sliding_window (MistralConfig's 4096; null: none), each
 * family's max_position_embeddings, hidden_act "swish" (HF's other name for silu), a RoPE object
 * without a type (the default RoPE), and llama3's pretraining length (a top-level
 * original_max_position_embeddings over the object's, else max_position_embeddings). */
static void test_llama_config_hf_defaults(void) {
    char *dir = fixture_rewrite("llama-tiny-mha");
    const char *path = join(dir, "config.json");
    model_config c, silu;
    char err[FG_ERR_LEN] = "";
    static const struct { const char *fixture, *key; int window, positions; } absent[] = {
        {"mistral-tiny-gqa8", "sliding_window", 4096, -1},
        {"mistral-tiny-gqa8", "max_position_embeddings", -1, 4096 * 32},
        {"qwen2-tiny", "max_position_embeddings", -1, 32768},
        {"llama-tiny-mha", "max_position_embeddings", -1, 2048},
    };
    for (size_t i = 0; i < sizeof absent / sizeof *absent; i++) {
        write_config_edit(dir, absent[i].fixture, absent[i].key, NULL);
        int rc = model_config_from_json(path, &c, err);
        EXPECT(rc == 0 && (absent[i].window < 0 || c.window == absent[i].window) &&
               (absent[i].positions < 0 || c.max_pos == absent[i].positions), "%s without %s: exit %d (%s), window "
               "%d, positions %d; expected HF's default", absent[i].fixture, absent[i].key, rc, err, c.window,
               c.max_pos);
    }
    write_config_edit(dir, "mistral-tiny-gqa8", "sliding_window", cJSON_CreateNull());
    CU_ASSERT_EQUAL(model_config_from_json(path, &c, err), 0);
    EXPECT(c.window == 0, "Mistral's sliding_window null: expected no window, got %d", c.window);

    write_config_edit(dir, "llama-tiny-mha", "hidden_act", cJSON_CreateString("silu"));
    CU_ASSERT_EQUAL_FATAL(model_config_from_json(path, &silu, err), 0);
    write_config_edit(dir, "llama-tiny-mha", "hidden_act", cJSON_CreateString("swish"));
    CU_ASSERT_EQUAL(model_config_from_json(path, &c, err), 0);
    EXPECT(!memcmp(&c, &silu, sizeof c), "hidden_act \"swish\": not the model of \"silu\" (%s)", err);

    write_config_edit(dir, "llama-tiny-mha", "rope_scaling", cJSON_Parse("{\"factor\": 4}"));
    CU_ASSERT_EQUAL(model_config_from_json(path, &c, err), 0);
    EXPECT(c.rope.kind == ROPE_DEFAULT, "rope_scaling {\"factor\": 4}: expected the default RoPE, got %d (%s)",
           c.rope.kind, err);

    static const char *const llama3 = "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
                                      "\"high_freq_factor\": 4%s}";
    char scaling[256];
    snprintf(scaling, sizeof scaling, llama3, ", \"original_max_position_embeddings\": 32");
    write_config_edit(dir, "llama-tiny-mha", "rope_scaling", cJSON_Parse(scaling));
    char *text = slurp(path, NULL);
    cJSON *root = cJSON_Parse(text);
    CU_ASSERT_PTR_NOT_NULL_FATAL(root);
    cJSON_AddNumberToObject(root, "original_max_position_embeddings", 64);
    char *edited = cJSON_Print(root);
    write_text(dir, "config.json", edited);
    free(edited), free(text);
    cJSON_Delete(root);
    CU_ASSERT_EQUAL(model_config_from_json(path, &c, err), 0);
    EXPECT(c.rope.kind == ROPE_LLAMA3 && c.rope.original_max_pos == 64, "llama3 with a top-level "
           "original_max_position_embeddings 64 beside the object's 32: got %d (%s)", c.rope.original_max_pos, err);
    snprintf(scaling, sizeof scaling, llama3, "");
    write_config_edit(dir, "llama-tiny-mha", "rope_scaling", cJSON_Parse(scaling));
    CU_ASSERT_EQUAL(model_config_from_json(path, &c, err), 0);
    EXPECT(c.rope.kind == ROPE_LLAMA3 && c.rope.original_max_pos == c.max_pos, "llama3 without "
           "original_max_position_embeddings: expected max_position_embeddings %d, got %d (%s)", c.max_pos,
           c.rope.original_max_pos, err);
    finish(dir, NULL);
}

/* Two loads of one model hold the same fp16 values; both are freed. */
static void expect_same_weights(model_weights *got, model_weights *want) {
    CU_ASSERT_EQUAL(got->storage_values, want->storage_values);
    CU_ASSERT(got->storage_values == want->storage_values &&
              memcmp(got->storage, want->storage, got->storage_values * sizeof(fp16)) == 0);
    model_weights_free(got);
    model_weights_free(want);
}

/* Older LLaMA checkpoints hold each layer's RoPE frequencies (self_attn.rotary_emb.inv_freq),
 * which HF skips as it loads: the model loads as without them. */
static void test_rope_buffers_skipped(void) {
    model_weights plain, w;
    tlist l;
    load_ok(fixture("llama-tiny-mha"), &plain);
    char *dir = fixture_copy("llama-tiny-mha", &l);
    int64_t half = cfg_head_dim(&plain.cfg) / 2;
    for (int j = 0; j < plain.cfg.n_layers; j++) {
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.self_attn.rotary_emb.inv_freq", j);
        tl_add(&l, name, "F32", 1, &half, NULL);
    }
    save_model(dir, &l);
    load_ok(dir, &w);
    expect_same_weights(&w, &plain);
    finish(dir, &l);
}

/* A directory with model.safetensors and a model.safetensors.index.json beside it (a sharded save
 * over an unsharded one leaves both; this index names shards that are gone) is read as HF reads
 * it: model.safetensors, the one file its checkpoint hash reads. */
static void test_single_file_over_index(void) {
    model_weights plain, w;
    load_ok(fixture("llama-tiny-mha"), &plain);
    char *dir = fixture_rewrite("llama-tiny-mha"), err[FG_ERR_LEN] = "";
    write_text(dir, "model.safetensors.index.json",
               "{\"metadata\": {}, \"weight_map\": {\"model.embed_tokens.weight\": "
               "\"model-00001-of-00002.safetensors\"}}");
    load_ok(dir, &w);
    expect_same_weights(&w, &plain);
    char **names;
    int n;
    CU_ASSERT_EQUAL_FATAL(st_dir_files(dir, &names, &n, err), 0);
    EXPECT(n == 1 && !strcmp(names[0], "model.safetensors"), "the checkpoint's files: %d, the first %s", n,
           n ? names[0] : "none");
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    finish(dir, NULL);
}

/* LLaMA checkpoints: a missing tensor, a wrong shape (the one expected named), an untied model
 * without lm_head.weight. */
static void test_llama_bad_tensors(void) {
    tlist l;
    char *dir = fixture_copy("llama-tiny-mqa-bias", &l);
    tl_remove(&l, "model.layers.1.mlp.up_proj.bias");
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, dir, "missing tensor", "model.layers.1.mlp.up_proj.bias");
    finish(dir, &l);
    dir = fixture_copy("llama-tiny-mqa-bias", &l); /* k_proj as wide as q_proj: not MQA's 24 */
    tl_reshape(tl_get(&l, "model.layers.0.self_attn.k_proj.weight"), 2, 192, 128);
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, "model.layers.0.self_attn.k_proj.weight", "[192, 128]", "expected [24, 128]");
    finish(dir, &l);
    dir = fixture_copy("llama-tiny-mha", &l);
    tl_remove(&l, "lm_head.weight");
    save_model(dir, &l);
    EXPECT_LOAD_FAIL(dir, "config.json", "\"tie_word_embeddings\" is false", "no lm_head.weight");
    finish(dir, &l);
}

/* A config that disagrees with the tensors on the number of layers is refused before anything
 * is sized from it, up to the 1024 layers a config may give (more: test_llama_config_refusals). */
static void test_config_layers_against_tensors(void) {
    char *dir = fixture_rewrite("opt-tiny");
    static const int wrong[] = {1, 3, 1024};
    for (size_t i = 0; i < sizeof wrong / sizeof *wrong; i++) {
        write_config_edit(dir, "opt-tiny", "num_hidden_layers", cJSON_CreateNumber(wrong[i]));
        char says[64];
        snprintf(says, sizeof says, "num_hidden_layers is %d", wrong[i]);
        EXPECT_LOAD_FAIL(dir, "config.json", says, "holds 2 decoder layers");
    }
    finish(dir, NULL);
}

static void test_missing_config_field(void) {
    static const char *const required[] = {"hidden_size", "num_hidden_layers",
                                           "num_attention_heads", "ffn_dim", "vocab_size"};
    char *dir = fixture_rewrite("opt-tiny");
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        char quoted[64];
        snprintf(quoted, sizeof quoted, "\"%s\"", required[i]);
        write_config_edit(dir, "opt-tiny", required[i], NULL);
        EXPECT_CONFIG_FAIL(join(dir, "config.json"), "config.json", "missing", quoted);
    }
    write_config_edit(dir, "opt-tiny", "hidden_size", NULL);
    EXPECT_LOAD_FAIL(dir, "config.json", "missing \"hidden_size\"");
    write_config_edit(dir, "opt-tiny", "hidden_size", cJSON_CreateString("64"));
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "\"hidden_size\"", "positive integer");
    write_config_edit(dir, "opt-tiny", "num_hidden_layers", cJSON_CreateNumber(0));
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "\"num_hidden_layers\"", "positive integer");
    write_config_edit(dir, "opt-tiny", "vocab_size", cJSON_CreateNumber(512.5));
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "\"vocab_size\"", "positive integer");
    write_config_edit(dir, "opt-tiny", "hidden_size", cJSON_CreateNumber(1e10));
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "\"hidden_size\"", "positive integer");
    finish(dir, NULL);
}

/* A key given twice in config.json takes its last value, as Python's json (and so HF) does:
 * earlier values of model_type, hidden_size and do_layer_norm_before are overridden by the
 * fixture's own, and a value appended at the end overrides the fixture's. */
static void test_config_repeated_keys(void) {
    char *dir = fixture_rewrite("opt-tiny"), *text = slurp(fixture("opt-tiny/config.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    char *brace = strrchr(text, '}');
    CU_ASSERT_PTR_NOT_NULL_FATAL(brace);
    *brace = 0;
    size_t cap = strlen(text) + 512;
    char *edited = malloc(cap);
    snprintf(edited, cap, "{\"model_type\": \"gpt2\", \"hidden_size\": 32, \"vocab_size\": 7, "
             "\"do_layer_norm_before\": false, %s, \"word_embed_proj_dim\": 32}", strchr(text, '{') + 1);
    write_text(dir, "config.json", edited);
    model_config c;
    char err[FG_ERR_LEN] = "";
    int rc = model_config_from_json(join(dir, "config.json"), &c, err);
    EXPECT(rc == 0, "config.json with repeated keys (the last value counts): %s", err);
    if (rc == 0)
        EXPECT(c.hidden == 64 && c.vocab == 512 && c.pre_ln == 1 && c.word_dim == 32,
               "repeated keys: expected the last values hidden_size 64, vocab_size 512, "
               "do_layer_norm_before true, word_embed_proj_dim 32; got %d, %d, %d, %d",
               c.hidden, c.vocab, c.pre_ln, c.word_dim);
    free(edited);
    free(text);
    finish(dir, NULL);
}

/* do_layer_norm_before and the other flags HF tests with `if` take a JSON number as Python
 * does (0 false, any other true); a value that is neither a number nor true or false is refused
 * naming the key and the value. A flag the runtime does not support is refused naming it. */
static void test_config_flags(void) {
    char *dir = fixture_rewrite("opt-tiny");
    static const double truthy[] = {1, 2, -1, 0.5};
    for (size_t i = 0; i < sizeof truthy / sizeof *truthy; i++) {
        write_config_edit(dir, "opt-tiny", "do_layer_norm_before", cJSON_CreateNumber(truthy[i]));
        model_weights w;
        char err[FG_ERR_LEN] = "";
        int rc = model_weights_load(dir, &w, err);
        EXPECT(rc == 0 && w.cfg.pre_ln == 1, "\"do_layer_norm_before\": %g (true to Python): "
               "expected a pre-LN model, got %s", truthy[i], rc ? err : "post-LN");
        if (rc == 0) model_weights_free(&w);
    }
    model_config c;
    char err[FG_ERR_LEN] = "";
    write_config_edit(dir, "opt-tiny", "do_layer_norm_before", cJSON_CreateNumber(0));
    CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    CU_ASSERT_EQUAL(c.pre_ln, 0);
    write_config_edit(dir, "opt-tiny", "do_layer_norm_before", cJSON_CreateString("false"));
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "config.json", "\"do_layer_norm_before\"",
                       "\"false\"", "true or false");
    write_config_edit(dir, "opt-tiny", "do_layer_norm_before", cJSON_CreateNull());
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "\"do_layer_norm_before\"", "null");
    write_config_edit(dir, "opt-tiny", "_remove_final_layer_norm", cJSON_CreateNumber(1));
    EXPECT_CONFIG_FAIL(join(dir, "config.json"), "_remove_final_layer_norm", "not supported");
    static const char *const needed[] = {"enable_bias", "layer_norm_elementwise_affine"};
    for (int i = 0; i < 2; i++) {
        write_config_edit(dir, "opt-tiny", needed[i], cJSON_CreateNumber(0));
        EXPECT_CONFIG_FAIL(join(dir, "config.json"), "config.json", needed[i], "not supported");
        write_config_edit(dir, "opt-tiny", needed[i], cJSON_CreateNumber(1));
        CU_ASSERT_EQUAL(model_config_from_json(join(dir, "config.json"), &c, err), 0);
    }
    finish(dir, NULL);
}

static void test_heads_do_not_divide_hidden(void) {
    char *dir = fixture_rewrite("opt-tiny");
    write_config_edit(dir, "opt-tiny", "num_attention_heads", cJSON_CreateNumber(5));
    EXPECT_LOAD_FAIL(dir, "config.json", "hidden_size 64", "not a multiple",
                     "num_attention_heads 5");
    finish(dir, NULL);
}

/* A temp copy of opt-tiny-350m (config, shards) whose index is the fixture's weight_map edited
 * by `edit` (NULL: unchanged). */
static char *sharded_copy(void (*edit)(cJSON *weight_map)) {
    char src[4096];
    snprintf(src, sizeof src, "%s", fixture("opt-tiny-350m"));
    char *dir = make_temp_dir();
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    copy_file(join(src, "config.json"), dir, "config.json");
    cJSON *root = read_index(src), *wm = cJSON_GetObjectItem(root, "weight_map"), *e;
    cJSON_ArrayForEach(e, wm) {
        if (access(join(dir, e->valuestring), F_OK) != 0)
            copy_file(join(src, e->valuestring), dir, e->valuestring);
    }
    if (edit) edit(wm);
    char *text = cJSON_Print(root);
    write_text(dir, "model.safetensors.index.json", text);
    free(text);
    cJSON_Delete(root);
    return dir;
}

static void shard_gone(cJSON *wm) {
    cJSON_ReplaceItemInObject(wm, L1 "fc1.bias",
                              cJSON_CreateString("model-00004-of-00003.safetensors"));
}

static void shard_wrong(cJSON *wm) { /* embed_tokens is in shard 1 */
    cJSON_ReplaceItemInObject(wm, "model.decoder.embed_tokens.weight",
                              cJSON_CreateString("model-00003-of-00003.safetensors"));
}

static void shard_ghost(cJSON *wm) {
    cJSON_AddItemToObject(wm, L0 "ghost.weight",
                          cJSON_CreateString("model-00002-of-00003.safetensors"));
}

static void shard_copied(cJSON *wm) { /* a copy of shard 1 beside it, named for one tensor */
    cJSON_ReplaceItemInObject(wm, "model.decoder.embed_tokens.weight",
                              cJSON_CreateString("model-copy.safetensors"));
}

static void shard_path(cJSON *wm) {
    cJSON_ReplaceItemInObject(wm, L1 "fc1.bias", cJSON_CreateString("../model.safetensors"));
}

static void test_sharded_copy_loads(void) {
    model_weights w, ref;
    char *dir = sharded_copy(NULL);
    load_ok(dir, &w);
    load_ok(fixture("opt-tiny-350m"), &ref);
    CU_ASSERT_EQUAL_FATAL(w.storage_values, ref.storage_values);
    CU_ASSERT(memcmp(w.storage, ref.storage, w.storage_values * sizeof(fp16)) == 0);
    model_weights_free(&w);
    model_weights_free(&ref);
    finish(dir, NULL);
}

static void test_index_missing_shard(void) {
    char *dir = sharded_copy(shard_gone);
    EXPECT_LOAD_FAIL(dir, "model-00004-of-00003.safetensors", "No such file");
    finish(dir, NULL);
}

static void test_index_tensor_not_in_shard(void) {
    char *dir = sharded_copy(shard_wrong);
    EXPECT_LOAD_FAIL(dir, "model.safetensors.index.json", "model.decoder.embed_tokens.weight",
                     "model-00003-of-00003.safetensors", "as the index says");
    finish(dir, NULL);
    dir = sharded_copy(shard_ghost);
    EXPECT_ST_FAIL(dir, "model.safetensors.index.json", L0 "ghost.weight",
                   "model-00002-of-00003.safetensors");
    finish(dir, NULL);
    dir = sharded_copy(shard_path);
    EXPECT_ST_FAIL(dir, "model.safetensors.index.json", L1 "fc1.bias", "bad file name");
    finish(dir, NULL);
}

static void test_malformed_index(void) {
    char *dir = sharded_copy(NULL);
    write_text(dir, "model.safetensors.index.json", "{\"weight_map\": {\"a\": ");
    EXPECT_LOAD_FAIL(dir, "model.safetensors.index.json", "malformed JSON");
    write_text(dir, "model.safetensors.index.json", "{\"metadata\": {}}");
    EXPECT_ST_FAIL(dir, "model.safetensors.index.json", "weight_map");
    finish(dir, NULL);
    /* a tensor in two shards: named with both, not as one the index misplaces */
    dir = sharded_copy(shard_copied);
    copy_file(join(dir, "model-00001-of-00003.safetensors"), dir, "model-copy.safetensors");
    EXPECT_ST_FAIL(dir, "model.safetensors.index.json", "is in two shards", "model-copy.safetensors");
    finish(dir, NULL);
}

static void test_no_safetensors(void) {
    char *dir = make_temp_dir();
    EXPECT_ST_FAIL(dir, dir, "no model.safetensors or model.safetensors.index.json");
    copy_file(fixture("opt-tiny/config.json"), dir, "config.json");
    EXPECT_LOAD_FAIL(dir, dir, "no model.safetensors or model.safetensors.index.json");
    finish(dir, NULL);
}

static void test_nonexistent_dir(void) {
    const char *dir = "/nonexistent/flexgen-test-dir";
    EXPECT_LOAD_FAIL(dir, "/nonexistent/flexgen-test-dir/config.json", "No such file");
    EXPECT_ST_FAIL(dir, dir, "no model.safetensors");
}

/* ---------------------------------------------------------------------------------------------
 * fp16
 * --------------------------------------------------------------------------------------------- */

static int fp16_is_nan(fp16 h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }

static void test_fp16_round_trip(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++)
        if (!fp16_is_nan((fp16)h)) bad += fp32_to_fp16(fp16_to_fp32((fp16)h)) != h;
    CU_ASSERT_EQUAL(bad, 0);
}

/* For every pair of neighbouring finite fp16 values (of both signs, the top one's neighbour being
 * 65536 = Inf): the midpoint rounds to the even one, and the floats just beside it to the near
 * one. That covers ties to even, subnormals, the subnormal/normal boundary and overflow. */
static void test_fp16_round_to_nearest_even(void) {
    int bad = 0;
    for (uint32_t sign = 0; sign <= 0x8000; sign += 0x8000)
        for (uint32_t m = 0; m < 0x7c00; m++) {
            float lo = fp16_to_fp32((fp16)m);
            float hi = m == 0x7bff ? 65536.0f : fp16_to_fp32((fp16)(m + 1));
            float mid = (lo + hi) / 2, s = sign ? -1.0f : 1.0f;
            fp16 even = (fp16)(sign | (m & 1 ? m + 1 : m));
            bad += fp32_to_fp16(s * lo) != (sign | m);
            bad += fp32_to_fp16(s * mid) != even;
            bad += fp32_to_fp16(s * nextafterf(mid, 0)) != (sign | m);
            bad += fp32_to_fp16(s * nextafterf(mid, INFINITY)) != (sign | (m + 1));
        }
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_fp16_edges(void) {
    CU_ASSERT_EQUAL(fp32_to_fp16(1.0f), 0x3c00);
    CU_ASSERT_EQUAL(fp32_to_fp16(1.0f + 0x1p-11f), 0x3c00);     /* tie, down to even */
    CU_ASSERT_EQUAL(fp32_to_fp16(1.0f + 3 * 0x1p-11f), 0x3c02); /* tie, up to even */
    CU_ASSERT_EQUAL(fp32_to_fp16(65504.0f), 0x7bff);
    CU_ASSERT_EQUAL(fp32_to_fp16(65519.0f), 0x7bff);
    CU_ASSERT_EQUAL(fp32_to_fp16(65520.0f), 0x7c00); /* overflow */
    CU_ASSERT_EQUAL(fp32_to_fp16(1e10f), 0x7c00);
    CU_ASSERT_EQUAL(fp32_to_fp16(-1e10f), 0xfc00);
    CU_ASSERT_EQUAL(fp32_to_fp16(3.4e38f), 0x7c00);
    CU_ASSERT_EQUAL(fp32_to_fp16(INFINITY), 0x7c00);
    CU_ASSERT_EQUAL(fp32_to_fp16(-INFINITY), 0xfc00);
    CU_ASSERT(fp16_is_nan(fp32_to_fp16(NAN)));
    CU_ASSERT_EQUAL(fp32_to_fp16(1e-10f), 0x0000); /* tiny: signed zero */
    CU_ASSERT_EQUAL(fp32_to_fp16(-1e-10f), 0x8000);
    CU_ASSERT_EQUAL(fp32_to_fp16(0x1p-149f), 0x0000);
    CU_ASSERT_EQUAL(fp32_to_fp16(-0.0f), 0x8000);
    CU_ASSERT_EQUAL(fp32_to_fp16(0x1p-25f), 0x0000);  /* half the smallest subnormal: to even */
    CU_ASSERT_EQUAL(fp32_to_fp16(nextafterf(0x1p-25f, 1)), 0x0001);
    CU_ASSERT_EQUAL(fp32_to_fp16(0x1p-24f), 0x0001);  /* smallest subnormal */
    CU_ASSERT_EQUAL(fp32_to_fp16(-0x1p-24f), 0x8001);
    CU_ASSERT_EQUAL(fp32_to_fp16(3 * 0x1p-25f), 0x0002); /* 1.5 ulp: to even */
    CU_ASSERT_EQUAL(fp32_to_fp16(5 * 0x1p-25f), 0x0002); /* 2.5 ulp: to even */
    CU_ASSERT_EQUAL(fp32_to_fp16(1023 * 0x1p-24f), 0x03ff); /* largest subnormal */
    CU_ASSERT_EQUAL(fp32_to_fp16(1023.5f * 0x1p-24f), 0x0400); /* tie into the normals */
    CU_ASSERT_EQUAL(fp32_to_fp16(0x1p-14f), 0x0400);  /* smallest normal */
    CU_ASSERT_EQUAL(fp16_to_fp32(0x0001), 0x1p-24f);
    CU_ASSERT_EQUAL(fp16_to_fp32(0x03ff), 1023 * 0x1p-24f);
    CU_ASSERT_EQUAL(fp16_to_fp32(0x8200), -0x1p-15f);
    CU_ASSERT_EQUAL(fp16_to_fp32(0x7bff), 65504.0f);
    CU_ASSERT_EQUAL(fp16_to_fp32(0x7c00), INFINITY);
    CU_ASSERT_EQUAL(fp16_to_fp32(0xfc00), -INFINITY);
    CU_ASSERT(isnan(fp16_to_fp32(0x7e00)));
    CU_ASSERT(signbit(fp16_to_fp32(0x8000)) && fp16_to_fp32(0x8000) == 0.0f);
    CU_ASSERT_EQUAL(bf16_to_fp32(0x3f80), 1.0f);
    CU_ASSERT_EQUAL(bf16_to_fp32(0xc040), -3.0f);
}

static uint64_t xorshift(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Edge values, random bit patterns (every exponent), random values in fp16's range and random
 * values near its subnormals. */
static void random_floats(float *x, size_t n) {
    static const float edges[] = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f,
                                  -65520.0f, 1e10f, INFINITY, -INFINITY, NAN, 0x1p-24f, 0x1p-25f,
                                  3 * 0x1p-25f, 1023.5f * 0x1p-24f, 0x1p-14f, 1.0f + 0x1p-11f,
                                  1.0f + 3 * 0x1p-11f, 0x1p-149f, 3.4e38f};
    size_t ne = sizeof edges / sizeof edges[0];
    uint64_t s = 0x243f6a8885a308d3ULL;
    for (size_t i = 0; i < n; i++) {
        uint64_t r = xorshift(&s);
        float u = (float)(r >> 40) / 16777216.0f * 2 - 1;
        switch (i < ne ? 3 : r % 3) {
        case 0: x[i] = bits_float((uint32_t)(r >> 16)); break;
        case 1: x[i] = u * 70000.0f; break;
        case 2: x[i] = u * 0x1p-13f; break;
        default: x[i] = edges[i]; break;
        }
    }
}

static int same_float(float a, float b) {
    return (isnan(a) && isnan(b)) || float_bits(a) == float_bits(b);
}

static void test_fp16_vector_matches_scalar(void) {
    enum { N = 100003 }; /* not a multiple of 8: the vector loop's tail runs too */
    float *x = malloc(N * sizeof *x), *y = malloc((N + 65536) * sizeof *y);
    fp16 *h = malloc((N + 65536) * sizeof *h);
    random_floats(x, N);
    size_t bad = 0;
    fp32_to_fp16_n(x, h, N);
    for (size_t i = 0; i < N; i++)
        bad += h[i] != fp32_to_fp16(x[i]) && !(fp16_is_nan(h[i]) && isnan(x[i]));
    CU_ASSERT_EQUAL(bad, 0);
    fp32_to_fp16_n(x + 1, h + 1, N - 1); /* unaligned start */
    for (size_t i = 1; i < N; i++)
        bad += h[i] != fp32_to_fp16(x[i]) && !(fp16_is_nan(h[i]) && isnan(x[i]));
    CU_ASSERT_EQUAL(bad, 0);
    for (size_t i = 0; i < 65536; i++) h[N + i] = (fp16)i; /* every fp16 after N random ones */
    fp16_to_fp32_n(h, y, N + 65536);
    for (size_t i = 0; i < N + 65536; i++) bad += !same_float(y[i], fp16_to_fp32(h[i]));
    CU_ASSERT_EQUAL(bad, 0);
    fp16_to_fp32_n(h + 3, y + 3, 13);
    for (size_t i = 3; i < 16; i++) bad += !same_float(y[i], fp16_to_fp32(h[i]));
    CU_ASSERT_EQUAL(bad, 0);
    free(x);
    free(y);
    free(h);
}

/* --------------------------------------------------------------------------------------------- */

void add_checkpoint_tests(void) {
    CU_pSuite s = CU_add_suite("checkpoint", NULL, NULL);
    CU_add_test(s, "fixture opt-tiny (fp16) loads, tied lm_head", test_fixture_opt_tiny);
    CU_add_test(s, "fixture opt-tiny-350m (fp32, sharded, project_in/out)",
                test_fixture_opt_tiny_350m);
    CU_add_test(s, "fixture opt-tiny-bf16 loads", test_fixture_opt_tiny_bf16);
    CU_add_test(s, "F32 copy gives bit-identical weights", test_dtype_f32_equivalence);
    CU_add_test(s, "BF16 copy gives bf16- then fp16-rounded weights", test_dtype_bf16_equivalence);
    CU_add_test(s, "names without \"model.\" load", test_names_without_model_prefix);
    CU_add_test(s, "explicit lm_head.weight is loaded separately when untied", test_explicit_lm_head);
    CU_add_test(s, "NaN, Inf or beyond fp16 in the weights: one line naming tensor and element",
                test_nonfinite_weights);
    CU_add_test(s, "tie_word_embeddings (true when absent) ties lm_head to the embedding, as HF; "
                   "a lm_head.weight that differs is refused", test_tied_lm_head);
    CU_add_test(s, "st_open_dir maps every shard of opt-tiny-350m", test_sharded_archive);
    CU_add_test(s, "a rewritten shard index loads", test_sharded_copy_loads);
    CU_add_test(s, "missing tensor", test_missing_tensor);
    CU_add_test(s, "extra tensor", test_extra_tensor);
    CU_add_test(s, "a layer past any count, two tensors for one weight", test_tensor_names_refused);
    CU_add_test(s, "wrong shape", test_wrong_shape);
    CU_add_test(s, "wrong ndim", test_wrong_ndim);
    CU_add_test(s, "unsupported dtype", test_unsupported_dtype);
    CU_add_test(s, "truncated data", test_truncated_data);
    CU_add_test(s, "header length beyond the file", test_header_length);
    CU_add_test(s, "file shorter than 8 bytes", test_short_file);
    CU_add_test(s, "bad data_offsets", test_data_offsets);
    CU_add_test(s, "overlapping data_offsets", test_overlapping_offsets);
    CU_add_test(s, "an empty tensor overlaps nothing", test_empty_tensor_overlaps_nothing);
    CU_add_test(s, "shape whose element count overflows", test_shape_overflow);
    CU_add_test(s, "a newline in a name from the file: still one error line", test_error_stays_one_line);
    CU_add_test(s, "FIFO, device or directory for a file: refused at once", test_not_regular_files);
    CU_add_test(s, "text file bigger than FG_MAX_TEXT_FILE", test_text_file_too_big);
    CU_add_test(s, "malformed safetensors header", test_malformed_header);
    CU_add_test(s, "header entries with bad fields", test_bad_header_fields);
    CU_add_test(s, "header with trailing garbage", test_header_trailing_garbage);
    CU_add_test(s, "malformed config.json", test_malformed_config);
    CU_add_test(s, "a JSON string holding \\u0000, or data after the value: refused in every file",
                test_json_nul_escape);
    CU_add_test(s, "unknown architecture", test_unknown_architecture);
    CU_add_test(s, "LLaMA family: each unimplemented config value refused, naming it", test_llama_config_refusals);
    CU_add_test(s, "LLaMA family: fields left out read with HF's defaults", test_llama_config_hf_defaults);
    CU_add_test(s, "OPT's config.json names its eos ids", test_opt_config_eos);
    CU_add_test(s, "LLaMA family: layers' saved RoPE frequencies skipped, as HF skips them", test_rope_buffers_skipped);
    CU_add_test(s, "model.safetensors read over an index beside it, as HF reads it", test_single_file_over_index);
    CU_add_test(s, "LLaMA family: transformers 5's rope_parameters, the same model as rope_scaling",
                test_config_v5);
    CU_add_test(s, "generation_config.json's eos_token_id over config.json's; a bad one refused",
                test_generation_config_eos);
    CU_add_test(s, "LLaMA family: a missing tensor, a wrong shape, no lm_head when untied", test_llama_bad_tensors);
    CU_add_test(s, "missing or bad config field", test_missing_config_field);
    CU_add_test(s, "config's layers against the tensor table, before allocating",
                test_config_layers_against_tensors);
    CU_add_test(s, "hidden_size not a multiple of heads", test_heads_do_not_divide_hidden);
    CU_add_test(s, "a repeated config.json key takes its last value", test_config_repeated_keys);
    CU_add_test(s, "config.json flags: numbers as Python reads them, other values refused", test_config_flags);
    CU_add_test(s, "index names a missing shard", test_index_missing_shard);
    CU_add_test(s, "index names a tensor its shard lacks", test_index_tensor_not_in_shard);
    CU_add_test(s, "malformed index", test_malformed_index);
    CU_add_test(s, "neither model.safetensors nor an index", test_no_safetensors);
    CU_add_test(s, "non-existent directory", test_nonexistent_dir);
    CU_add_test(s, "fp16 round trip of all 65536 values", test_fp16_round_trip);
    CU_add_test(s, "fp16 rounds to nearest even everywhere", test_fp16_round_to_nearest_even);
    CU_add_test(s, "fp16 edge values", test_fp16_edges);
    CU_add_test(s, "fp16 vector path == scalar", test_fp16_vector_matches_scalar);
}
