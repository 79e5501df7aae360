"""The composition grid (kvlm.compose): every cache variant x every feature, generated
from the code's own lists. A cell that composes gives the tokens (or logits) of the same
variant without the feature, bit for bit; a refused cell raises an error that says why;
docs/COMPOSITION.md is the grid's own table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import (
    CHATML,
    LFM2_TEMPLATE,
    assert_generation_agrees,
    save_tiny_model,
    sharpen_routers,
)
from kvlm import LLM, SamplingParams, compose
from kvlm.engine.speculative import SpeculativeConfig
from kvlm.errors import KvlmError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# past the hybrid model's window and its slack (8 + 32 tokens) and a block of 16, so its
# paged and int8 pools free windowed blocks in every cell (kvlm.cache.paged)
PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the woods and"


# the grid's models (kvlm.compose.MODELS): tiny random ones of conftest.TINY_MODELS, and
# "conv": an LFM2 (conv, attention, conv, attention) with its chat template; "state": a
# Qwen3.5 (DeltaNet, attention, DeltaNet, attention); "experts": a Qwen3-MoE (8 experts,
# the top 2, in all four layers); "latent": conftest's DeepSeek-V2 (latent attention);
# "shared": conftest's Gemma 4 (own head sizes, K = V, layers reading others' K/V)
MODEL_DIRS = {"llama": "llama", "hybrid": "gemma3", "latent": "deepseek2", "shared": "gemma4"}
SAVED = {
    "conv": dict(arch="lfm2", seed=20, chat_template=LFM2_TEMPLATE, tokenizer="llama3"),
    "state": dict(arch="qwen3_5", seed=30, chat_template=CHATML, tokenizer="qwen35"),
    "experts": dict(arch="qwen3_moe", seed=40, chat_template=CHATML, tokenizer="qwen35"),
}


@pytest.fixture(scope="module")
def grid_model_dir(tiny_model_dir, tmp_path_factory):
    made = {}

    def make(model: str):
        if model in MODEL_DIRS:
            return tiny_model_dir(MODEL_DIRS[model])
        if model not in made:
            made[model] = save_tiny_model(tmp_path_factory.mktemp(model), **SAVED[model])
            if model == "experts":
                sharpen_routers(made[model])
        return made[model]

    return make


def make(folder, mode, dtype, **kw) -> LLM:
    return LLM(model=folder, progress=False, max_context=160, kv=mode, kv_dtype=dtype, **kw)


def tokens(llm, prompt=PROMPT, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompt, params)[0].outputs]


def batching(folder, mode, dtype, tmp_path):
    llm = make(folder, mode, dtype)
    prompts = [PROMPT, "Once upon a time", "def add(a, b):"]
    together = [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, GREEDY)]
    assert together == [tokens(llm, p) for p in prompts]


def chunked_prefill(folder, mode, dtype, tmp_path):
    assert tokens(make(folder, mode, dtype, prefill_chunk=5)) == tokens(make(folder, mode, dtype))


def fan_out(folder, mode, dtype, tmp_path):
    llm = make(folder, mode, dtype)
    many = tokens(llm, params=SamplingParams(temperature=0.9, seed=4, max_tokens=16, n=3,
                                             ignore_eos=True))  # fmt: skip
    one = [tokens(llm, params=SamplingParams(temperature=0.9, seed=4 + i, max_tokens=16,
                                             ignore_eos=True))[0] for i in range(3)]  # fmt: skip
    assert many == one


def _two_turns(llm):
    session = llm.chat_session(GREEDY, use_template=True)
    list(session.send(PROMPT))
    turn = session.send("And then?")
    list(turn)
    return session, turn


def prefix_reuse(folder, mode, dtype, tmp_path):
    session, turn = _two_turns(make(folder, mode, dtype))
    fresh = make(folder, mode, dtype)
    ids = fresh.tokenizer.encode_chat(session.messages)
    whole = fresh.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0].outputs[0]
    assert turn.output.outputs[0].token_ids == whole.token_ids


def save_load(folder, mode, dtype, tmp_path):
    llm = make(folder, mode, dtype)
    session = llm.chat_session(GREEDY, use_template=True)
    list(session.send(PROMPT))
    path = tmp_path / "conversation.kv"
    session.save(path, llm.fingerprint)
    straight = session.send("And then?")
    list(straight)
    other = make(folder, mode, dtype)
    resumed = other.chat_session(GREEDY, use_template=True)
    resumed.load(path, other.fingerprint)
    again = resumed.send("And then?")
    list(again)
    assert again.output.outputs[0].token_ids == straight.output.outputs[0].token_ids


def rollback(folder, mode, dtype, tmp_path):
    llm = make(folder, mode, dtype)
    ids = llm.tokenizer.encode(PROMPT)
    a, b, c = ids[:-5], ids[-5:], [7, 8, 9]
    rolled = llm.new_cache(mode)
    llm.runner.forward(a, rolled)
    llm.runner.forward(b, rolled)
    rolled.rollback(len(b))
    fresh = llm.new_cache(mode)
    llm.runner.forward(a, fresh)
    assert torch.equal(llm.runner.forward(c, rolled), llm.runner.forward(c, fresh))


def speculative(folder, mode, dtype, tmp_path):
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = make(folder, mode, dtype, speculative=SpeculativeConfig(num_draft=4, ngram_min=1))
    plain = make(folder, mode, dtype)
    assert tokens(spec, prompt, params) == tokens(plain, prompt, params)


def fused_step(folder, mode, dtype, tmp_path):
    """Low-bit weights on the CPU: the variant's decode steps in the fused C step (what
    the runtime reports), its tokens held to the torch step's by the top-5 rule (the two
    sum in other orders); where the step does not run, the runtime's reason is the error."""
    llm = make(folder, mode, dtype, weights="int8")
    step = llm.describe()["decode_step"]
    if step != "fused":
        raise KvlmError(step)
    torch_step = make(folder, mode, dtype, weights="int8")
    torch_step.runner.fused_reason = "off: the comparison"
    assert torch_step.describe()["decode_step"] == "torch step: off: the comparison"
    assert_generation_agrees(torch_step, llm, PROMPT, 20)


RUNNERS = {
    "batching": batching, "chunked prefill": chunked_prefill, "n>1 fan-out": fan_out,
    "prefix reuse": prefix_reuse, "save/load": save_load, "rollback": rollback,
    "speculative decoding": speculative, "fused low-bit step": fused_step,
}  # fmt: skip


def test_every_feature_has_a_runner():
    assert set(RUNNERS) == set(compose.FEATURES)


@pytest.mark.parametrize("feature", list(compose.FEATURES))
@pytest.mark.parametrize(("model", "mode", "dtype"), compose.variants(),
                         ids=[compose.label(*v) for v in compose.variants()])  # fmt: skip
def test_cell(grid_model_dir, model, mode, dtype, feature, tmp_path):
    folder = grid_model_dir(model)
    why = compose.refusal(model, mode, dtype, feature)
    if why is None:
        RUNNERS[feature](folder, mode, dtype, tmp_path)
    else:
        with pytest.raises(KvlmError, match=re.escape(why)):
            RUNNERS[feature](folder, mode, dtype, tmp_path)


def test_the_docs_table_is_the_grid():
    doc = (Path(__file__).parent.parent / "docs" / "COMPOSITION.md").read_text()
    assert compose.markdown() in doc
