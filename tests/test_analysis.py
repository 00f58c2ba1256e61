"""Analysis: calibration statistics, per-tensor errors and their KLD prediction, super weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dynaquant.analysis.calibration import CalibrationSpec, calibration_chunks, tokenize_chunks
from dynaquant.analysis.errors import RowWeights, measure_errors, sample_rows
from dynaquant.analysis.sensitivity import ReferenceLogits, kld_with_weights
from dynaquant.analysis.stats import collect_stats, compute_imatrix
from dynaquant.analysis.superweights import confirm, find_candidates
from dynaquant.analysis.texts import default_calibration_text


@pytest.fixture(scope="module")
def chunks(default_tokenizer):
    return tokenize_chunks(default_tokenizer, default_calibration_text(), 256, 4)


@pytest.fixture(scope="module")
def stats(default_model, chunks):
    return collect_stats(default_model, chunks, fisher_sequences=2, progress=False)


def test_shared_inputs_and_imatrix_equal_llama_style_imatrix(default_model, chunks, stats):
    assert stats.input_of["model.layers.3.self_attn.k_proj"] == "model.layers.3.self_attn.q_proj"
    assert stats.input_of["model.layers.3.self_attn.v_proj"] == "model.layers.3.self_attn.q_proj"
    assert stats.input_of["model.layers.3.mlp.up_proj"] == "model.layers.3.mlp.gate_proj"
    assert stats.input_of["model.layers.3.mlp.down_proj"] == "model.layers.3.mlp.down_proj"
    assert len(stats.inputs) == 4 * 30 + 1  # four distinct inputs per block, plus the lm_head's
    # The two collections run separate forward passes; in float32 their inputs differ by float32 noise of the
    # activations' scale (~1e-6 of the largest channel), which is no bound on a small channel's relative error and
    # varies with the CPU's GEMM kernels. In float64 the inputs agree to ~1e-12 and what is left is H's float32
    # accumulation: a sum of <= 1024 positive terms, relative error <= 1024 * 2**-24 = 6.1e-5 in any order.
    model64 = copy.deepcopy(default_model).double()
    ours = collect_stats(model64, chunks, fisher_sequences=0, progress=False).to_imatrix()
    im = compute_imatrix(model64, chunks, progress=False)
    del model64
    for name in ("model.layers.3.self_attn.v_proj", "model.layers.7.mlp.down_proj", "lm_head"):
        assert ours.counts[name] == im.counts[name] == 4 * 256
        torch.testing.assert_close(ours.mean(name).double(), im.mean(name).double(), rtol=1e-4, atol=0.0)
    h = stats.input("model.layers.3.mlp.down_proj").hessian
    assert torch.allclose(h, h.T) and torch.linalg.eigvalsh(h.double()).min() > -1e-3 * h.diagonal().max()


def test_fisher_and_token_counts(stats, chunks):
    assert stats.fisher_sequences == 2 and stats.fisher_tokens == 512
    f = stats.outputs["model.layers.5.mlp.down_proj"].fisher
    assert f.shape == (576,) and torch.isfinite(f).all() and (f > 0).all()
    assert stats.outputs["model.layers.5.mlp.down_proj"].fisher_tokens == 512
    assert stats.embed_fisher.shape == (576,) and (stats.embed_fisher > 0).all()
    assert int(stats.token_counts.sum()) == chunks.numel()
    assert int(stats.token_counts[chunks[0, 5]]) >= 1


def test_stratified_row_sample_is_unbiased():
    g = torch.Generator().manual_seed(0)
    score = torch.rand(1000, generator=g) ** 4
    values = score * (1 + 0.1 * torch.randn(1000, generator=g))
    idx, w = sample_rows(score, 1000, 10, 0)
    assert float((w * values[idx].double()).sum()) == pytest.approx(float(values.double().sum()), rel=1e-9)
    ests = []
    for seed in range(200):
        idx, w = sample_rows(score, 64, 4, seed)
        assert idx.unique().numel() == 64
        ests.append(float((w * values[idx].double()).sum()))
    truth = float(values.sum())
    assert sum(ests) / len(ests) == pytest.approx(truth, rel=0.01)
    assert max(abs(e / truth - 1) for e in ests) < 0.1  # stratification keeps every draw close


def test_errors_exact_on_all_rows_and_ordered(stats, default_model):
    mod = "model.layers.4.mlp.down_proj"
    w = default_model.get_parameter(mod + ".weight").detach()
    inp = stats.input(mod)
    rw = RowWeights(fisher=stats.outputs[mod].fisher, hessian=inp.hessian)
    full = measure_errors(w, ["Q4_0", "Q8_0", "Q4_K", "IQ4_NL"], rw, imatrix=inp.imatrix, rows=w.shape[0])
    from dynaquant.quant.codecs import dequantize, quantize

    d = dequantize(quantize(w, "Q4_0", inp.imatrix), "Q4_0") - w
    expect = 0.5 * float((rw.fisher.double() * ((d @ inp.hessian) * d).sum(1).double()).sum())
    assert full["Q4_0"].kld_pred == pytest.approx(expect, rel=1e-5)
    out_rel = math.sqrt(float(((d @ inp.hessian) * d).sum() / ((w @ inp.hessian) * w).sum()))
    assert full["Q4_0"].output_rel == pytest.approx(out_rel, rel=1e-4)
    assert full["Q8_0"].kld_pred < full["Q4_K"].kld_pred < full["Q4_0"].kld_pred
    assert full["Q4_0"].size_bytes == 576 * 1536 // 32 * 18
    sampled = measure_errors(w, ["Q4_0", "Q8_0"], rw, imatrix=inp.imatrix)
    assert sampled["Q4_0"].kld_pred == pytest.approx(full["Q4_0"].kld_pred, rel=0.35)
    assert set(measure_errors(default_model.get_parameter("model.layers.4.mlp.up_proj.weight").detach(),
                              ["Q4_0", "Q4_K"], RowWeights(stats.outputs["model.layers.4.mlp.up_proj"].fisher,
                                                           stats.input("model.layers.4.mlp.up_proj").hessian))) == {"Q4_0"}


def test_predicted_kld_tracks_measured_kld(stats, default_model, default_tokenizer):
    """The Fisher prediction of one block's MLP at Q4_0 is within 3x of the KLD measured end to end."""
    held = tokenize_chunks(default_tokenizer, default_calibration_text(), 256, 6)[4:]
    ref = ReferenceLogits(default_model, held)
    for layer in (3, 20):
        names = [f"model.layers.{layer}.mlp.{p}_proj" for p in ("gate", "up", "down")]
        pred = 0.0
        for m in names:
            inp = stats.input(m)
            e = measure_errors(default_model.get_parameter(m + ".weight").detach(), ["MXFP4"],
                               RowWeights(stats.outputs[m].fisher, inp.hessian), imatrix=inp.imatrix)
            pred += e["MXFP4"].kld_pred
        meas = kld_with_weights(default_model, ref, {m + ".weight": "MXFP4" for m in names},
                                lambda n: stats.input(n[: -len(".weight")]).imatrix)
        assert 1 / 3 < pred / meas < 3, (layer, pred, meas)
    # weights restored
    assert ReferenceLogits(default_model, held[:1]).logp[0].equal(ref.logp[0])


