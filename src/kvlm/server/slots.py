"""llama.cpp's slot API (llama-server's `/slots`) over kvlm's engine: `GET /slots`, and
`POST /slots/{id}?action=save|restore|erase` with `kvlm serve --slot-save-path DIR`, so
that tools written for llama-server keep a conversation across server restarts.

llama-server runs a fixed number of slots, each holding one sequence's K/V; a tool picks
one (`id_slot`), saves its cache to a file under `--slot-save-path`, restores it later and
erases it. kvlm's engine has no slots: its pool shares every prompt's blocks through the
prefix cache. So a slot here names the last conversation a request ran under it: the
request's `id_slot`, else the slot whose conversation its prompt continues furthest, else
the least recently used one; its token ids (the prompt and the first sample's reply).

    save     the slot's ids to DIR/FILE (a small JSON file: the model's tier namespace and
             the ids). Their K/V are in the disk tier --slot-save-path keeps beside it
             (DIR/kv: every block written through as it is sealed, MAC'd, a recurrent
             model's state snapshots with them; kvlm.cache.tiers), its queued writes
             flushed first.
    restore  DIR/FILE's ids run as a prompt of one token (the token not kept): admission
             loads from the tier every block it verifies (and a recurrent model's latest
             state snapshot among them), and only what it lacked is computed.
             `n_restored` is the tokens the cache served: a restore that restores nothing
             says 0, never a success that re-prefills (llama.cpp 26676, on hybrids).
    erase    forgets the slot's conversation (its blocks stay cached, evictable).

Nothing read is trusted: FILE is a name, not a path; the file is read within the bytes
a context's ids take, its namespace must be this model's and its ids ints within the
vocabulary and the context; ids changed in the file find no records (each record's MAC
covers the ids before it), so they are computed, never answered from another prefix's K/V.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.sampling import SamplingParams
from kvlm.engine.sequence import common_prefix
from kvlm.errors import InvalidRequestError, KvlmError

FORMAT = "kvlm slot 1"  # the file's "format"
ID_BYTES = 16  # a slot file's bytes an id at most (JSON: "1234567, " and then some)
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a slot file's name
MAX_SLOTS = 16  # slots /slots lists: at most the engine's sequences decoding together
ACTIONS = ("save", "restore", "erase")


class NotSupported(KvlmError):
    """A slot action this server was not started for (llama-server's 501)."""


@dataclass
class Slot:
    id: int
    ids: list[int] = field(default_factory=list)  # the conversation it last ran
    used: float = 0.0  # when a request last took it (time.monotonic)
    running: int = 0  # its requests now


class SlotTable:
    """The server's slots (`n` of them) and, with `save_dir`, where their files go."""

    def __init__(self, n: int, save_dir: Path | None) -> None:
        self.slots = [Slot(i) for i in range(n)]
        self.save_dir = save_dir

    def slot(self, id_slot: int) -> Slot:
        if not 0 <= id_slot < len(self.slots):
            raise InvalidRequestError(f"id_slot {id_slot}: this server has slots 0 to "
                                      f"{len(self.slots) - 1}")  # fmt: skip
        return self.slots[id_slot]

    def take(self, id_slot: int | None, ids: list[int]) -> Slot:
        """The slot a request of prompt `ids` runs under: `id_slot` (None or -1: the one
        whose conversation the prompt continues furthest, else the least recently used
        idle one, else the least recently used)."""
        if id_slot is not None and id_slot >= 0:
            slot = self.slot(id_slot)
        else:
            slot = max(self.slots, key=lambda s: (common_prefix(s.ids, ids), s.running == 0,
                                                  -s.used))  # fmt: skip
        slot.used, slot.running = time.monotonic(), slot.running + 1
        return slot

    def done(self, slot: Slot, ids: list[int]) -> None:
        slot.running -= 1
        slot.ids = ids

    def listing(self, n_ctx: int) -> list[dict[str, Any]]:
        """GET /slots: each slot's id, context, whether a request runs in it, and how many
        tokens its conversation holds (llama-server's fields, those kvlm has)."""
        return [{"id": s.id, "id_task": -1, "n_ctx": n_ctx, "is_processing": s.running > 0,
                 "n_tokens": len(s.ids)} for s in self.slots]  # fmt: skip

    def path(self, filename: object) -> Path:
        """DIR/filename for a name (NotSupported without --slot-save-path)."""
        if self.save_dir is None:
            raise NotSupported("this server does not support slot save and restore: start it "
                               "with --slot-save-path DIR")  # fmt: skip
        if not isinstance(filename, str) or not NAME.fullmatch(filename):
            raise InvalidRequestError(
                "filename: a file name of letters, digits, '_', '-' and '.' (at most 128, not "
                "starting with '.' or '-')"
            )
        return self.save_dir / filename


async def act(
    table: SlotTable, engine: AsyncEngine, id_slot: int, action: str, body: dict[str, Any]
) -> dict[str, Any]:
    """POST /slots/{id_slot}?action=...: llama-server's answer to it."""
    slot = table.slot(id_slot)
    if action not in ACTIONS:
        raise InvalidRequestError(f"action {action!r}: one of {', '.join(ACTIONS)}")
    if action == "erase":
        n, slot.ids = len(slot.ids), []
        return {"id_slot": id_slot, "n_erased": n}
    path = table.path(body.get("filename"))
    t = time.perf_counter()
    if action == "save":  # the tier's queued writes out first: the file names their K/V
        ns = await engine.call(lambda e: _namespace(e, flush=True), timeout=30.0)
        data = json.dumps({"format": FORMAT, "namespace": ns, "ids": slot.ids}).encode()
        await asyncio.to_thread(_write, path, data)
        return {"id_slot": id_slot, "filename": path.name, "n_saved": len(slot.ids),
                "n_written": len(data),
                "timings": {"save_ms": (time.perf_counter() - t) * 1000}}  # fmt: skip
    ids = await _read(path, engine)
    served = await _restore(engine, ids)
    slot.ids = ids
    ms = (time.perf_counter() - t) * 1000
    return {"id_slot": id_slot, "filename": path.name, "n_restored": served,
            "n_read": len(ids), "timings": {"restore_ms": ms}}  # fmt: skip


def _namespace(engine, flush: bool = False) -> str:
    """The tier namespace of the engine's K/V (group 0's), with `flush` once its queued
    writes are out (on the engine's thread)."""
    tiers = engine.tiers
    if tiers is None:
        raise NotSupported("slot save and restore need --slot-save-path's disk tier")
    if flush:
        tiers.flush()
    return tiers.ns


def _write(path: Path, data: bytes) -> None:
    """The file whole or not at all: a temporary file of its own (two saves at once each
    write theirs) renamed over it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


async def _read(path: Path, engine: AsyncEngine) -> list[int]:
    """A slot file's ids, every field checked against this model (read within the bytes
    a context's ids take: ID_BYTES an id, 4 KiB besides)."""
    info = engine.info
    most = ID_BYTES * info.max_model_len + 4096

    def read() -> bytes:
        try:
            with open(path, "rb") as f:
                data = f.read(most + 1)
        except FileNotFoundError:
            raise InvalidRequestError(f"no slot file {path.name!r}") from None
        if len(data) > most:
            raise InvalidRequestError(f"slot file {path.name!r} is over {most} bytes: more "
                                      "ids than the context holds")  # fmt: skip
        return data

    data = await asyncio.to_thread(read)
    try:
        saved = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError(f"slot file {path.name!r} is not a kvlm slot file") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise InvalidRequestError(f"slot file {path.name!r} is not a kvlm slot file")
    ns = await engine.call(_namespace)
    if saved.get("namespace") != ns:
        raise InvalidRequestError(f"slot file {path.name!r} was saved by another model or "
                                  "numerics: its K/V are not this server's")  # fmt: skip
    ids = saved.get("ids")
    if not isinstance(ids, list) or not all(
        type(t) is int and 0 <= t < info.vocab_size for t in ids
    ):
        raise InvalidRequestError(f"slot file {path.name!r}: its ids are not this model's")
    if len(ids) >= info.max_model_len:
        raise InvalidRequestError(f"slot file {path.name!r}: {len(ids)} ids, past the context")
    return ids


async def _restore(engine: AsyncEngine, ids: list[int]) -> int:
    """`ids` admitted as a prompt of one token: the tokens the cache served (from the pool
    or the tiers), the rest computed (0 ids: 0)."""
    if not ids:
        return 0
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    served = 0
    async for event in await engine.generate(ids, params):
        served = max(served, event.cached_tokens)
    return served
