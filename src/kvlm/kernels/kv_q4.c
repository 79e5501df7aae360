/* ---- q4 K/V (part of qgemm.c's one translation unit; the layout: kv.c's q4_group) ---- */

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

/* The store's quantizers and the fp16 cache's conversions (kvlm_quantize_q4_rows here,
 * kvlm_quantize_kv_rows in kv_int8.c, kvlm_f16_round_trip in kv_float.c), exported for
 * tests alone (no caller in kvlm itself; tests/test_quant.py holds them to storage.py and
 * torch bit for bit), their buffers bounded as every entry point's: each with its length
 * (xn floats, cn bytes, ...), 0, or -2 with nothing read or written for sizes out of range
 * or a buffer shorter than they need. */

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
