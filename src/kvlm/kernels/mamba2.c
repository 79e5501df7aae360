/* ------------------------------------------------------------------------------------
 * The Mamba2 layer's step after its convolution (the mamba2 mixer, kvlm.model.mamba2):
 * for each sequence and head h (group g = h / (heads / G)), token by token,
 *
 *     x | B | C = silu(the convolution's x|B|C)       x: the head's hd channels; B, C: g's N
 *     dt = softplus(dt + dt_bias); A = -exp(A_log)
 *     S = S exp(dt A) + x (x) (dt B);  y = S C + D x     S (hd, N), fp32
 *     y = y silu(z)
 *
 * then for each row and group, the gated norm: y = w y / sqrt(mean over the group's
 * inner / G channels of y^2 + eps). transformers' mamba2_selective_state_update and its
 * gated group RMSNorm (norm_before_gate False), in fp32. Why here and not in
 * torch: as deltanet.c, every value is computed one way whatever the step holds (a (b, h)
 * pair's work in one thread, masked tails, sums in one fixed order), so chunked = one
 * shot and batched = alone bit for bit. Uses deltanet.c's row helpers. Part of qgemm.c's
 * one translation unit.
 * ------------------------------------------------------------------------------------ */

#define MAMBA_MAX_DIM 512  /* the largest head_dim or state_size the step takes */
#define MAMBA_MAX_GROUP 16384 /* the most channels of one group of the norm */

/* One row of the state: s[j] = in[j] * c + b[j] * x for n values (two roundings each: no
 * contraction; `in` the row before, s itself but for a step's first token, whose state
 * before is state_in's), and returns sum of s[j] q[j] (the row's output: q is C), summed
 * in 16 lanes (masked tail) then the lanes in a fixed order: the row read once for both. */
static inline float mamba_row(float *s, const float *in, float c, const float *b, float x,
                              const float *q, int64_t n) {
    float sum = 0.f;
    int64_t j = 0;
#if KVLM_V512
    const __m512 cv = _mm512_set1_ps(c), xv = _mm512_set1_ps(x);
    __m512 acc = _mm512_setzero_ps();
    for (; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        const __m512 d = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, in + j), cv);
        const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, b + j), xv);
        const __m512 v = _mm512_add_ps(d, p);
        _mm512_mask_storeu_ps(s + j, k, v);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, q + j)));
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        s[j] = in[j] * c + b[j] * x;
        sum += s[j] * q[j];
    }
    return sum;
}

/* One sequence's head over its T tokens (the module comment, but the norm): S its
 * (hd, N) state, updated in place (read from `before` at the first token where that is
 * not NULL: the state before the step in its own buffer, not copied first; a sequence of
 * no tokens copies it); rows of conv, z, dt and out at its first row on; the
 * state after row at[i] (i < na: ascending rows of this sequence) copied to
 * snap + i * stride too. */
static void mamba_head(const float *conv, const float *z, const float *dts, float a_log,
                       float dt_bias, float d, const float *before, float *S, float *out,
                       int64_t T, int64_t h,
                       int64_t heads, int64_t hd, int64_t N, int64_t ng, const int64_t *at,
                       int64_t na, float *snap, int64_t stride) {
    float b[MAMBA_MAX_DIM];
    const int64_t inner = heads * hd, C = inner + 2 * ng * N, g = h / (heads / ng);
    const float A = -expf(a_log);
    int64_t next = 0; /* the next of at[] */
    if (before && T == 0) memcpy(S, before, (size_t)(hd * N) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        /* x, B, C and the gate already silu'd (the first pass of kvlm_mamba2) */
        const float *row = conv + t * C, *x = row + h * hd, *c = row + inner + ng * N + g * N;
        const float *gate = z + t * inner + h * hd, *bg = row + inner + g * N;
        const float *in = t == 0 && before ? before : S;
        const float dt = delta_softplus(dts[t * heads + h] + dt_bias);
        const float decay = expf(dt * A);
        for (int64_t n = 0; n < N; n++) b[n] = dt * bg[n]; /* dt B */
        float *y = out + t * inner + h * hd;
        for (int64_t p = 0; p < hd; p++) {
            const float sc = mamba_row(S + p * N, in + p * N, decay, b, x[p], c, N);
            y[p] = (sc + x[p] * d) * gate[p];
        }
        if (next < na && at[next] == t) {
            memcpy(snap + next * stride, S, (size_t)(hd * N) * sizeof(float));
            next++;
        }
    }
}

/* kvlm_mamba2's work, its arguments checked (the fused decode step's too): the silu
 * pass, each (sequence s, head) pair in one thread (its state at row seq[s], NULL: s, of
 * `state`, read first from that row of state_in; NULL: state's own, in place), the gated
 * norm; `work` the step's multiply-adds, whether threads pay. */
