"""kvlm: a Python LLM inference engine built around the KV cache.

The public names load on first use, so `kvlm --help` does not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlm.engine.request import RequestOutput
    from kvlm.engine.sampling import SamplingParams
    from kvlm.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "kvlm.llm",
    "RequestOutput": "kvlm.engine.request",
    "SamplingParams": "kvlm.engine.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kvlm' has no attribute {name!r}")
