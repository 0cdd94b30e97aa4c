/* test_kernels.cu: each kernel of flexgen.cu against its CPU reference, one test per kernel (suite
 * "kernels"), on small shapes that are not multiples of a block or of a 4-bit group of 64:
 *
 *   dequant_kernel          quant.c's q4_decompress, rounded to fp16: bit for bit, whole and sliced
 *   store_kv_kernel         each token at its page-table row (kv_page_row): fp16 rows byte for
 *                           byte, 4-bit rows byte for byte against q4_compress(row, heads,
 *                           head_dim, 1), the layout of opt_model.c's store_kv, with a group whose
 *                           levels a fused multiply-add would change; padding rows and delegated
 *                           sequences (NULL cache pointers) leave the pools as they were
 *   attention_kernel        opt_attend_decode on the same fp16 (or 4-bit) values, within (A); its
 *                           top-K over exact ties keeps the CPU's keys (the earlier of a tie);
 *                           top-K over 6,600 keys, the scores in the workspace, also a row a run;
 *                           top-K loads the V rows of its kept keys alone
 *   keep_largest            top-K's radix select alone: quant.c's topk_keep's keys, exactly
 *   attention_span_kernel +
 *   attention_merge_kernel  the split over keys that queue_attention runs where no top-K
 *                           applies: opt_attend_decode within (A), at two and three spans with a
 *                           short last one, and at its shortest spans (as on a card the step
 *                           does not fill); two launches, and a step with top-K one; with room
 *                           for one query row's spans, runs of a row (two launches each); a
 *                           head of 36 (not whole chunks of 8) read value by value
 *   layer_norm_kernel       a layer norm in double on the same fp16 values, within (L), rows
 *                           of up to 4,500 (more than a block's first round of loads); y == x
 *                           gives the same bits; with a bias added first (bias_layer_norm), the
 *                           bits of bias_kernel then layer_norm_kernel
 *   linear() + bias_kernel  the product in double on the same fp16 values plus the bias, within
 *                           (B); with 4-bit W (q4_rows_kernel, or widened slices), on
 *                           q4_decompress's values rounded to fp16
 *   gather_rows_kernel +
 *   add_positions_kernel    the token's row plus its position's row, added in fp32 and rounded
 *                           once to fp16, as the CPU computes it here: bit for bit, fp16 and
 *                           4-bit tables
 *   lm_head, 4-bit          q4_vocab_kernel or widened slices: the product in double, within (B)
 *   prefill_attention +
 *   prefill_softmax_kernel  causal softmax attention with left padding in double, within (P)
 *   cuda_copy_in, _out      2.5 bounce buffers of pageable memory in and out, pinned memory, a
 *                           device copy: byte for byte
 *   upload_cache            the page tables of pages of 5 tokens, more than the workspace's part
 *                           holds, each sequence's rows and cache pointers on the device; the same
 *                           table for the next layer's pools not uploaded again, a changed one is
 *   rms_norm_kernel,
 *   rope_kernel,
 *   swiglu_kernel           the LLaMA family's steps in double on the same fp16 values, each within
 *                           the fp32 rounding it does plus one fp16 rounding (RoPE's cosf and sinf
 *                           within 2 ulps, CUDA's bound), at head dims 24, 64 and 128
 *   attention_kernel, GQA   grouped-query attention over LLaMA's blocked q, k, v against the same
 *                           kernel over OPT's rows with each K/V head repeated: bit for bit; the
 *                           same for the split over keys; each K row loaded once a block of heads
 *
 * Thread order: under the CPU execution harness (FLEXGEN_CUDA_EMU) each kernel runs with its
 * block's threads in forward order, reversed, and shuffled with two seeds between barriers; the
 * outputs must be the same bits every time, since a result that depends on the order in which
 * threads reach a barrier is a shared-memory race. On a GPU each runs once; without one the suite
 * says why and skips.
 *
 * Bounds. u = 2^-24 is fp32's unit roundoff; a sum of n products formed and added in fp32, in any
 * order, with or without fused multiply-adds, is within gamma_n = n u / (1 - n u) of the exact
 * sum times the sum of its terms' magnitudes (Higham, §3.1). cuBLAS's sums take 2u for u, g_n =
 * 2 n u / (1 - 2 n u): on tensor cores its fp32 additions may truncate instead of rounding (Fasi
 * et al., "Numerical behavior of NVIDIA tensor cores", 2021). h(x) = max(2^-11 |x|, 2^-25) is at
 * least half an fp16 ulp at x, the error of one rounding to fp16. "To first order" below leaves
 * out products of two of these small errors; the checks add 1% of the first-order terms for them.
 *
 * (A) Decode attention, device against opt_attend_decode: both read the same fp32 values (fp16
 *     widened exactly; 4-bit decoded by the same fma), so they differ only by the order of their
 *     sums, expf and the device's final rounding to fp16. Each side's score s_j = scale q.k_j is
 *     within scale gamma_hd sum_d |q_d k_jd| + u |s_j| of the exact one, and its subtraction of
 *     the max adds u (|s_j| + |m|) <= 2 u max|s|: the two sides' scores differ by at most
 *         D = max_j 2 scale gamma_hd sum_d |q_d k_jd| + 6 u max_j |s_j|.
 *     Moving every score by at most D moves each weight p_j = e^(s_j - m) / sum by at most 2 D p_j
 *     (to first order); expf (2 ulp on the device, 1 on the host: 6 u), the two sums of nk terms
 *     (2 gamma_nk) and the two divisions (2 u) add at most (2 nk + 8) u p_j: the weights differ by
 *     eta p_j, eta = 2 D + (2 nk + 8) u. The output sum_kept p_j v_jd then differs by at most
 *         E_d = (eta + 2 gamma_nk) sum_kept p_j |v_jd|,
 *     and the device's rounding to fp16 adds h(|out_d| + E_d): half an fp16 ulp of the output
 *     plus a few fp32 ulps of the sums. Top-K: equal weights on both sides give the same kept set; a cut
 *     between two different weights closer than 2 eta of the larger could go either way, and
 *     such queries (random data) are counted and left out. Exact ties come from identical keys,
 *     which give identical weights on each side.
 *     The split over keys (no top-K) computes each weight as e^(s_j - m_s) e^(m_s - M) over
 *     sum_s e^(m_s - M) l_s: its two subtractions add u (|s_j - m_s| + |m_s - M|) = u |s_j - M|,
 *     as the one of the max did; it divides once, at the end, where the block a query divides
 *     each weight; and with one span it is that block's sum (e^0 = 1, exact). With two spans or
 *     more (spans are 64 to 256 keys) it adds a second expf (4 u) and a product and a level of
 *     the sums (within gamma_(nk + 1) in place of gamma_nk): 5 u more, which the checks add to
 *     eta for both kernels.
 * (L) Layer norm, device (fp32) against the exact value y in double on the same fp16 inputs. The
 *     mean is within dm = gamma_dim sum|x| / dim + u |mean|; each x - mean within dm + u |x - mean|;
 *     the variance's relative error is gamma_dim + 2 u (the sum of squares; the mean's error
 *     cancels to first order since sum (x - mean) = 0) and its division by dim, the + 1e-5, the
 *     sqrt and the reciprocal add 4 u, so 1/sqrt(var + 1e-5) has a relative error of gamma_dim / 2
 *     + 5 u; the two products add 2 u and the bias u |y|. With t = (x - mean) inv w:
 *         E = dm inv |w| + |t| (gamma_dim / 2 + 8 u) + u |y|,
 *     and the device's rounding adds h(|y| + E): within half an fp16 ulp of y, so within one ulp of
 *     y rounded to fp16, except where t and b cancel and E, fp32's error in t, is the larger part.
 * (B) linear(): cuBLAS sums the in products (and the residual y0, OUT_ADD) in fp32 and rounds the
 *     result to fp16; bias_kernel adds b in fp32 and rounds again (then ReLU). Every mode with a
 *     bias rounds twice, and OUT_ADD's first rounding is of the residual sum y0 + xW, before the
 *     bias. The reference is matmul_reference (fp32, in order, within gamma_in A of the exact sum)
 *     plus y0 and b in double; cuBLAS's sum is within g_(in+1) A, A = sum_k |x_k W_kj| (+ |y0|), so
 *     with g the reference's value before the bias and y after it:
 *         |device - y| <= (gamma_in + g_(in+1)) A + h(|g| + ...) + u |y| + h(|y| + ...),
 *     the "..." the terms before it; without a bias, (gamma_in + g_(in+1)) A + h(|g| + ...).
 * (P) Prefill attention, device against softmax attention in double. cuBLAS's scores (fp32 sums
 *     of hd fp16 products, times scale) are within D_j = scale g_(hd+1) sum_d |q_d k_jd| + 2 u
 *     max|s| (with the subtraction of the max); the fp32 softmax's weights within eta p_j, eta = 2 D
 *     + (nk + 5) u (expf 4 u, the sum gamma_nk, the division u), and they are stored in fp16: each
 *     probability is within e_j = eta p_j + h(p_j (1 + eta)) of the exact one, which the test
 *     checks too. P V sums the fp16 probabilities times fp16 values in fp32 and rounds to fp16:
 *         E_d = sum_j (e_j + g_nk (p_j + e_j)) |v_jd|,   |device - exact| <= E_d + h(|out| + E_d).
 *     Here the fp16 probabilities dominate: about 2^-11 of sum_j p_j |v_jd|.
 */
#include "flexgen.cu"

extern "C" {
#include "tests/tests.h"
}
#ifdef FLEXGEN_CUDA_EMU
#include "tests/cuda_emu/cuda_emu.h"
#endif

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ============================================================================================
 * The suite's tools
 * ============================================================================================ */

static const double U = 0x1p-24; /* fp32's unit roundoff */

static double gamma_n(int n) { return n * U / (1 - n * U); }

/* cuBLAS's sums: on tensor cores fp32 additions may truncate, 2 u each. */
static double gamma_blas(int n) { return 2 * n * U / (1 - 2 * n * U); }

/* At least half an fp16 ulp at x (normal or subnormal): the error of one rounding to fp16. */
static double h16(double x) {
    x = fabs(x) * 0x1p-11;
    return x > 0x1p-25 ? x : 0x1p-25;
}

static float half_value(fp16 h) { return fp16_to_fp32(h); }

/* 1 where a GPU (or the harness) is there; else says once why the suite skips. */
static int gpu_ready(void) {
    static int said;
    char why[FG_ERR_LEN];
    if (fg_cuda_backend(why)) return 1;
    if (!said++) printf("\n  kernel suite skipped: %s\n", why);
    test_skip(why);
    return 0;
}

template <typename T> static T *host_array(size_t n) {
    T *p = (T *)calloc(n ? n : 1, sizeof(T));
    CU_ASSERT_FATAL(p != NULL);
    return p;
}

template <typename T> static T *device_array(size_t n) {
    T *p = (T *)cuda_alloc((n ? n : 1) * sizeof(T));
    if (!p) cuda_fail("cuda_alloc", __FILE__, __LINE__, "out of device memory for a kernel test");
    return p;
}

static void upload(void *dev, const void *host, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, ctx()->stream));
    wait_stream();
}

static void download(void *host, const void *dev, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, ctx()->stream));
    wait_stream();
}

template <typename T> static T *device_copy(const T *host, size_t n) {
    T *p = device_array<T>(n);
    upload(p, host, n * sizeof(T));
    return p;
}

/* All bits set: NaN as fp16, fp32, a 4-bit group's min and scale; a kernel must overwrite it. */
static void poison(void *dev, size_t bytes) {
    CUDA_CHECK(cudaMemsetAsync(dev, 0xff, bytes, ctx()->stream));
}

static fp16 random_half(uint64_t *seed, float lo, float hi) {
    return fp32_to_fp16(lo + (hi - lo) * test_uniform(seed));
}

static fp16 *random_halves(size_t n, uint64_t *seed, float lo, float hi) {
    fp16 *x = host_array<fp16>(n);
    for (size_t i = 0; i < n; i++) x[i] = random_half(seed, lo, hi);
    return x;
}

static float *widened(const fp16 *x, size_t n) {
    float *y = host_array<float>(n);
    for (size_t i = 0; i < n; i++) y[i] = half_value(x[i]);
    return y;
}

/* run(arg) launches a kernel (resetting its outputs first) and waits for it; `bytes` of device
 * memory at `out` are its result, copied into host. Under the harness it runs again with the
 * block's threads reversed and shuffled (two seeds), and each time the result must be the same
 * bits. */
/* A count of the emulated GPU's statistics so far: the bytes its asynchronous copies have read
 * (EMU_ASYNC_BYTES), those of K and V rows attention has loaded (EMU_KV_LOAD_BYTES: kv_load and
 * kv_at count them), or its cublasLtMatmul calls of its first or second algorithm (EMU_LT_FIRST,
 * EMU_LT_SECOND); -1 natively, where nothing counts them. run_in_every_order runs its kernels
 * EVERY_ORDER times there. */
enum { EVERY_ORDER = 4 };
enum emu_count { EMU_ASYNC_BYTES, EMU_KV_LOAD_BYTES, EMU_LT_FIRST, EMU_LT_SECOND };
static long long emu_count(emu_count which) {
#ifdef FLEXGEN_CUDA_EMU
    cuda_emu_stats s;
    cuda_emu_get_stats(&s);
    if (which == EMU_LT_FIRST || which == EMU_LT_SECOND) return s.lt_matmuls[which - EMU_LT_FIRST];
    return which == EMU_ASYNC_BYTES ? s.async_bytes : s.kv_load_bytes;
#else
    (void)which;
    return -1;
#endif
}

/* The bytes asynchronous copies read in each of run_in_every_order's runs since
 * emu_count(EMU_ASYNC_BYTES) gave `before`. */
static long long async_bytes_a_run(long long before) {
    return (emu_count(EMU_ASYNC_BYTES) - before) / EVERY_ORDER;
}

static void run_in_every_order(const char *what, void (*run)(void *), void *arg, const void *out,
                               size_t bytes, void *host) {
#ifdef FLEXGEN_CUDA_EMU
    int order_before;
    unsigned seed_before;
    cuda_emu_get_order(&order_before, &seed_before); /* FLEXGEN_EMU_ORDER's, or forward */
    cuda_emu_set_order(CUDA_EMU_FORWARD, 0);
#endif
    run(arg);
    download(host, out, bytes);
#ifdef FLEXGEN_CUDA_EMU
    static const struct { int order; unsigned seed; } orders[] = {
        {CUDA_EMU_REVERSE, 0}, {CUDA_EMU_SHUFFLE, 1}, {CUDA_EMU_SHUFFLE, 2718281}};
    static_assert(1 + sizeof orders / sizeof *orders == EVERY_ORDER, "forward, then the others");
    unsigned char *again = host_array<unsigned char>(bytes);
    for (size_t i = 0; i < sizeof orders / sizeof *orders; i++) {
        cuda_emu_set_order(orders[i].order, orders[i].seed);
        run(arg);
        download(again, out, bytes);
        size_t at = 0;
        while (at < bytes && again[at] == ((const unsigned char *)host)[at]) at++;
        EXPECT(at == bytes, "%s: the threads in %s order change the output (byte %zu of %zu: 0x%02x "
               "forward, 0x%02x now): a race", what, cuda_emu_order_name(), at, bytes,
               at < bytes ? ((const unsigned char *)host)[at] : 0, at < bytes ? again[at] : 0);
    }
    cuda_emu_set_order(order_before, seed_before);
    free(again);
#else
    (void)what;
#endif
}

/* ============================================================================================
 * dequant_kernel
 * ============================================================================================ */

typedef struct {
    const uint8_t *src;
    size_t len, inner, first, stride, width, n; /* dequant_kernel's slice */
    __half *dst;
} dequant_args;

static void run_dequant(void *p) {
    dequant_args *a = (dequant_args *)p;
    poison(a->dst, a->n * sizeof(__half));
    dequant_kernel<<<blocks_for(a->n, 256), 256, 0, ctx()->stream>>>(a->src, a->len, a->inner, a->first,
                                                                      a->stride, a->width, a->n, a->dst);
    LAUNCHED("dequant_kernel");
    wait_stream();
}

/* The kernel's slice of the tensor whose q4_decompress is `want` against q4_decompress, bit for bit. */
static void dequant_case(const uint8_t *q, size_t bytes, size_t outer, size_t len, size_t inner, size_t first,
                         size_t stride, size_t width, size_t n, const float *want) {
    dequant_args a = {device_copy(q, bytes), len, inner, first, stride, width, n, device_array<__half>(n)};
    fp16 *got = host_array<fp16>(n);
    char what[128];
    snprintf(what, sizeof what, "dequant_kernel [%zu][%zu][%zu], from %zu, %zu of %zu apart", outer, len, inner,
             first, width, stride);
    run_in_every_order(what, run_dequant, &a, a.dst, n * sizeof(fp16), got);
    size_t bad = 0, first_bad = 0;
    for (size_t e = 0; e < n; e++)
        if (got[e] != fp32_to_fp16(want[first + e / width * stride + e % width]) && !bad++) first_bad = e;
    float w = want[first + first_bad / width * stride + first_bad % width];
    EXPECT(bad == 0, "%s: %zu of %zu values differ from q4_decompress's; value %zu: expected 0x%04x (%g), got "
           "0x%04x (%g)", what, bad, n, first_bad, fp32_to_fp16(w), w, got[first_bad], half_value(got[first_bad]));
    cuda_free((void *)a.src);
    cuda_free(a.dst);
    free(got);
}

/* [outer][len][inner] tensors, len not a multiple of 64 (partial groups, a lone value), groups
 * along contiguous values (inner 1) and across rows (inner 3): whole, and a slice, the second
 * half of each outer index's values (as the widened products take slices). */
