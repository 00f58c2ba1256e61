"""Fast K-quant scale searches (``kquants.py``'s ``thorough=False``; the default, thorough ones are in
``_kquant_search``).

Same models and configurations as :mod:`._kquant_search` (``SymConfig``, ``AffConfig``), on
``(n_super, n_sub, sub_size)`` float32 ``x`` and importance ``w``; every step is a few large
batched torch expressions with the candidates stacked in a tensor dimension (no Python loop
over candidates, no host synchronisation), so the same code serves CPU and GPU.

* Symmetric with an exact profile (Q3_K, ``FastSym.exact``): a sub-block's codes change
  only where ``|x_i| / |s|`` crosses ``l + 1/2``; the crossings of all elements and levels
  (one sorted list per sign of the scale, with cumulative ``sum(w x q)`` and ``sum(w q q)``)
  give the exact error ``E_j(s)`` of every scale ``s`` with nearest codes, by a binary search.
  Step 1 takes each sub-block's global optimum from that list; step 2 ranks candidate
  ``d`` by the exact sum of ``min_k E_j(d * k)`` over the floor and ceil of ``A_j / d``.
* Symmetric otherwise (Q6_K): stacked step-1 candidate scales with least-squares refits,
  then candidate ``d`` ranked in closed form (codes fixed), one re-round / re-rank round.
* Affine (Q2_K, Q4_K, Q5_K): stacked step-1 candidates (llama.cpp's ``make_qkx3_quants``
  family and shifted offsets), each refitted by constrained least squares; then a
  coordinate search of ``d`` and ``dmin`` ranked in closed form; then a round on the codes
  re-rounded at the quantized scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from dynaquant.quant.codecs._kquant_search import (
    AffConfig,
    SymConfig,
    aff_codes,
    aff_error,
    aff_eval_choice,
    aff_eval_error,
    aff_ls,
    aff_quad,
    aff_round_candidates,
    f16_candidates,
    inv,
    keep_best,
    pick_min,
    safe_div,
    sym_codes,
    sym_error,
    sym_eval_choice,
    sym_eval_error,
)

# Elements (n_super * n_sub * candidates * sub_size) per chunk of stacked step-1 candidates.
_STACK_CHUNK = 1 << 23


@dataclass(frozen=True)
class FastSym:
    """Settings of the fast symmetric search.

    Attributes:
        qlo, qhi: code range; klo, khi: integer sub-scale range.
        d_steps: candidate ``d`` are ``+-max|A| / t``.
        exact: step 1 and 2 on the exact error profile (small code ranges: Q3_K).
        steps: otherwise, step-1 candidate inverse scales ``+-t / max|x|``.
        rounds: step-2 rounds (each re-rounds the codes at the kept scales).
    """

    qlo: int
    qhi: int
    klo: int
    khi: int
    d_steps: tuple[float, ...]
    exact: bool = False
    steps: tuple[float, ...] = ()
    rounds: int = 2
    window: int = 0


@dataclass(frozen=True)
class FastAff:
    """Settings of the fast affine search.

    Attributes:
        qmax, kmax: top code, top integer sub-scale and min.
        steps, shifts: step-1 candidates, as ``AffSearch``.
        d_steps: candidate ``d`` are ``max(A) / t`` and ``dmin`` ``max(-B) / t``.
        rounds: step-2 rounds.
    """

    qmax: int
    kmax: int
    steps: tuple[float, ...]
    shifts: tuple[float, ...]
    d_steps: tuple[float, ...]
    rounds: int = 2


def _rows(n: int, per_row: int) -> int:
    return max(1, _STACK_CHUNK // max(1, per_row))


# --------------------------------------------------------------------------- symmetric, exact profile


def _profile(x, w, qlo: int, qhi: int):
    """The crossings: sorted inverse scales ``t`` (n_super, n_sub, N) where a code grows by
    one (+inf for zeros), and for each sign of the scale (+1, then -1) the cumulative
    ``sum(w |x| |q|)`` and ``sum(w q q)`` after each, (n_super, n_sub, 2, N) float32. One list
    serves both signs: a crossing past a code's end for one sign adds nothing to its sums."""
    lv = max(-qlo, qhi)
    lev = torch.arange(lv, dtype=x.dtype, device=x.device)
    ax = x.abs()
    bp = (lev + 0.5) * inv(ax).unsqueeze(-1)  # (B,S,E,L)
    bp.masked_fill_((ax == 0).unsqueeze(-1), float("inf"))
    t, order = bp.flatten(-2).sort(-1)
    pos = (x > 0).unsqueeze(-1)
    # scale > 0 gives positive codes for positive x (up to qhi), negative ones down to qlo
    caps = (torch.where(pos, qhi, -qlo), torch.where(pos, -qlo, qhi))
    wax = (w * ax).unsqueeze(-1)
    wq = w.unsqueeze(-1) * (2 * lev + 1)
    sums = []
    for inc in (wax, wq):
        g = torch.stack([torch.where(lev < cap, inc, 0).flatten(-2).gather(-1, order) for cap in caps], -2)
        sums.append(g.cumsum_(-1))
    return t, sums[0], sums[1]


