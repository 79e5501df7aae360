"""The fused decode step over a paged pool: the server's batch in one C call.

Every row of a batch must get the logits it gets alone, bit for bit (a request's tokens do
not depend on who else is being served), and the same as the single-sequence fused step
over a contiguous cache (kvlm generate and kvlm serve answer alike)."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    feed_batched,
    feed_contiguous,
    needs_kernels,
    needs_vector_kernels,
    portable_build_params,
    portable_kernels,
    scrambled_tables,
)
from kvlm import LLM, kernels
from kvlm.cache.paged import BlockPool
from kvlm.cache.storage import Store
from kvlm.engine.runner import CacheBatch
from kvlm.model.fused import KVView
from numerics import assert_as_exact_as

# rows of different lengths: within one block, across several, one past 64 positions
# (two attention chunks) and one long enough for more
LENGTHS = [3, 16, 17, 40, 70, 9, 130, 1, 33, 64, 65, 5, 21, 48, 90, 12, 7, 28, 50, 2]


def _llm(tiny_model_dir, weights: str, kv_dtype: str, act: str = "fp32", name="llama") -> LLM:
    return LLM(
        model=tiny_model_dir(name),
        progress=False,
        max_context=256,
        weights=weights,
        kv_dtype=kv_dtype,
        activations=act,
        prefill_dtype="fp32",
    )


@needs_kernels
@pytest.mark.parametrize(
    "weights, kv_dtype, act",
    [
        ("int4", "fp32", "fp32"),
        ("int8", "bf16", "fp32"),
        ("int4", "fp16", "fp32"),
        ("int4", "int8", "int8"),
    ],
)
def test_a_batch_over_a_paged_pool_gives_each_row_its_own_logits(
    tiny_model_dir, weights, kv_dtype, act
):
    _rows_alone_and_together(_llm(tiny_model_dir, weights, kv_dtype, act), LENGTHS)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["q4", "int8/q4", "q4/fp16"])
@pytest.mark.parametrize(
    "name, lengths",
    [
        ("llama-hd128", LENGTHS[:10]),  # head_dim 128, 4 query heads a KV head
        # head_dim 64, a window of 150: the visible rows start past a chunk's first
        ("mistral-hd64-window", [3, 16, 17, 65, 151, 170, 201, 1, 33]),
    ],
)
def test_a_batch_over_a_paged_q4_pool_gives_each_row_its_own_logits(
    tiny_model_dir, kv_dtype, name, lengths
):
    """q4 K's scores (group sums of 4 rows) and q4 V's p.V (rows in pairs on the CPUs
    with AVX512-BF16): a row's logits are its own, alone or batched, paged or contiguous."""
    _rows_alone_and_together(_llm(tiny_model_dir, "int4", kv_dtype, name=name), lengths)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp32"])
def test_several_passes_over_a_kv_heads_heads_batch_alike(tiny_model_dir, kv_dtype):
    """head_dim 128 with 4 query heads a KV head: the scores and p.V take the heads in
    passes of 2 (p.V's 4 x 8 accumulators would be every zmm register): a row's logits
    are its own, alone or batched, paged or contiguous."""
    _rows_alone_and_together(_llm(tiny_model_dir, "int4", kv_dtype, name="llama-hd128"),
                             LENGTHS[:10])  # fmt: skip


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "int8"])
def test_the_portable_build_batches_alike(tiny_model_dir, monkeypatch, march, kv_dtype):
    """The scalar attention walks a block table too (row by row), and the AVX2 halves."""
    portable = portable_kernels(march)
    monkeypatch.setattr(kernels, "library", lambda: portable)
    _rows_alone_and_together(_llm(tiny_model_dir, "int4", kv_dtype), LENGTHS[:7])


def _rows_alone_and_together(llm: LLM, lengths: list[int]) -> None:
    assert llm.runner.fused_reason is None
    vocab = llm.config.vocab_size
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    spec = llm.cache_spec("paged")
    pool = BlockPool(spec, 64)
    tables = scrambled_tables(pool, lengths, seed=2)
    together = feed_batched(llm, seqs, pool, tables)  # 20 rows: products in two tiles of 16
    for b, tokens in enumerate(seqs):
        alone_pool = BlockPool(spec, 64)
        alone = feed_batched(
            llm, [tokens], alone_pool, scrambled_tables(alone_pool, [len(tokens)], seed=b)
        )
        assert torch.equal(together[b], alone[0]), f"row {b}: batched != alone"
        assert torch.equal(together[b], feed_contiguous(llm, tokens)), (
            f"row {b}: paged != contiguous"
        )


