"""OpenAI's Responses API: the real `openai` SDK (`client.responses`) against a real `kvlm
serve` (a tiny random Qwen3-shaped model with a tools template) on 127.0.0.1, and the
engine's pins that keep a stored conversation's blocks.

A random model's words mean nothing, so each check is of the protocol and the cache:
output items and status, the stream equal to the whole reply, a follow-up through
previous_response_id served from the prefix cache (usage says how much), a function tool
round trip, json_schema output, retrieve/delete/input_items, background and cancel."""

from __future__ import annotations

import json
import re
import time
from typing import Annotated

import jsonschema
import pytest
from pydantic import BaseModel, Field

from serving import kvlm_serve, metrics

openai = pytest.importorskip("openai")

KEY = "responses-key"
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 16}}, "required": ["city"],
               "additionalProperties": False}}  # fmt: skip


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def server(tools_model_dir):
    with kvlm_serve("--model", str(tools_model_dir), "--max-context", "2048", "--threads", "2",
                    "--api-key", KEY) as (port, _):  # fmt: skip
        yield port


def create(client, model, **kw):
    kw.setdefault("input", "Weather in Paris?")
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=model, **kw)


def test_a_response_streamed_and_not(client, model):
    whole = create(client, model, instructions="Be brief.")
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.model == model
    assert whole.output[0].type == "message" and whole.output[0].role == "assistant"
    assert 0 < whole.usage.output_tokens <= 24 and whole.usage.input_tokens > 0
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(create(client, model, instructions="Be brief.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    # the SDK's stream helper reads response.completed only (an incomplete one is
    # response.incomplete, as OpenAI sends it): a reply that ends, JSON by the grammar
    fmt = {"format": {"type": "json_schema", "name": "ok", "schema": SCHEMA}}
    ended = create(client, model, text=fmt, max_output_tokens=40)
    assert ended.status == "completed"
    with client.responses.stream(model=model, input="Weather in Paris?", max_output_tokens=40,
                                 temperature=0, text=fmt) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.output_text == ended.output_text and json.loads(final.output_text)


def test_a_follow_up_is_served_from_the_kv_cache(client, model, server):
    first = create(client, model, instructions="Be brief.", max_output_tokens=32)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert metrics(server, KEY)["kvlm_kv_blocks_pinned"] > 0  # its conversation held
    second = create(client, model, instructions="Be brief.", input="And in Rome?",
                    previous_response_id=first.id)  # fmt: skip
    cached = second.usage.input_tokens_details.cached_tokens
    # the whole first turn (prompt and reply, as the template renders them again) is
    # found in the pool, up to the block the reply's re-rendering first differs in
    assert cached >= first.usage.input_tokens - 16, (cached, first.usage)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        create(client, model, previous_response_id=first.id)
    unstored = create(client, model, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_function_tool_round_trip(client, model):
    call = create(client, model, tools=[WEATHER], tool_choice="required", max_output_tokens=80)
    calls = [item for item in call.output if item.type == "function_call"]
    assert call.status == "completed" and len(calls) >= 1 and calls[0].name == "weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(create(client, model, tools=[WEATHER], max_output_tokens=80, stream=True,
                         tool_choice={"type": "function", "name": "weather"}))  # fmt: skip
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["city"] is not None
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}
    answer = create(client, model, tools=[WEATHER], previous_response_id=call.id, input=[output])
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens_details.cached_tokens > 0


def test_structured_output_and_refusals(client, model):
    out = create(client, model, max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})  # fmt: skip
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    with pytest.raises(openai.BadRequestError, match="frobnicate tools are not supported"):
        create(client, model, tools=[{"type": "frobnicate"}])
    with pytest.raises(openai.BadRequestError, match="input_image parts are not supported"):
        create(client, model, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]}])  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="no stored item"):
        create(client, model, input=[{"type": "item_reference", "id": "msg_nothing"}])


# ---------------------------------------------------------------------------- Codex's shapes
# What OpenAI's Codex CLI (0.171.0) sends on every request (tests/test_agent_codex.py runs
# it): a namespace of functions, a hosted web_search, client_metadata.

GEO = {"type": "namespace", "name": "geo", "description": "Places and their weather.",
       "tools": [WEATHER]}  # fmt: skip
CODEX_FIELDS = {"client_metadata": {"session_id": "s1", "turn_id": "t1"},
                "context_management": [{"type": "compaction", "compact_threshold": 9000}],
                "prompt_cache_options": {"ttl": "30m"}}  # fmt: skip