def _profile_error(prof, s: torch.Tensor) -> torch.Tensor:
    """``E_j(s) - sum(w x x)`` for scales ``s`` (n_super, n_sub, M) with nearest codes;
    ``prof``: ``_profile``'s ``t`` and its sums with the sign axis flattened, (B, S, 2N)."""
    t, sxq, sqq = prof
    b, n_sub, n = t.shape
    m = s.shape[-1]
    sa = s.abs()
    i = torch.searchsorted(t.reshape(b * n_sub, n), inv(sa).reshape(b * n_sub, m), right=True).reshape(b, n_sub, m) - 1
    crossed = i >= 0
    i = i.clamp_min_(0) + torch.where(s < 0, n, 0)
    cx = sxq.gather(-1, i)
    cq = sqq.gather(-1, i)
    e = sa * sa * cq - 2 * sa * cx
    return torch.where(crossed, e, torch.zeros_like(e))


def _sym_exact(x, w, spec: FastSym) -> SymConfig:
    n, n_sub, _ = x.shape
    t, sxq, sqq = _profile(x, w, spec.qlo, spec.qhi)
    prof = (t, sxq.flatten(-2), sqq.flatten(-2))
    # step 1: each sub-block's best interval (both signs): gain sxq**2 / sqq
    gain = torch.where(torch.isfinite(t).unsqueeze(-2), safe_div(sxq * sxq, sqq), -1.0)
    g, i = gain.flatten(-2).max(-1)
    cx, cq = (c.flatten(-2).gather(-1, i.unsqueeze(-1)).squeeze(-1) for c in (sxq, sqq))
    a = safe_div(cx, cq) * torch.where(i >= t.shape[-1], -1.0, 1.0)  # (B,S) signed scale
    a = torch.where(g > 0, a, torch.zeros_like(a))
    am = a.gather(1, a.abs().argmax(1, keepdim=True))
    ts = torch.tensor(spec.d_steps, dtype=x.dtype, device=x.device)
    cand = f16_candidates(torch.cat([am / ts, -am / ts], 1))  # (B, C)
    d, k = _exact_pick(prof, a, cand, spec)
    for _ in range(spec.rounds - 1):
        # least-squares d for the kept integer scales, on the codes they give
        dl = d.unsqueeze(-1) * k.float()
        q = sym_codes(x, dl, spec.qlo, spec.qhi)
        kf = k.double()
        sxq_c = (w * x * q).sum(-1).double()
        sqq_c = (w * q * q).sum(-1).double()
        d_ls = safe_div((kf * sxq_c).sum(1), (kf * kf * sqq_c).sum(1)).float()
        cand = f16_candidates(torch.stack([d, d_ls], 1))
        d, k = _exact_pick(prof, a, cand, spec, keep=(d, k))
    return SymConfig(d, k)


