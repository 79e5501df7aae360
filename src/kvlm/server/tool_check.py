"""Tool calls checked against their tools' whole schemas, where no grammar held them to it.

A tool's schema compiles with llguidance's `lenient` option (kvlm.server.tools TOOL_JSON):
a keyword it does not implement (`propertyNames`, which zod writes for a record and Claude
Code's tools carry; `uniqueItems`, `contains`, `not`, ...) is left out of the grammar, and
llguidance says so (kvlm.engine.guided `Compiled.warnings`). Such a request's calls are
checked after the fact: once a reply is parsed (kvlm.server.tools `parse`), each call's
arguments are validated against its tool's whole `parameters` with jsonschema (the draft
its `$schema` names, 2020-12 without one; `format` is an annotation, as it is to the
grammar). So are the calls no grammar made: tool_choice auto in the llama3_json format,
or in the hermes format beside a response_format (whose guide is the reply's). A call the
grammar made of a schema it kept whole is not checked again: the grammar is the check.

What a failed check does. A call that breaks its tool's schema (or names a tool not
offered) is not a call: the reply stays text, as a reply that does not parse as calls does
(kvlm.server.tools), finish_reason "stop", and the server's log says which call broke what.
Neither vLLM nor SGLang checks arguments against the schema; SGLang leaves a call of a tool
not offered out of the calls. A call passed on as valid would be run by a client that does
not check (Codex hands an MCP tool's arguments to its server, the OpenAI Agents SDK to the
function), and the wire formats have no way to say "this call is wrong". As text the client
sees what the model wrote and runs nothing: Claude Code and Codex show it as the model's
answer and the user asks again. A forced call (tool_choice required or named) that breaks
its schema is its JSON array as `content`, no `tool_calls`. Streamed, such a request's calls
are held until the reply ends (a call's arguments are not streamed as they come) and then
sent whole, as llama3_json's always are, or as text.

Bounds. Schemas are client input and the model writes the instance, so a check must not
hang the server: the schema is first held to kvlm.engine.guide_limits' bounds (size,
nesting, `$ref` chains; a schema past them is not checked); `pattern`, `patternProperties`
and `additionalProperties` match with the `regex` package under a timeout (the `re` module
that jsonschema uses backtracks without one: `^(a|a)*$` over 40 characters runs for ever,
holding the GIL); a reply's checks share one CHECK_S deadline, looked at before every
keyword; `uniqueItems` (quadratic in jsonschema) is not checked past MAX_UNIQUE items; a
schema with both `unevaluatedProperties` and `patternProperties` (whose search jsonschema
makes with `re`) is not checked. A check that cannot finish within these (or a schema
jsonschema cannot use: an unknown type, a cycle, a `$ref` to another document, which is
never fetched) lets the calls through as before, with a line in the log: the grammar's
part of the schema holds.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

import regex
from jsonschema import validators
from jsonschema.exceptions import ValidationError
from referencing import Registry

from kvlm.engine.guide_limits import check_bounds
from kvlm.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvlm.engine.guided import Guide

CHECK_S = 0.05  # a reply's checks together; past it they stop and the calls go through
MAX_UNIQUE = 512  # uniqueItems past this many items: not checked (jsonschema's is O(n^2))

log = logging.getLogger("kvlm.server")

_DEADLINE: ContextVar[float] = ContextVar("kvlm_tool_check_deadline", default=math.inf)


class Call(Protocol):
    """A parsed call (kvlm.server.tools.Call, which imports this module)."""

    name: str
    arguments: str  # a JSON object, as text


class Unchecked(Exception):
    """A check that could not finish within its bounds."""


class ToolChecks:
    """The offered tools' whole schemas, for the calls of one request."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.schemas: dict[str, Any] = {}
        for tool in tools:
            fn = tool["function"]
            self.schemas[fn["name"]] = _checkable(fn.get("parameters") or {"type": "object"})

    def broken(self, calls: list[Call]) -> str | None:
        """Why one of a reply's calls breaks its tool's schema; None where all meet theirs,
        or the check cannot tell (a call cut off by max_tokens, whose arguments are not
        whole: its finish_reason says so; a check past its bounds, logged)."""
        token = _DEADLINE.set(time.monotonic() + CHECK_S)
        try:
            for call in calls:
                why = self._broken(call)
                if why is not None:
                    return why
        except Unchecked as exc:
            log.warning("tool calls not checked against their schemas: %s", exc)
        finally:
            _DEADLINE.reset(token)
        return None

    def _broken(self, call: Call) -> str | None:
        if call.name not in self.schemas:
            return f"no tool named {call.name!r} is offered"
        schema = self.schemas[call.name]
        if schema is None:
            return None  # past the bounds, or one jsonschema cannot read: unchecked
        try:
            args = json.loads(call.arguments)
        except (ValueError, RecursionError):
            return None  # cut off (max_tokens): as far as it came
        try:
            error = next(_checker(schema).iter_errors(args), None)
        except Unchecked:
            raise
        except Exception as exc:  # the client's schema: anything jsonschema raises on it
            raise Unchecked(f"{call.name}'s schema: {type(exc).__name__}: {exc}") from None
        if error is None:
            return None
        return f"{call.name}: {error.message[:200]} (at {error.json_path})"


