"""IQ3_XXS and IQ3_S: 3-bit i-quants, 256-weight super-blocks of 4-weight grid points.

Layouts (llama.cpp ``ggml-common.h``), 8 sub-blocks of 32 weights = 8 groups of 4 each:

``block_iq3_xxs`` (98 bytes, 3.0625 bpw)
    ``d`` (fp16) | ``qs[64]``: index into the 256-point grid ``iq3xxs_grid`` per group of 4 |
    ``scales_and_signs[8]`` (uint32 LE per sub-block): bits ``7k .. 7k+6`` index ``ksigns_iq2xs``
    for the 8 signs of weights ``8k .. 8k+7`` (an even number of minus signs: the 8th sign is
    the parity of the other 7), bits ``28..31`` the sub-block scale ``l``.
    ``y = (((d * (0.5 + l)) * 0.5) * grid) * sign``; grid values ``4, 12, .., 52, 62``.
``block_iq3_s`` (110 bytes, 3.4375 bpw)
    ``d`` (fp16) | ``qs[64]``: low 8 bits of the index into the 512-point ``iq3s_grid`` |
    ``qh[8]``: bit ``k`` of byte ``j`` = 9th index bit of group ``8 j + k`` | ``signs[32]``:
    bit ``i`` of byte ``j`` = sign of weight ``8 j + i`` (free signs) | ``scales[4]``: nibble
    ``j % 2`` of byte ``j // 2`` = ``l_j``. ``y = ((d * (1 + 2 l)) * grid) * sign``; grid
    values ``1, 3, .., 15``.

Decoders repeat ``gguf.quants`` float32 operations in the same order (bit-for-bit equal).
The grids and ``ksigns`` are gguf-py's published tables (``init_grid``), loaded once.

Encoder (minimises ``sum(w * (x - y)**2)``, batched over all blocks; the loops run over
candidate scales). With a sub-block scale ``A`` fixed, each group of 4 takes its best grid
point by an exhaustive search over the whole grid: ``sum_i w_i (v_i - A g_i)**2`` is
``sum w v**2 - [2 w v, -A w] . [g, g**2]``, one (groups, 8) x (8, grid) matmul and an
argmax (llama.cpp rounds each weight and searches a small neighbour list only when that
point is off the grid). ``v`` is ``|x|`` with the signs taken from ``x``; for IQ3_XXS,
whose sign bytes must have even parity, an 8-weight half-group with an odd number of
negative weights gets one weight with the wrong sign: every choice of that weight is tried
(each of the 8, in the final assignment; the least ``w x**2`` of either half of 4 during
the scale search), each with its own best grid point.

1. per sub-block, candidate scales ``A = max|x| / t`` (``t`` over the grid's top values),
   each assignment followed by a weighted least-squares refit of ``A``; the best refit
   scale (``lloyd_steps`` further assign/refit steps from it: none by default);
2. the fp16 ``d``: candidates ``max A / (c t)`` (``A = c d (2 l + 1)``, ``c = 1/4`` for
   IQ3_XXS, 1 for IQ3_S), each with the best odd multiple ``2 l + 1`` per sub-block, ranked
   by the fixed points' quadratic error ``Sgg (c d (2l+1) - A)**2``;
3. the points re-assigned under the stored scales, ``l +- 1`` tried on the exact decoded
   error; steps 2-3 repeat once from the new points (with the least-squares ``d`` as an
   extra candidate), keeping the best configuration per super-block.

On CPU (with :mod:`dynaquant.kernels` imported and a C compiler, the assignment runs as compiled C:
:mod:`dynaquant.kernels.native.lattice`, about 3x faster encodes, the same bytes on the tests' weights)
the off-grid groups search exact candidate lists instead of the whole grid (the grid
points no other grid point dominates with respect to the rounded pattern,
:func:`._lattice.dominance_candidates`: 20-23 on average, at most 61/74), and the search is
lighter (``cpu_search``: two step-1 scales, one round of steps 2-3 without
the ``l +- 1`` tries, no final IQ3_XXS flip pass); other devices run the full search above.

These are vector codes: a weight is not rounded on its own, so ``fit_params`` (GPTQ's
per-column rounding) raises NotImplementedError.

Measured weighted error ours / llama.cpp (same imatrix, ``ggml_quantize_chunk``): see
``MEASURED`` below.
"""

from __future__ import annotations

import numpy as np
import torch

from dynaquant.quant.codecs import _iq3_search as steps
from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs import _lattice as lat
from dynaquant.quant.codecs._iq3_search import nearest_variants_torch, variant_count  # noqa: F401  (iq3's names)
from dynaquant.quant.codecs.base import Codec, register
from dynaquant.quant.codecs.consts import device_constant

