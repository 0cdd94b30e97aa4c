/* support/cuda_kernels.h: the device helpers of flexgen.cu's kernels. A block's sums, maxima and
 * softmax; the tensor cores' product (PTX's mma.sync) and fp16 pairs as bits; asynchronous copies
 * into shared memory (cp.async) and the rings of steps through which the 4-bit decode products
 * read their codes (§5: q4_rows_kernel, q4_vocab_kernel), with their stages, fragments and sums; a
 * head's cached keys and values as decode attention reads them, fp16 or 4-bit (§5), found through
 * the page table and read a chunk at a time, with the scores and weighted values of a block's
 * queries over them (one query head, or several of one K/V head, each row loaded once for them
 * all); and §5's top-K, the keys a decode query keeps, by a radix select over its weights. Each
 * helper's test is its kernel's (tests/test_kernels.cu); on the emulated GPU the PTX is
 * tests/cuda_emu's. CUDA C++, for flexgen.cu and the kernel tests; the plumbing is
 * support/cuda_device.h's.
 */
#ifndef FG_CUDA_KERNELS_H
#define FG_CUDA_KERNELS_H

#include "support/cuda_device.h"

/* nvcc's `#pragma unroll` in this file's loops over register arrays (kept in registers only
 * where every index is known); the emulated GPU's compiler has no such pragma. */
#if defined(__CUDACC__)
#define FG_UNROLL _Pragma("unroll")
#else
#define FG_UNROLL
#endif

/* ---- Block reductions, and a block's softmax (flexgen.cu's layer norms and attention) ---- */

/* The block's sum (MAX 0) or maximum (MAX 1) of each thread's v, for every thread: a warp's by
 * shuffles, then the warps' in order through `shared` (32 floats). */
template <int MAX> __device__ float block_reduce(float v, float *shared) {
    for (int o = 16; o > 0; o /= 2) {
        float other = __shfl_xor_sync(0xffffffff, v, o);
        v = MAX ? fmaxf(v, other) : v + other;
    }
    int warp = threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int warps = (blockDim.x + 31) / 32;
    __syncthreads(); /* every thread has read `shared` of the reduction before */
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = MAX ? -INFINITY : 0;
    for (int w = 0; w < warps; w++) v = MAX ? fmaxf(v, shared[w]) : v + shared[w];
    return v;
}

__device__ float block_sum(float v, float *shared) { return block_reduce<0>(v, shared); }

__device__ float block_max(float v, float *shared) { return block_reduce<1>(v, shared); }

/* The scores to softmax weights in fp32. */
__device__ void softmax(float *scores, int nk, float *shared) {
    float m = -INFINITY;
    float sum = 0;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_max(m, shared);
    for (int j = threadIdx.x; j < nk; j += blockDim.x) sum += scores[j] = expf(scores[j] - m);
    sum = block_sum(sum, shared);
    for (int j = threadIdx.x; j < nk; j += blockDim.x) scores[j] /= sum;
    __syncthreads();
}

/* ---- The tensor cores, and fp16 pairs as bits (flexgen.cu's 4-bit decode product) ---- */

__device__ inline __half2 half2_of_bits(uint32_t bits) {
    __half2 h;
    memcpy(&h, &bits, sizeof h);
    return h;
}
__device__ inline uint32_t bits_of_half2(__half2 h) {
    uint32_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
}

/* d += a b for a warp's tile of 16 x 8 x 16 (PTX's mma.sync m16n8k16: fp16 in, fp32 sums), each
 * lane (gid = lane / 4, tig = lane % 4) holding its fragments: a, of A [16][16], rows gid and gid
 * + 8 at columns (2 tig, 2 tig + 1) and those + 8, as fp16 pairs (a[0]: row gid, a[1]: gid + 8,
 * a[2], a[3]: the same at columns + 8); b, of B [16][8], rows (2 tig, 2 tig + 1) and those + 8 of
 * column gid; d, of D [16][8], rows gid (d[0], d[1]) and gid + 8 (d[2], d[3]) at columns 2 tig
 * and 2 tig + 1. Before sm_80, two m16n8k8; on the emulated GPU, tests/cuda_emu's. */
__device__ inline void mma_16x8x16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(FLEXGEN_CUDA_EMU)
    cuda_emu::mma_16x8x16(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
    for (int half = 0; half < 2; half++)
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[2 * half]), "r"(a[2 * half + 1]), "r"(b[half]));
#endif
}

/* A 4-bit code as a float, exactly: 2^23 + q holds q in its mantissa's low bits (an OR and a
 * subtraction, where a conversion instruction would run at a fraction of the FMAs' rate). */
__device__ inline float code_value(uint32_t q) {
    return __int_as_float(0x4B000000 | (int)q) - 8388608.0f;
}

/* Codes of 8 columns: 4 bytes read one at a time (where they do not lie on 4 bytes). */
__device__ inline uint32_t code_word(const uint8_t *codes) {
    return codes[0] | (uint32_t)codes[1] << 8 | (uint32_t)codes[2] << 16 | (uint32_t)codes[3] << 24;
}

/* Asynchronous copies from device memory to shared memory (PTX's cp.async, sm_80 on; before, a
 * load and a store): BYTES (4 or 16) with both ends on BYTES bytes, in groups committed in turn;
 * copy_async_wait<N> waits until at most the newest N groups are in flight. A copy lands for its
 * own lane at the wait; the warp's other lanes read it after a __syncwarp. */
