"""Triton kernels of :mod:`dynaquant.kernels.grouped`: every routed expert of a mixture-of-experts layer in one launch,
on the layout of :mod:`dynaquant.kernels.packing` (the experts' weights stacked along N) and with the element
decoders of :mod:`.triton_linear` (imported lazily, as that module: importing this one imports Triton).

Two product kernels: :func:`_grouped_kernel`, the tensor-core tile of ``triton_linear``'s small-batch kernel with its
rows taken from a routing block's expert-sorted slots, and :func:`_grouped_gemv_kernel`, one program a slot on the
CUDA cores (the dense GEMV's loop), for a few slots an expert; and :func:`_route_kernel`, the routing table of
:func:`dynaquant.kernels.grouped.route` in one program (a layer's dozen small torch kernels in one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynaquant.kernels.packing import PackedWeight
from dynaquant.kernels.triton_half2 import X_UNSCALE, word_dot
from dynaquant.kernels.triton_linear import (
    MAGIC,
    _gemv_part,
    format_constants,
    group_scale,
    hi_source,
    interpreting,
    out_multiplier,
    packed_words,
    tile_values,
)
from dynaquant.kernels.tuning import has_half2

# ----------------------------------------------------------------------------------------------
# the routing table in one program

@triton.jit
def _route_keys(idx_ptr, s, S, E):
    """Slot ``s``'s bucket: its expert, E for a skipped choice (outside ``0 .. E-1``), E + 1 past the S slots."""
    v = tl.load(idx_ptr + s, mask=s < S, other=0)
    key = tl.where((v >= 0) & (v < E), v, E).to(tl.int32)
    return tl.where(s < S, key, E + 1)


