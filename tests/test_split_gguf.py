"""Split GGUF output (llama.cpp's gguf-split layout, written through gguf-py's GGUFWriter) and the provenance keys.

A tiny random Llama checkpoint serves most tests (cheap); one test splits the default model (F16, no encoding
search) and checks llama.cpp's logits from the first shard against the unsplit file's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from test_gguf_export import _llama_logits, _tiny_checkpoint

from dynaquant import cli
from dynaquant.analysis.imatrix_io import ImatrixData
from dynaquant.config import QuantizeConfig
from dynaquant.errors import InputError
from dynaquant.exporters.gguf.inspect import inspect_gguf
from dynaquant.pipeline import targets
from dynaquant.pipeline.quantize import run_quantize
from dynaquant.sources.checkpoint import ModelSource, SourceError, resolve_source
from dynaquant.sources.gguf import open_gguf_source
from dynaquant.sources.readers import open_gguf_shards

IDS = [1, 5, 7, 9, 11, 13, 17]


def _q(src, out, **kw) -> object:
    kw = {"preset": "Q8_0", "use_imatrix": False, "progress": False, **kw}
    return run_quantize(str(src), QuantizeConfig(output=out, **kw))


def _fields(path) -> dict:
    r = GGUFReader(path)
    return {k: (f.contents(), f.types[0]) for k, f in r.fields.items() if not k.startswith("GGUF.")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint, unsplit Q8_0 result, split result): 21 tensors, ~118 kB, shards of at most 20 kB of data."""
    d = tmp_path_factory.mktemp("split")
    _tiny_checkpoint(d / "ckpt", "llama")
    return d / "ckpt", _q(d / "ckpt", d / "one.gguf"), _q(d / "ckpt", d / "out" / "m.gguf", split_max_size=20_000)


