/* Low-bit weight products for kvlm: y[M, N] = x[M, K] . dequant(W)[N, K]^T, all fp32.
 *
 * Weights are stored in groups of 32 along K, llama.cpp's block size:
 *   q8: int8 codes [N, K] and one scale per group: w = s * q            (GGUF Q8_0)
 *   q4: 4-bit codes [N, K/2] and (d, m) per group: w = d * q + m        (Q4_1; Q4_0: m = -8d)
 *       byte j of a group holds element j in its low nibble and j + 16 in its high one.
 * Activations stay fp32: each weight is widened to fp32 in registers and multiplied there,
 * so the result is the dequantized weight's product up to summation order. (llama.cpp
 * quantizes the activations to 8 bits as well; kvlm does not, to keep its tokens.)
 *
 * Decode reads every weight once per token, so the loop runs over output rows, split
 * across OpenMP threads (torch's own runtime: torch is loaded first and ships the same
 * libgomp.so.1), and reuses each widened group for up to 4 rows of x. Many rows (prefill)
 * should dequantize once (kvlm_*_dequant) and call a real GEMM.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define G 32  /* weights per group */
#define MT 4  /* rows of x per pass over a weight row */
#define SMALL_ROWS 16 /* the most rows the int8-activation products take (quant.SMALL_M) */

enum { Q8 = 8, Q4 = 4 };

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

int kvlm_kernel_abi(void) { return 2; }

int kvlm_kernel_simd(void) {
#ifdef __AVX512F__
    return 512;
#else
    return 0;
#endif
}

/* 1 when the int8-activation products run on AVX512-VNNI, 0 for the scalar loop */
int kvlm_kernel_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* Group g of row `qrow` as 32 floats (scalar path and dequant). */
static inline void group_scalar(int kind, const void *qrow, const float *p0, const float *p1,
                                int64_t g, float *w) {
    if (kind == Q8) {
        const int8_t *q = (const int8_t *)qrow + g * G;
        for (int j = 0; j < G; j++) w[j] = p0[g] * (float)q[j];
    } else {
        const uint8_t *q = (const uint8_t *)qrow + g * (G / 2);
        for (int j = 0; j < G / 2; j++) {
            w[j] = p0[g] * (float)(q[j] & 0x0F) + p1[g];
            w[j + G / 2] = p0[g] * (float)(q[j] >> 4) + p1[g];
        }
    }
}

#ifdef __AVX512F__
/* exact: d * q + m rounded twice, as the float loader computes it (dense weights are then
 * bit-identical to the fp32 path's); otherwise one fma (products: order differs anyway). */
static inline void group_avx512(int kind, const void *qrow, const float *p0, const float *p1,
                                int64_t g, __m512 *lo, __m512 *hi, int exact) {
    if (kind == Q8) {
        const int8_t *q = (const int8_t *)qrow + g * G;
        __m512 s = _mm512_set1_ps(p0[g]);
        __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
        __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(a), s);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(b), s);
    } else {
        const uint8_t *q = (const uint8_t *)qrow + g * (G / 2);
        __m128i raw = _mm_loadu_si128((const __m128i *)q);
        __m128i nib = _mm_set1_epi8(0x0F);
        __m512i a = _mm512_cvtepu8_epi32(_mm_and_si128(raw, nib));
        __m512i b = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), nib));
        __m512 d = _mm512_set1_ps(p0[g]), m = _mm512_set1_ps(p1[g]);
        if (exact) {
            *lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), d), m);
            *hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(b), d), m);
        } else {
            *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), d, m);
            *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), d, m);
        }
    }
}
#endif

/* y[m0 + t, n] for t < mt: one weight row against up to MT rows of x. */
static inline __attribute__((always_inline)) void
row_product(int kind, const float *x, int64_t K, int64_t N, int64_t m0, int mt,
            const void *qrow, const float *p0, const float *p1, float *y, int64_t n) {
    int64_t groups = K / G;
#ifdef __AVX512F__
    __m512 acc[MT];
    for (int t = 0; t < MT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 lo, hi;
        group_avx512(kind, qrow, p0, p1, g, &lo, &hi, 0);
        const float *xg = x + m0 * K + g * G;
        switch (mt) { /* falls through: rows mt-1 .. 0 */
        case 4:
            acc[3] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + 3 * K), acc[3]);
            acc[3] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 3 * K + 16), acc[3]);
            /* fall through */
        case 3:
            acc[2] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + 2 * K), acc[2]);
            acc[2] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 2 * K + 16), acc[2]);
            /* fall through */
        case 2:
            acc[1] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + K), acc[1]);
            acc[1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + K + 16), acc[1]);
            /* fall through */
        default:
            acc[0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), acc[0]);
            acc[0] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), acc[0]);
        }
    }
    for (int t = 0; t < mt; t++) y[(m0 + t) * N + n] = _mm512_reduce_add_ps(acc[t]);
