"""GGUF K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K: super-blocks of 256 weights.

Layouts follow llama.cpp's ``ggml-common.h`` (``block_q2_K`` ... ``block_q6_K``); decoding
repeats gguf-py's ``gguf.quants`` float32 operations in the same order, so it equals
``gguf.quants.dequantize`` bit for bit.

=====  =====  ========================================================================
type   bytes  layout (offsets in bytes)                 decoded weight
=====  =====  ========================================================================
Q2_K   84     scales[16] (lo nibble: scale, hi: min),    ``d*sc*q - dmin*m``, q in 0..3,
              qs[64] (2-bit), d, dmin (fp16)             16 sub-blocks of 16
Q3_K   110    hmask[32] (high bit), qs[64] (low 2 bits), ``d*(sc-32)*(q-4)``, q in 0..7,
              scales[12] (16 x 6 bit), d                 16 sub-blocks of 16
Q4_K   144    d, dmin, scales[12] (8 scales + 8 mins,    ``d*sc*q - dmin*m``, q in 0..15,
              6 bit), qs[128] (4-bit)                    8 sub-blocks of 32
Q5_K   176    d, dmin, scales[12], qh[32], qs[128]       as Q4_K, q in 0..31
Q6_K   210    ql[128], qh[64], scales[16] (int8), d      ``d*sc*(q-32)``, q in 0..63,
                                                         16 sub-blocks of 16
=====  =====  ========================================================================

Encoders minimise the importance-weighted squared error of what decode reproduces
(float16 ``d``/``dmin``, quantized sub-block scales and mins, re-rounded codes). The default
is the thorough search of ``_kquant_search`` (each codec's ``search`` settings);
``fit_params(..., thorough=False)`` / ``encode_blocks(..., thorough=False)`` run the fast one of
:mod:`.kquant_fast` (each codec's ``fast`` settings: a few stacked candidate tensors a step; 2-10x
faster), not the default yet: its plans lost quality on the tiny-MoE tests (Q4_K_M output error
0.17 against 0.15 allowed; a router margin) that the thorough search passes. Everything is
batched torch on the input's device; on CUDA the thorough search's three steps run as fused
Triton kernels (the ``kquant.*`` fast paths of :mod:`.fastpaths`, registered by
:mod:`dynaquant.kernels`; ``backend`` chooses, as for the lattice i-quants).
"""

from __future__ import annotations

import torch

from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs import kquant_fast as kqf
from dynaquant.quant.codecs.base import Codec, ColumnGrid, get_codec, register
from dynaquant.quant.codecs.consts import device_constant
from dynaquant.quant.codecs.fastpaths import fast_path

QK_K = 256


# --------------------------------------------------------------------------- byte helpers


def _shifts(values, shape, device) -> torch.Tensor:
    return device_constant(values, torch.int32, device).reshape(shape)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(n,) float32 holding float16 values -> (n, 2) uint8, little-endian."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _f16_value(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).to(torch.float32).reshape(-1, 1)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).to(torch.uint8)


def _pack_crumbs(c: torch.Tensor) -> torch.Tensor:
    """2-bit codes (n, 256) -> qs (n, 64): byte ``32*h + l`` holds element ``128*h + 32*s + l``
    at bits ``2s`` (Q2_K/Q3_K ``qs``, and Q6_K ``qh`` for the high 2 bits)."""
    n = c.shape[0]
    c = c.to(torch.int32).reshape(n, 2, 4, 32) << _shifts([0, 2, 4, 6], (1, 1, 4, 1), c.device)
    return _u8(c.sum(2).reshape(n, 64))


