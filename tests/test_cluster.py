"""`kvlm serve --replicas 2` on Ray Serve: a real cluster process on 127.0.0.1 (a local Ray,
two replicas of one thread each), driven by the official openai client; and the pure parts
of its routing (the ring, the route key, the /metrics sum) on their own."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

import serving
from serving import get, kvlm_serve, openai_client

KEY = "cluster-key"
COMMON = ("--api-key", KEY, "--threads", "1", "--max-context", "1024", "--log-level", "warning")
ENGINE_WAIT_S = 0.05  # /v1/kv's wait for a busy engine: a prompt's prefill outlasts it
# --top-k: a sampling default each replica builds from the flags (greedy answers ignore it)
CLUSTER = ("--replicas", "2", "--max-body", "16KiB", "--engine-wait", str(ENGINE_WAIT_S),
           "--top-k", "40", *COMMON)  # fmt: skip
REPLICA_PROCESS = "ray::ServeReplica:kvlm:KvlmReplica"  # Ray's title for a replica's worker


# ------------------------------------------------------------------- routing, on its own


def test_the_ring_keeps_keys_in_place_and_moves_only_a_leaving_replicas():
    from kvlm.cluster.ring import HashRing

    keys = [f"prefix-{i}".encode() for i in range(300)]
    ring = HashRing(["a", "b", "c"])
    owners = {k: ring.pick(k, {}) for k in keys}
    assert {k: ring.pick(k, {}) for k in keys} == owners  # the same key, the same replica
    assert all(sum(o == m for o in owners.values()) > 50 for m in "abc")  # spread over all
    smaller = HashRing(["a", "b"])
    for k, owner in owners.items():
        if owner != "c":
            assert smaller.pick(k, {}) == owner  # only c's keys move


def test_a_slot_lives_on_one_replica_and_requests_naming_it_go_there():
    """llama-server's slot N lives on replica N mod R in the order of the replicas' ids:
    POST /slots/N and a completion's or chat's id_slot N name it (kvlm.cluster.keys.
    slot_of, the body read only where it holds the name), anything else names none; the
    ingress's GET /slots takes each slot from the replica it lives on."""
    from kvlm.cluster.app import merged_slots
    from kvlm.cluster.keys import slot_of
    from kvlm.cluster.router import slot_replica

    assert slot_of("POST", "/slots/3", b"") == 3
    assert slot_of("POST", "/slots/0", b'{"filename": "a"}') == 0
    for path in ("/slots/-1", "/slots/x", "/slots/1e3", "/slots/\u0663", "/slots/" + "9" * 10):
        assert slot_of("POST", path, b"") is None, path
    assert slot_of("GET", "/slots/3", b"") is None and slot_of("GET", "/slots", b"") is None
    chat = "/v1/chat/completions"
    assert slot_of("POST", chat, b'{"messages": [], "id_slot": 5}') == 5
    assert slot_of("POST", "/v1/completions", b'{"prompt": "a", "id_slot": 0}') == 0
    for body in (b'{"id_slot": -1}', b'{"id_slot": "1"}', b'{"id_slot": true}',
                 b'{"id_slot": 1.0}', b'{"id_slot": null}', b'["id_slot"]', b'{"id_slot": 1',
                 b'{"prompt": "say \\"id_slot\\""}', b"[" * 100_000 + b'"id_slot"'):  # fmt: skip
        assert slot_of("POST", chat, body) is None, body
    assert slot_of("POST", "/v1/responses", b'{"id_slot": 1}') is None  # not a field of it
    ids = ["b-replica", "a-replica", "c-replica"]
    assert [slot_replica(n, ids) for n in range(4)] == ["a-replica", "b-replica", "c-replica",
                                                        "a-replica"]  # fmt: skip
    listings = {rid: [{"id": n, "n_tokens": 10 * i + n} for n in range(4)]
                for i, rid in enumerate(sorted(ids))}  # fmt: skip
    assert [s["n_tokens"] for s in merged_slots(listings)] == [0, 11, 22, 3]


