"""Tool calls checked against their tools' whole schemas (kvlm.server.tool_check): what
the lenient grammar leaves out (`propertyNames`) is checked after the fact, a call that
breaks it leaves the reply text (whole and streamed alike), and a hostile schema cannot
hold the server: patterns under a timeout, uniqueItems bounded, no `$ref` fetched."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from kvlm.server.tool_check import CHECK_S, MAX_UNIQUE, ToolChecks, tool_checks
from kvlm.server.tools import Call, ToolStream, auto_guide, forced_guide, parse


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# a record as zod writes it, its keys held to a pattern llguidance's grammar leaves out
ENV = tool("set_env", {"type": "object", "properties": {"vars": {
    "type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
    "additionalProperties": {"type": "string"}}}, "required": ["vars"]})  # fmt: skip
PLAIN = tool("time", {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}})


def call(name: str, args: dict | str) -> Call:
    return Call(name, args if isinstance(args, str) else json.dumps(args))


def test_a_call_that_breaks_what_the_grammar_left_out_is_found():
    checks = ToolChecks([ENV, PLAIN])
    assert checks.broken([call("set_env", {"vars": {"HOME": "/root"}})]) is None
    why = checks.broken([call("time", {"zone": "UTC"}), call("set_env", {"vars": {"home": "x"}})])
    assert why is not None and why.startswith("set_env:") and "'home' does not match" in why
    assert "no tool named 'nope'" in checks.broken([call("nope", {})])
    # a call cut off by max_tokens is as far as it came (its finish_reason says so)
    assert checks.broken([call("set_env", '{"vars": {"home": ')]) is None


def test_the_schemas_draft_is_the_one_it_names():
    draft7 = tool("d7", {"$schema": "http://json-schema.org/draft-07/schema#",
                         "type": "object", "propertyNames": {"maxLength": 2},
                         "dependencies": {"a": ["b"]}})  # fmt: skip
    checks = ToolChecks([draft7])
    assert checks.broken([call("d7", {"a": 1, "b": 2})]) is None
    assert "'b' is a dependency of 'a'" in checks.broken([call("d7", {"a": 1})])
    assert "too long" in checks.broken([call("d7", {"abc": 1})])


def test_a_reply_with_a_broken_call_stays_text_whole_and_streamed():
    checks = ToolChecks([ENV, PLAIN])
    good = '{"name": "set_env", "arguments": {"vars": {"HOME": "/root"}}}'
    bad = '{"name": "set_env", "arguments": {"vars": {"home": "/root"}}}'
    hermes = "Setting it.\n<tool_call>\n{}\n</tool_call>"
    for parser, reply in (("hermes", hermes), (None, "[{}]"), ("llama3_json", "{}")):
        text_good, text_bad = reply.replace("{}", good), reply.replace("{}", bad)
        if parser == "llama3_json":
            text_good, text_bad = (t.replace('"arguments"', '"parameters"')
                                   for t in (text_good, text_bad))  # fmt: skip
        assert parse(text_good, parser, checks)[1][0].name == "set_env"
        assert parse(text_bad, parser) != (text_bad, [])  # unchecked: a call
        assert parse(text_bad, parser, checks) == (text_bad, [])
        for text, broken in ((text_good, False), (text_bad, True)):
            stream = ToolStream(parser, checks)
            shown = "".join(stream.push(ch) for ch in text)
            assert stream.deltas() == []  # checked calls are held, never streamed in parts
            rest, whole = stream.finish()
            if broken:
                assert (shown + rest, whole) == (text, [])
            else:
                assert [c.name for c in whole] == ["set_env"] and not rest


def test_only_what_the_grammar_left_out_makes_the_calls_checked(tiny):
    from kvlm.engine.guided import compile_guide

    def compiled(guide):
        return compile_guide(guide, tiny.tokenizer, tiny.config.vocab_size)

    whole = compiled(forced_guide([PLAIN], None, True))
    assert whole.compiled.warnings == () and tool_checks([PLAIN], whole) is None
    lenient = compiled(auto_guide([ENV, PLAIN]))
    assert "propertyNames" in " ".join(lenient.compiled.warnings)
    assert isinstance(tool_checks([ENV, PLAIN], lenient), ToolChecks)
    assert isinstance(tool_checks([PLAIN], None), ToolChecks)  # no grammar made the calls
    assert tool_checks(None, None) is None


@pytest.mark.parametrize(
    "schema, args",
    [  # each a backtracking search of 2^27 steps (~10 s) under the re module that
        # jsonschema uses; a longer text doubles it for each character
        ({"properties": {"s": {"pattern": "^(a|a)*$"}}}, {"s": "a" * 27 + "!"}),
        ({"propertyNames": {"pattern": "^(a|a)*$"}}, {"a" * 27 + "!": 1}),
        ({"patternProperties": {"^(a|a)*$": {}}}, {"a" * 27 + "!": 1}),
        ({"patternProperties": {"^(a|a)*$": {}}, "additionalProperties": False},
         {"a" * 27 + "!": 1}),
        # jsonschema compares objects' items pairwise: 8M comparisons (~14 s)
        ({"properties": {"l": {"uniqueItems": True}}},
         {"l": [{"k": i} for i in range(8 * MAX_UNIQUE)]}),
    ],
)  # fmt: skip
def test_a_hostile_schema_is_checked_within_its_bound(schema, args):
    checks = ToolChecks([tool("f", {"type": "object", **schema})])
    started = time.monotonic()
    assert checks.broken([call("f", args)]) is None  # not checked: the call goes through
    assert time.monotonic() - started < CHECK_S + 2  # slack for a shared, loaded machine


def test_a_reference_to_another_document_is_never_fetched():
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/schema.json"
        checks = ToolChecks([tool("f", {"type": "object", "properties": {"a": {"$ref": url}}})])
        assert checks.broken([call("f", {"a": 3})]) is None  # unresolvable: not checked
        server.shutdown()
    assert asked == []