def test_shards_have_llama_cpp_names_and_keys(tiny):
    _, one, res = tiny
    n = len(res.files)
    assert n > 2 and one.files == [one.output]
    assert [p.name for p in res.files] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert res.output == res.files[0] and res.size_bytes == sum(p.stat().st_size for p in res.files)
    assert sorted(p.name for p in res.files[0].parent.iterdir()) == [p.name for p in res.files]  # no temp left
    assert not any(k.startswith("split.") for k in _fields(one.output))
    readers = [GGUFReader(p) for p in res.files]
    for i, r in enumerate(readers):
        f = {k: (v.contents(), v.types[0]) for k, v in r.fields.items()}
        assert f["split.no"] == (i, GGUFValueType.UINT16) and f["split.count"] == (n, GGUFValueType.UINT16)
        assert f["split.tensors.count"] == (21, GGUFValueType.INT32)
        assert ("general.architecture" in f) == (i == 0)  # the metadata lives in the first shard
        data = sum(int(t.n_bytes) for t in r.tensors)
        assert len(r.tensors) >= 1 and (data <= 20_000 or len(r.tensors) == 1)
    whole = GGUFReader(one.output)
    assert [t.name for r in readers for t in r.tensors] == [t.name for t in whole.tensors]
    for a, b in zip((t for r in readers for t in r.tensors), whole.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(np.asarray(a.data), np.asarray(b.data))


def test_split_max_tensors(tiny, tmp_path):
    res = _q(tiny[0], tmp_path / "t.gguf", split_max_tensors=8)
    assert [len(GGUFReader(p).tensors) for p in res.files] == [8, 8, 5]


def test_llama_cpp_loads_the_first_shard_with_equal_logits(tiny):
    pytest.importorskip("llama_cpp")
    _, one, res = tiny
    assert np.array_equal(_llama_logits(res.output, IDS), _llama_logits(one.output, IDS))


def test_inspect_reads_every_shard(tiny):
    _, one, res = tiny
    s, w = inspect_gguf(res.output), inspect_gguf(one.output)
    assert s.files == [str(p) for p in res.files] and w.files == [str(one.output)]
    assert [t.name for t in s.tensors] == [t.name for t in w.tensors] and s.size_bytes == w.size_bytes
    assert s.file_size_bytes == res.size_bytes and s.file_type == w.file_type
    assert cli.main(["inspect", str(res.output), "--json"]) == 0


def test_a_missing_shard_is_named(tiny, tmp_path, capsys):
    _, _, res = tiny
    for p in res.files:
        shutil.copy(p, tmp_path / p.name)
    gone = tmp_path / res.files[2].name
    gone.unlink()
    first = tmp_path / res.files[0].name
    for read in (open_gguf_shards, inspect_gguf, open_gguf_source):
        with pytest.raises(InputError, match=f"{gone}.* is missing"):
            read(first)
    assert cli.main(["inspect", str(first)]) == 2
    assert str(gone) in capsys.readouterr().err
    with pytest.raises(InputError, match="give the first shard"):
        open_gguf_shards(tmp_path / res.files[1].name)


def test_a_split_gguf_is_a_source(tiny, tmp_path):
    """Re-quantizing from the first shard reads every shard: the same tensors as from the unsplit file."""
    _, one, res = tiny
    src = open_gguf_source(res.output)
    assert len(src.tensors()) == 21 and src.file_of(src.tensors()[-1]) == str(res.files[-1])
    a = _q(res.output, tmp_path / "a.gguf", preset="Q4_0")
    b = _q(one.output, tmp_path / "b.gguf", preset="Q4_0")
    ra, rb = GGUFReader(a.output), GGUFReader(b.output)
    assert [(t.name, t.tensor_type) for t in ra.tensors] == [(t.name, t.tensor_type) for t in rb.tensors]
    assert all(np.array_equal(np.asarray(x.data), np.asarray(y.data)) for x, y in zip(ra.tensors, rb.tensors))


def test_eval_accepts_the_first_shard(tiny):
    from dynaquant.pipeline.evaluate import evaluate

    ckpt, one, res = tiny
    kw = dict(reference=str(ckpt), n_ctx=32, chunks=2, device="cpu", progress=False)
    a, b = evaluate(res.output, **kw), evaluate(one.output, **kw)
    assert a.tokens == b.tokens > 0 and a.kld_mean == b.kld_mean and a.top1_agreement == b.top1_agreement


def test_an_error_mid_write_leaves_no_shard(tiny, tmp_path, monkeypatch):
    calls = []

    def failing(w, fmt, imp=None):
        calls.append(1)
        if len(calls) == 15:
            raise RuntimeError("encoder failed")
        return real(w, fmt, imp)

    real = targets.encode_tensor
    monkeypatch.setattr(targets, "encode_tensor", failing)
    with pytest.raises(RuntimeError, match="encoder failed"):
        _q(tiny[0], tmp_path / "m.gguf", split_max_size=20_000)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rename_removes_the_shards_already_placed(tiny, tmp_path, monkeypatch):
    """The shards are renamed last to first; a failure on the first shard removes the ones placed."""
    import dynaquant.exporters.gguf.writer as writer

    real = writer.os.replace

    def replace(a, b):
        if Path(b).name.startswith("m-00001-"):
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(InputError, match="No space left"):
        _q(tiny[0], tmp_path / "m.gguf", split_max_size=20_000)
    assert list(tmp_path.iterdir()) == []


def test_an_earlier_output_of_the_name_is_replaced(tiny, tmp_path):
    """A stale shard set of another count (or the single file) is removed once the new set is in place."""
    seven = _q(tiny[0], tmp_path / "m.gguf", split_max_size=20_000).files
    three = _q(tiny[0], tmp_path / "m.gguf", split_max_tensors=8).files
    assert len(seven) != len(three) == 3 and sorted(tmp_path.iterdir()) == three
    (tmp_path / "other-00001-of-00002.gguf").write_bytes(b"x")  # another name: left alone
    single = _q(tiny[0], tmp_path / "m.gguf").files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "other-00001-of-00002.gguf"] and single == [tmp_path / "m.gguf"]
    assert len(inspect_gguf(tmp_path / "m.gguf").files) == 1


def test_preflight_covers_every_shard_name(tiny, tmp_path):
    _, _, res = tiny
    folder = res.files[0].parent
    with pytest.raises(InputError, match="shard of this output's name"):  # m.gguf would replace its own source
        _q(res.output, folder / "m.gguf")
    with pytest.raises(InputError, match="is the source model"):  # a shard of the source set
        _q(res.output, res.files[1])
    assert all(p.exists() for p in res.files)


