"""Measured corrections (issue 19): plan -> measure -> fit per-group factors -> re-plan; the report section, the
error function that applies it, Plan.corrections, the plot, and the loop on a tiny random Llama."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dynaquant.analysis.corrections import GroupMeasure, PlanMeasure, correction_group, factor_lookup, measure_plan
from dynaquant.analysis.report.html import build_report_page
from dynaquant.analysis.report.plots import correction_points, fig_corrections
from dynaquant.analysis.report.schema import Report
from dynaquant.analysis.sensitivity import ReferenceLogits, SwappedWeights, kld_with_weights, tf32_matmuls
from dynaquant.errors import InputError
from dynaquant.pipeline.corrections import correct_plan, fit_factors, model_measure
from dynaquant.pipeline.plan import error_fn_from_report
from dynaquant.quant.plan import Plan, TensorInfo
from dynaquant.quant.planner import make_plan
from dynaquant.quant.presets import ModelInfo

FMTS = {"Q4_0": (0.30, 2), "Q8_0": (0.01, 4)}  # format -> (kld_pred of each tensor, bytes per element x 2)
NAMES = ["token_embd.weight"] + [f"blk.{i}.{k}.weight" for i in range(2) for k in ("attn_q", "ffn_down")]


def _report(corrections: dict | None = None, seed: int = 0) -> dict:
    """A synthetic report: 5 tensors of 64 x 64, Q4_0 / Q8_0 measured, random-ish predictions."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for n in NAMES:
        errs = {f: {"kld_pred": kp * (1 + float(torch.rand(1, generator=g))), "size_bytes": 64 * 64 * b // 2}
                for f, (kp, b) in FMTS.items()}
        tensors.append({"name": n, "hf_name": n, "shape": [64, 64], "quantizable": True, "errors": errs})
    rep = {"version": 1, "candidates": list(FMTS), "tensors": tensors,
           "model": {"n_layers": 2, "n_head": 1, "n_head_kv": 1, "tied_embeddings": True}}
    if corrections is not None:
        rep["corrections"] = corrections
    return rep


def _tensors() -> list[TensorInfo]:
    return [TensorInfo(n, n, (64, 64)) for n in NAMES]


def _replan(size_bytes: int):
    info = ModelInfo(n_layers=2, n_head=1, n_head_kv=1, tied_embeddings=True)

    def replan(rep: dict) -> Plan:
        return make_plan(_tensors(), info, "m", size_bytes=size_bytes, error_fn=error_fn_from_report(rep),
                         candidates=list(FMTS), error_source="measured kld")
    return replan


def test_correction_groups():
    assert correction_group("blk.3.attn_v.weight") == "blk.3.attn"
    assert correction_group("blk.3.ffn_down_exps.weight") == "blk.3.ffn"
    assert correction_group("blk.3.ffn_gate_inp.weight") == "blk.3.ffn"  # the router goes with the experts
    assert correction_group("blk.3.ffn_up_shexp.weight") == "blk.3.ffn"
    assert correction_group("token_embd.weight") == "token_embd" and correction_group("output.weight") == "output"
    assert correction_group("v.blk.0.attn_q.weight") == correction_group("mm.0.weight") == "vision"
    lookup = factor_lookup({"blk.0.attn": 2.0, "blk.1.attn": 8.0, "blk.0.ffn": 0.5})
    assert lookup("blk.0.attn") == 2.0 and lookup("blk.5.attn") == pytest.approx(4.0)  # the kind's geometric mean
    assert lookup("blk.5.ffn") == 0.5 and lookup("output") == 1.0


def test_error_fn_applies_group_and_interaction_factors():
    plain = error_fn_from_report(_report())
    t = {x.name: x for x in _tensors()}
    fn = error_fn_from_report(_report({"factors": {"blk.0.ffn": 2.0}, "interaction": 1.0}))
    assert fn(t["blk.0.ffn_down.weight"], "Q4_0") == 2 * plain(t["blk.0.ffn_down.weight"], "Q4_0")
    assert fn(t["blk.0.attn_q.weight"], "Q4_0") == plain(t["blk.0.attn_q.weight"], "Q4_0")
    assert fn(t["blk.1.ffn_down.weight"], "Q8_0") == 2 * plain(t["blk.1.ffn_down.weight"], "Q8_0")  # kind's mean
    fn3 = error_fn_from_report(_report({"factors": {}, "interaction": 1.5}))
    assert fn3(t["token_embd.weight"], "Q8_0") == pytest.approx(1.5 * plain(t["token_embd.weight"], "Q8_0"))
    off = error_fn_from_report(_report({"factors": {"blk.0.ffn": 2.0}}), use_corrections=False)
    assert off(t["blk.0.ffn_down.weight"], "Q4_0") == plain(t["blk.0.ffn_down.weight"], "Q4_0")


def test_old_report_without_section_is_unchanged_and_section_is_kept():
    rep = _report()
    assert "corrections" not in Report.from_dict(rep).to_dict() and Report.from_dict(rep).corrections is None
    sec = {"held_out": {"sequences": 8, "tokens": 4096}, "rounds": [{"round": 1, "kld_measured": 0.1}],
           "factors": {"blk.0.ffn": 2.0}, "interaction": 1.2}
    typed = Report.from_dict(_report(sec))
    assert typed.corrections.factors == {"blk.0.ffn": 2.0} and typed.corrections.interaction == 1.2
    assert typed.to_dict()["corrections"] == sec
    for bad in ({"factors": {"blk.0.ffn": 0}}, {"factors": {"blk.0.ffn": float("nan")}}, {"interaction": -1}):
        with pytest.raises(InputError, match="corrections"):
            Report.from_dict(_report(bad))


def _fake_measure(true_factor: dict[str, float], interaction: float, calls: list):
    """Measures as if group g's KLD were true_factor[g] x its uncorrected prediction, and the whole plan
    ``interaction`` x the groups' sum."""
    base = error_fn_from_report(_report(), use_corrections=False)
    info = {t.name: t for t in _tensors()}

    def measure(plan: Plan, desc: str) -> PlanMeasure:
        calls.append(desc)
        groups: dict[str, float] = {}
        for e in plan.entries:
            g = correction_group(e.name)
            groups[g] = groups.get(g, 0.0) + base(info[e.name], e.format)
        gm = [GroupMeasure(g, p, p * true_factor[g]) for g, p in groups.items()]
        s = sum(m.kld_measured for m in gm)
        return PlanMeasure(sum(m.kld_pred for m in gm), interaction * s, s, gm)
    return measure


def test_factors_fitted_exactly_from_one_round_and_the_loop_stops_within_10_percent():
    true = {"token_embd": 3.0, "blk.0.attn": 0.5, "blk.0.ffn": 2.0, "blk.1.attn": 1.0, "blk.1.ffn": 20.0}
    calls: list = []
    plan, sec = correct_plan(_report(), _replan(5 * 64 * 64 + 2 * 64 * 64), _fake_measure(true, 1.25, calls), rounds=3,
                             held_out={"sequences": 2, "tokens": 8})
    r1 = sec["rounds"][0]
    # round 1: the plain plan; its groups fitted exactly (measured / predicted), clamped to [0.25, 8]
    f, inter = fit_factors([r1])
    assert f == pytest.approx({g: min(v, 8.0) for g, v in true.items()}) and inter == pytest.approx(1.25)
    assert r1["interaction"] == pytest.approx(1.25) and r1["groups_sum"] * 1.25 == pytest.approx(r1["kld_measured"])
    # round 2's prediction matches its measurement within 10 % unless the clamp bit: blk.1.ffn is 20x > 8
    assert len(calls) == len(sec["rounds"]) == len(plan.corrections["rounds"]) <= 4
    last = sec["rounds"][-1]
    assert plan.kld_pred == last["kld_pred"] and plan.size_bytes <= 7 * 64 * 64
    assert [r["round"] for r in plan.corrections["rounds"]] == list(range(1, len(calls) + 1))
    assert set(plan.corrections["rounds"][0]) == {"round", "kld_pred", "kld_measured", "groups_sum", "interaction"}
    assert sec["factors"] == pytest.approx(fit_factors(sec["rounds"][:-1])[0])  # the factors the plan was made with


def test_stop_rule_stops_at_once_when_the_prediction_holds():
    calls: list = []
    true = dict.fromkeys(["token_embd", "blk.0.attn", "blk.0.ffn", "blk.1.attn", "blk.1.ffn"], 1.05)
    plan, sec = correct_plan(_report(), _replan(6 * 64 * 64), _fake_measure(true, 1.0, calls), rounds=2,
                             held_out={"sequences": 2, "tokens": 8})
    assert len(calls) == 1 and sec["factors"] == {} and sec["interaction"] == 1.0
    calls.clear()  # 50 % off: corrected, measured again (round 2 agrees exactly), then stops
    true = dict.fromkeys(true, 1.5)
    plan, sec = correct_plan(_report(), _replan(6 * 64 * 64), _fake_measure(true, 1.0, calls), rounds=5,
                             held_out={"sequences": 2, "tokens": 8})
    assert len(calls) == 2 and sec["factors"] == pytest.approx(dict.fromkeys(true, 1.5))
    assert plan.corrections["rounds"][-1]["kld_pred"] == pytest.approx(plan.corrections["rounds"][-1]["kld_measured"])
    calls.clear()  # never within 10 % (the clamp): rounds re-plans, rounds + 1 measurements
    true = dict.fromkeys(true, 30.0)
    plan, sec = correct_plan(_report(), _replan(6 * 64 * 64), _fake_measure(true, 1.0, calls), rounds=2,
                             held_out={"sequences": 2, "tokens": 8})
    assert len(calls) == 3 and set(sec["factors"].values()) == {8.0}


def test_plan_corrections_round_trip():
    plan = _replan(6 * 64 * 64)(_report())
    assert "corrections" not in plan.to_dict()
    plan.corrections = {"held_out": {"sequences": 2, "tokens": 8},
                        "rounds": [{"round": 1, "kld_pred": 0.1, "kld_measured": 0.2, "groups_sum": 0.15, "interaction": 1.3}]}
    d = json.loads(json.dumps(plan.to_dict()))
    assert Plan.from_dict(d).corrections == plan.corrections and Plan.from_dict(d).to_dict() == d


def test_plot_and_html_section_render():
    calls: list = []
    true = {"token_embd": 3.0, "blk.0.attn": 0.5, "blk.0.ffn": 2.0, "blk.1.attn": 1.0, "blk.1.ffn": 4.0}
    _, sec = correct_plan(_report(), _replan(6 * 64 * 64), _fake_measure(true, 1.25, calls), rounds=2,
                          held_out={"sequences": 2, "tokens": 8})
    groups, plans = correction_points(sec)
    assert len(groups) == 2 * 5 and len(plans) == len(sec["rounds"])
    after = [g for g in groups if g[3] == "after (final)"]
    assert all(x == pytest.approx(y) for x, y, *_ in after)  # corrected predictions of the groups = measured
    fig = fig_corrections(sec)
    assert len(fig.axes) == 2 and fig_corrections({"rounds": []}) is None
    page = build_report_page(_report(sec))
    assert "fig-corrections" in page.figures and "Measured corrections" in page.html
    assert "fig-corrections" not in build_report_page(_report()).figures


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in n else 0.15 * torch.randn_like(p))
    return model