def test_codex_fields_are_accepted(client, model):
    """client_metadata (Codex's session and turn ids, which it cannot switch off) and the
    bookkeeping fields beside it: accepted, no effect on the answer."""
    plain = create(client, model, max_output_tokens=8)
    codex = create(client, model, max_output_tokens=8, store=False, prompt_cache_key="s1",
                   include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                   extra_body=CODEX_FIELDS)  # fmt: skip
    assert codex.output_text == plain.output_text


def test_hosted_tools_are_accepted_and_not_offered(client, model):
    """web_search (Codex sends it with every request) and the other tools OpenAI runs
    itself: the request is answered, the prompt is the one without them (the model is
    offered the functions alone)."""
    hosted = [{"type": "web_search", "external_web_access": False},
              {"type": "file_search", "vector_store_ids": ["vs_1"]},
              {"type": "code_interpreter", "container": {"type": "auto"}}]  # fmt: skip
    bare = create(client, model, tools=[WEATHER], max_output_tokens=4)
    mixed = create(client, model, tools=[*hosted, WEATHER], max_output_tokens=4)
    assert mixed.usage.input_tokens == bare.usage.input_tokens
    assert [t.type for t in mixed.tools] == ["web_search", "file_search", "code_interpreter",
                                             "function"]  # fmt: skip
    alone = create(client, model, tools=hosted[:1], max_output_tokens=4)
    assert alone.usage.input_tokens == create(client, model, max_output_tokens=4).usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="no tools are given"):
        create(client, model, tools=hosted[:1], tool_choice="required")


def test_a_tool_choice_naming_a_hosted_tool_is_answered_as_none(client, model):
    """tool_choice naming a tool OpenAI runs itself: its model uses the tool to write its
    response, a message, and calls no function. kvlm runs none: the message, as under
    "none" (the same prompt: the functions not offered), the choice echoed as given. A
    forced call of a tool the client runs, which kvlm does not offer, is a 400."""
    tools = [{"type": "web_search"}, WEATHER]
    none = create(client, model, tools=tools, tool_choice="none")
    for kind in ("web_search", "web_search_preview", "file_search"):
        out = create(client, model, tools=tools, tool_choice={"type": kind})
        assert [item.type for item in out.output] == ["message"]
        assert out.usage.input_tokens == none.usage.input_tokens
        assert out.output_text == none.output_text
        echo = out.tool_choice  # the SDK's own model, or a dict for a type it does not know
        assert (echo["type"] if isinstance(echo, dict) else echo.type) == kind
    streamed = list(create(client, model, tools=tools, stream=True,
                           tool_choice={"type": "web_search_preview"}))  # fmt: skip
    assert streamed[-1].response.output_text == none.output_text
    with pytest.raises(openai.BadRequestError, match="a call of one cannot be forced") as err:
        create(client, model, tools=[*tools, {"type": "apply_patch"}],
               tool_choice={"type": "apply_patch"})  # fmt: skip
    assert err.value.body["param"] == "tool_choice"


def test_a_namespaced_function_is_offered_and_its_call_names_the_namespace(client, model):
    """A namespace's functions are offered under their own names (the prompt is the one of
    the same functions at the top level); a call of one is a function_call item with its
    `namespace`, whole and streamed, and comes back in the input (Codex sends its calls
    back with it) as the same conversation, found in the prefix cache."""
    flat = create(client, model, tools=[WEATHER], max_output_tokens=4)
    forced = {"type": "function", "name": "weather"}
    call = create(client, model, tools=[GEO], tool_choice=forced, max_output_tokens=80)
    assert call.usage.input_tokens == flat.usage.input_tokens
    item = next(i for i in call.output if i.type == "function_call")
    assert (item.name, item.namespace) == ("weather", "geo")
    events = list(create(client, model, tools=[GEO], tool_choice=forced, max_output_tokens=80,
                         stream=True))  # fmt: skip
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.namespace) for i in added + done] == [("weather", "geo")] * 2
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": item.call_id,
            "name": "weather",
            "namespace": "geo",
            "arguments": item.arguments,
        },
        {"type": "function_call_output", "call_id": item.call_id, "output": "Sunny"},
    ]
    answer = create(client, model, tools=[GEO], input=history, store=False)
    again = create(client, model, tools=[GEO], input=history, store=False)
    assert answer.status in ("completed", "incomplete")
    assert again.usage.input_tokens_details.cached_tokens >= answer.usage.input_tokens - 16
    twice = {**GEO, "name": "other"}
    with pytest.raises(openai.BadRequestError, match="'weather' is given twice"):
        create(client, model, tools=[GEO, twice])


