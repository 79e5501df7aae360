"""The Qwen3.5 family: Qwen3.5's dense models (text; transformers' `Qwen3_5ForCausalLM`,
`qwen3_5_text`, and the language model of a `Qwen3_5ForConditionalGeneration` folder,
`qwen3_5`, whose `text_config` is read and whose weights under `model.language_model.`
are the text model's: kvlm.loading.hf).

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
(`mtp.*`) and the vision tower are left unread. GGUF files (llama.cpp's `qwen35`) are not
read yet (docs/NOTES-qwen35.md).
"""

from __future__ import annotations

from typing import Any

import torch

from kvlm.arch.family import Family
from kvlm.arch.readers import hf_config, hf_layer_mixers
from kvlm.config import LIMITS, DeltaNet, Fields, ModelConfig, limits, value
from kvlm.errors import ModelLoadError, UnsupportedModelError

ARCHITECTURE = "qwen35"  # llama.cpp's general.architecture
# HF's layer_types -> the model's mixers
LAYER_TYPES = {"linear_attention": "deltanet", "full_attention": "attention"}
# transformers' Qwen3_5TextConfig defaults, where a config.json leaves a key out
DEFAULTS = {"head_dim": 256, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32}  # fmt: skip
GATED_NORM = "linear_attn.norm.weight"  # the DeltaNet's gated norm: w, not 1 + w


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
        }

    return hf_config(cfg, arch, name, part, rope_theta=DEFAULTS["rope_theta"])


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
    raise UnsupportedModelError(f"{g.where}: kvlm does not read Qwen3.5 ({arch}) GGUF files "
                                "yet; its Hugging Face folder runs (--kv off)")  # fmt: skip


def fold_hf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A norm's weight as the block multiplies by it: 1 + w, added in fp32 (as
    transformers adds it), but the DeltaNet's gated norm's (w as it is); q_proj's rows
    (and bias) as the queries of every head, then the gates."""
    if name.endswith("norm.weight") and not name.endswith(GATED_NORM):
        return 1.0 + tensor.float()
    if config.attn_output_gate and name.endswith(("q_proj.weight", "q_proj.bias")):
        d = config.head_dim
        per_head = tensor.reshape(config.num_heads, 2, d, *tensor.shape[1:])
        return per_head.transpose(0, 1).reshape(tensor.shape)
    return tensor


FAMILY = Family(
    name="qwen35",
    architectures=(ARCHITECTURE,),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"qwen3_5_text": ARCHITECTURE, "qwen3_5": ARCHITECTURE},
    fold_hf=fold_hf,
)
