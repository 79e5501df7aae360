"""The fused decode step (kvlm.model.fused) on every family's block: q|k|v and o_proj
biases (Qwen2, Llama's attention_bias), per-head q/k RMSNorm (Qwen3), a sliding window
(Mistral), Gemma 2 and 3 (local and global layers, sandwich norms, GeGLU, soft-caps, two
RoPE bases), head_dim 64, 128 and 256, tied and separate lm_heads; over fp32, bf16, fp16
and int8 K/V in contiguous (for Gemma: hybrid, the local layers in a ring) and paged
caches. Each is held to the torch model by the rules of
tests/numerics.py, and keeps the batch's property: a row's logits are the same bit for bit
alone, in any batch, paged or contiguous."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import (
    assert_greedy_agreement,
    assert_top_k_both_ways,
    counted_fused_runs,
    feed_batched,
    feed_contiguous,
    fused_and_torch,
    fused_draft_rolled_back,
    fused_steps_on,
    low_bit_llm,
    needs_kernels,
    needs_vector_kernels,
    portable_build_params,
    portable_kernels,
    save_tiny_model,
    scrambled_tables,
)
from kvlm import LLM, SamplingParams, kernels
from kvlm.cache.base import blocks_for
from kvlm.cache.hybrid import HybridCache
from kvlm.cache.kinds import RING_SLACK
from kvlm.cache.paged import BlockPool, PagedCache
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.runner import PoolBatch
from kvlm.model.fused import KVView, block_products, why_not
from numerics import SAME_ROUNDING, U32, assert_as_exact_as, gamma

# conftest.TINY_MODELS, and what each brings to the fused step
ARCH_MODELS = {
    "qwen2": "q|k|v bias, tied lm_head, head_dim 16",
    "qwen3": "q/k RMSNorm, head_dim 32",
    "llama-bias": "q|k|v and o_proj biases",
    "mistral-window": "sliding window 8",
    "mistral-hd64-window": "sliding window 150 over two chunks, head_dim 64, 4 heads per KV head",
    "llama-hd128": "head_dim 128, 4 heads per KV head, separate lm_head",
    "llama-hd128-g8": "head_dim 128, 8 heads per KV head (the attention's fallbacks)",
    "llama-hd64-g7": "head_dim 64, 7 heads per KV head (Qwen2.5-0.5B's: scores in one pass)",
    "gemma3": "local (window 8: a ring of 40 slots) and global layers, two RoPE bases, "
    "sandwich norms, GeGLU, q/k norms holding the score scale",
    "gemma2": "every second layer local, attention and final soft-caps, a score scale",
    "gemma3-hd256": "Gemma 3's head_dim 256, 4 query heads per KV head",
}
MADE = {  # ARCH_MODELS not in conftest.TINY_MODELS: (architecture, seed, overrides)
    "llama-hd128-g8": ("llama", 9, {"head_dim": 128, "num_attention_heads": 8,
                                    "num_key_value_heads": 1}),
    "llama-hd64-g7": ("llama", 11, {"head_dim": 64, "num_attention_heads": 14, "hidden_size": 224,
                                    "num_key_value_heads": 2}),
    "gemma3-hd256": ("gemma3", 14, {"head_dim": 256, "num_key_value_heads": 1}),
}  # fmt: skip
KV_DTYPES = ["fp32", "bf16", "fp16", "int8", "q4"]
# K and V apart (--k-dtype, --v-dtype): each kind of scores beside another kind of p.V
SPLIT_KV = ["int8/q4", "q4/fp16", "fp16/int8"]
MAX_CONTEXT = 256
# The fused step over an int8 cache also rounds each query head to int8 (one scale per
# head): one more int8 rounding of an attention input, of the size the K/V codes' own is,
# so its error against the exact result is up to twice the torch int8 path's, times the
# spread SAME_ROUNDING allows (as tests/test_quant.py holds the default model).
INT8_QUERIES = 2 * SAME_ROUNDING


@pytest.fixture(scope="module")
def arch_dir(tiny_model_dir, tmp_path_factory):
    """name in ARCH_MODELS -> model folder (conftest's, or one made here)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in MADE:
            return tiny_model_dir(name)
        if name not in made:
            arch, seed, overrides = MADE[name]
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), arch, seed, **overrides)
        return made[name]

    return get


def _weights(name: str) -> str:
    return "int8" if name.startswith(("qwen", "gemma2")) else "int4"


def _window(llm: LLM) -> int | None:
    """The model's window, or its local layers' (Gemma)."""
    local = [w for w in llm.config.layer_windows if w is not None]
    return min(local) if local else llm.config.sliding_window


@functools.cache
def _llm(folder: Path, weights: str, kv_dtype: str) -> LLM:
    return LLM(model=folder, progress=False, max_context=MAX_CONTEXT, weights=weights,
               kv_dtype=kv_dtype, activations="fp32", prefill_dtype="fp32")  # fmt: skip