def _unpack_crumbs(b: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_pack_crumbs``: (n, 64) uint8 -> (n, 256) int32."""
    n = b.shape[0]
    c = (b.to(torch.int32).reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)) & 3
    return c.reshape(n, QK_K)


def _pack_bitplanes(h: torch.Tensor) -> torch.Tensor:
    """1-bit values (n, 256) -> (n, 32): element ``32*i + l`` at bit ``i`` of byte ``l``
    (Q3_K ``hmask``, Q5_K ``qh``)."""
    n = h.shape[0]
    h = h.to(torch.int32).reshape(n, 8, 32) << _shifts(list(range(8)), (1, 8, 1), h.device)
    return _u8(h.sum(1))


def _unpack_bitplanes(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    return ((b.to(torch.int32).reshape(n, 1, 32) >> _shifts(list(range(8)), (1, 8, 1), b.device)) & 1).reshape(n, QK_K)


def _pack_nibbles(c: torch.Tensor) -> torch.Tensor:
    """4-bit codes (n, 256) -> (n, 128): byte ``32*g + l`` holds element ``64*g + l`` (low
    nibble) and ``64*g + 32 + l`` (high nibble) (Q4_K/Q5_K ``qs``)."""
    n = c.shape[0]
    c = c.to(torch.int32).reshape(n, 4, 2, 32)
    return _u8((c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, 128))


def _unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    return ((b.to(torch.int32).reshape(n, 4, 1, 32) >> _shifts([0, 4], (1, 1, 2, 1), b.device)) & 15).reshape(n, QK_K)


def _pack_scale_min_k4(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins (n, 8) -> the 12 ``scales`` bytes of Q4_K/Q5_K
    (llama.cpp ``get_scale_min_k4`` reads them back)."""
    sc, m = sc.to(torch.int32), m.to(torch.int32)
    b0 = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b4 = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    b8 = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return _u8(torch.cat([b0, b4, b8], 1))


def _unpack_scale_min_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = b.to(torch.int32).reshape(-1, 3, 4)
    d, m, md = b[:, 0], b[:, 1], b[:, 2]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], 1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], 1)
    return sc, mn


def _pack_scales_q3(s: torch.Tensor) -> torch.Tensor:
    """Sixteen 6-bit values (n, 16) in 0..63 -> Q3_K's 12 ``scales`` bytes: low nibbles of
    ``j`` and ``j + 8`` share byte ``j``; the top 2 bits of ``j`` sit in byte ``8 + j % 4`` at
    bit ``2 * (j // 4)``."""
    s = s.to(torch.int32)
    lo = (s[:, :8] & 15) | ((s[:, 8:] & 15) << 4)
    hi = ((s >> 4).reshape(-1, 4, 4) << _shifts([0, 2, 4, 6], (1, 4, 1), s.device)).sum(1)
    return _u8(torch.cat([lo, hi], 1))


def _unpack_scales_q3(b: torch.Tensor) -> torch.Tensor:
    b = b.to(torch.int32)
    lo = torch.cat([b[:, :8] & 15, b[:, :8] >> 4], 1)
    hi = ((b[:, 8:12].reshape(-1, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), b.device)) & 3).reshape(-1, 16)
    return lo | (hi << 4)


# --------------------------------------------------------------------------- codecs


def _grid(lo: float, hi: float, step: float) -> tuple[float, ...]:
    n = round((hi - lo) / step)
    return tuple(lo + i * step for i in range(n + 1))


def _geom(lo: float, ratio: float, n: int) -> tuple[float, ...]:
    return tuple(lo * ratio**i for i in range(n))


