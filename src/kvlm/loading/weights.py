"""The interface loaders hand to the model: named float tensors in Hugging Face layout."""

from __future__ import annotations

from typing import Protocol

import torch


class WeightSource(Protocol):
    """Tensors by Hugging Face name (`model.layers.0.self_attn.q_proj.weight`), [out, in].

    `get` may dequantize or read from disk on each call; the model builder calls it once
    per tensor and converts to its own dtype straight away, so the peak memory is the
    built model plus one tensor in flight.
    """

    def names(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...