def test_super_weight_found_and_confirmed(stats, default_model, chunks):
    cands = confirm(default_model, find_candidates(default_model, stats), chunks[:1, :128])
    top = {(c.layer, c.row, c.column): c for c in cands}
    sw = top[(11, 507, 1229)]  # SmolLM2-135M's super weight: layer 11 down_proj, massive channel 507
    assert sw.confirmed and sw.ppl_ratio > 2 and abs(sw.value) > 3
    assert sw.spike_out > 1000 and sw.spike_in > 500
    assert any(not c.confirmed for c in cands)  # spikes that are not super weights are rejected by ablation
    w = default_model.get_parameter("model.layers.11.mlp.down_proj.weight")
    assert float(w.detach()[507, 1229]) == pytest.approx(sw.value)  # restored



def test_ablations_replay_the_blocks_before_theirs(stats, default_model, chunks):
    """confirm runs each ablation from its own block on (the blocks before it replay the unablated outputs): the
    perplexities equal whole ablated forwards bit for bit, and the blocks before a candidate's are not run."""
    from dynaquant.analysis.superweights import perplexity

    text = chunks[:1, :96]
    cands = confirm(default_model, find_candidates(default_model, stats), text)
    assert len({c.layer for c in cands}) > 1
    mods = dict(default_model.named_modules())
    runs = [0] * len(default_model.model.layers)
    hooks = [b.self_attn.register_forward_pre_hook(lambda *a, i=i: runs.__setitem__(i, runs[i] + 1))
             for i, b in enumerate(default_model.model.layers)]  # (a replayed block's own pre-hooks still run)
    try:
        late = max(cands, key=lambda c: c.layer)
        again = confirm(default_model, [late], text)[0]
    finally:
        for h in hooks:
            h.remove()
    # recorded forward (every block), the replay check (the last block), the ablation (its block onwards)
    assert runs[: late.layer] == [1] * late.layer
    assert runs[late.layer] == 2 + (late.layer == len(runs) - 1)
    assert again.ppl_ablated == late.ppl_ablated and again.ppl_base == late.ppl_base
    for c in cands:
        w = mods[c.module].weight
        keep = w.detach()[c.row, c.column].clone()
        with torch.no_grad():
            w[c.row, c.column] = 0
        try:
            assert perplexity(default_model, text) == c.ppl_ablated, c.module
        finally:
            with torch.no_grad():
                w[c.row, c.column] = keep
    assert perplexity(default_model, text) == cands[0].ppl_base

