"""IQ3_XXS / IQ3_S: the best grid point of every group of 4 weights and of its sign-flip variants, fused (Triton).

:func:`nearest_variants` has the signature and the contract of its torch reference,
:func:`dynaquant.quant.codecs.iq3.nearest_variants_torch`; :mod:`dynaquant.kernels` registers it as the fast path
``iq3.nearest_variants`` of the IQ3 codecs' assignment step (:meth:`dynaquant.quant.codecs.iq3._IQ3._assign`).

Why a kernel: on an H100 the torch assignment of a 4096 x 14336 IQ3_XXS tensor spent ~1.2 of its 1.34 s of GPU time
in gathers (the off-grid rows and the odd groups' variants selected, their features re-laid out, the results
scattered back) and in the (rows, P) score matrices' reductions, not in arithmetic. Here one lane holds one group:

- each variant (the unflipped group; for an 8-group with an odd number of negative weights, IQ3_XXS's parity, the
  group with weight ``i`` flipped: every ``i``, or the one ``flip_at`` names) looks up the grid point its
  per-weight nearest levels form (7 midpoint compares a weight, the level pattern's entry of ``kmap``); such a
  point is the variant's best;
- a variant off the grid walks its level pattern's exact candidate list (the grid points no other point dominates,
  :func:`dynaquant.quant.codecs._lattice.dominance_candidates`, the lists the CPU search uses: 20-23 points on
  average, at most 61 / 74, against the grid's 256 / 512), ascending, the first maximum kept (so the whole grid's
  answer); with ``lists=False`` (the former path) the whole grid is walked once when any variant of the program's
  groups is off it (points and squares as uniform loads), all variants scored from the same products (a flip of
  weight ``i`` lowers the score by ``2 f_i g_i``);
- nothing of size (groups, P) or (groups, V, 8) touches memory: a call reads ``f``, ``t`` (and the flags) and writes
  the (R, V) scores and indices;
- with :data:`PACKED` (default) a grid point is one int32 word (:func:`.iq3_tables.packed_points`: its 4 coordinates as fields
  times the grid's step, and its index), so a lookup in the level-pattern map, a candidate of a list and the chosen
  point of :func:`assign` are one 4-byte load each (the float tables took 8 loads a point, plus the index): the
  same coordinates, the same operations, the same results;
- :func:`assign` with ``sums=True`` (the encoder's calls) sums the per-weight terms of each sub-block in the kernel
  (:data:`SUMS`) and writes (n, 8) sums, not (n, 8, 32) terms that torch reads back to sum;
- :func:`consider` (fast path ``iq3.consider``) is one candidate scale of step 1 in one launch: the assignment, its
  sums and the running best's float64 update (:data:`CONSIDER`), where ~17 small torch ops a candidate ran;
- :func:`exact` (fast path ``iq3.exact``) is the exact error of an assignment under the stored scales with that
  assignment's least-squares sums, the next round's start (a torch pass over the points before), and its indices in
  the narrowest integer type of the grid; :func:`exact_levels` (``iq3.exact_levels``, off by default:
  :data:`dynaquant.quant.codecs.iq3.FUSED_LEVELS`) does a round's levels ``l``, ``l + 1``, ``l - 1`` in one launch,
  the better kept a sub-block in registers; :func:`step1` (``iq3.step1``, off by default:
  :data:`dynaquant.quant.codecs.iq3.FUSED_STEP1`) does step 1's candidate scales and Lloyd steps in one launch.

Sums run in a fixed order, not torch's, so scores can differ from the reference by float32 rounding and a near-tie
can pick the other point (the tests compare the errors, and the bytes through gguf-py's decoder).
Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynaquant.kernels import iq3_tables as tables
from dynaquant.quant.codecs import _iq3_search as steps
from dynaquant.quant.codecs import iq3

__all__ = ["assign", "consider", "exact", "exact_levels", "nearest_variants", "step1"]

_BLOCK = 32  # groups a program (one a lane)
# Measured on an H100 (2026-12-07, benchmarks/iq3_configs.py, a 4096 x 14336 tensor; out/iq3-configs-h100.json): the
# three paths below on and IQ3_XXS walking its lists too: IQ3_XXS 4.70e8 -> 8.14e8, IQ3_S 7.89e8 -> 1.46e9 weights/s,
# weighted error 1.0000002-4 of the former path's (near-ties in float32 sums), gguf-py decodes the bytes. Programs of
# 64 groups (2 warps) gained 5 % on IQ3_S and nothing on IQ3_XXS. Session 34 (out/iq3-configs-prefetch-h100.json, the
# same bytes in every configuration): the prefetching walk in programs of 32 groups (one warp: a walk runs to the
# longest list among its warp's groups, not its program's four warps') IQ3_XXS 8.11e8 -> 8.88e8, IQ3_S 1.47e9 ->
# 1.54e9; prefetching alone in programs of 128: 8.14e8 / 1.35e9.
PACKED = True  # grid lookups and candidate lists as packed words (iq3_tables.packed_points; the same values, fewer loads)
SUMS = True  # assign(sums=True) sums the terms a sub-block in the kernel (else torch sums the written terms)
CONSIDER = True  # consider() updates step 1's running best in the kernel (else torch, from assign's sums)
LISTS_FROM = 256  # grids of this many points or more walk candidate lists by default (both IQ3 grids)
PREFETCH = True  # list walks load the next candidate's word before scoring this one (packed words only)
_WARPS = 1
_INTERPRETED_BLOCK = 128  # groups a program off CUDA (Triton's interpreter: its time is per program)


def _block(device: torch.device) -> int:
    """Groups a program on ``device``: :data:`_BLOCK` on CUDA, :data:`_INTERPRETED_BLOCK` in Triton's interpreter.
    In the interpreter the results do not depend on the program size; compiled, the in-kernel sub-block sums may add
    in another order for another size (the H100 gave other IQ3_XXS bytes for 32 and 128), so a CUDA run's bytes hold
    for its size."""
    return _BLOCK if device.type == "cuda" else _INTERPRETED_BLOCK


@triton.jit
def _levels(t, m0, m1, m2, m3, m4, m5, m6):
    # torch.bucketize(t, mids) (right=False): how many midpoints lie strictly below t
    lev = (m0 < t).to(tl.int32) + (m1 < t).to(tl.int32) + (m2 < t).to(tl.int32) + (m3 < t).to(tl.int32)
    return lev + (m4 < t).to(tl.int32) + (m5 < t).to(tl.int32) + (m6 < t).to(tl.int32)


@triton.jit
def _on_grid(kmap_ptr, grid_ptr, g2_ptr, l0, l1, l2, l3, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, mask,
             FB: tl.constexpr, GSTEP: tl.constexpr):
    # the grid point the levels l0..l3 form (-1 off the grid) and its score with the first four features signed
    # by s0..s3 (+1 or -1); FB > 0: kmap_ptr is the packed map (one word: the point's coordinates and its index)
    u = l0 + 8 * l1 + 64 * l2 + 512 * l3
    if FB > 0:
        word = tl.load(kmap_ptr + u, mask=mask, other=-1)
        idx = word >> (4 * FB)
        word = tl.where(mask & (idx >= 0), word, 0)
        return idx, _word_score(word, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, FB, GSTEP)
    idx = tl.load(kmap_ptr + u, mask=mask, other=-1).to(tl.int32)
    return idx, _point_score(grid_ptr, g2_ptr, idx, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, mask & (idx >= 0))


@triton.jit
def _score(g0, g1, g2, g3, q0, q1, q2, q3, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7):
    # a point's score: coordinates g, their squares q, the first four features signed by s0..s3
    b = (s0 * f0 * g0 + s1 * f1 * g1) + (s2 * f2 * g2 + s3 * f3 * g3)
    c = (f4 * q0 + f5 * q1) + (f6 * q2 + f7 * q3)
    return b + c


@triton.jit
def _point_score(grid_ptr, g2_ptr, idx, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, ok):
    # grid point idx's score, the first four features signed by s0..s3; 0 where not ok
    gp = grid_ptr + idx * 4
    qp = g2_ptr + idx * 4
    return _score(tl.load(gp + 0, mask=ok, other=0.0), tl.load(gp + 1, mask=ok, other=0.0),
                  tl.load(gp + 2, mask=ok, other=0.0), tl.load(gp + 3, mask=ok, other=0.0),
                  tl.load(qp + 0, mask=ok, other=0.0), tl.load(qp + 1, mask=ok, other=0.0),
                  tl.load(qp + 2, mask=ok, other=0.0), tl.load(qp + 3, mask=ok, other=0.0),
                  s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7)


@triton.jit
def _coord(word, j: tl.constexpr, FB: tl.constexpr, GSTEP: tl.constexpr):
    # coordinate j of a packed point (:func:`packed_points`): field j times the grid's step (exact)
    return ((word >> (FB * j)) & ((1 << FB) - 1)).to(tl.float32) * GSTEP


@triton.jit
def _word_score(word, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, FB: tl.constexpr, GSTEP: tl.constexpr):
    # :func:`_point_score` of a packed point (word 0: every coordinate 0, the score of a masked load)
    g0 = _coord(word, 0, FB, GSTEP)
    g1 = _coord(word, 1, FB, GSTEP)
    g2 = _coord(word, 2, FB, GSTEP)
    g3 = _coord(word, 3, FB, GSTEP)
    return _score(g0, g1, g2, g3, g0 * g0, g1 * g1, g2 * g2, g3 * g3, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7)


@triton.jit
def _take(take, s, i, best, arg):
    return tl.where(take, s, best), tl.where(take, i, arg)


@triton.jit
def _walk(cand_ptr, cnt_ptr, grid_ptr, g2_ptr, l0, l1, l2, l3, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, need,
          best, arg, K: tl.constexpr, FB: tl.constexpr, GSTEP: tl.constexpr, PF: tl.constexpr):
    # an off-grid variant's best point: the exact candidates of its level pattern (the points no other point
    # dominates), ascending, strict '>' keeping the first maximum; lanes not in need keep (best, arg); FB > 0:
    # cand_ptr holds packed points (one 4-byte load a candidate), else indices (then 8 loads of grid and squares);
    # PF (packed only): candidate k + 1's word is loaded before candidate k is scored (its load in flight meanwhile)
    u = l0 + 8 * l1 + 64 * l2 + 512 * l3
    cnt = tl.load(cnt_ptr + u, mask=need, other=0)
    b = tl.full(best.shape, float("-inf"), tl.float32)
    j = tl.zeros(arg.shape, tl.int32)
    if PF and FB > 0:
        row = cand_ptr + u * K
        word = tl.load(row, mask=need & (cnt > 0), other=0)
        for k in range(tl.max(cnt, axis=0)):
            m = need & (k < cnt)
            nxt = tl.load(row + (k + 1), mask=need & (k + 1 < cnt), other=0)
            v = _word_score(word, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, FB, GSTEP)
            b, j = _take(m & (v > b), v, word >> (4 * FB), b, j)
            word = nxt
    else:
        for k in range(tl.max(cnt, axis=0)):
            m = need & (k < cnt)
            if FB > 0:
                word = tl.load(cand_ptr + u * K + k, mask=m, other=0)
                p = word >> (4 * FB)
                v = _word_score(word, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, FB, GSTEP)
            else:
                p = tl.load(cand_ptr + u * K + k, mask=m, other=0)
                v = _point_score(grid_ptr, g2_ptr, p, s0, s1, s2, s3, f0, f1, f2, f3, f4, f5, f6, f7, m)
            b, j = _take(m & (v > b), v, p, b, j)
    return tl.where(need, b, best), tl.where(need, j, arg)


@triton.jit
def _search(f0, f1, f2, f3, f4, f5, f6, f7, t0, t1, t2, t3, odd, k, rm, kmap_ptr, mids_ptr, grid_ptr, g2_ptr, cand_ptr,
            cnt_ptr, P: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, LISTS: tl.constexpr,
            FB: tl.constexpr, GSTEP: tl.constexpr, PF: tl.constexpr):
    # the best point (score, index) of each variant of the lanes' groups (features f, targets t): variant 0 the
    # group, V = 2: weight k flipped, V = 5: weight i flipped in variant 1 + i (on the odd lanes; others unused)
    i1 = tl.zeros((BLOCK,), tl.int32)
    i2 = i1
    i3 = i1
    i4 = i1
    s1 = tl.zeros((BLOCK,), tl.float32)
    s2 = s1
    s3 = s1
    s4 = s1
    m0 = tl.load(mids_ptr + 0)
    m1 = tl.load(mids_ptr + 1)
    m2 = tl.load(mids_ptr + 2)
    m3 = tl.load(mids_ptr + 3)
    m4 = tl.load(mids_ptr + 4)
    m5 = tl.load(mids_ptr + 5)
    m6 = tl.load(mids_ptr + 6)
    # levels of each target and of its negation (a flipped weight)
    a0 = _levels(t0, m0, m1, m2, m3, m4, m5, m6)
    a1 = _levels(t1, m0, m1, m2, m3, m4, m5, m6)
    a2 = _levels(t2, m0, m1, m2, m3, m4, m5, m6)
    a3 = _levels(t3, m0, m1, m2, m3, m4, m5, m6)
    one = tl.full((BLOCK,), 1.0, tl.float32)
    i0, s0 = _on_grid(kmap_ptr, grid_ptr, g2_ptr, a0, a1, a2, a3, one, one, one, one, f0, f1, f2, f3, f4, f5, f6, f7, rm, FB, GSTEP)
    off = (i0 < 0) & rm
    if V > 1:
        z0 = _levels(-t0, m0, m1, m2, m3, m4, m5, m6)
        z1 = _levels(-t1, m0, m1, m2, m3, m4, m5, m6)
        z2 = _levels(-t2, m0, m1, m2, m3, m4, m5, m6)
        z3 = _levels(-t3, m0, m1, m2, m3, m4, m5, m6)
    if V == 2:
        sg0 = tl.where(k == 0, -1.0, 1.0)
        sg1 = tl.where(k == 1, -1.0, 1.0)
        sg2 = tl.where(k == 2, -1.0, 1.0)
        sg3 = tl.where(k == 3, -1.0, 1.0)
        i1, s1 = _on_grid(kmap_ptr, grid_ptr, g2_ptr, tl.where(k == 0, z0, a0), tl.where(k == 1, z1, a1),
                          tl.where(k == 2, z2, a2), tl.where(k == 3, z3, a3), sg0, sg1, sg2, sg3,
                          f0, f1, f2, f3, f4, f5, f6, f7, odd, FB, GSTEP)
        off = off | (odd & (i1 < 0))
    if V == 5:
        neg = -one
        i1, s1 = _on_grid(kmap_ptr, grid_ptr, g2_ptr, z0, a1, a2, a3, neg, one, one, one,
                          f0, f1, f2, f3, f4, f5, f6, f7, odd, FB, GSTEP)
        i2, s2 = _on_grid(kmap_ptr, grid_ptr, g2_ptr, a0, z1, a2, a3, one, neg, one, one,
                          f0, f1, f2, f3, f4, f5, f6, f7, odd, FB, GSTEP)
        i3, s3 = _on_grid(kmap_ptr, grid_ptr, g2_ptr, a0, a1, z2, a3, one, one, neg, one,
                          f0, f1, f2, f3, f4, f5, f6, f7, odd, FB, GSTEP)
        i4, s4 = _on_grid(kmap_ptr, grid_ptr, g2_ptr, a0, a1, a2, z3, one, one, one, neg,
                          f0, f1, f2, f3, f4, f5, f6, f7, odd, FB, GSTEP)
        off = off | (odd & ((i1 < 0) | (i2 < 0) | (i3 < 0) | (i4 < 0)))
    if LISTS:  # each off-grid variant walks its pattern's exact candidate list
        i0 = i0.to(tl.int32)
        s0, i0 = _walk(cand_ptr, cnt_ptr, grid_ptr, g2_ptr, a0, a1, a2, a3, one, one, one, one, f0, f1, f2, f3, f4, f5,
                       f6, f7, rm & (i0 < 0), s0, i0, K, FB, GSTEP, PF)
        if V == 2:
            s1, i1 = _walk(cand_ptr, cnt_ptr, grid_ptr, g2_ptr, tl.where(k == 0, z0, a0), tl.where(k == 1, z1, a1),
                           tl.where(k == 2, z2, a2), tl.where(k == 3, z3, a3), sg0, sg1, sg2, sg3, f0, f1, f2, f3, f4,
                           f5, f6, f7, odd & (i1 < 0), s1, i1.to(tl.int32), K, FB, GSTEP, PF)
        if V == 5:
            s1, i1 = _walk(cand_ptr, cnt_ptr, grid_ptr, g2_ptr, z0, a1, a2, a3, neg, one, one, one, f0, f1, f2, f3, f4,
                           f5, f6, f7, odd & (i1 < 0), s1, i1.to(tl.int32), K, FB, GSTEP, PF)
            s2, i2 = _walk(cand_ptr, cnt_ptr, grid_ptr, g2_ptr, a0, z1, a2, a3, one, neg, one, one, f0, f1, f2, f3, f4,
                           f5, f6, f7, odd & (i2 < 0), s2, i2.to(tl.int32), K, FB, GSTEP, PF)
            s3, i3 = _walk(cand_ptr, cnt_ptr, grid_ptr, g2_ptr, a0, a1, z2, a3, one, one, neg, one, f0, f1, f2, f3, f4,
                           f5, f6, f7, odd & (i3 < 0), s3, i3.to(tl.int32), K, FB, GSTEP, PF)
            s4, i4 = _walk(cand_ptr, cnt_ptr, grid_ptr, g2_ptr, a0, a1, a2, z3, one, one, one, neg, f0, f1, f2, f3, f4,
                           f5, f6, f7, odd & (i4 < 0), s4, i4.to(tl.int32), K, FB, GSTEP, PF)
    elif tl.max(off.to(tl.int32), axis=0) > 0:
        # the whole grid, every variant from the same products; strict '>' keeps the first maximum
        b0 = tl.full((BLOCK,), float("-inf"), tl.float32)
        j0 = tl.zeros((BLOCK,), tl.int32)
        if V > 1:
            b1 = tl.full((BLOCK,), float("-inf"), tl.float32)
            j1 = tl.zeros((BLOCK,), tl.int32)
        if V == 5:
            b2 = tl.full((BLOCK,), float("-inf"), tl.float32)
            j2 = tl.zeros((BLOCK,), tl.int32)
            b3 = tl.full((BLOCK,), float("-inf"), tl.float32)
            j3 = tl.zeros((BLOCK,), tl.int32)
            b4 = tl.full((BLOCK,), float("-inf"), tl.float32)
            j4 = tl.zeros((BLOCK,), tl.int32)
        for p in range(P):
            p0 = f0 * tl.load(grid_ptr + p * 4 + 0)
            p1 = f1 * tl.load(grid_ptr + p * 4 + 1)
            p2 = f2 * tl.load(grid_ptr + p * 4 + 2)
            p3 = f3 * tl.load(grid_ptr + p * 4 + 3)
            c = (f4 * tl.load(g2_ptr + p * 4 + 0) + f5 * tl.load(g2_ptr + p * 4 + 1)) + (
                f6 * tl.load(g2_ptr + p * 4 + 2) + f7 * tl.load(g2_ptr + p * 4 + 3))
            s = ((p0 + p1) + (p2 + p3)) + c
            b0, j0 = _take(s > b0, s, p, b0, j0)
            if V == 2:
                pk = tl.where(k == 0, p0, tl.where(k == 1, p1, tl.where(k == 2, p2, p3)))
                v = s - 2.0 * pk
                b1, j1 = _take(v > b1, v, p, b1, j1)
            if V == 5:
                v = s - 2.0 * p0
                b1, j1 = _take(v > b1, v, p, b1, j1)
                v = s - 2.0 * p1
                b2, j2 = _take(v > b2, v, p, b2, j2)
                v = s - 2.0 * p2
                b3, j3 = _take(v > b3, v, p, b3, j3)
                v = s - 2.0 * p3
                b4, j4 = _take(v > b4, v, p, b4, j4)
        s0, i0 = _take(i0 < 0, b0, j0, s0, i0)
        if V > 1:
            s1, i1 = _take(i1 < 0, b1, j1, s1, i1)
        if V == 5:
            s2, i2 = _take(i2 < 0, b2, j2, s2, i2)
            s3, i3 = _take(i3 < 0, b3, j3, s3, i3)
            s4, i4 = _take(i4 < 0, b4, j4, s4, i4)
    return s0, i0.to(tl.int32), s1, i1.to(tl.int32), s2, i2.to(tl.int32), s3, i3.to(tl.int32), s4, i4.to(tl.int32)


@triton.jit
def nearest_variants_kernel(f_ptr, t_ptr, odd_ptr, at_ptr, kmap_ptr, mids_ptr, grid_ptr, g2_ptr, cand_ptr, cnt_ptr,
                            score_ptr, idx_ptr, n, P: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                            BLOCK: tl.constexpr, LISTS: tl.constexpr, FB: tl.constexpr, GSTEP: tl.constexpr,
                            PF: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = rows < n
    f0 = tl.load(f_ptr + rows * 8 + 0, mask=rm, other=0.0)
    f1 = tl.load(f_ptr + rows * 8 + 1, mask=rm, other=0.0)
    f2 = tl.load(f_ptr + rows * 8 + 2, mask=rm, other=0.0)
    f3 = tl.load(f_ptr + rows * 8 + 3, mask=rm, other=0.0)
    f4 = tl.load(f_ptr + rows * 8 + 4, mask=rm, other=0.0)
    f5 = tl.load(f_ptr + rows * 8 + 5, mask=rm, other=0.0)
    f6 = tl.load(f_ptr + rows * 8 + 6, mask=rm, other=0.0)
    f7 = tl.load(f_ptr + rows * 8 + 7, mask=rm, other=0.0)
    t0 = tl.load(t_ptr + rows * 4 + 0, mask=rm, other=0.0)
    t1 = tl.load(t_ptr + rows * 4 + 1, mask=rm, other=0.0)
    t2 = tl.load(t_ptr + rows * 4 + 2, mask=rm, other=0.0)
    t3 = tl.load(t_ptr + rows * 4 + 3, mask=rm, other=0.0)
    odd = rm
    k = tl.zeros((BLOCK,), tl.int32)
    if V > 1:
        odd = rm & (tl.load(odd_ptr + rows, mask=rm, other=0) != 0)
    if V == 2:
        k = tl.load(at_ptr + rows, mask=rm, other=0).to(tl.int32)
    s0, i0, s1, i1, s2, i2, s3, i3, s4, i4 = _search(f0, f1, f2, f3, f4, f5, f6, f7, t0, t1, t2, t3, odd, k, rm, kmap_ptr,
                                                     mids_ptr, grid_ptr, g2_ptr, cand_ptr, cnt_ptr, P, V, K, BLOCK,
                                                     LISTS, FB, GSTEP, PF)
    out = rows * V
    tl.store(score_ptr + out, s0, mask=rm)
    tl.store(idx_ptr + out, i0.to(tl.int64), mask=rm)
    if V > 1:
        ninf = tl.full((BLOCK,), float("-inf"), tl.float32)
        tl.store(score_ptr + out + 1, tl.where(odd, s1, ninf), mask=rm)
        tl.store(idx_ptr + out + 1, tl.where(odd, i1, 0).to(tl.int64), mask=rm)
    if V == 5:
        tl.store(score_ptr + out + 2, tl.where(odd, s2, ninf), mask=rm)
        tl.store(idx_ptr + out + 2, tl.where(odd, i2, 0).to(tl.int64), mask=rm)
        tl.store(score_ptr + out + 3, tl.where(odd, s3, ninf), mask=rm)
        tl.store(idx_ptr + out + 3, tl.where(odd, i3, 0).to(tl.int64), mask=rm)
        tl.store(score_ptr + out + 4, tl.where(odd, s4, ninf), mask=rm)
        tl.store(idx_ptr + out + 4, tl.where(odd, i4, 0).to(tl.int64), mask=rm)


@triton.jit
def _load4(ptr, base, rm):
    # 4 consecutive float32 values of each lane
    return (tl.load(ptr + base + 0, mask=rm, other=0.0), tl.load(ptr + base + 1, mask=rm, other=0.0),
            tl.load(ptr + base + 2, mask=rm, other=0.0), tl.load(ptr + base + 3, mask=rm, other=0.0))


@triton.jit
def _lane_weights(x_ptr, w_ptr, lane, rm):
    # a lane's 8-group: the offsets of its halves (b0, b1), their weights x, y, importances w, u and |x|, |y|
    b0 = lane * 8
    b1 = b0 + 4
    x0, x1, x2, x3 = _load4(x_ptr, b0, rm)
    w0, w1, w2, w3 = _load4(w_ptr, b0, rm)
    y0, y1, y2, y3 = _load4(x_ptr, b1, rm)
    u0, u1, u2, u3 = _load4(w_ptr, b1, rm)
    return (b0, b1, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, tl.abs(x0), tl.abs(x1),
            tl.abs(x2), tl.abs(x3), tl.abs(y0), tl.abs(y1), tl.abs(y2), tl.abs(y3))


@triton.jit
def _inv_scale(a):
    # _iq3_search.inv_scale: 1 / a (IEEE, div_rn, as torch's) where a > 0, else 0
    return tl.where(a > 0, tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), tl.where(a > 0, a, 1.0)), 0.0)


@triton.jit
def _features(x0, x1, x2, x3, w0, w1, w2, w3, a, ia):
    # one half (4 weights) of the lanes' 8-groups: |x| and the features f = [2 w |x|, -a w], t = |x| / a
    na = -a
    v0 = tl.abs(x0)
    v1 = tl.abs(x1)
    v2 = tl.abs(x2)
    v3 = tl.abs(x3)
    return (v0, v1, v2, v3, 2.0 * w0 * v0, 2.0 * w1 * v1, 2.0 * w2 * v2, 2.0 * w3 * v3, na * w0, na * w1, na * w2, na * w3,
            v0 * ia, v1 * ia, v2 * ia, v3 * ia)


@triton.jit
def _argmin4(e0, e1, e2, e3):
    # torch's argmin over 4 values: the first minimum
    k = tl.zeros(e0.shape, tl.int32)
    b = e0
    k = tl.where(e1 < b, 1, k)
    b = tl.minimum(b, e1)
    k = tl.where(e2 < b, 2, k)
    b = tl.minimum(b, e2)
    k = tl.where(e3 < b, 3, k)
    return k


@triton.jit
def _best_flip(s1, i1, s2, i2, s3, i3, s4, i4, V: tl.constexpr):
    # the best flip variant of a half (score, grid index, variant 1..4): torch's max over the variants, the first
    # maximum
    if V == 5:
        b, i, v = s1, i1, tl.full(s1.shape, 1, tl.int32)
        t = s2 > b
        b, i, v = tl.where(t, s2, b), tl.where(t, i2, i), tl.where(t, 2, v)
        t = s3 > b
        b, i, v = tl.where(t, s3, b), tl.where(t, i3, i), tl.where(t, 3, v)
        t = s4 > b
        b, i, v = tl.where(t, s4, b), tl.where(t, i4, i), tl.where(t, 4, v)
    else:
        b, i, v = s1, i1, tl.full(s1.shape, 1, tl.int32)
    return b, i, v


@triton.jit
def _emit(p_ptr, q_ptr, flip_ptr, base, rm, g, x, w, v, fl, j: tl.constexpr, a, OUT: tl.constexpr, IDX: tl.constexpr,
          SUMS: tl.constexpr):
    # weight j of a half: its grid value g and the terms the encoder sums (torch's operations, in its order), stored
    # per weight unless SUMS (then only returned: the kernel sums them per sub-block)
    if OUT == 0:  # least squares: w v g and w g g, v = |x| negated where flipped
        vv = tl.where(fl, -v, v)
        pt = w * vv * g
        qt = w * g * g
    else:  # the exact error w (x - y)**2, y = (a g) * sign
        y = (a * g) * tl.where((x < 0) ^ fl, -1.0, 1.0)
        r = x - y
        pt = w * r * r
        qt = pt
    if SUMS == 0:
        tl.store(p_ptr + base + j, pt, mask=rm)
        if OUT == 0:
            tl.store(q_ptr + base + j, qt, mask=rm)
    if IDX:
        tl.store(flip_ptr + base + j, fl.to(tl.int8), mask=rm)
    return pt, qt


@triton.jit
def _sub_sums(t0, t1, t2, t3, u0, u1, u2, u3, rm, BLOCK: tl.constexpr):
    # per sub-block (4 consecutive lanes) sums of the lanes' 8 terms: pairwise within a lane, then over the 4 lanes
    s = ((t0 + t1) + (t2 + t3)) + ((u0 + u1) + (u2 + u3))
    return tl.sum(tl.reshape(tl.where(rm, s, 0.0), (BLOCK // 4, 4)), axis=1)


@triton.jit
def _term_sums(rm, ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2,
               u3, v0, v1, v2, v3, q0, q1, q2, q3, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3, a, OUT: tl.constexpr,
               BLOCK: tl.constexpr):
    # the sub-block sums of _emit's OUT terms of the lanes' assignment, summed by _sub_sums (bit for bit what an
    # OUT launch of the same assignment stores): OUT 0 (sum w v g, sum w g g), OUT 1 the exact error sum w (x - y)**2
    # under scales a (twice)
    pa0, qa0 = _emit(a, a, a, 0, rm, ga0, x0, w0, v0, fa0, 0, a, OUT, False, True)
    pa1, qa1 = _emit(a, a, a, 0, rm, ga1, x1, w1, v1, fa1, 1, a, OUT, False, True)
    pa2, qa2 = _emit(a, a, a, 0, rm, ga2, x2, w2, v2, fa2, 2, a, OUT, False, True)
    pa3, qa3 = _emit(a, a, a, 0, rm, ga3, x3, w3, v3, fa3, 3, a, OUT, False, True)
    pb0, qb0 = _emit(a, a, a, 0, rm, gb0, y0, u0, q0, fb0, 0, a, OUT, False, True)
    pb1, qb1 = _emit(a, a, a, 0, rm, gb1, y1, u1, q1, fb1, 1, a, OUT, False, True)
    pb2, qb2 = _emit(a, a, a, 0, rm, gb2, y2, u2, q2, fb2, 2, a, OUT, False, True)
    pb3, qb3 = _emit(a, a, a, 0, rm, gb3, y3, u3, q3, fb3, 3, a, OUT, False, True)
    return (_sub_sums(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, rm, BLOCK),
            _sub_sums(qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, rm, BLOCK))


@triton.jit
def _assign_lanes(x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, a, ia, rm, kmap_ptr, mids_ptr,
                  grid_ptr, g2_ptr, cand_ptr, cnt_ptr, P: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                  BLOCK: tl.constexpr, LISTS: tl.constexpr, FB: tl.constexpr, GSTEP: tl.constexpr, PF: tl.constexpr):
    # the lanes' 8-groups (halves x, w and y, u) under sub-block scales a (ia = 1 / a, 0 where a is 0): each half's
    # grid index (h0, h1) and the flips (fa*, fb*: weight decoded with the sign opposite to x's)
    (v0, v1, v2, v3, f0, f1, f2, f3, f4, f5, f6, f7, t0, t1, t2, t3) = _features(x0, x1, x2, x3, w0, w1, w2, w3, a, ia)
    (q0, q1, q2, q3, e0, e1, e2, e3, e4, e5, e6, e7, r0, r1, r2, r3) = _features(y0, y1, y2, y3, u0, u1, u2, u3, a, ia)
    odd = rm
    k0 = tl.zeros((BLOCK,), tl.int32)
    k1 = k0
    if V > 1:  # an odd number of negative weights in the 8-group
        nn = ((x0 < 0).to(tl.int32) + (x1 < 0).to(tl.int32)) + ((x2 < 0).to(tl.int32) + (x3 < 0).to(tl.int32))
        nn += ((y0 < 0).to(tl.int32) + (y1 < 0).to(tl.int32)) + ((y2 < 0).to(tl.int32) + (y3 < 0).to(tl.int32))
        odd = rm & ((nn % 2) == 1)
    if V == 2:  # the flipped weight: least w |x|**2 of its half
        k0 = _argmin4(w0 * v0 * v0, w1 * v1 * v1, w2 * v2 * v2, w3 * v3 * v3)
        k1 = _argmin4(u0 * q0 * q0, u1 * q1 * q1, u2 * q2 * q2, u3 * q3 * q3)
    s0, i0, s1, i1, s2, i2, s3, i3, s4, i4 = _search(f0, f1, f2, f3, f4, f5, f6, f7, t0, t1, t2, t3, odd, k0, rm, kmap_ptr,
                                                     mids_ptr, grid_ptr, g2_ptr, cand_ptr, cnt_ptr, P, V, K, BLOCK,
                                                     LISTS, FB, GSTEP, PF)
    h0 = i0
    h1 = i0
    fa0 = rm & ~rm  # no flips (all False)
    fa1 = fa0
    fa2 = fa0
    fa3 = fa0
    fb0 = fa0
    fb1 = fa0
    fb2 = fa0
    fb3 = fa0
    if V == 1:
        h1 = _search(e0, e1, e2, e3, e4, e5, e6, e7, r0, r1, r2, r3, odd, k1, rm, kmap_ptr, mids_ptr, grid_ptr, g2_ptr,
                     cand_ptr, cnt_ptr, P, V, K, BLOCK, LISTS, FB, GSTEP, PF)[1]
    else:
        z0, j0, z1, j1, z2, j2, z3, j3, z4, j4 = _search(e0, e1, e2, e3, e4, e5, e6, e7, r0, r1, r2, r3, odd, k1, rm,
                                                         kmap_ptr, mids_ptr, grid_ptr, g2_ptr, cand_ptr, cnt_ptr, P, V,
                                                         K, BLOCK, LISTS, FB, GSTEP, PF)
        # per 8-group: an odd one flips one weight, in the half where the pair scores best (ties: half 0)
        sa, ja, va = _best_flip(s1, i1, s2, i2, s3, i3, s4, i4, V)
        sb, jb, vb = _best_flip(z1, j1, z2, j2, z3, j3, z4, j4, V)
        in_a = sa + z0 >= s0 + sb
        ta = odd & in_a
        tb = odd & ~in_a
        h0 = tl.where(ta, ja, i0)
        h1 = tl.where(tb, jb, j0)
        if V == 2:
            wa = k0
            wb = k1
        else:
            wa = va - 1
            wb = vb - 1
        fa0, fa1, fa2, fa3 = ta & (wa == 0), ta & (wa == 1), ta & (wa == 2), ta & (wa == 3)
        fb0, fb1, fb2, fb3 = tb & (wb == 0), tb & (wb == 1), tb & (wb == 2), tb & (wb == 3)
    return h0, h1, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3


@triton.jit
def _points(pts_ptr, grid_ptr, h0, h1, rm, FB: tl.constexpr, GSTEP: tl.constexpr):
    # the coordinates of each half's grid point (h0, h1): packed words (FB > 0) or the float grid
    h0 = tl.where(rm, h0, 0)
    h1 = tl.where(rm, h1, 0)
    if FB > 0:  # each half's point: one packed word
        pa = tl.load(pts_ptr + h0, mask=rm, other=0)
        pb = tl.load(pts_ptr + h1, mask=rm, other=0)
        ga0, ga1, ga2, ga3 = _coord(pa, 0, FB, GSTEP), _coord(pa, 1, FB, GSTEP), _coord(pa, 2, FB, GSTEP), _coord(pa, 3, FB, GSTEP)
        gb0, gb1, gb2, gb3 = _coord(pb, 0, FB, GSTEP), _coord(pb, 1, FB, GSTEP), _coord(pb, 2, FB, GSTEP), _coord(pb, 3, FB, GSTEP)
    else:
        ga0 = tl.load(grid_ptr + h0 * 4 + 0, mask=rm, other=0.0)
        ga1 = tl.load(grid_ptr + h0 * 4 + 1, mask=rm, other=0.0)
        ga2 = tl.load(grid_ptr + h0 * 4 + 2, mask=rm, other=0.0)
        ga3 = tl.load(grid_ptr + h0 * 4 + 3, mask=rm, other=0.0)
        gb0 = tl.load(grid_ptr + h1 * 4 + 0, mask=rm, other=0.0)
        gb1 = tl.load(grid_ptr + h1 * 4 + 1, mask=rm, other=0.0)
        gb2 = tl.load(grid_ptr + h1 * 4 + 2, mask=rm, other=0.0)
        gb3 = tl.load(grid_ptr + h1 * 4 + 3, mask=rm, other=0.0)
    return ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3


@triton.jit
def assign_kernel(x_ptr, w_ptr, a_ptr, ia_ptr, kmap_ptr, mids_ptr, grid_ptr, g2_ptr, pts_ptr, cand_ptr, cnt_ptr,
                  idx_ptr, flip_ptr, p_ptr, q_ptr, bg_ptr, ba_ptr, sx_ptr, sg_ptr, n, P: tl.constexpr, V: tl.constexpr,
                  K: tl.constexpr, BLOCK: tl.constexpr, LISTS: tl.constexpr, OUT: tl.constexpr, IDX: tl.constexpr,
                  FB: tl.constexpr, GSTEP: tl.constexpr, SUMS: tl.constexpr, BEST: tl.constexpr, PF: tl.constexpr,
                  STATS: tl.constexpr):
    # one lane an 8-group (two halves of 4 weights, groups 2 l and 2 l + 1 of the (n * 64) groups)
    pid = tl.program_id(0)
    lane = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = lane < n
    a = tl.load(a_ptr + lane // 4, mask=rm, other=0.0)
    ia = tl.load(ia_ptr + lane // 4, mask=rm, other=0.0)
    (b0, b1, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, q0, q1, q2,
     q3) = _lane_weights(x_ptr, w_ptr, lane, rm)
    h0, h1, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3 = _assign_lanes(
        x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, a, ia, rm, kmap_ptr, mids_ptr, grid_ptr,
        g2_ptr, cand_ptr, cnt_ptr, P, V, K, BLOCK, LISTS, FB, GSTEP, PF)
    if IDX:  # in idx_ptr's integer type (int64, or narrower where the grid's indices fit)
        tl.store(idx_ptr + lane * 2, h0.to(idx_ptr.dtype.element_ty), mask=rm)
        tl.store(idx_ptr + lane * 2 + 1, h1.to(idx_ptr.dtype.element_ty), mask=rm)
    ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3 = _points(pts_ptr, grid_ptr, h0, h1, rm, FB, GSTEP)
    pa0, qa0 = _emit(p_ptr, q_ptr, flip_ptr, b0, rm, ga0, x0, w0, v0, fa0, 0, a, OUT, IDX, SUMS)
    pa1, qa1 = _emit(p_ptr, q_ptr, flip_ptr, b0, rm, ga1, x1, w1, v1, fa1, 1, a, OUT, IDX, SUMS)
    pa2, qa2 = _emit(p_ptr, q_ptr, flip_ptr, b0, rm, ga2, x2, w2, v2, fa2, 2, a, OUT, IDX, SUMS)
    pa3, qa3 = _emit(p_ptr, q_ptr, flip_ptr, b0, rm, ga3, x3, w3, v3, fa3, 3, a, OUT, IDX, SUMS)
    pb0, qb0 = _emit(p_ptr, q_ptr, flip_ptr, b1, rm, gb0, y0, u0, q0, fb0, 0, a, OUT, IDX, SUMS)
    pb1, qb1 = _emit(p_ptr, q_ptr, flip_ptr, b1, rm, gb1, y1, u1, q1, fb1, 1, a, OUT, IDX, SUMS)
    pb2, qb2 = _emit(p_ptr, q_ptr, flip_ptr, b1, rm, gb2, y2, u2, q2, fb2, 2, a, OUT, IDX, SUMS)
    pb3, qb3 = _emit(p_ptr, q_ptr, flip_ptr, b1, rm, gb3, y3, u3, q3, fb3, 3, a, OUT, IDX, SUMS)
    if SUMS:  # (n, 8) sums a sub-block instead of (n, 8, 32) terms
        sb = pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4).to(tl.int64)
        sm = sb < n // 4
        ps = _sub_sums(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, rm, BLOCK)
        if BEST:  # step 1's running best (steps.best_scale_update's float64 operations): p, q the updated (gain, A)
            qs = _sub_sums(qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, rm, BLOCK)
            bg, ba = _gain_update(ps, qs, tl.load(bg_ptr + sb, mask=sm, other=0.0),
                                  tl.load(ba_ptr + sb, mask=sm, other=0.0))
            tl.store(p_ptr + sb, bg, mask=sm)
            tl.store(q_ptr + sb, ba, mask=sm)
        else:
            tl.store(p_ptr + sb, ps, mask=sm)
            if OUT == 0:
                tl.store(q_ptr + sb, _sub_sums(qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, rm, BLOCK), mask=sm)
        if STATS:  # with the exact error (OUT 1): the same assignment's least-squares sums, as OUT 0 forms them
            sx, sg = _term_sums(rm, ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1,
                                w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, q0, q1, q2, q3, fa0, fa1, fa2, fa3, fb0, fb1,
                                fb2, fb3, a, 0, BLOCK)
            tl.store(sx_ptr + sb, sx, mask=sm)
            tl.store(sg_ptr + sb, sg, mask=sm)


@triton.jit
def _by_sub_block(t, BLOCK: tl.constexpr):
    # a (BLOCK // 4,) value a sub-block to its 4 lanes (BLOCK,)
    return tl.reshape(tl.broadcast_to(t[:, None], (BLOCK // 4, 4)), (BLOCK,))


@triton.jit
def _level_scale(d, lt, HALF: tl.constexpr):
    # _iq3_search.sub_scale's float32 operations: IQ3_XXS (HALF) (d (0.5 + l)) 0.5, IQ3_S d (1 + 2 l)
    if HALF:
        return (d * (0.5 + lt.to(tl.float32))) * 0.5
    return d * (1 + 2 * lt).to(tl.float32)


@triton.jit
def exact_levels_kernel(x_ptr, w_ptr, d_ptr, l_ptr, kmap_ptr, mids_ptr, grid_ptr, g2_ptr, pts_ptr, cand_ptr, cnt_ptr,
                        idx_ptr, flip_ptr, e_ptr, sx_ptr, sg_ptr, lo_ptr, n, P: tl.constexpr, V: tl.constexpr,
                        K: tl.constexpr, BLOCK: tl.constexpr, LISTS: tl.constexpr, FB: tl.constexpr,
                        GSTEP: tl.constexpr, PF: tl.constexpr, HALF: tl.constexpr, ND: tl.constexpr, D1: tl.constexpr,
                        D2: tl.constexpr):
    # one lane an 8-group, as assign_kernel; its sub-block's level l, then l + D1, l + D2 (the first ND; clamped to
    # 0..15), each assigned under the scale the level decodes to, the exact error and least-squares sums a sub-block
    # formed as assign_kernel's OUT 1 / STATS launch forms them; a later level kept only where its error is strictly
    # less (_iq3_search.best_levels); the kept level's points, flips, sums and level stored
    pid = tl.program_id(0)
    lane = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = lane < n
    sb = pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4).to(tl.int64)
    sm = sb < n // 4
    d = tl.load(d_ptr + lane // 32, mask=rm, other=0.0)
    l0 = tl.load(l_ptr + lane // 4, mask=rm, other=0).to(tl.int32)
    (b0, b1, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, q0, q1, q2,
     q3) = _lane_weights(x_ptr, w_ptr, lane, rm)
    for c in tl.static_range(1 + ND):
        if c == 0:
            lt = l0
        elif c == 1:
            lt = tl.minimum(tl.maximum(l0 + D1, 0), 15)
        else:
            lt = tl.minimum(tl.maximum(l0 + D2, 0), 15)
        a = _level_scale(d, lt, HALF)
        ia = _inv_scale(a)
        h0, h1, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3 = _assign_lanes(
            x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, a, ia, rm, kmap_ptr, mids_ptr, grid_ptr,
            g2_ptr, cand_ptr, cnt_ptr, P, V, K, BLOCK, LISTS, FB, GSTEP, PF)
        ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3 = _points(pts_ptr, grid_ptr, h0, h1, rm, FB, GSTEP)
        es = _term_sums(rm, ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3,
                        u0, u1, u2, u3, v0, v1, v2, v3, q0, q1, q2, q3, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3, a, 1,
                        BLOCK)[0]
        sx, sg = _term_sums(rm, ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2,
                            w3, u0, u1, u2, u3, v0, v1, v2, v3, q0, q1, q2, q3, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3,
                            a, 0, BLOCK)
        if c == 0:
            be, bsx, bsg, bl, bh0, bh1 = es, sx, sg, lt, h0, h1
            ba0, ba1, ba2, ba3, bb0, bb1, bb2, bb3 = fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3
        else:
            take = es < be  # (BLOCK // 4,)
            tk = _by_sub_block(take, BLOCK)  # its lanes
            be, bsx, bsg = tl.where(take, es, be), tl.where(take, sx, bsx), tl.where(take, sg, bsg)
            bl, bh0, bh1 = tl.where(tk, lt, bl), tl.where(tk, h0, bh0), tl.where(tk, h1, bh1)
            ba0, ba1, ba2, ba3 = tl.where(tk, fa0, ba0), tl.where(tk, fa1, ba1), tl.where(tk, fa2, ba2), tl.where(tk, fa3, ba3)
            bb0, bb1, bb2, bb3 = tl.where(tk, fb0, bb0), tl.where(tk, fb1, bb1), tl.where(tk, fb2, bb2), tl.where(tk, fb3, bb3)
    tl.store(e_ptr + sb, be, mask=sm)
    tl.store(sx_ptr + sb, bsx, mask=sm)
    tl.store(sg_ptr + sb, bsg, mask=sm)
    tl.store(lo_ptr + lane // 4, bl.to(tl.int64), mask=rm & (lane % 4 == 0))
    tl.store(idx_ptr + lane * 2, bh0.to(idx_ptr.dtype.element_ty), mask=rm)
    tl.store(idx_ptr + lane * 2 + 1, bh1.to(idx_ptr.dtype.element_ty), mask=rm)
    tl.store(flip_ptr + b0 + 0, ba0.to(tl.int8), mask=rm)
    tl.store(flip_ptr + b0 + 1, ba1.to(tl.int8), mask=rm)
    tl.store(flip_ptr + b0 + 2, ba2.to(tl.int8), mask=rm)
    tl.store(flip_ptr + b0 + 3, ba3.to(tl.int8), mask=rm)
    tl.store(flip_ptr + b1 + 0, bb0.to(tl.int8), mask=rm)
    tl.store(flip_ptr + b1 + 1, bb1.to(tl.int8), mask=rm)
    tl.store(flip_ptr + b1 + 2, bb2.to(tl.int8), mask=rm)
    tl.store(flip_ptr + b1 + 3, bb3.to(tl.int8), mask=rm)


@triton.jit
def _gain_update(sx, sg, bg, ba):
    # step 1's running best (_iq3_search.best_scale_update's float64 operations) from float32 sums sx, sg
    sxg = sx.to(tl.float64)
    sgg = sg.to(tl.float64)
    nz = sgg != 0
    den = tl.where(nz, sgg, 1.0)
    gain = tl.where(nz, (sxg * sxg) / den, 0.0)
    take = (gain > bg) & (sxg > 0)
    return tl.where(take, gain, bg), tl.where(take, tl.where(nz, sxg / den, 0.0).to(tl.float32), ba)


@triton.jit
def step1_kernel(x_ptr, w_ptr, c_ptr, ba_ptr, kmap_ptr, mids_ptr, grid_ptr, g2_ptr, pts_ptr, cand_ptr, cnt_ptr, n,
                 P: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, LISTS: tl.constexpr,
                 FB: tl.constexpr, GSTEP: tl.constexpr, PF: tl.constexpr, T: tl.constexpr, LLOYD: tl.constexpr):
    # one lane an 8-group, as assign_kernel; the sub-blocks' T candidate scales (c_ptr: (n, 8, T)) then LLOYD times
    # the best so far, each assigned (V variants), its least-squares sums formed as assign_kernel's BEST launch forms
    # them and the running best updated in registers; the best scale stored
    pid = tl.program_id(0)
    lane = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = lane < n
    sb = pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4).to(tl.int64)
    sm = sb < n // 4
    (b0, b1, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, q0, q1, q2,
     q3) = _lane_weights(x_ptr, w_ptr, lane, rm)
    bg = tl.full((BLOCK // 4,), -1.0, tl.float64)
    ba = tl.zeros((BLOCK // 4,), tl.float32)
    for k in range(T + LLOYD):
        a_sb = tl.load(c_ptr + sb * T + k, mask=sm & (k < T), other=0.0)
        a = _by_sub_block(tl.where(k < T, a_sb, ba), BLOCK)
        ia = _inv_scale(a)
        h0, h1, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3 = _assign_lanes(
            x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2, w3, u0, u1, u2, u3, a, ia, rm, kmap_ptr, mids_ptr, grid_ptr,
            g2_ptr, cand_ptr, cnt_ptr, P, V, K, BLOCK, LISTS, FB, GSTEP, PF)
        ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3 = _points(pts_ptr, grid_ptr, h0, h1, rm, FB, GSTEP)
        sx, sg = _term_sums(rm, ga0, ga1, ga2, ga3, gb0, gb1, gb2, gb3, x0, x1, x2, x3, y0, y1, y2, y3, w0, w1, w2,
                            w3, u0, u1, u2, u3, v0, v1, v2, v3, q0, q1, q2, q3, fa0, fa1, fa2, fa3, fb0, fb1, fb2, fb3,
                            a, 0, BLOCK)
        bg, ba = _gain_update(sx, sg, bg, ba)
    tl.store(ba_ptr + sb, ba, mask=sm)


def _launch(grid: torch.Tensor, kmap: torch.Tensor, mids: torch.Tensor, dev: torch.device, items: int,
            lists: bool | None, packed: bool | None, prefetch: bool | None):
    """What every search launch shares: (program grid over ``items`` lanes or rows, the tables (kmap, mids, grid,
    g2, pts, cand, cnt) as :func:`.iq3_tables.launch_tables` places them on ``dev``, the shared constexprs and
    ``num_warps``), with ``lists`` / ``packed`` / ``prefetch`` None taking the module defaults."""
    gc, g2, mc, kc, pts, cand, cnt, fb, gstep = tables.launch_tables(grid, kmap, mids, dev,
                                                                     PACKED if packed is None else packed)
    blk = _block(dev)
    meta = dict(P=gc.shape[0], K=cand.shape[1], BLOCK=blk, LISTS=grid.shape[0] >= LISTS_FROM if lists is None else lists,
                FB=fb, GSTEP=gstep, PF=PREFETCH if prefetch is None else prefetch, num_warps=_WARPS)
    return (triton.cdiv(items, blk),), (kc, mc, gc, g2, pts, cand, cnt), meta


def nearest_variants(f: torch.Tensor, t: torch.Tensor, odd: torch.Tensor | None, flip_at: torch.Tensor | None,
                     kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor,
                     g8: torch.Tensor, lists: bool | None = None,
                     packed: bool | None = None, prefetch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`dynaquant.quant.codecs.iq3.nearest_variants_torch`: same arguments, same result (module
    docstring for the rounding); ``lists``: off-grid variants walk their exact candidate lists (else the whole
    grid); None: lists on grids of at least :data:`LISTS_FROM` points (both: with the packed words and in-kernel
    sums IQ3_XXS's 256-point grid gained 1.46x from its lists on an H100, IQ3_S's 512 1.6x on an H200); ``packed``:
    grid lookups and candidates read as packed words (:func:`.iq3_tables.packed_points`; None: :data:`PACKED`), the
    same values and results.
    Raises ValueError when the shapes disagree."""
    r = f.shape[0]
    nv = iq3.variant_count(f, t, odd, flip_at, kmap, mids, grid, g8)
    score = torch.empty(r, nv, dtype=torch.float32, device=f.device)
    idx = torch.empty(r, nv, dtype=torch.int64, device=f.device)
    if r == 0:
        return score, idx
    dev = f.device
    fc = f.to(torch.float32).contiguous()
    tc = t.to(device=dev, dtype=torch.float32).contiguous()
    oc = odd.to(device=dev, dtype=torch.int8).contiguous() if odd is not None else fc
    ac = flip_at.to(device=dev, dtype=torch.int32).contiguous() if flip_at is not None else fc
    pgrid, (kc, mc, gc, g2, _, cand, cnt), meta = _launch(grid, kmap, mids, dev, r, lists, packed, prefetch)
    nearest_variants_kernel[pgrid](fc, tc, oc, ac, kc, mc, gc, g2, cand, cnt, score, idx, r, V=nv, **meta)
    return score, idx


