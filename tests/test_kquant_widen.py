"""Q2_K's widening of step 1's fits (``AffSearch.widen``, :func:`dynaquant.quant.codecs._kquant_search.aff_widen`).

A sub-block whose step-1 codes use two levels (an outlier and fifteen weights on one level) fits as well at any code
spacing; which spacing step 1 keeps was a rounding, and the widest set step 2's grid for the whole super-block (Q2_K on
tests/test_codecs_kquants.py ``test_device``'s input: 13% more error on CUDA than on the CPU). Widened, every tied
fit gives the same encoding, and the torch, compiled and Triton searches agree (tests/test_kquant_fused.py).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from kquant_cases import hard_blocks, split, two_level_blocks

import dynaquant.kernels  # noqa: F401  (registers the CPU fast paths)
from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs import get_codec

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _fit_error(x3, w3, a, b, qmax):
    """Each sub-block's error of ``x ~ a q + b`` with the nearest codes, (n_super, n_sub) float64."""
    q = kqs.aff_codes(x3, a.float(), (-b).float(), qmax)
    return (w3 * (x3 - (a.float().unsqueeze(-1) * q + b.float().unsqueeze(-1))) ** 2).sum(-1).double()


def test_widen_spreads_narrow_codes_and_keeps_the_rest():
    """Hand-made fits of Q2_K sub-blocks (qmax 3): codes {0, 1} -> A / 3, B kept; {1, 2} -> A / 3, B the level of code
    1; {0, 2} -> 2 A / 3; {0, 1, 2, 3}, one level, a positive lowest level: unchanged."""
    lv = torch.tensor
    # x on the levels of A = 3, B = -9 (codes 0..3: -9, -6, -3, 0), one code list a sub-block
    codes = [[0, 1], [1, 2], [0, 2], [0, 1, 2, 3], [2, 2]]
    x = torch.stack([-9.0 + 3.0 * lv(c * 8, dtype=torch.float32)[:16] for c in codes]).reshape(1, 5, 16)
    a = torch.full((1, 5), 3.0, dtype=torch.float64)
    b = torch.full((1, 5), -9.0, dtype=torch.float64)
    # a positive lowest level: x on 1 + 3 q, fit A = 3, B = 1 (not a fit step 1 returns, B > 0: left alone)
    xp = 1.0 + 3.0 * lv([0, 1] * 8, dtype=torch.float32).reshape(1, 1, 16)
    x = torch.cat([x, xp], 1)
    a = torch.cat([a, lv([[3.0]], dtype=torch.float64)], 1)
    b = torch.cat([b, lv([[1.0]], dtype=torch.float64)], 1)
    a2, b2 = kqs.aff_widen(x, a, b, 3)
    assert a2.dtype == b2.dtype == torch.float64
    assert a2[0].tolist() == [1.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert b2[0].tolist() == [-9.0, -6.0, -9.0, -9.0, -9.0, 1.0]
    q = kqs.aff_codes(x, a2.float(), (-b2).float(), 3)
    assert all(q[0, j].unique().tolist() == [0.0, 3.0] for j in range(3))
    w = torch.ones_like(x)
    assert torch.equal(_fit_error(x, w, a2, b2, 3), _fit_error(x, w, a, b, 3))  # exact levels: no error either way


@pytest.mark.parametrize("name", ["Q2_K", "Q4_K", "Q5_K"])
def test_widen_never_fits_worse(name):
    """On step 1's own fits of hard and two-level blocks, the widened fit's error is no higher (its levels hold the
    used ones), and the two-level blocks' outlier sub-blocks are widened."""
    x = torch.cat([hard_blocks(24, 1)[0], two_level_blocks(24, 2)[0]])
    w = torch.cat([hard_blocks(24, 1)[1], two_level_blocks(24, 2)[1]])
    codec, x3, w3 = split(name, x, w)
    sp = codec.search
    a, b = kqs.aff_search_scales_torch(x3, w3, sp)
    a2, b2 = kqs.aff_widen(x3, a, b, sp.qmax)
    e, e2 = _fit_error(x3, w3, a, b, sp.qmax), _fit_error(x3, w3, a2, b2, sp.qmax)
    assert (e2 <= e * (1 + 1e-5) + 1e-6 * e.amax(-1, keepdim=True)).all()
    assert (a2 <= a).all() and (b2 <= 0).all() and (a2 >= 0).all()
    if name == "Q2_K":
        assert (a2 < a)[24:].any(-1).float().mean() >= 0.5


def test_tied_step1_fits_give_one_encoding(monkeypatch):
    """Step 1 returning the two-level sub-blocks' fit at code spacing 1, 2 or 3 (codes {0, 1}, {0, 2}, {0, 3}; the
    same fit): the same Q2_K configuration, bit for bit (unwidened, spacing 1 cost 2-3x the error on such blocks)."""
    codec, x3, w3 = split("Q2_K", *two_level_blocks(12, 3))
    sp = codec.search
    a, b = kqs.aff_search_scales_torch(x3, w3, sp)
    q = kqs.aff_codes(x3, a.float(), (-b).float(), sp.qmax)
    lo, hi = q.amin(-1, keepdim=True), q.amax(-1, keepdim=True)
    two = ((q == lo) | (q == hi)).all(-1) & (hi > lo).squeeze(-1)
    assert two.any(-1).float().mean() >= 0.75
    delta, v = a * (hi - lo).squeeze(-1).double(), a * lo.squeeze(-1).double() + b
    cfgs = []
    for k in (1, 2, 3):
        fa, fb = torch.where(two, delta / k, a), torch.where(two, v, b)
        monkeypatch.setattr(kqs, "aff_search_scales_torch", lambda x, w, spec, iters=3, fa=fa, fb=fb: (fa, fb))
        cfgs.append(kqs.aff_encode_torch(x3, w3, sp, "torch"))
    for cfg in cfgs[1:]:
        for f in ("d", "dmin", "ks", "km"):
            assert torch.equal(getattr(cfg, f), getattr(cfgs[0], f)), f


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")
def test_compiled_whole_search_widens_as_the_torch_glue():
    """``kquant.aff_encode`` (C) on two-level blocks: the configuration of the torch glue over the same compiled
    steps, and so the torch reference's error."""
    from dynaquant.kernels.native import kquant as nk

    codec, x3, w3 = split("Q2_K", *two_level_blocks(48, 4))
    sp = codec.search
    got, want = nk.aff_encode(x3, w3, sp), kqs.aff_encode_torch(x3, w3, sp, "native")
    same = (got.d == want.d) & (got.dmin == want.dmin) & (got.ks == want.ks).all(-1) & (got.km == want.km).all(-1)
    assert same.float().mean() >= 0.95, same.float().mean()
    x, w = x3.reshape(-1, 256), w3.reshape(-1, 256)
    e = {be: (w * (x - codec.decode_blocks(codec.encode_blocks(x, w, backend=be))) ** 2).sum().item()
         for be in ("native", "torch")}
    assert abs(e["native"] - e["torch"]) <= 0.01 * e["torch"], e  # (unwidened: 1.5x apart)
    assert get_codec("Q2_K").search.widen and not get_codec("Q4_K").search.widen
