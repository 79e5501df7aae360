"""Decode tokens/s with and without speculative decoding (prompt lookup), on
input-grounded prompts (repeat / extract / edit a given text or code) and open-ended
ones, with llama.cpp's own prompt-lookup decoding (llama-cpp-python's
LlamaPromptLookupDecoding) in the same run where it is installed.

Greedy, one request at a time; decode rate = tokens after the first over the time from the
first token to the last (prefill excluded); kvlm's speculative output is checked equal to
its plain output. Engines take turns per prompt; medians of --rounds.

    python benchmarks/bench_speculative.py [--model FILE] [--tokens 128] [--rounds 3]
    python benchmarks/bench_speculative.py --chat --no-llama   # kvlm chat's path
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.speculative import SpeculativeConfig
from kvlm.loading.default import default_model_path

TEXT = (
    "The KV cache stores the keys and values of every token already processed, which turns "
    "generation from reprocessing the whole sequence into processing one token and attending "
    "over the cache. Paged caches split it into fixed-size blocks so that many requests share "
    "one pool, and a prefix cache lets a request reuse the blocks of an earlier one."
)
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef spread(values):\n    low = min(values)\n"
    "    high = max(values)\n    return high - low\n"
)
PROMPTS = {
    "grounded: repeat": "Repeat this text word for word:\n\n" + TEXT,
    "grounded: extract": "Copy every sentence of this text that mentions blocks:\n\n" + TEXT,
    "grounded: edit code": "Rename the variable `values` to `xs` in this code and print the "
    "whole code:\n\n" + CODE,
    "open: story": "Write a short story about a lighthouse keeper.",
    "open: explain": "Explain why the sky is blue to a child.",
}


def kvlm_rate(llm: LLM, ids: list[int], n: int, spec) -> tuple[float, list[int], float]:
    engine = Engine(llm, EngineConfig(num_blocks=256, prefix_caching=False, speculative=spec))
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=n))
    tokens: list[int] = []
    first = last = None
    while engine.has_work():
        for event in engine.step():
            now = time.perf_counter()
            if not tokens and event.token_ids:
                first = now
            tokens += event.token_ids
            last = now
    rate = (len(tokens) - 1) / (last - first) if len(tokens) > 1 else 0.0
    return rate, tokens, engine.stats.spec.acceptance


def chat_rate(llm: LLM, text: str, n: int, spec) -> tuple[float, list[int], float]:
    """One turn of a conversation on its own cache (kvlm chat's path), speculating with
    `spec` or not: decode rate from the first token to the last, tokens, acceptance."""
    llm.speculative = spec
    session = llm.chat_session(SamplingParams(temperature=0, max_tokens=n))
    turn = session.send(text)
    list(turn)
    acceptance = session.engine.stats.spec.acceptance
    out = turn.output
    return out.metrics.decode_tokens_per_s, out.outputs[0].token_ids, acceptance


def llama_rate(model: str, prompt_text: str, n: int, lookup: bool) -> float:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=5) if lookup else None
    llm = Llama(model, n_ctx=2048, n_threads=2, verbose=False, draft_model=draft)
    messages = [{"role": "user", "content": prompt_text}]
    first = last = None
    count = 0
    for chunk in llm.create_chat_completion(messages, temperature=0, max_tokens=n,
                                            stream=True):  # fmt: skip
        if chunk["choices"][0]["delta"].get("content"):
            now = time.perf_counter()
            first = first or now
            last = now
            count += 1
    return (count - 1) / (last - first) if count > 1 and last > first else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-draft", type=int, default=8)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--chat", action="store_true",
                    help="kvlm's rows: one turn of a conversation on its own cache (kvlm chat "
                    "--speculative), not a request in the engine")  # fmt: skip
    ap.add_argument("--exact", action="store_true",
                    help="the fp32 reference path, with self-speculation (the same file's "
                    "native low-bit weights drafting) beside prompt lookup")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(args.model, progress=False, max_context=2048, exact=args.exact)
    path = args.model or str(default_model_path())
    specs = {"ngram": SpeculativeConfig(num_draft=args.num_draft)}
    if args.exact:
        specs["self (native draft)"] = SpeculativeConfig("draft", num_draft=4,
                                                         draft_weights="native")  # fmt: skip
    try:
        import llama_cpp  # noqa: F401

        peer = not args.no_llama
    except ImportError:
        peer = False
    print(f"model {path}, {args.tokens} tokens, greedy, medians of {args.rounds}"
          + (", --exact" if args.exact else "") + (", --chat" if args.chat else ""))  # fmt: skip
    head = "".join(f" kvlm {k} tok/s | x | acceptance |" for k in specs)
    print("| prompt | kvlm plain tok/s |" + head
          + (" llama.cpp tok/s | llama.cpp lookup tok/s | x |" if peer else ""))  # fmt: skip
    print("| --- | ---: |" + " ---: | ---: | ---: |" * len(specs)
          + (" ---: | ---: | ---: |" if peer else ""))  # fmt: skip
    for name, text in PROMPTS.items():
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": text}])
        plain: list[float] = []
        lp: list[float] = []
        ll: list[float] = []
        fast: dict[str, list[float]] = {k: [] for k in specs}
        acc: dict[str, list[float]] = {k: [] for k in specs}
        for _ in range(args.rounds):
            if args.chat:

                def rate(spec, text=text):
                    return chat_rate(llm, text, args.tokens, spec)
            else:

                def rate(spec, ids=ids):
                    return kvlm_rate(llm, ids, args.tokens, spec)

            r0, t0, _ = rate(None)
            plain.append(r0)
            for key, spec in specs.items():
                r1, t1, a1 = rate(spec)
                assert t0 == t1, f"{name}: {key} output differs from plain"
                fast[key].append(r1)
                acc[key].append(a1)
            if peer:
                lp.append(llama_rate(path, text, args.tokens, False))
                ll.append(llama_rate(path, text, args.tokens, True))
        p = statistics.median(plain)
        row = f"| {name} | {p:.1f} |"
        for key in specs:
            f = statistics.median(fast[key])
            row += f" {f:.1f} | {f / p:.2f} | {statistics.median(acc[key]):.2f} |"
        if peer:
            a, b = statistics.median(lp), statistics.median(ll)
            row += f" {a:.1f} | {b:.1f} | {b / a:.2f} |"
        print(row)


if __name__ == "__main__":
    main()
