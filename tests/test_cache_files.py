"""Malformed KV-cache files: every one ends in CacheFileError, never another exception, and
a file that loads never makes kvlm allocate more than it justifies.

The allocation rule (kvlm.cache.base): a file's rows are justified by the data it holds.
A file of length >= 1 justifies its `batch` rows, at most MAX_FILE_ROWS (a fork makes at
most MAX_SAMPLES); a cache then costs what its mode's planned_nbytes says for those rows
(contiguous preallocates max_tokens per row, as it would after a fork). A length-0 file
holds no data, so it may claim no more rows than the loading cache's own batch.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from kvlm.cache import CacheFileError, CacheSpec, create_cache, planned_nbytes
from kvlm.cache.files import MAX_FILE_ROWS, load_cache, read_cache_file, save_cache
from kvlm.cache.kinds import FullAttention, SlidingWindow
from kvlm.cache.saved import SavedCache
from kvlm.engine.chat import ChatSession
from kvlm.engine.sampling import MAX_SAMPLES, SamplingParams
from kvlm.errors import CacheOverflowError

SPEC = CacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=8, max_tokens=32, block_size=8, window=6, sinks=2
)
MODES = ["contiguous", "paged", "int8", "window", "basic"]
FP = "fp-test"
# How each valid file is made: (tokens per step, fork into n, tokens rolled back at the end).
VARIANTS = {
    "empty": ((), 1, 0),
    "short": ((5,), 1, 0),
    "forked": ((5, 1), 3, 0),  # the fork happens after the first step
    "long": ((9, 7, 1), 1, 1),  # a window ring that wrapped, then a rollback
}
# A model of three layer groups (kvlm.cache.groups: the whole layer, windows of 1 and 2),
# whose files hold the `groups` layout, and what its caches are fed: its rings (33 and 34
# slots) wrap past 34 tokens
GROUPED = replace(SPEC, num_layers=4, max_tokens=64,
                  layer_kinds=(SlidingWindow(1), SlidingWindow(2), FullAttention(),
                               SlidingWindow(1)))  # fmt: skip
GROUPED_MODES = ["basic", "contiguous", "paged", "int8"]
GROUPED_VARIANTS = {
    "g-empty": ((), 1, 0),
    "g-forked": ((20, 1), 2, 0),
    "g-wrapped": ((30, 9), 1, 1),  # both rings wrapped, then a rollback
}


def kv(n: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def feed(cache, n: int, seed: int) -> None:
    step = cache.begin(n)
    for layer in range(cache.spec.num_layers):
        step.for_layer(layer).update(layer, *kv(n, cache.batch, seed * 10 + layer))
    cache.commit(step)


def filled(mode: str, variant: str, spec: CacheSpec = SPEC):
    steps, fork, back = (VARIANTS | GROUPED_VARIANTS)[variant]
    cache = create_cache(mode, spec)
    for i, n in enumerate(steps):
        feed(cache, n, seed=i)
        if i == 0:
            cache.fork(fork)
    cache.rollback(back)
    return cache


@functools.cache
def valid_file(
    mode: str, variant: str, spec: CacheSpec = SPEC
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of a file a real cache wrote (copy before changing)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.kv"
        save_cache(filled(mode, variant, spec), path, FP, extra={"note": "hi"})
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def write(path: Path, meta: dict[str, str] | None, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata=meta)
    return path


def edited(tmp_path: Path, mode: str, variant: str = "short", /, **changes: str | None) -> Path:
    """A valid file with some metadata values replaced (None deletes the key)."""
    meta, tensors = valid_file(mode, variant)
    meta = {**meta, **changes}
    meta = {k: v for k, v in meta.items() if v is not None}
    return write(tmp_path / "c.kv", meta, tensors)


def with_tensors(tmp_path: Path, mode: str, variant: str = "short", /, **tensors) -> Path:
    """A valid file with some tensors replaced (None drops one)."""
    meta, old = valid_file(mode, variant)
    new = {**old, **tensors}
    return write(tmp_path / "c.kv", meta, {k: t for k, t in new.items() if t is not None})


def refused(path: Path, match: str, mode: str = "contiguous", spec: CacheSpec = SPEC) -> None:
    with pytest.raises(CacheFileError, match=match) as info:
        load_cache(create_cache(mode, spec), path, FP)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------- valid files


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_valid_files_load_as_before(tmp_path, mode, variant):
    src = filled(mode, variant)
    path = tmp_path / "c.kv"
    save_cache(src, path, FP, extra={"note": "hi"})
    dst = create_cache(mode, SPEC)
    assert load_cache(dst, path, FP) == {"note": "hi"}
    assert (dst.num_tokens, dst.batch, dst.nbytes) == (src.num_tokens, src.batch, src.nbytes)
    for name, t in src.snapshot().tensors.items():
        assert torch.equal(dst.snapshot().tensors[name], t), name
    if src.num_tokens:  # and both continue alike
        feed(src, 1, seed=7)
        feed(dst, 1, seed=7)
        assert torch.equal(dst.snapshot().tensors["values"], src.snapshot().tensors["values"])


@pytest.mark.parametrize("mode", GROUPED_MODES)
@pytest.mark.parametrize("variant", GROUPED_VARIANTS)
def test_grouped_files_load_as_before_into_each_grouped_mode(tmp_path, mode, variant):
    """A model of three layer groups: its file (the `groups` layout, kvlm-cache/2) loads
    into a cache of its mode, and into the other modes of its dtype (a ring and a
    windowed block table export alike), exactly, and each goes on as the writer does."""
    src = filled(mode, variant, GROUPED)
    path = tmp_path / "c.kv"
    save_cache(src, path, FP, extra={"note": "hi"})
    with safe_open(str(path), framework="pt") as f:
        meta, names = f.metadata(), set(f.keys())
    assert (meta["format"], meta["layout"]) == ("kvlm-cache/2", "groups")
    assert {n[:3] for n in names} == {"g0_", "g1_", "g2_"}
    same_dtype = ["int8"] if mode == "int8" else ["basic", "contiguous", "paged"]
    want = src.snapshot().tensors
    for other in same_dtype:
        dst = create_cache(other, GROUPED)
        assert load_cache(dst, path, FP) == {"note": "hi"}
        assert (dst.num_tokens, dst.batch) == (src.num_tokens, src.batch)
        held = dst.snapshot().tensors
        assert held.keys() == want.keys()
        assert all(torch.equal(*held_slots(held, want, k)) for k in want), other
    if src.num_tokens:  # and the one of its mode goes on as the writer does
        feed(src, 1, seed=7)
        dst = create_cache(mode, GROUPED)
        load_cache(dst, path, FP)
        feed(dst, 1, seed=7)
        after = src.snapshot().tensors
        assert all(torch.equal(dst.snapshot().tensors[k], t) for k, t in after.items())


def held_slots(a: dict, b: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor `name` of two `groups` snapshots, a ring's cut to the slots that hold a
    position (an empty slot's values are whatever the cache left there)."""
    prefix = re.match(r"(g\d+_)?", name).group()
    pos = a.get(prefix + "slot_pos") if prefix else None
    if pos is None or name.endswith("slot_pos"):
        return a[name], b[name]
    slots = torch.nonzero(pos >= 0).flatten()
    return a[name][:, :, :, :, slots], b[name][:, :, :, :, slots]


