"""Hugging Face model folders: config.json, *.safetensors, tokenizer files.

config.json becomes a ModelConfig through the family of its `model_type` (kvlm.arch);
tensors get the model's names (`text_model_name`, then `Family.from_hf_name`) and values
(`Family.fold_hf`: a quirk folded into the weights as llama.cpp's converter folds it).

A checkpoint quantized to MXFP4 (transformers' `quant_method` "mxfp4": a stack NAME kept
as `NAME_blocks`, (E, rows, groups, 16) bytes of E2M1 nibbles, two elements a byte in
order, and `NAME_scales`, (E, rows, groups) E8M0 exponents, a group of 32 along the
input) is read as GGUF's MXFP4 blocks, as llama.cpp's converter rewrites them (a group's
exponent, then element j in the low nibble and j + 16 in the high one): its blocks as they
are for the kernels (`get_quant`: --weights native, the default for such a folder), rows
in the order the family's fold gives the float stack's rows (gpt-oss's gate|up
de-interleaved), or their values (`get`).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from kvlm.arch import config_from_hf, family
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.loading.shapes import check_shapes
from kvlm.model.quant import Blocks
from kvlm.model.weights import fingerprint_of

# the safetensors dtypes kvlm reads (as safetensors names them)
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# an MXFP4 stack's two tensors, a group's elements and a GGUF block's bytes (an exponent
# and 16 bytes of nibbles)
MXFP4_BLOCKS, MXFP4_SCALES, MXFP4_GROUP, MXFP4_BLOCK_BYTES = "_blocks", "_scales", 32, 17
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


# generation_config.json's sampling fields: the model's recommended sampling, which `kvlm
# serve` takes for a request's unset fields, as vLLM's `--generation-config auto` does (vLLM
# reads them whatever `do_sample` says, and so does kvlm)
GENERATION_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# A folder's JSON files but tokenizer.json (config.json, generation_config.json,
# tokenizer_config.json) are read whole, at most this many bytes: real ones are under
# 2 MiB (a tokenizer_config.json listing thousands of added tokens)
MAX_JSON_BYTES = 16 << 20


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of `path`, at most `limit` of them (a ModelLoadError past it, read no
    further)."""
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"missing {path}") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if len(data) > limit:
        raise ModelLoadError(f"{path} is over {limit} bytes; at most {limit}")
    return data


def read_text(path: Path, limit: int) -> str:
    """`path` as UTF-8 text of at most `limit` bytes."""
    try:
        return read_bounded(path, limit).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON object of at most `limit` bytes (anything else is a ModelLoadError)."""
    value = parse_json(read_text(path, limit), path)
    if not isinstance(value, dict):
        raise ModelLoadError(f"cannot read {path}: it holds {json_kind(value)}; expected an "
                             "object")  # fmt: skip
    return value


def parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    except RecursionError:  # nested past Python's stack
        raise ModelLoadError(f"cannot read {path}: its JSON is nested too deep") from None


def json_kind(value: Any) -> str:
    """A JSON value's type as an error names it (a list, a string, ...)."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}  # fmt: skip
    return kind.get(type(value), type(value).__name__)


