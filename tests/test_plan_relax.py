"""Relaxing the default floors (issue 16): an explicit budget below their minimum (a dense Llama-3-8B at 2.5 bpw) relaxes
them in ``rules.floor_relaxations``' order, just far enough; feasible budgets plan as before; user rules stay."""

from __future__ import annotations

import json
import logging

import pytest

from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan, TensorInfo
from dynaquant.quant.planner import BudgetError, make_plan, min_plan_bytes
from dynaquant.quant.presets import ModelInfo
from dynaquant.quant.rules import default_rules, floor_relaxations, relaxation_levels

LLAMA3_8B = ModelInfo(n_layers=32, n_head=32, n_head_kv=8)  # n_gqa 4, untied embeddings


def llama3_8b_tensors(n_layers: int = 32) -> list[TensorInfo]:
    """Llama-3-8B's tensor table (GGUF names, torch-order shapes): hidden 4096, 8 KV heads of 128, FFN 14336, vocabulary
    128256, untied output head; 8.03 B weights."""
    ts = [TensorInfo("token_embd.weight", None, (128256, 4096))]
    for i in range(n_layers):
        b = f"blk.{i}."
        ts += [TensorInfo(b + "attn_norm.weight", None, (4096,), False), TensorInfo(b + "attn_q.weight", None, (4096, 4096)),
               TensorInfo(b + "attn_k.weight", None, (1024, 4096)), TensorInfo(b + "attn_v.weight", None, (1024, 4096)),
               TensorInfo(b + "attn_output.weight", None, (4096, 4096)), TensorInfo(b + "ffn_norm.weight", None, (4096,), False),
               TensorInfo(b + "ffn_gate.weight", None, (14336, 4096)), TensorInfo(b + "ffn_up.weight", None, (14336, 4096)),
               TensorInfo(b + "ffn_down.weight", None, (4096, 14336))]
    return ts + [TensorInfo("output_norm.weight", None, (4096,), False), TensorInfo("output.weight", None, (128256, 4096))]


def _bytes(t: TensorInfo, fmt: str) -> int:
    return t.n_elements // t.row_size * get_format(fmt).row_bytes(t.row_size)


def _bpw(plan: Plan, name: str) -> float:
    return get_format(plan.formats()[name]).bpw


FIRST_STEP = ("token embedding: Q2_K class; attention: attn_q/k/output no floor, attn_v Q4_0 class "
              "(llama.cpp's IQ2 mixes)")


def test_a_dense_8b_at_2_5_bpw_plans_with_the_iq2_floors(caplog):
    ts, m = llama3_8b_tensors(), LLAMA3_8B
    defaults = default_rules(m)
    with pytest.raises(BudgetError) as old:  # what the floors allow: ~2.61 bpw with an imatrix
        make_plan(ts, m, bpw=2.5, defaults=defaults, has_imatrix=True, relax_floors=False)
    assert 2.6 < 8 * old.value.min_bytes / sum(t.n_elements for t in ts) < 2.62
    with caplog.at_level(logging.WARNING, logger="dynaquant.quant.planner"):
        plan = make_plan(ts, m, bpw=2.5, defaults=defaults, has_imatrix=True)
    assert 2.49 < plan.bpw <= 2.5
    assert plan.relaxed == [FIRST_STEP] and plan.method.endswith("; default floors relaxed (1 step)")
    assert any("relaxed: token embedding: Q2_K class; attention" in r.getMessage() for r in caplog.records)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["relaxed_floors"] == [FIRST_STEP]
    assert Plan.from_dict(d).relaxed == [FIRST_STEP]
    e = {x.name: x for x in plan.entries}
    assert "default: token embedding, relaxed to the Q2_K class" in e["token_embd.weight"].reason
    assert get_format(e["token_embd.weight"].format).bpw < 4.5  # the budget took what the embedding gave up
    assert "default: attn_v, relaxed from the attention floor" in e["blk.7.attn_v.weight"].reason
    for i in range(1, 32):  # the floors still standing: attn_v (n_gqa 4: llama.cpp's Q4_K), output, first layer
        assert _bpw(plan, f"blk.{i}.attn_v.weight") >= 4.5
        assert _bpw(plan, f"blk.{i}.attn_q.weight") < 4.5 and _bpw(plan, f"blk.{i}.ffn_up.weight") >= 2.06  # not IQ1
    assert _bpw(plan, "output.weight") >= 4.5 and "default: output head" in e["output.weight"].reason
    assert all(_bpw(plan, t.name) >= 8.5 for t in ts if t.quantizable and t.name.startswith("blk.0."))


