/* support/kv_pages.c: the KV cache in pages, in the manner of vLLM's PagedAttention. A block's
 * cache on each tier is a pool of pages of page_tokens tokens; a sequence takes pages from its
 * slot's tier as it grows, and gives them back when it ends, so that a refill can reuse them. A
 * page id addresses the same tokens in every layer's K and V (flexgen.c's kv_pool lays them out),
 * so one page table serves them all.
 *
 * The pools are sized by the pages the job's prompts need (kv_pool_shape), not by the longest
 * prompt for every slot: that is what the plan check counts.
 */
#include "support/support.h"

#include <stdlib.h>
#include <string.h>

/* A row of the cache holds a token's keys (or values) for every head, so one head's keys lie a
 * row apart (kilobytes), each in a 4 KiB page of its own, and the hardware's prefetchers, which
 * follow runs inside a page, fetch none of them ahead: each waited a trip to memory. So decode
 * attention (opt_model.c's attend_one) reads a head's keys a run at a time, and its loops ask for
 * the next run's rows (support/simd.c's fg_prefetch_ahead) as they read this one's. */
enum { KV_RUN = 16 };

/* Keys [j, j + n) of one head: as many as lie in order from j (to the end of j's page), at most
 * KV_RUN; none (n = 0) from nk on. */
const fp16 *kv_head_run(const opt_kv_rows *r, int j, int nk, int *n) {
    if (j >= nk) {
        *n = 0;
        return NULL;
    }
    int end = r->pages ? (j / r->page_tokens + 1) * r->page_tokens : nk;
    end = end < nk ? end : nk;
    *n = (end < j + KV_RUN ? end : j + KV_RUN) - j;
    return (const fp16 *)(r->rows + kv_page_row(r->pages, r->page_tokens, j) * r->stride) +
           (size_t)r->head * r->head_dim;
}

/* Sequence b of a GPU batch: gpu first, then cpu, then disk. */
fg_tier tier_of(const row_split *s, int b) {
    return b < s->rows[TIER_GPU]                       ? TIER_GPU
           : b < s->rows[TIER_GPU] + s->rows[TIER_CPU] ? TIER_CPU
                                                       : TIER_DISK;
}

/* The pages of `page` tokens each tier's pool needs for a job of n prompts run in blocks of
 * `slots` slots (GPU batches of gbs), prompt i of a block in slot i: the most any block's
 * sequences on that tier hold at their longest (prompt + gen_len), and at least one such sequence
 * of the longest prompt, which a refill may place in any slot. lens NULL: every prompt
 * max_len - gen_len long. */
static void pool_pages(const row_split *cache, int gbs, int slots, int max_len, int page, int n,
                       const int *lens, int gen_len, int pages[N_TIERS]) {
    int longest = kv_pages_for(max_len, page);
    for (int t = 0; t < N_TIERS; t++) pages[t] = cache->rows[t] > 0 ? longest : 0;
    for (int first = 0; first < n; first += slots) {
        int sum[N_TIERS] = {0};
        for (int i = first; i < n && i < first + slots; i++)
            sum[tier_of(cache, i % gbs)] +=
                kv_pages_for((lens ? lens[i] + gen_len : max_len), page);
        for (int t = 0; t < N_TIERS; t++) pages[t] = sum[t] > pages[t] ? sum[t] : pages[t];
    }
}

/* The same for the diagonal schedule: the prompts stream through the `blocks` blocks' (a
 * pipeline stage's micro-batches; one in one process) `slots / gbs` GPU batches each, which
 * start at their steps of the staircase (starts) and take the next prompts as their sequences end
 * (gen_len steps later), block by block at each step as the schedule walks them; so at each step
 * the groups hold sequences at different steps: a pool holds the most that any step's sequences of
 * one block hold at once. At step i of its sequence (0: prefill) a sequence holds its prompt and i
 * tokens. */
static void diagonal_pool_pages(const row_split *cache, int gbs, int slots, int blocks,
                                const int *starts, int max_len, int page, int n, const int *lens,
                                int gen_len, int pages[N_TIERS]) {
    int groups = slots / gbs, next = 0, busy = 1, first[blocks][groups], count[blocks][groups];
    for (int t = 0; t < N_TIERS; t++)
        pages[t] = cache->rows[t] > 0 ? kv_pages_for(max_len, page) : 0;
    memset(count, 0, sizeof count);
    for (int i = 0; busy; i++) {
        busy = 0;
        for (int bl = 0; bl < blocks; bl++) {
            int sum[N_TIERS] = {0}, *at = first[bl], *took = count[bl];
            for (int k = 0; k < groups; k++) {
                int start = starts[k], step = (i - start) % gen_len;
                if (i >= start && step == 0) {
                    at[k] = next;
                    took[k] = n - next < gbs ? n - next : gbs;
                    next += took[k];
                }
                for (int b = 0; i >= start && b < took[k]; b++)
                    sum[tier_of(cache, b)] +=
                        kv_pages_for((lens ? lens[at[k] + b] : max_len - gen_len) + step, page);
                busy |= next < n || (i >= start && took[k] > 0 && step < gen_len - 1);
            }
            for (int t = 0; t < N_TIERS; t++) pages[t] = sum[t] > pages[t] ? sum[t] : pages[t];
        }
    }
}

