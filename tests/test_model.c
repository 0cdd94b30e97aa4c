/* test_model.c: the forward pass against PyTorch + HF transformers (fixtures written by
 * scripts/make_reference.py), the KV cache against full recomputation, dummy weights, sampling.
 *
 * Tolerance: logits within 1e-4 x max|logit| of the reference, tokens exact. fp32 sums in another
 * order can round a K or V element to the neighbouring fp16 value; the bound covers that, and the
 * fixtures' smallest top-two logit gap is checked to be far above it. */
#define _GNU_SOURCE
#include "flexgen.h"
#include "tests.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    model_weights w;
    int n, gen_len, vocab;
    int **prompts, *lens;
    int *tokens;   /* [n][gen_len] */
    float *logits; /* [n][gen_len][vocab] */
    float max_abs, min_gap;
} reference;

static int read_ints_line(char *line, int **out) {
    int n = 0, cap = 8, *v = malloc(cap * sizeof *v);
    for (char *s = strtok(line, " \n"); s; s = strtok(NULL, " \n")) {
        if (n == cap) v = realloc(v, (cap *= 2) * sizeof *v);
        v[n++] = atoi(s);
    }
    *out = v;
    return n;
}

static int read_id_lines(const char *path, int ***rows, int **lens) {
    FILE *f = fopen(path, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    char line[8192];
    int n = 0;
    *rows = NULL;
    *lens = NULL;
    while (fgets(line, sizeof line, f)) {
        *rows = realloc(*rows, (n + 1) * sizeof **rows);
        *lens = realloc(*lens, (n + 1) * sizeof **lens);
        (*lens)[n] = read_ints_line(line, &(*rows)[n]);
        n++;
    }
    fclose(f);
    return n;
}

static float json_number(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    char buf[4096] = "";
    size_t len = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[len] = 0;
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *at = strstr(buf, pat);
    return at ? strtof(at + strlen(pat), NULL) : NAN;
}

/* The fixture tests/fixtures/NAME; its weights are in `weights`. */
static void load_reference(const char *name, const char *weights, reference *r) {
    char dir[512], path[600];
    char err[FG_ERR_LEN];
    memset(r, 0, sizeof *r);
    snprintf(dir, sizeof dir, "%s", fixture(name));
    int rc = model_weights_load(weights, &r->w, err);
    if (rc) fprintf(stderr, "%s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    snprintf(path, sizeof path, "%s/prompts.txt", dir);
    r->n = read_id_lines(path, &r->prompts, &r->lens);
    int **tok_rows, *tok_lens;
    snprintf(path, sizeof path, "%s/tokens.txt", dir);
    CU_ASSERT_EQUAL_FATAL(read_id_lines(path, &tok_rows, &tok_lens), r->n);
    r->gen_len = tok_lens[0];
    r->vocab = r->w.cfg.vocab;
    r->tokens = malloc((size_t)r->n * r->gen_len * sizeof *r->tokens);
    for (int p = 0; p < r->n; p++) {
        CU_ASSERT_EQUAL(tok_lens[p], r->gen_len);
        memcpy(r->tokens + (size_t)p * r->gen_len, tok_rows[p], r->gen_len * sizeof(int));
        free(tok_rows[p]);
    }
    free(tok_rows);
    free(tok_lens);
    size_t count = (size_t)r->n * r->gen_len * r->vocab;
    r->logits = malloc(count * sizeof(float));
    snprintf(path, sizeof path, "%s/logits.bin", dir);
    FILE *f = fopen(path, "rb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    CU_ASSERT_EQUAL_FATAL(fread(r->logits, sizeof(float), count, f), count);
    fclose(f);
    for (size_t i = 0; i < count; i++) r->max_abs = fmaxf(r->max_abs, fabsf(r->logits[i]));
    snprintf(path, sizeof path, "%s/reference.json", dir);
    r->min_gap = json_number(path, "min_top2_gap");
}

static void free_reference(reference *r) {
    for (int p = 0; p < r->n; p++) free(r->prompts[p]);
    free(r->prompts);
    free(r->lens);
    free(r->tokens);
    free(r->logits);
    model_weights_free(&r->w);
}

/* Generates the reference prompts with the given blocking; compares tokens and logits. */
static void check_against_reference(reference *r, const char *dir, int gpu_batch_size,
                                    int num_gpu_batches) {
    fg_policy p = fg_default_policy();
    p.gpu_batch_size = gpu_batch_size;
    p.num_gpu_batches = num_gpu_batches;
    size_t count = (size_t)r->n * r->gen_len * r->vocab;
    int *tokens = malloc((size_t)r->n * r->gen_len * sizeof *tokens);
    float *logits = malloc(count * sizeof *logits);
    CU_ASSERT_EQUAL_FATAL(generate_with(dir, NULL, 0, &p, r->gen_len, r->n, r->prompts, r->lens, tokens, logits, NULL, NULL), 0);
    int token_mismatches = 0, first = -1;
    for (int i = 0; i < r->n * r->gen_len; i++)
        if (tokens[i] != r->tokens[i] && token_mismatches++ == 0) first = i;
    float worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < count; i++)
        if (fabsf(logits[i] - r->logits[i]) > worst) worst = fabsf(logits[i] - r->logits[i]), at = i;
    EXPECT(token_mismatches == 0, "%s, blocks of %d x %d: %d of %d tokens differ from HF's; the first: "
           "prompt %d, step %d: expected %d, got %d", r->w.cfg.name, gpu_batch_size, num_gpu_batches,
           token_mismatches, r->n * r->gen_len, first / r->gen_len, first % r->gen_len,
           first < 0 ? 0 : r->tokens[first], first < 0 ? 0 : tokens[first]);
    size_t row = at / r->vocab;
    EXPECT(worst <= 1e-4f * r->max_abs, "%s, blocks of %d x %d: logits of prompt %zu, step %zu, token %zu: "
           "expected %g (HF), got %g; allowed 1e-4 x max|logit| = %.3g", r->w.cfg.name, gpu_batch_size,
           num_gpu_batches, row / r->gen_len, row % r->gen_len, at % r->vocab, r->logits[at], logits[at],
           1e-4 * r->max_abs);
    free(tokens);
    free(logits);
}

/* A fixture against its weights: the random models' are in the fixture, a trained model's in
 * models/. */
static void check_fixture_of(const char *name, const char *weights) {
    reference r;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", weights);
    load_reference(name, dir, &r);
    /* The bound only makes sense if no top-two pair is anywhere near it. */
    CU_ASSERT(r.min_gap > 20 * 1e-4f * r.max_abs);
    check_against_reference(&r, dir, r.n, 1); /* one GPU batch */
    check_against_reference(&r, dir, 2, 2);   /* blocks of 2 x 2, the last partial */
    check_against_reference(&r, dir, 1, 3);   /* one sequence per GPU batch */
    free_reference(&r);
}

static void check_fixture(const char *name) { check_fixture_of(name, fixture(name)); }

static void test_reference_pre_ln_fp16(void) { check_fixture("opt-tiny"); }
static void test_reference_350m_fp32_sharded(void) { check_fixture("opt-tiny-350m"); }
static void test_reference_bf16(void) { check_fixture("opt-tiny-bf16"); }
static void test_reference_text(void) { check_fixture("opt-tiny-text"); }
/* 20 layers, and words wider than the hidden states (word_embed_proj_dim 72 > hidden 40): the
 * workspace holds the embeddings before project_in and project_out's rows at their width. */
static void test_reference_deep(void) { check_fixture("opt-deep"); }
/* Four hidden dimensions whose activations are 24 to 56 times the rest at every linear layer's
 * input (as OPT-6.7B's and larger models' are): fp32 compute still matches HF. */
static void test_reference_outlier(void) { check_fixture("opt-outlier"); }
static void test_reference_trained(void) { check_fixture_of("opt-kjv", fixture("../../models/opt-kjv")); }
static void test_reference_trained_llama(void) { check_fixture_of("llama-kjv", fixture("../../models/llama-kjv")); }

/* The LLaMA family (scripts/make_llama_reference.py): GQA ratios, head dims, RoPE's variants. */
static void test_llama_mha(void) { check_fixture("llama-tiny-mha"); }
static void test_llama_gqa2_llama3(void) { check_fixture("llama-tiny-gqa2-llama3"); }
static void test_llama_gqa4_linear(void) { check_fixture("llama-tiny-gqa4-linear"); }
static void test_llama_mqa_bias(void) { check_fixture("llama-tiny-mqa-bias"); }
static void test_mistral_gqa8(void) { check_fixture("mistral-tiny-gqa8"); }
static void test_qwen2(void) { check_fixture("qwen2-tiny"); }

/* generate() on the opt-tiny fixture with the given options (blocks of 2 x 2); its error line
 * into err, or (err NULL) on stderr. */
static int generate_opt(gen_options *opt, int n, int *const *prompts, const int *lens, int *tokens,
                        float *logits, char *err_out) {
    char err[FG_ERR_LEN] = "";
    fg_policy p = fg_default_policy();
    p.gpu_batch_size = 2, p.num_gpu_batches = 2;
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    gen_timing t;
    int rc = fg_runtime_open(&p, &rt, err);
    if (rc == 0) rc = fg_model_open(rt, fixture("opt-tiny"), 0, &m, err);
    if (rc == 0) rc = generate(m, opt, n, prompts, lens, tokens, logits, &t, err);
    if (rc && err_out) snprintf(err_out, FG_ERR_LEN, "%s", err);
    else if (rc) fprintf(stderr, "\n  generate: %s\n", err);
    fg_model_close(m);
    fg_runtime_close(rt);
    return rc;
}

/* Teacher forcing (perplexity through decode): fed the tokens greedy decoding chose, each step
 * computes exactly what greedy decoding computed; fed other tokens, the outputs are those. */
static void test_teacher_forcing(void) {
    reference r;
    load_reference("opt-tiny", fixture("opt-tiny"), &r);
    size_t count = (size_t)r.n * r.gen_len * r.vocab;
    int *tokens = malloc((size_t)r.n * r.gen_len * sizeof *tokens), *forced = malloc((size_t)r.n * r.gen_len * sizeof *forced);
    float *greedy = malloc(count * sizeof *greedy), *taught = malloc(count * sizeof *taught);
    gen_options opt = {.gen_len = r.gen_len, .top_p = 1};
    CU_ASSERT_EQUAL_FATAL(generate_opt(&opt, r.n, r.prompts, r.lens, forced, greedy, NULL), 0);
    opt.forced = forced;
    CU_ASSERT_EQUAL_FATAL(generate_opt(&opt, r.n, r.prompts, r.lens, tokens, taught, NULL), 0);
    CU_ASSERT(memcmp(tokens, forced, (size_t)r.n * r.gen_len * sizeof *tokens) == 0);
    CU_ASSERT(memcmp(greedy, taught, count * sizeof *greedy) == 0);
    for (int i = 0; i < r.n * r.gen_len; i++) forced[i] = 3 + (i * 37) % (r.vocab - 3);
    CU_ASSERT_EQUAL_FATAL(generate_opt(&opt, r.n, r.prompts, r.lens, tokens, taught, NULL), 0);
    CU_ASSERT(memcmp(tokens, forced, (size_t)r.n * r.gen_len * sizeof *tokens) == 0);
    CU_ASSERT(memcmp(greedy + r.vocab, taught + r.vocab, (size_t)r.vocab * sizeof *greedy) != 0);
    forced[5] = r.vocab; /* out of the vocab: refused */
    char err[FG_ERR_LEN] = "";
    CU_ASSERT_EQUAL(generate_opt(&opt, r.n, r.prompts, r.lens, tokens, taught, err), -1);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "forced token 6"));
    free(tokens), free(forced), free(greedy), free(taught);
    free_reference(&r);
}

