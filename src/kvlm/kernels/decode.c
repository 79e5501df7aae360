/* ------------------------------------------------------------------------------------
 * One decode step of a Llama-family or Gemma 2/3 model, or one with short convolutions,
 * whole, for B sequences over their K/V caches (contiguous, paged, a hybrid cache's ring:
 * kvlm_kv_view) and their conv layers' rows (kvlm_conv_view): the per-token path without
 * ~500 small torch ops. The math is the torch model's (kvlm.model.transformer), in the
 * same order; only summation order differs. (Part of qgemm.c's one translation unit: the K/V attention it calls is kv*.c's,
 * the short convolution's conv.c's, the products weights.c's.)
 * ------------------------------------------------------------------------------------ */

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

static inline int is_recurrent(int64_t mixer) { return mixer == MIX_DELTA || mixer == MIX_MAMBA2; }

/* A recurrent layer's sizes from the model's (rec_*: nv value heads of dv, nk key heads
 * (groups) of dk): its convolution's channels (DeltaNet q|k|v = 2 nk dk + nv dv; Mamba2
 * x|B|C = nv dv + 2 nk dk), out_proj's input (nv dv), in_proj's rows (DeltaNet q|k|v, z,
 * b, a; Mamba2 z, x|B|C, dt), its gates a row (DeltaNet b and a; Mamba2 dt), a
 * sequence's state (nv dk dv floats either way) and its carried rows (DeltaNet: nv heads
 * of DELTA_CHUNK - 1 rows of DELTA_ROW floats; Mamba2 none) */
typedef struct {
    int64_t conv, inner, in, gates, state, carried;
} rec_sizes;

static rec_sizes rec_sizes_of(const kvlm_qmodel *m, int64_t mixer) {
    const int64_t nv = m->rec_heads, dv = m->rec_head_dim, dk = m->rec_key_dim;
    rec_sizes r;
    r.inner = nv * dv;
    r.conv = 2 * m->rec_groups * dk + r.inner;
    r.gates = mixer == MIX_DELTA ? 2 * nv : nv;
    r.in = r.conv + r.inner + r.gates;
    r.state = nv * dk * dv;
    r.carried = mixer == MIX_DELTA ? nv * (DELTA_CHUNK - 1) * DELTA_ROW(dk, dv) : 0;
    return r;
}

/* the model's recurrent kind (MIX_DELTA or MIX_MAMBA2: every recurrent layer's), or -1 */
static int64_t recurrent_kind(const kvlm_qmodel *m) {
    for (int64_t l = 0; l < m->n_layers; l++)
        if (is_recurrent(m->layers[l].mixer)) return m->layers[l].mixer;
    return -1;
}

/* Whether a recurrent layer's sizes are in range (its kernel's limits: deltanet.c,
 * mamba2.c), it is of the model's one recurrent kind, and its weights are of the shapes
 * they give */
static int recurrent_ok(const kvlm_qmodel *m, const kvlm_qlayer *L) {
    const int64_t H = m->hidden, nv = m->rec_heads, dv = m->rec_head_dim;
    const int64_t dk = m->rec_key_dim, nk = m->rec_groups;
    if (L->mixer != recurrent_kind(m) || nk < 1 || nv < nk || nv > 4096 || nv % nk) return 0;
    if (dk < 1 || dv < 1 || dk > DELTA_MAX_DIM || dv > DELTA_MAX_DIM || dk > MAMBA_MAX_DIM ||
        dv > MAMBA_MAX_DIM || !(m->rec_eps >= 0.0f))
        return 0;
    if (L->mixer == MIX_MAMBA2 && (!L->d || nv * dv / nk > MAMBA_MAX_GROUP)) return 0;
    const rec_sizes r = rec_sizes_of(m, L->mixer);
    return m->conv_kernel >= 2 && m->conv_kernel <= MAX_CONV_KERNEL && L->taps && L->a_log &&
           L->dt_bias && L->gnorm && qmat_ok(&L->in_proj, r.in, H) &&
           qmat_ok(&L->out_proj, H, r.inner);
}

