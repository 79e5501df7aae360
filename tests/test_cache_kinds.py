"""Layer kinds (kvlm.cache.kinds) and groups (kvlm.cache.groups): a model's layers grouped
by what they keep, one grouping that the row caches' hybrid and the pool's block tables
both take."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.cache.base import CacheSpec
from kvlm.cache.factory import create_cache, planned_parts
from kvlm.cache.files import load_cache, save_cache
from kvlm.cache.groups import from_layout, layer_at, layer_groups, layout_extra
from kvlm.cache.hybrid import HybridCache
from kvlm.cache.kinds import RING_SLACK, ConvWindow, FullAttention, SlidingWindow, kind_of
from kvlm.cache.paged import BlockPool
from kvlm.cache.saved import SavedCache
from kvlm.errors import InvalidRequestError, UnsupportedModelError

# layers 0, 1, 3, 4 windowed (W = 8), 2 and 5 whole: a Gemma-like pattern
WINDOWS = (8, 8, None, 8, 8, None)


def _spec(windows: tuple[int | None, ...] = WINDOWS, **kw) -> CacheSpec:
    kinds = tuple(kind_of(w) for w in windows)
    return CacheSpec(num_layers=6, num_kv_heads=2, head_dim=8, max_tokens=64,
                     layer_kinds=kinds, block_size=4, **kw)  # fmt: skip


def test_layers_are_grouped_by_kind_whole_ones_first():
    groups = layer_groups(_spec())
    assert [(g.kind, g.layers) for g in groups] == [
        (FullAttention(), (2, 5)), (SlidingWindow(8), (0, 1, 3, 4))]  # fmt: skip
    assert layer_at(groups) == [(1, 0), (1, 1), (0, 0), (1, 2), (1, 3), (0, 1)]
    assert layout_extra(groups) == {"groups": 2, "g0_kind": 0, "g0_layers": 0b100100,
                                    "g1_kind": 1, "g1_layers": 0b11011, "g1_size": 8}  # fmt: skip
    assert from_layout(layout_extra(groups), 6) == groups
    whole, ring = (g.spec(_spec()) for g in groups)
    assert (whole.num_layers, whole.sliding_window, whole.layer_kinds) == (2, None, ())
    assert (ring.num_layers, ring.sliding_window) == (4, 8)


def test_one_group_where_every_layer_is_alike():
    """A window on every layer (Mistral's) is the masks' business: one whole group; a spec
    that names every layer's kind alike is refused (it says nothing `()` does not)."""
    for spec in (_spec(()), _spec((), sliding_window=4)):
        (group,) = layer_groups(spec)
        assert group.kind == FullAttention() and group.layers == tuple(range(6))
        assert group.spec(spec) is spec and layout_extra((group,)) == {}
    with pytest.raises(InvalidRequestError, match="6 kinds for 6 layers, 1 distinct"):
        _spec((4,) * 6)
    with pytest.raises(InvalidRequestError, match="2 kinds for 6 layers"):
        _spec((4, None))


def _config(arch: str, **overrides):
    from kvlm.config import ModelConfig

    base = ModelConfig(architecture=arch, vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=512,
                       tie_word_embeddings=True)  # fmt: skip
    return replace(base, **overrides)


def test_a_specs_kinds_come_from_the_models_layers():
    """CacheSpec.for_model takes each layer's kind from its mixer (an attention layer's
    window: kinds.kind_of); a window every layer shares is the spec's sliding_window, the
    masks', and every row is kept."""
    gemma = _config("gemma3", layer_windows=(8, 8, None, 8))
    spec = CacheSpec.for_model(gemma, 64)
    assert spec.layer_kinds == (SlidingWindow(8),) * 2 + (FullAttention(), SlidingWindow(8))
    assert spec.sliding_window is None
    alike = (_config("mistral", sliding_window=16), _config("gemma2", layer_windows=(16,) * 4))
    for config in alike:
        spec = CacheSpec.for_model(config, 64)
        assert (spec.layer_kinds, spec.sliding_window) == ((), 16)
        assert len(layer_groups(spec)) == 1


def test_what_each_kind_keeps():
    window = SlidingWindow(8)
    assert (window.keep, window.kept(1000), window.kept(5)) == (8 + RING_SLACK, 40, 5)
    assert (window.first_read(3), window.first_read(100)) == (0, 93)
    whole = FullAttention()
    assert (whole.keep, whole.kept(1000), whole.first_read(100)) == (None, 1000, 0)


def test_a_conv_layer_is_a_state_kind_of_its_own_group():
    """A short convolution's kind (ConvWindow(L - 1, H), from the model's mixers): its
    rows a sequence, none per token (a conv layer takes no K/V), a rollback as far as its
    slack, its group after the whole layers, its fields in a file's layout."""
    conv = ConvWindow(2, 64)
    spec = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, max_tokens=64,
                     layer_kinds=(conv, FullAttention(), conv, FullAttention()))  # fmt: skip
    assert (conv.keep, conv.kept(1000), conv.first_read(100)) == (2 + RING_SLACK, 0, 98)
    assert (conv.token_bytes(spec), conv.sequence_bytes(spec)) == (0, (2 + RING_SLACK) * 64 * 4)
    assert spec.bytes_per_token == 2 * FullAttention().token_bytes(spec)
    groups = layer_groups(spec)
    assert [(g.kind, g.layers) for g in groups] == [(FullAttention(), (1, 3)), (conv, (0, 2))]
    assert layout_extra(groups)["g1_kind"] == 2
    assert from_layout(layout_extra(groups), 4) == groups
    lfm2 = _config("lfm2", layer_mixers=("conv", "attention") * 2, conv_kernel=3)
    kinds = CacheSpec.for_model(lfm2, 64).layer_kinds
    assert kinds == (ConvWindow(2, lfm2.hidden_size), FullAttention()) * 2


