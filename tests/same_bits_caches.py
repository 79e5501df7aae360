"""Same bits through the caches: what every cache mode computes on every family the tests
build, recorded from one source tree and compared bit for bit with another's (a change to
how caches are laid out or grouped that must not move a bit).

    PYTHONPATH=src python tests/same_bits_caches.py record OUT.pt [--quick]
    PYTHONPATH=src python tests/same_bits_caches.py compare BEFORE.pt AFTER.pt

`record` runs every family (conftest.TINY_MODELS, test_fused_arch.MADE) under every K/V
dtype (test_fused_arch.KV_DTYPES, SPLIT_KV) in every cache mode: the prompt's logits (a
prompt past the local window, so rings wrap) and STEPS greedy decode steps; then, in the
row and pool modes, the same prompt fed in chunks, a rollback and the steps again, a
fork into two rows, and a snapshot restored into a fresh cache; and a batch of prompts
through the pool engine (LLM.generate). Each result is kept as its raw bytes. `compare`
names every entry that differs or is missing, exit 1. `--quick`: fp32, int8 and q4 only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY_MODELS
from helpers import save_tiny_model
from same_bits import compare  # one comparison of two recordings, nested dicts and all

STEPS = 24
MAX_CONTEXT = 256
MODES = ("off", "basic", "contiguous", "paged", "int8", "window")
ROW_MODES = ("basic", "contiguous", "paged", "int8")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, so that equal means bit for bit (NaNs, -0.0)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _greedy(llm, cache, token: int, steps: int) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        out.append(llm.runner.forward([token], cache))
        token = int(out[-1].argmax())
    return out


def _decode(llm, mode: str, prompt: list[int]) -> dict[str, torch.Tensor]:
    """The prompt's logits and STEPS greedy steps'; in ROW_MODES also chunked, rolled
    back, forked and restored."""
    from kvlm.errors import InvalidRequestError

    try:
        cache = llm.new_cache(mode)
    except InvalidRequestError as e:  # a mode that refuses the dtype: the same words
        return {"refused": torch.tensor(list(str(e).encode()), dtype=torch.uint8)}
    rows = llm.runner.logits(prompt, cache)
    steps = _greedy(llm, cache, int(rows[-1].argmax()), STEPS)
    got = {"prompt": _bits(rows), "steps": _bits(torch.stack(steps))}
    if mode not in ROW_MODES:
        return got
    from kvlm.engine.runner import CacheBatch

    snap = cache.snapshot()
    if cache.can_roll_back(3):
        cache.rollback(3)
        got["rolled"] = _bits(torch.stack(_greedy(llm, cache, int(steps[-4].argmax()), 3)))
    fresh = llm.new_cache(mode)
    fresh.restore(snap)
    got["restored"] = _bits(torch.stack(_greedy(llm, fresh, int(steps[-1].argmax()), 4)))
    chunked = llm.new_cache(mode)
    for at in range(0, len(prompt), 7):
        last = llm.runner.logits(prompt[at : at + 7], chunked)
    got["chunked"] = _bits(last)
    chunked.fork(2)
    token = int(last[-1].argmax())
    got["forked"] = _bits(llm.runner.run(CacheBatch([[token], [token + 1]], chunked)))
    return got


def _families(tmp: Path) -> dict[str, Path]:
    from test_fused_arch import MADE

    models = {**TINY_MODELS, **MADE}
    return {name: save_tiny_model(tmp / name, arch, seed=seed, **overrides)
            for name, (arch, seed, overrides) in models.items()}  # fmt: skip


def record(path: Path, quick: bool) -> None:
    from kvlm import LLM, SamplingParams
    from kvlm.errors import KvlmError
    from test_fused_arch import KV_DTYPES, SPLIT_KV

    dtypes = ["fp32", "int8", "q4"] if quick else KV_DTYPES + SPLIT_KV
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in _families(Path(tmp)).items():
            for kv in dtypes:
                llm = LLM(
                    model=folder, progress=False, max_context=MAX_CONTEXT, kv_dtype=kv, threads=2
                )  # measured thread counts would move bits
                prompt = _ids(llm.config.vocab_size, 30, 11)
                for mode in MODES:
                    try:
                        out[f"{name}/{kv}/{mode}"] = _decode(llm, mode, prompt)
                    except KvlmError as exc:  # a mode the family refuses (latent: window)
                        print(f"{name} {kv} {mode}: refused ({exc})", flush=True)
                prompts = [_ids(llm.config.vocab_size, n, 20 + n) for n in (5, 19, 33)]
                params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
                done = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                out[f"{name}/{kv}/pool"] = {
                    "tokens": torch.tensor([o.outputs[0].token_ids for o in done])
                }
                print(name, kv, flush=True)
    torch.save(out, path)
    print(f"{len(out)} entries -> {path}")


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--quick", action="store_true")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.out, args.quick)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