def _exact_pick(prof, a, cand, spec: FastSym, keep=None):
    """Best ``(d, k)`` over candidate ``d`` (n_super, C): ``k_j`` the floor or ceil of
    ``A_j / d`` (or the kept ``k``), each ranked by the exact profile error."""
    b, n_sub = a.shape
    c = cand.shape[1]
    d3 = cand.unsqueeze(-1)  # (B,C,1)
    k0 = (a.unsqueeze(1) * inv(d3)).floor_()
    ks = [k0 + o for o in range(-spec.window, spec.window + 2)]
    if keep is not None:
        ks.append(keep[1].float().unsqueeze(1).expand_as(k0))
    k = torch.stack(ks, -1).clamp_(spec.klo, spec.khi)  # (B,C,S,O)
    s = (d3.unsqueeze(-1) * k).permute(0, 2, 1, 3).reshape(b, n_sub, -1)  # (B,S,C*O)
    e = _profile_error(prof, s).reshape(b, n_sub, c, -1).permute(0, 2, 1, 3)  # (B,C,S,O)
    e, i = e.min(-1)
    tot = e.sum(-1)
    if keep is not None:
        tot = torch.cat([tot, torch.full_like(tot[:, :1], float("inf"))], 1)
    j = tot.argmin(1)
    bi = torch.arange(b, device=a.device)
    kk = k[bi, j].gather(-1, i[bi, j].unsqueeze(-1)).squeeze(-1).long()
    return cand[bi, j], kk


# --------------------------------------------------------------------------- symmetric, candidates


def _sym_step1(x, w, spec: FastSym):
    """Stacked step-1 candidates ``+-t / max|x|``; returns the least-squares scales (B, S) float32."""
    n, n_sub, e = x.shape
    ts = torch.tensor(spec.steps, dtype=x.dtype, device=x.device)
    ts = torch.cat([ts, -ts])
    c = ts.numel()
    inv_amax = inv(x.abs().amax(-1))  # (B,S)
    out = []
    step = _rows(n, n_sub * c * e)
    for r0 in range(0, n, step):
        xs, ws = x[r0 : r0 + step], w[r0 : r0 + step]
        isc = inv_amax[r0 : r0 + step, :, None, None] * ts[:, None]  # (b,S,C,1)
        q = (xs.unsqueeze(-2) * isc).round_().clamp_(spec.qlo, spec.qhi)  # (b,S,C,E)
        sxq = torch.matmul(q, (ws * xs).unsqueeze(-1)).squeeze(-1)
        sqq = torch.matmul(q.mul_(q), ws.unsqueeze(-1)).squeeze(-1)
        g = safe_div(sxq * sxq, sqq)
        i = g.argmax(-1, keepdim=True)
        out.append(safe_div(sxq.gather(-1, i), sqq.gather(-1, i)).squeeze(-1))
    a = torch.cat(out)
    # one re-round / refit from the best
    q = sym_codes(x, a, spec.qlo, spec.qhi)
    wq = w * q
    a2 = safe_div((wq * x).sum(-1), (wq * q).sum(-1))
    return a2


def _sym_cand(x, w, spec: FastSym) -> SymConfig:
    a = _sym_step1(x, w, spec)
    q = sym_codes(x, a, spec.qlo, spec.qhi)
    ts = torch.tensor(spec.d_steps, dtype=x.dtype, device=x.device)
    best = best_err = None
    for _ in range(spec.rounds):
        wq = w * q
        sxq = (wq * x).sum(-1)
        sqq = (wq * q).sum(-1)
        a = safe_div(sxq, sqq)
        am = a.gather(1, a.abs().argmax(1, keepdim=True))
        cand = [am / ts, -am / ts]
        if best is not None:
            kf = best.k.float()
            cand += [best.d.unsqueeze(1), safe_div((kf * sxq).sum(1), (kf * kf * sqq).sum(1)).unsqueeze(1)]
        cand = f16_candidates(torch.cat(cand, 1))
        cfg = SymConfig(*pick_min([(cand,)], partial(sym_eval_error, a, sqq, spec.klo, spec.khi),
                                  partial(sym_eval_choice, a, sqq, spec.klo, spec.khi)))
        dl = cfg.sub_scales()
        q = sym_codes(x, dl, spec.qlo, spec.qhi)
        err = sym_error(x, w, dl, q).sum(-1)
        best, best_err = keep_best(best, best_err, cfg, err)
        if best is not cfg:  # codes of the kept configuration for the next round
            q = sym_codes(x, best.sub_scales(), spec.qlo, spec.qhi)
    return best


