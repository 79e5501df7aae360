"""The Gemma 4 family, text (`gemma4_text`; a `gemma4` multimodal checkpoint's language
model, its `text_config`).

Its block beside Gemma 3's (arch/gemma.py): the same sandwich of norms, GeGLU with tanh's
GELU and embeddings times sqrt(hidden), but RMSNorms that multiply by w itself (no 1 + w:
nothing folded), scores not scaled at all (query_scale 1: the q/k norms carry it), V
RMSNormed without a weight (`v_norm`), and, as transformers' modeling_gemma4 computes them:

- local layers (a sliding window) and global ones with their own head size and KV heads
  (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`: 512 on the
  globals by default), each with its RoPE: the locals' plain, the globals' "proportional"
  (the first partial_rotary_factor of a head's frequency pairs turn, the rest do not);
- K = V on the global layers (`attention_k_eq_v`: k_proj alone, V its output before the
  k norm);
- the last `num_kv_shared_layers` layers reading the K/V of the last earlier layer of their
  type (`kv_sources`: they keep none);
- per-layer inputs (`hidden_size_per_layer_input`): a table of per-layer embeddings and a
  projection of the embeddings, added to each layer's output through its own gate;
- each layer's output times its `layer_scalar`; the final logits soft-capped;
- `use_double_wide_mlp`: the layers that read an earlier layer's K/V have an MLP twice
  as wide (`layer_intermediate_sizes`);
- `enable_moe_block` (the 26B-A4B's layers): a mixture of experts beside every layer's
  dense MLP (kvlm.model.experts, `Experts.beside_mlp`): the router reads the residual
  stream through an RMSNorm of its own (`router.scale` times hidden ** -0.5, folded here:
  `router_norm`), a softmax over `num_experts`, the top `top_k_experts` renormalised,
  each times its expert's `per_expert_scale` (`expert_scale`); the experts (GeGLU of
  `moe_intermediate_size`, gate|up one stack) read `pre_feedforward_layernorm_2` of the
  stream; the MLP's output through `post_feedforward_layernorm_1`, the experts' through
  `post_feedforward_layernorm_2`, their sum through `post_feedforward_layernorm`.

Not yet: bidirectional attention, and GGUF files (refused by name: no GGUF reader for
`gemma4` yet).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvlm.arch.family import LAYER_NAMES, OUT_NORM_NAMES, Family, Tokenizing
from kvlm.arch.readers import hf_config, hf_window
from kvlm.config import EXPERTS, Experts, Fields, ModelConfig, limits, shown
from kvlm.errors import ModelLoadError, UnsupportedModelError

ARCHITECTURES = ("gemma4",)
# transformers' defaults where a config omits them (Gemma4TextConfig)
PATTERN = 6  # every sixth layer global
GLOBAL_HEAD_DIM = 512
PER_LAYER_INPUT = 256
PER_LAYER_VOCAB = 262_144
ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}  # fmt: skip
TYPES = ("sliding_attention", "full_attention")
# Hugging Face's names of the norms whose roles the model names otherwise (Gemma 3's)
HF_NAMES = {
    "post_attention_layernorm": "attn_out_norm",  # the attention's output norm
    "pre_feedforward_layernorm": "post_attention_layernorm",  # the MLP's input norm
    "post_feedforward_layernorm": "mlp_out_norm",
    # the experts beside the MLP (enable_moe_block): the router, its input norm's scale
    # and its experts' scales, the experts' stacks (those four named whole: no `.weight`),
    # and the norms around the experts and on the MLP's own output
    "router.proj": "mlp.gate",
    "router.scale": "mlp.router_norm.weight",
    "router.per_expert_scale": "mlp.expert_scale",
    "experts.gate_up_proj": "mlp.experts.gate_up_proj.weight",
    "experts.down_proj": "mlp.experts.down_proj.weight",
    "pre_feedforward_layernorm_2": "experts_in_norm",
    "post_feedforward_layernorm_1": "dense_out_norm",
    "post_feedforward_layernorm_2": "experts_out_norm",
}


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    cfg = dict(cfg)
    given = cfg.get("rope_parameters")
    if given is None:
        cfg["rope_parameters"] = ROPE_DEFAULTS
    elif not isinstance(given, dict) or not all(isinstance(given.get(t, {}), dict) for t in TYPES):
        raise ModelLoadError(f"{name or 'config.json'}: rope_parameters is {shown(given)}; "
                             "expected a dict per layer type")  # fmt: skip
    extra: dict[str, Any] = {}

    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        extra.update(_hf_fields(cfg, hf, heads))
        return {"activation": "gelu_tanh", "norm_layout": "sandwich",
                "embed_scale": hidden**0.5, **{k: v for k, v in extra.items()
                                                if k != "proportion"}}  # fmt: skip

    config = hf_config(cfg, arch, name, part, rope_theta=1e6, tied=True)
    s = config.rope_scaling
    if s.rope_type == "proportional":
        config = replace(config, rope_scaling=replace(s, proportion=extra["proportion"]))
    elif s.rope_type != "default":
        raise UnsupportedModelError(f"the global layers' RoPE type {s.rope_type!r} (supported: "
                                    "default, proportional)")  # fmt: skip
    return config


def _hf_fields(cfg: dict[str, Any], hf: Fields, heads: int) -> dict[str, Any]:
    """The layer pattern and each layer's window, head size, KV heads, K = V and K/V
    source; the local layers' RoPE base and the globals' proportion; the per-layer inputs;
    the soft-cap; the experts beside the MLP. What kvlm does not run yet is refused here,
    in one line."""
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention is not supported")
    act = hf("hidden_activation", str, "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{hf.where}: hidden_activation {act!r} is not supported")
    layers = hf("num_hidden_layers", int, lo=1)
    types = cfg.get("layer_types")
    if types is None:
        types = ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(TYPES):
        raise ModelLoadError(f"{hf.where}: layer_types is {shown(types)}; expected "
                             f"{layers} of {', '.join(TYPES)}")  # fmt: skip
    types = [*types[:-1], "full_attention"]  # as transformers forces the last layer's
    window = hf_window(hf) or 512
    head_dim = hf("head_dim", int, 256, lo=2)
    kv_heads = hf("num_key_value_heads", int, heads, lo=1)
    k_eq_v = hf("attention_k_eq_v", bool, False)
    dims, kvs = _global_geometry(cfg, hf, types, head_dim, kv_heads, k_eq_v)
    rope = cfg["rope_parameters"]
    local = Fields(rope.get("sliding_attention") or {}, f"{hf.where} rope_parameters")
    if local("rope_type", str, "default") != "default":
        raise UnsupportedModelError(f"{hf.where}: the local layers' RoPE type "
                                    f"{local.data['rope_type']!r} is not supported")  # fmt: skip
    full = Fields(rope.get("full_attention") or {}, f"{hf.where} rope_parameters")
    per_layer = hf("hidden_size_per_layer_input", int, PER_LAYER_INPUT, lo=0, hi=1 << 14)
    sources = _kv_sources(types, hf("num_kv_shared_layers", int, 0, hi=layers - 1))
    # the layers that read an earlier layer's K/V: an MLP twice as wide (use_double_wide_mlp)
    wide = ()
    if hf("use_double_wide_mlp", bool, False):
        inter = hf("intermediate_size", int, lo=1)
        wide = tuple(inter * (2 if j != i else 1) for i, j in enumerate(sources))
    return {
        **_moe_fields(hf, layers),
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "rope_local_theta": local("rope_theta", float, 10_000.0, lo=0.0),
        "proportion": full("partial_rotary_factor", float, 1.0, lo=0.0, hi=1.0),
        "qk_norm": True,
        "v_norm": True,
        "query_scale": 1.0,
        "final_softcap": hf("final_logit_softcapping", float, None, lo=0.0),
        "layer_head_dims": dims,
        "layer_kv_heads": kvs,
        "layer_k_eq_v": tuple(k_eq_v and t == "full_attention" for t in types),
        "kv_sources": sources,
        "layer_intermediate_sizes": wide,
        "per_layer_input": per_layer,
        "per_layer_vocab": hf("vocab_size_per_layer_input", int, PER_LAYER_VOCAB, lo=1)
        if per_layer
        else 0,
        "layer_scalars": True,
    }


def _moe_fields(hf: Fields, layers: int) -> dict[str, Any]:
    """`enable_moe_block`: every layer's experts (beside its MLP), as transformers'
    Gemma4TextRouter routes them; else none."""
    if not hf("enable_moe_block", bool, False):
        return {}
    count = hf("num_experts", int, lo=EXPERTS[0], hi=EXPERTS[1])
    experts = Experts(count=count, top_k=hf("top_k_experts", int, lo=1, hi=count),
                      intermediate=hf("moe_intermediate_size", int,
                                      **limits("intermediate_size")),
                      normalize=True, router_norm=True, expert_scale=True,
                      beside_mlp=True)  # fmt: skip
    return {"layer_ffns": ("experts",) * layers, "experts": experts}


def fold_hf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The router's input scale times hidden ** -0.5 (transformers multiplies the normed
    rows by both), in fp64: the router's norm's weight, one rounding to its dtype."""
    if name.endswith(".mlp.router_norm.weight"):
        return tensor.to(torch.float64) * config.hidden_size**-0.5
    return tensor


