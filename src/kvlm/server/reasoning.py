"""Reasoning split out of a reply: the text a thinking model writes between `<think>` and
`</think>` (Qwen3, QwQ, DeepSeek-R1 and their distills) goes to `reasoning_content` (chat),
a reasoning item (Responses) or a thinking block (Messages); what follows is the reply.

One rule serves every such family, as vLLM's qwen3 and deepseek_r1 parsers read it: a
reply is reasoning up to `</think>` when it opens with `<think>` (leading whitespace
allowed), or when the prompt itself ends inside an open `<think>` (DeepSeek-R1's template,
and Qwen3's thinking models, open it in the generation prompt); a reply cut off before
`</think>` is all reasoning; anything else is all content (Qwen3 with `enable_thinking`
false: its template closes an empty block in the prompt). The newlines right after
`</think>` are dropped, as the templates write them.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; both read the one rule above


def parser_for(chat_template: str | None) -> str | None:
    """The parser a template implies: a template that writes `</think>` belongs to a
    thinking model."""
    return "qwen3" if chat_template and CLOSE in chat_template else None


def starts_thinking(prompt_text: str) -> bool:
    """Whether a prompt ends inside an open `<think>` (its reply starts as reasoning)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def split(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    if not thinking:
        at = text.find(OPEN)
        if at < 0 or text[:at].strip():
            return None, text
        text = text[at + len(OPEN) :]
    end = text.find(CLOSE)
    if end < 0:
        return text, ""
    return text[:end], text[end + len(CLOSE) :].lstrip("\n")


class ReasoningStream:
    """The same split of a streamed reply: push() each piece of text, get (reasoning,
    content) deltas; text that may be the start of a tag is held until it is decided."""

    def __init__(self, thinking: bool) -> None:
        self.state = "think" if thinking else "start"
        self.held = ""
        self.blank = 0  # in "start": held's first characters known to be whitespace

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while self.held:
            if self.state == "start":
                # only what came since is read again: a reply opening with a long run of
                # whitespace costs its length, not its length times its tokens
                tail = self.held[self.blank :]
                rest = tail.lstrip()
                self.blank += len(tail) - len(rest)
                if rest.startswith(OPEN):
                    self.held, self.state = rest[len(OPEN) :], "think"
                elif not rest or OPEN.startswith(rest):
                    break  # whitespace, or a partial <think>: not decided yet
                else:
                    self.state = "content"
            elif self.state == "think":
                end = self.held.find(CLOSE)
                if end >= 0:
                    reasoning += self.held[:end]
                    self.held, self.state = self.held[end + len(CLOSE) :], "after"
                    continue
                keep = partial_tail(self.held, (CLOSE,))
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            elif self.state == "after":
                self.held = self.held.lstrip("\n")
                if self.held:
                    self.state = "content"
            else:
                content, self.held = content + self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held, at the end of the reply."""
        held, self.held = self.held, ""
        if self.state == "think":
            return held, ""
        return "", held.lstrip("\n") if self.state == "after" else held


def partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `tags` (text to hold
    until the next piece says whether it is the tag)."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0