static void test_dequant(void) {
    if (!gpu_ready()) return;
    static const size_t lens[] = {1, 17, 80, 130}, inners[] = {1, 3};
    uint64_t seed = 11;
    for (size_t outer = 1; outer <= 2; outer++)
        for (size_t l = 0; l < sizeof lens / sizeof *lens; l++)
            for (size_t i = 0; i < sizeof inners / sizeof *inners; i++) {
                size_t len = lens[l], inner = inners[i], n = outer * len * inner, bytes = q4_bytes(outer, len, inner);
                float *x = host_array<float>(n), *want = host_array<float>(n);
                for (size_t e = 0; e < n; e++) /* mixed scales and signs, some groups far from 0 */
                    x[e] = (test_uniform(&seed) - 0.3f) * (1 + (float)(e / 64 % 5) * 7.5f) + (float)(e / 150 % 2) * 40;
                uint8_t *q = host_array<uint8_t>(bytes);
                q4_compress(x, outer, len, inner, q);
                q4_decompress(q, outer, len, inner, want);
                dequant_case(q, bytes, outer, len, inner, 0, n, n, n, want);
                size_t row = len * inner, half = row / 2; /* the second half of each outer index's values */
                if (row >= 2)
                    dequant_case(q, bytes, outer, len, inner, half, row, row - half, outer * (row - half), want);
                free(x);
                free(want);
                free(q);
            }
}

/* ============================================================================================
 * A paged KV cache as the kernels see it
 * ============================================================================================ */

/* One layer's K and V pools for a batch, in one device allocation [K pool][V pool], and their page
 * tables as the kernels take them ([K, V][batch][max_pages]). Sequence b's cache pointer is its
 * pool's start plus b pages, and its table names pages batch + perm - b from there, perm a
 * shuffled permutation: every sequence has a pointer of its own and pages scattered among the
 * others'. A pool starts all ones (NaN values, NaN min and scale), so a wrong row shows. */
typedef struct {
    int batch, max_pages, page_tokens;
    size_t row_bytes, page_bytes, pool_bytes; /* pool_bytes: one of K or V */
    int *tables;   /* host, [2][batch][max_pages] */
    uint8_t *host; /* the pools, [2][pool_bytes] */
    uint8_t *dev;  /* the same on the device */
    int *dev_tables;
    void **dev_k, **dev_v; /* [batch] each, device: the sequences' pointers (NULL: delegated) */
} paged_cache;

static void shuffle_ints(int *x, int n, uint64_t *seed) {
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(test_uniform(seed) * (float)(i + 1)), t = x[i];
        j = j > i ? i : j;
        x[i] = x[j], x[j] = t;
    }
}

static void paged_cache_init(paged_cache *c, int batch, int max_len, int page_tokens, size_t row_bytes,
                             int delegated, uint64_t *seed) {
    memset(c, 0, sizeof *c);
    c->batch = batch, c->page_tokens = page_tokens, c->row_bytes = row_bytes;
    c->max_pages = kv_pages_for(max_len, page_tokens) + 1; /* a spare entry, as the workspace's */
    int used = batch * c->max_pages;
    c->page_bytes = (size_t)page_tokens * row_bytes;
    c->pool_bytes = (size_t)(used + batch) * c->page_bytes;
    c->tables = host_array<int>(2 * (size_t)used);
    int *perm = host_array<int>((size_t)used);
    for (int kv = 0; kv < 2; kv++) {
        for (int i = 0; i < used; i++) perm[i] = i;
        shuffle_ints(perm, used, seed);
        for (int b = 0; b < batch; b++)
            for (int i = 0; i < c->max_pages; i++)
                c->tables[((size_t)kv * batch + b) * c->max_pages + i] = batch + perm[b * c->max_pages + i] - b;
    }
    c->host = host_array<uint8_t>(2 * c->pool_bytes);
    memset(c->host, 0xff, 2 * c->pool_bytes);
    c->dev = device_array<uint8_t>(2 * c->pool_bytes);
    c->dev_tables = device_copy(c->tables, 2 * (size_t)used);
    void **k = host_array<void *>((size_t)batch), **v = host_array<void *>((size_t)batch);
    for (int b = 0; b < batch; b++) {
        k[b] = b == delegated ? NULL : c->dev + (size_t)b * c->page_bytes;
        v[b] = b == delegated ? NULL : c->dev + c->pool_bytes + (size_t)b * c->page_bytes;
    }
    c->dev_k = device_copy(k, (size_t)batch);
    c->dev_v = device_copy(v, (size_t)batch);
    free(perm);
    free(k);
    free(v);
}

static void paged_cache_free(paged_cache *c) {
    cuda_free(c->dev);
    cuda_free(c->dev_tables);
    cuda_free(c->dev_k);
    cuda_free(c->dev_v);
    free(c->tables);
    free(c->host);
}

static const int *table_of(const paged_cache *c, int kv, int b) {
    return c->tables + ((size_t)kv * c->batch + b) * c->max_pages;
}

/* Sequence b's K (kv 0) or V rows on the host, from its pointer (its page table counts from there). */
static uint8_t *rows_of(const paged_cache *c, int kv, int b) {
    return c->host + (size_t)kv * c->pool_bytes + (size_t)b * c->page_bytes;
}

static uint8_t *row_at(const paged_cache *c, int kv, int b, int slot) {
    return rows_of(c, kv, b) + kv_page_row(table_of(c, kv, b), c->page_tokens, slot) * c->row_bytes;
}

/* One token's K or V row of fp16 values x [heads][head_dim] as the cache holds it. */
static void write_row(uint8_t *row, const fp16 *x, int heads, int head_dim, int q4) {
    size_t h = (size_t)heads * head_dim;
    if (!q4) {
        memcpy(row, x, h * sizeof(fp16));
        return;
    }
    float *wide = widened(x, h);
    q4_compress(wide, (size_t)heads, (size_t)head_dim, 1, row);
    free(wide);
}

/* A step's sequences: past and padding rows of each; a delegated one (its cache in host memory,
 * NULL pointers on the device) or -1. */
typedef struct {
    const char *what;
    int heads, head_dim, batch, n_new, page_tokens, delegated;
    float sparsity;
    int past[8], pad[8];
} step_case;

/* The most keys a query of the step sees (at least 1). */
static int longest(const step_case *c) {
    int n = 1;
    for (int b = 0; b < c->batch; b++)
        n = c->past[b] + c->n_new - c->pad[b] > n ? c->past[b] + c->n_new - c->pad[b] : n;
    return n;
}

/* The slots (of head_dim + 2 floats) that a query row's top-K scores take in the workspace, where
 * shared memory cannot hold them (top_k_in_shared); 0 where it can. */
static size_t top_k_row_slots(const step_case *c) {
    if (top_k_in_shared(c->heads, c->heads, c->head_dim, longest(c))) return 0;
    return fg_cuda_top_k_slots(c->heads, c->head_dim, longest(c));
}

/* The spans' slots a step of c needs at its shortest spans (FG_CUDA_MIN_SPAN_KEYS keys): room for
 * queue_attention to cut every query as finely as it may, and for every row's top-K scores. */
static size_t shortest_span_slots(const step_case *c) {
    size_t spans = ((size_t)longest(c) + FG_CUDA_MIN_SPAN_KEYS - 1) / FG_CUDA_MIN_SPAN_KEYS;
    size_t rows = (size_t)c->batch * c->n_new;
    size_t slots = rows * c->heads * spans;
    return slots > rows * top_k_row_slots(c) ? slots : rows * top_k_row_slots(c);
}

/* ============================================================================================
 * store_kv_kernel
 * ============================================================================================ */

typedef struct {
    const step_case *c;
    int q4;
    const __half *qkv;
    const int *past, *pad;
    paged_cache *cache;
} store_args;

static void run_store(void *p) {
    store_args *a = (store_args *)p;
    const step_case *c = a->c;
    int h = c->heads * c->head_dim, rows = c->batch * c->n_new;
    upload(a->cache->dev, a->cache->host, 2 * a->cache->pool_bytes); /* the pools as they were */
    size_t threads = store_kv_threads(rows, c->heads, c->head_dim, a->q4);
    qkv_layout at = {{0, (size_t)h, 2 * (size_t)h}, {3 * (size_t)h, 3 * (size_t)h, 3 * (size_t)h}}; /* OPT's rows */
    attention_split step = {.qkv = a->qkv, .at = at, .attn = NULL, .past = a->past, .pad = a->pad,
                            .kc = a->cache->dev_k, .vc = a->cache->dev_v, .shift = {0, 0}, .pages = a->cache->dev_tables,
                            .max_pages = a->cache->max_pages, .page_tokens = a->cache->page_tokens,
                            .n_new = c->n_new, .hd = c->head_dim, .heads = c->heads, .kv_heads = c->heads,
                            .q4 = a->q4, .spans = 0, .span_keys = 0, .scale = 0,
                            .partials = NULL, .batch = c->batch, .first_b = 0, .first_t = 0,
                            .scores_apart = 0, .scores_in_workspace = 0, .scores_ready = 0};
    store_kv_kernel<<<blocks_for(threads, 128), 128, 0, ctx()->stream>>>(step, rows);
    LAUNCHED("store_kv_kernel");
    wait_stream();
}

/* Pages of 5 and 16 tokens, sequences whose length ends exactly on a page and one past it, all
 * padding, delegated, prefill, decode and both in one step. */
static const step_case STORE_CASES[] = {
    {"prefill, 3 heads of 48 (h 144), pages of 5, one delegated", 3, 48, 7, 6, 5, 4, 1,
     {0, 0, 0, 0, 0, 0, 0}, {0, 1, 2, 3, 0, 6, 1}},
    {"decode, 2 heads of 80, pages of 16", 2, 80, 7, 1, 16, -1, 1,
     {15, 16, 31, 32, 4, 0, 47}, {0, 0, 0, 0, 0, 1, 0}},
    {"prefill of 17, 1 head of 96, pages of 16", 1, 96, 1, 17, 16, -1, 1, {0}, {0}},
    {"prefill and decode in one step, 2 heads of 128, pages of 5", 2, 128, 7, 3, 5, -1, 1,
     {0, 9, 10, 0, 4, 0, 14}, {0, 2, 2, 1, 2, 3, 2}},
    {"decode to the end of a page, 2 heads of 128, pages of 5", 2, 128, 1, 1, 5, -1, 1, {4}, {0}},
};

/* Where the first differing byte of the pools lies, in words. */
static void describe_byte(const paged_cache *c, size_t at, char *out, size_t size) {
    int kv = at >= c->pool_bytes;
    size_t in_pool = at - (size_t)kv * c->pool_bytes, row = in_pool / c->row_bytes;
    snprintf(out, size, "%s pool, row %zu (page %zu), byte %zu of the row", kv ? "V" : "K", row,
             row / (size_t)c->page_tokens, in_pool % c->row_bytes);
}

/* The first stored token's K, head 0, group 0 becomes a group whose levels an fma would change:
 * min -5 and max 145 give scale 10 and inv 0.1f; for the values just below 0 (fp16 0x8005 to
 * 0x800b), (x - min) inv rounds to 0.5 and + 0.5 gives level 1, where fma(x - min, inv, 0.5) stays
 * below 1 and gives 0. The device must give the CPU's levels (compress_group's _rn operations). */
static void fused_rounding_group(const step_case *c, fp16 *qkv, uint64_t *seed) {
    int h = c->heads * c->head_dim, n = c->head_dim < Q4_GROUP ? c->head_dim : Q4_GROUP;
    for (int r = 0; r < c->batch * c->n_new; r++) {
        int b = r / c->n_new;
        if (r % c->n_new < c->pad[b] || b == c->delegated) continue;
        fp16 *k = qkv + (size_t)r * 3 * h + h;
        for (int e = 0; e < n; e++)
            k[e] = e == 0 ? fp32_to_fp16(-5) : e == 1 ? fp32_to_fp16(145) : e < 9 ? (fp16)(0x8005 + e - 2)
                                                                             : random_half(seed, -5, 145);
        return;
    }
}

static void store_case(const step_case *c, int q4, uint64_t *seed) {
    int h = c->heads * c->head_dim, rows = c->batch * c->n_new;
    size_t row_bytes = q4 ? q4_bytes((size_t)c->heads, (size_t)c->head_dim, 1) : 2 * (size_t)h;
    fp16 *qkv = host_array<fp16>((size_t)rows * 3 * h);
    for (int r = 0; r < rows; r++) { /* rows of small, middling and large values */
        float range = r % 3 == 0 ? 0.1f : r % 3 == 1 ? 3 : 60;
        for (int i = 0; i < 3 * h; i++) qkv[(size_t)r * 3 * h + i] = random_half(seed, -range, range * 0.7f);
    }
    if (q4) fused_rounding_group(c, qkv, seed);
    paged_cache cache;
    paged_cache_init(&cache, c->batch, longest(c), c->page_tokens, row_bytes, c->delegated, seed);
    /* what the pools must hold after the step: each token's row at its slot's page row */
    uint8_t *want = host_array<uint8_t>(2 * cache.pool_bytes), *got = host_array<uint8_t>(2 * cache.pool_bytes);
    memcpy(want, cache.host, 2 * cache.pool_bytes);
    for (int r = 0; r < rows; r++) {
        int b = r / c->n_new, t = r % c->n_new, slot = c->past[b] + t - c->pad[b];
        if (t < c->pad[b] || b == c->delegated) continue;
        for (int kv = 0; kv < 2; kv++) {
            uint8_t *row = want + (row_at(&cache, kv, b, slot) - cache.host);
            write_row(row, qkv + (size_t)r * 3 * h + (size_t)(kv + 1) * h, c->heads, c->head_dim, q4);
        }
    }
    store_args a = {c, q4, (const __half *)device_copy(qkv, (size_t)rows * 3 * h), device_copy(c->past, (size_t)c->batch),
                    device_copy(c->pad, (size_t)c->batch), &cache};
    char what[160];
    snprintf(what, sizeof what, "store_kv_kernel, %s, %s cache", c->what, q4 ? "4-bit" : "fp16");
    run_in_every_order(what, run_store, &a, cache.dev, 2 * cache.pool_bytes, got);
    size_t at = 0;
    while (at < 2 * cache.pool_bytes && got[at] == want[at]) at++;
    char where[128] = "";
    if (at < 2 * cache.pool_bytes) describe_byte(&cache, at, where, sizeof where);
    EXPECT(at == 2 * cache.pool_bytes, "%s: the pools differ first at %s: expected 0x%02x, got 0x%02x", what,
           where, at < 2 * cache.pool_bytes ? want[at] : 0, at < 2 * cache.pool_bytes ? got[at] : 0);
    cuda_free((void *)a.qkv);
    cuda_free((void *)a.past);
    cuda_free((void *)a.pad);
    paged_cache_free(&cache);
    free(qkv);
    free(want);
    free(got);
}

static void test_store_kv(void) {
    if (!gpu_ready()) return;
    uint64_t seed = 21;
    for (size_t i = 0; i < sizeof STORE_CASES / sizeof *STORE_CASES; i++)
        for (int q4 = 0; q4 <= 1; q4++) store_case(&STORE_CASES[i], q4, &seed);
}

/* ============================================================================================
 * attention_kernel
 * ============================================================================================ */

/* What attention_kernel takes: a block per (head, sequence b, row t) of the step's qkv rows
 * [batch][n_new][q|k|v]. Row t < pad[b] is padding: its output is zeros. Otherwise its query sits
 * at slot past[b] + t - pad[b] and sees keys [0, slot]: those below past[b] from the cache through
 * b's page tables (pages [K, V][batch][max_pages], rows from kc[b] and vc[b]), the others from
 * this step's own k and v rows (from row pad[b] on), never from the cache. kc[b] NULL is a
 * delegated sequence: its rows are left untouched. decode (n_new - pad[b] == 1 and past[b] > 0:
 * one query after cached ones) is where top-K applies: the new key and the floor(sparsity (nk -
 * 1)) earlier ones of largest weight, ties to the earlier. */

/* A step of attention as a test sets it up: its q, k, v rows, the cache of the tokens before it,
 * and their device copies. */
typedef struct {
    step_case c;
    int q4, h, rows;
    fp16 *qkv;    /* [rows][3 h] */
    float *qkv32; /* the same, widened */
    paged_cache cache;
    __half *dev_qkv, *dev_attn;
    int *dev_past, *dev_pad;
    int split;          /* run through queue_attention (the split over keys where it applies):
                           1 its fewest spans, 2 with room for one span less than they need,
                           3 its shortest spans (as if the card had room for every block) */
    float *dev_partials; /* its spans' sums, span_slots of head_dim + 2 floats */
    size_t span_slots;
    int64_t launches;   /* what the last run launched */
} attn_setup;

/* Whether a step takes top-K: a sequence's one query after its prompt, sparsity < 1. */
static int takes_top_k(const step_case *c) {
    int top_k = 0;
    for (int b = 0; b < c->batch; b++)
        top_k |= c->sparsity < 1 && c->n_new - c->pad[b] == 1 && c->past[b] > 0;
    return top_k;
}

