"""A context past the model's trained one (kvlm.config.for_context): RoPE scaled by YaRN
(or linear, or not at all) with one warning, its numbers transformers' own; and `kvlm
serve`'s default context, the trained one as far as the KV pool holds it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_greedy_agreement,
    assert_top_k_both_ways,
    fused_and_torch,
    hf_greedy,
    low_bit_llm,
    needs_kernels,
    write_gguf_from_hf,
)
from kvlm import LLM, SamplingParams
from kvlm.arch import config_from_hf
from kvlm.config import RopeScaling
from kvlm.model.layers import RotaryEmbedding, rope_inv_freq
from numerics import assert_as_exact_as
from serving import get, kvlm_serve

SRC = str(Path(__file__).parents[1] / "src")
TRAINED = 256  # every tiny model's max_position_embeddings (helpers.tiny_config)
PAST = "is past the model's trained context"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "kvlm.cli", *args], capture_output=True,
                          text=True, timeout=300, env=env, check=False)  # fmt: skip


def test_the_default_model_runs_past_its_trained_context_with_one_warning():
    """`--max-context 16384` on the default model (trained on 8,192): it runs, says so in
    one line, and RoPE is YaRN by 2 (llama.cpp's default would be unscaled)."""
    proc = _cli("generate", "Hello", "--max-context", "16384", "--max-new-tokens", "3",
                "--ignore-eos", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if PAST in line]
    assert said == [
        "--max-context 16384 is past the model's trained context of 8192 tokens: RoPE scaled "
        "by YaRN, factor 2 (--rope-scaling none: unscaled, as llama.cpp runs it)"
    ], proc.stderr
    record = json.loads(proc.stdout)
    assert record["completion_tokens"] == 3 and record["max_context"] == 16384
    assert record["rope_scaling"] == "yarn, factor 2 over 8192 tokens"


def _hf_config(params: dict):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=256, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=64, num_hidden_layers=1,
                       max_position_embeddings=TRAINED, rope_parameters=dict(params))  # fmt: skip


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}  # fmt: skip
ROPES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    "yarn": YARN,
    # DeepSeek's mscale pair, its own betas, the ramp's ends not rounded
    "yarn-mscale": {**YARN, "rope_theta": 1e6, "factor": 3.0, "beta_fast": 16, "beta_slow": 2,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    "yarn-attention-factor": {**YARN, "attention_factor": 0.8},
    # what for_context picks for 512 tokens on a model trained on 256
    "yarn-for-context": {**YARN, "factor": 2.0, "original_max_position_embeddings": TRAINED},
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROPES))
def test_cos_sin_are_transformers(name):
    """The frequencies, the attention factor and cos/sin at 0..599 (past the trained
    length) equal transformers' (ROPE_INIT_FUNCTIONS, LlamaRotaryEmbedding) bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = ROPES[name]
    hf = _hf_config(params)
    if name == "yarn-for-context":  # kvlm's own choice, from an unscaled config
        from kvlm.config import for_context

        plain = config_from_hf(_hf_config({"rope_theta": 10000.0}).to_dict())
        config, _ = for_context(plain, 2 * TRAINED)
    else:
        config = config_from_hf(hf.to_dict())
    assert config.rope_scaling.rope_type == params["rope_type"]
    inv_freq, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    assert torch.equal(rope_inv_freq(config), inv_freq)
    assert config.rope_scaling.attention_scaling == attention
    positions = torch.arange(600)[None]
    cos, sin = RotaryEmbedding(config)(positions, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, 600, 8), positions)
    assert torch.equal(cos[:, :, 0], ref_cos) and torch.equal(sin[:, :, 0], ref_sin)


def test_a_yarn_file_keeps_its_scaling_in_either_format(tiny_model_dir, tmp_path):
    """The tiny YaRN model (factor 4 over 64) read from its HF folder and from a GGUF
    written as llama.cpp's converter writes one (`rope.scaling.type` yarn, factor, original
    context): the same scaling, the context it stretches to (256), the same logits.
    (tests/test_hf_reference.py holds the folder's to transformers'.)"""
    folder = tiny_model_dir("llama-yarn")
    gguf = write_gguf_from_hf(folder, tmp_path / "yarn.gguf")
    a, b = (LLM(model=m, progress=False, max_context=TRAINED) for m in (folder, gguf))
    want = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)
    assert a.config.rope_scaling == b.config.rope_scaling == want
    assert a.config.max_position_embeddings == b.config.max_position_embeddings == TRAINED
    ids = list(range(3, 43))
    torch.testing.assert_close(a.runner.logits(ids, a.new_cache("off")),
                               b.runner.logits(ids, b.new_cache("off")))  # fmt: skip


def _hf_with(folder: Path, params: dict | None, context: int):
    """The folder's weights in transformers, with `params` as its RoPE (None: its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if params is not None:
        config.rope_parameters = dict(params)
        config.max_position_embeddings = context
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def _past_prompt(llm: LLM, n: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, llm.config.vocab_size, (n,), generator=g).tolist()


