"""Per-token cost of grammar-constrained decoding on this CPU: llguidance vs xgrammar.

For a JSON schema (and json_object), each library compiles the grammar for the model's
tokenizer, then a valid instance is walked token by token: at every step the library
fills the allowed-token bitmask, then accepts the token. Reported: compile time, and the
median / p90 mask time per token (the part on the decode step's critical path).

    python benchmarks/bench_grammar.py [--model FILE] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@analytical.org",
    "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"},
    "active": True,
}  # fmt: skip


def hf_tokenizer(model: str | None):
    from transformers import PreTrainedTokenizerFast

    from kvlm import LLM

    tok = LLM(model, progress=False, max_context=64).tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)


def walk(fill, accept, ids) -> list[float]:
    times = []
    for t in ids:
        s = time.perf_counter()
        fill()
        times.append(time.perf_counter() - s)
        accept(t)
    return times


def bench_llguidance(hf, ids, schema):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    s = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    setup = time.perf_counter() - s
    s = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - s
    assert not matcher.get_error(), matcher.get_error()
    bm = lt.allocate_token_bitmask(1, tok.vocab_size)
    times = walk(lambda: lt.fill_next_token_bitmask(matcher, bm, 0),
                 lambda t: matcher.consume_token(t), ids)  # fmt: skip
    assert not matcher.get_error(), matcher.get_error()
    return setup, compile_s, times


def bench_xgrammar(hf, ids, schema):
    import xgrammar as xgr

    s = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    setup = time.perf_counter() - s
    s = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - s
    bm = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = walk(lambda: matcher.fill_next_token_bitmask(bm), matcher.accept_token, ids)
    return setup, compile_s, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    hf = hf_tokenizer(args.model)
    print(f"vocabulary {len(hf)}")
    for label, schema in (("json_schema", SCHEMA), ("json_object", {"type": "object"})):
        ids = hf.encode(json.dumps(INSTANCE), add_special_tokens=False)
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            per, comp, setups = [], [], []
            for _ in range(args.reps):  # the libraries take turns, each rep fresh
                setup, c, times = fn(hf, ids, schema)
                per += times
                comp.append(c)
                setups.append(setup)
            per.sort()
            print(
                f"{label:12} {name:10} tokenizer setup {statistics.median(setups) * 1e3:7.1f} ms"
                f"  compile {statistics.median(comp) * 1e3:7.1f} ms"
                f"  mask median {statistics.median(per) * 1e6:6.1f} us"
                f"  p90 {per[int(0.9 * len(per))] * 1e6:6.1f} us  ({len(ids)} tokens)"
            )


if __name__ == "__main__":
    main()
