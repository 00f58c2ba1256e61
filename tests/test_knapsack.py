"""The exact allocation solver (``quant.knapsack``) and its use by the planner: optima checked by enumeration."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import numpy as np
import pytest

from dynaquant.quant import knapsack
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan, PlanError, TensorInfo
from dynaquant.quant.planner import GGUF_CANDIDATES, make_plan
from dynaquant.quant.presets import ModelInfo


def _enumerate(items) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and error of every combination of one option per item (numpy, in itertools.product order)."""
    b, e = np.zeros(1, dtype=np.int64), np.zeros(1)
    for opts in items:
        b = (b[:, None] + np.array([o[0] for o in opts])[None, :]).ravel()
        e = (e[:, None] + np.array([o[1] for o in opts])[None, :]).ravel()
    return b, e


def _frontier_budgets(b: np.ndarray, e: np.ndarray) -> list[int]:
    """The budgets where the optimum changes (the byte counts of the Pareto frontier) and one byte below each."""
    order = np.lexsort((e, b))
    best = np.minimum.accumulate(e[order])
    keep = np.r_[True, e[order][1:] < best[:-1]]
    edges = sorted(set(b[order][keep].tolist()))
    return sorted({x for v in edges for x in (v - 1, v)} | {int(b.max())})


def _instance(seed: int):
    """6 to 8 items of 3 to 5 options: random bytes, errors that are often non-convex (or not even decreasing)."""
    rng = random.Random(seed)
    items = []
    for _ in range(rng.randint(6, 8)):
        items.append([(rng.randint(1, 60), round(rng.uniform(0, 20), 3), f"o{k}") for k in range(rng.randint(3, 5))])
    return items


@pytest.mark.parametrize("seed", range(24))
def test_solver_finds_the_enumerated_optimum_at_every_interesting_budget(seed):
    items = _instance(seed)
    b, e = _enumerate(items)
    for limit in _frontier_budgets(b, e):
        if limit < b.min():
            with pytest.raises(ValueError, match="above the limit"):
                knapsack.solve(items, limit)
            continue
        best = float(e[b <= limit].min())
        r = knapsack.solve(items, limit)
        got_b = sum(items[i][j][0] for i, j in enumerate(r.choice))
        got_e = sum(items[i][j][1] for i, j in enumerate(r.choice))
        assert r.exact and got_b == r.bytes <= limit, (seed, limit, r)
        assert got_e == pytest.approx(r.error, abs=1e-9) and r.error == pytest.approx(best, abs=1e-9), (seed, limit)
        assert knapsack.lower_bound(items, limit) <= best + 1e-9
        assert r.bound == pytest.approx(best, abs=1e-9) and r.gap == 0 and r.gap_rel == 0


def _tied_embedding_case():
    """A big item (a tied embedding: one step 17.5x a small one, the largest error cut but a lower cut per byte)
    and ten small items; the budget fits the big step and two small ones, or all ten small ones."""
    small = [[(0, 10.0, "Q4_0"), (8192, 6.0, "Q8_0")] for _ in range(10)]
    big = [(0, 100.0, "Q4_0"), (143360, 50.0, "Q8_0")]
    return [big] + small, 143360 + 2 * 8192


def test_greedy_failure_case_is_solved_exactly():
    items, limit = _tied_embedding_case()
    b, e = _enumerate(items)
    best = float(e[b <= limit].min())
    r = knapsack.solve(items, limit)
    assert r.exact and r.error == pytest.approx(best) == 50 + 2 * 6 + 8 * 10 and r.choice[0] == 1
    assert r.bound <= best and r.bytes <= limit


