"""Legacy GGUF block formats Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (32 weights a block).

Layouts follow llama.cpp ``ggml-common.h`` (all little-endian, ``ggml_half`` = IEEE fp16):

- ``block_q8_0``: ``d`` (fp16), ``qs[32]`` int8; ``y = d * q``.
- ``block_q4_0``: ``d``, ``qs[16]``: byte j holds element j (low nibble) and j + 16 (high
  nibble); ``y = d * (q - 8)``.
- ``block_q4_1``: ``d``, ``m`` (fp16), ``qs[16]`` as Q4_0; ``y = d * q + m``.
- ``block_q5_0``: ``d``, ``qh[4]`` (bit j of the little-endian uint32 is bit 4 of element
  j), ``qs[16]`` low nibbles as Q4_0; ``y = d * (q - 16)``.
- ``block_q5_1``: ``d``, ``m``, ``qh[4]``, ``qs[16]``; ``y = d * q + m``.

Decoders repeat gguf-py's float operations in the same order (fp16 -> fp32 scale, one
float32 multiply, then one add for the ``_1`` types), so they equal
``gguf.quants.dequantize`` bit for bit. Encoders minimise the importance-weighted squared
error with the scale search of :mod:`._blockfit` (a grid of candidate scales, least-squares
refits, error measured on the stored fp16 values); they are not bit-compatible with
llama.cpp's encoders, only at least as accurate. Q8_0 codes stay in ``-127..127`` as
llama.cpp's own encoder writes them (``-128`` is left unused so SIMD dot products that take
``|q|`` as int8 stay exact).
"""

from __future__ import annotations

import numpy as np
import torch

from dynaquant.quant.codecs._blockfit import (
    Grid,
    ScaleCodec,
    affine_codes,
    bytes_half,
    fit_affine,
    half_bytes,
    in_subchunks,
    pack_high_bits,
    pack_nibbles,
    scale_targets,
    unpack_high_bits,
    unpack_nibbles,
)
from dynaquant.quant.codecs._records import Record
from dynaquant.quant.codecs.base import Codec, register


def _targets(lo: float, hi: float, n: int) -> list[float]:
    return [float(v) for v in np.linspace(lo, hi, n)]


def _geo(level: float, lo: float, hi: float, n: int) -> list[float]:
    return [level * float(f) for f in np.geomspace(lo, hi, n)]


class _SymmetricCodec(ScaleCodec):
    """Formats ``y = d * level`` with an fp16 ``d`` and a linear grid of integer levels (:class:`._blockfit.ScaleCodec`).

    ``encode_blocks(x, w)``: x, w (n_blocks, 32) float32 (w > 0) -> (n_blocks, type_size)
    uint8; ``decode_blocks`` inverts it. Search parameters (class data): ``targets`` and
    ``anchor_offsets`` of :func:`._blockfit.fit_scale`.

    Block parameters (:meth:`fit_params`): the tuple ``(d,)``, ``d`` (n_blocks,) float16 as
    stored. Codes (:meth:`round_to_grid`, :meth:`pack`): indices into ``grid``, i.e.
    ``level - grid.lo`` (the stored nibble / 5-bit value; Q8_0 stores ``code - 127`` as int8).
    """


