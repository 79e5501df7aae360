/* Low-bit weight products for kvlm: y[M, N] = x[M, K] . dequant(W)[N, K]^T, x and y fp32.
 *
 * Weights come in groups of 32 along K, llama.cpp's block size, with fp16 parameters:
 *   q8:   int8 codes q, scale s per group:      w = s * q                 (GGUF Q8_0)
 *   q4:   4-bit codes, (d, m) per group:        w = d * q + m             (Q4_1)
 *   q4_0: 4-bit codes, d per group:             w = d * (q - 8)           (Q4_0)
 *   q5_0: 5-bit codes, d per group:             w = d * (q - 16)          (Q5_0)
 *   q5_1: 5-bit codes, (d, m) per group:        w = d * q + m             (Q5_1)
 * or in llama.cpp's K-quant super-blocks of 256 (8 groups of 32):
 *   q4_k: 4-bit codes, (d, dmin) per 256, 6-bit (sc, mn) per 32: w = (d sc) q - dmin mn (Q4_K)
 *   q5_k: the same with 5-bit codes                                                     (Q5_K)
 *   q6_k: 6-bit codes, d per 256, int8 sc per 16:                w = (d sc) (q - 32)    (Q6_K)
 * each product of parameters in fp32 as ggml and gguf-py compute it (d sc and dmin mn are
 * exact), so a dequantized weight is gguf-py's, bit for bit.
 *
 * Stored row-interleaved (kvlm.model.quant packs them): blocks of 16 rows, one row per
 * vector lane, so one 64-byte load holds 4 consecutive bytes of 16 rows and a product
 * accumulates 16 outputs in one register (no horizontal sums, no per-row overhead; the
 * layout of llama.cpp's repacked Q4_0x8 / ARM kernels). Block b (rows 16b .. 16b + 15,
 * zero rows past N) is a row of records, one stream to read:
 *   q8, q4, q4_0, q5_0, q5_1: K / 32 records, one group each:
 *       codes [CB], scale [16] fp16 (s or d of each row), then q4 and q5_1: zero [16] fp16 (m)
 *   q4_k, q5_k: K / 256 records, each a header then the 8 groups' codes [CB]:
 *       header: the rows' 12 bytes of 6-bit scales and mins, ggml's own packing, as three
 *       vectors (lane i of the first = row i's bytes 0-3, the second's 4-7, the third's
 *       8-11), then d [16], dmin [16] fp16
 *   q6_k: K / 256 records: header d [16] fp16, sc [16 sub-blocks of 16][16 rows] int8, then
 *       the 8 groups' codes [CB]
 * codes [CB] of one group, 16 rows:
 *   q8: 512 bytes = 8 vectors, lane i of vector v = codes 4v .. 4v + 3 of row i
 *   the others: 256 bytes of nibbles = 4 vectors, lane i of vector v = bytes 4v .. 4v + 3 of
 *       row i's 16, byte j holding element j (low nibble) and j + 16 (high); then
 *       5-bit kinds: one vector of fifth bits, lane i = row i's 32: byte j, bit 2v + h =
 *           that of element 16h + 4v + j;
 *       q6_k: two vectors of bits 4-5: byte j, bits 2v and 2v + 1 = those of element
 *           4v + j (the first) or 16 + 4v + j (the second),
 *       so a shift and a mask put vector v's high bits beside its nibbles.
 * Bytes per weight: q8 1.0625, q4 0.625, q4_0 0.5625, q5_0 0.6875, q5_1 0.75, q4_k 0.5625,
 * q5_k 0.6875, q6_k 0.8203125: the GGUF file's own sizes; a block of 16 rows is 16 of the
 * file's rows long, so blocks of weights stacked along N are their packed bytes one after
 * another. kvlm_qpack writes this layout straight from a GGUF tensor's blocks.
 *
 * Decode reads every weight once per token, so the loop runs over blocks, split across
 * OpenMP threads (torch's own runtime: torch is loaded first and ships the same
 * libgomp.so.1), each block used for up to 4 rows of x per pass. fp32 activations: codes
 * are widened to fp32 in registers, each group's sum of q * x scaled once (per 16 for
 * q6_k; zero terms: plus m * sum(x), q4_0's -8d among them, its codes unsigned as q4's):
 * the dequantized weight's product up to rounding order. int8 activations (llama.cpp's
 * numerics) take integer dot products, at any row count (a prompt's rows too,
 * --prefill-dtype int8: 8 rows per pass over a block, its codes widened once for all of
 * them); int16 activations (the decode rows' default where the CPU has VNNI) are int8
 * codes and an int8 residual, two integer products of the same widened codes. Many rows
 * on fp32 or bf16 activations dequantize once (kvlm_qdequant: exactly the loader's
 * numbers) and call a real GEMM.
 *
 * The vector code is written in AVX-512 intrinsics (16 lanes: a block's 16 rows). Built
 * for a CPU with AVX2 + FMA + F16C and no AVX-512, v512.h gives those intrinsics as two
 * 256-bit halves (KVLM_V512 256), so Zen 2/3 and Intel's client cores run the same code,
 * not the scalar loops (the default model on a Zen 3, 2 threads: 8.4 -> 145.7 tokens/s);
 * the int8-activation products stay VNNI-only.
 */
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

#define G 32          /* weights per group */
#define BR 16         /* weight rows per block: one per 32-bit vector lane */
#define MT 4          /* rows of x per pass over a block */
#define MT_I8 8       /* with int8 x, many rows (a prompt): rows per pass */
#define L2_ROWS_BYTES (384 << 10) /* int8 rows of x per chunk of a many-row product */
#define SMALL_ROWS 16 /* the most rows the small products take (quant.SMALL_M) */

enum { Q8 = 8, Q4 = 4, Q40 = 40, Q50 = 50, Q51 = 51, Q4K = 104, Q5K = 105, Q6K = 106 };

static inline int known_kind(int64_t kind) {
    return kind == Q8 || kind == Q4 || kind == Q40 || kind == Q50 || kind == Q51 ||
           kind == Q4K || kind == Q5K || kind == Q6K;
}

static inline int is_k(int kind) { return kind == Q4K || kind == Q5K || kind == Q6K; }

/* bytes of a block as a GGUF file stores it (kvlm_qpack's input), and the weights it
 * holds: a row of K weights is K / weights blocks */
static inline int64_t ggml_block_bytes(int kind) {
    switch (kind) {
    case Q8: return 34;
    case Q4: return 20;
    case Q40: return 18;
    case Q50: return 22;
    case Q51: return 24;
    case Q4K: return 144;
    case Q5K: return 176;
    default: return 210;
    }
}

static inline int64_t ggml_block_weights(int kind) { return is_k(kind) ? 256 : G; }

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

/* *r = bytes of a packed [n, k] weight of a known kind (quant.packed_bytes): ceil(n / 16)
 * blocks of 16 rows of k / weights stored blocks each. 0 when n < 0, k < 1, k is not
 * whole blocks of the kind, or the size overflows. */
static int packed_size(int kind, int64_t n, int64_t k, int64_t *r) {
    int64_t row, block;
    if (n < 0 || k < 1 || k % ggml_block_weights(kind)) return 0;
    return mul_ok(k / ggml_block_weights(kind), ggml_block_bytes(kind), &row) &&
           mul_ok(row, BR, &block) && mul_ok(n / BR + (n % BR != 0), block, r);
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

int kvlm_kernel_abi(void) { return 23; }

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

/* ---- the packed layout ---- */

/* bits of a code above its nibble: 1 (5-bit kinds), 2 (q6_k), 0 */
static inline int high_bits(int kind) {
    return kind == Q6K ? 2 : (kind == Q50 || kind == Q51 || kind == Q5K) ? 1 : 0;
}

/* w = s (q - code_offset) + z: the kinds with a z term (q4_k, q5_k: z = -dmin mn) */
static inline int has_zero(int kind) {
    return kind == Q4 || kind == Q51 || kind == Q4K || kind == Q5K;
}

static inline int code_offset(int kind) {
    return kind == Q40 ? 8 : kind == Q50 ? 16 : kind == Q6K ? 32 : 0;
}

/* groups per record */
static inline int64_t rec_groups(int kind) { return is_k(kind) ? 8 : 1; }

/* bytes of one group's codes (16 rows): nibbles or int8, then high bits */
static inline int64_t code_bytes(int kind) {
    return kind == Q8 ? 16 * G : 8 * G + 64 * high_bits(kind);
}

/* fp16 parameters after each group's codes (the per-group kinds) */
static inline int64_t param_bytes(int kind) {
    return is_k(kind) ? 0 : (has_zero(kind) ? 4 : 2) * BR;
}

/* a K-quant record's header */
static inline int64_t head_bytes(int kind) {
    return kind == Q6K ? 18 * BR : is_k(kind) ? 16 * BR : 0;
}

static inline int64_t rec_bytes(int kind) {
    return head_bytes(kind) + rec_groups(kind) * (code_bytes(kind) + param_bytes(kind));
}

typedef struct {
    const uint8_t *p; /* the block's first record */
} kvlm_block;

static inline kvlm_block block_at(int kind, const uint8_t *w, int64_t groups, int64_t b) {
    kvlm_block r = {w + b * (groups / rec_groups(kind)) * rec_bytes(kind)};
    return r;
}

/* the record holding group g (its header, for the K-quants) */
static inline const uint8_t *head_of(int kind, kvlm_block B, int64_t g) {
    return B.p + g / rec_groups(kind) * rec_bytes(kind);
}

static inline const uint8_t *codes_of(int kind, kvlm_block B, int64_t g) {
    return head_of(kind, B, g) + head_bytes(kind) +
           g % rec_groups(kind) * (code_bytes(kind) + param_bytes(kind));
}

/* the 16 rows' fp16 scales of group g (zeros: the 16 after them); per-group kinds */
static inline const uint16_t *scales_of(int kind, kvlm_block B, int64_t g) {
    return (const uint16_t *)(codes_of(kind, B, g) + code_bytes(kind));
}

static inline int32_t load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Row i's group g as its 32 codes in element order: q8's int8 bytes, else 0 .. 2^bits - 1 */
static inline void row_codes(int kind, kvlm_block B, int64_t g, int i, uint8_t *q) {
    const uint8_t *c = codes_of(kind, B, g);
    if (kind == Q8) {
        for (int v = 0; v < 8; v++) memcpy(q + 4 * v, c + v * 64 + i * 4, 4);
        return;
    }
    const uint8_t *hb = c + 8 * G + 4 * i; /* lane i of the high-bit vector(s) */
    for (int v = 0; v < 4; v++)
        for (int j = 0; j < 4; j++) {
            const uint8_t byte = c[64 * v + 4 * i + j];
            uint8_t lo = byte & 0x0F, hi = byte >> 4;
            if (high_bits(kind) == 1) {
                lo |= (uint8_t)(((hb[j] >> (2 * v)) & 1) << 4);
                hi |= (uint8_t)(((hb[j] >> (2 * v + 1)) & 1) << 4);
            } else if (high_bits(kind) == 2) {
                lo |= (uint8_t)(((hb[j] >> (2 * v)) & 3) << 4);
                hi |= (uint8_t)(((hb[64 + j] >> (2 * v)) & 3) << 4);
            }
            q[4 * v + j] = lo;
            q[16 + 4 * v + j] = hi;
        }
}

/* the 6-bit scale and min of sub-block s from a row's 12 packed bytes (ggml's
 * get_scale_min_k4) */
static inline void scale_min_k4(const uint8_t *q, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = q[s] & 63;
        *mn = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0x0F) | ((q[s - 4] >> 6) << 4);
        *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

/* Row i's parameters of group g: w_j = s[j / 16] (q_j - code_offset) + z, in fp32 as ggml
 * computes them (q6_k: d sc per 16; q4_k, q5_k: d sc, and z = -(dmin mn), exact) */
static inline void row_params(int kind, kvlm_block B, int64_t g, int i, float *s, float *z) {
    if (!is_k(kind)) {
        const uint16_t *p = scales_of(kind, B, g);
        s[0] = s[1] = from_f16(p[i]);
        *z = has_zero(kind) ? from_f16(p[BR + i]) : 0.f;
        return;
    }
    const uint8_t *h = head_of(kind, B, g);
    const int sub = (int)(g % 8);
    if (kind == Q6K) {
        const float d = from_f16(((const uint16_t *)h)[i]);
        const int8_t *sc = (const int8_t *)(h + 2 * BR);
        s[0] = d * (float)sc[2 * sub * BR + i];
        s[1] = d * (float)sc[(2 * sub + 1) * BR + i];
        *z = 0.f;
        return;
    }
    uint8_t q12[12];
    for (int w = 0; w < 3; w++) memcpy(q12 + 4 * w, h + 64 * w + 4 * i, 4);
    int sc, mn;
    scale_min_k4(q12, sub, &sc, &mn);
    const uint16_t *dd = (const uint16_t *)(h + 12 * BR);
    s[0] = s[1] = from_f16(dd[i]) * (float)sc;
    *z = -(from_f16(dd[BR + i]) * (float)mn);
}

/* Row i's group g as 32 floats, exactly as the float loader computes them: s * q, or
 * s * q + z, or s * (q - offset), rounded as written (the build's ISO C mode keeps mul and
 * add unfused; x + (-y) is x - y). */
static inline void group_scalar(int kind, kvlm_block B, int64_t g, int i, float *w) {
    uint8_t q[G];
    float s[2], z;
    row_codes(kind, B, g, i, q);
    row_params(kind, B, g, i, s, &z);
    if (kind == Q8) {
        for (int j = 0; j < G; j++) w[j] = s[0] * (float)(int8_t)q[j];
    } else if (has_zero(kind)) {
        for (int j = 0; j < G; j++) w[j] = s[j / 16] * (float)q[j] + z;
    } else {
        for (int j = 0; j < G; j++) w[j] = s[j / 16] * (float)(q[j] - code_offset(kind));
    }
}

/* Scratch per calling thread (it prepares x; the OpenMP team reads it). Grows, never
 * shrinks: at most SMALL_ROWS rows of the widest K. */
static __thread char *act_buf;
static __thread size_t act_cap;

static char *act_scratch(size_t bytes) {
    if (bytes > act_cap) {
        free(act_buf);
        act_buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        act_cap = act_buf ? bytes : 0;
    }
    return act_buf;
}

#if KVLM_V512
/* x shifted left by s bits in each 32-bit lane (right by -s); s a literal once inlined */
static inline __attribute__((always_inline)) __m512i shift_lanes(__m512i x, int s) {
    return s > 0 ? _mm512_slli_epi32(x, (unsigned)s) : s < 0 ? _mm512_srli_epi32(x, (unsigned)-s) : x;
}

/* Vector v of a group's codes (c: its first byte) as bytes: lo = elements 4v .. 4v + 3 of
 * each row, hi = elements 16 + 4v ..; unsigned (0 .. 2^bits - 1). hb0, hb1: the group's
 * high-bit vectors (loaded once per group). */
static inline __attribute__((always_inline)) void
code_vectors(int kind, const uint8_t *c, int v, __m512i hb0, __m512i hb1, __m512i *lo,
             __m512i *hi) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i raw = _mm512_loadu_si512(c + 64 * v);
    *lo = _mm512_and_si512(raw, nib);
    *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    if (high_bits(kind) == 1) { /* bit 2v (+1) of each byte to bit 4: a | (b & c) */
        const __m512i bit = _mm512_set1_epi8(0x10);
        *lo = _mm512_ternarylogic_epi32(*lo, shift_lanes(hb0, 4 - 2 * v), bit, 0xF8);
        *hi = _mm512_ternarylogic_epi32(*hi, shift_lanes(hb0, 3 - 2 * v), bit, 0xF8);
    } else if (high_bits(kind) == 2) { /* bits 2v, 2v + 1 to bits 4, 5 */
        const __m512i bits = _mm512_set1_epi8(0x30);
        *lo = _mm512_ternarylogic_epi32(*lo, shift_lanes(hb0, 4 - 2 * v), bits, 0xF8);
        *hi = _mm512_ternarylogic_epi32(*hi, shift_lanes(hb1, 4 - 2 * v), bits, 0xF8);
    }
}

static inline __m512 load_f16x16(const void *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* -x, exactly (the sign flipped) */
static inline __m512 negate(__m512 x) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

/* The 16 rows' parameters of group g (row_params, a row per lane): s0 for elements 0..15,
 * s1 for 16..31 (different for q6_k only), z (zero where the kind has none) */
static inline __attribute__((always_inline)) void
group_params(int kind, kvlm_block B, int64_t g, __m512 *s0, __m512 *s1, __m512 *z) {
    if (!is_k(kind)) {
        const uint16_t *p = scales_of(kind, B, g);
        *s0 = *s1 = load_f16x16(p);
        *z = has_zero(kind) ? load_f16x16(p + BR) : _mm512_setzero_ps();
        return;
    }
    const uint8_t *h = head_of(kind, B, g);
    const int sub = (int)(g % 8);
    if (kind == Q6K) {
        const __m512 d = load_f16x16(h);
        const int8_t *sc = (const int8_t *)(h + 2 * BR) + 2 * sub * BR;
        *s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128((const __m128i *)sc))));
        *s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128((const __m128i *)(sc + BR)))));
        *z = _mm512_setzero_ps();
        return;
    }
    const __m512i cnt = _mm512_set1_epi32(8 * (sub & 3)), six = _mm512_set1_epi32(63);
    const __m512i w0 = _mm512_srlv_epi32(_mm512_loadu_si512(h), cnt);
    const __m512i w1 = _mm512_srlv_epi32(_mm512_loadu_si512(h + 64), cnt);
    __m512i sc, mn;
    if (sub < 4) {
        sc = _mm512_and_si512(w0, six);
        mn = _mm512_and_si512(w1, six);
    } else {
        const __m512i w2 = _mm512_srlv_epi32(_mm512_loadu_si512(h + 128), cnt);
        const __m512i low4 = _mm512_set1_epi32(0x0F), top2 = _mm512_set1_epi32(0x30);
        sc = _mm512_or_si512(_mm512_and_si512(w2, low4),
                             _mm512_and_si512(_mm512_srli_epi32(w0, 2), top2));
        mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low4),
                             _mm512_and_si512(_mm512_srli_epi32(w1, 2), top2));
    }
    const uint16_t *dd = (const uint16_t *)(h + 12 * BR);
    *s0 = *s1 = _mm512_mul_ps(load_f16x16(dd), _mm512_cvtepi32_ps(sc));
    *z = negate(_mm512_mul_ps(load_f16x16(dd + BR), _mm512_cvtepi32_ps(mn)));
}
#endif

/* Each group's bytes PREFETCH_AHEAD further on in the block's stream, fetched into L1 as
 * the group is read. The hardware prefetcher alone fell behind on records that are read
 * out of order (a K-quant group's codes, then its super-block's header; a 5-bit group's
 * high bits before its nibbles): one thread streaming 2048 x 8192 weights from DRAM took
 * q5_k 1290 -> 380 us (fp32 x), q4_k 440 -> 160 us (int8 x), and q4 / q8 gained too
 * (400 -> 300, 505 -> 360 us fp32). 8 KiB ahead gave most of it, 16 KiB a little more. */
#define PREFETCH_AHEAD 16384
static inline __attribute__((always_inline)) void prefetch_ahead(int kind, kvlm_block B,
                                                                 int64_t g) {
    const int64_t step = rec_bytes(kind) / rec_groups(kind); /* bytes per group, on average */
    const char *p = (const char *)B.p + g * step + PREFETCH_AHEAD;
    for (int64_t k = 0; k < step; k += 64) __builtin_prefetch(p + k, 0, 3);
}

/* ---- fp32 activations ---- */

#if KVLM_V512
/* vpshufb masks: byte j of each 32-bit lane moved to the lane's top byte, the rest zero,
 * so the lane reads q * 2^24 (signed for q8 codes and offset codes; 0..63 * 2^24 else). */
static inline __m512i top_byte_mask(int j) {
    const __m512i base = _mm512_set_epi32(0x0C808080, 0x08808080, 0x04808080, 0x00808080,
                                          0x0C808080, 0x08808080, 0x04808080, 0x00808080,
                                          0x0C808080, 0x08808080, 0x04808080, 0x00808080,
                                          0x0C808080, 0x08808080, 0x04808080, 0x00808080);
    return _mm512_add_epi32(base, _mm512_set1_epi32(j << 24));
}

/* y[m0 + t, 16b ..] (row stride ldy) for t < R (R a literal): block b against R rows of x
 * (row stride K). xs: per row and group, the sum of x (the z terms). */
static inline __attribute__((always_inline)) void
block_product(int kind, const int R, kvlm_block B, int64_t groups, const float *x, int64_t K,
              const float *xs, float *y, int64_t ldy, int64_t N, int64_t n0, int64_t m0) {
    __m512 acc[MT];
    for (int t = 0; t < R; t++) acc[t] = _mm512_setzero_ps();
    __m512i sel[4];
    for (int j = 0; j < 4; j++) sel[j] = top_byte_mask(j);
    /* Two independent sums per row of x (fma latency), whatever R: a row's sums must not
     * depend on how many rows share the pass, or a sequence's tokens would change with the
     * server's batch. (Four for R <= 2 measured no faster: 41.8 vs 42.0 us at M = 1.)
     * q6_k keeps its halves apart (a scale per 16). */
    const int C = 2;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *c = codes_of(kind, B, g);
        const float *xg = x + m0 * K + g * G;
        prefetch_ahead(kind, B, g);
        __m512 part[MT][4];
        for (int t = 0; t < R; t++)
            for (int k = 0; k < C; k++) part[t][k] = _mm512_setzero_ps();
        if (kind == Q8) {
            for (int v = 0; v < 8; v++) {
                __m512i raw = _mm512_loadu_si512(c + 64 * v);
                for (int j = 0; j < 4; j++) {
                    __m512 w = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(raw, sel[j]));
                    int k = j & (C - 1), e = 4 * v + j;
                    for (int t = 0; t < R; t++)
                        part[t][k] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[t * K + e]),
                                                     part[t][k]);
                }
            }
        } else {
            const __m512i hb0 = high_bits(kind) ? _mm512_loadu_si512(c + 8 * G) : _mm512_setzero_si512();
            const __m512i hb1 = high_bits(kind) == 2 ? _mm512_loadu_si512(c + 8 * G + 64) : hb0;
            for (int v = 0; v < 4; v++) {
                __m512i half[2];
                code_vectors(kind, c, v, hb0, hb1, &half[0], &half[1]);
                for (int h = 0; h < 2 && code_offset(kind) && kind != Q40; h++) /* q - offset */
                    half[h] = _mm512_sub_epi8(half[h], _mm512_set1_epi8((char)code_offset(kind)));
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 4; j++) {
                        __m512 w = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(half[h], sel[j]));
                        int k = kind == Q6K ? h : (2 * j + h) & (C - 1), e = 16 * h + 4 * v + j;
                        for (int t = 0; t < R; t++)
                            part[t][k] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[t * K + e]),
                                                         part[t][k]);
                    }
            }
        }
        __m512 s0, s1, z;
        group_params(kind, B, g, &s0, &s1, &z);
        /* q4_0: d q - 8d, as a zero term (-8d exact): the codes stay unsigned, as q4's */
        if (kind == Q40) z = negate(_mm512_mul_ps(s0, _mm512_set1_ps(8.f)));
        const __m512 unit = _mm512_set1_ps(5.9604644775390625e-8f); /* 2^-24: codes came scaled */
        s0 = _mm512_mul_ps(s0, unit);
        s1 = _mm512_mul_ps(s1, unit);
        for (int t = 0; t < R; t++) {
            if (kind == Q6K) {
                acc[t] = _mm512_fmadd_ps(part[t][0], s0, acc[t]);
                acc[t] = _mm512_fmadd_ps(part[t][1], s1, acc[t]);
            } else {
                __m512 p = part[t][0];
                for (int k = 1; k < C; k++) p = _mm512_add_ps(p, part[t][k]);
                acc[t] = _mm512_fmadd_ps(p, s0, acc[t]);
            }
            if (has_zero(kind) || kind == Q40)
                acc[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[(m0 + t) * groups + g]), acc[t]);
        }
    }
    __mmask16 keep = N - n0 >= BR ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int t = 0; t < R; t++) _mm512_mask_storeu_ps(y + (m0 + t) * ldy + n0, keep, acc[t]);
}
#else
static inline __attribute__((always_inline)) void
block_product(int kind, const int R, kvlm_block B, int64_t groups, const float *x, int64_t K,
              const float *xs, float *y, int64_t ldy, int64_t N, int64_t n0, int64_t m0) {
    (void)xs;
    for (int i = 0; i < BR && n0 + i < N; i++) {
        float acc[MT] = {0}, w[G];
        for (int64_t g = 0; g < groups; g++) {
            group_scalar(kind, B, g, i, w);
            for (int t = 0; t < R; t++) {
                const float *xg = x + (m0 + t) * K + g * G;
                float s = 0.f;
                for (int j = 0; j < G; j++) s += w[j] * xg[j];
                acc[t] += s;
            }
        }
        for (int t = 0; t < R; t++) y[(m0 + t) * ldy + n0 + i] = acc[t];
    }
}
#endif

