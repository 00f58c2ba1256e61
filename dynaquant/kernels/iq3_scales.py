"""IQ3_XXS / IQ3_S: the fp16 super-block scale ``d`` search's candidate errors, fused (Triton).

:func:`pick_errors` has the signature and the contract of its torch reference,
:func:`dynaquant.quant.codecs._iq3_search.pick_errors_torch`, bit for bit (float64, the reference's operations in its
order, no FMA contraction); :mod:`dynaquant.kernels` registers it as the fast path ``iq3.pick_errors`` of the IQ3
codecs' scale pick (:meth:`dynaquant.quant.codecs.iq3._IQ3`). The grid search itself is :mod:`.iq3_search`.
Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pick_errors"]

_BLOCK = 128  # (super-block, candidate) lanes a program


@triton.jit
def pick_errors_kernel(a_ptr, sgg_ptr, cand_ptr, e_ptr, n, C, c, BLOCK: tl.constexpr):
    # one lane a (super-block, candidate) pair; the reference's float64 operations in its order (launched without
    # FMA contraction, so each rounds as torch's one-operation kernels do)
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = lane < n
    sb = lane // C
    cd = c * tl.load(cand_ptr + lane, mask=rm, other=0.0).to(tl.float64)
    nz = cd != 0
    den = tl.where(nz, cd, 1.0)
    for j in tl.static_range(8):
        ad = tl.load(a_ptr + sb * 8 + j, mask=rm, other=0.0).to(tl.float64)
        s = tl.load(sgg_ptr + sb * 8 + j, mask=rm, other=0.0)
        u = tl.where(nz, ad / den, 0.0)
        l0 = tl.minimum(tl.maximum(tl.floor((u - 1.0) * 0.5), 0.0), 15.0)
        l1 = tl.minimum(tl.maximum(l0 + 1.0, 0.0), 15.0)
        r0 = cd * (2.0 * l0 + 1.0) - ad
        r1 = cd * (2.0 * l1 + 1.0) - ad
        e0 = s * r0 * r0
        e1 = s * r1 * r1
        tl.store(e_ptr + lane * 8 + j, tl.minimum(e0, e1), mask=rm)


def pick_errors(a: torch.Tensor, sgg: torch.Tensor, cand: torch.Tensor, c: float) -> torch.Tensor:
    """Fused :func:`dynaquant.quant.codecs._iq3_search.pick_errors_torch` (the fast path ``iq3.pick_errors``): same
    arguments, the same (n, C, 8) float64 bit for bit, written once instead of a dozen (n, C, 8, 2) float64
    temporaries. Raises ValueError when the shapes disagree."""
    n = a.shape[0]
    if a.shape != (n, 8) or sgg.shape != (n, 8) or cand.ndim != 2 or cand.shape[0] != n:
        raise ValueError(f"expected a, sgg (n, 8) and cand (n, C), got {tuple(a.shape)}, {tuple(sgg.shape)}, "
                         f"{tuple(cand.shape)}")
    e = torch.empty(n, cand.shape[1], 8, dtype=torch.float64, device=a.device)
    lanes = n * cand.shape[1]
    if lanes:
        pick_errors_kernel[(triton.cdiv(lanes, _BLOCK),)](
            a.to(torch.float32).contiguous(), sgg.to(torch.float64).contiguous(), cand.to(torch.float32).contiguous(),
            e, lanes, cand.shape[1], float(c), BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
    return e
