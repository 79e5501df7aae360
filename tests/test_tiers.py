"""KV tiers below the pool (kvlm.cache.tiers): a directory and a real Redis server. A block
from a tier gives the tokens a recomputed one does; a record that does not verify is never
used; a tier that is down, slow or full costs recomputation, never a request."""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import threading
import time
from contextlib import ExitStack

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.cache import tiers as tiers_mod
from kvlm.cache.base import CacheSpec
from kvlm.cache.paged import ALL, BlockPool
from kvlm.cache.prefix import BlockManager, block_key, root_key
from kvlm.cache.tier_key import load_tier_key
from kvlm.cache.tiers import DiskTier, KVTiers, check_digests, parse_tier
from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.errors import InvalidRequestError
from kvlm.server.metrics import render_metrics
from redis_server import JunkRedis, TrickleProxy, redis_server

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 4


KEY = b"k" * 32  # the small tiers' key


@pytest.fixture(autouse=True)
def state_home(tmp_path_factory, monkeypatch):
    """Each test's default tier key in a state folder of its own, never the user's."""
    home = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    return home


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
    text = _metrics(second)
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
    for key, block in first.pool.prefix.cached.items():
        if key in second.pool.prefix.cached:
            theirs = second.pool.store.values[:, :, second.pool.prefix.cached[key]]
            assert torch.equal(first.pool.store.values[:, :, block], theirs)
    assert len(second.pool.prefix.cached) == 6
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


def small_tiers(
    path, max_bytes: int = 1 << 20, key: bytes = KEY, tier=None
) -> tuple[BlockManager, KVTiers]:
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, max_tokens=64, block_size=BS)
    pool = BlockPool(spec, 16)
    block = (1, 2, 1, BS, 2)
    tier = tier or DiskTier(path, max_bytes)
    tiers = KVTiers([tier], "ns-test", {"values": (block, torch.float32)}, key)
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
    # truncated, padded, a flipped byte of the magic, the tag or the values: refused
    bad = [saved[:-1], saved + b"\0" * 64, b"X" + saved[1:], saved[:20] + b"X" + saved[21:],
           saved[:-1] + bytes([saved[-1] ^ 1])]  # fmt: skip
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
        assert 'kvlm_kv_tier_errors_total{tier="redis"}' in _metrics(three)
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
        ("redis://127.0.0.1:1?deadline=0", "deadline must be > 0"),
        ("disk:/tmp/x?deadline=never", "deadline must be seconds"),
        ("disk:/tmp/x?ttl=1", "unknown option 'ttl'"),
        ("s3://bucket", "unknown KV tier"),
    ],
)
def test_bad_tier_specs_are_refused_clearly(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_tier(spec)


def _metrics(engine: Engine) -> str:
    """/metrics of an engine stepped here, read as the server reads it (a loop not started)."""
    return render_metrics(AsyncEngine(engine).metrics())


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


@pytest.mark.parametrize(
    "case, message",
    [
        ("s3", "unknown KV tier 's3://bucket'"),
        ("open-dir", "is writable by others, who could plant records; fix with chmod go-w"),
        ("loose-key", "can be read or written by others (mode 0644)"),
        ("missing-key", "does not exist; make one with: head -c 32 /dev/urandom"),
        ("key-alone", "--kv-tier-key signs KV tier records: it needs --kv-tier"),
    ],
)
def test_kvlm_serve_refuses_a_bad_tier_before_loading(tmp_path, capsys, case, message):
    """One line on stderr, no traceback, before the model loads (the model named does not
    even exist). In process: `kvlm serve`'s own main, as a shell runs it."""
    from kvlm.cli import main

    tier, key = tmp_path / "tier", tmp_path / "tier.key"
    tier.mkdir(mode=0o700)
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    args = {
        "s3": ["--kv-tier", "s3://bucket"],
        "open-dir": ["--kv-tier", f"disk:{tier}"],
        "loose-key": ["--kv-tier", f"disk:{tier}", "--kv-tier-key", str(key)],
        "missing-key": ["--kv-tier", f"disk:{tier}", "--kv-tier-key", str(tmp_path / "no")],
        "key-alone": ["--kv-tier-key", str(key)],
    }[case]
    if case == "open-dir":
        tier.chmod(0o757)
    if case == "loose-key":
        key.chmod(0o644)
    assert main(["serve", "--model", str(tmp_path / "none.gguf"), *args]) != 0
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------- hostile tiers
#
# An attacker who can write to a tier (a local user for a directory, any client of a shared
# Redis) knows the victim's prompt and salt and has K/V of their own. Nothing they put
# there may change the victim's tokens: every record below is refused and counted.

SALT = "tenant-victim"
ATTACK = [(11 * i + 5) % 200 + 10 for i in range(101)]  # the attacker's own prompt


def block_names(engine: Engine, tokens: list[int], salt: str | None) -> list[tuple]:
    """(record name, chain key, tokens, check) of each full block of `tokens` that a
    request looks up (all but the last token's)."""
    bs = engine.spec.block_size
    count = (len(tokens) - 1) // bs
    checks = check_digests(tokens, salt, bs, count)
    key, out = root_key(salt), []
    for i in range(count):
        chunk = tuple(tokens[i * bs : (i + 1) * bs])
        key = block_key(key, chunk)
        out.append((engine.tiers._name(key), key, chunk, checks[i]))
    return out


def own_kv(llm: LLM, tokens: list[int]) -> list[dict[str, torch.Tensor]]:
    """The K/V an engine without tiers computes for the full blocks of `tokens`."""
    engine = engine_with(llm)
    run(engine, {"x": tokens})
    blocks, _ = engine.manager.match(tokens)
    return [{k: v.clone() for k, v in engine.pool.store.raw((ALL, ALL, b)).items()} for b in blocks]


def unkeyed_record(ns: str, key: bytes, chunk, salt, check: bytes, parts) -> bytes:
    """A record in the format before records were keyed (KVLMBLK1): a JSON header of the
    namespace, chain key, salt, tokens and an unkeyed check anyone can compute."""
    meta = {"ns": ns, "key": key.hex(), "salt": salt, "tokens": list(chunk), "check": check.hex()}
    header = json.dumps(meta, separators=(",", ":")).encode()
    body = b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts.values())
    return b"KVLMBLK1" + struct.pack("<I", len(header)) + header + body


