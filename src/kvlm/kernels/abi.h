/* The kernels' binary interface with Python: every struct, enum and limit that Python
 * mirrors or passes. kvlm/model/fused.py's ctypes classes (_QPart, _QMat, _QLayer, _QModel,
 * _KVView, _ConvView) mirror the structs, field for field; kvlm.kernels.CONSTANTS reads
 * the #defines and the enums' values from this file, and kvlm/model/quant.py's KIND_CODES,
 * BLOCK_ROWS and SMALL_M repeat some of them. tests/test_kernel_abi.py holds each side to the other
 * (a probe compiled against this header: sizes, offsets, values). The entry points' own
 * signatures are kvlm.kernels._SIGNATURES (each checked against its definition there too).
 * A change here that changes the layout or a meaning is a new KVLM_ABI. */
#ifndef KVLM_ABI_H
#define KVLM_ABI_H
#include <stdint.h>

#define KVLM_ABI 42 /* kvlm_kernel_abi(): kvlm.kernels loads no library that answers another */

/* the limits (fused.py: MAX_HEAD_DIM, MAX_ROWS, QMAT_PARTS; quant.py: BLOCK_ROWS, SMALL_M) */
#define BR 16         /* weight rows per block: one per 32-bit vector lane */
#define SMALL_ROWS 16 /* the most rows the small products take (quant.SMALL_M) */
#define MAX_HEAD_DIM 256 /* the attention's buffers (Gemma 3's head_dim) */
#define MAX_BATCH 256 /* the most rows (sequences) one decode step takes */
#define QMAT_PARTS 3 /* a fused projection's row parts, each of its own kind */
#define MAX_CONV_KERNEL 64 /* a conv layer's most taps (kvlm.config.CONV_KERNEL's bound) */
/* the gated delta rule's chunk (deltanet.c; kvlm.cache.kinds.DELTA_CHUNK): a DeltaNet
 * state is the one at a multiple of it, beside the rows since */
#define DELTA_CHUNK 16

/* the weight kinds (kvlm.model.quant.KIND_CODES); MXFP4's code is ggml's type number;
 * Q8R is Q8_0 as ggml stores it, rows of blocks in place (weights.c), not packed */
enum {
    Q8 = 8, Q4 = 4, Q40 = 40, Q50 = 50, Q51 = 51, Q4K = 104, Q5K = 105, Q6K = 106, MXFP4 = 39,
    Q8R = 80
};

/* K's and V's storage (kvlm_qmodel.k_dtype, v_dtype) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_F16 = 3, KV_Q4 = 4 };

/* kvlm_qmodel.act_int8, act_int16: an attention layer's q|k|v and o, a conv or recurrent
 * layer's in_proj and out_proj, every layer's gate|up and down, the vocabulary projection */
enum {
    ACT_QKV = 1, ACT_O = 2, ACT_GATE_UP = 4, ACT_DOWN = 8, ACT_HEAD = 16, ACT_CONV_IN = 32,
    ACT_CONV_OUT = 64
};

/* a mixture's router (kvlm_qlayer.router_kind, kvlm_route; kvlm.config.ROUTERS): softmax
 * over every expert, each expert's sigmoid, or the top k of the logits with a softmax over
 * those k alone */
enum { ROUTER_SOFTMAX = 0, ROUTER_SIGMOID = 1, ROUTER_TOPK_SOFTMAX = 2 };

/* an expert's activation (kvlm_qlayer.exp_act; kvlm.config.EXPERT_ACTIVATIONS): the
 * model's gated MLP's (kvlm_qmodel.gelu), or the clamped SwiGLU (gate clamped to at most
 * swiglu_limit, up to [-limit, limit], then (up + 1) gate sigmoid(swiglu_alpha gate)) */
enum { EXP_ACT_MODEL = 0, EXP_ACT_CLAMPED_SWIGLU = 1 };

