"""kvlm: a Python LLM inference engine built around the KV cache.

The public names load on first use, so `kvlm --help` does not pay for importing torch.
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import TYPE_CHECKING, Any

# MKL (torch's fp32 and fp64 GEMMs on x86) splits a product's sums across threads where it
# sees fit: on an AMX Xeon a 128 x 1536 -> 576 fp32 product differs between 1 and 2
# threads, so a prompt row's bits would follow the engine's thread count (kvlm.engine.
# threads moves it). Intel's strict conditional numerical reproducibility gives ?gemm one
# answer on any thread count (measured: 0-10% on 128-row products, docs/BENCHMARKS.md
# 20.4). MKL reads this at its first call, so it is set here, before any; a user's own
# setting stands.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

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