@functools.cache
def _exact(folder: Path, weights: str) -> LLM:
    """The same weights in fp64 (the torch path): the exact result both are held to."""
    return LLM(model=folder, progress=False, max_context=MAX_CONTEXT, weights=weights,
               dtype="fp64", activations="fp32", prefill_dtype="fp32")  # fmt: skip


def _load(arch_dir, name: str, kv_dtype: str = "fp32") -> tuple[LLM, Path, str]:
    folder, weights = arch_dir(name), _weights(name)
    return _llm(folder, weights, kv_dtype), folder, weights


def _ids(llm: LLM, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, llm.config.vocab_size, (n,), generator=g).tolist()


@needs_kernels
@pytest.mark.parametrize("name", list(ARCH_MODELS))
def test_every_family_takes_the_fused_step(arch_dir, name):
    """why_not says yes, and the model has what the case is named for (so the tests below
    exercise it)."""
    llm, _, _ = _load(arch_dir, name)
    model, c = llm.model, llm.config
    assert why_not(model) is None
    assert llm.runner.fused_reason is None
    attn = model.layers[0].attn
    if name.startswith("qwen2") or name == "llama-bias":
        assert attn.qkv.bias is not None and attn.qkv.bias.abs().max() > 0
    if name == "llama-bias":
        assert attn.o_proj.bias is not None and attn.o_proj.bias.abs().max() > 0
    if name == "qwen3":
        assert attn.q_norm is not None and attn.k_norm is not None
    if "window" in name:
        assert c.sliding_window is not None and c.sliding_window < MAX_CONTEXT
    if "hd128" in name:
        assert c.head_dim == 128 and not c.tie_word_embeddings
        with safe_open(arch_dir(name) / "model.safetensors", "pt") as f:
            assert "lm_head.weight" in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
    if "hd64" in name:
        assert c.head_dim == 64 and c.num_heads // c.num_kv_heads == (7 if "g7" in name else 4)
    if name == "qwen2":
        assert c.tie_word_embeddings
    if name.startswith("gemma"):  # local and global layers, Gemma's norms and GeGLU
        assert None in c.layer_windows and 8 in c.layer_windows
        block = model.layers[0]
        assert block.attn_out_norm is not None and block.mlp_out_norm is not None
        assert block.mlp.act == "gelu_tanh"
        assert isinstance(llm.new_cache("contiguous"), HybridCache)
    if name.startswith("gemma3"):
        assert attn.q_norm is not None and model.local_rope is not None
    if name == "gemma2":  # the score scale on the queries (no q norm to hold it)
        assert c.attn_softcap is not None and c.final_softcap is not None
        assert attn.q_scale not in (None, 1.0)
    if "hd256" in name:
        assert c.head_dim == 256 and c.num_heads // c.num_kv_heads == 4


def test_mlp_biases_stay_with_the_torch_step(tmp_path):
    folder = save_tiny_model(tmp_path / "m", "llama", seed=10, mlp_bias=True)
    llm = low_bit_llm(model=folder, max_context=64, weights="int8")
    assert llm.runner.fused_reason.startswith("MLP biases")


def _v_magnitude(llm: LLM, ids: list[int]) -> torch.Tensor:
    """|h| @ |Wv|.T + |bias| for layer 0's values at `ids`, as (1, Hkv, n, D): the scale of
    each V element's fp32 rounding error."""
    model, c = llm.model, llm.config
    layer = model.layers[0]
    h = layer.input_norm(model.embed(torch.tensor([ids])))[0].double()
    start = (c.num_heads + c.num_kv_heads) * c.head_dim
    qkv = layer.attn.qkv
    mag = h.abs() @ qkv.dense_weight()[start:].double().abs().t()
    if qkv.bias is not None:
        mag = mag + qkv.bias[start:].double().abs()
    return mag.view(len(ids), c.num_kv_heads, c.head_dim).transpose(0, 1)[None]


