"""Group-wise integer runtime formats ``INT{b}_G{g}`` and ``INT{b}_G{g}_ASYM`` (safetensors target).

Values, as compressed-tensors' ``pack-quantized`` format decodes them (``(q - zero) * scale``):

- symmetric ``INT{b}_G{g}``: ``w = scale * level``, ``level`` in ``-2**(b-1) .. 2**(b-1) - 1``,
  one fp16 ``scale`` per group of ``g`` consecutive weights of a row. The scale may be negative:
  the level grid has one more level below 0 than above, and the sign of the scale picks the
  side of the block's largest weight that gets it.
- asymmetric ``INT{b}_G{g}_ASYM``: ``w = scale * (code - zero)``, ``code`` and the integer
  ``zero`` in ``0 .. 2**b - 1``, fp16 ``scale`` >= 0.

The codec's byte record of a group (what ``quantize`` returns; :mod:`dynaquant.quant.runtime`
turns records into the file layout): fp16 ``scale`` (2 bytes, little-endian), then for the
asymmetric formats the ``zero`` byte, then one byte per weight holding its unsigned code
(``level + 2**(b-1)`` for the symmetric formats, compressed-tensors' packing offset).

Encoders minimise the importance-weighted squared error ``sum(w * (x - decode)**2)`` per group,
on the decoder's float32 values with the scale rounded to fp16 as stored: symmetric by the scale
search of :mod:`._blockfit` (candidate scales around both ends of the grid, clipping candidates,
least-squares refits, most-important-weight anchors, neighbouring fp16 values); asymmetric by
:func:`fit_int_zero` below (the same search over the scale, with the integer zero point anchored at
the group's min and max, refit with its neighbours).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dynaquant.quant.codecs._blockfit import (
    Grid,
    Scorer,
    bytes_half,
    candidate_groups,
    fit_scale,
    half_bytes,
    in_subchunks,
    safe_scale,
    scale_codes,
    to_half,
    ulp_neighbours,
)
from dynaquant.quant.codecs.base import Codec, register
from dynaquant.quant.codecs.fastpaths import fast_path
from dynaquant.quant.formats import FORMATS


def _geo(level: float, lo: float, hi: float, n: int) -> list[float]:
    return [level * float(f) for f in np.geomspace(lo, hi, n)]


# Symmetric search per code width: candidate levels for the group's largest weight (both grid
# ends, up to 3x past them to clip a low-importance outlier) and anchor offsets.
_SYM_SEARCH = {
    2: (_geo(-2, 0.6, 3.0, 16) + _geo(1, 0.6, 3.0, 12), tuple(range(-1, 2))),
    3: (_geo(-4, 0.7, 3.0, 18) + _geo(3, 0.7, 3.0, 14), tuple(range(-2, 3))),
    4: (_geo(-8, 0.8, 3.0, 22) + _geo(7, 0.85, 3.0, 16), tuple(range(-3, 4))),
    8: (_geo(-128, 0.7, 1.05, 10) + _geo(127, 0.7, 1.05, 10), tuple(range(-4, 5))),
}
# Asymmetric search: factors f of the nominal step (max - min) / nmax (f < 1 clips).
_ASYM_FACTORS = {
    2: [float(v) for v in np.linspace(0.5, 1.1, 24)],
    3: [float(v) for v in np.linspace(0.55, 1.1, 24)],
    4: [float(v) for v in np.linspace(0.6, 1.08, 24)],
    8: [float(v) for v in np.linspace(0.85, 1.02, 8)],
}


def int_zero_codes(x: torch.Tensor, d: torch.Tensor, z: torch.Tensor, nmax: int) -> torch.Tensor:
    """Nearest codes of ``d * (code - z)``: x (B, m) float32, d (B,) float16, z (B,) int64 -> (B, m) int64
    in ``0..nmax`` (``z`` where ``d == 0``)."""
    df = d.to(torch.float32)[:, None]
    codes = (torch.round(x / safe_scale(df)) + z[:, None]).clamp_(0, nmax)
    return torch.where(df == 0, z[:, None].to(codes.dtype), codes).to(torch.int64)


def fit_int_zero(x: torch.Tensor, w: torch.Tensor, nmax: int, factors: Sequence[float], lloyd_steps: int = 1,
                 ulps: Sequence[int] = (), backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fit_int_zero_torch`, or its fast path ``blockfit.fit_int_zero`` (one fused kernel a chunk) as
    ``backend`` chooses (:func:`dynaquant.quant.codecs.fastpaths.fast_path`); same arguments and results."""
    fn = fast_path("blockfit.fit_int_zero", x, backend)
    return (fn or fit_int_zero_torch)(x, w, nmax, factors, lloyd_steps, ulps)