def test_provenance_of_an_imatrix_file(tiny, tmp_path):
    """llama-quantize's keys (tools/quantize/quantize.cpp): file and dataset strings, counts as UINT32."""
    ckpt = tiny[0]
    names = [t.gguf_name for t in open_gguf_source(tiny[1].output).tensors() if t.quantizable and t.gguf_name.startswith("blk.")]
    ts = {t.gguf_name: t for t in open_gguf_source(tiny[1].output).tensors()}
    g = torch.Generator().manual_seed(0)
    im = ImatrixData({n: torch.rand(ts[n].shape[-1], generator=g, dtype=torch.float64) + 0.5 for n in names},
                     {n: torch.tensor(96) for n in names}, datasets=["calibration.txt"], chunk_count=3, chunk_size=32)
    path = im.save(tmp_path / "my.imatrix.gguf")
    res = _q(ckpt, tmp_path / "q.gguf", preset="Q4_0", use_imatrix=True, imatrix=path)
    f = _fields(res.output)
    assert f["quantize.imatrix.file"] == ("my.imatrix.gguf", GGUFValueType.STRING)
    assert f["quantize.imatrix.dataset"] == ("calibration.txt", GGUFValueType.STRING)
    assert f["quantize.imatrix.entries_count"] == (len(names), GGUFValueType.UINT32)
    assert f["quantize.imatrix.chunks_count"] == (3, GGUFValueType.UINT32)
    assert not any(k.startswith("quantize.") for k in _fields(tiny[1].output))  # no imatrix: no keys


def test_provenance_of_an_imatrix_computed_in_the_run(tiny, tmp_path):
    res = _q(tiny[0], tmp_path / "q.gguf", preset="Q4_0", use_imatrix=True, calibration_chunks=2, n_ctx=32, device="cpu")
    f = _fields(res.output)
    assert f["quantize.imatrix.file"][0] == targets.IMATRIX_COMPUTED_HERE
    assert f["quantize.imatrix.dataset"][0] == f["dynaquant.imatrix.dataset"][0]
    assert f["quantize.imatrix.chunks_count"] == (2, GGUFValueType.UINT32) == (res.imatrix_chunks, GGUFValueType.UINT32)
    assert f["quantize.imatrix.entries_count"][0] >= 14  # 7 linear modules a block


def test_hub_source_revision(tiny, tmp_path, monkeypatch):
    """--source-revision reaches snapshot_download; the commit it resolves to (the cache's snapshot folder) is recorded."""
    import huggingface_hub

    snap = tmp_path / "models--org--tiny" / "snapshots" / ("ab12" * 10)
    shutil.copytree(tiny[0], snap)
    asked = {}

    def fake(repo_id, revision=None, **kw):
        asked.update(repo_id=repo_id, revision=revision)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    src = resolve_source("org/tiny", revision="v1.0")
    assert asked == {"repo_id": "org/tiny", "revision": "v1.0"} and src.revision == "ab12" * 10
    kv = targets.provenance_kv(src, None, None, False)
    assert kv == {"general.source.repo_url": "https://huggingface.co/org/tiny", "dynaquant.source.revision": "ab12" * 10}
    res = _q("org/tiny", tmp_path / "q.gguf", source_revision="v1.0")
    assert _fields(res.output)["dynaquant.source.revision"][0] == "ab12" * 10
    with pytest.raises(SourceError, match="revision"):
        resolve_source(str(tiny[0]), revision="v1.0")
    assert targets.provenance_kv(ModelSource("hf", tiny[0], "ckpt", "ckpt"), None, None, False) == {}


def test_default_model_split_loads_in_llama_cpp(tmp_path):
    """The default model (F16: no encoder search), split at 60 MB: llama.cpp's logits from the first shard equal
    the unsplit file's."""
    pytest.importorskip("llama_cpp")
    assert cli.main(["quantize", "--preset", "F16", "--no-imatrix", "--no-eval", "--split-max-size", "60M",
                     "-o", str(tmp_path / "s" / "m.gguf")]) == 0
    one = run_quantize(None, QuantizeConfig(output=tmp_path / "m.gguf", preset="F16", use_imatrix=False, progress=False))
    shards = sorted((tmp_path / "s").iterdir())
    n = len(shards)
    assert n >= 4 and [p.name for p in shards] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert all(sum(int(t.n_bytes) for t in GGUFReader(p).tensors) <= 60_000_000 for p in shards)
    ids = [1, 504, 3458, 314, 260, 3624, 282]
    assert np.array_equal(_llama_logits(shards[0], ids), _llama_logits(one.output, ids))
    assert inspect_gguf(shards[0]).size_bytes == inspect_gguf(one.output).size_bytes
    assert gguf.Keys.Split.LLM_KV_SPLIT_COUNT not in _fields(one.output)