def test_measure_plan_on_a_tiny_llama_matches_kld_with_weights_and_restores(tiny_model):
    model = tiny_model
    chunks = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = ReferenceLogits(model, chunks)
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    fmts = {n: "Q4_0" for n in params}
    groups = {n: correction_group(n.replace("model.embed_tokens", "token_embd").replace("model.layers", "blk")
                                  .replace("self_attn.", "attn_").replace("mlp.", "ffn_")) for n in params}
    assert {"token_embd", "blk.0.attn", "blk.1.ffn"} <= set(groups.values())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = measure_plan(model, ref, fmts, groups, dict.fromkeys(params, 0.01), lambda n: None, progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert m.kld_measured == pytest.approx(kld_with_weights(model, ref, fmts, lambda n: None), rel=1e-5)
    alone = {g.group: g.kld_measured for g in m.groups}
    blk0 = {n: f for n, f in fmts.items() if groups[n] == "blk.0.attn"}
    assert alone["blk.0.attn"] == pytest.approx(kld_with_weights(model, ref, blk0, lambda n: None), rel=1e-5)
    assert m.kld_groups_sum == pytest.approx(sum(alone.values())) and m.kld_pred == pytest.approx(0.01 * len(params))
    assert m.interaction == pytest.approx(m.kld_measured / m.kld_groups_sum) and m.kld_measured > 0


def test_measure_plan_reuses_the_decoded_weights_of_an_earlier_round(tiny_model, monkeypatch):
    """With ``keep``, a second plan encodes only the parameters whose format changed, and measures what a fresh call
    measures (bit for bit); ``keep`` then holds exactly this plan's parameters in their formats."""
    import dynaquant.analysis.corrections as corr

    model = tiny_model
    chunks = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = ReferenceLogits(model, chunks)
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    groups = {n: n.split(".")[2] if "layers" in n else "token_embd" for n in params}
    pred = dict.fromkeys(params, 0.01)
    encoded = []
    real = corr.encoded_weight

    def spy(p, fmt, imatrix):
        encoded.append(fmt)
        return real(p, fmt, imatrix)

    monkeypatch.setattr(corr, "encoded_weight", spy)
    first = dict.fromkeys(params, "Q4_0")
    keep: dict = {}
    measure_plan(model, ref, first, groups, pred, lambda n: None, progress=False, keep=keep)
    assert len(encoded) == len(params) and {n: f for n, (f, _) in keep.items()} == first
    changed = sorted(params)[:2]
    second = {**first, **dict.fromkeys(changed, "Q8_0")}
    second.pop(sorted(params)[-1])  # a parameter no longer planned leaves ``keep``
    encoded.clear()
    again = measure_plan(model, ref, second, groups, pred, lambda n: None, progress=False, keep=keep)
    assert encoded == ["Q8_0", "Q8_0"]
    assert {n: f for n, (f, _) in keep.items()} == second
    fresh = measure_plan(model, ref, second, groups, pred, lambda n: None, progress=False)
    assert again.kld_measured == fresh.kld_measured
    assert [g.kld_measured for g in again.groups] == [g.kld_measured for g in fresh.groups]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_plan_on_the_gpu_keeps_one_copy_of_the_weights_there(tiny_model):
    """Decoded weights kept on the CPU are swapped through it: while swapped the GPU holds exactly the bytes it held
    before (the originals wait on the CPU), both sides come back bit for bit, and measure_plan's KLD is the CPU's."""
    model = tiny_model.cuda()
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    before = {n: p.detach().clone() for n, p in params.items()}
    decoded = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, (n, p) in enumerate(params.items())}
    kept = {n: t.clone() for n, t in decoded.items()}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with SwappedWeights(params, decoded, list(decoded)):
        assert torch.cuda.memory_allocated() == base
        assert all(torch.equal(p.cpu(), kept[n]) and decoded[n].device.type == "cpu" for n, p in params.items())
    assert all(torch.equal(p, before[n]) and torch.equal(decoded[n], kept[n]) for n, p in params.items())
    chunks = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    fmts, groups = dict.fromkeys(params, "Q4_0"), {n: n.split(".")[2] if "layers" in n else "token_embd" for n in params}
    m = measure_plan(model, ReferenceLogits(model, chunks.cuda()), fmts, groups, dict.fromkeys(params, 0.01),
                     lambda n: None, progress=False)
    assert all(torch.equal(p, before[n]) for n, p in params.items())
    model.cpu()
    assert m.kld_measured == pytest.approx(kld_with_weights(model, ReferenceLogits(model, chunks), fmts, lambda n: None),
                                           rel=1e-3)