@needs_kernels
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES + SPLIT_KV)
@pytest.mark.parametrize("name", list(ARCH_MODELS))
def test_the_fused_step_tracks_the_torch_model(arch_dir, name, kv_dtype, mode):
    """40 fused steps (past the window where there is one) against the torch model fed the
    same tokens, both held to the exact (fp64) result: the fused logits as close to it as
    the torch path's (fp32 K/V: the same arithmetic in another order; bf16, fp16: both round
    K/V alike; int8: INT8_QUERIES). Layer 0's K/V, computed from inputs that differ by fp32
    rounding, within one storage step (bf16 one ulp, int8 one code) or, fp32 and fp16, as
    exact as the torch path's (fp16: a value near 0 after cancellation may be a few of its
    own ulps off, its fp32 inputs' difference; test_fp16_rows_are_torchs_rounding_of_the_fp32_rows
    holds the rounding itself to torch's bit for bit)."""
    llm, folder, weights = _load(arch_dir, name, kv_dtype)
    window = _window(llm)
    prompt = _ids(llm, max(12, (window or 0) - 10), seed=11)
    tokens, fused, ref, fused_cache, torch_cache = fused_and_torch(llm, prompt, 40, mode)
    if window is not None:
        assert len(prompt) + len(tokens) > window + 16  # first visible keys past a chunk start
    if isinstance(fused_cache, HybridCache):  # past the ring: its slots reused
        assert len(prompt) + len(tokens) > fused_cache.parts[1].slots
    exact_llm = _exact(folder, weights)
    exact = exact_llm.runner.logits(prompt + tokens, exact_llm.new_cache("off"))[len(prompt) :]
    # q4: the queries stay fp32 (rotated), but the codes are 16x coarser than int8's, so a
    # code on a rounding boundary weighs as int8's query rounding does
    quantized = {"int8", "q4"} & set(kv_dtype.split("/"))
    factor = INT8_QUERIES if quantized else SAME_ROUNDING
    assert_as_exact_as(fused, ref, exact, factor)
    # q4 K on the 7-heads model (random weights, head_dim 64) moves the logits 2-8 from
    # exact on either path alike (as exact as each other, above): past what a top-5 rule
    # between the two can hold (it fails at one step of 40 before this model's scores
    # took one pass too); its other K dtypes keep the rule
    if not (name == "llama-hd64-g7" and kv_dtype.split("/")[0] == "q4"):
        assert_top_k_both_ways(fused, ref)
    if mode != "contiguous":
        return
    if "/" in kv_dtype:  # K's and V's rows apart, each by its dtype's rule below
        for kv, dtype in enumerate(kv_dtype.split("/")):
            ours, theirs = (_layer0_half(c, kv) for c in (fused_cache, torch_cache))
            if dtype == "fp16":
                exact_cache = exact_llm.new_cache("contiguous")
                exact_llm.runner.forward(prompt + tokens, exact_cache)
                exact_rows = _layer0_held(exact_cache)[0][kv]
                assert_as_exact_as(ours[0].float(), theirs[0].float(), exact_rows)
            else:
                _codes_within_one(ours, theirs, dtype)
        return
    (ours, scales, at), (theirs, _, _) = (_layer0_held(c) for c in (fused_cache, torch_cache))
    if kv_dtype in ("int8", "q4"):
        _codes_within_one((ours, scales), (theirs, None), kv_dtype)
    elif kv_dtype == "bf16":
        # each rounds its fp32 V to bf16: one ulp apart, plus how far apart the two fp32
        # values may be (a value near 0 after cancellation has a tiny ulp): each is within
        # (norm + product + bias) rounding of exact, (gamma_n + 8u + gamma_n + u)(|h| |Wv| +
        # |bias|), h layer 0's normalised input (the fp64 model's)
        a, b = ours.float(), theirs.float()
        ulp = torch.ldexp(torch.ones_like(a), torch.frexp(a.abs().maximum(b.abs()))[1] - 8)
        slack = (
            2
            * (2 * gamma(llm.config.hidden_size) + 9 * U32)
            * _v_magnitude(exact_llm, prompt + tokens)[..., at, :]
        )
        assert ((a - b).abs() <= ulp + slack.float()).all()
    else:
        exact_cache = exact_llm.new_cache("contiguous")
        exact_llm.runner.forward(prompt + tokens, exact_cache)
        assert_as_exact_as(ours, theirs, _layer0_held(exact_cache)[0])


@needs_kernels
def test_each_product_takes_its_own_activation_setting(arch_dir):
    """The fused step reads each product's act_int8 (a mask in its spec), as the torch step
    does: with the MLP's gate|up on fp32 activations and the other products on int8, the
    two steps still differ by summation order only (the same int8 codes), as they do with
    every product on int8; and the change moves the logits by the int8 rounding of that
    product's input, which is far larger."""
    folder = arch_dir("llama")
    llm = LLM(model=folder, progress=False, max_context=MAX_CONTEXT, weights="int4",
              activations="int8", prefill_dtype="fp32")  # fmt: skip
    prompt = _ids(llm, 12, seed=5)
    _, every, every_ref, *_ = fused_and_torch(llm, prompt, 6)
    for block in llm.model.layers:
        block.mlp.gate_up.act_int8 = False
    _, mixed, mixed_ref, *_ = fused_and_torch(llm, prompt, 6)
    order = max(float((every - every_ref).abs().max()), float((mixed - mixed_ref).abs().max()))
    assert float((mixed - mixed_ref).abs().max()) <= 4 * float((every - every_ref).abs().max())
    assert float((mixed[0] - every[0]).abs().max()) > 4 * order  # step 0: the same prefix
    assert_top_k_both_ways(mixed, mixed_ref)


