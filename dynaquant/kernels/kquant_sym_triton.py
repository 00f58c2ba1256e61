"""Triton kernels of the symmetric K-quant search's glue (Q3_K, Q6_K): what
:func:`dynaquant.quant.codecs._kquant_search.sym_encode_torch` does in torch between the fused steps, and the bytes
of :func:`dynaquant.quant.codecs.kquants.sym_bytes_torch` (launchers and checks in :mod:`dynaquant.kernels.kquant_sym`).

- :func:`sym_round_kernel`: a round's codes and their sums, the least-squares sub-block scales, and step 2's candidate
  ``d`` (grid, kept and least-squares ``d``; the clip steps apart), BLOCK_B super-blocks a program;
- :func:`sym_keep_kernel`: step 3's error per super-block and :func:`~dynaquant.quant.codecs._kquant_search.keep_best`;
- :func:`sym_bytes_kernel`: the nearest codes at decode's sub-block scales, packed as ``block_q3_K`` / ``block_q6_K``.

They replace torch's operations bit for bit on CUDA: the same float operations in the same order, IEEE divisions
(float32 ``div_rn``; float64 ``/`` is ``div.rn.f64``, as torch's), and every sum over 16 values in the order of
torch's CUDA reduction of a 16-long contiguous last axis (:func:`tree16`: ``0 + v`` a lane, then lanes 8, 4, 2, 1
apart added: the shuffle-down tree, offsets decreasing, of ``Reduce.cuh``'s ``block_x_reduce`` in recent torch).
Launch with ``enable_fp_fusion=False``. Importing this module imports Triton.
"""

import triton
import triton.language as tl

from dynaquant.kernels.kquant_triton import round_clamp

__all__ = ["tree16", "sym_round_kernel", "sym_keep_kernel", "sym_bytes_kernel"]

_F16_TINY = tl.constexpr(5.960464477539063e-08)  # 2**-24
_F16_MAX = tl.constexpr(65504.0)


@triton.jit
def _halve(v, N: tl.constexpr, H: tl.constexpr):
    """(N, 2 * H) -> (N, H): ``v[:, i] + v[:, H + i]``."""
    lo, hi = tl.split(tl.permute(tl.reshape(v, (N, 2, H)), (0, 2, 1)))
    return lo + hi


@triton.jit
def tree16(v, N: tl.constexpr):
    """Sums of the rows of ``v`` (N, 16) -> (N,) in torch's CUDA order (module docstring); float32 or float64."""
    v = v + 0.0  # each lane's accumulator starts at +0 (a -0 sum becomes +0, as torch's)
    v = _halve(v, N, 8)
    v = _halve(v, N, 4)
    v = _halve(v, N, 2)
    lo, hi = tl.split(v)
    return lo + hi


@triton.jit
def _inv_rn(b):
    """torch's ``inv``: ``1 / b`` (IEEE) where ``b != 0``, else 0."""
    nz = b != 0
    one = tl.full(b.shape, 1.0, b.dtype)
    return tl.where(nz, tl.math.div_rn(one, tl.where(nz, b, one)), 0.0)


@triton.jit
def _codes(v, QLO: tl.constexpr, QHI: tl.constexpr):
    """torch's ``v.round_().clamp_(QLO, QHI)`` (NaN stays NaN)."""
    return tl.where(v != v, v, round_clamp(v, QLO, QHI))


@triton.jit
def _f16_cand(v):
    """:func:`dynaquant.quant.codecs._kquant_search.f16_candidates` of float64 ``v`` -> float32."""
    v = v.to(tl.float32)
    tiny = (v != 0) & (tl.abs(v) < _F16_TINY)
    v = tl.where(tiny, tl.where(v > 0, _F16_TINY, -_F16_TINY), v)
    v = tl.minimum(tl.maximum(v, -_F16_MAX), _F16_MAX)
    return v.to(tl.float16).to(tl.float32)


