/* A mixture of experts, the FFN kind "experts" (kvlm.model.experts), for the decode step:
 * B rows' normed inputs h [B, hidden] -> out [B, hidden], as the torch model computes it
 *
 *     logits = h . router^T      fp32, each row's dot products in one order (any batch),
 *              + router_bias where the layer has one (a Linear's bias, after the product)
 *     p      = softmax(logits)   exp(l - max) / their sum, summed in expert order
 *              (ROUTER_SOFTMAX), or 1 / (1 + exp(-l)) each (ROUTER_SIGMOID)
 *     chosen = the top_k of p (+ expert_bias where the layer has one: it chooses, never
 *              weighs), the higher first, the lower expert first among equal ones
 *     w      = p[chosen], divided by (their sum (in chosen order) + route_eps) where
 *              `normalize`, then times route_scale
 *     (ROUTER_TOPK_SOFTMAX: chosen = the top_k of the logits themselves, the same ties;
 *      w = exp(l - the first's) / their sum (in chosen order): a softmax over those k)
 *     out    = 0, then for each expert in ascending order, for each row routed to it:
 *              out += MLP_e(h) * w   (a product, then the sum: no fused multiply-add)
 *
 * An expert's MLP: gate|up = its product (+ its gate|up bias), the model's activation
 * (SiLU or GELU of gate, times up) or the clamped SwiGLU (EXP_ACT_CLAMPED_SWIGLU:
 * clamped_swiglu), down's product (+ its down bias), as torch's Linear adds a bias.
 *
 * Each expert's products run once over every row routed to it (rows that share an expert
 * read its weights once: matmul_rows, whose rows' sums are their own in any batch), with
 * the model's activation settings of gate|up and down. The router (route_rows) is the
 * torch model's too on the CPU (kvlm_route), so a row picks the same experts with the
 * same weights on either road, alone or batched. */

static int matmul_rows(const kvlm_qmat *w, const float *x, int64_t B, float *y, int act);
static void silu_mul(const float *g, const float *u, float *y, int64_t n);
static void gelu_mul(const float *g, const float *u, float *y, int64_t n);
static int qmat_ok(const kvlm_qmat *w, int64_t n, int64_t k);
static void add_bias(float *y, const float *bias, int64_t B, int64_t n);

/* Whether a router's kind, renormalisation epsilon and scale are ones route_rows takes */
static int route_kind_ok(int64_t kind, double eps, double scale) {
    return (kind == ROUTER_SOFTMAX || kind == ROUTER_SIGMOID || kind == ROUTER_TOPK_SOFTMAX) &&
           eps >= 0.0 && eps <= 1.0 && scale > 0.0 && scale <= 1e6;
}

/* y = (up + 1) * (gate * sigmoid(alpha * gate)), gate clamped to at most `limit` and up to
 * [-limit, limit] first (a NaN stays a NaN, as torch's clamp keeps it): the clamped
 * SwiGLU in kvlm.model.layers.clamped_swiglu's order, g and u n values each */
static void clamped_swiglu_mul(const float *g, const float *u, float *y, int64_t n,
                               float alpha, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float gate = g[i] > limit ? limit : g[i];
        const float up = u[i] < -limit ? -limit : (u[i] > limit ? limit : u[i]);
        const float sig = 1.0f / (1.0f + expf(-(gate * alpha)));
        y[i] = (up + 1.0f) * (gate * sig);
    }
}

/* Whether layer L's experts are a mixture the step can run: counts in range, a router,
 * every expert's gate|up [2 expert_inter, hidden] and down [hidden, expert_inter] */