template <int BYTES> __device__ inline void copy_async(void *shared, const void *global) {
#if defined(FLEXGEN_CUDA_EMU)
    cuda_emu::copy_async(shared, global, BYTES);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned at = (unsigned)__cvta_generic_to_shared(shared);
    if (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(global)
                     : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(at), "l"(global),
                     "n"(BYTES)
                     : "memory");
#elif defined(__CUDA_ARCH__)
    if (BYTES == 16) *(uint4 *)shared = *(const uint4 *)global;
    else *(uint32_t *)shared = *(const uint32_t *)global;
#endif
}

__device__ inline void copy_async_commit() {
#if defined(FLEXGEN_CUDA_EMU)
    cuda_emu::copy_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int PENDING> __device__ inline void copy_async_wait() {
#if defined(FLEXGEN_CUDA_EMU)
    cuda_emu::copy_async_wait(PENDING);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

/* One step of a 4-bit product in a warp's shared memory: 512 bytes of codes and 64 of mins and 64
 * of scales. flexgen.cu's q4_rows_kernel keeps 16 rows of W there: each row's 32 bytes of codes of
 * the block's group (codes [16][8], row r in slot r ^ (r >> 2 & 1), so that the four rows a load
 * of the lanes reads, one per tig, lie in different banks), and the 4-byte words that hold each
 * row's min and scale (the half at min_shift, scale_shift). q4_vocab_kernel keeps 16 columns of
 * 64 rows of E: 32 byte rows of 16 bytes (codes [32][4]), and the 16 columns' mins and scales as
 * fp16 pairs (mins [8], scales [8]). */
struct q4_stage {
    uint32_t codes[128];
    uint32_t mins[16];
    uint32_t scales[16];
};

/* The shared slot of row r of a step of q4_rows_kernel. */
__device__ inline int q4_slot(int r) { return r ^ (r >> 2 & 1); }

/* The warps of a block of q4_rows_kernel (and q4_vocab_kernel), which take its steps in turn,
 * and the steps in each warp's ring in (dynamic) shared memory: Q4_STAGES - 1 of them on their way
 * while it multiplies one (about 2.9 KB of codes, mins and scales in flight a warp). Once the
 * rings are done, the warps' sums of m_tiles tiles of 16 rows take their place: Q4_SHARED_BYTES. */
#define Q4_WARPS 4
#define Q4_STAGES 6
#define Q4_RING_BYTES (Q4_WARPS * Q4_STAGES * sizeof(q4_stage))
#define Q4_SUMS_BYTES(m_tiles) ((Q4_WARPS - 1) * 16 * (m_tiles) * (Q4_GROUP + 1) * sizeof(float))
#define Q4_SHARED_BYTES(m_tiles) \
    (Q4_RING_BYTES > Q4_SUMS_BYTES(m_tiles) ? Q4_RING_BYTES : Q4_SUMS_BYTES(m_tiles))

/* A warp's share of a block's steps of 16 (rows of W, or columns of E) from k_begin to k_end:
 * the steps at k0 = k_begin + 16 warp, + 16 Q4_WARPS, ..., through the warp's ring of Q4_STAGES
 * stages (its part of `stages`). copy(stage, k0) issues the step's copies into its stage
 * (q4_stage_copy, q4_vocab_copy), Q4_STAGES - 1 steps ahead, a group of copies a step (empty past
 * the last step, so that the count stays); multiply(stage, k0) uses the step once its copies have
 * landed and every lane's are in sight (the __syncwarp, after which the stage of the step before,
 * which every lane is done with, takes the copies of the step Q4_STAGES - 1 on). */
template <typename Copy, typename Multiply>
__device__ inline void q4_ring(q4_stage *stages, int k_begin, int k_end, Copy copy,
                               Multiply multiply) {
    int warp = threadIdx.x / 32;
    int step = 16 * Q4_WARPS;
    int k_first = k_begin + 16 * warp;
    int steps = k_first < k_end ? (k_end - k_first + step - 1) / step : 0;
    q4_stage *ring = stages + warp * Q4_STAGES;
    auto issue = [&](int i) {
        if (i < steps) copy(&ring[i % Q4_STAGES], k_first + i * step);
        copy_async_commit();
    };
    for (int i = 0; i < Q4_STAGES - 1; i++) issue(i);
    for (int i = 0; i < steps; i++) {
        copy_async_wait<Q4_STAGES - 2>(); /* step i's copies have landed */
        __syncwarp(); /* every lane's, and every lane is done with step i - 1's stage */
        issue(i + Q4_STAGES - 1);
        multiply(&ring[i % Q4_STAGES], k_first + i * step);
    }
}

/* A warp's copies of the step of rows k0 to k0 + 15 (those below k_end) into stage s: lane l half
 * l % 2 of row l / 2's codes at codes_at, lanes 0-15 row l's word of its min at min_at, lanes 16-31
 * row l - 16's of its scale; for rows past k_end (whose x is zero too) a min and scale of zero, so
 * that their values are zeros whatever their codes' bytes. `part` is the part's first row, rows
 * `stride` bytes apart. copy_bytes: 16 where every row's group lies on 16 bytes, 4 where rows lie
 * on 4, else 1: plain loads and stores, the min and scale put at their halves. */
__device__ inline void q4_stage_copy(q4_stage *s, const uint8_t *part, size_t stride, int k0,
                                     int k_end, size_t codes_at, size_t min_at, size_t scale_at,
                                     int copy_bytes) {
    int lane = threadIdx.x % 32;
    int r = lane / 2;
    uint32_t *codes = &s->codes[8 * q4_slot(r) + 4 * (lane % 2)];
    if (k0 + r < k_end) {
        const uint8_t *from = part + (size_t)(k0 + r) * stride + codes_at + 16 * (lane % 2);
        if (copy_bytes == 16) {
            copy_async<16>(codes, from);
        } else {
            FG_UNROLL
            for (int j = 0; j < 4; j++) {
                if (copy_bytes == 4) copy_async<4>(codes + j, from + 4 * j);
                else codes[j] = code_word(from + 4 * j);
            }
        }
    }
    int row = lane % 16;
    size_t at = lane < 16 ? min_at : scale_at;
    uint32_t *word = lane < 16 ? &s->mins[row] : &s->scales[row];
    if (k0 + row >= k_end) {
        *word = 0;
        return;
    }
    const uint8_t *row_bytes = part + (size_t)(k0 + row) * stride;
    if (copy_bytes >= 4) {
        copy_async<4>(word, row_bytes + (at & ~(size_t)3));
        return;
    }
    uint32_t bits = row_bytes[at] | (uint32_t)row_bytes[at + 1] << 8;
    *word = bits << (at & 2 ? 16 : 0);
}

/* A lane's share of a step (rows 2 tig + (0, 1, 8, 9), tig = lane % 4, gid = lane / 4) from its
 * stage: each row's 4 bytes of codes of columns 8 gid to 8 gid + 7, and its min and scale as fp16
 * pairs of rows (k, k + 1). */
struct q4_step {
    uint32_t codes[4];
    __half2 mins[2];
    __half2 scales[2];
};

__device__ inline q4_step q4_stage_read(const q4_stage *s, int min_shift, int scale_shift) {
    q4_step step;
    uint32_t min[4];
    uint32_t scale[4];
    int gid = threadIdx.x % 32 / 4;
    int tig = threadIdx.x % 4;
    FG_UNROLL
    for (int i = 0; i < 4; i++) {
        int r = 2 * tig + 8 * (i / 2) + i % 2;
        step.codes[i] = s->codes[8 * q4_slot(r) + gid];
        min[i] = s->mins[r] >> min_shift & 0xffff;
        scale[i] = s->scales[r] >> scale_shift & 0xffff;
    }
    step.mins[0] = half2_of_bits(min[0] | min[1] << 16);
    step.mins[1] = half2_of_bits(min[2] | min[3] << 16);
    step.scales[0] = half2_of_bits(scale[0] | scale[1] << 16);
    step.scales[1] = half2_of_bits(scale[2] | scale[3] << 16);
    return step;
}

/* The fp16 pair min + q scale of the two codes q in bits 0-3 and 16-19 of `codes`: each q put in
 * the mantissa of 1024 + q (0x6400 is 1024 in fp16), 1024 taken off (exact), then one rounding
 * (__hfma2). */
__device__ inline uint32_t q4_values(uint32_t codes, __half2 min, __half2 scale) {
    uint32_t q = codes & 0x000F000Fu;
    __half2 value = __hsub2(half2_of_bits(q | 0x64006400u), half2_of_bits(0x64006400u));
    return bits_of_half2(__hfma2(value, scale, min));
}

/* The fp16 pair (W[k][j], W[k + 1][j]) of two rows' code words (row0, row1), j the column of byte
 * `byte`'s high half (high) or its low. */
__device__ inline uint32_t q4_pair(uint32_t row0, uint32_t row1, int byte, int high, __half2 min,
                                   __half2 scale) {
    uint32_t both = __byte_perm(row0, row1, (uint32_t)(byte | (4 + byte) << 8));
    return q4_values(high ? both >> 4 : both, min, scale);
}

/* Rows r0 + gid and r0 + gid + 8 of x, columns k0 + 2 tig, k0 + 2 tig + 1 and those + 8, as fp16
 * pairs: a lane's A of mma_16x8x16 (gid = lane / 4, tig = lane % 4). k0 is even, so a pair is one
 * 4-byte load where x's rows lie on 4 bytes. Zeros past `rows` and past k_end. */
__device__ inline void x_fragment(const __half *x, int rows, int in, int k_end, int r0, int k0,
                                  uint32_t a[4]) {
    int gid = threadIdx.x % 32 / 4;
    int tig = threadIdx.x % 4;
    int pairs = ((uintptr_t)x | (uintptr_t)in * 2) % 4 == 0;
    FG_UNROLL
    for (int i = 0; i < 4; i++) {
        int r = r0 + gid + 8 * (i % 2);
        int k = k0 + 2 * tig + 8 * (i / 2);
        const __half *at = x + (size_t)r * in + k;
        if (pairs && r < rows && k + 1 < k_end) {
            a[i] = *(const uint32_t *)at;
            continue;
        }
        __half first = r < rows && k < k_end ? at[0] : __float2half(0.0f);
        __half second = r < rows && k + 1 < k_end ? at[1] : __float2half(0.0f);
        a[i] = bits_of_half2(__halves2half2(first, second));
    }
}

/* One step of 16 rows of W for a lane of flexgen.cu's q4_rows_kernel: x's fragments of the step
 * (M_TILES tiles of 16 rows), the B of each of the group's 8 products from the lane's codes
 * (q4_pair), and the products added into acc. */
template <int M_TILES> __device__ inline void q4_step_multiply(const q4_step &now, const __half *x,
                                                               int rows, int in, int k_end, int k0,
                                                               float acc[M_TILES][8][4]) {
    uint32_t a[M_TILES][4];
    FG_UNROLL
    for (int m = 0; m < M_TILES; m++) x_fragment(x, rows, in, k_end, 16 * m, k0, a[m]);
    FG_UNROLL
    for (int t = 0; t < 8; t++) {
        uint32_t b[2];
        b[0] = q4_pair(now.codes[0], now.codes[1], t / 2, t % 2 == 0, now.mins[0], now.scales[0]);
        b[1] = q4_pair(now.codes[2], now.codes[3], t / 2, t % 2 == 0, now.mins[1], now.scales[1]);
        FG_UNROLL
        for (int m = 0; m < M_TILES; m++) mma_16x8x16(acc[m][t], a[m], b);
    }
}

/* A warp's copies of columns k0 to k0 + 15 of a group of 64 rows of a 4-bit table E [vocab][dim]
 * (flexgen.cu's q4_vocab_kernel) into stage s: lane l byte row l's 16 bytes (`codes`: the group's
 * first byte row, rows dim bytes apart), lanes 0-1 the 16 mins, 2-3 the 16 scales (`mins`,
 * `scales`: the group's). copy_bytes: 16 where E and dim lie on 16 bytes, else 1: plain loads and
 * stores, with a min and scale of zero for columns past dim (whose x is zero too), so that their
 * values are zeros. */
__device__ inline void q4_vocab_copy(q4_stage *s, const uint8_t *codes, const __half *mins,
                                     const __half *scales, int dim, int k0, int copy_bytes) {
    int lane = threadIdx.x % 32;
    const uint8_t *row = codes + (size_t)lane * dim + k0;
    if (copy_bytes == 16) {
        copy_async<16>(&s->codes[4 * lane], row);
        if (lane < 2) copy_async<16>(&s->mins[4 * lane], mins + k0 + 8 * lane);
        else if (lane < 4) copy_async<16>(&s->scales[4 * (lane - 2)], scales + k0 + 8 * (lane - 2));
        return;
    }
    uint8_t *bytes = (uint8_t *)&s->codes[4 * lane];
    for (int j = 0; j < 16; j++) bytes[j] = k0 + j < dim ? row[j] : 0;
    if (lane >= 16) return;
    const uint8_t *min = (const uint8_t *)(mins + k0 + lane);
    const uint8_t *scale = (const uint8_t *)(scales + k0 + lane);
    uint8_t *min_to = (uint8_t *)s->mins + 2 * lane;
    uint8_t *scale_to = (uint8_t *)s->scales + 2 * lane;
    for (int b = 0; b < 2; b++) {
        min_to[b] = k0 + lane < dim ? min[b] : 0;
        scale_to[b] = k0 + lane < dim ? scale[b] : 0;
    }
}

/* One step of q4_vocab_kernel for a lane (gid = lane / 4, tig = lane % 4): x's fragments of the
 * step's 16 columns (M_TILES tiles of 16 rows of x), and for j = 0 to 3, byte row 8 j + gid's
 * bytes of columns 2 tig, 2 tig + 1 and those + 8 as B's pairs, the high halves product 2 j's
 * column gid and the low halves product 2 j + 1's, the values min + q scale of their columns
 * (q4_values); the products added into acc. */
template <int M_TILES> __device__ inline void q4_vocab_multiply(const q4_stage *s, const __half *x,
                                                                int rows, int dim, int k0,
                                                                float acc[M_TILES][8][4]) {
    int gid = threadIdx.x % 32 / 4;
    int tig = threadIdx.x % 4;
    uint32_t a[M_TILES][4];
    FG_UNROLL
    for (int m = 0; m < M_TILES; m++) x_fragment(x, rows, dim, dim, 16 * m, k0, a[m]);
    __half2 min[2] = {half2_of_bits(s->mins[tig]), half2_of_bits(s->mins[4 + tig])};
    __half2 scale[2] = {half2_of_bits(s->scales[tig]), half2_of_bits(s->scales[4 + tig])};
    int shift = 16 * (tig % 2);
    FG_UNROLL
    for (int j = 0; j < 4; j++) {
        const uint32_t *row = &s->codes[4 * (8 * j + gid)];
        uint32_t spread[2];
        FG_UNROLL
        for (int h = 0; h < 2; h++) {
            uint32_t two = row[2 * h + tig / 2] >> shift & 0xffff; /* columns 2 tig + 8 h, + 1 */
            spread[h] = (two & 0xff) | (two & 0xff00) << 8;
        }
        FG_UNROLL
        for (int half = 0; half < 2; half++) {
            uint32_t b[2];
            FG_UNROLL
            for (int h = 0; h < 2; h++)
                b[h] = q4_values(half == 0 ? spread[h] >> 4 : spread[h], min[h], scale[h]);
            FG_UNROLL
            for (int m = 0; m < M_TILES; m++) mma_16x8x16(acc[m][2 * j + half], a[m], b);
        }
    }
}

/* Whether this block is the last of its group's gridDim.y chunks to count itself done (`done`, the
 * group's count, which that block sets back to zero for the next product): each block's partial
 * sums are written and made visible to the device (__threadfence) before it counts. */
__device__ inline int q4_last_chunk(unsigned *done) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1u) == gridDim.y - 1;
        if (last) *done = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

/* y[r][j] (+ y[r][j] with add) = the chunks' partial sums partial[c][r][j] (rows `out` apart)
 * added in chunk order, rounded to fp16 once, for r < rows and j < columns; a thread a value. Read
 * past L1 (__ldcg): other blocks wrote them. */
__device__ inline void q4_chunk_sums(const float *partial, int chunks, int rows, int columns,
                                     int out, __half *y, int add) {
    size_t n = (size_t)rows * out;
    for (int e = threadIdx.x; e < rows * columns; e += blockDim.x) {
        size_t at = (size_t)(e / columns) * out + e % columns;
        float total = 0;
        for (int c = 0; c < chunks; c++) total += __ldcg(partial + c * n + at);
        if (add) total += __half2float(y[at]);
        y[at] = __float2half_rn(total);
    }
}

/* The column of a group of 64 that product t's sum i of a lane holds (tig = lane % 4):
 * q4_rows_kernel's product t is column 8 gid + t of the group as column gid, so that sum i is
 * column 16 tig + 8 (i % 2) + t; q4_vocab_kernel's products 2 j and 2 j + 1 are rows 2 (8 j + n)
 * and 2 (8 j + n) + 1 of E as column n, so sum i is row 16 (t / 2) + 4 tig + 2 (i % 2) + t % 2. */
template <int VOCAB> __device__ inline int q4_sum_column(int t, int i) {
    int tig = threadIdx.x % 4;
    if (VOCAB) return 16 * (t / 2) + 4 * tig + 2 * (i % 2) + t % 2;
    return 16 * tig + 8 * (i % 2) + t;
}

/* The end of flexgen.cu's q4_rows_kernel and q4_vocab_kernel, whose warps' sums acc[m][t][i] are
 * rows 16 m + gid + 8 (i / 2) and columns q4_sum_column(t, i) of its group: warps 1 on leave
 * theirs in shared memory over the warps' rings (`stages`; every warp is done with its ring
 * first), and warp 0 adds them to its own in warp order and writes rows r < rows of the group's
 * first `columns` columns to out_sums[r][j] (rows `out` apart). A loop over the sums e = (m, t,
 * i). */
template <int M_TILES, int VOCAB>
__device__ inline void q4_sums_out(float acc[M_TILES][8][4], q4_stage *stages, int rows,
                                   int columns, int out, float *out_sums) {
    auto sums = (float(*)[16 * M_TILES][Q4_GROUP + 1]) stages;
    int warp = threadIdx.x / 32;
    int gid = threadIdx.x % 32 / 4;
    int warps = blockDim.x / 32;
    __syncthreads();
    FG_UNROLL
    for (int e = 0; e < 32 * M_TILES; e++) {
        int r = 16 * (e / 32) + gid + 8 * (e % 4 / 2);
        int j = q4_sum_column<VOCAB>(e / 4 % 8, e % 4);
        if (warp > 0) sums[warp - 1][r][j] = acc[e / 32][e / 4 % 8][e % 4];
    }
    __syncthreads();
    if (warp > 0) return;
    FG_UNROLL
    for (int e = 0; e < 32 * M_TILES; e++) {
        int r = 16 * (e / 32) + gid + 8 * (e % 4 / 2);
        int j = q4_sum_column<VOCAB>(e / 4 % 8, e % 4);
        if (r >= rows || j >= columns) continue;
        float total = acc[e / 32][e / 4 % 8][e % 4];
        for (int w = 0; w < warps - 1; w++) total += sums[w][r][j];
        out_sums[(size_t)r * out + j] = total;
    }
}

/* ---- A head's cached keys and values as decode attention reads them (flexgen.cu's attention
 * kernels), 8 values a chunk, and a 4-bit group's scale as the cache store makes it. Q4: the
 * cache's rows are 4-bit (this step's rows are fp16 either way); a template argument, so that a
 * kernel over an fp16 cache holds no register for the 4-bit rows (71 registers on sm_90 against
 * 128 for both). ---- */

/* The smallest fp16 at or above x >= 0 (quant.c's fp16_at_least). */
__device__ __half half_at_least(float x) {
    __half h = __float2half_rn(x);
    unsigned short bits = __half_as_ushort(h);
    if (__half2float(h) < x) bits++;
    if ((bits & 0x7c00) == 0x7c00) bits = 0x7bff;
    return __ushort_as_half(bits);
}

/* One K/V head's keys (or values) as a query reads them: the cache's rows below `past`, through
 * the page table (rows of heads x hd, fp16 or 4-bit), and this step's fp16 rows from `past` on,
 * `stride` apart. A 4-bit row is [heads][hd][1] in quant.c's layout, read by model.h's q4_value:
 * the value that opt_model.c's kv_row decompresses on the CPU. */
typedef struct {
    const char *cache;
    const int *pages;
    int page_tokens;
    const __half *fresh;
    size_t stride;
    int past, head, hd, heads;
} kv_head;

/* Key (or value) `slot` of a head, found once per key: its fp16 values, or its 4-bit bytes (one
 * pointer and a flag, for the registers of KEYS_AT_ONCE of them). */
typedef struct {
    const void *at; /* the head's first value or byte */
    int q4;         /* 4-bit bytes: a cached row of a 4-bit cache; else fp16 values */
} kv_row;

template <int Q4> __device__ inline kv_row kv_row_at(const kv_head *h, int slot) {
    kv_row r = {NULL, 0};
    if (slot >= h->past) {
        r.at = h->fresh + (size_t)(slot - h->past) * h->stride + (size_t)h->head * h->hd;
        return r;
    }
    size_t row = kv_page_row(h->pages, h->page_tokens, slot);
    if (Q4) {
        size_t head_bytes = q4_bytes(1, (size_t)h->hd, 1);
        r.at = h->cache + (row * h->heads + h->head) * head_bytes;
        r.q4 = 1;
        return r;
    }
    r.at = (const __half *)(h->cache + row * 2 * h->heads * h->hd) + (size_t)h->head * h->hd;
    return r;
}

/* On the emulated GPU, the bytes of K and V rows that attention loads, counted in its statistics
 * (kv_load_bytes), so that the tests can hold each row to one load a block; nothing on a card. */
__device__ inline void count_kv_load(int bytes) {
#if defined(FLEXGEN_CUDA_EMU)
    cuda_emu::count_kv_load(bytes);
#else
    (void)bytes;
#endif
}

/* Value d of a row that kv_row_at found (a 4-bit value reads its byte, min and scale). */
template <int Q4> __device__ inline float kv_at(kv_row r, int d, int hd) {
    if (!Q4 || !r.q4) {
        count_kv_load(2);
        return __half2float(((const __half *)r.at)[d]);
    }
    count_kv_load(5);
    return q4_value((const uint8_t *)r.at, (size_t)hd, 1, (size_t)d);
}

/* Whether a head's rows can be read a chunk at a time: head_dim a multiple of 8 (a chunk then
 * lies within one 4-bit group), fp16 rows 16-byte aligned and 4-bit ones 4-byte aligned (a head
 * of them is a multiple of 4 bytes). Else value by value. */
template <int Q4> __device__ inline int kv_whole(const kv_head *h) {
    uintptr_t fp16_rows = (uintptr_t)h->fresh | (uintptr_t)(h->stride * 2);
    if (!Q4) fp16_rows |= (uintptr_t)h->cache;
    return h->hd % 8 == 0 && fp16_rows % 16 == 0 && (uintptr_t)h->cache % 4 == 0;
}

/* Chunk c of a row as loaded: values [8c, 8c + 8), 16 bytes of fp16, or 4 bytes of 4-bit codes
 * (bits.x) and their group's min and scale (bits.y: the min's fp16 bits low, the scale's high).
 * Loading and widening are apart so that a thread has several loads in flight before it waits
 * on the first. */
typedef struct {
    uint4 bits;
} kv_bytes;

template <int Q4> __device__ inline kv_bytes kv_load(kv_row r, int c, int hd, int whole) {
    kv_bytes b = {};
    if (!whole) return b; /* kv_widen reads value by value */
    if (!Q4 || !r.q4) {
        count_kv_load(16);
        b.bits = *((const uint4 *)r.at + c);
        return b;
    }
    count_kv_load(8);
    int G = (hd + Q4_GROUP - 1) / Q4_GROUP;
    int g = 8 * c / Q4_GROUP;
    const uint8_t *codes = (const uint8_t *)r.at;
    const unsigned short *mins = (const unsigned short *)(codes + G * (Q4_GROUP / 2));
    b.bits.x = *(const uint32_t *)(codes + g * (Q4_GROUP / 2) + 8 * c % Q4_GROUP / 2);
    b.bits.y = mins[g] | (uint32_t)mins[G + g] << 16;
    return b;
}

/* The chunk's 8 values in fp32 (values past hd are 0): those of kv_at, to the bit (a 4-bit byte
 * holds an even value in its high half). */
template <int Q4>
__device__ inline void kv_widen(kv_bytes b, kv_row r, int c, int hd, int whole, float v[8]) {
    if (!whole) {
        for (int i = 0; i < 8; i++) v[i] = 8 * c + i < hd ? kv_at<Q4>(r, 8 * c + i, hd) : 0;
        return;
    }
    if (!Q4 || !r.q4) {
        const __half2 *h = (const __half2 *)&b.bits;
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __low2float(h[i]);
            v[2 * i + 1] = __high2float(h[i]);
        }
        return;
    }
    float min = __low2float(half2_of_bits(b.bits.y));
    float scale = __high2float(half2_of_bits(b.bits.y));
    for (int i = 0; i < 8; i++) {
        int byte = (b.bits.x >> (8 * (i / 2))) & 255;
        v[i] = fmaf(code_value((byte >> (i % 2 ? 0 : 4)) & 15), scale, min);
    }
}