/* Random q, k, v rows and cached rows for every slot below past (fp16, or 4-bit of fp16 values). */
static void attn_setup_init(attn_setup *s, const step_case *c, int q4, uint64_t *seed) {
    memset(s, 0, sizeof *s);
    s->c = *c, s->q4 = q4, s->h = c->heads * c->head_dim, s->rows = c->batch * c->n_new;
    size_t n = (size_t)s->rows * 3 * s->h;
    s->qkv = random_halves(n, seed, -2, 2);
    size_t row_bytes = q4 ? q4_bytes((size_t)c->heads, (size_t)c->head_dim, 1) : 2 * (size_t)s->h;
    paged_cache_init(&s->cache, c->batch, longest(c), c->page_tokens, row_bytes, c->delegated, seed);
    for (int b = 0; b < c->batch; b++)
        for (int slot = 0; slot < c->past[b]; slot++)
            for (int kv = 0; kv < 2; kv++) {
                fp16 *x = random_halves((size_t)s->h, seed, -2, 2);
                write_row(row_at(&s->cache, kv, b, slot), x, c->heads, c->head_dim, q4);
                free(x);
            }
    s->dev_qkv = device_array<__half>(n);
    s->dev_attn = device_array<__half>((size_t)s->rows * s->h);
    s->dev_past = device_copy(c->past, (size_t)c->batch);
    s->dev_pad = device_copy(c->pad, (size_t)c->batch);
    s->span_slots = shortest_span_slots(c);
    s->dev_partials = device_array<float>(s->span_slots * (c->head_dim + 2));
}

/* The host's rows to the device (after any change to them), and widened for the reference. */
static void attn_setup_upload(attn_setup *s) {
    size_t n = (size_t)s->rows * 3 * s->h;
    upload(s->dev_qkv, s->qkv, n * sizeof(fp16));
    upload(s->cache.dev, s->cache.host, 2 * s->cache.pool_bytes);
    free(s->qkv32);
    s->qkv32 = widened(s->qkv, n);
}

static void attn_setup_free(attn_setup *s) {
    paged_cache_free(&s->cache);
    cuda_free(s->dev_qkv);
    cuda_free(s->dev_attn);
    cuda_free(s->dev_past);
    cuda_free(s->dev_pad);
    cuda_free(s->dev_partials);
    free(s->qkv);
    free(s->qkv32);
}

/* attention_kernel, or with s->split queue_attention (a span's sums poisoned first: a merge that
 * reads one not written gives NaN), counting its launches. */
static void run_attention(void *p) {
    attn_setup *s = (attn_setup *)p;
    const step_case *c = &s->c;
    poison(s->dev_attn, (size_t)s->rows * s->h * sizeof(__half));
    size_t h = (size_t)s->h;
    qkv_layout at = {{0, h, 2 * h}, {3 * h, 3 * h, 3 * h}}; /* OPT's rows */
    int64_t before = counts.launches;
    attention_split a = {s->dev_qkv, at, s->dev_attn, s->dev_past, s->dev_pad, s->cache.dev_k,
                         s->cache.dev_v, {0, 0}, s->cache.dev_tables, s->cache.max_pages,
                         s->cache.page_tokens, c->n_new, c->head_dim, c->heads, c->heads,
                         s->q4, 0, 0, 1.0f / sqrtf((float)c->head_dim), s->dev_partials,
                         c->batch, 0, 0, 0, 0, 0};
    if (s->split) {
        poison(s->dev_partials, s->span_slots * (c->head_dim + 2) * sizeof(float));
        /* the spans as many as fit, or room for one query row's fewest spans, or top-K scores in
         * the workspace (a run a row) */
        size_t one_row = (size_t)c->heads * fg_cuda_attention_spans(longest(c));
        if (top_k_row_slots(c) > one_row) one_row = top_k_row_slots(c);
        size_t room = s->split == 2 ? one_row : s->span_slots;
        int fill_blocks = s->split == 3 ? INT_MAX : 1;
        queue_attention(a, c->batch, c->past, c->pad, c->sparsity, s->dev_partials, room,
                        fill_blocks);
        s->launches = counts.launches - before;
        wait_stream();
        return;
    }
    queue_attention_kernel(a, c->batch, c->n_new, longest(c), c->sparsity, 1);
    s->launches = counts.launches - before;
    wait_stream();
}

/* Key (or value) j of one head as the CPU reads it (opt_model.c's kv_row). */
static const float *kv_values(const opt_kv_rows *r, int j, float *buf) {
    if (j >= r->first_fresh) return r->fresh + (size_t)(j - r->first_fresh) * r->fresh_stride;
    const char *row = r->rows + kv_page_row(r->pages, r->page_tokens, j) * r->stride;
    if (r->q4) q4_decompress((const uint8_t *)row + r->head * q4_bytes(1, (size_t)r->head_dim, 1), 1,
                             (size_t)r->head_dim, 1, buf);
    else for (int d = 0; d < r->head_dim; d++) buf[d] = half_value(((const fp16 *)row)[(size_t)r->head * r->head_dim + d]);
    return buf;
}

typedef struct {
    double worst;     /* the largest |device - CPU| / bound */
    int sparse, left_out; /* sparse queries; those left out for a cut within the bound */
    int bad;          /* values off */
    char first[400];  /* the first of them */
} attn_stats;

static void attn_fail(attn_stats *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void attn_fail(attn_stats *st, const char *fmt, ...) {
    if (st->bad++) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->first, sizeof st->first, fmt, ap);
    va_end(ap);
}

static int by_weight_descending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* 1 when the CPU's top-K cut falls between two different weights within 2 eta of each other. */
static int cut_within(const float *p, int earlier, int keep, double eta) {
    if (keep <= 0 || keep >= earlier) return 0;
    float *sorted = host_array<float>((size_t)earlier);
    memcpy(sorted, p, (size_t)earlier * sizeof *p);
    qsort(sorted, (size_t)earlier, sizeof *sorted, by_weight_descending);
    int close = sorted[keep - 1] != sorted[keep] && sorted[keep - 1] - sorted[keep] <= 2 * eta * sorted[keep - 1];
    free(sorted);
    return close;
}

/* Query row t of sequence b, head `head`: the device's output (got, [rows][h] fp16) against
 * opt_attend_decode's within (A). With ties (one-hot values, hd >= nk) the device's nonzero
 * outputs must be the keys the CPU kept, exactly. */
static void check_query(const attn_setup *s, const fp16 *got, int b, int head, int t, int ties, attn_stats *st) {
    const step_case *c = &s->c;
    int hd = c->head_dim, h = s->h, past = c->past[b], pad = c->pad[b], nk = past + t - pad + 1;
    int decode = c->n_new - pad == 1 && past > 0;
    float sparsity = decode ? c->sparsity : 1, scale = 1.0f / sqrtf((float)hd);
    const fp16 *out16 = got + ((size_t)b * c->n_new + t) * h + (size_t)head * hd;
    const float *fresh = s->qkv32 + ((size_t)b * c->n_new + pad) * 3 * h + (size_t)head * hd;
    const float *q = s->qkv32 + ((size_t)b * c->n_new + t) * 3 * h + (size_t)head * hd;
    opt_kv_rows K = {(const char *)rows_of(&s->cache, 0, b), table_of(&s->cache, 0, b), c->page_tokens,
                     s->cache.row_bytes, s->q4, head, hd, past, fresh + h, 3 * (size_t)h};
    opt_kv_rows V = K;
    V.rows = (const char *)rows_of(&s->cache, 1, b), V.pages = table_of(&s->cache, 1, b), V.fresh = fresh + 2 * h;
    float *scratch = host_array<float>(3 * (size_t)nk + hd), *out = host_array<float>((size_t)hd);
    float *buf = host_array<float>((size_t)hd);
    int n_keep = opt_attend_decode(q, &K, &V, nk, scale, sparsity, scratch, out);
    const float *p = scratch;                                     /* the CPU's weights */
    const int *keep = (const int *)(scratch + 2 * (size_t)nk + hd); /* its kept keys, when sparse */
    char *kept = host_array<char>((size_t)nk);
    for (int i = 0; i < n_keep; i++) kept[sparsity < 1 ? keep[i] : i] = 1;
    /* D: how far apart the two sides' scores can be */
    double D = 0, smax = 0;
    for (int j = 0; j < nk; j++) {
        const float *k = kv_values(&K, j, buf);
        double dot = 0, mag = 0;
        for (int d = 0; d < hd; d++) dot += (double)q[d] * k[d], mag += fabs((double)q[d] * k[d]);
        D = fmax(D, 2 * scale * gamma_n(hd) * mag);
        smax = fmax(smax, fabs(scale * dot));
    }
    D += 6 * U * smax;
    double eta = 2 * D + (2 * nk + 8 + 5) * U; /* + 5 u: the split's spans (A) */
    int earlier_kept = (int)floorf(sparsity * (float)(nk - 1));
    if (sparsity < 1) st->sparse++;
    if (sparsity < 1 && !ties && cut_within(p, nk - 1, earlier_kept, eta)) {
        st->left_out++;
    } else {
        double *mass = host_array<double>((size_t)hd); /* sum_kept p_j |v_jd| */
        for (int j = 0; j < nk; j++) {
            if (!kept[j]) continue;
            const float *v = kv_values(&V, j, buf);
            for (int d = 0; d < hd; d++) mass[d] += p[j] * fabs((double)v[d]);
        }
        for (int d = 0; d < hd; d++) {
            double E = 1.01 * (eta + 2 * gamma_n(nk)) * mass[d], bound = E + h16(fabs(out[d]) + E);
            double err = fabs((double)half_value(out16[d]) - out[d]);
            if (!(err <= bound)) /* NaN fails too */
                attn_fail(st, "sequence %d, row %d, head %d, element %d of %d keys: expected %.7g within %.3g, got %.7g",
                          b, t, head, d, nk, out[d], bound, half_value(out16[d]));
            else if (err / bound > st->worst) st->worst = err / bound;
        }
        free(mass);
    }
    if (ties) {
        int count = 0;
        for (int j = 0; j < nk; j++) count += out16[j] != 0;
        for (int j = 0; j < nk; j++)
            if ((out16[j] != 0) != kept[j]) {
                attn_fail(st, "sequence %d, head %d: key %d of %d %s by the device, %s by the CPU (%d earlier "
                          "keys kept of %d)", b, head, j, nk, out16[j] ? "kept" : "dropped",
                          kept[j] ? "kept" : "dropped", earlier_kept, nk - 1);
                break;
            }
        if (count != earlier_kept + 1)
            attn_fail(st, "sequence %d, head %d: the device kept %d keys, expected %d", b, head, count, earlier_kept + 1);
    }
    free(scratch);
    free(out);
    free(buf);
    free(kept);
}

/* The whole step: padding rows zero, a delegated sequence's rows untouched, the others within (A). */
static void check_attention(const attn_setup *s, const fp16 *got, const char *what, int ties, attn_stats *st) {
    const step_case *c = &s->c;
    for (int b = 0; b < c->batch; b++)
        for (int t = 0; t < c->n_new; t++)
            for (int head = 0; head < c->heads; head++) {
                const fp16 *o = got + ((size_t)b * c->n_new + t) * s->h + (size_t)head * c->head_dim;
                if (b == c->delegated || t < c->pad[b]) {
                    fp16 want = b == c->delegated ? 0xffff : 0; /* left as it was; zeros */
                    for (int d = 0; d < c->head_dim; d++)
                        if (o[d] != want) {
                            attn_fail(st, "sequence %d (%s), row %d, head %d: element %d is 0x%04x, expected 0x%04x", b,
                                      b == c->delegated ? "delegated" : "padding", t, head, d, o[d], want);
                            break;
                        }
                    continue;
                }
                check_query(s, got, b, head, t, ties, st);
            }
    EXPECT(st->bad == 0, "%s: %d values off; the first: %s", what, st->bad, st->first);
    st->bad = 0;
}

/* Decode (keys 1 to 17), top-K, a delegated sequence, prefill and decode in one step (n_new 4:
 * decoding sequences with 3 padding rows, a 1-token prompt, one all padding), a prefill of 17,
 * several rows after cached ones (causal over the cache and this step's rows, no top-K), and more
 * keys than the block's 256 threads. Without top-K the split over keys runs, at its fewest spans
 * (at most FG_CUDA_SPAN_KEYS = 256 keys, cut evenly): queries of one span, of exactly one and two whole spans, of two
 * and three with a short last span, rows of one step on both sides of a span's end, padding and a
 * delegated sequence beside them; and at its shortest (as on a card the step does not fill: 701
 * keys in 11 spans of 64); with room for one span too few, attention_kernel instead. */
static const step_case ATTN_CASES[] = {
    {"decode, 3 heads of 48, pages of 5", 3, 48, 7, 1, 5, -1, 1,
     {16, 0, 4, 5, 9, 16, 1}, {0, 0, 0, 0, 0, 0, 0}},
    {"decode with top-K 0.5, 2 heads of 80, pages of 16", 2, 80, 1, 1, 16, -1, 0.5f, {16}, {0}},
    {"decode with top-K 0.5, 1 head of 96, one delegated", 1, 96, 7, 1, 16, 3, 0.5f,
     {16, 16, 7, 16, 12, 16, 3}, {0, 0, 0, 0, 0, 0, 0}},
    {"prefill and decode in one step, top-K 0.5, 2 heads of 128, pages of 5", 2, 128, 7, 4, 5, -1, 0.5f,
     {0, 16, 9, 0, 13, 0, 5}, {0, 3, 3, 3, 3, 4, 3}},
    {"prefill of 17 through the cache kernel, 3 heads of 48", 3, 48, 1, 17, 16, -1, 1, {0}, {0}},
    {"3 rows after 9 and 16 cached, top-K 0.5 (not decode: all keys), 2 heads of 80, pages of 5", 2, 80, 2, 3, 5,
     -1, 0.5f, {9, 16}, {0, 1}},
    {"decode after 200 and 130 cached (more keys than threads), top-K 0.5, 1 head of 80", 1, 80, 2, 1, 16, -1, 0.5f,
     {200, 130}, {0, 0}},
    {"decode of 701, 301, 256, 512 and 40 keys (3, 2, 1, 2, 1 spans), 2 heads of 64, one delegated",
     2, 64, 6, 1, 16, 5, 1, {700, 300, 255, 511, 39, 600}, {0, 0, 0, 0, 0, 0}},
    {"3 rows after 600 and 255 cached (keys 256 to 258: a span's end), 1 padding, 1 head of 80",
     1, 80, 2, 3, 5, -1, 1, {600, 255}, {1, 0}},
    {"2 rows after 530 cached, top-K 0.5 (not decode: spans), 3 heads of 48, pages of 5",
     3, 48, 1, 2, 5, -1, 0.5f, {530}, {0}},
    {"decode of 300 and 41 keys, 3 heads of 36 (rows read value by value)", 3, 36, 2, 1, 16, -1, 1,
     {299, 40}, {0, 0}},
    {"decode of 6,600 and 6,561 keys, top-K 0.002 (scores in the workspace), 1 head of 64", 1, 64,
     2, 1, 16, -1, 0.002f, {6599, 6560}, {0, 0}},
};

static void test_attention(void) {
    if (!gpu_ready()) return;
    uint64_t seed = 31;
    attn_stats st, split_st;
    memset(&st, 0, sizeof st);
    memset(&split_st, 0, sizeof split_st);
    for (size_t i = 0; i < sizeof ATTN_CASES / sizeof *ATTN_CASES; i++)
        for (int q4 = 0; q4 <= 1; q4++) {
            fp16 *alone = NULL; /* attention_kernel's bits, which top-K's split must give */
            uint64_t alone_seed = seed; /* its rows */
            for (int split = 0; split <= 3; split++) {
                const step_case *c = &ATTN_CASES[i];
                int top_k_split = split == 3 && takes_top_k(c) && longest(c) > FG_CUDA_MIN_SPAN_KEYS;
                attn_setup s;
                attn_setup_init(&s, c, q4, top_k_split ? &alone_seed : &seed);
                s.split = split;
                attn_setup_upload(&s);
                fp16 *got = host_array<fp16>((size_t)s.rows * s.h);
                char what[200];
                const char *path = !split ? "attention_kernel"
                                   : takes_top_k(c) && split == 2 ? "queue_attention (top-K, room for a row)"
                                   : top_k_split ? "queue_attention (top-K: the split's spans score, then attention_kernel)"
                                   : takes_top_k(c) ? "queue_attention (top-K: attention_kernel)"
                                   : split == 2 ? "queue_attention (room for a row: runs of a row)"
                                   : split == 3 ? "attention_span_kernel and the merge, shortest spans"
                                                : "attention_span_kernel and the merge";
                const char *cache = q4 ? "4-bit" : "fp16";
                snprintf(what, sizeof what, "%s, %s, %s cache", path, c->what, cache);
                size_t bytes = (size_t)s.rows * s.h * sizeof(fp16);
                run_in_every_order(what, run_attention, &s, s.dev_attn, bytes, got);
                int64_t want = !split ? 1 : split == 2 ? 2 * s.rows : 2;
                if (split && takes_top_k(c)) want = split == 2 && top_k_row_slots(c) ? s.rows : 1;
                if (top_k_split) { /* runs of the decode rows whose scores the workspace holds, two launches each */
                    size_t fit = s.span_slots / fg_cuda_top_k_slots(c->heads, c->head_dim, longest(c));
                    want = 2 * (int64_t)(((size_t)s.rows + fit - 1) / fit);
                }
                EXPECT(s.launches == want, "%s: %lld launches, expected %lld", what,
                       (long long)s.launches, (long long)want);
                check_attention(&s, got, what, 0, split && !takes_top_k(c) ? &split_st : &st);
                if (!split) alone = got;
                else if (top_k_split)
                    EXPECT(memcmp(got, alone, bytes) == 0, "%s: not the bits of attention_kernel alone", what);
                if (split) free(got);
                attn_setup_free(&s);
            }
            free(alone);
        }
    /* a few left out is chance; most would mean the cut rule is wrong */
    st.sparse += split_st.sparse;
    st.left_out += split_st.left_out;
    EXPECT(st.left_out * 10 <= st.sparse, "attention_kernel: %d of %d sparse queries left out for a cut "
           "within the bound", st.left_out, st.sparse);
    printf("(worst %.2f of the bound, %.2f split; %d of %d sparse queries left out) ", st.worst,
           split_st.worst, st.left_out, st.sparse);
}