class _KQuant(Codec):
    """A K-quant: 256-weight super-blocks; subclasses give the layout and the search.

    ``encode_blocks(x, w)``: (n, 256) float32 weights and importance -> (n, type_size) uint8.
    ``decode_blocks(b)``: (n, type_size) uint8 -> (n, 256) float32, as ``gguf.quants.dequantize``.
    Both raise ValueError on other shapes.

    Block parameters (:meth:`fit_params`): exactly what a super-block stores besides its
    codes: ``SymConfig`` (Q3_K, Q6_K: fp16 ``d``, integer sub-scales ``k``) or ``AffConfig``
    (Q2_K, Q4_K, Q5_K: fp16 ``d``, ``dmin``, integer sub-scales ``ks`` and mins ``km``) of
    ``_kquant_search``. Codes (:meth:`round_to_grid`, :meth:`pack`): the stored unsigned
    values, ``q - qlo`` for the symmetric types (Q3_K ``0..7``, Q6_K ``0..63``), ``q`` for
    the affine ones.
    """

    n_sub: int
    search: kqs.AffSearch | kqs.SymSearch
    fast: kqf.FastAff | kqf.FastSym

    fast_paths = True

    def encode_blocks(
        self, x: torch.Tensor, w: torch.Tensor, thorough: bool = True, backend: str = "auto", variant: str | None = None
    ) -> torch.Tensor:
        """As :meth:`Codec.encode_blocks`; ``thorough=False`` runs the fast search of :mod:`.kquant_fast`;
        ``backend`` chooses the thorough search's fused kernels (``kquant.*`` of
        :mod:`.fastpaths`: on CUDA tensors under ``"auto"``; on CPU tensors the compiled search; for Q3_K and
        Q6_K under ``"auto"`` also :func:`sym_bytes_torch`'s fast path, compiled on CPU, Triton on CUDA);
        ``variant`` is unused."""
        params = self.fit_params(x, w, thorough=thorough, backend=backend)
        if isinstance(params, kqs.SymConfig) and backend in ("auto", "native"):  # Q3_K, Q6_K: codes and bytes compiled
            fn = fast_path("kquant.sym_bytes", x, backend)
            if fn is not None:
                return fn(self.format_name, x, params)
        return self.pack(params, self._block_codes(x, params))

    def _block_codes(self, x: torch.Tensor, params) -> torch.Tensor:
        """:meth:`round_to_grid`'s codes of whole (n, 256) blocks, (n, 256) int64: the same roundings, each sub-block's
        scale broadcast over its elements instead of gathered a column."""
        n = x.shape[0]
        x3 = x.float().reshape(n, self.n_sub, -1)
        sp = self.search
        if isinstance(sp, kqs.AffSearch):
            q = kqs.aff_codes(x3, *params.sub_scales(), sp.qmax)
        else:
            q = kqs.sym_codes(x3, params.sub_scales(), sp.qlo, sp.qhi).sub_(sp.qlo)
        return q.reshape(n, QK_K).to(torch.int64)

    def fit_params(
        self, x: torch.Tensor, w: torch.Tensor, thorough: bool = True, backend: str = "auto"
    ) -> kqs.AffConfig | kqs.SymConfig:
        """Search the scales of (n, 256) blocks; raises ValueError on other shapes.

        The default (``thorough=True``) is the search of ``_kquant_search`` (more candidates
        and element-level refinement moves); ``thorough=False`` the fast search of
        :mod:`.kquant_fast` (module docstring). ``backend``: the thorough search's fused
        kernels (:func:`dynaquant.quant.codecs.fastpaths.fast_path`; ``"auto"`` runs them on CUDA).
        """
        if x.ndim != 2 or x.shape[1] != QK_K or w.shape != x.shape:
            raise ValueError(
                f"{self.format_name}: expected x and w of shape (n_blocks, 256), got {tuple(x.shape)} and {tuple(w.shape)}"
            )
        n = x.shape[0]
        x3 = x.float().reshape(n, self.n_sub, -1)
        w3 = w.float().reshape(n, self.n_sub, -1)
        if thorough:
            sp = self.search
            if isinstance(sp, kqs.AffSearch):
                return kqs.aff_encode(x3, w3, sp, backend)
            return kqs.sym_encode(x3, w3, sp, backend)
        fp = self.fast
        return kqf.aff_fast(x3, w3, fp) if isinstance(fp, kqf.FastAff) else kqf.sym_fast(x3, w3, fp)

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        n, m = x.shape
        if start < 0 or start + m > QK_K:
            raise ValueError(f"{self.format_name}: columns {start}..{start + m - 1} are outside a 256-block")
        # Each column's sub-block scale (and min), (n, m); the codes as the search rounds
        # them, on (n, m, 1) "sub-blocks" of one column.
        sub = torch.arange(start, start + m, device=x.device) // (QK_K // self.n_sub)
        x3 = x.float().unsqueeze(-1)
        sp = self.search
        if isinstance(sp, kqs.AffSearch):
            dl, ml = (t[:, sub] for t in params.sub_scales())
            q = kqs.aff_codes(x3, dl, ml, sp.qmax).squeeze(-1)
            return q.to(torch.int64), dl * q - ml
        dl = params.sub_scales()[:, sub]
        q = kqs.sym_codes(x3, dl, sp.qlo, sp.qhi).squeeze(-1)
        return (q - sp.qlo).to(torch.int64), dl * q

    def column_grid(self, params) -> ColumnGrid:
        """As :meth:`Codec.column_grid`: every column's sub-block scale (and min) and its inverse, (256, n_super),
        the numbers :meth:`round_to_grid` rounds with."""
        sp = self.search
        aff = isinstance(sp, kqs.AffSearch)
        dl, ml = params.sub_scales() if aff else (params.sub_scales(), None)
        sub = torch.arange(QK_K, device=dl.device) // (QK_K // self.n_sub)
        dl = dl[:, sub].t().contiguous()
        ml = None if ml is None else ml[:, sub].t().contiguous()
        return ColumnGrid(dl, kqs.inv(dl), ml, 0 if aff else sp.qlo, sp.qmax if aff else sp.qhi)

    def _check_bytes(self, b: torch.Tensor) -> int:
        """Number of blocks in ``b``; raises ValueError unless it is (n_blocks, type_size) uint8."""
        ts = self.format.type_size
        if b.dtype != torch.uint8 or b.ndim != 2 or b.shape[1] != ts:
            raise ValueError(f"{self.format_name}: expected (n_blocks, {ts}) uint8, got {tuple(b.shape)} {b.dtype}")
        return b.shape[0]


