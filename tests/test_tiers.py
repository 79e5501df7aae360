"""KV tiers below the pool (kvlm.cache.tiers): a directory and a real Redis server. A block
from a tier gives the tokens a recomputed one does; a record that does not verify is never
used; a tier that is down, slow or full costs recomputation, never a request."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.cache import tiers as tiers_mod
from kvlm.cache.base import CacheSpec
from kvlm.cache.paged import BlockPool
from kvlm.cache.prefix import BlockManager
from kvlm.cache.tiers import DiskTier, KVTiers, parse_tier
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.errors import InvalidRequestError
from kvlm.server.metrics import render_metrics
from redis_server import redis_server

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), progress=False, max_context=256)


def run(engine: Engine, prompts: dict[str, list[int]], salt: str | None = None) -> tuple:
    """{id: tokens}, {id: cached prompt tokens}, after stepping every request to its end."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY, cache_salt=salt)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
            cached.setdefault(ev.request_id, ev.cached_tokens)
    return out, cached


def engine_with(llm: LLM, *tiers: str, **kw) -> Engine:
    return Engine(llm, EngineConfig(num_blocks=64, kv_tiers=tiers, **kw))


PROMPT = [(7 * i + 3) % 200 + 10 for i in range(101)]  # 6 full blocks of 16 before the last


# ---------------------------------------------------------------- the engine on a tier


def test_a_restarted_engine_loads_the_prompt_from_disk(tiny, tmp_path):
    first = engine_with(tiny, f"disk:{tmp_path}")
    want, cached = run(first, {"a": PROMPT})
    first.close()
    assert cached == {"a": 0}
    assert first.tiers.stats["disk"].writes == 6  # every sealed block, prompt and output
    second = engine_with(tiny, f"disk:{tmp_path}")
    got, cached = run(second, {"a": PROMPT})
    assert got == want
    assert cached == {"a": 96}  # 6 blocks of 16 from disk: all but the last token's block
    assert second.stats.prefill_tokens == len(PROMPT) - 96
    disk = second.tiers.stats["disk"]
    assert (disk.hits, disk.misses, disk.refused) == (6, 0, 0)
    text = render_metrics(_Async(second))
    assert 'kvlm_kv_tier_hits_total{tier="disk"} 6' in text
    assert 'kvlm_kv_tier_up{tier="disk"} 1' in text
    second.close()


def test_tier_blocks_equal_recomputed_ones_bit_for_bit(tiny, tmp_path):
    """The pool after a tier load holds the bytes the pool that computed them held."""
    first = engine_with(tiny, f"disk:{tmp_path}")
    run(first, {"a": PROMPT})
    first.close()
    second = engine_with(tiny, f"disk:{tmp_path}")
    second.manager.fetch(PROMPT)
    for key, block in first.pool.cached.items():
        if key in second.pool.cached:
            theirs = second.pool.store.values[:, :, second.pool.cached[key]]
            assert torch.equal(first.pool.store.values[:, :, block], theirs)
    assert len(second.pool.cached) == 6
    second.close()


def test_salts_and_numerics_keep_tiers_apart(tiny, tmp_path):
    first = engine_with(tiny, f"disk:{tmp_path}")
    want, _ = run(first, {"a": PROMPT}, salt="tenant-a")
    first.close()
    other = engine_with(tiny, f"disk:{tmp_path}")
    got, cached = run(other, {"a": PROMPT}, salt="tenant-b")  # another tenant: no hit
    assert cached == {"a": 0} and other.tiers.stats["disk"].hits == 0
    got, cached = run(other, {"b": PROMPT}, salt="tenant-a")
    assert cached == {"b": 96} and got["b"] == want["a"]
    other.close()
    # another storage dtype is another namespace: its files are never asked for
    fp16 = LLM(model=tiny.loaded.path, progress=False, max_context=256, kv_dtype="fp16")
    third = engine_with(fp16, f"disk:{tmp_path}")
    assert third.tiers.ns != other.tiers.ns
    _, cached = run(third, {"a": PROMPT}, salt="tenant-a")
    assert cached == {"a": 0}
    third.close()


def test_a_tier_only_serves_whole_verified_runs(tiny, tmp_path):
    """A block missing from the middle ends the run: what follows it is recomputed."""
    first = engine_with(tiny, f"disk:{tmp_path}")
    want, _ = run(first, {"a": PROMPT})
    first.close()
    third_key = first.manager.match(PROMPT)[1][2]
    os.remove(tmp_path / f"kvlm:{first.tiers.ns[:32]}:{third_key.hex()}.kvb")
    second = engine_with(tiny, f"disk:{tmp_path}")
    got, cached = run(second, {"a": PROMPT})
    assert got == want and cached == {"a": 32}
    second.close()


# ---------------------------------------------------------------- records that lie


