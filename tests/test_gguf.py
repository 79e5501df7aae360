"""GGUF loading: names and permutation, every quant type, and what bad files do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from helpers import (
    PACKERS,
    load_hf,
    permute_qk,
    ref_dequant_rows,
    save_tiny_model,
    write_gguf_from_hf,
)
from kvlm import LLM
from kvlm.arch.llama import unpermute_qk
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.loading import load_model
from kvlm.loading.gguf import GGUFWeights
from numerics import U32, assert_as_exact_as

UP = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    """hidden 256: rows long enough for 256-element K-quant super-blocks."""
    return save_tiny_model(
        tmp_path_factory.mktemp("wide"),
        "llama",
        seed=7,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_qk(torch.from_numpy(permute_qk(w.numpy(), 4)), 4), w)


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_logits_match_hf(arch_name, tiny_model_dir, tmp_path):
    """An HF model written the way llama.cpp converts it (q/k permuted for llama, tied
    embeddings for qwen2) loads to the same logits as the HF original."""
    folder = tiny_model_dir(arch_name)
    path = write_gguf_from_hf(folder, tmp_path / "m.gguf", arch=arch_name)
    llm = LLM(model=path, progress=False)
    assert llm.loaded.format == "gguf"
    ids = llm.tokenizer.encode("The capital of France is Paris. " * 3)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ref = load_hf(folder)(torch.tensor([ids])).logits[0]
        exact = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
        exact = exact.eval()(torch.tensor([ids])).logits[0]
    assert_as_exact_as(ours, ref, exact)  # as close to exact as HF's own fp32 logits


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_block_quant_types_decode_exactly(qtype, llama_dir, tmp_path):
    path = write_gguf_from_hf(llama_dir, tmp_path / "m.gguf", quant=qtype)
    weights = GGUFWeights(path)
    tensor = next(t for t in weights.file.tensors if t.name == "blk.0.ffn_up.weight")
    assert tensor.tensor_type == qtype
    got = weights.get(UP)
    assert got.shape == (128, 64)  # HF layout [out, in]
    raw = np.array(tensor.data)
    if qtype == Q.F16:
        expected = raw.astype(np.float32)
    elif qtype == Q.BF16:
        expected = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        expected = ref_dequant_rows(raw, qtype.name)
    np.testing.assert_array_equal(got.float().numpy(), expected)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_decode_exactly(kind, wide_llama_dir, tmp_path):
    rng = np.random.default_rng(0)
    packed = PACKERS[kind](512, 256, rng)
    path = write_gguf_from_hf(
        wide_llama_dir,
        tmp_path / "m.gguf",
        extra_tensors={"blk.0.ffn_up.weight": (packed, Q[kind])},
    )
    got = GGUFWeights(path).get(UP)
    assert got.shape == (512, 256)
    # d * scale * q - dmin * min: each term exact in fp64, rounded at most twice in fp32
    want, size = ref_dequant_rows(packed, kind, with_size=True)
    assert (np.abs(got.double().numpy() - want) <= 4 * U32 * size).all()
    llm = LLM(model=path, progress=False)  # and the whole model runs with it
    out = llm.runner.logits(llm.tokenizer.encode("hello"), llm.new_cache("off"))
    assert torch.isfinite(out).all()


def test_quantized_model_stays_close_to_fp32(llama_dir, tmp_path):
    """Q8_0 weights: logits near the fp32 model (a whole-model sanity check)."""
    f32 = LLM(model=write_gguf_from_hf(llama_dir, tmp_path / "a.gguf"), progress=False)
    q8 = LLM(model=write_gguf_from_hf(llama_dir, tmp_path / "b.gguf", quant=Q.Q8_0), progress=False)
    ids = f32.tokenizer.encode("What is the capital of France?")
    a = f32.runner.logits(ids, f32.new_cache("off"))
    b = q8.runner.logits(ids, q8.new_cache("off"))
    for i, (x, y) in enumerate(zip(a, b, strict=True)):  # the top-k rule at every position
        assert int(x.argmax()) in torch.topk(y, 5).indices.tolist(), i
        assert int(y.argmax()) in torch.topk(x, 5).indices.tolist(), i


def test_unsupported_quant_type_is_named(llama_dir, tmp_path):
    bad = np.zeros((128, 2 * 18), np.uint8)  # two IQ4_NL blocks per 64-wide row; never decoded
    path = write_gguf_from_hf(
        llama_dir, tmp_path / "m.gguf", extra_tensors={"blk.0.ffn_up.weight": (bad, Q.IQ4_NL)}
    )
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'phi3'"):
        load_model(tmp_path / "phi.gguf")


def test_truncated_file(llama_dir, tmp_path):
    path = write_gguf_from_hf(llama_dir, tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(path)


def test_garbage_after_magic(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(path)


def test_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a GGUF file"):
        load_model(path)
    with pytest.raises(ModelLoadError, match="model not found"):
        load_model(tmp_path / "missing.gguf")


def test_the_mapped_file_is_given_back_after_loading(default_model_path):
    """LLM releases the GGUF map's pages once the model holds its own copies; the map
    stays valid (a later read faults the pages in again, the same bytes)."""
    from kvlm import LLM

    llm = LLM(progress=False, max_context=64)
    weights = llm.loaded.weights
    assert weights.release() is True
    assert weights.fingerprint() == llm.fingerprint  # read again from the file
    ids = llm.tokenizer.encode("hello")
    assert torch.isfinite(llm.runner.logits(ids, llm.new_cache("off"))).all()


def test_a_big_table_is_packed_in_pieces_each_given_back(default_model_path, monkeypatch):
    """A table read from the file's map is packed a piece at a time, each piece's file
    pages dropped once packed (the map and the packed table never both whole in memory):
    the packed bytes are those of one pass over a copy; a copy in ordinary memory is never
    madvised (MADV_DONTNEED would zero it)."""
    from kvlm.model import quant

    weights = load_model(default_model_path).weights
    name = "model.embed_tokens.weight"
    view = np.asarray(weights._tensors[name].data)
    assert quant._file_backed(view) and not quant._file_backed(np.array(view))
    released = []
    real = quant._release_pages
    monkeypatch.setattr(quant, "_release_pages", lambda a, n: released.append(n) or real(a, n))
    monkeypatch.setattr(quant, "RELEASE_PIECE", 1 << 20)
    pieces = weights.get_quant(name)
    copy = np.array(view).reshape(pieces.out_features, -1)
    expected = -(-pieces.out_features // quant._rows_per_piece(copy.shape[1]))
    assert len(released) == expected > 10  # a table of 1 MiB pieces, each given back
    whole = quant.QuantWeight.from_blocks(pieces.kind, copy)
    assert torch.equal(pieces.data, whole.data)
    assert len(released) == expected  # the copy was packed in one pass, nothing released