/* q|k|v's rows a token: Hq query heads (twice: q|gate, with attn_gate), Hkv K and V */
static inline int64_t qkv_rows(const kvlm_qmodel *m) {
    return ((m->attn_gate ? 2 : 1) * m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
}

/* Whether layer L's mixer is one the step runs, with its products of the shape the
 * model's sizes give them: attention's q|k|v and o, a conv layer's in_proj and out_proj
 * and its taps (conv_kernel of them in range), a recurrent layer's (recurrent_ok) */
static int mixer_ok(const kvlm_qmodel *m, const kvlm_qlayer *L) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads;
    if (L->mixer == MIX_CONV)
        return m->conv_kernel >= 2 && m->conv_kernel <= MAX_CONV_KERNEL && L->taps &&
               qmat_ok(&L->in_proj, 3 * H, H) && qmat_ok(&L->out_proj, H, H);
    if (is_recurrent(L->mixer)) return recurrent_ok(m, L);
    return L->mixer == MIX_ATTENTION && qmat_ok(&L->qkv, qkv_rows(m), H) &&
           qmat_ok(&L->o, H, Hq * D);
}

/* The model's sizes in range (each far past a real model's, short of overflowing the
 * scratch's size) and every product of the shape they give it: the step reads each
 * weight, norm and buffer by these sizes, so a weight of another shape is refused here,
 * not read past its end. 1 when so. */
static int model_ok(const kvlm_qmodel *m) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t I = m->inter;
    if (m->n_layers < 1 || m->n_layers > (1 << 16) || H < 1 || H > (1 << 22) || I < 1 ||
        I > (1 << 22))
        return 0;
    if (D < 2 || D > MAX_HEAD_DIM || Hq < 1 || Hq > 4096 || Hkv < 1 || Hkv > Hq) return 0;
    if (m->rotary_dim < 2 || m->rotary_dim > D || m->rotary_dim % 2 || (m->attn_gate >> 1) ||
        (m->qk_norm_whole >> 1))
        return 0;
    if (m->slots < 1 || m->slots > ((int64_t)1 << 26) || !m->layers || !m->final_norm) return 0;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        const int ffn_ok = L->ffn == FFN_EXPERTS ? experts_ok(m, L)
                           : L->ffn == FFN_MLP
                               ? qmat_ok(&L->gate_up, 2 * I, H) && qmat_ok(&L->down, H, I)
                               : 0;
        if (!L->input_norm || !L->post_norm || !mixer_ok(m, L) || !ffn_ok) return 0;
    }
    return qmat_ok(&m->lm_head, m->lm_head.n, H);
}

/* how many of the model's layers are conv layers (MIX_CONV), recurrent ones (recurrent) */
static int64_t layers_of(const kvlm_qmodel *m, int recurrent) {
    int64_t n = 0;
    for (int64_t l = 0; l < m->n_layers; l++)
        n += recurrent ? is_recurrent(m->layers[l].mixer) : m->layers[l].mixer == MIX_CONV;
    return n;
}

/* floats a row of the step's conv layers needs (bufs_of): in_proj's output, the taps',
 * and every conv layer's u, kept for the rows' update at the end; 0 without conv layers */
static int64_t conv_floats(const kvlm_qmodel *m) {
    const int64_t convs = layers_of(m, 0);
    return convs ? (4 + convs) * m->hidden : 0;
}

/* floats a row of the step's recurrent layers needs (bufs_of): in_proj's output, the
 * convolution's, z, the gates, the kernel's output, and every recurrent layer's conv
 * input u, kept for the rows' update at the end; 0 without recurrent layers */
static int64_t recurrent_floats(const kvlm_qmodel *m) {
    const int64_t n = layers_of(m, 1);
    if (!n) return 0;
    const rec_sizes r = rec_sizes_of(m, recurrent_kind(m));
    return r.in + r.conv + 2 * r.inner + r.gates + n * r.conv;
}