/* a layer's FFN (kvlm_qlayer.ffn; kvlm.config.FFNS): the gated MLP (gate_up, down), or a
 * mixture of experts (the experts' fields; experts.c) */
enum { FFN_MLP = 0, FFN_EXPERTS = 1 };
#define MAX_EXPERTS 4096 /* a layer's experts at most (kvlm.config.EXPERTS' bound) */

/* a layer's mixer (kvlm_qlayer.mixer; kvlm.config.MIXERS): attention, a gated short
 * convolution, a gated DeltaNet, a Mamba2 layer (the last two: recurrent, kvlm_state_view) */
enum { MIX_ATTENTION = 0, MIX_CONV = 1, MIX_DELTA = 2, MIX_MAMBA2 = 3 };

typedef struct {
    int64_t kind;        /* Q8, Q4, Q40, Q50, Q51, Q4K, Q5K, Q6K, MXFP4 or Q8R */
    const uint8_t *data; /* packed (see the top of weights.c); Q8R: ggml's rows */
    int64_t n;           /* its rows */
    int64_t bytes;       /* data's bytes: checked against what n rows of k take */
} kvlm_qpart;

/* [n, k]: the rows of parts 0 .. parts - 1 stacked (q|k|v of a Q4_K_M file: Q4_K, Q4_K, Q6_K) */
typedef struct {
    int64_t n, k, parts;
    kvlm_qpart part[QMAT_PARTS];
} kvlm_qmat;

typedef struct {
    const float *input_norm, *post_norm;
    kvlm_qmat qkv, o, gate_up, down;
    /* NULL when the model has none: the q|k|v bias (Qwen2; Llama's attention_bias), added
     * after the product as torch's Linear does; o_proj's bias; the RMSNorm weights of
     * the queries and keys before RoPE: a head's (head_dim each; Qwen3, Gemma 3), or each
     * whole projection's (n_heads and n_kv_heads x head_dim) where qk_norm_whole */
    const float *qkv_bias, *o_bias, *q_norm, *k_norm;
    /* Gemma's sandwich norms (NULL: none): the attention's output after o_proj and the
     * MLP's after down, each normed before it is added to the residual */
    const float *attn_out_norm, *mlp_out_norm;
    int64_t window; /* keys the query at p sees: p - window < s <= p; 0: all of 0 .. p;
                       -1: the step's window (kvlm_qmodel.window) */
    int64_t rope;   /* which cos/sin table (0: the model's base; 1: the local layers') */
    int64_t view;   /* which cache view holds this layer's K/V (kvlm_kv_view), a conv
                       layer's rows (kvlm_conv_view), a recurrent layer's state and rows
                       (kvlm_state_view) */
    int64_t index;  /* the layer's index inside that view's store */
    int64_t mixer;  /* MIX_ATTENTION: q|k|v through the fields above; MIX_CONV: a gated short
                       convolution through those below (qkv, o, their biases, the q/k norms,
                       window and rope unread; norms, gate_up, down and the output norms
                       as an attention layer's); MIX_DELTA, MIX_MAMBA2: a recurrent layer
                       through those below too (in_proj, out_proj, taps, the fields after) */
    /* a conv layer (kvlm.model.conv): B|C|x = in_proj [3 hidden, hidden], out_proj
     * [hidden, hidden]; their biases (NULL: none); the depthwise taps (conv_kernel,
     * hidden), tap k of channel h at k hidden + h (tap conv_kernel - 1 reads the row's own
     * position); the taps' bias (NULL: none) */
    kvlm_qmat in_proj, out_proj;
    const float *in_bias, *out_bias, *taps, *taps_bias;
    /* a recurrent layer (MIX_DELTA: kvlm.model.deltanet; MIX_MAMBA2: kvlm.model.mamba2),
     * with in_proj, out_proj, their biases, taps (conv_kernel, its conv's channels) and
     * their bias above: A_log and dt_bias (a value head's each), D (Mamba2's, a head's;
     * NULL for a DeltaNet), the gated norm's weight (a value head's dv: DeltaNet; the
     * inner channels: Mamba2) */
    const float *a_log, *dt_bias, *d, *gnorm;
    /* FFN_MLP: gate_up and down above; FFN_EXPERTS: n_experts experts, each a gated MLP
     * of expert_inter (exp_gate_up [2 expert_inter, hidden] and exp_down [hidden,
     * expert_inter], n_experts of each), top_k of them a row, chosen by the router's
     * (n_experts, hidden) fp32 weights, their weights divided by their sum where
     * normalize (gate_up and down above unread) */
    int64_t ffn;
    const float *router;
    const kvlm_qmat *exp_gate_up, *exp_down;
    int64_t n_experts, top_k, normalize, expert_inter;
    /* FFN_EXPERTS with a shared expert every row runs beside them (shared_inter > 0; 0:
     * none): its gate|up and down are gate_up [2 shared_inter, hidden] and down above, its
     * output times sigmoid(shared_gate . h) where shared_gate (hidden fp32) is not NULL */
    int64_t shared_inter;
    const float *shared_gate;
    /* FFN_EXPERTS: how the router scores (ROUTER_SOFTMAX, ROUTER_SIGMOID); a selection
     * bias (n_experts fp32, NULL: none) added to the scores to choose, not to weigh; the
     * chosen weights divided by (their sum + route_eps) where normalize, then times
     * route_scale (both rounded to fp32 first) */
    int64_t router_kind;
    const float *expert_bias;
    double route_eps, route_scale;
    /* FFN_EXPERTS: the router's own bias (n_experts fp32, NULL: none), added to its
     * logits after the product (a Linear's bias); each expert's gate|up bias and down bias
     * stacked (n_experts x 2 expert_inter and n_experts x hidden fp32, NULL: none), each
     * added after its product; the experts' activation (EXP_ACT_*) and the clamped
     * SwiGLU's alpha and limit (unread otherwise) */
    const float *router_bias, *exp_gate_up_bias, *exp_down_bias;
    int64_t exp_act;
    float swiglu_alpha, swiglu_limit;
    /* MIX_ATTENTION: attention sinks (n_heads fp32, NULL: none), a logit a query head that
     * joins each row's softmax denominator, its column without a value */
    const float *sinks;
} kvlm_qlayer;

typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, slots;
    float eps;
    const kvlm_qlayer *layers;
    const float *final_norm;
    kvlm_qmat lm_head;
    int64_t k_dtype, v_dtype; /* K's and V's storage: KV_F32, KV_BF16, KV_I8, KV_F16 or
                                 KV_Q4 (each its own: --k-dtype, --v-dtype) */
    int64_t act_int8;        /* which products round x to int8 per group (--activations
                                int8): a mask of ACT_QKV, ACT_O, ACT_GATE_UP, ACT_DOWN,
                                ACT_HEAD (the vocabulary projection: off by default,
                                near-tied logits decide the token) */
    int64_t act_int16;       /* which of those keep an int8 residual too, x to 16 bits a
                                value (--activations int16; kvlm_actrow) */
    const float *key_rot;    /* K in KV_I8 or KV_Q4: R (head_dim x head_dim); K rows are
                                stored as k R. A power-of-two head_dim: Sylvester's
                                Hadamard matrix / sqrt(head_dim) (applied as butterflies;
                                any other R refused) */
    int64_t window;          /* the step's attention window (Mistral) for the layers whose
                                own is -1: the query at p sees keys p - window < s <= p; 0:
                                all of 0 .. p */
    int64_t gelu;            /* the MLP's gate: 0 SiLU (SwiGLU), 1 tanh's GELU (GeGLU) */
    float score_scale;       /* the scores' scale (head_dim^-0.5, or Gemma's own) */
    float attn_softcap;      /* scores soft-capped, cap tanh(s / cap), before the softmax
                                (Gemma 2); 0: none */
    int64_t rope_tables;     /* the cos/sin tables given (1, or 2: a local layers' base) */
    int64_t conv_kernel;     /* a conv or recurrent layer's taps, 2 .. MAX_CONV_KERNEL
                                (unread without one) */
    int64_t rotary_dim;      /* the dimensions of a head RoPE rotates (head_dim; fewer: a
                                partial rotary factor), the tables' last dimension */
    int64_t attn_gate;       /* 1: q|gate|k|v, the attention's output times sigmoid(gate)
                                per element before o (Qwen3.5's gated attention) */
    float residual_scale;    /* each mixer's and MLP's output times this before the
                                residual add (Granite's multiplier); 0: none */
    float rec_eps;           /* a recurrent layer's gated norm's eps */
    /* a recurrent layer's sizes (every one of the model's of one kind): its value heads
     * (a DeltaNet's nv, a Mamba2's heads), a value head's channels (dv; head_dim), a key
     * head's (dk; the state size N), and the key heads (nk; the groups G) */
    int64_t rec_heads, rec_head_dim, rec_key_dim, rec_groups;
    int64_t qk_norm_whole;   /* 1: the q and k norms each over the whole projection
                                (ModelConfig.qk_norm_extent "projection"); 0: each head */
    const float *val_rot;    /* V in KV_I8 or KV_Q4 stored rotated (Store.v_rotated): R
                                (head_dim x head_dim); V rows are stored as v R and each
                                head's output is multiplied by R^T. Sylvester's Hadamard
                                matrix / sqrt(head_dim), a power of two (R^T = R; any other
                                refused). NULL: V as it is */
} kvlm_qmodel;

