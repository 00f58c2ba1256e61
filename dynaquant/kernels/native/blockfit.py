"""The one-scale block searches on the CPU, compiled (``blockfit.c``): the CPU fast paths ``blockfit.fit_scale`` and
``blockfit.fit_pow2`` of :mod:`dynaquant.quant.codecs.fastpaths`, with the signatures and returns of
:func:`dynaquant.quant.codecs._blockfit.fit_scale_torch` (Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS's sub-blocks) and
:func:`~dynaquant.quant.codecs._blockfit.fit_pow2_torch` (MXFP4, NVFP4). Grids they do not cover (levels rounded by
bucketize; a linear grid for ``fit_pow2``), blocks over 32 weights, more than 64 candidates and ``ulps`` run the torch
reference. Raises RuntimeError (from :func:`dynaquant.kernels.native.library`) when the library cannot be built.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from dynaquant.kernels.native import cpu_contiguous, library, ptr, split_rows
from dynaquant.quant.codecs._blockfit import Grid, fit_pow2_torch, fit_scale_torch

_MAX_N = 32
_MAX_CAND = 64


def _lib() -> ctypes.CDLL:
    lib = library("blockfit")
    if not getattr(lib, "_dq_typed", False):
        vp, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.dq_fit_scale.argtypes = [vp, vp, i64, i, i, f, f, i, i, vp, vp, i, vp, i, vp, i, vp, i, i, vp, vp]
        lib.dq_fit_scale.restype = None
        lib.dq_fit_pow2.argtypes = [vp, vp, i64, i, i, i, vp, vp, vp, vp, i, i, i, vp, vp, vp]
        lib.dq_fit_pow2.restype = None
        lib._dq_typed = True
    return lib


def build() -> None:
    """Build (or find) the library: the fast paths' loader calls it first (:func:`dynaquant.kernels._loader`)."""
    _lib()


def _tables(grid: Grid):
    """(vlut float32, lut int32) of a half-integer-midpoint grid, dummies for a linear one (CPU tensors)."""
    if grid.linear:
        return torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.int32)
    lut, vlut = grid.lookup("cpu")
    return vlut.contiguous(), lut.to(torch.int32).contiguous()


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
    if ulps or not (grid.linear or grid.half_int) or x.ndim != 2 or x.shape[1] > _MAX_N or n_cand > _MAX_CAND:
        return fit_scale_torch(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps)
    x, w = cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32)
    B, N = x.shape
    lib = _lib()
    vlut, lut = _tables(grid)
    levels = grid.level_tensor("cpu").contiguous()
    tg = torch.tensor([float(t) for t in targets], dtype=torch.float32)
    offs = torch.tensor(list(anchor_offsets) or [0], dtype=torch.int32)
    d = torch.empty(B, dtype=torch.float16)
    codes = torch.empty(B, N, dtype=torch.int64)
    kmin, kmax = (0, 0) if grid.linear else (grid.kmin, grid.kmax)

    def run(i0, i1):
        lib.dq_fit_scale(ptr(x, i0 * N), ptr(w, i0 * N), i1 - i0, N, int(grid.linear), grid.lo, grid.hi, kmin, kmax,
                         ptr(vlut), ptr(lut), grid.zero_code(), ptr(levels), len(grid.levels), ptr(tg), len(tg), ptr(offs),
                         len(anchor_offsets), lloyd_steps, ptr(d, i0), ptr(codes, i0 * N))

    split_rows(B, run)
    return d, codes


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
    if grid.linear or not grid.half_int or x.ndim != 2 or x.shape[1] > _MAX_N or not 0 <= emin <= emax:
        return fit_pow2_torch(x, w, grid, e0, offsets, emin, emax, scale_of)
    table = scale_of(torch.arange(emax + 1, dtype=torch.int64)).to(torch.float32).contiguous()
    if not bool((table[emin:] > 0).all()):
        return fit_pow2_torch(x, w, grid, e0, offsets, emin, emax, scale_of)
    x, w = cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32)
    B, N = x.shape
    lib = _lib()
    vlut, lut = _tables(grid)
    e0 = cpu_contiguous(e0, torch.int64)
    offs = torch.tensor(list(offsets), dtype=torch.int32)
    e = torch.empty(B, dtype=torch.int64)
    codes = torch.empty(B, N, dtype=torch.int64)

    def run(i0, i1):
        lib.dq_fit_pow2(ptr(x, i0 * N), ptr(w, i0 * N), i1 - i0, N, grid.kmin, grid.kmax, ptr(vlut), ptr(lut), ptr(e0, i0),
                        ptr(offs), len(offs), emin, emax, ptr(table), ptr(e, i0), ptr(codes, i0 * N))

    split_rows(B, run)
    return e, codes
