"""Pictures of a KV cache (matplotlib): a pool's block map, and a saved cache file.

    block map     one cell per block, ids row by row      +------+------+------+
                  colour: the owner (a band per owner)     | a    | ab 2 | b::  |
                  number: references of a shared block     +------+------+------+
                  ::    : a partial block's unused slots   | grey | free |      |
                  greys : cached (free, still findable by  +------+------+------+
                          its prefix) and free; blue edge: loaded from a KV tier

    a cache file  K and V norms per (layer, head) over positions: where the tokens are
                  and what they hold (sinks, outlier heads); bytes by mode and dtype for
                  its geometry and length; and its mode's own panel: the ring and its sinks
                  (window), per-token scale ranges (int8), the block map (paged, int8)

Drawn from data, never from live objects: the block map from kvlm.cache.view.block_map's
dict (what the server's GET /v1/kv returns and its /dashboard draws, in the same colours),
a file from kvlm.cache.saved. matplotlib is optional: imported when a picture is asked for,
and only its object API (Figure, no pyplot), so no global backend is switched under a
caller that has its own, and nothing is left open between pictures.
"""

from __future__ import annotations

import colorsys
import importlib
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvlm.cache.saved import PAGED_MODES, SavedCache
from kvlm.errors import InvalidRequestError, KvlmError

# The dashboard's greys (kvlm/server/dashboard.html; its owner hues: owner_colours).
FREE, CACHED, UNUSED, TIER_EDGE, NO_OWNER = "#e4e4e4", "#b9b9b9", "#cfd8dc", "#1565c0", "#616161"
DTYPE_COLOURS = {"fp32": "#1f77b4", "bf16": "#ff7f0e", "fp16": "#2ca02c", "int8": "#9467bd",
                 "fp64": "#8c564b"}  # fmt: skip
RED = "#b00020"
SMALL = {"ha": "center", "va": "center", "fontsize": 6}
WIDTH = 11.0  # inches: every picture is 1100 pixels wide at DPI
DPI = 100


def check_output(path: str | Path) -> Path:
    """A picture can be written to `path`: a .png name, matplotlib installed. Callers check
    before their slow work; _save checks again."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise InvalidRequestError(f"pictures are PNG files: name it .png, not {path.name!r}")
    _matplotlib()
    return path


class NoMatplotlib(InvalidRequestError):
    """matplotlib is not installed: a command can still give its text and say this."""


def _matplotlib(module: str = "matplotlib") -> Any:
    """A matplotlib module; without matplotlib, the error that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise NoMatplotlib("pictures need matplotlib: pip install matplotlib") from exc


def _figure(height: float) -> Any:
    figure = _matplotlib("matplotlib.figure").Figure
    return figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")


def _save(fig: Any, path: str | Path, palette: bool = False) -> Path:
    """Write `fig` as a PNG; with `palette`, in 256 colours (Pillow, which matplotlib
    depends on): a cache file's heatmaps are noise to zlib, a quarter of the bytes this way
    with no visible change (SmolLM2's 93-token int8 file: 324 KB -> 87 KB)."""
    path = check_output(path)
    try:
        buffer = io.BytesIO() if palette else path
        fig.savefig(buffer, format="png", dpi=DPI)
        if palette:
            from PIL import Image

            image = Image.open(buffer).convert("RGB")
            image = image.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
            image.save(path, format="PNG", optimize=True)
    except OSError as exc:
        raise KvlmError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human(n: float) -> str:
    """Bytes as a short label: 512 B, 3.5 KiB, 12 MiB, 1.25 GiB."""
    unit, scale = _unit(n)
    return f"{n / scale:.3g} {unit}" if scale > 1 else f"{n:.0f} B"


def _unit(n: float) -> tuple[str, int]:
    """The largest of GiB, MiB, KiB, B that `n` bytes reach, and its size."""
    return next(((u, k) for u, k in UNITS if abs(n) >= k), ("B", 1))


# ---------------------------------------------------------------------- block map


def block_map_png(view: dict, path: str | Path, title: str | None = None) -> Path:
    """The block map of a kvlm.cache.view.block_map dict, alone in one picture."""
    cols, rows = grid_shape(view["num_blocks"])
    fig = _figure(1.6 + rows * (WIDTH - 1) / cols)
    draw_block_map(fig.subplots(), view, title)
    return _save(fig, path)


