"""Hostile GGUF files: a tiny valid model as data, mutations of it, and a loader that runs
each file in a child process.

`tiny()` describes a small valid GGUF (a 2-layer Llama, hidden 64, Q4_0/Q8_0 projections
so the C kernels run, a SentencePiece or byte-level BPE vocabulary) as an editable
`Spec`: metadata keys with their GGUF value types, tensors as float arrays with their
GGML types. `write` turns a Spec into a file with the `gguf` package's writer, `read` a
float file (another family's, from llama.cpp's converter) into a Spec.
`MUTATIONS` are named edits of a Spec (a metadata value of another type or range, a
tensor dimension changed, a tensor dropped or added, a hostile vocabulary); `mutate`
draws some of them with a seeded generator, and `flip_header` sets bytes of a written
file's header. `Child` loads files in one long-lived subprocess (`kvlm` imported once),
each through `LLM()` and a short `generate`, and says what each did: loaded, refused with
one line (a KvlmError), raised something else (a traceback), killed by a signal, or ran
past its time.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

ARCH = "llama"
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS


@dataclass
class Spec:
    """A GGUF file as data: metadata key -> (value, value type, array item type), tensor
    name -> (float array in numpy order (rows, cols), GGML type)."""

    meta: dict[str, tuple[Any, V, V | None]] = field(default_factory=dict)
    tensors: dict[str, tuple[np.ndarray, Q]] = field(default_factory=dict)

    def set(self, key: str, value: Any, vtype: V, sub: V | None = None) -> None:
        self.meta[key] = (value, vtype, sub)


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """<unk> <s> </s>, the 256 byte tokens, letters and a few pieces ranked by score."""
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "th", "he", "▁t", "▁th", "▁the", "in", "er"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def _bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE: the 256 byte symbols, a few merges, two special tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
    tokens = ["<s>", "</s>", *sorted(ByteLevel.alphabet())]
    tokens += [m.replace(" ", "") for m in merges]
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, types, merges


def tiny(tokenizer: str = "spm", seed: int = 0) -> Spec:
    """A valid tiny GGUF model as a Spec (`tokenizer`: "spm" or "bpe")."""
    rng = np.random.default_rng(seed)
    s = Spec()
    s.set("general.architecture", ARCH, V.STRING)
    for key, value in (("block_count", LAYERS), ("context_length", 256),
                       ("embedding_length", HIDDEN), ("feed_forward_length", INTER),
                       ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS)):  # fmt: skip
        s.set(f"{ARCH}.{key}", value, V.UINT32)
    s.set(f"{ARCH}.rope.freq_base", 10000.0, V.FLOAT32)
    s.set(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32)
    if tokenizer == "spm":
        tokens, types, scores = _spm_vocab()
        s.set("tokenizer.ggml.model", "llama", V.STRING)
        s.set("tokenizer.ggml.scores", scores, V.ARRAY, V.FLOAT32)
        s.set("tokenizer.ggml.unknown_token_id", 0, V.UINT32)
        bos, eos = 1, 2
    else:
        tokens, types, merges = _bpe_vocab()
        s.set("tokenizer.ggml.model", "gpt2", V.STRING)
        s.set("tokenizer.ggml.pre", "gpt2", V.STRING)
        s.set("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING)
        bos, eos = 0, 1
    s.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    s.set("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
    s.set("tokenizer.ggml.bos_token_id", bos, V.UINT32)
    s.set("tokenizer.ggml.eos_token_id", eos, V.UINT32)
    s.set("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
          V.STRING)  # fmt: skip

    def weight(name: str, rows: int, cols: int, qtype: Q = Q.Q8_0) -> None:
        s.tensors[name] = (rng.normal(0, 0.2, (rows, cols)).astype(np.float32), qtype)

    def norm(name: str, n: int) -> None:
        s.tensors[name] = ((1 + 0.1 * rng.normal(size=n)).astype(np.float32), Q.F32)

    weight("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}"
        norm(f"{p}.attn_norm.weight", HIDDEN)
        weight(f"{p}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN, Q.Q4_0)
        weight(f"{p}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        weight(f"{p}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        weight(f"{p}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM, Q.Q4_0)
        norm(f"{p}.ffn_norm.weight", HIDDEN)
        weight(f"{p}.ffn_gate.weight", INTER, HIDDEN, Q.Q4_0)
        weight(f"{p}.ffn_up.weight", INTER, HIDDEN, Q.Q4_0)
        weight(f"{p}.ffn_down.weight", HIDDEN, INTER)
    norm("output_norm.weight", HIDDEN)
    weight("output.weight", len(tokens), HIDDEN)
    return s


def write(spec: Spec, path: Path) -> Path:
    """The Spec as a GGUF file (a tensor whose rows are not whole blocks of its type is
    written as F32)."""
    w = gguf.GGUFWriter(str(path), ARCH)
    w.kv_data[0].clear()  # the Spec's own general.architecture, or none
    for key, (value, vtype, sub) in spec.meta.items():
        w.add_key_value(key, value, vtype, sub)
    for name, (arr, qtype) in spec.tensors.items():
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if qtype == Q.F32 or arr.ndim != 2 or arr.shape[-1] % block or arr.size == 0:
            w.add_tensor(name, arr.astype(np.float32))
        else:
            data = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read(path: Path) -> Spec:
    """A float GGUF file (F32, F16) as a Spec to edit: its metadata and its tensors, each
    written back as F32."""
    r = gguf.GGUFReader(path)
    spec = Spec()
    for key, f in r.fields.items():
        if not key.startswith("GGUF."):
            sub = f.types[-1] if f.types[0] == V.ARRAY else None
            spec.set(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        spec.tensors[t.name] = (np.array(t.data, dtype=np.float32), Q.F32)
    return spec


def set_key(key: str, value: Any) -> Callable[[Spec], None]:
    """An edit of a read Spec: `key` set to `value`, of the type the file gave it."""
    return lambda spec: spec.set(key, value, *spec.meta[key][1:])


def cut_rows(tensor: str, rows: int) -> Callable[[Spec], None]:
    """An edit: `tensor` cut to its first `rows` along its first dimension."""

    def edit(spec: Spec) -> None:
        arr, kind = spec.tensors[tensor]
        spec.tensors[tensor] = (arr[:rows], kind)

    return edit


def fill(tensor: str, value: float) -> Callable[[Spec], None]:
    """An edit: every value of `tensor` set to `value`."""

    def edit(spec: Spec) -> None:
        arr, kind = spec.tensors[tensor]
        spec.tensors[tensor] = (np.full_like(arr, value), kind)

    return edit


# a Spec's metadata as config.json names it (write_hf)
HF_KEYS = {
    "block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}  # fmt: skip


def write_hf(spec: Spec, folder: Path) -> Path:
    """The Spec as a Hugging Face folder: config.json from its architecture keys (values
    as they are, of any type), model.safetensors from its tensors (float32, HF names), and
    its vocabulary's tokenizer.json."""
    from safetensors.numpy import save_file

    from kvlm.arch import family
    from kvlm.loading.tokenizer import tokenizer_from_gguf

    folder.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, (v, _, _) in spec.meta.items()}
    arch = meta.get("general.architecture", "")
    config = {"model_type": arch, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2}  # fmt: skip
    config |= {hf: meta[f"{arch}.{k}"] for k, hf in HF_KEYS.items() if f"{arch}.{k}" in meta}
    config.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    (folder / "config.json").write_text(json.dumps(config))
    hf_name = family("llama").from_gguf_name
    tensors = {hf_name(n): np.ascontiguousarray(a, np.float32)
               for n, (a, _) in spec.tensors.items() if hf_name(n)}  # fmt: skip
    save_file(tensors, str(folder / "model.safetensors"))
    tokenizer = tokenizer_from_gguf({k: v for k, v in meta.items() if "chat_template" not in k})
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    extra = {"chat_template": meta.get("tokenizer.chat_template")}
    (folder / "tokenizer_config.json").write_text(json.dumps(extra))
    return folder


