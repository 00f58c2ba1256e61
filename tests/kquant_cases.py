"""Inputs and step-by-step comparisons shared by the tests of the K-quant searches' fast paths (the Triton kernels,
tests/test_kquant_fused.py; the compiled CPU versions, tests/test_kquant_native.py): each fast path against its torch
reference in :mod:`dynaquant.quant.codecs._kquant_search`, on the reference's own intermediate results. The tests keep
their own assertions."""

from __future__ import annotations

import torch

from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs import get_codec

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def hard_blocks(n: int, seed: int = 0, device="cpu"):
    """(n, 256) weights of mixed scales with hard cases, and their importance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 256, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    w = torch.exp(torch.randn(n, 256, generator=g)) + 0.01
    x[0] = 0.0  # an all-zero block
    x[1, :100] = 0.0  # zero sub-blocks
    x[2] = x[2].abs()  # one sign only
    x[3] *= 1e4
    x[4] *= 1e-6
    x[5, 7] = 40.0  # an outlier
    return x.to(device), w.to(device)


def split(name, x, w):
    """(codec, x, w as (n_super, n_sub, sub_size))."""
    codec = get_codec(name)
    n = x.shape[0]
    return codec, x.reshape(n, codec.n_sub, -1), w.reshape(n, codec.n_sub, -1)


def step1(sp, x3, w3, impl):
    """Step 1 by ``impl`` (the fast path's ``*_search_scales``) and by the reference: ``(a_impl, a_ref, e_impl, e_ref,
    close)``, ``a`` the scales (affine: ``A``), ``e`` each sub-block's least-squares error with the nearest codes
    (float64), ``close`` where the results agree to rtol 1e-5."""

    def sub_error(codes_fn):
        return ((w3 * (x3 - codes_fn()) ** 2).sum(-1)).double()

    if isinstance(sp, kqs.AffSearch):
        (a_t, b_t), (a_f, b_f) = kqs.aff_search_scales_torch(x3, w3, sp), impl(x3, w3, sp)

        def err(a, b):  # least-squares error of x ~ a q + b with the nearest codes
            q = kqs.aff_codes(x3, a.float(), (-b).float(), sp.qmax)
            return sub_error(lambda: a.float().unsqueeze(-1) * q + b.float().unsqueeze(-1))

        close = torch.isclose(a_f, a_t, rtol=1e-5, atol=0) & torch.isclose(b_f, b_t, rtol=1e-5, atol=1e-30)
        return a_f, a_t, err(a_f, b_f), err(a_t, b_t), close
    a_t, a_f = kqs.sym_search_scales_torch(x3, w3, sp), impl(x3, w3, sp)

    def err(a):
        return sub_error(lambda: a.float().unsqueeze(-1) * kqs.sym_codes(x3, a.float(), sp.qlo, sp.qhi))

    return a_f, a_t, err(a_f), err(a_t), torch.isclose(a_f, a_t, rtol=1e-5, atol=0)


def step2(sp, x3, w3, pick, clip: bool = False):
    """Step 2 (one round's pick) by ``pick`` and by the reference, from the reference's step 1: ``(got, want, e_got,
    e_want, cfg)``, ``e`` the pick's ranking error per super-block, ``cfg`` the reference's configuration; ``clip``:
    the symmetric search's clip-step candidates, ranked with clipping, instead of its grid."""
    if isinstance(sp, kqs.AffSearch):
        a, b = kqs.aff_search_scales_torch(x3, w3, sp)
        q = kqs.aff_codes(x3, a.float(), (-b).float(), sp.qmax)
        wx = w3 * x3
        ts = torch.tensor(sp.d_steps, dtype=torch.float32, device=x3.device)
        ref, dc, mc, _ = kqs.aff_round_candidates(w3, wx, q, w3.sum(-1).double(), wx.sum(-1).double(), ts, sp.kmax, None)
        got, want = pick(ref, sp.kmax, dc, mc), kqs.aff_pick_torch(ref, sp.kmax, dc, mc)

        def err(r):
            return kqs.aff_eval_error(ref, sp.kmax, r[0][:, None], r[1][:, None])[:, 0]

        return got, want, err(got), err(want), kqs.AffConfig(*want)
    a = kqs.sym_search_scales_torch(x3, w3, sp)
    q = kqs.sym_codes(x3, a.float(), sp.qlo, sp.qhi)
    sxq, sqq = (w3 * x3 * q).sum(-1).double(), (w3 * q * q).sum(-1).double()
    a = kqs.safe_div(sxq, sqq)
    am = a.gather(1, a.abs().argmax(1, keepdim=True))
    ts = torch.tensor(sp.clip_steps if clip else sp.d_steps, dtype=torch.float64, device=x3.device)
    cand = kqs.f16_candidates(torch.cat([am / ts, -am / ts], 1))
    args = (x3, w3, a.float(), sqq.float(), sp, cand, clip)
    got, want = pick(*args), kqs.sym_pick_torch(*args)

    def err(r):
        return kqs.sym_clip_error(*args[:5], r[0][:, None], torch.full_like(r[0][:, None], clip, dtype=torch.bool))[:, 0]

    return got, want, err(got), err(want), kqs.SymConfig(*want)


def step3(sp, x3, w3, cfg, refine):
    """Step 3 by ``refine`` and by the reference from ``cfg``: ``((cfg_got, err_got), (cfg_want, err_want), same)``,
    ``same`` the super-blocks whose integer scales (and mins) agree."""
    if isinstance(sp, kqs.AffSearch):
        (c_got, e_got), (c_want, e_want) = refine(x3, w3, cfg, sp), kqs.aff_refine_torch(x3, w3, cfg, sp)
        same = (c_got.ks == c_want.ks).all(-1) & (c_got.km == c_want.km).all(-1)
    else:
        (c_got, e_got), (c_want, e_want) = refine(x3, w3, cfg, sp), kqs.sym_refine_torch(x3, w3, cfg, sp)
        same = (c_got.k == c_want.k).all(-1)
    return (c_got, e_got), (c_want, e_want), same


def outlier_blocks(n: int, seed: int = 0, device="cpu"):
    """(n, 256) weights whose super-blocks each have one sub-block of 16 (a random one) scaled 40-100x with importance
    1e-3 (a low-importance outlier sub-block, which sets ``max|A|``), the others N(0, 1) of importance in [0.5, 2]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, 16, generator=g)
    w = torch.rand(n, 16, 16, generator=g) * 1.5 + 0.5
    j = torch.randint(0, 16, (n,), generator=g)
    rows = torch.arange(n)
    x[rows, j] *= 40 + 60 * torch.rand(n, 1, generator=g)
    w[rows, j] = 1e-3
    return x.reshape(n, 256).to(device), w.reshape(n, 256).to(device)


def clip_pick_inputs(sp, x3, w3):
    """Step 2's inputs for the clip steps: ``(x, w, a, sqq, spec, cand, True)`` from the reference's step 1, the
    candidates ``+-max|A| / t`` for ``t`` in ``clip_steps`` as sym_encode_torch makes them."""
    a = kqs.sym_search_scales_torch(x3, w3, sp)
    q = kqs.sym_codes(x3, a.float(), sp.qlo, sp.qhi)
    sxq, sqq = (w3 * x3 * q).sum(-1).double(), (w3 * q * q).sum(-1).double()
    a = kqs.safe_div(sxq, sqq)
    am = a.gather(1, a.abs().argmax(1, keepdim=True))
    tc = torch.tensor(sp.clip_steps, dtype=torch.float64, device=x3.device)
    cand = kqs.f16_candidates(torch.cat([am / tc, -am / tc], 1))
    return x3, w3, a.float(), sqq.float(), sp, cand, True


def two_level_blocks(n: int, seed: int = 0, device="cpu"):
    """(n, 256) all-negative weights (``-2 |N(0, 1)|`` times a lognormal block scale) with one outlier, ``-40`` times
    that scale, at a random element, and lognormal importance (sigma 1.5), as the first row's second block of
    tests/test_codecs_kquants.py's ``_weights``. Step 1's best fits of the outlier's sub-block have two levels (the
    outlier and its fifteen neighbours' weighted mean) at any code spacing: ties, which rounding decides."""
    g = torch.Generator().manual_seed(seed)
    s = torch.exp(0.7 * torch.randn(n, 1, generator=g))
    x = -2 * torch.randn(n, 256, generator=g).abs() * s
    j = torch.randint(0, 256, (n,), generator=g)
    x[torch.arange(n), j] = -40 * s[:, 0]
    w = torch.exp(1.5 * torch.randn(n, 256, generator=g))
    return x.to(device), w.to(device)
