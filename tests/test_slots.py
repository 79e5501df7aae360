"""llama.cpp's slot API against a real `kvlm serve --slot-save-path` (kvlm.server.slots),
on a tiny Qwen3.5 (gated DeltaNets beside attention: a state that cannot be trimmed, the
case llama.cpp's own restore re-prefills, llama.cpp 26676): a conversation run under a
slot is saved, the server stopped, a new one started on the same directory restores it
(the K/V and the state snapshots from the disk tier, verified), and the next turn is
served from the cache with the tokens a fresh prefill gives; files that are not a slot's
are refused, and ids changed in a file restore nothing, never another prefix's K/V."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers import CHATML, save_tiny_model
from kvlm.engine.sequence import common_prefix
from serving import kvlm_serve

openai = pytest.importorskip("openai")

KEY = "slot-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIRST = [{"role": "user", "content": "Name three cities in France and say why each one is "
          "worth a visit, in a few words each. " * 3}]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("qwen35-slots"), "qwen3_5", seed=30,
                           tokenizer="qwen35", chat_template=CHATML)  # fmt: skip


def serve(folder, save: str):
    return kvlm_serve("--model", str(folder), "--max-context", "1024", "--threads", "2",
                      "--api-key", KEY, "--slot-save-path", save)  # fmt: skip


def chat(port: int, messages, **extra):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=messages, max_tokens=24, temperature=0,
                                          extra_body=extra)  # fmt: skip


def post(port: int, path: str, body=None) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers=AUTH, timeout=60)


def test_a_slot_saved_restores_on_another_server(folder, tmp_path):
    save = str(tmp_path / "slots")
    with serve(folder, save) as (port, _):
        first = chat(port, FIRST, id_slot=0)
        held = httpx.get(f"http://127.0.0.1:{port}/slots", headers=AUTH).json()[0]
        assert held["n_tokens"] == first.usage.total_tokens
        saved = post(port, "/slots/0?action=save", {"filename": "conv.bin"}).json()
        assert saved["n_saved"] == first.usage.total_tokens and saved["n_written"] > 0
        assert post(port, "/slots/0?action=save", {"filename": "../x"}).status_code == 400
        assert post(port, "/slots/0?action=save", {"filename": ".hidden"}).status_code == 400
    second = [*FIRST, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "And in Spain?"}]  # fmt: skip
    files = tmp_path / "slots"
    conv = json.loads((files / "conv.bin").read_text())
    bad = dict(conv, ids=[conv["ids"][1], conv["ids"][0], *conv["ids"][2:]])
    (files / "swapped.bin").write_text(json.dumps(bad))
    (files / "other.bin").write_text(json.dumps(dict(conv, namespace="another model")))
    (files / "junk.bin").write_bytes(b"\x00\xff not json")
    with serve(folder, save) as (port, _):
        # ids changed in the file: their blocks' records are not theirs (MAC'd over the
        # ids), so nothing comes from the tier: all computed
        swapped = post(port, "/slots/1?action=restore", {"filename": "swapped.bin"}).json()
        assert swapped["n_read"] == saved["n_saved"] and swapped["n_restored"] == 0
        restored = post(port, "/slots/0?action=restore", {"filename": "conv.bin"}).json()
        computed = saved["n_saved"] - 1  # the last token's K/V was never computed
        assert restored["n_restored"] >= (computed // 16 - 1) * 16 > 0, restored
        for name, why in (("other.bin", "another model"), ("junk.bin", "not a kvlm slot"),
                          ("none.bin", "no slot file")):  # fmt: skip
            r = post(port, "/slots/0?action=restore", {"filename": name})
            assert r.status_code == 400 and why in r.text, name
        ours = chat(port, second, id_slot=0)
        fresh = chat(port, second, cache_salt="fresh")  # another salt: prefilled whole
        # the next turn renders the reply as text: it shares the saved ids up to where
        # that text's tokens part from the generated ones; served from there back to the
        # last block end with a state snapshot (a block at most)
        ids = post(port, "/tokenize", {"messages": second}).json()["tokens"]
        shared = common_prefix(ids, conv["ids"])
        cached = ours.usage.prompt_tokens_details.cached_tokens
        assert cached >= (min(shared, restored["n_restored"]) // 16 - 1) * 16 > 0
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert ours.choices[0].message.content == fresh.choices[0].message.content