def assign(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, parity: bool, full: bool, out: str, want_idx: bool,
           kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor, lists: bool | None = None,
           packed: bool | None = None, sums: bool = False, fused_sums: bool | None = None, prefetch: bool | None = None):
    """Fused :func:`dynaquant.quant.codecs._iq3_search.assign_torch` (the fast path ``iq3.assign``): same arguments
    (``nearest`` is this module's search, ``lists`` and ``packed`` as :func:`nearest_variants`), one launch. With
    ``sums`` False its result equals the composition of :func:`nearest_variants` and the torch steps bit for bit (the
    same operations in the same order; the interpreter tests check it). With ``sums`` the (n, 8) sums a sub-block
    are formed in the kernel (``fused_sums``, default :data:`SUMS`: no (n, 8, 32) terms written and read back; each
    lane's 8 terms pairwise, then the 4 lanes: float32 rounding differs from torch's ``sum(-1)``) or by torch from the
    terms (bit for bit the reference's). Raises ValueError on an unknown ``out`` or shapes that disagree."""
    if out not in steps.OUTS:
        raise ValueError(f"out must be one of {steps.OUTS}, got {out!r}")
    n = x.shape[0]
    if x.shape != (n, 8, 32) or w.shape != x.shape or a.shape != (n, 8):
        raise ValueError(f"expected x, w (n, 8, 32) and a (n, 8), got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(a.shape)}")
    dev = x.device
    in_kernel = sums and (SUMS if fused_sums is None else fused_sums)
    xc, wc = x.to(torch.float32).contiguous(), w.to(torch.float32).contiguous()
    ac = a.to(torch.float32).contiguous()
    ia = steps.inv_scale(ac)
    p = torch.empty(n, 8, dtype=torch.float32, device=dev) if in_kernel else torch.empty_like(xc)
    q = torch.empty_like(p) if out == "stats" else p
    idx = torch.empty(n, 8, 8, dtype=torch.int64, device=dev) if want_idx else p
    flip = torch.zeros(n, 8, 32, dtype=torch.uint8, device=dev) if want_idx else p
    if n:
        pgrid, tabs, meta = _launch(grid, kmap, mids, dev, n * 32, lists, packed, prefetch)
        assign_kernel[pgrid](
            xc, wc, ac, ia, *tabs, idx, flip, p, q, p, p, p, p, n * 32, V=(5 if full else 2) if parity else 1,
            OUT=steps.OUTS.index(out), IDX=want_idx, SUMS=in_kernel, BEST=False, STATS=False, **meta)
    if sums and not in_kernel:
        p, q = p.sum(-1), (q.sum(-1) if out == "stats" else p)
    if not want_idx:
        return None, None, p, (q if out == "stats" else None)
    return idx, flip.view(torch.bool), p, (q if out == "stats" else None)