def small_tiers(path, max_bytes: int = 1 << 20) -> tuple[BlockManager, KVTiers]:
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, max_tokens=64, block_size=BS)
    pool = BlockPool(spec, 16)
    block = (1, 2, 1, BS, 2)
    tiers = KVTiers([DiskTier(path, max_bytes)], "ns-test", {"values": (block, torch.float32)})
    return BlockManager(pool, True, tiers), tiers


def seal_random(m: BlockManager, tokens: list[int], salt: str | None = None) -> torch.Tensor:
    table, _ = m.allocate(tokens, salt)
    for b in table.blocks:
        m.pool.store.values[:, :, b] = torch.randn(1, 2, 1, BS, 2)
    m.seal(table, tokens, len(tokens))
    m.tiers.flush()
    values = m.pool.store.values[:, :, table.blocks].clone()
    m.free(table)
    return values


def test_records_that_do_not_verify_are_refused(tmp_path):
    m, _ = small_tiers(tmp_path)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60, 70, 80, 9]
    seal_random(m, a)
    seal_random(m, b)
    files = sorted(tmp_path.glob("*.kvb"))
    assert len(files) == 3  # a's two blocks, b's second (its first is a's)
    key_a1 = m.match(a)[1][1]
    key_b1 = m.match(b)[1][1]

    def fresh() -> BlockManager:
        return small_tiers(tmp_path)[0]

    def path(key):
        return tmp_path / f"kvlm:ns-test:{key.hex()}.kvb"

    assert fresh().fetch(a) == 2
    # b's second block under a's key (a forced collision): its tokens do not match
    saved = path(key_a1).read_bytes()
    path(key_a1).write_bytes(path(key_b1).read_bytes())
    f = fresh()
    assert f.fetch(a) == 1 and f.tiers.stats["disk"].refused == 1
    # truncated, padded, a flipped header byte, a huge header length: refused, never raised
    bad = [saved[:-1], saved + b"\0" * 64, saved[:20] + b"X" + saved[21:],
           saved[:8] + (1 << 30).to_bytes(4, "little") + saved[12:]]  # fmt: skip
    for data in bad:
        path(key_a1).write_bytes(data)
        f = fresh()
        assert f.fetch(a) == 1 and f.tiers.stats["disk"].refused == 1
    # a file far larger than a record is read no further than one record's bound
    path(key_a1).write_bytes(saved + b"\0" * (1 << 22))
    f = fresh()
    assert f.fetch(a) == 1
    first_record = path(m.match(a)[1][0]).stat().st_size
    assert f.tiers.stats["disk"].bytes_read == first_record + f.tiers.record_limit + 1
    path(key_a1).write_bytes(saved)
    assert fresh().fetch(a) == 2
    # the other tenant's salt: the same tokens, other keys, nothing found
    assert fresh().fetch(a, salt="x") == 0


def test_the_loaded_blocks_hold_what_was_sealed(tmp_path):
    m, _ = small_tiers(tmp_path)
    tokens = list(range(1, 14))  # 3 full blocks, the last not looked up (the last token's)
    sealed = seal_random(m, tokens)
    f, _ = small_tiers(tmp_path)
    assert f.fetch(tokens) == 3
    table, cached = f.allocate(tokens)
    assert cached == 12
    assert torch.equal(f.pool.store.values[:, :, table.blocks[:3]], sealed[:, :, :3])


def test_disk_tier_is_lru_bounded_across_restarts(tmp_path):
    m, _ = small_tiers(tmp_path)
    seal_random(m, [99, 99, 99, 99, 0])  # records of two-digit tokens: all one size
    record = next(tmp_path.glob("*.kvb")).stat().st_size
    m, _ = small_tiers(tmp_path, max_bytes=3 * record)
    firsts = [[i, i, i, i, 0] for i in range(10, 14)]
    for tokens in firsts[:3]:
        seal_random(m, tokens)
    assert len(list(tmp_path.glob("*.kvb"))) == 3  # [99]*4 evicted by the third
    assert small_tiers(tmp_path, 3 * record)[0].fetch(firsts[0]) == 1  # touches it
    m, _ = small_tiers(tmp_path, max_bytes=3 * record)  # a restart: the order is kept
    seal_random(m, firsts[3])
    fresh = small_tiers(tmp_path, 3 * record)[0]
    assert [fresh.fetch(t) for t in firsts] == [1, 0, 1, 1]  # firsts[1] was oldest


def test_a_full_write_queue_drops_writes_and_never_waits(tiny, tmp_path, monkeypatch):
    class SlowDisk(DiskTier):
        def put(self, name, data):
            import time

            time.sleep(0.2)
            super().put(name, data)

    monkeypatch.setattr(tiers_mod, "WRITE_QUEUE_BLOCKS", 2)
    engine = engine_with(tiny, f"disk:{tmp_path}")
    engine.tiers.tiers[0].__class__ = SlowDisk
    want, _ = run(engine_with(tiny), {"a": PROMPT})
    got, _ = run(engine, {"a": PROMPT})
    assert got == want
    assert engine.tiers.dropped >= 3  # 6 blocks offered at once, 2 queued, 1 being written
    engine.close()


