"""The one-scale block search (Triton): :func:`fit_scale`, fused.

:func:`fit_scale` has the signature and the contract of its torch reference,
:func:`dynaquant.quant.codecs._blockfit.fit_scale_torch` (the scale search of the legacy ``Q4_0`` / ``Q5_0`` /
``Q8_0``, ``IQ4_NL``, ``IQ4_XS``'s sub-blocks and the symmetric ``INT{b}_G{g}`` runtime formats);
:mod:`dynaquant.kernels` registers it as the fast path ``blockfit.fit_scale``.

Why a kernel: the reference scores its candidates as stacks of (n, 8, blocks) tensors, about ten torch passes
over the chunk a candidate group plus the exact stage's passes (a Q4_0 chunk of 58 M weights: ~35 ms on an H100, some
8 GB of memory traffic for 235 MB of input). Here a program holds a (blocks, n) tile of ``x`` and ``w`` in
registers and runs the whole search on it: the candidates (the targets, then the anchors) with their least-squares
scores, the first best kept; the exact stage (the fp16 scale, the Lloyd refits, the neighbouring fp16 values) on the
decoder's float32 values; the codes under the stored scale. It reads ``x`` and ``w`` once and writes ``d`` and the
codes.

The float operations repeat the reference's in the same order (launched with ``enable_fp_fusion=False``), except
the sums over a block, whose order differs: scores and errors can differ by float32 rounding, and a near-tie can
keep the other candidate (the tests compare with the reference). Grids: linear (consecutive integers, rounded
half to even and clamped) and the half-integer-midpoint grids (``kvalues_iq4nl``: the reference's lookup table on
``floor(2 t)``); other grids, and blocks of a size that is not a power of two up to 256, run the torch reference.
Importing this module imports Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from dynaquant.kernels.kquant_triton import round_clamp
from dynaquant.quant.codecs import _blockfit as bf

__all__ = ["fit_scale", "supported"]

_TILE = 2048  # elements of a program's (blocks, n) tile
_OPTS = {"num_warps": 4, "enable_fp_fusion": False}
_MAX_N = 256


@triton.jit
def _first_argmax(v, cols, N: tl.constexpr):
    """Index of each row's first largest entry (``torch.argmax``'s choice)."""
    m = tl.max(v, 1)
    return tl.min(tl.where(v == m[:, None], cols[None, :], N), 1)


@triton.jit
def _at(v, idx, cols):
    """``v[b, idx[b]]`` (exact: one term of a sum of zeros)."""
    return tl.sum(tl.where(cols[None, :] == idx[:, None], v, 0.0), 1)


@triton.jit
def _half_k(t, KMIN: tl.constexpr, KMAX: tl.constexpr):
    """The reference's lookup index ``clamp(floor(2 t), kmin, kmax) - kmin`` (int32)."""
    return (tl.minimum(tl.maximum(tl.floor(t * 2.0), KMIN), KMAX) - KMIN).to(tl.int32)


@triton.jit
def _value(t, vlut_ptr, LINEAR: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, KMIN: tl.constexpr,
           KMAX: tl.constexpr):
    """The value of the level nearest to ``t`` (``Grid.values_of``)."""
    if LINEAR:
        return round_clamp(t, LO, HI)
    else:
        return tl.load(vlut_ptr + _half_k(t, KMIN, KMAX))


@triton.jit
def _code(t, clut_ptr, LINEAR: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, KMIN: tl.constexpr,
          KMAX: tl.constexpr):
    """The index of the level nearest to ``t`` (``Grid.codes_of``), int32."""
    if LINEAR:
        return (round_clamp(t, LO, HI) - LO).to(tl.int32)
    else:
        return tl.load(clut_ptr + _half_k(t, KMIN, KMAX))


@triton.jit
def _score(inv, x, w, wx, best_s, best_d, vlut_ptr, LINEAR: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
           KMIN: tl.constexpr, KMAX: tl.constexpr):
    """One candidate inverse scale per block: its codes' least-squares score ``Sqx**2 / Sqq`` and scale
    ``Sqx / Sqq``, kept where the score is higher."""
    q = _value(x * inv[:, None], vlut_ptr, LINEAR, LO, HI, KMIN, KMAX)
    sqx = tl.sum(q * wx, 1)
    sq2 = tl.sum((q * q) * w, 1)
    pos = sq2 > 0
    den = tl.where(pos, sq2, 1.0)
    s = tl.where(pos, sqx * sqx / den, -1.0)
    take = s > best_s
    return tl.where(take, s, best_s), tl.where(take, sqx / den, best_d)


