"""Tool calls: read out of the model's text, or forced by tool_choice.

A model trained for tools writes its calls in its own format, which its chat template
teaches it (the template renders the `tools` it is given):

    hermes       (Qwen2.5, Qwen3, Hermes, most ChatML models)
                 text <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call> ...
    llama3_json  (Llama 3.1-3.3)  <|python_tag|>? {"name": "f", "parameters": {...}}; ...

`parser_for(template)` picks the format from the template's own text (vLLM makes the user
name it; kvlm reads it off the template and `--tool-call-parser` overrides it). With
tool_choice "auto" the reply is parsed after the fact: calls found become `tool_calls`
(finish_reason "tool_calls"), the text before them the content; text that does not parse
as a call stays text; in the hermes format `auto_guide` makes the calls well formed (a
lazy grammar: any text until `<tool_call>`, then only a call of an offered tool). With
tool_choice "required" or a named function the output is constrained (kvlm.engine.guided)
to a JSON array of calls, [{"name", "arguments"}], as vLLM constrains it, whatever the
model's own format; cut off by max_tokens, the calls begun are returned (`parse_forced`).
A template that does not render tools gets them written into its system turn
(kvlm.loading.tokenizer TOOLS_SYSTEM, the hermes format). Where the grammar left part of a
tool's schema out (llguidance's `lenient`: TOOL_JSON) or no grammar made the calls, they
are checked against the whole schema once parsed, and a call that breaks it leaves the
reply text (kvlm.server.tool_check).

Streaming: content streams as it comes, except from the first character that may open a
call (the hermes tag, or a reply that opens with "{" / "<|python_tag|>" for llama3_json):
from there the text is held. A hermes or forced call streams as OpenAI streams it (its id
and name, then its arguments as they come); llama3_json's calls, and those of a request
whose calls are checked, are parsed at the end into one delta per call (id, name and the
whole arguments), which OpenAI's clients accumulate like any split.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlm.engine.guide_limits import check_bounds
from kvlm.engine.guide_worker import JSON_STYLE
from kvlm.engine.guided import Guide

if TYPE_CHECKING:
    from kvlm.server.tool_check import ToolChecks

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# A tool's schema in the grammar: JSON_STYLE, and a keyword llguidance does not implement
# (`propertyNames`, which zod writes for a record and Claude Code's tools carry) left out
# of the grammar rather than refusing the request; the calls are then checked against the
# whole schema after the fact (kvlm.server.tool_check). A response_format schema stays
# strict: a 400.
TOOL_JSON = JSON_STYLE | {"lenient": True}
PYTHON_TAG = "<|python_tag|>"

log = logging.getLogger("kvlm.server")


def parser_for(template: str | None) -> str:
    """The tool-call format a chat template teaches: llama3_json where it is Llama 3's
    (the python tag, or its JSON-call instructions), else hermes."""
    t = template or ""
    if PYTHON_TAG in t or ('"parameters"' in t and "ipython" in t):
        return "llama3_json"
    return "hermes"


@dataclass(slots=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def _call(obj: Any, args_key: str = "arguments") -> Call | None:
    """{"name": str, "arguments"|"parameters": object or JSON text} -> Call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _hermes_bodies(text: str) -> list[tuple[str, str]]:
    """(body, what closes it) of each `<tool_call>` in `text`, as the regex
    `<tool_call>\\s*(.*?)(\\s*</tool_call>|$)` read them: the body after its leading
    whitespace, closed by its `</tool_call>` (the whitespace before it with it), or cut off
    at the end ("": it keeps its trailing whitespace, but for one last newline). A scan
    with str.find, linear in the text: the regex (a lazy body before `\\s*`) was
    quadratic on a run of whitespace, which a model can write."""
    out, at = [], text.find(HERMES_OPEN)
    while at >= 0:
        start = at + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, start)
        if end < 0:
            body = text[start:].lstrip()
            out.append((body[:-1] if body.endswith("\n") else body, ""))
            break
        inner = text[start:end].lstrip()
        body = inner.rstrip()
        out.append((body, inner[len(body) :] + HERMES_CLOSE))
        at = text.find(HERMES_OPEN, end + len(HERMES_CLOSE))
    return out