#else
    float acc[MT] = {0};
    float w[G];
    for (int64_t g = 0; g < groups; g++) {
        group_scalar(kind, qrow, p0, p1, g, w);
        for (int t = 0; t < mt; t++) {
            const float *xg = x + (m0 + t) * K + g * G;
            float s = 0.f;
            for (int j = 0; j < G; j++) s += w[j] * xg[j];
            acc[t] += s;
        }
    }
    for (int t = 0; t < mt; t++) y[(m0 + t) * N + n] = acc[t];
#endif
}

/* The row loop, written out per kind: OpenMP outlines the loop body before constants
 * propagate, so a `kind` argument would become a runtime branch in the innermost loop. */
#define GEMM_ROWS(KIND, x, M, K, q, row_bytes, p0, p1, N, y)                                 \
    do {                                                                                     \
        int64_t groups_ = (K) / G;                                                           \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < (N); n++) {                                                  \
            for (int64_t m0 = 0; m0 < (M); m0 += MT) {                                       \
                int mt = (int)((M) - m0 < MT ? (M) - m0 : MT);                               \
                row_product(KIND, x, K, N, m0, mt, (q) + n * (row_bytes), (p0) + n * groups_, \
                            (p1) ? (p1) + n * groups_ : 0, y, n);                            \
            }                                                                                \
        }                                                                                    \
    } while (0)

/* x [M, K], q int8 [N, K], s [N, K/32] -> y [M, N] */
void kvlm_q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                  int64_t N, float *y) {
    const float *none = 0;
    GEMM_ROWS(Q8, x, M, K, (const uint8_t *)q, K, s, none, N, y);
}

/* x [M, K], q packed nibbles [N, K/2], d and m [N, K/32] -> y [M, N] */
void kvlm_q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d,
                  const float *m, int64_t N, float *y) {
    GEMM_ROWS(Q4, x, M, K, q, K / 2, d, m, N, y);
}

/* ------------------------------------------------------------------------------------
 * int8 activations (--activations int8): llama.cpp's numerics for the per-token products.
 * Each row of x is rounded per group of 32 to int8 codes c with one scale e = max|x| / 127
 * (nearest even), so a group's product is
 *     q8: s e sum(q c)                 q4: d e sum(q c) + m e sum(c)
 * with the integer sums on AVX512-VNNI (vpdpbusd: 64 byte products per instruction) where
 * the CPU has it, else in scalar integer code. Rounding x costs one pass over K per row.
 * ------------------------------------------------------------------------------------ */

/* A row of x as int8, in two layouts: `nat` (natural order, for q8 rows of 64 bytes = two
 * groups) and `quad` (for q4: 64 bytes of packed nibbles = four groups; their low nibbles
 * are elements 0..15 of each group, the high ones 16..31, so quad j is stored as
 * [g0 0..15 | g1 0..15 | g2 0..15 | g3 0..15] then the same for 16..31). Groups are padded
 * to a multiple of 16 with zero codes and zero scales. */
typedef struct {
    int8_t *nat, *quad;
    float *e, *es; /* per group: e, and e * sum(c) */
} kvlm_actrow;

static inline int64_t groups_padded(int64_t K) { return (K / G + 15) / 16 * 16; }

/* bytes per quantized row; a multiple of 64 */
static inline int64_t actrow_bytes(int64_t K) { return groups_padded(K) * (2 * G + 8); }

static kvlm_actrow actrow_at(char *buf, int64_t K, int64_t t) {
    int64_t gp = groups_padded(K);
    char *p = buf + t * actrow_bytes(K);
    kvlm_actrow r = {(int8_t *)p, (int8_t *)(p + gp * G), (float *)(p + 2 * gp * G),
                     (float *)(p + 2 * gp * G) + gp};
    return r;
}