/* Mismatches of tokens [n][gen_len] against want, the first described in where (or empty). */
static int count_token_mismatches(const int *tokens, const int *want, int n, int gen_len, char *where,
                                  size_t cap) {
    int bad = 0;
    where[0] = 0;
    for (int i = 0; i < n * gen_len; i++)
        if (tokens[i] != want[i] && bad++ == 0)
            snprintf(where, cap, "prompt %d, step %d: expected %d, got %d", i / gen_len, i % gen_len,
                     want[i], tokens[i]);
    return bad;
}

/* want: tokens up to each sequence's first EOS, then OPT_PAD_ID (flexgen.h's contract). */
static void pad_after_eos(const int *tokens, int n, int gen_len, int *want) {
    for (int p = 0; p < n; p++) {
        int done = 0;
        for (int s = 0; s < gen_len; s++) {
            int t = tokens[p * gen_len + s];
            want[p * gen_len + s] = done ? OPT_PAD_ID : t;
            done |= t == OPT_EOS_ID;
        }
    }
}

/* With stop_at_eos the token array generate() returns holds OPT_PAD_ID after each sequence's
 * first EOS, while the other sequences of its block go on: greedy decoding of the fixture
 * (prompt 4 generates </s> first, in a block with three others), and teacher forcing that gives
 * EOS at chosen steps and other tokens after it. */
