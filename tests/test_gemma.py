"""Gemma 3 (text) and Gemma 2: a GGUF file written as llama.cpp's converter writes one,
against HF transformers on the same weights; its SentencePiece vocabulary against
transformers' tokenizer for the same file; the local layers' window really applied; the
hybrid cache's ring. (The tiny models of conftest.TINY_MODELS meet transformers in
tests/test_hf_reference.py, and every cache mode and feature in tests/test_composition.py.)"""

from __future__ import annotations

import pytest
import torch

from helpers import (
    GEMMA_TEMPLATE,
    hf_greedy,
    load_hf,
    save_tiny_model,
    sentencepiece_vocab,
    write_gguf_from_hf,
)
from kvlm import LLM
from numerics import assert_as_exact_as, max_error

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,   runs of   spaces\n\n\tand\ttabs  ",
    "東京は日本の首都です。",
    "Привет, мир!",
    "emoji 🙂 and ünïcödé outside the vocabulary: ß∂ƒ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "def add(a, b):\n    return a + b\n",
    "",
]


def assert_logits_as_hf(llm: LLM, folder) -> None:
    """Teacher-forced logits over 41 tokens (past the window) as close to the exact ones
    (transformers in fp64 on the HF folder) as transformers' own fp32 logits are."""
    from helpers import hf_logits

    ids = [2, *range(300, 340)]
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    assert_as_exact_as(ours, hf_logits(load_hf(folder), ids), hf_logits(folder, ids, torch.float64))


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A tiny Gemma 3 as HF writes it (six layers: the sixth global, as llama.cpp reads
    every Gemma 3 file; a window of 8) and the same as a GGUF file."""
    vocab = len(sentencepiece_vocab()[0])
    folder = save_tiny_model(
        tmp_path_factory.mktemp("gemma3"), "gemma3", seed=11, vocab_size=vocab,
        num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=32,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
    )  # fmt: skip
    path = write_gguf_from_hf(folder, folder / "gemma3.gguf", arch="gemma3")
    return folder, path


def test_gguf_reads_gemma3_as_hf_does(gguf_pair):
    folder, path = gguf_pair
    llm = LLM(model=path, progress=False)
    c = llm.config
    assert c.architecture == "gemma3" and c.hybrid
    assert c.layer_windows == (8, 8, 8, 8, 8, None)
    assert (c.rope_theta, c.rope_local_theta, c.tie_word_embeddings) == (1e6, 1e4, True)
    assert_logits_as_hf(llm, folder)


def test_both_formats_give_the_norms_folded_as_llama_cpp_stores_them(gguf_pair):
    """The family folds its quirk into the weights at load (kvlm.arch.gemma.fold_hf): the
    HF folder's norms come as 1 + w, as the GGUF file stores them, under the model's
    names in both (Hugging Face's `pre_feedforward_layernorm` is the MLP's input norm,
    llama.cpp's `ffn_norm`), so the model reads either without knowing the family."""
    from safetensors import safe_open

    from kvlm.loading.gguf import GGUFWeights
    from kvlm.loading.hf import SafetensorsWeights

    folder, path = gguf_pair
    hf, gguf = SafetensorsWeights(folder), GGUFWeights(path)
    assert set(hf.names()) == set(gguf.names())
    stored = safe_open(str(next(folder.glob("*.safetensors"))), framework="pt")
    roles = {"input_layernorm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "post_attention_layernorm": "pre_feedforward_layernorm",
             "mlp_out_norm": "post_feedforward_layernorm",
             "self_attn.q_norm": "self_attn.q_norm"}  # fmt: skip
    for ours, theirs in roles.items():
        w = stored.get_tensor(f"model.layers.1.{theirs}.weight")
        name = f"model.layers.1.{ours}.weight"
        assert torch.equal(hf.get(name), 1.0 + w.float())
        assert torch.equal(gguf.get(name), hf.get(name))


def test_the_local_window_is_applied(gguf_pair):
    """Five layers of six see 8 tokens back: without that the logits are another
    function's (so the comparisons above can fail)."""
    folder, _ = gguf_pair
    llm = LLM(model=folder, progress=False)
    ids = [2, *range(300, 340)]
    exact = LLM(model=folder, progress=False, dtype="fp64").runner.logits(ids, llm.new_cache("off"))
    ours = llm.runner.logits(ids, llm.new_cache("contiguous"))
    from dataclasses import replace

    from kvlm.cache import create_cache

    spec = replace(llm.new_cache("off").spec, layer_kinds=())
    far = max_error(llm.runner.logits(ids, create_cache("off", spec)), exact)
    assert far > 1000 * max(max_error(ours, exact), 1e-30)


def test_sentencepiece_ids_equal_transformers(gguf_pair):
    from transformers import AutoTokenizer

    folder, path = gguf_pair
    ours = LLM(model=path, progress=False).tokenizer
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(
            ref.encode(text), skip_special_tokens=True
        )
    byte = sentencepiece_vocab()[0].index("<0xF0>")
    assert byte in ours.encode("🙂")  # byte fallback


def test_chat_template_from_the_file(gguf_pair):
    _, path = gguf_pair
    tok = LLM(model=path, progress=False).tokenizer
    assert tok.chat_template == GEMMA_TEMPLATE
    text = tok.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[:2] == [2, tok.token_to_id("<start_of_turn>")]


def test_greedy_from_gguf_follows_hf(gguf_pair):
    folder, path = gguf_pair
    llm = LLM(model=path, progress=False)
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    ref_ids, _ = hf_greedy(load_hf(folder), ids, 24)
    from kvlm import SamplingParams

    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))[0]  # fmt: skip
    assert out.outputs[0].token_ids == ref_ids


