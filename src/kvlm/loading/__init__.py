"""Model resolution and loading: a path, a Hub id or nothing (the default model)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError
from kvlm.loading.default import default_model_path
from kvlm.loading.gguf import GGUFWeights, is_gguf_file
from kvlm.loading.hf import SafetensorsWeights
from kvlm.loading.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_folder
from kvlm.model.weights import WeightSource

__all__ = ["LoadedModel", "load_model", "resolve_model_path"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@dataclass(slots=True)
class LoadedModel:
    path: Path
    format: str  # "gguf" | "hf"
    config: ModelConfig
    weights: WeightSource
    tokenizer: Tokenizer
    weight_types: list[str]  # GGUF quant types or safetensors dtypes found in the file
    # the sampling the file recommends: field -> (where it says so, the value as written,
    # unchecked: an untrusted file's; kvlm.server.defaults checks it)
    sampling: dict[str, tuple[str, Any]] = field(default_factory=dict)


def resolve_model_path(model: str | Path | None) -> Path:
    """None -> the embedded default; an existing path -> itself; `org/name` -> Hub download."""
    if model is None or str(model) == "":
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if isinstance(model, str) and _HUB_ID.match(model):
        return _download(model)
    raise ModelLoadError(f"model not found: {model}")


def load_model(model: str | Path | None = None, config_only: bool = False) -> LoadedModel:
    """`config_only`: a Hugging Face folder of config.json without weights loads too (no
    tensors, no tokenizer: `tokenizer` None), for what needs the config alone."""
    path = resolve_model_path(model)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        bare = config_only and not any(path.glob("*.safetensors"))
        if (path / "config.json").is_file() and bare:
            hf = SafetensorsWeights(path, tensors=False)
            return LoadedModel(path, "hf", hf.config, hf, None, [], hf.sampling)  # type: ignore[arg-type]
        if (path / "config.json").is_file():
            hf = SafetensorsWeights(path)
            tokenizer = tokenizer_from_hf_folder(path, hf.config.eos_token_ids,
                                                 hf.config.vocab_size)  # fmt: skip
            return LoadedModel(path, "hf", hf.config, hf, tokenizer, hf.dtypes, hf.sampling)
        if len(ggufs) != 1:
            raise ModelLoadError(
                f"{path} has no config.json and {len(ggufs)} .gguf files; pass one file"
            )
        path = ggufs[0]
    if not is_gguf_file(path):
        raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model folder")
    gguf = GGUFWeights(path)
    tokenizer = tokenizer_from_gguf(gguf.metadata, path.name)
    return LoadedModel(path, "gguf", gguf.config, gguf, tokenizer, gguf.quant_types, gguf.sampling)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelLoadError(
            f"{repo_id!r} looks like a Hub id but huggingface_hub is not installed"
        ) from exc
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:  # network, auth, missing repo: one line for the user
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"cannot download {repo_id!r} from the Hugging Face Hub: {reason}"
        ) from exc
