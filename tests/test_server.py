"""`kvlm serve` as users run it: a real server process on 127.0.0.1, driven by the official
`openai` client (and raw HTTP where a client would hide the detail under test)."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import serving
from serving import get, kvlm_serve

pytestmark = pytest.mark.slow

KEY = "test-key"
MAX_SEQS, MAX_WAITING = 8, 2
LONG = {"ignore_eos": True}  # runs to max_tokens


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--api-key", KEY, "--max-context", "1024", "--max-num-seqs", str(MAX_SEQS),
                    "--max-waiting", str(MAX_WAITING), "--threads", "2") as (port, _):  # fmt: skip
        yield port


def post(port: int, path: str, body: bytes, key: str = KEY) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data


def metrics(port: int) -> dict[str, float]:
    return serving.metrics(port, KEY)


def wait_idle(port: int, timeout: float = 60) -> dict[str, float]:
    return serving.wait_idle(port, KEY, timeout)


def ask(client, model, content: str, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0, **kw
    )


# ---------------------------------------------------------------------------- answers


def test_models_and_health(server, client, model):
    assert model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert get(server, "/health") == (200, '{"status":"ok"}')


def test_chat_matches_the_library(client, model):
    from kvlm import LLM, SamplingParams

    library = LLM(progress=False, max_context=1024)  # the server's numerics: the defaults
    r = ask(client, model, "What is the capital of France?", max_tokens=24)
    ref = library.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_stream_equals_the_whole_answer(client, model):
    whole = ask(client, model, "Name three animals.", max_tokens=20, extra_body=LONG)
    stream = ask(
        client, model, "Name three animals.", max_tokens=20, stream=True,
        stream_options={"include_usage": True}, extra_body=LONG,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_completions_n2_logprobs(client, model):
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
        n=2, logprobs=3, extra_body=LONG,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples agree
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.tokens[0] in lp.top_logprobs[0]  # greedy picks the top token
    assert max(lp.top_logprobs[0].values()) == lp.token_logprobs[0] <= 0
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5


def test_completion_stream_and_token_ids_prompt(client, model):
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                      temperature=0, extra_body=LONG)  # fmt: skip
    ids = client.completions.create(model=model, prompt=[9649, 2402, 253, 655], max_tokens=12,
                                    temperature=0, extra_body=LONG)  # fmt: skip
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                       temperature=0, stream=True, extra_body=LONG)  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    assert ids.usage.prompt_tokens == 4


def test_chat_logprobs(client, model):
    r = ask(client, model, "Say hello.", max_tokens=5, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert content[0].token == content[0].top_logprobs[0].token


def test_stop_strings_cut_the_text(client, model):
    free = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20,
                                     temperature=0, extra_body=LONG)  # fmt: skip
    assert " 6" in free.choices[0].text
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20,
                                  temperature=0, stop=[" 6", "zzz"])  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free.choices[0].text.split(" 6")[0]
    stream = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20,
                                       temperature=0, stop=" 6", stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text


def test_seeded_sampling_is_reproducible(client, model):
    kw = dict(max_tokens=12, temperature=0.9, seed=11, n=2)
    a = client.completions.create(model=model, prompt="My dog likes", **kw)
    b = client.completions.create(model=model, prompt="My dog likes", **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_concurrent_requests_get_their_own_answers(client, model):
    """Batch invariance through the server: 8 at once answer as each did alone."""
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def one(p):
        return ask(client, model, p, max_tokens=16).choices[0].message.content

    alone = [one(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone


# ---------------------------------------------------------------------------- errors


def test_errors_are_openai_shaped_and_the_server_goes_on(server, client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", extra_body={"best_of": 3})
    assert "best_of" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 1100)
    assert e.value.body["code"] == "context_length_exceeded"
    absurd = [{"max_tokens": -1}, {"temperature": 7}, {"n": 1000}, {"top_p": 0},
              {"stop": ["a", "b", "c", "d", "e"]}, {"logprobs": 99}, {"seed": "x"}]  # fmt: skip
    for extra in absurd:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="hi", **extra)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])
    status, body = post(server, "/v1/completions", b'{"model": "x", "prompt": ')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(server, "/v1/completions", b"{}", key="wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert get(server, "/v1/models")[0] == 401
    assert ask(client, model, "Still there?", max_tokens=4).choices[0].message.content
    assert get(server, "/health")[0] == 200


def open_stream(
    port: int, model: str, max_tokens: int = 400, wait: bool = True
) -> http.client.HTTPResponse:
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200
    if wait:
        assert resp.readline().startswith(b"data: ")  # the first token is out
    return resp


def test_a_client_that_disconnects_has_its_blocks_freed(server, model):
    before = metrics(server)
    resp = open_stream(server, model)
    assert metrics(server)["kvlm_kv_blocks_used"] > 0
    resp.close()  # hang up mid-stream
    after = wait_idle(server)
    assert after["kvlm_requests_aborted_total"] == before["kvlm_requests_aborted_total"] + 1
    assert after["kvlm_generation_tokens_total"] - before["kvlm_generation_tokens_total"] < 400


def test_a_client_that_leaves_a_whole_answer_has_it_aborted(server, model):
    before = metrics(server)["kvlm_requests_aborted_total"]
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": 900, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    deadline = time.time() + 30
    while metrics(server)["kvlm_kv_blocks_used"] == 0 and time.time() < deadline:
        time.sleep(0.1)
    conn.close()  # gone before the answer
    after = wait_idle(server)
    assert after["kvlm_requests_aborted_total"] == before + 1


def test_a_full_server_answers_503_and_recovers(server, client, model):
    # Not waiting for first tokens: the last two wait for seats, and hold their places.
    streams = [open_stream(server, model, wait=False) for _ in range(MAX_SEQS + MAX_WAITING)]
    assert metrics(server)["kvlm_requests_held"] == MAX_SEQS + MAX_WAITING
    with pytest.raises(openai.InternalServerError) as e:  # 503
        client.completions.create(model=model, prompt="one more", max_tokens=4)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    assert e.value.response.headers["Retry-After"] == "1"  # relayed by a cluster's ingress
    for resp in streams:
        resp.close()
    wait_idle(server)
    assert ask(client, model, "Hello?", max_tokens=4).choices[0].message.content


def test_metrics_are_prometheus_text(server):
    m = metrics(server)
    for name in ("kvlm_requests_running", "kvlm_requests_waiting", "kvlm_kv_blocks_used",
                 "kvlm_kv_blocks_free", "kvlm_prefix_cache_hit_rate",
                 "kvlm_generation_tokens_per_second",
                 'kvlm_time_to_first_token_seconds_bucket{le="+Inf"}'):  # fmt: skip
        assert name in m
    assert m["kvlm_kv_blocks_used"] + m["kvlm_kv_blocks_free"] == m["kvlm_kv_blocks_total"]
    assert m["kvlm_time_to_first_token_seconds_count"] >= 10
    assert 0 < m["kvlm_prefix_cache_hit_rate"] < 1
    # every step timed: the longest one is part of their sum, and no step took no time
    steps, total, worst = (m[f"kvlm_engine_{k}"] for k in ("steps_total", "step_seconds_total",
                                                          "step_seconds_max"))  # fmt: skip
    assert steps >= 10 and 0 < worst <= total
