"""Speculative decoding in the engine (kvlm.engine.speculative): prompt-lookup drafts
checked in the step's decode forward. Greedy output is token for token the plain
decode's (the default model through the fused step, random-weight models through the torch
step, every K/V storage dtype), a batch gives each request its tokens alone, the pool
gets every block back, and speculative sampling draws from the model's own distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.runner import DraftBatch
from kvlm.engine.sampling import Sampler
from kvlm.engine.speculative import SpeculativeConfig, propose_ngram

TEXT = (
    "The KV cache stores the keys and values of every token already processed, which turns "
    "generation from reprocessing the whole sequence into processing one token and attending "
    "over the cache. Paged caches split it into blocks so that many requests share one pool."
)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert propose_ngram(tokens, 3, 4, 2) == [7, 8, 2]  # "2 3 4" last seen before 7 8
    assert propose_ngram(tokens, 1, 4, 2) == [7]
    assert propose_ngram([1, 2, 3], 4, 4, 2) == []  # no earlier occurrence
    assert propose_ngram([5, 5, 5, 5], 2, 3, 2) == [5]  # what follows runs to the end
    with pytest.raises(ValueError):
        SpeculativeConfig(num_draft=0)


def run(llm: LLM, prompts: dict[str, list[int]], params: SamplingParams, spec) -> tuple:
    engine = Engine(llm, EngineConfig(num_blocks=192, speculative=spec))
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(2000):
        if not engine.has_work():
            break
        for event in engine.step():
            out[event.request_id] += event.token_ids
    pool = engine.pool
    assert pool.num_free == pool.num_blocks and not any(pool.refs)  # every block back
    return out, engine.stats


def grounded(llm: LLM, text: str = TEXT) -> list[int]:
    messages = [{"role": "user", "content": "Repeat this text word for word:\n\n" + text}]
    return llm.tokenizer.encode_chat(messages)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", [None, "bf16", "int8"])
def test_greedy_speculation_is_plain_decoding_on_the_default_model(kv_dtype):
    llm = LLM(progress=False, max_context=1024, kv_dtype=kv_dtype)
    prompts = {"copy": grounded(llm), "open": llm.tokenizer.encode_chat(
        [{"role": "user", "content": "Write a short story about a lighthouse."}])}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    plain, _ = run(llm, prompts, params, None)
    spec, stats = run(llm, prompts, params, SpeculativeConfig(num_draft=6))
    assert spec == plain and len(plain["copy"]) == 160
    assert stats.spec.accepted > 40 and stats.spec.tokens_per_forward > 1.5


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_speculation_is_plain_decoding_on_the_torch_step(tiny_model_dir, name):
    """fp32 weights: the torch step, rows of one sequence on one block table; random
    models repeat themselves, so prompt lookup proposes."""
    llm = LLM(model=tiny_model_dir(name), progress=False, max_context=256)
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    params = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True)
    plain, _ = run(llm, {"a": ids}, params, None)
    spec, stats = run(llm, {"a": ids}, params, SpeculativeConfig(num_draft=4, ngram_min=1))
    assert spec == plain and stats.spec.drafted > 0


def test_a_batch_with_speculation_gives_each_request_its_tokens_alone(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256,
              speculative=SpeculativeConfig(num_draft=4, ngram_min=1))  # fmt: skip
    plain = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256)
    prompts = ["The quick brown fox", "def add(a, b):", "Water boils at", "One two three"]
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=45, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=50, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop=["e"])]  # fmt: skip
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, q)[0] for p, q in zip(prompts, params, strict=True)]

    def result(o):
        return [(x.token_ids, x.text, x.finish_reason,
                 None if x.logprobs is None else [lp.to_dict() for lp in x.logprobs])
                for x in o.outputs]  # fmt: skip

    assert [result(o) for o in together] == [result(o) for o in alone]
    reference = [plain.generate(p, q)[0] for p, q in zip(prompts, params, strict=True)]
    for i in (0, 1, 3):  # greedy: the plain decode's tokens, logprobs and stops alike
        assert result(together[i]) == result(reference[i])
    assert llm.batch_engine().stats.spec.drafted > 0


def test_speculative_sampling_draws_from_the_models_distribution():
    """A one-hot draft accepted with probability p(d), else a draw from p without d: the
    token is distributed as p. 20,000 seeded draws on a 6-token vocabulary, with the
    draft the likeliest, a middling and an unlikely token; a chi-square test at 1e-4 (its
    critical value for 5 degrees of freedom is 25.7)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = torch.softmax(logits.double(), -1)
    params = SamplingParams(temperature=1.0, seed=7)
    for draft in (0, 2, 5):
        sampler = Sampler(params)
        counts = torch.zeros(6, dtype=torch.float64)
        accepted = 0
        n = 20_000
        for _ in range(n):
            token, ok = sampler.verify(logits, draft)
            counts[token] += 1
            accepted += ok
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 25.7, (draft, counts.tolist())
        assert math.isclose(accepted / n, float(p[draft]), abs_tol=5 * math.sqrt(0.25 / n))