@pytest.mark.parametrize("tied", [True, False])
def test_prefix_states_measure_a_group_from_its_first_layer_bit_for_bit(tied):
    """With ``prefix_states`` a group is measured from its first decoder layer (an untied head after the last one):
    the same KLD as the whole forward pass, bit for bit, for layer groups, the head and the embedding; the layers'
    own forwards are back afterwards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).eval()
    chunks = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    ref, whole = ReferenceLogits(model, chunks, prefix_states=True), ReferenceLogits(model, chunks)
    assert ref.states is not None and len(ref.states[0]) == 4
    assert all(a.equal(b) for a, b in zip(ref.logp, whole.logp))
    params = dict(model.named_parameters())
    cases = [(["model.layers.2.mlp.down_proj.weight"], 2), (["model.layers.3.mlp.up_proj.weight",
              "model.layers.1.self_attn.o_proj.weight"], 1), (["model.layers.0.self_attn.q_proj.weight"], 0),
             (["model.embed_tokens.weight"], 0)] + ([] if tied else [(["lm_head.weight"], 4)])
    g = torch.Generator().manual_seed(4)
    for names, start in cases:
        moved = {n: params[n].detach() + 0.05 * torch.randn(params[n].shape, generator=g) for n in names}
        with SwappedWeights(params, moved, names):
            assert ref.start_of(model, names) == start
            assert ref.kld(model, start=start) == whole.kld(model) > 0
    assert not any("forward" in m.__dict__ for m in model.model.layers)
    assert ReferenceLogits(model, chunks).start_of(model, ["model.layers.2.mlp.down_proj.weight"]) == 0


def test_measure_plan_with_prefix_states_measures_what_whole_passes_measure(tiny_model):
    model = tiny_model
    chunks = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    fmts, groups = dict.fromkeys(params, "Q4_0"), {n: n.split(".")[2] if "layers" in n else "token_embd" for n in params}
    got = [measure_plan(model, ReferenceLogits(model, chunks, prefix_states=pre), fmts, groups,
                        dict.fromkeys(params, 0.01), lambda n: None, progress=False) for pre in (False, True)]
    assert got[0].kld_measured == got[1].kld_measured
    assert [g.kld_measured for g in got[0].groups] == [g.kld_measured for g in got[1].groups]

def test_tf32_matmuls_is_scoped_to_cuda_and_restored():
    """The corrections' passes run TF32 matmuls on CUDA only, and the setting comes back (also on error)."""
    mm = torch.backends.cuda.matmul
    attr = "fp32_precision" if hasattr(mm, "fp32_precision") else "allow_tf32"
    before = getattr(mm, attr)
    with tf32_matmuls("cpu"):
        assert getattr(mm, attr) == before
    with tf32_matmuls("cuda:0"):
        assert getattr(mm, attr) in ("tf32", True)
    assert getattr(mm, attr) == before
    with pytest.raises(RuntimeError), tf32_matmuls(torch.device("cuda")):
        raise RuntimeError("measure failed")
    assert getattr(mm, attr) == before


