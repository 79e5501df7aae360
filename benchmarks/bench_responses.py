"""A 10-turn agent conversation two ways, on the same model: through /v1/responses with
`previous_response_id` (the conversation kept in the KV cache: each turn prefills only its
new input), and through /v1/chat/completions resending the whole history to a server
without prefix reuse (`--no-prefix-caching`: every turn prefills everything). Per turn:
the input tokens, those prefilled (input minus the cached ones the answer reports), and
the time to the first streamed token. Greedy, the same user turns on both.

    python benchmarks/bench_responses.py                     # the default model
    python benchmarks/bench_responses.py --model PATH --turns 10 --max-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai
from served import ServeProcess

USER = (
    "Here is the next part of the report. Section {i}: the team measured the cache again, "
    "wrote down what changed, and asked what to try next. What do you suggest?"
)


def responses_turns(port: int, model: str, turns: int, max_tokens: int) -> list[dict]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    rows, previous = [], None
    for i in range(turns):
        start, first = time.perf_counter(), None
        stream = client.responses.create(
            model=model, input=USER.format(i=i + 1), previous_response_id=previous,
            instructions="You are a helpful assistant.", max_output_tokens=max_tokens,
            temperature=0, stream=True)  # fmt: skip
        final = None
        for event in stream:
            if first is None and event.type == "response.output_text.delta":
                first = time.perf_counter() - start
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        used = final.usage
        cached = used.input_tokens_details.cached_tokens
        rows.append({"input": used.input_tokens, "prefilled": used.input_tokens - cached,
                     "ttft_ms": 1000 * (first or 0)})  # fmt: skip
        previous = final.id
    return rows


def chat_turns(port: int, model: str, turns: int, max_tokens: int) -> list[dict]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    rows = []
    for i in range(turns):
        messages.append({"role": "user", "content": USER.format(i=i + 1)})
        start, first, text, usage = time.perf_counter(), None, "", None
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        cached = usage.prompt_tokens_details.cached_tokens
        rows.append({"input": usage.prompt_tokens, "prefilled": usage.prompt_tokens - cached,
                     "ttft_ms": 1000 * (first or 0)})  # fmt: skip
        messages.append({"role": "assistant", "content": text})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model file or folder (default: kvlm's)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    model_args = ["--model", args.model] if args.model else []
    results = {}
    ways = (("responses", [], responses_turns),
            ("chat, no prefix reuse", ["--no-prefix-caching"], chat_turns))  # fmt: skip
    for name, extra, run in ways:
        server = ServeProcess([*model_args, "--max-context", "4096", *extra])
        try:
            results[name] = run(server.port, server.model, args.turns, args.max_tokens)
        finally:
            server.stop()
    print("| turn | " + " | ".join(f"{n}: input / prefilled / TTFT ms" for n in results) + " |")
    print("| ---: | " + " | ".join("---:" for _ in results) + " |")
    for t in range(args.turns):
        cells = [f"{r[t]['input']} / {r[t]['prefilled']} / {r[t]['ttft_ms']:.0f}"
                 for r in results.values()]  # fmt: skip
        print(f"| {t + 1} | " + " | ".join(cells) + " |")
    for name, rows in results.items():
        print(f"{name}: prefilled {sum(r['prefilled'] for r in rows)} tokens in all; median "
              f"TTFT of turns 2-{args.turns} "
              f"{statistics.median(r['ttft_ms'] for r in rows[1:]):.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
