"""Qwen3.5: gated DeltaNets beside gated attention (kvlm.model.deltanet; ModelConfig's
attn_output_gate and rope_dim), against transformers' Qwen3_5ForCausalLM on tiny
random-weight models of several layer orders, with kv "off"; then the DeltaNet state as a
layer group of every one-sequence cache (kvlm.cache.recurrent; the pool and cache files
refuse it: docs/NOTES-qwen35.md); then the GGUF files llama.cpp's own converter writes for
them (tests/converter.py).

The exact reference is transformers in fp64 with its delta rule's fp32 casts lifted
(`exact_hf`): transformers runs the rule in fp32 whatever the model's dtype, so its fp64
logits share its fp32 chunked rule's rounding (measured: its fp32 logits looked 5x closer
to them than to a true fp64 forward)."""

from __future__ import annotations

import inspect
import json
from dataclasses import replace
from itertools import pairwise

import pytest
import torch

import converter
from gguf_hostile import cut_rows, fill, set_key
from helpers import (
    CHATML,
    CHATML_TOOLS,
    FRANCE,
    GREEDY,
    POOL_PROMPTS,
    WEATHER,
    answer,
    assert_greedy_agreement,
    conversation,
    conversation_on_a_tier,
    fed,
    fresh_engine,
    gguf_as_folder,
    hf_greedy,
    hf_logits,
    load_hf,
    on_pool,
    prompt_ids,
    save_tiny_model,
    with_mtp,
)
from kvlm import LLM, SamplingParams
from kvlm.engine.runner import CacheBatch
from kvlm.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from numerics import SAME_ROUNDING, assert_as_exact_as, fp64_reorder_bound, max_error

PROMPT = FRANCE
D, A = "linear_attention", "full_attention"
# name -> (seed, transformers config overrides): the layer orders and variants (the
# helpers' config: D A D A, 2 q/k heads serving 4 v heads, kernel 4, RoPE over 8 of 32)
QWEN35_MODELS = {
    "qwen35": (30, {}),
    "qwen35-attention-first": (31, {"layer_types": [A, D, D, A]}),
    # a kernel of 3; q/k heads as many as v heads; RoPE over half of each head
    "qwen35-deltanets-last": (32, {"layer_types": [A, D, D, D], "linear_conv_kernel_dim": 3,
                                   "linear_num_value_heads": 2,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}}),
    # biases in q|k|v and o (q_proj's interleaved with its gate's)
    "qwen35-bias": (33, {"layer_types": [D, D, A, D], "attention_bias": True}),
}  # fmt: skip
# converted only (the GGUF tests): v heads of 32, one Q8_0 block each
GGUF_ONLY = {"qwen35-wide-v": (34, {"linear_value_head_dim": 32})}
# ChatML whose generation prompt opens an empty think block that a past reply is rendered
# without (as Qwen 3's and 3.5's templates with thinking off): the next turn parts from
# the prompt right after "<|im_start|>assistant\n"
THINK_OFF = CHATML.replace("'<|im_start|>assistant\n' }}", "'<|im_start|>assistant\n<think>"
                           "\n\n</think>\n\n' }}")  # fmt: skip


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    made = {}

    def make(name: str):
        if name not in made:
            seed, overrides = {**QWEN35_MODELS, **GGUF_ONLY}.get(name, (30, {}))
            templates = {"qwen35-think-off": THINK_OFF, "qwen35-tools": CHATML_TOOLS}
            template = templates.get(name, CHATML)
            if name == "qwen35-tools":  # the tools' system turn: ~800 of the tiny tokenizer's
                overrides = {**overrides, "max_position_embeddings": 2048}
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), "qwen3_5", seed=seed,
                                         tokenizer="qwen35", chat_template=template,
                                         **overrides)  # fmt: skip
        return made[name]

    return make


@pytest.fixture(scope="module", autouse=True)
def exact_hf():
    """transformers' delta rules (chunked and recurrent) computed in their inputs' dtype:
    their own source with `torch.float32` read as the input's dtype."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    saved = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        saved[name] = getattr(m, name)
        src = inspect.getsource(saved[name])
        src = src[src.index("def ") :].replace("torch.float32", "initial_dtype")
        assert "initial_dtype = query.dtype" in src
        scope: dict = {}
        exec(compile(src, m.__file__, "exec"), m.__dict__, scope)
        setattr(m, name, scope[name])
    yield
    for name, fn in saved.items():
        setattr(m, name, fn)


@pytest.mark.parametrize("name", list(QWEN35_MODELS))
def test_config_read_from_folder(qwen35_dir, name):
    folder = qwen35_dir(name)
    config, hf = LLM(model=folder, kv="off", progress=False).config, load_hf(folder).config
    mixers = {D: "deltanet", A: "attention"}
    assert config.architecture == "qwen35"
    assert config.layer_mixers == tuple(mixers[t] for t in hf.layer_types)
    d = config.deltanet
    assert (d.key_heads, d.value_heads, d.key_dim, d.value_dim, d.conv_kernel) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
        hf.linear_value_head_dim, hf.linear_conv_kernel_dim)  # fmt: skip
    assert config.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert config.attn_output_gate and config.qk_norm and config.tie_word_embeddings


@pytest.mark.parametrize("name", list(QWEN35_MODELS))
def test_teacher_forced_logits_match_hf(qwen35_dir, name):
    """Every position's logits over 40 tokens, the exact path: as close to the exact
    result as transformers' own fp32 logits (tests/numerics.py)."""
    folder = qwen35_dir(name)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours, ref = llm.runner.logits(ids, llm.new_cache("off")), hf_logits(load_hf(folder), ids)
    assert_as_exact_as(ours, ref, hf_logits(folder, ids, torch.float64))


@pytest.mark.parametrize("name", ["qwen35", "qwen35-bias"])
def test_greedy_tokens_equal_hf(qwen35_dir, name):
    """16 greedy tokens through LLM.generate (kv off): in fp64 the same tokens as
    transformers in fp64; in fp32 by default numerics, the top-5 rule against its fp32."""
    from transformers import AutoModelForCausalLM

    folder, n = qwen35_dir(name), 16
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    fp64 = LLM(model=folder, kv="off", dtype="fp64", progress=False)
    ids = fp64.tokenizer.encode(PROMPT)
    hf64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    out = fp64.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.token_ids == hf_greedy(hf64, ids, n)[0]
    llm = LLM(model=folder, kv="off", progress=False)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(load_hf(folder), ids, n)
    tops = [list(lp.top) for lp in out.logprobs]
    assert_greedy_agreement(out.token_ids, tops, ref_ids, ref_logits)


def test_the_deltanet_and_the_gate_are_applied(qwen35_dir, tmp_path):
    """Each part matters: the DeltaNet's convolution reduced to its last tap, or the
    attention's output gate's rows of q_proj zeroed in the file (every output times
    sigmoid(0)), moves the logits by far more than rounding (so the tests above can
    fail)."""
    from safetensors.torch import load_file, save_file

    folder = qwen35_dir("qwen35")
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    exact = hf_logits(folder, ids, torch.float64)

    def error(llm: LLM) -> float:
        return max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)

    before = error(llm)
    llm.model.layers[0].recurrent.kernel.data[:-1] = 0  # position t reads only its own row
    assert error(llm) > 1000 * before
    c = llm.config
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            q = tensors["model.layers.1.self_attn.q_proj.weight"]
            q.view(c.num_heads, 2, c.head_dim, -1)[:, 1] = 0  # each head's gate rows
            save_file(tensors, tmp_path / f.name)
        else:
            (tmp_path / f.name).write_bytes(f.read_bytes())
    assert error(LLM(model=tmp_path, kv="off", exact=True, progress=False)) > 1000 * before