/* floats of scratch a step of B rows needs (bufs_of), the model's sizes in range */
static int64_t scratch_floats(const kvlm_qmodel *m, int64_t B) {
    const int64_t D = m->head_dim, Hq = m->n_heads;
    const int64_t row = 2 * m->hidden + qkv_rows(m) + 2 * Hq * D + 3 * m->inter +
                        Hq * m->slots + Hq * MAX_CHUNKS * (D + 2) + Hq * (query_stride(D) / 4 + 2) +
                        Hq * Q4_QG + conv_floats(m) + recurrent_floats(m) + experts_floats(m);
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
    if (n_views < 0 || (n_views > 0 && !views)) return -2;
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
        if (L->mixer != MIX_ATTENTION) continue; /* a conv layer's rows: check_convs */
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
 * quantized K through R first (stored as k R), a quantized V through val_rot where it is
 * set (stored as v R; attend_layer undoes it on the output) */
static void write_kv(const kvlm_qmodel *m, const layer_kv *lk, int64_t b, int64_t p,
                     int64_t g, const float *k, const float *v, float *rot) {
    const int64_t D = m->head_dim, t = slot_of(lk->ring, p), slot = t % lk->bs;
    const int64_t blk = lk->tables[b * lk->width + t / lk->bs];
    if (kv_quantized(lk->k.dt)) {
        rotate(k, m->key_rot, D, rot);
        k = rot;
    }
    write_row(&lk->k, blk, g, slot, k, D);
    if (m->val_rot && kv_quantized(lk->v.dt)) { /* rot is free again: K is written */
        rotate(v, m->val_rot, D, rot);
        v = rot;
    }
    write_row(&lk->v, blk, g, slot, v, D);
}

/* The step's buffers in its scratch (kvlm_decode_scratch) */
typedef struct {
    float *h, *qkv, *att, *gate, *gu, *act, *tmp, *scores, *part, *qsc, *qsum, *qgs, *rot;
    int8_t *q8;
    float *cin, *cy, *u; /* conv layers: in_proj's output, the taps', each layer's u */
    /* recurrent layers: in_proj's output, the convolution's, z, the gates, the kernel's
     * output, each layer's u (recurrent_floats) */
    float *rin, *rcy, *rz, *rg, *ro, *ru;
    float *ex; /* expert layers: experts_floats a row (experts.c carves it) */
} step_bufs;

static step_bufs bufs_of(const kvlm_qmodel *m, int64_t B, float *scratch) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads, I = m->inter;
    step_bufs s;
    s.h = scratch;                                      /* B H */
    s.qkv = s.h + B * H;                                /* B qkv_rows: (Hq + 2 Hkv) D used */
    s.att = s.qkv + B * qkv_rows(m);                    /* B Hq D */
    s.gate = s.att + B * Hq * D;                        /* B Hq D: attn_gate's */
    s.gu = s.gate + B * Hq * D;                         /* B 2 I */
    s.act = s.gu + B * 2 * I;                           /* B I */
    s.tmp = s.act + B * I;                              /* B H */
    s.scores = s.tmp + B * H;                           /* B Hq S */
    s.part = s.scores + B * Hq * m->slots;  /* per (row, head, chunk): o [D], max, sum */
    s.qsc = s.part + B * Hq * MAX_CHUNKS * (D + 2);     /* B Hq: the int8 queries' sq */
    s.qsum = s.qsc + B * Hq;                            /* B Hq: their code sums */
    s.qgs = s.qsum + B * Hq;   /* B Hq Q4_QG: a q4 K's queries' scale per group (q4_group) */
    s.rot = s.qgs + B * Hq * Q4_QG;                     /* D: a row times R (int8 cache) */
    s.q8 = (int8_t *)(s.rot + D);                       /* B Hq QS: the int8 queries */
    s.cin = (float *)(s.q8 + B * Hq * query_stride(D)); /* B 3H: B | C | x (conv_floats) */
    s.cy = s.cin + B * 3 * H;                           /* B H: C * the taps */
    s.u = s.cy + B * H; /* conv layers x B H: each one's u, in the order of the layers */
    float *rec = s.cin + B * conv_floats(m); /* recurrent_floats */
    const int64_t kind = recurrent_kind(m);
    if (kind >= 0) {
        const rec_sizes r = rec_sizes_of(m, kind);
        s.rin = rec;                  /* B r.in: in_proj's output */
        s.rcy = s.rin + B * r.in;     /* B r.conv: the convolution's */
        s.rz = s.rcy + B * r.conv;    /* B r.inner: z */
        s.rg = s.rz + B * r.inner;    /* B r.gates: b | a, or dt */
        s.ro = s.rg + B * r.gates;    /* B r.inner: the kernel's output */
        s.ru = s.ro + B * r.inner;    /* recurrent layers x B r.conv: each one's u */
    } else {
        s.rin = s.rcy = s.rz = s.rg = s.ro = s.ru = NULL;
    }
    s.ex = rec + B * recurrent_floats(m);
    return s;
}

/* Each row's q|k|v after the product (its bias added): the q/k norms, RoPE at the row's
 * position (the layer's table; the first rotary_dim of each head), K/V written into the
 * row's slot, the queries rounded to int8 for an int8 cache (scaled, rotated) */