def test_calibration_sources(tmp_path, default_tokenizer):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha beta gamma. " * 300)
    b.write_text("delta epsilon. " * 300)
    ids = calibration_chunks(default_tokenizer, CalibrationSpec((str(a), str(b)), 100, 64))
    text = default_tokenizer.decode(ids.flatten())
    assert "alpha" in text and "delta" in text and ids.shape[1] == 64
    chat = calibration_chunks(default_tokenizer, CalibrationSpec((str(a),), 2, 64, chat_template=True))
    assert "<|im_start|>" in default_tokenizer.decode(chat.flatten())
    with pytest.raises(ValueError, match="missing.txt"):
        calibration_chunks(default_tokenizer, CalibrationSpec((str(tmp_path / "missing.txt"),)))
    # without the optional 'datasets' package the message says so; with it (offline) it names the dataset
    with pytest.raises(ValueError, match="'datasets' package|'org/name'"):
        calibration_chunks(default_tokenizer, CalibrationSpec(("hf:org/name",)))


def test_group_sensitivity_and_planner_correction(stats, default_model, default_tokenizer):
    from dynaquant.analysis.sensitivity import group_sensitivity
    from dynaquant.pipeline.plan import error_fn_from_report
    from dynaquant.quant.plan import TensorInfo

    held = tokenize_chunks(default_tokenizer, default_calibration_text(), 128, 6)[5:]
    ref = ReferenceLogits(default_model, held)
    groups = {"blk.4.attn": [f"model.layers.4.self_attn.{p}_proj.weight" for p in "qkvo"],
              "blk.4.ffn": [f"model.layers.4.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]}
    rows = group_sensitivity(default_model, ref, groups, ["MXFP4", "Q8_0"],
                             lambda n: stats.input(n[: -len(".weight")]).imatrix, progress=False)
    kld = {(r["group"], r["format"]): r["kld"] for r in rows}
    assert len(rows) == 4 and all(v >= 0 and math.isfinite(v) for v in kld.values())
    assert kld[("blk.4.ffn", "Q8_0")] < kld[("blk.4.ffn", "MXFP4")]
    # the planner scales a group's predictions by measured / predicted
    report = {"tensors": [{"name": "blk.4.ffn_up.weight", "errors": {"Q4_0": {"kld_pred": 1e-3}}},
                          {"name": "blk.5.ffn_up.weight", "errors": {"Q4_0": {"kld_pred": 1e-3}}}],
              "sensitivity": [{"group": "blk.4.ffn", "format": "Q4_0", "kld": 4e-3, "kld_pred": 1e-3}]}
    fn = error_fn_from_report(report)
    assert fn(TensorInfo("blk.4.ffn_up.weight", None, (1536, 576)), "Q4_0") == pytest.approx(4e-3)
    assert fn(TensorInfo("blk.5.ffn_up.weight", None, (1536, 576)), "Q4_0") == pytest.approx(1e-3)
    assert fn(TensorInfo("blk.5.ffn_up.weight", None, (1536, 576)), "Q8_0") == math.inf