def _check_idx_dtype(idx_dtype: torch.dtype, grid: torch.Tensor) -> None:
    """Raise ValueError unless ``idx_dtype`` is an integer type that holds every index of ``grid`` (P, 4)."""
    if idx_dtype.is_floating_point or idx_dtype == torch.bool or grid.shape[0] - 1 > torch.iinfo(idx_dtype).max:
        raise ValueError(f"idx_dtype {idx_dtype} cannot hold the indices of a {grid.shape[0]}-point grid")


def exact(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, parity: bool, full: bool, kmap: torch.Tensor,
          mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor, idx_dtype: torch.dtype = torch.int64,
          lists: bool | None = None, packed: bool | None = None, prefetch: bool | None = None):
    """Fused :func:`dynaquant.quant.codecs._iq3_search.exact_torch` (the fast path ``iq3.exact``: the encoder's exact
    error of an assignment under its stored scales, with that assignment's least-squares sums): one launch of
    :func:`assign`'s kernel that forms, from the same assignment, the sub-block sums of the exact error (what
    :func:`assign` with ``out="error"`` and ``sums`` stores) and of the least-squares terms (what ``out="stats"``
    stores), bit for bit both, so the encoder's next round needs no torch pass over the weights for the latter.

    Args:
        x, w: (n, 8, 32) float32 weights and importance; a: (n, 8) float32 sub-block scales (>= 0); parity, full: as
            :func:`assign`; kmap, mids, grid, g8: the tables of :func:`assign`.
        idx_dtype: the indices' integer type (torch.uint8 holds a 256-point grid's, torch.int16 a 512-point one's:
            an eighth or a quarter of int64's bytes for the encoder's selections).
    Returns:
        (idx (n, 8, 8) ``idx_dtype``, flip (n, 8, 32) bool, err, sxg, sgg (n, 8) float32: the sub-block sums of
        ``w (x - y)**2``, ``w v g`` and ``w g g``).
    Raises:
        ValueError: shapes that disagree, or an ``idx_dtype`` that cannot hold the grid's indices.
    """
    n = x.shape[0]
    if x.shape != (n, 8, 32) or w.shape != x.shape or a.shape != (n, 8):
        raise ValueError(f"expected x, w (n, 8, 32) and a (n, 8), got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(a.shape)}")
    _check_idx_dtype(idx_dtype, grid)
    dev = x.device
    xc, wc = x.to(torch.float32).contiguous(), w.to(torch.float32).contiguous()
    ac = a.to(torch.float32).contiguous()
    ia = steps.inv_scale(ac)
    err, sxg, sgg = (torch.empty(n, 8, dtype=torch.float32, device=dev) for _ in range(3))
    idx = torch.empty(n, 8, 8, dtype=idx_dtype, device=dev)
    flip = torch.zeros(n, 8, 32, dtype=torch.uint8, device=dev)
    if n:
        pgrid, tabs, meta = _launch(grid, kmap, mids, dev, n * 32, lists, packed, prefetch)
        assign_kernel[pgrid](
            xc, wc, ac, ia, *tabs, idx, flip, err, err, err, err, sxg, sgg, n * 32, V=(5 if full else 2) if parity else 1,
            OUT=1, IDX=True, SUMS=True, BEST=False, STATS=True, **meta)
    return idx, flip.view(torch.bool), err, sxg, sgg


