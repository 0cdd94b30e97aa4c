/* tests/cuda_emu/cuda_fp16.h: CUDA's __half for the CPU execution harness (docs/GPU.md, "The
 * emulated GPU"). Conversions are bit-exact with the GPU's cvt instructions: round to nearest
 * even, subnormals and infinities kept, NaN to the canonical 0x7fff (tests/test_emu.c holds them
 * to the CPU's F16C over all 65,536 halves). One operation on halves is done in fp32 and rounded
 * once; fp32's 24 bits are at least 2 x 11 + 2, so that single rounding of the fp32 result is the
 * correctly rounded half result, as the GPU gives (+, -, *, /).
 */
#ifndef CUDA_EMU_FP16_H
#define CUDA_EMU_FP16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cuda_runtime.h"

/* float -> half bits, round to nearest even. */
static inline unsigned short cuda_emu_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
    if (a > 0x7f800000) return 0x7fff;                /* NaN: the canonical one */
    if (a >= 0x477ff000) return (unsigned short)(sign | 0x7c00); /* 65520 and up: infinity */
    if (a >= 0x38800000) {                            /* a normal half: 2^-14 and up */
        uint32_t h = ((a >> 23) - 112) << 10 | (a & 0x7fffff) >> 13, rest = a & 0x1fff;
        if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* a carry moves the exponent */
        return (unsigned short)(sign | h);
    }
    if (a <= 0x33000000) return (unsigned short)sign; /* 2^-25 and below: zero (2^-25 ties to 0) */
    uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000, shift = 126 - e; /* subnormal: units of 2^-24 */
    uint32_t h = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) h++;
    return (unsigned short)(sign | h);
}

/* half bits -> float, exact; a NaN keeps its payload and is made quiet (as F16C does). */
static inline float cuda_emu_half_to_float(unsigned short h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, x;
    if (e == 0x1f) x = sign | 0x7f800000 | m << 13 | (m ? 0x400000 : 0);
    else if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f); /* m x 2^-24, exact */
        memcpy(&x, &v, 4);
        x |= sign;
    } else x = sign | (e + 112) << 23 | m << 13;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

struct __half_raw { unsigned short x; };

struct __half {
    unsigned short __x;
    __half() = default;
    __half(const __half_raw &r) : __x(r.x) {}
    __half(float f) : __x(cuda_emu_float_to_half(f)) {}
    __half(double d) : __x(cuda_emu_float_to_half((float)d)) {} /* CUDA rounds via float too */
    __half(int i) : __x(cuda_emu_float_to_half((float)i)) {}
    operator float() const { return cuda_emu_half_to_float(__x); }
    operator __half_raw() const { return __half_raw{__x}; }
};
struct __half2 { __half x, y; };
typedef __half half;
typedef __half2 half2;

static inline __half cuda_emu_bits(unsigned short b) { __half h; h.__x = b; return h; }

static inline __half __float2half(float f) { return cuda_emu_bits(cuda_emu_float_to_half(f)); }
static inline __half __float2half_rn(float f) { return __float2half(f); }
/* Toward zero: nearest, then one step back where that went past f in magnitude. */
static inline __half __float2half_rz(float f) {
    unsigned short h = cuda_emu_float_to_half(f);
    if ((h & 0x7fff) <= 0x7c00 && (h & 0x7fff) && fabsf(cuda_emu_half_to_float(h)) > fabsf(f)) h--;
    return cuda_emu_bits(h);
}
static inline float __half2float(__half h) { return cuda_emu_half_to_float(h.__x); }
static inline float __low2float(__half2 h) { return __half2float(h.x); }
static inline float __high2float(__half2 h) { return __half2float(h.y); }
static inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half(a), __float2half(b)}; }
static inline __half2 __float2half2_rn(float a) { return __floats2half2_rn(a, a); }
static inline __half __ushort_as_half(unsigned short b) { return cuda_emu_bits(b); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __short_as_half(short b) { return cuda_emu_bits((unsigned short)b); }
static inline short __half_as_short(__half h) { return (short)h.__x; }
static inline __half __int2half_rn(int i) { return __float2half((float)i); }
static inline int __half2int_rz(__half h) { return (int)__half2float(h); }

/* Arithmetic: in fp32, rounded once (see the top comment). */
static inline __half __hadd(__half a, __half b) { return __float2half(__half2float(a) + __half2float(b)); }
static inline __half __hsub(__half a, __half b) { return __float2half(__half2float(a) - __half2float(b)); }
static inline __half __hmul(__half a, __half b) { return __float2half(__half2float(a) * __half2float(b)); }
static inline __half __hdiv(__half a, __half b) { return __float2half(__half2float(a) / __half2float(b)); }
static inline __half __hneg(__half a) { return cuda_emu_bits((unsigned short)(a.__x ^ 0x8000)); }
static inline __half __habs(__half a) { return cuda_emu_bits((unsigned short)(a.__x & 0x7fff)); }
static inline __half __hmax(__half a, __half b) { return __half2float(a) >= __half2float(b) ? a : b; }
static inline __half __hmin(__half a, __half b) { return __half2float(a) <= __half2float(b) ? a : b; }
static inline bool __hisnan(__half a) { return (a.__x & 0x7fff) > 0x7c00; }
static inline bool __hisinf(__half a) { return (a.__x & 0x7fff) == 0x7c00; }
static inline bool __heq(__half a, __half b) { return __half2float(a) == __half2float(b); }
static inline bool __hlt(__half a, __half b) { return __half2float(a) < __half2float(b); }
static inline bool __hgt(__half a, __half b) { return __half2float(a) > __half2float(b); }
/* Pairs: each half as its own operation above (a fused multiply-add rounded once from fp32). */
static inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
static inline __half2 __hsub2(__half2 a, __half2 b) { return __half2{__hsub(a.x, b.x), __hsub(a.y, b.y)}; }
static inline __half __hfma(__half a, __half b, __half c) {
    return __float2half(fmaf(__half2float(a), __half2float(b), __half2float(c)));
}
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
    return __half2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)};
}
static inline __half operator+(__half a, __half b) { return __hadd(a, b); }
static inline __half operator-(__half a, __half b) { return __hsub(a, b); }
static inline __half operator*(__half a, __half b) { return __hmul(a, b); }
static inline __half operator/(__half a, __half b) { return __hdiv(a, b); }
static inline __half operator-(__half a) { return __hneg(a); }
static inline __half &operator+=(__half &a, __half b) { return a = __hadd(a, b); }
static inline __half &operator*=(__half &a, __half b) { return a = __hmul(a, b); }

#endif
