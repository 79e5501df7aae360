/* The AVX-512 operations qgemm.c uses, on AVX2 + FMA + F16C: a 512-bit vector is two
 * 256-bit halves (lanes 0..7 and 8..15), a 16-bit mask picks lanes as AVX-512's does.
 *
 * Included by qgemm.c where the compiler targets AVX2 but not AVX-512 (Zen 2/3, Intel's
 * client cores since Haswell): the kernels' AVX-512 code compiles unchanged against these
 * names (macros over GCC's/Clang's own, as SIMDe's native aliases do) instead of falling
 * to the scalar loops. Every operation gives AVX-512's bits: lane-wise arithmetic is the
 * same IEEE operation per lane (FMA fused, as vfmadd), the reductions add in the order of
 * GCC's _mm512_reduce_* (halves, then quarters, then pairs), conversions round as the
 * AVX-512 forms do under the default MXCSR, so a kernel's output should be the AVX-512
 * build's bit for bit. The tests hold this build to the same tolerances as the AVX-512
 * and scalar ones (tests/helpers.py PORTABLE_BUILDS: built with -march=haswell on any CPU
 * that has AVX2); the bit-for-bit claim is not tested.
 *
 * Not a general emulation: only the operations and immediates qgemm.c uses (ternarylogic
 * with 0xF8, roundscale to nearest), each checked where it is used. SIMDe (Debian's
 * 0.7.4, the one packaged; it is not on PyPI) lacks _mm512_cvtph_ps, _mm512_reduce_max_ps,
 * _mm512_cvtepi32_epi8 and _mm512_maskz_loadu_epi8, and the kernels are compiled on the
 * user's machine, so they take no header the user would have to install.
 */
#ifndef KVLM_V512_H
#define KVLM_V512_H

#include <immintrin.h>
#include <stdint.h>

typedef struct {
    __m256 lo, hi;
} kv_v16f;
typedef struct {
    __m256i lo, hi;
} kv_v16i;

#define KV_INL static inline __attribute__((always_inline))

/* lanes of half h (0: lanes 0..7, 1: 8..15) of a 16-bit mask, as all-ones / zero words */
KV_INL __m256i kv_mask_half(unsigned k, int h) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)((k >> (8 * h)) & 0xFF)), bit), bit);
}

/* ---- floats ---- */
KV_INL kv_v16f kv_f(__m256 lo, __m256 hi) {
    kv_v16f r = {lo, hi};
    return r;
}
KV_INL kv_v16i kv_i(__m256i lo, __m256i hi) {
    kv_v16i r = {lo, hi};
    return r;
}
KV_INL kv_v16f kv_setzero_ps(void) { return kv_f(_mm256_setzero_ps(), _mm256_setzero_ps()); }
KV_INL kv_v16f kv_set1_ps(float a) { return kv_f(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
KV_INL kv_v16f kv_loadu_ps(const void *p) {
    return kv_f(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
KV_INL void kv_storeu_ps(void *p, kv_v16f a) {
    _mm256_storeu_ps((float *)p, a.lo);
    _mm256_storeu_ps((float *)p + 8, a.hi);
}
KV_INL kv_v16f kv_maskz_loadu_ps(unsigned k, const void *p) {
    return kv_f(_mm256_maskload_ps((const float *)p, kv_mask_half(k, 0)),
                _mm256_maskload_ps((const float *)p + 8, kv_mask_half(k, 1)));
}
KV_INL void kv_mask_storeu_ps(void *p, unsigned k, kv_v16f a) {
    _mm256_maskstore_ps((float *)p, kv_mask_half(k, 0), a.lo);
    _mm256_maskstore_ps((float *)p + 8, kv_mask_half(k, 1), a.hi);
}
KV_INL kv_v16f kv_mask_mov_ps(kv_v16f src, unsigned k, kv_v16f a) {
    return kv_f(_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(kv_mask_half(k, 0))),
                _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(kv_mask_half(k, 1))));
}
KV_INL kv_v16f kv_maskz_mov_ps(unsigned k, kv_v16f a) {
    return kv_f(_mm256_and_ps(a.lo, _mm256_castsi256_ps(kv_mask_half(k, 0))),
                _mm256_and_ps(a.hi, _mm256_castsi256_ps(kv_mask_half(k, 1))));
}
KV_INL kv_v16f kv_mask_loadu_ps(kv_v16f src, unsigned k, const void *p) {
    return kv_mask_mov_ps(src, k, kv_maskz_loadu_ps(k, p));
}

#define KV_F2(name, op)                                                                      \
    KV_INL kv_v16f name(kv_v16f a, kv_v16f b) { return kv_f(op(a.lo, b.lo), op(a.hi, b.hi)); }
KV_F2(kv_add_ps, _mm256_add_ps)
KV_F2(kv_sub_ps, _mm256_sub_ps)
KV_F2(kv_mul_ps, _mm256_mul_ps)
KV_F2(kv_div_ps, _mm256_div_ps)
KV_F2(kv_min_ps, _mm256_min_ps)
KV_F2(kv_max_ps, _mm256_max_ps)
#undef KV_F2
KV_INL kv_v16f kv_fmadd_ps(kv_v16f a, kv_v16f b, kv_v16f c) {
    return kv_f(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
KV_INL kv_v16f kv_fnmadd_ps(kv_v16f a, kv_v16f b, kv_v16f c) {
    return kv_f(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
KV_INL kv_v16f kv_abs_ps(kv_v16f a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return kv_f(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
/* roundscale to an integer, nearest even (the one rounding qgemm.c asks of it) */
KV_INL kv_v16f kv_round_nearest_ps(kv_v16f a) { /* the rounding a literal (clang wants one) */
    return kv_f(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define kv_roundscale_ps(a, imm)                                                             \
    (__extension__({                                                                         \
        _Static_assert((imm) == (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),             \
                       "v512.h: roundscale to nearest only");                                \
        kv_round_nearest_ps(a);                                                              \
    }))
/* y * 2^e for integral e with 2^e a normal float (exp512's range: e in [-126, 127]): the
 * product by a power of two is exact, so it is scalef's result */
KV_INL kv_v16f kv_scalef_ps(kv_v16f y, kv_v16f e) {
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 plo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e.lo), bias), 23));
    __m256 phi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e.hi), bias), 23));
    return kv_f(_mm256_mul_ps(y.lo, plo), _mm256_mul_ps(y.hi, phi));
}
/* GCC's _mm512_reduce_add_ps / _max_ps order: halves, quarters, then pairs */
#define KV_REDUCE_PS(name, op256, op128)                                                     \
    KV_INL float name(kv_v16f a) {                                                           \
        __m256 t = op256(a.hi, a.lo);                                                        \
        __m128 u = op128(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));            \
        __m128 v = op128(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));                  \
        __m128 w = op128(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));                  \
        return _mm_cvtss_f32(w);                                                             \
    }
