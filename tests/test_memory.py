"""The memory planner: its figures are what the engine allocates."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvlm.cache import CACHE_MODES, CacheSpec, create_cache
from kvlm.cache.memory import TABLE_ROWS, parse_size, plan, table, weight_bytes
from kvlm.config import ModelConfig
from kvlm.errors import InvalidRequestError
from kvlm.loading import load_model

CONFIG = ModelConfig("llama", 100, 32, 64, 3, 4, 2, 8, 1e-6, 1e4, 512, True)


@pytest.mark.parametrize("mode", list(CACHE_MODES))
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("context", "batch"), [(37, 1), (64, 3)])
def test_planned_bytes_are_allocated_bytes(mode, kv_dtype, context, batch):
    if mode == "basic" and kv_dtype == torch.int8:
        return
    p = plan(
        CONFIG, mode, context, batch, kv_dtype, budget=10**9, block_size=16, window=20, sinks=2
    )
    spec = CacheSpec.for_model(
        CONFIG, context, kv_dtype, batch=batch, block_size=16, window=20, sinks=2
    )
    cache = create_cache(mode, spec)
    step = cache.begin(context)  # every row: `context` tokens of its own (nothing shared)
    for layer in range(CONFIG.num_layers):
        step.update(layer, *(torch.randn(batch, 2, context, 8) for _ in range(2)))
    cache.commit(step)
    assert cache.nbytes == p.total_bytes
    assert p.bytes_per_sequence * batch == p.total_bytes
    assert p.sequences_in_budget == (
        10**9 // p.bytes_per_sequence if p.bytes_per_sequence else None
    )


def test_bytes_per_token_is_the_akunu_formula():
    # 2 (K, V) x layers x kv_heads x head_dim x bytes
    p = plan(CONFIG, "contiguous", 512, 1, torch.bfloat16, budget=1)
    assert p.bytes_per_token == 2 * 3 * 2 * 8 * 2
    assert p.total_bytes == 512 * p.bytes_per_token


def test_default_model_figures():
    cfg = load_model().config  # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64
    p = plan(cfg, "contiguous", 8192, 1, torch.float32, budget=2**30)
    assert p.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert p.total_bytes == 8192 * 46080
    assert p.sequences_in_budget == 2**30 // (8192 * 46080)
    assert 134e6 < weight_bytes(cfg, torch.float32) / 4 < 135e6  # 134.5M parameters


def test_table_covers_every_mode():
    assert {m for m, *_ in TABLE_ROWS} == set(CACHE_MODES)
    rows = table(CONFIG, 100, 2)
    assert {r["mode"] for r in rows} == set(CACHE_MODES)


@pytest.mark.parametrize(
    ("text", "value"),
    [("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5g", int(1.5 * 2**30)), ("2e9", 2 * 10**9)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "-1GiB", "3 parsecs"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(InvalidRequestError, match="cannot read the size"):
        parse_size(text)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3", "gemma4", "gemma4-moe"])
def test_the_parameter_count_is_the_files(tiny_model_dir, name):
    """kvlm.cache.memory.parameter_count (what `kvlm memory` and Ollama's /api/show say)
    from the shapes alone: the tensors the file holds (a Gemma layer's two output norms
    and q/k norms too)."""
    from safetensors import safe_open

    from kvlm.arch import config_from_hf
    from kvlm.cache.memory import parameter_count

    folder = tiny_model_dir(name)
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (a safe_open is not iterable)
    assert parameter_count(config) == stored


# Two real shapes' config.json as transformers writes them (the Hub's values; no weights:
# `kvlm memory` plans from a folder of config.json alone)
GEMMA4_E2B = {  # google/gemma-4-E2B-it's text model: 35 layers, 4 local to 1 global,
    # the last 20 reading the K/V of the last earlier layer of their kind
    "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536,
    "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8,
    "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "sliding_window": 512, "num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144, "use_double_wide_mlp": True,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "max_position_embeddings": 131072, "final_logit_softcapping": 30.0,
}  # fmt: skip
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite: a latent of 512 and a rotated key
    # part of 64 a token and layer, a dense first layer, then 64 experts (6 a token)
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "max_position_embeddings": 163840, "rope_theta": 10000.0,
}  # fmt: skip


def _memory(tmp_path, capsys, config: dict, *flags: str) -> tuple[dict, str]:
    """`kvlm memory` on a folder of `config` as config.json alone: its JSON and its text."""
    from kvlm.cli import main

    folder = tmp_path / config["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    args = ["memory", "--model", str(folder), "--kv-dtype", "fp16", *flags]
    assert main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    return record, capsys.readouterr().out


def test_a_gemma4_e2b_shape_keeps_under_a_fifth_of_every_layer_whole_at_32k(tmp_path, capsys):
    """`kvlm memory` at 32k on the Gemma 4 E2B shape: the 20 layers that read an earlier
    layer's K/V keep nothing, the 12 local layers of the other 15 a window of 512 (and the
    ring's slack), the 3 global ones every token at their 512-wide heads: 0.148x of a
    cache that keeps all 35 layers whole with their own K and V (the issue: <= 0.2x)."""
    record, text = _memory(tmp_path, capsys, GEMMA4_E2B, "--context", "32768")
    context, fp16 = 32768, 2
    whole = context * fp16 * 2 * (28 * 256 + 7 * 512)  # K and V, every layer, one KV head
    groups = {g["kind"]: g for g in record["layer_groups"]}
    assert (groups["attention"]["layers"], groups["window"]["layers"]) == (3, 12)
    assert groups["attention"]["tokens"] == context and groups["window"]["window"] == 512
    assert groups["attention"]["keeps"] == groups["window"]["keeps"] == "K/V"
    assert groups["attention"]["shared_by"] == [19, 24, 29, 34]  # the later global layers
    assert len(groups["window"]["shared_by"]) == 16
    assert record["bytes_per_sequence"] == sum(g["bytes"] for g in groups.values())
    assert record["bytes_per_sequence"] <= 0.2 * whole
    assert "4 more layers read their K/V and keep none" in text
    print(f"E2B at 32k: {record['bytes_per_sequence'] / whole:.3f} of every layer whole")


def test_a_deepseek_v2_lite_shape_keeps_the_latent_alone(tmp_path, capsys):
    """`kvlm memory` on the DeepSeek-V2-Lite shape: the latent's bytes exactly (27 layers
    x (512 + 64) fp16 values = 31,104 B a token, against 276,480 for its 16 heads' K
    (192 wide) and V (128) materialised), one group that says it keeps a latent."""
    record, text = _memory(tmp_path, capsys, DEEPSEEK_V2_LITE, "--context", "32768")
    assert record["bytes_per_token"] == 27 * (512 + 64) * 2 == 31104
    assert record["bytes_per_sequence"] == 32768 * 31104
    assert 27 * 16 * (192 + 128) * 2 == 276480  # what a materialised cache would keep
    [group] = record["layer_groups"]
    assert (group["keeps"], group["layers"]) == ("latent", 27)
    assert "27 attention layers (a latent and a rotated key part a token)" in text