/* The block loop, written out per kind and per count of x rows (literals: OpenMP outlines
 * the loop body before constants propagate, so arguments would become runtime branches in
 * the innermost loop). BODY(KIND, R, m0) multiplies block b by rows m0 .. m0 + R - 1. */
#define ROWS_BY_MT(M, m0, KIND, BODY)                                                        \
    for (; m0 < (M); m0 += MT) {                                                             \
        switch ((M) - m0 < MT ? (M) - m0 : MT) {                                             \
        case 1: BODY(KIND, 1, m0); break;                                                    \
        case 2: BODY(KIND, 2, m0); break;                                                    \
        case 3: BODY(KIND, 3, m0); break;                                                    \
        default: BODY(KIND, 4, m0);                                                          \
        }                                                                                    \
    }
#define FOR_BLOCKS(M, N, KIND, BODY)                                                         \
    _Pragma("omp parallel for schedule(static)")                                             \
    for (int64_t b = 0; b < ((N) + BR - 1) / BR; b++) {                                      \
        int64_t m0 = 0;                                                                      \
        ROWS_BY_MT(M, m0, KIND, BODY)                                                        \
    }

/* As FOR_BLOCKS, MT_I8 rows per pass while that many are left (int8 x: a prompt's rows) */
#define FOR_BLOCKS_WIDE(M, N, KIND, BODY)                                                    \
    _Pragma("omp parallel for schedule(static)")                                             \
    for (int64_t b = 0; b < ((N) + BR - 1) / BR; b++) {                                      \
        int64_t m0 = 0;                                                                      \
        for (; (M) - m0 >= MT_I8; m0 += MT_I8) BODY(KIND, MT_I8, m0);                        \
        ROWS_BY_MT(M, m0, KIND, BODY)                                                        \
    }

#define FOR_KIND_LOOP(LOOP, kind, M, N, BODY)                                                \
    do {                                                                                     \
        switch (kind) {                                                                      \
        case Q8: LOOP(M, N, Q8, BODY) break;                                                 \
        case Q4: LOOP(M, N, Q4, BODY) break;                                                 \
        case Q40: LOOP(M, N, Q40, BODY) break;                                               \
        case Q50: LOOP(M, N, Q50, BODY) break;                                               \
        case Q51: LOOP(M, N, Q51, BODY) break;                                               \
        case Q4K: LOOP(M, N, Q4K, BODY) break;                                               \
        case Q5K: LOOP(M, N, Q5K, BODY) break;                                               \
        default: LOOP(M, N, Q6K, BODY) break;                                                \
        }                                                                                    \
    } while (0)
#define FOR_KIND_BLOCKS(kind, M, N, BODY) FOR_KIND_LOOP(FOR_BLOCKS, kind, M, N, BODY)

/* Whether a product's sizes agree: a known kind, M >= 1, K whole blocks of the kind, x
 * [M, K] within its xn floats, w a packed [N, K] within its wn bytes, and y's rows of N at
 * stride ldy >= N, (M - 1) ldy + N floats, within its yn. */
static int product_ok(int64_t kind, int64_t M, int64_t K, int64_t xn, int64_t wn, int64_t N,
                      int64_t ldy, int64_t yn) {
    int64_t need, last;
    if (!known_kind(kind) || M < 1 || N < 0 || ldy < N) return 0;
    if (!packed_size((int)kind, N, K, &need) || wn < need) return 0;
    if (!mul_ok(M, K, &need) || xn < need) return 0;
    return mul_ok(M - 1, ldy, &last) && add_ok(last, N, &need) && yn >= need;
}

/* x [M, K] (M <= SMALL_ROWS; xn floats), w packed [N, K] of `kind` (wn bytes) -> y [M, N],
 * row stride ldy >= N (a column slice of a wider output; yn floats from y on). Returns 0;
 * -1 when scratch memory cannot be had, -2, nothing read or written, when M or the kind is
 * out of range or a buffer is shorter than the shape needs (product_ok). */
int kvlm_qgemm(int64_t kind, const float *x, int64_t xn, int64_t M, int64_t K,
               const uint8_t *w, int64_t wn, int64_t N, float *y, int64_t yn, int64_t ldy) {
    const int64_t groups = K / G;
    if (M > SMALL_ROWS || !product_ok(kind, M, K, xn, wn, N, ldy, yn)) return -2;
    float *xs = (float *)act_scratch((size_t)M * groups * sizeof(float));
    if (!xs) return -1;
    for (int64_t t = 0; t < M * groups; t++) { /* each group's sum of x (the z terms) */
#if KVLM_V512
        xs[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + t * G), _mm512_loadu_ps(x + t * G + 16)));
#else
        float s = 0.f;
        for (int j = 0; j < G; j++) s += x[t * G + j];
        xs[t] = s;
#endif
    }
#define QGEMM_BODY(KIND, R, m0) \
    block_product(KIND, R, block_at(KIND, w, groups, b), groups, x, K, xs, y, ldy, N, b * BR, m0)
    FOR_KIND_BLOCKS(kind, M, N, QGEMM_BODY);
    return 0;
}

/* ------------------------------------------------------------------------------------
 * int8 activations (--activations int8): llama.cpp's numerics for the per-token products.
 * Each row of x is rounded per group of 32 to int8 codes c with one scale e = max|x| / 127
 * (nearest even), so a group's product is
 *     q8: s e sum(q c)     q4 (q5_1, q4_k, q5_k): s e sum(q c) + z e sum(c)
 *     q4_0, q5_0: s e (sum(q c) - o sum(c)), o = 8, 16
 *     q6_k: per half h, s_h e (sum_h(q c) - 32 sum_h(c))
 * with the integer sums on AVX512-VNNI (vpdpbusd: 16 rows x 4 byte products per
 * instruction, the 4 codes of x broadcast) where the CPU has it, else in scalar integer
 * code. vpdpbusd's first operand is unsigned: nibbles and the 5/6-bit codes are (their
 * offsets come off the integer sums, exactly); q8 codes are offset by 128 and the offset
 * taken back with the same sum(c) term. int16 activations (--activations int16) add an
 * int8 residual r per value, x ~ e (c + r / 256): the same sums over 256 c + r, scaled by
 * e / 256 (kvlm_actrow), a second vpdpbusd per word (2x the integer work; on Zen 4, +1-4%
 * of a decode step, +12% on the 1.7B Q4_0 shape whose step is the most compute-bound).
 * ------------------------------------------------------------------------------------ */

/* A row of x as int8: codes [groups][32], then per group e, e * sum(x's codes), and the
 * integer sums of codes 0..15 and 16..31. With a residual (--activations int16), x ~ e
 * (c + r / 256): c the nearest (even) integer to y = x 127 / max|x|, r that of (y - c) 256
 * (at most 127: a tie's 128, y exactly half-way, is taken as 127), so a value is within
 * e / 512 of x (e / 256 at a tie), 16 bits a value where int8 alone keeps it within e / 2;
 * then the residual codes [groups][32] follow, each half's sum of 256 c + r, and the
 * group's scale is kept as e / 256 (exact), so the kernel's sums are simply those of
 * 256 c + r in int32 (|.| < 2^28): a second vpdpbusd over the same codes of the weight,
 * joined to the first's by a shift, the offsets and scales as int8's. */
typedef struct {
    const int8_t *c, *r; /* r NULL: int8 alone */
    const float *e, *es;
    const int32_t *hs, *hr; /* hr: with r, each half's sum of 256 c + r */
} kvlm_actrow;

static inline int64_t actrow_bytes(int64_t K, int fine) {
    return (K / G) * (G + 16) + (fine ? (K / G) * (G + 8) : 0);
}

static kvlm_actrow actrow_at(const char *buf, int64_t K, int64_t t, int fine) {
    const char *p = buf + t * actrow_bytes(K, fine);
    const float *e = (const float *)(p + K);
    const int32_t *hs = (const int32_t *)(e + 2 * (K / G));
    const int8_t *r = fine ? (const int8_t *)(hs + 2 * (K / G)) : NULL;
    kvlm_actrow a = {(const int8_t *)p, r, e, e + K / G, hs, fine ? (const int32_t *)(r + K) : NULL};
    return a;
}

static void quantize_act_row(const float *x, int64_t K, char *out, int fine) {
    int64_t groups = K / G;
    int8_t *codes = (int8_t *)out;
    float *e = (float *)(out + K), *es = e + groups;
    int32_t *hs = (int32_t *)(es + groups);
    int8_t *rc = (int8_t *)(hs + 2 * groups);
    int32_t *hr = (int32_t *)(rc + K);
#if KVLM_V512
    /* one group = two vectors; the same max, the same product by 127 / amax and the same
     * half-to-even rounding as the loop below (1.6 -> 0.2 us per row at K = 576) */
    for (int64_t g = 0; g < groups; g++) {
        const __m512 lo = _mm512_loadu_ps(x + g * G), hi = _mm512_loadu_ps(x + g * G + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* a literal: clang wants one */
        const __m512 ylo = _mm512_mul_ps(lo, inv), yhi = _mm512_mul_ps(hi, inv);
        const __m512 flo = _mm512_roundscale_ps(ylo, RN), fhi = _mm512_roundscale_ps(yhi, RN);
        __m512i clo = _mm512_cvtps_epi32(flo), chi = _mm512_cvtps_epi32(fhi);
        _mm_storeu_si128((__m128i *)(codes + g * G), _mm512_cvtepi32_epi8(clo));
        _mm_storeu_si128((__m128i *)(codes + g * G + 16), _mm512_cvtepi32_epi8(chi));
        hs[2 * g] = _mm512_reduce_add_epi32(clo);
        hs[2 * g + 1] = _mm512_reduce_add_epi32(chi);
        e[g] = amax / 127.f;
        int32_t sr = 0;
        if (fine) { /* y - c is exact (|.| <= 1/2), its product by 256 too */
            const __m512 k256 = _mm512_set1_ps(256.f), top = _mm512_set1_ps(127.f);
            __m512 rlo = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(ylo, flo), k256), RN);
            __m512 rhi = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(yhi, fhi), k256), RN);
            __m512i ilo = _mm512_cvtps_epi32(_mm512_min_ps(rlo, top));
            __m512i ihi = _mm512_cvtps_epi32(_mm512_min_ps(rhi, top));
            _mm_storeu_si128((__m128i *)(rc + g * G), _mm512_cvtepi32_epi8(ilo));
            _mm_storeu_si128((__m128i *)(rc + g * G + 16), _mm512_cvtepi32_epi8(ihi));
            hr[2 * g] = 256 * hs[2 * g] + _mm512_reduce_add_epi32(ilo);
            hr[2 * g + 1] = 256 * hs[2 * g + 1] + _mm512_reduce_add_epi32(ihi);
            e[g] *= 1.f / 256.f; /* exact */
            sr = hr[2 * g] + hr[2 * g + 1];
        }
#undef RN
        /* e times the sum of codes (of 256 c + r: exact integers below 2^24), rounded once */
        es[g] = e[g] * (float)(fine ? sr : hs[2 * g] + hs[2 * g + 1]);
    }
    return;
#endif
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * G;
        float amax = 0.f;
        for (int j = 0; j < G; j++) amax = fmaxf(amax, fabsf(xg[j]));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum[2] = {0, 0}, rsum[2] = {0, 0};
        for (int j = 0; j < G; j++) {
            const float y = xg[j] * inv, c = nearbyintf(y); /* |.| <= 127; nearest even */
            codes[g * G + j] = (int8_t)c;
            sum[j / 16] += codes[g * G + j];
            if (fine) {
                rc[g * G + j] = (int8_t)fminf(nearbyintf((y - c) * 256.f), 127.f);
                rsum[j / 16] += rc[g * G + j];
            }
        }
        hs[2 * g] = sum[0];
        hs[2 * g + 1] = sum[1];
        e[g] = amax / 127.f;
        if (fine) {
            hr[2 * g] = 256 * sum[0] + rsum[0], hr[2 * g + 1] = 256 * sum[1] + rsum[1];
            e[g] *= 1.f / 256.f;
        }
        es[g] = e[g] * (float)(fine ? hr[2 * g] + hr[2 * g + 1] : sum[0] + sum[1]);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* acc + u . x's word broadcast (vpdpbusd with the word as an embedded broadcast operand:
 * GCC 12 loads a _mm512_set1_epi32 of it into a register first, one more vector
 * instruction a product) */
static inline __attribute__((always_inline)) __m512i dpbusd_word(__m512i acc, __m512i u,
                                                                 const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*x));
    return acc;
}

static inline __attribute__((always_inline)) void
block_product_i8(int kind, const int R, const int FINE, kvlm_block B, int64_t groups,
                 const kvlm_actrow *a, float *y, int64_t ldy, int64_t N, int64_t n0, int64_t m0) {
    __m512 acc[MT_I8], off[MT_I8];
    for (int t = 0; t < R; t++) acc[t] = off[t] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *c = codes_of(kind, B, g);
        prefetch_ahead(kind, B, g);
        /* independent integer sums per row (dpbusd latency): few rows, nibbles lo / hi
         * apart (q8: 4 or 2); many rows, one each (their own chains are enough), q6_k's
         * halves always apart (a scale each). Integer sums: the split changes no bit.
         * pr: the residual codes' sums, in chains of their own. */
        __m512i p[MT_I8][4], pr[MT_I8][4];
        const int C = kind == Q6K ? 2 : R > MT ? 1 : kind != Q8 ? 2 : (R <= 2 && !FINE ? 4 : 2);
        const int HI = C > 1 ? 1 : 0;
        for (int t = 0; t < R; t++)
            for (int k = 0; k < C; k++) p[t][k] = pr[t][k] = _mm512_setzero_si512();
        if (kind != Q8) { /* word v of x's group: elements 4v..; word 4 + v: 16 + 4v.. */
            const __m512i hb0 = high_bits(kind) ? _mm512_loadu_si512(c + 8 * G) : _mm512_setzero_si512();
            const __m512i hb1 = high_bits(kind) == 2 ? _mm512_loadu_si512(c + 8 * G + 64) : hb0;
            for (int v = 0; v < 4; v++) {
                __m512i lo, hi;
                code_vectors(kind, c, v, hb0, hb1, &lo, &hi);
                for (int t = 0; t < R; t++) {
                    const int32_t *xw = (const int32_t *)(a[t].c + g * G);
                    p[t][0] = dpbusd_word(p[t][0], lo, xw + v);
                    p[t][HI] = dpbusd_word(p[t][HI], hi, xw + 4 + v);
                    if (FINE) {
                        const int32_t *rw = (const int32_t *)(a[t].r + g * G);
                        pr[t][0] = dpbusd_word(pr[t][0], lo, rw + v);
                        pr[t][HI] = dpbusd_word(pr[t][HI], hi, rw + 4 + v);
                    }
                }
            }
        } else {
            for (int v = 0; v < 8; v++) {
                __m512i u = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * v), flip);
                for (int t = 0; t < R; t++) {
                    const int32_t *xw = (const int32_t *)(a[t].c + g * G);
                    p[t][v % C] = dpbusd_word(p[t][v % C], u, xw + v);
                    if (FINE)
                        pr[t][v % C] = dpbusd_word(pr[t][v % C], u, (const int32_t *)(a[t].r + g * G) + v);
                }
            }
        }
        __m512 s0, s1, z;
        group_params(kind, B, g, &s0, &s1, &z);
        if (kind == Q8) z = _mm512_mul_ps(s0, _mm512_set1_ps(-128.f));
        for (int t = 0; t < R; t++) {
            /* with a residual (FINE) a group's sums are those of 256 c + r (p << 8 plus pr),
             * its scale e / 256 and the codes' sums the offsets take 256 c + r's too */
            const __m512 e = _mm512_set1_ps(a[t].e[g]);
            const int32_t *hs = FINE ? a[t].hr : a[t].hs;
            if (kind == Q6K) { /* each half less 32 times its codes' sum: exact integers */
                __m512i q0 = p[t][0], q1 = p[t][1];
                if (FINE) {
                    q0 = _mm512_add_epi32(_mm512_slli_epi32(q0, 8), pr[t][0]);
                    q1 = _mm512_add_epi32(_mm512_slli_epi32(q1, 8), pr[t][1]);
                }
                q0 = _mm512_sub_epi32(q0, _mm512_set1_epi32(32 * hs[2 * g]));
                q1 = _mm512_sub_epi32(q1, _mm512_set1_epi32(32 * hs[2 * g + 1]));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), _mm512_mul_ps(s0, e), acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_mul_ps(s1, e), acc[t]);
                continue;
            }
            __m512i q = p[t][0], qr = pr[t][0];
            for (int k = 1; k < C; k++) q = _mm512_add_epi32(q, p[t][k]);
            if (FINE) {
                for (int k = 1; k < C; k++) qr = _mm512_add_epi32(qr, pr[t][k]);
                q = _mm512_add_epi32(_mm512_slli_epi32(q, 8), qr);
            }
            if (code_offset(kind)) /* q4_0, q5_0 */
                q = _mm512_sub_epi32(q, _mm512_set1_epi32(code_offset(kind) * (hs[2 * g] + hs[2 * g + 1])));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(s0, e), acc[t]);
            if (kind == Q8 || has_zero(kind))
                off[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(a[t].es[g]), off[t]);
        }
    }
    __mmask16 keep = N - n0 >= BR ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int t = 0; t < R; t++)
        _mm512_mask_storeu_ps(y + (m0 + t) * ldy + n0, keep, _mm512_add_ps(acc[t], off[t]));
}
#else
static inline __attribute__((always_inline)) void
block_product_i8(int kind, const int R, const int FINE, kvlm_block B, int64_t groups,
                 const kvlm_actrow *a, float *y, int64_t ldy, int64_t N, int64_t n0, int64_t m0) {
    for (int i = 0; i < BR && n0 + i < N; i++) {
        for (int t = 0; t < R; t++) {
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                uint8_t q[G];
                float s[2], z;
                row_codes(kind, B, g, i, q);
                row_params(kind, B, g, i, s, &z);
                const int8_t *c = a[t].c + g * G, *r = FINE ? a[t].r + g * G : NULL;
                const float e = a[t].e[g]; /* e / 256 with FINE */
                if (kind == Q8) {
                    int32_t dot = 0;
                    for (int j = 0; j < G; j++) dot += (int8_t)q[j] * (FINE ? 256 * c[j] + r[j] : c[j]);
                    acc += s[0] * e * (float)dot;
                    continue;
                }
                int32_t dot[2] = {0, 0};
                for (int j = 0; j < G; j++) dot[j / 16] += q[j] * (FINE ? 256 * c[j] + r[j] : c[j]);
                for (int h = 0; h < 2; h++)
                    dot[h] -= code_offset(kind) * (FINE ? a[t].hr[2 * g + h] : a[t].hs[2 * g + h]);
                if (kind == Q6K)
                    acc += s[0] * e * (float)dot[0] + s[1] * e * (float)dot[1];
                else
                    acc += s[0] * e * (float)(dot[0] + dot[1]) +
                           (has_zero(kind) ? z * a[t].es[g] : 0.f);
            }
            y[(m0 + t) * ldy + n0 + i] = acc;
        }
    }
}
#endif

/* As kvlm_qgemm with x rounded to int8 per group, and with fine != 0 to 16 bits (int8
 * codes and an int8 residual: kvlm_actrow), at any row count M (more than SMALL_ROWS: a
 * prompt's rows; with a residual MT rows a pass, its chains of sums twice as many). -2
 * as kvlm_qgemm's, and for a fine other than 0 or 1. */
int kvlm_qgemm_i8(int64_t kind, const float *x, int64_t xn, int64_t M, int64_t K,
                  const uint8_t *w, int64_t wn, int64_t N, float *y, int64_t yn, int64_t ldy,
                  int64_t fine) {
    const int64_t groups = K / G;
    if ((fine != 0 && fine != 1) || !product_ok(kind, M, K, xn, wn, N, ldy, yn)) return -2;
    const int F = (int)fine;
    const size_t rows_at = ((size_t)M * actrow_bytes(K, F) + 63) / 64 * 64;
    char *buf = act_scratch(rows_at + (size_t)M * sizeof(kvlm_actrow));
    if (!buf) return -1;
    kvlm_actrow *rows = (kvlm_actrow *)(buf + rows_at);
#pragma omp parallel for schedule(static) if (M > SMALL_ROWS)
    for (int64_t t = 0; t < M; t++) {
        quantize_act_row(x + t * K, K, buf + t * actrow_bytes(K, F), F);
        rows[t] = actrow_at(buf, K, t, F);
    }
#define QGEMM_I8_BODY(KIND, R, m0) \
    block_product_i8(KIND, R, 0, block_at(KIND, w, groups, b), groups, rows + (m0), y, ldy, N, b * BR, m0)
#define QGEMM_I16_BODY(KIND, R, m0) \
    block_product_i8(KIND, R, 1, block_at(KIND, w, groups, b), groups, rows + (m0), y, ldy, N, b * BR, m0)
    if (F) {
        FOR_KIND_BLOCKS(kind, M, N, QGEMM_I16_BODY);
        return 0;
    }
    if (M <= SMALL_ROWS) {
        FOR_KIND_BLOCKS(kind, M, N, QGEMM_I8_BODY);
        return 0;
    }
    /* Many rows: every weight block is multiplied by all of them, so they are streamed
     * once per block of 16 weight rows; in chunks that stay in L2 (each chunk against all
     * the blocks), not all of them from L3 (512 rows at K = 8192 are 4.7 MiB: the down
     * projection ran at ~1.0 TOPS against ~1.15 for the others). A row's sums are the
     * same in any chunk. */
    const int64_t chunk = (int64_t)(L2_ROWS_BYTES / actrow_bytes(K, 0)) / MT_I8 * MT_I8;
    const int64_t step = chunk < MT_I8 ? MT_I8 : chunk;
    for (int64_t c0 = 0; c0 < M; c0 += step) {
        const int64_t mc = M - c0 < step ? M - c0 : step;
        const kvlm_actrow *rows_c = rows + c0;
        float *y_c = y + c0 * ldy;
#define QGEMM_I8_CHUNK(KIND, R, m0) \
    block_product_i8(KIND, R, 0, block_at(KIND, w, groups, b), groups, rows_c + (m0), y_c, ldy, N, b * BR, m0)
        FOR_KIND_LOOP(FOR_BLOCKS_WIDE, kind, mc, N, QGEMM_I8_CHUNK);
#undef QGEMM_I8_CHUNK
    }
    return 0;
}

/* ---- dequantization (prefill) ---- */

/* Row i of block B into fp32 or (bf16 != 0) bf16 rounded to nearest even as torch rounds
 * (NaN not special-cased: weights have none). Values exactly group_scalar's. */
static inline __attribute__((always_inline)) void
dequant_row(int kind, int bf16, int64_t groups, kvlm_block B, int i, void *out) {
    float *wf = (float *)out;
    uint16_t *wh = (uint16_t *)out;
    for (int64_t g = 0; g < groups; g++) {
#if KVLM_V512
        /* lane i of each vector: the row's bytes, 4 at a time (register inserts, not a
         * byte copy then a reload, which would stall store forwarding) */
        const uint8_t *c = codes_of(kind, B, g) + 4 * i;
        __m128i raw[2];
        for (int h = 0; h < (kind == Q8 ? 2 : 1); h++)
            raw[h] = _mm_setr_epi32(load32(c + 256 * h), load32(c + 256 * h + 64),
                                    load32(c + 256 * h + 128), load32(c + 256 * h + 192));
        __m512 half[2];
        if (kind == Q8) {
            __m512 s = _mm512_set1_ps(from_f16(scales_of(kind, B, g)[i]));
            for (int h = 0; h < 2; h++)
                half[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw[h])), s);
        } else if (kind == Q4) {
            __m512 s = _mm512_set1_ps(from_f16(scales_of(kind, B, g)[i]));
            __m128i nib = _mm_set1_epi8(0x0F);
            __m128i codes[2] = {_mm_and_si128(raw[0], nib),
                                _mm_and_si128(_mm_srli_epi16(raw[0], 4), nib)};
            __m512 m = _mm512_set1_ps(from_f16(scales_of(kind, B, g)[BR + i]));
            for (int h = 0; h < 2; h++) /* mul then add: the loader's two roundings */
                half[h] = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes[h])), s), m);
        } else { /* byte 4v + j of raw sits in 32-bit lane v: shift it by 2v (+ 1) */
            const __m128i nib = _mm_set1_epi8(0x0F);
            __m128i codes[2] = {_mm_and_si128(raw[0], nib),
                                _mm_and_si128(_mm_srli_epi16(raw[0], 4), nib)};
            const __m128i even = _mm_setr_epi32(0, 2, 4, 6);
            if (high_bits(kind) == 1) {
                const __m128i hb = _mm_set1_epi32(load32(c + 8 * G)), one = _mm_set1_epi8(1);
                const __m128i odd = _mm_setr_epi32(1, 3, 5, 7);
                codes[0] = _mm_or_si128(codes[0], _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(hb, even), one), 4));
                codes[1] = _mm_or_si128(codes[1], _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(hb, odd), one), 4));
            } else if (high_bits(kind) == 2) {
                const __m128i three = _mm_set1_epi8(3);
                const __m128i ha = _mm_set1_epi32(load32(c + 8 * G));
                const __m128i hb = _mm_set1_epi32(load32(c + 8 * G + 64));
                codes[0] = _mm_or_si128(codes[0], _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(ha, even), three), 4));
                codes[1] = _mm_or_si128(codes[1], _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(hb, even), three), 4));
            }
            float s[2], z;
            row_params(kind, B, g, i, s, &z);
            for (int h = 0; h < 2; h++) {
                __m512i q = _mm512_cvtepu8_epi32(codes[h]);
                if (code_offset(kind)) q = _mm512_sub_epi32(q, _mm512_set1_epi32(code_offset(kind)));
                half[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s[h]));
                if (has_zero(kind)) half[h] = _mm512_add_ps(half[h], _mm512_set1_ps(z));
            }
        }
        for (int h = 0; h < 2; h++) {
            if (!bf16) {
                _mm512_storeu_ps(wf + g * G + 16 * h, half[h]);
                continue;
            }
            __m512i bits = _mm512_castps_si512(half[h]);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
            _mm256_storeu_si256((__m256i *)(wh + g * G + 16 * h),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        }
#else
        float tmp[G];
        group_scalar(kind, B, g, i, tmp);
        for (int j = 0; j < G; j++) {
            if (bf16)
                wh[g * G + j] = to_bf16(tmp[j]);
            else
                wf[g * G + j] = tmp[j];
        }
#endif
    }
}

