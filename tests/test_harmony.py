"""Harmony replies (kvlm.server.harmony): the analysis channel as reasoning_content, the
final channel and preambles as content, calls of `functions.*` as tool_calls; the split
streamed at every cut equal to the whole; a harmony vocabulary's two ends; a conversation's
earlier reasoning and calls rendered by the Hub's own template (llama.cpp's copy, read out
of the pinned sdist); and a real `kvlm serve` on a tiny gpt-oss GGUF written by llama.cpp's
converter (a harmony vocabulary, the Hub's template) whose replies are made harmony by a
Lark grammar over the special tokens (a random model would never write one), read through
the chat route (streamed and not) and as tool calls. (The Messages, Responses and Ollama
APIs build their thinking on the chat road's reasoning_content: tests/test_reasoning.py;
they take no grammar to steer a random model with.)"""

from __future__ import annotations

import json

import pytest

from converter import convert, template
from helpers import save_tiny_model
from kvlm.server.harmony import HEADER_MAX, HarmonyStream, is_harmony, split
from kvlm.server.protocol import ChatMessage
from kvlm.server.tools import parse
from serving import kvlm_serve, openai_client

A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}')  # fmt: skip
# (reply, tools offered) -> (reasoning or None, content, calls as (name, arguments))
REPLIES = [
    (A + "Weigh it.<|end|>" + F + "The answer.", True, ("Weigh it.", "The answer.", [])),
    (A + "Need it.<|end|>" + CALL, True,
     ("Need it.", None, [("get_weather", '{"city": "Paris"}')])),
    (A + "Need it.<|end|>" + CALL + "<|call|>", True,
     ("Need it.", None, [("get_weather", '{"city": "Paris"}')])),
    # the recipient in the role's header, a preamble, the reply opening with the call
    (' to=functions.f<|channel|>commentary json<|message|>{"a": [1, "}"]}', True,
     (None, None, [("f", '{"a": [1, "}"]}')])),
    ("<|channel|>commentary<|message|>Let me look.<|end|>" + CALL, True,
     (None, "Let me look.", [("get_weather", '{"city": "Paris"}')])),
    (A + "x<|end|>" + CALL, False, ("x", "", [])),  # no tools offered: the call dropped
    # a built-in tool's call is dropped, the reply goes on
    (A + "x<|end|><|start|>assistant<|channel|>analysis to=browser.search<|message|>{}<|call|>"
     + F + "y", True, ("x", "y", [])),
    ('{"answer": 42}', True, (None, '{"answer": 42}', [])),  # a guided reply: not harmony
    ("<|chan", True, (None, "<|chan", [])),  # cut before its header was decided
    (A + "cut off before its end", True, ("cut off before its end", "", [])),
    ("<|channel|>final" + "x" * HEADER_MAX, True,
     (None, "<|channel|>final" + "x" * HEADER_MAX, [])),
    (A + "a<|end|>\n<|start|>assistant<|channel|>final<|message|>b<|return|>", True,
     ("a", "b", [])),
    # text outside any message: content as written, but the whitespace after a message's end
    (A + "a<|end|> stray  text <|start|>assistant<|channel|>final<|message|>b", True,
     ("a", "stray  text b", [])),
]  # fmt: skip


def _read(reasoning: str | None, content: str, tools: bool):
    text, calls = parse(content, "hermes") if tools else (content, [])
    return reasoning, text, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text, tools, expected", REPLIES)
def test_the_messages_whole_and_streamed_at_every_cut(text, tools, expected):
    r, c = split(text, True, tools)
    assert _read(r, c, tools) == expected
    for cut in range(len(text) + 1):
        for pieces in [[text[:cut], text[cut:]]] + ([list(text)] if cut == 0 else []):
            stream = HarmonyStream(True, tools)
            got = [stream.push(p) for p in pieces] + [stream.finish()]
            assert ("".join(g[0] for g in got), "".join(g[1] for g in got)) == (r or "", c)


def test_without_the_reasoning_parser_the_analysis_is_content():
    assert split(A + "a<|end|>" + F + "b", False, False) == (None, "ab")


def test_a_harmony_vocabulary_ends_at_return_and_call(harmony_folder, harmony_gguf):
    from kvlm import LLM

    for model in (harmony_folder, harmony_gguf):  # each names <|return|> its EOS
        tok = LLM(model, kv="off", progress=False).tokenizer
        ends = {tok.id_to_token(i) for i in tok.eos_token_ids}
        assert {"<|return|>", "<|call|>"} <= ends and "<|end|>" not in ends


def test_earlier_reasoning_and_calls_are_rendered_by_the_template(harmony_folder):
    """An agent's second request: its first reply's reasoning (vLLM's field, as this server
    returned it) rendered before the call as the template's analysis message."""
    from kvlm.loading.tokenizer import tokenizer_from_hf_folder

    tok = tokenizer_from_hf_folder(harmony_folder)
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    messages = [ChatMessage.model_validate(t).for_template() for t in turns]
    text = tok.render_chat(messages, tools=[WEATHER])
    assert (A + "Need the weather.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in text  # fmt: skip
    assert text.endswith("<|start|>assistant")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# the replies' shapes, by a Lark grammar over the special tokens (unquoted: the tokens;
# quoted, their text)
THINKS = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,12}/ <|end|> '
          '<|start|> "assistant" <|channel|> "final" <|message|> /[a-z]{3,12}/')  # fmt: skip
CALLS = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,12}/ <|end|> <|start|> '
         '"assistant" <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" '
         '<|message|> "{\\"city\\": \\"" /[a-z]{2,8}/ "\\"}" <|call|>')  # fmt: skip


@pytest.fixture(scope="module")
def harmony_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("harmony"), "gpt_oss", seed=50,
                           tokenizer="harmony",
                           chat_template=template("openai-gpt-oss-120b.jinja"))  # fmt: skip


@pytest.fixture(scope="module")
def harmony_gguf(harmony_folder):
    return convert(harmony_folder, "f32", pre="qwen35")


@pytest.fixture(scope="module")
def served(harmony_gguf):
    with kvlm_serve("--model", str(harmony_gguf), "--max-context", "1024") as (port, _):
        yield port


def test_the_template_is_read_as_harmony(harmony_folder):
    assert is_harmony(template("openai-gpt-oss-120b.jinja"))
    assert not is_harmony("{{ messages }}<|im_start|>")


def _chat(client, grammar, **kw):
    model = client.models.list().data[0].id
    return dict(model=model, messages=ASK, max_tokens=160, temperature=0,
                extra_body={"guided_grammar": grammar}, **kw)  # fmt: skip


def test_served_replies_split_their_analysis(served):
    client = openai_client(served)
    kw = _chat(client, THINKS)
    message = client.chat.completions.create(**kw).choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought.isalpha() and message.content.isalpha()
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True)
              if c.choices]  # fmt: skip
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == message.content


def test_served_calls_are_tool_calls(served):
    client = openai_client(served)
    kw = _chat(client, CALLS, tools=[WEATHER])
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert choice.message.model_extra["reasoning_content"].isalpha()
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(tc.function.arguments or "" for c in chunks if c.choices
                       for tc in c.choices[0].delta.tool_calls or [])  # fmt: skip
    assert streamed == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
