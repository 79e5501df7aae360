"""SamplingParams validation, the sampler, logprobs and stop strings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlm.engine.request import StopText
from kvlm.engine.sampling import (
    Sampler,
    SamplingParams,
    _candidates,
    _draw,
    token_logprob,
)
from kvlm.errors import InvalidRequestError
from numerics import gamma


def _top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p: the
    reference `_candidates` is checked against (it never sorts the whole vocabulary)."""
    sorted_x, order = torch.sort(x, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each token
    drop = before >= top_p
    drop[..., 0] = False  # never the best: a top_p that rounds to 0 in fp32 would drop it
    return x.scatter(-1, order[drop], -math.inf)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"logprobs": 21},
        {"logprobs": -1},
        {"stop": [""]},
        {"seed": "abc"},
    ],
)
def test_absurd_values_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_accepted():
    assert SamplingParams(stop="END").stop == ["END"]


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=1234)
    s1, s2 = Sampler(params), Sampler(params)
    a = [s1(logits) for _ in range(20)]
    b = [s2(logits) for _ in range(20)]
    assert a == b
    assert len(set(a)) > 1  # it did sample, not argmax


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=2, seed=0))
    assert {sampler(logits) for _ in range(200)} == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    kept = torch.isfinite(_top_p_filter(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(_top_p_filter(logits, 0.5))
    assert kept.tolist() == [True, False, False, False]
    kept = torch.isfinite(_top_p_filter(logits, 0.01))
    assert kept.tolist() == [True, False, False, False]  # never empty
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def _kept_by_masking(x: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The reference: mask everything below the k-th logit, then `_top_p_filter`."""
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], -math.inf)
    if top_p < 1.0:
        x = _top_p_filter(x, top_p)
    return set(torch.isfinite(x).nonzero().flatten().tolist())


def _mass_ahead(x: torch.Tensor, top_k: int, token: int) -> float:
    """The exact (fp64) probability of the tokens more likely than `token`, after top-k."""
    x = x.double()
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], -math.inf)
    p = torch.softmax(x, dim=-1)
    return float(p[p > p[token]].sum())


@pytest.mark.parametrize("top_k", [0, 1, 7, 300])
@pytest.mark.parametrize("top_p", [1.0, 0.01, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])  # near-flat (top-p must widen) to peaked
def test_candidates_are_the_tokens_top_k_and_top_p_keep(top_k, top_p, scale):
    g = torch.Generator().manual_seed(top_k + int(100 * top_p))
    x = torch.randn(5000, generator=g) * scale
    if top_k == 0 and top_p == 1.0:
        return  # the sampler does not ask: nothing is filtered
    vals, ids = _candidates(x, top_k, top_p)
    got, want = set(ids.tolist()), _kept_by_masking(x, top_k, top_p)
    # Two fp32 sums of the mass ahead of a token (64..vocab terms, each CPU's own order)
    # can only disagree on a token whose exact mass ahead is within their rounding of top_p.
    for t in got ^ want:
        assert abs(_mass_ahead(x, top_k, t) - top_p) <= 2 * gamma(x.shape[-1]), t
    assert torch.equal(vals, x[ids]) and bool((vals[:-1] >= vals[1:]).all())  # best first
    if scale == 0.05 and top_p == 0.9 and top_k == 0:
        assert len(ids) > 64 * 4  # widened more than once


def test_the_draw_follows_the_probabilities_and_never_picks_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([_draw(probs, g) for _ in range(n)]), minlength=6)
    assert counts[0] == counts[2] == counts[5] == 0
    for i in (1, 3, 4):
        sigma = math.sqrt(n * probs[i] * (1 - probs[i]))
        assert abs(counts[i] - n * probs[i]) < 4 * sigma
    assert _draw(torch.tensor([0.0, 0.0, 1.0]), g) == 2  # the last index, however u falls


def test_sampled_tokens_follow_the_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    sampler = Sampler(SamplingParams(temperature=0.5, seed=0))
    n = 8000
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=4)
    expected = torch.softmax(logits / 0.5, -1) * n
    assert bool(((counts - expected).abs() < 4 * expected.sqrt() + 1).all())


def test_logprobs_of_the_raw_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0])
    lp = token_logprob(logits, 1, top=2)
    expected = torch.log_softmax(logits, -1)
    assert lp.token_id == 1
    assert lp.logprob == pytest.approx(float(expected[1]))
    assert list(lp.top) == [0, 1]
    assert lp.top[0] == pytest.approx(float(expected[0]))
    assert token_logprob(logits, 2, top=0).top == {}


def stream(stops, pieces):
    st = StopText(stops)
    shown = [st.push(p) for p in pieces]
    shown.append(st.flush())
    return "".join(shown), st


def test_stop_string_cuts_the_text():
    shown, st = stream(["\n\n"], ["Paris", ".", "\n", "\n", "More"])
    assert st.stopped
    assert st.text == "Paris."
    assert shown == "Paris."


def test_stop_string_split_across_tokens_is_never_shown():
    st = StopText(["STOP"])
    assert st.push("abc ST") == "abc "  # "ST" might start "STOP": held back
    assert st.push("O") == ""
    assert st.push("P tail") == ""
    assert st.stopped and st.text == "abc "


def test_held_back_text_is_released_when_it_cannot_be_a_stop():
    st = StopText(["STOP"])
    assert st.push("abc ST") == "abc "
    assert st.push("ray") == "STray"
    assert not st.stopped
    assert st.flush() == ""


def test_earliest_of_several_stops_wins():
    _, st = stream(["world", "lo"], ["hello world"])
    assert st.text == "hel"


def test_no_stops_streams_everything():
    shown, st = stream([], ["a", "b"])
    assert shown == "ab" and not st.stopped


def test_prefill_rate_counts_every_chunk_of_the_prompt():
    from kvlm.engine.metrics import Metrics

    m = Metrics(prompt_tokens=30, prefill_tokens=30)
    for _ in range(3):  # a prompt in three chunks of 0.1 s
        m.record_forward(0.1)
    m.record_token()
    m.record_forward(0.01)  # a decode step: not prefill
    m.record_token()
    assert m.prefill_tokens_per_s == pytest.approx(100.0)


def _reference_stop(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """Generation stops at the first piece after which the text holds a stop string, and
    the text is cut where the earliest one starts: searched over the whole text each time."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=500, deadline=None)
@example(stops=["SbSb"], pieces=["Sb", "Sb"])  # a text shorter than the longest stop - 1
@given(
    stops=st.lists(st.text(alphabet="abS", min_size=1, max_size=5), max_size=3),
    pieces=st.lists(st.text(alphabet="abST", max_size=4), max_size=30),
)
def test_stop_text_matches_a_whole_text_search(stops, pieces):
    """Shown pieces always add up to a prefix of the reference answer and to all of it at
    the end; the state a push searches stays bounded by the longest stop, whatever the
    output's length (so token 10,000 costs what token 10 does)."""
    want, stopped = _reference_stop(pieces, stops)
    stop_text = StopText(stops)
    shown = ""
    bound = max((len(s) for s in stops), default=1) - 1
    for piece in pieces:
        shown += stop_text.push(piece)
        assert want.startswith(shown)
        assert len(stop_text._tail) <= bound and len(stop_text._pending) <= bound
    shown += stop_text.flush()
    assert shown == want == stop_text.text
    assert stop_text.stopped == stopped


def test_a_long_stop_string_is_refused():
    from kvlm.engine.sampling import MAX_STOP_CHARS

    with pytest.raises(InvalidRequestError, match="at most"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_seeds_torch_cannot_take_are_refused(seed):
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed)


def test_the_highest_seed_seeds_every_sample():
    from kvlm.engine.sampling import MAX_SAMPLES, SEED_MAX

    top = SamplingParams(seed=SEED_MAX - MAX_SAMPLES, n=MAX_SAMPLES)
    torch.Generator().manual_seed(top.seed + MAX_SAMPLES - 1)  # what the engine does


def test_a_tiny_top_p_keeps_the_best_token():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    for top_p in (1e-300, 1e-45, 5e-324):
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0))
        assert {sampler(logits) for _ in range(20)} == {1}
        assert torch.isfinite(_top_p_filter(logits, top_p)).tolist() == [False, True, False, False]


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(3)) * 8
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0))
    assert {sampler(logits) for _ in range(5)} == {int(logits.argmax())}
