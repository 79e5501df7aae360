"""What the command line's flags build, for every command and for each replica of `kvlm
serve --replicas` (which gets the parsed arguments): the LLM (the flags of
kvlm.cli._model_args plus the command's own cache settings) and the speculative decoding
configuration; and the Markdown tables the commands print. Nothing here imports torch until
it is called: `kvlm --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any

from kvlm.errors import KvlmError


def model_from_args(args: argparse.Namespace, **settings: Any):
    """An LLM from the flags every model command has (_model_args: the RoPE scaling too,
    --kv-dtype and --max-context), plus the command's own cache settings (which win over
    those flags)."""
    from kvlm.llm import LLM  # imports torch: only once a command runs

    numerics = ("weights", "prefill_dtype", "activations", "exact", "max_context")
    rope = ("rope_scaling", "rope_scale")
    own = ("model", "dtype", "device", "cpu_experts", "threads")
    flags = {k: getattr(args, k) for k in (*own, *numerics, *rope)}
    flags["kv_dtype"] = kv_dtype_of(args)
    return LLM(**(flags | settings), progress=sys.stderr.isatty())


def kv_dtype_of(args: argparse.Namespace) -> str | None:
    """K's and V's storage from --kv-dtype (both) and --k-dtype / --v-dtype (each, over
    --kv-dtype): one name, "K/V" when they differ (a side unnamed: auto), or None."""
    both = getattr(args, "kv_dtype", None)
    k, v = getattr(args, "k_dtype", None), getattr(args, "v_dtype", None)
    if k is None and v is None:
        return both
    k, v = k or both or "auto", v or both or "auto"
    return k if k == v else f"{k}/{v}"


def speculative_from_args(args: argparse.Namespace):
    from kvlm.engine.speculative import SpeculativeConfig

    if not args.speculative:
        return None
    try:
        flags = {k: getattr(args, k) for k in ("num_draft", "draft_model", "draft_weights")}
        return SpeculativeConfig(args.speculative, **flags)
    except ValueError as exc:
        raise KvlmError(str(exc)) from None


def table(head: str, align: str, rows: Iterable[str] = ()) -> list[str]:
    """A Markdown table's lines: `head` and each of `rows` (cells joined by " | ") between
    pipes, and below `head` the rule, a letter of `align` per column (l `---`, r `---:`,
    c `:---:`)."""
    rule = " | ".join({"l": "---", "r": "---:", "c": ":---:"}[a] for a in align)
    return [f"| {line} |" for line in (head, rule, *rows)]