def carried(llm: LLM, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Teacher-forced logits of `ids` fed in `chunks` through a contiguous cache (the
    attention layers' K/V) with the DeltaNet state carried beside it by hand
    (`Transformer.forward(recurrent=)`), each chunk committed to both."""
    from kvlm.cache import create_cache

    spec = replace(llm.cache_spec("contiguous"), layer_kinds=())  # no state group
    cache, rows = create_cache("contiguous", spec), llm.model.new_delta_rows()
    out, at = [], 0
    with torch.inference_mode():
        for n in chunks:
            step, state = cache.begin(n), rows.begin(n)
            tokens = torch.tensor([ids[at : at + n]])
            out.append(llm.model(tokens, step.positions, step, last_only=False,
                                 recurrent=state)[0])  # fmt: skip
            cache.commit(step)
            rows.commit(state)
            at += n
    return torch.cat(out)


def test_state_carried_across_chunks_and_decode_equals_one_shot(qwen35_dir):
    """Chunks of 7 across the kernel's edge, then a token at a time: every position's
    logits as close to the exact ones as the one-shot forward's; in fp64 within the
    reordering bound of two fp64 evaluations."""
    folder = qwen35_dir("qwen35-bias")
    chunks = [7] * 4 + [1] * 12
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot = llm.runner.logits(ids, llm.new_cache("off"))
    exact = hf_logits(folder, ids, torch.float64)
    assert_as_exact_as(carried(llm, ids, chunks), one_shot, exact)
    fp64 = LLM(model=folder, kv="off", dtype="fp64", progress=False)
    one_shot64 = fp64.runner.logits(ids, fp64.new_cache("off"))
    far = max_error(carried(fp64, ids, chunks), one_shot64)
    assert far <= fp64_reorder_bound(max_error(one_shot, exact))


def test_a_multimodal_folder_runs_its_language_model(qwen35_dir, tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (config.json's text_config; the weights
    under model.language_model., as transformers saves them) reads to the same config and
    logits as the text model's folder."""
    from safetensors.torch import load_file, save_file

    folder = qwen35_dir("qwen35")
    text = json.loads((folder / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "tie_word_embeddings": text.pop("tie_word_embeddings"),
               "text_config": text}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            save_file({k.replace("model.", "model.language_model.", 1): v
                       for k, v in tensors.items()}, tmp_path / f.name)  # fmt: skip
        elif f.name != "config.json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    plain = LLM(model=folder, kv="off", exact=True, progress=False)
    multi = LLM(model=tmp_path, kv="off", exact=True, progress=False)
    assert multi.config == replace(plain.config, name=tmp_path.name)
    ids = prompt_ids(plain)
    ours = multi.runner.logits(ids, multi.new_cache("off"))
    assert torch.equal(ours, plain.runner.logits(ids, plain.new_cache("off")))


STATE_MODES = ["basic", "contiguous", "paged", "int8", "window"]


def cut(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


@pytest.mark.parametrize("mode", STATE_MODES)
def test_every_mode_keeps_the_state_chunked_equals_one_shot(qwen35_dir, mode):
    """Every one-sequence mode keeps the DeltaNet layers' state as a layer group of its
    cache (kvlm.cache.recurrent, a HybridCache's part): chunks of 1, 3 and 5 give the
    one-shot prefill's logits bit for bit in the exact modes (int8 within fp32 rounding:
    a chunk reads earlier rows as int8; window as exactly as the one shot: the ring's
    order);
    in fp64 within the reordering bound of two fp64 evaluations; the exact modes' one
    shot is the `off` oracle's bit for bit; a DeltaNet layer takes no K/V."""
    folder = qwen35_dir("qwen35-bias")
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    fp64 = LLM(model=folder, kv=mode, dtype="fp64", progress=False)
    ids = prompt_ids(llm)
    exact = hf_logits(folder, ids, torch.float64)
    one_shot, one_shot64 = fed(llm, ids, [len(ids)]), fed(fp64, ids, [len(ids)])
    off = LLM(model=folder, kv="off", exact=True, progress=False)
    off_shot = off.runner.logits(ids, off.new_cache("off"))
    for size in (1, 3, 5):
        chunked = fed(llm, ids, cut(len(ids), size))
        if mode == "int8":  # a chunk reads earlier chunks' K/V as int8 rows, one shot its
            # own fp32 K/V: both as far from the exact as int8 rows make them, apart by no
            # more than fp32 rounding (as every family's int8 cache)
            assert max_error(chunked, one_shot) <= SAME_ROUNDING * max_error(off_shot, exact)
        elif mode == "window":  # the ring's keys in slot order: another summation order
            assert_as_exact_as(chunked, one_shot, exact)
        else:  # bit for bit (kernels/deltanet.c: each value one way wherever it falls)
            assert torch.equal(chunked, one_shot), (size, max_error(chunked, one_shot))
        far = max_error(fed(fp64, ids, cut(len(ids), size)), one_shot64)
        if mode == "int8":
            assert far <= SAME_ROUNDING * max_error(off_shot, exact), size
        else:
            assert far <= fp64_reorder_bound(max_error(off_shot, exact)), size
    if mode in ("basic", "contiguous", "paged"):
        assert torch.equal(one_shot, off_shot)
    spec, attention = llm.cache_spec(), 1  # D D A D
    per_layer = spec.num_kv_heads * spec.head_dim * 2 * spec.dtype.itemsize
    assert spec.bytes_per_token == attention * per_layer or mode == "int8"


@pytest.mark.parametrize("mode", STATE_MODES)
def test_generate_in_every_mode_and_forks_equal_kv_off(qwen35_dir, mode):
    """Greedy tokens through LLM.generate in every mode = kv off's (which feeds every
    forward from position 0; int8, which rounds K/V, by the top-5 rule); n = 2 greedy
    samples (a fork of the prompt's cache, state and all) = the one; two prompts (batched
    on the engine's pool in paged and int8, a slot of state a sequence) = each alone."""
    folder = qwen35_dir("qwen35")
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, "One two three, one two three, one two"]
    off = LLM(model=folder, kv="off", progress=False)
    alone = [off.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(model=folder, kv=mode, progress=False)
    if mode == "int8":  # K/V rounded on purpose: off's tokens by the top-5 rule, then
        for p, want in zip(prompts, alone, strict=True):  # batched and forks = its own
            got = llm.generate(p, replace(greedy, logprobs=5))[0].outputs[0]
            ids = off.encode(p)
            ref = off.runner.logits(ids + want[:-1], off.new_cache("off"))[len(ids) - 1 :]
            tops = [list(lp.top) for lp in got.logprobs]
            assert_greedy_agreement(got.token_ids, tops, want, ref)
        alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    two = llm.generate(prompts[0], replace(greedy, n=2))
    assert [s.token_ids for s in two[0].outputs] == [alone[0]] * 2


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_a_chat_turn_resumes_from_the_state_where_its_reply_began(qwen35_dir, mode):
    """A state cannot be rolled back token by token, so a chat session asks its cache to
    keep the state where each turn's generation prompt begins (`checkpoint`: the next turn
    renders the reply after it otherwise): the next turn rolls back there and prefills
    only the rest (the reply as the template renders it and the new message), and its
    reply is a kv-off session's, which recomputes the whole conversation. Back past what
    is kept is refused with the reason (can_roll_back False: the caller starts over)."""
    folder = qwen35_dir("qwen35")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm, off = (
        LLM(model=folder, kv=mode, progress=False),
        LLM(model=folder, kv="off", progress=False),
    )
    one, ref = llm.chat_session(params), off.chat_session(params)
    turns = []
    for text in ("Hello there", "And then?", "Go on."):
        stream = one.send(text)
        assert "".join(stream) == "".join(ref.send(text))
        prompt = llm.tokenizer.encode_chat(one.messages)
        began = len(llm.tokenizer.encode_chat(one.messages, add_generation_prompt=False))
        turns.append((len(prompt), began, stream.output.metrics.prefill_tokens))
    one._settle(), ref._settle()
    assert one.history == ref.history
    (n1, b1, p1), (n2, b2, p2), (n3, b3, p3) = turns
    assert p1 == n1 and p2 == n2 - b1 and p3 == n3 - b2, turns  # from the last turn's start
    cache = one.cache
    assert cache.num_tokens > 1 and not cache.can_roll_back(1) and cache.can_roll_back(0)
    assert cache.rollback_point(cache.num_tokens - 1) == b3  # the last turn's start
    with pytest.raises(InvalidRequestError, match="DeltaNet's state cannot forget"):
        cache.rollback(1)
    assert cache.can_roll_back(cache.num_tokens)  # all of it: a reset
    cache.rollback(cache.num_tokens)
    assert cache.num_tokens == 0


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_a_saved_conversation_continues_from_its_checkpoint(qwen35_dir, tmp_path, mode):
    """A chat saved after two turns and loaded into a fresh session continues as the one
    that never stopped: the file's state group holds the state and conv rows, and the
    session's checkpoints (where each turn's reply began), so the loaded session's next
    turn prefills only from the last one, as the unbroken session's does; `kvlm inspect
    --cache` reads the file alone. Damaged state groups are one clear CacheFileError each
    (a state that is not finite, checkpoints out of order or past the tokens, too many,
    a shape the metadata does not say), the session left empty."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvlm.cache.base import CacheFileError
    from kvlm.cli import main

    llm = LLM(model=qwen35_dir("qwen35"), kv=mode, progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = llm.chat_session(params)
    for text in ("Hello there", "And then?"):
        "".join(one.send(text))
    path = tmp_path / "chat.kvc"
    one.save(path, llm.fingerprint)
    went_on = one.send("Go on.")
    text = "".join(went_on)
    two = llm.chat_session(params)
    two.load(path, llm.fingerprint)
    again = two.send("Go on.")
    assert "".join(again) == text and two.history == one.history
    assert again.output.metrics.prefill_tokens == went_on.output.metrics.prefill_tokens
    assert 0 < again.output.metrics.prefill_tokens < len(again.tokens) - 8
    assert main(["inspect", "--cache", str(path)]) == 0
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    g = next(k[: -len("mark_pos")] for k in tensors if k.endswith("mark_pos"))
    pos, state = tensors[g + "mark_pos"], tensors[g + "state"]
    assert len(pos) == 2 and 0 < pos[0] < pos[1] < int(meta["length"])
    inf = state.clone()
    inf.view(-1)[3] = float("inf")
    five = {g + "mark_pos": torch.arange(1, 6), **{g + k: tensors[g + k][:1].repeat(
        5, *[1] * (tensors[g + k].dim() - 1)) for k in ("mark_state", "mark_conv")}}  # fmt: skip
    bad_files = [
        ({g + "state": inf}, "state are not all finite"),
        ({g + "mark_pos": pos.flip(0)}, "are not ascending"),
        ({g + "mark_pos": pos + int(meta["length"])}, "are not ascending"),
        (five, "at most 4 checkpoints"),
        ({g + "mark_conv": tensors[g + "mark_conv"][:1]}, "mark_conv have shape"),
        ({g + "state": state[:, :, :1].contiguous()}, "state have shape"),
    ]
    for bad, says in bad_files:
        save_file({**tensors, **bad}, tmp_path / "bad.kvc", meta)
        session = llm.chat_session(params)
        with pytest.raises(CacheFileError, match=says):
            session.load(tmp_path / "bad.kvc", llm.fingerprint)
        assert session.cache.num_tokens == 0


@pytest.mark.parametrize("mode", ["contiguous", "window"])
def test_speculative_decoding_on_one_cache_equals_plain(qwen35_dir, mode):
    """Speculative decoding on one cache (a DraftBatch: the last token and its draft as
    rows of one step; the state after each row kept, the rejected rows' rolled back to the
    accepted one's): prompt lookup and a draft model (the file's int8 self, whose own
    cache keeps the state its one-token steps end at, `hold_rollback`) give plain greedy
    decoding's tokens, with drafts both accepted and rejected."""
    from kvlm.engine.speculative import SpeculativeConfig

    folder = qwen35_dir("qwen35")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(model=folder, kv=mode, progress=False)
    prompts = [llm.tokenizer.encode(p) for p in (PROMPT, "One two three, one two three, one two")]
    want = [answer(llm.cache_engine(), ids, greedy)[0] for ids in prompts]
    for how in (SpeculativeConfig("ngram", ngram_min=1),
                SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        spec = LLM(model=folder, kv=mode, speculative=how, progress=False)
        engine = spec.cache_engine()
        assert [answer(engine, ids, greedy)[0] for ids in prompts] == want, how.method
        st = engine.stats.spec
        # prompt lookup's drafts are rejected (a random model); the int8 self's accepted
        # in part: rows rolled back to a middle one
        assert st.drafted > 0 and (how.method == "ngram" or 0 < st.accepted < st.drafted), st


def test_a_draft_rolls_back_to_any_of_its_rows(qwen35_dir):
    """A one-sequence cache's draft step (begin(n, draft=True)) gives each token's decode
    logits bit for bit and keeps the state and conv rows after each of its rows: rolled
    back to any of them, the next token's logits are plain decoding's; back past them
    (before the step's first row) is refused with the reason (can_roll_back False: the
    caller starts over). hold_rollback(k) keeps the states
    that steps of one token end at, k back (a draft model's cache)."""
    from kvlm.engine.runner import DraftBatch

    llm = LLM(model=qwen35_dir("qwen35-attention-first"), kv="contiguous", exact=True,
              progress=False)  # fmt: skip
    ids = prompt_ids(llm, 30)
    plain = llm.new_cache()
    fed(llm, ids[:20], [20], plain)
    steps = [llm.runner.forward([t], plain) for t in ids[20:26]]  # positions 20 .. 25
    draft = llm.new_cache()
    fed(llm, ids[:20], [20], draft)
    saved = draft.snapshot()
    rows = llm.runner.run(DraftBatch(ids[20:25], draft))
    assert torch.equal(rows, torch.stack(steps[:5]))
    for back in range(1, 5):  # keep 5 - back of the 5 rows
        draft.restore(saved)
        llm.runner.run(DraftBatch(ids[20:25], draft))
        draft.rollback(back)
        n = draft.num_tokens
        assert n == 25 - back and draft.can_roll_back(n - 21) and not draft.can_roll_back(n - 20)
        with pytest.raises(InvalidRequestError, match="past the states kept"):
            draft.rollback(n - 20)  # before the draft's first row
        nxt = llm.runner.forward([ids[25 - back]], draft)
        assert torch.equal(nxt, steps[5 - back]), back
    draft.restore(saved)
    llm.runner.run(DraftBatch(ids[20:25], draft))
    assert draft.can_roll_back(4) and not draft.can_roll_back(5)  # the first row stays
    held = llm.new_cache()
    held.hold_rollback(3)
    fed(llm, ids[:20], [20], held)
    for t in ids[20:24]:
        llm.runner.forward([t], held)
    assert held.can_roll_back(3) and not held.can_roll_back(4)
    held.rollback(3)
    assert torch.equal(llm.runner.forward([ids[21]], held), steps[1])


def test_the_state_forks_snapshots_and_restores(qwen35_dir):
    """A cache's state: a snapshot restored gives the same next logits; a fork decodes
    each row as the one it came from and as the unforked row alone, bit for bit (batched =
    alone); free goes back to one empty sequence."""
    llm = LLM(model=qwen35_dir("qwen35-attention-first"), kv="contiguous", exact=True,
              progress=False)  # fmt: skip
    ids = prompt_ids(llm, 24)
    cache = llm.new_cache()
    fed(llm, ids[:20], [20], cache)
    saved = cache.snapshot()
    after = fed(llm, ids[20:], [4], cache)
    cache.restore(saved)
    assert cache.num_tokens == 20
    assert torch.equal(fed(llm, ids[20:], [4], cache), after)
    cache.restore(saved)
    cache.fork(2)
    two = llm.runner.run(CacheBatch([[5], [5]], cache))
    assert two.shape[0] == 2 and torch.equal(two[0], two[1])
    cache.restore(saved)
    one = llm.runner.run(CacheBatch([[5]], cache))[0]
    assert torch.equal(two[0], one)
    cache.free()
    assert cache.num_tokens == 0 and cache.batch == 1


def test_a_long_steps_conv_rows_keep_only_what_commit_needs(qwen35_dir):
    """A prompt step's conv rows stage only the last L - 1 of each DeltaNet layer's input
    (copied: a view would hold that layer's whole in_proj product until commit, 18 of
    them ~1.5 MB a token at Qwen3.5-0.8B's shape, which took a 16k-token prompt past 24
    GB), and a checkpoint's window where one falls inside; the state after the step is
    the one a step of the whole prompt at once leaves, as before."""
    llm = LLM(model=qwen35_dir("qwen35"), kv="contiguous", exact=True, progress=False)
    ids = prompt_ids(llm, 40)
    cache = llm.new_cache()
    cache.checkpoint(17)
    step = cache.begin(len(ids))
    with torch.inference_mode():
        llm.model(torch.tensor([ids]), step.positions, step)
    conv = step.for_layer(0).recurrent.conv  # the DeltaNet part's ConvStep
    r = llm.config.deltanet.conv_kernel - 1
    for staged, windows in zip(conv.staged, conv.windows, strict=True):
        assert staged.shape[1] == r and staged._base is None
        assert list(windows) == [17] and windows[17].shape[1] == r
    cache.commit(step)
    assert cache.rollback_point(20) == 17


def test_the_pacings_work_counts_the_deltanet_layers_as_no_attention(qwen35_dir):
    """kvlm.engine.pacing's Work: only the attention layers attend (D A D A: two), a gated
    one's q product twice as wide; a DeltaNet layer's products and its state's update are
    dense work a token."""
    from kvlm.engine.pacing import Work

    c = LLM(model=qwen35_dir("qwen35"), kv="off", progress=False).config
    d, h = c.deltanet, c.hidden_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    v = d.value_heads * d.value_dim
    delta = h * (d.conv_width + v + 2 * d.value_heads) + v * h + 4 * v * d.key_dim
    dense = 2 * h * (3 * q + 2 * kv) + 2 * delta + 4 * 3 * h * c.intermediate_size
    assert Work(c).attend == 2 * 2 * q / dense


def test_a_rows_bits_are_the_same_on_one_thread_or_two(qwen35_dir):
    """The engine moves its thread count while it runs (kvlm.engine.threads): prompt rows
    and decode rows of a hybrid are bit-equal on 1 and 2 threads (the DeltaNet step
    splits its work by sequence and head, never a value's sum)."""
    llm = LLM(model=qwen35_dir("qwen35"), kv="contiguous", progress=False, threads=2)
    ids, runs, before = prompt_ids(llm), [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = llm.new_cache()
            prompt = fed(llm, ids, [len(ids)], cache)
            decode = torch.stack([llm.runner.forward([7 + i], cache) for i in range(6)])
            runs.append((prompt, decode))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_memory_counts_the_state_per_sequence(qwen35_dir, mode, capsys):
    """`kvlm memory`'s plan: the DeltaNet layers' state a sequence whatever its length
    (value_heads x key_dim x value_dim, kernel - 1 rows of q|k|v and the rule's carried
    rows, DELTA_CHUNK - 1 of key_dim + value_dim + 2 a value head, fp32), the attention
    layers' K/V per token; a made cache holds what is planned for it."""
    from kvlm.cache import memory
    from kvlm.cache.kinds import DELTA_CHUNK
    from kvlm.cli import main

    llm = LLM(model=qwen35_dir("qwen35"), kv=mode, progress=False)
    c, spec = llm.config, llm.cache_spec()
    d, layers = c.deltanet, len(c.deltanet_layers)
    carried = d.value_heads * (DELTA_CHUNK - 1) * (d.key_dim + d.value_dim + 2)
    state = layers * (d.value_heads * d.key_dim * d.value_dim
                      + (d.conv_kernel - 1) * d.conv_width + carried) * 4  # fmt: skip
    for context, batch in ((64, 1), (128, 3)):
        groups = memory.layer_groups(mode, spec, context, batch)
        assert [g for g in groups if g["kind"] == "state"] == [
            {"kind": "state", "layers": layers, "window": None, "tokens": 0,
             "bytes": batch * state, "snapshot_bytes": state - layers * carried * 4}]  # fmt: skip
        assert memory.planned_nbytes(mode, spec, context, batch) == sum(g["bytes"] for g in groups)
    assert llm.new_cache().parts[-1].nbytes == state
    assert main(["memory", "--model", str(llm.loaded.path), "--kv", mode, "--context", "64"]) == 0
    said = f"{layers} recurrent layers, their state {state / 2**10:,.1f} KiB a sequence"
    out = capsys.readouterr().out
    assert said in out
    snapshot = state - layers * carried * 4  # at a block end of 16: no rows carried
    assert (
        f"snapshots of it for prefix hits (the state at a block's end: a prompt's, an "
        f"answer's, one every 512 prompt tokens) in 25% of --kv-memory (--snapshot-share): "
        f"{(1 << 28) // snapshot:,} of {snapshot / 2**10:,.1f} KiB in the default 1,024.0 MiB"
        in out
    )  # snapshot_plan's, at the default --kv-memory (before its cap of a snapshot a block)


def test_a_cache_without_the_state_says_why(qwen35_dir):
    """A forward past position 0 through a cache of another spec (no state group) says
    why (the fused step's own: tests/test_fused_recurrent.py)."""
    from kvlm.cache import create_cache

    folder = qwen35_dir("qwen35")
    llm = LLM(model=folder, kv="paged", progress=False)
    cache = create_cache("contiguous", replace(llm.cache_spec("contiguous"), layer_kinds=()))
    with torch.inference_mode():
        step = cache.begin(4)
        llm.model(torch.tensor([[5, 6, 7, 8]]), step.positions, step)
        cache.commit(step)
        step = cache.begin(1)
        with pytest.raises(UnsupportedModelError, match="recurrent layers need their state"):
            llm.model(torch.tensor([[9]]), step.positions, step)


def test_hostile_config_keys_are_refused(tmp_path):
    """Each key the family reads, of the wrong kind or range, is one clear error naming
    it."""
    from transformers import Qwen3_5TextConfig

    from kvlm.arch import config_from_hf

    base = Qwen3_5TextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, head_dim=8,
                             num_attention_heads=4, num_key_value_heads=2).to_dict()  # fmt: skip
    assert config_from_hf(base).layer_mixers == ("deltanet",) * 3 + ("attention",)
    bad = [
        ({"linear_num_value_heads": 3, "linear_num_key_heads": 2}, "linear_num_value_heads"),
        ({"linear_key_head_dim": "16"}, "linear_key_head_dim"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"layer_types": ["mamba"] * 4}, "unsupported layer types"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 1.5}}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.1}}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]  # fmt: skip
    for change, named in bad:
        with pytest.raises((ModelLoadError, UnsupportedModelError), match=named):
            config_from_hf({**base, **change})


# ------------------------------------------------------------------- llama.cpp's converter

# the folders converted: with an MTP head as the Hub's checkpoints carry (the converter
# writes it as a block after the model's), or without (`--no-mtp`)
WITH_MTP = ("qwen35", "qwen35-deltanets-last")


@pytest.fixture(scope="module")
def converted(qwen35_dir, tmp_path_factory):
    """(name, outtype) -> (the HF folder, the GGUF llama.cpp's convert_hf_to_gguf.py
    writes for it), each converted once."""
    made = {}

    def make(name: str, outtype: str = "f32"):
        if (name, outtype) not in made:
            folder = qwen35_dir(name)
            if name in WITH_MTP:  # the folder with its head: the file's twin
                folder = with_mtp(folder, tmp_path_factory.mktemp(name) / "mtp")
                path = converter.convert(folder, outtype, pre="qwen35")
            else:
                path = converter.convert(folder, outtype, pre="qwen35", options=("--no-mtp",))
            made[name, outtype] = folder, path
        return made[name, outtype]

    return make


@pytest.mark.parametrize("name", ["qwen35", "qwen35-deltanets-last", "qwen35-bias"])
def test_gguf_from_llama_cpps_converter_reads_as_the_folder(converted, name):
    """The file users get (f32): the folder's config (but the epsilon, stored in fp32), the
    very weights the folder's load gives (the +1 norms as transformers adds them; -exp(A_log)
    taken back to an A_log of the same exp; q_proj's [q, gate] rows and the v heads the
    converter tiles put back), so teacher-forced logits bit-equal to the folder's and the
    same greedy tokens. With an MTP head (its blocks after the model's, read as the
    folder's `mtp.*`: the converter's +1 on its norms as the folder's fold) and without."""
    folder, path = converted(name)
    from_gguf, from_hf = gguf_as_folder(path, folder)
    ours, ref = from_gguf.model.state_dict(), from_hf.model.state_dict()
    assert ours.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(ours[key], value), key
    ids = prompt_ids(from_hf)
    got = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    assert torch.equal(got, from_hf.runner.logits(ids, from_hf.new_cache("off")))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = [LLM(model=m, progress=False).generate(prompt_token_ids=[ids[:8]],
                                                  sampling_params=params)[0].token_ids
            for m in (path, folder)]  # fmt: skip
    assert runs[0] == runs[1]


def test_gguf_vocabulary_and_template_read_as_the_folder(converted):
    """The vocabulary's pre-tokenizer "qwen35" is Qwen 3.5's split (marks in words): the
    file's ids are the folder's, through kvlm and transformers, for text in NFC (llama.cpp
    does not normalise; transformers composes first), and its chat template renders alike."""
    from transformers import AutoTokenizer

    folder, path = converted("qwen35")
    ours = LLM(model=path, kv="off", progress=False).tokenizer
    theirs = LLM(model=folder, kv="off", progress=False).tokenizer
    ref = AutoTokenizer.from_pretrained(folder)
    texts = ["The quick brown fox.", "  runs   of\n\n spaces\t", "12345 3.14159 café", "I'll",
             "na\u00efve ma\u00f1ana <|im_end|>", "x\u0301y \u0301!"]  # fmt: skip
    for text in texts:
        assert ours.encode(text) == theirs.encode(text) == ref.encode(text), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages, add_generation_prompt=True) == want
    assert ours.eos_token_ids == theirs.eos_token_ids


