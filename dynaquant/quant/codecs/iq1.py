"""GGUF 1-bit i-quants IQ1_S and IQ1_M: super-blocks of 256 weights on a ternary grid.

Both code each group of 8 weights as one point ``g`` of ``iq1s_grid`` (2048 points of
{-1, 0, 1}^8, gguf-py's ``IQ1_S.grid``, decoded from llama.cpp's published table) shifted by
a delta ``+-IQ1S_DELTA`` (0.125): ``y = dl * (g + delta)``, with ``dl = d * (2 s + 1)`` for a
3-bit sub-block scale ``s`` and an fp16 super-block scale ``d``. Layouts follow llama.cpp
``ggml-common.h``:

- ``block_iq1_s`` (50 bytes, 1.5625 bpw): ``d`` (fp16), ``qs[32]`` (low 8 bits of the 32
  grid indices), ``qh[8]`` (uint16 per sub-block of 32: bits ``3k .. 3k+2`` the high 3
  bits of group ``k``'s index, bits 12..14 the scale ``s``, bit 15 the delta sign, set
  for ``-IQ1S_DELTA``).
- ``block_iq1_m`` (56 bytes, 1.75 bpw): ``qs[32]`` (low index bits), ``qh[16]`` (one
  byte per pair of groups: per nibble, bits 0..2 the high index bits and bit 3 the delta
  sign of that group), ``scales[8]`` (four little-endian uint16: bits ``3j .. 3j+2`` of
  word ``i`` hold the scale of sub-block ``4i + j`` of 16 weights; the top nibbles of the
  four words, word 0 lowest, are the bits of the fp16 ``d``).

Decoders repeat gguf-py's float32 operations (``dl = d * (2 s + 1)``, then
``dl * (g + delta)``) and equal ``gguf.quants.dequantize`` bit for bit.

Encoders minimise the importance-weighted squared error ``sum(w * (x - decode)**2)``.
The core is an exact nearest-grid-point search (:func:`nearest_points`): for a given scale
and delta sign each weight's cost is convex in its ternary level, so the best grid point
of a group is among the grid points that no other grid point dominates (lies coordinate-
wise between it and the group's free rounding); these sets, at most 54 points (about 17
on average for the half of the groups whose free rounding is off the grid), are built once
from the grid (:func:`_build_tables`), and searching them equals an exhaustive search of
all 2048 points (a test checks it). llama.cpp instead searches a fixed neighbour list at
the sub-block's float scale and never re-picks points after quantising the scales.

The search per super-block (:func:`_encode`):

1. per sub-block, candidate scales ``amax * r`` (``_RATIOS``): free ternary rounding at
   both delta signs, least-squares refit of the scale, keep the best (scale and curvature);
2. candidate ``d = max(scale) / m`` (``_DIVISORS``), each sub-block's scale code the
   nearest odd multiple, ranked by the quadratic model of the sub-block errors; the best
   is rounded to fp16 and scored exactly: each sub-block tries its code and the next code
   on the other side of its free scale, both delta signs (per group for IQ1_M), nearest
   grid points, on the float32 values the decoder produces;
3. least-squares refit of ``d`` given the codes, rounded to fp16, exact re-search, kept
   where better;
4. the all-zero block (``d = 0``) where it is better.

On CPU (``CPU_SEARCH``) step 2 tries only the nearest code per sub-block and step 3 is
skipped: about 3x faster at 0.4% more error.

On CUDA (with Triton) :func:`nearest_points` runs as one kernel
(fast path ``iq1.ternary_nearest``, the same search and the same
indices bit for bit), and so do step 1 (:func:`sub_scales_torch`, fast path ``iq1.sub_scales``:
the reference's (blocks, S, 6, G, 8) temporaries never written) and the searches of steps 2-3
(:func:`ternary_search_torch`, fast path ``iq1.ternary_search``: both delta signs, each group read
once for all its trial scales, the errors summed in the kernel, no gathered grid rows). Their sums
are :func:`tree_sum` (halves first) on every path, so the kernels give the torch path's bytes on any
device. Before those two kernels, IQ1_S encoded at 0.54 G weights/s on an H100 (4096 x 14336, 11-12x
llama.cpp's 16-thread ``ggml_quantize_chunk``, 45-48 M/s; 0.16 G/s torch-only). On CPU the same
search runs as compiled C (:mod:`dynaquant.kernels.native.lattice`; the same indices bit for bit,
IQ1_M 1.6x and IQ1_S 1.15x faster encodes on one thread).

Measured (``tests/test_codecs_iq1.py`` data): importance-weighted error / llama.cpp's
(same imatrix) 0.78 (IQ1_S) and 0.77 (IQ1_M) on average over SmolLM2 weights, worst tensor
0.84; 0.67 to 0.75 on synthetic ones.

Without an imatrix (the importance is constant over the chunk, as
:func:`dynaquant.quant.codecs.base.quantize` passes it) the weights are ``x**2``, llama.cpp's
IQ1_M default (llama.cpp refuses IQ1_S without an imatrix), floored at 1e-6 times the mean
``x**2`` of the super-block so all-zero groups stay well posed.
"""