def test_each_window_is_a_group_and_one_kind_must_see_everything():
    """Layers of two windows are two groups beside the whole layers (in the order of their
    first layer); kinds without one that keeps every position are refused in one line (a
    pool's prefix chain lives on that group)."""
    groups = layer_groups(_spec((8, 16, None, 8, 16, None)))
    assert [(g.kind, g.layers) for g in groups] == [
        (FullAttention(), (2, 5)),
        (SlidingWindow(8), (0, 3)),
        (SlidingWindow(16), (1, 4)),
    ]
    assert from_layout(layout_extra(groups), 6) == groups
    with pytest.raises(UnsupportedModelError, match="one kind of layers that see the whole"):
        layer_groups(_spec((8, 16, 8, 8, 16, 8)))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"groups": 1}, "not a count of 2 .. 6"),
        ({"g1_kind": 9}, "kind 9 is not one of"),
        ({"g1_size": 0}, "size 0 is not an integer >= 1"),
        ({"g1_layers": 0b11111}, "layer 2 is in two groups"),
        ({"g1_layers": 0b01011}, "layer 4 is in no group"),
        ({"g0_kind": 1, "g0_size": 16}, "one kind of layers that see the whole"),
        ({"g0_kind": 1, "g0_size": 8}, "1 distinct"),  # two groups of one kind
        ({"g1_rows": 3}, "takes \\['size'\\]"),
        ({"g2_kind": 0}, "not as kvlm writes them"),
    ],
)
def test_a_files_groups_are_checked(change, match):
    """A file's groups layout (kvlm.cache.groups.from_layout) names known kinds with their
    fields, every layer in one group, and the groups in the order kvlm writes them."""
    extra = layout_extra(layer_groups(_spec())) | change
    with pytest.raises(ValueError, match=match):
        from_layout(extra, 6)


@pytest.mark.parametrize("mode", ["basic", "contiguous"])
def test_the_row_hybrid_and_the_pool_take_the_same_groups(mode):
    """HybridCache's parts and BlockPool's groups are the one grouping: the same layers in
    each part and store, the same windows, the same file layout."""
    spec = _spec()
    cache = create_cache(mode, spec)
    pool = BlockPool(spec, 16)
    assert isinstance(cache, HybridCache)
    assert [p.group for p in pool.groups] == list(cache.groups) == list(layer_groups(spec))
    assert [part.spec.num_layers for part in cache.parts] == [
        g.store.shape[0] for g in pool.groups]  # fmt: skip
    assert pool.layer_at == [(g, index[i]) for i, (g, index) in enumerate(cache.layers)]
    assert [g.window for g in pool.groups] == [None, 8]
    assert [g.keep for g in pool.groups] == [None, 8 + RING_SLACK]
    paged = create_cache("paged", spec)
    assert paged._layout_extra() == cache._layout_extra() == layout_extra(layer_groups(spec))
    # the plans' groups: the ring keeps W + RING_SLACK positions, the pool whole blocks
    plans = [planned_parts(m, spec, 64, 1) for m in (mode, "paged")]
    assert [[(p.num_layers, kept) for p, _, kept in plan] for plan in plans] == [
        [(2, 64), (4, 40)], [(2, 64), (4, 44)]]  # fmt: skip


def test_a_pool_group_keeps_what_its_kind_says():
    """The windowed group's blocks slide out behind its kind's `keep`, and a rollback that
    would need a released position is refused by its kind's `first_read`."""
    spec = _spec()
    cache = create_cache("paged", spec)
    step = cache.begin(60)
    k = torch.zeros(1, 2, 60, 8)
    for layer in range(6):
        step.for_layer(layer).update(layer, k, k)
    cache.commit(step)
    live = [b for b in cache.group_tables[1][0] if b >= 0]
    assert len(live) * 4 >= 40 and len(live) < 15  # 40 positions kept, not 60
    assert cache.can_roll_back(RING_SLACK) and not cache.can_roll_back(RING_SLACK + 8)