/* DO(KIND) with KIND a literal for each known kind; an unknown kind returns -2 */
#define EACH_KIND(kind, DO)                                                                  \
    switch (kind) {                                                                          \
    case Q8: DO(Q8); break;                                                                  \
    case Q4: DO(Q4); break;                                                                  \
    case Q40: DO(Q40); break;                                                                \
    case Q50: DO(Q50); break;                                                                \
    case Q51: DO(Q51); break;                                                                \
    case Q4K: DO(Q4K); break;                                                                \
    case Q5K: DO(Q5K); break;                                                                \
    case Q6K: DO(Q6K); break;                                                                \
    default: return -2;                                                                      \
    }

/* KIND and BF16 literals (see FOR_BLOCKS) */
#define DEQUANT_ROWS(KIND, BF16)                                                             \
    do {                                                                                     \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < N; n++)                                                      \
            dequant_row(KIND, BF16, groups, block_at(KIND, w, groups, n / BR), (int)(n % BR), \
                        (char *)out + n * K * ((BF16) ? 2 : 4));                             \
    } while (0)

#define DEQUANT_KIND(KIND)                                                                   \
    do {                                                                                     \
        if (bf16) DEQUANT_ROWS(KIND, 1);                                                     \
        else DEQUANT_ROWS(KIND, 0);                                                          \
    } while (0)

/* The dense weight [N, K] of packed w (wn bytes) into out (on bytes): fp32, or bf16 != 0
 * bf16 (--prefill-dtype bf16). Returns 0, or -2, nothing read or written, for an unknown
 * kind, a bf16 other than 0 or 1, K not whole blocks of the kind, or a buffer shorter than
 * [N, K] needs. */
int kvlm_qdequant(int64_t kind, int64_t bf16, int64_t K, const uint8_t *w, int64_t wn,
                  int64_t N, void *out, int64_t on) {
    const int64_t groups = K / G;
    int64_t need, elems;
    if (!known_kind(kind) || (bf16 != 0 && bf16 != 1)) return -2;
    if (!packed_size((int)kind, N, K, &need) || wn < need) return -2;
    if (!mul_ok(N, K, &elems) || !mul_ok(elems, bf16 ? 2 : 4, &need) || on < need) return -2;
    EACH_KIND(kind, DEQUANT_KIND);
    return 0;
}

/* Rows rows[0 .. n) of packed w [N, K] (wn bytes) into out [n, K] fp32 (on floats): the
 * embedding lookup of a table kept in its stored format. Returns 0, or -2, nothing
 * written, for an unknown kind, K not whole blocks of the kind, a buffer shorter than its
 * shape needs, or a row outside [0, N). */
int kvlm_qdequant_rows(int64_t kind, int64_t K, const uint8_t *w, int64_t wn, int64_t N,
                       const int64_t *rows, int64_t n, float *out, int64_t on) {
    const int64_t groups = K / G;
    int64_t need;
    if (!known_kind(kind) || n < 0) return -2;
    if (!packed_size((int)kind, N, K, &need) || wn < need) return -2;
    if (!mul_ok(n, K, &need) || on < need) return -2;
    for (int64_t t = 0; t < n; t++)
        if (rows[t] < 0 || rows[t] >= N) return -2;
#define DEQUANT_PICKED(KIND)                                                                 \
    for (int64_t t = 0; t < n; t++)                                                          \
        dequant_row(KIND, 0, groups, block_at(KIND, w, groups, rows[t] / BR),                \
                    (int)(rows[t] % BR), out + t * K)
    EACH_KIND(kind, DEQUANT_PICKED);
#undef DEQUANT_PICKED
    return 0;
}

/* ---- packing (kvlm.model.quant: QuantWeight.from_blocks) ----
 * A GGUF tensor's blocks as the file stores them (ggml-common.h), rows of K / per blocks,
 * into the layout at the top of this file:
 *   q8 <- block_q8_0 (d, qs[32] int8)         q4 <- block_q4_1 (d, m, qs[16])
 *   q4_0 <- block_q4_0 (d, qs[16])            q5_0 <- block_q5_0 (d, qh[4], qs[16])
 *   q5_1 <- block_q5_1 (d, m, qh[4], qs[16])
 *   q4_k <- block_q4_K (d, dmin, scales[12], qs[128])
 *   q5_k <- block_q5_K (d, dmin, scales[12], qh[32], qs[128])
 *   q6_k <- block_q6_K (ql[128], qh[64], scales[16], d)
 * ggml's qs[j] of the 32-weight blocks holds element j (low nibble) and j + 16 (high):
 * the layout's own nibble bytes, copied as they are. Parameters are copied as stored
 * (fp16 and 6-bit scales alike): the packed weight holds the file's numbers. */

/* The row packer works on 32-bit words, 4 bytes of a row at once (a lane's width): byte b
 * of a word is the byte at address + b (little-endian, as everywhere in this file), and
 * shifts by less than 8 with a per-byte mask move bits within each byte. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "kvlm's kernels read little-endian words"
#endif
#define LOW4 0x0F0F0F0Fu

static inline void store32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

static inline uint32_t word32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* bits 0-3 of x to bit 0 of bytes 0-3 (x times 1 + 2^7 + 2^14 + 2^21: bit k lands on 8k,
 * the other copies on bits the mask clears, no two on one bit) */
static inline uint32_t spread4(uint32_t x) { return ((x & 15u) * 0x00204081u) & 0x01010101u; }

/* Row i of a block of 16 from its stored row s (K / per blocks) into the block's records
 * at out (KIND a literal once inlined): word v of a group's nibbles (bytes 4v .. 4v + 3:
 * elements 4v + j low, 16 + 4v + j high) goes to lane i of vector v; high bits as the
 * layout says (the top of this file). */
static inline __attribute__((always_inline)) void pack_row(int kind, const uint8_t *s,
                                                           int64_t K, int i, uint8_t *out) {
    const int64_t size = ggml_block_bytes(kind), rec = rec_bytes(kind);
    if (!is_k(kind)) {
        const int64_t cb = code_bytes(kind);
        for (int64_t g = 0; g < K / G; g++) {
            const uint8_t *blk = s + g * size;
            uint8_t *r = out + g * rec;
            memcpy(r + cb + 2 * i, blk, 2); /* d */
            if (kind == Q8) {
                for (int v = 0; v < 8; v++) memcpy(r + 64 * v + 4 * i, blk + 2 + 4 * v, 4);
                continue;
            }
            if (has_zero(kind)) memcpy(r + cb + 2 * BR + 2 * i, blk + 2, 2); /* m */
            const uint8_t *qs = blk + (has_zero(kind) ? 4 : 2) + (high_bits(kind) ? 4 : 0);
            for (int v = 0; v < 4; v++) memcpy(r + 64 * v + 4 * i, qs + 4 * v, 4);
            if (high_bits(kind)) { /* qh: bit e of a little-endian uint32 = element e's */
                const uint32_t qh = word32(qs - 4);
                uint32_t hb = 0; /* byte j, bit 2v + h = bit 16h + 4v + j of qh */
                for (int v = 0; v < 4; v++)
                    hb |= spread4(qh >> (4 * v)) << (2 * v) | spread4(qh >> (16 + 4 * v)) << (2 * v + 1);
                store32(r + 8 * G + 4 * i, hb);
            }
        }
        return;
    }
    const int64_t cb = code_bytes(kind);
    for (int64_t u = 0; u < K / 256; u++) {
        const uint8_t *blk = s + u * size;
        uint8_t *r = out + u * rec, *codes = r + head_bytes(kind);
        if (kind == Q6K) { /* ql[128], qh[64], scales[16], d */
            const uint8_t *ql = blk, *qh = blk + 128, *sc = blk + 192;
            memcpy(r + 2 * i, blk + 208, 2); /* d */
            for (int t = 0; t < 16; t++) r[2 * BR + BR * t + i] = sc[t];
            for (int sub = 0; sub < 8; sub++) { /* elements 32 sub ..: half n, quarter q */
                const int n = sub >> 2, q = sub & 3, sh = 4 * (q >> 1);
                const uint8_t *l = ql + 64 * n + 32 * (q & 1), *h = qh + 32 * n;
                uint8_t *c = codes + sub * cb;
                for (int v = 0; v < 4; v++)
                    store32(c + 64 * v + 4 * i, ((word32(l + 4 * v) >> sh) & LOW4) |
                                                    ((word32(l + 16 + 4 * v) >> sh) & LOW4) << 4);
                for (int hh = 0; hh < 2; hh++) { /* byte j, bits 2v, 2v + 1: element 16hh + 4v + j */
                    uint32_t hb = 0;
                    for (int v = 0; v < 4; v++)
                        hb |= ((word32(h + 16 * hh + 4 * v) >> (2 * q)) & 0x03030303u) << (2 * v);
                    store32(c + 8 * G + 64 * hh + 4 * i, hb);
                }
            }
            continue;
        }
        /* q4_k, q5_k: d, dmin, scales[12], (qh[32]), qs[128] */
        for (int w = 0; w < 3; w++) memcpy(r + 64 * w + 4 * i, blk + 4 + 4 * w, 4); /* scales */
        memcpy(r + 12 * BR + 2 * i, blk, 2);     /* d */
        memcpy(r + 14 * BR + 2 * i, blk + 2, 2); /* dmin */
        const uint8_t *qs = blk + (kind == Q5K ? 48 : 16), *qh = blk + 16;
        for (int sub = 0; sub < 8; sub++) { /* qs[32 (sub / 2) + e]: low nibble, or high */
            const uint8_t *q = qs + 32 * (sub >> 1);
            const int sh = 4 * (sub & 1);
            uint8_t *c = codes + sub * cb;
            for (int v = 0; v < 4; v++)
                store32(c + 64 * v + 4 * i, ((word32(q + 4 * v) >> sh) & LOW4) |
                                                ((word32(q + 16 + 4 * v) >> sh) & LOW4) << 4);
            if (kind == Q5K) { /* qh[e] bit sub -> byte j, bit 2v + h: element 16h + 4v + j */
                uint32_t hb = 0;
                for (int v = 0; v < 4; v++)
                    hb |= ((word32(qh + 4 * v) >> sub) & 0x01010101u) << (2 * v) |
                          ((word32(qh + 16 + 4 * v) >> sub) & 0x01010101u) << (2 * v + 1);
                store32(c + 8 * G + 4 * i, hb);
            }
        }
    }
}

/* The packed weight [N, K] of `kind` from its stored blocks: row n is src row order[n]
 * (order NULL: row n; a permutation applied as the rows are read, llama's q/k rows), each
 * K / per * bytes long; dst: ceil(N / 16) blocks of 16 x that many bytes, every byte
 * written (rows past N zero). Blocks of 16 rows in parallel. src holds sn bytes, dst dn.
 * Returns 0, or -2, nothing written, for an unknown kind, a K that is not whole blocks, a
 * buffer shorter than its shape needs (src N rows, dst the packed [N, K]), or an order
 * entry outside [0, N). */
int kvlm_qpack(int64_t kind, const uint8_t *src, int64_t sn, int64_t N, int64_t K,
               const int64_t *order, uint8_t *dst, int64_t dn) {
    int64_t need;
    if (!known_kind(kind) || !packed_size((int)kind, N, K, &need) || dn < need) return -2;
    const int64_t row_bytes = K / ggml_block_weights((int)kind) * ggml_block_bytes((int)kind);
    if (!mul_ok(N, row_bytes, &need) || sn < need) return -2; /* row_bytes: packed_size's */
    for (int64_t n = 0; order && n < N; n++)
        if (order[n] < 0 || order[n] >= N) return -2;
#define PACK_KIND(KIND)                                                                      \
    do {                                                                                     \
        _Pragma("omp parallel for schedule(dynamic)") /* the CPUs may be shared */           \
        for (int64_t b = 0; b < (N + BR - 1) / BR; b++) {                                    \
            uint8_t *out = dst + b * BR * row_bytes;                                         \
            const int rows = N - b * BR < BR ? (int)(N - b * BR) : BR;                       \
            if (rows < BR) memset(out, 0, (size_t)(BR * row_bytes));                         \
            for (int i = 0; i < rows; i++) {                                                 \
                const int64_t n = b * BR + i;                                                \
                pack_row(KIND, src + (order ? order[n] : n) * row_bytes, K, i, out);         \
            }                                                                                \
        }                                                                                    \
    } while (0)
    EACH_KIND(kind, PACK_KIND);
#undef PACK_KIND
    return 0;
}

/* ------------------------------------------------------------------------------------
 * One decode step of a Llama-family or Gemma 2/3 model, whole, for B sequences over their
 * K/V caches (contiguous, paged, a hybrid cache's ring: kvlm_kv_view): the per-token path
 * without ~500 small torch ops. The math is the torch model's (kvlm.model.transformer), in
 * the same order; only summation order differs.
 * ------------------------------------------------------------------------------------ */

#define QMAT_PARTS 3 /* a fused projection's row parts, each of its own kind */

typedef struct {
    int64_t kind;        /* Q8, Q4, Q40, Q50, Q51, Q4K, Q5K or Q6K */
    const uint8_t *data; /* packed (see the top of this file) */
    int64_t n;           /* its rows */
    int64_t bytes;       /* data's bytes: checked against what n rows of k take */
} kvlm_qpart;

/* [n, k]: the rows of parts 0 .. parts - 1 stacked (q|k|v of a Q4_K_M file: Q4_K, Q4_K, Q6_K) */
typedef struct {
    int64_t n, k, parts;
    kvlm_qpart part[QMAT_PARTS];
} kvlm_qmat;

typedef struct {
    const float *input_norm, *post_norm;
    kvlm_qmat qkv, o, gate_up, down;
    /* NULL when the model has none: the q|k|v bias (Qwen2; Llama's attention_bias), added
     * after the product as torch's Linear does; o_proj's bias; the per-head RMSNorm
     * weights (head_dim each) of the queries and keys before RoPE (Qwen3, Gemma 3) */
    const float *qkv_bias, *o_bias, *q_norm, *k_norm;
    /* Gemma's sandwich norms (NULL: none): the attention's output after o_proj and the
     * MLP's after down, each normed before it is added to the residual */
    const float *attn_out_norm, *mlp_out_norm;
    int64_t window; /* keys the query at p sees: p - window < s <= p; 0: all of 0 .. p;
                       -1: the step's window (kvlm_qmodel.window) */
    int64_t rope;   /* which cos/sin table (0: the model's base; 1: the local layers') */
    int64_t view;   /* which cache view holds this layer's K/V (kvlm_kv_view) */
    int64_t index;  /* the layer's index inside that view's store */
} kvlm_qlayer;

typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, slots;
    float eps;
    const kvlm_qlayer *layers;
    const float *final_norm;
    kvlm_qmat lm_head;
    int64_t k_dtype, v_dtype; /* K's and V's storage: KV_F32, KV_BF16, KV_I8, KV_F16 or
                                 KV_Q4 (each its own: --k-dtype, --v-dtype) */
    int64_t act_int8;        /* which products round x to int8 per group (--activations
                                int8): a mask of ACT_QKV, ACT_O, ACT_GATE_UP, ACT_DOWN,
                                ACT_HEAD (the vocabulary projection: off by default,
                                near-tied logits decide the token) */
    int64_t act_int16;       /* which of those keep an int8 residual too, x to 16 bits a
                                value (--activations int16; kvlm_actrow) */
    const float *key_rot;    /* K in KV_I8 or KV_Q4: R (head_dim x head_dim); K rows are
                                stored as k R */
    int64_t window;          /* the step's attention window (Mistral) for the layers whose
                                own is -1: the query at p sees keys p - window < s <= p; 0:
                                all of 0 .. p */
    int64_t gelu;            /* the MLP's gate: 0 SiLU (SwiGLU), 1 tanh's GELU (GeGLU) */
    float score_scale;       /* the scores' scale (head_dim^-0.5, or Gemma's own) */
    float attn_softcap;      /* scores soft-capped, cap tanh(s / cap), before the softmax
                                (Gemma 2); 0: none */
    int64_t rope_tables;     /* the cos/sin tables given (1, or 2: a local layers' base) */
} kvlm_qmodel;

/* Where a group of layers keeps its K/V: K of layer l at k + l * k_layer bytes, a
 * (num_blocks, kv_heads, block_size, row) array of rows in k_dtype (+ their parameters at
 * kp + l * kp_layer: KV_I8's (step, zero) per row, KV_Q4's head_dim / q4_group scales),
 * V alike in v_dtype; addressed per row of the step through tables [B, width] of block
 * ids. Position s of row b is slot s (ring 0) or s % ring (a ring of `ring` slots, a
 * multiple of block_size: the local layers' window cache), in block
 * tables[b][slot / block_size]. A contiguous cache is one block per row holding every slot
 * (tables {b}, block_size its slots). */
typedef struct {
    void *k, *v;
    uint16_t *kp, *vp;       /* NULL for a float dtype */
    const int32_t *tables;
    int64_t width, num_blocks, block_size, ring;
    int64_t layers;          /* the store's layers (a layer's index is checked against it) */
    int64_t k_layer, v_layer, kp_layer, vp_layer; /* bytes from one layer to the next */
    int64_t entries;         /* tables' int32s (at least B width) */
    /* bytes from k, v, kp and vp on: every layer's blocks must lie within them */
    int64_t k_bytes, v_bytes, kp_bytes, vp_bytes;
} kvlm_kv_view;

enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_F16 = 3, KV_Q4 = 4 };

/* q4 K/V (kvlm/cache/storage.py quantize_q4): a row of D values is D / 2 bytes of 4-bit
 * codes (value 2i in the low nibble of byte i, 2i + 1 in the high one) and one fp16 scale
 * d per group of G = 32 values (G = D when D is not a multiple of 32): x ~ (c - 8) d. */
static inline int64_t q4_group(int64_t D) { return D % 32 == 0 ? 32 : D; }
#define Q4_QG (MAX_HEAD_DIM / 32) /* the most q4 groups a row has */

/* bytes of one stored row, and of its parameters (int8's (step, zero), q4's scales) */
static inline int64_t kv_row_bytes(int dt, int64_t D) {
    return dt == KV_Q4 ? D / 2 : D * (dt == KV_I8 ? 1 : (dt == KV_F32 ? 4 : 2));
}
static inline int64_t kv_param_bytes(int dt, int64_t D) {
    return dt == KV_I8 ? 4 : (dt == KV_Q4 ? 2 * (D / q4_group(D)) : 0);
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

#if KVLM_V512
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

/* p[i] = exp(p[i] - mx) for i < n; returns the sum (exp512, scalar expf without AVX-512) */
static float exp_sum(float *p, int64_t n, float mx) {
    float sum = 0.f;
    int64_t i = 0;
#if KVLM_V512
    __m512 acc = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 y = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + i), vmx));
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

#if KVLM_V512
static inline __m512 load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* y += a * x */
/* element i of a cache row stored as dt: KV_F32, KV_BF16 or KV_F16 */
static inline float kv_elem(const char *row, int dt, int64_t i) {
    if (dt == KV_BF16) return from_bf16(((const uint16_t *)row)[i]);
    if (dt == KV_F16) return from_f16(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

#if KVLM_V512
static inline __m512 kv_load(const char *row, int dt, int64_t i) {
    if (dt == KV_I8) /* codes, widened (the caller takes step and zero apart) */
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
    if (dt == KV_F16) /* exact: every half is a float */
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    return dt == KV_BF16 ? load_bf16((const uint16_t *)row + i)
                         : _mm512_loadu_ps((const float *)row + i);
}
#endif

/* a . row[0:n] */
static inline float dot_kv(const float *a, const char *row, int dt, int64_t n) {
#if KVLM_V512
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), kv_load(row, dt, i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * kv_elem(row, dt, i);
    return s;
}

/* y[0:n] += a * row[0:n] */
static inline void axpy_kv(float a, const char *row, int dt, float *y, int64_t n) {
#if KVLM_V512
    if (n % 16 == 0) {
        __m512 av = _mm512_set1_ps(a);
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, kv_load(row, dt, i), _mm512_loadu_ps(y + i)));
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) y[i] += a * kv_elem(row, dt, i);
}

#define MAX_CHUNKS 8 /* position chunks per KV head: the threads' work items */
#define MAX_HEAD_DIM 256 /* the attention's buffers (Gemma 3's head_dim) */
#define MAX_BATCH 256 /* the most rows (sequences) one decode step takes */

/* Where one KV head's cache rows lie, contiguous, paged or in a ring. Position s of the
 * sequence is slot t = s (or s % ring), at
 *     base + table[t / bs] * bstride + (t % bs) * row_bytes
 * contiguous cache: table {0}, bs = its slots (one block of everything); paged pool
 * (kvlm.cache.paged): the sequence's block table, bs = block_size, bstride = the bytes of
 * one block id (all KV heads); a ring (kvlm.cache.window, a multiple of bs slots): its
 * wrap falls on a block's end. The kernels walk [s0, s1) in runs of one block each. */
typedef struct {
    const char *base;     /* this layer's K or V (or their int8 parameters), this KV head, block id 0 */
    const int32_t *table; /* block ids of the sequence */
    int64_t bs, bstride;  /* positions per block; bytes from one block id to the next */
    int64_t n;            /* positions the sequence holds (prefetching stops there) */
    int64_t ring;         /* 0, or the ring's slots: position s in slot s % ring */
} kv_span;

static inline int64_t slot_of(int64_t ring, int64_t s) { return ring ? s % ring : s; }

/* the first row of the run that starts at position a; *end: where it stops (its block's
 * end or s1); *lim: the end of its block's rows (prefetching within the block stops there:
 * for a contiguous cache, the end of the head's slots, so a thread that goes on to the
 * next chunk finds it fetched) */
static inline const char *run_at(const kv_span *sp, int64_t rowb, int64_t a, int64_t s1,
                                 int64_t *end, const char **lim) {
    const int64_t t = slot_of(sp->ring, a), blk = t / sp->bs, e = a + (blk + 1) * sp->bs - t;
    const char *block = sp->base + (int64_t)sp->table[blk] * sp->bstride;
    *end = e < s1 ? e : s1;
    if (lim) *lim = block + sp->bs * rowb;
    return block + (t - blk * sp->bs) * rowb;
}

/* one row, wherever its block is (the scalar paths) */
static inline const char *row_at(const kv_span *sp, int64_t rowb, int64_t s) {
    const int64_t t = slot_of(sp->ring, s);
    return sp->base + (int64_t)sp->table[t / sp->bs] * sp->bstride + (t % sp->bs) * rowb;
}

#if KVLM_V512
/* Cache rows are fetched 8 KiB ahead of the row being read, into L2: without it the
 * attention reads and computes by turns (a 1024-position step took about the time of a
 * plain read of its K/V plus its compute in L2); with it the two overlap. The fused step
 * at 1024 positions, bf16 K/V: attention 1.46-1.55 -> 1.04-1.15 ms per token. (2 KiB
 * ahead into L1 gave nothing.) */
