"""A GGUF's load time, RSS and decode in a fresh process (NOTES-moe item 2): `rows` as kvlm
loads it (Q8_0 expert stacks in place, quant.ROWS_KIND), `packed` with those experts
packed as q8 (the loader's road before), `llama` through llama-cpp-python where installed.
LLM(model=FILE, threads=2), then 64 greedy tokens after "a b c" twice, the second timed.

    PYTHONPATH=src python benchmarks/bench_load_in_place.py FILE rows
"""

import resource
import sys
import time


def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) // 1024
    return out


path, mode = sys.argv[1], sys.argv[2]
assert mode in ("rows", "packed", "llama"), mode
if mode == "llama":
    import llama_cpp

    base = status()
    t = time.perf_counter()
    m = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, verbose=False)
    load = time.perf_counter() - t
    after = status()
    t = time.perf_counter()
    out = m("a b c", max_tokens=64, temperature=0)
    n = out["usage"]["completion_tokens"]
    dec = n / (time.perf_counter() - t)
else:
    from kvlm import LLM, SamplingParams
    from kvlm.model import quant

    if mode == "packed":  # the loader's road before: every expert packed as q8
        import kvlm.model.transformer as T

        each = T._WeightTaker._each_expert

        def packed(self, name, count):
            return [
                quant.Blocks("q8", b.raw) if getattr(b, "kind", None) == quant.ROWS_KIND else b
                for b in each(self, name, count)
            ]

        T._WeightTaker._each_expert = packed
    base = status()
    t = time.perf_counter()
    llm = LLM(model=path, threads=2, progress=False)
    load = time.perf_counter() - t
    after = status()
    kinds = {p.kind for e in llm.model.layers[0].mlp.experts for p in e.down.quant.parts()}
    p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate("a b c", p)
    t = time.perf_counter()
    out = llm.generate("a b c", p)[0]
    dec = len(out.outputs[0].token_ids) / (time.perf_counter() - t)
    print("kinds", kinds)
end = status()
print(
    f"{mode}: load {load:.2f} s; RSS before load {base['VmRSS']} MiB, after load "
    f"{after['VmRSS']} MiB (anon {after['RssAnon']}, file {after['RssFile']}), peak by then "
    f"{after['VmHWM']} MiB; after decode {end['VmRSS']} MiB (anon {end['RssAnon']}, file "
    f"{end['RssFile']}), peak {end['VmHWM']} MiB; decode {dec:.1f} tok/s (64 tokens, incl. "
    f"the prompt) ; ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB"
)