def test_background_responses_are_polled_and_cancelled(client, model):
    started = create(client, model, background=True)
    assert started.status in ("queued", "in_progress")
    deadline = time.time() + 60
    while client.responses.retrieve(started.id).status in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.1)
    assert client.responses.retrieve(started.id).status in ("completed", "incomplete")
    long = create(client, model, background=True, max_output_tokens=1500)
    stopped = client.responses.cancel(long.id)
    assert stopped.status in ("cancelled", "completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="only background"):
        client.responses.cancel(create(client, model).id)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_conversation_outlives_the_pools_pressure(tiny, pinned):
    """Engine.pin holds a stored conversation's cached blocks: later requests that need
    more blocks than the pool has evict the others, not those (the control, unpinned,
    loses them)."""
    engine, run = _engine_of(tiny)
    bs = engine.pool.block_size

    first = [(7 * i) % 200 + 3 for i in range(4 * bs)]
    conversation = first + run("a", first)
    held = len(engine.manager.match(conversation)[0])
    assert held == 4
    if pinned:
        engine.pin("resp_a", conversation, None, 0.5)
        assert engine.snapshot()["blocks_pinned"] == held
    for k in range(4):  # prompts of 12 blocks each, 48 in all: more than the pool's 20
        run(f"b{k}", [(11 * i + k) % 200 + 5 for i in range(12 * bs)])
    assert len(engine.manager.match(conversation)[0]) == (held if pinned else 0)
    engine.unpin("resp_a")
    assert engine.pool.num_used == 0 and engine.snapshot()["blocks_pinned"] == 0


def test_a_pin_with_a_life_is_let_go_after_it(tiny, monkeypatch):
    """A pin with a ttl (a Messages request's cache_control mark) holds its blocks until
    its life is over, pinned again from then; past it, the engine's next step lets it
    go (its blocks stay cached, evictable)."""
    import kvlm.engine.engine as engine_mod

    engine, run = _engine_of(tiny)
    bs = engine.pool.block_size
    now = [1000.0]
    monkeypatch.setattr(engine_mod.time, "monotonic", lambda: now[0])
    first = [(7 * i) % 200 + 3 for i in range(3 * bs)]
    conversation = first + run("a", first)
    engine.pin("cc", conversation, None, 0.5, ttl=300.0)
    assert engine.snapshot()["blocks_pinned"] == 3
    now[0] += 200
    engine.pin("cc", conversation, None, 0.5, ttl=300.0)  # again: 300 s from now
    now[0] += 200
    engine.step()
    assert engine.snapshot()["blocks_pinned"] == 3
    now[0] += 101
    engine.step()
    assert engine.snapshot()["blocks_pinned"] == 0 and not engine.pin_until
    assert len(engine.manager.match(conversation)[0]) == 3  # still cached


def test_pins_that_share_blocks_count_each_block_once(tiny):
    """Two stored responses of one conversation (a response and its follow-up) hold the
    same leading blocks: blocks_pinned counts the pool's blocks, so it stays within
    blocks_used (the server fuzzing met 4 pinned against 3 used), and the share that lets
    old pins go is of distinct blocks."""
    engine, run = _engine_of(tiny)
    bs = engine.pool.block_size

    first = [(7 * i) % 200 + 3 for i in range(3 * bs)]
    one = first + run("a", first)
    two = one + [(5 * i) % 200 + 4 for i in range(bs)]
    two = two + run("b", two)
    engine.pin("resp_a", one, None, 0.5)
    engine.pin("resp_b", two, None, 0.5)
    held = set(engine.manager.match(two)[0])
    assert set(engine.manager.match(one)[0]) < held  # the first's blocks are the second's
    snap = engine.snapshot()
    assert snap["blocks_pinned"] == len(held) == snap["blocks_used"]
    engine.unpin("resp_a")
    assert engine.snapshot()["blocks_pinned"] == len(held)  # still the second's
    engine.unpin("resp_b")
    assert engine.pool.num_used == 0 and engine.snapshot()["blocks_pinned"] == 0


def _engine_of(tiny):
    """An Engine over a 20-block pool, and run(rid, ids): one greedy request of 4 tokens to
    its end, its tokens."""
    from kvlm import SamplingParams
    from kvlm.engine.engine import Engine, EngineConfig

    engine = Engine(tiny, EngineConfig(num_blocks=20))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(rid: str, ids: list[int]) -> list[int]:
        engine.add_request(rid, ids, params)
        out = []
        while engine.has_work():
            out += [t for ev in engine.step() for t in ev.token_ids]
        return out

    return engine, run


# ---------------------------------------------------------------------------- agent clients


class Verdict(BaseModel):
    ok: bool


def weather_now(city: Annotated[str, Field(max_length=16)]) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


@pytest.mark.parametrize("road", ["responses", "chat"])
def test_the_openai_agents_sdk_runs_a_tool(server, model, road):
    """openai-agents on its default model (Responses) and on its Chat Completions model:
    a first turn that must call the tool (the SDK then resets tool_choice to auto), the
    tool's output sent back, a final answer in the agent's output type (JSON by the
    grammar: a random model's free text would only end at max_tokens, which the SDK
    takes as a failure, as it does with OpenAI's)."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0)
    kind = agents.OpenAIResponsesModel if road == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(
        name="weather", instructions="Answer with the tool.", tools=[
            agents.function_tool(weather_now)],
        model=kind(model=model, openai_client=client), output_type=Verdict,
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60,
                                            temperature=0),
    )  # fmt: skip
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and outputs[0].output.startswith("Sunny in")
    assert isinstance(result.final_output, Verdict)


def test_the_openai_agents_sdk_gets_a_call_under_tool_choice_auto(server, model):
    """openai-agents' Chat Completions model with tool_choice auto: the reply's call (text
    then a hermes <tool_call>, which a random model writes only when a regex makes it) is
    parsed into tool_calls, the SDK runs the tool and, told to stop at the first tool,
    answers its output."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0)
    reply = ('Let me look.\n<tool_call>\n{"name": "weather_now", "arguments": '
             '{"city": "Paris"}}\n</tool_call>')  # fmt: skip
    agent = agents.Agent(
        name="weather", instructions="Answer with the tool.", tools=[
            agents.function_tool(weather_now)],
        model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="auto", max_tokens=400, temperature=0,
            extra_body={"guided_regex": re.escape(reply)}),
        tool_use_behavior="stop_on_first_tool",
    )  # fmt: skip
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=2)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert calls and json.loads(calls[0].raw_item.arguments) == {"city": "Paris"}
    assert result.final_output == "Sunny in Paris"


