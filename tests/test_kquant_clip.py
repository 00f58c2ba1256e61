"""Step 2 of the symmetric K-quant search past its grid (``SymSearch.clip_steps``, Q3_K): candidate ``d`` that clip
the largest sub-block scales, ranked with the exact error of a clamped sub-block (``sym_clip_error``), in the torch
reference and the compiled CPU search (the Triton kernel: tests/test_kquant_fused.py)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch
from kquant_cases import clip_pick_inputs, outlier_blocks

import dynaquant.kernels  # noqa: F401  (registers the CPU fast paths)
from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs import get_codec

HAS_CC = shutil.which(os.environ.get("CC") or "cc") is not None


def _brute_force(x3, w3, a, sqq, spec, d):
    """sym_clip_error written out one candidate and sub-block at a time, (n_super, C) float64."""
    n, c = d.shape
    out = torch.zeros(n, c, dtype=torch.float64)
    for b in range(n):
        for i in range(c):
            dd = d[b, i]
            f = torch.floor(a[b] * kqs.inv(dd))
            clamped = (f < spec.klo) | (f >= spec.khi)
            k0 = f.clamp(spec.klo, spec.khi)
            k1 = (k0 + 1).clamp(spec.klo, spec.khi)
            quad = torch.minimum(sqq[b] * (dd * k0 - a[b]) ** 2, sqq[b] * (dd * k1 - a[b]) ** 2).double()
            dl = dd * k0
            exact = kqs.sym_error(x3[b], w3[b], dl, kqs.sym_codes(x3[b], dl, spec.qlo, spec.qhi))
            use = clamped & (int(clamped.sum()) <= spec.clip_max)
            out[b, i] = torch.where(use, exact, quad).sum()
    return out


def test_clip_error_is_the_exact_error_of_clamped_sub_blocks():
    codec = get_codec("Q3_K")
    x, w = outlier_blocks(6, 0)
    x3, w3, a, sqq, sp, cand, _ = clip_pick_inputs(codec.search, x.reshape(6, 16, 16), w.reshape(6, 16, 16))
    for spec in (sp, dataclasses.replace(sp, clip_max=3)):
        got = kqs.sym_clip_error(x3, w3, a, sqq, spec, cand, torch.ones_like(cand, dtype=torch.bool))
        want = _brute_force(x3, w3, a, sqq, spec, cand)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=0)
    quad = kqs.sym_clip_error(x3, w3, a, sqq, sp, cand, torch.zeros_like(cand, dtype=torch.bool))
    assert torch.equal(quad, kqs.sym_eval_error(a, sqq, sp.klo, sp.khi, cand))
    assert not torch.allclose(quad.double(), _brute_force(x3, w3, a, sqq, sp, cand), rtol=1e-3)  # the exact path ran


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=pytest.mark.skipif(not HAS_CC, reason="cc"))])
def test_clip_steps_clip_a_low_importance_outlier_sub_block(backend):
    """With one outlier sub-block of little importance a super-block, Q3_K's encode clips it (its integer scale at
    the end of the range, below its least-squares scale) and its weighted error is well below the grid's alone."""
    codec = get_codec("Q3_K")
    x, w = outlier_blocks(48, 1)
    grid_only = dataclasses.replace(codec.search, clip_steps=())
    err = {}
    for tag, spec in (("clip", codec.search), ("grid", grid_only)):
        cfg = kqs.sym_encode(x.reshape(48, 16, 16), w.reshape(48, 16, 16), spec, backend)
        dl = cfg.sub_scales()
        q = kqs.sym_codes(x.reshape(48, 16, 16), dl, spec.qlo, spec.qhi)
        err[tag] = kqs.sym_error(x.reshape(48, 16, 16), w.reshape(48, 16, 16), dl, q).sum(-1)
        if tag == "clip":
            clamped = (cfg.k == spec.klo) | (cfg.k == spec.khi)
            assert clamped.any(-1).float().mean() >= 0.5
    assert err["clip"].sum() < 0.95 * err["grid"].sum(), (err["clip"].sum(), err["grid"].sum())
    # the clip steps' pick is kept by the exact error: a super-block worse than the grid's only through round 2
    assert (err["clip"] <= err["grid"] * 1.01).float().mean() >= 0.85


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_compiled_pick_matches_the_reference_past_the_grid():
    """The compiled step 2 with the clip steps against the reference, on outlier blocks (the exact errors in play):
    the same candidate and integer scales but for near-ties, never a higher ranking error."""
    from dynaquant.kernels.native import kquant as nk

    codec = get_codec("Q3_K")
    x, w = outlier_blocks(64, 2)
    args = clip_pick_inputs(codec.search, x.reshape(64, 16, 16), w.reshape(64, 16, 16))
    (d_n, k_n), (d_t, k_t) = nk.sym_pick(*args), kqs.sym_pick_torch(*args)
    same = (d_n == d_t) & (k_n == k_t).all(-1)
    assert same.float().mean() >= 0.95
    cand = args[5]
    e = kqs.sym_clip_error(*args[:5], cand, torch.ones_like(cand, dtype=torch.bool))
    quad = kqs.sym_eval_error(args[2], args[3], args[4].klo, args[4].khi, cand)

    def err(d, e):
        return e.gather(1, (cand == d[:, None]).float().argmax(1, keepdim=True))[:, 0]

    assert (err(d_n, e) <= err(d_t, e) * (1 + 1e-5)).all()
    assert (err(d_t, e) < err(d_t, quad)).float().mean() >= 0.5  # the exact errors decided most picks


def test_quality_vs_llama_cpp_with_outliers():
    """Weights with 0.2% heavy-tailed outliers and a lognormal imatrix (benchmarks/encode_speed.py's kind): Q3_K's
    weighted error below llama.cpp's with margin (it was 1.02x before the clip steps), Q6_K's below too."""
    pytest.importorskip("llama_cpp")
    from ggml_ref import error_ratios

    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4096, generator=g) * 0.02 * torch.exp(0.3 * torch.randn(32, 1, generator=g))
    out = (torch.rand(32, 4096, generator=g) < 0.002).nonzero(as_tuple=True)
    t3 = torch.randn(out[0].numel(), generator=g) / torch.sqrt((torch.randn(out[0].numel(), 3, generator=g) ** 2).mean(1))
    x[out] *= 4 + t3.abs() * 8
    imatrix = torch.exp(torch.randn(4096, generator=g))
    q3 = error_ratios([(x, imatrix)], "Q3_K")
    q6 = error_ratios([(x, imatrix)], "Q6_K")
    assert np.all(q3 < 0.98), q3
    assert np.all(q6 < 0.95), q6
