"""The Qwen3.5 family: Qwen3.5's dense models (text; transformers' `Qwen3_5ForCausalLM`,
`qwen3_5_text`, and the language model of a `Qwen3_5ForConditionalGeneration` folder,
`qwen3_5`, whose `text_config` is read and whose weights under `model.language_model.`
are the text model's: kvlm.loading.hf), and its mixture-of-experts sizes (`qwen3_5_moe`,
`qwen3_5_moe_text`; llama.cpp's `qwen35moe`): the same block with experts for every
layer's FFN (kvlm.model.experts: softmax, the top k always renormalised) and a shared
expert beside them gated by sigmoid(`shared_expert_gate`).

Its block beside Llama's (kvlm.config): three of every four layers (`layer_types`
"linear_attention"; transformers' default `full_attention_interval` 4) mix positions by
a gated DeltaNet (`layer_mixers` "deltanet", kvlm.model.deltanet; its sizes the
`linear_*` keys: `ModelConfig.deltanet`), the others attend (GQA) with per-head q/k
norms, RoPE over the first `partial_rotary_factor` of each head's dimensions
(`rope_dim`), and the output times sigmoid(a gate) that q_proj computes beside the
queries (`attn_output_gate`); SwiGLU. Its RMSNorms multiply by 1 + w (Qwen3_5RMSNorm, in
fp32; zeros at init): the 1 is added here at load (`fold_hf`), but for the
DeltaNet's gated norm, which multiplies by w. q_proj's rows come per head, the head's
queries then its gate ([q_0, g_0, q_1, g_1, ...]); `fold_hf` puts all the queries first,
then the gates, which is what the model's attention reads.

The config's rope_parameters may carry `mrope_section` / `mrope_interleaved` (the vision
model's 3-D positions): for text alone the three position streams are one, so RoPE is
the plain one at each token's position. The tokenizer (byte-level BPE with its own split
regex, NFC) and the chat template come from the files. The multi-token-prediction head
(`mtp.*`, `mtp_num_hidden_layers` blocks: kvlm.model.mtp) is read where the folder
has it (a drafter); the vision tower is left unread.

GGUF files (llama.cpp's `qwen35`, as its convert_hf_to_gguf.py writes them: `from_gguf`,
`GGUF_NAMES`): the DeltaNet's sizes are `ssm.*` keys (group_count the q/k heads,
time_step_rank the v heads, state_size the q/k head dim, inner_size all v heads' dims,
conv_kernel), its layers `attention.recurrent_layers` (else every
`full_attention_interval`-th layer attends), the partial RoPE `rope.dimension_count`
(`rope.dimension_sections`, the vision model's, left unread as the config's are); the
blocks after the model's are the MTP head's (`nextn_predict_layers`, `blk.N.nextn.*`:
kvlm.arch.family's NEXTN_NAMES). The
converter keeps q_proj's per-head [q, gate] rows and folds the 1 into the norms as
`fold_hf` does; it stores A_log as -exp(A_log) (`ssm_a`, taken back by `fold_gguf`), the
convolution as (C, L), and where the q/k heads are fewer than the v heads, every tensor's
v heads in ggml's tiled order (v head j of every q/k head, then j + 1: [0, r, 2r, ..., 1,
r + 1, ...] for r v heads a q/k head) instead of grouped by their q/k head; `gguf_rows`
and `gguf_cols` (out_proj's columns) put them back.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlm.arch.family import LAYER_NAMES, Family, fold_a_log
from kvlm.arch.readers import (
    gguf_config,
    gguf_experts,
    hf_config,
    hf_expert_counts,
    hf_layer_mixers,
)
from kvlm.config import (
    LIMITS,
    REQUIRED,
    DeltaNet,
    Experts,
    Fields,
    ModelConfig,
    limits,
    shown,
    value,
)
from kvlm.errors import ModelLoadError, UnsupportedModelError

ARCHITECTURE = "qwen35"  # llama.cpp's general.architecture
MOE = "qwen35moe"  # the mixture-of-experts sizes' (Qwen3.5-35B-A3B, ...)
# HF's layer_types -> the model's mixers
LAYER_TYPES = {"linear_attention": "deltanet", "full_attention": "attention"}
# transformers' Qwen3_5TextConfig defaults, where a config.json leaves a key out
DEFAULTS = {"head_dim": 256, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32}  # fmt: skip
MAX_MTP_LAYERS = 8  # the most multi-token-prediction blocks a config may name
GATED_NORM = "linear_attn.norm.weight"  # the DeltaNet's gated norm: w, not 1 + w
# llama.cpp's names of a block's tensors -> the model's: attention's as every family's,
# but `post_attention_norm` is the MLP's input norm here (llama.cpp's ATTN_POST_NORM; no
# ffn_norm); the DeltaNet's (`ssm_a` and `ssm_dt.bias` named whole: family.py)
GGUF_NAMES = {k: v for k, v in LAYER_NAMES.items() if k != "ffn_norm"} | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",  # stored as -exp(A_log): fold_gguf
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# the DeltaNet tensors whose rows the converter puts in ggml's tiled v-head order, and
# how many rows a v head has there ("v": value_dim; 1: one; the q|k|v product and its
# kernel: their v rows alone, after q and k)
V_ROWS = {"in_proj_qkv.weight": "v", "conv1d.weight": "v", "in_proj_z.weight": "v",
          "in_proj_b.weight": 1, "in_proj_a.weight": 1, "A_log": 1, "dt_bias": 1}  # fmt: skip


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    if "head_dim" not in cfg:
        cfg = {**cfg, "head_dim": DEFAULTS["head_dim"]}

    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        act = hf("hidden_act", str, "silu")
        if act != "silu":  # the MLP's and the DeltaNet convolution's
            raise UnsupportedModelError(f"{hf.where}: hidden_act {act!r} (Qwen3.5 runs silu)")
        layers = hf("num_hidden_layers", int, **limits("num_layers"))
        head_dim = hf("head_dim", int, **limits("head_dim"))
        return {
            "qk_norm": True,
            "attn_output_gate": True,
            "layer_mixers": _hf_mixers(cfg, hf, layers),
            "deltanet": _hf_deltanet(hf),
            "rope_dim": _hf_rope_dim(cfg, hf, head_dim),
            # the checkpoints' `mtp.*` head (transformers leaves it unread)
            "mtp_layers": hf("mtp_num_hidden_layers", int, 0, lo=0, hi=MAX_MTP_LAYERS),
            **(_hf_experts(cfg, hf, layers) if arch == MOE else {}),
        }

    return hf_config(cfg, arch, name, part, rope_theta=DEFAULTS["rope_theta"])


def _hf_experts(cfg: dict[str, Any], hf: Fields, layers: int) -> dict[str, Any]:
    """The MoE sizes' FFN: experts in every layer (softmax, the top k renormalised, as
    transformers' Qwen3_5MoeTopKRouter always does), a shared expert beside them gated by
    sigmoid(shared_expert_gate)."""
    count, top_k = hf_expert_counts(cfg, hf)
    width = limits("intermediate_size")
    experts = Experts(count=count, top_k=top_k,
                      intermediate=hf("moe_intermediate_size", int, **width),
                      shared=hf("shared_expert_intermediate_size", int, **width),
                      shared_gate=True)  # fmt: skip
    return {"layer_ffns": ("experts",) * layers, "experts": experts}


def _gguf_experts(g: Fields, arch: str, layers: int) -> dict[str, Any]:
    """The same from llama.cpp's `qwen35moe` keys (its graph renormalises the top k)."""
    shared = g(f"{arch}.expert_shared_feed_forward_length", int, **limits("intermediate_size"))
    experts = gguf_experts(g, arch, shared=shared, shared_gate=True)
    return {"layer_ffns": ("experts",) * layers, "experts": experts}