@pytest.mark.parametrize("name", ["qwen35", "qwen35-wide-v"])
def test_a_q8_0_gguf_native_blocks_are_its_values(converted, name):
    """--outtype q8_0: every tensor kvlm takes as the file's blocks (--weights native),
    rows and columns in Hugging Face's order, is the tensor the file decodes to; out_proj,
    whose columns the converter tiled by v head, as blocks where a v head is whole blocks
    (value_dim 32: "qwen35-wide-v"), else decoded (value_dim 8); so the model on the
    file's blocks is, bit for bit, the model on its decoded values quantized to int8
    (Q8_0's blocks are kvlm's q8 codes). Greedy tokens follow transformers' fp32 by the
    top-5 rule (on "qwen35": the wider model's random weights move its logits by Q8_0's
    rounding more than that rule allows, the f32 decoding of the file as much)."""
    from kvlm.loading.gguf import GGUFWeights

    folder, path = converted(name, "q8_0")
    weights = GGUFWeights(path)
    taken = {}
    for key in weights.names():
        blocks = weights.get_quant(key)
        if blocks is not None:
            assert torch.equal(blocks.dense(), weights.get(key).float()), key
            taken[key] = blocks
    out_proj = "model.layers.0.linear_attn.out_proj.weight"
    assert (out_proj in taken) == (name == "qwen35-wide-v")
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in taken
    llm = LLM(model=path, kv="off", weights="native", progress=False)
    int8 = LLM(model=path, kv="off", weights="int8", progress=False)
    ids = llm.tokenizer.encode(PROMPT)
    assert torch.equal(llm.runner.logits(ids, llm.new_cache("off")),
                       int8.runner.logits(ids, int8.new_cache("off")))  # fmt: skip
    if name != "qwen35":
        return
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(load_hf(folder), ids, 16)
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids,
                            ref_logits)  # fmt: skip