def keyed_record(victim: Engine, key: bytes, chunk, check: bytes, parts, mac_key: bytes) -> bytes:
    """A record in today's format, signed with `mac_key` (not the victim's)."""
    forger = KVTiers([], victim.tiers.ns, victim.tiers.parts, mac_key)
    data = forger._encode(tiers_mod._Write(key, chunk, check, parts))
    forger.close()
    return data


class Store:
    """Writes raw records into a disk tier's folder or a Redis, as an attacker would."""

    def __init__(self, kind: str, tmp_path, stack) -> None:
        self.kind = kind
        if kind == "disk":
            self.spec, self.path = f"disk:{tmp_path / 'tier'}", tmp_path / "tier"
        else:
            self.redis = stack.enter_context(redis_server())
            self.spec = self.redis.url

    def put(self, name: str, data: bytes) -> None:
        if self.kind == "disk":
            (self.path / f"{name}.kvb").write_bytes(data)
        else:
            self.redis.client().set(name, data)

    def get(self, name: str) -> bytes:
        if self.kind == "disk":
            return (self.path / f"{name}.kvb").read_bytes()
        return self.redis.client().get(name)


@pytest.mark.parametrize("kind", ["disk", "redis"])
@pytest.mark.parametrize("scheme", ["unkeyed", "wrong-key"])
def test_records_forged_for_the_victims_prompt_are_refused(tiny, tmp_path, kind, scheme):
    cold, _ = run(engine_with(tiny), {"v": PROMPT}, salt=SALT)
    theirs = own_kv(tiny, ATTACK)
    with ExitStack() as stack:
        store = Store(kind, tmp_path, stack)
        victim = engine_with(tiny, store.spec)
        for (name, key, chunk, check), parts in zip(
            block_names(victim, PROMPT, SALT), theirs, strict=True
        ):
            if scheme == "unkeyed":
                data = unkeyed_record(victim.tiers.ns, key, chunk, SALT, check, parts)
            else:
                data = keyed_record(victim, key, chunk, check, parts, b"w" * 32)
            store.put(name, data)
        got, cached = run(victim, {"v": PROMPT}, salt=SALT)
        assert got == cold and cached == {"v": 0}
        stats = victim.tiers.stats[kind]
        assert (stats.refused, stats.hits, stats.up) == (6, 0, True)
        assert f'kvlm_kv_tier_refused_total{{tier="{kind}"}} 6' in _metrics(victim)
        victim.close()