def test_the_ring_bounds_a_replicas_load():
    from kvlm.cluster.ring import HashRing, least_loaded

    ring = HashRing(["a", "b"])
    key = b"hot prefix"
    home, other = list(ring.walk(key))
    # 2 in flight: cap = ceil(1.25 * 3 / 2) = 2, so home takes a second one, not a third
    assert ring.pick(key, {home: 1, other: 1}, floor=0) == home
    assert ring.pick(key, {home: 2, other: 0}, floor=0) == other
    assert ring.pick(key, {home: 3, other: 3}, floor=0) == home  # cap 5: room again
    # the floor: below 4 requests home is never passed over; past it, the relative cap
    assert ring.pick(key, {home: 3, other: 0}) == home
    assert ring.pick(key, {home: 4, other: 0}) == other
    assert ring.pick(key, {home: 20, other: 12}) == home  # cap ceil(1.25 * 33 / 2) = 21
    assert ring.pick(key, {home: 21, other: 11}) == other
    assert least_loaded(["a", "b"], {"a": 2, "b": 1}) == "b"
    assert {least_loaded(["a", "b"], {}, turn) for turn in range(2)} == {"a", "b"}


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from kvlm.loading import load_model

    return load_model(default_model_path).tokenizer


def _chat(system: str, question: str, **extra) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def test_the_route_key_is_the_prefix_cache_key_of_the_first_blocks(tokenizer):
    from kvlm.cache.prefix import block_key, root_key
    from kvlm.cluster.keys import route_key

    system = "You answer questions about the history of the Roman empire. " * 8
    body = _chat(system, "Who was Augustus?")
    ids = tokenizer.encode_chat([{"role": "system", "content": system},
                                 {"role": "user", "content": "Who was Augustus?"}])  # fmt: skip
    expected = root_key(None)
    for i in range(4):
        expected = block_key(expected, tuple(ids[16 * i : 16 * (i + 1)]))
    assert route_key("/v1/chat/completions", body, tokenizer, 16) == expected
    # the same system prompt, another question: the same key; another tenant's: another
    same = route_key("/v1/chat/completions", _chat(system, "And Nero?"), tokenizer, 16)
    assert same == expected
    other = route_key("/v1/chat/completions", _chat("You sell shoes. " * 10, "Hi"), tokenizer, 16)
    assert other not in (None, expected)
    salted = _chat(system, "Who was Augustus?", cache_salt="tenant-1")
    assert route_key("/v1/chat/completions", salted, tokenizer, 16) not in (None, expected)
    prompt = json.dumps({"model": "m", "prompt": ids[:40]}).encode()  # 2 full blocks
    assert route_key("/v1/completions", prompt, tokenizer, 16) == block_key(
        block_key(root_key(None), tuple(ids[:16])), tuple(ids[16:32])
    )
    # nothing to route by: no full block, an unreadable body, another route
    short = json.dumps({"model": "m", "prompt": "Hi"}).encode()
    assert route_key("/v1/completions", short, tokenizer, 16) is None
    assert route_key("/v1/completions", b"{not json", tokenizer, 16) is None
    assert route_key("/v1/models", b"", tokenizer, 16) is None


def test_ollamas_chat_and_generate_route_by_the_prompt_they_mean(tokenizer):
    """/api/chat and /api/generate are keyed as the chat (a raw generate: the completion)
    the replica runs for them: an Ollama conversation meets its prefix."""
    from kvlm.cluster.keys import route_key

    system = "You answer questions about the history of the Roman empire. " * 8
    key = route_key("/v1/chat/completions", _chat(system, "Who was Augustus?"), tokenizer, 16)
    chat = _chat(system, "Who was Augustus?", options={"temperature": 0}, stream=False)
    assert key is not None and route_key("/api/chat", chat, tokenizer, 16) == key
    generate = {"model": "m", "system": system, "prompt": "Who was Augustus?"}
    assert route_key("/api/generate", json.dumps(generate).encode(), tokenizer, 16) == key
    raw = json.dumps({"model": "m", "prompt": system, "raw": True}).encode()
    completion = json.dumps({"model": "m", "prompt": system}).encode()
    assert route_key("/api/generate", raw, tokenizer, 16) == route_key(
        "/v1/completions", completion, tokenizer, 16) is not None  # fmt: skip
    loading = json.dumps({"model": "m"}).encode()  # Ollama's way to load a model: no prompt
    assert route_key("/api/chat", loading, tokenizer, 16) is None


