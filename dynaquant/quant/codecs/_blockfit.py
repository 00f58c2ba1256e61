"""Scale search for one-scale block formats (legacy ``Q*_0``/``Q*_1``, ``IQ4_NL``).

Shared by ``legacy.py`` and ``nonlinear.py``; private to those modules. Every function
works on ``(n_blocks, n)`` float32 tensors ``x`` (weights) and ``w`` (importance, > 0) on
any device, batched over all blocks (the Python loops run over candidate scales, never
over blocks), and minimises the importance-weighted squared error
``sum(w * (x - decode)**2)`` per block.

The search, per block:

1. candidate starting scales: ``d = xmax / c`` for a grid of ``c`` around the grid's
   extreme levels (both signs for asymmetric grids) and well past them (clipping a
   low-importance outlier often pays), plus scales that put the block's most important
   weight exactly on a level; for affine grids a grid of ``d`` with the level grid
   anchored at the block's min, its max, or its most important weight;
2. for each candidate: round to the grid, least-squares refit of the scale (and min)
   given those codes;
3. the refit scale (and min) are rounded to fp16 *as stored*, the codes are re-rounded
   to the nearest level under the stored values, and the error is computed on exactly
   the float32 reconstruction the decoder produces (``d * q`` or ``d * q + m``);
4. the best candidate per block is kept (the all-zero block, error ``sum(w x^2)``, is the
   starting point, so a block never ends worse than zero), then polished by a few
   Lloyd steps (refit on the best codes) and by trying the neighbouring fp16 scales.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dynaquant.quant.codecs.base import Codec, LevelGrid
from dynaquant.quant.codecs.fastpaths import fast_path, fused_path

FP16_MAX = 65504.0


def to_half(v: torch.Tensor) -> torch.Tensor:
    """float32 (any shape) -> float16, clamped to the finite fp16 range (NaN stays NaN)."""
    return v.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def half_bytes(v: torch.Tensor) -> torch.Tensor:
    """(B,) float16 -> (B, 2) uint8, little-endian (``ggml_half`` as stored in a block)."""
    return v.contiguous().view(torch.uint8).reshape(-1, 2)


def bytes_half(b: torch.Tensor) -> torch.Tensor:
    """(B, 2) uint8 little-endian fp16 -> (B, 1) float32 (exact)."""
    return b.contiguous().view(torch.float16).to(torch.float32).reshape(-1, 1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(B, 32) codes < 16 -> (B, 16) uint8: byte j = code[j] | code[j + 16] << 4 (ggml order)."""
    c = codes.to(torch.uint8)
    return (c[:, :16] & 15) | ((c[:, 16:] & 15) << 4)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(B, 16) uint8 -> (B, 32) uint8 codes, inverse of :func:`pack_nibbles`."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _bit_weights(device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_high_bits(codes: torch.Tensor) -> torch.Tensor:
    """(B, 32) 5-bit codes -> (B, 4) uint8: bit j of the little-endian uint32 is code[j] >> 4."""
    bits = ((codes.to(torch.uint8) >> 4) & 1).reshape(-1, 4, 8)
    return (bits * _bit_weights(codes.device)).sum(dim=2, dtype=torch.uint8)


def unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(B, 4) uint8 -> (B, 32) uint8 of 0/1, inverse of :func:`pack_high_bits`."""
    return ((qh.unsqueeze(2) & _bit_weights(qh.device)) != 0).to(torch.uint8).reshape(-1, 32)


class Grid:
    """A sorted set of levels (one block's value set is ``d * levels``).

    Args:
        levels: ascending level values. Consecutive integers make a linear grid, rounded
            by ``round``/``clamp``; other grids are rounded to the nearest level with ties
            going to the upper level (as ggml's ``best_index_int8``): by a lookup table on
            ``floor(2 t)`` when every midpoint is a multiple of 1/2 (``kvalues_iq4nl``,
            E2M1), else by bucketize.
    """

    def __init__(self, levels: Sequence[float]):
        self.levels = [float(v) for v in levels]
        if any(b <= a for a, b in zip(self.levels, self.levels[1:])):
            raise ValueError("grid levels must be strictly increasing")
        self.lo, self.hi = self.levels[0], self.levels[-1]
        self.linear = self.lo == int(self.lo) and self.levels == [self.lo + i for i in range(len(self.levels))]
        mids2 = [a + b for a, b in zip(self.levels, self.levels[1:])]  # 2 * midpoints
        self.half_int = all(m == int(m) for m in mids2)
        if self.half_int:
            # Table over k = floor(2 t) in [kmin, kmax]: index = #midpoints m with 2 m <= k.
            self.kmin, self.kmax = int(mids2[0]) - 1, int(mids2[-1])
            self._lut = [sum(m <= k for m in mids2) for k in range(self.kmin, self.kmax + 1)]
        self._cache: dict = {}

    def _tables(self, device):
        key = str(device)
        if key not in self._cache:
            lv = torch.tensor(self.levels, dtype=torch.float32, device=device)
            mids = (lv[1:] + lv[:-1]) * 0.5
            lut = torch.tensor(self._lut, dtype=torch.int32, device=device) if self.half_int else None
            vlut = lv[lut.long()] if self.half_int else None
            self._cache[key] = (lv, mids, lut, vlut)
        return self._cache[key]

    def lookup(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A half-integer-midpoint grid's tables on ``device``: the level index (int32) and value (float32) of
        each ``k = floor(2 t)`` in ``kmin .. kmax`` (entry ``k - kmin``). Raises ValueError on other grids."""
        if not self.half_int or self.linear:
            raise ValueError("only a non-linear grid whose midpoints are multiples of 1/2 has lookup tables")
        _, _, lut, vlut = self._tables(device)
        return lut, vlut

    def level_tensor(self, device) -> torch.Tensor:
        """The levels as a float32 tensor on ``device``."""
        return self._tables(device)[0]

    def _k(self, t: torch.Tensor) -> torch.Tensor:
        return t.mul(2).floor_().clamp_(self.kmin, self.kmax).sub_(self.kmin).to(torch.int32).reshape(-1)

    def values_of(self, t: torch.Tensor) -> torch.Tensor:
        """Value of the level nearest to each entry of ``t`` (float32, same shape)."""
        if self.linear:
            return torch.round(t).clamp_(self.lo, self.hi)
        lv, mids, _, vlut = self._tables(t.device)
        if self.half_int:
            return vlut.index_select(0, self._k(t)).reshape(t.shape)
        return lv[torch.bucketize(t, mids, right=True)]

    def round_values_(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`values_of`, overwriting ``t`` where it can (a linear grid rounds in place)."""
        if self.linear:
            return t.round_().clamp_(self.lo, self.hi)
        return self.values_of(t)

    def codes_of(self, t: torch.Tensor) -> torch.Tensor:
        """Index (int64) of the level nearest to each entry of ``t``, as :meth:`values_of`."""
        if self.linear:
            return (torch.round(t).clamp_(self.lo, self.hi) - self.lo).to(torch.int64)
        _, mids, lut, _ = self._tables(t.device)
        if self.half_int:
            return lut.index_select(0, self._k(t)).reshape(t.shape).to(torch.int64)
        return torch.bucketize(t, mids, right=True)

    def zero_code(self) -> int:
        """Index of the level nearest to 0 (the upper one on a tie)."""
        if not hasattr(self, "_zero"):
            self._zero = min(range(len(self.levels)), key=lambda i: (abs(self.levels[i]), -i))
        return self._zero

    def level_grid(self, dl: torch.Tensor) -> LevelGrid:
        """The :class:`LevelGrid` of scales ``dl`` (float32, (n_blocks,) or (block_size, n_blocks), contiguous): its
        codes are :meth:`codes_of` ``(x / dl)`` (the half-integer table's ``floor(2 t)`` lookup counts the midpoints
        ``<= t``, as bucketize does), ``zero_code`` where ``dl == 0``."""
        lv, mids, _, _ = self._tables(dl.device)
        return LevelGrid(dl, safe_scale(dl), lv, mids, self.linear, self.zero_code(), self.lo, self.hi)


# On CPU the search runs over sub-chunks of this many blocks, so that its (blocks, 32)
# temporaries stay in cache (about 2.5x faster than whole 1M-weight chunks on 2 cores).
CPU_SUBCHUNK_BLOCKS = 2048
# The candidate searches score candidates in stacks of this many per block (two (n, group,
# blocks) float32 buffers: peak extra memory about 2 * CAND_GROUP times the input's bytes).
CAND_GROUP = 8


def in_subchunks(fn: Callable[..., tuple[torch.Tensor, ...]], x: torch.Tensor, w: torch.Tensor, *args, **kwargs):
    """Run ``fn(x, w, *args, **kwargs)`` (which returns a tuple of tensors with the block
    axis first) on sub-chunks of blocks on CPU and concatenate; on other devices run it once."""
    n = x.shape[0]
    step = CPU_SUBCHUNK_BLOCKS
    if x.device.type != "cpu" or n <= step:
        return fn(x, w, *args, **kwargs)
    parts = [fn(x[i : i + step], w[i : i + step], *args, **kwargs) for i in range(0, n, step)]
    return tuple(torch.cat(p, dim=0) for p in zip(*parts))


def scale_targets(
    extremes: Sequence[float], n_near: int, n_far: int, near: tuple[float, float], far: float
) -> list[float]:
    """Candidate targets ``c`` for :func:`fit_scale`: for each extreme level ``L``, ``n_near``
    values ``L * f`` with ``f`` evenly spaced over ``near``, then ``n_far`` values with ``f``
    geometrically spaced from ``near[1]`` (excluded) to ``far`` (``f > 1`` clips the max)."""
    out: list[float] = []
    for lev in extremes:
        out += [lev * float(f) for f in np.linspace(near[0], near[1], n_near)]
        if n_far:
            out += [lev * float(f) for f in np.geomspace(near[1], far, n_far + 1)[1:]]
    return out


def safe_scale(d: torch.Tensor) -> torch.Tensor:
    """``d`` with zeros replaced by 1 (a divisor for scales; a zero scale's block decodes to 0 anyway)."""
    return torch.where(d == 0, torch.ones_like(d), d)


def ulp_neighbours(d16: torch.Tensor, k: int) -> torch.Tensor:
    """fp16 values ``k`` steps away in the bit pattern (same sign), as float32; non-finite -> same."""
    bits = d16.view(torch.int16)
    nb = (bits.to(torch.int32) + k).clamp(-32768, 32767).to(torch.int16).view(torch.float16)
    ok = torch.isfinite(nb) & ((nb.view(torch.int16) < 0) == (bits < 0))
    return torch.where(ok, nb, d16).to(torch.float32)


class Scorer:
    """Least-squares scores of candidate level stacks, in a transposed (n, candidates, blocks) layout
    (contiguous along blocks: vectorised elementwise ops, reductions over the outer axis) with
    reused buffers (fresh large tensors cost page faults on CPU).

    ``xT``, ``wT``: (n, B) float32 weights and importance; ``wxT`` = ``wT * xT``.
    """

    def __init__(self, x: torch.Tensor, w: torch.Tensor, wx: torch.Tensor, group: int):
        self.xT, self.wT, self.wxT = x.t().contiguous(), w.t().contiguous(), wx.t().contiguous()
        n, b = self.xT.shape
        self.buf = torch.empty(n, group, b, dtype=torch.float32, device=x.device)
        self.tmp = torch.empty_like(self.buf)

    def scaled(self, inv: torch.Tensor) -> torch.Tensor:
        """``x * inv`` for (G, B) inverse scales -> (n, G, B), in the reused buffer."""
        return torch.mul(self.xT[:, None, :], inv[None], out=self.buf[:, : inv.shape[0]])

    def dot(self, q: torch.Tensor, vT: torch.Tensor) -> torch.Tensor:
        """``sum_n v q`` -> (G, B) for q (n, G, B) and vT (n, B)."""
        return torch.mul(q, vT[:, None, :], out=self.tmp[:, : q.shape[1]]).sum(0)

    def ls(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``sum w q x``, ``sum w q^2``), each (G, B); ``q`` is squared in place."""
        sqx = self.dot(q, self.wxT)
        return sqx, self.dot(q.square_(), self.wT)


def candidate_groups(n_cand: int) -> list[slice]:
    """Slices of a candidate axis of ``n_cand``, :data:`CAND_GROUP` candidates a slice."""
    return [slice(i, min(i + CAND_GROUP, n_cand)) for i in range(0, n_cand, CAND_GROUP)]


def fit_scale(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    targets: Sequence[float],
    anchor_offsets: Sequence[int] = (),
    lloyd_steps: int = 1,
    ulps: Sequence[int] = (-1, 1),
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fit_scale_torch`, or its fast path ``blockfit.fit_scale`` (one fused kernel a chunk) as ``backend``
    chooses (:func:`dynaquant.quant.codecs.fastpaths.fast_path`); same arguments and results."""
    fn = fast_path("blockfit.fit_scale", x, backend)
    return (fn or fit_scale_torch)(x, w, grid, targets, anchor_offsets, lloyd_steps, ulps)


def fit_scale_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    targets: Sequence[float],
    anchor_offsets: Sequence[int] = (),
    lloyd_steps: int = 1,
    ulps: Sequence[int] = (-1, 1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Search the fp16 scale ``d`` of ``decode = d * levels[code]`` per block.

    Every candidate inverse scale is scored at once (a (blocks, candidates, n) stack, in groups
    to bound memory) by the error of its codes after a least-squares refit of the scale,
    ``sum(w x^2) - sum(w q x)^2 / sum(w q^2)``; only the best candidate of each block is then
    rounded to fp16 and measured exactly (codes re-rounded under the stored scale, error on the
    decoder's ``d * q``), then polished by Lloyd steps and neighbouring fp16 values.

    Args:
        x: (B, n) float32 weights.
        w: (B, n) float32 importance, > 0.
        grid: the levels.
        targets: candidate values ``c`` for the level of the block's largest-magnitude
            weight: each candidate starts at ``d = xmax / c`` (``xmax`` signed).
        anchor_offsets: more candidates: with ``j`` the block's largest ``w x^2`` and ``i0``
            its nearest level under ``d = |xmax| / max|level|``, start at
            ``d = x_j / levels[i0 + o]`` for each offset ``o`` (skipped off the grid or at 0).
        lloyd_steps: refit/re-round steps on the best codes after the candidate search.
        ulps: fp16 bit-pattern offsets of the best scale tried at the end.
    Returns:
        (d, codes): (B,) float16 stored scales and (B, n) int64 codes into ``grid``; the
        codes are the nearest levels under the stored scale (the level nearest 0 where
        ``d == 0``).
    """
    imax = x.abs().argmax(dim=1, keepdim=True)
    xmax = x.gather(1, imax).squeeze(1)
    wx = w * x
    # Inverse scales of all candidates (B, C): level c for the max, then the anchors.
    inv = torch.tensor(list(targets), dtype=torch.float32, device=x.device)[None, :] / safe_scale(xmax)[:, None]
    if anchor_offsets:
        # Scales that put the block's most important weight (largest w x^2) exactly on a
        # level: its nearest level under the max-based scale, and levels around it.
        lv = grid.level_tensor(x.device)
        xj = x.gather(1, (wx * x).argmax(dim=1, keepdim=True))
        d_nom = xmax.abs() / max(abs(grid.lo), abs(grid.hi))
        i0 = grid.codes_of(xj / safe_scale(d_nom)[:, None])
        i = i0 + torch.tensor(list(anchor_offsets), device=x.device)[None, :]
        ok = (i >= 0) & (i < len(grid.levels))
        lvl = lv[i.clamp(0, len(grid.levels) - 1)]
        ok &= lvl != 0
        inv_a = torch.where(ok, lvl / safe_scale(xj), 1.0 / safe_scale(d_nom)[:, None])
        inv = torch.cat([inv, inv_a], dim=1)
    best_score = torch.full_like(xmax, -1.0)
    best_d = torch.zeros_like(xmax)
    groups = candidate_groups(inv.shape[1])
    sc = Scorer(x, w, wx, groups[0].stop)
    invT = inv.t().contiguous()
    for g in groups:
        sqx, sq2 = sc.ls(grid.round_values_(sc.scaled(invT[g])))
        pos = sq2 > 0
        score = torch.where(pos, sqx * sqx / torch.where(pos, sq2, 1.0), -1.0)
        top, arg = score.max(dim=0)
        d = (sqx / torch.where(pos, sq2, 1.0)).gather(0, arg[None]).squeeze(0)
        better = top > best_score
        best_score = torch.where(better, top, best_score)
        best_d = torch.where(better, d, best_d)
    return polish_scale(x, w, wx, grid, best_d, lloyd_steps, ulps)


def polish_scale(
    x: torch.Tensor, w: torch.Tensor, wx: torch.Tensor, grid: Grid, d: torch.Tensor, lloyd_steps: int, ulps: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact stage of :func:`fit_scale`: the all-zero block, the fp16 rounding of ``d`` (B,) float32,
    ``lloyd_steps`` refits on the best codes and the ``ulps`` neighbours of the best stored scale,
    each measured on the decoder's values with the codes nearest under the stored scale.
    Returns ``(d (B,) float16, codes (B, n) int64)``."""
    best_err = (wx * x).sum(dim=1)
    best_d = torch.zeros_like(d, dtype=torch.float16)

    def consider(d: torch.Tensor) -> torch.Tensor:
        nonlocal best_err, best_d
        d16 = to_half(d)
        df = d16.to(torch.float32)[:, None]
        q = grid.values_of(x / safe_scale(df))
        r = x - df * q
        err = (w * r.square_()).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_d = torch.where(better, d16, best_d)
        return q

    q = consider(d)
    for _ in range(lloyd_steps):
        sq2 = (w * q * q).sum(dim=1)
        pos = sq2 > 0
        q = consider(torch.where(pos, (wx * q).sum(dim=1) / torch.where(pos, sq2, 1.0), best_d.to(torch.float32)))
    base = best_d
    for k in ulps:
        consider(ulp_neighbours(base, k))
    return best_d, scale_codes(x, best_d, grid)


def scale_codes(x: torch.Tensor, d: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Nearest codes under stored scales: x (B, m) float32, d (B,) float16 -> (B, m) int64
    indices into ``grid`` (the level nearest 0 where ``d == 0``)."""
    df = d.to(torch.float32)[:, None]
    codes = grid.codes_of(x / safe_scale(df))
    return torch.where(df == 0, grid.zero_code(), codes)


class ScaleCodec(Codec):
    """A format ``y = d * levels[code]`` with one fp16 ``d`` a block, searched by :func:`fit_scale` (the legacy
    ``Q4_0`` / ``Q5_0`` / ``Q8_0``, ``IQ4_NL``); subclasses set ``grid``, the search's class data and ``pack`` /
    ``decode_blocks``.

    Block parameters (:meth:`fit_params`): the tuple ``(d,)``, ``d`` (n_blocks,) float16 as stored. Codes
    (:meth:`round_to_grid`, :meth:`pack`): indices into ``grid``. ``record``: the block layout as data
    (:class:`._records.Record`, equal to :meth:`pack`'s), which the fused search ``blockfit.encode_scale`` writes
    straight; None: the search's codes are packed by :meth:`pack`.
    """

    grid: Grid
    targets: list[float]
    anchor_offsets: tuple[int, ...] = ()
    lloyd_steps: int = 1
    ulps: tuple[int, ...] = ()
    record: object | None = None  # a _records.Record (not imported here: _records builds on this module)

    fast_paths = True  # the scale search's fused kernel (blockfit.fit_scale), and its record writer (encode_scale)

    def _fit(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        x, w = x.to(torch.float32), w.to(torch.float32)
        args = (self.grid, self.targets, self.anchor_offsets, self.lloyd_steps, self.ulps)
        if fast_path("blockfit.fit_scale", x, backend) is not None:  # a fused search keeps no (blocks, n) temporaries
            return fit_scale(x, w, *args, backend=backend)
        return in_subchunks(fit_scale, x, w, *args, backend=backend)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor]:
        return (self._fit(x, w, backend)[0],)

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """As :meth:`Codec.encode_blocks`; ``backend`` chooses the search that also writes the records
        (``blockfit.encode_scale``, :attr:`record`: Triton on CUDA, compiled C on the CPU), else the scale search's
        fused kernel (:func:`fit_scale`) and :meth:`pack`; ``variant`` is unused."""
        fused = fused_path("blockfit.encode_scale", x, backend) if self.record is not None else None
        if fused is not None:
            args = (self.grid, self.targets, self.anchor_offsets, self.lloyd_steps, self.ulps, self.record)
            return fused(x.to(torch.float32), w.to(torch.float32), *args)
        # The search's codes are round_to_grid's (nearest under the stored scale): no second pass.
        d, codes = self._fit(x, w, backend)
        return self.pack((d,), codes)

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        (d,) = params
        x = x.to(torch.float32)
        codes = scale_codes(x, d, self.grid)
        return codes, d.to(torch.float32)[:, None] * self.grid.level_tensor(x.device)[codes]

    def column_grid(self, params) -> LevelGrid:
        """As :meth:`Codec.column_grid`: the stored scale of each block (all its columns') and its safe divisor."""
        (d,) = params
        return self.grid.level_grid(d.to(torch.float32).reshape(-1).contiguous())


def affine_codes(x: torch.Tensor, d: torch.Tensor, m: torch.Tensor, nmax: int) -> torch.Tensor:
    """Nearest codes of ``d * code + m`` under stored values: x (B, n) float32, d, m (B,)
    float16 -> (B, n) int64 in ``0..nmax`` (0 where ``d == 0``)."""
    df, mf = d.to(torch.float32)[:, None], m.to(torch.float32)[:, None]
    codes = torch.round((x - mf) / safe_scale(df)).clamp_(0, nmax)
    return torch.where(d[:, None] == 0, 0.0, codes).to(torch.int64)


def fit_affine(
    x: torch.Tensor,
    w: torch.Tensor,
    nmax: int,
    steps: Sequence[float],
    n_anchor: int = 0,
    lloyd_steps: int = 1,
    ulps: Sequence[int] = (),
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fit_affine_torch`, or its fast path ``blockfit.fit_affine`` (one fused kernel a chunk) as ``backend``
    chooses (:func:`dynaquant.quant.codecs.fastpaths.fast_path`); same arguments and results."""
    fn = fast_path("blockfit.fit_affine", x, backend)
    return (fn or fit_affine_torch)(x, w, nmax, steps, n_anchor, lloyd_steps, ulps)


def fit_affine_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    nmax: int,
    steps: Sequence[float],
    n_anchor: int = 0,
    lloyd_steps: int = 1,
    ulps: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Search fp16 ``d`` and ``m`` of ``decode = d * code + m``, ``code`` in ``0..nmax``, per block.

    Each step ``s`` starts ``2 + n_anchor`` candidates, ``d = (max - min) / (nmax + s)``
    with the level grid anchored at the block's min, at its max, and at each of its
    ``n_anchor`` most important weights (largest ``w``). All candidates are scored at once (a
    stacked (n, candidates, blocks) search, as :func:`fit_scale`) by the weighted least-squares
    error of (d, m) given their codes; the best of each block is then rounded as stored (``d`` to
    fp16, ``m`` refit under the stored ``d`` and rounded to fp16, the codes re-rounded under the
    stored pair, the error taken on ``d * code + m`` as the decoder computes it) and polished by
    Lloyd steps and neighbouring fp16 values of ``d``.

    Args:
        x: (B, n) float32 weights.
        w: (B, n) float32 importance, > 0.
        nmax: largest code (15 for Q4_1, 31 for Q5_1).
        steps: offsets ``s`` of the candidate level count (``nmax + s`` steps span max - min).
        n_anchor: number of most-important weights used as extra grid anchors.
        lloyd_steps: refit/re-round steps on the best codes after the candidate search.
        ulps: fp16 bit-pattern offsets of the best ``d`` tried at the end (``m`` refit).
    Returns:
        (d, m, codes): (B,) float16, (B,) float16, (B, n) int64 codes in ``0..nmax``
        (0 where ``d == 0``).
    """
    xmin = x.min(dim=1).values
    xmax = x.max(dim=1).values
    wx = w * x
    sw = w.sum(dim=1)
    swx = wx.sum(dim=1)
    rng = xmax - xmin
    # Candidates (C, B): inverse step and offset o, codes = clamp(round(x * inv - o), 0, nmax).
    inv = torch.tensor([nmax + float(s) for s in steps], dtype=torch.float32, device=x.device)[:, None] / safe_scale(rng)[None]
    offs = [xmin[None] * inv, xmax[None] * inv - nmax]
    if n_anchor:
        order = w.argsort(dim=1, descending=True)[:, :n_anchor]
        for i in range(n_anchor):
            xa = x.gather(1, order[:, i : i + 1]).squeeze(1)[None]
            offs.append(xa * inv - torch.round((xa - xmin[None]) * inv))
    off = torch.cat(offs, dim=0)
    inv = inv.repeat(len(offs), 1)
    swd, swxd = sw.double(), swx.double()
    best_gain = torch.full_like(swd, -1.0)
    best_d = torch.zeros_like(xmin)
    best_m = torch.zeros_like(xmin)
    groups = candidate_groups(inv.shape[0])
    sc = Scorer(x, w, wx, groups[0].stop)
    for g in groups:
        q = sc.scaled(inv[g]).sub_(off[g][None]).round_().clamp_(0, nmax)
        s1 = sc.dot(q, sc.wT).double()
        sqx, sqq = (v.double() for v in sc.ls(q))
        det = swd * sqq - s1 * s1
        ok = det > 1e-6 * swd * sqq
        det = torch.where(ok, det, 1.0)
        gain = torch.where(ok, (swd * sqx * sqx - 2 * s1 * sqx * swxd + sqq * swxd * swxd) / det, -1.0)
        top, arg = gain.max(dim=0)
        d = ((swd * sqx - s1 * swxd) / det).gather(0, arg[None]).squeeze(0).float()
        m = ((sqq * swxd - s1 * sqx) / det).gather(0, arg[None]).squeeze(0).float()
        better = top > best_gain
        best_gain = torch.where(better, top, best_gain)
        best_d = torch.where(better, d, best_d)
        best_m = torch.where(better, m, best_m)
    return polish_affine(x, w, sw, swx, nmax, best_d, best_m, lloyd_steps, ulps)


def polish_affine(
    x: torch.Tensor,
    w: torch.Tensor,
    sw: torch.Tensor,
    swx: torch.Tensor,
    nmax: int,
    d: torch.Tensor,
    m: torch.Tensor,
    lloyd_steps: int,
    ulps: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact stage of :func:`fit_affine` from least-squares ``d``, ``m`` (B,) float32 (see there);
    ``sw``, ``swx`` (B,) are ``sum(w)``, ``sum(w x)``. Returns ``(d, m, codes)`` as :func:`fit_affine`."""
    # Start: the constant block at the weighted mean (d = 0).
    best_m = to_half(swx / sw)
    best_d = torch.zeros_like(best_m)
    best_err = (w * (x - best_m.to(torch.float32)[:, None]).square()).sum(dim=1)

    def codes_of(df: torch.Tensor, mf: torch.Tensor) -> torch.Tensor:
        return torch.round((x - mf) / safe_scale(df)).clamp_(0, nmax)

    def consider(d: torch.Tensor, q: torch.Tensor) -> None:
        # d -> fp16; m refit under the stored d with the codes q, -> fp16; codes re-rounded
        # under the stored pair; error on d * q + m exactly as the decoder computes it.
        nonlocal best_err, best_d, best_m
        d16 = to_half(d)
        df = d16.to(torch.float32)
        m16 = to_half((swx - df * (w * q).sum(dim=1)) / sw)
        mf = m16.to(torch.float32)[:, None]
        df = df[:, None]
        qn = codes_of(df, mf)
        err = (w * (x - (df * qn + mf)).square_()).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_d = torch.where(better, d16, best_d)
        best_m = torch.where(better, m16, best_m)

    def refit(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        # Weighted least squares for (d, m) given codes q; returns d (m is refit in consider).
        wq = w * q
        swq = wq.sum(dim=1)
        swq2 = (wq * q).sum(dim=1)
        swqx = (wq * x).sum(dim=1)
        det = sw * swq2 - swq * swq
        ok = det > 1e-6 * sw * swq2
        return torch.where(ok, (sw * swqx - swq * swx) / torch.where(ok, det, 1.0), d)

    def best_codes() -> torch.Tensor:
        return codes_of(best_d.to(torch.float32)[:, None], best_m.to(torch.float32)[:, None])

    consider(d, codes_of(to_half(d).to(torch.float32)[:, None], m[:, None]))
    for _ in range(lloyd_steps):
        q = best_codes()
        consider(refit(q, best_d.to(torch.float32)), q)
    if ulps:
        base_d, q = best_d, best_codes()
        for k in ulps:
            consider(ulp_neighbours(base_d, k), q)
    return best_d, best_m, affine_codes(x, best_d, best_m, nmax)


def fit_pow2(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    e0: torch.Tensor,
    offsets: Sequence[int],
    emin: int,
    emax: int,
    scale_of: Callable[[torch.Tensor], torch.Tensor],
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fit_pow2_torch`, or its fast path ``blockfit.fit_pow2`` as ``backend`` chooses
    (:func:`dynaquant.quant.codecs.fastpaths.fast_path`: the compiled search on CPU tensors); same arguments and results."""
    fn = fast_path("blockfit.fit_pow2", x, backend)
    return (fn or fit_pow2_torch)(x, w, grid, e0, offsets, emin, emax, scale_of)


def fit_pow2_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: Grid,
    e0: torch.Tensor,
    offsets: Sequence[int],
    emin: int,
    emax: int,
    scale_of: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Search a power-of-two scale exponent per block (E8M0-style scales).

    With a power-of-two scale ``x / d`` is exact, so the nearest level of each weight is
    the best code and the exponent is the only choice; each candidate is scored on the
    decoder's ``d * level``.

    Args:
        x, w: (B, n) float32 weights and importance.
        grid: the levels.
        e0: (B,) int64 starting exponent code.
        offsets: exponent offsets from ``e0`` tried.
        emin, emax: valid range of the exponent code.
        scale_of: maps (B,) int64 exponent codes to (B,) float32 scales exactly as the decoder.
    Returns:
        (e, codes): (B,) int64 exponent codes and (B, n) int64 codes into ``grid``.
    """
    best_err = best_e = None
    for k in offsets:
        e = (e0 + k).clamp(emin, emax)
        d = scale_of(e)[:, None]
        q = grid.values_of(x / d)
        err = (w * (x - d * q).square_()).sum(dim=1)
        if best_err is None:
            best_err, best_e = err, e
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_e = torch.where(better, e, best_e)
    return best_e, grid.codes_of(x / scale_of(best_e)[:, None])
