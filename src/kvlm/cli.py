"""The `kvlm` command: parse, call the library, print. User mistakes end in one line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvlm.errors import InvalidRequestError, KvlmError
from kvlm.settings import kv_dtype_of, model_from_args, speculative_from_args, table

EXIT_USER_ERROR = 2
# Spelled out rather than imported from kvlm.cache, which pulls in torch: `kvlm --help`
# stays instant. tests/test_cli.py checks it names every mode the factory knows.
KV_HELP = "cache mode: off, basic, contiguous (default), paged, int8, window"
KV_DTYPE_HELP = "cache storage: fp32, bf16, fp16, int8, q4 (4-bit codes, a scale per 32)"
K_DTYPE_HELP = "K's storage alone (over --kv-dtype; as llama.cpp's -ctk)"
V_DTYPE_HELP = "V's storage alone (over --kv-dtype; as llama.cpp's -ctv)"
MODEL_HELP = "GGUF file, HF folder or Hub id (default: SmolLM2-135M)"
VERIFY_PROMPT = "Explain what a KV cache is and why it makes text generation faster."


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KvlmError as exc:
        print(f"kvlm: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvlm generate ... | head`
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlm", description="A Python LLM inference engine built around the KV cache."
    )
    parser.add_argument("--version", action="version", version=f"kvlm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (_generate_parser, _chat_parser, _verify_parser, _memory_parser,
                    _serve_parser, _bench_parser, _inspect_parser):  # fmt: skip
        command(sub)
    return parser


def _version() -> str:
    """The installed distribution's version (the package's metadata: no torch import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvlm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _generate_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", nargs="?", default="-", help="the prompt ('-' or none: stdin)")
    _model_args(gen)
    _cache_args(gen)
    _sampling_args(gen, temperature=0.0)
    gen.add_argument("-n", "--n", type=int, default=1, help="samples from one prefill")
    _speculative_args(gen)
    _session_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")


def _chat_parser(sub: Any) -> None:
    chat = sub.add_parser("chat", help="an interactive conversation that keeps its KV cache")
    _model_args(chat)
    _cache_args(chat)
    _sampling_args(chat, temperature=0.7)
    _session_args(chat)
    _speculative_args(chat)


def _verify_parser(sub: Any) -> None:
    verify = sub.add_parser(
        "verify",
        help="greedy agreement and logit drift of a cache mode against --kv off, or "
        "of the numerics against the fp32 reference over a prompt set (--against exact)",
    )
    verify.add_argument("prompt", nargs="?", default=VERIFY_PROMPT,
                        help="the prompt (default: a question about KV caches)")  # fmt: skip
    _model_args(verify)
    _cache_args(verify)
    verify.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="greedy tokens to compare (default: 64; 24 with --against exact)",
    )
    verify.add_argument("--against", choices=("off", "exact"), default="off",
                        help="off (default): the cache mode against --kv off, same numerics; "
                        "exact: this model's numerics (the flags, or the defaults) against the "
                        "fp32 reference (--exact) over a prompt set: how often the first "
                        "token and the whole greedy answer are the reference's")  # fmt: skip
    verify.add_argument("--prompts", type=int, default=48,
                        help="with --against exact: how many of kvlm's 216 fidelity prompts "
                        "(nine kinds, taken evenly; default 48)")  # fmt: skip
    verify.add_argument(
        "--prompts-file",
        default=None,
        help="with --against exact: the prompts instead, one per line",
    )
    verify.add_argument("--json", action="store_true", help="print the result as JSON")


def _memory_parser(sub: Any) -> None:
    memory = sub.add_parser("memory", help="KV cache bytes for a model, context and batch")
    memory.add_argument("--model", help=MODEL_HELP + "; a folder of config.json alone "
                        "(the weights not downloaded yet) plans too")  # fmt: skip
    memory.add_argument("--context", type=int, default=None, help="tokens per sequence")
    memory.add_argument("--batch", type=int, default=1, help="sequences")
    memory.add_argument("--kv", default="contiguous", help=KV_HELP)
    memory.add_argument("--kv-dtype", default=None,
                        help="fp32, bf16, fp16, int8 or q4 (default: what kvlm generate "
                        "stores this model's K/V in, kvlm.defaults: fp16 for a low-bit GGUF "
                        "where the C kernels run, else --dtype)")  # fmt: skip
    memory.add_argument("--k-dtype", default=None, help=K_DTYPE_HELP)
    memory.add_argument("--v-dtype", default=None, help=V_DTYPE_HELP)
    memory.add_argument("--dtype", default="fp32", help="weights dtype, for the budget")
    memory.add_argument(
        "--budget", default=None,
        help="memory for the cache (default: free RAM, or the GPU's free memory with --device)",
    )  # fmt: skip
    memory.add_argument("--device", default="cpu", help="cpu or cuda: whose free memory")
    memory.add_argument("--cpu-experts", default="0", metavar="N",
                        help="the routed experts of the first N expert layers in host memory "
                        "(as kvlm generate --cpu-experts): left out of the device's weights "
                        "and budget, said apart")  # fmt: skip
    _size_args(memory)
    memory.add_argument("--json", action="store_true", help="print the table as JSON")
    memory.add_argument("--plot", metavar="OUT.png",
                        help="draw the bytes by mode and dtype (matplotlib)")  # fmt: skip


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for many clients")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument(
        "--api-key", default=os.environ.get("KVLM_API_KEY"), help="require this bearer key"
    )
    serve.add_argument("--served-model-name", default=None, help="the model id clients use")
    _speculative_args(serve)
    serve.add_argument(
        "--tool-call-parser", choices=("hermes", "llama3_json", "harmony"), default=None,
        help="the model's tool-call format (default: read off its chat template)",
    )  # fmt: skip
    serve.add_argument(
        "--reasoning-parser", choices=("auto", "none", "qwen3", "deepseek_r1", "harmony"),
        default="auto",
        help="split reasoning out of replies into reasoning_content (auto: <think> text when "
        "the chat template writes </think>, the analysis channel of a harmony template)",
    )  # fmt: skip
    _serve_sampling_args(serve)
    _pool_args(serve)
    _limit_args(serve)
    _replica_args(serve)