static void test_stop_at_eos_pads_tokens(void) {
    reference r;
    load_reference("opt-tiny", fixture("opt-tiny"), &r);
    size_t count = (size_t)r.n * r.gen_len;
    int *tokens = malloc(count * sizeof *tokens), *forced = malloc(count * sizeof *forced);
    int *want = malloc(count * sizeof *want);
    char where[160];
    CU_ASSERT_FATAL(r.n >= 4 && r.gen_len >= 3 && r.tokens[3 * r.gen_len] == OPT_EOS_ID);
    gen_options opt = {.gen_len = r.gen_len, .top_p = 1, .stop_at_eos = 1};
    CU_ASSERT_EQUAL_FATAL(generate_opt(&opt, r.n, r.prompts, r.lens, tokens, NULL, NULL), 0);
    pad_after_eos(r.tokens, r.n, r.gen_len, want);
    int bad = count_token_mismatches(tokens, want, r.n, r.gen_len, where, sizeof where);
    EXPECT(bad == 0, "greedy with stop_at_eos: %d tokens differ from the reference's, padded after "
           "the first EOS; %s", bad, where);
    for (size_t i = 0; i < count; i++) forced[i] = 3 + (int)(i * 37) % (r.vocab - 3); /* no EOS, no pad */
    forced[0 * r.gen_len + 1] = OPT_EOS_ID;
    forced[1 * r.gen_len + 0] = OPT_EOS_ID;
    forced[1 * r.gen_len + 2] = OPT_EOS_ID; /* a second EOS is padded too */
    forced[2 * r.gen_len + r.gen_len - 1] = OPT_EOS_ID;
    opt.forced = forced;
    CU_ASSERT_EQUAL_FATAL(generate_opt(&opt, r.n, r.prompts, r.lens, tokens, NULL, NULL), 0);
    pad_after_eos(forced, r.n, r.gen_len, want);
    bad = count_token_mismatches(tokens, want, r.n, r.gen_len, where, sizeof where);
    EXPECT(bad == 0, "teacher forcing EOS with stop_at_eos: %d tokens differ from the forced ones, "
           "padded after the first EOS; %s", bad, where);
    free(tokens), free(forced), free(want);
    free_reference(&r);
}

/* Prefill's logits at every prompt position (perplexity through prefill): position t's row of
 * a prompt equals the next-token logits of the prompt cut after token t, run on its own. */
static void test_prompt_logits(void) {
    reference r;
    load_reference("opt-tiny", fixture("opt-tiny"), &r);
    int longest = 0, tok, worst_p = -1, worst_t = -1;
    for (int p = 0; p < r.n; p++) longest = r.lens[p] > longest ? r.lens[p] : longest;
    float *all = malloc((size_t)r.n * longest * r.vocab * sizeof *all), *one = malloc((size_t)r.vocab * sizeof *one);
    int *tokens = malloc((size_t)r.n * sizeof *tokens);
    gen_options opt = {.gen_len = 1, .top_p = 1, .prompt_logits = all};
    CU_ASSERT_EQUAL_FATAL(generate_opt(&opt, r.n, r.prompts, r.lens, tokens, NULL, NULL), 0);
    gen_options plain = {.gen_len = 1, .top_p = 1};
    float worst = 0, zero = 0;
    for (int p = 0; p < r.n; p++) {
        for (int t = 0; t < r.lens[p]; t++) {
            int len = t + 1;
            CU_ASSERT_EQUAL_FATAL(generate_opt(&plain, 1, &r.prompts[p], &len, &tok, one, NULL), 0);
            const float *row = all + ((size_t)p * longest + t) * r.vocab;
            for (int v = 0; v < r.vocab; v++)
                if (fabsf(row[v] - one[v]) > worst) worst = fabsf(row[v] - one[v]), worst_p = p, worst_t = t;
        }
        for (size_t i = (size_t)r.lens[p] * r.vocab; i < (size_t)longest * r.vocab; i++) /* past the prompt */
            zero = fmaxf(zero, fabsf(all[(size_t)p * longest * r.vocab + i]));
    }
    /* the suite's bound: padding changes the order of fp32 sums, which can round a K or V
     * element to the neighbouring fp16 value (seen: 1.4e-5 x max|logit|) */
    EXPECT(worst <= 1e-4f * r.max_abs, "prompt %d, position %d: the prefill row differs from the cut "
           "prompt's logits by %g; allowed 1e-4 x max|logit| = %g", worst_p, worst_t, worst, 1e-4 * r.max_abs);
    CU_ASSERT_EQUAL(zero, 0);
    free(all), free(one), free(tokens);
    free_reference(&r);
}

/* Fills gb for a prefill of the given prompts, left-padded to the longest. */
static void setup_prefill(gpu_batch *gb, int *const *prompts, const int *lens, int n) {
    int padded = 0;
    for (int b = 0; b < n; b++) padded = lens[b] > padded ? lens[b] : padded;
    gb->batch = n;
    gb->n_new = padded;
    for (int b = 0; b < n; b++) {
        gb->past[b] = 0, gb->pad[b] = padded - lens[b];
        for (int t = 0; t < padded; t++)
            gb->tokens[b * padded + t] = t < gb->pad[b] ? OPT_PAD_ID : prompts[b][t - gb->pad[b]];
    }
}

/* A GPU batch whose whole cache is one array on the compute device: [layer][K, V][b][slot] rows
 * of `row` bytes, room for an fp16 row or a 4-bit one (which is longer where a head has fewer
 * values than a group). */
typedef struct {
    gpu_batch gb;
    float *x;
    char *cache;
    size_t row;
} test_batch;

static void test_batch_init(test_batch *t, const model_config *c, int batch, int max_len) {
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(gpu_batch_init(&t->gb, batch, max_len, max_len, err), 0);
    t->x = malloc((size_t)batch * max_len * c->hidden * sizeof(float));
    size_t paged = (size_t)max_len + FG_PAGE_TOKENS; /* room for the paged layout, pages of up to 16 */
    t->row = opt_kv_row_bytes(c, 1) > opt_kv_row_bytes(c, 0) ? opt_kv_row_bytes(c, 1) : opt_kv_row_bytes(c, 0);
    t->cache = malloc((size_t)c->n_layers * 2 * batch * paged * t->row);
    t->gb.x = t->x;
}

static void test_batch_free(test_batch *t) {
    gpu_batch_free(&t->gb);
    free(t->x);
    free(t->cache);
}

