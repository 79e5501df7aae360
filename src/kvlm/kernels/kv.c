/* ------------------------------------------------------------------------------------
 * The K/V cache as the decode step's attention reads it (part of qgemm.c's one translation
 * unit), what every K and V dtype shares: a stored row's bytes, the exponentials, a row of
 * a float dtype read widened, where a KV head's rows lie (kv_span: contiguous, paged, a
 * ring) and fetching them ahead, the softmax pieces of a chunk's scores, and the rotation
 * a quantized K is stored under. Each dtype's scores and p.V are a file of its own
 * (kv_float.c, kv_int8.c, kv_q4.c), read by decode.c's attend_item.
 * ------------------------------------------------------------------------------------ */

/* q4 K/V (kvlm/cache/storage.py quantize_q4): a row of D values is D / 2 bytes of 4-bit
 * codes (value 2i in the low nibble of byte i, 2i + 1 in the high one) and one fp16 scale
 * d per group of G = 32 values (G = D when D is not a multiple of 32): x ~ (c - 8) d. */
static inline int64_t q4_group(int64_t D) { return D % 32 == 0 ? 32 : D; }
#define Q4_QG (MAX_HEAD_DIM / 32) /* the most q4 groups a row has */

/* bytes of one stored row, and of its parameters (int8's (step, zero), q4's scales) */
static inline int64_t kv_row_bytes(int dt, int64_t D) {
    return dt == KV_Q4 ? D / 2 : D * (dt == KV_I8 ? 1 : (dt == KV_F32 ? 4 : 2));
}
static inline int64_t kv_param_bytes(int dt, int64_t D) {
    return dt == KV_I8 ? 4 : (dt == KV_Q4 ? 2 * (D / q4_group(D)) : 0);
}

/* p[i] = exp(p[i] - mx) for i < n; returns the sum (exp512, scalar expf without AVX-512) */
static float exp_sum(float *p, int64_t n, float mx) {
    float sum = 0.f;
    int64_t i = 0;
#if KVLM_V512
    __m512 acc = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 y = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + i), vmx));
        _mm512_mask_storeu_ps(p + i, k, y);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, y));
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    return sum;
}

#if KVLM_V512
static inline __m512 load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* y += a * x */
/* element i of a cache row stored as dt: KV_F32, KV_BF16 or KV_F16 */
static inline float kv_elem(const char *row, int dt, int64_t i) {
    if (dt == KV_BF16) return from_bf16(((const uint16_t *)row)[i]);
    if (dt == KV_F16) return from_f16(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

#if KVLM_V512
static inline __m512 kv_load(const char *row, int dt, int64_t i) {
    if (dt == KV_I8) /* codes, widened (the caller takes step and zero apart) */
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
    if (dt == KV_F16) /* exact: every half is a float */
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    return dt == KV_BF16 ? load_bf16((const uint16_t *)row + i)
                         : _mm512_loadu_ps((const float *)row + i);
}
#endif

/* a . row[0:n] */
static inline float dot_kv(const float *a, const char *row, int dt, int64_t n) {
#if KVLM_V512
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), kv_load(row, dt, i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * kv_elem(row, dt, i);
    return s;
}

/* y[0:n] += a * row[0:n] */
static inline void axpy_kv(float a, const char *row, int dt, float *y, int64_t n) {
#if KVLM_V512
    if (n % 16 == 0) {
        __m512 av = _mm512_set1_ps(a);
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, kv_load(row, dt, i), _mm512_loadu_ps(y + i)));
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) y[i] += a * kv_elem(row, dt, i);
}

#define MAX_CHUNKS 8 /* position chunks per KV head: the threads' work items */

/* Where one KV head's cache rows lie, contiguous, paged or in a ring. Position s of the
 * sequence is slot t = s (or s % ring), at
 *     base + table[t / bs] * bstride + (t % bs) * row_bytes
 * contiguous cache: table {0}, bs = its slots (one block of everything); paged pool
 * (kvlm.cache.paged): the sequence's block table, bs = block_size, bstride = the bytes of
 * one block id (all KV heads); a ring (kvlm.cache.window, a multiple of bs slots): its
 * wrap falls on a block's end. The kernels walk [s0, s1) in runs of one block each. */
typedef struct {
    const char *base;     /* this layer's K or V (or their int8 parameters), this KV head, block id 0 */
    const int32_t *table; /* block ids of the sequence */
    int64_t bs, bstride;  /* positions per block; bytes from one block id to the next */
    int64_t n;            /* positions the sequence holds (prefetching stops there) */
    int64_t ring;         /* 0, or the ring's slots: position s in slot s % ring */
} kv_span;