def _serve_sampling_args(serve: argparse.ArgumentParser) -> None:
    """The sampling of a request's unset fields (kvlm.server.defaults): over the model
    file's recommendation, under the request's own."""
    _flags(serve,
        ("--temperature", float, None, "the temperature of requests that set none (default: "
         "the model file's recommendation, else the API's: 1; 0 = greedy)", {"metavar": "T"}),
        ("--top-p", float, None, "the top_p of requests that set none (default: the file's, "
         "else 1)", {"metavar": "P"}),
        ("--top-k", int, None, "the top_k of requests that set none (default: the file's, "
         "else off; <= 0 = off)", {"metavar": "K"}),
        ("--min-p", float, None, "the min_p of requests that set none (default: the file's, "
         "else 0)", {"metavar": "P"}),
        ("--repeat-penalty", float, None, "the repetition_penalty of requests that set none "
         "(default: the file's, else 1 = off)", {"metavar": "R"}),
    )  # fmt: skip


def _pool_args(serve: argparse.ArgumentParser) -> None:
    """The engine's KV pool, its scheduler and the tiers below it."""
    _flags(serve,
        ("--kv-dtype", None, None, KV_DTYPE_HELP),
        ("--k-dtype", None, None, K_DTYPE_HELP),
        ("--v-dtype", None, None, V_DTYPE_HELP),
        ("--max-context", int, None, "tokens per sequence"),
        ("--block-size", int, 16, "tokens per KV block"),
        ("--kv-blocks", int, None, "blocks in the KV pool"),
        ("--kv-memory", None, None, "KV pool size when --kv-blocks is unset (default: 1GiB; on "
         "a GPU, 90%% of its free memory once the model is loaded)"),
        ("--snapshot-share", float, None, "a model with recurrent layers (a gated DeltaNet's "
         "or a Mamba2 state): the share of --kv-memory kept for snapshots of their state at "
         "block ends, where prefix hits resume (default 0.25; 0: no prefix hits on such a "
         "model)"),
        ("--max-num-seqs", int, 16, "sequences decoded together"),
        ("--max-waiting", int, 64, "queued requests before 503"),
        ("--prefill-chunk", int, 256, "prompt tokens per step"),
        ("--step-time", float, 0.5, "while streams decode, a step takes only the prompt tokens "
         "that fit in this many seconds, as measured (at least 32); 0: --prefill-chunk always"),
    )  # fmt: skip
    serve.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV blocks of prompts seen before (default: on)",
    )  # fmt: skip
    _flags(serve,
        ("--kv-tier", None, [], "a KV tier below the pool, asked in order (repeatable): "
         "disk:PATH[:SIZE] (default size 10GiB) or redis://HOST:PORT[?ttl=SECONDS]; either "
         "with ?deadline=SECONDS for a whole lookup (default 1 disk, 0.5 Redis)",
         {"action": "append", "metavar": "SPEC"}),
        ("--kv-tier-key", None, None, "the key (a 0600 file of 16+ random bytes) that signs KV "
         "tier records: give every server that shares a tier the same one (default: a key "
         "made on first use in $XDG_STATE_HOME/kvlm/tier.key)", {"metavar": "FILE"}),
        ("--slot-save-path", None, None, "llama-server's: where POST /slots/ID?action=save "
         "writes a slot's file and restore reads it; the K/V go to a disk tier in DIR/kv "
         "(every sealed block, as --kv-tier disk:DIR/kv)", {"metavar": "DIR"}),
    )  # fmt: skip


def _limit_args(serve: argparse.ArgumentParser) -> None:
    """What one client may take of the server."""
    _flags(serve,
        ("--max-body", None, "4MiB", "largest request body; a larger one gets 413"),
        ("--idle-timeout", float, 30.0,
         "seconds a client has to send a request head, or the next piece of a body"),
        ("--max-connections", int, 512, "open connections; more get 503"),
        ("--engine-wait", float, 10.0,
         "seconds /v1/kv waits for the engine between two steps; longer gets 503"),
        ("--stream-ping", float, 5.0,
         "seconds a stream may wait for its next event (a long prefill) before a keep-alive "
         "is sent: Anthropic's ping event, an SSE comment on OpenAI's routes"),
    )  # fmt: skip
    serve.add_argument(
        "--public-metrics", action="store_true",
        help="serve /metrics without --api-key (for a Prometheus scraper)",
    )  # fmt: skip
    serve.add_argument(
        "--log-level", default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="info: each request, and each engine step longer than any before it (past 1 s)",
    )  # fmt: skip


def _replica_args(serve: argparse.ArgumentParser) -> None:
    """--replicas: engines behind one endpoint on Ray Serve."""
    _flags(serve,
        ("--replicas", int, 1, "engines behind the one endpoint, on Ray Serve (kvlm.cluster; "
         "default 1: this process alone); --threads is per replica (default: the cores over "
         "the replicas)"),
        ("--routing", None, "prefix", "--replicas: which replica takes a request (prefix: "
         "where its leading blocks are likely cached, within a bound on load)",
         {"choices": ("prefix", "round-robin")}),
        ("--route-blocks", int, 4, "--routing prefix: the leading KV blocks that key a request"),
        ("--route-balance", float, 1.25, "--routing prefix: a replica takes at most this times "
         "its fair share of the requests in flight before its prefixes spill to the next "
         "(>= 1; with 2 replicas, 2 lifts the bound)"),
        ("--ray-address", None, None, "--replicas: join this Ray cluster (auto, or HOST:PORT "
         "of `ray start --head`) instead of starting Ray here"),
    )  # fmt: skip