@pytest.fixture(scope="module")
def tiny_int8(tiny):
    return LLM(model=tiny.loaded.path, progress=False, max_context=256, kv_dtype="int8")


@pytest.mark.parametrize(
    "kind, where",
    [("disk", "magic"), ("disk", "tag"), ("disk", "values"), ("disk", "scales"),
     ("disk", "tokens"), ("redis", "values"), ("redis", "scales")],
)  # fmt: skip
def test_a_tampered_record_is_refused(tiny_int8, tmp_path, kind, where):
    """One byte flipped in a genuine record (int8 K/V: values and scales), or a genuine
    record of other tokens under the name: the block and the ones after it recomputed."""
    with ExitStack() as stack:
        store = Store(kind, tmp_path, stack)
        first = engine_with(tiny_int8, store.spec)
        want, _ = run(first, {"v": PROMPT}, salt=SALT)
        first.tiers.flush()
        names = [b[0] for b in block_names(first, PROMPT, SALT)]
        data = bytearray(store.get(names[0]))
        sizes = first.tiers._sizes[0]
        at = {"magic": 3, "tag": 8 + 5, "values": 40 + sizes["values"] // 2,
              "scales": 40 + sizes["values"] + sizes["scales"] // 2}  # fmt: skip
        if where == "tokens":
            data = bytearray(store.get(names[1]))  # block 1's record as block 0's
        else:
            data[at[where]] ^= 0x10
        store.put(names[0], bytes(data))
        first.close()
        second = engine_with(tiny_int8, store.spec)
        got, cached = run(second, {"v": PROMPT}, salt=SALT)
        assert got == want and cached == {"v": 0}
        assert second.tiers.stats[kind].refused == 1
        second.close()


def test_links_planted_in_the_tier_are_never_followed(tiny, tmp_path):
    """Links at the temporary names the old writer used and at record names: the file
    they point to is never written, a genuine record behind a link is never read."""
    tier, precious = tmp_path / "tier", tmp_path / "precious.txt"
    tier.mkdir(mode=0o700)
    precious.write_text("keep me")
    engine = engine_with(tiny, f"disk:{tier}")
    names = [b[0] for b in block_names(engine, PROMPT, None)]
    for name in names:
        os.symlink(precious, tier / f"{name}.tmp")
    for name in names[:3]:
        os.symlink(precious, tier / f"{name}.kvb")
    want, cached = run(engine, {"a": PROMPT})
    engine.close()
    assert precious.read_text() == "keep me" and cached == {"a": 0}
    assert engine.tiers.stats["disk"].refused == 3  # the links at record names
    for name in names:  # each link at a record name replaced by the record itself
        st = os.lstat(tier / f"{name}.kvb")
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    # a genuine record moved out of the folder and linked back: not followed
    os.replace(tier / f"{names[0]}.kvb", tmp_path / "moved.kvb")
    os.symlink(tmp_path / "moved.kvb", tier / f"{names[0]}.kvb")
    again = engine_with(tiny, f"disk:{tier}")
    got, cached = run(again, {"a": PROMPT})
    assert got == want and cached == {"a": 0} and again.tiers.stats["disk"].refused == 1
    again.close()


def test_a_fifo_under_a_record_name_is_refused_without_blocking(tiny, tmp_path):
    tier = tmp_path / "tier"
    want, _ = run(engine_with(tiny), {"a": PROMPT})
    engine = engine_with(tiny, f"disk:{tier}")
    fifo = tier / f"{block_names(engine, PROMPT, None)[0][0]}.kvb"
    os.mkfifo(fifo)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=run(engine, {"a": PROMPT})))
    worker.start()
    try:
        worker.join(timeout=60)  # the engine thread, which must not wait on the FIFO
        assert not worker.is_alive(), "the engine is blocked on a FIFO"
    finally:
        if worker.is_alive():  # a writer end lets the blocked open() return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(timeout=10)
    got, cached = result["out"]
    assert got == want and cached == {"a": 0}
    assert engine.tiers.stats["disk"].refused == 1
    engine.close()


