/* Low-bit weight products for kvlm: y[M, N] = x[M, K] . dequant(W)[N, K]^T, x and y fp32
 * (part of qgemm.c's one translation unit: the weight formats, their products, dequantization
 * and packing).
 *
 * Weights come in groups of 32 along K, llama.cpp's block size, with fp16 parameters:
 *   q8:   int8 codes q, scale s per group:      w = s * q                 (GGUF Q8_0)
 *   q4:   4-bit codes, (d, m) per group:        w = d * q + m             (Q4_1)
 *   q4_0: 4-bit codes, d per group:             w = d * (q - 8)           (Q4_0)
 *   q5_0: 5-bit codes, d per group:             w = d * (q - 16)          (Q5_0)
 *   q5_1: 5-bit codes, (d, m) per group:        w = d * q + m             (Q5_1)
 *   mxfp4: 4-bit E2M1 codes, an E8M0 e per group: w = h(e) * kv[q]        (MXFP4)
 *         kv = (0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12), E2M1's values doubled, and
 *         h(e) = 2^(e - 128), their half-scale (ggml's e8m0_to_fp32_half: an exact power
 *         of two in fp32, subnormal for e = 0, 1), so w = h(e) (c - 12) with c = kv[q] + 12
 *         an unsigned code 0 .. 24 (a 16-entry byte shuffle of the nibble) and offset 12
 * or in llama.cpp's K-quant super-blocks of 256 (8 groups of 32):
 *   q4_k: 4-bit codes, (d, dmin) per 256, 6-bit (sc, mn) per 32: w = (d sc) q - dmin mn (Q4_K)
 *   q5_k: the same with 5-bit codes                                                     (Q5_K)
 *   q6_k: 6-bit codes, d per 256, int8 sc per 16:                w = (d sc) (q - 32)    (Q6_K)
 * each product of parameters in fp32 as ggml and gguf-py compute it (d sc and dmin mn are
 * exact; mxfp4's h(e) kv[q] too), so a dequantized weight is gguf-py's, bit for bit.
 *
 * Stored row-interleaved (kvlm.model.quant packs them): blocks of 16 rows, one row per
 * vector lane, so one 64-byte load holds 4 consecutive bytes of 16 rows and a product
 * accumulates 16 outputs in one register (no horizontal sums, no per-row overhead; the
 * layout of llama.cpp's repacked Q4_0x8 / ARM kernels). Block b (rows 16b .. 16b + 15,
 * zero rows past N) is a row of records, one stream to read:
 *   q8, q4, q4_0, q5_0, q5_1, mxfp4: K / 32 records, one group each:
 *       codes [CB], scale [16] fp16 (s or d of each row), then q4 and q5_1: zero [16] fp16 (m);
 *       mxfp4: codes [CB], e [16] (each row's exponent byte, as stored)
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
 * q5_k 0.6875, q6_k 0.8203125, mxfp4 0.53125: the GGUF file's own sizes; a block of 16 rows is 16 of the
 * file's rows long, so blocks of weights stacked along N are their packed bytes one after
 * another. kvlm_qpack writes this layout straight from a GGUF tensor's blocks.
 *
 * q8_0_rows (Q8R) is Q8_0 left as the file stores it, read where it lies in the file's
 * map (a stack of experts, not copied at load): ggml's block_q8_0 (fp16 d, int8 qs[32]:
 * 34 bytes a group), K / 32 of them a row, rows one after another, N x K / 32 x 34
 * bytes, no padding. Its products pack each block of 16 rows into this layout's q8
 * records in the thread's scratch (rows_block; 16 x K bytes, in L1/L2) and run q8's
 * kernel on them, so a row's numbers are q8's bit for bit at any row count; its
 * dequantization reads the rows directly (the same exact products).
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

#define G 32          /* weights per group */
#define MT 4          /* rows of x per pass over a block */
#define MT_I8 8       /* with int8 x, many rows (a prompt): rows per pass */
#define L2_ROWS_BYTES (384 << 10) /* int8 rows of x per chunk of a many-row product */


