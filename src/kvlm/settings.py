"""What the command line's flags build, for every command and for each replica of `kvlm
serve --replicas` (which gets the parsed arguments): the LLM (the flags of
kvlm.cli._model_args plus the command's own cache settings) and the speculative decoding
configuration. Nothing here imports torch until it is called: `kvlm --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvlm.errors import KvlmError


def model_from_args(args: argparse.Namespace, **settings: Any):
    """An LLM from the flags every model command has (_model_args), plus the command's own
    cache settings."""
    from kvlm.llm import LLM  # imports torch: only once a command runs

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        weights=args.weights,
        prefill_dtype=args.prefill_dtype,
        activations=args.activations,
        exact=args.exact,
        progress=sys.stderr.isatty(),
        **settings,
    )


def speculative_from_args(args: argparse.Namespace):
    from kvlm.engine.speculative import SpeculativeConfig

    if not args.speculative:
        return None
    try:
        return SpeculativeConfig(
            args.speculative,
            num_draft=args.num_draft,
            draft_model=args.draft_model,
            draft_weights=args.draft_weights,
        )
    except ValueError as exc:
        raise KvlmError(str(exc)) from None