#define KV_AHEAD 8192
static inline __attribute__((always_inline)) void fetch_ahead(const char *row, int64_t bytes,
                                                               const char *lim) {
    if (lim - row < KV_AHEAD + bytes) return; /* past its block: fetch_run's work */
    for (int64_t j = 0; j < bytes; j += 64) _mm_prefetch(row + KV_AHEAD + j, _MM_HINT_T1);
}

/* A paged run (a block smaller than 8 KiB, whose rows fetch_ahead leaves alone) fetches
 * the block about 8 KiB further on in the sequence, whole; the first run of a chunk also
 * the ones before it. Nothing for a contiguous cache: its one run is all its rows. */
static inline __attribute__((always_inline)) void fetch_run(const kv_span *sp, int64_t rowb,
                                                            int64_t a, int64_t s0) {
    const int64_t bb = sp->bs * rowb, k = bb >= KV_AHEAD ? 1 : KV_AHEAD / bb;
    const int64_t t = slot_of(sp->ring, a), blk = t / sp->bs, bytes = bb < KV_AHEAD ? bb : KV_AHEAD;
    const int64_t blocks = sp->ring / sp->bs; /* a ring's wrap (0: none) */
    for (int64_t j = a == s0 ? 1 : k; j <= k && a - t % sp->bs + j * sp->bs < sp->n; j++) {
        const int64_t at = blocks && blk + j >= blocks ? (blk + j) % blocks : blk + j;
        const char *r = sp->base + (int64_t)sp->table[at] * sp->bstride;
        for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(r + i, _MM_HINT_T1);
    }
}

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

/* bf16 cache rows, 32 elements (one 64-byte load) at a time: a 32-bit word holds elements
 * 2i (low half) and 2i + 1 (high half), so the even elements are the words shifted left
 * by 16 and the odd ones the words with the low half cleared: two fp32 vectors in two
 * operations instead of six. Dot products take the query split the same way (qs2: per 32
 * elements, 16 even then 16 odd); p.V accumulates split and is interleaved back once per
 * chunk. The same products as the fp32 widening, summed in another order. One thread over
 * 2000 positions of 3 heads (in L2): 20.4-20.8 us before, 17.4-19.0 us with it. */
static inline void load_bf16_pairs(const char *row, int64_t i, __m512 *even, __m512 *odd) {
    __m512i w = _mm512_loadu_si512((const uint16_t *)row + i);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* the scores of J (4 or 1) rows from r for NG heads (see scores_rows) */
static inline __attribute__((always_inline)) void
scores_of_rows(const int NG, const int NV, const int PAIRS, const int J, const float *qs,
               const char *r, int64_t rowb, int dt, int64_t D, __m512 acc[8][4]) {
    for (int h = 0; h < NG; h++)
        for (int j = 0; j < J; j++) acc[h][j] = _mm512_setzero_ps();
    if (PAIRS) {
        for (int v = 0; v < NV / 2; v++) {
            __m512 e[4], o[4];
            for (int j = 0; j < J; j++) load_bf16_pairs(r + j * rowb, 32 * v, &e[j], &o[j]);
            for (int h = 0; h < NG; h++) {
                __m512 qe = _mm512_loadu_ps(qs + h * D + 32 * v);
                __m512 qo = _mm512_loadu_ps(qs + h * D + 32 * v + 16);
                for (int j = 0; j < J; j++)
                    acc[h][j] = _mm512_fmadd_ps(qo, o[j], _mm512_fmadd_ps(qe, e[j], acc[h][j]));
            }
        }
    } else {
        for (int v = 0; v < NV; v++) {
            __m512 k[4];
            for (int j = 0; j < J; j++) k[j] = kv_load(r + j * rowb, dt, 16 * v);
            for (int h = 0; h < NG; h++) {
                __m512 qv = _mm512_loadu_ps(qs + h * D + 16 * v);
                for (int j = 0; j < J; j++) acc[h][j] = _mm512_fmadd_ps(qv, k[j], acc[h][j]);
            }
        }
    }
}

/* p[h * S + s] = qs_h . K[s] for s in [s0, s1) (qs: the NG query heads, pre-scaled):
 * each K row widened once for all NG heads, four positions per reduction. NG, NV (D / 16)
 * and PAIRS constant where inlined, so the 4 * NG sums stay in registers. PAIRS: bf16 rows
 * read as even / odd halves (load_bf16_pairs) against queries split the same way. */
static inline __attribute__((always_inline)) void
scores_rows(const int NG, const int NV, const int PAIRS, const float *qs, const kv_span *K,
            int dt, int64_t esz, int64_t D, int64_t S, int64_t s0, int64_t s1, float *p) {
    const int64_t rowb = D * esz;
    __m512 acc[8][4];
    for (int64_t a = s0, end; a < s1; a = end) {
        const char *lim, *run = run_at(K, rowb, a, s1, &end, &lim);
        fetch_run(K, rowb, a, s0);
        int64_t s = a;
        for (; s + 4 <= end; s += 4) {
            const char *r = run + (s - a) * rowb;
            fetch_ahead(r, 4 * rowb, lim);
            scores_of_rows(NG, NV, PAIRS, 4, qs, r, rowb, dt, D, acc);
            for (int h = 0; h < NG; h++)
                _mm_storeu_ps(p + h * S + s, reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
        }
        for (; s < end; s++) {
            scores_of_rows(NG, NV, PAIRS, 1, qs, run + (s - a) * rowb, rowb, dt, D, acc);
            for (int h = 0; h < NG; h++) p[h * S + s] = _mm512_reduce_add_ps(acc[h][0]);
        }
    }
}

static void scores_dispatch(int ng, int nv, const float *qs, const kv_span *K, int dt,
                            int64_t esz, int64_t D, int64_t S, int64_t s0, int64_t s1,
                            float *p) {
#define SC_CASE(G_, V_)                                                                      \
    if (ng == G_ && nv == V_) {                                                              \
        scores_rows(G_, V_, 0, qs, K, dt, esz, D, S, s0, s1, p);                             \
        return;                                                                              \
    }
    SC_CASE(1, 4) SC_CASE(2, 4) SC_CASE(3, 4) SC_CASE(4, 4) SC_CASE(1, 8) SC_CASE(2, 8)
    SC_CASE(1, 16) SC_CASE(2, 16) SC_CASE(4, 16) SC_CASE(5, 4) SC_CASE(6, 4) SC_CASE(7, 4)
#undef SC_CASE
    /* more heads a KV head: in balanced passes over the rows (the later ones from L2); at
     * head_dim 64 up to 7 a pass (28 sums and 4 rows in the 32 zmm registers): Qwen2.5-0.5B's
     * 7 heads in one pass instead of 4 + 3, its decode +6% at 8k and 32k (the same sums:
     * docs/BENCHMARKS.md 19.12); head_dim 128, 6 (Qwen2.5-1.5B) in 3 + 3: no gain */
    const int most = nv == 4 ? 7 : nv == 8 ? 2 : 4;
    if (ng > most) {
        for (int h = 0, left = (ng + most - 1) / most; h < ng; left--) {
            const int n = (ng - h + left - 1) / left;
            scores_dispatch(n, nv, qs + h * D, K, dt, esz, D, S, s0, s1, p + h * S);
            h += n;
        }
        return;
    }
    for (int h = 0; h < ng; h++)
        scores_rows(1, nv, 0, qs + h * D, K, dt, esz, D, S, s0, s1, p + h * S);
}

/* the largest of p[0:n] (n >= 1) */
static inline float max_of(const float *p, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail_mask(n - i), p + i));
    return _mm512_reduce_max_ps(m);
}

/* o[h] = sum_s p[h * S + s] V[s] over [s0, s1) (+ bias[h] when given), each V row read
 * once for the NG heads; NG, NV (D / 16) and PAIRS constant where inlined, so the
 * accumulators stay in registers. PAIRS: bf16 rows taken as even / odd halves
 * (load_bf16_pairs), accumulated apart and interleaved back at the end. */
static inline __attribute__((always_inline)) void
pv_avx512(const int NG, const int NV, const int PAIRS, const float *p, const kv_span *V, int dt,
          int64_t esz, int64_t D, int64_t S, int64_t s0, int64_t s1, const float *bias,
          float *o, int64_t col) {
    const int64_t rowb = D * esz;
    __m512 acc[8][8];
    for (int h = 0; h < NG; h++)
        for (int v = 0; v < NV; v++) acc[h][v] = _mm512_setzero_ps();
    for (int64_t a = s0, e; a < s1; a = e) {
        const char *lim, *run = run_at(V, rowb, a, s1, &e, &lim);
        fetch_run(V, rowb, a, s0);
        for (int64_t s = a; s < e; s++) {
            const char *r = run + (s - a) * rowb + col * esz;
            fetch_ahead(r, rowb, lim);
            for (int v = 0; v < NV; v += 1 + PAIRS) {
                __m512 x[2];
                if (PAIRS)
                    load_bf16_pairs(r, 16 * v, &x[0], &x[1]);
                else
                    x[0] = kv_load(r, dt, 16 * v);
                for (int h = 0; h < NG; h++) {
                    const __m512 w = _mm512_set1_ps(p[h * S + s]);
                    for (int k = 0; k <= PAIRS; k++)
                        acc[h][v + k] = _mm512_fmadd_ps(w, x[k], acc[h][v + k]);
                }
            }
        }
    }
    for (int h = 0; h < NG; h++) {
        float *oh = o + h * D + col;
        for (int v = 0; v < NV; v += 1 + PAIRS) {
            if (!PAIRS) {
                _mm512_storeu_ps(oh + 16 * v, bias ? _mm512_add_ps(acc[h][v], _mm512_set1_ps(bias[h]))
                                                   : acc[h][v]);
                continue;
            }
            float even[16], odd[16];
            _mm512_storeu_ps(even, acc[h][v]);
            _mm512_storeu_ps(odd, acc[h][v + 1]);
            for (int j = 0; j < 16; j++) {
                oh[16 * v + 2 * j] = even[j];
                oh[16 * v + 2 * j + 1] = odd[j];
            }
        }
    }
}

/* head_dim 256 (Gemma 3) in two passes of 128 columns over the chunk's rows (just read: in
 * L1/L2). The heads of a KV head in passes whose accumulators stay in registers: up to 4
 * heads x 4 vectors (head_dim 64; 7 in one pass, as scores_dispatch now takes them, gained
 * nothing over 4 + 3: docs/BENCHMARKS.md 19.12), 3 x 8 from 128 columns (4 x 8 is all 32
 * zmm registers, and GCC spilled them; without the spills the speed did not move:
 * docs/BENCHMARKS.md 19.9), the passes balanced (6 = 3 + 3, 4 = 2 + 2) */
static void pv_dispatch(int ng, const float *p, const kv_span *V, int dt, int64_t esz,
                        int64_t D, int64_t S, int64_t s0, int64_t s1, float *o) {
    const int most = D >= 128 ? 3 : 4;
    if (ng > most) {
        const int passes = (ng + most - 1) / most;
        for (int h = 0, left = passes; h < ng; left--) {
            const int n = (ng - h + left - 1) / left;
            pv_dispatch(n, p + h * S, V, dt, esz, D, S, s0, s1, o + h * D);
            h += n;
        }
        return;
    }
    for (int64_t col = 0; col < D; col += 128) {
        const int nv = (int)((D - col < 128 ? D - col : 128) / 16);
#define PV_CASE(G_, V_)                                                                      \
        if (ng == G_ && nv == V_) {                                                          \
            pv_avx512(G_, V_, 0, p, V, dt, esz, D, S, s0, s1, NULL, o, col);                 \
            continue;                                                                        \
        }
        PV_CASE(1, 4) PV_CASE(2, 4) PV_CASE(3, 4) PV_CASE(4, 4) PV_CASE(1, 8) PV_CASE(2, 8)
        PV_CASE(3, 8)
#undef PV_CASE
        for (int h = 0; h < ng; h++)
            pv_avx512(1, nv, 0, p + h * S, V, dt, esz, D, S, s0, s1, NULL, o + h * D, col);
    }
}

#endif

/* The softmax pieces of a chunk's scores p[h * S + s], s in [s0, s1), of which the query
 * sees [v0, s1) (soft-capped first when cap > 0) (v0 > s0 only in a windowed row's first chunk, which starts at the multiple
 * of 16 below its first visible key, so that its runs group positions as every other
 * chunk's do): m[h], the most of the visible scores; l[h], the sum of their exp(p - m),
 * left in place; the hidden ones set to 0, so that p.V over [s0, s1) adds nothing for
 * them (0 * v, v a written row's finite value). */
static void softmax_pieces(int ng, float *p, int64_t S, int64_t s0, int64_t v0, int64_t s1,
                           float cap, float *m, float *l) {
    for (int h = 0; h < ng; h++) {
        float *ph = p + h * S;
        if (cap > 0.f) /* Gemma 2: cap tanh(s / cap), as attend_capped caps them */
            for (int64_t s = v0; s < s1; s++) ph[s] = tanhf(ph[s] / cap) * cap;
#if KVLM_V512
        m[h] = max_of(ph + v0, s1 - v0);
#else
        m[h] = -INFINITY;
        for (int64_t s = v0; s < s1; s++) m[h] = ph[s] > m[h] ? ph[s] : m[h];
#endif
        l[h] = exp_sum(ph + v0, s1 - v0, m[h]);
        for (int64_t s = s0; s < v0; s++) ph[s] = 0.f;
    }
}

#if KVLM_V512
/* scores, softmax pieces and p.V over a bf16 cache for NG <= 4 query heads and head_dim
 * 32 * NP (NP 2, 4 or 8: p.V of 256 in two passes of 128 columns, pv_dispatch's); 0 when
 * this shape has no case here (the caller widens per row) */
static int attend_bf16(int ng, int64_t D, const float *qs2, const kv_span *K, const kv_span *V,
                       int64_t S, int64_t s0, int64_t v0, int64_t s1, float cap, float *p,
                       float *m, float *l, float *o) {
#define BF_CASE(G_, P_)                                                                      \
    if (ng == G_ && D == 32 * P_) {                                                          \
        scores_rows(G_, 2 * P_, 1, qs2, K, 1, 2, D, S, s0, s1, p);                           \
        softmax_pieces(G_, p, S, s0, v0, s1, cap, m, l);                                     \
        for (int64_t col = 0; col < D; col += 128)                                           \
            pv_avx512(G_, 2 * (P_ < 4 ? P_ : 4), 1, p, V, 1, 2, D, S, s0, s1, NULL, o, col); \
        return 1;                                                                            \
    }
    BF_CASE(1, 2) BF_CASE(2, 2) BF_CASE(3, 2) BF_CASE(4, 2) BF_CASE(1, 4) BF_CASE(2, 4)
    BF_CASE(3, 4) BF_CASE(4, 4) BF_CASE(1, 8) BF_CASE(2, 8) BF_CASE(4, 8)
#undef BF_CASE
    return 0;
}
#endif

/* y = silu(g) * u = g / (1 + exp(-g)) * u */
static void silu_mul(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = 0;
#if KVLM_V512
    for (; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + i)));
    }
#endif
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* y = gelu_tanh(g) * u, GELU's tanh form 0.5 g (1 + tanh(c (g + 0.044715 g^3))), c =
 * sqrt(2 / pi), written as g / (1 + exp(-2 c (g + 0.044715 g^3))) (the same function:
 * 1 + tanh(t) = 2 / (1 + exp(-2t))), silu_mul's shape */
static void gelu_mul(const float *g, const float *u, float *y, int64_t n) {
    const float c2 = -2.0f * 0.7978845608028654f, k = 0.044715f;
    int64_t i = 0;
#if KVLM_V512
    for (; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(k), gv), _mm512_mul_ps(gv, gv), gv);
        __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(c2), t));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
#endif
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(c2 * (g[i] + k * g[i] * g[i] * g[i]))) * u[i];
}

/* Attention of the `ng` query heads of one KV head over the chunk [s0, s1), of which the
 * query sees [v0, s1) (softmax_pieces, scores soft-capped when cap > 0): unnormalised
 * output o (ng x D), running max m and sum l per head (combined across chunks later). */
/* The attention of ng query heads over rows [s0, s1) of one KV head, in three parts that
 * each K and V dtype supplies apart (--k-dtype, --v-dtype): K's scores into p (h * S + s,
 * the softmax scale in, before any cap; a part may leave [s0, v0) unwritten), their
 * softmax pieces (softmax_pieces: capped, max m, exps, their sum l; [s0, v0) zeroed), and
 * V's o = sum_s p_s V_s. A float K: scores over [s0, s1) as stored (rows in the vector
 * kernels), or per visible row. */
static void scores_float(const float *q, int ng, const kv_span *K, int dt, int64_t D,
                         int64_t S, int64_t s0, int64_t v0, int64_t s1, float scale, float *p) {
    const int64_t esz = dt == KV_F32 ? 4 : 2;
#if KVLM_V512
    if (D % 16 == 0 && D <= MAX_HEAD_DIM) {
        float qs[8 * MAX_HEAD_DIM]; /* the heads' queries times the softmax scale */
        for (int64_t i = 0; i < ng * D; i++) qs[i] = q[i] * scale;
        scores_dispatch(ng, (int)(D / 16), qs, K, dt, esz, D, S, s0, s1, p);
        return;
    }
#endif
    (void)s0;
    for (int h = 0; h < ng; h++)
        for (int64_t s = v0; s < s1; s++)
            p[h * S + s] = dot_kv(q + h * D, row_at(K, D * esz, s), dt, D) * scale;
}

/* o = sum_s p_s V_s for a float V */
static void pv_float(int ng, const float *p, const kv_span *V, int dt, int64_t D, int64_t S,
                     int64_t s0, int64_t v0, int64_t s1, float *o) {
    const int64_t esz = dt == KV_F32 ? 4 : 2;
#if KVLM_V512
    if (D % 16 == 0 && D <= MAX_HEAD_DIM) {
        pv_dispatch(ng, p, V, dt, esz, D, S, s0, s1, o);
        return;
    }
#endif
    (void)s0;
    for (int h = 0; h < ng; h++) {
        float *oh = o + h * D;
        memset(oh, 0, D * sizeof(float));
        for (int64_t s = v0; s < s1; s++) axpy_kv(p[h * S + s], row_at(V, D * esz, s), dt, oh, D);
    }
}

/* ---- int8 K/V (kvlm/cache/storage.py): a row is D codes c and fp16 (step, zero),
 * x ~ (c + 128) step + zero; K rows are stored rotated, k R (R orthonormal), so the
 * queries are rotated too: (q R).(k R) = q.k. Scores are integer dot products: each
 * query head (times the softmax scale, rotated) rounds to int8 with one scale sq (as
 * llama.cpp does for its q8_0 cache), and
 *   q.k ~ sq (step sum_i q8_i (c_i + 128) + zero sum_i q8_i),
 * exact integer sums (VNNI: 64 codes x 1 query per instruction, no widening). p.V widens
 * the codes: o = sum_s (p_s step_s) c_s + sum_s p_s (128 step_s + zero_s). */

/* storage.quantize of one row: codes[D] and params (step, zero), bit for bit */
static void quantize_kv_row(const float *x, int64_t D, int8_t *codes, uint16_t *params) {
    float lo = x[0], hi = x[0];
    for (int64_t i = 1; i < D; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    params[0] = to_f16((hi - lo) / 255.0f);
    params[1] = to_f16(lo);
    float step = from_f16(params[0]), zero = from_f16(params[1]);
    step = step < 0x1p-14f ? 0x1p-14f : step; /* fp16's smallest normal, as storage clamps */
    int64_t i = 0;
#if KVLM_V512
    const __m512 vz = _mm512_set1_ps(zero), vs = _mm512_set1_ps(step);
    for (; i + 16 <= D; i += 16) { /* the same IEEE division and half-to-even rounding */
        __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vz), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c = _mm512_min_ps(_mm512_max_ps(c, _mm512_setzero_ps()), _mm512_set1_ps(255.f));
        __m512i q = _mm512_cvtps_epi32(_mm512_sub_ps(c, _mm512_set1_ps(128.f)));
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(q));
    }
#endif
    for (; i < D; i++) {
        float c = rintf((x[i] - zero) / step);
        codes[i] = (int8_t)((c < 0.f ? 0.f : (c > 255.f ? 255.f : c)) - 128.f);
    }
}

static void rotate(const float *x, const float *R, int64_t D, float *y);

/* storage.quantize_q4 of one row: packed codes [D / 2] and scales [D / gs], bit for bit:
 * per group the value of largest magnitude m (the first of equal ones), d = fp16(m / -8),
 * codes round(x * (1 / d)) + 8 (nearest even) clamped to 0..15 (0 for every x when d = 0) */
static void quantize_q4_row(const float *x, int64_t D, uint8_t *codes, uint16_t *scales) {
    const int64_t gs = q4_group(D);
    for (int64_t g0 = 0; g0 < D; g0 += gs) {
        float m = x[g0], am = fabsf(x[g0]);
        for (int64_t i = g0 + 1; i < g0 + gs; i++)
            if (fabsf(x[i]) > am) am = fabsf(x[i]), m = x[i];
        const uint16_t h = to_f16(m / -8.0f);
        scales[g0 / gs] = h;
        const float d = from_f16(h), inv = d != 0.f ? 1.0f / d : 0.f;
        for (int64_t i = g0; i < g0 + gs; i += 2) {
            float c0 = rintf(x[i] * inv) + 8.f, c1 = rintf(x[i + 1] * inv) + 8.f;
            c0 = c0 < 0.f ? 0.f : (c0 > 15.f ? 15.f : c0);
            c1 = c1 < 0.f ? 0.f : (c1 > 15.f ? 15.f : c1);
            codes[i / 2] = (uint8_t)((int)c0 | ((int)c1 << 4));
        }
    }
}

/* one q4 row as floats: (c - 8) d */
static inline void dequant_q4_row(const uint8_t *codes, const uint16_t *scales, int64_t D,
                                  float *y) {
    const int64_t gs = q4_group(D);
    for (int64_t g0 = 0; g0 < D; g0 += gs) {
        const float d = from_f16(scales[g0 / gs]);
        for (int64_t i = g0; i < g0 + gs; i += 2) {
            const uint8_t c = codes[i / 2];
            y[i] = (float)((int)(c & 15) - 8) * d;
            y[i + 1] = (float)((int)(c >> 4) - 8) * d;
        }
    }
}


#if KVLM_V512
/* q4 V's o for NG <= 8 heads and D a multiple of 32: o = sum_s (p_s d_s) (c_s - 8), a
 * group (32 values) at a time over PV_ROWS rows (then the next rows), the heads' sums in
 * registers. The rows' weights w_s = p_s d_s of the group first (16 rows an operation);
 * with VNNI they are rounded to int16 on one scale (p <= 1, so the rows' largest |d| maps
 * to 32767: each weight within 2^-16 of that d, ~4,000 times finer than the 4-bit step of
 * the values it weighs) and two rows go into one vpdpwssd a head and 16 values, their
 * codes c - 8 as int16 (exact), the sums exact in int32 (256 rows of at most 8 x 32767
 * each); without VNNI a row at a time in fp32 FMAs, the codes looked up as c - 8.
 * Rows pair from v0 and PV_ROWS count from v0 whatever the layout's runs (a pair across two
 * runs finds its second row by row_at; an odd count's last row pairs with itself at weight
 * zero), so paged and contiguous pools give the same bits. */
#define PV_ROWS 256
#if defined(__AVX512VNNI__)
/* acc + x . the int16 pair at w, broadcast (vpdpwssd's embedded broadcast: as dpbusd_word,
 * one vector instruction fewer a product than GCC's set1 into a register) */