static void prepare_rows(const kvlm_qmodel *m, const kvlm_qlayer *L, const layer_kv *lk,
                         int64_t B, const int64_t *pos, const float *cos, const float *sin,
                         const step_bufs *s) {
    const int64_t D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t QKV = (Hq + 2 * Hkv) * D, QS = query_stride(D), R = m->rotary_dim;
    const float *c = cos + L->rope * m->slots * R, *sn = sin + L->rope * m->slots * R;
    for (int64_t b = 0; b < B; b++) {
        float *q = s->qkv + b * QKV;
        const int64_t p = pos[b];
        if (L->q_norm && m->qk_norm_whole) { /* each whole projection, before RoPE */
            rms_norm(q, L->q_norm, Hq * D, m->eps, q);
            rms_norm(q + Hq * D, L->k_norm, Hkv * D, m->eps, q + Hq * D);
        } else if (L->q_norm) /* per head, before RoPE (Attention.forward) */
            for (int64_t j = 0; j < Hq + Hkv; j++)
                rms_norm(q + j * D, j < Hq ? L->q_norm : L->k_norm, D, m->eps, q + j * D);
        for (int64_t j = 0; j < Hq + Hkv; j++) rope(q + j * D, c + p * R, sn + p * R, R);
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
 * the threads, then each head's chunks merged by log-sum-exp (and times R^T where V is
 * stored rotated, val_rot). `sinks` (n_heads, NULL:
 * none): a head's sink logit joins the merge as a chunk of its own with no value, the max
 * starting at it and the sum at exp(sink - max), before the chunks' terms (the chunks
 * themselves do not see it: K's and V's dtypes' kernels are the same with or without). */
static void attend_layer(const kvlm_qmodel *m, const layer_kv *lk, const step_bufs *s,
                         int64_t B, const int64_t *pos, const float *sinks) {
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
            const float sink = sinks ? sinks[j - b * Hq] : -INFINITY;
            float M = sink, Lsum = 0.f, *out = s->att + j * D;
            for (int64_t c = 0; c < chunks; c++)
                M = pj[c * (D + 2) + D] > M ? pj[c * (D + 2) + D] : M;
            if (sinks) Lsum = expf(sink - M);
            memset(out, 0, D * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const float *pc = pj + c * (D + 2);
                float w = expf(pc[D] - M);
                Lsum += w * pc[D + 1];
                axpy_kv(w, (const char *)pc, KV_F32, out, D);
            }
            for (int64_t i = 0; i < D; i++) out[i] /= Lsum;
            if (m->val_rot && kv_quantized(lk->v.dt)) /* o R R^T: R^T = R (Hadamard's) */
                rotate(out, m->val_rot, D, out);
        }
    }
}

/* x += y (B rows of n), y first normed by w where there is one (Gemma's sandwich norms),
 * then times `scale` where it is not 0 (Granite's residual multiplier: a product, then
 * the sum, as the torch model rounds them) */
static void add_residual(float *x, float *y, const float *w, int64_t B, int64_t n, float eps,
                         float scale) {
    for (int64_t b = 0; b < B && w; b++) rms_norm(y + b * n, w, n, eps, y + b * n);
    if (scale != 0.0f)
        for (int64_t i = 0; i < B * n; i++) y[i] = y[i] * scale;
    for (int64_t i = 0; i < B * n; i++) x[i] += y[i];
}

/* how product `bit` rounds x (matmul_rows' act) */
static inline int act_of(const kvlm_qmodel *m, int64_t bit) {
    return (m->act_int8 & bit) ? ((m->act_int16 & bit) ? 2 : 1) : 0;
}

/* y [B, n] += bias [n] where there is one (after the product, as torch's Linear adds it) */
static void add_bias(float *y, const float *bias, int64_t B, int64_t n) {
    for (int64_t i = 0; bias && i < B * n; i++) y[i] += bias[i % n];
}

/* An attention layer's mixer: the normed rows s->h to s->tmp (q|k|v, RoPE, the K/V
 * written, attention, o); 0 or -1 (a product's) */