def grid_shape(num_blocks: int) -> tuple[int, int]:
    """(columns, rows) of the cell grid: 16, 32, 64 ... columns, the fewest that leave at
    most half as many rows (a picture twice as wide as tall, at most)."""
    cols = 16
    while math.ceil(num_blocks / cols) > cols // 2:
        cols *= 2
    return cols, math.ceil(num_blocks / cols)


def owner_colours(view: dict) -> dict[str, tuple[float, float, float]]:
    """A colour per owner sequence, as the dashboard gives it: hues a golden angle apart
    in order of first sight (here: by block id), so neighbours in a run of sequences
    (s8-0, s8-1, ...) never look alike."""
    owners = dict.fromkeys(o for b in view["blocks"] for o in b["owners"])
    return {o: colorsys.hls_to_rgb((i * 137.508) % 360 / 360, 0.46, 0.62)
            for i, o in enumerate(owners)}  # fmt: skip


# How a block's parts are drawn (matplotlib patch keywords).
HATCHED = {"facecolor": UNUSED, "hatch": "////", "edgecolor": "#90a4ae", "linewidth": 0}
ID_TEXT = {"ha": "left", "va": "top", "color": "#455a64"}
REFS_TEXT = {"ha": "center", "va": "center", "color": "white", "weight": "bold"}


def draw_block_map(ax: Any, view: dict, title: str | None = None) -> None:
    n, bs = view["num_blocks"], view["block_size"]
    cols, rows = grid_shape(n)
    colours = owner_colours(view)
    cell = (WIDTH - 1) / cols * 72  # points per cell, for the fonts
    for b in view["blocks"]:
        _draw_block(ax, b, b["id"] % cols + 0.05, b["id"] // cols + 0.05, bs, colours)
        if b["refs"] > 1:
            ax.text(*_at(b, cols, 0.45, 0.47), str(b["refs"]), fontsize=min(11, cell * 0.45),
                    **REFS_TEXT)  # fmt: skip
        elif n <= 64:
            ax.text(*_at(b, cols, 0.06, 0.1), str(b["id"]), fontsize=min(7, cell * 0.3), **ID_TEXT)
    ax.set(xlim=(0, cols), ylim=(rows, 0), aspect="equal", xticks=[], yticks=[])
    ax.set_frame_on(False)
    ax.legend(handles=_block_legend(view, colours), loc="upper center", bbox_to_anchor=(0.5, 0),
              ncol=8, fontsize=8, frameon=False)  # fmt: skip
    waste = view["waste"]
    ax.set_title(
        (f"{title}\n" if title else "")
        + f"{view['used']} used, {view['cached']} cached, {view['free']} free of {n} blocks "
        f"x {bs} tokens ({human(view['block_bytes'])} each); unused slots in partial blocks: "
        f"{waste['slots']} ({waste['fraction']:.0%} of the used blocks' slots)",
        fontsize=10,
    )


def _at(block: dict, cols: int, dx: float, dy: float) -> tuple[float, float]:
    return block["id"] % cols + dx, block["id"] // cols + dy


def _draw_block(
    ax: Any, b: dict, x: float, y: float, block_size: int, colours: dict[str, Any]
) -> None:
    """One cell, 0.9 wide at (x, y): a band per owner (filled to the block's fill, the rest
    hatched), or the grey of its state; a black edge when shared, blue when from a tier."""
    from matplotlib.patches import Rectangle

    # a used block referenced by no table given: drawn (as owner None), not hidden
    owners = (b["owners"] or [None]) if b["state"] == "used" else []
    fill = 0.9 * b["fill"] / block_size
    band = 0.9 / max(1, len(owners))
    split = {"edgecolor": "white", "linewidth": 0.5} if len(owners) > 1 else {"linewidth": 0}
    for k, owner in enumerate(owners):
        colour = NO_OWNER if owner is None else colours[owner]
        ax.add_patch(Rectangle((x, y + k * band), fill, band, facecolor=colour, **split))
        ax.add_patch(Rectangle((x + fill, y + k * band), 0.9 - fill, band, **HATCHED))
    if not owners:
        grey = CACHED if b["state"] == "cached" else FREE
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=grey, linewidth=0))
    edge = TIER_EDGE if b["tier"] else "black" if b["refs"] > 1 else None
    if edge:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor=edge, linewidth=1.5))


