"""CUDA graphs for the decode step: one replay per token instead of ~30 launches a layer.

A decode step of a 0.5B model on an H100 is ~1.5 ms of GPU work but, launched op by op from
Python, ~20 ms of CPU time (measured, docs/BENCHMARKS.md "Issue [11]"): the GPU waits on the
launches. A CUDA graph records the step's kernels once and replays them with one call, so
the step costs its GPU time. transformers gets the same from torch.compile's
"reduce-overhead" mode over its static cache; vLLM captures its decode batch per batch size.

A graph replays fixed addresses and shapes, so the captured step reads its inputs from
static tensors (token ids, positions, block tables) copied in before each replay, and
attends over a fixed number of keys, masked past each row's position:

    keys   k0 k1 ... k(p)  k(p+1) ... k(S-1)      S: the row's position rounded up to a
    mask    1  1 ...  1      0    ...   0            power of two (a graph per bucket)

Two layouts, one step (`StaticStep`):
- a contiguous cache (LLM.generate's cache, n rows after a fork): row b writes slot p of
  its own row of the store and reads the view [0, S) of it, no copy;
- the engine's block pool (the server's batch): row b writes block tables[b][p // bs], slot
  p % bs, and reads its blocks gathered through its table (W blocks, W a power of two);
  rows are padded to a power of two, the padding writing into the pool's scratch block
  (BlockPool.scratch), never into a sequence's.

Every row's K/V are written before any row attends (as TableStep does), so a speculative
draft's rows at consecutive positions of one sequence see each other's keys.

Graphs are captured lazily, one per (layout, rows, keys) shape, sharing one memory pool.
`KVLM_CUDA_GRAPHS=0` turns them off (every step eager, as before).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from kvlm.cache.base import KVCache, visible
from kvlm.cache.storage import Store
from kvlm.model.experts import Experts

log = logging.getLogger("kvlm.graphs")

MIN_KEYS = 128  # the smallest key bucket of a contiguous cache
# why a cache or pool of several layer groups (kvlm.cache.groups: a hybrid model's) decodes
# without CUDA graphs: a graph's step reads one store through one table per row, every
# layer with one window (the fused step reads each group through a view of its own)
ONE_GROUP = "the CUDA graphs read one store and one block table per row: one layer group"
# why a model with a mixture of experts decodes without CUDA graphs: a layer off the
# experts' device road (kvlm.model.experts: Experts.stacks; its experts in host memory,
# --cpu-experts, or not dense on the device) reads which experts the router chose on the
# host (torch.unique(...).tolist(), and the hop to the host's experts), a sync no graph
# can hold
EXPERTS = "the experts' routing reads the chosen experts on the host: not capturable"
MAX_ROWS = 256  # batches of more rows run eagerly (a graph per power of two up to this)


def enabled(device: torch.device) -> bool:
    """CUDA graphs for this device: on CUDA unless KVLM_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get("KVLM_CUDA_GRAPHS", "1") != "0"


def why_not(model: torch.nn.Module) -> str | None:
    """None when a decode step of `model` can be captured, else why not (EXPERTS: a
    mixture of experts off the device road)."""
    moes = [m for m in model.modules() if isinstance(m, Experts)]
    return EXPERTS if any(m.host or m.stacks is None for m in moes) else None


def bucket(n: int, low: int, high: int) -> int:
    """The smallest power of two >= n and >= low, capped at high."""
    b = low
    while b < n:
        b *= 2
    return min(b, high)


