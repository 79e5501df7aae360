"""llama.cpp's own converter, the one users' GGUF files come from, run on the tests' tiny
models: the way a family is tested from GGUF (docs/ADDING_A_MODEL.md).

The llama-cpp-python sdist (`SDIST`, pinned) carries llama.cpp's source:
vendor/llama.cpp/convert_hf_to_gguf.py, the `conversion` package it imports (one module
per family) and its own gguf-py. `converter()` finds the sdist in CACHE (fetching it
with `pip download --no-deps --no-binary :all:` once where it is absent) and unpacks
those three; `convert(folder)` runs the script on a Hugging Face folder as a subprocess
with that gguf-py first on PYTHONPATH and keeps the file in CACHE, keyed by the folder's
bytes and the options, so the suite pays for each model once. Where the sdist is absent
and cannot be fetched (no network), a test that needs it is skipped, saying so.

One thing is not as a user runs it: the converter names a byte-level BPE vocabulary's
pre-tokenizer by hashing the ids its tokenizer gives a fixed text, against a list of the
Hub's tokenizers (`get_vocab_base_pre`). A tiny tokenizer trained for the tests is on no
such list, so the runner says which pre-tokenizer it was built with (`pre`) where the
hash is unknown; everything else is the script's own code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
CACHE = Path(os.environ.get("KVLM_TEST_CACHE", Path.home() / ".cache" / "kvlm-tests"))
# what of the sdist the converter needs (under its vendor/llama.cpp/)
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# llama.cpp's copies of the Hub's chat templates (models/templates/), read by `template`
TEMPLATES = "models/templates/"
FETCH_TIMEOUT_S = 600
CONVERT_TIMEOUT_S = 600

# The runner: llama.cpp's script as `python convert_hf_to_gguf.py ARGS`, but for a
# vocabulary whose hash is on no list: then the pre-tokenizer the test built it with.
_RUNNER = """
import runpy, sys
vendor, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [vendor, vendor + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # a tokenizer trained for the tests: on no list
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [vendor + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter() -> Path:
    """vendor/llama.cpp of the sdist, unpacked in CACHE (the sdist fetched once where it
    is absent); the calling test is skipped where it cannot be had."""
    root = CACHE / f"llama-cpp-python-{VERSION}"
    vendor = root / "vendor" / "llama.cpp"
    if (vendor / "convert_hf_to_gguf.py").is_file():
        return vendor
    sdist = CACHE / SDIST
    if not sdist.is_file():
        _fetch(sdist)
    partial = root.with_name(root.name + f".part{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(PARTS)]  # fmt: skip
        for m in members:
            m.name = "vendor/llama.cpp/" + m.name[len(prefix) :]
        tar.extractall(partial, members=members, filter="data")
    try:
        partial.rename(root)  # whole or not at all; another process may have won
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return vendor


def template(name: str) -> str:
    """A chat template as llama.cpp keeps it (vendor/llama.cpp/models/templates/`name`: the
    Hub model's own, e.g. "openai-gpt-oss-120b.jinja"), read out of the sdist once and kept
    beside the converter; the calling test is skipped where the sdist cannot be had."""
    vendor = converter()
    path = vendor / TEMPLATES / name
    if not path.is_file():
        member = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/{TEMPLATES}{name}"
        if not (CACHE / SDIST).is_file():
            _fetch(CACHE / SDIST)
        with tarfile.open(CACHE / SDIST) as tar:
            text = tar.extractfile(member).read()  # type: ignore[union-attr]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + f".part{os.getpid()}")
        partial.write_bytes(text)
        partial.rename(path)
    return path.read_text()


def _fetch(sdist: Path) -> None:
    """`pip download` the sdist into CACHE, or skip the test saying why it could not."""
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "-d", str(CACHE), f"llama-cpp-python=={VERSION}"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"llama.cpp's converter: {SDIST} is not in {CACHE} and pip download "
                    f"failed: {exc}")  # fmt: skip
    if not sdist.is_file():
        said = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"llama.cpp's converter: {SDIST} is not in {CACHE} and pip download "
                    f"could not fetch it ({said[0]})")  # fmt: skip


def convert(
    folder: Path, outtype: str = "f32", pre: str = "gpt2", options: tuple[str, ...] = ()
) -> Path:
    """The GGUF llama.cpp's convert_hf_to_gguf.py writes for the Hugging Face `folder`
    (`outtype`: its --outtype; `pre`: the pre-tokenizer the folder's tokenizer was built
    with, named where the converter does not know its hash; `options`: more of its
    arguments, `--no-mtp`), kept in CACHE by the folder's bytes and the options."""
    vendor = converter()
    digest = hashlib.sha256(f"{VERSION}/{outtype}/{pre}/{' '.join(options)}".encode())
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    out = CACHE / "gguf" / f"{digest.hexdigest()[:24]}-{outtype}.gguf"  # not by the folder's name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".part{os.getpid()}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(vendor / "gguf-py"), str(vendor)])}
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, "-c", _RUNNER, str(vendor), pre, str(folder),
           "--outfile", str(partial), "--outtype", outtype, *options]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=CONVERT_TIMEOUT_S)  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed on {folder}:\n{done.stderr[-4000:]}")
    partial.rename(out)
    return out