def test_langchain_on_the_responses_api(server, model):
    from langchain_openai import ChatOpenAI

    url = f"http://127.0.0.1:{server}/v1"
    chat = ChatOpenAI(model=model, base_url=url, api_key=KEY, use_responses_api=True,
                      temperature=0, max_tokens=16, max_retries=0)  # fmt: skip
    reply = chat.invoke("Weather in Paris?")
    assert reply.response_metadata.get("id", "").startswith("resp_")
    assert "".join(chunk.text for chunk in chat.stream("Weather in Paris?")) == reply.text
    tools = chat.model_copy(update={"max_tokens": 80}).bind_tools([WEATHER], tool_choice="weather")
    called = tools.invoke("Weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "weather"


def test_pydantic_ais_responses_model(server, model):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY)
    agent = pydantic_ai.Agent(OpenAIResponsesModel(model, provider=provider))
    result = agent.run_sync("Weather in Paris?", model_settings={"max_tokens": 16,
                                                                  "temperature": 0})  # fmt: skip
    assert isinstance(result.output, str)


def test_the_store_is_bounded_by_count_bytes_and_age(monkeypatch):
    """The oldest stored responses go (their pins let go) past the count, past the bytes of
    their own text, and once expired; the one just stored stays."""
    from types import SimpleNamespace

    from kvlm.server import responses_api as api

    let_go = []

    class Reply(SimpleNamespace):
        def output(self):
            return []

    def stored(rid: str, text: str = "x") -> api.Stored:
        no_logprobs = SimpleNamespace(state=[])
        return api.Stored(Reply(id=rid, choices=no_logprobs), [{"role": "user", "content": text}],
                          [{"id": f"item-{rid}", "type": "message"}])  # fmt: skip

    store = api.ResponseStore(3, 60.0, lambda *a: None, let_go.append)
    for i in range(5):
        store.put(stored(f"r{i}"))
    store.put(store.entries["r4"])  # stored again (a background response, done): counted once
    assert store.nbytes == sum(e.nbytes for e in store.entries.values())
    assert list(store.entries) == ["r2", "r3", "r4"] and let_go == ["r0", "r1"]
    assert store.item("item-r4") is not None and store.item("item-r0") is None
    monkeypatch.setattr(api, "KEEP_BYTES", 1000)
    store.put(stored("big", "y" * 2000))
    assert list(store.entries) == ["big"] and store.nbytes == store.entries["big"].nbytes
    store.entries["big"].expires = 0.0  # its hour is up
    store.put(stored("late"))
    assert store.get("big") is None and "late" in store.entries
