"""The lattice searches of the grid i-quants on the CPU, compiled (``lattice_search.c``): the CPU fast paths
``lattice.nearest_codewords``, ``lattice.candidate_terms`` and ``lattice.subset_min_costs`` of
:mod:`dynaquant.quant.codecs.fastpaths` (IQ2_XXS, IQ2_XS, IQ2_S), with the signatures and returns of their torch
references in :mod:`dynaquant.quant.codecs._lattice` (shapes and dtypes there) and of the Triton kernels of
:mod:`dynaquant.kernels.lattice_search`. Raises RuntimeError (from :func:`dynaquant.kernels.native.library`) when
the library cannot be built.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from dynaquant.kernels.native import cpu_contiguous, library, ptr, split_rows
from dynaquant.quant.codecs import _lattice as lat
from dynaquant.quant.codecs import iq3
from dynaquant.quant.codecs._lattice import nearest_codewords_torch

_I64, _INT = ctypes.c_int64, ctypes.c_int
_MAX_D = 8
_MAX_L = 16


def _lib() -> ctypes.CDLL:
    lib = library("lattice_search")
    if not getattr(lib, "_dq_typed", False):
        vp = ctypes.c_void_p
        lib.dq_nearest_codewords.argtypes = [vp, vp, _INT, vp, vp, vp, _INT, _INT, vp, _INT, _I64, vp, _I64, _I64, vp, vp]
        lib.dq_candidate_terms.argtypes = [vp, vp, _INT, vp, vp, _INT, vp, _I64, vp, vp]
        lib.dq_subset_min_costs.argtypes = [vp, vp, _INT, vp, _INT, _I64, _I64, _I64, vp]
        lib.dq_iq3_nearest_variants.argtypes = [vp, vp, _I64, vp, vp, _INT, vp, vp, vp, vp, vp, _INT, vp, vp]
        lib.dq_ternary_nearest.argtypes = [vp, vp, vp, vp, _I64, vp, vp, vp, _INT, ctypes.c_float, vp]
        for f in (lib.dq_nearest_codewords, lib.dq_candidate_terms, lib.dq_subset_min_costs, lib.dq_iq3_nearest_variants,
                  lib.dq_ternary_nearest):
            f.restype = None
        lib._dq_typed = True
    return lib


def build() -> None:
    """Build (or find) the library: the fast paths' loader calls it first (:func:`dynaquant.kernels._loader`)."""
    _lib()


def _groups(x: torch.Tensor, w: torch.Tensor, grid: torch.Tensor):
    if x.ndim != 2 or w.shape != x.shape or grid.ndim != 2 or grid.shape[1] != x.shape[1] or x.shape[1] > _MAX_D:
        raise ValueError(f"expected x, w (n, D <= {_MAX_D}) and grid (G, D), got {tuple(x.shape)}, {tuple(w.shape)}, "
                         f"{tuple(grid.shape)}")
    return cpu_contiguous(x, torch.float32), cpu_contiguous(w, torch.float32), cpu_contiguous(grid, torch.float32)


def _scales(scale: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Size]:
    """(..., n) scales as a contiguous (T, n) float32 CPU tensor, and the leading shape."""
    if scale.shape[-1:] != (n,):
        raise ValueError(f"scale must be (..., {n}), got {tuple(scale.shape)}")
    lead = scale.shape[:-1]
    return cpu_contiguous(scale, torch.float32).reshape(math.prod(lead), n), lead


def _odd(odd: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if odd is None:
        return None
    if odd.shape != (n,):
        raise ValueError(f"odd must be ({n},), got {tuple(odd.shape)}")
    return cpu_contiguous(odd, torch.int8)


_LEVELS: dict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}


