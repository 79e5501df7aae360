"""kvlm's own reader of a GGUF file's header: metadata, tensor infos, and views of the data.

gguf-py's `GGUFReader` makes a numpy view for every part of every value: a 128k-token
vocabulary is ~300k views and several seconds before the first weight is read. This
reader walks the header with `struct.unpack_from` over one read-only `mmap` of the file
and gives the same results: `metadata` equals `{k: f.contents() for k, f in
GGUFReader(p).fields.items()}` (the `GGUF.version`, `GGUF.tensor_count` and
`GGUF.kv_count` entries included, nested arrays flattened as gguf-py flattens them), and
each tensor's `name`, `tensor_type`, `shape` (ne0 first) and `data` (a read-only view of
the map, typed for F16/F32/F64/I8..I64, `uint8` rows of blocks for the other types, as
gguf-py shapes them) match gguf-py's `ReaderTensor`.

Nothing in the file is trusted: every count and length is checked against the bytes left
before anything is allocated or looped over, and every fault (a truncated file, an absurd
count, an unknown value type, a bad alignment, tensor data past the end or overlapping,
a duplicated key or tensor name, invalid UTF-8) raises `ModelLoadError` naming what is
wrong and the byte offset where it was read. A tensor type this `gguf` package does not
know, GGUF version 1 and big-endian files raise `UnsupportedModelError`.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from kvlm.errors import ModelLoadError, UnsupportedModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 (32-bit counts and lengths) is refused, as gguf-py refuses it
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 16  # arrays of arrays: deeper than any real file, shallow for the stack
INT64_MAX = 2**63 - 1

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# value type -> (struct format, numpy dtype) of the fixed-size types, little-endian: their
# codes in GGUFValueType's order, STRING and ARRAY left out
_SCALARS: dict[V, tuple[struct.Struct, np.dtype]] = {
    t: (struct.Struct("<" + code), np.dtype("<" + code))
    for t, code in zip([t for t in V if t not in (V.STRING, V.ARRAY)], "BbHhIif?Qqd", strict=True)
}
_MIN_SIZE = {**{t: s.size for t, (s, _) in _SCALARS.items()}, V.STRING: 8, V.ARRAY: 12}
_VALUE_TYPES = {int(t): t for t in V}
# the least bytes one key/value pair and one tensor info take (an empty key, a 1-byte
# value; an empty name, one dimension): bounds on the counts before the loops
_MIN_KV = 8 + 4 + 1
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8

# tensor types gguf-py gives typed views of; the others are uint8 rows of blocks
_TYPED_DATA = {
    q: np.dtype(q.name.replace("F", "float").replace("I", "int"))
    for q in (Q.F16, Q.F32, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64)
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: its header entry and a read-only view of its bytes in the map."""

    name: str
    tensor_type: Q
    shape: tuple[int, ...]  # GGUF order: ne0 (the innermost, contiguous) first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray = field(repr=False)


class GGUFFile:
    """A GGUF file's header, parsed; the tensors' data stays in one read-only map."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < len(MAGIC):
                    raise ModelLoadError(
                        f"{self.path.name}: truncated or corrupt GGUF: the file ends at byte "
                        f"offset {size}, before the end of the 4-byte magic"
                    )
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"cannot read {self.path}: {exc}") from exc
        self.size = len(self._map)
        parser = _Parser(self._map, self.path.name)
        try:
            parser.parse()
        except BaseException:
            with contextlib.suppress(BufferError):  # a view is alive: the map goes with it
                self._map.close()
            raise
        self.version: int = parser.version
        self.alignment: int = parser.alignment
        self.data_offset: int = parser.data_offset  # start of the (aligned) data section
        self.metadata: dict[str, Any] = parser.metadata
        self.value_types: dict[str, V] = parser.value_types  # each key's (outer) type
        self.tensors: list[GGUFTensor] = parser.tensors

    def release(self) -> bool:
        """MADV_DONTNEED the whole map: its pages go back to the OS, the map stays valid
        (a later read faults them in again from the file). False where the OS has no
        MADV_DONTNEED."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or self._map.closed:
            return False
        self._map.madvise(advice)
        return True


