"""The OLMoE family: AI2's mixture-of-experts models (OLMoE-1B-7B-0924 and its Instruct;
transformers' `OlmoeForCausalLM`, llama.cpp's `olmoe`).

A Llama block with two changes: RMSNorms on the queries and the keys before RoPE, each
over the whole projection (`qk_norm_extent` "projection": weights of num_heads x head_dim
and num_kv_heads x head_dim, not a head's), and a mixture of experts for the FFN in every
layer (`layer_ffns` "experts", kvlm.model.experts): a router's softmax over
`num_experts`, the top `num_experts_per_tok` kept at their softmax weights (not
renormalised where `norm_topk_prob` is false, as OLMoE's is), each expert a SwiGLU MLP
of `intermediate_size`; no shared expert. llama.cpp's converter stacks each layer's
experts into one tensor (`ffn_gate_exps`) and writes the experts' width as
`feed_forward_length` (no `expert_feed_forward_length`), the q/k norms' weights as they
are, q and k unpermuted (its graph's RoPE is NeoX's, rotate-half: kvlm's), and an rms eps
of 1e-5 whatever the config says; its graph never renormalises the top k.
"""

from __future__ import annotations

from typing import Any

from kvlm.arch.family import Family, Shape
from kvlm.arch.readers import gguf_config, gguf_expert_counts, hf_config, hf_expert_counts
from kvlm.config import Experts, Fields, ModelConfig, limits
from kvlm.errors import UnsupportedModelError

ARCH = "olmoe"
BLOCK = {"qk_norm": True, "qk_norm_extent": "projection"}


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        layers = hf("num_hidden_layers", int, **limits("num_layers"))
        if hf("clip_qkv", float, None) is not None:  # OLMoE's are null
            raise UnsupportedModelError(f"{hf.where}: clip_qkv (q, k and v clamped) is not "
                                        "supported")  # fmt: skip
        count, top_k = hf_expert_counts(cfg, hf)
        experts = Experts(
            count=count,
            top_k=top_k,
            intermediate=hf("intermediate_size", int, **limits("intermediate_size")),
            normalize=hf("norm_topk_prob", bool, False),
        )
        return {**BLOCK, "layer_ffns": ("experts",) * layers, "experts": experts}

    return hf_config(cfg, arch, name, part)


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        count, top_k = gguf_expert_counts(g, arch)
        experts = Experts(
            count=count,
            top_k=top_k,
            # the converter writes the experts' width as the feed-forward length
            intermediate=g(f"{arch}.feed_forward_length", int, **limits("intermediate_size")),
            normalize=False,  # llama.cpp's olmoe graph keeps the top k's softmax weights
        )
        return {**BLOCK, "layer_ffns": ("experts",) * layers, "experts": experts}

    return gguf_config(g, arch, name, part)


# OLMoE-1B-7B-0924's configuration (its config.json on the Hub); "-2l": its first 2 of 16
# layers, every tensor of the real shape (a file this 2-vCPU machine decodes in seconds)
_1B7B = dict(arch=ARCH, hidden=2048, heads=16, kv_heads=16, head_dim=128, inter=1024,
             vocab=50304, tied=False, rope_theta=1e4, context=4096, eps=1e-5, experts=64,
             experts_used=8, expert_inter=1024)  # fmt: skip
SHAPES = {
    "olmoe-1b-7b": Shape(layers=16, **_1B7B),
    "olmoe-1b-7b-2l": Shape(layers=2, **_1B7B),
}

FAMILY = Family(
    name="olmoe",
    architectures=(ARCH,),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"olmoe": ARCH},
    shapes=SHAPES,
)