static inline int known_kind(int64_t kind) {
    return kind == Q8 || kind == Q4 || kind == Q40 || kind == Q50 || kind == Q51 ||
           kind == Q4K || kind == Q5K || kind == Q6K || kind == MXFP4 || kind == Q8R;
}

static inline int is_k(int kind) { return kind == Q4K || kind == Q5K || kind == Q6K; }

/* bytes of a block as a GGUF file stores it (kvlm_qpack's input), and the weights it
 * holds: a row of K weights is K / weights blocks */
static inline int64_t ggml_block_bytes(int kind) {
    switch (kind) {
    case Q8:
    case Q8R: return 34;
    case Q4: return 20;
    case Q40: return 18;
    case Q50: return 22;
    case Q51: return 24;
    case MXFP4: return 17;
    case Q4K: return 144;
    case Q5K: return 176;
    default: return 210;
    }
}

static inline int64_t ggml_block_weights(int kind) { return is_k(kind) ? 256 : G; }

/* *r = bytes of a packed [n, k] weight of a known kind (quant.packed_bytes): ceil(n / 16)
 * blocks of 16 rows of k / weights stored blocks each (Q8R: n rows, unpadded). 0 when
 * n < 0, k < 1, k is not whole blocks of the kind, or the size overflows. */
static int packed_size(int kind, int64_t n, int64_t k, int64_t *r) {
    int64_t row, block;
    if (n < 0 || k < 1 || k % ggml_block_weights(kind)) return 0;
    if (!mul_ok(k / ggml_block_weights(kind), ggml_block_bytes(kind), &row)) return 0;
    if (kind == Q8R) return mul_ok(n, row, r);
    return mul_ok(row, BR, &block) && mul_ok(n / BR + (n % BR != 0), block, r);
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
    return kind == Q40 ? 8 : kind == Q50 ? 16 : kind == Q6K ? 32 : kind == MXFP4 ? 12 : 0;
}

/* mxfp4's nibble -> unsigned code kv[q] + 12 (the top of this file), a byte shuffle's
 * table (the same 16 bytes in each 128-bit lane) */
#define MXFP4_CODES 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
static const uint8_t mxfp4_code[16] = {MXFP4_CODES};

/* ggml's e8m0_to_fp32_half: 2^(e - 128) as fp32's bits, 0x00200000 << e for e < 2 (the
 * subnormals 2^-128 and 2^-127), else (e - 1) << 23 */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* groups per record */
static inline int64_t rec_groups(int kind) { return is_k(kind) ? 8 : 1; }

/* bytes of one group's codes (16 rows): nibbles or int8, then high bits */
static inline int64_t code_bytes(int kind) {
    return kind == Q8 ? 16 * G : 8 * G + 64 * high_bits(kind);
}

/* parameters after each group's codes (the per-group kinds): fp16 d (and m), or mxfp4's
 * exponent byte, one a row */