# ------------------------------------------------------------------------- mutations

Mutation = Callable[[Spec, random.Random], str]  # edits the Spec, returns what it did

# the metadata keys a mutation may change, and values of every type and range
_ARCH_KEYS = ["block_count", "context_length", "embedding_length", "feed_forward_length",
              "attention.head_count", "attention.head_count_kv", "rope.freq_base",
              "attention.layer_norm_rms_epsilon", "attention.key_length", "vocab_size",
              "rope.scaling.type", "rope.scaling.factor", "rope.dimension_count"]  # fmt: skip
_TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                   "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token",
                   "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
                   "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.tokens", "tokenizer.ggml.merges"]  # fmt: skip
_VALUES: list[tuple[Any, V, V | None]] = [
    (0, V.UINT32, None), (1, V.UINT32, None), (5, V.UINT32, None), (32, V.UINT32, None),
    (63, V.UINT32, None), (65, V.UINT32, None), (4096, V.UINT32, None),
    (65536, V.UINT32, None), (2**20, V.UINT32, None), (2**32 - 1, V.UINT32, None),
    (-1, V.INT32, None), (-(2**31), V.INT32, None), (2**63 - 1, V.UINT64, None),
    (2**64 - 1, V.UINT64, None), (-(2**63), V.INT64, None),
    (float("nan"), V.FLOAT32, None), (float("inf"), V.FLOAT32, None),
    (-1.0, V.FLOAT32, None), (0.0, V.FLOAT32, None), (1e30, V.FLOAT32, None),
    (2.5, V.FLOAT64, None), (True, V.BOOL, None), ("12", V.STRING, None), ("", V.STRING, None),
    ("linear", V.STRING, None), ("x" * 5000, V.STRING, None), ([1, 2], V.ARRAY, V.INT32),
    (["a", "b"], V.ARRAY, V.STRING), ([0.5], V.ARRAY, V.FLOAT32),
]  # fmt: skip


