"""kvlm's layers run one way. Every import in src/kvlm (at the top of a module, inside a
function, under TYPE_CHECKING: each is a dependency) is read from the source, and:

- no two modules import each other, directly or round a ring;
- no two packages do either (the package is the unit a reader holds in mind);
- no module imports one of a layer above its own;
- a family file of kvlm.arch is imported by the registry (kvlm.arch) alone, and imports
  no other family's.

LAYERS is the order, bottom first, written once here; docs/DESIGN.md draws the same.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Bottom first. A name is a package or a top-level module of kvlm ("kvlm": its __init__).
LAYERS = (
    ("errors", "dtypes", "kernels"),  # no kvlm imports but these
    ("config",),  # the model's shape
    ("arch",),  # the families: each one's config, tensor names, folds, tokenizer quirks
    ("cache",),  # the cache protocol and its modes, tiers, files
    ("model",),  # the transformer over a cache; the weight-source protocol
    ("loading", "defaults"),  # files -> weight sources, tokenizer; numerics by the CPU
    ("engine",),  # runner, scheduler, sampling, requests, the loop
    ("llm", "compose", "settings", "kvlm"),  # the library's facade; what the flags build
    ("server", "bench"),  # HTTP on the engine; measurements
    ("cluster",),  # replicas of the server on Ray
    ("cli",),  # the command
)

# Empty since issue [13]: the engine takes any object with what kvlm.engine.served lists
# (an LLM is one) and never imports the facade above it. Nothing may come back.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_PACKAGE_CYCLES: set[frozenset[str]] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "kvlm").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the kvlm modules it imports (a name imported from a package that is not
    a module of its own counts as the package)."""

    def resolve(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]  # fmt: skip
            else:
                continue
            for target in targets:
                if target == "kvlm" or target.startswith("kvlm."):
                    edges[name].add(resolve(target))
        edges[name].discard(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def unit(module: str) -> str:
    """The package or top-level module a module belongs to ("kvlm" for kvlm/__init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvlm"


RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
MODS = modules()
EDGES = imports(MODS)


def test_every_package_and_module_has_a_layer():
    assert {unit(m) for m in MODS} == set(RANK)


def test_the_walker_sees_imports_of_every_kind():
    """A function's import and a TYPE_CHECKING one count; the walker is not blind."""
    assert "kvlm.model.weights" in EDGES["kvlm.defaults"]  # under TYPE_CHECKING
    assert "kvlm.cluster" in EDGES["kvlm.cli"]  # inside cmd_serve
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}


def test_no_module_imports_a_layer_above_its_own():
    upward = {(m, t) for m, ts in EDGES.items() for t in ts if RANK[unit(t)] > RANK[unit(m)]}
    assert upward == KNOWN_UPWARD


def test_no_import_cycles_between_modules():
    assert cycles(EDGES) == KNOWN_CYCLES


def test_no_import_cycles_between_packages():
    packages: dict[str, set[str]] = defaultdict(set)
    for m, ts in EDGES.items():
        packages[unit(m)] |= {unit(t) for t in ts if unit(t) != unit(m)}
    assert cycles(packages) == KNOWN_PACKAGE_CYCLES


# kvlm.arch's modules that are not a family's: the registry and what every family shares
ARCH_SHARED = {"kvlm.arch", "kvlm.arch.family", "kvlm.arch.readers"}
FAMILY_MODULES = {m for m in MODS if m.startswith("kvlm.arch.") and m not in ARCH_SHARED}


def test_only_the_registry_imports_a_family_file():
    """What a family is lives in its file: the rest of kvlm asks the registry (kvlm.arch)
    and reads the ModelConfig and Family it gives, and no family builds on another's."""
    assert {"kvlm.arch.llama", "kvlm.arch.gemma", "kvlm.arch.lfm2"} <= FAMILY_MODULES
    importers = {(m, t) for m, ts in EDGES.items() for t in ts if t in FAMILY_MODULES}
    assert {m for m, _ in importers} == {"kvlm.arch"}
    assert {t for _, t in importers} == FAMILY_MODULES  # every family registered


def test_the_arch_package_reads_config_helpers_only():
    """kvlm.arch builds on kvlm.config (ModelConfig, Fields, value) and nothing of the
    model, the caches or the loaders."""
    below = {unit(t) for m, ts in EDGES.items() if unit(m) == "arch" for t in ts}
    assert below <= {"arch", "config", "errors"}


