"""fp32 one-row matmuls through numpy's OpenBLAS: the CPU decode kernel for fp32 weights.

Why not torch's: torch sends fp32 GEMM to MKL, whose one-row path runs on a single core
(and MKL takes slow code paths on AMD CPUs). OpenBLAS's sgemv spreads over every core and
reads weights near memory bandwidth. On this project's 2-core EPYC one decode row through
a 576x3072 weight took 373 us with MKL and 226 us with OpenBLAS, the 576x49152 lm_head
5.0 ms and 3.2 ms (benchmarks/bench_kernels.py; docs/BENCHMARKS.md).

The trap: two thread pools on the same cores fight. With torch's OpenMP threads and
OpenBLAS's pthreads both spinning, a decode step takes several times as long (the
"torch left at all threads" row of benchmarks/bench_kernels.py). So while a one-row step
runs, torch drops to one thread (its remaining ops are tiny at one row) and OpenBLAS owns
the cores; multi-row steps (prefill) keep torch's threads and MKL.

OpenBLAS's workers spin for about 0.1 s after a call (OPENBLAS_THREAD_TIMEOUT, 2^28
cycles), so a multi-row forward that starts right after a one-row one shares the cores
for that moment (the prefill rows of the same benchmark). Making them sleep at once
(OPENBLAS_THREAD_TIMEOUT=4) removes that but made every decode step slower in five
alternating runs of the same benchmark, so the default stays.

Used only where it wins: CPU, fp32, numpy linked against OpenBLAS. KVLM_CPU_BLAS=torch
turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch


@cache
def _openblas():
    """threadpoolctl's handle on numpy's OpenBLAS, or None when numpy uses another BLAS."""
    if os.environ.get("KVLM_CPU_BLAS", "auto").lower() == "torch":
        return None
    try:
        import numpy  # noqa: F401 - load numpy's BLAS so threadpoolctl can see it
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    pools = ThreadpoolController().select(internal_api="openblas")
    numpy_pools = [p for p in pools.lib_controllers if "numpy" in p.filepath]
    return numpy_pools[0] if numpy_pools else None


def openblas_available() -> bool:
    return _openblas() is not None


def set_blas_threads(n: int) -> None:
    """Keep OpenBLAS within the thread budget the user gave torch."""
    pool = _openblas()
    if pool is not None:
        pool.set_num_threads(n)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run a one-row step with torch on one thread, leaving the cores to OpenBLAS."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