static void quantize_act_row(const float *x, int64_t K, kvlm_actrow r) {
    int64_t groups = K / G, gp = groups_padded(K);
    memset(r.nat, 0, 2 * gp * G);
    memset(r.e, 0, 2 * gp * sizeof(float));
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * G;
        int8_t c[G];
        float amax = 0.f;
        for (int j = 0; j < G; j++) amax = fmaxf(amax, fabsf(xg[j]));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < G; j++) {
            c[j] = (int8_t)nearbyintf(xg[j] * inv); /* |.| <= 127; nearest even */
            sum += c[j];
        }
        memcpy(r.nat + g * G, c, G);
        int8_t *qd = r.quad + (g / 4) * 128 + (g % 4) * 16;
        memcpy(qd, c, 16);
        memcpy(qd + 64, c + 16, 16);
        r.e[g] = amax / 127.f;
        r.es[g] = r.e[g] * (float)sum;
    }
}

/* Thread-local scratch for the quantized rows (the caller's thread quantizes; the
 * OpenMP team reads it). Grows, never shrinks: at most SMALL_M rows of the widest K. */
static __thread char *act_buf;
static __thread size_t act_cap;

static char *act_scratch(size_t bytes) {
    if (bytes > act_cap) {
        free(act_buf);
        act_buf = aligned_alloc(64, bytes);
        act_cap = act_buf ? bytes : 0;
    }
    return act_buf;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* R rows of x (R a literal: loops unroll) against weight row n. */
static inline __attribute__((always_inline)) void
row_product_i8(int kind, const int R, const uint8_t *qrow, const float *p0, const float *p1,
               int64_t groups, const kvlm_actrow *a, float *y, int64_t N, int64_t n,
               int64_t m0) {
    __m512 acc[MT];
    for (int t = 0; t < R; t++) acc[t] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        int64_t ng = groups - g0 < 16 ? groups - g0 : 16;
        __mmask16 km = (__mmask16)((1u << ng) - 1);
        __m512 dv = _mm512_maskz_loadu_ps(km, p0 + g0), sv[MT];
        /* q4: + m e sum(c); q8 (codes offset by 128 below): - 128 s e sum(c) */
        __m512 zv = kind == Q4 ? _mm512_maskz_loadu_ps(km, p1 + g0)
                               : _mm512_mul_ps(dv, _mm512_set1_ps(-128.f));
        for (int t = 0; t < R; t++) {
            sv[t] = _mm512_mul_ps(dv, _mm512_loadu_ps(a[t].e + g0));
            acc[t] = _mm512_fmadd_ps(zv, _mm512_loadu_ps(a[t].es + g0), acc[t]);
        }
        if (kind == Q4) { /* four groups per step; lane i of a product = group i / 4 */
            __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            for (int64_t g = g0; g < g0 + ng; g += 4) {
                const uint8_t *src = qrow + g * (G / 2);
                __m512i raw = groups - g >= 4
                                  ? _mm512_loadu_si512(src)
                                  : _mm512_maskz_loadu_epi8((1ULL << ((groups - g) * 16)) - 1, src);
                __m512i lo = _mm512_and_si512(raw, nib);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
                for (int t = 0; t < R; t++) {
                    const int8_t *xq = a[t].quad + g * G;
                    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                    _mm512_load_si512(xq));
                    p = _mm512_dpbusd_epi32(p, hi, _mm512_load_si512(xq + 64));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                             _mm512_permutexvar_ps(idx, sv[t]), acc[t]);
                }
                idx = _mm512_add_epi32(idx, _mm512_set1_epi32(4));
            }
        } else { /* two groups per step; codes + 128 are the unsigned operand */
            __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            for (int64_t g = g0; g < g0 + ng; g += 2) {
                const uint8_t *src = qrow + g * G;
                __m512i raw = groups - g >= 2 ? _mm512_loadu_si512(src)
                                              : _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, src);
                __m512i u = _mm512_xor_si512(raw, flip);
                for (int t = 0; t < R; t++) {
                    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u,
                                                    _mm512_load_si512(a[t].nat + g * G));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                             _mm512_permutexvar_ps(idx, sv[t]), acc[t]);
                }
                idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
            }
        }
    }
    for (int t = 0; t < R; t++) y[(m0 + t) * N + n] = _mm512_reduce_add_ps(acc[t]);
}
#else
static inline __attribute__((always_inline)) void
row_product_i8(int kind, const int R, const uint8_t *qrow, const float *p0, const float *p1,
               int64_t groups, const kvlm_actrow *a, float *y, int64_t N, int64_t n,
               int64_t m0) {
    for (int t = 0; t < R; t++) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            int32_t dot = 0;
            const int8_t *c = a[t].nat + g * G;
            if (kind == Q8) {
                const int8_t *q = (const int8_t *)qrow + g * G;
                for (int j = 0; j < G; j++) dot += q[j] * c[j];
                acc += p0[g] * a[t].e[g] * (float)dot;
            } else {
                const uint8_t *q = qrow + g * (G / 2);
                for (int j = 0; j < G / 2; j++)
                    dot += (q[j] & 0x0F) * c[j] + (q[j] >> 4) * c[j + G / 2];
                acc += p0[g] * a[t].e[g] * (float)dot + p1[g] * a[t].es[g];
            }
        }
        y[(m0 + t) * N + n] = acc;
    }
}
#endif