def step1(x: torch.Tensor, w: torch.Tensor, cand: torch.Tensor, lloyd: int, parity: bool, kmap: torch.Tensor,
          mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor, lists: bool | None = None,
          packed: bool | None = None, prefetch: bool | None = None) -> torch.Tensor:
    """Fused :func:`dynaquant.quant.codecs._iq3_search.step1_torch` (the fast path ``iq3.step1``): step 1 in one
    launch: x and w read once, each candidate scale and then each Lloyd step assigned in turn, the running best
    (float64 gain, float32 scale) kept a sub-block in registers; bit for bit :func:`step1_torch` with :func:`consider`
    a candidate (the inverse scales as torch's: ``div_rn``).

    Args:
        x, w: (n, 8, 32) float32; cand: (n, 8, T) float32 candidate scales (>= 0); lloyd: refits after them; parity:
            IQ3_XXS's even sign parity (the one-flip variants); kmap, mids, grid, g8: the tables of :func:`assign`.
    Returns:
        (n, 8) float32 best scales.
    Raises:
        ValueError: shapes that disagree.
    """
    n = x.shape[0]
    if x.shape != (n, 8, 32) or w.shape != x.shape or cand.ndim != 3 or cand.shape[:2] != (n, 8) or lloyd < 0:
        raise ValueError(f"expected x, w (n, 8, 32), cand (n, 8, T) and lloyd >= 0, got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(cand.shape)}, {lloyd}")
    dev = x.device
    best = torch.zeros(n, 8, dtype=torch.float32, device=dev)
    if n and cand.shape[-1] + lloyd:
        pgrid, tabs, meta = _launch(grid, kmap, mids, dev, n * 32, lists, packed, prefetch)
        step1_kernel[pgrid](
            x.to(torch.float32).contiguous(), w.to(torch.float32).contiguous(), cand.to(torch.float32).contiguous(),
            best, *tabs, n * 32, V=2 if parity else 1, T=cand.shape[-1], LLOYD=int(lloyd), **meta)
    return best


