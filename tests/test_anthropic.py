"""Anthropic's Messages API: the real `anthropic` SDK against a real `kvlm serve` (a tiny
random Qwen3-shaped model with a tools template), on 127.0.0.1.

A random model's words mean nothing, so each check is of the protocol: the reply's shape,
stop reasons (a stop sequence taken from the model's own greedy reply), the stream equal to
the whole reply, forced tool calls whose input validates, the tool round trip, usage and
count_tokens agreeing, the prefix cache's tokens reported, errors in Anthropic's shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from serving import kvlm_serve, wait_idle

anthropic = pytest.importorskip("anthropic")

KEY = "anthropic-key"
WEATHER = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                     "required": ["city"], "additionalProperties": False},
}  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tools_model_dir):
    with kvlm_serve("--model", str(tools_model_dir), "--max-context", "2048", "--threads", "2",
                    "--api-key", KEY) as (port, _):  # fmt: skip
        yield port


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server}", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    import openai

    base = str(client.base_url).rstrip("/")
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY).models.list().data[0].id


def create(client, model, temperature=None, **kw):
    """messages.create; `temperature` (gone from Anthropic's newest SDK, sent by older
    clients and honoured by kvlm) in the body's extra fields."""
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 24)
    if temperature is not None:
        kw["extra_body"] = {"temperature": temperature}
    return client.messages.create(model=model, **kw)


def stream(client, model, temperature=0, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 24)
    return client.messages.stream(model=model, extra_body={"temperature": temperature}, **kw)


def test_a_reply_stream_and_usage(client, model, server):
    whole = create(client, model, temperature=0, system="Be brief.")
    assert whole.type == "message" and whole.role == "assistant" and whole.model == model
    assert whole.id.startswith("msg_") and whole.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in whole.content if b.type == "text")
    assert 0 < whole.usage.output_tokens <= 24
    counted = client.messages.count_tokens(model=model, messages=ASK, system="Be brief.")
    used = whole.usage
    assert used.input_tokens + used.cache_read_input_tokens == counted.input_tokens
    with stream(client, model, system="Be brief.") as events:
        streamed = "".join(events.text_stream)
        final = events.get_final_message()
    assert streamed == text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the same prompt again: its full blocks come from the prefix cache, and usage says so
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted.input_tokens
    wait_idle(server, KEY)


def test_a_stop_sequence_ends_the_reply_and_is_named(client, model):
    text = create(client, model, temperature=0, max_tokens=16).content[0].text
    assert len(text) >= 4, text
    stop = text[len(text) // 2 :][:2]
    cut = create(client, model, temperature=0, max_tokens=16, stop_sequences=[stop, "\x00zz"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == text[: text.index(stop)]
    with stream(client, model, max_tokens=16, stop_sequences=[stop]) as events:
        final = events.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_a_forced_tool_call_and_its_result(client, model):
    for streamed in (False, True):
        kw = dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"},
                  temperature=0, max_tokens=80)  # fmt: skip
        if streamed:
            with stream(client, model, **kw) as events:
                kinds = [e.type for e in events]
                reply = events.get_final_message()
            assert "content_block_start" in kinds and "message_stop" in kinds
        else:
            reply = create(client, model, **kw)
        assert reply.stop_reason == "tool_use", reply
        calls = [b for b in reply.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == "weather"
        jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                          "content": "Sunny, 21 C"}]}]  # fmt: skip
    answer = create(client, model, messages=turn, tools=[WEATHER], temperature=0)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # "any": some tool, the grammar decides the format
    anyone = create(client, model, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=80,
                    temperature=0)  # fmt: skip
    assert anyone.stop_reason == "tool_use"
    assert json.dumps(anyone.content[-1].input)


def test_errors_come_in_anthropics_shape(client, model, server):
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, model, temperature=1.5)
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        create(client, model, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.BadRequestError, match="server tool"):
        create(client, model, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(client, "no-such-model")
    assert missing.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server}", api_key="wrong",
                                max_retries=0)  # fmt: skip
    with pytest.raises(anthropic.AuthenticationError) as denied:
        create(wrong, model)
    assert denied.value.body["error"]["type"] == "authentication_error"
    # the Bearer header works too (clients that send OpenAI's)
    bearer = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server}", auth_token=KEY,
                                 max_retries=0)  # fmt: skip
    assert create(bearer, model, max_tokens=2).usage.output_tokens <= 2


def test_structured_output_thinking_and_unknown_fields(client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    out = create(client, model, output_config={"format": {"type": "json_schema", "schema": schema}},
                 thinking={"type": "disabled"}, max_tokens=40, temperature=0)  # fmt: skip
    jsonschema.validate(json.loads(out.content[0].text), schema)
    with_tools = client.messages.count_tokens(model=model, messages=ASK, tools=[WEATHER])
    assert (
        with_tools.input_tokens
        > client.messages.count_tokens(model=model, messages=ASK).input_tokens
    )
    with pytest.raises(anthropic.BadRequestError, match="unrecognized request argument supplied: "
                       "frobnicate"):  # fmt: skip
        create(client, model, extra_body={"frobnicate": 1})