/* KIND literal, as GEMM_ROWS; rows of x in blocks of MT so each weight row is read once
 * per block. */
#define GEMM_ROWS_I8(KIND, x, M, K, q, row_bytes, p0, p1, N, y)                              \
    do {                                                                                     \
        int64_t groups_ = (K) / G;                                                           \
        char *buf_ = act_scratch((size_t)(M)*actrow_bytes(K));                               \
        if (!buf_) return -1;                                                                \
        kvlm_actrow rows_[SMALL_ROWS];                                                       \
        for (int64_t t = 0; t < (M); t++) {                                                  \
            rows_[t] = actrow_at(buf_, K, t);                                                \
            quantize_act_row((x) + t * (K), K, rows_[t]);                                    \
        }                                                                                    \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < (N); n++) {                                                  \
            const uint8_t *qr_ = (q) + n * (row_bytes);                                      \
            const float *a_ = (p0) + n * groups_, *b_ = (p1) ? (p1) + n * groups_ : 0;       \
            for (int64_t m0 = 0; m0 < (M); m0 += MT) {                                       \
                switch ((M) - m0 < MT ? (M) - m0 : MT) {                                     \
                case 1: row_product_i8(KIND, 1, qr_, a_, b_, groups_, rows_ + m0, y, N, n, m0); break; \
                case 2: row_product_i8(KIND, 2, qr_, a_, b_, groups_, rows_ + m0, y, N, n, m0); break; \
                case 3: row_product_i8(KIND, 3, qr_, a_, b_, groups_, rows_ + m0, y, N, n, m0); break; \
                default: row_product_i8(KIND, 4, qr_, a_, b_, groups_, rows_ + m0, y, N, n, m0); \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        return 0;                                                                            \
    } while (0)

/* As kvlm_q8_gemm / kvlm_q4_gemm with x rounded to int8 per group; M <= SMALL_ROWS.
 * Returns 0, or -1 when M is too large or scratch memory cannot be had (y untouched). */
int kvlm_q8_gemm_i8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                    int64_t N, float *y) {
    const float *none = 0;
    if (M < 1 || M > SMALL_ROWS) return -1;
    GEMM_ROWS_I8(Q8, x, M, K, (const uint8_t *)q, K, s, none, N, y);
}

int kvlm_q4_gemm_i8(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d,
                    const float *m, int64_t N, float *y) {
    if (M < 1 || M > SMALL_ROWS) return -1;
    GEMM_ROWS_I8(Q4, x, M, K, q, K / 2, d, m, N, y);
}

/* Row n of the dense weight [N, K], into fp32 or (bf16 != 0) bf16 rounded to nearest even
 * as torch rounds (NaN not special-cased: weights have none). Values: d * q + m rounded
 * twice, exactly as the float loader computes them. */
static inline __attribute__((always_inline)) void
dequant_row(int kind, int bf16, int64_t K, const uint8_t *qrow, const float *p0,
            const float *p1, void *out) {
    float *wf = (float *)out;
    uint16_t *wh = (uint16_t *)out;
    for (int64_t g = 0; g < K / G; g++) {
#ifdef __AVX512F__
        __m512 half[2];
        group_avx512(kind, qrow, p0, p1, g, &half[0], &half[1], 1);
        for (int i = 0; i < 2; i++) {
            if (!bf16) {
                _mm512_storeu_ps(wf + g * G + 16 * i, half[i]);
                continue;
            }
            __m512i bits = _mm512_castps_si512(half[i]);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
            _mm256_storeu_si256((__m256i *)(wh + g * G + 16 * i),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        }
#else
        float tmp[G];
        group_scalar(kind, qrow, p0, p1, g, tmp);
        for (int j = 0; j < G; j++) {
            if (bf16)
                wh[g * G + j] = to_bf16(tmp[j]);
            else
                wf[g * G + j] = tmp[j];
        }
#endif
    }
}

/* KIND and BF16 are literals: the loop body is outlined by OpenMP (see GEMM_ROWS). */
#define DEQUANT_ROWS(KIND, BF16, K, q, row_bytes, p0, p1, N, w)                              \
    do {                                                                                     \
        int64_t groups_ = (K) / G;                                                           \
        size_t esz_ = (BF16) ? sizeof(uint16_t) : sizeof(float);                             \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < (N); n++)                                                    \
            dequant_row(KIND, BF16, K, (q) + n * (row_bytes), (p0) + n * groups_,            \
                        (p1) ? (p1) + n * groups_ : 0, (char *)(w) + n * (K) * esz_);        \
    } while (0)

/* The dense weight [N, K], for products with many rows (prefill): fp32, or bf16 for
 * --prefill-dtype bf16. */
void kvlm_q8_dequant(int64_t K, const int8_t *q, const float *s, int64_t N, float *w) {
    const float *none = 0;
    DEQUANT_ROWS(Q8, 0, K, (const uint8_t *)q, K, s, none, N, w);
}

void kvlm_q4_dequant(int64_t K, const uint8_t *q, const float *d, const float *m, int64_t N,
                     float *w) {
    DEQUANT_ROWS(Q4, 0, K, q, K / 2, d, m, N, w);
}

void kvlm_q8_dequant_bf16(int64_t K, const int8_t *q, const float *s, int64_t N, uint16_t *w) {
    const float *none = 0;
    DEQUANT_ROWS(Q8, 1, K, (const uint8_t *)q, K, s, none, N, w);
}

void kvlm_q4_dequant_bf16(int64_t K, const uint8_t *q, const float *d, const float *m,
                          int64_t N, uint16_t *w) {
    DEQUANT_ROWS(Q4, 1, K, q, K / 2, d, m, N, w);
}

/* ------------------------------------------------------------------------------------
 * One decode step of a Llama-family model, whole, for one sequence on a contiguous fp32
 * KV cache: the per-token path without ~500 small torch ops. The math is the torch
 * model's (kvlm.model.transformer), in the same order; only summation order differs.
 * ------------------------------------------------------------------------------------ */

typedef struct {
    int64_t kind; /* 8 or 4 */
    const void *codes;
    const float *scale;
    const float *zero;
    int64_t n, k;
} kvlm_qmat;

typedef struct {
    const float *input_norm, *post_norm;
    kvlm_qmat qkv, o, gate_up, down;
} kvlm_qlayer;

typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, slots;
    float eps;
    const kvlm_qlayer *layers;
    const float *final_norm;
    kvlm_qmat lm_head;
    int64_t kv_bf16; /* the cache stores bf16 (else fp32) */
    int64_t act_int8; /* products round x to int8 per group (--activations int8) */
} kvlm_qmodel;