/* ---- A block's queries over a span of keys: scores and values (flexgen.cu's attention kernels).
 * HEADS: the query heads a block takes at most, all on one K/V head (grouped-query attention), nh
 * of them at run time; each key's and each value's row is loaded and widened once for all of them.
 * Each head's sums are formed in the order a block of one head forms them, so that a block of
 * several heads gives each the bits it would give alone. ---- */

/* The blocks a K/V head's group of query heads is cut into, `heads` query heads a block at most
 * (the last may take fewer). */
__host__ __device__ inline int head_blocks(int group, int heads) {
    return (group + heads - 1) / heads;
}

/* The query heads a block of attention takes at most where they share a K/V head (its kernels'
 * HEADS: this, or 1 where a K/V head has one query head). */
#define GQA_HEADS 4

/* A query row's blocks in attention's kernels: each K/V head's query heads, GQA_HEADS a block. */
__host__ __device__ inline int row_head_blocks(int heads, int kv_heads) {
    return kv_heads * head_blocks(heads / kv_heads, GQA_HEADS);
}

/* The first query head of block `block` of the K/V heads' head_blocks (HEADS query heads a block,
 * each K/V head's blocks in turn; heads on kv_heads): *kvh its K/V head, *nh its query heads
 * (fewer in a group's last block). */