def test_a_responses_request_routes_by_its_prompt_or_to_the_replica_that_stored_it(tokenizer):
    from kvlm.cluster.keys import affinity, replica_tag, route_key
    from kvlm.server import responses_api

    system = "You answer questions about the history of the Roman empire. " * 8
    chat = _chat(system, "Who was Augustus?")
    responses = json.dumps({"model": "m", "instructions": system,
                            "input": "Who was Augustus?"}).encode()  # fmt: skip
    key = route_key("/v1/chat/completions", chat, tokenizer, 16)
    assert key is not None and route_key("/v1/responses", responses, tokenizer, 16) == key
    # a stored response's id names the replica that made it; the ingress reads it back
    tag = replica_tag("replica-abc")
    assert len(tag) == 8 and tag != replica_tag("replica-abd")
    made = responses_api.new_id("resp", tag)
    assert responses_api.tag_of(made) == tag and responses_api.tag_of("resp_abcdef") is None
    follow = json.dumps({"model": "m", "input": "And Nero?", "previous_response_id": made})
    assert affinity("POST", "/v1/responses", follow.encode()) == tag
    assert route_key("/v1/responses", follow.encode(), tokenizer, 16) is None
    ref = {"model": "m", "input": [{"type": "item_reference", "id": f"msg_{tag}_00"}]}
    assert affinity("POST", "/v1/responses", json.dumps(ref).encode()) == tag
    for method, path in (("GET", f"/v1/responses/{made}"), ("DELETE", f"/v1/responses/{made}"),
                         ("GET", f"/v1/responses/{made}/input_items"),
                         ("POST", f"/v1/responses/{made}/cancel")):  # fmt: skip
        assert affinity(method, path, b"") == tag
    # nothing stored named: no affinity (the prefix key, or the least loaded replica)
    deep = b"[" * 200_000 + b"]" * 200_000  # past json's recursion depth: no error either
    for body in (responses, b"{not json", b"[1]", b'{"previous_response_id": 7}', deep):
        assert affinity("POST", "/v1/responses", body) is None
    assert affinity("POST", "/v1/chat/completions", follow.encode()) is None
    assert affinity("GET", "/v1/responses/resp_plain", b"") is None


def test_metrics_are_summed_series_by_series():
    from kvlm.cluster.metrics import aggregate

    def replica(hits: int, queries: int, disk: int) -> str:
        return "\n".join([
            "# HELP kvlm_prefix_cache_queries_total Prompt tokens looked up.",
            "# TYPE kvlm_prefix_cache_queries_total counter",
            f"kvlm_prefix_cache_queries_total {queries}",
            "# HELP kvlm_prefix_cache_hits_total Prompt tokens served from cache.",
            "# TYPE kvlm_prefix_cache_hits_total counter",
            f"kvlm_prefix_cache_hits_total {hits}",
            "# HELP kvlm_prefix_cache_hit_rate Prefix cache hits over queries.",
            "# TYPE kvlm_prefix_cache_hit_rate gauge",
            f"kvlm_prefix_cache_hit_rate {hits / queries:g}",
            "# HELP kvlm_kv_tier_hits_total Blocks found in a tier.",
            "# TYPE kvlm_kv_tier_hits_total counter",
            f'kvlm_kv_tier_hits_total{{tier="disk"}} {disk}',
            'kvlm_kv_tier_hits_total{tier="redis"} 1',
            "# HELP kvlm_ttft_seconds Time to first token.",
            "# TYPE kvlm_ttft_seconds histogram",
            'kvlm_ttft_seconds_bucket{le="0.1"} 1',
            'kvlm_ttft_seconds_bucket{le="+Inf"} 2',
            "kvlm_ttft_seconds_sum 0.5",
            "kvlm_ttft_seconds_count 2",
            "# HELP kvlm_engine_step_seconds_max The longest engine step.",
            "# TYPE kvlm_engine_step_seconds_max gauge",
            f"kvlm_engine_step_seconds_max {hits / 10:g}",
        ])  # fmt: skip

    text = aggregate([replica(10, 100, 3), replica(30, 100, 4)], {"r1": 5, "r2": 2})
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[0] != "#")
    assert samples["kvlm_prefix_cache_hits_total"] == "40"
    assert samples["kvlm_prefix_cache_hit_rate"] == "0.2"  # 40 / 200, not 0.1 + 0.3
    assert samples['kvlm_kv_tier_hits_total{tier="disk"}'] == "7"
    assert samples['kvlm_kv_tier_hits_total{tier="redis"}'] == "2"
    assert samples['kvlm_ttft_seconds_bucket{le="+Inf"}'] == "4"
    assert samples["kvlm_ttft_seconds_sum"] == "1"
    assert samples["kvlm_engine_step_seconds_max"] == "3"  # the longest, not 1 + 3
    assert samples["kvlm_replicas"] == "2"
    assert samples['kvlm_cluster_requests_routed_total{replica="r1"}'] == "5"
    assert text.count("# TYPE kvlm_kv_tier_hits_total counter") == 1


