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

    def fingerprint(self) -> str:
        """A short hash that tells this model's weights from another's (cache files)."""
        ...


def fingerprint_of(config: object, *chunks: bytes) -> str:
    """sha256 of the config and a few raw weight bytes: cheap, and independent of the dtype
    the model is later run in."""
    import hashlib
    import json
    from dataclasses import asdict

    h = hashlib.sha256(json.dumps(asdict(config), sort_keys=True, default=str).encode())
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()[:16]
