"""The Llama family: Llama (and SmolLM2), Mistral, Qwen2 (and Qwen2.5), Qwen3.

The block every other family is told against (kvlm.config's defaults): an RMSNorm before
attention and one before the MLP, SwiGLU, embeddings as they are. Qwen2's q|k|v products
have biases (read where a file has them), Qwen3 norms each q and k head before RoPE,
Mistral's layers all attend in one sliding window. llama.cpp's converter permutes the
rows of Llama's q/k projections so that its interleaved RoPE sees Hugging Face's
rotate-half pairs; `gguf_rows` undoes it (of whole rows: of a row's blocks alike) so one
RoPE serves both formats.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlm.arch.family import Family, Shape, unpermute_qk
from kvlm.arch.readers import gguf_config, hf_config, hf_window
from kvlm.config import Fields, ModelConfig


def from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    def part(cfg: dict[str, Any], hf: Fields, arch: str, hidden: int, heads: int) -> dict:
        window = None  # Qwen2's is read only where it is used (configs name one they do not)
        if arch != "qwen2" or cfg.get("use_sliding_window", False):
            window = hf_window(hf)
        return {"qk_norm": arch == "qwen3", "sliding_window": window or None}

    return hf_config(cfg, arch, name, part)


def from_gguf(g: Fields, arch: str, name: str) -> ModelConfig:
    return gguf_config(g, arch, name, lambda *_: {"qk_norm": arch == "qwen3"})


def gguf_rows(config: ModelConfig, name: str, rows: torch.Tensor) -> torch.Tensor:
    """A Llama file's q/k rows back in Hugging Face's order (other tensors as they are)."""
    if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_heads if "q_proj" in name else config.num_kv_heads
        return unpermute_qk(rows, heads)
    return rows


# The configurations of the models named (their config.json on the Hub).
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 64, 4864, 151936, True, 1e6, 32768,
                          qkv_bias=True),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True, 1e6, 32768,
                          qkv_bias=True),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6, 40960),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, 1e6, 40960),
    "llama-3.2-1b": Shape(
        "llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 5e5, 131072, 1e-5, llama3_rope=True
    ),
    "smollm2-135m": Shape("llama", 576, 30, 9, 3, 64, 1536, 49152, True, 1e5, 8192, 1e-5),
    "smollm2-360m": Shape("llama", 960, 32, 15, 5, 64, 2560, 49152, True, 1e5, 8192, 1e-5),
    "smollm2-1.7b": Shape("llama", 2048, 24, 32, 32, 64, 8192, 49152, True, 1.3e5, 8192, 1e-5),
}  # fmt: skip

FAMILY = Family(
    name="llama",
    architectures=("llama", "mistral", "qwen2", "qwen3"),
    from_hf=from_hf,
    from_gguf=from_gguf,
    hf_model_types={a: a for a in ("llama", "mistral", "qwen2", "qwen3")},
    gguf_rows=gguf_rows,
    shapes=SHAPES,
)