def test_a_prompt_past_the_trained_context_generates_as_transformers_with_yarn(
    tiny_model_dir, caplog
):
    """The tiny llama (trained on 256) at max_context 512: one warning, YaRN by 2 over 256;
    a 300-token prompt's logits are as close to the exact ones (fp64) as transformers'
    with that rope_scaling, and 16 greedy tokens agree with its generate."""
    folder = tiny_model_dir("llama")
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        llm = LLM(model=folder, progress=False, max_context=2 * TRAINED)
    assert [r.getMessage() for r in caplog.records if PAST in r.getMessage()] == [
        "--max-context 512 is past the model's trained context of 256 tokens: RoPE scaled by "
        "YaRN, factor 2 (--rope-scaling none: unscaled, as llama.cpp runs it)"
    ]
    params = ROPES["yarn-for-context"]
    hf = _hf_with(folder, params, 2 * TRAINED)
    ids = _past_prompt(llm)
    ours = llm.runner.logits(ids, llm.new_cache("contiguous"))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        exact = _hf_with(folder, params, 2 * TRAINED).double()(torch.tensor([ids])).logits[0]
    assert_as_exact_as(ours, ref, exact)
    ref_ids, ref_logits = hf_greedy(hf, ids, 16)
    params_ = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params_)[0]
    assert len(out.token_ids) == 16
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids,
                            ref_logits)  # fmt: skip


@pytest.mark.parametrize(
    ("scaling", "scale", "want", "said"),
    [
        ("none", None, RopeScaling(), "RoPE unscaled, at positions the model never saw"),
        ("linear", None, RopeScaling("linear", 2.0, original_max_position_embeddings=256),
         "RoPE scaled by linear interpolation, factor 2"),
        ("yarn", 1.5, RopeScaling("yarn", 1.5, original_max_position_embeddings=256),
         "RoPE scaled by YaRN, factor 1.5, which stretches it to 384 tokens"),
    ],
)  # fmt: skip
def test_the_scaling_asked_for_is_the_one_run(tiny_model_dir, caplog, scaling, scale, want, said):
    """rope_scaling / rope_scale (--rope-scaling / --rope-scale) choose what runs past the
    trained context, and the warning says which."""
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=2 * TRAINED,
                  rope_scaling=scaling, rope_scale=scale)  # fmt: skip
    assert llm.config.rope_scaling == want
    lines = [r.getMessage() for r in caplog.records if PAST in r.getMessage()]
    assert len(lines) == 1 and said in lines[0], lines
    out = llm.generate(prompt_token_ids=[_past_prompt(llm)],
                       sampling_params=SamplingParams(temperature=0, max_tokens=2))  # fmt: skip
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rope_scaling": "dynamic"}, "unknown RoPE scaling 'dynamic'; valid: none, linear, yarn"),
        ({"rope_scale": 2.0}, "a RoPE scale needs the RoPE scaling linear or yarn"),
        ({"rope_scaling": "yarn", "rope_scale": 0.5}, "the RoPE scale must be a number >= 1"),
        ({"max_context": 0}, "max_context must be between 1 and"),
    ],
)
def test_bad_rope_settings_are_one_clear_error(tiny_model_dir, settings, message):
    from kvlm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=message):
        LLM(model=tiny_model_dir("llama"), progress=False, **{"max_context": 64, **settings})


def test_a_llama3_file_is_not_rescaled(tiny_model_dir):
    """Llama 3's frequencies are what its model learned: linear or YaRN in their place is
    refused; past its context it runs them as they are (one warning)."""
    from kvlm.errors import InvalidRequestError

    folder = tiny_model_dir("llama3-rope")
    with pytest.raises(InvalidRequestError, match="scales RoPE by llama3"):
        LLM(model=folder, progress=False, max_context=64, rope_scaling="yarn")
    llm = LLM(model=folder, progress=False, max_context=2 * TRAINED)
    assert llm.config.rope_scaling.rope_type == "llama3"


