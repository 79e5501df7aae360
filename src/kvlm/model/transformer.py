"""One Llama-family transformer (Llama, Mistral, Qwen2, Qwen3, SmolLM2).

The same `forward` serves prefill, decode and chunked prefill: what differs is how many
tokens are fed, at which positions, and which cache step they attend through.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from tqdm import tqdm

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError
from kvlm.loading.weights import WeightSource
from kvlm.model.attention import Attention, KVStep
from kvlm.model.blas import one_torch_thread
from kvlm.model.layers import MLP, Linear, RMSNorm, RotaryEmbedding


class Block(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.input_norm = input_norm
        self.post_norm = post_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVStep
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, kv)
        return x + self.mlp(self.post_norm(x))


class Transformer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        weights: WeightSource,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        loader = _WeightTaker(weights, config, dtype, self.device, progress)
        with loader:
            self.layers = nn.ModuleList(loader.block(i) for i in range(config.num_layers))
            self.norm = RMSNorm(loader.take("model.norm.weight"), config.rms_norm_eps)
            embed = loader.take("model.embed_tokens.weight")
            if config.tie_word_embeddings or not loader.has("lm_head.weight"):
                self.lm_head = Linear(embed)
                # Tied: read embeddings out of lm_head's weight unless it is packed.
                self._embed_table = None if self.lm_head.rows() is not None else embed
            else:
                self.lm_head = Linear(loader.take("lm_head.weight"))
                self._embed_table = embed
            freq_factors = loader.take_raw("rope_freqs.weight")
        self.rope = RotaryEmbedding(config, self.device, freq_factors)

    def step_context(self, rows: int) -> AbstractContextManager:
        """Thread arrangement for a forward of `rows` token rows (see kvlm.model.blas)."""
        if rows == 1 and self.lm_head.uses_blas:
            return one_torch_thread()
        return nullcontext()

    def quantize_weights(self, fmt: str) -> None:
        """Swap the projections' weights to another storage format (gpt-fast's module
        swap: the model code stays plain). "int8": see Linear.quantize_int8. The embedding
        table stays in the model's dtype (one row is read per token)."""
        if fmt != "int8":
            raise ValueError(f"unknown weight format {fmt!r}")
        if self._embed_table is None:  # tied: keep the rows before lm_head is quantized
            self._embed_table = self.lm_head.rows().contiguous()
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8()

    def pack_for_batches(self) -> None:
        """Switch fp32 CPU weights to oneDNN's packed layout (kvlm.model.layers.Linear):
        what a server wants, many rows per step. Single-stream decode is faster on the
        default OpenBLAS layout."""
        if self._embed_table is None:  # tied: keep the rows before lm_head is repacked
            self._embed_table = self.lm_head.rows().contiguous()
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_onednn()

    @property
    def embed_table(self) -> torch.Tensor:
        """(V, H); a strided view of lm_head's weight when the embeddings are tied."""
        table = self._embed_table
        return self.lm_head.rows() if table is None else table

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVStep,
        last_only: bool = True,
    ) -> torch.Tensor:
        """input_ids, positions: (B, T) -> fp32 logits (B, 1 or T, V).

        `last_only` skips the vocabulary projection for all but the last position: a
        512-token prefill would otherwise build a 512 x 49152 logits matrix to use one row.
        """
        x = self.embed_table[input_ids]  # (B, T, H)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()


class _WeightTaker:
    """Pulls named tensors from a WeightSource, converting each at once (one in flight)."""

    def __init__(
        self,
        weights: WeightSource,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        progress: bool,
    ) -> None:
        self.weights = weights
        self.config = config
        self.dtype = dtype
        self.device = device
        self.available = set(weights.names())
        self.bar = tqdm(
            total=len(self.available),
            desc="loading weights",
            unit="tensor",
            disable=not progress,
            file=sys.stderr,
            leave=False,
        )

    def __enter__(self) -> _WeightTaker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def has(self, name: str) -> bool:
        return name in self.available

    def take_raw(self, name: str) -> torch.Tensor | None:
        if name not in self.available:
            return None
        self.bar.update(1)
        return self.weights.get(name)

    def take(self, name: str) -> torch.Tensor:
        tensor = self.take_raw(name)
        if tensor is None:
            raise ModelLoadError(f"the model file has no tensor {name}")
        return tensor.to(device=self.device, dtype=self.dtype)

    def fused_linear(self, prefix: str, parts: tuple[str, ...]) -> Linear:
        """Concatenate projections that read the same input (q|k|v, gate|up) into one."""
        ws = [self.take(f"{prefix}.{p}.weight") for p in parts]
        biases = [self.take_raw(f"{prefix}.{p}.bias") for p in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    torch.zeros(w.shape[0]) if b is None else b.float()
                    for w, b in zip(ws, biases, strict=True)
                ]
            ).to(device=self.device, dtype=self.dtype)
        return Linear(torch.cat(ws, dim=0), bias)

    def block(self, i: int) -> Block:
        c = self.config
        p = f"model.layers.{i}"
        eps = c.rms_norm_eps
        q_norm = k_norm = None
        if c.qk_norm:
            q_norm = RMSNorm(self.take(f"{p}.self_attn.q_norm.weight"), eps)
            k_norm = RMSNorm(self.take(f"{p}.self_attn.k_norm.weight"), eps)
        o_bias = self.take_raw(f"{p}.self_attn.o_proj.bias")
        attn = Attention(
            i,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            qkv=self.fused_linear(f"{p}.self_attn", ("q_proj", "k_proj", "v_proj")),
            o_proj=Linear(
                self.take(f"{p}.self_attn.o_proj.weight"),
                None if o_bias is None else o_bias.to(self.device, self.dtype),
            ),
            q_norm=q_norm,
            k_norm=k_norm,
        )
        mlp = MLP(
            self.fused_linear(f"{p}.mlp", ("gate_proj", "up_proj")),
            Linear(self.take(f"{p}.mlp.down_proj.weight")),
        )
        return Block(
            attn,
            mlp,
            RMSNorm(self.take(f"{p}.input_layernorm.weight"), eps),
            RMSNorm(self.take(f"{p}.post_attention_layernorm.weight"), eps),
        )
