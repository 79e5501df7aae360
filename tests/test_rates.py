"""Every rate counts what it names: a decode rate counts tokens (every sample's, every
draft token a sample kept), not steps or events, on every road a user reads one from
(`RequestOutput.metrics` of `LLM.generate`, `LLM.stream` and a chat turn, `kvlm generate
--json`, `kvlm bench`'s speculative rows, the server's usage and /metrics).

Each figure is held to the clock without a timed assert: the tokens it counts are the
tokens the user got, and the time it divides by lies between the forwards it spans and
the wall-clock time of the call around it."""

from __future__ import annotations

import json
import math
import time

import pytest

from kvlm import LLM, SamplingParams
from kvlm.engine.speculative import SpeculativeConfig

TEXT = (
    "The KV cache stores the keys and values of every token already processed, which turns "
    "generation from reprocessing the whole sequence into processing one token and attending "
    "over the cache. Paged caches split it into blocks so that many requests share one pool."
)
COPY = "Repeat this text word for word:\n\n" + TEXT
NEW = 96
pytestmark = pytest.mark.slow  # the default model: drafts a copy prompt accepts


@pytest.fixture(scope="module")
def llms():
    plain = LLM(progress=False, max_context=1024)
    spec = LLM(progress=False, max_context=1024, speculative=SpeculativeConfig(num_draft=6))
    return plain, spec


def copy_ids(llm: LLM) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": COPY}])


def assert_counts_tokens(out, wall_s: float, first_step: int) -> None:
    """`out`'s decode rate counts every token after the first step's (`first_step`: one a
    sample) over a time within [the forwards after the first token, the call's wall time]."""
    m = out.metrics
    tokens = sum(len(o.token_ids) for o in out.outputs)
    assert tokens > first_step + 8  # something was decoded
    assert m.decode_tokens == tokens - first_step
    after_first = sum(m.per_forward_ms[m._prefill_forwards :])  # each inside [first, last]
    assert after_first <= m.decode_ms <= wall_s * 1000.0
    assert math.isclose(m.decode_tokens_per_s, m.decode_tokens / (m.decode_ms / 1000.0))
    # the clock's own lower bound: every token after the first within the call's time
    assert m.decode_tokens_per_s >= (tokens - first_step) / wall_s


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def test_plain_and_n_samples_count_every_token(llms):
    plain, _ = llms
    ids = copy_ids(plain)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    out, wall = timed(lambda: plain.stream(ids, greedy).run())
    assert_counts_tokens(out, wall, first_step=1)
    # n samples: a step emits one token a live sample, every one counted
    sampled = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=NEW // 2, ignore_eos=True)
    (out,), wall = timed(lambda: plain.generate(prompt_token_ids=[ids], sampling_params=sampled))
    assert len(out.outputs) == 3
    assert_counts_tokens(out, wall, first_step=3)


def test_speculative_rates_count_the_accepted_drafts(llms):
    """A step that keeps k draft tokens emits k + 1 tokens: the rate counts them all (it
    counted one a step, reading ~44 tok/s where the clock said ~370)."""
    _, spec = llms
    ids = copy_ids(spec)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    # LLM.generate with speculative: the pool engine (run_batch)
    (out,), wall = timed(lambda: spec.generate(prompt_token_ids=[ids], sampling_params=params))
    stats = spec.batch_engine().stats.spec
    assert stats.tokens_per_forward > 2  # drafts were kept: events are far fewer than tokens
    assert_counts_tokens(out, wall, first_step=1)
    # a chat turn on its own cache (kvlm chat / kvlm generate's road: the DraftBatch)
    session = spec.chat_session(params)
    turn, wall = timed(lambda: session.send(COPY).run())
    assert turn.metrics.decode_tokens > 0 and session.engine.stats.spec.tokens_per_forward > 2
    assert_counts_tokens(turn, wall, first_step=1)


def test_kvlm_generate_json_and_bench_count_the_accepted_drafts(llms, capsys):
    from kvlm.bench import run_kvlm_speculative
    from kvlm.cli import main

    t0 = time.perf_counter()
    code = main(["generate", COPY, "--json", "--speculative", "ngram", "--max-new-tokens",
                 str(NEW), "--ignore-eos", "--max-context", "1024"])  # fmt: skip
    wall = time.perf_counter() - t0
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["speculative"]["tokens_per_forward"] > 2
    m = record["metrics"]
    assert m["decode_tokens"] == record["completion_tokens"] - 1 == NEW - 1
    assert m["decode_ms"] <= wall * 1000.0
    assert math.isclose(m["decode_tokens_per_s"], m["decode_tokens"] / m["decode_ms"] * 1000,
                        rel_tol=1e-3)  # fmt: skip
    # kvlm bench's speculative row: the same request timed by the clock around it
    _, spec = llms
    row, wall = timed(lambda: run_kvlm_speculative(spec, copy_ids(spec), NEW, spec.speculative))
    assert row["tokens_per_forward"] > 2
    assert row["decode_tok_s"] >= (NEW - 1) / wall
