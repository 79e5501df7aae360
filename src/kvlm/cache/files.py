"""Cache files: a cache's snapshot (KVCache.snapshot) written to a safetensors file with
what is needed to check it, and read back, checked whole, into a cache of the same mode
and shape (KVCache.restore's checks). kvlm.cache.saved reads one alone, for `kvlm inspect`.

Beside the protocol, not inside it: a cache knows nothing of files.

A file names its format, the oldest that reads it (FORMATS): `kvlm-cache/1` holds the
`dense` and `window` layouts, and the `hybrid` layout kvlm wrote for a model of two layer
groups before the `groups` layout (`kvlm-cache/2`: any number of groups, each group's
tensors prefixed `g{n}_`, kvlm.cache.groups.layout_extra). A `hybrid` file is read as
the `groups` snapshot it is (`_as_groups`: its whole layers group 0, its ring group 1).
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvlm.cache.base import CacheFileError, CacheSnapshot, CacheSpec, KVCache, brief
from kvlm.cache.factory import CACHE_MODES, HYBRID_MODES
from kvlm.cache.groups import LayerGroup, from_layout, layer_groups, layout_extra
from kvlm.cache.hybrid import group_prefix
from kvlm.cache.kinds import (
    CONV_ROW_DTYPE,
    RING_SLACK,
    ConvWindow,
    FullAttention,
    RecurrentState,
    SlidingWindow,
    state_dtype,
)
from kvlm.cache.recurrent import CHECKPOINTS, state_layout
from kvlm.cache.storage import CODECS, V_ROTATED, part_layout
from kvlm.dtypes import NAMES, Q4, dtype_name
from kvlm.errors import CacheOverflowError

# Each format and the layouts it holds; a file names the one of its layout
FORMATS = {"kvlm-cache/1": ("dense", "window", "hybrid"), "kvlm-cache/2": ("groups",)}
RING = "ring_"  # the `hybrid` layout's prefix of its ring's tensors
# The most rows (sequences) a cache file may hold: a fork of one sequence makes at most
# kvlm.engine.sampling.MAX_SAMPLES (a test pins the two together; the cache layer does not
# import the engine).
MAX_FILE_ROWS = 64


def save_cache(
    cache: KVCache, path: str | Path, fingerprint: str, extra: dict | None = None
) -> None:
    """Write the cache's contents to a safetensors file with what load_cache() needs to
    check it."""
    from safetensors.torch import save_file

    snap = cache.snapshot()
    meta = {
        "format": next(f for f, layouts in FORMATS.items() if snap.layout in layouts),
        "fingerprint": fingerprint,
        "mode": cache.mode,
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


def load_cache(cache: KVCache, path: str | Path, fingerprint: str) -> dict:
    """Restore `cache` from a file written by save_cache(); returns the caller's `extra` dict.

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
    cache._check_compatible(snap, str(path))
    if snap.length == 0 and snap.batch > cache.spec.batch:
        raise CacheFileError(
            f"{path} holds {snap.batch} empty rows: an empty cache justifies at most "
            f"{cache.spec.batch}"
        )
    snap.tensors = {k: t.to(cache.spec.device) for k, t in snap.tensors.items()}
    try:
        cache._replace(snap)
    except CacheOverflowError as exc:
        raise CacheFileError(f"{path} does not fit: {exc}") from exc
    return meta["extra"]


# ---------------------------------------------------------------------- cache files
#
# A file is checked whole before anything is restored from it: its metadata parsed strictly
# (counts as str(int) writes them, JSON objects of the expected keys and int types), its
# tensors exactly those of its layout, in its dtype and of the shape the metadata implies.
# A shape is only trusted once the tensor holding it is on disk, so a claim of rows costs
# nothing until the file really carries them (see load_cache for empty files).

_META_KEYS = ("fingerprint", "mode", "layout", "dtype", "length", "batch", "geometry",
              "layout_extra", "extra")  # fmt: skip
