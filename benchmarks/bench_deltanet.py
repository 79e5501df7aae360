"""Qwen3.5's gated DeltaNet (BENCHMARKS 24.4), two measurements, run alone on an idle box:

1. `kernel`: kvlm_gated_delta (kernels/deltanet.c) against the torch road it replaced on
   the CPU (the same token loop in torch ops), one layer of a Qwen3.5-0.8B-like shape (16
   q/k and 16 v heads of 128), T tokens through each; five interleaved rounds, medians.
2. `turns`: a chat's second turn through the engine's pool on random weights of that shape
   (hidden 1,024, 24 layers of which 18 gated DeltaNets; written once to FOLDER): its time
   to first token on a fresh pool (the whole conversation prefilled) and on the pool that
   ran the first turn (a prefix hit: the state snapshot restored), the same token both ways.
3. `system`: a conversation of TURNS turns after a SYSTEM-token system prompt on a GGUF
   file (llama.cpp's converter's), kvlm's engine pool (as `kvlm serve` keeps it) against
   llama-cpp-python's `Llama` (one object: its own prompt reuse, `generate`'s longest
   prefix) on the same token ids (kvlm's greedy replies: kvlm computes its own, llama.cpp
   evaluates them untimed, as had it generated them; each prompt ends in an opener the
   next turn drops, as a think-off template's, kvlm told where it began as the server
   tells it), each turn's time to first token, interleaved turn by turn; then kvlm's last
   turn cold on a fresh pool.

    python benchmarks/bench_deltanet.py kernel
    python benchmarks/bench_deltanet.py turns --first 1000 --folder /tmp/q35-08
    python benchmarks/bench_deltanet.py system --gguf q35-08-q8_0.gguf --system 6000 --turns 6

4. `steps`: a decode step after a CONTEXT-token prompt on a GGUF file (one contiguous cache,
   the prompt in one step), its time (the median of 7 rounds of 10 steps; several
   contexts, each on a cache of its own, take turns round by round, each against the
   first) and on the torch step its time by module (forward hooks on the recurrent
   layers, the attention layers and the MLPs), and the process's peak RSS after the
   prompts; `--kv-dtype` the cache's storage.

    python benchmarks/bench_deltanet.py steps --gguf q35-08-q4_k_m.gguf --context 512,16384

5. `drafts`: after a 512-token prompt on one contiguous cache (kept for a rollback of 8),
   a decode step of one row and a draft of 2 and of 4 rows (DraftBatch), each on the fused
   step and on the torch step in turn, each rolled back after, and the torch step keeping
   the states an MTP head drafts from (ModelRunner.keep_hidden); medians of 8
   (BENCHMARKS 24.10, 24.12).

    python benchmarks/bench_deltanet.py drafts --gguf q35-08-mtp-q8_0.gguf

6. `prefill`: a prompt of CONTEXT tokens on one contiguous cache, four times, the median
   of the last three (BENCHMARKS 24.13: the commits compared each in its own process).

    python benchmarks/bench_deltanet.py prefill --gguf q35-2b-q4_k_m.gguf --context 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import answer, fresh_engine, save_tiny_model
from kvlm import LLM, SamplingParams, kernels
from kvlm.cache.kinds import DELTA_CHUNK
from test_hostile_files import _delta_torch

NK = NV = 16
DK = DV = 128


def kernel() -> None:
    lib = kernels.library()
    if lib is None:
        raise SystemExit(kernels.status())
    C = 2 * NK * DK + NV * DV
    for T in (1, 64, 512):
        conv, z = torch.randn(T, C), torch.randn(T, NV * DV)
        b, a = torch.randn(T, NV), torch.randn(T, NV)
        a_log, dt, w = torch.randn(NV) * 0.5, torch.randn(NV) * 0.5, torch.rand(DV) + 0.5
        st, cu = torch.randn(1, NV, DK, DV) * 0.1, torch.tensor([0, T])

        win = torch.zeros(NV * (DELTA_CHUNK - 1) * (DK + DV + 2))  # no rows carried in
        first = torch.tensor([0])

        def ours(T=T, conv=conv, z=z, b=b, a=a, a_log=a_log, dt=dt, w=w, st=st, cu=cu,
                 win=win, first=first) -> None:  # fmt: skip
            s, out = torch.empty_like(st), torch.empty(T, NV * DV)  # the state: st's after
            rows = torch.empty_like(win)
            assert lib.kvlm_gated_delta(
                conv.data_ptr(), conv.numel(), z.data_ptr(), z.numel(), b.data_ptr(),
                b.numel(), a.data_ptr(), a.numel(), a_log.data_ptr(), dt.data_ptr(), NV,
                w.data_ptr(), DV, 1e-6, st.data_ptr(), s.data_ptr(), s.numel(),
                win.data_ptr(), rows.data_ptr(), rows.numel(), out.data_ptr(), out.numel(),
                cu.data_ptr(), 2, first.data_ptr(), 1, None, 0, None, 0, None, 0, 1, NK, NV,
                DK, DV) == 0  # fmt: skip

        def theirs(conv=conv, z=z, b=b, a=a, a_log=a_log, dt=dt, w=w, st=st) -> None:
            _delta_torch(conv[None], z[None], b[None], a[None], a_log, dt, w, 1e-6, st, NK, DK)

        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        n = max(3, 100 // T)
        for _ in range(5):
            for name, f in (("kernel", ours), ("torch", theirs)):
                f()
                t0 = time.perf_counter()
                for _ in range(n):
                    f()
                times[name].append((time.perf_counter() - t0) / n * 1e3)
        km, tm = statistics.median(times["kernel"]), statistics.median(times["torch"])
        flops = T * NV * DK * DV * 7 / km / 1e6
        print(f"T={T}: kernel {km:.2f} ms, torch {tm:.2f} ms, {tm / km:.1f}x; {flops:.1f} GFLOP/s")


def turns(first_tokens: int, folder: Path, rounds: int) -> None:
    if not (folder / "config.json").exists():
        D, A = "linear_attention", "full_attention"
        save_tiny_model(folder, "qwen3_5", seed=1, hidden_size=1024, num_hidden_layers=24,
                        layer_types=[D, D, D, A] * 6, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=256, intermediate_size=3584,
                        linear_num_key_heads=NK, linear_num_value_heads=NV,
                        linear_key_head_dim=DK, linear_value_head_dim=DV,
                        linear_conv_kernel_dim=4)  # fmt: skip
    llm = LLM(model=folder, kv="paged", progress=False, max_context=4096)
    g, vocab = torch.Generator().manual_seed(0), llm.config.vocab_size
    first = torch.randint(10, vocab - 10, (first_tokens,), generator=g).tolist()
    reply_params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(engine, ids):
        t = time.perf_counter()
        out, cached = answer(engine, ids, one)
        return time.perf_counter() - t, out, cached

    cold_t, hit_t = [], []
    for r in range(rounds):
        engine = fresh_engine(llm)
        reply, _ = answer(engine, first, reply_params)
        second = first + reply + torch.randint(10, vocab - 10, (24,), generator=g).tolist()
        ht, hout, cached = ttft(engine, second)
        ct, cout, cold = ttft(fresh_engine(llm), second)
        assert hout == cout and cold == 0, (hout, cout, cold)
        hit_t.append(ht)
        cold_t.append(ct)
        print(f"round {r}: second turn {len(second)} tokens: cold {ct:.2f} s, hit {ht:.3f} s "
              f"({cached} cached)", flush=True)  # fmt: skip
    cm, hm = statistics.median(cold_t), statistics.median(hit_t)
    print(f"median cold {cm:.2f} s, hit {hm:.3f} s, {cm / hm:.1f}x")


def system(path: Path, system_tokens: int, turns: int, threads: int) -> None:
    import llama_cpp

    llm = LLM(model=path, kv="paged", progress=False, max_context=system_tokens + 1024,
              threads=threads)  # fmt: skip
    peer = llama_cpp.Llama(str(path), n_ctx=system_tokens + 1024, n_threads=threads,
                           n_batch=512, verbose=False)  # fmt: skip
    g, vocab = torch.Generator().manual_seed(0), llm.config.vocab_size

    def words(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    # each turn's prompt ends in a generation prompt's opener that the next turn renders the
    # reply without (an empty think block, as Qwen 3.5's template with thinking off): the
    # next prompt parts from the last one where that opener began (its turn start)
    opener, reply_params = words(6), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine = fresh_engine(llm)
    base, ours, theirs = words(system_tokens), [], []
    for turn in range(turns):
        base += words(40)  # the user's message
        prompt = base + opener
        t = time.perf_counter()
        _, cached = answer(engine, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                           turn_start=len(base))  # fmt: skip
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        next(iter(peer.generate(prompt, temp=0.0)))  # its first token, its own reuse
        theirs.append(time.perf_counter() - t)
        print(f"turn {turn + 1}: {len(prompt)} tokens: kvlm {ours[-1]:.2f} s ({cached} cached), "
              f"llama.cpp {theirs[-1]:.2f} s", flush=True)  # fmt: skip
        reply = answer(engine, prompt, reply_params, turn_start=len(base))[0]  # kvlm's own,
        peer.eval(reply)  # llama.cpp the same tokens (as had it generated them), untimed
        base += reply
    t = time.perf_counter()
    answer(
        fresh_engine(llm), base[: -reply_params.max_tokens] + opener, SamplingParams(max_tokens=1)
    )
    cold = time.perf_counter() - t
    print(f"turns 2-{turns}: kvlm {sum(ours[1:]):.2f} s, llama.cpp {sum(theirs[1:]):.2f} s "
          f"({sum(ours[1:]) / sum(theirs[1:]):.3f}x); kvlm's last turn {ours[-1]:.2f} s, cold "
          f"{cold:.2f} s ({ours[-1] / cold:.1%})")  # fmt: skip


def steps(path: Path, contexts: list[int], kv_dtype: str | None, threads: int) -> None:
    import collections
    import resource
    import statistics

    from kvlm.engine.runner import CacheBatch

    extra = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
    llm = LLM(model=path, kv="contiguous", progress=False, max_context=max(contexts) + 256,
              threads=threads, **extra)  # fmt: skip
    vocab = llm.config.vocab_size
    caches = {}
    for context in contexts:  # each prompt on a cache of its own, one step each
        cache = caches[context] = llm.new_cache()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, vocab - 10, (context,), generator=g)
        llm.runner.run(CacheBatch([ids.tolist()], cache, prompt=True))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    spent, began = collections.Counter(), {}
    for block in llm.model.layers:
        for name in ("recurrent", "attn", "mlp"):
            module = getattr(block, name, None)
            if module is not None:
                module.register_forward_pre_hook(
                    lambda m, a, name=name: began.__setitem__(name, time.perf_counter())
                )
                module.register_forward_hook(lambda m, a, o, name=name: spent.update(
                    {name: time.perf_counter() - began[name]}))  # fmt: skip
    for cache in caches.values():
        for _ in range(3):
            llm.runner.forward([200], cache)
    spent.clear()
    rounds: dict[int, list[float]] = {c: [] for c in contexts}
    for _ in range(ROUNDS):  # the contexts take turns: 10 steps each a round
        for context, cache in caches.items():
            t = time.perf_counter()
            for _ in range(10):
                llm.runner.forward([200], cache)
            rounds[context].append((time.perf_counter() - t) / 10 * 1000)
    parts = ", ".join(f"{k} {v / (10 * ROUNDS * len(contexts)) * 1000:.2f}"
                      for k, v in spent.most_common())  # fmt: skip
    base = statistics.median(rounds[contexts[0]])
    for context in contexts:
        step = statistics.median(rounds[context])
        print(f"context {context}: a decode step {step:.2f} ms ({step / base:.3f}x "
              f"context {contexts[0]}'s) on the {llm.describe()['decode_step']}")  # fmt: skip
    print(f"({parts or 'one C call'}); peak RSS after the prompts {peak:,.0f} MiB")


ROUNDS = 7  # steps' rounds


def drafts(path: Path, threads: int) -> None:
    from kvlm import LLM
    from kvlm.engine.runner import CacheBatch, DraftBatch

    torch.set_num_threads(threads)
    llm = LLM(model=str(path), progress=False)
    runner, cache = llm.runner, llm.new_cache("contiguous")
    cache.hold_rollback(8)
    runner.run(CacheBatch([list(range(1000, 1512))], cache, prompt=True))

    def timed(fn, n: int = 8) -> float:
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    def one() -> None:
        runner.run(CacheBatch([[5]], cache, prompt=False))
        cache.rollback(1)

    def draft(n: int):
        def run() -> None:
            runner.run(DraftBatch([5] * n, cache))
            cache.rollback(n)

        return run

    steps = {"fused": None, "torch": "off for the measurement"}
    for road, off in steps.items():  # each road's rows, interleaved round by round
        runner.fused_reason = off
        print(f"{road}, 1 row: {timed(one):.1f} ms ({runner.decode_step(cache)})")
    for n in (2, 4):
        for road, off in steps.items():
            runner.fused_reason = off
            print(f"{road}, draft of {n} rows: {timed(draft(n)):.1f} ms")
    runner.keep_hidden = True
    print(f"torch, 1 row, keep_hidden: {timed(one):.1f} ms")


def prefill(path: Path, tokens: int, threads: int) -> None:
    from kvlm.engine.runner import CacheBatch

    torch.set_num_threads(threads)
    llm = LLM(model=str(path), progress=False)
    ids = [1000 + (i * 7) % 5000 for i in range(tokens)]
    times = []
    for _ in range(4):
        cache = llm.new_cache("contiguous")
        t0 = time.perf_counter()
        llm.runner.run(CacheBatch([ids], cache, prompt=True))
        times.append(time.perf_counter() - t0)
    print(f"prefill of {tokens}: median {statistics.median(times[1:]) * 1e3:.0f} ms "
          f"(each: {', '.join(f'{t * 1e3:.0f}' for t in times)})")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["kernel", "turns", "system", "steps", "drafts", "prefill"])
    p.add_argument(
        "--context",
        default="4096",
        help="steps: the prompt's tokens (several, comma-separated: taking turns)",
    )
    p.add_argument("--kv-dtype", default=None, help="steps: the cache's storage")
    p.add_argument("--gguf", type=Path, help="system: the model file")
    p.add_argument("--system", type=int, default=6000, help="system: its prompt's tokens")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--first", type=int, default=1000, help="the first turn's tokens")
    p.add_argument("--folder", type=Path, default=Path("/tmp/q35-08"))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.what == "kernel":
        kernel()
    elif args.what == "steps":
        steps(args.gguf, [int(c) for c in args.context.split(",")], args.kv_dtype, args.threads)
    elif args.what == "drafts":
        drafts(args.gguf, args.threads)
    elif args.what == "prefill":
        prefill(args.gguf, int(args.context), args.threads)
    elif args.what == "system":
        system(args.gguf, args.system, args.turns, args.threads)
    else:
        turns(args.first, args.folder, args.rounds)


if __name__ == "__main__":
    main()
