"""IQ1_S/IQ1_M's first search step, the best free scale of every sub-block, as one Triton kernel.

:func:`sub_scales` repeats :func:`dynaquant.quant.codecs.iq1.sub_scales_torch` (step 1 of
:func:`dynaquant.quant.codecs.iq1._encode`) bit for bit: for each of R trial scales ``amax * r`` of a
sub-block, the free ternary rounding at both delta signs, the better sign per group (IQ1_M) or per
sub-block (IQ1_S), the least-squares scale given those levels and its error; the trial of least
error gives the sub-block's scale ``t`` and curvature ``h``. The reference's torch passes write
(blocks, S, R, G, 8) temporaries, R = 6 times the weight; here one program holds a tile of whole
sub-blocks and writes two floats per sub-block.

Every sum is formed halves first (``v[:k] + v[k:]``, recursively; the reference's
:func:`dynaquant.quant.codecs.iq1.tree_sum`) by additions over axes of two, whose result does not
depend on the reduction's order; the launch disables multiply-add fusion, so each product and
difference is rounded as in torch, and divisions are ``div_rn`` (IEEE; Triton's ``/``
is an approximate division on CUDA). Importing this module imports Triton; :mod:`dynaquant.kernels`
registers :func:`sub_scales` as the fast path ``iq1.sub_scales`` for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sub_scales", "sub_scales_kernel"]

# Elements of one (sub-blocks, SUB) register tile.
_TILE = 2048


@triton.jit
def _halve(v, A: tl.constexpr, H: tl.constexpr):
    """(A, 2H) -> (A, H): ``v[:, k] + v[:, H + k]`` (one addition each: any reduction order gives it)."""
    return tl.sum(tl.reshape(v, (A, 2, H)), axis=1)


@triton.jit
def _total(v, A: tl.constexpr, L: tl.constexpr):
    """(A, L) -> (A,): the sum of each row, halves first (L a power of two, 2 .. 32)."""
    if L >= 32:
        v = _halve(v, A, 16)
    if L >= 16:
        v = _halve(v, A, 8)
    if L >= 8:
        v = _halve(v, A, 4)
    if L >= 4:
        v = _halve(v, A, 2)
    return tl.reshape(_halve(v, A, 1), (A,))


@triton.jit
def _free_rounding(x, w, ts, sg, BS: tl.constexpr, SUB: tl.constexpr):
    """Levels ``clamp(round(x / ts - sg), -1, 1) + sg`` of a (BS, SUB) tile and each group's error (BS * SUB // 8,)."""
    u = tl.div_rn(x, ts) - sg
    q = ((u > 0.5).to(tl.float32) - (u < -0.5).to(tl.float32)) + sg
    d = x - ts * q
    return q, _total(tl.reshape(w * (d * d), (BS * (SUB // 8), 8)), BS * (SUB // 8), 8)


@triton.jit
def sub_scales_kernel(
    x_ptr,
    w_ptr,
    ratio_ptr,
    t_ptr,
    h_ptr,
    n_sub,
    delta,
    R: tl.constexpr,
    SUB: tl.constexpr,
    BS: tl.constexpr,
    PER_GROUP: tl.constexpr,
):
    # BS sub-blocks of SUB weights a program, one (BS, SUB) tile; the R trials in turn.
    G: tl.constexpr = SUB // 8
    pid = tl.program_id(0)
    subs = pid.to(tl.int64) * BS + tl.arange(0, BS).to(tl.int64)
    smask = subs < n_sub
    off = subs[:, None] * SUB + tl.arange(0, SUB)[None, :]
    x = tl.load(x_ptr + off, mask=smask[:, None], other=0.0)
    w = tl.load(w_ptr + off, mask=smask[:, None], other=0.0)
    amax = tl.max(tl.abs(x), axis=1)
    wx = w * x
    best_e = tl.full((BS,), float("inf"), dtype=tl.float32)
    best_t = tl.zeros((BS,), dtype=tl.float32)
    best_h = tl.zeros((BS,), dtype=tl.float32)
    for r in tl.static_range(R):
        ts = tl.maximum(amax * tl.load(ratio_ptr + r), 1e-30)[:, None]
        qp, ep = _free_rounding(x, w, ts, delta, BS, SUB)
        qm, em = _free_rounding(x, w, ts, -delta, BS, SUB)
        if PER_GROUP:
            neg = tl.reshape(em < ep, (BS * G, 1))
            q = tl.reshape(tl.where(neg, tl.reshape(qm, (BS * G, 8)), tl.reshape(qp, (BS * G, 8))), (BS, SUB))
        else:
            neg = _total(tl.reshape(em, (BS, G)), BS, G) < _total(tl.reshape(ep, (BS, G)), BS, G)
            q = tl.where(neg[:, None], qm, qp)
        num = _total(wx * q, BS, SUB)
        den = tl.maximum(_total((w * q) * q, BS, SUB), 1e-30)
        t = tl.div_rn(num, den)
        t = tl.where(t < 0, 0.0, t)  # keeps -0.0, as the reference
        d = x - t[:, None] * q
        e = _total(w * (d * d), BS, SUB)
        upd = e < best_e
        best_e = tl.where(upd, e, best_e)
        best_t = tl.where(upd, t, best_t)
        best_h = tl.where(upd, den, best_h)
    tl.store(t_ptr + subs, best_t, mask=smask)
    tl.store(h_ptr + subs, best_h, mask=smask)


def sub_scales(
    x: torch.Tensor, w: torch.Tensor, ratios: torch.Tensor, sub: int, per_group: bool, delta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best free scale of every sub-block (fused); as :func:`dynaquant.quant.codecs.iq1.sub_scales_torch`.

    Args:
        x, w: (n, 256) float32 weights and importance (>= 0).
        ratios: (R,) float32 trial scales as fractions of the sub-block's max ``|x|``.
        sub: weights per sub-block (32 for IQ1_S, 16 for IQ1_M).
        per_group: the delta sign is chosen per group of 8 (IQ1_M), else per sub-block.
        delta: the grid shift.
    Returns:
        (t, h): (n, 256 // sub) float32 scale and curvature ``sum w q**2`` of the best trial.
    Raises:
        ValueError: shapes disagree, or ``sub`` is not 16 or 32.
    """
    if x.ndim != 2 or x.shape[1] != 256 or w.shape != x.shape or ratios.ndim != 1 or sub not in (16, 32):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, ratios {tuple(ratios.shape)}, sub {sub}")
    n_sub = x.shape[0] * (256 // sub)
    t = torch.empty(x.shape[0], 256 // sub, dtype=torch.float32, device=x.device)
    h = torch.empty_like(t)
    if n_sub == 0:
        return t, h
    bs = _TILE // sub
    sub_scales_kernel[(triton.cdiv(n_sub, bs),)](
        x.to(torch.float32).contiguous(),
        w.to(torch.float32).contiguous(),
        ratios.to(device=x.device, dtype=torch.float32).contiguous(),
        t,
        h,
        n_sub,
        float(delta),
        R=ratios.shape[0],
        SUB=sub,
        BS=bs,
        PER_GROUP=per_group,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return t, h