# Files kvlm wrote before the groups layout (kvlm-cache/1, layout `hybrid`: one window and
# the whole layers), as kvlm at 80b6b6d wrote them, by tests/data/make_hybrid_files.py:
# a contiguous cache (fp32, forked into two rows) and an int8 pool's, 41 tokens of
# OLD_SPEC, its ring of 4 + 32 slots wrapped
DATA = Path(__file__).parent / "data"
OLD_KINDS = (SlidingWindow(4), SlidingWindow(4), FullAttention(), SlidingWindow(4))
OLD_SPEC = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, max_tokens=64, block_size=8,
                     layer_kinds=OLD_KINDS)  # fmt: skip


def old_fed(mode: str):
    """What make_hybrid_files.py fed its cache, fed to today's cache of `mode`."""
    cache = create_cache(mode, OLD_SPEC)
    for i, n in enumerate((38, 3)):
        g = torch.Generator().manual_seed(i + 1)
        step = cache.begin(n)
        for layer in range(4):
            k, v = (torch.randn(cache.batch, 2, n, 8, generator=g) for _ in range(2))
            step.for_layer(layer).update(layer, k, v)
        cache.commit(step)
        if i == 0 and mode == "contiguous":
            cache.fork(2)
    return cache


@pytest.mark.parametrize(
    ("name", "modes"),
    [("hybrid-contiguous.kv", ["contiguous", "paged", "basic"]), ("hybrid-int8.kv", ["int8"])],
)
def test_hybrid_files_of_kvlm_cache_1_still_load(name, modes):
    """A `hybrid` file of kvlm-cache/1 reads as the `groups` snapshot it is (its whole
    layers group 0, its ring group 1) and loads into today's caches of its dtype: each then
    holds exactly what today's cache fed the same K/V holds, and goes on alike. The int8
    file's V is plain, today's int8 V rotated: refused in one line, never misread."""
    path = DATA / name
    with safe_open(str(path), framework="pt") as f:
        assert (f.metadata()["format"], f.metadata()["layout"]) == ("kvlm-cache/1", "hybrid")
    saved = SavedCache.read(path)
    assert saved.snap.layout == "groups" and saved.spec().layer_kinds == OLD_SPEC.layer_kinds
    assert [g["layers"] for g in saved.summary()["layer_groups"]] == [[2], [0, 1, 3]]
    if modes == ["int8"]:  # its V plain: today's int8 V is stored rotated (value_rotation)
        with pytest.raises(CacheFileError, match=r"holds int8 values but this cache stores "
                                                 r"int8\+vrot"):  # fmt: skip
            load_cache(create_cache("int8", OLD_SPEC), path, "fp-old")
        return
    for mode in modes:
        made, loaded = old_fed(modes[0]), create_cache(mode, OLD_SPEC)
        assert load_cache(loaded, path, "fp-old") == {"made_by": "kvlm 80b6b6d"}
        assert (loaded.num_tokens, loaded.batch) == (41, made.batch)
        want = made.snapshot().tensors
        assert loaded.snapshot().tensors.keys() == want.keys()
        assert all(torch.equal(loaded.snapshot().tensors[k], t) for k, t in want.items())
        feed(made, 1, seed=7)
        feed(loaded, 1, seed=7)
        want = made.snapshot().tensors
        assert all(torch.equal(loaded.snapshot().tensors[k], t) for k, t in want.items())