/* Top-K over exact ties: the 16 earlier keys of each (sequence, head) are levels x one direction,
 * with levels [1 2 2 0 2 1 3 2 0 1 2 3 1 2 0 1] rotated: two 3s, six 2s, five 1s, three 0s, whose
 * weights are e apart; identical keys tie exactly on each side. Keeping 5 cuts the 2s, 9 cuts the
 * 1s, 8 falls between levels, 0 keeps the new token alone. Values are one-hot (value j is unit
 * vector j), so output element j is nonzero exactly when key j was kept. On the emulated GPU the
 * kernel loads every key's K row and the V rows of the kept keys alone (§5). */
static void test_attention_ties(void) {
    if (!gpu_ready()) return;
    static const int levels[16] = {1, 2, 2, 0, 2, 1, 3, 2, 0, 1, 2, 3, 1, 2, 0, 1};
    static const float sparsities[] = {0.05f, 0.35f, 0.5f, 0.6f};
    step_case c = {"top-K over ties, 2 heads of 48, pages of 5", 2, 48, 2, 1, 5, -1, 1, {16, 16}, {0, 0}};
    int hd = c.head_dim, h = c.heads * hd;
    float scale = 1.0f / sqrtf((float)hd), alpha = 1 / (scale * 0.25f * (float)hd); /* q.k = level */
    uint64_t seed = 41;
    attn_stats st;
    memset(&st, 0, sizeof st);
    for (size_t si = 0; si < sizeof sparsities / sizeof *sparsities; si++)
        for (int q4 = 0; q4 <= 1; q4++) {
            c.sparsity = sparsities[si];
            attn_setup s;
            attn_setup_init(&s, &c, q4, &seed);
            fp16 *k = host_array<fp16>((size_t)h), *v = host_array<fp16>((size_t)h);
            for (int b = 0; b < c.batch; b++)
                for (int j = 0; j <= 16; j++) { /* key j (16: this step's, in qkv) */
                    for (int head = 0; head < c.heads; head++) {
                        float level = j == 16 ? 1.5f : (float)levels[(j + 3 * (2 * b + head)) % 16];
                        for (int d = 0; d < hd; d++) {
                            float dir = d % 3 == 0 ? -0.5f : 0.5f; /* |dir|^2 = 1/4 */
                            k[head * hd + d] = fp32_to_fp16(level * dir);
                            v[head * hd + d] = fp32_to_fp16(d == j ? 1.0f : 0.0f);
                            if (j == 16) s.qkv[(size_t)b * 3 * h + head * hd + d] = fp32_to_fp16(alpha * dir);
                        }
                    }
                    if (j < 16) {
                        write_row(row_at(&s.cache, 0, b, j), k, c.heads, hd, q4);
                        write_row(row_at(&s.cache, 1, b, j), v, c.heads, hd, q4);
                    } else {
                        memcpy(s.qkv + (size_t)b * 3 * h + h, k, (size_t)h * sizeof(fp16));
                        memcpy(s.qkv + (size_t)b * 3 * h + 2 * h, v, (size_t)h * sizeof(fp16));
                    }
                }
            attn_setup_upload(&s);
            fp16 *got = host_array<fp16>((size_t)s.rows * h);
            char what[160];
            snprintf(what, sizeof what, "attention_kernel, %s, top-K %g, %s cache", c.what, (double)c.sparsity,
                     q4 ? "4-bit" : "fp16");
            long long before = emu_count(EMU_KV_LOAD_BYTES);
            run_in_every_order(what, run_attention, &s, s.dev_attn, (size_t)s.rows * h * sizeof(fp16), got);
            check_attention(&s, got, what, 1, &st);
            if (before >= 0) { /* 16 cached rows and this step's of K; of V, the kept ones alone */
                long long cached = q4 ? hd : 2 * hd, fresh = 2 * hd, keep = (long long)floorf(c.sparsity * 16);
                long long want = (long long)c.batch * c.heads * (16 * cached + fresh + keep * cached + fresh);
                long long read = (emu_count(EMU_KV_LOAD_BYTES) - before) / EVERY_ORDER;
                EXPECT(read == want, "%s: %lld bytes of K and V rows loaded, expected %lld (every key's K, the "
                       "kept keys' V)", what, read, want);
            }
            free(k);
            free(v);
            free(got);
            attn_setup_free(&s);
        }
    printf("(worst %.2f of the bound) ", st.worst);
}

/* keep_largest alone: the list kept[0 .. keep) of n weights, one block of `threads`. */
__global__ void keep_largest_kernel(const float *w, int n, int keep, int *kept) {
    __shared__ top_k_select selection;
    keep_largest(w, n, keep, kept, &selection);
}

typedef struct {
    const float *w;
    int n, keep, threads;
    int *kept;
} select_args;

static void run_select(void *p) {
    select_args *a = (select_args *)p;
    poison(a->kept, (size_t)a->n * sizeof(int));
    keep_largest_kernel<<<1, a->threads, 0, ctx()->stream>>>(a->w, a->n, a->keep, a->kept);
    LAUNCHED("keep_largest_kernel");
    wait_stream();
}

/* The weights of the selection cases: a kind, n of them. */
static void select_weights(int kind, int n, uint64_t *seed, float *w) {
    float sum = 0;
    for (int j = 0; j < n; j++) {
        float u = test_uniform(seed);
        switch (kind) {
        case 0: w[j] = u; break;                                                 /* distinct */
        case 1: w[j] = (float)(int)(4 * u) * 0.125f; break;                      /* 4 levels, one 0 */
        case 2: w[j] = 1.0f + (float)(int)(256 * u) * 0x1p-23f; break;          /* one last byte apart */
        case 3: w[j] = 0.375f; break;                                            /* all one tie */
        case 4: w[j] = u < 0.7f ? 0 : u < 0.9f ? 0x1p-140f * (float)(int)(8 * u) : u; break; /* 0s, subnormals */
        default: w[j] = expf(8 * u), sum += w[j];                               /* a softmax */
        }
    }
    if (kind == 5)
        for (int j = 0; j < n; j++) w[j] /= sum;
}

/* keep_largest against quant.c's topk_keep (the CPU's top-K): the same list of keys, exactly, for
 * distinct weights, ties of whole values and of a last byte (the passes' last), one value
 * throughout, zeros with subnormals, and a softmax's weights; keep 0, 1, a third, a half and one,
 * n - 1; n of 1 to 9,000 (ties in many threads' runs, and runs of none), 256 threads (the
 * kernel's) and 96. */
static void test_top_k_select(void) {
    if (!gpu_ready()) return;
    static const int ns[] = {1, 2, 33, 700, 9000};
    uint64_t seed = 53;
    for (int kind = 0; kind <= 5; kind++)
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
            int n = ns[ni];
            float *w = host_array<float>((size_t)n), *scratch = host_array<float>((size_t)n);
            int *want = host_array<int>((size_t)n), *got = host_array<int>((size_t)n);
            select_weights(kind, n, &seed, w);
            select_args a = {device_copy(w, (size_t)n), n, 0, ATTENTION_THREADS, device_array<int>((size_t)n)};
            int keeps[] = {0, 1, n / 3, n / 2 + 1, n - 1};
            for (size_t ki = 0; ki < sizeof keeps / sizeof *keeps; ki++)
                for (int threads = 96; threads <= ATTENTION_THREADS; threads += ATTENTION_THREADS - 96) {
                    a.keep = keeps[ki] < n ? keeps[ki] : n - 1;
                    a.threads = threads;
                    char what[160];
                    snprintf(what, sizeof what, "keep_largest, weights of kind %d, %d of %d, %d threads", kind,
                             a.keep, n, threads);
                    run_in_every_order(what, run_select, &a, a.kept, (size_t)n * sizeof(int), got);
                    int kept = topk_keep(w, n, a.keep, want, scratch), bad = 0, first_bad = -1;
                    for (int i = 0; i < kept; i++)
                        if (got[i] != want[i] && !bad++) first_bad = i;
                    EXPECT(kept == a.keep, "topk_keep kept %d of %d, not %d", kept, n, a.keep);
                    EXPECT(bad == 0, "%s: %d of the list's keys differ from topk_keep's; entry %d: expected key %d "
                           "(weight %a), got %d", what, bad, first_bad, first_bad >= 0 ? want[first_bad] : 0,
                           first_bad >= 0 ? (double)w[want[first_bad]] : 0.0, first_bad >= 0 ? got[first_bad] : 0);
                }
            cuda_free((void *)a.w);
            cuda_free(a.kept);
            free(w);
            free(scratch);
            free(want);
            free(got);
        }
}

/* ============================================================================================
 * layer_norm_kernel
 * ============================================================================================ */

typedef struct {
    int rows, dim, alias;
    const fp16 *x_host;
    __half *x, *y; /* y == x when alias */
    const fp16 *w, *b; /* device */
} ln_args;

static void run_layer_norm(void *p) {
    ln_args *a = (ln_args *)p;
    size_t bytes = (size_t)a->rows * a->dim * sizeof(fp16);
    upload(a->x, a->x_host, bytes); /* aliased, the last run wrote over it */
    if (!a->alias) poison(a->y, bytes);
    layer_norm(a->x, a->rows, a->dim, a->w, a->b, a->y);
    wait_stream();
}

/* Row r of x against (L): the largest error as a fraction of its bound, or -1 (and what) if one
 * is beyond it. */
static double check_norm_row(const fp16 *x, const fp16 *w, const fp16 *b, const fp16 *got, int dim, char *what, size_t size) {
    double sum = 0, abs_sum = 0, var = 0, worst = 0;
    for (int i = 0; i < dim; i++) sum += half_value(x[i]), abs_sum += fabs(half_value(x[i]));
    double mean = sum / dim;
    for (int i = 0; i < dim; i++) var += (half_value(x[i]) - mean) * (half_value(x[i]) - mean);
    double inv = 1 / sqrt(var / dim + 1e-5), dm = gamma_n(dim) * abs_sum / dim + U * fabs(mean);
    for (int i = 0; i < dim; i++) {
        double t = (half_value(x[i]) - mean) * inv * half_value(w[i]), y = t + half_value(b[i]);
        double E = 1.01 * (dm * inv * fabs(half_value(w[i])) + fabs(t) * (gamma_n(dim) / 2 + 8 * U) + U * fabs(y));
        double bound = E + h16(fabs(y) + E), err = fabs(half_value(got[i]) - y);
        if (!(err <= bound)) {
            snprintf(what, size, "element %d: expected %.7g within %.3g, got %.7g", i, y, bound, half_value(got[i]));
            return -1;
        }
        worst = fmax(worst, err / bound);
    }
    return worst;
}

/* dims below and above the block's 1024 threads and their first round of 4 loads each (4096),
 * not multiples of 64; rows 1 and 7; each row's own mean and spread; y == x must give the same
 * bits as a separate y. */
static void test_layer_norm(void) {
    if (!gpu_ready()) return;
    static const int dims[] = {80, 144, 600, 1100, 4500}, row_counts[] = {1, 7};
    uint64_t seed = 51;
    double worst = 0;
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++)
        for (size_t ri = 0; ri < sizeof row_counts / sizeof *row_counts; ri++) {
            int dim = dims[di], rows = row_counts[ri];
            size_t n = (size_t)rows * dim;
            fp16 *x = host_array<fp16>(n);
            for (int r = 0; r < rows; r++) {
                float center = (float)(r % 3 - 1) * 2, spread = 0.5f + (float)(r % 4);
                for (int i = 0; i < dim; i++) x[(size_t)r * dim + i] = random_half(&seed, center - spread, center + spread);
            }
            fp16 *w = random_halves((size_t)dim, &seed, 0.5f, 1.5f), *b = random_halves((size_t)dim, &seed, -0.5f, 0.5f);
            ln_args a = {rows, dim, 0, x, device_array<__half>(n), device_array<__half>(n),
                         device_copy(w, (size_t)dim), device_copy(b, (size_t)dim)};
            fp16 *got = host_array<fp16>(n), *aliased = host_array<fp16>(n);
            char what[96];
            snprintf(what, sizeof what, "layer_norm_kernel, %d rows of %d", rows, dim);
            run_in_every_order(what, run_layer_norm, &a, a.y, n * sizeof(fp16), got);
            for (int r = 0; r < rows; r++) {
                char why[200];
                double ratio = check_norm_row(x + (size_t)r * dim, w, b, got + (size_t)r * dim, dim, why, sizeof why);
                EXPECT(ratio >= 0, "%s, row %d: %s", what, r, ratio >= 0 ? "" : why);
                worst = fmax(worst, ratio);
            }
            __half *y = a.y;
            a.alias = 1, a.y = a.x;
            snprintf(what, sizeof what, "layer_norm_kernel, %d rows of %d, y == x", rows, dim);
            run_in_every_order(what, run_layer_norm, &a, a.y, n * sizeof(fp16), aliased);
            EXPECT(memcmp(got, aliased, n * sizeof(fp16)) == 0, "%s: not the bits of a separate y", what);
            cuda_free(a.x);
            cuda_free(y);
            cuda_free((void *)a.w);
            cuda_free((void *)a.b);
            free(x);
            free(w);
            free(b);
            free(got);
            free(aliased);
        }
    printf("(worst %.2f of the bound) ", worst);
}

/* layer_norm_kernel with a bias to add first (bias_layer_norm: out_proj's bias, then the norm,
 * in one launch) against its two steps apart, bias_kernel's OUT_ADD and layer_norm_kernel: the
 * same bits in x and in y, y apart and y == x. */
static void test_bias_layer_norm(void) {
    if (!gpu_ready()) return;
    static const int dims[] = {80, 600};
    uint64_t seed = 53;
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++)
        for (int alias = 0; alias <= 1; alias++) {
            int dim = dims[di], rows = 5;
            size_t n = (size_t)rows * dim, bytes = n * sizeof(fp16);
            fp16 *x = random_halves(n, &seed, -3, 3), *add = random_halves((size_t)dim, &seed, -2, 2);
            fp16 *w = random_halves((size_t)dim, &seed, 0.5f, 1.5f), *b = random_halves((size_t)dim, &seed, -0.5f, 0.5f);
            __half *dx = device_array<__half>(n), *dy = device_array<__half>(n);
            __half *y = alias ? dx : dy;
            const fp16 *d_add = device_copy(add, (size_t)dim), *dw = device_copy(w, (size_t)dim), *db = device_copy(b, (size_t)dim);
            fp16 *apart_x = host_array<fp16>(n), *apart_y = host_array<fp16>(n), *fused_x = host_array<fp16>(n), *fused_y = host_array<fp16>(n);
            upload(dx, x, bytes);
            bias_kernel<<<blocks_for(n, 256), 256, 0, ctx()->stream>>>(dx, n, dim, (const __half *)d_add, 0);
            LAUNCHED("bias_kernel");
            layer_norm(dx, rows, dim, dw, db, y);
            wait_stream();
            download(apart_x, dx, bytes);
            download(apart_y, y, bytes);
            upload(dx, x, bytes);
            bias_layer_norm(dx, rows, dim, d_add, dw, db, y);
            wait_stream();
            download(fused_x, dx, bytes);
            download(fused_y, y, bytes);
            EXPECT(!memcmp(apart_x, fused_x, bytes) && !memcmp(apart_y, fused_y, bytes), "bias_layer_norm, %d rows of %d%s: "
                   "not the bits of bias_kernel then layer_norm_kernel", rows, dim, alias ? ", y == x" : "");
            cuda_free(dx), cuda_free(dy), cuda_free((void *)d_add), cuda_free((void *)dw), cuda_free((void *)db);
            free(x), free(add), free(w), free(b), free(apart_x), free(apart_y), free(fused_x), free(fused_y);
        }
}

/* ============================================================================================
 * linear(): cuBLAS, or 4-bit (q4_rows_kernel, or widened slices and cuBLAS), then
 * bias_kernel
 * ============================================================================================ */

typedef struct {
    cuda_ws *d;        /* the 4-bit products' scratch */
    int rows, in, out, mode, q4;
    const __half *x;
    const void *W;     /* device: fp16, or 4-bit (q4) */
    const fp16 *b;     /* device; may be NULL */
    const fp16 *y0;    /* host: y before (OUT_ADD's residual) */
    __half *y;
} linear_args;

static void run_linear(void *p) {
    linear_args *a = (linear_args *)p;
    size_t bytes = (size_t)a->rows * a->out * sizeof(fp16);
    if (a->mode == OUT_ADD) upload(a->y, a->y0, bytes);
    else poison(a->y, bytes); /* beta 0: cuBLAS must not read it */
    linear(a->d, a->x, a->rows, a->in, a->W, a->q4, a->b, a->out, a->y, a->mode);
    wait_stream();
}

/* A workspace with only the 4-bit scratch, for products of `rows` x `in` x `out`: the partial
 * sums, or a slice of widen_values values (small, so that a product takes several slices); and
 * the groups' counts of chunks done, zeros (q4_test_groups: up to 3 parts). */
static int q4_test_groups(int out) { return out / 64 + 3; }

static cuda_ws q4_workspace(int rows, int in, int out, size_t widen_values) {
    cuda_ws d;
    memset(&d, 0, sizeof d);
    int k_chunk = fg_cuda_q4_k_chunk(in, out, rows);
    size_t partials = (size_t)(in + k_chunk - 1) / k_chunk * rows * out;
    d.widen_values = widen_values;
    d.q4_scratch = device_array<float>(partials > widen_values ? partials : widen_values);
    unsigned *zeros = (unsigned *)calloc((size_t)q4_test_groups(out), sizeof(unsigned));
    d.q4_done = device_array<unsigned>((size_t)q4_test_groups(out));
    upload(d.q4_done, zeros, (size_t)q4_test_groups(out) * sizeof(unsigned));
    free(zeros);
    return d;
}