@needs_kernels
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_the_fused_step_follows_the_scaling(tiny_model_dir, mode):
    """The fused decode step (int4 weights) past the trained context under YaRN: its
    logits as close to the exact ones as the torch path's, the top-k rule both ways."""
    folder = tiny_model_dir("llama")
    settings = {"model": folder, "weights": "int4", "max_context": 2 * TRAINED}
    llm = low_bit_llm(**settings)
    assert llm.config.rope_scaling.rope_type == "yarn"
    prompt = _past_prompt(llm, 250)  # decoding from 250 to 274: across the trained length
    tokens, fused, ref, _, _ = fused_and_torch(llm, prompt, 24, mode)
    exact = low_bit_llm(**settings, dtype="fp64")
    want = exact.runner.logits(prompt + tokens, exact.new_cache("off"))[len(prompt) :]
    assert_as_exact_as(fused, ref, want)
    assert_top_k_both_ways(fused, ref)


def test_serve_defaults_to_the_trained_context():
    """`kvlm serve` without --max-context: the default model's 8,192 tokens (its pool of
    1 GiB holds five such sequences at fp16 K/V), not the library's 4,096."""
    with kvlm_serve() as (port, _):
        status, body = get(port, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 8192


def test_serve_bounds_the_default_context_by_the_pool(tiny_model_dir, tmp_path):
    """A pool too small for one sequence of the trained context: the context is what it
    holds, less the block kept free at admission, in whole blocks, said in one warning."""
    gguf = write_gguf_from_hf(tiny_model_dir("llama"), tmp_path / "t.gguf")
    per_token = LLM(model=gguf, progress=False).cache_spec("paged").bytes_per_token
    blocks = 6
    memory = blocks * 16 * per_token  # bytes: six blocks of 16 tokens
    with kvlm_serve("--model", str(gguf), "--kv-memory", str(memory)) as (port, proc):
        status, body = get(port, "/v1/models")
        log = proc.stdout.read().decode()  # what it said while it started
    assert status == 200
    fits = (blocks - 1) * 16
    assert json.loads(body)["data"][0]["max_model_len"] == fits
    # the line, whatever the logging setup prefixes it with ("kvlm: ")
    said = [line.split("kvlm: ", 1)[-1] for line in log.splitlines()
            if "short of the model's trained" in line]  # fmt: skip
    assert said == [
        f"the KV pool holds one sequence of {fits} tokens, short of the model's trained "
        f"context of {TRAINED}: the context limit is {fits} (--kv-memory or --kv-blocks "
        "raise it)"
    ], log


def test_a_familys_block_fields_leave_its_fingerprints_as_they_were(tiny_model_dir):
    """A ModelConfig's block composition (activation, norm layout, embedding scale) is set
    by the family from the architecture and the sizes, which the fingerprint hashes: it is
    not hashed again, so a Gemma model's cache files and tier records saved before those
    were fields still read as the same model's."""
    import dataclasses

    from kvlm.model.weights import fingerprint_of

    config = LLM(model=tiny_model_dir("gemma3"), progress=False).config
    assert (config.activation, config.norm_layout, config.embed_scale) == (
        "gelu_tanh", "sandwich", 64**0.5)  # fmt: skip
    llama_block = dataclasses.replace(config, activation="silu", norm_layout="pre",
                                      embed_scale=None)  # fmt: skip
    assert fingerprint_of(llama_block, b"w") == fingerprint_of(config, b"w")


def test_a_config_field_a_later_kvlm_adds_leaves_old_fingerprints_alone():
    """Cache files and KV tier records carry the weights' fingerprint, which hashes the
    config: a field added at its default (this change's RoPE fields; every new family's)
    must not make every saved file read as another model's."""
    import dataclasses

    from kvlm.config import ModelConfig
    from kvlm.model.weights import fingerprint_of

    config = ModelConfig("llama", vocab_size=259, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                         tie_word_embeddings=False)  # fmt: skip
    grown = dataclasses.make_dataclass(
        "ModelConfig",
        [("new_knob", float, dataclasses.field(default=1.0))],
        bases=(ModelConfig,),
        frozen=True,
    )
    same = grown(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)})
    assert fingerprint_of(same, b"w") == fingerprint_of(config, b"w")
    other = dataclasses.replace(same, new_knob=2.0)
    assert fingerprint_of(other, b"w") != fingerprint_of(config, b"w")
    assert fingerprint_of(dataclasses.replace(config, num_layers=3), b"w") != (
        fingerprint_of(config, b"w"))  # fmt: skip
