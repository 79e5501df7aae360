/* What every part of the kernels uses (part of qgemm.c's one translation unit: compiled
 * only through it): the system headers and KVLM_V512, the checks of the sizes every entry
 * point is given, the fp16 and bf16 conversions, what the build is (kvlm_kernel_abi, _simd,
 * _vnni), and the vector math the weights, the K/V attention and the prompt's ops share. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
/* KVLM_V512: the 16-lane vector code paths, in AVX-512, or on AVX2 as two 256-bit halves
 * (v512.h: the same operations, the same bits); else the scalar loops */
#if defined(__AVX512F__)
#define KVLM_V512 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "v512.h"
#define KVLM_V512 256
#else
#define KVLM_V512 0
#endif

/* ---- the sizes an entry point is given ----
 * Every buffer an entry point reads or writes comes with its length (elements of its
 * type, or bytes), and the call is refused (-2) before any of them is touched unless the
 * furthest element it would touch lies within: native code does not take Python's word
 * for a shape. Lengths and shapes are untrusted int64s, so their products are taken here
 * with checks for negative values and overflow. */

/* *r = a * b (a + b) when a, b >= 0 and it fits an int64: 1; else 0, *r unset */
static inline int mul_ok(int64_t a, int64_t b, int64_t *r) {
    return a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, r);
}
static inline int add_ok(int64_t a, int64_t b, int64_t *r) {
    return a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, r);
}

/* *r = one past the furthest element of [n0][n1][d] at strides s0, s1 (d contiguous):
 * (n0 - 1) s0 + (n1 - 1) s1 + d. 0 when a count is under 1, a stride negative, or it
 * overflows. */
static int extent_ok(int64_t n0, int64_t s0, int64_t n1, int64_t s1, int64_t d, int64_t *r) {
    int64_t a, b, c;
    return n0 >= 1 && n1 >= 1 && d >= 1 && mul_ok(n0 - 1, s0, &a) && mul_ok(n1 - 1, s1, &b) &&
           add_ok(a, b, &c) && add_ok(c, d, r);
}

/* fp32 -> bf16 as torch rounds it (nearest even; NaN stays a quiet NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half -> float, exact (F16C's instruction where the CPU has it) */
static inline float from_f16(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF, u;
    float f;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (e == 31 && m) m |= 0x200; /* a NaN comes out quiet, as F16C's does */
    u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    memcpy(&f, &u, 4);
    return f;
}

/* float -> IEEE half, round to nearest even, as torch's .to(float16): subnormal halves,
 * overflow past 65520 to inf (65504 is the largest finite half) */
static inline uint16_t to_f16(float f) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    /* Maratyszcza's FP16 library (fp16_ieee_from_fp32_value) */
    uint32_t w, b, bias;
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f, t;
    memcpy(&w, &f, 4);
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    b = (bias >> 1) + 0x07800000u;
    memcpy(&t, &b, 4);
    base = t + base;
    memcpy(&b, &base, 4);
    const uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
    /* NaN: quiet, its payload's top bits kept, as F16C (and torch's vector path) */
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u | ((w >> 13) & 0x3FFu) : nonsign));
#endif
}

int kvlm_kernel_abi(void) { return KVLM_ABI; }

/* 512: AVX-512; 256: the same code on AVX2 (two halves per vector); 0: scalar loops */
int kvlm_kernel_simd(void) { return KVLM_V512; }

/* 1 when the int8-activation products run on AVX512-VNNI, 0 for the scalar loop */
int kvlm_kernel_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if KVLM_V512
/* -x, exactly (the sign flipped) */
static inline __m512 negate(__m512 x) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

/* exp(x) on 16 lanes: Cephes' expf polynomial (relative error ~1e-7) scaled by 2^k with
 * scalef; x clamped to [-87, 88] (below: ~0; above: overflow to a large finite value). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 e = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(e, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, e);
}

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}
#endif
