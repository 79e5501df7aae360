"""What the model asks of the weights a loader hands it (kvlm.loading: a GGUF file, a
folder of safetensors): named tensors in Hugging Face layout, and, for a file of low-bit
blocks, those blocks as stored. Declared here, below the loaders, and asked of every
source alike (no probing for methods).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvlm.config import ModelConfig
    from kvlm.model.quant import Blocks, QuantWeight


class WeightSource(Protocol):
    """Tensors by the model's name, [out, in]: the Llama block's Hugging Face names
    (`model.layers.0.self_attn.q_proj.weight`; `post_attention_layernorm` the MLP's input
    norm) and a sandwich block's `attn_out_norm`, `mlp_out_norm` (`out_norms`), rows in
    Hugging Face's order and values as the model multiplies them: a family's quirks
    (kvlm.arch) already folded in.

    `get` may dequantize or read from disk on each call; the model builder calls it once
    per tensor and converts to its own dtype straight away, so the peak memory is the
    built model plus one tensor in flight.
    """

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, [out, in] for a projection, without reading it."""
        ...

    def get(self, name: str) -> torch.Tensor: ...

    def fingerprint(self) -> str:
        """A short hash that tells this model's weights from another's (cache files)."""
        ...

    def files(self) -> list[Path]:
        """The files the tensors are read from (the packed weights' arena is sized by them)."""
        ...

    def is_quantized(self, name: str) -> bool:
        """Whether the file stores `name` in low-bit blocks."""
        ...

    def stored_as(self, name: str) -> tuple[str, str]:
        """(the tensor's name in the file, its stored type's name), for warnings."""
        ...

    def get_quant(self, name: str, packed: bool = True) -> QuantWeight | Blocks | None:
        """The file's own low-bit blocks for `name` (kvlm.model.quant), None where kvlm
        has no kernel for its type or it is not low-bit."""
        ...

    def release(self) -> object:
        """The model holds its own copies now: the source may give its pages back."""
        ...


# the model's names of the norms of a mixture of experts beside a layer's dense MLP
# (Experts.beside_mlp; kvlm.model.transformer.ExpertsBeside): the experts' input norm, the
# dense MLP's output norm, the experts' output norm
BESIDE_NORMS = ("experts_in_norm", "dense_out_norm", "experts_out_norm")


def out_norms(config: ModelConfig) -> list[str]:
    """The model's names of a block's output norms (the attention's, the MLP's): those of
    a "sandwich" block (ModelConfig.norm_layout), none for another."""
    return ["attn_out_norm", "mlp_out_norm"] if config.norm_layout == "sandwich" else []


def fingerprint_of(config: object, *chunks: bytes) -> str:
    """sha256 of the config and a few raw weight bytes: cheap, and independent of the dtype
    the model is later run in. The config's fields at their defaults are left out, so a
    field a later kvlm adds (a new family's, a RoPE variant's) leaves the fingerprints of
    the models it does not concern as they were: their cache files and tier records stay
    readable across the upgrade."""
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(_set_fields(config), sort_keys=True, default=str).encode())
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()[:16]


def _set_fields(value: object) -> object:
    """A dataclass as a dict of its fields that differ from their defaults (nested ones
    alike), but those marked `metadata={"fingerprint": False}` (what the hashed fields
    determine: a ModelConfig's block composition, set by its family from the architecture
    and the sizes); anything else as it is."""
    import dataclasses

    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    out = {}
    for f in dataclasses.fields(value):
        if f.metadata.get("fingerprint", True) is False:
            continue
        v = getattr(value, f.name)
        if f.default is not dataclasses.MISSING and v == f.default:
            continue
        if f.default_factory is not dataclasses.MISSING and v == f.default_factory():
            continue
        out[f.name] = _set_fields(v)
    return out