class StaticStep:
    """The KVStep of a graph-captured decode forward: one token per row, at the positions
    in `positions`, over `n_keys` keys a row (masked past the row's position).

    `tables` None: a contiguous store, row b of the batch is row b of the store. Else the
    pool layout: row b's blocks are tables[b] (W of them, n_keys = W * block size)."""

    is_causal = False
    key_rotation = None
    value_rotation = None
    key_rope_positions = None
    rows = None
    segments = None
    logit_rows = None

    def __init__(
        self,
        store: Store,
        positions: torch.Tensor,
        n_keys: int,
        tables: torch.Tensor | None = None,
        window: int | None = None,
    ) -> None:
        self.values = store.values
        self.pos = positions  # (B,) int64, static
        self.tables = tables  # (B, W) int64, static, or None
        self.n_keys = n_keys
        self.keys = torch.arange(n_keys, device=positions.device)
        self.window = window
        self.mask: torch.Tensor | None = None

    def for_layer(self, layer: int) -> StaticStep:
        return self  # one window for every layer (one layer group: ONE_GROUP)

    def prepare(self) -> None:
        """Build the mask from the static positions (inside the captured forward)."""
        allowed = visible(self.pos[:, None], self.keys[None, :], self.window)  # (B, S)
        self.mask = allowed[:, None, None, :]  # (B, 1, 1, S): over heads and the one query
        if self.tables is not None:
            bs = self.values.shape[4]
            self._write_block = self.tables.gather(1, (self.pos // bs)[:, None])[:, 0]
            self._write_slot = self.pos % bs
        else:
            self._rows = torch.arange(self.pos.shape[0], device=self.pos.device)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, 1, D): stored at each row's position; returns (B, Hkv, S, D)."""
        dtype = self.values.dtype
        out = []
        for kv, x in ((0, k), (1, v)):
            x = x[:, :, 0].to(dtype)  # (B, Hkv, D)
            plane = self.values[layer, kv]
            if self.tables is None:  # (B, Hkv, slots, D): row b, slot pos[b]
                plane[self._rows, :, self.pos] = x
                out.append(plane[: x.shape[0], :, : self.n_keys])
            else:  # (blocks, Hkv, bs, D): block write_block[b], slot write_slot[b]
                plane[self._write_block, :, self._write_slot] = x
                blocks = plane[self.tables]  # (B, W, Hkv, bs, D)
                B, W, H, bs, D = blocks.shape
                out.append(blocks.transpose(1, 2).reshape(B, H, W * bs, D))
        return out[0].to(k.dtype), out[1].to(v.dtype)


class _Graph:
    """One captured decode forward and its static inputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        step: StaticStep,
        ids: torch.Tensor,
        mempool: object,
    ) -> None:
        self.step, self.ids = step, ids
        positions = step.pos[:, None]

        def forward() -> torch.Tensor:
            step.prepare()
            return model(ids, positions, step, prompt=False)[:, -1]

        self.forward = forward
        self.graph = None
        if mempool is None:  # not captured: each replay runs the step (tests on the CPU)
            return

        # A warm-up off the capture (cuBLAS picks and allocates its workspace); it writes
        # the same K/V the first replay writes, into slots this step owns.
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(ids.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.logits = forward()

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits


class GraphDecoder:
    """Captured decode steps of one model, for contiguous caches and for block pools."""

    def __init__(self, model: torch.nn.Module, capture: bool = True) -> None:
        """`capture` False: the same static steps run eagerly (their logic tested on the
        CPU, where there is nothing to capture)."""
        self.model = model
        self.device = model.device
        self.capture = capture
        # one memory pool per layout, a fresh one with each new store: a pool whose graphs
        # are all gone is freed, and cannot be captured into again
        self._mempools: dict[str, object] = {}
        self.captured = 0  # graphs captured (or, not capturing, built)
        self.replays = 0  # decode steps run through them
        self._graphs: dict[tuple, _Graph] = {}
        # the stores the graphs were captured over: a new one drops the old one's graphs
        self._stores: dict[str, Store] = {}

    def _over(self, kind: str, store: Store) -> object:
        """Graphs of `kind` over `store` from now on; returns their memory pool."""
        if self._stores.get(kind) is not store:
            self._graphs = {k: g for k, g in self._graphs.items() if k[0] != kind}
            self._stores[kind] = store
            self._mempools[kind] = torch.cuda.graph_pool_handle() if self.capture else None
        return self._mempools[kind]

    @staticmethod
    def accepts(cache: KVCache) -> bool:
        """A contiguous cache of one layer group (one view: KVCache.kv_views; ONE_GROUP)
        of float K/V in one dtype (quantized or split stores, a hybrid cache's parts and
        the other modes: eager)."""
        views = cache.kv_views(()) if cache.mode == "contiguous" else None
        return views is not None and len(views) == 1 and GraphDecoder.reads(views[0].store)

    @staticmethod
    def reads(store: Store) -> bool:
        return not store.quantized and not store.split

    def _replay(
        self,
        key: tuple,
        store: Store,
        host: tuple[torch.Tensor, ...],
        n_keys: int,
        window: int | None,
    ) -> torch.Tensor:
        """Replay the graph of `key` (captured over `store` on first use) on the inputs
        `host`: token ids (B, 1), positions (B,) and, for the pool, block tables (B, W)."""
        mempool = self._over(key[0], store)
        graph = self._graphs.get(key)
        if graph is None:
            ids, pos, *tables = (h.to(self.device) for h in host)  # static copies
            static = StaticStep(store, pos, n_keys, tables[0] if tables else None, window)
            graph = self._graphs[key] = _Graph(self.model, static, ids, mempool)
            self.captured += 1
        else:
            statics = (graph.ids, graph.step.pos, graph.step.tables)
            for static, h in zip(statics, host, strict=False):
                static.copy_(h)
        self.replays += 1
        return graph.replay()

    def step(self, tokens: Sequence[int], cache: KVCache) -> torch.Tensor:
        """One token per row of a contiguous cache -> logits (B, V); commits the token."""
        store = cache.store
        if cache.would_overflow(1):
            cache.begin(1)  # raises, with the cache's own message
        start, rows = cache.num_tokens, len(tokens)
        n_keys = bucket(start + 1, MIN_KEYS, store.shape[4])
        host = (torch.tensor(tokens, dtype=torch.long)[:, None], torch.full((rows,), start))
        logits = self._replay(
            ("rows", rows, n_keys), store, host, n_keys, cache.spec.sliding_window
        )
        # a contiguous cache wrote the slots in place; commit reads a one-token step's start
        cache.commit(SimpleNamespace(start=start, n_new=1))
        return logits.clone()

    def step_table(
        self,
        store: Store,
        scratch: int,
        tokens: Sequence[int],
        tables: Sequence[list[int]],
        starts: Sequence[int],
        window: int | None,
    ) -> torch.Tensor | None:
        """Rows of a block pool (the engine's decode batch) -> logits (B, V), or None when
        the batch is too big for a graph (the caller runs it eagerly)."""
        n = len(tokens)
        if n > MAX_ROWS:
            return None
        bs = store.shape[4]
        need = (max(starts) + 1 + bs - 1) // bs
        width = bucket(need, 1, max(need, 1 << 30))
        rows = bucket(n, 1, MAX_ROWS)
        padded = [list(t[:width]) + [t[-1]] * (width - len(t[:width])) for t in tables]
        padded += [[scratch] * width] * (rows - n)
        host = (
            torch.tensor(list(tokens) + [0] * (rows - n), dtype=torch.long)[:, None],
            torch.tensor(list(starts) + [0] * (rows - n), dtype=torch.long),
            torch.tensor(padded, dtype=torch.long),
        )
        return self._replay(("pool", rows, width), store, host, width * bs, window)[:n].clone()
