"""The gpt-oss family: OpenAI's open-weight mixtures of experts (gpt-oss-20b, gpt-oss-120b;
transformers' `GptOssForCausalLM`, llama.cpp's `gpt-oss`).

Llama's block with q/k/v/o biases, attention sinks (`attn_sinks`: a learned logit a query
head in each row's softmax, kvlm.model.attention.attend_explicit), layers alternating a
sliding window (`sliding_window`, 128) and the whole context (`layer_types`), YaRN, and a
mixture of experts in every layer (kvlm.model.experts): a router with a bias, the top
`num_experts_per_tok` of its logits, a softmax over those alone (router "topk_softmax");
each expert of `intermediate_size` with biases and the clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`: activation "clamped_swiglu").

A Hugging Face checkpoint stacks the experts transposed and gate/up interleaved:
`mlp.experts.gate_up_proj` (E, hidden, 2 I), gate the even columns, up the odd ones, with
`gate_up_proj_bias` (E, 2 I); `down_proj` (E, I, hidden). `fold_hf` turns them into the
model's (E, rows, columns) stacks, gate's rows then up's, as llama.cpp's converter splits
them (`ffn_gate_exps`, `ffn_up_exps`, their biases). The Hub's own checkpoints keep the
experts as MXFP4 blocks and scales (`gate_up_proj_blocks`): kvlm reads a folder of float
tensors (transformers' dequantized save) and GGUF files, whose MXFP4 experts the loader
keeps as stored, the weight kind "mxfp4" (kvlm.loading.gguf, kvlm.model.quant; dequantized
where the weights are not native: --exact, a GPU, --weights f32/bf16).

llama.cpp's graph hard-codes what its files do not store: the window on every other
layer, the first one windowed (its `set_swa_pattern(2)`), and the clamped SwiGLU's alpha
1.702 and limit 7.0; YaRN's ramp is read as the Hub's configs give it (`truncate`
false), where llama.cpp rounds the ramp's ends to whole dimensions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvlm.arch.family import LAYER_NAMES, Family, Shape
from kvlm.arch.readers import (
    gguf_config,
    gguf_experts,
    hf_config,
    hf_expert_counts,
    hf_layer_mixers,
    hf_window,
)
from kvlm.config import Experts, Fields, ModelConfig, limits

ARCH = "gpt-oss"
WINDOW, ALPHA, LIMIT = 128, 1.702, 7.0  # transformers' defaults, llama.cpp's constants
LAYER_TYPES = {"sliding_attention": "window", "full_attention": "full"}


def _block(experts: Experts, windows: tuple[int | None, ...]) -> dict[str, Any]:
    return {"attn_sinks": True, "layer_ffns": ("experts",) * len(windows),
            "experts": experts, "layer_windows": windows}  # fmt: skip


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        layers = hf("num_hidden_layers", int, **limits("num_layers"))
        count, top_k = hf_expert_counts(cfg, hf)
        experts = Experts(
            count=count,
            top_k=top_k,
            intermediate=hf("intermediate_size", int, **limits("intermediate_size")),
            normalize=False,
            router="topk_softmax",
            activation="clamped_swiglu",
            swiglu_alpha=hf("swiglu_alpha", float, ALPHA, lo=0.0),
            swiglu_limit=hf("swiglu_limit", float, LIMIT, lo=0.0),
        )
        window = hf_window(hf) or WINDOW
        types = cfg.get("layer_types")
        if types is None:  # transformers' default: the even layers windowed
            types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(layers)]  # fmt: skip
        kinds = hf_layer_mixers(types, LAYER_TYPES, hf, layers)
        return _block(experts, tuple(window if k == "window" else None for k in kinds))

    return hf_config(cfg, arch, name, part, rope_theta=150000.0)


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        # llama.cpp's graph: alpha 1.702, limit 7.0
        experts = gguf_experts(g, arch, normalize=False, router="topk_softmax",
                               activation="clamped_swiglu")  # fmt: skip
        window = g(f"{arch}.attention.sliding_window", int, WINDOW, **limits("sliding_window"))
        # llama.cpp's set_swa_pattern(2): the even layers windowed
        return _block(experts, tuple(window if i % 2 == 0 else None for i in range(layers)))

    config = gguf_config(g, arch, name, part)
    if config.rope_scaling.rope_type == "yarn":  # the Hub's configs: YaRN's ramp unrounded
        config = replace(config, rope_scaling=replace(config.rope_scaling, truncate=False))
    return config


# A checkpoint's names -> the model's: the router, and the experts' stacks (named whole:
# they have no `.weight` of their own)
HF_NAMES = {
    "mlp.router": "mlp.gate",
    "mlp.experts.gate_up_proj": "mlp.experts.gate_up_proj.weight",
    "mlp.experts.gate_up_proj_bias": "mlp.experts.gate_up_proj.bias",
    "mlp.experts.down_proj": "mlp.experts.down_proj.weight",
    "mlp.experts.down_proj_bias": "mlp.experts.down_proj.bias",
}
GGUF_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",  # the MLP's input norm here
    "attn_sinks.weight": "self_attn.sinks",
}
_TRANSPOSED = (".mlp.experts.gate_up_proj.weight", ".mlp.experts.down_proj.weight")


def _hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A stack's shape once `fold_hf` has turned it (E, columns, rows) -> (E, rows, columns)."""
    if name.endswith(_TRANSPOSED) and len(shape) == 3:
        return (shape[0], shape[2], shape[1])
    return shape


def fold_hf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The experts' stacks as the model takes them: (E, rows, columns), gate|up's rows
    de-interleaved (gate the even ones, then up the odd ones), as llama.cpp's converter
    splits them; their biases alike."""
    if name.endswith(_TRANSPOSED):
        tensor = tensor.transpose(1, 2)
    if name.endswith((".mlp.experts.gate_up_proj.weight", ".mlp.experts.gate_up_proj.bias")):
        tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
    return tensor.contiguous()


# gpt-oss-20b's config.json: 24 layers of 32 experts (4 a token) of 2880, 64 query heads of
# 64 over 8 KV heads, a 201,088-token vocabulary, YaRN x32 over 4,096; its slice of 4
# layers keeps every tensor's shape (the vocabulary's projections are then a larger share
# of what a token reads than in the whole model)
_20B = dict(arch=ARCH, hidden=2880, heads=64, kv_heads=8, head_dim=64, inter=2880,
            vocab=201088, tied=False, rope_theta=150000.0, context=131072, eps=1e-5,
            window=WINDOW, experts=32, experts_used=4, expert_inter=2880, biases=True,
            yarn=(32.0, 4096))  # fmt: skip
SHAPES = {
    "gpt-oss-20b": Shape(layers=24, **_20B),
    "gpt-oss-20b-4l": Shape(layers=4, **_20B),
}

FAMILY = Family(
    name="gptoss",
    architectures=(ARCH,),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"gpt_oss": ARCH},
    gguf_names=GGUF_NAMES,
    hf_names=HF_NAMES,
    fold_hf=fold_hf,
    hf_shape=_hf_shape,
    shapes=SHAPES,
)