def tool_checks(tools: list[dict[str, Any]] | None, guide: Guide | None) -> ToolChecks | None:
    """The checks a request's calls need: none where its tools' grammar (`guide`, compiled)
    kept every schema whole; all its tools' where the grammar left something out or there
    is no grammar for the calls (None)."""
    if not tools:
        return None
    if guide is not None and guide.compiled is not None and not guide.compiled.warnings:
        return None
    return ToolChecks(tools)


def _checkable(schema: Any) -> Any:
    """The schema, or None where it is not checked: past guide_limits' bounds, or with
    both unevaluatedProperties and patternProperties."""
    try:
        check_bounds("json_schema", schema, "tools")
    except InvalidRequestError:
        return None
    keys: set[str] = set()
    stack = [schema]
    while stack:  # bounded just now: at most MAX_SCHEMA_NODES values
        node = stack.pop()
        if isinstance(node, dict):
            keys.update(k for k in node if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if {"unevaluatedProperties", "patternProperties"} <= keys:
        return None
    return schema


def _checker(schema: dict[str, Any]) -> Any:
    """A jsonschema validator of the schema's draft, its keywords bounded. Its registry
    is empty: jsonschema's default fetches a `$ref` to another document with urlopen."""
    base = validators.validator_for(schema, default=validators.Draft202012Validator)
    return _bounded(base)(schema, registry=Registry())


@functools.cache
def _bounded(base: type) -> type:
    """`base` with every keyword looking at the deadline first, and the regex keywords
    and uniqueItems replaced by bounded ones."""
    unique = functools.partial(_unique_items, base.VALIDATORS.get("uniqueItems"))
    own = {"pattern": _pattern, "patternProperties": _pattern_properties,
           "additionalProperties": _additional_properties, "uniqueItems": unique}  # fmt: skip
    keywords = {k: _timed(own.get(k, fn)) for k, fn in base.VALIDATORS.items()}
    return validators.extend(base, keywords)


def _timed(keyword: Any) -> Any:
    def timed(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        _left()
        yield from keyword(validator, value, instance, schema)

    return timed


def _left() -> float:
    """Seconds left of the reply's checks; Unchecked where none are."""
    left = _DEADLINE.get() - time.monotonic()
    if left <= 0:
        raise Unchecked(f"past {CHECK_S} s")
    return left


def _search(pattern: str, text: str) -> bool:
    """re.search's answer (JSON Schema's `pattern`), with a timeout."""
    try:
        return regex.search(pattern, text, timeout=_left()) is not None
    except TimeoutError:
        raise Unchecked(f"the pattern {pattern[:80]!r} ran past {CHECK_S} s") from None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    named, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = [k for k in instance if k not in named and not any(_search(p, k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        yield ValidationError(f"additional properties are not allowed ({extras!r} unexpected)")


def _unique_items(
    keyword: Any, validator: Any, unique: Any, instance: Any, schema: Any
) -> Iterator[Any]:
    if unique and validator.is_type(instance, "array") and len(instance) > MAX_UNIQUE:
        raise Unchecked(f"uniqueItems over {len(instance)} items")
    if keyword is not None:
        yield from keyword(validator, unique, instance, schema)