QK_K = 256
_N_SUB = 8  # sub-blocks of 32
_N_GRP = 8  # groups of 4 per sub-block

# Ratios ours / llama.cpp of the importance-weighted error, measured by
# tests/test_codecs_iq34.py (SmolLM2-135M dithered test tensors: mean, worst; synthetic), with
# the CPU search profile (the full search, on other devices: IQ3_XXS mean 0.770 worst 0.918,
# IQ3_S mean 0.743 worst 0.856). CPU speed with the compiled assignment (kernels/native): 1.4-2.1x llama.cpp's
# weights/s on the same 2 threads (README, benchmarks/out/encode_speed-cpu-lattice.json).
MEASURED = {
    "IQ3_XXS": "smollm2 mean 0.838 worst 0.965; synthetic 0.74-0.77; no imatrix 0.61-0.72",
    "IQ3_S": "smollm2 mean 0.808 worst 0.891; synthetic 0.74-0.78; no imatrix 0.55-0.63",
}

# Rows of the (rows, grid) score matrix per matmul: bounds memory at about this many floats.
_SCORE_ELEMS = {"cpu": 1 << 21, "other": 1 << 26}
# Super-blocks per encode pass on CPU (keeps the temporaries small); other devices take all.
_CPU_BLOCKS = 2048

_tables: dict = {}

# Step 3's levels l, l + 1, l - 1 of a round in one launch (the fast path ``iq3.exact_levels``: x and w read once, the
# better level kept a sub-block in the kernel) instead of one ``iq3.exact`` launch a level and torch selections between
# them; the same bytes. Built without a GPU (2026-12-07, session 36): off until an H100 run measures it
# (benchmarks/iq3_configs.py --configs prefetch32,levels).
FUSED_LEVELS = False
# Step 1's candidate scales and its Lloyd steps in one launch (the fast path ``iq3.step1``: x and w read once, the
# running best kept a sub-block in registers) instead of one ``iq3.consider`` launch a candidate; the same bytes. Built
# without a GPU (session 36): off until measured (benchmarks/iq3_configs.py --configs prefetch32,step1).
FUSED_STEP1 = False
# The one-launch switches above, by name (benchmarks set them by these names: encode_speed.py --iq3-fused, iq3_configs.py).
FUSED_FLAGS = ("FUSED_LEVELS", "FUSED_STEP1")


def _grid_table(name: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid (P, 4) float32, G8 (8, P) = [g; g**2]) of gguf-py's ``IQ3_XXS``/``IQ3_S`` grid."""
    key = (name, str(device))
    if key not in _tables:
        import gguf.quants as gq

        cls = getattr(gq, name)
        cls.init_grid()
        g = torch.from_numpy(np.array(cls.grid, dtype=np.float32).reshape(-1, 4)).to(device)
        _tables[key] = (g, torch.cat([g.T, g.T * g.T], 0).contiguous())
    return _tables[key]


def _packed_grid(name: str, device) -> torch.Tensor:
    """(P,) int32: grid point ``i``'s 4 coordinates as the bytes of one little-endian word (the values are small
    positive integers), so that a gather moves 4 bytes a point instead of 16."""
    key = (name, "packed", str(device))
    if key not in _tables:
        g, _ = _grid_table(name, "cpu")
        _tables[key] = g.to(torch.uint8).contiguous().view(torch.int32).reshape(-1).to(device)
    return _tables[key]


def grid_points(name: str, idx: torch.Tensor) -> torch.Tensor:
    """Grid indices (any shape, int64) -> their points (``idx.shape + (4,)``) float32, equal to
    ``_grid_table(name)[0][idx]`` (one int32 gather and a byte unpack)."""
    w = _packed_grid(name, idx.device).index_select(0, idx.reshape(-1))
    return w.view(torch.uint8).to(torch.float32).reshape(*idx.shape, 4)