@needs_kernels
def test_the_batched_step_matches_the_torch_model_over_a_paged_pool(tiny_model_dir):
    """Against kvlm's own torch forward (TableStep: gathered keys, masked padding)."""
    llm = _llm(tiny_model_dir, "int4", "fp32")
    vocab = llm.config.vocab_size
    lengths = [5, 30, 70, 17]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    spec = llm.cache_spec("paged")
    pools = [BlockPool(spec, 32), BlockPool(spec, 32)]
    tables = scrambled_tables(pools[0], lengths, seed=4)
    assert scrambled_tables(pools[1], lengths, seed=4) == tables
    fused = feed_batched(llm, seqs, pools[0], tables)
    llm.runner.fused_reason = "off for the comparison"
    reference = feed_batched(llm, seqs, pools[1], tables)
    # both held to the same weights in fp64: as close to it as each other (fp32 in two
    # summation orders), logits and the K/V each wrote via the tables
    exact_llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256,
                    weights="int4", dtype="fp64")  # fmt: skip
    for ours, theirs, seq in zip(fused, reference, seqs, strict=True):
        exact = exact_llm.runner.logits(seq, exact_llm.new_cache("off"))
        assert_as_exact_as(ours, theirs, exact)
    for table, seq in zip(tables, seqs, strict=True):
        n = len(seq)
        ours, theirs = (
            p.store.values[:, :, table].transpose(2, 3).flatten(3, 4)[..., :n, :] for p in pools
        )
        cache = exact_llm.new_cache("contiguous")
        exact_llm.runner.forward(seq, cache)
        assert_as_exact_as(ours, theirs, cache.store.values[:, :, 0, :, :n])


@needs_kernels
def test_the_batched_step_refuses_positions_outside_itsscrambled_tables(tiny_model_dir):
    """A position past the rows' tables or the context, or a block id past the pool: a
    clear error, and nothing written."""
    llm = _llm(tiny_model_dir, "int8", "fp32")
    spec = llm.cache_spec("paged")
    pool = BlockPool(spec, 4)
    pool.store.values.fill_(0.5)
    before = pool.store.values.clone()
    decoder = llm.runner._decoder(spec.max_tokens)
    for tables, starts in (
        ([[0]], [16]),  # block 1 of a one-block table
        ([[7]], [0]),  # no block 7 in a pool of 4
        ([[0, 1]], [-1]),
        ([[0] * 20], [256]),  # past the context
    ):
        with pytest.raises(ValueError, match="refused"):
            decoder.run([KVView(pool.store, tables, pool.block_size)], [5], starts, None)
    # views that do not hold every layer once, in a store that has it: refused before or
    # by the C step (a layer's index past its view's store, a ring shorter than a window)
    one = Store((1, *pool.store.values.shape[1:]), torch.float32, torch.device("cpu"))
    bs = pool.block_size
    for views, match in (
        ([KVView(pool.store, [[0]], bs, 0, (0,))], "layer 1 in no view"),
        ([KVView(pool.store, [[0]], bs), KVView(one, [[1]], bs, 0, (1,))], "in two views"),
        ([KVView(one, [[0]], bs, 0, (0, 1))], "refused"),  # index 1 of a 1-layer store
        ([KVView(pool.store, [[0, 1]], bs, 2 * bs)], "refused"),  # a ring of no window
    ):
        with pytest.raises(ValueError, match=match):
            decoder.run(views, [5], [3], None)
    assert torch.equal(pool.store.values, before)


@needs_kernels
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_forked_samples_decode_in_one_step_as_each_would_alone(tiny_model_dir, mode, name):
    """n samples of one prompt (cache.fork, as LLM.generate does for n > 1) step together
    through the fused step, over a contiguous cache of n rows or a paged one (its shared
    last block copied on write), each row as a cache of its own would; Gemma 3's
    contiguous cache is a hybrid one, its ring forked too and wrapped by the 51 tokens."""
    llm = _llm(tiny_model_dir, "int4", "fp32", name=name)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, llm.config.vocab_size, (21,), generator=g).tolist()
    rows = torch.randint(3, llm.config.vocab_size, (3, 30), generator=g).tolist()
    cache = llm.new_cache(mode)
    llm.runner.forward(prompt, cache)  # the prefill: the torch model
    cache.fork(3)
    assert llm.runner.fused_for(cache) is not None
    together = torch.stack(
        [llm.runner.run(CacheBatch([r[t : t + 1] for r in rows], cache)) for t in range(30)]
    )
    for b, row in enumerate(rows):
        alone = llm.new_cache(mode)
        llm.runner.forward(prompt, alone)
        logits = torch.stack([llm.runner.forward([tok], alone) for tok in row])
        assert torch.equal(together[:, b], logits), f"sample {b}"