static int attention_mix(const kvlm_qmodel *m, const kvlm_qlayer *L, const kvlm_kv_view *views,
                         int64_t B, const int64_t *pos, const float *cos, const float *sin,
                         const step_bufs *s) {
    const layer_kv lk = layer_kv_of(m, L, views);
    const int64_t D = m->head_dim, Hq = m->n_heads, QG = qkv_rows(m);
    const int64_t QKV = (Hq + 2 * m->n_kv_heads) * D;
    if (matmul_rows(&L->qkv, s->h, B, s->qkv, act_of(m, ACT_QKV))) return -1;
    add_bias(s->qkv, L->qkv_bias, B, QG);
    if (m->attn_gate) /* q|gate|k|v: the gate aside, q|k|v rows packed (row b's moves down) */
        for (int64_t b = 0; b < B; b++) {
            float *row = s->qkv + b * QG;
            memcpy(s->gate + b * Hq * D, row + Hq * D, Hq * D * sizeof(float));
            memmove(s->qkv + b * QKV, row, Hq * D * sizeof(float));
            memmove(s->qkv + b * QKV + Hq * D, row + 2 * Hq * D, (QKV - Hq * D) * sizeof(float));
        }
    prepare_rows(m, L, &lk, B, pos, cos, sin, s);
    attend_layer(m, &lk, s, B, pos, L->sinks);
    if (m->attn_gate) /* the output times sigmoid(gate), element by element */
        for (int64_t i = 0; i < B * Hq * D; i++)
            s->att[i] = s->att[i] * (1.0f / (1.0f + expf(-s->gate[i])));
    if (matmul_rows(&L->o, s->att, B, s->tmp, act_of(m, ACT_O))) return -1;
    add_bias(s->tmp, L->o_bias, B, m->hidden);
    return 0;
}

/* A conv layer's mixer (conv.c), the `c`-th of the model's: s->h to s->tmp, in_proj, the
 * gated taps over its rows, out_proj; its u rows kept in s->u for the rows' update */
static int conv_mix(const kvlm_qmodel *m, const kvlm_qlayer *L, const kvlm_conv_view *convs,
                    int64_t B, const int64_t *pos, const step_bufs *s, int64_t c) {
    const int64_t H = m->hidden;
    if (matmul_rows(&L->in_proj, s->h, B, s->cin, act_of(m, ACT_CONV_IN))) return -1;
    add_bias(s->cin, L->in_bias, B, 3 * H);
    conv_rows(m, L, convs + L->view, L->index, B, pos, s->cin, s->u + c * B * H, s->cy);
    if (matmul_rows(&L->out_proj, s->cy, B, s->tmp, act_of(m, ACT_CONV_OUT))) return -1;
    add_bias(s->tmp, L->out_bias, B, H);
    return 0;
}

/* The draft rows of a step whose row b feeds sequence seq[b] (runs of one sequence
 * consecutive: conv_view_ok): every row of a run but its last, the rows whose state a
 * state view keeps (kvlm_state_view.snaps), written to at[] where at is not NULL; their
 * count */
static int64_t draft_rows(const int64_t *seq, int64_t B, int64_t *at) {
    int64_t n = 0;
    for (int64_t b = 0; b + 1 < B; b++)
        if (seq[b + 1] == seq[b]) {
            if (at) at[n] = b;
            n++;
        }
    return n;
}

/* -2 unless every state view holds what the step reads and writes there: its conv rows
 * (conv_view_ok: a sequence's rows one run, CONV_ROWS), the states before the step of
 * each of its layers and sequences within in's bytes, out's rows (each row's sequence's
 * among them) within out's, a run's draft rows at most DELTA_MAX_AT, their states
 * within snaps' rows and bytes, the rows' u within urows' (where given), a DeltaNet's carried rows laid out as the states
 * (win, win_out, wsnaps; in place exactly where the states are); each recurrent layer's
 * view and index within them, its view's conv rows, states and carried rows of its
 * sizes */