def test_no_module_outside_the_family_file_and_the_registry_names_gemma():
    """The knowledge check of issue [20]: `grep -ril gemma src/kvlm --include=*.py` lists
    Gemma's family file and the registry only (a comment naming it elsewhere is knowledge
    of the family outside its file too)."""
    naming = {m for m, path in MODS.items() if "gemma" in path.read_text().lower()}
    assert naming == {"kvlm.arch.gemma", "kvlm.arch.gemma4", "kvlm.arch"}


def test_no_module_outside_the_family_file_and_the_registry_names_gemma4():
    """The same for Gemma 4: its K = V layers, the layers that read an earlier layer's
    K/V, its per-layer inputs and layers of their own head size are ModelConfig fields."""
    names = ("gemma4", "gemma 4")
    naming = {m for m, path in MODS.items() if any(n in path.read_text().lower() for n in names)}
    assert naming == {"kvlm.arch.gemma4", "kvlm.arch"}


def test_no_module_outside_the_family_file_and_the_registry_names_lfm2():
    """The same for LFM2: its short convolution is a layer kind (kvlm.model.conv), not
    the family's, and every other module reads it from the ModelConfig."""
    naming = {m for m, path in MODS.items() if "lfm2" in path.read_text().lower()}
    assert naming == {"kvlm.arch.lfm2", "kvlm.arch"}


def test_no_module_outside_the_family_file_and_the_registry_names_qwen35():
    """The same for Qwen3.5: its gated DeltaNet is a layer kind (kvlm.model.deltanet) and
    its gated attention and partial RoPE are ModelConfig fields, not the family's. (But
    loading/tokenizer.py's table of llama.cpp's pre-tokenizers, keyed by the vocabulary
    names GGUF files carry, "qwen2" and "smollm" among them, has "qwen35": Qwen 3.5's own
    split regex, not a family's branch.)"""
    names = ("qwen35", "qwen3_5", "qwen3.5")
    naming = {m for m, path in MODS.items() if any(n in path.read_text().lower() for n in names)}
    assert naming == {"kvlm.arch.qwen35", "kvlm.arch", "kvlm.loading.tokenizer"}


def test_no_module_outside_the_family_file_and_the_registry_names_qwen3moe():
    """The same for Qwen3-MoE: its mixture of experts is an FFN kind (kvlm.model.experts),
    its router's sizes ModelConfig fields, not the family's."""
    names = ("qwen3moe", "qwen3_moe", "qwen3-moe")
    naming = {m for m, path in MODS.items() if any(n in path.read_text().lower() for n in names)}
    assert naming == {"kvlm.arch.qwen3moe", "kvlm.arch"}


def test_no_module_outside_the_family_file_and_the_registry_names_granite():
    """The same for Granite 4.0-H: its Mamba2 layer is a layer kind (kvlm.model.mamba2),
    NoPE and its multipliers ModelConfig fields, not the family's."""
    naming = {m for m, path in MODS.items() if "granite" in path.read_text().lower()}
    assert naming == {"kvlm.arch.granite", "kvlm.arch"}


def test_no_module_outside_the_family_file_and_the_registry_names_olmoe():
    """The same for OLMoE: its q/k norms over the whole projections are a ModelConfig
    field (qk_norm_extent), its experts the FFN kind, not the family's."""
    naming = {m for m, path in MODS.items() if "olmoe" in path.read_text().lower()}
    assert naming == {"kvlm.arch.olmoe", "kvlm.arch"}


def test_no_module_outside_the_family_file_and_the_registry_names_deepseek2():
    """The same for DeepSeek-V2: its latent attention is a layer kind (kvlm.model.mla, the
    cache kind LatentAttention), its sizes ModelConfig's `latent`, not the family's. (Other
    modules may name DeepSeek for other things: YaRN's mscale pair, a reasoning format.)"""
    names = ("deepseek2", "deepseek_v2", "deepseek-v2")
    naming = {m for m, path in MODS.items() if any(n in path.read_text().lower() for n in names)}
    assert naming == {"kvlm.arch.deepseek2", "kvlm.arch"}


def test_no_module_outside_the_family_file_and_the_registry_names_glm_or_deepseek_v3():
    """The same for GLM-4.7-Flash and DeepSeek-V3, read by the DeepSeek-V2 family file:
    their router (a sigmoid, a selection bias, group-limited routing) is the experts'
    FFN kind's, its fields Experts', not the family's."""
    names = ("glm", "deepseek_v3", "deepseek-v3")
    naming = {m for m, path in MODS.items() if any(n in path.read_text().lower() for n in names)}
    assert naming == {"kvlm.arch.deepseek2", "kvlm.arch"}
