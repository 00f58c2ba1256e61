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
from dynaquant.quant.codecs.consts import device_constant

__all__ = ["fit_scale", "encode_scale", "fit_affine", "fit_int_zero", "supported"]

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
def _half(v):
    """``to_half``: clamped to the finite fp16 range, rounded to fp16 (nearest even), back to float32."""
    return tl.minimum(tl.maximum(v, -65504.0), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def _ls_score(q, w, wx):
    """Levels ``q`` per block: the least-squares score ``Sqx**2 / Sqq`` (-1 where ``Sqq`` is 0), the scale
    ``Sqx / Sqq`` (``Sqx`` where ``Sqq`` is 0) and whether ``Sqq > 0``."""
    sqx = tl.sum(q * wx, 1)
    sq2 = tl.sum((q * q) * w, 1)
    pos = sq2 > 0
    den = tl.where(pos, sq2, 1.0)
    return tl.where(pos, sqx * sqx / den, -1.0), sqx / den, pos


@triton.jit
def _score(inv, x, w, wx, best_s, best_d, vlut_ptr, LINEAR: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
           KMIN: tl.constexpr, KMAX: tl.constexpr):
    """One candidate inverse scale per block: its codes' least-squares score ``Sqx**2 / Sqq`` and scale
    ``Sqx / Sqq``, kept where the score is higher."""
    s, d, _ = _ls_score(_value(x * inv[:, None], vlut_ptr, LINEAR, LO, HI, KMIN, KMAX), w, wx)
    take = s > best_s
    return tl.where(take, s, best_s), tl.where(take, d, best_d)


@triton.jit
def _consider(d, x, w, best_err, best_df, vlut_ptr, LINEAR: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
              KMIN: tl.constexpr, KMAX: tl.constexpr):
    """The exact stage's step: ``d`` rounded to fp16 as stored, the nearest levels under it, the error on the
    decoder's ``d * level``; kept where lower. Returns the levels and the running best."""
    df = _half(d)
    q = _value(x / tl.where(df == 0, 1.0, df)[:, None], vlut_ptr, LINEAR, LO, HI, KMIN, KMAX)
    r = x - df[:, None] * q
    err = tl.sum(w * (r * r), 1)
    take = err < best_err
    return q, tl.where(take, err, best_err), tl.where(take, df, best_df)


@triton.jit(do_not_specialize=["B", "NT", "NA", "NU"])
def fit_scale_kernel(x_ptr, w_ptr, tgt_ptr, off_ptr, ulp_ptr, lv_ptr, vlut_ptr, clut_ptr, d_ptr, code_ptr,
                     B, NT, NA, NU, NLEV: tl.constexpr, AMAX: tl.constexpr, ZERO: tl.constexpr, LINEAR: tl.constexpr,
                     LO: tl.constexpr, HI: tl.constexpr, KMIN: tl.constexpr, KMAX: tl.constexpr,
                     LLOYD: tl.constexpr, N: tl.constexpr, BLOCK_B: tl.constexpr, REC: tl.constexpr = 0,
                     COFF: tl.constexpr = 0, RB: tl.constexpr = 0):
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
    if REC == 0:
        tl.store(d_ptr + rows, best_df.to(tl.float16), mask=rmask)
        tl.store(code_ptr + offs, codes.to(tl.int64), mask=rmask[:, None])
    else:
        _write_record(code_ptr, rows, rmask, cols, best_df, codes + COFF, REC, N, RB)


@triton.jit
def _write_record(out_ptr, rows, rmask, cols, df, c, REC: tl.constexpr, N: tl.constexpr, RB: tl.constexpr):
    """Block records (:func:`dynaquant.quant.codecs._records.pack_record`, ``scale_bytes`` 2, one block a record):
    the fp16 ``d`` little-endian, then the stored codes ``c`` (int32, (B, N)) as ``i8`` (REC 1), ``nibbles`` (2) or
    ``q5`` (3)."""
    base = out_ptr + rows * RB
    bits = df.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(base, (bits & 255).to(tl.uint8), mask=rmask)
    tl.store(base + 1, ((bits >> 8) & 255).to(tl.uint8), mask=rmask)
    if REC == 1:
        tl.store(base[:, None] + 2 + cols[None, :], (c & 255).to(tl.uint8), mask=rmask[:, None])
    else:
        q0 = 2
        if REC == 3:  # qh: bit j of the little-endian word = bit 4 of c[j]
            qh = tl.sum(((c >> 4) & 1).to(tl.int64) << cols[None, :].to(tl.int64), 1)
            for k in tl.static_range(N // 8):
                tl.store(base + 2 + k, ((qh >> (8 * k)) & 255).to(tl.uint8), mask=rmask)
            q0 = 2 + N // 8
        lo, hi = tl.split(tl.permute(tl.reshape(c & 15, (c.shape[0], 2, N // 2)), (0, 2, 1)))
        half = tl.arange(0, N // 2)
        tl.store(base[:, None] + q0 + half[None, :], (lo | (hi << 4)).to(tl.uint8), mask=rmask[:, None])


@triton.jit
def _aff_score(inv, off, x, w, wx, swd, swxd, eps, best_g, best_d, best_m, NMAX: tl.constexpr):
    """One affine candidate (inverse step, offset) per block: its codes' float64 least-squares gain and (d, m),
    kept where the gain is higher (:func:`fit_affine_torch`'s candidate loop)."""
    q = round_clamp(x * inv[:, None] - off[:, None], 0.0, NMAX)
    s1 = tl.sum(q * w, 1).to(tl.float64)
    sqx = tl.sum(q * wx, 1).to(tl.float64)
    sqq = tl.sum((q * q) * w, 1).to(tl.float64)
    det = swd * sqq - s1 * s1
    ok = det > (eps * swd) * sqq
    det = tl.where(ok, det, 1.0)
    g = tl.where(ok, ((swd * sqx) * sqx - ((2.0 * s1) * sqx) * swxd + (sqq * swxd) * swxd) / det, -1.0)
    take = g > best_g
    d = ((swd * sqx - s1 * swxd) / det).to(tl.float32)
    m = ((sqq * swxd - s1 * sqx) / det).to(tl.float32)
    return tl.where(take, g, best_g), tl.where(take, d, best_d), tl.where(take, m, best_m)


@triton.jit
def _aff_codes(x, df, mf, NMAX: tl.constexpr):
    """The nearest codes ``0 .. NMAX`` of ``d * code + m`` for (B,) ``df``, ``mf`` (``affine_codes`` before its
    ``d == 0`` case)."""
    return round_clamp((x - mf[:, None]) / tl.where(df == 0, 1.0, df)[:, None], 0.0, NMAX)


@triton.jit
def _aff_consider(d, q, x, w, sw, swx, best_err, best_d, best_m, NMAX: tl.constexpr):
    """:func:`polish_affine`'s step: ``d`` to fp16, ``m`` refit under it with codes ``q`` and rounded, the codes
    re-rounded under the stored pair, the error on ``d * code + m``; kept where lower."""
    df = _half(d)
    mf = _half((swx - df * tl.sum(w * q, 1)) / sw)
    r = x - (df[:, None] * _aff_codes(x, df, mf, NMAX) + mf[:, None])
    err = tl.sum(w * (r * r), 1)
    take = err < best_err
    return tl.where(take, err, best_err), tl.where(take, df, best_d), tl.where(take, mf, best_m)


@triton.jit(do_not_specialize=["B", "NS"])
def fit_affine_kernel(x_ptr, w_ptr, steps_ptr, eps_ptr, d_ptr, m_ptr, code_ptr, B, NS, NMAX: tl.constexpr,
                      ANCHOR: tl.constexpr, LLOYD: tl.constexpr, N: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    rmask = rows < B
    cols = tl.arange(0, N)
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0)
    w = tl.load(w_ptr + offs, mask=rmask[:, None], other=0.0)
    eps = tl.load(eps_ptr)
    xmin = tl.min(x, 1)
    xmax = tl.max(x, 1)
    wx = w * x
    sw = tl.sum(w, 1)
    swx = tl.sum(wx, 1)
    rng = xmax - xmin
    srng = tl.where(rng == 0, 1.0, rng)
    swd = sw.to(tl.float64)
    swxd = swx.to(tl.float64)
    best_g = tl.full((BLOCK_B,), -1.0, tl.float64)
    best_d = tl.zeros((BLOCK_B,), tl.float32)
    best_m = tl.zeros((BLOCK_B,), tl.float32)
    for c in range(NS):  # the grid anchored at the block's min
        inv = tl.load(steps_ptr + c) / srng
        best_g, best_d, best_m = _aff_score(inv, xmin * inv, x, w, wx, swd, swxd, eps, best_g, best_d, best_m, NMAX)
    for c in range(NS):  # at its max
        inv = tl.load(steps_ptr + c) / srng
        best_g, best_d, best_m = _aff_score(inv, xmax * inv - NMAX, x, w, wx, swd, swxd, eps, best_g, best_d, best_m,
                                            NMAX)
    if ANCHOR:  # at its most important weight (the first largest w)
        xa = _at(x, _first_argmax(w, cols, N), cols)
        for c in range(NS):
            inv = tl.load(steps_ptr + c) / srng
            off = xa * inv - round_clamp((xa - xmin) * inv, -4194304.0, 4194304.0)
            best_g, best_d, best_m = _aff_score(inv, off, x, w, wx, swd, swxd, eps, best_g, best_d, best_m, NMAX)
    # exact stage: the constant block at the weighted mean first
    m0 = _half(swx / sw)
    r0 = x - m0[:, None]
    best_err = tl.sum(w * (r0 * r0), 1)
    bd = tl.zeros((BLOCK_B,), tl.float32)
    bm = m0
    q = _aff_codes(x, _half(best_d), best_m, NMAX)  # (the least-squares m itself, not yet rounded)
    best_err, bd, bm = _aff_consider(best_d, q, x, w, sw, swx, best_err, bd, bm, NMAX)
    for _ in tl.static_range(LLOYD):
        q = _aff_codes(x, bd, bm, NMAX)
        wq = w * q
        swq = tl.sum(wq, 1)
        swq2 = tl.sum(wq * q, 1)
        swqx = tl.sum(wq * x, 1)
        det = sw * swq2 - swq * swq
        ok = det > (1e-6 * sw) * swq2
        d = tl.where(ok, (sw * swqx - swq * swx) / tl.where(ok, det, 1.0), bd)
        best_err, bd, bm = _aff_consider(d, q, x, w, sw, swx, best_err, bd, bm, NMAX)
    codes = tl.where(bd[:, None] == 0, 0.0, _aff_codes(x, bd, bm, NMAX))
    tl.store(d_ptr + rows, bd.to(tl.float16), mask=rmask)
    tl.store(m_ptr + rows, bm.to(tl.float16), mask=rmask)
    tl.store(code_ptr + offs, codes.to(tl.int64), mask=rmask[:, None])


@triton.jit
def _zero_score(d, z, x, w, wx, best_s, ls_d, ls_z, NMAX: tl.constexpr):
    """One (step, zero) candidate of :func:`fit_int_zero_torch`: the least-squares score of its levels, kept where
    higher."""
    sd = tl.where(d == 0, 1.0, d)
    s, d_ls, pos = _ls_score(round_clamp(x * (1.0 / sd)[:, None], -z[:, None], (NMAX - z)[:, None]), w, wx)
    take = s > best_s
    return tl.where(take, s, best_s), tl.where(take, tl.where(pos, d_ls, d), ls_d), tl.where(take, z, ls_z)


@triton.jit
def _zero_consider(d, z, x, w, best_err, best_d, best_z, NMAX: tl.constexpr):
    """:func:`fit_int_zero_torch`'s exact step: ``d`` (>= 0) to fp16, the codes under it and the zero ``z``, the
    error on ``d * (code - z)``; kept where lower (and ``d > 0``)."""
    df = _half(tl.maximum(d, 0.0))
    lv = round_clamp(x / tl.where(df == 0, 1.0, df)[:, None], -z[:, None], (NMAX - z)[:, None])
    r = x - df[:, None] * lv
    err = tl.sum(w * (r * r), 1)
    take = (err < best_err) & (df > 0)
    return tl.where(take, err, best_err), tl.where(take, df, best_d), tl.where(take, z, best_z)


@triton.jit(do_not_specialize=["B", "NF"])
def fit_int_zero_kernel(x_ptr, w_ptr, fac_ptr, d_ptr, z_ptr, B, NF, NMAX: tl.constexpr, LLOYD: tl.constexpr,
                        N: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    rmask = rows < B
    offs = rows[:, None] * N + tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0)
    w = tl.load(w_ptr + offs, mask=rmask[:, None], other=0.0)
    xmin = tl.minimum(tl.min(x, 1), 0.0)
    xmax = tl.maximum(tl.max(x, 1), 0.0)
    wx = w * x
    best_s = tl.full((BLOCK_B,), -1.0, tl.float32)
    ls_d = tl.zeros((BLOCK_B,), tl.float32)
    ls_z = tl.zeros((BLOCK_B,), tl.float32)
    for c in range(NF):  # zero points putting the min on a level
        d = (xmax - xmin) * tl.load(fac_ptr + c)
        z = round_clamp(-xmin / tl.where(d == 0, 1.0, d), 0.0, NMAX)
        best_s, ls_d, ls_z = _zero_score(d, z, x, w, wx, best_s, ls_d, ls_z, NMAX)
    for c in range(NF):  # the max
        d = (xmax - xmin) * tl.load(fac_ptr + c)
        z = tl.minimum(tl.maximum(NMAX - round_clamp(xmax / tl.where(d == 0, 1.0, d), -1.0, NMAX + 1.0), 0.0), NMAX)
        best_s, ls_d, ls_z = _zero_score(d, z, x, w, wx, best_s, ls_d, ls_z, NMAX)
    best_err = tl.sum(wx * x, 1)
    bd = tl.zeros((BLOCK_B,), tl.float32)
    bz = tl.zeros((BLOCK_B,), tl.float32)
    best_err, bd, bz = _zero_consider(ls_d, ls_z, x, w, best_err, bd, bz, NMAX)
    for _ in tl.static_range(LLOYD):
        d0 = bd
        z0 = bz
        sd0 = tl.where(d0 == 0, 1.0, d0)
        for k in tl.static_range(3):  # the zero, then its neighbours below and above
            z = tl.minimum(tl.maximum(z0 + (k // 2 - k % 2), 0.0), NMAX)  # dz = 0, -1, 1
            q = round_clamp(x / sd0[:, None], -z[:, None], (NMAX - z)[:, None])
            wq = w * q
            s2 = tl.sum(wq * q, 1)
            d = tl.where(s2 > 0, tl.sum(wq * x, 1) / tl.where(s2 > 0, s2, 1.0), d0)
            best_err, bd, bz = _zero_consider(d, z, x, w, best_err, bd, bz, NMAX)
    tl.store(d_ptr + rows, bd.to(tl.float16), mask=rmask)
    tl.store(z_ptr + rows, bz.to(tl.int64), mask=rmask)


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


def _blocks_ok(x: torch.Tensor) -> bool:
    """(B, n) blocks with ``n`` a power of two up to 256 (a program's tile)."""
    n = x.shape[-1] if x.ndim == 2 else 0
    return 0 < n <= _MAX_N and n & (n - 1) == 0


def _inputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``x``, ``w`` as contiguous float32 on ``x``'s device, and the blocks a program takes."""
    xc = x.to(torch.float32).contiguous()
    return xc, w.to(device=x.device, dtype=torch.float32).contiguous(), _TILE // x.shape[1]


def supported(x: torch.Tensor, grid: bf.Grid) -> bool:
    """Whether the kernel runs this search: (B, n) blocks with ``n`` a power of two up to 256, on a linear or
    half-integer-midpoint grid."""
    return _blocks_ok(x) and (grid.linear or grid.half_int)


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
    d = torch.empty(b, dtype=torch.float16, device=x.device)
    codes = torch.empty(b, n, dtype=torch.int64, device=x.device)
    _launch_scale(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps, d, codes)
    return d, codes


def _launch_scale(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps, d, out, rec: int = 0, coff: int = 0) -> None:
    """One :data:`fit_scale_kernel` launch over the (B, n) blocks of ``x``: ``d`` and int64 codes ``out`` (``rec``
    0), or the block records into ``out`` (``rec`` > 0, codes offset by ``coff``; ``d`` unused)."""
    b, n = x.shape
    if b == 0:
        return
    xc, wc, block = _inputs(x, w)
    tgt, off, ulp, lv, vlut, clut = _tables(grid, targets, anchor_offsets, ulps, x.device)
    kmin, kmax = (grid.kmin, grid.kmax) if grid.half_int and not grid.linear else (0, 0)
    fit_scale_kernel[(triton.cdiv(b, block),)](
        xc, wc, tgt, off, ulp, lv, vlut, clut, d, out, b, len(targets), len(anchor_offsets), len(ulps),
        NLEV=len(grid.levels), AMAX=float(max(abs(grid.lo), abs(grid.hi))), ZERO=grid.zero_code(),
        LINEAR=grid.linear, LO=float(grid.lo), HI=float(grid.hi), KMIN=float(kmin), KMAX=float(kmax),
        LLOYD=int(lloyd_steps), N=n, BLOCK_B=block, REC=rec, COFF=coff, RB=out.shape[1] if rec else 0, **_OPTS)


_RECORD_KINDS = {"i8": 1, "nibbles": 2, "q5": 3}


def encode_scale(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: bf.Grid,
    targets: Sequence[float],
    anchor_offsets: Sequence[int],
    lloyd_steps: int,
    ulps: Sequence[int],
    record,
) -> torch.Tensor:
    """:func:`dynaquant.quant.codecs._records.encode_scale_torch`, fused: :func:`fit_scale`'s search with the block
    records written by the kernel (no (B, n) int64 codes, no torch pack): x, w (B, n) float32 -> (B, record_bytes(n))
    uint8, byte for byte :func:`~dynaquant.quant.codecs._records.pack_record` of :func:`fit_scale`'s scale and codes.
    Records of one block with a 2-byte scale, codes ``"i8"``, ``"nibbles"`` or ``"q5"`` (n = 32) and no
    ``code_map`` (``Q8_0``, ``Q4_0``, ``Q5_0``, ``IQ4_NL``); other records pack :func:`fit_scale`'s results."""
    from dynaquant.quant.codecs._records import pack_record

    kind = _RECORD_KINDS.get(record.codes)
    if (kind is None or record.scale_bytes != 2 or record.sub_blocks != 1 or record.code_map is not None
            or (kind == 3 and x.shape[-1] != 32) or not supported(x, grid) or w.shape != x.shape):
        d, codes = fit_scale(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps)
        return pack_record(record, bf.half_bytes(d), codes)
    b, n = x.shape
    out = torch.empty(b, record.record_bytes(n), dtype=torch.uint8, device=x.device)
    _launch_scale(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps, out, out, kind, int(record.code_offset))
    return out


def fit_affine(
    x: torch.Tensor,
    w: torch.Tensor,
    nmax: int,
    steps: Sequence[float],
    n_anchor: int = 0,
    lloyd_steps: int = 1,
    ulps: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dynaquant.quant.codecs._blockfit.fit_affine_torch` (``Q4_1``, ``Q5_1``), fused as :func:`fit_scale`:
    the same arguments and results ((B,) float16 ``d`` and ``m``, (B, n) int64 codes). One anchor at most and no
    ``ulps`` (what the codecs use); other searches, and blocks the kernel does not take, go to the reference."""
    if not _blocks_ok(x) or w.shape != x.shape or n_anchor > 1 or ulps:
        return bf.fit_affine_torch(x, w, nmax, steps, n_anchor, lloyd_steps, ulps)
    b, n = x.shape
    xc, wc, block = _inputs(x, w)
    st = device_constant([nmax + float(v) for v in steps], torch.float32, x.device)
    eps = device_constant([1e-6], torch.float64, x.device)
    d = torch.empty(b, dtype=torch.float16, device=x.device)
    m = torch.empty(b, dtype=torch.float16, device=x.device)
    codes = torch.empty(b, n, dtype=torch.int64, device=x.device)
    if b:
        fit_affine_kernel[(triton.cdiv(b, block),)](xc, wc, st, eps, d, m, codes, b, len(steps), NMAX=float(nmax),
                                                    ANCHOR=n_anchor == 1, LLOYD=int(lloyd_steps), N=n, BLOCK_B=block,
                                                    **_OPTS)
    return d, m, codes


def fit_int_zero(x: torch.Tensor, w: torch.Tensor, nmax: int, factors: Sequence[float], lloyd_steps: int = 1,
                 ulps: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dynaquant.quant.codecs.runtime_int.fit_int_zero_torch` (the asymmetric ``INT{b}_G{g}_ASYM`` search),
    fused as :func:`fit_scale`: the same arguments and results ((B,) float16 ``d``, (B,) int64 ``z``). No ``ulps``
    (what the codecs use); other searches, and blocks the kernel does not take, go to the reference."""
    from dynaquant.quant.codecs import runtime_int

    if not _blocks_ok(x) or w.shape != x.shape or ulps:
        return runtime_int.fit_int_zero_torch(x, w, nmax, factors, lloyd_steps, ulps)
    b, n = x.shape
    xc, wc, block = _inputs(x, w)
    fac = device_constant([f / nmax for f in factors], torch.float32, x.device)
    d = torch.empty(b, dtype=torch.float16, device=x.device)
    z = torch.empty(b, dtype=torch.int64, device=x.device)
    if b:
        fit_int_zero_kernel[(triton.cdiv(b, block),)](xc, wc, fac, d, z, b, len(factors), NMAX=float(nmax),
                                                      LLOYD=int(lloyd_steps), N=n, BLOCK_B=block, **_OPTS)
    return d, z