def _meta_value(s: Spec, rng: random.Random) -> str:
    key = rng.choice([f"{ARCH}.{k}" for k in _ARCH_KEYS] + _TOKENIZER_KEYS)
    value = rng.choice(_VALUES)
    s.meta[key] = value
    return f"{key} = {value[0]!r:.40} ({value[1].name})"


def _meta_drop(s: Spec, rng: random.Random) -> str:
    key = rng.choice(sorted(s.meta))
    del s.meta[key]
    return f"no {key}"


def _arch(s: Spec, rng: random.Random) -> str:
    value = rng.choice(["gemma3", "gemma2", "qwen3", "qwen2", "mistral", "phi3", ""])
    s.set("general.architecture", value, V.STRING)
    for key in [k for k in s.meta if k.startswith(f"{ARCH}.")]:  # the keys follow the name
        s.meta[key.replace(ARCH, value, 1)] = s.meta.pop(key)
    return f"architecture {value!r}"


def _dim(s: Spec, rng: random.Random) -> str:
    name = rng.choice(sorted(s.tensors))
    arr, qtype = s.tensors[name]
    axis = rng.randrange(arr.ndim)
    old = arr.shape[axis]
    new = rng.choice([0, 1, 16, 32, old // 2, old - 32, old + 32, 2 * old, 200, 400, 4096])
    new = max(new, 0)
    shape = list(arr.shape)
    shape[axis] = new
    s.tensors[name] = (np.random.default_rng(new).normal(0, 0.2, shape).astype(np.float32), qtype)
    return f"{name} dims {tuple(reversed(shape))}"


def _drop_tensor(s: Spec, rng: random.Random) -> str:
    name = rng.choice(sorted(s.tensors))
    del s.tensors[name]
    return f"no {name}"


def _extra_tensor(s: Spec, rng: random.Random) -> str:
    name = rng.choice(["blk.7.attn_q.weight", "blk.-1.ffn_up.weight", "rope_freqs.weight",
                       "blk.0.attn_q.bias", "blk.1.attn_q_norm.weight", "blk.x.attn_k.weight",
                       "output.bias"])  # fmt: skip
    n = rng.choice([0, 1, 8, HEAD_DIM // 2, HIDDEN, 3 * HIDDEN])
    fill = rng.choice([0.5, 0.0, -1.0, float("nan")])
    s.tensors[name] = (np.full(n, fill, np.float32), Q.F32)
    return f"extra {name} ({n},) of {fill}"


def _retype(s: Spec, rng: random.Random) -> str:
    name = rng.choice(sorted(s.tensors))
    arr, _ = s.tensors[name]
    qtype = rng.choice([Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
    s.tensors[name] = (arr, qtype)
    return f"{name} as {qtype.name}"


def _vocab(s: Spec, rng: random.Random) -> str:
    tokens, _, sub = s.meta.get("tokenizer.ggml.tokens", (None, None, None))
    if sub != V.STRING:  # an earlier mutation took the token list away
        return "vocabulary: none to change"
    tokens = list(tokens)
    what = rng.choice(["long", "empty", "dup", "ints", "short", "types", "scores", "merge"])
    if what == "long":  # one very long token (a SentencePiece merge for each split)
        tokens[-1] = "ab" * rng.choice([5000, 500_000])
    elif what == "empty":
        tokens[rng.randrange(len(tokens))] = ""
    elif what == "dup":
        tokens[-1] = tokens[-2]
    elif what == "ints":
        s.set("tokenizer.ggml.tokens", list(range(len(tokens))), V.ARRAY, V.INT32)
        return "tokens are integers"
    elif what == "short":
        tokens = tokens[: rng.choice([1, 3, 200])]
    elif what == "types":
        n = rng.choice([1, len(tokens) + 5])
        s.set("tokenizer.ggml.token_type", [rng.choice([-7, 0, 3, 6, 99])] * n, V.ARRAY, V.INT32)
        return f"{n} token types"
    elif what == "scores":
        bad = rng.choice([float("nan"), float("inf"), 1e38])
        s.set("tokenizer.ggml.scores", [bad] * rng.choice([2, len(tokens)]), V.ARRAY, V.FLOAT32)
        return f"scores {bad}"
    else:  # a merge naming tokens the vocabulary lacks, or no space
        merge = rng.choice(["zz qq", "nospace", "a b c", " ", "Ġ Ġ"])
        merges, _, sub = s.meta.get("tokenizer.ggml.merges", ([], None, V.STRING))
        s.set("tokenizer.ggml.merges", [merge, *(merges if sub == V.STRING else [])],
              V.ARRAY, V.STRING)  # fmt: skip
        return f"merge {merge!r}"
    s.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    return f"vocabulary: {what}"


MUTATIONS: dict[str, Mutation] = {
    "meta": _meta_value, "drop-key": _meta_drop, "arch": _arch, "dim": _dim,
    "drop-tensor": _drop_tensor, "extra-tensor": _extra_tensor, "retype": _retype,
    "vocab": _vocab,
}  # fmt: skip
_WEIGHTS = {"meta": 6, "drop-key": 2, "arch": 1, "dim": 6, "drop-tensor": 1,
            "extra-tensor": 1, "retype": 1, "vocab": 3}  # fmt: skip


def mutate(rng: random.Random, base: Spec) -> tuple[Spec, list[str]]:
    """A copy of `base` with one to three mutations drawn by `rng`, and what they were."""
    spec = copy.deepcopy(base)
    names = rng.choices(list(_WEIGHTS), weights=list(_WEIGHTS.values()), k=rng.choice([1, 1, 2, 3]))
    return spec, [MUTATIONS[n](spec, rng) for n in names]


def flip_header(path: Path, rng: random.Random, flips: int = 4) -> str:
    """Set up to `flips` random bytes of the file's header (metadata and tensor infos)."""
    raw = bytearray(path.read_bytes())
    end = gguf.GGUFReader(str(path)).data_offset
    done = []
    for _ in range(rng.randint(1, flips)):
        at, value = rng.randrange(4, end), rng.randrange(256)
        raw[at] = value
        done.append(f"{at}={value}")
    path.write_bytes(bytes(raw))
    return "header bytes " + " ".join(done)


# ----------------------------------------------------------------------- the child

# One file per line on stdin; for each: {"case": i} when it starts, then {"case": i,
# "outcome": ..., "detail": ...}. outcome: "ran" (loaded and generated), "refused" (a
# KvlmError: its message), "error" (finish_reason error), "raised" (anything else: its
# traceback).
_CHILD = r"""
import json, sys, time, traceback
import torch
torch.set_num_threads(1)
from kvlm import LLM, SamplingParams
from kvlm.errors import KvlmError
greedy = SamplingParams(max_tokens=3, temperature=0.0)
for i, line in enumerate(sys.stdin):
    print(json.dumps({"case": i}), flush=True)
    start = time.monotonic()
    try:
        llm = LLM(model=line.strip(), progress=False)
        out = llm.generate("the theater", greedy)[0].outputs[0]
        reason = out.finish_reason
        result = ("error", reason) if reason == "error" else ("ran", out.text)
    except KvlmError as exc:
        result = ("refused", f"{type(exc).__name__}: {exc}")
    except Exception:
        result = ("raised", traceback.format_exc())
    took = time.monotonic() - start
    print(json.dumps({"case": i, "outcome": result[0], "detail": result[1], "seconds": took}),
          flush=True)
"""


@dataclass
class Outcome:
    outcome: str  # ran | refused | error | raised | signal | hang | exit
    detail: str
    seconds: float

    def refused_in_one_line(self, name: str, says: str) -> None:
        """The load ended in one ModelLoadError / UnsupportedModelError line naming the
        file (or folder) `name` and matching `says`."""
        assert self.outcome == "refused", f"{self.outcome}: {self.detail}"
        assert self.detail.startswith(("ModelLoadError", "UnsupportedModelError")), self.detail
        assert "\n" not in self.detail and name in self.detail, self.detail
        assert re.search(says, self.detail), self.detail


class Child:
    """A subprocess that loads GGUF files one after another (restarted after a death)."""

    def __init__(self, timeout: float, env: dict[str, str] | None = None) -> None:
        self.timeout = timeout
        self.env = {**os.environ, "KVLM_LOG_LEVEL": "ERROR", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.pending = b""  # read from the child, not yet a whole line

    def _start(self) -> subprocess.Popen:
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = {**self.env, "PYTHONPATH": os.pathsep.join([src, self.env.get("PYTHONPATH", "")])}
        return subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip

    def run(self, path: Path) -> Outcome:
        if self.proc is None or self.proc.poll() is not None:
            self.proc, self.pending = self._start(), b""
        proc, start = self.proc, time.monotonic()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"{path}\n".encode())
        proc.stdin.flush()
        deadline = start + self.timeout + 30  # the first case pays for importing kvlm
        while True:
            line = self._line(proc, deadline)
            if line is None:
                self.close()
                return Outcome("hang", f"no answer in {self.timeout} s", time.monotonic() - start)
            if not line:
                code = proc.wait()
                self.proc = None
                kind = "signal" if code < 0 else "exit"
                return Outcome(kind, f"child exit status {code}", time.monotonic() - start)
            msg = json.loads(line)
            if "outcome" in msg:
                return Outcome(msg["outcome"], msg["detail"], msg["seconds"])
            deadline = time.monotonic() + self.timeout

    def _line(self, proc: subprocess.Popen, deadline: float) -> bytes | None:
        """The child's next line (b"" at its end), None past `deadline`: read from the
        pipe unbuffered, so that select sees every byte not yet taken."""
        fd = proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