from __future__ import annotations

import torch

from dynaquant.quant.codecs import _lattice as lat
from dynaquant.quant.codecs.base import Codec, register
from dynaquant.quant.codecs.consts import device_constant

QK_K = 256
DELTA = 0.125  # IQ1S_DELTA == IQ1M_DELTA
GRID_SIZE = 2048


# --------------------------------------------------------------------------- grid tables


_TABLES: dict[str, tuple[torch.Tensor, ...]] = {}


def _build_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grid (2048, 8) int64 in {-1, 0, 1}, grid_of (6561,) int64, cand (6561, K) int64).

    Patterns of {-1, 0, 1}^8 are numbered ``sum_i (v_i + 1) 3**i``. ``grid_of[p]`` is the
    grid index of pattern ``p`` or -1. ``cand[p]`` lists the grid points ``g`` that no other
    grid point ``g'`` dominates with respect to ``p`` (``g'_i`` between ``p_i`` and ``g_i``
    for every ``i``), padded by repeating its first entry. With a per-coordinate cost that
    is convex and minimal at ``p``, the cheapest grid point is always in ``cand[p]``.

    Built by a box-OR sweep: ``B[p, q]`` (the box between ``p`` and ``q`` holds a grid
    point) is the OR of ``grid`` over that box, one pass per axis; ``q`` is dominated when
    a one-step move of ``q`` towards ``p`` has ``B`` set.
    """
    import gguf.quants

    gguf.quants.IQ1_S.init_grid()
    grid = torch.from_numpy(gguf.quants.IQ1_S.grid.reshape(GRID_SIZE, 8).copy()).to(torch.int64)
    n = 3**8
    pow3 = 3 ** torch.arange(8)
    gid = ((grid + 1) * pow3).sum(1)
    on_grid = torch.zeros(n, dtype=torch.bool)
    on_grid[gid] = True
    grid_of = torch.full((n,), -1, dtype=torch.int64)
    grid_of[gid] = torch.arange(GRID_SIZE)
    digits = (torch.arange(n)[:, None] // pow3) % 3  # (p, i)

    box = on_grid.expand(n, n).clone().view(n, *(3,) * 8)  # digit i of q is dim 8 - i
    dom = torch.zeros_like(box)
    # One move towards digit c of p: (to, from) pairs, in sweep order.
    moves = {0: ((1, 0), (2, 1)), 1: ((0, 1), (2, 1)), 2: ((1, 2), (0, 1))}
    for target, source, sweep in ((box, box, True), (dom, box, False)):
        for i in range(8):
            for c in range(3):
                rows = (digits[:, i] == c).nonzero().squeeze(1)
                src = source.index_select(0, rows)
                dst = src if sweep else target.index_select(0, rows)
                for to, frm in moves[c]:
                    dst.select(8 - i, to).logical_or_(src.select(8 - i, frm))
                target.index_copy_(0, rows, dst)
    keep = on_grid & ~dom.view(n, n)  # (p, q)
    counts = keep.sum(1)
    k = int(counts.max())
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :k]  # kept q first
    slot = torch.arange(k)[None, :]
    q = torch.where(slot < counts[:, None], order, order[:, :1])
    return grid, grid_of, grid_of[q]


def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per device: grid (2048, 8) float32, grid_of (6561,) int64, cand (6561, K) int64,
    pow3 (8,) int64, count (6561,) int64 (distinct candidates of each pattern), cand_lh
    (6561, K, 2) int64 (each candidate's low and 81 + high half-pattern id)."""
    key = str(device)
    if key not in _TABLES:
        if "cpu" not in _TABLES:
            grid, grid_of, cand = _build_tables()
            g = grid.to(torch.float32)
            count = (cand != cand[:, :1]).sum(1) + 1
            pow3 = 3 ** torch.arange(8)
            digits = grid + 1  # (2048, 8)
            lo = (digits[:, :4] * pow3[:4]).sum(1)
            hi = (digits[:, 4:] * pow3[:4]).sum(1) + 81
            cand_lh = torch.stack([lo[cand], hi[cand]], 2)  # (6561, K, 2)
            _TABLES["cpu"] = (g, grid_of, cand, pow3, count, cand_lh)
        _TABLES[key] = tuple(t.to(device) for t in _TABLES["cpu"])
    return _TABLES[key]