@pytest.mark.slow
def test_the_server_speculates_and_answers_what_it_answers_without(tiny_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    from serving import kvlm_serve, metrics, openai_client

    folder = str(tiny_model_dir("llama"))
    # repeated text: prompt lookup finds something to propose (a random model rarely agrees)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 3,
               "def add(a, b):\n    return a + b\n" * 3, "One two three four. " * 4]  # fmt: skip
    answers = {}
    for flags in ((), ("--speculative", "ngram", "--num-draft", "4")):
        with kvlm_serve("--model", folder, "--max-context", "256", *flags) as (port, _):
            client = openai_client(port)

            def ask(prompt, client=client):
                out = client.completions.create(model=client.models.list().data[0].id,
                                                prompt=prompt, temperature=0, max_tokens=80,
                                                logprobs=0,
                                                extra_body={"ignore_eos": True})  # fmt: skip
                # usage counts tokens, every accepted draft token among them
                assert out.usage.completion_tokens == len(out.choices[0].logprobs.tokens) == 80
                return out.choices[0].text

            with ThreadPoolExecutor(3) as pool:  # concurrent: one batch
                answers[flags] = list(pool.map(ask, prompts))
            seen = metrics(port, "")
    assert answers[()] == answers[("--speculative", "ngram", "--num-draft", "4")]
    assert seen["kvlm_spec_draft_tokens_total"] > 0
    assert 0 <= seen["kvlm_spec_acceptance_rate"] <= 1
    assert seen["kvlm_spec_tokens_per_forward"] >= 1
    assert seen["kvlm_generation_tokens_total"] == 3 * 80  # tokens, not steps or events


@pytest.fixture(scope="module")
def tiny_fp32(tiny_model_dir):
    # a short context: a pool of a few blocks still holds one sequence (and preempts)
    return LLM(model=tiny_model_dir("llama"), progress=False, max_context=96)