def test_open_gguf_reuses_the_reader_of_an_unchanged_file_only(tmp_path):
    """gguf-py parses metadata in Python (seconds for a large vocabulary): a file opened again unchanged gives the
    same reader; rewritten in place with other metadata of the same size, or replaced, it is parsed again."""
    from dynaquant.sources.readers import open_gguf

    def write(path, value):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_string("general.name", value)
        w.add_tensor("t", np.arange(8, dtype=np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
        w.close()

    path = tmp_path / "m.gguf"
    write(path, "aaaa")
    first = open_gguf(path)
    assert open_gguf(path) is first
    size = path.stat().st_size
    data = path.read_bytes().replace(b"aaaa", b"bbbb")  # same size, same inode: the metadata differs
    with open(path, "r+b") as f:
        f.write(data)
    assert path.stat().st_size == size
    again = open_gguf(path)
    assert again is not first and bytes(again.fields["general.name"].parts[-1]) == b"bbbb"
    write(tmp_path / "n.gguf", "cccc")
    (tmp_path / "n.gguf").replace(path)  # a new file under the old name
    assert bytes(open_gguf(path).fields["general.name"].parts[-1]) == b"cccc"


def test_a_quantize_runs_evaluation_equals_dynaquant_eval(tiny, tmp_path):
    """quantize --eval builds the quantized model as a copy of the reference holding the file's decoded weights (no
    second load): the same figures, bit for bit, as ``dynaquant eval`` on the file (transformers' GGUF loader)."""
    from dynaquant.pipeline.evaluate import evaluate

    ckpt = tiny[0]
    text = tmp_path / "eval.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    res = _q(ckpt, tmp_path / "q.gguf", preset="Q4_0", evaluate=True, eval_text=text, eval_chunks=2, n_ctx=32,
             device="cpu")
    again = evaluate(res.output, ckpt, text=text, n_ctx=32, chunks=2, device="cpu", progress=False)
    assert res.eval.kld_mean == again.kld_mean and res.eval.top1_agreement == again.top1_agreement
    assert res.eval.kld_mean > 0 and res.eval.ppl == again.ppl
    gsrc = tiny[1].output  # a GGUF source (no head counts in its tensor source; q/k stored permuted)
    res = _q(gsrc, tmp_path / "g.gguf", preset="Q4_0", evaluate=True, eval_text=text, eval_chunks=2, n_ctx=32,
             device="cpu")
    again = evaluate(res.output, gsrc, text=text, n_ctx=32, chunks=2, device="cpu", progress=False)
    assert res.eval.kld_mean == again.kld_mean and res.eval.kld_mean > 0


def test_a_tensor_planned_in_its_stored_type_keeps_the_source_bytes(tiny, tmp_path, monkeypatch):
    """A GGUF source's tensor planned in the type it is stored in is written with the source's own bytes (its decoding
    is the source weight: error 0; GGUFTarget.source_records), whatever the imatrix; without that, re-encoding the
    decoded weights with the imatrix gives other bytes for some tensor (so this test tells the two apart)."""
    from dynaquant.pipeline.targets import GGUFTarget

    src = tiny[1].output  # a Q8_0 GGUF (F32 norms)
    kw = dict(preset="Q8_0", use_imatrix=True, calibration_chunks=2, n_ctx=32, device="cpu")
    _q(src, tmp_path / "kept.gguf", **kw)
    monkeypatch.setattr(GGUFTarget, "source_records", lambda self, t, lo=0, hi=None: None)
    _q(src, tmp_path / "again.gguf", **kw)
    source = {t.name: t for t in GGUFReader(src).tensors}
    kept, again = GGUFReader(tmp_path / "kept.gguf").tensors, GGUFReader(tmp_path / "again.gguf").tensors
    assert [t.tensor_type for t in kept] == [source[t.name].tensor_type for t in kept]
    assert all(t.data.tobytes() == source[t.name].data.tobytes() for t in kept)
    assert any(t.data.tobytes() != source[t.name].data.tobytes() for t in again)


def test_a_quantize_run_loads_its_source_model_once(tiny, tmp_path, monkeypatch):
    """The whole-model run's source model is the evaluation's reference: loaded once (the figures equal a separate
    ``dynaquant eval``'s: test_a_quantize_runs_evaluation_equals_dynaquant_eval)."""
    import dynaquant.pipeline.evaluate as ev
    import dynaquant.pipeline.quantize as q

    loads = []
    for mod in (q, ev):
        real = mod.load_model
        monkeypatch.setattr(mod, "load_model", lambda *a, real=real, **k: loads.append(1) or real(*a, **k))
    text = tmp_path / "eval.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    res = _q(tiny[0], tmp_path / "q.gguf", preset="Q4_0", use_imatrix=True, calibration_chunks=2, n_ctx=32,
             evaluate=True, eval_text=text, eval_chunks=2, device="cpu")
    assert res.eval.kld_mean > 0 and len(loads) == 1