def _mean_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean())


@needs_kernels
def test_int16_activations_in_the_fused_step(arch_dir):
    """--activations int16: the fused step reads each product's act_int16 (a second mask)
    as the torch step does. The two steps' last-bit differences upstream (the attention's
    summation order) meet 256x finer codes, so now and then a residual code lands one
    apart (e / 256 of its group), where int8's coarse codes stayed equal: the logits are
    held to a quarter of what the setting itself moves them by (on average over the
    vocabulary; a wrong mask would leave them as far apart as the setting moves them), one
    product at a time (the vocabulary projection's among them: a fifth bit) and the
    blocks' four; and int16's logits are far closer to fp32 activations' than int8's are."""
    folder = arch_dir("llama")
    opts = dict(model=folder, progress=False, max_context=MAX_CONTEXT, weights="int4",
                prefill_dtype="fp32")  # fmt: skip
    prompt = _ids(LLM(**opts), 12, seed=6)
    _, every, every_ref, *_ = fused_and_torch(LLM(**opts, activations="int8"), prompt, 3)
    int8_head = LLM(**opts, activations="int8")
    int8_head.model.lm_head.act_int8 = True  # the baseline of the vocabulary's int16
    _, _, head_ref, *_ = fused_and_torch(int8_head, prompt, 3)
    for keep in range(6):  # 0..3: that product alone; 4: the vocabulary's; 5: the blocks'
        llm = LLM(**opts, activations="int16")
        head = llm.model.lm_head
        for block in llm.model.layers:
            for i, lin in enumerate(block_products(block)):
                lin.act_int16 = keep in (i, 5)
        head.act_int8 = head.act_int16 = keep == 4
        tokens, one, one_ref, *_ = fused_and_torch(llm, prompt, 3)
        base = head_ref if keep == 4 else every_ref  # the same with int8 for int16
        moved = _mean_apart(one_ref[0], base[0])  # step 0: the same prefix for both
        assert _mean_apart(one, one_ref) <= moved / 4, keep
        assert_top_k_both_ways(one, one_ref)
    exact = LLM(**opts, activations="fp32")
    cache = exact.new_cache("contiguous")
    exact.runner.forward(prompt, cache)
    fp32 = exact.runner.forward([tokens[0]], cache)
    assert _mean_apart(one[0], fp32) * 16 < _mean_apart(every[0], fp32)


def _codes_within_one(ours: tuple, theirs: tuple, dtype: str) -> None:
    """int8 codes, or q4's two a byte: a code on a rounding boundary may take its
    neighbour; the fused step's parameters finite."""
    (a, scales), (b, _) = ours, theirs
    for shift in (0, 4) if dtype == "q4" else (None,):
        x, y = (a.int(), b.int()) if shift is None else ((t.int() >> shift) & 15 for t in (a, b))
        assert (x - y).abs().max() <= 1
    assert torch.isfinite(scales).all()


def _layer0_half(cache, kv: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layer 0's stored K (kv 0) or V rows of a contiguous cache (batch, kv_heads, n, row),
    and their parameters (None for floats), held as _layer0_held holds them."""
    if isinstance(cache, HybridCache):  # layer 0 is local: every ring slot (_layer0_held)
        store, held = cache.parts[1].store, slice(None)
    else:
        store, held = cache.store, slice(0, cache.num_tokens)
    values, scales = store.rows(kv)
    return values[0, ..., held, :], None if scales is None else scales[0, ..., held, :]


def _layer0_held(cache) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Layer 0's stored K/V rows of a contiguous cache, (2, batch, kv_heads, n, head_dim),
    their int8 (step, zero) or None, and the positions they hold: 0 .. n-1, or (a hybrid
    cache, whose layer 0 is local) every ring slot, holding the positions slot_pos says."""
    if isinstance(cache, HybridCache):
        store, held, at = cache.parts[1].store, slice(None), cache.parts[1].slot_pos
        assert (at >= 0).all()
    else:
        n = cache.num_tokens
        store, held, at = cache.store, slice(0, n), torch.arange(n)
    scales = store.scales[0, ..., held, :] if store.quantized else None
    return store.values[0, ..., held, :], scales, at


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES + SPLIT_KV)
@pytest.mark.parametrize("name", list(ARCH_MODELS))
def test_generate_runs_the_fused_step_and_keeps_the_greedy_tokens(
    arch_dir, name, kv_dtype, monkeypatch
):
    """LLM.generate decodes through the fused step (one call per token), and its greedy
    tokens, over a generation longer than the model's window, are the torch path's (equal
    up to a first divergence, where each side's token is in the other's top 5)."""
    llm, _, _ = _load(arch_dir, name, kv_dtype)
    window = _window(llm)
    n = (window or 16) + 24 + (RING_SLACK if llm.config.layer_windows else 0)  # past a ring
    prompt = _ids(llm, 8, seed=12)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    calls = counted_fused_runs(monkeypatch)
    fused = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert calls == [1] * (n - 1)  # every token after the first (the prefill's)
    reason, llm.runner.fused_reason = llm.runner.fused_reason, "off for the comparison"
    try:
        ref = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    finally:
        llm.runner.fused_reason = reason
    assert len(calls) == n - 1  # the torch run did not call it
    # the reference's logits on its own prefix: the exact ones (no cache), but over q4 K or
    # V, whose 4-bit rounding moves a tiny model's near-tied logits by more than the fused
    # step's own arithmetic does (ranks up to 9 on the torch path too), the torch path's
    # over the same q4 cache (one forward: its update hands back the stored rows)
    q4 = "q4" in kv_dtype.split("/")
    reason, llm.runner.fused_reason = llm.runner.fused_reason, "off for the reference"
    try:
        cache = llm.new_cache("contiguous" if q4 else "off")
        ref_logits = llm.runner.logits(prompt + ref.token_ids[:-1], cache)
    finally:
        llm.runner.fused_reason = reason
    assert_greedy_agreement(
        fused.token_ids,
        [list(lp.top) for lp in fused.logprobs],
        ref.token_ids,
        ref_logits[len(prompt) - 1 :],
    )