def test_a_kinds_geometry_and_bytes_reach_its_groups_stores_and_plans():
    """A kind may have rows of its own geometry (Gemma 4's wider global heads): its group's
    spec, stores and planned bytes take it (LayerKind.shape, token_bytes), every other
    group keeps the model's; the whole spec's bytes per token sum each layer's kind's."""
    wide = FullAttention(head_dim=16)
    kinds = tuple(wide if w is None else SlidingWindow(w) for w in WINDOWS)
    spec = CacheSpec(num_layers=6, num_kv_heads=2, head_dim=8, max_tokens=64, layer_kinds=kinds,
                     block_size=4)  # fmt: skip
    assert (wide.shape(spec), SlidingWindow(8).shape(spec)) == ((2, 16), (2, 8))
    assert wide.token_bytes(spec) == 2 * 2 * 16 * 4 and wide.sequence_bytes(spec) == 0
    assert spec.bytes_per_token == 2 * wide.token_bytes(spec) + 4 * 2 * 2 * 8 * 4
    whole, ring = layer_groups(spec)
    assert (whole.spec(spec).head_dim, ring.spec(spec).head_dim) == (16, 8)
    pool = BlockPool(spec, 16)
    assert [g.store.head_dim for g in pool.groups] == [16, 8]
    for mode in ("contiguous", "paged"):
        cache = create_cache(mode, spec)
        step = cache.begin(5)
        for layer, kind in enumerate(kinds):
            k = torch.full((1, 2, 5, kind.shape(spec)[1]), float(layer))
            keys, _ = step.for_layer(layer).update(layer, k, k)
            assert keys.shape[-1] == k.shape[-1] and keys[0, 0, -1, 0] == layer
        cache.commit(step)
        planned = planned_parts(mode, spec, 64, 1)
        assert planned[0][1] == 64 * whole.token_bytes(spec) == 64 * 2 * wide.token_bytes(spec)
        if mode == "contiguous":  # preallocated: what it holds is what was planned
            assert cache.nbytes == sum(n for _, n, _ in planned)


LONG = "The quick brown fox jumps over the lazy dog and runs far away. " * 3
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def three_groups(tiny_model_dir):
    """LLMs of the tiny Gemma 3 with its local layers' windows 8 and 16: three layer
    groups. No model file names two windows yet, so the config is changed in place
    before any cache is made (the local layers keep their RoPE base)."""

    def make(mode: str) -> LLM:
        llm = LLM(model=tiny_model_dir("gemma3"), progress=False, max_context=256, kv=mode)
        windows = llm.config.layer_windows
        assert windows == (8, 8, None, 8)
        llm.config = llm.model.config = replace(llm.config, layer_windows=(8, 16, None, 8))
        return llm

    return make


def test_three_layer_groups_through_every_mode_the_pool_and_a_file(three_groups, tmp_path):
    """A model of three groups (the whole layer, each window's): one cache of each row and
    pool mode keeps a part per group and gives the `off` oracle's greedy tokens on a
    prompt past both windows and their slack, so does the engine's pool; a paged cache's
    file (the groups layout) resumes into a paged and a contiguous cache."""
    want = three_groups("off").generate([LONG], GREEDY)[0].outputs[0].token_ids
    for mode in ("basic", "contiguous", "paged"):
        llm = three_groups(mode)
        assert len(llm.tokenizer.encode(LONG)) > 16 + RING_SLACK
        cache = llm.new_cache(mode)
        parts = cache.pool.groups if mode == "paged" else cache.parts
        assert [p.spec.sliding_window if mode != "paged" else p.window for p in parts] == [
            None, 8, 16]  # fmt: skip
        assert llm.generate([LONG], GREEDY)[0].outputs[0].token_ids == want
        pair = llm.generate([LONG, LONG[:70]], GREEDY)  # the engine's pool
        assert pair[0].outputs[0].token_ids == want
        assert len(llm.batch_engine().pool.groups) == 3
    llm = three_groups("paged")
    cache = llm.new_cache("paged")
    llm.runner.forward(llm.tokenizer.encode(LONG), cache)
    save_cache(cache, tmp_path / "c.kv", llm.fingerprint)
    info = SavedCache.read(tmp_path / "c.kv").summary()
    assert [g["window"] for g in info["layer_groups"]] == [None, 8, 16]
    next_logits = llm.runner.forward([5, 6, 7], cache)
    for mode in ("paged", "contiguous"):
        other = three_groups(mode).new_cache(mode)
        load_cache(other, tmp_path / "c.kv", llm.fingerprint)
        got = llm.runner.forward([5, 6, 7], other)
        assert got.equal(next_logits) if mode == "paged" else (got - next_logits).abs().max() < 1e-4