def parse(
    text: str, parser: str | None, checks: ToolChecks | None = None
) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole reply; no calls: (text, []). `parser` None: tool_choice
    forced, the whole text is the calls (parse_forced; none begun: (None, [])). `checks`:
    a call that breaks its tool's whole schema leaves the reply text, forced or not
    (kvlm.server.tool_check)."""
    content, calls = _parsed(text, parser)
    why = checks.broken(calls) if checks is not None and calls else None
    if why is not None:
        log.info("a tool call breaks its schema, the reply stays text: %s", why)
        return text, []
    return content, calls


def _parsed(text: str, parser: str | None) -> tuple[str | None, list[Call]]:
    if parser is None:
        return None, parse_forced(text)
    if parser == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        content, objects = text[:start].strip() or None, []
        for body, closed in _hermes_bodies(text[start:]):
            try:
                objects.append(json.loads(body))
            except (ValueError, RecursionError):  # cut off (max_tokens), or nested too deep:
                # the call as far as it came, or none
                begun = _begun(body)
                if len(begun) == 1:
                    objects.append(Call(*begun[0]))
                elif closed:
                    objects.append(None)  # a closed call that is not one: no calls
        if not objects:
            return text, []
        args_key = "arguments"
    elif parser == "llama3_json":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        content, objects, args_key = None, _json_objects(body), "parameters"
    else:
        raise ValueError(f"unknown tool-call parser {parser!r}")
    calls = [obj if isinstance(obj, Call) else _call(obj, args_key) for obj in objects]
    if not calls or any(c is None for c in calls):
        return text, []  # not well-formed calls: the reply stays text
    return content, calls  # type: ignore[return-value]


def _json_objects(text: str) -> list[Any]:
    """The JSON values of `text`, separated by ";" or whitespace; [] if any is not."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return []
        out.append(obj)
    return out


def forced_guide(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> Guide:
    """tool_choice "required" (name None) or a named function: the output is a JSON array
    of calls [{"name", "arguments"}] of the offered tools (of that one)."""
    schema = _calls_schema(tools, name) | {"x-guidance": TOOL_JSON}
    if not parallel or name is not None:
        schema["maxItems"] = 1
    return Guide("json_schema", schema, "tool_choice")


def _calls_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """A JSON array of calls of the offered tools (of the one named)."""
    items = [
        {"type": "object",
         "properties": {"name": {"const": t["function"]["name"]},
                        "arguments": t["function"].get("parameters") or {"type": "object"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools if name is None or t["function"]["name"] == name
    ]  # fmt: skip
    one = items[0] if len(items) == 1 else {"anyOf": items}
    return {"type": "array", "minItems": 1, "items": one}


def auto_guide(tools: list[dict[str, Any]]) -> Guide:
    """tool_choice "auto" in the hermes format: free text, and from the moment the model
    writes `<tool_call>` (llguidance's lazy lexeme: the grammar waits for its trigger) a
    call of an offered tool whose arguments follow its schema, then `</tool_call>`: calls
    are well formed without forcing one."""
    from llguidance._struct_tag import StructTag  # llguidance's own helper for this

    schema = _calls_schema(tools, None)["items"] | {"x-guidance": TOOL_JSON}
    check_bounds("json_schema", schema, "tools")
    tag = StructTag(trigger=HERMES_OPEN, begin=HERMES_OPEN + "\n", grammar=schema,
                    end="\n" + HERMES_CLOSE)  # fmt: skip
    return Guide("grammar", StructTag.to_grammar([tag], assume_special=False), "tools")


def parse_forced(text: str) -> list[Call]:
    """A forced reply's calls: the JSON array; cut off (max_tokens), the calls begun, the
    last with its arguments as far as they came (OpenAI's answer when a call is cut)."""
    try:
        calls = [_call(obj) for obj in json.loads(text)]
    except (ValueError, TypeError, RecursionError):
        return [Call(name, args) for name, args in _begun(text)]
    return [c for c in calls if c is not None]


# A call's head as the grammars write it. The name is bounded (OpenAI's are at most 64
# characters; escaped, at most 6 each), so a head is at most _HEAD_MAX characters before
# its whitespace, and a scan of growing text need never look back further than that.
_NAME_MAX = 6 * 64
_BEGUN = re.compile(r'\{"name": ("(?:[^"\\]|\\.){0,' + str(_NAME_MAX) + r'}"), "arguments":\s*')
_HEAD_MAX = len('{"name": "", "arguments":') + 2 * _NAME_MAX


def _begun(text: str) -> list[tuple[str, str]]:
    """(name, arguments as text: whole, or as far as a cut one came) of each call a
    reply began (written as JSON_STYLE writes JSON, as the grammars make it)."""
    starts = list(_BEGUN.finditer(text))
    out = []
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        body = text[match.end() : end]
        try:
            args, _ = json.JSONDecoder().raw_decode(body)
            body = json.dumps(args, ensure_ascii=False)
        except (ValueError, RecursionError):
            pass  # cut off: its text as far as it came
        out.append((json.loads(match.group(1)), body))
    return out


class ToolStream:
    """One streamed choice's text: passes content through, holds what may be a call. In
    the hermes format and forced, a call streams as OpenAI streams it: a first delta with
    its id and name once the name is written, then its arguments' text as it comes
    (`deltas()`); in llama3_json, and where the calls are checked (`checks`: a call that
    breaks its schema leaves the reply text, which a call sent as it came could not), each
    call comes whole at the end."""

    def __init__(self, parser: str | None, checks: ToolChecks | None = None) -> None:
        self.parser = parser  # None: forced (the whole output is the calls' JSON)
        self.checks = checks
        self.text = ""  # everything so far
        self.shown = 0  # characters of it sent as content
        self.holding = parser is None
        scan = parser in (None, "hermes") and checks is None
        self.calls = _CallScanner() if scan else None

    def push(self, delta: str) -> str:
        """The content to send now for this new text."""
        self.text += delta
        if self.holding:
            return self._scan()
        if self.parser == "llama3_json":
            head = self.text.lstrip()
            if not head:
                return ""
            opens_call = head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)])
            if opens_call and self.shown == 0:  # a reply that opens like a call: hold it all
                self.holding = True
                return ""
            return self._release(len(self.text))
        at = self.text.find(HERMES_OPEN, self.shown)
        if at >= 0:
            self.holding = True
            return self._release(at) + self._scan()
        # keep back a tail that could be the start of the tag
        keep = next((k for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1)
                     if HERMES_OPEN.startswith(self.text[-k:])), 0)  # fmt: skip
        return self._release(len(self.text) - keep)

    def _scan(self) -> str:
        if self.calls is not None:
            self.calls.feed(self.text, self.shown)
        return ""

    def deltas(self) -> list[dict[str, Any]]:
        """The calls' deltas since the last call (OpenAI's `delta.tool_calls` items)."""
        return self.calls.take() if self.calls is not None else []

    @property
    def began(self) -> int:
        """Calls begun in the stream so far."""
        return self.calls.count if self.calls is not None else 0

    def _release(self, upto: int) -> str:
        out = self.text[self.shown : upto]
        self.shown = max(self.shown, upto)
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """At the end: (content still to send, the calls not streamed as they came)."""
        if self.began:
            return "", []
        content, calls = parse(self.text, self.parser, self.checks)
        if not calls:  # held text that is no call (or calls that break their schemas):
            # content; a forced reply cut before its first name has none
            return (self._release(len(self.text)) if content is not None else ""), []
        return "", calls  # what came before the calls was sent as it came


