"""Triton kernels for ``y = x @ dequant(W).T`` on the layout of :mod:`dynaquant.kernels.packing`.

Imported lazily (by :func:`dynaquant.kernels.linear`): importing this module imports Triton, and
``TRITON_INTERPRET=1`` must be set before that to run the kernels on CPU tensors.

Integer-to-float conversion without ``I2F`` (quarter-rate on the GPU): a ``b``-bit code at bit ``p``
of a word is masked in place and OR-ed with the exponent ``150 - p``, which makes the float
``2**(23 - p) + code`` exactly; one subtraction of ``2**(23 - p) + zero`` gives ``code - zero``
(codes above bit ``23 - b`` are shifted down 16 first). An E2M1 nibble moves its sign to bit 31
and its three magnitude bits to bits 22..24, giving ``e2m1 * 2**-126`` exactly (subnormal for
0.5); the GEMV path scales the activations by ``2**100`` and the result by ``2**26`` instead of
each weight, the other paths multiply by ``2**126`` before rounding to bf16/fp16.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dynaquant.kernels.formats import KernelFormat
from dynaquant.kernels.packing import PackedWeight
from dynaquant.kernels.triton_half2 import X_UNSCALE, word_dot, word_pair_dot
from dynaquant.kernels.tuning import LaunchConfig

try:  # grid dependency control (Triton 3.4+): programmatic dependent launch on Hopper and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off (stand-ins never compiled: PDL is False)
    HAS_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

KIND_INT, KIND_MX, KIND_NV = 0, 1, 2
# the M = 1 GEMV launched with programmatic dependent launch (_gemv_kernel's PDL). Off: on the H100 (session 35,
# benchmarks/out/kernels-h100-m1-pdl-s35.json) the fused decode step moved -4 % .. +4 % against bf16, no clear gain
PDL = False
MAGIC = 150 << 23  # float32 bits of 2**23, passed at run time (see _int_field)
X_SCALE_FP4 = 2.0 ** 100  # activations' scale on the FP4 GEMV path (weights decode to e2m1 * 2**-126)
FP4_UNSCALE = 2.0 ** 26  # 2**126 / 2**100
X_SCALE = tl.constexpr(X_SCALE_FP4)
FP4_UP = tl.constexpr(2.0 ** 126)


# ----------------------------------------------------------------------------------------------
# element decoders (compile-time field index IDX)


@triton.jit
def _int_field(w, magic, IDX: tl.constexpr, BITS: tl.constexpr):
    """Code IDX of int32 words ``w`` (BITS-bit codes, natural order) as exact float32 ``2**(23-p) + code``.

    ``magic`` is the runtime int32 ``150 << 23``: a register operand lets the mask and the OR fuse
    into one LOP3 (two immediates do not)."""
    P: tl.constexpr = BITS * IDX
    SH: tl.constexpr = 16 if P + BITS > 23 else 0
    PP: tl.constexpr = P - SH
    MASK: tl.constexpr = ((1 << BITS) - 1) << PP
    return ((w >> SH) & MASK | (magic - (PP << 23))).to(tl.float32, bitcast=True)


@triton.jit
def _int_offset(IDX: tl.constexpr, BITS: tl.constexpr):
    """The magic part ``2**(23 - p)`` of :func:`_int_field` for code IDX."""
    P: tl.constexpr = BITS * IDX
    SH: tl.constexpr = 16 if P + BITS > 23 else 0
    PP: tl.constexpr = P - SH
    return 1 << (23 - PP)


@triton.jit
def _hi_bit(hsrc, magic, IDX: tl.constexpr):
    """Bit IDX (< 16) of ``hsrc`` as exact float32 0.0 / 1.0."""
    return ((hsrc & (1 << IDX)) | (magic - (IDX << 23))).to(tl.float32, bitcast=True) - (1 << (23 - IDX))


@triton.jit
def _fp4_field(w, IDX: tl.constexpr):
    """E2M1 nibble IDX of int32 words ``w`` as float32 ``e2m1 * 2**-126`` (exact): the nibble is shifted
    to the top, then arithmetically right by 6 (sign stays at bit 31, magnitude lands on bits 22..24)."""
    SS: tl.constexpr = 28 - 4 * IDX
    return (((w << SS) >> 6) & -2118123520).to(tl.float32, bitcast=True)  # mask 0x81C00000


@triton.jit
def code_value(w, hsrc, zoff, magic, IDX: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr):
    """Code IDX of the words as float32: ``code - zero`` for integer formats (``zoff`` holds
    ``zero`` per row/group, or is the symmetric constant), ``e2m1 * 2**-126`` for FP4."""
    if KIND != 0:
        v = _fp4_field(w, IDX)
    elif BITS == 3:
        lo = _int_field(w, magic, IDX, 2) - (_int_offset(IDX, 2) + zoff)
        v = _hi_bit(hsrc, magic, IDX) * 4.0 + lo
    else:
        v = _int_field(w, magic, IDX, BITS) - (_int_offset(IDX, BITS) + zoff)
    return v


@triton.jit
def group_scale(sc, KIND: tl.constexpr):
    """Loaded scales -> float32 (INT: fp16/bf16; MXFP4: E8M0 byte; NVFP4: E4M3 byte)."""
    if KIND == 0:
        s = sc.to(tl.float32)
    elif KIND == 1:
        e = sc.to(tl.int32)
        bits = tl.where(e > 0, e << 23, 0x00400000)
        bits = tl.where(e == 255, 0x7FC00000, bits)
        s = bits.to(tl.float32, bitcast=True)
    else:
        s = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return s


@triton.jit
def hi_source(w, qh_ptr, row, KH, word, BITS: tl.constexpr):
    """What :func:`code_value` reads high bits from for words ``word`` [W] of rows ``row`` [R, 1]: INT3's 1-bit
    plane (two 16-bit halves a word of it, shifted into place), else the words ``w`` themselves."""
    if BITS == 3:
        hw = tl.load(qh_ptr + row * KH + (word // 2)[None, :])
        hsrc = hw >> ((word % 2) * 16)[None, :]
    else:
        hsrc = w
    return hsrc


@triton.jit
def _il8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Interleave 8 tensors along the last axis: element j of a_i lands at 8 j + i."""
    return tl.interleave(tl.interleave(tl.interleave(a0, a4), tl.interleave(a2, a6)),
                         tl.interleave(tl.interleave(a1, a5), tl.interleave(a3, a7)))