/* One step (prefill or decode) through every layer; advances the cache. With `pages` (not NULL),
 * sequence b's cache is the pages pages[b][0..] of each layer's K and V pool, which t->cache holds
 * in place of its rows in order ([layer][K, V][batch * max_len tokens' pages][page]). */
static void run_paged_step(const model_weights *w, test_batch *t, const int *pages, model_workspace *ws,
                           float *logits) {
    gpu_batch *gb = &t->gb;
    int page = gb->page_tokens;
    size_t rows = (size_t)gb->max_len * t->row, max_pages = (size_t)kv_pages_for(gb->max_len, page);
    opt_embed(w, gb, ws);
    for (int l = 0; l < w->cfg.n_layers; l++) {
        for (int b = 0; b < gb->batch; b++)
            for (int kv = 0; kv < 2; kv++) {
                size_t layer = ((size_t)l * 2 + kv) * gb->batch * max_pages * page * t->row;
                (kv ? gb->v : gb->k)[b] = t->cache + (pages ? layer : (((size_t)l * 2 + kv) * gb->batch + b) * rows);
                (kv ? gb->v_pages : gb->k_pages)[b] = pages ? pages + b * max_pages : NULL;
            }
        opt_layer(w, l, gb, ws);
    }
    opt_output(w, gb, ws, logits);
    gpu_batch_advance(gb);
}

static void run_step(const model_weights *w, test_batch *t, model_workspace *ws, float *logits) {
    run_paged_step(w, t, NULL, ws, logits);
}

/* Decode with the KV cache equals recomputing every sequence from scratch, step by step. */
static void test_kv_cache_equals_recompute(void) {
    reference r;
    load_reference("opt-tiny", fixture("opt-tiny"), &r);
    const model_weights *w = &r.w;
    int n = r.n, steps = 6, max_prompt = 0, V = r.vocab;
    for (int p = 0; p < n; p++) max_prompt = r.lens[p] > max_prompt ? r.lens[p] : max_prompt;
    int max_len = max_prompt + steps;
    test_batch cached, fresh;
    model_workspace ws;
    char err[FG_ERR_LEN];
    test_batch_init(&cached, &w->cfg, n, max_len);
    test_batch_init(&fresh, &w->cfg, n, max_len);
    CU_ASSERT_EQUAL_FATAL(model_workspace_init(&ws, &w->cfg, (size_t)n * max_len, max_len, max_len, err), 0);
    float *lc = malloc((size_t)n * V * sizeof(float)), *lf = malloc((size_t)n * V * sizeof(float));
    int **seqs = malloc(n * sizeof *seqs), *lens = malloc(n * sizeof *lens);
    for (int b = 0; b < n; b++) {
        seqs[b] = malloc(max_len * sizeof(int));
        memcpy(seqs[b], r.prompts[b], r.lens[b] * sizeof(int));
        lens[b] = r.lens[b];
    }
    setup_prefill(&cached.gb, seqs, lens, n);
    float worst = 0;
    for (int step = 0; step < steps; step++) {
        if (step > 0) { /* one new token per sequence */
            for (int b = 0; b < n; b++) cached.gb.tokens[b] = seqs[b][lens[b] - 1];
        }
        run_step(w, &cached, &ws, lc);
        setup_prefill(&fresh.gb, seqs, lens, n);
        run_step(w, &fresh, &ws, lf);
        for (size_t i = 0; i < (size_t)n * V; i++) worst = fmaxf(worst, fabsf(lc[i] - lf[i]));
        for (int b = 0; b < n; b++) { /* greedy next token, appended to each sequence */
            int best = 0;
            for (int v = 1; v < V; v++) best = lc[b * V + v] > lc[b * V + best] ? v : best;
            seqs[b][lens[b]++] = best;
        }
    }
    CU_ASSERT(worst <= 1e-4f * r.max_abs);
    if (worst > 1e-4f * r.max_abs) fprintf(stderr, "\n  cached vs recomputed: %g\n", worst);
    for (int b = 0; b < n; b++) free(seqs[b]);
    free(seqs);
    free(lens);
    free(lc);
    free(lf);
    test_batch_free(&cached);
    test_batch_free(&fresh);
    model_workspace_free(&ws);
    free_reference(&r);
}

/* A cache in pages (vLLM's PagedAttention) is read and written through each sequence's page
 * table: with the pages of a pool handed out in a shuffled order, every step's logits have the
 * same bits as with each sequence's rows in order, past several page boundaries: an fp16 cache
 * (decode's fast path), a 4-bit one, top-K sparse attention, and pages of 5 tokens. */
static void test_paged_cache_same_bits(void) {
    reference r;
    load_reference("opt-tiny", fixture("opt-tiny"), &r);
    const model_weights *w = &r.w;
    enum { STEPS = 2 * FG_PAGE_TOKENS + 3 };
    int n = r.n, V = r.vocab, max_prompt = 0;
    for (int p = 0; p < n; p++) max_prompt = r.lens[p] > max_prompt ? r.lens[p] : max_prompt;
    int max_len = max_prompt + STEPS, *pages = malloc((size_t)n * kv_pages_for(max_len, 5) * sizeof *pages);
    fg_rng rng;
    rng_seed(&rng, 7);
    char err[FG_ERR_LEN];
    model_workspace ws;
    CU_ASSERT_EQUAL_FATAL(model_workspace_init(&ws, &w->cfg, (size_t)n * max_len, max_len, max_len, err), 0);
    float *in_order = malloc((size_t)n * V * sizeof(float)), *paged = malloc((size_t)n * V * sizeof(float));
    for (int variant = 0; variant < 4; variant++) { /* fp16; 4-bit; sparse; pages of 5 */
        test_batch a, b;
        test_batch_init(&a, &w->cfg, n, max_len);
        test_batch_init(&b, &w->cfg, n, max_len);
        b.gb.page_tokens = variant == 3 ? 5 : FG_PAGE_TOKENS;
        int n_pages = n * kv_pages_for(max_len, b.gb.page_tokens);
        for (int i = 0; i < n_pages; i++) pages[i] = i;
        for (int i = n_pages - 1; i > 0; i--) { /* Fisher-Yates */
            int j = (int)(rng_next(&rng) % (uint64_t)(i + 1)), tmp = pages[i];
            pages[i] = pages[j], pages[j] = tmp;
        }
        a.gb.kv_q4 = b.gb.kv_q4 = variant == 1;
        a.gb.attn_sparsity = b.gb.attn_sparsity = variant == 2 ? 0.5f : 1;
        setup_prefill(&a.gb, r.prompts, r.lens, n);
        setup_prefill(&b.gb, r.prompts, r.lens, n);
        int differ = -1;
        for (int step = 0; step < STEPS && differ < 0; step++) {
            run_paged_step(w, &a, NULL, &ws, in_order);
            run_paged_step(w, &b, pages, &ws, paged);
            if (memcmp(in_order, paged, (size_t)n * V * sizeof(float))) differ = step;
            for (int s = 0; s < n; s++) { /* greedy, fed to both */
                int best = 0;
                for (int v = 1; v < V; v++) best = in_order[s * V + v] > in_order[s * V + best] ? v : best;
                a.gb.tokens[s] = b.gb.tokens[s] = best;
            }
        }
        EXPECT(differ < 0, "variant %d (fp16, 4-bit, sparse, pages of 5): step %d's logits differ between the cache "
               "in shuffled pages and in order", variant, differ);
        test_batch_free(&a);
        test_batch_free(&b);
    }
    free(in_order), free(paged), free(pages);
    model_workspace_free(&ws);
    free_reference(&r);
}