static void mamba2_run(float *conv, float *z, const float *dt, const float *a_log,
                       const float *dt_bias, const float *d, const float *w, float e,
                       const float *state_in, const int64_t *seq, float *state, float *out,
                       const int64_t *cu, int64_t S, const int64_t *at, int64_t atn,
                       float *snaps, int64_t heads, int64_t hd, int64_t N, int64_t ng,
                       int64_t rows, int64_t work) {
    const int64_t inner = heads * hd, C = inner + 2 * ng * N, pairs = S * heads, hdn = hd * N;
    /* silu of x|B|C and of z, a row at a time, in place: B and C once a group, not once
     * a head (a value's bits the same wherever its row is cut: deltanet.c's lanes) */
#pragma omp parallel for schedule(static) if (rows > 1 && work >= 16384)
    for (int64_t r = 0; r < rows; r++) {
        delta_silu_row(conv + r * C, conv + r * C, C);
        delta_silu_row(z + r * inner, z + r * inner, inner);
    }
#pragma omp parallel for schedule(dynamic) if (pairs > 1 && work >= 16384)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t s = p / heads, h = p % heads, r0 = cu[s], T = cu[s + 1] - cu[s];
        int64_t i0, local[DELTA_MAX_AT];
        const int64_t na = seq_kept(at, atn, r0, T, local, &i0);
        const int64_t at_row = ((seq ? seq[s] : s) * heads + h) * hdn;
        mamba_head(conv + r0 * C, z + r0 * inner, dt + r0 * heads, a_log[h], dt_bias[h], d[h],
                   state_in ? state_in + at_row : NULL, state + at_row, out + r0 * inner, T,
                   h, heads, hd, N, ng, local, na,
                   na ? snaps + (i0 * heads + h) * hdn : NULL, heads * hdn);
    }
    /* the gated norm, a (row, group) at a time: its channels' squares summed in one order */
    const int64_t size = inner / ng, cells = rows * ng;
#pragma omp parallel for schedule(static) if (cells > 1 && work >= 16384)
    for (int64_t q = 0; q < cells; q++) {
        float *y = out + q * size;
        const float *wg = w + (q % ng) * size;
        const float r = 1.0f / sqrtf(delta_sum_squares(y, size) / (float)size + e);
        for (int64_t j = 0; j < size; j++) y[j] = wg[j] * (y[j] * r);
    }
}

/* The step of one Mamba2 layer over S sequences, sequence s the rows cu[s] .. cu[s + 1] - 1
 * of the step (cu: S + 1 offsets, cun of them; 0 first, never decreasing; a sequence of
 * no rows keeps its state): conv [rows, C] (C = heads hd + 2 ng N: x|B|C, before silu),
 * z [rows, heads hd] (both overwritten with their silu: the caller's scratch), dt [rows, heads], a_log, dt_bias and d [heads] (hn), w [heads hd]
 * (wn: the gated norm's weight), state [S, heads, hd, N] (sn floats), out [rows, heads hd]
 * (on floats). `state_in`, `at` and `snaps` as kvlm_gated_delta's (the states before the
 * step, NULL for in place; rows whose state is copied out, at most DELTA_MAX_AT a
 * sequence). Returns 0, or -2, nothing read or written, for a shape out of range (S,
 * heads, ng >= 1; heads a multiple of ng; hd, N in 1..MAMBA_MAX_DIM; a group's channels at
 * most MAMBA_MAX_GROUP; cu or at not as said) or a buffer shorter than its shape. */
int kvlm_mamba2(float *conv, int64_t cn, float *z, int64_t zn, const float *dt,
                int64_t dn, const float *a_log, const float *dt_bias, const float *d,
                int64_t hn, const float *w, int64_t wn, double eps, const float *state_in,
                float *state, int64_t sn, float *out, int64_t on, const int64_t *cu,
                int64_t cun, const int64_t *at, int64_t atn, float *snaps, int64_t pn,
                int64_t S, int64_t heads, int64_t hd, int64_t N, int64_t ng) {
    int64_t rows, C, need, pairs, inner, hdn, work;
    if (S < 1 || heads < 1 || ng < 1 || heads % ng || !cu || cun != S + 1 || cu[0] != 0) return -2;
    if (hd < 1 || hd > MAMBA_MAX_DIM || N < 1 || N > MAMBA_MAX_DIM) return -2;
    if (!conv || !z || !dt || !a_log || !dt_bias || !d || !w || !state || !out) return -2;
    if ((rows = step_rows(cu, S, at, &atn, snaps)) < 0) return -2;
    if (hn != heads || !mul_ok(S, heads, &pairs) || !mul_ok(heads, hd, &inner)) return -2;
    if (wn != inner || inner / ng > MAMBA_MAX_GROUP) return -2;
    if (!mul_ok(ng, 2 * N, &C) || !add_ok(C, inner, &C)) return -2;
    if (!mul_ok(rows, C, &need) || cn < need) return -2;
    if (!mul_ok(rows, inner, &need) || zn < need || on < need) return -2;
    if (!mul_ok(need, N, &work)) work = INT64_MAX; /* the step's work, for the threads */
    if (!mul_ok(rows, heads, &need) || dn < need) return -2;
    if (!mul_ok(hd, N, &hdn) || !mul_ok(pairs, hdn, &need) || sn < need) return -2;
    if (!mul_ok(atn, heads * hdn, &need) || (at && pn < need)) return -2;
    mamba2_run(conv, z, dt, a_log, dt_bias, d, w, (float)eps, state_in, NULL, state, out, cu,
               S, at, atn, snaps, heads, hd, N, ng, rows, work);
    return 0;
}
