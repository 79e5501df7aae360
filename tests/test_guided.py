"""Grammar-constrained decoding (kvlm.engine.guided, llguidance): on a random-weight model
whose unconstrained output is noise, the output still parses and validates against the
JSON schema, matches the regex, is one of the choices; each sample has its own matcher, so
a guided sample's tokens are the same alone and in a batch; a bad schema is refused before
any work."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvlm import SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.guided import Guide
from kvlm.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def text(llm, params, prompt="Give me a person as JSON:"):
    return [o.text for o in llm.generate(prompt, params)[0].outputs]


def test_json_schema_output_validates(tiny):
    for temperature, seed in ((0, None), (1.0, 3), (1.3, 8)):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=120,
                                guide=Guide("json_schema", SCHEMA))  # fmt: skip
        for out in text(tiny, params):
            jsonschema.validate(json.loads(out), SCHEMA)


def test_json_object_regex_and_choice(tiny):
    # any object: nothing bounds its length, so a sample cut by max_tokens is a prefix;
    # every one that ended by itself parses (here every seed's but one is "{}")
    ended = 0
    for seed in range(6):
        out = tiny.generate("JSON:", SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                                                    guide=Guide("json_object")))  # fmt: skip
        one = out[0].outputs[0]
        if one.finish_reason == "stop":
            assert isinstance(json.loads(one.text), dict)
            ended += 1
    assert ended >= 1
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    got = text(tiny, SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                                    guide=Guide("regex", pattern)))[0]  # fmt: skip
    assert re.fullmatch(pattern, got), got
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        got = text(tiny, SamplingParams(temperature=1.0, seed=seed, max_tokens=10,
                                        guide=Guide("choice", choices)))[0]  # fmt: skip
        assert got in choices


def test_unguided_output_is_not_json(tiny):
    """The control: without the guide the random model does not write this JSON."""
    out = text(tiny, SamplingParams(temperature=1.0, seed=1, max_tokens=60))[0]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out), SCHEMA)


def test_guided_samples_are_the_same_in_a_batch_as_alone(tiny):
    prompts = ["A person:", "Another one:", "Plain text"]
    params = [
        SamplingParams(temperature=0.9, seed=5, max_tokens=60, n=2,
                       guide=Guide("json_schema", SCHEMA)),
        SamplingParams(temperature=0, max_tokens=40, guide=Guide("regex", r"[a-z ]{5,20}\.")),
        SamplingParams(temperature=0.7, seed=2, max_tokens=20),
    ]  # fmt: skip
    alone = [[o.token_ids for o in tiny.generate(p, q)[0].outputs]
             for p, q in zip(prompts, params, strict=True)]  # fmt: skip
    together = [[o.token_ids for o in r.outputs] for r in tiny.generate(prompts, params)]
    assert together == alone


def test_a_bad_guide_is_refused_before_any_work(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=32))
    bad = SamplingParams(guide=Guide("regex", "(unclosed", "guided_regex"))
    with pytest.raises(InvalidRequestError) as err:
        engine.check_request([1, 2, 3], bad)
    assert err.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError):
        engine.check_request([1, 2, 3], SamplingParams(
            guide=Guide("json_schema", {"type": "no-such-type"})))  # fmt: skip