def test_device_room_is_zero_off_cuda():
    from dynaquant.analysis.corrections import device_room

    assert device_room("cpu") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_plan_keeps_decoded_weights_on_the_gpu_while_it_has_room(tiny_model, monkeypatch):
    """With room on the GPU the decoded weights stay there (swapped by pointer: no copy to the host); with none
    (``device_room`` 0) they go to the host; the two measure the same KLDs bit for bit and restore the weights."""
    import dynaquant.analysis.corrections as corr

    model = tiny_model.cuda()
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    before = {n: p.detach().clone() for n, p in params.items()}
    chunks = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    ref = ReferenceLogits(model, chunks)
    fmts, groups = dict.fromkeys(params, "Q4_0"), {n: n.split(".")[2] if "layers" in n else "token_embd" for n in params}
    measured, places = [], []
    for room in (None, 0):
        if room is not None:
            monkeypatch.setattr(corr, "device_room", lambda device, room=room: room)
        keep: dict = {}
        measured.append(measure_plan(model, ref, fmts, groups, dict.fromkeys(params, 0.01), lambda n: None,
                                     progress=False, keep=keep))
        places.append({t.device.type for _, t in keep.values()})
        assert all(torch.equal(p, before[n]) for n, p in params.items())
    assert places == [{"cuda"}, {"cpu"}]
    assert measured[0].kld_measured == measured[1].kld_measured
    assert [g.kld_measured for g in measured[0].groups] == [g.kld_measured for g in measured[1].groups]

