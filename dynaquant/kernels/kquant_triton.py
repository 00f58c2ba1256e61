"""Triton kernels of the K-quant scale searches (the launches, shapes and checks are in
:mod:`dynaquant.kernels.kquant_search`; the torch references in
:mod:`dynaquant.quant.codecs._kquant_search`).

Each kernel runs one step of the search for all of its candidates in one launch, keeping the
running best in registers; the float operations repeat the reference's in the same order
(float32 element work and sums, float64 least squares), so only the order inside a sum
differs. Launch with ``enable_fp_fusion=False`` (no multiply-add contraction, as the
reference's separate kernels).

- :func:`aff_step1_kernel`: affine step 1, one sub-block a row of a (BLOCK_R, SUB) tile;
- :func:`sym_step1_kernel`: symmetric step 1 (scaled steps, the exhaustive search's interval
  midpoints taken from sorted breakpoints, the ``n_elem`` most important elements put on every
  level);
- :func:`sym_breakpoints_kernel`: the exhaustive search's code breakpoints of each sub-block,
  sorted in registers (``tl.sort``);
- :func:`aff_pick_kernel` / :func:`sym_pick_kernel`: step 2, the best candidate ``d`` (and
  ``dmin``) of each super-block by the closed-form error, one super-block a row (the symmetric
  one's clip steps, ``CLIP``, also by the exact error of a clamped sub-block, loading the
  super-block's elements for each candidate);
- :func:`aff_refine_kernel` / :func:`sym_refine_kernel`: step 3, the moves of each
  sub-block's integer scale (and min) tried on the elements.

Memory layout: ``x``, ``w`` (R, SUB) float32 row-major (R = n_super * NSUB sub-blocks);
per-sub-block values (R,) (= (n_super, NSUB) row-major); candidates (n_super, C) row-major.
The run-time sizes are not specialized on (``do_not_specialize``) and the launcher keeps the
tiles fixed, so each format compiles each kernel once, whatever its chunks' sizes.
Importing this module imports Triton.
"""

import triton
import triton.language as tl

__all__ = [
    "aff_step1_kernel",
    "sym_step1_kernel",
    "sym_breakpoints_kernel",
    "aff_pick_kernel",
    "sym_pick_kernel",
    "aff_refine_kernel",
    "sym_refine_kernel",
    "round_clamp",
    "round_clamp_low",
]

# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude below 2**22 to the
# nearest integer, ties to even (torch.round's rule).
_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_clamp(v, lo, hi):
    """``clamp(round(v), lo, hi)`` with ties to even; clamping to ``[lo - 1, hi + 1]`` first
    keeps the rounding trick in range and gives the same result."""
    v = tl.minimum(tl.maximum(v, lo - 1.0), hi + 1.0)
    r = (v + _MAGIC) - _MAGIC
    return tl.minimum(tl.maximum(r, lo), hi)


@triton.jit
def round_clamp_low(v, lo, hi):
    """:func:`round_clamp` in 4 operations instead of 6, the same value for every ``v`` (NaN and +-inf too, with
    PTX's NaN-dropping max): ``max(v, lo)`` (an integer below every ``v`` it passes), rounded (ties to even; from
    2**22 up the trick leaves a value above ``hi``), then ``min(., hi)``."""
    r = (tl.maximum(v, lo) + _MAGIC) - _MAGIC
    return tl.minimum(r, hi)


@triton.jit
def _clampf(v, lo, hi):
    return tl.minimum(tl.maximum(v, lo), hi)


@triton.jit
def _safe_div(a, b):
    nz = b != 0
    return tl.where(nz, a / tl.where(nz, b, 1.0), 0.0)


@triton.jit
def _inv(b):
    nz = b != 0
    return tl.where(nz, 1.0 / tl.where(nz, b, 1.0), 0.0)


@triton.jit
def _rows(n, BLOCK: tl.constexpr):
    """This program's BLOCK row indices (int64) and their mask (``< n``)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return rows, rows < n


@triton.jit
def _row_tile(x_ptr, w_ptr, R, SUB: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's (BLOCK_R, SUB) tiles of the (R, SUB) ``x`` and ``w`` (masked rows 0), with
    the rows and their mask."""
    rows, rmask = _rows(R, BLOCK_R)
    offs = rows[:, None] * SUB + tl.arange(0, SUB)[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0)
    w = tl.load(w_ptr + offs, mask=rmask[:, None], other=0.0)
    return rows, rmask, x, w


