"""One forward per engine step: a step's prompt chunks and decode rows as one ragged
forward (kvlm.cache.paged.RaggedStep), the road a GPU takes (ModelRunner.one_forward).

On the CPU the runner keeps a forward per chunk (a prompt's bits do not depend on its
neighbours); here it is switched to the ragged forward to check its arithmetic: every
sequence's logits as close to the exact (fp64) ones as the forward-per-chunk road's are,
and the engine's greedy tokens held to the top-5 rule against that road. The GPU's own
kernel (FlashAttention's varlen) is checked in tests/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_greedy_agreement, mixed_step
from kvlm import SamplingParams
from kvlm.cache.paged import RaggedStep
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.scheduler import SchedulerConfig
from numerics import assert_as_exact_as


def test_a_ragged_step_computes_what_each_chunk_alone_does(tiny, exact, monkeypatch):
    made = []
    real = RaggedStep.__init__

    def spy(self, *args, **kwargs):
        made.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(RaggedStep, "__init__", spy)
    ragged = mixed_step(tiny, True)
    assert len(made) == 1  # the whole step was one forward
    split = mixed_step(tiny, False)
    assert len(made) == 1  # and the other road none
    exact_rows = mixed_step(exact, False)
    for i, (got, ref, ex) in enumerate(zip(ragged, split, exact_rows, strict=True)):
        assert got.shape == ref.shape, f"row {i}"
        assert_as_exact_as(got, ref, ex)


@pytest.mark.parametrize("chunk", [4, 64])
def test_the_engine_on_one_forward_per_step_follows_a_forward_per_chunk(tiny, chunk):
    """Requests arriving while others decode, prompts in chunks (4) or whole (64): each
    mixed step one ragged forward; greedy tokens held to the top-5 rule against the
    forward-per-chunk road, every block back in the pool at the end."""
    prompts = [tiny.tokenizer.encode(p) for p in ("Once upon a time there was", "def f(x):",
               "The capital of France is Paris and the capital of", "Red, green and")]  # fmt: skip

    def run(one_forward: bool) -> dict[str, list]:
        cfg = EngineConfig(num_blocks=64, scheduler=SchedulerConfig(prefill_chunk=chunk))
        engine = Engine(tiny, cfg)
        engine.runner.one_forward = one_forward
        out: dict[str, list] = {}
        try:
            params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
            mixed = 0
            for step in range(200):
                if step < len(prompts):  # one more request per step: chunks meet decodes
                    engine.add_request(str(step), prompts[step], params)
                if not engine.has_work():
                    break
                for ev in engine.step():
                    out.setdefault(ev.request_id, []).extend(ev.logprobs)
                b = engine.last_plan
                mixed += bool(b.prefill and b.decode)
            assert mixed >= 2, "no step held a prompt chunk and decode rows together"
            assert engine.pool.num_used == 0
        finally:
            engine.runner.one_forward = False
        return out

    def top(lps: list) -> tuple[list[int], list[list[int]], torch.Tensor]:
        """Tokens, each step's top 5, and logits that rank those 5 first."""
        logits = torch.full((len(lps), tiny.config.vocab_size), -torch.inf)
        for i, lp in enumerate(lps):
            for t, v in lp.top.items():
                logits[i, t] = v
        return [lp.token_id for lp in lps], [list(lp.top) for lp in lps], logits

    ragged, split = run(True), run(False)
    assert set(ragged) == set(split) == {str(i) for i in range(len(prompts))}
    for rid in split:
        assert len(ragged[rid]) == len(split[rid]) == 12
        ours, our_top, _ = top(ragged[rid])
        ref, _, ref_logits = top(split[rid])
        assert_greedy_agreement(ours, our_top, ref, ref_logits)
