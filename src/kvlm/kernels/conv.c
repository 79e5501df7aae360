/* ------------------------------------------------------------------------------------
 * The gated short convolution's decode rows (the conv layer kind, kvlm.model.conv): the
 * part of the decode step between a conv layer's two products (decode.c runs in_proj and
 * out_proj as it runs an attention layer's). From each row's in_proj output B | C | x:
 *
 *     u    = B * x                           the row's input to the convolution
 *     conv = taps[0] u[p - L + 1] + ... + taps[L - 1] u[p]   (+ the taps' bias)
 *     y    = C * conv                        what out_proj reads
 *
 * a depthwise causal convolution of L = conv_kernel taps per channel over the sequence's
 * held rows (kvlm_conv_view: its last `keep` rows of u, a one-sequence cache's rows or a
 * pool slot's ring: conv_row) and the step's own (conv_taps: a recurrent layer's
 * convolution too, over its q|k|v or x|B|C, decode.c's recurrent_mix). Once the step has made its logits, each
 * sequence's held rows move on past the step's rows (conv_keep_rows, what
 * kvlm.cache.conv.ConvRows.commit does to them; a slot's ring takes the new rows where
 * their positions fall), so a step that fails leaves them as they were. The arithmetic is ShortConv's, operation for operation
 * (a product, then a sum, tap by tap in order; -std=c11 keeps products and sums from
 * being fused into one rounding), so each value is the torch model's for the same in_proj
 * output, on every build. (Part of qgemm.c's one translation unit: decode.c calls these.)
 * ------------------------------------------------------------------------------------ */

/* -2 unless the conv view V holds what the step reads and writes there: a known layout,
 * its rows within its bytes, seq and ends within their entries, each step row's sequence
 * (slot) within its batch, the rows of one sequence consecutive in the step at consecutive
 * positions with one end (a draft's run), no sequence in two such runs, and the L - 1 rows
 * before each run held (end - keep + L - 1 <= start <= end); 0 when so */
static int conv_view_ok(const kvlm_conv_view *V, int64_t B, const int64_t *pos, int64_t L) {
    int64_t need;
    if (!V->rows || !V->seq || !V->ends || V->layers < 0 || V->batch < 1) return -2;
    if (V->keep < L - 1 || V->keep < 1 || V->width < 1 || V->entries < B) return -2;
    if (V->layout != CONV_ROWS && V->layout != CONV_SLOTS) return -2;
    if (!mul_ok(V->batch, V->keep, &need)) return -2;
    if (V->layout == CONV_SLOTS && !add_ok(need, 1, &need)) return -2; /* the zero row */
    if (!mul_ok(need, V->layers, &need) || !mul_ok(need, V->width, &need) ||
        !mul_ok(need, (int64_t)sizeof(float), &need) || V->bytes < need)
        return -2;
    for (int64_t b = 0; b < B; b++) {
        const int64_t s = V->seq[b];
        if (s < 0 || s >= V->batch || V->ends[b] < 0) return -2;
        if (b > 0 && s == V->seq[b - 1]) { /* the run goes on: the next position */
            if (pos[b] != pos[b - 1] + 1 || V->ends[b] != V->ends[b - 1]) return -2;
            continue;
        }
        for (int64_t a = 0; a < b; a++)
            if (V->seq[a] == s) return -2; /* the sequence's second run */
        const int64_t behind = V->ends[b] - pos[b];
        if (behind < 0 || behind > V->keep - (L - 1)) return -2;
    }
    return 0;
}

/* -2 unless every conv view holds what the step reads and writes there (conv_view_ok, its
 * rows a hidden wide) and each conv layer's view and index lie within them */
static int check_convs(const kvlm_qmodel *m, int64_t B, const int64_t *pos,
                       const kvlm_conv_view *convs, int64_t n_convs) {
    if (n_convs < 0 || (n_convs > 0 && !convs)) return -2;
    for (int64_t v = 0; v < n_convs; v++)
        if (conv_view_ok(convs + v, B, pos, m->conv_kernel) || convs[v].width != m->hidden)
            return -2;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *Lr = m->layers + l;
        if (Lr->mixer != MIX_CONV) continue;
        if (Lr->view < 0 || Lr->view >= n_convs || Lr->index < 0 ||
            Lr->index >= convs[Lr->view].layers)
            return -2;
    }
    return 0;
}

