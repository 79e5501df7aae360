"""Replies in the harmony format: a reply is a run of messages, each a header, its text and
an end, written with special tokens kept in the text:

    <|channel|>analysis<|message|>Weigh it.<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>

(the first message's `<|start|>assistant` is the generation prompt's). A message's channel
says where its text goes: "analysis" to `reasoning_content` (to the content where the
reasoning parser is off), "final" and a "commentary" without a recipient (a preamble) to
the content; a message to `functions.NAME` (the recipient after ` to=`, in the channel's
header or the role's) is a tool call of NAME whose text is its JSON arguments, handed on
written as the hermes format writes a call (`<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>`), so that kvlm.server.tools reads, streams and checks it as any
other; a message to another recipient (a built-in tool's: `browser.search`, `python`) is
dropped, as llama.cpp drops it, and so is a call where no tools were offered. Text that
does not open as a harmony header (a guided reply: JSON from its first token) is content
as it is. `<|return|>` and `<|call|>` end a generation (kvlm.loading.tokenizer), so a
reply's last message is cut by the end of the text; `<|end|>` does not.

`HarmonyStream` reads a reply piece by piece, as kvlm.server.reasoning.ReasoningStream
does (push -> (reasoning, content) deltas, finish at the end), holding text that may be
the start of a marker; `split` reads a whole reply through the same stream.
"""

from __future__ import annotations

import json
import re

from kvlm.server.reasoning import partial_tail
from kvlm.server.tools import HERMES_CLOSE, HERMES_OPEN

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, RETURN, CALL = "<|channel|>", "<|return|>", "<|call|>"
BODY_ENDS = (END, RETURN, CALL, START)  # what ends a message's text
REASONING_CHANNEL = "analysis"
FUNCTIONS = "functions."
# A header is a role, a channel, a recipient and a content type: a few dozen characters
# (a tool's name at most 64). Past this without `<|message|>` it is no header: the rest of
# the reply is content as written.
HEADER_MAX = 512
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]*)")


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (its channels and messages)."""
    return bool(template) and all(m in template for m in (START, CHANNEL, MESSAGE))  # type: ignore[operator]


class HarmonyStream:
    """One reply's harmony messages, pushed as its text comes: (reasoning, content) deltas,
    a tool call's text among the content in the hermes form. `reasoning`: the analysis
    channel's text goes to the reasoning (else to the content); `tools`: calls of
    `functions.*` are handed on (else dropped)."""

    def __init__(self, reasoning: bool, tools: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.state = "first"  # first | header | body | between | plain
        self.held = ""
        self.route = "content"  # a message's text: "reasoning" | "content" | "call" | "drop"
        self.thought = False  # an analysis message was opened
        self.spoke = False  # between messages: text other than whitespace came

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        out = {"reasoning": "", "content": ""}
        while self.held:
            if self.state == "plain":
                out["content"] += self.held
                self.held = ""
            elif self.state in ("first", "header"):
                if not self._header(out):
                    break
            elif self.state == "body":
                if not self._body(out):
                    break
            elif not self._between(out):
                break
        return out["reasoning"], out["content"]

    def _between(self, out: dict[str, str]) -> bool:
        """Text after a message's end, up to the next `<|start|>`: the whitespace right
        after the end dropped (as it comes: the same whatever the pieces), other text
        content as written; False: wait for more text."""
        if not self.spoke:
            rest = self.held.lstrip()
            if not rest:
                self.held = ""
                return False
            self.held, self.spoke = rest, True
        at = self.held.find(START)
        if at < 0:
            keep = partial_tail(self.held, (START,))
            out["content"] += self.held[: len(self.held) - keep]
            self.held = self.held[len(self.held) - keep :]
            return False
        out["content"] += self.held[:at]
        self.held, self.state = self.held[at + len(START) :], "header"
        return True

    def finish(self) -> tuple[str, str]:
        """What was held, at the end of the reply: the last message's text goes where its
        message went, a call closed (its end, `<|call|>`, ended the generation; cut off by
        max_tokens, kvlm.server.tools reads the arguments as far as they came); a header
        cut off is nothing, but the first (the reply was not harmony); text between
        messages is content."""
        held, self.held = self.held, ""
        if self.state in ("first", "plain", "between"):
            return "", held
        if self.state != "body" or self.route == "drop":
            return "", ""
        if self.route == "reasoning":
            return held, ""
        return "", held + ("}\n" + HERMES_CLOSE if self.route == "call" else "")

    # ------------------------------------------------------------------ states

    def _header(self, out: dict[str, str]) -> bool:
        """Read a header up to `<|message|>`; False: wait for more text."""
        if self.state == "first" and not _may_open(self.held):
            self.state = "plain"  # not harmony (a guided reply): content as written
            return True
        at = self.held.find(MESSAGE)
        if at < 0:
            if len(self.held) > HEADER_MAX:
                self.state = "plain"
                return True
            return False
        header, self.held = self.held[:at], self.held[at + len(MESSAGE) :]
        self._open(header, out)
        self.state = "body"
        return True

    def _open(self, header: str, out: dict[str, str]) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = channel.group(1) if channel else ""
        if recipient is not None and recipient.group(1) != "assistant":
            to = recipient.group(1)
            if to.startswith(FUNCTIONS) and self.tools:
                self.route = "call"
                out["content"] += (HERMES_OPEN + '\n{"name": '
                                   + json.dumps(to[len(FUNCTIONS) :], ensure_ascii=False)
                                   + ', "arguments": ')  # fmt: skip
            else:
                self.route = "drop"  # a built-in tool's call, or a call no tool was offered for
        elif name == REASONING_CHANNEL and self.reasoning:
            self.route, self.thought = "reasoning", True
        else:
            self.route = "content"

    def _body(self, out: dict[str, str]) -> bool:
        """A message's text up to its end; False: wait for more text."""
        ends = [(i, m) for m in BODY_ENDS if (i := self.held.find(m)) >= 0]
        if not ends:
            keep = partial_tail(self.held, BODY_ENDS)
            self._emit(self.held[: len(self.held) - keep], out)
            self.held = self.held[len(self.held) - keep :]
            return False
        at, marker = min(ends)
        self._emit(self.held[:at], out)
        if self.route == "call":
            out["content"] += "}\n" + HERMES_CLOSE
        self.held = self.held[at + len(marker) :]
        self.state, self.spoke = ("header" if marker == START else "between"), False
        return True

    def _emit(self, text: str, out: dict[str, str]) -> None:
        if text and self.route != "drop":
            out["reasoning" if self.route == "reasoning" else "content"] += text


def _may_open(text: str) -> bool:
    """Whether a reply's first characters are (or may still become) a harmony header:
    a channel, or a recipient in the role's header (` to=`)."""
    return any(text.startswith(m) or m.startswith(text) for m in (CHANNEL, " to="))


def split(text: str, reasoning: bool, tools: bool) -> tuple[str | None, str]:
    """(reasoning or None where no analysis message was read, content) of a whole reply."""
    stream = HarmonyStream(reasoning, tools)
    r, c = stream.push(text)
    r2, c2 = stream.finish()
    return (r + r2 if stream.thought else None), c + c2
