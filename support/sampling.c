/* support/sampling.c: the tokens generate() takes and gives: the prompts and forced tokens
 * checked against the model, and the next token chosen from a row of logits (greedy,
 * temperature and top-p) with a small generator, which flexgen.c's sample_tokens seeds per
 * (prompt, step) for each sequence of a block as its step ends.
 */
#include "support/support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void rng_seed(fg_rng *r, uint64_t seed) {
    r->s[0] = fg_mix64(seed + 0x9e3779b97f4a7c15ULL);
    r->s[1] = fg_mix64(r->s[0] ^ 0x2545f4914f6cdd1dULL) | 1;
}

uint64_t rng_next(fg_rng *r) { /* xorshift128+ */
    uint64_t s1 = r->s[0];
    const uint64_t s0 = r->s[1];
    r->s[0] = s0;
    s1 ^= s1 << 23;
    r->s[1] = s1 ^ s0 ^ (s1 >> 17) ^ (s0 >> 26);
    return r->s[1] + s0;
}

/* [0, 1) */
static float rng_uniform(fg_rng *r) { return (float)(rng_next(r) >> 40) / 16777216.0f; }

int fg_argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* By probability, the largest first; among equal ones the larger id first, which is the order
 * HF's TopPLogitsWarper keeps them in at the nucleus's edge (it sorts ascending, equal scores in id
 * order, and drops from the front). */
static int cmp_prob_desc(const void *a, const void *b) {
    float x = ((const float *)a)[0], y = ((const float *)b)[0];
    if (x != y) return (x < y) - (x > y);
    int i, j;
    memcpy(&i, (const float *)a + 1, sizeof i);
    memcpy(&j, (const float *)b + 1, sizeof j);
    return (i < j) - (i > j);
}

int sample_nucleus(const float *logits, int n, float temperature, float top_p, float *scratch,
                   float *mass) {
    float m = logits[fg_argmax(logits, n)], sum = 0;
    for (int i = 0; i < n; i++) {
        scratch[2 * i] = expf((logits[i] - m) / temperature);
        memcpy(&scratch[2 * i + 1], &i, sizeof i);
        sum += scratch[2 * i];
    }
    int keep = n;
    if (top_p < 1.0f) {
        qsort(scratch, (size_t)n, 2 * sizeof(float), cmp_prob_desc);
        float cum = 0;
        for (keep = 0; keep < n && cum < top_p * sum; keep++) cum += scratch[2 * keep];
        sum = cum;
    }
    *mass = sum;
    return keep;
}

int sample_token(const float *logits, int n, float temperature, float top_p, fg_rng *rng,
                 float *scratch) {
    if (temperature <= 0) return fg_argmax(logits, n);
    float sum;
    int keep = sample_nucleus(logits, n, temperature, top_p, scratch, &sum);
    float u = rng_uniform(rng) * sum, acc = 0;
    int id = 0;
    for (int i = 0; i < keep; i++) {
        memcpy(&id, &scratch[2 * i + 1], sizeof id);
        acc += scratch[2 * i];
        if (acc > u) break;
    }
    return id;
}

int check_prompt(const model_config *c, const int *ids, int len, int gen_len, const char *name,
                 char *err) {
    if (len < 1) return fg_fail(err, "%s is empty", name);
    if (gen_len - 1 > c->max_pos - len) /* the last token is not fed back; the sum of len and
                                           gen_len may not fit an int */
        return fg_fail(err,
                       "%s: %d tokens + --gen-len %d need %lld positions (the last one generated "
                       "is not fed back); the model has %d (max_position_embeddings)",
                       name, len, gen_len, (long long)len + gen_len - 1, c->max_pos);
    if (c->window && gen_len - 1 > c->window - len)
        return fg_fail(err,
                       "%s: %d tokens + --gen-len %d need %lld positions, beyond the model's "
                       "sliding_window %d (sliding-window attention is not implemented)",
                       name, len, gen_len, (long long)len + gen_len - 1, c->window);
    for (int t = 0; t < len; t++)
        if (ids[t] < 0 || ids[t] >= c->vocab)
            return fg_fail(err, "%s: token id %d out of range [0, %d) (the model's vocab_size)",
                           name, ids[t], c->vocab);
    return 0;
}

int check_prompts(const model_config *c, int n, int *const *prompts, const int *lens, int gen_len,
                  char *err) {
    if (n < 1) return fg_fail(err, "no prompts");
    for (int p = 0; p < n; p++) {
        char name[32];
        snprintf(name, sizeof name, "prompt %d", p + 1);
        if (check_prompt(c, prompts[p], lens[p], gen_len, name, err)) return -1;
    }
    return 0;
}

/* Teacher forcing feeds only ids of the vocab. */
int check_forced(const model_config *c, const int *forced, int n_prompts, int gen_len, char *err) {
    for (int p = 0; p < n_prompts; p++)
        for (int i = 0; i < gen_len; i++) {
            int id = forced[(size_t)p * gen_len + i];
            if (id < 0 || id >= c->vocab)
                return fg_fail(err, "prompt %d: forced token %d is id %d, out of range [0, %d)",
                               p + 1, i + 1, id, c->vocab);
        }
    return 0;
}
