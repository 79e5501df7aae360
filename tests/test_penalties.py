"""Penalties, logit_bias and min_p: the arithmetic against its definition, their effect on
real generations, and the property the engine needs: a sample's tokens are the same alone
and in a batch (each sample keeps its own counts)."""

from __future__ import annotations

import math

import pytest
import torch

from kvlm import SamplingParams
from kvlm.engine.sampling import Penalties, Sampler, _min_p_filter
from kvlm.errors import InvalidRequestError


def _reference(logits, prompt, generated, p: SamplingParams):
    """vLLM's order, written out one token at a time in fp64."""
    x = logits.double().clone()
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(generated):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(generated):
        x[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    return x


def test_penalties_follow_their_definition():
    torch.manual_seed(0)
    V = 50
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.3,
                       logit_bias={3: 5.0, 49: -100.0, 7: 0.5})  # fmt: skip
    prompt = [1, 2, 2, 40]
    pen = Penalties(p, prompt)
    generated: list[int] = []
    for token in [5, 5, 3, 40, 5, 11]:
        logits = torch.randn(V) * 4
        got = pen.apply(logits)
        ref = _reference(logits, prompt, generated, p)
        # each entry: at most 4 fp32 roundings (bias add, scale, two subtractions)
        assert torch.allclose(got.double(), ref, rtol=8 * 2**-24, atol=8 * 2**-24 * 100)
        assert not torch.equal(got, logits)  # a new tensor; the model's logits unchanged
        pen.count(token)
        generated.append(token)


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_of_the_best():
    x = torch.tensor([2.0, 1.0, 0.0, -3.0, 2.0 + math.log(0.25)])
    kept = torch.isfinite(_min_p_filter(x, 0.25))
    probs = torch.softmax(x.double(), -1)
    assert kept.tolist() == (probs >= 0.25 * probs.max() * (1 - 1e-6)).tolist()
    assert kept.tolist() == [True, True, False, False, True]


def test_a_sampler_with_min_p_never_draws_a_dropped_token():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=1))
    assert {s(logits) for _ in range(200)} <= {0, 1}


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("presence_penalty", 2.5, "between -2 and 2"),
        ("frequency_penalty", float("nan"), "between -2 and 2"),
        ("repetition_penalty", 0.0, "> 0"),
        ("min_p", 1.5, r"\[0, 1\]"),
        ("logit_bias", {5: 101.0}, "between -100 and 100"),
        ("logit_bias", {-1: 1.0}, "not a token id"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field, value, match):
    with pytest.raises(InvalidRequestError, match=match) as err:
        SamplingParams(**{field: value})
    assert err.value.param in (field, None)


def test_logit_bias_bans_and_forces_tokens(tiny):
    prompt = "The quick brown fox"
    plain = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ids = plain[0].outputs[0].token_ids
    banned = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  logit_bias={ids[0]: -100.0}))  # fmt: skip
    assert ids[0] not in banned[0].outputs[0].token_ids
    forced = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                  logit_bias={17: 100.0}))  # fmt: skip
    assert forced[0].outputs[0].token_ids == [17] * 5


def test_penalties_make_greedy_repeat_less(tiny):
    """Greedy on a random-weight model repeats tokens (47 distinct of 60 here); a penalty
    of 2 on what was generated (presence, frequency) or a large one on what was seen
    (repetition) outweighs the logits' spread: no token twice."""
    prompt = "Once upon a time"

    def distinct(**penalty) -> int:
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, **penalty)
        return len(set(tiny.generate(prompt, params)[0].outputs[0].token_ids))

    plain = distinct()
    assert plain < 60  # it repeats
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                    {"repetition_penalty": 100.0}):  # fmt: skip
        assert distinct(**penalty) == 60, penalty


def test_penalized_samples_are_the_same_in_a_batch_as_alone(tiny):
    prompts = ["The capital of France is", "def fibonacci(n):", "Water", "List three colours:"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0.9, seed=4, max_tokens=25, ignore_eos=True, n=3,
                       presence_penalty=1.0, repetition_penalty=1.2, min_p=0.05),
        SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, logit_bias={17: 3.0}),
        SamplingParams(temperature=0.7, seed=9, max_tokens=18, ignore_eos=True, top_k=30,
                       min_p=0.1, logprobs=2),
    ]  # fmt: skip
    alone = [tiny.generate(p, q)[0] for p, q in zip(prompts, params, strict=True)]
    together = tiny.generate(prompts, params)

    def result(out):
        return [(o.token_ids, o.text, None if o.logprobs is None else
                 [lp.to_dict() for lp in o.logprobs]) for o in out.outputs]  # fmt: skip

    assert [result(o) for o in together] == [result(o) for o in alone]
