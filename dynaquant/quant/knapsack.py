"""An exact multiple-choice knapsack solver: one option per item, a byte limit, the summed error minimised.

The planner's allocation is this problem (an item is a tensor or a tie group, an option one of its formats with
its bytes and predicted error). Pure Python and numpy; deterministic (ties broken by item order, then option order).

Method (Lagrangian relaxation, then reduced-cost fixing and a dynamic program; see e.g. Pisinger, "A minimal
algorithm for the multiple-choice knapsack problem", EJOR 1995, and Nemhauser & Wolsey, ch. II.3):

(a) Dominated options are removed per item: an option with at least the bytes of another and no lower error.
    Every non-dominated option is kept (not only the convex hull): a non-hull option may be what fits.
(b) Lagrangian relaxation with a price ``lam`` per byte: each item picks ``argmin e + lam * b``, and
    ``g(lam) = sum_i min_j (e_ij + lam * b_ij) - lam * limit`` is a lower bound of the optimum for every
    ``lam >= 0``. ``g`` is concave and piecewise linear; its breakpoints are the slopes of the items' lower convex
    hulls. Sorting all hull steps by slope (the error reduction per extra byte) and taking them in that order until
    the next one does not fit gives the maximising ``lam*`` (the slope of that step) exactly, with no float
    bisection: ``L = g(lam*)`` (the LP relaxation's value). The incumbent: the hull steps in that order that fit
    (the greedy allocator), then the best-ratio single upgrades to any option, hull or not, that fit the leftover.
(c) Exact completion by reduced-cost fixing. With ``rc_ij = e_ij + lam* b_ij - min_j (e_ij + lam* b_ij) >= 0``,
    every feasible x has ``E(x) = L + sum rc(x) + lam* (limit - B(x)) >= L + sum rc(x)``; so a solution better
    than the incumbent U has ``sum rc(x) < gap = U - L``. Options with ``rc >= gap`` are dropped, items left with
    one option are fixed, and the others are solved by a dynamic program over partial states ``(bytes, error)``,
    item by item. A state is kept only if it is feasible (its bytes plus the remaining items' cheapest fit the
    limit), its reduced cost is below the gap, and no other state has fewer or equal bytes and lower or equal
    error (Pareto dominance; see ``_pareto``). When the DP completes, its best state or the incumbent is optimal
    (``exact``: the bound is raised to it and the gap is 0). A cap on the states of one step (``max_states``)
    keeps the lowest-reduced-cost states when exceeded; the result is then the best found, ``exact`` False, with
    the honest gap ``U - L``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

Option = tuple[int, float, Hashable]  # (bytes, error, label)

MAX_STATES = 200_000
_REL_TOL = 1e-12  # relative float slack on the error sums (a gap this small is no gap)


@dataclass
class KnapsackResult:
    """The solver's answer.

    Attributes:
        choice: per item, the index of the chosen option in the item's given list.
        bytes: summed bytes of the choice (int, <= the limit).
        error: summed error of the choice (float).
        bound: a lower bound of the optimum (the optimum itself when ``exact``).
        gap: ``error - bound`` (>= 0); gap_rel: ``gap / error`` (0 when the error is 0).
        exact: the choice is proved optimal.
        method: how it was found (``"lagrangian"``: the relaxation's incumbent was optimal;
            ``"lagrangian+dp"``; ``"lagrangian+dp (state cap N reached)"``).
        states: partial states the dynamic program kept, summed over its steps.
        time_s: wall time of the solve (seconds).
    """

    choice: list[int]
    bytes: int
    error: float
    bound: float
    gap: float
    gap_rel: float
    exact: bool
    method: str
    states: int
    time_s: float


def nondominated(options: Sequence[Option]) -> list[int]:
    """Indices of the options no other option dominates (fewer or equal bytes and lower or equal error; among
    equal options the first), in increasing bytes (and decreasing error). Non-finite errors are left out."""
    order = sorted((b, e, j) for j, (b, e, _) in enumerate(options) if np.isfinite(e))
    out: list[int] = []
    for _, e, j in order:
        if out and e >= options[out[-1]][1]:
            continue
        out.append(j)
    return out


def hull(options: Sequence[Option], keep: Sequence[int]) -> list[int]:
    """The lower convex hull of ``options[keep]`` (``keep`` non-dominated, by increasing bytes): the error reduction
    per extra byte strictly decreases along it. Collinear middle points are dropped."""
    h: list[int] = []
    for j in keep:
        b, e = options[j][0], options[j][1]
        while len(h) >= 2:
            (b0, e0), (b1, e1) = options[h[-2]][:2], options[h[-1]][:2]
            if (e0 - e1) * (b - b1) > (e1 - e) * (b1 - b0):
                break
            h.pop()
        h.append(j)
    return h


def _pareto(bytes_: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated states, by increasing bytes: for the objective ``sum e`` under ``sum b <= limit``
    a state with fewer or equal bytes and lower or equal error is at least as good after any completion (the same
    options add the same bytes and error, and it stays within the limit), so only strictly better errors at more
    bytes are kept. (Dominance on ``rc - lam* b`` would be wrong: it trades bytes against error at the price lam*,
    but the limit makes bytes worth nothing below it and everything above it.) Stable: among equal states the first."""
    order = np.lexsort((err, bytes_))
    e = err[order]
    best = np.minimum.accumulate(e)
    keep = np.ones(len(e), dtype=bool)
    keep[1:] = e[1:] < best[:-1]
    return order[keep]