_KERNEL_TABLES: dict[str, tuple[torch.Tensor, ...]] = {}


def _kernel_tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per device, the tables of the fused search
    (fast path ``iq1.ternary_nearest``): grid_of (6561,) int32,
    count (6561,) int32, codes (6561, K) int32 = candidate index | its 2-bit digits
    (level + 1) << 11 + 2 i."""
    key = str(device)
    if key not in _KERNEL_TABLES:
        grid, grid_of, cand, _, count, _ = _tables(torch.device("cpu"))
        digits = ((grid.to(torch.int64) + 1) << (2 * torch.arange(8))).sum(1)  # (2048,)
        codes = cand | (digits[cand] << 11)
        _KERNEL_TABLES[key] = tuple(v.to(torch.int32).to(device) for v in (grid_of, count, codes, digits))
    return _KERNEL_TABLES[key][:3]


def _grid_digits(device: torch.device) -> torch.Tensor:
    """(2048,) int32 on ``device``: each grid point's 2-bit digits (level + 1 at bits 2 i), for
    fast path ``iq1.ternary_search`` (after :func:`_kernel_tables`'s three)."""
    _kernel_tables(device)
    return _KERNEL_TABLES[str(device)][3]


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a power of two long), halves first: ``v[..., :k] + v[..., k:]``
    recursively. Every search sum is formed so, the same on every device and in the kernels
    (:mod:`dynaquant.kernels.iq1_search`, :func:`dynaquant.kernels.lattice_search.ternary_search`)."""
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def grid_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """``iq1s_grid`` as (2048, 8) float32 in {-1, 0, 1} on ``device``."""
    return _tables(torch.device(device))[0]


# Groups handled per step of the candidate search (bounds its (groups, K, 2) temporaries).
_CPU_GROUPS = 1 << 14
_GPU_GROUPS = 1 << 19
# CPU: an off-grid group is searched in the narrowest of these candidate-list widths that
# holds all its candidates (on real weights about half the groups are off the grid, and
# 60% of those need at most 16). Each tier costs a host sync, so GPUs use one full width.
_TIERS = (8, 16, 32)


def _best_candidate(a: torch.Tensor, w: torch.Tensor, pid: torch.Tensor, k: int, tables) -> torch.Tensor:
    """Grid index of the cheapest of the first ``k`` candidates of each group's pattern.

    ``a``, ``w``: (m, 8) level-cost coefficients (cost of level v is ``w |v| + a v``);
    ``pid``: (m,) rounded-pattern ids. The cost of a candidate is the sum of the costs of
    its two 4-element halves, read from the group's (m, 162) table of all half-pattern
    costs (built by broadcast sums), so each candidate costs two gathers.
    """
    cand, cand_lh = tables
    m = a.shape[0]
    lv = torch.stack([w - a, torch.zeros_like(a), w + a], 2)  # (m, 8, 3): levels -1, 0, 1
    halves = []
    for h in (4, 8):  # half-pattern id sum_i (v_i + 1) 3**i: element h - 1 is the top digit
        acc = lv[:, h - 1]
        for i in range(h - 2, h - 5, -1):
            acc = (acc.unsqueeze(2) + lv[:, i].unsqueeze(1)).reshape(m, -1)
        halves.append(acc)
    lh = torch.cat(halves, 1)  # (m, 162): costs of the 81 low and 81 high half-patterns
    ck, lhk = _tier(cand, cand_lh, k)
    cost = lh.gather(1, lhk.index_select(0, pid)).view(-1, k, 2).sum(2)
    return ck.index_select(0, pid).gather(1, cost.argmin(1, keepdim=True)).squeeze(1)


_TIER_TABLES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _tier(cand: torch.Tensor, cand_lh: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` candidates of every pattern, (6561, k) int64, and their half-pattern
    ids, (6561, 2 k) int64, contiguous (cached per device and width) for row gathers."""
    key = (str(cand.device), k)
    if key not in _TIER_TABLES:
        _TIER_TABLES[key] = (cand[:, :k].contiguous(), cand_lh[:, :k].reshape(cand.shape[0], 2 * k).contiguous())
    return _TIER_TABLES[key]


