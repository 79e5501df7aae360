"""A saved cache file read without its model: what `kvlm inspect --cache` prints and draws.

A file (kvlm.cache.files.save_cache) holds the K/V as its layout stores them plus the
metadata that checks them, and nothing of the model: no config, no tokenizer. So
everything here comes from the file alone, through read_cache_file's checks (a damaged
file is a CacheFileError before anything is drawn):

    dense file   values [layers, 2, batch, kv_heads, length, head_dim]   position = column
    window file  values [..., sinks + window, head_dim] + slot_pos       position = slot_pos
                 (ring order; read back here in position order, empty slots dropped)
    groups file  each layer group's tensors, prefixed g0_, g1_, ...: the layers that see
                 everything as a dense file's, each window's layers as a ring (with
                 g{n}_slot_pos); contents() and the pictures are of group 0; the summary
                 names every group (a kvlm-cache/1 `hybrid` file reads as one of two
                 groups, kvlm.cache.files)

A paged or int8 file is dense on disk: a cache re-pages it when it loads, and the file does
not record the block size it was written with. Its block map is the pool it restores into
at the block size the caller names (`--block-size`, 16 by default, as `kvlm generate`),
each row in blocks of its own, exactly as load_cache lays it out (a forked file's rows
come back unshared: the file holds no references).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvlm.cache.base import CacheSnapshot, CacheSpec, blocks_for
from kvlm.cache.factory import create_cache, planned_nbytes
from kvlm.cache.files import RING_KEYS, file_kv_dtypes, read_cache_file
from kvlm.cache.groups import from_layout, layer_kinds
from kvlm.cache.hybrid import group_tensors
from kvlm.cache.paged import PagedCache
from kvlm.cache.storage import CODECS, parts_as

PAGED_MODES = ("paged", "int8")


@dataclass(slots=True)
class SavedCache:
    path: Path
    mode: str
    snap: CacheSnapshot
    fingerprint: str
    extra: dict  # the saver's own: a chat session's token history and messages

    @classmethod
    def read(cls, path: str | Path) -> SavedCache:
        """Every problem with the file is a CacheFileError naming it."""
        snap, meta = read_cache_file(path)
        return cls(Path(path), meta["mode"], snap, meta["fingerprint"], meta["extra"])

    @property
    def quantized(self) -> bool:
        return any(t in CODECS for t in file_kv_dtypes(self.snap.dtype))

    @property
    def groups(self) -> tuple:
        """The layer groups of a `groups` file (kvlm.cache.groups), () for another layout."""
        if self.snap.layout != "groups":
            return ()
        groups = {k: v for k, v in self.snap.extra.items() if k not in RING_KEYS}
        return from_layout(groups, self.snap.geometry["layers"])

    def spec(self, block_size: int = 16) -> CacheSpec:
        """The spec of a cache that holds exactly this file (the pool: its rows' blocks)."""
        s, g, extra = self.snap, self.snap.geometry, self.snap.extra
        sizes = {}
        if s.layout == "window":
            sizes = {"window": extra["window"], "sinks": extra["sinks"]}
            sizes["window_positions"] = "cache" if extra.get("cache_positions") else "absolute"
        if s.layout == "groups":  # each layer's kind, from its group's
            sizes = {"layer_kinds": layer_kinds(self.groups)}
        return CacheSpec(
            num_layers=g["layers"],
            num_kv_heads=g["kv_heads"],
            head_dim=g["head_dim"],
            max_tokens=max(1, s.length),
            batch=s.batch,
            dtype=file_kv_dtypes(s.dtype)[0],
            v_dtype=file_kv_dtypes(s.dtype)[1],
            block_size=block_size,
            num_blocks=max(1, s.batch * blocks_for(s.length, block_size)),
            **sizes,
        )

    def restore(self, block_size: int = 16) -> PagedCache:
        """A paged/int8 file in a cache of its mode, over a pool just large enough."""
        if self.mode not in PAGED_MODES:
            raise ValueError(f"a {self.mode} file has no block pool")
        cache = create_cache(self.mode, self.spec(block_size))
        assert isinstance(cache, PagedCache)
        cache.restore(self.snap)
        return cache

    def block_map(self, block_size: int = 16) -> dict:
        """kvlm.cache.view.block_map of the pool restore() fills, owners "row 0", ..."""
        from kvlm.cache.view import block_map

        cache = self.restore(block_size)
        tables = {f"row {i}": table for i, table in enumerate(cache.tables)}
        return block_map(cache.pool, tables, dict.fromkeys(tables, cache.num_tokens))

    # ------------------------------------------------------------------ contents

    def positions(self) -> torch.Tensor:
        """(T,) the absolute position of each column contents() returns, ascending."""
        if self.snap.layout == "window":
            pos = self.snap.tensors["slot_pos"]
            return pos[pos >= 0].sort().values
        return torch.arange(self.snap.length)

    def _columns(self, t: torch.Tensor) -> torch.Tensor:
        """A stored tensor [..., rows, last] with its rows in position order."""
        if self.snap.layout != "window":
            return t
        pos = self.snap.tensors["slot_pos"]
        held = torch.nonzero(pos >= 0).flatten()
        return t[..., held[pos[held].argsort()], :]

    def contents(self, row: int = 0) -> torch.Tensor:
        """(layers, 2, kv_heads, T, head_dim) fp32: sequence `row`'s K and V as stored
        (int8 and q4 dequantized; their K, and a quantized V, in the rotated basis, which
        keeps norms; window K before RoPE in its default positions, which keeps norms
        too)."""
        parts = {name: t[:, :, row] for name, t in self._stored().items() if t.dim() == 6}
        values = parts_as(parts, *file_kv_dtypes(self.snap.dtype), torch.float32)
        return self._columns(values.float())

    @property
    def int8(self) -> bool:
        """K and V both int8 (the file's per-token step and zero point: `scales`)."""
        return file_kv_dtypes(self.snap.dtype) == (torch.int8, torch.int8)

    def scales(self, row: int = 0) -> torch.Tensor:
        """int8: (layers, 2, kv_heads, T, 2) fp32 step and zero point of each token row."""
        if not self.int8:
            raise ValueError(f"a {self.snap.dtype} file has no int8 scales")
        return self._columns(self._stored()["scales"][:, :, row].float())

    def _stored(self) -> dict[str, torch.Tensor]:
        """The tensors contents() reads: a groups file's group 0's (the layers that see
        everything), another's all."""
        return group_tensors(self.snap.tensors, 0) if self.groups else self.snap.tensors

    # ------------------------------------------------------------------ summary

    def summary(self, block_size: int = 16) -> dict:
        """What `kvlm inspect --cache` prints (and --json gives)."""
        s = self.snap
        spec = self.spec(block_size)
        stored = sum(t.numel() * t.element_size() for t in s.tensors.values())
        info = {
            "path": str(self.path),
            "mode": self.mode,
            "layout": s.layout,
            "dtype": s.dtype,
            "tokens": s.length,
            "held_tokens": len(self.positions()),
            "batch": s.batch,
            "geometry": s.geometry,
            "bytes_per_token": spec.bytes_per_token,
            "stored_bytes": stored,
            "file_bytes": self.path.stat().st_size,
            "restored_bytes": planned_nbytes(self.mode, spec, s.length, s.batch),
            "fingerprint": self.fingerprint,
        }
        if s.extra:
            info["layout_extra"] = s.extra
        if self.groups:
            info["layer_groups"] = [group.described for group in self.groups]
        if self.mode in PAGED_MODES:
            info["block_size"] = block_size
            info["blocks"] = s.batch * blocks_for(s.length, block_size)
        if isinstance(self.extra.get("kind"), str):
            info["saved_by"] = f"{self.extra['kind']} session"
        return info