def test_windowed_layers_keep_only_their_window(tiny_model_dir, tmp_path):
    """The contiguous cache of a hybrid model holds its windowed layers in a ring of W +
    RING_SLACK slots, however long the context: 190 tokens in, the same bytes as at 1; and
    a file of it reads back (kvlm inspect --cache) naming both groups."""
    from kvlm.cache.files import save_cache
    from kvlm.cache.hybrid import HybridCache
    from kvlm.cache.kinds import RING_SLACK
    from kvlm.cache.saved import SavedCache

    llm = LLM(model=tiny_model_dir("gemma3"), progress=False, max_context=256)
    cache = llm.new_cache("contiguous")
    assert isinstance(cache, HybridCache) and cache.mode == "contiguous"
    assert cache.parts[1].store.values.shape[4] == 8 + RING_SLACK  # 3 layers: a ring each
    assert cache.parts[0].store.values.shape[:1] == (1,)  # 1 layer sees everything
    before = cache.nbytes
    llm.runner.forward(list(range(10, 200)), cache)
    assert cache.nbytes == before and cache.num_tokens == 190
    save_cache(cache, tmp_path / "c.kv", llm.fingerprint)
    info = SavedCache.read(tmp_path / "c.kv").summary()
    assert info["layer_groups"] == [
        {"kind": "attention", "layers": [2], "window": None},
        {"kind": "window", "layers": [0, 1, 3], "window": 8},
    ]
    per_layer = cache.spec.bytes_per_token // 4  # one layer's K and V of one token
    assert info["restored_bytes"] == (190 + 3 * (8 + RING_SLACK)) * per_layer


def test_a_gemma3_1b_shape_plans_a_fifth_of_the_bytes_at_32k():
    """Gemma 3 1B (26 layers, every sixth global, a window of 512; fp16 K/V): the K/V a
    contiguous cache, or a paged one, plans for 32k tokens is at most 0.25x of every layer
    kept whole."""
    from dataclasses import replace

    from kvlm.arch import config_from_hf
    from kvlm.cache import CacheSpec
    from kvlm.cache.factory import planned_nbytes

    config = config_from_hf({
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
    })  # fmt: skip
    assert config.layer_windows.count(None) == 4
    spec = CacheSpec.for_model(config, 32768, torch.float16)
    hybrid = planned_nbytes("contiguous", spec, 32768, 1)
    whole = planned_nbytes("contiguous", replace(spec, layer_kinds=()), 32768, 1)
    assert whole == 32768 * 26 * 2 * 256 * 2
    assert hybrid <= 0.25 * whole
    from kvlm.cache.memory import plan

    groups = plan(config, "contiguous", 32768, 1, torch.float16, budget=0).layer_groups
    assert [(g["kind"], g["layers"], g["window"], g["tokens"]) for g in groups] == [
        ("attention", 4, None, 32768), ("window", 22, 512, 512 + 32)]  # fmt: skip
    assert sum(g["bytes"] for g in groups) == hybrid
    # the paged pool's windowed group: at most ceil((W + RING_SLACK) / 16) + 1 blocks
    paged = plan(config, "paged", 32768, 1, torch.float16, budget=0)
    assert [(g["layers"], g["window"], g["tokens"]) for g in paged.layer_groups] == [
        (4, None, 32768), (22, 512, (34 + 1) * 16)]  # fmt: skip
    whole = planned_nbytes("paged", replace(spec, layer_kinds=()), 32768, 1)
    assert paged.total_bytes <= 0.25 * whole


def test_gguf_reads_gemma2_as_hf_does(tiny_model_dir, tmp_path):
    """Gemma 2 from GGUF: every second layer windowed, the scores and the logits
    soft-capped (the keys llama.cpp's converter writes), the score scale as llama.cpp
    reads it (head_dim's, below 27B)."""
    vocab = len(sentencepiece_vocab()[0])
    folder = save_tiny_model(tmp_path / "g2", "gemma2", seed=12, vocab_size=vocab,
                             query_pre_attn_scalar=32)  # fmt: skip
    path = write_gguf_from_hf(folder, tmp_path / "g2.gguf", arch="gemma2")
    llm = LLM(model=path, progress=False)
    c = llm.config
    assert (c.layer_windows, c.attn_softcap, c.final_softcap) == ((8, None), 5.0, 30.0)
    assert_logits_as_hf(llm, folder)