template <int HEADS>
__device__ int block_heads(int heads, int kv_heads, int block, int *kvh, int *nh) {
    int group = heads / kv_heads;
    int blocks = head_blocks(group, HEADS);
    *kvh = block / blocks;
    int head = *kvh * group + block % blocks * HEADS;
    *nh = HEADS;
    if (HEADS > 1 && (*kvh + 1) * group - head < HEADS) *nh = (*kvh + 1) * group - head;
    return head;
}

/* The floats of nh query heads in shared memory, each head_dim rounded up to whole chunks of 8. */
__host__ __device__ inline size_t query_floats(int nh, int hd) {
    return (size_t)nh * ((hd + 7) / 8 * 8);
}

/* The keys (and values) each thread has loaded before it uses the first. */
#define KEYS_AT_ONCE 4

/* The lanes that read a key's row for its score: a power of two at least its chunks, at most a
 * warp (16 at head_dim 128: a warp's load is two whole rows of 256 bytes). */
__device__ inline int lanes_per_key(int chunks) {
    int lanes = 1;
    while (lanes < chunks && lanes < 32) lanes *= 2;
    return lanes;
}

/* The fp32 copy in shared memory of nh query heads side by side from q (hd apart), each padded
 * with zeros to whole chunks: query[h (hd rounded up to 8) + d]. */
