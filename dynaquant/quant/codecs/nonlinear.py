"""Non-linear 4-bit GGUF block formats IQ4_NL, MXFP4 (32 weights a block) and NVFP4 (64).

Layouts follow llama.cpp ``ggml-common.h``:

- ``block_iq4_nl``: ``d`` (fp16), ``qs[16]``: byte j holds element j (low nibble) and
  j + 16 (high nibble); ``y = d * kvalues_iq4nl[q]`` with the fixed 16-entry grid
  ``kvalues_iq4nl`` = -127 ... 113.
- ``block_mxfp4`` (GGML type 39): ``e`` (one E8M0 byte), ``qs[16]`` nibbles as IQ4_NL;
  ``y = ggml_e8m0_to_fp32_half(e) * kvalues_mxfp4[q]``, where ``kvalues_mxfp4`` are the
  E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives, code 8 = -0) and the
  half-scale is ``2**(e - 128)`` (denormal patterns for ``e < 2``), per the OCP MX v1.0
  spec and ``ggml-impl.h``.
- ``block_nvfp4`` (GGML type 40): ``d[4]`` (one UE4M3 byte per sub-block of 16), ``qs[32]``:
  sub-block s owns bytes ``8 s .. 8 s + 7``, byte j of it holds element ``16 s + j`` (low
  nibble) and ``16 s + 8 + j`` (high nibble); ``y = ggml_ue4m3_to_fp32(d[s]) * kvalues_mxfp4[q]``
  where ``ggml_ue4m3_to_fp32`` is half the unsigned E4M3 value (bias 7, 3 mantissa bits,
  subnormals ``m * 2**-9``; 0x00 and 0x7F are 0, the top bit is ignored, ``ggml-impl.h``).
  No per-tensor scale (NVIDIA's second-level FP32 scale is not part of the GGML type).

Decoders equal ``gguf.quants.dequantize`` bit for bit (one float32 multiply of the scale
by the grid value). Encoders minimise the importance-weighted squared error: IQ4_NL by the
scale search of :mod:`._blockfit` over both signs of the scale, MXFP4 by trying the
exponents around the max-based one (with a power-of-two scale the nearest code of each
weight is exact, so the exponent is the only choice), NVFP4 likewise over the UE4M3 codes
around each sub-block's max-based one (llama.cpp only takes that one and ignores the imatrix).
Measured NVFP4 weighted error ours / llama.cpp (``tests/test_codecs_iq34.py``): dithered
SmolLM2-135M tensors with their imatrix mean 0.47, worst 0.67; synthetic 0.40-0.54; no
imatrix 0.73-0.76.
"""

from __future__ import annotations

import torch

from dynaquant.quant.codecs._blockfit import (
    Grid,
    ScaleCodec,
    bytes_half,
    fit_pow2,
    half_bytes,
    in_subchunks,
    pack_nibbles,
    scale_targets,
    unpack_nibbles,
)
from dynaquant.quant.codecs._records import Record, pow2_start
from dynaquant.quant.codecs.base import Codec, register
from dynaquant.quant.codecs.fastpaths import fast_path, fused_path
from dynaquant.quant.formats import E2M1_VALUES

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# llama.cpp's kvalues_mxfp4: the E2M1 values doubled, as int8 (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ...).
KVALUES_MXFP4 = tuple(int(2 * v) for v in E2M1_VALUES)


