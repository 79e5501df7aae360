"""The `kvlm` command: parse, call the library, print. User mistakes end in one line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvlm.errors import KvlmError

EXIT_USER_ERROR = 2
# Spelled out rather than imported from kvlm.cache, which pulls in torch: `kvlm --help`
# stays instant. tests/test_cli.py checks it names every mode the factory knows.
KV_HELP = "cache mode: off, basic, contiguous (default)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", nargs="?", default="-", help="the prompt ('-' or none: stdin)")
    _model_args(gen)
    _sampling_args(gen, temperature=0.0)
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive conversation that keeps its KV cache")
    _model_args(chat)
    _sampling_args(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    inspect = sub.add_parser("inspect", help="show a model's configuration and cache sizes")
    inspect.add_argument("--model", help="GGUF file, HF folder or Hub id (default: SmolLM2-135M)")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file, HF folder or Hub id (default: SmolLM2-135M)")
    p.add_argument("--kv", default="contiguous", help=KV_HELP)
    p.add_argument("--dtype", default="fp32", help="compute dtype: fp32, bf16, fp16")
    p.add_argument("--kv-dtype", default=None, help="cache dtype (default: --dtype)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps")
    p.add_argument("--max-context", type=int, default=None, help="cache capacity in tokens")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--system", default=None, help="system prompt for the chat template")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the model's chat template (default: on when the model has one)",
    )


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


def _load(args: argparse.Namespace):
    from kvlm.llm import LLM  # imports torch: only once a command runs

    return LLM(
        model=args.model,
        kv=args.kv,
        dtype=args.dtype,
        device=args.device,
        kv_dtype=args.kv_dtype,
        max_context=args.max_context,
        threads=args.threads,
        progress=sys.stderr.isatty(),
    )


def _params(args: argparse.Namespace):
    from kvlm.engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _params(args)  # validate before the slow load
    llm = _load(args)
    use_chat = args.chat and llm.tokenizer.chat_template is not None
    ids = llm.encode(prompt, chat=use_chat, system=args.system)
    stream = llm.stream(ids, params, prompt=prompt)
    for delta in stream:
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    out = stream.output
    if args.json:
        record = {
            **llm.describe(),
            **out.to_dict(),
            "chat_template": use_chat,
            "kv_bytes": llm.cache.nbytes,
            "kv_bytes_used": llm.cache.num_tokens * llm.cache.spec.bytes_per_token,
        }
        print(json.dumps(record))
    else:
        print()
        print(_summary(out, llm), file=sys.stderr)
    return 0


def _summary(out: Any, llm: Any) -> str:
    m = out.metrics
    return (
        f"[{len(out.token_ids)} tokens, {out.finish_reason}; prefill {m.prefill_tokens} tokens, "
        f"TTFT {m.ttft_ms:.0f} ms; decode {m.decode_tokens_per_s:.1f} tok/s; "
        f"kv {llm.kv_mode} {llm.cache.nbytes / 2**20:.1f} MiB]"
    )


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _load(args)
    if llm.tokenizer.chat_template is None:
        raise KvlmError("this model has no chat template; use `kvlm generate --no-chat`")
    session = llm.chat_session(params, system=args.system)
    print(f"kvlm chat: {llm.model_name} (kv {llm.kv_mode}). /reset clears, Ctrl-D quits.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/reset":
            session = llm.chat_session(params, system=args.system)
            continue
        if not line.strip():
            continue
        turn = session.send(line)
        try:
            for delta in turn:
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass  # stop this reply, keep the conversation
        print()
        m = turn.output.metrics
        reused = m.prompt_tokens - m.prefill_tokens
        print(f"[reused {reused} cached tokens, prefilled {m.prefill_tokens}; "
              f"{len(turn.output.token_ids)} tokens at {m.decode_tokens_per_s:.1f} tok/s; "
              f"cache {session.cache.num_tokens}/{session.cache.capacity} tokens]",
              file=sys.stderr)  # fmt: skip


def cmd_inspect(args: argparse.Namespace) -> int:
    from dataclasses import asdict

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
    if args.json:
        print(json.dumps(info, default=str))
        return 0
    for key, value in info.items():
        print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