static int check_states(const kvlm_qmodel *m, int64_t B, const int64_t *pos,
                        const kvlm_state_view *states, int64_t n_states) {
    const int64_t kind = recurrent_kind(m);
    int64_t need;
    if (n_states < 0 || (n_states > 0 && !states)) return -2;
    for (int64_t v = 0; v < n_states; v++) {
        const kvlm_state_view *V = states + v;
        const int64_t per = V->state * (int64_t)sizeof(float);
        if (conv_view_ok(&V->conv, B, pos, m->conv_kernel) || V->conv.layout != CONV_ROWS)
            return -2;
        if (!V->in || !V->out || V->state < 1 || V->out_rows < 1) return -2;
        if (V->in == V->out && V->out_rows != V->conv.batch) return -2; /* in place */
        for (int64_t b = 0; b < B; b++)
            if (V->conv.seq[b] >= V->out_rows) return -2; /* its row of out */
        if (!mul_ok(V->conv.layers, V->conv.batch, &need) || !mul_ok(need, per, &need) ||
            V->in_bytes < need)
            return -2;
        if (!mul_ok(V->conv.layers, V->out_rows, &need) || !mul_ok(need, per, &need) ||
            V->out_bytes < need)
            return -2;
        const int64_t n_at = draft_rows(V->conv.seq, B, NULL);
        for (int64_t b = 0, run = 1; b + 1 < B; b++) /* a run keeps at most DELTA_MAX_AT */
            if ((run = V->conv.seq[b + 1] == V->conv.seq[b] ? run + 1 : 1) > DELTA_MAX_AT + 1)
                return -2;
        if (n_at > 0) { /* the draft rows' states: snaps (layers, snap_rows, state) */
            if (!V->snaps || V->snap_rows < n_at || !mul_ok(V->conv.layers, V->snap_rows, &need) ||
                !mul_ok(need, per, &need) || V->snaps_bytes < need)
                return -2;
        }
        if (V->urows && (!mul_ok(V->conv.layers, B, &need) || !mul_ok(need, V->conv.width, &need) ||
                         !mul_ok(need, (int64_t)sizeof(float), &need) || V->urows_bytes < need))
            return -2;
        /* the carried rows, laid out as the states (none: Mamba2's) */
        const int64_t wper = V->carried * (int64_t)sizeof(float);
        if (V->carried < 0 || (V->carried > 0 && (!V->win || !V->win_out))) return -2;
        if (V->carried > 0 && (V->win == V->win_out) != (V->in == V->out)) return -2;
        if (V->carried > 0 && (!mul_ok(V->conv.layers, V->conv.batch, &need) ||
                               !mul_ok(need, wper, &need) || V->win_bytes < need))
            return -2;
        if (V->carried > 0 && (!mul_ok(V->conv.layers, V->out_rows, &need) ||
                               !mul_ok(need, wper, &need) || V->win_out_bytes < need))
            return -2;
        if (V->carried > 0 && n_at > 0 &&
            (!V->wsnaps || !mul_ok(V->conv.layers, V->snap_rows, &need) ||
             !mul_ok(need, wper, &need) || V->wsnaps_bytes < need))
            return -2;
    }
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        if (!is_recurrent(L->mixer)) continue;
        const rec_sizes r = rec_sizes_of(m, kind);
        if (L->view < 0 || L->view >= n_states || L->index < 0) return -2;
        const kvlm_state_view *V = states + L->view;
        if (L->index >= V->conv.layers || V->conv.width != r.conv || V->state != r.state ||
            V->carried != r.carried)
            return -2;
    }
    return 0;
}

/* A recurrent layer's mixer, the `c`-th recurrent layer of the model: s->h to s->tmp,
 * in_proj; its convolution's input u (kept in s->ru for the rows' update, copied to the
 * view's urows where there are some), z and the gates each made contiguous; the taps over
 * its rows (conv_taps: its held rows and the run's earlier u); the layer's kernel
 * (deltanet.c, mamba2.c) over each sequence's run of rows from its state before the step
 * (its view's `in`, the sequence's row) to its state after (`out`, the same row; `in`
 * itself where out is in: the pool's slots, updated in place), the state after each draft
 * row but the run's last into the view's snaps; out_proj */
