"""One answer whatever the cache does: a prompt row's bits follow its position, never its
chunk, under the numerics each CPU family gets by default (kvlm.defaults), so a request's
tokens are the same cold, as a prefix hit, batched beside others and at any prefill chunk
size (a tier's hit after a restart is a prefix hit whose blocks came back as bytes).

On an Intel Xeon with AMX the defaults' bf16 prompt products went through oneDNN at the
chunk's row count (padded to 16 shapes an octave) and its prompt attention through torch's
flash attention, which splits a chunk's rows by its length: a 13-row prefix hit and a
256-row chunk gave other bits than a 621-row prompt, and the same chat request answered
differently the second time. Elsewhere a chunk of 16 rows or fewer took the C kernel where
a longer one took a dense GEMM (fp32 prompt products: CPUs without VNNI, and the
vocabulary projection everywhere). Each family's numerics run here on this CPU's kernels
(and the AVX2 family's on the portable builds too): a family whose fast kernel this CPU
lacks (AMX's tiles) runs oneDNN's road for the same dtype, so a test here holds the road,
and on that CPU the same test holds its kernels."""

from __future__ import annotations

import pytest
import torch

from helpers import portable_build_params, portable_kernels
from kvlm import LLM, SamplingParams, kernels
from kvlm import defaults as defaults_mod
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.runner import CacheBatch
from kvlm.engine.scheduler import SchedulerConfig

pytestmark = pytest.mark.slow  # the default model

# CPU family: (the flags it reports, whether its kernels have VNNI) -> what kvlm.defaults
# resolves for a low-bit file (activations, prompt products, prompt attention bf16 from)
FAMILIES = {
    "amx": ({"amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2"}, True,
            ("int16", "bf16", 0)),
    "avx512-vnni-bf16": ({"avx512_bf16", "avx512_vnni", "avx512f", "avx2"}, True,
                         ("int16", "int8", defaults_mod.LONG_ATTENTION)),
    "avx512-vnni": ({"avx512_vnni", "avx512f", "avx2"}, True, ("int16", "int8", None)),
    "avx2": ({"avx2", "fma", "f16c"}, False, ("fp32", "fp32", None)),
}  # fmt: skip
SYSTEM = "You are a careful assistant for a shipping company. "


class _Lib:
    """This CPU's kernels, answering kvlm_kernel_vnni as another family's would."""

    def __init__(self, lib, vnni: bool) -> None:
        self._lib, self._vnni = lib, vnni

    def kvlm_kernel_vnni(self) -> int:
        return int(self._vnni)

    def __getattr__(self, name):
        return getattr(self._lib, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_cpu_familys_defaults_are_the_ones_named_here(monkeypatch, family, default_model_path):
    from kvlm.loading.gguf import GGUFWeights

    flags, vnni, (activations, prefill, bf16_from) = FAMILIES[family]
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.status())
    monkeypatch.setattr(kernels, "cpu_flags", lambda: sorted(flags))
    monkeypatch.setattr(kernels, "library", lambda: _Lib(lib, vnni))
    got = defaults_mod.resolve(weights="auto", activations="auto", prefill_dtype="auto",
                               kv_dtype="auto", exact=False, fp32_cpu=True,
                               source=GGUFWeights(default_model_path))  # fmt: skip
    assert (got.weights, got.activations, got.prefill_dtype, got.kv_dtype) == (
        "native",
        activations,
        prefill,
        "fp16",
    )
    assert got.attention_bf16_from == bf16_from


def _prompt(llm: LLM, repeat: int = 20) -> list[int]:
    """A chat prompt of SYSTEM `repeat` times: 219 tokens at 20, 149 at 13 (the default
    model's tokenizer)."""
    messages = [{"role": "system", "content": SYSTEM * repeat},
                {"role": "user", "content": "Name three rivers."}]  # fmt: skip
    return llm.tokenizer.encode_chat(messages)


def _logits(llm: LLM, ids: list[int], cuts: list[tuple[int, int]]) -> torch.Tensor:
    """Every prompt row's logits, the prompt fed as the engine feeds a chunk (prompt=True)."""
    cache = llm.new_cache("contiguous")
    rows = [llm.runner.run(CacheBatch([ids[a:b]], cache, prompt=True, all_rows=True))[0]
            for a, b in cuts]  # fmt: skip
    return torch.cat(rows)