/* Where a group of layers keeps its K/V: K of layer l at k + l * k_layer bytes, a
 * (num_blocks, kv_heads, block_size, row) array of rows in k_dtype (+ their parameters at
 * kp + l * kp_layer: KV_I8's (step, zero) per row, KV_Q4's head_dim / q4_group scales),
 * V alike in v_dtype; addressed per row of the step through tables [B, width] of block
 * ids. Position s of row b is slot s (ring 0) or s % ring (a ring of `ring` slots, a
 * multiple of block_size: the local layers' window cache), in block
 * tables[b][slot / block_size]. A contiguous cache is one block per row holding every slot
 * (tables {b}, block_size its slots). */
typedef struct {
    void *k, *v;
    uint16_t *kp, *vp;       /* NULL for a float dtype */
    const int32_t *tables;
    int64_t width, num_blocks, block_size, ring;
    int64_t layers;          /* the store's layers (a layer's index is checked against it) */
    int64_t k_layer, v_layer, kp_layer, vp_layer; /* bytes from one layer to the next */
    int64_t entries;         /* tables' int32s (at least B width) */
    /* bytes from k, v, kp and vp on: every layer's blocks must lie within them */
    int64_t k_bytes, v_bytes, kp_bytes, vp_bytes;
} kvlm_kv_view;

/* a conv view's layout (kvlm_conv_view.layout) */
enum { CONV_ROWS = 0, CONV_SLOTS = 1 };