/* A thin, deep model with the dummy-weight rule of every OPT size. */
static model_config deep_config(int pre_ln) {
    model_config c = {.n_layers = 96, .hidden = 64, .n_heads = 4, .ffn = 256, .vocab = 300,
                    .max_pos = 64, .word_dim = pre_ln ? 64 : 32, .pre_ln = pre_ln};
    snprintf(c.name, sizeof c.name, "deep-%s", pre_ln ? "pre" : "post");
    return c;
}

static void generate_dummy(const model_config *c, uint64_t seed, int *tokens, float *logits) {
    int p0[] = {2, 10, 11, 12, 13, 14, 15, 16}, p1[] = {2, 99};
    int *prompts[] = {p0, p1}, lens[] = {8, 2};
    fg_policy p = fg_default_policy();
    p.gpu_batch_size = 2;
    p.num_gpu_batches = 1;
    CU_ASSERT_EQUAL(generate_with(NULL, c, seed, &p, 4, 2, prompts, lens, tokens, logits, NULL, NULL), 0);
}

/* Dummy weights keep activations finite through 96 layers and do not depend on the thread
 * count; different seeds give different weights. */
static void test_dummy_weights(void) {
    for (int pre_ln = 0; pre_ln <= 1; pre_ln++) {
        model_config c = deep_config(pre_ln);
        size_t n = (size_t)2 * 4 * c.vocab;
        float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
        int ta[8], tb[8];
        int threads = omp_get_max_threads();
        generate_dummy(&c, 7, ta, a);
        omp_set_num_threads(1);
        generate_dummy(&c, 7, tb, b);
        omp_set_num_threads(threads);
        int finite = 1;
        float spread = 0;
        for (size_t i = 0; i < n; i++) finite &= isfinite(a[i]), spread = fmaxf(spread, fabsf(a[i]));
        CU_ASSERT(finite);
        CU_ASSERT(spread > 1e-3f); /* not collapsed to zero either */
        CU_ASSERT_EQUAL(memcmp(ta, tb, sizeof ta), 0);
        generate_dummy(&c, 8, tb, b);
        CU_ASSERT(memcmp(a, b, n * sizeof *a) != 0);
        free(a);
        free(b);
    }
}

/* Every named size resolves, with the dims of the OPT paper's table; 350m is the post-LN one. */
static void test_configs(void) {
    const char *names[] = {"opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b", "opt-6.7b",
                           "opt-13b", "opt-30b", "opt-66b", "opt-175b"};
    model_config c;
    char err[FG_ERR_LEN];
    for (int i = 0; i < 9; i++) {
        CU_ASSERT_EQUAL(model_config_by_name(names[i], &c, err), 0);
        CU_ASSERT_EQUAL(c.pre_ln, i != 1);
        CU_ASSERT_EQUAL(c.hidden % c.n_heads, 0);
    }
    CU_ASSERT_EQUAL(model_config_by_name("facebook/opt-1.3b", &c, err), 0);
    CU_ASSERT_EQUAL(c.hidden, 2048);
    CU_ASSERT_EQUAL(model_config_by_name("opt-175b", &c, err), 0);
    CU_ASSERT(c.n_layers == 96 && c.hidden == 12288 && c.ffn == 49152 && c.n_heads == 96);
    /* FlexGen's model_bytes for opt-175b is 2 x 174.6e9 parameters' worth (324 GiB-ish). */
    CU_ASSERT(opt_model_bytes(&c) > 3.4e11 && opt_model_bytes(&c) < 3.6e11);
    CU_ASSERT_EQUAL(model_config_by_name("opt-7b", &c, err), -1);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "opt-7b"));
    /* opt-125m has 125.2M parameters (HF's count, lm_head tied). */
    CU_ASSERT_EQUAL(model_config_by_name("opt-125m", &c, err), 0);
    CU_ASSERT(opt_param_count(&c) > 125.0e6 && opt_param_count(&c) < 125.5e6);
}

/* Every size --model names is its model's own config.json (tests/fixtures/model-sizes: each
 * Hugging Face repository's values; OPT-175B's from the OPT paper), read by the project's
 * config.json reader and compared field by field: a wrong number in the names' table would skew
 * every plan, estimate and dummy run of that size. */
