"""No grammar or schema ends or stalls the server (kvlm.engine.guide_limits, guide_worker).

A real `kvlm serve` on 127.0.0.1: each bound met exactly compiles and the request
completes, one past it is a 400 naming the field; the 5,000-rule Lark chain and the
5,000-link $ref chain that crashed llguidance (SIGSEGV) are 400s; a killed compile worker
is one request's 400 and the next guided request works; and a neighbour stream beside all
of it gets the tokens it gets alone. A hypothesis fuzzer sends generated grammars and
schemas to the compile path in a subprocess and fails on a crash or a hang.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlm.engine import guide_limits as L
from serving import kvlm_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--max-context", "512", "--max-num-seqs", "4", "--threads", "1",
                    "--weights", "native", "--log-level", "warning") as (port, proc):  # fmt: skip
        yield port, proc


def post(port: int, body: dict, path: str = "/v1/completions") -> tuple[int, dict, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.perf_counter()
    conn.request("POST", path, body=json.dumps({"model": MODEL, **body}),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw), time.perf_counter() - start


def guided(port: int, field: str, value, **more) -> tuple[int, dict, float]:
    return post(port, {"prompt": "Answer:", "max_tokens": 3, "temperature": 0, field: value,
                       **more})  # fmt: skip


# ------------------------------------------------------------------ guides at the bounds


def lark_chain(rules: int) -> str:
    """`rules` definitions: start, then r0 .. r(rules-2), each "a" and the next."""
    body = "".join(f'r{i}: "a" r{i + 1}\n' for i in range(rules - 2))
    return f'start: r0\n{body}r{rules - 2}: "a"\n'


def ref_chain(links: int, nest: bool = False) -> dict:
    """A root $ref and `links - 1` more, each def a plain alias (or nesting an object)."""
    last = f"d{links - 1}"
    defs = {}
    for i in range(links - 1):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"x": ref}} if nest else ref
    defs[last] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_chain(depth: int) -> dict:
    """The longest nesting (through $refs) that is `depth` levels; max_depth below."""
    links = 1
    while L._deepest(ref_chain(links + 1, nest=True))[0] <= depth:
        links += 1
    return ref_chain(links, nest=True)


def enum_of(values: int) -> dict:
    return {"enum": [f"v{i}" for i in range(values)]}  # 2 + values JSON values


def fan(key: str, n: int) -> dict:
    if key == "properties":
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    return {key: [{"const": i} for i in range(n)]}


def choices(total: int) -> list[str]:
    """1,024 choices (the most a request takes) of `total` characters together."""
    size, extra = divmod(total, 1024)
    return [f"{i:04d}" + "x" * (size - 4 + (i < extra)) for i in range(1024)]


# (field, just at the bound, one past it, words the 400 says)
BOUNDS = [
    ("guided_grammar", lark_chain(L.MAX_LARK_RULES), lark_chain(L.MAX_LARK_RULES + 1), "rules"),
    ("guided_grammar", 'start: "' + "a" * (L.MAX_GUIDE_CHARS - 9) + '"',
     'start: "' + "a" * (L.MAX_GUIDE_CHARS - 8) + '"', "at most"),
    ("guided_regex", "b" * L.MAX_REGEX_CHARS, "b" * (L.MAX_REGEX_CHARS + 1), "characters"),
    ("guided_choice", choices(L.MAX_GUIDE_CHARS), choices(L.MAX_GUIDE_CHARS + 1), "characters"),
    ("guided_json", ref_chain(L.MAX_REF_DEPTH), ref_chain(L.MAX_REF_DEPTH + 1), "$ref chain"),
    ("guided_json", nested_chain(L.MAX_SCHEMA_DEPTH),
     ref_chain(len(nested_chain(L.MAX_SCHEMA_DEPTH)["$defs"]) + 1, nest=True), "nests"),
    ("guided_json", enum_of(L.MAX_SCHEMA_NODES - 2), enum_of(L.MAX_SCHEMA_NODES - 1), "values"),
    ("guided_json", fan("anyOf", L.MAX_FAN_OUT), fan("anyOf", L.MAX_FAN_OUT + 1), "anyOf"),
    ("guided_json", fan("properties", L.MAX_FAN_OUT), fan("properties", L.MAX_FAN_OUT + 1),
     "properties"),
]  # fmt: skip

# what crashed the server before the bounds: SIGSEGV in llguidance, a stack overflow
CRASHERS = [
    ("guided_grammar", lark_chain(5_000)),
    ("guided_json", ref_chain(5_000)),
    ("guided_json", ref_chain(5_000, nest=True)),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": ref_chain(5_000)}}),
]  # fmt: skip


def stream(port: int, max_tokens: int) -> tuple[list[str], float]:
    """A normal greedy stream's tokens and its worst gap between two chunks (s)."""
    body = {"model": MODEL, "prompt": "Write a short note about caches.", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    tokens, gap, last = [], 0.0, None
    for line in resp:
        if line.startswith(b"data: {"):
            now = time.perf_counter()
            gap = gap if last is None else max(gap, now - last)
            last = now
            tokens += json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
    conn.close()
    return tokens, gap


def check_bounds_through(port: int) -> list[str]:
    """Every bound met and passed, then the crashers; failures as text (asserted after)."""
    bad = []
    for field, at, past, words in BOUNDS:
        status, body, took = guided(port, field, at)
        print(f"{field} at ({words}): {status} in {took:.3f} s")
        if status != 200:
            bad.append(f"{field} at its bound ({words}): {status} {body}")
        status, body, took = guided(port, field, past)
        err = body.get("error", {})
        if status != 400 or err.get("param") != field or words not in err.get("message", ""):
            bad.append(f"{field} past its bound ({words}): {status} {body}")
        print(f"{field} past ({words}): 400 in {took:.3f} s")
    for field, value in CRASHERS:
        if field == "response_format":
            status, body, took = post(port, {"messages": [{"role": "user", "content": "Hi"}],
                                             "max_tokens": 3, field: value},
                                      "/v1/chat/completions")  # fmt: skip
        else:
            status, body, took = guided(port, field, value)
        if status != 400 or not body["error"]["param"].startswith(field):
            bad.append(f"crasher {field}: {status} {body}")
        print(f"crasher {field}: {status} in {took:.3f} s")
    return bad


def test_bounds_refuse_fast_and_the_neighbour_streams_on(server):
    port, proc = server
    assert guided(port, "guided_regex", "[a-z]+")[0] == 200  # the worker started
    alone, alone_gap = stream(port, 64)
    with ThreadPoolExecutor(2) as pool:
        neighbour = pool.submit(stream, port, 64)
        time.sleep(0.5)  # it is decoding
        bad = check_bounds_through(port)
        together, gap = neighbour.result()
    print(f"neighbour's worst gap between chunks: {gap:.3f} s (alone {alone_gap:.3f} s)")
    assert bad == []
    assert proc.poll() is None
    assert together == alone
    # the stream's own worst gap alone measures the machine (4.0 s on 2 vCPUs shared with
    # other test runs); beside the guides it may be at most 2 s worse (measured: 2.8 s)
    assert gap < alone_gap + 2.0


# ------------------------------------------------------------------ the worker's crash


def worker_pids(server_pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"kvlm.engine.guide_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
    return out


def test_a_dead_worker_is_one_400_and_the_next_request_works(server):
    port, proc = server
    assert guided(port, "guided_regex", "[0-9]+")[0] == 200
    pids = worker_pids(proc.pid)  # one, or two if earlier guides compiled at once
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSEGV)  # as llguidance's stack overflow ends it
    time.sleep(0.2)
    status, body, _ = guided(port, "guided_regex", "[a-f]+")
    assert status == 400, body
    assert body["error"]["param"] == "guided_regex"
    assert "crashed" in body["error"]["message"] and "SIGSEGV" in body["error"]["message"]
    status, body, _ = guided(port, "guided_json", {"type": "integer"})
    assert status == 200, body
    assert body["choices"][0]["text"].isdigit()
    assert proc.poll() is None
    assert worker_pids(proc.pid) and not set(worker_pids(proc.pid)) & set(pids)


# ------------------------------------------------------------------ the fuzzer

COMPILER = """
import json, sys
from kvlm.engine.guided import Guide, compile_guide
from kvlm.errors import InvalidRequestError
from kvlm.loading import load_model
tok = load_model().tokenizer
print("ready", flush=True)
for line in sys.stdin:
    kind, spec = json.loads(line)
    try:
        compile_guide(Guide(kind, spec, "f"), tok, 49152)
        print("ok", flush=True)
    except InvalidRequestError as exc:
        print("400", flush=True)
"""

NAMES = [f"d{i}" for i in range(6)]
_leaf = st.one_of(
    st.sampled_from([{"type": t} for t in ("integer", "string", "boolean", "number", "null")]),
    st.builds(lambda n: {"$ref": f"#/$defs/{n}"}, st.sampled_from(NAMES)),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.from_regex(r"[ab()|*+?]{0,12}")),
    st.builds(lambda v: {"enum": v}, st.lists(st.integers(), min_size=1, max_size=5)),
)
_schema = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda k, ps: {k: ps}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
              st.lists(inner, min_size=1, max_size=6)),
    st.builds(lambda ps: {"type": "object", "properties": ps, "required": sorted(ps)[:1]},
              st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)),
    st.builds(lambda i: {"type": "array", "items": i, "maxItems": 3}, inner),
), max_leaves=30)  # fmt: skip
SCHEMAS = st.builds(lambda root, defs: {**root, "$defs": defs}, _schema,
                    st.dictionaries(st.sampled_from(NAMES), _schema, max_size=6))  # fmt: skip
