"""kvlm against Hugging Face transformers on tiny random-weight models of every family."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_MODELS
from helpers import assert_greedy_agreement, hf_greedy, hf_logits, load_hf
from kvlm import LLM, SamplingParams
from numerics import assert_as_exact_as, max_error

PROMPT = "What is the capital of France? The capital of France is"


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def pair(request, tiny_model_dir):
    folder = tiny_model_dir(request.param)
    return request.param, LLM(model=folder, progress=False), load_hf(folder)


def test_config_read_from_folder(pair):
    name, llm, hf = pair
    assert llm.config.architecture == TINY_MODELS[name][0]
    assert llm.config.num_layers == hf.config.num_hidden_layers
    # the config's own values (a config of layers of their own geometry refuses the
    # attributes: each layer's are checked by its family's tests)
    c = hf.config.to_dict()
    assert llm.config.num_kv_heads == c["num_key_value_heads"]
    assert llm.config.head_dim == (
        c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    )
    assert llm.config.tie_word_embeddings == c["tie_word_embeddings"]


def test_teacher_forced_logits_match_hf(pair, tiny_model_dir):
    """Every position's logits, one forward over 40 tokens: as close to the exact result
    (HF in fp64) as HF's own fp32 logits are."""
    name, llm, hf = pair
    ids = llm.tokenizer.encode(PROMPT * 4)[:40]
    assert len(ids) == 40
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape
    assert_as_exact_as(ours, ref, hf_logits(tiny_model_dir(name), ids, torch.float64))


@pytest.mark.parametrize("kv", ["contiguous", "basic", "off"])
def test_greedy_32_tokens_match_hf_generate(pair, kv):
    _, llm, hf = pair
    ids = llm.tokenizer.encode(PROMPT)
    ref_ids, ref_logits = hf_greedy(hf, ids, 32)
    llm.cache = llm.new_cache(kv)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    tops = [list(lp.top) for lp in out.logprobs]
    assert len(out.token_ids) == 32
    assert_greedy_agreement(out.token_ids, tops, ref_ids, ref_logits)


def test_sliding_window_is_applied(tiny_model_dir):
    """Mistral's window of 8 matters on a 40-token prompt: kvlm follows HF, and the
    logits differ from the same weights without a window (so the test can fail)."""
    folder = tiny_model_dir("mistral-window")
    llm, hf = LLM(model=folder, progress=False), load_hf(folder)
    ids = llm.tokenizer.encode(PROMPT * 4)[:40]
    assert len(ids) == 40
    ours = llm.runner.logits(ids, llm.new_cache("contiguous"))
    ref, exact = hf_logits(hf, ids), hf_logits(folder, ids, torch.float64)
    assert_as_exact_as(ours, ref, exact)
    assert llm.cache.spec.sliding_window == 8  # the spec carries the window into every mask
    from dataclasses import replace

    from kvlm.cache import create_cache

    unwindowed = create_cache("off", replace(llm.cache.spec, sliding_window=None))
    far = max_error(llm.runner.logits(ids, unwindowed), exact)
    assert far > 1000 * max_error(ref, exact)  # not rounding: a different function


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_matches_hf_at_the_same_dtype(tiny_model_dir, dtype):
    """kvlm in bf16/fp16 (oneDNN-packed or F.linear weights) against HF in the same dtype."""
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    folder = tiny_model_dir("llama")
    llm = LLM(model=folder, dtype=dtype, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()
    ids = llm.tokenizer.encode(PROMPT)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    ref = hf_logits(hf, ids).float()
    # both round to the same dtype at the same places (weights, activations): as far from
    # the exact result as each other
    assert_as_exact_as(ours, ref, hf_logits(folder, ids, torch.float64))
    ref_ids, ref_logits = hf_greedy(hf, ids, 16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert_greedy_agreement(
        out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids, ref_logits
    )