def fit_int_zero_torch(x: torch.Tensor, w: torch.Tensor, nmax: int, factors: Sequence[float], lloyd_steps: int = 1,
                       ulps: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Search fp16 ``d`` >= 0 and integer ``z`` of ``decode = d * (code - z)``, codes and ``z`` in ``0..nmax``.

    Each factor ``f`` starts two candidates with ``d = f * (max - min) / nmax``, ``z`` putting the
    group's min (or its max) on a level. All are scored at once (a stacked (n, candidates, groups)
    search, as :func:`._blockfit.fit_scale`) by the weighted least-squares error of ``d`` given their
    levels ``code - z``; the best is rounded to fp16, the codes re-rounded under the stored ``d`` and
    the error taken on ``d * (code - z)`` as the decoder computes it, then polished by Lloyd steps
    (refit ``d``; ``z`` and its two neighbours) and the neighbouring fp16 values of ``d``.

    Args:
        x: (B, n) float32 weights; w: (B, n) float32 importance, > 0.
        nmax: largest code (``2**bits - 1``).
        factors: step factors tried (``f < 1`` clips the ends).
    Returns:
        (d, z): (B,) float16 scales (>= 0) and (B,) int64 zero points.
    """
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    wx = w * x
    best_err = (wx * x).sum(dim=1)  # d = 0: the all-zero group
    best_d = torch.zeros_like(xmin, dtype=torch.float16)
    best_z = torch.zeros_like(xmin, dtype=torch.int64)

    def consider(d: torch.Tensor, z: torch.Tensor) -> None:
        nonlocal best_err, best_d, best_z
        d16 = to_half(d.clamp(min=0))
        df = d16.to(torch.float32)[:, None]
        c = (torch.round(x / safe_scale(df)) + z[:, None]).clamp_(0, nmax)
        err = (w * (x - df * (c - z[:, None])).square_()).sum(dim=1)
        better = (err < best_err) & (d16 > 0)
        best_err = torch.where(better, err, best_err)
        best_d = torch.where(better, d16, best_d)
        best_z = torch.where(better, z, best_z)

    def refit(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        wq = w * q
        s2 = (wq * q).sum(dim=1)
        return torch.where(s2 > 0, (wq * x).sum(dim=1) / torch.where(s2 > 0, s2, 1.0), d)

    def levels(d: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (torch.round(x / safe_scale(d)[:, None]) + z[:, None]).clamp_(0, nmax) - z[:, None]

    # Candidates (C, B): step d and zero z, levels clamp(round(x / d), -z, nmax - z).
    d = (xmax - xmin)[None] * torch.tensor([f / nmax for f in factors], dtype=torch.float32, device=x.device)[:, None]
    sd = safe_scale(d)
    z = torch.cat([torch.round(-xmin[None] / sd), nmax - torch.round(xmax[None] / sd)]).clamp_(0, nmax)
    inv = (1.0 / sd).repeat(2, 1)
    d = d.repeat(2, 1)
    best_score = torch.full_like(xmin, -1.0)
    ls_d, ls_z = xmin.new_zeros(xmin.shape), best_z
    groups = candidate_groups(inv.shape[0])
    sc = Scorer(x, w, wx, groups[0].stop)
    for g in groups:
        q = sc.scaled(inv[g]).round_()
        q = torch.maximum(q, -z[g][None], out=q)
        q = torch.minimum(q, nmax - z[g][None], out=q)
        sqx, sq2 = sc.ls(q)
        pos = sq2 > 0
        score = torch.where(pos, sqx * sqx / torch.where(pos, sq2, 1.0), -1.0)
        top, arg = score.max(dim=0)
        dg = torch.where(pos, sqx / torch.where(pos, sq2, 1.0), d[g]).gather(0, arg[None]).squeeze(0)
        better = top > best_score
        best_score = torch.where(better, top, best_score)
        ls_d = torch.where(better, dg, ls_d)
        ls_z = torch.where(better, z[g].gather(0, arg[None]).squeeze(0).to(torch.int64), ls_z)
    consider(ls_d, ls_z)
    for _ in range(lloyd_steps):
        d0, z0 = best_d.to(torch.float32), best_z
        for dz in (0, -1, 1):
            z = (z0 + dz).clamp(0, nmax)
            consider(refit(levels(d0, z), d0), z)
    base_d, z = best_d, best_z
    for k in ulps:
        consider(ulp_neighbours(base_d, k), z)
    return best_d, best_z


class _IntCodec(Codec):
    """One ``INT{b}_G{g}[_ASYM]`` format (module docstring).

    ``encode_blocks(x, w)``: x, w (n_groups, g) float32 (w > 0) -> (n_groups, g + 2 [+ 1]) uint8
    records; ``decode_blocks`` -> (n_groups, g) float32, equal bit for bit to compressed-tensors'
    float32 ``(q - zero) * scale``.

    Block parameters (:meth:`fit_params`): ``(d,)`` (symmetric) or ``(d, z)`` (asymmetric), ``d``
    (n_groups,) float16 as stored, ``z`` (n_groups,) int64. Codes: the unsigned stored codes
    ``0 .. 2**b - 1`` (symmetric: ``level + 2**(b-1)``).
    """

    bits: int
    asym: bool
    grid: Grid

    @property
    def nmax(self) -> int:
        return (1 << self.bits) - 1

    fast_paths = True  # the symmetric scale search's fused kernel (blockfit.fit_scale)

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """As :meth:`Codec.encode_blocks`; ``backend`` chooses the symmetric search's fused kernel
        (:func:`._blockfit.fit_scale`); ``variant`` is unused."""
        if self.asym:
            params = self.fit_params(x, w, backend)
            return self.pack(params, self.round_to_grid(x, params)[0])
        d, codes = self._fit_sym(x, w, backend)  # the search's codes are round_to_grid's
        return self.pack((d,), codes)

    def _fit_sym(self, x: torch.Tensor, w: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        targets, anchors = _SYM_SEARCH[self.bits]
        return in_subchunks(fit_scale, x.to(torch.float32), w.to(torch.float32), self.grid, targets, anchors,
                            backend=backend)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto"):
        if self.asym:
            return in_subchunks(fit_int_zero, x.to(torch.float32), w.to(torch.float32), self.nmax, _ASYM_FACTORS[self.bits],
                                backend=backend)
        return (self._fit_sym(x, w, backend)[0],)

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(torch.float32)
        d = params[0]
        df = d.to(torch.float32)[:, None]
        if self.asym:
            z = params[1]
            codes = int_zero_codes(x, d, z, self.nmax)
            return codes, df * (codes - z[:, None]).to(torch.float32)
        codes = scale_codes(x, d, self.grid)
        return codes, df * self.grid.level_tensor(x.device)[codes]

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        parts = [half_bytes(params[0])]
        if self.asym:
            parts.append(params[1].to(torch.uint8)[:, None])
        parts.append(codes.to(torch.uint8))
        return torch.cat(parts, dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        d = bytes_half(b[:, :2])
        if self.asym:
            return (b[:, 3:].to(torch.int32) - b[:, 2:3].to(torch.int32)).to(torch.float32) * d
        return (b[:, 2:].to(torch.int32) - (1 << (self.bits - 1))).to(torch.float32) * d


for _name, _f in FORMATS.items():
    if _f.kind == "int":
        register(type(_name, (_IntCodec,), {
            "format_name": _name, "bits": _f.bits, "asym": _f.zero_bits > 0,
            "grid": Grid(range(-(1 << (_f.bits - 1)), 1 << (_f.bits - 1))),
            "__doc__": f"{_name}: {_f.bits}-bit {'asymmetric' if _f.zero_bits else 'symmetric'} codes, "
                       f"groups of {_f.block_size} (see the module docstring).",
        }))