@triton.jit
def _route_kernel(idx_ptr, order_ptr, token_ptr, expert_ptr, bounds_ptr, eblock_ptr, bexp_ptr, S, K, E, NB,
                  SP: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, SC: tl.constexpr, BB: tl.constexpr,
                  NB_CHUNKS: tl.constexpr):
    """One program: :class:`dynaquant.kernels.grouped.Routing`'s tables for the S = T k choices ``idx`` (flat).
    Each slot's key is its bucket (:func:`_route_keys`, SP slots); the keys ``key SP + slot`` are distinct, so one
    (bitonic) sort of them orders the slots by expert, ties in slot order (a stable sort). Each expert's slot count
    (compared with the keys, SC slots at a time: no ``tl.histogram``, whose replicated layouts some Triton versions
    miscount), its prefix sums the bounds and, in blocks of BM slots, each expert's first block; block ``b``'s
    expert is the number of experts whose blocks end at or before ``b`` (the reference's
    ``searchsorted(right=True)``), BB blocks at a time. EP >= E + 1 expert lanes."""
    s = tl.arange(0, SP)
    live = s < S
    comp = tl.sort(_route_keys(idx_ptr, s, S, E) * SP + s)
    srt = comp // SP
    order = comp - srt * SP
    tl.store(order_ptr + s, order.to(tl.int64), mask=live)
    tl.store(token_ptr + s, (order // K).to(tl.int64), mask=live)
    tl.store(expert_ptr + s, srt.to(tl.int64), mask=live)
    ex = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    for c in range(SP // SC):
        key = _route_keys(idx_ptr, c * SC + tl.arange(0, SC), S, E)
        counts += tl.sum((key[None, :] == ex[:, None]).to(tl.int32), axis=1)
    bounds = tl.cumsum(counts, 0) - counts
    tl.store(bounds_ptr + ex, bounds.to(tl.int64), mask=ex <= E)
    blocks = tl.where(ex < E, (counts + (BM - 1)) // BM, 0)
    ends = tl.cumsum(blocks, 0)
    tl.store(eblock_ptr + ex, (ends - blocks).to(tl.int64), mask=ex < E)
    ends = tl.where(ex < E, ends, 1 << 30)
    for c in range(NB_CHUNKS):
        b = c * BB + tl.arange(0, BB)
        n = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(bexp_ptr + b, tl.minimum(n, E - 1).to(tl.int64), mask=b < NB)


def run_route(flat_index: torch.Tensor, k: int, num_experts: int, block_m: int,
              n_blocks: int) -> tuple[torch.Tensor, ...]:
    """The routing tables of :func:`dynaquant.kernels.grouped.route` for ``flat_index`` (S,) (contiguous integers,
    ``0 < S <= grouped.ROUTE_MAX_SLOTS``, ``num_experts <= grouped.ROUTE_MAX_EXPERTS``) in one launch: (order, token,
    expert, expert_bounds, expert_block, block_expert), int64, of sizes S, S, S, E + 1, E and ``n_blocks``."""
    s, e = flat_index.numel(), num_experts
    dev = flat_index.device
    sp = max(16, triton.next_power_of_2(s))
    ep = max(16, triton.next_power_of_2(e + 1))
    sc = min(sp, max(16, 4096 // ep))  # (an [EP, SC] comparison a step: 4096 lanes, 32 a thread at 4 warps)
    bb = max(16, 4096 // ep)
    out = [torch.empty(n, dtype=torch.int64, device=dev) for n in (s, s, s, e + 1, e, n_blocks)]
    _route_kernel[(1,)](flat_index, *out, s, k, e, n_blocks, SP=sp, EP=ep, BM=block_m, SC=sc, BB=bb,
                        NB_CHUNKS=triton.cdiv(triton.cdiv(sp, block_m) + min(e, sp), bb), num_warps=4)
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# mixture of experts: every routed expert of a layer in one launch


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """float32 ``x`` rounded to DT (to nearest even), as float32. bfloat16 by bit arithmetic: Triton's interpreter
    truncates a plain cast, and its ``rtne`` cast loses the carry into the exponent; compiled, the same values."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _act_mul(gate, up, DT: tl.constexpr, ACT: tl.constexpr):
    """``act(gate) * up`` (float32 in) in DT, rounded as the unfused path rounds: gate and up stored in DT, the
    activation rounded to DT, the product rounded to DT (torch's ``silu(g) * u`` on DT tensors).
    ACT 1: SiLU, ``g / (1 + e^-g)``."""
    g = _rounded(gate, DT)
    u = _rounded(up, DT)
    if ACT == 1:
        a = g / (1.0 + tl.exp(-g))
    return _rounded(_rounded(a, DT) * u, DT).to(DT)


@triton.jit
def _grouped_gemv_kernel(x_ptr, tok_ptr, exp_ptr, qw_ptr, qh_ptr, s_ptr, z_ptr, y_ptr, dst_ptr, w_ptr,
                         E, N, KW, KH, NG, stride_xm, stride_ym, out_mul, magic, NT, NT_C: tl.constexpr,
                         KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, ZC: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SCATTER: tl.constexpr, HALF2: tl.constexpr,
                         ASM: tl.constexpr, ACT: tl.constexpr):
    """Program (N tile, sorted slot ``s``): the slot's product on the CUDA cores, the dense GEMV's loop over words
    [BLOCK_N, BLOCK_KW] of its expert's rows (for a few slots an expert, where a 16-slot tensor-core tile would
    decode for one live row). A skipped choice (expert ``E``) computes nothing; with SCATTER it stores zeros at its
    original slot. HALF2: the packed-fp16 word products (:mod:`dynaquant.kernels.triton_half2`; ASM: their PTX).
    ACT (1: SiLU): the expert's N rows are gate (the first N / 2) and up; the program's BLOCK_N rows are BLOCK_N / 2
    output columns' gate and up rows, interleaved, and it stores ``act(gate) * up`` (:func:`_act_mul`), N / 2 columns."""
    EPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WPG: tl.constexpr = G // EPW
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    e = tl.load(exp_ptr + pid_s)
    if ACT:
        half = N // 2
        i = tl.arange(0, BLOCK_N)
        rows = tl.minimum(pid_n * (BLOCK_N // 2) + i // 2, half - 1) + (i % 2) * half  # gate, up, gate, up, ...
        rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_mask = rn < half
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rows = tl.minimum(rn, N - 1)
    if e < E:
        tok = tl.load(tok_ptr + pid_s)
        xrow = x_ptr + tok * stride_xm
        row = (rows + e * N)[:, None]
        rw = tl.arange(0, BLOCK_KW)
        wrow = qw_ptr + row * KW
        acc = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
        for t in range(0, NT_C if NT_C > 0 else NT):
            base = t * BLOCK_KW
            word = base + rw
            w = tl.load(wrow + word[None, :])
            goff = row * NG + (base // WPG + rw // WPG)[None, :]
            sc = group_scale(tl.load(s_ptr + goff), KIND)
            kb = word * EPW
            if HALF2:
                acc += word_dot(w, xrow, kb, BITS, ASM, KIND != 0) * sc
            else:
                acc += _gemv_part(w, xrow, kb, qh_ptr, z_ptr, row, KH, base, rw, goff, magic,
                                  KIND, BITS, ASYM, ZC, BLOCK_N, BLOCK_KW, EPW) * sc
        y = tl.sum(acc, axis=1) * out_mul
        if HALF2:
            y = y * X_UNSCALE
        if ACT:
            gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
            tl.store(y_ptr + pid_s * stride_ym + rn, _act_mul(gate, up, y_ptr.dtype.element_ty, ACT), mask=n_mask)
        else:
            if SCATTER:
                dst = tl.load(dst_ptr + pid_s)
                y = y * tl.load(w_ptr + dst).to(tl.float32)
            else:
                dst = pid_s
            tl.store(y_ptr + dst * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    elif SCATTER:
        dst = tl.load(dst_ptr + pid_s)
        tl.store(y_ptr + dst * stride_ym + rn, tl.zeros([BLOCK_N], dtype=y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _grouped_kernel(x_ptr, tok_ptr, be_ptr, eb_ptr, bounds_ptr, qw_ptr, qh_ptr, s_ptr, z_ptr, y_ptr, dst_ptr, w_ptr,
                    N, KW, KH, NG, stride_xm, stride_ym, out_mul, magic, NG_C: tl.constexpr,
                    KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, ZC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, SCATTER: tl.constexpr,
                    ACT: tl.constexpr):
    """Program (N tile, routing block ``b``): the block's slots (rows ``start .. end - 1`` of the expert-sorted order,
    all routed to expert ``e``; :class:`dynaquant.kernels.grouped.Routing`) times rows ``e N .. e N + N - 1`` of the
    experts' stacked layout; the slots' activation rows gathered through ``tok``. ``end <= start``: nothing to do.
    SCATTER: each product times its slot's weight ``w[dst]``, stored at row ``dst`` (the slot's original index).
    ACT: gate and up rows interleaved in the tile, ``act(gate) * up`` stored (as :func:`_grouped_gemv_kernel`)."""
    EPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WPG: tl.constexpr = G // EPW
    DT: tl.constexpr = tl.float32 if DOT_F32 else x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    e = tl.load(be_ptr + pid_b)
    start = tl.load(bounds_ptr + e) + (pid_b - tl.load(eb_ptr + e)) * BLOCK_M
    end = tl.minimum(start + BLOCK_M, tl.load(bounds_ptr + e + 1))
    if end > start:
        if ACT:
            half = N // 2
            i = tl.arange(0, BLOCK_N)
            rowv = tl.minimum(pid_n * (BLOCK_N // 2) + i // 2, half - 1) + (i % 2) * half + e * N
            rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            n_mask = rn < half
        else:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = rn < N
            rowv = tl.minimum(rn, N - 1) + e * N
        row = rowv[:, None]
        rm = start + tl.arange(0, BLOCK_M)
        m_mask = rm < end
        tok = tl.load(tok_ptr + rm, mask=m_mask, other=0).to(tl.int64)
        rw = tl.arange(0, WPG)
        rk = tl.arange(0, G)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for gi in range(0, NG_C if NG_C > 0 else NG):
            word = gi * WPG + rw
            w = tl.load(qw_ptr + row * KW + word[None, :])  # [BLOCK_N, WPG]
            if ASYM:
                zoff = tl.load(z_ptr + row * NG + gi).to(tl.float32)
            else:
                zoff = ZC
            hsrc = hi_source(w, qh_ptr, row, KH, word, BITS)
            wt = tile_values(w, hsrc, zoff, magic, KIND, BITS, EPW, DT)  # [BLOCK_N, G]
            xt = tl.load(x_ptr + tok[None, :] * stride_xm + (gi * G + rk)[:, None], mask=m_mask[None, :], other=0.0)
            d = tl.dot(wt, xt.to(DT))  # [BLOCK_N, BLOCK_M]
            sc = group_scale(tl.load(s_ptr + rowv * NG + gi), KIND)
            acc += d * sc[:, None]
        out = acc * out_mul
        if ACT:
            gate, up = tl.split(tl.reshape(tl.trans(out), [BLOCK_M, BLOCK_N // 2, 2]))  # [BLOCK_M, BLOCK_N / 2]
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], _act_mul(gate, up, y_ptr.dtype.element_ty, ACT),
                     mask=m_mask[:, None] & n_mask[None, :])
        else:
            if SCATTER:
                dst = tl.load(dst_ptr + rm, mask=m_mask, other=0)
                out = out * tl.load(w_ptr + dst, mask=m_mask, other=0.0).to(tl.float32)[None, :]
            else:
                dst = rm
            tl.store(y_ptr + dst[None, :] * stride_ym + rn[:, None], out.to(y_ptr.dtype.element_ty),
                     mask=n_mask[:, None] & m_mask[None, :])


def _gemv_words(packed: PackedWeight, kw: int, most: int = 16) -> int:
    """Words a row per GEMV iteration: whole groups (up to ``most`` words, dividing the row), or one group for
    asymmetric formats (their zero point is one per tile)."""
    f = packed.fmt
    wpg = f.group_size // (16 if f.bits == 3 else 32 // f.bits)
    if not f.symmetric:
        return wpg
    m = 1
    while wpg * m * 2 <= most and kw % (wpg * m * 2) == 0:
        m *= 2
    return wpg * m


ACT_IDS = {"silu": 1}  # the gate/up epilogue's activations (``act`` of :func:`run_grouped`): the kernels' ACT


def run_grouped(x2: torch.Tensor, rows: torch.Tensor, packed: PackedWeight, routing, block_n: int = 64,
                num_warps: int = 4, num_stages: int = 1, slot_weights: torch.Tensor | None = None,
                gemv: bool = False, half2: bool = False, words: int = 16, act: str | None = None) -> torch.Tensor:
    """(S, N) = for each sorted slot ``s`` of ``routing`` (:class:`dynaquant.kernels.grouped.Routing`):
    ``x2[rows[s]] @ dequant(W_e).T`` with ``e`` its expert, for the experts' stacked layout ``packed`` (E N rows);
    rows of skipped slots left unwritten. ``slot_weights`` (S,): each product times its slot's weight, at its
    original slot index (rows of skipped slots zero). ``gemv``: one program a slot and N tile on the CUDA cores
    (:func:`_grouped_gemv_kernel`) instead of the routing blocks' tensor-core tiles, with K tiles of up to ``words``
    words a row, and (``half2``, symmetric INT4 / INT2 only) the packed-fp16 word products. ``act`` (a key of
    ``ACT_IDS``, not with ``slot_weights``): each expert's N rows are gate then up, and the result is
    (S, N / 2) ``act(gate) * up``, each program's ``block_n`` rows ``block_n / 2`` columns' gate and up."""
    n = packed.out_features // routing.num_experts
    kw, kh, ng = packed_words(packed)
    scatter = slot_weights is not None
    act_id = ACT_IDS[act] if act is not None else 0
    if act_id and (scatter or n % 2 or block_n < 2):
        raise ValueError(f"act needs an even N, block_n >= 2 and no slot weights (N = {n}, block_n = {block_n})")
    n_out = n // 2 if act_id else n
    alloc = torch.zeros if scatter and not gemv else torch.empty  # (the GEMV writes skipped slots' zeros itself)
    y = alloc(routing.slots, n_out, dtype=x2.dtype, device=x2.device)
    qh = packed.qweight_hi if packed.qweight_hi is not None else packed.qweight
    z = packed.zeros if packed.zeros is not None else packed.scales
    grid_n = triton.cdiv(n_out, block_n // 2 if act_id else block_n)
    if gemv:
        if half2 and not has_half2(packed.fmt):
            raise ValueError(f"{packed.fmt.name}: half2 needs symmetric INT4 / INT2 or FP4 codes")
        bkw = _gemv_words(packed, kw, words)
        nt = kw // bkw
        _grouped_gemv_kernel[(grid_n, routing.slots)](
            x2, rows, routing.expert, packed.qweight, qh, packed.scales, z, y, routing.order,
            slot_weights if scatter else y, routing.num_experts, n, kw, kh, ng, x2.stride(0), y.stride(0),
            out_multiplier(packed, not half2), MAGIC, nt, NT_C=nt if interpreting() else 0, BLOCK_N=block_n,
            BLOCK_KW=bkw, SCATTER=scatter, HALF2=half2, ASM=not interpreting(), ACT=act_id, num_warps=num_warps,
            num_stages=num_stages, **format_constants(packed))
        return y
    _grouped_kernel[(grid_n, routing.block_expert.numel())](
        x2, rows, routing.block_expert, routing.expert_block, routing.expert_bounds, packed.qweight, qh,
        packed.scales, z, y, routing.order, slot_weights if scatter else y, n, kw, kh, ng, x2.stride(0), y.stride(0),
        out_multiplier(packed, False), MAGIC, NG_C=ng if interpreting() else 0, BLOCK_M=routing.block_m,
        BLOCK_N=block_n, DOT_F32=interpreting(), SCATTER=scatter, ACT=act_id, num_warps=num_warps,
        num_stages=num_stages, **format_constants(packed))
    return y