LONG_REFS = st.builds(lambda n, nest: ref_chain(n, nest), st.integers(2, 3000), st.booleans())

_term = st.sampled_from(['"a"', '"b"', "/[0-9]+/", "/(ab|c)*/", "r0", "r1", "r2", "r3"])
_expr = st.recursive(_term, lambda inner: st.one_of(
    st.builds(lambda xs: " ".join(xs), st.lists(inner, min_size=1, max_size=4)),
    st.builds(lambda xs: "(" + " | ".join(xs) + ")", st.lists(inner, min_size=1, max_size=4)),
    st.builds(lambda x, op: f"({x}){op}", inner, st.sampled_from(["*", "+", "?"])),
), max_leaves=12)  # fmt: skip
GRAMMARS = st.one_of(
    st.builds(lambda rules: "start: r0\n" + "".join(f"r{i}: {e}\n" for i, e in enumerate(rules)),
              st.lists(_expr, min_size=4, max_size=8)),
    st.builds(lambda n: lark_chain(n), st.integers(2, 4000)),
    st.builds(lambda n: "start: " + "(" * n + '"a"' + ")" * n, st.integers(1, 3000)),
)  # fmt: skip
REGEXES = st.one_of(
    st.from_regex(r"[ab()|*+?{}0-9,\[\]\\]{1,40}"),
    st.builds(lambda a, b: f"(a{{{a}}}){{{b}}}", st.integers(1, 2000), st.integers(1, 2000)),
)
GUIDES = st.one_of(
    st.tuples(st.just("json_schema"), SCHEMAS | LONG_REFS),
    st.tuples(st.just("grammar"), GRAMMARS),
    st.tuples(st.just("regex"), REGEXES),
)


@pytest.fixture(scope="module")
def compiler():
    proc = subprocess.Popen([sys.executable, "-c", COMPILER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_generated_guides_never_crash_or_hang_the_compile_path(compiler):
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(compiler.stdout, selectors.EVENT_READ)
    seen = {"ok": 0, "400": 0}

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(GUIDES)
    def one(guide):
        compiler.stdin.write(json.dumps(guide) + "\n")
        compiler.stdin.flush()
        # the worker's 3 s limit, the server's own compile and a loaded machine: 30 s
        assert sel.select(timeout=30), f"hung on {json.dumps(guide)[:300]}"
        answer = compiler.stdout.readline().strip()
        assert answer in seen, f"the compile path died ({compiler.poll()}) on {guide!r:.300}"
        seen[answer] += 1

    one()
    print(seen)
    assert seen["ok"] > 0 and seen["400"] > 0