def _mix(llm, requests, spec, num_blocks, prefix):
    engine = Engine(llm, EngineConfig(num_blocks=num_blocks, prefix_caching=prefix,
                                      speculative=spec))  # fmt: skip
    out: dict[tuple[str, int], list[int]] = {}
    for rid, (ids, n, max_tokens) in requests.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, n=n,
                                                    ignore_eos=True))  # fmt: skip
    for _ in range(3000):
        if not engine.has_work():
            break
        for event in engine.step():
            out.setdefault((event.request_id, event.index), []).extend(event.token_ids)
    assert not engine.has_work()
    pool = engine.pool
    assert pool.num_free == pool.num_blocks and not any(pool.refs)  # conserved, refs exact
    return out, engine


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3), st.integers(5, 40)),
                  min_size=1, max_size=5),
    blocks=st.integers(8, 20), prefix=st.booleans(), k=st.integers(1, 6),
)  # fmt: skip
def test_rollback_interleaved_with_fork_prefix_reuse_and_preemption(tiny_fp32, data, blocks,
                                                                     prefix, k):  # fmt: skip
    """Requests sharing prefixes (reused blocks), n > 1 (forked tables, copy on write), a
    small pool (preemption and recompute), drafts accepted and rejected: every sample's
    greedy tokens are the plain engine's, and the pool gets every block back."""
    base = [tiny_fp32.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2),
            tiny_fp32.tokenizer.encode("One two three four five six seven. " * 2)]  # fmt: skip
    requests = {f"r{i}": (base[v % 2] + [5 + v] * (v // 2), n, m)
                for i, (v, n, m) in enumerate(data)}  # fmt: skip
    plain, _ = _mix(tiny_fp32, requests, None, blocks, prefix)
    spec, engine = _mix(tiny_fp32, requests, SpeculativeConfig(num_draft=k, ngram_min=1),
                        blocks, prefix)  # fmt: skip
    assert spec == plain
    SEEN["drafted"] += engine.stats.spec.drafted
    SEEN["accepted"] += engine.stats.spec.accepted
    SEEN["preempted"] += engine.scheduler.preemptions


SEEN = {"drafted": 0, "accepted": 0, "preempted": 0}


def test_the_property_test_met_drafts_rejections_and_preemption():
    """The interleaving above did propose, accept, reject and preempt (it runs first:
    pytest keeps the file's order)."""
    if SEEN["drafted"] == 0:
        pytest.skip("run with the test above")
    assert 0 < SEEN["accepted"] < SEEN["drafted"] and SEEN["preempted"] > 0


@pytest.mark.parametrize(("draft", "weights"), [(None, "int8"), ("mistral", None)])
def test_a_draft_model_proposes_and_greedy_output_is_plain(tiny_model_dir, draft, weights):
    """Self-speculation (the same file, int8 weights, drafting for fp32) and another
    model with the same tokenizer: greedy output is the plain decode's; the draft's
    caches are rolled back to what each sequence kept and freed when it ends."""
    path = tiny_model_dir("llama")
    other = None if draft is None else str(tiny_model_dir(draft))
    spec = SpeculativeConfig("draft", num_draft=4, draft_weights=weights or "auto",
                             draft_model=other)  # fmt: skip
    llm = LLM(model=path, progress=False, max_context=256)
    ids = {"a": llm.tokenizer.encode("The quick brown fox"), "b": llm.tokenizer.encode("Once")}
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    plain, _ = run(llm, ids, params, None)
    engine_spec, stats = run(llm, ids, params, spec)
    assert engine_spec == plain and stats.spec.drafted > 0
    if draft is None:  # the same weights, a little rounded: it mostly agrees
        assert stats.spec.acceptance > 0.5


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    import json

    from helpers import save_tiny_model
    from kvlm.errors import InvalidRequestError

    other = save_tiny_model(tmp_path / "other", "llama", seed=1)
    # the same trained tokenizer: make it differ by one token's text
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab["zz" + first] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=128)
    with pytest.raises(InvalidRequestError, match="another tokenizer"):
        Engine(llm, EngineConfig(num_blocks=32, speculative=SpeculativeConfig(
            "draft", draft_model=str(other))))  # fmt: skip
    with pytest.raises(ValueError, match="draft method"):
        SpeculativeConfig("ngram", draft_model=str(other))


def test_speculation_where_the_engine_cannot_run_it_is_refused(tiny_model_dir):
    from kvlm.errors import InvalidRequestError

    for kv, why in (("off", "keeps no cache"),):
        with pytest.raises(InvalidRequestError, match=why):
            LLM(model=tiny_model_dir("llama"), progress=False, kv=kv, speculative="ngram")
    with pytest.raises(InvalidRequestError, match="method"):
        LLM(model=tiny_model_dir("llama"), progress=False, speculative="medusa")


# ---------------------------------------------------------------- a single stream (chat)


def chat_turns(llm: LLM, params: SamplingParams, turns: list[str]) -> list[list[int]]:
    session = llm.chat_session(params, use_template=False)
    out = []
    for text in turns:
        turn = session.send(text)
        list(turn)
        out.append(turn.output.outputs[0].token_ids)
    return out, session


def _chat_pair(folder, spec, turns, max_tokens=100, **kw):
    """A conversation's greedy turns with `spec` and without."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(model=folder, progress=False, max_context=kw.pop("max_context", 256), **kw)
    ref, _ = chat_turns(plain, params, turns)
    llm = LLM(model=folder, progress=False, max_context=plain.max_context, speculative=spec,
              **kw)  # fmt: skip
    got, session = chat_turns(llm, params, turns)
    return got, ref, session, llm


CHAT = ["The quick brown fox jumps over the lazy dog.", "and again the fox"]


@pytest.mark.parametrize(("kv", "kv_dtype", "weights"), [
    ("contiguous", None, None), ("paged", None, None), ("int8", None, None),
    ("contiguous", "int8", None), ("contiguous", None, "int8"), ("paged", "bf16", "int8"),
    ("basic", None, None),
])  # fmt: skip
def test_chat_speculation_is_plain_decoding(tiny_model_dir, kv, kv_dtype, weights):
    """A conversation on its own cache (kvlm chat), each turn speculating: drafts checked
    as rows of one step (the torch step's rows over their own keys, or the fused step's
    with low-bit weights), rejected ones rolled back in the cache's own way (a counter,
    blocks freed, int8 rows): two turns of greedy tokens equal the plain session's."""
    spec = SpeculativeConfig(num_draft=4, ngram_min=1)
    got, ref, session, llm = _chat_pair(tiny_model_dir("llama"), spec, CHAT, kv=kv,
                                        kv_dtype=kv_dtype, weights=weights)  # fmt: skip
    assert got == ref and [len(t) for t in got] == [100, 100]  # 200 tokens, 2 turns
    st = session.engine.stats.spec
    assert st.drafted > 0 and st.accepted < st.drafted  # drafts checked, some rolled back
    assert session.cache.num_tokens == len(session._turn.tokens) - 1  # all but the last
    fused = llm.describe()["decode_step"] == "fused"
    assert fused == (weights is not None)  # which step checked them
    if kv in ("paged", "int8"):
        pool = session.cache.pool
        assert pool.num_used == len({b for t in session.cache.tables for b in t})