static void matvec(const kvlm_qmat *w, const float *x, float *y, int act_int8) {
    if (act_int8 && w->kind == Q8 &&
        kvlm_q8_gemm_i8(x, 1, w->k, (const int8_t *)w->codes, w->scale, w->n, y) == 0)
        return;
    if (act_int8 && w->kind == Q4 &&
        kvlm_q4_gemm_i8(x, 1, w->k, (const uint8_t *)w->codes, w->scale, w->zero, w->n, y) == 0)
        return;
    if (w->kind == Q8)
        kvlm_q8_gemm(x, 1, w->k, (const int8_t *)w->codes, w->scale, w->n, y);
    else
        kvlm_q4_gemm(x, 1, w->k, (const uint8_t *)w->codes, w->scale, w->zero, w->n, y);
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* rotate-half RoPE on one head in place */
static void rope(float *v, const float *cos, const float *sin, int64_t d) {
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * cos[i] - b * sin[i];
        v[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* p[i] = exp(p[i] - mx) for i < n; returns the sum. AVX-512: Cephes' expf polynomial
 * (relative error ~1e-7) scaled by 2^k with scalef; scalar expf otherwise. */
static float exp_sum(float *p, int64_t n, float mx) {
    float sum = 0.f;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + i), vmx);
        x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
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
        y = _mm512_scalef_ps(y, e);
        _mm512_mask_storeu_ps(p + i, k, y);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, y));
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    return sum;
}