def _global_geometry(
    cfg: dict[str, Any], hf: Fields, types: list[str], head_dim: int, kv_heads: int,
    k_eq_v: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """Each layer's head size and KV heads: `per_layer_config` (a layer's index -> its
    overrides, as transformers saves them), else transformers' rule: the global layers'
    head size `global_head_dim` (512), their KV heads `num_global_key_value_heads` where
    K = V."""
    dims, kvs = [head_dim] * len(types), [kv_heads] * len(types)
    given = cfg.get("per_layer_config")
    if given is None:
        dim = hf("global_head_dim", int, GLOBAL_HEAD_DIM, lo=2)
        heads = hf("num_global_key_value_heads", int, None, lo=1) if k_eq_v else None
        given = {str(i): {"head_dim": dim, **({"num_key_value_heads": heads} if heads else {})}
                 for i, t in enumerate(types) if t == "full_attention"}  # fmt: skip
    if not isinstance(given, dict):
        raise ModelLoadError(f"{hf.where}: per_layer_config is {shown(given)}; expected a dict")
    for key, over in given.items():
        if not (str(key).isdigit() and int(key) < len(types) and isinstance(over, dict)):
            raise ModelLoadError(f"{hf.where}: per_layer_config entry {shown(key)}: "
                                 f"{shown(over)} is not a layer's overrides")  # fmt: skip
        f = Fields(over, f"{hf.where} per_layer_config[{key}]")
        unknown = set(over) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UnsupportedModelError(f"{f.where}: per-layer {sorted(unknown)} not supported")
        dims[int(key)] = f("head_dim", int, head_dim, lo=2, hi=1 << 12)
        kvs[int(key)] = f("num_key_value_heads", int, kv_heads, lo=1, hi=1 << 12)
    return tuple(dims), tuple(kvs)


def _kv_sources(types: list[str], shared: int) -> tuple[int, ...]:
    """Each layer's K/V source: the last `shared` layers read the last layer before them
    of their own type (transformers' kv_sharing_modes); the others their own."""
    first = len(types) - shared
    sources = list(range(len(types)))
    for i in range(first, len(types)):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise UnsupportedModelError(f"layer {i} shares the K/V of a {types[i]} layer "
                                        "before it, and there is none")  # fmt: skip
        sources[i] = earlier[-1]
    return tuple(sources)


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    raise UnsupportedModelError(f"{name or 'a GGUF file'}: Gemma 4 GGUF files are not supported "
                                "yet (its Hugging Face folders are)")  # fmt: skip


FAMILY = Family(
    name="gemma4",
    architectures=ARCHITECTURES,
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"gemma4": "gemma4", "gemma4_text": "gemma4"},
    gguf_names=LAYER_NAMES | OUT_NORM_NAMES,
    hf_names=HF_NAMES,
    fold_hf=fold_hf,
    # as Gemma's SentencePiece vocabularies read (arch/gemma.py)
    tokenizing=Tokenizing(spaces_as_pieces=True, merges_in_vocab_order=True),
    vocabularies=ARCHITECTURES,
)