__device__ inline void query_to_shared(const __half *q, int nh, int hd, float *query) {
    int padded = (hd + 7) / 8 * 8;
    for (int i = threadIdx.x; i < nh * padded; i += blockDim.x) {
        int h = i / padded;
        int d = i % padded;
        query[i] = d < hd ? __half2float(q[(size_t)h * hd + d]) : 0;
    }
}

/* scores[h apart + i] = scale q_h.K[first + i] for n keys and the block's nh heads: a group of
 * lanes_per_key lanes a key, lane l reading chunks l, l + lanes, ... of its row side by side with
 * the others, each thread's KEYS_AT_ONCE keys found in the page table and loaded before any is
 * used, each chunk widened once for every head. A lane sums its chunks over d in order; the
 * group's sums are added by shuffles, halves onto halves (the same order on every run). Every
 * thread of a block runs the same rounds, so whole warps meet at each shuffle. */
template <int Q4, int HEADS>
__device__ void attention_scores(const float *query, int nh, const kv_head *keys, int first, int n,
                                 float scale, float *scores, int apart) {
    int hd = keys->hd;
    int chunks = (hd + 7) / 8;
    int whole = kv_whole<Q4>(keys);
    int lanes = lanes_per_key(chunks);
    int lane = threadIdx.x % lanes;
    int groups = blockDim.x / lanes;
    int group = threadIdx.x / lanes;
    for (int j0 = 0; j0 < n; j0 += groups * KEYS_AT_ONCE) {
        kv_row key[KEYS_AT_ONCE];
        float dot[KEYS_AT_ONCE][HEADS];
        FG_UNROLL
        for (int i = 0; i < KEYS_AT_ONCE; i++) {
            int j = j0 + i * groups + group;
            key[i] = kv_row_at<Q4>(keys, first + (j < n ? j : n - 1));
            FG_UNROLL
            for (int h = 0; h < HEADS; h++) dot[i][h] = 0;
        }
        for (int c = lane; c < chunks; c += lanes) {
            kv_bytes raw[KEYS_AT_ONCE];
            FG_UNROLL
            for (int i = 0; i < KEYS_AT_ONCE; i++)
                if (j0 + i * groups + group < n) raw[i] = kv_load<Q4>(key[i], c, hd, whole);
            FG_UNROLL
            for (int i = 0; i < KEYS_AT_ONCE; i++) {
                if (j0 + i * groups + group >= n) break;
                float v[8];
                kv_widen<Q4>(raw[i], key[i], c, hd, whole, v);
                FG_UNROLL
                for (int h = 0; h < HEADS; h++) {
                    if (h >= nh) break;
                    const float *q = query + h * chunks * 8 + 8 * c;
                    for (int e = 0; e < 8; e++) dot[i][h] = fmaf(q[e], v[e], dot[i][h]);
                }
            }
        }
        FG_UNROLL
        for (int i = 0; i < KEYS_AT_ONCE; i++) {
            int j = j0 + i * groups + group;
            FG_UNROLL
            for (int h = 0; h < HEADS; h++) {
                if (h >= nh) break;
                for (int o = lanes / 2; o > 0; o /= 2)
                    dot[i][h] += __shfl_xor_sync(0xffffffff, dot[i][h], o);
                if (lane == 0 && j < n) scores[h * apart + j] = dot[i][h] * scale;
            }
        }
    }
}