@pytest.mark.parametrize(
    "problem, message",
    [(0o757, "is writable by others,"), (0o770, "is writable by group,"),
     (0o777, "is writable by group and others,"), ("owner", "belongs to uid 4242, not you")],
)  # fmt: skip
def test_a_tier_directory_others_can_write_is_refused(tmp_path, problem, message):
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    if problem == "owner":
        try:
            os.chown(tier, 4242, 4242)
        except PermissionError:
            pytest.skip("giving a folder to another user takes root")
    else:
        tier.chmod(problem)
    for make in (parse_tier, lambda spec: DiskTier(spec[5:])):
        with pytest.raises(InvalidRequestError, match=message) as err:
            make(f"disk:{tier}")
        assert "\n" not in str(err.value)


def test_records_and_key_are_private(tiny, tmp_path, state_home):
    """A new tier folder is 0700, records 0600 and hold neither the salt nor the token ids;
    the key is made once, 0600, and a restarted engine reads its records with it."""
    tier = tmp_path / "new" / "tier"
    salt = "s3cret-tenant-salt"
    first = engine_with(tiny, f"disk:{tier}")
    want, _ = run(first, {"a": PROMPT}, salt=salt)
    first.close()
    assert stat.S_IMODE(tier.stat().st_mode) == 0o700
    key = state_home / "kvlm" / "tier.key"
    st = key.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 32
    records = sorted(tier.glob("*.kvb"))
    assert len(records) == 6
    tokens = struct.pack("<16I", *PROMPT[:16])
    for record in records:
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
        data = record.read_bytes()
        assert salt.encode() not in data and tokens not in data and b"tokens" not in data
    second = engine_with(tiny, f"disk:{tier}")
    got, cached = run(second, {"a": PROMPT}, salt=salt)
    assert got == want and cached == {"a": 96}
    assert key.stat().st_ino == st.st_ino and key.stat().st_mtime_ns == st.st_mtime_ns
    second.close()


def test_a_key_file_others_can_read_is_refused(tmp_path):
    key = tmp_path / "tier.key"
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_tier_key(key)
    key.write_bytes(b"short")
    key.chmod(0o600)
    with pytest.raises(InvalidRequestError, match="holds 5 bytes"):
        load_tier_key(key)
    key.write_bytes(b"k" * 32)
    assert load_tier_key(key) == b"k" * 32
    for mode in (0o640, 0o604, 0o620):
        key.chmod(mode)
        with pytest.raises(InvalidRequestError, match=f"mode {mode:04o}.*chmod 600"):
            load_tier_key(key)
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        load_tier_key(tmp_path)


def test_engines_share_records_under_one_key_and_refuse_another(tiny, tmp_path):
    keys = {}
    for name in ("a", "b"):
        keys[name] = tmp_path / f"{name}.key"
        keys[name].write_bytes(os.urandom(32))
        keys[name].chmod(0o600)
    with redis_server() as redis:
        one = engine_with(tiny, redis.url, kv_tier_key=str(keys["a"]))
        want, _ = run(one, {"a": PROMPT})
        one.close()
        two = engine_with(tiny, redis.url, kv_tier_key=str(keys["a"]))  # a replica
        got, cached = run(two, {"a": PROMPT})
        assert got == want and cached == {"a": 96}
        two.close()
        other = engine_with(tiny, redis.url, kv_tier_key=str(keys["b"]))  # not one
        got, cached = run(other, {"a": PROMPT})
        assert got == want and cached == {"a": 0}
        assert other.tiers.stats["redis"].refused == 6
        other.close()