typedef int32_t __attribute__((may_alias)) pair_i16; /* two int16 read as one word */
static inline __attribute__((always_inline)) __m512i dpwssd_word(__m512i acc, __m512i x,
                                                                 const pair_i16 *w) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*w));
    return acc;
}
#endif
static inline __attribute__((always_inline)) void
pv_q4_v(const int NG, const float *p, const kv_span *Vs, const kv_span *Vps, int64_t D,
        int64_t S, int64_t v0, int64_t s1, float *o) {
    const int64_t rowb = D / 2, ns = D / 32, pb = 2 * ns;
    float d[PV_ROWS], dall[PV_ROWS * MAX_HEAD_DIM / 32];
    float acc[8 * MAX_HEAD_DIM]; /* head h, group g: its even values then its odd */
    memset(acc, 0, sizeof(float) * NG * D);
#if defined(__AVX512VNNI__)
    int16_t wq[8][PV_ROWS + 2]; /* a head's weights as int16, pairs (s, s + 1) from c0 */
    float wsc = 0.f;            /* and their scale (the group's, every head's) */
    const __m512i nib = _mm512_set1_epi32(0x000F000F), eight = _mm512_set1_epi16(8);
#else
    float w[8 * PV_ROWS];
    const __m512 k8 = _mm512_cvtepi32_ps(  /* c - 8 for c = 0 .. 15 */
        _mm512_setr_epi32(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m512i f = _mm512_set1_epi32(15);
#endif
    for (int64_t c0 = v0; c0 < s1; c0 += PV_ROWS) {
        const int64_t c1 = s1 - c0 < PV_ROWS ? s1 : c0 + PV_ROWS, n = c1 - c0;
        for (int64_t a0 = c0, e; a0 < c1; a0 = e) { /* the rows' scales, every group */
            const uint16_t *Vp = (const uint16_t *)run_at(Vps, pb, a0, c1, &e, NULL);
            const int64_t k = (e - a0) * ns;
            float *da = dall + (a0 - c0) * ns;
            int64_t i = 0;
            for (; i + 16 <= k; i += 16)
                _mm512_storeu_ps(da + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(Vp + i))));
            for (; i < k; i++) da[i] = from_f16(Vp[i]);
        }
        for (int64_t g = 0; g < ns; g++) {
            for (int64_t i = 0; i < n; i++) d[i] = dall[i * ns + g]; /* group g's */
#if defined(__AVX512VNNI__)
            { /* w = p d on the scale 32767 / max |d| (p <= 1: the softmax pieces' exps) */
                __m512 most = _mm512_setzero_ps();
                for (int64_t i = 0; i < n; i += 16) {
                    const __mmask16 m = tail_mask(n - i);
                    most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, d + i)));
                }
                const float big = _mm512_reduce_max_ps(most);
                const __m512 k = _mm512_set1_ps(big > 0.f ? 32767.f / big : 0.f);
                wsc = big / 32767.f;
                for (int64_t i = 0; i < n; i += 16) /* d's first n only */
                    _mm512_mask_storeu_ps(d + i, tail_mask(n - i),
                                          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask(n - i), d + i), k));
            }
            for (int h = 0; h < NG; h++) { /* saturating: nothing wraps */
                for (int64_t i = 0; i < n; i += 16) {
                    const __mmask16 m = tail_mask(n - i);
                    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + h * S + c0 + i),
                                                   _mm512_maskz_loadu_ps(m, d + i));
                    _mm256_mask_storeu_epi16(wq[h] + i, m, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
                }
                wq[h][n] = 0;
            }
            __m512i xe[8], xo[8];
            for (int h = 0; h < NG; h++) xe[h] = _mm512_setzero_si512(), xo[h] = _mm512_setzero_si512();
            for (int64_t a0 = c0, e; a0 < c1; a0 = e) {
                const char *lim;
                const uint8_t *V = (const uint8_t *)run_at(Vs, rowb, a0, c1, &e, &lim);
                if (g == 0) fetch_run(Vs, rowb, a0, c0);
                /* a run that starts inside a pair (an odd block size) already had its row */
                for (int64_t s = a0 + (a0 - c0) % 2; s < e; s += 2) {
                    const uint8_t *r0 = V + (s - a0) * rowb, *r1 = r0;
                    if (s + 1 < e) r1 = r0 + rowb;
                    else if (s + 1 < c1) r1 = (const uint8_t *)row_at(Vs, rowb, s + 1);
                    if (g == 0) fetch_ahead((const char *)r0, 2 * rowb, lim);
                    /* 32-bit lane j: byte j of the group in row s (low half), row s + 1 (high) */
                    const __m512i x = _mm512_or_si512(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r0 + 16 * g))),
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r1 + 16 * g))), 16));
                    const __m512i ce = _mm512_sub_epi16(_mm512_and_si512(x, nib), eight);
                    const __m512i co = _mm512_sub_epi16(_mm512_and_si512(_mm512_srli_epi32(x, 4), nib), eight);
                    for (int h = 0; h < NG; h++) { /* the pair's weights broadcast */
                        const pair_i16 *wp = (const pair_i16 *)(wq[h] + (s - c0));
                        xe[h] = dpwssd_word(xe[h], ce, wp);
                        xo[h] = dpwssd_word(xo[h], co, wp);
                    }
                }
            }
            for (int h = 0; h < NG; h++) { /* the int32 sums times their scale, into acc */
                const __m512 sc = _mm512_set1_ps(wsc);
                float *ah = acc + h * D + 32 * g;
                _mm512_storeu_ps(ah, _mm512_fmadd_ps(_mm512_cvtepi32_ps(xe[h]), sc, _mm512_loadu_ps(ah)));
                _mm512_storeu_ps(ah + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(xo[h]), sc, _mm512_loadu_ps(ah + 16)));
            }
#else
            __m512 ae[8], ao[8];
            for (int h = 0; h < NG; h++) {
                ae[h] = _mm512_loadu_ps(acc + h * D + 32 * g);
                ao[h] = _mm512_loadu_ps(acc + h * D + 32 * g + 16);
            }
            for (int h = 0; h < NG; h++)
                for (int64_t i = 0; i < n; i += 16) {
                    const __mmask16 m = tail_mask(n - i);
                    _mm512_mask_storeu_ps(w + h * PV_ROWS + i, m,
                                          _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + h * S + c0 + i),
                                                        _mm512_maskz_loadu_ps(m, d + i)));
                }
            for (int64_t a0 = c0, e; a0 < c1; a0 = e) {
                const char *lim;
                const uint8_t *V = (const uint8_t *)run_at(Vs, rowb, a0, c1, &e, &lim);
                if (g == 0) fetch_run(Vs, rowb, a0, c0);
                for (int64_t s = a0; s < e; s++) {
                    const uint8_t *r = V + (s - a0) * rowb;
                    if (g == 0) fetch_ahead((const char *)r, rowb, lim);
                    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r + 16 * g)));
                    const __m512 ce = _mm512_permutexvar_ps(_mm512_and_si512(x, f), k8);
                    const __m512 co = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), k8);
                    for (int h = 0; h < NG; h++) {
                        const __m512 wv = _mm512_set1_ps(w[h * PV_ROWS + (s - c0)]);
                        ae[h] = _mm512_fmadd_ps(wv, ce, ae[h]);
                        ao[h] = _mm512_fmadd_ps(wv, co, ao[h]);
                    }
                }
            }
            for (int h = 0; h < NG; h++) {
                _mm512_storeu_ps(acc + h * D + 32 * g, ae[h]);
                _mm512_storeu_ps(acc + h * D + 32 * g + 16, ao[h]);
            }
#endif
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int h = 0; h < NG; h++) /* even and odd values interleaved back */
        for (int64_t g = 0; g < ns; g++) {
            const __m512 ev = _mm512_loadu_ps(acc + h * D + 32 * g), od = _mm512_loadu_ps(acc + h * D + 32 * g + 16);
            _mm512_storeu_ps(o + h * D + 32 * g, _mm512_permutex2var_ps(ev, lo, od));
            _mm512_storeu_ps(o + h * D + 32 * g + 16, _mm512_permutex2var_ps(ev, hi, od));
        }
}
#endif

/* q4 V's o = sum_s p_s V_s over the visible rows [v0, s1) */
static void pv_q4(int ng, const float *p, const kv_span *V, const kv_span *Vp, int64_t D,
                  int64_t S, int64_t v0, int64_t s1, float *o) {
#if KVLM_V512
    if (D % 32 == 0 && D <= MAX_HEAD_DIM) { /* up to 8 heads a pass */
        for (int h = 0; h < ng; h += 8) {
            const float *ph = p + h * S;
            float *oh = o + h * D;
            switch (ng - h < 8 ? ng - h : 8) {
            case 1: pv_q4_v(1, ph, V, Vp, D, S, v0, s1, oh); break;
            case 2: pv_q4_v(2, ph, V, Vp, D, S, v0, s1, oh); break;
            case 3: pv_q4_v(3, ph, V, Vp, D, S, v0, s1, oh); break;
            case 4: pv_q4_v(4, ph, V, Vp, D, S, v0, s1, oh); break;
            case 5: pv_q4_v(5, ph, V, Vp, D, S, v0, s1, oh); break;
            case 6: pv_q4_v(6, ph, V, Vp, D, S, v0, s1, oh); break;
            case 7: pv_q4_v(7, ph, V, Vp, D, S, v0, s1, oh); break;
            default: pv_q4_v(8, ph, V, Vp, D, S, v0, s1, oh); break;
            }
        }
        return;
    }
#endif
    float row[MAX_HEAD_DIM];
    const int64_t rowb = D / 2, pb = kv_param_bytes(KV_Q4, D);
    for (int h = 0; h < ng; h++) memset(o + h * D, 0, D * sizeof(float));
    for (int64_t s = v0; s < s1; s++) {
        dequant_q4_row((const uint8_t *)row_at(V, rowb, s), (const uint16_t *)row_at(Vp, pb, s),
                       D, row);
        for (int h = 0; h < ng; h++) {
            const float w = p[h * S + s];
            for (int64_t i = 0; i < D; i++) o[h * D + i] += w * row[i];
        }
    }
}

/* The store's quantizers and the fp16 cache's conversions, exported for tests alone (no
 * caller in kvlm itself; tests/test_quant.py holds them to storage.py and torch bit for
 * bit), their buffers bounded as every entry point's: each with its length (xn floats,
 * cn bytes, ...), 0, or -2 with nothing read or written for sizes out of range or a buffer
 * shorter than they need. */

/* quantize_q4_row over `rows` rows of D (even, at least 2): x [rows, D] -> codes
 * [rows, D / 2] bytes and scales [rows, D / q4_group(D)] fp16 */
int kvlm_quantize_q4_rows(const float *x, int64_t xn, uint8_t *codes, int64_t cn,
                          uint16_t *scales, int64_t sn, int64_t rows, int64_t D) {
    int64_t need;
    if (rows < 0 || D < 2 || D % 2 || !mul_ok(rows, D, &need) || xn < need) return -2;
    if (cn < need / 2 || sn < rows * (D / q4_group(D))) return -2; /* each at most rows D */
    for (int64_t r = 0; r < rows; r++)
        quantize_q4_row(x + r * D, D, codes + r * D / 2, scales + r * (D / q4_group(D)));
    return 0;
}

/* quantize_kv_row over `rows` rows of D: x [rows, D] -> codes [rows, D] and params
 * [rows, 2] fp16 (step, zero) */
int kvlm_quantize_kv_rows(const float *x, int64_t xn, int8_t *codes, int64_t cn,
                          uint16_t *params, int64_t pn, int64_t rows, int64_t D) {
    int64_t need;
    if (rows < 0 || D < 1 || !mul_ok(rows, D, &need) || xn < need || cn < need) return -2;
    if (!mul_ok(rows, 2, &need) || pn < need) return -2;
    for (int64_t r = 0; r < rows; r++) quantize_kv_row(x + r * D, D, codes + r * D, params + 2 * r);
    return 0;
}

/* to_f16 of x[0:n] into h, and from_f16 of h back into y (the fp16 cache's conversions,
 * against torch's .to(float16) and .float()) */
int kvlm_f16_round_trip(const float *x, int64_t xn, uint16_t *h, int64_t hn, float *y,
                        int64_t yn, int64_t n) {
    if (n < 0 || xn < n || hn < n || yn < n) return -2;
    for (int64_t i = 0; i < n; i++) h[i] = to_f16(x[i]);
    for (int64_t i = 0; i < n; i++) y[i] = from_f16(h[i]);
    return 0;
}

/* y = x R (R: D x D, row-major) */
static void rotate(const float *x, const float *R, int64_t D, float *y) {
#if KVLM_V512
    if (D % 16 == 0 && D <= MAX_HEAD_DIM) { /* y in registers, one x[i] per row of R */
        __m512 acc[MAX_HEAD_DIM / 16];
        for (int64_t v = 0; v < D / 16; v++) acc[v] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i++) {
            const __m512 xi = _mm512_set1_ps(x[i]);
            for (int64_t v = 0; v < D / 16; v++)
                acc[v] = _mm512_fmadd_ps(xi, _mm512_loadu_ps(R + i * D + 16 * v), acc[v]);
        }
        for (int64_t v = 0; v < D / 16; v++) _mm512_storeu_ps(y + 16 * v, acc[v]);
        return;
    }
#endif
    for (int64_t j = 0; j < D; j++) y[j] = 0.f;
    for (int64_t i = 0; i < D; i++)
        for (int64_t j = 0; j < D; j++) y[j] += x[i] * R[i * D + j];
}

/* q8 (zero-padded to a multiple of 64) = x / sq rounded, sq = max|x| / 127; returns sq */
static float quantize_query(const float *x, int64_t D, int8_t *q8, int32_t *sum) {
    float amax = 0.f;
    for (int64_t i = 0; i < D; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float sq = amax / 127.f, inv = sq > 0.f ? 1.f / sq : 0.f;
    int32_t t = 0;
    for (int64_t i = 0; i < (D + 63) / 64 * 64; i++) {
        q8[i] = i < D ? (int8_t)rintf(x[i] * inv) : 0;
        t += q8[i];
    }
    *sum = t;
    return sq;
}

/* quantize_query per group of q4_group(D) values (a scale each, into sg[D / group]): the
 * queries a q4 K's scores take; codes past D zero up to the stride */
static void quantize_query_groups(const float *x, int64_t D, int8_t *q8, float *sg) {
    const int64_t gs = q4_group(D);
    for (int64_t g = 0; g < D / gs; g++) {
        float amax = 0.f;
        for (int64_t i = g * gs; i < (g + 1) * gs; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float sq = amax / 127.f, inv = sq > 0.f ? 1.f / sq : 0.f;
        for (int64_t i = g * gs; i < (g + 1) * gs; i++) q8[i] = (int8_t)rintf(x[i] * inv);
        sg[g] = sq;
    }
    for (int64_t i = D; i < (D + 63) / 64 * 64; i++) q8[i] = 0;
}

/* the int8 cache's compiled cases: 1-4 query heads per KV head x two widths */
#define FOR_I8_SHAPES(CASE, W1, W2)                                                          \
    CASE(1, W1) CASE(2, W1) CASE(3, W1) CASE(4, W1) CASE(1, W2) CASE(2, W2) CASE(3, W2) CASE(4, W2)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* integer lanes 0..3 = the sums of a, b, c, d */
static inline __m128i reduce4i(__m512i a, __m512i b, __m512i c, __m512i d) {
#define HALVES(v) _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
    __m256i ab = _mm256_hadd_epi32(HALVES(a), HALVES(b)), cd = _mm256_hadd_epi32(HALVES(c), HALVES(d));
#undef HALVES
    __m256i abcd = _mm256_hadd_epi32(ab, cd);
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

/* p[h * S + s] for NG heads, head_dim <= 64 NB (NB <= 4), four positions per reduction */
static inline __attribute__((always_inline)) void
scores_i8(const int NG, const int NB, const int8_t *q8, int64_t QS, const float *sq,
          const float *sumq, const kv_span *Ks, const kv_span *Kps, int64_t D, int64_t S,
          int64_t s0, int64_t s1, float *p) {
    const __mmask64 last = D == 64 * NB ? ~0ULL : (1ULL << (D - 64 * (NB - 1))) - 1;
    const __m512i flip = _mm512_set1_epi8((char)0x80); /* c + 128 as unsigned bytes */
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m512i qv[4][4];
    for (int h = 0; h < NG; h++)
        for (int b = 0; b < NB; b++) qv[h][b] = _mm512_loadu_si512(q8 + h * QS + 64 * b);
    for (int64_t a0 = s0, e; a0 < s1; a0 = e) {
    /* the run's rows and (step, zero) pairs, indexed from its first position a0 */
    const char *lim;
    const int8_t *K = (const int8_t *)run_at(Ks, D, a0, s1, &e, &lim);
    const uint16_t *Kp = (const uint16_t *)run_at(Kps, 4, a0, s1, &e, NULL);
    fetch_run(Ks, D, a0, s0);
    int64_t s = a0;
    for (; s + 4 <= e; s += 4) {
        const int8_t *r = K + (s - a0) * D;
        fetch_ahead((const char *)r, 4 * D, lim);
        __m512i a[4][4];
        for (int h = 0; h < NG; h++)
            for (int j = 0; j < 4; j++) a[h][j] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++)
            for (int b = 0; b < NB; b++) {
                __m512i k = b == NB - 1 ? _mm512_maskz_loadu_epi8(last, r + j * D + 64 * b)
                                        : _mm512_loadu_si512(r + j * D + 64 * b);
                k = _mm512_xor_si512(k, flip); /* masked-off bytes meet q8 = 0 */
                for (int h = 0; h < NG; h++) a[h][j] = _mm512_dpbusd_epi32(a[h][j], k, qv[h][b]);
            }
        /* (step, zero) of the 4 rows -> 4 steps | 4 zeros */
        __m256 sz = _mm256_permutevar8x32_ps(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(Kp + 2 * (s - a0)))), split);
        const __m128 st = _mm256_castps256_ps128(sz), ze = _mm256_extractf128_ps(sz, 1);
        for (int h = 0; h < NG; h++) {
            __m128 dot = _mm_cvtepi32_ps(reduce4i(a[h][0], a[h][1], a[h][2], a[h][3]));
            __m128 v = _mm_add_ps(_mm_mul_ps(st, dot), _mm_mul_ps(ze, _mm_set1_ps(sumq[h])));
            _mm_storeu_ps(p + h * S + s, _mm_mul_ps(_mm_set1_ps(sq[h]), v));
        }
    }
    for (; s < e; s++) {
        const float st = from_f16(Kp[2 * (s - a0)]), ze = from_f16(Kp[2 * (s - a0) + 1]);
        for (int h = 0; h < NG; h++) {
            int32_t dot = 0;
            for (int64_t i = 0; i < D; i++) dot += q8[h * QS + i] * (K[(s - a0) * D + i] + 128);
            p[h * S + s] = sq[h] * (st * (float)dot + ze * sumq[h]);
        }
    }
    }
}

static int scores_i8_dispatch(int ng, int64_t D, const int8_t *q8, int64_t QS, const float *sq,
                              const float *sumq, const kv_span *K, const kv_span *Kp,
                              int64_t S, int64_t s0, int64_t s1, float *p) {
    if (ng > 4) { /* Qwen2.5's 6 or 7 heads a KV head: 4 at a time (rows read again, in L1) */
        for (int h = 0; h < ng; h += 4)
            if (!scores_i8_dispatch(ng - h < 4 ? ng - h : 4, D, q8 + h * QS, QS, sq + h, sumq + h,
                                    K, Kp, S, s0, s1, p + h * S))
                return 0;
        return 1;
    }
#define I8_CASE(G_, B_)                                                                      \
    if (ng == G_ && (D + 63) / 64 == B_) return scores_i8(G_, B_, q8, QS, sq, sumq, K, Kp, D, S, s0, s1, p), 1;
    FOR_I8_SHAPES(I8_CASE, 1, 2)
    I8_CASE(1, 4) I8_CASE(2, 4) I8_CASE(4, 4) /* head_dim 256 */
#undef I8_CASE
    return 0;
}
#endif

/* ---- q4 K's scores on int8 queries: the queries (times the scale, rotated by R as K is)
 * rounded to int8 with a scale sq_g per group of K's (quantize_query_groups; llama.cpp
 * rounds its queries to q8_0 for a q4_0 K alike), so each group's dot product is an
 * integer one of the codes c in 0..15:
 *   q.k ~ sum_g sq_g d_g (sum_{i in g} q8_i c_i - 8 sum_{i in g} q8_i) */

#if KVLM_V512 && defined(__AVX512BW__)
/* a += the 4-byte lanes' sums of u8 x s8 products (VNNI's vpdpbusd, else its two-step
 * form: u8 <= 15 times s8 pairs stay far inside int16) */
static inline __m512i dot_u8s8(__m512i a, __m512i u, __m512i s8) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(a, u, s8);
#else
    return _mm512_add_epi32(a, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s8), _mm512_set1_epi16(1)));
#endif
}

/* bytes [32 b, 32 b + 32) of a q4 row (masked to the row) as 64 codes: the 32 low nibbles
 * (the even values 64 b + 2j) then the 32 high ones (the odd, 64 b + 2j + 1) */
static inline __m512i q4_codes(const uint8_t *row, int64_t b, __mmask32 m) {
    const __m256i x = _mm256_maskz_loadu_epi8(m, row + 32 * b), f = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(x, f), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), f);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* p[h * S + s] for NG heads over q4 rows of head_dim <= 64 NB (NB <= 4), four rows per
 * reduction: per 64 values one integer product per head (q4_codes' order, the queries
 * permuted to it once), less 8 times the lane's query sum, times each lane's group scale */
static inline __attribute__((always_inline)) void
scores_q4_v(const int NG, const int NB, const int8_t *q8, int64_t QS, const float *sg,
            const kv_span *Ks, const kv_span *Kps, int64_t D, int64_t S, int64_t s0, int64_t s1,
            float *p) {
    const int64_t rowb = D / 2, gs = q4_group(D), ns = D / gs, pb = 2 * ns;
    __m512i qv[4][4], off[4][4], lane_g[4];
    __m512 qs[4][4]; /* each lane's query scale */
    __mmask32 bytes[4];
    __mmask16 valid[4];
    for (int b = 0; b < NB; b++) {
        const int64_t left = rowb - 32 * b; /* the row's bytes in this piece */
        bytes[b] = left >= 32 ? ~0u : (1u << left) - 1;
        int32_t grp[16];
        valid[b] = 0;
        for (int L = 0; L < 16; L++) {
            const int64_t v = 64 * b + 8 * (L % 8); /* the lane's first value */
            grp[L] = v < D ? (int32_t)(v / gs) : 0;
            if (4 * (L % 8) < left) valid[b] |= (__mmask16)(1u << L);
        }
        lane_g[b] = _mm512_loadu_si512(grp);
        for (int h = 0; h < NG; h++) {
            int8_t t[64];
            for (int k = 0; k < 64; k++) {
                const int64_t v = 64 * b + 2 * (k % 32) + k / 32;
                t[k] = v < D ? q8[h * QS + v] : 0;
            }
            qv[h][b] = _mm512_loadu_si512(t);
            off[h][b] = dot_u8s8(_mm512_setzero_si512(), _mm512_set1_epi8(8), qv[h][b]);
            qs[h][b] = _mm512_permutexvar_ps(lane_g[b], _mm512_maskz_loadu_ps((__mmask16)((1u << ns) - 1), sg + h * Q4_QG));
        }
    }
    const __mmask8 sm = (__mmask8)((1u << ns) - 1);
    for (int64_t a0 = s0, e; a0 < s1; a0 = e) {
    const char *lim;
    const uint8_t *K = (const uint8_t *)run_at(Ks, rowb, a0, s1, &e, &lim);
    const uint16_t *Kp = (const uint16_t *)run_at(Kps, pb, a0, s1, &e, NULL);
    fetch_run(Ks, rowb, a0, s0);
    for (int64_t s = a0; s < e;) {
        const int R = e - s >= 4 ? 4 : 1;
        fetch_ahead((const char *)(K + (s - a0) * rowb), R * rowb, lim);
        __m512 acc[4][4];
        for (int j = 0; j < R; j++) {
            const uint8_t *r = K + (s - a0 + j) * rowb;
            const __m512 d = _mm512_cvtph_ps(_mm256_castsi128_si256(
                _mm_maskz_loadu_epi16(sm, Kp + (s - a0 + j) * ns)));
            for (int h = 0; h < NG; h++) acc[h][j] = _mm512_setzero_ps();
            for (int b = 0; b < NB; b++) {
                const __m512i c = q4_codes(r, b, bytes[b]);
                const __m512 db = _mm512_permutexvar_ps(lane_g[b], d);
                for (int h = 0; h < NG; h++) {
                    const __m512i x = _mm512_sub_epi32(dot_u8s8(_mm512_setzero_si512(), c, qv[h][b]), off[h][b]);
                    acc[h][j] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(x), _mm512_mul_ps(db, qs[h][b]),
                                                      acc[h][j], valid[b]);
                }
            }
        }
        for (int h = 0; h < NG; h++) {
            if (R == 4)
                _mm_storeu_ps(p + h * S + s, reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
            else /* a row alone summed as in a four (lane 0's tree): its bits whatever the
                    layout's runs (paged blocks, a ring's wrap) */
                p[h * S + s] = _mm_cvtss_f32(reduce4(acc[h][0], _mm512_setzero_ps(),
                                                     _mm512_setzero_ps(), _mm512_setzero_ps()));
        }
        s += R;
    }
    }
}
/* lane a of two vectors of 16 rows x 2 words (rows 0-7, then 8-15): row a's word u */
static const int32_t word_of_pairs[2][16] = {
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};

/* X[k] lane j = the 32-bit word k of row j, for 16 rows of `rowb` bytes from r (8 words
 * each from r: a 16 x 8 transpose of words in three rounds of two-source permutes, the
 * rows loaded whole instead of 8 gathers) */