/* The weights times the values of n keys, first + keys[i] for i < n (keys NULL: first + i, the
 * split's span), and the block's nh heads (key k's weight for head h: weights[h apart + k]), so
 * that only the rows of the keys listed are read (§5's top-K loads the V cache of its kept keys
 * alone): thread t sums chunk t % chunks of the keys of its group t / chunks (a group's threads
 * read a row side by side), KEYS_AT_ONCE keys loaded at a time, each chunk widened once for every
 * head, in registers; then, a head at a time, the groups' sums are added in a fixed order through
 * `partial` ([groups][chunks][8], blockDim.x x 8 floats), into out rounded to fp16, or into sums in
 * fp32 where out is NULL (head h's hd values at h out_apart on). keys: a block of one head's
 * only. */
template <int Q4, int HEADS>
__device__ void attention_values(const float *weights, int apart, const int *keys, int nh,
                                 const kv_head *values, int first, int n, float *partial,
                                 __half *out, float *sums, size_t out_apart) {
    int hd = values->hd;
    int chunks = (hd + 7) / 8;
    int whole = kv_whole<Q4>(values);
    int groups = blockDim.x / chunks;
    int group = threadIdx.x / chunks;
    int c = threadIdx.x % chunks;
    float acc[HEADS][8] = {};
    for (int j0 = group * KEYS_AT_ONCE; group < groups && j0 < n; j0 += groups * KEYS_AT_ONCE) {
        kv_row value[KEYS_AT_ONCE];
        kv_bytes raw[KEYS_AT_ONCE];
        FG_UNROLL
        for (int i = 0; i < KEYS_AT_ONCE; i++) {
            int at = j0 + i < n ? j0 + i : n - 1;
            value[i] = kv_row_at<Q4>(values, first + (keys ? keys[at] : at));
        }
        FG_UNROLL
        for (int i = 0; i < KEYS_AT_ONCE; i++)
            if (j0 + i < n) raw[i] = kv_load<Q4>(value[i], c, hd, whole);
        FG_UNROLL
        for (int i = 0; i < KEYS_AT_ONCE; i++) {
            if (j0 + i >= n) continue;
            float v[8];
            kv_widen<Q4>(raw[i], value[i], c, hd, whole, v);
            FG_UNROLL
            for (int h = 0; h < HEADS; h++) {
                if (h >= nh) break;
                float w = weights[h * apart + (keys ? keys[j0 + i] : j0 + i)];
                for (int e = 0; e < 8; e++) acc[h][e] = fmaf(w, v[e], acc[h][e]);
            }
        }
    }
    FG_UNROLL
    for (int h = 0; h < HEADS; h++) {
        if (h >= nh) break;
        if (h > 0) __syncthreads(); /* every thread done with the last head's partial sums */
        if (group < groups)
            for (int e = 0; e < 8; e++) partial[threadIdx.x * 8 + e] = acc[h][e];
        __syncthreads();
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float total = 0;
            for (int g = 0; g < groups; g++) total += partial[g * chunks * 8 + d];
            if (out) out[h * out_apart + d] = __float2half_rn(total);
            else sums[h * out_apart + d] = total;
        }
    }
}