FILE_DTYPES = {name: dtype for dtype, name in NAMES.items()}  # fp32 bf16 fp16 int8 fp64
_GEOMETRY = {"layers": 1, "kv_heads": 1, "head_dim": 1}  # key -> least value
_LAYOUT_EXTRA = {
    "dense": {},
    "window": {"sinks": 0, "window": 1},
    "hybrid": {"window": 1, "local_layers": 1},  # a bit per ring layer (kvlm-cache/1)
    "groups": {"groups": 2},  # and each group's keys (kvlm.cache.groups.layout_extra)
}
# A `groups` file's keys of --kv window's group 0, a sinks + ring (WindowCache's), beside
# the groups' own
RING_KEYS = ("sinks", "window", "cache_positions")
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
    with _readable(path):
        try:
            if not stat.S_ISREG(path.stat().st_mode):
                raise CacheFileError(f"{path} is not a file")
        except FileNotFoundError:
            raise CacheFileError(f"cache file not found: {path}") from None
        f = safe_open(str(path), framework="pt")
        snap, parsed = _parse_metadata(path, f.metadata())
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        _check_shapes(path, snap, shapes)
        snap.tensors = {name: f.get_tensor(name) for name in shapes}
        _check_contents(path, snap)
    return _as_groups(snap), parsed


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """Whatever the OS or safetensors raise on an unreadable or corrupt file becomes a
    CacheFileError; the checks' own CacheFileErrors pass through."""
    try:
        yield
    except CacheFileError:
        raise
    except Exception as exc:  # safetensors raises its own error types, OSError, ...
        raise CacheFileError(f"{path} is not a readable cache file ({_line(exc)})") from exc


def _parse_metadata(path: Path, meta: dict[str, str] | None) -> tuple[CacheSnapshot, dict]:
    """The snapshot the metadata describes (its tensors not read yet), and the rest."""
    if not meta:
        raise CacheFileError(f"{path} has no metadata: not a kvlm cache file")
    if meta.get("format") not in FORMATS:
        raise CacheFileError(
            f"{path} is not a kvlm cache file (format {brief(meta.get('format'))})"
        )
    for key in _META_KEYS:
        if key not in meta:
            raise _bad_meta(path, f"no {key!r}")
    layout, mode, dtype = meta["layout"], meta["mode"], meta["dtype"]
    if layout not in FORMATS[meta["format"]]:
        raise _bad_meta(path, f"layout {brief(layout)} is not one {meta['format']} holds")
    if mode not in CACHE_MODES or mode == "off":
        raise _bad_meta(path, f"mode {brief(mode)} is not one kvlm writes")
    # --kv window of a model of layer groups: a `groups` file whose group 0 is a sinks + ring
    grouped = (layout in ("hybrid", "groups") and mode in HYBRID_MODES) or (
        layout == "groups" and mode == "window")  # fmt: skip
    if CACHE_MODES[mode].layout != layout and not grouped:
        raise _bad_meta(path, f"mode {mode!r} does not write the {layout} layout")
    if file_kv_dtypes(dtype) is None:
        raise _bad_meta(path, f"dtype {brief(dtype)} is not one kvlm stores")
    batch = _count(path, meta, "batch")
    if batch > MAX_FILE_ROWS:
        raise _bad_meta(path, f"batch {batch} is more than {MAX_FILE_ROWS} rows")
    more = layout in ("window", "groups")  # keys beyond _LAYOUT_EXTRA's
    snap = CacheSnapshot(
        layout=layout,
        dtype=dtype,
        length=_count(path, meta, "length"),
        batch=batch,
        geometry=_ints(path, meta, "geometry", _GEOMETRY),
        tensors={},
        # a window's flags, e.g. "cache_positions": 1 (kvlm.cache.window); each group's keys
        extra=_ints(path, meta, "layout_extra", _LAYOUT_EXTRA[layout], more=more),
    )
    if layout == "groups":
        ring = {k: snap.extra.get(k) for k in _LAYOUT_EXTRA["window"]}  # group 0's ring
        if (mode == "window") != (ring["window"] is not None) or (
            (ring["sinks"] is None) != (ring["window"] is None)
        ):
            raise _bad_meta(path, f"layout_extra: a {mode} cache's groups with ring {ring} "
                                  "(--kv window's group 0 names both, others neither)")  # fmt: skip
        if ring["window"] == 0:
            raise _bad_meta(path, "layout_extra.window is 0, not an integer >= 1")
        _groups(path, snap)
    extra = _json_object(path, meta, "extra")
    return snap, {"fingerprint": meta["fingerprint"], "mode": mode, "extra": extra}


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
    path: Path, meta: dict[str, str], key: str, least: dict[str, int], more: bool = False
) -> dict[str, int]:
    """The JSON object `meta[key]`: the keys of `least`, each an int (not a bool, not 2.0)
    >= its least; with `more`, other keys too, each an int >= 0 (a layout's flags, which
    restore compares with the cache's own)."""
    obj = _json_object(path, meta, key)
    if not set(least) <= set(obj) or (not more and set(obj) != set(least)):
        raise _bad_meta(path, f"{key} has keys {brief(sorted(obj))}, not {sorted(least)}")
    for name, value in obj.items():
        low = least.get(name, 0)
        if type(value) is not int or value < low:
            raise _bad_meta(path, f"{key}.{name} is {brief(value)}, not an integer >= {low}")
    return obj