KV_REDUCE_PS(kv_reduce_add_ps, _mm256_add_ps, _mm_add_ps)
KV_REDUCE_PS(kv_reduce_max_ps, _mm256_max_ps, _mm_max_ps)
#undef KV_REDUCE_PS

/* ---- integers ---- */
KV_INL kv_v16i kv_setzero_si512(void) {
    return kv_i(_mm256_setzero_si256(), _mm256_setzero_si256());
}
KV_INL kv_v16i kv_set1_epi32(int a) { return kv_i(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
KV_INL kv_v16i kv_set1_epi8(char a) { return kv_i(_mm256_set1_epi8(a), _mm256_set1_epi8(a)); }
/* _mm512_set_epi32 names lanes 15 .. 0, setr 0 .. 15 */
KV_INL kv_v16i kv_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9,
                            int e8, int e7, int e6, int e5, int e4, int e3, int e2, int e1,
                            int e0) {
    return kv_i(_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7),
                _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15));
}
KV_INL kv_v16i kv_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7,
                             int e8, int e9, int e10, int e11, int e12, int e13, int e14,
                             int e15) {
    return kv_i(_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7),
                _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15));
}
KV_INL kv_v16i kv_loadu_si512(const void *p) {
    return kv_i(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
#define KV_I2(name, op)                                                                      \
    KV_INL kv_v16i name(kv_v16i a, kv_v16i b) { return kv_i(op(a.lo, b.lo), op(a.hi, b.hi)); }
KV_I2(kv_and_si512, _mm256_and_si256)
KV_I2(kv_or_si512, _mm256_or_si256)
KV_I2(kv_xor_si512, _mm256_xor_si256)
KV_I2(kv_add_epi32, _mm256_add_epi32)
KV_I2(kv_sub_epi32, _mm256_sub_epi32)
KV_I2(kv_sub_epi8, _mm256_sub_epi8)
KV_I2(kv_srlv_epi32, _mm256_srlv_epi32)
KV_I2(kv_shuffle_epi8, _mm256_shuffle_epi8) /* within each 128-bit lane, as vpshufb zmm */
#undef KV_I2
KV_INL kv_v16i kv_srli_epi32(kv_v16i a, unsigned s) {
    return kv_i(_mm256_srli_epi32(a.lo, (int)s), _mm256_srli_epi32(a.hi, (int)s));
}
KV_INL kv_v16i kv_slli_epi32(kv_v16i a, unsigned s) {
    return kv_i(_mm256_slli_epi32(a.lo, (int)s), _mm256_slli_epi32(a.hi, (int)s));
}
KV_INL kv_v16i kv_srli_epi16(kv_v16i a, unsigned s) {
    return kv_i(_mm256_srli_epi16(a.lo, (int)s), _mm256_srli_epi16(a.hi, (int)s));
}
/* a | (b & c): vpternlogd's 0xF8, the one table qgemm.c uses */
#define kv_ternarylogic_epi32(a, b, c, imm)                                                  \
    (__extension__({                                                                         \
        _Static_assert((imm) == 0xF8, "v512.h: ternarylogic 0xF8 only");                     \
        kv_or_si512((a), kv_and_si512((b), (c)));                                            \
    }))
KV_INL int kv_reduce_add_epi32(kv_v16i a) {
    __m256i t = _mm256_add_epi32(a.lo, a.hi);
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(u);
}

/* ---- conversions ---- */
KV_INL kv_v16f kv_cvtepi32_ps(kv_v16i a) {
    return kv_f(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi));
}
KV_INL kv_v16i kv_cvtps_epi32(kv_v16f a) {
    return kv_i(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi));
}
KV_INL kv_v16f kv_cvtph_ps(__m256i h) {
    return kv_f(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
KV_INL kv_v16i kv_cvtepi8_epi32(__m128i a) {
    return kv_i(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
KV_INL kv_v16i kv_cvtepu8_epi32(__m128i a) {
    return kv_i(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
KV_INL kv_v16i kv_cvtepu16_epi32(__m256i a) {
    return kv_i(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
                _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
/* 16 words to their low 16 bits, truncating as vpmovdw (masked first, so the unsigned
 * saturation of the packs never applies), in lane order */
KV_INL __m256i kv_cvtepi32_epi16(kv_v16i a) {
    const __m256i m = _mm256_set1_epi32(0xFFFF);
    __m256i p = _mm256_packus_epi32(_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m));
    return _mm256_permute4x64_epi64(p, _MM_SHUFFLE(3, 1, 2, 0));
}
/* 16 words to their low bytes, truncating as vpmovdb */
KV_INL __m128i kv_cvtepi32_epi8(kv_v16i a) {
    const __m256i m = _mm256_set1_epi32(0xFF);
    __m256i p = _mm256_packus_epi32(_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m));
    p = _mm256_permute4x64_epi64(p, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm_packus_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
}
KV_INL kv_v16f kv_castsi512_ps(kv_v16i a) {
    return kv_f(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi));
}
KV_INL kv_v16i kv_castps_si512(kv_v16f a) {
    return kv_i(_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi));
}
/* reduce4's halves: the 512-bit value seen as doubles only to take its top 256 bits */
KV_INL kv_v16f kv_castps_pd(kv_v16f a) { return a; }
KV_INL __m256d kv_extractf64x4_pd(kv_v16f a, int h) { return _mm256_castps_pd(h ? a.hi : a.lo); }
KV_INL __m256 kv_castps512_ps256(kv_v16f a) { return a.lo; }
KV_INL __m256i kv_castsi512_si256(kv_v16i a) { return a.lo; }
KV_INL __m256i kv_extracti64x4_epi64(kv_v16i a, int h) { return h ? a.hi : a.lo; }
/* lane i = (idx_i & 16 ? b : a)[idx_i & 15] */
KV_INL kv_v16f kv_permutex2var_ps(kv_v16f a, kv_v16i idx, kv_v16f b) {
    float t[32] __attribute__((aligned(32)));
    int32_t ix[16] __attribute__((aligned(32)));
    float r[16] __attribute__((aligned(32)));
    kv_storeu_ps(t, a);
    kv_storeu_ps(t + 16, b);
    _mm256_store_si256((__m256i *)ix, idx.lo);
    _mm256_store_si256((__m256i *)ix + 1, idx.hi);
    for (int i = 0; i < 16; i++) r[i] = t[ix[i] & 31];
    return kv_loadu_ps(r);
}
/* a 16-float table looked up by 16 indices (the low 4 bits): each half's lanes from the
 * table's two halves (vpermps), the one picked by bit 3 */
KV_INL kv_v16f kv_permutexvar_ps(kv_v16i idx, kv_v16f t) {
    kv_v16f r;
    const __m256i seven = _mm256_set1_epi32(7), fifteen = _mm256_set1_epi32(15);
    const __m256i i0 = _mm256_and_si256(idx.lo, fifteen), i1 = _mm256_and_si256(idx.hi, fifteen);
    r.lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, i0), _mm256_permutevar8x32_ps(t.hi, i0),
                            _mm256_castsi256_ps(_mm256_cmpgt_epi32(i0, seven)));
    r.hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, i1), _mm256_permutevar8x32_ps(t.hi, i1),
                            _mm256_castsi256_ps(_mm256_cmpgt_epi32(i1, seven)));
    return r;
}
/* 128-bit byte masks (AVX512BW + VL): a masked load, and which bytes are nonzero */
KV_INL __m128i kv_mm_maskz_loadu_epi8(unsigned k, const void *p) {
    uint8_t b[16] = {0};
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) b[i] = ((const uint8_t *)p)[i];
    return _mm_loadu_si128((const __m128i *)b);
}
KV_INL unsigned kv_mm_test_epi8_mask(__m128i a, __m128i b) {
    __m128i z = _mm_cmpeq_epi8(_mm_and_si128(a, b), _mm_setzero_si128());
    return ~(unsigned)_mm_movemask_epi8(z) & 0xFFFF;
}