def test_ssm_a_is_taken_back_to_an_a_log_of_the_same_exp(converted):
    """The converter stores -exp(A_log) (fp32); log of it, rounded to fp32, misses an
    A_log whose exp is that value for about 1 in 10^4 (exp spreads neighbours apart past
    |A_log| > 1): the value next to it is taken there, so exp(A_log) at run time is the
    file's, every one of 10^6 values of transformers' init range (log U(0, 16))."""
    from kvlm.arch import family

    config = LLM(model=converted("qwen35")[1], kv="off", progress=False).config
    a_log = torch.log(
        torch.empty(10**6).uniform_(0, 16, generator=torch.Generator().manual_seed(0))
    )
    stored = -a_log.float().exp()
    got = family("qwen35").fold_gguf(config, "model.layers.0.linear_attn.A_log", stored)
    assert torch.equal(-got.exp(), stored)


def _drop(key):
    return lambda spec: spec.meta.pop(key)


_key, _shape, _values = set_key, cut_rows, fill


# a converted file's faults -> what the one line names
QWEN35_GGUF_FINDINGS = {
    "no-state-size": (_drop("qwen35.ssm.state_size"), r"qwen35\.ssm\.state_size"),
    "no-group-count": (_drop("qwen35.ssm.group_count"), r"qwen35\.ssm\.group_count"),
    "inner-size-7": (_key("qwen35.ssm.inner_size", 7), r"inner_size 7"),
    "v-heads-3": (_key("qwen35.ssm.time_step_rank", 3), r"time_step_rank"),
    "recurrent-layers-short": (_key("qwen35.attention.recurrent_layers", [True, False]),
                               r"recurrent_layers names 2 blocks"),
    "mtp-block-recurrent": (_key("qwen35.attention.recurrent_layers", [True] * 5),
                            r"marks block 4 recurrent"),
    "rope-dims-odd": (_key("qwen35.rope.dimension_count", 7), r"dimension_count is 7"),
    "nextn-all": (_key("qwen35.nextn_predict_layers", 5), r"nextn_predict_layers"),
    "conv-kernel-rows": (_shape("blk.0.ssm_conv1d.weight", 40), r"blk\.0\.ssm_conv1d"),
    "qkv-rows": (_shape("blk.2.attn_qkv.weight", 50), r"blk\.2\.attn_qkv"),
    "no-ssm-a": (lambda spec: spec.tensors.pop("blk.0.ssm_a"), r"no tensor blk\.0\.ssm_a"),
    "ssm-a-positive": (_values("blk.0.ssm_a", 0.5), r"blk\.0\.ssm_a holds values"),
}  # fmt: skip


def test_the_converted_file_runs_in_the_child(converted, child, tmp_path):
    """The base the edits start from, written back from its Spec, loads and generates (else
    every refusal below is vacuous)."""
    from gguf_hostile import read, write

    _, path = converted("qwen35")
    got = child.run(write(read(path), tmp_path / "m.gguf"))
    assert got.outcome == "ran", got


@pytest.mark.parametrize("finding", list(QWEN35_GGUF_FINDINGS))
def test_a_faulty_qwen35_gguf_is_one_clear_line(converted, child, tmp_path, finding):
    """A key the family reads missing or wrong, a DeltaNet tensor of another shape,
    missing, or of values -exp cannot give: one ModelLoadError / UnsupportedModelError
    line naming the file and the fault."""

    from gguf_hostile import read, write

    _, path = converted("qwen35")
    edit, says = QWEN35_GGUF_FINDINGS[finding]
    spec = read(path)
    edit(spec)
    child.run(write(spec, tmp_path / "m.gguf")).refused_in_one_line("m.gguf", says)


