"""Triton kernels of the lattice searches of the grid i-quants (the launches, shapes and checks
are in :mod:`dynaquant.kernels.lattice_search`).

- :func:`nearest_tile_kernel`: a (BLOCK_N, BLOCK_G) register tile of ``B``, ``C``, ``M`` per
  program (all codewords of BLOCK_N groups), reduced across lanes once per scale;
- :func:`nearest_rows_kernel`: one group per lane, the codebook walked one codeword at a time,
  up to 8 running (min, argmin) pairs per group in registers (D = 4 or 8);
- :func:`candidate_terms_kernel`: ``B`` and ``C`` (parity flip included) of K candidates a group;
- :func:`subset_min_kernel`: ``min_k S**2 C_k - 2 S B_k`` for T scales a group;
- :func:`subset_min_sub_kernel`: the same for one scale a sub-block of GPS groups (no per-group copy of
  the scales), the two group minima of a GPS = 2 sub-block summed when SUM;
- :func:`stored_scale_kernel`: IQ2's stored sub-block scales: for F block scales ``d`` and O code offsets
  around each sub-block's continuous scale, the best code and its cost (sub-blocks of 2 groups);
- :func:`ternary_nearest_kernel`: IQ1's nearest ternary grid point, one group per lane.

Memory layout: ``x``, ``w`` (n, D) float32 row-major, ``grid`` (G, D) float32 row-major,
scales and costs (T, n) float32 row-major, indices (T, n) int64, ``odd`` (n,) int8. Importing
this module imports Triton.
"""

import triton
import triton.language as tl

__all__ = [
    "nearest_tile_kernel",
    "nearest_rows_kernel",
    "candidate_terms_kernel",
    "subset_min_kernel",
    "subset_min_sub_kernel",
    "stored_scale_kernel",
    "ternary_nearest_kernel",
    "ternary_search_kernel",
]