def test_the_row_bound_is_the_most_samples_a_fork_makes():
    assert MAX_FILE_ROWS == MAX_SAMPLES


# ---------------------------------------------------------------------- the named gaps


@pytest.mark.parametrize("mode", ["contiguous", "window"])
def test_negative_length_is_refused(tmp_path, mode):
    refused(edited(tmp_path, mode, length="-1"), "length '-1' is not a decimal count", mode)


def test_a_huge_batch_of_empty_rows_allocates_nothing(tmp_path):
    meta, _ = valid_file("contiguous", "empty")
    shape = (2, 2, 10**6, 2, 0, 8)  # zero elements, whatever the batch
    path = write(tmp_path / "c.kv", {**meta, "batch": str(10**6)}, {"values": torch.zeros(shape)})
    refused(path, "batch 1000000 is more than 64 rows")
    shape = (2, 2, 2, 2, 0, 8)
    path = write(tmp_path / "c.kv", {**meta, "batch": "2"}, {"values": torch.zeros(shape)})
    refused(path, "2 empty rows: an empty cache justifies at most 1")
    meta, tensors = valid_file("window", "empty")  # a window file's rows are whole rings
    values = tensors["values"].repeat(1, 1, 2, 1, 1, 1)
    path = write(tmp_path / "w.kv", {**meta, "batch": "2"}, {**tensors, "values": values})
    refused(path, "2 empty rows: an empty cache justifies at most 1", "window")


def test_rows_with_data_are_bounded_too(tmp_path):
    meta, tensors = valid_file("contiguous", "short")
    values = tensors["values"].repeat(1, 1, MAX_FILE_ROWS + 1, 1, 1, 1)
    path = write(tmp_path / "c.kv", {**meta, "batch": str(MAX_FILE_ROWS + 1)}, {"values": values})
    refused(path, "more than 64 rows")


def test_a_paged_pool_without_room_for_the_file_is_refused_and_keeps_its_blocks(tmp_path):
    path = tmp_path / "c.kv"
    save_cache(filled("paged", "forked"), path, FP)  # 3 rows of 6 tokens: 3 blocks
    small = replace(SPEC, num_blocks=2)
    cache = create_cache("paged", small)
    refused(
        path, "does not fit: 3 rows of 6 tokens need 3 blocks, the pool has 2 free", "paged", small
    )
    with pytest.raises(CacheFileError):
        load_cache(cache, path, FP)
    assert cache.pool.num_free == 2 and (cache.num_tokens, cache.batch) == (0, 1)


def test_window_file_without_slot_pos_is_refused(tmp_path):
    refused(with_tensors(tmp_path, "window", slot_pos=None), "missing tensor slot_pos", "window")


@pytest.mark.parametrize(
    ("variant", "slot_pos", "match"),
    [
        ("short", torch.tensor([0, 1, 2, 3, 4, -1, -1, -1], dtype=torch.int32), "int32"),
        ("short", torch.tensor([0, 1, 2, 3, 4, -1, -1]), r"shape \(7,\)"),
        ("short", torch.tensor([[0, 1, 2, 3, 4, -1, -1, -1]]), r"shape \(1, 8\)"),
        ("short", torch.tensor([0, 1, 2, 3, 4, -1, -1, -2]), "outside -1 .. 4"),
        ("short", torch.tensor([0, 1, 2, 3, 5, -1, -1, -1]), "outside -1 .. 4"),
        ("short", torch.tensor([0, 1, 2, 3, 4, 4, -1, -1]), "position 4 in slot 5"),
        ("short", torch.tensor([0, 1, 2, 3, -1, 4, -1, -1]), "position 4 in slot 5"),
        ("short", torch.tensor([0, 1, 2, -1, 4, -1, -1, -1]), "misses positions"),
        ("short", torch.tensor([0, -1, 2, 3, 4, -1, -1, -1]), "misses positions"),
        ("long", torch.tensor([0, 1, 14, 15, 16, 11, 12, 13]), "outside -1 .. 15"),
        ("long", torch.tensor([0, 1, 14, 15, 4, 11, 12, 13]), "position 4, which the window"),
        ("long", torch.tensor([0, 1, 14, 15, 10, 11, 12, 13]), None),  # 10..15: the last W
    ],
)
def test_bad_slot_pos_is_refused(tmp_path, variant, slot_pos, match):
    path = with_tensors(tmp_path, "window", variant, slot_pos=slot_pos)
    if match is None:
        load_cache(create_cache("window", SPEC), path, FP)
    else:
        refused(path, match, "window")