def exact_levels(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, lsc: torch.Tensor, deltas: tuple, kind: str,
                 parity: bool, kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor,
                 idx_dtype: torch.dtype = torch.int64, lists: bool | None = None, packed: bool | None = None,
                 prefetch: bool | None = None):
    """Fused :func:`dynaquant.quant.codecs._iq3_search.exact_levels_torch` (the fast path ``iq3.exact_levels``): a
    round's levels ``l`` and ``l + delta`` in one launch: x and w read once, each level's scales
    (:func:`._iq3_search.sub_scale`) and assignment made in the kernel, its exact error and least-squares sums a
    sub-block formed as :func:`exact` forms them, the better level kept a sub-block in registers; bit for bit
    :func:`._iq3_search.best_levels` of :func:`exact` a level (the scales and their inverses are the torch operations'
    float32 results: ``div_rn``).

    Args:
        x, w: (n, 8, 32) float32; d: (n,) float32 fp16 super-block scales; lsc: (n, 8) int64 levels (0..15); deltas:
            up to two level offsets tried after ``l``; kind: :data:`._iq3_search.SCALE_KINDS`; parity: IQ3_XXS's
            even sign parity (the one-flip variants; ``full`` is False); kmap, mids, grid, g8: the tables of
            :func:`assign`; idx_dtype: the indices' integer type (as :func:`exact`).
    Returns:
        (err (n, 8) float32, idx (n, 8, 8) ``idx_dtype``, flip (n, 8, 32) bool, sxg, sgg (n, 8) float32, l (n, 8)
        int64): the kept level's, in :func:`._iq3_search.best_levels`' order.
    Raises:
        ValueError: shapes that disagree, more than two deltas, an unknown ``kind`` or an ``idx_dtype`` too narrow.
    """
    n = x.shape[0]
    deltas = tuple(int(v) for v in deltas)
    if x.shape != (n, 8, 32) or w.shape != x.shape or d.shape != (n,) or lsc.shape != (n, 8) or len(deltas) > 2:
        raise ValueError(f"expected x, w (n, 8, 32), d (n,), lsc (n, 8) and at most two deltas, got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(d.shape)}, {tuple(lsc.shape)}, {deltas}")
    if kind not in steps.SCALE_KINDS:
        raise ValueError(f"kind must be one of {steps.SCALE_KINDS}, got {kind!r}")
    _check_idx_dtype(idx_dtype, grid)
    dev = x.device
    err, sxg, sgg = (torch.empty(n, 8, dtype=torch.float32, device=dev) for _ in range(3))
    idx = torch.empty(n, 8, 8, dtype=idx_dtype, device=dev)
    flip = torch.empty(n, 8, 32, dtype=torch.uint8, device=dev)
    lo = torch.empty(n, 8, dtype=torch.int64, device=dev)
    if n:
        pgrid, tabs, meta = _launch(grid, kmap, mids, dev, n * 32, lists, packed, prefetch)
        exact_levels_kernel[pgrid](
            x.to(torch.float32).contiguous(), w.to(torch.float32).contiguous(), d.to(torch.float32).contiguous(),
            lsc.to(torch.int64).contiguous(), *tabs, idx, flip, err, sxg, sgg, lo, n * 32, V=2 if parity else 1,
            HALF=kind == "half", ND=len(deltas), D1=deltas[0] if deltas else 0, D2=deltas[1] if len(deltas) > 1 else 0,
            **meta)
    return err, idx, flip.view(torch.bool), sxg, sgg, lo