def test_planner_exact_beats_greedy_on_the_tied_embedding_case():
    """The same instance through make_plan: Q4_0 -> Q8_0 is 4 bits per weight more (0.5 byte per element)."""
    ts = [TensorInfo("token_embd.weight", None, (1120, 256))]
    ts += [TensorInfo(f"blk.{i}.attn_q.weight", None, (64, 256)) for i in range(10)]
    cut = {"token_embd.weight": (100.0, 50.0)}

    def error_fn(t, fmt):
        lo, hi = cut.get(t.name, (10.0, 6.0))
        return {"Q4_0": lo, "Q8_0": hi}[fmt]

    def nbytes(t, fmt):
        return t.n_elements // t.row_size * get_format(fmt).row_bytes(t.row_size)

    base = sum(nbytes(t, "Q4_0") for t in ts)
    items = [[(nbytes(t, f), error_fn(t, f), f) for f in ("Q4_0", "Q8_0")] for t in ts]
    size = base + 143360 + 2 * 8192
    b, e = _enumerate(items)
    best = float(e[b <= size].min())
    args = dict(size_bytes=size, error_fn=error_fn, candidates=("Q4_0", "Q8_0"), error_source="toy")
    greedy = make_plan(ts, ModelInfo(n_layers=10, tied_embeddings=True), solver="greedy", **args)
    exact = make_plan(ts, ModelInfo(n_layers=10, tied_embeddings=True), **args)
    assert greedy.kld_pred == pytest.approx(160.0) and best == pytest.approx(142.0)
    assert exact.kld_pred == pytest.approx(best) and exact.size_bytes <= size
    assert exact.formats()["token_embd.weight"] == "Q8_0" and greedy.formats()["token_embd.weight"] == "Q4_0"
    assert exact.solver["method"] == "exact" and exact.solver["exact"] and exact.solver["gap"] == 0
    assert exact.solver["predicted"] == pytest.approx(best) and exact.method.endswith(", exact (gap 0.00%)")
    assert greedy.solver["method"] == "greedy" and not greedy.solver["exact"]
    assert greedy.solver["bound"] <= best and greedy.solver["gap_rel"] == pytest.approx((160 - greedy.solver["bound"]) / 160,
                                                                                        rel=1e-3)
    assert all(e.reason.startswith("allocation: ") and "by toy" in e.reason for e in exact.entries)
    assert all("upgrade(s) from Q4_0 by toy" in e.reason for e in greedy.entries)


def _realistic(seed: int, n_items: int = 272):
    """Items like a model's tensors: error ~ n * 2^(-2 bpw) * weight * noise over the 21 GGUF candidates."""
    rng = np.random.default_rng(seed)
    bpws = [get_format(f).bpw for f in GGUF_CANDIDATES]
    shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
    items = []
    for i in range(n_items):
        n = int(np.prod(shapes[i % 4])) * (80 if i == 0 else 1)
        w = rng.lognormal(0, 1)
        items.append([(int(n * b / 8), float(n * w * 2 ** (-2 * b) * rng.lognormal(0, 0.3)), f)
                      for b, f in zip(bpws, GGUF_CANDIDATES)])
    return items


def test_realistic_instance_is_solved_to_within_the_target_gap():
    items = _realistic(3)
    least = sum(min(o[0] for o in opts) for opts in items)
    for frac in (1.05, 1.7, 2.2):
        r = knapsack.solve(items, int(least * frac))
        assert r.exact or r.gap_rel <= 1e-3, (frac, r)
        assert r.bytes <= int(least * frac) and r.bound <= r.error
        assert r.error <= knapsack.solve(items[:], int(least * frac), max_states=1).error


def test_state_cap_returns_a_feasible_choice_and_an_honest_gap():
    items = _realistic(1, 120)
    limit = int(sum(min(o[0] for o in opts) for opts in items) * 1.7)
    full = knapsack.solve(items, limit)
    assert full.exact and full.states > 10
    capped = knapsack.solve(items, limit, max_states=2)
    assert not capped.exact and "state cap 2" in capped.method
    assert capped.bytes <= limit and capped.gap >= 0 and capped.gap_rel >= 0
    assert capped.bound <= full.error + 1e-9 <= capped.error + 2e-9
    assert capped.gap == pytest.approx(capped.error - capped.bound)


def test_solver_is_deterministic_and_prefers_earlier_options_on_ties():
    items = _realistic(2, 60)
    limit = int(sum(min(o[0] for o in opts) for opts in items) * 2)
    a, b = knapsack.solve(items, limit), knapsack.solve(items, limit)
    assert dataclasses.replace(a, time_s=0) == dataclasses.replace(b, time_s=0)
    twins = [[(1, 5.0, "a"), (1, 5.0, "b"), (3, 1.0, "c")], [(1, 5.0, "a"), (3, 1.0, "b"), (3, 1.0, "c")]]
    assert knapsack.solve(twins, 4).choice in ([0, 1], [2, 0])
    assert knapsack.solve(twins, 4).choice == knapsack.solve(twins, 4).choice
    assert knapsack.nondominated(twins[0]) == [0, 2] and knapsack.nondominated(twins[1]) == [0, 1]
    with pytest.raises(ValueError, match="no option with a finite error"):
        knapsack.solve([[(1, float("inf"), "x")]], 5)