def test_window_length_must_agree_with_the_ring(tmp_path):
    # "long": 17 tokens, rolled back to 16: sinks 0, 1 and the ring 11..15 (16 was dropped)
    assert valid_file("window", "long")[1]["slot_pos"].tolist() == [0, 1, 14, 15, -1, 11, 12, 13]
    refused(edited(tmp_path, "window", "long", length="15"), "outside -1 .. 14", "window")
    refused(edited(tmp_path, "window", "long", length="17"), "misses positions", "window")
    refused(edited(tmp_path, "window", "long", length=str(10**17)), "evicted", "window")


def chat_file(tmp_path: Path, extra: dict, variant: str = "short") -> Path:
    path = tmp_path / "chat.kv"
    save_cache(filled("contiguous", variant), path, FP, extra=extra)
    return path


def session(vocab_size: int | None = 100, use_template: bool = True) -> ChatSession:
    # load() needs neither a model nor a tokenizer: only the engine's cache
    cache = create_cache("contiguous", SPEC)
    engine = SimpleNamespace(tokenizer=None, backend=SimpleNamespace(cache=cache))
    return ChatSession(
        engine,  # type: ignore[arg-type]
        SamplingParams(),
        vocab_size=vocab_size,
        use_template=use_template,
    )


CHAT = {"kind": "chat", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({**CHAT, "history": [1, 2, "3", 4, 5, 6]}, "history entry '3' is not a token id"),
        ({**CHAT, "history": [1, 2, 3.5, 4, 5, 6]}, "history entry 3.5 is not a token id"),
        ({**CHAT, "history": [1, 2, True, 4, 5, 6]}, "history entry True is not a token id"),
        ({**CHAT, "history": [1, 2, -3, 4, 5, 6]}, "token id -3 is outside the vocabulary"),
        ({**CHAT, "history": [1, 2, 100, 4, 5, 6]}, "token id 100 is outside the vocabulary"),
        ({**CHAT, "history": [1, 2, 3, 4]}, "4 tokens of history for 5 cached"),
        ({**CHAT, "history": list(range(34))}, "34 tokens of history, more than"),
        ({**CHAT, "history": "1 2 3 4 5"}, "has no token history"),
        ({**CHAT, "history": [1, 2, 3, 4, 5], "messages": "hi"}, "messages are not a list"),
        ({**CHAT, "history": [1, 2, 3, 4, 5], "messages": [["user", "hi"]]}, "message 0 is"),
        ({"kind": "chat", "history": [1, 2, 3, 4, 5]}, "messages are not a list"),
        (
            {**CHAT, "history": [1, 2, 3, 4, 5], "messages": [{"role": "user", "content": 3}]},
            "message 0 is",
        ),
    ],
)
def test_bad_conversations_are_refused(tmp_path, extra, match):
    path = chat_file(tmp_path, extra)
    chat = session()
    with pytest.raises(CacheFileError, match=match) as info:
        chat.load(path, FP)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert chat.cache.num_tokens == 0 and chat.history == []  # nothing half-loaded


def test_a_conversation_is_one_sequence(tmp_path):
    path = chat_file(tmp_path, {**CHAT, "history": [1] * 7}, variant="forked")
    with pytest.raises(CacheFileError, match="holds 3 sequences; a conversation is one"):
        session().load(path, FP)


def test_a_good_conversation_loads(tmp_path):
    path = chat_file(tmp_path, {**CHAT, "history": [1, 2, 3, 4, 5, 99]})
    chat = session()
    chat.load(path, FP)
    assert (chat.history, chat.messages, chat.cache.num_tokens) == (
        [1, 2, 3, 4, 5, 99],
        CHAT["messages"],
        5,
    )
    session(vocab_size=None).load(chat_file(tmp_path, {**CHAT, "history": [10**6] * 5}), FP)


