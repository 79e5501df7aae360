"""How faithful kvlm's fast path is to the fp32 reference, against llama.cpp on the same file,
over kvlm's 216 fidelity prompts (kvlm.bench.prompts: nine kinds, 24 each), in one run.

    python benchmarks/bench_fidelity.py [--model FILE] [--tokens 24] [--threads 2]
        [--runs "defaults;activations fp32;..."] [--no-llamacpp]

Every engine answers each prompt (the chat template's token ids, the same ids for all)
greedily, alone, up to --tokens tokens or the end-of-sequence token. Each answer is held
to the reference's (kvlm --exact: weights dequantized to fp32, fp32 activations and prompt
products, fp32 K/V): the first token, the whole answer, and teacher-forced agreement (the
reference's argmax on the answer's own prefix, one no-cache forward per answer: a
divergence does not cascade). kvlm's runs pull its numerics apart one at a time, to find
which rounding loses agreement: decode activations (int8 per group of 32 with VNNI; int16,
int8 codes and an int8 residual), the
prompt's products (bf16 with AMX, int8 with VNNI), the K/V dtype (fp16).
"""

from __future__ import annotations

import argparse
import json
import time

from kvlm import LLM
from kvlm.bench.prompts import KINDS, fidelity_prompts
from kvlm.engine.verify import compare, greedy_answers
from kvlm.model.attention import Attention
from kvlm.model.fused import block_products

PRODUCTS = ("qkv", "o_proj", "gate_up", "down")  # block_products' order, as runs name them

RUNS = {
    "defaults": {},
    "activations fp32": {"activations": "fp32"},
    "activations int16": {"activations": "int16"},
    "activations int8": {"activations": "int8"},
    # int16 on some products, int8 on the others (what each product's rounding costs)
    "activations int16 on gate|up": {"activations": "int16", "int16_products": ("gate_up",)},
    "activations int16 on qkv, o, down": {
        "activations": "int16",
        "int16_products": ("qkv", "o_proj", "down"),
    },
    "prompt products fp32": {"prefill_dtype": "fp32"},
    "prompt products int8": {"prefill_dtype": "int8"},
    "prompt products bf16": {"prefill_dtype": "bf16"},
    "K/V fp32": {"kv_dtype": "fp32"},
    # the prompt's attention in bf16 (fp32) for every row whatever its products (by
    # default: bf16 with bf16 products; with int8 ones from 2,048 keys where the CPU
    # multiplies bf16, kvlm.defaults.LONG_ATTENTION)
    "prompt attention bf16": {"prompt_attention": "bf16"},
    "prompt attention fp32": {"prompt_attention": "fp32"},
    "native weights, the rest fp32": dict(
        activations="fp32", prefill_dtype="fp32", kv_dtype="fp32"
    ),
}


def llamacpp_answers(path: str, prompts: list[list[int]], n: int, threads: int,
                     eos: set[int]) -> list[list[int]]:  # fmt: skip
    from llama_cpp import Llama

    model = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                  verbose=False)  # fmt: skip
    out = []
    for ids in prompts:
        answer: list[int] = []
        for token in model.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            answer.append(int(token))
            if token in eos or len(answer) >= n:
                break
        out.append(answer)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", default=None, help=f"names separated by ; (of: {'; '.join(RUNS)})")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    runs = list(RUNS) if args.runs is None else [r.strip() for r in args.runs.split(";")]
    common = {"model": args.model, "threads": args.threads, "max_context": 1024,
              "progress": False}  # fmt: skip
    reference = LLM(**common, exact=True)
    path = str(reference.loaded.path)
    texts = fidelity_prompts()
    prompts = [reference.encode(t, chat=True) for t in texts]
    n = args.tokens
    start = time.perf_counter()
    expected = greedy_answers(reference, prompts, n)
    took = time.perf_counter() - start
    print(f"{reference.model_name}: {len(prompts)} prompts, answers of up to {n} tokens; "
          f"the reference's answers in {took:.0f} s", flush=True)  # fmt: skip
    results = {}
    for name in runs:
        settings = dict(RUNS[name])
        attention = settings.pop("prompt_attention", None)
        fine = settings.pop("int16_products", None)
        llm = LLM(**common, **settings)
        if fine is not None:  # the fused step reads them every step
            for block in llm.model.layers:
                for product, lin in zip(PRODUCTS, block_products(block), strict=True):
                    lin.act_int16 = product in fine
        layers = [m for m in llm.model.modules() if isinstance(m, Attention)]
        if attention is not None:  # "bf16": every prompt row; "fp32": none
            for m in layers:
                m.prompt_bf16_from = 0 if attention == "bf16" else None
        num = llm.numerics
        answers = greedy_answers(llm, prompts, n)
        at = layers[0].prompt_bf16_from
        rounded = "fp32" if at is None else "bf16" if at == 0 else f"bf16 from {at:,} keys"
        results[name] = (compare(reference, prompts, expected, answers, n),
                         f"{num.activations} / {num.prefill_dtype} (attention {rounded}) / "
                         f"{num.kv_dtype}")  # fmt: skip
        print(name, results[name][0].to_dict() | {"differing": None}, flush=True)
        del llm
    if not args.no_llamacpp:
        eos = set(reference.tokenizer.eos_token_ids)
        answers = llamacpp_answers(path, prompts, n, args.threads, eos)
        results["llama.cpp"] = (compare(reference, prompts, expected, answers, n), "its own")
        print("llama.cpp", results["llama.cpp"][0].to_dict() | {"differing": None}, flush=True)
    per = len(prompts) // len(KINDS)
    head = ("| run | activations / prompt products / K/V | first token | whole answer | "
            "teacher-forced | worst rank | " + " | ".join(KINDS) + " |")  # fmt: skip
    print("\n" + head)
    print("| --- | --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(KINDS))
    for name, (r, numerics) in results.items():
        kinds = [per - sum(k * per <= i < (k + 1) * per for i in r.differing)
                 for k in range(len(KINDS))]  # fmt: skip
        print(f"| {name} | {numerics} | {r.first_token:.1%} | {r.whole_answer:.1%} | "
              f"{r.forced_agreement:.2%} | {r.worst_rank} | "
              + " | ".join(f"{k}/{per}" for k in kinds) + " |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: r.to_dict() | {"numerics": num} for k, (r, num) in results.items()}, f)


if __name__ == "__main__":
    main()
