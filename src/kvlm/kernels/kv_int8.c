/* ---- int8 K/V (kvlm/cache/storage.py; part of qgemm.c's one translation unit): a row is
 * D codes c and fp16 (step, zero), x ~ (c + 128) step + zero; K rows are stored rotated,
 * k R (R orthonormal), so the queries are rotated too: (q R).(k R) = q.k. Scores are
 * integer dot products: each query head (times the softmax scale, rotated) rounds to int8
 * with one scale sq (as llama.cpp does for its q8_0 cache), and
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

/* quantize_kv_row over `rows` rows of D: x [rows, D] -> codes [rows, D] and params
 * [rows, 2] fp16 (step, zero); for tests alone (kv_q4.c's note) */
int kvlm_quantize_kv_rows(const float *x, int64_t xn, int8_t *codes, int64_t cn,
                          uint16_t *params, int64_t pn, int64_t rows, int64_t D) {
    int64_t need;
    if (rows < 0 || D < 1 || !mul_ok(rows, D, &need) || xn < need || cn < need) return -2;
    if (!mul_ok(rows, 2, &need) || pn < need) return -2;
    for (int64_t r = 0; r < rows; r++) quantize_kv_row(x + r * D, D, codes + r * D, params + 2 * r);
    return 0;
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
