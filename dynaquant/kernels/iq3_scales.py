"""IQ3_XXS / IQ3_S: the fp16 super-block scale ``d`` search's pick, fused (Triton).

:func:`pick` has the signature and the contract of its torch reference,
:func:`dynaquant.quant.codecs._iq3_search.pick_torch`, bit for bit (float64, the reference's operations in its order,
no FMA contraction); :mod:`dynaquant.kernels` registers it as the fast path ``iq3.pick`` of the IQ3 codecs' scale pick
(:meth:`dynaquant.quant.codecs.iq3._IQ3._pick_d`). One program scores every candidate of a few super-blocks, sums each
candidate's 8 sub-block errors in registers, takes the first least total and the levels ``l`` of that candidate: the
(n, C, 8) float64 errors the former fast path wrote (``pick_errors``: 231 MB a 16M-weight chunk), torch's sum and
argmin over them and the winner's levels in ~15 torch ops are gone. The grid search itself is :mod:`.iq3_search`.
Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynaquant.quant.codecs import _kquant_search as kqs

__all__ = ["pick"]

# Super-blocks a program, each with all its candidates: a (_ROWS, C rounded up to a power of 2) tile, one element a
# thread in 8 warps for IQ3's 61-63 candidates. Offline sm_90 compiles (Triton 3.9's ptxas): 94 registers, no spills;
# 8 super-blocks in 4 warps spilled (255 registers, 48 bytes of stack: the float64 divisions of two elements a thread).
_ROWS = 4
_WARPS = 8


@triton.jit
def _level_errors(ad, s, cd):
    # a sub-block's two nearest odd multiples of cd (float64): (l0, l1) and their errors sgg (cd (2 l + 1) - A)**2,
    # the reference's operations in its order
    nz = cd != 0
    u = tl.where(nz, ad / tl.where(nz, cd, 1.0), 0.0)
    l0 = tl.minimum(tl.maximum(tl.floor((u - 1.0) * 0.5), 0.0), 15.0)
    l1 = tl.minimum(tl.maximum(l0 + 1.0, 0.0), 15.0)
    r0 = cd * (2.0 * l0 + 1.0) - ad
    r1 = cd * (2.0 * l1 + 1.0) - ad
    return l0, l1, s * r0 * r0, s * r1 * r1


@triton.jit
def _sub_error(a_ptr, sgg_ptr, row, rm, j: tl.constexpr, cd):
    # sub-block j's least error over its two levels, for every candidate column of cd (ROWS, BC)
    ad = tl.load(a_ptr + row * 8 + j, mask=rm, other=0.0).to(tl.float64)[:, None]
    s = tl.load(sgg_ptr + row * 8 + j, mask=rm, other=0.0)[:, None]
    _, _, e0, e1 = _level_errors(ad, s, cd)
    return tl.minimum(e0, e1)


@triton.jit
def _f16_candidate(v, TINY: tl.constexpr, F16MAX: tl.constexpr):
    # kquant_search.f16_candidates of float64 v, then clamp_min(0) (a -0.0 stays -0.0, as torch's): float32 fp16 values
    f = v.to(tl.float32)
    tiny = (f != 0) & (tl.abs(f) < TINY)
    sign = tl.where(f > 0, 1.0, tl.where(f < 0, -1.0, 0.0))
    f = tl.where(tiny, sign * TINY, f)
    f = tl.minimum(tl.maximum(f, -F16MAX), F16MAX).to(tl.float16).to(tl.float32)
    return tl.where(f < 0, 0.0, f)


@triton.jit
def _candidates(a_ptr, ts_ptr, ex_ptr, row, col, rm, am, T, E, c, TINY: tl.constexpr, F16MAX: tl.constexpr):
    # candidate col of each row: max A / (c t_col) for col < T, else the row's extra column col - T (float64 in)
    col = col + 0 * row  # the pointers in the masks' shape (a load broadcasts its mask, not always its pointer)
    st = rm & (col < T)
    cts = c * tl.load(ts_ptr + col, mask=st, other=1.0)
    v = tl.where(col < T, am.to(tl.float64) / cts,
                 tl.load(ex_ptr + row * E + (col - T), mask=rm & (col >= T) & (col < T + E), other=0.0))
    return _f16_candidate(v, TINY, F16MAX)


@triton.jit
def pick_kernel(a_ptr, sgg_ptr, ts_ptr, ex_ptr, d_ptr, lsc_ptr, n, T, E, c, ROWS: tl.constexpr, BC: tl.constexpr,
                TINY: tl.constexpr, F16MAX: tl.constexpr):
    # rows: ROWS super-blocks; columns: their T + E candidates (BC >= T + E slots, the rest masked)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    col = tl.arange(0, BC)
    rm = row < n
    m = rm[:, None] & (col[None, :] < T + E)
    am = tl.load(a_ptr + row * 8, mask=rm, other=0.0)
    for j in tl.static_range(1, 8):
        am = tl.maximum(am, tl.load(a_ptr + row * 8 + j, mask=rm, other=0.0))
    cand = _candidates(a_ptr, ts_ptr, ex_ptr, row[:, None], col[None, :], rm[:, None], am[:, None], T, E, c, TINY,
                       F16MAX)
    cd = c * cand.to(tl.float64)
    total = ((_sub_error(a_ptr, sgg_ptr, row, rm, 0, cd) + _sub_error(a_ptr, sgg_ptr, row, rm, 1, cd))
             + (_sub_error(a_ptr, sgg_ptr, row, rm, 2, cd) + _sub_error(a_ptr, sgg_ptr, row, rm, 3, cd))) \
        + ((_sub_error(a_ptr, sgg_ptr, row, rm, 4, cd) + _sub_error(a_ptr, sgg_ptr, row, rm, 5, cd))
           + (_sub_error(a_ptr, sgg_ptr, row, rm, 6, cd) + _sub_error(a_ptr, sgg_ptr, row, rm, 7, cd)))
    total = tl.where(m, total, float("inf"))
    best = tl.argmin(total, axis=1, tie_break_left=True)  # (ROWS,): the first least total
    d = _candidates(a_ptr, ts_ptr, ex_ptr, row, best, rm, am, T, E, c, TINY, F16MAX)  # the winner, made again
    tl.store(d_ptr + row, d, mask=rm)
    cb = c * d.to(tl.float64)
    for j in tl.static_range(8):
        ad = tl.load(a_ptr + row * 8 + j, mask=rm, other=0.0).to(tl.float64)
        s = tl.load(sgg_ptr + row * 8 + j, mask=rm, other=0.0)
        l0, l1, e0, e1 = _level_errors(ad, s, cb)
        tl.store(lsc_ptr + row * 8 + j, tl.where(e1 < e0, l1, l0).to(tl.int64), mask=rm)  # the first on a tie


def pick(a: torch.Tensor, sgg: torch.Tensor, ts: torch.Tensor, extra: torch.Tensor | None,
         c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`dynaquant.quant.codecs._iq3_search.pick_torch` (the fast path ``iq3.pick``): same arguments, the
    same (d (n,) float32, l (n, 8) int64) bit for bit, in one launch (the candidates made in the kernel).

    Args:
        a: (n, 8) float32 continuous sub-block scales; sgg: (n, 8) float64 ``sum w g**2``; ts: (T,) float64 the
            steps ``t`` of the candidates ``max A / (c t)``; extra: (n, E) float64 more candidates a super-block, or
            None; c: the format's ``A = c d (2 l + 1)`` factor.
    Raises:
        ValueError: shapes that disagree, or no candidate.
    """
    n = a.shape[0]
    ne = 0 if extra is None else extra.shape[-1]
    if a.shape != (n, 8) or sgg.shape != (n, 8) or ts.ndim != 1 or (extra is not None and extra.shape != (n, ne)) \
            or ts.shape[0] + ne < 1:
        raise ValueError(f"expected a, sgg (n, 8), ts (T,) and extra (n, E) or None with T + E >= 1, got "
                         f"{tuple(a.shape)}, {tuple(sgg.shape)}, {tuple(ts.shape)}, "
                         f"{None if extra is None else tuple(extra.shape)}")
    d = torch.empty(n, dtype=torch.float32, device=a.device)
    lsc = torch.empty(n, 8, dtype=torch.int64, device=a.device)
    if n:
        tc = ts.to(device=a.device, dtype=torch.float64).contiguous()
        ex = tc if extra is None else extra.to(torch.float64).contiguous()
        pick_kernel[(triton.cdiv(n, _ROWS),)](
            a.to(torch.float32).contiguous(), sgg.to(torch.float64).contiguous(), tc, ex, d, lsc, n, ts.shape[0], ne,
            float(c), ROWS=_ROWS, BC=triton.next_power_of_2(ts.shape[0] + ne), TINY=kqs._F16_TINY,
            F16MAX=kqs._F16_MAX, num_warps=_WARPS, enable_fp_fusion=False)
    return d, lsc