class _Parser:
    """One pass over the header. `off` is the byte offset of the next thing to read."""

    def __init__(self, buf: mmap.mmap, name: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.name = name
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, V] = {}
        self.key_offsets: dict[str, int] = {}
        self.tensors: list[GGUFTensor] = []
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0

    # ------------------------------------------------------------------------ errors

    def fail(self, what: str, off: int, unsupported: bool = False) -> NoReturn:
        if unsupported:
            raise UnsupportedModelError(f"{self.name}: {what} (at byte offset {off})")
        raise ModelLoadError(f"{self.name}: truncated or corrupt GGUF: {what} at byte offset {off}")

    def need(self, off: int, n: int, what: str) -> None:
        """`n` bytes at `off`, or a ModelLoadError (checked before reading or allocating)."""
        if n > self.size - off:
            self.fail(f"{what} needs {n} bytes but the file ({self.size} bytes) ends first", off)

    def read(self, fmt: struct.Struct, off: int, what: str) -> Any:
        """The one value of `fmt` at `off` (checked there first)."""
        self.need(off, fmt.size, what)
        return fmt.unpack_from(self.buf, off)[0]

    def string(self, off: int, what: str) -> tuple[str, int]:
        n = self.read(_U64, off, f"the length of {what}")
        if n > self.size - off - 8:
            self.fail(f"{what} has length {n}, past the end of the file ({self.size} bytes)", off)
        return self.decode(off + 8, n, what), off + 8 + n

    def decode(self, off: int, n: int, what: str) -> str:
        try:
            return str(self.buf[off : off + n], "utf-8")
        except UnicodeDecodeError as exc:
            self.fail(f"{what} is not UTF-8 ({exc.reason})", off + exc.start)

    def value_type(self, off: int, what: str) -> V:
        raw = self.read(_U32, off, what)
        vtype = _VALUE_TYPES.get(raw)
        if vtype is None:
            self.fail(f"{what} is {raw}, not a GGUF value type (0..12)", off)
        return vtype

    def count(self, off: int, item: V, what: str) -> int:
        """An array's element count at `off`, bounded by the bytes after it."""
        n = self.read(_U64, off, f"the length of {what}")
        least = n * _MIN_SIZE[item]
        if least > self.size - off - 8:
            self.fail(
                f"{what} has {n} elements of type {item.name}, at least {least} bytes, more "
                f"than the {self.size - off - 8} left in the file",
                off,
            )
        return n

    # ------------------------------------------------------------------------ header

    def parse(self) -> None:
        if self.buf[:4] != MAGIC:
            self.fail(f"the magic is {bytes(self.buf[:4])!r}, not {MAGIC!r}", 0)
        version = self.read(_U32, 4, "the version")
        if version == 1:
            self.fail("GGUF version 1 (32-bit lengths) is not supported; convert the model "
                      "again with a current llama.cpp", 4, unsupported=True)  # fmt: skip
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, *VERSIONS):
                self.fail("a big-endian GGUF file is not supported", 4, unsupported=True)
            self.fail(f"the version is {version}, not one of {VERSIONS}", 4)
        self.version = version
        n_tensors = self.read(_U64, 8, "the tensor count")
        n_kv = self.read(_U64, 16, "the key/value count")
        off = 24
        least = n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO
        if least > self.size - off:
            self.fail(
                f"{n_kv} key/value pairs and {n_tensors} tensor infos take at least "
                f"{least} bytes, more than the {self.size - off} left in the file",
                8,
            )
        self.add("GGUF.version", V.UINT32, version, 4)
        self.add("GGUF.tensor_count", V.UINT64, n_tensors, 8)
        self.add("GGUF.kv_count", V.UINT64, n_kv, 16)
        for i in range(n_kv):
            key_off = off
            key, off = self.string(off, f"key {i} of {n_kv}")
            if key in self.metadata:
                self.fail(f"key {key!r} appears twice", key_off)
            vtype = self.value_type(off, f"the value type of key {key!r}")
            value, off = self.value(vtype, off + 4, f"the value of key {key!r}")
            self.add(key, vtype, value, key_off)
        names: set[str] = set()
        infos = []
        for i in range(n_tensors):
            info, off = self.tensor_info(off, i, n_tensors, names)
            infos.append(info)
        self.alignment = self._alignment()
        self.data_offset = -(-off // self.alignment) * self.alignment
        self.tensors = self._tensors(infos)

    def add(self, key: str, vtype: V, value: Any, off: int) -> None:
        self.metadata[key] = value
        self.value_types[key] = vtype
        self.key_offsets[key] = off

    # ------------------------------------------------------------------------ values

    def value(self, vtype: V, off: int, what: str) -> tuple[Any, int]:
        """(the value of type `vtype` at `off`, as gguf-py's `contents()` gives it, the
        offset after it)."""
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype][0]
            return self.read(fmt, off, what), off + fmt.size
        if vtype == V.STRING:
            return self.string(off, what)
        # an array: item type, count, items
        item = self.value_type(off, f"the item type of {what}")
        n = self.count(off + 4, item, what)
        off += 12
        scalar = _SCALARS.get(item)
        if scalar is not None:
            dtype = scalar[1]
            values = np.frombuffer(self.buf, dtype, n, off).tolist() if n else []
            return values, off + n * dtype.itemsize
        if item == V.STRING:
            return self.strings(off, n, what)
        return self.nested(off - 12, what)

    def strings(self, off: int, n: int, what: str) -> tuple[list[str], int]:
        """`n` strings from `off`: the loop that reads a tokenizer's vocabulary."""
        buf, size = self.buf, self.size
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        i = length = 0
        try:
            for i in range(n):  # noqa: B007 - i names the string at fault below
                (length,) = unpack(buf, off)
                off += 8
                end = off + length
                if end > size:
                    break
                append(str(buf[off:end], "utf-8"))
                off = end
            else:
                return out, off
        except struct.error:  # fewer than 8 bytes left for a length
            self.need(off, 8, f"the length of string {i} of {n} in {what}")
        except UnicodeDecodeError as exc:
            self.fail(f"string {i} of {n} in {what} is not UTF-8 ({exc.reason})", off + exc.start)
        self.fail(
            f"string {i} of {n} in {what} has length {length}, past the end of the file "
            f"({size} bytes)",
            off - 8,
        )

    def nested(self, off: int, what: str) -> tuple[list[Any], int]:
        """An array of arrays at `off` (its item type), flattened as gguf-py flattens it:
        its leaves in order, each read as the type at the end of the chain of first
        elements (strings if that is STRING; else numbers, a string leaf giving its
        bytes)."""
        leaves, types, off = self.leaves(off, 0, what)
        if types[-1] == V.STRING:
            return [self.decode(o, n, what) for _, o, n in leaves], off
        out: list[Any] = []
        for t, o, n in leaves:
            if t == V.STRING:
                out.extend(self.buf[o : o + n])
            else:
                out.append(_SCALARS[t][0].unpack_from(self.buf, o)[0])
        return out, off

    def leaves(
        self, off: int, depth: int, what: str
    ) -> tuple[list[tuple[V, int, int]], list[V], int]:
        """(leaves as (type, offset, bytes), gguf-py's chain of types, the end) of the
        array whose item type is at `off`."""
        if depth >= MAX_NESTING:
            self.fail(f"{what} nests arrays more than {MAX_NESTING} deep", off)
        item = self.value_type(off, f"the item type of {what}")
        n = self.count(off + 4, item, what)
        off += 12
        types = [V.ARRAY]
        leaves: list[tuple[V, int, int]] = []
        if n and item in _SCALARS:
            size = _MIN_SIZE[item]
            leaves = [(item, o, size) for o in range(off, off + n * size, size)]
            return leaves, [*types, item], off + n * size
        for i in range(n):
            if item == V.STRING:
                length = self.read(_U64, off, f"the length of string {i} in {what}")
                if length > self.size - off - 8:
                    self.fail(f"string {i} in {what} has length {length}, past the end", off)
                leaves.append((V.STRING, off + 8, length))
                off += 8 + length
                sub = [V.STRING]
            else:
                sub_leaves, sub, off = self.leaves(off, depth + 1, what)
                leaves += sub_leaves
            if i == 0:
                types += sub
        return leaves, types, off

    # ------------------------------------------------------------------------ tensors

    def tensor_info(
        self, off: int, i: int, n: int, names: set[str]
    ) -> tuple[tuple[str, tuple[int, ...], Q, int, int], int]:
        """((name, dims, type, data offset in the data section, n_elements), the offset
        after the info)."""
        start = off
        name, off = self.string(off, f"the name of tensor {i} of {n}")
        if name in names:
            self.fail(f"tensor name {name!r} appears twice", start)
        names.add(name)
        n_dims = self.read(_U32, off, f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            self.fail(f"tensor {name!r} has {n_dims} dimensions, not 1..{MAX_DIMS}", off)
        off += 4
        self.need(off, 8 * n_dims, f"the dimensions of tensor {name!r}")
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, off)
        n_elements = 1
        for d in dims:
            if d > INT64_MAX:
                self.fail(f"tensor {name!r} has a negative dimension ({d - 2**64})", off)
            n_elements *= d
        if n_elements > INT64_MAX:
            self.fail(f"tensor {name!r}'s dimensions {list(dims)} overflow int64", off)
        off += 8 * n_dims
        raw_type = self.read(_U32, off, f"the type of tensor {name!r}")
        try:
            qtype = Q(raw_type)
            block, _ = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self.fail(
                f"tensor {name!r} has GGML type {raw_type}, which this gguf package does not "
                "know (a type newer than it, or a corrupt file)",
                off,
                unsupported=True,
            )
        if dims[0] % block:
            self.fail(
                f"tensor {name!r}'s rows ({dims[0]}) are not whole {qtype.name} blocks "
                f"({block} weights)",
                off,
            )
        rel = self.read(_U64, off + 4, f"the data offset of tensor {name!r}")
        return (name, tuple(dims), qtype, rel, n_elements), off + 12

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        key = "general.alignment"
        vtype, align, off = self.value_types[key], self.metadata[key], self.key_offsets[key]
        if vtype != V.UINT32:
            self.fail(f"{key} is a {vtype.name}, not a UINT32", off)
        if align == 0 or align & (align - 1):
            self.fail(f"{key} is {align}, not a power of two", off)
        return align

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], Q, int, int]]) -> list[GGUFTensor]:
        base = np.frombuffer(self.buf, np.uint8)  # read-only: the map is ACCESS_READ
        start, align = self.data_offset, self.alignment
        spans, tensors = [], []
        for name, dims, qtype, rel, n_elements in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_elements // block * type_size
            begin = start + rel
            if rel % align:
                self.fail(f"tensor {name!r}'s data offset {rel} is not a multiple of the "
                          f"alignment {align}", begin)  # fmt: skip
            if n_bytes > self.size - begin:
                self.fail(
                    f"tensor {name!r}'s {n_bytes} bytes of data run past the end of the file "
                    f"({self.size} bytes)",
                    begin,
                )
            spans.append((begin, begin + n_bytes, name))
            shape = tuple(reversed(dims))  # numpy order: the innermost dimension last
            raw = base[begin : begin + n_bytes]
            dtype = _TYPED_DATA.get(qtype)
            if dtype is not None:
                data = raw.view(dtype).reshape(shape)
            else:  # rows of blocks, as gguf.quants.quant_shape_to_byte_shape shapes them
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            tensors.append(GGUFTensor(name, qtype, dims, n_elements, n_bytes, begin, data))
        spans.sort()
        for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
            if begin < end:
                self.fail(f"the data of tensors {a!r} and {b!r} overlap", begin)
        return tensors
