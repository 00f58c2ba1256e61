"""IQ3 assignment steps shared by the codecs' torch path and the references of their fused fast paths.

:func:`assign_variants` is :meth:`dynaquant.quant.codecs.iq3._IQ3._assign` given a nearest-point search of
:func:`nearest_variants_torch`'s contract; :func:`assign_torch` adds what the encoder computes from an assignment (the
per-weight terms of the least-squares sums, or of the exact error) and is the reference of the fused fast path
``iq3.assign`` (:mod:`dynaquant.kernels.iq3_search`). The references of the other fast paths: :func:`consider_torch`
(one step-1 candidate) of ``iq3.consider``, :func:`step1_torch` (all of step 1) of ``iq3.step1``, :func:`exact_torch`
(the exact error and the least-squares sums of one assignment) of ``iq3.exact``, :func:`exact_levels_torch` (each
sub-block's best level, :func:`best_levels`) of ``iq3.exact_levels``, :func:`pick_torch` (from
:func:`pick_errors_torch`'s terms) of ``iq3.pick``, the fp16 ``d`` search's pick. Pure torch; the operations are the
encoder's own, in its order, so a fast path that repeats them gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynaquant.quant.codecs import _kquant_search as kqs

_N_SUB = 8  # sub-blocks of 32 a super-block
_N_GRP = 8  # groups of 4 a sub-block


def inv_scale(a: torch.Tensor) -> torch.Tensor:
    """``1 / a`` where ``a > 0``, else 0 (float32, ``a``'s shape)."""
    return torch.where(a > 0, 1.0 / torch.where(a > 0, a, 1.0), 0.0)


def assign_variants(xa: torch.Tensor, w: torch.Tensor, neg: torch.Tensor, a: torch.Tensor, parity: bool, full: bool,
                    nearest: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Best grid points and signs of every group of 4 for sub-block scales ``a``.

    Args:
        xa, w: (n, 8, 32) float32 ``|x|`` and importance; neg: (n, 8, 32) bool ``x < 0``.
        a: (n, 8) float32 sub-block scales (>= 0) in grid units.
        parity: the signs of each 8 weights must have even parity (IQ3_XXS): an 8-group with an odd number of
            negative weights decodes one weight with the wrong sign, in the half where that costs least.
        full: with ``parity``, try every weight of a half as the flipped one (else the one of least ``w x**2``).
        nearest: ``nearest(f, t, odd, flip_at)``, the contract of :func:`nearest_variants_torch` with its
            tables bound.
    Returns:
        (idx (n, 8, 8) int64 grid indices, flip (n, 8, 32) bool: weight decoded with the sign opposite to ``x``'s).
    """
    n = xa.shape[0]
    xg = xa.reshape(n, _N_SUB, _N_GRP, 4)
    wg = w.reshape(n, _N_SUB, _N_GRP, 4)
    f = torch.cat([2 * wg * xg, -a[:, :, None, None] * wg], -1)  # (n, 8, 8, 8)
    tg = xg * inv_scale(a)[:, :, None, None]
    if not parity:
        idx = nearest(f.reshape(-1, 8), tg.reshape(-1, 4), None, None)[1]
        return idx.reshape(n, _N_SUB, _N_GRP), torch.zeros_like(neg)
    if full:
        # variants: no flip, flip weight i of the group (i = 0..3)
        eye = torch.eye(4, device=xa.device, dtype=torch.bool)
        flips = torch.cat([torch.zeros(1, 4, dtype=torch.bool, device=xa.device), eye], 0)  # (5, 4)
        flips = flips.expand(n, _N_SUB, _N_GRP, 5, 4)
        imin = None
    else:
        imin = (wg * xg * xg).argmin(-1)  # (n, 8, 8)
        one = torch.nn.functional.one_hot(imin, 4).bool()
        flips = torch.stack([torch.zeros_like(one), one], -2)  # (n, 8, 8, 2, 4)
    nv = flips.shape[-2]
    # Flip variants only where the 8-group has an odd number of negative weights.
    odd = (neg.reshape(n, _N_SUB, 4, 8).sum(-1) % 2) == 1  # (n, 8, 4)
    odd_rows = odd.repeat_interleave(2, dim=-1).reshape(-1)
    score, idx = nearest(f.reshape(-1, 8), tg.reshape(-1, 4), odd_rows, None if imin is None else imin.reshape(-1))
    score, idx = score.reshape(n, _N_SUB, 4, 2, nv), idx.reshape(n, _N_SUB, 4, 2, nv)
    flips = flips.reshape(n, _N_SUB, 4, 2, nv, 4)
    # Per 8-group (pair of halves): even parity -> no flip; odd -> flip in one half.
    s0 = score[..., 0]  # (n, 8, 4, 2)
    sf, vf = score[..., 1:].max(-1)  # best flip variant per half
    vf = vf + 1
    in_a = sf[..., 0] + s0[..., 1] >= s0[..., 0] + sf[..., 1]  # flip in half 0 is better
    v0 = torch.where(odd & in_a, vf[..., 0], 0)
    v1 = torch.where(odd & ~in_a, vf[..., 1], 0)
    v = torch.stack([v0, v1], -1)  # (n, 8, 4, 2)
    idx = idx.gather(-1, v.unsqueeze(-1)).squeeze(-1).reshape(n, _N_SUB, _N_GRP)
    flip = flips.gather(-2, v[..., None, None].expand(-1, -1, -1, -1, 1, 4)).squeeze(-2)
    return idx, flip.reshape(n, _N_SUB, 32)


def points(grid: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(n, 8, 8) grid indices -> (n, 8, 32) float32 coordinates of ``grid`` (P, 4)."""
    return grid.index_select(0, idx.reshape(-1)).reshape(idx.shape[0], _N_SUB, 32)


def stats_terms(xa: torch.Tensor, w: torch.Tensor, g: torch.Tensor, flip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-weight terms of the least-squares sums of an assignment: ``(w v g, w g g)``, each (n, 8, 32) float32, for
    ``|x|``, importance, grid values ``g`` and ``flip`` (n, 8, 32) (``v`` is ``|x|`` negated where flipped)."""
    v = torch.where(flip, -xa, xa)
    return w * v * g, w * g * g


def error_terms(x: torch.Tensor, w: torch.Tensor, neg: torch.Tensor, a: torch.Tensor, g: torch.Tensor,
                flip: torch.Tensor) -> torch.Tensor:
    """Per-weight exact error ``w (x - y)**2`` (n, 8, 32) float32 of the decoded ``y = (a g) * sign``."""
    y = (a.unsqueeze(-1) * g) * torch.where(neg ^ flip, -1.0, 1.0)
    r = x - y
    return w * r * r


OUTS = ("stats", "error")


def assign_torch(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, parity: bool, full: bool, out: str,
                 want_idx: bool, kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor,
                 nearest: Callable | None = None, sums: bool = False):
    """An assignment (:func:`assign_variants`) and the per-weight terms the encoder sums over it: the reference of
    the fused fast path ``iq3.assign``.

    Args:
        x, w: (n, 8, 32) float32 weights and importance; a: (n, 8) float32 sub-block scales (>= 0).
        parity, full: as :func:`assign_variants`.
        out: ``"stats"``: ``(p, q) = (w v g, w g g)`` (:func:`stats_terms`); ``"error"``: ``p = w (x - y)**2``
            (:func:`error_terms`, ``y`` decoded with scale ``a``), ``q`` None.
        want_idx: also return the assignment (else None, None).
        kmap, mids, grid, g8: the tables of :func:`nearest_variants_torch`.
        nearest: the nearest-point search (default :func:`nearest_variants_torch`; the tests pass its fast path
            to show the fused kernel equals the composition).
        sums: return ``p`` and ``q`` summed over each sub-block's 32 weights, (n, 8) float32 (``sum(-1)``), the sums
            the encoder uses (a fast path may form them in another order).
    Returns:
        (idx (n, 8, 8) int64 | None, flip (n, 8, 32) bool | None, p (n, 8, 32) float32, q (n, 8, 32) float32 | None)
        (p, q (n, 8) with ``sums``).
    Raises:
        ValueError: an unknown ``out`` or shapes that disagree.
    """
    if out not in OUTS:
        raise ValueError(f"out must be one of {OUTS}, got {out!r}")
    n = x.shape[0]
    if x.shape != (n, _N_SUB, 32) or w.shape != x.shape or a.shape != (n, _N_SUB):
        raise ValueError(f"expected x, w (n, 8, 32) and a (n, 8), got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(a.shape)}")
    if nearest is None:
        nearest = nearest_variants_torch
    xa, neg = x.abs(), x < 0
    idx, flip = assign_variants(xa, w, neg, a, parity, full, lambda f, t, o, k: nearest(f, t, o, k, kmap, mids, grid, g8))
    g = points(grid, idx)
    if out == "stats":
        p, q = stats_terms(xa, w, g, flip)
    else:
        p, q = error_terms(x, w, neg, a, g, flip), None
    if sums:
        p, q = p.sum(-1), (None if q is None else q.sum(-1))
    return (idx, flip, p, q) if want_idx else (None, None, p, q)


def exact_torch(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, parity: bool, full: bool, kmap: torch.Tensor,
                mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor, idx_dtype: torch.dtype = torch.int64,
                nearest: Callable | None = None):
    """The exact error of the assignment for sub-block scales ``a`` and that assignment's least-squares sums (the
    reference of the fast path ``iq3.exact``): :func:`assign_torch` with ``out="error"`` and ``sums``, then
    :func:`stats_terms` of the same points summed by ``sum(-1)``.

    Args:
        x, w: (n, 8, 32) float32; a: (n, 8) float32 (>= 0); parity, full, kmap, mids, grid, g8, nearest: as
            :func:`assign_torch`; idx_dtype: the returned indices' integer type.
    Returns:
        (idx (n, 8, 8) ``idx_dtype``, flip (n, 8, 32) bool, err, sxg, sgg (n, 8) float32).
    Raises:
        ValueError: as :func:`assign_torch`.
    """
    idx, flip, err, _ = assign_torch(x, w, a, parity, full, "error", True, kmap, mids, grid, g8, nearest, sums=True)
    p, q = stats_terms(x.abs(), w, points(grid, idx), flip)
    return idx.to(idx_dtype), flip, err, p.sum(-1), q.sum(-1)


SCALE_KINDS = ("half", "odd")  # IQ3_XXS: A = (d (0.5 + l)) 0.5; IQ3_S: A = d (1 + 2 l)


def sub_scale(d: torch.Tensor, lsc: torch.Tensor, kind: str) -> torch.Tensor:
    """Decode's float32 sub-block scales (n, 8) for fp16 ``d`` (n,) float32 and levels ``l`` (n, 8) integer:
    ``kind`` ``"half"`` (IQ3_XXS) ``(d (0.5 + l)) 0.5``, ``"odd"`` (IQ3_S) ``d (1 + 2 l)`` (gguf-py's operations)."""
    if kind == "half":
        return (d.unsqueeze(-1) * (0.5 + lsc.to(torch.float32))) * 0.5
    return d.unsqueeze(-1) * (1 + 2 * lsc).to(torch.float32)


def best_levels(exact: Callable, lsc: torch.Tensor, deltas) -> tuple:
    """Step 3: each sub-block's level ``l`` and its ``l + delta`` (clamped to 0..15, in ``deltas``' order), the one of
    least exact error kept (a later one only where strictly less).

    Args:
        exact: ``exact(l)`` -> (err (n, 8) float, idx (n, 8, 8), flip (n, 8, 32) bool, sxg, sgg (n, 8) or None):
            the assignment under levels ``l`` (n, 8) int64 and its exact error (and least-squares sums).
        lsc: (n, 8) int64 levels; deltas: the offsets tried after ``l`` itself.
    Returns:
        (err, idx, flip, sxg, sgg, l) of the kept level a sub-block (sxg, sgg None where ``exact`` gives None).
    """
    err, idx, flip, sxg, sgg = exact(lsc)
    for delta in deltas:
        lt = (lsc + delta).clamp(0, 15)
        et, it, ft, sx, sg = exact(lt)
        take = et < err
        err = torch.where(take, et, err)
        lsc = torch.where(take, lt, lsc)
        idx = torch.where(take.unsqueeze(-1), it, idx)
        flip = torch.where(take.unsqueeze(-1), ft, flip)
        if sxg is not None:
            sxg, sgg = torch.where(take, sx, sxg), torch.where(take, sg, sgg)
    return err, idx, flip, sxg, sgg, lsc


def exact_levels_torch(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, lsc: torch.Tensor, deltas: tuple,
                       kind: str, parity: bool, kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor,
                       g8: torch.Tensor, idx_dtype: torch.dtype = torch.int64):
    """Step 3 on the exact errors (the reference of the fast path ``iq3.exact_levels``): :func:`best_levels` of
    :func:`exact_torch` under the scales :func:`sub_scale` gives for ``d`` (n,) float32 and each level tried.

    Args:
        x, w: (n, 8, 32) float32; d: (n,) float32; lsc: (n, 8) int64 (0..15); deltas: level offsets; kind: one of
            :data:`SCALE_KINDS`; parity, tables: as :func:`exact_torch` (``full`` False); idx_dtype: the indices' type.
    Returns:
        (err, idx, flip, sxg, sgg, l): err, sxg, sgg (n, 8) float32, idx (n, 8, 8) ``idx_dtype``, flip (n, 8, 32)
        bool, l (n, 8) int64.
    Raises:
        ValueError: an unknown ``kind``, or as :func:`assign_torch`.
    """
    if kind not in SCALE_KINDS:
        raise ValueError(f"kind must be one of {SCALE_KINDS}, got {kind!r}")

    def exact(lt):
        idx, flip, err, sxg, sgg = exact_torch(x, w, sub_scale(d, lt, kind), parity, False, kmap, mids, grid, g8,
                                               idx_dtype)
        return err, idx, flip, sxg, sgg

    return best_levels(exact, lsc, deltas)


def best_scale_update(sxg: torch.Tensor, sgg: torch.Tensor, best_gain: torch.Tensor,
                      best_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's running choice of sub-block scale: a candidate's least-squares sums ``sxg``, ``sgg`` (n, 8) float64
    give the gain ``sxg**2 / sgg`` and the refit scale ``sxg / sgg`` (0 where ``sgg`` is 0); it replaces the best
    where its gain is larger and ``sxg > 0``. Returns (best_gain (n, 8) float64, best_a (n, 8) float32)."""
    gain = kqs.safe_div(sxg * sxg, sgg)
    take = (gain > best_gain) & (sxg > 0)
    return torch.where(take, gain, best_gain), torch.where(take, kqs.safe_div(sxg, sgg).float(), best_a)


def consider_torch(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, parity: bool, best_gain: torch.Tensor,
                   best_a: torch.Tensor, kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor,
                   g8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One candidate of step 1 (the reference of the fast path ``iq3.consider``): the assignment for scales ``a``
    (n, 8) float32 (:func:`assign_torch`, ``full`` False), its least-squares sums and :func:`best_scale_update`.
    x, w: (n, 8, 32) float32; best_gain (n, 8) float64, best_a (n, 8) float32; tables as :func:`assign_torch`.
    Returns the new (best_gain, best_a). Raises ValueError as :func:`assign_torch`."""
    p, q = assign_torch(x, w, a, parity, False, "stats", False, kmap, mids, grid, g8, sums=True)[2:]
    return best_scale_update(p.double(), q.double(), best_gain, best_a)


def step1_torch(x: torch.Tensor, w: torch.Tensor, cand: torch.Tensor, lloyd: int, parity: bool, kmap: torch.Tensor,
                mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor, consider: Callable | None = None) -> torch.Tensor:
    """Step 1 (the reference of the fast path ``iq3.step1``): the running best of :func:`consider_torch` over each
    candidate scale, then ``lloyd`` refits (the best so far considered again).

    Args:
        x, w: (n, 8, 32) float32; cand: (n, 8, T) float32 candidate sub-block scales (>= 0); lloyd: refits;
        parity, kmap, mids, grid, g8: as :func:`consider_torch`; consider: ``consider(a, best_gain, best_a)`` ->
            (best_gain, best_a) (default :func:`consider_torch` with these arguments; the tests pass the fast path
            ``iq3.consider`` to show the fused step equals the composition).
    Returns:
        (n, 8) float32: the scales of largest gain (0 where no candidate had a positive ``sum w v g``).
    """
    if consider is None:
        def consider(a, bg, ba):
            return consider_torch(x, w, a, parity, bg, ba, kmap, mids, grid, g8)
    best_gain = torch.full(cand.shape[:2], -1.0, dtype=torch.float64, device=x.device)
    best_a = torch.zeros(cand.shape[:2], dtype=torch.float32, device=x.device)
    for k in range(cand.shape[-1]):
        best_gain, best_a = consider(cand[..., k], best_gain, best_a)
    for _ in range(lloyd):
        best_gain, best_a = consider(best_a, best_gain, best_a)
    return best_a


def _pick_terms(a: torch.Tensor, sgg: torch.Tensor, cand: torch.Tensor, c: float):
    """Step 2's per-candidate terms: (e (n, C, 8) float64 the least quadratic error of each sub-block over the two odd
    multiples ``2 l + 1`` nearest ``A / (c d)``, ls (n, C, 8, 2) float64 those ``l``, i (n, C, 8) int64 the better)."""
    d3 = cand.unsqueeze(-1).double()  # (n, C, 1)
    ad = a.unsqueeze(1).double()
    u = kqs.safe_div(ad, c * d3)  # ideal odd multiple
    l0 = ((u - 1) * 0.5).floor().clamp(0, 15)
    ls = torch.stack([l0, (l0 + 1).clamp(0, 15)], -1)  # (n, C, 8, 2)
    r = c * d3.unsqueeze(-1) * (2 * ls + 1) - ad.unsqueeze(-1)
    e, i = (sgg[:, None, :, None] * r * r).min(-1)
    return e, ls, i


def pick_errors_torch(a: torch.Tensor, sgg: torch.Tensor, cand: torch.Tensor, c: float) -> torch.Tensor:
    """The fp16 ``d`` search's candidate errors per sub-block.

    Args:
        a: (n, 8) float32 continuous sub-block scales; sgg: (n, 8) float64 ``sum w g**2`` of their points;
        cand: (n, C) float32 candidate ``d`` (>= 0); c: the format's ``A = c d (2 l + 1)`` factor.
    Returns:
        (n, C, 8) float64: per sub-block ``min over l in {l0, l0 + 1} of sgg (c d (2 l + 1) - A)**2``,
        ``l0 = clamp(floor((A / (c d) - 1) / 2), 0, 15)``, ``l0 + 1`` clamped to 15.
    """
    return _pick_terms(a, sgg, cand, c)[0]


def pairwise8(e: torch.Tensor) -> torch.Tensor:
    """``((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7))`` over the last axis (size 8): a fixed order a kernel
    repeats (torch's ``sum(-1)`` adds in an order of its own, another on each device)."""
    s = e[..., 0::2] + e[..., 1::2]
    s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0] + s[..., 1]


def pick_torch(a: torch.Tensor, sgg: torch.Tensor, ts: torch.Tensor, extra: torch.Tensor | None,
               c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2's pick (the reference of the fast path ``iq3.pick``): the fp16 super-block scale ``d`` of least total
    error and its sub-block levels.

    Args:
        a: (n, 8) float32 continuous sub-block scales; sgg: (n, 8) float64 ``sum w g**2`` of their points;
        ts: (T,) float64 steps: candidates ``max A / (c t)``; extra: (n, E) float64 more candidates, or None; c: the
            format's ``A = c d (2 l + 1)`` factor.
    Returns:
        (d (n,) float32: the candidate (each rounded to fp16 by :func:`._kquant_search.f16_candidates`, negative ones
        0) of least :func:`pairwise8` sum of :func:`pick_errors_torch`, the first on a tie; l (n, 8) int64:
        :func:`pick_levels` for it).
    """
    am = a.amax(1, keepdim=True)
    cand = kqs.f16_candidates(torch.cat([am / (c * ts), *([] if extra is None else [extra])], 1))  # (n, C) float32
    cand = cand.clamp_min(0)
    best = pairwise8(pick_errors_torch(a, sgg, cand, c)).argmin(1)
    d = cand.gather(1, best[:, None]).squeeze(1)
    return d, pick_levels(a, sgg, d, c)


def pick_levels(a: torch.Tensor, sgg: torch.Tensor, d: torch.Tensor, c: float) -> torch.Tensor:
    """The sub-block levels ``l`` (n, 8) int64 :func:`pick_errors_torch` scores for one ``d`` (n,) float32 a
    super-block (its better odd multiple, the first on a tie)."""
    _, ls, i = _pick_terms(a, sgg, d[:, None], c)
    return ls.gather(-1, i.unsqueeze(-1)).squeeze(-1).squeeze(1).long()


def variant_count(f: torch.Tensor, t: torch.Tensor, odd: torch.Tensor | None, flip_at: torch.Tensor | None,
                  kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor, g8: torch.Tensor) -> int:
    """The number of variants V (1, 2 or 5) a call of :func:`nearest_variants_torch` (or of a fast path with its
    arguments) scores per group. Raises ValueError when the arguments' shapes disagree (the message lists them)."""
    r = f.shape[0]
    if (f.shape != (r, 8) or t.shape != (r, 4) or (odd is not None and odd.shape != (r,))
            or (flip_at is not None and (odd is None or flip_at.shape != (r,))) or kmap.shape != (4096,)
            or mids.shape != (7,) or grid.ndim != 2 or grid.shape[1] != 4 or g8.shape != (8, grid.shape[0])):
        raise ValueError(f"shapes disagree: f {tuple(f.shape)}, t {tuple(t.shape)}, odd "
                         f"{None if odd is None else tuple(odd.shape)}, flip_at "
                         f"{None if flip_at is None else tuple(flip_at.shape)}, kmap {tuple(kmap.shape)}, mids "
                         f"{tuple(mids.shape)}, grid {tuple(grid.shape)}, g8 {tuple(g8.shape)}")
    return 1 if odd is None else (5 if flip_at is None else 2)


def nearest_variants_torch(f: torch.Tensor, t: torch.Tensor, odd: torch.Tensor | None, flip_at: torch.Tensor | None,
                           kmap: torch.Tensor, mids: torch.Tensor, grid: torch.Tensor,
                           g8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best grid point of every group of 4 and of its sign-flip variants (the torch reference of the fused search
    ``iq3.nearest_variants``, :mod:`.fastpaths`).

    Args:
        f: (R, 8) float32 features ``[2 w v, -A w]``; t: (R, 4) float32 targets ``v / A`` (``v = |x|``).
        odd: (R,) bool groups whose 8-group has an odd number of negative weights (their flip variants are
            scored), or None: variant 0 only (V = 1).
        flip_at: (R,) int64 the weight (0-3) flipped in variant 1 (V = 2), or None with ``odd``: variant ``1 + i``
            flips weight ``i`` (V = 5). A flip negates ``f[:, i]`` and ``t[:, i]``.
        kmap, mids: :func:`_grid_map`'s (4096,) int64 level pattern -> grid index (-1 off the grid) and (7,)
            float32 level midpoints; grid, g8: :func:`_grid_table`'s (P, 4) float32 points and (8, P) ``[g; g**2]``.
    Returns:
        (score (R, V) float32, idx (R, V) int64): ``sum w v**2 - score`` is the variant's error; a group whose
        per-weight nearest levels form a grid point takes that point, the others the best of the whole grid (the
        first on an exact tie); variants > 0 of even groups score -inf with index 0.
    """
    r = f.shape[0]
    nv = variant_count(f, t, odd, flip_at, kmap, mids, grid, g8)
    flips = torch.zeros(r, nv, 4, dtype=torch.bool, device=f.device)
    if nv == 5:
        flips[:, 1:] = torch.eye(4, dtype=torch.bool, device=f.device)
    elif nv == 2:
        flips[:, 1] = torch.nn.functional.one_hot(flip_at, 4).bool()
    sign = torch.where(flips, -1.0, 1.0)
    fv = torch.cat([f[:, None, :4] * sign, f[:, None, 4:].expand(r, nv, 4)], -1)  # (R, V, 8)
    lev = torch.bucketize(t[:, None, :] * sign, mids)
    idx = kmap[(lev << (3 * torch.arange(4, device=f.device))).sum(-1)]
    on = idx >= 0
    s_on = (fv * g8.T[idx.clamp_min(0)]).sum(-1)
    s_all, i_all = (fv @ g8).max(-1)
    score, idx = torch.where(on, s_on, s_all), torch.where(on, idx, i_all)
    if nv > 1:
        keep = odd[:, None] | (torch.arange(nv, device=f.device) == 0)
        score, idx = torch.where(keep, score, -torch.inf), torch.where(keep, idx, 0)
    return score, idx