def _block_legend(view: dict, colours: dict[str, Any]) -> list[Any]:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=r) for r, c in list(colours.items())[:12]]
    if len(colours) > 12:
        handles.append(Patch(facecolor="white", label=f"+{len(colours) - 12} more owners"))
    handles += [
        Patch(facecolor="white", edgecolor="black", label="shared: number = references"),
        Patch(label="unused slots", **HATCHED),
        Patch(facecolor=CACHED, label="cached (free, prefix kept)"),
        Patch(facecolor=FREE, label="free"),
    ]
    if any(b["tier"] for b in view["blocks"]):
        handles.append(Patch(facecolor="white", edgecolor=TIER_EDGE, label="from a KV tier"))
    return handles


# ---------------------------------------------------------------------- bytes


def memory_png(
    rows: list[dict],
    path: str | Path,
    title: str,
    mark: tuple[str, str] | None = None,
    budget: int | None = None,
) -> Path:
    """Bytes by mode and storage dtype (kvlm.cache.memory.table rows), `mark` = (mode,
    kv_dtype) outlined, `budget` a dashed line where it is within sight of the bars."""
    fig = _figure(4.2)
    draw_bytes(fig.subplots(), rows, title, mark, budget)
    return _save(fig, path)


def with_row(rows: list[dict], mode: str, kv_dtype: str, total_bytes: int) -> list[dict]:
    """`rows` with one for (mode, kv_dtype) added where the table has none (fp16 storage,
    paged bf16 ...), so the bar to mark is there."""
    if any((r["mode"], r["kv_dtype"]) == (mode, kv_dtype) for r in rows):
        return rows
    return [*rows, {"mode": mode, "kv_dtype": kv_dtype, "total_bytes": total_bytes}]


def draw_bytes(
    ax: Any,
    rows: list[dict],
    title: str,
    mark: tuple[str, str] | None = None,
    budget: int | None = None,
    mark_label: str = "this plan",
) -> None:
    """Bars grouped by mode, one per storage dtype the mode has, in one unit (B, KiB, MiB or
    GiB, the largest the tallest bar reaches)."""
    from matplotlib.patches import Patch

    top = max([r["total_bytes"] for r in rows] + [1])
    unit, scale = _unit(top)
    modes: dict[str, list[dict]] = {}
    for r in rows:
        modes.setdefault(r["mode"], []).append(r)
    width = 0.8 / max(len(group) for group in modes.values())
    for i, group in enumerate(modes.values()):
        for j, r in enumerate(group):
            x = i + width * (j - (len(group) - 1) / 2)
            marked = mark == (r["mode"], r["kv_dtype"])
            height = r["total_bytes"] / scale
            outline = {"edgecolor": "black", "linewidth": 2} if marked else {"linewidth": 0}
            colour = DTYPE_COLOURS.get(r["kv_dtype"], "grey")
            ax.bar(x, height, width * 0.92, color=colour, **outline)
            label = human(r["total_bytes"]) + (f"  <- {mark_label}" if marked else "")
            ax.text(x, height + top / scale * 0.01, label, rotation=90, ha="center",
                    va="bottom", fontsize=7, weight="bold" if marked else "normal")  # fmt: skip
    ceiling = top * 1.45
    if budget is not None and 0 < budget <= 2 * top:
        ax.axhline(budget / scale, color=RED, linestyle="--", linewidth=1)
        ax.text(len(modes) - 0.5, budget / scale, f"budget {human(budget)}", color=RED,
                ha="right", va="bottom", fontsize=8)  # fmt: skip
        ceiling = max(ceiling, budget * 1.1)
    ax.set_xticks(range(len(modes)), list(modes))
    ax.set(ylim=(0, ceiling / scale), ylabel=f"KV cache ({unit})", title=title)
    ax.title.set_fontsize(10)
    dtypes = dict.fromkeys(r["kv_dtype"] for r in rows)
    handles = [Patch(color=DTYPE_COLOURS.get(d, "grey"), label=d) for d in dtypes]
    ax.legend(handles=handles, title="storage", fontsize=8, loc="upper left")


# ---------------------------------------------------------------------- a cache file