@register
class Q2_K(_KQuant):
    """``block_q2_K``: 2.625 bpw; 16 sub-blocks of 16 with 4-bit scales and mins."""

    format_name = "Q2_K"
    n_sub = 16
    search = kqs.AffSearch(
        qmax=3,
        kmax=15,
        steps=_grid(1.5, 4.0, 0.2),
        shifts=(0.0, 0.25, -0.25, 0.5),
        d_steps=_grid(8.0, 15.5, 0.25),
        moves=kqs.MOVES_WIDE,
        widen=True,
    )
    fast = kqf.FastAff(
        qmax=3, kmax=15, steps=_grid(2.0, 4.0, 0.25), shifts=(0.0,), d_steps=_geom(10.0, 1.1, 8), rounds=1
    )

    def pack(self, params: kqs.AffConfig, codes: torch.Tensor) -> torch.Tensor:
        cfg = params
        scales = _u8(cfg.ks | (cfg.km << 4))
        return torch.cat([scales, _pack_crumbs(codes), _f16_bytes(cfg.d), _f16_bytes(cfg.dmin)], 1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        n = self._check_bytes(b)
        sc = b[:, :16].to(torch.int32)
        d, dmin = _f16_value(b[:, 80:82]), _f16_value(b[:, 82:84])
        dl = (d * (sc & 15).to(torch.float32)).reshape(n, 16, 1)
        ml = (dmin * (sc >> 4).to(torch.float32)).reshape(n, 16, 1)
        q = _unpack_crumbs(b[:, 16:80]).reshape(n, 16, 16).to(torch.float32)
        return (dl * q - ml).reshape(n, QK_K)


@register
class Q3_K(_KQuant):
    """``block_q3_K``: 3.4375 bpw; 16 sub-blocks of 16 with signed 6-bit scales, codes -4..3."""

    format_name = "Q3_K"
    n_sub = 16
    search = kqs.SymSearch(
        qlo=-4, qhi=3, klo=-32, khi=31, d_steps=_grid(20.0, 32.5, 0.25), exhaustive=True,
        clip_steps=_geom(32.5 * 1.25, 1.25, 6),  # d down to max|A| / 124: an outlier sub-block's scale clipped
    )
    fast = kqf.FastSym(qlo=-4, qhi=3, klo=-32, khi=31, d_steps=_geom(28.0, 1.12, 11), exact=True)

    def pack(self, params: kqs.SymConfig, codes: torch.Tensor) -> torch.Tensor:
        cfg, L = params, codes
        return torch.cat(
            [_pack_bitplanes(L >> 2), _pack_crumbs(L & 3), _pack_scales_q3(cfg.k + 32), _f16_bytes(cfg.d)], 1
        )

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        n = self._check_bytes(b)
        d = _f16_value(b[:, 108:110])
        sc = (_unpack_scales_q3(b[:, 96:108]) - 32).to(torch.float32)
        dl = (d * sc).reshape(n, 16, 1)
        q = _unpack_crumbs(b[:, 32:96]) - ((1 - _unpack_bitplanes(b[:, :32])) << 2)
        return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, QK_K)


@register
class Q4_K(_KQuant):
    """``block_q4_K``: 4.5 bpw; 8 sub-blocks of 32 with 6-bit scales and mins."""

    format_name = "Q4_K"
    n_sub = 8
    search = kqs.AffSearch(
        qmax=15, kmax=63, steps=_grid(11.0, 16.0, 0.2), shifts=(0.0, 0.3, -0.3), d_steps=_grid(40.0, 63.5, 0.5)
    )
    fast = kqf.FastAff(qmax=15, kmax=63, steps=_grid(13.0, 16.0, 0.5), shifts=(0.0,), d_steps=_grid(52.0, 63.5, 1.0))

    def pack(self, params: kqs.AffConfig, codes: torch.Tensor) -> torch.Tensor:
        cfg = params
        return torch.cat(
            [_f16_bytes(cfg.d), _f16_bytes(cfg.dmin), _pack_scale_min_k4(cfg.ks, cfg.km), _pack_nibbles(codes)], 1
        )

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        self._check_bytes(b)
        return _decode_q45(b, _unpack_nibbles(b[:, 16:144]))


