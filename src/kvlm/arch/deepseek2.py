"""The DeepSeek-V2 family: latent attention and a mixture of experts (DeepSeek-V2,
DeepSeek-V2-Lite, DeepSeek-Coder-V2; transformers' `DeepseekV2ForCausalLM`, model_type
`deepseek_v2`; llama.cpp's `deepseek2`), and the models built of the same layers with
DeepSeek-V3's router: GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, model_type `glm4_moe_lite`)
and DeepSeek-V3 (`DeepseekV3ForCausalLM`, `deepseek_v3`), which llama.cpp's converter
writes as `deepseek2` files too.

Every layer's mixer is latent attention (`layer_mixers` "latent", kvlm.model.mla; its sizes
`Latent`): `kv_lora_rank` the latent the cache keeps, `qk_rope_head_dim` the shared key
part RoPE rotates, `qk_nope_head_dim` and `v_head_dim` each head's key and value rows of
kv_b, `q_lora_rank` a compressed query (null: one q_proj). Their RMSNorms (q_a_layernorm,
kv_a_layernorm) take transformers' fixed 1e-6, not rms_norm_eps. Scores scale by
(nope + rope) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN
(`query_scale`); cos/sin by YaRN's own factor (RopeScaling.attention_scaling).

RoPE turns (x[2i], x[2i+1]) pairs (transformers' complex `apply_rotary_emb`; V3's and
GLM's `rope_interleave`, their default and the released configs'), not kvlm's halves:
`fold_hf` reorders the rotated rows of q (each head's last rope rows) and of the key part
(kv_a's last rope rows) evens first, then odds; a score is the same sum of products in
another order, bit for bit up to the order of a dot product's terms. `rope_interleave`
false and a `partial_rotary_factor` other than 1 are refused.

FFN: dense layers (a gated MLP of `intermediate_size`) first, then `n_routed_experts`
experts of `moe_intermediate_size`, the top `num_experts_per_tok` a token, times
`routed_scaling_factor`, beside `n_shared_experts` shared experts as one MLP of n x
moe_intermediate_size (`mlp.shared_experts`). The dense layers: V2's first
`first_k_dense_replace` (0 where absent) and all but every `moe_layer_freq`-th; V3's first
`first_k_dense_replace` (3); GLM's `mlp_layer_types` ("dense" / "sparse"), or where a
config has none the first `first_k_dense_replace` (1: transformers' default of one dense
layer, the released config's value). The routers:

- V2 (`topk_method` "greedy"): a softmax over all, the top k, not renormalised
  (transformers does not whatever `norm_topk_prob` says); "group_limited_greedy" (the
  236B model's) the same among the experts of the `topk_group` best of `n_group` groups,
  a group scored by its best expert (Experts.group_score "max").
- V3 and GLM ("noaux_tc", which transformers runs whatever `topk_method` says): each
  expert's sigmoid, the top k by sigmoid + `e_score_correction_bias` (the selection bias,
  `mlp.expert_bias`) among the `topk_group` best of `n_group` groups (a group scored by
  its two best biased scores' sum), the un-biased scores renormalised where
  `norm_topk_prob` (their sum + 1e-20, transformers' epsilon).

Group-limited routing runs on the torch road (the kernels' router takes every expert:
kvlm.model.experts.GROUPS_REFUSED); GLM-4.7-Flash's one group does not limit.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from kvlm.arch.family import LAYER_NAMES, Family
from kvlm.arch.readers import gguf_config, gguf_vocab, hf_config, hf_rope
from kvlm.config import (
    EXPERTS,
    REQUIRED,
    Experts,
    Fields,
    Latent,
    ModelConfig,
    limits,
    shown,
    value,
)
from kvlm.errors import ModelLoadError, UnsupportedModelError

ARCH = "deepseek2"
# transformers' DeepseekV2RMSNorm of the latent and the compressed query: its default eps
LATENT_NORM_EPS = 1e-6
# the config.json model types this file reads: their routers and dense layers differ
V2, V3, GLM = "deepseek_v2", "deepseek_v3", "glm4_moe_lite"
# the dense layers first where a config names no count: transformers' defaults
DENSE_FIRST = {V2: 0, V3: 3, GLM: 1}
# what transformers' noaux_tc router adds to the chosen scores' sum before dividing by it
NOAUX_EPS = 1e-20
# llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*) -> the router
GATING = {1: "softmax", 2: "sigmoid"}
# where a file names no gating function, llama.cpp's deepseek2 loader takes GLM-4.7-Flash's
# (sigmoid) for a model of 47 or 48 blocks and this vocabulary, else softmax (its
# "GLM 4.7 Lite" test; the converter writes no key for it): read alike
GLM_FLASH_BLOCKS, GLM_FLASH_VOCAB = (47, 48), 154880
HF_NAMES = {
    **{f"mlp.shared_experts.{n}": f"mlp.shared_expert.{n}"
       for n in ("gate_proj", "up_proj", "down_proj")},
    "mlp.gate.e_score_correction_bias": "mlp.expert_bias",  # V3's and GLM's selection bias
}  # fmt: skip
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
    kind = str(cfg.get("model_type", V2)).lower()

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
        _check_rope(cfg, hf)
        experts = _hf_experts(hf, kind)
        ffns = _hf_ffns(cfg, hf, kind, layers)
        return {"layer_mixers": ("latent",) * layers, "latent": latent, "layer_ffns": ffns,
                "experts": experts if "experts" in ffns else None}  # fmt: skip

    config = hf_config(cfg, arch, name, part)
    # head_dim: the rotated part's, as transformers' config has it (the Hub's configs name
    # none: not hidden / heads); the heads' own sizes are the Latent's
    config = replace(config, head_dim=sizes["rope_dim"], num_kv_heads=config.num_heads)
    return _with_scale(config, sizes["qk_dim"])


def _check_rope(cfg: dict[str, Any], hf: Fields) -> None:
    """The rotated rows as `fold_hf` reads them: interleaved pairs (V3's and GLM's
    `rope_interleave`, true by default), every one of qk_rope_head_dim turned."""
    if not hf("rope_interleave", bool, True):
        raise UnsupportedModelError(f"{hf.where}: rope_interleave false: kvlm reads the "
                                    "rotated rows as interleaved pairs")  # fmt: skip
    factor = hf_rope(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = value(1.0 if factor is None else factor, "partial_rotary_factor", float, 0.0, 1.0,
                   hf.where, open_low=True)  # fmt: skip
    if factor != 1.0:
        raise UnsupportedModelError(f"{hf.where}: partial_rotary_factor {factor:g}: latent "
                                    "attention turns the whole qk_rope_head_dim")  # fmt: skip


def _hf_experts(hf: Fields, kind: str) -> Experts:
    """The routed experts as transformers' router of this model type runs them (the
    module docstring): V2's softmax ("greedy", or "group_limited_greedy" among the best
    groups by their best expert), V3's and GLM's sigmoid with its selection bias among
    the best groups by their two best."""
    count = hf("n_routed_experts", int, lo=EXPERTS[0], hi=EXPERTS[1])
    inter = hf("moe_intermediate_size", int, **limits("intermediate_size"))
    common = dict(
        count=count, top_k=hf("num_experts_per_tok", int, lo=1, hi=count), intermediate=inter,
        scale=hf("routed_scaling_factor", float, 1.0, lo=0.0),
        shared=hf("n_shared_experts", int, 0, lo=0, hi=1 << 10) * inter,
    )  # fmt: skip

    def groups() -> dict[str, int]:
        return {"groups": hf("n_group", int, None, lo=1, hi=count) or 1,
                "groups_used": hf("topk_group", int, None, lo=1, hi=count) or 1}  # fmt: skip

    if kind != V2:  # noaux_tc
        normalize = hf("norm_topk_prob", bool, True)
        return Experts(**common, **groups(), router="sigmoid", selection_bias=True,
                       normalize=normalize, norm_eps=NOAUX_EPS)  # fmt: skip
    method = hf("topk_method", str, "greedy")
    if method == "greedy":
        return Experts(**common, normalize=False, router="softmax")
    if method == "group_limited_greedy":
        return Experts(**common, **groups(), normalize=False, router="softmax",
                       group_score="max")  # fmt: skip
    raise UnsupportedModelError(f"{hf.where}: topk_method {method!r}: transformers' "
                                "deepseek_v2 routes by greedy or group_limited_greedy")  # fmt: skip


def _hf_ffns(cfg: dict[str, Any], hf: Fields, kind: str, layers: int) -> tuple[str, ...]:
    """Each layer's FFN, "mlp" (dense) or "experts" (the module docstring)."""
    types = cfg.get("mlp_layer_types")
    if kind == GLM and types is not None:
        ok = isinstance(types, list) and len(types) == layers
        if not ok or any(t not in ("dense", "sparse") for t in types):
            raise ModelLoadError(f"{hf.where}: mlp_layer_types is {shown(types)}; expected "
                                 f"{layers} of 'dense' or 'sparse'")  # fmt: skip
        return tuple("experts" if t == "sparse" else "mlp" for t in types)
    dense = hf("first_k_dense_replace", int, DENSE_FIRST.get(kind, 0), lo=0, hi=layers)
    every = hf("moe_layer_freq", int, 1, lo=1, hi=layers) if kind == V2 else 1
    return tuple("experts" if i >= dense and i % every == 0 else "mlp" for i in range(layers))


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    """llama.cpp's converter's keys: `attention.kv_lora_rank`, `.q_lora_rank` (absent: one
    q projection), `.key_length_mla` (nope + rope), `.value_length_mla`,
    `rope.dimension_count`; `head_count_kv` 1 and `key_length` kv_rank + rope (its MQA
    view of the latent); the experts after `leading_dense_block_count`, weighed by
    `expert_weights_scale`, renormalised where `expert_weights_norm`, beside
    `expert_shared_count` shared ones; YaRN's mscale_all_dim as 10 x
    `rope.scaling.yarn_log_multiplier` (llama.cpp keeps one mscale: cos/sin unscaled,
    as the DeepSeek-V2 configs' mscale = mscale_all_dim make them). The router
    (`_gguf_router`): `expert_gating_func`, `expert_group_count` and
    `expert_group_used_count`. A nextn block (GLM-4.7-Flash's multi-token prediction,
    `nextn_predict_layers`) is left unread: kvlm's MTP head has no latent block."""
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
                **_gguf_router(g, arch, count),
            )
        yarn = key("rope.scaling.yarn_log_multiplier", float, None, lo=0.0)
        if yarn is not None:
            sizes["mscale_all_dim"] = yarn / 0.1  # type: ignore[assignment]
        return {"layer_mixers": ("latent",) * layers, "latent": latent, "layer_ffns": ffns,
                "experts": experts}  # fmt: skip

    config = gguf_config(g, arch, name, part, partial_rope=True)
    config = replace(config, head_dim=sizes["rope_dim"], num_kv_heads=config.num_heads,
                     rope_dim=None, mtp_layers=0)  # fmt: skip
    s = config.rope_scaling
    m = sizes.get("mscale_all_dim")
    if s.rope_type == "yarn" and m:
        config = replace(config, rope_scaling=replace(s, mscale=m, mscale_all_dim=m))
    return _with_scale(config, sizes["qk_dim"])


