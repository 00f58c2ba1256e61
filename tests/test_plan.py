"""Plans: presets mirror llama.cpp's mixes, rules, fallbacks, budgets, JSON validation."""

from __future__ import annotations

import json

import pytest

from dynaquant.quant.formats import FORMATS, get_format, resolve_for_row
from dynaquant.quant.plan import Plan, TensorInfo
from dynaquant.quant.planner import BudgetError, make_plan
from dynaquant.quant.presets import ModelInfo
from dynaquant.quant.rules import Rule

N_LAYERS = 30
SMOL = ModelInfo(n_layers=N_LAYERS, n_head=9, n_head_kv=3, tied_embeddings=True)


def smollm2_tensors() -> list[TensorInfo]:
    """SmolLM2-135M's tensor table (GGUF names, torch-order shapes), tied embedding."""
    ts = [TensorInfo("token_embd.weight", None, (49152, 576))]
    for i in range(N_LAYERS):
        b = f"blk.{i}."
        ts += [
            TensorInfo(b + "attn_norm.weight", None, (576,), False),
            TensorInfo(b + "ffn_down.weight", None, (576, 1536)),
            TensorInfo(b + "ffn_gate.weight", None, (1536, 576)),
            TensorInfo(b + "ffn_up.weight", None, (1536, 576)),
            TensorInfo(b + "ffn_norm.weight", None, (576,), False),
            TensorInfo(b + "attn_k.weight", None, (192, 576)),
            TensorInfo(b + "attn_output.weight", None, (576, 576)),
            TensorInfo(b + "attn_q.weight", None, (576, 576)),
            TensorInfo(b + "attn_v.weight", None, (192, 576)),
        ]
    return ts + [TensorInfo("output_norm.weight", None, (576,), False)]


def test_bpw_is_derived_from_the_row():
    assert get_format("Q4_K").bpw == 4.5
    assert get_format("Q8_0").bpw == 8.5
    assert get_format("q6_k").bpw == 6.5625
    with pytest.raises(KeyError, match="unknown format"):
        get_format("Q4_Z")


def test_fallbacks_follow_llama_cpp():
    assert resolve_for_row("Q4_K", 576)[0].name == "Q5_0"
    assert resolve_for_row("Q5_K", 576)[0].name == "Q5_1"
    assert resolve_for_row("Q6_K", 576)[0].name == "Q8_0"
    assert resolve_for_row("Q3_K", 576)[0].name == "Q4_0"
    assert resolve_for_row("Q2_K", 576)[0].name == "Q4_0"
    assert resolve_for_row("Q4_K", 1536) == (FORMATS["Q4_K"], None)
    fmt, why = resolve_for_row("Q4_0", 48)
    assert fmt.name == "F16" and "Q4_0->F16" in why


IQ_256 = ("IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")


