"""What the engine needs of a loaded model, and nothing more.

The engine layer sits below the library's facade (kvlm.llm.LLM): it must not import it.
An Engine, a DraftModel and verify_mode take any object with these attributes; an LLM
is one (and the one every entry passes: the library, the CLI, the server, a replica).
Keeping the list here, in the engine's own layer, is what lets the import graph run one
way (tests/test_import_layers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvlm.cache import CacheSpec, KVCache
    from kvlm.config import ModelConfig
    from kvlm.defaults import Numerics
    from kvlm.engine.runner import ModelRunner
    from kvlm.engine.speculative import DraftModel, SpeculativeConfig
    from kvlm.loading.tokenizer import Tokenizer
    from kvlm.model.transformer import Transformer


class ServedModel(Protocol):
    """A model loaded for serving: its weights run by one runner, its tokenizer, and the
    settings its caches are made with."""

    config: ModelConfig
    tokenizer: Tokenizer
    model: Transformer
    runner: ModelRunner
    numerics: Numerics  # the weight and activation formats in use, and why
    dtype: torch.dtype  # the activations'
    max_context: int
    kv_mode: str  # the single stream's cache mode (--kv)
    threads: int | None  # the user's CPU thread count; None: measured (kvlm.engine.threads)

    @property
    def fingerprint(self) -> str:
        """A digest of the weights' bytes: K/V computed from other weights never match."""
        ...

    def cache_spec(self, mode: str | None = None) -> CacheSpec:
        """The settings a cache of `mode` (the model's own by default) is made with."""
        ...

    def new_cache(self, mode: str | None = None) -> KVCache:
        """A fresh, empty cache of `mode`."""
        ...

    def draft_model(self, spec: SpeculativeConfig) -> DraftModel:
        """The draft model `spec` names (method "draft"), loaded once and shared by every
        engine of this model."""
        ...