def solve(items: Sequence[Sequence[Option]], limit: int, max_states: int = MAX_STATES) -> KnapsackResult:
    """Choose one option per item minimising the summed error with summed bytes <= ``limit``.

    Args:
        items: per item, its options ``(bytes: int >= 0, error: float, label)``; options with a non-finite error
            are never chosen (each item needs one with a finite error).
        limit: the byte limit (int).
        max_states: the dynamic program's cap on states per step (module docstring, (c)); the DP keeps 8 bytes per
            state for the backtracking, at most ``8 * max_states`` bytes per item.
    Returns:
        KnapsackResult (``choice`` indexes each item's given list).
    Raises:
        ValueError: an item without a finite-error option, or the cheapest options exceed ``limit``.
    """
    t0 = time.perf_counter()
    keep = [nondominated(opts) for opts in items]
    for i, k in enumerate(keep):
        if not k:
            raise ValueError(f"knapsack item {i} has no option with a finite error")
    least = sum(items[i][k[0]][0] for i, k in enumerate(keep))
    if least > limit:
        raise ValueError(f"knapsack: the cheapest options need {least} bytes, above the limit {limit}")
    lam, choice = _relaxation(items, keep, limit)
    choice = _fill(items, keep, choice, limit)
    err = _error(items, choice)
    bound = _dual(items, keep, lam, limit)
    states, method, exact = 0, "lagrangian", False
    if err - bound <= _REL_TOL * max(abs(err), abs(bound)):
        exact = True
    else:
        found, states, capped = _complete(items, keep, lam, limit, err, bound, max_states)
        if found is not None and _error(items, found) < err:
            choice, err = found, _error(items, found)
        method, exact = "lagrangian+dp" + (f" (state cap {max_states} reached)" if capped else ""), not capped
    if exact:
        bound = err
    used = sum(items[i][j][0] for i, j in enumerate(choice))
    gap = max(err - bound, 0.0)
    return KnapsackResult(choice, used, err, bound, gap, gap / err if err > 0 else 0.0, exact, method, states,
                          time.perf_counter() - t0)


def lower_bound(items: Sequence[Sequence[Option]], limit: int) -> float:
    """The Lagrangian (LP) lower bound ``L`` of the optimum (module docstring, (b)); -inf when no option of some item
    has a finite error."""
    keep = [nondominated(opts) for opts in items]
    if not all(keep):
        return -np.inf
    return _dual(items, keep, _relaxation(items, keep, limit)[0], limit)


def _error(items, choice) -> float:
    return float(sum(items[i][j][1] for i, j in enumerate(choice)))


def _relaxation(items, keep, limit) -> tuple[float, list[int]]:
    """(lam*, the greedy choice along the hull steps sorted by slope: those that fit, skipping the rest)."""
    return hull_greedy(items, [hull(opts, k) for opts, k in zip(items, keep)], limit)


def hull_greedy(items: Sequence[Sequence[Option]], hulls: Sequence[Sequence[int]], limit: int) -> tuple[float, list[int]]:
    """The greedy allocation along the items' hulls (module docstring, (b)): every item starts at its hull's first
    option; the hull steps are taken in decreasing error reduction per extra byte (ties: item order, then step order),
    each that fits; an item whose step does not fit takes no later step.

    Args:
        items: per item, its options; hulls: per item, indices into its options along its lower convex hull
            (:func:`hull`), by increasing bytes.
        limit: the byte limit (>= the hulls' first options' bytes summed).
    Returns:
        (lam*: the slope of the first step that did not fit, 0 when every step fit; per item the chosen option index).
    """
    steps = []  # (-slope, item, step): ties by item order, then step order
    for i, h in enumerate(hulls):
        for s in range(len(h) - 1):
            (b0, e0), (b1, e1) = items[i][h[s]][:2], items[i][h[s + 1]][:2]
            steps.append((-(e0 - e1) / (b1 - b0), i, s))
    steps.sort()
    level = [0] * len(items)
    used = sum(items[i][h[0]][0] for i, h in enumerate(hulls))
    lam = None
    for neg, i, s in steps:
        if level[i] != s:
            continue  # an earlier step of this item did not fit
        db = items[i][hulls[i][s + 1]][0] - items[i][hulls[i][s]][0]
        if used + db > limit:
            lam = -neg if lam is None else lam  # the first step that does not fit prices a byte
            continue
        used += db
        level[i] = s + 1
    return (0.0 if lam is None else lam), [h[lv] for h, lv in zip(hulls, level)]