# ---------------------------------------------------------------- full, slow, garbage


def warnings_of(caplog, tier: str) -> int:
    return caplog.text.count(f"KV tier {tier} failed")


def test_a_full_tier_costs_recomputation(tiny, tmp_path, caplog):
    """A disk tier smaller than one record keeps none (and stays within its size); a Redis
    out of memory (noeviction) refuses the writes: marked down once, answers unchanged."""
    want, _ = run(engine_with(tiny), {"a": PROMPT})
    small = engine_with(tiny, f"disk:{tmp_path / 'tier'}:1KiB")
    got, _ = run(small, {"a": PROMPT})
    small.close()
    assert got == want and small.tiers.stats["disk"].writes == 6
    assert sum(p.stat().st_size for p in (tmp_path / "tier").iterdir()) <= 1024
    with redis_server() as redis:
        redis.client().config_set("maxmemory-policy", "noeviction")
        redis.client().config_set("maxmemory", 1)
        full = engine_with(tiny, redis.url)
        with caplog.at_level(logging.WARNING, logger="kvlm.tiers"):
            got, _ = run(full, {"a": PROMPT})
            full.tiers.flush()
            again, _ = run(full, {"b": PROMPT[:60]})
        assert got["a"] == want["a"] and again["b"]
        stats = full.tiers.stats["redis"]
        assert stats.errors >= 1 and not stats.up and warnings_of(caplog, "redis") == 1
        assert "OutOfMemoryError" in caplog.text
        full.close()


def test_a_trickling_redis_costs_its_deadline_not_a_frozen_engine(tiny, caplog):
    """Redis' reply forwarded 64 bytes every 50 ms: each read returns within the client's
    0.25 s socket timeout, the whole reply would take many seconds. The request waits the
    tier's deadline (0.5 s, and 1.5 ms for the 48 KiB asked), then computes its prefix; the
    tier is marked down, warned about once, counted, and the next request does not wait
    on it."""
    with redis_server() as redis:
        one = engine_with(tiny, redis.url)
        want, _ = run(one, {"a": PROMPT})
        one.close()
        with TrickleProxy(redis.port, chunk=64, delay=0.05) as proxy:
            slow = engine_with(tiny, proxy.url)
            assert 6 * slow.tiers.record_limit / 64 * 0.05 > 10  # what waiting would cost
            with caplog.at_level(logging.WARNING, logger="kvlm.tiers"):
                start = time.monotonic()
                got, cached = run(slow, {"a": PROMPT})
                took = time.monotonic() - start
                start = time.monotonic()
                again, _ = run(slow, {"b": PROMPT})
                took_again = time.monotonic() - start
            assert got == want and again["b"] == want["a"] and cached == {"a": 0}
            assert took < 5 and took_again < 5  # measured: 1.5-1.8 s and 0.3-1.8 s
            stats = slow.tiers.stats["redis"]
            assert (stats.timeouts, stats.up) == (1, False)
            assert warnings_of(caplog, "redis") == 1
            assert "6 lookups within its deadline (0.50 s)" in caplog.text
            text = _metrics(slow)
            assert 'kvlm_kv_tier_up{tier="redis"} 0' in text
            assert 'kvlm_kv_tier_timeouts_total{tier="redis"} 1' in text
            slow.close()


def test_closing_waits_for_a_slow_tier_a_bounded_time(tmp_path):
    """Writes queued behind a Redis that answers one byte every 0.2 s (each SET would take
    about a second): close() gives them CLOSE_FLUSH_S, drops the rest (counted) and cuts
    the connection."""
    with redis_server() as redis, TrickleProxy(redis.port, chunk=1, delay=0.2) as proxy:
        m, tiers = small_tiers(tmp_path, tier=tiers_mod.RedisTier(proxy.url))
        for i in range(8):
            table, _ = m.allocate([i + 1] * BS + [0])
            m.seal(table, [i + 1] * BS + [0], BS)
            m.free(table)
        start = time.monotonic()
        tiers.close()
        took = time.monotonic() - start
        assert took < tiers_mod.CLOSE_FLUSH_S + 2  # measured: ~2.0 s
        assert tiers.dropped >= 5


