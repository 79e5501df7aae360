"""GGUF files (llama.cpp's format): metadata, tokenizer and dequantized tensors.

The header is read by kvlm's own reader (kvlm.loading.gguf_file: gguf-py's results, in
milliseconds rather than seconds for a 128k-token vocabulary, every fault a ModelLoadError).
Its metadata becomes a ModelConfig through the family of its `general.architecture`
(kvlm.arch), and its tensors get the model's names from that family's table
(`Family.from_gguf_name`); blocks past the model's layers (a multi-token-prediction
head's, `{arch}.nextn_predict_layers`: kvlm.arch.readers) are the head's, `mtp.*`
(kvlm.model.mtp). Tensors are
dequantized with the `gguf` package, one at a time, rows and columns in Hugging Face's
order (`Family.gguf_rows`: Llama's q/k, which llama.cpp's converter permutes for its
interleaved RoPE; `Family.gguf_cols`); `--weights native` takes the blocks of the types
kvlm has kernels for as they are instead (`get_quant`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K, MXFP4), whole rows of blocks put in that order as they are packed, and the blocks of
each row in theirs where a column order moves whole blocks (else the tensor is decoded).
Values are the file's: a quirk llama.cpp's converter folded into the weights (1 + w
norms) stays folded; a vector whose values it changed otherwise the family takes back
(`Family.fold_gguf`: an A_log stored as -exp(A_log)).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlm import kernels
from kvlm.arch import config_from_gguf, family
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.loading.gguf_file import GGUFFile, GGUFTensor
from kvlm.loading.shapes import check_shapes
from kvlm.model.quant import GGML_KINDS, Blocks, QuantWeight, outside_arena
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
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4,
}  # fmt: skip
SUPPORTED_TYPES = set(FLOAT_TYPES) | QUANT_TYPES

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


def is_gguf_file(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


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
        cfg = config_from_gguf(self.metadata, name=path.name)
        self.config = replace(cfg, tie_word_embeddings=tied)
        self.family = family(cfg.architecture)
        # field -> (where the file says it, its value as written: checked by its user)
        self.sampling: dict[str, tuple[str, Any]] = {
            name: (key, self.metadata[key])
            for key, name in SAMPLING_KEYS.items() if key in self.metadata
        }  # fmt: skip
        self._tensors: dict[str, GGUFTensor] = {}
        for t in self.file.tensors:
            name = self.family.from_gguf_name(t.name, cfg.num_layers)
            if name is None:
                continue
            if t.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{path.name}: tensor {t.name} has type {t.tensor_type.name}, which kvlm does "
                    f"not load (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            self._tensors[name] = t
        self.quant_types = sorted({t.tensor_type.name for t in self._tensors.values()})
        check_shapes(self, self.config, path.name, self.family.to_gguf_name)

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
                out = _dequantized(t, shape)
            out = out.reshape(shape)
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{self.path.name}: cannot decode tensor {t.name}: {exc}") from exc
        out = self._in_order(name, out)
        cols = self._columns(name, shape[-1])
        if cols is not None:
            out = out[..., cols].contiguous()
        fold = self.family.fold_gguf
        return out if fold is None else fold(self.config, name, out)

    def is_quantized(self, name: str) -> bool:
        return self._tensors[name].tensor_type in QUANT_TYPES

    def stored_bytes(self, name: str) -> int:
        """The tensor's bytes in the file (a low-bit one's blocks as --weights native
        keeps them)."""
        return self._tensors[name].n_bytes

    def stored_as(self, name: str) -> tuple[str, str]:
        """(the tensor's name in the file, its GGML type's name): `blk.3.ffn_down.weight`,
        `Q3_K`."""
        t = self._tensors[name]
        return t.name, t.tensor_type.name

    def get_quant(self, name: str, packed: bool = True) -> QuantWeight | Blocks | None:
        """The tensor's own blocks, unrounded, for the types kvlm multiplies as stored
        (NATIVE_BLOCKS); None for other types. A stack of matrices (a mixture of experts'
        (E, rows, K)) reads as one of E x rows rows. Packed for the kernels, read where they lie
        in the file's map; `packed=False`: not yet (quant.Blocks, a view of the map), for
        the caller to pack with others into one buffer (quant.concat)."""
        t = self._tensors[name]
        kind = NATIVE_BLOCKS.get(t.tensor_type)
        if kind is None or len(t.shape) not in (2, 3):
            return None
        # rows of every matrix of a stack (experts: (E, rows, K) -> E x rows rows)
        rows = int(np.prod([int(n) for n in t.shape[1:]]))
        try:
            # the blocks as stored, rows of K / 32 (or / 256) blocks: a view, not a copy
            flat = np.asarray(t.data).reshape(-1)
            if flat.dtype != np.uint8 or flat.size % rows:
                raise ValueError(f"{flat.size} bytes of {flat.dtype} are not {rows} rows of blocks")
            flat = flat.reshape(rows, -1)
            cols = self._columns(name, int(t.shape[0]))
            if cols is not None:  # whole blocks of each row in their order, or decoded
                flat = _blocks_in_order(flat, cols, t.tensor_type)
                if flat is None:
                    return None
            blocks = Blocks(kind, flat)
            # whole rows of blocks: q/k rows un-permuted as they are packed
            order = self._in_order(name, torch.arange(rows))
            if not torch.equal(order, torch.arange(rows)):
                blocks.order = order
            return blocks.pack() if packed else blocks
        except ValueError as exc:
            raise ModelLoadError(f"{self.path.name}: cannot decode tensor {t.name}: {exc}") from exc

    def _in_order(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (a tensor's, or their indices) in Hugging Face's order (Family.gguf_rows)."""
        order = self.family.gguf_rows
        return rows if order is None else order(self.config, name, rows)

    def _columns(self, name: str, n: int) -> torch.Tensor | None:
        """The order a tensor's `n` columns are taken in (Family.gguf_cols; None: as stored)."""
        order = self.family.gguf_cols
        if order is None:
            return None
        cols = order(self.config, name, torch.arange(n))
        return None if torch.equal(cols, torch.arange(n)) else cols


