"""Fuzzing plan.json and report.json (issue 13): mutated valid files end in a clean error or a correct result.

Seeds, made once per module from a tiny random Llama checkpoint: a report.json of its tensors (the layout
``dynaquant analyze`` writes; errors from a fixed formula, not measured, which a parser cannot tell) and the
dynamic plan ``make_dynamic_plan`` makes from it (budget, sources and predictions filled in).

Mutations (hypothesis, ``derandomize=True``: the same examples on every run): on the JSON tree, up to three of
drop a key or list item, replace a value (None, bools, ints up to 2**64 and beyond, -1, 1e308, NaN, +-Inf,
strings, lists, dicts) or duplicate a list item (a duplicated tensor entry); on the bytes, truncation or up to
four byte flips. Every example must end in a ``ValueError`` (``InputError``, ``PlanError``) whose message starts
with the file's path, or in a result that holds the properties a valid one has; any other exception fails.

Limits per example (:func:`_limits`): ``signal.alarm`` raises ``TimeoutError`` after 10 s (a hang), the
hypothesis deadline fails an example slower than 2 s, and the soft ``RLIMIT_AS`` is lowered to the process's
current address space + 1 GiB while the file is parsed (restored afterwards), so a huge allocation raises
``MemoryError`` instead of exhausting the machine; ``test_limits_hold`` checks both limits work.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import resource
import signal
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

CANDIDATES = ("Q4_0", "Q4_K", "Q8_0")
FIELDS = ("size_bytes", "bpw", "weighted_rel", "output_rel", "kld_pred")
SETTINGS = settings(max_examples=150, derandomize=True, deadline=2000, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def _limits(seconds: int = 10, extra_bytes: int = 1 << 30):
    """Run the body under a wall-clock alarm and an address-space cap (see the module docstring)."""

    def timeout(*_):
        raise TimeoutError(f"example ran over {seconds} s")

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + extra_bytes if hard == resource.RLIM_INFINITY else min(vm + extra_bytes, hard)
    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_limits_hold():
    with pytest.raises(MemoryError), _limits():
        bytearray(4 << 30)
    with pytest.raises(TimeoutError), _limits(seconds=1):
        time.sleep(5)
    bytearray(64 << 20)  # restored


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """(folder, report dict, plan dict, the model's TensorInfo list)."""
    from test_gguf_export import _tiny_checkpoint

    from dynaquant import make_dynamic_plan
    from dynaquant.pipeline.source import model_info, tensor_infos
    from dynaquant.quant.formats import get_format
    from dynaquant.sources.open import open_hf_source

    root = tmp_path_factory.mktemp("fuzz")
    _tiny_checkpoint(root / "ckpt", "llama", hidden_size=256, intermediate_size=512)
    ts = open_hf_source(root / "ckpt")
    tensors, info = tensor_infos(ts), model_info(ts)
    rows = []
    for t in tensors:
        errors = {}
        for c in CANDIDATES if t.quantizable else ():
            f = get_format(c)
            if f.fits(t.row_size):
                rel = 2.0 ** (-2 * f.bpw)
                errors[c] = {"size_bytes": t.n_elements // t.row_size * f.row_bytes(t.row_size), "bpw": f.bpw,
                             "weighted_rel": rel, "output_rel": math.sqrt(rel), "kld_pred": t.n_elements * rel / 1e4}
        rows.append({"name": t.name, "hf_name": t.hf_name, "shape": list(t.shape), "n_elements": t.n_elements,
                     "layer": t.layer, "quantizable": t.quantizable, "super_weight": False, "errors": errors})
    report = {"version": 1, "model": {"id": "tiny", "revision": None, "arch": ts.arch, "n_layers": info.n_layers,
                                      "tied_embeddings": info.tied_embeddings, "n_head": info.n_head,
                                      "n_head_kv": info.n_head_kv, "n_expert": 0, "expert_format": None,
                                      "gguf_overhead_bytes": 8192},
              "candidates": list(CANDIDATES), "tensors": rows, "activations": [], "super_weights": [],
              "sensitivity": [{"group": "blk.0.ffn", "layer": 0, "kind": "ffn", "format": "Q4_0", "kld": 0.01,
                               "kld_pred": 0.02}], "plans": [], "timings_s": {}}
    (root / "report.json").write_text(json.dumps(report))
    plan = make_dynamic_plan(root / "report.json", bpw=7.0).to_dict()
    assert plan["budget"] == {"bpw": 7.0} and plan["sources"]["report"] and plan["kld_pred"] > 0
    return root, report, plan, tensors


SPECIAL = [None, True, False, 0, -1, 1, 3, 2**31, 2**64, 10**30, -0.5, 1e308, -1e308, float("nan"), float("inf"),
           float("-inf"), "", "x", "Q4_K", "gguf", [], {}, [1, 2], [256, 512], {"bpw": 4}, [[1]]]
VALUES = st.one_of(st.sampled_from(SPECIAL), st.integers(), st.floats(), st.text(max_size=8))


def _paths(obj, prefix=()):
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


def _mutated(draw, seed: dict):
    d = copy.deepcopy(seed)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(d))[1:]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        op = draw(st.sampled_from(["drop", "replace", "replace", "duplicate"]))
        if op == "drop":
            del parent[key]
        elif op == "replace":
            parent[key] = draw(VALUES)
        elif isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        else:
            parent[key] = [parent[key], copy.deepcopy(parent[key])]
    return d