def test_a_single_kvlm_serve_never_imports_ray():
    code = "import sys, kvlm.cli, kvlm.server.app; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_bad_cluster_flags_are_one_line_before_anything_starts(capsys):
    from kvlm.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    assert main(["serve", "--replicas", "2", "--route-balance", "0.5"]) == 2
    assert main(["serve", "--replicas", "2", "--top-p", "0"]) == 2  # a replica's flag
    assert capsys.readouterr().err.count("kvlm: error:") == 3


# --------------------------------------------------------------------- a real cluster


@pytest.fixture(scope="module")
def reference(plain_serve_answers):
    """One plain `kvlm serve`'s four greedy answers and its pool size: a future, computed
    while the cluster starts (its start is mostly waiting on Ray); the session's, which
    test_ray_cluster reads too (conftest.py)."""
    return plain_serve_answers


def single_kvlm_serve(common: tuple[str, ...], key: str) -> tuple[list, float]:
    """A plain `kvlm serve COMMON`: its four greedy answers (_answers) and its pool's
    blocks; every call bounded, so a hung one fails instead of stalling the suite."""
    with kvlm_serve(*common) as (port, _):
        alone = openai_client(port, key).with_options(timeout=60)
        model = alone.models.list().data[0].id
        return _answers(alone, model), serving.metrics(port, key)["kvlm_kv_blocks_total"]


@pytest.fixture(scope="module")
def server(reference):
    with kvlm_serve(*CLUSTER) as (port, proc):
        yield port, proc


@pytest.fixture(scope="module")
def port(server):
    return server[0]


@pytest.fixture(scope="module")
def client(port):
    return openai_client(port, KEY)


def metrics(port: int) -> dict[str, float]:
    return serving.metrics(port, KEY)


def wait_for(what, timeout: float = 60, step: float = 0.25):
    """Poll `what()` until it is truthy (bounded); return its last value."""
    deadline = time.time() + timeout
    while not (value := what()) and time.time() < deadline:
        time.sleep(step)
    return value


def all_up(port: int) -> bool:
    """Both replicas known to the ingress's router (/health asks those it knows). Until
    Ray Serve has deployed the ingress, its proxy answers /health 404 in plain text."""
    status, body = get(port, "/health")
    return status == 200 and json.loads(body).get("replicas") == 2


