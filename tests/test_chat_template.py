"""Chat templates as an attacker writes them: the sandbox bounds a render's steps, time and
size (kvlm.loading.chat_template), so each hostile template ends in one clear error, on the
library road and from `kvlm generate` (the server's road: tests/test_server_abuse.py)."""

from __future__ import annotations

import time

import pytest

from helpers import CHATML, CHATML_TOOLS, HOSTILE_TEMPLATE_CASES, train_tiny_tokenizer
from kvlm.cli import main
from kvlm.errors import InvalidRequestError
from kvlm.loading.chat_template import TemplateLimits
from kvlm.loading.tokenizer import Tokenizer

# hostile beyond the five: each bound's other roads
MORE_CASES = {
    "a string doubled in a loop": "{% set ns = namespace(s='a') %}{% for i in range(60) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "a list grown by copies": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + [i] %}{% endfor %}",
    "a filter's width": "{{ 'a' | center(10**10) }}",
    "a method's width": "{{ 'a'.center(10**10) }}",
    "a separator times a list": "{{ range(100000) | map('string') | join('a' * 1000000) }}",
    "a power": "{{ 10 ** (10 ** 10) }}",
    "a format's width": "{{ '%999999999d' % 1 }}",
    "a block's buffer": "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "0123456789abcdef{% endfor %}{% endfor %}{% endset %}",
    "a recursive loop": "{% for x in [[1], [2]] recursive %}{{ loop([[1], [2]]) }}{% endfor %}",
}
LIMITS = TemplateLimits(steps=100_000, seconds=2.0, chars=1 << 20)
USER = [{"role": "user", "content": "hi"}]


def tokenizer(template: str, limits: TemplateLimits = LIMITS) -> Tokenizer:
    tok = Tokenizer(train_tiny_tokenizer(), bos_token="<s>", eos_token="</s>",
                    chat_template=template)  # fmt: skip
    tok.template_limits = limits
    return tok


@pytest.mark.parametrize("template", [*HOSTILE_TEMPLATE_CASES.values(), *MORE_CASES.values()],
                         ids=[*HOSTILE_TEMPLATE_CASES, *MORE_CASES])  # fmt: skip
def test_a_runaway_template_is_a_clear_error(template):
    tok = tokenizer(template)
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="chat template ran past its bound"):
        tok.render_chat(USER)
    assert time.monotonic() - start < 30  # bounded (generously: two busy cores)


def test_a_long_conversation_renders_within_the_bounds():
    """The bounds grow with what the template is given: 4,000 messages and the tools'
    system turn render whole under limits a hostile template cannot get past."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(64)]  # fmt: skip
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " * 20}
                for i in range(4000)]  # fmt: skip
    for template in (CHATML, CHATML_TOOLS):
        bounded = tokenizer(template, TemplateLimits(steps=1_000, chars=1_000)).render_chat(
            messages, tools=tools
        )
        assert bounded == tokenizer(template, TemplateLimits()).render_chat(messages, tools=tools)
        assert "turn 3999" in bounded


@pytest.mark.parametrize("word", HOSTILE_TEMPLATE_CASES)
def test_kvlm_generate_ends_a_runaway_template_in_one_line(capsys, hostile_template_dir, word):
    code = main(["generate", word, "--model", str(hostile_template_dir), "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("kvlm: error: the chat template ran past its bound"), err
    # the same model answers an ordinary prompt
    assert main(["generate", "hello", "--model", str(hostile_template_dir),
                 "--max-new-tokens", "2", "--ignore-eos"]) == 0  # fmt: skip
