"""The kernels' weight layout: :class:`PackedWeight`, built at load time by :func:`pack`.

Pure torch (no Triton import): packing runs anywhere, and :func:`unpack` inverts it for the
reference and the tests. The layout (the only place it is defined):

- ``qweight`` int32 (N, K * b / 32), row-major: a row's codes packed densely along K, word ``j``
  holding codes ``k = e*j .. e*j + e - 1`` (``e = 32 / b`` codes a word), code ``k`` at bits
  ``b * (k % e)``. Rows are contiguous, so a tile of rows and words is read with 16-byte loads.
  Integer codes are stored unsigned: ``code + 2**(b-1)`` for symmetric formats, the code itself
  for asymmetric ones. FP4 codes are the E2M1 nibbles (bit 3 the sign).
- 3-bit codes use two bit planes: ``qweight`` holds the low two bits as 2-bit codes (16 a word)
  and ``qweight_hi`` int32 (N, K / 32) the third bit (32 a word, code ``k`` at bit ``k % 32``).
- ``scales`` (N, K / g), row-major: float16 / bfloat16 for integer formats, uint8 E8M0 exponents
  for MXFP4, uint8 E4M3 bit patterns for NVFP4 (whose float32 ``global_scale`` divides them).
- ``zeros`` uint8 (N, K / g) for asymmetric formats.
- ``super_weights``: ``(rows, cols, delta)`` with ``delta = value - dequant(W)[row, col]``; the
  kernels' callers add ``x[:, cols] * delta`` to ``y[:, rows]``.
- ``counters`` int32 (ceil(N / 16),) zeros: split-K semaphores (each reset by the last program of
  its tile, so they are zero between calls); one call at a time per weight (one stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaquant.kernels.formats import KernelFormat
from dynaquant.kernels.reference import dequantize_ref

__all__ = ["PackedWeight", "pack", "unpack", "stack", "pack_bits", "unpack_bits"]


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit values densely along the last axis into int32 words.

    Args:
        values: (R, C) integer tensor, values in ``0 .. 2**bits - 1``, C a multiple of ``32 / bits``.
        bits: 1, 2, 4 or 8.
    Returns:
        (R, C * bits / 32) int32; value ``c`` at bits ``bits * (c % (32 / bits))`` of word ``c // (32 / bits)``.
    """
    epw = 32 // bits
    r, c = values.shape
    if c % epw:
        raise ValueError(f"{c} values a row do not fill whole words of {epw}")
    v = values.to(torch.int64).reshape(r, c // epw, epw)
    shifts = torch.arange(epw, device=values.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


def unpack_bits(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: (R, W) int32 -> (R, W * 32 / bits) int64 values."""
    epw = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(epw, device=words.device, dtype=torch.int64) * bits
    return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A quantized weight W (N, K) in the kernels' layout (module docstring).

    Attributes:
        fmt: the format.
        out_features: N; in_features: K (a multiple of the group size).
        qweight: int32 (N, K * b / 32) (3-bit: (N, K / 16), the low two bits).
        qweight_hi: int32 (N, K / 32), the third bit of 3-bit codes; None otherwise.
        scales: (N, K / g) float16 / bfloat16 (integer formats) or uint8 (E8M0, E4M3 bits).
        zeros: uint8 (N, K / g) (asymmetric formats) or None.
        global_scale: NVFP4's float32 divisor (1.0 otherwise).
        super_weights: ``(rows, cols, delta)``: (S,) int64, (S,) int64, (S,) float32, or None.
        counters: int32 (ceil(N / 16),) split-K semaphores, zero between calls.
    """

    fmt: KernelFormat
    out_features: int
    in_features: int
    qweight: torch.Tensor
    qweight_hi: torch.Tensor | None
    scales: torch.Tensor
    zeros: torch.Tensor | None
    global_scale: float
    super_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    counters: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes a matrix product reads for the weight: codes, scales and zero points."""
        t = [self.qweight, self.qweight_hi, self.scales, self.zeros]
        return sum(x.numel() * x.element_size() for x in t if x is not None)

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Rows ``start .. stop - 1`` of the weight as a PackedWeight of views (rows are contiguous: no copy), its
        super weights those rows' (re-indexed), its own split-K counters. One expert of a stacked layout
        (:mod:`.grouped`)."""
        def cut(t):
            return None if t is None else t[start:stop]
        sw = None
        if self.super_weights is not None:
            r, c, d = self.super_weights
            keep = (r >= start) & (r < stop)
            sw = (r[keep] - start, c[keep], d[keep]) if bool(keep.any()) else None
        return PackedWeight(self.fmt, stop - start, self.in_features, cut(self.qweight), cut(self.qweight_hi),
                            cut(self.scales), cut(self.zeros), self.global_scale, sw,
                            torch.zeros(-(-(stop - start) // 16), dtype=torch.int32, device=self.device))

    def to(self, device) -> PackedWeight:
        """A copy with every tensor on ``device``."""
        def mv(t):
            return None if t is None else t.to(device)
        sw = None if self.super_weights is None else tuple(t.to(device) for t in self.super_weights)
        return PackedWeight(self.fmt, self.out_features, self.in_features, self.qweight.to(device), mv(self.qweight_hi),
                            self.scales.to(device), mv(self.zeros), self.global_scale, sw,
                            torch.zeros_like(self.counters, device=device))


def _check(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, f: KernelFormat) -> None:
    if codes.ndim != 2:
        raise ValueError(f"codes must be (N, K), got shape {tuple(codes.shape)}")
    n, k = codes.shape
    g = f.group_size
    if k % g or k % 32:
        raise ValueError(f"{f.name}: K = {k} must be a multiple of the group size {g} and of 32")
    if tuple(scales.shape) != (n, k // g):
        raise ValueError(f"{f.name}: scales must be ({n}, {k // g}), got {tuple(scales.shape)}")
    if f.kind == "int":
        if f.symmetric and codes.dtype != torch.int8:
            raise ValueError(f"{f.name}: symmetric codes must be int8, got {codes.dtype}")
        if not f.symmetric and codes.dtype != torch.uint8:
            raise ValueError(f"{f.name}: asymmetric codes must be uint8, got {codes.dtype}")
        if scales.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{f.name}: scales must be float16 or bfloat16, got {scales.dtype}")
        if f.symmetric != (zeros is None):
            raise ValueError(f"{f.name}: zeros must be given exactly for asymmetric formats")
        if zeros is not None and (tuple(zeros.shape) != (n, k // g) or zeros.dtype != torch.uint8):
            raise ValueError(f"{f.name}: zeros must be uint8 ({n}, {k // g})")
    else:
        if codes.dtype != torch.uint8:
            raise ValueError(f"{f.name}: E2M1 codes must be uint8, got {codes.dtype}")
        want = torch.uint8 if f.kind == "mxfp4" else torch.float8_e4m3fn
        if scales.dtype != want and scales.dtype != torch.uint8:
            raise ValueError(f"{f.name}: scales must be {want}, got {scales.dtype}")
        if zeros is not None:
            raise ValueError(f"{f.name} has no zero points")


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: str | KernelFormat, *,
         global_scale: float | torch.Tensor | None = None, super_weights=None) -> PackedWeight:
    """Repack an unpacked runtime weight into the kernels' layout, on the codes' device.

    Args:
        codes: (N, K) int8 (symmetric INT, levels ``-2**(b-1) .. 2**(b-1)-1``) or uint8 (asymmetric
            INT codes ``0 .. 2**b - 1``; FP4 E2M1 nibbles 0..15).
        scales: (N, K / g) float16 / bfloat16 (INT), uint8 E8M0 exponents (MXFP4) or
            float8_e4m3fn (NVFP4; uint8 bit patterns accepted).
        zeros: (N, K / g) uint8 zero points (asymmetric INT) or None.
        fmt: a format name (``INT4_G128``, ``INT2_G64_ASYM``, ``MXFP4_G32``, ``NVFP4_G16``) or KernelFormat.
        global_scale: NVFP4's float32 global scale (``w = e2m1 * float(scale) / global_scale``).
        super_weights: optional ``(rows, cols, values)`` restored exactly after dequantization.
    Returns:
        The PackedWeight (layout in the module docstring).
    Raises:
        ValueError: shapes, dtypes or code ranges that do not fit the format.
    """
    f = KernelFormat.parse(fmt)
    _check(codes, scales, zeros, f)
    n, k = codes.shape
    dev = codes.device
    b = f.bits
    if f.kind == "int":
        u = codes.to(torch.int32) + ((1 << (b - 1)) if f.symmetric else 0)
    else:
        u = codes.to(torch.int32)
    if int(u.min()) < 0 or int(u.max()) >= 1 << b:
        raise ValueError(f"{f.name}: codes out of range for {b}-bit storage")
    if b == 3:
        qweight, qweight_hi = pack_bits(u & 3, 2), pack_bits(u >> 2, 1)
    else:
        qweight, qweight_hi = pack_bits(u, b), None
    if f.kind == "nvfp4":
        if global_scale is None:
            raise ValueError("NVFP4_G16 needs its global scale")
        gs = float(torch.as_tensor(global_scale, dtype=torch.float32).reshape(-1)[0])
    else:
        gs = 1.0
    sc = scales.contiguous()
    if f.is_fp4:
        sc = sc.view(torch.uint8)
    sw = None
    if super_weights is not None:
        rows, cols, vals = (torch.as_tensor(t).reshape(-1) for t in super_weights)
        rows, cols, vals = rows.long().to(dev), cols.long().to(dev), vals.float().to(dev)
        if rows.numel():
            base = dequantize_ref(codes, scales, zeros, f, global_scale=gs)[rows, cols]
            sw = (rows, cols, vals - base)
    counters = torch.zeros(max(1, -(-n // 16)), dtype=torch.int32, device=dev)
    return PackedWeight(f, n, k, qweight.contiguous(), None if qweight_hi is None else qweight_hi.contiguous(), sc,
                        None if zeros is None else zeros.contiguous(), gs, sw, counters)


def unpack(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`pack` (super weights aside): ``(codes, scales, zeros)`` in the unpacked contract's dtypes."""
    f = packed.fmt
    b = f.bits
    if b == 3:
        u = unpack_bits(packed.qweight, 2) | (unpack_bits(packed.qweight_hi, 1) << 2)
    else:
        u = unpack_bits(packed.qweight, b)
    if f.kind == "int" and f.symmetric:
        codes = (u - (1 << (b - 1))).to(torch.int8)
    else:
        codes = u.to(torch.uint8)
    scales = packed.scales
    if f.kind == "nvfp4":
        scales = scales.view(torch.float8_e4m3fn)
    return codes, scales, packed.zeros


def stack(weights: list[PackedWeight]) -> PackedWeight:
    """Weights of one format and K stacked along N (the first's rows, then the second's, ...): the layout :func:`pack`
    gives the concatenated codes, without unpacking (rows are independent). Super weights keep their rows, offset.
    A mixture-of-experts layer's experts of one projection become one weight this way (:mod:`.grouped`).

    Raises:
        ValueError: no weights, or their formats, K or (NVFP4) global scales differ.
    """
    if not weights:
        raise ValueError("no weights to stack")
    f, k, gs = weights[0].fmt, weights[0].in_features, weights[0].global_scale
    if any(w.fmt != f or w.in_features != k or w.global_scale != gs for w in weights):
        raise ValueError("weights of different formats, K or global scales do not stack")

    def cat(attr):
        parts = [getattr(w, attr) for w in weights]
        return None if parts[0] is None else torch.cat(parts)

    offsets, sw = 0, []
    for w in weights:
        if w.super_weights is not None:
            r, c, d = w.super_weights
            sw.append((r + offsets, c, d))
        offsets += w.out_features
    supers = tuple(torch.cat(parts) for parts in zip(*sw)) if sw else None
    return PackedWeight(f, offsets, k, cat("qweight"), cat("qweight_hi"), cat("scales"), cat("zeros"), gs, supers,
                        torch.zeros(-(-offsets // 16), dtype=torch.int32, device=weights[0].device))