def ask(client, model, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    messages = [{"role": "user", "content": "Name three fruits."}]
    return client.chat.completions.create(model=model, messages=messages, **kw)


def complete(client, model, **kw):
    kw.setdefault("max_tokens", 24)
    prompt = kw.pop("prompt", "The capital of France is")
    return client.completions.create(model=model, prompt=prompt, temperature=0, **kw)


def _answers(client, model) -> list:
    chat = ask(client, model).choices[0].message.content
    chat_stream = "".join(c.choices[0].delta.content or "" for c in ask(client, model, stream=True))
    text = complete(client, model).choices[0].text
    text_stream = "".join(c.choices[0].text for c in complete(client, model, stream=True))
    return [chat, chat_stream, text, text_stream]


@pytest.mark.slow
def test_answers_equal_a_single_kvlm_serve(port, client, model, reference):
    ours = _answers(client, model)
    assert ours[0] and ours[0] == ours[1] and ours[2] == ours[3]
    alone, blocks = reference.result(timeout=300)
    assert alone == ours
    # a replica slower than the ingress's scrape window (SCRAPE_TIMEOUT_S: two busy cores,
    # the suite beside it) is left out of that one scrape, not lost: ask again, bounded
    m = wait_for(lambda: (m := metrics(port))["kvlm_replicas"] == 2 and m, timeout=60, step=1)
    assert m and m["kvlm_kv_blocks_total"] == 2 * blocks
    assert json.loads(get(port, "/health")[1]) == {"status": "ok", "replicas": 2}


@pytest.mark.slow
def test_the_proxy_and_replicas_run_at_the_servers_priority(server):
    """Ray lowers its workers to niceness 15; on a cluster kvlm starts they are the server
    (Serve's proxy starved beside three test workers at 0 and never answered)."""
    _, proc = server
    assert len(_replica_pids(proc)) == 2
    workers = {pid: psutil.Process(pid).nice()
               for pid in _replica_pids(proc, ("ray::ProxyActor", REPLICA_PROCESS))}  # fmt: skip
    assert len(workers) == 3 and set(workers.values()) == {psutil.Process(proc.pid).nice()}, workers


@pytest.mark.slow
def test_the_replicas_take_the_sampling_flags(port, client, model):
    """CLUSTER's --top-k is the replicas' default: in the card, and a request that sets no
    top_k takes it (the replica's header, passed on by the ingress)."""
    card = client.models.list().data[0]
    assert card.model_extra["sampling_defaults"] == {"top_k": 40}
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert raw.headers["kvlm-sampling-defaults"] == "top_k=40"


@pytest.mark.slow
def test_a_conversation_of_stored_responses_follows_its_replica(port, client, model):
    """Each stored response lives on the replica that made it: follow-ups (previous_response_id),
    GET, input_items and DELETE reach it there, whichever replica the first turn took."""
    assert wait_for(lambda: all_up(port))
    first = client.responses.create(model=model, input="Name a colour.", max_output_tokens=4,
                                     temperature=0)  # fmt: skip
    chain = [first]
    for turn in range(5):  # without affinity, each lands on the other replica half the time
        chain.append(client.responses.create(
            model=model, input=f"And another, number {turn}?", max_output_tokens=4,
            temperature=0, previous_response_id=chain[-1].id))  # fmt: skip
    assert len({r.id.split("_")[1] for r in chain}) == 1  # one replica's tag
    for r in chain:
        assert client.responses.retrieve(r.id).id == r.id
        assert client.responses.input_items.list(r.id).data
    assert chain[-1].usage.input_tokens_details.cached_tokens > 0  # its replica's prefix cache
    for r in chain:
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


@pytest.mark.slow
def test_errors_pass_through(port, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, model, temperature=5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        ask(openai_client(port, "wrong-key"), model)
    assert get(port, "/metrics")[0] == 401  # the replicas' own key check
    big = json.dumps({"model": model, "prompt": "x" * 20_000}).encode()  # over --max-body
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", big, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["type"] == "invalid_request_error"
    assert complete(client, model, max_tokens=4).choices[0].text  # and it goes on


TENANTS = ["a bakery", "a law firm", "a bicycle shop", "an observatory"]
QUESTIONS = ["When do you open?", "Where are you?", "What do you sell?", "Who works there?"]


def _tenant_workload(port: int, model: str, nonce: str) -> float:
    """Each tenant's questions in turn under its own ~200-token system prompt, one request
    at a time; returns the prompt tokens the replicas served from their prefix caches."""
    client = openai_client(port, KEY)
    assert wait_for(lambda: all_up(port))  # else the first requests all go to one replica
    before = metrics(port)["kvlm_prefix_cache_hits_total"]
    for tenant in TENANTS:
        rule = f"Answer politely and briefly, as the staff of {tenant} would. "
        system = f"[{nonce}] You are the assistant of {tenant}. " + rule * 14
        for question in QUESTIONS:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    return metrics(port)["kvlm_prefix_cache_hits_total"] - before


@pytest.fixture(scope="module")
def round_robin():
    """A second cluster: round-robin routing, both replicas on one real Redis tier."""
    from redis_server import redis_server

    with (
        redis_server() as redis,
        kvlm_serve("--routing", "round-robin", "--kv-tier", redis.url, *CLUSTER) as (rr, _),
    ):
        assert wait_for(lambda: all_up(rr))
        yield rr


def _tier_hits(port: int) -> float:
    return metrics(port)['kvlm_kv_tier_hits_total{tier="redis"}']


@pytest.mark.slow
def test_prefix_routing_hits_more_than_round_robin(port, round_robin, model):
    prefix = _tenant_workload(port, model, "prefix")
    auth = {"Authorization": f"Bearer {KEY}"}
    block_size = json.loads(get(round_robin, "/v1/kv", auth)[1])["block_size"]
    tier_before = _tier_hits(round_robin)
    hits = _tenant_workload(round_robin, model, "round-robin")
    # the pool's own hits: blocks a replica loaded from the Redis tier count as hits too
    round_robin_pool = hits - block_size * (_tier_hits(round_robin) - tier_before)
    # prefix: one miss per tenant; round-robin: one per tenant and replica (tenant-major
    # order alternates each tenant's questions over both replicas)
    assert prefix >= 1.4 * round_robin_pool > 0, (prefix, round_robin_pool)


def _stream(client, model, prompt: str, max_tokens: int = 900):
    """A long streamed completion, its first chunk read (its replica is decoding)."""
    stream = complete(client, model, prompt=prompt, max_tokens=max_tokens, stream=True,
                      extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    return stream


def _endings(streams) -> list[str]:
    """Each stream read to its end: "done", or "failed" on the replica_failed error event
    (not a hang or a broken stream), sorted."""
    endings = []
    for stream in streams:
        try:
            for _ in stream:
                pass
            endings.append("done")
        except openai.APIError as exc:
            assert exc.body["code"] == "replica_failed"
            endings.append("failed")
    return sorted(endings)


@pytest.mark.slow
def test_a_client_that_hangs_up_has_its_request_aborted_on_its_replica(port, client, model):
    before = metrics(port)["kvlm_requests_aborted_total"]
    _stream(client, model, "Tell me a story.").close()  # mid-stream
    with pytest.raises(openai.APITimeoutError):  # gone before a whole answer
        client.with_options(timeout=1.0).completions.create(
            model=model, prompt="Tell me another story.", max_tokens=900,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    def settled():
        m = metrics(port)
        return m["kvlm_requests_aborted_total"] == before + 2 and m["kvlm_kv_blocks_used"] == 0

    assert wait_for(settled, timeout=30), metrics(port)


def _replica_pids(
    proc: subprocess.Popen, titles: tuple[str, ...] = (REPLICA_PROCESS,)
) -> list[int]:
    """The replicas' worker processes (or those of other `titles`): descendants of this
    cluster's `kvlm serve` (its local Ray), whatever else runs on the machine."""
    pids = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.name().startswith(titles) and child.status() != "zombie":
                pids.append(child.pid)
        except psutil.Error:  # gone meanwhile
            pass
    return pids


@pytest.mark.slow
def test_a_killed_replica_ends_its_streams_cleanly_and_comes_back(server, client, model):
    port, proc = server  # last in the module: the cluster comes back, but with new ids
    assert wait_for(lambda: all_up(port))
    # no full block: the router sends each to the least loaded replica, one each
    # 80 tokens: in flight at the kill on any machine, short enough to read to its end
    streams = [_stream(client, model, "Tell me about cats.", 80),
               _stream(client, model, "Tell me about dogs.", 80)]  # fmt: skip
    pids = _replica_pids(proc)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    assert _endings(streams) == ["done", "failed"]
    for i in range(3):  # the survivor answers; the router has dropped the dead one
        assert complete(client, model, prompt=f"Hello number {i}", max_tokens=4).choices[0].text

    def back():
        return metrics(port)["kvlm_replicas"] == 2 and len(_replica_pids(proc)) == 2

    assert wait_for(back, timeout=120, step=1)


# greedy, the default model loops on this and never ends it (700+ tokens): a request of
# every surface is still running when its replica is killed
ENDLESS = "Tell me a very long story about a cat."
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    """One request with the key, read whole: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, data, HEADERS)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _long_requests(model: str) -> dict[str, dict]:
    """A request on each surface the ingress fronts, each long enough to be killed under."""
    user = [{"role": "user", "content": ENDLESS}]
    greedy = {"model": model, "temperature": 0}
    return {
        "/v1/chat/completions": greedy | {"messages": user, "max_tokens": 900, "ignore_eos": True},
        "/v1/completions": greedy | {"prompt": ENDLESS, "max_tokens": 900, "ignore_eos": True},
        "/v1/messages": greedy | {"messages": user, "max_tokens": 900},
        "/v1/responses": greedy | {"input": ENDLESS, "max_output_tokens": 900, "store": False},
    }


def _sse(port: int, path: str, body: dict, begun: threading.Event) -> list[tuple[str | None, str]]:
    """A streamed request's events read to the end, as (event name, data); `begun` is set
    once its first events are in (it is running on its replica)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body | {"stream": True}).encode(), HEADERS)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events: list[tuple[str | None, str]] = []
        name = None
        for raw in resp:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, line.removeprefix("data: ")))
                name = None
                if len(events) == 3:
                    begun.set()
        return events
    finally:
        conn.close()


