"""The resident-activation GEMV (M = 1): each program keeps one K slice's activation pairs in registers and streams
many small row tiles of packed weights past them (``LaunchConfig.resident``).

Why (``kernels/NOTES.md``, ncu of the half2 GEMV, session 28): the wide-tile half2 GEMV re-reads and re-packs its
activations every K tile (INT2's L1/TEX pipe 76 % busy, 42 % of the stalls on the L1TEX scoreboard), its 512-word
INT4 tiles hold 168 registers (19 % occupancy), and its grids end on partial waves. Here:

- the grid is ``(P, SPLIT_K)``: program ``(p, s)`` owns K slice ``s`` (``BLOCK_KW`` words of every row: the K split
  is the whole row in slices, ``SPLIT_K * BLOCK_KW = KW``) and the row tiles ``p, p + P, p + 2P, ...`` of
  ``BLOCK_N`` rows; ``P * SPLIT_K`` is at most ``resident`` programs an SM, so the grid is one wave and each
  program persistent over its row tiles (``P`` is chosen so that every program has the same number of tiles, or
  one fewer);
- the slice's activations are loaded and packed into the f16x2 pairs of :func:`.triton_half2.x_pairs` once, before
  the loop, in the products' register layout (16 / BITS int32 registers a word column a thread);
- a tile's words and scales are loaded two tiles ahead (``prefetch``; registers for three tiles), its word products
  (:func:`.triton_half2.pairs_dot`) summed over runs of ``CW`` words (one group's scale a run, as
  :func:`.triton_linear._half2_part`), its rows' sums stored (no split) or written to the float32 workspace;
  programs ``(p, 0 .. SPLIT_K - 1)`` own the same row tiles, so one split-K counter a column ``p`` and one atomic a
  program (after its last tile) suffice: the last of them sums the column's partials (the fence and the atomic's
  round trip once a program, not once a tile).

Numerics: the half2 GEMV's exactly (same word products, same runs, same float32 sums): with the same rows a tile,
K tile and runs as a half2 config whose K tile is its K slice, the outputs are equal bit for bit in the interpreter.
Formats: those of :func:`.tuning.has_half2` (symmetric INT4 / INT2, MXFP4, NVFP4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynaquant.kernels.packing import PackedWeight
from dynaquant.kernels.triton_half2 import X_UNSCALE, pairs_dot, x_pairs
from dynaquant.kernels.triton_linear import (
    call_buffers,
    format_constants,
    group_scale,
    interpreting,
    out_multiplier,
    store_rows,
)
from dynaquant.kernels.tuning import LaunchConfig, device_info, resident_grid


@triton.jit
def _resident_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, KW, NG, out_mul, TPP,
                     TPP_C: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, PREFETCH: tl.constexpr,
                     SPLIT_K: tl.constexpr, ASM: tl.constexpr, CW: tl.constexpr, RB: tl.constexpr):
    """Program ``(p, s)``: K slice ``s`` (words ``s * BLOCK_KW ..``), row tiles ``p + i P`` for i < TPP (rows past N
    masked). With a K split each tile's partial sums go to the workspace, and the last of the SPLIT_K programs of
    column ``p`` (one split-K counter a column, one atomic a program) reduces all the column's tiles, RB at a time.
    TPP_C: TPP as a constant (the interpreter), else 0."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    NC: tl.constexpr = BLOCK_KW // CW
    pid_n = tl.program_id(0)
    n_prog = tl.num_programs(0)
    pid_k = tl.program_id(1)
    base = pid_k * BLOCK_KW
    word = base + tl.arange(0, BLOCK_KW)
    p0, p1, p2, p3, p4, p5, p6, p7 = x_pairs(x_ptr, word * EPW, BITS, ASM)
    p0 = p0[None, :]
    p1 = p1[None, :]
    p2 = p2[None, :]
    p3 = p3[None, :]
    p4 = p4[None, :]
    p5 = p5[None, :]
    p6 = p6[None, :]
    p7 = p7[None, :]
    wcol = qw_ptr + word[None, :]
    # each run's group, as (scalar + per-element constant): the runs of one group load the same scale
    scol = s_ptr + (base // WPG + tl.arange(0, NC) // (WPG // CW))[None, :]
    rr = tl.arange(0, BLOCK_N)
    if PREFETCH:  # tiles 0 and 1 of the program
        row_a = tl.minimum(pid_n * BLOCK_N + rr, N - 1)[:, None]
        w_a = tl.load(wcol + row_a * KW)
        s_a = tl.load(scol + row_a * NG)
        row_b = tl.minimum((pid_n + n_prog) * BLOCK_N + rr, N - 1)[:, None]
        w_b = tl.load(wcol + row_b * KW)
        s_b = tl.load(scol + row_b * NG)
    for i in range(0, TPP_C if TPP_C > 0 else TPP):  # (an assigned ternary trips the 3.6 interpreter)
        rn = (pid_n + i * n_prog) * BLOCK_N + rr
        row = tl.minimum(rn, N - 1)[:, None]  # tiles past the last read its last row (masked below)
        if PREFETCH:
            # two tiles ahead: ptxas issues a loop iteration's loads after its arithmetic (offline sm_90 SASS), so
            # loads of the next tile would be waited on at the top of the next iteration; tile i + 2's have all of
            # tile i + 1's decoding to arrive
            w = w_a
            s_raw = s_a
            w_a = w_b
            s_a = s_b
            row_c = tl.minimum(rn + 2 * n_prog * BLOCK_N, N - 1)[:, None]
            w_b = tl.load(wcol + row_c * KW)
            s_b = tl.load(scol + row_c * NG)
        else:
            w = tl.load(wcol + row * KW)
            s_raw = tl.load(scol + row * NG)
        d = pairs_dot(w, p0, p1, p2, p3, p4, p5, p6, p7, BITS, ASM, KIND != 0)  # [BLOCK_N, BLOCK_KW]
        part = tl.sum(tl.reshape(d, [BLOCK_N, NC, CW]), axis=2)
        sc = group_scale(s_raw, KIND)
        y = tl.sum(part * sc, axis=1) * X_UNSCALE
        if SPLIT_K == 1:
            store_rows(y, rn, rn < N, b_ptr, y_ptr, out_mul, HAS_BIAS)
        else:
            tl.store(ws_ptr + pid_k * N + rn, y, mask=rn < N)
    if SPLIT_K > 1:
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            ri = tl.arange(0, RB)
            for j in range(0, TPP_C if TPP_C > 0 else TPP, RB):
                rn2 = ((pid_n + (j + ri) * n_prog) * BLOCK_N)[:, None] + rr[None, :]  # [RB, BLOCK_N]
                m2 = (rn2 < N) & ((j + ri) < TPP)[:, None]
                tot = tl.zeros([RB, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # (all the loads in flight at once)
                    tot += tl.load(ws_ptr + s * N + rn2, mask=m2, other=0.0, cache_modifier=".cg")
                store_rows(tot, rn2, m2, b_ptr, y_ptr, out_mul, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def resident_launch_args(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig):
    """(kernel, grid, args, kwargs, y) of one resident-GEMV call (x2 (1, K); ``cfg`` valid for the shape, see
    :func:`.tuning.valid_config`); the grid from :func:`.tuning.resident_grid` on x2's device."""
    n = packed.out_features
    split = cfg.split_k
    kw, _, ng, y, ws, _, _, b = call_buffers(x2, packed, bias, split)
    f = packed.fmt
    wpg = f.group_size // (32 // f.bits)
    _, n_prog, tpp = resident_grid(n, cfg, device_info(x2.device).sm_count)
    args = (x2, packed.qweight, packed.scales, b, y, ws, packed.counters, n, kw, ng, out_multiplier(packed, False), tpp)
    fc = format_constants(packed)
    kwargs = dict(TPP_C=tpp if interpreting() else 0, KIND=fc["KIND"], BITS=fc["BITS"], G=fc["G"],
                  HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.groups * wpg, PREFETCH=cfg.prefetch,
                  SPLIT_K=split, ASM=not interpreting(), CW=min(cfg.scale_words, wpg), RB=8, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    return _resident_kernel, (n_prog, split), args, kwargs, y


def run_resident(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> torch.Tensor:
    """``x2 (1, K) @ dequant(W).T + bias`` (1, N) on the resident GEMV (``cfg.resident``; no super weights), as
    :func:`.triton_linear.run_linear` on the other gemv configurations."""
    kernel, grid, args, kwargs, y = resident_launch_args(x2, packed, bias, cfg)
    kernel[grid](*args, **kwargs)
    return y


def compile_resident(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> None:
    """Compile (without running) the kernel :func:`run_resident` would launch; safe to call from threads."""
    kernel, grid, args, kwargs, _ = resident_launch_args(x2[:1], packed, bias, cfg)
    kernel.warmup(*args, grid=grid, **kwargs)