def test_the_loop_on_a_tiny_llama_returns_a_plan_within_budget(tiny_model):
    model = tiny_model
    names = {n: n.replace("model.embed_tokens", "token_embd").replace("model.layers", "blk").replace("self_attn.", "attn_")
             .replace("mlp.", "ffn_").replace("_proj", "") for n, p in model.named_parameters() if p.ndim == 2}
    tensors = [TensorInfo(g, n, tuple(model.get_parameter(n).shape)) for n, g in names.items()]
    rep = {"version": 1, "candidates": ["Q4_0", "Q8_0"], "model": {"n_layers": 2},
           "tensors": [{"name": t.name, "hf_name": t.hf_name, "shape": list(t.shape), "errors": {
               f: {"kld_pred": k * t.n_elements / 8192} for f, k in (("Q4_0", 0.004), ("Q8_0", 0.0001))}} for t in tensors]}
    info = ModelInfo(n_layers=2, n_head=4, n_head_kv=2, tied_embeddings=True)
    budget = sum(t.n_elements for t in tensors) * 6 // 8

    def replan(r):
        return make_plan(tensors, info, "tiny", size_bytes=budget, error_fn=error_fn_from_report(r),
                         candidates=["Q4_0", "Q8_0"], error_source="measured kld")

    ref = ReferenceLogits(model, torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2)))
    plan, sec = correct_plan(rep, replan, model_measure(model, ref, tensors, rep, lambda n: None, progress=False),
                             rounds=1, held_out={"sequences": 2, "tokens": 32})
    assert plan.size_bytes <= budget and 1 <= len(plan.corrections["rounds"]) <= 2
    r = sec["rounds"][-1]
    assert r["kld_measured"] > 0 and r["interaction"] == pytest.approx(r["kld_measured"] / r["groups_sum"])
    assert {g["group"] for g in sec["rounds"][0]["groups"]} == {"token_embd", "blk.0.attn", "blk.0.ffn", "blk.1.attn",
                                                                   "blk.1.ffn"}
    assert all(math.isfinite(f) and 0.25 <= f <= 8 for f in sec["factors"].values())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from test_gguf_export import _tiny_checkpoint

    ckpt = tmp_path_factory.mktemp("corr") / "tiny-llama"
    _tiny_checkpoint(ckpt, "llama", hidden_size=256, intermediate_size=512)
    return ckpt


