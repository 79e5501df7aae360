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


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3", "gemma4"])
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