@triton.jit
def _aff_consider(q, w, wx, sw, sx, sxx, eps, best_e, best_a, best_b):
    """One affine step-1 candidate (codes ``q``): least squares ``x ~ A q + B`` (A >= 0,
    B <= 0) in float64, kept where its error is lower."""
    wq = w * q
    sq = tl.sum(wq, 1).to(tl.float64)
    sqq = tl.sum(wq * q, 1).to(tl.float64)
    sxq = tl.sum(wx * q, 1).to(tl.float64)
    det = sw * sqq - sq * sq
    ok = det > eps * sw * sqq
    det = tl.where(ok, det, 0.0)
    a = _safe_div(sw * sxq - sq * sx, det)
    b = _safe_div(sqq * sx - sq * sxq, det)
    fix = (ok == 0) | (b > 0) | (a < 0)
    a2 = tl.maximum(_safe_div(sxq, sqq), 0.0)
    b2 = tl.minimum(_safe_div(sx - a2 * sq, sw), 0.0)
    a = tl.where(fix, a2, a)
    b = tl.where(fix, b2, b)
    e = sxx - 2.0 * a * sxq - 2.0 * b * sx + a * a * sqq + 2.0 * a * b * sq + b * b * sw
    take = e < best_e
    return tl.where(take, e, best_e), tl.where(take, a, best_a), tl.where(take, b, best_b)


