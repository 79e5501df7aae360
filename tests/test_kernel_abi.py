"""The C kernels' binary interface, one definition on each side held to the other: the structs,
enums and limits of kernels/abi.h against fused.py's ctypes classes and the Python numbers
(a probe compiled against the header says each field's offset and size and each number's
value); every exported function's ctypes signature (kvlm.kernels._SIGNATURES) against its C
definition and the library's exported symbols; the build key against every source file."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvlm import kernels
from kvlm.config import CONV_KERNEL, MIXERS
from kvlm.model import fused, quant

KERNELS = Path(kernels.__file__).parent
# abi.h's structs -> their ctypes mirror
MIRROR = {
    "kvlm_qpart": fused._QPart,
    "kvlm_qmat": fused._QMat,
    "kvlm_qlayer": fused._QLayer,
    "kvlm_qmodel": fused._QModel,
    "kvlm_kv_view": fused._KVView,
    "kvlm_conv_view": fused._ConvView,
    "kvlm_state_view": fused._StateView,
}
SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}


def _code(text: str) -> str:
    """C text without its comments and preprocessor lines (continuations too)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.MULTILINE)


def header_structs(text: str) -> dict[str, list[tuple[str, str, int, str | None]]]:
    """abi.h's `typedef struct { ... } name;`: each field as (name, base type, pointer
    depth, array length or None), in order."""
    structs = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", _code(text), re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            m = re.fullmatch(r"((?:const\s+)?\w+)\s+(.+)", decl, re.S)
            assert m, f"{name}: cannot read {decl!r}"
            base = m[1].replace("const", "").strip()
            for item in m[2].split(","):
                d = re.fullmatch(r"\s*(\**)\s*(?:const\s+)?(\w+)\s*(?:\[\s*(\w+)\s*\])?\s*", item)
                assert d, f"{name}: cannot read {item!r}"
                fields.append((d[2], base, len(d[1]), d[3]))
        structs[name] = fields
    return structs


def _expected(base: str, stars: int, length: str | None):
    """What the ctypes field must be for a C field: (kind, detail)."""
    if length is not None:
        n = int(length) if length.isdigit() else kernels.CONSTANTS[length]
        return ("array", _expected(base, stars, None), n)
    if stars:
        return ("pointer",)
    if base in MIRROR:
        return ("struct", MIRROR[base])
    return ("scalar", SCALARS[base])


def _actual(ctype):
    if issubclass(ctype, ctypes.Array):
        return ("array", _actual(ctype._type_), ctype._length_)
    if ctype is ctypes.c_void_p or issubclass(ctype, ctypes._Pointer):
        return ("pointer",)
    if issubclass(ctype, ctypes.Structure):
        return ("struct", ctype)
    return ("scalar", ctype)


def test_the_ctypes_structs_are_abi_hs_field_for_field():
    """Names, order and kinds (an int64, a float, a pointer, a struct, an array of the
    header's length) of every field; sizes and offsets come from the probe below."""
    structs = header_structs((KERNELS / "abi.h").read_text())
    assert set(structs) == set(MIRROR), "a struct in abi.h without a ctypes mirror, or the reverse"
    for name, fields in structs.items():
        mirror = MIRROR[name]._fields_
        assert [f[0] for f in fields] == [f[0] for f in mirror], name
        for (field, base, stars, length), (_, ctype) in zip(fields, mirror, strict=True):
            assert _actual(ctype) == _expected(base, stars, length), f"{name}.{field}"