@triton.jit
def tile_values(w, hsrc, zoff, magic, KIND: tl.constexpr, BITS: tl.constexpr, EPW: tl.constexpr, DT: tl.constexpr):
    """Words [R, W] -> values [R, W * EPW] in natural K order, dtype DT (exact; FP4 scaled to e2m1)."""
    if KIND != 0:
        c = FP4_UP
        v0 = (_fp4_field(w, 0) * c).to(DT)
        v1 = (_fp4_field(w, 1) * c).to(DT)
        v2 = (_fp4_field(w, 2) * c).to(DT)
        v3 = (_fp4_field(w, 3) * c).to(DT)
        v4 = (_fp4_field(w, 4) * c).to(DT)
        v5 = (_fp4_field(w, 5) * c).to(DT)
        v6 = (_fp4_field(w, 6) * c).to(DT)
        v7 = (_fp4_field(w, 7) * c).to(DT)
        out = _il8(v0, v1, v2, v3, v4, v5, v6, v7)
    elif EPW == 4:
        v0 = code_value(w, hsrc, zoff, magic, 0, KIND, BITS).to(DT)
        v1 = code_value(w, hsrc, zoff, magic, 1, KIND, BITS).to(DT)
        v2 = code_value(w, hsrc, zoff, magic, 2, KIND, BITS).to(DT)
        v3 = code_value(w, hsrc, zoff, magic, 3, KIND, BITS).to(DT)
        out = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))
    elif EPW == 8:
        v0 = code_value(w, hsrc, zoff, magic, 0, KIND, BITS).to(DT)
        v1 = code_value(w, hsrc, zoff, magic, 1, KIND, BITS).to(DT)
        v2 = code_value(w, hsrc, zoff, magic, 2, KIND, BITS).to(DT)
        v3 = code_value(w, hsrc, zoff, magic, 3, KIND, BITS).to(DT)
        v4 = code_value(w, hsrc, zoff, magic, 4, KIND, BITS).to(DT)
        v5 = code_value(w, hsrc, zoff, magic, 5, KIND, BITS).to(DT)
        v6 = code_value(w, hsrc, zoff, magic, 6, KIND, BITS).to(DT)
        v7 = code_value(w, hsrc, zoff, magic, 7, KIND, BITS).to(DT)
        out = _il8(v0, v1, v2, v3, v4, v5, v6, v7)
    else:
        v0 = code_value(w, hsrc, zoff, magic, 0, KIND, BITS).to(DT)
        v1 = code_value(w, hsrc, zoff, magic, 1, KIND, BITS).to(DT)
        v2 = code_value(w, hsrc, zoff, magic, 2, KIND, BITS).to(DT)
        v3 = code_value(w, hsrc, zoff, magic, 3, KIND, BITS).to(DT)
        v4 = code_value(w, hsrc, zoff, magic, 4, KIND, BITS).to(DT)
        v5 = code_value(w, hsrc, zoff, magic, 5, KIND, BITS).to(DT)
        v6 = code_value(w, hsrc, zoff, magic, 6, KIND, BITS).to(DT)
        v7 = code_value(w, hsrc, zoff, magic, 7, KIND, BITS).to(DT)
        v8 = code_value(w, hsrc, zoff, magic, 8, KIND, BITS).to(DT)
        v9 = code_value(w, hsrc, zoff, magic, 9, KIND, BITS).to(DT)
        v10 = code_value(w, hsrc, zoff, magic, 10, KIND, BITS).to(DT)
        v11 = code_value(w, hsrc, zoff, magic, 11, KIND, BITS).to(DT)
        v12 = code_value(w, hsrc, zoff, magic, 12, KIND, BITS).to(DT)
        v13 = code_value(w, hsrc, zoff, magic, 13, KIND, BITS).to(DT)
        v14 = code_value(w, hsrc, zoff, magic, 14, KIND, BITS).to(DT)
        v15 = code_value(w, hsrc, zoff, magic, 15, KIND, BITS).to(DT)
        out = tl.interleave(_il8(v0, v2, v4, v6, v8, v10, v12, v14), _il8(v1, v3, v5, v7, v9, v11, v13, v15))
    return out


