"""Vision-language models analysed block by block: ``analyze(..., stream=True)`` gives the whole-model analysis's
report (the vision tower and projector in the outer part, their statistics from the image + text items), with one
decoder block's weights in memory at a time.

Oracle: the whole-model analysis of the same tiny checkpoints (Qwen2-VL, LLaVA, Mllama: test_vl_runtime's builders).
"""

from __future__ import annotations

import pytest
from test_blockwise import _differences, every_row  # noqa: F401 (a fixture)
from test_vl_runtime import _build

import dynaquant
from dynaquant.analysis.blockwise import collect_blockwise
from dynaquant.analysis.calibration import CalibrationSpec, calibration_chunks
from dynaquant.analysis.stats import Collect, collect
from dynaquant.analysis.vl_calibration import vl_calibration_samples
from dynaquant.sources.checkpoint import load_tokenizer, resolve_source
from dynaquant.sources.hf_vl_full import open_vl_full_source
from dynaquant.sources.model import load_model
from dynaquant.sources.skeleton import build_skeleton

ARCHS = ("qwen2vl", "llava", "mllama")


@pytest.fixture(scope="module", params=ARCHS)
def vl(request, tmp_path_factory):
    return request.param, _build(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


def _samples(folder, n_text=3):
    source = resolve_source(str(folder))
    tok = load_tokenizer(source)
    chunks = calibration_chunks(tok, CalibrationSpec(n_sequences=n_text, seq_len=24))
    return source, vl_calibration_samples(folder, tok, chunks, n_images=2)


def test_blockwise_vl_statistics_equal_the_whole_model_pass(vl):
    """Image + text items through the skeleton give the whole-model pass's statistics: the vision tower's and
    projector's H, activation statistics and Fisher diagonals included (Mllama: its gradients through the
    cross-attention states too), bit for bit."""
    arch, folder = vl
    source, samples = _samples(folder)
    what = Collect(fisher_sequences=3, imatrix=True)  # two image items and one text item get gradients
    want = collect(load_model(source), samples, what, progress=False)
    sk = build_skeleton(source, open_vl_full_source(folder))
    live = []
    orig = sk.materialize

    def materialize(part):
        orig(part)
        live.append(len(sk.live))
    sk.materialize = materialize
    got = collect_blockwise(sk, samples, what, progress=False)
    assert max(live) <= 2  # the outer part and one block
    vision = [k for k in want.outputs if not k.startswith(("model.language_model", "lm_head"))]
    assert vision and all(want.outputs[k].fisher_sum is not None and want.outputs[k].fisher_sum.abs().sum() > 0
                          for k in vision)
    assert _differences(got, want) == []


@pytest.mark.usefixtures("every_row")
def test_analyze_stream_vl_report_equals_whole_model(vl, tmp_path):
    """``analyze(..., stream=True)`` of a VL checkpoint: the whole-model report (vision and projector tensors
    measured, errors to rounding), the same imatrix file."""
    arch, folder = vl
    kw = dict(calibration=CalibrationSpec(n_sequences=2, seq_len=32, n_images=2), candidates=("INT4_G32", "INT8_G32"),
              fisher_sequences=3, super_weights=False, device="cpu", progress=False)
    whole = dynaquant.analyze(folder, tmp_path / "a", **kw).report
    got = dynaquant.analyze(folder, tmp_path / "b", stream=True, **kw).report
    assert got["calibration"].pop("blockwise") is True
    for key in ("model", "calibration", "candidates", "activations"):
        assert got[key] == whole[key], key
    vis = 0
    for g, w in zip(got["tensors"], whole["tensors"], strict=True):
        assert {k: v for k, v in g.items() if k != "errors"} == {k: v for k, v in w.items() if k != "errors"}, g["name"]
        assert g["errors"].keys() == w["errors"].keys(), g["name"]
        vis += g["name"].startswith(("v.", "mm.")) and bool(g["errors"])
        for f, e in w["errors"].items():
            for k in ("weighted_rel", "output_rel", "kld_pred"):
                assert g["errors"][f][k] == pytest.approx(e[k], rel=1e-4, abs=1e-12), (g["name"], f, k)
    assert vis >= 4
    assert (tmp_path / "b" / "imatrix.gguf").read_bytes() == (tmp_path / "a" / "imatrix.gguf").read_bytes()