def _probe(tmp_path: Path) -> dict[str, int]:
    """What the C compiler makes of abi.h: sizeof and offsetof of every struct and field, the
    value of every number Python reads from it."""
    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    lines = []
    for name, fields in header_structs((KERNELS / "abi.h").read_text()).items():
        lines.append(f'printf("size {name} %zu\\n", sizeof({name}));')
        for field, *_ in fields:
            lines.append(f'printf("offset {name}.{field} %zu\\n", offsetof({name}, {field}));')
            lines.append(f'printf("size {name}.{field} %zu\\n", sizeof((({name} *)0)->{field}));')
    for const in kernels.CONSTANTS:
        lines.append(f'printf("value {const} %lld\\n", (long long)({const}));')
    src = tmp_path / "probe.c"
    src.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "abi.h"\nint main(void) {\n'
        + "\n".join(lines)
        + "\nreturn 0;\n}\n"
    )
    exe = tmp_path / "probe"
    build = subprocess.run([cc, "-std=c11", "-I", str(KERNELS), "-o", str(exe), str(src)],
                           capture_output=True, text=True)  # fmt: skip
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {" ".join(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}


@pytest.mark.skipif(sys.platform == "win32", reason="kernels are not built there")
def test_sizes_offsets_and_numbers_are_the_compilers(tmp_path):
    """Every field at the offset and of the size the compiler lays it out with, every struct
    of its size; every number Python reads from abi.h (kernels.CONSTANTS) the compiler's."""
    probe = _probe(tmp_path)
    for name, mirror in MIRROR.items():
        assert ctypes.sizeof(mirror) == probe[f"size {name}"], name
        for field, _ in mirror._fields_:
            attr = getattr(mirror, field)
            assert attr.offset == probe[f"offset {name}.{field}"], f"{name}.{field}"
            assert attr.size == probe[f"size {name}.{field}"], f"{name}.{field}"
    for const, value in kernels.CONSTANTS.items():
        assert probe[f"value {const}"] == value, const


def test_pythons_numbers_are_abi_hs():
    """One definition of each: fused.py reads its limits and codes from abi.h; quant.py's
    weight kinds, rows per block and rows per small product must be the header's."""
    c = kernels.CONSTANTS
    assert c["MAX_HEAD_DIM"] == fused.MAX_HEAD_DIM
    assert (c["MAX_BATCH"], c["QMAT_PARTS"]) == (fused.MAX_ROWS, fused.QMAT_PARTS)
    assert set(fused._KV_DTYPE.values()) == {c[k] for k in c if k.startswith("KV_")}
    assert sum(fused._ACT_BITS) == sum(c[k] for k in c if k.startswith("ACT_"))
    header = {k: c[k] for k in ("Q8", "Q4", "Q40", "Q50", "Q51", "Q4K", "Q5K", "Q6K", "MXFP4")}
    header["Q80ROWS"] = c["Q8R"]  # quant.ROWS_KIND
    assert {
        name.upper().replace("_", ""): code for name, code in quant.KIND_CODES.items()
    } == header
    assert (c["BR"], c["SMALL_ROWS"]) == (quant.BLOCK_ROWS, quant.SMALL_M)
    from kvlm.cache.kinds import DELTA_CHUNK  # the DeltaNet state's format: one chunk

    assert c["DELTA_CHUNK"] == DELTA_CHUNK
    assert c["KVLM_ABI"] == kernels.ABI
    # a layer's mixer: one code for each of the config's the step runs (kvlm_qlayer.mixer;
    # why_not refuses a model with any other), and the most taps a conv layer takes the
    # config's bound
    assert set(fused._MIXERS) <= set(MIXERS)
    assert set(fused._MIXERS.values()) == {c[k] for k in c if k.startswith("MIX_")}
    assert c["MAX_CONV_KERNEL"] == CONV_KERNEL[1]


def exported_definitions() -> dict[str, tuple[str, str]]:
    """Every function the C parts define at file scope without `static`, as _SIGNATURES
    writes it: (return type, argument letters). (v512.h's functions are static inline
    through a macro; the library's symbols, below, are the compiler's word on all of it.)"""
    found: dict[str, tuple[str, str]] = {}
    for path in (p for p in kernels.sources() if p.suffix == ".c"):
        depth, head = 0, ""
        for tok in re.split(r"([{};])", _code(path.read_text())):
            if tok == "{":
                sig = " ".join(head.split())
                m = re.fullmatch(r"(.*?)\b(\w+)\s*\((.*)\)", sig)
                if depth == 0 and m and not re.search(r"\b(static|typedef|struct|enum)\b|=", m[1]):
                    found[m[2]] = (_c_type(m[1]), _letters(m[3]))
                depth += 1
            elif tok == "}":
                depth -= 1
                head = ""
            elif tok == ";":
                head = ""
            elif depth == 0:
                head += tok
    return found


def _c_type(ret: str) -> str:
    return {"int": "int", "int64_t": "int64"}.get(ret.strip(), ret.strip())


def _letters(params: str) -> str:
    if params.strip() in ("", "void"):
        return ""
    out = ""
    for p in params.split(","):
        p = p.strip()
        out += "p" if "*" in p else {"int64_t": "i", "double": "d"}[p.split()[0]]
    return out


def test_every_exported_function_is_in_the_table_as_defined():
    """Every non-static function the sources define is bound by kernels._SIGNATURES with
    its definition's return type and arguments, and the table names no other."""
    defined = exported_definitions()
    assert all(name.startswith("kvlm_") for name in defined)
    assert defined == kernels._SIGNATURES


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm")
def test_the_librarys_exported_symbols_are_the_table(tmp_path):
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.status())
    out = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    symbols = {line.split()[-1] for line in out.splitlines() if line.split()[-2] in "TtWi"}
    assert symbols == set(kernels._SIGNATURES)


def test_no_one_else_binds_a_kernel():
    """The table is the one binding: no module or test sets a kernel's argtypes or restype."""
    root = KERNELS.parents[2]
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in [
            *root.glob("src/**/*.py"),
            *root.glob("tests/*.py"),
            *root.glob("benchmarks/*.py"),
        ]
        if path.name != "test_kernel_abi.py" and path != KERNELS / "__init__.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"kvlm_\w+\.(argtypes|restype)\b", line)
    ]
    assert not found


def test_the_build_key_covers_every_source_file():
    """qgemm.c includes the parts; the key hashes all of them (a change to any part
    rebuilds), and no C file or header beside them is left out of the build."""
    names = [p.name for p in kernels.sources()]
    assert names[0] == "qgemm.c" and len(names) == len(set(names))
    on_disk = {p.name for p in KERNELS.iterdir() if p.suffix in (".c", ".h")}
    assert set(names) == on_disk
    assert {"abi.h", "v512.h", "weights.c", "decode.c", "prompt.c"} <= set(names)


def test_a_change_to_any_part_changes_the_key(tmp_path, monkeypatch):
    """A copy of the sources: one byte more in each part in turn gives another key."""
    cc = kernels._compiler() or "cc"
    for path in kernels.sources():
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(kernels, "SOURCE", tmp_path / "qgemm.c")
    keys = {kernels._key(cc, kernels.FLAGS)}
    for path in kernels.sources():
        path.write_text(path.read_text() + "\n")
        keys.add(kernels._key(cc, kernels.FLAGS))
    assert len(keys) == len(kernels.sources()) + 1