# ------------------------------------------------------------------- the engine's pool


@pytest.fixture(scope="module")
def pooled(qwen35_dir):
    """The tiny Qwen3.5 (D A D A) on --kv paged, and each POOL_PROMPTS' greedy tokens
    alone on its one-sequence cache (a HybridCache: the paged part and the state)."""
    llm = LLM(model=qwen35_dir("qwen35"), kv="paged", progress=False)
    alone = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    return llm, alone


def test_the_pool_batches_chunks_forks_and_preempts_as_alone(pooled):
    """Through the engine's pool (a slot of state a sequence, kvlm.cache.recurrent.
    StateSlots): the prompts batched, in chunks of 5 (one ragged step's sequences at their
    own row offsets), n = 2 greedy samples (the slot forked by copy), and on a pool too
    small for them all (the newest preempted, their slots freed and their prompts
    recomputed) each give every prompt's tokens alone; every slot is back at the end; the
    same prompts again (after the first three finished) are prefix hits with the same
    tokens. The pool made holds the slots, snapshots and blocks planned (windowed_plan,
    block_bytes)."""
    from kvlm.cache.recurrent import StateSlots
    from kvlm.engine.engine import block_bytes, windowed_plan

    llm, want = pooled
    got, engine = on_pool(llm, POOL_PROMPTS, GREEDY)
    assert got == want
    state = engine.pool.groups[1]
    assert isinstance(state, StateSlots) and state.num_used == 0 and state.num_blocks == 16
    cfg, spec = engine.config, engine.spec  # the pool made is the pool planned
    plan = windowed_plan(cfg, spec, llm.max_context)
    # a slot a seat, and the snapshots of its state and rows planned (a block end of 16
    # carries no rows of the rule's chunk: a snapshot is a slot less its carried rows)
    assert plan.blocks == [16] and state.nbytes == plan.nbytes
    assert state.snap_state.shape[1] == plan.snapshots > 0
    assert plan.nbytes == 16 * state.block_nbytes + plan.snapshots * state.block_rows_nbytes
    assert state.block_rows_nbytes == state.block_nbytes - state.win.nbytes // 16
    assert engine.pool.total_nbytes == engine.pool.num_blocks * block_bytes(cfg, spec) + plan.nbytes
    assert [o.outputs[0].token_ids for o in llm.generate(POOL_PROMPTS, GREEDY)] == [
        w[0] for w in want]  # LLM.generate's own pool  # fmt: skip
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want
    two, engine = on_pool(llm, POOL_PROMPTS, SamplingParams(n=2, max_tokens=20, temperature=0.0,
                                                            ignore_eos=True))  # fmt: skip
    assert two == [w * 2 for w in want] and engine.pool.groups[1].num_used == 0
    small = LLM(model=llm.loaded.path, kv="paged", max_context=96, progress=False)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want_long = [[small.generate(p, long)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    got, engine = on_pool(small, POOL_PROMPTS, long, num_blocks=8)
    assert got == want_long
    assert engine.scheduler.preemptions > 0 and engine.pool.groups[1].num_used == 0
    again, engine = on_pool(llm, POOL_PROMPTS * 2, GREEDY, scheduler={"max_num_seqs": 3})
    assert again == want * 2 and engine.manager.stats.hits > 0  # the second three: hits


def test_a_pool_step_refuses_a_state_of_another_length(pooled):
    """A slot's state holds its tokens and no others: a step that does not start where
    the slot ends is refused (CacheOverflowError), and so is a trim to fewer tokens but
    0; a step that fails leaves the slot as it was (commit after the forward only)."""
    from kvlm.cache.recurrent import StateSlots
    from kvlm.engine.engine import Engine
    from kvlm.errors import CacheOverflowError

    llm, _ = pooled
    state = Engine(llm).pool.groups[1]
    assert isinstance(state, StateSlots)
    r, width, layers = state.conv.shape[2], state.conv.shape[-1], state.state.shape[0]
    slot = [state.allocate()]

    def run(step, u: torch.Tensor) -> list[torch.Tensor]:
        taps = []
        for layer in range(layers):
            taps = step.taps(layer, u)
            step.stage(layer, step.initial(layer) + 1)
            step.stage_win(layer, step.initial_win(layer))
        return taps

    step = state.step([(slot[0], 0, 5, [])])
    u = torch.randn(1, 5, width)
    step.taps(0, u)
    with pytest.raises(ValueError, match="before every DeltaNet layer ran"):
        step.commit()
    assert state.end[slot[0]] == 0 and not state.conv[:, slot[0]].any()
    taps = run(step, u)
    assert torch.equal(taps[0][0, :r], torch.zeros(r, width))  # before position 0: zeros
    assert step._bufs[0].shape[0] == r  # of the step's rows only what commit reads is held
    step.commit()
    assert state.end[slot[0]] == 5 and torch.equal(state.conv[0, slot[0]], u[0, -r:])
    v = torch.randn(1, 1, width)
    taps = run(state.step([(slot[0], 5, 1, [])]), v)  # one row: the slot's rows before it
    assert all(torch.equal(t[0, 0], w) for t, w in zip(taps, [*u[0, -r:], v[0, 0]], strict=True))
    with pytest.raises(CacheOverflowError, match="holds 5 tokens; a step at 4"):
        state.step([(slot[0], 4, 1, [])])
    with pytest.raises(RuntimeError, match="cannot forget"):
        state.trim(slot, 4)
    state.trim(slot, 0)
    assert not slot and state.num_used == 0


def test_a_pool_draft_rolls_back_to_its_rows(pooled):
    """A sequence's draft rows (pieces of one token at consecutive positions) are one
    sequence of the step whose state after each row but the last is kept
    (SlotDeltaStep.keep_rows) until the slot's next step: a trim to one of them restores
    that row's state and conv rows, and forgets the block-end snapshot taken past it (a
    rejected row's state); a trim before the draft, or after the next step, is refused."""
    from kvlm.engine.engine import Engine

    llm, _ = pooled
    state = Engine(llm).pool.groups[1]
    layers, r, width = state.state.shape[0], state.conv.shape[2], state.conv.shape[-1]
    bs, slot, table = state.block_size, [state.allocate()], [7, 8]

    def run(step, u: torch.Tensor, mark: float) -> None:
        for layer in range(layers):
            step.taps(layer, u)
            step.stage(layer, step.initial(layer) + mark)
            step.stage_win(layer, step.initial_win(layer))
            if step.keep_rows:  # the state after kept row i: marked i + 1
                kept = [step.initial(layer)[0] + i + 1 for i in range(len(step.keep_rows))]
                step.stage_kept(layer, torch.stack(kept))
                step.stage_kept_win(layer, step.initial_win(layer)[[0] * len(kept)])
        step.commit()

    u = torch.randn(1, bs - 2, width)
    run(state.step([(slot[0], 0, bs - 2, table)]), u, 0.5)  # a prompt: 2 short of a block
    before = state.state[:, slot[0]].clone()
    d = torch.randn(1, 5, width)  # the last token and 4 drafted: positions bs - 2 .. bs + 2
    step = state.step([(slot[0], bs - 2 + i, 1, table) for i in range(5)])
    assert step.cu == [0, 5] and step.keep_rows == [0, 1, 2, 3]
    run(step, d, 100.0)
    assert state.end[slot[0]] == bs + 3 and table[0] in state.snap_of  # the block's end
    state.trim(slot, bs + 1)  # 3 rows kept: the state after row 2, the rows before bs + 1
    assert state.end[slot[0]] == bs + 1
    assert torch.equal(state.state[:, slot[0]], before + 3)
    assert torch.equal(state.conv[0, slot[0]], torch.cat([u[0], d[0]])[-r - 2 : -2])
    assert table[0] in state.snap_of  # taken at bs, kept
    run(state.step([(slot[0], bs + 1 + i, 1, table) for i in range(3)]), d[:, :3], 1.0)
    state.trim(slot, bs + 1 + 1)
    run(state.step([(slot[0], bs + 2 + i, 1, table) for i in range(2)]), d[:, :2], 1.0)
    with pytest.raises(RuntimeError, match="cannot forget"):
        state.trim(slot, bs + 1)  # the draft before the last step: gone
    again = [state.allocate()]
    run(state.step([(again[0], 0, bs - 2, table)]), u, 0.5)
    run(state.step([(again[0], bs - 2 + i, 1, table) for i in range(5)]), d, 100.0)
    assert table[0] in state.snap_of
    state.trim(again, bs - 1)  # back before the block's end: its snapshot was a rejected row's
    assert table[0] not in state.snap_of and state.end[again[0]] == bs - 1
    with pytest.raises(RuntimeError, match="cannot forget"):
        state.trim(again, bs - 2)
    state.trim(slot, 0), state.trim(again, 0)
    assert state.num_used == 0 and not state.drafted


def test_a_prefix_hit_mid_conversation_restores_the_state(pooled):
    """The second turn of a chat finds the first's blocks: the snapshot of the state at
    the hit's last block end (taken by the step that passed it) restores the sequence's
    slot, and the answer is a fresh pool's, which computes the whole prompt; without that
    snapshot the hit goes back to the last block end that has one, and with none it is
    no hit. The snapshots are a fixed budget (a running sequence holds its prompt's and
    its answer's latest), the least recently used reused first."""
    llm, _ = pooled
    first, second = conversation(llm)
    want, cold = answer(fresh_engine(llm), second)
    assert cold == 0
    engine = fresh_engine(llm)
    answer(engine, first)
    got, cached = answer(engine, second)
    hit = (len(first) // 16) * 16  # at least the first turn's full blocks
    assert got == want and cached >= hit > 0 and engine.manager.stats.hits == cached
    state = engine.pool.groups[1]
    assert 0 < state.blocks_with_rows <= state.snap_state.shape[1]
    assert state.num_used == 0
    blocks, _ = engine.manager.match(second)
    assert state.has_rows(blocks[-1], engine.pool.prefix.prefix_id[blocks[-1]])
    state.forget(blocks[-1])  # that block's snapshot gone: the hit is an earlier end
    shorter = max((i + 1) * 16 for i, b in enumerate(blocks[:-1])
                  if state.has_rows(b, engine.pool.prefix.prefix_id[b]))  # fmt: skip
    got, cached = answer(engine, second)
    assert got == want and cached == shorter < len(blocks) * 16
    for block in engine.manager.match(second)[0]:
        state.forget(block)
    assert engine.manager.match(second)[0] == []  # no snapshot: no hit
    got, cached = answer(engine, second)
    assert got == want and cached == 0


def test_the_snapshots_are_a_share_of_the_kv_memory(pooled, monkeypatch):
    """The snapshots of the state take --snapshot-share of --kv-memory (as many as it
    holds, kvlm.engine.engine.snapshot_plan), inside the pool's budget: a pool of a given
    kv_memory holds blocks, slots and snapshots within it; a share that holds six keeps
    six, and the oldest conversations' hits go as newer ones take them, the answers
    unchanged; a share of 0 keeps none (no hits, the same tokens); a share outside [0, 1)
    is one clear error, from the library and from `kvlm serve`; a budget the seats'
    states alone fill, another."""
    from kvlm.engine.engine import EngineConfig, snapshot_plan
    from kvlm.errors import InvalidRequestError

    llm, _ = pooled
    first, second = conversation(llm)
    want, _ = answer(fresh_engine(llm), second)
    each = fresh_engine(llm).pool.groups[1].block_rows_nbytes
    memory = 4 << 20
    six = 6 * each / memory + 1e-9  # a share that holds six snapshots and not seven
    assert snapshot_plan(EngineConfig(kv_memory=memory, snapshot_share=six),
                         llm.cache_spec("paged"), llm.max_context) == 6  # fmt: skip
    engine = fresh_engine(llm, kv_memory=memory, snapshot_share=six)
    state = engine.pool.groups[1]
    assert state.snap_state.shape[1] == 6 and engine.pool.total_nbytes <= memory
    answer(engine, first)
    got, cached = answer(engine, second)
    assert got == want and cached > 0  # the conversation's hit
    for p in POOL_PROMPTS:  # other conversations take the six, least recently used first
        answer(engine, llm.tokenizer.encode(p))
    assert state.blocks_with_rows <= 6
    got, cached = answer(engine, second)
    assert got == want  # its snapshots reused by others: a shorter hit or none, same tokens
    none = fresh_engine(llm, kv_memory=memory, snapshot_share=0.0)
    assert none.pool.groups[1].snap_state.shape[1] == 0
    answer(none, first)
    assert answer(none, second) == (want, 0)  # no snapshot: no hit
    more = fresh_engine(llm, kv_memory=memory, snapshot_share=0.5)
    assert more.pool.groups[1].snap_state.shape[1] > 6 and more.pool.total_nbytes <= memory
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(InvalidRequestError, match="--snapshot-share"):
            EngineConfig(snapshot_share=bad)
    # a budget the seats' states fill leaves no K/V block: one error that says what to
    # change (the pool had held one sequence's blocks past the budget)
    slot = none.pool.groups[1].block_nbytes
    with pytest.raises(InvalidRequestError, match="raise --kv-memory, or lower --max-num-seqs"):
        fresh_engine(llm, kv_memory=16 * slot, snapshot_share=0.0)
    # the default budget so filled is the K/V blocks' alone, the states beside it: the
    # default context is the whole one, not a block
    from kvlm.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "default_kv_memory", lambda *_: 16 * slot)
    config = EngineConfig(snapshot_share=0.0)
    blocks = engine_module.memory_blocks(config, llm.cache_spec("paged"), llm.max_context)
    assert blocks == 16 * slot // engine_module.block_bytes(config, llm.cache_spec("paged"))
    assert engine_module.pool_context(llm, config, llm.max_context) > 16
    assert answer(fresh_engine(llm, snapshot_share=0.0), first)[0]


def test_speculative_decoding_on_the_pool_equals_plain(pooled):
    """Speculative decoding through the engine's pool: a sequence's draft rows are one
    sequence of the step to its slot (the state after each row kept until its next step,
    StateSlots.drafted) and a rejected row's trim goes back to the accepted one's state;
    prompt lookup and the file's int8 self as draft model give every prompt's tokens
    alone, batched, drafts accepted and rejected. A conversation decoded speculatively
    (block-end snapshots taken by draft steps, those after a rejected row forgotten)
    hits for its second turn with a fresh pool's answer."""
    from kvlm.engine.speculative import SpeculativeConfig

    llm, want = pooled
    for how in (SpeculativeConfig("ngram", ngram_min=1),
                SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        got, engine = on_pool(llm, POOL_PROMPTS, GREEDY, speculative=how)
        st, state = engine.stats.spec, engine.pool.groups[1]
        assert got == want and st.drafted > 0, how.method  # ngram's rejected, int8's in part
        assert how.method == "ngram" or 0 < st.accepted < st.drafted, st
        assert state.num_used == 0 and not state.drafted
    first, second = conversation(llm)
    plain, _ = answer(fresh_engine(llm), second)
    engine = fresh_engine(llm, speculative=SpeculativeConfig("draft", draft_weights="int8"))
    answer(engine, first)
    got, cached = answer(engine, second)
    assert got == plain and cached >= (len(first) // 16) * 16 > 0
    # drafts made and accepted; rejected ones too where this CPU's numerics part the int8
    # draft from the model (on the AMX Xeon all 32 of this turn's were accepted; the pool
    # prompts above reject some on every CPU the suite ran on)
    assert engine.stats.spec.drafted >= engine.stats.spec.accepted > 0


def test_a_disk_tier_restores_the_state_snapshots(pooled, tmp_path, monkeypatch):
    """A disk tier holds the state snapshots the pool marks at block ends under the
    DeltaNet group's own records (MAC'd as the K/V's): a restarted engine hits the first
    turn's prefix from the tier, state and all (the latest block end a record has), with
    a fresh pool's tokens; those records changed in one byte are refused, and with no
    state for it the hit is none, the same tokens."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the tier key's home
    llm, _ = pooled
    first, second, want, tier, writer = conversation_on_a_tier(llm, tmp_path / "tier")
    sealed = (len(first) + GREEDY.max_tokens - 1) // 16  # full blocks of computed tokens
    stats = writer.tiers.stats["disk"]
    assert sealed < stats.writes < 2 * sealed  # every block's K/V, some blocks' state
    reader = fresh_engine(llm, kv_tiers=tier)
    got, cached = answer(reader, second)
    reader.close()
    assert got == want and cached >= (len(first) // 16) * 16 > 0
    state_ns = reader.tiers.groups[0][0][:32]
    records = [f for f in (tmp_path / "tier").rglob("*") if f.is_file() and state_ns in f.name]
    assert records
    for f in records:  # each changed in one byte: refused, so no state for the hit
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    bent = fresh_engine(llm, kv_tiers=tier)
    got, cached = answer(bent, second)
    bent.close()
    assert got == want and cached == 0 and bent.tiers.stats["disk"].refused >= 1


def think_off_conversation(llm) -> tuple[list[dict], list[int], int, list[int]]:
    """A conversation's two turns under THINK_OFF whose first prompt's last full block
    ends past the point the second turn parts from it (its user message chosen so): the
    second turn's messages, the first's ids and turn start
    (ChatCompletionRequest.turn_start), the second's ids."""
    from kvlm.server.protocol import ChatCompletionRequest

    tok = llm.tokenizer
    for n in range(1, 40):
        user = {"role": "user", "content": " ".join(["word"] * n)}
        first = tok.encode_chat([user])
        turn = ChatCompletionRequest(model="m", messages=[user]).turn_start(tok, first)
        reply = tok.decode(answer(fresh_engine(llm), first)[0])
        messages = [user, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "And then?"}]  # fmt: skip
        second = tok.encode_chat(messages)
        parts = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        if turn and turn >= 16 and parts < len(first) // 16 * 16:
            return messages, first, turn, second
    raise AssertionError("no first turn found whose last block ends past the parting")


def test_a_chat_turns_snapshot_is_where_its_reply_began(qwen35_dir):
    """The pool takes a prompt's snapshot at its last full block end; where the next turn
    renders the reply otherwise than the prompt opened it (a think block dropped), that
    end is past where the turns part, so the next turn cannot use it (nor the answer's).
    With the request's turn start (the server's, ChatCompletionRequest.turn_start) the
    prompt's snapshot is at the last block end at most it: the next turn hits there, with
    a fresh pool's tokens."""
    llm = LLM(model=qwen35_dir("qwen35-think-off"), kv="paged", progress=False)
    _, first, turn, second = think_off_conversation(llm)
    want, _ = answer(fresh_engine(llm), second)
    plain = fresh_engine(llm)
    answer(plain, first)
    got, cached = answer(plain, second)
    assert got == want and cached < turn // 16 * 16
    engine = fresh_engine(llm)
    answer(engine, first, turn_start=turn)
    got, cached = answer(engine, second)
    assert got == want and cached == turn // 16 * 16 > 0, (turn, len(first))


def test_a_shared_prefix_hits_at_the_snapshot_a_prompt_left_within_it(pooled):
    """A prompt leaves a snapshot every `every` tokens it passes (held by no seat, least
    recently used reused first), so another prompt that shares only its first part (a
    system prompt, a document, then another question) hits within it, at the last one
    its shared part passes, with a fresh pool's tokens; without them (`every` past the
    prompt) the second prompt shares nothing the pool kept and prefills it all."""
    llm, _ = pooled
    tok = llm.tokenizer
    shared = tok.encode(" ".join(f"rule {i}: be brief." for i in range(8)))
    # the first's own question long: its prompt's last full block ends past the shared part
    first = shared + tok.encode(" Alpha, and then " + " and then ".join(["more"] * 8) + "?")
    second = shared + tok.encode(" Beta, then gamma?")
    assert len(shared) > 64 and (len(first) - 1) // 16 * 16 > len(shared)
    want, _ = answer(fresh_engine(llm), second)
    for every, hit in ((32, len(shared) // 32 * 32), (4096, 0)):
        engine = fresh_engine(llm)
        engine.pool.groups[1].every = every
        answer(engine, first)
        got, cached = answer(engine, second)
        assert got == want and cached == hit, (every, cached, len(shared))


def test_kvlm_serve_answers_concurrent_chats(qwen35_dir):
    """A real `kvlm serve` of the tiny Qwen3.5 (its pool: a slot of DeltaNet state a
    sequence): two chat requests at once, batched (fewer steps than tokens), each answered
    as the LLM answers it alone; a conversation's second turn hits at its first turn's
    start (the server tells the engine where the reply began: its template renders a past
    reply without the think block its prompt opened); /v1/kv and /metrics show the state
    group and the snapshots it keeps at block ends."""
    from serving import (
        QUESTIONS,
        chats_alone,
        chats_at_once,
        get,
        kvlm_serve,
        openai_client,
        wait_idle,
    )

    llm = LLM(model=qwen35_dir("qwen35-think-off"), kv="paged", progress=False)
    want = chats_alone(llm, QUESTIONS, 32)
    messages, _, turn, _ = think_off_conversation(llm)
    key = "sekret"
    with kvlm_serve("--model", str(llm.loaded.path), "--threads", "1", "--api-key", key,
                    "--max-context", "256") as (port, _):  # fmt: skip
        got = chats_at_once(port, key, QUESTIONS, 32)
        client = openai_client(port, key)
        model, cached = client.models.list().data[0].id, []
        for turn_messages in (messages[:1], messages):
            reply = client.chat.completions.create(model=model, messages=turn_messages,
                                                   max_tokens=4, temperature=0)  # fmt: skip
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        m = wait_idle(port, key)
        status, text = get(port, "/v1/kv", {"Authorization": f"Bearer {key}"})
    assert got == want
    assert cached == [0, turn // 16 * 16], (cached, turn)
    assert m["kvlm_engine_steps_total"] < m["kvlm_generation_tokens_total"]  # rows together
    assert m['kvlm_kv_group_blocks_total{group="1",window="none",layers="2"}'] == 16  # slots
    assert m['kvlm_kv_group_blocks_used{group="1",window="none",layers="2"}'] == 0
    assert m['kvlm_kv_group_end_states{group="1",window="none",layers="2"}'] > 0  # snapshots
    assert status == 200
    groups = json.loads(text)["groups"]
    assert [(g["kind"], g["layers"]) for g in groups] == [("attention", [1, 3]), ("state", [0, 2])]
    assert groups[1]["block_bytes"] == llm.cache_spec().layer_kinds[0].sequence_bytes(
        llm.cache_spec()) * 2  # two DeltaNet layers' state a slot  # fmt: skip


def test_the_sdks_five_turns_with_tools_on_a_gguf_are_cached_and_as_fresh(converted):
    """The anthropic SDK (Messages: the conversation resent each turn) and the openai SDK
    (Responses: each turn on the last by previous_response_id) through five turns with a
    tool (a forced call, its result, three more) on the tiny hybrid as llama.cpp's
    converter writes it, against two real `kvlm serve`s of it: every turn's reply is the
    one a server without the prefix cache gives, and from the second turn on the usage
    reports cached prompt tokens (Anthropic's cache_read_input_tokens, Responses'
    input_tokens_details.cached_tokens), none on the cacheless one: the conversation is
    not prefilled again."""
    import anthropic
    import openai

    from serving import kvlm_serve

    _, path = converted("qwen35-tools")
    key = "sekret"
    args = ("--model", str(path), "--max-context", "2048", "--threads", "1", "--api-key", key)
    tool = {"type": "function", "name": "weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}  # fmt: skip
    with kvlm_serve(*args) as (port, _), kvlm_serve(*args, "--no-prefix-caching") as (cold, _):
        base = [f"http://127.0.0.1:{p}" for p in (port, cold)]
        claude = [anthropic.Anthropic(base_url=b, api_key=key, max_retries=0) for b in base]
        oai = [openai.OpenAI(base_url=b + "/v1", api_key=key, max_retries=0) for b in base]
        model = oai[0].models.list().data[0].id
        # Messages: the conversation as the client keeps it, sent to both
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        cached: list[list[int]] = [[], []]
        for turn in range(5):
            kw = dict(model=model, messages=messages, tools=[WEATHER], max_tokens=16,
                      extra_body={"temperature": 0})  # fmt: skip
            if turn == 0:
                kw.update(tool_choice={"type": "tool", "name": "weather"}, max_tokens=80)
            replies = [c.messages.create(**kw) for c in claude]
            said = [[b.model_dump(exclude={"id"}) for b in r.content] for r in replies]
            assert said[0] == said[1], turn  # (a call's id is new each time)
            for i, r in enumerate(replies):
                cached[i].append(r.usage.cache_read_input_tokens or 0)
            blocks = [b.model_dump(exclude_none=True) for b in replies[0].content]
            messages = [*messages, {"role": "assistant", "content": blocks}]
            if turn == 0:
                call = replies[0].content[-1]
                assert call.type == "tool_use"
                messages.append(
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": call.id,
                                "content": "Sunny, 21 C",
                            }
                        ],
                    }
                )
            else:
                messages.append({"role": "user", "content": f"And then ({turn})?"})
        # each turn reads more of the conversation from the cache than the one before (on
        # the 2 cores of the writing: 560, 736, 784, 816 of the Messages turns)
        assert cached[0][1] > 0 and all(a < b for a, b in pairwise(cached[0][1:])), cached
        assert not any(cached[1]), cached
        # Responses: each server's own chain of stored responses
        outputs, used = [[], []], [[], []]
        for i, client in enumerate(oai):
            previous, given = None, "Weather in Paris?"
            for turn in range(5):
                kw = dict(model=model, input=given, tools=[tool], temperature=0,
                          max_output_tokens=16, previous_response_id=previous)  # fmt: skip
                if turn == 0:
                    kw.update(tool_choice={"type": "function", "name": "weather"},
                              max_output_tokens=80)  # fmt: skip
                r = client.responses.create(**kw)
                outputs[i].append([(o.type, getattr(o, "arguments", None), getattr(o, "content",
                                   None) and o.content[0].text) for o in r.output])  # fmt: skip
                used[i].append(r.usage.input_tokens_details.cached_tokens)
                previous = r.id
                if turn == 0:
                    call = r.output[-1]
                    assert call.type == "function_call"
                    given = [{"type": "function_call_output", "call_id": call.call_id,
                              "output": "Sunny, 21 C"}]  # fmt: skip
                else:
                    given = f"And then ({turn})?"
        assert outputs[0] == outputs[1]
        assert used[0][1] > 0 and all(a < b for a, b in pairwise(used[0][1:])), used
        assert not any(used[1]), used


def mtp_logits_hf(folder, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The MTP head's logits at positions 0 .. T - 2 (of the token after next), built of
    transformers' own modules in `dtype` (it does not run the head: Qwen3_5DecoderLayer
    of the full-attention kind, Qwen3_5RMSNorm, a Linear fc; vLLM's composition): the
    model's final-normed states and the next tokens' embeddings, normed, joined
    (embedding first), fc, the block causal over the head's positions, the norm, lm_head."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    c, w = hf.config, load_file(folder / "model.safetensors")
    head = {k.removeprefix("mtp."): v.to(dtype) for k, v in w.items() if k.startswith("mtp.")}
    block = m.Qwen3_5DecoderLayer(c, c.layer_types.index(A)).to(dtype).eval()
    block.load_state_dict({k.removeprefix("layers.0."): v for k, v in head.items()
                           if k.startswith("layers.0.")})  # fmt: skip

    def norm(name):
        n = m.Qwen3_5RMSNorm(c.hidden_size, eps=c.rms_norm_eps).to(dtype).eval()
        n.load_state_dict({"weight": head[f"{name}.weight"]})
        return n

    t = torch.tensor([ids])
    n = len(ids) - 1
    with torch.no_grad():
        h = hf(t, output_hidden_states=True).hidden_states[-1][:, :n]  # after the final norm
        e = hf.model.embed_tokens(t[:, 1:])
        u = torch.cat([norm("pre_fc_norm_embedding")(e), norm("pre_fc_norm_hidden")(h)], -1)
        u = u @ head["fc.weight"].t()
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf"), dtype=dtype).triu(1)[None, None]
        u = block(u, attention_mask=mask, position_ids=pos,
                  position_embeddings=hf.model.rotary_emb(u, pos))  # fmt: skip
        u = u[0] if isinstance(u, tuple) else u
        return hf.lm_head(norm("norm")(u))[0]


def mtp_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """kvlm's MTP head over the same positions: the model's states (`hidden=True`), then
    the head on a cache of its own (kvlm.model.mtp.head_spec)."""
    from kvlm.cache import create_cache
    from kvlm.model.mtp import head_spec

    t = torch.tensor([ids])
    with torch.inference_mode():
        cache = llm.new_cache("contiguous")
        step = cache.begin(len(ids))
        _, hidden = llm.model(t, step.positions, step, last_only=False, hidden=True)
        n = len(ids) - 1
        head = create_cache("contiguous", head_spec(llm.config, 64, llm.model.dtype))
        hs = head.begin(n)
        logits, _ = llm.model.mtp_forward(
            t[:, 1:], hs.positions, hidden[:, :n].contiguous(), hs, last_only=False
        )
        head.commit(hs)
    return logits[0]


def test_the_mtp_head_is_transformers_blocks_on_the_models_states(qwen35_dir, tmp_path):
    """A folder with a multi-token-prediction head (`mtp.*`, as Qwen3.5's checkpoints): the
    head's logits over 20 positions as close to the exact result (the same modules in
    fp64) as transformers' modules' own fp32 ones, on the exact path; the head's greedy
    picks equal."""
    folder = with_mtp(qwen35_dir("qwen35"), tmp_path / "mtp")
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    assert llm.config.mtp_layers == 1 and llm.model.mtp is not None
    ids = prompt_ids(llm, 20)
    ours, ref = mtp_logits(llm, ids), mtp_logits_hf(folder, ids, torch.float32)
    exact = mtp_logits_hf(folder, ids, torch.float64)
    assert_as_exact_as(ours, ref, exact)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_the_mtp_head_of_a_converted_file_is_the_folders(converted):
    """The converter's blocks after the model's (`blk.N.nextn.*` and the block's own)
    read as the folder's head: the same logits bit for bit (f32)."""
    folder, path = converted("qwen35")
    from_gguf, from_hf = gguf_as_folder(path, folder)
    assert from_gguf.model.mtp is not None
    ids = prompt_ids(from_hf, 12)
    assert torch.equal(mtp_logits(from_gguf, ids), mtp_logits(from_hf, ids))


def _edit_head(folder, dest, drop=(), shapes=None, config=None):
    """A copy of `folder` (with a head) less the tensors `drop`, with `shapes` replaced by
    zeros of another shape, and the config's keys `config` set."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    w = load_file(dest / "model.safetensors")
    w = {k: v for k, v in w.items() if k not in drop}
    w |= {k: torch.zeros(shape) for k, shape in (shapes or {}).items()}
    save_file(w, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return dest


def test_a_head_the_config_names_but_the_save_left_out_runs_without(qwen35_dir, tmp_path):
    """transformers saves a Qwen3.5 without its `mtp.*` (it leaves them unread) and keeps
    `mtp_num_hidden_layers` in config.json: the model runs, headless; a head left half
    (its norm gone) or of another shape (fc [H, H]) is one clear ModelLoadError."""
    from kvlm.errors import ModelLoadError

    base = qwen35_dir("qwen35")
    headless = _edit_head(base, tmp_path / "headless", config={"mtp_num_hidden_layers": 1})
    llm = LLM(model=headless, kv="off", progress=False)
    assert llm.config.mtp_layers == 1 and llm.model.mtp is None
    full = with_mtp(base, tmp_path / "mtp")
    half = _edit_head(full, tmp_path / "half", drop=("mtp.norm.weight",))
    with pytest.raises(ModelLoadError, match=r"no tensor mtp\.norm\.weight"):
        LLM(model=half, kv="off", progress=False)
    h = llm.config.hidden_size
    wrong = _edit_head(full, tmp_path / "wrong", shapes={"mtp.fc.weight": (h, h)})
    with pytest.raises(ModelLoadError, match=rf"mtp\.fc\.weight has shape \({h}, {h}\)"):
        LLM(model=wrong, kv="off", progress=False)


def _head_drafts(llm: LLM, tokens: list[int], k: int, first: int = 0) -> list[int]:
    """The MTP head's k greedy drafts after `tokens` computed from nothing: the model over
    tokens[:-1] (its states, `hidden=True`), the head over every position from `first` at
    once on a fresh cache (each at its own position), then k - 1 steps on its own states:
    the oracle MtpDrafter's incremental head (recorded states, kept K/V, rolled-back
    drafts) is held to."""
    from kvlm.cache import create_cache
    from kvlm.model.mtp import head_spec

    n, model = len(tokens) - 1, llm.model
    t = torch.tensor([tokens])
    with torch.inference_mode():
        cache = llm.new_cache("contiguous")
        step = cache.begin(n)
        _, hidden = model(t[:, :n], step.positions, step, last_only=False, hidden=True)
        head = create_cache("contiguous", head_spec(llm.config, 128, model.dtype))
        hs = head.begin(n - first)
        positions = torch.arange(first, n)[None]
        logits, normed = model.mtp_forward(t[:, first + 1 :], positions, hidden[:, first:], hs)
        head.commit(hs)
        drafts = [int(logits[0, -1].argmax())]
        for j in range(1, k):
            hs = head.begin(1)
            logits, normed = model.mtp_forward(torch.tensor([drafts[-1:]]),
                                               torch.tensor([[n - 1 + j]]), normed[:, -1:],
                                               hs, j)  # fmt: skip
            head.commit(hs)
            drafts.append(int(logits[0, -1].argmax()))
    return drafts


@pytest.mark.parametrize("engine_kind", ["cache", "pool"])
def test_the_mtp_head_drafts_and_greedy_output_is_plain(qwen35_dir, tmp_path, engine_kind):
    """--speculative mtp: the file's head proposes from the states the engine's steps
    leave (prompt chunks, then each step's kept decode and draft rows); in fp64 every
    proposal (k = 3: one from the model's states, two on the head's own) equals the head
    run from nothing over the sequence so far (`_head_drafts`), so the head's cache keeps
    exactly the verified positions through rejections; the tokens are plain greedy
    decoding's, on one cache and on the pool (prompt chunks of 5, two sequences). On the
    pool a prompt again is a prefix hit: its head is fed from the hit's end on (positions
    this process never computed have no state to feed), the oracle's too."""
    from kvlm.engine.speculative import MtpDrafter, SpeculativeConfig

    folder = with_mtp(qwen35_dir("qwen35"), tmp_path / "mtp")
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    how = SpeculativeConfig("mtp", num_draft=3)
    kv = "contiguous" if engine_kind == "cache" else "paged"
    plain = LLM(model=folder, kv=kv, dtype="fp64", progress=False)
    spec = LLM(model=folder, kv=kv, dtype="fp64", speculative=how, progress=False)
    prompts = [PROMPT, "One two three, one two three, one two"]
    calls = []
    propose = MtpDrafter.propose

    def watched(self, seq, k):
        draft = propose(self, seq, k)
        calls.append((list(seq.token_ids), k, draft, self.heads[seq.seq_id].offset))
        return draft

    MtpDrafter.propose = watched
    try:
        if engine_kind == "cache":
            want = [answer(plain.cache_engine(), plain.tokenizer.encode(p), greedy)[0]
                    for p in prompts]  # fmt: skip
            engine = spec.cache_engine()
            got = [answer(engine, spec.tokenizer.encode(p), greedy)[0] for p in prompts]
        else:
            want = [w[0] for w in on_pool(plain, prompts, greedy)[0]]
            out, engine = on_pool(spec, prompts, greedy, scheduler={"prefill_chunk": 5},
                                  speculative=how)  # fmt: skip
            got = [o[0] for o in out]
    finally:
        MtpDrafter.propose = propose
    assert got == want
    st = engine.stats.spec
    assert st.drafted > 0 and len(calls) > 4, st
    for tokens, k, draft, first in calls:
        assert draft == _head_drafts(spec, tokens, k, first)[: len(draft)], len(tokens)
    if engine_kind == "pool":  # the first prompt again, after it: a prefix hit
        calls.clear()
        MtpDrafter.propose = watched
        try:
            long = [" ".join([PROMPT] * 4)] * 2  # blocks of 16 to hit
            again, engine = on_pool(spec, long, greedy, speculative=how, num_blocks=48,
                                    scheduler={"max_num_seqs": 1})  # fmt: skip
        finally:
            MtpDrafter.propose = propose
        alone = on_pool(plain, long[:1], greedy)[0][0]
        assert [o[0] for o in again] == alone * 2 and engine.manager.stats.hits > 0
        # the second's head starts where its states do (the hit's end): never fed before
        assert {first for *_, first in calls} - {0}, calls
        for tokens, k, draft, first in calls:
            assert draft == _head_drafts(spec, tokens, k, first)[: len(draft)], len(tokens)


def test_speculative_mtp_on_a_model_without_a_head_is_refused(qwen35_dir):
    from kvlm.engine.speculative import SpeculativeConfig
    from kvlm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="no multi-token-prediction head"):
        LLM(model=qwen35_dir("qwen35"), progress=False, speculative="mtp")
    llm = LLM(model=qwen35_dir("qwen35"), progress=False)  # an engine asked for it: the same
    with pytest.raises(InvalidRequestError, match="no multi-token-prediction head"):
        fresh_engine(llm, speculative=SpeculativeConfig("mtp"))


def test_memory_counts_a_gguf_files_weights_as_held(converted, capsys):
    """`kvlm memory` of a Q8_0 file: the weights as `kvlm generate` holds them (--weights
    native, the default for such a file on the CPU): the file's low-bit tensors at their
    bytes in the file (gguf-py's reader's count) and its float ones in fp32, not every
    parameter dense; the budget is the RAM less that."""
    import json

    import gguf

    from kvlm.cache.memory import weight_bytes
    from kvlm.cli import main

    path = converted("qwen35", "q8_0")[1]
    assert main(["memory", "--model", str(path), "--kv", "contiguous", "--context", "64",
                 "--json"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    quant = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
             gguf.GGMLQuantizationType.BF16}  # fmt: skip
    llm = LLM(model=path, kv="off", progress=False)
    taken = set(llm.loaded.weights.names())  # the tensors the model reads (not the MTP's)
    want = 0
    for t in gguf.GGUFReader(path).tensors:
        name = llm.loaded.weights.family.from_gguf_name(t.name, llm.config.num_layers)
        if name in taken:
            want += int(t.n_elements) * 4 if t.tensor_type in quant else int(t.n_bytes)
    assert record["weight_bytes"] == want < weight_bytes(llm.config, torch.float32)
