"""The Qwen3-MoE family: Qwen3's mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B,
Qwen3-Coder-30B-A3B; transformers' `Qwen3MoeForCausalLM`, llama.cpp's `qwen3moe`).

Qwen3's block (kvlm.arch.llama: per-head q/k norms, SwiGLU, RoPE) with a mixture of
experts for its FFN (`layer_ffns` "experts", kvlm.model.experts): a router's softmax over
`num_experts`, the top `num_experts_per_tok`, renormalised where `norm_topk_prob`, each
expert a SwiGLU MLP of `moe_intermediate_size`. Hugging Face configs may keep a dense MLP
(of `intermediate_size`) in some layers: those in `mlp_only_layers`, and all but every
`decoder_sparse_step`-th. llama.cpp's converter stacks each layer's experts into one
tensor (`ffn_gate_exps`, (experts, rows, columns)) and its graph renormalises the top k
always and puts experts in every layer, so a GGUF file reads that way.
"""

from __future__ import annotations

from typing import Any

from kvlm.arch.family import Family, Shape
from kvlm.arch.readers import gguf_config, gguf_experts, hf_config, hf_expert_counts
from kvlm.config import Experts, Fields, ModelConfig, limits, value

ARCH = "qwen3moe"


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        layers = hf("num_hidden_layers", int, **limits("num_layers"))
        count, top_k = hf_expert_counts(cfg, hf)
        experts = Experts(
            count=count,
            top_k=top_k,
            intermediate=hf("moe_intermediate_size", int, **limits("intermediate_size")),
            normalize=hf("norm_topk_prob", bool, False),
        )
        step = hf("decoder_sparse_step", int, 1, lo=1, hi=layers)
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            dense = [dense]
        dense = {value(i, "an mlp_only_layers entry", int, 0, layers - 1, hf.where) for i in dense}
        ffns = tuple("experts" if i not in dense and (i + 1) % step == 0 else "mlp"
                     for i in range(layers))  # fmt: skip
        return {"qk_norm": True, "layer_ffns": ffns, "experts": experts}

    return hf_config(cfg, arch, name, part, rope_theta=1e6)


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        # llama.cpp's qwen3moe graph renormalises the top k
        experts = gguf_experts(g, arch, normalize=True)
        return {"qk_norm": True, "layer_ffns": ("experts",) * layers, "experts": experts}

    return gguf_config(g, arch, name, part)


# The configurations of the models named (their config.json on the Hub); "-8l", "-16l":
# the first 8 or 16 of its 48 layers, every tensor of the real shape (the whole file and
# its peer's do not fit a 24 GiB machine together)
_30B = dict(arch=ARCH, hidden=2048, heads=32, kv_heads=4, head_dim=128, inter=6144,
            vocab=151936, tied=False, rope_theta=1e6, context=40960, experts=128,
            experts_used=8, expert_inter=768)  # fmt: skip
SHAPES = {
    "qwen3-30b-a3b": Shape(layers=48, **_30B),
    "qwen3-30b-a3b-8l": Shape(layers=8, **_30B),
    "qwen3-30b-a3b-16l": Shape(layers=16, **_30B),
}

FAMILY = Family(
    name="qwen3moe",
    architectures=(ARCH,),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"qwen3_moe": ARCH},
    shapes=SHAPES,
)
