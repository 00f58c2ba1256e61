"""The analysis's batched error measurement (``measure_samples``) equals measuring one tensor at a time.

Oracles: :func:`measure_errors` on each tensor alone (the per-tensor path, itself checked against the
quantize/dequantize formula in test_analysis.py), and ``quantize``/``dequantize`` of the same sampled
rows for the weighted error. Equality is exact (``==`` on the float results): each block's encoding
depends on that block alone, the sums run over the same rows in the same order.
"""

from __future__ import annotations

import pytest
import torch

import dynaquant.analysis.errors as errors
from dynaquant.analysis.errors import RowWeights, measure_errors, measure_samples, sample_tensor
from dynaquant.quant.codecs import base, dequantize, quantize

# one format a class (the i-quants' CPU encoders are slow): 256-blocks with a lattice search (IQ2_XXS switches to
# its no-imatrix weighting on constant importance), K-quant, legacy, nonlinear, NVFP4 runtime (global scale over
# the blocks encoded: measured alone), plain float
FORMATS = ["IQ2_XXS", "Q4_K", "Q4_0", "MXFP4", "NVFP4_G16", "F16"]


def _case(n: int, k: int, seed: int, imatrix: bool = True, lookup: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g))
    x = torch.randn(48, k, generator=g) * 3 * torch.rand(k, generator=g)
    h = x.T @ x / 48
    if lookup:
        return w, RowWeights(lookup=torch.rand(n, generator=g), lookup_fisher=torch.rand(k, generator=g)), None
    return w, RowWeights(fisher=torch.rand(n, generator=g), hessian=h), torch.diagonal(h).clone() if imatrix else None


@pytest.fixture(scope="module")
def cases():
    # odd row counts, two row sizes, a K that only the 32-blocks fit, no imatrix (constant importance), an embedding
    return [_case(90, 256, 0), _case(33, 512, 1), _case(40, 256, 2, imatrix=False), _case(21, 96, 3),
            _case(70, 256, 4, lookup=True)]


def test_batched_errors_equal_per_tensor(cases, monkeypatch):
    # small chunks (cut inside tensors and across them; quantize's own too: NVFP4_G16's global scale is the chunk's)
    # and batches (a batch boundary inside the list)
    for mod in (errors, base):
        monkeypatch.setattr(mod, "chunk_weights", lambda device, *args, **kwargs: 2560)
    alone = [measure_errors(w, FORMATS, rw, imatrix=im, seed=i) for i, (w, rw, im) in enumerate(cases)]
    samples = [sample_tensor(w, rw, imatrix=im, seed=i) for i, (w, rw, im) in enumerate(cases)]
    together = measure_samples(samples, FORMATS, batch_weights=6 * 256 * 40)
    assert together == alone
    assert list(together[3]) == ["Q4_0", "MXFP4", "NVFP4_G16", "F16"]  # K = 96: the 256-block formats left out
    assert [s.constant for s in samples] == [False, False, True, False, True]
    for s, errs in zip(samples, together):
        for f, te in errs.items():  # the decoded rows are quantize's on the same rows, bit for bit
            d = dequantize(quantize(s.rows, f, s.imatrix if f != "F16" else None), f) - s.rows
            assert te.weighted_rel == float((s.weights * (d * d * s.imp).sum(1).double()).sum()) / float(s.ref[0])
        assert errs["IQ2_XXS" if "IQ2_XXS" in errs else "Q4_0"].kld_pred > errs["F16"].kld_pred > 0


def _experts_layer():
    """(ExpertStats, experts module, row-weight totals) of layer 1 of the tiny Qwen2-MoE after a short calibration."""
    from test_moe_analysis import _model

    from dynaquant.analysis.stats import collect_stats

    model = _model("qwen2moe")
    chunks = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2))
    stats = collect_stats(model, chunks, fisher_sequences=1, progress=False)
    name = "model.layers.1.mlp.experts"
    return stats.experts[name], model.get_submodule(name), dict(total_tokens=stats.tokens, fisher_total=stats.fisher_tokens)


