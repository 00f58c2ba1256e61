"""The one-scale block searches on the CPU, compiled (``blockfit.c``): the CPU fast paths of
:mod:`dynaquant.quant.codecs.fastpaths`

* ``blockfit.fit_scale`` and ``blockfit.fit_pow2``, with the signatures and returns of
  :func:`dynaquant.quant.codecs._blockfit.fit_scale_torch` (Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS's sub-blocks) and
  :func:`~dynaquant.quant.codecs._blockfit.fit_pow2_torch` (MXFP4, NVFP4): the scales and int64 codes;
* ``blockfit.encode_scale`` and ``blockfit.encode_pow2``, with those of
  :func:`dynaquant.quant.codecs._records.encode_scale_torch` and :func:`~dynaquant.quant.codecs._records.encode_pow2_torch`:
  the same searches writing the format's block records straight (no int64 codes, no torch pack).

Grids they do not cover (levels rounded by bucketize; a linear grid for the power-of-two search), blocks over 32
weights, more than 64 candidates and ``ulps`` run the torch reference. The tables a call needs (the grid's lookup
tables, the candidates, the record's layout) are made once a search configuration and kept. Raises RuntimeError
(from :func:`dynaquant.kernels.native.library`) when the library cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch

from dynaquant.kernels.native import cpu_contiguous, library, ptr, split_rows
from dynaquant.quant.codecs._blockfit import Grid, fit_pow2_torch, fit_scale_torch
from dynaquant.quant.codecs._records import Record, encode_pow2_torch, encode_scale_torch

_MAX_N = 32
_MAX_CAND = 64
_MAX_K = 1 << 20  # |levels| and |floor(2 t)| bounds of the C side's rounding (blockfit.c: < 2^21)
_WRITERS = {None: 0, "i8": 1, "nibbles": 2, "q5": 3, "pairs": 4}  # blockfit.c's WR_*


def _lib() -> ctypes.CDLL:
    lib = library("blockfit")
    if not getattr(lib, "_dq_typed", False):
        vp, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.dq_fit_scale.argtypes = [vp, vp, i64, i, i64, i, f, f, i, i, vp, vp, i, vp, i, vp, i, vp, i, i, vp, vp, vp, vp]
        lib.dq_fit_scale.restype = None
        lib.dq_fit_pow2.argtypes = [vp, vp, i64, i, i64, i, i, vp, vp, vp, i, vp, i, i, i, vp, vp, i, vp, vp, vp, vp]
        lib.dq_fit_pow2.restype = None
        lib._dq_typed = True
    return lib


def build() -> None:
    """Build (or find) the library: the fast paths' loader calls it first (:func:`dynaquant.kernels._loader`)."""
    _lib()


def _covered(grid: Grid) -> bool:
    """A grid the C side rounds: linear, or a half-integer-midpoint table, its keys within the rounding's range."""
    if grid.linear:
        return max(abs(grid.lo), abs(grid.hi)) < _MAX_K
    return grid.half_int and max(abs(grid.kmin), abs(grid.kmax)) < _MAX_K