def _bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="kvlm vs transformers on the same model and prompts")
    _model_args(bench)
    bench.add_argument("--kv", default="contiguous", help="cache modes, comma-separated")
    _speculative_args(bench)
    _flags(bench,
        ("--prompts", None, None, "prompt lengths in tokens (default 128,512,2048; --suite: 512)"),
        ("--new-tokens", int, None, "tokens decoded per run (default 128; --suite: 64)"),
        ("--peers", None, "hf,hf-static,llama.cpp", "hf, hf-static, llama.cpp, or none"),
        ("--plots", None, None, "write PNG plots here (matplotlib); with --streams, "
         "block_map.png: the engine's KV pool at the busiest step of the most streams",
         {"metavar": "DIR"}),
        ("--rounds", int, None,
         "runs per cell (median; default 1; --suite: 3, the engines taking turns)"),
        ("--max-context", int, None, "cache capacity"),
        ("--kv-dtype", None, None, KV_DTYPE_HELP),
        ("--k-dtype", None, None, K_DTYPE_HELP),
        ("--v-dtype", None, None, V_DTYPE_HELP),
        ("--json", None, None, "write the results as JSON", {"metavar": "FILE"}),
        ("--streams", None, "1,2,4,8", "concurrent streams for the engine run, or none"),
        ("--suite", None, None, "the model set instead of one model: random-weight GGUFs of "
         "real shapes (written into DIR when absent) and the default model, kvlm with no "
         "flags against --peers (llama.cpp, hf), each engine alone in a fresh process",
         {"metavar": "DIR"}),
        ("--shapes", None, None, "--suite: shapes, comma-separated (kvlm.bench.models)"),
        ("--types", None, None, "--suite: file types, comma-separated (Q4_0,Q8_0,Q4_K_M)"),
    )  # fmt: skip


def _inspect_parser(sub: Any) -> None:
    inspect = sub.add_parser(
        "inspect", help="show a model's configuration and cache sizes, or a saved cache file"
    )
    what = inspect.add_mutually_exclusive_group()
    what.add_argument("--model", help=MODEL_HELP)
    what.add_argument("--cache", metavar="FILE", help="a cache file (--save-cache) instead")
    _flags(inspect,
        ("--plot", None, None, "--cache: draw it (matplotlib): K/V norms per layer and head, "
         "bytes by mode and dtype, and its mode's own panel (window ring, int8 scales, paged "
         "block map)", {"metavar": "OUT.png"}),
        ("--block-size", int, 16,
         "--cache, paged/int8: tokens per block of the pool it restores into (16)"),
    )  # fmt: skip
    inspect.add_argument("--json", action="store_true")


REFERENCE_HEADER = """# kvlm command reference

Every command and flag, as `kvlm COMMAND --help` prints them. Generated from the argument
parser; tests/test_cli.py fails when this file and the parser disagree. To regenerate:

    python -c "from kvlm.cli import reference; print(reference(), end='')" > docs/CLI.md

`kvlm --version` prints the installed version.
"""


