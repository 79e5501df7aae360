"""Tokenizers and chat templates, built with the libraries made for the job.

- GGUF: the vocabulary, merges and token types stored in the file become a
  `tokenizers.Tokenizer`. Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`)
  use llama.cpp's pre-tokenizer regexes, chosen by `tokenizer.ggml.pre`; SentencePiece
  vocabularies (`"llama"`) become a byte-fallback BPE whose merges are ranked by the
  stored scores.
- Hugging Face folders: `tokenizer.json`, checked against its bounds first (its size,
  types, ids, token lengths, merges, pipeline and regexes: `_check_tokenizer_json`), is
  built by `tokenizers`; `tokenizer_config.json` (or `chat_template.jinja`) supplies the
  special tokens and the chat template.
- Chat templates are Jinja2, rendered in a sandbox with the same helpers transformers
  gives them (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), and
  bounded in steps, time and size (kvlm.loading.chat_template): a runaway template is
  one InvalidRequestError, not a hang.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from kvlm.arch import pre_tokenizer, tokenizing
from kvlm.config import LIMITS, Fields
from kvlm.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from kvlm.loading.chat_template import BoundedSandbox, TemplateLimitError, TemplateLimits
from kvlm.loading.hf import json_kind, parse_json, read_json, read_text

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied one after another, each
# splitting the pieces the previous one produced and keeping both matches and the rest.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5's ("qwen35"): Qwen2's with combining marks (\p{M}) in words and out of
# punctuation runs. llama.cpp splits by it without the NFC its tokenizer.json applies first.
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's pre-tokenizers: their reference tokenizer.json sets BPE `ignore_merges`
# (whole-word hits in the vocabulary win over merging).
log = logging.getLogger("kvlm")
# The tools, as kvlm writes them into the system turn of a template that does not render
# them (llama.cpp's generic handler does the same): the hermes format, which the reply
# parser (kvlm.server.tools) reads and the lazy grammar of tool_choice auto enforces.
TOOLS_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
_TOOLS_VARIABLE = re.compile(r"\btools\b")
# Llama 3's split without a BOS token whatever the file says (llama.cpp drops its bos id),
# with or without ignore_merges: the types a family's own names read as (Family.pre_tokenizers)
_NO_BOS_PRE = ("llama3-nobos", "llama3-nobos-merges")
_IGNORE_MERGES = ("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe", "llama3-nobos")
_BOS_PRE = ("llama3", "llama-bpe", "llama-v3")  # llama.cpp's add_bos default: true
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt2", "gpt-2", "mpt", "olmo"), (_GPT2,)),
    **dict.fromkeys(_IGNORE_MERGES, (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    "llama3-nobos-merges": (_LLAMA3,),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), (r"\p{N}", _GPT2)
    ),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_TOKEN_BYTE = 6


HARMONY_ENDS = ("<|return|>", "<|call|>")


class Tokenizer:
    """Text <-> token ids, special tokens, and the model's chat template."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.template_limits = TemplateLimits()  # what one render may spend
        eos = [self.token_to_id(eos_token)] if eos_token else []
        # a harmony vocabulary's replies end at either of its two ends (a file names one
        # as its EOS), never at <|end|>, which closes a message within a reply
        # (kvlm.server.harmony); llama.cpp's vocabulary reads them the same way
        ends = [self.token_to_id(t) for t in HARMONY_ENDS]
        if None in ends:
            ends = []
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in (*eos, *extra_eos_ids, *ends) if i is not None)
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): not Unicode text
            raise InvalidRequestError(f"the text is not valid Unicode ({exc.reason})") from exc
        except BaseException as exc:  # a panic in `tokenizers` (a BaseException) is one line
            if not _is_panic(exc):
                raise
            failed = f"the tokenizer failed on this text: {_one_line(exc)}"
            raise InvalidRequestError(failed) from None

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to: the longest vocabulary entry (a byte-
        level entry of n symbols is n bytes; a SentencePiece one is n characters or one
        byte). A text of c characters is at least c / max_token_chars tokens, which lets a
        server refuse an absurdly long prompt without tokenizing it."""
        return max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """An incremental decoder: `.step(tokenizer.backend, id)` returns new text or None."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final: bool = False,
        **options: Any,
    ) -> str:
        """The conversation through the model's template, as transformers'
        apply_chat_template renders it: `tools` (OpenAI's function specs) for the
        templates that render them, `options` (reasoning_effort, ...) as extra variables;
        `continue_final`: the text ends where the last message's content ends (what the
        template closes it with cut off), so the model goes on writing it."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use --no-chat")
        if tools and not _TOOLS_VARIABLE.search(self.chat_template):
            if not vars(self).get("_told_tools"):
                self._told_tools = True
                log.info("this model's chat template does not render tools: kvlm writes them "
                         "into the system turn, calls in the hermes format")  # fmt: skip
            messages, tools = _tools_written_in(messages, tools), None
        text = self._render(messages, add_generation_prompt, tools, **options)
        if not continue_final:
            return text
        last = str(messages[-1].get("content") or "").rstrip() if messages else ""
        at = text.rfind(last) if last else -1
        if at < 0:
            raise InvalidRequestError("continue_final_message: the last message's content is "
                                      "not in the rendered conversation")  # fmt: skip
        return text[: at + len(last)]

    def _render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None, **options: Any,
    ) -> str:  # fmt: skip
        variables = options | {
            "messages": list(messages), "tools": None if tools is None else list(tools),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
        }  # fmt: skip
        text = sum(len(str(m.get("content") or "")) for m in messages)
        text += len(json.dumps(tools)) if tools else 0
        template = self._template
        try:
            return template.environment.render(  # type: ignore[attr-defined]
                template, self.template_limits, len(messages), text, variables
            )
        except TemplateLimitError as exc:
            raise InvalidRequestError(str(exc)) from None
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc
        except RecursionError:
            raise InvalidRequestError("the chat template ran past its bound: it recursed "
                                      "deeper than Python's stack allows") from None  # fmt: skip
        except (OverflowError, MemoryError) as exc:  # range(10**9) is jinja's OverflowError
            raise InvalidRequestError(f"the chat template ran past its bound: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # the template met messages it cannot render (a field of the wrong type)
            raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final: bool = False,
        **options: Any,
    ) -> list[int]:
        # The template writes the BOS token itself where the model wants one, so the
        # rendered text is encoded without adding special tokens (as transformers does).
        text = self.render_chat(messages, add_generation_prompt, tools, continue_final, **options)
        return self.encode(text, add_special_tokens=False)

    def turn_start(
        self,
        ids: Sequence[int],
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **options: Any,
    ) -> int | None:
        """Where the generation prompt begins in `ids` (encode_chat(messages, tools,
        **options)): the length of the conversation rendered without it, where that is a
        prefix of `ids`; None otherwise. The next turn may render this reply otherwise
        than the generation prompt opened it (dropping an empty think block), so a state
        that cannot forget tokens is kept there (Engine.add_request's turn_start)."""
        turn = self.encode_chat(messages, False, tools, **options)
        return len(turn) if 0 < len(turn) < len(ids) and list(ids[: len(turn)]) == turn else None

    @cached_property
    def _template(self) -> jinja2.Template:
        env = BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = env.bounded(_tojson)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template or "")
        except jinja2.TemplateError as exc:
            raise ModelLoadError(f"the model's chat template does not parse: {exc}") from exc


