/* ------------------------------------------------------------------------------------
 * The gated DeltaNet's step after its convolution (the deltanet layer kind,
 * kvlm.model.deltanet): for each sequence b and value head h, token by token,
 *
 *     q, k, v = silu(the convolution's q|k|v)   (q/k head h / (nv / nk): consecutive)
 *     q = l2norm(q) / sqrt(dk); k = l2norm(k)    l2norm(x) = x / sqrt(sum x^2 + 1e-6)
 *     beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
 *     S = S exp(g); S = S + k (x) ((v - S^T k) beta); o = S^T q     S (dk, dv), fp32
 *     y = rmsnorm(o) w silu(z)                   (the gated RMSNorm, over dv)
 *
 * transformers' torch_recurrent_gated_delta_rule and its gated norm, in fp32, the rule
 * computed in chunks of DELTA_CHUNK positions (abi.h: 16) at absolute multiples of it
 * (delta_head: the WY form, a row's state products one read of S, the state written once
 * a chunk), a sequence's state kept as the one at its chunk's start beside the chunk's
 * carried rows, so a step cut anywhere computes the values a step from the chunk's start
 * does. Why here and not in torch: torch's elementwise ops run a vector loop and a scalar
 * tail whose exp, sigmoid and silu round differently, so a value's bits depended on where
 * it fell in a step's tensor (a prompt in chunks was ~7e-6 from one shot, a forked row
 * 1e-5 from its batch of one), and the reductions over dk could be split by threads; here
 * every value is computed one way whatever the step holds: a (b, h) pair's work in one
 * thread, the lanes of dv with masked tails (no scalar tail), each sum in one order, a
 * norm's in 16 lanes added in one fixed order, the chunk's dots a lane each. The vector
 * path fuses its products and sums (fma); the portable builds keep them apart (-std=c11:
 * no contraction) with scalar exp: each build its own bits, one way. Part of qgemm.c's one
 * translation unit.
 * ------------------------------------------------------------------------------------ */

#define DELTA_MAX_DIM 512 /* the largest key or value head the step takes */
#define DELTA_MAX_AT 64  /* the most states one sequence's rows may copy out in a step */

static inline float delta_silu(float x) { return x / (1.0f + expf(-x)); }

/* y[i] = silu(x[i]) for n values, each the same way wherever it falls */
static void delta_silu_row(const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if KVLM_V512
    for (; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        const __m512 e = exp512(negate(v));
        _mm512_mask_storeu_ps(y + i, k, _mm512_div_ps(v, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    }
#endif
    for (; i < n; i++) y[i] = delta_silu(x[i]);
}

/* sum of x[i]^2 over n values: 16 lanes (masked tail), then the lanes in a fixed order */
static float delta_sum_squares(const float *x, int64_t n) {
    float ss = 0.f;
    int64_t i = 0;
#if KVLM_V512
    __m512 acc = _mm512_setzero_ps();
    for (; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) ss += x[i] * x[i];
    return ss;
}

/* torch's softplus (beta 1, threshold 20) */
static inline float delta_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* s[j] = s[j] * c for n values */
static inline void delta_scale(float *s, float c, int64_t n) {
    int64_t j = 0;
#if KVLM_V512
    const __m512 cv = _mm512_set1_ps(c);
    for (; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), cv));
    }
#endif
    for (; j < n; j++) s[j] = s[j] * c;
}

/* a carried row's floats: k [dk] (normed), u [dv], g, gc (the chunk's cumulative g) */
#define DELTA_ROW(dk, dv) ((dk) + (dv) + 2)

/* y[0..n) = y + x * c (fma in the vector path) */
static inline void ck_axpy(float *y, const float *x, float c, int64_t n) {
    int64_t j = 0;
#if KVLM_V512
    const __m512 cv = _mm512_set1_ps(c);
    for (; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        _mm512_mask_storeu_ps(y + j, k, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, x + j), cv,
                                                        _mm512_maskz_loadu_ps(k, y + j)));
    }
