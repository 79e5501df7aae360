"""The defaults are the fast path (kvlm.defaults): what "auto" resolves to, and that the
fast path holds greedy decoding to the fp32 reference by the top-5 rule."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_greedy_agreement
from kvlm import LLM, SamplingParams, defaults, kernels
from kvlm.errors import InvalidRequestError

# the tests' prompts: questions a new user asks first
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "Who wrote Hamlet?",
]


def _resolve(source, exact=False, fp32_cpu=True, **settings):
    named = {"weights": "auto", "activations": "auto", "prefill_dtype": "auto", "kv_dtype": "auto"}
    named.update(settings)
    return defaults.resolve(**named, exact=exact, fp32_cpu=fp32_cpu, source=source)


class _Source:
    """A weight source whose named tensors are low-bit or not."""

    def __init__(self, quantized: dict[str, bool]) -> None:
        self.quantized = quantized

    def names(self):
        return list(self.quantized)

    def is_quantized(self, name):
        return self.quantized[name]


LOW_BIT_FILE = _Source({"model.layers.0.self_attn.q_proj.weight": True, "model.norm.weight": False})
FLOAT_FILE = _Source({"model.layers.0.self_attn.q_proj.weight": False})


def test_a_low_bit_gguf_runs_on_its_own_blocks():
    assert _resolve(LOW_BIT_FILE).weights == "native"


def test_float_files_and_folders_keep_the_compute_dtype():
    assert _resolve(FLOAT_FILE).weights is None
    assert _resolve(_Source({})).weights is None  # nothing low-bit (an HF folder)
    assert _resolve(LOW_BIT_FILE, fp32_cpu=False).weights is None  # bf16 / a GPU


def test_activations_and_prefill_follow_the_cpu(monkeypatch):
    flags = set(kernels.cpu_flags())
    lib = kernels.library()
    got = _resolve(LOW_BIT_FILE)
    vnni = lib is not None and bool(lib.kvlm_kernel_vnni())
    assert got.activations == ("int16" if vnni else "fp32")
    prefill = "bf16" if "amx_bf16" in flags else "int8" if vnni else "bf16"
    assert got.prefill_dtype == (prefill if flags & {"avx512_bf16", "amx_bf16"} or vnni else "fp32")
    # K/V in fp16 where the kernels' fused step reads it (with low-bit weights on the CPU)
    assert got.kv_dtype == ("fp16" if lib is not None else None)
    assert _resolve(LOW_BIT_FILE, fp32_cpu=False).kv_dtype is None  # a GPU: compute dtype
    # a CPU without them: fp32 both, K/V in the compute dtype
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ["sse2", "avx2"])
    monkeypatch.setattr(kernels, "library", lambda: None)  # no compiled kernels
    plain = _resolve(LOW_BIT_FILE)
    assert (plain.weights, plain.activations, plain.prefill_dtype) == ("native", "fp32", "fp32")
    assert plain.kv_dtype is None
    # float weights: nothing to round
    assert _resolve(FLOAT_FILE).activations == "fp32"
    assert _resolve(FLOAT_FILE).kv_dtype is None


@pytest.mark.parametrize(
    ("flags", "vnni", "prefill"),
    [
        (["avx512_bf16", "amx_bf16", "avx512_vnni"], 1, "bf16"),  # AMX: oneDNN's tiles
        (["avx512_bf16", "avx512_vnni"], 1, "int8"),  # Zen 4/5: VNNI at the bf16 rate
        (["avx512_vnni"], 1, "int8"),  # Cascade Lake
        (["avx512_bf16"], 0, "bf16"),
        (["avx2"], 0, "fp32"),
    ],
)
def test_the_prompt_products_rule(monkeypatch, flags, vnni, prefill):
    """Which prompt products each kind of CPU gets (the rule, whatever CPU runs the test)."""

    class Kernels:  # what resolve() asks of the compiled library
        @staticmethod
        def kvlm_kernel_vnni():
            return vnni

    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "library", lambda: Kernels)
    assert _resolve(LOW_BIT_FILE).prefill_dtype == prefill
    assert _resolve(FLOAT_FILE).prefill_dtype == "fp32"  # float weights: the dense path


@pytest.mark.parametrize(
    ("flags", "vnni", "attention"),
    [
        (["avx512_bf16", "amx_bf16", "avx512_vnni"], 1, 0),  # bf16 products: every row
        (["avx512_bf16", "avx512_vnni"], 1, defaults.LONG_ATTENTION),  # int8: the long rows
        (["avx512_vnni"], 1, None),  # int8 products, no bf16 multiplies: fp32
        (["avx512_bf16"], 0, 0),
        (["avx2"], 0, None),
    ],
)
def test_the_prompt_attention_rule(monkeypatch, flags, vnni, attention):
    """Which prompt rows attend in bf16 on each kind of CPU: every one with bf16 prompt
    products, those from LONG_ATTENTION keys with int8 ones where the CPU multiplies bf16,
    none otherwise; a named prefill dtype decides it as its auto self would."""

    class Kernels:
        @staticmethod
        def kvlm_kernel_vnni():
            return vnni

    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "library", lambda: Kernels)
    got = _resolve(LOW_BIT_FILE)
    assert got.attention_bf16_from == attention
    said = any("prompt attention" in r for r in got.reasons)
    assert said == (attention == defaults.LONG_ATTENTION)
    assert _resolve(LOW_BIT_FILE, prefill_dtype="fp32").attention_bf16_from is None
    assert _resolve(LOW_BIT_FILE, prefill_dtype="bf16").attention_bf16_from == 0
    assert _resolve(LOW_BIT_FILE, exact=True).attention_bf16_from is None
    assert _resolve(FLOAT_FILE).attention_bf16_from is None  # fp32 products


def test_named_settings_win_over_auto():
    got = _resolve(LOW_BIT_FILE, weights="int8", activations="fp32", prefill_dtype="fp32")
    assert (got.weights, got.activations, got.prefill_dtype) == ("int8", "fp32", "fp32")
    assert _resolve(LOW_BIT_FILE, kv_dtype="int8").kv_dtype == "int8"
    assert _resolve(LOW_BIT_FILE, kv_dtype="fp32").kv_dtype == "fp32"


def test_exact_is_the_reference_and_refuses_fast_settings():
    got = _resolve(LOW_BIT_FILE, exact=True)
    assert (got.weights, got.activations, got.prefill_dtype, got.kv_dtype) == (
        None,
        "fp32",
        "fp32",
        None,
    )
    with pytest.raises(InvalidRequestError, match="weights='native'"):
        _resolve(LOW_BIT_FILE, exact=True, weights="native")
    with pytest.raises(InvalidRequestError, match="activations='int8'"):
        _resolve(LOW_BIT_FILE, exact=True, activations="int8")


@pytest.fixture(scope="module")
def fast():
    return LLM(progress=False, max_context=512)


@pytest.fixture(scope="module")
def exact():
    return LLM(progress=False, max_context=512, exact=True)


@pytest.mark.slow
def test_the_default_model_runs_the_fast_path(fast):
    """No flags: the file's Q4_1 blocks, and what the CPU does fastest."""
    d = fast.describe()
    assert d["weights"] == "native"
    assert d["numerics"] and d["numerics"][0].startswith("weights native")
    # the vocabulary projection keeps fp32 activations, the blocks round theirs
    assert fast.model.lm_head.act_int8 is False
    assert fast.model.layers[0].mlp.down.act_int8 == (fast.activations == "int16")
    assert fast.model.layers[0].mlp.down.act_int16 == (fast.activations == "int16")


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_fast_path_keeps_greedy_decoding_to_the_top5_rule(fast, exact, prompt):
    """The default numerics against the fp32 reference (weights dequantized, fp32
    everywhere): every greedy token within the reference's top 5 on the same prefix."""
    n = 24
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    ids = exact.encode(prompt, chat=True)
    ours = fast.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref = exact.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    forced = exact.runner.logits(ids + ours.token_ids[:-1], exact.new_cache("off"))[-n:]
    our_top = [list(lp.top) for lp in ours.logprobs]
    assert_greedy_agreement(ours.token_ids, our_top, ref.token_ids, forced)


