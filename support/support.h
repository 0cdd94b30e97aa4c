/* support/support.h: what the paper's files take from the support layer, the one support header
 * they include: error lines and small services, fp16, the fast kernels (SIMD twins and the CPU's
 * products), the checkpoint's weight table and dummy weights, the disk tier's mapped files, the
 * KV cache's pages, the I/O threads, sampling, the trace. It builds on model.h alone: nothing here
 * knows the runtime (flexgen.h), so the support files beneath it never call back up into it.
 */
#ifndef FLEXGEN_SUPPORT_H
#define FLEXGEN_SUPPORT_H

#include "model.h"

#include <pthread.h>
#include <stdio.h>

/* ---- Error lines and small services (util.c) ---- */
/* Writes one line into err (may be NULL) and returns -1; control characters become '?'. */
int fg_fail(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The line in err, about a file that `flag` named, with the flag put before it; returns -1. */
int fg_fail_flag(char *err, const char *flag);
double now_seconds(void); /* a monotonic clock */
#define GB ((double)(1 << 30))
typedef struct {
    char s[32];
} size_text;
size_text human(double bytes); /* "1.50 GiB", "12.3 MiB", "4.0 KiB", "512 B" */
/* bytes on whole 64-byte cache lines (free() frees them), or NULL: what matrix units load a row
 * of a tile at a time (AMX), and a row that straddles two lines slows them */
void *line_alloc(size_t bytes);
double mem_available_bytes(void);
double host_memory_for_plans(void);
int is_dir(const char *path);
int check_dir(const char *flag, const char *dir, char *err); /* exists and is writable */
int mkdir_p(const char *dir);                                /* -1 (errno) on failure */
/* folder gets path's folder ("." for a bare name, "/" for a name at the root); returns the name
 * after it, inside path. */
const char *path_folder(const char *path, char *folder, size_t n);
void path_beside(const char *path, const char *name, char *out, size_t n); /* name in its folder */
void default_weight_dir(char *out, size_t n);                              /* ~/.cache/flexgen */
int unnamed_file(const char *dir, const char *flag, char *err); /* an fd, removed at exit */
/* A file made in dir and named once complete (the weights' file of --path): util.c. */
typedef struct {
    char path[FG_PATH_LEN]; /* its temporary name, or "" (unnamed) */
    int slot;               /* the temporary's place among the handlers' */
} fg_new;
int fg_new_file(const char *dir, const char *flag, fg_new *t, char *err);
int fg_new_file_name(fg_new *t, int fd, const char *path);
void fg_new_file_remove(fg_new *t);
/* The directories mkdir_p made, where they are empty: a failed (or stopped) run's way out. */
void fg_remove_made_dirs(void);
/* A SIGBUS in a watched mapping ends the process with one line naming its file. */
void fg_watch_mapping(const void *base, size_t size, const char *path);
void fg_unwatch_mapping(const void *base);
static inline uint64_t fg_mix64(uint64_t x) { /* a stateless 64-bit hash (splitmix64's finalizer) */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}
uint64_t fg_fnv64(const void *bytes, size_t n); /* FNV-1a: names, files */
#define FG_FNV64_START 0xcbf29ce484222325ULL
uint64_t fg_fnv64_more(uint64_t h, const void *bytes, size_t n); /* h: FG_FNV64_START, or an earlier
                                                                    result */

/* ---- fp16 (util.c): round to nearest even, as the hardware and PyTorch's .half() ---- */
fp16 fp32_to_fp16(float f); /* fp16_to_fp32 is in flexgen.h */
float bf16_to_fp32(uint16_t b);
uint16_t fp32_to_bf16(float f);                                 /* to nearest, ties to even */
void fp32_to_bf16_n(const float *src, uint16_t *dst, size_t n); /* every thread */
void fp16_to_fp32_n(const fp16 *src, float *dst, size_t n);     /* F16C where the CPU has it */
void fp32_to_fp16_n(const float *src, fp16 *dst, size_t n);
int fg_cpu_has_avx2(void); /* AVX2, FMA and F16C, and the path not portable (FLEXGEN_ISA,
                              FLEXGEN_NO_SIMD) */

/* ---- The instruction set the CPU's kernels run (util.c): the widest the CPU has, or the one
 * FLEXGEN_ISA names: portable, avx2, avx512 (no wider than the CPU's), or avx512-simde, the
 * AVX-512 kernels built on SIMDe's portable C, which runs anywhere. FLEXGEN_NO_SIMD=1: portable.
 * AVX-512 here means F, BW, DQ and VL. ---- */
enum {
    FG_CPU_AVX = 1,
    FG_CPU_AVX2 = 2,
    FG_CPU_FMA = 4,
    FG_CPU_AVX512F = 8,
    FG_CPU_AVX512BW = 16,
    FG_CPU_AVX512DQ = 32,
    FG_CPU_AVX512VL = 64,
    FG_CPU_F16C = 128,
    FG_CPU_AVX512VNNI = 256,
    FG_CPU_AVXVNNI = 512
};
unsigned fg_cpu_features(void); /* this CPU's FG_CPU_ bits (with the OS's support for them) */
typedef enum { FG_ISA_PORTABLE, FG_ISA_AVX2, FG_ISA_AVX512, FG_ISA_AVX512_SIMDE } fg_isa;
fg_isa fg_isa_of_cpu(void);
fg_isa fg_isa_active(void);
const char *fg_isa_name(fg_isa isa);
/* FLEXGEN_ISA checked: 0, or -1 with err naming the variable and what is wrong. */
int fg_isa_check_env(char *err);

/* ---- The decode products' wide kernels (matmul.c: AVX2; avx512.c: AVX-512, built natively and
 * on SIMDe). A band is kc rows of W for every row of x (ldx apart; y ldy apart), over whole groups
 * of 64 columns: one fused chain per element of y over k in order, from y (from_y) or 0 (for
 * 4-bit weights, matmul.c's band_q4_portable's sums, then added to y), so the bits are the
 * portable path's. ahead: prefetch the same columns kc rows on (the next band). ---- */
/* Decode's 4-bit products (matmul.c) in bands of up to Q4_BAND rows of W and chunks of up to
 * Q4_CHUNK groups, for up to Q4_CHUNK rows of x at a time; the terms that do not depend on the
 * column, for group g + i of the chunk: a[r][k][i] = x[r][k] scale[k][g + i], and min_term[r][i],
 * the band's sum of x[r][k] min[k][g + i] (one fmaf chain, k in order). */
enum { Q4_BAND = 32, Q4_CHUNK = 8 };
typedef struct {
    float a[Q4_CHUNK][Q4_BAND][Q4_CHUNK];
    float min_term[Q4_CHUNK][Q4_CHUNK];
} q4_terms;
typedef void fg_int8_sums(const uint8_t *quads, const int8_t *a8, int mr, int32_t (*isum)[64]);
typedef void fg_int8_pairs(const float *x, int rows, size_t ldx, int in, const uint8_t *w,
                           size_t stride, int G, int g0, int ng, float *y, size_t ldy, int from_y);
typedef struct {
    const char *name;
    /* fp16 rows of W, ldw apart; cols a multiple of 64 */
    void (*band_f16)(const float *x, int rows, size_t ldx, const fp16 *w, size_t ldw, int kc,
                     int cols, float *y, size_t ldy, int from_y, int ahead);
    /* 4-bit codes of one part, stride bytes a row, from the first byte of the chunk's first
     * group: ng <= Q4_CHUNK whole groups, rows <= Q4_CHUNK rows of x given by their terms t; y at
     * the chunk's first column */
    void (*band_q4)(const q4_terms *t, int rows, const uint8_t *codes, size_t stride, int ng,
                    int kc, float *y, size_t ldy, int from_y, int ahead);
    /* lm_head: y[r][j] = x[r] . E[v0 + j] for every row of x (dim apart) and ne <= 8 rows of fp16
     * E [n][dim], each dot in 8 lanes as matmul.c's dot_portable */
    void (*dots_f16)(const float *x, int rows, int dim, const fp16 *E, int v0, int ne, float *y,
                     size_t ldy);
    /* the same for a 4-bit table (v0 a multiple of 8, inside one group), from the codes:
     * y[r][j] = a[r] . q[v0 + j] + min_term[r], a [rows][dim] (matmul.c's lm_head) */
    void (*dots_q4)(const float *a, const float *min_term, int rows, int dim, const uint8_t *E,
                    int v0, int ne, float *y, size_t ldy);
    /* 4-bit x int8 (int8.c) with VNNI: isum[r][s] = sum over k < 64 of a8[64 r + k] quads[4 (64 (k
     * / 4)
     * + s) + k % 4], exact in int32, for mr <= 4 rows and the 64 slots of a block's panel; NULL:
     * none */
    fg_int8_sums *int8_sums;
    /* the same scheme for decode with no panel (avx512.c with VNNI; int8.c's int8_pairs_avx2 on
     * the avx2 path): rows of x (ldx apart) over in (a multiple of 64) rows of W; ng (even) whole
     * groups of a part from g0, whose codes start at w in row 0 (stride bytes a row; G groups in
     * the part); y at group g0's first column, = or += x W; NULL: none */
    fg_int8_pairs *int8_pairs;
} matmul_kernels;
fg_int8_sums *matmul_int8_sums(void); /* the path's VNNI sums where this CPU (or SIMDe) has them;
                                         NULL: none */
const char *matmul_int8_path(void); /* the integer sums' instructions: avx512-vnni, avx-vnni, avx2,
                                       portable */
fg_int8_sums *int8_sums_vnni256(int native); /* int8.c: AVX-VNNI's sums, or (0) their AVX2
                                                stand-in */
/* int8.c: int8_pairs with vpmaddubsw, no VNNI needed (matmul.c's avx2 path; x86-64 builds only) */
fg_int8_pairs int8_pairs_avx2;
const matmul_kernels *matmul_avx512(void); /* NULL where the compiler cannot build it */
const matmul_kernels *matmul_avx512_simde(void);
const char *matmul_path(void); /* the path the products run: "portable", "avx2", "avx512", ... */

/* ---- The SIMD twins of the paper's loops (simd.c): the same arithmetic, so the same bits.
 * An entry is NULL where the CPU lacks AVX2 (the plain loop runs then). ---- */
typedef struct {
    void (*q4_range)(const float *x, float *lo, float *hi);                /* 64 values */
    void (*q4_pack)(const float *x, float min, float inv, uint8_t *bytes); /* 64 values */
    size_t (*q4_decode_groups)(const uint8_t *bytes, const fp16 *mins, const fp16 *scales,
                               size_t len, float *out); /* whole groups; returns values done */
    void (*q4_decode_row)(const uint8_t *bytes, const fp16 *mins, const fp16 *scales, size_t r,
                          size_t inner, float *out);
    /* the attention loops over nk rows `stride` apart; the first n_ahead rows of `ahead` (the
     * next run's, the same stride) are asked for as they go, row i with row i */
    void (*dot_f16_rows)(const float *q, const fp16 *K, size_t stride, int nk, int hd, float scale,
                         float *scores, const fp16 *ahead, int n_ahead);
    void (*axpy_f16_rows)(const float *p, const fp16 *V, size_t stride, int nk, int hd, float *out,
                          const fp16 *ahead, int n_ahead);
    /* checkpoint.c's dummy values: element first + j apart (j < n) of a tensor whose hash starts
     * at base, center + scale (u - 1) rounded to fp16 and back; returns the values done (whole
     * groups of 8) */
    size_t (*dummy_values)(uint64_t base, size_t first, size_t apart, size_t n, float center,
                           float scale, float *out);
} fg_simd;
const fg_simd *fg_simd_kernels(void);
/* row j of the n_ahead rows at `ahead` (hd values, `stride` apart) asked for ahead of its use */
void fg_prefetch_ahead(const fp16 *ahead, int n_ahead, int j, size_t stride, int hd);

/* ---- The CPU's products with weights as stored, fp16 or 4-bit (matmul.c): the fast twins of
 * opt_model.c's matmul_reference and embed_t_reference. q4_parts > 0: 4-bit, in q4_parts
 * parts side by side (q|k|v: 3), each grouped on its own ---- */
#define MATMUL_DECODE_ROWS 64
/* How the CPU backend's linear layers multiply (model_weights.products): fp32 products of the
 * weights as stored (§5), the 4-bit weights times int8 activations (int8.c), or prefill in bf16. */
typedef enum { PRODUCTS_FP32, PRODUCTS_INT8, PRODUCTS_BF16_PREFILL } fg_products;
#define MATMUL_EMBED_DOT_ROWS 64
#define MATMUL_EMBED_BLOCK 64
/* What a linear layer does to y after its product (opt_model.c's linear_layer): bias[j] added
 * to every row, then ReLU where relu; the int8 prefill product does it in its finish, the others
 * in a pass after. matmul_weights' after: NULL (nothing), or one with a bias. */
typedef struct {
    const float *bias;
    int relu;
} matmul_epilogue;
/* --int8-activations' prefill: W's 7-bit columns made once, for weights that stay put
 * (matmul.c), and a set of them that the runtime keeps with its resident 4-bit matrices, found
 * by W. int8_columns_estimate: about the bytes a W[in][out] takes. add: 0, or -1 without memory. */
typedef struct int8_columns int8_columns;
typedef struct int8_column_set {
    int n, cap;
    int8_columns **items;
    size_t bytes;
} int8_column_set;
size_t int8_columns_estimate(int in, int out);
int int8_column_set_add(int8_column_set *set, const void *W, int q4_parts, int in, int out);
const int8_columns *int8_column_set_find(const int8_column_set *set, const void *W); /* or NULL */
void int8_column_set_free(int8_column_set *set);
/* products: fg_products (model.h); prefill: the GPU batch's phase (PRODUCTS_INT8 and
 * PRODUCTS_BF16_PREFILL take prefill's scheme for a prompt of any rows, and for a decode step of
 * more than MATMUL_DECODE_ROWS); scratch: matmul_scratch_floats(in, out)
 * floats where rows > MATMUL_DECODE_ROWS; kept: NULL, or the int8 columns made once
 * (PRODUCTS_INT8's prefill reads W's there, where the set has them, instead of making them from
 * the codes) */
void matmul_weights(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                    float *y, int accumulate, int products, int prefill, float *scratch,
                    const matmul_epilogue *after, const int8_column_set *kept);
/* int8.c; vnni: NULL, or the sums; pairs: NULL, or the path's kernel without a panel
 * (int8_pairs) */
void matmul_q4_int8(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                    float *y, int accumulate, int simd, fg_int8_sums *vnni, fg_int8_pairs *pairs);
/* int8.c's scheme of decode (any rows), on this CPU's path */
void matmul_int8_blocks(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                        float *y, int accumulate);
/* int8.c, prefill's steps: each row of x rounded to int8 once (every thread); each column of W,
 * in 7 bits (|w8| <= INT8_W_MAX), scale[j] = max_k |w[k][j]| / INT8_W_MAX; then y (= or +=)
 * alpha[r] scale[j] isum[r][j] */
enum { INT8_W_MAX = 64 };
void int8_round_rows(const float *x, int rows, int in, int8_t *x8, float *alpha);
/* W's columns, n (<= 64) of them, whose rows come a block at a time (matmul.c widens the 4-bit
 * codes of 64 rows at a time into L1): begin; tops over every block of rows; scales; round over
 * every block of rows again. One thread a block of columns. */
typedef struct {
    int n;
    const struct rounding_loops *loops; /* the path's build of the loops */
    uint32_t top_bits[64];              /* max |w[k][j]| so far, as bits */
    float inv[64];                      /* INT8_W_MAX / max |w[k][j]| */
} int8_column_block;
void int8_column_block_begin(int8_column_block *b, int n);
void int8_column_block_tops(int8_column_block *b, const float *w, int kc, size_t ldw);
void int8_column_block_scales(int8_column_block *b, float *scale);
void int8_column_block_round(const int8_column_block *b, const float *w, int kc, size_t ldw,
                             int8_t *w8, size_t ldw8);
/* The build of the rounding loops the last rounding ran: avx512, avx2, default, or "none ran" */
const char *int8_rounding_path(void);
/* ... then bias[j] added (NULL: none) and ReLU (relu != 0), as linear_layer does after a product */
void int8_finish_rows(const int32_t *isum, const float *alpha, const float *scale, int rows, int nc,
                      float *y, int ldy, int accumulate, const float *bias, int relu);
size_t matmul_scratch_floats(int in, int out);

/* ---- The opt-in prefill schemes' products (onednn.c): oneDNN where the build has it and its
 * kernel keeps the product's promise, else onednn.c's own paths; they always give c ---- */
/* gemm_s8's b_max: the largest |b| the caller's b holds (INT8_W_MAX for the prefill scheme's W) */
void gemm_s8(int m, int n, int k, const int8_t *a, const int8_t *b, int b_max, int32_t *c);
/* b kept for many products (prefill's W, made once with the weights): gemm_s8_keep copies b into
 * the layout the product's kernel reads (oneDNN's, with b's column sums; or b as it is), NULL
 * without memory; gemm_s8_with_kept gives gemm_s8's c, the same sums, with no reorder of b: 0,
 * or -1 where no kernel takes the kept layout for m rows (gemm_s8 on b then gives c). */
typedef struct gemm_s8_kept gemm_s8_kept;
gemm_s8_kept *gemm_s8_keep(int n, int k, const int8_t *b, int b_max);
int gemm_s8_with_kept(int m, const int8_t *a, const gemm_s8_kept *b, int32_t *c);
size_t gemm_s8_kept_bytes(const gemm_s8_kept *b);
void gemm_s8_kept_free(gemm_s8_kept *b);
void gemm_bf16(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c); /* c [m][n] */
void gemm_s8_reference(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c);
void gemm_bf16_reference(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c);
/* The exact AVX2 kernel (int16 pairs): 0, or -1 where the CPU has no AVX2 or there is no memory. */
int gemm_s8_pairs(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c);
/* The path the last product of the kind (bf16 or int8) took: "onednn " and oneDNN's kernel, "avx2
 * (exact int16 pairs)", "fp32 sgemm of bf16 operands", "portable"; "none ran" before the first. */
const char *gemm_path(int bf16);
/* The instruction set oneDNN's kernels may use here ("onednn avx512_core_amx", ...; "none" without
 * oneDNN), which with the shapes decides its kernels; it plans no product. */
const char *gemm_library_isa(void);
void matmul_embed_t(const float *x, int rows, int dim, const void *E, int q4_parts, int n, float *y,
                    float *scratch, size_t scratch_stride);
void matmul_embed_row(const void *E, int q4_parts, int n, int dim, int r, float *dst);

/* ---- Buffers of the forward pass (workspace.c) ---- */
/* The disk tier's files, unless --offload-dir. */
#define FG_DEFAULT_OFFLOAD_DIR "/var/tmp"
/* Bytes of an activation: fp16 on CUDA, fp32 on the CPU (app/cpu_fp16.c keeps 2). */
#define FG_CUDA_ACT_ELEM 2
#define FG_CPU_ACT_ELEM 4
/* The device's context, cuBLAS and rounding: an estimate. Of it, cuBLAS's: its handle's own
 * workspace, and cublasLt's for the fp16 products of decode's rows (support/cuda_device.cu,
 * fp16_product), FG_CUDA_PRODUCT_WORKSPACE a thread, cuBLAS's own size on Hopper. */
#define FG_CUDA_RESERVE (512.0 * (1 << 20))
#define FG_CUDA_PRODUCT_WORKSPACE ((size_t)32 << 20)
/* Pinned copy buffers: 3 copying threads, 2 of 8 MiB each. */
#define FG_CUDA_HOST_RESERVE (3 * 2 * 8.0 * (1 << 20))
/* Prefill runs a layer on chunks of this many token rows at most. */
#define FG_CHUNK_ROWS 2048
size_t fg_workspace_rows(int gbs, int max_prompt);
int gpu_batch_init(gpu_batch *gb, int batch, int max_len, int max_new, char *err);
void gpu_batch_free(gpu_batch *gb);
gpu_batch gpu_batch_slice(const gpu_batch *gb, int first, int n, size_t act_row);
void gpu_batch_advance(gpu_batch *gb); /* after a step: past[b] += its tokens; next, decode's
                                          rows */
/* The CPU's workspace: max_prompt is not used (decode's max_len keys are the most). */
size_t model_workspace_bytes(const model_config *cfg, size_t rows, int max_prompt, int max_len);
int model_workspace_init(model_workspace *ws, const model_config *cfg, size_t rows, int max_prompt,
                         int max_len, char *err);
void model_workspace_free(model_workspace *ws);
enum { FG_CUDA_WS_PARTS = 7 };
/* CUDA's 4-bit products (flexgen.cu, §5): up to FG_CUDA_Q4_DIRECT rows of x (decode's) multiply
 * the codes in one pass, a block summing k_chunk rows of W (fg_cuda_q4_k_chunk) into fp32 partial
 * sums, which the last block of a group of columns to finish adds (its count of chunks done is
 * one of fg_cuda_q4_groups; the logits' product a group of rows of E a block, whole); more rows
 * widen W to fp16 for cuBLAS a slice at a time: FG_CUDA_WIDEN_VALUES values (2 MiB), or 64 columns
 * of the longest matrix where those are more. */
enum { FG_CUDA_Q4_DIRECT = 32 };
enum { FG_CUDA_WIDEN_VALUES = 1 << 20, FG_CUDA_WIDEN_COLUMNS = 64 };
int fg_cuda_q4_k_chunk(int in, int out, int rows);
size_t fg_cuda_q4_scratch_bytes(const model_config *cfg); /* a part of the workspace */
size_t fg_cuda_q4_groups(const model_config *cfg);        /* the most groups of a product */
/* Decode attention on CUDA splits a query's keys into spans of at most FG_CUDA_SPAN_KEYS, a block
 * each (flexgen.cu, queue_attention), and into shorter ones, down to FG_CUDA_MIN_SPAN_KEYS, where
 * a step's queries are too few to fill the card. Each (row, query head, span) leaves head_dim + 2
 * floats in the workspace, which has room for FG_CUDA_SPLIT_ROWS rows' spans of max_len keys, for
 * FG_CUDA_MIN_SPAN_SLOTS spans at least, and for one row's top-K scores of max_len keys:
 * fg_cuda_span_slots (a step that needs more goes through in runs of its rows). */
enum { FG_CUDA_SPAN_KEYS = 256, FG_CUDA_MIN_SPAN_KEYS = 64, FG_CUDA_SPLIT_ROWS = 256 };
enum { FG_CUDA_MIN_SPAN_SLOTS = 4096 };
static inline int fg_cuda_attention_spans(int keys) {
    return (keys + FG_CUDA_SPAN_KEYS - 1) / FG_CUDA_SPAN_KEYS;
}
/* A query's scores and list of kept keys for §5's top-K over nk keys (flexgen.cu's
 * attention_kernel), in shared memory or the workspace: the scores in whole 16-byte groups, then
 * up to nk keys' indices (4 bytes each), in whole groups too. */
static inline size_t fg_cuda_top_k_bytes(int nk) { return (size_t)(nk + 3) / 4 * 16 * 2; }
/* The slots (of head_dim + 2 floats) that a query row's top-K scores of its heads take. */
static inline size_t fg_cuda_top_k_slots(int heads, int head_dim, int nk) {
    size_t slot_bytes = 4 * ((size_t)head_dim + 2);
    return ((size_t)heads * fg_cuda_top_k_bytes(nk) + slot_bytes - 1) / slot_bytes;
}
size_t fg_cuda_span_slots(const model_config *cfg, size_t rows, int max_len);
/* The CUDA backend's tables, for `rows` sequences at most: a step's pad, past and tokens; a
 * layer's pad, past, K and V pointers and page tables of max_pages entries (flexgen.cu). A few
 * of each stay on the device, so that one already there is not uploaded again. The token tables'
 * part ends with the 4-bit products' counts of chunks done (fg_cuda_q4_groups of them). */
enum { FG_CUDA_TOKEN_TABLES = 2, FG_CUDA_CACHE_TABLES = 2 };
size_t fg_cuda_token_table_bytes(size_t rows);
size_t fg_cuda_cache_table_bytes(size_t rows, int max_pages);
size_t fg_cuda_workspace_parts(const model_config *cfg, size_t rows, int max_prompt, int max_len,
                               size_t *sizes);
size_t fg_cuda_workspace_bytes(const model_config *cfg, size_t rows, int max_prompt, int max_len);
size_t fg_cuda_delegated_bytes(const model_config *cfg, size_t rows, int max_len);

/* ---- Configs and the weight table (checkpoint.c, safetensors.c) ---- */
typedef enum { ST_F16, ST_BF16, ST_F32 } st_dtype;
typedef struct {
    char name[160];
    st_dtype dtype;
    int ndim;
    int64_t shape[4];
    const void *data; /* inside the mapping */
    size_t nbytes;
    int file;
} st_tensor;
typedef struct {
    int n_files, n_tensors;
    char **paths;
    void **maps;
    size_t *sizes;
    st_tensor *tensors;
} st_archive;
const st_tensor *st_find(const st_archive *a, const char *name);
void st_close(st_archive *a);

/* An OPT-shaped config written out (tests, the profiler): the fields of OPT_SIZES' rows. */
#define OPT_SHAPE(nm, layers, h, heads, f, v, pos, wd, pre)                                  \
    {                                                                                        \
        .name = nm, .n_layers = layers, .hidden = h, .n_heads = heads, .ffn = f, .vocab = v, \
        .max_pos = pos, .word_dim = wd, .pre_ln = pre                                        \
    }

int model_config_by_name(const char *name, model_config *cfg, char *err); /* "opt-125m" ... */
/* An HF checkpoint directory: its config.json (cfg->name becomes dir) and its archive, mapped. */
int opt_checkpoint_open(const char *dir, model_config *cfg, st_archive *a, char *err);
/* FlexGen's layer list (0 input embedding, 1 .. n_layers decoders, n_layers + 1 output
 * embedding) split over n pipeline stages: stage s has [*first, *end). */
void fg_stage_layers(const model_config *c, int s, int n, int *first, int *end);
size_t opt_param_count(const model_config *cfg);
size_t layer_param_count(const model_config *cfg, int j);  /* FlexGen's layer j: 0 input, 1 ..
                                                              n_layers, output */
size_t layer_vector_count(const model_config *cfg, int j); /* of those, in biases and norms */

/* The model's stored tensors, layer by layer (§4.2 places weights tensor by tensor within a
 * layer). A layer's tensors tile one arena of layer_floats[layer] values; tensor t starts at
 * offset and spans count (64-byte padding included). */
typedef struct {
    char name[96];        /* HF name without "model." (q_proj's for the fused q, k, v) */
    int layer;            /* FlexGen's layer */
    size_t offset, count; /* elements, within the layer's arena */
    fp16 **slot;          /* the field of the view that points at the tensor's working copy */
    size_t group_outer, group_len, group_inner; /* §5's grouping: [outer][len][inner] along
                                                   len; group_len 0: a vector, never 4-bit */
    int tied_to;             /* -1, or the tensor whose values and home it shares (tied lm_head) */
    int first_spec, n_specs; /* the checkpoint tensors that fill it (internal) */
} opt_tensor;
typedef struct opt_layout {
    model_weights *view; /* the compute view whose fields the slots name */
    opt_tensor *tensors;
    int n_tensors;
    size_t *layer_floats; /* [n_layers + 2] */
    void *specs;          /* internal to checkpoint.c */
    int n_specs;
} opt_layout;
/* Where values come from: a checkpoint (archive) or dummy weights (archive NULL, seed). */
typedef struct {
    const st_archive *archive;
    uint64_t seed;
} weight_source;
int opt_layout_init(opt_layout *l, model_weights *view, const model_config *cfg, int has_lm_head,
                    char *err);
void opt_layout_free(opt_layout *l);
int opt_layout_check_archive(const opt_layout *l, const st_archive *a, const char *dir, char *err);
/* Tensor t's values rounded to fp16, in its stored layout, into dst32 (as fp32) or dst16; -1 with
 * a line naming the file, the tensor and the element where a checkpoint value is not a finite
 * fp16 (NaN, Inf, or beyond 65504). */
int opt_tensor_fill(const opt_layout *l, int t, const weight_source *src, float *dst32, fp16 *dst16,
                    char *err);
/* n dummy values (seed) of part `part` of tensor t, `apart` apart in the part's checkpoint order
 * from element `first`, rounded to fp16 as opt_tensor_fill rounds them, as fp32 (halves: room for
 * n), for quant.c's q4_compress_dummy. */
void opt_tensor_dummy_values(const opt_layout *l, int t, int part, uint64_t seed, size_t first,
                             size_t apart, size_t n, float *out, fp16 *halves);

/* ---- The disk tier's files, mapped (disk_arena.c) ---- */
/* A file of the disk tier, mapped: pieces of it are taken page-aligned, in order. */
typedef struct {
    int fd;
    char *base;
    size_t size, used;
} disk_arena;

size_t page_size(void);
size_t page_up(size_t n);
int arena_map(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir, char *err);
int arena_map_read_only(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir,
                        char *err);
void arena_close(disk_arena *a);
void disk_fetch_pages(const disk_arena *a, size_t off, size_t len);
/* The whole pages under [p, p + bytes) of the arena: from *off, *len bytes. */
void page_range(const disk_arena *a, const void *p, size_t bytes, size_t *off, size_t *len);
void *arena_take(disk_arena *a, size_t bytes); /* page-aligned; the plan sized the arena */
void drop_pages(const disk_arena *a, const void *p, size_t bytes, int dirty);

/* The dummy-weight file (weight_file.c): every tensor's stored bytes, page-aligned, with a
 * checksum per layer, written once into the weight dir and reused while intact. */
typedef struct {
    const char *dir;         /* the weight dir (--path) */
    const model_config *cfg; /* with seed and q4, what names the contents */
    uint64_t seed;
    int q4;
    const opt_layout *layout;
    const int *layer_first; /* [n_layers + 3]: layer j's tensors are [j] .. [j + 1] - 1 */
    size_t (*bytes)(void *ctx, int i);                   /* tensor i's stored bytes */
    int (*fill)(void *ctx, int i, void *dst, char *err); /* ... and the bytes themselves */
    void *ctx;
    int verbose;
} weight_file;
int weight_file_exists(const weight_file *f);
int weight_file_map(const weight_file *f, disk_arena *a, size_t *offsets, char *err);

/* ---- Sampling (sampling.c) ---- */
typedef struct {
    uint64_t s[2];
} fg_rng;
void rng_seed(fg_rng *r, uint64_t seed);
uint64_t rng_next(fg_rng *r);
int fg_argmax(const float *x, int n); /* the first of equal maxima, as torch.argmax */
/* The tokens a draw is left to: (probability, id) pairs of softmax(logits / temperature) in
 * scratch (2 n floats), the first `keep` of them (the value returned) the nucleus of top_p (all
 * n where top_p >= 1: unsorted), their sum in *mass. */
int sample_nucleus(const float *logits, int n, float temperature, float top_p, float *scratch,
                   float *mass);
/* temperature <= 0: argmax. Else a draw from sample_nucleus's tokens. scratch: 2 n floats. */
int sample_token(const float *logits, int n, float temperature, float top_p, fg_rng *rng,
                 float *scratch);
/* Every prompt is a non-empty run of token ids in the vocab that fits the model's positions with
 * gen_len more (check_prompt: one, its line naming it as `name`); forced tokens (teacher forcing,
 * [n][gen_len]) are ids of the vocab. */
int check_prompt(const model_config *c, const int *ids, int len, int gen_len, const char *name,
                 char *err);
int check_prompts(const model_config *c, int n, int *const *prompts, const int *lens, int gen_len,
                  char *err);
int check_forced(const model_config *c, const int *forced, int n, int gen_len, char *err);

/* ---- The trace (trace.c): one track per thread, one event per task or computation ---- */
enum { TRACK_COMPUTE, N_TRACKS = 5 };
typedef struct {
    const char *name;
    int layer, batch;
    double start, end; /* seconds since the run began */
} trace_event;
typedef struct {
    trace_event *events;
    size_t n, cap;
} trace_track;
typedef struct {
    double time;           /* seconds since the run began: the step's end */
    fg_device_counts step; /* what the host asked of the device in the step */
} trace_counts;
typedef struct {
    int on;
    double t0;
    trace_track tracks[N_TRACKS];
    trace_counts *counts; /* each step's counters, where the backend counts (CUDA) */
    size_t n_counts, cap_counts;
} fg_trace;
void trace_record(fg_trace *tr, int track, const char *name, int layer, int batch, double start,
                  double end);
void trace_record_counts(fg_trace *tr, double end, const fg_device_counts *step);
void trace_restart(fg_trace *tr, double t0); /* no events yet; times from t0 */
/* Each counter of sum: plus c's, or (most) the larger of the two; d = end - start. */
void device_counts_add(fg_device_counts *sum, const fg_device_counts *c, int most);
void device_counts_diff(const fg_device_counts *end, const fg_device_counts *start,
                        fg_device_counts *d);
void trace_free(fg_trace *tr);

/* ---- The KV cache in pages (kv_pages.c; vLLM's PagedAttention) ---- */
typedef struct {
    int rows[N_TIERS]; /* of a GPU batch's sequences: gpu first, then cpu, then disk */
} row_split;
fg_tier tier_of(const row_split *s, int b); /* the tier of a GPU batch's sequence b */
/* keys [j, j + n) of one head as decode attention reads them: a run in one page, at most 16 */
const fp16 *kv_head_run(const opt_kv_rows *r, int j, int nk, int *n);
static inline int kv_pages_for(int tokens, int page_tokens) {
    return (tokens + page_tokens - 1) / page_tokens;
}
typedef struct {
    int page_tokens;         /* tokens a page */
    int pool_pages[N_TIERS]; /* each tier's pool */
} kv_pool_size;
/* The pools of a job of n prompts (lens NULL: each max_len - gen_len long), in blocks of `slots`;
 * diagonal_blocks > 0: the prompts stream through that many blocks, GPU batch k of each starting
 * at step diagonal_starts[k] (the diagonal schedule's staircase, tiers.h's diagonal_start). */
kv_pool_size kv_pool_shape(const row_split *cache, int gbs, int slots, int max_len, int n,
                           const int *lens, int gen_len, int diagonal_blocks,
                           const int *diagonal_starts);
typedef struct {
    kv_pool_size pool;
    row_split cache; /* slot s is on tier tier_of(&cache, s % gbs) */
    int gbs, slots;
    int max_pages;   /* a slot's page table: the pages of max_len tokens */
    int *page_table; /* [slots][max_pages]: each slot's pages in its tier's pool */
    int *held;       /* [slots]: how many pages each slot holds */
    int *free_pages[N_TIERS], n_free[N_TIERS]; /* each tier's pages held by no slot (a stack) */
    int peak[N_TIERS]; /* the most pages of each tier's pool held at once since kv_pages_init */
} kv_pages;
int kv_pages_init(kv_pages *kp, const kv_pool_size *pool, const row_split *cache, int gbs,
                  int slots, int max_len, char *err);
void kv_pages_free(kv_pages *kp);
void kv_pages_reset(kv_pages *kp);
fg_tier slot_tier(const kv_pages *kp, int slot);
const int *slot_pages(const kv_pages *kp, int slot);
int kv_pages_grow(kv_pages *kp, int slot, int tokens);
void kv_pages_give_back(kv_pages *kp, int slot);

/* ---- The I/O threads (io_links.c): a queue of tasks per link, each run in order ---- */
struct fg_runtime; /* the runtime (flexgen.h), which each task is given */
typedef struct io_task io_task;
struct io_task {
    void (*fn)(struct fg_runtime *rt, const io_task *t); /* run on the link's thread */
    const char *name;
    int after_link; /* the task waits for task after_seq of link after_link (0: none) */
    uint64_t after_seq;
    void *ctx; /* what it works on: a model (weights) or a block */
    int layer; /* FlexGen's layer j */
    int batch; /* GPU batch k */
    int arena; /* the staging arena it fills or empties */
    int msg;   /* a message between pipeline stages (pipeline.c) */
};

#define IO_QUEUE 64

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    io_task queue[IO_QUEUE];
    uint64_t submitted, done;
    int running, stop, track;
} io_link;

/* The I/O threads: disk <-> cpu and cpu <-> gpu, once for weights and once for the KV cache and
 * activations, as FlexGen's separate CUDA streams: a layer's weights then load while every GPU
 * batch of the previous layer computes, without holding up those batches' I/O. */
enum { IO_WEIGHT_DISK, IO_WEIGHT_HOST, IO_DISK, IO_HOST, N_IO };
typedef struct {
    io_link link[N_IO];
    struct fg_runtime *owner; /* what each task's fn is given */
    fg_trace *trace;
    void (*join)(unsigned links); /* after the compute thread waits for links (bits 1 << link): the
                                     backend orders their streams and its own (fg_backend.join) */
} io_links;
void io_start(io_links *io, struct fg_runtime *owner, fg_trace *trace, int overlap,
              void (*join)(unsigned links));
void io_stop(io_links *io);
uint64_t io_submit(io_links *io, int link, io_task t);
void io_wait(io_links *io, int link, uint64_t seq);
void io_sync(io_links *io, int weights);
int io_link_of_this_thread(void); /* the link whose thread calls, or -1 (the compute thread) */

#endif
