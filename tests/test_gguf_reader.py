"""FastGGUFReader parses every field and tensor as gguf-py's GGUFReader does (dynaquant.sources.readers)."""

import gguf
import numpy as np
import pytest

from dynaquant.sources.readers import FastGGUFReader


def _same(path):
    ref, ours = gguf.GGUFReader(path), FastGGUFReader(path)
    assert list(ref.fields) == list(ours.fields)
    for key, a in ref.fields.items():
        b = ours.fields[key]
        assert (a.name, a.offset, a.types, a.data) == (b.name, b.offset, b.types, b.data), key
        assert len(a.parts) == len(b.parts), key
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), key
        assert a.contents() == b.contents(), key
    assert len(ref.tensors) == len(ours.tensors) > 0
    for a, b in zip(ref.tensors, ours.tensors):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes) == (b.name, b.tensor_type, b.data_offset, b.n_bytes)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
        assert np.shares_memory(b.data, ours.data)  # still a view of the mapped file


def test_fast_reader_matches_gguf_py_on_the_default_model(default_source):
    _same(default_source.path)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_fast_reader_matches_gguf_py_on_every_value_kind(tmp_path, endian):
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_string("a.string", "héllo")
    w.add_array("a.strings", ["", "x", "a longer string", "ünïcode"])
    w.add_array("a.empty_strings", [])
    w.add_array("a.ints", [1, -2, 3])
    w.add_array("a.floats", [0.5, 1.5])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_array("a.nested_strings", [["a", "bc"], ["d"]])
    w.add_uint64("a.u64", 2**40)
    w.add_bool("a.bool", True)
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same(path)


def test_layout_check_names_the_string_that_runs_past_the_end(tmp_path):
    import struct

    from dynaquant.errors import InputError
    from dynaquant.sources.readers import check_gguf_layout

    path = tmp_path / "strings.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("a.strings", ["first", "second-one", "third"])
    w.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = bytearray(path.read_bytes())
    assert check_gguf_layout(path) > 0
    at = raw.index(struct.pack("<Q", 10) + b"second-one")
    raw[at:at + 8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"a\.strings.*\[1\]"):
        check_gguf_layout(path)


def test_tensor_table_is_gguf_pys(default_source, tmp_path):
    """gguf_tensor_table (the writer's read-back check) gives gguf-py's tensors (names, types, dims) and
    general.file_type; a file without general.file_type gives None."""
    from dynaquant.sources.readers import gguf_tensor_table

    ref = gguf.GGUFReader(default_source.path)
    table, ft = gguf_tensor_table(default_source.path)
    assert table == [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape)) for t in ref.tensors]
    assert ft == int(ref.fields["general.file_type"].contents())
    path = tmp_path / "no-ft.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_tensor_table(path) == ([("t", int(gguf.GGMLQuantizationType.F32), (32, 2))], None)


def test_writer_read_back_names_what_differs(tmp_path):
    """The GGUF writer's read-back check refuses a file whose tensor table or file type is not what was written."""
    from types import SimpleNamespace

    from dynaquant.exporters.gguf.writer import _verify
    from dynaquant.quant.formats import get_format

    path = tmp_path / "one.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_file_type(7)
    w.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = SimpleNamespace(gguf_name="t", shape=(2, 32))
    _verify(path, [t], {"t": get_format("F32")}, 7)
    with pytest.raises(ValueError, match="read back as t F32 .2, 32.*wrote t F16"):
        _verify(path, [t], {"t": get_format("F16")}, 7)
    with pytest.raises(ValueError, match="general.file_type did not read back as 8"):
        _verify(path, [t], {"t": get_format("F32")}, 8)
    with pytest.raises(ValueError, match="read back 1 tensors, wrote 2"):
        _verify(path, [t, t], {"t": get_format("F32")}, None)


def test_float_tensors_read_as_gguf_py_dequantizes_them(tmp_path):
    """BF16 / F16 / F32 tensors (2-D and stacked 3-D; subnormal, infinite and NaN values) read by the GGUF source as
    gguf-py's ``dequantize`` gives them: the same float32 values bit for bit (NaN where gguf-py has NaN)."""
    import torch

    from dynaquant.sources.gguf import open_gguf_source

    g = np.random.default_rng(0)
    x = g.standard_normal((3, 4, 64)).astype(np.float32)
    x.flat[:6] = [np.inf, -np.inf, np.nan, 1e-40, -0.0, 65504.0]
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated: any bit pattern is a BF16 value
    path = tmp_path / "floats.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.attn_q.weight", bf16[0].view(np.uint8), raw_shape=(4, 64), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_tensor("blk.0.attn_k.weight", x[0].astype(np.float16))
    w.add_tensor("blk.0.attn_v.weight", x[0])
    w.add_tensor("blk.0.ffn_gate_exps.weight", bf16.view(np.uint8), raw_shape=(3, 4, 64),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = open_gguf_source(path)
    by_name = {t.gguf_name: t for t in src.tensors()}
    reader = gguf.GGUFReader(path)
    for rt in reader.tensors:
        data = rt.data
        if rt.tensor_type == gguf.GGMLQuantizationType.BF16:
            data = np.ascontiguousarray(data).view(np.uint8)
        want = torch.from_numpy(np.array(gguf.quants.dequantize(data, rt.tensor_type), dtype=np.float32))
        t = by_name[rt.name]
        got = src.read(t)
        assert got.dtype == torch.float32 and tuple(got.shape) == tuple(t.shape), rt.name
        want = want.reshape(got.shape)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), rt.name
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32)), rt.name