@pytest.mark.slow
def test_the_ingresss_own_503s_say_when_to_retry(server, model):
    """Both replicas killed under a request of each surface (OpenAI chat and completions,
    Anthropic messages, Responses): each answers the ingress's own 503 replica_failed with
    Retry-After 1 (a live replica takes the retry), under /v1/messages in Anthropic's shape,
    and an Anthropic stream ends with its `event: error`; /health, /metrics and /v1/kv,
    while no replica answers, 503 with Retry-After 5 (new ones load their model). The
    ingress's own 503s had no Retry-After (a replica's passed through), its errors under
    /v1/messages were OpenAI's, and an Anthropic client read the stream's end as none."""
    from kvlm.cluster.app import REPLICA_FAILED

    port, proc = server
    assert wait_for(lambda: all_up(port))
    bodies = _long_requests(model)
    held = metrics(port)["kvlm_requests_held"]
    begun = threading.Event()
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        calls = {path: pool.submit(_call, port, "POST", path, b) for path, b in bodies.items()}
        stream = pool.submit(_sse, port, "/v1/messages", bodies["/v1/messages"], begun)

        def running() -> bool:
            return metrics(port)["kvlm_requests_held"] == held + len(bodies) + 1

        assert wait_for(running, timeout=120, step=0.1), metrics(port)
        assert begun.wait(timeout=120)
        pids = _replica_pids(proc)
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        down: dict[str, tuple[int, dict, bytes]] = {}

        def scraped_down() -> bool:
            for path in ("/health", "/metrics", "/v1/kv"):
                if path not in down and (answer := _call(port, "GET", path))[0] == 503:
                    down[path] = answer
            return len(down) == 3

        assert wait_for(scraped_down, timeout=60, step=0.05), down
        answers = {path: call.result(timeout=120) for path, call in calls.items()}
        events = stream.result(timeout=120)
    for path, (status, headers, body) in answers.items():
        assert status == 503, (path, status, body)
        assert headers.get("retry-after") == "1", (path, headers)
        error = json.loads(body)
        if path == "/v1/messages":  # Anthropic's shape, as kvlm serve's errors there
            assert error == {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": REPLICA_FAILED}}  # fmt: skip
        else:
            assert error["error"]["code"] == "replica_failed", (path, body)
    for path, (_, headers, body) in down.items():
        assert headers.get("retry-after") == "5", (path, headers, body)
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error", events[-3:]
    assert json.loads(data) == {"type": "error", "error": {"type": "api_error",
                                                           "message": REPLICA_FAILED}}  # fmt: skip
    assert wait_for(lambda: all_up(port) and len(_replica_pids(proc)) == 2, timeout=120, step=1)


def test_the_redis_tier_is_shared_by_two_replicas(round_robin, model):
    """Round-robin puts the second request on the other replica: the long prompt its twin
    computed comes from Redis, the same tokens, and the cluster's /metrics counts it."""
    rr = round_robin
    system = " ".join(f"Shared rule {i}: be brief and exact." for i in range(30))
    client = openai_client(rr, KEY)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]

    def chat():
        return client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0
        )

    def routed() -> dict[str, float]:
        m = metrics(rr)
        return {k: v for k, v in m.items() if k.startswith("kvlm_cluster_requests_routed")}

    writes = 'kvlm_kv_tier_writes_total{tier="redis"}'
    before, writes_before, tier_before = routed(), metrics(rr)[writes], _tier_hits(rr)
    first = chat()
    wait_for(lambda: metrics(rr)[writes] > writes_before)
    time.sleep(1)  # the writer thread finishes the prompt's blocks
    second = chat()
    assert second.choices[0].message.content == first.choices[0].message.content
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * 8
    assert _tier_hits(rr) - tier_before >= 8
    gained = [v - before.get(k, 0) for k, v in routed().items()]
    assert sorted(gained) == [1, 1]  # one request on each replica