# ---------------------------------------------------------------- Redis


def test_redis_is_shared_by_two_engines_and_survives_going_down(tiny, monkeypatch, caplog):
    monkeypatch.setattr(tiers_mod, "RETRY_S", 0.0)
    with redis_server() as redis:
        one = engine_with(tiny, redis.url + "?ttl=60")
        want, _ = run(one, {"a": PROMPT})
        one.tiers.flush()
        assert redis.client().ttl(redis.client().keys("kvlm:*")[0]) > 0
        two = engine_with(tiny, redis.url)  # another replica on the same Redis
        got, cached = run(two, {"a": PROMPT})
        assert got == want and cached == {"a": 96}
        assert two.tiers.stats["redis"].hits == 6
        redis.stop()
        three = engine_with(tiny, redis.url)
        with caplog.at_level(logging.WARNING, logger="kvlm.tiers"):
            got, cached = run(three, {"a": PROMPT, "b": PROMPT[:50]})
        assert got["a"] == want["a"] and cached["a"] == 0
        stats = three.tiers.stats["redis"]
        assert stats.errors >= 1 and stats.hits == 0
        assert "KV tier redis failed" in caplog.text
        assert 'kvlm_kv_tier_errors_total{tier="redis"}' in render_metrics(_Async(three))
        redis.start()  # back: the next request asks it again (RETRY_S is 0 here)
        got, cached = run(three, {"c": PROMPT})
        assert got["c"] == want["a"]
        for e in (one, two, three):
            e.tiers.close(timeout=2)


def test_disk_then_redis_each_asked_for_what_the_one_before_lacked(tiny, tmp_path):
    with redis_server() as redis:
        one = engine_with(tiny, redis.url)
        want, _ = run(one, {"a": PROMPT})
        one.close()
        two = engine_with(tiny, f"disk:{tmp_path}", redis.url)
        got, cached = run(two, {"a": PROMPT})
        assert got == want and cached == {"a": 96}
        assert two.tiers.stats["disk"].misses == 6 and two.tiers.stats["redis"].hits == 6
        two.close()  # the blocks found in Redis were written to the disk tier too
        three = engine_with(tiny, f"disk:{tmp_path}")
        assert run(three, {"a": PROMPT})[1] == {"a": 96}
        three.close()


# ---------------------------------------------------------------- specs


@pytest.mark.parametrize(
    "spec, message",
    [
        ("disk:", "needs a path"),
        ("disk:/tmp/x:lots", "size"),
        ("redis://127.0.0.1:1?ttl=soon", "whole seconds"),
        ("s3://bucket", "unknown KV tier"),
    ],
)
def test_bad_tier_specs_are_refused_clearly(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_tier(spec)


class _Async:
    """What render_metrics reads off an AsyncEngine, for an engine stepped here."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.num_requests = 0


# ---------------------------------------------------------------- kvlm serve


LONG_SYSTEM = " ".join(f"Rule {i}: answer in plain words and keep it short." for i in range(40))


@pytest.mark.slow
def test_kvlm_serve_restarted_on_a_disk_tier_answers_from_it(tmp_path):
    """The second server's first request finds the long system prompt on disk: the same
    tokens, `cached_tokens` counting the blocks the tier gave, the tier's hits in /metrics;
    a Redis stopped under the server costs recomputation, not an answer."""
    from serving import kvlm_serve, metrics, openai_client

    args = ["--threads", "1", "--kv-tier", f"disk:{tmp_path}", "--api-key", "k",
            "--served-model-name", "m"]  # fmt: skip
    messages = [{"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": "Name a colour."}]  # fmt: skip

    def ask(port: int, content: str = "Name a colour."):
        client = openai_client(port, "k")
        return client.chat.completions.create(
            model="m", messages=[messages[0], {"role": "user", "content": content}],
            max_tokens=12, temperature=0,
        )  # fmt: skip

    with kvlm_serve(*args) as (port, _):
        first = ask(port)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    with redis_server() as redis, kvlm_serve(*args, "--kv-tier", redis.url) as (port, _):
        second = ask(port)
        assert second.choices[0].message.content == first.choices[0].message.content
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 2 * 16 and cached % 16 == 0
        m = metrics(port, "k")
        assert m['kvlm_kv_tier_hits_total{tier="disk"}'] == cached // 16
        redis.stop()
        third = ask(port, "Name a fruit.")  # Redis is gone: answered all the same
        assert third.choices[0].finish_reason in ("stop", "length")
        m = metrics(port, "k")
        assert m['kvlm_kv_tier_errors_total{tier="redis"}'] >= 1
        assert m['kvlm_kv_tier_up{tier="redis"}'] == 0


def test_kvlm_serve_refuses_a_bad_tier_before_loading():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kvlm.cli", "serve", "--kv-tier", "s3://bucket"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "unknown KV tier 's3://bucket'" in proc.stderr
    assert "Traceback" not in proc.stderr
