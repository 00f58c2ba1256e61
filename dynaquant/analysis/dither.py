"""Dithering weights that lie on a quantization grid.

The default model's weights were dequantized from a Q4_1 file, so each block of 32 lies
exactly on a 16-level grid, and any format containing that grid reproduces it almost
exactly. Quality benchmarks quantize a dithered copy instead: in each group of
``group_size`` weights, let d be the smallest gap between distinct values (the grid
step) and add noise drawn uniformly from [-d/2, d/2) with a fixed seed.
"""

from __future__ import annotations

import torch


def dither(weight: torch.Tensor, group_size: int = 32, seed: int = 0) -> torch.Tensor:
    """Add half-grid-step uniform noise inside each group of ``group_size`` weights.

    Args:
        weight: (..., K) float tensor, K a multiple of ``group_size``.
        group_size: the source format's block size (32 for Q4_1).
        seed: noise seed; the same seed and tensor give the same result.
    Returns:
        float32 tensor of the weight's shape. Groups with a single distinct value are unchanged.
    Raises:
        ValueError: K is not a multiple of ``group_size``.
    """
    if weight.shape[-1] % group_size:
        raise ValueError(f"row of {weight.shape[-1]} is not a multiple of group size {group_size}")
    g = weight.reshape(-1, group_size).to(torch.float32)
    s = g.sort(dim=1).values
    gaps = s[:, 1:] - s[:, :-1]
    gaps = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf")))
    d = gaps.min(dim=1, keepdim=True).values
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.rand(g.shape, generator=gen, dtype=torch.float32).to(g.device) - 0.5
    return (g + u * d).reshape(weight.shape)
