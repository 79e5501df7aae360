"""Bounds on a guide (kvlm.engine.guided), checked in pure Python before any native code
sees it.

llguidance compiles recursively: a chain of 3,000 Lark rules, or of 1,000 `$ref` links
that each nest an object, overflows an 8 MiB stack and ends the process with SIGSEGV
(benchmarks and figures: docs/API.md, "Limits on guides"). So the shapes that drive its
recursion are measured here without recursion (explicit stacks, `$ref` resolved by JSON
pointer), and a guide over a bound is the request's 400 naming its field. What these
bounds cannot see (a counted repetition that takes seconds, an unknown crash) is caught
by the compile worker's time limit and process boundary (kvlm.engine.guide_worker).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from kvlm.errors import InvalidRequestError

MAX_GUIDE_CHARS = 128 * 1024  # a grammar, regex, schema (as JSON) or the choices together
MAX_REGEX_CHARS = 16 * 1024
MAX_LARK_RULES = 1_000  # rule and terminal definitions
MAX_SCHEMA_NODES = 5_000  # JSON values in the schema document
MAX_SCHEMA_DEPTH = 128  # nesting, counted through every $ref followed (cycles cut)
MAX_REF_DEPTH = 64  # $ref links followed on one path
MAX_FAN_OUT = 256  # anyOf / oneOf / allOf branches, properties of one object
_FAN_OUT_KEYS = ("anyOf", "oneOf", "allOf", "properties", "patternProperties")
# a Lark definition starts a line: `name:`, `?name:`, `!name:`, `NAME.2:`
_LARK_DEF = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:", re.MULTILINE)


def check_bounds(kind: str, spec: Any, param: str) -> None:
    """InvalidRequestError naming `param` where the guide is over a bound."""

    def refuse(what: str) -> None:
        raise InvalidRequestError(f"{param}: {what}", param=param)

    if kind == "grammar":
        _check_chars(spec, MAX_GUIDE_CHARS, "the grammar", refuse)
        rules = len(_LARK_DEF.findall(spec))
        if rules > MAX_LARK_RULES:
            refuse(f"the grammar has {rules} rules; at most {MAX_LARK_RULES} are accepted")
    elif kind == "regex":
        _check_chars(spec, MAX_REGEX_CHARS, "the regular expression", refuse)
    elif kind == "choice":
        _check_chars("".join(spec), MAX_GUIDE_CHARS, "the choices together", refuse)
    elif kind == "json_schema":
        _check_schema(spec, refuse)


def _check_chars(text: str, limit: int, what: str, refuse) -> None:
    if len(text) > limit:
        refuse(f"{what} has {len(text):,} characters; at most {limit:,} are accepted")


def _check_schema(schema: Any, refuse) -> None:
    nodes = 0
    stack = [(schema, 1)]
    while stack:  # the document itself first: its size and nesting bound what follows
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            refuse(f"the schema has more than {MAX_SCHEMA_NODES:,} values")
        if depth > MAX_SCHEMA_DEPTH:
            refuse(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            for key in _FAN_OUT_KEYS:
                part = node.get(key)
                if isinstance(part, (list, dict)) and len(part) > MAX_FAN_OUT:
                    refuse(f"'{key}' has {len(part)} entries; at most {MAX_FAN_OUT} are accepted")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    _check_chars(json.dumps(schema), MAX_GUIDE_CHARS, "the schema", refuse)
    depth, hops = _deepest(schema)
    if hops > MAX_REF_DEPTH:
        refuse(f"a $ref chain of {hops} links; at most {MAX_REF_DEPTH} are accepted")
    if depth > MAX_SCHEMA_DEPTH:
        refuse(f"the schema nests {depth} levels through its $refs; at most {MAX_SCHEMA_DEPTH}")


def _deepest(root: Any) -> tuple[int, int]:
    """(nesting depth, $ref links) of the deepest path from `root`, a $ref's target counted
    as its child; a path that comes back to a node on it (a recursive schema: llguidance
    makes it a recursive rule, not a deeper one) stops there. Iterative post-order with a
    memo: each container is finished once."""
    memo: dict[int, tuple[int, int]] = {}
    active: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finish = stack.pop()
        key = id(node)
        if finish:
            active.discard(key)
            depth = hops = 0
            for child, link in _children(node, root):
                d, h = memo.get(id(child), (0, 0))  # (0, 0): on the path, a cycle's way back
                depth, hops = max(depth, d), max(hops, h + link)
            memo[key] = (depth + 1, hops)
            if depth + 1 > MAX_SCHEMA_DEPTH or hops > MAX_REF_DEPTH:
                return memo[key]  # over already: the rest cannot make it less so
            continue
        if key in memo or key in active:
            continue
        active.add(key)
        stack.append((node, True))
        for child, _ in _children(node, root):
            if id(child) not in memo and id(child) not in active:
                stack.append((child, False))
    return memo.get(id(root), (1, 0))


def _children(node: Any, root: Any) -> list[tuple[Any, int]]:
    """The containers under `node`, each with 1 where it is reached by a $ref."""
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    out = [(v, 0) for v in values if isinstance(v, (dict, list))]
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target = _resolve(root, node["$ref"])
        if isinstance(target, (dict, list)):
            out.append((target, 1))
    return out


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer (`#`, `#/$defs/a~1b`); None for anything else (anchors, other
    documents: llguidance refuses or resolves those itself, inside the worker)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
