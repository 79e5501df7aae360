"""kvlm's C kernels (qgemm.c), compiled for this machine on first use.

The low-bit weight formats (`--weights int8|int4|native`) multiply through these. The
library is built once with the system C compiler (`$CC`, else `cc`/`gcc`), `-O3
-march=native -fopenmp`, into `$KVLM_CACHE_DIR` (default `~/.cache/kvlm`) under a name
that hashes the source, the compiler and the flags, so an upgrade or another CPU rebuilds.
A build takes about a second. Without a compiler (or with `KVLM_NO_KERNELS=1`) `library()`
returns None and the formats fall back to a torch path with the same numerics, slower;
`status()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch  # loaded first, so the kernels share torch's OpenMP runtime

SOURCE = Path(__file__).with_name("qgemm.c")
ABI = 5
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
BUILD_TIMEOUT_S = 120

_reason = ""


def cache_dir() -> Path:
    root = os.environ.get("KVLM_CACHE_DIR") or Path.home() / ".cache" / "kvlm"
    return Path(root) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def _build(cc: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile qgemm.c unless a build for this source/compiler/flags exists; return it.
    (Tests pass other `flags` to check the portable code paths on this CPU.)"""
    key = hashlib.sha256(
        SOURCE.read_bytes() + _compiler_id(cc).encode() + " ".join(flags).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"qgemm-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process sees all of it or none.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, str(SOURCE), "-lm"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if out.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.kvlm_qgemm, lib.kvlm_qgemm_i8):  # kind, x, M, K, w, N, y
        fn.argtypes = [i, p, i, i, p, i, p]
        fn.restype = ctypes.c_int
    lib.kvlm_qdequant.argtypes = [i, i, i, p, i, p]  # kind, bf16, K, w, N, out
    lib.kvlm_qdequant.restype = None
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (see `status()`)."""
    global _reason
    if os.environ.get("KVLM_NO_KERNELS"):
        _reason = "disabled by KVLM_NO_KERNELS"
        return None
    if sys.platform == "win32":
        _reason = "not built on Windows"
        return None
    cc = _compiler()
    if cc is None:
        _reason = "no C compiler found (set CC, or install gcc)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
        if lib.kvlm_kernel_abi() != ABI:
            raise OSError("stale kernel library")
        return _bind(lib)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        _reason = f"build failed: {exc}"
        return None


def status() -> str:
    """One line for `kvlm info` / logs: which kernels run and why."""
    lib = library()
    if lib is None:
        return f"torch fallback ({_reason})"
    simd = "AVX-512" if lib.kvlm_kernel_simd() == 512 else "scalar, compiler-vectorised"
    vnni = "VNNI" if lib.kvlm_kernel_vnni() else "scalar"
    return f"compiled C kernels ({simd}; int8 activations: {vnni})"


HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of `nbytes` on transparent huge pages (anonymous memory, 2 MiB aligned,
    madvise(MADV_HUGEPAGE) before the first touch), or None where the OS does not offer them
    (not Linux). Streaming ~100 MB of weights per token through 4 KiB pages costs a page
    walk every 4 KiB; on 2 MiB pages a plain read here ran at 45-57 GB/s instead of 30-38."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return None
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(advice)
    except (OSError, ValueError, AttributeError):
        return None
    with warnings.catch_warnings():  # an mmap is writable; torch keeps it alive
        warnings.simplefilter("ignore")
        whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]
