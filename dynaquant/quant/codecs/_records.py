"""Block records of the one-scale formats as data, and the searches that write them whole.

A :class:`Record` says how a format lays out a block found by :func:`._blockfit.fit_scale` (``Q8_0``, ``Q4_0``,
``Q5_0``, ``IQ4_NL``) or :func:`._blockfit.fit_pow2` (``MXFP4``, ``MXFP4_G32``, ``NVFP4``): the scale's bytes, then
the codes packed (llama.cpp ``ggml-common.h``; compressed-tensors' ``pack_fp4_to_uint8`` for the pairs).
:func:`pack_record` writes records in torch (equal to each codec's ``pack``, ``tests/test_blockfit_native.py``);
:func:`encode_scale_torch` and :func:`encode_pow2_torch` are the references of the fused fast paths
``blockfit.encode_scale`` and ``blockfit.encode_pow2`` (:mod:`.fastpaths`: compiled C on the CPU, which writes the
records inside its search instead of int64 codes for a torch pack).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dynaquant.quant.codecs._blockfit import Grid, fit_pow2_torch, fit_scale_torch, half_bytes, pack_high_bits

CODE_KINDS = ("i8", "nibbles", "q5", "pairs")


@dataclass(frozen=True)
class Record:
    """A block record: ``sub_blocks`` searched blocks of ``n`` codes, their scales first, then their codes.

    Attributes:
        codes: how a block's ``n`` stored codes ``c`` are packed: ``"i8"`` one byte each (``c`` as int8),
            ``"nibbles"`` ``n / 2`` bytes, byte ``j`` = ``c[j] | c[j + n/2] << 4`` (ggml's order), ``"q5"`` the
            5-bit codes as ``qh`` (``n / 8`` bytes, bit ``j`` of the little-endian word = bit 4 of ``c[j]``) then the
            low nibbles as ``"nibbles"``, ``"pairs"`` byte ``j`` = ``c[2j] | c[2j + 1] << 4``.
        scale_bytes: 2 (the float16 ``d``, little-endian) or 1 (a scale code byte: E8M0, UE4M3).
        code_offset: added to a level index to make its stored code (Q8_0: -127, the int8 ``q``).
        code_map: the stored code of each level index (MXFP4's E2M1 nibbles), or None (index + ``code_offset``).
        sub_blocks: searched blocks a record (NVFP4: 4 sub-blocks of 16, the 4 scale bytes then 4 x 8 code bytes).
    Raises:
        ValueError: an unknown ``codes`` kind or scale width.
    """

    codes: str
    scale_bytes: int
    code_offset: int = 0
    code_map: tuple[int, ...] | None = None
    sub_blocks: int = 1

    def __post_init__(self):
        if self.codes not in CODE_KINDS or self.scale_bytes not in (1, 2) or self.sub_blocks < 1:
            raise ValueError(f"bad record {self}: codes one of {CODE_KINDS}, scale_bytes 1 or 2, sub_blocks >= 1")

    def code_bytes(self, n: int) -> int:
        """Bytes of one block's ``n`` codes."""
        return {"i8": n, "nibbles": n // 2, "q5": n // 8 + n // 2, "pairs": n // 2}[self.codes]

    def record_bytes(self, n: int) -> int:
        """Bytes of a record of blocks of ``n`` codes (the format's type size)."""
        return self.sub_blocks * (self.scale_bytes + self.code_bytes(n))


def pack_record(record: Record, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Write records: ``scale`` (B, scale_bytes) uint8 (each block's scale bytes), ``codes`` (B, n) int64 level
    indices -> (B / sub_blocks, record_bytes(n)) uint8. Raises ValueError when B is not a multiple of sub_blocks."""
    b, n = codes.shape
    if b % record.sub_blocks:
        raise ValueError(f"{b} blocks do not fill records of {record.sub_blocks}")
    if record.code_map is not None:
        c = torch.tensor(record.code_map, dtype=torch.int64, device=codes.device)[codes]
    else:
        c = codes + record.code_offset
    c = (c & 255).to(torch.uint8)
    if record.codes == "i8":
        q = c
    elif record.codes == "pairs":
        q = (c[:, 0::2] & 15) | ((c[:, 1::2] & 15) << 4)
    else:
        q = (c[:, : n // 2] & 15) | ((c[:, n // 2 :] & 15) << 4)
        if record.codes == "q5":
            q = torch.cat([pack_high_bits(c), q], dim=1)
    s = record.sub_blocks
    return torch.cat([scale.reshape(b // s, -1), q.reshape(b // s, -1)], dim=1)


def encode_scale_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    targets: Sequence[float],
    anchor_offsets: Sequence[int],
    lloyd_steps: int,
    ulps: Sequence[int],
    record: Record,
) -> torch.Tensor:
    """:func:`._blockfit.fit_scale_torch` of x, w (B, n) float32, its ``d`` and codes written as ``record``
    (``scale_bytes`` 2) -> (B / sub_blocks, record_bytes(n)) uint8."""
    d, codes = fit_scale_torch(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps)
    return pack_record(record, half_bytes(d), codes)


def pow2_start(x: torch.Tensor, bias: int) -> torch.Tensor:
    """(B,) int64 start codes of (B, n) float32 blocks: ``floor(log2(amax)) + bias`` where the block's largest
    magnitude ``amax`` is > 0, else 0 (MXFP4's, with bias 125: llama.cpp's ``floor(log2(amax)) - 2`` in E8M0)."""
    amax = x.abs().max(dim=1).values
    exp = torch.frexp(amax).exponent.to(torch.int64) - 1  # floor(log2(amax)) exactly: amax = mant * 2**exp
    return torch.where(amax > 0, exp + bias, torch.zeros_like(exp))


def encode_pow2_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    e0: torch.Tensor | None,
    e0_bias: int,
    offsets: Sequence[int],
    emin: int,
    emax: int,
    scale_of: Callable[[torch.Tensor], torch.Tensor],
    record: Record,
    zero_empty: bool = False,
) -> torch.Tensor:
    """:func:`._blockfit.fit_pow2_torch` of x, w (B, n) float32 from the start codes ``e0`` ((B,) int64; None:
    :func:`pow2_start` with ``e0_bias``), written as ``record`` (``scale_bytes`` 1) -> (B / sub_blocks,
    record_bytes(n)) uint8; ``zero_empty``: a block of zeros gets scale code 0 (NVFP4's)."""
    start = pow2_start(x, e0_bias) if e0 is None else e0
    e, codes = fit_pow2_torch(x, w, grid, start, offsets, emin, emax, scale_of)
    if zero_empty:
        e = torch.where(x.abs().amax(dim=1) > 0, e, torch.zeros_like(e))
    return pack_record(record, e.to(torch.uint8)[:, None], codes)
