"""Low-bit weights in groups of 32 (llama.cpp's blocks), multiplied by kvlm's C kernels.

    q8:   int8 codes, one fp16 scale per group:      w = s * q          (Q8_0's numerics)
    q4:   4-bit codes, fp16 (d, m) per group:        w = d * q + m      (Q4_1)
    q4_0: 4-bit codes, fp16 d per group:             w = d * (q - 8)    (Q4_0)
    q5_0: 5-bit codes, fp16 d per group:             w = d * (q - 16)   (Q5_0)
    q5_1: 5-bit codes, fp16 (d, m) per group:        w = d * q + m      (Q5_1)
    q4_k, q5_k: 4/5-bit codes, super-blocks of 256: fp16 (d, dmin), 6-bit (sc, mn) per 32:
                                                     w = (d sc) q - dmin mn   (Q4_K, Q5_K)
    q6_k: 6-bit codes, fp16 d per 256, int8 sc per 16: w = (d sc) (q - 32)    (Q6_K)
    mxfp4: 4-bit E2M1 codes, an 8-bit exponent e per group: w = 2^(e - 128) kv[q]  (MXFP4)
           kv = MXFP4_VALUES (E2M1's values doubled), 2^(e - 128) = ggml's e8m0 half-scale
    q8_0_rows: Q8_0's blocks as the file stores them, row after row, not packed: read
           where they lie in the file's map (ROWS_KIND; a stack of experts), q8's numbers

A QuantWeight comes either from a float weight (`quantize(w, "q8" | "q4")`: `--weights
int8|int4`) or straight from a GGUF file's blocks (`--weights native`: the file's own
numbers, nothing re-rounded; `QuantWeight.from_blocks`), packed row-interleaved for the
kernels (`QuantWeight`, kernels/weights.c: kvlm_qpack packs, reading the blocks where they
lie) at the file's own bytes per weight, and moved onto huge pages with the rest of the
model's weights (`move_to_huge_pages`). Fused projections (q|k|v, gate|up) are packed into
one buffer (`concat`); where their parts come in different kinds (a Q4_K_M file's Q4_K q/k
and Q6_K v) they stay a weight of row parts, each in its own kind. Products keep fp32
activations: the C kernel widens the codes in registers (decode rows and the vocabulary
projection's, SMALL_M rows a call), or the weight is dequantized in tiles into a dense
matrix for a BLAS GEMM (a block's prompt rows, PROMPT_BLOCK rows a call: `row_blocks`).
`act_int8` (`--activations int8`) rounds each row of x to int8 per group of 32, as
llama.cpp does, for integer dot products (AVX512-VNNI); with `act_int16` (`--activations
int16`, the decode rows' default with VNNI) an int8 residual too, 16 bits a value, for a
second integer product of the same codes (`round_activations`). Without the
compiled kernels the same products run in torch (from the same packed bytes): the same
numbers, slower.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvlm import kernels

GROUP = 32
# Kinds built from ggml's blocks as a GGUF file stores them: (weights, bytes) per block.
GGML_KINDS = {
    "q4_0": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "mxfp4": (32, 17),
}
# Q8_0 kept as stored (ggml's block_q8_0 rows, 34 bytes a group, rows one after another):
# `data` is a view of the blocks (the file's map), never packed; the kernels pack each block
# of 16 rows into q8's records as they read it, so its products are q8's bit for bit.
ROWS_KIND = "q8_0_rows"
KINDS = ("q8", "q4", *GGML_KINDS, ROWS_KIND)
KIND_CODES = {"q8": 8, "q4": 4, "q4_0": 40, "q5_0": 50, "q5_1": 51, "q4_k": 104, "q5_k": 105,
              "q6_k": 106, "mxfp4": 39, ROWS_KIND: 80}  # fmt: skip
# MXFP4's nibble -> its E2M1 value doubled (gguf-py's MXFP4.kvalues, ggml's kvalues_mxfp4)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# The blocks from_blocks reads, per kind: the GGML_KINDS', and q8 from Q8_0 (f16 d, int8
# q[32]), q4 from Q4_1 (f16 d, f16 m, nibbles[16]).
BLOCK_FORMATS = {"q8": (32, 34), "q4": (32, 20), **GGML_KINDS, ROWS_KIND: (32, 34)}
PACK_WEIGHTS = 1 << 24  # weights per piece that the torch packer packs at a time
MIXED = "mixed"  # the kind of a weight of row parts of different kinds (`concat`)
FORMATS = {"int8": "q8", "int4": "q4"}  # --weights name -> kind
PACKED_FORMATS = ("native", *FORMATS)  # --weights values that make packed weights
# Rows per call of the C kernel (it reads the low-bit weight once a call; fp32 rows that
# are not a block's prompt rows take it at any row count, SMALL_M at a time).
SMALL_M = 16
# A block's prompt rows in fp32 or bf16 go through a dense GEMM in calls of exactly this many
# rows, the last padded with zero rows (`row_blocks`). oneDNN's and MKL's kernels pick
# their blocking by the call's shape (MKL's fp32 GEMM sums rows 1, 2, 3 and 5 in other
# orders than 8 or more; oneDNN's AMX tiles a 256-row call otherwise than a 64-row one), so
# a row's bits followed the rows beside it and a prefix hit or another chunk size gave
# other K/V. One shape for every call gives a row the same bits at any chunk size or
# start; and oneDNN builds one primitive for it, not one per row count. 128: on a Zen 4 a
# 64-row call ran the 1.7B shape's products 1.5x (fp32) and 1.2x (bf16) slower than one
# call of 512 rows, 128 1.25x and 1.0x (docs/BENCHMARKS.md 20.1); a shorter chunk computes
# 128 rows.
PROMPT_BLOCK = 128
# int8 activations: rows per kernel call (the kernel's int8 copy of them, ~1.1 bytes per
# element, is its scratch, kept per thread: bounded by this, not by the prompt's length).
PROMPT_ROWS = 512
# The dense GEMM's weight is dequantized in tiles of at most this many weights (16 MiB of
# fp32 scratch), not whole.
TILE_WEIGHTS = 1 << 22
# oneDNN's products (the bf16 prompt GEMM here, kvlm.model.layers.Linear's packed fp32 and
# bf16 weights) take their rows padded with zero rows (`onednn_rows`): oneDNN builds a
# primitive (JIT code, ~1 ms) for each shape it meets and keeps up to 1,024 of them, and a
# server whose prompt chunks had any row count from 1 to 256 grew ~50 MiB a minute under
# load (docs/BENCHMARKS.md 12.1). A multiple of ONEDNN_ROWS (an AMX tile's rows: no extra
# tile work) up to 16 * ONEDNN_ROWS, then of a 16th of the power of two below: 16 shapes
# an octave, at most 1/16 of the rows padding.
ONEDNN_ROWS = 16


def onednn_rows(m: int) -> int:
    """`m` rows padded for a oneDNN product (ONEDNN_ROWS)."""
    step = max(ONEDNN_ROWS, 1 << max(0, m.bit_length() - 5))
    return -(-m // step) * step


def row_blocks(
    x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], n: int,
    rows: int = PROMPT_BLOCK,
) -> torch.Tensor:  # fmt: skip
    """product(x) for x (M, K), computed `rows` rows a call (the last call's rows padded
    with zeros): every call has one shape, so each row's result is what it gets in any
    other call, whatever M and wherever the row sits (PROMPT_BLOCK). -> (M, n) fp32."""
    m = x.shape[0]
    if m % rows:
        x = F.pad(x, (0, 0, 0, rows - m % rows))
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for i in range(0, x.shape[0], rows):
        y[i : i + rows] = product(x[i : i + rows])
    return y[:m]


class QuantWeight:
    """A low-bit weight [N, K] in the kernels' packed layout (kernels/weights.c): blocks of 16
    rows, each row's 4 consecutive code bytes in one 32-bit lane, its parameters beside
    them. q8 and q4 are built from codes in their natural order:

        q8: codes int8 [N, K], scale [N, K/32]
        q4: codes uint8 [N, K/2] (byte j of a group: element j low, j + 16 high nibble),
            scale d and zero m [N, K/32]

    and every kind from a GGUF tensor's blocks (`from_blocks`: BLOCK_FORMATS; the
    GGML_KINDS only so). Scales are stored in fp16 (a GGUF file's own d and m are fp16:
    kept exactly; mxfp4's as the file's exponent byte). `unpacked()` gives the natural
    arrays back (the ggml blocks, for the GGML_KINDS). A weight of row parts of different
    kinds (`concat`) has kind MIXED: its parts are packed one after another in `data`, each
    in its own kind (`parts()`). Every packed buffer comes from `_new_data`."""

    __slots__ = ("_dense_rows", "_parts", "data", "in_features", "kind", "out_features")

    def __init__(
        self,
        kind: str,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None = None,
    ) -> None:
        if kind in GGML_KINDS or kind == ROWS_KIND:
            raise ValueError(f"{kind} weights are built from ggml blocks (QuantWeight.from_blocks)")
        if kind not in KINDS:
            raise ValueError(f"unknown quantized kind {kind!r}")
        if (kind == "q4") != (zero is not None):
            raise ValueError("q4 weights need a zero per group; q8 weights have none")
        # as the Q8_0 / Q4_1 blocks these arrays are, packed like a file's
        q = QuantWeight.from_blocks(kind, _natural_blocks(kind, codes, scale, zero))
        self.kind, self.out_features, self.in_features = kind, q.out_features, q.in_features
        self.data = q.data
        self._parts: tuple[tuple[str, int, int, int], ...] | None = None

    @classmethod
    def from_blocks(
        cls,
        kind: str,
        blocks: torch.Tensor | np.ndarray,
        order: torch.Tensor | None = None,
        reference: bool = False,
    ) -> QuantWeight:
        """A weight from its blocks as GGUF stores them: uint8 [N, K / weights_per_block *
        bytes_per_block] (BLOCK_FORMATS: ggml's block_q8_0, block_q4_1, block_q4_0,
        block_q5_0, block_q5_1, block_q4_K, block_q5_K, block_q6_K, block_mxfp4, row after
        row), a tensor
        or a numpy array (a view of the file's map: read where it lies, not copied).
        `order`: row i of the weight is row order[i] of the blocks (a permutation, applied
        as they are packed). `reference`: packed by the torch code (what the C packer is
        tested against; the path without the compiled kernels). ROWS_KIND: `blocks` itself
        (a view, not a copy; rows in order, contiguous)."""
        n, k = _block_shape(kind, blocks)
        if kind == ROWS_KIND:
            if order is not None:
                raise ValueError(f"{kind} weights are read in place: no row order")
            return cls._wrap(kind, n, k, _in_place(blocks))
        data = _new_data(packed_bytes(kind, n, k)).view(-(-n // BLOCK_ROWS), -1)
        _pack_blocks(kind, blocks, order, data, reference)
        return cls._wrap(kind, n, k, data)

    @classmethod
    def _wrap(
        cls,
        kind: str,
        n: int,
        k: int,
        data: torch.Tensor,
        parts: tuple[tuple[str, int, int, int], ...] | tuple[QuantWeight, ...] | None = None,
    ) -> QuantWeight:
        q = cls.__new__(cls)
        q.kind, q.out_features, q.in_features, q.data, q._parts = kind, n, k, data, parts
        return q

    def parts(self) -> list[QuantWeight]:
        """The row parts, each of one kind, top to bottom (views of `data`): [self] for a
        weight of one kind. A weight joined from weights in place (`concat` of ROWS_KIND
        parts): those weights."""
        if self._parts is None:
            return [self]
        if isinstance(self._parts[0], QuantWeight):
            return list(self._parts)  # type: ignore[arg-type]
        k = self.in_features
        return [
            QuantWeight._wrap(kind, n, k, self.data[a:b].view(-(-n // BLOCK_ROWS), -1))
            for kind, n, a, b in self._parts
        ]

    @property
    def in_place(self) -> bool:
        """Whether a part is read where it lies (ROWS_KIND: the file's map, not to move)."""
        return any(p.kind == ROWS_KIND for p in self.parts())

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes and parameters (with the rows padding a block)."""
        return sum(p.data.numel() for p in self.parts())

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(codes, scale, zero) in the natural order, scales as fp32 (q8, q4); (the ggml
        blocks [N, bytes], None, None) for the GGML_KINDS. A MIXED weight: unpack each of
        its parts()."""
        blocks = _blocks_of(self)
        if self.kind == ROWS_KIND:
            return _block_arrays("q8", blocks)
        return (blocks, None, None) if self.kind in GGML_KINDS else _block_arrays(self.kind, blocks)

    def dense(
        self, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The weight as [N, K] in fp32, or in bf16 rounded to nearest even as torch rounds
        (written into `out` when given)."""
        n, k = self.out_features, self.in_features
        lib = kernels.library()
        if lib is None:
            return _dense_torch(self).to(dtype)
        out = torch.empty(n, k, dtype=dtype) if out is None else out.view(n, k)
        row = 0
        for p in self.parts():
            _dequant(lib, p, p.data, out[row : row + p.out_features])
            row += p.out_features
        return out

    def _tiled(self, lib, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x @ W^T through dense tiles of at most TILE_WEIGHTS weights in `dtype` (fp32
        accumulation), PROMPT_BLOCK rows a product (`row_blocks`): the prefill's scratch
        stays bounded whatever the weight (a 128k vocabulary projection would otherwise be
        dequantized whole: 1 GiB in fp32), and a row's bits are its own at any row count.
        The tiles are fixed by the weight's shape."""
        m, k = x.shape
        xd = x.to(dtype)
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        col = 0
        for p in self.parts():
            u = _data_rows(p.kind)  # rows an entry of p.data holds; q8's tiles for ROWS_KIND
            per = max(1, TILE_WEIGHTS // (BLOCK_ROWS * k)) * BLOCK_ROWS // u  # entries a tile
            for b0 in range(0, p.data.shape[0], per):
                rows = min(p.out_features, (b0 + per) * u) - b0 * u
                w = _scratch(rows * k, dtype).view(rows, k)
                _dequant(lib, p, p.data[b0:], w)
                at = col + b0 * u
                y[:, at : at + rows] = row_blocks(xd, lambda xb, w=w: torch.matmul(xb, w.t()), rows)
            col += p.out_features
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (any shape, values in [0, N)) dequantized to fp32,
        (*ids.shape, K): an embedding lookup from a table kept in its stored format. Without
        the compiled kernels (or for a weight of mixed parts) the whole table is
        dequantized once and kept."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features})")  # every path
        lib = kernels.library()
        if lib is None or self.kind == MIXED:
            if getattr(self, "_dense_rows", None) is None:
                self._dense_rows = self.dense()
            return self._dense_rows[flat].view(*ids.shape, self.in_features)
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        if flat.numel():
            code, k, w = KIND_CODES[self.kind], self.in_features, self.data
            rc = lib.kvlm_qdequant_rows(code, k, w.data_ptr(), _nbytes(w), self.out_features,
                                        flat.data_ptr(), flat.numel(), out.data_ptr(),
                                        out.numel())  # fmt: skip
            if rc != 0:
                raise ValueError(f"the kernels refused {self.kind} rows of a [{self.out_features}, "
                                 f"{k}] weight in {_nbytes(w)} bytes")  # fmt: skip
        return out.view(*ids.shape, self.in_features)

    def matmul(
        self,
        x: torch.Tensor,
        prefill_bf16: bool = False,
        act_int8: bool = False,
        out: torch.Tensor | None = None,
        act_int16: bool = False,
        prompt: bool = False,
    ) -> torch.Tensor:
        """x (M, K) fp32, contiguous -> x @ W^T (M, N) fp32: into `out` (M, N) fp32,
        contiguous, where the kernels write the result themselves (use the returned tensor:
        the dense paths make their own).

        The caller says how its rows are multiplied (kvlm.model.layers.Linear decides it by
        their role, prompt rows or decode rows, never by how many share the call, so that a
        row's numbers do not depend on its batch or on how a prompt was chunked):
        `prefill_bf16`: in bf16 (inputs and weight rounded, fp32 accumulation, the result
        rounded to bf16; oneDNN with AVX512-BF16 runs it ~2x faster than fp32; its kernels
        differ by row count in the result's last bf16 bit), a trade of exactness for TTFT.
        `act_int8`: x rounded to int8 per group of 32 (`round_activations`), integer
        products in the kernel at any row count (VNNI: on AVX512-VNNI without AMX, as fast
        as oneDNN's bf16 GEMM and with no dequantized tiles), a trade of exactness for
        speed: decode rows, and prompt rows with --prefill-dtype int8. `act_int16` (with
        `act_int8`): x to 16 bits a value, int8 codes and an int8 residual
        (`round_activations(x, fine=True)`), two integer products of the same weight codes
        (--activations int16: decode rows near fp32's answers at integer speed). Neither:
        fp32 products, `prompt` (a block's prompt rows) a dense GEMM PROMPT_BLOCK rows a
        call, else (decode rows, the vocabulary projection's rows) the C kernel SMALL_M
        rows a call: each road gives a row its bits at any row count."""
        m, k = x.shape
        numel = self.out_features * self.in_features
        if x.dtype == torch.float64:  # the reference: the same weights, fp64 sums
            return torch.matmul(x, self.dense(_scratch(numel)).t().double())
        lib = kernels.library()
        if lib is None and prefill_bf16:
            w = self.dense(dtype=torch.bfloat16)
            return row_blocks(x.to(torch.bfloat16), lambda xb: torch.matmul(xb, w.t()).float(),
                              self.out_features)  # fmt: skip
        if lib is None:
            x = round_activations(x, act_int16) if act_int8 else x
            w = self.dense(_scratch(numel))
            rows = PROMPT_BLOCK if prompt and not act_int8 else SMALL_M
            return row_blocks(x, lambda xb: torch.matmul(xb, w.t()), self.out_features, rows)
        if prefill_bf16 or (prompt and not act_int8):
            return self._tiled(lib, x, torch.bfloat16 if prefill_bf16 else torch.float32)
        n = self.out_features
        y = torch.empty(m, n, dtype=torch.float32) if out is None else out
        if x.dtype != torch.float32 or not x.is_contiguous() or not y.is_contiguous():
            raise ValueError("the kernels take x and out as contiguous fp32")
        if y.dtype != torch.float32 or y.shape != (m, n):
            raise ValueError(f"out must be fp32 [{m}, {n}], not {y.dtype} {list(y.shape)}")
        step = PROMPT_ROWS if act_int8 else SMALL_M
        if m > step:  # bounded scratch (int8) or the C kernel's most rows (fp32): a row's
            for i in range(0, m, step):  # result is the same in any call
                part = y[i : i + step]
                self.matmul(x[i : i + step], act_int8=act_int8, out=part, act_int16=act_int16)
            return y
        col = 0
        for p in self.parts():  # each part's outputs: columns col .. of y (row stride n)
            # each buffer's length from the tensor itself: the kernel refuses (-2) a shape
            # its buffers are too short for
            args = (KIND_CODES[p.kind], x.data_ptr(), x.numel(), m, k, p.data.data_ptr(),
                    _nbytes(p.data), p.out_features, y.data_ptr() + 4 * col, y.numel() - col,
                    n)  # fmt: skip
            rc = lib.kvlm_qgemm_i8(*args, int(act_int16)) if act_int8 else lib.kvlm_qgemm(*args)
            if rc == -1:
                raise MemoryError("no scratch memory for a low-bit product")
            if rc != 0:
                raise ValueError(
                    f"the kernels refused a {p.kind} product of [{m}, {k}] rows by "
                    f"a [{p.out_features}, {k}] weight in {_nbytes(p.data)} bytes"
                )
            col += p.out_features
        return y


BLOCK_ROWS = 16  # rows per packed block: one per 32-bit lane of a 512-bit vector


def _data_rows(kind: str) -> int:
    """Rows of the weight an entry (first-axis index) of its `data` holds."""
    return 1 if kind == ROWS_KIND else BLOCK_ROWS


def _in_place(blocks: torch.Tensor | np.ndarray) -> torch.Tensor:
    """ROWS_KIND's data: the blocks as a tensor sharing their memory (a map's read-only
    view too: the kernels only read it), rows contiguous."""
    if isinstance(blocks, torch.Tensor):
        return blocks.contiguous()
    a = np.ascontiguousarray(blocks)
    with warnings.catch_warnings():  # read-only: torch warns that writes would fail
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a contiguous tensor: the length a kernel is given with its pointer."""
    if not t.is_contiguous():
        raise ValueError("the kernels take contiguous buffers")
    return t.numel() * t.element_size()


def _dequant(lib, q: QuantWeight, data: torch.Tensor, out: torch.Tensor) -> None:
    """The rows of `out` (fp32 or bf16 [rows, K], contiguous) of q's kind from its packed
    `data` (from the first of those rows' blocks on)."""
    code, bf16, rows = KIND_CODES[q.kind], out.dtype == torch.bfloat16, out.shape[0]
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the kernels dequantize into fp32 or bf16, not {out.dtype}")
    k, wn, on = q.in_features, _nbytes(data), _nbytes(out)
    if lib.kvlm_qdequant(code, bf16, k, data.data_ptr(), wn, rows, out.data_ptr(), on) != 0:
        raise ValueError(f"the kernels refused to dequantize {rows} {q.kind} rows of {k} from "
                         f"{wn} bytes into {on}")  # fmt: skip


def _new_data(nbytes: int) -> torch.Tensor:
    """A packed weight's buffer: uint8 [nbytes], contents undefined (the packer writes every
    byte). Every packed weight's data is allocated here: the next slice of the huge-page
    arena while one is open (`packing_on_huge_pages`), else ordinary memory."""
    got = _ARENAS[-1].take(nbytes) if _ARENAS and _ARENAS[-1] is not None else None
    return torch.empty(nbytes, dtype=torch.uint8) if got is None else got


class HugePageArena:
    """One huge-page buffer (kernels.huge_page_buffer) handed out front to back, each slice
    from a 64-byte boundary. Reserved whole, resident only as far as it is written: the
    anonymous map's untouched pages cost address space, not memory. The pages ahead of the
    slices handed out are faulted in by every thread at once (kvlm_prefault): a slice's
    own, and as many bytes again ahead (at most PREFAULT_BYTES), so at most one slice's
    worth past the last one is resident unused. A slice's first touch in a pack (one 2 MiB
    page zeroed at ~1 GB/s on one thread while the other waited) was most of a mixture of
    experts' load (BENCHMARKS 25.4)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.used = 0
        self.faulted = 0  # bytes from the start whose pages are in

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // 64) * 64
        if start + nbytes > self.buffer.numel():
            return None  # full: the caller's weight goes to ordinary memory
        self.used = start + nbytes
        if self.used > self.faulted:  # this slice's pages, and as many again ahead
            self._fault_to(self.used + min(nbytes, PREFAULT_BYTES))
        return self.buffer[start : start + nbytes]

    def trim(self) -> None:
        """Give back the pages faulted in ahead that no slice took (whole pages past the
        last slice's: zeros, never written), once the packing is over."""
        page = kernels.HUGE_PAGE
        start = -(-self.used // page) * page
        if self.faulted > start:
            _release_pages(self.buffer.data_ptr() + start, self.faulted - start)
            self.faulted = start

    def _fault_to(self, end: int) -> None:
        lib, page = kernels.library(), kernels.HUGE_PAGE
        upto = min(self.buffer.numel(), -(-end // page) * page)
        if lib is not None and upto > self.faulted:
            lib.kvlm_prefault(self.buffer.data_ptr() + self.faulted, upto - self.faulted, page)
        self.faulted = max(self.faulted, upto)

    def holds(self, t: torch.Tensor) -> bool:
        base = self.buffer.data_ptr()
        return base <= t.data_ptr() < base + self.buffer.numel()


_ARENAS: list[HugePageArena | None] = []
PREFAULT_BYTES = 16 << 20  # the most of the arena's pages faulted in ahead of its slices


def packing_on_huge_pages(capacity: int) -> AbstractContextManager[HugePageArena | None]:
    """While open, weights are packed straight into one huge-page buffer of up to
    `capacity` bytes, in the order they are made (a model's load order is a decode step's
    read order): no second copy of the model to move them there afterwards, so the load's
    peak is the model, and no copy time. Yields None (ordinary memory) where the OS offers
    no huge pages. `outside_arena()` opens a gap for temporaries."""
    buffer = kernels.huge_page_buffer(capacity)
    return _packing_into(None if buffer is None else HugePageArena(buffer))


def outside_arena() -> AbstractContextManager[None]:
    """Weights made in here (a part to be copied into a fused weight) use ordinary memory,
    so the arena holds no dead copies."""
    return _packing_into(None)


@contextmanager
def _packing_into(arena: HugePageArena | None) -> Iterator[HugePageArena | None]:
    """Weights made within are packed into `arena` (None: ordinary memory)."""
    _ARENAS.append(arena)
    try:
        yield arena
    finally:
        _ARENAS.pop()
        if arena is not None:
            arena.trim()


def packed_bytes(kind: str, n: int, k: int) -> int:
    """Bytes of a packed [n, k] weight of `kind`: per block of 16 rows, 16 of the file's
    rows (rows past n padded); ROWS_KIND's n rows as stored."""
    per, size = BLOCK_FORMATS[kind]
    return -(-n // _data_rows(kind)) * _data_rows(kind) * (k // per * size)


@dataclass(slots=True)
class Blocks:
    """A weight's blocks as a GGUF file stores them, not yet packed (`from_blocks` reads
    them; `concat` packs several into one buffer): `raw` uint8 [N, bytes] (a numpy view of
    the file's map, or a tensor), row i of the weight being raw row order[i] (None: row
    i)."""

    kind: str
    raw: torch.Tensor | np.ndarray
    order: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return _block_shape(self.kind, self.raw)[0]

    @property
    def in_features(self) -> int:
        return _block_shape(self.kind, self.raw)[1]

    def pack(self) -> QuantWeight:
        return QuantWeight.from_blocks(self.kind, self.raw, self.order)

    def rows(self) -> torch.Tensor:
        """The blocks as a tensor [N, bytes] in the weight's row order (a copy)."""
        raw = _as_tensor(self.raw)
        return raw.clone() if self.order is None else raw[self.order]


def _block_shape(kind: str, blocks: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """(N, K) of a weight's blocks; ValueError for blocks of the wrong shape or type."""
    if kind not in BLOCK_FORMATS:
        raise ValueError(f"{kind!r} is not built from ggml blocks")
    per, size = BLOCK_FORMATS[kind]
    uint8 = blocks.dtype in (torch.uint8, np.uint8)
    if blocks.ndim != 2 or not uint8 or blocks.shape[1] % size or not blocks.shape[1]:
        raise ValueError(f"{kind} blocks must be uint8 [rows, a multiple of {size} bytes]")
    return int(blocks.shape[0]), blocks.shape[1] // size * per


def _as_tensor(blocks: torch.Tensor | np.ndarray) -> torch.Tensor:
    # a numpy array copied: a map's view is read-only
    return blocks if isinstance(blocks, torch.Tensor) else torch.from_numpy(np.array(blocks))


def _pack_blocks(
    kind: str,
    blocks: torch.Tensor | np.ndarray,
    order: torch.Tensor | None,
    out: torch.Tensor,
    reference: bool = False,
) -> None:
    """Pack `blocks` (rows in `order`) into `out`, a contiguous uint8 buffer of exactly
    packed_bytes(kind, N, K): the C packer (kvlm_qpack), or the torch code (`reference`,
    or without the kernels), byte for byte the same."""
    n, k = _block_shape(kind, blocks)
    size = packed_bytes(kind, n, k)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != size:
        raise ValueError(f"a {kind} [{n}, {k}] weight packs into {size} contiguous bytes")
    if order is not None:
        order = order.to(torch.int64).contiguous()
        if order.shape != (n,):
            raise ValueError(f"the row order of {n} rows must have {n} entries")
    lib = None if reference else kernels.library()
    if lib is not None:
        mapped = isinstance(blocks, np.ndarray) and _file_backed(blocks)
        tensor = isinstance(blocks, torch.Tensor)
        blocks = blocks.contiguous() if tensor else np.ascontiguousarray(blocks)
        src = blocks.data_ptr() if tensor else blocks.ctypes.data
        at = None if order is None else order.data_ptr()
        # A big table read from the file's map (the vocabulary: 248 MiB at Q8_0 x 151,936
        # x 1,536) is packed in pieces, each piece's file pages given back once packed:
        # the file and the packed table were both resident, a peak of the table's size.
        row_bytes = blocks.shape[1]
        src_bytes = _nbytes(blocks) if tensor else blocks.nbytes  # of the array itself
        step = n if not mapped or order is not None else _rows_per_piece(row_bytes)
        per_block = packed_bytes(kind, BLOCK_ROWS, k)
        for a in range(0, n, step):
            rows, skip = min(step, n - a), a // BLOCK_ROWS * per_block
            sn, dn = src_bytes - a * row_bytes, out.numel() - skip  # out: uint8, contiguous
            rc = lib.kvlm_qpack(KIND_CODES[kind], src + a * row_bytes, sn, rows, k, at,
                                out.data_ptr() + skip, dn)  # fmt: skip
            if rc != 0:
                raise ValueError(
                    f"the kernels refused to pack {rows} rows of {k} {kind} weights from {sn} "
                    f"bytes into {dn} (a bad row order?)"
                )
            if step < n:
                _release_pages(src + a * row_bytes, rows * row_bytes)
        return
    raw = _as_tensor(blocks)
    if order is not None:
        if n and (int(order.min()) < 0 or int(order.max()) >= n):
            raise ValueError("a row order entry is out of range")
        raw = raw[order]
    # in pieces of whole blocks of 16 rows, each packed alone: the temporaries stay a few
    # bytes per weight of a piece, not of a vocabulary matrix
    step = max(BLOCK_ROWS, PACK_WEIGHTS // k // BLOCK_ROWS * BLOCK_ROWS)
    dst = out.view(-(-n // BLOCK_ROWS), -1)
    for a in range(0, n, step):
        rows = raw[a : a + step].contiguous()
        dst[a // BLOCK_ROWS : -(-(a + rows.shape[0]) // BLOCK_ROWS)] = _pack_torch(kind, rows)


RELEASE_PIECE = 32 << 20  # bytes of a mapped table packed before its pages are given back


def _rows_per_piece(row_bytes: int) -> int:
    """Whole blocks of 16 rows per piece, about RELEASE_PIECE bytes of the file."""
    return max(BLOCK_ROWS, RELEASE_PIECE // max(1, row_bytes) // BLOCK_ROWS * BLOCK_ROWS)


def _file_backed(a: np.ndarray) -> bool:
    """Whether `a` is a view of a file's map (mmap.mmap at the end of its bases): its pages
    can be dropped and read again from the file. Never anonymous memory, which
    MADV_DONTNEED would zero."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap)


def _release_pages(addr: int, nbytes: int) -> None:
    """MADV_DONTNEED the whole pages inside [addr, addr + nbytes) of a file's map (a later
    read faults them in again from the file), or of anonymous memory that holds nothing
    (a later touch gets zeros). Best effort: nothing where the OS or libc has no madvise."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    libc = _libc()
    if advice is None or libc is None:
        return
    page = mmap.PAGESIZE
    start, end = -(-addr // page) * page, (addr + nbytes) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise  # noqa: B018 - present
    except (OSError, AttributeError):
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _pack_torch(kind: str, rows: torch.Tensor) -> torch.Tensor:
    """Blocks [N, bytes] -> the packed layout [blocks, bytes], in torch (the reference)."""
    n, k = _block_shape(kind, rows)
    return _pack_fields(kind, _ggml_fields(kind, rows), n, k)


def _block_arrays(
    kind: str, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scale, zero) in the natural order of Q8_0 (q8) or Q4_1 (q4) blocks: nibble j
    holds weights j (low) and j + 16 (high), the order QuantWeight takes."""
    _, size = BLOCK_FORMATS[kind]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, size)
    d = _f16(b[..., 0:2])
    if kind == "q8":
        return b[..., 2:].contiguous().view(torch.int8).reshape(n, -1), d, None
    return b[..., 4:].reshape(n, -1), d, _f16(b[..., 2:4])


def _natural_blocks(
    kind: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    """The inverse of _block_arrays: natural arrays as Q8_0 (q8) or Q4_1 (q4) blocks, the
    scales rounded to fp16."""
    n, groups = scale.shape
    width = GROUP if kind == "q8" else GROUP // 2
    c = codes.contiguous().view(torch.uint8).reshape(n, groups, width)
    params = [_f16_bytes(t) for t in ((scale,) if zero is None else (scale, zero))]
    return torch.cat([*params, c], -1).reshape(n, -1)


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp32 [...] rounded to fp16, as its little-endian bytes [..., 2] (the inverse of
    _f16)."""
    h = t.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack((h & 255, h >> 8), -1).to(torch.uint8)


# ---- every kind's blocks (BLOCK_FORMATS) <-> fields <-> the packed layout ----
#
# Fields: "codes" uint8 [N, K], each weight's code (0 .. 2^bits - 1; q8: the int8 code's
# byte; mxfp4: the nibble, not its value) in column order, and the parameters as stored,
# bytes per row and block: "d" [N, U, 2] (fp16), "m" (q4, q5_1) and "dmin" (q4_k, q5_k)
# [N, U, 2], "scales" [N, U, 12] (q4_k, q5_k: ggml's packed 6-bit scales and mins) or
# [N, U, 16] (q6_k: int8 per 16), "e" [N, U, 1] (mxfp4's exponent byte), U = blocks per
# row.

# code bits above the low nibble (q8: a whole byte per code, 512 code bytes a record)
_HIGH_BITS = {"q8": 4, "q4": 0, "q4_0": 0, "q5_0": 1, "q5_1": 1, "q5_k": 1, "q6_k": 2, "q4_k": 0,
              "mxfp4": 0}  # fmt: skip
# a record per group of 32 (no super-blocks): its parameters, in order
_PER_GROUP = {"q8": ("d",), "q4": ("d", "m"), "q4_0": ("d",), "q5_0": ("d",), "q5_1": ("d", "m"),
              "mxfp4": ("e",)}  # fmt: skip
# bytes of a per-group parameter (fp16, but mxfp4's exponent byte)
_PARAM_BYTES = {"d": 2, "m": 2, "e": 1}
_K4_HEAD = (("scales", 12, 4), ("d", 2, 2), ("dmin", 2, 2))  # the packed scales: 3 vectors
# the parameters of a packed record, in order: (field, bytes per row, lane width)
_PACKED_PARAMS = {
    **{
        kind: tuple((p, _PARAM_BYTES[p], _PARAM_BYTES[p]) for p in params)
        for kind, params in _PER_GROUP.items()
    },
    "q4_k": _K4_HEAD,
    "q5_k": _K4_HEAD,
    "q6_k": (("d", 2, 2), ("scales", 16, 1)),  # d [16], sc [16 sub-blocks][16 rows]
}


def _u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _ggml_fields(kind: str, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """ggml's blocks [N, U * size] -> fields (gguf-py's quants.py reads them the same way)."""
    per, size = BLOCK_FORMATS[kind]
    n = blocks.shape[0]
    b = blocks.view(n, -1, size)
    u = b.shape[1]
    if kind in _PER_GROUP:  # d (mxfp4: e), (m), (qh: bit j = weight j's fifth), qs: j, j + 16
        f, at = {}, 0
        for p in _PER_GROUP[kind]:
            f[p], at = b[..., at : at + _PARAM_BYTES[p]], at + _PARAM_BYTES[p]
        qh = 4 if _HIGH_BITS[kind] == 1 else 0  # bytes of fifth bits
        at += qh
        qs = b[..., at:]
        codes = qs if kind == "q8" else torch.cat((qs & 15, qs >> 4), -1)  # q8: bytes
        if qh:
            high = (b[..., at - 4 : at, None] >> _u8(range(8))) & 1  # (n, u, 4 bytes, 8 bits)
            codes = codes | (high.reshape(n, u, 32) << 4)
    elif kind in ("q4_k", "q5_k"):  # d, dmin, scales[12], (qh[32]), qs[128]
        f = {"d": b[..., 0:2], "dmin": b[..., 2:4], "scales": b[..., 4:16]}
        qs = b[..., -128:].reshape(n, u, 4, 1, 32)  # sub-block 2c: low nibbles, 2c + 1: high
        codes = ((qs >> _u8([0, 4]).view(2, 1)) & 15).reshape(n, u, 8, 32)
        if kind == "q5_k":  # qh[e] bit s: element e of sub-block s
            codes = codes | (((b[..., 16:48, None] >> _u8(range(8))) & 1).transpose(-1, -2) << 4)
    else:  # q6_k: ql[128], qh[64], scales[16], d
        f = {"scales": b[..., 192:208], "d": b[..., 208:210]}
        ql = b[..., :128].reshape(n, u, 2, 1, 64) >> _u8([0, 4]).view(2, 1)  # (.., 2, 2, 64)
        ql = (ql & 15).reshape(n, u, 2, 4, 32)  # per half of 128: groups k = 0..3
        qh = (b[..., 128:192].reshape(n, u, 2, 1, 32) >> _u8([0, 2, 4, 6]).view(4, 1)) & 3
        codes = ql | (qh << 4)
    f = {k: v.contiguous() for k, v in f.items()}
    f["codes"] = codes.reshape(n, u * per).contiguous()
    return f


def _or_bits(bits: torch.Tensor, dim: int, shifts: list[int]) -> torch.Tensor:
    """OR of bits.select(dim, i) << shifts[i] over i (small fields packed into bytes),
    uint8 throughout."""
    out = torch.zeros_like(bits.select(dim, 0))
    for i, shift in enumerate(shifts):
        out |= bits.select(dim, i) << shift
    return out


def _ggml_blocks(kind: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Fields -> ggml's blocks [N, U * size] (the inverse of _ggml_fields)."""
    per, _ = BLOCK_FORMATS[kind]
    n = f["codes"].shape[0]
    c = f["codes"].view(n, -1, per)
    u = c.shape[1]
    if kind in _PER_GROUP:
        pieces = [f[p] for p in _PER_GROUP[kind]]
        if _HIGH_BITS[kind] == 1:
            pieces.append(_or_bits((c >> 4).view(n, u, 4, 8), -1, list(range(8))))
        pieces.append(c if kind == "q8" else (c[..., :16] & 15) | ((c[..., 16:] & 15) << 4))
    elif kind in ("q4_k", "q5_k"):
        c8 = c.view(n, u, 4, 2, 32)
        qs = ((c8[..., 0, :] & 15) | ((c8[..., 1, :] & 15) << 4)).reshape(n, u, 128)
        pieces = [f["d"], f["dmin"], f["scales"], qs]
        if kind == "q5_k":  # qh[e] bit s = sub-block s's element e
            pieces.insert(3, _or_bits(c.view(n, u, 8, 32) >> 4, 2, list(range(8))))
    else:
        c6 = c.view(n, u, 2, 4, 32)
        lo = c6 & 15
        ql = torch.stack(
            (lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)), 3
        )
        qh = _or_bits(c6 >> 4, 3, [0, 2, 4, 6])
        pieces = [ql.reshape(n, u, 128), qh.reshape(n, u, 64), f["scales"], f["d"]]
    return torch.cat([p.reshape(n, u, -1) for p in pieces], -1).reshape(n, -1)


def _lanes(t: torch.Tensor, width: int) -> torch.Tensor:
    """[N, U, W] bytes per row and unit -> [blocks, U, W * 16]: per block of 16 rows and
    unit, W / width vectors, lane i of each = row i's `width` bytes (rows padded with 0)."""
    n, u, w = t.shape
    blocks = -(-n // BLOCK_ROWS)
    t = F.pad(t, (0, 0, 0, 0, 0, blocks * BLOCK_ROWS - n))
    t = t.view(blocks, BLOCK_ROWS, u, w // width, width).permute(0, 2, 3, 1, 4)
    return t.reshape(blocks, u, w * BLOCK_ROWS)


def _unlanes(p: torch.Tensor, n: int, w: int, width: int) -> torch.Tensor:
    """The inverse of _lanes: [blocks, U, W * 16] -> [N, U, W]."""
    blocks, u, _ = p.shape
    t = p.reshape(blocks, u, w // width, BLOCK_ROWS, width).permute(0, 3, 1, 2, 4)
    return t.reshape(blocks * BLOCK_ROWS, u, w)[:n].contiguous()


def _code_layout(kind: str, codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> [blocks, K / 32, code bytes] (kernels/weights.c: codes [CB])."""
    n, k = codes.shape
    c = codes.view(n, k // GROUP, GROUP)
    if kind == "q8":  # the code bytes themselves
        return _lanes(c, 4)
    pieces = [_lanes((c[..., :16] & 15) | ((c[..., 16:] & 15) << 4), 4)]  # nibbles
    high = (c >> 4).view(n, k // GROUP, 2, 4, 4)  # element 16h + 4v + j: (h, v, j)
    if _HIGH_BITS[kind] == 1:  # byte j, bit 2v + h
        hb = _or_bits(high.reshape(n, k // GROUP, 8, 4), 2, [0, 2, 4, 6, 1, 3, 5, 7])
        pieces.append(_lanes(hb, 4))
    elif _HIGH_BITS[kind] == 2:  # word h, byte j, bits 2v, 2v + 1
        hb = _or_bits(high, 3, [0, 2, 4, 6])  # (n, G, h, j)
        pieces.append(_lanes(hb.reshape(n, k // GROUP, 8), 4))
    return torch.cat(pieces, -1)


def _code_fields(kind: str, p: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of _code_layout: [blocks, K / 32, code bytes] -> codes [N, K]."""
    groups = p.shape[1]
    if kind == "q8":
        return _unlanes(p, n, GROUP, 4).reshape(n, groups * GROUP)
    nib = _unlanes(p[..., :256], n, 16, 4)
    codes = torch.cat((nib & 15, nib >> 4), -1)  # (n, G, 32)
    if _HIGH_BITS[kind] == 1:
        hb = _unlanes(p[..., 256:320], n, 4, 4)  # (n, G, j)
        shift = _u8([[0, 1], [2, 3], [4, 5], [6, 7]]).view(4, 2, 1)  # (v, h, 1)
        bits = (hb[:, :, None, None, :] >> shift) & 1  # (n, G, v, h, j)
        codes |= bits.permute(0, 1, 3, 2, 4).reshape(n, groups, 32) << 4
    elif _HIGH_BITS[kind] == 2:
        hb = _unlanes(p[..., 256:384], n, 8, 4).view(n, groups, 2, 1, 4)  # (n, G, h, 1, j)
        bits = (hb >> _u8([0, 2, 4, 6]).view(4, 1)) & 3  # (n, G, h, v, j)
        codes |= bits.reshape(n, groups, 32) << 4
    return codes.reshape(n, groups * GROUP)


def _pack_fields(kind: str, f: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """Fields -> the packed layout [blocks, records * record bytes] (kernels/weights.c)."""
    codes = _code_layout(kind, f["codes"])  # [blocks, G, code bytes]
    blocks = codes.shape[0]
    params = [_lanes(f[p], width) for p, _, width in _PACKED_PARAMS[kind]]
    if kind in _PER_GROUP:  # a record per group: codes, d [16], (m [16])
        return torch.cat([codes, *params], -1).reshape(blocks, -1)
    # a record per super-block: its parameters (the header), then its codes
    return torch.cat([*params, codes.reshape(blocks, k // 256, -1)], -1).reshape(blocks, -1)


def _unpack_fields(kind: str, data: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
    """The inverse of _pack_fields."""
    blocks, groups = data.shape[0], k // GROUP
    code_bytes = 256 + 64 * _HIGH_BITS[kind]
    per_group = kind in _PER_GROUP
    rec = data.view(blocks, groups if per_group else k // 256, -1)
    at, f = code_bytes if per_group else 0, {}
    for p, w, width in _PACKED_PARAMS[kind]:
        f[p] = _unlanes(rec[..., at : at + BLOCK_ROWS * w], n, w, width)
        at += BLOCK_ROWS * w
    codes = rec[..., :code_bytes] if per_group else rec[..., at:].reshape(blocks, groups, -1)
    f["codes"] = _code_fields(kind, codes, n)
    return f


def _f16(b: torch.Tensor) -> torch.Tensor:
    """fp16 stored as byte pairs [..., 2] -> fp32 [...], exactly."""
    return b.contiguous().view(torch.float16)[..., 0].float()


_MXFP4 = torch.tensor(MXFP4_VALUES, dtype=torch.float32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """Exponent bytes -> fp32 2^(e - 128), exactly as ggml's e8m0_to_fp32_half makes its
    bits: 0x00200000 << e for e < 2 (subnormals), else (e - 1) << 23."""
    e = e.to(torch.int32)
    small = torch.full_like(e, 0x00200000) << e.clamp(max=2)
    return torch.where(e < 2, small, (e - 1).clamp(min=0) << 23).view(torch.float32)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's 12 packed bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and mins."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 0x30)), -1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 0x30)), -1)
    return sc, mn


def _dense_fields(kind: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] in fp32, in gguf-py's order of operations (so, bit for bit)."""
    per, _ = BLOCK_FORMATS[kind]
    n, k = f["codes"].shape
    q = f["codes"].view(n, k // per, -1, 16 if kind == "q6_k" else 32)
    if kind == "mxfp4":  # the exponent's half-scale times the nibble's value
        return (_e8m0_half(f["e"][..., 0])[..., None, None] * _MXFP4[q.long()]).reshape(n, k)
    d = _f16(f["d"])[..., None, None]
    if kind == "q8":
        w = d * q.view(torch.int8).float()
    elif kind in ("q4_0", "q5_0"):
        w = d * (q.to(torch.int16) - (8 if kind == "q4_0" else 16)).float()
    elif kind in ("q4", "q5_1"):
        w = d * q.float() + _f16(f["m"])[..., None, None]
    elif kind == "q6_k":  # (d sc) per 16, times q - 32
        sc = f["scales"].view(torch.int8).float()
        w = (d[..., 0] * sc)[..., None] * (q.to(torch.int16) - 32).float()
    else:  # (d sc) q - dmin mn per sub-block of 32
        sc, mn = _scale_min_k4(f["scales"])
        scale = (d[..., 0] * sc.float())[..., None]
        w = scale * q.float() - (_f16(f["dmin"])[..., None] * mn.float())[..., None]
    return w.reshape(n, k)


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One reused buffer per dtype for the weight being multiplied densely (prefill): a
    fresh 7 MiB tensor per product would be page-faulted and zeroed by the OS every time."""
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _dense_torch(q: QuantWeight) -> torch.Tensor:
    if q._parts is not None:
        return torch.cat([_dense_torch(p) for p in q.parts()])
    if q.kind == ROWS_KIND:  # s q, exact in fp32
        codes, scale, _ = _block_arrays("q8", q.data)
        return codes.float() * scale.repeat_interleave(GROUP, dim=1)
    return _dense_fields(q.kind, _unpack_fields(q.kind, q.data, q.out_features, q.in_features))


def round_activations(x: torch.Tensor, fine: bool = False) -> torch.Tensor:
    """x (M, K) as the int8-activation kernels see it: per group of 32, e = max|x| / 127
    and x -> e * round(x / e) (nearest even), in fp32. `fine` (int16 activations): plus the
    residual to 1/256 of e, x -> e * (c + r / 256) with c = round(y), y = x / e, and r =
    round(256 (y - c)) at most 127 (kernels/weights.c kvlm_actrow; in fp64, where every such
    value is exact)."""
    m, k = x.shape
    g = x.reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    # a true division, as the kernels' 127 / amax (a Python number over a tensor is a
    # reciprocal times 127 in torch: an ulp apart at times)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    y = g * inv
    c = torch.round(y)
    if not fine:
        return (c * (amax / 127.0)).reshape(m, k)
    r = torch.round((y - c) * 256.0).clamp(max=127.0)
    return ((c.double() + r.double() / 256.0) * (amax / 127.0).double()).float().reshape(m, k)


def can_quantize(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def quantize(weight: torch.Tensor, kind: str) -> QuantWeight:
    """Round a float weight [N, K] (K a multiple of 32) to `kind`, per group of 32.

    q8: symmetric, s = max|w| / 127. q4: asymmetric over [min, max], d = (max - min) / 15,
    m = min (llama.cpp's Q4_1 rule). Scales are rounded to fp16 (as GGUF stores them) before
    the codes are chosen, so each weight is within half a step of its grid. Re-quantizing a
    Q4_1 file's dequantized weights this way recovers its blocks: each block's min and max
    are its codes 0 and 15.
    """
    if not can_quantize(weight):
        raise ValueError(f"weight {tuple(weight.shape)}: in_features must be a multiple of {GROUP}")
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if kind == "q8":
        scale = (g.abs().amax(dim=-1) / 127.0).half().float()  # on fp16's grid, as stored
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantWeight("q8", codes.reshape(n, k), scale)
    if kind == "q4":
        lo = g.amin(dim=-1).half().float()
        d = ((g.amax(dim=-1) - lo) / 15.0).half().float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.round((g - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
        return QuantWeight("q4", packed.reshape(n, k // 2), d, lo)
    raise ValueError(f"unknown quantized kind {kind!r}")


def move_to_huge_pages(
    weights: Sequence[QuantWeight], moved: Callable[[QuantWeight], None] | None = None
) -> bool:
    """Move the packed weights, in the order given (a decode step's read order), into one
    buffer on transparent huge pages (kernels.huge_page_buffer): the kernels stream them
    with a page walk per 2 MiB instead of per 4 KiB. False (nothing moved) where the OS
    offers no huge pages. `moved(w)` runs after each weight's move: the caller drops its
    other references to the old storage there, so it is freed weight by weight and the
    peak stays one weight above the model, not two models."""
    # each weight from a 64-byte boundary, as HugePageArena hands them out
    buffer = kernels.huge_page_buffer(sum(-(-w.data.numel() // 64) * 64 for w in weights))
    if buffer is None:
        return False
    arena = HugePageArena(buffer)
    for w in weights:
        view = arena.take(w.data.numel()).view(w.data.shape)
        view.copy_(w.data)
        w.data = view
        if moved is not None:
            moved(w)
    return True


def concat(parts: Sequence[QuantWeight | Blocks]) -> QuantWeight:
    """Stack weights along their outputs (fused q|k|v, gate|up), packed into one buffer:
    packed weights (QuantWeight) or blocks not yet packed (Blocks, packed straight into
    their place). Neighbours of one kind become one packed weight: their packed bytes one
    after another, as a block of 16 rows holds 16 whole rows, wherever every part but the
    last fills its blocks (out_features a multiple of 16; else their rows are packed
    anew). Where kinds differ (a Q4_K_M file's Q4_K q and k, Q6_K v) the result is a MIXED
    weight of those row parts, each packed in its own kind from a 64-byte boundary, so
    every part keeps the file's numbers."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("cannot fuse weights of different widths")
    k = parts[0].in_features
    flat = [one for p in parts for one in (p.parts() if isinstance(p, QuantWeight) else [p])]
    if len(flat) == 1 and isinstance(flat[0], QuantWeight):
        return flat[0]
    if any(p.kind == ROWS_KIND for p in flat):
        return _joined([p.pack() if isinstance(p, Blocks) else p for p in flat], k)
    runs = [list(run) for _, run in itertools.groupby(flat, key=lambda p: p.kind)]
    spec, at = [], 0
    for run in runs:  # each run's bytes from a 64-byte boundary
        n = sum(p.out_features for p in run)
        size = packed_bytes(run[0].kind, n, k)
        spec.append((run[0].kind, n, at, at + size))
        at += size if len(runs) == 1 else -(-size // 64) * 64
    data = _new_data(at)
    for run, (kind, n, a, b) in zip(runs, spec, strict=True):
        _fill(kind, run, data[a:b].view(-(-n // BLOCK_ROWS), -1))
        data[b : -(-b // 64) * 64].zero_()  # the padding to the next part (none after one run)
    if len(runs) == 1:
        kind, n, _, _ = spec[0]
        return QuantWeight._wrap(kind, n, k, data.view(-(-n // BLOCK_ROWS), -1))
    n = sum(n for _, n, _, _ in spec)
    return QuantWeight._wrap(MIXED, n, k, data, tuple(spec))


def _joined(parts: list[QuantWeight], k: int) -> QuantWeight:
    """Parts stacked along their outputs without a copy (ROWS_KIND's stay in place): a
    MIXED weight of those weights, each its own buffer; at most QMAT_PARTS (abi.h)."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) > 3:
        raise ValueError(f"{len(parts)} parts: a weight joined in place takes at most 3")
    n = sum(p.out_features for p in parts)
    return QuantWeight._wrap(MIXED, n, k, parts[0].data, tuple(parts))


def _fill(kind: str, run: Sequence[QuantWeight | Blocks], out: torch.Tensor) -> None:
    """Pack parts of one kind, stacked, into `out` [blocks, bytes]."""
    if all(p.out_features % BLOCK_ROWS == 0 for p in run[:-1]):
        row = 0  # each part's blocks: its own packed bytes, in place
        for p in run:
            b0, b1 = row // BLOCK_ROWS, -(-(row + p.out_features) // BLOCK_ROWS)
            if isinstance(p, Blocks):
                _pack_blocks(kind, p.raw, p.order, out[b0:b1])
            else:
                out[b0:b1] = p.data.view(b1 - b0, -1)
            row += p.out_features
        return
    # a part ends inside a block of 16: the rows are packed anew from their blocks
    _pack_blocks(kind, torch.cat([_blocks_of(p) for p in run]), None, out)


def _blocks_of(p: QuantWeight | Blocks) -> torch.Tensor:
    """A weight's blocks as stored ([N, bytes], rows in order): Q8_0 / Q4_1 for q8 / q4."""
    if isinstance(p, Blocks):
        return p.rows()
    if p.kind == ROWS_KIND:
        return p.data
    if p._parts is not None:
        raise ValueError("a weight of parts of different kinds: unpack each of parts()")
    return _ggml_blocks(p.kind, _unpack_fields(p.kind, p.data, p.out_features, p.in_features))
