"""A real `kvlm serve` (a tiny model whose chat template is hostile on trigger words,
helpers.HOSTILE_TEMPLATE) against what an attacker sends: runaway templates, bodies that
expand, stored responses that hold more than their text, and a storm of clients that
vanish. Each answer is a 4xx or the right answer, an ordinary request is answered
meanwhile, and nothing is held afterwards."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import serving
from helpers import HOSTILE_TEMPLATE_CASES, train_tiny_tokenizer
from kvlm.engine.engine import StepOutput
from kvlm.engine.sampling import TokenLogprob
from kvlm.loading.tokenizer import Tokenizer
from kvlm.server import responses_api as api
from kvlm.server.responses import Choices
from serving import kvlm_serve

pytestmark = pytest.mark.slow

KEY = "abuse-key"
MAX_SEQS = 4


@pytest.fixture(scope="module")
def server(hostile_template_dir):
    with kvlm_serve("--model", str(hostile_template_dir), "--api-key", KEY,
                    "--max-context", "1024", "--max-num-seqs", str(MAX_SEQS),
                    "--max-waiting", "16", "--threads", "2",
                    "--log-level", "warning") as (port, proc):  # fmt: skip
        yield port
    assert proc.returncode is not None


def post(port: int, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            path,
            json.dumps(body),
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def chat(port: int, content: str, **fields) -> tuple[int, dict]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    return post(port, "/v1/chat/completions", body | {"model": model_name(port)})


def model_name(port: int) -> str:
    return json.loads(serving.get(port, "/v1/models", {"Authorization": f"Bearer {KEY}"})[1])[
        "data"
    ][0]["id"]


ORDINARY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def ordinary(port: int) -> tuple[int, str]:
    """An ordinary greedy chat request's status and text."""
    status, body = chat(port, "Hello there", **ORDINARY)
    return status, body["choices"][0]["message"]["content"] if status == 200 else body


# ---------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("word", HOSTILE_TEMPLATE_CASES)
def test_a_runaway_template_is_a_400_naming_its_bound(server, word):
    status, body = chat(server, word, max_tokens=2)
    assert status == 400, body
    assert "the chat template ran past its bound" in body["error"]["message"]


def test_runaway_templates_leave_room_for_an_ordinary_request(server):
    """Twice as many runaway renders as the machine has room for at once, and an ordinary
    request beside them: the runaways each get their 400, the ordinary one its answer."""
    alone = ordinary(server)
    assert alone[0] == 200, alone
    with ThreadPoolExecutor(17) as pool:
        hostile = [pool.submit(chat, server, word, max_tokens=2)
                   for word in ("LOOPS", "OUTPUT") * 8]  # fmt: skip
        time.sleep(0.2)
        beside = pool.submit(ordinary, server)
        assert beside.result(timeout=120) == alone
        assert all(h.result()[0] == 400 for h in hostile)
    assert serving.get(server, "/health")[0] == 200
    serving.wait_idle(server, KEY)


# ---------------------------------------------------------------------- Responses, Messages


def test_item_references_are_bounded_by_what_they_expand_to(server):
    """One stored message referenced 4,096 times: refused from the sum of its sizes
    (context_length_exceeded on `input`), before any reference is joined."""
    model = model_name(server)
    status, first = post(server, "/v1/responses", {"model": model, "input": "word " * 100,
                                                    "max_output_tokens": 2})  # fmt: skip
    assert status == 200, first
    status, items = 200, json.loads(serving.get(
        server, f"/v1/responses/{first['id']}/input_items",
        {"Authorization": f"Bearer {KEY}"})[1])  # fmt: skip
    ref = {"type": "item_reference", "id": items["data"][0]["id"]}
    start = time.monotonic()
    status, body = post(server, "/v1/responses", {"model": model, "input": [ref] * 4096})
    assert status == 400, body
    assert body["error"]["param"] == "input", body
    assert body["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 30
    assert serving.get(server, "/health")[0] == 200


def test_a_messages_body_of_many_blocks_is_refused_by_its_length(server):
    blocks = [{"type": "text", "text": "x" * 1000}] * 2000  # 2 MB of text, one message
    body = {"model": model_name(server), "max_tokens": 4,
            "messages": [{"role": "user", "content": blocks}]}  # fmt: skip
    status, answer = post(server, "/v1/messages", body)
    assert status == 400 and answer["type"] == "error", answer
    assert "context length" in answer["error"]["message"]


def test_a_stored_response_returns_its_logprobs(server):
    model = model_name(server)
    status, made = post(server, "/v1/responses", {"model": model, "input": "Hello",
                        "max_output_tokens": 6, "temperature": 0, "top_logprobs": 3})  # fmt: skip
    assert status == 200, made
    got = json.loads(serving.get(server, f"/v1/responses/{made['id']}",
                                 {"Authorization": f"Bearer {KEY}"})[1])  # fmt: skip
    texts = [c for item in got["output"] if item["type"] == "message" for c in item["content"]]
    assert texts, got
    logprobs = texts[0]["logprobs"]
    assert len(logprobs) == made["usage"]["output_tokens"]
    for entry in logprobs:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3
    assert got["output"] == made["output"]


def test_the_store_counts_the_logprobs_a_response_holds():
    """2,000 tokens at top_logprobs 20 hold megabytes: the store's bound counts them, not
    only the reply's text."""
    tok = Tokenizer(train_tiny_tokenizer(), bos_token="<s>", eos_token="</s>",
                    chat_template=None)  # fmt: skip
    choices = Choices(tok, 1, chat=True, want_logprobs=True)
    top = {t: -1.0 - t for t in range(20)}
    for _ in range(2000):
        choices.add(StepOutput("r", 0, "a", [40], [TokenLogprob(40, -0.5, dict(top))]))
    body = api.ResponsesRequest(model="m", input="hi", top_logprobs=20)
    reply = api.Reply(body, "m", choices, 1)
    store = api.ResponseStore(8, 60.0, lambda *a: None, lambda _: None)
    store.put(api.Stored(reply, [{"role": "assistant", "content": "a" * 2000}], []))
    assert store.nbytes > 2000 * 3000  # ~3.2 KB a token, not the reply's 2 KB of text


# ---------------------------------------------------------------------- vanishing clients


def _open_stream(port: int, model: str) -> socket.socket:
    body = json.dumps({"model": model, "stream": True, "max_tokens": 64, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "Tell me a story"}]})  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                 f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                 f"{body}".encode())  # fmt: skip
    return sock


def _cut(port: int, model: str) -> None:
    with _open_stream(port, model) as sock:
        sock.recv(1024)  # the head or a first event, then gone


def _half_open(port: int, model: str) -> None:
    with _open_stream(port, model) as sock:
        sock.shutdown(socket.SHUT_WR)  # says it is done sending, reads nothing
        time.sleep(1.0)


def test_a_storm_of_vanishing_clients_holds_nothing_and_changes_no_answer(server):
    """50 streams cut after their first bytes, 10 half-open, 20 abandoned unread until the
    end: afterwards no block is held and an ordinary answer is what it was before."""
    model = model_name(server)
    before = ordinary(server)
    abandoned = [_open_stream(server, model) for _ in range(20)]
    with ThreadPoolExecutor(16) as pool:
        cuts = [pool.submit(_cut, server, model) for _ in range(50)]
        halves = [pool.submit(_half_open, server, model) for _ in range(10)]
        for f in cuts + halves:
            f.result()
    for sock in abandoned:
        sock.close()
    m = serving.wait_idle(server, KEY)
    assert m["kvlm_requests_held"] == 0
    assert ordinary(server) == before
    assert serving.get(server, "/health")[0] == 200