def reference() -> str:
    """docs/CLI.md: each command's usage, description and flags (default, help) in
    Markdown, read off build_parser()."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = [REFERENCE_HEADER]
    for name, command in sub.choices.items():
        command.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=88)
        out += [
            f"## kvlm {name}",
            "",
            helps.get(name) or "",
            "",
            "```",
            command.format_usage().strip(),
            "```",
            "",
            *table("argument | default | what it does", "lll"),
        ]
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
            if action.metavar and action.option_strings:
                names += f" {action.metavar}"
            elif action.choices and action.option_strings:
                names += " {" + ",".join(str(c) for c in action.choices) + "}"
            hidden = action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0
            shown = "" if hidden else f"`{action.default}`"
            text = formatter._expand_help(action) if action.help else ""  # %(default)s, %%
            text = text.replace("|", "\\|").replace("\n", " ")
            out.append(f"| {names} | {shown} | {text} |")
        out.append("")
    return "\n".join(out)


def _flags(p: argparse.ArgumentParser, *rows: tuple) -> None:
    """add_argument for each row: (flag, type, default, help), then a dict of any other
    keywords (choices, metavar, action); a type of None keeps the value a string."""
    for flag, kind, default, text, *other in rows:
        p.add_argument(flag, type=kind, default=default, help=text, **dict(*other))


def _model_args(p: argparse.ArgumentParser) -> None:
    _flags(p,
        ("--model", None, None, MODEL_HELP),
        ("--dtype", None, "fp32", "compute dtype: fp32, bf16, fp16 (fp64: the reference)"),
        ("--weights", None, "auto", "projection weights: auto (default: native for a low-bit "
         "GGUF, else as --dtype), f32 (as --dtype), bf16, int8 or int4 (groups of 32), or "
         "native (a GGUF file's own low-bit blocks, multiplied as stored)"),
        ("--prefill-dtype", None, "auto", "with low-bit weights: auto (default: bf16 with AMX, "
         "else int8 with VNNI, else bf16 with AVX512-BF16), fp32 (exact), bf16 (prompt "
         "products in bf16 through oneDNN, and the prompt's attention in bf16) or int8 "
         "(prompt rows rounded to int8 per group of 32 as decode rows are, integer products "
         "from the packed blocks); agreement in docs/BENCHMARKS.md"),
        ("--activations", None, "auto", "with low-bit weights: auto (default: int16 where the "
         "CPU has VNNI), fp32 (exact), int16 (per-token products round activations per group "
         "of 32 to int8 codes and an int8 residual, two integer products) or int8 (int8 codes "
         "alone, as llama.cpp does: a little faster decode, less faithful); agreement in "
         "docs/BENCHMARKS.md"),
    )  # fmt: skip
    p.add_argument(
        "--exact", action="store_true",
        help="the fp32 reference path: weights dequantized to --dtype, fp32 activations and "
        "prompt products, the cache in --dtype (the defaults are the fast path: kvlm.defaults)",
    )  # fmt: skip
    _flags(p,
        ("--rope-scaling", None, None, "RoPE scaling for the context (default: the model "
         "file's own; past its trained context, yarn by --max-context / trained, said in one "
         "warning); none: unscaled, as llama.cpp runs it; linear or yarn in place of the "
         "file's", {"choices": ("none", "linear", "yarn")}),
        ("--rope-scale", float, None, "--rope-scaling linear/yarn: the factor (default: "
         "--max-context / the trained context, at least 1)", {"metavar": "F"}),
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps")
    p.add_argument(
        "--cpu-experts", default="0", metavar="N",
        help="keep the routed experts of the first N mixture-of-experts layers in host "
        "memory and run them on the CPU beside a GPU, as llama.cpp's --n-cpu-moe (the "
        "router, the shared expert and the rest stay on --device); all: every layer; "
        "0 (default): none",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--system", default=None, help="system prompt for the chat template")
    p.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True,
        help="apply the model's chat template (default: on when the model has one)",
    )  # fmt: skip


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv", default="contiguous", help=KV_HELP)
    p.add_argument("--kv-dtype", default=None, help=KV_DTYPE_HELP)
    p.add_argument("--k-dtype", default=None, help=K_DTYPE_HELP)
    p.add_argument("--v-dtype", default=None, help=V_DTYPE_HELP)
    p.add_argument("--max-context", type=int, default=None, help="cache capacity in tokens")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill N tokens at a time")
    _size_args(p)


def _size_args(p: argparse.ArgumentParser) -> None:
    _flags(p,
        ("--block-size", int, 16, "paged/int8: tokens per block"),
        ("--kv-blocks", int, None, "paged/int8: blocks in the pool"),
        ("--window", int, 256, "window: recent tokens kept"),
        ("--sinks", int, 4, "window: first tokens kept"),
        ("--window-positions", None, "cache", "window: RoPE positions counted inside the cache "
         "(default, StreamingLLM: streams run past the trained context) or absolute (the "
         "text's own, for comparison)", {"choices": ("cache", "absolute")}),
    )  # fmt: skip


def _sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--temperature", type=float, default=temperature, help=f"0 = greedy ({temperature})"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    p.add_argument("--logprobs", type=int, default=None, help="report top-N logprobs per token")


def _session_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-cache", metavar="FILE", help="save the conversation and its cache")
    p.add_argument("--load-cache", metavar="FILE", help="resume a conversation saved before")


def _speculative_args(p: argparse.ArgumentParser) -> None:
    _flags(p,
        ("--speculative", None, None, "speculative decoding: each sequence proposes tokens "
         "(ngram: by prompt lookup; draft: a draft model; mtp: the file's own "
         "multi-token-prediction head), the model checks them in one forward (greedy output "
         "unchanged)", {"choices": ("ngram", "draft", "mtp")}),  # speculative.METHODS
        ("--num-draft", int, 8, "the most tokens proposed per step (--speculative)"),
        ("--draft-model", None, None, "--speculative draft: a model file with the same "
         "tokenizer (default: this model's own file, at --draft-weights)"),
        ("--draft-weights", None, "auto", "the draft's weight format (auto, native, int8, "
         "int4, ...): a cheaper format of the same file is self-speculation"),
    )  # fmt: skip


def _load(args: argparse.Namespace, **settings: Any):
    """generate, chat, verify: every cache flag (_cache_args) applies."""
    from kvlm.llm import CacheOptions

    sizes = (args.block_size, args.kv_blocks, args.window, args.sinks, args.window_positions)
    options = CacheOptions(*sizes)
    return model_from_args(
        args, kv=args.kv, cache_options=options, prefill_chunk=args.prefill_chunk, **settings
    )


def _params(args: argparse.Namespace, n: int = 1):
    from kvlm.engine.sampling import SamplingParams

    names = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs")
    flags = {k: getattr(args, k) for k in names}
    return SamplingParams(max_tokens=args.max_new_tokens, n=n, **flags)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _params(args, n=args.n)  # validate before the slow load
    if params.n > 1 and (args.save_cache or args.load_cache):
        raise KvlmError("--save-cache/--load-cache continue one conversation: use -n 1")
    llm = _load(args, speculative=speculative_from_args(args))
    use_chat = _use_chat(args, llm)
    if args.save_cache or args.load_cache:
        session = _session(args, llm, params)
        turn = session.send(prompt)
    else:
        ids = llm.encode(prompt, chat=use_chat, system=args.system)
        turn = llm.stream(ids, params, prompt=prompt)
    _show(turn, not args.json)
    if args.save_cache:
        session.save(args.save_cache, llm.fingerprint)
    out, cache = turn.output, turn.engine.backend.cache
    if args.json:
        record = {
            **llm.describe(),
            **out.to_dict(),
            "chat_template": use_chat,
            "kv_bytes": cache.nbytes,
            "kv_bytes_used": cache.num_tokens * cache.batch * cache.spec.bytes_per_token,
        }
        if llm.speculative is not None:
            st, spec = turn.engine.stats.spec, llm.speculative
            record["speculative"] = {
                "method": spec.method, "num_draft": spec.num_draft, "drafted": st.drafted,
                "accepted": st.accepted, "acceptance": st.acceptance,
                "tokens_per_forward": st.tokens_per_forward}  # fmt: skip
        print(json.dumps(record))
        return 0
    print()
    for sample in out.outputs[1:]:
        print(f"--- sample {sample.index} ---\n{sample.text}")
    _summary(turn, llm, "this request")
    return 0


def _summary(turn: Any, llm: Any, scope: str) -> None:
    """The turn's line on stderr, and what the drafts did over `scope` where speculative."""
    out, cache, st = turn.output, turn.engine.backend.cache, turn.engine.stats.spec
    m = out.metrics
    reused = m.prompt_tokens - m.prefill_tokens
    print(
        f"[{sum(len(o.token_ids) for o in out.outputs)} tokens, {out.finish_reason}; "
        f"prefill {m.prefill_tokens} tokens (reused {reused}), TTFT {m.ttft_ms:.0f} ms; "
        f"decode {m.decode_tokens_per_s:.1f} tok/s; kv {llm.kv_mode} "
        f"{cache.nbytes / 2**20:.1f} MiB, {cache.num_tokens} tokens]",
        file=sys.stderr,
    )
    if llm.speculative is not None:
        print(
            f"[speculative {llm.speculative.method}: {st.accepted}/{st.drafted} drafted tokens "
            f"accepted ({st.acceptance:.0%}), {st.tokens_per_forward:.2f} tokens per checked "
            f"forward, {scope}]",
            file=sys.stderr,
        )


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _load(args, speculative=speculative_from_args(args))  # turns decode speculatively
    if args.chat and not _use_chat(args, llm):
        raise KvlmError("this model has no chat template; use `kvlm chat --no-chat`")
    session = _session(args, llm, params)
    print(f"kvlm chat: {llm.model_name} (kv {llm.kv_mode}). /help lists the commands.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        command = line.strip()
        if command in CHAT_EXIT:
            return 0
        if command == "/reset":
            session = _session(args, llm, params, load=False)
            print("(conversation cleared: the next message starts a new one)")
            continue
        if command == "/help" or (command.startswith("/") and command[1:].isalpha()):
            unknown = "" if command == "/help" else f"unknown command {command}; "
            print(f"({unknown}{CHAT_HELP})")
            continue
        if not command:
            continue
        turn = session.send(line)
        with contextlib.suppress(KeyboardInterrupt):  # stop this reply, keep the conversation
            _show(turn)
        print()
        _summary(turn, llm, "this conversation")
        if args.save_cache:
            session.save(args.save_cache, llm.fingerprint)


# `kvlm chat`'s own commands, never sent to the model ("/word": a command, known or not)
CHAT_EXIT = ("/exit", "/quit", "exit", "quit")
CHAT_HELP = (
    "/reset: forget the conversation and its cache; /exit, /quit, exit, quit or Ctrl-D: "
    "leave; /help: this; Ctrl-C: stop the reply being written"
)


def _use_chat(args: argparse.Namespace, llm: Any) -> bool:
    """--chat, where the model has a chat template."""
    return args.chat and llm.tokenizer.chat_template is not None


def _session(args: argparse.Namespace, llm: Any, params: Any, load: bool = True) -> Any:
    """A conversation in the chat template where _use_chat, resumed from --load-cache
    (unless not `load`: /reset starts an empty one)."""
    session = llm.chat_session(params, system=args.system, use_template=_use_chat(args, llm))
    if load and args.load_cache:
        session.load(args.load_cache, llm.fingerprint)
    return session


def _show(turn: Any, show: bool = True) -> None:
    """Run the turn, printing its text as it comes (unless not `show`)."""
    for delta in turn:
        if show:
            print(delta, end="", flush=True)


def cmd_verify(args: argparse.Namespace) -> int:
    from kvlm.engine.verify import verify_mode

    if args.max_new_tokens is None:
        args.max_new_tokens = 24 if args.against == "exact" else 64
    if args.max_new_tokens < 1:
        raise KvlmError("--max-new-tokens must be >= 1")
    if args.against == "exact":
        return _verify_numerics(args)
    llm = _load(args)
    ids = llm.encode(args.prompt, chat=_use_chat(args, llm), system=args.system)
    result = verify_mode(llm, ids, args.kv, args.max_new_tokens)
    first = result.first_disagreement
    return _print(
        args.json,
        {"model": llm.model_name, **result.to_dict()},
        f"--kv {result.mode} ({result.kv_dtype}) vs --kv off on {llm.model_name}, "
        f"{result.prompt_tokens}-token prompt, {result.steps} greedy steps:\n"
        f"  greedy agreement  {result.agreement:.2%}"
        f"{'' if first is None else f' (first disagreement at step {first})'}\n"
        f"  max logit drift   {result.max_logit_drift:.3g}\n"
        f"  mean logit drift  {result.mean_logit_drift:.3g}  (per step, largest |difference|)\n"
        f"  cache bytes       {result.kv_bytes}",
    )


def _verify_numerics(args: argparse.Namespace) -> int:
    """kvlm verify --against exact: the numerics' greedy answers against the reference's."""
    from kvlm.bench.prompts import fidelity_prompts
    from kvlm.engine.verify import compare, greedy_answers
    from kvlm.llm import LLM

    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                texts = [line.strip() for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise KvlmError(f"--prompts-file: {exc}") from None
        if not texts:
            raise KvlmError("--prompts-file: no prompt in it (one per line)")
    else:
        every = fidelity_prompts()
        if not 0 < args.prompts <= len(every):
            raise KvlmError(f"--prompts must be between 1 and {len(every)}")
        texts = [every[i * len(every) // args.prompts] for i in range(args.prompts)]
    llm = _load(args)
    reference = LLM(model=args.model, device=args.device, threads=args.threads,
                    max_context=args.max_context, exact=True, progress=False,
                    rope_scaling=args.rope_scaling, rope_scale=args.rope_scale)  # fmt: skip
    chat = _use_chat(args, llm)
    prompts = [llm.encode(t, chat=chat, system=args.system) for t in texts]
    n = args.max_new_tokens
    result = compare(reference, prompts, greedy_answers(reference, prompts, n),
                     greedy_answers(llm, prompts, n), n)  # fmt: skip
    num = llm.numerics
    described = (
        f"weights {num.weights or 'as the dtype'}, activations {num.activations}, "
        f"prompt products {num.prefill_dtype}, K/V {num.kv_dtype or 'as the dtype'}"
    )
    return _print(
        args.json,
        {"model": llm.model_name, "numerics": described, **result.to_dict()},
        f"{llm.model_name} ({described}) against the fp32 reference (--exact), "
        f"{result.prompts} prompts, greedy answers of up to {n} tokens:\n"
        f"  first token        {result.first_token:.1%}\n"
        f"  whole answer       {result.whole_answer:.1%}\n"
        f"  teacher-forced     {result.forced_agreement:.2%} of the answers' tokens are the "
        f"reference's argmax (worst rank {result.worst_rank})",
    )


def cmd_memory(args: argparse.Namespace) -> int:
    from kvlm import defaults
    from kvlm.cache.factory import check_mode
    from kvlm.cache.memory import parse_size, plan, table, weight_bytes
    from kvlm.dtypes import parse_dtype
    from kvlm.llm import _check_device, _cpu_experts
    from kvlm.loading import load_model

    check_mode(args.kv)
    no_picture = _check_plot(args.plot)
    device = _check_device(args.device)  # no GPU: one line, before the model loads
    budget = parse_size(args.budget) if args.budget else None
    loaded = load_model(args.model, config_only=True)  # a config.json alone plans too
    config, dtype = loaded.config, parse_dtype(args.dtype)
    context = args.context or config.max_position_embeddings
    if not 0 < context <= config.max_position_embeddings:
        raise KvlmError(f"--context must be between 1 and {config.max_position_embeddings}")
    sizes = {"block_size": args.block_size, "window": args.window, "sinks": args.sinks}
    numerics = _generate_numerics(args, loaded, dtype, device)
    kv_dtypes = defaults.kv_dtypes(numerics, dtype)
    held = _held_weight_bytes(loaded, numerics.weights, dtype)
    host, on_device = _host_experts(loaded, _cpu_experts(args.cpu_experts, config, device, dtype),
                                    dtype)  # fmt: skip
    if host:  # the device holds the rest: its budget is what is free less that
        held = (weight_bytes(config, dtype) if held is None else held) - on_device
    p = plan(config, args.kv, context, args.batch, kv_dtypes, dtype, budget, device, held,
             **sizes)  # fmt: skip
    rows = table(config, context, args.batch, **sizes)
    if args.plot and not no_picture:
        _memory_plot(args.plot, config.name, p, rows)
    record = {"model": config.name, **p.to_dict(), "table": rows}
    weights = _mib(p.weight_bytes)
    if config.expert_layers:  # what one token's step reads of them (its speed's bound)
        record["weight_bytes_read_per_token"] = read = _read_per_token(config, p.weight_bytes,
                                                                       held, loaded)  # fmt: skip
        x = config.experts
        weights += f", of which a token reads {_mib(read)} (its top {x.top_k} of {x.count} experts)"
    if host:
        record["host_expert_bytes"] = host
        weights += f"; and {_mib(host)} of routed experts in host memory (--cpu-experts)"
    _print(args.json, record, _memory_report(config.name, p, rows, weights))
    return _no_picture(no_picture)


def _host_experts(loaded: Any, n: int, dtype: Any) -> tuple[int, int]:
    """The routed experts of the first n expert layers (--cpu-experts): their bytes in host
    memory as the model loads them (a GGUF's low-bit stacks at their bytes in the file,
    else fp32) and the bytes they would take on the device in `dtype`."""
    config, source = loaded.config, loaded.weights
    x, layers = config.experts, sorted(config.expert_layers)[:n]
    params = len(layers) * x.count * 3 * config.hidden_size * x.intermediate if n else 0
    host = params * 4
    prefixes = tuple(f"model.layers.{i}.mlp.experts." for i in layers)
    names = [name for name in source.names() if name.startswith(prefixes)]
    if names and hasattr(source, "stored_bytes") and all(map(source.is_quantized, names)):
        host = sum(source.stored_bytes(name) for name in names)
    return host, params * dtype.itemsize


def _read_per_token(config: Any, weights: int, held: int | None, loaded: Any) -> int:
    """The weights one token's step reads of a mixture of experts' model: every tensor
    but the experts', of which top_k of count, and but an untied embedding table, of
    which a row (the file's own bytes where it keeps its blocks, else by the parameters'
    share)."""
    from kvlm.cache.memory import parameter_count

    x = config.experts
    idle = 1 - x.top_k / x.count
    if held is not None:  # the file's own bytes: the experts' stacks or tensors
        source = loaded.weights
        routed = sum(source.stored_bytes(n) for n in source.names() if ".mlp.experts." in n)
        table = "model.embed_tokens.weight"
        lookup = 0 if config.tie_word_embeddings else source.stored_bytes(table)
        return int(weights - routed * idle - lookup)
    active = parameter_count(config, active=True)
    if not config.tie_word_embeddings:
        active -= config.vocab_size * config.hidden_size
    return int(weights * active / parameter_count(config))


def _check_plot(path: str | None) -> str | None:
    """--plot, checked before the slow work: a name that is not .png is an error; without
    matplotlib, what to say after the text report (still printed: it is worth having)."""
    if not path:
        return None
    from kvlm.cache.plots import NoMatplotlib, check_output

    try:
        check_output(path)
    except NoMatplotlib as exc:
        return f"no picture written to {path}: {exc}, then run this command again"
    return None


def _no_picture(note: str | None) -> int:
    """The exit status after the report: 0, or `note` on stderr and EXIT_USER_ERROR."""
    if note is None:
        return 0
    print(f"kvlm: {note}", file=sys.stderr)
    return EXIT_USER_ERROR


def _generate_numerics(args: argparse.Namespace, loaded: Any, dtype: Any, device: Any) -> Any:
    """The numerics `kvlm generate` with these flags picks (kvlm.defaults.resolve: the
    LLM's road), "auto" where no --kv-dtype is named."""
    import torch

    from kvlm import defaults
    from kvlm.dtypes import dtype_name

    auto = defaults.AUTO
    return defaults.resolve(
        weights=auto, activations=auto, prefill_dtype=auto, kv_dtype=kv_dtype_of(args) or auto,
        exact=False, fp32_cpu=device.type == "cpu" and dtype == torch.float32,
        source=loaded.weights, compute=dtype_name(dtype),
    )  # fmt: skip


def _held_weight_bytes(loaded: Any, weights: str | None, dtype: Any) -> int | None:
    """What the weights take once loaded as `kvlm generate` loads them, where that is not
    every parameter dense: a GGUF file's low-bit tensors kept as its blocks (--weights
    native, the default for such a file on the CPU) at their bytes in the file, its float
    tensors in the compute dtype; None otherwise (kvlm.cache.memory.weight_bytes)."""
    import math

    source = loaded.weights
    if weights != "native" or not hasattr(source, "stored_bytes"):
        return None
    return sum(source.stored_bytes(n) if source.is_quantized(n)
               else math.prod(source.shape(n)) * dtype.itemsize
               for n in source.names())  # fmt: skip


def _memory_plot(path: str, name: str, p: Any, rows: list[dict]) -> None:
    """The table's bars, the plan's own mode and dtype outlined, its budget as a line."""
    from kvlm.cache.plots import memory_png, with_row

    rows = with_row(rows, p.mode, p.kv_dtype, p.total_bytes)
    title = f"{name}: KV cache for {p.batch} x {p.context:,} tokens, by mode and storage dtype"
    memory_png(rows, path, title, (p.mode, p.kv_dtype), p.budget_bytes)
    print(f"kvlm: wrote {path}", file=sys.stderr)


def _memory_report(name: str, p: Any, rows: list[dict], weights: str) -> str:
    """The plan as text; `weights`: its weights line's value."""
    fits = "?" if p.sequences_in_budget is None else f"{p.sequences_in_budget:,}"
    budget = "unknown (pass --budget)" if p.budget_bytes is None else _mib(p.budget_bytes)
    head = f"mode | kv dtype | bytes/token | total for {p.batch} x {p.context:,} tokens"
    lines = [
        f"{name}: --kv {p.mode} ({p.kv_dtype}), context {p.context:,} tokens, batch {p.batch}",
        f"  bytes per token     {p.bytes_per_token:,}",
        f"  per sequence        {_mib(p.bytes_per_sequence)}",
        f"  total (batch {p.batch:<3})   {_mib(p.total_bytes)}",
        f"  weights             {weights}",
        f"  budget              {budget}: {fits} sequences of {p.context:,} tokens",
        *_groups_report(p.layer_groups, p.batch),
        "",
        *table(head, "llrr", (f"{r['mode']} | {r['kv_dtype']} | {r['bytes_per_token']:,} | "
                              f"{_mib(r['total_bytes'])}" for r in rows)),
    ]  # fmt: skip
    return "\n".join(lines)


def _groups_report(groups: list[dict], batch: int) -> list[str]:
    """A hybrid model's layer groups (kvlm.cache.memory.layer_groups), a line each."""
    import torch

    from kvlm.cache.recurrent import SNAPSHOT_EVERY
    from kvlm.engine.engine import SNAPSHOT_SHARE, default_kv_memory

    first = groups[0]
    if len(groups) < 2 and first.get("keeps", "K/V") == "K/V" and "shared_by" not in first:
        return []  # one group of plain K/V: the lines above say it all
    lines = []
    for g in groups:
        kept = "the whole context" if g["window"] is None else f"a window of {g['window']:,}"
        if g["kind"] == "conv":  # a state kind: its rows a sequence, none per token
            lines.append(f"  {g['layers']} conv layers, their last rows a sequence: "
                         f"{_mib(g['bytes'])}; kvlm serve's pool keeps "
                         f"{g['block_end_bytes'] / 2**10:,.1f} KiB more a block for prefix "
                         "hits (the rows at its end)")  # fmt: skip
            continue
        if g["kind"] == "state":  # a recurrent layer's: fixed a sequence, a slot in the pool
            each, pool = g["bytes"] / batch, default_kv_memory(torch.device("cpu"))
            snaps = int(pool * SNAPSHOT_SHARE) // g["snapshot_bytes"]
            lines.append(f"  {g['layers']} recurrent layers, their state "
                         f"{each / 2**10:,.1f} KiB a sequence: {_mib(g['bytes'])}; kvlm "
                         f"serve's pool keeps snapshots of it for prefix hits (the state at "
                         f"a block's end: a prompt's, an answer's, one every {SNAPSHOT_EVERY} "
                         f"prompt tokens) in {SNAPSHOT_SHARE:.0%} of --kv-memory "
                         f"(--snapshot-share): {snaps:,} of "
                         f"{g['snapshot_bytes'] / 2**10:,.1f} KiB in the default "
                         f"{_mib(pool)}")  # fmt: skip
            continue
        keeps = _KEEPS.get(g.get("keeps", "K/V"), g.get("keeps"))
        line = (f"  {g['layers']} {g['kind']} layers ({keeps}), {kept}: {g['tokens']:,} "
                f"tokens, {_mib(g['bytes'])}")  # fmt: skip
        if g.get("shared_by"):  # later layers that read these layers' K/V
            n = len(g["shared_by"])
            line += f"; {n} more layer{'s' * (n > 1)} read their K/V and keep none"
        lines.append(line)
    return lines


# What a group's layers keep (kvlm.cache.kinds.keeps), as `kvlm memory` says it
_KEEPS = {"K/V": "K and V of their own", "K = V": "one row a token, their K and their V",
          "latent": "a latent and a rotated key part a token"}  # fmt: skip


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cmd_serve(args: argparse.Namespace) -> int:
    from kvlm.server import exit_now, log_to_stderr, serve

    if not 0 < args.port < 65536:
        raise InvalidRequestError(f"--port must be 1..65535, got {args.port}")
    if args.replicas < 1:
        raise InvalidRequestError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1 or args.ray_address:
        from kvlm.cluster import serve_replicas  # imports Ray: only here

        return serve_replicas(args)
    from kvlm.server.config import serve_config, serve_model, serve_sampling

    config, limits = serve_config(args)
    log_to_stderr(args.log_level)  # from the start: the kernels' first build says so there
    llm = serve_model(args, config)
    serve(llm, config, args.host, args.port, args.api_key, args.served_model_name, args.log_level,
          limits, args.tool_call_parser, args.reasoning_parser,
          serve_sampling(args, llm), args.slot_save_path)  # fmt: skip
    exit_now(0)  # (kvlm.server.exit_now says why)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvlm.bench import PEERS, BenchConfig, bench, markdown
    from kvlm.cache.factory import check_mode

    if args.suite:
        return _bench_suite(args)
    args.prompts = args.prompts or "128,512,2048"
    args.new_tokens = 128 if args.new_tokens is None else args.new_tokens
    args.rounds = 1 if args.rounds is None else args.rounds
    prompts = _counts(args.prompts, "--prompts takes comma-separated token counts")
    if min(prompts) < 1 or args.new_tokens < 2 or args.rounds < 1:
        raise InvalidRequestError("prompts must be >= 1 token, --new-tokens >= 2, --rounds >= 1")
    modes = args.kv.split(",")
    peers = _names(args.peers, PEERS, "unknown peer {!r}; valid: " + ", ".join(PEERS))
    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise InvalidRequestError("--plots needs matplotlib: pip install matplotlib") from exc
    for mode in modes:
        check_mode(mode)  # before the slow load
    need = max(*prompts, 16) + args.new_tokens  # 16: the warm-up and per-forward prompt
    llm = model_from_args(args, kv=modes[0], max_context=args.max_context or need)
    for mode in modes[1:]:
        llm.cache_spec(mode)  # every mode's settings checked before the long run
    streams = []
    if args.streams != "none":
        streams = _counts(args.streams, "--streams takes comma-separated counts")
    if streams and min(streams) < 1:
        raise InvalidRequestError("--streams counts must be >= 1")
    config = BenchConfig(prompts, args.new_tokens, modes, peers, args.rounds, args.plots, streams,
                         speculative_from_args(args))  # fmt: skip
    try:
        result = bench(llm, config)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc
    return _report(markdown(result), result, args.json)


def _counts(value: str, message: str) -> list[int]:
    """Comma-separated counts; a word that is not one ends in `message`."""
    try:
        return [int(x) for x in value.split(",")]
    except ValueError as exc:
        raise InvalidRequestError(f"{message}: {exc}") from exc


def _names(value: str, valid: Sequence[str], message: str) -> list[str]:
    """Comma-separated names of `valid` ("none": no name); an unknown one ends in
    `message`, formatted with it."""
    names = [] if value == "none" else value.split(",")
    unknown = sorted(set(names) - set(valid))
    if unknown:
        raise InvalidRequestError(message.format(unknown[0]))
    return names


def _report(text: str, result: dict, json_path: str | None) -> int:
    """Print a bench's markdown, and write its result to --json's file."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _bench_suite(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvlm.bench.suite import ENGINES, markdown, run_suite, suite_models

    try:
        prompt = int(args.prompts or 512)
    except ValueError as exc:
        raise InvalidRequestError("--suite takes one prompt length (--prompts 512)") from exc
    new = 64 if args.new_tokens is None else args.new_tokens
    rounds = 3 if args.rounds is None else args.rounds
    if prompt < 16 or new < 2 or rounds < 1:
        raise InvalidRequestError("--suite: --prompts >= 16, --new-tokens >= 2, --rounds >= 1")
    flags = {"--model": args.model, "--exact": args.exact, "--kv-dtype": kv_dtype_of(args),
             "--plots": args.plots, "--max-context": args.max_context}  # fmt: skip
    flags |= {f"--{k.replace('_', '-')}": getattr(args, k) != "auto"
              for k in ("weights", "prefill_dtype", "activations")}  # fmt: skip
    given = [name for name, value in flags.items() if value]
    if given:
        raise InvalidRequestError(
            f"--suite runs kvlm with no flags on its own model set; {given[0]} does not apply"
        )
    peers = "llama.cpp,hf" if args.peers == "hf,hf-static,llama.cpp" else args.peers
    peers = _names(peers, ENGINES, "--suite peers: {!r}; valid: llama.cpp, hf")

    shapes, types = (None if v is None else v.split(",") for v in (args.shapes, args.types))
    try:
        models = suite_models(Path(args.suite), shapes, types, log=sys.stderr)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc
    engines = ["kvlm", *[p for p in ENGINES if p in peers]]
    result = run_suite(models, engines, prompt, new, rounds, args.threads)
    return _report(markdown(result), result, args.json)


def cmd_inspect(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    if args.cache:
        return _inspect_cache(args)
    if args.plot:
        raise KvlmError("--plot draws a saved cache: kvlm inspect --cache FILE --plot OUT.png")

    from kvlm.loading import load_model

    loaded = load_model(args.model)
    cfg = loaded.config
    per_token = cfg.kv_elements_per_token
    info = {
        "path": str(loaded.path),
        "format": loaded.format,
        "weight_types": loaded.weight_types,
        **asdict(cfg),
        "chat_template": loaded.tokenizer.chat_template is not None,
        "tokenizer_vocab": loaded.tokenizer.vocab_size,
        "kv_bytes_per_token": {"fp32": per_token * 4, "bf16": per_token * 2, "fp16": per_token * 2},
    }
    if cfg.expert_layers:  # what a token runs of them (kvlm.model.experts)
        from kvlm.cache.memory import parameter_count

        info["parameters"] = parameter_count(cfg)
        info["active_parameters"] = parameter_count(cfg, active=True)
    if cfg.mtp_layers:  # a drafter the file carries (kvlm.model.mtp), or only its name
        held = "mtp.fc.weight" in loaded.weights.names()
        info["mtp_head"] = (f"{cfg.mtp_layers} block(s)" if held else
                            "named by the config, not in the file (runs without)")  # fmt: skip
    from kvlm.cache.base import CacheSpec
    from kvlm.cache.groups import layer_groups
    from kvlm.cache.kinds import shown

    # what each layer group keeps (kvlm memory: its bytes at a context)
    spec = CacheSpec.for_model(cfg, 1)
    groups = [g.described | shown(cfg, g.layers) for g in layer_groups(spec)]
    for g, group in zip(groups, layer_groups(spec), strict=True):
        g["kv_bytes_per_token"] = group.token_bytes(spec)  # at the model's dtype (fp32)
    if len(groups) > 1 or groups[0]["keeps"] != "K/V" or "shared_by" in groups[0]:
        info["kv_layer_groups"] = groups
    return _print_info(info, args.json, 24)


def _inspect_cache(args: argparse.Namespace) -> int:
    """A saved cache file, read without its model (kvlm.cache.saved)."""
    from kvlm.cache.base import CacheSpec
    from kvlm.cache.plots import cache_png, human
    from kvlm.cache.saved import SavedCache

    CacheSpec(1, 1, 1, 1, block_size=args.block_size)  # a bad --block-size: one line, first
    no_picture = _check_plot(args.plot)
    saved = SavedCache.read(args.cache)
    info = saved.summary(args.block_size)
    if args.plot and not no_picture:
        info["plot"] = str(cache_png(saved, args.plot, args.block_size))
    _print_info(
        info, args.json, 16, lambda k, v: f"{v:,} ({human(v)})" if k.endswith("_bytes") else v
    )
    return _no_picture(no_picture)


def _print_info(info: dict, as_json: bool, width: int, shown: Any = lambda k, v: v) -> int:
    """`info` as one JSON object, or a line per key (right-aligned in `width`)."""
    return _print(as_json, info, "\n".join(f"{k:>{width}}: {shown(k, v)}" for k, v in info.items()))


def _print(as_json: bool, record: dict, text: str) -> int:
    """A command's result: `record` as one JSON object, or `text`."""
    print(json.dumps(record, default=str) if as_json else text)
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "verify": cmd_verify,
    "memory": cmd_memory,
    "serve": cmd_serve,
    "bench": cmd_bench,
    "inspect": cmd_inspect,
}


if __name__ == "__main__":
    sys.exit(main())
