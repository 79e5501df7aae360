"""The Granite 4.0-H family: IBM's hybrids of Mamba2 layers and attention (transformers'
`GraniteMoeHybridForCausalLM`, `granitemoehybrid`; llama.cpp's `granitehybrid`), their
dense sizes (350M, 1B, 3B: `num_local_experts` 0) and its mixture-of-experts sizes (Tiny
7B-A1B, Small: experts in every layer, their shared MLP a shared expert without a gate).

Its block beside Llama's (kvlm.config): most layers (`layer_types` "mamba", transformers'
"linear_attention") mix positions by a Mamba2 layer (`layer_mixers` "mamba2",
kvlm.model.mamba2; its sizes the `mamba_*` keys: `ModelConfig.mamba2`), the others attend
(GQA) without any position encoding (`position_embedding_type` None: NoPE, `rope`
False; "rope" where a config says so), scores scaled by `attention_multiplier`
(`query_scale`); the MLP is `shared_mlp` (SwiGLU of `shared_intermediate_size`, its gate
and up one tensor, `input_linear`: the model's `mlp.gate_up_proj`); the embeddings times
`embedding_multiplier` (`embed_scale`), each mixer's and MLP's output times
`residual_multiplier` before it joins the residual stream (`residual_scale`), the logits
divided by `logits_scaling` (`logit_scale`). The tokenizer (byte-level BPE) and the chat
template come from the files.

GGUF files (llama.cpp's `granitehybrid`, as its convert_hf_to_gguf.py writes them): the
Mamba2 sizes are `ssm.*` keys (time_step_rank the heads, inner_size every head's
channels, state_size, group_count, conv_kernel), the layers' kinds
`attention.head_count_kv` (0 a Mamba2 layer), RoPE `rope.scaling.finetuned` (false:
NoPE), the multipliers `embedding_scale`, `residual_scale`, `logit_scale` and
`attention.scale`, the MLP's width `expert_shared_feed_forward_length` (its
`feed_forward_length` the experts'). The converter splits `input_linear` into ffn_gate
and ffn_up, keeps
A_log as -exp(A_log) (`ssm_a`, (heads, 1): `fold_gguf` takes it back), D as (heads, 1),
the norm's weight as (groups, inner / groups), the convolution as (C, L), and permutes
the attention's q/k rows as it does Llama's (`gguf_rows` undoes it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlm.arch.family import LAYER_NAMES, Family, fold_a_log, unpermute_qk
from kvlm.arch.readers import gguf_config, gguf_kv_pattern, hf_config, hf_layer_mixers
from kvlm.config import (
    CONV_KERNEL,
    EXPERTS,
    LIMITS,
    REQUIRED,
    Experts,
    Fields,
    Mamba2,
    ModelConfig,
    limits,
    value,
)
from kvlm.errors import ModelLoadError, UnsupportedModelError

ARCHITECTURE = "granitehybrid"  # llama.cpp's general.architecture
# HF's layer_types (transformers 5's names and the Hub configs' own) -> the model's mixers
LAYER_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention",
               "full_attention": "attention"}  # fmt: skip
# transformers' GraniteMoeHybridConfig defaults, where a config.json leaves a key out
DEFAULTS = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
            "mamba_d_conv": 4, "mamba_expand": 2}  # fmt: skip
KERNEL = {"lo": CONV_KERNEL[0], "hi": CONV_KERNEL[1]}  # the convolution's positions
# a checkpoint's names -> the model's: the MLP's (gate|up one tensor)
HF_NAMES = {"shared_mlp.input_linear": "mlp.gate_up_proj",
            "shared_mlp.output_linear": "mlp.down_proj",
            # the MoE sizes' experts: every expert's gate|up stacked (E, 2 I, H), down
            # (E, H, I), the router; the shared MLP above is their shared expert
            "block_sparse_moe.input_linear": "mlp.experts.gate_up_proj",
            "block_sparse_moe.output_linear": "mlp.experts.down_proj",
            "block_sparse_moe.router.layer": "mlp.gate"}  # fmt: skip
# llama.cpp's names of the Mamba2 layers' tensors -> the model's (`ssm_a`, `ssm_d` and
# `ssm_dt.bias` named whole: family.py)
GGUF_NAMES = LAYER_NAMES | {
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_a": "mamba.A_log",  # stored as -exp(A_log): fold_gguf
    "ssm_d": "mamba.D",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    hf = Fields(cfg, f"{name}: config.json" if name else "config.json")
    count = hf("num_local_experts", int, 8, lo=0, hi=EXPERTS[1])  # transformers' default
    # the MLP is the shared one: its width is the model's intermediate size; the MoE
    # sizes' experts are of intermediate_size (softmax over the top k's logits: the
    # renormalised softmax), the shared MLP their shared expert (no gate)
    shared = hf("shared_intermediate_size", int, 1024, **limits("intermediate_size"))
    moe = {}
    if count:
        width = hf("intermediate_size", int, **limits("intermediate_size"))
        top_k = hf("num_experts_per_tok", int, lo=1, hi=count)
        moe = {"experts": Experts(count=count, top_k=top_k, intermediate=width, shared=shared)}
    cfg = {**cfg, "intermediate_size": shared}

    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        act = hf("hidden_act", str, "silu")
        if act != "silu":  # the MLP's and the convolution's
            raise UnsupportedModelError(f"{hf.where}: hidden_act {act!r} (Granite runs silu)")
        limit = cfg.get("time_step_limit")
        if limit is not None and (not isinstance(limit, list | tuple) or len(limit) != 2
                                  or limit[0] != 0 or not _infinite(limit[1])):  # fmt: skip
            raise UnsupportedModelError(f"{hf.where}: time_step_limit {limit!r}: kvlm takes "
                                        "the default (0, inf) alone")  # fmt: skip
        position = cfg.get("position_embedding_type")
        if position not in (None, "rope"):
            raise UnsupportedModelError(f"{hf.where}: position_embedding_type {position!r} "
                                        "(None or 'rope')")  # fmt: skip
        layers = hf("num_hidden_layers", int, **limits("num_layers"))
        types = cfg.get("layer_types")
        mixers = hf_layer_mixers(["mamba"] * layers if types is None else types,
                                 LAYER_TYPES, hf, layers)  # fmt: skip
        return {
            "layer_mixers": mixers,
            "mamba2": _hf_mamba2(hf, hidden) if "mamba2" in mixers else None,
            "rope": position == "rope",
            **_hf_multipliers(hf),
            **({"layer_ffns": ("experts",) * layers, **moe} if moe else {}),
        }

    return hf_config(cfg, arch, name, part)


def _infinite(x: Any) -> bool:
    """+inf as a config.json holds it: `Infinity` (Python's json) or transformers 5's
    {"__float__": "Infinity"}."""
    return x == math.inf or x == {"__float__": "Infinity"}


def _multipliers(key) -> dict[str, float | None]:
    """The four multipliers (None where absent, and but the attention's where 1: no
    product at all), each positive; `key(name)` reads one by its config.json name. A GGUF
    file without `attention.scale` scales scores by head_dim ** -0.5, as llama.cpp does."""
    out = {}
    for name, field in (("embedding_multiplier", "embed_scale"),
                        ("attention_multiplier", "query_scale"),
                        ("residual_multiplier", "residual_scale"),
                        ("logits_scaling", "logit_scale")):  # fmt: skip
        x = key(name)
        out[field] = None if x is None or (x == 1.0 and field != "query_scale") else x
    return out


def _hf_multipliers(hf: Fields) -> dict[str, float | None]:
    """The multipliers of a config.json: transformers' default 1.0 where one is absent,
    the attention's too (its scores are then not scaled at all)."""
    out = _multipliers(lambda k: hf(k, float, None, lo=0.0))
    if out["query_scale"] is None:
        out["query_scale"] = 1.0
    return out


def _hf_mamba2(hf: Fields, hidden: int) -> Mamba2:
    """The Mamba2 layers' sizes (the `mamba_*` keys): head_dim "auto" is
    mamba_expand x hidden_size / mamba_n_heads, as transformers derives it."""
    heads, dims = limits("num_heads"), limits("head_dim")

    def key(k: str, bounds: dict[str, int]) -> int:
        return hf(k, int, DEFAULTS[k], **bounds)

    n = key("mamba_n_heads", heads)
    inner = key("mamba_expand", {"lo": 1, "hi": 64}) * hidden
    head_dim = hf.data.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = inner // n
    head_dim = value(head_dim, "mamba_d_head", int, *LIMITS["head_dim"], hf.where)
    if head_dim * n != inner:
        raise ModelLoadError(f"{hf.where}: mamba_d_head {head_dim} x mamba_n_heads {n} is not "
                             f"mamba_expand x hidden_size ({inner})")  # fmt: skip
    m = Mamba2(heads=n, head_dim=head_dim, state_size=key("mamba_d_state", dims),
               groups=key("mamba_n_groups", heads),
               conv_kernel=key("mamba_d_conv", KERNEL))  # fmt: skip
    if m.heads % m.groups:
        raise ModelLoadError(f"{hf.where}: mamba_n_heads {m.heads} is not a multiple of "
                             f"mamba_n_groups {m.groups}")  # fmt: skip
    return m


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    g, mixers = gguf_kv_pattern(g, arch, "mamba2")
    count = g(f"{arch}.expert_count", int, 0, lo=0, hi=EXPERTS[1])
    # the dense MLP is the shared one: its width, where the file names it, is the model's
    shared = g(f"{arch}.expert_shared_feed_forward_length", int, None,
               **limits("intermediate_size"))  # fmt: skip
    moe = {}
    if count:  # the MoE sizes: experts of feed_forward_length (as llama.cpp's converter
        # writes a Granite's: expert_feed_forward_length where a file names one), the
        # shared expert of expert_shared_feed_forward_length
        width = limits("intermediate_size")
        ff = g(f"{arch}.feed_forward_length", int, **width)
        moe = {"experts": Experts(
            count=count, top_k=g(f"{arch}.expert_used_count", int, lo=1, hi=count),
            intermediate=g(f"{arch}.expert_feed_forward_length", int, ff, **width),
            shared=g(f"{arch}.expert_shared_feed_forward_length", int, **width))}  # fmt: skip
    if shared is not None:
        g = Fields({**g.data, f"{arch}.feed_forward_length": shared}, g.where)

    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        layer_mixers = mixers or ("attention",) * layers
        if len(layer_mixers) != layers:
            raise ModelLoadError(f"{g.where}: {arch}.attention.head_count_kv names "
                                 f"{len(layer_mixers)} layers; {arch}.block_count is "
                                 f"{layers}")  # fmt: skip
        scales = {"embedding_multiplier": "embedding_scale", "attention_multiplier":
                  "attention.scale", "residual_multiplier": "residual_scale",
                  "logits_scaling": "logit_scale"}  # fmt: skip
        return {
            "layer_mixers": layer_mixers,
            "mamba2": _gguf_mamba2(g, arch) if "mamba2" in layer_mixers else None,
            "rope": g(f"{arch}.rope.scaling.finetuned", bool, True),
            **_multipliers(lambda k: g(f"{arch}.{scales[k]}", float, None, lo=0.0)),
            **({"layer_ffns": ("experts",) * layers, **moe} if moe else {}),
        }

    return gguf_config(g, arch, name, part)


def _gguf_mamba2(g: Fields, arch: str) -> Mamba2:
    """The Mamba2 layers' sizes from the `ssm.*` keys as the converter writes them."""
    heads, dims = limits("num_heads"), limits("head_dim")

    def key(k: str, bounds: dict[str, int]) -> int:
        return g(f"{arch}.ssm.{k}", int, REQUIRED, **bounds)

    n = key("time_step_rank", heads)
    inner = key("inner_size", {"lo": 1, "hi": n * dims["hi"]})
    if inner % n:
        raise ModelLoadError(f"{g.where}: {arch}.ssm.inner_size {inner} is not a multiple of "
                             f"{arch}.ssm.time_step_rank {n} (the heads)")  # fmt: skip
    head_dim = value(inner // n, f"{arch}.ssm.inner_size / {arch}.ssm.time_step_rank", int,
                     *LIMITS["head_dim"], g.where)  # fmt: skip
    m = Mamba2(heads=n, head_dim=head_dim,
               state_size=key("state_size", dims), groups=key("group_count", heads),
               conv_kernel=key("conv_kernel", KERNEL))  # fmt: skip
    if m.heads % m.groups:
        raise ModelLoadError(f"{g.where}: {arch}.ssm.time_step_rank {m.heads} is not a "
                             f"multiple of {arch}.ssm.group_count {m.groups}")  # fmt: skip
    return m


def gguf_rows(config: ModelConfig, name: str, rows: torch.Tensor) -> torch.Tensor:
    """The attention's q/k rows back in Hugging Face's order (the converter permutes them
    as Llama's)."""
    if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        heads = config.num_heads if "q_proj" in name else config.num_kv_heads
        return unpermute_qk(rows, heads)
    return rows


def fold_gguf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`ssm_a` (-exp(A_log), as the converter stores it) back to an A_log of the same exp."""
    if name.endswith("mamba.A_log"):
        return fold_a_log(config, name, tensor, "ssm_a")
    return tensor


FAMILY = Family(
    name="granite",
    architectures=(ARCHITECTURE,),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"granitemoehybrid": ARCHITECTURE},
    gguf_names=GGUF_NAMES,
    hf_names=HF_NAMES,
    gguf_rows=gguf_rows,
    fold_gguf=fold_gguf,
)
