"""Checkpoint tensors stored quantized, dequantized to float32 for the GGUF writer.

Spec: llama.cpp's converter (``conversion/base.py`` ``ModelBase.dequant_model``, ``fp8``
branch: ``dequant_simple``; ``conversion/gpt_oss.py`` for the MXFP4 expert layout) and
transformers (``integrations/mxfp4.py`` ``convert_moe_packed_tensors``, the OCP MX spec's
FP4 E2M1 values and E8M0 scales).

- Block-scaled FP8 (DeepSeek-V3's release checkpoints, ``quantization_config.quant_method
  == "fp8"``): ``X.weight`` in ``float8_e4m3fn`` with ``X.weight_scale_inv`` float32 of shape
  ``(ceil(N / b0), ceil(K / b1))`` for ``weight_block_size = [b0, b1]``; the value is
  ``weight * scale_inv`` with each scale repeated over its block (and cut to the weight's
  shape). Despite its name, ``scale_inv`` multiplies.
- MXFP4 (gpt-oss's release checkpoints): ``*_blocks`` uint8 ``(..., G, 16)`` holding 32 FP4
  E2M1 codes per block (low nibble = even element, high nibble = odd) and ``*_scales`` uint8
  ``(..., G)`` E8M0 exponents (value ``2 ** (s - 127)``); the row is ``G * 32`` long.
"""

from __future__ import annotations

import math

import torch

from dynaquant.quant.formats import E2M1_VALUES

FP8_SCALE_SUFFIX = "_scale_inv"
# tensors a quantized checkpoint carries that llama.cpp does not use
UNUSED_SUFFIXES = (".activation_scale", "_activation_scale")


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                      block_size: list[int] | tuple[int, ...] | None) -> torch.Tensor:
    """Block-scaled FP8 to float32 (the converter's ``dequant_simple``).

    Args:
        weight: ``(N, K)`` (or more dims) float8/any float tensor.
        scale_inv: per-block multipliers, ``(ceil(N / b0), ceil(K / b1))``; or a scalar /
            per-tensor value when ``block_size`` is None.
        block_size: ``quantization_config.weight_block_size`` (``[128, 128]`` for DeepSeek-V3).
    Returns:
        float32 of ``weight``'s shape.
    Raises:
        ValueError: the scales do not cover the weight with that block size.
    """
    s = scale_inv.to(torch.float32)
    if block_size is not None:
        lead = s.ndim - len(block_size)
        dims = weight.shape[weight.ndim - len(block_size):]
        for i, size in enumerate(block_size):
            if s.shape[lead + i] != math.ceil(dims[i] / size):
                raise ValueError(f"FP8 scales of shape {tuple(s.shape)} do not cover a weight of shape "
                                 f"{tuple(weight.shape)} in blocks of {list(block_size)}")
        if s.ndim == weight.ndim and all(n % b == 0 for n, b in zip(dims, block_size, strict=True)):
            # whole blocks: each scale broadcast over its block in place (the same products, no scale copy of
            # the weight's size)
            split = [d for n, b in zip(s.shape[lead:], block_size, strict=True) for d in (n, b)]
            out = weight.to(torch.float32)
            out.view(*weight.shape[:lead], *split).mul_(
                s.reshape(*s.shape[:lead], *[d for n in s.shape[lead:] for d in (n, 1)]))
            return out
        for i, size in enumerate(block_size):
            s = s.repeat_interleave(size, lead + i)
        s = s[tuple(slice(0, n) for n in weight.shape[weight.ndim - s.ndim:])]
    while s.ndim < weight.ndim:
        s = s.unsqueeze(-1)
    return weight.to(torch.float32) * s


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks and E8M0 scales to float32 ``(..., G * 32)``.

    Args:
        blocks: uint8 ``(..., G, 16)``: 32 FP4 codes per block, element ``2j`` in the low
            nibble of byte ``j``, ``2j + 1`` in the high nibble.
        scales: uint8 ``(..., G)``: the block's power of two, biased by 127.
    Raises:
        ValueError: the shapes do not match.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not match (want uint8 (..., G, 16) and (..., G))")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=torch.float32)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, scales.to(torch.int32).unsqueeze(-1) - 127)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