def test_analyze_correct_then_plan_and_quantize_correct_from_the_cli(tiny_folder, tmp_path, capsys):
    from dynaquant.analysis.calibration import CalibrationSpec
    from dynaquant.cli import main
    from dynaquant.pipeline.analyze import analyze
    from dynaquant.pipeline.plan import make_dynamic_plan

    an = tmp_path / "an"
    res = analyze(str(tiny_folder), an, calibration=CalibrationSpec(n_sequences=3, seq_len=64), progress=False,
                  candidates=("Q4_0", "Q5_0", "Q8_0"), fisher_sequences=1, super_weights=False, device="cpu",
                  validate_presets=("Q8_0",), correct_rounds=1, correct_sequences=2)
    rep = json.loads((an / "report.json").read_text())
    sec, row = rep["corrections"], rep["plans"][0]
    assert sec["held_out"] == {"sequences": 2, "tokens": 128} and sec["rounds"][0]["label"] == "Q8_0 size"
    assert row["kld_measured"] > 0 and row["corrected"]["rounds"] == len(sec["rounds"]) >= 1
    assert row["corrected"]["kld_measured"] == min(r["kld_measured"] for r in sec["rounds"])  # the plan kept: measured best
    assert res.report["corrections"] == sec
    # dynaquant plan report.json reuses the section's factors
    assert bool(sec["factors"]) == (len(sec["rounds"]) > 1)  # fitted only when round 1 was more than 10 % off
    plan, fn = make_dynamic_plan(an / "report.json", bpw=7), error_fn_from_report(rep)
    for e in plan.entries:
        if e.kld_pred is not None:
            assert e.kld_pred == fn(TensorInfo(e.name, e.hf_name, e.shape), e.format)
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(tiny_folder), "--report", str(an / "report.json"), "--bpw", "7", "--correct", "1",
                 "--correct-sequences", "2", "--calibration-chunks", "3", "--ctx", "64", "--device", "cpu", "-o", str(out),
                 "--save-plan", str(tmp_path / "plan.json"), "--json", "--no-eval"]) == 0
    got = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "plan.json").read_text())
    rounds = saved["corrections"]["rounds"]
    assert 1 <= len(rounds) <= 2 and rounds[-1]["kld_measured"] > 0 and saved["kld_pred"] == pytest.approx(rounds[-1]["kld_pred"])
    assert got["size_bytes"] <= 7 * sum(math.prod(t["shape"]) for t in rep["tensors"]) / 8 + 10**6
    assert "corrections_s" in got["timings_s"]
    with pytest.raises(SystemExit):
        main(["quantize", str(tiny_folder), "--correct", "-1"])