static inline __attribute__((always_inline)) void words_t(const uint8_t *r, int64_t rowb,
                                                          __m512i *X) {
    static const int32_t i1[2][16] = { /* lane 4a + b: row a (of 4), word 4h + b */
        {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
        {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}};
    static const int32_t i2[2][16] = { /* lane 2a + b: row a (of 8), word 2t + b (of 4) */
        {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
        {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}};
    __m512i Z[8], A[4][2], B[2][2][2];
    for (int i = 0; i < 8; i++) /* rows 2i, 2i + 1: 8 words each */
        Z[i] = rowb == 32 ? _mm512_loadu_si512(r + 64 * i)
                          : _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r + 2 * i * rowb))),
                                               _mm256_loadu_si256((const __m256i *)(r + (2 * i + 1) * rowb)), 1);
    for (int h = 0; h < 2; h++) {
        const __m512i ix = _mm512_loadu_si512(i1[h]);
        for (int i = 0; i < 4; i++) A[i][h] = _mm512_permutex2var_epi32(Z[2 * i], ix, Z[2 * i + 1]);
    }
    for (int t = 0; t < 2; t++) {
        const __m512i ix = _mm512_loadu_si512(i2[t]);
        for (int j = 0; j < 2; j++)
            for (int h = 0; h < 2; h++) B[j][h][t] = _mm512_permutex2var_epi32(A[2 * j][h], ix, A[2 * j + 1][h]);
    }
    for (int u = 0; u < 2; u++) {
        const __m512i ix = _mm512_loadu_si512(word_of_pairs[u]);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 2; t++) X[4 * h + 2 * t + u] = _mm512_permutex2var_epi32(B[0][h][t], ix, B[1][h][t]);
    }
}

/* p[h * S + s] for NG heads over q4 rows of D = 8 NW values (groups of 32: NW a multiple of
 * 8), the rows in lanes: 16 rows at a time, word k of each row (its values 8k .. 8k + 7,
 * the even ones in the low nibbles) in one vector (words_t; gathered for a run's last
 * rows), its low and its high nibbles
 * one vpdpbusd each against the head's 4 query bytes of those values, broadcast; a group's
 * 4 words summed so in integers per row, less 8 times the group's query sum, times the rows'
 * group scales and the head's query scale. No horizontal sums: the 16 rows' scores come
 * out as one vector, each lane its own row's (a run's last rows are masked lanes), so
 * paged and contiguous pools agree. */
static inline __attribute__((always_inline)) void
scores_q4_t(const int NG, const int NW, const int8_t *q8, int64_t QS, const float *sg,
            const kv_span *Ks, const kv_span *Kps, int64_t D, int64_t S, int64_t s0, int64_t s1,
            float *p) {
    const int64_t rowb = D / 2, ns = D / 32, pb = 2 * ns;
    int32_t qe[8][MAX_HEAD_DIM / 8], qo[8][MAX_HEAD_DIM / 8], off[8][MAX_HEAD_DIM / 32];
    for (int h = 0; h < NG; h++) {
        const int8_t *q = q8 + h * QS;
        for (int k = 0; k < NW; k++) {
            uint8_t e[4], o[4];
            for (int j = 0; j < 4; j++) e[j] = (uint8_t)q[8 * k + 2 * j], o[j] = (uint8_t)q[8 * k + 2 * j + 1];
            memcpy(&qe[h][k], e, 4), memcpy(&qo[h][k], o, 4);
        }
        for (int g = 0; g < NW / 4; g++) {
            int32_t t = 0;
            for (int i = 32 * g; i < 32 * g + 32; i++) t += q[i];
            off[h][g] = 8 * t;
        }
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i words = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)(rowb / 4)));
    const __m512i pwords = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)(ns / 2)));
    const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F), half = _mm512_set1_epi32(0xFFFF);
    for (int64_t a0 = s0, e; a0 < s1; a0 = e) {
    const char *lim;
    const uint8_t *K = (const uint8_t *)run_at(Ks, rowb, a0, s1, &e, &lim);
    const uint16_t *Kp = (const uint16_t *)run_at(Kps, pb, a0, s1, &e, NULL);
    fetch_run(Ks, rowb, a0, s0);
    for (int64_t s = a0; s < e; s += 16) {
        const int R = e - s >= 16 ? 16 : (int)(e - s);
        const __mmask16 m = tail_mask(R);
        const uint8_t *r = K + (s - a0) * rowb;
        const uint16_t *pr = Kp + (s - a0) * ns;
        fetch_ahead((const char *)r, R * rowb, lim);
        __m512 acc[8];
        for (int h = 0; h < NG; h++) acc[h] = _mm512_setzero_ps();
        __m512 d = _mm512_setzero_ps(), dn = _mm512_setzero_ps();
        __m512i X[8]; /* words 8 (g / 2) .. + 7 of the 16 rows: lane j row j's */
        for (int g = 0; g < NW / 4; g++) {
            if (g % 2 == 0) { /* groups g and g + 1: one 32-bit word of each row's scales */
                __m512i w;
                if (R == 16 && ns == 2) /* the rows' scales are 16 words in a row */
                    w = _mm512_loadu_si512(pr);
                else if (R == 16 && ns == 4) /* 2 words a row: word g / 2 of each */
                    w = _mm512_permutex2var_epi32(_mm512_loadu_si512(pr), _mm512_loadu_si512(word_of_pairs[g / 2]),
                                                  _mm512_loadu_si512(pr + 32));
                else
                    w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m,
                                                    _mm512_add_epi32(pwords, _mm512_set1_epi32(g / 2)), pr, 4);
                d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(w, half)));
                dn = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
                if (R == 16)
                    words_t(r + 32 * (g / 2), rowb, X);
                else
                    for (int k = 0; k < 8; k++)
                        X[k] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m,
                                                           _mm512_add_epi32(words, _mm512_set1_epi32(4 * g + k)), r, 4);
            } else {
                d = dn;
            }
            __m512i x[8];
            for (int h = 0; h < NG; h++) x[h] = _mm512_setzero_si512();
            for (int k = 4 * g; k < 4 * g + 4; k++) {
                const __m512i w = X[k % 8];
                const __m512i lo = _mm512_and_si512(w, nib), hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), nib);
                for (int h = 0; h < NG; h++) {
                    x[h] = dot_u8s8(x[h], lo, _mm512_set1_epi32(qe[h][k]));
                    x[h] = dot_u8s8(x[h], hi, _mm512_set1_epi32(qo[h][k]));
                }
            }
            for (int h = 0; h < NG; h++) {
                const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(x[h], _mm512_set1_epi32(off[h][g])));
                acc[h] = _mm512_fmadd_ps(v, _mm512_mul_ps(d, _mm512_set1_ps(sg[h * Q4_QG + g])), acc[h]);
            }
        }
        for (int h = 0; h < NG; h++) _mm512_mask_storeu_ps(p + h * S + s, m, acc[h]);
    }
    }
}

#endif

/* q4 K's scores over the visible rows [v0, s1): q8 (QS bytes per head) and sg (Q4_QG
 * per head) from quantize_query_groups */
static void scores_q4(const int8_t *q8, int64_t QS, const float *sg, int ng, const kv_span *K,
                      const kv_span *Kp, int64_t D, int64_t S, int64_t v0, int64_t s1,
                      float *p) {
#if KVLM_V512 && defined(__AVX512BW__)
    const int nb = (int)((D + 63) / 64);
    if (D % 64 == 0 && D <= MAX_HEAD_DIM && nb != 3) { /* 64, 128, 256: up to 8 heads a pass */
        for (int h = 0; h < ng; h += 8) {
            const int n = ng - h < 8 ? ng - h : 8;
            const int8_t *qh = q8 + h * QS;
            float *ph = p + h * S;
#define Q4G_CASE(G_, B_)                                                                     \
            if (n == G_ && nb == B_) { scores_q4_t(G_, 8 * B_, qh, QS, sg + h * Q4_QG, K, Kp, D, S, v0, s1, ph); continue; }
#define Q4G_HEADS(B_) Q4G_CASE(1, B_) Q4G_CASE(2, B_) Q4G_CASE(3, B_) Q4G_CASE(4, B_) \
            Q4G_CASE(5, B_) Q4G_CASE(6, B_) Q4G_CASE(7, B_) Q4G_CASE(8, B_)
            Q4G_HEADS(1) Q4G_HEADS(2) Q4G_HEADS(4)
#undef Q4G_HEADS
#undef Q4G_CASE
        }
        return;
    }
    if (D <= MAX_HEAD_DIM && nb != 3 && nb <= 4) { /* the other widths up to 64, 128, 256 */
        for (int h = 0; h < ng; h += 4) { /* 4 heads at a time */
            const int n = ng - h < 4 ? ng - h : 4;
            const int8_t *qh = q8 + h * QS;
            float *ph = p + h * S;
#define Q4_CASE(G_, B_)                                                                      \
            if (n == G_ && nb == B_) { scores_q4_v(G_, B_, qh, QS, sg + h * Q4_QG, K, Kp, D, S, v0, s1, ph); continue; }
            FOR_I8_SHAPES(Q4_CASE, 1, 2)
            Q4_CASE(1, 4) Q4_CASE(2, 4) Q4_CASE(3, 4) Q4_CASE(4, 4)
#undef Q4_CASE
        }
        return;
    }
#endif
    const int64_t rowb = D / 2, gs = q4_group(D), ns = D / gs;
    for (int64_t s = v0; s < s1; s++) {
        const uint8_t *row = (const uint8_t *)row_at(K, rowb, s);
        const uint16_t *sc = (const uint16_t *)row_at(Kp, 2 * ns, s);
        for (int h = 0; h < ng; h++) {
            float acc = 0.f;
            for (int64_t g = 0; g < ns; g++) {
                int32_t dot = 0, sum = 0;
                for (int64_t i = g * gs; i < (g + 1) * gs; i += 2) {
                    const uint8_t c = row[i / 2];
                    const int32_t a = q8[h * QS + i], b = q8[h * QS + i + 1];
                    dot += a * (c & 15) + b * (c >> 4), sum += a + b;
                }
                acc += sg[h * Q4_QG + g] * from_f16(sc[g]) * (float)(dot - 8 * sum);
            }
            p[h * S + s] = acc;
        }
    }
}

#if KVLM_V512
/* head_dim 256 in two passes of 128 columns, as pv_dispatch */
static int pv_i8_dispatch(int ng, int64_t D, const float *w, const kv_span *V, int64_t S,
                          int64_t s0, int64_t s1, const float *bias, float *o) {
    if (ng > 4) { /* 4 heads at a time, as scores_i8_dispatch */
        for (int h = 0; h < ng; h += 4)
            if (!pv_i8_dispatch(ng - h < 4 ? ng - h : 4, D, w + h * S, V, S, s0, s1, bias + h,
                                o + h * D))
                return 0;
        return 1;
    }
    const int64_t cols = D == 256 ? 128 : D;
    int done = 1;
    for (int64_t col = 0; col < D && done; col += cols) {
        done = 0;
#define PV8_CASE(G_, V_) if (!done && ng == G_ && cols == 16 * V_) pv_avx512(G_, V_, 0, w, V, KV_I8, 1, D, S, s0, s1, bias, o, col), done = 1;
        FOR_I8_SHAPES(PV8_CASE, 4, 8)
#undef PV8_CASE
    }
    return done;
}
#endif

/* int8 K's scores over [s0, s1): q8 (QS bytes per head), sq and sumq from
 * quantize_query; Kp the rows' (step, zero) */
static void scores_i8_rows(const int8_t *q8, int64_t QS, const float *sq, const float *sumq,
                           int ng, const kv_span *K, const kv_span *Kp, int64_t D, int64_t S,
                           int64_t s0, int64_t s1, float *p) {
    int done = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    done = scores_i8_dispatch(ng, D, q8, QS, sq, sumq, K, Kp, S, s0, s1, p);
#endif
    for (int64_t s = s0; s < s1 && !done; s++) {
        const uint16_t *kp = (const uint16_t *)row_at(Kp, 4, s);
        const int8_t *k = (const int8_t *)row_at(K, D, s);
        const float st = from_f16(kp[0]), ze = from_f16(kp[1]);
        for (int h = 0; h < ng; h++) {
            int32_t dot = 0;
            for (int64_t i = 0; i < D; i++) dot += q8[h * QS + i] * (k[i] + 128);
            p[h * S + s] = sq[h] * (st * (float)dot + ze * sumq[h]);
        }
    }
}

/* int8 V's o = sum_s p_s V_s over [s0, s1) (p zero before v0; as stored): p_s step_s in
 * place, the zero points' share a bias per head; Vp the rows' (step, zero) */
static void pv_i8_rows(int ng, float *p, const kv_span *V, const kv_span *Vp, int64_t D,
                       int64_t S, int64_t s0, int64_t s1, float *o) {
    float bias[8];
    for (int h = 0; h < ng; h++) bias[h] = 0.f;
#if KVLM_V512
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    __m512 bacc[8];
    for (int h = 0; h < ng; h++) bacc[h] = _mm512_setzero_ps();
    /* vector parts first, 16 positions at a time from s0 (a multiple of 16), then the rows
     * left over: the same groups whatever the layout (a group across a block's end, or a
     * ring's wrap, gathered first), so a row's sums are alike paged and contiguous */
    for (int64_t s = s0; s + 16 <= s1; s += 16) { /* 16 rows' (step, zero): 32 halves */
        uint16_t gathered[32];
        int64_t e;
        const uint16_t *r = (const uint16_t *)run_at(Vp, 4, s, s1, &e, NULL);
        if (e < s + 16) {
            for (int64_t t = 0; t < 16; t++)
                memcpy(gathered + 2 * t, row_at(Vp, 4, s + t), 4);
            r = gathered;
        }
        __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
        __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 16)));
        __m512 st = _mm512_permutex2var_ps(lo, evens, hi);
        __m512 ze = _mm512_permutex2var_ps(lo, odds, hi);
        __m512 b = _mm512_fmadd_ps(_mm512_set1_ps(128.f), st, ze);
        for (int h = 0; h < ng; h++) {
            __m512 pv = _mm512_loadu_ps(p + h * S + s);
            bacc[h] = _mm512_fmadd_ps(pv, b, bacc[h]);
            _mm512_storeu_ps(p + h * S + s, _mm512_mul_ps(pv, st));
        }
    }
    for (int h = 0; h < ng; h++) bias[h] = _mm512_reduce_add_ps(bacc[h]);
    const int64_t rest = s0 + (s1 - s0) / 16 * 16; /* done above */
#else
    const int64_t rest = s0;
#endif
    for (int64_t s = rest; s < s1; s++) { /* p_s step_s in place; the zero points' share */
        const uint16_t *vp = (const uint16_t *)row_at(Vp, 4, s);
        const float st = from_f16(vp[0]), ze = from_f16(vp[1]);
        for (int h = 0; h < ng; h++) {
            bias[h] += p[h * S + s] * (128.f * st + ze);
            p[h * S + s] *= st;
        }
    }
#if KVLM_V512
    if (pv_i8_dispatch(ng, D, p, V, S, s0, s1, bias, o)) return;
#endif
    for (int h = 0; h < ng; h++) {
        for (int64_t i = 0; i < D; i++) o[h * D + i] = 0.f;
        for (int64_t s = s0; s < s1; s++) {
            const int8_t *v = (const int8_t *)row_at(V, D, s);
            for (int64_t i = 0; i < D; i++) o[h * D + i] += p[h * S + s] * (float)v[i];
        }
        for (int64_t i = 0; i < D; i++) o[h * D + i] += bias[h];
    }
}

static inline int64_t query_stride(int64_t D) { return (D + 63) / 64 * 64; } /* int8 bytes */

/* Whether w is an [n, k] product of 1..QMAT_PARTS parts whose rows add up to n, each of a
 * known kind, k whole blocks of it, and exactly the bytes n rows of k take */
static int qmat_ok(const kvlm_qmat *w, int64_t n, int64_t k) {
    if (w->n != n || w->k != k || n < 1 || k < 1 || w->parts < 1 || w->parts > QMAT_PARTS)
        return 0;
    int64_t rows = 0, need;
    for (int64_t p = 0; p < w->parts; p++) {
        const kvlm_qpart *P = w->part + p;
        if (!known_kind(P->kind) || !P->data || P->n < 1 || P->n > n) return 0;
        if (!packed_size((int)P->kind, P->n, k, &need) || P->bytes != need) return 0;
        rows += P->n;
    }
    return rows == n;
}

/* The model's sizes in range (each far past a real model's, short of overflowing the
 * scratch's size) and every product of the shape they give it: the step reads each
 * weight, norm and buffer by these sizes, so a weight of another shape is refused here,
 * not read past its end. 1 when so. */
static int model_ok(const kvlm_qmodel *m) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t I = m->inter;
    if (m->n_layers < 1 || H < 1 || H > (1 << 22) || I < 1 || I > (1 << 22)) return 0;
    if (D < 2 || D > MAX_HEAD_DIM || Hq < 1 || Hq > 4096 || Hkv < 1 || Hkv > Hq) return 0;
    if (m->slots < 1 || m->slots > ((int64_t)1 << 26) || !m->layers || !m->final_norm) return 0;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        if (!L->input_norm || !L->post_norm || !qmat_ok(&L->qkv, (Hq + 2 * Hkv) * D, H) ||
            !qmat_ok(&L->o, H, Hq * D) || !qmat_ok(&L->gate_up, 2 * I, H) || !qmat_ok(&L->down, H, I))
            return 0;
    }
    return qmat_ok(&m->lm_head, m->lm_head.n, H);
}

/* floats of scratch a step of B rows needs (bufs_of), the model's sizes in range */
static int64_t scratch_floats(const kvlm_qmodel *m, int64_t B) {
    const int64_t D = m->head_dim, Hq = m->n_heads;
    const int64_t row = 2 * m->hidden + (Hq + 2 * m->n_kv_heads) * D + Hq * D + 3 * m->inter +
                        Hq * m->slots + Hq * MAX_CHUNKS * (D + 2) + Hq * (query_stride(D) / 4 + 2) +
                        Hq * Q4_QG;
    return B * row + D;
}

/* floats of scratch a step of B rows needs; -2 when the model or B is out of range
 * (model_ok) */
int64_t kvlm_decode_scratch(const kvlm_qmodel *m, int64_t B) {
    if (B < 1 || B > MAX_BATCH || !model_ok(m)) return -2;
    return scratch_floats(m, B);
}

/* y [B, n] = x [B, k] . W^T, 16 rows per call (the small products' most); act: x in fp32
 * (0), rounded to int8 (1) or to 16 bits (2: int8 and a residual); 0 or -1 */
static int matmul_rows(const kvlm_qmat *w, const float *x, int64_t B, float *y, int act) {
    for (int64_t r = 0; r < B; r += SMALL_ROWS) {
        const int64_t M = B - r < SMALL_ROWS ? B - r : SMALL_ROWS;
        const float *xr = x + r * w->k;
        float *yr = y + r * w->n;
        const int64_t xn = (B - r) * w->k, yn = (B - r) * w->n; /* from xr, yr on */
        for (int64_t p = 0, col = 0; p < w->parts; col += w->part[p].n, p++) {
            const kvlm_qpart *P = w->part + p; /* its outputs: columns col .. col + n - 1 */
            if (act && kvlm_qgemm_i8(P->kind, xr, xn, M, w->k, P->data, P->bytes, P->n, yr + col,
                                     yn - col, w->n, act == 2) == 0)
                continue;
            if (kvlm_qgemm(P->kind, xr, xn, M, w->k, P->data, P->bytes, P->n, yr + col, yn - col,
                           w->n) != 0)
                return -1;
        }
    }
    return 0;
}

/* The position chunks of a row attending over n positions: the threads' work items per
 * KV head. A chunk starts at a multiple of 16, so the kernels' runs over a paged table
 * (16-slot blocks) and over a contiguous cache group the positions alike (same sums). */
static inline int64_t chunk_len(int64_t n) {
    const int64_t chunks = n < 64 ? 1 : (n / 64 < MAX_CHUNKS ? n / 64 : MAX_CHUNKS);
    return ((n + chunks - 1) / chunks + 15) / 16 * 16;
}

/* The keys the query at position p sees are [lo, p] (lo = p + 1 - window with a window
 * that excludes some, else 0: causal_mask's `q - k < window`). Its chunks cover [a0, p]
 * from a0, the multiple of 16 at or below lo, `per` positions each (a multiple of 16),
 * `chunks` of them: boundaries that depend on p alone (a row's logits do not depend on the
 * rows beside it) and fall on multiples of 16 (runs group positions alike over a contiguous
 * cache and a paged one). Positions [a0, lo) are read but weigh nothing (softmax_pieces). */
typedef struct {
    int64_t lo, a0, per, chunks;
} row_chunks;

static inline row_chunks chunks_of(int64_t p, int64_t window) {
    row_chunks r;
    const int64_t n = p + 1;
    r.lo = window > 0 && n > window ? n - window : 0;
    r.a0 = r.lo / 16 * 16;
    r.per = chunk_len(n - r.a0);
    r.chunks = (n - r.a0 + r.per - 1) / r.per;
    return r;
}

/* K or V of one layer as the step reads and writes them: rows (and their parameters) at
 * block id 0, the dtype, a row's and its parameters' bytes, block id / KV head strides */
typedef struct {
    char *c, *p;
    int dt;
    int64_t rowb, pb, bstride, head_bytes, pstride, phead;
} kv_half;

/* One layer's K/V as the step reads and writes them (its view's store at the layer's
 * index): K and V, the rows' tables, its window. */
typedef struct {
    kv_half k, v;
    const int32_t *tables;     /* [B, width] */
    int64_t width, bs, ring;   /* a view's geometry (kvlm_kv_view) */
    int64_t window;            /* 0: whole context */
} layer_kv;

static inline int kv_quantized(int64_t dt) { return dt == KV_I8 || dt == KV_Q4; }

static kv_half kv_half_of(int dt, int64_t D, int64_t Hkv, int64_t bs, char *c, char *p) {
    kv_half h;
    h.dt = dt, h.rowb = kv_row_bytes(dt, D), h.pb = kv_param_bytes(dt, D);
    h.bstride = Hkv * bs * h.rowb, h.head_bytes = bs * h.rowb;
    h.pstride = Hkv * bs * h.pb, h.phead = bs * h.pb;
    h.c = c, h.p = kv_quantized(dt) ? p : NULL;
    return h;
}

static layer_kv layer_kv_of(const kvlm_qmodel *m, const kvlm_qlayer *L, const kvlm_kv_view *views) {
    const kvlm_kv_view *V = views + L->view;
    const int64_t Hkv = m->n_kv_heads, bs = V->block_size, l = L->index, D = m->head_dim;
    layer_kv r;
    r.tables = V->tables, r.width = V->width, r.bs = bs, r.ring = V->ring;
    r.k = kv_half_of((int)m->k_dtype, D, Hkv, bs, (char *)V->k + l * V->k_layer,
                     (char *)V->kp + l * V->kp_layer);
    r.v = kv_half_of((int)m->v_dtype, D, Hkv, bs, (char *)V->v + l * V->v_layer,
                     (char *)V->vp + l * V->vp_layer);
    r.window = L->window < 0 ? m->window : L->window;
    return r;
}

/* Whether `layers` layers (layer_bytes apart) of `blocks` blocks of Hkv x bs rows of `row`
 * bytes, the furthest byte a block id below `blocks` and a layer index below `layers`
 * reach, (layers - 1) layer_bytes + blocks Hkv bs row, lie within a store's `bytes` (a
 * view with no layers: nothing is read or written through it) */
static int store_ok(int64_t layers, int64_t layer_bytes, int64_t blocks, int64_t Hkv,
                    int64_t bs, int64_t row, int64_t bytes) {
    int64_t block, need;
    if (layers == 0) return 1;
    return mul_ok(Hkv, bs, &block) && mul_ok(block, row, &block) &&
           extent_ok(layers, layer_bytes, blocks, block, block, &need) && bytes >= need;
}

/* -2 unless every layer's view holds every row's slots up to its position: the tables
 * [B, width] within their entries, each table entry the step reads within the view's
 * table width and pool, the pool's blocks of every layer within K's and V's bytes (and
 * their parameters'), a ring a whole number of blocks and at least the layer's window (the
 * keys a query sees are all still there) */
