/* ------------------------------------------------------------------------------------
 * The prompt's elementwise SwiGLU and attention (torch's CPU ops for them ran at ~1 G
 * elements/s and ~90 GFLOPS: a third of a 0.5B model's 512-token prefill once its
 * products were integer ones). Part of qgemm.c's one translation unit.
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
 * RoPE of each head's first R dims at the row's cos and sin (row stride cs, R each; cn and
 * sn floats; R = D but for a partial rotary factor, the rest of the head as it is; none
 * when cos is NULL). A row's result is its own. Returns 0, or -2, nothing read or written,
 * for sizes out of range (D odd or under 2, R odd, under 2 or over D, no heads, rs <
 * (nq + nk) D, a stride negative), norm weights of another length than D, or a buffer
 * shorter than its rows at their stride ((M - 1) rs + (nq + nk) D floats of qkv,
 * (M - 1) cs + R of cos and of sin). */
int kvlm_qk_norm_rope(float *qkv, int64_t qkvn, int64_t M, int64_t rs, int64_t nq, int64_t nk,
                      int64_t D, const float *qn, const float *kn, int64_t nn, double eps,
                      const float *cos, int64_t cn, const float *sin, int64_t sn, int64_t cs,
                      int64_t R) {
    int64_t heads, row, need;
    if (M < 0 || D < 2 || D % 2 || (qn && !kn) || (cos && !sin)) return -2;
    if (cos && (R < 2 || R % 2 || R > D)) return -2;
    if (!add_ok(nq, nk, &heads) || !mul_ok(heads, D, &row) || rs < row) return -2;
    if (qn && nn != D) return -2; /* qn, kn: nn floats each, one per element of a head */
    if (M > 0 && (!extent_ok(1, 0, M, rs, row, &need) || qkvn < need)) return -2;
    if (M > 0 && cos && (!extent_ok(1, 0, M, cs, R, &need) || cn < need || sn < need))
        return -2;
#pragma omp parallel for schedule(static) if (M * (nq + nk) * D > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < nq + nk; j++) {
            float *head = qkv + m * rs + j * D;
            if (qn) rms_norm_row(head, j < nq ? qn : kn, D, (float)eps, head);
            if (cos) rope_row(head, cos + m * cs, sin + m * cs, R);
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
 * the scale): the running max *m and sum *l updated (their start: -inf and 0, or a sink's
 * logit and 1: the sink's column, exp(sink - max), in the sum from the start), e[h] = exp(scale s - max) for the
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
 * `sink`: the head's sink logit (-INFINITY: none), a column of each row's softmax with no
 * value: the running max starts at it and the sum at 1 (exp(sink - sink)), so the sink
 * joins the denominator as the blocks rescale it; with none they start at -inf and 0.
 * DV = D / 16; R, NK, DV literals where inlined (scores and outputs stay in registers). */
static inline __attribute__((always_inline)) void
attend_prompt_rows(const int R, const int NK, const int DV, const float *q, int64_t qst,
                   int64_t t0, const float *kt, const float *v, int64_t vst, int64_t S,
                   const uint8_t *mask, int64_t mst, int causal, float scale, float sink,
                   float *out, int64_t ost) {
    const int KB = 16 * NK;
    __m512 O[4][16];
    float m[4], l[4];
    float p[4][64] __attribute__((aligned(64)));
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        m[r] = sink;
        l[r] = sink > -INFINITY ? 1.f : 0.f;
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
                        const uint8_t *mask, int64_t mst, int causal, float scale, float sink,
                        float *out, int64_t ost) {
    const int KB = 16 * NK;
    __m512 O[4][16];
    float m[4], l[4];
    uint32_t qp[4][128] __attribute__((aligned(64))); /* the query's bf16 pairs */
    uint32_t pp[4][32] __attribute__((aligned(64)));  /* a block's weights, bf16 pairs */
    const int64_t D = 16 * (int64_t)DV;
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        m[r] = sink; /* the sink's start, as attend_prompt_rows' */
        l[r] = sink > -INFINITY ? 1.f : 0.f;
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
 * sees alone. `sinks` (sn floats; NULL: none): head h's sink logit, a column of each of
 * its rows' softmax with no value (the online softmax's max starts at it and its sum at 1),
 * so a row's weights are exp(s - m) / (exp(sink - m) + their sum). qn, kn, vn, mn, on:
 * the elements of q, k, v, mask and out from each pointer on. Returns 0; -1 when scratch memory cannot be had; -2, touching nothing, for sizes
 * that disagree (attend_ok); -3, touching nothing, for a shape it does not take (D not a
 * multiple of 16 or over 256 (bf16 rows: not 64 or 128), no AVX-512 (bf16 rows: no
 * AVX512-BF16): the caller uses torch's SDPA). */
static int attend_prompt_bf16(const float *q, int64_t H, int64_t T, int64_t D, int64_t qsh,
                       int64_t qst, const float *k, const float *v, int64_t Hkv, int64_t S,
                       int64_t ksh, int64_t kst, int64_t vsh, int64_t vst, const uint8_t *mask,
                       int64_t mst, int64_t causal, double scale, const float *sinks,
                       float *out, int64_t r0);
static int attend_prompt_f32(const float *q, int64_t H, int64_t D, int64_t qsh,
                       int64_t qst, const float *k, const float *v, int64_t Hkv, int64_t S,
                       int64_t ksh, int64_t kst, int64_t vsh, int64_t vst, const uint8_t *mask,
                       int64_t mst, int64_t causal, double scale, const float *sinks,
                       float *out, int64_t r1);

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
 * mst + j] is nonzero if `mask` is given. A row that sees no key is 0. `sinks` (NULL:
 * none): head h's sink logit, a column of its softmax with no value: the max starts at it
 * and the sum at exp(sink - max), before the keys' terms. */
static int attend_prompt_scalar(const float *q, int64_t H, int64_t T, int64_t D, int64_t qsh,
                                int64_t qst, const float *k, const float *v, int64_t Hkv,
                                int64_t S, int64_t ksh, int64_t kst, int64_t vsh, int64_t vst,
                                const uint8_t *mask, int64_t mst, int64_t causal, double scale,
                                const float *sinks, float *out) {
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
        const float sink = sinks ? sinks[h] : -INFINITY;
        float mx = sink;
        for (int64_t j = 0; j < S; j++) {
            sr[j] = -INFINITY;
            if ((causal && j > t) || (mask && !mask[t * mst + j])) continue;
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += qr[d] * kg[j * kst + d];
            sr[j] = dot * (float)scale;
            if (sr[j] > mx) mx = sr[j];
        }
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        float sum = sink > -INFINITY ? expf(sink - mx) : 0.f;
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
                float *out, int64_t on, int64_t bf16_from, const float *sinks, int64_t sn) {
    if (!attend_ok(qn, H, T, D, qsh, qst, kn, vn, Hkv, S, ksh, kst, vsh, vst, mask, mn, mst, on))
        return -2;
    if (sinks && sn < H) return -2; /* a sink logit a query head */
    const int64_t b = bf16_from < 0 ? 0 : bf16_from > T ? T : bf16_from;
#if !defined(KVLM_ATTEND_BF16)
    if (b < T) return -3;
#endif
    if (b < T && D != 64 && D != 128) return -3;
#if !KVLM_V512
    if (b > 0) /* the scalar build: every row in fp32, one key after another */
        return attend_prompt_scalar(q, H, T, D, qsh, qst, k, v, Hkv, S, ksh, kst, vsh, vst,
                                    mask, mst, causal, scale, sinks, out);
#endif
    if (b > 0 && (D % 16 || D > 256)) return -3;
    int rc = 0;
    if (b < T) /* the longest rows first */
        rc = attend_prompt_bf16(q, H, T, D, qsh, qst, k, v, Hkv, S, ksh, kst, vsh, vst, mask,
                                mst, causal, scale, sinks, out, b);
    if (rc == 0 && b > 0)
        rc = attend_prompt_f32(q, H, D, qsh, qst, k, v, Hkv, S, ksh, kst, vsh, vst, mask,
                               mst, causal, scale, sinks, out, b);
    return rc;
}

/* One query row per head, a decode row (T = 1): q [H][D] (head stride qsh, d contiguous)
 * over keys 0 .. S - 1 of k, v [Hkv][S][D] (strides ksh, kst, vsh, vst), query head h
 * reading KV head h / (H / Hkv), the keys with mask[s] != 0 where mask is given; out
 * [H][D]. Each head's row is one thread's work and its keys go in order: the scores q.k
 * (16 lanes of d, the lanes then summed), their max, exp(s - max) summed in key order and
 * p.V accumulated in key order, divided by the sum once. So a row's bits depend neither on
 * the thread count nor on the other heads (torch's SDPA split one row's keys across
 * threads), and no copy of K is made (kvlm_attend's prompt kernel transposes K for many
 * rows). A row that sees no key is 0. Returns 0; -1 when scratch memory cannot be had;
 * -2, touching nothing, for sizes that disagree (attend_ok with T = 1); -3, touching
 * nothing, for D not a multiple of 16 or over 256 in a vector build. `sinks` (sn floats;
 * NULL: none): head h's sink logit, a column of its softmax with no value (the max starts
 * at it, the sum at exp(sink - max) before the keys' terms). */
int kvlm_attend_row(const float *q, int64_t qn, int64_t H, int64_t D, int64_t qsh,
                    const float *k, int64_t kn, const float *v, int64_t vn, int64_t Hkv,
                    int64_t S, int64_t ksh, int64_t kst, int64_t vsh, int64_t vst,
                    const uint8_t *mask, int64_t mn, double scale, float *out, int64_t on,
                    const float *sinks, int64_t sn) {
    if (!attend_ok(qn, H, 1, D, qsh, 0, kn, vn, Hkv, S, ksh, kst, vsh, vst, mask, mn, 0, on))
        return -2;
    if (sinks && sn < H) return -2; /* a sink logit a query head */
#if !KVLM_V512 /* the scalar build: its prompt loop, one row */
    return attend_prompt_scalar(q, H, 1, D, qsh, 0, k, v, Hkv, S, ksh, kst, vsh, vst, mask, 0,
                                0, scale, sinks, out);
#else
    if (D % 16 || D > MAX_HEAD_DIM) return -3;
    const int64_t group = H / Hkv, C = D / 16;
    const float sc = (float)scale;
    int failed = 0;
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < H; h++) {
        const float *qh = q + h * qsh, *kg = k + (h / group) * ksh, *vg = v + (h / group) * vsh;
        float *oh = out + h * D, *sr = malloc((size_t)S * sizeof(float));
        if (!sr) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float sink = sinks ? sinks[h] : -INFINITY;
        float mx = sink;
        __m512 qv[MAX_HEAD_DIM / 16], O[MAX_HEAD_DIM / 16];
        for (int64_t c = 0; c < C; c++) {
            qv[c] = _mm512_loadu_ps(qh + 16 * c);
            O[c] = _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < S; j++) {
            sr[j] = -INFINITY;
            if (mask && !mask[j]) continue;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < C; c++)
                acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kg + j * kst + 16 * c), acc);
            sr[j] = _mm512_reduce_add_ps(acc) * sc;
            if (sr[j] > mx) mx = sr[j];
        }
        float sum = sink > -INFINITY ? expf(sink - mx) : 0.f;
        for (int64_t j = 0; j < S && mx > -INFINITY; j++) {
            if (sr[j] == -INFINITY) continue;
            const float e = expf(sr[j] - mx);
            sum += e;
            const __m512 ev = _mm512_set1_ps(e);
            for (int64_t c = 0; c < C; c++)
                O[c] = _mm512_fmadd_ps(ev, _mm512_loadu_ps(vg + j * vst + 16 * c), O[c]);
        }
        const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(oh + 16 * c, _mm512_mul_ps(O[c], inv));
        free(sr);
    }
    return failed ? -1 : 0;
