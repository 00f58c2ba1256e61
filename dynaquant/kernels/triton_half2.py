"""Packed-half dot products of one word of symmetric INT4 / INT2 or FP4 (E2M1) codes with the activations (the
``half2`` GEMV).

The ``gemv`` path's default inner loop decodes every code to float32 on its own (a LOP3 and an FADD a
weight) and multiplies it with an FFMA: about four instructions a weight, and the GEMV stays far from
the memory bound. Here two codes at a time are decoded into one ``f16x2`` register with the magic-number
trick of FasterTransformer / Marlin (``lop3``: mask the two codes in place, OR the fp16 exponent of 1024,
giving ``1024 + 2**p * code`` in each half exactly), brought to ``(code - zero) / 16`` with one ``fma.rn.f16x2``
(exact: ``(1024 + 2**p c) * 2**(-p-4) - (1024 * 2**-p + zero) / 16``), and multiplied with a pair of activations by
``fma.rn.f16x2``: a word of 8 INT4 codes costs 1 shift, 4 LOP3, 4 HFMA2 for the codes, 4 HFMA2 for the
products and 3 instructions to add its two halves into float32 (~2 a weight; INT2: 16 codes in ~1.7 a
weight). FP4 (E2M1, MXFP4 / NVFP4): a pair's magnitude bits are moved to fp16 bits 9..11 and its signs to bit 15
(two shifts, two LOP3: ``e2m1 * 2**-14`` exactly, 0.5 as a subnormal), one ``mul.rn.f16x2`` gives ``e2m1 / 16``.

Numerics: the products and their sum within one word (4 products a half for INT4 and FP4, 8 for INT2) are fp16; the
sums over words, groups and the scales are float32. The activations enter as fp16 (a bf16 activation is
exact in fp16 from ``|x| = 2**-14`` to 65504; subnormal, ~6e-8 absolute, below; larger ones overflow), the
codes as ``(code - zero) / 16`` (so a word's partial sums stay below ``2 |x|``; the caller multiplies the
result by :data:`X_UNSCALE`). Relative error per word about ``2**-11`` (fp16 rounding), below the bf16
output's ``2**-8``.

Pairing: the word's codes ``i`` and ``i + E/2`` (``E`` codes a word) share a register (low and high half),
so the activations are packed in the same pairs (:func:`_pack_pair`). Under Triton's interpreter (no PTX)
:func:`word_dot` computes the same pairing in float32 from the packed activations, so the packing is
tested on CPU; the PTX runs in the native tests.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

CODE_SCALE = 2.0 ** -4
X_UNSCALE = tl.constexpr(1.0 / CODE_SCALE)


def _half(v: float) -> int:
    return int(np.array(v, dtype=np.float16).view(np.uint16))


def _pair(v: float) -> str:
    h = _half(v)
    return f"0x{(h << 16) | h:08X}"


def _int_codes(bits: int, src: str, shifted: str) -> list[str]:
    """PTX turning the INT4 / INT2 word ``src`` (``shifted`` = ``src >> 8``) into f16x2 ``t<j>`` = ``(code - zero) / 16``
    of codes j and j + per_half."""
    epw = 32 // bits
    mask = (1 << bits) - 1
    zero = 1 << (bits - 1)
    codes_per_byte = 8 // bits
    lines = [f"shr.u32 {shifted}, {src}, 8;"]
    for j in range(epw // 2):
        p = bits * (j % codes_per_byte)  # bit position within its byte
        m = (mask << p) | (mask << (p + 16))
        lines.append(f"lop3.b32 t{j}, {src if j < codes_per_byte else shifted}, 0x{m:08X}, 0x64006400, 0xEA;")
        lines.append(f"mov.b32 sc, {_pair(2.0 ** -p * CODE_SCALE)};")
        lines.append(f"mov.b32 bi, {_pair(-(1024.0 * 2.0 ** -p + zero) * CODE_SCALE)};")
        lines.append(f"fma.rn.f16x2 t{j}, t{j}, sc, bi;")  # (code - zero) / 16, exact
    return lines


def _fp4_codes(src: str) -> list[str]:
    """PTX turning the E2M1 word ``src`` into f16x2 ``t<j>`` = ``e2m1 / 16`` of nibbles j and j + 4: the magnitude
    bits move to fp16 bits 9..11 (an fp16 of ``e2m1 * 2**-14``, subnormal for 0.5, exactly) and the sign to bit 15,
    then one ``mul.rn.f16x2`` by ``2**10``."""
    lines = []
    for j in range(4):
        sa, sb = 9 - 4 * j, 12 - 4 * j
        lines.append(f"shl.b32 a, {src}, {sa};" if sa >= 0 else f"shr.u32 a, {src}, {-sa};")
        lines.append(f"shl.b32 b, {src}, {sb};" if sb > 0 else f"mov.b32 b, {src};")
        lines.append(f"lop3.b32 t{j}, a, 0x0E000E00, 0, 0xC0;")  # a & magnitude mask
        lines.append(f"lop3.b32 t{j}, b, 0x80008000, t{j}, 0xEA;")  # | (b & sign mask)
        lines.append(f"mul.rn.f16x2 t{j}, t{j}, k;")
    return lines


def _words_asm(bits: int, fp4: bool, words: int = 1) -> str:
    """PTX of the dot product of ``words`` words with their f16x2 activation pairs: ``$0`` = float32 sum, ``$1 ..
    $words`` = the words, then each word's pairs in turn (``16 / bits`` each). The products of all the words are
    summed in one f16x2 register (``words * 16 / bits`` a half), converted to float32 once."""
    npairs = 16 // bits
    lines = ["{", ".reg .b32 w8, acc, sc, bi, a, b, k;", f".reg .b32 t<{npairs}>;", ".reg .b16 lo, hi;",
             ".reg .f32 flo, fhi;"]
    if fp4:
        lines.append(f"mov.b32 k, {_pair(2.0 ** 14 * CODE_SCALE)};")
    for i in range(words):
        lines += _fp4_codes(f"${i + 1}") if fp4 else _int_codes(bits, f"${i + 1}", "w8")
        for j in range(npairs):
            x = f"${1 + words + i * npairs + j}"
            lines.append(f"mul.rn.f16x2 acc, t{j}, {x};" if i == 0 and j == 0 else f"fma.rn.f16x2 acc, t{j}, {x}, acc;")
    lines += ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;", "}"]
    return "\n".join(lines)


FP4_ASM = tl.constexpr(_words_asm(4, True))
INT4_ASM = tl.constexpr(_words_asm(4, False))
INT2_ASM = tl.constexpr(_words_asm(2, False))
INT4_CONSTRAINTS = tl.constexpr("=f" + ",r" * 5)
INT2_CONSTRAINTS = tl.constexpr("=f" + ",r" * 9)
FP4_ASM2 = tl.constexpr(_words_asm(4, True, 2))
INT4_ASM2 = tl.constexpr(_words_asm(4, False, 2))
INT2_ASM2 = tl.constexpr(_words_asm(2, False, 2))
INT4_CONSTRAINTS2 = tl.constexpr("=f" + ",r" * 10)
INT2_CONSTRAINTS2 = tl.constexpr("=f" + ",r" * 18)


@triton.jit
def _pack_pair(lo, hi, ASM: tl.constexpr):
    """Two float32 tensors -> int32 holding ``(fp16(lo), fp16(hi))`` as (low, high) halves (ASM: one ``cvt`` of
    both; a single-value ``F2F`` conversion issues at a quarter of the rate)."""
    if ASM:
        out = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        a = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        b = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        out = a | (b << 16)
    return out


@triton.jit
def _x_at(x_ptr, kb, i):
    return tl.load(x_ptr + kb + i).to(tl.float32)


@triton.jit
def _half_value(p, HIGH: tl.constexpr):
    """Low or high fp16 half of packed int32 ``p`` as float32 (the interpreter's stand-in for the PTX)."""
    if HIGH:
        h = p >> 16
    else:
        h = p
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _code(w, zero, IDX: tl.constexpr, BITS: tl.constexpr):
    return (((w >> (BITS * IDX)) & ((1 << BITS) - 1)).to(tl.float32) - zero) * (1.0 / X_UNSCALE)


@triton.jit
def _e2m1(w, IDX: tl.constexpr):
    """E2M1 nibble IDX of the words as float32 ``e2m1 / 16`` (interpreter path)."""
    n = (w >> (4 * IDX)) & 15
    e = (n >> 1) & 3
    mag = tl.where(e == 0, 0.5 * (n & 1).to(tl.float32),
                   (1.0 + 0.5 * (n & 1).to(tl.float32)) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((n & 8) != 0, -mag, mag) * (1.0 / X_UNSCALE)


@triton.jit
def _pair_dot(w, p, J: tl.constexpr, BITS: tl.constexpr, FP4: tl.constexpr):
    """Pair J's two products (codes J and J + 16 / BITS) in float32 (interpreter path)."""
    Z: tl.constexpr = 1 << (BITS - 1)
    H: tl.constexpr = 16 // BITS
    if FP4:
        out = _e2m1(w, J) * _half_value(p, False) + _e2m1(w, J + H) * _half_value(p, True)
    else:
        out = _code(w, Z, J, BITS) * _half_value(p, False) + _code(w, Z, J + H, BITS) * _half_value(p, True)
    return out


@triton.jit
def _pairs4(x_ptr, kb, H: tl.constexpr, J: tl.constexpr, ASM: tl.constexpr):
    """Activation pairs J .. J + 3 of words starting at K index ``kb`` (pairs ``(i, i + H)``), each [1, ...]."""
    p0 = tl.expand_dims(_pack_pair(_x_at(x_ptr, kb, J), _x_at(x_ptr, kb, H + J), ASM), 0)
    p1 = tl.expand_dims(_pack_pair(_x_at(x_ptr, kb, J + 1), _x_at(x_ptr, kb, H + J + 1), ASM), 0)
    p2 = tl.expand_dims(_pack_pair(_x_at(x_ptr, kb, J + 2), _x_at(x_ptr, kb, H + J + 2), ASM), 0)
    p3 = tl.expand_dims(_pack_pair(_x_at(x_ptr, kb, J + 3), _x_at(x_ptr, kb, H + J + 3), ASM), 0)
    return p0, p1, p2, p3


@triton.jit
def word_pair_dot(wa, wb, x_ptr, kba, kbb, BITS: tl.constexpr, ASM: tl.constexpr, FP4: tl.constexpr = False):
    """Dot products of two words at a time, ``wa`` and ``wb`` [R, C] (K indices from ``kba`` and ``kbb`` [C]), with
    both words' products summed in one f16x2 register before the float32 conversion (``2 * 16 / BITS`` products a
    half; :func:`word_dot` has half as many): float32 [R, C], 1/16 of the products' sums. Interpreter: float32."""
    H: tl.constexpr = 16 // BITS
    a0, a1, a2, a3 = _pairs4(x_ptr, kba, H, 0, ASM)
    b0, b1, b2, b3 = _pairs4(x_ptr, kbb, H, 0, ASM)
    if BITS == 4:
        if ASM:
            out = tl.inline_asm_elementwise(FP4_ASM2 if FP4 else INT4_ASM2, INT4_CONSTRAINTS2,
                                            [wa, wb, a0, a1, a2, a3, b0, b1, b2, b3], dtype=tl.float32, is_pure=True,
                                            pack=1)
        else:
            out = (_pair_dot(wa, a0, 0, 4, FP4) + _pair_dot(wa, a1, 1, 4, FP4) + _pair_dot(wa, a2, 2, 4, FP4)
                   + _pair_dot(wa, a3, 3, 4, FP4) + _pair_dot(wb, b0, 0, 4, FP4) + _pair_dot(wb, b1, 1, 4, FP4)
                   + _pair_dot(wb, b2, 2, 4, FP4) + _pair_dot(wb, b3, 3, 4, FP4))
    else:
        a4, a5, a6, a7 = _pairs4(x_ptr, kba, H, 4, ASM)
        b4, b5, b6, b7 = _pairs4(x_ptr, kbb, H, 4, ASM)
        if ASM:
            out = tl.inline_asm_elementwise(INT2_ASM2, INT2_CONSTRAINTS2,
                                            [wa, wb, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7],
                                            dtype=tl.float32, is_pure=True, pack=1)
        else:
            out = (_pair_dot(wa, a0, 0, 2, False) + _pair_dot(wa, a1, 1, 2, False) + _pair_dot(wa, a2, 2, 2, False)
                   + _pair_dot(wa, a3, 3, 2, False) + _pair_dot(wa, a4, 4, 2, False) + _pair_dot(wa, a5, 5, 2, False)
                   + _pair_dot(wa, a6, 6, 2, False) + _pair_dot(wa, a7, 7, 2, False) + _pair_dot(wb, b0, 0, 2, False)
                   + _pair_dot(wb, b1, 1, 2, False) + _pair_dot(wb, b2, 2, 2, False) + _pair_dot(wb, b3, 3, 2, False)
                   + _pair_dot(wb, b4, 4, 2, False) + _pair_dot(wb, b5, 5, 2, False) + _pair_dot(wb, b6, 6, 2, False)
                   + _pair_dot(wb, b7, 7, 2, False))
    return out


@triton.jit
def x_pairs(x_ptr, kb, BITS: tl.constexpr, ASM: tl.constexpr):
    """The activation pairs of words whose first K index is ``kb`` [W]: int32 [W] each, pair ``j`` holding
    ``(fp16(x[kb + j]), fp16(x[kb + j + 16 / BITS]))`` (low, high), j = 0 .. 16 / BITS - 1 (INT4 / FP4: 4, INT2: 8;
    for INT4 / FP4 the last four are copies of the first, unused). :func:`pairs_dot` takes them, expanded."""
    H: tl.constexpr = 16 // BITS
    p0 = _pack_pair(_x_at(x_ptr, kb, 0), _x_at(x_ptr, kb, H), ASM)
    p1 = _pack_pair(_x_at(x_ptr, kb, 1), _x_at(x_ptr, kb, H + 1), ASM)
    p2 = _pack_pair(_x_at(x_ptr, kb, 2), _x_at(x_ptr, kb, H + 2), ASM)
    p3 = _pack_pair(_x_at(x_ptr, kb, 3), _x_at(x_ptr, kb, H + 3), ASM)
    if BITS == 4:
        p4 = p0
        p5 = p0
        p6 = p0
        p7 = p0
    else:
        p4 = _pack_pair(_x_at(x_ptr, kb, 4), _x_at(x_ptr, kb, H + 4), ASM)
        p5 = _pack_pair(_x_at(x_ptr, kb, 5), _x_at(x_ptr, kb, H + 5), ASM)
        p6 = _pack_pair(_x_at(x_ptr, kb, 6), _x_at(x_ptr, kb, H + 6), ASM)
        p7 = _pack_pair(_x_at(x_ptr, kb, 7), _x_at(x_ptr, kb, H + 7), ASM)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def pairs_dot(w, p0, p1, p2, p3, p4, p5, p6, p7, BITS: tl.constexpr, ASM: tl.constexpr, FP4: tl.constexpr = False):
    """Dot products of words ``w`` [R, W] with their activation pairs (:func:`x_pairs`, each [1, W] or [R, W]):
    float32 [R, W], 1/16 of the products' sums (see :func:`word_dot`; INT4 / FP4 read ``p0 .. p3`` only)."""
    if BITS == 4:
        if ASM:
            out = tl.inline_asm_elementwise(FP4_ASM if FP4 else INT4_ASM, INT4_CONSTRAINTS, [w, p0, p1, p2, p3],
                                            dtype=tl.float32, is_pure=True, pack=1)
        else:
            out = (_pair_dot(w, p0, 0, 4, FP4) + _pair_dot(w, p1, 1, 4, FP4) + _pair_dot(w, p2, 2, 4, FP4)
                   + _pair_dot(w, p3, 3, 4, FP4))
    else:
        if ASM:
            out = tl.inline_asm_elementwise(INT2_ASM, INT2_CONSTRAINTS, [w, p0, p1, p2, p3, p4, p5, p6, p7],
                                            dtype=tl.float32, is_pure=True, pack=1)
        else:
            out = (_pair_dot(w, p0, 0, 2, False) + _pair_dot(w, p1, 1, 2, False) + _pair_dot(w, p2, 2, 2, False)
                   + _pair_dot(w, p3, 3, 2, False) + _pair_dot(w, p4, 4, 2, False) + _pair_dot(w, p5, 5, 2, False)
                   + _pair_dot(w, p6, 6, 2, False) + _pair_dot(w, p7, 7, 2, False))
    return out


@triton.jit
def word_dot(w, x_ptr, kb, BITS: tl.constexpr, ASM: tl.constexpr, FP4: tl.constexpr = False):
    """Dot products of words ``w`` [R, W] (symmetric INT4 or INT2 codes, or with FP4 E2M1 codes, natural order) with
    the activations ``x_ptr[kb + i]`` (``kb`` [W]: each word's first K index): float32 [R, W], 1/16 of the products'
    sums (multiply the sum by :data:`X_UNSCALE`). ``ASM``: the f16x2 PTX (GPU); else float32 of the same pairs
    (interpreter)."""
    p0, p1, p2, p3, p4, p5, p6, p7 = x_pairs(x_ptr, kb, BITS, ASM)
    return pairs_dot(w, p0[None, :], p1[None, :], p2[None, :], p3[None, :], p4[None, :], p5[None, :], p6[None, :],
                     p7[None, :], BITS, ASM, FP4)