def _level_tables(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A codebook's coordinates as levels (cached by its contents): off (G, D) uint8 ``i L + level index`` of
    coordinate ``i``, the L sorted levels (L,) float32 and their squares, or None past :data:`_MAX_L` levels."""
    key = grid.numpy().tobytes() + bytes(str(tuple(grid.shape)), "ascii")
    if key not in _LEVELS:
        levels = torch.unique(grid)
        if levels.numel() > _MAX_L:
            _LEVELS[key] = None
        else:
            lev = torch.searchsorted(levels, grid.contiguous())
            off = (lev + levels.numel() * torch.arange(grid.shape[1])).to(torch.uint8).contiguous()
            _LEVELS[key] = (off, levels.contiguous(), (levels * levels).contiguous())
    return _LEVELS[key]


def nearest_codewords(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: torch.Tensor,
    scale: torch.Tensor,
    odd: torch.Tensor | None = None,
    *,
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`dynaquant.quant.codecs._lattice.nearest_codewords_torch`: (cost (..., n) float32, idx (..., n)
    int64), among exact ties the lowest index. ``variant`` (the Triton kernel's) is unused. Groups of other than 4
    or 8 weights, and codebooks with more than 16 distinct coordinate values, run the torch reference."""
    if x.ndim == 2 and x.shape[1] not in (4, 8):
        return nearest_codewords_torch(x, w, grid, scale, odd)
    x, w, grid = _groups(x, w, grid)
    tables = _level_tables(grid)
    if tables is None:
        return nearest_codewords_torch(x, w, grid, scale, odd)
    off, lv, lv2 = tables
    n, d = x.shape
    sc, lead = _scales(scale, n)
    t = sc.shape[0]
    oc = _odd(odd, n)
    cost = torch.empty(t, n, dtype=torch.float32)
    idx = torch.empty(t, n, dtype=torch.int64)
    if n and t:
        lib = _lib()

        def run(i0, i1):
            lib.dq_nearest_codewords(ptr(x), ptr(w), d, ptr(off), ptr(lv), ptr(lv2), lv.shape[0], grid.shape[0], ptr(sc),
                                     t, n, None if oc is None else ptr(oc), i0, i1, ptr(cost), ptr(idx))

        split_rows(n, run)
    return cost.reshape(*lead, n), idx.reshape(*lead, n)


def candidate_terms(
    x: torch.Tensor, w: torch.Tensor, grid: torch.Tensor, idx: torch.Tensor, odd: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`dynaquant.quant.codecs._lattice.candidate_terms_torch`: (b, c), each (n, K) float32."""
    x, w, grid = _groups(x, w, grid)
    n, d = x.shape
    if idx.ndim != 2 or idx.shape[0] != n:
        raise ValueError(f"idx must be ({n}, K), got {tuple(idx.shape)}")
    k = idx.shape[1]
    ic = cpu_contiguous(idx, torch.int64)
    if n and k and not bool(((ic >= 0) & (ic < grid.shape[0])).all()):
        raise IndexError(f"candidate indices out of the codebook's range [0, {grid.shape[0]})")
    oc = _odd(odd, n)
    b = torch.empty(n, k, dtype=torch.float32)
    c = torch.empty(n, k, dtype=torch.float32)
    if n and k:
        lib = _lib()

        def run(i0, i1):
            lib.dq_candidate_terms(ptr(x, i0 * d), ptr(w, i0 * d), d, ptr(grid), ptr(ic, i0 * k), k,
                                   None if oc is None else ptr(oc, i0), i1 - i0, ptr(b, i0 * k), ptr(c, i0 * k))

        split_rows(n, run)
    return b, c


def subset_min_costs(b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, gps: int = 1) -> torch.Tensor:
    """As :func:`dynaquant.quant.codecs._lattice.subset_min_costs_torch`: (n, K), (n, K), (..., n // gps) float32 ->
    (..., n // gps) float32, without the (..., n, K) temporary (``gps`` > 1: the scales repeated over each
    sub-block's groups and the minima summed by torch, as the reference does)."""
    if b.ndim != 2 or c.shape != b.shape:
        raise ValueError(f"expected b, c (n, K), got {tuple(b.shape)}, {tuple(c.shape)}")
    if gps != 1:
        cost = subset_min_costs(b, c, scale.repeat_interleave(gps, dim=-1))
        return cost.view(*cost.shape[:-1], -1, gps).sum(dim=-1)
    b, c = cpu_contiguous(b, torch.float32), cpu_contiguous(c, torch.float32)
    n, k = b.shape
    sc, lead = _scales(scale, n)
    t = sc.shape[0]
    cost = torch.empty(t, n, dtype=torch.float32)
    if n and t:
        if k == 0:
            return cost.fill_(math.inf).reshape(*lead, n)
        lib = _lib()

        def run(i0, i1):
            lib.dq_subset_min_costs(ptr(b), ptr(c), k, ptr(sc), t, n, i0, i1, ptr(cost))

        split_rows(n, run)
    return cost.reshape(*lead, n)


_LISTS: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}


def _candidate_lists(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cand (4096, K) int32, count (4096,) int32): the exact candidate lists of a grid of 8 levels
    (:func:`dynaquant.quant.codecs._lattice.dominance_candidates`, the lists the torch CPU search walks), cached by
    the grid's contents."""
    gn = grid.detach().to("cpu", torch.float32).contiguous().numpy()
    key = gn.tobytes()
    if key not in _LISTS:
        cand, cnt = lat.dominance_candidates(np.searchsorted(np.unique(gn), gn), 8)
        _LISTS[key] = (cand.to(torch.int32).contiguous(), cnt.to(torch.int32).contiguous())
    return _LISTS[key]


def nearest_variants(f: torch.Tensor, t: torch.Tensor, odd: torch.Tensor | None, flip_at: torch.Tensor | None,
                     kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor,
                     g8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`dynaquant.quant.codecs.iq3.nearest_variants_torch` (score (R, V) float32, idx (R, V) int64), an
    off-grid variant searching its level pattern's exact candidate list instead of the whole grid (the same point
    up to float32 rounding of near-ties; the first maximum, as the whole grid's argmax). Raises ValueError when the
    shapes disagree."""
    r = f.shape[0]
    nv = iq3.variant_count(f, t, odd, flip_at, kmap, mids, grid, g8)
    score = torch.empty(r, nv, dtype=torch.float32)
    idx = torch.empty(r, nv, dtype=torch.int64)
    if r == 0:
        return score, idx
    fc, tc = cpu_contiguous(f, torch.float32), cpu_contiguous(t, torch.float32)
    oc = None if odd is None else cpu_contiguous(odd, torch.int8)
    ac = None if flip_at is None else cpu_contiguous(flip_at, torch.int64)
    km = cpu_contiguous(kmap, torch.int32)
    md = cpu_contiguous(mids, torch.float32)
    g8t = cpu_contiguous(g8, torch.float32).T.contiguous()
    cand, cnt = _candidate_lists(grid)
    lib = _lib()

    def run(i0, i1):
        lib.dq_iq3_nearest_variants(ptr(fc, i0 * 8), ptr(tc, i0 * 4), i1 - i0, None if oc is None else ptr(oc, i0),
                                    None if ac is None else ptr(ac, i0), nv, ptr(km), ptr(md), ptr(g8t), ptr(cand),
                                    ptr(cnt), cand.shape[1], ptr(score, i0 * nv), ptr(idx, i0 * nv))

    split_rows(r, run)
    return score, idx


def ternary_nearest(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, sign: torch.Tensor, grid_of: torch.Tensor,
                    count: torch.Tensor, codes: torch.Tensor, delta: float) -> torch.Tensor:
    """As the Triton :func:`dynaquant.kernels.lattice_search.ternary_nearest`: IQ1's nearest ternary grid point of
    each group of 8 (x, w (m, 8) float32, t, sign (m,) float32; the tables of
    :func:`dynaquant.quant.codecs.iq1._kernel_tables`) -> (m,) int64, the indices of
    :func:`dynaquant.quant.codecs.iq1.nearest_points`'s torch search bit for bit (the same operations in the same
    order). Raises ValueError when the shapes disagree."""
    m = x.shape[0]
    if x.shape != (m, 8) or w.shape != (m, 8) or t.shape != (m,) or sign.shape != (m,) or codes.ndim != 2:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, t {tuple(t.shape)}, sign "
                         f"{tuple(sign.shape)}, codes {tuple(codes.shape)}")
    idx = torch.empty(m, dtype=torch.int64)
    if m == 0:
        return idx
    xc, wc, tc, sc = (cpu_contiguous(v, torch.float32) for v in (x, w, t, sign))
    go, cn, cd = (cpu_contiguous(v, torch.int32) for v in (grid_of, count, codes))
    lib = _lib()

    def run(i0, i1):
        lib.dq_ternary_nearest(ptr(xc, i0 * 8), ptr(wc, i0 * 8), ptr(tc, i0), ptr(sc, i0), i1 - i0, ptr(go), ptr(cn),
                               ptr(cd), cd.shape[1], float(delta), ptr(idx, i0))

    split_rows(m, run)
    return idx