class _CallScanner:
    """Calls read out of text as it grows: each `{"name": N, "arguments": ` begins one
    (a delta with its id and name), then the arguments' JSON as it comes (deltas of its
    text) until the object closes."""

    def __init__(self) -> None:
        self.at = 0  # characters of the text read
        self.count = 0  # calls begun
        self.depth = -1  # inside arguments: the nesting depth; -1: between calls
        self.quoted = self.escaped = False
        self.pending: list[dict[str, Any]] = []

    def feed(self, text: str, start: int) -> None:
        self.at = max(self.at, start)
        while self.at < len(text):
            if self.depth < 0:
                head = _BEGUN.search(text, self.at)
                if head is None:  # no call begun (yet): read the last head's length again
                    self.at = max(self.at, len(text) - _HEAD_MAX)
                    return
                call = Call(json.loads(head.group(1)), "")
                self.pending.append({"index": self.count, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}})  # fmt: skip
                self.count, self.depth, self.at = self.count + 1, 0, head.end()
                continue
            while self.depth == 0 and self.at < len(text) and text[self.at].isspace():
                self.at += 1  # before the arguments' first character
            begin = self.at
            while self.at < len(text) and self.depth >= 0:
                self._step(text[self.at])
                self.at += 1
            if self.at > begin:
                self.pending.append({"index": self.count - 1,
                                     "function": {"arguments": text[begin : self.at]}})  # fmt: skip

    def _step(self, ch: str) -> None:
        if self.quoted:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.quoted = False
        elif ch == '"':
            self.quoted = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.depth = -1  # the arguments' object closed: this call's end

    def take(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return out
