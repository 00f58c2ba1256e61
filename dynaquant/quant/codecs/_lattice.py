"""Exhaustive nearest-codeword search for the grid (lattice) i-quants.

The i-quants (``IQ2_*``, ``IQ3_*``, ``IQ1_*``) code a group of ``D`` weights (8 or 4) as one
point ``g`` of a fixed codebook (``grid``, (G, D) float32, the same table llama.cpp and
gguf-py use) times a scale ``S`` shared by a sub-block. For one group with weights ``x``
(already sign-folded where the format stores signs apart) and importance ``w``:

    E(S, g) = sum_i w_i (x_i - S g_i)**2 = A - 2 S B_g + S**2 C_g,
    A = sum_i w_i x_i**2,   B_g = sum_i w_i x_i g_i,   C_g = sum_i w_i g_i**2.

The costs of every codeword at one scale per group come from one (n, 2D) @ (2D, G)
matmul, ``[S**2 w, -2 S w x] @ [grid**2, grid].T`` (:func:`full_costs`): every codeword
is searched for every candidate scale (llama.cpp searches a small neighbourhood of the
rounded point). For a few candidate codewords per group, :func:`subset_terms` gives ``B``
and ``C`` and :func:`scaled_costs` evaluates any batch of scales on them. Given the chosen
codewords, the least-squares scale of a sub-block is ``sum B / sum C`` over its groups
(:func:`lsq_scale`).

Formats whose sign bits carry a parity constraint (IQ2_XXS, IQ2_XS: an even number of
negative signs per group of 8) add :func:`flip_penalty`: with an odd number of negative
weights one sign must be wrong, and flipping element ``i`` costs ``4 S w_i |x_i| g_i``; so
the exact cost of codeword ``g`` is ``E(S, g) + 4 S min_i w_i |x_i| g_i``, i.e. ``B_g``
lowered by ``2 min_i w_i |x_i| g_i``.

All functions are pure torch on the inputs' device, batched over groups; callers bound
memory by calling them on slices of groups (:func:`group_chunk`). Private to the codecs.

:func:`nearest_codewords`, :func:`candidate_terms` and :func:`subset_min_costs` run a fast path
registered in :mod:`dynaquant.quant.codecs.fastpaths` (the fused Triton kernels of
:mod:`dynaquant.kernels` for CUDA tensors, the compiled C searches of
:mod:`dynaquant.kernels.native.lattice` for CPU tensors, registered when that package is imported)
or their torch references ``*_torch`` of the same signatures; the ``backend`` argument chooses
(:func:`fast_path`): ``"auto"`` (default) the fast path of the tensors' device when one is
registered and loads, ``"torch"`` the reference, ``"triton"`` the Triton fast path on any device,
``"native"`` the compiled CPU one (RuntimeError when there is none). The fast paths keep no
(groups, G) or (scales, groups, K) temporaries, so with one the codecs need no slicing.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch

from dynaquant.quant.codecs.fastpaths import fast_path

# Elements of one (groups, G) float32 tensor a codec should hold at a time: small on CPU
# (cache), large on GPUs (few, big kernels; 512 MiB a tensor).
_CPU_ELEMS = 1 << 21
_GPU_ELEMS = 1 << 27


@cache
def _gguf_grid_np(type_name: str) -> np.ndarray:
    import gguf.quants

    cls = getattr(gguf.quants, type_name)
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32)
    return g.reshape(cls.grid_shape).copy()


_GRID_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def gguf_grid(type_name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """A GGML type's codebook as gguf-py builds it from llama.cpp's published table.

    Args:
        type_name: ``"IQ2_XXS"``, ``"IQ2_XS"``, ``"IQ2_S"``, ``"IQ3_XXS"``, ``"IQ3_S"``,
            ``"IQ1_S"`` or ``"IQ1_M"``.
        device: where the tensor should live (cached per device).
    Returns:
        (G, D) float32, row ``k`` the decoded values of codeword ``k`` (e.g. 8, 25, 43 for
        IQ2_*; -1, 0, 1 for IQ1_*). Do not modify it in place.
    Raises:
        AttributeError: gguf-py has no such type.
    """
    dev = torch.device(device)
    key = (type_name, str(dev))
    if key not in _GRID_CACHE:
        _GRID_CACHE[key] = torch.from_numpy(_gguf_grid_np(type_name)).to(dev)
    return _GRID_CACHE[key]


def dominance_candidates(lev: np.ndarray, n_levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact candidate lists for a nearest-point search on a grid whose coordinates take
    ``n_levels`` sorted levels, under a per-coordinate cost convex in the level.

    With the scale fixed, each coordinate's cost is least at its rounded level ``p_i`` and
    grows away from it, so the best grid point is one that no other grid point dominates
    (lies, coordinate by coordinate, between it and the rounded pattern ``p``). Built by a
    box-OR sweep over (pattern, pattern) pairs in numpy (``has[p, q]``: the box between ``p``
    and ``q`` holds a grid point; ``q`` is dominated when a one-step move of ``q`` towards
    ``p`` has ``has`` set); memory (L**D)**2 bytes twice (IQ2: 86 MB, briefly).

    Args:
        lev: (P, D) int level index of each grid point's coordinates (0 .. n_levels - 1).
        n_levels: L.
    Returns:
        cand (L**D, K) int64 grid indices in ascending order, padded with the first, and
        count (L**D,) int64 distinct candidates, for the pattern ``sum_i p_i L**i``; an
        on-grid pattern's only candidate is its own point.
    """
    n_pts, dims = lev.shape
    L = n_levels
    n = L**dims
    u = (lev * L ** np.arange(dims)).sum(1)
    on = np.zeros(n, dtype=bool)
    on[u] = True
    # (p digits D-1..0, q digits D-1..0): digit i of p is axis D-1-i, of q axis 2D-1-i
    has = np.broadcast_to(on, (n, n)).reshape((L,) * (2 * dims)).copy()
    dom = np.zeros_like(has)
    for target in (has, dom):
        for i in range(dims):
            h = np.moveaxis(has, (dims - 1 - i, 2 * dims - 1 - i), (0, 1))  # views
            d = np.moveaxis(target, (dims - 1 - i, 2 * dims - 1 - i), (0, 1))
            for c in range(L):  # sweep outwards from p_i = c (in place: cumulative for ``has``)
                for k in range(c + 1, L):
                    d[c, k] |= h[c, k - 1]
                for k in range(c - 1, -1, -1):
                    d[c, k] |= h[c, k + 1]
    del has
    p, q = np.nonzero(on & ~dom.reshape(n, n))
    grid_of = np.full(n, -1, dtype=np.int64)
    grid_of[u] = np.arange(n_pts)
    gi = grid_of[q]
    order = np.lexsort((gi, p))
    p, gi = p[order], gi[order]
    count = np.bincount(p, minlength=n)
    k = int(count.max())
    slot = np.arange(p.shape[0]) - (np.cumsum(count) - count)[p]
    cand = np.zeros((n, k), dtype=np.int64)
    cand[p, slot] = gi
    cand = np.where(np.arange(k)[None, :] < count[:, None], cand, cand[:, :1])
    return torch.from_numpy(cand), torch.from_numpy(count.astype(np.int64))