/* ---- the names qgemm.c writes (clang defines some of them as macros: undefined first) ---- */
#define __m512 kv_v16f
#define __m512i kv_v16i
#undef _mm512_setzero_ps
#define _mm512_setzero_ps kv_setzero_ps
#undef _mm512_set1_ps
#define _mm512_set1_ps kv_set1_ps
#undef _mm512_loadu_ps
#define _mm512_loadu_ps kv_loadu_ps
#undef _mm512_load_ps
#define _mm512_load_ps kv_loadu_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps kv_storeu_ps
#undef _mm512_store_ps
#define _mm512_store_ps kv_storeu_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps kv_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps kv_mask_storeu_ps
#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps kv_mask_loadu_ps
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps kv_mask_mov_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps kv_maskz_mov_ps
#undef _mm512_add_ps
#define _mm512_add_ps kv_add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps kv_sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps kv_mul_ps
#undef _mm512_div_ps
#define _mm512_div_ps kv_div_ps
#undef _mm512_min_ps
#define _mm512_min_ps kv_min_ps
#undef _mm512_max_ps
#define _mm512_max_ps kv_max_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps kv_fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps kv_fnmadd_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps kv_abs_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps kv_roundscale_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps kv_scalef_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps kv_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps kv_reduce_max_ps
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 kv_setzero_si512
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 kv_set1_epi32
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 kv_set1_epi8
#undef _mm512_set_epi32
#define _mm512_set_epi32 kv_set_epi32
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 kv_setr_epi32
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 kv_loadu_si512
#undef _mm512_and_si512
#define _mm512_and_si512 kv_and_si512
#undef _mm512_or_si512
#define _mm512_or_si512 kv_or_si512
#undef _mm512_xor_si512
#define _mm512_xor_si512 kv_xor_si512
#undef _mm512_add_epi32
#define _mm512_add_epi32 kv_add_epi32
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 kv_sub_epi32
#undef _mm512_sub_epi8
#define _mm512_sub_epi8 kv_sub_epi8
#undef _mm512_srlv_epi32
#define _mm512_srlv_epi32 kv_srlv_epi32
#undef _mm512_shuffle_epi8
#define _mm512_shuffle_epi8 kv_shuffle_epi8
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 kv_srli_epi32
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 kv_slli_epi32
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 kv_srli_epi16
#undef _mm512_ternarylogic_epi32
#define _mm512_ternarylogic_epi32 kv_ternarylogic_epi32
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 kv_reduce_add_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps kv_cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 kv_cvtps_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps kv_cvtph_ps
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 kv_cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 kv_cvtepu8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 kv_cvtepu16_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 kv_cvtepi32_epi16
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 kv_cvtepi32_epi8
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps kv_castsi512_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 kv_castps_si512
#undef _mm512_castps_pd
#define _mm512_castps_pd kv_castps_pd
#undef _mm512_extractf64x4_pd
#define _mm512_extractf64x4_pd kv_extractf64x4_pd
#undef _mm512_castps512_ps256
#define _mm512_castps512_ps256 kv_castps512_ps256
#undef _mm512_castsi512_si256
#define _mm512_castsi512_si256 kv_castsi512_si256
#undef _mm512_extracti64x4_epi64
#define _mm512_extracti64x4_epi64 kv_extracti64x4_epi64
#undef _mm512_permutex2var_ps
#define _mm512_permutex2var_ps kv_permutex2var_ps
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps kv_permutexvar_ps
#undef _mm_maskz_loadu_epi8
#define _mm_maskz_loadu_epi8 kv_mm_maskz_loadu_epi8
#undef _mm_test_epi8_mask
#define _mm_test_epi8_mask kv_mm_test_epi8_mask

#endif
