"""What a block pool holds, as plain data: the block map, the prefix tree, the waste.

One description feeds every picture of a pool: `GET /v1/kv` returns it as JSON, the
`/dashboard` page draws it, and kvlm.cache.plots draws the same block map with matplotlib.

    blocks[i] = {id, state, refs, owners, fill, parent, hits, tier}
        state   "used" (referenced by a sequence), "cached" (free, still findable by its
                prefix key), "free"
        owners  the sequences whose tables hold it (shared blocks: several; refs counts them)
        fill    token slots written (a sequence's last block may be partial)
        parent  the block before it in its prefix chain (registered blocks), else None
        hits    admissions that took it from the prefix cache since it was registered
        tier    the tier it was loaded from ("disk", "redis"), else None
    prefix_tree = the registered blocks as nodes under their parents, with the tokens and
                  hits of the path; roots are first blocks of a chain
    waste       slots allocated and not written (partial blocks), in slots and bytes

The block map is group 0's: every layer, or a hybrid model's layers that see everything.
`layer_groups` sums up every layer group of the pool (kvlm.cache.paged: a hybrid model's
windowed layers have a block table and blocks of their own; its conv layers a slot of rows
a sequence, kvlm.cache.conv) with its blocks and bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvlm.cache.paged import BlockPool
from kvlm.cache.slots import Slots


def block_map(
    pool: BlockPool, tables: Mapping[str, Sequence[int]], lengths: Mapping[str, int]
) -> dict:
    """The pool's blocks as seen by the sequences `tables` (owner -> block ids, in order)
    holding `lengths[owner]` tokens."""
    bs = pool.block_size
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    for owner, table in tables.items():
        for i, block in enumerate(table):
            owners.setdefault(block, []).append(owner)
            used = max(0, min(bs, lengths[owner] - i * bs))
            fill[block] = max(fill.get(block, 0), used)
    by_prefix = {pool.prefix.prefix_id[b]: b for b in pool.prefix.cached.values()}
    blocks = []
    for b in range(pool.num_blocks):
        link = pool.prefix.block_parent[b]
        registered = pool.prefix.block_hash[b] is not None
        state = "used" if pool.refs[b] else "cached" if registered else "free"
        parent = None if link is None or link[0] is None else by_prefix.get(link[0])
        blocks.append({
            "id": b, "state": state, "refs": pool.refs[b], "owners": owners.get(b, []),
            "fill": fill.get(b, bs if registered else 0), "parent": parent,
            "hits": pool.prefix.block_hits[b], "tier": pool.prefix.block_tier[b],
        })  # fmt: skip
    slots = sum(bs - blocks[b]["fill"] for b in owners)
    return {
        "block_size": bs,
        "num_blocks": pool.num_blocks,
        "block_bytes": pool.block_nbytes,
        **{state: sum(b["state"] == state for b in blocks) for state in ("used", "cached", "free")},
        "blocks": blocks,
        "prefix_tree": prefix_tree(pool, blocks),
        "waste": {
            "slots": slots,
            "bytes": slots * pool.block_nbytes // bs,
            "fraction": slots / (len(owners) * bs) if owners else 0.0,
        },
    }


def prefix_tree(pool: BlockPool, blocks: list[dict]) -> list[dict]:
    """The registered blocks as a forest: [{block, tokens, hits, refs, children: [...]}],
    roots in block order; `tokens` is the length of the prefix through the node."""
    bs = pool.block_size
    children: dict[int | None, list[int]] = {}
    for b in sorted(pool.prefix.cached.values()):
        children.setdefault(blocks[b]["parent"], []).append(b)

    roots: list[dict] = []
    stack = [(b, 0, roots) for b in reversed(children.get(None, []))]
    while stack:  # iterative: a chain is as deep as the context is long
        b, depth, siblings = stack.pop()
        node = {"block": b, "tokens": (depth + 1) * bs, "hits": blocks[b]["hits"],
                "refs": blocks[b]["refs"], "children": []}  # fmt: skip
        siblings.append(node)
        stack += [(c, depth + 1, node["children"]) for c in reversed(children.get(b, []))]
    return roots


def layer_groups(pool: BlockPool) -> list[dict]:
    """Each layer group of the pool: {group, kind (what its layers keep: kvlm.cache.kinds),
    layers (model layer indices), window (None:
    the whole context), keep (positions a sequence keeps behind its end, None: all),
    num_blocks, used, cached, free, block_bytes, used_bytes, total_bytes}."""
    out = []
    for g, group in enumerate(pool.groups):
        if isinstance(group, Slots):
            out.append(slot_group(g, group))
            continue
        cached = sum(1 for b in group.prefix.cached.values() if group.refs[b] == 0)
        out.append({
            "group": g, "kind": group.group.kind.name, "layers": list(group.group.layers),
            "window": group.window, "keep": group.keep, "num_blocks": group.num_blocks,
            "used": group.num_used, "cached": cached, "free": group.num_free - cached,
            "block_bytes": group.block_nbytes, "used_bytes": group.num_used * group.block_nbytes,
            "total_bytes": group.num_blocks * group.block_nbytes,
        })  # fmt: skip
    return out


def slot_group(g: int, group: Slots) -> dict:
    """A state group (kvlm.cache.slots: a conv group's rows, a DeltaNet group's state) as
    layer_groups gives the others: its "blocks" are slots, one a sequence (`block_bytes` a
    slot's, `used` the sequences holding one), and besides them the end rows it holds of
    group 0's blocks for prefix hits (`blocks_with_rows`, `block_rows_bytes` each; in
    `total_bytes`; none for a DeltaNet group yet)."""
    return {
        "group": g, "kind": group.group.kind.name, "layers": list(group.group.layers),
        "window": None, "keep": group.keep, "num_blocks": group.num_blocks,
        "used": group.num_used, "cached": 0, "free": group.num_free,
        "block_bytes": group.block_nbytes, "used_bytes": group.num_used * group.block_nbytes,
        "total_bytes": group.nbytes, "blocks_with_rows": group.blocks_with_rows,
        "block_rows_bytes": group.block_rows_nbytes,
    }  # fmt: skip