#ifdef __AVX512F__
static inline __m512 load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* y += a * x */
/* element i of a cache row stored as fp32, or (bf) as bf16 */
static inline float kv_elem(const char *row, int bf, int64_t i) {
    return bf ? from_bf16(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

#ifdef __AVX512F__
static inline __m512 kv_load(const char *row, int bf, int64_t i) {
    return bf ? load_bf16((const uint16_t *)row + i) : _mm512_loadu_ps((const float *)row + i);
}
#endif

/* a . row[0:n] */
static inline float dot_kv(const float *a, const char *row, int bf, int64_t n) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), kv_load(row, bf, i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * kv_elem(row, bf, i);
    return s;
}

/* y[0:n] += a * row[0:n] */
static inline void axpy_kv(float a, const char *row, int bf, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * kv_elem(row, bf, i);
}

#define MAX_CHUNKS 8 /* position chunks per KV head: the threads' work items */

#ifdef __AVX512F__
/* lanes 0..3 = the sums of a, b, c, d */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(v)                                                                            \
    _mm256_add_ps(_mm512_castps512_ps256(v),                                                 \
                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b)), cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* p[h * S + s] = scale * q_h . K[s] for s in [s0, s1), four positions per reduction */
static inline __attribute__((always_inline)) void
scores_avx512(const float *q, int ng, const char *K, int bf, int64_t esz, int64_t D, int64_t S,
              int64_t s0, int64_t s1, float scale, float *p) {
    const int nv = (int)(D / 16);
    const __m512 zero = _mm512_setzero_ps();
    for (int h = 0; h < ng; h++) {
        __m512 qv[8];
        for (int v = 0; v < nv; v++) qv[v] = _mm512_mul_ps(_mm512_loadu_ps(q + h * D + 16 * v),
                                                          _mm512_set1_ps(scale));
        float *ph = p + h * S;
        int64_t s = s0;
        for (; s + 4 <= s1; s += 4) {
            const char *r = K + s * D * esz;
            __m512 a0 = zero, a1 = zero, a2 = zero, a3 = zero;
            for (int v = 0; v < nv; v++) {
                a0 = _mm512_fmadd_ps(qv[v], kv_load(r, bf, 16 * v), a0);
                a1 = _mm512_fmadd_ps(qv[v], kv_load(r + D * esz, bf, 16 * v), a1);
                a2 = _mm512_fmadd_ps(qv[v], kv_load(r + 2 * D * esz, bf, 16 * v), a2);
                a3 = _mm512_fmadd_ps(qv[v], kv_load(r + 3 * D * esz, bf, 16 * v), a3);
            }
            _mm_storeu_ps(ph + s, reduce4(a0, a1, a2, a3));
        }
        for (; s < s1; s++) {
            const char *r = K + s * D * esz;
            __m512 a = zero;
            for (int v = 0; v < nv; v++) a = _mm512_fmadd_ps(qv[v], kv_load(r, bf, 16 * v), a);
            ph[s] = _mm512_reduce_add_ps(a);
        }
    }
}