static void test_sizes_are_their_configs(void) {
    static const char *const names[] = {"opt-125m",    "opt-350m",     "opt-1.3b",     "opt-2.7b",
                                        "opt-6.7b",    "opt-13b",      "opt-30b",      "opt-66b",
                                        "opt-175b",    "llama-2-7b",   "llama-2-13b",  "llama-2-70b",
                                        "llama-3-8b",  "llama-3.2-1b", "tinyllama-1.1b",
                                        "mistral-7b",  "qwen2.5-0.5b"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char path[4200], err[FG_ERR_LEN] = "";
        snprintf(path, sizeof path, "%s/%s.json", fixture("model-sizes"), names[i]);
        model_config named, read;
        int ok = model_config_by_name(names[i], &named, err) == 0 &&
                 model_config_from_json(path, &read, err) == 0;
        EXPECT(ok, "%s: %s", names[i], err);
        char *text = ok ? slurp(path, NULL) : NULL;
        cJSON *root = text ? cJSON_Parse(text) : NULL;
        free(text);
        if (!root) continue;
        int untied = !cJSON_IsTrue(cJSON_GetObjectItem(root, "tie_word_embeddings"));
        cJSON_Delete(root);
        EXPECT(named.n_layers == read.n_layers && named.hidden == read.hidden &&
                   named.n_heads == read.n_heads && named.ffn == read.ffn &&
                   named.vocab == read.vocab && named.max_pos == read.max_pos &&
                   named.word_dim == read.word_dim && named.pre_ln == read.pre_ln &&
                   named.family == read.family,
               "%s: layers %d/%d hidden %d/%d heads %d/%d ffn %d/%d vocab %d/%d max_pos %d/%d "
               "word_dim %d/%d pre_ln %d/%d family %d/%d (named/config.json)",
               names[i], named.n_layers, read.n_layers, named.hidden, read.hidden, named.n_heads,
               read.n_heads, named.ffn, read.ffn, named.vocab, read.vocab, named.max_pos,
               read.max_pos, named.word_dim, read.word_dim, named.pre_ln, read.pre_ln,
               named.family, read.family);
        EXPECT(cfg_kv_heads(&named) == cfg_kv_heads(&read) &&
                   cfg_head_dim(&named) == cfg_head_dim(&read) && named.qkv_bias == read.qkv_bias &&
                   named.o_bias == read.o_bias && named.mlp_bias == read.mlp_bias &&
                   named.window == read.window && named.untied == untied,
               "%s: kv heads %d/%d head_dim %d/%d biases %d%d%d/%d%d%d window %d/%d untied %d/%d",
               names[i], cfg_kv_heads(&named), cfg_kv_heads(&read), cfg_head_dim(&named),
               cfg_head_dim(&read), named.qkv_bias, named.o_bias, named.mlp_bias, read.qkv_bias,
               read.o_bias, read.mlp_bias, named.window, read.window, named.untied, untied);
        if (named.family != FAMILY_LLAMA) continue; /* OPT's special ids and norms are fixed */
        EXPECT(named.rms_eps == read.rms_eps && named.rope.kind == read.rope.kind &&
                   named.rope.theta == read.rope.theta && named.rope.factor == read.rope.factor &&
                   named.rope.low_freq == read.rope.low_freq &&
                   named.rope.high_freq == read.rope.high_freq &&
                   named.rope.original_max_pos == read.rope.original_max_pos &&
                   named.bos_id == read.bos_id && named.n_eos == read.n_eos &&
                   named.eos_ids[0] == read.eos_ids[0],
               "%s: eps %g/%g rope %d/%d theta %g/%g factor %g/%g (%g %g %d)/(%g %g %d) bos %d/%d "
               "eos %d:%d/%d:%d",
               names[i], named.rms_eps, read.rms_eps, named.rope.kind, read.rope.kind,
               named.rope.theta, read.rope.theta, named.rope.factor, read.rope.factor,
               named.rope.low_freq, named.rope.high_freq, named.rope.original_max_pos,
               read.rope.low_freq, read.rope.high_freq, read.rope.original_max_pos, named.bos_id,
               read.bos_id, named.n_eos, named.eos_ids[0], read.n_eos, read.eos_ids[0]);
    }
}

static void test_sampling(void) {
    enum { N = 5 };
    float logits[N] = {0.5f, 2.0f, 1.0f, -1.0f, 1.9f}, scratch[2 * N];
    fg_rng rng;
    rng_seed(&rng, 1);
    CU_ASSERT_EQUAL(sample_token(logits, N, 0, 1, &rng, scratch), 1);    /* greedy */
    CU_ASSERT_EQUAL(sample_token(logits, N, 1, 1e-6f, &rng, scratch), 1); /* tiny nucleus */
    /* top-p 0.5 at T=1: ids 1 and 4 hold 0.39 + 0.35 of the mass, so only they are drawn. */
    int counts[N] = {0}, trials = 20000;
    for (int i = 0; i < trials; i++) counts[sample_token(logits, N, 1, 0.5f, &rng, scratch)]++;
    CU_ASSERT_EQUAL(counts[0] + counts[2] + counts[3], 0);
    /* ... in the ratio of their probabilities, renormalised: e^2 / (e^2 + e^1.9) = 0.525 (one
     * standard deviation of 20000 draws: 0.0035; a uniform draw between them would be 0.5) */
    double kept_first = (double)counts[1] / (counts[1] + counts[4]);
    EXPECT(fabs(kept_first - 1 / (1 + exp(-0.1))) < 0.015, "top-p 0.5: id 1 drawn %.4f of the kept "
           "draws, expected %.4f", kept_first, 1 / (1 + exp(-0.1)));
    /* Full softmax at T=1 and T=0.5: frequencies within 2% of the probabilities of logits / T. */
    const float temperatures[2] = {1, 0.5f};
    for (int t = 0; t < 2; t++) {
        double z = 0, p[N];
        for (int i = 0; i < N; i++) z += exp(logits[i] / temperatures[t]);
        memset(counts, 0, sizeof counts);
        for (int i = 0; i < trials; i++)
            counts[sample_token(logits, N, temperatures[t], 1, &rng, scratch)]++;
        for (int i = 0; i < N; i++) {
            p[i] = exp(logits[i] / temperatures[t]) / z;
            EXPECT(fabs((double)counts[i] / trials - p[i]) < 0.02, "T=%g: id %d drawn %.4f, expected %.4f",
                   temperatures[t], i, (double)counts[i] / trials, p[i]);
        }
    }
    /* Same seed, same draws. */
    fg_rng a, b;
    rng_seed(&a, 42);
    rng_seed(&b, 42);
    for (int i = 0; i < 100; i++)
        CU_ASSERT_EQUAL(sample_token(logits, N, 0.7f, 0.9f, &a, scratch),
                        sample_token(logits, N, 0.7f, 0.9f, &b, scratch));
}

/* Greedy decoding takes the first of equal largest logits, as torch.argmax does (and so does
 * perplexity's top-1 prediction: both call fg_argmax). */
static void test_greedy_ties(void) {
    static const struct { int n, want; float logits[6]; } cases[] = {
        {6, 1, {1, 4, -2, 4, 0, 4}}, {4, 0, {0.5f, 0.5f, 0.5f, 0.5f}}, {3, 0, {7, 7, 1}},
        {5, 2, {-3, -3, -1, -2, -1}},
    };
    float scratch[12];
    fg_rng rng;
    rng_seed(&rng, 1);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int got = sample_token(cases[i].logits, cases[i].n, 0, 1, &rng, scratch);
        EXPECT(got == cases[i].want && fg_argmax(cases[i].logits, cases[i].n) == cases[i].want, "greedy over "
               "tied logits (case %zu): expected the first largest, id %d, got id %d (fg_argmax: %d)", i,
               cases[i].want, got, fg_argmax(cases[i].logits, cases[i].n));
    }
}

/* The nucleus holds the tokens HF's warpers leave a draw to (tests/fixtures/sampling/top_p.json,
 * scripts/make_sampling_fixture.py: TemperatureLogitsWarper then TopPLogitsWarper), tied
 * probabilities at its edge included: there HF keeps the larger ids. */
