"""The Gemma family: Gemma 2 and Gemma 3 (text; Gemma 3's multimodal checkpoints run
their language model).

Its block beside Llama's (kvlm.config): norms before and after attention and the MLP
(`sandwich`), GeGLU with tanh's GELU, embeddings times sqrt(hidden), the score scale of
`query_pre_attn_scalar`, local layers with a sliding window between global ones (every
second layer global in Gemma 2, every sixth in Gemma 3, or as `layer_types` says), Gemma
3's per-head q/k norms and its local layers' own RoPE base, Gemma 2's soft-capped scores
and logits. Its RMSNorms multiply by 1 + w: Hugging Face stores w, and the 1 is added
here at load (`fold_hf`), where llama.cpp's converter adds it to the GGUF file's norms.
Hugging Face names the attention's output norm `post_attention_layernorm` and the MLP's
input norm `pre_feedforward_layernorm`; llama.cpp's names are its roles' as in every
family. Its GGUF SentencePiece vocabulary reads as transformers reads Gemma's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlm.arch.family import LAYER_NAMES, OUT_NORM_NAMES, Family, Shape, Tokenizing
from kvlm.arch.readers import gguf_config, hf_config, hf_window
from kvlm.config import Fields, ModelConfig, limits, shown, value
from kvlm.errors import ModelLoadError, UnsupportedModelError

ARCHITECTURES = ("gemma2", "gemma3")
# As llama.cpp reads Gemma's GGUF files, which do not store these: every second (Gemma 2)
# or sixth (Gemma 3) layer attends to the whole context, the others to a window; Gemma
# 3's local layers' RoPE base.
PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_THETA = 10000.0
# Gemma 2 27B and Gemma 3 27B (by layer count): scores scaled by (hidden / heads) ** -0.5,
# not head_dim ** -0.5 (llama.cpp's rule for GGUF files)
LAYERS_27B = {"gemma2": 46, "gemma3": 62}
GEMMA2_SOFTCAPS = {"final": 30.0, "attn": 50.0}
# Hugging Face's names of the norms whose roles the model names otherwise
HF_NAMES = {
    "post_attention_layernorm": "attn_out_norm",  # the attention's output norm
    "pre_feedforward_layernorm": "post_attention_layernorm",  # the MLP's input norm
    "post_feedforward_layernorm": "mlp_out_norm",
}


def _block(arch: str, hidden: int) -> dict[str, Any]:
    """The block's composition (kvlm.config.ModelConfig's fields)."""
    return {"activation": "gelu_tanh", "norm_layout": "sandwich", "embed_scale": hidden**0.5,
            "qk_norm": arch == "gemma3"}  # fmt: skip


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        # the window is the local layers'
        return _block(arch, hidden) | _hf_fields(cfg, hf_window(hf), arch, hf)

    theta = 1e6 if arch == "gemma3" else 1e4
    return hf_config(cfg, arch, name, part, rope_theta=theta, tied=True)


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    def part(g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        return _block(arch, hidden) | _gguf_fields(g, arch, layers, hidden, heads, head_dim)

    return gguf_config(g, arch, name, part)


def _hf_fields(cfg: dict[str, Any], window: int | None, arch: str, hf: Fields) -> dict[str, Any]:
    """The layer pattern, Gemma 3's two RoPE bases (transformers 5's `rope_parameters` per
    layer type, or the Hub's `rope_theta`, `rope_local_base_freq` and `rope_scaling`), the
    score scale and the soft-caps of a Hugging Face text config."""
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
    pattern = hf("sliding_window_pattern", int, PATTERN[arch], lo=1)
    layers = hf("num_hidden_layers", int)
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(map(_is_str, types))):
        raise ModelLoadError(f"{hf.where}: layer_types is {shown(types)}; expected a list of "
                             "layer type names")  # fmt: skip
    extra = _layer_windows(layers, window or 4096, pattern, types)
    if arch == "gemma3":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        theta = local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
        extra["rope_local_theta"] = value(theta, "rope_local_base_freq", float, 0.0,
                                          where=hf.where, open_low=True)  # fmt: skip
    extra["query_scale"] = _query_scale(hf("query_pre_attn_scalar", float, 256.0, lo=0.0))
    for field_name, k in (("final_softcap", "final"), ("attn_softcap", "attn")):
        # absent: transformers' defaults (Gemma 2: 30 and 50; Gemma 3: none)
        default = GEMMA2_SOFTCAPS[k] if arch == "gemma2" else None
        extra[field_name] = hf(f"{k}_logit_softcapping", float, default, lo=0.0)
    return extra


def _gguf_fields(
    g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """The layer pattern, the score scale, the local layers' RoPE base and the soft-caps
    of GGUF metadata."""
    window = g(f"{arch}.attention.sliding_window", int, **limits("sliding_window"))
    # the file's own pattern where it has one: every n-th layer global, or a flag per layer
    # (True: windowed); else llama.cpp's fixed one
    pattern = g.data.get(f"{arch}.attention.sliding_window_pattern", PATTERN[arch])
    types = None
    if isinstance(pattern, list):
        flags = [value(f, "a sliding_window_pattern entry", bool, where=g.where) for f in pattern]
        types = ["sliding_attention" if f else "full_attention" for f in flags]
        pattern = PATTERN[arch]
    pattern = value(pattern, f"{arch}.attention.sliding_window_pattern", int, 1, where=g.where)
    extra = _layer_windows(layers, window, pattern, types)
    scalar = hidden // heads if layers == LAYERS_27B[arch] else head_dim
    extra["query_scale"] = _query_scale(scalar)
    if arch == "gemma3":
        extra["rope_local_theta"] = GEMMA3_LOCAL_THETA
    for field_name, k in (("final_softcap", "final"), ("attn_softcap", "attn")):
        extra[field_name] = g(f"{arch}.{k}_logit_softcapping", float, None, lo=0.0)
    return extra


def _layer_windows(
    layers: int, window: int, pattern: int, types: list[str] | None
) -> dict[str, Any]:
    """`layer_windows` from HF's `layer_types` (else every `pattern`-th layer global)."""
    if window < 1 or pattern < 1:
        raise UnsupportedModelError(f"a sliding window of {window} every {pattern} layers")
    if types is None:
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModelError(f"unsupported layer types {sorted(unknown)}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return {"layer_windows": windows}


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _query_scale(scalar: float) -> float:
    """Attention's score scale from query_pre_attn_scalar: scalar ** -0.5."""
    if not 0 < scalar < math.inf:
        raise UnsupportedModelError(f"query_pre_attn_scalar {scalar!r} must be positive")
    return scalar**-0.5


def fold_hf(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A norm's weight as the block multiplies by it: 1 + w, added in fp32 (as
    transformers adds it; llama.cpp's converter stores the sum)."""
    return 1.0 + tensor.float() if name.endswith("norm.weight") else tensor


# The configurations of the models named (their config.json on the Hub).
SHAPES = {
    "gemma-3-270m": Shape("gemma3", 640, 18, 4, 1, 256, 2048, 262144, True, 1e6, 32768, window=512),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 256, 6912, 262144, True, 1e6, 32768, window=512),
}

FAMILY = Family(
    name="gemma",
    architectures=ARCHITECTURES,
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={"gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3"},
    gguf_names=LAYER_NAMES | OUT_NORM_NAMES,
    hf_names=HF_NAMES,
    fold_hf=fold_hf,
    # a run of spaces is a token spelled in spaces, looked up as "▁"s; the merge order is
    # the vocabulary's, not the stored scores' (Gemma 1's files too)
    tokenizing=Tokenizing(spaces_as_pieces=True, merges_in_vocab_order=True),
    vocabularies=("gemma", *ARCHITECTURES),
    shapes=SHAPES,
)