def test_encodings_keep_a_plans_bytes_within_their_limit():
    """Encodings: kept while they fit the limit (a replaced entry's bytes freed first), dropped when a plan changes
    their format, given up once taken, and only in the format asked for."""
    from dynaquant.analysis.corrections import Encodings

    enc = Encodings(limit=100)
    enc.offer("a", "Q4_0", torch.zeros(4, 10, dtype=torch.uint8))
    enc.offer("b", "Q8_0", torch.zeros(5, 10, dtype=torch.uint8))
    enc.offer("c", "Q8_0", torch.zeros(2, 10, dtype=torch.uint8))  # 40 + 50 + 20 > 100: not kept
    assert set(enc.codes) == {"a", "b"} and enc.nbytes == 90
    enc.offer("b", "Q4_0", torch.zeros(3, 10, dtype=torch.uint8))  # replaces b's 50 bytes
    enc.offer("c", "Q8_0", torch.zeros(2, 10, dtype=torch.uint8))
    assert enc.nbytes == 90 and enc.codes["b"][0] == "Q4_0" and "c" in enc.codes
    enc.keep_only({"a": "Q4_0", "b": "Q5_0", "c": "Q8_0"})
    assert set(enc.codes) == {"a", "c"} and enc.nbytes == 60
    assert enc.take("a", "Q8_0") is None and enc.take("a", "Q4_0").shape == (4, 10)
    assert enc.take("a", "Q4_0") is None and enc.nbytes == 20


@pytest.mark.parametrize("gptq", [False, True], ids=["plain", "gptq"])
def test_a_corrected_run_writes_the_bytes_its_corrections_encoded(tiny_folder, tmp_path, monkeypatch, gptq):
    """A whole-model run with corrections writes the planned tensors from the bytes its last measured plan encoded
    (llama's q/k rows put in the GGUF's order), not encoding them again: the file is byte for byte the one a run that
    encodes every tensor again writes. With ``--gptq`` those bytes are the plain rounding GPTQ is checked against
    (not encoded a second time), and the file is again the one of a run encoding them again."""
    from dynaquant.analysis.calibration import CalibrationSpec
    from dynaquant.cli import main
    from dynaquant.pipeline import gptq as gptq_mod
    from dynaquant.pipeline import quantize as quantize_mod
    from dynaquant.pipeline.analyze import analyze
    from dynaquant.pipeline.targets import GGUFTarget

    an = tmp_path / "an"
    analyze(str(tiny_folder), an, calibration=CalibrationSpec(n_sequences=3, seq_len=64), progress=False,
            candidates=("Q4_0", "Q5_0", "Q8_0"), fisher_sequences=1, super_weights=False, device="cpu",
            validate_presets=(), correct_rounds=0)
    reused = []
    real = GGUFTarget.reused

    def counted(self, t):
        got = real(self, t)
        if got is not None:
            reused.append(t.gguf_name)
        return got
    monkeypatch.setattr(GGUFTarget, "reused", counted)
    plain_encodes = []
    real_encode = gptq_mod.encode_tensor
    monkeypatch.setattr(gptq_mod, "encode_tensor", lambda *a, **k: plain_encodes.append(1) or real_encode(*a, **k))
    args = ["quantize", str(tiny_folder), "--report", str(an / "report.json"), "--bpw", "7", "--correct", "1",
            "--correct-sequences", "2", "--calibration-chunks", "3", "--ctx", "64", "--device", "cpu", "--no-eval",
            *(["--gptq"] if gptq else [])]
    assert main([*args, "-o", str(tmp_path / "a.gguf")]) == 0
    assert "blk.0.attn_q.weight" in reused and "blk.1.attn_k.weight" in reused and "blk.1.ffn_down.weight" in reused
    assert plain_encodes == []  # (with --gptq: every plain rounding was the corrections')
    monkeypatch.setattr(quantize_mod, "reusable_encodings", lambda cfg, target: None)
    n = len(reused)
    assert main([*args, "-o", str(tmp_path / "b.gguf")]) == 0
    assert len(reused) == n  # (nothing kept: every tensor encoded by the writer)
    assert (len(plain_encodes) > 0) == gptq
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_the_plan_measured_best_is_kept_and_re_predicted():
    """A re-plan that measures worse than the first plan (as at the IQ2_XXS size of the default model) is not returned:
    the first plan is, its prediction the corrected one (factors fitted on both rounds)."""
    true = {"token_embd": 3.0, "blk.0.attn": 0.5, "blk.0.ffn": 2.0, "blk.1.attn": 1.0, "blk.1.ffn": 4.0}
    calls: list = []
    honest = _fake_measure(true, 1.0, calls)
    plans: list = []

    def measure(plan: Plan, desc: str) -> PlanMeasure:
        m = honest(plan, desc)
        plans.append(plan)
        if len(plans) == 1:
            return m
        return PlanMeasure(m.kld_pred, 10 * m.kld_measured + 1.0, m.kld_groups_sum, m.groups)  # the re-plan: worse

    size = 5 * 64 * 64 + 2 * 64 * 64
    plan, sec = correct_plan(_report(), _replan(size), measure, rounds=1, held_out={"sequences": 2, "tokens": 8},
                             repredict=_repredict)
    assert len(plans) == 2 and plans[0] is not plans[1] and plan is plans[0]
    assert plan.corrections["chosen"] == 1 and plan.corrections["kld_measured"] == sec["rounds"][0]["kld_measured"]
    assert sec["factors"] == pytest.approx(fit_factors(sec["rounds"])[0])  # fitted on both rounds
    info = {t.name: t for t in _tensors()}
    fn = error_fn_from_report({**_report(), "corrections": sec})
    assert plan.kld_pred == pytest.approx(sum(fn(info[e.name], e.format) for e in plan.entries))
    assert plan.corrections["kld_pred"] == plan.kld_pred != sec["rounds"][0]["kld_pred"]