def test_feasible_budgets_plan_as_before():
    ts, m = llama3_8b_tensors(8), ModelInfo(n_layers=8, n_head=32, n_head_kv=8)
    defaults = default_rules(m, ["blk.3.ffn_down.weight"])
    least = min_plan_bytes(ts, m, defaults=defaults, has_imatrix=True, relax_floors=False)
    for budget in ({"size_bytes": least}, {"size_bytes": least + 10**7}, {"bpw": 3.8}, {"bpw": 5.0}):
        for solver in ("exact", "greedy"):
            kw = dict(defaults=defaults, has_imatrix=True, solver=solver, **budget)
            new, old = make_plan(ts, m, **kw), make_plan(ts, m, relax_floors=False, **kw)
            assert json.dumps(new.to_dict()) == json.dumps(old.to_dict())
            assert new.relaxed is None and "relaxed" not in new.method and "relaxed_floors" not in new.to_dict()
    with pytest.raises(BudgetError):
        make_plan(ts, m, size_bytes=least - 1, defaults=defaults, has_imatrix=True, relax_floors=False)
    assert make_plan(ts, m, size_bytes=least - 1, defaults=defaults, has_imatrix=True).relaxed == [FIRST_STEP]


def test_just_enough_floors_are_relaxed_in_order():
    ts, m = llama3_8b_tensors(8), ModelInfo(n_layers=8, n_head=32, n_head_kv=8)
    defaults = default_rules(m)
    levels = relaxation_levels(defaults, m)
    assert [names[-1] for names, _ in levels] == [FIRST_STEP, "attn_v: Q2_K class", "output head: Q2_K class",
                                                  "first layers: Q4_0 class", "first layers: Q2_K class"]
    mins = [min_plan_bytes(ts, m, defaults=d, has_imatrix=True, relax_floors=False) for d in [defaults] + [r for _, r in levels]]
    assert mins == sorted(mins, reverse=True) and len(set(mins)) == len(mins)  # every step lowers the minimum
    for k, (names, _) in enumerate(levels):
        for size in (mins[k + 1], mins[k] - 1):  # the least relaxed level that fits, at both ends of its range
            plan = make_plan(ts, m, size_bytes=size, defaults=defaults, has_imatrix=True)
            assert plan.relaxed == list(names) and plan.size_bytes <= size
    assert min_plan_bytes(ts, m, defaults=defaults, has_imatrix=True) == mins[-1]


