"""GGUF files (llama.cpp's format): metadata, tokenizer and dequantized tensors.

The header is read by kvlm's own reader (kvlm.loading.gguf_file: gguf-py's results, in
milliseconds rather than seconds for a 128k-token vocabulary, every fault a ModelLoadError).
Tensors are dequantized with the `gguf` package, one at a time, into Hugging Face names
and layout; `--weights native` takes the blocks of the types kvlm has kernels for as they
are instead (`get_quant`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K). llama.cpp's
converter permutes the rows of Llama's q/k projections so that its interleaved RoPE sees
HF's rotate-half pairs; we undo that permutation (of whole rows: of a row's blocks alike)
so one RoPE serves both formats.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.loading.gguf_file import GGUFFile, GGUFTensor
from kvlm.loading.shapes import check_shapes
from kvlm.model.quant import GGML_KINDS, Blocks, QuantWeight
from kvlm.model.weights import fingerprint_of

try:
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError as exc:  # pragma: no cover - gguf is a declared dependency
    raise ImportError("kvlm needs the `gguf` package: pip install gguf") from exc

GGUF_MAGIC = b"GGUF"
# Types kvlm loads. Float types keep their dtype; quantized types go through gguf.quants.
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.int16}
QUANT_TYPES = {
    Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
}  # fmt: skip
SUPPORTED_TYPES = set(FLOAT_TYPES) | QUANT_TYPES

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's block norms its attention's and its MLP's outputs too; its `ffn_norm` is the
# MLP's input norm, as Llama's is, but HF names that one `pre_feedforward_layernorm`.
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# The model's recommended sampling, as llama.cpp's converter writes it (from the model's
# generation_config.json) and llama-server takes it for a request's unset fields: GGUF
# key -> kvlm's field
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
}


def is_gguf_file(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def hf_name(gguf_name: str, gemma: bool = False) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None if unknown;
    `gemma`: a Gemma file's names, ModelConfig.gemma)."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    names = _GEMMA_NAMES if gemma else _LAYER_NAMES
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    return None


def gguf_name(name: str, gemma: bool = False) -> str:
    """The inverse of `hf_name`: `model.layers.3.self_attn.q_proj.weight` ->
    `blk.3.attn_q.weight` (the name itself where it has no GGUF name)."""
    stem, _, suffix = name.rpartition(".")
    for ours, theirs in _GLOBAL_NAMES.items():
        if stem == theirs:
            return f"{ours}.{suffix}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for ours, theirs in (_GEMMA_NAMES if gemma else _LAYER_NAMES).items():
            if parts[3] == theirs:
                return f"blk.{parts[2]}.{ours}.{suffix}"
    return name


class GGUFWeights:
    """A `WeightSource` over one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not is_gguf_file(path):
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
        # kvlm's reader: every fault of the file is a ModelLoadError saying what and where
        # (UnsupportedModelError for a tensor type, version or byte order it cannot read)
        self.file = GGUFFile(path)
        self.metadata: dict[str, Any] = self.file.metadata
        tied = "output.weight" not in {t.name for t in self.file.tensors}
        cfg = ModelConfig.from_gguf(self.metadata, name=path.name)
        self.config = replace(cfg, tie_word_embeddings=tied)
        # field -> (where the file says it, its value as written: checked by its user)
        self.sampling: dict[str, tuple[str, Any]] = {
            name: (key, self.metadata[key])
            for key, name in SAMPLING_KEYS.items() if key in self.metadata
        }  # fmt: skip
        self._tensors: dict[str, GGUFTensor] = {}
        for t in self.file.tensors:
            name = hf_name(t.name, cfg.gemma)
            if name is None:
                continue
            if t.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{path.name}: tensor {t.name} has type {t.tensor_type.name}, which kvlm does "
                    f"not load (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            self._tensors[name] = t
        self.quant_types = sorted({t.tensor_type.name for t in self._tensors.values()})
        check_shapes(self, self.config, path.name, lambda n: gguf_name(n, cfg.gemma))

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))  # ne0 last

    def files(self) -> list[Path]:
        return [self.path]

    def release(self) -> bool:
        """Give the mapped file's pages back once the model holds its own copies (they
        were read once while packing). The map stays valid: a later read of a tensor
        (the fingerprint, a tool) faults its pages in again from the file. False where
        the OS has no MADV_DONTNEED."""
        return self.file.release()

    def fingerprint(self) -> str:
        """Config + the raw bytes of the final norm and the first 4 KiB of the embedding."""
        raw = [self._tensors[n] for n in ("model.norm.weight", "model.embed_tokens.weight")]
        config = replace(self.config, name="")  # the file name is not the model
        # the first 4 KiB of each, not the whole table copied to bytes first
        heads = (np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)[:4096] for t in raw)
        return fingerprint_of(config, *(h.tobytes() for h in heads))

    def get(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        shape = self.shape(name)
        try:
            if t.tensor_type in FLOAT_TYPES:
                # np.array copies out of the read-only mmap; BF16 travels as int16 bits.
                out = torch.from_numpy(np.array(t.data).view(FLOAT_TYPES[t.tensor_type]))
                if t.tensor_type == Q.BF16:
                    out = out.view(torch.bfloat16)
            else:
                out = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            out = out.reshape(shape)
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{self.path.name}: cannot decode tensor {t.name}: {exc}") from exc
        if self.config.gemma and name.endswith("norm.weight"):
            out = out.float() - 1.0  # llama.cpp stores Gemma's norms as 1 + w; HF as w
        return self._unpermute(name, out)

    def is_quantized(self, name: str) -> bool:
        return self._tensors[name].tensor_type in QUANT_TYPES

    def stored_as(self, name: str) -> tuple[str, str]:
        """(the tensor's name in the file, its GGML type's name): `blk.3.ffn_down.weight`,
        `Q3_K`."""
        t = self._tensors[name]
        return t.name, t.tensor_type.name

    def get_quant(self, name: str, packed: bool = True) -> QuantWeight | Blocks | None:
        """The tensor's own blocks, unrounded, for the types kvlm multiplies as stored
        (NATIVE_BLOCKS); None for other types. Packed for the kernels, read where they lie
        in the file's map; `packed=False`: not yet (quant.Blocks, a view of the map), for
        the caller to pack with others into one buffer (quant.concat)."""
        t = self._tensors[name]
        kind = NATIVE_BLOCKS.get(t.tensor_type)
        if kind is None or len(t.shape) != 2:
            return None
        rows = int(t.shape[1])
        try:
            # the blocks as stored, rows of K / 32 (or / 256) blocks: a view, not a copy
            flat = np.asarray(t.data).reshape(-1)
            if flat.dtype != np.uint8 or flat.size % rows:
                raise ValueError(f"{flat.size} bytes of {flat.dtype} are not {rows} rows of blocks")
            blocks = Blocks(kind, flat.reshape(rows, -1))
            # whole rows of blocks: q/k rows un-permuted as they are packed
            order = self._unpermute(name, torch.arange(rows))
            if not torch.equal(order, torch.arange(rows)):
                blocks.order = order
            return blocks.pack() if packed else blocks
        except ValueError as exc:
            raise ModelLoadError(f"{self.path.name}: cannot decode tensor {t.name}: {exc}") from exc

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        is_qk = name.endswith(("q_proj.weight", "k_proj.weight"))
        if self.config.architecture == "llama" and is_qk:
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            rows = unpermute_qk(rows, heads)
        return rows


# GGUF blocks kvlm multiplies as they are (`--weights native`), each packed from its
# blocks as stored (QuantWeight.from_blocks) into a kind: Q8_0 and Q4_1 into q8 and q4 (the
# kinds that `--weights int8|int4` quantize to), the others (quant.GGML_KINDS) into their
# own. Q2_K, Q3_K and the IQ types have no kernel: dequantized, and with --weights native
# re-quantized to int8 (kvlm.model.transformer names them at load).
NATIVE_BLOCKS = {Q.Q8_0: "q8", Q.Q4_1: "q4", **{Q[kind.upper()]: kind for kind in GGML_KINDS}}


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Within each head, HF orders rows [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] (rotate-half
    pairs x_i, y_i); llama.cpp stores them interleaved [x_0, y_0, x_1, y_1, ...].
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    # (heads, half, 2, ...) interleaved  ->  (heads, 2, half, ...) rotate-half
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