def cache_png(saved: SavedCache, path: str | Path, block_size: int = 16) -> Path:
    """One picture of a saved cache: the panels its mode has (see the module docstring),
    stacked, each a subfigure of its own height."""
    from kvlm.cache.factory import planned_nbytes
    from kvlm.cache.memory import spec_table

    s, g = saved.snap, saved.snap.geometry
    spec = saved.spec(block_size)
    tokens = max(1, s.length)  # an empty file: the cost of its first token
    rows = with_row(spec_table(spec, tokens, s.batch), saved.mode, s.dtype,
                    planned_nbytes(saved.mode, spec, tokens, s.batch))  # fmt: skip
    title = f"bytes for {s.batch} x {tokens:,} tokens of this geometry, by mode and dtype"
    ring = s.layout == "window"

    def bytes_panel(f: Any) -> None:  # a window's ring beside the bytes
        left, *right = f.subplots(1, 2, width_ratios=[3, 2]) if ring else [f.subplots()]
        draw_bytes(left, rows, title, (saved.mode, s.dtype), None, "this file")
        if ring:
            draw_ring(right[0], saved)

    panels: list[tuple[float, Callable[[Any], None]]] = [
        (3.6, lambda f: _norms(f, saved)),
        (4.6 if ring else 3.6, bytes_panel),
    ]
    if saved.int8:  # the per-token (step, zero) scales
        panels.append((3.2, lambda f: _scales(f, saved)))
    if saved.mode in PAGED_MODES:
        view = saved.block_map(block_size)
        cols, grid_rows = grid_shape(view["num_blocks"])
        height = 1.5 + grid_rows * (WIDTH - 1) / cols
        restored = f"the pool it restores into (--block-size {block_size})"
        panels.append((height, lambda f: draw_block_map(f.subplots(), view, restored)))
    fig = _figure(sum(h for h, _ in panels) + 0.4)
    subs = fig.subfigures(len(panels), 1, height_ratios=[h for h, _ in panels])
    for sub, (_, draw) in zip(subs, panels, strict=True):
        draw(sub)
    fig.suptitle(
        f"{saved.path.name}: --kv {saved.mode}, {s.dtype}, {s.length:,} tokens x {s.batch} "
        f"row{'s' if s.batch > 1 else ''}; {g['layers']} layers x {g['kv_heads']} KV heads "
        f"x {g['head_dim']}",
        fontsize=12,
    )
    return _save(fig, path, palette=True)


def _position_ticks(ax: Any, positions: torch.Tensor) -> None:
    """Column ticks labelled with the absolute positions they hold; a dashed line where
    the positions jump (a window's evicted stretch between its sinks and its ring)."""
    t = len(positions)
    cols = sorted({round(i * (t - 1) / 7) for i in range(8)}) if t > 1 else [0]
    ax.set_xticks(cols, [str(int(positions[c])) for c in cols])
    colour = "white" if ax.images else "grey"
    for c in torch.nonzero(positions.diff() > 1).flatten().tolist():
        ax.axvline(c + 0.5, color=colour, linestyle="--")
        ax.text(c + 0.5, 0.98, " evicted", transform=ax.get_xaxis_transform(), va="top",
                fontsize=7, color=colour)  # fmt: skip
    ax.set_xlabel("position (sequence 0)")