@pytest.mark.parametrize(
    "reply, down",
    [
        (b"\x00\xffjunk\r\n", True),  # not RESP: the client cannot parse it
        (b":42\r\n", False),  # a number
        (b"*2\r\n:1\r\n:2\r\n", False),  # a list
        (b"$3\r\nabc\r\n", False),  # a string of the wrong length
        (b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", False),
    ],
)
def test_a_redis_answering_garbage_costs_recomputation(tiny, reply, down):
    want, _ = run(engine_with(tiny), {"a": PROMPT})
    with JunkRedis(reply) as junk:
        engine = engine_with(tiny, junk.url)
        got, cached = run(engine, {"a": PROMPT})
        assert got == want and cached == {"a": 0}
        stats = engine.tiers.stats["redis"]
        if down:
            assert not stats.up and stats.errors >= 1 and stats.refused == 0
        else:  # every record refused, the tier still asked
            assert stats.refused == 6 and stats.hits == 0
        engine.close()


def test_a_slow_tier_holds_its_request_not_the_engines_steps(tiny, tmp_path):
    """The engine thread never waits for a tier: while a disk tier's lookup is held (its
    get blocks until the test lets it go), every step goes on and decodes the running
    stream, and the request that asked waits in the queue; once the tier answers it is
    admitted with the blocks that came, and its answer is the one computed from scratch."""
    first = engine_with(tiny, f"disk:{tmp_path}")
    want, _ = run(first, {"a": PROMPT})
    first.close()
    engine = engine_with(tiny, f"disk:{tmp_path}")
    disk = engine.tiers.tiers[0]
    disk.deadline = 60.0  # the engine would wait this long for it (it used to)
    asked, release, answered = threading.Event(), threading.Event(), threading.Event()
    get_many = disk.get_many

    def held(names: list[str], limit: int) -> list:
        asked.set()
        release.wait(5)  # a bound for the engine that waits (before the fix): 5 s
        try:
            return get_many(names, limit)
        finally:
            answered.set()

    disk.get_many = held
    stream = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("s", PROMPT[:3], stream)
    engine.step()
    engine.add_request("a", PROMPT, GREEDY)
    for _ in range(4):
        events = engine.step()
        # the lookup runs on the tiers' thread: it has begun by now or begins shortly
        assert asked.wait(5) and not answered.is_set()  # the tier still holds its answer
        assert [ev.request_id for ev in events] == ["s"]  # and the stream stepped on
        assert [s.request_id for s in engine.scheduler.waiting] == ["a"]
    release.set()
    out, cached = {"a": [], "s": []}, {}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
            cached.setdefault(ev.request_id, ev.cached_tokens)
    assert out["a"] == want["a"] and cached["a"] == 96
    assert engine.tiers.stats["disk"].hits == 6
    engine.close()


def test_a_request_that_leaves_while_its_tier_lookup_runs_holds_nothing(tiny, tmp_path):
    """Aborted while it waits for the tier: the pool blocks its lookup held go back, and
    the answer that comes later is dropped."""
    first = engine_with(tiny, f"disk:{tmp_path}")
    run(first, {"a": PROMPT})
    first.close()
    engine = engine_with(tiny, f"disk:{tmp_path}")
    run(engine, {"warm": PROMPT[:40]})  # two blocks of the prompt in the pool: held by the lookup
    disk = engine.tiers.tiers[0]
    release, get_many = threading.Event(), disk.get_many
    disk.get_many = lambda names, limit: release.wait(5) and get_many(names, limit)
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    assert engine.scheduler.blocked_on()
    assert engine.pool.num_used == 2
    engine.abort("a")
    release.set()
    engine.tiers.flush()
    assert not engine.has_work() and engine.pool.num_used == 0
    assert not engine.scheduler.blocked_on()
    engine.close()