@functools.cache
def _grid_tables(grid: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(vlut float32, lut int32, levels float32) of a grid (dummy tables for a linear one), CPU, made once a grid."""
    levels = grid.level_tensor("cpu").contiguous()
    if grid.linear:
        return torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.int32), levels
    lut, vlut = grid.lookup("cpu")
    return vlut.contiguous(), lut.to(torch.int32).contiguous(), levels


@functools.cache
def _layout(record: Record | None, n: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """blockfit.c's writer of ``record`` (None: int64 codes) for blocks of ``n``: (layout (4,) int32, code_map int32
    or None, blocks a record, output elements a record)."""
    if record is None:
        return torch.tensor([0, 1, 0, 0], dtype=torch.int32), None, 1, n
    size = record.record_bytes(n)
    layout = torch.tensor([_WRITERS[record.codes], record.sub_blocks, record.code_offset, size], dtype=torch.int32)
    cmap = None if record.code_map is None else torch.tensor(record.code_map, dtype=torch.int32)
    return layout, cmap, record.sub_blocks, size


@functools.cache
def _scale_plan(grid: Grid, targets: tuple[float, ...], anchor_offsets: tuple[int, ...], lloyd_steps: int,
                record: Record | None, n: int) -> tuple[tuple, int, int, tuple]:
    """dq_fit_scale's arguments that do not change from call to call (ctypes pointers to the tables), blocks a record,
    output elements a record, and the tables (kept alive with the pointers): made once a search configuration."""
    vlut, lut, levels = _grid_tables(grid)
    tg = torch.tensor([float(t) for t in targets], dtype=torch.float32)
    offs = torch.tensor(list(anchor_offsets) or [0], dtype=torch.int32)
    layout, cmap, sub, row = _layout(record, n)
    kmin, kmax = (0, 0) if grid.linear else (grid.kmin, grid.kmax)
    consts = (int(grid.linear), grid.lo, grid.hi, kmin, kmax, ptr(vlut), ptr(lut), grid.zero_code(), ptr(levels),
              len(grid.levels), ptr(tg), len(targets), ptr(offs), len(anchor_offsets), lloyd_steps, ptr(layout),
              None if cmap is None else ptr(cmap))
    return consts, sub, row, (tg, offs)


def _scale_call(x, w, grid, targets, anchor_offsets, lloyd_steps, record, d, out) -> None:
    """dq_fit_scale over x, w (B, N) float32 contiguous, into d (B,) float16 and out (int64 codes, record None) or
    out (B / sub_blocks, record_bytes) uint8, split over the threads at whole records."""
    B, N = x.shape
    fn = _lib().dq_fit_scale
    consts, sub, row, _ = _scale_plan(grid, tuple(targets), tuple(anchor_offsets), lloyd_steps, record, N)
    xp, wp, dp, op = x.data_ptr(), w.data_ptr(), d.data_ptr(), out.data_ptr()
    osize = out.element_size() * row

    def run(r0, r1):  # records r0 .. r1 - 1
        i0, i1 = r0 * sub, r1 * sub
        fn(xp + 4 * i0 * N, wp + 4 * i0 * N, i1 - i0, N, i1 - i0, *consts, dp + 2 * i0, op + osize * r0)

    split_rows(B // sub, run)


def fit_scale(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    targets: Sequence[float],
    anchor_offsets: Sequence[int] = (),
    lloyd_steps: int = 1,
    ulps: Sequence[int] = (-1, 1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`dynaquant.quant.codecs._blockfit.fit_scale_torch`: ``(d (B,) float16, codes (B, n) int64)``."""
    n_cand = len(targets) + len(anchor_offsets)
    if ulps or not _covered(grid) or x.ndim != 2 or x.shape[1] > _MAX_N or n_cand > _MAX_CAND:
        return fit_scale_torch(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps)
    x, w = cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32)
    d = torch.empty(x.shape[0], dtype=torch.float16)
    codes = torch.empty(x.shape, dtype=torch.int64)
    _scale_call(x, w, grid, targets, anchor_offsets, lloyd_steps, None, d, codes)
    return d, codes


