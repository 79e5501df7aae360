"""Hugging Face model folders: config.json, *.safetensors, tokenizer files.

config.json becomes a ModelConfig through the family of its `model_type` (kvlm.arch);
tensors get the model's names (`text_model_name`, then `Family.from_hf_name`) and values
(`Family.fold_hf`: a quirk folded into the weights as llama.cpp's converter folds it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvlm.arch import config_from_hf, family
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.loading.shapes import check_shapes
from kvlm.model.weights import fingerprint_of

# the safetensors dtypes kvlm reads (as safetensors names them)
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


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

    def __init__(self, folder: Path) -> None:
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
        if not files:
            raise ModelLoadError(
                f"{folder} has no *.safetensors files (pytorch_model.bin is not supported)"
            )
        self._where: dict[str, Any] = {}
        self._stored: dict[str, str] = {}  # kvlm's name -> the file's
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise ModelLoadError(f"cannot read {file}: {exc}") from exc
            for stored in handle.keys():  # noqa: SIM118 - safe_open: no __iter__
                name = self.family.from_hf_name(text_model_name(stored))
                self._where[name], self._stored[name] = handle, stored
        self.dtypes = sorted({str(self.stored_as(n)[1]) for n in self._where})
        for name in check_shapes(self, self.config, folder.name, self.family.to_hf_name):
            stored, dtype = self.stored_as(name)
            if dtype not in FLOAT_DTYPES:
                raise UnsupportedModelError(f"{folder.name}: tensor {stored} is {dtype}; kvlm "
                                            f"reads {', '.join(FLOAT_DTYPES)}")  # fmt: skip

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as the model takes it (Family.hf_shape: after its fold)."""
        stored = tuple(self._where[name].get_slice(self._stored[name]).get_shape())
        folded = self.family.hf_shape
        return stored if folded is None else folded(name, stored)

    def files(self) -> list[Path]:
        return self._files

    def is_quantized(self, name: str) -> bool:
        return False  # safetensors holds float tensors

    def stored_as(self, name: str) -> tuple[str, str]:
        stored = self._stored[name]
        return stored, str(self._where[name].get_slice(stored).get_dtype())

    def get_quant(self, name: str, packed: bool = True) -> None:
        return None

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
        tensor = self._stored_tensor(name)
        fold = self.family.fold_hf
        return tensor if fold is None else fold(self.config, name, tensor)

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
