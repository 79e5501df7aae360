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

from helpers import WEATHER
from serving import kvlm_serve, metrics, wait_idle

anthropic = pytest.importorskip("anthropic")

KEY = "anthropic-key"
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


def test_cache_control_marks_pin_their_prefixes_and_usage_says_what_they_wrote(
    client, model, server
):
    """A system prompt marked with cache_control (and a mark on the last user block, a
    1 h one): the first request writes the marked prefix (cache_creation_input_tokens:
    its tokens the cache did not serve, input_tokens the rest, together the prompt's) and
    pins it (kvlm_kv_blocks_pinned grows); the next request with that system prompt reads
    it (cache_read_input_tokens at least the marked prefix's whole blocks, nothing written
    for the mark but the part of a block past them). Five marks are a 400, as
    Anthropic's."""
    system = [{"type": "text", "text": "You answer in one line. " * 40,
               "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    ask = [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Weather in Rome?",
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                }
            ],
        }
    ]
    pinned = metrics(server, KEY)["kvlm_kv_blocks_pinned"]
    first = create(client, model, system=system, messages=ask, max_tokens=4, temperature=0)
    prompt = client.messages.count_tokens(model=model, system=system, messages=ask).input_tokens
    u = first.usage
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == prompt
    assert u.cache_creation_input_tokens >= prompt - 16 and u.cache_read_input_tokens == 0
    wait_idle(server, KEY)
    assert metrics(server, KEY)["kvlm_kv_blocks_pinned"] >= pinned + (prompt - 16) // 16
    other = [{"role": "user", "content": "And in Oslo?"}]
    again = create(client, model, system=system, messages=other, max_tokens=4, temperature=0)
    x = [{"role": "user", "content": "x"}]
    turn = (client.messages.count_tokens(model=model, system=system, messages=x).input_tokens
            - client.messages.count_tokens(model=model, messages=x).input_tokens)  # fmt: skip
    u = again.usage
    assert u.cache_read_input_tokens >= 16 * (turn // 16) - 16 > 0  # the system turn's
    assert u.cache_creation_input_tokens < 32
    five = [{"type": "text", "text": f"part {i}. ", "cache_control": {"type": "ephemeral"}}
            for i in range(5)]  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4 blocks"):
        create(client, model, system=five)
    with pytest.raises(anthropic.BadRequestError, match="ttl"):
        create(
            client,
            model,
            system=[
                {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}
            ],
        )


# ------------------------------------------------------------- what Claude Code sends

# A record as zod writes it (z.record): `propertyNames`, which llguidance does not implement
ENV_TOOL = {
    "name": "set_env",
    "description": "Set environment variables",
    "input_schema": {"type": "object", "properties": {"vars": {
        "type": "object", "propertyNames": {"type": "string"},
        "additionalProperties": {"type": "string", "maxLength": 8}, "maxProperties": 2}},
        "required": ["vars"], "additionalProperties": False},
}  # fmt: skip


def test_claude_codes_request_shape_is_served(client, model):
    """What Claude Code 2.1.332 sends on its first request: a system turn inside
    `messages` after the first user turn, `context_management` (clear_thinking),
    adaptive thinking with display omitted, a 32,000 max_tokens past the context, and
    a tool whose schema carries `propertyNames`. Each was a 400 before."""
    messages = [*ASK, {"role": "system", "content": [
        {"type": "text", "text": "# Environment\nPlatform: linux", "cache_control": {
            "type": "ephemeral"}}]}]  # fmt: skip
    extra = {"context_management": {"edits": [{"type": "clear_thinking_20251015",
                                               "keep": "all"}]}, "temperature": 0}  # fmt: skip
    with client.messages.stream(model=model, messages=messages, max_tokens=32000,
                                tools=[ENV_TOOL], extra_body=extra,
                                thinking={"type": "adaptive", "display": "omitted"},
                                metadata={"user_id": '{"device_id": "x"}'}) as events:  # fmt: skip
        final = events.get_final_message()
        clamped = events.response.headers.get("kvlm-max-tokens")
    assert final.stop_reason in ("end_turn", "tool_use", "model_context_window_exceeded")
    counted = client.messages.count_tokens(model=model, messages=messages, tools=[ENV_TOOL])
    # the room the prompt leaves in the server's 2,048-token context, said in a header
    assert clamped is not None and int(clamped) == 2048 - counted.input_tokens
    assert final.usage.output_tokens <= int(clamped)
    if final.usage.output_tokens == int(clamped):  # cut by the context, as Anthropic says it
        assert final.stop_reason == "model_context_window_exceeded"
    # the system turn reaches the prompt: it has more tokens than the conversation without
    assert counted.input_tokens > client.messages.count_tokens(
        model=model, messages=ASK, tools=[ENV_TOOL]).input_tokens  # fmt: skip
    # forced, the call's input follows the schema's other keywords (the grammar's)
    forced = create(client, model, tools=[ENV_TOOL], max_tokens=80, temperature=0,
                    tool_choice={"type": "tool", "name": "set_env"})  # fmt: skip
    assert forced.stop_reason == "tool_use"
    assert isinstance(forced.content[-1].input["vars"], dict)


def test_what_kvlm_cannot_honour_of_those_is_named(client, model):
    tool_blocks = [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]
    with pytest.raises(anthropic.BadRequestError, match="system turn's content is text"):
        create(client, model, messages=[*ASK, {"role": "system", "content": tool_blocks}])
    clear_tools = {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
    with pytest.raises(anthropic.BadRequestError, match="clear_tool_uses_20250919"):
        create(client, model, extra_body=clear_tools)


def test_max_tokens_past_the_context_is_clamped_on_every_route(server, model):
    """A max_tokens past the room the prompt leaves is run with that room (was a 400
    context_length_exceeded), and the kvlm-max-tokens header says it, on every route: the
    one road (kvlm.server.app._params)."""
    import openai

    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "Hi"}]
    big = {"temperature": 0, "model": model}
    chat = oa.chat.completions.with_raw_response.create(messages=ask, max_tokens=32000, **big)
    done = oa.completions.with_raw_response.create(prompt="Hi", max_tokens=32000, **big)
    reply = oa.responses.with_raw_response.create(input="Hi", store=False,
                                                  max_output_tokens=32000, **big)  # fmt: skip
    for raw, used in ((chat, chat.parse().usage.completion_tokens),
                      (done, done.parse().usage.completion_tokens),
                      (reply, reply.parse().usage.output_tokens)):  # fmt: skip
        clamped = int(raw.headers["kvlm-max-tokens"])
        assert 0 < clamped < 2048 and used <= clamped
    prompt = chat.parse().usage.prompt_tokens
    assert int(chat.headers["kvlm-max-tokens"]) == 2048 - prompt
    # a max_tokens that fits: no header
    fits = oa.chat.completions.with_raw_response.create(model=model, messages=ask, max_tokens=4)
    assert "kvlm-max-tokens" not in fits.headers