@pytest.mark.parametrize("positions", ["cache", "absolute"])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_window_speculation_is_plain_decoding_past_the_ring(tiny_model_dir, positions,
                                                            kv_dtype, method):  # fmt: skip
    """The window cache (4 sinks + a ring of 24, wrapped many times over 200 tokens): each
    draft row reads the ring as its one-token step would (earlier rows written in, its own
    RoPE positions inside the cache), and rolling rejected rows back restores the slots
    they overwrote: greedy turns equal the plain session's."""
    from kvlm.llm import CacheOptions

    spec = (SpeculativeConfig(num_draft=4, ngram_min=1) if method == "ngram" else
            SpeculativeConfig("draft", num_draft=4, draft_weights="int8"))  # fmt: skip
    options = CacheOptions(window=24, sinks=4, window_positions=positions)
    got, ref, session, _ = _chat_pair(tiny_model_dir("llama"), spec, CHAT, kv="window",
                                      kv_dtype=kv_dtype, cache_options=options)  # fmt: skip
    assert got == ref and [len(t) for t in got] == [100, 100]
    st = session.engine.stats.spec
    assert st.drafted > 0 and st.accepted < st.drafted
    if method == "draft":
        assert st.accepted > 0  # some drafts taken whole or in part, past the ring's wrap


