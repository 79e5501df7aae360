"""The cache protocol: what every KV cache mode answers, and the per-step view the model sees.

One forward pass goes through a cache like this:

    step = cache.begin(n_new)        # capacity checked here: overflow raises, nothing written
    logits = model(ids, step.positions, step)
        # each layer:  k_all, v_all = step.update(layer, k_new, v_new)
        #              attention(q, k_all, v_all, step.mask, step.is_causal)
    cache.commit(step)               # only now does the cache hold n_new more tokens

If the forward raises, `commit` never runs and the cache holds what it held before (a
layout may have written past its counter, or allocated blocks it keeps; nothing reads them).

A cache holds `batch` sequences of one length, advanced in lockstep: one after a prefill,
n after `fork(n)` (n samples decoding from one prompt). Positions are owned by the cache,
never inferred from tensor contents: the new tokens sit at num_tokens .. num_tokens+n-1.
That one rule makes prefill, decode, chunked prefill and a resumed conversation the same
code path. A cache that stores nothing (`off`) always reports 0 tokens, so its caller
re-feeds the whole sequence.

Beyond the forward: rollback(n), reset(), free(), fork(n), snapshot()/restore(),
save()/load() to a safetensors file, nbytes (exact), and planned_nbytes() (what a cache of
this mode allocates for a workload, the figure `kvlm memory` prints).
"""

from __future__ import annotations

import json
import math
import re
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from kvlm.cache.storage import PARAMS_PER_ROW, Store, itemsize, key_rotation
from kvlm.config import ModelConfig
from kvlm.dtypes import NAMES, dtype_name
from kvlm.errors import CacheOverflowError, InvalidRequestError, KvlmError

CACHE_FILE_FORMAT = "kvlm-cache/1"
WINDOW_POSITIONS = ("cache", "absolute")  # kvlm.cache.window
# The most rows (sequences) a cache file may hold: a fork of one sequence makes at most
# kvlm.engine.sampling.MAX_SAMPLES (a test pins the two together; the cache layer does not
# import the engine).
MAX_FILE_ROWS = 64


class CacheFileError(KvlmError):
    """A cache file that cannot be used here: unreadable, corrupt, or from another model."""


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """The shape of one cache: the model's K/V geometry, how many tokens a sequence may
    hold, and the mode-specific sizes (each mode reads the fields it needs)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int
    batch: int = 1
    dtype: torch.dtype = torch.float32  # storage: fp32, bf16, fp16, or int8 (+ fp16 params)
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable
    # The model's own attention window (Mistral), applied in the mask; not the window cache.
    sliding_window: int | None = None
    block_size: int = 16  # paged: tokens per block
    num_blocks: int | None = None  # paged: pool size (None: room for 8 full-length sequences)
    window: int = 256  # window: recent tokens kept
    sinks: int = 4  # window: first tokens kept forever
    # window: RoPE positions "cache" (counted inside the cache, StreamingLLM; K kept before
    # RoPE) or "absolute" (each token's position in the text); kvlm.cache.window.
    window_positions: str = "cache"

    def __post_init__(self) -> None:
        for name in ("max_tokens", "batch", "block_size", "window"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if self.sinks < 0:
            raise InvalidRequestError(f"sinks must be >= 0, got {self.sinks}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise InvalidRequestError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.window_positions not in WINDOW_POSITIONS:
            raise InvalidRequestError(
                f"unknown window positions {self.window_positions!r}; valid: "
                + ", ".join(WINDOW_POSITIONS)
            )

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        **sizes: int | None,
    ) -> CacheSpec:
        """`sizes`: batch, block_size, num_blocks, window, sinks."""
        return cls(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_tokens=max_tokens,
            dtype=dtype,
            device=torch.device(device),
            sliding_window=config.sliding_window,
            **{k: v for k, v in sizes.items() if v is not None},
        )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, for one sequence, int8 parameters included."""
        per_head = round(self.head_dim * itemsize(self.dtype, self.head_dim))
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def geometry(self) -> dict[str, int]:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