/* The page size and the pools for a job: pages of FG_PAGE_TOKENS tokens where they make no
 * tier's pool larger than pages of max_len tokens, one a sequence; else those (short sequences,
 * or all of one length). A pool never holds more than max_len rows a slot, the cache before
 * pages, so a plan that fits the longest prompts fits these. */
kv_pool_size kv_pool_shape(const row_split *cache, int gbs, int slots, int max_len, int n,
                           const int *lens, int gen_len, int diagonal_blocks,
                           const int *diagonal_starts) {
    int paged[N_TIERS], whole[N_TIERS], no_larger = 1;
    if (diagonal_blocks) {
        diagonal_pool_pages(cache, gbs, slots, diagonal_blocks, diagonal_starts, max_len,
                            FG_PAGE_TOKENS, n, lens, gen_len, paged);
        diagonal_pool_pages(cache, gbs, slots, diagonal_blocks, diagonal_starts, max_len, max_len,
                            n, lens, gen_len, whole);
    } else {
        pool_pages(cache, gbs, slots, max_len, FG_PAGE_TOKENS, n, lens, gen_len, paged);
        pool_pages(cache, gbs, slots, max_len, max_len, n, lens, gen_len, whole);
    }
    for (int t = 0; t < N_TIERS; t++)
        no_larger &= (long)paged[t] * FG_PAGE_TOKENS <= (long)whole[t] * max_len;
    kv_pool_size p = {.page_tokens = no_larger ? FG_PAGE_TOKENS : max_len};
    memcpy(p.pool_pages, no_larger ? paged : whole, sizeof paged);
    return p;
}

int kv_pages_init(kv_pages *kp, const kv_pool_size *pool, const row_split *cache, int gbs,
                  int slots, int max_len, char *err) {
    memset(kp, 0, sizeof *kp);
    kp->pool = *pool;
    kp->cache = *cache;
    kp->gbs = gbs;
    kp->slots = slots;
    kp->max_pages = kv_pages_for(max_len, pool->page_tokens);
    kp->page_table = calloc((size_t)slots * kp->max_pages, sizeof *kp->page_table);
    kp->held = calloc((size_t)slots, sizeof *kp->held);
    int ok = kp->page_table && kp->held;
    for (int t = 0; t < N_TIERS; t++)
        ok = ok && (kp->free_pages[t] = malloc((size_t)(pool->pool_pages[t] + 1) * sizeof(int)));
    if (!ok) return fg_fail(err, "out of memory for the KV cache's page tables");
    kv_pages_reset(kp);
    return 0;
}

void kv_pages_free(kv_pages *kp) {
    free(kp->page_table);
    free(kp->held);
    for (int t = 0; t < N_TIERS; t++) free(kp->free_pages[t]);
}

/* Every page back in its pool, to be taken in order (page 0 first). */
void kv_pages_reset(kv_pages *kp) {
    for (int t = 0; t < N_TIERS; t++) {
        kp->n_free[t] = kp->pool.pool_pages[t];
        for (int i = 0; i < kp->n_free[t]; i++) kp->free_pages[t][i] = kp->n_free[t] - 1 - i;
    }
    memset(kp->held, 0, (size_t)kp->slots * sizeof *kp->held);
}

fg_tier slot_tier(const kv_pages *kp, int slot) { return tier_of(&kp->cache, slot % kp->gbs); }
const int *slot_pages(const kv_pages *kp, int slot) {
    return kp->page_table + (size_t)slot * kp->max_pages;
}

/* Slot `slot` holds pages for `tokens` tokens, taking what it lacks from its tier's pool: 0, or
 * -1 when the pool ran dry. The pools hold the schedule's peak (kv_pool_shape) and the refill's
 * admission (flexgen.c's promisable_pages) keeps within them: a schedule that runs dry is a bug. */
int kv_pages_grow(kv_pages *kp, int slot, int tokens) {
    fg_tier t = slot_tier(kp, slot);
    int *table = kp->page_table + (size_t)slot * kp->max_pages;
    while (kp->held[slot] < kv_pages_for(tokens, kp->pool.page_tokens)) {
        if (kp->n_free[t] == 0 || kp->held[slot] == kp->max_pages) return -1;
        table[kp->held[slot]++] = kp->free_pages[t][--kp->n_free[t]];
    }
    int in_use = kp->pool.pool_pages[t] - kp->n_free[t];
    kp->peak[t] = in_use > kp->peak[t] ? in_use : kp->peak[t];
    return 0;
}

/* Slot `slot`'s sequence ended: its pages go back to the pool. */
void kv_pages_give_back(kv_pages *kp, int slot) {
    fg_tier t = slot_tier(kp, slot);
    const int *table = slot_pages(kp, slot);
    while (kp->held[slot] > 0) kp->free_pages[t][kp->n_free[t]++] = table[--kp->held[slot]];
}