def _cuts(n: int) -> dict[str, list[tuple[int, int]]]:
    """Chunks of 17 rows, one more than the C kernel's SMALL_M (a chunk of 16 or fewer took
    it where a longer one took a dense GEMM): three, the last of the prompt, after one of
    n - 51 rows (past a PROMPT_BLOCK's 128: a row count of its own). Not the whole prompt
    in 17s: each chunk is a forward of its own, on the fp32 and bf16 roads of 128 rows
    however short (kvlm.model.quant.row_blocks), and the 64s and the prefix hit cover
    every row at other row counts."""
    return {
        "chunks of 64": [(a, min(a + 64, n)) for a in range(0, n, 64)],
        "a prefix hit leaving 13 rows": [(0, n - 13), (n - 13, n)],
        "chunks of 17": [(0, n - 51), (n - 51, n - 34), (n - 34, n - 17), (n - 17, n)],
        "the last rows one by one": [(0, n - 3), (n - 3, n - 2), (n - 2, n - 1), (n - 1, n)],
    }


def _assert_rows_whole_or_chunked(
    llm: LLM, only: tuple[str, ...] | None = None, repeat: int = 20
) -> None:
    """`only`: these of `_cuts` (the portable builds: the scalar one runs a prompt in ~4 s);
    `repeat`: the prompt's (_prompt)."""
    ids = _prompt(llm, repeat)
    whole = _logits(llm, ids, [(0, len(ids))])
    for name, cuts in _cuts(len(ids)).items():
        if only is not None and name not in only:
            continue
        got = _logits(llm, ids, cuts)
        differ = (got != whole).any(dim=-1).nonzero().flatten().tolist()
        assert not differ, f"{name}: rows {differ[:8]} differ from the whole prompt's"


def _family_llm(family: str) -> LLM:
    activations, prefill, _ = FAMILIES[family][2]
    return LLM(progress=False, max_context=1024, activations=activations, prefill_dtype=prefill)


@pytest.fixture(scope="module")
def family_llm():
    """family (of FAMILIES, or "exact") -> its LLM on this CPU's kernels, each loaded once
    for the chunk and thread-count tests (neither changes it)."""
    made: dict[str, LLM] = {}

    def get(family: str) -> LLM:
        if family != "exact" and kernels.library() is None:
            pytest.skip(kernels.status())
        if family not in made:
            made[family] = (LLM(progress=False, max_context=1024, exact=True)
                            if family == "exact" else _family_llm(family))  # fmt: skip
        return made[family]

    return get


@pytest.mark.parametrize("family", [*FAMILIES, "exact"])
def test_a_prompt_row_has_its_bits_whole_or_in_any_chunks(family_llm, family):
    _assert_rows_whole_or_chunked(family_llm(family))


@pytest.mark.parametrize("march", portable_build_params())
def test_the_portable_builds_keep_a_rows_bits(monkeypatch, march):
    """The AVX2 family's numerics on the builds of CPUs without AVX-512 (the AVX2 halves,
    the scalar loops): a prefix hit's rows, and the last rows one by one (the scalar
    build's one-row loop); chunks of 64 and 17 take the same kernels at other row counts,
    and the native build runs them all."""
    portable = portable_kernels(march)
    monkeypatch.setattr(kernels, "library", lambda: portable)
    only = ("a prefix hit leaving 13 rows", "the last rows one by one")
    # 149 tokens: still past a PROMPT_BLOCK (the prefix hit's first chunk of 136 rows is two
    # prompt calls), a third fewer rows through the scalar loops than the 219 of the others
    _assert_rows_whole_or_chunked(_family_llm("avx2"), only, repeat=13)


def test_the_engine_answers_alike_cold_as_a_prefix_hit_batched_and_chunked():
    """This CPU's defaults on the serving engine's pool: the same greedy tokens for the
    request cold, again (a prefix hit), beside two others, and at other chunk sizes."""
    llm = LLM(progress=False, max_context=1024)
    ids = _prompt(llm)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    others = [llm.tokenizer.encode("The river Danube flows"), ids[:-20] + ids[-5:]]

    def answers(chunk: int, batch: list[list[int]], repeat: int = 1) -> list[list[int]]:
        sched = SchedulerConfig(prefill_chunk=chunk)
        engine = Engine(llm, EngineConfig(num_blocks=None, kv_memory=64 << 20, scheduler=sched))
        runs = []
        for _ in range(repeat):
            out: dict[str, list[int]] = {}
            cached = {}
            for i, prompt in enumerate(batch):
                engine.add_request(f"r{len(runs)}-{i}", prompt, params)
            for _ in range(2000):
                if not engine.has_work():
                    break
                for ev in engine.step():
                    out.setdefault(ev.request_id, []).extend(ev.token_ids)
                    cached[ev.request_id] = ev.cached_tokens
            runs.append((out[f"r{len(runs)}-0"], cached[f"r{len(runs)}-0"]))
        return runs

    (cold, none), (again, hit) = answers(256, [ids], repeat=2)
    assert none == 0 and hit > len(ids) - 16  # the second run was a prefix hit
    assert again == cold
    ((batched, _),) = answers(256, [ids, *others])
    assert batched == cold
    for chunk in (64, 700):
        ((chunked, _),) = answers(chunk, [ids])
        assert chunked == cold, chunk