def test_a_slot_is_one_replicas_through_the_ingress(port, client, model):
    """A chat under id_slot 0 and one under id_slot 1 go to the two replicas (the slots'
    own: kvlm.cluster.router.slot_replica); GET /slots shows each as its replica holds
    it, POST /slots/1?action=erase reaches the replica that holds slot 1, and a save on a
    cluster started without --slot-save-path is the replica's 501."""
    wait_for(lambda: all_up(port))
    auth = {"Authorization": f"Bearer {KEY}"}

    def routed() -> dict[str, float]:
        return {k: v for k, v in metrics(port).items()
                if k.startswith("kvlm_cluster_requests_routed")}  # fmt: skip

    before = routed()
    totals = [ask(client, model, max_tokens=6, extra_body={"id_slot": n}).usage.total_tokens
              for n in (0, 1)]  # fmt: skip
    gained = [v - before.get(k, 0) for k, v in routed().items()]
    # one on each replica (series of replicas an earlier test killed stay, at 0 gained)
    assert sorted(g for g in gained if g) == [1, 1]
    listed = json.loads(get(port, "/slots", auth)[1])
    assert [s["n_tokens"] for s in listed[:2]] == totals and listed[0]["id"] == 0
    erase = httpx.post(f"http://127.0.0.1:{port}/slots/1?action=erase", headers=auth, timeout=30)
    assert erase.json() == {"id_slot": 1, "n_erased": totals[1]}
    assert json.loads(get(port, "/slots", auth)[1])[1]["n_tokens"] == 0
    save = httpx.post(f"http://127.0.0.1:{port}/slots/0?action=save", headers=auth,
                      json={"filename": "conv.bin"}, timeout=30)  # fmt: skip
    assert save.status_code == 501 and "--slot-save-path" in save.text
    assert get(port, "/slots")[0] == 401


