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
 * transformers' torch_recurrent_gated_delta_rule and its gated norm, in fp32. Why here and
 * not in torch: torch's elementwise ops run a vector loop and a scalar tail whose exp,
 * sigmoid and silu round differently, so a value's bits depended on where it fell in a
 * step's tensor (a prompt in chunks was ~7e-6 from one shot, a forked row 1e-5 from its
 * batch of one), and the reductions over dk could be split by threads; here every value is
 * computed one way whatever the step holds: a (b, h) pair's work in one thread, the lanes
 * of dv with masked tails (no scalar tail), the sums over dk in order, those over dk / dv
 * of a norm in 16 lanes added in one fixed order. Products and sums stay separate roundings
 * (-std=c11: no contraction), so the portable builds compute the same values with
 * scalar exp (their own bits, one way). Part of qgemm.c's one translation unit.
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

/* acc[j] = acc[j] + s[j] * c for n values */
static inline void delta_axpy(float *acc, const float *s, float c, int64_t n) {
    int64_t j = 0;
#if KVLM_V512
    const __m512 cv = _mm512_set1_ps(c);
    for (; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), cv);
        _mm512_mask_storeu_ps(acc + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, acc + j), p));
    }
#endif
    for (; j < n; j++) acc[j] = acc[j] + s[j] * c;
}

/* One sequence's value head over its T tokens (the module comment): S its (dk, dv) state,
 * updated in place; rows of conv, z, b, a and out at its first row on; the state after
 * row at[i] (i < na: ascending rows of this sequence) copied to snap + i * stride too. */
