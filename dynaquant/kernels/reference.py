"""Torch reference of the kernels' dequantization, on the unpacked contract (``dequantize_ref``);
the packed-weight references ``dequantize_packed_ref`` and ``linear_ref`` are in :mod:`.ops`.

The decoding rules are those of :mod:`dynaquant.quant.runtime` (in float32)::

    INT{b}_G{g}        w = scale * code                       (code int8, signed)
    INT{b}_G{g}_ASYM   w = scale * (code - zero)              (code, zero uint8)
    MXFP4_G32          w = e2m1(code) * 2**(e - 127)          (OCP Microscaling v1.0, E8M0 e)
    NVFP4_G16          w = e2m1(code) * (e4m3(scale) / global_scale)   (compressed-tensors' NVFP4)

E2M1 codes: bit 3 the sign, bits 0-2 index ``0, 0.5, 1, 1.5, 2, 3, 4, 6``.
"""

from __future__ import annotations

import torch

from dynaquant.kernels.formats import KernelFormat
from dynaquant.quant.formats import E2M1_VALUES

__all__ = ["E2M1_VALUES", "e2m1_to_float", "e8m0_to_float", "dequantize_ref"]


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (any shape, integer dtype, values 0..15) -> float32 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponents (uint8) -> float32 ``2**(e - 127)`` exactly (e = 255 -> NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 0x00400000))
    return torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits).view(torch.float32)


def dequantize_ref(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: str | KernelFormat, *,
                   global_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize an unpacked runtime weight (module docstring), in float32.

    Args:
        codes: (N, K) int8 / uint8 codes; scales: (N, K / g); zeros: (N, K / g) uint8 or None
            (dtypes as :func:`dynaquant.kernels.pack` takes them).
        fmt: format name or KernelFormat.
        global_scale: NVFP4's float32 global scale (divides the E4M3 scales).
    Returns:
        (N, K) float32 on the codes' device.
    Raises:
        ValueError: NVFP4 without its global scale.
    """
    f = KernelFormat.parse(fmt)
    n, k = codes.shape
    g = f.group_size
    if f.kind == "int":
        q = codes.to(torch.float32).reshape(n, k // g, g)
        if zeros is not None:
            q = q - zeros.to(torch.float32).reshape(n, k // g, 1)
        w = q * scales.to(torch.float32).reshape(n, k // g, 1)
    elif f.kind == "mxfp4":
        w = e2m1_to_float(codes).reshape(n, k // g, g) * e8m0_to_float(scales.view(torch.uint8)).reshape(n, k // g, 1)
    else:
        if global_scale is None:
            raise ValueError("NVFP4_G16 needs its global scale")
        s = scales.view(torch.float8_e4m3fn).to(torch.float32)
        s = s / torch.as_tensor(global_scale, dtype=torch.float32, device=s.device).reshape(())
        w = e2m1_to_float(codes).reshape(n, k // g, g) * s.reshape(n, k // g, 1)
    return w.reshape(n, k)