# ---------------------------------------------------------------------- metadata


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("length", "1e3", "length '1e3' is not a decimal count"),
        ("length", " 5", "length ' 5' is not a decimal count"),
        ("length", "0x10", "length '0x10' is not a decimal count"),
        ("length", "05", "length '05' is not a decimal count"),
        ("length", "5_0", "is not a decimal count"),
        ("length", "\u0665", "is not a decimal count"),  # an Arabic-Indic 5: int() takes it
        ("length", "9" * 40, "is not a decimal count"),
        ("length", "6", r"values have shape \(2, 2, 1, 2, 5, 8\), the metadata says"),
        ("length", "31", r"the metadata says \(2, 2, 1, 2, 31, 8\)"),
        ("batch", "0", "batch '0' is less than 1"),
        ("batch", "-1", "batch '-1' is not a decimal count"),
        ("geometry", '{"layers": 0, "kv_heads": 2, "head_dim": 8}', "geometry.layers is 0"),
        ("geometry", '{"layers": 2, "kv_heads": -2, "head_dim": 8}', "geometry.kv_heads is -2"),
        ("geometry", '{"layers": 2.0, "kv_heads": 2, "head_dim": 8}', "geometry.layers is 2.0"),
        ("geometry", '{"layers": true, "kv_heads": 2, "head_dim": 8}', "geometry.layers is True"),
        ("geometry", '{"layers": "2", "kv_heads": 2, "head_dim": 8}', "geometry.layers is '2'"),
        ("geometry", '{"layers": 2, "kv_heads": 2}', "geometry has keys"),
        ("geometry", "[2, 2, 8]", "geometry is not a JSON object"),
        ("geometry", '"2x2x8"', "geometry is not a JSON object"),
        ("geometry", "{layers: 2}", "geometry is not JSON"),
        pytest.param("geometry", "[" * 100_000, "geometry is not JSON", id="geometry-deep"),
        ("layout_extra", "[]", "layout_extra is not a JSON object"),
        ("layout_extra", '{"sinks": 2}', "layout_extra has keys"),
        ("extra", "null", "extra is not a JSON object"),
        ("extra", '"note"', "extra is not a JSON object"),
        ("dtype", "fp8", "dtype 'fp8' is not one kvlm stores"),
        ("dtype", "float32", "dtype 'float32' is not one kvlm stores"),
        ("layout", "ring", "layout 'ring' is not one kvlm-cache/1 holds"),
        ("mode", "nope", "mode 'nope' is not one kvlm writes"),
        ("mode", "window", "mode 'window' does not write the dense layout"),
        ("length", None, "no 'length'"),
        ("fingerprint", None, "no 'fingerprint'"),
        ("format", None, "not a kvlm cache file"),
    ],
)
def test_bad_metadata_is_refused(tmp_path, key, value, match):
    refused(edited(tmp_path, "contiguous", **{key: value}), match)


def test_window_layout_extra_must_be_counts(tmp_path):
    bad = '{"sinks": 2, "window": 0}'
    refused(edited(tmp_path, "window", layout_extra=bad), "layout_extra.window is 0", "window")
    bad = '{"sinks": -1, "window": 7}'
    refused(edited(tmp_path, "window", layout_extra=bad), "layout_extra.sinks is -1", "window")
    bad = '{"sinks": 2, "window": 6, "flag": "yes"}'  # a layout's flags are ints too
    refused(edited(tmp_path, "window", layout_extra=bad), "layout_extra.flag is 'yes'", "window")
    # counts, but the ring in the file has 8 slots
    bad = '{"sinks": 1, "window": 9}'
    refused(edited(tmp_path, "window", layout_extra=bad), "the metadata says", "window")


def test_no_metadata_at_all_is_refused(tmp_path):
    _, tensors = valid_file("contiguous", "short")
    refused(write(tmp_path / "c.kv", None, tensors), "has no metadata")


# ---------------------------------------------------------------------- tensors


def values(mode: str = "contiguous", variant: str = "short") -> torch.Tensor:
    return valid_file(mode, variant)[1]["values"]


@pytest.mark.parametrize(
    ("mode", "tensors", "match"),
    [
        ("int8", {"values": values("int8").float()}, "values are fp32, not int8"),
        ("contiguous", {"values": values().long()}, "values are int64, not fp32"),
        ("contiguous", {"values": values().half()}, "values are fp16, not fp32"),
        ("int8", {"scales": valid_file("int8", "short")[1]["scales"].float()}, "scales are"),
        ("int8", {"scales": None}, "missing tensor scales"),
        ("contiguous", {"scales": torch.zeros(2, 2, 1, 2, 5, 2).half()}, "unexpected tensor"),
        ("contiguous", {"values": None}, "missing tensor values"),
        ("contiguous", {"extra": torch.zeros(3)}, "unexpected tensor 'extra'"),
        ("contiguous", {"values": torch.tensor(1.0)}, r"values have shape \(\)"),
        ("contiguous", {"values": values()[0]}, r"values have shape \(2, 1, 2, 5, 8\)"),
        ("contiguous", {"values": values()[..., :0]}, r"values have shape \(2, 2, 1, 2, 5, 0\)"),
        ("contiguous", {"values": values()[:, :, :, :, :0]}, "the metadata says"),
        ("window", {"values": values("window")[:, :, :, :, :7]}, "the metadata says"),
    ],
)
def test_bad_tensors_are_refused(tmp_path, mode, tensors, match):
    refused(with_tensors(tmp_path, mode, **tensors), match, mode)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int8_scales_must_be_finite(tmp_path, bad):
    scales = valid_file("int8", "short")[1]["scales"].clone()
    scales[1, 0, 0, 1, 3, 0] = bad
    refused(with_tensors(tmp_path, "int8", scales=scales), "scales are not all finite", "int8")