static void delta_head(const float *conv, const float *z, const float *bb, const float *aa,
                       float a_log, float dt_bias, const float *w, float eps, float *S,
                       float *out, int64_t T, int64_t h, int64_t nk, int64_t nv, int64_t dk,
                       int64_t dv, const int64_t *at, int64_t na, float *snap, int64_t stride) {
    float q[DELTA_MAX_DIM], k[DELTA_MAX_DIM], v[DELTA_MAX_DIM], kv[DELTA_MAX_DIM],
        o[DELTA_MAX_DIM], gate[DELTA_MAX_DIM];
    const int64_t C = 2 * nk * dk + nv * dv, kh = h / (nv / nk);
    const float scale = (float)(1.0 / sqrt((double)dk)), decay_rate = -expf(a_log);
    int64_t next = 0; /* the next of at[] */
    for (int64_t t = 0; t < T; t++) {
        const float *x = conv + t * C;
        delta_silu_row(x + kh * dk, q, dk);
        delta_silu_row(x + nk * dk + kh * dk, k, dk);
        delta_silu_row(x + 2 * nk * dk + h * dv, v, dv);
        const float rq = 1.0f / sqrtf(delta_sum_squares(q, dk) + 1e-6f);
        const float rk = 1.0f / sqrtf(delta_sum_squares(k, dk) + 1e-6f);
        for (int64_t i = 0; i < dk; i++) {
            q[i] = q[i] * rq * scale;
            k[i] = k[i] * rk;
        }
        const float beta = 1.0f / (1.0f + expf(-bb[t * nv + h]));
        const float decay = expf(decay_rate * delta_softplus(aa[t * nv + h] + dt_bias));
        /* S = S decay; kv = S^T k (rows of S in order) */
        for (int64_t j = 0; j < dv; j++) kv[j] = 0.f;
        for (int64_t i = 0; i < dk; i++) {
            delta_scale(S + i * dv, decay, dv);
            delta_axpy(kv, S + i * dv, k[i], dv);
        }
        for (int64_t j = 0; j < dv; j++) {
            kv[j] = (v[j] - kv[j]) * beta; /* the delta */
            o[j] = 0.f;
        }
        /* S = S + k (x) delta; o = S^T q */
        for (int64_t i = 0; i < dk; i++) {
            delta_axpy(S + i * dv, kv, k[i], dv);
            delta_axpy(o, S + i * dv, q[i], dv);
        }
        /* the gated RMSNorm */
        const float r = 1.0f / sqrtf(delta_sum_squares(o, dv) / (float)dv + eps);
        delta_silu_row(z + t * nv * dv + h * dv, gate, dv);
        float *y = out + t * nv * dv + h * dv;
        for (int64_t j = 0; j < dv; j++) y[j] = o[j] * r * w[j] * gate[j];
        if (next < na && at[next] == t) {
            memcpy(snap + next * stride, S, (size_t)(dk * dv) * sizeof(float));
            next++;
        }
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
 * `state`, read first from that row of state_in (NULL: state's own, updated in place).
 * `work` the step's multiply-adds, whether threads pay. */
static void gated_delta_heads(const float *conv, const float *z, const float *b, const float *a,
                              const float *a_log, const float *dt_bias, const float *w, float e,
                              const float *state_in, const int64_t *seq, float *state,
                              float *out, const int64_t *cu, int64_t S, const int64_t *at,
                              int64_t atn, float *snaps, int64_t nk, int64_t nv, int64_t dk,
                              int64_t dv, int64_t work) {
    const int64_t C = 2 * nk * dk + nv * dv, vd = nv * dv, heads = S * nv;
#pragma omp parallel for schedule(dynamic) if (heads > 1 && work >= 16384)
    for (int64_t p = 0; p < heads; p++) {
        const int64_t s = p / nv, h = p % nv, r0 = cu[s], T = cu[s + 1] - cu[s];
        int64_t i0, local[DELTA_MAX_AT];
        const int64_t na = seq_kept(at, atn, r0, T, local, &i0);
        const int64_t at_row = ((seq ? seq[s] : s) * nv + h) * dk * dv;
        if (state_in) memcpy(state + at_row, state_in + at_row,
                             (size_t)(dk * dv) * sizeof(float)); /* this head's, in cache */
        delta_head(conv + r0 * C, z + r0 * vd, b + r0 * nv, a + r0 * nv, a_log[h], dt_bias[h],
                   w, e, state + at_row, out + r0 * vd, T, h, nk, nv, dk, dv, local, na,
                   na ? snaps + (i0 * nv + h) * dk * dv : NULL, nv * dk * dv);
    }
}

/* The step of one gated DeltaNet layer over S sequences, sequence s the rows cu[s] ..
 * cu[s + 1] - 1 of the step (cu: S + 1 offsets, cun of them; 0 first, never decreasing;
 * a sequence of no rows keeps its state): conv [rows, C] (C = 2 nk dk + nv dv: q|k|v,
 * before silu), z [rows, nv dv], b and a [rows, nv], a_log and dt_bias [nv] (hn), w [dv]
 * (wn: the gated norm's weight), state [S, nv, dk, dv] (sn floats: read and updated), out
 * [rows, nv dv] (on floats). `state_in` (NULL: `state` is read and updated in place):
 * the states before the step, [S, nv, dk, dv] as `state` (sn floats too), `state` then
 * only written (the caller keeps the states before, no copy of its own). Each buffer's
 * length follows it, in floats. `at` (atn
 * entries, or NULL): rows of the step, strictly ascending; the state of row at[i]'s
 * sequence after that row copied into snaps [atn, nv, dk, dv] (pn floats) at i too (a
 * state at a block's end, for prefix hits; at each draft row, for a rollback), at most
 * DELTA_MAX_AT of one sequence's. Returns 0,
 * or -2, nothing read or written, for a shape out of range (S, nk >= 1; nv a multiple of
 * nk; dk, dv in 1..DELTA_MAX_DIM; cu or at not as said) or a buffer shorter than its
 * shape. */
int kvlm_gated_delta(const float *conv, int64_t cn, const float *z, int64_t zn,
                     const float *b, int64_t bn, const float *a, int64_t an,
                     const float *a_log, const float *dt_bias, int64_t hn, const float *w,
                     int64_t wn, double eps, const float *state_in, float *state, int64_t sn,
                     float *out, int64_t on,
                     const int64_t *cu, int64_t cun, const int64_t *at, int64_t atn,
                     float *snaps, int64_t pn, int64_t S, int64_t nk, int64_t nv, int64_t dk,
                     int64_t dv) {
    int64_t rows, C, need, heads, vd, work;
    if (S < 1 || nk < 1 || nv < nk || nv % nk || !cu || cun != S + 1 || cu[0] != 0) return -2;
    if (dk < 1 || dk > DELTA_MAX_DIM || dv < 1 || dv > DELTA_MAX_DIM) return -2;
    if (!conv || !z || !b || !a || !a_log || !dt_bias || !w || !state || !out) return -2;
    if ((rows = step_rows(cu, S, at, &atn, snaps)) < 0) return -2;
    if (hn != nv || wn != dv || !mul_ok(S, nv, &heads) || !mul_ok(nv, dv, &vd)) return -2;
    if (!mul_ok(nk, 2 * dk, &C) || !add_ok(C, vd, &C)) return -2;
    if (!mul_ok(rows, C, &need) || cn < need) return -2;
    if (!mul_ok(rows, vd, &need) || zn < need || on < need) return -2;
    if (!mul_ok(need, dk, &work)) work = INT64_MAX; /* the step's work, for the threads */
    if (!mul_ok(rows, nv, &need) || bn < need || an < need) return -2;
    if (!mul_ok(heads, dk * dv, &need) || sn < need) return -2;
    if (!mul_ok(atn, nv * dk * dv, &need) || (at && pn < need)) return -2;
    gated_delta_heads(conv, z, b, a, a_log, dt_bias, w, (float)eps, state_in, NULL, state, out,
                      cu, S, at, atn, snaps, nk, nv, dk, dv, work);
    return 0;
}