class CacheStep(ABC):
    """One forward's view of a cache: where the new tokens go and what they attend to."""

    def __init__(
        self,
        start: int,
        n_new: int,
        batch: int,
        device: torch.device,
        mask: torch.Tensor | None,
        is_causal: bool,
    ) -> None:
        self.start = start
        self.n_new = n_new
        pos = torch.arange(start, start + n_new, device=device)
        self.positions = pos.expand(batch, n_new)  # (B, T) int64
        self.mask = mask  # (T, S) bool, True = may attend; or None
        self.is_causal = is_causal
        # When set, the keys update() returns are k @ R (int8 caches quantize K in a rotated
        # basis, kvlm.cache.storage) and attention must use q @ R: (qR).(kR) = q.k.
        self.key_rotation: torch.Tensor | None = None
        # When set (S,), update() takes and returns K before RoPE, and the model rotates the
        # returned keys at these positions (the window cache's positions inside the cache).
        self.key_rope_positions: torch.Tensor | None = None
        # When set, the rows see different numbers of keys (the engine's batch of sequences
        # of different lengths, on the CPU): row b's (keys, mask, is_causal), and attention
        # runs over exactly the row's keys, as it would alone (kvlm.model.attention).
        self.rows: list[tuple[int, torch.Tensor | None, bool]] | None = None

    @abstractmethod
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, Hkv, T, D) for `layer`; return all visible (B, Hkv, S, D)."""

    def _draft_rows(self, batch: int) -> None:
        """Make this step of n_new tokens of one sequence n_new rows of one token (a
        speculative draft's check): row i at position start + i, attending over the keys up
        to its own position (`rows`), with no mask, as decoding its token alone would."""
        if batch != 1:
            raise ValueError("a draft check feeds one sequence")
        self.positions = self.positions.reshape(self.n_new, 1)  # (rows, 1)
        self.mask, self.is_causal = None, False
        self.rows = [(self.start + i + 1, None, False) for i in range(self.n_new)]

    def _over(self, store: Store) -> None:
        """This step reads and writes `store`; an int8 store keeps K rotated."""
        if store.quantized:
            self.key_rotation = key_rotation(store.values.shape[-1]).to(store.values.device)

    def _keys_in(self, k: torch.Tensor) -> torch.Tensor:
        """K as the store keeps it (rotated for int8)."""
        return k if self.key_rotation is None else k @ self.key_rotation.to(k.dtype)


class DraftRows:
    """Mixin over a cache step of one sequence: its n_new tokens fed as n_new rows of one
    token (a speculative draft's check), every row's K/V stored by the step's own update
    before any row attends, row i attending over the keys up to its own position
    (CacheStep.rows), as decoding its token alone would."""

    def __init__(self, cache: KVCache, n_new: int) -> None:
        super().__init__(cache, n_new)  # type: ignore[call-arg]
        self._draft_rows(cache.batch)  # type: ignore[attr-defined]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (rows, Hkv, 1, D) -> the sequence's keys (rows, Hkv, S, D)."""
        n = k.shape[0]
        as_seq = [x[:, :, 0].transpose(0, 1)[None] for x in (k, v)]  # (1, Hkv, n, D)
        keys, values = super().update(layer, *as_seq)  # type: ignore[misc]
        return keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1)


class DenseStep(CacheStep):
    """A step whose keys are the sequence's tokens 0 .. start+n_new-1, in order (basic,
    contiguous, paged): the causal mask over positions, in its cheapest exact form."""

    def __init__(self, cache: KVCache, n_new: int) -> None:
        start, spec = cache.num_tokens, cache.spec
        mask, causal = causal_mask(start, n_new, start + n_new, spec.sliding_window, spec.device)
        super().__init__(start, n_new, cache.batch, spec.device, mask, causal)


def causal_mask(
    q_start: int, n_new: int, n_keys: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """Mask for queries at positions q_start.. over keys at positions 0..n_keys-1.

    Returns (mask, is_causal) for scaled_dot_product_attention, taking the cheap forms when
    they are exact. A chunk that continues a prefix needs the explicit form, because SDPA's
    is_causal aligns the triangle top-left:

                 k0 k1 k2 k3 | k4 k5 k6        (k0..k3 cached, k4..k6 this chunk)
            q4 [  1  1  1  1 |  1  0  0 ]
            q5 [  1  1  1  1 |  1  1  0 ]
            q6 [  1  1  1  1 |  1  1  1 ]

    With a model attention window W, key j is visible to query i only if i - j < W.
    """
    if window is None or n_keys <= window:
        if n_new == 1:
            return None, False  # one query sees every key
        if q_start == 0 and n_keys == n_new:
            return None, True  # a fresh prefill: the plain triangle
    q = torch.arange(q_start, q_start + n_new, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed, False  # (T, S) broadcasts over batch and heads


@dataclass(slots=True)
class CacheSnapshot:
    """A cache's contents, detached from it: what snapshot() returns and files hold.

    `layout` says how to read `tensors`: "dense" is values [layers, 2, batch, heads, length,
    head_dim] (and for int8 "scales", [..., length, 2]: step and zero point per token),
    shared by basic, contiguous and paged;
    "window" is the ring as stored plus the position of each slot.
    """

    layout: str
    dtype: str
    length: int
    batch: int
    geometry: dict[str, int]
    tensors: dict[str, torch.Tensor]
    extra: dict[str, int] = field(default_factory=dict)


class KVCache(ABC):
    """A KV cache of one of the modes in kvlm.cache.factory.CACHE_MODES."""

    mode: ClassVar[str]
    layout: ClassVar[str] = "dense"

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self._length = 0
        self.batch = spec.batch

    # ------------------------------------------------------------------ the forward

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V this cache holds (per sequence)."""
        return self._length

    @property
    def capacity(self) -> int:
        """The most tokens one sequence may hold, counting the new ones of a step."""
        return self.spec.max_tokens

    def would_overflow(self, n_new: int) -> bool:
        return self.num_tokens + n_new > self.capacity

    def begin(self, n_new: int) -> CacheStep:
        """Plan a forward of `n_new` tokens per sequence. Raises before anything is written."""
        if n_new <= 0:
            raise InvalidRequestError(f"a forward needs at least one token, got {n_new}")
        if self.would_overflow(n_new):
            raise CacheOverflowError(self._overflow_message(n_new))
        return self._begin(n_new)

    def _overflow_message(self, n_new: int) -> str:
        return (
            f"{self.num_tokens} cached + {n_new} new tokens exceed the cache capacity of "
            f"{self.capacity} tokens (raise --max-context, up to the model's limit)"
        )

    def commit(self, step: CacheStep) -> None:
        """The forward succeeded: the cache now holds the step's tokens."""
        if step.start != self._length:
            raise RuntimeError("commit of a stale cache step")  # a bug, not a user error
        self._commit(step)
        self._length = step.start + step.n_new

    # ------------------------------------------------------------------ lifetime

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens (speculation rejected, a chat turn diverged)."""
        if not 0 <= n <= self._length:
            raise InvalidRequestError(f"cannot roll back {n} of {self._length} cached tokens")
        self._check_rollback(n)
        self._length -= n
        self._truncate(self._length)

    def reset(self) -> None:
        """Empty, keeping the batch and whatever storage the cache owns."""
        self._length = 0
        self._truncate(0)

    def free(self) -> None:
        """Empty and give storage back (blocks to their pool); back to the initial batch."""
        self.reset()
        self._release()
        self.batch = self.spec.batch

    def fork(self, n: int) -> None:
        """Turn each sequence into n that share its prefix (n samples of one prompt).
        Sequence i becomes rows i*n .. i*n + n-1."""
        if n < 1:
            raise InvalidRequestError(f"fork needs n >= 1, got {n}")
        if n > 1:
            self._fork(n)
            self.batch *= n

    # ------------------------------------------------------------------ state

    def snapshot(self) -> CacheSnapshot:
        """A copy of the contents that outlives later writes (restore() brings it back)."""
        tensors = {k: t.clone() for k, t in self._export().items()}
        return CacheSnapshot(
            layout=self.layout,
            dtype=dtype_name(self.spec.dtype),
            length=self._length,
            batch=self.batch,
            geometry=self.spec.geometry(),
            tensors=tensors,
            extra=self._layout_extra(),
        )

    def restore(self, snap: CacheSnapshot) -> None:
        self._check_compatible(snap, "the snapshot")
        self._replace(snap)

    def _replace(self, snap: CacheSnapshot) -> None:
        """Swap the contents for a checked snapshot's."""
        self.free()
        self.batch = snap.batch
        try:
            self._import(snap.tensors, snap.length)
        except CacheOverflowError:  # a block pool without room for the rows: nothing taken
            self.free()
            raise
        self._length = snap.length

    def save(self, path: str | Path, fingerprint: str, extra: dict | None = None) -> None:
        """Write the contents to a safetensors file with what load() needs to check it."""
        from safetensors.torch import save_file

        snap = self.snapshot()
        meta = {
            "format": CACHE_FILE_FORMAT,
            "fingerprint": fingerprint,
            "mode": self.mode,
            "layout": snap.layout,
            "dtype": snap.dtype,
            "length": str(snap.length),
            "batch": str(snap.batch),
            "geometry": json.dumps(snap.geometry),
            "layout_extra": json.dumps(snap.extra),
            "extra": json.dumps(extra or {}),
        }
        tensors = {k: t.contiguous().cpu() for k, t in snap.tensors.items()}
        try:
            save_file(tensors, str(path), metadata=meta)
        except OSError as exc:
            raise CacheFileError(f"cannot write cache file {path}: {exc}") from exc

    def load(self, path: str | Path, fingerprint: str) -> dict:
        """Restore from a file written by save(); returns the caller's `extra` dict.

        Every problem with the file is a CacheFileError naming it, raised before the cache
        changes. Rows cost memory only for the data they hold: an empty file (length 0)
        may not claim more rows than this cache's own batch (read_cache_file caps the rest).
        """
        snap, meta = read_cache_file(path)
        if meta["fingerprint"] != fingerprint:
            raise CacheFileError(
                f"{path} was saved from another model (fingerprint "
                f"{brief(meta['fingerprint'])}, this model {fingerprint})"
            )
        self._check_compatible(snap, str(path))
        if snap.length == 0 and snap.batch > self.spec.batch:
            raise CacheFileError(
                f"{path} holds {snap.batch} empty rows: an empty cache justifies at most "
                f"{self.spec.batch}"
            )
        snap.tensors = {k: t.to(self.spec.device) for k, t in snap.tensors.items()}
        try:
            self._replace(snap)
        except CacheOverflowError as exc:
            raise CacheFileError(f"{path} does not fit: {exc}") from exc
        return meta["extra"]

    def _check_compatible(self, snap: CacheSnapshot, source: str) -> None:
        if snap.layout != self.layout:
            raise CacheFileError(
                f"{source}: a {snap.layout} cache cannot be restored into --kv {self.mode}"
            )
        if snap.dtype != dtype_name(self.spec.dtype):
            raise CacheFileError(
                f"{source} holds {snap.dtype} values but this cache stores "
                f"{dtype_name(self.spec.dtype)} (use the same --kv-dtype)"
            )
        if snap.geometry != self.spec.geometry():
            raise CacheFileError(
                f"{source}: cache shape {snap.geometry} does not match this model's "
                f"{self.spec.geometry()}"
            )
        if snap.extra != self._layout_extra():
            raise CacheFileError(
                f"{source}: cache layout {brief(snap.extra, 80)} does not match this cache's "
                f"{self._layout_extra()}"
            )
        if snap.length > self.capacity:
            raise CacheFileError(
                f"{source} holds {snap.length} tokens, more than this cache's capacity of "
                f"{self.capacity} (raise --max-context)"
            )

    # ------------------------------------------------------------------ accounting

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of K/V storage this cache holds right now (allocated, not just used)."""

    @classmethod
    @abstractmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        """Bytes this mode allocates for `batch` sequences of `tokens` tokens each."""

    # ------------------------------------------------------------------ per-mode hooks

    @abstractmethod
    def _begin(self, n_new: int) -> CacheStep: ...

    @abstractmethod
    def _export(self) -> dict[str, torch.Tensor]:
        """The held contents as raw tensors (views are fine: snapshot() clones)."""

    @abstractmethod
    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Load contents of `length` tokens for `self.batch` rows into an empty cache."""

    @abstractmethod
    def _fork(self, n: int) -> None: ...

    def _commit(self, step: CacheStep) -> None:  # noqa: B027 - most modes write in update()
        pass

    def _truncate(self, length: int) -> None:  # noqa: B027 - a counter move is enough for most
        pass

    def _release(self) -> None:  # noqa: B027 - only pools and growable caches give memory back
        pass

    def _check_rollback(self, n: int) -> None:  # noqa: B027 - every token is kept by most
        pass

    def _layout_extra(self) -> dict[str, int]:
        return {}

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.batch}x{self.num_tokens}/{self.capacity} tokens, "
            f"{self.nbytes} B>"
        )


# ---------------------------------------------------------------------- cache files
#
# A file is checked whole before anything is restored from it: its metadata parsed strictly
# (counts as str(int) writes them, JSON objects of the expected keys and int types), its
# tensors exactly those of its layout, in its dtype and of the shape the metadata implies.
# A shape is only trusted once the tensor holding it is on disk, so a claim of rows costs
# nothing until the file really carries them (see KVCache.load for empty files).

_META_KEYS = (
    "fingerprint",
    "mode",
    "layout",
    "dtype",
    "length",
    "batch",
    "geometry",
    "layout_extra",
    "extra",
)
_FILE_DTYPES = {name: dtype for dtype, name in NAMES.items()}  # fp32 bf16 fp16 int8 fp64
_GEOMETRY = {"layers": 1, "kv_heads": 1, "head_dim": 1}  # key -> least value
_LAYOUT_EXTRA = {"dense": {}, "window": {"sinks": 0, "window": 1}}
# A count as str(int) writes it, under 2**63: int() would also take " 5", "1_0", "٥", "+5".
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,17}")