def test_values_are_data_even_when_not_finite(tmp_path):
    v = values().clone()
    v[0, 0, 0, 0, 0, 0] = float("nan")
    v[0, 0, 0, 0, 1, 0] = float("inf")
    cache = create_cache("contiguous", SPEC)
    load_cache(cache, with_tensors(tmp_path, "contiguous", values=v), FP)
    assert cache.num_tokens == 5


# ---------------------------------------------------------------------- the file itself


def test_files_that_are_not_cache_files(tmp_path):
    good = tmp_path / "good.kv"
    save_cache(filled("contiguous", "short"), good, FP)
    data = good.read_bytes()
    (tmp_path / "head.kv").write_bytes(data[:200])
    refused(tmp_path / "head.kv", "not a readable cache file")
    (tmp_path / "tail.kv").write_bytes(data[:-4])  # the header is whole, the data is not
    refused(tmp_path / "tail.kv", "not a readable cache file")
    (tmp_path / "text.kv").write_text("hello, world\n")
    refused(tmp_path / "text.kv", "not a readable cache file")
    (tmp_path / "empty.kv").write_bytes(b"")
    refused(tmp_path / "empty.kv", "not a readable cache file")
    (tmp_path / "dir.kv").mkdir()
    refused(tmp_path / "dir.kv", "is not a file")
    refused(tmp_path / "nope.kv", "cache file not found")


def test_nothing_is_read_into_memory_before_the_headers_check_out(tmp_path, monkeypatch):
    import safetensors

    real, loaded = safetensors.safe_open, []

    class Spy:
        def __init__(self, *args, **kwargs) -> None:
            self.f = real(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(self.f, name)

        def get_tensor(self, name: str) -> torch.Tensor:
            loaded.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    weights = {"embed.weight": torch.zeros(64, 8)}  # a model's file, passed by mistake
    refused(write(tmp_path / "model.safetensors", {"format": "pt"}, weights), "format 'pt'")
    refused(edited(tmp_path, "contiguous", batch="2"), "the metadata says")
    assert loaded == []
    load_cache(create_cache("contiguous", SPEC), edited(tmp_path, "contiguous"), FP)
    assert loaded == ["values"]


def test_an_unreadable_file_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "c.kv"
    save_cache(filled("contiguous", "short"), path, FP)
    if os.geteuid() != 0:  # root reads whatever the mode bits say
        path.chmod(0)
        refused(path, "not a readable cache file")
        path.chmod(0o600)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("safetensors.safe_open", denied)
    refused(path, r"not a readable cache file \(\[Errno 13\] Permission denied\)")


# ---------------------------------------------------------------------- property test
#
# Start from files real caches wrote, damage them, load. Either CacheFileError (naming the
# file, one line) or a load that restores exactly what the file holds, within the bound:
#   rows:   1 <= batch <= MAX_FILE_ROWS, and batch <= SPEC.batch when length is 0;
#   memory: cache.nbytes <= planned_nbytes(mode, SPEC, length, batch), what the mode costs
#           for the rows the file holds.

KEYS = ["format", "fingerprint", "mode", "layout", "dtype", "length", "batch"]
KEYS += ["geometry", "layout_extra", "extra"]
NAMES = ["values", "scales", "slot_pos"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8]
DTYPES += [torch.uint8, torch.int32, torch.int64, torch.bool]
COUNTS = st.one_of(
    st.sampled_from(["-1", "0", "1", "2", "3", "5", "6", "16", "17", "32", "33", "64", "65"]),
    st.sampled_from(["1e3", " 5", "0x10", "05", "+3", "", "9" * 18, "9" * 40, "\u0665"]),
    st.integers(-(2**64), 2**64).map(str),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=8,
)
FIELDS = st.sampled_from(["layers", "kv_heads", "head_dim", "sinks", "window", "x"])
DELETE = object()
META_OPS = ("delete", "set", "swap", "field")
META_EDITS = st.one_of(
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("set"), st.sampled_from(KEYS), st.text(max_size=20)),
    st.tuples(st.just("set"), st.sampled_from(KEYS), COUNTS),
    st.tuples(st.just("set"), st.sampled_from(KEYS), JSON.map(json.dumps)),
    st.tuples(st.just("set"), st.sampled_from(["mode", "layout"]), st.sampled_from(MODES)),
    st.tuples(st.just("set"), st.just("layout"), st.sampled_from(["dense", "window"])),
    st.tuples(st.just("set"), st.just("dtype"), st.sampled_from(["fp32", "fp16", "int8", "x"])),
    st.tuples(st.just("swap"), st.sampled_from(KEYS), st.sampled_from(KEYS)),
    st.tuples(
        st.just("field"),
        st.sampled_from(["geometry", "layout_extra", "extra"]),
        FIELDS,
        st.one_of(st.just(DELETE), st.integers(-2, 40), JSON),
    ),
)


