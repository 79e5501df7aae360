"""The server's sampling defaults: what a request gets for a sampling field it leaves unset.

    the request's own field                       (given, even as the API's default value)
      > kvlm serve's flag                         (--temperature, --top-p, --top-k, --min-p,
                                                   --repeat-penalty)
      > the model file's recommendation           (a GGUF's general.sampling.*, a folder's
                                                   generation_config.json)
      > the API's default                         (temperature 1, ...; on Ollama's routes its
                                                   Modelfile defaults, ollama.DEFAULTS)

as llama-server serves a GGUF's keys under its own flags, and vLLM a folder's
generation_config.json (`--generation-config auto`). Agents (Claude Code, Codex) send no
temperature: at the APIs' 1.0 a 135M model writes on where it answers at 0, and a default
on the server is how a user changes that without changing the client. Every route takes
these in one place, kvlm.server.app._params, against the request model's `model_fields_set`
(a translated dialect's body, Messages', Responses', Ollama's, carries only the fields its
client set). The file is untrusted: a value of the wrong type or out of range is ignored
with a warning; a flag's is a one-line error.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvlm.engine.sampling import SamplingParams
from kvlm.errors import InvalidRequestError

log = logging.getLogger("kvlm.server")

# the fields a server default may set -> kvlm serve's flag for it (llama.cpp's names, and
# kvlm generate's --temperature)
FLAGS = {
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "repetition_penalty": "--repeat-penalty",
}
# the response header naming the server's defaults a request took (absent: it took none)
HEADER = "kvlm-sampling-defaults"
_SHOWN_CHARS = 40  # of a bad value in a warning: a file's string may be long


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The server's value for each field it sets, and where each came from (a flag, or
    the file's key)."""

    values: dict[str, float | int] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The startup line: each default in effect and where it came from."""
        if not self.values:
            flags = ", ".join(FLAGS.values())
            return (f"sampling defaults: none (a request's unset fields take its API's "
                    f"defaults, temperature 1; {flags} set the server's)")  # fmt: skip
        shown = ", ".join(f"{k} {_number(v)} ({self.sources[k]})" for k, v in self.values.items())
        return f"sampling defaults for the fields a request leaves unset: {shown}"

    def header(self, names: Iterable[str]) -> str:
        """The HEADER's value for a request that took the defaults of `names`."""
        return ", ".join(f"{k}={_number(self.values[k])}" for k in names)


def check(name: str, value: Any) -> float | int:
    """`value` as the field `name` takes it (top_k: an integer, <= 0 off as llama.cpp and
    vLLM's -1 read it; the others a float), or a ValueError saying why not: the ranges
    are SamplingParams' own."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number")
    if name == "top_k":
        if not (math.isfinite(value) and float(value).is_integer()):
            raise ValueError("top_k must be an integer")
        value = max(int(value), 0)
    else:
        value = float(value)
    try:
        SamplingParams(**{name: value})
    except InvalidRequestError as exc:
        raise ValueError(str(exc)) from None
    return value


def from_flags(args: argparse.Namespace) -> dict[str, float | int]:
    """The defaults kvlm serve's flags set (a bad one: InvalidRequestError naming it)."""
    out: dict[str, float | int] = {}
    for name, flag in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        try:
            out[name] = check(name, value)
        except ValueError as exc:
            raise InvalidRequestError(f"{flag}: {exc}") from None
    return out


def resolve(
    flags: dict[str, float | int], recommended: dict[str, tuple[str, Any]], model: str
) -> SamplingDefaults:
    """The flags' defaults over the file's `recommended` ones (field -> (its key, the
    value as written)); a file's value that does not pass `check` is left out, with a
    warning naming the file's key."""
    values: dict[str, float | int] = {}
    sources: dict[str, str] = {}
    for name, (key, raw) in recommended.items():
        if name in flags:
            continue
        try:
            values[name] = check(name, raw)
        except ValueError as exc:
            shown = repr(raw)
            shown = shown if len(shown) <= _SHOWN_CHARS else shown[:_SHOWN_CHARS] + "..."
            log.warning("%s: its recommended %s (%s = %s) is ignored: %s", model, name, key,
                        shown, exc)  # fmt: skip
            continue
        sources[name] = key
    for name, value in flags.items():
        values[name], sources[name] = value, FLAGS[name]
    order = list(FLAGS)  # one order in the line, the header and /v1/models
    ordered = dict(sorted(values.items(), key=lambda kv: order.index(kv[0])))
    return SamplingDefaults(ordered, {k: sources[k] for k in ordered})


def _number(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