def test_plan_solver_round_trips_and_plans_stay_deterministic():
    ts = [TensorInfo(f"blk.{i}.ffn_down.weight", None, (64 + 32 * i, 256)) for i in range(6)]
    m = ModelInfo(n_layers=6)

    def error_fn(t, fmt):
        return t.n_elements * (1 + t.layer % 3) * 2.0 ** (-2 * get_format(fmt).bpw)

    plan = make_plan(ts, m, bpw=4.0, error_fn=error_fn)
    assert plan.solver["method"] == "exact" and "time_s" in plan.solver
    d = json.loads(json.dumps(plan.to_dict()))
    assert "time_s" not in d["solver"] and d == make_plan(ts, m, bpw=4.0, error_fn=error_fn).to_dict()  # same bytes
    back = Plan.from_dict(d)
    assert back.solver == d["solver"] and back.to_dict() == d
    assert plan.solver["bound"] <= plan.solver["predicted"] == pytest.approx(plan.kld_pred, rel=1e-7)
    assert "solver" not in make_plan(ts, m, preset="Q4_K_M").to_dict()
    for bad in ({"method": "magic"}, {"method": "exact", "gap": "x"}, {"method": "exact", "exact": 1}, []):
        with pytest.raises(PlanError, match="p.json: .*solver"):
            Plan.from_dict(d | {"solver": bad}, "p.json")
    with pytest.raises(ValueError, match="unknown solver"):
        make_plan(ts, m, bpw=4.0, error_fn=error_fn, solver="magic")


def test_exact_is_never_worse_than_greedy_on_small_planner_problems():
    """make_plan with every candidate (hull and non-hull options): exact <= greedy, and = the enumerated optimum."""
    ts = [TensorInfo(f"blk.{i}.attn_q.weight", None, (32, 256)) for i in range(4)]
    cands = ("Q2_K", "Q3_K", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
    rng = random.Random(7)
    noise = {(t.name, f): rng.uniform(0.3, 3.0) for t in ts for f in cands}

    def error_fn(t, fmt):
        return noise[t.name, fmt] * 2.0 ** (-2 * get_format(fmt).bpw)

    def nbytes(t, fmt):
        return t.n_elements // t.row_size * get_format(fmt).row_bytes(t.row_size)

    m = ModelInfo(n_layers=4)
    for bpw in (3.0, 3.6, 4.4, 5.2, 6.0):
        limit = int(bpw * sum(t.n_elements for t in ts) / 8)
        best = min(sum(error_fn(t, f) for t, f in zip(ts, combo)) for combo in itertools.product(cands, repeat=len(ts))
                   if sum(nbytes(t, f) for t, f in zip(ts, combo)) <= limit)
        args = dict(bpw=bpw, error_fn=error_fn, candidates=cands)
        exact, greedy = make_plan(ts, m, **args), make_plan(ts, m, solver="greedy", **args)
        assert exact.kld_pred == pytest.approx(best, rel=1e-12) and best <= greedy.kld_pred * (1 + 1e-12)
        assert exact.solver["exact"] and exact.size_bytes <= limit


def test_plan_cli_solver_option(tmp_path, capsys):
    """``dynaquant plan --solver`` on a synthetic report (no model): the plan records the solver it was made with."""
    from dynaquant.cli import main

    cands = ("Q2_K", "Q4_K", "Q6_K", "Q8_0")
    rows = []
    for i in range(4):
        shape = [64 * (i + 1), 256]
        n = shape[0] * shape[1]
        errors = {c: {"size_bytes": n // 256 * get_format(c).row_bytes(256), "bpw": get_format(c).bpw,
                      "kld_pred": n * (i + 1) * 2.0 ** (-2 * get_format(c).bpw)} for c in cands}
        rows.append({"name": f"blk.{i}.attn_q.weight", "hf_name": None, "shape": shape, "n_elements": n, "layer": i,
                     "quantizable": True, "super_weight": False, "errors": errors})
    report = {"version": 1, "model": {"id": "toy", "arch": "llama", "n_layers": 4, "tied_embeddings": False, "n_head": 4,
                                      "n_head_kv": 4, "n_expert": 0, "gguf_overhead_bytes": 4096},
              "candidates": list(cands), "tensors": rows}
    (tmp_path / "report.json").write_text(json.dumps(report))
    for solver in ("greedy", "exact"):
        out = tmp_path / f"{solver}.json"
        assert main(["plan", str(tmp_path / "report.json"), "--bpw", "4.4", "--no-default-rules", "--solver", solver,
                     "-o", str(out)]) == 0
        d = json.loads(out.read_text())
        assert d["solver"]["method"] == solver and d["method"].startswith(f"allocation bpw<=4.4, {solver} (gap ")
        assert f"{solver} (gap" in capsys.readouterr().out
    exact, greedy = (json.loads((tmp_path / f"{s}.json").read_text())["kld_pred"] for s in ("exact", "greedy"))
    assert exact <= greedy * (1 + 1e-12)