def tensor_edits(names: list[str]) -> st.SearchStrategy:
    """Damage to the tensors `names` (and new ones)."""
    return st.one_of(
        st.tuples(st.just("drop"), st.sampled_from(names)),
        st.tuples(st.just("dtype"), st.sampled_from(names), st.sampled_from(DTYPES)),
        st.tuples(st.just("add_dim"), st.sampled_from(names), st.integers(0, 6)),
        st.tuples(st.just("remove_dim"), st.sampled_from(names), st.integers(0, 5)),
        st.tuples(st.just("resize"), st.sampled_from(names), st.integers(0, 5), st.integers(0, 40)),
        st.tuples(st.just("scalar"), st.sampled_from(names)),
        st.tuples(
            st.just("add"),
            st.sampled_from(["extra", "values", "scales", "slot_pos", "k", "v", "g3_values"]),
            st.lists(st.integers(0, 3), max_size=3),
            st.sampled_from(DTYPES),
        ),
        st.tuples(
            st.just("poke"),
            st.sampled_from(names),
            st.integers(0, 10**6),
            st.sampled_from(
                [float("nan"), float("inf"), -float("inf"), -2, -1, 0, 1, 5, 16, 2**40]
            ),
        ),
        st.tuples(st.just("shuffle"), st.sampled_from(names), st.integers(0, 2**32)),
    )


TENSOR_EDITS = tensor_edits(NAMES)
# a groups file's: each group's tensors, and its layout's fields
GROUP_NAMES = [f"g{g}_{n}" for g in range(3) for n in NAMES]
GROUP_KEYS = ["groups", "g0_kind", "g0_layers", "g1_kind", "g1_size", "g1_layers"]
GROUP_FIELDS = st.sampled_from([*GROUP_KEYS, "g2_size", "g2_layers", "g3_kind", "window"])
GROUP_META_EDITS = st.one_of(
    META_EDITS,
    st.tuples(st.just("set"), st.just("layout"), st.sampled_from(["groups", "hybrid", "dense"])),
    st.tuples(st.just("set"), st.just("format"), st.sampled_from(["kvlm-cache/1", "kvlm-cache/2"])),
    st.tuples(
        st.just("field"),
        st.just("layout_extra"),
        GROUP_FIELDS,
        st.one_of(st.just(DELETE), st.integers(-1, 70), JSON),
    ),
)


def edit_meta(meta: dict[str, str], edit: tuple) -> None:
    op, key, *args = edit
    if op == "delete":
        meta.pop(key, None)
    elif op == "set":
        meta[key] = args[0]
    elif op == "swap" and key in meta and args[0] in meta:
        meta[key], meta[args[0]] = meta[args[0]], meta[key]
    elif op == "field" and key in meta:
        try:
            obj = json.loads(meta[key])
        except ValueError:
            return
        if isinstance(obj, dict):
            name, value = args
            if value is DELETE:
                obj.pop(name, None)
            else:
                obj[name] = value
            meta[key] = json.dumps(obj)


def edit_tensors(tensors: dict[str, torch.Tensor], edit: tuple) -> None:
    op, name, *args = edit
    if op == "add":
        shape, dtype = args
        tensors[name] = torch.zeros(shape, dtype=dtype)
        return
    t = tensors.get(name)
    if t is None:
        return
    if op == "drop":
        del tensors[name]
    elif op == "dtype":
        tensors[name] = t.to(args[0])
    elif op == "add_dim":
        tensors[name] = t.unsqueeze(min(args[0], t.dim()))
    elif op == "remove_dim" and args[0] < t.dim():
        d = args[0]
        smaller = [*t.shape[:d], *t.shape[d + 1 :]]
        tensors[name] = t.select(d, 0) if t.shape[d] else torch.zeros(smaller, dtype=t.dtype)
    elif op == "resize" and args[0] < t.dim():
        d, n = args
        if t.shape[d]:
            tensors[name] = t.index_select(d, torch.arange(n) % t.shape[d])
        else:
            tensors[name] = torch.zeros([*t.shape[:d], n, *t.shape[d + 1 :]], dtype=t.dtype)
    elif op == "scalar":
        tensors[name] = torch.ones((), dtype=t.dtype)
    elif op == "poke" and t.numel():
        tensors[name] = poked(t, *args)
    elif op == "shuffle":
        g = torch.Generator().manual_seed(args[0])
        tensors[name] = t.reshape(-1)[torch.randperm(t.numel(), generator=g)].reshape(t.shape)


