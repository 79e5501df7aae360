"""Random-weight GGUF files of real model shapes, for measuring speed and memory.

Hub downloads are not always possible, and a benchmark of speed needs the shape and the
storage types of a model, not its knowledge. `write_model` writes a GGUF file with the
architecture, sizes and vocabulary of a real model (SHAPES: each family file's, kvlm.arch)
and the tensor types llama.cpp's
quantizer gives each tensor for a file type (RECIPES: Q4_0, Q8_0, Q4_K_M, ...), each tensor
random valid blocks (random codes, scales of a realistic size; gguf-py cannot quantize
K-quants, and random blocks are what a random weight would quantize to anyway). The
tokenizer is the default model's (SmolLM2's BPE), its token list padded with unused tokens
to the shape's vocabulary size, so that both kvlm and llama.cpp load the file.

    python benchmarks/make_models.py --out /tmp/models        # every shape x type
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvlm.arch import SHAPES, Shape, config_from_gguf, family
from kvlm.config import ModelConfig
from kvlm.loading.gguf_file import GGUFFile

try:
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError as exc:  # pragma: no cover - gguf is a declared dependency
    raise ImportError("kvlm needs the `gguf` package: pip install gguf") from exc


# llama.cpp's file types (llama_model_ftype) kvlm writes
FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "MXFP4_MOE": 38}

# bytes per block and the fp16 fields (offset, what) of each block type; the rest of a
# block (codes, packed sub-block scales) takes any bit pattern
_FIELDS: dict[Q, tuple[tuple[int, str], ...]] = {
    Q.Q4_0: ((0, "d"),),
    Q.Q4_1: ((0, "d"), (2, "m")),
    Q.Q5_0: ((0, "d"),),
    Q.Q5_1: ((0, "d"), (2, "m")),
    Q.Q8_0: ((0, "d"),),
    Q.Q4_K: ((0, "d"), (2, "dmin")),
    Q.Q5_K: ((0, "d"), (2, "dmin")),
    Q.Q6_K: ((208, "d"),),
}
# the weight's spread per unit of d, for random codes: Q4_0 (q - 8) and Q8_0 q uniform;
# K-quants times a sub-block scale of ~32 (6-bit) or ~64 (Q6_K's int8)
_SPREAD = {
    Q.Q4_0: 4.6, Q.Q4_1: 4.6, Q.Q5_0: 9.2, Q.Q5_1: 9.2, Q.Q8_0: 74.0,
    Q.Q4_K: 4.6 * 32, Q.Q5_K: 9.2 * 32, Q.Q6_K: 18.5 * 64,
}  # fmt: skip
# zero offsets so that the mean weight is ~0: m = -d * (mean code), dmin ~ d * mean code
_MEAN_CODE = {Q.Q4_1: 7.5, Q.Q5_1: 15.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5}
STD = 0.02  # the spread of a random weight (initializer-sized)
MXFP4_EXPONENT = 120  # an MXFP4 block's scale 2^-8: random codes' weights spread ~0.023

_K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}  # rows not a multiple of 256


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the attn_v / ffn_down layers Q4_K_M keeps at Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(file_type: str, name: str, layer: int | None, layers: int, tied: bool) -> Q:
    """The type llama.cpp's quantizer (llama_tensor_get_type) gives a 2-D weight (MXFP4_MOE:
    the experts' stacks MXFP4, as the Hub's checkpoints keep them, the rest Q8_0)."""
    if file_type == "MXFP4_MOE":
        return Q.MXFP4 if name.endswith("_exps") else Q.Q8_0
    if file_type == "Q8_0":
        return Q.Q8_0
    if name == "output" or (tied and name == "token_embd") or file_type == "Q6_K":
        return Q.Q6_K
    if file_type == "Q4_0":
        return Q.Q4_0
    more = ("attn_v", "ffn_down", "ffn_down_exps")
    if name in more and layer is not None and _use_more_bits(layer, layers):
        return Q.Q6_K
    return Q.Q4_K if file_type == "Q4_K_M" else Q.Q5_K


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks (rows, bytes per row) of `qtype` for a weight [rows, cols] whose
    values spread ~STD."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block}, not {cols}")
    n = rows * (cols // block)
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == Q.MXFP4:  # E2M1 codes (doubled values up to 12, rms ~5.9) times 2^(e - 128)
        data[:, 0] = MXFP4_EXPONENT
        return data.reshape(rows, -1)
    d = float(np.float16(STD / _SPREAD[qtype]))
    # m (Q4_1 / Q5_1: w = d q + m) and dmin (w = d sc q - dmin m, sc and m alike on average)
    mean = _MEAN_CODE.get(qtype, 0.0)
    for offset, what in _FIELDS[qtype]:
        value = np.full(n, d * {"d": 1.0, "m": -mean, "dmin": mean}[what], np.float16)
        data[:, offset : offset + 2] = value.view(np.uint8).reshape(n, 2)
    return data.reshape(rows, -1)


def _llama3_rope_factors(shape: Shape) -> np.ndarray:
    """Llama 3.1/3.2's rope_freqs (factor 32, low 1, high 4, original context 8192)."""
    dims = np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim
    wavelen = 2 * np.pi * shape.rope_theta**dims
    low, high, factor, original = 8192 / 1.0, 8192 / 4.0, 32.0, 8192
    smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
    factors = np.where(wavelen > low, factor, 1.0)
    mid = (wavelen <= low) & (wavelen >= high)
    factors[mid] = 1.0 / ((1 - smooth[mid]) / factor + smooth[mid])
    return factors.astype(np.float32)