def _file_bytes(data, seed: dict) -> bytes:
    """A mutated seed as JSON (NaN/Infinity written as Python's json writes them), or corrupted bytes."""
    kind = data.draw(st.sampled_from(["tree", "tree", "truncate", "flip"]))
    if kind == "tree":
        return json.dumps(_mutated(data.draw, seed), indent=1).encode()
    raw = json.dumps(seed, indent=1).encode()
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    b = bytearray(raw)
    for i, x in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), min_size=1, max_size=4)):
        b[i] ^= x
    return bytes(b)


@SETTINGS
@given(data=st.data())
def test_fuzz_plan_json(seeds, data):
    from dynaquant.pipeline.plan import load_plan as _load_plan
    from dynaquant.quant.plan import Plan

    root, _, seed, tensors = seeds
    path = root / "plan.json"
    path.write_bytes(_file_bytes(data, seed))
    try:
        with _limits():
            plan = _load_plan(path)
            plan.check_tensors(tensors, str(path))
    except ValueError as e:
        assert str(e).startswith(f"{path}: "), repr(e)
        event(f"refused: {type(e).__name__}")
        return
    event("accepted")
    # a correct plan: one finite format per model tensor, within its own budget, round-tripping
    assert sorted(e.name for e in plan.entries) == sorted(t.name for t in tensors)
    assert math.isfinite(plan.bpw) and plan.size_bytes > 0
    if "bpw" in plan.budget:
        assert plan.bpw <= plan.budget["bpw"]
    assert all(e.kld_pred is None or (math.isfinite(e.kld_pred) and e.kld_pred >= 0) for e in plan.entries)
    d = plan.to_dict()
    assert Plan.from_dict(json.loads(json.dumps(d)), "again").to_dict() == d


@SETTINGS
@given(data=st.data())
def test_fuzz_report_json(seeds, data):
    from dynaquant import make_dynamic_plan
    from dynaquant.analysis.report.schema import load_report
    from dynaquant.quant.planner import BudgetError

    root, seed, _, _ = seeds
    path = root / "report.json"
    path.write_bytes(_file_bytes(data, seed))
    try:
        with _limits():
            rep = load_report(path)
    except ValueError as e:
        assert str(e).startswith(f"{path}: "), repr(e)
        event(f"refused: {type(e).__name__}")
        return
    for t in rep["tensors"]:  # what the planner will read: every measured error finite and >= 0
        for e in (t.get("errors") or {}).values():
            assert all(e.get(k) is None or (math.isfinite(e[k]) and e[k] >= 0) for k in FIELDS)
    try:
        with _limits():
            plan = make_dynamic_plan(rep, bpw=7.0)
    except BudgetError:
        event("loaded; budget refused")
        return  # a well-formed report whose fixed choices exceed 7 bpw
    except ValueError as e:  # the report names no file here (a dict); its refusals are ValueErrors all the same
        assert str(e), repr(e)
        event("loaded; planner refused")
        return
    event("loaded and planned")
    assert plan.bpw <= 7.0 and (plan.kld_pred is None or (math.isfinite(plan.kld_pred) and plan.kld_pred >= 0))
