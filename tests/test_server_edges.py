"""The edges of `kvlm serve`. A real server process on 127.0.0.1 (the default model),
clients from the standard library.

- a body over --max-body is a 413 the client can read: urllib sends the whole body before
  it reads, so the server reads and discards the rest (bounded) before closing;
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

import serving
from serving import kvlm_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_BODY = 4 << 20  # the default


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--max-context", "512", "--threads", "2",
                    "--weights", "native", "--max-body", str(MAX_BODY),
                    "--log-level", "warning") as (port, proc):  # fmt: skip
        yield port, proc


# ------------------------------------------------------------------ an oversized body


def test_urllib_reads_the_413_of_a_body_over_the_limit(server):
    port, _ = server
    body = b'{"prompt": "' + b"x" * (2 * MAX_BODY) + b'"}'  # twice the limit
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    for _ in range(3):  # a reset is a race the client can win by luck: try it a few times
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        assert caught.value.code == 413
        error = json.loads(caught.value.read())["error"]
        assert "over the limit" in error["message"], error
    assert serving.get(port, "/health")[0] == 200


def test_a_client_that_stalls_mid_body_is_drained_for_a_bounded_time(server):
    port, _ = server
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (1 << 30))  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + b"x" * 65536)  # then a trickle: the rest of 1 GiB never comes
        reply = b""
        while chunk := s.recv(65536):  # the 413, then the server's FIN (a half-close)
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b'"error"' in reply
        # the server still reads (and discards) what comes, for a bounded time: once it
        # has closed, a send is answered with a reset and the next one fails
        started = time.time()
        with pytest.raises(OSError):  # BrokenPipeError / ConnectionResetError
            while time.time() - started < 30:
                s.sendall(b"x" * 1024)
                time.sleep(0.1)
        drained = time.time() - started
    print(f"a stalled body drained for {drained:.2f} s")
    assert 1.0 < drained < 20, drained  # not closed at once (a reset), not held forever
    assert serving.get(port, "/health")[0] == 200
