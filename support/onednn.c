/* support/onednn.c: the two products of the CPU's opt-in prefill schemes (int8.c's rows rounded
 * once, matmul.c's bf16), on oneDNN's matmul where the build has it, on plain loops where not.
 *
 *   gemm_s8     c[m][n] = sum_k a[m][k] b[k][n]    int8 operands, int32 sums (exact)
 *   gemm_bf16   c[m][n] = sum_k a[m][k] b[k][n]    bf16 operands, fp32 sums
 *
 * All three matrices are dense, row after row: oneDNN's fastest kernels (brgemm) take no gaps
 * between c's rows, so the callers write a panel's c contiguously and add it into y themselves.
 *
 * Prefill is bound by the CPU's arithmetic (§3's roofline: hundreds of rows of x per weight read).
 * oneDNN (Intel's deep-learning kernels, Debian's libdnnl-dev) picks the fastest instructions this
 * CPU has at run time: AMX tiles (Sapphire Rapids and later: int8 and bf16 products in 1 KiB
 * tiles), AVX-512 VNNI or BF16, AVX2. Its kernels want W in a blocked layout of their own, so each
 * call reorders b into it (one pass over the panel; prefill reuses it for every row of a).
 * docs/DESIGN.md ("Prefill's products on a library") says why a library, not AMX by hand.
 *
 * The plain loops beside them are the references the tests hold oneDNN to: gemm_s8's sums are
 * integers, so every path gives the same bits; gemm_bf16's fp32 sums may be added in any order,
 * so the tests hold it to the bound of that order. A build without oneDNN (FLEXGEN_ONEDNN unset:
 * no libdnnl-dev where it was built) runs the plain loops: the same int8 bits, slowly.
 */
#include "support/support.h"

#include <stdlib.h>
#include <string.h>

/* ---- The references ---- */

void gemm_s8_reference(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < m; i++) {
        int32_t *row = c + (size_t)i * n;
        memset(row, 0, (size_t)n * sizeof *row);
        for (int p = 0; p < k; p++) {
            int32_t av = a[(size_t)i * k + p];
            const int8_t *brow = b + (size_t)p * n;
            for (int j = 0; j < n; j++) row[j] += av * brow[j];
        }
    }
}

void gemm_bf16_reference(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < m; i++) {
        float *row = c + (size_t)i * n;
        memset(row, 0, (size_t)n * sizeof *row);
        for (int p = 0; p < k; p++) {
            float av = bf16_to_fp32(a[(size_t)i * k + p]);
            const uint16_t *brow = b + (size_t)p * n;
            for (int j = 0; j < n; j++) row[j] += av * bf16_to_fp32(brow[j]);
        }
    }
}

#ifndef FLEXGEN_ONEDNN

void gemm_s8(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c) { gemm_s8_reference(m, n, k, a, b, c); }

void gemm_bf16(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c) {
    gemm_bf16_reference(m, n, k, a, b, c);
}

const char *gemm_path(int bf16) {
    (void)bf16;
    return "portable";
}

#else

#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdio.h>

/* One shape's primitives: the product, and the reorder of b into the product's layout. */
typedef struct {
    int used, bf16, m, n, k;
    dnnl_primitive_t product, reorder;
    dnnl_memory_desc_t a_md, b_md, b_blocked_md, c_md;
    size_t b_blocked_bytes;
} gemm_plan;

enum { N_PLANS = 16 }; /* prefill's shapes: 4 to 6 products a layer, times a full and a last batch */

static struct {
    pthread_mutex_t lock;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    gemm_plan plans[N_PLANS];
    int next_evicted;
    void *b_blocked; /* the reordered b, shared by the plans (one call at a time) */
    size_t b_blocked_cap;
    char path[2][96]; /* what oneDNN chose, for int8 and for bf16 */
} dnnl = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void check(dnnl_status_t status, const char *what) {
    if (status == dnnl_success) return;
    fprintf(stderr, "flexgen: oneDNN failed (%s: status %d)\n", what, (int)status);
    abort();
}

static void engine_once(void) {
    if (dnnl.engine) return;
    check(dnnl_engine_create(&dnnl.engine, dnnl_cpu, 0), "engine");
    check(dnnl_stream_create(&dnnl.stream, dnnl.engine, dnnl_stream_default_flags), "stream");
}

static void plan_free(gemm_plan *p) {
    if (!p->used) return;
    dnnl_primitive_destroy(p->product);
    dnnl_primitive_destroy(p->reorder);
    memset(p, 0, sizeof *p);
}

/* The product's primitive for this shape, b's layout left to oneDNN ("any"), and the reorder
 * from plain [k][n] into that layout. */
