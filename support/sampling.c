/* support/sampling.c: the tokens generate() takes and gives: the prompts and forced tokens
 * checked against the model, and the next token chosen from the logits (greedy, temperature and
 * top-p) with a small generator that sample_tokens (below) seeds per (prompt, step), for each
 * sequence of a block as its step ends.
 */
#include "flexgen.h"
#include "support/support.h"

#include <math.h>
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

float rng_uniform(fg_rng *r) { return (float)(rng_next(r) >> 40) / 16777216.0f; }

int fg_argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int cmp_prob_desc(const void *a, const void *b) {
    float x = ((const float *)a)[0], y = ((const float *)b)[0];
    return (x < y) - (x > y);
}

int sample_token(const float *logits, int n, float temperature, float top_p, fg_rng *rng,
                 float *scratch) {
    if (temperature <= 0) return fg_argmax(logits, n);
    /* scratch holds (probability, id) pairs, sorted by probability for the nucleus. */
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
    float u = rng_uniform(rng) * sum, acc = 0;
    int id = 0;
    for (int i = 0; i < keep; i++) {
        memcpy(&id, &scratch[2 * i + 1], sizeof id);
        acc += scratch[2 * i];
        if (acc > u) break;
    }
    return id;
}

int check_prompts(const opt_config *c, int n, int *const *prompts, const int *lens, int gen_len,
                  char *err) {
    if (n < 1) return fg_fail(err, "no prompts");
    for (int p = 0; p < n; p++) {
        if (lens[p] < 1) return fg_fail(err, "prompt %d is empty", p + 1);
        if (gen_len - 1 > c->max_pos - lens[p]) /* the last token is not fed back; the sum of
                                                   lens[p] and gen_len may not fit an int */
            return fg_fail(err, "prompt %d: %d tokens + --gen-len %d need %lld positions (the last one generated "
                           "is not fed back); the model has %d (max_position_embeddings)", p + 1, lens[p], gen_len,
                           (long long)lens[p] + gen_len - 1, c->max_pos);
        if (c->window && gen_len - 1 > c->window - lens[p])
            return fg_fail(err, "prompt %d: %d tokens + --gen-len %d need %lld positions, beyond the model's "
                           "sliding_window %d (sliding-window attention is not implemented)", p + 1, lens[p],
                           gen_len, (long long)lens[p] + gen_len - 1, c->window);
        for (int t = 0; t < lens[p]; t++)
            if (prompts[p][t] < 0 || prompts[p][t] >= c->vocab)
                return fg_fail(err, "prompt %d: token id %d out of range [0, %d) (the model's vocab_size)",
                               p + 1, prompts[p][t], c->vocab);
    }
    return 0;
}

/* Teacher forcing feeds only ids of the vocab. */
int check_forced(const opt_config *c, const int *forced, int n_prompts, int gen_len, char *err) {
    for (int p = 0; p < n_prompts; p++)
        for (int i = 0; i < gen_len; i++) {
            int id = forced[(size_t)p * gen_len + i];
            if (id < 0 || id >= c->vocab)
                return fg_fail(err, "prompt %d: forced token %d is id %d, out of range [0, %d)", p + 1,
                               i + 1, id, c->vocab);
        }
    return 0;
}

/* ---- A block's tokens, as its step ends ---- */

/* The logits of sequence s's last token, and of its token t (with prompt_logits, at prefill). */
static const float *logits_row(const block *bl, int s, int t) {
    size_t batch_rows = (size_t)bl->s.gbs * bl->s.logit_rows, row = (size_t)(s % bl->s.gbs) * bl->out_rows + t;
    return bl->host_logits + ((size_t)(s / bl->s.gbs) * batch_rows + row) * bl->m->view.cfg.vocab;
}

/* Prefill's logits of every position of each prompt (its padding left out), in prompt order. */
static void keep_prompt_logits(const block *bl, const gen_options *opt) {
    int vocab = bl->m->view.cfg.vocab, longest = bl->s.max_prompt;
    for (int s = 0; s < bl->count; s++) {
        int pad = bl->gb[s / bl->s.gbs].pad[s % bl->s.gbs], len = bl->out_rows - pad;
        memcpy(opt->prompt_logits + (size_t)bl->prompt[s] * longest * vocab, logits_row(bl, s, pad),
               (size_t)len * vocab * sizeof(float));
    }
}

/* The last stage chooses each sequence's next token from its logits (into bl->ids), keeping
 * the logits of sequences still running; with teacher forcing the next token is given.
 * Sampling draws from a generator seeded by (seed, prompt, step), so the tokens do not depend
 * on the block shape, the number of stages or the slot a refill gave the prompt. */
void sample_tokens(block *bl, const gen_options *opt, float *logits_out, float *scratch) {
    int vocab = bl->m->view.cfg.vocab;
    size_t rows = bl->s.logit_rows == 1 ? (size_t)bl->count : (size_t)bl->n_batches * bl->s.gbs * bl->s.logit_rows;
    bl->rt->backend->copy_out(bl->host_logits, bl->logits, rows * vocab * sizeof(float));
    bl->rt->backend->copies_done(); /* a decode step's one wait on the device, on a GPU */
    if (opt->prompt_logits && bl->step[0] == 0) keep_prompt_logits(bl, opt);
    for (int s = 0; s < bl->count; s++) {
        const float *row = logits_row(bl, s, bl->out_rows - 1);
        int p = bl->prompt[s], step = bl->step[s];
        if (p < 0) continue; /* an idle slot */
        if (logits_out && !bl->done[s])
            memcpy(logits_out + ((size_t)p * opt->gen_len + step) * vocab, row, vocab * sizeof(float));
        if (opt->forced) {
            bl->ids[s] = opt->forced[(size_t)p * opt->gen_len + step];
            continue;
        }
        fg_rng rng;
        uint64_t place = opt->index ? (uint64_t)opt->index[p] : (uint64_t)p; /* in the job */
        rng_seed(&rng, opt->seed ^ ((place << 24) + (uint64_t)step) * 0x9e3779b97f4a7c15ULL);
        bl->ids[s] = sample_token(row, vocab, opt->temperature, opt->top_p, &rng, scratch);
    }
}

int gen_is_eos(const gen_options *opt, int tok) {
    if (opt->n_eos == 0) return tok == OPT_EOS_ID;
    for (int i = 0; i < opt->n_eos; i++)
        if (tok == opt->eos_ids[i]) return 1;
    return 0;
}

int take_tokens(block *bl, const gen_options *opt, int *out_tokens) {
    int running = 0;
    for (int s = 0; s < bl->count; s++) {
        int tok = bl->ids[s];
        if (bl->prompt[s] < 0) continue;
        out_tokens[(size_t)bl->prompt[s] * opt->gen_len + bl->step[s]++] = bl->done[s] ? OPT_PAD_ID : tok;
        if (opt->stop_at_eos && gen_is_eos(opt, tok)) bl->done[s] = 1;
        running += slot_running(bl, s, opt->gen_len);
        bl->gb[s / bl->s.gbs].tokens[s % bl->s.gbs] = tok;
    }
    return running;
}