def _batched(llm: LLM, seqs: list[list[int]], seed: int) -> list[torch.Tensor]:
    """Every row's tokens one step at a time through the runner's batch over a paged pool
    (the engine's path), all rows that still have one together; each row's logits."""
    spec = llm.cache_spec("paged")
    pool = BlockPool(spec, sum(blocks_for(len(s), spec.block_size) for s in seqs))
    lengths = [len(s) for s in seqs]
    tables = scrambled_tables(pool, lengths, seed)
    windowed = [scrambled_tables(group, lengths, seed) for group in pool.groups[1:]]
    return feed_batched(llm, seqs, pool, tables, windowed)


def _lengths(llm: LLM) -> list[int]:
    """Rows of different lengths: within one block, across several, past 64 (two chunks),
    and for a window, past it with the first visible key at, just after and far from a
    multiple of 16 (17 rows: products in two tiles of 16)."""
    w = _window(llm)
    if w is None or w < 64:
        return [3, 16, 17, 40, 70, 9, 130, 1, 33, 64, 65, 5, 21, 48, 90, 12, 7]
    return [w + 2, w + 17, w + 40, w + 95, MAX_CONTEXT, 3, 70, w, w + 1, 17, 130, 1, 48,
            w + 16, w + 63, 9, 100]  # fmt: skip