#endif
    for (; j < n; j++) y[j] = y[j] + x[j] * c;
}

static inline float ck_dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    int64_t i = 0;
#if KVLM_V512
    __m512 acc = _mm512_setzero_ps();
    for (; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
    }
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* A[j][s] = e^{gc_j - gc_s} (k_j . k_s) for s < j and B[j][s] = e^{gc_j - gc_s} (q_j . k_s)
 * for s <= j (rows of DELTA_CHUNK), the n x n lower triangles; Kt scratch (dk, n) */
static void ck_chunk_dots(const float *Q, const float *K, float *A, float *B, const float *gc,
                          int64_t j0, int64_t n, int64_t dk, float *Kt) {
    const int64_t CH = DELTA_CHUNK;
    for (int64_t s = 0; s < n; s++)
        for (int64_t i = 0; i < dk; i++) Kt[i * CH + s] = K[s * dk + i];
#if KVLM_V512 && DELTA_CHUNK <= 32
    enum { NVEC = (DELTA_CHUNK + 15) / 16 };
    __mmask16 m[NVEC];
    for (int v = 0; v < NVEC; v++) m[v] = n > 16 * v ? tail_mask(n - 16 * v) : 0;
    for (int64_t j = j0; j < n; j++) {
        __m512 a[NVEC], b[NVEC];
        for (int v = 0; v < NVEC; v++) a[v] = b[v] = _mm512_setzero_ps();
        const float *kj = K + j * dk, *qj = Q + j * dk;
        for (int64_t i = 0; i < dk; i++) {
            const __m512 kb = _mm512_set1_ps(kj[i]), qb = _mm512_set1_ps(qj[i]);
            for (int v = 0; v < NVEC; v++) {
                const __m512 t = _mm512_maskz_loadu_ps(m[v], Kt + i * CH + 16 * v);
                a[v] = _mm512_fmadd_ps(t, kb, a[v]);
                b[v] = _mm512_fmadd_ps(t, qb, b[v]);
            }
        }
        const __m512 gj = _mm512_set1_ps(gc[j]);
        for (int v = 0; v < NVEC; v++) {
            const __m512 d = exp512(_mm512_sub_ps(gj, _mm512_maskz_loadu_ps(m[v], gc + 16 * v)));
            _mm512_mask_storeu_ps(A + j * CH + 16 * v, m[v], _mm512_mul_ps(d, a[v]));
            _mm512_mask_storeu_ps(B + j * CH + 16 * v, m[v], _mm512_mul_ps(d, b[v]));
        }
    }
    return;
#endif
    for (int64_t j = j0; j < n; j++)
        for (int64_t s = 0; s <= j; s++) {
            const float d = expf(gc[j] - gc[s]);
            B[j * CH + s] = d * ck_dot(Q + j * dk, K + s * dk, dk);
            if (s < j) A[j * CH + s] = d * ck_dot(K + j * dk, K + s * dk, dk);
        }
}

/* y = y * a + sum_{s < n} c[s] rows[s] (rows of dv floats): y kept in registers */
static void ck_rows_combine(float *y, float a, const float *rows, const float *c, int64_t n,
                            int64_t dv) {
#if KVLM_V512
    if (dv % 16 == 0 && dv <= 256) {
        const int64_t L = dv / 16;
        __m512 acc[16];
        const __m512 av = _mm512_set1_ps(a);
        for (int64_t l = 0; l < L; l++) acc[l] = _mm512_mul_ps(_mm512_loadu_ps(y + 16 * l), av);
        for (int64_t s = 0; s < n; s++) {
            const __m512 cb = _mm512_set1_ps(c[s]);
            const float *r = rows + s * dv;
            for (int64_t l = 0; l < L; l++)
                acc[l] = _mm512_fmadd_ps(_mm512_loadu_ps(r + 16 * l), cb, acc[l]);
        }
        for (int64_t l = 0; l < L; l++) _mm512_storeu_ps(y + 16 * l, acc[l]);
        return;
    }
#endif
    delta_scale(y, a, dv);
    for (int64_t s = 0; s < n; s++) ck_axpy(y, rows + s * dv, c[s], dv);
}

