"""Tokenizers built from GGUF metadata and HF folders, and chat templates, against HF."""

from __future__ import annotations

import json

import pytest

from helpers import CHATML, train_tiny_tokenizer, write_gguf_from_hf, write_spm_gguf
from kvlm.errors import InvalidRequestError, UnsupportedModelError
from kvlm.loading.default import default_model_path
from kvlm.loading.gguf_file import GGUFFile
from kvlm.loading.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_folder

TEXTS = [
    "Hello world! 12345 numbers 3.14159",
    "What's the capital of France?\n\nIt's   Paris.",
    "<|im_start|>user\nhi<|im_end|>\n",
    "émigré naïve 中文 🙂 tabs\tand  spaces  ",
    "I'll we've they'RE DON'T",
    "def f(x):\n\treturn x**2  # comment\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."},
    ],
]


def gguf_meta(path) -> dict:
    return GGUFFile(path).metadata  # what gguf-py's reader gives (tests/test_gguf_file.py)


@pytest.fixture(scope="module")
def default_pair():
    from transformers import AutoTokenizer

    path = default_model_path()
    return tokenizer_from_gguf(gguf_meta(path)), AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name
    )


@pytest.mark.parametrize("text", TEXTS)
def test_default_model_tokenizer_matches_hf(default_pair, text):
    ours, hf = default_pair
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_default_chat_template_matches_hf(default_pair, messages):
    ours, hf = default_pair
    for gen_prompt in (True, False):
        expected = hf.apply_chat_template(
            messages, add_generation_prompt=gen_prompt, tokenize=False
        )
        assert ours.render_chat(messages, gen_prompt) == expected
    expected_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    assert ours.encode_chat(messages) == list(expected_ids)


def test_default_eos_is_the_turn_end(default_pair):
    ours, _ = default_pair
    assert ours.eos_token == "<|im_end|>"
    assert ours.eos_token_ids == (ours.token_to_id("<|im_end|>"),)


def test_gguf_bpe_tokenizer_equals_its_source(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    path = write_gguf_from_hf(folder, tmp_path / "m.gguf")
    ours = tokenizer_from_gguf(gguf_meta(path))
    source = train_tiny_tokenizer()
    for text in TEXTS:
        assert ours.encode(text) == source.encode(text).ids
    assert ours.chat_template == CHATML
    assert ours.eos_token == "</s>"


def test_gguf_sentencepiece_tokenizer_matches_hf(tmp_path):
    from transformers import AutoTokenizer

    path = write_spm_gguf(tmp_path / "spm.gguf")
    ours = tokenizer_from_gguf(gguf_meta(path))
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in [
        "The quick brown fox",
        "What is the capital of France?",
        "café 🙂 12345",  # 🙂 is not in the vocabulary: byte fallback
        "tabs\tand\nnewlines",
    ]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ids[0] == ours.token_to_id("<s>")  # add_bos_token
        assert ours.decode(ids) == text


def test_sentencepiece_always_adds_the_dummy_prefix(tmp_path):
    """SentencePiece and llama.cpp prepend '▁' even when the text starts with spaces
    (transformers' Metaspace skips it there and loses a space on the round trip)."""
    ours = tokenizer_from_gguf(gguf_meta(write_spm_gguf(tmp_path / "spm.gguf")))
    ids = ours.encode("  leading spaces", add_special_tokens=False)
    assert "".join(ours.id_to_token(i) for i in ids).startswith("▁▁▁l")  # prefix + 2 spaces
    assert ours.decode(ids) == "  leading spaces"


def test_hf_folder_chat_template_file_wins(tmp_path):
    tok = train_tiny_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "</s>"},
                "chat_template": [{"name": "default", "template": "{{ 'listed' }}"}],
            }
        )
    )
    assert tokenizer_from_hf_folder(tmp_path).render_chat([]) == "listed"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    ours = tokenizer_from_hf_folder(tmp_path, eos_token_ids=[3])
    assert ours.render_chat([{"role": "user", "content": "hey"}]) == "HEY"
    assert ours.eos_token_ids == (ours.token_to_id("</s>"), 3)


def test_template_errors_are_user_errors(tmp_path):
    tok = train_tiny_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    ours = tokenizer_from_hf_folder(tmp_path)
    with pytest.raises(InvalidRequestError, match="system first"):
        ours.render_chat([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer_from_hf_folder(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_unsupported_tokenizers_are_named():
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        tokenizer_from_gguf(meta)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "klingon",
        "tokenizer.ggml.tokens": ["a"],
    }
    with pytest.raises(UnsupportedModelError, match="'klingon'"):
        tokenizer_from_gguf(meta)


@pytest.mark.parametrize(("pre", "bos"), [("llama-bpe", True), ("lfm2", True), ("smollm", False)])
def test_a_byte_level_vocabulary_without_add_bos_token_reads_as_llama_cpp_does(pre, bos):
    """llama.cpp adds a BOS to a byte-level vocabulary of Llama 3's pre-tokenizer (and of a
    family's name for it, LFM2's "lfm2") where the file does not say; to others not."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": 0}  # fmt: skip
    ids = tokenizer_from_gguf(meta).encode("ab")
    assert ids == ([0, 3] if bos else [3])
    meta["tokenizer.ggml.add_bos_token"] = not bos  # the key, where there is one, decides
    assert tokenizer_from_gguf(meta).encode("ab") == ([3] if bos else [0, 3])


@pytest.mark.parametrize("pre", ["glm4", "glm5", "chatglm-bpe"])
def test_glm_pre_tokenizers_read_as_llama_cpp_reads_them(pre):
    """GLM's pre-tokenizers (GLM-4.7-Flash's GGUF says "glm4"): Llama 3's split, no BOS
    even where the file names one and asks for it, and for glm4/glm5 a whole word of the
    vocabulary taken before any merge (llama.cpp's ignore_merges: "abc" is one token, where
    merging "a b" alone makes "ab" "c")."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab", "c", "abc"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.add_bos_token": True}  # fmt: skip
    ours = tokenizer_from_gguf(meta)
    assert ours.encode("abc") == ([3, 4] if pre == "chatglm-bpe" else [5])
    assert ours.encode("ab") == [3]  # no BOS
    assert ours.bos_token is None