def _decode_logits(llm: LLM, ids: list[int], steps: int = 6) -> torch.Tensor:
    """The logits of the prompt's last row and of `steps` greedy decode rows after it, on
    the road the engine's decode rows take (one row against the cache)."""
    cache = llm.new_cache(llm.kv_mode)
    rows = [llm.runner.run(CacheBatch([ids], cache, prompt=True))[0][-1:]]
    for _ in range(steps):
        token = int(rows[-1][-1].argmax())
        rows.append(llm.runner.run(CacheBatch([[token]], cache))[0][-1:])
    return torch.cat(rows)


@pytest.mark.parametrize("family", [*FAMILIES, "exact"])
def test_a_rows_bits_are_the_same_on_one_thread_or_two(family_llm, family):
    """The engine moves its OpenMP thread count while it runs (kvlm.engine.threads: fewer
    when other work takes the cores), so the count must never change a token: every
    prompt row's logits and a few decode steps' are bit-equal on 1 and 2 threads."""
    llm = family_llm(family)
    ids, was = _prompt(llm), torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)  # as the engine does: torch's count, not OpenBLAS's
            got[n] = (_logits(llm, ids, [(0, len(ids))]), _decode_logits(llm, ids))
    finally:
        torch.set_num_threads(was)
    prompt_rows = (got[1][0] != got[2][0]).any(dim=-1).nonzero().flatten().tolist()
    assert not prompt_rows, f"prompt rows {prompt_rows[:8]} differ between 1 and 2 threads"
    steps = (got[1][1] != got[2][1]).any(dim=-1).nonzero().flatten().tolist()
    assert not steps, f"decode steps {steps} differ between 1 and 2 threads"


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_decode_row_has_its_bits_on_any_thread_count(tiny_model_dir, name):
    """The engine picks its thread count from the cores other work leaves free
    (kvlm.engine.threads), so two runs of one request, or a batch and a row alone, may run
    on different counts: an HF folder's dense road (oneDNN's products, kvlm_attend for
    decode rows too: torch's SDPA split one row's keys across threads) gives a decode row
    the same bits on 1 and 2 threads, and so does the prompt before it."""
    llm = LLM(model=tiny_model_dir(name), progress=False, max_context=256, threads=2)
    ids = list(range(5, 60))
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = llm.new_cache("contiguous")
            prompt = llm.runner.run(CacheBatch([ids], cache, prompt=True, all_rows=True))[0]
            decode = torch.stack([llm.runner.forward([7 + i], cache) for i in range(8)])
            runs.append((prompt, decode))
    finally:
        torch.set_num_threads(before)
    assert llm.runner.fused_for(llm.new_cache("contiguous")) is None  # the torch step
    assert torch.equal(runs[0][0], runs[1][0]), "prompt rows"
    assert torch.equal(runs[0][1], runs[1][1]), "decode rows"


def test_mkls_products_have_their_bits_on_any_thread_count():
    """kvlm sets MKL's strict reproducibility (MKL_CBWR) before MKL's first call: torch's
    fp32 GEMMs of a prompt block's shapes give the same bits on 1 and 2 threads (on an AMX
    Xeon, without it, 128 x 1536 -> 576 did not). A fresh process: MKL reads the setting
    once. Not fp64: that road is the tests' reference alone (quant.py's fp64 sums), bound
    by no contract, and on the CI's AVX2-only CPU MKL's fp64 128 x 8192 -> 2048 differed
    between 1 and 2 threads even under STRICT."""
    import os
    import subprocess
    import sys

    code = """
import os, kvlm, torch
assert os.environ["MKL_CBWR"] == "AUTO,STRICT"
torch.manual_seed(0)
for m, k, n in ((128, 1536, 576), (128, 576, 1536), (128, 8192, 2048), (16, 2048, 64)):
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = []
    for t in (1, 2):
        torch.set_num_threads(t)
        got.append(torch.matmul(x, w.t()))
    assert torch.equal(*got), (m, k, n)
"""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
