"""FP4 runtime formats ``MXFP4_G32`` and ``NVFP4_G16`` (safetensors target, compressed-tensors layouts).

Elements are E2M1 codes (OCP Microscaling v1.0): bit 3 the sign, bits 0-2 the index of the
magnitude in ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (the same nibbles as GGUF's MXFP4 codes).

- ``MXFP4_G32``: one E8M0 scale byte ``e`` per 32 weights, ``w = e2m1 * 2**(e - 127)``, as
  compressed-tensors' ``mxfp4-pack-quantized`` (the values of GGUF's ``MXFP4`` exactly; the
  encoder is GGUF MXFP4's exponent search, only the byte layout differs).
- ``NVFP4_G16``: one float8 E4M3 scale ``s`` per 16 weights and one float32 ``global_scale`` per
  tensor, ``w = e2m1 * (float(s) / global_scale)`` in float32, as compressed-tensors'
  ``nvfp4-pack-quantized`` (``global_scale = 448 * 6 / amax(tensor)``, its ``generate_gparam``).

Byte records of a block (what ``quantize`` returns; :mod:`dynaquant.quant.runtime` turns them into
the file layout): ``MXFP4_G32`` = ``e`` + 16 bytes, ``NVFP4_G16`` = the E4M3 byte + the float32
global scale (4 bytes, little-endian) + 8 bytes; the code bytes hold two consecutive elements,
the first in the low nibble (compressed-tensors' ``pack_fp4_to_uint8`` order).

The NVFP4 encoder takes the global scale from the whole tensor when given it
(:meth:`NVFP4_G16.fit_params`; :func:`dynaquant.quant.runtime.encode` does), else from the blocks
it is given; per block it tries the E4M3 scales around the max-based one (codes nearest under the
stored scale, error on the decoder's float32 values, importance-weighted) and keeps the best.
"""

from __future__ import annotations

import torch

from dynaquant.quant.codecs._blockfit import Grid
from dynaquant.quant.codecs._records import Record
from dynaquant.quant.codecs.base import Codec, register
from dynaquant.quant.codecs.nonlinear import KVALUES_MXFP4, MX_CODES, MX_LEVELS, MXFP4, e8m0_to_fp32_half

FP8_E4M3_MAX = 448.0
FP4_MAX = 6.0


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """(B, n) codes < 16, n even -> (B, n / 2) uint8: byte j = code[2j] | code[2j + 1] << 4."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] & 15) | ((c[:, 1::2] & 15) << 4)


def unpack_pairs(b: torch.Tensor) -> torch.Tensor:
    """(B, m) uint8 -> (B, 2 m) uint8 codes, inverse of :func:`pack_pairs`."""
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any shape, any int dtype) -> float32 values (code 8, -0, decodes to -0.0 * 0 = 0)."""
    lut = torch.tensor(KVALUES_MXFP4, dtype=torch.float32, device=codes.device) * 0.5
    return lut[codes.long()]


@register
class MXFP4_G32(MXFP4):
    """MXFP4_G32: 17-byte record = E8M0 ``e`` + 16 bytes of E2M1 pairs (module docstring).

    ``encode_blocks(x, w)``: x, w (n_blocks, 32) float32 -> (n_blocks, 17) uint8; ``decode_blocks`` ->
    (n_blocks, 32) float32. Parameters and codes as GGUF's :class:`MXFP4` (the same search).
    """

    format_name = "MXFP4_G32"
    record = Record("pairs", 1, code_map=MX_CODES)

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (e,) = params
        return torch.cat([e.to(torch.uint8)[:, None], pack_pairs(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        # 2**(e - 127) * value == 2**(e - 128) * (2 * value), GGUF's exact float32 product.
        d = e8m0_to_fp32_half(b[:, :1])
        q = unpack_pairs(b[:, 1:17]).long()
        return d * torch.tensor(KVALUES_MXFP4, dtype=torch.float32, device=b.device)[q]


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """() float32 global scale ``448 * 6 / amax`` (1 where amax is 0), compressed-tensors' ``generate_gparam``."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, (FP8_E4M3_MAX * FP4_MAX) / torch.where(amax > 0, amax, 1.0), torch.ones_like(amax))


def _fp8_neighbours(s8: torch.Tensor, k: int) -> torch.Tensor:
    """E4M3 values ``k`` codes away (positive, finite), as float8."""
    bits = s8.view(torch.uint8).to(torch.int32) + k
    return bits.clamp(1, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn)


@register
class NVFP4_G16(Codec):
    """NVFP4_G16: 13-byte record = E4M3 scale + float32 global scale + 8 bytes of E2M1 pairs.

    ``encode_blocks(x, w)``: x, w (n_blocks, 16) float32 -> (n_blocks, 13) uint8; ``decode_blocks``
    -> (n_blocks, 16) float32, equal to compressed-tensors' float32 ``e2m1 * (scale / global_scale)``.

    Block parameters (:meth:`fit_params`): ``(s, g)``, ``s`` (n_blocks,) float8_e4m3fn as stored,
    ``g`` () float32 global scale. Codes: the E2M1 nibbles.
    """

    format_name = "NVFP4_G16"
    cross_block = True  # the global scale, without one given, comes from all the blocks of the call
    grid = Grid(MX_LEVELS)  # doubled E2M1 values
    offsets = (-3, -2, -1, 0, 1, 2)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor, global_scale: torch.Tensor | None = None):
        x, w = x.to(torch.float32), w.to(torch.float32)
        g = nvfp4_global_scale(x.abs().max()) if global_scale is None else global_scale.to(torch.float32).reshape(())
        amax = x.abs().max(dim=1).values
        s0 = (amax / FP4_MAX * g).clamp(2.0**-9, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        best_err, best_s = None, s0
        for k in self.offsets:
            s8 = _fp8_neighbours(s0, k)
            half = (s8.to(torch.float32) / g)[:, None] * 0.5  # value = level * half, level doubled E2M1
            q = self.grid.values_of(x / half)
            err = (w * (x - q * half).square_()).sum(dim=1)
            if best_err is None:
                best_err, best_s = err, s8
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s8.view(torch.uint8), best_s.view(torch.uint8)).view(torch.float8_e4m3fn)
        return best_s, g

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        s8, g = params
        scale = (s8.to(torch.float32) / g)[:, None]
        idx = self.grid.codes_of(x.to(torch.float32) / (scale * 0.5))
        codes = torch.tensor(MX_CODES, dtype=torch.int64, device=x.device)[idx]
        return codes, e2m1_values(codes) * scale

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        s8, g = params
        gb = g.reshape(1).to(torch.float32).view(torch.uint8).expand(s8.shape[0], 4)
        return torch.cat([s8.view(torch.uint8)[:, None], gb, pack_pairs(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        s = b[:, :1].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        g = b[:, 1:5].contiguous().view(torch.float32)
        return e2m1_values(unpack_pairs(b[:, 5:13])) * (s / g)
