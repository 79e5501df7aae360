"""How kvlm builds and loads its C kernels (kvlm.kernels): the build key follows the CPU, only
a private cache is loaded from, a failed build is remembered, no temporary file outlives a
build. Fake compilers (shell scripts) keep these fast; one test compiles a stub library."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlm import kernels

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="kernels are not built there")

# The fake compilers answer the key's probes (--version, -###) with nothing and log each
# real build (a command naming qgemm.c): the TMPDIR it was given, one line per build. Each
# writes a temporary file into that TMPDIR, as cc1 and as do, then runs its body.
FAKE_CC = """#!/bin/sh
case "$*" in *qgemm.c*) ;; *) exit 0 ;; esac
echo "$TMPDIR" >> "{log}"
touch "$TMPDIR/cc-temp.s"
while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done
{body}
"""
BUILDS = 'echo library > "$out"'
FAILS = 'echo "qgemm.c:1: fatal error: omp.h: No such file or directory" >&2; exit 1'
HANGS = 'echo partial > "$out"; sleep 60 & echo $! > "{pid}"; wait'


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh kernel cache under tmp_path; library() evaluated anew in and after the test."""
    monkeypatch.setenv("KVLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVLM_NO_KERNELS", raising=False)
    kernels.library.cache_clear()
    yield tmp_path / "cache" / "kernels"
    kernels.library.cache_clear()  # the other tests load the real kernels again


def fake_cc(tmp_path: Path, body: str) -> tuple[str, Path]:
    """A fake compiler script running `body`, and the log of its builds."""
    log, script = tmp_path / "cc.log", tmp_path / f"cc-{len(list(tmp_path.glob('cc-*')))}"
    script.write_text(FAKE_CC.format(log=log, body=body.format(pid=tmp_path / "cc.pid")))
    script.chmod(0o755)
    return str(script), log


def builds(log: Path) -> list[str]:
    """The TMPDIR of each build the fake compiler ran."""
    return log.read_text().splitlines() if log.exists() else []