def _hf_mixers(cfg: dict[str, Any], hf: Fields, layers: int) -> tuple[str, ...]:
    """Each layer's mixer from `layer_types`, else every `full_attention_interval`-th
    layer attends (transformers' rule)."""
    types = cfg.get("layer_types")
    if types is None:
        every = hf("full_attention_interval", int, DEFAULTS["full_attention_interval"], lo=1,
                   hi=LIMITS["num_layers"][1])  # fmt: skip
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(layers)]  # fmt: skip
    return hf_layer_mixers(types, LAYER_TYPES, hf, layers)


def _hf_deltanet(hf: Fields) -> DeltaNet:
    """The DeltaNet layers' sizes (the `linear_*` keys)."""
    heads, dims = limits("num_heads"), limits("head_dim")

    def key(k: str, bounds: dict[str, int]) -> int:
        return hf(f"linear_{k}", int, DEFAULTS[f"linear_{k}"], **bounds)

    d = DeltaNet(key_heads=key("num_key_heads", heads), value_heads=key("num_value_heads", heads),
                 key_dim=key("key_head_dim", dims), value_dim=key("value_head_dim", dims),
                 conv_kernel=key("conv_kernel_dim", {"lo": 2, "hi": 64}))  # fmt: skip
    if d.value_heads % d.key_heads:
        raise ModelLoadError(f"{hf.where}: linear_num_value_heads {d.value_heads} is not a "
                             f"multiple of linear_num_key_heads {d.key_heads}")  # fmt: skip
    return d