@register
class Q8_0(_SymmetricCodec):
    """Q8_0 (``block_q8_0``): 34 bytes = fp16 ``d`` + 32 int8 codes."""

    format_name = "Q8_0"
    grid = Grid(range(-127, 128))
    # The max-based scale (llama.cpp's), plus scales putting the most important weight exactly
    # on a level near its own (measured on the benchmark tensor: error ratio to llama.cpp 0.91
    # with these 6 candidates, 0.97 with the max-based one alone, 0.82 with the former 41).
    targets = [127.0]
    anchor_offsets = (-2, -1, 0, 1, 2)
    record = Record("i8", 2, code_offset=-127)

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (d,) = params
        q = (codes + int(self.grid.lo)).to(torch.int8).view(torch.uint8)
        return torch.cat([half_bytes(d), q], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d


@register
class Q4_0(_SymmetricCodec):
    """Q4_0 (``block_q4_0``): 18 bytes = fp16 ``d`` + 16 bytes of 4-bit codes, ``y = d * (q - 8)``."""

    format_name = "Q4_0"
    grid = Grid(range(-8, 8))
    # Starts put the largest weight near -8 (the extra level on its side) or near +7, up to
    # 2x past it (clipping a low-importance outlier), plus most-important-weight anchors
    # (13 candidates: error ratio to llama.cpp 0.952 on the benchmark tensor, 0.946 with 45).
    targets = _geo(-8, 0.85, 2.0, 6) + _geo(7, 0.9, 2.0, 4)
    anchor_offsets = (-1, 0, 1)
    record = Record("nibbles", 2)

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (d,) = params
        return torch.cat([half_bytes(d), pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        q = unpack_nibbles(b[:, 2:18]).to(torch.int8) - 8
        return d * q.to(torch.float32)


@register
class Q5_0(_SymmetricCodec):
    """Q5_0 (``block_q5_0``): 22 bytes = fp16 ``d`` + ``qh[4]`` + ``qs[16]``, ``y = d * (q - 16)``."""

    format_name = "Q5_0"
    grid = Grid(range(-16, 16))
    targets = scale_targets([-16, 15], 5, 2, (0.85, 1.08), 3.0)
    anchor_offsets = (-2, -1, 0, 1, 2)
    record = Record("q5", 2)

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (d,) = params
        return torch.cat([half_bytes(d), pack_high_bits(codes), pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        q = unpack_nibbles(b[:, 6:22]) | (unpack_high_bits(b[:, 2:6]) << 4)
        return d * (q.to(torch.int8) - 16).to(torch.float32)


class _AffineCodec(Codec):
    """Formats ``y = d * code + m`` with fp16 ``d``, ``m`` and codes ``0..nmax``.

    ``encode_blocks(x, w)``: x, w (n_blocks, 32) float32 (w > 0) -> (n_blocks, type_size)
    uint8; ``decode_blocks`` inverts it. Search parameters (class data): ``steps`` and
    ``n_anchor`` of :func:`._blockfit.fit_affine`.

    Block parameters (:meth:`fit_params`): the tuple ``(d, m)``, each (n_blocks,) float16 as
    stored. Codes (:meth:`round_to_grid`, :meth:`pack`): the stored ``0..nmax``.
    """

    nmax: int
    steps: list[float]
    n_anchor: int = 0
    lloyd_steps: int = 1
    ulps: tuple[int, ...] = ()

    fast_paths = True  # the affine search's fused kernel (blockfit.fit_affine)

    def _fit(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, w = x.to(torch.float32), w.to(torch.float32)
        return in_subchunks(fit_affine, x, w, self.nmax, self.steps, self.n_anchor, self.lloyd_steps, self.ulps,
                            backend=backend)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        d, m, _ = self._fit(x, w, backend)
        return d, m

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """As :meth:`Codec.encode_blocks`; ``backend`` chooses the affine search's fused kernel
        (:func:`._blockfit.fit_affine`); ``variant`` is unused."""
        # The search's codes are round_to_grid's (nearest under the stored pair): no second pass.
        d, m, codes = self._fit(x, w, backend)
        return self.pack((d, m), codes)

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        d, m = params
        codes = affine_codes(x.to(torch.float32), d, m, self.nmax)
        return codes, d.to(torch.float32)[:, None] * codes.to(torch.float32) + m.to(torch.float32)[:, None]


@register
class Q4_1(_AffineCodec):
    """Q4_1 (``block_q4_1``): 20 bytes = fp16 ``d``, fp16 ``m`` + 16 bytes of 4-bit codes, ``y = d * q + m``."""

    format_name = "Q4_1"
    nmax = 15
    # Level counts nmax + s: dense where the winners concentrate, a geometric tail for clipping.
    steps = _targets(-3.0, 1.5, 6) + [3.0, 6.0]
    n_anchor = 1

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        d, m = params
        return torch.cat([half_bytes(d), half_bytes(m), pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        m = bytes_half(b[:, 2:4])
        q = unpack_nibbles(b[:, 4:20]).to(torch.float32)
        return d * q + m


@register
class Q5_1(_AffineCodec):
    """Q5_1 (``block_q5_1``): 24 bytes = fp16 ``d``, fp16 ``m``, ``qh[4]``, ``qs[16]``, ``y = d * q + m``."""

    format_name = "Q5_1"
    nmax = 31
    steps = _targets(-6.0, 1.5, 6) + [4.0, 10.0]
    n_anchor = 1

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        d, m = params
        return torch.cat([half_bytes(d), half_bytes(m), pack_high_bits(codes), pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        m = bytes_half(b[:, 2:4])
        q = (unpack_nibbles(b[:, 8:24]) | (unpack_high_bits(b[:, 4:8]) << 4)).to(torch.float32)
        return d * q + m
