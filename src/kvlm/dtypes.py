"""Names users type for dtypes, and what they mean."""

from __future__ import annotations

import torch

from kvlm.errors import InvalidRequestError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    # The reference precision: fp32's rounding shrunk by 2^-29, so two fp32 paths can be
    # held to "as close to exact as fp32 allows" (tests, `kvlm verify --dtype fp64`). Slow.
    "fp64": torch.float64,
    "float64": torch.float64,
}
# The 4-bit K/V type (kvlm.cache.storage: q4_0-like, per group of 32): torch has no 4-bit
# dtype, so its codes' storage dtype, two codes a byte, names it.
Q4 = torch.uint8
SHORT_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int8: "int8",
    Q4: "q4",
}
# Cache files store what kvlm serves with; an fp64 reference cache is never written.
NAMES = {**SHORT_NAMES, torch.float64: "fp64"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A compute dtype: fp32, bf16, fp16 (or fp64, the reference)."""
    return _parse(name, DTYPES, "fp32, bf16, fp16 or fp64")


def parse_kv_dtype(name: str | torch.dtype) -> torch.dtype:
    """A cache storage dtype: the compute dtypes, int8 (with per-token scales) or q4 (4-bit
    codes, a scale per group of 32)."""
    table = {**DTYPES, "int8": torch.int8, "q4": Q4}
    return _parse(name, table, "fp32, bf16, fp16, fp64, int8 or q4")


def parse_kv_dtypes(name: str | torch.dtype | tuple) -> tuple[torch.dtype, torch.dtype]:
    """K's and V's storage dtypes: one name for both ("int8"), or K's and V's apart, "K/V"
    ("int8/q4": --k-dtype int8 --v-dtype q4), or a (K, V) pair."""
    if isinstance(name, tuple):
        if len(name) != 2:
            raise InvalidRequestError(f"K/V dtypes are a pair (K, V), not {name!r}")
        k, v = name
    elif isinstance(name, str):
        k, v = kv_sides(name)
    else:
        k = v = name
    return parse_kv_dtype(k), parse_kv_dtype(v)


def kv_sides(name: str) -> tuple[str, str]:
    """A K/V storage name's K and V sides: "int8/q4" -> ("int8", "q4"), "fp16" -> both."""
    k, _, v = name.partition("/")
    return k, v or k


def kv_dtype_name(k: torch.dtype, v: torch.dtype | None = None) -> str:
    """K's and V's storage as one name: "int8" for both, "int8/q4" for K int8, V q4."""
    if v is None or v == k:
        return dtype_name(k)
    return f"{dtype_name(k)}/{dtype_name(v)}"


def _parse(name: str | torch.dtype, table: dict[str, torch.dtype], valid: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in table.values():
            raise InvalidRequestError(f"unsupported dtype {name}; use {valid}")
        return name
    dtype = table.get(str(name).lower())
    if dtype is None:
        raise InvalidRequestError(f"unknown dtype {name!r}; use {valid}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return NAMES.get(dtype, str(dtype).removeprefix("torch."))
