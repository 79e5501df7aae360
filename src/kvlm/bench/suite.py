"""`kvlm bench --suite DIR`: the models people run, each engine alone, in one run.

    for each model file (random-weight GGUFs of real shapes, written into DIR when absent,
    kvlm.bench.models; and the default model):
        ROUNDS times, the engines taking turns (kvlm with no flags, llama.cpp; then
        transformers, once: its load alone takes 11-37 s, and it is a reference, not a
        target):
            a fresh process (bench/child.py): load (timed), warm up, the prompt once
            -> TTFT, decode tokens/s, peak RSS, load time
        each engine's row: the medians over its rounds (peak RSS: the largest)
    plus the memory bandwidth probed just before and after each kvlm process, and kvlm's
    share of the bound it sets (weight bytes read per token / bandwidth).

The rounds take turns because this machine's memory bandwidth moves by 2x over minutes
(39-80 GB/s in one run): rounds of one engine run back to back, then the other's, compared
each engine with a different machine.

A process per engine and model: peak RSS and load time are each engine's own (no other
engine's weights or libraries in the process), and a crash of one peer costs one row. The
file is read once before the first engine, so every load starts from the page cache.
Targets (issue [6]) are checked per row and summed up in the markdown.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvlm.bench import probed, prompt_ids
from kvlm.bench.models import FILE_TYPES, SHAPES, write_model
from kvlm.loading import default_model_path, load_model
from kvlm.settings import table

ENGINES = ("kvlm", "llama.cpp", "hf")
MODULES = {"kvlm": "kvlm", "llama.cpp": "llama_cpp", "hf": "transformers"}
SUITE_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "qwen3-1.7b", "llama-3.2-1b")
SUITE_TYPES = ("Q4_0", "Q8_0", "Q4_K_M")
CHILD = Path(__file__).with_name("child.py")
# targets of issue [6], kvlm with no flags against llama.cpp in the same run
TARGET_DECODE = 1.5  # x llama.cpp's decode tokens/s
TARGET_SHARE = 0.85  # of the bandwidth bound, on the shapes of >= 1B parameters
TARGET_TTFT = 0.5  # x llama.cpp's TTFT
TARGET_LOAD_S_PER_GB = 2.0


def suite_models(
    folder: Path,
    shapes: list[str] | None = None,
    types: list[str] | None = None,
    default: bool = True,
    log: Any = None,
) -> list[Path]:
    """The suite's files: each shape x type in `folder` (written when absent, with the
    default model's tokenizer), and the default model."""
    shapes = list(SUITE_SHAPES if shapes is None else shapes)
    types = list(SUITE_TYPES if types is None else types)
    for kind, names, valid in (("shape", shapes, SHAPES), ("file type", types, FILE_TYPES)):
        for name in names:
            if name not in valid:
                raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(valid)}")
    folder.mkdir(parents=True, exist_ok=True)
    out = [default_model_path()] if default else []
    for name in shapes:
        for t in types:
            path = folder / f"{name}-{t}.gguf"
            if not path.is_file():
                if log:
                    print(f"writing {path}", file=log, flush=True)
                tmp = path.with_suffix(".tmp")
                write_model(name, t, tmp, default_model_path())
                tmp.rename(path)
            out.append(path)
    return out