def encode_scale(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    targets: Sequence[float],
    anchor_offsets: Sequence[int],
    lloyd_steps: int,
    ulps: Sequence[int],
    record: Record,
) -> torch.Tensor:
    """As :func:`dynaquant.quant.codecs._records.encode_scale_torch`: (B / sub_blocks, record_bytes) uint8."""
    n_cand = len(targets) + len(anchor_offsets)
    if (ulps or not _covered(grid) or x.ndim != 2 or x.shape[1] > _MAX_N or n_cand > _MAX_CAND
            or record.scale_bytes != 2 or x.shape[0] % record.sub_blocks):
        return encode_scale_torch(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps, record)
    x, w = cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32)
    B, N = x.shape
    d = torch.empty(B, dtype=torch.float16)  # (unused by the record writers)
    out = torch.empty(B // record.sub_blocks, record.record_bytes(N), dtype=torch.uint8)
    _scale_call(x, w, grid, targets, anchor_offsets, lloyd_steps, record, d, out)
    return out


@functools.cache
def _scale_tables(scale_of: Callable[[torch.Tensor], torch.Tensor], emin: int, emax: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor, bool]:
    """(scale_of of every code 0..emax, float32; 1 / scale where that is exact, else 0: a power of two whose reciprocal
    is a normal float, x * inv is then x / scale bit for bit, blockfit.c; whether every scale from emin on is > 0)."""
    table = scale_of(torch.arange(emax + 1, dtype=torch.int64)).to(torch.float32).contiguous()
    mant, exp = torch.frexp(table)
    exact = (table > 0) & (mant == 0.5) & (exp - 1 <= 126) & (exp - 1 >= -125)  # 2**(exp-1), its inverse normal
    inv = torch.where(exact, 1.0 / torch.where(exact, table, 1.0), 0.0).to(torch.float32).contiguous()
    return table, inv, bool((table[emin:] > 0).all())


@functools.cache
def _pow2_plan(grid: Grid, offsets: tuple[int, ...], record: Record | None, n: int) -> tuple[tuple, tuple, tuple, int,
                                                                                            int, torch.Tensor]:
    """dq_fit_pow2's arguments that do not change from call to call (the grid's, the offsets', the writer's), blocks a
    record, output elements a record, and the offsets' tensor (kept alive with its pointer): made once a search
    configuration."""
    vlut, lut, _ = _grid_tables(grid)
    offs = torch.tensor(list(offsets), dtype=torch.int32)
    layout, cmap, sub, row = _layout(record, n)
    writer = (ptr(layout), None if cmap is None else ptr(cmap))
    return (grid.kmin, grid.kmax, ptr(vlut), ptr(lut)), (ptr(offs), len(offsets)), writer, sub, row, offs


def _pow2_call(x, w, grid, e0, e0_bias, offsets, emin, emax, table, inv, zero_empty, record, e, out) -> None:
    B, N = x.shape
    fn = _lib().dq_fit_pow2
    head, offs, writer, sub, row, _ = _pow2_plan(grid, tuple(offsets), record, N)
    mid = (*offs, emin, emax, table.data_ptr(), inv.data_ptr(), int(zero_empty), *writer)
    xp, wp, op = x.data_ptr(), w.data_ptr(), out.data_ptr()
    osize = out.element_size() * row

    def run(r0, r1):
        i0, i1 = r0 * sub, r1 * sub
        fn(xp + 4 * i0 * N, wp + 4 * i0 * N, i1 - i0, N, i1 - i0, *head, None if e0 is None else e0.data_ptr() + 8 * i0,
           e0_bias, *mid, None if e is None else e.data_ptr() + 8 * i0, op + osize * r0)

    split_rows(B // sub, run)


def _pow2_covered(grid: Grid, x: torch.Tensor, offsets: Sequence[int], positive: bool) -> bool:
    return not grid.linear and _covered(grid) and x.ndim == 2 and x.shape[1] <= _MAX_N and len(offsets) > 0 and positive


def fit_pow2(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    e0: torch.Tensor,
    offsets: Sequence[int],
    emin: int,
    emax: int,
    scale_of: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`dynaquant.quant.codecs._blockfit.fit_pow2_torch`: ``(e (B,) int64, codes (B, n) int64)``; the scales
    are ``scale_of`` of every code ``0..emax`` (a table), which must be positive from ``emin`` on."""
    if grid.linear or not 0 <= emin <= emax:
        return fit_pow2_torch(x, w, grid, e0, offsets, emin, emax, scale_of)
    table, inv, positive = _scale_tables(scale_of, emin, emax)
    if not _pow2_covered(grid, x, offsets, positive):
        return fit_pow2_torch(x, w, grid, e0, offsets, emin, emax, scale_of)
    x, w = cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32)
    e0 = cpu_contiguous(e0, torch.int64)
    e = torch.empty(x.shape[0], dtype=torch.int64)
    codes = torch.empty(x.shape, dtype=torch.int64)
    _pow2_call(x, w, grid, e0, 0, offsets, emin, emax, table, inv, False, None, e, codes)
    return e, codes


def encode_pow2(
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
    """As :func:`dynaquant.quant.codecs._records.encode_pow2_torch`: (B / sub_blocks, record_bytes) uint8."""
    args = (x, w, grid, e0, e0_bias, offsets, emin, emax, scale_of, record, zero_empty)
    if grid.linear or not 0 <= emin <= emax or record.scale_bytes != 1 or x.ndim != 2 or x.shape[0] % record.sub_blocks:
        return encode_pow2_torch(*args)
    table, inv, positive = _scale_tables(scale_of, emin, emax)
    if not _pow2_covered(grid, x, offsets, positive) or emax > 255:
        return encode_pow2_torch(*args)
    x, w = cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32)
    e0 = None if e0 is None else cpu_contiguous(e0, torch.int64)
    out = torch.empty(x.shape[0] // record.sub_blocks, record.record_bytes(x.shape[1]), dtype=torch.uint8)
    _pow2_call(x, w, grid, e0, e0_bias, offsets, emin, emax, table, inv, zero_empty, record, None, out)
    return out

