"""Fused K-quant scale searches (Triton): each step of the search of
:mod:`dynaquant.quant.codecs._kquant_search` in one launch for all its candidates.

The reference runs every candidate as a handful of batched torch operations (for a 16 M-weight
Q4_K chunk some 9 000 small kernels, two thirds of the time in step 1's 81 candidates); here a
program keeps its tile of ``x`` and ``w`` in registers, walks the candidates and keeps the
running best, so a step reads its inputs once and writes only the result. Same signatures
and results as the torch references (each function names its own); the floats are computed
in the same order except inside the sums over a sub-block (or over a super-block's
sub-blocks), whose order differs, so a block whose two best candidates are within rounding
may keep the other one (a tie either way). The tests compare with the references.

Functions (shapes as the references): :func:`aff_search_scales`, :func:`aff_pick`,
:func:`aff_refine`, :func:`sym_search_scales`, :func:`sym_pick`, :func:`sym_refine`; and the whole symmetric
search :func:`sym_encode` (the steps' kernels with the torch glue between them fused too:
:mod:`dynaquant.kernels.kquant_sym_triton`; bit for bit ``sym_encode_torch`` with the steps' kernels on CUDA) and
its bytes :func:`sym_bytes`.
:mod:`dynaquant.kernels` registers them into :mod:`dynaquant.quant.codecs.fastpaths`
(``kquant.*``). Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton

from dynaquant.kernels.kquant_sym_triton import sym_bytes_kernel, sym_keep_kernel, sym_round_kernel
from dynaquant.kernels.kquant_triton import (
    aff_pick_kernel,
    aff_refine_kernel,
    aff_step1_kernel,
    sym_breakpoints_kernel,
    sym_pick_kernel,
    sym_refine_kernel,
    sym_step1_kernel,
)
from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs.consts import device_constant

__all__ = ["aff_search_scales", "aff_pick", "aff_refine", "sym_search_scales", "sym_pick", "sym_refine", "sym_encode",
           "sym_bytes"]

_TILE = 2048  # elements of a (rows, sub_size) register tile
_PICK_ROWS = 64  # super-blocks a step-2 program
_NUM_WARPS = 4
_OPTS = {"num_warps": _NUM_WARPS, "enable_fp_fusion": False}
# The symmetric step 1's tile (elements) and warps: any with at least 4 elements of a row a thread (tile / (32 *
# warps) >= 4) gives its sums over a sub-block the same layout (4 neighbours a thread, 4 lanes a row), so the same
# order and results; .dev/k_bench.py times the choices.
_STEP1_SYM_TILE = _TILE
_STEP1_SYM_WARPS = _NUM_WARPS
_BLOCK_B = 8  # super-blocks a program of the symmetric glue and bytes: (8, 16, 16) tiles of x and w


def _flat(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    if x.ndim != 3 or w.shape != x.shape:
        raise ValueError(f"expected x and w of shape (n_super, n_sub, sub_size), got {tuple(x.shape)} and {tuple(w.shape)}")
    n_super, n_sub, sub = x.shape
    if sub & (sub - 1) or n_sub & (n_sub - 1):
        raise ValueError(f"sub-blocks of {sub} and {n_sub} sub-blocks: both must be powers of two")
    xc = x.to(torch.float32).reshape(-1, sub).contiguous()
    wc = w.to(device=x.device, dtype=torch.float32).reshape(-1, sub).contiguous()
    return xc, wc, n_super, n_sub, sub


def _rows_grid(r: int, sub: int) -> tuple[int, tuple[int]]:
    # one tile shape per sub-block size (one compiled kernel per format; small inputs are masked)
    block = _TILE // sub
    return block, (triton.cdiv(r, block),)


def aff_search_scales(x: torch.Tensor, w: torch.Tensor, spec: kqs.AffSearch, iters: int = 3):
    """Affine step 1 (fused): as :func:`dynaquant.quant.codecs._kquant_search.aff_search_scales`
    ((n_super, n_sub, sub_size) float32 -> (A, B) (n_super, n_sub) float64)."""
    xc, wc, n_super, n_sub, sub = _flat(x, w)
    r = xc.shape[0]
    a = torch.empty(r, dtype=torch.float64, device=x.device)
    b = torch.empty_like(a)
    if r:
        steps = device_constant(spec.steps, torch.float32, x.device)
        shifts = device_constant(spec.shifts, torch.float32, x.device)
        eps = device_constant([1e-12], torch.float64, x.device)
        block, grid = _rows_grid(r, sub)
        aff_step1_kernel[grid](
            xc, wc, steps, shifts, eps, a, b, r, len(spec.steps), len(spec.shifts),
            QMAX=spec.qmax, ITERS=iters, SUB=sub, BLOCK_R=block, **_OPTS,
        )
    return a.view(n_super, n_sub), b.view(n_super, n_sub)


def sym_search_scales(x: torch.Tensor, w: torch.Tensor, spec: kqs.SymSearch, iters: int = 2) -> torch.Tensor:
    """Symmetric step 1 (fused): as :func:`dynaquant.quant.codecs._kquant_search.sym_search_scales`
    ((n_super, n_sub, sub_size) float32 -> (n_super, n_sub) float64). The exhaustive search's code breakpoints
    (:func:`~dynaquant.quant.codecs._kquant_search.exhaustive_breakpoints`) are sorted a sub-block in registers by
    one launch (:func:`sym_breakpoints`), and step 1 walks the middles of neighbours as
    :func:`~dynaquant.quant.codecs._kquant_search.exhaustive_mids` lists them."""
    xc, wc, n_super, n_sub, sub = _flat(x, w)
    r = xc.shape[0]
    a = torch.empty(r, dtype=torch.float64, device=x.device)
    if r:
        signed = [s * t for t in spec.steps for s in (1.0, -1.0)]
        steps = device_constant(signed or [0.0], torch.float32, x.device)
        bp = sym_breakpoints(xc, spec.qlo, spec.qhi) if spec.exhaustive else xc
        m = bp.shape[1] if spec.exhaustive else 0
        block = _STEP1_SYM_TILE // sub
        sym_step1_kernel[(triton.cdiv(r, block),)](
            xc, wc, steps, bp, a, r, len(signed), m, N_ELEM=min(spec.n_elem, sub), QLO=spec.qlo, QHI=spec.qhi,
            ITERS=iters, SUB=sub, BLOCK_R=block, num_warps=_STEP1_SYM_WARPS, enable_fp_fusion=False,
        )
    return a.view(n_super, n_sub)


def sym_breakpoints(x: torch.Tensor, qlo: int, qhi: int) -> torch.Tensor:
    """As :func:`dynaquant.quant.codecs._kquant_search.exhaustive_breakpoints` of (R, sub_size) float32 rows ->
    (R, sub_size * max(-qlo, qhi)) float32 ascending, one launch (a sub-block's breakpoints sorted in registers);
    the torch sort where that count is not a power of two."""
    r, sub = x.shape
    nl = max(-qlo, qhi)
    if (sub * nl) & (sub * nl - 1) or nl & (nl - 1):
        return kqs.exhaustive_breakpoints(x, qlo, qhi).contiguous()
    bp = torch.empty(r, sub * nl, dtype=torch.float32, device=x.device)
    if r:
        block = max(1, _TILE // (sub * nl))
        sym_breakpoints_kernel[(triton.cdiv(r, block),)](x, bp, r, SUB=sub, NL=nl, BLOCK_R=block, **_OPTS)
    return bp


def aff_pick(ref: tuple[torch.Tensor, ...], kmax: int, dc: torch.Tensor, mc: torch.Tensor):
    """Affine step 2 (fused): as :func:`dynaquant.quant.codecs._kquant_search.aff_pick_torch`
    (``ref`` seven (n_super, n_sub) float32, candidates (n_super, C) float32 -> d, dmin
    (n_super,) float32, ks, km (n_super, n_sub) int64)."""
    n_super, n_sub = ref[0].shape
    dev = dc.device
    d = torch.zeros(n_super, dtype=torch.float32, device=dev)
    dm = torch.zeros_like(d)
    ks = torch.zeros(n_super, n_sub, dtype=torch.int64, device=dev)
    km = torch.zeros_like(ks)
    if n_super:
        refc = torch.stack([t.to(torch.float32) for t in ref]).contiguous()
        block = _PICK_ROWS
        aff_pick_kernel[(triton.cdiv(n_super, block),)](
            refc, dc.to(torch.float32).contiguous(), mc.to(torch.float32).contiguous(), d, dm, ks, km,
            n_super, dc.shape[1], KMAX=kmax, NSUB=n_sub, BLOCK_B=block, **_OPTS,
        )
    return d, dm, ks, km


def sym_pick(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, sqq: torch.Tensor, spec: kqs.SymSearch,
             cand: torch.Tensor, clip: bool = False):
    """Symmetric step 2 (fused): as :func:`dynaquant.quant.codecs._kquant_search.sym_pick_torch`
    (``x``, ``w`` (n_super, n_sub, sub_size), ``a``, ``sqq`` (n_super, n_sub) float32, candidates (n_super, C)
    float32, ranked with ``clip`` by the clipping error -> d (n_super,) float32, k (n_super, n_sub) int64)."""
    xc, wc, n_super, n_sub, sub = _flat(x, w)
    c = cand.shape[1]
    d = torch.zeros(n_super, dtype=torch.float32, device=a.device)
    k = torch.zeros(n_super, n_sub, dtype=torch.int64, device=a.device)
    if n_super:
        # the clip steps load (block, n_sub, sub_size) tiles of x and w a candidate: rows for _TILE elements a tile
        # (8 super-blocks of Q3_K; a power of two)
        block = max(1, min(_PICK_ROWS, _TILE // (n_sub * sub))) if clip else _PICK_ROWS
        sym_pick_kernel[(triton.cdiv(n_super, block),)](
            xc, wc, a.to(torch.float32).contiguous(), sqq.to(torch.float32).contiguous(),
            cand.to(torch.float32).contiguous(), d, k, n_super, c, QLO=spec.qlo, QHI=spec.qhi, KLO=spec.klo,
            KHI=spec.khi, CLIP=bool(clip), CLIP_MAX=spec.clip_max, SUB=sub, NSUB=n_sub, BLOCK_B=block, **_OPTS,
        )
    return d, k


def aff_refine(x: torch.Tensor, w: torch.Tensor, cfg: kqs.AffConfig, spec: kqs.AffSearch):
    """Affine step 3 (fused): as :func:`dynaquant.quant.codecs._kquant_search.aff_refine_torch`
    (returns the config and its error per super-block, (n_super,) float64)."""
    xc, wc, n_super, n_sub, sub = _flat(x, w)
    r = xc.shape[0]
    ks = torch.empty(r, dtype=torch.int64, device=x.device)
    km = torch.empty_like(ks)
    err = torch.empty(r, dtype=torch.float64, device=x.device)
    if r:
        moves = device_constant(spec.moves, torch.int32, x.device).reshape(-1)
        block, grid = _rows_grid(r, sub)
        aff_refine_kernel[grid](
            xc, wc, cfg.d.float().contiguous(), cfg.dmin.float().contiguous(), cfg.ks.contiguous(), cfg.km.contiguous(),
            moves, ks, km, err, r, len(spec.moves),
            QMAX=spec.qmax, KMAX=spec.kmax, SUB=sub, NSUB=n_sub, BLOCK_R=block, **_OPTS,
        )
    out = kqs.AffConfig(cfg.d, cfg.dmin, ks.view(n_super, n_sub), km.view(n_super, n_sub))
    return out, err.view(n_super, n_sub).sum(-1)


def sym_refine(x: torch.Tensor, w: torch.Tensor, cfg: kqs.SymConfig, spec: kqs.SymSearch):
    """Symmetric step 3 (fused): as :func:`dynaquant.quant.codecs._kquant_search.sym_refine_torch`
    (returns the config and its error per super-block, (n_super,) float64)."""
    xc, wc, n_super, n_sub, sub = _flat(x, w)
    r = xc.shape[0]
    k = torch.empty(r, dtype=torch.int64, device=x.device)
    err = torch.empty(r, dtype=torch.float64, device=x.device)
    if r:
        block, grid = _rows_grid(r, sub)
        sym_refine_kernel[grid](
            xc, wc, cfg.d.float().contiguous(), cfg.k.contiguous(), k, err, r,
            QLO=spec.qlo, QHI=spec.qhi, KLO=spec.klo, KHI=spec.khi, SUB=sub, NSUB=n_sub, BLOCK_R=block, **_OPTS,
        )
    return kqs.SymConfig(cfg.d, k.view(n_super, n_sub)), err.view(n_super, n_sub).sum(-1)


def sym_encode(x: torch.Tensor, w: torch.Tensor, spec: kqs.SymSearch) -> kqs.SymConfig:
    """As :func:`dynaquant.quant.codecs._kquant_search.sym_encode_torch` with the step kernels (``backend="triton"``):
    x, w (n_super, 16, 16) float32 -> :class:`~dynaquant.quant.codecs._kquant_search.SymConfig`, the same values.
    Other shapes (not 16 sub-blocks of 16) run ``sym_encode_torch``."""
    if x.ndim != 3 or x.shape[1:] != (16, 16) or w.shape != x.shape:
        return kqs.sym_encode_torch(x, w, spec, "triton")
    xc, wc, n, n_sub, sub = _flat(x, w)
    dev = x.device
    bd = torch.zeros(n, dtype=torch.float32, device=dev)
    bk = torch.zeros(n, n_sub, dtype=torch.int64, device=dev)
    if n == 0:
        return kqs.SymConfig(bd, bk)
    be = torch.zeros(n, dtype=torch.float64, device=dev)
    a1 = sym_search_scales(x, w, spec)
    ts = device_constant(spec.d_steps, torch.float64, dev)
    nc = len(spec.clip_steps)
    tc = device_constant(spec.clip_steps, torch.float64, dev) if nc else ts
    r = n * n_sub
    a32 = torch.empty(n, n_sub, dtype=torch.float32, device=dev)
    sqq32 = torch.empty_like(a32)
    grid = (triton.cdiv(n, _BLOCK_B),)
    first = True
    for rnd in range(spec.rounds):
        c = 2 * len(spec.d_steps) + (0 if rnd == 0 else 2)
        cand = torch.empty(n, c, dtype=torch.float32, device=dev)
        candc = torch.empty(n, 2 * nc, dtype=torch.float32, device=dev) if nc else cand
        sym_round_kernel[grid](
            xc, wc, a1, bd, bk, ts, tc, a32, sqq32, cand, candc, n, len(spec.d_steps), nc, c,
            FIRST=rnd == 0, QLO=spec.qlo, QHI=spec.qhi, BLOCK_B=_BLOCK_B, **_OPTS,
        )
        groups = [(cand, False)] + ([(candc, True)] if nc else [])
        for cg, clip in groups:
            d, k = sym_pick(x, w, a32, sqq32, spec, cg, clip)
            k2 = torch.empty(r, dtype=torch.int64, device=dev)
            err = torch.empty(r, dtype=torch.float64, device=dev)
            block, rgrid = _rows_grid(r, sub)
            sym_refine_kernel[rgrid](
                xc, wc, d, k, k2, err, r,
                QLO=spec.qlo, QHI=spec.qhi, KLO=spec.klo, KHI=spec.khi, SUB=sub, NSUB=n_sub, BLOCK_R=block, **_OPTS,
            )
            sym_keep_kernel[grid](err, d, k2, bd, bk, be, n, FIRST=first, BLOCK_B=_BLOCK_B, **_OPTS)
            first = False
    return kqs.SymConfig(bd, bk)


def sym_bytes(format_name: str, x: torch.Tensor, cfg: kqs.SymConfig) -> torch.Tensor:
    """As :func:`dynaquant.quant.codecs.kquants.sym_bytes_torch`, one launch: x (n, 256) float32, ``cfg.d`` (n,)
    float32 holding float16 values, ``cfg.k`` (n, 16) int64 -> (n, type_size) uint8. Raises ValueError for another
    format or shape."""
    qbits, tsize = kqs.sym_bytes_layout(format_name, x, cfg, "Triton")
    n = x.shape[0]
    out = torch.empty(n, tsize, dtype=torch.uint8, device=x.device)
    if n:
        xc = x.to(torch.float32).contiguous()
        d = cfg.d.to(device=x.device, dtype=torch.float32).contiguous()
        k = cfg.k.to(device=x.device, dtype=torch.int64).contiguous()
        sym_bytes_kernel[(triton.cdiv(n, _BLOCK_B),)](xc, d, k, out, n, Q6=qbits == 6, TS=tsize, BLOCK_B=_BLOCK_B, **_OPTS)
    return out