def test_an_impossible_budget_raises_with_the_relaxed_minimum():
    ts, m = llama3_8b_tensors(8), ModelInfo(n_layers=8, n_head=32, n_head_kv=8)
    defaults = default_rules(m)
    # fully relaxed by hand: token embedding, output, attn_v and the first layer at Q2_K, everything else IQ1_S
    want = 1000 + sum(_bytes(t, "Q2_K" if t.name.startswith(("token_embd", "output.", "blk.0.")) or ".attn_v." in t.name
                             else "IQ1_S") for t in ts if t.quantizable)
    want += sum(4 * t.n_elements for t in ts if not t.quantizable)
    with pytest.raises(BudgetError, match="even with the default floors relaxed") as err:
        make_plan(ts, m, bpw=1.6, overhead_bytes=1000, defaults=defaults, has_imatrix=True)
    assert err.value.min_bytes == want == min_plan_bytes(ts, m, overhead_bytes=1000, defaults=defaults, has_imatrix=True)
    plan = make_plan(ts, m, size_bytes=want, overhead_bytes=1000, defaults=defaults, has_imatrix=True)
    assert plan.size_bytes == want - 1000 and len(plan.relaxed) == 5 and plan.method.endswith("relaxed (5 steps)")
    assert len(plan.method) <= 29 + 64  # what the GGUF overhead estimate leaves the method (targets.gguf_extra_kv)
    # without an imatrix the cheapest format is Q2_K (2.625 bpw): 2.5 bpw cannot be met, relaxed or not
    with pytest.raises(BudgetError, match="even with the default floors relaxed") as err:
        make_plan(ts, m, bpw=2.5, defaults=default_rules(m, has_imatrix=False))
    assert err.value.min_bytes == sum(_bytes(t, "Q2_K") if t.quantizable else 4 * t.n_elements for t in ts)


def test_user_rules_are_never_relaxed():
    ts, m = llama3_8b_tensors(), LLAMA3_8B
    defaults = default_rules(m)
    plan = make_plan(ts, m, bpw=2.5, rules=[r"\.attn_k\.>=Q6_K", r"^output\.=Q5_K"], defaults=defaults, has_imatrix=True)
    assert plan.relaxed and plan.bpw <= 2.5
    e = {x.name: x for x in plan.entries}
    for i in range(32):
        assert _bpw(plan, f"blk.{i}.attn_k.weight") >= 6.5625 and e[f"blk.{i}.attn_k.weight"].reason.endswith(
            "rule 1: \\.attn_k\\.>=Q6_K")
    assert e["output.weight"].format == "Q5_K" and e["output.weight"].reason == "rule 2: ^output\\.=Q5_K"
    # user rules alone above the budget: refused, their bytes in the minimum
    with pytest.raises(BudgetError) as err:
        make_plan(ts, m, bpw=2.5, rules=["ffn_=Q4_K"], defaults=defaults, has_imatrix=True)
    assert err.value.min_bytes == min_plan_bytes(ts, m, rules=["ffn_=Q4_K"], defaults=defaults, has_imatrix=True)
    assert 8 * err.value.min_bytes / sum(t.n_elements for t in ts) > 3.0
    # no default rules (--no-default-rules): nothing to relax, the error as before
    with pytest.raises(BudgetError, match=r"need at least [0-9.]+ bpw \("):
        make_plan(ts, m, bpw=1.0, has_imatrix=True)


def test_tied_small_gqa_and_moe_models():
    tied = ModelInfo(n_layers=30, n_head=9, n_head_kv=3, tied_embeddings=True)  # SmolLM2-135M: n_gqa 3
    names = [s.name for s in floor_relaxations(tied)]
    assert names == ["attention: attn_q/k/output no floor, attn_v Q2_K class (llama.cpp's IQ2 mixes)",
                     "output head (the tied token embedding): Q2_K class", "first layers: Q4_0 class",
                     "first layers: Q2_K class"]
    rules = relaxation_levels(default_rules(tied), tied)[1][1]
    hit = next(r for r in rules if r.matches("token_embd.weight"))
    assert (hit.format, hit.origin) == ("Q2_K", "default: output head (the tied token embedding), relaxed to the Q2_K class")
    moe = ModelInfo(n_layers=8, n_head=32, n_head_kv=8, n_expert=8)
    assert floor_relaxations(moe) == [] and relaxation_levels(default_rules(moe), moe) == []


def test_the_quantize_pipelines_default_target_does_not_relax():
    from dynaquant.config import QuantizeConfig
    from dynaquant.pipeline.safetensors_target import SafetensorsTarget
    from dynaquant.pipeline.targets import GGUFTarget

    m = LLAMA3_8B
    for target in (GGUFTarget(), SafetensorsTarget()):
        assert target.plan_options(m, [], None, QuantizeConfig())["relax_floors"] is False
        assert target.plan_options(m, [], None, QuantizeConfig(bpw=2.5))["relax_floors"] is True


