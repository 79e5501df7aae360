"""Pictures of a KV cache (kvlm.cache.plots): valid PNGs whose pixels follow the cache.

A picture that drew a constant image, or ignored the data it was given, would pass a "the
file exists" test; these decode every PNG and compare pixels between two caches that differ
in one thing (how many sequences, shared or not, what the tokens hold, how far a ring has
turned). The block map is also checked by area: each state's grey covers as many pixels
as its count of cells says.
"""

from __future__ import annotations

import json

import pytest
import torch
from matplotlib import colors as mcolors
from matplotlib import image as mimage

from kvlm.cache import CacheSpec, create_cache, plots, save_cache
from kvlm.cache.paged import BlockPool, PagedCache
from kvlm.cache.saved import SavedCache
from kvlm.cache.view import block_map
from kvlm.cli import main

SPEC = CacheSpec(
    num_layers=3, num_kv_heads=2, head_dim=8, max_tokens=48, block_size=4, window=8, sinks=2
)
PNG = b"\x89PNG\r\n\x1a\n"


def pixels(path) -> torch.Tensor:
    """The decoded picture (H, W, channels): a PNG, not one flat colour."""
    assert path.read_bytes()[:8] == PNG
    img = torch.from_numpy(mimage.imread(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    # not a constant: the distinct colours, each pixel's 8-bit channels packed in one int
    # (torch.unique over rows sorts the whole image row-wise: seconds for one picture)
    codes = (img.reshape(-1, img.shape[-1]) * 255).round().long()
    packed = (codes << (8 * torch.arange(codes.shape[-1]))).sum(-1)
    assert len(torch.unique(packed)) > 20
    return img


def differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or bool((a != b).any())


def feed(cache, n: int, seed: int, like_position: bool = False) -> None:
    """n tokens per row; with `like_position` every K element of position p is p + 1 (the
    norm picture of position p is then sqrt(D) (p + 1))."""
    g = torch.Generator().manual_seed(seed)
    start = cache.num_tokens
    step = cache.begin(n)
    shape = (cache.batch, SPEC.num_kv_heads, n, SPEC.head_dim)
    for layer in range(SPEC.num_layers):
        k = torch.randn(shape, generator=g) * (layer + 1)
        if like_position:
            k = (torch.arange(start, start + n, dtype=torch.float32) + 1)[:, None].expand(shape)
        step.update(layer, k, torch.randn(shape, generator=g))
    cache.commit(step)


def saved(tmp_path, mode: str, tokens: int, seed: int = 0, fork: int = 1) -> SavedCache:
    cache = create_cache(mode, SPEC)
    feed(cache, tokens, seed)
    cache.fork(fork)
    feed(cache, 1, seed + 1)
    path = tmp_path / f"{mode}-{tokens}-{seed}-{fork}.kv"
    save_cache(cache, path, "fp-test")
    return SavedCache.read(path)


def drawn(tmp_path, file: SavedCache, name: str) -> torch.Tensor:
    return pixels(plots.cache_png(file, tmp_path / f"{name}.png", block_size=4))


# ---------------------------------------------------------------------- block map


def pool_of(sequences: int, shared: bool, tokens: int = 10) -> tuple[BlockPool, dict, dict]:
    """`sequences` of `tokens` (+1) in one 32-block pool: forks of one prompt (its two full
    blocks shared) or separate caches."""
    pool = BlockPool(SPEC, 32)
    caches = [PagedCache(SPEC, pool)]
    if shared:
        feed(caches[0], tokens, 0)
        caches[0].fork(sequences)
    else:
        caches += [PagedCache(SPEC, pool) for _ in range(sequences - 1)]
        for i, c in enumerate(caches):
            feed(c, tokens, i)
    for c in caches:
        feed(c, 1, 9)
    tables = {f"seq{i}/{j}": t for i, c in enumerate(caches) for j, t in enumerate(c.tables)}
    return pool, tables, dict.fromkeys(tables, tokens + 1)


def test_block_map_of_a_known_pool(tmp_path):
    pool, tables, lengths = pool_of(3, shared=True)  # 10 tokens, forked: blocks 0, 1 shared
    view = block_map(pool, tables, lengths)
    blocks = view["blocks"]
    assert view["num_blocks"] == 32 == len(blocks)
    # the two full prompt blocks (ref 3), and per row one block for tokens 8..10: the fork's
    # partial block 2 is written in place by the last row, copied by the others
    assert [b["refs"] for b in blocks[:2]] == [3, 3] and view["used"] == 5
    assert sorted(b["fill"] for b in blocks if b["state"] == "used") == [3, 3, 3, 4, 4]
    assert view["waste"]["slots"] == 3
    img = pixels(plots.block_map_png(view, tmp_path / "map.png", "three samples"))
    cols, rows = plots.grid_shape(32)
    assert (cols, rows) == (16, 2)
    # the free grey covers the area of 27 cells; once two blocks are cached instead, of 25,
    # and the cached grey of 2 (legend swatches are a few pixels against a cell's ~3,000)
    free = colour_pixels(img, plots.FREE)
    pool.prefix.register(5, b"k", (1, 2, 3, 4), None, None)  # two free blocks made findable
    pool.prefix.register(6, b"k2", (5, 6, 7, 8), None, None)
    cached_view = block_map(pool, tables, lengths)
    assert (cached_view["free"], cached_view["cached"]) == (25, 2)
    img2 = pixels(plots.block_map_png(cached_view, tmp_path / "cached.png", "three samples"))
    per_cell = free / 27
    assert colour_pixels(img2, plots.FREE) == pytest.approx(25 * per_cell, rel=0.05)
    assert colour_pixels(img2, plots.CACHED) == pytest.approx(2 * per_cell, rel=0.15)


def colour_pixels(img: torch.Tensor, colour: str) -> int:
    rgb = torch.tensor(mcolors.to_rgb(colour), dtype=img.dtype)
    return int((img[..., :3] - rgb).abs().amax(-1).lt(1 / 255).sum())


@pytest.mark.parametrize(("a", "b"), [((2, False), (5, False)), ((3, False), (3, True))])
def test_block_map_picture_follows_the_pool(tmp_path, a, b):
    """2 vs 5 sequences, separate vs sharing a prompt: different pictures."""
    pictures = []
    for i, (n, shared) in enumerate((a, b)):
        pool, tables, lengths = pool_of(n, shared)
        view = block_map(pool, tables, lengths)
        assert view["used"] == len({b for t in tables.values() for b in t})
        pictures.append(pixels(plots.block_map_png(view, tmp_path / f"{i}.png")))
    assert differ(*pictures)


def test_block_map_draws_partial_blocks_and_tiers(tmp_path):
    pool, tables, lengths = pool_of(1, shared=False, tokens=5)  # 6 tokens: 2 of 4 in block 1
    plain = pixels(plots.block_map_png(block_map(pool, tables, lengths), tmp_path / "a.png"))
    assert colour_pixels(plain, plots.UNUSED) > 0  # the unused half of block 1
    pool.prefix.register(0, b"k", (1, 2, 3, 4), None, None)
    pool.prefix.block_tier[0] = "disk"
    view = block_map(pool, tables, lengths)
    assert view["blocks"][0]["tier"] == "disk"
    tiered = pixels(plots.block_map_png(view, tmp_path / "b.png"))
    assert colour_pixels(tiered, plots.TIER_EDGE) > colour_pixels(plain, plots.TIER_EDGE)


# ---------------------------------------------------------------------- cache files


@pytest.mark.parametrize("mode", ["contiguous", "paged", "int8", "window", "basic"])
def test_cache_file_picture_follows_its_contents(tmp_path, mode):
    one = drawn(tmp_path, saved(tmp_path, mode, 13, seed=0), "one")
    other = drawn(tmp_path, saved(tmp_path, mode, 13, seed=5), "other")
    assert one.shape == other.shape and differ(one, other)  # same layout, other tokens


def test_paged_file_picture_follows_its_rows(tmp_path):
    """2 vs 5 rows of one fork: more owners in the restored pool, and a taller picture."""
    two = saved(tmp_path, "paged", 9, fork=2)
    five = saved(tmp_path, "paged", 9, fork=5)
    view = five.block_map(4)
    assert view["used"] == 5 * 3 and view["num_blocks"] == 15  # 10 tokens: 3 blocks a row
    assert {o for b in view["blocks"] for o in b["owners"]} == {f"row {i}" for i in range(5)}
    assert all(b["refs"] == 1 and b["fill"] == (2 if b["id"] % 3 == 2 else 4)
               for b in view["blocks"])  # fmt: skip
    assert differ(drawn(tmp_path, two, "two"), drawn(tmp_path, five, "five"))


def test_window_file_reads_back_in_position_order(tmp_path):
    cache = create_cache("window", SPEC)
    feed(cache, 7, 0, like_position=True)
    feed(cache, 6, 1, like_position=True)  # 13 tokens: sinks 0, 1 + ring of 8 (5..12)
    save_cache(cache, tmp_path / "w.kv", "fp")
    file = SavedCache.read(tmp_path / "w.kv")
    assert file.positions().tolist() == [0, 1, *range(5, 13)]
    k = file.contents()[:, 0]  # (L, H, T, D): each element of position p is p + 1
    assert torch.equal(k[0, 0, :, 0], file.positions().float() + 1)
    summary = file.summary()
    assert summary["tokens"] == 13 and summary["held_tokens"] == 10
    assert summary["layout_extra"] == {"sinks": 2, "window": 8, "cache_positions": 1}
    ring = drawn(tmp_path, file, "ring")
    feed(cache, 1, 2, like_position=True)  # the ring turns one slot
    save_cache(cache, tmp_path / "w2.kv", "fp")
    assert differ(ring, drawn(tmp_path, SavedCache.read(tmp_path / "w2.kv"), "turned"))


def test_int8_file_scales(tmp_path):
    file = saved(tmp_path, "int8", 11)
    s = file.scales()
    assert s.shape == (3, 2, 2, 12, 2) and (s[..., 0] > 0).all()
    with pytest.raises(ValueError, match="no int8 scales"):
        saved(tmp_path, "paged", 11).scales()


def test_memory_picture_follows_the_plan(tmp_path):
    from kvlm.cache.memory import spec_table

    rows = spec_table(SPEC, 48, 1)
    a = pixels(plots.memory_png(rows, tmp_path / "a.png", "t", ("paged", "fp32"), 10**5))
    b = pixels(plots.memory_png(spec_table(SPEC, 48, 8), tmp_path / "b.png", "t"))
    assert differ(a, b)


def test_without_matplotlib_the_error_names_the_install(tmp_path, monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(Exception, match="pip install matplotlib"):
        plots.check_output(tmp_path / "x.png")


# ---------------------------------------------------------------------- the CLI


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def test_inspect_a_saved_cache(capsys, tmp_path, tiny):
    conv = tmp_path / "conv.kv"
    code, _, err = run_cli(capsys, "generate", "hello there", "--model", tiny, "--kv", "paged",
                           "--max-new-tokens", "6", "--ignore-eos", "--no-chat", "--json",
                           "--save-cache", conv)  # fmt: skip
    assert code == 0, err
    out_png = tmp_path / "conv.png"
    code, out, err = run_cli(capsys, "inspect", "--cache", conv, "--plot", out_png, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["mode"] == "paged" and info["batch"] == 1 and info["saved_by"] == "text session"
    assert info["geometry"] == {"layers": 2, "kv_heads": 2, "head_dim": 16}
    assert info["blocks"] == -(-info["tokens"] // 16) and info["plot"] == str(out_png)
    assert info["stored_bytes"] == info["tokens"] * info["bytes_per_token"]
    pixels(out_png)
    code, out, _ = run_cli(capsys, "inspect", "--cache", conv)  # the text summary
    assert code == 0 and "mode: paged" in out and "stored_bytes:" in out


def test_memory_plot(capsys, tmp_path, tiny):
    out_png = tmp_path / "memory.png"
    code, out, err = run_cli(capsys, "memory", "--model", tiny, "--context", "64", "--kv",
                             "paged", "--kv-dtype", "fp16", "--plot", out_png)  # fmt: skip
    assert code == 0, err
    assert "| window | int8 |" in out and "wrote" in err
    pixels(out_png)


def test_bench_plots_the_block_map_of_its_streams(capsys, tmp_path, tiny):
    code, _, err = run_cli(capsys, "bench", "--model", tiny, "--kv", "paged", "--prompts", "8",
                           "--new-tokens", "4", "--peers", "none", "--streams", "1,3",
                           "--max-context", "40", "--plots", tmp_path)  # fmt: skip
    assert code == 0, err
    pixels(tmp_path / "block_map.png")


def test_stream_throughput_captures_the_busiest_step(tiny):
    from kvlm import LLM
    from kvlm.bench import stream_throughput

    llm = LLM(model=str(tiny), progress=False, max_context=40)
    rows, view = stream_throughput(llm, [2, 3], prompt=8, new=6, capture=True)
    assert [r["streams"] for r in rows] == [2, 3]
    owners = {o for b in view["blocks"] for o in b["owners"]}
    assert owners == {"s3-0/0", "s3-1/0", "s3-2/0"}  # the run of the most streams, all running
    assert view["used"] >= 3
    assert stream_throughput(llm, [2], prompt=8, new=4)[1] is None  # nothing asked


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache", "{tmp}/missing.kv"], "cache file not found"),
        (["--cache", "{tmp}/notes.txt"], "is not a readable cache file"),
        (["--cache", "{tmp}/truncated.kv"], "is not a readable cache file"),
        (["--cache", "{tmp}"], "is not a file"),
        (["--cache", "{tmp}/good.kv", "--plot", "{tmp}/x.jpg"], "name it .png"),
        (["--cache", "{tmp}/good.kv", "--plot", "{tmp}/no/dir/x.png"], "cannot write"),
        (["--cache", "{tmp}/good.kv", "--block-size", "0"], "block_size must be positive"),
        (["--plot", "{tmp}/x.png"], "--plot draws a saved cache"),
    ],
)
def test_inspect_mistakes_end_in_one_line(capsys, tmp_path, args, message):
    cache = create_cache("paged", SPEC)
    feed(cache, 9, 0)
    save_cache(cache, tmp_path / "good.kv", "fp")
    data = (tmp_path / "good.kv").read_bytes()
    (tmp_path / "truncated.kv").write_bytes(data[:-64])
    (tmp_path / "notes.txt").write_text("not a cache\n" * 40)
    code, out, err = run_cli(capsys, "inspect", *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and out == ""
    assert err.startswith("kvlm: error:") and message in err and err.count("\n") == 1
