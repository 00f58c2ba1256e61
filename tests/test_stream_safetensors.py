"""``quantize(..., target="safetensors", stream=True)``: the checkpoint folder of the whole-model run, file for file and
byte for byte, written with at most one part of the model's skeleton (the outer part or one decoder block) holding real
weights at a time, resumable from its work folder; what it cannot do yet is refused before any work.

Oracle: the same run on the model transformers loads whole (``stream=False``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_blockwise import _checkpoint, every_row  # noqa: F401 (a fixture)

import dynaquant.pipeline.quantize as quantize_mod
from dynaquant.config import QuantizeConfig
from dynaquant.pipeline.quantize import run_quantize
from dynaquant.pipeline.safetensors_target import SafetensorsTarget
from dynaquant.sources.skeleton import OUTER, ModelSkeleton

# (bpw 6.5 is below what the safetensors default rules need on these tiny models: 7.7 bpw for "llama")
KW = dict(bpw=9.0, calibration_chunks=4, n_ctx=32, device="cpu", progress=False)


def _quantize(model, **kw):
    """``quantize`` on a :class:`QuantizeConfig` (``max_shard_bytes`` is not an argument of ``quantize``)."""
    return run_quantize(str(model), QuantizeConfig(**kw))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def watch_write(monkeypatch):
    """``(part, number of live parts)`` after each ``materialize`` during the tensor loop (``write_output``)."""
    seen: list[tuple] = []
    writing = [False]
    real_mat, real_write = ModelSkeleton.materialize, quantize_mod.write_output

    def materialize(self, part):
        real_mat(self, part)
        if writing[0]:
            seen.append((part, len(self.live)))

    def write_output(*a, **k):
        writing[0] = True
        try:
            return real_write(*a, **k)
        finally:
            writing[0] = False
    monkeypatch.setattr(ModelSkeleton, "materialize", materialize)
    monkeypatch.setattr(quantize_mod, "write_output", write_output)
    return seen


@pytest.mark.parametrize("case,shard", [("llama", None), ("qwen2", None), ("qwen2moe", 20_000), ("deepseek-v3", None),
                                        ("gpt-oss", 50_000)])
def test_stream_checkpoint_equals_whole_model(case, shard, tmp_path, every_row, watch_write):  # noqa: F811
    """Same plan, same files (shards, index, config.json, tokenizer and generation files), byte for byte; during the
    write one part live at a time (the tied head of "qwen2" skipped as in the whole-model run)."""
    _checkpoint(tmp_path / "ckpt", case)
    kw = dict(KW, target="safetensors", **({"max_shard_bytes": shard} if shard else {}))
    whole = _quantize(tmp_path / "ckpt", output=tmp_path / "a", **kw)
    assert watch_write == []
    got = _quantize(tmp_path / "ckpt", output=tmp_path / "b", stream=True, **kw)
    assert got.plan.formats() == whole.plan.formats()
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert list(b) == list(a)
    assert [n for n in a if a[n] != b[n]] == []
    assert got.size_bytes == whole.size_bytes
    shards = [n for n in a if n.endswith(".safetensors")]
    assert (len(shards) > 1) == (shard is not None) and ("model.safetensors.index.json" in a) == (shard is not None)
    assert watch_write and max(n for _, n in watch_write) == 1
    assert [p for p, _ in watch_write] == [OUTER, *range(2), OUTER]  # (the norm and head: the outer part again)
    if case == "qwen2":  # tied: the head is the embedding, not written twice
        from safetensors import safe_open

        with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
            assert not any(k.startswith("lm_head") for k in f.keys())


def test_stream_checkpoint_resumes_after_a_crash_mid_loop(tmp_path, monkeypatch, watch_write):
    """A run that fails in the middle of the tensor loop, started again with the same arguments and work folder,
    encodes only the tensors not kept (encodings of every kind: a weight, stacked experts, a float weight kept as it
    is) and reads only the parts they are in; it writes the uninterrupted run's bytes; the failed run leaves no
    output."""
    import torch

    _checkpoint(tmp_path / "ckpt", "qwen2moe")
    kw = dict(KW, target="safetensors", stream=True, max_shard_bytes=20_000)
    real = SafetensorsTarget.encode
    calls: list[str] = []
    fail_at = [None]

    def encode(self, name, w, rounded):
        calls.append(name)
        if len(calls) == fail_at[0]:
            raise RuntimeError("killed")
        return real(self, name, w, rounded)
    monkeypatch.setattr(SafetensorsTarget, "encode", encode)
    ref = _quantize(tmp_path / "ckpt", output=tmp_path / "ref", **kw)
    everything = list(calls)
    k = next(i for i, n in enumerate(everything) if ".layers.1." in n) + 1  # block 0 and the embedding kept
    calls.clear()
    fail_at[0] = k + 1
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="killed"):
        _quantize(tmp_path / "ckpt", output=tmp_path / "b", work_dir=work, **kw)
    assert not (tmp_path / "b").exists()
    kept = sorted((work / "tensors").glob("*.pt"))
    assert len(kept) == k
    kinds = {torch.load(p, weights_only=True)["kind"] for p in kept}
    assert kinds == {"none", "weight", "experts"}
    calls.clear()
    watch_write.clear()
    fail_at[0] = None
    got = _quantize(tmp_path / "ckpt", output=tmp_path / "b", work_dir=work, **kw)
    assert calls == everything[k:]  # the kept ones were not encoded again
    assert [p for p, _ in watch_write] == [1, OUTER]  # nor their parts read: the embedding and block 0 were done
    a, b = _files(tmp_path / "ref"), _files(tmp_path / "b")
    assert list(b) == list(a) and [n for n in a if a[n] != b[n]] == []
    assert got.size_bytes == ref.size_bytes
    assert not work.exists()  # removed after success


@pytest.mark.usefixtures("every_row")
def test_stream_checkpoint_of_a_vision_language_model(tmp_path, watch_write):
    """A Qwen2-VL folder (its vision tower part of the outer part), planned here: the block-wise analysis with image +
    text calibration gives the whole-model run's plan and folder, byte for byte (processor files included), one part
    live at a time while writing; with a given plan too."""
    from test_vl_gguf import _tiny_vl_checkpoint

    _tiny_vl_checkpoint(tmp_path / "ckpt")
    kw = dict(KW, target="safetensors", correct_rounds=0)
    _quantize(tmp_path / "ckpt", output=tmp_path / "a", save_plan=tmp_path / "plan.json", **kw)
    got = _quantize(tmp_path / "ckpt", output=tmp_path / "b", stream=True, **kw)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert "preprocessor_config.json" in a and list(b) == list(a)
    assert [n for n in a if a[n] != b[n]] == []
    assert any(n.startswith("v.") and f not in ("F32", "F16", "BF16") for n, f in got.plan.formats().items())
    assert max(n for _, n in watch_write) == 1 and [p for p, _ in watch_write][0] == OUTER
    kw = dict(kw, bpw=None, plan=tmp_path / "plan.json", use_imatrix=False)
    _quantize(tmp_path / "ckpt", output=tmp_path / "c", **kw)
    _quantize(tmp_path / "ckpt", output=tmp_path / "d", stream=True, **kw)
    c, d = _files(tmp_path / "c"), _files(tmp_path / "d")
    assert list(d) == list(c) and [n for n in c if c[n] != d[n]] == []


@pytest.mark.parametrize("extra,names", [(dict(gptq=True), "gptq"), (dict(evaluate=True), "evaluate"),
                                         (dict(gptq=True, evaluate=True), "gptq and evaluate"),
                                         (dict(compare_presets=True, target="gguf", card=True, evaluate=True), "compare_presets")])
def test_stream_safetensors_refusals_before_any_work(extra, names, tmp_path, monkeypatch):
    """What stream with the safetensors target does not do yet is refused before the source is even opened."""
    _checkpoint(tmp_path / "ckpt", "llama")

    def no_work(*a, **k):
        raise AssertionError("work started")
    monkeypatch.setattr(quantize_mod, "resolve_source", no_work)
    kw = {**KW, "target": "safetensors", "stream": True, **extra}
    with pytest.raises(ValueError, match=names):
        _quantize(tmp_path / "ckpt", output=tmp_path / "a", **kw)
    assert not (tmp_path / "a").exists()