/* o[h] = sum_s p[h * S + s] V[s] over [s0, s1), each V row read once for the NG heads;
 * NG and NV constant where inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
pv_avx512(const int NG, const int NV, const float *p, const char *V, int bf, int64_t esz,
          int64_t D, int64_t S, int64_t s0, int64_t s1, float *o) {
    __m512 acc[8][8];
    for (int h = 0; h < NG; h++)
        for (int v = 0; v < NV; v++) acc[h][v] = _mm512_setzero_ps();
    for (int64_t s = s0; s < s1; s++) {
        const char *r = V + s * D * esz;
        for (int v = 0; v < NV; v++) {
            __m512 vv = kv_load(r, bf, 16 * v);
            for (int h = 0; h < NG; h++)
                acc[h][v] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * S + s]), vv, acc[h][v]);
        }
    }
    for (int h = 0; h < NG; h++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + h * D + 16 * v, acc[h][v]);
}

static void pv_dispatch(int ng, int nv, const float *p, const char *V, int bf, int64_t esz,
                        int64_t D, int64_t S, int64_t s0, int64_t s1, float *o) {
#define PV_CASE(G_, V_)                                                                      \
    if (ng == G_ && nv == V_) {                                                              \
        pv_avx512(G_, V_, p, V, bf, esz, D, S, s0, s1, o);                                   \
        return;                                                                              \
    }
    PV_CASE(1, 4) PV_CASE(2, 4) PV_CASE(3, 4) PV_CASE(4, 4) PV_CASE(1, 8) PV_CASE(2, 8)
    PV_CASE(4, 8)
#undef PV_CASE
    for (int h = 0; h < ng; h++) pv_avx512(1, nv, p + h * S, V, bf, esz, D, S, s0, s1, o + h * D);
}
#endif

/* Attention of the `ng` query heads of one KV head over positions [s0, s1): unnormalised
 * output o (ng x D), running max m and sum l per head (combined across chunks later). */
static void attend_chunk(const float *q, int ng, const char *K, const char *V, int bf,
                         int64_t esz, int64_t D, int64_t S, int64_t s0, int64_t s1, float scale,
                         float *p, float *m, float *l, float *o) {
#ifdef __AVX512F__
    if (D % 16 == 0 && D <= 128) {
        scores_avx512(q, ng, K, bf, esz, D, S, s0, s1, scale, p);
        for (int h = 0; h < ng; h++) {
            float mx = -INFINITY;
            for (int64_t s = s0; s < s1; s++) mx = p[h * S + s] > mx ? p[h * S + s] : mx;
            m[h] = mx;
            l[h] = exp_sum(p + h * S + s0, s1 - s0, mx);
        }
        pv_dispatch(ng, (int)(D / 16), p, V, bf, esz, D, S, s0, s1, o);
        return;
    }
#endif
    for (int h = 0; h < ng; h++) {
        const float *qh = q + h * D;
        float *ph = p + h * S, mx = -INFINITY;
        for (int64_t s = s0; s < s1; s++) {
            const char *row = K + s * D * esz;
            ph[s] = dot_kv(qh, row, bf, D) * scale;
            mx = ph[s] > mx ? ph[s] : mx;
        }
        m[h] = mx;
        l[h] = exp_sum(ph + s0, s1 - s0, mx);
        float *oh = o + h * D;
        memset(oh, 0, D * sizeof(float));
        for (int64_t s = s0; s < s1; s++) {
            axpy_kv(ph[s], V + s * D * esz, bf, oh, D);
        }
    }
}

/* x [hidden]: the token's embedding in, overwritten; cos/sin [head_dim] at `pos`;
 * kv: (layers, 2, kv_heads, slots, head_dim) fp32 or bf16, slot `pos` written here;
 * scratch: kvlm_decode_scratch() floats; logits [vocab] out. */
