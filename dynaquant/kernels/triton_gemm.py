"""Large batches (M >= 64): a fused dequant-GEMM that never writes the full-precision weight.

A program owns a (BLOCK_N weight rows) x (BLOCK_M tokens) output tile and walks K in tiles of
BLOCK_K: it loads the tile's packed words, decodes them in registers with the decoders of
:mod:`dynaquant.kernels.triton_linear` (no ``I2F``), multiplies each word's codes by its group's
scale in float32, rounds once to the activations' dtype and accumulates ``W_tile @ X_tile^T`` on the
tensor cores into one float32 accumulator (``tl.dot`` with ``acc``; on Hopper Triton issues
``wgmma``). The weight values entering the product are therefore exactly those of
dequantize-then-cuBLAS (``round((code - zero) * scale)``); only the float32 summation order differs.
Programs run with the token tile fastest, so the programs sharing a weight tile run together and its
bytes come from L2 after the first. NVFP4's global scale is applied to the float32 result.

Variants (``LaunchConfig`` options, off by default): ``xa`` swaps the operands (``acc (BLOCK_M, BLOCK_N) +=
X_tile @ W_tile^T``: the decoded weight tile is the dot's B, in shared memory on Hopper); ``post_scale`` (K tiles
inside one group) multiplies exact codes and applies the group's scale to the tile's float32 product;
``warp_spec`` asks Triton to warp-specialize the K loop; ``max_regs`` caps the registers (``maxnreg``).

Imported lazily, like :mod:`dynaquant.kernels.triton_linear` (``TRITON_INTERPRET=1`` first for CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynaquant.kernels.packing import PackedWeight
from dynaquant.kernels.triton_linear import (
    FP4_UP,
    MAGIC,
    _il8,
    call_buffers,
    code_value,
    format_constants,
    group_scale,
    hi_source,
    interpreting,
    out_multiplier,
    tile_values,
)
from dynaquant.kernels.tuning import LaunchConfig


@triton.jit
def _scaled(w, hsrc, zoff, sc, magic, IDX: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """Code IDX of the words times its word's scale, rounded once to DT (FP4 lifted to e2m1 first: a
    scale times 2**126 could overflow)."""
    v = code_value(w, hsrc, zoff, magic, IDX, KIND, BITS)
    if KIND != 0:
        v = v * FP4_UP
    return (v * sc).to(DT)


@triton.jit
def scaled_tile(w, hsrc, zoff, sc, magic, KIND: tl.constexpr, BITS: tl.constexpr, EPW: tl.constexpr,
                DT: tl.constexpr):
    """Words [R, W] with per-word scales ``sc`` (and zero offsets ``zoff``) -> weights [R, W * EPW] in
    natural K order, ``round_DT((code - zero) * scale)``."""
    if EPW == 4:
        v0 = _scaled(w, hsrc, zoff, sc, magic, 0, KIND, BITS, DT)
        v1 = _scaled(w, hsrc, zoff, sc, magic, 1, KIND, BITS, DT)
        v2 = _scaled(w, hsrc, zoff, sc, magic, 2, KIND, BITS, DT)
        v3 = _scaled(w, hsrc, zoff, sc, magic, 3, KIND, BITS, DT)
        out = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))
    elif EPW == 8:
        out = _il8(_scaled(w, hsrc, zoff, sc, magic, 0, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 1, KIND, BITS, DT),
                   _scaled(w, hsrc, zoff, sc, magic, 2, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 3, KIND, BITS, DT),
                   _scaled(w, hsrc, zoff, sc, magic, 4, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 5, KIND, BITS, DT),
                   _scaled(w, hsrc, zoff, sc, magic, 6, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 7, KIND, BITS, DT))
    else:
        ev = _il8(_scaled(w, hsrc, zoff, sc, magic, 0, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 2, KIND, BITS, DT),
                  _scaled(w, hsrc, zoff, sc, magic, 4, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 6, KIND, BITS, DT),
                  _scaled(w, hsrc, zoff, sc, magic, 8, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 10, KIND, BITS, DT),
                  _scaled(w, hsrc, zoff, sc, magic, 12, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 14, KIND, BITS, DT))
        od = _il8(_scaled(w, hsrc, zoff, sc, magic, 1, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 3, KIND, BITS, DT),
                  _scaled(w, hsrc, zoff, sc, magic, 5, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 7, KIND, BITS, DT),
                  _scaled(w, hsrc, zoff, sc, magic, 9, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 11, KIND, BITS, DT),
                  _scaled(w, hsrc, zoff, sc, magic, 13, KIND, BITS, DT), _scaled(w, hsrc, zoff, sc, magic, 15, KIND, BITS, DT))
        out = tl.interleave(ev, od)
    return out


@triton.jit
def tile_words(qw_ptr, qh_ptr, s_ptr, row, rw, t, KW, KH, NG, KIND: tl.constexpr, BITS: tl.constexpr,
               KWT: tl.constexpr, WPG: tl.constexpr, ONE_GROUP: tl.constexpr):
    """K tile ``t``'s packed words ``w`` [R, KWT] of rows ``row`` [R, 1] (``rw``: ``arange(KWT)``), the offsets
    ``goff`` of their groups' scales and zeros ([R, 1] where the tile lies in one group, else [R, KWT]), the float32
    scales and the high-bit source (:func:`hi_source`). Shared by the Triton and Gluon GEMMs."""
    word = t * KWT + rw
    w = tl.load(qw_ptr + row * KW + word[None, :])
    if ONE_GROUP:
        goff = row * NG + (t * KWT) // WPG
    else:
        goff = row * NG + (word // WPG)[None, :]
    sc = group_scale(tl.load(s_ptr + goff), KIND)
    return w, goff, sc, hi_source(w, qh_ptr, row, KH, word, BITS)


@triton.jit
def store_tile(out, ym, yn, tile, pid_k, M, N, b_ptr, y_ptr, ws_ptr, cnt_ptr, stride_ym, HAS_BIAS: tl.constexpr,
               SPLIT_K: tl.constexpr):
    """Store a program's float32 output tile ``out`` at rows ``ym`` / columns ``yn`` of ``y`` (broadcast index
    tensors in ``out``'s orientation), bias added, in y's dtype. With a K split the tile's partials go to the
    float32 workspace and the last program of output tile ``tile`` adds them up (its counter reset for the next
    call). Shared by the Triton and Gluon GEMMs."""
    mask = (ym < M) & (yn < N)
    if SPLIT_K > 1:
        part = ws_ptr + ym * N + yn
        tl.store(part + pid_k * M * N, out, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            out = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")  # (no zeros_like: Gluon wants a layout)
            for s in range(1, SPLIT_K):
                out += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            if HAS_BIAS:
                out += tl.load(b_ptr + yn, mask=yn < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + ym * stride_ym + yn, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + yn, mask=yn < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + ym * stride_ym + yn, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, qw_ptr, qh_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                 M, N, KW, KH, NG, stride_xm, stride_ym, out_mul, magic, NKT, NKT_C: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, ZC: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, XA: tl.constexpr = False, POST: tl.constexpr = False,
                 WS: tl.constexpr = False):
    EPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WPG: tl.constexpr = G // EPW  # words a group
    KWT: tl.constexpr = BLOCK_K // EPW  # words a K tile
    ONE_GROUP: tl.constexpr = KWT <= WPG  # the tile lies inside one group: one scale (and zero) a row
    DT: tl.constexpr = tl.float32 if DOT_F32 else x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)  # fastest: the programs of one weight tile run together
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(rn, N - 1)[:, None]
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if XA:  # tokens as the dot's A operand: x [BLOCK_M, BLOCK_K], the decoded weight tile transposed as B
        xrow = x_ptr + tl.minimum(rm, M - 1)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # the weight tile as A, x^T [BLOCK_K, BLOCK_M] as B
        xrow = x_ptr + tl.minimum(rm, M - 1)[None, :] * stride_xm + tl.arange(0, BLOCK_K)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    rw = tl.arange(0, KWT)
    nkt = NKT_C if NKT_C > 0 else NKT
    t0 = pid_k * nkt
    for t in tl.range(t0, t0 + nkt, warp_specialize=WS):  # pipelined by the launch's num_stages
        w, goff, sc, hsrc = tile_words(qw_ptr, qh_ptr, s_ptr, row, rw, t, KW, KH, NG, KIND, BITS, KWT, WPG, ONE_GROUP)
        if ASYM:
            zoff = tl.load(z_ptr + goff).to(tl.float32)
        else:
            zoff = ZC
        if POST:  # exact codes (one group a tile): the scale multiplies the tile's float32 product
            wt = tile_values(w, hsrc, zoff, magic, KIND, BITS, EPW, DT)  # [BLOCK_N, BLOCK_K]
        else:
            wt = scaled_tile(w, hsrc, zoff, sc, magic, KIND, BITS, EPW, DT)  # [BLOCK_N, BLOCK_K]
        xt = tl.load(xrow + t * BLOCK_K).to(DT)
        if XA:
            if POST:
                acc += tl.dot(xt, tl.trans(wt)) * tl.trans(sc)
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
        else:
            if POST:
                acc += tl.dot(wt, xt) * sc
            else:
                acc = tl.dot(wt, xt, acc)
    out = acc * out_mul
    if XA:  # offsets and masks in the accumulator's orientation
        ym = rm[:, None]
        yn = rn[None, :]
    else:
        ym = rm[None, :]
        yn = rn[:, None]
    store_tile(out, ym, yn, pid_m * tl.cdiv(N, BLOCK_N) + pid_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, cnt_ptr, stride_ym,
               HAS_BIAS, SPLIT_K)


def _launch_args(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig):
    m, k = x2.shape
    n = packed.out_features
    split = cfg.split_k
    kw, kh, ng, y, ws, qh, z, b = call_buffers(x2, packed, bias, split)
    nkt = k // cfg.block_k // split
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    args = (x2, packed.qweight, qh, packed.scales, z, b, y, ws, packed.counters, m, n, kw, kh, ng, x2.stride(0),
            y.stride(0), out_multiplier(packed, False), MAGIC, nkt)
    kwargs = dict(NKT_C=nkt if interpreting() else 0, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, DOT_F32=interpreting(), XA=cfg.xa,
                  POST=cfg.post_scale, WS=cfg.warp_spec, **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **format_constants(packed))
    return grid, args, kwargs, y


def run_gemm(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> torch.Tensor:
    """``x2 (M, K) @ dequant(W).T + bias`` on the fused GEMM path (``cfg.path == "gemm"``; no super weights; the
    ``cfg.gluon`` kernel is :func:`dynaquant.kernels.gluon_gemm.run_gluon_gemm`)."""
    grid, args, kwargs, y = _launch_args(x2, packed, bias, cfg)
    _gemm_kernel[grid](*args, **kwargs)
    return y


def compile_gemm(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> None:
    """Compile (without running) the kernel :func:`run_gemm` would launch."""
    grid, args, kwargs, _ = _launch_args(x2, packed, bias, cfg)
    _gemm_kernel.warmup(*args, grid=grid, **kwargs)