static int check_views(const kvlm_qmodel *m, int64_t B, const int64_t *pos,
                       const kvlm_kv_view *views, int64_t n_views) {
    const int64_t D = m->head_dim, Hkv = m->n_kv_heads;
    const int kdt = (int)m->k_dtype, vdt = (int)m->v_dtype;
    for (int64_t v = 0; v < n_views; v++) {
        const kvlm_kv_view *V = views + v;
        const int64_t bs = V->block_size, nb = V->num_blocks, L = V->layers;
        int64_t need;
        if (bs < 1 || nb < 1 || V->width < 1 || V->ring < 0 || V->ring % bs) return -2;
        if (!V->k || !V->v || !V->tables || L < 0) return -2;
        if ((kv_quantized(kdt) && !V->kp) || (kv_quantized(vdt) && !V->vp)) return -2;
        if (V->k_layer < 0 || V->v_layer < 0 || V->kp_layer < 0 || V->vp_layer < 0) return -2;
        if (!mul_ok(B, V->width, &need) || V->entries < need) return -2;
        if (!store_ok(L, V->k_layer, nb, Hkv, bs, kv_row_bytes(kdt, D), V->k_bytes) ||
            !store_ok(L, V->v_layer, nb, Hkv, bs, kv_row_bytes(vdt, D), V->v_bytes))
            return -2;
        if ((kv_quantized(kdt) &&
             !store_ok(L, V->kp_layer, nb, Hkv, bs, kv_param_bytes(kdt, D), V->kp_bytes)) ||
            (kv_quantized(vdt) &&
             !store_ok(L, V->vp_layer, nb, Hkv, bs, kv_param_bytes(vdt, D), V->vp_bytes)))
            return -2;
        for (int64_t b = 0; b < B; b++) {
            const int64_t last = V->ring && pos[b] >= V->ring ? V->ring - 1 : pos[b];
            if (last / bs >= V->width) return -2;
            for (int64_t j = 0; j <= last / bs; j++) {
                const int32_t id = V->tables[b * V->width + j];
                if (id < 0 || id >= V->num_blocks) return -2;
            }
        }
    }
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        const int64_t w = L->window < 0 ? m->window : L->window;
        if (L->view < 0 || L->view >= n_views || L->index < 0 || L->rope < 0 ||
            L->rope >= m->rope_tables)
            return -2;
        if (L->index >= views[L->view].layers) return -2;
        if (w < 0 || (views[L->view].ring && (w == 0 || w > views[L->view].ring))) return -2;
    }
    return 0;
}

/* One row x (head_dim values) into K or V's slot of block blk, KV head g, rounded to the
 * storage dtype as the torch path rounds it */
static void write_row(const kv_half *h, int64_t blk, int64_t g, int64_t slot, const float *x,
                      int64_t D) {
    char *d = h->c + blk * h->bstride + g * h->head_bytes + slot * h->rowb;
    uint16_t *pp = h->p ? (uint16_t *)(h->p + blk * h->pstride + g * h->phead + slot * h->pb) : NULL;
    if (h->dt == KV_Q4) {
        quantize_q4_row(x, D, (uint8_t *)d, pp);
    } else if (h->dt == KV_I8) {
        quantize_kv_row(x, D, (int8_t *)d, pp);
    } else if (h->dt == KV_BF16) {
        for (int64_t i = 0; i < D; i++) ((uint16_t *)d)[i] = to_bf16(x[i]);
    } else if (h->dt == KV_F16) { /* nearest even, as torch's .to(float16) */
        for (int64_t i = 0; i < D; i++) ((uint16_t *)d)[i] = to_f16(x[i]);
    } else {
        memcpy(d, x, D * sizeof(float));
    }
}

/* Row b's new K/V (k, v: head_dim each, KV head g) into its slot of the layer's store; a
 * quantized K through R first (stored as k R) */
static void write_kv(const kvlm_qmodel *m, const layer_kv *lk, int64_t b, int64_t p,
                     int64_t g, const float *k, const float *v, float *rot) {
    const int64_t D = m->head_dim, t = slot_of(lk->ring, p), slot = t % lk->bs;
    const int64_t blk = lk->tables[b * lk->width + t / lk->bs];
    if (kv_quantized(lk->k.dt)) {
        rotate(k, m->key_rot, D, rot);
        k = rot;
    }
    write_row(&lk->k, blk, g, slot, k, D);
    write_row(&lk->v, blk, g, slot, v, D);
}

/* The step's buffers in its scratch (kvlm_decode_scratch) */
typedef struct {
    float *h, *qkv, *att, *gu, *act, *tmp, *scores, *part, *qsc, *qsum, *qgs, *rot;
    int8_t *q8;
} step_bufs;

static step_bufs bufs_of(const kvlm_qmodel *m, int64_t B, float *scratch) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads, I = m->inter;
    step_bufs s;
    s.h = scratch;                                      /* B H */
    s.qkv = s.h + B * H;                                /* B (Hq + 2 Hkv) D */
    s.att = s.qkv + B * (Hq + 2 * m->n_kv_heads) * D;   /* B Hq D */
    s.gu = s.att + B * Hq * D;                          /* B 2 I */
    s.act = s.gu + B * 2 * I;                           /* B I */
    s.tmp = s.act + B * I;                              /* B H */
    s.scores = s.tmp + B * H;                           /* B Hq S */
    s.part = s.scores + B * Hq * m->slots;  /* per (row, head, chunk): o [D], max, sum */
    s.qsc = s.part + B * Hq * MAX_CHUNKS * (D + 2);     /* B Hq: the int8 queries' sq */
    s.qsum = s.qsc + B * Hq;                            /* B Hq: their code sums */
    s.qgs = s.qsum + B * Hq;   /* B Hq Q4_QG: a q4 K's queries' scale per group (q4_group) */
    s.rot = s.qgs + B * Hq * Q4_QG;                     /* D: a row times R (int8 cache) */
    s.q8 = (int8_t *)(s.rot + D);                       /* B Hq QS: the int8 queries */
    return s;
}

/* Each row's q|k|v after the product: the bias, the q/k norms, RoPE at the row's position
 * (the layer's table), K/V written into the row's slot, the queries rounded to int8 for an
 * int8 cache (scaled, rotated) */
static void prepare_rows(const kvlm_qmodel *m, const kvlm_qlayer *L, const layer_kv *lk,
                         int64_t B, const int64_t *pos, const float *cos, const float *sin,
                         const step_bufs *s) {
    const int64_t D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t QKV = (Hq + 2 * Hkv) * D, QS = query_stride(D);
    const float *c = cos + L->rope * m->slots * D, *sn = sin + L->rope * m->slots * D;
    for (int64_t b = 0; b < B; b++) {
        float *q = s->qkv + b * QKV;
        const int64_t p = pos[b];
        if (L->qkv_bias)
            for (int64_t i = 0; i < QKV; i++) q[i] += L->qkv_bias[i];
        if (L->q_norm) /* per head, before RoPE (Attention.forward) */
            for (int64_t j = 0; j < Hq + Hkv; j++)
                rms_norm(q + j * D, j < Hq ? L->q_norm : L->k_norm, D, m->eps, q + j * D);
        for (int64_t j = 0; j < Hq + Hkv; j++) rope(q + j * D, c + p * D, sn + p * D, D);
        for (int64_t g = 0; g < Hkv; g++)
            write_kv(m, lk, b, p, g, q + (Hq + g) * D, q + (Hq + Hkv + g) * D, s->rot);
        for (int64_t j = 0; j < Hq && kv_quantized(m->k_dtype); j++) {
            float qs[MAX_HEAD_DIM];
            for (int64_t i = 0; i < D; i++) qs[i] = q[j * D + i] * m->score_scale;
            rotate(qs, m->key_rot, D, s->rot);
            int32_t sum;
            int8_t *q8 = s->q8 + (b * Hq + j) * QS;
            if (m->k_dtype == KV_Q4) { /* a scale per group of K's, as llama.cpp's q8_0 query */
                quantize_query_groups(s->rot, D, q8, s->qgs + (b * Hq + j) * Q4_QG);
                continue;
            }
            s->qsc[b * Hq + j] = quantize_query(s->rot, D, q8, &sum);
            s->qsum[b * Hq + j] = (float)sum;
        }
    }
}

/* One work item of the attention: row b, KV head g, chunk c of the positions it sees: K's
 * scores in K's dtype, their softmax pieces, p.V in V's dtype (each its own) */
static void attend_item(const kvlm_qmodel *m, const layer_kv *lk, const step_bufs *s,
                        const int64_t *pos, int64_t b, int64_t g, int64_t c) {
    const int64_t D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads, S = m->slots;
    const int64_t group = Hq / Hkv, QS = query_stride(D), n = pos[b] + 1;
    const int kdt = lk->k.dt, vdt = lk->v.dt;
    const row_chunks rc = chunks_of(pos[b], lk->window);
    const int64_t s0 = rc.a0 + c * rc.per, s1 = s0 + rc.per < n ? s0 + rc.per : n;
    const int64_t v0 = s0 > rc.lo ? s0 : rc.lo; /* the first key the query sees */
    const int64_t hq = b * Hq + g * group;     /* the row's first query head of g */
    const int32_t *table = lk->tables + b * lk->width;
    float *pt = s->part + (hq * MAX_CHUNKS + c) * (D + 2);
    /* heads hq ..: o at pt + h*MAX_CHUNKS*(D+2), max/sum after it */
    float o[8 * MAX_HEAD_DIM], mh[8], lh[8], *p = s->scores + hq * S;
    const float *q = s->qkv + b * (Hq + 2 * Hkv) * D + g * group * D;
    const kv_span K = {lk->k.c + g * lk->k.head_bytes, table, lk->bs, lk->k.bstride, n, lk->ring};
    const kv_span V = {lk->v.c + g * lk->v.head_bytes, table, lk->bs, lk->v.bstride, n, lk->ring};
    const kv_span Kp = {lk->k.p + g * lk->k.phead, table, lk->bs, lk->k.pstride, n, lk->ring};
    const kv_span Vp = {lk->v.p + g * lk->v.phead, table, lk->bs, lk->v.pstride, n, lk->ring};
    int done = 0;
#if KVLM_V512
    if (kdt == KV_BF16 && vdt == KV_BF16 && D % 32 == 0 && D <= MAX_HEAD_DIM) {
        float qs2[8 * MAX_HEAD_DIM]; /* bf16 K and V: words split into halves, per 32: 16
                                        even elements, then 16 odd */
        for (int64_t i = 0; i < group * D; i++)
            qs2[i / 32 * 32 + (i % 2) * 16 + (i % 32) / 2] = q[i] * m->score_scale;
        done = attend_bf16((int)group, D, qs2, &K, &V, S, s0, v0, s1, m->attn_softcap, p, mh,
                           lh, o);
    }
#endif
    if (!done) {
        if (kdt == KV_Q4)
            scores_q4(s->q8 + hq * QS, QS, s->qgs + hq * Q4_QG, (int)group, &K, &Kp, D, S, v0, s1, p);
        else if (kdt == KV_I8)
            scores_i8_rows(s->q8 + hq * QS, QS, s->qsc + hq, s->qsum + hq, (int)group, &K, &Kp,
                           D, S, s0, s1, p);
        else
            scores_float(q, (int)group, &K, kdt, D, S, s0, v0, s1, m->score_scale, p);
        softmax_pieces((int)group, p, S, s0, v0, s1, m->attn_softcap, mh, lh);
        if (vdt == KV_Q4)
            pv_q4((int)group, p, &V, &Vp, D, S, v0, s1, o);
        else if (vdt == KV_I8)
            pv_i8_rows((int)group, p, &V, &Vp, D, S, s0, s1, o);
        else
            pv_float((int)group, p, &V, vdt, D, S, s0, v0, s1, o);
    }
    for (int64_t j = 0; j < group; j++) {
        float *dst = pt + j * MAX_CHUNKS * (D + 2);
        memcpy(dst, o + j * D, D * sizeof(float));
        dst[D] = mh[j];
        dst[D + 1] = lh[j];
    }
}

/* The layer's attention for every row into s->att: work items (row, KV head, chunk) across
 * the threads, then each head's chunks merged by log-sum-exp */
static void attend_layer(const kvlm_qmodel *m, const layer_kv *lk, const step_bufs *s,
                         int64_t B, const int64_t *pos) {
    const int64_t D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    int64_t first[MAX_BATCH + 1]; /* row b's work items start at first[b] */
    first[0] = 0;
    for (int64_t b = 0; b < B; b++)
        first[b + 1] = first[b] + Hkv * chunks_of(pos[b], lk->window).chunks;
#pragma omp parallel for schedule(static) /* a thread takes consecutive chunks of a head */
    for (int64_t item = 0; item < first[B]; item++) {
        int64_t b = 0, hi = B; /* the row holding this item: first[b] <= item < first[b+1] */
        while (hi - b > 1) {
            const int64_t mid = (b + hi) / 2;
            if (first[mid] <= item) b = mid; else hi = mid;
        }
        const int64_t chunks = chunks_of(pos[b], lk->window).chunks;
        attend_item(m, lk, s, pos, b, (item - first[b]) / chunks, (item - first[b]) % chunks);
    }
    for (int64_t b = 0; b < B; b++) { /* merge each head's chunks: log-sum-exp */
        const int64_t chunks = chunks_of(pos[b], lk->window).chunks;
        for (int64_t j = b * Hq; j < (b + 1) * Hq; j++) {
            const float *pj = s->part + j * MAX_CHUNKS * (D + 2);
            float M = -INFINITY, Lsum = 0.f, *out = s->att + j * D;
            for (int64_t c = 0; c < chunks; c++)
                M = pj[c * (D + 2) + D] > M ? pj[c * (D + 2) + D] : M;
            memset(out, 0, D * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const float *pc = pj + c * (D + 2);
                float w = expf(pc[D] - M);
                Lsum += w * pc[D + 1];
                axpy_kv(w, (const char *)pc, KV_F32, out, D);
            }
            for (int64_t i = 0; i < D; i++) out[i] /= Lsum;
        }
    }
}

/* x += y (B rows of n), y first normed by w where there is one (Gemma's sandwich norms) */
static void add_residual(float *x, float *y, const float *w, int64_t B, int64_t n, float eps) {
    for (int64_t b = 0; b < B && w; b++) rms_norm(y + b * n, w, n, eps, y + b * n);
    for (int64_t i = 0; i < B * n; i++) x[i] += y[i];
}

/* One decode step for B sequences, one token each (B = 1 with a contiguous cache is the
 * single-stream decode; more rows are the server's batch, every product reading its weight
 * once for up to 16 rows). Each buffer comes with its length (elements from its pointer
 * on), checked against what the step reads or writes there:
 *   x [B, hidden] (xn floats): the tokens' embeddings in (Gemma's scaled), overwritten;
 *   pos [B] (pn): each row's position (its token is written there; it attends over 0 ..
 *       pos, or over its last `window` positions: the layer's, or m->window);
 *   cos, sin [m->rope_tables, slots, head_dim] (cn, sn floats): RoPE at every position,
 *       the model's base then (Gemma 3) the local layers' (kvlm_qlayer.rope picks);
 *   views [n_views]: where the layers' K/V are (kvlm_kv_view, with its tables' entries
 *       and its stores' bytes; kvlm_qlayer.view, index);
 *   scratch: kvlm_decode_scratch(m, B) floats (scn); logits [B, vocab] out (ln floats).
 * Returns 0; -2 when an argument is out of range (a weight not of the shape the model's
 * sizes give it, a buffer shorter than its shape, a position past the slots or a table,
 * a block id past its pool, a pool past its store's bytes, a ring shorter than a layer's
 * window: nothing is written); -1 when a product found no scratch memory. */
/* kvlm_qmodel.act_int8, act_int16 */
enum { ACT_QKV = 1, ACT_O = 2, ACT_GATE_UP = 4, ACT_DOWN = 8, ACT_HEAD = 16 };

/* how product `bit` rounds x (matmul_rows' act) */
static inline int act_of(const kvlm_qmodel *m, int64_t bit) {
    return (m->act_int8 & bit) ? ((m->act_int16 & bit) ? 2 : 1) : 0;
}

int kvlm_decode_batch(const kvlm_qmodel *m, int64_t B, float *x, int64_t xn, const int64_t *pos,
                      int64_t pn, const float *cos, int64_t cn, const float *sin, int64_t sn,
                      const kvlm_kv_view *views, int64_t n_views, float *scratch, int64_t scn,
                      float *logits, int64_t ln) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t I = m->inter;
    int64_t need;
    if (B < 1 || B > MAX_BATCH || n_views < 1 || !views || !model_ok(m) || Hq % Hkv != 0)
        return -2;
    if (Hq / Hkv > 8 || D > MAX_HEAD_DIM || D % 2) return -2; /* the attention's buffers */
    if (m->window < 0 || m->k_dtype < KV_F32 || m->k_dtype > KV_Q4) return -2;
    if (m->v_dtype < KV_F32 || m->v_dtype > KV_Q4) return -2;
    if (kv_quantized(m->k_dtype) && !m->key_rot) return -2;
    /* the per-call buffers: x [B, hidden], pos [B], cos and sin [rope_tables, slots,
     * head_dim], the scratch, logits [B, vocab] */
    if (xn < B * H || pn < B || scn < scratch_floats(m, B)) return -2;
    if (!mul_ok(m->rope_tables, m->slots, &need) || !mul_ok(need, D, &need) || cn < need ||
        sn < need)
        return -2;
    if (!mul_ok(B, m->lm_head.n, &need) || ln < need) return -2;
    for (int64_t b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= m->slots) return -2;
    if (check_views(m, B, pos, views, n_views)) return -2;
    const step_bufs s = bufs_of(m, B, scratch);
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        const layer_kv lk = layer_kv_of(m, L, views);
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, L->input_norm, H, m->eps, s.h + b * H);
        if (matmul_rows(&L->qkv, s.h, B, s.qkv, act_of(m, ACT_QKV))) return -1;
        prepare_rows(m, L, &lk, B, pos, cos, sin, &s);
        attend_layer(m, &lk, &s, B, pos);
        if (matmul_rows(&L->o, s.att, B, s.tmp, act_of(m, ACT_O))) return -1;
        if (L->o_bias)
            for (int64_t i = 0; i < B * H; i++) s.tmp[i] += L->o_bias[i % H];
        add_residual(x, s.tmp, L->attn_out_norm, B, H, m->eps);
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, L->post_norm, H, m->eps, s.h + b * H);
        if (matmul_rows(&L->gate_up, s.h, B, s.gu, act_of(m, ACT_GATE_UP))) return -1;
        for (int64_t b = 0; b < B; b++)
            (m->gelu ? gelu_mul : silu_mul)(s.gu + b * 2 * I, s.gu + b * 2 * I + I, s.act + b * I, I);
        if (matmul_rows(&L->down, s.act, B, s.tmp, act_of(m, ACT_DOWN))) return -1;
        add_residual(x, s.tmp, L->mlp_out_norm, B, H, m->eps);
    }
    for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, m->final_norm, H, m->eps, s.h + b * H);
    return matmul_rows(&m->lm_head, s.h, B, logits, act_of(m, ACT_HEAD));
}

/* ------------------------------------------------------------------------------------
 * The prompt's elementwise SwiGLU and attention (torch's CPU ops for them ran at ~1 G
 * elements/s and ~90 GFLOPS: a third of a 0.5B model's 512-token prefill once its
 * products were integer ones).
 * ------------------------------------------------------------------------------------ */

/* out [M, I] = silu(gu[:, :I]) * gu[:, I:], gu [M, 2I] (the fused gate|up product; gn
 * floats) into out (on floats); silu_mul's numbers, a row at a time. Returns 0, or -2,
 * nothing read or written, when M or I is under 1 or a buffer is shorter than its shape. */
int kvlm_silu_mul(const float *gu, int64_t gn, int64_t M, int64_t I, float *out, int64_t on) {
    int64_t need;
    if (M < 1 || I < 1 || !mul_ok(M, I, &need) || on < need) return -2;
    if (!mul_ok(need, 2, &need) || gn < need) return -2;
#pragma omp parallel for schedule(static) if (M * I > 65536)
    for (int64_t m = 0; m < M; m++) silu_mul(gu + m * 2 * I, gu + m * 2 * I + I, out + m * I, I);
    return 0;
}

/* RMSNorm of one row in place or not: y = x * r * w, r = 1 / sqrt(mean(x^2) + eps) (the
 * products in torch's order, (x r) w); the squares summed in 16 lanes, the lanes then
 * added in a fixed order: a row's bits depend on its n values only. */
static void rms_norm_row(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.f;
    int64_t i = 0;
#if KVLM_V512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    i = 0;
#if KVLM_V512
    const __m512 rv = _mm512_set1_ps(r);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv),
                                              _mm512_loadu_ps(w + i)));
#endif
    for (; i < n; i++) y[i] = x[i] * r * w[i];
}

/* y [M, N] (row stride ys >= N; yn floats from y on) = RMSNorm of x [M, N] (row stride
 * xs; xn floats) by w (wn floats: -2 unless N); y may be x. Returns 0, or -2, nothing
 * read or written, for M < 0, N < 1, a stride negative (or ys < N), or a buffer shorter
 * than its rows at their stride ((M - 1) xs + N floats of x, ...). */
int kvlm_rms_norm(const float *x, int64_t xn, int64_t M, int64_t N, int64_t xs,
                  const float *w, int64_t wn, double eps, float *y, int64_t yn, int64_t ys) {
    int64_t need;
    if (M < 0 || N < 1 || wn != N || ys < N) return -2; /* w: wn floats, one per column */
    if (M > 0 && (!extent_ok(1, 0, M, xs, N, &need) || xn < need)) return -2;
    if (M > 0 && (!extent_ok(1, 0, M, ys, N, &need) || yn < need)) return -2;
#pragma omp parallel for schedule(static) if (M * N > 65536)
    for (int64_t m = 0; m < M; m++) rms_norm_row(x + m * xs, w, N, (float)eps, y + m * ys);
    return 0;
}

/* The rotate-half RoPE of one head in place, as apply_rope computes it: the two products
 * rounded, then added (x cos + rotate_half(x) sin; no fused multiply-add), so the bits are
 * torch's. */
static void rope_row(float *v, const float *cos, const float *sin, int64_t d) {
    const int64_t h = d / 2;
    int64_t i = 0;
#if KVLM_V512
    for (; i < h; i += 16) {
        const __mmask16 k = tail_mask(h - i);
        const __m512 a = _mm512_maskz_loadu_ps(k, v + i), b = _mm512_maskz_loadu_ps(k, v + h + i);
        const __m512 lo = _mm512_add_ps(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, cos + i)),
                                        _mm512_mul_ps(negate(b), _mm512_maskz_loadu_ps(k, sin + i)));
        const __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(k, cos + h + i)),
                                        _mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, sin + h + i)));
        _mm512_mask_storeu_ps(v + i, k, lo);
        _mm512_mask_storeu_ps(v + h + i, k, hi);
    }
#endif
    for (; i < h; i++) {
        const float a = v[i], b = v[i + h];
        const float lo = a * cos[i], lo2 = -b * sin[i];
        const float hi = b * cos[i + h], hi2 = a * sin[i + h];
        v[i] = lo + lo2;
        v[i + h] = hi + hi2;
    }
}

/* The query and key heads of M rows of a q|k|v product (row stride rs: nq query heads,
 * then nk key heads, of D each; qkvn floats from qkv on), in place: each head's RMSNorm
 * (qn for query heads, kn for key heads; none when qn is NULL, Qwen3's before RoPE), then
 * RoPE at the row's cos and sin (row stride cs, D each; cn and sn floats; none when cos is
 * NULL). A row's result is its own. Returns 0, or -2, nothing read or written, for sizes
 * out of range (D odd or under 2, no heads, rs < (nq + nk) D, a stride negative), norm
 * weights of another length than D, or a buffer shorter than its rows at their stride
 * ((M - 1) rs + (nq + nk) D floats of qkv, (M - 1) cs + D of cos and of sin). */
int kvlm_qk_norm_rope(float *qkv, int64_t qkvn, int64_t M, int64_t rs, int64_t nq, int64_t nk,
                      int64_t D, const float *qn, const float *kn, int64_t nn, double eps,
                      const float *cos, int64_t cn, const float *sin, int64_t sn, int64_t cs) {
    int64_t heads, row, need;
    if (M < 0 || D < 2 || D % 2 || (qn && !kn) || (cos && !sin)) return -2;
    if (!add_ok(nq, nk, &heads) || !mul_ok(heads, D, &row) || rs < row) return -2;
    if (qn && nn != D) return -2; /* qn, kn: nn floats each, one per element of a head */
    if (M > 0 && (!extent_ok(1, 0, M, rs, row, &need) || qkvn < need)) return -2;
    if (M > 0 && cos && (!extent_ok(1, 0, M, cs, D, &need) || cn < need || sn < need))
        return -2;
#pragma omp parallel for schedule(static) if (M * (nq + nk) * D > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < nq + nk; j++) {
            float *head = qkv + m * rs + j * D;
            if (qn) rms_norm_row(head, j < nq ? qn : kn, D, (float)eps, head);
            if (cos) rope_row(head, cos + m * cs, sin + m * cs, D);
        }
    return 0;
}

#if KVLM_V512
/* a vector kept in a register: GCC otherwise folds a load shared by R products into each
 * of them (R loads where one does; the loops were load-bound) */
#if KVLM_V512 == 256
#define IN_REG(x) __asm__("" : "+x"((x).lo), "+x"((x).hi))
#else
#define IN_REG(x) __asm__("" : "+v"(x))
#endif

