"""Grammar-constrained decoding (JSON schema, JSON object, regex, choice, Lark grammar)
through llguidance.

Why llguidance: on this project's CPUs both maintained libraries made for this (xgrammar,
what vLLM and SGLang default to, and llguidance) cost far less than a decode step per
token (benchmarks/bench_grammar.py, docs/BENCHMARKS.md: a 49k vocabulary, a nested JSON
schema: llguidance 11 us median / 82 us p90 per mask, xgrammar 1.4 / 7 us, against a
~3 ms step), and llguidance is one 3 MB wheel with no dependencies where xgrammar
requires torch's triton and a TVM runtime. It also compiles a schema in ~1 ms (lazily),
which a server meeting a new schema per request wants.

Each sample keeps its own matcher: before sampling, its allowed-token bitmask turns every
other logit into -inf (a per-row operation, the same in any batch); after, the matcher
consumes the token. When the grammar is complete only the end-of-sequence tokens are
allowed, so the sample stops there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from kvlm.errors import InvalidRequestError

GUIDE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GUIDE_CHARS = 1 << 20  # a grammar or schema of more text than this is refused
# JSON as json.dumps writes it: ", " and ": ", no other whitespace. Free whitespace lets a
# small model spend its tokens on newlines and indents (a random-weight one never closes
# the object); a schema's own "x-guidance" options still override this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Guide:
    """What the output must match. `spec`: a JSON schema (dict) for json_schema, nothing
    for json_object, a regular expression, a list of strings (choice), a Lark grammar."""

    kind: str
    spec: Any = None
    param: str = "response_format"  # the request field it came from (errors name it)

    def grammar(self) -> str:
        """llguidance's grammar for it; InvalidRequestError naming `param` if it is not
        one."""
        import llguidance

        m = llguidance.LLMatcher
        try:
            if self.kind == "json_schema":
                return m.grammar_from_json_schema(json.dumps(self.spec), defaults=JSON_STYLE)
            if self.kind == "json_object":
                return m.grammar_from_json_schema('{"type": "object"}', defaults=JSON_STYLE)
            if self.kind == "regex":
                return m.grammar_from_regex(self.spec)
            if self.kind == "choice":
                return m.grammar_from_regex("|".join(re.escape(c) for c in self.spec))
            if self.kind == "grammar":
                return m.grammar_from_lark(self.spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{self.param}: {exc}", param=self.param) from None
        raise InvalidRequestError(f"unknown guide {self.kind!r}", param=self.param)


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the model's tokenizer (~0.3 s to build: kept on the tokenizer),
    over the model's whole vocabulary (its logits; a GGUF may pad past the tokenizer's),
    ending at the tokenizer's end-of-sequence tokens."""
    import llguidance

    made = getattr(tokenizer, "_ll_tokenizers", None)
    if made is None:
        made = tokenizer._ll_tokenizers = {}
    if vocab_size not in made:
        eos = sorted(tokenizer.eos_token_ids) or None
        made[vocab_size] = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos
        )
    return made[vocab_size]


def check_guide(guide: Guide, tokenizer, vocab_size: int) -> None:
    """Compile the guide for this model now: a bad schema, regex or grammar is the
    request's 400, never a failure mid-generation."""
    GuideState(guide, tokenizer, vocab_size)


class GuideState:
    """One sample's matcher."""

    def __init__(self, guide: Guide, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.guide = guide
        self.vocab_size = vocab_size
        tok = ll_tokenizer(tokenizer, vocab_size)
        self.matcher = llguidance.LLMatcher(tok, guide.grammar(), log_level=0)
        if self.matcher.is_error():
            raise InvalidRequestError(
                f"{guide.param}: {self.matcher.get_error()}", param=guide.param
            )
        self._fill = lt.fill_next_token_bitmask
        self.bitmask = lt.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` (V,) with every token the grammar does not allow at -inf."""
        self._fill(self.matcher, self.bitmask, 0)
        words = self.bitmask[0].to(torch.int32)
        allowed = ((words[:, None] >> self._bits) & 1).bool().flatten()[: logits.shape[-1]]
        if not bool(allowed.any()):  # the grammar is over and its end was ignored (ignore_eos)
            return logits
        out = logits.float().clone()
        out[~allowed.to(out.device)] = float("-inf")
        return out

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)