static inline int64_t param_bytes(int kind) {
    return is_k(kind) ? 0 : kind == MXFP4 ? BR : (has_zero(kind) ? 4 : 2) * BR;
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

/* Q8R's block b (rows 16b .. 16b + 15 of w's N rows of `groups` block_q8_0 each) as q8's
 * packed records, in this thread's scratch (zero rows past N); {NULL} when no scratch
 * could be had. The products' loops take it where a packed kind takes block_at's. */
static __thread uint8_t *rows_buf;
static __thread size_t rows_cap;

static kvlm_block rows_block(const uint8_t *w, int64_t groups, int64_t N, int64_t b) {
    kvlm_block r = {NULL};
    const int64_t row = groups * 34, rec = rec_bytes(Q8);
    const size_t need = (size_t)(groups * rec);
    if (need > rows_cap) {
        free(rows_buf);
        rows_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        rows_cap = rows_buf ? need : 0;
        if (!rows_buf) return r;
    }
    const int rows = N - b * BR < BR ? (int)(N - b * BR) : BR;
    if (rows < BR) memset(rows_buf, 0, need);
#if KVLM_V512 == 512
    if (rows == BR) { /* per group: rows i and i + 8 in one register, an 8 x 8 transpose
                         of 32-bit words in each 256-bit half (lane i of vector v = row i's
                         word v), the scales copied */
        const uint8_t *r0 = w + b * BR * row;
        const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *c = r0 + g * 34 + 2;
            uint8_t *o = rows_buf + g * rec;
            __m512i z[8], t[8], u[8];
            for (int i = 0; i < 8; i++)
                z[i] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c + i * row))),
                    _mm256_loadu_si256((const __m256i *)(c + (i + 8) * row)), 1);
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
                t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
            }
            for (int h = 0; h < 8; h += 4) {
                u[h] = _mm512_unpacklo_epi64(t[h], t[h + 2]);
                u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);
                u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]);
                u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);
            }
            for (int v = 0; v < 4; v++) {
                _mm512_storeu_si512(o + 64 * v, _mm512_permutex2var_epi64(u[v], lo, u[v + 4]));
                _mm512_storeu_si512(o + 64 * (v + 4), _mm512_permutex2var_epi64(u[v], hi, u[v + 4]));
            }
            for (int i = 0; i < BR; i++) memcpy(o + 16 * G + 2 * i, c - 2 + i * row, 2);
        }
        r.p = rows_buf;
        return r;
    }
#endif
    for (int i = 0; i < rows; i++) {
        const uint8_t *s = w + (b * BR + i) * row;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = s + g * 34;
            uint8_t *o = rows_buf + g * rec;
            memcpy(o + 16 * G + 2 * i, blk, 2); /* d */
            for (int v = 0; v < 8; v++) memcpy(o + 64 * v + 4 * i, blk + 2 + 4 * v, 4);
        }
    }
    r.p = rows_buf;
    return r;
}

/* block b of w as a product reads it (KIND a literal once inlined), and the kind its
 * records are */
static inline kvlm_block take_block(int kind, const uint8_t *w, int64_t groups, int64_t N,
                                    int64_t b) {
    return kind == Q8R ? rows_block(w, groups, N, b) : block_at(kind, w, groups, b);
}
#define PACKED(KIND) ((KIND) == Q8R ? Q8 : (KIND))

/* Row i's group g as its 32 codes in element order: q8's int8 bytes, mxfp4's kv[q] + 12,
 * else 0 .. 2^bits - 1 */
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
            } else if (kind == MXFP4) {
                lo = mxfp4_code[lo];
                hi = mxfp4_code[hi];
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
    if (kind == MXFP4) {
        s[0] = s[1] = e8m0_half(codes_of(kind, B, g)[code_bytes(kind) + i]);
        *z = 0.f;
        return;
    }
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
 * each row, hi = elements 16 + 4v ..; unsigned (0 .. 2^bits - 1; mxfp4: kv[q] + 12, its
 * nibbles through the table, or with `values` kv[q] itself, signed, from a table 12 less
 * that the compiler folds). hb0, hb1: the group's high-bit vectors (loaded once per
 * group). */
static inline __attribute__((always_inline)) void
code_vectors(int kind, const uint8_t *c, int v, __m512i hb0, __m512i hb1, int values,
             __m512i *lo, __m512i *hi) {
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
    } else if (kind == MXFP4) { /* nibble -> kv + 12: vpshufb, the table in each 128 bits */
        const __m512i table = _mm512_set_epi32( /* MXFP4_CODES, 4 bytes a lane, high first */
            0x00040608, 0x090A0B0C, 0x18141210, 0x0F0E0D0C, 0x00040608, 0x090A0B0C,
            0x18141210, 0x0F0E0D0C, 0x00040608, 0x090A0B0C, 0x18141210, 0x0F0E0D0C,
            0x00040608, 0x090A0B0C, 0x18141210, 0x0F0E0D0C);
        const __m512i signed_table = _mm512_sub_epi8(table, _mm512_set1_epi8(12));
        *lo = _mm512_shuffle_epi8(values ? signed_table : table, *lo);
        *hi = _mm512_shuffle_epi8(values ? signed_table : table, *hi);
    }
}