def _read_once(path: Path) -> None:
    """Bring the file into the page cache, so every engine's load starts from memory."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def run_child(
    engine: str, model: Path, ids_file: str, new: int, threads: int, timeout: float
) -> dict[str, Any]:
    cmd = [sys.executable, str(CHILD), engine, str(model), ids_file, str(new), str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"engine": engine, "error": f"exit {done.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


ONCE = ("hf",)  # engines run one round per model (a reference, not a target)
MEDIANS = ("ttft_ms", "prefill_tok_s", "decode_tok_s", "load_s", "bandwidth_gb_s")


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's row from its rounds on a model: the medians of the timings and the
    bandwidth, the largest peak RSS, the rest from the first round that ran; an error only
    when no round ran (else the rounds that did, and how many failed)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    row = dict(ok[0])
    for key in MEDIANS:
        values = [r[key] for r in ok if key in r]
        if values:
            row[key] = statistics.median(values)
    if any("peak_rss_mib" in r for r in ok):
        row["peak_rss_mib"] = max(r.get("peak_rss_mib", 0.0) for r in ok)
    row["rounds"] = len(ok)
    if len(ok) < len(runs):
        row["failed_rounds"] = len(runs) - len(ok)
    return row


def run_suite(
    models: list[Path],
    engines: list[str],
    prompt: int = 512,
    new: int = 64,
    rounds: int = 2,
    threads: int | None = None,
    timeout: float = 1800.0,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    threads = threads or torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    skipped = {e: "not installed" for e in engines if importlib.util.find_spec(MODULES[e]) is None}
    todo = [e for e in engines if e not in skipped]
    per_model = sum(1 if e in ONCE else rounds for e in todo)
    total, done = len(models) * per_model, 0
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            ids_file = os.path.join(tmp, "ids.json")
            with open(ids_file, "w") as f:
                json.dump(prompt_ids(load_model(model), prompt), f)
            _read_once(model)
            size = model.stat().st_size
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in todo}
            for r in range(rounds):
                for engine in todo:
                    if engine in ONCE and r:
                        continue
                    done += 1
                    print(f"[{done}/{total}] {engine}: {model.name}", file=log, flush=True)
                    run = partial(run_child, engine, model, ids_file, new, threads, timeout)
                    runs[engine].append(probed(run) if engine == "kvlm" else run())
            for engine in todo:
                rows.append(merge_rounds(runs[engine]) | {"model": model.name, "file_bytes": size})
    return {
        "prompt_tokens": prompt,
        "new_tokens": new,
        "rounds": rounds,
        "threads": threads,
        "rows": rows,
        "skipped": skipped,
        "targets": targets(rows),
    }


def _billions(name: str) -> float | None:
    """Parameters in billions from a suite file's name (`qwen3-1.7b-Q4_0.gguf`), else None."""
    for part in name.split("-"):
        if part.endswith("b") and part[:-1].replace(".", "").isdigit():
            return float(part[:-1])
    return None


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: kvlm against llama.cpp (decode, TTFT, peak RSS), kvlm's share of the
    bandwidth bound and its load time per GB, each with whether it meets issue [6]'s
    target (None where the row needed is missing)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["engine"]: r for r in rows if r["model"] == model and "error" not in r}
        k, peer = by.get("kvlm"), by.get("llama.cpp")
        if k is None:
            continue
        gb = k["file_bytes"] / 1e9
        t: dict[str, Any] = {"model": model, "load_s_per_gb": round(k["load_s"] / gb, 2)}
        t["load_ok"] = t["load_s_per_gb"] <= TARGET_LOAD_S_PER_GB
        bound = k["bandwidth_gb_s"] * 1e9 / k["weight_bytes_per_token"]
        t["share_of_bound"] = round(k["decode_tok_s"] / bound, 3)
        size = _billions(model)
        t["share_ok"] = None if size is None or size < 1 else t["share_of_bound"] >= TARGET_SHARE
        if peer is not None:
            t["decode_ratio"] = round(k["decode_tok_s"] / peer["decode_tok_s"], 2)
            t["ttft_ratio"] = round(k["ttft_ms"] / peer["ttft_ms"], 2)
            t["rss_ratio"] = round(k["peak_rss_mib"] / peer["peak_rss_mib"], 2)
            t["decode_ok"] = t["decode_ratio"] >= TARGET_DECODE
            t["ttft_ok"] = t["ttft_ratio"] <= TARGET_TTFT
            t["rss_ok"] = t["rss_ratio"] <= 1.0
        out.append(t)
    return out


def markdown(result: dict[str, Any]) -> str:
    head = "model | GB | engine | load s | TTFT ms | decode tok/s | share of bound | peak RSS MiB"
    lines = [
        f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens (greedy, "
        f"EOS off), medians of {result['rounds']} rounds taking turns (transformers: one), "
        f"{result['threads']} threads; each engine "
        "alone in a fresh process; load time from the page cache",
        "",
        *table(head, "lrlrrrrr"),
    ]
    for r in result["rows"]:
        gb = f"{r['file_bytes'] / 1e9:.2f}"
        if "error" in r:
            lines.append(f"| {r['model']} | {gb} | {r['engine']} | {r['error']} |||||")
            continue
        share = ""
        if "weight_bytes_per_token" in r:
            bound = r["bandwidth_gb_s"] * 1e9 / r["weight_bytes_per_token"]
            share = f"{r['decode_tok_s'] / bound:.0%} of {bound:.0f}"
            share += f" ({r['bandwidth_gb_s']:.0f} GB/s)"
        lines.append(
            f"| {r['model']} | {gb} | {r['engine']} | {r['load_s']:.2f} | {r['ttft_ms']:.0f} | "
            f"{r['decode_tok_s']:.1f} | {share} | {r['peak_rss_mib']:.0f} |"
        )
    if result["targets"]:

        def mark(ok: bool | None) -> str:
            return "" if ok is None else (" ✓" if ok else " ✗")

        head = "model | decode x llama.cpp | TTFT x llama.cpp | peak RSS x llama.cpp"
        lines += [
            "",
            f"Targets: decode >= {TARGET_DECODE}x llama.cpp, TTFT <= {TARGET_TTFT}x, peak RSS "
            f"<= llama.cpp's, >= {TARGET_SHARE:.0%} of the bound on >= 1B shapes, load <= "
            f"{TARGET_LOAD_S_PER_GB} s/GB",
            "",
            *table(head + " | share of bound | load s/GB", "lrrrrr"),
        ]
        for t in result["targets"]:
            cells = [
                f"{t[k]}{mark(t.get(k.replace('ratio', 'ok')))}" if k in t else "-"
                for k in ("decode_ratio", "ttft_ratio", "rss_ratio")
            ]
            lines.append(
                f"| {t['model']} | {' | '.join(cells)} | {t['share_of_bound']:.0%}"
                f"{mark(t['share_ok'])} | {t['load_s_per_gb']}{mark(t['load_ok'])} |"
            )
        met = [v for t in result["targets"] for k, v in t.items() if k.endswith("_ok")]
        checked = [v for v in met if v is not None]
        lines += ["", f"{sum(checked)} of {len(checked)} target checks met"]
    for engine, why in result["skipped"].items():
        lines.append(f"\nskipped {engine}: {why}")
    return "\n".join(lines)