/* Whether the groups' counts of chunks done are zeros again, as the next product needs. */
static int q4_counts_back_to_zero(const cuda_ws *d, int out) {
    unsigned *counts = host_array<unsigned>((size_t)q4_test_groups(out));
    download(counts, d->q4_done, (size_t)q4_test_groups(out) * sizeof(unsigned));
    int zero = 1;
    for (int g = 0; g < q4_test_groups(out); g++) zero &= counts[g] == 0;
    free(counts);
    return zero;
}

/* A 4-bit copy of W [in][out] of `parts` parts on the device as quant.c stores a matrix (outer
 * in parts, len out / parts, inner 1), `offset` bytes into its allocation (2: its words not 4-byte
 * aligned); into W32, the values the product multiplies: q4_decompress's, rounded to fp16 (both
 * products, from the codes and widened, multiply fp16 values). */
static void *q4_matrix(const float *W, int in, int out, int parts, int offset, float *W32, void **allocation) {
    size_t n = (size_t)in * out, outer = (size_t)in * parts, len = (size_t)(out / parts);
    size_t bytes = q4_bytes(outer, len, 1);
    uint8_t *q = host_array<uint8_t>(bytes);
    q4_compress(W, outer, len, 1, q);
    q4_decompress(q, outer, len, 1, W32);
    for (size_t i = 0; i < n; i++) W32[i] = half_value(fp32_to_fp16(W32[i]));
    uint8_t *dev = device_array<uint8_t>(bytes + (size_t)offset);
    upload(dev + offset, q, bytes);
    free(q);
    *allocation = dev;
    return dev + offset;
}

/* The bound of a cuBLAS product's value g = r (+ y0 where it adds): r's k terms of absolute sum A
 * summed in fp32 (on tensor cores, whose additions may truncate), then y's rounding, to fp16 or
 * fp32. Where it adds to an fp16 y, cuBLAS may first round the product to y's fp16 (on an H200 it
 * did for 7 rows), a rounding of the product's size, not of the sum's. */
static double product_bound(double A, double r, double g, int k, int adds, int fp32_out) {
    double e_sum = (gamma_n(k) + gamma_blas(k + 1)) * A;
    double e_product = adds && !fp32_out ? h16(fabs(r) + e_sum) : 0;
    double e_out = fp32_out ? U * (fabs(g) + e_sum) : h16(fabs(g) + e_sum + e_product);
    return e_sum + e_product + e_out;
}

/* q4: 0 (fp16), or W's 4-bit parts. */
static void linear_case(int rows, int in, int out, int with_bias, int mode, int q4, int offset, uint64_t *seed,
                        double *worst) {
    static const char *const modes[] = {"OUT_SET", "OUT_ADD", "OUT_RELU"};
    size_t nx = (size_t)rows * in, nw = (size_t)in * out, ny = (size_t)rows * out;
    fp16 *x = random_halves(nx, seed, -1, 1), *W = random_halves(nw, seed, -0.2f, 0.2f);
    fp16 *b = random_halves((size_t)out, seed, -0.5f, 0.5f), *y0 = random_halves(ny, seed, -2, 2);
    float *x32 = widened(x, nx), *W32 = widened(W, nw);
    void *W_dev = NULL, *allocation = NULL;
    cuda_ws d = q4_workspace(rows, in, out, 3 * (size_t)in);
    if (q4) W_dev = q4_matrix(W32, in, out, q4, offset, W32, &allocation);
    else allocation = W_dev = device_copy(W, nw);
    linear_args a = {&d, rows, in, out, mode, q4, (const __half *)device_copy(x, nx), W_dev,
                     with_bias ? device_copy(b, (size_t)out) : NULL, y0, device_array<__half>(ny)};
    fp16 *got = host_array<fp16>(ny);
    char what[160];
    snprintf(what, sizeof what, "linear, %d x %d times %d x %d%s in %d part(s), %s, %s", rows, in, in, out,
             !q4 ? "" : rows > FG_CUDA_Q4_DIRECT ? " 4-bit (widened)" : offset % 4 ? " 4-bit (unaligned)" : " 4-bit",
             q4 ? q4 : 1, modes[mode], with_bias ? "bias" : "no bias");
    long long copied = emu_count(EMU_ASYNC_BYTES);
    run_in_every_order(what, run_linear, &a, a.y, ny * sizeof(fp16), got);
    if (q4 && rows <= FG_CUDA_Q4_DIRECT && copied >= 0) {
        /* one pass over the codes: a row's 32 bytes a group, the 4-byte words of its min and scale
         * (none where W does not lie on 4 bytes, whose bytes are read by plain loads) */
        long long groups = q4 * ((out / q4 + 63) / 64);
        long long expected = offset % 4 ? 0 : (long long)in * groups * (32 + 2 * 4);
        long long run = async_bytes_a_run(copied);
        EXPECT(run == expected, "%s: its copies read %lld bytes, one pass over the codes %lld", what, run, expected);
        EXPECT(q4_counts_back_to_zero(&d, out), "%s: the groups' counts of chunks done are not zeros after it", what);
    }
    int bad = 0;
    char first[200] = "";
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < out; j++) {
            size_t at = (size_t)i * out + j;
            double A = mode == OUT_ADD ? fabs(half_value(y0[at])) : 0, r = 0;
            for (int k = 0; k < in; k++) {
                double term = (double)x32[(size_t)i * in + k] * W32[(size_t)k * out + j];
                r += term;
                A += fabs(term);
            }
            double g = r + (mode == OUT_ADD ? half_value(y0[at]) : 0), y = g + (with_bias ? half_value(b[j]) : 0);
            if (mode == OUT_RELU && y < 0) y = 0;
            double bound = product_bound(A, r, g, in, mode == OUT_ADD, 0);
            if (with_bias) {
                double e_add = U * (fabs(y) + bound);
                bound += e_add + h16(fabs(y) + bound + e_add);
            }
            bound *= 1.01;
            double err = fabs(half_value(got[at]) - y);
            if (!(err <= bound) && !bad++)
                snprintf(first, sizeof first, "row %d, column %d: expected %.7g within %.3g, got %.7g", i, j, y,
                         bound, half_value(got[at]));
            if (err <= bound) *worst = fmax(*worst, err / bound);
        }
    EXPECT(bad == 0, "%s: %d values off; the first: %s", what, bad, first);
    cuda_free((void *)a.x);
    cuda_free(allocation);
    cuda_free((void *)a.b);
    cuda_free(a.y);
    cuda_free(d.q4_scratch);
    cuda_free(d.q4_done);
    free(x);
    free(W);
    free(b);
    free(y0);
    free(x32);
    free(W32);
    free(got);
}

/* q|k|v's shape (144 -> 432), a square one, 80 -> 160, every mode; and one without a bias (a
 * projection's), set and added: without a bias linear() ends after the product, with no ReLU,
 * as opt_model.c's does, and ReLU layers (fc1) always have one. */
static void test_linear(void) {
    if (!gpu_ready()) return;
    static const int shapes[][4] = {{7, 144, 432, 1}, {1, 144, 144, 1}, {7, 80, 160, 1}, {7, 144, 80, 0}};
    uint64_t seed = 61;
    double worst = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int mode = OUT_SET; mode <= (shapes[i][3] ? OUT_RELU : OUT_ADD); mode++)
            linear_case(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], mode, 0, 0, &seed, &worst);
    printf("(worst %.2f of the bound) ", worst);
}

/* 4-bit W, read as stored: 1 to 32 rows from the codes (q4_rows_kernel over groups of 64 columns
 * and chunks of W's rows, one chunk or several, the last one short; one and two tiles of 16 rows
 * of x; the chunks' sums by each group's last block, its count of chunks zero after), 36 and 40
 * rows through widened slices of 3 columns of W at a time; `out` not a multiple of 64 or 8 (a
 * narrow last group, a last word of codes past it), `in` not a multiple of 16 and odd (rows of x
 * not 4-byte aligned), codes not 4-byte aligned, q|k|v's 3 parts (of 144 and of 20 columns, a
 * word of codes past each). The codes copied 16 bytes at a time (out 256 and 3 parts of 256:
 * groups whose rows lie on 16 bytes), 4 and 1, with more steps a warp than its ring holds (in
 * 1999), and on the emulated GPU, the copies reading the codes once. Each mode, with and without
 * a bias. */
static void test_q4_linear(void) {
    if (!gpu_ready()) return;
    static const int shapes[][6] = {/* rows, in, out, parts, bias, byte offset of W */
                                    {1, 300, 200, 1, 1, 0}, {3, 144, 600, 1, 1, 0}, {8, 130, 70, 1, 0, 0},
                                    {3, 96, 13, 1, 1, 2},   {2, 144, 432, 3, 1, 0}, {5, 70, 60, 3, 1, 0},
                                    {9, 144, 200, 1, 1, 0}, {32, 70, 130, 1, 0, 0}, {12, 80, 60, 3, 1, 0},
                                    {27, 96, 70, 1, 1, 2},  {40, 70, 130, 1, 0, 0}, {36, 80, 60, 3, 1, 0},
                                    {4, 1100, 130, 1, 1, 0}, {20, 3000, 70, 1, 1, 0}, {3, 97, 64, 1, 0, 2},
                                    {20, 1999, 256, 1, 1, 0}, {6, 1999, 768, 3, 1, 0}, {24, 520, 768, 3, 0, 0}};
    uint64_t seed = 67;
    double worst = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        int modes = (shapes[i][4] ? OUT_RELU : OUT_ADD) - OUT_SET + 1;
        for (int mode = OUT_SET; mode < OUT_SET + modes; mode++) {
            /* make test-san: each shape in one mode, the modes in turn (make test checks the numbers
               of all) */
            if (SANITIZERS_ONE_DIAGONAL && (mode - OUT_SET) != (int)(i % (size_t)modes)) continue;
            linear_case(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][4], mode, shapes[i][3], shapes[i][5],
                        &seed, &worst);
        }
    }
    printf("(worst %.2f of the bound) ", worst);
}

/* ============================================================================================
 * fp16_product: cuBLAS's default, or a cublasLt algorithm timed once a shape
 * ============================================================================================ */

/* One product of fp16_product, y [n][m] = x [n][k] op(W) + beta y0 (column-major, as cuBLAS sees
 * it), on the device: W m x k (op N) or k x m (op T), x k x n, y m x n of fp16 or fp32. */
typedef struct {
    const char *what;
    cublasOperation_t op_w;
    int m, n, k;
    float beta;
    cudaDataType y_type;
    float *W, *x, *y0; /* host: the values, as the device holds them */
    void *W_dev, *x_dev, *y_dev;
    size_t shift[3]; /* bytes from each device operand's allocation to it (product_case_shift) */
} product_case;

static product_case product_case_make(const char *what, cublasOperation_t op_w, int m, int n, int k,
                                      float beta, cudaDataType y_type, uint64_t *seed) {
    product_case p = {what, op_w, m, n, k, beta, y_type, NULL, NULL, NULL, NULL, NULL, NULL, {0, 0, 0}};
    fp16 *W = random_halves((size_t)m * k, seed, -0.2f, 0.2f);
    fp16 *x = random_halves((size_t)k * n, seed, -1, 1);
    fp16 *y0 = random_halves((size_t)m * n, seed, -2, 2);
    p.W = widened(W, (size_t)m * k);
    p.x = widened(x, (size_t)k * n);
    p.y0 = widened(y0, (size_t)m * n);
    p.W_dev = device_copy(W, (size_t)m * k);
    p.x_dev = device_copy(x, (size_t)k * n);
    p.y_dev = device_array<float>((size_t)m * n);
    free(W);
    free(x);
    free(y0);
    return p;
}

/* Its device operands moved by the given bytes (fp16 elements apart) into allocations of their own,
 * as a small model's W or a part of the workspace lies: aligned to less than cudaMalloc's 256. */
static void product_case_shift(product_case *p, size_t w_bytes, size_t x_bytes, size_t y_bytes) {
    const float *values[2] = {p->W, p->x};
    size_t counts[2] = {(size_t)p->m * p->k, (size_t)p->k * p->n};
    void **devs[3] = {&p->W_dev, &p->x_dev, &p->y_dev};
    size_t shifts[3] = {w_bytes, x_bytes, y_bytes};
    for (int i = 0; i < 3; i++) {
        size_t bytes = i < 2 ? counts[i] * sizeof(fp16) : (size_t)p->m * p->n * sizeof(float);
        char *moved = device_array<char>(shifts[i] + bytes);
        if (i < 2) {
            fp16 *halves = host_array<fp16>(counts[i]);
            for (size_t j = 0; j < counts[i]; j++) halves[j] = fp32_to_fp16(values[i][j]);
            upload(moved + shifts[i], halves, bytes);
            free(halves);
        }
        cuda_free((char *)*devs[i] - p->shift[i]);
        *devs[i] = moved + shifts[i];
        p->shift[i] = shifts[i];
    }
}

static void product_case_free(product_case *p) {
    cuda_free((char *)p->W_dev - p->shift[0]);
    cuda_free((char *)p->x_dev - p->shift[1]);
    cuda_free((char *)p->y_dev - p->shift[2]);
    free(p->W);
    free(p->x);
    free(p->y0);
}

/* y as it starts: y0, in y's type. */
static void product_start(const product_case *p) {
    size_t n = (size_t)p->m * p->n;
    if (p->y_type == CUDA_R_32F) upload(p->y_dev, p->y0, n * sizeof(float));
    else {
        fp16 *y0 = host_array<fp16>(n);
        for (size_t i = 0; i < n; i++) y0[i] = fp32_to_fp16(p->y0[i]);
        upload(p->y_dev, y0, n * sizeof(fp16));
        free(y0);
    }
}

static void product_queue(cuda_ws *d, const product_case *p) {
    fp16_product(d, p->op_w, p->m, p->n, p->k, p->W_dev, p->x_dev, p->beta, p->y_dev, p->y_type);
}

/* y from y0, the product, waited for. */
static void product_run(cuda_ws *d, const product_case *p) {
    product_start(p);
    product_queue(d, p);
    wait_stream();
}

/* The product's y against the product in double, within product_bound (as test_linear's); `when`
 * says which call it was. */
static void product_check(const product_case *p, const char *when) {
    size_t n = (size_t)p->m * p->n;
    float *got = host_array<float>(n);
    if (p->y_type == CUDA_R_32F) download(got, p->y_dev, n * sizeof(float));
    else {
        fp16 *y = host_array<fp16>(n);
        download(y, p->y_dev, n * sizeof(fp16));
        for (size_t i = 0; i < n; i++) got[i] = half_value(y[i]);
        free(y);
    }
    int bad = 0;
    char first[200] = "";
    for (int col = 0; col < p->n; col++)
        for (int row = 0; row < p->m; row++) {
            double r = 0;
            double A = p->beta * fabs(p->y0[(size_t)col * p->m + row]);
            for (int i = 0; i < p->k; i++) {
                size_t w_at = p->op_w == CUBLAS_OP_N ? (size_t)i * p->m + row : (size_t)row * p->k + i;
                double term = (double)p->W[w_at] * p->x[(size_t)col * p->k + i];
                r += term;
                A += fabs(term);
            }
            double g = r + p->beta * p->y0[(size_t)col * p->m + row];
            double bound = 1.01 * product_bound(A, r, g, p->k, p->beta != 0, p->y_type == CUDA_R_32F);
            double err = fabs(got[(size_t)col * p->m + row] - g);
            if (!(err <= bound) && !bad++)
                snprintf(first, sizeof first, "y[%d][%d]: expected %.7g within %.3g, got %.7g", col, row, g, bound,
                         got[(size_t)col * p->m + row]);
        }
    EXPECT(bad == 0, "fp16_product, %s, %s: %d values off; the first: %s", p->what, when, bad, first);
    free(got);
}

/* What one product_run asked: its timing runs, cuBLAS products, and (on the emulated GPU; 0
 * natively) cublasLtMatmul calls of cublasLt's first and second algorithms. */
typedef struct {
    long long timed, products, lt_first, lt_second;
} product_counts;

static product_counts counted_run(cuda_ws *d, const product_case *p) {
    fg_device_counts before, after;
    long long first = emu_count(EMU_LT_FIRST), second = emu_count(EMU_LT_SECOND);
    cuda_counts(&before);
    product_run(d, p);
    cuda_counts(&after);
    product_counts n = {after.products_timed - before.products_timed, after.blas_calls - before.blas_calls, 0, 0};
    if (first >= 0) {
        n.lt_first = emu_count(EMU_LT_FIRST) - first;
        n.lt_second = emu_count(EMU_LT_SECOND) - second;
    }
    return n;
}

/* Timed (the default): a shape's first product queues the timing runs of every candidate (6 runs
 * each: on the emulated GPU cuBLAS's default and cublasLt's two algorithms whose workspace fits,
 * 18) and is cuBLAS's; once settled, a shape takes the fastest (on the emulated GPU, whose clock
 * makes cublasLt's second algorithm 10% faster than cuBLAS's default, that one) and is timed no
 * more. Every product, before and after, within its bound: q|k|v's shape and out's (which adds to
 * y: the timing runs go to the workspace's scratch, so y gets the product once), lm_head's (op T,
 * fp32 logits). A shape in a layer being captured is timed after the graph's launch, and its
 * product inside the graph is cuBLAS's; more rows than decode's (33) are never timed; an adding
 * product with no scratch is not timed. FLEXGEN_CUDA_PRODUCTS's other modes: cublas, cuBLAS's
 * default alone; cublaslt, cublasLt's first algorithm, untimed. */