@triton.jit(do_not_specialize=["R", "T", "S"])
def aff_step1_kernel(
    x_ptr,
    w_ptr,
    steps_ptr,
    shifts_ptr,
    eps_ptr,
    a_ptr,
    b_ptr,
    R,
    T,
    S,
    QMAX: tl.constexpr,
    ITERS: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows, rmask, x, w = _row_tile(x_ptr, w_ptr, R, SUB, BLOCK_R)
    eps = tl.load(eps_ptr)
    wx = w * x
    sw = tl.sum(w, 1).to(tl.float64)
    sx = tl.sum(wx, 1).to(tl.float64)
    sxx = tl.sum(wx * x, 1).to(tl.float64)
    lo = tl.minimum(tl.min(x, 1), 0.0)
    rng = tl.max(x, 1) - lo
    inv_rng = _inv(rng)
    best_e = tl.full((BLOCK_R,), float("inf"), dtype=tl.float64)
    best_a = tl.zeros((BLOCK_R,), dtype=tl.float64)
    best_b = tl.zeros((BLOCK_R,), dtype=tl.float64)
    for i in range(T):
        t = tl.load(steps_ptr + i)
        iscale = t * inv_rng
        for j in range(S):
            s = tl.load(shifts_ptr + j)
            b0 = lo + s * rng / t
            q = round_clamp((x - b0[:, None]) * iscale[:, None], 0.0, QMAX)
            best_e, best_a, best_b = _aff_consider(q, w, wx, sw, sx, sxx, eps, best_e, best_a, best_b)
    for _ in tl.static_range(ITERS):
        dl = best_a.to(tl.float32)
        ml = (-best_b).to(tl.float32)
        q = round_clamp((x + ml[:, None]) * _inv(dl)[:, None], 0.0, QMAX)
        best_e, best_a, best_b = _aff_consider(q, w, wx, sw, sx, sxx, eps, best_e, best_a, best_b)
    tl.store(a_ptr + rows, best_a, mask=rmask)
    tl.store(b_ptr + rows, best_b, mask=rmask)


@triton.jit
def _sym_consider(iscale, x, w, wx, g, a, s, QLO: tl.constexpr, QHI: tl.constexpr):
    """One symmetric step-1 candidate inverse scale per row: kept where ``Sxq**2 / Sqq`` gains.

    State ``(g, a, s)``: the best's ``Sxq**2`` (-1 before the first), ``Sxq`` and ``Sqq`` (1 where 0); gains are
    compared by cross-multiplying (``Sxq**2 Sqq' > Sxq'**2 Sqq``) rather than as the reference's float64 quotients:
    the same order but where the rounded quotients tie, and no float64 division a candidate (on the H200 a 16.5 M-weight
    chunk's step 1 took 3.33 -> 2.10 ms for Q3_K, 3.78 -> 2.3 ms for Q6_K, the same scale on every sub-block of the
    encode_speed tensor). ``A = a / s`` (:func:`_sym_a`)."""
    q = round_clamp_low(x * iscale[:, None], QLO, QHI)
    sxq = tl.sum(wx * q, 1).to(tl.float64)
    sqq = tl.sum(w * q * q, 1).to(tl.float64)
    nz = sqq != 0
    gn = tl.where(nz, sxq * sxq, 0.0)
    gd = tl.where(nz, sqq, 1.0)
    better = gn * s > g * gd
    return tl.where(better, gn, g), tl.where(better, tl.where(nz, sxq, 0.0), a), tl.where(better, gd, s)


@triton.jit
def _sym_a(a, s):
    """The best candidate's ``A = Sxq / Sqq`` from :func:`_sym_consider`'s state."""
    return a / s


@triton.jit(do_not_specialize=["R", "T", "M"])
def sym_step1_kernel(
    x_ptr,
    w_ptr,
    steps_ptr,
    bp_ptr,
    a_ptr,
    R,
    T,
    M,
    N_ELEM: tl.constexpr,
    QLO: tl.constexpr,
    QHI: tl.constexpr,
    ITERS: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows, rmask, x, w = _row_tile(x_ptr, w_ptr, R, SUB, BLOCK_R)
    cols = tl.arange(0, SUB)
    wx = w * x
    inv_amax = _inv(tl.max(tl.abs(x), 1))
    g = tl.full((BLOCK_R,), -1.0, dtype=tl.float64)
    a = tl.zeros((BLOCK_R,), dtype=tl.float64)
    s = tl.full((BLOCK_R,), 1.0, dtype=tl.float64)
    # steps_ptr holds the signed multipliers in the reference's order (t, -t for each step)
    for i in range(T):
        st = tl.load(steps_ptr + i)
        g, a, s = _sym_consider(st * inv_amax, x, w, wx, g, a, s, QLO, QHI)
    # bp_ptr: (R, M) ascending breakpoints (sym_breakpoints_kernel); the candidates are
    # exhaustive_mids's: the middle of each pair of neighbours, then the last times 1.25
    # (each breakpoint loaded once: the right neighbour of one interval is the left of the next)
    b1 = tl.load(bp_ptr + rows * M, mask=rmask, other=0.0)  # (M = 0: bp is x, a valid address)
    for i in range(M):
        b0 = b1
        b1 = tl.load(bp_ptr + rows * M + tl.minimum(i + 1, M - 1), mask=rmask, other=0.0)
        m = tl.where(i + 1 < M, (b0 + b1) * 0.5, b0 * 1.25)
        g, a, s = _sym_consider(m, x, w, wx, g, a, s, QLO, QHI)
        g, a, s = _sym_consider(-1.0 * m, x, w, wx, g, a, s, QLO, QHI)
    if N_ELEM > 0:
        v = w * x * x
        for _e in tl.static_range(N_ELEM):
            am = tl.argmax(v, 1)
            hit = cols[None, :] == am[:, None]
            inv_xi = _inv(tl.sum(tl.where(hit, x, 0.0), 1))
            v = tl.where(hit, -float("inf"), v)
            # every nonzero level in ascending order (two loops: no level 0)
            for lev in range(QLO, 0):
                g, a, s = _sym_consider(lev * inv_xi, x, w, wx, g, a, s, QLO, QHI)
            for lev in range(1, QHI + 1):
                g, a, s = _sym_consider(lev * inv_xi, x, w, wx, g, a, s, QLO, QHI)
    for _ in tl.static_range(ITERS):
        g, a, s = _sym_consider(_inv(_sym_a(a, s).to(tl.float32)), x, w, wx, g, a, s, QLO, QHI)
    tl.store(a_ptr + rows, _sym_a(a, s), mask=rmask)


@triton.jit(do_not_specialize=["R"])
def sym_breakpoints_kernel(x_ptr, bp_ptr, R, SUB: tl.constexpr, NL: tl.constexpr, BLOCK_R: tl.constexpr):
    """:func:`dynaquant.quant.codecs._kquant_search.exhaustive_breakpoints` of a (BLOCK_R, SUB) tile: each
    element's ``inv(|x|) * (l + 1/2)``, ``l < NL``, sorted ascending per row into bp (R, SUB * NL) float32
    (the same products, so the same values and order as the reference's sort)."""
    rows, rmask = _rows(R, BLOCK_R)
    x = tl.load(x_ptr + rows[:, None] * SUB + tl.arange(0, SUB)[None, :], mask=rmask[:, None], other=0.0)
    half = tl.arange(0, NL).to(tl.float32) + 0.5
    ax = tl.abs(x)
    nz = ax != 0
    ia = tl.where(nz, tl.math.div_rn(tl.full(ax.shape, 1.0, tl.float32), tl.where(nz, ax, 1.0)), 0.0)  # IEEE, as torch's
    bp = tl.reshape(ia[:, :, None] * half[None, None, :], (BLOCK_R, SUB * NL))
    bp = tl.sort(bp, 1)
    offs = rows[:, None] * (SUB * NL) + tl.arange(0, SUB * NL)[None, :]
    tl.store(bp_ptr + offs, bp, mask=rmask[:, None])


@triton.jit
def _aff_option(d, a, b, ga, gb, sqq, sq, sw, inv_dm, neg_dm, ks, KMAX: tl.constexpr):
    """The two min options of integer scale ``ks``: (error, km) of each."""
    da = d[:, None] * ks - a
    mopt = tl.maximum(-(b - (gb + sq * da) / sw), 0.0)
    m0 = _clampf(tl.floor(mopt * inv_dm[:, None]), 0.0, KMAX)
    m1 = tl.minimum(m0 + 1.0, KMAX)
    db0 = neg_dm[:, None] * m0 - b
    db1 = neg_dm[:, None] * m1 - b
    e0 = 2.0 * (ga * da + gb * db0) + sqq * da * da
    e0 = e0 + (2.0 * sq * da * db0 + sw * db0 * db0)
    e1 = 2.0 * (ga * da + gb * db1) + sqq * da * da
    e1 = e1 + (2.0 * sq * da * db1 + sw * db1 * db1)
    return e0, m0, e1, m1


@triton.jit(do_not_specialize=["B", "C"])
def aff_pick_kernel(
    ref_ptr,
    dc_ptr,
    mc_ptr,
    d_ptr,
    dm_ptr,
    ks_ptr,
    km_ptr,
    B,
    C,
    KMAX: tl.constexpr,
    NSUB: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # ref_ptr: (7, B, NSUB) float32, the reference's (a, b, gA, gB, Sqq, Sq, Sw)
    sb, bmask = _rows(B, BLOCK_B)
    offs = sb[:, None] * NSUB + tl.arange(0, NSUB)[None, :]
    m2 = bmask[:, None]
    plane = B * NSUB
    a = tl.load(ref_ptr + offs, mask=m2, other=0.0)
    b = tl.load(ref_ptr + plane + offs, mask=m2, other=0.0)
    ga = tl.load(ref_ptr + 2 * plane + offs, mask=m2, other=0.0)
    gb = tl.load(ref_ptr + 3 * plane + offs, mask=m2, other=0.0)
    sqq = tl.load(ref_ptr + 4 * plane + offs, mask=m2, other=0.0)
    sq = tl.load(ref_ptr + 5 * plane + offs, mask=m2, other=0.0)
    sw = tl.load(ref_ptr + 6 * plane + offs, mask=m2, other=1.0)
    best_e = tl.full((BLOCK_B,), float("inf"), dtype=tl.float32)
    best_d = tl.zeros((BLOCK_B,), dtype=tl.float32)
    best_dm = tl.zeros((BLOCK_B,), dtype=tl.float32)
    best_ks = tl.zeros((BLOCK_B, NSUB), dtype=tl.float32)
    best_km = tl.zeros((BLOCK_B, NSUB), dtype=tl.float32)
    for c in range(C):
        d = tl.load(dc_ptr + sb * C + c, mask=bmask, other=0.0)
        dm = tl.load(mc_ptr + sb * C + c, mask=bmask, other=0.0)
        inv_dm = _inv(dm)
        neg_dm = -dm
        k0 = _clampf(tl.floor(a * _inv(d)[:, None]), 0.0, KMAX)
        k1 = tl.minimum(k0 + 1.0, KMAX)
        e00, m00, e01, m01 = _aff_option(d, a, b, ga, gb, sqq, sq, sw, inv_dm, neg_dm, k0, KMAX)
        e10, m10, e11, m11 = _aff_option(d, a, b, ga, gb, sqq, sq, sw, inv_dm, neg_dm, k1, KMAX)
        # first minimum in the reference's order (k0, m0), (k0, m1), (k1, m0), (k1, m1)
        e = e00
        ks = k0
        km = m00
        t = e01 < e
        e = tl.where(t, e01, e)
        km = tl.where(t, m01, km)
        t = e10 < e
        e = tl.where(t, e10, e)
        ks = tl.where(t, k1, ks)
        km = tl.where(t, m10, km)
        t = e11 < e
        e = tl.where(t, e11, e)
        ks = tl.where(t, k1, ks)
        km = tl.where(t, m11, km)
        tot = tl.sum(e, 1)
        take = tot < best_e
        best_e = tl.where(take, tot, best_e)
        best_d = tl.where(take, d, best_d)
        best_dm = tl.where(take, dm, best_dm)
        best_ks = tl.where(take[:, None], ks, best_ks)
        best_km = tl.where(take[:, None], km, best_km)
    tl.store(d_ptr + sb, best_d, mask=bmask)
    tl.store(dm_ptr + sb, best_dm, mask=bmask)
    tl.store(ks_ptr + offs, best_ks.to(tl.int64), mask=m2)
    tl.store(km_ptr + offs, best_km.to(tl.int64), mask=m2)


@triton.jit(do_not_specialize=["B", "C"])
def sym_pick_kernel(
    x_ptr,
    w_ptr,
    a_ptr,
    sqq_ptr,
    cand_ptr,
    d_ptr,
    k_ptr,
    B,
    C,
    QLO: tl.constexpr,
    QHI: tl.constexpr,
    KLO: tl.constexpr,
    KHI: tl.constexpr,
    CLIP: tl.constexpr,
    CLIP_MAX: tl.constexpr,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    sb, bmask = _rows(B, BLOCK_B)
    offs = sb[:, None] * NSUB + tl.arange(0, NSUB)[None, :]
    m2 = bmask[:, None]
    offs3 = offs[:, :, None] * SUB + tl.arange(0, SUB)[None, None, :]  # (BLOCK_B, NSUB, SUB) elements
    m3 = bmask[:, None, None]
    a = tl.load(a_ptr + offs, mask=m2, other=0.0)
    sqq = tl.load(sqq_ptr + offs, mask=m2, other=0.0)
    best_e = tl.full((BLOCK_B,), float("inf"), dtype=tl.float32)
    best_d = tl.zeros((BLOCK_B,), dtype=tl.float32)
    best_k = tl.zeros((BLOCK_B, NSUB), dtype=tl.float32)
    for c in range(C):
        d = tl.load(cand_ptr + sb * C + c, mask=bmask, other=0.0)
        f = tl.floor(a * _inv(d)[:, None])
        k0 = _clampf(f, KLO, KHI)
        k1 = tl.minimum(k0 + 1.0, KHI)
        r0 = d[:, None] * k0 - a
        r1 = d[:, None] * k1 - a
        e0 = sqq * r0 * r0
        e1 = sqq * r1 * r1
        t = e1 < e0
        e = tl.where(t, e1, e0)
        k = tl.where(t, k1, k0)
        if CLIP:  # the clip steps: a clamped sub-block's exact error where 1..CLIP_MAX clamp (sym_clip_error)
            out = (f < KLO) | (f >= KHI)
            cnt = tl.sum(out.to(tl.int32), 1)
            exact = out & (cnt <= CLIP_MAX)[:, None]
            x = tl.load(x_ptr + offs3, mask=m3, other=0.0)
            w = tl.load(w_ptr + offs3, mask=m3, other=0.0)
            dl = d[:, None] * k0
            q = round_clamp(x * _inv(dl)[:, :, None], QLO, QHI)
            r = x - dl[:, :, None] * q
            e = tl.where(exact, tl.sum(w * r * r, 2), e)
        tot = tl.sum(e, 1)
        take = tot < best_e
        best_e = tl.where(take, tot, best_e)
        best_d = tl.where(take, d, best_d)
        best_k = tl.where(take[:, None], k, best_k)
    tl.store(d_ptr + sb, best_d, mask=bmask)
    tl.store(k_ptr + offs, best_k.to(tl.int64), mask=m2)


@triton.jit
def _aff_err(x, w, dl, ml, QMAX: tl.constexpr):
    q = round_clamp((x + ml[:, None]) * _inv(dl)[:, None], 0.0, QMAX)
    r = x - (dl[:, None] * q - ml[:, None])
    return tl.sum(w * r * r, 1).to(tl.float64)


@triton.jit(do_not_specialize=["R", "M"])
def aff_refine_kernel(
    x_ptr,
    w_ptr,
    d_ptr,
    dmin_ptr,
    ks_ptr,
    km_ptr,
    moves_ptr,
    ks_out,
    km_out,
    err_ptr,
    R,
    M,
    QMAX: tl.constexpr,
    KMAX: tl.constexpr,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows, rmask, x, w = _row_tile(x_ptr, w_ptr, R, SUB, BLOCK_R)
    d = tl.load(d_ptr + rows // NSUB, mask=rmask, other=0.0)
    dmin = tl.load(dmin_ptr + rows // NSUB, mask=rmask, other=0.0)
    ks = tl.load(ks_ptr + rows, mask=rmask, other=0).to(tl.float32)
    km = tl.load(km_ptr + rows, mask=rmask, other=0).to(tl.float32)
    err = _aff_err(x, w, d * ks, dmin * km, QMAX)
    for i in range(M):
        kst = _clampf(ks + tl.load(moves_ptr + 2 * i).to(tl.float32), 0.0, KMAX)
        kmt = _clampf(km + tl.load(moves_ptr + 2 * i + 1).to(tl.float32), 0.0, KMAX)
        et = _aff_err(x, w, d * kst, dmin * kmt, QMAX)
        take = et < err
        err = tl.where(take, et, err)
        ks = tl.where(take, kst, ks)
        km = tl.where(take, kmt, km)
    tl.store(ks_out + rows, ks.to(tl.int64), mask=rmask)
    tl.store(km_out + rows, km.to(tl.int64), mask=rmask)
    tl.store(err_ptr + rows, err, mask=rmask)


@triton.jit
def _sym_err(x, w, dl, QLO: tl.constexpr, QHI: tl.constexpr):
    q = round_clamp(x * _inv(dl)[:, None], QLO, QHI)
    r = x - dl[:, None] * q
    return tl.sum(w * r * r, 1).to(tl.float64)


@triton.jit(do_not_specialize=["R"])
def sym_refine_kernel(
    x_ptr,
    w_ptr,
    d_ptr,
    k_ptr,
    k_out,
    err_ptr,
    R,
    QLO: tl.constexpr,
    QHI: tl.constexpr,
    KLO: tl.constexpr,
    KHI: tl.constexpr,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows, rmask, x, w = _row_tile(x_ptr, w_ptr, R, SUB, BLOCK_R)
    d = tl.load(d_ptr + rows // NSUB, mask=rmask, other=0.0)
    k = tl.load(k_ptr + rows, mask=rmask, other=0).to(tl.float32)
    err = _sym_err(x, w, d * k, QLO, QHI)
    for delta in tl.static_range(2):
        kt = _clampf(k + (1.0 - 2.0 * delta), KLO, KHI)
        et = _sym_err(x, w, d * kt, QLO, QHI)
        take = et < err
        err = tl.where(take, et, err)
        k = tl.where(take, kt, k)
    tl.store(k_out + rows, k.to(tl.int64), mask=rmask)
    tl.store(err_ptr + rows, err, mask=rmask)
