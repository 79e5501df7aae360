"""The server app in-process (Starlette's TestClient over a tiny model's AsyncEngine): the
options that need a server of their own, cheaply. tests/test_server*.py run `kvlm serve`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvlm import LLM
from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.server.app import create_app
from kvlm.server.limits import ServerLimits

KEY = "app-key"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=128)
    eng = AsyncEngine(Engine(llm, EngineConfig(num_blocks=64)))
    eng.start()
    yield eng
    eng.stop()


def client(engine, **limits) -> TestClient:
    return TestClient(create_app(engine, "tiny", KEY, ServerLimits(**limits)))


def test_public_metrics_opens_metrics_and_nothing_else(engine):
    closed, open_ = client(engine), client(engine, public_metrics=True)
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert open_.get("/metrics").status_code == 200
    assert open_.get("/v1/models").status_code == 401
    # a key that differs in its last byte, one of another length, one with non-ASCII bytes
    for bad in (KEY[:-1] + "x", KEY + "x", "k\u00e9y"):
        headers = {"Authorization": f"Bearer {bad}".encode("latin-1")}  # bytes on the wire
        assert closed.get("/v1/models", headers=headers).status_code == 401


def test_cache_salt_keeps_prefixes_apart(engine):
    """The same prompt again: served from the prefix cache under the same salt (or none),
    recomputed under another."""
    c = client(engine)
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = "The quick brown fox jumps over the lazy dog. " * 4

    def cached(salt: str | None) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = c.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("tenant-a")  # fills the cache under "tenant-a"
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0  # another tenant's blocks are not theirs
    assert cached(None) == 0
    assert cached(None) > 0
    r = c.post("/v1/completions", headers=auth,
               json={"model": "tiny", "prompt": "x", "cache_salt": ""})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    r = c.post("/v1/completions", headers=auth,
               json={"model": "tiny", "prompt": "x", "cache_salt": "s" * 257})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_the_body_limit_is_a_413(engine):
    c = client(engine, max_body_bytes=4096)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = c.post("/v1/completions", headers=auth,
               json={"model": "tiny", "prompt": "word " * 2000})  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the request body")
    r = c.post("/v1/completions", headers=auth, json={"model": "tiny", "prompt": "hi",
                                                       "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200


def test_an_unhandled_error_is_a_json_500(engine, monkeypatch):
    from kvlm.server import app as app_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "_params", broken)
    c = TestClient(create_app(engine, "tiny", KEY), raise_server_exceptions=False)
    r = c.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
               json={"model": "tiny", "prompt": "hi"})  # fmt: skip
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"


def test_tokenizing_runs_off_the_event_loop(engine, monkeypatch):
    """A long prompt's tokenizing and chat template run on a worker thread, so the event
    loop (every stream, /health) never waits for them."""
    import asyncio

    tokenizer = engine.engine.tokenizer
    seen = []
    real_encode = tokenizer.encode

    def encode(text, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            seen.append("event loop")
        except RuntimeError:
            seen.append("worker")
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    c, auth = client(engine), {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "max_tokens": 2}
    assert c.post("/v1/completions", headers=auth, json=body | {"prompt": "hi"}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert c.post("/v1/chat/completions", headers=auth, json=body | chat).status_code == 200
    assert seen == ["worker", "worker"]


def test_a_text_too_long_for_the_context_is_refused_without_tokenizing(engine, monkeypatch):
    tokenizer = engine.engine.tokenizer

    def encode(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(tokenizer, "encode", encode)
    c, auth = client(engine), {"Authorization": f"Bearer {KEY}"}
    # more characters than 128 tokens can hold, whatever the tokens
    text = "x" * (128 * tokenizer.max_token_chars * 4 + 1)
    r = c.post("/v1/completions", headers=auth, json={"model": "tiny", "prompt": text})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    r = c.post("/v1/chat/completions", headers=auth, json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_the_slots_without_a_save_path(engine):
    """llama-server's /slots: the slots listed; a request's id_slot takes its slot and
    keeps its conversation there; erase forgets it; save and restore need
    --slot-save-path (501, as llama-server answers); a slot or an action that is not
    one is a 400."""
    c = client(engine)
    auth = {"Authorization": f"Bearer {KEY}"}
    listed = c.get("/slots", headers=auth).json()
    assert [s["id"] for s in listed] == list(range(len(listed))) and len(listed) >= 2
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 3,
            "temperature": 0, "id_slot": 1}  # fmt: skip
    done = c.post("/v1/completions", json=body, headers=auth).json()
    held = c.get("/slots", headers=auth).json()[1]
    assert held["n_tokens"] == done["usage"]["total_tokens"] and not held["is_processing"]
    save = c.post("/slots/1?action=save", json={"filename": "a.bin"}, headers=auth)
    assert save.status_code == 501 and "--slot-save-path" in save.text
    erased = c.post("/slots/1?action=erase", headers=auth).json()
    assert erased == {"id_slot": 1, "n_erased": done["usage"]["total_tokens"]}
    assert c.get("/slots", headers=auth).json()[1]["n_tokens"] == 0
    assert c.post("/slots/1?action=copy", headers=auth).status_code == 400
    assert c.post(f"/slots/{len(listed)}?action=erase", headers=auth).status_code == 400
    assert c.post("/v1/completions", json={**body, "id_slot": 99}, headers=auth).status_code == 400
    assert c.get("/slots").status_code == 401