def _repredict(rep: dict, plan: Plan) -> None:
    fn = error_fn_from_report(rep)
    info = {t.name: t for t in _tensors()}
    for e in plan.entries:
        e.kld_pred = fn(info[e.name], e.format)


def test_a_given_first_plan_is_measured_not_planned_again():
    """quantize hands its plan in (``first``): round 1 measures it; only the re-plans call ``replan``."""
    true = dict.fromkeys(["token_embd", "blk.0.attn", "blk.0.ffn", "blk.1.attn", "blk.1.ffn"], 1.5)
    calls: list = []
    made: list = []
    replan = _replan(6 * 64 * 64)

    def counted(rep: dict) -> Plan:
        made.append(rep)
        return replan(rep)

    first = replan(_report())
    plan, sec = correct_plan(_report(), counted, _fake_measure(true, 1.0, calls), rounds=1,
                             held_out={"sequences": 2, "tokens": 8}, first=first)
    assert len(calls) == 2 and len(made) == 1 and made[0]["corrections"]["factors"]  # one re-plan, with factors
    assert sec["rounds"][0]["kld_pred"] == first.kld_pred


def test_batched_reference_measures_what_single_passes_measure():
    """``batch`` sequences a pass (the CUDA default batches the held-out sequences): prefix-state passes of a batch are
    the whole batched pass's bit for bit, a last partial batch included; the KLD equals the one-a-pass KLD to float32
    rounding; an unchanged model measures 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    chunks = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(3))
    ref = ReferenceLogits(model, chunks, prefix_states=True, batch=2)
    whole, single = ReferenceLogits(model, chunks, batch=2), ReferenceLogits(model, chunks)
    assert ref.states is not None and [b.shape[0] for b in ref.batches] == [2, 1] and single.batch == 1
    assert [lp.shape for lp in ref.logp] == [(2, 16, 128), (1, 16, 128)]
    assert ref.kld(model) == whole.kld(model) == 0.0
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(4)
    for names in (["model.layers.2.mlp.down_proj.weight"], ["lm_head.weight"], ["model.embed_tokens.weight"]):
        moved = {n: params[n].detach() + 0.05 * torch.randn(params[n].shape, generator=g) for n in names}
        with SwappedWeights(params, moved, names):
            got = ref.kld(model, start=ref.start_of(model, names))
            assert got == whole.kld(model) > 0
            assert got == pytest.approx(single.kld(model), rel=1e-4)
    with pytest.raises(ValueError, match="batch 0"):
        ReferenceLogits(model, chunks, batch=0)


def test_reference_batch_is_one_off_cuda():
    from dynaquant.analysis.sensitivity import reference_batch

    class M:
        class config:
            @staticmethod
            def get_text_config():
                return type("C", (), {"vocab_size": 128})

    assert reference_batch(M, torch.zeros(8, 16, dtype=torch.long), torch.device("cpu")) == 1
