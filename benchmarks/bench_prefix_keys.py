"""What collision-resistant prefix keys cost at admission: a 4097-token prompt (256 full
blocks of 16), all cached. sha256 chain keys (kvlm.cache.prefix) against the Python tuple
hash they replaced, and the manager's match / admission over the whole chain.

    python benchmarks/bench_prefix_keys.py

Best of 15 rounds of 200 calls, interleaved.
"""

from __future__ import annotations

import timeit

from kvlm.cache.base import CacheSpec
from kvlm.cache.paged import BlockPool
from kvlm.cache.prefix import BlockManager, block_key, root_key

SPEC = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, max_tokens=8192, block_size=16)
TOKENS = [(i * 7919) % 150000 for i in range(4097)]
CHUNKS = [tuple(TOKENS[i * 16 : (i + 1) * 16]) for i in range(256)]


def tuple_hash_chain() -> None:  # the keys before: hash((parent, tokens))
    key = None
    for chunk in CHUNKS:
        key = hash((key, chunk))


def sha256_chain() -> None:
    key = root_key(None)
    for chunk in CHUNKS:
        key = block_key(key, chunk)


def main() -> None:
    manager = BlockManager(BlockPool(SPEC, 300))
    table, _ = manager.allocate(TOKENS)
    manager.seal(table, TOKENS, len(TOKENS))
    assert len(manager.match(TOKENS)[0]) == 256
    manager.free(table)

    def admit() -> None:
        manager.can_admit(TOKENS)
        manager.free(manager.allocate(TOKENS)[0])

    cases = {
        "256 keys, tuple hash (before)": tuple_hash_chain,
        "256 keys, sha256 chain": sha256_chain,
        "match, 256 blocks hit": lambda: manager.match(TOKENS),
        "admission (can_admit + allocate + free)": admit,
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(15):
        for name, fn in cases.items():
            best[name] = min(best[name], timeit.timeit(fn, number=200) / 200)
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e6:.0f} us |")


if __name__ == "__main__":
    main()
