"""The DeepSeek-V2 family: latent attention and a mixture of experts (DeepSeek-V2,
DeepSeek-V2-Lite, DeepSeek-Coder-V2; transformers' `DeepseekV2ForCausalLM`, model_type
`deepseek_v2`; llama.cpp's `deepseek2`).

Every layer's mixer is latent attention (`layer_mixers` "latent", kvlm.model.mla; its sizes
`Latent`): `kv_lora_rank` the latent the cache keeps, `qk_rope_head_dim` the shared key
part RoPE rotates, `qk_nope_head_dim` and `v_head_dim` each head's key and value rows of
kv_b, `q_lora_rank` a compressed query (null: one q_proj). Their RMSNorms (q_a_layernorm,
kv_a_layernorm) take transformers' fixed 1e-6, not rms_norm_eps. Scores scale by
(nope + rope) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN
(`query_scale`); cos/sin by YaRN's own factor (RopeScaling.attention_scaling).

RoPE turns (x[2i], x[2i+1]) pairs (transformers' complex `apply_rotary_emb`), not kvlm's
halves: `fold_hf` reorders the rotated rows of q (each head's last rope rows) and of the
key part (kv_a's last rope rows) evens first, then odds; a score is the same sum of
products in another order, bit for bit up to the order of a dot product's terms.

FFN: the first `first_k_dense_replace` layers a gated MLP of `intermediate_size`, the
others (every `moe_layer_freq`-th) `n_routed_experts` experts of `moe_intermediate_size`,
the top `num_experts_per_tok` of a softmax over all (`topk_method` "greedy"; transformers
does not renormalise them whatever `norm_topk_prob` says), times `routed_scaling_factor`,
beside `n_shared_experts` shared experts as one MLP of n x moe_intermediate_size
(`mlp.shared_experts`). "group_limited_greedy" (the 236B model's) is refused.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from kvlm.arch.family import LAYER_NAMES, Family
from kvlm.arch.readers import gguf_config, hf_config
from kvlm.config import EXPERTS, REQUIRED, Experts, Fields, Latent, ModelConfig, limits
from kvlm.errors import UnsupportedModelError

ARCH = "deepseek2"
# transformers' DeepseekV2RMSNorm of the latent and the compressed query: its default eps
LATENT_NORM_EPS = 1e-6
HF_NAMES = {f"mlp.shared_experts.{n}": f"mlp.shared_expert.{n}"
            for n in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
# llama.cpp's names of the latent attention's tensors; its converter splits kv_b into each
# head's K rows, transposed (`attn_k_b`: (H, kv_rank, nope)), and V rows (`attn_v_b`:
# (H, v, kv_rank)), which the mixer's builder joins back (an older file's `attn_kv_b` whole)
GGUF_NAMES = {
    **LAYER_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    sizes: dict[str, int] = {}

    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        layers = hf("num_hidden_layers", int, **limits("num_layers"))
        dim = dict(lo=1, hi=1 << 14)
        latent = Latent(
            kv_rank=hf("kv_lora_rank", int, **dim),
            q_rank=hf("q_lora_rank", int, None, **dim) or 0,
            nope_dim=hf("qk_nope_head_dim", int, **dim),
            rope_dim=hf("qk_rope_head_dim", int, **dim),
            v_dim=hf("v_head_dim", int, **dim),
            norm_eps=LATENT_NORM_EPS,
        )
        sizes["qk_dim"], sizes["rope_dim"] = latent.qk_dim, latent.rope_dim
        method = hf("topk_method", str, "greedy")
        if method != "greedy":
            raise UnsupportedModelError(f"{hf.where}: topk_method {method!r}: kvlm's router "
                                        "takes the top k of all experts (greedy) only")  # fmt: skip
        count = hf("n_routed_experts", int, lo=EXPERTS[0], hi=EXPERTS[1])
        top_k = hf("num_experts_per_tok", int, lo=1, hi=count)
        inter = hf("moe_intermediate_size", int, **limits("intermediate_size"))
        shared = hf("n_shared_experts", int, 0, lo=0, hi=1 << 10)
        experts = Experts(
            count=count, top_k=top_k, intermediate=inter, normalize=False, router="softmax",
            scale=hf("routed_scaling_factor", float, 1.0, lo=0.0),
            shared=shared * inter,
        )  # fmt: skip
        dense = hf("first_k_dense_replace", int, 0, lo=0, hi=layers)
        every = hf("moe_layer_freq", int, 1, lo=1, hi=layers)
        ffns = tuple("experts" if i >= dense and i % every == 0 else "mlp" for i in range(layers))
        return {"layer_mixers": ("latent",) * layers, "latent": latent, "layer_ffns": ffns,
                "experts": experts if "experts" in ffns else None}  # fmt: skip

    config = hf_config(cfg, arch, name, part)
    # head_dim: the rotated part's, as transformers' config has it (the Hub's configs name
    # none: not hidden / heads); the heads' own sizes are the Latent's
    config = replace(config, head_dim=sizes["rope_dim"], num_kv_heads=config.num_heads)
    return _with_scale(config, sizes["qk_dim"])


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    """llama.cpp's converter's keys: `attention.kv_lora_rank`, `.q_lora_rank` (absent: one
    q projection), `.key_length_mla` (nope + rope), `.value_length_mla`,
    `rope.dimension_count`; `head_count_kv` 1 and `key_length` kv_rank + rope (its MQA
    view of the latent); the experts after `leading_dense_block_count`, weighed by
    `expert_weights_scale`, renormalised where `expert_weights_norm`, beside
    `expert_shared_count` shared ones; YaRN's mscale_all_dim as 10 x
    `rope.scaling.yarn_log_multiplier` (llama.cpp keeps one mscale: cos/sin unscaled,
    as the DeepSeek-V2 configs' mscale = mscale_all_dim make them)."""
    sizes: dict[str, int] = {}

    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        def key(k: str, kind: type = int, default: Any = REQUIRED, **bounds: Any) -> Any:
            return g(f"{arch}.{k}", kind, default, **bounds)

        dim = dict(lo=1, hi=1 << 14)
        rope = key("rope.dimension_count", int, **dim)
        qk = key("attention.key_length_mla", int, **dim)
        if qk <= rope:
            raise UnsupportedModelError(f"{g.where}: {arch}.attention.key_length_mla "
                                        f"{qk} is not more than rope.dimension_count "
                                        f"{rope}")  # fmt: skip
        latent = Latent(
            kv_rank=key("attention.kv_lora_rank", int, **dim),
            q_rank=key("attention.q_lora_rank", int, 0, lo=0, hi=1 << 16),
            nope_dim=qk - rope,
            rope_dim=rope,
            v_dim=key("attention.value_length_mla", int, **dim),
            norm_eps=LATENT_NORM_EPS,  # transformers' (llama.cpp's: the file's fp32 rms eps)
        )
        sizes["qk_dim"], sizes["rope_dim"] = latent.qk_dim, rope
        dense = key("leading_dense_block_count", int, 0, lo=0, hi=layers)
        gating = key("expert_gating_func", int, 1)
        if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise UnsupportedModelError(f"{g.where}: {arch}.expert_gating_func {gating}: "
                                        "kvlm reads the softmax router (1) only")  # fmt: skip
        ffns = ("mlp",) * dense + ("experts",) * (layers - dense)
        experts = None
        if "experts" in ffns:
            count = key("expert_count", int, lo=1, hi=EXPERTS[1])
            inter = key("expert_feed_forward_length", int, **limits("intermediate_size"))
            experts = Experts(
                count=count,
                top_k=key("expert_used_count", int, lo=1, hi=count),
                intermediate=inter,
                normalize=key("expert_weights_norm", bool, False),
                scale=key("expert_weights_scale", float, 1.0, lo=0.0),
                shared=key("expert_shared_count", int, 0, lo=0, hi=1 << 10) * inter,
            )
        yarn = key("rope.scaling.yarn_log_multiplier", float, None, lo=0.0)
        if yarn is not None:
            sizes["mscale_all_dim"] = yarn / 0.1  # type: ignore[assignment]
        return {"layer_mixers": ("latent",) * layers, "latent": latent, "layer_ffns": ffns,
                "experts": experts}  # fmt: skip

    config = gguf_config(g, arch, name, part, partial_rope=True)
    config = replace(config, head_dim=sizes["rope_dim"], num_kv_heads=config.num_heads,
                     rope_dim=None)  # fmt: skip
    s = config.rope_scaling
    m = sizes.get("mscale_all_dim")
    if s.rope_type == "yarn" and m:
        config = replace(config, rope_scaling=replace(s, mscale=m, mscale_all_dim=m))
    return _with_scale(config, sizes["qk_dim"])


def _with_scale(config: ModelConfig, qk_dim: int) -> ModelConfig:
    """The scores' scale: qk_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under
    YaRN where the config names mscale_all_dim (transformers' yarn_apply_mscale)."""
    s = config.rope_scaling
    if s.rope_type == "yarn" and s.mscale_all_dim:
        scale = qk_dim**-0.5 * _yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return replace(config, query_scale=scale)
    return config


def _evens_first(rows: torch.Tensor) -> torch.Tensor:
    """The rotated rows (dim 0, or dim 1 of a head-major view) as pairs (2i, 2i + 1)
    turn in transformers -> kvlm's halves: the even ones, then the odd ones."""
    return torch.cat([rows[0::2], rows[1::2]])


def fold_hf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """q's and the key part's RoPE rows from interleaved pairs to halves (module
    docstring)."""
    x = config.latent
    if x is None:
        return tensor
    if name.endswith((".self_attn.q_b_proj.weight", ".self_attn.q_proj.weight")):
        heads = tensor.reshape(config.num_heads, x.qk_dim, -1)
        nope, rot = heads.split([x.nope_dim, x.rope_dim], dim=1)
        rot = torch.cat([rot[:, 0::2], rot[:, 1::2]], dim=1)
        return torch.cat([nope, rot], dim=1).reshape(tensor.shape)
    if name.endswith((".self_attn.kv_a_proj_with_mqa.weight",
                      ".self_attn.kv_a_proj_with_mqa.bias")):  # fmt: skip
        return torch.cat([tensor[: x.kv_rank], _evens_first(tensor[x.kv_rank :])])
    return tensor


FAMILY = Family(
    name="deepseek2",
    architectures=(ARCH,),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"deepseek_v2": ARCH},
    gguf_names=GGUF_NAMES,
    hf_names=HF_NAMES,
    fold_hf=fold_hf,
    gguf_rows=fold_hf,  # llama.cpp turns the same pairs (its NORM RoPE): the same rows
)