def _groups(path: Path, snap: CacheSnapshot) -> tuple[LayerGroup, ...]:
    """The layer groups a `groups` file's metadata names (kvlm.cache.groups.from_layout)."""
    groups = {k: v for k, v in snap.extra.items() if k not in RING_KEYS}
    try:
        return from_layout(groups, snap.geometry["layers"])
    except ValueError as exc:
        raise _bad_meta(path, f"layout_extra: {_line(exc)}") from None


def _as_groups(snap: CacheSnapshot) -> CacheSnapshot:
    """A checked `hybrid` snapshot (kvlm-cache/1) as the `groups` one it is: its whole
    layers group 0 (tensors "" -> "g0_"), its ring group 1 ("ring_" -> "g1_")."""
    if snap.layout != "hybrid":
        return snap
    local, layers = snap.extra["local_layers"], snap.geometry["layers"]
    window = SlidingWindow(snap.extra["window"])
    kinds = tuple(window if local >> i & 1 else FullAttention() for i in range(layers))
    spec = CacheSpec(layers, 1, 2, 1, layer_kinds=kinds)
    tensors = {(group_prefix(1) + k[len(RING) :] if k.startswith(RING) else group_prefix(0) + k): t
               for k, t in snap.tensors.items()}  # fmt: skip
    return replace(snap, layout="groups", tensors=tensors, extra=layout_extra(layer_groups(spec)))


def file_kv_dtypes(name: object) -> tuple[torch.dtype, torch.dtype] | None:
    """K's and V's dtypes from a file's dtype: "fp16", or "int8/q4" (K/V); None if it
    names no dtype kvlm stores, in the one spelling kvlm writes (CacheSpec.kv_format: a
    rotated V's mark, "+vrot", only where V is quantized)."""
    if not isinstance(name, str):
        return None
    rotated = name.endswith(V_ROTATED)
    k, _, v = name.removesuffix(V_ROTATED).partition("/")
    if rotated and FILE_DTYPES.get(v or k) not in CODECS:
        return None
    if k not in FILE_DTYPES or (v and (v not in FILE_DTYPES or v == k)):
        return None
    return FILE_DTYPES[k], FILE_DTYPES[v or k]


