"""Reasoning split out of replies (kvlm.server.reasoning): the rule, the streamed split
equal to the whole one at every cut, and a real `kvlm serve` on a tiny random
Qwen3-shaped model whose replies are made to contain `<think>...</think>` by a regex guide
(a random model would never write it), read through the chat route (streamed and not),
and a template that opens `<think>` in its
generation prompt (DeepSeek-R1's way), read off the template with no flag, through the
chat route, the Messages API (a thinking block) and the Responses API (a reasoning item),
streamed and not."""

from __future__ import annotations

import pytest

from helpers import CHATML, save_tiny_model
from kvlm.server.reasoning import ReasoningStream, parser_for, split, starts_thinking
from serving import kvlm_serve, openai_client

REPLIES = [
    ("<think>weigh it</think>\n\nThe answer", False, ("weigh it", "The answer")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("no thinking here", False, (None, "no thinking here")),
    ("text <think>late</think> more", False, (None, "text <think>late</think> more")),
    ("<think>cut off before the end", False, ("cut off before the end", "")),
    ("opened by the prompt</think>\nreply", True, ("opened by the prompt", "reply")),
    ("still thinking", True, ("still thinking", "")),
    ("<thi", False, (None, "<thi")),
]


@pytest.mark.parametrize("text, thinking, expected", REPLIES)
def test_the_split_whole_and_streamed_at_every_cut(text, thinking, expected):
    assert split(text, thinking) == expected
    reasoning, content = expected
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            stream = ReasoningStream(thinking)
            r = c = ""
            for piece in pieces:
                dr, dc = stream.push(piece)
                r, c = r + dr, c + dc
            dr, dc = stream.finish()
            assert (r + dr, c + dc) == ((reasoning or ""), content), (cut, pieces)


def test_which_templates_and_prompts_think():
    assert parser_for(R1_TEMPLATE) == "qwen3" and parser_for(CHATML) is None
    assert starts_thinking("<|im_start|>assistant\n<think>\n")
    assert not starts_thinking("<think>\n\n</think>\n\n")  # Qwen3, enable_thinking false


# DeepSeek-R1's way: earlier turns' thinking dropped, the generation prompt opens <think>
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'].split('</think>')[-1] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
THINKS = r"<think>[a-z]{3,12}</think>\n\n[a-z]{3,12}"  # the reply's shape, by the guide
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("qwen3-think"), "qwen3", seed=3,
                             max_position_embeddings=1024)  # fmt: skip
    with kvlm_serve("--model", str(folder), "--max-context", "1024",
                    "--reasoning-parser", "qwen3") as (port, _):  # fmt: skip
        yield port


def test_served_replies_split_their_thinking(served):
    client = openai_client(served)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, max_tokens=40, temperature=0,
              extra_body={"guided_regex": THINKS})  # fmt: skip
    whole = client.chat.completions.create(**kw)
    message = whole.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert 3 <= len(thought) <= 12 and thought.isalpha() and "think" not in message.content
    assert message.content.isalpha() and whole.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == message.content


def test_a_template_that_opens_think_is_read_with_no_flag(tmp_path):
    folder = save_tiny_model(tmp_path / "r1", "qwen3", seed=4, chat_template=R1_TEMPLATE)
    with kvlm_serve("--model", str(folder), "--max-context", "256") as (port, _):
        client = openai_client(port)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=ASK, max_tokens=8,
                                             temperature=0)  # fmt: skip
        message = out.choices[0].message
        # no </think> in 8 random tokens: all of it is still the reasoning
        assert message.model_extra["reasoning_content"] and not message.content
        anthropic = pytest.importorskip("anthropic")
        messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x",
                                       max_retries=0)  # fmt: skip
        kw = dict(model=model, messages=ASK, max_tokens=8, extra_body={"temperature": 0})
        reply = messages.messages.create(**kw)
        assert [b.type for b in reply.content] == ["thinking"]
        assert reply.content[0].thinking == message.model_extra["reasoning_content"]
        with messages.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert final.content[0].thinking == reply.content[0].thinking
        response = client.responses.create(model=model, input="Weather in Paris?",
                                           temperature=0, max_output_tokens=8)  # fmt: skip
        assert [i.type for i in response.output] == ["reasoning"]
        assert response.output[0].content[0].text == reply.content[0].thinking
        events = list(client.responses.create(model=model, input="Weather in Paris?",
                                              stream=True, temperature=0,
                                              max_output_tokens=8))  # fmt: skip
        said = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert said == reply.content[0].thinking
