"""The LFM2 family: Liquid AI's LFM2 and LFM2.5 (text; transformers' `Lfm2ForCausalLM`,
llama.cpp's `lfm2`).

Its block beside Llama's (kvlm.config): most layers mix positions with a gated short
convolution instead of attention (`layer_mixers` "conv", kvlm.model.conv: in_proj to B,
C, x; B * x through a depthwise causal convolution of `conv_kernel` positions, L_cache
3; C times that; out_proj), the others attend (GQA) with per-head q/k norms; SwiGLU;
embeddings as they are, tied. Its Hugging Face config names the norm epsilon `norm_eps`
and derives the MLP's width from `block_ff_dim` (`_hf_width`); its layer pattern is
`layer_types` (or `full_attn_idxs`). llama.cpp's converter writes the width it derived,
and the pattern as `attention.head_count_kv`, an array with 0 for a conv layer (the rule
llama.cpp reads it by). Transformers names the block's tensors its own way (`HF_NAMES`)
and its final norm `embedding_norm`, which the GGUF file calls `token_embd_norm`. Its
vocabulary is byte-level BPE with Llama 3's pre-tokenizer (`tokenizer.ggml.pre` "lfm2"),
its chat template the files'.
"""

from __future__ import annotations

from typing import Any

from kvlm.arch.family import CONV_NAMES, GLOBAL_NAMES, LAYER_NAMES, Family, Shape
from kvlm.arch.readers import gguf_config, gguf_kv_pattern, hf_config, hf_layer_mixers
from kvlm.config import CONV_KERNEL, LIMITS, REQUIRED, Fields, ModelConfig, limits, shown, value
from kvlm.errors import ModelLoadError, UnsupportedModelError

