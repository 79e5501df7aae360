"""kvlm: a Python LLM inference engine built around the KV cache."""

from kvlm.engine.generate import RequestOutput
from kvlm.engine.sampling import SamplingParams
from kvlm.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