int64_t kvlm_decode_scratch(const kvlm_qmodel *m) {
    int64_t qkv = (m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    return 2 * m->hidden + qkv + m->n_heads * m->head_dim + 3 * m->inter +
           m->n_heads * m->slots + m->n_heads * MAX_CHUNKS * (m->head_dim + 2);
}

void kvlm_decode_step(const kvlm_qmodel *m, float *x, int64_t pos, const float *cos,
                      const float *sin, void *kv, float *scratch, float *logits) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t S = m->slots, group = Hq / Hkv, n = pos + 1;
    const float scale = 1.0f / sqrtf((float)D);
    const int ai8 = m->act_int8 != 0;
    float *h = scratch;                  /* H */
    float *qkv = h + H;                  /* (Hq + 2 Hkv) D */
    float *att = qkv + (Hq + 2 * Hkv) * D; /* Hq D */
    float *gu = att + Hq * D;            /* 2 I */
    float *act = gu + 2 * m->inter;      /* I */
    float *scores = act + m->inter;      /* Hq S */
    float *tmp = scores + Hq * S;        /* H */
    float *part = tmp + H;               /* per (head, chunk): o [D], max, sum */
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        const int bf = m->kv_bf16 != 0;
        const int64_t esz = bf ? 2 : 4;
        char *kc = (char *)kv + (l * 2) * Hkv * S * D * esz;
        char *vc = (char *)kv + (l * 2 + 1) * Hkv * S * D * esz;
        rms_norm(x, L->input_norm, H, m->eps, h);
        matvec(&L->qkv, h, qkv, ai8);
        for (int64_t j = 0; j < Hq + Hkv; j++) rope(qkv + j * D, cos, sin, D);
        for (int64_t g = 0; g < Hkv; g++) {
            const float *k = qkv + (Hq + g) * D, *v = qkv + (Hq + Hkv + g) * D;
            char *kd = kc + (g * S + pos) * D * esz, *vd = vc + (g * S + pos) * D * esz;
            if (bf) {
                for (int64_t i = 0; i < D; i++) {
                    ((uint16_t *)kd)[i] = to_bf16(k[i]);
                    ((uint16_t *)vd)[i] = to_bf16(v[i]);
                }
            } else {
                memcpy(kd, k, D * sizeof(float));
                memcpy(vd, v, D * sizeof(float));
            }
        }
        /* work items: (KV head, chunk of positions), so two threads share even 3 heads */
        const int64_t chunks = n < 64 ? 1 : (n / 64 < MAX_CHUNKS ? n / 64 : MAX_CHUNKS);
        const int64_t per = (n + chunks - 1) / chunks;
#pragma omp parallel for schedule(static)
        for (int64_t item = 0; item < Hkv * chunks; item++) {
            const int64_t g = item / chunks, c = item % chunks;
            const int64_t s0 = c * per, s1 = s0 + per < n ? s0 + per : n;
            float *pt = part + (g * group * MAX_CHUNKS + c) * (D + 2);
            /* heads g*group .. : o at pt + h*MAX_CHUNKS*(D+2), max/sum after it */
            float o[8 * 128], mh[8], lh[8];
            if (s0 < s1 && group <= 8 && D <= 128) {
                attend_chunk(qkv + g * group * D, (int)group, kc + g * S * D * esz,
                             vc + g * S * D * esz, bf, esz, D, S, s0, s1, scale,
                             scores + g * group * S, mh, lh, o);
            } else {
                for (int64_t h = 0; h < group && h < 8; h++) mh[h] = -INFINITY, lh[h] = 0.f;
                memset(o, 0, sizeof(o));
            }
            for (int64_t h = 0; h < group && h < 8; h++) {
                float *dst = pt + h * MAX_CHUNKS * (D + 2);
                memcpy(dst, o + h * D, D * sizeof(float));
                dst[D] = mh[h];
                dst[D + 1] = lh[h];
            }
        }
        for (int64_t j = 0; j < Hq; j++) { /* merge the chunks: log-sum-exp */
            const float *pj = part + j * MAX_CHUNKS * (D + 2);
            float M = -INFINITY, Lsum = 0.f, *out = att + j * D;
            for (int64_t c = 0; c < chunks; c++) M = pj[c * (D + 2) + D] > M ? pj[c * (D + 2) + D] : M;
            memset(out, 0, D * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const float *pc = pj + c * (D + 2);
                float w = pc[D] == -INFINITY ? 0.f : expf(pc[D] - M);
                Lsum += w * pc[D + 1];
                axpy_kv(w, (const char *)pc, 0, out, D);
            }
            for (int64_t i = 0; i < D; i++) out[i] /= Lsum;
        }
        matvec(&L->o, att, tmp, ai8);
        for (int64_t i = 0; i < H; i++) x[i] += tmp[i];
        rms_norm(x, L->post_norm, H, m->eps, h);
        matvec(&L->gate_up, h, gu, ai8);
        for (int64_t i = 0; i < m->inter; i++) {
            float g = gu[i];
            act[i] = g / (1.0f + expf(-g)) * gu[m->inter + i];
        }
        matvec(&L->down, act, tmp, ai8);
        for (int64_t i = 0; i < H; i++) x[i] += tmp[i];
    }
    rms_norm(x, m->final_norm, H, m->eps, h);
    matvec(&m->lm_head, h, logits, ai8);
}