static inline int64_t slot_of(int64_t ring, int64_t s) { return ring ? s % ring : s; }

/* the first row of the run that starts at position a; *end: where it stops (its block's
 * end or s1); *lim: the end of its block's rows (prefetching within the block stops there:
 * for a contiguous cache, the end of the head's slots, so a thread that goes on to the
 * next chunk finds it fetched) */
static inline const char *run_at(const kv_span *sp, int64_t rowb, int64_t a, int64_t s1,
                                 int64_t *end, const char **lim) {
    const int64_t t = slot_of(sp->ring, a), blk = t / sp->bs, e = a + (blk + 1) * sp->bs - t;
    const char *block = sp->base + (int64_t)sp->table[blk] * sp->bstride;
    *end = e < s1 ? e : s1;
    if (lim) *lim = block + sp->bs * rowb;
    return block + (t - blk * sp->bs) * rowb;
}

/* one row, wherever its block is (the scalar paths) */
static inline const char *row_at(const kv_span *sp, int64_t rowb, int64_t s) {
    const int64_t t = slot_of(sp->ring, s);
    return sp->base + (int64_t)sp->table[t / sp->bs] * sp->bstride + (t % sp->bs) * rowb;
}

#if KVLM_V512
/* Cache rows are fetched 8 KiB ahead of the row being read, into L2: without it the
 * attention reads and computes by turns (a 1024-position step took about the time of a
 * plain read of its K/V plus its compute in L2); with it the two overlap. The fused step
 * at 1024 positions, bf16 K/V: attention 1.46-1.55 -> 1.04-1.15 ms per token. (2 KiB
 * ahead into L1 gave nothing.) */
#define KV_AHEAD 8192
static inline __attribute__((always_inline)) void fetch_ahead(const char *row, int64_t bytes,
                                                               const char *lim) {
    if (lim - row < KV_AHEAD + bytes) return; /* past its block: fetch_run's work */
    for (int64_t j = 0; j < bytes; j += 64) _mm_prefetch(row + KV_AHEAD + j, _MM_HINT_T1);
}

/* A paged run (a block smaller than 8 KiB, whose rows fetch_ahead leaves alone) fetches
 * the block about 8 KiB further on in the sequence, whole; the first run of a chunk also
 * the ones before it. Nothing for a contiguous cache: its one run is all its rows. */
static inline __attribute__((always_inline)) void fetch_run(const kv_span *sp, int64_t rowb,
                                                            int64_t a, int64_t s0) {
    const int64_t bb = sp->bs * rowb, k = bb >= KV_AHEAD ? 1 : KV_AHEAD / bb;
    const int64_t t = slot_of(sp->ring, a), blk = t / sp->bs, bytes = bb < KV_AHEAD ? bb : KV_AHEAD;
    const int64_t blocks = sp->ring / sp->bs; /* a ring's wrap (0: none) */
    for (int64_t j = a == s0 ? 1 : k; j <= k && a - t % sp->bs + j * sp->bs < sp->n; j++) {
        const int64_t at = blocks && blk + j >= blocks ? (blk + j) % blocks : blk + j;
        const char *r = sp->base + (int64_t)sp->table[at] * sp->bstride;
        for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(r + i, _MM_HINT_T1);
    }
}

/* lanes 0..3 = the sums of a, b, c, d */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(v)                                                                            \
    _mm256_add_ps(_mm512_castps512_ps256(v),                                                 \
                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b)), cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* the largest of p[0:n] (n >= 1) */
static inline float max_of(const float *p, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail_mask(n - i), p + i));
    return _mm512_reduce_max_ps(m);
}
#endif

/* The softmax pieces of a chunk's scores p[h * S + s], s in [s0, s1), of which the query
 * sees [v0, s1) (soft-capped first when cap > 0) (v0 > s0 only in a windowed row's first chunk, which starts at the multiple
 * of 16 below its first visible key, so that its runs group positions as every other
 * chunk's do): m[h], the most of the visible scores; l[h], the sum of their exp(p - m),
 * left in place; the hidden ones set to 0, so that p.V over [s0, s1) adds nothing for
 * them (0 * v, v a written row's finite value). */
