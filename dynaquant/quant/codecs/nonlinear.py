"""Non-linear 4-bit GGUF block formats IQ4_NL and MXFP4 (32 weights a block).

Layouts follow llama.cpp ``ggml-common.h``:

- ``block_iq4_nl``: ``d`` (fp16), ``qs[16]``: byte j holds element j (low nibble) and
  j + 16 (high nibble); ``y = d * kvalues_iq4nl[q]`` with the fixed 16-entry grid
  ``kvalues_iq4nl`` = -127 ... 113.
- ``block_mxfp4`` (GGML type 39): ``e`` (one E8M0 byte), ``qs[16]`` nibbles as IQ4_NL;
  ``y = ggml_e8m0_to_fp32_half(e) * kvalues_mxfp4[q]``, where ``kvalues_mxfp4`` are the
  E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives, code 8 = -0) and the
  half-scale is ``2**(e - 128)`` (denormal patterns for ``e < 2``), per the OCP MX v1.0
  spec and ``ggml-impl.h``.

Decoders equal ``gguf.quants.dequantize`` bit for bit (one float32 multiply of the scale
by the grid value). Encoders minimise the importance-weighted squared error: IQ4_NL by the
scale search of :mod:`._blockfit` over both signs of the scale, MXFP4 by trying the
exponents around the max-based one (with a power-of-two scale the nearest code of each
weight is exact, so the exponent is the only choice).
"""

from __future__ import annotations

import torch

from ._blockfit import (
    Grid,
    bytes_half,
    fit_pow2,
    fit_scale,
    half_bytes,
    in_subchunks,
    pack_nibbles,
    scale_codes,
    scale_targets,
    unpack_nibbles,
)
from .base import Codec, register

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _lut(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@register
class IQ4_NL(Codec):
    """IQ4_NL (``block_iq4_nl``): 18 bytes = fp16 ``d`` + 16 bytes of 4-bit indices into ``kvalues_iq4nl``.

    ``encode_blocks(x, w)``: x, w (n_blocks, 32) float32 (w > 0) -> (n_blocks, 18) uint8;
    ``decode_blocks`` -> (n_blocks, 32) float32. The scale may be negative (the grid is
    asymmetric, so its sign picks which end gets -127).

    Block parameters (:meth:`fit_params`): the tuple ``(d,)``, ``d`` (n_blocks,) float16 as
    stored. Codes: indices into ``kvalues_iq4nl`` (the stored nibbles).
    """

    format_name = "IQ4_NL"
    grid = Grid(KVALUES_IQ4NL)
    # The largest weight starts near the grid's end on its side: -127 (d > 0 for a
    # negative max) or 113, with some clipping and some headroom.
    targets = scale_targets([-127, 113], 16, 10, (0.8, 1.1), 3.0)
    anchor_offsets = tuple(range(-3, 4))

    def fit_params(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        d, _ = in_subchunks(
            fit_scale, x.to(torch.float32), w.to(torch.float32), self.grid, self.targets, self.anchor_offsets
        )
        return (d,)

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        (d,) = params
        codes = scale_codes(x.to(torch.float32), d, self.grid)
        return codes, d.to(torch.float32)[:, None] * self.grid.level_tensor(x.device)[codes]

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (d,) = params
        return torch.cat([half_bytes(d), pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        q = unpack_nibbles(b[:, 2:18]).long()
        return d * _lut(KVALUES_IQ4NL, b.device)[q]


# Sorted MXFP4 levels and the nibble code of each (negative values use the sign bit 8).
_MX_LEVELS = (-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12)
_MX_CODES = tuple(KVALUES_MXFP4.index(v) for v in _MX_LEVELS)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (any int dtype, any shape) -> float32 ``2**(e - 128)``, as ``ggml_e8m0_to_fp32_half``."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    return bits.view(torch.float32)


@register
class MXFP4(Codec):
    """MXFP4 (``block_mxfp4``, GGML type 39): 17 bytes = E8M0 ``e`` + 16 bytes of E2M1 nibbles.

    ``encode_blocks(x, w)``: x, w (n_blocks, 32) float32 (w > 0) -> (n_blocks, 17) uint8;
    ``decode_blocks`` -> (n_blocks, 32) float32. ``e`` stays in 0..254 (255 is NaN in the
    OCP spec); +0 is written as code 0, never 8 (-0).

    Block parameters (:meth:`fit_params`): the tuple ``(e,)``, ``e`` (n_blocks,) int64 E8M0
    exponent codes. Codes: the stored E2M1 nibbles (indices into ``kvalues_mxfp4``).
    """

    format_name = "MXFP4"
    grid = Grid(_MX_LEVELS)
    # Exponents tried around llama.cpp's floor(log2(amax)) - 2 + 127.
    offsets = (-3, -2, -1, 0, 1, 2)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        x = x.to(torch.float32)
        amax = x.abs().max(dim=1).values
        # floor(log2(amax)) exactly: frexp gives amax = mant * 2**exp with mant in [0.5, 1).
        exp = torch.frexp(amax).exponent.to(torch.int64) - 1
        e0 = torch.where(amax > 0, exp - 2 + 127, torch.zeros_like(exp))
        e, _ = fit_pow2(x, w.to(torch.float32), self.grid, e0, self.offsets, 0, 254, e8m0_to_fp32_half)
        return (e,)

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        (e,) = params
        d = e8m0_to_fp32_half(e)[:, None]
        idx = self.grid.codes_of(x.to(torch.float32) / d)
        codes = torch.tensor(_MX_CODES, dtype=torch.int64, device=x.device)[idx]
        return codes, d * self.grid.level_tensor(x.device)[idx]

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (e,) = params
        return torch.cat([e.to(torch.uint8)[:, None], pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = e8m0_to_fp32_half(b[:, :1])
        q = unpack_nibbles(b[:, 1:17]).long()
        return d * _lut(KVALUES_MXFP4, b.device)[q]
