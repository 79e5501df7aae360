/* ---- fp32, bf16 and fp16 K/V (part of qgemm.c's one translation unit): K's scores and V's
 * p.V over rows stored as floats, widened in registers (bf16 rows as even / odd halves) */

#if KVLM_V512
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

/* to_f16 of x[0:n] into h, and from_f16 of h back into y (the fp16 cache's conversions,
 * against torch's .to(float16) and .float()); for tests alone (kv_q4.c's note) */
int kvlm_f16_round_trip(const float *x, int64_t xn, uint16_t *h, int64_t hn, float *y,
                        int64_t yn, int64_t n) {
    if (n < 0 || xn < n || hn < n || yn < n) return -2;
    for (int64_t i = 0; i < n; i++) h[i] = to_f16(x[i]);
    for (int64_t i = 0; i < n; i++) y[i] = from_f16(h[i]);
    return 0;
}