def _hf_rope_dim(cfg: dict[str, Any], hf: Fields, head_dim: int) -> int | None:
    """The dimensions RoPE rotates: head_dim times `partial_rotary_factor` (in
    rope_parameters, transformers 5's, else at the top level), as transformers rounds it
    (int()); None where that is the whole head."""
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params) if isinstance(params, dict) else {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None:
        factor = DEFAULTS["partial_rotary_factor"]
    factor = value(factor, "partial_rotary_factor", float, 0.0, 1.0, hf.where, open_low=True)
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise UnsupportedModelError(f"{hf.where}: partial_rotary_factor {factor} of head_dim "
                                    f"{head_dim} rotates {dim} dimensions; RoPE needs an even "
                                    "number, 2 or more")  # fmt: skip
    return None if dim == head_dim else dim


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        mixers = _gguf_mixers(g, arch, layers)
        return {
            "qk_norm": True,
            "attn_output_gate": True,
            "layer_mixers": mixers,
            "deltanet": _gguf_deltanet(g, arch) if "deltanet" in mixers else None,
            **(_gguf_experts(g, arch, layers) if arch == MOE else {}),
        }

    return gguf_config(g, arch, name, part, partial_rope=True)


def _gguf_mixers(g: Fields, arch: str, layers: int) -> tuple[str, ...]:
    """Each layer's mixer from `attention.recurrent_layers` (one bool a block, the MTP
    head's blocks after the model's), else every `full_attention_interval`-th layer
    attends (llama.cpp's rule, transformers')."""
    key = f"{arch}.attention.recurrent_layers"
    flags = g.data.get(key)
    if flags is None:
        every = g(f"{arch}.full_attention_interval", int, DEFAULTS["full_attention_interval"],
                  lo=1, hi=LIMITS["num_layers"][1])  # fmt: skip
        return tuple("attention" if (i + 1) % every == 0 else "deltanet" for i in range(layers))
    if not isinstance(flags, list) or not all(isinstance(f, bool) for f in flags):
        raise ModelLoadError(f"{g.where}: {key} is {shown(flags)}; expected a list of bools, "
                             "one a block")  # fmt: skip
    if len(flags) < layers:
        raise ModelLoadError(f"{g.where}: {key} names {len(flags)} blocks; the model has "
                             f"{layers} layers")  # fmt: skip
    if any(flags[layers:]):
        raise ModelLoadError(f"{g.where}: {key} marks block {flags.index(True, layers)} "
                             f"recurrent, past the model's {layers} layers (the MTP head's "
                             "blocks attend)")  # fmt: skip
    return tuple("deltanet" if f else "attention" for f in flags[:layers])


def _gguf_deltanet(g: Fields, arch: str) -> DeltaNet:
    """The DeltaNet layers' sizes from the `ssm.*` keys as the converter writes them."""
    heads, dims = limits("num_heads"), limits("head_dim")

    def key(k: str, bounds: dict[str, int]) -> int:
        return g(f"{arch}.ssm.{k}", int, REQUIRED, **bounds)

    key_heads, value_heads = key("group_count", heads), key("time_step_rank", heads)
    inner = key("inner_size", {"lo": 1, "hi": value_heads * dims["hi"]})
    if inner % value_heads:
        raise ModelLoadError(f"{g.where}: {arch}.ssm.inner_size {inner} is not a multiple of "
                             f"{arch}.ssm.time_step_rank {value_heads} (the v heads)")  # fmt: skip
    if value_heads % key_heads:
        raise ModelLoadError(f"{g.where}: {arch}.ssm.time_step_rank {value_heads} is not a "
                             f"multiple of {arch}.ssm.group_count {key_heads}")  # fmt: skip
    return DeltaNet(key_heads=key_heads, value_heads=value_heads,
                    key_dim=key("state_size", dims),
                    value_dim=value(inner // value_heads, f"{arch}.ssm.inner_size / "
                                    f"{arch}.ssm.time_step_rank", int, *LIMITS["head_dim"],
                                    g.where),
                    conv_kernel=key("conv_kernel", {"lo": 2, "hi": 64}))  # fmt: skip


def gguf_rows(config: ModelConfig, name: str, rows: torch.Tensor) -> torch.Tensor:
    """A GGUF tensor's rows in Hugging Face's order: q_proj's as `fold_hf` puts them
    (all queries, then the gates); the DeltaNet's v heads grouped by their q/k head."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return fold_hf(config, name, rows)
    per_head = _v_rows(config, name)
    if per_head is None:
        return rows
    d = config.deltanet
    first = 2 * d.key_heads * d.key_dim if name.endswith(("qkv.weight", "conv1d.weight")) else 0
    v = _grouped(rows[first:], d.key_heads, d.value_heads // d.key_heads, per_head)
    return torch.cat([rows[:first], v]) if first else v


def gguf_cols(config: ModelConfig, name: str, cols: torch.Tensor) -> torch.Tensor:
    """out_proj's columns (its input, the v heads) grouped by their q/k head."""
    d = config.deltanet
    if (
        d is None
        or d.key_heads == d.value_heads
        or not name.endswith("linear_attn.out_proj.weight")
    ):
        return cols
    return _grouped(cols, d.key_heads, d.value_heads // d.key_heads, d.value_dim)


def _v_rows(config: ModelConfig, name: str) -> int | None:
    """The rows a v head has in a DeltaNet tensor the converter reorders (None: not one)."""
    d = config.deltanet
    if d is None or d.key_heads == d.value_heads or ".linear_attn." not in name:
        return None
    rows = V_ROWS.get(name.rpartition(".linear_attn.")[2])
    return d.value_dim if rows == "v" else rows


def _grouped(t: torch.Tensor, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """ggml's tiled v heads ([per_key][key_heads] of `width` along dim 0) grouped by their
    q/k head ([key_heads][per_key]), the converter's _reorder_v_heads undone."""
    tiled = t.reshape(per_key, key_heads, width, *t.shape[1:])
    return tiled.transpose(0, 1).reshape(t.shape)


def fold_gguf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`ssm_a` (-exp(A_log), as the converter stores it) back to A_log: the fp32 value
    whose exp, as the model takes it (fp32), is -ssm_a where one is (log(-ssm_a), or the
    fp32 value next to it), so that exp(A_log) at run time is the value the file holds."""
    if not name.endswith("linear_attn.A_log"):
        return tensor
    return fold_a_log(config, name, tensor, "ssm_a")


def _is_norm(name: str) -> bool:
    """Whether `name` is an RMSNorm's weight: `*norm.weight`, and the MTP head's input
    norms (`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`: the converter's
    `nextn.enorm` / `hnorm`, which it folds as norms)."""
    return name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_")


def fold_hf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A norm's weight as the block multiplies by it: 1 + w, added in fp32 (as
    transformers adds it), but the DeltaNet's gated norm's (w as it is); q_proj's rows
    (and bias) as the queries of every head, then the gates."""
    if _is_norm(name) and not name.endswith(GATED_NORM):
        return 1.0 + tensor.float()
    if config.attn_output_gate and name.endswith(("q_proj.weight", "q_proj.bias")):
        d = config.head_dim
        per_head = tensor.reshape(config.num_heads, 2, d, *tensor.shape[1:])
        return per_head.transpose(0, 1).reshape(tensor.shape)
    return tensor


HF_MODEL_TYPES = {"qwen3_5_text": ARCHITECTURE, "qwen3_5": ARCHITECTURE,
                  "qwen3_5_moe_text": MOE, "qwen3_5_moe": MOE}  # fmt: skip

FAMILY = Family(
    name="qwen35",
    architectures=(ARCHITECTURE, MOE),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types=HF_MODEL_TYPES,
    gguf_names=GGUF_NAMES,
    fold_hf=fold_hf,
    gguf_rows=gguf_rows,
    gguf_cols=gguf_cols,
    fold_gguf=fold_gguf,
)
