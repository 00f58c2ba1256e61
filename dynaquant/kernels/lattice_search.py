"""Fused lattice searches of the grid i-quants (Triton).

:func:`nearest_codewords`: the best codeword of each group of ``D`` weights over the whole
codebook, for ``T`` candidate scales per group. The torch reference with the same signature
is :func:`dynaquant.quant.codecs._lattice.nearest_codewords_torch` (one matmul per batch of
scales, the (groups, G) cost matrix written to memory and reduced). Per group and codeword

    B[r, g] = sum_i w_ri x_ri g_i,   C[r, g] = sum_i w_ri g_i**2,   M[r, g] = min_i w_ri x_ri g_i,

``B`` lowered by ``2 M`` on the groups flagged ``odd`` (the parity flip,
:func:`dynaquant.quant.codecs._lattice.flip_penalty`), and for each scale the minimum and
argmin of ``S**2 C - 2 S B``. Nothing of size (groups, G) touches memory: a call reads ``x``,
``w`` and the scales and writes (T, n) costs and indices. Two implementations:

- ``rows`` (default; D = 4 or 8): one group per lane, the codebook walked one codeword at a
  time (its coordinates and squares as uniform loads), up to 8 running (min, argmin) pairs
  per group in registers (more scales: one launch per 8), no cross-lane reduction;
- ``tile``: a (BLOCK_N, G) register tile of ``B``, ``C``, ``M`` per program, reduced across
  lanes once per scale (5x slower on an H100: the reductions dominate).

The ``variant`` argument (``"rows"`` or ``"tile"``) chooses; the codecs pass it down from
``quantize(..., variant=...)``. Measured on an H100 (2M groups, 8
scales, parity on): rows 2.1 ms (IQ2_XXS, G = 256) and 3.9 ms (IQ2_XS, G = 512); tile 12.0
and 11.8 ms; torch reference 67 and 118 ms.

The kernels themselves, and the memory layout they read, are in
:mod:`dynaquant.kernels.lattice_triton`; this module checks shapes, lays out the inputs and
launches them.

Two smaller kernels serve the search over a few candidate codewords per group:
:func:`candidate_terms` (``B`` and ``C`` of each group's candidates, the flip penalty
included; reference :func:`dynaquant.quant.codecs._lattice.candidate_terms_torch`) and
:func:`subset_min_costs` (``min_k S**2 C_k - 2 S B_k`` for a batch of scales without the
(T, n, K) temporary; reference :func:`dynaquant.quant.codecs._lattice.subset_min_costs_torch`).

:func:`ternary_nearest` is IQ1_S/IQ1_M's exact nearest point of the ternary grid (its
candidate-list search, :func:`dynaquant.quant.codecs.iq1.nearest_points`, one group per lane,
bit-identical indices); :func:`ternary_search` runs it for both delta signs at once, reads each
group once for all its trial scales, and also returns each group's error (reference
:func:`dynaquant.quant.codecs.iq1.ternary_search_torch`, bit for bit).

Importing this module imports Triton. :mod:`dynaquant.kernels` registers these functions into
:mod:`dynaquant.quant.codecs.fastpaths` (loaded on first use) without importing it; the codecs
run them on CUDA tensors (``backend="auto"``) or wherever ``backend="triton"`` says.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from dynaquant.kernels.lattice_triton import (
    candidate_terms_kernel,
    nearest_rows_kernel,
    nearest_tile_kernel,
    stored_scale_kernel,
    subset_min_kernel,
    subset_min_sub_kernel,
    ternary_nearest_kernel,
    ternary_search_kernel,
)

__all__ = ["nearest_codewords", "candidate_terms", "subset_min_costs", "stored_scale_costs", "ternary_nearest", "ternary_search"]

# Two implementations of nearest_codewords: "rows" (one group per lane, the codebook walked
# codeword by codeword, no cross-lane reduction; D = 4 or 8) and "tile" (a (BLOCK_N, G)
# register tile of costs per program, reduced across lanes for each scale).
# ``variant`` chooses (None: the default).
VARIANTS = ("rows", "tile")
DEFAULT_VARIANT = "rows"
# rows: groups per program and warps.
_ROWS_BLOCK = 256
_ROWS_WARPS = 4
# tile: elements of one (BLOCK_N, BLOCK_G) register tile (three live tiles: B, C, M).
_TILE = 4096
_NUM_WARPS = 4


def nearest_codewords(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: torch.Tensor,
    scale: torch.Tensor,
    odd: torch.Tensor | None = None,
    *,
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best codeword of each group over the whole codebook, for a batch of scales (fused).

    Arguments and result as the torch reference
    :func:`dynaquant.quant.codecs._lattice.nearest_codewords_torch` (x, w (n, D) float32, grid
    (G, D) float32, scale (..., n) float32, odd optional (n,) bool -> cost (..., n) float32,
    idx (..., n) int64; among exact ties the lowest index). ``variant``: ``"rows"`` or
    ``"tile"`` (module docstring; None: :data:`DEFAULT_VARIANT`); ``"rows"`` needs D = 4 or 8
    and falls back to ``"tile"`` otherwise.

    Raises:
        ValueError: shapes disagree, or an unknown variant.
    """
    variant = DEFAULT_VARIANT if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} or None, got {variant!r}")
    if x.ndim != 2 or w.shape != x.shape or grid.ndim != 2 or grid.shape[1] != x.shape[1] or scale.shape[-1:] != x.shape[:1]:
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, grid {tuple(grid.shape)}, scale {tuple(scale.shape)}"
        )
    n, d = x.shape
    g = grid.shape[0]
    lead = scale.shape[:-1]
    t = math.prod(lead)
    sc = scale.reshape(t, n).to(torch.float32).contiguous()
    cost = torch.empty(t, n, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, n, dtype=torch.int64, device=x.device)
    if n == 0 or t == 0:
        return cost.reshape(*lead, n), idx.reshape(*lead, n)
    xc = x.to(torch.float32).contiguous()
    wc = w.to(device=x.device, dtype=torch.float32).contiguous()
    gc = grid.to(device=x.device, dtype=torch.float32).contiguous()
    if odd is not None:
        oc = odd.to(device=x.device, dtype=torch.int8).contiguous()
        if oc.shape != (n,):
            raise ValueError(f"odd must be ({n},), got {tuple(odd.shape)}")
    else:
        oc = xc  # unused (PARITY False)
    if variant == "rows" and d in (4, 8):
        g2 = gc * gc
        block_n = max(32, min(_ROWS_BLOCK, triton.next_power_of_2(n)))
        for t0 in range(0, t, 8):
            t1 = min(t, t0 + 8)
            nearest_rows_kernel[(triton.cdiv(n, block_n),)](
                xc,
                wc,
                gc,
                g2,
                sc[t0:t1],
                oc,
                cost[t0:t1],
                idx[t0:t1],
                n,
                G=g,
                T=t1 - t0,
                D=d,
                BLOCK_N=block_n,
                PARITY=odd is not None,
                num_warps=_ROWS_WARPS,
            )
    else:
        block_g = triton.next_power_of_2(g)
        block_n = max(1, min(_TILE // block_g, triton.next_power_of_2(n)))
        nearest_tile_kernel[(triton.cdiv(n, block_n),)](
            xc,
            wc,
            gc,
            sc,
            oc,
            cost,
            idx,
            n,
            g,
            t,
            D=d,
            BLOCK_N=block_n,
            BLOCK_G=block_g,
            PARITY=odd is not None,
            num_warps=_NUM_WARPS,
        )
    return cost.reshape(*lead, n), idx.reshape(*lead, n)


def candidate_terms(
    x: torch.Tensor, w: torch.Tensor, grid: torch.Tensor, idx: torch.Tensor, odd: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``B`` and ``C`` of a few candidate codewords per group, the parity flip included (fused).

    Arguments and result as the torch reference
    :func:`dynaquant.quant.codecs._lattice.candidate_terms_torch` (idx (n, K) int64 -> b, c
    (n, K) float32).
    """
    n, d = x.shape
    k = idx.shape[1]
    b = torch.empty(n, k, dtype=torch.float32, device=x.device)
    c = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if n == 0 or k == 0:
        return b, c
    xc, wc = x.to(torch.float32).contiguous(), w.to(torch.float32).contiguous()
    gc = grid.to(torch.float32).contiguous()
    ic = idx.contiguous()
    oc = odd.to(torch.int8).contiguous() if odd is not None else xc
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(1024 // block_k, triton.next_power_of_2(n)))
    candidate_terms_kernel[(triton.cdiv(n, block_n),)](
        xc, wc, gc, ic, oc, b, c, n, k, D=d, BLOCK_N=block_n, BLOCK_K=block_k, PARITY=odd is not None, num_warps=4
    )
    return b, c


def subset_min_costs(b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, gps: int = 1) -> torch.Tensor:
    """``min_k S**2 c_k - 2 S b_k`` of each group for a batch of scales (fused): as the torch
    reference :func:`dynaquant.quant.codecs._lattice.subset_min_costs_torch` ((n, K), (n, K),
    (..., n // gps) float32 -> (..., n // gps) float32; with ``gps`` > 1 one scale a sub-block of ``gps``
    consecutive groups, and the sub-block's sum of its groups' minima), without the (..., n, K) temporary
    nor a per-group copy of the scales. The sum of two minima (``gps`` = 2) is formed in the kernel
    (``m0 + m1``, the one rounding torch's sum makes); longer sums are torch's (``.sum(-1)`` of the
    (..., n) minima), so they round as the reference's do.

    Raises:
        ValueError: ``gps`` < 1 or it does not divide n, or scale's last axis is not n // gps.
    """
    n, k = b.shape
    if gps < 1 or n % gps or scale.shape[-1] != n // gps:
        raise ValueError(f"scale {tuple(scale.shape)} must end in n // gps = {n} // {gps} sub-blocks")
    lead = scale.shape[:-1]
    t = math.prod(lead)
    n_sub = n // gps
    cost = torch.empty(t, n_sub if gps == 2 else n, dtype=torch.float32, device=b.device)  # (gps = 2: summed here)
    if n == 0 or t == 0:
        return cost[:, :n_sub].reshape(*lead, n_sub)
    sc = scale.reshape(t, n_sub).to(torch.float32).contiguous()
    block_k = triton.next_power_of_2(k)
    bc, cc = b.contiguous(), c.contiguous()
    if gps == 1:
        block_n = max(1, min(1024 // block_k, triton.next_power_of_2(n)))
        subset_min_kernel[(triton.cdiv(n, block_n),)](bc, cc, sc, cost, n, k, T=t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
        return cost.reshape(*lead, n)
    block_s = max(1, min(1024 // block_k, triton.next_power_of_2(n_sub)))
    subset_min_sub_kernel[(triton.cdiv(n_sub, block_s),)](
        bc, cc, sc, cost, n_sub, k, T=t, GPS=gps, SUM=gps == 2, BLOCK_S=block_s, BLOCK_K=block_k, num_warps=4
    )
    if gps == 2:
        return cost.reshape(*lead, n_sub)
    return cost.view(t, n_sub, gps).sum(dim=-1).reshape(*lead, n_sub)


def stored_scale_costs(
    b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, cont: torch.Tensor, offsets: torch.Tensor, gps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2's best stored sub-block code for each candidate block scale (fused): as the torch reference
    :func:`dynaquant.quant.codecs.iq2.stored_scale_costs_torch` (b, c (n_sub 2, K) float32, d (F, n) float32,
    cont (n, n_sub) float32, offsets (O,) int64 -> cost (F, n, n_sub) float32, s (F, n, n_sub) int64), without
    the (O, F, n, n_sub) codes, scales and costs in memory.

    Raises:
        ValueError: ``gps`` is not 2 (longer sub-blocks sum their minima in torch's order: the reference), or
            shapes disagree.
    """
    n, n_sub = cont.shape
    if gps != 2 or b.shape != c.shape or b.shape[0] != n * n_sub * 2 or d.ndim != 2 or d.shape[1] != n:
        raise ValueError(f"shapes disagree: b {tuple(b.shape)}, c {tuple(c.shape)}, d {tuple(d.shape)}, "
                         f"cont {tuple(cont.shape)}, gps {gps} (2 only)")
    f, k = d.shape[0], b.shape[1]
    cost = torch.empty(f, n, n_sub, dtype=torch.float32, device=b.device)
    s = torch.empty(f, n, n_sub, dtype=torch.int64, device=b.device)
    m = n * n_sub
    if m == 0 or f == 0:
        return cost, s
    block_k = triton.next_power_of_2(k)
    block_s = max(1, min(1024 // block_k, triton.next_power_of_2(m)))
    stored_scale_kernel[(triton.cdiv(m, block_s),)](
        b.contiguous(), c.contiguous(), d.to(torch.float32).contiguous(), cont.to(torch.float32).contiguous(),
        offsets.to(device=b.device, dtype=torch.int64).contiguous(), cost, s, m, n, k, f,
        N_OFF=offsets.numel(), NSUB=n_sub, BLOCK_S=block_s, BLOCK_K=block_k, num_warps=4,
    )
    return cost, s


def ternary_nearest(
    x: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    sign: torch.Tensor,
    grid_of: torch.Tensor,
    count: torch.Tensor,
    codes: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """Nearest point of IQ1's ternary grid (shifted by ``sign * delta``) of each group of 8 (fused).

    Same search and same result as :func:`dynaquant.quant.codecs.iq1.nearest_points` (its
    index): the free rounding's pattern is looked up in ``grid_of``; off the grid, its
    candidate list is scanned (costs summed in the reference's order).

    Args:
        x, w: (m, 8) float32 weights and importance (>= 0).
        t: (m,) float32 scales (>= 0); sign: (m,) float32 +1 / -1.
        grid_of: (6561,) int32 grid index of each pattern or -1; count: (6561,) int32
            candidates of each pattern; codes: (6561, KP) int32 candidates, each
            ``index | digits << 11`` (digit ``i`` = level + 1 at bits ``11 + 2 i``).
        delta: the grid shift (IQ1S_DELTA).
    Returns:
        (m,) int64 grid indices.
    """
    m = x.shape[0]
    idx = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return idx
    block_n = max(32, min(256, triton.next_power_of_2(m)))
    ternary_nearest_kernel[(triton.cdiv(m, block_n),)](
        x.to(torch.float32).contiguous(),
        w.to(torch.float32).contiguous(),
        t.to(torch.float32).contiguous(),
        sign.to(torch.float32).contiguous(),
        grid_of,
        count,
        codes,
        idx,
        m,
        float(delta),
        KP=codes.shape[1],
        BLOCK_N=block_n,
        DYNAMIC=os.environ.get("TRITON_INTERPRET", "0") != "1",
        num_warps=4,
    )
    return idx


def ternary_search(
    x: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    grid_of: torch.Tensor,
    count: torch.Tensor,
    codes: torch.Tensor,
    digits: torch.Tensor,
    delta: float,
    rep: int,
    gps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ1's nearest ternary grid points and their errors, both delta signs, ``rep`` trial scales a group (fused).

    Same result as the torch reference :func:`dynaquant.quant.codecs.iq1.ternary_search_torch`, bit for bit
    (launched without multiply-add fusion, so each error is formed with the reference's roundings).

    Args:
        x, w: (r, 8) float32 weights and importance (>= 0), sub-blocks of ``gps`` consecutive groups.
        t: (m,) float32 scales, m = r * rep, ordered (sub-block, trial, group): lane ``l`` is group
            ``(l // (rep gps)) gps + l % gps``.
        grid_of, count, codes: :func:`dynaquant.quant.codecs.iq1._kernel_tables`; digits: (2048,) int32 each
            grid point's 2-bit digits (level + 1 at bits ``2 i``).
        delta: the grid shift.
    Returns:
        (idx, err): (2, m) int64 grid indices and (2, m) float32 errors ``sum w (x - t (g + sign delta))**2``;
        row 0 for ``sign = +1``, row 1 for ``-1``.
    Raises:
        ValueError: shapes disagree.
    """
    m = t.shape[0]
    if x.ndim != 2 or x.shape[1] != 8 or w.shape != x.shape or t.ndim != 1 or x.shape[0] * rep != m or x.shape[0] % gps:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, t {tuple(t.shape)}, rep {rep}, gps {gps}")
    idx = torch.empty(2, m, dtype=torch.int64, device=x.device)
    err = torch.empty(2, m, dtype=torch.float32, device=x.device)
    if m == 0:
        return idx, err
    block_n = max(32, min(256, triton.next_power_of_2(m)))
    ternary_search_kernel[(triton.cdiv(m, block_n),)](
        x.to(torch.float32).contiguous(),
        w.to(torch.float32).contiguous(),
        t.to(torch.float32).contiguous(),
        grid_of,
        count,
        codes,
        digits,
        idx,
        err,
        m,
        float(delta),
        KP=codes.shape[1],
        REP=rep,
        GPS=gps,
        BLOCK_N=block_n,
        DYNAMIC=os.environ.get("TRITON_INTERPRET", "0") != "1",
        num_warps=4,
        enable_fp_fusion=False,
    )
    return idx, err
