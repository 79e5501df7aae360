"""A conversation that keeps its KV cache between turns, and can be saved and resumed.

Each turn renders the whole conversation with the chat template, keeps the longest
prefix the cache already holds, rolls back the rest, and prefills only the new tokens:

    turn 1 cache: [system][user 1][assistant 1 .. last sampled token not yet fed]
    turn 2 ids:   [system][user 1][assistant 1<|im_end|>][user 2][assistant header]
                  |<------ shared, kept ------>|<- rolled back and re-fed from here ->|

Without a template (`use_template=False`) a turn's text is appended to the token history.
save()/load() write the cache with the history and messages, so a later process resumes
the conversation without recomputing its prefix.
"""

from __future__ import annotations

from pathlib import Path

from kvlm.cache import CacheFileError, KVCache
from kvlm.cache.base import brief
from kvlm.cache.files import load_cache, save_cache
from kvlm.engine.batch import Stream
from kvlm.engine.engine import Engine
from kvlm.engine.sampling import SamplingParams
from kvlm.engine.sequence import common_prefix
from kvlm.errors import InvalidRequestError

FIELDS = ("role", "content")  # a saved message's, each a string


class ChatSession:
    def __init__(
        self,
        engine: Engine,
        params: SamplingParams,
        system: str | None = None,
        vocab_size: int | None = None,
        use_template: bool = True,
    ) -> None:
        """`engine`: an engine over the conversation's own cache that starts each request
        from what the cache holds (LLM.cache_engine(cache, reuse=True)); with speculative
        decoding configured, every turn decodes speculatively."""
        if params.n != 1:
            raise InvalidRequestError("a conversation continues one sample: use n=1")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.cache: KVCache = engine.backend.cache
        self.params = params
        self.vocab_size = vocab_size
        self.use_template = use_template
        self.messages: list[dict[str, str]] = []
        if system and use_template:
            self.messages.append({"role": "system", "content": system})
        self.history: list[int] = []  # every token so far, the last sampled one included
        self.cache.reset()
        self._turn: Stream | None = None

    def send(self, text: str) -> Stream:
        """Start a turn; iterate the returned Stream for the reply's text."""
        self._settle()
        if self.use_template:
            self.messages.append({"role": "user", "content": text})
            ids = self.tokenizer.encode_chat(self.messages)
            # where the generation prompt starts: the next turn renders this one's reply
            # after it otherwise, so a state that cannot forget tokens keeps its value there
            turn = self.tokenizer.turn_start(ids, self.messages)
        else:
            turn = None
            ids = self.history + self.tokenizer.encode(text, add_special_tokens=not self.history)
        cached = self.history[: self.cache.num_tokens]  # exactly the tokens the cache holds
        keep = min(common_prefix(cached, ids), len(ids) - 1)
        # the furthest the cache can go back to within that (a ring may have let go of what
        # the kept prefix's end reads, a state kept only some positions); 0: start over
        point = self.cache.rollback_point(keep)
        if point:
            self.cache.rollback(self.cache.num_tokens - point)
        else:
            self.cache.reset()
        self._turn = Stream(self.engine, ids, self.params, turn_start=turn)
        return self._turn

    def _settle(self) -> None:
        """Record the previous turn (finished or interrupted) in the history."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        self.history = list(turn.tokens)
        turn.sync()
        if self.use_template:
            self.messages.append({"role": "assistant", "content": turn.output.text})

    def save(self, path: str | Path, fingerprint: str) -> None:
        self._settle()
        extra = {"kind": "chat" if self.use_template else "text", "history": self.history}
        if self.use_template:
            extra["messages"] = self.messages
        save_cache(self.cache, path, fingerprint, extra)

    def load(self, path: str | Path, fingerprint: str) -> None:
        """Resume a conversation saved by save(). A file that does not hold one (a token
        history covering the cache, ids in the vocabulary, one sequence) is refused with a
        CacheFileError, and the cache is left empty rather than half-loaded."""
        extra = load_cache(self.cache, path, fingerprint)
        try:
            self.history, self.messages = self._check_saved(path, extra)
        except CacheFileError:
            self.cache.free()  # K/V the session holds no tokens for must not stay
            raise
        self._turn = None

    def _check_saved(self, path: str | Path, extra: dict) -> tuple[list[int], list[dict]]:
        kind = "chat" if self.use_template else "text"
        if extra.get("kind") != kind:
            raise CacheFileError(
                f"{path} holds a {brief(extra.get('kind'))} conversation; this one is {kind!r} "
                "(use the same --chat/--no-chat)"
            )
        if self.cache.batch != 1:
            raise CacheFileError(
                f"{path} holds {self.cache.batch} sequences; a conversation is one"
            )
        history = extra.get("history")
        if not isinstance(history, list):
            raise CacheFileError(f"{path} has no token history")
        self._check_history(path, history)
        messages = extra.get("messages", [] if kind == "text" else None)
        if not isinstance(messages, list):
            raise CacheFileError(f"{path} is damaged: its messages are not a list")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in FIELDS)):
                raise CacheFileError(
                    f"{path} is damaged: message {i} is not a role and a content string"
                )
        return history, messages

    def _check_history(self, path: str | Path, history: list) -> None:
        """Token ids, at least the cached ones, at most one past a full cache (the last
        sampled token is never fed)."""
        for t in history:
            if type(t) is not int:  # not a bool, not 3.0, not "3"
                raise CacheFileError(
                    f"{path} is damaged: history entry {brief(t)} is not a token id"
                )
            if t < 0 or (self.vocab_size is not None and t >= self.vocab_size):
                size = "" if self.vocab_size is None else f" of {self.vocab_size} tokens"
                raise CacheFileError(
                    f"{path} is damaged: token id {brief(t)} is outside the vocabulary{size}"
                )
        cached, room = self.cache.num_tokens, self.cache.capacity + 1
        if len(history) < cached:
            raise CacheFileError(
                f"{path} is damaged: {len(history)} tokens of history for {cached} cached"
            )
        if len(history) > room:
            raise CacheFileError(
                f"{path} holds {len(history)} tokens of history, more than this cache's "
                f"capacity of {self.cache.capacity} (raise --max-context)"
            )