static void softmax_pieces(int ng, float *p, int64_t S, int64_t s0, int64_t v0, int64_t s1,
                           float cap, float *m, float *l) {
    for (int h = 0; h < ng; h++) {
        float *ph = p + h * S;
        if (cap > 0.f) /* Gemma 2: cap tanh(s / cap), as attend_capped caps them */
            for (int64_t s = v0; s < s1; s++) ph[s] = tanhf(ph[s] / cap) * cap;
#if KVLM_V512
        m[h] = max_of(ph + v0, s1 - v0);
#else
        m[h] = -INFINITY;
        for (int64_t s = v0; s < s1; s++) m[h] = ph[s] > m[h] ? ph[s] : m[h];
#endif
        l[h] = exp_sum(ph + v0, s1 - v0, m[h]);
        for (int64_t s = s0; s < v0; s++) ph[s] = 0.f;
    }
}

/* Whether R (D x D, row-major) is Sylvester's Hadamard matrix times R[0] > 0: entry (i, j)
 * is R[0] or -R[0] by the parity of i & j (storage.key_rotation's R for a power-of-two D) */
static int is_hadamard(const float *R, int64_t D) {
    if (D < 1 || (D & (D - 1)) || !(R[0] > 0.f)) return 0;
    for (int64_t i = 0; i < D; i++)
        for (int64_t j = 0; j < D; j++)
            if (R[i * D + j] != (__builtin_popcountll((uint64_t)(i & j)) & 1 ? -R[0] : R[0]))
                return 0;
    return 1;
}

/* y = x R (R: D x D, row-major; y may be x). A power-of-two D: R is Sylvester's Hadamard
 * matrix / sqrt(D) (is_hadamard, checked by kvlm_decode_batch), taken as the fast
 * Walsh-Hadamard transform: log2(D) rounds of butterflies (a + b, a - b: each a single
 * rounding, nothing reassociated or fused, so the same bits whatever the order within a
 * round, on every build and vector width), then one product by R[0] = 1/sqrt(D): the
 * first three rounds on 8 values at a time, the later ones 8 lanes at a time (loops of 8
 * the compiler vectorises). D log D operations for D^2, and no chain of dependent sums:
 * ~0.1 us at D = 64 against ~0.3 for the AVX-512 product below. Other D: the product. */
static void rotate(const float *x, const float *R, int64_t D, float *y) {
    if ((D & (D - 1)) == 0) {
        int64_t h = 1;
        for (int64_t i = 0; i + 8 <= D; i += 8) { /* rounds h = 1, 2, 4 */
            float t[8], u[8];
            for (int k = 0; k < 8; k++) t[k] = x[i + k];
            for (int k = 0; k < 8; k += 2) {
                u[k] = t[k] + t[k + 1];
                u[k + 1] = t[k] - t[k + 1];
            }
            for (int k = 0; k < 8; k += 4)
                for (int q = k; q < k + 2; q++) {
                    t[q] = u[q] + u[q + 2];
                    t[q + 2] = u[q] - u[q + 2];
                }
            for (int q = 0; q < 4; q++) {
                y[i + q] = t[q] + t[q + 4];
                y[i + q + 4] = t[q] - t[q + 4];
            }
            h = 8;
        }
        if (h == 1 && y != x) memcpy(y, x, D * sizeof(float));
        for (; h < D && h < 8; h *= 2) /* D < 8: a pair at a time */
            for (int64_t i = 0; i < D; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        for (; h < D; h *= 2) /* rounds h = 8 .. D / 2, 8 lanes at a time */
            for (int64_t i = 0; i < D; i += 2 * h)
                for (int64_t j = i; j < i + h; j += 8)
                    for (int k = 0; k < 8; k++) {
                        const float a = y[j + k], b = y[j + h + k];
                        y[j + k] = a + b;
                        y[j + h + k] = a - b;
                    }
        const float r = R[0];
        for (int64_t j = 0; j < D; j++) y[j] *= r;
        return;
    }
#if KVLM_V512
    if (D % 16 == 0 && D <= MAX_HEAD_DIM) { /* y in registers, one x[i] per row of R */
        __m512 acc[MAX_HEAD_DIM / 16];
        for (int64_t v = 0; v < D / 16; v++) acc[v] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i++) {
            const __m512 xi = _mm512_set1_ps(x[i]);
            for (int64_t v = 0; v < D / 16; v++)
                acc[v] = _mm512_fmadd_ps(xi, _mm512_loadu_ps(R + i * D + 16 * v), acc[v]);
        }
        for (int64_t v = 0; v < D / 16; v++) _mm512_storeu_ps(y + 16 * v, acc[v]);
        return;
    }
#endif
    for (int64_t j = 0; j < D; j++) y[j] = 0.f;
    for (int64_t i = 0; i < D; i++)
        for (int64_t j = 0; j < D; j++) y[j] += x[i] * R[i * D + j];
}