/* ---- §5's top-K: the keys a decode query keeps (flexgen.cu's attention_kernel) ---- */

/* The 32 lanes' sums of v over lanes 0 to their own. */
__device__ unsigned long long warp_prefix_sum(unsigned long long v) {
    int lane = threadIdx.x % 32;
    for (int o = 1; o < 32; o *= 2) {
        unsigned long long below = __shfl_up_sync(0xffffffff, v, o);
        if (lane >= o) v += below;
    }
    return v;
}

/* The sum of v over the block's threads before this one (blockDim.x a multiple of 32).
 * warp_sums: 32 in shared memory. */
__device__ unsigned long long block_prefix_sum(unsigned long long v,
                                               unsigned long long *warp_sums) {
    int warp = threadIdx.x / 32;
    unsigned long long through = warp_prefix_sum(v);
    if (threadIdx.x % 32 == 31) warp_sums[warp] = through;
    __syncthreads();
    unsigned long long before = 0;
    for (int w = 0; w < warp; w++) before += warp_sums[w];
    __syncthreads(); /* every thread has read warp_sums */
    return before + through - v;
}

/* What keep_largest's passes share: a byte's 256 counts, and the threshold found so far. */
typedef struct {
    unsigned bins[256];
    unsigned threshold; /* the bits of the keep-th largest weight, its bytes found so far */
    unsigned wanted;    /* how many of the weights that agree with them are still to be kept */
    unsigned long long warp_sums[32];
} top_k_select;

