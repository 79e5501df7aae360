"""vLLM's and llama.cpp's request extensions, and vLLM's side routes, against a real `kvlm
serve` (the tiny llama: token 0 is <s>, 1 is </s>, its EOS) on 127.0.0.1, with the openai
client's `extra_body` as people send them. Tokens are forced with logit_bias where a check
needs a known token, so no check depends on what a random model says."""

from __future__ import annotations

import json
import urllib.request

import pytest

from serving import kvlm_serve

KEY = "ext-key"
BOS, EOS = 0, 1


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with kvlm_serve("--model", str(tiny_model_dir("llama")), "--max-context", "128",
                    "--api-key", KEY) as (port, _):  # fmt: skip
        yield port


def complete(client, model, **extra):
    kw = {k: extra.pop(k) for k in ("max_tokens", "temperature", "seed", "stop") if k in extra}
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt="Once upon a time", extra_body=extra,
                                     **kw)  # fmt: skip


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_min_tokens_holds_back_every_end(client, model):
    eos_first = {str(EOS): 100}
    ended = complete(client, model, max_tokens=8, logit_bias=eos_first)
    assert ended.usage.completion_tokens == 1 and ended.choices[0].finish_reason == "stop"
    held = complete(client, model, max_tokens=8, logit_bias=eos_first, min_tokens=5)
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    text = complete(client, model, max_tokens=12).choices[0].text
    stop = text[:1]
    assert complete(client, model, max_tokens=12, stop=[stop]).usage.completion_tokens <= 1
    late = complete(client, model, max_tokens=12, stop=[stop], min_tokens=4)
    assert late.usage.completion_tokens >= 4
    with pytest.raises(Exception, match="min_tokens"):
        complete(client, model, max_tokens=4, min_tokens=5)


def test_stop_token_ids_and_what_the_text_keeps(client, model, server):
    forced = {"7": 100}  # token 7 first, whatever the model says
    plain = complete(client, model, max_tokens=4, logit_bias=forced)
    piece = plain.choices[0].text[: len(plain.choices[0].text) // 4 or 1]
    stopped = complete(client, model, max_tokens=4, logit_bias=forced, stop_token_ids=[7])
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == ""
    kept = complete(client, model, max_tokens=4, logit_bias=forced, stop_token_ids=[7],
                    include_stop_str_in_output=True)  # fmt: skip
    assert kept.choices[0].text and plain.choices[0].text.startswith(kept.choices[0].text)
    assert piece
    status, body = post(server, "/v1/completions", {"model": model, "prompt": "a",
                                                    "stop_token_ids": [10**6]})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "stop_token_ids"


def test_stop_strings_kept_and_special_tokens_shown(client, model):
    text = complete(client, model, max_tokens=12).choices[0].text
    stop = text[len(text) // 2 :][:2]
    cut = complete(client, model, max_tokens=12, stop=[stop]).choices[0].text
    with_stop = complete(client, model, max_tokens=12, stop=[stop],
                         include_stop_str_in_output=True).choices[0].text  # fmt: skip
    assert with_stop == cut + stop and text.startswith(with_stop)
    bos_first = {str(BOS): 100}
    hidden = complete(client, model, max_tokens=2, logit_bias=bos_first).choices[0].text
    shown = complete(client, model, max_tokens=2, logit_bias=bos_first,
                     skip_special_tokens=False).choices[0].text  # fmt: skip
    assert hidden == "" and shown == "<s><s>"


def test_typical_p_n_predict_request_id_and_accepted_fields(client, model):
    narrow = [complete(client, model, max_tokens=8, temperature=1.0, seed=seed, typical_p=1e-6)
              for seed in (1, 2)]  # fmt: skip
    assert narrow[0].choices[0].text == narrow[1].choices[0].text  # one candidate a step
    wide = [complete(client, model, max_tokens=8, temperature=1.0, seed=seed) for seed in (1, 2)]
    assert wide[0].choices[0].text != wide[1].choices[0].text
    three = client.completions.create(model=model, prompt="Hi", extra_body={
        "n_predict": 3, "ignore_eos": True})  # fmt: skip
    assert three.usage.completion_tokens == 3
    named = complete(client, model, max_tokens=2, request_id="my-request.1", priority=5,
                     cache_prompt=False)  # fmt: skip
    assert named.id == "cmpl-my-request.1"


def test_chat_template_options(client, model, server):
    messages = [{"role": "user", "content": "Say it"},
                {"role": "assistant", "content": "The answer is"}]  # fmt: skip
    status, body = post(server, "/tokenize", {"messages": messages, "add_generation_prompt":
                                              False, "continue_final_message": True})  # fmt: skip
    assert status == 200 and body["count"] == len(body["tokens"])
    status, text = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and text["prompt"].endswith("The answer is")
    status, whole = post(server, "/tokenize", {"messages": messages})
    assert whole["count"] > body["count"]  # the closed turn and the generation prompt
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"x": 1}}  # fmt: skip
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                          extra_body=options)  # fmt: skip
    assert chat.usage.prompt_tokens == body["count"]
    status, refused = post(
        server,
        "/v1/chat/completions",
        {"model": model, "messages": messages, "chat_template_kwargs": {"messages": []}},
    )
    assert status == 400 and "set by the server" in refused["error"]["message"]
    status, both = post(
        server,
        "/v1/chat/completions",
        {"model": model, "messages": messages, "continue_final_message": True},
    )
    assert status == 400 and "add_generation_prompt" in both["error"]["message"]


def test_side_routes(client, model, server):
    assert client.models.retrieve(model).id == model
    with pytest.raises(Exception, match="does not exist"):
        client.models.retrieve("no-such-model")
    status, body = post(server, "/tokenize", {"prompt": "Once upon", "return_token_strs": True})
    assert status == 200 and len(body["token_strs"]) == body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128
    assert post(server, "/detokenize", {"tokens": body["tokens"]})[1]["prompt"] == "Once upon"
    assert post(server, "/detokenize", {"tokens": [10**6]})[0] == 400
    assert post(server, "/tokenize", {"prompt": "a", "messages": [
        {"role": "user", "content": "a"}]})[0] == 400  # fmt: skip
    status, body = post(server, "/v1/embeddings", {"model": model, "input": "hi"})
    assert status == 400 and "does not serve embeddings" in body["error"]["message"]