static void test_top_p_as_hf(void) {
    char *text = slurp(fixture("sampling/top_p.json"), NULL);
    cJSON *fixture_json = cJSON_Parse(text), *c;
    CU_ASSERT_PTR_NOT_NULL_FATAL(fixture_json);
    int checked = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(fixture_json, "cases")) {
        float logits[16], scratch[32], mass;
        int n = 0, want[16], n_want = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, cJSON_GetObjectItemCaseSensitive(c, "logits")) logits[n++] = (float)v->valuedouble;
        cJSON_ArrayForEach(v, cJSON_GetObjectItemCaseSensitive(c, "kept")) want[n_want++] = v->valueint;
        float t = (float)cJSON_GetObjectItemCaseSensitive(c, "temperature")->valuedouble;
        float p = (float)cJSON_GetObjectItemCaseSensitive(c, "top_p")->valuedouble;
        int keep = sample_nucleus(logits, n, t, p, scratch, &mass), kept[16] = {0}, same = keep == n_want;
        for (int i = 0; i < keep; i++) {
            int id;
            memcpy(&id, &scratch[2 * i + 1], sizeof id);
            kept[id] = 1;
        }
        for (int i = 0; i < n_want; i++) same = same && kept[want[i]];
        char logits_text[200] = "";
        for (int i = 0; i < n; i++)
            snprintf(logits_text + strlen(logits_text), sizeof logits_text - strlen(logits_text), " %g", logits[i]);
        EXPECT(same, "logits [%s ], T %g, top-p %g: %d tokens kept, HF keeps %d (ids %d%s)", logits_text, t, p, keep,
               n_want, want[0], n_want > 1 ? " ..." : "");
        checked++;
    }
    CU_ASSERT(checked > 50);
    cJSON_Delete(fixture_json);
    free(text);
}

/* Temperature divides the logits: over many seeds, the frequencies at T = 0.3 and T = 2.5 are
 * those of softmax(logits / T), within five standard deviations of the draws' count. */
static void test_sampling_temperature(void) {
    enum { N = 5, TRIALS = 20000 };
    const float logits[N] = {0.5f, 2.0f, 1.0f, -1.0f, 1.9f}, temps[2] = {0.3f, 2.5f};
    float scratch[2 * N];
    for (int k = 0; k < 2; k++) {
        int counts[N] = {0};
        for (int i = 0; i < TRIALS; i++) {
            fg_rng rng;
            rng_seed(&rng, 1000 + (uint64_t)i);
            counts[sample_token(logits, N, temps[k], 1, &rng, scratch)]++;
        }
        double z = 0, p[N];
        for (int i = 0; i < N; i++) z += p[i] = exp(logits[i] / temps[k]);
        for (int i = 0; i < N; i++) {
            p[i] /= z;
            double f = (double)counts[i] / TRIALS, bound = 5 * sqrt(p[i] * (1 - p[i]) / TRIALS) + 1e-3;
            EXPECT(fabs(f - p[i]) < bound, "T = %g, id %d: drawn with frequency %.4f, softmax(logits / T) "
                   "gives %.4f (allowed %.4f)", temps[k], i, f, p[i], bound);
        }
    }
}

/* Scores near 1000 overflow expf unless softmax subtracts the row's largest score first: the
 * attention weights must stay finite and sum to 1, in prefill (many queries) and in decode (one,
 * on the fp16 fast path and, with sparsity, through opt_attend_decode). One head of 8; the keys
 * are (1, 0.999, 0.998) along dim 0 and the values one-hot, so the output is the weights. */
static void check_large_scores(float sparsity) {
    const model_config c = OPT_SHAPE("scores", 1, 8, 1, 16, 8, 16, 8, 1);
    enum { H = 8, MAX_LEN = 4 };
    char err[FG_ERR_LEN];
    gpu_batch gb;
    model_workspace ws;
    CU_ASSERT_EQUAL_FATAL(gpu_batch_init(&gb, 1, MAX_LEN, 2, err), 0);
    CU_ASSERT_EQUAL_FATAL(model_workspace_init(&ws, &c, 2, 1, MAX_LEN, err), 0);
    fp16 kc[MAX_LEN * H], vc[MAX_LEN * H];
    gb.k[0] = kc, gb.v[0] = vc;
    gb.attn_sparsity = sparsity;
    const float a = 2829.0f, keys[3] = {1.0f, 0.999f, 0.998f}; /* a / sqrt(8) x key: ~1000 */
    for (int step = 0; step < 2; step++) { /* prefill of two tokens, then the third decodes */
        gb.past[0] = step ? 2 : 0, gb.n_new = step ? 1 : 2;
        memset(ws.qkv, 0, (size_t)2 * 3 * H * sizeof(float));
        for (int t = 0; t < gb.n_new; t++) {
            float *row = ws.qkv + (size_t)t * 3 * H; /* q | k | v */
            int slot = gb.past[0] + t;
            row[0] = a;
            row[H] = keys[slot];
            row[2 * H + slot] = 1;
        }
        opt_cache_attention(&c, &gb, &ws);
        const float *out = ws.attn + (size_t)(gb.n_new - 1) * H; /* the last query's output */
        int n = gb.past[0] + gb.n_new, finite = 1;
        double sum = 0;
        for (int d = 0; d < n; d++) finite &= isfinite(out[d]), sum += out[d];
        /* sparse decode drops a key and, as FlexGen, does not renormalize: the kept weights of a
         * softmax, so at most 1 */
        int ok = finite && (sparsity < 1 && step ? sum <= 1 + 1e-5 && sum > 0.5 : fabs(sum - 1) < 1e-5);
        EXPECT(ok, "%s%s, scores near 1000: attention weights %g %g %g: expected finite, summing to 1 "
               "(softmax must subtract the largest score)",
               step ? "decode" : "prefill", sparsity < 1 ? " (sparse)" : "", out[0], out[1],
               n > 2 ? out[2] : 0.0f);
        EXPECT(out[0] > out[1], "%s, scores near 1000: the larger score must weigh more: %g, %g",
               step ? "decode" : "prefill", out[0], out[1]);
    }
    model_workspace_free(&ws);
    gpu_batch_free(&gb);
}

static void test_large_scores(void) {
    check_large_scores(1);
    check_large_scores(0.99f);
}