/* kept[0 .. keep): the `keep` largest of w[0 .. n) (0 <= keep < n), ties to the earlier, in
 * index order: quant.c's topk_keep's list. The weights are not negative, so their bits order as
 * unsigned integers do, and a radix select finds the bits of the keep-th largest, a byte a pass
 * from the top: each pass counts the weights whose higher bytes are the threshold's so far by
 * their next byte, and the first warp walks those 256 counts down from the top (8 a lane, then the
 * lanes' prefix sums) to the byte where the count reaches the weights still wanted. Then a weight
 * above the threshold is kept, and of the ones equal to it the earliest `wanted`: each thread
 * counts both in its own run of w, and one prefix sum over the threads says where its kept keys
 * go in the list and how many ties come before its run. Four passes and a fifth over n weights,
 * where ranking each weight against every other would take n^2 compares. blockDim.x: a multiple
 * of 32. CPU twin: quant.c's topk_keep (a quickselect). Test: test_top_k_select, its list
 * exactly. */
__device__ void keep_largest(const float *w, int n, int keep, int *kept, top_k_select *selection) {
    unsigned threshold = ~0u; /* keep 0: nothing is above it, and no tie is wanted */
    unsigned wanted = 0;
    if (keep > 0) {
        threshold = 0;
        wanted = keep;
    }
    unsigned found = 0; /* the threshold's bits found */
    for (int shift = 24; keep > 0 && shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) selection->bins[i] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            unsigned bits = __float_as_uint(w[j]);
            if ((bits & found) == threshold) atomicAdd(&selection->bins[bits >> shift & 255], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            int top = 255 - 8 * (int)threadIdx.x; /* this lane's bytes: top down to top - 7 */
            unsigned count = 0;
            for (int i = 0; i < 8; i++) count += selection->bins[top - i];
            unsigned above = (unsigned)warp_prefix_sum(count) - count; /* the higher bytes' */
            if (above < wanted && above + count >= wanted)
                for (int byte = top; byte > top - 8; byte--) {
                    if (above + selection->bins[byte] >= wanted) {
                        selection->threshold = threshold | (unsigned)byte << shift;
                        selection->wanted = wanted - above;
                        break;
                    }
                    above += selection->bins[byte];
                }
        }
        __syncthreads();
        threshold = selection->threshold;
        wanted = selection->wanted;
        found |= 255u << shift;
    }
    int run = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    int from = (int)threadIdx.x * run < n ? (int)threadIdx.x * run : n;
    int to = from + run < n ? from + run : n;
    unsigned long long above = 0; /* in this thread's run */
    unsigned long long ties = 0;
    for (int j = from; j < to; j++) {
        unsigned bits = __float_as_uint(w[j]);
        above += bits > threshold;
        ties += bits == threshold;
    }
    unsigned long long before = block_prefix_sum(ties << 32 | above, selection->warp_sums);
    unsigned long long ties_before = before >> 32;
    unsigned long long at = (before & 0xffffffffu) + (ties_before < wanted ? ties_before : wanted);
    for (int j = from; j < to; j++) {
        unsigned bits = __float_as_uint(w[j]);
        if (bits > threshold || (bits == threshold && ties_before++ < wanted)) kept[at++] = j;
    }
    __syncthreads();
}

#endif
