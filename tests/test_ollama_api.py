"""Ollama's API: the real `ollama` Python client against a real `kvlm serve` of the
default model on 127.0.0.1, one server for the file.

Each check is of the protocol and of what reaches the engine: the probes and listings
Ollama's clients send first, chat and generate whole and streamed (the stream equal to
the whole reply), options reaching sampling (num_predict, seed, stop, num_ctx), format
json and a schema giving parseable JSON, tools offered to the template (the prompt counted
as /tokenize renders it with them), pull's honest answer, and bad bodies getting Ollama's
400 without harming the server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from serving import kvlm_serve, wait_idle

ollama = pytest.importorskip("ollama")

KEY = "ollama-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 16}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--max-context", "1024", "--threads", "2", "--api-key", KEY) as (port, _):
        yield port


@pytest.fixture(scope="module")
def base(server):
    return f"http://127.0.0.1:{server}"


@pytest.fixture(scope="module")
def ol(base):
    return ollama.Client(host=base, headers=AUTH)


@pytest.fixture(scope="module")
def name(ol):
    return ol.list().models[0].model


def tokens(base, messages, tools=None) -> int:
    """The prompt's length as /tokenize renders the chat (the chat route's template)."""
    body = {"messages": messages} | ({"tools": tools} if tools else {})
    reply = httpx.post(base + "/tokenize", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def test_the_probes_answer_without_a_key(base):
    for method in ("GET", "HEAD"):
        root = httpx.request(method, base + "/")
        version = httpx.request(method, base + "/api/version")
        assert root.status_code == version.status_code == 200
        if method == "HEAD":
            assert root.content == version.content == b""
    assert "Ollama is running" in httpx.get(base + "/").text
    number = httpx.get(base + "/api/version").json()["version"]
    # GitHub Copilot asks for at least 0.6.4
    assert tuple(map(int, number.split("."))) >= (0, 6, 4)
    # the rest takes the key, and says so in Ollama's shape
    refused = httpx.get(base + "/api/tags")
    assert refused.status_code == 401 and set(refused.json()) == {"error"}


def test_tags_show_and_ps_describe_the_served_model(ol, name, base):
    assert name.endswith(":latest")  # Ollama's names carry a tag
    listed = ol.list().models[0]
    assert listed.size > 0 and listed.details.family == "llama"
    shown = ol.show(name)
    # SmolLM2's template renders no tools, and it does not reason
    assert shown.capabilities == ["completion", "tools"]  # in its system turn
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 1024  # the server's context
    assert "<|im_start|>" in shown.template and shown.details.parameter_size == "135M"
    assert ol.show(name.removesuffix(":latest")).capabilities == ["completion", "tools"]
    with pytest.raises(ollama.ResponseError) as missing:
        ol.show("llama3.2")
    assert missing.value.status_code == 404 and "llama3.2" in missing.value.error
    running = ol.ps().models
    assert [m.model for m in running] == [name] and running[0].context_length == 1024


def test_chat_whole_and_streamed_agree(ol, name, base, server):
    whole = ol.chat(model=name, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert 0 < whole.eval_count <= 16
    assert whole.prompt_eval_count == tokens(base, ASK)
    for duration in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(whole, duration), int) and getattr(whole, duration) >= 0
    parts = list(ol.chat(model=name, messages=ASK, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    assert parts[-1].done_reason == whole.done_reason
    wait_idle(server, KEY)


def test_the_published_schema_describes_ollamas_routes_and_answers(base, name):
    """/openapi.json lists Ollama's routes with their bodies, and the answers given are
    what it says: a chat whole and each of its NDJSON lines, tags, an error."""
    doc = httpx.get(base + "/openapi.json").json()
    paths = {p: set(ops) for p, ops in doc["paths"].items()}
    for path, method in (("/api/chat", "post"), ("/api/generate", "post"), ("/api/show", "post"),
                         ("/api/pull", "post"), ("/api/tags", "get"), ("/api/ps", "get"),
                         ("/api/version", "get"), ("/", "get")):  # fmt: skip
        assert method in paths.get(path, ()), path
    chat = doc["paths"]["/api/chat"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatRequest")  # fmt: skip

    def holds(answer: dict, path: str, status: str = "200", kind: str = "application/json"):
        media = doc["paths"][path]["post" if path != "/api/tags" else "get"]["responses"]
        schema = media[status]["content"][kind]["schema"]
        jsonschema.validate(answer, schema | {"components": doc["components"]})

    body = {"model": name, "messages": ASK, "options": GREEDY}
    holds(httpx.post(base + "/api/chat", json=body | {"stream": False}, headers=AUTH).json(),
          "/api/chat")  # fmt: skip
    lines = httpx.post(base + "/api/chat", json=body, headers=AUTH).text.splitlines()
    for line in lines:
        holds(json.loads(line), "/api/chat", kind="application/x-ndjson")
    holds(httpx.get(base + "/api/tags", headers=AUTH).json(), "/api/tags")
    unknown = httpx.post(base + "/api/chat", json=body | {"model": "nope"}, headers=AUTH)
    holds(unknown.json(), "/api/chat", str(unknown.status_code))


def test_generate_templated_raw_and_streamed(ol, name, base):
    prompt = "Count to five:"
    whole = ol.generate(model=name, prompt=prompt, system="Be brief.", options=GREEDY)
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    assert whole.done and whole.response and whole.prompt_eval_count == tokens(base, turn)
    streamed = list(ol.generate(model=name, prompt=prompt, system="Be brief.", options=GREEDY,
                                stream=True))  # fmt: skip
    assert "".join(p.response for p in streamed) == whole.response and streamed[-1].done
    raw = ol.generate(model=name, prompt="1, 2, 3,", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < 10  # the prompt as it is: no template around it
    assert raw.response.startswith(" 4")


def test_options_reach_sampling(ol, name, base):
    short = ol.chat(model=name, messages=ASK, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    # seeded sampling at temperature 1: the same seed, the same reply
    seeded = {"temperature": 1.0, "seed": 1234, "num_predict": 24}
    one, two = (ol.chat(model=name, messages=ASK, options=seeded).message.content for _ in "ab")
    assert one == two
    # stop: a piece of the greedy reply ends it there
    text = ol.chat(model=name, messages=ASK, options=GREEDY).message.content
    stop = text[len(text) // 2 :][:3]
    cut = ol.chat(model=name, messages=ASK, options=GREEDY | {"stop": [stop]})
    assert cut.message.content == text[: text.index(stop)] and cut.done_reason == "stop"
    # num_ctx narrows the context this request may fill
    prompt = tokens(base, ASK)
    narrow = ol.chat(model=name, messages=ASK, options={"temperature": 0, "num_ctx": prompt + 2})
    assert narrow.eval_count == 2 and narrow.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as small:
        ol.chat(model=name, messages=ASK, options={"num_ctx": prompt})
    assert small.value.status_code == 400 and "context length" in small.value.error
    # a num_ctx past the server's is bounded by it, not refused
    wide = ol.chat(model=name, messages=ASK, options=GREEDY | {"num_ctx": 131072})
    assert wide.message.content == text


def test_format_json_and_a_schema(ol, name):
    for streamed in (False, True):
        kw = {"model": name, "messages": [{"role": "user", "content": "Describe a person."}],
              "options": {"temperature": 0, "num_predict": 64}}  # fmt: skip
        if streamed:
            text = "".join(p.message.content for p in ol.chat(**kw, format=PERSON, stream=True))
        else:
            text = ol.chat(**kw, format=PERSON).message.content
        jsonschema.validate(json.loads(text), PERSON)
    # greedy: sampled at temperature 1, "any JSON" once ran past its 48 tokens inside a
    # string (a cut-off document is what Ollama returns too: done_reason "length")
    anything = ol.chat(model=name, messages=ASK, format="json",
                       options={"temperature": 0, "num_predict": 48})  # fmt: skip
    assert anything.done_reason == "stop", anything
    assert isinstance(json.loads(anything.message.content), dict)
    made = ol.generate(model=name, prompt="A person:", format=PERSON,
                       options={"temperature": 0, "num_predict": 64})  # fmt: skip
    assert made.done_reason == "stop", made
    jsonschema.validate(json.loads(made.response), PERSON)


def test_tools_reach_the_template_and_a_tool_round_trip(ol, name, base):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    offered = ol.chat(model=name, messages=ask, tools=[WEATHER], options=GREEDY)
    assert offered.done
    assert offered.prompt_eval_count == tokens(base, ask, [WEATHER]) > tokens(base, ask)
    # a call made and its result (Ollama's history: arguments an object, tool_name)
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_name": "weather"}]  # fmt: skip
    answer = ol.chat(model=name, messages=history, tools=[WEATHER], options=GREEDY)
    same = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1_0",
         "name": "weather"}]  # fmt: skip
    assert answer.prompt_eval_count == tokens(base, same, [WEATHER])


def test_think_keep_alive_logprobs_and_loading(ol, name):
    reply = ol.chat(model=name, messages=ASK, think=True, keep_alive="5m", options=GREEDY,
                    logprobs=True, top_logprobs=2)  # fmt: skip
    assert reply.done and len(reply.logprobs) == reply.eval_count
    assert all(len(entry.top_logprobs) == 2 for entry in reply.logprobs)
    # nothing to generate: Ollama's way to load a model, answered at once
    assert ol.generate(model=name, prompt="").done_reason == "load"
    assert ol.chat(model=name, messages=[]).done_reason == "load"


def test_pull_is_answered_honestly(ol, name):
    lines = list(ol.pull(name, stream=True))
    assert name in lines[0].status and lines[-1].status == "success"
    assert ol.pull(name).status == "success"
    with pytest.raises(ollama.ResponseError) as other:
        ol.pull("llama3.2")
    assert other.value.status_code == 404 and "pulls no models" in other.value.error


BAD = [
    b"{not json",
    {"messages": ASK},  # no model
    {"model": "M", "messages": "hello"},
    {"model": "M", "messages": ASK, "stream": "yes"},
    {"model": "M", "messages": ASK, "options": {"temperature": -1}},
    {"model": "M", "messages": ASK, "options": {"num_ctx": 0}},
    {"model": "M", "messages": ASK, "format": "xml"},
    {"model": "M", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
    {"model": "M", "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": "M", "messages": ASK, "tools": [{"type": "function", "function": {"name": "a b"}}]},
]  # fmt: skip
BAD_GENERATE = [
    {"model": "M", "prompt": "def f(", "suffix": "return 1"},
    {"model": "M", "prompt": "hi", "template": "{{ .Prompt }}"},
    {"model": "M", "prompt": "hi", "context": [1, 2, 3]},
    {"model": "M", "prompt": "hi", "width": 512},
]


def test_bad_bodies_get_ollamas_400_and_the_server_goes_on(base, name, ol):
    def post(path, body):
        if isinstance(body, dict):
            body = json.dumps({k: name if v == "M" else v for k, v in body.items()}).encode()
        return httpx.post(
            base + path, content=body, headers=AUTH | {"Content-Type": "application/json"}
        )

    for path, bodies in (("/api/chat", BAD), ("/api/generate", BAD_GENERATE)):
        for body in bodies:
            reply = post(path, body)
            assert reply.status_code == 400, (body, reply.text)
            error = reply.json()
            assert set(error) == {"error"} and error["error"], (body, error)
    assert post("/api/chat", {"model": "nope", "messages": ASK}).status_code == 404
    assert post("/api/embed", {"model": "M", "input": "hi"}).status_code == 400
    assert httpx.request("DELETE", base + "/api/delete", headers=AUTH, json={"model": name}
                         ).status_code == 400  # fmt: skip
    assert ol.chat(model=name, messages=ASK, options=GREEDY).done
    # unknown fields are ignored, as Ollama's server ignores them (its clients add fields)
    for extra in ({"surprise": 1}, {"options": {"no_such_option": 1, "num_predict": 4}}):
        body = {"model": "M", "messages": ASK, "stream": False, "options": {"num_predict": 4}}
        body |= extra
        assert post("/api/chat", body).status_code == 200, body