/* Layer `index`'s held row of position q (end - keep <= q < end, or q < 0) of sequence s
 * whose rows end at `end`: CONV_ROWS, row q - end + keep of the sequence's (zeros before 0
 * are rows of it); CONV_SLOTS, row q % keep of slot s's ring, the zero row for q < 0 */
static inline float *conv_row(const kvlm_conv_view *V, int64_t index, int64_t s, int64_t end,
                              int64_t q, int64_t H) {
    const int64_t keep = V->keep;
    if (V->layout == CONV_SLOTS) {
        const int64_t per = V->batch * keep + 1; /* a layer's rows: the rings, the zero row */
        return V->rows + (index * per + (q < 0 ? V->batch * keep : s * keep + q % keep)) * H;
    }
    return V->rows + ((index * V->batch + s) * keep + q - end + keep) * H;
}

/* One output row of a depthwise convolution: y[h] = rows[0][h] w[h] + rows[1][h] w[W + h]
 * + ... + rows[L - 1][h] w[(L - 1) W + h] (+ bias[h]): a product, then the sum, tap by tap
 * in order (ShortConv's and depthwise's operations; -std=c11: no contraction) */
static inline void taps_sum(float *y, const float *const *rows, const float *w,
                            const float *bias, int64_t L, int64_t W) {
    for (int64_t k = 0; k < L; k++) {
        const float *r = rows[k], *wk = w + k * W;
        if (k == 0)
            for (int64_t h = 0; h < W; h++) y[h] = r[h] * wk[h];
        else
            for (int64_t h = 0; h < W; h++) y[h] = y[h] + r[h] * wk[h];
    }
    if (bias)
        for (int64_t h = 0; h < W; h++) y[h] = y[h] + bias[h];
}

/* y [B, W] = the taps (L of them, each W wide: tap k of channel h at k W + h) over
 * positions pos - L + 1 .. pos of each row's input u [B, W] (+ the taps' bias), a position
 * before the row's run read from its sequence's held rows of layer `index` in V, one from
 * the run's first on from the run's own u: ShortConv's and depthwise's sum, tap by tap in
 * order */
static void conv_taps(const kvlm_conv_view *V, int64_t index, int64_t B, const int64_t *pos,
                      const float *u, const float *taps, const float *bias, int64_t L,
                      int64_t W, float *y) {
    for (int64_t b = 0, first = 0; b < B; b++) {
        if (b == 0 || V->seq[b] != V->seq[b - 1]) first = b;
        const int64_t start = pos[first], end = V->ends[b], seq = V->seq[b];
        const float *rows[MAX_CONV_KERNEL];
        for (int64_t k = 0; k < L; k++) {
            const int64_t q = pos[b] - (L - 1) + k; /* the position tap k reads */
            rows[k] = q >= start ? u + (first + q - start) * W
                                 : conv_row(V, index, seq, end, q, W);
        }
        taps_sum(y + b * W, rows, taps, bias, L, W);
    }
}

/* The prompt road's depthwise causal convolution (kvlm.model.conv.depthwise: every mixer
 * with one; its taps a cache step's Taps): y [N, C], output n the taps' rows of x summed,
 *
 *     y[n] = w[0] x[idx[0][n]] + w[1] x[idx[1][n]] + ... + w[L - 1] x[idx[L - 1][n]] (+ bias)
 *
 * as conv_taps sums it (a product, then the sum, tap by tap in order, then the bias; no
 * contraction), so a value's bits are the torch ops' this replaces, wherever it falls.
 * x: xr rows of C floats (xn from x on), idx: [L, N] row numbers (in entries, each below
 * xr), w [L, C] (wn floats), bias [C] (bn) or NULL, y [N, C] (yn). Returns 0, or -2,
 * nothing read past a buffer or written, for a size out of range or a buffer shorter
 * than its shape. */