def test_iquant_fallbacks_and_sizes_follow_llama_cpp():
    # tensor_type_fallback: every 256-block i-quant -> IQ4_NL; rows not a multiple of 32 -> F16
    for f in IQ_256:
        assert resolve_for_row(f, 576) == (FORMATS["IQ4_NL"], f"{f}->IQ4_NL: row 576 not a multiple of 256")
        assert resolve_for_row(f, 1536) == (FORMATS[f], None)
        assert resolve_for_row(f, 48)[0].name == "F16"
    assert resolve_for_row("NVFP4", 576) == (FORMATS["NVFP4"], None)  # 9 blocks of 64
    plan = make_plan(smollm2_tensors(), SMOL, preset="Q4_K_M", rules=["attn_q=IQ2_XXS", "ffn_down=IQ1_S"])
    e = {e.name: e for e in plan.entries}
    q, d = e["blk.3.attn_q.weight"], e["blk.3.ffn_down.weight"]
    assert (q.format, q.requested) == ("IQ4_NL", "IQ2_XXS") and "fallback IQ2_XXS->IQ4_NL" in q.reason
    assert q.size_bytes == 576 * 576 // 32 * 18  # sized in the format written, as llama-quantize does
    assert (d.format, d.size_bytes) == ("IQ1_S", 576 * 1536 // 256 * 50)


def test_candidates_are_the_registered_codecs(monkeypatch):
    from dynaquant.quant.codecs import base
    from dynaquant.quant.planner import GGUF_CANDIDATES, _registered

    assert set(IQ_256) | {"NVFP4"} <= set(GGUF_CANDIDATES) <= set(FORMATS)
    monkeypatch.delitem(base._CODECS, "IQ1_S")  # a codec module not (yet) importable
    assert _registered(("Q4_0", "IQ1_S", "IQ2_XXS")) == ("Q4_0", "IQ2_XXS")


def test_allocator_needs_an_imatrix_for_the_lowest_iquants():
    from dynaquant.quant.presets import requires_imatrix

    # llama.cpp refuses IQ3_XXS/IQ2_*/IQ1_* without an imatrix, except in token_embd/output
    assert requires_imatrix("blk.0.ffn_down.weight", "IQ3_XXS") and requires_imatrix("blk.0.attn_q.weight", "iq1_m")
    assert not requires_imatrix("token_embd.weight", "IQ2_XXS") and not requires_imatrix("output.weight", "IQ1_S")
    assert not requires_imatrix("blk.0.ffn_down.weight", "IQ3_S") and not requires_imatrix("blk.0.ffn_down.weight", "Q2_K")
    with_im = make_plan(smollm2_tensors(), SMOL, bpw=4.0, has_imatrix=True)
    without = make_plan(smollm2_tensors(), SMOL, bpw=4.0)
    assert any(requires_imatrix(e.name, e.format) for e in with_im.entries)
    assert not any(requires_imatrix(e.name, e.format) for e in without.entries)
    assert without.bpw <= 4.0 and with_im.bpw <= 4.0
    # the cheapest formats differ: IQ1_S (1.5625 bpw) with an imatrix, Q2_K (2.625 bpw) without
    make_plan(smollm2_tensors(), SMOL, bpw=3.8, has_imatrix=True)
    with pytest.raises(BudgetError):
        make_plan(smollm2_tensors(), SMOL, bpw=3.8)


def test_q4_k_m_preset_matches_llama_quantize_decisions():
    plan = make_plan(smollm2_tensors(), SMOL, preset="Q4_K_M")
    f = plan.formats()
    # tied embedding acts as the output tensor; 576 is not a multiple of 256 -> Q8_0
    assert f["token_embd.weight"] == "Q8_0"
    # use_more_bits(i, 30): i < 3, i >= 26, or (i - 3) % 3 == 2
    more = {i for i in range(N_LAYERS) if i < 3 or i >= 26 or (i - 3) % 3 == 2}
    for i in range(N_LAYERS):
        assert f[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert f[f"blk.{i}.attn_v.weight"] == ("Q8_0" if i in more else "Q5_0")  # Q6_K/Q4_K fall back on rows of 576
        assert f[f"blk.{i}.attn_q.weight"] == "Q5_0"
        assert f[f"blk.{i}.attn_norm.weight"] == "F32"
    e = next(e for e in plan.entries if e.name == "blk.4.attn_q.weight")
    assert e.requested == "Q4_K" and "fallback Q4_K->Q5_0" in e.reason


def test_q2_k_and_q3_k_m_presets():
    f = make_plan(smollm2_tensors(), SMOL, preset="Q2_K").formats()
    assert f["blk.7.ffn_down.weight"] == "Q3_K" and f["blk.7.attn_q.weight"] == "Q4_0"
    f = make_plan(smollm2_tensors(), SMOL, preset="Q3_K_M").formats()
    assert f["blk.0.ffn_down.weight"] == "Q5_K" and f["blk.9.ffn_down.weight"] == "Q4_K"
    assert f["blk.1.attn_v.weight"] == "Q5_1" and f["blk.5.attn_v.weight"] == "Q5_0"
    assert f["blk.5.attn_output.weight"] == "Q5_0"


def test_presets_are_ordered_by_size():
    sizes = [make_plan(smollm2_tensors(), SMOL, preset=p).size_bytes
             for p in ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)


def test_rules_first_match_wins_and_are_recorded():
    plan = make_plan(smollm2_tensors(), SMOL, preset="Q4_K_M", rules=["ffn_down=Q2_K", "ffn_.*=Q8_0"])
    e = {e.name: e for e in plan.entries}
    assert e["blk.5.ffn_down.weight"].format == "Q2_K" and e["blk.5.ffn_down.weight"].reason.startswith("rule 1")
    assert e["blk.5.ffn_up.weight"].format == "Q8_0" and e["blk.5.ffn_up.weight"].reason.startswith("rule 2")
    assert plan.rules == ["ffn_down=Q2_K", "ffn_.*=Q8_0"]


@pytest.mark.parametrize("text,msg", [("ffn_down", "REGEX=FORMAT"), ("ffn_down=Q9_X", "unknown format"),
                                      ("ffn_(down=Q4_K", "invalid regex")])
def test_bad_rules_are_named(text, msg):
    with pytest.raises(ValueError, match=msg):
        Rule.parse(text)


@pytest.mark.parametrize("bpw", [4.0, 5.0, 6.5])
def test_bpw_budget_is_an_upper_bound_and_mostly_used(bpw):
    plan = make_plan(smollm2_tensors(), SMOL, bpw=bpw)
    assert plan.bpw <= bpw
    assert plan.bpw > bpw - 0.25  # the allocator spends the budget
    assert all(e.reason.startswith(("allocation", "not quantized")) for e in plan.entries)


def test_size_budget_counts_overhead_and_bigger_budget_is_never_worse():
    small = make_plan(smollm2_tensors(), SMOL, size_bytes=80_000_000, overhead_bytes=2_000_000)
    big = make_plan(smollm2_tensors(), SMOL, size_bytes=100_000_000, overhead_bytes=2_000_000)
    assert small.size_bytes <= 78_000_000 < big.size_bytes <= 98_000_000


def test_budget_below_fixed_rules_reports_the_minimum():
    with pytest.raises(BudgetError, match="at least") as info:
        make_plan(smollm2_tensors(), SMOL, bpw=5.0, rules=["token_embd=F32"])
    # token_embd in F32 alone is 28.3M * 4 bytes
    assert info.value.min_bytes > 49152 * 576 * 4


def test_plan_json_round_trip_and_validation():
    ts = smollm2_tensors()
    plan = make_plan(ts, SMOL, preset="Q4_K_M")
    d = json.loads(json.dumps(plan.to_dict()))
    back = Plan.from_dict(d, "p.json")
    back.check_tensors(ts, "p.json")
    assert back.formats() == plan.formats() and back.size_bytes == plan.size_bytes
    d["tensors"][2]["format"] = "Q7_Z"
    with pytest.raises(ValueError, match=r"p\.json: tensor blk\.0\.ffn_down\.weight: unknown format"):
        Plan.from_dict(d, "p.json")
    d["tensors"][2]["format"] = "Q4_K"
    d["tensors"][6]["format"] = "Q4_K"  # attn_k rows of 576
    with pytest.raises(ValueError, match="multiple of 256"):
        Plan.from_dict(d, "p.json")
    d["tensors"][6]["format"] = "Q8_0"
    d["tensors"][6]["name"] = "blk.0.attn_kk.weight"
    with pytest.raises(ValueError, match="not in the model: blk.0.attn_kk.weight"):
        Plan.from_dict(d, "p.json").check_tensors(ts, "p.json")


def test_rule_operators():
    assert Rule.parse("attn_v>=Q5_0") == Rule("attn_v", "Q5_0", ">=")
    assert Rule.parse(r"blk\.1[0-9]\.ffn_down<=q4_k") == Rule(r"blk\.1[0-9]\.ffn_down", "Q4_K", "<=")
    assert Rule.parse("a=b=Q8_0") == Rule("a=b", "Q8_0", "=")
    with pytest.raises(ValueError, match="expected REGEX=FORMAT"):
        Rule.parse(">=Q8_0")


def _toy_error(t: TensorInfo, fmt: str) -> float:
    """A deterministic, tensor-dependent error: more weight on low layers and on ffn_down."""
    w = 1.0 + (3.0 if t.layer == 2 else 0.0) + (2.0 if "ffn_down" in t.name else 0.0) + 0.01 * len(t.name)
    return t.n_elements * w * 2.0 ** (-2 * get_format(fmt).bpw)


def test_allocator_is_optimal_on_a_small_problem():
    """Greedy on convex hulls equals the brute-force optimum (convex errors), and respects bounds."""
    import itertools

    from dynaquant.quant.planner import _bytes

    ts = [TensorInfo(f"blk.{i}.ffn_down.weight", None, (64, 256)) for i in range(3)] + \
         [TensorInfo(f"blk.{i}.attn_q.weight", None, (64, 256)) for i in range(3)]
    m = ModelInfo(n_layers=3)
    cands = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
    for bpw in (3.0, 4.0, 5.25):
        plan = make_plan(ts, m, bpw=bpw, error_fn=_toy_error, candidates=cands, error_source="toy")
        limit = int(bpw * sum(t.n_elements for t in ts) / 8)
        assert plan.size_bytes <= limit
        best = min((sum(_toy_error(t, f) for t, f in zip(ts, combo)), combo)
                   for combo in itertools.product(cands, repeat=len(ts))
                   if sum(_bytes(t, f) for t, f in zip(ts, combo)) <= limit)
        got = sum(_toy_error(t, e.format) for t, e in zip(ts, plan.entries))
        assert got <= best[0] * 1.02, (bpw, got, best)
        assert plan.kld_pred == pytest.approx(got)
    again = make_plan(ts, m, bpw=4.0, error_fn=_toy_error, candidates=cands, error_source="toy")
    assert again.to_dict() == make_plan(ts, m, bpw=4.0, error_fn=_toy_error, candidates=cands, error_source="toy").to_dict()
    bounded = make_plan(ts, m, bpw=4.0, error_fn=_toy_error, candidates=cands, error_source="toy",
                        rules=["attn_q<=Q3_K", r"blk\.0\.ffn_down>=Q6_K"])
    f = bounded.formats()
    assert all(get_format(f[f"blk.{i}.attn_q.weight"]).bpw <= 3.4375 for i in range(3))
    assert get_format(f["blk.0.ffn_down.weight"]).bpw >= 6.5625
    assert "rule 2" in next(e.reason for e in bounded.entries if e.name == "blk.0.ffn_down.weight")


def test_default_rules_keep_super_weights_first_layer_and_attention_high():
    from dynaquant.quant.rules import default_rules

    ts = smollm2_tensors()
    err = lambda t, f: t.n_elements * 2.0 ** (-2 * get_format(f).bpw)  # noqa: E731
    plan = make_plan(ts, SMOL, size_bytes=80_000_000, error_fn=err, error_source="toy",
                     defaults=default_rules(SMOL, ["blk.11.ffn_down.weight"]))
    f = plan.formats()
    assert f["blk.11.ffn_down.weight"] == "Q8_0" and f["blk.0.ffn_up.weight"] == "Q8_0"
    assert all(get_format(f[f"blk.{i}.attn_v.weight"]).bpw >= 4.5 for i in range(N_LAYERS))
    assert get_format(f["token_embd.weight"]).bpw >= 4.5
    assert plan.size_bytes <= 80_000_000
    # a user rule overrides a default one
    plan = make_plan(ts, SMOL, size_bytes=80_000_000, error_fn=err, error_source="toy", rules=[r"blk\.11\.ffn_down=Q4_K"],
                     defaults=default_rules(SMOL, ["blk.11.ffn_down.weight"]))
    assert plan.formats()["blk.11.ffn_down.weight"] == "Q4_K"


def _old_default_target(ts, m, rules, size, error_fn, cands, defaults):
    """The default target's plan as made before min_plan_bytes: a plan, and on BudgetError a second at its min_bytes."""
    try:
        return make_plan(ts, m, rules=rules, size_bytes=size, overhead_bytes=1000, error_fn=error_fn, candidates=cands,
                         defaults=defaults, error_source="toy", has_imatrix=True, lift_expert_caps=False), size
    except BudgetError as e:
        return make_plan(ts, m, rules=rules, size_bytes=e.min_bytes, overhead_bytes=1000, error_fn=error_fn,
                         candidates=cands, defaults=defaults, error_source="toy", has_imatrix=True,
                         lift_expert_caps=False), e.min_bytes


@pytest.mark.parametrize("rules", [(), ("ffn_down=Q8_0",), ("attn_.*>=Q6_K", "token_embd=F16")])
@pytest.mark.parametrize("target", ["gguf", "safetensors"])
def test_min_plan_bytes_is_the_budget_errors_minimum_and_plans_the_same(rules, target):
    from dynaquant.quant.planner import default_rules, min_plan_bytes, preset_size_bytes

    ts, m = smollm2_tensors(), SMOL
    if target == "safetensors":
        rules = tuple(r for r in rules if "=F16" not in r and "=Q8_0" not in r)
    measured = {"Q2_K", "Q4_K", "Q6_K", "Q8_0", "INT4_G128", "INT8_G32", "FP8"}

    def err(t, f):
        return _toy_error(t, f) if f in measured else float("inf")

    for error_fn in (None, err):
        kw = dict(rules=rules, overhead_bytes=1000, error_fn=error_fn, target=target, error_source="toy",
                  defaults=default_rules(m, ["blk.3.ffn_down.weight"], target=target), has_imatrix=True)
        least = min_plan_bytes(ts, m, **kw)
        for budget in ({"bpw": 1.0}, {"size_bytes": least - 1}, {"size_bytes": 10**6}):
            with pytest.raises(BudgetError) as old:
                make_plan(ts, m, **budget, **kw)
            with pytest.raises(BudgetError) as new:
                min_plan_bytes(ts, m, **budget, **kw)
            assert (str(new.value), new.value.min_bytes) == (str(old.value), old.value.min_bytes)
            assert least == old.value.min_bytes
        for budget in ({"size_bytes": least}, {"size_bytes": least + 5_000_000}, {"bpw": 20.0}):
            assert min_plan_bytes(ts, m, **budget, **kw) == least  # fits: no error
            make_plan(ts, m, **budget, **kw)
    assert preset_size_bytes(ts, m, "Q4_K_M") == make_plan(ts, m, preset="Q4_K_M").size_bytes
    assert preset_size_bytes(ts, m, "Q2_K") == make_plan(ts, m, preset="Q2_K").size_bytes


@pytest.mark.parametrize("rules", [(), ("ffn_down=Q8_0",), ("attn_.*>=Q6_K",)])
def test_default_target_plan_once_equals_the_retry(rules):
    """pipeline.plan's default target: max(size, min_plan_bytes) then one plan == the plan-then-retry of before."""
    from dynaquant.quant.planner import default_rules, min_plan_bytes

    ts, m = smollm2_tensors(), SMOL
    cands = ["Q2_K", "Q3_K", "Q4_K", "Q6_K", "Q8_0"]
    defaults = default_rules(m, ["blk.5.ffn_down.weight"])
    least = min_plan_bytes(ts, m, rules=rules, overhead_bytes=1000, error_fn=_toy_error, candidates=cands,
                           defaults=defaults, has_imatrix=True)
    for size in (10**6, least - 1, least, least + 1, 60_000_000, 200_000_000):
        old, old_size = _old_default_target(ts, m, rules, size, _toy_error, cands, defaults)
        new_size = max(size, least)
        new = make_plan(ts, m, rules=rules, size_bytes=new_size, overhead_bytes=1000, error_fn=_toy_error,
                        candidates=cands, defaults=defaults, error_source="toy", has_imatrix=True, lift_expert_caps=False)
        assert (new.to_dict(), new_size) == (old.to_dict(), old_size)


def test_the_gaussian_prior_table_is_what_the_encoders_measure():
    """planner.GAUSSIAN_REL_MSE (the prior of a plan without measurements, kept as numbers so that no run spends
    seconds measuring it) holds every quantized format, each its encoder's error on the Gaussian rows; a codec whose
    error moved fails here (then measure the table again)."""
    from dynaquant.quant.planner import GAUSSIAN_REL_MSE, gaussian_rel_mse, measure_gaussian_rel_mse

    assert set(GAUSSIAN_REL_MSE) == {n for n, f in FORMATS.items() if f.kind != "float"}
    for name, value in GAUSSIAN_REL_MSE.items():
        assert measure_gaussian_rel_mse(name) == pytest.approx(value, rel=1e-5), name
        assert gaussian_rel_mse(name) == value
    assert gaussian_rel_mse("F16") == 1e-7 and gaussian_rel_mse("F32") == 0.0