@triton.jit
def store_rows(y, rn, mask, b_ptr, y_ptr, out_mul, HAS_BIAS: tl.constexpr):
    """``y * out_mul (+ bias[rn])`` (float32) into ``y_ptr[rn]`` where ``mask``, in the output's dtype."""
    out = y * out_mul
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish(y, rn, n_mask, pid_n, pid_k, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, out_mul,
            HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store one row of outputs (GEMV), reducing split-K partials in the last program of the tile."""
    if SPLIT_K == 1:
        store_rows(y, rn, n_mask, b_ptr, y_ptr, out_mul, HAS_BIAS)
    else:
        tl.store(ws_ptr + pid_k * N + rn, y, mask=n_mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            tot = tl.zeros_like(y)
            for s in range(SPLIT_K):
                tot += tl.load(ws_ptr + s * N + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
            store_rows(tot, rn, n_mask, b_ptr, y_ptr, out_mul, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


# ----------------------------------------------------------------------------------------------
# M = 1: GEMV on the CUDA cores


@triton.jit
def _gemv_part(w, x_ptr, kb, qh_ptr, z_ptr, row, KH, base, rw, goff, magic, KIND: tl.constexpr, BITS: tl.constexpr,
               ASYM: tl.constexpr, ZC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EPW: tl.constexpr):
    """The GEMV's float32 path: words [BLOCK_N, BLOCK_KW] times the activations, each code decoded to float32
    (:func:`code_value`), unscaled."""
    if BITS == 3:
        hw = tl.load(qh_ptr + row * KH + (base // 2 + rw // 2)[None, :])
        hsrc = hw >> ((rw % 2) * 16)[None, :]
    else:
        hsrc = w
    part = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    xs = tl.zeros([BLOCK_KW], dtype=tl.float32)
    for i in tl.static_range(EPW):
        xi = tl.load(x_ptr + kb + i).to(tl.float32)
        if KIND != 0:
            xi = xi * X_SCALE
        part += xi[None, :] * code_value(w, hsrc, ZC, magic, i, KIND, BITS)
        if ASYM:
            xs += xi
    if ASYM:  # sum x (code - zero) = sum x code - zero * sum x; the tile lies in one group (valid_config),
        # whose sum x is a scalar (a per-word sum would reload x in the zeros' register layout)
        part -= tl.load(z_ptr + goff).to(tl.float32) * (tl.sum(xs, axis=0) / BLOCK_KW)
    return part


@triton.jit
def _half2_part(w, x_ptr, s_ptr, row, NG, base, KIND: tl.constexpr, BITS: tl.constexpr, WPG: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, CW: tl.constexpr, PAIRS: tl.constexpr,
                ASM: tl.constexpr):
    """The GEMV's packed-fp16 path: words [BLOCK_N, BLOCK_KW] (from word ``base``) times the activations, scaled,
    as float32 [BLOCK_N, BLOCK_KW / CW] (unscaled by :data:`X_UNSCALE`): each run of CW words (at most one thread's
    16-byte load and one group) summed, then multiplied by its group's scale, so a scale is loaded and converted
    (E8M0 / E4M3 / fp16 -> float32) once a run (the kernel's CW = 1 path: once a word). PAIRS: two words' products summed in f16x2
    before the float32 conversion (:func:`.triton_half2.word_pair_dot`; CW >= 2)."""
    EPW: tl.constexpr = 32 // BITS
    NC: tl.constexpr = BLOCK_KW // CW
    if PAIRS:
        wa, wb = tl.split(tl.reshape(w, [BLOCK_N, BLOCK_KW // 2, 2]))
        kba = (base + 2 * tl.arange(0, BLOCK_KW // 2)) * EPW
        d = word_pair_dot(wa, wb, x_ptr, kba, kba + EPW, BITS, ASM, KIND != 0)  # [BLOCK_N, BLOCK_KW / 2]
        part = tl.sum(tl.reshape(d, [BLOCK_N, NC, CW // 2]), axis=2)
    else:
        d = word_dot(w, x_ptr, (base + tl.arange(0, BLOCK_KW)) * EPW, BITS, ASM, KIND != 0)
        part = tl.sum(tl.reshape(d, [BLOCK_N, NC, CW]), axis=2)
    # the run's group as (scalar + per-element constant); runs of one group (WPG > 4) load the same scale
    sc = group_scale(tl.load(s_ptr + row * NG + (base // WPG + tl.arange(0, NC) // (WPG // CW))[None, :]), KIND)
    return part * sc


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, qh_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                 N, KW, KH, NG, out_mul, magic, NT, NT_C: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, ZC: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, PREFETCH: tl.constexpr,
                 SPLIT_K: tl.constexpr, HALF2: tl.constexpr, ASM: tl.constexpr, CW: tl.constexpr, PAIRS: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Words [BLOCK_N, BLOCK_KW] per iteration (16-byte loads along K, whole groups or parts of one);
    NT iterations per program. PREFETCH loads the next tile's words before decoding the current one.
    PDL (launched with programmatic dependent launch, Hopper+): the program lets the next kernel launch at once and
    loads its first weight tile (static data) before it waits for the previous kernel (``griddepcontrol``); the
    activations, the split-K workspace and the output are touched only after the wait.
    HALF2 (symmetric INT4 / INT2, FP4): each word's dot product in packed fp16 (:mod:`.triton_half2`; ASM: its
    PTX), scaled once a run of CW words (:func:`_half2_part`; PAIRS: two words a register); the FP4 codes then enter
    as ``e2m1 / 16`` (``out_mul`` without the float32 path's ``2**26``)."""
    EPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WPG: tl.constexpr = G // EPW
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    row = tl.minimum(rn, N - 1)[:, None]
    rw = tl.arange(0, BLOCK_KW)
    wrow = qw_ptr + row * KW
    if HALF2:
        acc = tl.zeros([BLOCK_N, BLOCK_KW // CW], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    kw0 = pid_k * NT * BLOCK_KW
    if PDL:
        gdc_launch_dependents()
    if PREFETCH:
        w_next = tl.load(wrow + (kw0 + rw)[None, :])
    if PDL:
        gdc_wait()
    for t in range(0, NT_C if NT_C > 0 else NT):  # (an assigned ternary trips the 3.6 interpreter)
        base = kw0 + t * BLOCK_KW  # a multiple of BLOCK_KW, so of WPG or of the tile's part of a group
        word = base + rw
        if PREFETCH:
            w = w_next
            w_next = tl.load(wrow + (word + BLOCK_KW)[None, :], mask=(rw + (t + 1) * BLOCK_KW < NT * BLOCK_KW)[None, :],
                             other=0)
        else:
            w = tl.load(wrow + word[None, :])
        if HALF2 and CW > 1:
            acc += _half2_part(w, x_ptr, s_ptr, row, NG, base, KIND, BITS, WPG, BLOCK_N, BLOCK_KW, CW, PAIRS, ASM)
        else:
            # the group of each word, as (scalar + per-element constant): words of one group then load
            # their scale from one address, which the compiler merges into one load a thread
            goff = row * NG + (base // WPG + rw // WPG)[None, :]
            sc = group_scale(tl.load(s_ptr + goff), KIND)
            kb = word * EPW
            if HALF2:  # a scale a word
                acc += word_dot(w, x_ptr, kb, BITS, ASM, KIND != 0) * sc
            else:
                acc += _gemv_part(w, x_ptr, kb, qh_ptr, z_ptr, row, KH, base, rw, goff, magic,
                                  KIND, BITS, ASYM, ZC, BLOCK_N, BLOCK_KW, EPW) * sc
    y = tl.sum(acc, axis=1)
    if HALF2:
        y = y * X_UNSCALE
    _finish(y, rn, n_mask, pid_n, pid_k, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, out_mul, HAS_BIAS, SPLIT_K)


# ----------------------------------------------------------------------------------------------
# small batches: tensor cores, W tile as the wide operand


@triton.jit
def _mm_kernel(x_ptr, qw_ptr, qh_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
               M, N, KW, KH, NG, stride_xm, stride_ym, out_mul, magic, GPS, GPS_C: tl.constexpr,
               KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, ZC: tl.constexpr,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NGT: tl.constexpr,
               SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr):
    EPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WPG: tl.constexpr = G // EPW
    DT: tl.constexpr = tl.float32 if DOT_F32 else x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rowv = tl.minimum(rn, N - 1)
    row = rowv[:, None]
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rw = tl.arange(0, WPG)
    rk = tl.arange(0, G)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    g_start = pid_k * GPS
    for gl in range(0, GPS_C if GPS_C > 0 else GPS, NGT):
        for t in tl.static_range(NGT):
            gi = g_start + gl + t
            word = gi * WPG + rw
            w = tl.load(qw_ptr + row * KW + word[None, :])  # [BLOCK_N, WPG]
            if ASYM:
                zoff = tl.load(z_ptr + row * NG + gi).to(tl.float32)  # [BLOCK_N, 1]
            else:
                zoff = ZC
            hsrc = hi_source(w, qh_ptr, row, KH, word, BITS)
            wt = tile_values(w, hsrc, zoff, magic, KIND, BITS, EPW, DT)  # [BLOCK_N, G]
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + (gi * G + rk)[:, None], mask=m_mask[None, :], other=0.0)
            xt = xt.to(DT)
            d = tl.dot(wt, xt)  # [BLOCK_N, BLOCK_M]
            sc = group_scale(tl.load(s_ptr + rowv * NG + gi), KIND)
            acc += d * sc[:, None]
    out = acc * out_mul
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & m_mask[None, :])
    else:
        wsp = ws_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
        tl.store(wsp, out, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            tot = tl.zeros_like(out)
            for s in range(SPLIT_K):
                tot += tl.load(ws_ptr + s * M * N + rm[None, :] * N + rn[:, None], mask=mask, other=0.0,
                               cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


# ----------------------------------------------------------------------------------------------
# large batches: dequantize, then cuBLAS


@triton.jit
def _dequant_kernel(qw_ptr, qh_ptr, s_ptr, z_ptr, out_ptr, N, K, KW, KH, NG, out_mul, magic,
                    KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, ZC: tl.constexpr,
                    BLOCK_N: tl.constexpr, NGT: tl.constexpr):
    EPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WPG: tl.constexpr = G // EPW
    DT: tl.constexpr = out_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    row = tl.minimum(rn, N - 1)[:, None]
    rw = tl.arange(0, WPG)
    rk = tl.arange(0, G)
    for t in tl.static_range(NGT):
        gi = pid_g * NGT + t
        word = gi * WPG + rw
        w = tl.load(qw_ptr + row * KW + word[None, :])
        if ASYM:
            zoff = tl.load(z_ptr + row * NG + gi).to(tl.float32)
        else:
            zoff = ZC
        hsrc = hi_source(w, qh_ptr, row, KH, word, BITS)
        v = tile_values(w, hsrc, zoff, magic, KIND, BITS, EPW, tl.float32)
        sc = group_scale(tl.load(s_ptr + row * NG + gi), KIND) * out_mul  # [BLOCK_N, 1]
        tl.store(out_ptr + row * K + (gi * G + rk)[None, :], (v * sc).to(DT), mask=n_mask[:, None])


# ----------------------------------------------------------------------------------------------
# launchers


def interpreting() -> bool:
    # Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw integers (it gets float32 ones),
    # and cannot take a loop bound from a run-time argument under numpy 2.4 (it gets a constexpr one)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def format_constants(packed: PackedWeight) -> dict:
    f: KernelFormat = packed.fmt
    kind = {"int": KIND_INT, "mxfp4": KIND_MX, "nvfp4": KIND_NV}[f.kind]
    zc = (1 << (f.bits - 1)) if (f.kind == "int" and f.symmetric) else 0
    return dict(KIND=kind, BITS=f.bits, G=f.group_size, ASYM=not f.symmetric, ZC=zc)


def out_multiplier(packed: PackedWeight, gemv: bool) -> float:
    f = packed.fmt
    if f.kind == "int":
        return 1.0
    m = FP4_UNSCALE if gemv else 1.0
    return m / packed.global_scale if f.kind == "nvfp4" else m


def packed_words(packed: PackedWeight) -> tuple[int, int, int]:
    kw = packed.qweight.shape[1]
    kh = packed.qweight_hi.shape[1] if packed.qweight_hi is not None else 0
    return kw, kh, packed.in_features // packed.fmt.group_size


def dequantize(packed: PackedWeight, dtype: torch.dtype, config: LaunchConfig | None = None) -> torch.Tensor:
    """The weight (N, K) in ``dtype`` (bf16/fp16/fp32), dequantized by a Triton kernel (super weights not applied)."""
    n, k = packed.shape
    kw, kh, ng = packed_words(packed)
    block_n = config.block_n if config is not None else 64
    ngt = config.groups if config is not None and ng % config.groups == 0 else 1
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    qh = packed.qweight_hi if packed.qweight_hi is not None else packed.qweight
    z = packed.zeros if packed.zeros is not None else packed.scales
    grid = (triton.cdiv(n, block_n), ng // ngt)
    _dequant_kernel[grid](packed.qweight, qh, packed.scales, z, out, n, k, kw, kh, ng, out_multiplier(packed, False), MAGIC,
                          BLOCK_N=block_n, NGT=ngt, num_warps=4, **format_constants(packed))
    return out


def call_buffers(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, split: int):
    """What a linear kernel's launch passes besides the weight: ``(KW, KH, NG)`` (:func:`packed_words`), the output
    ``y`` (M, N) in x's dtype, the float32 split-K workspace (one element without a split), and the high-bit plane,
    zero points and bias pointers (stand-ins where the format or call has none)."""
    m = x2.shape[0]
    n = packed.out_features
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    ws = torch.empty(split * m * n if split > 1 else 1, dtype=torch.float32, device=x2.device)
    qh = packed.qweight_hi if packed.qweight_hi is not None else packed.qweight
    z = packed.zeros if packed.zeros is not None else packed.scales
    return (*packed_words(packed), y, ws, qh, z, bias if bias is not None else y)


def _launch_args(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig):
    """(kernel, grid, args, kwargs, y) of one call on the gemv or mm path (the resident GEMV:
    :mod:`dynaquant.kernels.triton_resident`)."""
    m, k = x2.shape
    n = packed.out_features
    split = cfg.split_k
    kw, kh, ng, y, ws, qh, z, b = call_buffers(x2, packed, bias, split)
    gps = ng // split
    gps_c = gps if interpreting() else 0  # the 3.6 interpreter cannot loop to a run-time bound (numpy 2.4)
    common = dict(HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, SPLIT_K=split, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **format_constants(packed))
    if cfg.path == "gemv":
        f = packed.fmt
        wpg = f.group_size // (16 if f.bits == 3 else 32 // f.bits)
        nt = gps // cfg.groups
        grid = (triton.cdiv(n, cfg.block_n), split)
        args = (x2, packed.qweight, qh, packed.scales, z, b, y, ws, packed.counters, n, kw, kh, ng,
                out_multiplier(packed, not cfg.half2), MAGIC, nt)
        return _gemv_kernel, grid, args, dict(common, NT_C=nt if gps_c else 0, BLOCK_KW=cfg.groups * wpg,
                                              PREFETCH=cfg.prefetch, HALF2=cfg.half2, ASM=not interpreting(),
                                              CW=min(cfg.scale_words, wpg), PAIRS=cfg.pairs, **_pdl(x2)), y
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    args = (x2, packed.qweight, qh, packed.scales, z, b, y, ws, packed.counters, m, n, kw, kh, ng, x2.stride(0),
            y.stride(0), out_multiplier(packed, False), MAGIC, gps)
    return _mm_kernel, grid, args, dict(common, GPS_C=gps_c, BLOCK_M=cfg.block_m, NGT=cfg.groups,
                                        DOT_F32=interpreting()), y


def _pdl(x2: torch.Tensor) -> dict:
    """The GEMV's launch options for :data:`PDL`: on (``PDL`` constexpr and Triton's ``launch_pdl``) only on a CUDA
    device of capability 9.0+ with a Triton that has grid dependency control, never in the interpreter."""
    if not PDL or not HAS_GDC or interpreting() or x2.device.type != "cuda" \
            or torch.cuda.get_device_capability(x2.device)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


def run_linear(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> torch.Tensor:
    """``x2 (M, K) @ dequant(W).T + bias`` with the given launch configuration (no super weights; the ``gemm``
    path is :func:`dynaquant.kernels.triton_gemm.run_gemm`)."""
    if cfg.path == "dequant":
        w = dequantize(packed, x2.dtype, cfg)
        return torch.nn.functional.linear(x2, w, bias)
    kernel, grid, args, kwargs, y = _launch_args(x2, packed, bias, cfg)
    kernel[grid](*args, **kwargs)
    return y


def compile_linear(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> None:
    """Compile (without running) the kernel :func:`run_linear` would launch; safe to call from threads."""
    if cfg.path == "dequant":
        n, k = packed.shape
        kw, kh, ng = packed_words(packed)
        ngt = cfg.groups if ng % cfg.groups == 0 else 1
        out = torch.empty(1, dtype=x2.dtype, device=x2.device)
        qh = packed.qweight_hi if packed.qweight_hi is not None else packed.qweight
        z = packed.zeros if packed.zeros is not None else packed.scales
        _dequant_kernel.warmup(packed.qweight, qh, packed.scales, z, out, n, k, kw, kh, ng, out_multiplier(packed, False), MAGIC,
                               BLOCK_N=cfg.block_n, NGT=ngt, num_warps=4, grid=(1,), **format_constants(packed))
        return
    kernel, grid, args, kwargs, _ = _launch_args(x2[:1], packed, bias, cfg) if cfg.path == "gemv" else \
        _launch_args(x2, packed, bias, cfg)
    kernel.warmup(*args, grid=grid, **kwargs)
