"""kvlm: a Python LLM inference engine built around the KV cache.

The public names load on first use, so `kvlm --help` does not pay for importing torch.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

# OpenMP's threads wait for work asleep, not spinning (unless the user set a policy). By
# default libgomp's idle threads spin ~300,000 rounds after each parallel region, and
# kvlm runs thousands of regions a second: on a machine where anything else runs (a
# server's clients, a browser, a build), the spinners take the CPU from the thread every
# region waits for, and decoding fell 10-40x (the default model, 2 cores, one other busy
# process: 2.5-7 tok/s against 54-120 asleep; docs/BENCHMARKS.md 12.5). Set before torch
# loads libgomp, which reads it once: a process that imported torch first keeps its own.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