def test_a_hostile_window_pattern_is_refused(tmp_path):
    from kvlm.arch import config_from_gguf
    from kvlm.errors import ModelLoadError, UnsupportedModelError

    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 64,
            "gemma3.attention.head_count": 4, "gemma3.feed_forward_length": 128,
            "gemma3.block_count": 4, "gemma3.attention.sliding_window": 8,
            "gemma3.attention.sliding_window_pattern": 0, "gemma3.vocab_size": 10}  # fmt: skip
    with pytest.raises(ModelLoadError, match="sliding_window_pattern is 0"):
        config_from_gguf(meta)
    meta["gemma3.attention.sliding_window_pattern"] = [True, False]  # 2 flags, 4 layers
    with pytest.raises(UnsupportedModelError, match="layer types for 4 layers"):
        config_from_gguf(meta)
    meta["gemma3.attention.sliding_window_pattern"] = 2
    for cap in (0.0, -30.0, float("inf"), float("nan")):  # cap * tanh(x / cap)
        meta["gemma3.final_logit_softcapping"] = cap
        with pytest.raises(ModelLoadError, match=r"final_logit_softcapping is .*; expected a "
                           r"finite number above 0"):  # fmt: skip
            config_from_gguf(meta)
    del meta["gemma3.final_logit_softcapping"]
    meta["gemma3.attention.key_length"] = -32  # the score scale head_dim ** -0.5
    with pytest.raises(ModelLoadError, match="key_length is -32; expected an integer at least 2"):
        config_from_gguf(meta)


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_gemma2_composes(tiny_model_dir, mode, tmp_path):
    """Gemma 2's soft-capped attention (scores made whole, not SDPA's) through the grid's
    own checks (tests/test_composition.py): batched = alone, chunked = one shot,
    speculative = plain, rollback."""
    from test_composition import batching, chunked_prefill, rollback, speculative

    for check in (batching, chunked_prefill, speculative, rollback):
        check(tiny_model_dir("gemma2"), mode, None, tmp_path)


def test_a_multimodal_gemma3_folder_runs_its_text_model(tmp_path):
    """Gemma 3 4B and up come as Gemma3ForConditionalGeneration (a vision tower beside the
    language model, `text_config`, weights under `language_model.`): kvlm runs the language
    model, as transformers' forward over text alone does."""
    import shutil

    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from helpers import tiny_config

    text = tiny_config("gemma3", 320)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                       image_token_index=300, boi_token_index=301, eoi_token_index=302)  # fmt: skip
    torch.manual_seed(13)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    donor = save_tiny_model(tmp_path / "donor", "llama")  # tokenizer files
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(donor / f, tmp_path / f)
    llm = LLM(model=tmp_path, progress=False)
    assert llm.config.architecture == "gemma3" and llm.config.layer_windows == (8, 8, None, 8)
    ids = [0, *range(10, 50)]
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    exact = LLM(model=tmp_path, progress=False, dtype="fp64").runner.logits(
        ids, llm.new_cache("off")
    )
    assert_as_exact_as(ours, ref, exact)


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_chunks_longer_than_the_window_equal_one_shot(tiny_model_dir, mode):
    """Prefill chunks of 12 and 20 past a window of 8 (the ring stages a chunk's own K/V,
    so its early queries see what its later tokens evict) give the one-shot tokens."""
    from test_composition import make, tokens

    folder = tiny_model_dir("gemma3")
    prompt = "The quick brown fox jumps over the lazy dog and runs far away" * 2
    want = tokens(make(folder, mode, None), prompt)
    for chunk in (12, 20):
        assert tokens(make(folder, mode, None, prefill_chunk=chunk), prompt) == want


def test_a_restarted_engine_loads_a_hybrid_models_prompt_from_disk(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The pool (a block table per layer group, kvlm.cache.paged) through a disk tier:
    the second engine gets its prefix from disk, each group's blocks from their own
    records, and answers with the same tokens."""
    from test_tiers import PROMPT, engine_with, run

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the tier key's home

    llm = LLM(model=tiny_model_dir("gemma3"), progress=False, max_context=256)
    first = engine_with(llm, f"disk:{tmp_path / 'tier'}")
    want, _ = run(first, {"a": PROMPT})
    first.close()
    second = engine_with(llm, f"disk:{tmp_path / 'tier'}")
    got, cached = run(second, {"a": PROMPT})
    second.close()
    assert got == want and cached == {"a": 96}
