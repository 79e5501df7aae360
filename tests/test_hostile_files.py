"""Hostile model files: each ends in one clear line (a ModelLoadError), never a signal, a
traceback, a hang or a run on garbage.

Every file is the tiny valid model of tests/gguf_hostile.py with edits: the findings of
issue [18] section 4 by name (`FINDINGS`), a Hugging Face folder's hostile tokenizer files
by name (`TOKENIZER_FINDINGS`, `TOKENIZER_OFF`), then a seeded fuzzer over the metadata,
the tensor table and the header's bytes. Files load in a child process (`Child`), so that a
signal or a hang is a failed test, not a dead test run.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGUFValueType as V

from gguf_hostile import ARCH, Spec, flip_header, mutate, tiny, write, write_hf
from helpers import portable_build_params, portable_kernels
from kvlm import kernels
from kvlm.model import quant
from kvlm.model.attention import _attend_kernel
from numerics import assert_as_exact_as
from serving import free_port

Edit = Callable[[Spec], None]


def key(name: str, value, vtype: V = V.UINT32, sub: V | None = None) -> Edit:
    """Set metadata `name` (an architecture key when it has no dot prefix of its own)."""
    full = name if name.startswith(("tokenizer.", "general.")) else f"{ARCH}.{name}"
    return lambda s: s.set(full, value, vtype, sub)


def dims(name: str, *shape: int) -> Edit:
    """Give tensor `name` this shape (numpy order: rows first), random values."""

    def edit(s: Spec) -> None:
        values = np.random.default_rng(0).normal(0, 0.2, shape).astype(np.float32)
        s.tensors[name] = (values, s.tensors[name][1])

    return edit


def long_token(n: int) -> Edit:
    def edit(s: Spec) -> None:
        tokens = list(s.meta["tokenizer.ggml.tokens"][0])
        tokens[-1] = "ab" * (n // 2)
        s.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)

    return edit


def pieces(more: Iterable[str]) -> Edit:
    """Append SentencePiece pieces (normal tokens, score 0) to the vocabulary, and rows to
    the embedding and the output for them."""
    more = list(more)

    def edit(s: Spec) -> None:
        for k, extra in (("tokens", more), ("token_type", [1] * len(more)),
                         ("scores", [0.0] * len(more))):  # fmt: skip
            values, vtype, sub = s.meta[f"tokenizer.ggml.{k}"]
            s.set(f"tokenizer.ggml.{k}", [*values, *extra], vtype, sub)
        for name in ("token_embd.weight", "output.weight"):
            rows = len(s.meta["tokenizer.ggml.tokens"][0])
            dims(name, rows, s.tensors[name][0].shape[1])(s)

    return edit


def edits(*each: Edit) -> Edit:
    def edit(s: Spec) -> None:
        for e in each:
            e(s)

    return edit


N_TOKENS = len(tiny().meta["tokenizer.ggml.tokens"][0])
FFN_4096 = edits(
    *(dims(f"blk.{i}.ffn_{p}.weight", 4096, 64) for i in range(2) for p in ("gate", "up")),
    *(dims(f"blk.{i}.ffn_down.weight", 64, 4096) for i in range(2)),
)

# name -> (tokenizer, edit, what the one line must say)
# fmt: off
FINDINGS: dict[str, tuple[str, Edit, str]] = {
    # memory: sizes from the metadata, shapes trusted by the C kernels
    "norm-dim-0": ("spm", dims("output_norm.weight", 0), r"output_norm\.weight.* \(0,\)"),
    "hidden-65536": ("spm", key("embedding_length", 65536), r"head_dim .*embedding_length"),
    "hidden-65536-key-length-16": ("spm", edits(key("embedding_length", 65536),
                                                key("attention.key_length", 16)),
                                   r"token_embd\.weight has shape \(\d+, 64\), .*65536"),
    "hidden-2^20": ("spm", key("embedding_length", 2**20), r"embedding_length"),
    "hidden-4194304": ("spm", key("embedding_length", 4194304), r"embedding_length"),
    "ffn-32-rows-4096": ("spm", edits(key("feed_forward_length", 32), FFN_4096), r"ffn_"),
    # one clear line, not a traceback
    "heads-0": ("spm", key("attention.head_count", 0), r"head_count is 0"),
    "heads-array": ("spm", key("attention.head_count", [4, 4], V.ARRAY, V.INT32),
                    r"head_count .*an array"),
    "heads-5-hidden-64": ("spm", edits(key("attention.head_count", 5),
                                       key("attention.head_count_kv", 1)), r"attn_q"),
    "block-count-string": ("spm", key("block_count", "2", V.STRING), r"block_count .*a string"),
    "context-string": ("spm", key("context_length", "4k", V.STRING), r"context_length"),
    "bos-string": ("spm", key("tokenizer.ggml.bos_token_id", "one", V.STRING), r"bos_token_id"),
    "block-count-past-blocks": ("spm", key("block_count", 3), r"no tensor blk\.2\."),
    "merge-unknown-token": ("bpe", key("tokenizer.ggml.merges", ["zz qq", "h e"], V.ARRAY,
                                       V.STRING), r"merge 0 .*'zz qq'"),
    "tokens-integers": ("spm", key("tokenizer.ggml.tokens", list(range(N_TOKENS)), V.ARRAY,
                                   V.INT32), r"tokenizer\.ggml\.tokens"),
    "unknown-id-out-of-range": ("spm", key("tokenizer.ggml.unknown_token_id", 100_000),
                                r"unknown_token_id is 100000"),
    "template-integer": ("spm", key("tokenizer.chat_template", 7), r"chat_template"),
    "template-of-2-MiB": ("spm", key("tokenizer.chat_template", "x" * (2 << 20), V.STRING),
                          r"chat_template is 2097152 characters long"),
    # ran and failed, or ran on garbage
    "kv-heads-1-tensors-2": ("spm", key("attention.head_count_kv", 1), r"attn_k"),
    "embedding-200-rows": ("spm", dims("token_embd.weight", 200, 64), r"token_embd"),
    "embedding-400-rows": ("spm", dims("token_embd.weight", 400, 64), r"token_embd"),
    "rope-base-nan": ("spm", key("rope.freq_base", float("nan"), V.FLOAT32), r"freq_base"),
    "rope-base-negative": ("spm", key("rope.freq_base", -1.0, V.FLOAT32), r"freq_base"),
    # a hang: SentencePiece merges built over every split of a 1,000,000-character token
    "token-1e6-chars": ("spm", long_token(1_000_000), r"characters"),
    # pieces of every length up to 1,024: each within bounds, their splits not
    "spm-split-work": ("spm", pieces("ab" * n for n in range(3, 512)), r"splits"),
}
# fmt: on


def written(tmp_path: Path, tokenizer: str, edit: Edit) -> Path:
    spec = tiny(tokenizer)
    edit(spec)
    return write(spec, tmp_path / "m.gguf")


@pytest.mark.parametrize("finding", list(FINDINGS))
def test_finding_is_one_clear_line(finding, child, tmp_path):
    tokenizer, edit, says = FINDINGS[finding]
    got = child.run(written(tmp_path, tokenizer, edit))
    got.refused_in_one_line("m.gguf", says)  # the file is named
    assert got.seconds < 5, got  # no hang: bounded work


# the same faults in a Hugging Face folder (config.json, model.safetensors, tokenizer files)
# fmt: off
HF_FINDINGS: dict[str, tuple[Edit, str]] = {
    "norm-dim-0": (dims("output_norm.weight", 0), r"model\.norm\.weight has shape \(0,\)"),
    "hidden-65536": (edits(key("embedding_length", 65536), key("attention.key_length", 16)),
                     rf"(embed_tokens|lm_head)\.weight has shape \({N_TOKENS}, 64\)"),
    "ffn-32-rows-4096": (edits(key("feed_forward_length", 32), FFN_4096), r"mlp\.\w+_proj"),
    "heads-0": (key("attention.head_count", 0), r"num_attention_heads is 0"),
    "heads-string": (key("attention.head_count", "4", V.STRING), r"num_attention_heads is a str"),
    "layers-past-tensors": (key("block_count", 3), r"no tensor model\.layers\.2\."),
    "kv-heads-1-tensors-2": (key("attention.head_count_kv", 1), r"k_proj"),
    "embedding-200-rows": (dims("token_embd.weight", 200, 64), r"embed_tokens"),
    "rope-theta-nan": (key("rope.freq_base", float("nan"), V.FLOAT32), r"rope_theta is nan"),
    "template-integer": (key("tokenizer.chat_template", 7), r"chat_template is int"),
}
# fmt: on


@pytest.mark.parametrize("finding", list(HF_FINDINGS))
def test_hf_folder_finding_is_one_clear_line(finding, child, tmp_path):
    edit, says = HF_FINDINGS[finding]
    spec = tiny()
    edit(spec)
    got = child.run(write_hf(spec, tmp_path / "hf"))
    got.refused_in_one_line("hf", says)


def test_the_tiny_models_run(child, tmp_path):
    """The base the edits start from loads and generates (else every refusal is vacuous)."""
    for tokenizer in ("spm", "bpe"):
        got = child.run(write(tiny(tokenizer), tmp_path / f"{tokenizer}.gguf"))
        assert got.outcome == "ran", got
        got = child.run(write_hf(tiny(tokenizer), tmp_path / f"{tokenizer}-hf"))
        assert got.outcome == "ran", got


# ------------------------------------------------------- a HF folder's tokenizer files

# A folder edit: the tiny byte-level BPE model written as a Hugging Face folder (write_hf),
# then one of its tokenizer files changed
FolderEdit = Callable[[Path], None]


def json_file(name: str, edit: Callable[[dict], Any]) -> FolderEdit:
    """Edit the folder's JSON file `name` (the edit's return value, if not None, is
    written instead of the object)."""

    def apply(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        out = edit(data)
        (folder / name).write_text(json.dumps(data if out is None else out))

    return apply


def tok(edit: Callable[[dict], Any]) -> FolderEdit:
    return json_file("tokenizer.json", edit)


def tok_config(edit: Callable[[dict], Any]) -> FolderEdit:
    return json_file("tokenizer_config.json", edit)


def raw_file(name: str, data: bytes) -> FolderEdit:
    return lambda folder: (folder / name).write_bytes(data)


def padded(name: str, spaces: int) -> FolderEdit:
    """The JSON file with `spaces` spaces after it: the same JSON, that many bytes more."""

    def apply(folder: Path) -> None:
        with (folder / name).open("ab") as f:
            f.write(b" " * spaces)

    return apply


def many_tokens(n: int) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        vocab = t["model"]["vocab"]
        vocab.update({f"extra{i}": len(vocab) + i for i in range(n)})

    return edit


def renamed(old: str, new: str) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        vocab = t["model"]["vocab"]
        vocab[new] = vocab.pop(old)

    return edit


def added(content, token_id=100) -> Callable[[dict], None]:
    token = {"id": token_id, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}  # fmt: skip
    return lambda t: t["added_tokens"].append(token)


def split_by(regex: str) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        t["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": regex}

    return edit


def setting(key: str, value) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(key, value)


def template_of(pieces: int, ids: list[int]) -> dict:
    """A TemplateProcessing post-processor: `pieces` special tokens before each text."""
    special = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    text = {"Sequence": {"id": "A", "type_id": 0}}
    token = {"id": "<s>", "ids": ids, "tokens": ["<s>"] * len(ids)}
    return {
        "type": "TemplateProcessing",
        "single": [special] * pieces + [text],
        "pair": [text],
        "special_tokens": {"<s>": token},
    }


def charsmap(blob: bytes) -> dict:
    """A Precompiled normalizer (a Unigram model's character map) of these bytes."""
    return {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(blob).decode()}


def replace(pattern: str, content: str) -> dict:
    return {"type": "Replace", "pattern": {"String": pattern}, "content": content}


N_BPE = len(tiny("bpe").meta["tokenizer.ggml.tokens"][0])
MiB = 1 << 20

# name -> (edit, what the one line must say); every one loaded, ran, or failed otherwise
# before tokenizer.json and tokenizer_config.json were checked
# fmt: off
TOKENIZER_FINDINGS: dict[str, tuple[FolderEdit, str]] = {
    "file-over-64-MiB": (padded("tokenizer.json", 64 * MiB), r"over 67108864 bytes"),
    "a-million-tokens": (tok(many_tokens(1_000_000)),
                         rf"model\.vocab has {N_BPE + 1_000_000} tokens; at most the model's "
                         rf"{N_BPE} \(config\.json vocab_size\)"),
    "token-id-past-the-model": (tok(lambda t: t["model"]["vocab"].__setitem__("~", 10**9)),
                                r"'~' id 1000000000; ids are below the model's"),
    "token-of-1e6-chars": (tok(renamed("~", "ab" * 500_000)),
                           r"model\.vocab has a token of 1000000 characters"),
    "a-million-merges": (tok(lambda t: t["model"]["merges"].extend([["Ġ", "t"]] * 1_000_000)),
                         rf"model\.merges has 1000005 merges for {N_BPE} tokens"),
    "added-token-of-1e6-chars": (tok(added("x" * 1_000_000)),
                                 r"added_tokens\[2\]\.content is 1000000 characters"),
    "added-token-past-the-model": (tok(added("<big>", 10**6)),
                                   r"added_tokens\[2\]\.id is 1000000; ids are below"),
    # backtracking: on a crafted text, minutes (polynomial) or a Rust panic (exponential)
    "regex-polynomial": (tok(split_by("a*a*a*a*c")), r"'a\*a\*a\*a\*c' is not a regex kvlm knows"),
    "regex-exponential": (tok(split_by("(a+)+$")), r"is not a regex kvlm knows"),
    # a Replace of an empty pattern panics in `tokenizers` on every text
    "replace-empty-pattern": (tok(setting("normalizer", replace("", "x"))),
                              r"normalizer\.pattern\.String is an empty pattern"),
    "replacement-of-1e6-chars": (tok(setting("normalizer", replace(" ", "y" * 1_000_000))),
                                 r"normalizer\.content is 1000000 characters long"),
    "normalizer-of-1e5-steps": (tok(setting("normalizer", {
        "type": "Sequence", "normalizers": [{"type": "Lowercase"}] * 100_000})),
        r"normalizer has more than 4096 values"),
    "template-of-1e5-tokens": (tok(setting("post_processor", template_of(100_000, [0]))),
                               r"post_processor has more than 4096 values"),
    # a Unigram model's character map that `tokenizers` cannot parse: a Rust panic (a
    # BaseException) at load, or on every text
    "charsmap-unparsable": (tok(setting("normalizer", charsmap(b""))),
                            r"cannot read .*Cannot parse precompiled_charsmap"),
    "charsmap-panics-on-text": (tok(setting("normalizer", charsmap(b"\x01\0\0\0"))),
                                r"tokenizer\.json: the tokenizer fails on a plain text: index out"),
    "suffix-of-1e6-chars": (tok(lambda t: t["model"].__setitem__("end_of_word_suffix",
                                                                  "s" * 10**6)),
                            r"model\.end_of_word_suffix is 1000000 characters long"),
    "template-id-past-the-model": (tok(setting("post_processor", template_of(1, [10**6]))),
                                   r"post_processor\.special_tokens\.<s>\.ids\[0\] is 1000000"),
    "tokenizer-config-a-list": (tok_config(lambda c: [c]),
                                r"tokenizer_config\.json: it holds a list"),
    "bos-token-a-number": (tok_config(lambda c: c.__setitem__("bos_token", 7)),
                           r"bos_token is an integer"),
    "eos-token-of-1e6-chars": (tok_config(lambda c: c.__setitem__("eos_token", "e" * 1_000_000)),
                               r"eos_token is 1000000 characters long"),
    "chat-template-of-2-MiB": (tok_config(lambda c: c.__setitem__("chat_template", "x" * 2 * MiB)),
                               r"the chat template is 2097152 characters long"),
    "chat-template-file-not-utf8": (raw_file("chat_template.jinja", b"{{ x }}\xff\xfe"),
                                    r"chat_template\.jinja: 'utf-8' codec"),
    "config-json-a-list": (raw_file("config.json", b"[1]"), r"config\.json: it holds a list"),
    "generation-config-a-list": (raw_file("generation_config.json", b"[]"),
                                 r"generation_config\.json: it holds a list"),
}
# what kvlm never wants of a tokenizer.json, switched off: the model runs as without it
# (before: every prompt padded to 10^8 tokens, a hang; cut to 2 tokens; split at random)
TOKENIZER_OFF: dict[str, FolderEdit] = {
    "padding-to-1e8": tok(setting("padding", {
        "strategy": {"Fixed": 100_000_000}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "<s>"})),
    "truncation-to-2": tok(setting("truncation", {
        "direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0})),
    "bpe-dropout": tok(lambda t: t["model"].__setitem__("dropout", 1.0)),
}
# fmt: on


@pytest.fixture(scope="module")
def hf_bpe(tmp_path_factory) -> Path:
    return write_hf(tiny("bpe"), tmp_path_factory.mktemp("base") / "hf")


def hf_edited(base: Path, tmp_path: Path, edit: FolderEdit) -> Path:
    folder = shutil.copytree(base, tmp_path / "hf")
    edit(folder)
    return folder


@pytest.mark.parametrize("finding", list(TOKENIZER_FINDINGS))
def test_hf_tokenizer_finding_is_one_clear_line(finding, child, hf_bpe, tmp_path):
    edit, says = TOKENIZER_FINDINGS[finding]
    got = child.run(hf_edited(hf_bpe, tmp_path, edit))
    assert got.outcome == "refused", f"{got.outcome}: {got.detail[-600:]}"
    assert got.detail.startswith(("ModelLoadError", "UnsupportedModelError")), got.detail
    assert "\n" not in got.detail and "/hf" in got.detail  # the folder's file is named
    assert got.seconds < 5, got  # bounded work before the refusal
    assert re.search(says, got.detail), got.detail


@pytest.mark.parametrize("setting", list(TOKENIZER_OFF))
def test_hf_tokenizer_settings_kvlm_never_wants_are_off(setting, child, hf_bpe, tmp_path):
    base = child.run(hf_bpe)
    got = child.run(hf_edited(hf_bpe, tmp_path, TOKENIZER_OFF[setting]))
    assert base.outcome == "ran" and got.outcome == "ran", got
    assert got.detail == base.detail and got.seconds < 5, (got, base)


def test_a_panic_in_tokenizers_is_one_line():
    """A Rust panic in `tokenizers` while encoding (pyo3's PanicException, a BaseException
    that no `except Exception` catches) is an InvalidRequestError: a Replace of an empty
    pattern before a byte-level split, built in code past the loader's checks."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers

    from kvlm.errors import InvalidRequestError
    from kvlm.loading.tokenizer import Tokenizer

    backend = Backend(models.BPE({"a": 0, "x": 1}, []))
    backend.normalizer = normalizers.Replace("", "x")
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    ours = Tokenizer(backend, bos_token=None, eos_token=None, chat_template=None)
    with pytest.raises(InvalidRequestError, match="the tokenizer failed on this text"):
        ours.encode("a a")


@pytest.mark.parametrize(("command", "finding"), [("generate", "tokenizer-config-a-list"),
                                                   ("serve", "regex-polynomial")])  # fmt: skip
def test_the_command_says_one_line_of_a_tokenizer(command, finding, hf_bpe, tmp_path):
    """`kvlm generate` and `kvlm serve` on a folder with a hostile tokenizer file: exit
    status 2 and one line naming the file, no traceback (the server never starts)."""
    edit, says = TOKENIZER_FINDINGS[finding]
    folder = hf_edited(hf_bpe, tmp_path, edit)
    args = ["generate", "hello", "--max-new-tokens", "3"] if command == "generate" else ["serve"]
    if command == "serve":
        args += ["--port", "PORT"]
    line = cli_error_line(args, folder)
    assert f"{folder}/" in line  # the file is named
    assert re.search(says, line)


# The fuzzer: seeded, and bounded in cases and seconds (KVLM_FUZZ_SEED, KVLM_FUZZ_CASES and
# KVLM_FUZZ_SECONDS run it longer or elsewhere by hand)
FUZZ_SEED = int(os.environ.get("KVLM_FUZZ_SEED", "18"))
FUZZ_CASES = int(os.environ.get("KVLM_FUZZ_CASES", "2000"))
# the suite's share (KVLM_FUZZ_SECONDS=600: a longer search; the seed moves it elsewhere)
FUZZ_SECONDS = float(os.environ.get("KVLM_FUZZ_SECONDS", "12"))


def fuzzed_file(rng: random.Random, bases: dict[str, Spec], folder: Path) -> tuple[Path, str]:
    """One hostile file from `rng`: the tiny model mutated (as a GGUF file, or a Hugging
    Face folder), or a GGUF file with bytes of its header set at random."""
    tokenizer = rng.choice(list(bases))
    spec, done = mutate(rng, bases[tokenizer])
    what = f"{tokenizer}: " + "; ".join(done)
    form = rng.random()
    if form < 0.15:
        try:  # the vocabulary's tokenizer.json is written by kvlm: a bad one is GGUF only
            return write_hf(spec, folder / "hf"), "hf " + what
        except Exception:
            pass
    path = write(spec, folder / "m.gguf")
    if form > 0.7:
        what += "; " + flip_header(path, rng)
    return path, what


def test_fuzzed_files_end_in_one_line(child, tmp_path):
    """Hostile files drawn at random load and generate, or end in one KvlmError line (a
    ModelLoadError at load; a prompt longer than a 1-token context at generate):
    never a signal, a traceback, a hang or a failed generation. A signal is reported with
    the cases the same process ran before it (a write past a buffer may kill it later)."""
    rng = random.Random(FUZZ_SEED)
    bases = {"spm": tiny("spm"), "bpe": tiny("bpe")}
    failures, outcomes, since_start = [], {}, []
    start = time.monotonic()
    for i in range(FUZZ_CASES):
        if time.monotonic() - start > FUZZ_SECONDS or len(failures) >= 5:
            break
        folder = tmp_path / str(i)
        folder.mkdir()
        path, what = fuzzed_file(rng, bases, folder)
        got = child.run(path)
        outcomes[got.outcome] = outcomes.get(got.outcome, 0) + 1
        since_start.append(f"{i} ({what})")
        one_line = got.outcome == "refused" and "\n" not in got.detail  # any KvlmError
        if got.outcome != "ran" and not one_line:
            before = "; after " + ", ".join(since_start[-4:-1]) if got.outcome == "signal" else ""
            failures.append(f"case {i} ({what}): {got.outcome}: {got.detail[-600:]}{before}")
        if got.outcome in ("signal", "hang", "exit"):
            since_start = []  # a fresh process from here
    print(f"fuzzed {sum(outcomes.values())} files in {time.monotonic() - start:.1f} s: {outcomes}")
    assert not failures, "\n".join(failures)
    assert outcomes.get("refused", 0) > 10 and outcomes.get("ran", 0) > 0  # both roads taken


# fmt: off
CLI_CASES = {  # the command, and the finding whose file it is given
    "generate": (["generate", "hello", "--max-new-tokens", "3"], "norm-dim-0"),
    "serve": (["serve", "--port", "PORT"], "template-integer"),
}
# fmt: on


@pytest.mark.parametrize("command", list(CLI_CASES))
def test_the_command_says_one_line(command, tmp_path):
    """`kvlm generate` and `kvlm serve` on a hostile file: exit status 2 and one line on
    stderr, no traceback (the server never starts)."""
    args, finding = CLI_CASES[command]
    tokenizer, edit, says = FINDINGS[finding]
    line = cli_error_line(args, written(tmp_path, tokenizer, edit))
    assert line.startswith("kvlm: error: m.gguf: "), line
    assert re.search(says, line)


def cli_error_line(args: list[str], model: Path) -> str:
    """`kvlm ARGS --model MODEL` ("PORT" in ARGS: a free one, were a server to start) must
    exit 2 with nothing on stdout and one line on stderr, no traceback: that line."""
    args = [str(free_port()) if a == "PORT" else a for a in args]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvlm.cli", *args, "--model", str(model)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("kvlm: error: "), proc.stderr
    return lines[0]


def test_native_code_checks_the_sizes_it_is_given(tmp_path):
    """The C entry points refuse sizes that disagree (-2, nothing read or written): a norm
    weight of another length than the rows, and a decode step whose products are not of
    the shape the model's sizes give (rows, columns or bytes)."""
    import ctypes

    import torch

    from kvlm import LLM, kernels
    from kvlm.model.fused import FusedDecoder

    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.status())
    x, y, w = torch.randn(2, 64), torch.empty(2, 64), torch.ones(64)
    xp, yp = x.data_ptr(), y.data_ptr()
    assert lib.kvlm_rms_norm(xp, 128, 2, 64, 64, w.data_ptr(), 64, 1e-6, yp, 128, 64) == 0
    assert lib.kvlm_rms_norm(xp, 128, 2, 64, 64, w.data_ptr(), 0, 1e-6, yp, 128, 64) == -2
    qkv, cs = torch.randn(1, 8 * 16), torch.ones(1, 16)
    args = (qkv.data_ptr(), 8 * 16, 1, 8 * 16, 4, 2, 16, w.data_ptr(), w.data_ptr())
    tail = (1e-6, cs.data_ptr(), 16, cs.data_ptr(), 16, 16, 16)
    assert lib.kvlm_qk_norm_rope(*args, 16, *tail) == 0
    assert lib.kvlm_qk_norm_rope(*args, 64, *tail) == -2

    llm = LLM(model=write(tiny(), tmp_path / "m.gguf"), weights="native", progress=False)
    step = FusedDecoder(llm.model, 64)
    spec = ctypes.byref(step.spec)
    assert lib.kvlm_decode_scratch(spec, 1) > 0
    qkv_mat, head = step.spec.layers[1].qkv, step.spec.lm_head
    for field, owner in (("n", qkv_mat), ("k", qkv_mat), ("n", qkv_mat.part[0]),
                         ("bytes", head.part[0])):  # fmt: skip
        setattr(owner, field, getattr(owner, field) + 32)
        assert lib.kvlm_decode_scratch(spec, 1) == -2, field
        # refused before anything is read: no views, no buffers given
        none = (None, 0) * 4  # x, pos, cos, sin and their lengths
        views = (None, 1, None, 0, None, 0)  # K/V views, conv views, state views
        assert lib.kvlm_decode_batch(spec, 1, *none, *views, None, 0, None, 0) == -2, field
        setattr(owner, field, getattr(owner, field) - 32)
    assert lib.kvlm_decode_scratch(spec, 1) > 0


# Each C entry point that is handed a buffer is handed its length too, and refuses (-2) a
# call whose buffers are shorter than its shape needs before it reads or writes any of
# them. Called here with each buffer one element or byte short, a negative length, sizes
# whose products overflow an int64, in the native build and the portable ones (the checks
# are code every build shares). Outputs are `_guarded`: a call that wrote anything, or
# past what it was given, changes a sentinel.

BUILDS = [pytest.param("native", id="native"), *portable_build_params()]
GUARD = 64  # elements after an output that no call may write
SENTINEL = 7  # every element of a guarded output before the call
HUGE = 2**62  # a size whose product with another (or twice it) overflows an int64
ANY = 2**63 - 1  # a length that covers anything: the product must be refused itself


def _kernels(build: str):
    if build != "native":
        return portable_kernels(build)
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.status())
    return lib


def _guarded(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output of n elements and GUARD more, each SENTINEL."""
    return torch.full((n + GUARD,), SENTINEL, dtype=dtype)


def _untouched(buf: torch.Tensor) -> bool:
    return bool((buf == SENTINEL).all())


def _q8(n: int = 20, k: int = 64) -> quant.QuantWeight:
    """A q8 weight [n, k]: 20 rows are two blocks of 16, the second partial."""
    return quant.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), "q8")


@pytest.mark.parametrize("build", BUILDS)
def test_the_convolution_checks_its_rows(build):
    """kvlm_depthwise (the prompt's depthwise convolution): x's rows within xn floats,
    every row number of idx [L, N] within x's rows and within its entries, w [L, C], the
    bias [C] and y [N, C] each within its count, L within MAX_CONV_KERNEL; nothing
    written when refused, and the torch ops' sums when taken."""
    lib = _kernels(build)
    R, L, N, C = 7, 4, 5, 24
    x, w, bias = torch.randn(R, C), torch.randn(L, C), torch.randn(C)
    idx = torch.randint(0, R, (L, N), generator=torch.Generator().manual_seed(1))
    good = {"xn": R * C, "xr": R, "in": L * N, "L": L, "N": N, "C": C, "wn": L * C, "bn": C,
            "yn": N * C}  # fmt: skip

    def call(index=idx, **given) -> tuple[int, torch.Tensor]:
        a, y = {**good, **given}, _guarded(N * C)
        rc = lib.kvlm_depthwise(x.data_ptr(), a["xn"], a["xr"], index.data_ptr(), a["in"],
                                a["L"], a["N"], a["C"], w.data_ptr(), a["wn"], bias.data_ptr(),
                                a["bn"], y.data_ptr(), a["yn"])  # fmt: skip
        assert rc != -2 or _untouched(y), given
        return rc, y[: N * C].view(N, C)

    bad = [{"xn": R * C - 1}, {"xr": R + 1}, {"in": L * N - 1}, {"wn": L * C - 1},
           {"bn": C - 1}, {"yn": N * C - 1}, {"L": 0}, {"L": 65}, {"N": 0}, {"C": 0},
           {"xr": HUGE, "xn": ANY}, {"N": HUGE, "in": ANY, "yn": ANY}]  # fmt: skip
    for given in bad:
        assert call(**given)[0] == -2, given
    for row in (-1, R):
        past = idx.clone()
        past[2, 3] = row
        assert call(past)[0] == -2, row
    rc, y = call()
    want = x[idx[0]] * w[0]
    for k in range(1, L):
        want = want + x[idx[k]] * w[k]
    assert rc == 0 and torch.equal(y, want + bias)


@pytest.mark.parametrize("build", BUILDS)
def test_the_products_check_their_buffers(build):
    """kvlm_qgemm and kvlm_qgemm_i8 (int8 and 16-bit x): x [M, K] within xn floats, the
    packed w [N, K] within wn bytes, y's M rows of N at stride ldy >= N within yn floats,
    K whole blocks of the kind."""
    lib = _kernels(build)
    M, K, N = 3, 64, 20
    w, x = _q8(N, K), torch.randn(M, K)
    wn = w.data.numel()
    good = {"xn": M * K, "M": M, "K": K, "wn": wn, "yn": M * N, "ldy": N}
    bad = [{"xn": M * K - 1}, {"wn": wn - 1}, {"yn": M * N - 1}, {"ldy": N - 1},
           {"xn": -1}, {"wn": -1}, {"yn": -1}, {"K": K - 16}, {"K": 0},
           {"M": HUGE, "xn": ANY}, {"ldy": HUGE, "yn": ANY}]  # fmt: skip
    for name, fn, fine in (("fp32", lib.kvlm_qgemm, ()), ("int8", lib.kvlm_qgemm_i8, (0,)),
                           ("int16", lib.kvlm_qgemm_i8, (1,))):  # fmt: skip

        def call(y: torch.Tensor, fn=fn, fine=fine, **given) -> int:
            a = {**good, **given}
            return fn(8, x.data_ptr(), a["xn"], a["M"], a["K"], w.data.data_ptr(), a["wn"], N,
                      y.data_ptr(), a["yn"], a["ldy"], *fine)  # fmt: skip

        for given in bad:
            y = _guarded(M * N)
            assert call(y, **given) == -2 and _untouched(y), (name, given)
        y = _guarded(M * N)
        assert call(y) == 0 and _untouched(y[M * N :]) and not _untouched(y[: M * N]), name


@pytest.mark.parametrize("build", BUILDS)
def test_dequantizing_checks_its_buffers(build):
    """kvlm_qdequant: the packed w [N, K] within wn bytes, out [N, K] of fp32 or bf16
    within its bytes (a bf16 buffer's are too few for fp32); kvlm_qdequant_rows: out [n, K]
    within its floats, and each row in [0, N)."""
    lib = _kernels(build)
    K, N = 64, 20
    w = _q8(N, K)
    wp, wn = w.data.data_ptr(), w.data.numel()
    for bf16, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        on = N * K * (2 if bf16 else 4)
        good = {"bf16": bf16, "K": K, "wn": wn, "N": N, "on": on}

        def call(out: torch.Tensor, good=good, **given) -> int:
            a = {**good, **given}
            return lib.kvlm_qdequant(8, a["bf16"], a["K"], wp, a["wn"], a["N"], out.data_ptr(),
                                     a["on"])  # fmt: skip

        bad = [{"wn": wn - 1}, {"on": on - 1}, {"wn": -1}, {"on": -1}, {"N": N + 16},
               {"K": K - 16}, {"bf16": 2}, {"N": HUGE, "wn": ANY, "on": ANY}]  # fmt: skip
        if bf16:
            bad.append({"bf16": 0})  # fp32 into a bf16 buffer's bytes
        for given in bad:
            out = _guarded(N * K, dtype)
            assert call(out, **given) == -2 and _untouched(out), (dtype, given)
        out = _guarded(N * K, dtype)
        assert call(out) == 0 and _untouched(out[N * K :]), dtype
        assert torch.equal(out[: N * K].view(N, K), w.dense(dtype=dtype))

    ids = torch.tensor([0, N - 1, 5])
    good = {"K": K, "wn": wn, "N": N, "rows": ids, "n": 3, "on": 3 * K}

    def rows(out: torch.Tensor, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_qdequant_rows(8, a["K"], wp, a["wn"], a["N"], a["rows"].data_ptr(),
                                      a["n"], out.data_ptr(), a["on"])  # fmt: skip

    bad = [{"on": 3 * K - 1}, {"wn": wn - 1}, {"on": -1}, {"wn": -1}, {"n": -1},
           {"N": N + 16}, {"K": K - 16}, {"rows": torch.tensor([0, N, 5])},
           {"rows": torch.tensor([0, -1, 5])}, {"n": HUGE, "on": ANY}]  # fmt: skip
    for given in bad:
        out = _guarded(3 * K)
        assert rows(out, **given) == -2 and _untouched(out), given
    out = _guarded(3 * K)
    assert rows(out) == 0 and _untouched(out[3 * K :])
    assert torch.equal(out[: 3 * K].view(3, K), w.dense()[ids])


@pytest.mark.parametrize("build", BUILDS)
def test_packing_checks_its_buffers(build):
    """kvlm_qpack: N stored rows of K within the source's sn bytes, the packed [N, K]
    within dst's dn bytes; K whole blocks; each order entry in [0, N)."""
    lib = _kernels(build)
    K, N = 64, 20
    row = K // 32 * 34  # Q8_0: 34 bytes a block of 32
    src = torch.randint(
        0, 256, (N, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    need, order = quant.packed_bytes("q8", N, K), torch.arange(N).flip(0)
    good = {"sn": N * row, "N": N, "K": K, "order": order, "dn": need}

    def call(dst: torch.Tensor, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_qpack(8, src.data_ptr(), a["sn"], a["N"], a["K"], a["order"].data_ptr(),
                              dst.data_ptr(), a["dn"])  # fmt: skip

    bad = [{"sn": N * row - 1}, {"dn": need - 1}, {"sn": -1}, {"dn": -1},
           {"N": N + 1, "order": torch.arange(N + 1)},  # a row more than the source holds
           {"K": K - 16}, {"order": torch.arange(N).index_fill(0, torch.tensor([3]), N)},
           {"N": HUGE, "sn": ANY, "dn": ANY}]  # fmt: skip
    for given in bad:
        dst = _guarded(need, torch.uint8)
        assert call(dst, **given) == -2 and _untouched(dst), given
    dst = _guarded(need, torch.uint8)
    assert call(dst) == 0 and _untouched(dst[need:])
    ref = quant.QuantWeight.from_blocks("q8", src, order, reference=True)
    assert torch.equal(dst[:need], ref.data.reshape(-1))


@pytest.mark.parametrize("build", BUILDS)
def test_prompt_attention_checks_its_buffers(build):
    """kvlm_attend: q, k, v, the mask and out each within its count at the strides it is
    given ((H - 1) qsh + (T - 1) qst + D elements of q, and so on), no stride negative, H a
    multiple of Hkv. A shape the kernel does not take is -3 (declined: torch's SDPA), not
    the -2 of sizes that disagree. Sinks, where given, are one a query head."""
    lib = _kernels(build)
    H, T, D, Hkv, S = 2, 3, 16, 1, 3
    sinks = torch.zeros(H)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, L, D, generator=g) for n, L in ((H, T), (Hkv, S), (Hkv, S)))
    mask = torch.ones(T, S, dtype=torch.bool).tril()
    on = T * H * D
    good = {"qn": q.numel(), "H": H, "T": T, "qsh": T * D, "qst": D, "kn": k.numel(),
            "vn": v.numel(), "Hkv": Hkv, "S": S, "ksh": S * D, "kst": D, "vsh": S * D, "vst": D,
            "mn": mask.numel(), "mst": S, "on": on, "bf16_from": T, "sinks": None,
            "sn": 0}  # fmt: skip

    def call(out: torch.Tensor, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_attend(
            q.data_ptr(), a["qn"], a["H"], a["T"], D, a["qsh"], a["qst"], k.data_ptr(),
            a["kn"], v.data_ptr(), a["vn"], a["Hkv"], a["S"], a["ksh"], a["kst"], a["vsh"],
            a["vst"], mask.data_ptr(), a["mn"], a["mst"], 0, D**-0.5, out.data_ptr(), a["on"],
            a["bf16_from"], a["sinks"], a["sn"],
        )  # fmt: skip

    bad = [{"qn": q.numel() - 1}, {"kn": k.numel() - 1}, {"vn": v.numel() - 1},
           {"mn": mask.numel() - 1}, {"on": on - 1}, {"qst": D + 1}, {"kst": D + 1},
           {"vst": D + 1}, {"mst": S + 1}, {"qst": -D}, {"qn": -1}, {"on": -1},
           {"H": 3, "Hkv": 2}, {"T": 0}, {"S": 0}, {"kst": HUGE, "kn": ANY},
           {"T": HUGE, "qst": 0, "mst": 0, "on": ANY},
           {"sinks": sinks.data_ptr(), "sn": H - 1}]  # fmt: skip
    for given in bad:
        out = _guarded(on)
        assert call(out, **given) == -2 and _untouched(out), given
    out = _guarded(on)
    assert call(out, bf16_from=0) == -3 and _untouched(out)  # bf16 pairs: D 64 or 128 only
    assert call(out) == 0 and _untouched(out[on:])
    ref = F.scaled_dot_product_attention(q[None], k.expand(H, S, D)[None], v.expand(H, S, D)[None],
                                         attn_mask=mask[None])  # fmt: skip
    torch.testing.assert_close(out[:on].view(T, H, D), ref[0].transpose(0, 1))


@pytest.mark.parametrize("build", BUILDS)
def test_a_decode_rows_attention_checks_its_buffers(build):
    """kvlm_attend_row (one query row per head, a decoded token's): q's H heads at stride qsh,
    k and v's Hkv heads of S keys at their strides, the mask's S and out's H D, each within
    its count; H a multiple of Hkv; sinks, where given, one a query head. The result is
    SDPA's up to summation order."""
    lib = _kernels(build)
    H, D, Hkv, S = 4, 16, 2, 5
    sinks = torch.zeros(H)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(H, D, generator=g), *(torch.randn(Hkv, S, D, generator=g)
                                                 for _ in range(2))  # fmt: skip
    mask = torch.tensor([True, False, True, True, False])
    on = H * D
    good = {"qn": q.numel(), "H": H, "qsh": D, "kn": k.numel(), "vn": v.numel(), "Hkv": Hkv,
            "S": S, "ksh": S * D, "kst": D, "vsh": S * D, "vst": D, "mn": S, "on": on,
            "sinks": None, "sn": 0}  # fmt: skip

    def call(out: torch.Tensor, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_attend_row(
            q.data_ptr(), a["qn"], a["H"], D, a["qsh"], k.data_ptr(), a["kn"], v.data_ptr(),
            a["vn"], a["Hkv"], a["S"], a["ksh"], a["kst"], a["vsh"], a["vst"], mask.data_ptr(),
            a["mn"], D**-0.5, out.data_ptr(), a["on"], a["sinks"], a["sn"],
        )  # fmt: skip

    bad = [{"qn": q.numel() - 1}, {"kn": k.numel() - 1}, {"vn": v.numel() - 1},
           {"mn": S - 1}, {"on": on - 1}, {"qsh": D + 1}, {"kst": D + 1}, {"vst": D + 1},
           {"qsh": -D}, {"on": -1}, {"H": 3}, {"S": 0}, {"H": 0},
           {"kst": HUGE, "kn": ANY}, {"S": HUGE, "mn": ANY},
           {"sinks": sinks.data_ptr(), "sn": H - 1}]  # fmt: skip
    for given in bad:
        out = _guarded(on)
        assert call(out, **given) == -2 and _untouched(out), given
    out = _guarded(on)
    assert call(out) == 0 and _untouched(out[on:])
    group = H // Hkv
    ref = F.scaled_dot_product_attention(
        q[None, :, None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None],
        attn_mask=mask[None])  # fmt: skip
    torch.testing.assert_close(out[:on].view(H, D), ref[0, :, 0])


@pytest.mark.parametrize("build", BUILDS)
def test_the_row_kernels_check_their_buffers(build):
    """kvlm_silu_mul: gu [M, 2I] within gn floats, out [M, I] within on; kvlm_rms_norm: x
    and y's M rows of N at their strides within xn and yn ((M - 1) xs + N, ...; ys >= N);
    kvlm_qk_norm_rope: the q and k heads of M rows at stride rs >= (nq + nk) D within qkvn,
    cos and sin's rows of R (even, 2..D: a partial rotary factor's) at stride cs within cn
    and sn, D even."""
    lib = _kernels(build)
    M, N, inter = 3, 24, 40
    gu = torch.randn(M, 2 * inter)
    good = {"gn": M * 2 * inter, "M": M, "I": inter, "on": M * inter}

    def glu(out: torch.Tensor, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_silu_mul(gu.data_ptr(), a["gn"], a["M"], a["I"], out.data_ptr(), a["on"])

    n = M * inter
    bad = [{"gn": 2 * n - 1}, {"on": n - 1}, {"gn": -1}, {"on": -1}, {"M": 0}, {"I": 0},
           {"M": HUGE, "gn": ANY, "on": ANY}]  # fmt: skip
    for given in bad:
        out = _guarded(n)
        assert glu(out, **given) == -2 and _untouched(out), ("silu_mul", given)
    out = _guarded(n)
    assert glu(out) == 0 and _untouched(out[n:]) and not _untouched(out[:n])

    x, w = torch.randn(M, N), torch.rand(N) + 0.5
    good = {"xn": M * N, "M": M, "xs": N, "wn": N, "yn": M * N, "ys": N}

    def norm(y: torch.Tensor, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_rms_norm(x.data_ptr(), a["xn"], a["M"], N, a["xs"], w.data_ptr(),
                                 a["wn"], 1e-6, y.data_ptr(), a["yn"], a["ys"])  # fmt: skip

    bad = [{"xn": M * N - 1}, {"yn": M * N - 1}, {"xs": N + 1}, {"ys": N + 1}, {"ys": N - 1},
           {"xs": -N}, {"xn": -1}, {"yn": -1}, {"M": -1}, {"wn": N - 1},
           {"xs": HUGE, "xn": ANY}, {"M": HUGE, "xs": 0, "yn": ANY}]  # fmt: skip
    for given in bad:
        y = _guarded(M * N)
        assert norm(y, **given) == -2 and _untouched(y), ("rms_norm", given)
    y = _guarded(M * N)
    assert norm(y) == 0 and _untouched(y[M * N :])
    torch.testing.assert_close(y[: M * N].view(M, N), F.rms_norm(x, (N,), w, 1e-6))

    nq, nk, D = 2, 1, 16  # and a v head after them: a row is 4 heads, 3 of them touched
    rs, cs = (nq + nk + 1) * D, D
    need = (M - 1) * rs + (nq + nk) * D
    cos, sin = torch.randn(M, D), torch.randn(M, D)
    good = {"qkvn": need, "M": M, "rs": rs, "nq": nq, "nk": nk, "D": D, "nn": D,
            "cn": M * D, "sn": M * D, "cs": cs, "R": D}  # fmt: skip

    def rope(qkv: torch.Tensor, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_qk_norm_rope(
            qkv.data_ptr(), a["qkvn"], a["M"], a["rs"], a["nq"], a["nk"], a["D"], w.data_ptr(),
            w.data_ptr(), a["nn"], 1e-6, cos.data_ptr(), a["cn"], sin.data_ptr(), a["sn"],
            a["cs"], a["R"],
        )  # fmt: skip

    bad = [{"qkvn": need - 1}, {"cn": M * D - 1}, {"sn": M * D - 1}, {"rs": (nq + nk) * D - 1},
           {"R": D + 2}, {"R": 3}, {"R": 0}, {"R": 8, "cs": 8, "cn": 2 * 8 + 7},
           {"cs": D + 1}, {"cs": -D}, {"qkvn": -1}, {"cn": -1}, {"nq": -1}, {"D": 15},
           {"nn": D + 2}, {"nq": 0, "nk": 0}, {"nq": HUGE, "nk": HUGE, "qkvn": ANY},
           {"M": HUGE, "rs": HUGE, "qkvn": ANY}]  # fmt: skip
    for given in bad:  # in place: a guarded q|k|v (each value the sentinel) stays so
        qkv = _guarded(need)
        assert rope(qkv, **given) == -2 and _untouched(qkv), ("qk_norm_rope", given)
    qkv = _guarded(need)
    assert rope(qkv) == 0 and _untouched(qkv[need:]) and not _untouched(qkv[:D])
    assert _untouched(qkv[(nq + nk) * D : rs])  # the v head


def _delta_torch(conv, z, b, a, a_log, dt_bias, w, eps, state, nk, dk):
    """The torch road of kvlm.model.deltanet (GatedDeltaNet.forward after its conv), in
    the inputs' dtype: (out (B, T, nv dv), the state after)."""
    from kvlm.model.deltanet import gated_rms_norm, l2norm, recurrent_gated_delta_rule

    B, T, nv = b.shape
    dv = z.shape[-1] // nv
    q, k, v = F.silu(conv).split([nk * dk, nk * dk, nv * dv], dim=-1)
    beta, g = b.sigmoid(), -a_log.exp() * F.softplus(a + dt_bias)
    q, k = (t.view(B, T, nk, dk).repeat_interleave(nv // nk, dim=2) for t in (q, k))
    q, k = l2norm(q), l2norm(k)
    out, after = recurrent_gated_delta_rule(q / dk**0.5, k, v.view(B, T, nv, dv), g, beta, state)
    return gated_rms_norm(out, z.view(B, T, nv, dv), w, eps, z.dtype).reshape(B, T, -1), after


def _replayed(state: torch.Tensor, win: torch.Tensor, m: int) -> torch.Tensor:
    """The state a DeltaNet's cache format means (kernels/deltanet.c: the state at the
    chunk start, `win` the chunk's m rows since, each k, u, g, gc) in fp64: the rows' rule
    applied to it, (S, nv, dk, dv) from (S, nv, dk, dv) and (S, nv, DELTA_CHUNK - 1, row)."""
    dk = state.shape[-2]
    out = state.double()
    for r in range(m):
        row = win[:, :, r].double()
        k, u, g = row[..., :dk], row[..., dk:-2], row[..., -2]
        out = out * g.exp()[..., None, None] + k[..., :, None] * u[..., None, :]
    return out


@pytest.mark.parametrize("build", BUILDS)
def test_the_gated_delta_checks_its_buffers_and_is_the_torch_road(build):
    """kvlm_gated_delta (kernels/deltanet.c): S sequences at the row offsets cu (S + 1 of
    them, from 0, never decreasing) from positions starts (S, each >= 0), conv [rows, 2 nk
    dk + nv dv], z [rows, nv dv], b and a [rows, nv], a_log and dt_bias [nv] (hn), w [dv]
    (wn), state [S, nv, dk, dv] and its carried rows win [S, nv, DELTA_CHUNK - 1, dk + dv +
    2], out [rows, nv dv], each within its length; nv a multiple of nk; dk, dv in 1..512.
    Refused calls write nothing (out, the state and its rows stay); a good one is the
    torch road's arithmetic as exactly as torch's own fp32 (against fp64), its state too
    (the carried rows applied to the chunk's state), on every build, with dims off the 16
    lanes (dk 20, dv 24), two q/k heads serving four, and sequences of 5, 0 and 20 rows (a
    pool step's ragged rows; the third past a chunk's end); the states asked for (`at`:
    rows of the step, ascending, at most 64 of a sequence's) are those the rows alone
    leave, bit for bit, and a sequence's rows cut in two calls (the rows carried) are its
    one call's, bit for bit."""
    from kvlm.cache.kinds import DELTA_CHUNK

    lib = _kernels(build)
    g = torch.Generator().manual_seed(5)
    lengths, nk, nv, dk, dv = [5, 0, 20], 2, 4, 20, 24
    S, N, C = len(lengths), sum(lengths), 2 * nk * dk + nv * dv
    cu = torch.tensor([0, 5, 5, 25], dtype=torch.int64)
    starts = torch.zeros(S, dtype=torch.int64)
    carried = nv * (DELTA_CHUNK - 1) * (dk + dv + 2)  # a sequence's rows, one layer

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    ins = dict(conv=r(N, C), z=r(N, nv * dv), b=r(N, nv), a=r(N, nv), a_log=r(nv, scale=0.5),
               dt_bias=r(nv, scale=0.5), w=r(dv).abs() + 0.5)  # fmt: skip
    state0 = r(S, nv, dk, dv, scale=0.1)
    f32 = {k: v.float().contiguous() for k, v in ins.items()}
    size = {"cn": N * C, "zn": N * nv * dv, "bn": N * nv, "an": N * nv, "hn": nv, "wn": dv,
            "sn": S * nv * dk * dv, "wn2": S * carried, "on": N * nv * dv}  # fmt: skip
    dims = {"cun": S + 1, "stn": S, "S": S, "nk": nk, "nv": nv, "dk": dk, "dv": dv}

    points = torch.tensor([0, 1, 3, 7, 20], dtype=torch.int64)  # rows of the step
    A, one = len(points), nv * dk * dv
    snaps, wsnaps = _guarded(A * one), _guarded(A * carried)

    def call(state, win, out, offsets=cu, at=points, before=None, win_before=None,
             first=starts, **given) -> int:  # fmt: skip
        n = {**size, "atn": A, "pn": A * one, "pwn": A * carried, **given}
        d = {**dims, **{k: v for k, v in given.items() if k in dims}}
        return lib.kvlm_gated_delta(
            f32["conv"].data_ptr(), n["cn"], f32["z"].data_ptr(), n["zn"], f32["b"].data_ptr(),
            n["bn"], f32["a"].data_ptr(), n["an"], f32["a_log"].data_ptr(),
            f32["dt_bias"].data_ptr(), n["hn"], f32["w"].data_ptr(), n["wn"], 1e-6,
            None if before is None else before.data_ptr(), state.data_ptr(), n["sn"],
            None if win_before is None else win_before.data_ptr(), win.data_ptr(), n["wn2"],
            out.data_ptr(), n["on"], offsets.data_ptr(), d["cun"], first.data_ptr(), d["stn"],
            None if at is None else at.data_ptr(), n["atn"], snaps.data_ptr(), n["pn"],
            wsnaps.data_ptr(), n["pwn"], d["S"], d["nk"], d["nv"], d["dk"], d["dv"],
        )  # fmt: skip

    big = {k: ANY for k in size if k not in ("hn", "wn")}
    bad = [{k: v - 1} for k, v in size.items()] + [
        {"cn": -1}, {"S": 0, "cun": 1, "stn": 0}, {"cun": S}, {"stn": S - 1}, {"nk": 0},
        {"nv": 3}, {"nk": 3}, {"dk": 0}, {"dk": 513}, {"dv": 513}, {"hn": nv + 1},
        {"wn": dv + 1}, {"first": torch.tensor([0, -1, 0])},
        {"offsets": torch.tensor([1, 5, 5, 25])}, {"offsets": torch.tensor([0, 5, 4, 25])},
        {"offsets": torch.tensor([0, 5, 5, 26])},
        {"offsets": torch.tensor([0, 5, 5, HUGE]), **big},
        {"nv": HUGE, "hn": HUGE, "nk": 1, **big}, {"atn": 0}, {"pn": A * one - 1},
        {"pwn": A * carried - 1}, {"at": torch.tensor([1, 0, 3, 7, 20])},
        {"at": torch.tensor([0, 1, 1, 7, 20])}, {"at": torch.tensor([0, 1, 3, 8, 25])},
        {"at": torch.tensor([-1, 1, 3, 7, 20])}]  # fmt: skip
    n_state, n_out, n_win = size["sn"], size["on"], size["wn2"]
    for given in bad:
        state, win, out = _guarded(n_state), _guarded(n_win), _guarded(n_out)
        assert call(state, win, out, **given) == -2, given
        assert _untouched(state) and _untouched(out) and _untouched(win), given
        assert _untouched(snaps) and _untouched(wsnaps), given
    state, win, out = _guarded(n_state), _guarded(n_win), _guarded(n_out)
    state[:n_state] = state0.float().flatten()
    win[:n_win] = 0
    assert call(state, win, out) == 0 and _untouched(out[n_out:]) and _untouched(state[n_state:])
    assert _untouched(win[n_win:])
    got, got_state = out[:n_out].view(N, -1), state[:n_state].view(S, nv, dk, dv)
    got_win = win[:n_win].view(S, nv, DELTA_CHUNK - 1, -1)
    assert torch.equal(got_state[1], state0[1].float())  # a sequence of no rows: as it was
    # the states before in buffers of their own (`state_in`, `win_in`): `state` and `win`
    # only written, the same bits as in place, the buffers before untouched
    before, wbefore = state0.float().flatten().clone(), torch.zeros(n_win)
    fresh, fresh_win, out2 = _guarded(n_state), _guarded(n_win), _guarded(n_out)
    assert call(fresh, fresh_win, out2, before=before, win_before=wbefore) == 0
    assert torch.equal(before, state0.float().flatten()) and not wbefore.any()
    assert torch.equal(fresh[:n_state], state[:n_state]) and torch.equal(out2, out)
    assert torch.equal(fresh_win[:n_win], win[:n_win])
    at = 0
    for i, n in enumerate(lengths):
        if not n:
            continue
        one_seq = {k: v[at : at + n][None] if k in ("conv", "z", "b", "a") else v
                   for k, v in ins.items()}  # fmt: skip
        exact, after = _delta_torch(**one_seq, eps=1e-6, state=state0[i : i + 1], nk=nk, dk=dk)
        ref, ref_after = _delta_torch(**{k: v.float() for k, v in one_seq.items()}, eps=1e-6,
                                      state=state0[i : i + 1].float(), nk=nk, dk=dk)  # fmt: skip
        assert_as_exact_as(got[at : at + n][None], ref, exact)
        meant = _replayed(got_state[i : i + 1], got_win[i : i + 1], n % DELTA_CHUNK)
        assert_as_exact_as(meant, ref_after, after)
        for j, row in enumerate(points.tolist()):
            if not at <= row < at + n:
                continue
            k = row - at + 1  # the state after k rows: the same call over k rows alone
            alone, alone_win = state0[i : i + 1].float().clone(), torch.zeros(carried)
            alone_out = torch.empty(k, nv * dv)
            part = {key: f32[key][at : at + k].contiguous() for key in ("conv", "z", "b", "a")}
            assert lib.kvlm_gated_delta(
                part["conv"].data_ptr(), part["conv"].numel(), part["z"].data_ptr(),
                part["z"].numel(), part["b"].data_ptr(), part["b"].numel(),
                part["a"].data_ptr(), part["a"].numel(), f32["a_log"].data_ptr(),
                f32["dt_bias"].data_ptr(), nv, f32["w"].data_ptr(), dv, 1e-6, None,
                alone.data_ptr(), alone.numel(), None, alone_win.data_ptr(), carried,
                alone_out.data_ptr(), alone_out.numel(), torch.tensor([0, k]).data_ptr(), 2,
                torch.tensor([0]).data_ptr(), 1, None, 0, None, 0, None, 0, 1, nk, nv, dk,
                dv) == 0  # fmt: skip
            assert torch.equal(snaps[: A * one].view(A, nv, dk, dv)[j], alone[0]), (i, row)
            assert torch.equal(wsnaps[: A * carried].view(A, -1)[j], alone_win), (i, row)
        at += n
    assert _untouched(snaps[A * one :]) and _untouched(wsnaps[A * carried :])
    # the third sequence's 20 rows in two calls, 7 then 13 (the rows carried between):
    # its one call's outputs, state and rows, bit for bit
    st, wn = state0[2:].float().clone(), torch.zeros(carried)
    halves = []
    for lo, hi in ((5, 12), (12, 25)):
        part = {key: f32[key][lo:hi].contiguous() for key in ("conv", "z", "b", "a")}
        o = torch.empty(hi - lo, nv * dv)
        assert lib.kvlm_gated_delta(
            part["conv"].data_ptr(), part["conv"].numel(), part["z"].data_ptr(),
            part["z"].numel(), part["b"].data_ptr(), part["b"].numel(), part["a"].data_ptr(),
            part["a"].numel(), f32["a_log"].data_ptr(), f32["dt_bias"].data_ptr(), nv,
            f32["w"].data_ptr(), dv, 1e-6, None, st.data_ptr(), st.numel(), None,
            wn.data_ptr(), carried, o.data_ptr(), o.numel(),
            torch.tensor([0, hi - lo]).data_ptr(), 2, torch.tensor([lo - 5]).data_ptr(), 1,
            None, 0, None, 0, None, 0, 1, nk, nv, dk, dv) == 0  # fmt: skip
        halves.append(o)
    assert torch.equal(torch.cat(halves), got[5:25])
    assert torch.equal(st, got_state[2:]) and torch.equal(wn, got_win[2].flatten())
    # more than 64 states of one sequence: refused, nothing written
    rows = 70
    z0 = [torch.zeros(rows, w) for w in (C, nv * dv, nv, nv)]
    st, o, many = torch.zeros(nv * dk * dv), torch.zeros(rows * nv * dv), torch.arange(65)
    wn = torch.zeros(carried)
    out_many, wout_many = _guarded(65 * one), _guarded(65 * carried)
    assert lib.kvlm_gated_delta(
        z0[0].data_ptr(), z0[0].numel(), z0[1].data_ptr(), z0[1].numel(), z0[2].data_ptr(),
        z0[2].numel(), z0[3].data_ptr(), z0[3].numel(), f32["a_log"].data_ptr(),
        f32["dt_bias"].data_ptr(), nv, f32["w"].data_ptr(), dv, 1e-6, None, st.data_ptr(),
        st.numel(), None, wn.data_ptr(), carried, o.data_ptr(), o.numel(),
        torch.tensor([0, rows]).data_ptr(), 2, torch.tensor([0]).data_ptr(), 1,
        many.data_ptr(), 65, out_many.data_ptr(), 65 * one, wout_many.data_ptr(), 65 * carried,
        1, nk, nv, dk, dv) == -2  # fmt: skip
    assert _untouched(out_many) and _untouched(wout_many)


@pytest.mark.parametrize("build", BUILDS)
def test_the_test_exports_check_their_buffers(build):
    """The quantizers and fp16 conversions exported for tests (kvlm_quantize_q4_rows,
    kvlm_quantize_kv_rows, kvlm_f16_round_trip): x [rows, D] within xn floats, each output
    within its length, D a size they take."""
    lib = _kernels(build)
    rows, D = 3, 64
    x = torch.randn(rows, D)
    n = rows * D
    for name, fn, codes, params, dtype in (
        ("q4", lib.kvlm_quantize_q4_rows, n // 2, rows * D // 32, torch.uint8),
        ("kv", lib.kvlm_quantize_kv_rows, n, 2 * rows, torch.int8),
    ):
        good = {"xn": n, "cn": codes, "pn": params, "rows": rows, "D": D}

        def call(c: torch.Tensor, p: torch.Tensor, fn=fn, good=good, **given) -> int:
            a = {**good, **given}
            return fn(x.data_ptr(), a["xn"], c.data_ptr(), a["cn"], p.data_ptr(), a["pn"],
                      a["rows"], a["D"])  # fmt: skip

        bad = [{"xn": n - 1}, {"cn": codes - 1}, {"pn": params - 1}, {"xn": -1}, {"cn": -1},
               {"rows": -1}, {"D": 0}, {"rows": HUGE, "xn": ANY, "cn": ANY, "pn": ANY}]  # fmt: skip
        if name == "q4":
            bad.append({"D": 63})  # codes hold values in pairs
        for given in bad:
            c, p = _guarded(codes, dtype), _guarded(params, torch.int16)
            assert call(c, p, **given) == -2 and _untouched(c) and _untouched(p), (name, given)
        c, p = _guarded(codes, dtype), _guarded(params, torch.int16)
        assert call(c, p) == 0 and _untouched(c[codes:]) and _untouched(p[params:]), name

    def trip(h: torch.Tensor, y: torch.Tensor, xn=n, hn=n, yn=n, count=n) -> int:
        return lib.kvlm_f16_round_trip(x.data_ptr(), xn, h.data_ptr(), hn, y.data_ptr(), yn,
                                       count)  # fmt: skip

    for given in ({"xn": n - 1}, {"hn": n - 1}, {"yn": n - 1}, {"count": -1}, {"hn": -1}):
        h, y = _guarded(n, torch.int16), _guarded(n)
        assert trip(h, y, **given) == -2 and _untouched(h) and _untouched(y), given
    h, y = _guarded(n, torch.int16), _guarded(n)
    assert trip(h, y) == 0 and _untouched(h[n:]) and torch.equal(y[:n].view(rows, D),
                                                                   x.half().float())  # fmt: skip


@pytest.fixture(scope="module")
def tiny_step(tmp_path_factory):
    """The tiny model's fused decode step over 32 slots."""
    from kvlm import LLM
    from kvlm.model.fused import FusedDecoder

    if kernels.library() is None:
        pytest.skip(kernels.status())
    path = write(tiny(), tmp_path_factory.mktemp("step") / "m.gguf")
    return FusedDecoder(LLM(model=path, weights="native", progress=False).model, 32)


@pytest.mark.parametrize("kv", ["fp32", "int8"])
@pytest.mark.parametrize("build", BUILDS)
def test_the_decode_step_checks_its_buffers(build, kv, tiny_step):
    """kvlm_decode_batch: x [B, hidden], pos [B], cos and sin [tables, slots, head_dim],
    the scratch and logits [B, vocab] each within its count; each view's tables [B, width]
    within their entries, and its pool's blocks of every layer (and an int8 cache's
    parameters) within its store's bytes: more blocks, layers, a longer block or a wider
    layer stride than the store holds is refused. Nothing written: x, the logits and the
    cache as they were."""
    import ctypes

    from kvlm.cache.storage import Store
    from kvlm.model.fused import KVView

    lib, step = _kernels(build), tiny_step
    c, S, B = step.model.config, step.slots, 2
    H, Hkv, D, vocab = c.hidden_size, c.num_kv_heads, c.head_dim, step.vocab
    dtype = {"fp32": torch.float32, "int8": torch.int8}[kv]
    store = Store((c.num_layers, 2, B, Hkv, S, D), dtype, torch.device("cpu"))
    for t in store.parts.values():
        t.fill_(1)
    before = [t.clone() for t in store.parts.values()]
    step._set_storage(store, None)
    step._place([KVView(store, [[0], [1]], S)], [], [])
    pos = torch.tensor([3, 5])
    spec = ctypes.byref(step.spec)
    scratch = torch.empty(lib.kvlm_decode_scratch(spec, B))
    tables = step.cos.numel()
    good = {"xn": B * H, "pn": B, "cn": tables, "sn": tables, "scn": scratch.numel(),
            "ln": B * vocab}  # fmt: skip

    def view(**fields) -> ctypes.Array:
        """The step's view of `store` with each length exactly what it must hold, then
        `fields`."""
        views, keep = step._c_views([KVView(store, [[0], [1]], S)], pos.tolist())
        v = views[0]
        v.entries, block = B * v.width, Hkv * S  # rows a block holds (all slots, KV heads)
        row, params = {"fp32": (4 * D, 0), "int8": (D, 4)}[kv]
        v.k_bytes = v.v_bytes = (c.num_layers - 1) * v.k_layer + B * block * row
        if params:
            v.kp_bytes = v.vp_bytes = (c.num_layers - 1) * v.kp_layer + B * block * params
        for name, value in fields.items():
            setattr(v, name, value)
        views._keep = keep  # the tables they point into
        return views

    def call(x: torch.Tensor, logits: torch.Tensor, views=None, **given) -> int:
        a = {**good, **given}
        return lib.kvlm_decode_batch(
            spec, B, x.data_ptr(), a["xn"], pos.data_ptr(), a["pn"], step.cos.data_ptr(),
            a["cn"], step.sin.data_ptr(), a["sn"], view() if views is None else views, 1, None,
            0, None, 0, scratch.data_ptr(), a["scn"], logits.data_ptr(), a["ln"],
        )  # fmt: skip

    bad = [{"xn": B * H - 1}, {"pn": B - 1}, {"cn": tables - 1}, {"sn": tables - 1},
           {"scn": scratch.numel() - 1}, {"ln": B * vocab - 1}, {"xn": -1}, {"ln": -1}]  # fmt: skip
    views = [{"entries": B - 1}, {"k_bytes": view()[0].k_bytes - 1},
             {"v_bytes": view()[0].v_bytes - 1}, {"num_blocks": B + 1},
             {"layers": c.num_layers + 1}, {"k_layer": view()[0].k_layer + 1},
             {"v_layer": view()[0].v_layer + 1}, {"block_size": 2 * S}, {"k_bytes": -1},
             {"tables": None}, {"k": None}, {"block_size": HUGE},
             {"layers": 3, "k_layer": HUGE, "k_bytes": ANY}]  # fmt: skip
    if kv == "int8":
        views += [{"kp_bytes": view()[0].kp_bytes - 1}, {"vp_bytes": view()[0].vp_bytes - 1},
                  {"kp_layer": view()[0].kp_layer + 1}]  # fmt: skip
    cases = [(given, {}) for given in bad] + [({}, fields) for fields in views]
    for given, fields in cases:
        x, logits = _guarded(B * H), _guarded(B * vocab)
        rc = call(x, logits, view(**fields), **given)
        assert rc == -2 and _untouched(x) and _untouched(logits), (given, fields)
    rope = step.spec.rope_tables  # cos and sin's tables past an int64 of floats
    step.spec.rope_tables = HUGE
    x, logits = _guarded(B * H), _guarded(B * vocab)
    assert call(x, logits, cn=ANY, sn=ANY) == -2 and _untouched(logits), "rope_tables"
    step.spec.rope_tables = rope
    assert all(torch.equal(t, b) for t, b in zip(store.parts.values(), before, strict=True))
    x, logits = _guarded(B * H), _guarded(B * vocab)
    assert call(x, logits) == 0 and _untouched(logits[B * vocab :]) and _untouched(x[B * H :])
    assert torch.isfinite(logits[: B * vocab]).all()
    assert not all(torch.equal(t, b) for t, b in zip(store.parts.values(), before, strict=True))


@pytest.fixture(scope="module")
def lfm2_step(tmp_path_factory):
    """A tiny LFM2's fused step (conv, attention, conv, attention) and a contiguous cache
    of two sequences, 5 tokens held: the step's K/V views and conv rows."""
    return _step_of(tmp_path_factory, "lfm2", tokenizer="llama3")


def _step_of(tmp_path_factory, arch: str, slots: int = 32, **extra):
    """A tiny model's fused step and a contiguous cache of two sequences, 5 tokens held,
    `slots` positions."""
    from helpers import save_tiny_model
    from kvlm import LLM
    from kvlm.model.fused import FusedDecoder

    if kernels.library() is None:
        pytest.skip(kernels.status())
    folder = save_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=3, **extra)
    llm = LLM(model=folder, weights="int8", max_context=slots, progress=False)
    cache = llm.new_cache("contiguous")
    llm.runner.forward([5, 6, 7, 8, 9], cache)
    cache.fork(2)
    return FusedDecoder(llm.model, slots), cache


@pytest.mark.parametrize("build", BUILDS)
def test_the_conv_rows_are_checked(build, lfm2_step):
    """kvlm_decode_batch over a model with conv layers: each conv view's rows within its
    bytes (layers x sequences x keep x hidden floats, overflow refused), its seq and ends
    within their entries, each row's sequence within the batch, the rows before each
    step's held (end - keep + kernel - 1 <= start <= end), a sequence's rows consecutive
    at consecutive positions with one end, no sequence twice, each conv layer's view and
    index within them; the model's conv layers' products of their shapes, taps given, the
    kernel in range, a known mixer. Nothing written: x, the logits, the K/V and the rows
    as they were; the call with each as it should be moves the rows on."""
    from kvlm.model.fused import ConvView, _split

    lib, (step, cache) = _kernels(build), lfm2_step
    c, n = step.model.config, cache.num_tokens
    H, vocab, L = c.hidden_size, step.vocab, c.conv_kernel
    kv, (conv,), _ = _split(cache.kv_views([0, 1]))
    step._set_storage(kv[0].store, None)
    step._place(kv, [conv], [])
    rows = conv.rows
    slack = rows.shape[2] - (L - 1)
    held = [rows, *kv[0].store.parts.values()]
    before = [t.clone() for t in held]
    spec = ctypes.byref(step.spec)

    def call(pos=(n, n), seqs=(0, 1), ends_at=(n, n), n_convs=1, **fields) -> int:
        """The step of len(pos) rows, the conv view's seq and ends as given, then its
        struct's `fields`; a refusal (-2) has left x and the logits untouched."""
        B = len(pos)
        kv_rows, *_ = _split(cache.kv_views([b % 2 for b in range(B)]))  # K/V rows in range
        c_views, _tables = step._c_views(kv_rows, list(pos))
        c_convs, _lists = step._c_convs([ConvView(rows, list(seqs), list(ends_at))])
        for name, value in fields.items():
            setattr(c_convs[0], name, value)
        scratch = torch.empty(lib.kvlm_decode_scratch(spec, B))
        x, logits, p = _guarded(B * H), _guarded(B * vocab), torch.tensor(pos)
        rc = lib.kvlm_decode_batch(
            spec, B, x.data_ptr(), B * H, p.data_ptr(), B, step.cos.data_ptr(), step.cos.numel(),
            step.sin.data_ptr(), step.sin.numel(), c_views, len(kv), c_convs, n_convs, None, 0,
            scratch.data_ptr(), scratch.numel(), logits.data_ptr(), B * vocab,
        )  # fmt: skip
        assert rc != -2 or (_untouched(x) and _untouched(logits)), fields
        return rc

    layers, need = rows.shape[0], rows.numel() * 4
    bad = [{"rows": None}, {"seq": None}, {"ends": None}, {"layers": layers - 1},
           {"batch": 1}, {"batch": 0}, {"keep": L - 2}, {"width": H + 1}, {"width": H - 1},
           {"entries": 1}, {"bytes": need - 1}, {"bytes": -1},
           {"layers": HUGE, "bytes": ANY}, {"keep": HUGE, "layers": 2, "bytes": ANY},
           {"seqs": (0, 2)}, {"seqs": (-1, 0)}, {"ends_at": (n, -1)},
           {"ends_at": (n + slack + 1,) * 2}, {"ends_at": (n - 1, n)},  # not held; past its end
           {"seqs": (0, 0)},  # one sequence's rows at one position
           {"seqs": (0, 0), "pos": (n, n + 1), "ends_at": (n, n + 1)},  # two ends
           {"seqs": (0, 1, 0), "pos": (n,) * 3, "ends_at": (n,) * 3},  # a sequence twice
           {"n_convs": 0}]  # fmt: skip
    for given in bad:
        assert call(**given) == -2, given
    layer = step.spec.layers[0]  # a conv layer
    for field, value in (("view", 1), ("index", layers)):
        old = getattr(layer, field)
        setattr(layer, field, value)
        assert call() == -2, field
        setattr(layer, field, old)
    assert all(torch.equal(a, b) for a, b in zip(held, before, strict=True))
    most = kernels.CONSTANTS["MAX_CONV_KERNEL"]
    for owner, field, value in ((step.spec, "conv_kernel", 1),
                                (step.spec, "conv_kernel", most + 1), (layer, "mixer", 4),
                                (layer.in_proj, "n", 3 * H + 32), (layer.out_proj, "k", H + 32),
                                (layer, "taps", None)):  # fmt: skip
        old = getattr(owner, field)
        setattr(owner, field, value)
        assert lib.kvlm_decode_scratch(spec, 2) == -2, field
        setattr(owner, field, old)
    assert call() == 0  # the rows moved on: each sequence's new u last, the rest one back
    assert torch.equal(rows[:, :, :-1], before[0][:, :, 1:])
    assert not torch.equal(rows[:, :, -1], before[0][:, :, -1])
    # a draft of two rows on one sequence beside a row of the other: taken
    assert call(pos=(n + 1, n + 2, n + 1), seqs=(0, 0, 1), ends_at=(n + 1,) * 3) == 0


@pytest.mark.parametrize("build", BUILDS)
def test_the_conv_slots_are_checked_and_read_as_the_rows(build, lfm2_step):
    """kvlm_decode_batch over the engine pool's conv layout (CONV_SLOTS: a ring of keep rows
    a slot, position p at row slot keep + p % keep, one zero row after the rings): the rows
    within its bytes (layers x (slots x keep + 1) x hidden floats), each row's slot within
    the slots, the rows before its start held, a known layout; nothing written when
    refused. Taken, the same rows as rings give the logits of the one-sequence layout bit
    for bit, and the step writes each row's u at its position's ring row only (the zero
    row, the other slots and the other ring rows as they were)."""
    from kvlm.model.fused import ConvView, _split

    lib, (step, cache) = _kernels(build), lfm2_step
    c, n = step.model.config, cache.num_tokens
    H, vocab, L = c.hidden_size, step.vocab, c.conv_kernel
    kv, (conv,), _ = _split(cache.kv_views([0, 1]))
    step._set_storage(kv[0].store, None)
    step._place(kv, [conv], [])
    layers, _, keep, _ = conv.rows.shape
    slots, order = 3, (2, 0)  # the cache's sequence 0 in slot 2, its sequence 1 in slot 0
    rings = torch.zeros(layers, slots * keep + 1, H)
    rings[:, keep : 2 * keep] = torch.randn(layers, keep, H)  # slot 1: not the step's
    for seq, slot in enumerate(order):  # positions n - keep .. n - 1, those >= 0
        for p in range(max(0, n - keep), n):
            rings[:, slot * keep + p % keep] = conv.rows[:, seq, p - n + keep]
    spec = ctypes.byref(step.spec)

    def call(view: ConvView, pos=(n, n), **fields) -> tuple[int, torch.Tensor]:
        B = len(pos)
        c_views, _tables = step._c_views(kv, list(pos))
        c_convs, _lists = step._c_convs([view])
        for name, value in fields.items():
            setattr(c_convs[0], name, value)
        scratch = torch.empty(lib.kvlm_decode_scratch(spec, B))
        x = step.model.embed(torch.tensor([5, 9])).contiguous()
        logits, p = _guarded(B * vocab), torch.tensor(pos)
        rc = lib.kvlm_decode_batch(
            spec, B, x.data_ptr(), B * H, p.data_ptr(), B, step.cos.data_ptr(), step.cos.numel(),
            step.sin.data_ptr(), step.sin.numel(), c_views, len(kv), c_convs, 1, None, 0,
            scratch.data_ptr(), scratch.numel(), logits.data_ptr(), B * vocab,
        )  # fmt: skip
        assert rc != -2 or _untouched(logits), fields
        return rc, logits[: B * vocab]

    def ring(**given) -> ConvView:
        return ConvView(rings, given.get("seqs", order), given.get("ends", (n, n)), None, keep)

    need = rings.numel() * 4
    before = rings.clone()
    bad = [({"layout": 2}, {}), ({"bytes": need - 1}, {}), ({"batch": slots + 1}, {}),
           ({"keep": keep + 1}, {}), ({"layers": HUGE, "bytes": ANY}, {}),
           ({"batch": HUGE, "bytes": ANY}, {}), ({}, {"seqs": (slots, 0)}),
           ({}, {"seqs": (-1, 0)}), ({}, {"ends": (n + keep - L + 2, n)}),
           ({}, {"ends": (n - 1, n)}), ({}, {"seqs": (2, 2)})]  # fmt: skip
    for fields, given in bad:
        assert call(ring(**given), **fields)[0] == -2, (fields, given)
    assert torch.equal(rings, before)
    shift = conv.rows.clone()
    rc, want = call(ConvView(conv.rows, [0, 1], [n, n]))  # the one-sequence layout
    assert rc == 0
    conv.rows.copy_(shift)  # (as it was, for the tests after)
    rc, got = call(ring())
    assert rc == 0 and torch.equal(got, want)
    written = [slot * keep + n % keep for slot in order]
    others = [r for r in range(slots * keep + 1) if r not in written]
    assert torch.equal(rings[:, others], before[:, others])
    assert not torch.equal(rings[:, written], before[:, written])
    assert rings[:, -1].abs().sum() == 0


@pytest.fixture(scope="module", params=["qwen3_5", "granitemoehybrid"])
def recurrent_step(request, tmp_path_factory):
    """A tiny hybrid's fused step (gated DeltaNets, or Mamba2 layers, beside attention) and
    a contiguous cache of two sequences, 5 tokens held."""
    extra = {"tokenizer": "qwen35"} if request.param == "qwen3_5" else {}
    return _step_of(tmp_path_factory, request.param, slots=96, **extra)


@pytest.mark.parametrize("build", BUILDS)
def test_the_recurrent_states_are_checked(build, recurrent_step):
    """kvlm_decode_batch over a model with recurrent layers: each state view's conv rows as
    a conv view's (within their bytes, of the layers' conv width, a sequence's rows one
    run at consecutive positions, the one-sequence layout), its states before the step
    within `in`'s bytes, `out`'s rows each row's sequence's and within its bytes, a draft
    run's kept rows at most 64 (the kernels' bound), their states within `snaps`' rows and
    bytes, the rows' u within `urows`' bytes, the
    state's floats the layers' own, each recurrent layer's view and index within them; the
    recurrent sizes within the kernels' limits and one kind a model. Nothing written: x,
    the logits, the states, the conv rows and the out and draft buffers as they were; the
    call as it should be writes `out` (a draft's `snaps`) and `urows` and moves the rows
    on."""
    from kvlm.cache.base import ConvView, StateView
    from kvlm.model.fused import _split

    lib, (step, cache) = _kernels(build), recurrent_step
    c, n = step.model.config, cache.num_tokens
    H, vocab = c.hidden_size, step.vocab
    kv, _, (state,) = _split(cache.kv_views([0, 1]))
    step._set_storage(kv[0].store, None)
    step._place(kv, [], [state])
    rows, states = state.conv.rows, state.state
    held = [rows, states, *kv[0].store.parts.values()]
    before = [t.clone() for t in held]
    spec = ctypes.byref(step.spec)

    def call(pos=(n, n), seqs=(0, 1), n_states=1, out_rows=2, drafts=0, **fields):
        B, L = len(pos), states.shape[0]
        out = _guarded(L * out_rows * states[0, 0].numel())
        # a draft's buffers: the state after `drafts` rows, every row's u; a DeltaNet's
        # carried rows after the step and after the draft's rows
        snaps, urows = _guarded(L * drafts * states[0, 0].numel()), _guarded(L * B * width)
        win_out, wsnaps = _guarded(L * out_rows * carried), _guarded(L * drafts * carried)
        win_shape = () if win is None else win.shape[2:]
        view = StateView(
            ConvView(rows, list(seqs), [n] * len(seqs)),
            states,
            out[: out.numel() - GUARD].view(L, out_rows, *states.shape[2:]),
            None,
            snaps[: snaps.numel() - GUARD].view(L, drafts, *states.shape[2:]),
            urows[: urows.numel() - GUARD].view(L, B, width),
            win,
            None if win is None else win_out[:-GUARD].view(L, out_rows, *win_shape),
            None if win is None else wsnaps[:-GUARD].view(L, drafts, *win_shape),
        )
        kv_rows, *_ = _split(cache.kv_views([b % 2 for b in range(B)]))
        c_views, _tables = step._c_views(kv_rows, list(pos))
        c_states, _lists = step._c_states([view])
        for name, value in fields.items():
            owner = c_states[0].conv if name.startswith("conv_") else c_states[0]
            setattr(owner, name.removeprefix("conv_"), value)
        scratch = torch.empty(lib.kvlm_decode_scratch(spec, B))
        x, logits, p = _guarded(B * H), _guarded(B * vocab), torch.tensor(pos)
        rc = lib.kvlm_decode_batch(
            spec, B, x.data_ptr(), B * H, p.data_ptr(), B, step.cos.data_ptr(), step.cos.numel(),
            step.sin.data_ptr(), step.sin.numel(), c_views, len(kv), None, 0, c_states, n_states,
            scratch.data_ptr(), scratch.numel(), logits.data_ptr(), B * vocab,
        )  # fmt: skip
        if rc == -2:
            assert _untouched(x) and _untouched(logits) and _untouched(out), fields
            assert _untouched(snaps) and _untouched(urows), fields
            assert _untouched(win_out) and _untouched(wsnaps), fields
        else:
            assert _untouched(out[-GUARD:]) and not _untouched(out[:-GUARD])
            assert _untouched(snaps[-GUARD:]) and _untouched(urows[-GUARD:])
            assert not _untouched(urows[:-GUARD]) and (not drafts or not _untouched(snaps))
            assert _untouched(win_out[-GUARD:]) and _untouched(wsnaps[-GUARD:])
            assert not carried or not _untouched(win_out[:-GUARD])
        return rc

    layers, per = states.shape[0], states[0, 0].numel()
    width = rows.shape[-1]
    win = state.win  # a DeltaNet's carried rows (None: a Mamba2's, none)
    carried = 0 if win is None else win[0, 0].numel()
    draft = {"pos": (n, n + 1), "seqs": (0, 0), "drafts": 1}  # one sequence's run of two
    bad = [{"in": None}, {"out": None}, {"state": per - 1}, {"state": per + 1},
           {"out_rows": 1}, {"in_bytes": states.numel() * 4 - 1}, {"out_bytes": 2 * per * 4},
           {"in_bytes": -1}, {"conv_width": width - 1}, {"conv_layers": layers - 1},
           {"conv_bytes": rows.numel() * 4 - 1}, {"conv_layout": 1}, {"conv_batch": 1},
           {"conv_keep": rows.shape[2] + 1}, {"conv_layers": HUGE, "conv_bytes": ANY},
           {"seqs": (0, 0)},  # one sequence's two rows at one position
           {"seqs": (0, 2)}, {"n_states": 0}, {"state": HUGE, "in_bytes": ANY},
           # in place (out is in: the pool's) with rows of another count than in's
           {"out": states.data_ptr(), "out_rows": 3, "out_bytes": ANY},
           # a draft's: its row's state with nowhere to go, or past snaps' rows or bytes;
           # the rows' u past urows' bytes
           {**draft, "snaps": None}, {**draft, "snap_rows": 0},
           {**draft, "snaps_bytes": layers * per * 4 - 1},
           {**draft, "snap_rows": HUGE, "snaps_bytes": ANY},
           {"urows_bytes": layers * 2 * width * 4 - 1},
           {"pos": (n, n + 2), "seqs": (0, 0), "drafts": 1},
           # the carried rows: of another size than the layers' (a Mamba2's: none), or
           # (a DeltaNet's) missing or past their bytes, in place with out not in place
           {"carried": carried + 1}]  # fmt: skip
    if carried:
        bad += [{"win": None}, {"win_out": None}, {"win_bytes": layers * 2 * carried * 4 - 1},
                {"win_out_bytes": layers * 2 * carried * 4 - 1},
                {**draft, "wsnaps": None}, {**draft, "wsnaps_bytes": layers * carried * 4 - 1},
                {"win_out": win.data_ptr(), "win_out_bytes": ANY}]  # fmt: skip
    for given in bad:
        assert call(**given) == -2, given
    layer = next(ly for ly in step.spec.layers[: c.num_layers] if ly.mixer >= 2)
    for field, value in (("view", 1), ("index", layers), ("view", -1)):
        old = getattr(layer, field)
        setattr(layer, field, value)
        assert call() == -2, field
        setattr(layer, field, old)
    assert all(torch.equal(a, b) for a, b in zip(held, before, strict=True))
    for owner, field, value in ((step.spec, "rec_key_dim", 513), (step.spec, "rec_groups", 0),
                                (step.spec, "rec_heads", 2 * step.spec.rec_heads + 1),
                                (layer, "mixer", 5 - layer.mixer), (layer, "a_log", None),
                                (layer.in_proj, "n", layer.in_proj.n + 32), (layer, "taps", None),
                                (step.spec, "rotary_dim", c.head_dim + 2),
                                (step.spec, "rotary_dim", 3),
                                (step.spec, "attn_gate", 2)):  # fmt: skip
        old = getattr(owner, field)
        setattr(owner, field, value)
        assert lib.kvlm_decode_scratch(spec, 2) == -2, field
        setattr(owner, field, old)
    assert call(**draft) == 0  # a draft's run of two rows: the state after the first kept
    rows.copy_(before[0])
    # a run of 65 rows keeps 64 states (DELTA_MAX_AT, the kernels' bound); 66 refused
    for run, rc in ((65, 0), (66, -2)):
        assert call(pos=tuple(range(n, n + run)), seqs=(0,) * run, drafts=run - 1) == rc, run
        rows.copy_(before[0])
    assert call() == 0  # the rows moved on (each sequence's new row last), the states kept
    assert torch.equal(rows[:, :, :-1], before[0][:, :, 1:])
    assert torch.equal(states, before[1])


def test_a_norm_or_glu_the_kernels_refuse_is_an_error_not_torch(monkeypatch):
    """A -2 from the norms' and SwiGLU's kernels is a ValueError, as every entry point's
    (their callers took torch's road on it): an RMSNorm weight of another length than a
    row (torch's own error before), q/k norms and RoPE or SwiGLU refused."""
    from kvlm.model.attention import Attention
    from kvlm.model.layers import MLP, Linear, RMSNorm

    if kernels.library() is None:
        pytest.skip(kernels.status())
    with pytest.raises(ValueError, match="refused RMSNorm"):
        RMSNorm(torch.ones(63), 1e-6)(torch.randn(2, 64))
    H, Hkv, D = 2, 1, 16
    attn = Attention(0, H, Hkv, D, Linear(torch.randn(4 * D, 32)), Linear(torch.randn(32, 32)))
    qkv, cs = torch.randn(1, 3, H + 2 * Hkv, D), torch.ones(1, 3, 1, D)
    mlp = MLP(Linear(torch.randn(64, 32)), Linear(torch.randn(32, 32)))
    monkeypatch.setattr(kernels, "library", lambda: SimpleNamespace(
        kvlm_qk_norm_rope=lambda *a: -2, kvlm_silu_mul=lambda *a: -2))  # fmt: skip
    with pytest.raises(ValueError, match="refused the q/k norms and RoPE"):
        attn._norm_rope_in_c(qkv, cs, cs)
    with pytest.raises(ValueError, match="refused SwiGLU"):
        mlp(torch.randn(1, 3, 32))


def test_a_weight_shorter_than_its_shape_is_refused_not_read_past(monkeypatch):
    """The Python callers hand each kernel the lengths of the tensors themselves: a packed
    weight whose bytes are fewer than its shape says (one block of 16 rows for 20) is
    refused in a clear ValueError by every road that reads it. Attention's -2 (sizes that
    disagree; torch's views never do) is a ValueError too, its -3 (declined) torch's SDPA."""
    if kernels.library() is None:
        pytest.skip(kernels.status())
    short = quant.QuantWeight._wrap("q8", 20, 64, _q8(20, 64).data[:1])
    for road in (lambda: short.matmul(torch.randn(1, 64)),
                 lambda: short.matmul(torch.randn(2, 64), act_int8=True),
                 lambda: short.matmul(torch.randn(2, 64), prompt=True),
                 lambda: short.dense(), lambda: short.rows(torch.tensor([19]))):  # fmt: skip
        with pytest.raises(ValueError, match="refused"):
            road()
    q = torch.randn(1, 2, 4, 16)
    monkeypatch.setattr(kernels, "library", lambda: SimpleNamespace(kvlm_attend=lambda *a: -3))
    assert _attend_kernel(q, q, q, None, True) is None
    monkeypatch.setattr(kernels, "library", lambda: SimpleNamespace(kvlm_attend=lambda *a: -2))
    with pytest.raises(ValueError, match="refused attention"):
        _attend_kernel(q, q, q, None, True)
