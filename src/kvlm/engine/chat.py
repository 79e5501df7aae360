"""A conversation that keeps its KV cache between turns.

Each turn renders the whole conversation with the chat template, keeps the longest
prefix the cache already holds, rolls back the rest, and prefills only the new tokens:

    turn 1 cache: [system][user 1][assistant 1 .. last sampled token not yet fed]
    turn 2 ids:   [system][user 1][assistant 1<|im_end|>][user 2][assistant header]
                  |<------ shared, kept ------>|<- rolled back and re-fed from here ->|
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlm.cache import KVCache
from kvlm.engine.generate import Generation
from kvlm.engine.runner import ModelRunner
from kvlm.engine.sampling import SamplingParams
from kvlm.loading.tokenizer import Tokenizer


class ChatSession:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        cache: KVCache,
        params: SamplingParams,
        system: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache = cache
        self.params = params
        self.vocab_size = vocab_size
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.cached_ids: list[int] = []  # exactly the tokens whose K/V the cache holds
        cache.reset()
        self._turn: Generation | None = None

    def send(self, user_text: str) -> Generation:
        """Start a turn; iterate the returned Generation for the reply's text."""
        self._settle()
        self.messages.append({"role": "user", "content": user_text})
        ids = self.tokenizer.encode_chat(self.messages)
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)
        self.cache.rollback(self.cache.num_tokens - min(keep, self.cache.num_tokens))
        self._turn = Generation(
            self.runner, self.tokenizer, self.cache, ids, self.params, vocab_size=self.vocab_size
        )
        return self._turn

    def _settle(self) -> None:
        """Record the previous turn (finished or interrupted) in the history."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        self.cached_ids = turn.tokens[: self.cache.num_tokens]
        self.messages.append({"role": "assistant", "content": turn.output.text})


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
