/* app/perplexity.c: how well a model predicts a text, through the same runtime, placements and
 * approximations as generation: the measure of the paper's §6.2 (Table 6's WikiText column),
 * with which the 4-bit weights and cache and the sparse attention of §5 are judged.
 *
 * A model sees at most `window` tokens at once, so a long text is scored in windows that
 * overlap (the usual recipe for models of fixed length): window w covers tokens
 * [begin, begin + window), the next begins `stride` later, and each scores only the tokens no
 * earlier window scored, so every token after the first is scored once, with at least
 * window - stride tokens of context after the first window.
 *
 *   prefill   each window is a prompt; prefill's logits at position t predict token t + 1
 *             (the output layer keeps every position: gen_options.prompt_logits)
 *   decode    the window's unscored head is the prompt, and its scored tokens go through the
 *             decode steps one at a time, each step fed the text's own next token instead of a
 *             sampled one (gen_options.forced). This is how generation reads the KV cache: a
 *             4-bit cache and sparse attention change these numbers, where prefill, which
 *             attends to the fresh keys and values, is unaffected by them.
 *
 * perplexity = exp(-(1/N) sum log p(token | the tokens before it in its window)), N scored.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int begin, first, end; /* the window's tokens [begin, end); it scores [first, end) */
} window;

/* The windows over n tokens. */
static window *plan_windows(int n, int size, int stride, int *count) {
    window *w = malloc(((size_t)n / (size_t)stride + 2) * sizeof *w);
    if (!w) return NULL;
    int k = 0;
    for (int begin = 0, scored_to = 1;; begin += stride) {
        int end = n - begin < size ? n : begin + size;
        w[k++] = (window){begin, scored_to, end};
        scored_to = end;
        if (end == n) break;
    }
    *count = k;
    return w;
}

/* log softmax(row)[target], and the row's argmax (greedy decoding's: the first of equal maxima). */
static double log_prob(const float *row, int vocab, int target, int *argmax) {
    int best = fg_argmax(row, vocab);
    double sum = 0;
    for (int i = 0; i < vocab; i++) sum += exp((double)row[i] - row[best]);
    *argmax = best;
    return (double)row[target] - row[best] - log(sum);
}

/* Scores the targets [first, end) of ids from logits rows, row r predicting first + r. */
static void score(const float *rows, int vocab, const int *ids, int first, int end, ppl_result *r,
                  int *top1) {
    for (int t = first; t < end; t++) {
        int argmax;
        r->nll -= log_prob(rows + (size_t)(t - first) * vocab, vocab, ids[t], &argmax);
        if (top1) top1[t - 1] = argmax;
        r->scored++;
    }
}

/* Windows [from, to) as one generate() call. Prefill: each window is a prompt, gen_len 1.
 * Decode: the windows share the split (head, scored); the head is the prompt and the scored
 * tokens are forced. */
static int run_windows(fg_model *m, const int *ids, const window *w, int from, int to, int decode,
                       ppl_result *r, int *top1, char *err) {
    int n = to - from, vocab = m->view.cfg.vocab, longest = 0;
    int gen_len = decode ? w[from].end - w[from].first : 1;
    const int **prompts = malloc((size_t)n * sizeof *prompts);
    int *lens = malloc((size_t)n * sizeof *lens), *out = malloc((size_t)n * gen_len * sizeof *out);
    int *forced = decode ? malloc((size_t)n * gen_len * sizeof *forced) : NULL;
    for (int i = 0; lens && i < n; i++) {
        const window *v = &w[from + i];
        lens[i] = decode ? v->first - v->begin : v->end - v->begin;
        longest = lens[i] > longest ? lens[i] : longest;
    }
    size_t rows = decode ? (size_t)n * gen_len : (size_t)n * longest;
    float *logits = malloc(rows * vocab * sizeof *logits);
    int rc = 0;
    if (!prompts || !lens || !out || (decode && !forced) || !logits) {
        rc = fg_fail(err, "out of memory for %d windows' logits (%.1f GiB)", n,
                     (double)rows * vocab * sizeof(float) / (1 << 30));
    } else {
        for (int i = 0; i < n; i++) {
            prompts[i] = ids + w[from + i].begin;
            if (decode)
                memcpy(forced + (size_t)i * gen_len, ids + w[from + i].first,
                       (size_t)gen_len * sizeof *forced);
        }
        gen_options opt = {
            .gen_len = gen_len, .forced = forced, .prompt_logits = decode ? NULL : logits};
        gen_timing timing;
        rc = generate(m, &opt, n, (int *const *)prompts, lens, out, decode ? logits : NULL, &timing,
                      err);
        for (int i = 0; rc == 0 && i < n; i++) {
            const window *v = &w[from + i];
            /* decode: step j's logits predict first + j; prefill: position t's predict t + 1 */
            const float *head =
                decode ? logits + (size_t)i * gen_len * vocab
                       : logits + ((size_t)i * longest + (v->first - 1 - v->begin)) * vocab;
            score(head, vocab, ids, v->first, v->end, r, top1);
        }
    }
    free(prompts);
    free(lens);
    free(out);
    free(forced);
    free(logits);
    return rc;
}

int fg_perplexity(fg_model *m, const int *ids, int n, const ppl_options *o, int *top1,
                  ppl_result *r, char *err) {
    const model_config *c = &m->view.cfg;
    memset(r, 0, sizeof *r);
    /* A sliding window (Mistral) bounds what a sequence may span here (check_prompt says why) */
    int positions = c->window && c->window < c->max_pos ? c->window : c->max_pos;
    int size = o->window ? o->window : positions, stride = o->stride ? o->stride : size / 2;
    if (n < 2)
        return fg_fail(err, "--text: the text has %d token%s: perplexity needs at least 2", n,
                       n == 1 ? "" : "s");
    if (size < 2 || size > positions)
        return fg_fail(err, "--window %d: expected 2 .. the model's %d positions%s", size,
                       positions,
                       positions < c->max_pos ? " (its sliding_window; sliding-window attention "
                                                "is not implemented)"
                                              : "");
    if (stride < 1 || stride > size - 1)
        return fg_fail(err, "--stride %d: expected 1 .. --window - 1 (%d)", stride, size - 1);
    int count;
    window *w = plan_windows(n, size, stride, &count);
    if (!w) return fg_fail(err, "out of memory");
    /* A call takes a block of windows (fewer when their logits would pass 1 GiB) that share
     * one shape in decode: all but the first and the last do. */
    const fg_policy *p = &m->rt->policy;
    size_t per_window = (size_t)size * c->vocab * sizeof(float);
    size_t fit = ((size_t)1 << 30) / per_window;
    int block = p->gpu_batch_size * p->num_gpu_batches, rc = 0;
    int cap = fit < (size_t)block ? (fit > 0 ? (int)fit : 1) : block;
    double start = now_seconds();
    for (int from = 0, to; rc == 0 && from < count; from = to) {
        to = from + 1;
        while (to < count && to - from < cap &&
               (!o->decode || (w[to].first - w[to].begin == w[from].first - w[from].begin &&
                               w[to].end - w[to].first == w[from].end - w[from].first)))
            to++;
        rc = run_windows(m, ids, w, from, to, o->decode, r, top1, err);
        if (o->verbose) fprintf(stderr, "\rperplexity: window %d/%d", to, count);
    }
    if (o->verbose) fprintf(stderr, "\n");
    r->windows = count;
    r->window = size;
    r->stride = stride;
    r->seconds = now_seconds() - start;
    r->perplexity = exp(r->nll / (double)r->scored);
    free(w);
    return rc;
}