def _norms(fig: Any, saved: SavedCache) -> None:
    from matplotlib.colors import LogNorm

    g = saved.snap.geometry
    layers, heads = g["layers"], g["kv_heads"]
    axes = fig.subplots(1, 2)
    positions = saved.positions()
    if len(positions) == 0:
        return _no_tokens(axes, xticks=[], yticks=[])
    values = saved.contents()  # (L, 2, H, T, D)
    for kv, ax in enumerate(axes):
        norms = values[:, kv].norm(dim=-1).reshape(layers * heads, -1)  # (L*H, T)
        low = norms[norms > 0].min().item() if (norms > 0).any() else 1e-6
        scale = LogNorm(vmin=low, vmax=max(low * 1.01, norms.max().item()))
        image = ax.imshow(norms.numpy(), aspect="auto", interpolation="nearest", cmap="magma",
                          norm=scale)  # fmt: skip
        shown = range(0, layers, max(1, layers // 8))  # at most ~8 layer labels
        ax.set_yticks([i * heads + (heads - 1) / 2 for i in shown], [str(i) for i in shown])
        if heads > 1 and layers <= 48:
            for i in range(1, layers):
                ax.axhline(i * heads - 0.5, color="black", linewidth=0.3)
        _position_ticks(ax, positions)
        ax.set_ylabel(f"layer ({heads} KV head{'s' if heads > 1 else ''} each)")
        ax.set_title(f"|{'KV'[kv]}| per token, layer and head", fontsize=10)
        fig.colorbar(image, ax=ax, fraction=0.04)


def draw_ring(ax: Any, saved: SavedCache) -> None:
    """The window's slots: the ring of W as wedges clockwise from the top, the S sinks as a
    strip inside it, each labelled with the position it holds, the next write marked.

        slot_pos [ s0 .. sS-1 | r0 .. rW-1 ]: position p >= S is in ring slot (p - S) % W,
        so the next token (position n) takes ring slot (n - S) % W, the oldest one's
    """
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle, Wedge

    extra, n = saved.snap.extra, saved.snap.length
    sinks, window = extra["sinks"], extra["window"]
    slot_pos = saved.snap.tensors["slot_pos"].tolist()
    held = [p for p in slot_pos if p >= 0]
    lo, hi = (min(held), max(held)) if held else (0, 1)

    def shade(p: int) -> Any:
        return colormaps["viridis"](0.15 + 0.8 * (p - lo) / max(1, hi - lo)) if p >= 0 else FREE

    every, arc = max(1, math.ceil(window / 32)), 360 / window
    head = n if n < sinks else sinks + (n - sinks) % window  # the slot the next token takes
    for j in range(window):
        p, theta = slot_pos[sinks + j], 90 - j * arc  # slot j spans [theta - arc, theta]
        ax.add_patch(Wedge((0, 0), 1.0, theta - arc, theta, width=0.28, facecolor=shade(p),
                           edgecolor="white", linewidth=0.5))  # fmt: skip
        c, s = math.cos(math.radians(theta - arc / 2)), math.sin(math.radians(theta - arc / 2))
        if j % every == 0 or sinks + j == head:
            ax.text(1.1 * c, 1.1 * s, str(p) if p >= 0 else "-", **SMALL)
        if sinks + j == head:
            ax.annotate(f"next write: position {n}", xy=(c, s), xytext=(1.45 * c, 1.45 * s),
                        ha="center", fontsize=8, color=RED,
                        arrowprops={"arrowstyle": "->", "color": RED})  # fmt: skip
    size = min(0.3, 1.2 / max(1, sinks))
    for i, p in enumerate(slot_pos[:sinks]):  # the sinks: a strip inside, never overwritten
        x = (i - sinks / 2) * size
        ax.add_patch(Rectangle((x, -size / 2), size, size, facecolor="#ff8f00" if p >= 0 else FREE,
                               edgecolor=RED if i == head else "white", linewidth=1.5))  # fmt: skip
        ax.text(x + size / 2, 0, str(p) if p >= 0 else "-", **SMALL)
    ax.text(0, -size / 2 - 0.06, f"{sinks} sinks", ha="center", va="top", fontsize=8)
    ax.set(xlim=(-1.6, 1.6), ylim=(-1.45, 1.6), aspect="equal", xticks=[], yticks=[])
    ax.set_frame_on(False)
    ax.set_title(f"the ring: {window} slots clockwise from the top, newer = lighter\n"
                 f"{n:,} tokens seen, {n - len(held):,} evicted", fontsize=9)  # fmt: skip


def _no_tokens(axes: Any, **settings: Any) -> None:
    """Panels of a file that holds no token: a line saying so."""
    for ax in axes:
        ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes)
        ax.set(**settings)


def _scales(fig: Any, saved: SavedCache) -> None:
    """int8: per position, the spread over layers and heads of each row's step (left) and
    of the interval its 256 codes cover, [zero, zero + 255 step] (right)."""
    left, right = fig.subplots(1, 2)
    if len(saved.positions()) == 0:
        return _no_tokens((left, right))
    s = saved.scales()  # (L, 2, H, T, 2)
    x = torch.arange(s.shape[3]).numpy()
    for kv, colour in ((0, "#1565c0"), (1, "#e65100")):
        step = s[:, kv, ..., 0].flatten(0, 1).clamp_min(2**-14)  # (L*H, T)
        zero = s[:, kv, ..., 1].flatten(0, 1)
        top = zero + 255 * step
        band, line = {"color": colour, "alpha": 0.25, "linewidth": 0}, {"color": colour, "lw": 1}
        name = "KV"[kv]
        left.fill_between(x, step.amin(0), step.amax(0), label=f"{name}: min..max", **band)
        left.plot(x, step.median(0).values, label=f"{name}: median", **line)
        right.fill_between(x, zero.amin(0), top.amax(0), label=f"{name}: widest", **band)
        right.plot(x, zero.median(0).values, label=f"{name}: median", **line)
        right.plot(x, top.median(0).values, **line)
    left.set_yscale("log")
    left.set(ylabel="step (one int8 code)", title="int8 step per token row, over layers and "
             "heads (K rotated)")  # fmt: skip
    right.set(ylabel="value", title="interval the 256 codes cover, [zero, zero + 255 step]")
    for ax in (left, right):
        ax.title.set_fontsize(10)
        _position_ticks(ax, saved.positions())
        ax.legend(fontsize=7, ncol=2)