def _layout(
    path: Path, snap: CacheSnapshot, shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors (shape, dtype) the metadata says the file holds: the stores' parts
    (kvlm.cache.storage.part_layout) of each group of layers, a ring's slot positions, a
    conv group's rows and a DeltaNet group's state (`state_layout`; how many checkpoints
    it holds read from `shapes`, the file's, at most CHECKPOINTS):

    values    [layers, 2, batch, kv_heads, rows, head_dim]   rows: length, or S + W
                                                             (q4: head_dim / 2 bytes)
    scales    [layers, 2, batch, kv_heads, rows, 2]          int8 only
              [layers, 2, batch, kv_heads, rows, head_dim / G]  q4 only (q4_group)
              K and V in two dtypes: k.values, k.scales, v.values, v.scales, each [layers,
              1, ...] in its own
    slot_pos  [S + W]                                        window only
    conv, held                 a conv group's rows (kvlm.cache.conv)
    conv, state, mark_pos,     a DeltaNet group's rows and state, and its M checkpoints'
    mark_state, mark_conv      positions, states and rows (M <= CHECKPOINTS: the shape of
                               mark_pos as the file says it, bounded before any is read)
    """
    g, extra = snap.geometry, snap.extra
    rows = snap.length if snap.layout != "window" else extra["sinks"] + extra["window"]
    layers, heads, d = g["layers"], g["kv_heads"], g["head_dim"]
    # (prefix, layers, rows held, kv heads, head_dim, slot positions too)
    parts = [("", layers, rows, heads, d, snap.layout == "window")]
    if snap.layout == "hybrid":  # the whole layers' rows, then the ring layers' ring
        local = extra["local_layers"]
        ring = bin(local).count("1")
        if local >= 1 << layers or ring == layers:
            raise _bad_meta(path, f"local_layers {local} is not a set of some of {layers} layers")
        parts = [("", layers - ring, rows, heads, d, False),
                 (RING, ring, extra["window"] + RING_SLACK, heads, d, True)]  # fmt: skip
    want = {}
    if snap.layout == "groups":  # each group's rows, or a window's ring of its `keep`
        groups = list(enumerate(_groups(path, snap)))
        parts = [(group_prefix(n), len(group.layers), rows if group.kind.keep is None
                  else group.kind.keep, *group.kind.shape(_Geometry(heads, d)),
                  group.kind.keep is not None)
                 for n, group in groups
                 if not isinstance(group.kind, ConvWindow | RecurrentState)]  # fmt: skip
        if "window" in extra:  # --kv window: group 0 a sinks + ring, as the window layout's
            prefix, n, _, h, dim, _ = parts[0]
            parts[0] = (prefix, n, extra["sinks"] + extra["window"], h, dim, True)
        for n, group in groups:  # a conv group's window a sequence (kvlm.cache.conv)
            if isinstance(kind := group.kind, ConvWindow):
                shape = (len(group.layers), snap.batch, kind.keep, kind.width)
                want[group_prefix(n) + "rows"] = (shape, CONV_ROW_DTYPE)
                want[group_prefix(n) + "held"] = ((1,), torch.int64)
            elif isinstance(kind, RecurrentState):
                prefix = group_prefix(n)
                marks = shapes.get(prefix + "mark_pos", (0,))
                if len(marks) != 1 or marks[0] > CHECKPOINTS:
                    raise _damaged(path, f"{prefix}mark_pos have shape {marks}: at most "
                                         f"{CHECKPOINTS} checkpoints")  # fmt: skip
                sd = state_dtype(file_kv_dtypes(snap.dtype)[0])  # type: ignore[index]
                for name, shape in state_layout(kind, len(group.layers), snap.batch,
                                                marks[0]).items():  # fmt: skip
                    want[prefix + name] = (shape, torch.int64 if name == "mark_pos" else sd)
    k, v = file_kv_dtypes(snap.dtype)
    for prefix, n, held, h, dim, ring in parts:
        if Q4 in (k, v) and dim % 2:
            what = "geometry.head_dim" if dim == d else f"{prefix}head_dim"
            raise _bad_meta(path, f"{what} {dim} is odd: q4 packs two values a byte")
        shape = (n, 2, snap.batch, h, held, dim)
        want.update({prefix + name: sd for name, sd in part_layout(shape, k, v).items()})
        if ring:
            want[prefix + "slot_pos"] = ((held,), torch.int64)
    return want


@dataclass(frozen=True, slots=True)
class _Geometry:
    """A file's geometry as a kind reads it (LayerKind.shape)."""

    num_kv_heads: int
    head_dim: int


def _check_shapes(path: Path, snap: CacheSnapshot, shapes: dict[str, tuple[int, ...]]) -> None:
    """Exactly the layout's tensors (_layout), of the shape the metadata says."""
    want = _layout(path, snap, shapes)
    missing, unexpected = set(want) - set(shapes), set(shapes) - set(want)
    if missing:
        raise _damaged(path, f"missing tensor {min(missing)}")
    if unexpected:
        raise _damaged(path, f"unexpected tensor {brief(min(unexpected))}")
    for name, shape in shapes.items():
        if shape != want[name][0]:
            raise _damaged(path, f"{name} have shape {shape}, the metadata says {want[name][0]}")


def _check_contents(path: Path, snap: CacheSnapshot) -> None:
    """Dtypes (values in the file's dtypes, fp16 int8/q4 parameters, int64 slot
    positions), finite parameters (one inf step turns a row into NaN; values themselves
    are data, NaN included), a window's ring, and a DeltaNet group's state (finite, its
    checkpoints at ascending positions within the tokens held)."""
    want = _layout(path, snap, {k: tuple(t.shape) for k, t in snap.tensors.items()})
    for name, t in snap.tensors.items():
        dtype = want[name][1]
        if t.dtype != dtype:
            raise _damaged(path, f"{name} are {dtype_name(t.dtype)}, not {dtype_name(dtype)}")
        if name.endswith("scales") and not torch.isfinite(t).all():
            raise _damaged(path, f"{snap.dtype} scales are not all finite")
    if snap.layout == "window":
        _check_ring(path, snap, snap.extra["sinks"], snap.extra["window"], "slot_pos")
    if snap.layout == "hybrid":  # a ring of W + RING_SLACK; the next query reads W - 1
        window = snap.extra["window"]
        _check_ring(path, snap, 0, window + RING_SLACK, RING + "slot_pos", window)
    if snap.layout == "groups":  # each window's ring, as the hybrid layout's
        if "window" in snap.extra:  # --kv window's group 0, as the window layout's
            extra = snap.extra
            _check_ring(path, snap, extra["sinks"], extra["window"], group_prefix(0) + "slot_pos")
        for n, group in enumerate(_groups(path, snap)):
            kind = group.kind
            if isinstance(kind, ConvWindow):  # rows held before the end: rows .. keep
                held = int(snap.tensors[group_prefix(n) + "held"][0])
                if not kind.rows <= held <= kind.keep:
                    raise _damaged(path, f"{group_prefix(n)}held {held} is not "
                                         f"{kind.rows} .. {kind.keep}")  # fmt: skip
            elif isinstance(kind, RecurrentState):  # a state is no data: one inf spreads
                prefix = group_prefix(n)
                for name in ("state", "conv", "mark_state", "mark_conv"):
                    if not torch.isfinite(snap.tensors[prefix + name]).all():
                        raise _damaged(path, f"{prefix}{name} are not all finite")
                pos = snap.tensors[prefix + "mark_pos"].tolist()
                if any(not 0 < p <= snap.length for p in pos) or pos != sorted(set(pos)):
                    raise _damaged(path, f"{prefix}mark_pos {brief(pos)} are not ascending "
                                         f"positions in 1 .. {snap.length}")  # fmt: skip
            elif kind.keep is not None:
                name = group_prefix(n) + "slot_pos"
                _check_ring(path, snap, 0, kind.keep, name, kind.window or kind.keep)


def _check_ring(
    path: Path, snap: CacheSnapshot, sinks: int, window: int, name: str, reads: int = 0
) -> None:
    """slot_pos (`name`) must be a ring kvlm.cache.window could hold at `length` tokens:

    slots [ s0 .. sS-1 | r0 .. rW-1 ]   position p < S in slot p, p >= S in S + (p-S) % W
    held: each sink below length; of the rest one run of positions, at most the last W
          and at least the last `reads` - 1 (what the next query reads; `reads` 0: W,
          what a window cache keeps through a rollback); -1 marks an empty slot.
    """
    n, pos = snap.length, snap.tensors[name]
    if ((pos < -1) | (pos >= n)).any():
        raise _damaged(path, f"{name} holds positions outside -1 .. {n - 1}")
    slot = torch.nonzero(pos >= 0).flatten()
    p = pos[slot]
    home = torch.where(p < sinks, p, sinks + (p - sinks) % window)
    wrong = torch.nonzero(home != slot).flatten()
    if len(wrong):
        i = int(wrong[0])
        raise _damaged(path, f"{name} puts position {int(p[i])} in slot {int(slot[i])}")
    ring = p[p >= sinks]
    evicted = ring[ring < n - window]
    if len(evicted):
        raise _damaged(
            path,
            f"{name} holds position {int(evicted.min())}, which the window "
            f"had evicted by position {n}",
        )
    # held positions are distinct (one home slot each), so counting finds a gap
    reads = reads or window
    needed = min(sinks, n) + max(0, n - max(sinks, n - reads + 1))
    if int((p < sinks).sum() + (ring >= n - reads + 1).sum()) != needed:
        raise _damaged(path, f"{name} misses positions the token after {n - 1} attends to")
    # a ring holds one run of positions (a rollback empties its newest slots, no others):
    # a pool reading one with a gap would hold the gap's rows too, unwritten
    if len(ring) and int(ring.max() - ring.min()) + 1 != len(ring):
        raise _damaged(path, f"{name} has a gap in its run of positions")


def _bad_meta(path: Path, what: str) -> CacheFileError:
    return CacheFileError(f"{path} has damaged metadata: {what}")


def _damaged(path: Path, what: str) -> CacheFileError:
    return CacheFileError(f"{path} is damaged: {what}")


def _line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