@pytest.mark.slow
def test_the_first_answer_is_the_reference_answer(fast, exact):
    """The README's first command: the fast path answers what the reference answers."""
    ids = exact.encode("What is the capital of Japan?", chat=True)
    params = SamplingParams(temperature=0, max_tokens=16)
    a = fast.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    b = exact.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert a.token_ids == b.token_ids
    assert a.text == "The capital of Japan is Tokyo."


def test_a_near_tie_follows_the_top5_rule(fast, exact):
    """ "What is the capital of France?" is a near tie for the default model (the
    reference's top two first tokens 0.08 apart): the reference answers "The capital of
    France is Paris.", llama.cpp (int8 activations everywhere) "L'Étoile, la Cité, ...",
    and so does the fast path on a CPU whose prompt products are int8. Whatever it
    answers, every token it picks is in the reference's top 5 on the same prefix."""
    ids = exact.encode("What is the capital of France?", chat=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = fast.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
    forced = exact.runner.logits(ids + ours[:-1], exact.new_cache("off"))[len(ids) - 1 :]
    rank = (forced > forced.gather(-1, torch.tensor(ours)[:, None])).sum(-1)
    assert int(rank.max()) < 5
    top2 = torch.topk(forced[0], 2).values
    assert float(top2[0] - top2[1]) < 0.2  # it is a near tie


@pytest.mark.slow
def test_cli_exact_and_default(default_model_path, capsys):
    """`kvlm generate`'s own main, as a shell runs it, in process."""
    from kvlm.cli import main

    def run(*flags):
        assert main(["generate", "Hi", "--max-new-tokens", "2", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    fast, ref = run(), run("--exact")
    assert fast["weights"] == "native" and ref["weights"] == "fp32"
    assert ref["activations"] == "fp32" and ref["prefill_dtype"] == "fp32"
    assert main(["generate", "Hi", "--exact", "--weights", "int8"]) != 0
    err = capsys.readouterr().err
    assert "exact" in err and "Traceback" not in err


def test_rows_take_the_numerics_of_their_role_not_of_their_count(monkeypatch):
    """A low-bit Linear: prompt rows (T > 1, or as the model says) take --prefill-dtype
    (with fp32 ones, the dense road: `prompt`), decoded rows --activations, whatever the
    number of rows in the call; the vocabulary projection's rows never the dense road."""
    from kvlm.model import quant
    from kvlm.model.layers import Linear, feeding_prompt

    torch.manual_seed(0)
    lin = Linear.from_quant(quant.quantize(torch.randn(48, 64), "q8"))
    lin.prefill_bf16, lin.act_int8 = True, True
    seen = []
    real = quant.QuantWeight.matmul
    monkeypatch.setattr(
        quant.QuantWeight,
        "matmul",
        lambda self, x, prefill_bf16=False, act_int8=False, out=None, act_int16=False,
        prompt=False: (
            seen.append((x.shape[0], prefill_bf16, act_int8, act_int16, prompt))
            or real(self, x, prefill_bf16, act_int8, out=out, act_int16=act_int16, prompt=prompt)
        ),
    )  # fmt: skip
    lin(torch.randn(1, 5, 64))  # a prompt chunk of 5
    lin(torch.randn(40, 1, 64))  # 40 decode rows
    lin(torch.randn(1, 1, 64))  # one row: a decode step by shape ...
    with feeding_prompt(True):
        lin(torch.randn(1, 1, 64))  # ... or the last token of a prompt, as the model says
    assert seen == [(5, True, False, False, True), (40, False, True, False, False),
                    (1, False, True, False, False), (1, True, False, False, True)]  # fmt: skip
    # int8 prompt products (--prefill-dtype int8): prompt rows on int8 activations too;
    # int16 activations (--activations int16) for decoded rows only
    seen.clear()
    lin.prefill_bf16, lin.prefill_int8, lin.act_int16 = False, True, True
    lin(torch.randn(1, 5, 64))
    lin(torch.randn(40, 1, 64))
    assert seen == [(5, False, True, False, True), (40, False, True, True, False)]
    # fp32 products: a block's prompt rows the dense road, the vocabulary's rows the C kernel
    seen.clear()
    lin.prefill_int8, lin.act_int8, lin.act_int16 = False, False, False
    lin(torch.randn(1, 5, 64))
    lin.vocabulary = True
    lin(torch.randn(1, 5, 64))
    assert seen == [(5, False, False, False, True), (5, False, False, False, False)]


def test_the_model_is_built_with_its_numerics(tiny_model_dir):
    """The numerics go into the Transformer as it is built, and from it into every layer it
    makes: each block's products and the prompt's attention take them, the vocabulary
    projection keeps fp32 products, and the runner reads them off the model (prompt and
    decode rows in one ragged forward only where the two round alike)."""
    from kvlm.engine.runner import ModelRunner
    from kvlm.loading import load_model
    from kvlm.model.attention import Attention
    from kvlm.model.layers import Linear
    from kvlm.model.numerics import ACTIVATIONS, PREFILL_DTYPES, ModelNumerics
    from kvlm.model.transformer import Transformer

    loaded = load_model(tiny_model_dir("llama"))
    numerics = ModelNumerics("int8", "int16", attention_bf16_from=7)
    model = Transformer(loaded.config, loaded.weights, progress=False, weight_format="int8",
                        numerics=numerics)  # fmt: skip
    assert model.numerics == numerics
    blocks = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert len(blocks) == 4 * loaded.config.num_layers  # qkv, o, gate|up, down
    assert all(m.prefill_int8 and m.act_int8 and m.act_int16 and not m.prefill_bf16
               for m in blocks)  # fmt: skip
    head = model.lm_head
    assert head.vocabulary and not (head.prefill_int8 or head.act_int8 or head.act_int16)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert [m.prompt_bf16_from for m in attns] == [7] * loaded.config.num_layers
    runner = ModelRunner(model)
    runner.one_forward = True  # as on a GPU: the numerics alone decide
    for prefill in PREFILL_DTYPES:
        for act in ACTIVATIONS:
            model.numerics = ModelNumerics(prefill, act)
            alike = prefill != "bf16" and act != "int16" and (prefill == "int8") == (act == "int8")
            assert runner.ragged_steps() == alike, (prefill, act)
    with pytest.raises(ValueError, match="activations 'int4'"):
        ModelNumerics(activations="int4")


@pytest.mark.slow
def test_the_embedding_table_stays_in_its_stored_format(fast, exact):
    """No fp32 copy of the table: the tied head's low-bit weight serves the lookups, and a
    prompt's logits are what the dequantized table gives."""
    assert fast.model._embed_table is None and fast.model._embed_quant is fast.model.lm_head.quant
    ids = torch.tensor([[1, 504, 60, 49151]])
    assert torch.equal(fast.model.embed(ids), exact.model.embed(ids))
