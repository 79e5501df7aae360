"""kvlm's C kernels (qgemm.c and the parts it includes), compiled for this machine on first use.

The low-bit weight formats (`--weights int8|int4|native`) multiply through these. The
sources are split by concern (abi.h: the structs, enums and limits Python mirrors; base.c,
weights.c, kv.c, kv_float.c, kv_int8.c, kv_q4.c, conv.c, decode.c, prompt.c; v512.h: the map is
qgemm.c's comment) and compiled as one translation unit: qgemm.c includes the parts in
order and is the one file the compiler is given, so the compiler inlines across them as
within one file. The library is built once with the system C compiler (`$CC`, else
`cc`/`gcc`), `-O3 -march=native -fopenmp`, into `$KVLM_CACHE_DIR/kernels` (default
`~/.cache/kvlm/kernels`) as `qgemm-{key}.so`, the key hashing every source file
(`sources()`: qgemm.c and what it includes, so a change to any part rebuilds), the
compiler, the flags and the CPU (the instruction sets the compiler resolves `-march=native`
to, and the feature flags the OS reports), so an upgrade, or a cache dir shared with
another CPU, rebuilds instead of loading code that dies of SIGILL. A build is about 30 s of
CPU work (gcc 12, a Zen 4 core: most of it optimizing a few large functions, the q4 cache's
scores alone ~30%); with gcc and `make` at hand it is compiled with `-flto=auto`, whose
link step optimizes the functions in partitions on every core (`_flags`; the same
arithmetic: -std=c11 keeps -ffp-contract=off, so no float operation is reordered or
fused). It logs a line before it starts (what, why, about
how long, where it is cached) and one every PROGRESS_S while it runs, on the "kvlm.kernels"
logger at WARNING: the CLI, `kvlm serve` and a script's `LLM()` all show them on stderr.
Without a compiler (or with `KVLM_NO_KERNELS=1`) `library()` returns None and the formats
fall back to a torch path with the same numerics, slower; `status()` says why.

A dlopen runs the library's code, so it is loaded only from a directory the user owns and no
one else can write (`_open_folder`). A failed build leaves `qgemm-{key}.failed` (the
compiler's error) and is not retried while that marker exists. A build works in a private
`.qgemm-*.tmp` directory (the output and the compiler's TMPDIR) renamed into place, removed
however the build ends; ones left by a killed process are removed by the next build.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import logging
import mmap
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch  # loaded first, so the kernels share torch's OpenMP runtime

SOURCE = Path(__file__).with_name("qgemm.c")  # the one file compiled: it includes the parts
ABI_HEADER = Path(__file__).with_name("abi.h")  # the structs, enums and limits Python mirrors
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# gcc's link-time optimizer partitions the functions and compiles the partitions in
# parallel (one job a core; lto-wrapper runs them through `make`): the one translation unit,
# built on several cores without splitting it
PARALLEL = ("-flto=auto",)
# a first build on a busy 2-core box took 113 s of wall time: a slow or loaded machine
# must not end in a remembered failure
BUILD_TIMEOUT_S = 600
PROGRESS_S = 10.0  # a "still compiling" line this often while the build runs
CPU_SECONDS = 30  # the build's CPU time on a Zen 4 core (gcc 12: 28-31 s user), for the first line
WORK_PREFIX, WORK_SUFFIX = ".qgemm-", ".tmp"  # a build's private directory in the cache


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def sources(main: Path | None = None) -> list[Path]:
    """The files a build of `main` (SOURCE) compiles: it, then each file it includes in
    quotes (beside the file naming it), depth first in the order they are named, each once.
    Every `#include "..."` counts, whichever `#if` branch it is in (v512.h: the AVX2
    builds'), so the build key covers what any CPU's build reads."""
    order: list[Path] = []

    def walk(path: Path) -> None:
        if path in order:
            return
        order.append(path)
        for name in _INCLUDE.findall(path.read_text(encoding="utf-8")):
            walk(path.parent / name)

    walk(SOURCE if main is None else main)
    return order


def _abi_constants(text: str) -> dict[str, int]:
    """abi.h's numbers by name: each `#define NAME <integer>` and each `NAME = <integer>` of
    its enums (tests/test_kernel_abi.py holds them to what the compiler makes of them)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    found = {m[1]: int(m[2], 0) for m in re.finditer(r"^#define\s+(\w+)\s+(\d+)\s*$", text, re.M)}
    for body in re.findall(r"\benum\s*\{([^}]*)\}", text):
        found.update((m[1], int(m[2], 0)) for m in re.finditer(r"(\w+)\s*=\s*(\d+)", body))
    return found


# The binary interface's numbers (abi.h): limits (MAX_HEAD_DIM, MAX_BATCH, QMAT_PARTS, ...),
# the weight kinds (Q8, Q4K, ...), K/V dtypes (KV_F32, ...), activation bits (ACT_QKV, ...)
CONSTANTS = _abi_constants(ABI_HEADER.read_text(encoding="utf-8"))
ABI = CONSTANTS["KVLM_ABI"]  # kvlm_kernel_abi() of a library built from these sources


class KernelBuildError(OSError):
    """Why the kernels were not built or may not be loaded; the text is status()'s reason."""


@dataclass(slots=True)
class _Outcome:
    """What the last `library()` call found, for `status()`."""

    reason: str = ""  # why library() returned None
    built_for: str = ""  # the CPU the loaded library was compiled for (its .cpu sidecar)


_outcome = _Outcome()
log = logging.getLogger("kvlm.kernels")


def _compiler() -> str | None:
    names = (os.environ.get("CC"), "cc", "gcc", "clang")
    return next((name for name in names if name and shutil.which(name)), None)


@cache
def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


@cache
def _is_gcc(cc: str) -> bool:
    """Whether `cc` is gcc: `-v` ends "gcc version 12.2.0 ..." (clang's "clang version";
    `--version` will not do: Debian's cc calls itself "cc (Debian 12.2.0...)")."""
    try:
        out = subprocess.run([cc, "-v"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "\ngcc version " in f"\n{out.stderr}"


def _flags(cc: str) -> tuple[str, ...]:
    """The build's flags: FLAGS, plus PARALLEL where `cc` is gcc and `make` is on PATH
    (without make gcc's parallel LTO fails; clang's needs a linker plugin)."""
    return FLAGS + PARALLEL if _is_gcc(cc) and shutil.which("make") else FLAGS


@cache
def _compiler_target(cc: str, flags: tuple[str, ...]) -> str:
    """The instruction-set options `cc` turns `flags` into: gcc and clang resolve
    `-march=native` in the driver, and `-###` prints the compiler proper's command line
    without running it (~1 ms): gcc `"-march=znver3" -mavx2 -mno-xop ...`, clang
    `-target-cpu znver3 -target-feature +avx2 ...`. "" where there is no such line."""
    probe = [cc, *(f for f in flags if f != "-shared"), "-E", "-###", "-x", "c", os.devnull]
    try:
        out = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.stderr.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if not words or not (words[0].endswith("cc1") or "-cc1" in words):
            continue
        keep = [w for w in words if w.startswith("-m")]  # gcc: -march=, -mavx512f, -mno-xop
        for flag in ("-target-cpu", "-target-feature"):  # clang: each followed by its value
            keep += [f"{flag} {v}" for f, v in itertools.pairwise(words) if f == flag]
        return " ".join(keep)
    return ""  # another compiler: the OS's CPU flags still go into the key


def _linux_cpuinfo() -> str:
    """The first processor's feature flags (x86 `flags`, Arm `Features`, RISC-V `isa`) and
    model from /proc/cpuinfo (~0.05 ms: reading stops at the end of that block)."""
    wanted = ("flags", "features", "isa", "model name", "cpu implementer", "cpu part")
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if not line.strip() and found:
                break
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name in wanted and name not in found:
                found[name] = " ".join(value.split())
    return "\n".join(f"{k}: {v}" for k, v in found.items())


def cpu_flags() -> list[str]:
    """The CPU's feature flags as the OS names them (x86 `flags`, Arm `Features`), lower
    case; empty where the OS does not say (not Linux)."""
    for line in _cpu_features().splitlines():
        name, _, value = line.partition(":")
        if name in ("flags", "features"):
            return value.lower().split()
    return []


@cache
def _cpu_features() -> str:
    """What the OS says this CPU is and can do, stable across runs on one machine."""
    if sys.platform.startswith("linux") and (info := _linux_cpuinfo()):
        return info
    if sys.platform == "darwin":
        keys = ("machdep.cpu.brand_string", "machdep.cpu.features", "machdep.cpu.leaf7_features")
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            # an Apple-silicon Mac has no features keys: the brand string still comes
            out = subprocess.run(["sysctl", "-n", *keys], capture_output=True, text=True)
            if out.stdout.strip():
                return " ".join(out.stdout.split())
    return f"{platform.machine()} {platform.processor()}"


def _key(cc: str, flags: tuple[str, ...]) -> str:
    """The build's name: every source file, compiler, flags, and the CPU the code is
    compiled for."""
    parts = (
        *(f"{path.name}\0".encode() + path.read_bytes() for path in sources()),
        _compiler_id(cc).encode(),
        " ".join(flags).encode(),
        _compiler_target(cc, flags).encode(),
        _cpu_features().encode(),
    )
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_summary(cc: str, flags: tuple[str, ...]) -> str:
    """A few words naming the target: `znver3`, else the OS's model name, else the machine."""
    target = re.search(r"(?:^| )(?:-march=|-target-cpu )(\S+)", _compiler_target(cc, flags))
    if target:
        return target[1]
    model = re.search(r"^model name: (.*)$", _cpu_features(), re.MULTILINE)
    return model[1] if model else platform.machine() or "this CPU"


def _check_parent(folder: Path) -> None:
    """Whoever can write the cache's parent can rename `folder` away and put their own in
    its place, so it must be the user's or root's and, if others can write it, sticky
    (/tmp: only an entry's owner may rename it). Ancestors above it are not walked: they
    are the user's environment (home, project, venv) that Python already trusts for the
    code it imports, and a walk to / would refuse common setups (container bind mounts
    owned by other uids) without guarding against anyone who could not already replace
    kvlm's own modules."""
    parent = folder.parent
    st = os.stat(parent)  # following links: KVLM_CACHE_DIR may name one
    if st.st_uid not in (os.getuid(), 0):
        raise KernelBuildError(
            f"kernel cache parent {parent} belongs to uid {st.st_uid}, who could swap "
            f"{folder}; set KVLM_CACHE_DIR to a directory of your own"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise KernelBuildError(
            f"kernel cache parent {parent} is writable by others (no sticky bit), who could "
            f"swap {folder}; fix with chmod go-w {parent} or set KVLM_CACHE_DIR"
        )


def _check_private(path: Path, what: str, is_kind: Callable[[int], bool], fix: str) -> None:
    """`path` (not followed if a symlink) is of the kind, the user's, and only the user's
    to write; else KernelBuildError naming what is wrong and `fix`."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symlink"
    elif not is_kind(st.st_mode):
        problem = "is not a " + ("directory" if is_kind is stat.S_ISDIR else "regular file")
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not you (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        problem = "is writable by others"
    else:
        return
    raise KernelBuildError(f"{what} {path} {problem}; {fix}")


def _open_folder() -> Path:
    """The kernel cache, created private (0o700) if missing, checked safe to load from."""
    root = os.environ.get("KVLM_CACHE_DIR") or Path.home() / ".cache" / "kvlm"
    folder = Path(root) / "kernels"
    if not os.path.lexists(folder):
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            folder.mkdir(mode=0o700)
            os.chmod(folder, 0o700)  # ours, just made: exactly 0o700 whatever the umask
        except FileExistsError:
            pass  # another process made it first: checked below like any other
    _check_parent(folder)
    fix = f"fix with chmod 700 {folder} or set KVLM_CACHE_DIR"
    if os.lstat(folder).st_uid != os.getuid():
        fix = "set KVLM_CACHE_DIR to a directory of your own"
    _check_private(folder, "kernel cache", stat.S_ISDIR, fix)
    return folder


def _remove_stale(folder: Path) -> None:
    """Remove what builds killed mid-way left (SIGKILL, power loss): work directories
    older than the build timeout, so a concurrent build's is left alone. (`tmp*.so`: the
    partial files of kvlm versions that built beside the target.)"""
    cutoff = time.time() - BUILD_TIMEOUT_S
    for entry in [*folder.glob(f"{WORK_PREFIX}*{WORK_SUFFIX}"), *folder.glob("tmp*.so")]:
        try:
            st = entry.lstat()
            if st.st_mtime >= cutoff:
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink()
        except OSError:
            continue  # gone already (another process cleaning), or not ours to remove


def _run_compiler(cmd: list[str], work: Path) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in `work` with its temporaries there too (TMPDIR), in its own process
    group: on a timeout or Ctrl-C the driver and what it started (cc1, as, ld) are all
    killed, so none keeps writing once `work` is removed."""
    env = {**os.environ, "TMPDIR": str(work), "TMP": str(work), "TEMP": str(work)}
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    start = time.monotonic()
    try:
        while True:  # a line every PROGRESS_S, until it ends or BUILD_TIMEOUT_S
            left = BUILD_TIMEOUT_S - (time.monotonic() - start)
            try:
                out, _ = proc.communicate(timeout=max(0.0, min(PROGRESS_S, left)))
                break
            except subprocess.TimeoutExpired:
                if left <= PROGRESS_S:
                    raise
                log.warning("still compiling the C kernels: %.0f s", time.monotonic() - start)
    except BaseException:  # TimeoutExpired, KeyboardInterrupt, ...
        with contextlib.suppress(OSError):  # OSError: all gone already
            os.killpg(proc.pid, signal.SIGKILL)
        # reap it and close the pipe; a child that left the group may hold the pipe open
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _compile(cc: str, flags: tuple[str, ...], target: Path, failed: Path, work: Path) -> None:
    """Build into `work`, then rename into place: a concurrent process sees a whole
    library or none. A compiler that fails leaves `failed` with its error instead."""
    built = work / "qgemm.so"
    cmd = [cc, *flags, "-o", str(built), str(SOURCE), "-lm"]
    try:
        out = _run_compiler(cmd, work)
        why = "" if out.returncode == 0 else f"exit {out.returncode}"
        tail = out.stdout.strip()[-4000:]
    except subprocess.TimeoutExpired:
        why, tail = f"timed out after {BUILD_TIMEOUT_S} s", ""
    if why:
        brief = f"{cc} failed ({why}: {tail[-300:]})" if tail else f"{cc} failed ({why})"
        try:  # remembered, so later starts do not pay for the same failure again
            note = work / "failed"
            note.write_text(f"{shlex.join(cmd)}\n{why}\n{tail}\n", encoding="utf-8")
            os.replace(note, failed)
        except OSError as exc:
            raise KernelBuildError(f"{brief}; could not note it in {failed}: {exc}") from None
        raise KernelBuildError(f"{brief}; noted in {failed}, delete it to retry")
    os.chmod(built, 0o700)  # ours, just made: not left group-writable by a lax umask
    sidecar = work / "cpu"
    lines = (_cpu_summary(cc, flags), _compiler_target(cc, flags), _cpu_features())
    sidecar.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    os.replace(sidecar, target.with_suffix(".cpu"))
    os.replace(built, target)


def _target(folder: Path, cc: str, flags: tuple[str, ...]) -> Path:
    """The library's path for this source/compiler/flags/CPU in the cache `folder`."""
    return folder / f"qgemm-{_key(cc, flags)}.so"


def _build(cc: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library for this source/compiler/flags/CPU, compiled unless there; raises
    KernelBuildError (an OSError) if the cache is unsafe or the build failed, now or
    earlier. (Tests pass other `flags` to check the portable code paths on this CPU.)"""
    folder = _open_folder()
    target = _target(folder, cc, flags)
    failed = target.with_suffix(".failed")
    if os.path.lexists(target):
        _check_private(target, "kernel library", stat.S_ISREG, "delete it to rebuild")
        return target
    if os.path.lexists(failed):
        raise KernelBuildError(f"build failed earlier (see {failed}); delete it to retry")
    _remove_stale(folder)
    log.warning(build_notice(cc, flags, folder))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(
        prefix=WORK_PREFIX, suffix=WORK_SUFFIX, dir=folder, ignore_cleanup_errors=True
    ) as work:
        try:
            _compile(cc, flags, target, failed, Path(work))
        except KernelBuildError as exc:
            log.warning("C kernels not built (a slower torch path runs instead): %s", exc)
            raise
    log.warning("C kernels built in %.0f s: %s", time.monotonic() - start, target)
    return target


def build_notice(cc: str, flags: tuple[str, ...], folder: Path) -> str:
    """The line logged before a build: what, why, about how long, where it is kept."""
    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    spread = f", in parallel on {jobs} cores" if set(PARALLEL) <= set(flags) and jobs else ""
    return (
        f"compiling kvlm's C kernels for this CPU ({_cpu_summary(cc, flags)}) with {cc}, "
        f"once: the low-bit weight formats and the fused decode step run on them. About "
        f"{CPU_SECONDS} s of CPU time on a recent core{spread}. Kept in {folder} per source, "
        f"compiler, flags and CPU; later starts load it at once. KVLM_NO_KERNELS=1 skips it "
        f"(a slower torch path)"
    )


# Every function the library exports, bound once here (`_bind`; nothing else sets a ctypes
# signature on them: tests/test_kernel_abi.py holds this table to the C definitions and to
# the library's exported symbols): its return type, "int" or "int64", and its arguments (p a
# pointer, i an int64, d a double), named as in the C. A buffer's length follows it (xn: x's
# elements, wn: w's bytes, ...; base.c's "the sizes an entry point is given"): the kernels
# refuse a call (-2) whose buffers are shorter than its shape needs.
_SIGNATURES: dict[str, tuple[str, str]] = {
    # what the build is (base.c): ABI, 512 / 256 / 0, VNNI 1 / 0
    "kvlm_kernel_abi": ("int", ""),
    "kvlm_kernel_simd": ("int", ""),
    "kvlm_kernel_vnni": ("int", ""),
    # weights.c
    "kvlm_qgemm": ("int", "ipiiipiipii"),  # kind, x, xn, M, K, w, wn, N, y, yn, ldy
    "kvlm_qgemm_i8": ("int", "ipiiipiipiii"),  # ..., fine (an int8 residual: 16 bits)
    "kvlm_qdequant": ("int", "iiipiipi"),  # kind, bf16, K, w, wn, N, out, on (bytes)
    "kvlm_qdequant_rows": ("int", "iipiipipi"),  # kind, K, w, wn, N, rows, n, out, on
    "kvlm_qpack": ("int", "ipiiippi"),  # kind, blocks, sn, N, K, order, out, dn
    "kvlm_prefault": ("int", "pii"),  # buf, n (bytes), page
    # prompt.c
    "kvlm_silu_mul": ("int", "piiipi"),  # gu, gn, M, I, out, on
    # q, qn, H, T, D, qsh, qst, k, kn, v, vn, Hkv, S, ksh, kst, vsh, vst, mask, mn, mst,
    # causal, scale, out, on, bf16_from, sinks, sn
    "kvlm_attend": ("int", "piiiiiipipiiiiiiipiiidpiipi"),
    # q, qn, H, D, qsh, k, kn, v, vn, Hkv, S, ksh, kst, vsh, vst, mask, mn, scale, out, on,
    # sinks, sn
    "kvlm_attend_row": ("int", "piiiipipiiiiiiipidpipi"),
    "kvlm_rms_norm": ("int", "piiiipidpii"),  # x, xn, M, N, xs, w, wn, eps, y, yn, ys
    # qkv, qkvn, M, rs, nq, nk, D, qn, kn, nn, eps, cos, cn, sin, sn, cs, R
    "kvlm_qk_norm_rope": ("int", "piiiiiippidpipiii"),
    # deltanet.c: conv, cn, z, zn, b, bn, a, an, a_log, dt_bias, hn, w, wn, eps, state_in,
    # state, sn, win_in, win, wn2, out, on, cu, cun, starts, stn, at, atn, snaps, pn,
    # wsnaps, pwn, S, nk, nv, dk, dv
    "kvlm_gated_delta": ("int", "pipipipippipidppippipipipipipipiiiiii"),
    # mamba2.c: conv, cn, z, zn, dt, dn, a_log, dt_bias, d, hn, w, wn, eps, state_in,
    # state, sn, out, on, cu, cun, at, atn, snaps, pn, S, heads, hd, N, G
    "kvlm_mamba2": ("int", "pipipipppipidppipipipipiiiiii"),
    # conv.c: x, xn, xr, idx, in, L, N, C, w, wn, bias, bn, y, yn
    "kvlm_depthwise": ("int", "piipiiiipipipi"),
    # experts.c: x, xn, M, H, router, rn, E, K, normalize, kind, bias, bn, eps, scale,
    # chosen, cn, w, wn, logits, ln, router_bias, rbn
    "kvlm_route": ("int", "piiipiiiiipiddpipipipi"),
    # decode.c
    "kvlm_decode_scratch": ("int64", "pi"),  # m, B
    # m, B, x, xn, pos, pn, cos, cn, sin, sn, views, n_views, convs, n_convs, states,
    # n_states, scratch, scn, logits, ln
    "kvlm_decode_batch": ("int", "pipipipipipipipipipi"),
    # for tests alone (no caller in kvlm): the store's quantizers and fp16 conversions
    "kvlm_quantize_q4_rows": ("int", "pipipiii"),  # x, xn, codes, cn, scales, sn, rows, D
    "kvlm_quantize_kv_rows": ("int", "pipipiii"),  # x, xn, codes, cn, params, pn, rows, D
    "kvlm_f16_round_trip": ("int", "pipipii"),  # x, xn, h, hn, y, yn, n
}
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "d": ctypes.c_double}
_RESTYPES = {"int": ctypes.c_int, "int64": ctypes.c_int64}


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, args) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[a] for a in args]
        fn.restype = _RESTYPES[restype]
    return lib


def _built_for(path: Path) -> str:
    try:
        with open(path.with_suffix(".cpu"), encoding="utf-8") as f:
            return f.readline().strip()
    except OSError:
        return ""


def _build_with_fallback(cc: str, flags: tuple[str, ...]) -> Path:
    """_build with `flags`; where that fails and they hold PARALLEL, the build without it
    (one key each, so later starts find the failure noted and the plain build kept). A gcc
    whose link-time optimizer cannot run (no lto-wrapper, no plugin: a CUDA image's gcc
    did exactly that) still gets its kernels."""
    try:
        return _build(cc, flags)
    except KernelBuildError as exc:
        plain = tuple(f for f in flags if f not in PARALLEL)
        if plain == flags:
            raise
        # said once, when the plain build is made; every later start finds it built (a
        # line "building ..." at each start, as the H200's runs printed, said what was not)
        built = os.path.lexists(_target(_open_folder(), cc, plain))
        (log.debug if built else log.warning)(
            "building the C kernels without %s: %s", " ".join(PARALLEL), exc
        )
        return _build(cc, plain)


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (see `status()`)."""
    _outcome.reason, _outcome.built_for = "", ""
    if os.environ.get("KVLM_NO_KERNELS"):
        _outcome.reason = "disabled by KVLM_NO_KERNELS"
        return None
    if sys.platform == "win32":
        _outcome.reason = "not built on Windows"
        return None
    cc = _compiler()
    if cc is None:
        _outcome.reason = "no C compiler found (set CC, or install gcc)"
        return None
    try:
        path = _build_with_fallback(cc, _flags(cc))
    except (OSError, subprocess.SubprocessError) as exc:  # a KernelBuildError in its own words
        _outcome.reason = str(exc) if isinstance(exc, KernelBuildError) else f"build failed: {exc}"
        return None
    try:
        lib = ctypes.CDLL(str(path))
        if lib.kvlm_kernel_abi() != ABI:
            raise OSError("stale kernel library")
        lib = _bind(lib)  # a missing function: not this source's library
    except (OSError, AttributeError) as exc:
        _outcome.reason = f"could not load {path}: {exc}"
        return None
    _outcome.built_for = _built_for(path)
    return lib


def status() -> str:
    """One line for `kvlm info` / logs: which kernels run and why."""
    lib = library()
    if lib is None:
        return f"torch fallback ({_outcome.reason})"
    simd = {512: "AVX-512", 256: "AVX2 (AVX-512 code in two halves)"}.get(
        lib.kvlm_kernel_simd(), "scalar, compiler-vectorised"
    )
    vnni = "VNNI" if lib.kvlm_kernel_vnni() else "scalar"
    cpu = f"; built for {_outcome.built_for}" if _outcome.built_for else ""
    return f"compiled C kernels ({simd}; int8 / int16 activations: {vnni}{cpu})"


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
