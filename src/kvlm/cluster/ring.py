"""Which replica takes a prefix: consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2016).

    ring:   0 ─── a#3 ── b#0 ── a#1 ──●── b#2 ── a#0 ── b#1 ─── 2**64
                                      │
                              the key's point: walk clockwise, b first, then a

Each replica has POINTS virtual points on a ring of 64-bit hashes; a key's point is its
own hash, and the key's replica is the first one met walking clockwise. So a prefix always
goes to the same replica while the set of replicas stays the same, and a replica that
leaves moves only its own keys. Plain consistent hashing lets one popular prefix bury a
replica; the bound caps each replica at

    cap = max(ceil(c * (in flight + 1) / n), FLOOR)     c = 1.25, n replicas, FLOOR = 4

requests, the new one counted: the walk passes a replica that is at the cap and takes the
next. A replica at the average load is always under the cap (c >= 1), so the walk always
ends. The bound is a trade: a request that spills computes its prefix again on the next
replica, while one more request on its home replica is one more row in a decode batch
that runs 16 by default. Mirrokni's cap alone bites at small loads (2 replicas, 4 in
flight: at most 3 on one): on benchmarks/bench_cluster.py's 8 tenants and 4 clients it
kept a hit rate of 0.51-0.57, no better than round-robin's 0.51. So, as SGLang's router
only balances past an absolute imbalance, a replica holding fewer than FLOOR requests is
never passed over; past that the relative bound holds (32 in flight on 2 replicas: at
most 21 on one). `kvlm serve --route-balance` sets c (docs/BENCHMARKS.md has the runs).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping

POINTS = 64  # virtual points per replica: keys spread evenly over a few replicas
BALANCE = 1.25  # c: a replica takes at most 25% more than its fair share...
FLOOR = 4  # ...once it holds this many requests: below, a prefix always goes home


class HashRing:
    def __init__(self, members: Iterable[str], points: int = POINTS) -> None:
        self.members = tuple(sorted(set(members)))
        ring = sorted((_point(f"{m}#{i}".encode()), m) for m in self.members for i in range(points))
        self._points = [p for p, _ in ring]
        self._owners = [m for _, m in ring]

    def walk(self, key: bytes) -> Iterator[str]:
        """Every member once, clockwise from the key's point."""
        start = bisect.bisect(self._points, _point(key))
        yield from dict.fromkeys(self._owners[start:] + self._owners[:start])

    def pick(
        self, key: bytes, loads: Mapping[str, int], balance: float = BALANCE, floor: int = FLOOR
    ) -> str:
        """The first member clockwise whose load, with this request, stays within the cap."""
        total = sum(loads.get(m, 0) for m in self.members)
        cap = max(math.ceil(balance * (total + 1) / len(self.members)), floor)
        return next(m for m in self.walk(key) if loads.get(m, 0) + 1 <= cap)


def least_loaded(members: Iterable[str], loads: Mapping[str, int], turn: int = 0) -> str:
    """The member with the fewest requests in flight; ties go round in turn."""
    ordered = sorted(members)
    rotated = ordered[turn % len(ordered) :] + ordered[: turn % len(ordered)]
    return min(rotated, key=lambda m: loads.get(m, 0))


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
