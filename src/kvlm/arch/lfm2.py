"""The LFM2 family: Liquid AI's LFM2 and LFM2.5 (text; transformers' `Lfm2ForCausalLM`,
llama.cpp's `lfm2`), and LFM2-MoE (LFM2-8B-A1B, LFM2-24B-A2B: transformers'
`Lfm2MoeForCausalLM`, `lfm2_moe`; llama.cpp's `lfm2moe`).

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

LFM2-MoE is that layer mix with a mixture of experts (kvlm.model.experts) for the FFN
after its first `num_dense_layers` (dense MLPs of `intermediate_size` as it is: no
block_ff_dim adjustment) and a sigmoid router: each expert's sigmoid score, the top
`num_experts_per_tok` by score + `expert_bias` (a per-expert selection bias, where
`use_expert_bias`), the chosen un-biased scores divided by (their sum + 1e-6) where
`norm_topk_prob`, times `routed_scaling_factor`. Its checkpoints keep one tensor an
expert (`feed_forward.experts.E.w1`); llama.cpp's converter stacks them (`ffn_*_exps`),
writes the bias as `exp_probs_b.bias`, the dense layers as `leading_dense_block_count`
and the router as `expert_gating_func` (2: sigmoid), and neither the scale nor the
renormalisation: llama.cpp's graph renormalises always (the sum clamped from below, no
epsilon) and scales by nothing (its lfm2moe reads no `expert_weights_scale`), so a GGUF
file reads that way.
"""

from __future__ import annotations

from typing import Any

from kvlm.arch.family import CONV_NAMES, GLOBAL_NAMES, LAYER_NAMES, Family, Shape
from kvlm.arch.readers import (
    gguf_config,
    gguf_experts,
    gguf_kv_pattern,
    hf_config,
    hf_layer_mixers,
)
from kvlm.config import (
    CONV_KERNEL,
    EXPERTS,
    LIMITS,
    REQUIRED,
    Experts,
    Fields,
    ModelConfig,
    limits,
    shown,
    value,
)
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
    # LFM2-MoE's: the router, the selection bias (feed_forward.expert_bias), each expert's
    # (E: any expert's index)
    "feed_forward.gate": "mlp.gate",
    "feed_forward": "mlp",
    "feed_forward.experts.*.w1": "mlp.experts.*.gate_proj",
    "feed_forward.experts.*.w3": "mlp.experts.*.up_proj",
    "feed_forward.experts.*.w2": "mlp.experts.*.down_proj",
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


MOE = "lfm2moe"  # llama.cpp's general.architecture of LFM2-MoE
# transformers' renormalisation: the chosen scores over (their sum + 1e-6)
HF_NORM_EPS = 1e-6
GATING_SIGMOID = 2  # llama.cpp's expert_gating_func (LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    hf = Fields(cfg, f"{name}: config.json" if name else "config.json")
    # what every family reads, under LFM2's names (read as transformers reads them); the
    # MoE's dense MLPs are of intermediate_size as it is
    width = hf("intermediate_size", int, **limits("intermediate_size")) if arch == MOE else None
    common = {"rms_norm_eps": hf("norm_eps", float, 1e-5, lo=0.0),
              "intermediate_size": width or _hf_width(cfg, hf)}  # fmt: skip
    if "tie_word_embeddings" not in cfg and "tie_embedding" in cfg:
        common["tie_word_embeddings"] = hf("tie_embedding", bool)

    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        layers = hf("num_hidden_layers", int, **limits("num_layers"))
        mixers = _hf_mixers(cfg, hf, layers)
        kernel = hf("conv_L_cache", int, DEFAULT_KERNEL, *CONV_KERNEL)
        own = {"qk_norm": True, "layer_mixers": mixers, "conv_kernel": kernel}
        return own | (_hf_experts(hf, layers) if arch == MOE else {})

    return hf_config({**cfg, **common}, arch, name, part, rope_theta=1e6, tied=True)


def _hf_experts(hf: Fields, layers: int) -> dict:
    """LFM2-MoE's FFNs: dense in the first `num_dense_layers`, then experts behind the
    sigmoid router (transformers' defaults where a key is absent)."""
    count = hf("num_experts", int, 32, lo=EXPERTS[0], hi=EXPERTS[1])
    experts = Experts(
        count=count,
        top_k=hf("num_experts_per_tok", int, 4, lo=1, hi=count),
        intermediate=hf("moe_intermediate_size", int, 1792, **limits("intermediate_size")),
        normalize=hf("norm_topk_prob", bool, True),
        router="sigmoid",
        norm_eps=HF_NORM_EPS,
        scale=hf("routed_scaling_factor", float, 1.0, lo=1e-6, hi=1e6),
        selection_bias=hf("use_expert_bias", bool, True),
    )
    dense = hf("num_dense_layers", int, 2, lo=0, hi=layers)
    return {"layer_ffns": ("mlp",) * dense + ("experts",) * (layers - dense), "experts": experts}


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
        own = {"qk_norm": True, "layer_mixers": layer_mixers, "conv_kernel": kernel}
        return own | (_gguf_experts(g, arch, layers) if arch == MOE else {})

    return gguf_config(g, arch, name, part)


def _gguf_experts(g: Fields, arch: str, layers: int) -> dict:
    """An lfm2moe file's FFNs as llama.cpp runs them: dense in the first
    `leading_dense_block_count`, then experts behind the sigmoid router with the
    selection bias (`exp_probs_b`), renormalised always, unscaled."""
    gating = g(f"{arch}.expert_gating_func", int, GATING_SIGMOID)
    if gating != GATING_SIGMOID:
        raise UnsupportedModelError(f"{g.where}: {arch}.expert_gating_func is {gating}; "
                                    f"llama.cpp runs {arch} files by sigmoid "
                                    f"({GATING_SIGMOID})")  # fmt: skip
    experts = gguf_experts(g, arch, normalize=True, router="sigmoid", selection_bias=True)
    dense = g(f"{arch}.leading_dense_block_count", int, 0, lo=0, hi=layers)
    return {"layer_ffns": ("mlp",) * dense + ("experts",) * (layers - dense), "experts": experts}


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
    architectures=("lfm2", MOE),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"lfm2": "lfm2", "lfm2_moe": MOE},
    gguf_names=LAYER_NAMES | CONV_NAMES,
    hf_names=HF_NAMES,
    gguf_globals=GGUF_GLOBALS,
    hf_globals=HF_GLOBALS,
    # llama.cpp reads an "lfm2" vocabulary with Llama 3's pre-tokenizer (llama-vocab.cpp)
    pre_tokenizers={"lfm2": "llama3"},
    shapes=SHAPES,
)
