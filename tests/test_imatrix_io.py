"""llama.cpp imatrix files: read llama-imatrix's GGUF and legacy .dat output, write the GGUF format exactly.

Fixtures in tests/data were written by llama.cpp's ``llama-imatrix`` (commands in tests/data/README.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.imatrix_io import (
    ImatrixData,
    imatrix_entries,
    load_imatrix,
    save_imatrix,
    save_imatrix_gguf,
)
from dynaquant.errors import InputError

DATA = Path(__file__).parent / "data"
GGUF_FIX = DATA / "imatrix_smollm2.gguf"
DAT_FIX = DATA / "imatrix_smollm2.dat"
MOE_GGUF_FIX = DATA / "imatrix_moe.gguf"
MOE_DAT_FIX = DATA / "imatrix_moe.dat"
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _layout(path: Path) -> tuple[dict, list]:
    """(metadata {key: (types, contents)}, [(tensor name, type, shape)]) as gguf-py reads them."""
    r = gguf.GGUFReader(path)
    fields = {k: (list(f.types), f.contents()) for k, f in r.fields.items()}
    tensors = [(t.name, t.tensor_type, [int(d) for d in t.shape]) for t in r.tensors]
    return fields, tensors


@pytest.fixture(scope="module")
def fix_gguf() -> ImatrixData:
    return load_imatrix(GGUF_FIX)


@pytest.fixture(scope="module")
def fix_dat() -> ImatrixData:
    return load_imatrix(DAT_FIX)


def test_llama_imatrix_gguf_fixture(fix_gguf):
    names = {f"blk.{i}.{k}.weight" for i in range(30) for k in KINDS}
    assert set(fix_gguf.names()) == names
    assert fix_gguf.datasets == ["imatrix_calibration.txt"]
    assert (fix_gguf.chunk_count, fix_gguf.chunk_size, fix_gguf.legacy) == (2, 128, False)
    for n in names:
        k = 1536 if "ffn_down" in n else 576
        assert fix_gguf.sums[n].shape == (k,) and fix_gguf.sums[n].dtype == torch.float64
        assert fix_gguf.counts[n].shape == () and int(fix_gguf.counts[n]) == 2 * 128
        m = fix_gguf.mean(n)
        assert m.dtype == torch.float32 and m.shape == (k,)
        assert torch.all(m >= 0) and m.max() > 0
    # q, k and v read the same input
    torch.testing.assert_close(fix_gguf.sums["blk.7.attn_q.weight"], fix_gguf.sums["blk.7.attn_v.weight"], rtol=0, atol=0)


def test_dat_fixture_agrees_with_gguf_fixture(fix_gguf, fix_dat):
    assert fix_dat.legacy and fix_dat.names() == fix_gguf.names()
    assert fix_dat.datasets == fix_gguf.datasets and fix_dat.chunk_count == fix_gguf.chunk_count
    assert fix_dat.chunk_size == 0  # not recorded in the legacy format
    for n in fix_gguf.names():
        assert int(fix_dat.counts[n]) == 2  # ncall = ceil(256 tokens / 128)
        torch.testing.assert_close(fix_dat.mean(n), fix_gguf.mean(n), rtol=1e-6, atol=0)
    # in token units, as llama-imatrix --in-file reads a legacy file
    scaled = load_imatrix(DAT_FIX, legacy_chunk_size=128)
    assert scaled.chunk_size == 128
    n = "blk.5.ffn_down.weight"
    assert int(scaled.counts[n]) == 256
    torch.testing.assert_close(scaled.sums[n], fix_gguf.sums[n], rtol=1e-6, atol=0)


def test_rewrite_is_byte_identical_to_llama_imatrix(fix_gguf, tmp_path):
    out = fix_gguf.save(tmp_path / "ours.gguf")
    assert _layout(out) == _layout(GGUF_FIX)
    assert out.read_bytes() == GGUF_FIX.read_bytes()
    back = load_imatrix(out)
    assert back.names() == fix_gguf.names()
    for n in back.names():
        assert torch.equal(back.sums[n], fix_gguf.sums[n]) and torch.equal(back.counts[n], fix_gguf.counts[n])
    assert not [p for p in tmp_path.iterdir() if p.name != "ours.gguf"]  # no temporary left behind


def test_dat_converted_to_gguf_has_llama_layout(fix_gguf, tmp_path):
    d = load_imatrix(DAT_FIX, legacy_chunk_size=128)
    out = save_imatrix_gguf(tmp_path / "from_dat.gguf", d.entries(), datasets=d.datasets, chunk_count=d.chunk_count,
                            chunk_size=d.chunk_size)
    ref_fields, ref_tensors = _layout(GGUF_FIX)
    fields, tensors = _layout(out)
    assert tensors == ref_tensors
    assert fields.keys() == ref_fields.keys()
    assert {k: v[0] for k, v in fields.items()} == {k: v[0] for k, v in ref_fields.items()}  # value types
    assert fields == ref_fields
    back = load_imatrix(out)
    for n in fix_gguf.names():
        torch.testing.assert_close(back.mean(n), fix_gguf.mean(n), rtol=1e-6, atol=0)


def test_moe_fixture_per_expert(tmp_path):
    g, d = load_imatrix(MOE_GGUF_FIX), load_imatrix(MOE_DAT_FIX)
    assert g.names() == d.names() == ["blk.0.attn_q.weight", "blk.0.ffn_down_exps.weight",
                                      "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"]
    down = "blk.0.ffn_down_exps.weight"
    assert g.sums[down].shape == (4, 48) and g.counts[down].tolist() == [300, 0, 128, 77]
    assert g.sums["blk.0.ffn_gate_exps.weight"].shape == (4, 33) and g.sums["blk.0.attn_q.weight"].shape == (33,)
    m = g.mean(down)
    assert m.shape == (4, 48)
    assert torch.equal(m[1], torch.ones(48))  # an expert that saw no token: ones, as llama-quantize
    torch.testing.assert_close(m[2].double(), g.sums[down][2] / 128)
    for n in g.names():  # legacy entries are flat (n_expert * K,)
        assert d.sums[n].shape == (g.sums[n].numel(),)
        torch.testing.assert_close(d.mean(n), g.mean(n).reshape(-1), rtol=1e-6, atol=0)
    assert g.save(tmp_path / "moe.gguf").read_bytes() == MOE_GGUF_FIX.read_bytes()
    _, tensors = _layout(MOE_GGUF_FIX)
    assert (down + ".in_sum2", gguf.GGMLQuantizationType.F32, [48, 4]) in tensors
    assert (down + ".counts", gguf.GGMLQuantizationType.F32, [1, 4]) in tensors
    assert ("blk.0.attn_q.weight.counts", gguf.GGMLQuantizationType.F32, [1]) in tensors


def test_round_trip_random_entries(tmp_path):
    g = torch.Generator().manual_seed(7)
    entries = {
        "blk.1.ffn_down_exps.weight": (torch.rand(3, 17, generator=g, dtype=torch.float64) * 50, torch.tensor([9, 0, 40])),
        "blk.1.ffn_up_exps.weight": (torch.rand(5, 8, generator=g).numpy() * 3, np.array([1, 2, 3, 4, 5])),
        "blk.0.attn_q.weight": (torch.rand(31, generator=g) * 7, 123),
        "blk.0.single_exps.weight": (torch.rand(1, 6, generator=g), torch.tensor([11])),  # one expert: written dense
        "output.weight": (torch.rand(64, generator=g, dtype=torch.float64), torch.tensor(64)),
    }
    out = save_imatrix_gguf(tmp_path / "x.gguf", entries, datasets=["a.txt", "b.txt"], chunk_count=3, chunk_size=64)
    back = load_imatrix(out)
    assert back.names() == sorted(entries) and back.datasets == ["a.txt", "b.txt"]
    assert (back.chunk_count, back.chunk_size) == (3, 64)
    for n, (s, c) in entries.items():
        s = torch.as_tensor(s).to(torch.float32).to(torch.float64)
        if n == "blk.0.single_exps.weight":
            s, c = s[0], c[0]
        assert back.sums[n].shape == s.shape and torch.equal(back.sums[n], s)
        assert torch.equal(back.counts[n], torch.as_tensor(c, dtype=torch.int64))
    m = back.mean("blk.1.ffn_down_exps.weight")
    torch.testing.assert_close(m[2], (back.sums["blk.1.ffn_down_exps.weight"][2] / 40).float())
    assert torch.equal(m[1], torch.ones(17))
    shapes = {name: shape for name, _, shape in _layout(out)[1]}
    assert shapes["blk.1.ffn_down_exps.weight.in_sum2"] == [17, 3]
    assert shapes["blk.1.ffn_down_exps.weight.counts"] == [1, 3]
    assert shapes["blk.0.single_exps.weight.in_sum2"] == [6] and shapes["blk.0.single_exps.weight.counts"] == [1]
    # the writer's own output reads back into the same bytes
    assert back.save(tmp_path / "y.gguf").read_bytes() == out.read_bytes()


def test_imatrix_entries_from_hf_keyed_imatrix(tmp_path):
    g = torch.Generator().manual_seed(3)
    im = Imatrix(dataset="calib.txt", chunks=2)
    for hf in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"):
        k = 24 if "down" in hf else 16
        im.sums[hf] = torch.rand(k, generator=g, dtype=torch.float64) * 200
        im.counts[hf] = 200
    gguf_names = {"model.layers.0.self_attn.q_proj": "blk.0.attn_q.weight", "model.layers.0.mlp.down_proj": "blk.0.ffn_down.weight"}
    entries = imatrix_entries(im, gguf_names.get)
    assert sorted(entries) == ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"]
    out = save_imatrix(tmp_path / "im.gguf", im, gguf_names.get)
    back = load_imatrix(out)
    assert back.datasets == ["calib.txt"] and (back.chunk_count, back.chunk_size) == (2, 100)
    torch.testing.assert_close(back.mean("blk.0.ffn_down.weight"), im.mean("model.layers.0.mlp.down_proj"))
    with pytest.raises(ValueError, match="both map to"):
        imatrix_entries(im, lambda hf: "blk.0.attn_q.weight")


def test_writer_rejects_bad_entries_and_leaves_no_file(tmp_path, monkeypatch):
    p = tmp_path / "bad.gguf"
    kw = dict(datasets=["d"], chunk_count=1, chunk_size=8)
    bad = [
        {},
        {"blk.0.attn_q.weight": (torch.rand(2, 3, 4), 1)},  # 3-D sums
        {"blk.0.attn_q.weight": (torch.rand(2, 4), 5)},  # one count for two experts
        {"blk.0.attn_q.weight": (torch.rand(4), -1)},
        {"blk.0.attn_q.weight": (torch.rand(4), 2.5)},
        {"blk.0.attn_q.weight": (torch.tensor([1.0, float("nan")]), 2)},
        {"blk.0.attn_q.weight": (torch.tensor([1.0, -2.0]), 2)},
    ]
    for entries in bad:
        with pytest.raises(ValueError):
            save_imatrix_gguf(p, entries, **kw)
    with pytest.raises(ValueError, match="datasets"):
        save_imatrix_gguf(p, {"a.weight": (torch.rand(4), 1)}, datasets=[], chunk_count=1, chunk_size=8)
    with pytest.raises(ValueError, match="uint32"):
        save_imatrix_gguf(p, {"a.weight": (torch.rand(4), 1)}, datasets=["d"], chunk_count=-1, chunk_size=8)

    def boom(self, **_):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(InputError, match=f"^{re.escape(str(p))}: cannot write: disk full$") as e:  # names the file
        save_imatrix_gguf(p, {"a.weight": (torch.rand(4), 1)}, **kw)
    assert isinstance(e.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_load_errors_name_the_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("this is not an imatrix file at all\n" * 3)
    with pytest.raises(ValueError, match="notes.txt"):
        load_imatrix(text)

    # a model GGUF (weights named like the imatrix entries' weights); the real SmolLM2 file gives the same error,
    # but gguf-py takes seconds to parse its vocabulary
    g = torch.Generator().manual_seed(1)
    model = {"token_embd.weight": torch.randn(40, 16, generator=g).numpy(),
             "blk.0.attn_q.weight": torch.randn(16, 16, generator=g).numpy()}
    with pytest.raises(ValueError, match=r"tiny_model.gguf: a GGUF of general.type 'model', not an imatrix"):
        load_imatrix(_write_raw_gguf(tmp_path / "tiny_model.gguf", model, "model"))
    with pytest.raises(ValueError, match=r"untyped.gguf: a model GGUF \(general.architecture 'llama'\), not an imatrix"):
        load_imatrix(_write_raw_gguf(tmp_path / "untyped.gguf", model, None))

    blob = DAT_FIX.read_bytes()
    for i, cut in enumerate((2, 30, 5000, len(blob) // 2, len(blob) - 30, len(blob) - 2)):
        p = tmp_path / f"cut{i}.dat"
        p.write_bytes(blob[:cut])
        with pytest.raises(ValueError, match=f"cut{i}.dat"):
            load_imatrix(p)
    p = tmp_path / "extra.dat"
    p.write_bytes(blob + b"\0\0")
    with pytest.raises(ValueError, match="extra.dat.*trailer"):
        load_imatrix(p)
    p = tmp_path / "no_trailer.dat"  # the trailer is optional
    p.write_bytes(blob[: len(blob) - 4 - 4 - len("imatrix_calibration.txt")])
    assert load_imatrix(p).datasets == [] and len(load_imatrix(p).sums) == 210

    gblob = GGUF_FIX.read_bytes()
    for i, cut in enumerate((10, 20000, len(gblob) - 100)):
        p = tmp_path / f"cut{i}.gguf"
        p.write_bytes(gblob[:cut])
        with pytest.raises(ValueError, match=f"cut{i}.gguf"):
            load_imatrix(p)


def _write_raw_gguf(path: Path, tensors: dict[str, np.ndarray], gtype: str | None = "imatrix") -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if gtype is not None:
        w.add_type(gtype)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_load_rejects_inconsistent_gguf(tmp_path):
    s, c = np.ones(8, np.float32), np.array([4], np.float32)
    cases = {
        "nocounts.gguf": {"a.weight.in_sum2": s},
        "f16.gguf": {"a.weight.in_sum2": s.astype(np.float16), "a.weight.counts": c},
        "split.gguf": {"a.weight.in_sum2": s, "a.weight.counts": np.array([1, 2, 3], np.float32)},
        "negcount.gguf": {"a.weight.in_sum2": s, "a.weight.counts": np.array([-1], np.float32)},
        "noentries.gguf": {"a.weight": s},
    }
    for fname, tensors in cases.items():
        with pytest.raises(ValueError, match=fname):
            load_imatrix(_write_raw_gguf(tmp_path / fname, tensors))
    with pytest.raises(ValueError, match="general.type 'model'"):
        load_imatrix(_write_raw_gguf(tmp_path / "model.gguf", {"a.weight.in_sum2": s, "a.weight.counts": c}, "model"))


def test_our_imatrix_agrees_with_llama_imatrix(default_model, default_tokenizer, fix_gguf, default_source):
    """Same model, same text, same chunking: per-column E[x^2] of torch and llama.cpp agree."""
    from dynaquant.analysis.calibration import tokenize_chunks
    from dynaquant.analysis.stats import compute_imatrix
    from dynaquant.names import hf_to_gguf_name

    chunks = tokenize_chunks(default_tokenizer, (DATA / "imatrix_calibration.txt").read_text(), 128, 2)
    im = compute_imatrix(default_model, chunks, "imatrix_calibration.txt", progress=False)
    n_layers = default_model.config.num_hidden_layers

    def name_map(hf: str) -> str | None:
        g = hf_to_gguf_name("llama", n_layers, hf)
        return g + ".weight" if g is not None and g.startswith("blk.") else None  # llama-imatrix: blk.* only

    ours = {n: (torch.as_tensor(s), c) for n, (s, c) in imatrix_entries(im, name_map).items()}
    assert set(ours) == set(fix_gguf.names())
    for n in fix_gguf.names():
        s, c = ours[n]
        assert c == int(fix_gguf.counts[n]) == 256
        a, b = (s / c).double(), fix_gguf.mean(n).double()
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert corr > 0.99, (n, corr)
    n = "blk.5.ffn_down.weight"
    rel = ((ours[n][0] / 256).float() - fix_gguf.mean(n)).abs() / fix_gguf.mean(n)
    assert rel.median() < 0.05
