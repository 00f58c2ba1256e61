"""``linear`` and ``dequantize``: the kernels' entry points, with a torch fallback.

On CUDA tensors (bf16/fp16 activations) these run the Triton kernels of
:mod:`dynaquant.kernels.triton_linear` (imported on first use); with ``TRITON_INTERPRET=1`` the same
kernels run on CPU tensors in Triton's interpreter (the tests do this). Anywhere else (CPU without
the interpreter, float32 activations, no Triton) they compute the same thing in torch from the
reference dequantization. :func:`linear_ref` and :func:`dequantize_packed_ref` are the torch
references of the packed layout, beside the fast paths.
"""

from __future__ import annotations

import os

import torch

from dynaquant.kernels.packing import PackedWeight, unpack
from dynaquant.kernels.reference import dequantize_ref
from dynaquant.kernels.tuning import LaunchConfig, choose_config, device_info, valid_config

__all__ = ["linear", "dequantize", "uses_triton", "dequantize_packed_ref", "linear_ref"]


def triton_device(x: torch.Tensor) -> bool:
    """Whether Triton kernels run on ``x``'s device: CUDA, or the CPU under ``TRITON_INTERPRET=1`` (the interpreter)."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


def uses_triton(x: torch.Tensor) -> bool:
    """Whether :func:`linear` runs the Triton kernels for activations like ``x`` (bfloat16 / float16 on a
    :func:`triton_device`)."""
    return x.dtype in (torch.bfloat16, torch.float16) and triton_device(x)


def _apply_super(y: torch.Tensor, x2: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    if packed.super_weights is None:
        return y
    rows, cols, delta = packed.super_weights
    corr = x2[:, cols].to(torch.float32) * delta
    return y.index_add_(1, rows, corr.to(y.dtype))


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, *,
           config: LaunchConfig | None = None) -> torch.Tensor:
    """``y = x @ dequant(W).T + bias`` with float32 accumulation (``F.linear`` with a quantized weight).

    Args:
        x: (..., K) bfloat16 / float16 activations (float32 takes the torch fallback).
        packed: the weight (N, K), from :func:`dynaquant.kernels.pack`, on x's device.
        bias: (N,) or None.
        config: launch configuration; default :func:`~dynaquant.kernels.tuning.choose_config` for the
            shape and device.
    Returns:
        (..., N) in x's dtype. Super weights are added in x's dtype after the product.
    Raises:
        ValueError: K differs from the weight's, or ``config`` does not fit the shape.
    """
    k = packed.in_features
    n = packed.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    if x.device != packed.device:
        raise ValueError(f"x is on {x.device}, the weight on {packed.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not uses_triton(x):
        w = dequantize_packed_ref(packed).to(x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    if m == 0:
        return x.new_empty(*lead, n)
    if x2.stride(-1) != 1 or x2.stride(0) != k:
        x2 = x2.contiguous()
    cfg = config if config is not None else choose_config(packed.fmt, m, n, k, device_info(x.device))
    if not valid_config(cfg, packed.fmt, m, n, k):
        raise ValueError(f"launch configuration {cfg} does not fit m={m}, n={n}, k={k} in {packed.fmt.name}")
    if cfg.path == "gemm" and cfg.gluon:
        from dynaquant.kernels import gluon_gemm

        y = gluon_gemm.run_gluon_gemm(x2, packed, bias, cfg)
    elif cfg.path == "gemm":
        from dynaquant.kernels import triton_gemm

        y = triton_gemm.run_gemm(x2, packed, bias, cfg)
    elif cfg.path == "gemv" and cfg.resident:
        from dynaquant.kernels import triton_resident

        y = triton_resident.run_resident(x2, packed, bias, cfg)
    else:
        from dynaquant.kernels import triton_linear

        y = triton_linear.run_linear(x2, packed, bias, cfg)
    return _apply_super(y, x2, packed).reshape(*lead, n)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight (N, K) in ``dtype``, super weights restored (Triton on CUDA or under the interpreter, else torch)."""
    probe = torch.empty(0, dtype=torch.bfloat16, device=packed.device)
    if not uses_triton(probe) or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return dequantize_packed_ref(packed).to(dtype)
    from dynaquant.kernels import triton_linear

    w = triton_linear.dequantize(packed, dtype)
    if packed.super_weights is not None:
        rows, cols, delta = packed.super_weights
        w[rows, cols] = (w[rows, cols].to(torch.float32) + delta).to(dtype)
    return w


def dequantize_packed_ref(packed: PackedWeight) -> torch.Tensor:
    """The full-precision weight (N, K) float32 of a PackedWeight, super weights restored."""
    codes, scales, zeros = unpack(packed)
    w = dequantize_ref(codes, scales, zeros, packed.fmt, global_scale=packed.global_scale)
    if packed.super_weights is not None:
        rows, cols, delta = packed.super_weights
        w[rows, cols] += delta
    return w


def linear_ref(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`dynaquant.kernels.linear`: ``y = x @ dequant(W).T + bias``.

    Computed in float32 from the packed layout (so it also checks :func:`~dynaquant.kernels.pack`).

    Args:
        x: (..., K) float16 / bfloat16 / float32 activations.
        packed: the weight; bias: (N,) or None.
    Returns:
        (..., N) in x's dtype.
    """
    w = dequantize_packed_ref(packed).to(x.device)
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
