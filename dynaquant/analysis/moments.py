"""Second moments of layer inputs: the (K, K) sums of ``x x^T`` the calibration pass gathers (GPTQ's Hessian, the
error measure's input covariance)."""

from __future__ import annotations

import torch


def gram(x: torch.Tensor, split: bool | None = None) -> torch.Tensor:
    """(K, K) float32 ``x.T @ x`` of ``x`` (T, K) float32: the second-moment sum of one call's inputs.

    ``split`` (default: on CUDA) False: one float32 GEMM (on the CPU bit for bit the earlier ``zeros.addmm_``).
    True: ``x`` split as ``hi + lo`` (``hi`` = ``x`` rounded to bfloat16, ``lo`` = the remainder rounded to bfloat16)
    and ``hi.T hi + hi.T lo + lo.T hi`` summed in float32 as one GEMM over 3T stacked rows: on CUDA bfloat16 tensor-core
    products with float32 accumulation (``hi.T hi``'s products are exact), elsewhere the same products in float32. The
    dropped ``lo.T lo`` and ``lo``'s rounding leave a relative error of about 2**-16 per product (float32's own is
    2**-24, TF32's 2**-11); on an H200 several times faster than float32, whose SIMT GEMM was most of a Llama-3-8B
    calibration pass (32 x 512 tokens, ~270 TFLOP)."""
    k = x.shape[1]
    if not (x.device.type == "cuda" if split is None else split):
        return torch.zeros((k, k), dtype=torch.float32, device=x.device).addmm_(x.T, x)
    hi = x.to(torch.bfloat16)
    lo = (x - hi.to(torch.float32)).to(torch.bfloat16)
    a, b = torch.cat([hi, hi, lo]), torch.cat([hi, lo, hi])
    if x.device.type == "cuda":
        return torch.mm(a.T, b, out_dtype=torch.float32)
    return a.to(torch.float32).T @ b.to(torch.float32)