def _rows_alone_and_together(llm: LLM) -> None:
    assert llm.runner.fused_reason is None
    lengths = _lengths(llm)
    assert max(lengths) <= MAX_CONTEXT
    g = torch.Generator().manual_seed(13)
    seqs = [torch.randint(3, llm.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    together = _batched(llm, seqs, seed=14)
    for b, tokens in enumerate(seqs):
        alone = _batched(llm, [tokens], seed=b)[0]
        assert torch.equal(together[b], alone), f"row {b}: batched != alone"
        assert torch.equal(together[b], feed_contiguous(llm, tokens)), (
            f"row {b}: paged != contiguous"
        )


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("name", list(ARCH_MODELS))
def test_a_row_gets_the_same_logits_alone_and_in_a_batch(arch_dir, name, kv_dtype):
    _rows_alone_and_together(_load(arch_dir, name, kv_dtype)[0])


def _layer0_rows(cache) -> torch.Tensor:
    """Layer 0's K and V of what `cache` holds: (2, kv_heads, n, head_dim)."""
    if isinstance(cache, PagedCache):
        ids = cache.tables[0][: blocks_for(cache.num_tokens, cache.pool.block_size)]
        rows = cache.pool.store.values[0, :, ids]  # (2, blocks, kv_heads, bs, D)
        return rows.transpose(1, 2).flatten(2, 3)[:, :, : cache.num_tokens]
    return cache.store.values[0, :, 0, :, : cache.num_tokens]


@needs_kernels
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama-bias", "llama-hd128"])
def test_fp16_rows_are_torchs_rounding_of_the_fp32_rows(arch_dir, name, mode):
    """The runner takes the fused step over an fp16 cache, contiguous or paged, and the
    layer-0 K/V rows it writes are torch's .to(float16) of the rows the same step writes
    into an fp32 cache, bit for bit (layer 0's K/V depend on the token and position alone,
    not on what the cache held before)."""
    rows = {}
    for kv_dtype in ("fp32", "fp16"):
        llm = _load(arch_dir, name, kv_dtype)[0]
        cache = llm.new_cache(mode)
        assert cache.spec.dtype == {"fp32": torch.float32, "fp16": torch.float16}[kv_dtype]
        assert llm.runner.fused_for(cache) is not None, llm.runner.fused_reason
        for t in _ids(llm, 70, seed=18):  # past 64: two blocks of a paged pool, two chunks
            llm.runner.forward([t], cache)
        rows[kv_dtype] = _layer0_rows(cache)
    assert rows["fp16"].dtype == torch.float16
    want = rows["fp32"].to(torch.float16)
    assert torch.equal(rows["fp16"].view(torch.int16), want.view(torch.int16))


@needs_kernels
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_fp16_rows_past_65504_are_inf_as_torch_writes_them(arch_dir, mode):
    """K and V beyond fp16's range (layer 0's input norm scaled by 2^20) are stored as inf
    by the fused step as by the torch step; finite ones as torch rounds them. The logits
    are not compared: inf keys make them NaN on both paths."""
    folder = arch_dir("llama-bias")
    written = []
    for fused in (True, False):
        llm = LLM(model=folder, progress=False, max_context=MAX_CONTEXT, weights="int4",
                  kv_dtype="fp16", activations="fp32", prefill_dtype="fp32")  # fmt: skip
        llm.model.layers[0].input_norm.weight.mul_(2.0**20)  # in place: the C step's pointer
        if not fused:
            llm.runner.fused_reason = "off for the comparison"
        cache = llm.new_cache(mode)
        assert (llm.runner.fused_for(cache) is not None) == fused
        for t in _ids(llm, 5, seed=19):
            llm.runner.forward([t], cache)
        written.append(_layer0_rows(cache))
    ours, theirs = written
    assert torch.isinf(ours).any() and torch.isfinite(ours).any()
    a, b = ours.float(), theirs.float()
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a.sign(), b.sign())
    e = (torch.frexp(a.abs().maximum(b.abs()))[1] - 11).clamp(min=-24)  # finite: one ulp
    fin = torch.isfinite(a)
    assert ((a[fin] - b[fin]).abs() <= torch.ldexp(torch.ones_like(a[fin]), e[fin])).all()


@needs_kernels
def test_the_window_is_the_torch_masks_window(arch_dir):
    """The fused step's window is causal_mask's, not one key more or less: after the same
    prefill, its logits past the window are as exact as the torch path's, and far from the
    step's own with a window one longer or one shorter (so an off-by-one could not pass)."""
    llm, folder, weights = _load(arch_dir, "mistral-window")
    w, n = llm.config.sliding_window, 30
    prompt = _ids(llm, n, seed=15)
    exact_llm = _exact(folder, weights)
    exact = exact_llm.runner.logits(prompt, exact_llm.new_cache("off"))[-1]
    ref = llm.runner.forward(prompt, llm.new_cache("contiguous"))  # torch: one prefill
    spec = llm.cache_spec("paged")
    pool, table = BlockPool(spec, 4), [2, 0]
    llm.runner.run(PoolBatch([prompt[:-1]], pool, spec, [table], [0]))
    decoder = llm.runner._decoder(spec.max_tokens)
    views = [KVView(pool.store, [table], pool.block_size)]
    got = {
        width: decoder.run(views, prompt[-1:], [n - 1], width)[0]
        for width in (w - 1, w, w + 1)  # each rewrites position n - 1 before reading it
    }
    assert_as_exact_as(got[w], ref, exact)
    last = PoolBatch([prompt[-1:]], pool, spec, [table], [n - 1])
    runner_step = llm.runner.run(last)[0]
    assert torch.equal(got[w], runner_step)  # the runner passes the spec's window
    own = float((ref.double() - exact.double()).abs().max())
    for width in (w - 1, w + 1):  # a different function, not rounding
        assert float((got[width].double() - exact.double()).abs().max()) > 1000 * own


@needs_kernels
@pytest.mark.parametrize("name", ["mistral-window", "qwen3", "llama-bias", "gemma3"])
def test_the_engine_batches_them_through_the_fused_step(arch_dir, name, monkeypatch):
    """The server's engine runs the decode rows of every request in one fused call, and each
    request gets the tokens it gets alone (the batch is invariant)."""
    folder, weights = arch_dir(name), _weights(name)
    llm = low_bit_llm(model=folder, max_context=MAX_CONTEXT, weights=weights)
    engine = Engine(llm, EngineConfig(num_blocks=64))
    assert llm.runner.fused_reason is None
    calls = counted_fused_runs(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = {f"r{i}": _ids(llm, n, seed=20 + i) for i, n in enumerate([5, 12, 20, 31])}

    def run(requests):
        for rid, ids in requests.items():
            engine.add_request(rid, ids, params)
        out: dict[str, list[int]] = {rid: [] for rid in requests}
        while engine.has_work():
            for ev in engine.step():
                out[ev.request_id].extend(ev.token_ids)
        return out

    together = run(prompts)
    assert max(calls) == len(prompts)  # the decode rows in one fused call
    assert all(len(t) == 24 for t in together.values())
    for rid, ids in prompts.items():
        assert run({rid: ids})[rid] == together[rid], rid


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize(
    "name", ["mistral-window", "mistral-hd64-window", "qwen3", "llama-bias", "gemma3-hd256"]
)
def test_the_portable_build_runs_them_alike(arch_dir, march, name, kv_dtype, monkeypatch):
    """The scalar attention (the visible keys row by row) and products of a build without
    AVX-512: as close to the exact result as the AVX-512 build, and a batch invariant too;
    the AVX2 halves likewise."""
    portable = portable_kernels(march)
    llm, folder, weights = _load(arch_dir, name, kv_dtype)
    window = _window(llm)
    prompt = _ids(llm, max(12, (window or 0) - 4), seed=16)
    steps = _ids(llm, 24, seed=17)
    logits = []
    for lib in (kernels.library(), portable):
        logits.append(fused_steps_on(llm, lib, prompt, steps)[0])
    exact_llm = _exact(folder, weights)
    exact = exact_llm.runner.logits(prompt + steps, exact_llm.new_cache("off"))[len(prompt) :]
    factor = INT8_QUERIES if kv_dtype == "int8" else SAME_ROUNDING
    # fp32 K/V: two orders of the same arithmetic; fp16 (F16C or the portable conversion)
    # and int8: both round queries and K/V alike
    assert_as_exact_as(logits[1], logits[0], exact, factor)
    assert_as_exact_as(logits[0], logits[1], exact, factor)
    if name == "mistral-window":
        monkeypatch.setattr(kernels, "library", lambda: portable)
        scalar = LLM(model=folder, progress=False, max_context=MAX_CONTEXT, weights=weights,
                     kv_dtype=kv_dtype, activations="fp32", prefill_dtype="fp32")  # fmt: skip
        _rows_alone_and_together(scalar)


@needs_kernels
def test_kv_int8_mode_takes_the_fused_step_like_paged_int8():
    """`--kv int8` is `--kv paged --kv-dtype int8` (the same cache class but for its
    name): the single stream decodes through the fused step in both, to the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for kv, kv_dtype in (("int8", None), ("paged", "int8")):
        llm = low_bit_llm(kv=kv, kv_dtype=kv_dtype, max_context=256)
        assert llm.runner.fused_for(llm.new_cache()) is not None, kv
        outs.append(llm.generate("The capital of France is", params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("reject", [0, 1, 3, 5])
def test_a_gemma_draft_in_the_fused_step_rolls_its_ring_back(arch_dir, kv_dtype, reject,
                                                            monkeypatch):  # fmt: skip
    """The last token and a draft of 5, checked as 6 rows of one fused step on a hybrid
    cache whose ring has wrapped, `reject` of them rolled back: each kept row's logits are
    those of the fused step fed its token alone, and the cache (the whole part's rows, the
    ring's values, scales and positions) bit for bit that of a cache fed the kept tokens
    one at a time, so the next token's logits are too."""
    llm = _load(arch_dir, "gemma3", kv_dtype)[0]
    ids, draft = _ids(llm, 50, seed=21), _ids(llm, 5, seed=22)
    a, b = fused_draft_rolled_back(llm, ids, draft, reject, monkeypatch)
    assert len(ids) - 1 > a.parts[1].slots  # the prefill went past the ring
    n = a.num_tokens
    assert n == b.num_tokens and torch.equal(a.parts[1].slot_pos, b.parts[1].slot_pos)
    for key, t in a.parts[1].store.raw(()).items():
        assert torch.equal(t, b.parts[1].store.raw(())[key]), key
    held = (slice(None),) * 4 + (slice(0, n),)
    for key, t in a.parts[0].store.raw(held).items():
        assert torch.equal(t, b.parts[0].store.raw(held)[key]), key
    assert torch.equal(llm.runner.forward([7], a), llm.runner.forward([7], b))


def test_a_draft_longer_than_the_rings_slack_stays_with_the_torch_step(arch_dir):
    """The fused step writes every row's K/V before any row attends: on a ring of W + 32
    slots, row 33 of a draft would overwrite a key row 0 reads, so such a draft is the
    torch step's (which reads each row's ring as it was)."""
    llm = _load(arch_dir, "gemma3")[0]
    cache = llm.new_cache("contiguous")
    decoder = llm.runner.fused_for(cache)
    slack = cache.parts[1].slots - cache.groups[1].kind.window
    assert decoder.drafts(cache, slack + 1) and not decoder.drafts(cache, slack + 2)


@needs_kernels
def test_the_fused_step_reads_a_cache_of_three_layer_groups(arch_dir):
    """The fused step reads what a cache declares (KVCache.kv_views: a view per layer
    group), so a hybrid cache of two rings is read as one of one: the tiny Gemma 3 with
    local windows 8 and 16 (no file names two windows yet: its config is changed in place
    before any cache is made), greedy past both rings, as exact as the torch path against
    fp64; drafts only as long as the tighter ring keeps what the first row reads."""
    folder, weights = arch_dir("gemma3"), _weights("gemma3")
    options = {"progress": False, "max_context": MAX_CONTEXT, "weights": weights,
               "activations": "fp32", "prefill_dtype": "fp32"}  # fmt: skip
    made = [LLM(model=folder, dtype=d, **options) for d in ("fp32", "fp64")]
    for llm in made:
        assert llm.config.layer_windows == (8, 8, None, 8)
        llm.config = llm.model.config = replace(llm.config, layer_windows=(8, 16, None, 8))
    llm, exact_llm = made
    prompt = _ids(llm, 30, seed=5)
    tokens, fused, ref, cache, _ = fused_and_torch(llm, prompt, 40)
    assert [len(g.layers) for g in cache.groups] == [1, 2, 1]
    assert len(prompt) + len(tokens) > cache.parts[2].slots == 16 + RING_SLACK
    exact = exact_llm.runner.logits(prompt + tokens, exact_llm.new_cache("off"))[len(prompt) :]
    assert_as_exact_as(fused, ref, exact, SAME_ROUNDING)
    decoder = llm.runner.fused_for(cache)
    assert decoder.drafts(cache, RING_SLACK + 1) and not decoder.drafts(cache, RING_SLACK + 2)


@pytest.fixture(scope="module")
def gemma_q4_k_m(tmp_path_factory):
    """A Gemma 3 of head_dim 256 (4 query heads per KV head) as a Q4_K_M file of Gemma's
    kinds: q Q5_0 and k Q8_0 (what llama.cpp falls back to for rows that are not a
    multiple of 256, as Gemma 3 270M's 640 and 1B's 1152 are), v, down and the tied
    vocabulary Q6_K, the rest Q4_K."""
    from gguf import GGMLQuantizationType as Q

    from helpers import sentencepiece_vocab, write_gguf_from_hf

    folder = save_tiny_model(
        tmp_path_factory.mktemp("gemma-q4km"), "gemma3", seed=15,
        vocab_size=len(sentencepiece_vocab()[0]), hidden_size=256, intermediate_size=512,
        head_dim=256, num_key_value_heads=1,
    )  # fmt: skip
    types = {"*attn_q.*": Q.Q5_0, "*attn_k.*": Q.Q8_0, "*attn_v*": Q.Q6_K,
             "*ffn_down*": Q.Q6_K, "token_embd*": Q.Q6_K, "*": Q.Q4_K}  # fmt: skip
    return write_gguf_from_hf(folder, folder / "m.gguf", arch="gemma3", types=types)


@needs_kernels
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_a_gemma3_q4_k_m_file_takes_the_fused_step(gemma_q4_k_m, mode):
    """--weights native on Gemma's Q4_K_M kinds: every projection, the vocabulary's
    included, goes to the fused step in its stored kinds (q|k|v as parts Q5_0, Q8_0,
    Q6_K; no dequantized copy), and its logits over 40 steps (past the window and the
    ring) are as close to the exact ones as the torch path's."""
    llm = low_bit_llm(model=gemma_q4_k_m, max_context=MAX_CONTEXT)
    assert llm.runner.fused_reason is None, llm.runner.fused_reason
    model = llm.model
    for block in model.layers:
        assert [p.kind for p in block.attn.qkv.quant.parts()] == ["q5_0", "q8", "q6_k"]
        assert block.mlp.gate_up.quant.kind == "q4_k" and block.mlp.down.quant.kind == "q6_k"
    head = model.lm_head
    assert head.kernel == "quant" and head.quant.kind == "q6_k"
    assert head.quant.data.dtype == torch.uint8  # the file's blocks, not fp32 weights
    prompt = _ids(llm, 12, seed=23)
    tokens, fused, ref, _, _ = fused_and_torch(llm, prompt, 40, mode)
    exact = low_bit_llm(model=gemma_q4_k_m, max_context=MAX_CONTEXT, dtype="fp64")
    want = exact.runner.logits(prompt + tokens, exact.new_cache("off"))[len(prompt) :]
    assert_as_exact_as(fused, ref, want, SAME_ROUNDING)
    assert_top_k_both_ways(fused, ref)
