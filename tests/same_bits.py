"""Same bits: what every road through the C kernels computes, recorded from one build of
kvlm and compared bit for bit with another's (a change to the kernels that must not move a
bit: a move of code between files, a refactor).

    PYTHONPATH=src python tests/same_bits.py record OUT.pt [--build native|haswell|x86-64]
    PYTHONPATH=src python tests/same_bits.py compare BEFORE.pt AFTER.pt

`record` runs, on this source's kernels (native: the build kvlm makes for this CPU;
haswell, x86-64: the portable AVX2 and scalar builds the tests make, helpers.py's
portable_kernels):
- every family the tests build (conftest.TINY_MODELS, test_fused_arch.MADE) under every
  K/V dtype the fused step reads (test_fused_arch.KV_DTYPES, SPLIT_KV) in a contiguous
  (Gemma: hybrid) and a paged cache: the prompt's logits (the prompt kernels: products,
  norms, q/k norm + RoPE, attention, SwiGLU) and 40 greedy decode steps (the fused step);
- each family again with int8 and int16 activations and int8 and bf16 prompt products;
- rows of different lengths batched over a paged pool (test_fused_batch.LENGTHS: the
  fused step's B > 1), per K/V dtype;
- test_kquants.MIXES as GGUF files (`--weights native`: Q4_K, Q5_K, Q6_K, Q4_0, Q5_0,
  Q5_1 and a mix of parts);
- each weight kind's entry points on random blocks: packing, dequantization (fp32, bf16,
  rows), products at 1-40 rows (fp32, int8, int16 activations, a prompt's tiles);
  the prompt attention (kvlm_attend) at test_prompt_kernels' shapes, fp32 and bf16 rows.
Each result is kept as its raw bytes (NaN payloads too), with the fused step's reason
where it did not run. `compare` names every entry that differs or is missing, exit 1.
Run `record` before the change and after it (one build each), then `compare`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY_MODELS
from helpers import (
    feed_batched,
    random_blocks,
    save_tiny_model,
    scrambled_tables,
    write_gguf_from_hf,
)

STEPS = 40
MAX_CONTEXT = 256


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, so that equal means bit for bit (NaNs, -0.0)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _llm(folder: Path, weights: str, kv_dtype: str, act: str = "fp32", prefill: str = "fp32"):
    from kvlm import LLM

    return LLM(model=folder, progress=False, max_context=MAX_CONTEXT, weights=weights,
               kv_dtype=kv_dtype, activations=act, prefill_dtype=prefill)  # fmt: skip


def _decode(llm, mode: str, seed: int) -> dict[str, torch.Tensor | str]:
    """The prompt's logits, then STEPS greedy steps' (the fused step where it runs)."""
    c = llm.config
    windows = [w for w in (c.layer_windows or []) if w is not None]
    window = min(windows) if windows else c.sliding_window
    prompt = _ids(c.vocab_size, max(12, (window or 0) - 10), seed)
    cache = llm.new_cache(mode)
    rows = llm.runner.logits(prompt, cache)
    fused = llm.runner.fused_for(cache) is not None
    token, steps = int(rows[-1].argmax()), []
    for _ in range(STEPS):
        steps.append(llm.runner.forward([token], cache))
        token = int(steps[-1].argmax())
    return {"prompt": _bits(rows), "steps": _bits(torch.stack(steps)),
            "fused": "yes" if fused else str(llm.runner.fused_reason)}  # fmt: skip


def _families(tmp: Path) -> dict[str, Path]:
    from test_fused_arch import MADE

    models = {**TINY_MODELS, **MADE}
    return {name: save_tiny_model(tmp / name, arch, seed=seed, **overrides)
            for name, (arch, seed, overrides) in models.items()}  # fmt: skip


def _weights(name: str) -> str:
    return "int8" if name.startswith(("qwen", "gemma2")) else "int4"  # test_fused_arch's


def record_models(out: dict, tmp: Path) -> None:
    from test_fused_arch import KV_DTYPES, SPLIT_KV

    for name, folder in _families(tmp).items():
        for kv in KV_DTYPES + SPLIT_KV:
            llm = _llm(folder, _weights(name), kv)
            for mode in ("contiguous", "paged"):
                out[f"model/{name}/{kv}/{mode}"] = _decode(llm, mode, seed=11)
        for act, prefill in (("int8", "int8"), ("int16", "bf16"), ("int16", "int8")):
            llm = _llm(folder, _weights(name), "fp16", act, prefill)
            out[f"numerics/{name}/{act}/{prefill}"] = _decode(llm, "paged", seed=12)
        other = {"int8": "int4", "int4": "int8"}[_weights(name)]
        out[f"weights/{name}/{other}"] = _decode(_llm(folder, other, "fp32"), "contiguous", 13)


def record_batches(out: dict, tmp: Path) -> None:
    from kvlm.cache.paged import BlockPool
    from test_fused_arch import KV_DTYPES, SPLIT_KV
    from test_fused_batch import LENGTHS

    for name in ("llama", "qwen3", "llama-hd128", "mistral-hd64-window"):
        arch, seed, overrides = TINY_MODELS[name]
        folder = save_tiny_model(tmp / f"batch-{name}", arch, seed=seed, **overrides)
        for kv in KV_DTYPES + SPLIT_KV:
            for act in ("fp32", "int16"):
                llm = _llm(folder, "int4", kv, act)
                seqs = [_ids(llm.config.vocab_size, n, b) for b, n in enumerate(LENGTHS)]
                pool = BlockPool(llm.cache_spec("paged"), 64)
                rows = feed_batched(llm, seqs, pool, scrambled_tables(pool, LENGTHS, seed=2))
                out[f"batch/{name}/{kv}/{act}"] = {
                    "rows": _bits(torch.cat(rows)),
                    "fused": str(llm.runner.fused_reason),
                }


def record_native(out: dict, tmp: Path) -> None:
    from test_kquants import MIXES

    wide = save_tiny_model(tmp / "wide", "llama", seed=7, hidden_size=256,
                           intermediate_size=512, head_dim=64)  # fmt: skip
    for mix, types in MIXES.items():
        path = write_gguf_from_hf(wide, tmp / f"{mix}.gguf", types=types)
        for kv in ("fp32", "fp16", "int8", "q4"):
            out[f"native/{mix}/{kv}"] = _decode(_llm(path, "native", kv), "contiguous", 14)
        out[f"native/{mix}/int16"] = _decode(_llm(path, "native", "fp16", "int16", "int8"),
                                             "paged", 15)  # fmt: skip


def record_products(out: dict) -> None:
    from kvlm.model import quant

    sources = {"q8": "Q8_0", "q4": "Q4_1", "q4_0": "Q4_0", "q5_0": "Q5_0", "q5_1": "Q5_1",
               "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "mxfp4": "MXFP4"}  # fmt: skip
    n, k = 40, 512  # 40 rows: a block of 16 padded
    for i, (kind, qtype) in enumerate(sources.items()):
        blocks = random_blocks(qtype, n, k, np.random.default_rng(i))
        w = quant.QuantWeight.from_blocks(kind, torch.from_numpy(blocks))
        got = {"packed": _bits(w.data), "dense": _bits(w.dense()),
               "dense_bf16": _bits(w.dense(dtype=torch.bfloat16)),
               "rows": _bits(w.rows(torch.tensor([0, 39, 17, 17, 3])))}  # fmt: skip
        g = torch.Generator().manual_seed(100 + i)
        for m in (1, 2, 3, 5, 16, 17, 40):
            x = torch.randn(m, k, generator=g)
            got[f"fp32/{m}"] = _bits(w.matmul(x))
            got[f"int8/{m}"] = _bits(w.matmul(x, act_int8=True))
            got[f"int16/{m}"] = _bits(w.matmul(x, act_int8=True, act_int16=True))
            got[f"prompt/{m}"] = _bits(w.matmul(x, prompt=True))
            got[f"bf16/{m}"] = _bits(w.matmul(x, prefill_bf16=True))
        out[f"products/{kind}"] = got


def record_attention(out: dict) -> None:
    from kvlm.cache.base import causal_mask
    from kvlm.model.attention import _attend_kernel

    shapes = [(9, 3, 64, 37), (14, 2, 64, 100), (16, 8, 128, 70), (12, 2, 128, 33),
              (4, 4, 96, 19), (2, 1, 256, 9), (4, 2, 32, 2), (12, 2, 64, 45)]  # fmt: skip
    for H, Hkv, D, T in shapes:
        g = torch.Generator().manual_seed(H * D + T)
        q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (H, Hkv, Hkv))
        got = {}
        for bf16_row in (None, 0, T // 3):
            for causal in (True, False):
                r = _attend_kernel(q, k, v, None, causal, bf16_row=bf16_row)
                got[f"{bf16_row}/{causal}"] = "declined" if r is None else _bits(r)
        if T > 20:
            mask, causal = causal_mask(20, T - 20, T, None, q.device)
            r = _attend_kernel(q[:, :, 20:], k, v, mask, causal)
            got["prefix"] = "declined" if r is None else _bits(r)
        out[f"attend/{H}x{Hkv}x{D}x{T}"] = got


def record(path: Path, build: str) -> None:
    from kvlm import kernels

    if build != "native":
        from helpers import portable_kernels

        lib = portable_kernels(build)
        kernels.library = lambda: lib  # every caller reads kernels.library()
    lib = kernels.library()
    if lib is None:
        sys.exit(f"no kernels: {kernels.status()}")
    torch.manual_seed(0)
    out: dict = {"simd": lib.kvlm_kernel_simd(), "vnni": lib.kvlm_kernel_vnni()}
    with tempfile.TemporaryDirectory(prefix="kvlm-same-bits-") as tmp:
        record_products(out)
        record_attention(out)
        record_models(out, Path(tmp))
        record_batches(out, Path(tmp))
        record_native(out, Path(tmp))
    torch.save(out, path)
    print(f"{len(out)} entries ({build}: simd {out['simd']}, vnni {out['vnni']}) -> {path}")


def _flat(d, prefix: str = "") -> dict:
    flat = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        flat.update(_flat(value, f"{name}/") if isinstance(value, dict) else {name: value})
    return flat


def compare(a_path: Path, b_path: Path) -> int:
    a, b = _flat(torch.load(a_path)), _flat(torch.load(b_path))
    bad = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        same = (
            torch.equal(x, y)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
            else x == y
        )
        if not same:
            bad.append(key)
    for key in bad:
        print(f"differs: {key}")
    fused = sum(1 for k, v in a.items() if k.endswith("/fused") and v == "yes")
    through = f" ({fused} through the fused step)" if fused else ""
    print(f"{len(a)} results compared{through}: "
          f"{'all the same bits' if not bad else f'{len(bad)} differ'}")  # fmt: skip
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--build", choices=("native", "haswell", "x86-64"), default="native")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out, args.build)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