static void plan_make(gemm_plan *p, int bf16, int m, int n, int k) {
    dnnl_data_type_t in = bf16 ? dnnl_bf16 : dnnl_s8, out = bf16 ? dnnl_f32 : dnnl_s32;
    dnnl_dims_t a_dims = {m, k}, b_dims = {k, n}, c_dims = {m, n};
    dnnl_memory_desc_t b_any;
    *p = (gemm_plan){.used = 1, .bf16 = bf16, .m = m, .n = n, .k = k};
    check(dnnl_memory_desc_init_by_tag(&p->a_md, 2, a_dims, in, dnnl_ab), "a");
    check(dnnl_memory_desc_init_by_tag(&p->b_md, 2, b_dims, in, dnnl_ab), "b");
    check(dnnl_memory_desc_init_by_tag(&b_any, 2, b_dims, in, dnnl_format_tag_any), "b, any layout");
    check(dnnl_memory_desc_init_by_tag(&p->c_md, 2, c_dims, out, dnnl_ab), "c");

    dnnl_matmul_desc_t desc;
    dnnl_primitive_desc_t product_pd, reorder_pd;
    check(dnnl_matmul_desc_init(&desc, &p->a_md, &b_any, NULL, &p->c_md), "matmul");
    check(dnnl_primitive_desc_create(&product_pd, &desc, NULL, dnnl.engine, NULL), "matmul");
    p->b_blocked_md = *dnnl_primitive_desc_query_md(product_pd, dnnl_query_weights_md, 0);
    p->b_blocked_bytes = dnnl_memory_desc_get_size(&p->b_blocked_md);
    const char *impl = "";
    dnnl_primitive_desc_query(product_pd, dnnl_query_impl_info_str, 0, &impl);
    snprintf(dnnl.path[bf16], sizeof dnnl.path[bf16], "onednn %s", impl);
    check(dnnl_primitive_create(&p->product, product_pd), "matmul");
    check(dnnl_reorder_primitive_desc_create(&reorder_pd, &p->b_md, dnnl.engine, &p->b_blocked_md, dnnl.engine, NULL),
          "reorder");
    check(dnnl_primitive_create(&p->reorder, reorder_pd), "reorder");
    dnnl_primitive_desc_destroy(product_pd);
    dnnl_primitive_desc_destroy(reorder_pd);
}

/* The plan of this shape: kept, or made in the place of the oldest. */
static gemm_plan *plan_for(int bf16, int m, int n, int k) {
    engine_once();
    for (int i = 0; i < N_PLANS; i++) {
        gemm_plan *p = &dnnl.plans[i];
        if (p->used && p->bf16 == bf16 && p->m == m && p->n == n && p->k == k) return p;
    }
    gemm_plan *p = &dnnl.plans[dnnl.next_evicted];
    dnnl.next_evicted = (dnnl.next_evicted + 1) % N_PLANS;
    plan_free(p);
    plan_make(p, bf16, m, n, k);
    return p;
}

static dnnl_memory_t memory_at(const dnnl_memory_desc_t *md, const void *at) {
    dnnl_memory_t mem;
    check(dnnl_memory_create(&mem, md, dnnl.engine, (void *)at), "memory");
    return mem;
}

/* b reordered into the plan's layout, then c = a b. */
static void run(int bf16, int m, int n, int k, const void *a, const void *b, void *c) {
    pthread_mutex_lock(&dnnl.lock);
    gemm_plan *p = plan_for(bf16, m, n, k);
    if (p->b_blocked_bytes > dnnl.b_blocked_cap) {
        free(dnnl.b_blocked);
        dnnl.b_blocked = malloc(p->b_blocked_bytes);
        if (!dnnl.b_blocked) {
            fprintf(stderr, "flexgen: out of memory for a prefill product's weights (%s)\n",
                    human((double)p->b_blocked_bytes).s);
            abort();
        }
        dnnl.b_blocked_cap = p->b_blocked_bytes;
    }
    dnnl_memory_t a_mem = memory_at(&p->a_md, a), b_mem = memory_at(&p->b_md, b);
    dnnl_memory_t b_blocked = memory_at(&p->b_blocked_md, dnnl.b_blocked), c_mem = memory_at(&p->c_md, c);
    dnnl_exec_arg_t reorder_args[2] = {{DNNL_ARG_FROM, b_mem}, {DNNL_ARG_TO, b_blocked}};
    dnnl_exec_arg_t product_args[3] = {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_blocked}, {DNNL_ARG_DST, c_mem}};
    check(dnnl_primitive_execute(p->reorder, dnnl.stream, 2, reorder_args), "reorder");
    check(dnnl_primitive_execute(p->product, dnnl.stream, 3, product_args), "matmul");
    check(dnnl_stream_wait(dnnl.stream), "stream");
    dnnl_memory_destroy(a_mem);
    dnnl_memory_destroy(b_mem);
    dnnl_memory_destroy(b_blocked);
    dnnl_memory_destroy(c_mem);
    pthread_mutex_unlock(&dnnl.lock);
}

void gemm_s8(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c) { run(0, m, n, k, a, b, c); }

void gemm_bf16(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c) { run(1, m, n, k, a, b, c); }

/* The kernel oneDNN chose for the last shape, e.g. "onednn brg:avx512_core_amx_int8" (before the
 * first product: for a shape of 256 x 256 x 256, which takes the same kernel as prefill's). */
const char *gemm_path(int bf16) {
    static char path[96];
    bf16 = bf16 != 0;
    pthread_mutex_lock(&dnnl.lock);
    if (!dnnl.path[bf16][0]) plan_for(bf16, 256, 256, 256);
    snprintf(path, sizeof path, "%s", dnnl.path[bf16]);
    pthread_mutex_unlock(&dnnl.lock);
    return path;
}

#endif
