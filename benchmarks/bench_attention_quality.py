"""What the prompt's attention in bf16 costs in quality, by position: over a long real text
fed in chunks (the prompt path: every chunk's rows attend over all earlier chunks' K/V),
each position's next-token distribution against the fp32 reference's (`exact`), as KL
divergence, the share of positions whose top token is the reference's, and perplexity,
in buckets of position (the rows from kvlm.defaults.LONG_ATTENTION on are the ones the
defaults put in bf16 with int8 prompt products), and each run against the defaults.

    python benchmarks/bench_attention_quality.py [--model FILE] [--text FILE]
        [--tokens 8000] [--chunk 512] [--threads 2]

Runs: the fp32 reference, the defaults, the defaults with the attention in fp32 for every
prompt row, the same in bf16 for every row, and bf16 prompt products (whose attention is
bf16 throughout). The text (default: the GPL-3 text Debian ships, ~8k tokens) repeats
when shorter than --tokens. Only a chunk's logits are held at a time.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch

from kvlm import LLM
from kvlm.bench import QUALITY_TEXT, lockstep_logprobs
from kvlm.defaults import LONG_ATTENTION
from kvlm.model.attention import Attention

RUNS = {  # name: (LLM settings, every Attention's prompt_bf16_from or "as resolved")
    "exact": ({"exact": True}, "as resolved"),
    "defaults": ({}, "as resolved"),
    "defaults, attention fp32": ({}, None),
    "defaults, attention bf16": ({}, 0),
    "prompt products bf16": ({"prefill_dtype": "bf16"}, "as resolved"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--text", default=str(QUALITY_TEXT))
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    llms = {}
    for name, (settings, attention) in RUNS.items():
        llm = LLM(args.model, max_context=args.tokens + 1, threads=args.threads, progress=False,
                  **settings)  # fmt: skip
        if attention != "as resolved":
            for m in llm.model.modules():
                if isinstance(m, Attention):
                    m.prompt_bf16_from = attention
        llms[name] = llm
    ids = llms["exact"].tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = ids[: args.tokens]
    n = len(ids) - 1
    nxt = torch.tensor([*ids[1:], 0])
    nll: dict[str, list] = {k: [] for k in llms}
    kl: dict[str, list] = {k: [] for k in llms}  # against exact
    kd: dict[str, list] = {k: [] for k in llms}  # against the defaults
    same: dict[str, list] = {k: [] for k in llms}
    for start, lp in lockstep_logprobs(llms, ids, args.chunk):
        size = len(lp["exact"])
        nx = nxt[start : start + size]
        pe, pd = lp["exact"].exp(), lp["defaults"].exp()
        for k in llms:
            nll[k].append(-lp[k].gather(-1, nx[:, None])[:, 0])
            kl[k].append((pe * (lp["exact"] - lp[k])).sum(-1))
            kd[k].append((pd * (lp["defaults"] - lp[k])).sum(-1))
            same[k].append((lp[k].argmax(-1) == lp["exact"].argmax(-1)).double())
        print(f"{start + size} tokens", flush=True)
    edges = [e for e in (0, 512, LONG_ATTENTION, 4096, 16384, 32768) if e < n] + [n]
    spans = list(itertools.pairwise(edges))
    name = llms["exact"].model_name
    print(f"\n{name}, {n} positions of {Path(args.text).name}, chunks of {args.chunk}; "
          "each cell: mean KL vs exact / same top token as exact / mean KL vs the "
          "defaults\n")  # fmt: skip
    print("| run | prompt attention bf16 from | perplexity | "
          + " | ".join(f"positions {a:,}-{b - 1:,}" for a, b in spans) + " |")  # fmt: skip
    print("| --- | ---: | ---: |" + " --- |" * len(spans))
    for k, llm in llms.items():
        at = next(m for m in llm.model.modules() if isinstance(m, Attention)).prompt_bf16_from
        ppl = math.exp(float(torch.cat(nll[k])[:n].mean()))
        d, e, s = (torch.cat(x[k])[:n] for x in (kl, kd, same))
        cells = [f"{float(d[a:b].mean()):.5f} / {float(s[a:b].mean()):.2%} / "
                 f"{float(e[a:b].mean()):.5f}" for a, b in spans]  # fmt: skip
        at = "-" if at is None else f"{at:,}"
        print(f"| {k} | {at} | {ppl:.4f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
