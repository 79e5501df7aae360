"""The server's sampling defaults (kvlm.server.defaults): the model file's recommendation
(a GGUF's general.sampling.*, a folder's generation_config.json) and kvlm serve's flags
(--temperature, --top-p, --top-k, --min-p, --repeat-penalty) reach a request that sets
none of those fields, on every route, and a request's own field wins.

Two real `kvlm serve`s of the tiny random Llama: as a GGUF whose file says temperature 0
(and top_p, top_k, a repetition penalty, an out-of-range min_p), and as an HF folder
whose generation_config.json says temperature 0.9 under `--temperature 0`. What a request
got is read twice: in the `kvlm-sampling-defaults` header (the server's defaults it took)
and in its tokens, against a request that asks for greedy decoding itself (a random
model sampled at 1.0 writes other tokens).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from helpers import save_tiny_model, write_gguf_from_hf
from serving import kvlm_serve

HEADER = "kvlm-sampling-defaults"
TEXT = "hi there, how are you"
N = 16
# the GGUF's keys, as llama.cpp's converter writes them (min_p out of range: ignored)
FILE_SAYS = {"temp": 0.0, "top_p": 0.5, "top_k": 5, "min_p": 2.5, "penalty_repeat": 1.25}
FILE_TOOK = "temperature=0, top_p=0.5, top_k=5, repetition_penalty=1.25"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama-sampling"), "llama", seed=0)


@pytest.fixture(scope="module")
def gguf_server(folder, tmp_path_factory):
    from gguf import GGUFValueType as V

    kinds = {"top_k": V.INT32}
    meta = {f"general.sampling.{k}": (v, kinds.get(k, V.FLOAT32)) for k, v in FILE_SAYS.items()}
    path = write_gguf_from_hf(folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                              metadata=meta)  # fmt: skip
    with kvlm_serve("--model", str(path), "--threads", "1") as (port, proc):
        yield httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120), proc


@pytest.fixture(scope="module")
def hf_server(folder, tmp_path_factory):
    """The same model as a folder: its generation_config.json says temperature 0.9 (and a
    top_k that is not a number), the flags say 0 and a repetition penalty."""
    copy = tmp_path_factory.mktemp("hf") / "tiny-hf"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    gen = json.loads((copy / "generation_config.json").read_text())
    gen |= {"do_sample": True, "temperature": 0.9, "top_p": 0.5, "top_k": "forty"}
    (copy / "generation_config.json").write_text(json.dumps(gen))
    with kvlm_serve("--model", str(copy), "--threads", "1", "--temperature", "0",
                    "--repeat-penalty", "1.25") as (port, proc):  # fmt: skip
        yield httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120), proc


def _model(c: httpx.Client) -> str:
    return c.get("/v1/models").json()["data"][0]["id"]


def _log(proc) -> str:
    return proc.stdout.read().decode(errors="replace")


def _chat(c: httpx.Client, **fields) -> httpx.Response:
    body = {"model": _model(c), "messages": [{"role": "user", "content": TEXT}],
            "max_tokens": N} | fields  # fmt: skip
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def _text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def _every_route(c: httpx.Client, fields: dict) -> dict[str, httpx.Response]:
    """The same conversation on each chat-like route, with these sampling `fields`."""
    model = _model(c)
    ask = [{"role": "user", "content": TEXT}]
    bodies = {
        "/v1/chat/completions": {"model": model, "messages": ask, "max_tokens": N},
        "/v1/messages": {"model": model, "messages": ask, "max_tokens": N},
        "/v1/responses": {"model": model, "input": TEXT, "max_output_tokens": N,
                          "store": False},
        "/api/chat": {"model": model, "messages": ask, "stream": False,
                      "options": {"num_predict": N} | fields},
    }  # fmt: skip
    out = {}
    for path, body in bodies.items():
        if path != "/api/chat":
            body |= fields
        out[path] = c.post(path, json=body)
        assert out[path].status_code == 200, (path, out[path].text)
    return out


def _route_text(path: str, r: httpx.Response) -> str:
    body = r.json()
    if path == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if path == "/v1/messages":
        return "".join(b["text"] for b in body["content"] if b["type"] == "text")
    if path == "/v1/responses":
        return body["output"][0]["content"][0]["text"] if body["output"] else ""
    return body["message"]["content"]


def test_a_gguf_files_sampling_reaches_every_route(gguf_server):
    """The file's temperature 0 (and its other keys) on a request that sets none: the
    header names what it took, and the tokens are greedy's, on chat, Messages, Responses
    and Ollama's /api/chat (whose own default, temperature 0.8, the file's wins over)."""
    c, proc = gguf_server
    card = c.get("/v1/models").json()["data"][0]
    took = card["sampling_defaults"]
    assert list(took) == ["temperature", "top_p", "top_k", "repetition_penalty"], took
    assert took["temperature"] == 0 and took["top_k"] == 5
    assert math.isclose(took["top_p"], 0.5) and math.isclose(took["repetition_penalty"], 1.25)
    greedy = _chat(c, temperature=0)  # asks for greedy itself: takes the file's others
    assert greedy.headers[HEADER] == "top_p=0.5, top_k=5, repetition_penalty=1.25"
    for path, r in _every_route(c, {}).items():
        assert r.headers[HEADER] == FILE_TOOK, path
        assert _route_text(path, r) == _text(greedy), path
    responses = _every_route(c, {})["/v1/responses"].json()
    assert responses["temperature"] == 0 and responses["top_p"] == 0.5  # what it ran with
    log = _log(proc)
    assert ("sampling defaults for the fields a request leaves unset: temperature 0 "
            "(general.sampling.temp), top_p 0.5 (general.sampling.top_p), top_k 5 "
            "(general.sampling.top_k), repetition_penalty 1.25 "
            "(general.sampling.penalty_repeat)") in log  # fmt: skip
    assert "min_p (general.sampling.min_p = 2.5) is ignored: min_p must be in [0, 1]" in log


def test_a_requests_own_field_wins_over_the_files(gguf_server):
    c, _ = gguf_server
    greedy = _text(_chat(c, temperature=0))
    sampled = _chat(c, temperature=1.0, seed=7)
    assert sampled.headers[HEADER] == "top_p=0.5, top_k=5, repetition_penalty=1.25"
    assert _text(sampled) != greedy  # sampled at 1.0 among the file's top 5
    for path, r in _every_route(c, {"temperature": 1.0, "top_p": 1.0, "top_k": 0}).items():
        assert r.headers[HEADER] == "repetition_penalty=1.25", path
    r = _every_route(c, {"temperature": 0.5})["/v1/responses"].json()
    assert r["temperature"] == 0.5 and r["top_p"] == 0.5
    # the completions route and Ollama's raw generate take them too
    model = _model(c)
    r = c.post("/v1/completions", json={"model": model, "prompt": TEXT, "max_tokens": N})
    assert r.status_code == 200 and r.headers[HEADER] == FILE_TOOK
    body = {"model": model, "prompt": TEXT, "raw": True, "stream": False,
            "options": {"num_predict": N}}  # fmt: skip
    raw = c.post("/api/generate", json=body)
    assert raw.status_code == 200 and raw.headers[HEADER] == FILE_TOOK
    assert raw.json()["response"] == r.json()["choices"][0]["text"]  # both greedy


def test_the_flags_win_over_the_folders_generation_config(hf_server):
    """generation_config.json's temperature 0.9 under --temperature 0: greedy; its top_p
    kept; its top_k, not a number, ignored with a warning (Ollama's 40 stands there)."""
    c, proc = hf_server
    took = c.get("/v1/models").json()["data"][0]["sampling_defaults"]
    assert took == {"temperature": 0, "top_p": 0.5, "repetition_penalty": 1.25}
    greedy = _text(_chat(c, temperature=0))
    for path, r in _every_route(c, {}).items():
        assert r.headers[HEADER] == "temperature=0, top_p=0.5, repetition_penalty=1.25", path
        assert _route_text(path, r) == greedy, path
    shown = c.post("/api/show", json={"model": _model(c)}).json()["parameters"]
    assert shown.splitlines() == ["temperature 0.0", "top_k 40", "top_p 0.5",
                                  "repeat_penalty 1.25"]  # fmt: skip
    log = _log(proc)
    assert ("temperature 0 (--temperature), top_p 0.5 (generation_config.json), "
            "repetition_penalty 1.25 (--repeat-penalty)") in log  # fmt: skip
    assert "top_k (generation_config.json = 'forty') is ignored: top_k must be a number" in log


def test_no_defaults_no_header(tiny_model_dir):
    """A file that recommends nothing and no flags: the APIs' own defaults, no header,
    and the startup line says how to set them."""
    with kvlm_serve("--model", str(tiny_model_dir("llama")), "--threads", "1") as (port, proc):
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        assert c.get("/v1/models").json()["data"][0]["sampling_defaults"] == {}
        assert HEADER not in _chat(c).headers
        assert "sampling defaults: none" in _log(proc)


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("temperature", "hot", "temperature must be a number"),
        ("temperature", True, "temperature must be a number"),
        ("temperature", float("nan"), "temperature must be a finite number >= 0"),
        ("temperature", -1.0, "temperature must be a finite number >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_k", 1.5, "top_k must be an integer"),
        ("top_k", float("inf"), "top_k must be an integer"),
        ("min_p", 1.5, "min_p must be in [0, 1]"),
        ("repetition_penalty", 0, "repetition_penalty must be > 0"),
        ("repetition_penalty", [1.1], "repetition_penalty must be a number"),
    ],
)
def test_a_files_bad_value_is_ignored_with_a_warning(name, value, why, caplog):
    from kvlm.server.defaults import resolve

    other = "top_p" if name == "min_p" else "min_p"  # a good value beside it: kept
    with caplog.at_level("WARNING", logger="kvlm.server"):
        got = resolve({}, {name: ("its.key", value), other: ("other.key", 0.25)}, "m.gguf")
    assert got.values == {other: 0.25} and got.sources == {other: "other.key"}
    assert f"m.gguf: its recommended {name} (its.key = " in caplog.text
    assert why in caplog.text


def test_a_files_top_k_reads_as_llama_cpp_reads_it():
    from kvlm.server.defaults import resolve

    got = resolve({}, {"top_k": ("k", 40.0), "temperature": ("t", 1)}, "m")
    assert got.values == {"temperature": 1.0, "top_k": 40}
    assert isinstance(got.values["top_k"], int)
    assert resolve({}, {"top_k": ("k", -1)}, "m").values == {"top_k": 0}  # off


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--top-p", "0", "--top-p: top_p must be in (0, 1]"),
        ("--temperature", "nan", "--temperature: temperature must be a finite number >= 0"),
        ("--min-p", "2", "--min-p: min_p must be in [0, 1]"),
        ("--repeat-penalty", "-1", "--repeat-penalty: repetition_penalty must be > 0"),
        (
            "--snapshot-share",
            "1",
            "--snapshot-share (the snapshots' share of the KV memory) must be in [0, 1), not 1.0",
        ),
    ],
)
def test_a_bad_flag_is_one_line_before_the_load(flag, value, said, capsys):
    from kvlm.cli import main

    assert main(["serve", "--model", "/nonexistent.gguf", flag, value]) == 2
    err = capsys.readouterr().err
    assert said in err and "not found" not in err, err