def poked(t: torch.Tensor, index: int, value: float) -> torch.Tensor:
    flat = t.reshape(-1).clone()
    if t.dtype == torch.bool:
        value = bool(value)
    elif not t.dtype.is_floating_point:
        if value != value or abs(value) == float("inf"):
            return t  # no NaN in an integer tensor
        info = torch.iinfo(t.dtype)
        value = int(min(max(value, info.min), info.max))
    flat[index % flat.numel()] = value
    return flat.reshape(t.shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: values are data, NaN included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    source=st.sampled_from(MODES),
    variant=st.sampled_from(list(VARIANTS)),
    edits=st.lists(st.one_of(META_EDITS, TENSOR_EDITS), max_size=3),
    target=st.one_of(st.none(), st.sampled_from(MODES)),
)
def test_damaged_files_load_exactly_or_are_refused(tmp_path, source, variant, edits, target):
    damaged_load(tmp_path, source, variant, edits, target, SPEC)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    source=st.sampled_from(GROUPED_MODES),
    variant=st.sampled_from(list(GROUPED_VARIANTS)),
    edits=st.lists(st.one_of(GROUP_META_EDITS, tensor_edits(GROUP_NAMES)), max_size=3),
    target=st.one_of(st.none(), st.sampled_from(GROUPED_MODES)),
)
def test_damaged_grouped_files_load_exactly_or_are_refused(
    tmp_path, source, variant, edits, target
):
    """A model of three layer groups: its files (the `groups` layout) damaged, each group's
    tensors and its layout's fields: refused in one line, or loaded exactly."""
    damaged_load(tmp_path, source, variant, edits, target, GROUPED)


def damaged_load(tmp_path, source, variant, edits, target, spec: CacheSpec) -> None:
    """A file `source` of `variant` wrote, damaged by `edits`, loaded into a cache of
    `target` (default: its own mode): refused with a CacheFileError naming it, or loaded
    exactly, within the allocation bound, and the cache goes on working."""
    meta, tensors = (dict(d) for d in valid_file(source, variant, spec))
    for edit in edits:
        if edit[0] in META_OPS:
            edit_meta(meta, edit)
        else:
            edit_tensors(tensors, edit)
    path = write(tmp_path / "c.kv", meta, tensors)
    try:
        read_cache_file(path)
        read = True
    except CacheFileError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        read = False
    mode = target or source
    cache = create_cache(mode, spec)
    try:
        load_cache(cache, path, FP)
    except CacheFileError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        assert (cache.num_tokens, cache.batch) == (0, spec.batch)
        event("refused")
        return
    event("loaded")
    assert read  # what load() accepts, read_cache_file accepts
    length, batch = int(meta["length"]), int(meta["batch"])
    assert (cache.num_tokens, cache.batch) == (length, batch)
    assert 1 <= batch <= MAX_FILE_ROWS and (length > 0 or batch <= spec.batch)
    assert cache.nbytes <= planned_nbytes(mode, spec, length, batch)
    held = cache.snapshot().tensors
    assert held.keys() == tensors.keys()
    # a groups file's empty ring slots are no data: a pool keeps only the held positions
    assert all(same_bytes(*held_slots(held, tensors, k)) for k in tensors)
    try:  # and the cache goes on working
        feed(cache, 1, seed=3)
    except CacheOverflowError:
        assert length == spec.max_tokens or mode in ("paged", "int8")


MESSAGES = st.fixed_dictionaries({"role": st.text(max_size=4), "content": st.text(max_size=4)})
CONVERSATIONS = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["chat", "text", "x"]),
        "history": st.lists(st.integers(0, 99), max_size=36)
        | st.lists(st.integers(-2, 101) | JSON, max_size=36)
        | JSON,
    },
    optional={
        "messages": st.lists(MESSAGES, max_size=3) | st.lists(MESSAGES | JSON, max_size=3) | JSON,
        "x": JSON,
    },
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(extra=CONVERSATIONS, variant=st.sampled_from(list(VARIANTS)), use_template=st.booleans())
def test_damaged_conversations_load_or_are_refused(tmp_path, extra, variant, use_template):
    path = chat_file(tmp_path, extra, variant)
    chat = session(use_template=use_template)
    try:
        chat.load(path, FP)
    except CacheFileError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        assert chat.cache.num_tokens == 0 and chat.history == []
        event("refused")
        return
    event("loaded")
    assert chat.cache.batch == 1
    assert all(type(t) is int and 0 <= t < 100 for t in chat.history)
    assert chat.cache.num_tokens <= len(chat.history) <= chat.cache.capacity + 1
    assert all(set(m) >= {"role", "content"} for m in chat.messages)


def test_a_ring_with_a_gap_in_its_slack_is_refused(tmp_path):
    """A window's ring in a groups file holds one run of positions: a gap among the slack's
    older positions (which no next query reads) was read, and a pool loading it held the
    gap's rows unwritten (hypothesis found it: a paged file, one slot emptied)."""
    meta, tensors = (dict(d) for d in valid_file("paged", "g-forked", GROUPED))
    pos = tensors["g2_slot_pos"]
    held = sorted(int(p) for p in pos if p >= 0)
    assert len(held) >= 3  # an inner position to take out
    pos = pos.clone()
    pos[pos == held[1]] = -1
    path = write(tmp_path / "c.kv", meta, {**tensors, "g2_slot_pos": pos})
    with pytest.raises(CacheFileError, match="gap in its run of positions"):
        read_cache_file(path)