def refuse_loading(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make any dlopen a test failure; returns the paths that were tried."""
    tried: list[str] = []

    def cdll(path, *args, **kwargs):
        tried.append(path)
        raise AssertionError(f"loaded {path}")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    return tried


def process_gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether `pid` has exited (a zombie nobody reaped counts as exited)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        except OSError:  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            state = "R"
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# --- the key follows the CPU -------------------------------------------------------------


def test_another_cpu_gets_its_own_build(tmp_path, monkeypatch):
    cc, log = fake_cc(tmp_path, BUILDS)
    monkeypatch.setattr(kernels, "_cpu_features", lambda: "flags: sse2 avx2 avx512f")
    first = kernels._build(cc)
    assert kernels._key(cc, kernels.FLAGS) == kernels._key(cc, kernels.FLAGS)
    assert kernels._build(cc) == first and len(builds(log)) == 1  # same CPU: reused

    # the cache dir moved (copied, NFS home) to a CPU without AVX-512: never load `first`
    monkeypatch.setattr(kernels, "_cpu_features", lambda: "flags: sse2 avx2")
    second = kernels._build(cc)
    assert second != first and len(builds(log)) == 2

    # the same OS flags but another -march=native target (a compiler that knows more)
    monkeypatch.setattr(kernels, "_compiler_target", lambda cc, flags: "-march=znver4")
    assert kernels._build(cc) not in (first, second) and len(builds(log)) == 3


def test_the_key_holds_what_the_compiler_targets_and_what_the_os_reports():
    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    assert kernels._cpu_features()  # never empty: platform.machine() at worst
    target = kernels._compiler_target(cc, kernels.FLAGS)
    if "gcc" in kernels._compiler_id(cc).lower() or "clang" in kernels._compiler_id(cc).lower():
        assert "-march=" in target or "-target-cpu" in target  # native resolved to a CPU
        assert "native" not in target


def test_a_build_for_another_cpu_is_rebuilt_and_loaded(tmp_path, monkeypatch, cache):
    """End to end with the real compiler on a stub library: load, say which CPU, rebuild."""
    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    stub = tmp_path / "qgemm.c"
    # every bound function, from the table library() binds by (a hand list drifted once)
    body = [f"int kvlm_kernel_abi(void) {{ return {kernels.ABI}; }}"]
    others = [name for name in kernels._SIGNATURES if name != "kvlm_kernel_abi"]
    body += [f"int {name}(void) {{ return 0; }}" for name in others]
    stub.write_text("\n".join(body) + "\n")
    monkeypatch.setattr(kernels, "SOURCE", stub)
    monkeypatch.setenv("CC", cc)
    assert kernels.library() is not None, kernels.status()
    assert "built for " in kernels.status()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # created private
    first = sorted(cache.glob("*.so"))

    kernels.library.cache_clear()
    monkeypatch.setattr(kernels, "_cpu_features", lambda: "flags: sse2")
    assert kernels.library() is not None, kernels.status()
    now = sorted(cache.glob("*.so"))
    assert len(now) == 2 and first[0] in now


# --- load only from a private cache ------------------------------------------------------


def planted_library(cc: str) -> Path:
    """A library at the path library() would load for `cc`, in a cache made by kvlm."""
    target = kernels._open_folder() / f"qgemm-{kernels._key(cc, kernels.FLAGS)}.so"
    target.write_text("not a library")
    target.chmod(0o700)
    return target


@pytest.mark.parametrize("problem", ["group-writable", "world-writable", "someone else's"])
def test_a_cache_others_can_write_is_not_loaded_from(tmp_path, monkeypatch, cache, problem):
    cc, log = fake_cc(tmp_path, BUILDS)
    monkeypatch.setenv("CC", cc)
    planted_library(cc)
    if problem == "someone else's":
        other = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: other)
    else:
        cache.chmod(0o770 if problem == "group-writable" else 0o707)
    tried = refuse_loading(monkeypatch)
    assert kernels.library() is None
    reason = kernels.status()
    assert reason.startswith("torch fallback") and str(cache) in reason
    if problem == "someone else's":
        assert "belongs to uid" in reason and "KVLM_CACHE_DIR" in reason
    else:
        assert "writable by others" in reason and f"chmod 700 {cache}" in reason
    assert tried == [] and builds(log) == []  # neither loaded nor built into


@pytest.mark.parametrize("problem", ["symlink", "writable", "directory"])
def test_an_unsafe_library_file_is_not_loaded(tmp_path, monkeypatch, problem):
    cc, log = fake_cc(tmp_path, BUILDS)
    monkeypatch.setenv("CC", cc)
    target = planted_library(cc)
    if problem == "symlink":  # pointing at a file the user owns does not make it safe
        target.rename(tmp_path / "elsewhere.so")
        target.symlink_to(tmp_path / "elsewhere.so")
    elif problem == "writable":
        target.chmod(0o666)
    else:
        target.unlink()
        target.mkdir()
    tried = refuse_loading(monkeypatch)
    assert kernels.library() is None
    expected = {"symlink": "is a symlink", "writable": "writable by others"}
    assert str(target) in kernels.status()
    assert expected.get(problem, "not a regular file") in kernels.status()
    assert tried == [] and builds(log) == []


def test_a_parent_others_can_write_needs_the_sticky_bit(tmp_path, monkeypatch):
    cc, log = fake_cc(tmp_path, BUILDS)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename shared/kernels and plant their own
    monkeypatch.setenv("KVLM_CACHE_DIR", str(shared))
    with pytest.raises(kernels.KernelBuildError, match=f"parent {shared} is writable by others"):
        kernels._build(cc)
    assert builds(log) == []
    shared.chmod(0o1777)  # /tmp-like: only the owner of kernels/ may rename it
    assert kernels._build(cc).parent == shared / "kernels"


# --- a failed build is remembered --------------------------------------------------------


def test_a_failed_build_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(OSError, match="failed"):
        kernels._build("false")  # a "compiler" that always fails
    assert not list((tmp_path / "kernels").glob("*.so*"))  # no half-written library left
    assert len(list((tmp_path / "kernels").glob("qgemm-*.failed"))) == 1


def test_a_failed_build_is_not_retried_until_its_marker_goes(tmp_path, monkeypatch, cache):
    cc, log = fake_cc(tmp_path, FAILS)
    monkeypatch.setenv("CC", cc)
    assert kernels.library() is None
    (marker,) = cache.glob("qgemm-*.failed")
    assert "omp.h: No such file" in marker.read_text()  # the compiler's own words
    assert "omp.h" in kernels.status() and str(marker) in kernels.status()

    kernels.library.cache_clear()  # the next start
    assert kernels.library() is None and len(builds(log)) == 1  # the compiler did not run
    assert kernels.status() == (
        f"torch fallback (build failed earlier (see {marker}); delete it to retry)"
    )

    marker.unlink()
    kernels.library.cache_clear()
    assert kernels.library() is None and len(builds(log)) == 2  # deleting it retries


def test_a_build_whose_link_time_optimizer_fails_is_built_without_it(tmp_path, monkeypatch,
                                                                     cache, caplog):  # fmt: skip
    """A gcc whose -flto cannot run (a CUDA image's: "could not run lto-wrapper") gets the
    kernels built without it, said once; the next start goes straight to that build and
    says nothing of building."""
    lto_fails = (
        "case \"$(tr '\\0' ' ' < /proc/$$/cmdline)\" in *-flto*) "
        'echo "ld: error: could not run lto-wrapper" >&2; exit 1;; esac; '
        'echo library > "$out"'
    )  # fmt: skip (the command line: $* is shifted away)
    cc, log = fake_cc(tmp_path, lto_fails)
    monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(kernels, "_flags", lambda cc: kernels.FLAGS + kernels.PARALLEL)
    said = "building the C kernels without"
    with caplog.at_level(logging.INFO, logger=kernels.log.name):
        kernels.library()  # the fake's "library" does not load: the builds are what is checked
    assert len(builds(log)) == 2 and len(list(cache.glob("qgemm-*.failed"))) == 1
    assert len(list(cache.glob("qgemm-*.so"))) == 1
    assert said in caplog.text
    caplog.clear()
    kernels.library.cache_clear()  # the next start
    with caplog.at_level(logging.INFO, logger=kernels.log.name):
        kernels.library()
    assert len(builds(log)) == 2  # neither build again
    assert said not in caplog.text


# --- nothing temporary survives a build --------------------------------------------------


def interrupt_the_build(monkeypatch: pytest.MonkeyPatch, pidfile: Path) -> None:
    """Ctrl-C while the (fake) compiler runs, once it has written its temporaries."""

    class Interrupted(subprocess.Popen):
        def communicate(self, input=None, timeout=None):
            if "-o" in self.args and not getattr(self, "interrupted", False):
                self.interrupted = True
                deadline = time.monotonic() + 10
                while not pidfile.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                raise KeyboardInterrupt
            return super().communicate(input, timeout)

    monkeypatch.setattr(subprocess, "Popen", Interrupted)


@pytest.mark.parametrize("outcome", ["builds", "fails", "times out", "interrupted"])
def test_a_build_leaves_no_temporary_files(tmp_path, monkeypatch, cache, outcome):
    body = {"builds": BUILDS, "fails": FAILS}.get(outcome, HANGS)
    cc, log = fake_cc(tmp_path, body)
    key = kernels._key(cc, kernels.FLAGS)  # before Popen is patched: the probes are cached
    monkeypatch.setattr(kernels, "BUILD_TIMEOUT_S", 0.5)
    if outcome == "interrupted":
        interrupt_the_build(monkeypatch, tmp_path / "cc.pid")
    raises, match = {
        "builds": (None, None),
        "fails": (kernels.KernelBuildError, "exit 1"),
        "times out": (kernels.KernelBuildError, "timed out"),
        "interrupted": (KeyboardInterrupt, None),
    }[outcome]
    started = time.monotonic()
    if raises is None:
        kernels._build(cc)
    else:
        with pytest.raises(raises, match=match):
            kernels._build(cc)
    assert time.monotonic() - started < 15  # not waiting on the compiler's `sleep 60`

    (private_tmp,) = builds(log)
    assert Path(private_tmp).parent == cache and not os.path.exists(private_tmp)
    expected = {
        "builds": [f"qgemm-{key}.cpu", f"qgemm-{key}.so"],
        "fails": [f"qgemm-{key}.failed"],
        "times out": [f"qgemm-{key}.failed"],
        "interrupted": [],  # Ctrl-C is no compiler failure: the next start builds again
    }[outcome]
    assert sorted(p.name for p in cache.iterdir()) == expected
    if outcome in ("times out", "interrupted"):  # the driver's children were killed too
        assert process_gone(int((tmp_path / "cc.pid").read_text()))


def test_stale_work_files_are_removed_and_fresh_ones_kept(tmp_path, monkeypatch, cache):
    cc, _ = fake_cc(tmp_path, BUILDS)
    kernels._open_folder()
    old = time.time() - kernels.BUILD_TIMEOUT_S - 60  # a build SIGKILLed a while ago
    stale_file, stale_dir = cache / ".qgemm-a1b2.tmp", cache / ".qgemm-c3d4.tmp"
    fresh = cache / ".qgemm-e5f6.tmp"  # another process's build, still running
    stale_dir.mkdir()
    (stale_dir / "ccXYZ.s").write_text("partial")
    for path in (stale_file, fresh):
        path.write_text("partial")
    for path in (stale_file, stale_dir):
        os.utime(path, (old, old))
    kernels._build(cc)
    assert not stale_file.exists() and not stale_dir.exists()
    assert fresh.exists()


# --- switches ----------------------------------------------------------------------------


def test_kernels_can_be_switched_off_and_are_not_built_on_windows(monkeypatch):
    monkeypatch.setenv("KVLM_NO_KERNELS", "1")
    assert kernels.library() is None and "KVLM_NO_KERNELS" in kernels.status()
    monkeypatch.delenv("KVLM_NO_KERNELS")
    kernels.library.cache_clear()
    monkeypatch.setattr(sys, "platform", "win32")
    assert kernels.library() is None and "Windows" in kernels.status()


# --- a first build says so, from every entry ---------------------------------------------

# waits (at most 30 s) for the file the test's log handler makes on the first progress line
WAITS_FOR = 'n=0; while [ ! -e "{go}" ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done\n'


def test_a_build_says_what_it_does_and_how_it_goes(tmp_path, monkeypatch, cache, caplog):
    """A line before (what, why, how long, where it is kept), a line while it runs, one at
    the end; nothing when the library is there already."""
    go = tmp_path / "go"
    cc, log = fake_cc(tmp_path, WAITS_FOR.format(go=go) + BUILDS)
    monkeypatch.setattr(kernels, "PROGRESS_S", 0.05)

    class Go(logging.Handler):  # the compiler finishes once a progress line was logged
        def emit(self, record: logging.LogRecord) -> None:
            if "still compiling" in record.getMessage():
                go.touch()

    handler = Go()
    logging.getLogger("kvlm.kernels").addHandler(handler)
    caplog.set_level(logging.WARNING, logger="kvlm.kernels")
    try:
        kernels._build(cc)
    finally:
        logging.getLogger("kvlm.kernels").removeHandler(handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvlm.kernels"]
    first = lines[0]
    assert first.startswith("compiling kvlm's C kernels for this CPU") and cc in first
    assert "s of CPU time" in first and f"Kept in {cache}" in first
    assert "KVLM_NO_KERNELS=1" in first
    assert any(line.startswith("still compiling the C kernels: ") for line in lines[1:-1])
    assert lines[-1].startswith("C kernels built in ") and len(builds(log)) == 1
    caplog.clear()
    kernels._build(cc)  # cached: loaded at once, nothing said
    assert [r for r in caplog.records if r.name == "kvlm.kernels"] == []


def test_the_notice_names_the_parallel_build(tmp_path):
    cc = kernels._compiler() or "cc"
    assert "in parallel on" in kernels.build_notice(cc, kernels.FLAGS + kernels.PARALLEL, tmp_path)
    assert "in parallel" not in kernels.build_notice(cc, kernels.FLAGS, tmp_path)


def test_gcc_with_make_builds_in_parallel():
    cc = kernels._compiler()
    if cc is None or not kernels._is_gcc(cc) or not shutil.which("make"):
        pytest.skip("needs gcc and make")
    assert kernels._flags(cc) == kernels.FLAGS + kernels.PARALLEL
    assert kernels._flags("false") == kernels.FLAGS  # not gcc: one job, as before


ENTRIES = {
    "kvlm generate": ["-m", "kvlm.cli", "generate", "hi", "--model", "{model}", "--no-chat",
                      "--max-new-tokens", "2", "--threads", "1"],
    "LLM()": ["-c", "from kvlm import LLM, SamplingParams; LLM(model='{model}', progress=False)"
              ".generate('hi', SamplingParams(max_tokens=2))"],
}  # fmt: skip


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_first_build_is_announced_on_stderr(tmp_path, tiny_model_dir, entry):
    """The real command and a script's LLM(), with a fresh cache: the line on stderr."""
    cc, log = fake_cc(tmp_path, BUILDS)  # its "library" will not load: the torch path runs
    args = [a.format(model=tiny_model_dir("llama")) for a in ENTRIES[entry]]
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "CC": cc, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "compiling kvlm's C kernels for this CPU" in proc.stderr
    assert "C kernels built in" in proc.stderr and len(builds(log)) == 1


def test_kvlm_serve_announces_the_first_build(tmp_path, tiny_model_dir, monkeypatch):
    """(The tiny fp32 model first needs the kernels in its first request's attention; a
    low-bit GGUF while it loads.)"""
    from serving import kvlm_serve, openai_client

    cc, log = fake_cc(tmp_path, BUILDS)
    monkeypatch.setenv("CC", cc)
    with kvlm_serve("--model", str(tiny_model_dir("llama")), "--threads", "1") as (port, proc):
        client = openai_client(port)
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
        out = proc.stdout.read().decode(errors="replace")
    assert "\nkvlm.kernels: compiling kvlm's C kernels for this CPU" in f"\n{out}"
    assert len(builds(log)) == 1
