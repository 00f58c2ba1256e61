"""Scale searches behind the K-quant encoders (private to ``kquants.py``).

Two families of sub-block models, both on super-blocks of 256 weights viewed as
``(n_super, n_sub, sub_size)`` float32 tensors ``x`` with importance ``w`` (> 0):

* symmetric (Q3_K, Q6_K): ``x ~ (d * k_j) * q``, codes ``q`` in ``[qlo, qhi]``, integer
  sub-scales ``k_j`` in ``[klo, khi]``, one float16 ``d`` per super-block;
* affine (Q2_K, Q4_K, Q5_K): ``x ~ (d * ks_j) * q - dmin * km_j``, ``q`` in ``[0, qmax]``,
  ``ks_j, km_j`` in ``[0, kmax]``, float16 ``d, dmin`` per super-block.

The encoders minimise ``sum(w * (x - decode)**2)`` in three steps, batched over all
super-blocks (no loop over blocks; the loops are over candidates, keeping a running best):

1. per sub-block, continuous scales (and offsets): many candidate inverse scales (and
   starting offsets), each followed by a weighted least-squares refit of the scale (and
   offset) to the rounded codes, then a few re-round / refit steps from the best. Q3_K
   tries every interval of inverse scales with constant codes (the global optimum);
   Q6_K adds the scales that put its most important elements exactly on a level. Q2_K
   then spreads codes that leave levels unused over the code range where the same levels fit
   at a smaller scale (``AffSearch.widen``).
2. the super-block scale ``d`` (and ``dmin``): many float16 candidates, each with its best
   integer sub-scales (floor or ceil; for the affine model, the min's floor or ceil at the
   best offset for that scale), ranked by the closed-form quadratic error of the current
   codes. The affine model searches ``d`` then ``dmin`` (coordinate search), and also
   tries the least-squares ``(d, dmin)`` of the previous round. The symmetric model also
   tries smaller ``d`` that clip its largest sub-block scales (``SymSearch.clip_steps``),
   ranked with the exact error of a clamped sub-block, which the quadratic overstates.
3. codes are re-rounded with the quantized scales exactly as decode rebuilds them, small
   moves of each integer sub-scale (and min) are tried on the elements, and per super-block
   the configuration with the lowest exact error is kept. Steps 2-3 repeat.

A configuration (``d``, ``dmin``, integer sub-scales) fixes the codes (nearest rounding,
optimal per element for given scales), so only configurations are carried. Sums per
sub-block are float64 where they feed least squares; element-level work is float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from dynaquant.quant.codecs.consts import device_constant
from dynaquant.quant.codecs.fastpaths import fast_path

_F16_MAX = 65504.0
_F16_TINY = 2.0**-24  # smallest positive float16 (subnormal)
# Candidate evaluations (n_super * C * n_sub * options) per chunk in step 2, to bound memory: on a CPU a chunk that
# stays in cache; on a GPU 16x more (~2 GB of temporaries), since there one candidate a call left the search bound by
# the launches of its small kernels (~22 000 for a 16 M-weight Q4_K chunk on an H100, 141 ms of kernel time in 0.54 s).
# The chunking does not change the result: each candidate's error is computed alone and the first best is kept.
_EVAL_CHUNK = 1 << 21
_EVAL_CHUNK_GPU = 1 << 25


def eval_chunk(device: torch.device) -> int:
    """Candidate evaluations a step-2 chunk holds on ``device``."""
    return _EVAL_CHUNK if device.type == "cpu" else _EVAL_CHUNK_GPU

MOVES_SMALL = ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1))
MOVES_WIDE = MOVES_SMALL + ((2, 0), (-2, 0), (0, 2), (0, -2), (2, 1), (-2, -1), (1, 2), (-1, -2))


def fp16_round(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest float16 (saturating at +-65504), returned in ``v``'s dtype."""
    return v.clamp(-_F16_MAX, _F16_MAX).to(torch.float16).to(v.dtype)


def f16_candidates(v: torch.Tensor) -> torch.Tensor:
    """Float16-rounded candidate scales as float32; nonzero values that would round to 0 (or
    a very coarse subnormal) become +-2**-24, so tiny blocks keep a usable scale."""
    v = v.float()
    tiny = (v != 0) & (v.abs() < _F16_TINY)
    return fp16_round(torch.where(tiny, torch.sign(v) * _F16_TINY, v))


def safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` where ``b != 0``, else 0 (scalar fills: no tensors of ones and zeros made a call)."""
    nz = b != 0
    return torch.where(nz, a / torch.where(nz, b, 1), 0)


def inv(b: torch.Tensor) -> torch.Tensor:
    return safe_div(torch.ones_like(b), b)


def pick_min(cands, error, payload):
    """Per super-block the candidate of lowest error over chunks of candidates (the first on a tie, chunk by chunk),
    and its payload: ``cands`` yields tuples of (n_super, c) candidate parameters, ``error(*chunk)`` returns their
    (n_super, c) errors, ``payload(*params)`` the payload of one candidate a super-block from its (n_super,)
    parameters, computed once for the winners rather than for every candidate."""
    best_e = best = None
    for chunk in cands:
        e = error(*chunk)
        i = e.argmin(1, keepdim=True)
        e = e.gather(1, i).squeeze(1)
        sel = [c.gather(1, i).squeeze(1) for c in chunk]
        if best is None:
            best_e, best = e, sel
        else:
            take = e < best_e
            best_e = torch.where(take, e, best_e)
            best = [torch.where(take, c, b) for c, b in zip(sel, best)]
    return payload(*best)


def keep_best(best, best_err, cfg, err):
    """Per super-block, the better of the kept ``(best, best_err)`` (None at first) and
    ``(cfg, err)``: configurations with ``.where``, errors (n_super,)."""
    if best is None:
        return cfg, err
    take = err < best_err
    return cfg.where(take, best), torch.where(take, err, best_err)


def chunks(step: int, *cands: torch.Tensor):
    for c0 in range(0, cands[0].shape[1], step):
        yield tuple(c[:, c0 : c0 + step] for c in cands)


# --------------------------------------------------------------------------- symmetric


@dataclass(frozen=True)
class SymSearch:
    """Settings of the symmetric search.

    Attributes:
        qlo, qhi: code range (Q3_K -4, 3; Q6_K -32, 31).
        klo, khi: integer sub-scale range (Q3_K -32, 31; Q6_K -128, 127).
        d_steps: candidate super-block scales are ``+-max|A| / t`` for each ``t``.
        steps: step-1 candidate inverse scales ``+-t / max|x|`` for each ``t``.
        n_elem: step 1 also puts each of the ``n_elem`` elements with the largest
            ``w * x**2`` exactly on every nonzero level.
        exhaustive: step 1 tries every interval of inverse scales with constant codes.
        rounds: repetitions of steps 2-3.
        clip_steps: more candidate ``d``, ``+-max|A| / t`` for each ``t``, past ``d_steps``: scales at which the
            largest sub-blocks' integer scales clamp (their scale clipped). Where one sub-block of little importance
            (an outlier) sets ``max|A|``, a smaller ``d`` gives the other fifteen finer scales; step 2 picks the best
            of these apart, ranked with a clamped sub-block's exact error (:func:`sym_clip_error`), step 3 refines
            it too, and the exact error keeps the better of the two. llama.cpp's weighted fit of ``d`` reaches such
            scales (``make_qx_quants`` on the sub-block scales); Q3_K's grid alone left it 2% behind llama.cpp
            (weighted error 1.02x).
        clip_max: step 2 ranks a candidate's clamped sub-blocks by their exact error only where it clamps at most
            this many (one that clips most of a super-block is not a contender: the quadratic ranks it, and the
            exact errors, 16x the work of a quadratic term, stay few; 1 kept all of the gain on Q3_K).
    """

    qlo: int
    qhi: int
    klo: int
    khi: int
    d_steps: tuple[float, ...]
    steps: tuple[float, ...] = ()
    n_elem: int = 0
    exhaustive: bool = False
    rounds: int = 2
    clip_steps: tuple[float, ...] = ()
    clip_max: int = 1

    def d_grid(self) -> tuple[float, ...]:
        """Step 2's divisors ``t`` of ``max|A|``: ``d_steps``, then ``clip_steps``."""
        return tuple(self.d_steps) + tuple(self.clip_steps)

    def __post_init__(self):
        if self.clip_max < 0:
            raise ValueError(f"clip_max must be >= 0, got {self.clip_max}")


@dataclass
class SymConfig:
    """A symmetric encoding: ``d`` (n_super,) float32 holding float16 values; ``k`` (n_super, n_sub) int64."""

    d: torch.Tensor
    k: torch.Tensor

    def where(self, take: torch.Tensor, other: SymConfig) -> SymConfig:
        """Per super-block: this configuration where ``take`` (n_super,) bool, else ``other``."""
        return SymConfig(torch.where(take, self.d, other.d), torch.where(take.unsqueeze(-1), self.k, other.k))

    def sub_scales(self) -> torch.Tensor:
        """Decode's float32 ``d * k``, (n_super, n_sub)."""
        return self.d.unsqueeze(-1) * self.k.float()


def sym_codes(x: torch.Tensor, dl: torch.Tensor, qlo: int, qhi: int) -> torch.Tensor:
    """Nearest codes (float32) for sub-block scales ``dl`` (n_super, n_sub); 0 where ``dl == 0``."""
    return (x * inv(dl).unsqueeze(-1)).round_().clamp_(qlo, qhi)


def sym_error(x: torch.Tensor, w: torch.Tensor, dl: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum(w * (x - dl * q)**2)`` per sub-block, (n_super, n_sub) float64."""
    r = x - dl.unsqueeze(-1) * q
    return (w * r * r).sum(-1).double()


def exhaustive_breakpoints(x: torch.Tensor, qlo: int, qhi: int) -> torch.Tensor:
    """Where the codes of the exhaustive step 1 change: ``inv(|x_i|) * (l + 1/2)`` for ``l < max(-qlo, qhi)``,
    ``(..., sub_size)`` float32 -> ``(..., sub_size * max(-qlo, qhi))`` ascending."""
    half = torch.arange(max(-qlo, qhi), dtype=x.dtype, device=x.device) + 0.5
    return (inv(x.abs()).unsqueeze(-1) * half).flatten(-2).sort(-1).values


def exhaustive_mids(x: torch.Tensor, qlo: int, qhi: int) -> torch.Tensor:
    """The exhaustive step 1's inverse scales (positive side): the middle of every interval
    between consecutive code breakpoints (:func:`exhaustive_breakpoints`) and a point past the last,
    ``(..., sub_size)`` float32 -> ``(..., sub_size * max(-qlo, qhi))`` ascending."""
    bp = exhaustive_breakpoints(x, qlo, qhi)
    return torch.cat([(bp[..., :-1] + bp[..., 1:]) * 0.5, bp[..., -1:] * 1.25], -1)


def sym_search_scales(x: torch.Tensor, w: torch.Tensor, spec: SymSearch, iters: int = 2, backend: str = "auto"):
    """:func:`sym_search_scales_torch`, or its fast path ``kquant.sym_search_scales`` as ``backend``
    chooses (:func:`dynaquant.quant.codecs.fastpaths.fast_path`)."""
    fn = fast_path("kquant.sym_search_scales", x, backend)
    return (fn or sym_search_scales_torch)(x, w, spec, iters)


def sym_search_scales_torch(x: torch.Tensor, w: torch.Tensor, spec: SymSearch, iters: int = 2) -> torch.Tensor:
    """Step 1, symmetric: the best continuous scale per sub-block.

    Args:
        x, w: (n_super, n_sub, sub_size) float32.
    Returns:
        (n_super, n_sub) float64 signed scale ``A`` minimising ``sum(w * (x - A * q)**2)``
        (``q`` the nearest codes) over the candidates of ``spec``.
    """
    qlo, qhi = spec.qlo, spec.qhi
    wx = w * x
    inv_amax = inv(x.abs().amax(-1))
    best_gain = torch.full(inv_amax.shape, -1.0, dtype=torch.float64, device=x.device)
    best_a = torch.zeros(inv_amax.shape, dtype=torch.float64, device=x.device)

    def consider(iscale: torch.Tensor) -> None:  # iscale: (B, S, 1)
        q = (x * iscale).round_().clamp_(qlo, qhi)
        sxq = (wx * q).sum(-1).double()
        sqq = (w * q).mul_(q).sum(-1).double()
        nz = sqq != 0  # safe_div's values, its mask and divisor shared by both quotients
        den = torch.where(nz, sqq, 1.0)
        gain = torch.where(nz, sxq * sxq / den, 0.0)  # error = Sxx - gain
        better = gain > best_gain
        torch.where(better, gain, best_gain, out=best_gain)
        torch.where(better, torch.where(nz, sxq / den, 0.0), best_a, out=best_a)

    for t in spec.steps:
        for sign in (1.0, -1.0):
            consider((sign * t * inv_amax).unsqueeze(-1))
    if spec.exhaustive:
        # Codes change where |x_i| * iscale crosses l + 1/2; between consecutive breakpoints
        # they are constant, so the middle of every interval (and a point past the last one),
        # with both signs, covers every distinct code vector.
        mids = exhaustive_mids(x, qlo, qhi)
        for i in range(mids.shape[-1]):
            for sign in (1.0, -1.0):
                consider(sign * mids[..., i : i + 1])
    if spec.n_elem:
        idx = (w * x * x).topk(min(spec.n_elem, x.shape[-1]), dim=-1).indices
        for i in range(idx.shape[-1]):
            inv_xi = inv(x.gather(-1, idx[..., i : i + 1]))
            for lev in range(qlo, qhi + 1):
                if lev:
                    consider(lev * inv_xi)
    for _ in range(iters):
        consider(inv(best_a.float()).unsqueeze(-1))
    return best_a


def _sym_pair(a, sqq, klo, khi, d):
    """A sub-block's two integer scales at candidate scale ``d``, floor and ceil of ``A / d``, with their errors:
    ``(k0, e0), (k1, e1)``, ``e = Sqq (d k - A)**2`` (``a``, ``sqq``, ``d`` broadcast against each other)."""
    k0 = (a * inv(d)).floor_().clamp_(klo, khi)
    k1 = (k0 + 1).clamp_(klo, khi)
    r0 = d * k0 - a
    r1 = d * k1 - a
    return (k0, sqq * r0 * r0), (k1, sqq * r1 * r1)


def sym_eval_error(a, sqq, klo, khi, d):
    """Step-2 ranking of candidate scales ``d`` (n_super, C).

    With the codes fixed, a sub-block's error at scale ``D`` is ``E(A) + Sqq (D - A)**2``
    (``A`` its least-squares scale, ``a`` (n_super, n_sub)); candidates are ranked by the sum of the second term
    over sub-blocks, each with the better of floor/ceil ``A / d``. Returns err (n_super, C)."""
    (_, e0), (_, e1) = _sym_pair(a.unsqueeze(1), sqq.unsqueeze(1), klo, khi, d.unsqueeze(-1))
    return torch.minimum(e0, e1).sum(-1)


def sym_eval_choice(a, sqq, klo, khi, d):
    """The payload of one candidate ``d`` (n_super,) a super-block: ``(d, k (n_super, n_sub) int64)``, the integer
    scales :func:`sym_eval_error` ranked it with (floor on a tie)."""
    (k0, e0), (k1, e1) = _sym_pair(a, sqq, klo, khi, d.unsqueeze(-1))
    return d, torch.where(e1 < e0, k1, k0).long()


def sym_clip_error(x, w, a, sqq, spec, d, clip):
    """Step-2 ranking of candidate scales ``d`` (n_super, C) in the thorough search: :func:`sym_eval_error`'s, but for
    the candidates where ``clip`` (n_super, C) bool (the clip steps), a sub-block whose scale clamps
    (``f = floor(A / d)`` out of ``[klo, khi)``) counts with the exact error of its codes re-rounded at the clamped
    scale ``d clamp(f, klo, khi)`` (:func:`sym_error`'s terms summed in float32) where the candidate clamps 1 to
    ``spec.clip_max`` sub-blocks: the quadratic keeps the codes of the unclamped scale and overstates a clipped
    sub-block's error many times. ``x``, ``w`` (n_super, n_sub, sub_size), ``a``, ``sqq`` (n_super, n_sub) float32.
    Returns err (n_super, C) float32."""
    a3, sqq3, d3 = a.unsqueeze(1), sqq.unsqueeze(1), d.unsqueeze(-1)
    (k0, e0), (_, e1) = _sym_pair(a3, sqq3, spec.klo, spec.khi, d3)
    e = torch.minimum(e0, e1)  # (n_super, C, n_sub)
    if not clip.any():
        return e.sum(-1)
    f = (a3 * inv(d3)).floor_()
    out = (f < spec.klo) | (f >= spec.khi)
    exact = out & (out.sum(-1, keepdim=True) <= spec.clip_max) & clip.unsqueeze(-1)
    if exact.any():
        dl = (d3 * k0).unsqueeze(-1)  # k0 = clamp(f, klo, khi)
        x4 = x.unsqueeze(1)
        r = x4 - dl * (x4 * inv(dl)).round_().clamp_(spec.qlo, spec.qhi)
        e = torch.where(exact, (w.unsqueeze(1) * r * r).sum(-1), e)
    return e.sum(-1)


def sym_pick_torch(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, sqq: torch.Tensor, spec: SymSearch,
                   cand: torch.Tensor, clip: bool = False):
    """Step 2, symmetric: per super-block the first candidate ``d`` of ``cand`` (n_super, C)
    float32 with the lowest error: :func:`sym_eval_error`, or with ``clip`` :func:`sym_clip_error` (``x``, ``w``
    (n_super, n_sub, sub_size), ``a``, ``sqq`` (n_super, n_sub) float32; ``spec`` the code and integer-scale
    ranges); returns ``d`` (n_super,) float32 and ``k`` (n_super, n_sub) int64, the better of floor and ceil of
    ``A / d`` by the quadratic (the clamped one where the scale clamps)."""
    n_super, n_sub = a.shape
    per = n_sub * (x.shape[-1] if clip else 2)
    step = max(1, eval_chunk(a.device) // max(1, n_super * per))
    flags = torch.full_like(cand, bool(clip), dtype=torch.bool)
    return pick_min(chunks(step, cand, flags), partial(sym_clip_error, x, w, a, sqq, spec),
                    lambda d, _f: sym_eval_choice(a, sqq, spec.klo, spec.khi, d))


def sym_pick(x, w, a, sqq, spec, cand, clip: bool = False, backend: str = "auto"):
    """:func:`sym_pick_torch`, or its fast path ``kquant.sym_pick`` as ``backend`` chooses."""
    return (fast_path("kquant.sym_pick", a, backend) or sym_pick_torch)(x, w, a, sqq, spec, cand, clip)


def sym_refine(x, w, cfg: SymConfig, spec: SymSearch, backend: str = "auto"):
    """:func:`sym_refine_torch`, or its fast path ``kquant.sym_refine`` as ``backend`` chooses."""
    return (fast_path("kquant.sym_refine", x, backend) or sym_refine_torch)(x, w, cfg, spec)


def sym_refine_torch(x, w, cfg: SymConfig, spec: SymSearch):
    """Step 3, symmetric: try ``k_j +- 1`` on the elements; returns (config, error per super-block)."""
    dl = cfg.sub_scales()
    err = sym_error(x, w, dl, sym_codes(x, dl, spec.qlo, spec.qhi))
    k = cfg.k
    for delta in (1, -1):
        kt = (k + delta).clamp(spec.klo, spec.khi)
        dlt = cfg.d.unsqueeze(-1) * kt.float()
        et = sym_error(x, w, dlt, sym_codes(x, dlt, spec.qlo, spec.qhi))
        take = et < err
        err = torch.where(take, et, err)
        k = torch.where(take, kt, k)
    return SymConfig(cfg.d, k), err.sum(-1)


SYM_BYTES = {"Q3_K": (3, 110), "Q6_K": (6, 210)}  # code bits and block bytes of the symmetric K-quants


def sym_bytes_layout(format_name: str, x: torch.Tensor, cfg: SymConfig, packer: str) -> tuple[int, int]:
    """(code bits, block bytes) of ``format_name`` for a ``kquant.sym_bytes`` fast path (``packer`` names it in
    errors), after checking x (n, 256), ``cfg.d`` (n,) and ``cfg.k`` (n, 16).

    Raises:
        ValueError: a format other than Q3_K / Q6_K, or shapes that disagree.
    """
    if format_name not in SYM_BYTES:
        raise ValueError(f"no {packer} packing of {format_name}: {', '.join(SYM_BYTES)}")
    n = x.shape[0]
    if x.shape != (n, 256) or cfg.d.shape != (n,) or cfg.k.shape != (n, 16):
        raise ValueError(f"expected x (n, 256), d (n,), k (n, 16), got {tuple(x.shape)}, {tuple(cfg.d.shape)}, "
                         f"{tuple(cfg.k.shape)}")
    return SYM_BYTES[format_name]


def sym_encode(x: torch.Tensor, w: torch.Tensor, spec: SymSearch, backend: str = "auto") -> SymConfig:
    """The whole search's fast path ``kquant.sym_encode`` as ``backend`` chooses (``"auto"``: the compiled one on CPU,
    on CUDA the steps' kernels with the glue between them fused, the same bytes), else :func:`sym_encode_torch` with
    the steps' own fast paths (``"triton"``: the steps' kernels)."""
    fn = None if backend == "triton" else fast_path("kquant.sym_encode", x, backend)
    return fn(x, w, spec) if fn is not None else sym_encode_torch(x, w, spec, backend)


def sym_encode_torch(x: torch.Tensor, w: torch.Tensor, spec: SymSearch, backend: str = "auto") -> SymConfig:
    """Symmetric model, steps 1-3 (module docstring); x, w: (n_super, n_sub, sub_size) float32;
    ``backend`` chooses the steps' fast paths (:func:`dynaquant.quant.codecs.fastpaths.fast_path`)."""
    a = sym_search_scales(x, w, spec, backend=backend)
    q = sym_codes(x, a.float(), spec.qlo, spec.qhi)
    wx = w * x
    ts = device_constant(spec.d_steps, torch.float64, x.device)
    tc = device_constant(spec.clip_steps, torch.float64, x.device)
    best: SymConfig | None = None
    best_err = None
    for r in range(spec.rounds):
        sxq = (wx * q).sum(-1).double()
        sqq = (w * q * q).sum(-1).double()
        a = safe_div(sxq, sqq)
        am = a.gather(1, a.abs().argmax(1, keepdim=True))  # signed largest sub-scale, (B, 1)
        cand = [am / ts, -am / ts]
        if best is not None:
            # the kept d and its least-squares refit to the current codes and integer scales
            kf = best.k.double()
            d_ls = safe_div((kf * sxq).sum(1), (kf * kf * sqq).sum(1))
            cand += [best.d.double().unsqueeze(1), d_ls.unsqueeze(1)]
        groups = [(f16_candidates(torch.cat(cand, 1)), False)]
        if spec.clip_steps:  # the clip steps, ranked with clipping, picked and refined apart: kept by the exact error
            groups.append((f16_candidates(torch.cat([am / tc, -am / tc], 1)), True))
        for cand_g, clip in groups:
            d, k = sym_pick(x, w, a.float(), sqq.float(), spec, cand_g, clip, backend)
            cfg, err = sym_refine(x, w, SymConfig(d, k), spec, backend)
            best, best_err = keep_best(best, best_err, cfg, err)
        if r + 1 < spec.rounds:
            q = sym_codes(x, best.sub_scales(), spec.qlo, spec.qhi)
    return best


# --------------------------------------------------------------------------- affine


@dataclass(frozen=True)
class AffSearch:
    """Settings of the affine search.

    Attributes:
        qmax: top code (Q2_K 3, Q4_K 15, Q5_K 31).
        kmax: top integer sub-scale and min (Q2_K 15, else 63).
        steps, shifts: step-1 candidates: codes ``round((x - b0) * t / (max - m0))`` with
            ``m0 = min(min(x), 0)`` and ``b0 = m0 + s * (max - m0) / t``, for each ``t`` in
            ``steps`` and ``s`` in ``shifts``.
        d_steps: candidate ``d`` are ``max(A) / t`` and candidate ``dmin`` ``max(-B) / t``.
        moves: step-3 moves ``(dks, dkm)`` of each sub-block's integer scale and min.
        rounds: repetitions of steps 2-3.
        widen: after step 1, a sub-block whose codes' levels fit at a smaller scale gets them spread over the code
            range (:func:`aff_widen`: the same levels kept, so no worse a fit).
            Step 1's fits of such a sub-block (an outlier and fifteen weights on one level: two levels, at any
            spacing) tie, and which one wins is a rounding; the widest ``A`` sets step 2's grid ``max(A) / t`` for
            the whole super-block and leaves the other sub-blocks' scales at 0 or 1 (Q2_K: 2.9x the error of the
            narrow fit on such a block, 13% on tests/test_codecs_kquants.py ``test_device``'s input). On for Q2_K
            (its weighted error 1.5-7% lower on synthetic tensors, 6.4% on benchmarks/encode_speed.py's); off for
            Q4_K and Q5_K, which keep their bytes (Q4_K 0.05% lower there with it, Q5_K unchanged).
    """

    qmax: int
    kmax: int
    steps: tuple[float, ...]
    shifts: tuple[float, ...]
    d_steps: tuple[float, ...]
    moves: tuple[tuple[int, int], ...] = MOVES_SMALL
    rounds: int = 2
    widen: bool = False


@dataclass
class AffConfig:
    """An affine encoding: ``d``, ``dmin`` (n_super,) float32 holding float16 values;
    ``ks``, ``km`` (n_super, n_sub) int64."""

    d: torch.Tensor
    dmin: torch.Tensor
    ks: torch.Tensor
    km: torch.Tensor

    def where(self, take: torch.Tensor, other: AffConfig) -> AffConfig:
        """Per super-block: this configuration where ``take`` (n_super,) bool, else ``other``."""
        t1 = take.unsqueeze(-1)
        return AffConfig(
            torch.where(take, self.d, other.d),
            torch.where(take, self.dmin, other.dmin),
            torch.where(t1, self.ks, other.ks),
            torch.where(t1, self.km, other.km),
        )

    def sub_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(dl, ml): decode's float32 ``d * ks`` and ``dmin * km``, (n_super, n_sub) each."""
        return self.d.unsqueeze(-1) * self.ks.float(), self.dmin.unsqueeze(-1) * self.km.float()


def aff_codes(x: torch.Tensor, dl: torch.Tensor, ml: torch.Tensor, qmax: int) -> torch.Tensor:
    """Nearest codes (float32) in ``[0, qmax]`` for ``x ~ dl * q - ml``; 0 where ``dl == 0``."""
    return ((x + ml.unsqueeze(-1)) * inv(dl).unsqueeze(-1)).round_().clamp_(0, qmax)


def aff_error(x, w, dl, ml, q) -> torch.Tensor:
    """``sum(w * (x - (dl * q - ml))**2)`` per sub-block in decode's float32 order, float64."""
    r = x - (dl.unsqueeze(-1) * q - ml.unsqueeze(-1))
    return (w * r * r).sum(-1).double()


def aff_ls(sw, sq, sqq, sx, sxq):
    """Weighted least squares of ``x ~ A q + B`` with ``A >= 0``, ``B <= 0``; returns (A, B)."""
    det = sw * sqq - sq * sq
    ok = det > 1e-12 * sw * sqq
    det = torch.where(ok, det, 0.0)
    a = safe_div(sw * sxq - sq * sx, det)
    b = safe_div(sqq * sx - sq * sxq, det)
    # constrained or degenerate: B = 0 with A = Sxq / Sqq (A >= 0), then B refitted if A is 0
    fix = ~ok | (b > 0) | (a < 0)
    a2 = safe_div(sxq, sqq).clamp_min(0)
    b2 = safe_div(sx - a2 * sq, sw).clamp_max(0)
    return torch.where(fix, a2, a), torch.where(fix, b2, b)


def aff_quad(sw, sq, sqq, sx, sxq, sxx, a, b):
    """``sum(w (x - a q - b)**2)`` from the sums."""
    return sxx - 2 * a * sxq - 2 * b * sx + a * a * sqq + 2 * a * b * sq + b * b * sw


def aff_search_scales(x: torch.Tensor, w: torch.Tensor, spec: AffSearch, iters: int = 3, backend: str = "auto"):
    """:func:`aff_search_scales_torch`, or its fast path ``kquant.aff_search_scales`` as ``backend`` chooses."""
    return (fast_path("kquant.aff_search_scales", x, backend) or aff_search_scales_torch)(x, w, spec, iters)


def aff_search_scales_torch(x: torch.Tensor, w: torch.Tensor, spec: AffSearch, iters: int = 3):
    """Step 1, affine: the best continuous ``(A, B)`` per sub-block, ``x ~ A q + B``.

    Args:
        x, w: (n_super, n_sub, sub_size) float32.
    Returns:
        (A, B): (n_super, n_sub) float64 each, ``A >= 0``, ``B <= 0``.
    """
    qmax = spec.qmax
    wx = w * x
    sw = w.sum(-1).double()
    sx = wx.sum(-1).double()
    sxx = (wx * x).sum(-1).double()
    lo = x.amin(-1).clamp_max(0)
    rng = x.amax(-1) - lo
    inv_rng = inv(rng)
    best_e = torch.full(sw.shape, float("inf"), dtype=torch.float64, device=x.device)
    best_a = torch.zeros_like(best_e)
    best_b = torch.zeros_like(best_e)

    def consider(q):
        wq = w * q
        sq = wq.sum(-1).double()
        sqq = (wq * q).sum(-1).double()
        sxq = (wx * q).sum(-1).double()
        a, b = aff_ls(sw, sq, sqq, sx, sxq)
        e = aff_quad(sw, sq, sqq, sx, sxq, sxx, a, b)
        take = e < best_e
        torch.where(take, e, best_e, out=best_e)
        torch.where(take, a, best_a, out=best_a)
        torch.where(take, b, best_b, out=best_b)

    for t in spec.steps:
        iscale = (t * inv_rng).unsqueeze(-1)
        for s in spec.shifts:
            b0 = (lo + s * rng / t).unsqueeze(-1)
            consider(((x - b0) * iscale).round_().clamp_(0, qmax))
    for _ in range(iters):
        consider(aff_codes(x, best_a.float(), (-best_b).float(), qmax))
    return best_a, best_b


def aff_widen(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's fits with their codes spread over the code range where the same levels fit at a smaller scale.

    The nearest codes ``q`` of ``x ~ A q + B`` in a sub-block use levels ``v + A (q - lo)``, ``v = A lo + B`` the
    lowest; with ``g`` the greatest common divisor of the ``q - lo`` and ``s = (max q - lo) / g``, those levels are
    ``v + (A g / m) k`` at the integer codes ``k = m (q - lo) / g <= qmax`` for ``m = floor(qmax / s)``. Where
    ``m > g`` (a smaller scale) and ``v <= 0`` the fit becomes ``A g / m``, ``B = v``: its levels hold every used
    one, so the nearest codes fit no worse, and the sub-block's scale, which may set step 2's grid ``max(A) / t``,
    is the smallest that keeps them (two levels: ``(v_hi - v_lo) / qmax``, whichever code spacing step 1 kept).
    Elsewhere ``(A, B)`` is returned as is. Float64 operations in this order (the compiled glue repeats them).

    Args:
        x: (n_super, n_sub, sub_size) float32 weights.
        a, b: (n_super, n_sub) float64, ``A >= 0``, ``B <= 0`` (:func:`aff_search_scales_torch`).
        qmax: top code.
    Returns:
        (A, B): (n_super, n_sub) float64 each, ``A >= 0``, ``B <= 0``.
    """
    q = aff_codes(x, a.float(), (-b).float(), qmax)
    lo = q.amin(-1, keepdim=True)
    dq = (q - lo).to(torch.int64)
    g = dq[..., 0]
    for i in range(1, dq.shape[-1]):
        g = torch.gcd(g, dq[..., i])
    lo = lo.squeeze(-1).double()
    gd = g.double()
    span = dq.amax(-1).double() / gd.clamp_min(1.0)
    m = (qmax / span.clamp_min(1.0)).floor_()
    v = a * lo + b
    ok = (g > 0) & (m > gd) & (v <= 0)
    return torch.where(ok, a * gd / m, a), torch.where(ok, v, b)


def aff_reference(st):
    """The current codes' error as a quadratic around its constrained least-squares point.

    ``err(A, B) = E(a, b) + 2 (gA dA + gB dB) + Sqq dA**2 + 2 Sq dA dB + Sw dB**2`` with
    ``dA = A - a``, ``dB = B - b``. Returns float32 (a, b, gA, gB, Sqq, Sq, Sw), each
    (n_super, n_sub): ranking by the variable part avoids the cancellation of the raw sums.
    """
    sw, sq, sqq, sx, sxq = st
    a, b = aff_ls(sw, sq, sqq, sx, sxq)
    ga = a * sqq + b * sq - sxq
    gb = a * sq + b * sw - sx
    return tuple(t.float() for t in (a, b, ga, gb, sqq, sq, sw))


def aff_ls_super(st, cfg: AffConfig):
    """Least-squares ``(d, dmin)`` for fixed codes and integer scales/mins, (n_super,) float64 each
    (the config's own values where the fit is degenerate or negative)."""
    sw, sq, sqq, sx, sxq = st
    ks, km = cfg.ks.double(), cfg.km.double()
    a11 = (ks * ks * sqq).sum(1)
    a12 = -(ks * km * sq).sum(1)
    a22 = (km * km * sw).sum(1)
    b1 = (ks * sxq).sum(1)
    b2 = -(km * sx).sum(1)
    det = a11 * a22 - a12 * a12
    d = safe_div(b1 * a22 - a12 * b2, det)
    m = safe_div(a11 * b2 - a12 * b1, det)
    bad = (d <= 0) | (m < 0)
    return torch.where(bad, cfg.d.double(), d), torch.where(bad, cfg.dmin.double(), m)


def _aff_choices(ref, kmax, d, dm):
    """A sub-block's four integer (scale, min) choices at candidate pair ``(d, dm)``: ``ks`` in {floor, ceil}(a / d);
    for each, ``km`` in {floor, ceil} of the best min for that scale; in the order ``(ks0, km0), (ks0, km1), (ks1,
    km0), (ks1, km1)``, a list of ``(ks, km, e)`` with ``e`` the variable part of :func:`aff_reference`'s quadratic
    (``ref`` and ``d``, ``dm`` broadcast against each other by the caller)."""
    a, b, ga, gb, sqq, sq, sw = ref
    k0 = (a * inv(d)).floor_().clamp_(0, kmax)
    ndm, idm, sq2 = -dm, inv(dm), 2 * sq
    out = []
    # in place where the value is the same: x + y = y + x, -(b - t) = t - b exactly; products kept in their order
    for ks in (k0, (k0 + 1).clamp_(0, kmax)):
        da = d * ks - a
        mopt = (sq * da).add_(gb).div_(sw).sub_(b).clamp_(min=0)  # -(b - (gb + sq da) / sw), >= 0
        m0 = (mopt * idm).floor_().clamp_(0, kmax)
        ga_da, sqq_da2, sq2_da = ga * da, (sqq * da).mul_(da), sq2 * da
        for km in (m0, (m0 + 1).clamp_(0, kmax)):
            db = (ndm * km).sub_(b)
            e = (gb * db).add_(ga_da).mul_(2).add_(sqq_da2)  # 2 (ga da + gb db) + sqq da da
            e.add_((sq2_da * db).add_((sw * db).mul_(db)))  # += 2 sq da db + sw db db
            out.append((ks, km, e))
    return out


def aff_eval_error(ref, kmax, d, dm):
    """Step-2 ranking of candidate pairs ``(d, dm)`` (n_super, C): the sum over sub-blocks of the best of
    :func:`_aff_choices`; returns err (n_super, C)."""
    ch = _aff_choices(tuple(t[:, None, :] for t in ref), kmax, d[:, :, None], dm[:, :, None])
    e = ch[0][2]
    for _, _, ej in ch[1:]:
        e = torch.minimum(e, ej)
    return e.sum(-1)


def aff_eval_choice(ref, kmax, d, dm):
    """The payload of one candidate pair (n_super,) a super-block: ``(d, dm, ks, km)``, ``ks``, ``km`` (n_super,
    n_sub) int64, the choice :func:`aff_eval_error` ranked it with (the first of the four on a tie)."""
    ch = _aff_choices(ref, kmax, d[:, None], dm[:, None])
    ks, km, e = ch[0]
    for ksj, kmj, ej in ch[1:]:
        take = ej < e
        ks, km, e = torch.where(take, ksj, ks), torch.where(take, kmj, km), torch.where(take, ej, e)
    return d, dm, ks.long(), km.long()


def aff_pick_torch(ref, kmax: int, dc: torch.Tensor, mc: torch.Tensor):
    """Step 2, affine: per super-block the first candidate pair ``(dc, mc)`` (n_super, C) float32
    with the lowest :func:`aff_eval_error` on ``ref`` (:func:`aff_reference`); returns ``d``,
    ``dmin`` (n_super,) float32 and ``ks``, ``km`` (n_super, n_sub) int64."""
    n_super, n_sub = ref[0].shape
    step = max(1, eval_chunk(dc.device) // max(1, n_super * n_sub * 4))
    return pick_min(chunks(step, dc, mc), partial(aff_eval_error, ref, kmax), partial(aff_eval_choice, ref, kmax))


def aff_pick(ref, kmax: int, dc: torch.Tensor, mc: torch.Tensor, backend: str = "auto"):
    """:func:`aff_pick_torch`, or its fast path ``kquant.aff_pick`` as ``backend`` chooses."""
    return (fast_path("kquant.aff_pick", dc, backend) or aff_pick_torch)(ref, kmax, dc, mc)


def aff_refine(x, w, cfg: AffConfig, spec: AffSearch, backend: str = "auto"):
    """:func:`aff_refine_torch`, or its fast path ``kquant.aff_refine`` as ``backend`` chooses."""
    return (fast_path("kquant.aff_refine", x, backend) or aff_refine_torch)(x, w, cfg, spec)


def aff_refine_torch(x, w, cfg: AffConfig, spec: AffSearch):
    """Step 3, affine: try the moves of each sub-block's ``(ks, km)`` on the elements.

    Returns (config, error per super-block (n_super,) float64)."""
    qmax, kmax = spec.qmax, spec.kmax
    dl, ml = cfg.sub_scales()
    err = aff_error(x, w, dl, ml, aff_codes(x, dl, ml, qmax))
    ks, km = cfg.ks, cfg.km
    for ds, dm in spec.moves:
        kst, kmt = (ks + ds).clamp(0, kmax), (km + dm).clamp(0, kmax)
        dlt = cfg.d.unsqueeze(-1) * kst.float()
        mlt = cfg.dmin.unsqueeze(-1) * kmt.float()
        et = aff_error(x, w, dlt, mlt, aff_codes(x, dlt, mlt, qmax))
        take = et < err
        err = torch.where(take, et, err)
        ks, km = torch.where(take, kst, ks), torch.where(take, kmt, km)
    return AffConfig(cfg.d, cfg.dmin, ks, km), err.sum(-1)


def aff_round_candidates(w, wx, q, sw, sx, ts, kmax: int, best: AffConfig | None):
    """One step-2 round's reference and candidates for codes ``q`` (n_super, n_sub, sub_size).

    ``sw``, ``sx``: (n_super, n_sub) float64 ``sum(w)``, ``sum(w x)``; ``ts`` (T,) the
    ``d_steps``. Returns ``(ref, dc, mc, grid_m)``: :func:`aff_reference` of the codes, the
    first coordinate's candidates ``d`` over its grid (plus the kept ``d`` and the
    least-squares ``d`` of ``best``) with ``dmin`` kept, both (n_super, C), and the ``dmin``
    grid (n_super, T).
    """
    wq = w * q
    st = (sw, wq.sum(-1).double(), (wq * q).sum(-1).double(), sx, (wx * q).sum(-1).double())
    ref = aff_reference(st)
    amax, mmax = ref[0].amax(1, keepdim=True), (-ref[1]).amax(1, keepdim=True)
    grid_d, grid_m = f16_candidates(amax / ts), f16_candidates(mmax / ts)
    if best is None:
        d_cur, m_cur = f16_candidates(amax / kmax), f16_candidates(mmax / kmax)
        extra_d, extra_m = [d_cur], [m_cur]
    else:
        d_cur, m_cur = best.d.unsqueeze(1), best.dmin.unsqueeze(1)
        d_ls, m_ls = aff_ls_super(st, best)
        extra_d, extra_m = [d_cur, f16_candidates(d_ls).unsqueeze(1)], [m_cur, f16_candidates(m_ls).unsqueeze(1)]
    return ref, torch.cat([grid_d, *extra_d], 1), torch.cat([m_cur.expand_as(grid_d), *extra_m], 1), grid_m


def aff_encode(x: torch.Tensor, w: torch.Tensor, spec: AffSearch, backend: str = "auto") -> AffConfig:
    """The whole search's fast path ``kquant.aff_encode`` as ``backend`` chooses (only a compiled CPU one exists), else
    :func:`aff_encode_torch` with the steps' own fast paths (``"triton"``: the steps' kernels)."""
    fn = None if backend == "triton" else fast_path("kquant.aff_encode", x, backend)
    return fn(x, w, spec) if fn is not None else aff_encode_torch(x, w, spec, backend)


def aff_encode_torch(x: torch.Tensor, w: torch.Tensor, spec: AffSearch, backend: str = "auto") -> AffConfig:
    """Affine model, steps 1-3 (module docstring); x, w: (n_super, n_sub, sub_size) float32;
    ``backend`` chooses the steps' fast paths (:func:`dynaquant.quant.codecs.fastpaths.fast_path`)."""
    kmax = spec.kmax
    a, b = aff_search_scales(x, w, spec, backend=backend)
    if spec.widen:
        a, b = aff_widen(x, a, b, spec.qmax)
    q = aff_codes(x, a.float(), (-b).float(), spec.qmax)
    wx = w * x
    sw = w.sum(-1).double()
    sx = wx.sum(-1).double()
    ts = device_constant(spec.d_steps, torch.float32, x.device)
    best: AffConfig | None = None
    best_err = None
    for r in range(spec.rounds):
        ref, dc, mc, grid_m = aff_round_candidates(w, wx, q, sw, sx, ts, kmax, best)
        # coordinate search: d over its grid (dmin kept), then dmin over its grid (d kept)
        d, dm, _, _ = aff_pick(ref, kmax, dc, mc, backend)
        dc = d.unsqueeze(1).expand(-1, grid_m.shape[1] + 1)
        mc = torch.cat([grid_m, dm.unsqueeze(1)], 1)
        cfg = AffConfig(*aff_pick(ref, kmax, dc, mc, backend))
        cfg, err = aff_refine(x, w, cfg, spec, backend)
        best, best_err = keep_best(best, best_err, cfg, err)
        if r + 1 < spec.rounds:
            q = aff_codes(x, *best.sub_scales(), spec.qmax)
    return best