/* Where a group of conv layers keeps its rows, in one of two layouts (`layout`):
 *
 * CONV_ROWS (kvlm.cache.conv.ConvRows, a one-sequence cache's): layer l's at rows + l batch
 * keep width floats, (batch, keep, width): sequence s's last `keep` input rows of the
 * convolution (u = B * x, width = hidden floats each) at positions end - keep .. end - 1,
 * zeros before position 0 (and before what a rollback kept):
 *
 *     [ .. slack .. | conv_kernel - 1 rows ]  end        a step at start reads the
 *                                                        conv_kernel - 1 rows before it
 *
 * CONV_SLOTS (kvlm.cache.conv.ConvSlots, the engine pool's): layer l's at rows + l (batch
 * keep + 1) width floats, a ring of `keep` rows per slot (batch slots): slot s's position
 * p >= 0 at row s keep + p % keep, every position before 0 at row batch keep (zeros, never
 * written); the ring holds positions end - keep .. end - 1.
 *
 * Step row b (at pos[b]) feeds sequence (slot) seq[b], whose rows end at ends[b] (end -
 * keep + conv_kernel - 1 <= start <= end: a rollback leaves the rows). Rows of one
 * sequence are consecutive in the step at consecutive positions (a draft's rows: one
 * sequence to the convolution); once its logits are made the step moves each sequence's
 * rows on to end at its last row's position + 1, as ConvRows.commit would (CONV_ROWS), or
 * writes its rows' u into the ring (CONV_SLOTS: the last keep of them). */
typedef struct {
    float *rows;
    const int64_t *seq, *ends; /* [B] each */
    int64_t layers, batch, keep, width;
    int64_t layout;            /* CONV_ROWS or CONV_SLOTS */
    int64_t entries;           /* seq's and ends' int64s (each at least B) */
    int64_t bytes;             /* bytes from rows on: layers batch keep width floats within
                                  (CONV_SLOTS: layers (batch keep + 1) width) */
} kvlm_conv_view;

/* Where a group of recurrent layers keeps its state (kvlm.cache.recurrent: a
 * one-sequence cache's DeltaRows, the engine pool's StateSlots): `conv` their conv rows
 * (CONV_ROWS; its width the convolution's channels, `keep` L - 1), sequence conv.seq[b]
 * row b's; `in` the states before the step, (layers, conv.batch, state) floats, read only;
 * `out` (layers, out_rows, state): the state of row b's sequence after its last row of the
 * step written at row conv.seq[b] (a one-sequence cache's out buffer, which the caller
 * keeps once the step succeeded); `out` == `in`: the states updated in place (the pool's
 * slots; out_rows then conv.batch).
 *
 * A sequence's rows are one run (a draft's: consecutive rows at consecutive positions,
 * conv_view_ok), read from its state in order. The state after each row of a run but its
 * last (the draft rows a rollback may go back to; `n_at` of them in the step, in row
 * order) goes to `snaps` (layers, snap_rows, state): layer l's i-th at (l snap_rows + i)
 * state, required where n_at > 0 (snap_rows >= n_at). `urows` (layers, B, conv.width) or
 * NULL: each row's convolution input u, which the caller keeps with the rows before the
 * step for a rollback's window (conv_keep_rows keeps only the last L - 1). */
typedef struct {
    kvlm_conv_view conv;
    const float *in;
    float *out;
    int64_t state;              /* floats of a layer's state of one sequence */
    int64_t out_rows;           /* out's rows a layer (each row's sequence's among them) */
    int64_t in_bytes, out_bytes; /* bytes from in and out on */
    float *snaps, *urows;       /* the draft rows' states; the rows' u (or NULL) */
    int64_t snap_rows;          /* snaps' rows a layer */
    int64_t snaps_bytes, urows_bytes; /* bytes from snaps and urows on */
    /* A gated DeltaNet's carried rows (deltanet.c: the state is the one at the start of
     * the 16-row chunk a sequence's position is in, and these the chunk's rows before it),
     * laid out as the states: `win` (layers, conv.batch, carried) before the step, read
     * only; `win_out` (layers, out_rows, carried) after it (win_out == win: in place, as
     * out == in); `wsnaps` (layers, snap_rows, carried) the draft rows'. `carried` the
     * floats of a layer's of one sequence (0 for Mamba2: no rows, the pointers NULL). */
    const float *win;
    float *win_out, *wsnaps;
    int64_t carried;
    int64_t win_bytes, win_out_bytes, wsnaps_bytes;
} kvlm_state_view;

#endif