def test_kv_and_the_dashboard_show_every_replica(port, client, model):
    """/v1/kv asks every replica (a routed GET would land on another one at each poll):
    the first replica's pool at the top level, for /dashboard, and all of them under
    "replicas", in a stable order; both behind the key."""
    wait_for(lambda: all_up(port))
    assert get(port, "/v1/kv")[0] == 401
    complete(client, model, max_tokens=2, prompt="Blocks and more blocks. " * 8)
    auth = {"Authorization": f"Bearer {KEY}"}
    views = [json.loads(get(port, "/v1/kv", auth)[1]) for _ in range(3)]
    ids = [[r["replica"] for r in v["replicas"]] for v in views]
    assert len(ids[0]) == 2 and ids[0] == sorted(ids[0]) and ids.count(ids[0]) == 3
    first = views[0]
    assert first["replica"] == ids[0][0] and first["object"] == "kv_cache"
    assert len(first["blocks"]) == first["num_blocks"]
    assert sum(r["prefix_cache"]["queries"] for r in first["replicas"]) > 0
    status, page = get(port, "/dashboard", auth)
    assert status == 200 and "/v1/kv" in page


def test_kv_passes_on_a_busy_replicas_503_and_its_retry_after(port, client, model):
    """A replica whose engine stays busy past --engine-wait answers /v1/kv 503 with
    Retry-After; the ingress passes both on (it used to drop the header)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    # ~900 tokens of prefill: four chunks, each step past --engine-wait (a 400-token prompt
    # was done after two polls on a fast CPU)
    long = "Blocks and more blocks, one after another. " * 90
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(complete, client, model, prompt=long, max_tokens=1)
        seen = []
        while not busy.done() and len(seen) < 400:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/v1/kv", headers=auth)
            resp = conn.getresponse()
            body, retry = json.loads(resp.read()), resp.getheader("Retry-After")
            conn.close()
            seen.append(resp.status)
            if resp.status == 503:
                assert body["error"]["code"] == "engine_busy", body
                assert retry is not None and int(retry) >= 1
                break
        assert busy.result(timeout=120).choices[0].text
    assert 503 in seen, seen