# transformers' names of the block's tensors -> the model's (the Llama block's)
HF_NAMES = {
    "operator_norm": "input_layernorm",  # the mixer's input norm, attention or conv
    "ffn_norm": "post_attention_layernorm",  # the MLP's input norm
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
# the final norm: transformers' `embedding_norm`, applied after the last layer; llama.cpp
# reads `token_embd_norm` there (and no `output_norm`)
HF_GLOBALS = {"model.embedding_norm": "model.norm"}
GGUF_GLOBALS = {k: v for k, v in GLOBAL_NAMES.items() if k != "output_norm"} | {
    "token_embd_norm": "model.norm"
}
# HF's layer_types: a conv layer, an attention layer over the whole context
LAYER_TYPES = {"conv": "conv", "full_attention": "attention"}
DEFAULT_KERNEL = 3  # transformers' conv_L_cache


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    hf = Fields(cfg, f"{name}: config.json" if name else "config.json")
    # what every family reads, under LFM2's names (read as transformers reads them)
    common = {"rms_norm_eps": hf("norm_eps", float, 1e-5, lo=0.0),
              "intermediate_size": _hf_width(cfg, hf)}  # fmt: skip
    if "tie_word_embeddings" not in cfg and "tie_embedding" in cfg:
        common["tie_word_embeddings"] = hf("tie_embedding", bool)

    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        mixers = _hf_mixers(cfg, hf, hf("num_hidden_layers", int, **limits("num_layers")))
        kernel = hf("conv_L_cache", int, DEFAULT_KERNEL, *CONV_KERNEL)
        return {"qk_norm": True, "layer_mixers": mixers, "conv_kernel": kernel}

    return hf_config({**cfg, **common}, arch, name, part, rope_theta=1e6, tied=True)


def _hf_width(cfg: dict[str, Any], hf: Fields) -> int:
    """The MLP's width as transformers' Lfm2MLP derives it: `block_ff_dim` (else
    `intermediate_size`), with `block_auto_adjust_ff_dim` 2/3 of it, times
    `block_ffn_dim_multiplier` and rounded up to `block_multiple_of` where the multiplier
    is not null."""
    width = hf("block_ff_dim", int, None, **limits("intermediate_size"))
    width = width or hf("intermediate_size", int, **limits("intermediate_size"))
    if not hf("block_auto_adjust_ff_dim", bool, True):
        return width
    width = int(2 * width / 3)
    if "block_ffn_dim_multiplier" in cfg and cfg["block_ffn_dim_multiplier"] is None:
        return width  # transformers rounds only with a multiplier
    multiplier = hf("block_ffn_dim_multiplier", float, 1.0, lo=0.0)
    multiple = hf("block_multiple_of", int, 256, lo=1, hi=LIMITS["intermediate_size"][1])
    width = int(multiplier * width)
    width = multiple * ((width + multiple - 1) // multiple)
    return value(width, "the MLP's width (block_ff_dim adjusted)", int,
                 *LIMITS["intermediate_size"], where=hf.where)  # fmt: skip


def _hf_mixers(cfg: dict[str, Any], hf: Fields, layers: int) -> tuple[str, ...]:
    """Each layer's mixer from `layer_types`, else `full_attn_idxs` (the attention
    layers; absent: every layer attends, as transformers reads it)."""
    types = cfg.get("layer_types")
    if types is None:
        idxs = cfg.get("full_attn_idxs")
        if idxs is None:
            return ("attention",) * layers
        if not isinstance(idxs, list):
            raise ModelLoadError(f"{hf.where}: full_attn_idxs is {shown(idxs)}; expected a "
                                 "list of layer indices")  # fmt: skip
        at = {value(i, "a full_attn_idxs entry", int, 0, layers - 1, hf.where) for i in idxs}
        types = ["full_attention" if i in at else "conv" for i in range(layers)]
    return hf_layer_mixers(types, LAYER_TYPES, hf, layers)


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    g, mixers = gguf_kv_pattern(g, arch, "conv")

    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        if g(f"{arch}.attention.sliding_window", int, 0):
            raise UnsupportedModelError(f"{g.where}: {arch}.attention.sliding_window: "
                                        "windowed attention in an LFM2 file")  # fmt: skip
        layer_mixers = mixers or ("attention",) * layers
        if len(layer_mixers) != layers:
            raise ModelLoadError(f"{g.where}: {arch}.attention.head_count_kv names "
                                 f"{len(layer_mixers)} layers; {arch}.block_count is "
                                 f"{layers}")  # fmt: skip
        convs = "conv" in layer_mixers
        kernel = g(f"{arch}.shortconv.l_cache", int, REQUIRED if convs else None, *CONV_KERNEL)
        return {"qk_norm": True, "layer_mixers": layer_mixers, "conv_kernel": kernel}

    return gguf_config(g, arch, name, part)


# the Hub's config.json sizes (the MLP's width as `_hf_width` derives it from block_ff_dim
# 6656 / 12288; the attention layers from full_attn_idxs)
_ATTENTION = (2, 5, 8, 10, 12, 14)
SHAPES = {
    "lfm2-350m": Shape("lfm2", 1024, 16, 16, 8, 64, 4608, 65536, True, 1e6, 128000, 1e-5,
                       attention_layers=_ATTENTION),
    "lfm2-1.2b": Shape("lfm2", 2048, 16, 32, 8, 64, 8192, 65536, True, 1e6, 128000, 1e-5,
                       attention_layers=_ATTENTION),
}  # fmt: skip

FAMILY = Family(
    name="lfm2",
    architectures=("lfm2",),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"lfm2": "lfm2"},
    gguf_names=LAYER_NAMES | CONV_NAMES,
    hf_names=HF_NAMES,
    gguf_globals=GGUF_GLOBALS,
    hf_globals=HF_GLOBALS,
    # llama.cpp reads an "lfm2" vocabulary with Llama 3's pre-tokenizer (llama-vocab.cpp)
    pre_tokenizers={"lfm2": "llama3"},
    shapes=SHAPES,
)