def add_shape(w: gguf.GGUFWriter, shape: Shape) -> None:
    """The architecture's size keys of a GGUF file, as llama.cpp's converter writes them."""
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.inter)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(_kv_heads(shape))
    if shape.attention_layers is not None:
        w.add_shortconv_l_cache(shape.conv_kernel)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_vocab_size(shape.vocab)
    if shape.window is not None:
        w.add_sliding_window(shape.window)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_inter)
    if shape.yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.yarn[0])
        w.add_rope_scaling_orig_ctx_len(shape.yarn[1])


def _kv_heads(shape: Shape) -> int | list[int]:
    """`attention.head_count_kv`: a number, or per layer with 0 for a conv layer (as
    llama.cpp's converter writes a conv-and-attention pattern)."""
    if shape.attention_layers is None:
        return shape.kv_heads
    return [shape.kv_heads if i in shape.attention_layers else 0 for i in range(shape.layers)]


def shape_config(shape: Shape) -> ModelConfig:
    """The ModelConfig kvlm reads from a file of this shape (its family's GGUF reader):
    which tensors the file's blocks hold."""
    K, a = gguf.Keys, shape.arch
    sizes = {K.LLM.BLOCK_COUNT: shape.layers, K.LLM.CONTEXT_LENGTH: shape.context,
             K.LLM.EMBEDDING_LENGTH: shape.hidden, K.LLM.FEED_FORWARD_LENGTH: shape.inter,
             K.Attention.HEAD_COUNT: shape.heads, K.Attention.HEAD_COUNT_KV: _kv_heads(shape),
             K.Attention.KEY_LENGTH: shape.head_dim, K.Rope.FREQ_BASE: shape.rope_theta,
             K.Attention.LAYERNORM_RMS_EPS: shape.eps, K.LLM.VOCAB_SIZE: shape.vocab,
             K.Attention.SLIDING_WINDOW: shape.window}  # fmt: skip
    if shape.attention_layers is not None:
        sizes[K.ShortConv.L_CACHE] = shape.conv_kernel
    if shape.experts:
        sizes |= {K.LLM.EXPERT_COUNT: shape.experts, K.LLM.EXPERT_USED_COUNT: shape.experts_used,
                  K.LLM.EXPERT_FEED_FORWARD_LENGTH: shape.expert_inter}  # fmt: skip
    if shape.yarn is not None:
        sizes |= {K.Rope.SCALING_TYPE: "yarn", K.Rope.SCALING_FACTOR: shape.yarn[0],
                  K.Rope.SCALING_ORIG_CTX_LEN: shape.yarn[1]}  # fmt: skip
    meta = {k.format(arch=a): v for k, v in sizes.items() if v is not None}
    return config_from_gguf({K.General.ARCHITECTURE: a, **meta})