def consider(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, parity: bool, best_gain: torch.Tensor,
             best_a: torch.Tensor, kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor,
             lists: bool | None = None, packed: bool | None = None, prefetch: bool | None = None):
    """Fused :func:`dynaquant.quant.codecs._iq3_search.consider_torch` (the fast path ``iq3.consider``, one candidate
    scale of step 1): the assignment for scales ``a``, its least-squares sums a sub-block and the running best's
    update in one launch (:data:`CONSIDER`; else :func:`assign` with ``sums`` and the reference's update in torch).
    The update is the reference's float64 operations on the kernel's sums (:func:`assign`'s ``sums`` order). Same
    arguments; returns the new (best_gain (n, 8) float64, best_a (n, 8) float32). Raises ValueError as :func:`assign`."""
    n = x.shape[0]
    if not (CONSIDER and SUMS) or n == 0:
        p, q = assign(x, w, a, parity, False, "stats", False, kmap, mids, grid, g8, lists, packed, sums=True,
                      prefetch=prefetch)[2:]
        return steps.best_scale_update(p.double(), q.double(), best_gain, best_a)
    if x.shape != (n, 8, 32) or w.shape != x.shape or a.shape != (n, 8) or best_gain.shape != (n, 8) \
            or best_a.shape != (n, 8):
        raise ValueError(f"expected x, w (n, 8, 32) and a, best_gain, best_a (n, 8), got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(a.shape)}, {tuple(best_gain.shape)}, {tuple(best_a.shape)}")
    dev = x.device
    xc, wc = x.to(torch.float32).contiguous(), w.to(torch.float32).contiguous()
    ac = a.to(torch.float32).contiguous()
    ia = steps.inv_scale(ac)
    bg, ba = best_gain.to(torch.float64).contiguous(), best_a.to(torch.float32).contiguous()
    gain, scale = torch.empty_like(bg), torch.empty_like(ba)
    pgrid, tabs, meta = _launch(grid, kmap, mids, dev, n * 32, lists, packed, prefetch)
    assign_kernel[pgrid](
        xc, wc, ac, ia, *tabs, gain, gain, gain, scale, bg, ba, gain, gain, n * 32, V=2 if parity else 1, OUT=0,
        IDX=False, SUMS=True, BEST=True, STATS=False, **meta)
    return gain, scale