def _tools_written_in(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with the tools in its system turn (TOOLS_SYSTEM), an assistant's
    calls written in its text as hermes calls, and a tool's reply as a user turn in
    <tool_response>: what a template that knows nothing of tools renders."""
    out = []
    for m in messages:
        m = dict(m)
        for call in m.pop("tool_calls", None) or []:
            fn = call["function"]
            body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]})
            m["content"] = (m.get("content") or "") + f"\n<tool_call>\n{body}\n</tool_call>"
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    listed = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    if out and out[0]["role"] == "system":
        out[0]["content"] = out[0]["content"] + "\n\n" + listed
    else:
        out.insert(0, {"role": "system", "content": listed})
    return out


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


# ----------------------------------------------------------------------------- GGUF


# Bounds on a GGUF vocabulary: its tokens (the model's vocabulary's limit), the characters
# of one token (the longest of the default model's is 81), and the work of finding a
# SentencePiece vocabulary's merges (`_merges_from_scores`: up to n - 1 splits of a piece
# of n characters, each slicing and hashing its n characters; a 262k-token vocabulary of
# pieces of ~7 characters takes ~2M splits of ~15M characters)
MAX_TOKENS = LIMITS["vocab_size"][1]
MAX_TOKEN_CHARS = 1024
MAX_SPLITS = 1 << 22
MAX_SPLIT_CHARS = 1 << 26
MAX_TEMPLATE_CHARS = 1 << 20  # a chat template, of either format (real ones: under 64 KiB)


def tokenizer_from_gguf(meta: dict[str, Any], where: str = "GGUF metadata") -> Tokenizer:
    """Build the tokenizer described by GGUF metadata (`tokenizer.ggml.*`), every value
    checked for its type and range first (ModelLoadError naming `where`, the file)."""
    f = Fields(meta, where)
    kind = f("tokenizer.ggml.model", str, None)
    tokens = _strings(f, "tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedModelError(f"{where} has no tokenizer.ggml.tokens")
    n, last = len(tokens), len(tokens) - 1
    types = _numbers(f, "tokenizer.ggml.token_type", int, n) or [1] * n
    # without tokenizer.ggml.add_bos_token, as llama.cpp reads it (llama-vocab.cpp): a BOS
    # for SentencePiece and for the byte-level vocabularies of Llama 3's pre-tokenizer (a
    # family's name for it too)
    if kind == "gpt2":
        pre = pre_tokenizer(f("tokenizer.ggml.pre", str, "default"))  # a family's name: its type
        backend, bos_by_default = _gguf_bpe(f, tokens, pre), pre in _BOS_PRE
    elif kind == "llama":
        backend, bos_by_default = _gguf_sentencepiece(f, tokens, types), True
    else:
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)"
        )
    specials = [
        AddedToken(tok, special=t == _TOKEN_CONTROL, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and tok
    ]
    backend.add_special_tokens([t for t in specials if t.special])
    backend.add_tokens([t for t in specials if not t.special])
    ids = {k: f(f"tokenizer.ggml.{k}_token_id", int, None, hi=last) for k in _SPECIAL_IDS}
    bos, eos = (None if ids[k] is None else tokens[ids[k]] for k in ("bos", "eos"))
    if kind == "gpt2" and pre in _NO_BOS_PRE:
        bos = None
    add_bos = f("tokenizer.ggml.add_bos_token", bool, bos_by_default)
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    # End-of-turn tokens (Llama 3's <|eot_id|>, <|eom_id|>) also end a generation.
    extra = [ids[k] for k in ("eot", "eom") if ids[k] is not None]
    template = f("tokenizer.chat_template", str, None)
    _check_length(template, MAX_TEMPLATE_CHARS, where, "tokenizer.chat_template")
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        chat_template=template,
        extra_eos_ids=extra,
    )


# the special tokens whose ids a GGUF file may name (tokenizer.ggml.<name>_token_id)
_SPECIAL_IDS = ("bos", "eos", "unknown", "padding", "eot", "eom")


def _strings(f: Fields, key: str) -> list[str]:
    """A list of strings, each at most MAX_TOKEN_CHARS, at most MAX_TOKENS of them ([]
    where absent)."""
    items = f.data.get(key)
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(t, str) for t in items):
        raise ModelLoadError(f"{f.where}: {key} is not a list of strings")
    if len(items) > MAX_TOKENS:
        raise ModelLoadError(f"{f.where}: {key} has {len(items)} entries; at most {MAX_TOKENS}")
    longest = max(map(len, items), default=0)
    if longest > MAX_TOKEN_CHARS:
        at = next(i for i, t in enumerate(items) if len(t) == longest)
        raise ModelLoadError(f"{f.where}: entry {at} of {key} is {longest} characters long; "
                             f"at most {MAX_TOKEN_CHARS}")  # fmt: skip
    return items


def _numbers(f: Fields, key: str, kind: type, n: int) -> list | None:
    """A list of n numbers of `kind` (int, or float: not NaN), None where absent."""
    items = f.data.get(key)
    if items is None:
        return None
    number = (int,) if kind is int else (int, float)
    if not isinstance(items, list) or not all(
        isinstance(x, number) and not isinstance(x, bool) and x == x for x in items
    ):
        raise ModelLoadError(f"{f.where}: {key} is not a list of {kind.__name__}s")
    if len(items) != n:
        raise ModelLoadError(f"{f.where}: {key} has {len(items)} entries for {n} tokens")
    return items


def _gguf_bpe(f: Fields, tokens: list[str], pre: str) -> _HFTokenizer:
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        raise UnsupportedModelError(
            f"unsupported GGUF pre-tokenizer {pre!r} "
            f"(supported: {', '.join(PRE_TOKENIZER_REGEXES)})"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for i, m in enumerate(_strings(f, "tokenizer.ggml.merges")):
        pair = tuple(m.split(" ", 1))
        if len(pair) != 2 or not all(t in vocab for t in (*pair, "".join(pair))):
            raise ModelLoadError(f"{f.where}: merge {i} of tokenizer.ggml.merges, {m!r}, is "
                                 "not two tokens of the vocabulary that make a third")  # fmt: skip
        merges.append(pair)
    backend = _HFTokenizer(_bpe(f, vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece(f: Fields, tokens: list[str], types: list[int]) -> _HFTokenizer:
    scores = _numbers(f, "tokenizer.ggml.scores", float, len(tokens)) or [0.0] * len(tokens)
    # the family's quirks (kvlm.arch.family.Tokenizing), as transformers reads its files
    quirks = tokenizing(f.data.get("general.architecture"))
    if quirks.spaces_as_pieces:  # a token spelled in spaces, looked up as "▁"s
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    if quirks.merges_in_vocab_order:  # not by the stored scores
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk_id = f("tokenizer.ggml.unknown_token_id", int, 0, hi=len(tokens) - 1)
    mergeable = {
        tok: score
        for tok, score, t in zip(tokens, scores, types, strict=True)
        if t not in (_TOKEN_CONTROL, _TOKEN_BYTE)
    }
    merges = _merges_from_scores(vocab, mergeable, f.where)
    bpe = _bpe(f, vocab, merges, unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True)
    backend = _HFTokenizer(bpe)
    # the space SentencePiece puts before the text, and takes off again when decoding
    prefix = f("tokenizer.ggml.add_space_prefix", bool, True)
    prepend = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend


def _bpe(
    f: Fields, vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any
) -> models.BPE:
    """tokenizers' BPE model; what it refuses (it raises a bare Exception) a ModelLoadError."""
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as exc:
        raise ModelLoadError(f"{f.where}: the vocabulary is not a BPE model: {exc}") from exc


def _merges_from_scores(
    vocab: dict[str, int], scores: dict[str, float], where: str = "GGUF metadata"
) -> list[tuple[str, str]]:
    """SentencePiece BPE stores no merges: a piece is formed by merging any split of it into
    two known pieces, and a higher piece score means an earlier merge. Only the cuts whose
    left part has the length of some token are tried: at most MAX_SPLITS of them, of at
    most MAX_SPLIT_CHARS characters in all (a ModelLoadError before any is tried)."""
    lengths = sorted({len(t) for t in vocab})
    cuts = [(bisect.bisect_left(lengths, len(piece)), len(piece)) for piece in scores]
    splits, chars = sum(k for k, _ in cuts), sum(k * n for k, n in cuts)
    if splits > MAX_SPLITS or chars > MAX_SPLIT_CHARS:
        raise ModelLoadError(f"{where}: the SentencePiece vocabulary's merges would take "
                             f"{splits} splits of {chars} characters; at most {MAX_SPLITS} of "
                             f"{MAX_SPLIT_CHARS}")  # fmt: skip
    ranked = sorted(
        (-score, len(left), len(right), vocab[left], vocab[right], left, right)
        for piece, score in scores.items()
        for left, right in ((piece[:cut], piece[cut:]) for cut in _cuts(lengths, len(piece)))
        if left in vocab and right in vocab
    )
    return [(left, right) for *_, left, right in ranked]


def _cuts(lengths: list[int], n: int) -> list[int]:
    """The token lengths below n: where a piece of n characters may split."""
    return lengths[: bisect.bisect_left(lengths, n)]


# ----------------------------------------------------------------------------- HF folders

# Bounds on a Hugging Face folder's tokenizer files, checked before the `tokenizers` library
# sees them: it builds whatever the file describes (a padding to 10^8 tokens on every
# encode, a normalizer of 100,000 steps, a Replace of an empty pattern that panics on every
# text). Real tokenizer.json files are up to ~33 MB (a vocabulary of 262k tokens and its
# merges); a merge list is at most ~2.2 merges a token (Llama 3's 280k for 128k tokens).
MAX_TOKENIZER_JSON_BYTES = 64 << 20
MERGES_PER_TOKEN = 8
# The normalizer, pre-tokenizer, post-processor and decoder run on every text: each at
# most MAX_PIPELINE_VALUES JSON values (real ones: under 100; a Unigram model's precompiled
# character map is one string), each string at most MAX_PIPELINE_CHARS characters (a
# pattern, a replacement, a template's token) but that map and a regex of KNOWN_REGEXES.
MAX_PIPELINE_VALUES = 4096
MAX_PIPELINE_CHARS = 256

# The regexes a tokenizer.json may split or replace by. Oniguruma, which `tokenizers` runs
# them with, backtracks: it bounds one match attempt (a retry limit; past it, a Rust panic),
# not a search, which tries every position of the text. Measured here (tokenizers 0.23,
# one core): `a*a*a*c` on 1,202 characters took 407 s, `a*a*a*a*c` on 302 took 110 s,
# `a*a*[bc]d` on 4,002 took 52 s, even `a*[bc]d` on 80,002 took 13 s; `(a+)+$` panics in
# 0.2 s. No check of a pattern's shape bounds that, so only the regexes of the tokenizers
# kvlm runs are taken (as a GGUF file's pre-tokenizer is one kvlm names): those above, and
# the ones real tokenizer.json files ship, each a linear scan (every alternative consumes
# what it scans). A new one belongs here once its worst case is measured.
KNOWN_REGEXES = frozenset({
    *(r for rs in PRE_TOKENIZER_REGEXES.values() for r in rs),
    # GPT-2's, as a Split (SmolLM's and others')
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    # Llama 3's
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen2's, Qwen 2.5's and Qwen 3's; and with marks in words (Qwen 3.5's)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Tekken (Mistral Nemo, Small 3)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # o200k's (GPT-4o's, as converted tokenizers ship it)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})  # fmt: skip
_PIPELINE = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
_PLAIN_TEXT = "Hello, world! It's 12:30.\n\tÉté, 中文, ١٢٣ 🙂"  # encoded once at load


def tokenizer_from_hf_folder(
    folder: Path, eos_token_ids: Sequence[int] = (), vocab_size: int | None = None
) -> Tokenizer:
    """The folder's tokenizer.json, tokenizer_config.json and chat_template.jinja, each
    checked against its bounds first; `vocab_size`: the model's (config.json), which every
    token id must be below."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json (kvlm reads fast tokenizers only)")
    backend = _hf_backend(path, vocab_size)
    config_path = folder / "tokenizer_config.json"
    cfg = read_json(config_path) if config_path.is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        template, config_path = read_text(jinja_file, MAX_TEMPLATE_CHARS * 4), jinja_file
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{config_path}: chat_template is {type(template).__name__}; "
                             "expected a string (a Jinja template)")  # fmt: skip
    _check_length(template, MAX_TEMPLATE_CHARS, config_path, "the chat template")
    return Tokenizer(
        backend,
        bos_token=_token_text(cfg, "bos_token", folder / "tokenizer_config.json"),
        eos_token=_token_text(cfg, "eos_token", folder / "tokenizer_config.json"),
        chat_template=template,
        extra_eos_ids=eos_token_ids,
    )


def _hf_backend(path: Path, vocab_size: int | None) -> _HFTokenizer:
    """tokenizer.json checked (_check_tokenizer_json), then built; what kvlm never wants of
    it switched off: padding and truncation (every prompt padded to, or cut at, the file's
    length) and BPE dropout (merges skipped at random)."""
    text = read_text(path, MAX_TOKENIZER_JSON_BYTES)
    _check_tokenizer_json(parse_json(text, path), str(path), vocab_size)
    try:
        backend = _HFTokenizer.from_str(text)
    except BaseException as exc:  # tokenizers raises a bare Exception, or panics
        if not isinstance(exc, Exception) and not _is_panic(exc):
            raise
        raise ModelLoadError(f"cannot read {path}: {_one_line(exc)}") from exc
    backend.no_padding()
    backend.no_truncation()
    if getattr(backend.model, "dropout", None):
        backend.model.dropout = None
    try:  # a pipeline that panics on any text (a character map it cannot read) is refused here
        backend.encode(_PLAIN_TEXT)
    except BaseException as exc:
        if not isinstance(exc, Exception) and not _is_panic(exc):
            raise
        raise ModelLoadError(
            f"{path}: the tokenizer fails on a plain text: {_one_line(exc)}"
        ) from exc
    return backend


def _check_tokenizer_json(data: Any, where: str, vocab_size: int | None) -> None:
    """What kvlm and `tokenizers` read of a tokenizer.json, of the types they expect and
    within bounds: every token id below the model's `vocab_size` (else MAX_TOKENS), every
    token at most MAX_TOKEN_CHARS, at most MERGES_PER_TOKEN merges a token, the pipeline
    (_check_pipeline). A ModelLoadError naming the field, or UnsupportedModelError for a
    regex kvlm does not know."""
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {where}: it holds {json_kind(data)}; expected an "
                             "object")  # fmt: skip
    limit = vocab_size or MAX_TOKENS
    bound = f"the model's {vocab_size} (config.json vocab_size)" if vocab_size else MAX_TOKENS
    model = data.get("model")
    if not isinstance(model, dict):
        raise ModelLoadError(f"{where}: model is {json_kind(model)}; expected an object")
    for key, value in model.items():  # unk_token, a word's prefix or suffix: on every word
        if isinstance(value, str) and len(value) > MAX_PIPELINE_CHARS:
            raise ModelLoadError(f"{where}: model.{key} is {len(value)} characters long; at "
                                 f"most {MAX_PIPELINE_CHARS}")  # fmt: skip
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        tokens, ids = list(vocab), list(vocab.values())
        if not all(type(i) is int for i in ids):
            raise ModelLoadError(f"{where}: model.vocab gives a token something other than "
                                 "an integer id")  # fmt: skip
    elif isinstance(vocab, list):  # Unigram: [piece, score], the id its place
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                   and type(p[1]) in (int, float) for p in vocab):  # fmt: skip
            raise ModelLoadError(f"{where}: model.vocab is a list, but not of [piece, score] "
                                 "pairs")  # fmt: skip
        tokens, ids = [p[0] for p in vocab], list(range(len(vocab)))
    else:
        raise ModelLoadError(f"{where}: model.vocab is {json_kind(vocab)}; expected an "
                             "object of tokens and ids (a list of [piece, score] for "
                             "Unigram)")  # fmt: skip
    if len(tokens) > limit:
        raise ModelLoadError(f"{where}: model.vocab has {len(tokens)} tokens; at most {bound}")
    outside = next((i for i in ids if not 0 <= i < limit), None)
    if outside is not None:
        token = tokens[ids.index(outside)]
        raise ModelLoadError(f"{where}: model.vocab gives {_shown_token(token)} id {outside}; "
                             f"ids are below {bound}")  # fmt: skip
    _check_token_lengths(tokens, where, "model.vocab")
    merges = model.get("merges")
    if merges is not None:
        if not isinstance(merges, list):
            raise ModelLoadError(f"{where}: model.merges is {json_kind(merges)}; expected a "
                                 "list")  # fmt: skip
        most = MERGES_PER_TOKEN * max(len(tokens), 1)
        if len(merges) > most:
            raise ModelLoadError(f"{where}: model.merges has {len(merges)} merges for "
                                 f"{len(tokens)} tokens; at most {MERGES_PER_TOKEN} a "
                                 "token")  # fmt: skip
        parts = []
        for m in merges:
            pair = m.split(" ", 1) if isinstance(m, str) else m
            if not (isinstance(pair, list) and len(pair) == 2 and all(map(_is_str, pair))):
                raise ModelLoadError(f"{where}: a merge of model.merges, {str(m)[:80]!r}, is not "
                                     "two tokens")  # fmt: skip
            parts.extend(pair)
        _check_token_lengths(parts, where, "model.merges")
    _check_added_tokens(data.get("added_tokens", []), where, limit, bound)
    for part in _PIPELINE:
        if data.get(part) is not None:
            _check_pipeline(data[part], where, part, limit, bound)


def _check_added_tokens(added: Any, where: str, limit: int, bound: Any) -> None:
    if not isinstance(added, list) or not all(isinstance(t, dict) for t in added):
        raise ModelLoadError(f"{where}: added_tokens is not a list of objects")
    for i, t in enumerate(added):
        at = f"{where}: added_tokens[{i}]"
        token_id, content = t.get("id"), t.get("content")
        if type(token_id) is not int or not 0 <= token_id < limit:
            raise ModelLoadError(f"{at}.id is {_shown_value(token_id)}; ids are below {bound}")
        if not isinstance(content, str):
            raise ModelLoadError(f"{at}.content is {json_kind(content)}; expected a string")
        if len(content) > MAX_TOKEN_CHARS:
            raise ModelLoadError(f"{at}.content is {len(content)} characters long; at most "
                                 f"{MAX_TOKEN_CHARS}")  # fmt: skip


def _check_pipeline(value: Any, where: str, part: str, limit: int, bound: Any) -> None:
    """A normalizer, pre-tokenizer, post-processor or decoder: an object of at most
    MAX_PIPELINE_VALUES JSON values, its strings at most MAX_PIPELINE_CHARS (a
    precompiled character map and a KNOWN_REGEXES regex aside), no empty pattern (a
    Replace of one panics on every text), every integer a token id below `limit` (a
    post-processor's template adds them to every text)."""
    if not isinstance(value, dict):
        raise ModelLoadError(f"{where}: {part} is {json_kind(value)}; expected an object")
    seen = 0
    stack: list[tuple[str, str, Any]] = [(part, part, value)]  # where, its key, the value
    while stack:
        at, key, v = stack.pop()
        seen += 1
        if seen > MAX_PIPELINE_VALUES:
            raise ModelLoadError(f"{where}: {part} has more than {MAX_PIPELINE_VALUES} values "
                                 "(steps, pieces, ids); it runs on every text")  # fmt: skip
        if isinstance(v, dict):
            for k, item in v.items():
                if len(k) > MAX_PIPELINE_CHARS:
                    raise ModelLoadError(f"{where}: {at} has a key of {len(k)} characters; "
                                         f"at most {MAX_PIPELINE_CHARS}")  # fmt: skip
                stack.append((f"{at}.{k}", k, item))
        elif isinstance(v, list):
            stack.extend((f"{at}[{i}]", key, item) for i, item in enumerate(v))
        elif isinstance(v, str):
            _check_pipeline_string(v, where, at, key)
        elif type(v) is int and part == "post_processor" and not 0 <= v < limit:
            raise ModelLoadError(f"{where}: {at} is {v}; token ids are below {bound}")


def _check_pipeline_string(v: str, where: str, at: str, key: str) -> None:
    if key == "Regex":
        if v not in KNOWN_REGEXES:
            raise UnsupportedModelError(
                f"{where}: {at} {v[:80]!r}{'...' if len(v) > 80 else ''} is not a regex kvlm "
                "knows (a regex runs on every text, and a backtracking one can take minutes "
                "on a crafted one; see KNOWN_REGEXES)"
            )
    elif key == "String" and not v:
        raise ModelLoadError(f"{where}: {at} is an empty pattern")
    elif key != "precompiled_charsmap" and len(v) > MAX_PIPELINE_CHARS:
        raise ModelLoadError(f"{where}: {at} is {len(v)} characters long; at most "
                             f"{MAX_PIPELINE_CHARS}")  # fmt: skip


def _check_token_lengths(tokens: list[str], where: str, field: str) -> None:
    longest = max(map(len, tokens), default=0)
    if longest > MAX_TOKEN_CHARS:
        token = next(t for t in tokens if len(t) == longest)
        raise ModelLoadError(f"{where}: {field} has a token of {longest} characters "
                             f"({_shown_token(token)}); at most {MAX_TOKEN_CHARS}")  # fmt: skip


def _shown_token(token: str) -> str:
    return repr(token) if len(token) <= 40 else f"{token[:40]!r}..."


def _shown_value(value: Any) -> str:
    return str(value) if type(value) is int else json_kind(value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_panic(exc: BaseException) -> bool:
    """A Rust panic inside `tokenizers` (pyo3's PanicException, a BaseException)."""
    return type(exc).__name__ == "PanicException"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _token_text(cfg: dict[str, Any], key: str, where: Path) -> str | None:
    """A special token of tokenizer_config.json: its text, or {"content": text}."""
    value = cfg.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise ModelLoadError(f"{where}: {key} is {json_kind(value)}; expected a token's text "
                             '(a string, or {"content": a string})')  # fmt: skip
    _check_length(text, MAX_TOKEN_CHARS, where, key)
    return text


def _check_length(text: str | None, limit: int, where: object, what: str) -> None:
    """One clear line for a string of a tokenizer's files longer than its bound."""
    if text is not None and len(text) > limit:
        raise ModelLoadError(f"{where}: {what} is {len(text)} characters long; at most {limit}")