/* Which of the keys j0 .. j0 + 16 NK - 1 rows t0 .. t0 + R - 1 see (valid[r][h]: the
 * 16 keys of vector h for row r): those before S, before the row when `causal`, and with
 * a nonzero mask byte when `mask` is given. Returns whether any row sees any of them. */
static inline __attribute__((always_inline)) int
block_seen(const int R, const int NK, int64_t j0, int64_t t0, int64_t S, int causal,
           const uint8_t *mask, int64_t mst, __mmask16 valid[4][4]) {
    int any = 0;
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) {
            const int64_t at = j0 + 16 * h;
            __mmask16 ok = at < S ? tail_mask(S - at) : (__mmask16)0;
            if (causal) {
                const int64_t seen = t0 + r + 1 - at;
                ok &= seen > 0 ? tail_mask(seen) : (__mmask16)0;
            }
            if (mask && ok) {
                const __m128i b = _mm_maskz_loadu_epi8(ok, mask + (t0 + r) * mst + at);
                ok &= _mm_test_epi8_mask(b, b);
            }
            valid[r][h] = ok;
            any |= ok;
        }
    }
    return any;
}

/* One row's online softmax over a block of its scores s[0 .. NK - 1] (16 keys each, before
 * the scale): the running max *m and sum *l updated, e[h] = exp(scale s - max) for the
 * keys it sees and 0 for the rest; returns the factor the row's outputs so far take
 * (exp(old max - new max)), or -1, touching nothing, when it sees none of the block's keys
 * (they weigh nothing). */
static inline __attribute__((always_inline)) float
block_softmax(const int NK, const __m512 *s, const __mmask16 *valid, float scale, float *m,
              float *l, __m512 *e) {
    int seen = 0;
    _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) seen |= valid[h];
    if (!seen) return -1.f;
    const __m512 sc = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-INFINITY);
    __m512 mx = lo;
    _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) {
        e[h] = _mm512_mul_ps(s[h], sc);
        mx = _mm512_max_ps(mx, _mm512_mask_mov_ps(lo, valid[h], e[h]));
    }
    const float mb = _mm512_reduce_max_ps(mx);
    const float mn = mb > *m ? mb : *m;
    const float alpha = expf(*m - mn); /* 0 at the first block (m = -inf) */
    const __m512 mv = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) {
        e[h] = _mm512_maskz_mov_ps(valid[h], exp512(_mm512_sub_ps(e[h], mv)));
        sum = _mm512_add_ps(sum, e[h]);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = mn;
    return alpha;
}

/* Rows t0 .. t0 + R - 1 of query head `q` (row stride qst) over the keys 0 .. S - 1 of
 * its KV head, keys in blocks of 16 NK (NK vectors of scores per row: a K vector feeds R
 * products, a query element NK): K transposed per block and zero-padded (kt [S / 16 NK][D]
 * [16 NK]: a block's floats in one run, read in order; a transposed [D][S] put each d's
 * row 2 KiB apart at S = 512, all in two L1 sets), V rows (stride vst). A row's running
 * max and sum are updated per block it sees any key of (online softmax), its blocks in
 * order: a row's result depends on its own query, the keys it sees and nothing else (not
 * R, not T, not the keys past those it sees: a block it sees none of is skipped, a key it
 * does not see weighs exactly 0), so a prompt gets the same bits chunked or whole.
 * DV = D / 16; R, NK, DV literals where inlined (scores and outputs stay in registers). */
static inline __attribute__((always_inline)) void
attend_prompt_rows(const int R, const int NK, const int DV, const float *q, int64_t qst,
                   int64_t t0, const float *kt, const float *v, int64_t vst, int64_t S,
                   const uint8_t *mask, int64_t mst, int causal, float scale, float *out,
                   int64_t ost) {
    const int KB = 16 * NK;
    __m512 O[4][16];
    float m[4], l[4];
    float p[4][64] __attribute__((aligned(64)));
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++) O[r][dv] = _mm512_setzero_ps();
    }
    const int64_t D = 16 * (int64_t)DV;
    const int64_t end = causal && t0 + R < S ? t0 + R : S; /* top-left: row t sees 0 .. t */
    for (int64_t j0 = 0; j0 < end; j0 += KB) {
        __mmask16 valid[4][4];
        if (!block_seen(R, NK, j0, t0, S, causal, mask, mst, valid)) continue;
        __m512 s[4][4];
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) s[r][h] = _mm512_setzero_ps();
        const float *kb = kt + j0 * D; /* block j0 / KB */
        for (int64_t d = 0; d < D; d++) {
            __m512 kv[4];
            _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) {
                kv[h] = _mm512_load_ps(kb + d * KB + 16 * h);
                IN_REG(kv[h]);
            }
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
                const __m512 qd = _mm512_set1_ps(q[r * qst + d]);
                _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++)
                    s[r][h] = _mm512_fmadd_ps(qd, kv[h], s[r][h]);
            }
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            __m512 e[4];
            const float alpha = block_softmax(NK, s[r], valid[r], scale, &m[r], &l[r], e);
            _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) /* unseen: weighs nothing */
                _mm512_store_ps(p[r] + 16 * h, alpha < 0.f ? _mm512_setzero_ps() : e[h]);
            if (alpha < 0.f) continue;
            const __m512 a = _mm512_set1_ps(alpha);
            _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++) O[r][dv] = _mm512_mul_ps(O[r][dv], a);
        }
        const int64_t jn = S - j0 < KB ? S - j0 : KB;
        for (int64_t j = 0; j < jn; j++) {
            const float *vj = v + (j0 + j) * vst;
            __m512 pj[4];
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) pj[r] = _mm512_set1_ps(p[r][j]);
            _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++) {
                __m512 vv = _mm512_loadu_ps(vj + 16 * dv);
                IN_REG(vv);
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
                    O[r][dv] = _mm512_fmadd_ps(pj[r], vv, O[r][dv]);
            }
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f); /* no key: 0 */
        _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++)
            _mm512_storeu_ps(out + (t0 + r) * ost + 16 * dv, _mm512_mul_ps(O[r][dv], inv));
    }
}
#endif

#if defined(__AVX512BF16__) && KVLM_V512 == 512
#define KVLM_ATTEND_BF16 1
/* attend_prompt_rows with q, K, V and the weights p rounded to bf16 and multiplied in
 * pairs (vdpbf16ps: two products a lane, summed in fp32; half the instructions of the fp32
 * FMAs), the scores, the softmax and the sums in fp32 as before. K is transposed in pairs
 * (kt [S / 16 NK][D / 2][16 NK][2]: a vector is 16 keys' values at d and d + 1), V in
 * pairs of keys (vp [S / 2][D][2]: a vector is 16 d's of keys j and j + 1, zero past S),
 * each row's query rounded to bf16 pairs here. A row's result depends on its own query and
 * the keys it sees alone, as in the fp32 kernel (an unseen key weighs exactly 0). */
static inline __attribute__((always_inline)) void
attend_prompt_rows_bf16(const int R, const int NK, const int DV, const float *q, int64_t qst,
                        int64_t t0, const uint16_t *kt, const uint16_t *vp, int64_t S,
                        const uint8_t *mask, int64_t mst, int causal, float scale, float *out,
                        int64_t ost) {
    const int KB = 16 * NK;
    __m512 O[4][16];
    float m[4], l[4];
    uint32_t qp[4][128] __attribute__((aligned(64))); /* the query's bf16 pairs */
    uint32_t pp[4][32] __attribute__((aligned(64)));  /* a block's weights, bf16 pairs */
    const int64_t D = 16 * (int64_t)DV;
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++) O[r][dv] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32) {
            const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + r * qst + d + 16),
                                                   _mm512_loadu_ps(q + r * qst + d));
            _mm512_store_si512((void *)(qp[r] + d / 2), (__m512i)b);
        }
    }
    const int64_t end = causal && t0 + R < S ? t0 + R : S; /* top-left: row t sees 0 .. t */
    for (int64_t j0 = 0; j0 < end; j0 += KB) {
        __mmask16 valid[4][4];
        if (!block_seen(R, NK, j0, t0, S, causal, mask, mst, valid)) continue;
        __m512 s[4][4];
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) s[r][h] = _mm512_setzero_ps();
        const uint16_t *kb = kt + j0 * D; /* block j0 / KB */
        for (int64_t dp = 0; dp < D / 2; dp++) {
            __m512i kv[4];
            _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++) {
                kv[h] = _mm512_load_si512((const void *)(kb + (dp * KB + 16 * h) * 2));
                __asm__("" : "+v"(kv[h]));
            }
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
                const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)qp[r][dp]);
                _Pragma("GCC unroll 16") for (int h = 0; h < NK; h++)
                    s[r][h] = _mm512_dpbf16_ps(s[r][h], (__m512bh)kv[h], qd);
            }
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            __m512 e[4];
            const float alpha = block_softmax(NK, s[r], valid[r], scale, &m[r], &l[r], e);
            _Pragma("GCC unroll 16") for (int h = 0; h < NK; h += 2) /* unseen: weighs nothing */
                _mm512_store_si512((void *)(pp[r] + 8 * h),
                                   alpha < 0.f ? _mm512_setzero_si512()
                                               : (__m512i)_mm512_cvtne2ps_pbh(e[h + 1], e[h]));
            if (alpha < 0.f) continue;
            const __m512 a = _mm512_set1_ps(alpha);
            _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++) O[r][dv] = _mm512_mul_ps(O[r][dv], a);
        }
        const int64_t jn = S - j0 < KB ? S - j0 : KB;
        const uint16_t *vb = vp + j0 * D; /* key pair j0 / 2 */
        for (int64_t jp = 0; jp < (jn + 1) / 2; jp++) {
            __m512bh pj[4];
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
                pj[r] = (__m512bh)_mm512_set1_epi32((int)pp[r][jp]);
            _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++) {
                __m512i vv = _mm512_load_si512((const void *)(vb + (jp * D + 16 * dv) * 2));
                __asm__("" : "+v"(vv));
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
                    O[r][dv] = _mm512_dpbf16_ps(O[r][dv], (__m512bh)vv, pj[r]);
            }
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f); /* no key: 0 */
        _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; dv++)
            _mm512_storeu_ps(out + (t0 + r) * ost + 16 * dv, _mm512_mul_ps(O[r][dv], inv));
    }
}

/* a float rounded to bf16, to nearest even (a NaN stays a NaN) */
static inline uint16_t bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif

/* Attention of a prompt's T queries (one sequence): q [H][T][D] (strides qsh, qst; d
 * contiguous) over k, v [Hkv][S][D] (strides ksh, kst, vsh, vst), query head h reading KV
 * head h / (H / Hkv); softmax(scale q.k) v. Which keys row t sees: those with
 * mask[t * mst + s] != 0 (a bool [T, S] tensor) when mask is given, else 0 .. t when
 * `causal` (the top-left triangle, SDPA's is_causal), else all. out [T][H][D] contiguous.
 * Rows from `bf16_from` on (0: all; T or more: none): q, k, v and the softmax's weights
 * rounded to bf16, multiplied in pairs (vdpbf16ps), scores, softmax and sums in fp32
 * (attend_prompt_rows_bf16; AVX512-BF16 only); the rows before it in fp32
 * (attend_prompt_rows). Either way a row's bits depend on its own query and the keys it
 * sees alone. qn, kn, vn, mn, on: the elements of q, k, v, mask and out from each pointer
 * on. Returns 0; -1 when scratch memory cannot be had; -2, touching nothing, for sizes
 * that disagree (attend_ok); -3, touching nothing, for a shape it does not take (D not a
 * multiple of 16 or over 256 (bf16 rows: not 64 or 128), no AVX-512 (bf16 rows: no
 * AVX512-BF16): the caller uses torch's SDPA). */
static int attend_prompt_bf16(const float *q, int64_t H, int64_t T, int64_t D, int64_t qsh,
                       int64_t qst, const float *k, const float *v, int64_t Hkv, int64_t S,
                       int64_t ksh, int64_t kst, int64_t vsh, int64_t vst, const uint8_t *mask,
                       int64_t mst, int64_t causal, double scale, float *out, int64_t r0);
static int attend_prompt_f32(const float *q, int64_t H, int64_t D, int64_t qsh,
                       int64_t qst, const float *k, const float *v, int64_t Hkv, int64_t S,
                       int64_t ksh, int64_t kst, int64_t vsh, int64_t vst, const uint8_t *mask,
                       int64_t mst, int64_t causal, double scale, float *out, int64_t r1);

/* the keys rows before r1 can read: a causal call's rows see none past their own, but the
 * kernels read whole blocks of KB = 16 NK <= 64 keys up to a row group's end (t0 + R <=
 * r1 + 3, R <= 4), so up to r1 + 3 rounded up to a block: within r1 + 64 rounded up */
static inline int64_t keys_read(int64_t S, int64_t causal, int64_t r1) {
    return causal && r1 + 64 < S ? r1 + 64 : S;
}

#if !KVLM_V512
/* kvlm_attend on a CPU without the vector code (the scalar build: no AVX2, or not x86):
 * each row's scores, max, sum and p.V over its keys in key order, so a row's bits are its
 * own whichever chunk it comes in (torch's SDPA, the fallback before, split a chunk's rows
 * and keys by its shape). Row t sees key j < S when j <= t if `causal`, and where mask[t
 * mst + j] is nonzero if `mask` is given. A row that sees no key is 0. */
static int attend_prompt_scalar(const float *q, int64_t H, int64_t T, int64_t D, int64_t qsh,
                                int64_t qst, const float *k, const float *v, int64_t Hkv,
                                int64_t S, int64_t ksh, int64_t kst, int64_t vsh, int64_t vst,
                                const uint8_t *mask, int64_t mst, int64_t causal, double scale,
                                float *out) {
    const int64_t group = H / Hkv;
    int failed = 0;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < H * T; task++) {
        const int64_t h = task / T, t = task % T;
        const float *qr = q + h * qsh + t * qst;
        const float *kg = k + (h / group) * ksh, *vg = v + (h / group) * vsh;
        float *sr = malloc((size_t)S * sizeof(float)), *o = out + t * H * D + h * D;
        if (!sr) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float mx = -INFINITY;
        for (int64_t j = 0; j < S; j++) {
            sr[j] = -INFINITY;
            if ((causal && j > t) || (mask && !mask[t * mst + j])) continue;
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += qr[d] * kg[j * kst + d];
            sr[j] = dot * (float)scale;
            if (sr[j] > mx) mx = sr[j];
        }
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        float sum = 0.f;
        for (int64_t j = 0; j < S && mx > -INFINITY; j++) {
            if (sr[j] == -INFINITY) continue;
            const float e = expf(sr[j] - mx);
            sum += e;
            for (int64_t d = 0; d < D; d++) o[d] += e * vg[j * vst + d];
        }
        if (sum > 0.f)
            for (int64_t d = 0; d < D; d++) o[d] /= sum;
        free(sr);
    }
    return failed ? -1 : 0;
}
#endif

/* Whether kvlm_attend's sizes agree: H, T, D, Hkv, S >= 1, H a multiple of Hkv, strides
 * not negative, and within each buffer's count the furthest element the call may touch
 * (every build reads keys 0 .. S - 1 at most): q (H - 1) qsh + (T - 1) qst + D, k and v
 * (Hkv - 1) sh + (S - 1) st + D, mask (T - 1) mst + S, out T H D. */
static int attend_ok(int64_t qn, int64_t H, int64_t T, int64_t D, int64_t qsh, int64_t qst,
                     int64_t kn, int64_t vn, int64_t Hkv, int64_t S, int64_t ksh, int64_t kst,
                     int64_t vsh, int64_t vst, const uint8_t *mask, int64_t mn, int64_t mst,
                     int64_t on) {
    int64_t need, rows;
    if (H < 1 || Hkv < 1 || H % Hkv) return 0;
    if (!extent_ok(H, qsh, T, qst, D, &need) || qn < need) return 0;
    if (!extent_ok(Hkv, ksh, S, kst, D, &need) || kn < need) return 0;
    if (!extent_ok(Hkv, vsh, S, vst, D, &need) || vn < need) return 0;
    if (mask && (!extent_ok(1, 0, T, mst, S, &need) || mn < need)) return 0;
    return mul_ok(T, H, &rows) && mul_ok(rows, D, &need) && on >= need;
}

int kvlm_attend(const float *q, int64_t qn, int64_t H, int64_t T, int64_t D, int64_t qsh,
                int64_t qst, const float *k, int64_t kn, const float *v, int64_t vn, int64_t Hkv,
                int64_t S, int64_t ksh, int64_t kst, int64_t vsh, int64_t vst,
                const uint8_t *mask, int64_t mn, int64_t mst, int64_t causal, double scale,
                float *out, int64_t on, int64_t bf16_from) {
    if (!attend_ok(qn, H, T, D, qsh, qst, kn, vn, Hkv, S, ksh, kst, vsh, vst, mask, mn, mst, on))
        return -2;
    const int64_t b = bf16_from < 0 ? 0 : bf16_from > T ? T : bf16_from;
#if !defined(KVLM_ATTEND_BF16)
    if (b < T) return -3;
#endif
    if (b < T && D != 64 && D != 128) return -3;
#if !KVLM_V512
    if (b > 0) /* the scalar build: every row in fp32, one key after another */
        return attend_prompt_scalar(q, H, T, D, qsh, qst, k, v, Hkv, S, ksh, kst, vsh, vst,
                                    mask, mst, causal, scale, out);
#endif
    if (b > 0 && (D % 16 || D > 256)) return -3;
    int rc = 0;
    if (b < T) /* the longest rows first */
        rc = attend_prompt_bf16(q, H, T, D, qsh, qst, k, v, Hkv, S, ksh, kst, vsh, vst, mask,
                                mst, causal, scale, out, b);
    if (rc == 0 && b > 0)
        rc = attend_prompt_f32(q, H, D, qsh, qst, k, v, Hkv, S, ksh, kst, vsh, vst, mask,
                               mst, causal, scale, out, b);
    return rc;
}

/* kvlm_attend's fp32 rows 0 .. r1 - 1 */
static int attend_prompt_f32(const float *q, int64_t H, int64_t D, int64_t qsh,
                       int64_t qst, const float *k, const float *v, int64_t Hkv, int64_t S,
                       int64_t ksh, int64_t kst, int64_t vsh, int64_t vst, const uint8_t *mask,
                       int64_t mst, int64_t causal, double scale, float *out, int64_t r1) {
#if !KVLM_V512
    (void)q, (void)H, (void)D, (void)qsh, (void)qst, (void)k, (void)v, (void)Hkv;
    (void)S, (void)ksh, (void)kst, (void)vsh, (void)vst, (void)mask, (void)mst, (void)causal;
    (void)scale, (void)out, (void)r1;
    return -3;
#else
    /* rows per pass and key vectors per block: D = 64 4 x 2, D = 128 2 x 4, else 1 x 2 */
    const int R = D == 64 ? 4 : D == 128 ? 2 : 1, NK = D == 128 ? 4 : 2, KB = 16 * NK;
    const int64_t Sn = keys_read(S, causal, r1), Sp = (Sn + KB - 1) / KB * KB, group = H / Hkv;
    float *kt = aligned_alloc(64, (size_t)(Hkv * D * Sp) * sizeof(float));
    if (!kt) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < Hkv; g++) { /* kt[g][s / KB][d][s % KB] = k[g][s][d], 0 past S */
        float *kg = kt + g * D * Sp;
        for (int64_t s0 = 0; s0 < Sp; s0 += KB)
            for (int64_t s = s0; s < s0 + KB; s++)
                for (int64_t d = 0; d < D; d++)
                    kg[s0 * D + d * KB + (s - s0)] = s < Sn ? k[g * ksh + s * kst + d] : 0.f;
    }
    const int64_t nqb = (r1 + R - 1) / R;
    const float sc = (float)scale;
    /* a head's row groups one after another, the last (most keys) first: the threads
     * share one head's K and V while they last in cache (8 KV heads of 512 x 128 keys
     * and values are 4 MiB: taken head after head, each task read its own from L3) */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * nqb; task++) {
        const int64_t h = task / nqb, t0 = (nqb - 1 - task % nqb) * R;
        const int rows = r1 - t0 < R ? (int)(r1 - t0) : R;
        const float *qh = q + h * qsh + t0 * qst, *kg = kt + (h / group) * D * Sp;
        const float *vg = v + (h / group) * vsh;
        float *oh = out + h * D;
#define ATTEND_ROWS(RR, NKK, DVV) \
    attend_prompt_rows(RR, NKK, DVV, qh, qst, t0, kg, vg, vst, S, mask, mst, (int)causal, sc, oh, H * D)
        if (D == 64) {
            switch (rows) {
            case 1: ATTEND_ROWS(1, 2, 4); break;
            case 2: ATTEND_ROWS(2, 2, 4); break;
            case 3: ATTEND_ROWS(3, 2, 4); break;
            default: ATTEND_ROWS(4, 2, 4);
            }
        } else if (D == 128) {
            if (rows == 1) ATTEND_ROWS(1, 4, 8);
            else ATTEND_ROWS(2, 4, 8);
        } else {
            for (int r = 0; r < rows; r++)
                attend_prompt_rows(1, 2, (int)(D / 16), qh + r * qst, qst, t0 + r, kg, vg, vst,
                                   S, mask, mst, (int)causal, sc, oh, H * D);
        }
#undef ATTEND_ROWS
    }
    free(kt);
    return 0;
#endif
}

/* kvlm_attend's bf16 road: its own scratch and task loop (one function serving both
 * dtypes, the kernel's choice inside the task loop, ran the fp32 road 1.5x slower on a Zen
 * 4: 12.4 -> 18.2 ms at 1,024 x 1,024, its row kernel's code unchanged) */
static int attend_prompt_bf16(const float *q, int64_t H, int64_t T, int64_t D, int64_t qsh,
                       int64_t qst, const float *k, const float *v, int64_t Hkv, int64_t S,
                       int64_t ksh, int64_t kst, int64_t vsh, int64_t vst, const uint8_t *mask,
                       int64_t mst, int64_t causal, double scale, float *out, int64_t r0) {
#if !defined(KVLM_ATTEND_BF16)
    (void)q, (void)H, (void)T, (void)D, (void)qsh, (void)qst, (void)k, (void)v, (void)Hkv;
    (void)S, (void)ksh, (void)kst, (void)vsh, (void)vst, (void)mask, (void)mst, (void)causal;
    (void)scale, (void)out, (void)r0;
    return -3;
#else
    /* rows per pass and key vectors per block as the fp32 kernel's */
    const int R = D == 64 ? 4 : 2, NK = D == 64 ? 2 : 4, KB = 16 * NK;
    const int64_t Sp = (S + KB - 1) / KB * KB, group = H / Hkv;
    uint16_t *kt = aligned_alloc(64, (size_t)(2 * Hkv * D * Sp) * sizeof(uint16_t));
    if (!kt) return -1;
    uint16_t *vp = kt + Hkv * D * Sp;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < Hkv; g++) {
        /* kt[g][s / KB][d / 2][s % KB][d % 2] = k[g][s][d]; vp[g][s / 2][d][s % 2] = v[g][s][d];
         * 0 past S */
        uint16_t *kg = kt + g * D * Sp, *vg = vp + g * D * Sp;
        for (int64_t s = 0; s < Sp; s++) {
            const int64_t s0 = s / KB * KB;
            for (int64_t d = 0; d < D; d++) {
                kg[s0 * D + ((d / 2) * KB + (s - s0)) * 2 + d % 2] =
                    s < S ? bf16_round(k[g * ksh + s * kst + d]) : 0;
                vg[((s / 2) * D + d) * 2 + s % 2] = s < S ? bf16_round(v[g * vsh + s * vst + d]) : 0;
            }
        }
    }
    const int64_t nqb = (T - r0 + R - 1) / R; /* rows r0 .. T - 1 */
    const float sc = (float)scale;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * nqb; task++) {
        const int64_t h = task / nqb, t0 = r0 + (nqb - 1 - task % nqb) * R;
        const int rows = T - t0 < R ? (int)(T - t0) : R;
        const float *qh = q + h * qsh + t0 * qst;
        const uint16_t *kg = kt + (h / group) * D * Sp, *vg = vp + (h / group) * D * Sp;
        float *oh = out + h * D;
#define ATTEND_ROWS(RR, NKK, DVV) \
    attend_prompt_rows_bf16(RR, NKK, DVV, qh, qst, t0, kg, vg, S, mask, mst, (int)causal, sc, oh, H * D)
        if (D == 64) {
            switch (rows) {
            case 1: ATTEND_ROWS(1, 2, 4); break;
            case 2: ATTEND_ROWS(2, 2, 4); break;
            case 3: ATTEND_ROWS(3, 2, 4); break;
            default: ATTEND_ROWS(4, 2, 4);
            }
        } else if (rows == 1) ATTEND_ROWS(1, 4, 8);
        else ATTEND_ROWS(2, 4, 8);
#undef ATTEND_ROWS
    }
    free(kt);
    return 0;
#endif
}