@register
class Q5_K(_KQuant):
    """``block_q5_K``: 5.5 bpw; 8 sub-blocks of 32 with 6-bit scales and mins."""

    format_name = "Q5_K"
    n_sub = 8
    search = kqs.AffSearch(
        qmax=31,
        kmax=63,
        steps=_grid(25.0, 32.0, 0.25),
        shifts=(0.0, 0.3, -0.3),
        d_steps=_grid(40.0, 63.5, 0.5),
        moves=kqs.MOVES_WIDE,
    )
    fast = kqf.FastAff(
        qmax=31, kmax=63, steps=_grid(29.0, 32.0, 0.5), shifts=(0.0, 0.3, -0.3), d_steps=_grid(52.0, 63.5, 1.0), rounds=1
    )

    def pack(self, params: kqs.AffConfig, codes: torch.Tensor) -> torch.Tensor:
        cfg, q = params, codes
        return torch.cat(
            [
                _f16_bytes(cfg.d),
                _f16_bytes(cfg.dmin),
                _pack_scale_min_k4(cfg.ks, cfg.km),
                _pack_bitplanes(q >> 4),
                _pack_nibbles(q & 15),
            ],
            1,
        )

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        self._check_bytes(b)
        q = _unpack_nibbles(b[:, 48:176]) | (_unpack_bitplanes(b[:, 16:48]) << 4)
        return _decode_q45(b, q)


def sym_bytes_torch(format_name: str, x: torch.Tensor, cfg: kqs.SymConfig) -> torch.Tensor:
    """The bytes of symmetric K-quant blocks (``"Q3_K"`` or ``"Q6_K"``) for their configuration: the nearest codes at
    decode's sub-block scales, packed. x (n, 256) float32, ``cfg.d`` (n,) float32 holding float16 values, ``cfg.k``
    (n, 16) int64 -> (n, type_size) uint8. The reference of the fast path ``kquant.sym_bytes``. Raises ValueError
    for another format."""
    codec = get_codec(format_name)
    if not isinstance(codec, _KQuant) or not isinstance(codec.search, kqs.SymSearch):
        raise ValueError(f"{format_name} is not a symmetric K-quant (Q3_K, Q6_K)")
    return codec.pack(cfg, codec._block_codes(x, cfg))


def _decode_q45(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K decode from the block bytes and the unpacked codes (n, 256)."""
    n = b.shape[0]
    d, dmin = _f16_value(b[:, 0:2]), _f16_value(b[:, 2:4])
    sc, m = _unpack_scale_min_k4(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * m.to(torch.float32)).reshape(n, 8, 1)
    return (dl * q.reshape(n, 8, 32).to(torch.float32) - ml).reshape(n, QK_K)


@register
class Q6_K(_KQuant):
    """``block_q6_K``: 6.5625 bpw; 16 sub-blocks of 16 with int8 scales, codes -32..31."""

    format_name = "Q6_K"
    n_sub = 16
    search = kqs.SymSearch(
        qlo=-32, qhi=31, klo=-128, khi=127, d_steps=_grid(100.0, 128.5, 0.5), steps=_grid(26.0, 32.5, 0.25), n_elem=2
    )
    fast = kqf.FastSym(qlo=-32, qhi=31, klo=-128, khi=127, d_steps=_grid(116.0, 128.5, 1.0), steps=_grid(30.0, 32.5, 0.5))

    def pack(self, params: kqs.SymConfig, codes: torch.Tensor) -> torch.Tensor:
        cfg = params
        n = codes.shape[0]
        L = codes.reshape(n, 2, 2, 64)
        ql = _u8(((L[:, :, 0] & 15) | ((L[:, :, 1] & 15) << 4)).reshape(n, 128))
        qh = _pack_crumbs(codes.reshape(n, QK_K) >> 4)
        sc = cfg.k.to(torch.int8).view(torch.uint8)
        return torch.cat([ql, qh, sc, _f16_bytes(cfg.d)], 1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        n = self._check_bytes(b)
        d = _f16_value(b[:, 208:210])
        sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
        dl = (d * sc).reshape(n, 16, 1)
        ql = (b[:, :128].to(torch.int32).reshape(n, 2, 1, 64) >> _shifts([0, 4], (1, 1, 2, 1), b.device)) & 15
        qh = _unpack_crumbs(b[:, 128:192]).reshape(n, 2, 4, 32)
        q = (ql.reshape(n, 2, 4, 32) | (qh << 4)) - 32
        return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, QK_K)