/* ks[j] = S^T k_j and qs[j] = S^T q_j for j < n: one pass over S's rows per token */
static void ck_state_products(const float *S, const float *K, const float *Q, float *ks, float *qs,
                              int64_t n, int64_t dk, int64_t dv) {
#if KVLM_V512
    if (dv % 16 == 0 && dv <= 256) {
        const int64_t L = dv / 16;
        for (int64_t j = 0; j < n; j++) {
            __m512 ak[16], aq[16];
            for (int64_t l = 0; l < L; l++) ak[l] = aq[l] = _mm512_setzero_ps();
            const float *kj = K + j * dk, *qj = Q + j * dk;
            for (int64_t i = 0; i < dk; i++) {
                const __m512 kb = _mm512_set1_ps(kj[i]), qb = _mm512_set1_ps(qj[i]);
                const float *row = S + i * dv;
                for (int64_t l = 0; l < L; l++) {
                    const __m512 s = _mm512_loadu_ps(row + 16 * l);
                    ak[l] = _mm512_fmadd_ps(s, kb, ak[l]);
                    aq[l] = _mm512_fmadd_ps(s, qb, aq[l]);
                }
            }
            for (int64_t l = 0; l < L; l++) {
                _mm512_storeu_ps(ks + j * dv + 16 * l, ak[l]);
                _mm512_storeu_ps(qs + j * dv + 16 * l, aq[l]);
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        for (int64_t c = 0; c < dv; c++) ks[j * dv + c] = qs[j * dv + c] = 0.f;
        for (int64_t i = 0; i < dk; i++) {
            ck_axpy(ks + j * dv, S + i * dv, K[j * dk + i], dv);
            ck_axpy(qs + j * dv, S + i * dv, Q[j * dk + i], dv);
        }
    }
}


/* One sequence's value head over its T tokens (the module comment's rule) in chunks of
 * DELTA_CHUNK at absolute positions: the chunk of positions c .. c + 15 from S0, its state
 * at c, by the WY form
 *
 *     gc_j = g_0 + .. + g_j,   ks_j = S0^T k_j,   qs_j = S0^T q_j
 *     u_j = beta_j (v_j - e^{gc_j} ks_j) - beta_j sum_{s<j} e^{gc_j - gc_s} (k_j . k_s) u_s
 *     o_j = e^{gc_j} qs_j + sum_{s<=j} e^{gc_j - gc_s} (q_j . k_s) u_s
 *     S   = e^{gc_15} S0 + sum_s e^{gc_15 - gc_s} k_s (x) u_s        (the chunk complete)
 *
 * (u_j is the loop's delta: the same rule, its products as small matrix products, S read
 * once a row and written once a chunk). S holds the state at the chunk start of the
 * sequence's first position p0 (c = p0 - p0 % DELTA_CHUNK), `win` the chunk's rows before
 * p0 (p0 % DELTA_CHUNK of them, DELTA_ROW floats each): a step's rows continue that chunk,
 * so every value is the one a step from the chunk's start computes, whatever the steps'
 * cuts (a prompt in chunks = one shot, a decode row = the prompt's row, bit for bit). S and
 * win move on in place (S when a chunk completes, win to the rows of the last, incomplete
 * one); rows of conv, z, b, a and out at the sequence's first row on. The state after row
 * at[i] (i < na, ascending rows of this sequence) is copied out too, S to snap + i stride
 * and the rows to wsnap + i wstride (the rest of its rows zeros). `work`: delta_work
 * floats. */
static inline int64_t delta_work(int64_t dk, int64_t dv) {
    const int64_t d = dk > dv ? dk : dv;
    return 6 * DELTA_CHUNK * d + 2 * DELTA_CHUNK * DELTA_CHUNK;
}

static void delta_head(const float *conv, const float *z, const float *bb, const float *aa,
                       float a_log, float dt_bias, const float *w, float eps, float *S,
                       float *win, float *out, int64_t T, int64_t h, int64_t nk, int64_t nv,
                       int64_t dk, int64_t dv, int64_t p0, const int64_t *at, int64_t na,
                       float *snap, int64_t stride, float *wsnap, int64_t wstride,
                       float *work) {
    const int64_t C = 2 * nk * dk + nv * dv, kh = h / (nv / nk), CH = DELTA_CHUNK;
    const int64_t WR = DELTA_ROW(dk, dv);
    const float scale = (float)(1.0 / sqrt((double)dk)), decay_rate = -expf(a_log);
    float *Q = work, *K = Q + CH * dk, *V = K + CH * dk, *U = V + CH * dv, *O = U + CH * dv;
    float *A = O + CH * dv, *Bm = A + CH * CH, *Kt = Bm + CH * CH;
    float g[DELTA_CHUNK], gc[DELTA_CHUNK], beta[DELTA_CHUNK], cf[DELTA_CHUNK];
    float gate[DELTA_MAX_DIM];
    int64_t m = p0 % CH, next = 0; /* the chunk's rows before the step's first; at[next] */
    for (int64_t r = 0; r < m; r++) {
        memcpy(K + r * dk, win + r * WR, (size_t)dk * sizeof(float));
        memcpy(U + r * dv, win + r * WR + dk, (size_t)dv * sizeof(float));
        g[r] = win[r * WR + dk + dv];
        gc[r] = win[r * WR + dk + dv + 1];
    }
    for (int64_t t0 = 0; t0 < T; m = 0) {
        int64_t n = CH; /* the chunk's rows at the end of this pass */
        if (n - m > T - t0) n = m + (T - t0);
        for (int64_t j = m; j < n; j++) {
            const int64_t t = t0 + j - m;
            const float *x = conv + t * C;
            float *q = Q + j * dk, *k = K + j * dk;
            delta_silu_row(x + kh * dk, q, dk);
            delta_silu_row(x + nk * dk + kh * dk, k, dk);
            delta_silu_row(x + 2 * nk * dk + h * dv, V + j * dv, dv);
            const float rq = 1.0f / sqrtf(delta_sum_squares(q, dk) + 1e-6f);
            const float rk = 1.0f / sqrtf(delta_sum_squares(k, dk) + 1e-6f);
            for (int64_t i = 0; i < dk; i++) {
                q[i] = q[i] * rq * scale;
                k[i] = k[i] * rk;
            }
            beta[j] = 1.0f / (1.0f + expf(-bb[t * nv + h]));
            g[j] = decay_rate * delta_softplus(aa[t * nv + h] + dt_bias);
            gc[j] = j ? gc[j - 1] + g[j] : g[j];
        }
        ck_state_products(S, K + m * dk, Q + m * dk, U + m * dv, O + m * dv, n - m, dk, dv);
        ck_chunk_dots(Q, K, A, Bm, gc, m, n, dk, Kt);
        for (int64_t j = m; j < n; j++) {
            const float e = expf(gc[j]);
            for (int64_t c = 0; c < dv; c++) {
                O[j * dv + c] = O[j * dv + c] * e;
                U[j * dv + c] = beta[j] * (V[j * dv + c] - U[j * dv + c] * e);
            }
            for (int64_t s = 0; s < j; s++) cf[s] = -beta[j] * A[j * CH + s];
            ck_rows_combine(U + j * dv, 1.0f, U, cf, j, dv);
            ck_rows_combine(O + j * dv, 1.0f, U, Bm + j * CH, j + 1, dv);
        }
        for (int64_t j = m; j < n; j++) {
            const int64_t t = t0 + j - m;
            const float *o = O + j * dv;
            const float r = 1.0f / sqrtf(delta_sum_squares(o, dv) / (float)dv + eps);
            delta_silu_row(z + t * nv * dv + h * dv, gate, dv);
            float *y = out + t * nv * dv + h * dv;
            for (int64_t c = 0; c < dv; c++) y[c] = o[c] * r * w[c] * gate[c];
        }
        /* the rows of this chunk as carried rows (win's layout) up to row `upto` into dst */
#define DELTA_PUT_ROWS(dst, upto)                                                            \
    do {                                                                                     \
        for (int64_t r_ = 0; r_ < (upto); r_++) {                                            \
            memcpy((dst) + r_ * WR, K + r_ * dk, (size_t)dk * sizeof(float));                \
            memcpy((dst) + r_ * WR + dk, U + r_ * dv, (size_t)dv * sizeof(float));           \
            (dst)[r_ * WR + dk + dv] = g[r_];                                                \
            (dst)[r_ * WR + dk + dv + 1] = gc[r_];                                           \
        }                                                                                    \
    } while (0)
        /* kept rows inside the chunk (not its last): S (the chunk's start) and its rows */
        while (next < na && at[next] < t0 + n - m && (at[next] - t0 + m) < CH - 1) {
            const int64_t j = at[next] - t0 + m;
            memcpy(snap + next * stride, S, (size_t)(dk * dv) * sizeof(float));
            float *ws = wsnap + next * wstride;
            memset(ws, 0, (size_t)((CH - 1) * WR) * sizeof(float));
            DELTA_PUT_ROWS(ws, j + 1);
            next++;
        }
        t0 += n - m;
        if (n < CH) { /* the step ends inside the chunk: its rows carried (zeros after) */
            DELTA_PUT_ROWS(win, n);
            memset(win + n * WR, 0, (size_t)((CH - 1 - n) * WR) * sizeof(float));
            break;
        }
        /* the chunk complete: S e^{gc_15} + sum_s (e^{gc_15 - gc_s} k_s) (x) u_s */
        const float last = gc[n - 1], el = expf(last);
        float wk[DELTA_CHUNK];
        for (int64_t s = 0; s < n; s++) wk[s] = expf(last - gc[s]);
        for (int64_t i = 0; i < dk; i++) {
            for (int64_t s = 0; s < n; s++) cf[s] = wk[s] * K[s * dk + i];
            ck_rows_combine(S + i * dv, el, U, cf, n, dv);
        }
        if (next < na && at[next] == t0 - 1) { /* a kept row that completed the chunk */
            memcpy(snap + next * stride, S, (size_t)(dk * dv) * sizeof(float));
            memset(wsnap + next * wstride, 0, (size_t)((CH - 1) * WR) * sizeof(float));
            next++;
        }
        if (t0 == T) /* no rows carried */
            memset(win, 0, (size_t)((CH - 1) * WR) * sizeof(float));
#undef DELTA_PUT_ROWS
    }
}

/* A recurrent step's sequences and kept rows, checked (kvlm_gated_delta's and
 * kvlm_mamba2's): cu[0 .. S] never decreasing from 0 (the caller checked cu[0] and its
 * length); at (*atn entries, or NULL: *atn set 0) strictly ascending rows below cu[S],
 * snaps given with it, at most DELTA_MAX_AT a sequence. Returns the step's rows, or -1. */
static int64_t step_rows(const int64_t *cu, int64_t S, const int64_t *at, int64_t *atn,
                         const float *snaps) {
    for (int64_t s = 0; s < S; s++)
        if (cu[s + 1] < cu[s]) return -1;
    const int64_t rows = cu[S];
    if (at && (*atn < 1 || !snaps)) return -1;
    if (!at) *atn = 0;
    for (int64_t i = 0; i < *atn; i++)
        if (at[i] < (i ? at[i - 1] + 1 : 0) || at[i] >= rows) return -1;
    for (int64_t s = 0, i = 0; s < S; s++) {
        int64_t n = 0;
        for (; i < *atn && at[i] < cu[s + 1]; i++) n++;
        if (n > DELTA_MAX_AT) return -1;
    }
    return rows;
}

/* The kept rows (at, ascending: step_rows checked, at most DELTA_MAX_AT a sequence) of
 * the sequence at rows r0 .. r0 + T - 1, relative to r0 in local[]; their count, and in
 * *first the index in at of the first of them. */
static int64_t seq_kept(const int64_t *at, int64_t atn, int64_t r0, int64_t T, int64_t *local,
                        int64_t *first) {
    int64_t i0 = 0, na = 0;
    while (i0 < atn && at[i0] < r0) i0++;
    while (i0 + na < atn && at[i0 + na] < r0 + T) {
        local[na] = at[i0 + na] - r0;
        na++;
    }
    *first = i0;
    return na;
}

/* kvlm_gated_delta's work, its arguments checked (the fused decode step's too): each
 * (sequence s, value head h) pair in one thread, its state at row seq[s] (NULL: s) of
 * `state` and its carried rows at that row of `win`, read first from those rows of
 * state_in and win_in (NULL: state's and win's own, updated in place); starts[s] the
 * sequence's first position. `work` the step's multiply-adds, whether threads pay. */
static void gated_delta_heads(const float *conv, const float *z, const float *b, const float *a,
                              const float *a_log, const float *dt_bias, const float *w, float e,
                              const float *state_in, const float *win_in, const int64_t *seq,
                              float *state, float *win, float *out, const int64_t *cu,
                              const int64_t *starts, int64_t S, const int64_t *at, int64_t atn,
                              float *snaps, float *wsnaps, int64_t nk, int64_t nv, int64_t dk,
                              int64_t dv, int64_t work) {
    const int64_t C = 2 * nk * dk + nv * dv, vd = nv * dv, heads = S * nv;
    const int64_t rows = (DELTA_CHUNK - 1) * DELTA_ROW(dk, dv); /* a head's carried rows */
#pragma omp parallel for schedule(dynamic) if (heads > 1 && work >= 16384)
    for (int64_t p = 0; p < heads; p++) {
        const int64_t s = p / nv, h = p % nv, r0 = cu[s], T = cu[s + 1] - cu[s];
        int64_t i0, local[DELTA_MAX_AT];
        float scratch[delta_work(dk, dv)];
        const int64_t na = seq_kept(at, atn, r0, T, local, &i0);
        const int64_t row = (seq ? seq[s] : s) * nv + h;
        if (state_in) memcpy(state + row * dk * dv, state_in + row * dk * dv,
                             (size_t)(dk * dv) * sizeof(float)); /* this head's, in cache */
        if (win_in) memcpy(win + row * rows, win_in + row * rows, (size_t)rows * sizeof(float));
        delta_head(conv + r0 * C, z + r0 * vd, b + r0 * nv, a + r0 * nv, a_log[h], dt_bias[h],
                   w, e, state + row * dk * dv, win + row * rows, out + r0 * vd, T, h, nk, nv,
                   dk, dv, starts[s], local, na, na ? snaps + (i0 * nv + h) * dk * dv : NULL,
                   nv * dk * dv, na ? wsnaps + (i0 * nv + h) * rows : NULL, nv * rows, scratch);
    }
}

/* The step of one gated DeltaNet layer over S sequences, sequence s the rows cu[s] ..
 * cu[s + 1] - 1 of the step at positions starts[s] on (cu: S + 1 offsets, cun of them; 0
 * first, never decreasing; starts: S positions, stn of them, each at least 0; a sequence
 * of no rows keeps its state): conv [rows, C] (C = 2 nk dk + nv dv: q|k|v, before silu), z
 * [rows, nv dv], b and a [rows, nv], a_log and dt_bias [nv] (hn), w [dv] (wn: the gated
 * norm's weight), state [S, nv, dk, dv] (sn floats: the state at each sequence's chunk
 * start, read and updated), win [S, nv, DELTA_CHUNK - 1, DELTA_ROW] (wn2 floats: the
 * chunk's rows before its first position, read and updated), out [rows, nv dv] (on
 * floats). `state_in`, `win_in` (NULL: `state`, `win` read and updated in place): the
 * states and rows before the step, shaped as `state` and `win`, which are then only
 * written. `at` (atn entries, or NULL): rows of the step, strictly ascending; the state of
 * row at[i]'s sequence after that row copied into snaps [atn, nv, dk, dv] (pn floats) and
 * its carried rows into wsnaps [atn, nv, DELTA_CHUNK - 1, DELTA_ROW] (pwn floats) at i, at
 * most DELTA_MAX_AT of one sequence's. Each buffer's length follows it, in floats. Returns
 * 0, or -2, nothing read or written, for a shape out of range (S, nk >= 1; nv a multiple
 * of nk; dk, dv in 1..DELTA_MAX_DIM; cu, starts or at not as said) or a buffer shorter than
 * its shape. */
int kvlm_gated_delta(const float *conv, int64_t cn, const float *z, int64_t zn,
                     const float *b, int64_t bn, const float *a, int64_t an,
                     const float *a_log, const float *dt_bias, int64_t hn, const float *w,
                     int64_t wn, double eps, const float *state_in, float *state, int64_t sn,
                     const float *win_in, float *win, int64_t wn2, float *out, int64_t on,
                     const int64_t *cu, int64_t cun, const int64_t *starts, int64_t stn,
                     const int64_t *at, int64_t atn, float *snaps, int64_t pn, float *wsnaps,
                     int64_t pwn, int64_t S, int64_t nk, int64_t nv, int64_t dk, int64_t dv) {
    int64_t rows, C, need, heads, vd, work, carried;
    if (S < 1 || nk < 1 || nv < nk || nv % nk || !cu || cun != S + 1 || cu[0] != 0) return -2;
    if (dk < 1 || dk > DELTA_MAX_DIM || dv < 1 || dv > DELTA_MAX_DIM) return -2;
    if (!conv || !z || !b || !a || !a_log || !dt_bias || !w || !state || !win || !out) return -2;
    if (!starts || stn != S) return -2;
    for (int64_t s = 0; s < S; s++)
        if (starts[s] < 0) return -2;
    if ((rows = step_rows(cu, S, at, &atn, snaps)) < 0 || (at && !wsnaps)) return -2;
    if (hn != nv || wn != dv || !mul_ok(S, nv, &heads) || !mul_ok(nv, dv, &vd)) return -2;
    if (!mul_ok(nk, 2 * dk, &C) || !add_ok(C, vd, &C)) return -2;
    if (!mul_ok(rows, C, &need) || cn < need) return -2;
    if (!mul_ok(rows, vd, &need) || zn < need || on < need) return -2;
    if (!mul_ok(need, dk, &work)) work = INT64_MAX; /* the step's work, for the threads */
    if (!mul_ok(rows, nv, &need) || bn < need || an < need) return -2;
    if (!mul_ok(heads, dk * dv, &need) || sn < need) return -2;
    carried = (DELTA_CHUNK - 1) * DELTA_ROW(dk, dv);
    if (!mul_ok(heads, carried, &need) || wn2 < need) return -2;
    if (!mul_ok(atn, nv * dk * dv, &need) || (at && pn < need)) return -2;
    if (!mul_ok(atn, nv * carried, &need) || (at && pwn < need)) return -2;
    gated_delta_heads(conv, z, b, a, a_log, dt_bias, w, (float)eps, state_in, win_in, NULL,
                      state, win, out, cu, starts, S, at, atn, snaps, wsnaps, nk, nv, dk, dv,
                      work);
    return 0;
}