def test_expert_errors_batched_equal_per_expert():
    from dynaquant.analysis import experts as moe
    from dynaquant.sources.experts import PROJS, expert_weight

    st, mod, kw = _experts_layer()
    for proj in PROJS:
        got, fallback = moe.measure_expert_errors(mod, proj, st, ["Q4_0", "Q8_0"], **kw)
        w = expert_weight(mod, proj).detach()
        per = []
        rows = moe.expert_sample_rows(st.n_expert, w.shape[1])  # (the stack's sample spread over its experts)
        for e in range(st.n_expert):
            rw, imp, _ = st.row_weights(proj, e, **kw)
            per.append(measure_errors(w[e], ["Q4_0", "Q8_0"], rw, imatrix=imp, seed=e, rows=rows))
        assert got == moe.combine_expert_errors(st, per)
        assert got["Q4_0"].kld_pred == sum(p["Q4_0"].kld_pred for p in per) > got["Q8_0"].kld_pred > 0
        assert got["Q4_0"].size_bytes == w.numel() // 32 * 18 and fallback == st.unrouted()


def test_deferred_fisher_equals_direct_measurement(cases):
    """Errors measured before the Fisher is known (rows sampled by output energy, each row's output error kept) and
    weighted later give the predicted KLD measured with the Fisher at hand on the same rows; the other figures are
    the same measurement's."""
    for i, (w, rw, im) in enumerate(cases[:4]):  # the linear cases (the embedding's lookup term is not deferred)
        direct = measure_samples([sample_tensor(w, rw, imatrix=im, seed=i, score="output")], FORMATS)[0]
        early = sample_tensor(w, errors.RowWeights(hessian=rw.hessian), imatrix=im, seed=i, score="output")
        deferred = measure_samples([early], FORMATS, per_row=True)[0]
        assert list(deferred) == list(direct)
        for f, re in deferred.items():
            assert re.error.kld_pred == 0.0 and re.out_err.shape == re.index.shape == re.weights.shape
            got = re.with_fisher(rw.fisher)
            assert (got.size_bytes, got.bpw, got.weighted_rel, got.output_rel) == \
                (direct[f].size_bytes, direct[f].bpw, direct[f].weighted_rel, direct[f].output_rel)
            assert got.kld_pred == pytest.approx(direct[f].kld_pred, rel=1e-12, abs=0)
        # the sample follows the output energy: the rows with the largest W H W^T are always in it
        energy = ((w @ rw.hessian) * w).sum(1)
        top = max(1, early.index.numel() // 16) if early.index.numel() < w.shape[0] else w.shape[0]
        assert set(torch.argsort(energy, descending=True)[:top].tolist()) <= set(early.index.tolist())
    with pytest.raises(ValueError, match="unknown score"):
        sample_tensor(cases[0][0], cases[0][1], score="bogus")


def test_deferred_expert_errors_equal_direct():
    """A stack of experts measured in the forward sweep (no Fisher yet) and weighted by each expert's Fisher at the
    end equals the measurement with the Fisher known, on the same rows."""
    from dynaquant.analysis import experts as moe
    from dynaquant.sources.experts import PROJS, expert_weight

    st, mod, kw = _experts_layer()
    for proj in PROJS:
        samples, fallback = moe.expert_samples(mod, proj, st, defer_fisher=True, **kw)
        got = moe.expert_errors_with_fisher(st, proj, measure_samples(samples, ["Q4_0", "Q8_0"], per_row=True), **kw)
        w = expert_weight(mod, proj).detach()
        direct = []
        rows = moe.expert_sample_rows(st.n_expert, w.shape[1])
        for e in range(st.n_expert):
            rw, imp, _ = st.row_weights(proj, e, **kw)
            direct.append(measure_samples([sample_tensor(w[e], rw, imatrix=imp, seed=e, score="output", rows=rows)],
                                          ["Q4_0", "Q8_0"])[0])
        want = moe.combine_expert_errors(st, direct)
        for f in want:
            assert got[f].size_bytes == want[f].size_bytes and got[f].output_rel == want[f].output_rel
            # (row_weights rounds G_e to float32; the deferred weighting keeps float64)
            assert got[f].kld_pred == pytest.approx(want[f].kld_pred, rel=1e-6) and got[f].kld_pred > 0
        assert fallback == st.unrouted()


def test_experts_beyond_the_bound_keep_diagonal_second_moments(monkeypatch):
    """Experts whose (E, K, K) second moments exceed EXPERT_HESSIAN_BYTES keep their diagonals (E, K) alone: the same
    imatrix, and errors measured with H taken as diagonal (equal to passing the diagonal matrix)."""
    from test_moe_analysis import _model

    from dynaquant.analysis import experts as moe
    from dynaquant.analysis.stats import collect_stats
    from dynaquant.sources.experts import expert_weight

    model = _model("qwen2moe")
    chunks = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2))
    full = collect_stats(model, chunks, fisher_sequences=1, progress=False)
    monkeypatch.setattr(moe, "EXPERT_HESSIAN_BYTES", 0)
    diag = collect_stats(model, chunks, fisher_sequences=1, progress=False)
    name = "model.layers.1.mlp.experts"
    sf, sd = full.experts[name], diag.experts[name]
    assert sf.hessian_sum["gate_up"].dim() == 3 and sd.hessian_sum["gate_up"].dim() == 2
    for proj in ("gate_proj", "down_proj"):
        torch.testing.assert_close(sd.imatrix(proj)[0], sf.imatrix(proj)[0], rtol=1e-5, atol=1e-6)
    kw = dict(total_tokens=diag.tokens, fisher_total=diag.fisher_tokens)
    mod = model.get_submodule(name)
    got, _ = moe.measure_expert_errors(mod, "down_proj", sd, ["Q4_0"], **kw)
    w = expert_weight(mod, "down_proj").detach()
    per = []
    rows = moe.expert_sample_rows(sd.n_expert, w.shape[1])
    for e in range(sd.n_expert):
        rw, imp, _ = sd.row_weights("down_proj", e, **kw)
        assert rw.hessian.dim() == 1
        dense = RowWeights(rw.fisher, torch.diag(rw.hessian))
        per.append(measure_errors(w[e], ["Q4_0"], dense, imatrix=imp, seed=e, rows=rows))
    want = moe.combine_expert_errors(sd, per)["Q4_0"]
    assert got["Q4_0"].kld_pred == pytest.approx(want.kld_pred, rel=1e-5) and got["Q4_0"].kld_pred > 0
    assert got["Q4_0"].output_rel == pytest.approx(want.output_rel, rel=1e-5)
    sd.drop_hessians()
    assert sd.imatrix("up_proj")[0].shape == (sd.n_expert, 256)


def test_a_stored_type_is_measured_as_the_source_bytes(cases):
    """A tensor of a GGUF source in the type it is stored in (``ErrorSample.stored``) keeps the source's bytes in the
    file: that format's error is 0 without encoding (re-encoding an affine grid does not give it back exactly); the other
    formats' errors are those measured without it."""
    w, rw, im = cases[0]
    x = dequantize(quantize(w, "Q4_1"), "Q4_1")  # weights on a Q4_1 grid, as a Q4_1 source decodes
    plain = measure_samples([sample_tensor(x, rw, imatrix=im)], FORMATS + ["Q4_1"])[0]
    kept = measure_samples([sample_tensor(x, rw, imatrix=im, stored="Q4_1")], FORMATS + ["Q4_1"])[0]
    assert plain["Q4_1"].weighted_rel > 0
    assert kept["Q4_1"].weighted_rel == kept["Q4_1"].output_rel == kept["Q4_1"].kld_pred == 0
    assert kept["Q4_1"].size_bytes == plain["Q4_1"].size_bytes
    assert {f: e for f, e in kept.items() if f != "Q4_1"} == {f: e for f, e in plain.items() if f != "Q4_1"}