def nearest_points(
    x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, sign: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best grid point of each group of 8 for a given scale and delta sign (exact).

    Args:
        x: (m, 8) float32 weights.
        w: (m, 8) float32 importance, >= 0.
        t: (m,) float32 scale ``dl`` (>= 0; 0 decodes to zeros).
        sign: (m,) float32, +1 or -1: the delta is ``sign * DELTA``.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"native"``: whether the fast path
            ``iq1.ternary_nearest`` runs (:func:`._lattice.fast_path`: Triton on CUDA, C on CPU; same indices,
            bit for bit).
    Returns:
        (idx, err): (m,) int64 grid index minimising ``sum w (x - t (g + sign DELTA))**2``
        and (m,) float32 that error, computed on the float32 values the decoder gives (summed
        halves first, :func:`tree_sum`).
    """
    grid, grid_of, cand, pow3, count, cand_lh = _tables(x.device)
    ternary_nearest = lat.fast_path("iq1.ternary_nearest", x, backend)
    if ternary_nearest is not None:  # the same search in one kernel (Triton or C; same indices, bit for bit)
        idx = ternary_nearest(x, w, t, sign, *_kernel_tables(x.device), DELTA)
        return idx, _group_error(x, w, t, sign, grid.index_select(0, idx))
    tables = (cand, cand_lh)
    ts = torch.where(t > 0, t, torch.ones_like(t))[:, None]
    # Cost of level v (dropping terms free of v, divided by t^2): w |v| + a v.
    a = 2 * w * (sign[:, None] * DELTA - x / ts)
    v = (a < -w).to(torch.int64) - (a > w).to(torch.int64)
    pid = ((v + 1) * pow3).sum(1)
    # Groups whose rounded pattern is on the grid are done; the others search their candidates.
    idx = grid_of[pid]
    need = torch.where(idx < 0, count[pid], 0)
    step = _GPU_GROUPS if x.is_cuda else _CPU_GROUPS
    lo = 0
    for k in (*(() if x.is_cuda else _TIERS), cand.shape[1]):
        off = ((need > lo) & (need <= k)).nonzero().squeeze(1)
        lo = k
        for s in range(0, off.numel(), step):
            o = off[s : s + step]
            idx[o] = _best_candidate(a.index_select(0, o), w.index_select(0, o), pid[o], k, tables)
    return idx, _group_error(x, w, t, sign, grid.index_select(0, idx))


def _group_error(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, sign: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(m,) float32 ``sum w (x - t (g + sign DELTA))**2`` of (m, 8) groups at grid values ``g`` (:func:`tree_sum`)."""
    d = x - t[:, None] * (g + (sign * DELTA)[:, None])
    return tree_sum(w * (d * d))


# --------------------------------------------------------------------------- search


def _search(xg: torch.Tensor, wg: torch.Tensor, t: torch.Tensor, per_group: bool, backend: str = "auto"):
    """Nearest points of every group for both delta signs at ``T`` trial sub-block scales.

    Args:
        xg, wg: (n, S, G, 8) float32 weights and importance (S sub-blocks of G groups).
        t: (n, S, T) float32 trial sub-block scales ``dl``.
        per_group: the delta sign is chosen per group (IQ1_M), else per sub-block (IQ1_S).
        backend: as :func:`nearest_points`.
    Returns:
        (idx, neg, err): (n, S, T, G) int64 grid indices, (n, S, T, G) bool (delta is
        negative), (n, S, T) float32 sub-block error of each trial.
    """
    n, s, g, _ = xg.shape
    shape = (n, s, t.shape[2], g)
    tf = t.unsqueeze(3).expand(shape).reshape(-1)
    kernel = lat.fast_path("iq1.ternary_search", xg, backend) if backend != "native" else None
    if kernel is not None:  # both signs, every trial scale, and the errors in one kernel (no expanded copies)
        i2, e2 = kernel(
            xg.reshape(-1, 8), wg.reshape(-1, 8), tf, *_kernel_tables(xg.device), _grid_digits(xg.device), DELTA, t.shape[2], g
        )
    else:
        i2, e2 = ternary_search_torch(xg, wg, tf, t.shape[2], backend)
    ip, im, ep, em = i2[0].view(shape), i2[1].view(shape), e2[0].view(shape), e2[1].view(shape)
    neg = em < ep if per_group else (tree_sum(em) < tree_sum(ep)).unsqueeze(3).expand(shape)
    return torch.where(neg, im, ip), neg, tree_sum(torch.where(neg, em, ep))


def ternary_search_torch(
    xg: torch.Tensor, wg: torch.Tensor, tf: torch.Tensor, rep: int, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nearest_points` of every group at its ``rep`` trial scales, both delta signs.

    Reference of fast path ``iq1.ternary_search`` (:func:`dynaquant.kernels.lattice_search.ternary_search`).

    Args:
        xg, wg: (n, S, G, 8) float32 weights and importance.
        tf: (n * S * rep * G,) float32 scales, ordered (block, sub-block, trial, group).
        rep: trial scales a sub-block.
        backend: as :func:`nearest_points` (its ``"triton"`` or ``"native"`` fast path finds the indices).
    Returns:
        (idx, err): (2, m) int64 and (2, m) float32, row 0 for the delta ``+DELTA``, row 1 for ``-DELTA``.
    """
    n, s, g, _ = xg.shape
    shape = (n, s, rep, g)
    xf = xg.unsqueeze(2).expand(*shape, 8).reshape(-1, 8)
    wf = wg.unsqueeze(2).expand(*shape, 8).reshape(-1, 8)
    m = tf.numel()
    if lat.fast_path("iq1.ternary_nearest", xf, backend) is not None:  # one kernel per sign, no concatenated copies
        ones = torch.ones(m, device=xg.device)
        ip, ep = nearest_points(xf, wf, tf, ones, backend)
        im, em = nearest_points(xf, wf, tf, -ones, backend)
        return torch.stack([ip, im]), torch.stack([ep, em])
    sign = torch.ones(2 * m, device=xg.device)
    sign[m:] = -1
    i2, e2 = nearest_points(torch.cat([xf, xf]), torch.cat([wf, wf]), torch.cat([tf, tf]), sign, backend)
    return i2.view(2, m), e2.view(2, m)


def _levels(idx: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """(..., 8) float32 ``g + delta`` of grid indices and delta signs (any leading shape)."""
    grid = grid_values(idx.device)
    return grid[idx] + torch.where(neg, -DELTA, DELTA).unsqueeze(-1)


def sub_scales_torch(x: torch.Tensor, w: torch.Tensor, sub: int, per_group: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of :func:`_encode`: the best free scale of every sub-block of ``sub`` weights.

    For each trial scale ``ts = amax * r`` (``_RATIOS``, ``amax`` the sub-block's max ``|x|``): the
    unconstrained ternary rounding ``clamp(round(x / ts - sg), -1, 1) + sg`` at both delta signs
    ``sg``, the better sign per group (``per_group``, IQ1_M) or per sub-block (IQ1_S), the
    least-squares scale ``t = sum(w x q) / sum(w q q)`` (>= 0) of those levels and its error; the
    trial of least error (the first on ties) wins. Sums are :func:`tree_sum`. Reference of fast
    path ``iq1.sub_scales`` (:func:`dynaquant.kernels.iq1_search.sub_scales`, bit for bit).

    Args:
        x, w: (n, 256) float32 weights and importance.
        sub: 32 (IQ1_S) or 16 (IQ1_M); per_group: as above.
    Returns:
        (t, h): (n, 256 // sub) float32, the winning trial's scale and ``sum w q**2`` (>= 1e-30).
    """
    n = x.shape[0]
    S, G = QK_K // sub, sub // 8
    xr, wr = x.view(n, S, 1, G, 8), w.view(n, S, 1, G, 8)
    amax = x.view(n, S, sub).abs().amax(2)
    ratios = device_constant(_RATIOS, torch.float32, x.device)
    ts = (amax.unsqueeze(2) * ratios).clamp_min(1e-30)[..., None, None]  # (n, S, R, 1, 1)
    out, errs = [], []
    for sg in (DELTA, -DELTA):
        q = torch.round(xr / ts - sg).clamp(-1, 1) + sg
        d = xr - ts * q
        out.append(q)
        errs.append(tree_sum(wr * (d * d)))  # (n, S, R, G)
    neg = errs[1] < errs[0] if per_group else (tree_sum(errs[1]) < tree_sum(errs[0])).unsqueeze(3)
    q = torch.where(neg.unsqueeze(4), out[1], out[0])
    num = tree_sum((wr * xr * q).flatten(3))  # (n, S, R)
    den = tree_sum((wr * q * q).flatten(3)).clamp_min(1e-30)
    t = num / den
    t = torch.where(t < 0, 0.0, t)  # (clamp_min(0), keeping -0.0 on every device)
    d = xr - t[..., None, None] * q
    r = tree_sum((wr * (d * d)).flatten(3)).argmin(2, keepdim=True)
    return t.gather(2, r).squeeze(2), den.gather(2, r).squeeze(2)


def _to_half(v: torch.Tensor) -> torch.Tensor:
    """float32 -> float32 holding the nearest (clamped) float16 value."""
    return v.clamp(-65504.0, 65504.0).to(torch.float16).to(torch.float32)


def _codes_at(xg, wg, d, st, per_group, backend):
    """Best codes of each sub-block for the stored super-block scale ``d``.

    Each sub-block tries the T scale codes ``st`` (n, S, T) int64 in 0..7 (ties go to the
    earlier one), both delta signs, and its nearest points, all in one search. ``d``: (n,)
    float32 (a float16 value); ``backend`` as :func:`nearest_points`. Returns [s, idx, neg,
    err] with err (n, S) float32 exactly as decoded.
    """
    idx, neg, err = _search(xg, wg, d[:, None, None] * (2 * st + 1).to(torch.float32), per_group, backend)
    best = err.argmin(2, keepdim=True)  # (n, S, 1)
    pick = best.unsqueeze(3).expand(*best.shape, idx.shape[3])
    return [
        st.gather(2, best).squeeze(2),
        idx.gather(2, pick).squeeze(2),
        neg.gather(2, pick).squeeze(2),
        err.gather(2, best).squeeze(2),
    ]


# IQ1_S: the bit offsets of a sub-block's four 3-bit high index fields in ``qh``.
_QH_SHIFTS = (0, 3, 6, 9)
# Sub-block scale candidates, as fractions of the sub-block's max |x|.
_RATIOS = tuple(0.15 * (0.95 / 0.15) ** (i / 5) for i in range(6))
# Super-block scale candidates: max(sub-block scale) / m.
_DIVISORS = tuple(7.0 * (18.0 / 7.0) ** (i / 31) for i in range(32))
# Model-ranked d candidates scored exactly. Each sub-block then tries two scale codes
# (trying s - 1, s, s + 1 instead: 0.1-0.3% lower error, 1.3x the time; s alone: 0.5-1%
# higher error, 0.6x the time); 3 candidates: 0.1% lower error, 2x the time.
_EXACT_D = 1
# Also search -x with a negated d (the grid is not symmetric under negation): about 1%
# lower error for twice the time; off.
_NEGATIVE_D = False
# The CPU search: whether each sub-block also tries the second scale code in step 2 and
# whether step 3 (the least-squares refit of d and a second exact search) runs. Both off:
# about 3x faster on CPU at 0.4% more error (IQ1_S on benchmarks/encode_speed.py's tensor:
# 0.660 vs 0.657 of llama.cpp's). Other devices run the full search.
CPU_SEARCH = {"second_code": False, "refit": False}


def _encode(x: torch.Tensor, w: torch.Tensor, sub: int, per_group: bool, backend: str = "auto"):
    """Search the codes of (n, 256) super-blocks with sub-blocks of ``sub`` weights
    (module docstring, steps 1-4; ``backend`` as :func:`nearest_points`).

    Returns (d, s, idx, neg, err): d (n,) float32 (float16 values), s (n, S) int64 scale
    codes, idx (n, S, G) int64 grid indices, neg (n, S, G) bool negative deltas, err (n,)
    float32 block error.
    """
    n = x.shape[0]
    S, G = QK_K // sub, sub // 8
    xg, wg = x.view(n, S, G, 8), w.view(n, S, G, 8)

    # 1. the best free scale of each sub-block
    kernel = lat.fast_path("iq1.sub_scales", x, backend) if backend != "native" else None
    if kernel is not None:
        best_t, best_h = kernel(x, w, device_constant(_RATIOS, torch.float32, x.device), sub, per_group, DELTA)
    else:
        best_t, best_h = sub_scales_torch(x, w, sub, per_group)

    # 2. super-block scale: model-ranked candidates, the best few scored exactly
    tmax = best_t.amax(1)
    m = device_constant(_DIVISORS, torch.float32, x.device)
    dc = tmax[:, None] / m  # (n, M)
    sc = torch.round((best_t[:, None, :] / dc.clamp_min(1e-30)[..., None] - 1) / 2).clamp(0, 7)
    model = (best_h[:, None, :] * (dc[..., None] * (2 * sc + 1) - best_t[:, None, :]) ** 2).sum(2)
    top = model.topk(min(_EXACT_D, m.numel()), dim=1, largest=False).indices
    best = None
    for j in range(top.shape[1]):
        d = _to_half(dc.gather(1, top[:, j : j + 1]).squeeze(1))
        s0 = sc.gather(1, top[:, j : j + 1, None].expand(n, 1, S)).squeeze(1).to(torch.int64)
        # each sub-block's nearest code and the next one on the other side of its free scale
        up = best_t >= d[:, None] * (2 * s0 + 1).to(torch.float32)
        st = torch.stack([s0, (s0 + torch.where(up, 1, -1)).clamp(0, 7)], 2)
        if x.device.type == "cpu" and not CPU_SEARCH["second_code"]:
            st = st[:, :, :1]
        cur = [d, *_codes_at(xg, wg, d, st, per_group, backend)]
        best = cur if best is None else _pick(best, cur)

    # 3. least-squares refit of d given the codes
    if x.device.type == "cpu" and not CPU_SEARCH["refit"]:
        return _finish(x, w, best)
    d, s, idx, neg, _ = best
    q = (2 * s + 1).to(torch.float32)[..., None, None] * _levels(idx, neg)
    num = (wg * xg * q).sum((1, 2, 3))
    den = (wg * q * q).sum((1, 2, 3)).clamp_min(1e-30)
    d = _to_half(num / den)
    best = _pick(best, [d, *_codes_at(xg, wg, d, s.unsqueeze(2), per_group, backend)])
    return _finish(x, w, best)


def _finish(x: torch.Tensor, w: torch.Tensor, best):
    """Step 4 of :func:`_encode`: the all-zero block where it is better than ``best``."""
    d, s, idx, neg, err = best
    err = err.sum(1)
    zero = (w * x * x).sum(1) <= err
    d = torch.where(zero, torch.zeros_like(d), d)
    return d, s, idx, neg, torch.where(zero, (w * x * x).sum(1), err)


def _encode_both(x: torch.Tensor, w: torch.Tensor, sub: int, per_group: bool, backend: str = "auto"):
    """:func:`_encode`, and where ``_NEGATIVE_D`` is set also on ``-x`` with ``d`` negated
    (the grid is not symmetric, so ``d < 0`` reaches the negated grid); the better per block."""
    d, s, idx, neg, err = _encode(x, w, sub, per_group, backend)
    if not _NEGATIVE_D:
        return d, s, idx, neg
    d2, s2, idx2, neg2, err2 = _encode(-x, w, sub, per_group, backend)
    b = err2 < err
    return (
        torch.where(b, -d2, d),
        torch.where(b[:, None], s2, s),
        torch.where(b[:, None, None], idx2, idx),
        torch.where(b[:, None, None], neg2, neg),
    )


def _pick(a, b):
    """Per super-block, the better of two [d, s, idx, neg, err] candidates (total error)."""
    take = b[4].sum(1) < a[4].sum(1)
    out = []
    for u, v in zip(a, b):
        k = take.view(-1, *([1] * (u.dim() - 1)))
        out.append(torch.where(k, v, u))
    return out


def _default_importance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w``, or llama.cpp's no-imatrix weighting ``x**2`` when ``w`` is constant (no imatrix).
    The choice is a ``torch.where`` on the device (no host sync)."""
    if not w.numel():
        return w
    x2 = x * x
    return torch.where((w == w.reshape(-1)[0]).all(), x2 + 1e-6 * x2.mean(1, keepdim=True) + 1e-30, w)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != QK_K:
        raise ValueError(f"expected (n_blocks, {QK_K}) weights, got {tuple(x.shape)}")
    if w.shape != x.shape:
        raise ValueError(f"importance shape {tuple(w.shape)} differs from weights {tuple(x.shape)}")


def _u16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(n, k) int64 holding uint16 values -> (n, 2 k) uint8, little-endian."""
    v = v.to(torch.int32)
    return torch.stack([v & 255, v >> 8], dim=2).reshape(v.shape[0], -1).to(torch.uint8)


def _bytes_u16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2 k) uint8 -> (n, k) int32 little-endian uint16 values."""
    b = b.to(torch.int32)
    return b[:, 0::2] | (b[:, 1::2] << 8)


def _u16_half(u: torch.Tensor) -> torch.Tensor:
    """int32 uint16 bit patterns -> float32 values of those float16s."""
    return torch.where(u >= 32768, u - 65536, u).to(torch.int16).view(torch.float16).to(torch.float32)


def _half_u16(d: torch.Tensor) -> torch.Tensor:
    """float32 (float16 values) -> int32 uint16 bit patterns."""
    return d.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF


@register
class IQ1_S(Codec):
    """IQ1_S (``block_iq1_s``): 50 bytes = fp16 ``d`` + ``qs[32]`` + ``qh[8]`` (uint16).

    ``encode_blocks(x, w)``: x, w (n_blocks, 256) float32 (w >= 0) -> (n_blocks, 50) uint8;
    ``decode_blocks``: (n_blocks, 50) uint8 -> (n_blocks, 256) float32. Sub-blocks of 32
    weights share a 3-bit scale and one delta sign; ``y = d (2 s + 1) (g + delta)``.
    Vector-quantised: no per-column rounding; :meth:`fit_params`, :meth:`round_to_grid` and
    :meth:`pack` raise ``NotImplementedError`` (the base class's), so GPTQ cannot use it.

    Raises:
        ValueError: blocks are not (n, 256), or the importance has another shape.
    """

    format_name = "IQ1_S"
    fast_paths = True

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, *, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """Encode (n, 256) blocks (class docstring); ``backend`` as :func:`nearest_points`,
        ``variant`` unused (one kernel)."""
        _check(x, w)
        x = x.to(torch.float32).contiguous()
        w = _default_importance(x, w.to(torch.float32))
        d, s, idx, neg = _encode_both(x, w, 32, per_group=False, backend=backend)
        n = x.shape[0]
        qs = (idx & 255).reshape(n, 32).to(torch.uint8)
        shifts = device_constant(_QH_SHIFTS, torch.int64, x.device)
        qh = ((idx >> 8) << shifts).sum(2) | (s << 12) | (neg[:, :, 0].to(torch.int64) << 15)
        return torch.cat([_u16_bytes(_half_u16(d)[:, None]), qs, _u16_bytes(qh)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        if b.dim() != 2 or b.shape[1] != 50:
            raise ValueError(f"expected (n_blocks, 50) bytes, got {tuple(b.shape)}")
        n = b.shape[0]
        d = _u16_half(_bytes_u16(b[:, 0:2]))  # (n, 1)
        qs = b[:, 2:34].to(torch.int64).view(n, 8, 4)
        qh = _bytes_u16(b[:, 34:50]).to(torch.int64)  # (n, 8)
        idx = qs | (((qh[:, :, None] >> device_constant(_QH_SHIFTS, torch.int64, b.device)) & 7) << 8)
        dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)  # (n, 8)
        delta = torch.where((qh & 0x8000) != 0, -DELTA, DELTA)
        y = dl[:, :, None, None] * (grid_values(b.device)[idx] + delta[:, :, None, None])
        return y.reshape(n, QK_K)


@register
class IQ1_M(Codec):
    """IQ1_M (``block_iq1_m``): 56 bytes = ``qs[32]`` + ``qh[16]`` + ``scales[8]`` (fp16 ``d`` in the top nibbles).

    ``encode_blocks(x, w)``: x, w (n_blocks, 256) float32 (w >= 0) -> (n_blocks, 56) uint8;
    ``decode_blocks``: (n_blocks, 56) uint8 -> (n_blocks, 256) float32. Sub-blocks of 16
    weights share a 3-bit scale; each group of 8 has its own delta sign.
    Vector-quantised: no per-column rounding; :meth:`fit_params`, :meth:`round_to_grid` and
    :meth:`pack` raise ``NotImplementedError`` (the base class's), so GPTQ cannot use it.

    Raises:
        ValueError: blocks are not (n, 256), or the importance has another shape.
    """

    format_name = "IQ1_M"
    fast_paths = True

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, *, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """Encode (n, 256) blocks (class docstring); ``backend`` as :func:`nearest_points`,
        ``variant`` unused (one kernel)."""
        _check(x, w)
        x = x.to(torch.float32).contiguous()
        w = _default_importance(x, w.to(torch.float32))
        d, s, idx, neg = _encode_both(x, w, 16, per_group=True, backend=backend)
        n = x.shape[0]
        qs = (idx & 255).reshape(n, 32).to(torch.uint8)
        nib = (idx >> 8) | (neg.to(torch.int64) << 3)  # (n, 16, 2)
        qh = (nib[:, :, 0] | (nib[:, :, 1] << 4)).to(torch.uint8)
        dbits = _half_u16(d).to(torch.int64)  # (n,)
        four = device_constant((0, 1, 2, 3), torch.int64, x.device)
        words = (s.view(n, 4, 4) << (3 * four)).sum(2) | (((dbits[:, None] >> (4 * four)) & 15) << 12)
        return torch.cat([qs, qh, _u16_bytes(words)], dim=1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        if b.dim() != 2 or b.shape[1] != 56:
            raise ValueError(f"expected (n_blocks, 56) bytes, got {tuple(b.shape)}")
        n = b.shape[0]
        qs = b[:, 0:32].to(torch.int64).view(n, 16, 2)
        qh = b[:, 32:48].to(torch.int64)
        sc = _bytes_u16(b[:, 48:56]).to(torch.int64)  # (n, 4)
        four = device_constant((0, 1, 2, 3), torch.int64, b.device)
        dbits = ((sc >> 12) << (4 * four)).sum(1)
        d = _u16_half(dbits.to(torch.int32))[:, None]  # (n, 1)
        s = ((sc[:, :, None] >> (3 * four)) & 7).reshape(n, 16)
        dl = d * (2 * s + 1).to(torch.float32)  # (n, 16)
        nib = torch.stack([qh & 15, qh >> 4], dim=2)  # (n, 16, 2)
        idx = qs | ((nib & 7) << 8)
        delta = torch.where((nib & 8) != 0, -DELTA, DELTA)
        y = dl[:, :, None, None] * (grid_values(b.device)[idx] + delta[..., None])
        return y.reshape(n, QK_K)