def sym_fast(x: torch.Tensor, w: torch.Tensor, spec: FastSym) -> SymConfig:
    """Fast symmetric search; x, w: (n_super, n_sub, sub_size) float32 -> SymConfig."""
    return _sym_exact(x, w, spec) if spec.exact else _sym_cand(x, w, spec)


# --------------------------------------------------------------------------- affine


def _aff_step1(x, w, spec: FastAff):
    """Stacked step-1 candidates; returns the constrained least-squares ``(A, B)`` (B, S) float64."""
    n, n_sub, e = x.shape
    ts = torch.tensor(spec.steps, dtype=x.dtype, device=x.device)
    sh = torch.tensor(spec.shifts, dtype=x.dtype, device=x.device)
    c = ts.numel() * sh.numel()
    lo = x.amin(-1).clamp_max(0)
    rng = x.amax(-1) - lo
    wx = w * x
    sw, sx, sxx = w.sum(-1).double(), wx.sum(-1).double(), (wx * x).sum(-1).double()
    iscale = (ts * inv(rng).unsqueeze(-1)).repeat_interleave(sh.numel(), -1)  # (B,S,C)
    b0 = lo.unsqueeze(-1) + (sh.repeat(ts.numel()) * rng.unsqueeze(-1) / ts.repeat_interleave(sh.numel()))
    ww = torch.stack([w, wx], -1)  # (B,S,E,2): sums by one batched matmul per candidate stack
    out_a, out_b = [], []
    step = _rows(n, n_sub * c * e)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        xs = x[sl].unsqueeze(-2)
        q = ((xs - b0[sl].unsqueeze(-1)) * iscale[sl].unsqueeze(-1)).round_().clamp_(0, spec.qmax)  # (b,S,C,E)
        s1 = torch.matmul(q, ww[sl]).double()  # (b,S,C,2): sum(w q), sum(w x q)
        sqq = torch.matmul(q.mul_(q), w[sl].unsqueeze(-1)).squeeze(-1).double()
        sq, sxq = s1[..., 0], s1[..., 1]
        st = [t[sl].unsqueeze(-1) for t in (sw, sx, sxx)]
        a, b = aff_ls(st[0], sq, sqq, st[1], sxq)
        err = aff_quad(st[0], sq, sqq, st[1], sxq, st[2], a, b)
        i = err.argmin(-1, keepdim=True)
        out_a.append(a.gather(-1, i).squeeze(-1))
        out_b.append(b.gather(-1, i).squeeze(-1))
    a, b = torch.cat(out_a), torch.cat(out_b)
    # one re-round / refit from the best
    q = aff_codes(x, a.float(), (-b).float(), spec.qmax)
    wq = w * q
    a2, b2 = aff_ls(sw, wq.sum(-1).double(), (wq * q).sum(-1).double(), sx, (wx * q).sum(-1).double())
    return a2, b2, q


def aff_fast(x: torch.Tensor, w: torch.Tensor, spec: FastAff) -> AffConfig:
    """Fast affine search; x, w: (n_super, n_sub, sub_size) float32 -> AffConfig."""
    kmax = spec.kmax
    _, _, q = _aff_step1(x, w, spec)
    wx = w * x
    sw, sx = w.sum(-1).double(), wx.sum(-1).double()
    ts = torch.tensor(spec.d_steps, dtype=torch.float32, device=x.device)
    best = best_err = None
    for _ in range(spec.rounds):
        ref, dc, mc, grid_m = aff_round_candidates(w, wx, q, sw, sx, ts, kmax, best)
        error, choice = partial(aff_eval_error, ref, kmax), partial(aff_eval_choice, ref, kmax)
        cfg = AffConfig(*pick_min([(dc, mc)], error, choice))
        mc = torch.cat([grid_m, cfg.dmin.unsqueeze(1)], 1)
        cfg = AffConfig(*pick_min([(cfg.d.unsqueeze(1).expand_as(mc), mc)], error, choice))
        dl, ml = cfg.sub_scales()
        q = aff_codes(x, dl, ml, spec.qmax)
        err = aff_error(x, w, dl, ml, q).sum(-1)
        best, best_err = keep_best(best, best_err, cfg, err)
        if best is not cfg:  # codes of the kept configuration for the next round
            q = aff_codes(x, *best.sub_scales(), spec.qmax)
    return best