def _grid_map(name: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(kmap (4096,) int64: grid index of the point with level indices ``l0 + 8 l1 + 64 l2 +
    512 l3``, or -1 off the grid; mids (7,) float32 midpoints between the 8 levels)."""
    key = (name, "map", str(device))
    if key not in _tables:
        g, _ = _grid_table(name, "cpu")
        levels = torch.unique(g)
        lev = torch.bucketize(g, levels)  # exact level index of each coordinate
        u = (lev << (3 * torch.arange(4))).sum(1)
        kmap = torch.full((8**4,), -1, dtype=torch.int64)
        kmap[u] = torch.arange(g.shape[0])
        _tables[key] = (kmap.to(device), ((levels[1:] + levels[:-1]) * 0.5).to(device))
    return _tables[key]


def _candidates(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact candidate lists of the CPU nearest-point search (cached; CPU tensors):
    :func:`._lattice.dominance_candidates` of the grid's 8 levels.

    Returns:
        cand (4096, K) int64 grid indices in ascending order (padded with the first) and
        count (4096,) int64 distinct candidates of each rounded pattern ``l0 + 8 l1 + 64 l2 + 512 l3``.
    """
    key = (name, "cand")
    if key not in _tables:
        gn = _grid_table(name, "cpu")[0].numpy()
        _tables[key] = lat.dominance_candidates(np.searchsorted(np.unique(gn), gn), 8)
    return _tables[key]


def _tier(name: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` candidates of each pattern (:func:`_candidates`), (4096, k) int64, and
    their ``[g, g**2]`` rows, (4096, k * 8) float32 (cached; 1-10 MB)."""
    key = (name, "tier", k)
    if key not in _tables:
        ck = _candidates(name)[0][:, :k].contiguous()
        g8t = _grid_table(name, "cpu")[1].T
        _tables[key] = (ck, g8t[ck].reshape(ck.shape[0], -1).contiguous())
    return _tables[key]


# CPU: an off-grid group searches the narrowest of these candidate-list widths that holds
# all its candidates (the last tier is the full width).
_TIERS = (8, 16, 32)


def _ksigns(device) -> torch.Tensor:
    """``ksigns_iq2xs`` (128,) int64: 7 sign bits -> the 8-bit pattern with even parity."""
    key = ("ksigns", str(device))
    if key not in _tables:
        import gguf.quants as gq

        _tables[key] = torch.tensor(list(gq.IQ2_XXS.ksigns), dtype=torch.int64, device=device)
    return _tables[key]


def _bits(device, n: int = 8, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``0 .. n - 1`` (n,) ``dtype`` on ``device`` (made once: :func:`.consts.device_constant`)."""
    return device_constant(tuple(range(n)), dtype, device)


class _IQ3(Codec):
    """Shared IQ3 encoder (module docstring); subclasses give the layout."""

    grid_name: str
    scale_mul: float  # c in A = c * d * (2 l + 1)
    scale_kind: str  # decode's sub-block scale: _iq3_search.sub_scale's kind
    parity: bool  # signs of 8 weights must have even parity (IQ3_XXS)
    # Step 1: A = max|x| / t for these t (grid value units).
    step1_t: tuple[float, ...]
    # Step 2: d = max A / (c t) for these t (odd multiples 2 l + 1 reach 31).
    d_steps = tuple(18.0 + 0.25 * i for i in range(61))  # 18 .. 33
    # Assign/refit (Lloyd) steps after step 1's candidates: 0 since 2026-12-08. Two of them changed the weighted
    # error by 0.0036 % (IQ3_XXS) and 0.0017 % (IQ3_S) on benchmarks/encode_speed.py's tensor (1024 rows, the full
    # search on the CPU) and cost 2 of step 1's 10 assignment passes (step 1 was 37 % of an IQ3_XXS encode on the
    # H100).
    lloyd_steps = 0
    rounds = 2
    l_deltas = (1, -1)  # step 3: l + delta tried on the exact error
    full_flip = True  # IQ3_XXS: a final assignment trying every weight of an odd 8-group as the flipped one
    # The CPU search: overrides of the attributes above (two step-1 scales,
    # one round, no l +- 1 tries, no final flip pass): about 3-4x faster at a few % more
    # error (IQ3_S 0.73 vs 0.71 of llama.cpp's on benchmarks/encode_speed.py's tensor,
    # IQ3_XXS 0.78 vs 0.75). Other devices run the full search.
    cpu_search: dict = {"rounds": 1, "l_deltas": (), "full_flip": False}

    def _knob(self, name: str, device: torch.device):
        """Search attribute ``name`` for a search on ``device`` (:attr:`cpu_search` on CPU)."""
        if device.type == "cpu" and name in self.cpu_search:
            return self.cpu_search[name]
        return getattr(self, name)

    # ------------------------------------------------------------------ assignment

    def _nearest(self, f: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Best grid point of each row: features ``f`` (R, 8) = [2 w v, -A w], targets ``t`` (R, 4) = v / A.

        Where the per-weight nearest levels of ``t`` form a grid point, that point is the
        best (the error is a sum over the 4 weights), so only the other rows are searched:
        on CPU among the exact candidate lists of :func:`_candidates` (each candidate's
        scores by a batched (candidates, 8) x (8,) product), elsewhere
        exhaustively, by a (rows, 8) x (8, P) matmul and an argmax. The two agree up to
        float32 rounding of near-ties.
        Returns (score (R,), index (R,) int64): ``sum w v**2 - score`` is the group's error.
        """
        _, g8 = _grid_table(self.grid_name, f.device)
        kmap, mids = _grid_map(self.grid_name, f.device)
        lev = torch.bucketize(t, mids)  # (R, 4) nearest level per weight
        u = (lev << (3 * torch.arange(4, device=f.device))).sum(1)
        idx = kmap[u]
        on = idx >= 0
        score = (f * g8.T.index_select(0, idx.clamp_min(0))).sum(1)
        off = (~on).nonzero().squeeze(1)
        if not off.numel():
            return score, idx
        if f.device.type == "cpu":
            self._search_candidates(f, u, off, score, idx)
            return score, idx
        fo = f[off]
        p = g8.shape[1]
        step = max(1, _SCORE_ELEMS["other"] // p)
        for r0 in range(0, fo.shape[0], step):
            s, i = (fo[r0 : r0 + step] @ g8).max(dim=1)
            rows = off[r0 : r0 + step]
            score[rows] = s
            idx[rows] = i
        return score, idx

    def _search_candidates(self, f, u, off, score, idx) -> None:
        """CPU part of :meth:`_nearest`: best candidate of the rows ``off`` (written into ``score``, ``idx``)."""
        cand, count = _candidates(self.grid_name)
        need = count[u[off]]
        lo = 0
        for k in (*_TIERS, cand.shape[1]):
            sel = off[(need > lo) & (need <= k)]
            lo = k
            if not sel.numel():
                continue
            ck, pk = _tier(self.grid_name, k)
            ur = u[sel]
            pts = pk.index_select(0, ur).view(-1, k, 8)  # [g, g**2] of each candidate
            s, j = torch.bmm(pts, f[sel, :, None]).squeeze(2).max(dim=1)
            ck = ck.index_select(0, ur)
            score[sel] = s
            idx[sel] = ck.gather(1, j[:, None]).squeeze(1)

    def _assign(self, xa: torch.Tensor, w: torch.Tensor, neg: torch.Tensor, a: torch.Tensor, full: bool,
                backend: str = "auto"):
        """Best grid points and signs for sub-block scales ``a``.

        Args:
            xa, w: (n, 8, 32) float32 ``|x|`` and importance; neg: (n, 8, 32) bool ``x < 0``.
            a: (n, 8) float32 sub-block scales (>= 0) in grid units.
            full: IQ3_XXS: try every weight of an odd 8-group as the flipped one (else the
                least ``w x**2`` of each half).
            backend: ``"auto"`` (Triton on CUDA, compiled C on CPU), ``"triton"`` or ``"native"``: every group's
                variants scored by the fast path ``iq3.nearest_variants`` (:func:`nearest_variants_torch` is its
                reference); ``"torch"``: by :meth:`_variants` (:meth:`_nearest`'s matmul, or its candidate lists on
                CPU).
        Returns:
            (idx (n, 8, 8) int64 grid indices, flip (n, 8, 32) bool: weight decoded with the
            sign opposite to ``x``'s).
        """
        kernel = lat.fast_path("iq3.nearest_variants", xa, backend)
        if kernel is not None:
            tables = (*_grid_map(self.grid_name, xa.device), *_grid_table(self.grid_name, xa.device))
            return steps.assign_variants(xa, w, neg, a, self.parity, full, lambda f, t, o, k: kernel(f, t, o, k, *tables))
        return steps.assign_variants(xa, w, neg, a, self.parity, full, self._torch_variants)

    def _torch_variants(self, f, t, odd, flip_at):
        """:func:`nearest_variants_torch`'s contract by :meth:`_nearest` (the odd rows' variants only)."""
        if odd is None:
            score, idx = self._nearest(f, t)
            return score[:, None], idx[:, None]
        flips = torch.zeros(f.shape[0], 5 if flip_at is None else 2, 4, dtype=torch.bool, device=f.device)
        if flip_at is None:
            flips[:, 1:] = torch.eye(4, dtype=torch.bool, device=f.device)
        else:
            flips[:, 1] = torch.nn.functional.one_hot(flip_at, 4).bool()
        return self._variants(f, t, flips, odd)

    def _variants(self, f, tg, flips, odd_rows):
        """Torch side of :meth:`_assign`: (score, idx) (R, V) of each group's flip variants (variant 0 unflipped;
        the others on the odd rows only, -inf and 0 elsewhere), as :func:`nearest_variants_torch` gives them."""
        nv = flips.shape[-2]
        sign = torch.cat([torch.where(flips, -1.0, 1.0), torch.ones_like(flips, dtype=f.dtype)], -1)
        score0, idx0 = self._nearest(f.reshape(-1, 8), tg.reshape(-1, 4))
        rows = odd_rows.nonzero().squeeze(1)
        score = torch.full((odd_rows.shape[0], nv), -torch.inf, dtype=f.dtype, device=f.device)
        idx = torch.zeros((odd_rows.shape[0], nv), dtype=torch.int64, device=f.device)
        score[:, 0], idx[:, 0] = score0, idx0
        if rows.numel():
            sg = sign.reshape(-1, nv, 8)[rows, 1:]  # (R, V-1, 8)
            fv = f.reshape(-1, 1, 8)[rows] * sg
            tv = tg.reshape(-1, 1, 4)[rows] * sg[..., :4]
            sv, iv = self._nearest(fv.reshape(-1, 8), tv.reshape(-1, 4))
            score[rows, 1:] = sv.reshape(-1, nv - 1)
            idx[rows, 1:] = iv.reshape(-1, nv - 1)
        return score, idx

    def _points(self, idx: torch.Tensor) -> torch.Tensor:
        """(n, 8, 8) grid indices -> (n, 8, 32) float32 grid values."""
        return grid_points(self.grid_name, idx).reshape(idx.shape[0], _N_SUB, 32)

    # ------------------------------------------------------------------ scales

    def _sub_scale(self, d: torch.Tensor, lsc: torch.Tensor) -> torch.Tensor:
        """Decode's float32 sub-block scale for fp16 ``d`` (n,) float32 and ``l`` (n, 8) int64
        (:func:`._iq3_search.sub_scale` of :attr:`scale_kind`)."""
        return steps.sub_scale(d, lsc, self.scale_kind)

    def _exact_error(self, x, w, xa, neg, d, lsc, full, backend: str = "auto"):
        """The assignment under the stored scales and its exact error: (err (n, 8) float64, idx, flip, sxg, sgg), where
        sxg, sgg are the assignment's least-squares sums (n, 8) float64 from the fast path ``iq3.exact`` (its indices
        in :meth:`_idx_dtype`), or None, None from the torch steps (int64 indices)."""
        dl = self._sub_scale(d, lsc)
        exact = self._fast("iq3.exact", xa, backend)
        if exact is not None:
            idx, flip, e, sxg, sgg = exact(x, w, dl, self.parity, full, *self._tables(xa.device),
                                           idx_dtype=self._idx_dtype(xa.device))
            return e.double(), idx, flip, sxg.double(), sgg.double()
        idx, flip = self._assign(xa, w, neg, dl, full, backend)
        e = steps.error_terms(x, w, neg, dl, self._points(idx), flip)
        return e.sum(-1).double(), idx, flip, None, None

    def _best_levels(self, x, w, xa, neg, d, lsc, backend: str = "auto"):
        """Step 3: :func:`._iq3_search.best_levels` over :attr:`l_deltas` on the exact errors: (err (n, 8) float64, idx,
        flip, sxg, sgg, l), in one launch by the fast path ``iq3.exact_levels`` where it is on (:data:`FUSED_LEVELS`),
        else by :meth:`_exact_error` a level."""
        deltas = tuple(self._knob("l_deltas", x.device))
        fused = self._fast("iq3.exact_levels", xa, backend) if FUSED_LEVELS else None
        if fused is not None:
            err, idx, flip, sxg, sgg, lsc = fused(x, w, d, lsc, deltas, self.scale_kind, self.parity,
                                                  *self._tables(xa.device), idx_dtype=self._idx_dtype(xa.device))
            return err.double(), idx, flip, sxg.double(), sgg.double(), lsc
        return steps.best_levels(lambda lt: self._exact_error(x, w, xa, neg, d, lt, False, backend), lsc, deltas)

    def _idx_dtype(self, device) -> torch.dtype:
        """The narrowest integer type of the grid's indices (uint8 for IQ3_XXS's 256 points, int16 for IQ3_S's 512): the
        fast path's indices, which the rounds select between (an eighth or a quarter of int64's bytes)."""
        return torch.uint8 if _grid_table(self.grid_name, device)[0].shape[0] <= 256 else torch.int16

    @staticmethod
    def _fast(name: str, x: torch.Tensor, backend: str):
        """The fast path ``name`` (``iq3.assign``, ``iq3.consider``, ``iq3.exact``, ``iq3.exact_levels``, ``iq3.step1``:
        Triton) for ``backend`` on ``x``'s device, or None: the torch backend, or none there (CPU: the compiled search
        has only the nearest-point search; one not registered or not loading), where :meth:`_assign` and the torch
        steps serve."""
        try:
            return lat.fast_path(name, x, backend)
        except RuntimeError:
            return None

    @classmethod
    def _fused(cls, x: torch.Tensor, backend: str):
        """The fused assignment ``iq3.assign`` (:func:`._iq3_search.assign_torch`'s contract) or None (:meth:`_fast`)."""
        return cls._fast("iq3.assign", x, backend)

    def _tables(self, device) -> tuple[torch.Tensor, ...]:
        """The search tables of :func:`nearest_variants_torch` (kmap, mids, grid, g8) on ``device``."""
        return (*_grid_map(self.grid_name, device), *_grid_table(self.grid_name, device))

    def _step1(self, x, xa, w, neg, backend: str = "auto") -> torch.Tensor:
        """Step 1: the best continuous sub-block scales ``A`` (n, 8) float32 (0 for an all-zero sub-block), by
        :func:`._iq3_search.step1_torch` with this backend's candidate step, or in one launch (``iq3.step1``)."""
        amax = xa.amax(-1)
        cand = torch.stack([amax / t for t in self._knob("step1_t", xa.device)], -1)  # (n, 8, T)
        lloyd, tables = self._knob("lloyd_steps", xa.device), self._tables(x.device)
        fused_step = self._fast("iq3.step1", xa, backend) if FUSED_STEP1 else None
        if fused_step is not None:  # every candidate (and any Lloyd steps) in one launch
            return fused_step(x, w, cand, lloyd, self.parity, *tables)
        fused = self._fused(xa, backend)
        update = self._fast("iq3.consider", xa, backend) if fused is not None else None  # the fused candidate step

        def consider(a, best_gain, best_a):
            if update is not None:
                return update(x, w, a, self.parity, best_gain, best_a, *tables)
            if fused is not None:
                sxg, sgg = self._ls_stats_fused(fused, x, w, a, False)[2:]
            else:
                sxg, sgg = self._ls_stats(xa, w, *self._assign(xa, w, neg, a, False, backend))
            return steps.best_scale_update(sxg, sgg, best_gain, best_a)

        return steps.step1_torch(x, w, cand, lloyd, self.parity, *tables, consider=consider)

    def _ls_stats(self, xa, w, idx, flip):
        """The least-squares sums (sxg, sgg) (n, 8) float64 of an assignment: ``sum w v g``, ``sum w g g``."""
        p, q = steps.stats_terms(xa, w, self._points(idx), flip)
        return p.sum(-1).double(), q.sum(-1).double()

    def _ls_stats_fused(self, fused, x, w, a, want_idx):
        """(idx, flip, sxg, sgg): :meth:`_assign` for scales ``a`` and :meth:`_ls_stats` of it, by the fused fast
        path ``iq3.assign`` (idx, flip None unless ``want_idx``)."""
        idx, flip, p, q = fused(x, w, a, self.parity, False, "stats", want_idx, *self._tables(x.device), sums=True)
        return idx, flip, p.double(), q.double()

    def _pick_d(self, a: torch.Tensor, sgg: torch.Tensor, extra: list[torch.Tensor], backend: str = "auto"):
        """Step 2: (d (n,) float32 fp16 values, l (n, 8) int64): among ``max A / (c t)`` for :attr:`d_steps` and the
        ``extra`` (n, 1) float64 candidates, the one of least quadratic error (its errors summed in
        :func:`._iq3_search.pairwise8`'s order), by the fast path ``iq3.pick`` where there is one
        (:func:`._iq3_search.pick_torch`)."""
        ts = device_constant(self.d_steps, torch.float64, a.device)
        try:
            pick = lat.fast_path("iq3.pick", a, backend) or steps.pick_torch
        except RuntimeError:  # none for this backend (the compiled CPU search has none)
            pick = steps.pick_torch
        return pick(a, sgg, ts, torch.cat(extra, 1) if extra else None, self.scale_mul)

    def _encode(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        x = x.reshape(n, _N_SUB, 32)
        w = w.reshape(n, _N_SUB, 32)
        xa, neg = x.abs(), x < 0
        a = self._step1(x, xa, w, neg, backend)
        fused = self._fused(xa, backend)
        if fused is not None:  # round 0's sums (its points are not kept: every round assigns under stored scales)
            sxg, sgg = self._ls_stats_fused(fused, x, w, a, False)[2:]
        else:
            sxg, sgg = self._ls_stats(xa, w, *self._assign(xa, w, neg, a, False, backend))
        best = None  # (d, l, idx, flip, error a super-block, sxg, sgg)
        for r in range(self._knob("rounds", x.device)):
            if r > 0:  # the best configuration's least-squares sums: from the fast path, else from its points
                sxg, sgg = (best[5], best[6]) if best[5] is not None else self._ls_stats(xa, w, best[2], best[3])
            a = kqs.safe_div(sxg, sgg).clamp_min(0)
            extra = []
            if best is not None:
                kf = self.scale_mul * (2 * best[1].double() + 1)
                d_ls = kqs.safe_div((kf * sxg).sum(1), (kf * kf * sgg).sum(1))
                extra = [best[0].double().unsqueeze(1), d_ls.unsqueeze(1)]
            d, lsc = self._pick_d(a, sgg, extra, backend)
            err, idx, flip, esx, esg, lsc = self._best_levels(x, w, xa, neg, d, lsc, backend)
            cfg = (d, lsc, idx, flip, err.sum(-1), esx, esg)
            if best is None:
                best = cfg
            else:
                take = cfg[4] < best[4]
                best = tuple(None if c is None else torch.where(take.view(-1, *([1] * (c.ndim - 1))), c, b)
                             for c, b in zip(cfg, best))
        d, lsc, idx, flip, err0 = best[:5]
        if self.parity and self._knob("full_flip", x.device):
            # Final assignment with every flip choice, kept where it is better.
            err1, idx1, flip1 = self._exact_error(x, w, xa, neg, d, lsc, True, backend)[:3]
            take = (err1.sum(-1) < err0).view(-1, 1, 1)
            idx, flip = torch.where(take, idx1, idx), torch.where(take, flip1, flip)
        zero = d == 0
        lsc = torch.where(zero.unsqueeze(-1), 0, lsc)
        return (self._pack(d, lsc, idx, neg ^ flip),)

    # ------------------------------------------------------------------ Codec

    def _check_blocks(self, x: torch.Tensor, w: torch.Tensor) -> None:
        if x.ndim != 2 or x.shape[1] != QK_K or w.shape != x.shape:
            raise ValueError(
                f"{self.format_name}: expected x and w of shape (n_blocks, 256), got {tuple(x.shape)} and {tuple(w.shape)}"
            )

    def _check_bytes(self, b: torch.Tensor) -> None:
        ts = self.format.type_size
        if b.dtype != torch.uint8 or b.ndim != 2 or b.shape[1] != ts:
            raise ValueError(f"{self.format_name}: expected (n_blocks, {ts}) uint8, got {tuple(b.shape)} {b.dtype}")

    fast_paths = True

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """(n, 256) float32 weights and importance (> 0) -> (n, type_size) uint8; ValueError on other shapes.
        ``backend``: the assignment's fast path (:meth:`_assign`; ``"auto"``: Triton on CUDA, C on CPU);
        ``variant`` is unused (the kernel's default, ``"rows"``)."""
        self._check_blocks(x, w)
        x, w = x.to(torch.float32), w.to(torch.float32)
        step = _CPU_BLOCKS if x.device.type == "cpu" else max(1, x.shape[0])
        parts = [self._encode(x[i : i + step], w[i : i + step], backend)[0] for i in range(0, x.shape[0], step)]
        return torch.cat(parts, 0) if parts else torch.empty(0, self.format.type_size, dtype=torch.uint8, device=x.device)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor):
        """Not available: IQ3 types are vector-quantized (grid points of 4 weights), so
        there is no per-weight rounding for GPTQ. Raises NotImplementedError."""
        raise NotImplementedError(f"{self.format_name} is vector-quantized: no per-weight rounding")

    def _pack(self, d, lsc, idx, negative) -> torch.Tensor:
        raise NotImplementedError


@register
class IQ3_XXS(_IQ3):
    """IQ3_XXS (``block_iq3_xxs``): 98 bytes per 256 weights, 256-point grid, even-parity signs.

    ``encode_blocks(x, w)``: x, w (n_blocks, 256) float32 -> (n_blocks, 98) uint8;
    ``decode_blocks`` -> (n_blocks, 256) float32. Both raise ValueError on other shapes.
    """

    format_name = "IQ3_XXS"
    grid_name = "IQ3_XXS"
    scale_mul = 0.25
    scale_kind = "half"
    parity = True
    step1_t = tuple(float(t) for t in np.linspace(44.0, 78.0, 8))
    cpu_search = {**_IQ3.cpu_search, "step1_t": (50.0, 62.0)}

    def _pack(self, d, lsc, idx, negative) -> torch.Tensor:
        n = d.shape[0]
        d16 = d.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2)
        qs = idx.reshape(n, 64).to(torch.uint8)
        bits = negative.reshape(n, _N_SUB, 4, 8)[..., :7].to(torch.uint8) << _bits(d.device, 7, torch.uint8)
        s7 = bits.sum(-1)  # (n, 8, 4) int64 (the (n, 8, 4, 7) bits in uint8: an eighth of int64's bytes)
        word = (s7 << (7 * _bits(d.device, 4))).sum(-1) | (lsc.to(torch.int64) << 28)  # (n, 8)
        wb = ((word.unsqueeze(-1) >> (8 * _bits(d.device, 4))) & 255).reshape(n, 32).to(torch.uint8)
        return torch.cat([d16, qs, wb], 1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        """(n, 98) uint8 -> (n, 256) float32 (``gguf.quants.IQ3_XXS``'s operations)."""
        self._check_bytes(b)
        n = b.shape[0]
        d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)  # (n, 1)
        grid = grid_points(self.grid_name, b[:, 2:66].long()).reshape(n, _N_SUB, 32)
        word = (b[:, 66:98].long().reshape(n, _N_SUB, 4) << (8 * _bits(b.device, 4))).sum(-1)  # (n, 8)
        db = (d * (0.5 + (word >> 28).to(torch.float32))) * 0.5
        s7 = (word.unsqueeze(-1) >> (7 * _bits(b.device, 4))) & 127  # (n, 8, 4)
        s8 = _ksigns(b.device)[s7]
        sbits = (s8.unsqueeze(-1) >> _bits(b.device)) & 1  # (n, 8, 4, 8)
        signs = torch.where(sbits == 0, 1.0, -1.0).reshape(n, _N_SUB, 32)
        return ((db.unsqueeze(-1) * grid) * signs).reshape(n, QK_K)


@register
class IQ3_S(_IQ3):
    """IQ3_S (``block_iq3_s``): 110 bytes per 256 weights, 512-point grid, free signs.

    ``encode_blocks(x, w)``: x, w (n_blocks, 256) float32 -> (n_blocks, 110) uint8;
    ``decode_blocks`` -> (n_blocks, 256) float32. Both raise ValueError on other shapes.
    """

    format_name = "IQ3_S"
    grid_name = "IQ3_S"
    scale_mul = 1.0
    scale_kind = "odd"
    parity = False
    step1_t = tuple(float(t) for t in np.linspace(11.0, 19.5, 8))
    cpu_search = {**_IQ3.cpu_search, "step1_t": (12.0, 15.5)}

    def _pack(self, d, lsc, idx, negative) -> torch.Tensor:
        n = d.shape[0]
        d16 = d.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2)
        idx = idx.reshape(n, 64).to(torch.int64)
        qs = idx & 255
        qh = (((idx >> 8) & 1).reshape(n, 8, 8) << _bits(d.device)).sum(-1)
        signs = (negative.reshape(n, 32, 8).to(torch.uint8) << _bits(d.device, 8, torch.uint8)).sum(-1)
        lsc = lsc.to(torch.int64)
        scales = lsc[:, 0::2] | (lsc[:, 1::2] << 4)
        return torch.cat([d16, torch.cat([qs, qh, signs, scales], 1).to(torch.uint8)], 1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        """(n, 110) uint8 -> (n, 256) float32 (``gguf.quants.IQ3_S``'s operations)."""
        self._check_bytes(b)
        n = b.shape[0]
        d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)  # (n, 1)
        bl = b.long()
        qh = ((bl[:, 66:74].unsqueeze(-1) >> _bits(b.device)) & 1).reshape(n, 64)
        idx = bl[:, 2:66] | (qh << 8)
        grid = grid_points(self.grid_name, idx).reshape(n, _N_SUB, 32)
        sbits = ((bl[:, 74:106].unsqueeze(-1) >> _bits(b.device)) & 1).reshape(n, _N_SUB, 32)
        signs = torch.where(sbits == 0, 1.0, -1.0)
        sc = ((bl[:, 106:110].unsqueeze(-1) >> torch.tensor([0, 4], device=b.device)) & 15).reshape(n, _N_SUB)
        db = d * (1 + 2 * sc).to(torch.float32)
        return ((db.unsqueeze(-1) * grid) * signs).reshape(n, QK_K)