def read_cache_file(path: str | Path) -> tuple[CacheSnapshot, dict]:
    """Parse and check a cache file; every problem is a CacheFileError with the reason.

    Returns the snapshot and {"fingerprint", "mode", "extra"}; the snapshot's tensors are
    what the file holds, on the CPU. Nothing is read into memory before the metadata and
    the tensor headers check out (a model's weights passed by mistake are not loaded).
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CacheFileError(f"cache file not found: {path}") from None
    except OSError as exc:
        raise CacheFileError(f"{path} is not a readable cache file ({_line(exc)})") from exc
    if not stat.S_ISREG(mode):
        raise CacheFileError(f"{path} is not a file")
    with _readable(path):
        f = safe_open(str(path), framework="pt")
        meta = f.metadata()
    snap, parsed = _parse_metadata(path, meta)
    with _readable(path):
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    _check_shapes(path, snap, shapes)
    with _readable(path):
        snap.tensors = {name: f.get_tensor(name) for name in shapes}
    _check_contents(path, snap)
    return snap, parsed


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """safetensors calls: whatever they raise on a corrupt file becomes a CacheFileError."""
    try:
        yield
    except Exception as exc:  # safetensors raises its own error types, OSError, ...
        raise CacheFileError(f"{path} is not a readable cache file ({_line(exc)})") from exc


def _parse_metadata(path: Path, meta: dict[str, str] | None) -> tuple[CacheSnapshot, dict]:
    """The snapshot the metadata describes (its tensors not read yet), and the rest."""
    from kvlm.cache.factory import CACHE_MODES  # the factory imports this module

    if not meta:
        raise CacheFileError(f"{path} has no metadata: not a kvlm cache file")
    if meta.get("format") != CACHE_FILE_FORMAT:
        raise CacheFileError(
            f"{path} is not a kvlm cache file (format {brief(meta.get('format'))})"
        )
    for key in _META_KEYS:
        if key not in meta:
            raise _bad_meta(path, f"no {key!r}")
    layout, mode, dtype = meta["layout"], meta["mode"], meta["dtype"]
    if layout not in _LAYOUT_EXTRA:
        raise _bad_meta(path, f"layout {brief(layout)} is not one kvlm writes")
    if mode not in CACHE_MODES or mode == "off":
        raise _bad_meta(path, f"mode {brief(mode)} is not one kvlm writes")
    if CACHE_MODES[mode].layout != layout:
        raise _bad_meta(path, f"mode {mode!r} does not write the {layout} layout")
    if dtype not in _FILE_DTYPES:
        raise _bad_meta(path, f"dtype {brief(dtype)} is not one kvlm stores")
    batch = _count(path, meta, "batch")
    if batch > MAX_FILE_ROWS:
        raise _bad_meta(path, f"batch {batch} is more than {MAX_FILE_ROWS} rows")
    snap = CacheSnapshot(
        layout=layout,
        dtype=dtype,
        length=_count(path, meta, "length"),
        batch=batch,
        geometry=_ints(path, "geometry", _json_object(path, meta, "geometry"), _GEOMETRY),
        tensors={},
        extra=_ints(
            path,
            "layout_extra",
            _json_object(path, meta, "layout_extra"),
            _LAYOUT_EXTRA[layout],
            more=layout == "window",  # e.g. "cache_positions": 1, kvlm.cache.window
        ),
    )
    parsed = {"fingerprint": meta["fingerprint"], "mode": mode}
    parsed["extra"] = _json_object(path, meta, "extra")
    return snap, parsed


def _count(path: Path, meta: dict[str, str], key: str) -> int:
    text = meta[key]
    if not _DECIMAL.fullmatch(text):
        raise _bad_meta(path, f"{key} {brief(text)} is not a decimal count")
    n = int(text)
    least = 1 if key == "batch" else 0
    if n < least:
        raise _bad_meta(path, f"{key} {text!r} is less than {least}")
    return n


def _json_object(path: Path, meta: dict[str, str], key: str) -> dict:
    try:
        value = json.loads(meta[key])
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." thousands deep
        raise _bad_meta(path, f"{key} is not JSON ({_line(exc)})") from exc
    if not isinstance(value, dict):
        raise _bad_meta(path, f"{key} is not a JSON object")
    return value


def _ints(
    path: Path, key: str, obj: dict, least: dict[str, int], more: bool = False
) -> dict[str, int]:
    """`obj` holds the keys of `least`, each an int (not a bool, not 2.0) >= its least;
    with `more`, other keys too, each an int >= 0 (a layout's flags, which restore compares
    with the cache's own)."""
    if not set(least) <= set(obj) or (not more and set(obj) != set(least)):
        raise _bad_meta(path, f"{key} has keys {brief(sorted(obj))}, not {sorted(least)}")
    for name, value in obj.items():
        low = least.get(name, 0)
        if type(value) is not int or value < low:
            raise _bad_meta(path, f"{key}.{name} is {brief(value)}, not an integer >= {low}")
    return obj


def _check_shapes(path: Path, snap: CacheSnapshot, shapes: dict[str, tuple[int, ...]]) -> None:
    """Exactly the layout's tensors, of the shape the metadata says:

    values    [layers, 2, batch, kv_heads, rows, head_dim]   rows: length, or S + W
    scales    [layers, 2, batch, kv_heads, rows, 2]          int8 only
    slot_pos  [S + W]                                        window only
    """
    g, extra = snap.geometry, snap.extra
    rows = snap.length if snap.layout == "dense" else extra["sinks"] + extra["window"]
    values = (g["layers"], 2, snap.batch, g["kv_heads"], rows, g["head_dim"])
    want = {"values": values}
    if snap.dtype == "int8":
        want["scales"] = (*values[:-1], PARAMS_PER_ROW)
    if snap.layout == "window":
        want["slot_pos"] = (rows,)
    missing, unexpected = set(want) - set(shapes), set(shapes) - set(want)
    if missing:
        raise _damaged(path, f"missing tensor {min(missing)}")
    if unexpected:
        raise _damaged(path, f"unexpected tensor {brief(min(unexpected))}")
    for name, shape in shapes.items():
        if shape != want[name]:
            raise _damaged(path, f"{name} have shape {shape}, the metadata says {want[name]}")


def _check_contents(path: Path, snap: CacheSnapshot) -> None:
    """Dtypes (values in the file's dtype, fp16 int8 parameters, int64 slot positions),
    finite int8 parameters (one inf step turns a row into NaN; values themselves are data,
    NaN included), and a window's ring."""
    want = {"values": _FILE_DTYPES[snap.dtype], "scales": torch.float16, "slot_pos": torch.int64}
    for name, t in snap.tensors.items():
        if t.dtype != want[name]:
            raise _damaged(path, f"{name} are {dtype_name(t.dtype)}, not {dtype_name(want[name])}")
    if "scales" in snap.tensors and not torch.isfinite(snap.tensors["scales"]).all():
        raise _damaged(path, "int8 scales are not all finite")
    if snap.layout == "window":
        _check_ring(path, snap)


def _check_ring(path: Path, snap: CacheSnapshot) -> None:
    """slot_pos must be a ring kvlm.cache.window could hold at `length` tokens:

    slots [ s0 .. sS-1 | r0 .. rW-1 ]   position p < S in slot p, p >= S in S + (p-S) % W
    held: each sink below length; of the rest at most the last W positions and at
          least the last W - 1 (what a rollback keeps); -1 marks an empty slot.
    """
    sinks, window, n = snap.extra["sinks"], snap.extra["window"], snap.length
    pos = snap.tensors["slot_pos"]
    if ((pos < -1) | (pos >= n)).any():
        raise _damaged(path, f"slot_pos holds positions outside -1 .. {n - 1}")
    slot = torch.nonzero(pos >= 0).flatten()
    p = pos[slot]
    home = torch.where(p < sinks, p, sinks + (p - sinks) % window)
    wrong = torch.nonzero(home != slot).flatten()
    if len(wrong):
        i = int(wrong[0])
        raise _damaged(path, f"slot_pos puts position {int(p[i])} in slot {int(slot[i])}")
    ring = p[p >= sinks]
    evicted = ring[ring < n - window]
    if len(evicted):
        raise _damaged(
            path,
            f"slot_pos holds position {int(evicted.min())}, which the window "
            f"had evicted by position {n}",
        )
    # held positions are distinct (one home slot each), so counting finds a gap
    needed = min(sinks, n) + max(0, n - max(sinks, n - window + 1))
    if int((p < sinks).sum() + (ring >= n - window + 1).sum()) != needed:
        raise _damaged(path, f"slot_pos misses positions the token after {n - 1} attends to")


def _bad_meta(path: Path, what: str) -> CacheFileError:
    return CacheFileError(f"{path} has damaged metadata: {what}")


def _damaged(path: Path, what: str) -> CacheFileError:
    return CacheFileError(f"{path} is damaged: {what}")


def brief(value: object, limit: int = 40) -> str:
    """A value from a file as one short line (repr escapes newlines)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