static inline __m512 load_f16x16(const void *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* The 16 rows' parameters of group g (row_params, a row per lane): s0 for elements 0..15,
 * s1 for 16..31 (different for q6_k only), z (zero where the kind has none) */
static inline __attribute__((always_inline)) void
group_params(int kind, kvlm_block B, int64_t g, __m512 *s0, __m512 *s1, __m512 *z) {
    if (kind == MXFP4) { /* e8m0_half's bits per lane */
        const __m128i e8 = _mm_loadu_si128((const __m128i *)(codes_of(kind, B, g) + code_bytes(kind)));
        const __m512i e = _mm512_cvtepu8_epi32(e8);
#if KVLM_V512 == 512 /* (e - 1) << 23, or 0x00200000 << e in the lanes where e < 2 */
        const __m512i bits = _mm512_mask_sllv_epi32(
            _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23),
            _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), _mm512_set1_epi32(0x00200000), e);
#else /* without masks: (e -sat 1) << 23 | 0x00400000 >> t, t = (e ^ 1) + 32 (e -sat 1):
         1 for e = 0, 0 for e = 1, at least 32 (a shift to nothing) for the others */
        const __m512i em1 = _mm512_cvtepu8_epi32(_mm_subs_epu8(e8, _mm_set1_epi8(1)));
        const __m512i t = _mm512_add_epi32(_mm512_xor_si512(e, _mm512_set1_epi32(1)),
                                           _mm512_slli_epi32(em1, 5));
        const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(em1, 23),
                                             _mm512_srlv_epi32(_mm512_set1_epi32(0x00400000), t));