static void test_product_choice(void) {
    if (!gpu_ready()) return;
    uint64_t seed = 71;
    int emulated = emu_count(EMU_LT_FIRST) >= 0;
    cuda_ws d;
    memset(&d, 0, sizeof d);
    d.widen_values = (size_t)1 << 16;
    d.q4_scratch = device_array<float>(d.widen_values / 2);
    d.graphs = 1;
    product_case cases[] = {
        product_case_make("q|k|v, 4 rows", CUBLAS_OP_N, 432, 4, 144, 0, CUDA_R_16F, &seed),
        product_case_make("out, 4 rows, added", CUBLAS_OP_N, 144, 4, 144, 1, CUDA_R_16F, &seed),
        product_case_make("lm_head, 3 rows", CUBLAS_OP_T, 500, 3, 144, 0, CUDA_R_32F, &seed),
        product_case_make("fc1, 33 rows", CUBLAS_OP_N, 576, 33, 144, 0, CUDA_R_16F, &seed),
        product_case_make("fc2, 32 rows, added, in a graph", CUBLAS_OP_N, 144, 32, 576, 1, CUDA_R_16F, &seed)};
    enum { QKV, OUT, LM_HEAD, ROWS_33, CAPTURED, N_CASES };
    products_reset(PRODUCTS_TIMED);
    for (int c = QKV; c <= ROWS_33; c++) {
        product_case *p = &cases[c];
        product_counts n = counted_run(&d, p);
        product_check(p, "first product");
        if (c == ROWS_33)
            EXPECT(n.timed == 0, "%s: %lld timing runs; more rows than decode's are not timed", p->what, n.timed);
        else if (emulated)
            EXPECT(n.timed == 18 && n.lt_first == 6 && n.lt_second == 6, "%s: %lld timing runs, %lld and %lld of "
                   "cublasLt's two algorithms; 18, 6 and 6 expected", p->what, n.timed, n.lt_first, n.lt_second);
        else EXPECT(n.timed >= 6 && n.timed % 6 == 0, "%s: %lld timing runs; 6 a candidate", p->what, n.timed);
        EXPECT(n.products == 1, "%s: %lld cuBLAS products counted; the product alone", p->what, n.products);
    }
    products_settle();
    for (int c = QKV; c <= ROWS_33; c++) {
        product_case *p = &cases[c];
        product_counts n = counted_run(&d, p);
        product_check(p, "settled");
        EXPECT(n.timed == 0, "%s: timed again once settled", p->what);
        if (emulated && c != ROWS_33)
            EXPECT(n.lt_second == 1, "%s: settled on another algorithm than the fastest (cublasLt's second on the "
                   "emulated GPU)", p->what);
    }

    /* In a layer being captured: cuBLAS's product in the graph; the timing after its launch */
    gpu_batch gb;
    memset(&gb, 0, sizeof gb);
    gb.batch = 1;
    gb.n_new = 1;
    cache_table t;
    memset(&t, 0, sizeof t);
    t.on_device = 1;
    fg_device_counts before, after;
    product_start(&cases[CAPTURED]);
    cuda_counts(&before);
    int captured = layer_graph_begins(&d, &gb, &t);
    CU_ASSERT(captured);
    product_queue(&d, &cases[CAPTURED]);
    cuda_counts(&after);
    EXPECT(after.products_timed == before.products_timed, "%s: timed inside the capture", cases[CAPTURED].what);
    layer_graph_ends(&d, captured);
    wait_stream();
    cuda_counts(&after);
    product_check(&cases[CAPTURED], "captured");
    long long timed = after.products_timed - before.products_timed;
    EXPECT(timed == (emulated ? 18 : timed) && timed >= 6, "%s: %lld timing runs after the graph's launch",
           cases[CAPTURED].what, timed);
    products_settle();
    product_run(&d, &cases[CAPTURED]);
    product_check(&cases[CAPTURED], "settled after the graph");

    /* An adding product with no scratch to time it in: cuBLAS's, untimed */
    products_reset(PRODUCTS_TIMED);
    cuda_ws bare = d;
    bare.q4_scratch = NULL;
    product_counts n = counted_run(&bare, &cases[OUT]);
    EXPECT(n.timed == 0, "%s, no scratch: timed", cases[OUT].what);

    /* Operands aligned to less than 256 bytes, as a small model's W and the workspace's parts lie.
     * A shape is also its operands' alignments, and the heuristic is told them: W, x or y moved
     * off 256 bytes alone makes a shape of its own, timed anew (on the emulated GPU an algorithm
     * given a matrix less aligned than it was chosen for writes NaN, as one gave wrong sums on an
     * H200); all three moved, for out (adding, timed into the scratch) and lm_head (op T, fp32).
     * No timing into a scratch less aligned than y. */
    products_reset(PRODUCTS_TIMED);
    product_run(&d, &cases[QKV]);
    products_settle();
    struct {
        int like;
        size_t w, x, y;
        const char *what;
    } moves[] = {{QKV, 64, 0, 0, "q|k|v, 4 rows, W 64 bytes on"},
                 {QKV, 0, 16, 0, "q|k|v, 4 rows, x 16 bytes on"},
                 {QKV, 0, 0, 32, "q|k|v, 4 rows, y 32 bytes on"},
                 {OUT, 64, 32, 16, "out, 4 rows, added, all moved"},
                 {LM_HEAD, 128, 64, 32, "lm_head, 3 rows, all moved"}};
    for (size_t c = 0; c < sizeof moves / sizeof moves[0]; c++) {
        const product_case *like = &cases[moves[c].like];
        product_case moved = product_case_make(moves[c].what, like->op_w, like->m, like->n, like->k,
                                               like->beta, like->y_type, &seed);
        product_case_shift(&moved, moves[c].w, moves[c].x, moves[c].y);
        n = counted_run(&d, &moved);
        EXPECT(n.timed > 0, "%s: not timed; took another alignment's choice", moved.what);
        product_check(&moved, "first product");
        products_settle();
        product_run(&d, &moved);
        product_check(&moved, "settled");
        product_case_free(&moved);
    }
    products_reset(PRODUCTS_TIMED);
    cuda_ws moved_scratch = d;
    moved_scratch.q4_scratch = (float *)((char *)d.q4_scratch + 64);
    n = counted_run(&moved_scratch, &cases[OUT]);
    EXPECT(n.timed == 0, "%s: timed into a scratch less aligned than y", cases[OUT].what);

    /* cublas: never cublasLt; cublaslt: its first algorithm, untimed */
    for (int mode = PRODUCTS_CUBLAS; mode <= PRODUCTS_CUBLASLT; mode++) {
        const char *name = mode == PRODUCTS_CUBLAS ? "cublas" : "cublaslt";
        products_reset(mode);
        n = counted_run(&d, &cases[QKV]);
        product_check(&cases[QKV], name);
        EXPECT(n.timed == 0, "%s, %s: timed", cases[QKV].what, name);
        if (emulated)
            EXPECT(n.lt_first == (mode == PRODUCTS_CUBLASLT) && n.lt_second == 0, "%s, %s: cublasLt's algorithms ran "
                   "%lld and %lld times", cases[QKV].what, name, n.lt_first, n.lt_second);
    }
    products_reset(products_mode(NULL) < 0 ? PRODUCTS_TIMED : products_mode(NULL));
    for (int c = 0; c < N_CASES; c++) product_case_free(&cases[c]);
    if (d.layer_graph) CUDA_CHECK(cudaGraphExecDestroy(d.layer_graph));
    cuda_free(d.q4_scratch);
}

/* ============================================================================================
 * gather_rows_kernel + add_positions_kernel
 * ============================================================================================ */

typedef struct {
    int rows, n_new;
    table_view table, pos;
    const int *ids, *past, *pad;
    __half *x;
} embed_args;

static void run_embed(void *p) {
    embed_args *a = (embed_args *)p;
    cudaStream_t s = ctx()->stream;
    poison(a->x, (size_t)a->rows * a->table.dim * sizeof(fp16));
    gather_rows_kernel<<<a->rows, 256, 0, s>>>(a->table, a->ids, a->x);
    LAUNCHED("gather_rows_kernel");
    add_positions_kernel<<<a->rows, 256, 0, s>>>(a->x, a->pos, a->past, a->pad, a->n_new);
    LAUNCHED("add_positions_kernel");
    wait_stream();
}

/* An embedding table [len][dim] on the device: its fp16 values, or 4-bit ones (q4: quant.c's
 * layout with outer 1), whose fp16 roundings replace `values`, as the kernels read them. */
static table_view device_table_of(fp16 *values, int q4, int len, int dim) {
    size_t n = (size_t)len * dim;
    if (!q4) return table_of(device_copy(values, n), 0, len, dim);
    float *x = widened(values, n);
    size_t bytes = q4_bytes(1, (size_t)len, (size_t)dim);
    uint8_t *q = host_array<uint8_t>(bytes);
    q4_compress(x, 1, (size_t)len, (size_t)dim, q);
    q4_decompress(q, 1, (size_t)len, (size_t)dim, x);
    for (size_t i = 0; i < n; i++) values[i] = fp32_to_fp16(x[i]);
    table_view t = table_of(device_copy(q, bytes), 1, len, dim);
    free(x);
    free(q);
    return t;
}

/* 7 sequences of 3 rows (prefill with 0 to 3 padding rows, decode past 5, 17, 30 with padding),
 * rows of 80, 144 and 300 (more than a block's threads), fp16 and 4-bit tables (a last group of
 * fewer than 64 rows): each value the fp16 rounding of token row + position row, padding rows at
 * position OPT_POS_OFFSET - 1. */
static void test_embed(void) {
    if (!gpu_ready()) return;
    enum { VOCAB = 50, MAX_POS = 40, B = 7, N_NEW = 3 };
    static const int dims[] = {80, 144, 300}, past[B] = {0, 0, 0, 0, 5, 17, 30}, pad[B] = {0, 1, 2, 3, 2, 2, 0};
    uint64_t seed = 71;
    for (int q4 = 0; q4 <= 1; q4++)
        for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
            int dim = dims[di], rows = B * N_NEW, ids[B * N_NEW];
            fp16 *table = random_halves((size_t)VOCAB * dim, &seed, -1, 1);
            fp16 *pos = random_halves((size_t)(MAX_POS + 2) * dim, &seed, -0.3f, 0.3f);
            for (int r = 0; r < rows; r++)
                ids[r] = r % N_NEW < pad[r / N_NEW] ? OPT_PAD_ID : (int)(test_uniform(&seed) * VOCAB);
            embed_args a = {rows, N_NEW, device_table_of(table, q4, VOCAB, dim),
                            device_table_of(pos, q4, MAX_POS + 2, dim), device_copy(ids, (size_t)rows),
                            device_copy(past, (size_t)B), device_copy(pad, (size_t)B),
                            device_array<__half>((size_t)rows * dim)};
            fp16 *got = host_array<fp16>((size_t)rows * dim);
            char what[128];
            snprintf(what, sizeof what, "gather_rows_kernel + add_positions_kernel, %s rows of %d",
                     q4 ? "4-bit" : "fp16", dim);
            run_in_every_order(what, run_embed, &a, a.x, (size_t)rows * dim * sizeof(fp16), got);
            int bad = 0;
            char first[200] = "";
            for (int r = 0; r < rows; r++) {
                int b = r / N_NEW, t = r % N_NEW;
                int position = t < pad[b] ? OPT_POS_OFFSET - 1 : past[b] + t - pad[b] + OPT_POS_OFFSET;
                for (int i = 0; i < dim; i++) {
                    float token_value = half_value(table[(size_t)ids[r] * dim + i]);
                    fp16 want = fp32_to_fp16(token_value + half_value(pos[(size_t)position * dim + i]));
                    if (got[(size_t)r * dim + i] != want && !bad++)
                        snprintf(first, sizeof first, "row %d (token %d, position %d), element %d: expected "
                                 "0x%04x, got 0x%04x", r, ids[r], position, i, want, got[(size_t)r * dim + i]);
                }
            }
            EXPECT(bad == 0, "%s: %d values differ; the first: %s", what, bad, first);
            cuda_free((void *)a.table.values);
            cuda_free((void *)a.pos.values);
            cuda_free((void *)a.ids);
            cuda_free((void *)a.past);
            cuda_free((void *)a.pad);
            cuda_free(a.x);
            free(table);
            free(pos);
            free(got);
        }
}

/* ============================================================================================
 * lm_head: 4-bit tables (q4_vocab_kernel, or widened slices and cuBLAS)
 * ============================================================================================ */

typedef struct {
    cuda_ws *d;
    model_weights w; /* cfg's vocab and word_dim, lm_head on the device, q4 */
    int rows;
    const __half *x;
    float *logits;
} lm_head_args;

static void run_lm_head(void *p) {
    lm_head_args *a = (lm_head_args *)p;
    poison(a->logits, (size_t)a->rows * a->w.cfg.vocab * sizeof(float));
    lm_head(a->d, &a->w, a->x, a->rows, a->logits);
    wait_stream();
}

/* logits = x E^T for a 4-bit E [vocab][dim] against the same in double on its values rounded to
 * fp16, within (gamma_dim + g_(dim + 1)) sum_i |x_i E_vi|: 1 to 32 rows from the codes (one and
 * two tiles of 16 rows of x; an odd vocabulary's last row alone, a last group of fewer than 64;
 * dim a multiple of 16, copied 16 bytes at a time, or not, a byte at a time with a short last step;
 * more steps a warp than its ring holds; on the emulated GPU, the copies reading the table once),
 * 40 rows through widened slices of 3 rows of E. */
static void test_q4_lm_head(void) {
    if (!gpu_ready()) return;
    static const int shapes[][3] = {{1, 80, 130}, {3, 144, 64}, {8, 300, 71}, {9, 80, 130}, {32, 100, 70},
                                    {17, 1104, 130}, {5, 1000, 200}, {40, 80, 130}};
    uint64_t seed = 73;
    double worst = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int rows = shapes[s][0], dim = shapes[s][1], vocab = shapes[s][2];
        size_t nx = (size_t)rows * dim, ne = (size_t)vocab * dim, ny = (size_t)rows * vocab;
        fp16 *x = random_halves(nx, &seed, -1, 1), *E = random_halves(ne, &seed, -0.5f, 0.5f);
        table_view table = device_table_of(E, 1, vocab, dim);
        float *E32 = widened(E, ne);
        cuda_ws d = q4_workspace(rows, dim, vocab, 3 * (size_t)dim);
        lm_head_args a;
        memset(&a, 0, sizeof a);
        a.d = &d;
        a.w.cfg.vocab = vocab;
        a.w.cfg.word_dim = dim;
        a.w.lm_head = (fp16 *)table.values;
        a.w.q4 = 1;
        a.rows = rows;
        a.x = (const __half *)device_copy(x, nx);
        a.logits = device_array<float>(ny);
        float *got = host_array<float>(ny);
        char what[128];
        snprintf(what, sizeof what, "lm_head, %d x %d times a 4-bit [%d][%d]%s", rows, dim, vocab, dim,
                 rows > FG_CUDA_Q4_DIRECT ? " (widened)" : "");
        long long copied = emu_count(EMU_ASYNC_BYTES);
        run_in_every_order(what, run_lm_head, &a, a.logits, ny * sizeof(float), got);
        if (rows <= FG_CUDA_Q4_DIRECT && copied >= 0) { /* the table once, where dim lies on 16 bytes */
            long long expected = dim % 16 ? 0 : (long long)q4_bytes(1, (size_t)vocab, (size_t)dim);
            long long run = async_bytes_a_run(copied);
            EXPECT(run == expected, "%s: its copies read %lld bytes, the table %lld", what, run, expected);
        }
        int bad = 0;
        char first[200] = "";
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < vocab; v++) {
                double want = 0, A = 0;
                for (int i = 0; i < dim; i++) {
                    double term = (double)half_value(x[(size_t)r * dim + i]) * E32[(size_t)v * dim + i];
                    want += term;
                    A += fabs(term);
                }
                double bound = 1.01 * (gamma_n(dim) + gamma_blas(dim + 1)) * A + 1.01 * U * fabs(want);
                double err = fabs(got[(size_t)r * vocab + v] - want);
                if (!(err <= bound) && !bad++)
                    snprintf(first, sizeof first, "row %d, token %d: expected %.7g within %.3g, got %.7g", r, v,
                             want, bound, got[(size_t)r * vocab + v]);
                if (err <= bound) worst = fmax(worst, err / bound);
            }
        EXPECT(bad == 0, "%s: %d logits off; the first: %s", what, bad, first);
        cuda_free((void *)table.values);
        cuda_free((void *)a.x);
        cuda_free(a.logits);
        cuda_free(d.q4_scratch);
    cuda_free(d.q4_done);
        free(x);
        free(E);
        free(E32);
        free(got);
    }
    printf("(worst %.2f of the bound) ", worst);
}

/* ============================================================================================
 * prefill_attention: cuBLAS's scores, prefill_softmax_kernel, cuBLAS's P V
 * ============================================================================================ */

typedef struct {
    cuda_ws d;         /* qkv, scores, probs, attn: the parts prefill_attention uses */
    char *out;         /* one allocation: [scores][probs][attn], the outputs compared bit for bit */
    size_t out_bytes;
    model_config c;
    gpu_batch gb;
    int b;             /* the sequence this run computes */
} prefill_args;

static void run_prefill(void *p) {
    prefill_args *a = (prefill_args *)p;
    poison(a->out, a->out_bytes);
    prefill_attention(&a->d, &a->c, &a->gb, a->b);
    wait_stream();
}