def group_chunk(n_per_block: int, n_codewords: int, device: torch.device) -> int:
    """Blocks per slice so that a (groups, G) float32 tensor stays within a fixed budget
    (:func:`batch_size` then says how many candidate scales fit at once).

    Args:
        n_per_block: groups per block.
        n_codewords: G.
        device: the device the search runs on (CPU slices are small, for the cache).
    Returns:
        A positive int.
    """
    budget = _CPU_ELEMS if torch.device(device).type == "cpu" else _GPU_ELEMS
    return max(1, budget // (n_per_block * n_codewords))


def batch_size(n_groups: int, n_codewords: int, device: torch.device) -> int:
    """How many candidate scales :func:`full_costs` may take at once for ``n_groups`` groups
    within the same budget as :func:`group_chunk` (>= 1)."""
    budget = _CPU_ELEMS if torch.device(device).type == "cpu" else _GPU_ELEMS
    return max(1, budget // max(1, n_groups * n_codewords))


def group_terms(x: torch.Tensor, w: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``B = (w * x) @ grid.T`` and ``C = w @ (grid**2).T`` (all codewords).

    Args:
        x: (n, D) float32 group weights (sign-folded when the format stores signs apart).
        w: (n, D) float32 importance, >= 0.
        grid: (G, D) float32 codebook.
    Returns:
        (B, C), each (n, G) float32: ``E(S, g) = sum(w x**2) - 2 S B[:, g] + S**2 C[:, g]``.
    """
    return (w * x) @ grid.T, w @ (grid * grid).T


def subset_terms(x: torch.Tensor, w: torch.Tensor, grid: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_terms` for a few codewords per group.

    Args:
        x, w: (n, D) float32 as in :func:`group_terms`.
        grid: (G, D) float32 codebook.
        idx: (n, K) int64 codeword indices.
    Returns:
        (B, C), each (n, K) float32, ``B[r, k]`` the term of codeword ``idx[r, k]``.
    """
    g = grid[idx]  # (n, K, D)
    return ((w * x)[:, None, :] * g).sum(dim=2), (w[:, None, :] * (g * g)).sum(dim=2)


def full_costs(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: torch.Tensor,
    scale: torch.Tensor,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
    want_idx: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Best codeword of each group over the whole codebook, by one matmul per batch of scales.

    ``S**2 C - 2 S B = [S**2 w, -2 S w x] @ [grid**2, grid].T``: the costs are written once
    and reduced once, with no stored ``B``/``C``.

    Args:
        x, w: (n, D) float32 as in :func:`group_terms`.
        grid: (G, D) float32 codebook.
        scale: (..., n) float32 scale of each group (>= 0); leading axes are a batch of
            candidate scales (memory: a (..., n, G) float32 temporary).
        extra: optional ``(rows, m)``: (r,) int64 group indices and (r, G) float32; adds
            ``4 S m`` to those groups' costs (the parity flip, :func:`flip_penalty`).
        want_idx: also return the argmin.
    Returns:
        (cost, idx) as :func:`scaled_costs`, shaped like ``scale``.
    """
    s = scale[..., None]
    lhs = torch.cat([w * (s * s), (w * x) * (-2.0 * s)], dim=-1)  # (..., n, 2D)
    e = lhs @ torch.cat([grid * grid, grid], dim=1).T
    if extra is not None and extra[0].numel():
        rows, m = extra
        e.index_add_(e.dim() - 2, rows, m * (4.0 * scale[..., rows, None]))
    if want_idx:
        cost, idx = e.min(dim=-1)
        return cost, idx
    return e.amin(dim=-1), None


def nearest_codewords_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: torch.Tensor,
    scale: torch.Tensor,
    odd: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best codeword of each group over the whole codebook, for a batch of scales (torch).

    The reference of the fused Triton kernel
    fast path ``lattice.nearest_codewords`` (:mod:`.fastpaths`; same signature): the
    parity penalty of the ``odd`` groups from :func:`flip_penalty`, the costs from
    :func:`full_costs`, on slices of groups and batches of scales that keep each (T, groups,
    G) temporary within the device's budget.

    Args:
        x: (n, D) float32 group weights (sign-folded, >= 0, where ``odd`` is given).
        w: (n, D) float32 importance, >= 0.
        grid: (G, D) float32 codebook (entries > 0 where ``odd`` is given).
        scale: (..., n) float32 scale of each group (>= 0); leading axes are candidate scales.
        odd: optional (n,) bool: groups whose sign pattern must flip one element (their cost
            gets ``4 S min_i w_i x_i g_i``).
    Returns:
        (cost, idx): (..., n) float32 ``min_g S**2 C_g - 2 S B_g (+ 4 S M_g)`` (the error less
        ``sum(w x**2)``) and (..., n) int64 its argmin.
    """
    n = x.shape[0]
    lead = scale.shape[:-1]
    sc = scale.reshape(math.prod(lead), n)
    cost = torch.empty(sc.shape, dtype=torch.float32, device=x.device)
    idx = torch.empty(sc.shape, dtype=torch.int64, device=x.device)
    g = grid.shape[0]
    step = max(1, (_CPU_ELEMS if x.device.type == "cpu" else _GPU_ELEMS) // g)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        extra = None
        if odd is not None:
            rows = odd[r0:r1].nonzero().squeeze(1)
            extra = (rows, flip_penalty(w[r0:r1][rows] * x[r0:r1][rows], grid))
        per = batch_size(r1 - r0, g, x.device)
        for t0 in range(0, sc.shape[0], per):
            c, i = full_costs(x[r0:r1], w[r0:r1], grid, sc[t0 : t0 + per, r0:r1], extra)
            cost[t0 : t0 + per, r0:r1], idx[t0 : t0 + per, r0:r1] = c, i
    return cost.reshape(*lead, n), idx.reshape(*lead, n)


def fused(x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether :func:`nearest_codewords` runs a fast path (:func:`fast_path`) for groups on ``x``'s device."""
    return fast_path("lattice.nearest_codewords", x, backend) is not None


def nearest_codewords(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: torch.Tensor,
    scale: torch.Tensor,
    odd: torch.Tensor | None = None,
    backend: str = "auto",
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nearest_codewords_torch`, or its fast path (the fused Triton kernel) as
    ``backend`` chooses (:func:`fast_path`); the two agree up to float32 rounding (equal
    indices except near-exact ties). ``variant``: the kernel's implementation (``"rows"`` or
    ``"tile"``; None: its default), unused by the reference."""
    kernel = fast_path("lattice.nearest_codewords", x, backend)
    if kernel is not None:
        return kernel(x, w, grid, scale, odd, variant=variant)
    return nearest_codewords_torch(x, w, grid, scale, odd)


def candidate_terms_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: torch.Tensor,
    idx: torch.Tensor,
    odd: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`subset_terms` with the parity flip: ``B`` lowered by ``2 min_i w_i x_i g_i`` on
    the ``odd`` groups (:func:`subset_penalty`). Reference of
    fast path ``lattice.candidate_terms`` (same signature).

    Args:
        x, w: (n, D) float32 (``x`` sign-folded, >= 0, where ``odd`` is given); grid: (G, D);
        idx: (n, K) int64 candidate codewords; odd: optional (n,) bool.
    Returns:
        (b, c), each (n, K) float32.
    """
    b, c = subset_terms(x, w, grid, idx)
    if odd is not None:
        rows = odd.nonzero().squeeze(1)
        if rows.numel():
            b[rows] -= 2.0 * subset_penalty(w[rows] * x[rows], grid, idx[rows])
    return b, c


def candidate_terms(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: torch.Tensor,
    idx: torch.Tensor,
    odd: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`candidate_terms_torch`, or its fast path (a Triton kernel) as ``backend`` chooses (:func:`fast_path`)."""
    kernel = fast_path("lattice.candidate_terms", x, backend)
    if kernel is not None:
        return kernel(x, w, grid, idx, odd)
    return candidate_terms_torch(x, w, grid, idx, odd)


def subset_min_costs_torch(b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, gps: int = 1) -> torch.Tensor:
    """``min_k S**2 c_k - 2 S b_k`` per group for a batch of scales (:func:`scaled_costs` without the argmin),
    summed over sub-blocks of ``gps`` consecutive groups that share one scale. Reference of fast path
    ``lattice.subset_min_costs`` (same signature).

    Args:
        b, c: (n, K) float32 terms of each group's candidates.
        scale: (..., n // gps) float32, one scale a sub-block.
        gps: groups a sub-block (divides n).
    Returns:
        (..., n // gps) float32: each sub-block's sum (torch's ``sum``) of its groups' minima.
    """
    if gps == 1:
        return scaled_costs(b, c, scale, False)[0]
    cost = scaled_costs(b, c, scale.repeat_interleave(gps, dim=-1), False)[0]
    return cost.view(*cost.shape[:-1], -1, gps).sum(dim=-1)


def subset_min_costs(b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, backend: str = "auto", gps: int = 1) -> torch.Tensor:
    """:func:`subset_min_costs_torch`, or its fast path (a Triton kernel, which never writes the
    (..., n, K) temporary) as ``backend`` chooses (:func:`fast_path`)."""
    kernel = fast_path("lattice.subset_min_costs", b, backend)
    if kernel is not None:
        return kernel(b, c, scale, gps)
    return subset_min_costs_torch(b, c, scale, gps)


def subset_penalty(a: torch.Tensor, grid: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """:func:`flip_penalty` for a few codewords per group: ``min_i a_i grid[idx]_i``.

    Args:
        a: (n, D) float32 ``w * |x|`` (>= 0); grid: (G, D); idx: (n, K) int64.
    Returns:
        (n, K) float32, equal to ``flip_penalty(a, grid).gather(1, idx)``.
    """
    return (a[:, None, :] * grid[idx]).amin(dim=2)


def flip_penalty(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``min_i a_i g_i`` for every codeword: the cost / (4 S) of the cheapest forced sign flip.

    Exact: a running minimum over the D elements, each step one (n, G) product written into
    a reused buffer (no (n, G, D) temporary, no indexing).

    Args:
        a: (n, D) float32, ``w * |x|`` of each group (>= 0).
        grid: (G, D) float32 codebook, entries > 0.
    Returns:
        (n, G) float32.
    """
    g_t = grid.T.contiguous()  # (D, G)
    m = a[:, :1] * g_t[0]
    tmp = torch.empty_like(m)
    for i in range(1, a.shape[1]):
        torch.mul(a[:, i : i + 1], g_t[i], out=tmp)
        torch.minimum(m, tmp, out=m)
    return m


def scaled_costs(
    b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, want_idx: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Best codeword of each group at a given scale.

    Args:
        b, c: (n, G) float32 from :func:`group_terms` (``b`` possibly lowered by a flip
            penalty), or their columns for a subset of codewords.
        scale: (..., n) float32 scale of each group's sub-block (>= 0); leading axes are a
            batch of candidate scales, evaluated at once.
        want_idx: also return the argmin (slower on CPU).
    Returns:
        (cost, idx): (..., n) float32 ``min_g S**2 C_g - 2 S B_g`` (the error less the
        constant ``sum(w x**2)``) and (..., n) int64 its argmin into ``b``'s columns (None
        unless ``want_idx``).
    """
    s = scale[..., None]
    e = c * (s * s)
    e.addcmul_(b, s, value=-2.0)
    if want_idx:
        cost, idx = e.min(dim=-1)
        return cost, idx
    return e.amin(dim=-1), None


def last_sum(t: torch.Tensor) -> torch.Tensor:
    """``t.sum(dim=-1)``; a last axis of two as one elementwise add, ``t[..., 0] + t[..., 1]`` (the same value, the
    one rounding of a two-term sum, without a reduction kernel over pairs: slow on CUDA).

    Args:
        t: (..., m) float tensor.
    Returns:
        (...,) tensor.
    """
    return t[..., 0] + t[..., 1] if t.shape[-1] == 2 else t.sum(dim=-1)


def lsq_scale(b_sel: torch.Tensor, c_sel: torch.Tensor) -> torch.Tensor:
    """Least-squares scale of sub-blocks given their chosen codewords.

    Args:
        b_sel, c_sel: (..., groups) float32 ``B`` and ``C`` at each group's chosen codeword.
    Returns:
        (...,) float32 ``sum B / sum C`` (0 where ``sum C`` is 0), clamped at >= 0.
    """
    num, den = last_sum(b_sel), last_sum(c_sel)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den)).clamp_min(0)