static int recurrent_mix(const kvlm_qmodel *m, const kvlm_qlayer *L,
                         const kvlm_state_view *states, int64_t B, const int64_t *pos,
                         const step_bufs *s, int64_t c) {
    const rec_sizes r = rec_sizes_of(m, L->mixer);
    const kvlm_state_view *V = states + L->view;
    const int64_t nv = m->rec_heads, dv = m->rec_head_dim, dk = m->rec_key_dim;
    const int64_t nk = m->rec_groups, delta = L->mixer == MIX_DELTA;
    /* in_proj's rows: DeltaNet q|k|v, z, b, a; Mamba2 z, x|B|C, dt */
    const int64_t at_u = delta ? 0 : r.inner, at_z = delta ? r.conv : 0;
    float *u = s->ru + c * B * r.conv;
    int64_t cu[MAX_BATCH + 1], seq[MAX_BATCH], at[MAX_BATCH], starts[MAX_BATCH], S = 0;
    if (matmul_rows(&L->in_proj, s->h, B, s->rin, act_of(m, ACT_CONV_IN))) return -1;
    add_bias(s->rin, L->in_bias, B, r.in);
    for (int64_t b = 0; b < B; b++) {
        const float *row = s->rin + b * r.in;
        memcpy(u + b * r.conv, row + at_u, r.conv * sizeof(float));
        memcpy(s->rz + b * r.inner, row + at_z, r.inner * sizeof(float));
        for (int64_t g = 0; g < r.gates; g++) /* b | a: b's rows, then a's (B nv each) */
            s->rg[(g / nv) * B * nv + b * nv + g % nv] = row[r.conv + r.inner + g];
        if (b == 0 || V->conv.seq[b] != V->conv.seq[b - 1]) { /* a sequence's run starts */
            cu[S] = b;
            starts[S] = pos[b];
            seq[S++] = V->conv.seq[b];
        }
    }
    cu[S] = B;
    if (V->urows)
        memcpy(V->urows + L->index * B * r.conv, u, (size_t)(B * r.conv) * sizeof(float));
    conv_taps(&V->conv, L->index, B, pos, u, L->taps, L->taps_bias, m->conv_kernel, r.conv,
              s->rcy);
    /* sequence s's state at row seq[s] of the layer's `in` and `out` (the same rows: a
     * one-sequence cache's out buffer, or the pool's slots updated in place); its draft
     * rows' states at the layer's rows of snaps */
    const float *in = V->in == V->out ? NULL : V->in + L->index * V->conv.batch * r.state;
    float *out = V->out + L->index * V->out_rows * r.state;
    const int64_t atn = draft_rows(V->conv.seq, B, at);
    float *snaps = atn ? V->snaps + L->index * V->snap_rows * r.state : NULL;
    const int64_t work = B * r.inner * dk;
    if (delta) { /* and its carried rows, laid out as its states */
        const float *win_in = V->win == V->win_out ? NULL
                                                   : V->win + L->index * V->conv.batch * r.carried;
        float *win = V->win_out + L->index * V->out_rows * r.carried;
        float *wsnaps = atn ? V->wsnaps + L->index * V->snap_rows * r.carried : NULL;
        gated_delta_heads(s->rcy, s->rz, s->rg, s->rg + B * nv, L->a_log, L->dt_bias, L->gnorm,
                          m->rec_eps, in, win_in, seq, out, win, s->ro, cu, starts, S,
                          atn ? at : NULL, atn, snaps, wsnaps, nk, nv, dk, dv, work);
    }
    else
        mamba2_run(s->rcy, s->rz, s->rg, L->a_log, L->dt_bias, L->d, L->gnorm, m->rec_eps, in,
                   seq, out, s->ro, cu, S, atn ? at : NULL, atn, snaps, nv, dv, dk, nk, B, work);
    if (matmul_rows(&L->out_proj, s->ro, B, s->tmp, act_of(m, ACT_CONV_OUT))) return -1;
    add_bias(s->tmp, L->out_bias, B, m->hidden);
    return 0;
}

/* One decode step for B sequences, one token each (B = 1 with a contiguous cache is the
 * single-stream decode; more rows are the server's batch, every product reading its weight
 * once for up to 16 rows; rows of one sequence at consecutive positions are a draft's).
 * Each buffer comes with its length (elements from its pointer on), checked against what
 * the step reads or writes there:
 *   x [B, hidden] (xn floats): the tokens' embeddings in (Gemma's scaled), overwritten;
 *   pos [B] (pn): each row's position (its token is written there; it attends over 0 ..
 *       pos, or over its last `window` positions: the layer's, or m->window);
 *   cos, sin [m->rope_tables, slots, rotary_dim] (cn, sn floats): RoPE at every position,
 *       the model's base then (Gemma 3) the local layers' (kvlm_qlayer.rope picks);
 *   views [n_views]: where the layers' K/V are (kvlm_kv_view, with its tables' entries
 *       and its stores' bytes; kvlm_qlayer.view, index);
 *   convs [n_convs]: where the conv layers' rows are (kvlm_conv_view, with its entries
 *       and bytes; kvlm_qlayer.view, index), moved on past the step's rows once its
 *       logits are made (none without conv layers);
 *   states [n_states]: where the recurrent layers' states and conv rows are
 *       (kvlm_state_view; kvlm_qlayer.view, index): the states before the step read from
 *       `in`, each sequence's after its rows written to `out` (a draft's earlier rows'
 *       to `snaps`), the conv rows moved on as a conv layer's (none without recurrent
 *       layers);
 *   scratch: kvlm_decode_scratch(m, B) floats (scn); logits [B, vocab] out (ln floats).
 * Returns 0; -2 when an argument is out of range (a weight not of the shape the model's
 * sizes give it, a buffer shorter than its shape, a position past the slots or a table,
 * a block id past its pool, a pool past its store's bytes, a ring shorter than a layer's
 * window, conv rows that do not hold the rows before a step's, a key_rot or val_rot not
 * Hadamard's where it must be: nothing is written); -1
 * when a product found no scratch memory (the conv rows as they were). */