#endif
}

/* kvlm_attend's fp32 rows 0 .. r1 - 1 */
static int attend_prompt_f32(const float *q, int64_t H, int64_t D, int64_t qsh,
                       int64_t qst, const float *k, const float *v, int64_t Hkv, int64_t S,
                       int64_t ksh, int64_t kst, int64_t vsh, int64_t vst, const uint8_t *mask,
                       int64_t mst, int64_t causal, double scale, const float *sinks,
                       float *out, int64_t r1) {
#if !KVLM_V512
    (void)q, (void)H, (void)D, (void)qsh, (void)qst, (void)k, (void)v, (void)Hkv;
    (void)S, (void)ksh, (void)kst, (void)vsh, (void)vst, (void)mask, (void)mst, (void)causal;
    (void)scale, (void)sinks, (void)out, (void)r1;
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
        const float sink = sinks ? sinks[h] : -INFINITY;
        float *oh = out + h * D;
#define ATTEND_ROWS(RR, NKK, DVV) \
    attend_prompt_rows(RR, NKK, DVV, qh, qst, t0, kg, vg, vst, S, mask, mst, (int)causal, sc, sink, oh, H * D)
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
                                   S, mask, mst, (int)causal, sc, sink, oh, H * D);
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
                       int64_t mst, int64_t causal, double scale, const float *sinks,
                       float *out, int64_t r0) {
#if !defined(KVLM_ATTEND_BF16)
    (void)q, (void)H, (void)T, (void)D, (void)qsh, (void)qst, (void)k, (void)v, (void)Hkv;
    (void)S, (void)ksh, (void)kst, (void)vsh, (void)vst, (void)mask, (void)mst, (void)causal;
    (void)scale, (void)sinks, (void)out, (void)r0;
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
        const float sink = sinks ? sinks[h] : -INFINITY;
        float *oh = out + h * D;
#define ATTEND_ROWS(RR, NKK, DVV) \
    attend_prompt_rows_bf16(RR, NKK, DVV, qh, qst, t0, kg, vg, S, mask, mst, (int)causal, sc, sink, oh, H * D)
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