class SafetensorsWeights:
    """A `WeightSource` over the safetensors shards of one folder."""

    def __init__(self, folder: Path, tensors: bool = True) -> None:
        """`tensors` False: a folder with config.json alone is read too, as a source of no
        tensors (`kvlm memory` plans from the config before the weights are downloaded)."""
        raw = read_json(folder / "config.json")
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else {}
        self.config = config_from_hf(_with_generation_eos(gen, raw), name=folder.name)
        self.family = family(self.config.architecture)
        # field -> (where the file says it, its value as written: checked by its user)
        self.sampling: dict[str, tuple[str, Any]] = {
            name: ("generation_config.json", gen[name])
            for name in GENERATION_SAMPLING if gen.get(name) is not None
        }  # fmt: skip
        files = self._files = sorted(folder.glob("*.safetensors"))
        self._where: dict[str, Any] = {}
        self._stored: dict[str, str] = {}  # kvlm's name -> the file's
        self._mxfp4: dict[str, tuple[Any, str]] = {}
        if not files and not tensors:
            self.dtypes: list[str] = []
            return
        if not files:
            raise ModelLoadError(
                f"{folder} has no *.safetensors files (pytorch_model.bin is not supported)"
            )
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise ModelLoadError(f"cannot read {file}: {exc}") from exc
            for stored in handle.keys():  # noqa: SIM118 - safe_open: no __iter__
                name = self.family.from_hf_name(text_model_name(stored))
                self._where[name], self._stored[name] = handle, stored
        # MXFP4 stacks under the model's name of NAME: its blocks where every tensor is
        # (`_where`, `_stored`), its scales' file and name here (a shard of their own maybe)
        named = {stored: name for name, stored in self._stored.items()}
        for stored in [s for s in named if s.endswith(MXFP4_BLOCKS)]:
            base = stored.removesuffix(MXFP4_BLOCKS)
            scales = base + MXFP4_SCALES
            if scales not in named:
                raise ModelLoadError(f"{folder.name}: {stored} has no {scales}")
            name = self.family.from_hf_name(text_model_name(base))
            self._where[name] = self._where.pop(named[stored])
            self._stored[name] = self._stored.pop(named[stored])
            self._mxfp4[name] = (self._where.pop(named[scales]), scales)
            del self._stored[named[scales]]
        self.dtypes = sorted({str(self.stored_as(n)[1]) for n in self._where})
        for name in check_shapes(self, self.config, folder.name, self.family.to_hf_name):
            stored, dtype = self.stored_as(name)
            if name in self._mxfp4:
                self._check_mxfp4(name)
            elif dtype not in FLOAT_DTYPES:
                raise UnsupportedModelError(f"{folder.name}: tensor {stored} is {dtype}; kvlm "
                                            f"reads {', '.join(FLOAT_DTYPES)}")  # fmt: skip

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as the model takes it (Family.hf_shape: after its fold; an
        MXFP4 stack's (E, rows, groups x 32) as its blocks lie)."""
        stored = tuple(self._where[name].get_slice(self._stored[name]).get_shape())
        if name in self._mxfp4:
            return (*stored[:-2], stored[-2] * MXFP4_GROUP) if len(stored) > 1 else stored
        folded = self.family.hf_shape
        return stored if folded is None else folded(name, stored)

    def files(self) -> list[Path]:
        return self._files

    def is_quantized(self, name: str) -> bool:
        return name in self._mxfp4  # else a float tensor

    def stored_bytes(self, name: str) -> int:
        """The tensor's bytes in the file: an MXFP4 stack's as --weights native keeps them
        (17 a group of 32), a float tensor's at its stored dtype's size."""
        if name in self._mxfp4:
            return math.prod(self.shape(name)) // MXFP4_GROUP * MXFP4_BLOCK_BYTES
        stored = self._where[name].get_slice(self._stored[name])
        size = _ITEM_BYTES.get(str(stored.get_dtype()))
        if size is None:
            raise UnsupportedModelError(f"tensor {self._stored[name]} is {stored.get_dtype()}")
        return math.prod(stored.get_shape()) * size

    def stored_as(self, name: str) -> tuple[str, str]:
        stored = self._stored[name]
        if name in self._mxfp4:
            return stored, "MXFP4"
        return stored, str(self._where[name].get_slice(stored).get_dtype())

    def get_quant(self, name: str, packed: bool = True) -> Blocks | None:
        """An MXFP4 stack's blocks (E x rows rows of GGUF's MXFP4 blocks, in the model's row
        order), packed or (`packed=False`) not yet; None for a float tensor."""
        if name not in self._mxfp4:
            return None
        blocks = Blocks("mxfp4", self._mxfp4_rows(name))
        return blocks.pack() if packed else blocks

    def release(self) -> None:
        pass

    def fingerprint(self) -> str:
        """Config + the final norm and the first rows of the embedding, as stored."""
        config = replace(self.config, name="")
        norm = self._stored_tensor("model.norm.weight")
        embed = self._where["model.embed_tokens.weight"].get_slice(
            self._stored["model.embed_tokens.weight"]
        )
        return fingerprint_of(config, _bytes(norm), _bytes(embed[:8]))

    def get(self, name: str) -> torch.Tensor:
        if name in self._mxfp4:  # its values, (E, rows, K) in the model's order already
            rows = self._mxfp4_rows(name)
            # gguf-py's own MXFP4 decoding (the blocks' reference, as for a GGUF file)
            values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.MXFP4)
            return torch.from_numpy(np.ascontiguousarray(values)).reshape(self.shape(name))
        tensor = self._stored_tensor(name)
        fold = self.family.fold_hf
        return tensor if fold is None else fold(self.config, name, tensor)

    def _check_mxfp4(self, name: str) -> None:
        """An MXFP4 stack's blocks (E, rows, groups, 16) and scales (E, rows, groups) uint8."""
        (where, scales), blocks = self._mxfp4[name], self._stored[name]
        b, s = self._where[name].get_slice(blocks), where.get_slice(scales)
        shape_b, shape_s = tuple(b.get_shape()), tuple(s.get_shape())
        if (str(b.get_dtype()), str(s.get_dtype())) != ("U8", "U8") or (
            len(shape_b) != 4 or shape_b[-1] != MXFP4_GROUP // 2 or shape_b[:-1] != shape_s
        ):
            raise ModelLoadError(f"{blocks} {b.get_dtype()} {list(shape_b)} and {scales} "
                                 f"{s.get_dtype()} {list(shape_s)} are not MXFP4 blocks and "
                                 "their scales (uint8, (E, rows, groups, 16) and (E, rows, "
                                 "groups))")  # fmt: skip

    def _mxfp4_rows(self, name: str) -> np.ndarray:
        """An MXFP4 stack as GGUF's blocks, E x rows rows of groups x 17 bytes, the rows in
        the order the family's fold gives the float stack's (E, rows, K)."""
        where, scales = self._mxfp4[name]
        blocks = self._stored_tensor(name).numpy()
        e, rows, groups, _ = blocks.shape
        # byte i of the Hub's holds elements 2i (low) and 2i + 1 (high); GGUF's byte j holds
        # element j (low) and j + 16 (high): its even bytes take low nibbles, its odd ones
        # high ones, of the first eight bytes and (shifted) of the last eight
        out = np.empty((e, rows, groups, MXFP4_BLOCK_BYTES), dtype=np.uint8)
        try:
            out[..., 0] = where.get_tensor(scales).numpy()
        except Exception as exc:
            raise ModelLoadError(f"cannot read tensor {scales}: {exc}") from exc
        low, high = blocks & 0x0F, blocks >> 4
        out[..., 1::2] = low[..., :8] | (low[..., 8:] << 4)
        out[..., 2::2] = high[..., :8] | (high[..., 8:] << 4)
        out = out.reshape(e * rows, -1)
        order = self._row_order(name, e, rows)
        return out if order is None else np.ascontiguousarray(out[order])

    def _row_order(self, name: str, e: int, rows: int) -> np.ndarray | None:
        """The rows of a stack (E, rows, K) in the order the family's fold puts the float
        stack's (its index passed through `fold_hf` as the float tensor would be: stored
        (E, K, rows) where `hf_shape` turns it, else (E, rows, K)); None: as stored."""
        fold = self.family.fold_hf
        if fold is None:
            return None
        index = torch.arange(e * rows).reshape(e, rows, 1)
        turned = self.family.hf_shape
        if turned is not None and turned(name, (e, 1, rows)) == (e, rows, 1):
            index = index.transpose(1, 2)  # stored (E, K, rows): one column of K here
        order = fold(self.config, name, index).reshape(-1).numpy()
        return None if np.array_equal(order, np.arange(e * rows)) else order

    def _stored_tensor(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(self._stored[name])
        except Exception as exc:
            raise ModelLoadError(f"cannot read tensor {name}: {exc}") from exc


# A multimodal checkpoint's language model, as its files name it -> as a text model's
# (`language_model.model.*` on the Hub, and `model.language_model.*` as newer
# transformers lay it out)
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}


def text_model_name(stored: str) -> str:
    """The name a text model gives the tensor the file calls `stored`."""
    for prefix, plain in _TEXT_PREFIXES.items():
        if stored.startswith(prefix):
            return plain + stored[len(prefix) :]
    return stored


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _with_generation_eos(gen: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json (`gen`) often lists more end tokens than config.json (chat
    turns)."""
    if gen.get("eos_token_id") is None:
        return cfg
    ids = cfg.get("eos_token_id")
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    extra = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    return {**cfg, "eos_token_id": list(dict.fromkeys([*ids, *extra]))}