#endif
        *s0 = *s1 = _mm512_castsi512_ps(bits);
        *z = _mm512_setzero_ps();
        return;
    }
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
                code_vectors(kind, c, v, hb0, hb1, 1, &half[0], &half[1]); /* mxfp4: kv[q] */
                const int less = code_offset(kind) && kind != Q40 && kind != MXFP4;
                for (int h = 0; h < 2 && less; h++) /* q - offset */
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
        if (kind != MXFP4) { /* mxfp4's scale is down to 2^-128: its sums take the 2^-24 */
            s0 = _mm512_mul_ps(s0, unit);
            s1 = _mm512_mul_ps(s1, unit);
        }
        for (int t = 0; t < R; t++) {
            if (kind == Q6K) {
                acc[t] = _mm512_fmadd_ps(part[t][0], s0, acc[t]);
                acc[t] = _mm512_fmadd_ps(part[t][1], s1, acc[t]);
            } else {
                __m512 p = part[t][0];
                for (int k = 1; k < C; k++) p = _mm512_add_ps(p, part[t][k]);
                if (kind == MXFP4) p = _mm512_mul_ps(p, unit); /* exact: a power of two */
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
        const kvlm_block blk = take_block(KIND, w, groups, N, b);                            \
        if (!blk.p) {                                                                        \
            _Pragma("omp atomic write") no_scratch = 1;                                      \
            continue;                                                                        \
        }                                                                                    \
        int64_t m0 = 0;                                                                      \
        ROWS_BY_MT(M, m0, KIND, BODY)                                                        \
    }

/* As FOR_BLOCKS, MT_I8 rows per pass while that many are left (int8 x: a prompt's rows) */
#define FOR_BLOCKS_WIDE(M, N, KIND, BODY)                                                    \
    _Pragma("omp parallel for schedule(static)")                                             \
    for (int64_t b = 0; b < ((N) + BR - 1) / BR; b++) {                                      \
        const kvlm_block blk = take_block(KIND, w, groups, N, b);                            \
        if (!blk.p) {                                                                        \
            _Pragma("omp atomic write") no_scratch = 1;                                      \
            continue;                                                                        \
        }                                                                                    \
        int64_t m0 = 0;                                                                      \
        for (; (M) - m0 >= MT_I8; m0 += MT_I8) BODY(KIND, MT_I8, m0);                        \
        ROWS_BY_MT(M, m0, KIND, BODY)                                                        \
    }

#define FOR_KIND_LOOP(LOOP, kind, M, N, BODY)                                                \
    do {                                                                                     \
        switch (kind) {                                                                      \
        case Q8: LOOP(M, N, Q8, BODY) break;                                                 \
        case Q8R: LOOP(M, N, Q8R, BODY) break;                                               \
        case Q4: LOOP(M, N, Q4, BODY) break;                                                 \
        case Q40: LOOP(M, N, Q40, BODY) break;                                               \
        case Q50: LOOP(M, N, Q50, BODY) break;                                               \
        case Q51: LOOP(M, N, Q51, BODY) break;                                               \
        case Q4K: LOOP(M, N, Q4K, BODY) break;                                               \
        case Q5K: LOOP(M, N, Q5K, BODY) break;                                               \
        case MXFP4: LOOP(M, N, MXFP4, BODY) break;                                           \
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
    int no_scratch = 0;
#define QGEMM_BODY(KIND, R, m0) \
    block_product(PACKED(KIND), R, blk, groups, x, K, xs, y, ldy, N, b * BR, m0)
    FOR_KIND_BLOCKS(kind, M, N, QGEMM_BODY);
    return no_scratch ? -1 : 0;
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
                code_vectors(kind, c, v, hb0, hb1, 0, &lo, &hi);
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
    int no_scratch = 0;
#define QGEMM_I8_BODY(KIND, R, m0) \
    block_product_i8(PACKED(KIND), R, 0, blk, groups, rows + (m0), y, ldy, N, b * BR, m0)
#define QGEMM_I16_BODY(KIND, R, m0) \
    block_product_i8(PACKED(KIND), R, 1, blk, groups, rows + (m0), y, ldy, N, b * BR, m0)
    if (F) {
        FOR_KIND_BLOCKS(kind, M, N, QGEMM_I16_BODY);
        return no_scratch ? -1 : 0;
    }
    if (M <= SMALL_ROWS) {
        FOR_KIND_BLOCKS(kind, M, N, QGEMM_I8_BODY);
        return no_scratch ? -1 : 0;
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
    block_product_i8(PACKED(KIND), R, 0, blk, groups, rows_c + (m0), y_c, ldy, N, b * BR, m0)
        FOR_KIND_LOOP(FOR_BLOCKS_WIDE, kind, mc, N, QGEMM_I8_CHUNK);
#undef QGEMM_I8_CHUNK
    }
    return no_scratch ? -1 : 0;
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
            } else if (kind == MXFP4) { /* nibble -> kv + 12 */
                const __m128i table = _mm_loadu_si128((const __m128i *)mxfp4_code);
                codes[0] = _mm_shuffle_epi8(table, codes[0]);
                codes[1] = _mm_shuffle_epi8(table, codes[1]);
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

/* Row n of Q8R's w (rows of `groups` block_q8_0) as dequant_row gives q8's: s q, exact */
static inline void dequant_rows_row(int bf16, int64_t groups, const uint8_t *w, int64_t n,
                                    void *out) {
    const uint8_t *s = w + n * groups * 34;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = s + g * 34;
        uint16_t d;
        memcpy(&d, blk, 2);
        const float sc = from_f16(d);
        for (int j = 0; j < G; j++) {
            const float v = sc * (float)(int8_t)blk[2 + j];
            if (bf16)
                ((uint16_t *)out)[g * G + j] = to_bf16(v);
            else
                ((float *)out)[g * G + j] = v;
        }
    }
}

/* row n of w of `kind` into out (KIND a literal once inlined) */
static inline __attribute__((always_inline)) void
dequant_any(int kind, int bf16, int64_t groups, const uint8_t *w, int64_t n, void *out) {
    if (kind == Q8R)
        dequant_rows_row(bf16, groups, w, n, out);
    else
        dequant_row(kind, bf16, groups, block_at(kind, w, groups, n / BR), (int)(n % BR), out);
}

/* DO(KIND) with KIND a literal for each known kind; an unknown kind returns -2 */
#define EACH_KIND(kind, DO)                                                                  \
    switch (kind) {                                                                          \
    case Q8: DO(Q8); break;                                                                  \
    case Q8R: DO(Q8R); break;                                                                \
    case Q4: DO(Q4); break;                                                                  \
    case Q40: DO(Q40); break;                                                                \
    case Q50: DO(Q50); break;                                                                \
    case Q51: DO(Q51); break;                                                                \
    case Q4K: DO(Q4K); break;                                                                \
    case Q5K: DO(Q5K); break;                                                                \
    case Q6K: DO(Q6K); break;                                                                \
    case MXFP4: DO(MXFP4); break;                                                            \
    default: return -2;                                                                      \
    }

/* KIND and BF16 literals (see FOR_BLOCKS) */
#define DEQUANT_ROWS(KIND, BF16)                                                             \
    do {                                                                                     \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < N; n++)                                                      \
            dequant_any(KIND, BF16, groups, w, n, (char *)out + n * K * ((BF16) ? 2 : 4));   \
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
        dequant_any(KIND, 0, groups, w, rows[t], out + t * K)
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
 *   mxfp4 <- block_mxfp4 (e, qs[16])
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
            if (kind == MXFP4) { /* e, then the nibbles as q4_0's */
                r[cb + i] = blk[0];
                for (int v = 0; v < 4; v++) memcpy(r + 64 * v + 4 * i, blk + 1 + 4 * v, 4);
                continue;
            }
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

/* Fault in the pages of buf[0 .. n) (a fresh anonymous map: every byte still zero), one
 * write of a zero a `page` bytes, the pages shared out among the threads: the kernel
 * zeroes (and on a huge-page map, first gathers) a page at its first touch, which on one
 * thread ran at ~1 GB/s of 2 MiB pages while the other waited at kvlm_qpack's barrier.
 * Returns 0, or -2 for a page under 4096 bytes or a negative n. */
int kvlm_prefault(uint8_t *buf, int64_t n, int64_t page) {
    if (!buf || n < 0 || page < 4096) return -2;
#pragma omp parallel for schedule(static)
    for (int64_t at = 0; at < n; at += page) buf[at] = 0;
    return 0;
}

/* The packed weight [N, K] of `kind` from its stored blocks: row n is src row order[n]
 * (order NULL: row n; a permutation applied as the rows are read, llama's q/k rows), each
 * K / per * bytes long; dst: ceil(N / 16) blocks of 16 x that many bytes, every byte
 * written (rows past N zero). Blocks of 16 rows in parallel. src holds sn bytes, dst dn.
 * Returns 0, or -2, nothing written, for an unknown kind (or Q8R, never packed), a K that
 * is not whole blocks, a buffer shorter than its shape needs (src N rows, dst the packed
 * [N, K]), or an order
 * entry outside [0, N). */
int kvlm_qpack(int64_t kind, const uint8_t *src, int64_t sn, int64_t N, int64_t K,
               const int64_t *order, uint8_t *dst, int64_t dn) {
    int64_t need;
    if (!known_kind(kind) || kind == Q8R || !packed_size((int)kind, N, K, &need) || dn < need)
        return -2; /* Q8R is not packed: its rows are read in place */
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