def _lut(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@register
class IQ4_NL(ScaleCodec):
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
    targets = scale_targets([-127, 113], 4, 2, (0.85, 1.1), 2.5)
    anchor_offsets = (-1, 0, 1)
    lloyd_steps = 1
    ulps: tuple[int, ...] = ()
    record = Record("nibbles", 2)

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (d,) = params
        return torch.cat([half_bytes(d), pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        q = unpack_nibbles(b[:, 2:18]).long()
        return d * _lut(KVALUES_IQ4NL, b.device)[q]


# Sorted MXFP4 levels and the nibble code of each (negative values use the sign bit 8).
MX_LEVELS = (-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12)
MX_CODES = tuple(KVALUES_MXFP4.index(v) for v in MX_LEVELS)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (any int dtype, any shape) -> float32 ``2**(e - 128)``, as ``ggml_e8m0_to_fp32_half``."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    return bits.view(torch.float32)


_mx_codes_cache: dict = {}


def _mx_codes(device) -> torch.Tensor:
    """``MX_CODES`` (the E2M1 nibble of each level of ``MX_LEVELS``) as an int64 tensor on ``device``."""
    key = str(device)
    if key not in _mx_codes_cache:
        _mx_codes_cache[key] = torch.tensor(MX_CODES, dtype=torch.int64, device=device)
    return _mx_codes_cache[key]


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
    grid = Grid(MX_LEVELS)
    # Exponents tried around llama.cpp's floor(log2(amax)) - 2 + 127.
    # (-3..2 gave the same error on the benchmark tensor, 0.88 of llama.cpp's; -1..0 gives 1.0.)
    offsets = (-2, -1, 0, 1)
    e0_bias = 125  # the start: llama.cpp's floor(log2(amax)) - 2, as an E8M0 code (bias 127)
    record = Record("nibbles", 1, code_map=MX_CODES)  # the block layout as data (the fused search writes it)

    fast_paths = True  # the exponent search's compiled CPU version (blockfit.fit_pow2, blockfit.encode_pow2)

    def _search(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """(e (n_blocks,) int64, level indices (n_blocks, 32) int64 under the chosen scale)."""
        x = x.to(torch.float32)
        e0 = pow2_start(x, self.e0_bias)
        return fit_pow2(x, w.to(torch.float32), self.grid, e0, self.offsets, 0, 254, e8m0_to_fp32_half, backend=backend)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor]:
        return (self._search(x, w, backend)[0],)

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """As :meth:`Codec.encode_blocks`; the search's level indices are :meth:`round_to_grid`'s (nearest under the
        chosen scale), so they are packed as they are. ``backend``: the search's compiled CPU version
        (:func:`._blockfit.fit_pow2`), on the CPU the one that also writes the records (``blockfit.encode_pow2``,
        :attr:`record`); ``variant`` is unused."""
        fused = fused_path("blockfit.encode_pow2", x, backend)
        if fused is not None:
            return fused(x.to(torch.float32), w.to(torch.float32), self.grid, None, self.e0_bias, self.offsets, 0, 254,
                         e8m0_to_fp32_half, self.record)
        e, idx = self._search(x, w, backend)
        return self.pack((e,), _mx_codes(x.device)[idx])

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        (e,) = params
        d = e8m0_to_fp32_half(e)[:, None]
        idx = self.grid.codes_of(x.to(torch.float32) / d)
        codes = _mx_codes(x.device)[idx]
        return codes, d * self.grid.level_tensor(x.device)[idx]

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (e,) = params
        return torch.cat([e.to(torch.uint8)[:, None], pack_nibbles(codes)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = e8m0_to_fp32_half(b[:, :1])
        q = unpack_nibbles(b[:, 1:17]).long()
        return d * _lut(KVALUES_MXFP4, b.device)[q]


def _ue4m3_table() -> list[float]:
    """The 256 values of ``ggml_ue4m3_to_fp32`` (already halved), exact in float32."""
    out = []
    for b in range(256):
        exp, man = (b >> 3) & 15, b & 7
        raw = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        out.append(0.0 if b in (0, 0x7F) else raw * 0.5)
    return out


_UE4M3 = _ue4m3_table()
# Largest code the encoder writes (0x7E = 448 / 2, as ggml_fp32_to_ue4m3 saturates); the
# codes 1..0x7E decode to strictly increasing values.
_UE4M3_MAX_CODE = 0x7E
_ue4m3_cache: dict = {}


def ue4m3_to_fp32(code: torch.Tensor) -> torch.Tensor:
    """UE4M3 byte codes (any int dtype, any shape) -> float32 scales, as ``ggml_ue4m3_to_fp32``
    (half the E4M3 value, matching the doubled ``kvalues_mxfp4``)."""
    key = str(code.device)
    if key not in _ue4m3_cache:
        _ue4m3_cache[key] = _lut(_UE4M3, code.device)
    return _ue4m3_cache[key][code.to(torch.int64)]


@register
class NVFP4(Codec):
    """NVFP4 (``block_nvfp4``, GGML type 40): 36 bytes = 4 UE4M3 sub-block scales + 32 bytes of E2M1 nibbles.

    ``encode_blocks(x, w)``: x, w (n_blocks, 64) float32 (w > 0) -> (n_blocks, 36) uint8;
    ``decode_blocks`` -> (n_blocks, 64) float32. Scale codes stay in 0..0x7E; an all-zero
    sub-block gets code 0; +0 is written as nibble 0, never 8 (-0).

    The encoder tries, per sub-block of 16, the scale codes from 3 below to 6 above the one
    of ``amax / 6`` (llama.cpp's ``quantize_row_nvfp4_ref`` takes that one only), each with
    every weight at its nearest level (optimal for a given scale), and keeps the lowest
    ``sum(w * (x - y)**2)`` on the decoder's exact values.

    Block parameters (:meth:`fit_params`): the tuple ``(e,)``, ``e`` (n_blocks, 4) int64
    UE4M3 codes. Codes: the stored E2M1 nibbles (indices into ``kvalues_mxfp4``).
    """

    format_name = "NVFP4"
    grid = Grid(MX_LEVELS)
    sub = 16
    # Up to +6: a sub-block whose max sits on level 8 (not 12) has its exact scale there.
    offsets = tuple(range(-3, 7))
    record = Record("nibbles", 1, code_map=MX_CODES, sub_blocks=4)  # the block layout as data (the fused search's)

    fast_paths = True  # the scale search's compiled CPU version (blockfit.fit_pow2, blockfit.encode_pow2)

    def _starts(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sub-blocks of x and w (n * 4, 16) float32, their amax (n * 4,), start codes (n * 4,) int64); raises
        ValueError on shapes other than (n, 64)."""
        if x.ndim != 2 or x.shape[1] != 64 or w.shape != x.shape:
            raise ValueError(f"NVFP4: expected x and w of shape (n_blocks, 64), got {tuple(x.shape)} and {tuple(w.shape)}")
        xs = x.to(torch.float32).reshape(-1, self.sub)
        ws = w.to(torch.float32).reshape(-1, self.sub)
        amax = xs.abs().amax(dim=1)
        # Code whose value is nearest amax / 12 from above (ggml rounds amax / 6 to UE4M3).
        table = ue4m3_to_fp32(torch.arange(1, _UE4M3_MAX_CODE + 1, device=x.device))
        return xs, ws, amax, torch.bucketize(amax / 12, table).clamp_(0, _UE4M3_MAX_CODE - 1) + 1

    def _search(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """(e (n, 4) int64 scale codes, level indices (n * 4, 16) int64 under them); raises ValueError on shapes
        other than (n, 64)."""
        n = x.shape[0]
        xs, ws, amax, e0 = self._starts(x, w)
        if fast_path("blockfit.fit_pow2", xs, backend) is not None:  # a fused search: no sub-chunks needed
            e, idx = fit_pow2(xs, ws, self.grid, e0, self.offsets, 1, _UE4M3_MAX_CODE, ue4m3_to_fp32, backend=backend)
        else:
            e, idx = in_subchunks(self._fit_codes, xs, torch.cat([ws, e0.to(torch.float32).unsqueeze(1)], 1))
        e = torch.where(amax > 0, e, torch.zeros_like(e))
        return e.reshape(n, 4), idx

    def fit_params(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor]:
        """Search the scale codes of (n, 64) blocks; raises ValueError on other shapes."""
        return (self._search(x, w, backend)[0],)

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """As :meth:`Codec.encode_blocks`: the search's level indices packed as they are (:meth:`round_to_grid`'s
        under a nonzero scale; an all-zero sub-block, scale code 0, gets nibble 0). ``backend``: the search's compiled
        CPU version (:func:`._blockfit.fit_pow2`), or the one that also writes the records (``blockfit.encode_pow2``,
        :attr:`record`); ``variant`` is unused."""
        fused = fused_path("blockfit.encode_pow2", x, backend)
        if fused is not None:
            xs, ws, _, e0 = self._starts(x, w)
            return fused(xs, ws, self.grid, e0, 0, self.offsets, 1, _UE4M3_MAX_CODE, ue4m3_to_fp32, self.record,
                         zero_empty=True)
        e, idx = self._search(x, w, backend)
        codes = torch.where(e.reshape(-1, 1) == 0, 0, _mx_codes(x.device)[idx])
        return self.pack((e,), codes.reshape(x.shape[0], 64))

    def _fit_codes(self, xs: torch.Tensor, we: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # we = [w | e0]: the start codes ride along with the importance through in_subchunks.
        e0 = we[:, -1].to(torch.int64)
        return fit_pow2(xs, we[:, :-1], self.grid, e0, self.offsets, 1, _UE4M3_MAX_CODE, ue4m3_to_fp32, backend="torch")

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        (e,) = params
        sub = (torch.arange(x.shape[1], device=x.device) + start) // self.sub
        d = ue4m3_to_fp32(e[:, sub])
        idx = self.grid.codes_of(x.to(torch.float32) / torch.where(d == 0, 1.0, d))
        codes = _mx_codes(x.device)[idx]
        codes = torch.where(d == 0, 0, codes)
        return codes, d * _lut(KVALUES_MXFP4, x.device)[codes]

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        (e,) = params
        c = codes.to(torch.uint8).reshape(-1, 4, 2, 8)
        qs = (c[:, :, 0] & 15) | ((c[:, :, 1] & 15) << 4)
        return torch.cat([e.to(torch.uint8), qs.reshape(-1, 32)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        """(n, 36) uint8 -> (n, 64) float32; raises ValueError on other shapes or dtypes."""
        if b.dtype != torch.uint8 or b.ndim != 2 or b.shape[1] != 36:
            raise ValueError(f"NVFP4: expected (n_blocks, 36) uint8, got {tuple(b.shape)} {b.dtype}")
        n = b.shape[0]
        d = ue4m3_to_fp32(b[:, :4]).reshape(n, 4, 1)
        qs = b[:, 4:36].reshape(n, 4, 8)
        q = torch.cat([qs & 15, qs >> 4], dim=2).long()
        return (d * _lut(KVALUES_MXFP4, b.device)[q]).reshape(n, 64)