def _blocks_in_order(rows: np.ndarray, cols: torch.Tensor, kind: Any) -> np.ndarray | None:
    """Each row's blocks (`rows`: (R, bytes a row)) in the order that takes the columns in
    `cols` order, where it moves whole blocks (a copy); None where it does not."""
    width, size = gguf.GGML_QUANT_SIZES[kind]
    runs = cols.reshape(-1, width)
    first = runs[:, :1]
    if not (torch.equal(runs, first + torch.arange(width)) and not (first % width).any()):
        return None
    blocks = rows.reshape(rows.shape[0], -1, size)
    return np.ascontiguousarray(blocks[:, (first[:, 0] // width).numpy()]).reshape(
        rows.shape[0], -1
    )


# GGUF blocks kvlm multiplies as they are (`--weights native`), each packed from its
# blocks as stored (QuantWeight.from_blocks) into a kind: Q8_0 and Q4_1 into q8 and q4 (the
# kinds that `--weights int8|int4` quantize to), the others (quant.GGML_KINDS) into their
# own (MXFP4, E2M1 values with an 8-bit exponent a 32, into "mxfp4"). Q2_K, Q3_K and the
# IQ types have no kernel: dequantized, and with --weights native re-quantized to int8
# (kvlm.model.transformer names them at load).
NATIVE_BLOCKS = {Q.Q8_0: "q8", Q.Q4_1: "q4", **{Q[kind.upper()]: kind for kind in GGML_KINDS}}


def _dequantized(t: GGUFTensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A low-bit tensor in fp32: through kvlm's kernels where they read its kind (on every
    core, gguf-py's values bit for bit: tests/test_kquants.py), else gguf-py's numpy (one
    core). A GPU's load and every dense weight dequantize here: on the 2-vCPU AMX Xeon the
    kernels' road ran 2.0x (Q8_0) to 5.4x (MXFP4) gguf-py's with a core to spare, and a
    GPU host's 16 cores take it further (the H200 spent 42.6 s dequantizing the 3 GB
    gpt-oss slice)."""
    kind = NATIVE_BLOCKS.get(t.tensor_type)
    if kind is None or len(shape) not in (2, 3) or kernels.library() is None:
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    rows = int(np.prod(shape[:-1]))
    with outside_arena():  # a temporary: not a slice of the packed weights' arena
        return QuantWeight.from_blocks(kind, np.asarray(t.data).reshape(rows, -1)).dense()