def test_relaxed_floors_in_plan_json_are_checked():
    from dynaquant.quant.plan import PlanError

    d = make_plan(llama3_8b_tensors(2), ModelInfo(n_layers=2, n_head=32, n_head_kv=8), bpw=5.0).to_dict()
    for bad in ([1], "token embedding", {"a": 1}):
        with pytest.raises(PlanError, match="relaxed_floors"):
            Plan.from_dict({**d, "relaxed_floors": bad})
    assert Plan.from_dict({**d, "relaxed_floors": ["x"]}).to_dict()["relaxed_floors"] == ["x"]


def _small_report() -> dict:
    """A report of a 4-block model with rows of 512 (token embedding, output, attn_q, attn_v, ffn_down), measured in
    Q2_K, Q4_0, Q8_0: the default floors need 4.76 bpw at least, 4.04 with the first step relaxed."""
    def errs(n, w):
        return {f: {"size_bytes": n // 256 * get_format(f).row_bytes(256), "bpw": get_format(f).bpw, "weighted_rel": r,
                    "output_rel": r, "kld_pred": w * r} for f, r in (("Q2_K", 0.07), ("Q4_0", 0.007), ("Q8_0", 3e-5))}
    t = [{"name": "token_embd.weight", "hf_name": "model.embed_tokens.weight", "shape": [1024, 512], "quantizable": True,
          "errors": errs(1024 * 512, 0.5)}]
    for i in range(4):
        for kind, hf, shape in (("attn_q", "self_attn.q_proj", [512, 512]), ("attn_v", "self_attn.v_proj", [128, 512]),
                                ("ffn_down", "mlp.down_proj", [512, 512])):
            t.append({"name": f"blk.{i}.{kind}.weight", "hf_name": f"model.layers.{i}.{hf}.weight", "shape": shape,
                      "quantizable": True, "errors": errs(shape[0] * shape[1], 1.0)})
    t.append({"name": "output.weight", "hf_name": "lm_head.weight", "shape": [1024, 512], "quantizable": True,
              "errors": errs(1024 * 512, 4.0)})
    return {"version": 1, "model": {"id": "tiny", "n_layers": 4, "n_head": 8, "n_head_kv": 2, "gguf_overhead_bytes": 4096},
            "candidates": ["Q2_K", "Q4_0", "Q8_0"], "tensors": t}


def test_cli_plan_relaxes_the_floors_below_their_minimum(tmp_path, capsys, caplog):
    from dynaquant.cli import main

    rep = tmp_path / "report.json"
    rep.write_text(json.dumps(_small_report()))
    with caplog.at_level(logging.WARNING, logger="dynaquant.quant.planner"):
        assert main(["plan", str(rep), "--bpw", "4.2", "-o", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["bpw"] <= 4.2 and plan["relaxed_floors"] == [
        "token embedding: Q2_K class; attention: attn_q/k/output no floor, attn_v Q4_0 class (llama.cpp's IQ2 mixes)"]
    assert any("default floors allow; relaxed: token embedding" in r.getMessage() for r in caplog.records)
    f = {t["name"]: t["format"] for t in plan["tensors"]}
    assert f["token_embd.weight"] == "Q2_K" and f["output.weight"] in ("Q4_0", "Q8_0") and f["blk.0.ffn_down.weight"] == "Q8_0"
    # below the fully relaxed minimum (everything Q2_K, 2.625 bpw): refused, the minimum named
    capsys.readouterr()
    assert main(["plan", str(rep), "--bpw", "2.6", "-o", str(tmp_path / "p2.json")]) != 0
    assert "need at least 2.6250 bpw even with the default floors relaxed" in capsys.readouterr().err
