"""What each K/V dtype costs in quality, measured as llama.cpp measures its cache types
(`llama-perplexity --kl-divergence`): over a long real text, the KL divergence of each
position's next-token distribution from the one with fp16 K/V, the share of positions
whose top token is fp16's, and the text's perplexity.

    python benchmarks/bench_kv_quality.py [--model FILE] [--text FILE] [--tokens 4096]
        [--chunk 512] [--dtypes fp16,fp32,bf16,int8,q4] [--threads 2]
        [--llamacpp [--llamacpp-types f16,q8_0,q4_0]]

A dtype "K/V" stores K and V apart (int8/q4: --k-dtype int8 --v-dtype q4); llama.cpp's
types likewise (q8_0/q4_0: type_k q8_0, type_v q4_0).

The text (default: the GPL-3 text Debian ships, /usr/share/common-licenses/GPL-3, ~8k
tokens of real English prose) is fed in chunks of --chunk tokens through one contiguous
cache per dtype, the model's defaults otherwise: each chunk's positions attend over every
earlier chunk's K/V as that dtype stores them, and over their own chunk's as stored too
(the cache hands back what it stored). Every dtype sees the same chunks in lockstep, so
only a chunk's logits are held at a time.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from kvlm import LLM
from kvlm.bench import QUALITY_TEXT, lockstep_logprobs

LLAMACPP_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml's type ids (llama_cpp.GGML_TYPE_*)


def llamacpp_rows(
    path: str, ids: list[int], chunk: int, threads: int, names: list[str]
) -> dict[str, tuple]:
    """llama.cpp's own table on the same tokens: its K/V types ("q8_0", or K's and V's
    apart, "q8_0/q4_0"; flash attention, which its quantized V needs), each position's
    log-probabilities against its f16 cache's: (perplexity, KL per position, same-top
    count)."""
    import numpy as np
    from llama_cpp import Llama

    logp = {}
    for name in ["f16", *(n for n in names if n != "f16")]:
        k, _, v = name.partition("/")
        t_k, t_v = LLAMACPP_TYPES[k], LLAMACPP_TYPES[v or k]
        model = Llama(model_path=path, n_ctx=len(ids) + 8, n_batch=chunk, n_ubatch=chunk,
                      n_threads=threads, n_threads_batch=threads, logits_all=True,
                      flash_attn=True, type_k=t_k, type_v=t_v, verbose=False)  # fmt: skip
        model.eval(ids)
        scores = torch.from_numpy(np.array(model.scores[: len(ids) - 1], dtype=np.float64))
        logp[name] = torch.log_softmax(scores, dim=-1)
        del model
    nxt = torch.tensor(ids[1:])
    out = {}
    for name, lp in logp.items():
        ppl = math.exp(-float(lp.gather(-1, nxt[:, None]).sum()) / len(nxt))
        kl = (logp["f16"].exp() * (logp["f16"] - lp)).sum(-1)
        same = int((lp.argmax(-1) == logp["f16"].argmax(-1)).sum())
        out[name] = (ppl, kl, same)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--text", default=str(QUALITY_TEXT))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--dtypes", default="fp16,fp32,bf16,int8,q4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llamacpp", action="store_true", help="llama.cpp's K/V types beside")
    p.add_argument("--llamacpp-types", default="f16,q8_0,q4_0")
    args = p.parse_args()
    dtypes = args.dtypes.split(",")
    assert dtypes[0] == "fp16", "the first dtype is the baseline: fp16"
    text = Path(args.text).read_text(encoding="utf-8")
    llms = {d: LLM(args.model, kv_dtype=d, max_context=args.tokens + 1, threads=args.threads,
                   progress=False) for d in dtypes}  # fmt: skip
    base = llms["fp16"]
    ids = base.tokenizer.encode(text)[: args.tokens]
    kl: dict[str, list[torch.Tensor]] = {d: [] for d in dtypes[1:]}
    same = dict.fromkeys(dtypes[1:], 0)
    nll = dict.fromkeys(dtypes, 0.0)
    # the last token has no next one: no chunk starts at it
    for start, lps in lockstep_logprobs(llms, ids, args.chunk, stop=len(ids) - 1):
        nxt = torch.tensor(ids[start + 1 : start + args.chunk + 1])
        logp = {}
        for d, lp in lps.items():
            logp[d] = lp[: len(nxt)]
            nll[d] -= float(logp[d].gather(-1, nxt[:, None]).sum())
        p_base = logp["fp16"].exp()
        for d in dtypes[1:]:
            kl[d].append((p_base * (logp["fp16"] - logp[d])).sum(-1))
            same[d] += int((logp[d].argmax(-1) == logp["fp16"].argmax(-1)).sum())
        print(f"{start + len(lps['fp16'])} tokens", flush=True)
    n = len(ids) - 1
    spec = {d: llm.new_cache("contiguous").spec.bytes_per_token for d, llm in llms.items()}
    print(f"\n{base.model_name}, {n} positions of {Path(args.text).name}, chunks of "
          f"{args.chunk}, the defaults' numerics otherwise\n")  # fmt: skip
    print("| K/V | bytes/token | perplexity | mean KL vs fp16 | 99th pct KL | max KL | "
          "same top token as fp16 |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for d in dtypes:
        ppl = math.exp(nll[d] / n)
        if d == "fp16":
            print(f"| fp16 | {spec[d]:,} | {ppl:.4f} | - | - | - | - |")
            continue
        k = torch.cat(kl[d])
        print(
            f"| {d} | {spec[d]:,} | {ppl:.4f} | {float(k.mean()):.3g} | "
            f"{float(k.quantile(0.99)):.3g} | {float(k.max()):.3g} | {same[d] / n:.2%} |"
        )
    if args.llamacpp:
        rows = llamacpp_rows(str(base.loaded.path), ids, args.chunk, args.threads,
                             args.llamacpp_types.split(","))  # fmt: skip
        for name, (ppl, k, same_top) in rows.items():
            cells = ("- | - | - | -" if name == "f16" else
                     f"{float(k.mean()):.3g} | {float(k.quantile(0.99)):.3g} | "
                     f"{float(k.max()):.3g} | {same_top / n:.2%}")  # fmt: skip
            print(f"| llama.cpp {name} (vs its f16) | | {ppl:.4f} | {cells} |")


if __name__ == "__main__":
    main()