def test_chat_speculation_with_a_draft_model_and_at_the_context_limit(tiny_model_dir):
    """Self-speculation (the same file at int8 drafting for fp32) in a conversation; and a
    turn that runs into the context limit ends where the plain one does."""
    spec = SpeculativeConfig("draft", num_draft=4, draft_weights="int8")
    got, ref, session, _ = _chat_pair(tiny_model_dir("llama"), spec, CHAT, max_tokens=60)
    assert got == ref and session.engine.stats.spec.acceptance > 0.5
    spec = SpeculativeConfig(num_draft=8, ngram_min=1)
    got, ref, *_ = _chat_pair(tiny_model_dir("llama"), spec, CHAT[:1], max_tokens=500,
                              max_context=96)  # fmt: skip
    assert got == ref and len(got[0]) < 500  # "length" at the context's end, alike


def test_chat_speculation_refuses_n_and_other_caches(tiny_model_dir):
    """n samples on one cache decode in lockstep: no drafts, the plain tokens; a cache
    that keeps nothing checks no draft."""
    from kvlm.errors import InvalidRequestError

    spec = SpeculativeConfig(num_draft=4, ngram_min=1)
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=128, speculative=spec)
    plain = LLM(model=tiny_model_dir("llama"), progress=False, max_context=128)
    ids = plain.encode(CHAT[0], chat=True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    stream = llm.stream(ids, params)
    out = stream.run()
    assert [o.token_ids for o in out.outputs] == [plain.stream(ids, params).run().token_ids] * 2
    assert stream.engine.stats.spec.drafted == 0
    with pytest.raises(InvalidRequestError, match="no speculative decoding with kv 'off'"):
        LLM(model=tiny_model_dir("llama"), progress=False, kv="off", speculative=spec)
    with pytest.raises(InvalidRequestError, match="contiguous, paged, basic or window"):
        llm.runner.run(DraftBatch([1, 2], llm.new_cache("off")))


@pytest.mark.slow
def test_kvlm_chat_speculates(tmp_path):
    """`kvlm chat --speculative ngram` on the default model: the turn's line says what was
    accepted; a cache mode without drafts is one line of error."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvlm.cli", "chat", "--speculative", "ngram",
           "--temperature", "0", "--max-new-tokens", "48"]  # fmt: skip
    text = "Repeat exactly: one two three four five six seven eight nine ten.\n"
    done = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "[speculative ngram:" in done.stderr and "accepted" in done.stderr
    bad = subprocess.run([*cmd, "--kv", "off"], input=text, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "no speculative decoding with kv 'off'" in bad.stderr


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("reject", [0, 1, 3, 5])
def test_a_window_draft_rolled_back_leaves_the_kept_tokens_ring(tiny_model_dir, kv_dtype,
                                                                reject):  # fmt: skip
    """A draft of 5 rows checked on a wrapped ring, `reject` of them rolled back: the
    ring (codes, scales, positions) is bit for bit that of a cache fed the kept tokens one
    at a time."""
    from kvlm.llm import CacheOptions

    options = CacheOptions(window=12, sinks=2)
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, kv="window",
              kv_dtype=kv_dtype, cache_options=options)  # fmt: skip
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over.")
    ids = (ids * 3)[:30]  # longer than sinks + ring: wrapped
    draft = [5, 9, 13, 17, 21]
    a, b = llm.new_cache("window"), llm.new_cache("window")
    for cache in (a, b):
        llm.runner.forward(ids[:-1], cache)
    llm.runner.run(DraftBatch([ids[-1], *draft], a))
    a.rollback(reject)
    for token in [ids[-1], *draft][: 6 - reject]:
        llm.runner.forward([token], b)
    assert a.num_tokens == b.num_tokens
    assert torch.equal(a.slot_pos, b.slot_pos)
    for key, t in a.store.raw(()).items():
        assert torch.equal(t, b.store.raw(())[key]), key
