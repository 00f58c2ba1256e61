"""GPTQ's column loop over one block in one Triton launch: the fast path ``gptq.round_block`` of
:func:`dynaquant.quant.gptq.round_block_torch` (same arguments with a :class:`ColumnGrid` or :class:`LevelGrid`,
same results).

A program owns ``BLOCK_R`` rows of the batch ``w1`` (N, B) and holds them in registers, (BLOCK_R, BW) with ``BW`` the
next power of two of B; for each of the block's columns in processing order it takes the column out of the tile,
rounds it to the column's linear grid (``q = clamp(round((x + ml) * iv))`` or ``clamp(round(x * iv))``, ties to even
by :func:`.kquant_triton.round_clamp`; a :class:`LevelGrid`: ``t = x / safe`` rounded and clamped, or the count of
the level table's midpoints ``<= t``, and the zero code where the scale is 0), computes the value (``dl * q - ml``,
``dl * q`` or ``dl * levels[code]``) and the scaled error
``(x - value) / U_tt``, and subtracts ``error * U[t, later columns]`` from the tile; at the end the tile (the later
columns updated) is written back. Torch's loop launches ~20 kernels a column; this is one a block. The float
operations are the loop's, element for element (launched with ``enable_fp_fusion=False``: no multiply-add
contraction, as the reference's separate kernels), so the results are equal bit for bit under the interpreter and
differ natively only where torch's own ``addr_`` contracts. Rows are independent (GPTQ is row-parallel).
Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynaquant.kernels.kquant_triton import round_clamp
from dynaquant.quant.codecs.base import ColumnGrid, LevelGrid

__all__ = ["round_block"]

_OPTS = {"num_warps": 4, "enable_fp_fusion": False}
_TILE = 4096  # float32 values of w1 a program holds: BLOCK_R * BW (32 a thread with 4 warps)


@triton.jit(do_not_specialize=["N", "B", "start", "M", "su0", "su1", "sdl"])
def _round_block_kernel(w_ptr, u_ptr, dl_ptr, ml_ptr, iv_ptr, lv_ptr, mid_ptr, loc_ptr, c_ptr, v_ptr, e_ptr, N, B, start,
                        M, su0, su1, sdl, QLO: tl.constexpr, QHI: tl.constexpr, MODE: tl.constexpr, NL: tl.constexpr,
                        ZC: tl.constexpr, BLOCK_R: tl.constexpr, BW: tl.constexpr):
    # MODE 0: ColumnGrid affine (ml), 1: ColumnGrid symmetric, 2: LevelGrid linear, 3: LevelGrid table of NL levels.
    # iv_ptr holds 1 / dl (ColumnGrid) or the safe divisor (LevelGrid); sdl: a column's stride in dl / iv / ml.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < N
    cols = tl.arange(0, BW)
    cmask = cols < B
    tile = rows[:, None] * B + cols[None, :]
    tmask = rmask[:, None] & cmask[None, :]
    w = tl.load(w_ptr + tile, mask=tmask, other=0.0)
    for t in range(0, M):
        i = start + t
        # the column, exactly (-0.0 is the identity of a float sum, so a -0.0 weight stays -0.0)
        x = tl.sum(tl.where(cols[None, :] == i, w, -0.0), axis=1)
        j = tl.load(loc_ptr + t).to(tl.int64)
        dl = tl.load(dl_ptr + j * sdl + rows, mask=rmask, other=0.0)
        iv = tl.load(iv_ptr + j * sdl + rows, mask=rmask, other=1.0)
        if MODE == 0:
            ml = tl.load(ml_ptr + j * sdl + rows, mask=rmask, other=0.0)
            q = round_clamp((x + ml) * iv, QLO, QHI)
            v = dl * q - ml
            code = q
        elif MODE == 1:
            q = round_clamp(x * iv, QLO, QHI)
            v = dl * q
            code = q - QLO
        else:
            t_ = tl.math.div_rn(x, iv)  # IEEE division, as torch's x / safe
            if MODE == 2:
                c_ = (round_clamp(t_, QLO, QHI) - QLO).to(tl.int32)
            else:
                c_ = tl.zeros([BLOCK_R], dtype=tl.int32)
                for k in tl.static_range(NL - 1):
                    c_ += (t_ >= tl.load(mid_ptr + k)).to(tl.int32)
            c_ = tl.where(dl == 0, ZC, c_)
            v = dl * tl.load(lv_ptr + c_)
            code = c_
        e = (x - v) / tl.load(u_ptr + i * su0 + i * su1)
        urow = tl.load(u_ptr + i * su0 + cols * su1, mask=cmask & (cols > i), other=0.0)
        w = tl.where((cols > i)[None, :], w - e[:, None] * urow[None, :], w)
        out = rows * M + t
        tl.store(c_ptr + out, code.to(tl.int64), mask=rmask)
        tl.store(v_ptr + out, v, mask=rmask)
        tl.store(e_ptr + out, e, mask=rmask)
    tl.store(w_ptr + tile, w, mask=tmask)


def round_block(w1: torch.Tensor, u1: torch.Tensor, rnd: ColumnGrid | LevelGrid, i: int, local: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dynaquant.quant.gptq.round_block_torch` in one launch (module docstring).

    Raises:
        TypeError: ``rnd`` is not a :class:`ColumnGrid` or :class:`LevelGrid`.
        ValueError: ``w1`` is not a contiguous (N, B) float32 tensor, ``u1`` not (B, B) float32 (any strides), or
            the columns run past B.
    """
    if not isinstance(rnd, ColumnGrid | LevelGrid):
        raise TypeError(f"gptq.round_block takes a ColumnGrid or LevelGrid, got {type(rnd).__name__}")
    n, b = w1.shape
    m = len(local)
    if w1.dtype != torch.float32 or not w1.is_contiguous() or u1.shape != (b, b) or u1.dtype != torch.float32 \
            or not 0 <= i <= b - m:
        raise ValueError(f"gptq.round_block: w1 {tuple(w1.shape)} {w1.dtype}, u1 {tuple(u1.shape)} {u1.dtype} "
                         f"strides {u1.stride()}, columns {i}..{i + m - 1}")
    dev = w1.device
    loc = torch.tensor(local, dtype=torch.int32, device=dev)
    codes = torch.empty(n, m, dtype=torch.int64, device=dev)
    values = torch.empty(n, m, dtype=torch.float32, device=dev)
    errors = torch.empty(n, m, dtype=torch.float32, device=dev)
    bw = triton.next_power_of_2(b)
    block_r = max(1, min(64, _TILE // bw))
    if isinstance(rnd, ColumnGrid):
        mode, ml, iv, lv, mids = 0 if rnd.ml is not None else 1, rnd.ml, rnd.iv, None, None
        nl, zc, qlo, qhi = 1, 0, rnd.qlo, rnd.qhi
    else:
        mode, ml, iv, lv, mids = 2 if rnd.linear else 3, None, rnd.safe, rnd.levels, rnd.mids
        nl, zc, qlo, qhi = rnd.levels.numel(), rnd.zero_code, rnd.lo, rnd.hi
    sdl = 0 if rnd.dl.ndim == 1 else n
    _round_block_kernel[(triton.cdiv(n, block_r),)](
        w1, u1, rnd.dl, rnd.dl if ml is None else ml, iv, rnd.dl if lv is None else lv, rnd.dl if mids is None else mids,
        loc, codes, values, errors, n, b, i, m, u1.stride(0), u1.stride(1), sdl,
        QLO=float(qlo), QHI=float(qhi), MODE=mode, NL=nl, ZC=zc, BLOCK_R=block_r, BW=bw, **_OPTS)
    return codes, values, errors