static int experts_ok(const kvlm_qmodel *m, const kvlm_qlayer *L) {
    const int64_t E = L->n_experts, I = L->expert_inter, H = m->hidden;
    if (E < 1 || E > MAX_EXPERTS || L->top_k < 1 || L->top_k > E || I < 1 || I > (1 << 22))
        return 0;
    if ((L->normalize >> 1) || !L->router || !L->exp_gate_up || !L->exp_down) return 0;
    if (!route_kind_ok(L->router_kind, L->route_eps, L->route_scale)) return 0;
    if (L->exp_act != EXP_ACT_MODEL && L->exp_act != EXP_ACT_CLAMPED_SWIGLU) return 0;
    if (L->exp_act == EXP_ACT_CLAMPED_SWIGLU &&
        !(L->swiglu_limit >= 0.0f && L->swiglu_limit <= 1e30f && L->swiglu_alpha >= 0.0f &&
          L->swiglu_alpha <= 1e30f))
        return 0;
    for (int64_t e = 0; e < E; e++)
        if (!qmat_ok(L->exp_gate_up + e, 2 * I, H) || !qmat_ok(L->exp_down + e, H, I)) return 0;
    const int64_t S = L->shared_inter; /* a shared expert: gate_up and down */
    if (S < 0 || S > (1 << 22) || (!S && L->shared_gate)) return 0;
    return !S || (qmat_ok(&L->gate_up, 2 * S, H) && qmat_ok(&L->down, H, S));
}

/* floats of scratch a row of the step's expert layers needs (the most of any layer): the
 * logits, the chosen experts (int64, two floats each) and their weights, an expert's rows
 * gathered, their gate|up, its product and their output; a shared expert's gate|up, its
 * product and its output */
static int64_t experts_floats(const kvlm_qmodel *m) {
    int64_t most = 0;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kvlm_qlayer *L = m->layers + l;
        if (L->ffn != FFN_EXPERTS) continue;
        const int64_t n = L->n_experts + 3 * L->top_k + 2 * m->hidden + 3 * L->expert_inter +
                          3 * L->shared_inter + m->hidden; /* the shared expert's */
        most = n > most ? n : most;
    }
    return most ? most + 2 : 0; /* + 2: the int64s' alignment */
}

/* a . b over n floats in 16 running sums (element c into sum c % 16: the compiler's
 * vector lanes), then those added in lane order: one order on every build, for any batch */
static inline float dot16(const float *a, const float *b, int64_t n) {
    float acc[16] = {0.0f}, s = 0.0f;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[c + j] * b[c + j];
    for (int j = 0; c + j < n; j++) acc[j] += a[c + j] * b[c + j];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* The router of B rows (a mixture's first half, the torch model's too: kvlm_route):
 * h [B, hidden] . router [E, hidden]^T into logits [B, E] (each dot product dot16's),
 * plus `logit_bias` (NULL: none) after each product, then each row's scores: the softmax
 * over its E (exp(l - max) summed in expert order: ROUTER_SOFTMAX), each logit's sigmoid
 * 1 / (1 + exp(-l)) (ROUTER_SIGMOID), or the logits as they are (ROUTER_TOPK_SOFTMAX), in
 * place; the top K of each row by a selection over the scores plus `bias` (NULL: none)
 * that takes the lower expert among equal ones (the higher first), their un-biased scores
 * divided by (their sum (in chosen order) + eps) where `normalize`, then times `scale`
 * (eps and scale in fp32, as transformers adds and multiplies them): chosen [B, K],
 * w [B, K]; ROUTER_TOPK_SOFTMAX's w instead the softmax over the K chosen logits alone,
 * exp(l - the first's) (the largest) divided by their sum in chosen order (transformers'
 * top k, then softmax; no renormalisation or scale). A NaN never wins a comparison: a
 * row of NaNs takes experts 0 .. K - 1. */
typedef struct {
    int64_t kind, normalize;
    const float *bias, *logit_bias;
    float eps, scale;
} route_how;

/* The top K of one row's scores p [E] (plus `bias` where given: it chooses, never weighs)
 * into chosen [K]: the best not yet taken each time, the higher first, the lower expert
 * first among equal ones; a NaN never wins a comparison */
static void top_k(const float *p, const float *bias, int64_t E, int64_t K, int64_t *chosen) {
    for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        float top = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t t = 0; t < j; t++) taken |= chosen[t] == e;
            const float s = bias ? p[e] + bias[e] : p[e];
            if (!taken && (best < 0 || s > top)) best = e, top = s;
        }
        chosen[j] = best;
    }
}

