from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

# Under pytest-xdist (`-n 3 --dist loadfile`, README) the workers share the cores, each with its own
# OpenMP teams (torch's, the kernels', a `kvlm serve` child's): OpenMP's default spin at a
# barrier then burns the core another worker needs. PASSIVE sleeps instead. Measured on
# an Intel Xeon with AMX (2 vCPUs): test_scoring_fair's scored prompt beside
# test_fused_arch took 85.1 s spinning, 23.9 s passive (13.7 s alone). Read by libgomp when
# it loads, so set before torch is imported; a `kvlm serve` child inherits it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import save_tiny_model

torch.set_num_threads(2)

# (architecture, seed, config overrides): one tiny random model per family and variant.
TINY_MODELS = {
    "llama": ("llama", 0, {}),
    "mistral": ("mistral", 1, {}),
    "qwen2": ("qwen2", 2, {}),
    "qwen3": ("qwen3", 3, {}),
    # variants exercising less common code paths
    "llama-bias": ("llama", 4, {"attention_bias": True}),
    "llama-mlp-bias": ("llama", 8, {"mlp_bias": True}),  # gate/up/down biases
    "llama3-rope": (
        "llama",
        5,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    # YaRN over 64 positions by 4 (to the 256 of every tiny model): slow dimensions
    # interpolated, a ramp, cos/sin scaled by 0.1 ln 4 + 1
    "llama-yarn": (
        "llama",
        12,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral-window": ("mistral", 6, {"sliding_window": 8}),
    # head_dim 128 (4 query heads per KV head), its own lm_head
    "llama-hd128": ("llama", 7, {"head_dim": 128, "num_attention_heads": 8}),
    # head_dim 64, 4 query heads per KV head, a window of 150: past 150 positions the fused
    # step's chunks over the visible keys are two, the first starting below the window
    # Gemma 3: local (window 8) and global layers, sandwich norms, GeGLU, two RoPE bases
    "gemma3": ("gemma3", 9, {}),
    # Gemma 2: every second layer windowed, attention scores and logits soft-capped
    "gemma2": ("gemma2", 10, {}),
    # Gemma 4: local and wider global layers, K = V on the globals, the last two layers
    # reading earlier layers' K/V, per-layer inputs (helpers.tiny_config)
    "gemma4": ("gemma4", 11, {}),
    # Gemma 4's experts beside every layer's MLP (enable_moe_block): 8 of 32 (the top 2);
    # four layers, local and global (K = V), the last two reading layers 0 and 1's K/V
    "gemma4-moe": (
        "gemma4",
        13,
        {
            "num_hidden_layers": 4,
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "mistral-hd64-window": (
        "mistral",
        8,
        {"head_dim": 64, "num_key_value_heads": 1, "sliding_window": 150},
    ),
    # DeepSeek-V2: latent attention (the cache keeps a latent of 32 and a rotated key part
    # of 8 a token), a dense first layer, then 8 experts (the top 2) and a shared expert
    "deepseek2": ("deepseek2", 90, {}),
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: name in TINY_MODELS -> folder with config, safetensors and tokenizer."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            arch, seed, overrides = TINY_MODELS[name]
            made[name] = save_tiny_model(
                tmp_path_factory.mktemp(name), arch, seed=seed, **overrides
            )
        return made[name]

    return make


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny llama, fp32, 256 positions: an LLM of each module's own (a test may change
    it: the engine repacks its weights, a module sets speculation)."""
    from kvlm import LLM

    return LLM(model=tiny_model_dir("llama"), progress=False, max_context=256)


@pytest.fixture(scope="module")
def exact(tiny_model_dir):
    """The same tiny llama in fp64: the exact reference of its fp32 results."""
    from kvlm import LLM

    return LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, dtype="fp64")


@pytest.fixture(scope="session")
def default_model_path():
    from kvlm.loading.default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_llm():
    from kvlm import LLM

    # the fp32 reference path: tests of caches and equivalences compare exact numerics
    return LLM(progress=False, max_context=1024, exact=True)


@pytest.fixture(scope="session")
def hf_default():
    """transformers loading the same GGUF, fp32: the reference for the real model.

    transformers reads the file with a fresh gguf.GGUFReader per pass (the config's, the
    weights'), each parsing every metadata field (the 49,152-token vocabulary's), and
    builds gguf's name map of the architecture once per module of the model (~400 times):
    ~19 s of a 2-core box, the same work each time. Both are pure functions of their
    arguments, so each is made once here (the same config and weights, bit for bit): ~5 s."""
    from contextlib import ExitStack
    from functools import lru_cache
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM

    from kvlm.loading.default import default_model_path

    path = default_model_path()
    with ExitStack() as once:
        for name in ("GGUFReader", "get_tensor_name_map"):  # imported from gguf at each call
            once.enter_context(mock.patch.object(gguf, name, lru_cache(getattr(gguf, name))))
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory):
    """A tiny random Qwen3-shaped model whose ChatML template renders tools in the hermes
    format (helpers.CHATML_TOOLS), 2,048 positions (the tools' system turn spends ~800 of
    the tiny tokenizer's tokens): the tool, Responses and Messages tests' model."""
    from helpers import CHATML_TOOLS

    return save_tiny_model(tmp_path_factory.mktemp("qwen3-tools"), "qwen3", seed=3,
                           chat_template=CHATML_TOOLS, max_position_embeddings=2048)  # fmt: skip


@pytest.fixture(scope="session")
def hostile_template_dir(tmp_path_factory):
    """A tiny random Llama whose chat template runs a hostile payload on a trigger word
    (helpers.HOSTILE_TEMPLATE): the template tests' model, on the CLI and on a server."""
    from helpers import HOSTILE_TEMPLATE

    folder = tmp_path_factory.mktemp("hostile-template")
    return save_tiny_model(folder, "llama", seed=5, chat_template=HOSTILE_TEMPLATE,
                           max_position_embeddings=1024)  # fmt: skip


@pytest.fixture(scope="session")
def plain_serve_answers():
    """One plain `kvlm serve` with the cluster tests' flags (test_cluster.COMMON): its four
    greedy answers and its pool's blocks (test_cluster.single_kvlm_serve), a future. Started
    by the first cluster module that asks, while its cluster starts (mostly waiting on Ray);
    test_cluster and test_ray_cluster hold their replicas to the same answers."""
    from concurrent.futures import ThreadPoolExecutor

    from test_cluster import COMMON, KEY, single_kvlm_serve

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(single_kvlm_serve, COMMON, KEY)


@pytest.fixture(scope="module")
def client(server, request):
    """The openai client on the module's `kvlm serve` (its `server` fixture: the port),
    with the module's KEY where it has one."""
    from serving import openai_client

    return openai_client(server, getattr(request.module, "KEY", "unused"))


@pytest.fixture(scope="module")
def model(client):
    """The id the module's server serves."""
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def child():
    """One long-lived child process that loads hostile files (gguf_hostile.Child), a
    module's."""
    from gguf_hostile import Child

    c = Child(timeout=20)
    yield c
    c.close()


# The files that take longest, longest first (seconds of the suite under `-n 3` on an
# Intel Xeon with AMX, BENCHMARKS 16): handed out first so the workers end together
# (longest first). A file not named here follows, most tests first (xdist's own order).
LONGEST_FIRST = (
    "test_cluster.py", "test_composition.py", "test_cache_family.py", "test_one_answer.py",
    "test_fused_arch.py", "test_ray_cluster.py", "test_server_fuzz.py", "test_speculative.py",
    "test_default_model.py", "test_quant.py", "test_qwen35.py", "test_agent_codex.py",
    "test_engine.py", "test_first_minutes.py", "test_agents.py", "test_llm_batch.py",
    "test_bench_suite.py", "test_hostile_files.py", "test_anthropic.py", "test_lm_eval.py",
    "test_server_edges.py", "test_tools.py", "test_lfm2.py", "test_plots.py",
)  # fmt: skip


def pytest_configure(config):
    # `--dist loadfile` hands out files in the order collected (below), not by test count
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Under xdist only: the files in LONGEST_FIRST's order, then the rest by test count
    (a plain run keeps pytest's order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    count = collections.Counter(item.path.name for item in items)
    items.sort(
        key=lambda item: (
            rank.get(item.path.name, len(rank)),
            -count[item.path.name],
            item.path.name,
        )
    )  # a stable sort: in-file order kept