/* Sequence b's probabilities and output (got: attn of the whole batch) against (P). */
static void check_prefill(const prefill_args *a, const fp16 *qkv, const fp16 *probs, const fp16 *attn,
                          const char *what, double *worst) {
    int n = a->gb.n_new, pad = a->gb.pad[a->b], H = a->c.n_heads, h = a->c.hidden, hd = h / H;
    double scale = 1.0f / sqrtf((float)hd);
    const fp16 *rows = qkv + (size_t)a->b * n * 3 * h;
    double *p = host_array<double>((size_t)n), *e = host_array<double>((size_t)n);
    int bad = 0;
    char first[240] = "";
    for (int head = 0; head < H; head++)
        for (int t = 0; t < n; t++) {
            const fp16 *prow = probs + ((size_t)head * n + t) * n;
            const fp16 *orow = attn + ((size_t)a->b * n + t) * h + (size_t)head * hd;
            /* exact weights of keys [pad, t], and D */
            double m = -INFINITY, sum = 0, D = 0, smax = 0;
            for (int j = pad; j <= t; j++) {
                double dot = 0, mag = 0;
                for (int d = 0; d < hd; d++) {
                    double prod = (double)half_value(rows[(size_t)t * 3 * h + head * hd + d]) *
                                  half_value(rows[(size_t)j * 3 * h + h + head * hd + d]);
                    dot += prod, mag += fabs(prod);
                }
                p[j] = scale * dot;
                m = fmax(m, p[j]), smax = fmax(smax, fabs(p[j]));
                D = fmax(D, scale * gamma_blas(hd + 1) * mag);
            }
            D += 2 * U * smax;
            double eta = 2 * D + (t - pad + 1 + 5) * U;
            for (int j = pad; j <= t; j++) sum += p[j] = exp(p[j] - m);
            for (int j = pad; j <= t; j++) p[j] /= sum, e[j] = 1.01 * eta * p[j] + h16(p[j] * (1 + eta));
            for (int j = 0; j < n; j++) { /* the probabilities: masked ones exactly +0 */
                int visible = j >= pad && j <= t;
                double err = visible ? fabs(half_value(prow[j]) - p[j]) : 0;
                if ((visible ? !(err <= e[j]) : prow[j] != 0) && !bad++)
                    snprintf(first, sizeof first, "head %d, query %d, key %d: probability %.7g, expected %s%.7g", head,
                             t, j, half_value(prow[j]), visible ? "within the bound of " : "", visible ? p[j] : 0.0);
            }
            for (int d = 0; d < hd; d++) { /* the output; a padding query's is 0 */
                double want = 0, E = 0;
                for (int j = pad; j <= t; j++) {
                    double v = half_value(rows[(size_t)j * 3 * h + 2 * h + head * hd + d]);
                    want += p[j] * v;
                    E += (e[j] + gamma_blas(t - pad + 1) * (p[j] + e[j])) * fabs(v);
                }
                E *= 1.01;
                double bound = E + h16(fabs(want) + E), err = fabs(half_value(orow[d]) - want);
                if (t < pad ? half_value(orow[d]) != 0 : !(err <= bound)) {
                    if (!bad++)
                        snprintf(first, sizeof first, "head %d, query %d, element %d: expected %.7g within %.3g, got %.7g",
                                 head, t, d, want, bound, half_value(orow[d]));
                } else if (t >= pad) {
                    *worst = fmax(*worst, err / bound);
                }
            }
        }
    EXPECT(bad == 0, "%s: %d values off; the first: %s", what, bad, first);
    free(p);
    free(e);
}

static void prefill_case(int heads, int head_dim, int batch, int n, const int *pads, uint64_t *seed, double *worst) {
    int h = heads * head_dim;
    size_t nqkv = (size_t)batch * n * 3 * h, nscores = (size_t)heads * n * n, nattn = (size_t)batch * n * h;
    fp16 *qkv = random_halves(nqkv, seed, -2, 2);
    prefill_args a;
    memset(&a, 0, sizeof a);
    a.c.hidden = h, a.c.n_heads = heads;
    a.gb.batch = batch, a.gb.n_new = n, a.gb.pad = (int *)pads;
    a.d.qkv = (__half *)device_copy(qkv, nqkv);
    a.out_bytes = nscores * sizeof(float) + nscores * sizeof(fp16) + nattn * sizeof(fp16);
    a.out = device_array<char>(a.out_bytes);
    a.d.scores = (float *)a.out;
    a.d.probs = (__half *)(a.d.scores + nscores);
    a.d.attn = a.d.probs + nscores;
    char *got = host_array<char>(a.out_bytes);
    const fp16 *probs = (const fp16 *)(got + nscores * sizeof(float)), *attn = probs + nscores;
    for (a.b = 0; a.b < batch; a.b++) {
        char what[128];
        snprintf(what, sizeof what, "prefill_attention, %d heads of %d, %d rows, %d padding", heads, head_dim, n, pads[a.b]);
        run_in_every_order(what, run_prefill, &a, a.out, a.out_bytes, got);
        check_prefill(&a, qkv, probs, attn, what, worst);
        /* the other sequences' rows are not its to write */
        int touched = 0;
        for (size_t i = 0; i < nattn; i++)
            touched += i / ((size_t)n * h) != (size_t)a.b && attn[i] != 0xffff;
        EXPECT(touched == 0, "%s: %d values of other sequences' rows written", what, touched);
    }
    cuda_free(a.d.qkv);
    cuda_free(a.out);
    free(qkv);
    free(got);
}

/* Prompts of 1 and 17 rows with 0, 3 and all 17 padding (a slot with no prompt), heads of 48, 80,
 * 96 and 128, and one of 140 rows, more than the softmax block's 128 threads. */
static void test_prefill(void) {
    if (!gpu_ready()) return;
    static const int pads_17[] = {0, 3, 17}, pads_1[] = {0, 0}, pads_140[] = {5};
    uint64_t seed = 81;
    double worst = 0;
    prefill_case(3, 48, 3, 17, pads_17, &seed, &worst);
    prefill_case(1, 128, 2, 17, pads_17 + 1, &seed, &worst);
    prefill_case(2, 80, 2, 1, pads_1, &seed, &worst);
    prefill_case(2, 96, 1, 1, pads_1, &seed, &worst);
    prefill_case(1, 48, 1, 140, pads_140, &seed, &worst);
    printf("(worst %.2f of the bound) ", worst);
}

/* The copies of the disk tier's pages (pageable memory): 2.5 bounce buffers' worth in and out,
 * so each buffer is filled again while its last piece may still be moving; byte for byte, and so
 * from pinned memory and between device buffers. */
static void test_copies(void) {
    if (!gpu_ready()) return;
    size_t bytes = 5 * (size_t)BOUNCE / 2 + 4099;
    uint8_t *src = host_array<uint8_t>(bytes), *back = host_array<uint8_t>(bytes);
    uint64_t seed = 5;
    for (size_t i = 0; i < bytes; i++) src[i] = (uint8_t)(test_uniform(&seed) * 256); /* no period: each piece differs */
    uint8_t *dev = device_array<uint8_t>(bytes), *dev2 = device_array<uint8_t>(bytes);
    cuda_copy_in(dev, src, bytes);
    cuda_copy(dev2, dev, bytes);
    cuda_copy_out(back, dev2, bytes); /* pageable: there when it returns */
    size_t first = 0;
    while (first < bytes && back[first] == src[first]) first++;
    EXPECT(first == bytes, "pageable memory in and out through the bounce buffers: byte %zu of %zu differs", first, bytes);
    uint8_t *pinned = (uint8_t *)cuda_host_alloc(bytes, 1);
    memcpy(pinned, src, bytes);
    cuda_copy_in(dev, pinned, bytes);
    cuda_copies_done(); /* before the source is written again */
    memset(pinned, 0, bytes);
    cuda_copy_out(pinned, dev, bytes);
    cuda_copies_done();
    EXPECT(!memcmp(pinned, src, bytes), "pinned memory in and out: the bytes differ");
    cuda_host_free(pinned);
    cuda_free(dev);
    cuda_free(dev2);
    free(src);
    free(back);
}

/* upload_cache's tables: page tables for pages of 5 tokens (the runtime makes pages of 16 tokens
 * or of a whole sequence, and the workspace holds tables of 16-token pages; smaller ones, max_len
 * 40 taking 8 pages of 5, not 3 of 16, must reach the device whole, for each sequence and for K
 * and V), the rows' pad and past, the cache pointers (NULL for a delegated sequence); and a table
 * already on the device is used again, with the pointers' shifts, for the same sequences in the
 * next layer's pools (K's rows a distance on and V's another, as staged K rows beside V rows read
 * in place lie), but uploaded anew when a page, a row or one pointer's distance differs. */
static void test_page_tables(void) {
    if (!gpu_ready()) return;
    model_config cfg = {}; /* OPT-shaped: 1 layer, hidden 64, 4 heads, ffn 256, vocab 16, 64 positions */
    cfg.n_layers = 1, cfg.hidden = 64, cfg.n_heads = 4, cfg.ffn = 256, cfg.vocab = 16, cfg.max_pos = 64;
    cfg.word_dim = 64, cfg.pre_ln = 1;
    model_workspace ws;
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(cuda_workspace_init(&ws, &cfg, 3, 1, 40, err), 0);
    cuda_ws *d = (cuda_ws *)ws.device;
    enum { B = 3, PAGES = 8, LAYER = 4096 };
    int past[B] = {10, 33, 7}, pad[B] = {0, 0, 1}, tables[2][B][PAGES];
    const int *k_pages[B], *v_pages[B];
    char in_host[B] = {0, 0, 1};
    uint8_t *pools = device_array<uint8_t>(7 * LAYER); /* two layers' K and V pools, and a third's V */
    void *k[B], *v[B];
    for (int kv = 0; kv < 2; kv++)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < PAGES; i++) tables[kv][b][i] = 100 * kv + 10 * b + (7 * i + 3) % PAGES;
    for (int b = 0; b < B; b++) {
        k_pages[b] = tables[0][b];
        v_pages[b] = tables[1][b];
        k[b] = pools + 64 * b;
        v[b] = pools + LAYER + 64 * b;
    }
    gpu_batch gb;
    memset(&gb, 0, sizeof gb);
    gb.batch = B, gb.max_len = 40, gb.page_tokens = 5, gb.n_new = 1, gb.past = past, gb.pad = pad;
    gb.k = k, gb.v = v, gb.k_pages = k_pages, gb.v_pages = v_pages, gb.kv_in_host = in_host;
    cache_table t = upload_cache(d, &gb);
    CU_ASSERT_EQUAL(t.on_device, B - 1);
    EXPECT(t.max_pages >= PAGES, "pages of 5 for 40 tokens: tables of %d pages, expected %d", t.max_pages, PAGES);
    int *got = host_array<int>((size_t)2 * B * t.max_pages), rows[2 * B];
    download(got, t.pages, (size_t)2 * B * t.max_pages * sizeof(int));
    download(rows, t.pad, sizeof rows);
    void *pointers[2 * B];
    download(pointers, t.k, sizeof pointers);
    int wrong = 0;
    for (int kv = 0; kv < 2; kv++)
        for (int b = 0; b < B - 1; b++)
            for (int i = 0; i < PAGES; i++) wrong += got[((size_t)kv * B + b) * t.max_pages + i] != tables[kv][b][i];
    EXPECT(wrong == 0, "pages of 5: %d of %d page-table entries on the device differ from the sequences' tables", wrong,
           2 * (B - 1) * PAGES);
    for (int b = 0; b < B; b++) {
        EXPECT(rows[b] == pad[b] && rows[B + b] == past[b], "sequence %d: pad %d and past %d on the device, not %d and %d",
               b, rows[b], rows[B + b], pad[b], past[b]);
        void *want_k = in_host[b] ? NULL : k[b], *want_v = in_host[b] ? NULL : v[b];
        EXPECT(pointers[b] == want_k && pointers[B + b] == want_v, "sequence %d: cache pointers %p, %p on the device, "
               "not %p, %p", b, pointers[b], pointers[B + b], want_k, want_v);
    }
    fg_device_counts before, after;
    cuda_counts(&before);
    for (int b = 0; b < B; b++) { /* the next layer: its pools 2 LAYER bytes on */
        k[b] = (char *)k[b] + 2 * LAYER;
        v[b] = (char *)v[b] + 2 * LAYER;
    }
    cache_table next = upload_cache(d, &gb);
    cuda_counts(&after);
    EXPECT(after.copies_in == before.copies_in && next.k == t.k && next.shift[0] == 2 * LAYER &&
           next.shift[1] == 2 * LAYER, "the next layer's table: %lld uploads, shifts %lld and %lld; expected the same "
           "table, no upload, shifts %d", (long long)(after.copies_in - before.copies_in), next.shift[0], next.shift[1],
           2 * LAYER);
    for (int b = 0; b < B; b++) /* V's rows 3 LAYER further than the first layer's, K's back where they were */
        v[b] = (char *)v[b] + LAYER, k[b] = (char *)k[b] - 2 * LAYER;
    next = upload_cache(d, &gb);
    cuda_counts(&after);
    EXPECT(after.copies_in == before.copies_in && next.shift[0] == 0 && next.shift[1] == 3 * LAYER, "K's rows where the "
           "table's are, V's 3 LAYER on: %lld uploads, shifts %lld and %lld; expected no upload, shifts 0 and %d",
           (long long)(after.copies_in - before.copies_in), next.shift[0], next.shift[1], 3 * LAYER);
    tables[1][0][PAGES - 1]++; /* a page of its own: the table differs */
    upload_cache(d, &gb);
    v[1] = (char *)v[1] + 64; /* one pointer's distance differs */
    upload_cache(d, &gb);
    past[2]++; /* a row's past differs */
    upload_cache(d, &gb);
    fg_device_counts last;
    cuda_counts(&last);
    EXPECT(last.copies_in - after.copies_in == 3, "a changed page, pointer or row: %lld uploads, expected 3",
           (long long)(last.copies_in - after.copies_in));
    free(got);
    cuda_free(pools);
    cuda_workspace_free(&ws);
}

/* ============================================================================================
 * The LLaMA family's kernels: rms_norm_kernel, rope_kernel, swiglu_kernel against their math in
 * double on the same fp16 inputs, and grouped-query attention (attention_kernel over q, k and v
 * in LLaMA's blocked layout, n_heads / n_kv_heads query heads to a K/V head) against the same
 * kernel over OPT's rows with each K/V head repeated for its query heads, bit for bit.
 * ============================================================================================ */

/* Bound of a value y computed in fp32 with relative error rel, then rounded to fp16. */
static double fp16_bound(double y, double rel) {
    double E = 1.01 * rel * fabs(y);
    return E + h16(fabs(y) + E);
}

typedef struct {
    int rows, dim;
    float eps;
    const fp16 *x_host;
    __half *x, *y;
    const fp16 *w;
} rms_args;

static void run_rms_norm(void *p) {
    rms_args *a = (rms_args *)p;
    size_t bytes = (size_t)a->rows * a->dim * sizeof(fp16);
    upload(a->x, a->x_host, bytes);
    if (a->y != a->x) poison(a->y, bytes);
    rms_norm(a->x, a->rows, a->dim, a->w, a->eps, a->y);
    wait_stream();
}

/* RMSNorm: the sum of squares (positive terms) within gamma_dim, the root and three roundings
 * more: y within gamma_dim / 2 + 8 u of itself before its fp16 rounding. y == x: the same bits.
 * Inputs in [-3, 3], and in [-0.017, 0.017] (an rms near 0.01, as an embedding row's), where
 * epsilon under the root moves y by 5% (1e-5) or 0.5% (1e-6) against epsilon added after it. */
static void test_rms_norm(void) {
    if (!gpu_ready()) return;
    static const int dims[] = {24, 144, 600}, row_counts[] = {1, 5};
    static const float ranges[] = {3, 0.017f};
    uint64_t seed = 61;
    for (size_t di = 0; di < 3; di++)
        for (size_t ri = 0; ri < 4; ri++) {
            int dim = dims[di], rows = row_counts[ri % 2], bad = 0;
            float eps = di % 2 ? 1e-6f : 1e-5f, range = ranges[ri / 2];
            size_t n = (size_t)rows * dim;
            fp16 *x = random_halves(n, &seed, -range, range), *w = random_halves((size_t)dim, &seed, 0.2f, 2);
            rms_args a = {rows, dim, eps, x, device_array<__half>(n), device_array<__half>(n), device_copy(w, (size_t)dim)};
            fp16 *got = host_array<fp16>(n), *aliased = host_array<fp16>(n);
            char what[96];
            snprintf(what, sizeof what, "rms_norm_kernel, %d rows of %d in [-%g, %g]", rows, dim, range, range);
            run_in_every_order(what, run_rms_norm, &a, a.y, n * sizeof(fp16), got);
            for (int r = 0; r < rows; r++) {
                const fp16 *xr = x + (size_t)r * dim;
                double squares = 0;
                for (int i = 0; i < dim; i++) squares += (double)half_value(xr[i]) * half_value(xr[i]);
                double inv = 1 / sqrt(squares / dim + eps);
                for (int i = 0; i < dim; i++) {
                    double y = half_value(w[i]) * half_value(xr[i]) * inv;
                    bad += !(fabs(half_value(got[(size_t)r * dim + i]) - y) <= fp16_bound(y, gamma_n(dim) / 2 + 8 * U));
                }
            }
            EXPECT(bad == 0, "%s: %d values beyond their bound", what, bad);
            __half *y = a.y;
            a.y = a.x;
            run_in_every_order(what, run_rms_norm, &a, a.y, n * sizeof(fp16), aliased);
            EXPECT(!memcmp(got, aliased, n * sizeof(fp16)), "%s, y == x: not the bits of a separate y", what);
            cuda_free(a.x), cuda_free(y), cuda_free((void *)a.w);
            free(x), free(w), free(got), free(aliased);
        }
}

typedef struct {
    const fp16 *host;
    __half *qkv;
    qkv_layout at;
    int n_new, hd, heads, kv_heads;
    const int *past, *pad;
    rope_freqs freqs;
    size_t n;
} rope_args;