/* ROUTER_TOPK_SOFTMAX of one row's logits p [E]: the top K (top_k), then their softmax
 * alone, exp(l - p[chosen[0]]) over their sum in chosen order (route_rows) */
static void topk_softmax_row(const float *p, int64_t E, int64_t K, int64_t *chosen, float *w) {
    top_k(p, NULL, E, K, chosen);
    const float mx = p[chosen[0]];
    float sum = 0.0f;
    for (int64_t j = 0; j < K; j++) {
        w[j] = expf(p[chosen[j]] - mx);
        sum += w[j];
    }
    for (int64_t j = 0; j < K; j++) w[j] /= sum;
}

static void route_rows(const float *h, int64_t B, int64_t H, const float *router, int64_t E,
                       int64_t K, route_how how, float *logits, int64_t *chosen, float *w) {
#pragma omp parallel for schedule(static) if (B * E > 64)
    for (int64_t i = 0; i < B * E; i++)
        logits[i] = dot16(h + (i / E) * H, router + (i % E) * H, H);
    for (int64_t i = 0; how.logit_bias && i < B * E; i++) logits[i] += how.logit_bias[i % E];
    for (int64_t b = 0; b < B; b++) {
        float *p = logits + b * E;
        if (how.kind == ROUTER_TOPK_SOFTMAX) {
            topk_softmax_row(p, E, K, chosen + b * K, w + b * K);
            continue;
        }
        if (how.kind == ROUTER_SIGMOID) {
            for (int64_t e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-p[e]));
        } else {
            float mx = p[0], sum = 0.0f;
            for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
            for (int64_t e = 0; e < E; e++) {
                p[e] = expf(p[e] - mx);
                sum += p[e];
            }
            for (int64_t e = 0; e < E; e++) p[e] /= sum;
        }
        top_k(p, how.bias, E, K, chosen + b * K);
        float total = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            w[b * K + j] = p[chosen[b * K + j]];
            total += w[b * K + j];
        }
        if (how.normalize) {
            const float d = total + how.eps;
            for (int64_t j = 0; j < K; j++) w[b * K + j] /= d;
        }
        for (int64_t j = 0; how.scale != 1.0f && j < K; j++) w[b * K + j] *= how.scale;
    }
}

/* kvlm.model.experts' router on the CPU (route_rows): x [M, H] fp32, router [E, H] fp32,
 * kind ROUTER_*, bias [E] fp32 or NULL (bn its length: the selection bias), router_bias
 * [E] fp32 or NULL (rbn its length: the router's own, added to its logits) -> chosen
 * [M, K] int64, w [M, K] fp32; logits [M, E] its scratch (the scores after it). 0, or -2
 * for sizes or a kind out of range or buffers too small. */
int kvlm_route(const float *x, int64_t xn, int64_t M, int64_t H, const float *router,
               int64_t rn, int64_t E, int64_t K, int64_t normalize, int64_t kind,
               const float *bias, int64_t bn, double eps, double scale, int64_t *chosen,
               int64_t cn, float *w, int64_t wn, float *logits, int64_t ln,
               const float *router_bias, int64_t rbn) {
    int64_t need;
    if (M < 1 || H < 1 || E < 1 || E > MAX_EXPERTS || K < 1 || K > E || (normalize >> 1))
        return -2;
    if (!route_kind_ok(kind, eps, scale) || (bias && bn < E) || (router_bias && rbn < E))
        return -2;
    if (!x || !router || !chosen || !w || !logits) return -2;
    if (!mul_ok(M, H, &need) || xn < need || !mul_ok(E, H, &need) || rn < need) return -2;
    if (!mul_ok(M, K, &need) || cn < need || wn < need) return -2;
    if (!mul_ok(M, E, &need) || ln < need) return -2;
    const route_how how = {kind, normalize, bias, router_bias, (float)eps, (float)scale};
    route_rows(x, M, H, router, E, K, how, logits, chosen, w);
    return 0;
}