def _dual(items, keep, lam, limit) -> float:
    return float(sum(min(items[i][j][1] + lam * items[i][j][0] for j in k) for i, k in enumerate(keep)) - lam * limit)


def _fill(items, keep, choice, limit) -> list[int]:
    """Spend the leftover bytes: repeatedly the single upgrade (to any non-dominated option) with the largest error
    reduction per extra byte that fits, until none does."""
    choice = list(choice)
    used = sum(items[i][j][0] for i, j in enumerate(choice))
    while True:
        best = None
        for i, k in enumerate(keep):
            b0, e0 = items[i][choice[i]][:2]
            for j in k:
                b, e = items[i][j][:2]
                if b > b0 and e < e0 and used + b - b0 <= limit:
                    r = (e0 - e) / (b - b0)
                    if best is None or r > best[0]:
                        best = (r, i, j)
        if best is None:
            return choice
        _, i, j = best
        used += items[i][j][0] - items[i][choice[i]][0]
        choice[i] = j


def _complete(items, keep, lam, limit, upper, bound, max_states):
    """Module docstring (c): (the best choice the DP found or None, states kept, whether the cap was reached)."""
    slack = _REL_TOL * max(abs(upper), abs(bound)) + 1e-300
    gap = upper - bound + slack
    opts = []  # per item: the option indices left, their bytes and errors
    for i, k in enumerate(keep):
        b = np.array([items[i][j][0] for j in k], dtype=np.int64)
        e = np.array([items[i][j][1] for j in k], dtype=np.float64)
        rc = e + lam * b
        rc -= rc.min()
        left = np.flatnonzero(rc < gap)
        opts.append((np.array(k)[left], b[left], e[left], float((e + lam * b).min())))
    fixed_b = sum(int(b[0]) for _, b, _, _ in (o for o in opts if len(o[0]) == 1))
    fixed_e = sum(float(e[0]) for _, _, e, _ in (o for o in opts if len(o[0]) == 1))
    fixed_m = sum(m for j, _, _, m in opts if len(j) == 1)
    free = [i for i, o in enumerate(opts) if len(o[0]) > 1]
    rest_min = np.cumsum([0] + [int(opts[i][1].min()) for i in reversed(free)])[::-1]  # cheapest bytes of free[n:]
    sb = np.array([fixed_b], dtype=np.int64)
    se = np.array([fixed_e], dtype=np.float64)
    done_m = fixed_m + 0.0
    if fixed_b + rest_min[0] > limit:
        return None, 0, False
    parents: list[tuple[np.ndarray, np.ndarray]] = []
    states, capped = 0, False
    for n, i in enumerate(free):
        idx, b, e, m = opts[i]
        nb = (sb[None, :] + b[:, None]).ravel()
        ne = (se[None, :] + e[:, None]).ravel()
        par = np.tile(np.arange(len(sb)), len(b))
        opt = np.repeat(np.arange(len(b)), len(sb))
        done_m += m
        # feasible with the rest at their cheapest; reduced cost so far below the gap (the rest adds rc >= 0)
        ok = (nb + rest_min[n + 1] <= limit) & (ne + lam * nb - done_m < gap)
        sel = np.flatnonzero(ok)
        sel = sel[_pareto(nb[sel], ne[sel])]
        if len(sel) > max_states:
            capped = True
            rc = ne[sel] + lam * nb[sel]
            sel = sel[np.sort(np.argsort(rc, kind="stable")[:max_states])]
        if len(sel) == 0:
            return None, states, capped
        sb, se = nb[sel], ne[sel]
        parents.append((par[sel].astype(np.int32), idx[opt[sel]].astype(np.int32)))  # <= 8 bytes a state kept
        states += len(sel)
    best = int(np.lexsort((sb, se))[0])
    choice = [int(o[0][0]) for o in opts]
    s = best
    for n in range(len(free) - 1, -1, -1):
        par, j = parents[n]
        choice[free[n]] = int(j[s])
        s = int(par[s])
    return choice, states, capped
