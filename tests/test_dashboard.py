"""Seeing the cache from the server: GET /v1/kv is exact on a small engine (known
requests -> known block ids, refcounts, owners, fills and prefix tree), both it and the
/dashboard page are behind --api-key, and a real headless browser runs the page against a
live `kvlm serve` and draws one cell per block."""

from __future__ import annotations

import base64
import http.client
import json
import re
import shutil
import subprocess

import pytest

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.llm import CacheOptions
from serving import get, kvlm_serve, openai_client

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KEY = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), progress=False, max_context=32,
               cache_options=CacheOptions(block_size=4))  # fmt: skip


def test_kv_view_is_exact_on_a_small_engine(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=16))
    a = list(range(1, 11))  # 10 tokens: blocks 0, 1 full, 2 holding 2
    engine.add_request("a", a, PARAMS)
    engine.step()  # a's prompt: 10 computed, blocks 0 and 1 sealed, its first token sampled
    b = [*a[:8], 20, 21, 22]  # shares a's two full blocks
    engine.add_request("b", b, PARAMS)
    engine.step()  # b takes 0 and 1 from the cache, computes 3 into block 3; a decodes one
    view = engine.kv_view()
    free = {"state": "free", "refs": 0, "owners": [], "fill": 0, "parent": None, "hits": 0,
            "tier": None}  # fmt: skip
    assert view["blocks"] == [
        {"id": 0, "state": "used", "refs": 2, "owners": ["a/0", "b/0"], "fill": 4,
         "parent": None, "hits": 1, "tier": None},
        {"id": 1, "state": "used", "refs": 2, "owners": ["a/0", "b/0"], "fill": 4,
         "parent": 0, "hits": 1, "tier": None},
        {"id": 2, "state": "used", "refs": 1, "owners": ["a/0"], "fill": 3, "parent": None,
         "hits": 0, "tier": None},  # tokens 8, 9 and a's first: computed, not yet full
        {"id": 3, "state": "used", "refs": 1, "owners": ["b/0"], "fill": 3, "parent": None,
         "hits": 0, "tier": None},
        *({"id": i} | free for i in range(4, 16)),
    ]  # fmt: skip
    assert view["prefix_tree"] == [
        {"block": 0, "tokens": 4, "hits": 1, "refs": 2, "children": [
            {"block": 1, "tokens": 8, "hits": 1, "refs": 2, "children": []}]},
    ]  # fmt: skip
    assert (view["used"], view["cached"], view["free"], view["num_blocks"]) == (4, 0, 12, 16)
    assert view["waste"] == {"slots": 2, "bytes": 2 * engine.pool.block_nbytes // 4,
                             "fraction": 2 / 16}  # fmt: skip
    assert view["sequences"] == [
        {"id": "a/0", "request_id": "a", "index": 0, "tokens": 11, "cached_tokens": 0,
         "blocks": [0, 1, 2]},
        {"id": "b/0", "request_id": "b", "index": 0, "tokens": 11, "cached_tokens": 8,
         "blocks": [0, 1, 3]},
    ]  # fmt: skip
    assert view["prefix_cache"] == {"queries": 21, "hits": 8, "hit_rate": 8 / 21,
                                    "evictions": 0}  # fmt: skip
    assert view["tiers"] == {} and view["waiting"] == 0
    while engine.has_work():
        engine.step()
    done = engine.kv_view()
    assert done["used"] == 0 and done["sequences"] == [] and done["waste"]["slots"] == 0
    # a: 17 of 18 tokens computed -> 4 sealed blocks; b: 18 of 19 -> 2 shared + 2 its own
    assert done["cached"] == 6
    (root,) = done["prefix_tree"]
    assert root["block"] == 0 and [c["block"] for c in root["children"]] == [1]
    branches = root["children"][0]["children"]
    assert [c["block"] for c in branches] == [2, 3]  # a's continuation, b's
    assert [c["tokens"] for c in branches] == [12, 12]
    assert all(len(c["children"]) == 1 for c in branches)


def basic(key: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"me:{key}".encode()).decode()}


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--threads", "1", "--api-key", "sekret", "--kv-blocks", "300",
                    "--served-model-name", "m") as (port, _):  # fmt: skip
        yield port


def test_kv_and_dashboard_are_behind_the_api_key(server):
    assert get(server, "/v1/kv")[0] == 401
    assert get(server, "/dashboard")[0] == 401
    assert get(server, "/v1/kv", KEY)[0] == 200
    assert get(server, "/v1/kv", basic("sekret"))[0] == 200
    assert get(server, "/v1/kv", basic("wrong"))[0] == 401
    assert get(server, "/v1/kv", {"Authorization": "Basic %%%"})[0] == 401
    status, page = get(server, "/dashboard", basic("sekret"))
    assert status == 200 and "<script>" in page
    assert "http://" not in page and "https://" not in page  # nothing from elsewhere
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    conn.request("GET", "/dashboard")
    resp = conn.getresponse()
    assert resp.getheader("WWW-Authenticate") == 'Basic realm="kvlm"'  # the browser asks
    conn.close()


def test_kv_over_http_follows_the_requests(server):
    client = openai_client(server, "sekret")
    prompt = "Count the blocks of the cache, one by one, as they fill. " * 3
    client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    first = json.loads(get(server, "/v1/kv", KEY)[1])
    client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    second = json.loads(get(server, "/v1/kv", KEY)[1])
    assert first["object"] == "kv_cache" and first["num_blocks"] == 300
    assert first["cached"] > 0 and first["used"] == 0 and first["sequences"] == []
    (root,) = [n for n in second["prefix_tree"] if n["hits"] == 1]  # the prompt's chain
    hit = second["prefix_cache"]["hits"] - first["prefix_cache"]["hits"]
    depth, node = 1, root
    while node["children"] and node["children"][0]["hits"] == 1:
        node, depth = node["children"][0], depth + 1
    assert hit == 16 * depth > 0  # every block of the hit was counted on its node


def browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(browser() is None, reason="no headless browser: apt-get install chromium")
def test_a_headless_browser_draws_the_block_map(server):
    """Chromium loads /dashboard (Basic auth with the API key, as a person would type it),
    runs its script against the live server and draws one cell per block, in the states
    /v1/kv gives."""
    client = openai_client(server, "sekret")
    client.completions.create(model="m", prompt="A picture of the cache, please. " * 6,
                              max_tokens=4, temperature=0)  # fmt: skip
    view = json.loads(get(server, "/v1/kv", KEY)[1])
    dom = subprocess.run(
        [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000",
         "--dump-dom", f"http://me:sekret@127.0.0.1:{server}/dashboard"],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert '<div id="error"></div>' in dom, re.search(r'id="error">[^<]*', dom)
    cells = re.findall(r'<div class="b[^"]*" data-id="(\d+)" data-state="(\w+)"', dom)
    assert len(cells) == view["num_blocks"] == 300
    assert [int(i) for i, _ in cells] == list(range(300))
    assert 'data-cells="300"' in dom
    states = [s for _, s in cells]
    assert states.count("cached") == view["cached"] > 0
    assert states.count("free") == view["free"]