/* support/simd.c's twins of decode attention's two loops over an fp16 cache, where this CPU runs
 * them: bit for bit the arithmetic they stand in for (opt_model.c's dot8_fma: 8 lanes of fmaf in
 * order, added pairwise as a halving reduction; one fmaf per value of out and row, rows in order),
 * at head sizes 8 to 128 (out in blocks of 32 and the rest) and key counts around four a pass,
 * rows a gap apart. Under FLEXGEN_ISA=portable there are no twins to hold. */
static void test_attention_twins(void) {
    const fg_simd *simd = fg_simd_kernels();
    if (!simd->dot_f16_rows || !simd->axpy_f16_rows) {
        printf("\n  skipped: this path (%s) has no twins of decode attention's loops\n",
               fg_isa_active() == FG_ISA_PORTABLE ? "FLEXGEN_ISA=portable" : "no AVX2");
        return;
    }
    static const int hds[] = {8, 16, 40, 64, 128}, nks[] = {1, 3, 4, 5, 9, 37};
    uint64_t seed = 167;
    for (size_t h = 0; h < sizeof hds / sizeof *hds; h++)
        for (size_t c = 0; c < sizeof nks / sizeof *nks; c++) {
            int hd = hds[h], nk = nks[c];
            size_t stride = (size_t)hd + 8;
            fp16 *rows = malloc((size_t)nk * stride * sizeof *rows);
            float *q = malloc((size_t)hd * sizeof *q), *p = malloc((size_t)nk * sizeof *p);
            float *scores = malloc((size_t)nk * sizeof *scores), *want = malloc((size_t)hd * sizeof *want);
            float *out = malloc((size_t)hd * sizeof *out);
            for (size_t e = 0; e < (size_t)nk * stride; e++) rows[e] = fp32_to_fp16(4 * test_uniform(&seed) - 2);
            for (int d = 0; d < hd; d++) q[d] = 2 * test_uniform(&seed) - 1;
            for (int j = 0; j < nk; j++) p[j] = test_uniform(&seed);
            simd->dot_f16_rows(q, rows, stride, nk, hd, 0.125f, scores, rows, nk);
            int differ = 0;
            for (int j = 0; j < nk; j++) {
                float lane[8] = {0};
                for (int d = 0; d < hd; d++)
                    lane[d % 8] = fmaf(q[d], fp16_to_fp32(rows[(size_t)j * stride + d]), lane[d % 8]);
                float dot = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
                float expect = dot * 0.125f;
                differ += memcmp(&expect, &scores[j], sizeof expect) != 0;
            }
            for (int d = 0; d < hd; d++) out[d] = want[d] = test_uniform(&seed) - 0.5f;
            simd->axpy_f16_rows(p, rows, stride, nk, hd, out, rows, nk);
            for (int j = 0; j < nk; j++)
                for (int d = 0; d < hd; d++) want[d] = fmaf(p[j], fp16_to_fp32(rows[(size_t)j * stride + d]), want[d]);
            EXPECT(differ == 0 && !memcmp(out, want, (size_t)hd * sizeof *out), "decode attention's AVX2 twins, head "
                   "size %d, %d keys: %d scores differ from dot8_fma's arithmetic, out %s", hd, nk, differ,
                   memcmp(out, want, (size_t)hd * sizeof *out) ? "differs from one fmaf per value and row" : "equal");
            free(rows), free(q), free(p), free(scores), free(want), free(out);
        }
}

void add_model_tests(void) {
    CU_pSuite s = CU_add_suite("model", NULL, NULL);
    CU_add_test(s, "decode attention's AVX2 twins: the plain loops' bits, head sizes 8 to 128", test_attention_twins);
    CU_add_test(s, "pre-LN fp16 checkpoint matches HF transformers", test_reference_pre_ln_fp16);
    CU_add_test(s, "350m-style post-LN fp32 sharded checkpoint matches HF",
                test_reference_350m_fp32_sharded);
    CU_add_test(s, "bf16 checkpoint matches HF", test_reference_bf16);
    CU_add_test(s, "checkpoint with a tokenizer matches HF", test_reference_text);
    CU_add_test(s, "20 layers, words wider than the hidden states: matches HF", test_reference_deep);
    CU_add_test(s, "activations with outlier dimensions (24 to 56x the rest): matches HF", test_reference_outlier);
    CU_add_test(s, "the trained checkpoint (models/opt-kjv) matches HF", test_reference_trained);
    CU_add_test(s, "the trained LLaMA (models/llama-kjv, GQA 2) matches HF", test_reference_trained_llama);
    CU_add_test(s, "LLaMA, 2 heads of 64, rope_theta 1e4, fp16, untied, matches HF", test_llama_mha);
    CU_add_test(s, "LLaMA, GQA 2, llama3 rope_scaling, theta 5e5, bf16, tied, matches HF", test_llama_gqa2_llama3);
    CU_add_test(s, "LLaMA, GQA 4, linear rope_scaling, fp32 sharded, matches HF", test_llama_gqa4_linear);
    CU_add_test(s, "LLaMA, MQA (8 heads, 1 K/V head) of dim 24, attention and MLP biases, matches HF",
                test_llama_mqa_bias);
    CU_add_test(s, "Mistral, GQA 8 (16 heads, 2 K/V heads), theta 1e6, matches HF", test_mistral_gqa8);
    CU_add_test(s, "Qwen2, one head of 128, q/k/v biases, bf16, tied, matches HF", test_qwen2);
    CU_add_test(s, "teacher forcing: the given tokens, the logits of greedy decoding", test_teacher_forcing);
    CU_add_test(s, "stop_at_eos: the returned tokens are padding after the first EOS", test_stop_at_eos_pads_tokens);
    CU_add_test(s, "prefill's logits at every position: those of each cut prompt", test_prompt_logits);
    CU_add_test(s, "KV-cache decode equals full recomputation", test_kv_cache_equals_recompute);
    CU_add_test(s, "a cache in shuffled pages gives the bits of rows in order", test_paged_cache_same_bits);
    CU_add_test(s, "dummy weights: finite, seeded, thread-independent", test_dummy_weights);
    CU_add_test(s, "every OPT size by name", test_configs);
    CU_add_test(s, "every named size is its model's config.json, field by field",
                test_sizes_are_their_configs);
    CU_add_test(s, "greedy, temperature and top-p sampling", test_sampling);
    CU_add_test(s, "greedy takes the first of tied logits", test_greedy_ties);
    CU_add_test(s, "top-p keeps the tokens HF keeps, ties at its edge too", test_top_p_as_hf);
    CU_add_test(s, "temperature divides the logits (T = 0.3, 2.5)", test_sampling_temperature);
    CU_add_test(s, "softmax of scores near 1000: finite weights summing to 1", test_large_scores);
}