int kvlm_depthwise(const float *x, int64_t xn, int64_t xr, const int64_t *idx, int64_t in,
                   int64_t L, int64_t N, int64_t C, const float *w, int64_t wn,
                   const float *bias, int64_t bn, float *y, int64_t yn) {
    int64_t need;
    if (!x || !idx || !w || !y || L < 1 || L > MAX_CONV_KERNEL || N < 1 || C < 1 || xr < 1)
        return -2;
    if (!mul_ok(xr, C, &need) || xn < need || !mul_ok(L, N, &need) || in < need) return -2;
    if (!mul_ok(L, C, &need) || wn < need || (bias && bn < C)) return -2;
    if (!mul_ok(N, C, &need) || yn < need) return -2;
    for (int64_t i = 0; i < L * N; i++)
        if (idx[i] < 0 || idx[i] >= xr) return -2;
#pragma omp parallel for schedule(static) if (N > 1 && N * C * L >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *rows[MAX_CONV_KERNEL];
        for (int64_t k = 0; k < L; k++) rows[k] = x + idx[k * N + n] * C;
        taps_sum(y + n * C, rows, w, bias, L, C);
    }
    return 0;
}

/* The conv layer Lr's rows of the step: u [B, H] = B * x of each row's in_proj output cin
 * [B, 3H] (B | C | x), then y [B, H] = C * (the taps over u: conv_taps) */
static void conv_rows(const kvlm_qmodel *m, const kvlm_qlayer *Lr, const kvlm_conv_view *V,
                      int64_t index, int64_t B, const int64_t *pos, const float *cin, float *u,
                      float *y) {
    const int64_t H = m->hidden;
    for (int64_t b = 0; b < B; b++) {
        const float *bx = cin + b * 3 * H; /* B, then (after C) x */
        for (int64_t h = 0; h < H; h++) u[b * H + h] = bx[h] * bx[2 * H + h];
    }
    conv_taps(V, index, B, pos, u, Lr->taps, Lr->taps_bias, m->conv_kernel, H, y);
    for (int64_t b = 0; b < B; b++) {
        const float *c = cin + b * 3 * H + H;
        for (int64_t h = 0; h < H; h++) y[b * H + h] = c[h] * y[b * H + h];
    }
}

/* Each sequence's held rows of layer `index` in V moved on past the step. CONV_ROWS, as
 * ConvRows.commit moves them: a run of n rows from `start` over rows that ended at `end`
 * now ends at start + n, its rows before start where they still fit in keep (zeros for
 * positions that were not held: a run shorter than the rollback before it), then its own
 * u rows (the last keep of them)
 *
 *     before   [ end - keep ............... start ... end )
 *     after              [ start + n - keep ... start | u: n rows )
 *
 * CONV_SLOTS: the run's u rows (the last keep of them) into the slot's ring at their
 * positions' rows, as kvlm.cache.conv.SlotStep.commit writes them (the zero row never) */
static void conv_keep_rows(const kvlm_conv_view *V, int64_t index, int64_t B,
                           const int64_t *pos, const float *u, int64_t H) {
    const int64_t keep = V->keep;
    for (int64_t b = 0, n = 1; b < B; b += n, n = 1) {
        while (b + n < B && V->seq[b + n] == V->seq[b]) n++;
        const int64_t first = n > keep ? n - keep : 0;
        if (V->layout == CONV_SLOTS) {
            for (int64_t i = first; i < n; i++) /* pos[b + i] >= 0: a row of the ring */
                memcpy(conv_row(V, index, V->seq[b], 0, pos[b + i], H), u + (b + i) * H,
                       H * sizeof(float));
            continue;
        }
        const int64_t behind = V->ends[b] - pos[b], shift = n - behind;
        float *r = V->rows + (index * V->batch + V->seq[b]) * keep * H;
        const int64_t before = keep - n; /* rows for the positions before start */
        if (before > 0) { /* row j <- row j + shift, zeros where that is below row 0 */
            const int64_t zero = behind - n <= 0 ? 0 : (behind - n < before ? behind - n : before);
            if (before > zero)
                memmove(r + zero * H, r + (zero + shift) * H, (before - zero) * H * sizeof(float));
            memset(r, 0, zero * H * sizeof(float));
        }
        for (int64_t i = first; i < n; i++)
            memcpy(r + (keep - n + i) * H, u + (b + i) * H, H * sizeof(float));
    }
}