@triton.jit(do_not_specialize=["B", "T", "TC", "C"])
def sym_round_kernel(
    x_ptr,
    w_ptr,
    a1_ptr,
    bd_ptr,
    bk_ptr,
    ts_ptr,
    tc_ptr,
    a_out,
    sqq_out,
    cand_ptr,
    candc_ptr,
    B,
    T,
    TC,
    C,
    FIRST: tl.constexpr,
    QLO: tl.constexpr,
    QHI: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One round of ``sym_encode_torch`` up to step 2: codes ``q`` at step 1's scales ``a1`` (R,) float64
    (``FIRST``) or at the kept configuration's ``bd * bk`` ((B,) float32, (R,) int64); ``a = Sxq / Sqq`` and ``Sqq``
    as float32 (R,) into ``a_out``, ``sqq_out``; the candidates ``+-am / ts`` (T each) then, unless ``FIRST``, the
    kept ``d`` and the least-squares ``d`` into ``cand`` (B, C); ``+-am / tc`` (TC each) into ``candc`` (B, 2 TC).
    x, w: (B * 16, 16) float32; 16 sub-blocks of 16."""
    pid = tl.program_id(0).to(tl.int64)
    sb = pid * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    bmask = sb < B
    cols = tl.arange(0, 16)
    offs = sb[:, None] * 16 + cols[None, :]  # (BLOCK_B, 16) sub-blocks
    m2 = bmask[:, None]
    offs3 = offs[:, :, None] * 16 + cols[None, None, :]
    m3 = bmask[:, None, None]
    x = tl.load(x_ptr + offs3, mask=m3, other=0.0)
    w = tl.load(w_ptr + offs3, mask=m3, other=0.0)
    if FIRST:
        dl = tl.load(a1_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    else:
        bd = tl.load(bd_ptr + sb, mask=bmask, other=0.0)
        bk = tl.load(bk_ptr + offs, mask=m2, other=0)
        dl = bd[:, None] * bk.to(tl.float32)
    q = _codes(x * _inv_rn(dl)[:, :, None], QLO, QHI)
    wx = w * x
    sxq = tl.reshape(tree16(tl.reshape(wx * q, (BLOCK_B * 16, 16)), BLOCK_B * 16), (BLOCK_B, 16))
    sqq = tl.reshape(tree16(tl.reshape(w * q * q, (BLOCK_B * 16, 16)), BLOCK_B * 16), (BLOCK_B, 16))
    sxq = sxq.to(tl.float64)
    sqq64 = sqq.to(tl.float64)
    nz = sqq64 != 0
    a = tl.where(nz, sxq / tl.where(nz, sqq64, 1.0), 0.0)
    tl.store(a_out + offs, a.to(tl.float32), mask=m2)
    tl.store(sqq_out + offs, sqq, mask=m2)
    # the signed largest sub-block scale (the first of the largest magnitude, as argmax)
    aa = tl.abs(a)
    big = tl.max(aa, 1)
    first = tl.min(tl.where(aa == big[:, None], cols[None, :], 16), 1)
    am = tl.max(tl.where(cols[None, :] == first[:, None], a, -float("inf")), 1)
    nam = -am
    for t in range(T):
        tv = tl.load(ts_ptr + t)
        tl.store(cand_ptr + sb * C + t, _f16_cand(am / tv), mask=bmask)
        tl.store(cand_ptr + sb * C + T + t, _f16_cand(nam / tv), mask=bmask)
    if not FIRST:
        kf = bk.to(tl.float64)
        num = tree16(kf * sxq, BLOCK_B)
        den = tree16(kf * kf * sqq64, BLOCK_B)
        dnz = den != 0
        d_ls = tl.where(dnz, num / tl.where(dnz, den, 1.0), 0.0)
        tl.store(cand_ptr + sb * C + 2 * T, _f16_cand(bd.to(tl.float64)), mask=bmask)
        tl.store(cand_ptr + sb * C + 2 * T + 1, _f16_cand(d_ls), mask=bmask)
    for t in range(TC):
        tv = tl.load(tc_ptr + t)
        tl.store(candc_ptr + sb * (2 * TC) + t, _f16_cand(am / tv), mask=bmask)
        tl.store(candc_ptr + sb * (2 * TC) + TC + t, _f16_cand(nam / tv), mask=bmask)


@triton.jit(do_not_specialize=["B"])
def sym_keep_kernel(err_ptr, d_ptr, k_ptr, bd_ptr, bk_ptr, be_ptr, B, FIRST: tl.constexpr, BLOCK_B: tl.constexpr):
    """``keep_best``: the configuration ``(d (B,) float32, k (R,) int64)`` with step 3's errors ``err`` (R,) float64,
    summed over a super-block's 16 sub-blocks, replaces the kept ``(bd, bk, be)`` where lower (always when
    ``FIRST``)."""
    pid = tl.program_id(0).to(tl.int64)
    sb = pid * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    bmask = sb < B
    offs = sb[:, None] * 16 + tl.arange(0, 16)[None, :]
    e = tree16(tl.load(err_ptr + offs, mask=bmask[:, None], other=0.0), BLOCK_B)
    if FIRST:
        take = bmask
    else:
        take = bmask & (e < tl.load(be_ptr + sb, mask=bmask, other=0.0))
    tl.store(be_ptr + sb, e, mask=take)
    tl.store(bd_ptr + sb, tl.load(d_ptr + sb, mask=take, other=0.0), mask=take)
    t2 = take[:, None]
    tl.store(bk_ptr + offs, tl.load(k_ptr + offs, mask=t2, other=0), mask=t2)


@triton.jit
def _code_at(x_ptr, k_ptr, d, sb, e, QLO: tl.constexpr, QHI: tl.constexpr, m):
    """The stored code (int32, ``q - QLO``) of elements ``e`` (BLOCK_B, n) of super-blocks ``sb`` (BLOCK_B,):
    ``round(x / (d k))`` clamped, as ``_block_codes``."""
    xv = tl.load(x_ptr + sb[:, None] * 256 + e, mask=m, other=0.0)
    kv = tl.load(k_ptr + sb[:, None] * 16 + e // 16, mask=m, other=0)
    dl = d[:, None] * kv.to(tl.float32)
    return (_codes(xv * _inv_rn(dl), QLO, QHI) - QLO).to(tl.int32)


@triton.jit(do_not_specialize=["B"])
def sym_bytes_kernel(x_ptr, d_ptr, k_ptr, out_ptr, B, Q6: tl.constexpr, TS: tl.constexpr, BLOCK_B: tl.constexpr):
    """The bytes of BLOCK_B super-blocks a program: x (B, 256) float32, d (B,) float32 (float16 values), k (B, 16)
    int64 -> out (B, 110) (Q3_K) or (B, 210) (``Q6``) uint8, the layouts of ``Q3_K.pack`` / ``Q6_K.pack``."""
    pid = tl.program_id(0).to(tl.int64)
    sb = pid * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    bmask = sb < B
    m = bmask[:, None]
    d = tl.load(d_ptr + sb, mask=bmask, other=0.0)
    j16 = tl.arange(0, 16)[None, :]
    k = tl.load(k_ptr + sb[:, None] * 16 + j16, mask=m, other=0).to(tl.int32)
    dbits = d.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    if Q6:
        row = out_ptr + sb[:, None] * TS
        # ql[128]: byte 64 h + l holds element 128 h + l (low nibble) and 128 h + 64 + l (high)
        j = tl.arange(0, 128)[None, :]
        e0 = (j // 64) * 128 + j % 64
        lo = _code_at(x_ptr, k_ptr, d, sb, e0, -32, 31, m)
        hi = _code_at(x_ptr, k_ptr, d, sb, e0 + 64, -32, 31, m)
        tl.store(row + j, ((lo & 15) | ((hi & 15) << 4)).to(tl.uint8), mask=m)
        # qh[64]: byte 32 h + l holds the top 2 bits of element 128 h + 32 s + l at bits 2 s
        j = tl.arange(0, 64)[None, :]
        base = (j // 32) * 128 + j % 32
        acc = tl.zeros((BLOCK_B, 64), dtype=tl.int32)
        for s in tl.static_range(4):
            acc |= (_code_at(x_ptr, k_ptr, d, sb, base + 32 * s, -32, 31, m) >> 4) << (2 * s)
        tl.store(row + 128 + j, acc.to(tl.uint8), mask=m)
        tl.store(row + 192 + j16, (k & 255).to(tl.uint8), mask=m)
    else:
        row = out_ptr + sb[:, None] * TS
        # hmask[32]: bit i of byte l is the high bit of element 32 i + l
        j = tl.arange(0, 32)[None, :]
        acc = tl.zeros((BLOCK_B, 32), dtype=tl.int32)
        for i in tl.static_range(8):
            acc |= ((_code_at(x_ptr, k_ptr, d, sb, j + 32 * i, -4, 3, m) >> 2) & 1) << i
        tl.store(row + j, acc.to(tl.uint8), mask=m)
        # qs[64]: byte 32 h + l holds the low 2 bits of element 128 h + 32 s + l at bits 2 s
        j = tl.arange(0, 64)[None, :]
        base = (j // 32) * 128 + j % 32
        acc = tl.zeros((BLOCK_B, 64), dtype=tl.int32)
        for s in tl.static_range(4):
            acc |= (_code_at(x_ptr, k_ptr, d, sb, base + 32 * s, -4, 3, m) & 3) << (2 * s)
        tl.store(row + 32 + j, acc.to(tl.uint8), mask=m)
        # scales[12]: s = k + 32; low nibbles of j and j + 8 in byte j; top 2 bits of j in byte 8 + j % 4 at 2 (j // 4)
        j8 = tl.arange(0, 8)[None, :]
        s_lo = tl.load(k_ptr + sb[:, None] * 16 + j8, mask=m, other=0).to(tl.int32) + 32
        s_hi = tl.load(k_ptr + sb[:, None] * 16 + 8 + j8, mask=m, other=0).to(tl.int32) + 32
        tl.store(row + 96 + j8, ((s_lo & 15) | ((s_hi & 15) << 4)).to(tl.uint8), mask=m)
        j4 = tl.arange(0, 4)[None, :]
        acc4 = tl.zeros((BLOCK_B, 4), dtype=tl.int32)
        for i in tl.static_range(4):
            sv = tl.load(k_ptr + sb[:, None] * 16 + 4 * i + j4, mask=m, other=0).to(tl.int32) + 32
            acc4 |= (sv >> 4) << (2 * i)
        tl.store(row + 104 + j4, acc4.to(tl.uint8), mask=m)
    tl.store(row + (TS - 2), (dbits & 255)[:, None].to(tl.uint8), mask=m)
    tl.store(row + (TS - 1), (dbits >> 8)[:, None].to(tl.uint8), mask=m)