static void run_rope(void *p) {
    rope_args *a = (rope_args *)p;
    upload(a->qkv, a->host, a->n * sizeof(fp16));
    rope_kernel<<<(unsigned)(a->n / (a->at.stride[0] + 2 * a->at.stride[1])), 128, 0, ctx()->stream>>>(
        a->qkv, a->at, a->n_new, a->past, a->pad, a->hd, a->heads, a->kv_heads, a->freqs);
    LAUNCHED("rope_kernel");
    wait_stream();
}

/* RoPE on q and k heads at each row's position (cache slot), v untouched: each output a c - b s
 * (or b c + a s) of the fp16 inputs, with the fp32 angle pos * inv_freq (as the CPU forms it),
 * cosf and sinf within 2 ulps (CUDA's bound), two products and a sum in fp32. llama3 scaling,
 * head dims 24 (MQA), 64 and 128, positions past a page, padding rows. */
static void test_rope(void) {
    if (!gpu_ready()) return;
    static const struct { int heads, kv_heads, hd; } shapes[] = {{4, 1, 24}, {6, 2, 64}, {2, 2, 128}};
    const int batch = 3, n_new = 4, past[3] = {0, 37, 5}, pad[3] = {1, 0, 3};
    uint64_t seed = 71;
    for (int si = 0; si < 3; si++) {
        model_config c = {};
        c.family = FAMILY_LLAMA, c.hidden = 96, c.n_heads = shapes[si].heads, c.n_kv_heads = shapes[si].kv_heads;
        c.head_dim = shapes[si].hd, c.rope.theta = si == 1 ? 500000.0f : 10000.0f;
        if (si == 1) c.rope.kind = ROPE_LLAMA3, c.rope.factor = 8, c.rope.low_freq = 1, c.rope.high_freq = 4, c.rope.original_max_pos = 64;
        int rows = batch * n_new, hd = c.head_dim, half = hd / 2, bad = 0;
        qkv_layout at = qkv_layout_of(&c, (size_t)rows);
        size_t n = (size_t)rows * qkv_width(&c);
        rope_args a = {random_halves(n, &seed, -2, 2), device_array<__half>(n), at, n_new, hd, c.n_heads, c.n_kv_heads,
                       device_copy(past, 3), device_copy(pad, 3), {}, n};
        rope_frequencies(&c, a.freqs.f);
        fp16 *got = host_array<fp16>(n);
        char what[96];
        snprintf(what, sizeof what, "rope_kernel, %d heads, %d K/V heads of %d", c.n_heads, c.n_kv_heads, hd);
        run_in_every_order(what, run_rope, &a, a.qkv, n * sizeof(fp16), got);
        for (int r = 0; r < rows; r++) {
            float pos = (float)(past[r / n_new] + r % n_new - pad[r / n_new]);
            for (int head = 0; head < c.n_heads + c.n_kv_heads; head++) {
                int is_k = head >= c.n_heads;
                size_t base = at.at[is_k] + (size_t)r * at.stride[is_k] + (size_t)(head - is_k * c.n_heads) * hd;
                for (int p = 0; p < half; p++) {
                    float angle = pos * a.freqs.f[p];
                    double cs = cos((double)angle), sn = sin((double)angle);
                    double x0 = half_value(a.host[base + p]), x1 = half_value(a.host[base + p + half]);
                    double y0 = x0 * cs - x1 * sn, y1 = x1 * cs + x0 * sn, mag = fabs(x0) + fabs(x1);
                    double E = mag * (2 * 0x1p-23 + 3 * U); /* cos, sin within 2^-23; products, sum */
                    bad += !(fabs(half_value(got[base + p]) - y0) <= E + h16(fabs(y0) + E));
                    bad += !(fabs(half_value(got[base + p + half]) - y1) <= E + h16(fabs(y1) + E));
                }
            }
        }
        bad += memcmp(got + at.at[2], a.host + at.at[2], (size_t)rows * at.stride[2] * sizeof(fp16)) != 0; /* v */
        EXPECT(bad == 0, "%s: %d values beyond their bound (or v changed)", what, bad);
        cuda_free(a.qkv), cuda_free((void *)a.past), cuda_free((void *)a.pad);
        free((void *)a.host), free(got);
    }
}

typedef struct {
    const fp16 *gate_host;
    __half *gate, *up;
    size_t n;
} swiglu_args;

static void run_swiglu(void *p) {
    swiglu_args *a = (swiglu_args *)p;
    upload(a->gate, a->gate_host, a->n * sizeof(fp16));
    swiglu_kernel<<<blocks_for(a->n, 256), 256, 0, ctx()->stream>>>(a->gate, a->up, a->n);
    LAUNCHED("swiglu_kernel");
    wait_stream();
}

/* silu(g) u: expf within 2 ulps, then an addition, a division and a product in fp32 (the
 * exponential's error is damped by e/(1 + e) <= 1): within 10 u before the fp16 rounding. */
static void test_swiglu(void) {
    if (!gpu_ready()) return;
    const size_t n = 1000;
    uint64_t seed = 81;
    fp16 *g = random_halves(n, &seed, -12, 12), *u = random_halves(n, &seed, -3, 3), *got = host_array<fp16>(n);
    swiglu_args a = {g, device_array<__half>(n), device_copy((const __half *)u, n), n};
    run_in_every_order("swiglu_kernel", run_swiglu, &a, a.gate, n * sizeof(fp16), got);
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        double x = half_value(g[i]), y = x / (1 + exp(-x)) * half_value(u[i]);
        bad += !(fabs(half_value(got[i]) - y) <= fp16_bound(y, 10 * U));
    }
    EXPECT(bad == 0, "swiglu_kernel: %d of %zu values beyond their bound", bad, n);
    cuda_free(a.gate), cuda_free(a.up);
    free(g), free(u), free(got);
}

/* attention_kernel's output for q, k, v rows laid out by `at`, over a cache of kv_heads heads; with
 * `split`, queue_attention's (the split over keys where no top-K applies). *read: the bytes of K
 * and V rows it loaded (-1 natively). */
static fp16 *gqa_attention(const step_case *c, const fp16 *qkv, size_t n, qkv_layout at, int kv_heads,
                           const paged_cache *cache, int q4, int split, long long *read) {
    int rows = c->batch * c->n_new;
    size_t out = (size_t)rows * c->heads * c->head_dim;
    __half *dev_qkv = (__half *)device_copy(qkv, n), *dev_attn = device_array<__half>(out);
    int *past = device_copy(c->past, (size_t)c->batch), *pad = device_copy(c->pad, (size_t)c->batch);
    size_t slots = shortest_span_slots(c);
    float *partials = device_array<float>(slots * (c->head_dim + 2));
    upload(cache->dev, cache->host, 2 * cache->pool_bytes);
    float scale = 1.0f / sqrtf((float)c->head_dim);
    attention_split a = {dev_qkv, at, dev_attn, past, pad, cache->dev_k, cache->dev_v, {0, 0},
                         cache->dev_tables, cache->max_pages, cache->page_tokens, c->n_new,
                         c->head_dim, c->heads, kv_heads, q4, 0, 0, scale, partials, c->batch, 0, 0, 0, 0, 0};
    long long before = emu_count(EMU_KV_LOAD_BYTES);
    if (split) {
        queue_attention(a, c->batch, c->past, c->pad, c->sparsity, partials, slots, INT_MAX);
    } else {
        queue_attention_kernel(a, c->batch, c->n_new, longest(c), c->sparsity, 1);
    }
    wait_stream();
    *read = before < 0 ? -1 : emu_count(EMU_KV_LOAD_BYTES) - before;
    fp16 *got = host_array<fp16>(out);
    download(got, dev_attn, out * sizeof(fp16));
    cuda_free(dev_qkv), cuda_free(dev_attn), cuda_free(past), cuda_free(pad);
    cuda_free(partials);
    return got;
}

/* The bytes of K and V rows that attention loads for step c, each K/V head's rows read by `blocks`
 * blocks (of its query heads): every key of each query once a block, a cached row at its stored
 * bytes (a 4-bit chunk of 8 values 4 bytes of codes, a min and a scale; value by value where hd
 * is not a multiple of 8, 5 bytes a value), this step's rows as fp16. V's the same for the split;
 * attention_kernel (v_a_head) reads V a query head at a time, for a top-K decode query each head's
 * kept cached rows and the new token's. */
static long long attention_kv_bytes(const step_case *c, int kv_heads, int blocks, int q4, int v_a_head) {
    long long hd = c->head_dim, cached = q4 ? (hd % 8 ? 5 * hd : hd) : 2 * hd, total = 0;
    for (int b = 0; b < c->batch; b++)
        for (int t = c->pad[b]; t < c->n_new; t++) {
            long long fresh = t - c->pad[b] + 1, row = c->past[b] * cached + fresh * 2 * hd;
            int top_k = c->sparsity < 1 && c->n_new - c->pad[b] == 1 && c->past[b] > 0;
            long long kept = (long long)floorf(c->sparsity * (float)c->past[b]) * cached + 2 * hd;
            total += kv_heads * blocks * row + (!v_a_head ? kv_heads * blocks * row : c->heads * (top_k ? kept : row));
        }
    return total;
}

/* Grouped-query attention equals multi-head attention over repeated K/V heads: the blocked
 * layout and a cache of kv_heads heads against OPT's rows and a cache with each K/V head written
 * for each of its query heads, the same page tables; decode and prefill after cached tokens, fp16
 * and 4-bit caches, dense and top-K; attention_kernel (attention_gqa_kernel) and the split over
 * keys (queue_attention; with top-K its spans scoring the keys for attention_kernel), also over
 * three spans and more, whose blocks take GQA_HEADS query heads
 * of a K/V head at a time (groups of 2, 3, 4, 7 and 8) where the blocks of repeated heads take
 * one. On the emulated GPU each K row is loaded once for a block of GQA_HEADS query heads (each V
 * row too in the split; attention_kernel reads a head's V rows, or its kept ones, for each head),
 * where repeated heads load it once for each (attention_kv_bytes). */
static void test_gqa_attention(void) {
    if (!gpu_ready()) return;
    static const step_case cases[] = {
        {"decode, 4 heads on 1 K/V head of 24, pages of 5", 4, 24, 3, 1, 5, -1, 1, {7, 16, 3}, {0, 0, 0}},
        {"decode, top-K, 6 heads on 2 K/V heads of 40", 6, 40, 2, 1, 16, -1, 0.5f, {20, 33}, {0, 0}},
        {"prefill after cached tokens, 8 heads on 2 K/V heads of 64", 8, 64, 2, 3, 5, -1, 1, {9, 4}, {1, 0}},
        {"decode of 600 and 257 keys, 4 heads on 2 K/V heads of 32", 4, 32, 2, 1, 16, -1, 1,
         {599, 256}, {0, 0}},
        {"decode of 300 and 131 keys, 7 heads on 1 K/V head of 64 (blocks of 4 and 3 heads)", 7,
         64, 2, 1, 16, -1, 1, {299, 130}, {0, 0}},
        {"prefill after cached tokens, 16 heads on 2 K/V heads of 128 (two blocks a K/V head)", 16,
         128, 2, 2, 5, -1, 1, {70, 9}, {0, 1}},
        {"decode, 6 heads on 2 K/V heads of 36 (read value by value)", 6, 36, 2, 1, 16, -1, 1,
         {40, 77}, {0, 0}},
        {"decode of 300 and 131 keys, top-K 0.2, 7 heads on 1 K/V head of 64 (the split's spans score)", 7,
         64, 2, 1, 16, -1, 0.2f, {299, 130}, {0, 0}},
    };
    const int kv_heads[] = {1, 2, 2, 2, 1, 2, 2, 1};
    uint64_t seed = 91;
    for (int ci = 0; ci < 8; ci++)
        for (int q4 = 0; q4 <= 1; q4++) {
            const step_case *c = &cases[ci];
            int H = c->heads, KV = kv_heads[ci], hd = c->head_dim, group = H / KV, rows = c->batch * c->n_new;
            size_t qw = (size_t)H * hd, kw = (size_t)KV * hd;
            qkv_layout blocked = {{0, rows * qw, rows * (qw + kw)}, {qw, kw, kw}};
            qkv_layout rows_at = {{0, qw, 2 * qw}, {3 * qw, 3 * qw, 3 * qw}};
            fp16 *gq = random_halves((size_t)rows * (qw + 2 * kw), &seed, -2, 2), *mq = host_array<fp16>((size_t)rows * 3 * qw);
            for (int r = 0; r < rows; r++)
                for (int head = 0; head < H; head++)
                    for (int i = 0; i < 3; i++)
                        memcpy(mq + (size_t)r * 3 * qw + i * qw + (size_t)head * hd,
                               gq + blocked.at[i] + (size_t)r * blocked.stride[i] + (size_t)(i ? head / group : head) * hd,
                               (size_t)hd * sizeof(fp16));
            uint64_t tables = seed; /* both caches get the same page tables */
            paged_cache gc, mc;
            size_t g_row = q4 ? q4_bytes((size_t)KV, (size_t)hd, 1) : 2 * kw, m_row = q4 ? q4_bytes((size_t)H, (size_t)hd, 1) : 2 * qw;
            paged_cache_init(&gc, c->batch, longest(c), c->page_tokens, g_row, -1, &tables);
            tables = seed;
            paged_cache_init(&mc, c->batch, longest(c), c->page_tokens, m_row, -1, &tables);
            fp16 *expanded = host_array<fp16>(qw);
            for (int b = 0; b < c->batch; b++)
                for (int slot = 0; slot < c->past[b]; slot++)
                    for (int kv = 0; kv < 2; kv++) {
                        fp16 *x = random_halves(kw, &seed, -2, 2);
                        for (int head = 0; head < H; head++) memcpy(expanded + (size_t)head * hd, x + (size_t)(head / group) * hd, (size_t)hd * sizeof(fp16));
                        write_row(row_at(&gc, kv, b, slot), x, KV, hd, q4);
                        write_row(row_at(&mc, kv, b, slot), expanded, H, hd, q4);
                        free(x);
                    }
            for (int split = 0; split <= 1; split++) {
                size_t g_n = (size_t)rows * (qw + 2 * kw), m_n = (size_t)rows * 3 * qw;
                long long got_read, want_read;
                fp16 *got = gqa_attention(c, gq, g_n, blocked, KV, &gc, q4, split, &got_read);
                fp16 *want = gqa_attention(c, mq, m_n, rows_at, H, &mc, q4, split, &want_read);
                EXPECT(!memcmp(got, want, (size_t)rows * qw * sizeof(fp16)), "%s, %s, %s cache: "
                       "grouped-query attention is not multi-head attention over repeated "
                       "K/V heads", split ? "queue_attention" : "attention_kernel", c->what,
                       q4 ? "4-bit" : "fp16");
                if (got_read >= 0) { /* top-K, its keys scored by the split's spans or not, reads a head's V rows */
                    int v_a_head = !split || c->sparsity < 1;
                    long long once = attention_kv_bytes(c, KV, (group + GQA_HEADS - 1) / GQA_HEADS, q4, v_a_head);
                    long long each = attention_kv_bytes(c, H, 1, q4, v_a_head);
                    EXPECT(got_read == once && want_read == each, "%s, %s, %s cache: K and V rows read "
                           "%lld bytes (%lld expected), over repeated heads %lld (%lld expected)",
                           split ? "queue_attention" : "attention_kernel", c->what, q4 ? "4-bit" : "fp16",
                           got_read, once, want_read, each);
                }
                free(got);
                free(want);
            }
            paged_cache_free(&gc), paged_cache_free(&mc);
            free(gq), free(mq), free(expanded);
        }
}

/* ============================================================================================ */

extern "C" void add_kernel_tests(void) {
    CU_pSuite s = CU_add_suite("kernels", NULL, NULL);
    CU_add_test(s, "dequant_kernel: q4_decompress rounded to fp16, bit for bit", test_dequant);
    CU_add_test(s, "store_kv_kernel: fp16 and 4-bit rows at their page rows, byte for byte", test_store_kv);
    CU_add_test(s, "attention_kernel and the split over keys: opt_attend_decode within its bound, "
                "fp16 and 4-bit cache", test_attention);
    CU_add_test(s, "attention_kernel: top-K over exact ties keeps the CPU's keys", test_attention_ties);
    CU_add_test(s, "keep_largest: top-K's radix select keeps topk_keep's keys", test_top_k_select);
    CU_add_test(s, "layer_norm_kernel: a layer norm in double within its bound; y == x", test_layer_norm);
    CU_add_test(s, "bias_layer_norm: the bits of bias_kernel, then layer_norm_kernel", test_bias_layer_norm);
    CU_add_test(s, "linear and bias_kernel: matmul_reference within its bound, every mode", test_linear);
    CU_add_test(s, "linear, 4-bit: the product by the codes' values within its bound, every mode", test_q4_linear);
    CU_add_test(s, "fp16_product: every candidate timed once a shape, the fastest kept, within its bound",
                test_product_choice);
    CU_add_test(s, "gather_rows_kernel and add_positions_kernel: bit for bit, fp16 and 4-bit", test_embed);
    CU_add_test(s, "lm_head, 4-bit: the product by the codes' values within its bound", test_q4_lm_head);
    CU_add_test(s, "prefill_attention and prefill_softmax_kernel: softmax attention in double within its bound", test_prefill);
    CU_add_test(s, "copies through the bounce buffers, from pinned memory, on the device: byte for byte", test_copies);
    CU_add_test(s, "upload_cache: page tables of pages under 16 tokens; a table on the device used again", test_page_tables);
    CU_add_test(s, "rms_norm_kernel: RMSNorm in double within its bound; y == x", test_rms_norm);
    CU_add_test(s, "rope_kernel: HF's rotation in double within its bound, v untouched", test_rope);
    CU_add_test(s, "swiglu_kernel: silu(g) u in double within its bound", test_swiglu);
    CU_add_test(s, "attention_kernel: grouped-query attention is attention over repeated K/V heads, bit for bit",
                test_gqa_attention);
}