def _gguf_router(g: Fields, arch: str, count: int) -> dict[str, Any]:
    """The router's Experts fields as llama.cpp's deepseek2 graph runs it: softmax (1) or
    sigmoid (2: with the selection bias `exp_probs_b`, DeepSeek-V3's and GLM's) by
    `expert_gating_func` (absent: GLM-4.7-Flash's sigmoid for its shape, else softmax, as
    llama.cpp's loader); group-limited among the `expert_group_used_count` best of
    `expert_group_count` groups, a group scored by its two best selection scores whatever
    the gating (llama.cpp's build_moe_ffn)."""
    gating = g(f"{arch}.expert_gating_func", int, None)
    if gating is None:
        blocks = g(f"{arch}.block_count", int)
        glm = blocks in GLM_FLASH_BLOCKS and gguf_vocab(g, arch) == GLM_FLASH_VOCAB
        gating = 2 if glm else 1
    if gating not in GATING:
        raise UnsupportedModelError(f"{g.where}: {arch}.expert_gating_func {gating}: kvlm "
                                    "reads the softmax (1) and sigmoid (2) routers")  # fmt: skip
    out: dict[str, Any] = {"router": GATING[gating]}
    if GATING[gating] == "sigmoid":  # transformers' epsilon, so a file reads as its folder
        # (llama.cpp clamps the sum at 2^-14 instead: neither moves a sum of sigmoids)
        out |= {"selection_bias": True, "norm_eps": NOAUX_EPS}
    groups = g(f"{arch}.expert_group_count", int, 0, lo=0, hi=count)
    if groups > 1:
        used = g(f"{arch}.expert_group_used_count", int, lo=1, hi=groups)
        out |= {"groups": groups, "groups_used": used, "group_score": "top2"}
    return out


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
    hf_model_types={V2: ARCH, V3: ARCH, GLM: ARCH},
    gguf_names=GGUF_NAMES,
    hf_names=HF_NAMES,
    fold_hf=fold_hf,
    gguf_rows=fold_hf,  # llama.cpp turns the same pairs (its NORM RoPE): the same rows
    # GLM's GGUF pre-tokenizers as llama.cpp reads them (its CHATGLM4 type): Llama 3's
    # split, no BOS token; "glm4"/"glm5" (GLM-4.7-Flash's) with ignore_merges
    pre_tokenizers={
        "glm4": "llama3-nobos",
        "glm5": "llama3-nobos",
        "chatglm-bpe": "llama3-nobos-merges",
    },
)
