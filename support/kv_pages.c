/* support/kv_pages.c: the KV cache in pages (vLLM's PagedAttention, which the zig-zag report
 * carries into FlexGen's schedule). A block's cache on each tier is a pool of pages of
 * page_tokens tokens; a sequence takes pages from its slot's tier as it grows, and gives them
 * back when it ends, so that a refill can reuse them. A page id addresses the same tokens in every
 * layer's K and V (flexgen.c's kv_pool lays them out), so one page table serves them all.
 *
 * The pools are sized by the pages the job's prompts need (kv_pool_shape), not by the longest
 * prompt for every slot: that is what the plan check counts.
 */
#include "flexgen.h"
#include "support/support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The pages of `page` tokens each tier's pool needs for a job of n prompts run in blocks of B
 * (gbs x ngb) slots, prompt i of a block in slot i: the most any block's sequences on that tier
 * hold at their longest (prompt + gen_len), and at least one such sequence of the longest prompt,
 * which a refill may place in any slot. lens NULL: every prompt max_prompt long. */
static void pool_pages(const block_shape *s, int page, int n, const int *lens, int gen_len, int pages[N_TIERS]) {
    int B = s->gbs * s->ngb, longest = kv_pages_for(s->max_len, page);
    for (int t = 0; t < N_TIERS; t++) pages[t] = s->cache.rows[t] > 0 ? longest : 0;
    for (int first = 0; first < n; first += B) {
        int sum[N_TIERS] = {0};
        for (int i = first; i < n && i < first + B; i++)
            sum[tier_of(&s->cache, i % s->gbs)] += kv_pages_for((lens ? lens[i] : s->max_prompt) + gen_len, page);
        for (int t = 0; t < N_TIERS; t++) pages[t] = sum[t] > pages[t] ? sum[t] : pages[t];
    }
}

/* The page size and the pools for a job: pages of FG_PAGE_TOKENS tokens where they make no
 * tier's pool larger than pages of max_len tokens, one a sequence; else those (short sequences,
 * or all of one length). A pool never holds more than max_len rows a slot, the cache before
 * pages, so a plan that fits the longest prompts fits these. */
void kv_pool_shape(block_shape *s, int n, const int *lens, int gen_len) {
    int paged[N_TIERS], whole[N_TIERS], no_larger = 1;
    pool_pages(s, FG_PAGE_TOKENS, n, lens, gen_len, paged);
    pool_pages(s, s->max_len, n, lens, gen_len, whole);
    for (int t = 0; t < N_TIERS; t++) no_larger &= (long)paged[t] * FG_PAGE_TOKENS <= (long)whole[t] * s->max_len;
    s->page_tokens = no_larger ? FG_PAGE_TOKENS : s->max_len;
    memcpy(s->pool_pages, no_larger ? paged : whole, sizeof paged);
}

int kv_pages_init(block *bl, char *err) {
    int slots = bl->s.gbs * bl->s.ngb;
    bl->max_pages = kv_pages_for(bl->s.max_len, bl->s.page_tokens);
    bl->page_table = calloc((size_t)slots * bl->max_pages, sizeof *bl->page_table);
    bl->held = calloc((size_t)slots, sizeof *bl->held);
    int ok = bl->page_table && bl->held;
    for (int t = 0; t < N_TIERS; t++)
        ok = ok && (bl->free_pages[t] = malloc((size_t)(bl->s.pool_pages[t] + 1) * sizeof(int)));
    if (!ok) return fg_fail(err, "out of memory for the KV cache's page tables");
    kv_pages_reset(bl);
    return 0;
}

void kv_pages_free(block *bl) {
    free(bl->page_table);
    free(bl->held);
    for (int t = 0; t < N_TIERS; t++) free(bl->free_pages[t]);
}

/* Every page back in its pool, to be taken in order (page 0 first). */
void kv_pages_reset(block *bl) {
    for (int t = 0; t < N_TIERS; t++) {
        bl->n_free[t] = bl->s.pool_pages[t];
        for (int i = 0; i < bl->n_free[t]; i++) bl->free_pages[t][i] = bl->n_free[t] - 1 - i;
    }
    memset(bl->held, 0, (size_t)bl->s.gbs * bl->s.ngb * sizeof *bl->held);
}

fg_tier slot_tier(const block *bl, int slot) { return tier_of(&bl->s.cache, slot % bl->s.gbs); }
const int *slot_pages(const block *bl, int slot) { return bl->page_table + (size_t)slot * bl->max_pages; }

/* Slot `slot` holds pages for `tokens` tokens, taking what it lacks from its tier's pool. The
 * refill's admission (kv_pages_promisable) keeps the pool from running dry; that it did is a bug. */
void kv_pages_grow(block *bl, int slot, int tokens) {
    fg_tier t = slot_tier(bl, slot);
    int *table = bl->page_table + (size_t)slot * bl->max_pages;
    while (bl->held[slot] < kv_pages_for(tokens, bl->s.page_tokens)) {
        if (bl->n_free[t] == 0 || bl->held[slot] == bl->max_pages) {
            fprintf(stderr, "flexgen: internal error: the %s tier's KV cache pool (%d pages) ran out\n",
                    fg_tier_names[t], bl->s.pool_pages[t]);
            abort();
        }
        table[bl->held[slot]++] = bl->free_pages[t][--bl->n_free[t]];
    }
}

/* Slot `slot`'s sequence ended: its pages go back to the pool. */
void kv_pages_give_back(block *bl, int slot) {
    fg_tier t = slot_tier(bl, slot);
    const int *table = slot_pages(bl, slot);
    while (bl->held[slot] > 0) bl->free_pages[t][bl->n_free[t]++] = table[--bl->held[slot]];
}

/* The pages each tier can still promise a new sequence (a refill's admission): those free, less
 * what the running ones may yet take, each up to its prompt (of lens) + gen_len. */
void kv_pages_promisable(const block *bl, const int *lens, int gen_len, int promise[N_TIERS]) {
    for (int t = 0; t < N_TIERS; t++) promise[t] = bl->n_free[t];
    for (int s = 0; s < bl->count; s++)
        if (slot_running(bl, s, gen_len))
            promise[slot_tier(bl, s)] -= kv_pages_for(lens[bl->prompt[s]] + gen_len, bl->s.page_tokens) - bl->held[s];
}