@triton.jit
def _consider(d, x, w, best_err, best_df, vlut_ptr, LINEAR: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
              KMIN: tl.constexpr, KMAX: tl.constexpr):
    """The exact stage's step: ``d`` rounded to fp16 as stored, the nearest levels under it, the error on the
    decoder's ``d * level``; kept where lower. Returns the levels and the running best."""
    df = tl.minimum(tl.maximum(d, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    q = _value(x / tl.where(df == 0, 1.0, df)[:, None], vlut_ptr, LINEAR, LO, HI, KMIN, KMAX)
    r = x - df[:, None] * q
    err = tl.sum(w * (r * r), 1)
    take = err < best_err
    return q, tl.where(take, err, best_err), tl.where(take, df, best_df)


@triton.jit(do_not_specialize=["B", "NT", "NA", "NU"])
def fit_scale_kernel(x_ptr, w_ptr, tgt_ptr, off_ptr, ulp_ptr, lv_ptr, vlut_ptr, clut_ptr, d_ptr, code_ptr,
                     B, NT, NA, NU, NLEV: tl.constexpr, AMAX: tl.constexpr, ZERO: tl.constexpr, LINEAR: tl.constexpr,
                     LO: tl.constexpr, HI: tl.constexpr, KMIN: tl.constexpr, KMAX: tl.constexpr,
                     LLOYD: tl.constexpr, N: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    rmask = rows < B
    cols = tl.arange(0, N)
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0)
    w = tl.load(w_ptr + offs, mask=rmask[:, None], other=0.0)
    wx = w * x
    xmax = _at(x, _first_argmax(tl.abs(x), cols, N), cols)
    sxmax = tl.where(xmax == 0, 1.0, xmax)
    best_s = tl.full((BLOCK_B,), -1.0, tl.float32)
    best_d = tl.zeros((BLOCK_B,), tl.float32)
    for c in range(NT):  # targets: the largest weight on level c
        best_s, best_d = _score(tl.load(tgt_ptr + c) / sxmax, x, w, wx, best_s, best_d, vlut_ptr, LINEAR, LO, HI,
                                KMIN, KMAX)
    if NA > 0:  # anchors: the most important weight (largest w x^2) exactly on a level near its own
        xj = _at(x, _first_argmax(wx * x, cols, N), cols)
        d_nom = tl.abs(xmax) / AMAX
        sd = tl.where(d_nom == 0, 1.0, d_nom)
        sxj = tl.where(xj == 0, 1.0, xj)
        i0 = _code(xj / sd, clut_ptr, LINEAR, LO, HI, KMIN, KMAX)
        for a in range(NA):
            i = i0 + tl.load(off_ptr + a)
            lvl = tl.load(lv_ptr + tl.minimum(tl.maximum(i, 0), NLEV - 1))
            ok = (i >= 0) & (i < NLEV) & (lvl != 0)
            best_s, best_d = _score(tl.where(ok, lvl / sxj, 1.0 / sd), x, w, wx, best_s, best_d, vlut_ptr, LINEAR,
                                    LO, HI, KMIN, KMAX)
    # exact stage: the all-zero block first, then the best candidate, Lloyd refits, fp16 neighbours
    best_err = tl.sum(wx * x, 1)
    best_df = tl.zeros((BLOCK_B,), tl.float32)
    q, best_err, best_df = _consider(best_d, x, w, best_err, best_df, vlut_ptr, LINEAR, LO, HI, KMIN, KMAX)
    for _ in tl.static_range(LLOYD):
        sq2 = tl.sum((w * q) * q, 1)
        pos = sq2 > 0
        d = tl.where(pos, tl.sum(wx * q, 1) / tl.where(pos, sq2, 1.0), best_df)
        q, best_err, best_df = _consider(d, x, w, best_err, best_df, vlut_ptr, LINEAR, LO, HI, KMIN, KMAX)
    base = best_df
    bits = base.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    for u in range(NU):
        nb = tl.minimum(tl.maximum(bits + tl.load(ulp_ptr + u), -32768), 32767)
        nf = nb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        ok = (tl.abs(nf) < float("inf")) & ((nb < 0) == (bits < 0))
        q, best_err, best_df = _consider(tl.where(ok, nf, base), x, w, best_err, best_df, vlut_ptr, LINEAR, LO, HI,
                                         KMIN, KMAX)
    codes = _code(x / tl.where(best_df == 0, 1.0, best_df)[:, None], clut_ptr, LINEAR, LO, HI, KMIN, KMAX)
    codes = tl.where(best_df[:, None] == 0, ZERO, codes)
    tl.store(d_ptr + rows, best_df.to(tl.float16), mask=rmask)
    tl.store(code_ptr + offs, codes.to(tl.int64), mask=rmask[:, None])


_TABLES: dict = {}


def _tables(grid: bf.Grid, targets: Sequence[float], anchors: Sequence[int], ulps: Sequence[int], device):
    """Device tensors of a search (cached per grid, candidate lists and device)."""
    key = (id(grid), tuple(targets), tuple(anchors), tuple(ulps), str(device))
    if key not in _TABLES:
        f32, i32 = torch.float32, torch.int32
        lv = torch.tensor(grid.levels, dtype=f32, device=device)
        clut, vlut = (torch.zeros(1, dtype=i32, device=device), lv) if grid.linear else grid.lookup(device)
        _TABLES[key] = (grid, torch.tensor(list(targets) or [0.0], dtype=f32, device=device),
                        torch.tensor(list(anchors) or [0], dtype=i32, device=device),
                        torch.tensor(list(ulps) or [0], dtype=i32, device=device), lv, vlut, clut)
    return _TABLES[key][1:]


def supported(x: torch.Tensor, grid: bf.Grid) -> bool:
    """Whether the kernel runs this search: (B, n) blocks with ``n`` a power of two up to 256, on a linear or
    half-integer-midpoint grid."""
    n = x.shape[-1] if x.ndim == 2 else 0
    return 0 < n <= _MAX_N and n & (n - 1) == 0 and (grid.linear or grid.half_int)


def fit_scale(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: bf.Grid,
    targets: Sequence[float],
    anchor_offsets: Sequence[int] = (),
    lloyd_steps: int = 1,
    ulps: Sequence[int] = (-1, 1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dynaquant.quant.codecs._blockfit.fit_scale_torch`, fused (module docstring): the same arguments
    ((B, n) float32 ``x`` and importance ``w`` > 0) and results ((B,) float16 stored scales, (B, n) int64 codes
    into ``grid``). Searches the kernel does not run (:func:`supported`) go to the reference."""
    if not supported(x, grid) or w.shape != x.shape:
        return bf.fit_scale_torch(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps)
    b, n = x.shape
    xc = x.to(torch.float32).contiguous()
    wc = w.to(device=x.device, dtype=torch.float32).contiguous()
    tgt, off, ulp, lv, vlut, clut = _tables(grid, targets, anchor_offsets, ulps, x.device)
    d = torch.empty(b, dtype=torch.float16, device=x.device)
    codes = torch.empty(b, n, dtype=torch.int64, device=x.device)
    if b == 0:
        return d, codes
    block = _TILE // n
    kmin, kmax = (grid.kmin, grid.kmax) if grid.half_int and not grid.linear else (0, 0)
    fit_scale_kernel[(triton.cdiv(b, block),)](
        xc, wc, tgt, off, ulp, lv, vlut, clut, d, codes, b, len(targets), len(anchor_offsets), len(ulps),
        NLEV=len(grid.levels), AMAX=float(max(abs(grid.lo), abs(grid.hi))), ZERO=grid.zero_code(),
        LINEAR=grid.linear, LO=float(grid.lo), HI=float(grid.hi), KMIN=float(kmin), KMAX=float(kmax),
        LLOYD=int(lloyd_steps), N=n, BLOCK_B=block, **_OPTS)
    return d, codes
