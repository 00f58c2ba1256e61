"""The GGUF writer's one-pass array packing (``ArrayPackingWriter._pack_array``) against gguf-py's element-by-element
packing: the same bytes for every array type, gguf-py's own errors for what it refuses, and the same whole file."""

from __future__ import annotations

import pytest
from gguf import GGUFEndian, GGUFValueType, GGUFWriter

from dynaquant.exporters.gguf.writer import ArrayPackingWriter, header_bytes

T = GGUFValueType
ARRAYS = [
    (["a", "héllo", "", "x" * 300, "日本語", "tab\there"], None),
    (["a", "b"], T.STRING),
    ([b"raw", b"", b"\xff\x00"], T.STRING),
    ([0.5, -1.25, 3.0, float("inf"), -0.0, 1e-40], None),  # FLOAT32 (gguf-py's type of a Python float)
    ([0.5, -1.25, 1e-300], T.FLOAT64),
    ([1, -2, 3, 2**31 - 1, -(2**31)], None),  # INT32
    ([1, 2, 3], T.INT32),
    ([0, 255, 7], T.UINT8),
    ([-128, 127], T.INT8),
    ([0, 65535], T.UINT16),
    ([-1, 2], T.INT16),
    ([0, 2**32 - 1], T.UINT32),
    ([0, 2**64 - 1], T.UINT64),
    ([-(2**63), 2**63 - 1], T.INT64),
    ([True, False, True], None),
    ([True, False], T.BOOL),
]


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
@pytest.mark.parametrize("val, sub_type", ARRAYS)
def test_array_bytes_are_gguf_pys(val, sub_type, endian):
    for add_vtype in (True, False):
        want = GGUFWriter(None, "llama", endianess=endian)._pack_val(val, T.ARRAY, add_vtype, sub_type)
        got = ArrayPackingWriter(None, "llama", endianess=endian)._pack_val(val, T.ARRAY, add_vtype, sub_type)
        assert got == want


@pytest.mark.parametrize("val, sub_type", [
    (["a", 1], None),  # mixed types: gguf-py's ValueError
    ([[1, 2], [3, 4]], None),  # nested arrays: gguf-py's own packing
    ([1, 300], T.UINT8),  # out of range: struct.error from both
])
def test_what_gguf_py_refuses_is_refused_the_same_way(val, sub_type):
    def outcome(writer):
        try:
            return writer._pack_val(val, T.ARRAY, True, sub_type)
        except Exception as e:  # noqa: BLE001 - the exception type is what is compared
            return type(e)

    assert outcome(ArrayPackingWriter(None, "llama")) == outcome(GGUFWriter(None, "llama"))


def test_a_vocabulary_header_is_byte_identical(tmp_path):
    """A header with a tokenizer-sized vocabulary, scores and token types: the same bytes and the same count."""
    toks = [f"tok{i}\u0120é" for i in range(5000)]

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_token_list(toks)
        w.add_token_scores([float(i) / 7 for i in range(len(toks))])
        w.add_token_types([i % 5 for i in range(len(toks))])
        w.add_token_merges([f"a{i} b{i}" for i in range(3000)])
        w.add_uint32("test.n", 7)

    files = []
    for cls in (GGUFWriter, ArrayPackingWriter):
        path = tmp_path / f"{cls.__name__}.gguf"
        w = cls(path, "llama")
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        files.append(path.read_bytes())
        counted = cls(None, "llama")
        fill(counted)
        assert header_bytes(counted) == len(files[-1])
    assert files[0] == files[1]