@triton.jit
def nearest_tile_kernel(
    x_ptr,
    w_ptr,
    grid_ptr,
    scale_ptr,
    odd_ptr,
    cost_ptr,
    idx_ptr,
    n,
    G,
    T: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PARITY: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < n
    cols = tl.arange(0, BLOCK_G)
    cmask = cols < G
    b = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    c = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    m = tl.full((BLOCK_N, BLOCK_G), float("inf"), dtype=tl.float32)
    for i in tl.static_range(D):
        xi = tl.load(x_ptr + rows * D + i, mask=rmask, other=0.0)
        wi = tl.load(w_ptr + rows * D + i, mask=rmask, other=0.0)
        gi = tl.load(grid_ptr + cols * D + i, mask=cmask, other=0.0)
        p = (wi * xi)[:, None] * gi[None, :]
        b += p
        c += wi[:, None] * (gi * gi)[None, :]
        if PARITY:
            m = tl.minimum(m, p)
    if PARITY:
        odd = tl.load(odd_ptr + rows, mask=rmask, other=0)
        b = tl.where((odd != 0)[:, None], b - 2.0 * m, b)
    sp = scale_ptr + rows
    cp = cost_ptr + rows
    ip = idx_ptr + rows
    for _t in range(T):
        s = tl.load(sp, mask=rmask, other=0.0)
        e = (s * s)[:, None] * c - (2.0 * s)[:, None] * b
        e = tl.where(cmask[None, :], e, float("inf"))
        best, arg = tl.min(e, axis=1, return_indices=True)
        tl.store(cp, best, mask=rmask)
        tl.store(ip, arg.to(tl.int64), mask=rmask)
        sp += n
        cp += n
        ip += n


@triton.jit
def nearest_rows_kernel(
    x_ptr,
    w_ptr,
    grid_ptr,
    grid2_ptr,
    scale_ptr,
    odd_ptr,
    cost_ptr,
    idx_ptr,
    n,
    G: tl.constexpr,
    T: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARITY: tl.constexpr,
):
    # One group per lane (BLOCK_N groups a program), the codebook walked one codeword at a
    # time with its D coordinates and squares as uniform scalar loads; T <= 8 running
    # (min, argmin) pairs per group, so no cross-lane reduction. D is 4 or 8.
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < n
    xp = x_ptr + rows * D
    wp = w_ptr + rows * D
    w0 = tl.load(wp + 0, mask=rmask, other=0.0)
    a0 = w0 * tl.load(xp + 0, mask=rmask, other=0.0)
    w1 = tl.load(wp + 1, mask=rmask, other=0.0)
    a1 = w1 * tl.load(xp + 1, mask=rmask, other=0.0)
    w2 = tl.load(wp + 2, mask=rmask, other=0.0)
    a2 = w2 * tl.load(xp + 2, mask=rmask, other=0.0)
    w3 = tl.load(wp + 3, mask=rmask, other=0.0)
    a3 = w3 * tl.load(xp + 3, mask=rmask, other=0.0)
    if D == 8:
        w4 = tl.load(wp + 4, mask=rmask, other=0.0)
        a4 = w4 * tl.load(xp + 4, mask=rmask, other=0.0)
        w5 = tl.load(wp + 5, mask=rmask, other=0.0)
        a5 = w5 * tl.load(xp + 5, mask=rmask, other=0.0)
        w6 = tl.load(wp + 6, mask=rmask, other=0.0)
        a6 = w6 * tl.load(xp + 6, mask=rmask, other=0.0)
        w7 = tl.load(wp + 7, mask=rmask, other=0.0)
        a7 = w7 * tl.load(xp + 7, mask=rmask, other=0.0)
    if PARITY:
        odd2 = tl.where(tl.load(odd_ptr + rows, mask=rmask, other=0) != 0, 2.0, 0.0)
    s0 = tl.load(scale_ptr + 0 * n + rows, mask=rmask, other=0.0)
    q0 = s0 * s0
    r0 = 2.0 * s0
    best0 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
    arg0 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if T > 1:
        s1 = tl.load(scale_ptr + 1 * n + rows, mask=rmask, other=0.0)
        q1 = s1 * s1
        r1 = 2.0 * s1
        best1 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        arg1 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if T > 2:
        s2 = tl.load(scale_ptr + 2 * n + rows, mask=rmask, other=0.0)
        q2 = s2 * s2
        r2 = 2.0 * s2
        best2 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        arg2 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if T > 3:
        s3 = tl.load(scale_ptr + 3 * n + rows, mask=rmask, other=0.0)
        q3 = s3 * s3
        r3 = 2.0 * s3
        best3 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        arg3 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if T > 4:
        s4 = tl.load(scale_ptr + 4 * n + rows, mask=rmask, other=0.0)
        q4 = s4 * s4
        r4 = 2.0 * s4
        best4 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        arg4 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if T > 5:
        s5 = tl.load(scale_ptr + 5 * n + rows, mask=rmask, other=0.0)
        q5 = s5 * s5
        r5 = 2.0 * s5
        best5 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        arg5 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if T > 6:
        s6 = tl.load(scale_ptr + 6 * n + rows, mask=rmask, other=0.0)
        q6 = s6 * s6
        r6 = 2.0 * s6
        best6 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        arg6 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if T > 7:
        s7 = tl.load(scale_ptr + 7 * n + rows, mask=rmask, other=0.0)
        q7 = s7 * s7
        r7 = 2.0 * s7
        best7 = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        arg7 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for g in range(G):
        gp = grid_ptr + g * D
        qp = grid2_ptr + g * D
        p0 = a0 * tl.load(gp + 0)
        c0 = w0 * tl.load(qp + 0)
        p1 = a1 * tl.load(gp + 1)
        c1 = w1 * tl.load(qp + 1)
        p2 = a2 * tl.load(gp + 2)
        c2 = w2 * tl.load(qp + 2)
        p3 = a3 * tl.load(gp + 3)
        c3 = w3 * tl.load(qp + 3)
        if D == 8:
            p4 = a4 * tl.load(gp + 4)
            c4 = w4 * tl.load(qp + 4)
            p5 = a5 * tl.load(gp + 5)
            c5 = w5 * tl.load(qp + 5)
            p6 = a6 * tl.load(gp + 6)
            c6 = w6 * tl.load(qp + 6)
            p7 = a7 * tl.load(gp + 7)
            c7 = w7 * tl.load(qp + 7)
        b = (p0 + p1) + (p2 + p3)
        c = (c0 + c1) + (c2 + c3)
        if PARITY:
            m = tl.minimum(tl.minimum(p0, p1), tl.minimum(p2, p3))
        if D == 8:
            b = b + ((p4 + p5) + (p6 + p7))
            c = c + ((c4 + c5) + (c6 + c7))
            if PARITY:
                m = tl.minimum(m, tl.minimum(tl.minimum(p4, p5), tl.minimum(p6, p7)))
        if PARITY:
            b = b - odd2 * m
        e = q0 * c - r0 * b
        u = e < best0
        best0 = tl.where(u, e, best0)
        arg0 = tl.where(u, g, arg0)
        if T > 1:
            e = q1 * c - r1 * b
            u = e < best1
            best1 = tl.where(u, e, best1)
            arg1 = tl.where(u, g, arg1)
        if T > 2:
            e = q2 * c - r2 * b
            u = e < best2
            best2 = tl.where(u, e, best2)
            arg2 = tl.where(u, g, arg2)
        if T > 3:
            e = q3 * c - r3 * b
            u = e < best3
            best3 = tl.where(u, e, best3)
            arg3 = tl.where(u, g, arg3)
        if T > 4:
            e = q4 * c - r4 * b
            u = e < best4
            best4 = tl.where(u, e, best4)
            arg4 = tl.where(u, g, arg4)
        if T > 5:
            e = q5 * c - r5 * b
            u = e < best5
            best5 = tl.where(u, e, best5)
            arg5 = tl.where(u, g, arg5)
        if T > 6:
            e = q6 * c - r6 * b
            u = e < best6
            best6 = tl.where(u, e, best6)
            arg6 = tl.where(u, g, arg6)
        if T > 7:
            e = q7 * c - r7 * b
            u = e < best7
            best7 = tl.where(u, e, best7)
            arg7 = tl.where(u, g, arg7)
    tl.store(cost_ptr + 0 * n + rows, best0, mask=rmask)
    tl.store(idx_ptr + 0 * n + rows, arg0.to(tl.int64), mask=rmask)
    if T > 1:
        tl.store(cost_ptr + 1 * n + rows, best1, mask=rmask)
        tl.store(idx_ptr + 1 * n + rows, arg1.to(tl.int64), mask=rmask)
    if T > 2:
        tl.store(cost_ptr + 2 * n + rows, best2, mask=rmask)
        tl.store(idx_ptr + 2 * n + rows, arg2.to(tl.int64), mask=rmask)
    if T > 3:
        tl.store(cost_ptr + 3 * n + rows, best3, mask=rmask)
        tl.store(idx_ptr + 3 * n + rows, arg3.to(tl.int64), mask=rmask)
    if T > 4:
        tl.store(cost_ptr + 4 * n + rows, best4, mask=rmask)
        tl.store(idx_ptr + 4 * n + rows, arg4.to(tl.int64), mask=rmask)
    if T > 5:
        tl.store(cost_ptr + 5 * n + rows, best5, mask=rmask)
        tl.store(idx_ptr + 5 * n + rows, arg5.to(tl.int64), mask=rmask)
    if T > 6:
        tl.store(cost_ptr + 6 * n + rows, best6, mask=rmask)
        tl.store(idx_ptr + 6 * n + rows, arg6.to(tl.int64), mask=rmask)
    if T > 7:
        tl.store(cost_ptr + 7 * n + rows, best7, mask=rmask)
        tl.store(idx_ptr + 7 * n + rows, arg7.to(tl.int64), mask=rmask)


@triton.jit
def candidate_terms_kernel(
    x_ptr,
    w_ptr,
    grid_ptr,
    idx_ptr,
    odd_ptr,
    b_ptr,
    c_ptr,
    n,
    K,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARITY: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < n
    ks = tl.arange(0, BLOCK_K)
    mask = rmask[:, None] & (ks < K)[None, :]
    off = rows[:, None] * K + ks[None, :]
    cand = tl.load(idx_ptr + off, mask=mask, other=0)
    b = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    c = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    m = tl.full((BLOCK_N, BLOCK_K), float("inf"), dtype=tl.float32)
    for i in tl.static_range(D):
        xi = tl.load(x_ptr + rows * D + i, mask=rmask, other=0.0)
        wi = tl.load(w_ptr + rows * D + i, mask=rmask, other=0.0)
        gi = tl.load(grid_ptr + cand * D + i, mask=mask, other=0.0)
        p = (wi * xi)[:, None] * gi
        b += p
        c += wi[:, None] * (gi * gi)
        if PARITY:
            m = tl.minimum(m, p)
    if PARITY:
        odd = tl.load(odd_ptr + rows, mask=rmask, other=0)
        b = tl.where((odd != 0)[:, None], b - 2.0 * m, b)
    tl.store(b_ptr + off, b, mask=mask)
    tl.store(c_ptr + off, c, mask=mask)


@triton.jit
def _subset_min_of(b, c, s, kmask):
    """``min_k S**2 c_k - 2 S b_k`` of each row of a (rows, BLOCK_K) tile at the rows' scales ``s`` (the subset-min
    kernels' one expression)."""
    e = (s * s)[:, None] * c - (2.0 * s)[:, None] * b
    e = tl.where(kmask, e, float("inf"))
    return tl.min(e, axis=1)


@triton.jit
def _pair_tiles(b_ptr, c_ptr, subs, K, ks, mask):
    """b and c of the two groups of each sub-block ``subs`` (b, c: (n_sub 2, K)): four (rows, BLOCK_K) tiles."""
    off = (subs * 2)[:, None] * K + ks[None, :]
    b0 = tl.load(b_ptr + off, mask=mask, other=0.0)
    c0 = tl.load(c_ptr + off, mask=mask, other=0.0)
    b1 = tl.load(b_ptr + off + K, mask=mask, other=0.0)
    c1 = tl.load(c_ptr + off + K, mask=mask, other=0.0)
    return b0, c0, b1, c1


@triton.jit
def subset_min_kernel(b_ptr, c_ptr, scale_ptr, cost_ptr, n, K, T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < n
    ks = tl.arange(0, BLOCK_K)
    kmask = (ks < K)[None, :]
    mask = rmask[:, None] & kmask
    off = rows[:, None] * K + ks[None, :]
    b = tl.load(b_ptr + off, mask=mask, other=0.0)
    c = tl.load(c_ptr + off, mask=mask, other=0.0)
    sp = scale_ptr + rows
    cp = cost_ptr + rows
    for _t in range(T):
        s = tl.load(sp, mask=rmask, other=0.0)
        tl.store(cp, _subset_min_of(b, c, s, kmask), mask=rmask)
        sp += n
        cp += n


@triton.jit
def subset_min_sub_kernel(
    b_ptr,
    c_ptr,
    scale_ptr,
    cost_ptr,
    n_sub,
    K,
    T: tl.constexpr,
    GPS: tl.constexpr,
    SUM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One sub-block (GPS consecutive groups) a lane: scales (T, n_sub), b and c (n_sub GPS, K). Each group's
    # minimum is formed as subset_min_kernel forms it. SUM (GPS = 2): the two minima added, m0 + m1, into cost
    # (T, n_sub); else each group's minimum stored at cost[t, sub GPS + j] (T, n_sub GPS).
    pid = tl.program_id(0)
    subs = pid.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    smask = subs < n_sub
    ks = tl.arange(0, BLOCK_K)
    kmask = (ks < K)[None, :]
    mask = smask[:, None] & kmask
    if SUM:
        b0, c0, b1, c1 = _pair_tiles(b_ptr, c_ptr, subs, K, ks, mask)
        sp = scale_ptr + subs
        cp = cost_ptr + subs
        for _t in range(T):
            s = tl.load(sp, mask=smask, other=0.0)
            tl.store(cp, _subset_min_of(b0, c0, s, kmask) + _subset_min_of(b1, c1, s, kmask), mask=smask)
            sp += n_sub
            cp += n_sub
    else:
        for j in tl.static_range(GPS):
            off = (subs * GPS + j)[:, None] * K + ks[None, :]
            b = tl.load(b_ptr + off, mask=mask, other=0.0)
            c = tl.load(c_ptr + off, mask=mask, other=0.0)
            sp = scale_ptr + subs
            cp = cost_ptr + subs * GPS + j
            for _t in range(T):
                s = tl.load(sp, mask=smask, other=0.0)
                tl.store(cp, _subset_min_of(b, c, s, kmask), mask=smask)
                sp += n_sub
                cp += n_sub * GPS


@triton.jit
def stored_scale_kernel(
    b_ptr,
    c_ptr,
    d_ptr,
    cont_ptr,
    off_ptr,
    cost_ptr,
    s_ptr,
    n_sub,
    n_blk,
    K,
    F,
    N_OFF: tl.constexpr,
    NSUB: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One sub-block of 2 groups a lane (NSUB sub-blocks a block): for each of F block scales d (F, n_blk) and
    # each of N_OFF code offsets, the code s = clamp(floor((8 cont / d - 1) / 2) + offset, 0, 15), its stored scale
    # d (0.5 + s) / 4 and the sub-block's cost (the two minima of subset_min_sub_kernel, m0 + m1); the first
    # offset of least cost is kept: cost, s (F, n_sub). Each step is torch's operation of the reference
    # (the division IEEE, div_rn), so the values are the reference's.
    pid = tl.program_id(0)
    subs = pid.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    smask = subs < n_sub
    ks = tl.arange(0, BLOCK_K)
    kmask = (ks < K)[None, :]
    mask = smask[:, None] & kmask
    b0, c0, b1, c1 = _pair_tiles(b_ptr, c_ptr, subs, K, ks, mask)
    c8 = 8.0 * tl.load(cont_ptr + subs, mask=smask, other=0.0)
    blk = subs // NSUB
    for f in range(F):
        dv = tl.load(d_ptr + f * n_blk + blk, mask=smask, other=0.0)
        safe = tl.where(dv > 0, dv, 1.0)
        base = tl.floor((tl.div_rn(c8, safe) - 1.0) * 0.5).to(tl.int64)
        best = tl.full((BLOCK_S,), float("inf"), dtype=tl.float32)
        best_s = tl.zeros((BLOCK_S,), dtype=tl.int64)
        for o in tl.static_range(N_OFF):
            s = tl.minimum(tl.maximum(base + tl.load(off_ptr + o), 0), 15)
            sc = dv * (0.5 + s.to(tl.float32)) * 0.25
            e = _subset_min_of(b0, c0, sc, kmask) + _subset_min_of(b1, c1, sc, kmask)
            u = e < best
            best = tl.where(u, e, best)
            best_s = tl.where(u, s, best_s)
        tl.store(cost_ptr + f * n_sub + subs, best, mask=smask)
        tl.store(s_ptr + f * n_sub + subs, best_s, mask=smask)


@triton.jit
def _ternary_step(cp, k, cnt, best, best_idx, w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7):
    """Candidate ``k`` of each lane's list: its cost, kept where strictly lower."""
    valid = k < cnt
    code = tl.load(cp + k, mask=valid, other=0)
    # level cost of digit v (level v - 1): w - a (v = 0), 0 (v = 1), w + a (v = 2)
    d = (code >> 11) & 3
    c0 = tl.where(d == 2, w0 + a0, tl.where(d == 0, w0 - a0, 0.0))
    d = (code >> 13) & 3
    c1 = tl.where(d == 2, w1 + a1, tl.where(d == 0, w1 - a1, 0.0))
    d = (code >> 15) & 3
    c2 = tl.where(d == 2, w2 + a2, tl.where(d == 0, w2 - a2, 0.0))
    d = (code >> 17) & 3
    c3 = tl.where(d == 2, w3 + a3, tl.where(d == 0, w3 - a3, 0.0))
    d = (code >> 19) & 3
    c4 = tl.where(d == 2, w4 + a4, tl.where(d == 0, w4 - a4, 0.0))
    d = (code >> 21) & 3
    c5 = tl.where(d == 2, w5 + a5, tl.where(d == 0, w5 - a5, 0.0))
    d = (code >> 23) & 3
    c6 = tl.where(d == 2, w6 + a6, tl.where(d == 0, w6 - a6, 0.0))
    d = (code >> 25) & 3
    c7 = tl.where(d == 2, w7 + a7, tl.where(d == 0, w7 - a7, 0.0))
    cost = (((c3 + c2) + c1) + c0) + (((c7 + c6) + c5) + c4)
    upd = valid & (cost < best)
    return tl.where(upd, cost, best), tl.where(upd, code & 2047, best_idx)


@triton.jit
def ternary_nearest_kernel(
    x_ptr,
    w_ptr,
    t_ptr,
    sign_ptr,
    grid_of_ptr,
    count_ptr,
    code_ptr,
    idx_ptr,
    n,
    delta,
    KP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DYNAMIC: tl.constexpr,
):
    # One group per lane: the free ternary rounding's pattern id, then its candidate list
    # (each entry: grid index | 2-bit digits << 11). Level costs and their sum are formed in
    # the reference's order, so costs and argmins equal it bit for bit (:func:`_ternary_index`).
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < n
    t = tl.load(t_ptr + rows, mask=rmask, other=1.0)
    ts = tl.where(t > 0, t, 1.0)
    sd = tl.load(sign_ptr + rows, mask=rmask, other=1.0) * delta
    xp = x_ptr + rows * 8
    wp = w_ptr + rows * 8
    best_idx = _ternary_index(
        tl.load(xp + 0, mask=rmask, other=0.0),
        tl.load(xp + 1, mask=rmask, other=0.0),
        tl.load(xp + 2, mask=rmask, other=0.0),
        tl.load(xp + 3, mask=rmask, other=0.0),
        tl.load(xp + 4, mask=rmask, other=0.0),
        tl.load(xp + 5, mask=rmask, other=0.0),
        tl.load(xp + 6, mask=rmask, other=0.0),
        tl.load(xp + 7, mask=rmask, other=0.0),
        tl.load(wp + 0, mask=rmask, other=0.0),
        tl.load(wp + 1, mask=rmask, other=0.0),
        tl.load(wp + 2, mask=rmask, other=0.0),
        tl.load(wp + 3, mask=rmask, other=0.0),
        tl.load(wp + 4, mask=rmask, other=0.0),
        tl.load(wp + 5, mask=rmask, other=0.0),
        tl.load(wp + 6, mask=rmask, other=0.0),
        tl.load(wp + 7, mask=rmask, other=0.0),
        ts,
        sd,
        rmask,
        grid_of_ptr,
        count_ptr,
        code_ptr,
        KP,
        BLOCK_N,
        DYNAMIC,
    )
    tl.store(idx_ptr + rows, best_idx.to(tl.int64), mask=rmask)


@triton.jit
def _ternary_index(x0, x1, x2, x3, x4, x5, x6, x7, w0, w1, w2, w3, w4, w5, w6, w7, ts, sd, rmask, grid_of_ptr, count_ptr,
                   code_ptr, KP: tl.constexpr, BLOCK_N: tl.constexpr, DYNAMIC: tl.constexpr):
    """:func:`ternary_nearest_kernel`'s search of one lane's group: the grid index (int32). Divisions are
    ``div_rn`` (IEEE, as torch's; Triton's ``/`` is an approximate division on CUDA)."""
    a0 = 2 * w0 * (sd - tl.div_rn(x0, ts))
    a1 = 2 * w1 * (sd - tl.div_rn(x1, ts))
    a2 = 2 * w2 * (sd - tl.div_rn(x2, ts))
    a3 = 2 * w3 * (sd - tl.div_rn(x3, ts))
    a4 = 2 * w4 * (sd - tl.div_rn(x4, ts))
    a5 = 2 * w5 * (sd - tl.div_rn(x5, ts))
    a6 = 2 * w6 * (sd - tl.div_rn(x6, ts))
    a7 = 2 * w7 * (sd - tl.div_rn(x7, ts))
    p = (
        ((a0 < -w0).to(tl.int32) - (a0 > w0).to(tl.int32) + 1)
        + ((a1 < -w1).to(tl.int32) - (a1 > w1).to(tl.int32) + 1) * 3
        + ((a2 < -w2).to(tl.int32) - (a2 > w2).to(tl.int32) + 1) * 9
        + ((a3 < -w3).to(tl.int32) - (a3 > w3).to(tl.int32) + 1) * 27
        + ((a4 < -w4).to(tl.int32) - (a4 > w4).to(tl.int32) + 1) * 81
        + ((a5 < -w5).to(tl.int32) - (a5 > w5).to(tl.int32) + 1) * 243
        + ((a6 < -w6).to(tl.int32) - (a6 > w6).to(tl.int32) + 1) * 729
        + ((a7 < -w7).to(tl.int32) - (a7 > w7).to(tl.int32) + 1) * 2187
    )
    best_idx = tl.load(grid_of_ptr + p, mask=rmask, other=0)
    cnt = tl.where(best_idx < 0, tl.load(count_ptr + p, mask=rmask, other=0), 0)
    best = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
    cp = code_ptr + p.to(tl.int64) * KP
    if DYNAMIC:  # stop at the block's longest list (the interpreter needs a constant bound)
        for k in range(tl.max(cnt, axis=0)):
            best, best_idx = _ternary_step(
                cp, k, cnt, best, best_idx, w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7
            )
    else:
        for k in range(KP):
            best, best_idx = _ternary_step(
                cp, k, cnt, best, best_idx, w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7
            )
    return best_idx


@triton.jit
def _ternary_term(x, w, t, sd, dig, i: tl.constexpr):
    """``w (x - t (g + sd))**2`` of element ``i`` (level ``g`` from 2-bit digit ``i`` of ``dig``)."""
    g = (((dig >> (2 * i)) & 3) - 1).to(tl.float32)
    d = x - t * (g + sd)
    return w * (d * d)


@triton.jit
def ternary_search_kernel(
    x_ptr,
    w_ptr,
    t_ptr,
    grid_of_ptr,
    count_ptr,
    code_ptr,
    digits_ptr,
    idx_ptr,
    err_ptr,
    m,
    delta,
    KP: tl.constexpr,
    REP: tl.constexpr,
    GPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DYNAMIC: tl.constexpr,
):
    # One (group, scale) per lane, both delta signs (+delta into row 0 of idx/err, -delta into
    # row 1): :func:`_ternary_index`'s search, then the group's error on the decoded values,
    # summed halves first (((e0 + e4) + (e2 + e6)) + ((e1 + e5) + (e3 + e7))). Lane l reads
    # group row (l // (REP GPS)) GPS + l % GPS: REP scales of each sub-block of GPS groups.
    pid = tl.program_id(0)
    lanes = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = lanes < m
    rows = (lanes // (REP * GPS)) * GPS + lanes % GPS
    t = tl.load(t_ptr + lanes, mask=rmask, other=1.0)
    ts = tl.where(t > 0, t, 1.0)
    xp = x_ptr + rows * 8
    wp = w_ptr + rows * 8
    x0 = tl.load(xp + 0, mask=rmask, other=0.0)
    x1 = tl.load(xp + 1, mask=rmask, other=0.0)
    x2 = tl.load(xp + 2, mask=rmask, other=0.0)
    x3 = tl.load(xp + 3, mask=rmask, other=0.0)
    x4 = tl.load(xp + 4, mask=rmask, other=0.0)
    x5 = tl.load(xp + 5, mask=rmask, other=0.0)
    x6 = tl.load(xp + 6, mask=rmask, other=0.0)
    x7 = tl.load(xp + 7, mask=rmask, other=0.0)
    w0 = tl.load(wp + 0, mask=rmask, other=0.0)
    w1 = tl.load(wp + 1, mask=rmask, other=0.0)
    w2 = tl.load(wp + 2, mask=rmask, other=0.0)
    w3 = tl.load(wp + 3, mask=rmask, other=0.0)
    w4 = tl.load(wp + 4, mask=rmask, other=0.0)
    w5 = tl.load(wp + 5, mask=rmask, other=0.0)
    w6 = tl.load(wp + 6, mask=rmask, other=0.0)
    w7 = tl.load(wp + 7, mask=rmask, other=0.0)
    for s in tl.static_range(2):
        sd = delta if s == 0 else -delta
        idx = _ternary_index(x0, x1, x2, x3, x4, x5, x6, x7, w0, w1, w2, w3, w4, w5, w6, w7, ts, sd, rmask,
                             grid_of_ptr, count_ptr, code_ptr, KP, BLOCK_N, DYNAMIC)
        dig = tl.load(digits_ptr + idx, mask=rmask, other=0)
        e0 = _ternary_term(x0, w0, t, sd, dig, 0)
        e1 = _ternary_term(x1, w1, t, sd, dig, 1)
        e2 = _ternary_term(x2, w2, t, sd, dig, 2)
        e3 = _ternary_term(x3, w3, t, sd, dig, 3)
        e4 = _ternary_term(x4, w4, t, sd, dig, 4)
        e5 = _ternary_term(x5, w5, t, sd, dig, 5)
        e6 = _ternary_term(x6, w6, t, sd, dig, 6)
        e7 = _ternary_term(x7, w7, t, sd, dig, 7)
        err = ((e0 + e4) + (e2 + e6)) + ((e1 + e5) + (e3 + e7))
        tl.store(idx_ptr + s * m + lanes, idx.to(tl.int64), mask=rmask)
        tl.store(err_ptr + s * m + lanes, err, mask=rmask)