/* out [B, hidden] = layer L's mixture of experts of h [B, hidden] (above); `ex` the
 * scratch of experts_floats a row; act_gu, act_down: the products' activations
 * (matmul_rows' act); 0, or -1 (a product's failure) */
static int experts_ffn(const kvlm_qmodel *m, const kvlm_qlayer *L, int64_t B, const float *h,
                       float *out, float *ex, int act_gu, int act_down) {
    const int64_t H = m->hidden, E = L->n_experts, K = L->top_k, I = L->expert_inter;
    float *logits = ex;                         /* B E */
    float *w = logits + B * E;                  /* B K */
    float *x = w + B * K;                       /* B H: an expert's rows */
    float *gu = x + B * H;                      /* B 2 I */
    float *act = gu + B * 2 * I;                /* B I */
    float *y = act + B * I;                     /* B H */
    const int64_t S = L->shared_inter;
    float *sgu = y + B * H;                     /* B 2 S: the shared expert's */
    float *sact = sgu + B * 2 * S;              /* B S */
    float *sy = sact + B * S;                   /* B H */
    float *tail = sy + B * H;
    int64_t *chosen = (int64_t *)(tail + ((uintptr_t)tail % 8 ? 1 : 0)); /* B K */
    const route_how how = {L->router_kind, L->normalize, L->expert_bias, L->router_bias,
                           (float)L->route_eps, (float)L->route_scale};
    route_rows(h, B, H, L->router, E, K, how, logits, chosen, w);
    for (int64_t i = 0; i < B * H; i++) out[i] = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0; /* the rows routed to e, in row order (a row takes e once at most) */
        for (int64_t i = 0; i < B * K; i++)
            if (chosen[i] == e) memcpy(x + n++ * H, h + (i / K) * H, (size_t)H * sizeof(float));
        if (!n) continue;
        if (matmul_rows(L->exp_gate_up + e, x, n, gu, act_gu)) return -1;
        if (L->exp_gate_up_bias) add_bias(gu, L->exp_gate_up_bias + e * 2 * I, n, 2 * I);
        for (int64_t r = 0; r < n; r++) {
            float *g = gu + r * 2 * I;
            if (L->exp_act == EXP_ACT_CLAMPED_SWIGLU)
                clamped_swiglu_mul(g, g + I, act + r * I, I, L->swiglu_alpha, L->swiglu_limit);
            else
                (m->gelu ? gelu_mul : silu_mul)(g, g + I, act + r * I, I);
        }
        if (matmul_rows(L->exp_down + e, act, n, y, act_down)) return -1;
        if (L->exp_down_bias) add_bias(y, L->exp_down_bias + e * H, n, H);
        for (int64_t i = 0, r = 0; i < B * K; i++) {
            if (chosen[i] != e) continue;
            float *o = out + (i / K) * H;
            const float *yr = y + r++ * H, wt = w[i];
            for (int64_t c = 0; c < H; c++) {
                const float t = yr[c] * wt;
                o[c] += t;
            }
        }
    }
    if (!S) return 0;
    /* the shared expert over every row, times sigmoid(its gate), added after the routed */
    if (matmul_rows(&L->gate_up, h, B, sgu, act_gu)) return -1;
    for (int64_t b = 0; b < B; b++)
        (m->gelu ? gelu_mul : silu_mul)(sgu + b * 2 * S, sgu + b * 2 * S + S, sact + b * S, S);
    if (matmul_rows(&L->down, sact, B, sy, act_down)) return -1;
    for (int64_t b = 0; b < B; b++) {
        const float g =
            L->shared_gate ? 1.0f / (1.0f + expf(-dot16(h + b * H, L->shared_gate, H))) : 1.0f;
        float *o = out + b * H;
        for (int64_t c = 0; c < H; c++) {
            const float t = g * sy[b * H + c];
            o[c] += t;
        }
    }
    return 0;
}
