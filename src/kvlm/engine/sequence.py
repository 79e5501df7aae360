"""A sequence the scheduler runs: its tokens, how many are in the cache, its block table.

    token_ids:    [ p0 p1 ... p(n-1) | g0 g1 ... g(k-1) ]      prompt, then generated
    num_computed:  tokens whose K/V are in the sequence's blocks

    prefilling:  more than one token pending: the next step feeds a chunk of them
    decoding:    only the last token pending: the next step feeds it, in the decode batch

A step samples a sequence's next token only once all its tokens are computed.

A preempted sequence keeps its tokens and drops its blocks (num_computed = 0); when it is
admitted again it "prefills" prompt and generated tokens alike (recompute), and the
prefix cache usually hands most of its old blocks back.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from kvlm.cache.prefix import BlockTable, TierFetch
from kvlm.engine.request import SampleState
from kvlm.engine.sampling import Sampler

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    sample: SampleState  # tokens, text, stop checks; sample.seq is the token list
    sampler: Sampler
    num_prompt: int
    fan_out: int = 1  # samples still to split off when the prompt's prefill ends
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served by the prefix cache at the last admission
    tiers_asked: bool = False  # the KV tiers were asked for its prompt (kvlm.cache.tiers)
    tier_fetch: TierFetch | None = None  # that lookup, while under way
    table: BlockTable = field(default_factory=BlockTable)
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    turn_start: int | None = None  # a chat prompt's generation prompt's start (add_request)
    # speculative decoding (kvlm.engine.speculative): this step's proposed tokens, fed
    # after the last one at the next positions, and how many to propose next time
    draft: list[int] = field(default_factory=list)
    draft_len: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.sample.seq

    @property
    def num_tokens(self) -> int:
        return len(self.sample.seq)

    @property
    def index(self) -> int:
        return self.sample.out.index

    @property
    def prefilling(self) -> bool:
        return self.num_pending > 1

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next token can be sampled."""
        return self.num_tokens - self.num_computed


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share: runs of PREFIX_RUN compared as slices
    (in C), then the last one token by token (a conversation resent whole shares tens of
    thousands; every request's slot is picked by this, kvlm.server.slots)."""
    n, i = min(len(a), len(b)), 0
    while i + PREFIX_RUN <= n and a[i : i + PREFIX_RUN] == b[i : i + PREFIX_RUN]:
        i += PREFIX_RUN
    return next((j for j in range(i, n) if a[j] != b[j]), n)


PREFIX_RUN = 1024  # common_prefix's slices