int kvlm_decode_batch(const kvlm_qmodel *m, int64_t B, float *x, int64_t xn, const int64_t *pos,
                      int64_t pn, const float *cos, int64_t cn, const float *sin, int64_t sn,
                      const kvlm_kv_view *views, int64_t n_views, const kvlm_conv_view *convs,
                      int64_t n_convs, const kvlm_state_view *states, int64_t n_states,
                      float *scratch, int64_t scn, float *logits, int64_t ln) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->n_heads, Hkv = m->n_kv_heads;
    const int64_t I = m->inter;
    int64_t need;
    if (B < 1 || B > MAX_BATCH || !model_ok(m) || Hq % Hkv != 0) return -2;
    if (Hq / Hkv > 8 || D > MAX_HEAD_DIM || D % 2) return -2; /* the attention's buffers */
    if (m->window < 0 || m->k_dtype < KV_F32 || m->k_dtype > KV_Q4) return -2;
    if (m->v_dtype < KV_F32 || m->v_dtype > KV_Q4) return -2;
    if (kv_quantized(m->k_dtype) && !m->key_rot) return -2;
    /* rotate() takes a power-of-two D's R as Hadamard's (butterflies), and V's R^T as R */
    const int pow2 = !(D & (D - 1));
    if (m->key_rot && pow2 && !is_hadamard(m->key_rot, D)) return -2;
    if (m->val_rot && !(pow2 && m->val_rot == m->key_rot) && !is_hadamard(m->val_rot, D))
        return -2;
    /* the per-call buffers: x [B, hidden], pos [B], cos and sin [rope_tables, slots,
     * head_dim], the scratch, logits [B, vocab] */
    if (xn < B * H || pn < B || scn < scratch_floats(m, B)) return -2;
    if (!mul_ok(m->rope_tables, m->slots, &need) || !mul_ok(need, m->rotary_dim, &need) || cn < need ||
        sn < need)
        return -2;
    if (!mul_ok(B, m->lm_head.n, &need) || ln < need) return -2;
    for (int64_t b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= m->slots) return -2;
    if (check_views(m, B, pos, views, n_views) || check_convs(m, B, pos, convs, n_convs) ||
        check_states(m, B, pos, states, n_states))
        return -2;
    const step_bufs s = bufs_of(m, B, scratch);
    const float rs = m->residual_scale;
    for (int64_t l = 0, c = 0, r = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, L->input_norm, H, m->eps, s.h + b * H);
        const int rc = L->mixer == MIX_CONV      ? conv_mix(m, L, convs, B, pos, &s, c++)
                       : is_recurrent(L->mixer) ? recurrent_mix(m, L, states, B, pos, &s, r++)
                                                : attention_mix(m, L, views, B, pos, cos, sin, &s);
        if (rc) return -1;
        add_residual(x, s.tmp, L->attn_out_norm, B, H, m->eps, rs);
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, L->post_norm, H, m->eps, s.h + b * H);
        if (L->ffn == FFN_EXPERTS) {
            if (experts_ffn(m, L, B, s.h, s.tmp, s.ex, act_of(m, ACT_GATE_UP), act_of(m, ACT_DOWN)))
                return -1;
        } else {
            if (matmul_rows(&L->gate_up, s.h, B, s.gu, act_of(m, ACT_GATE_UP))) return -1;
            for (int64_t b = 0; b < B; b++)
                (m->gelu ? gelu_mul : silu_mul)(s.gu + b * 2 * I, s.gu + b * 2 * I + I,
                                                s.act + b * I, I);
            if (matmul_rows(&L->down, s.act, B, s.tmp, act_of(m, ACT_DOWN))) return -1;
        }
        add_residual(x, s.tmp, L->mlp_out_norm, B, H, m->eps, rs);
    }
    for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, m->final_norm, H, m->eps, s.h + b * H);
    if (matmul_rows(&m->lm_head, s.h, B, logits, act_of(m, ACT_HEAD))) return -1;
    for (int64_t l = 0, c = 0, r = 0; l < m->n_layers; l++) { /* the conv rows, the step made */
        const kvlm_qlayer *L = m->layers + l;
        if (L->mixer == MIX_CONV)
            conv_keep_rows(convs + L->view, L->index, B, pos, s.u + c++ * B * H, H);
        if (is_recurrent(L->mixer)) {
            const int64_t w = rec_sizes_of(m, L->mixer).conv;
            conv_keep_rows(&states[L->view].conv, L->index, B, pos, s.ru + r++ * B * w, w);
        }
    }
    return 0;
}