def write_model(shape_name: str, file_type: str, out: Path, tokenizer_from: Path) -> Path:
    """Write `out`: the shape `shape_name` in `file_type`, the tokenizer of the GGUF file
    `tokenizer_from` (padded to the vocabulary)."""
    shape = SHAPES[shape_name]
    config = shape_config(shape)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(out), shape.arch)
    w.add_name(f"random {shape_name} {file_type}")
    add_shape(w, shape)
    w.add_file_type(FILE_TYPES[file_type])
    _copy_tokenizer(w, tokenizer_from, shape.vocab)

    # llama.cpp's quantizer counts attn_v tensors among the layers that have one
    attending = [i for i in range(shape.layers) if i not in config.conv_layers]

    def weight(name: str, rows: int, cols: int, layer: int | None = None, stack: int = 0) -> None:
        """A weight [rows, cols], or `stack` of them (every expert's: (stack, rows, cols))."""
        base = name.split(".")[-1] if layer is None else name.split(".")[2]
        at, of = layer, shape.layers
        if base == "attn_v" and layer is not None:
            at, of = attending.index(layer), len(attending)
        qtype = tensor_type(file_type, base, at, of, shape.tied)
        if cols % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = _K_FALLBACK[qtype]
        data = random_blocks(qtype, max(stack, 1) * rows, cols, rng)
        if stack:
            data = data.reshape(stack, rows, -1)
        w.add_tensor(f"{name}.weight", data, raw_shape=data.shape, raw_dtype=qtype)

    def vector(name: str, n: int, value: float = 1.0) -> None:
        w.add_tensor(name, np.full(n, value, np.float32))

    def bias(name: str, *size: int) -> None:
        if shape.biases:
            w.add_tensor(f"{name}.bias", rng.normal(0, STD, size).astype(np.float32))

    gguf_name = family(shape.arch).to_gguf_name

    def mlp(p: str, i: int) -> None:
        # the MLP's input norm, by the family's name for it (ffn_norm for most)
        vector(gguf_name(f"model.layers.{i}.post_attention_layernorm.weight"), h)
        if shape.experts:  # the router (never quantized, as llama.cpp's quantizer leaves it)
            n, e = shape.experts, shape.expert_inter
            router = rng.normal(0, STD, (n, h)).astype(np.float32)
            w.add_tensor(f"{p}.ffn_gate_inp.weight", router)
            bias(f"{p}.ffn_gate_inp", n)
            for part, rows, cols in (("gate", e, h), ("up", e, h), ("down", h, e)):
                weight(f"{p}.ffn_{part}_exps", rows, cols, i, stack=n)
                bias(f"{p}.ffn_{part}_exps", n, rows)
            return
        weight(f"{p}.ffn_gate", shape.inter, h, i)
        weight(f"{p}.ffn_up", shape.inter, h, i)
        weight(f"{p}.ffn_down", h, shape.inter, i)

    h, d, hq, hkv = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    weight("token_embd", shape.vocab, h)
    for i in range(shape.layers):
        p = f"blk.{i}"
        vector(f"{p}.attn_norm.weight", h)
        if i in config.conv_layers:  # B, C, x; the depthwise taps; the output
            weight(f"{p}.shortconv.in_proj", 3 * h, h, i)
            taps = rng.normal(0, 1 / shape.conv_kernel, (h, shape.conv_kernel))
            w.add_tensor(f"{p}.shortconv.conv.weight", taps.astype(np.float32))
            weight(f"{p}.shortconv.out_proj", h, h, i)
            mlp(p, i)
            continue
        weight(f"{p}.attn_q", hq * d, h, i)
        weight(f"{p}.attn_k", hkv * d, h, i)
        weight(f"{p}.attn_v", hkv * d, h, i)
        if shape.qkv_bias or shape.biases:
            for part, n in (("attn_q", hq * d), ("attn_k", hkv * d), ("attn_v", hkv * d)):
                w.add_tensor(f"{p}.{part}.bias", rng.normal(0, STD, n).astype(np.float32))
        if config.qk_norm:  # q/k norms (a head's, or the whole projection's)
            vector(f"{p}.attn_q_norm.weight", config.qk_norm_sizes[0])
            vector(f"{p}.attn_k_norm.weight", config.qk_norm_sizes[1])
        if config.attn_sinks:  # a logit a query head
            w.add_tensor(f"{p}.attn_sinks.weight", rng.normal(0, 1, hq).astype(np.float32))
        weight(f"{p}.attn_output", h, hq * d, i)
        bias(f"{p}.attn_output", h)
        if config.norm_layout == "sandwich":  # the attention's and the MLP's outputs normed
            vector(f"{p}.post_attention_norm.weight", h)
            vector(f"{p}.post_ffw_norm.weight", h)
        mlp(p, i)
    # the final norm under the family's name for it (token_embd_norm for some)
    vector(family(shape.arch).to_gguf_name("model.norm.weight"), h)
    if not shape.tied:
        weight("output", shape.vocab, h)
    if shape.llama3_rope:
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _copy_tokenizer(w: gguf.GGUFWriter, source: Path, vocab: int) -> None:
    meta = GGUFFile(source).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if len(tokens) > vocab:
        raise ValueError(f"{source.name}'s tokenizer has {len(tokens)} tokens > {vocab}")
    pad = vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [gguf.TokenType.UNUSED] * pad
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    for key, add in (
        ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
        ("tokenizer.ggml.unknown_token_id", w.add_unk_token_id),
        ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
        ("tokenizer.ggml.add_bos_token", w.add_add_bos_token),
        ("tokenizer.chat_template", w.add_chat_template),
    ):
        if key in meta:
            add(meta[key])
