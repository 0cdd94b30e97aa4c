/* kernels.h: the per-thread bodies of flexgen.cu's kernels, written once for the device and the
 * host. nvcc compiles them into the kernels; a C compiler compiles them as plain functions, so
 * that the CPU tests (tests/test_quant.c) check a kernel's arithmetic on machines without a GPU
 * or nvcc. In device code fp16 and fmaf are the device's, on the host util.c's and libm's: both
 * round the same way (fp16 to fp32 is exact, fmaf rounds once), so the bits are the same.
 *
 *   q4_value    one thread of the 4-bit decompression kernel (§5): value e of a tensor
 */
#ifndef FLEXGEN_KERNELS_H
#define FLEXGEN_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define FG_HOST_DEVICE __host__ __device__
#else
#define FG_HOST_DEVICE
#endif

#ifdef __cplusplus
extern "C" {
#endif
#include "flexgen.h"
#ifdef __cplusplus
}
#endif

/* An fp16 (its bits) as a float: exact. */
static inline FG_HOST_DEVICE float half_bits_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half(h));
#else
    return fp16_to_fp32(h);
#endif
}

/* Value e (in memory order) of a 4-bit tensor [outer][len][inner], as quant.c lays it out (its
 * top comment): grouped along len in groups of Q4_GROUP rows, per outer index the nibbles
 * [G][Q4_GROUP / 2][inner] (the even row of a pair in the high nibble), then the groups' fp16
 * mins [G][inner] and scales [G][inner]. A level q decodes to fmaf(q, scale, min), as
 * q4_decompress. */
static inline FG_HOST_DEVICE float q4_value(const uint8_t *src, size_t len, size_t inner, size_t e) {
    size_t o = e / (len * inner), r = (e / inner) % len, i = e % inner;
    size_t G = (len + Q4_GROUP - 1) / Q4_GROUP, g = r / Q4_GROUP, p = (r % Q4_GROUP) / 2;
    const uint8_t *bytes = src + o * G * inner * (Q4_GROUP / 2 + 4);
    const uint16_t *mins = (const uint16_t *)(bytes + G * inner * (Q4_GROUP / 2)), *scales = mins + G * inner;
    int q = (bytes[(g * (Q4_GROUP / 2) + p) * inner + i] >> (r % 2 ? 0 : 4)) & 15;
    return fmaf((float)q, half_bits_to_float(scales[g * inner + i]), half_bits_to_float(mins[g * inner + i]));
}

#endif
