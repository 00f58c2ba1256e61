"""Issue 13, defects 3, 7 and the plan part of 4: non-finite weights, plans and reports refused with exit 2.

One tiny random Llama checkpoint (rows of 256, so Q4_K fits) per module, and a copy with one NaN and one Inf
in ``model.layers.0.mlp.down_proj.weight``.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import gguf
import numpy as np
import pytest
import torch

BAD_HF = "model.layers.0.mlp.down_proj.weight"
BAD_GGUF = "blk.0.ffn_down.weight"
NAN_AT, INF_AT = (3, 5), (7, 100)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(good folder, bad folder): the bad one's down_proj of block 0 holds a NaN at NAN_AT and +Inf at INF_AT."""
    from safetensors.torch import load_file, save_file
    from test_gguf_export import _tiny_checkpoint

    root = tmp_path_factory.mktemp("nonfinite")
    good, bad = root / "good", root / "bad"
    _tiny_checkpoint(good, "llama", hidden_size=256, intermediate_size=512)
    shutil.copytree(good, bad)
    sd = load_file(bad / "model.safetensors")
    sd[BAD_HF][NAN_AT] = float("nan")
    sd[BAD_HF][INF_AT] = float("inf")
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    return good, bad


def _main(capsys, *argv) -> tuple[int, str]:
    from dynaquant.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def _assert_names_the_bad_tensor(err: str, bad) -> None:
    assert str(bad / "model.safetensors") in err
    assert BAD_HF in err and BAD_GGUF in err
    assert "2 non-finite values (1 NaN, 1 Inf)" in err and f"first at {list(NAN_AT)}" in err
    assert "--allow-nonfinite" in err


def _dequantized(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])) for t in r.tensors}


# -- non-finite weights ----------------------------------------------------------------------------------------


def test_check_finite_names_counts_and_replaces():
    from dynaquant.errors import InputError
    from dynaquant.sources.nonfinite import check_finite, replace_nonfinite

    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, generator=g)
    assert check_finite(w, "tensor x", "f.safetensors") is w
    ints = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert check_finite(ints, "tensor p", "f") is ints
    w[2, 3], w[4, 1], w[0, 6] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(InputError, match=r"^f\.safetensors: tensor x has 3 non-finite values \(1 NaN, 2 Inf\), "
                                         r"the first at \[0, 6\];.*--allow-nonfinite"):
        check_finite(w, "tensor x", "f.safetensors")
    fixed = check_finite(w, "tensor x", "f.safetensors", allow_nonfinite=True)
    finite = w[torch.isfinite(w)].abs().max()
    assert torch.isfinite(fixed).all() and fixed.dtype == w.dtype and fixed.shape == w.shape
    assert fixed[2, 3] == 0 and fixed[4, 1] == finite and fixed[0, 6] == -finite
    keep = torch.isfinite(w)
    assert torch.equal(fixed[keep], w[keep])
    assert torch.equal(replace_nonfinite(torch.full((3,), float("nan"), dtype=torch.float16)),
                       torch.zeros(3, dtype=torch.float16))
    h = torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)
    assert replace_nonfinite(h).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M"])
def test_nonfinite_weights_exit_2_on_preset_paths(ckpts, tmp_path, capsys, preset):
    _, bad = ckpts
    out = tmp_path / "out.gguf"
    rc, err = _main(capsys, "quantize", bad, "--preset", preset, "--no-eval", "--no-imatrix", "-o", out)
    assert rc == 2, err
    _assert_names_the_bad_tensor(err, bad)
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no output, no temporary file left


def test_nonfinite_weights_refused_before_the_imatrix_pass(ckpts, tmp_path, monkeypatch):
    """The preset path that calibrates checks the loaded model before its first forward pass."""
    import dynaquant.pipeline.quantize as pipeline
    from dynaquant.errors import InputError

    def no_forward(*a, **k):
        raise AssertionError("the imatrix pass ran on a model with NaN weights")

    monkeypatch.setattr(pipeline, "compute_imatrix", no_forward)
    _, bad = ckpts
    with pytest.raises(InputError, match=rf"{BAD_HF} \(GGUF {BAD_GGUF}\) has 2 non-finite"):
        pipeline.quantize(bad, output=tmp_path / "o.gguf", preset="Q4_K_M", calibration_chunks=2, n_ctx=64,
                          progress=False, device="cpu")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M"])
def test_allow_nonfinite_writes_a_finite_file(ckpts, tmp_path, capsys, caplog, preset):
    good, bad = ckpts
    out, ref = tmp_path / "out.gguf", tmp_path / "ref.gguf"
    rc, err = _main(capsys, "quantize", bad, "--preset", preset, "--no-eval", "--no-imatrix", "--allow-nonfinite",
                    "-o", out)
    assert rc == 0, err
    assert any(BAD_HF in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert _main(capsys, "quantize", good, "--preset", preset, "--no-eval", "--no-imatrix", "-o", ref)[0] == 0
    got, want = _dequantized(out), _dequantized(ref)
    assert all(np.isfinite(v).all() for v in got.values())
    # every other tensor is bit-identical to the clean checkpoint's
    assert all(np.array_equal(got[k], want[k]) for k in want if k != BAD_GGUF)
    d = got[BAD_GGUF]
    # GGUF row of ffn_down is the input (512) axis: torch [row, col] is d[row, col] here
    top = np.abs(want[BAD_GGUF]).max()
    assert abs(d[NAN_AT]) < 0.1 * top  # NaN -> 0 (within the block's rounding step)
    assert d[INF_AT] == pytest.approx(top, rel=0.1)  # +Inf -> the tensor's largest |value| (not 0, not 3.4e38)


def test_nonfinite_weights_exit_2_on_the_dynamic_path_before_calibration(ckpts, tmp_path, capsys, monkeypatch):
    import dynaquant.pipeline.analyze as ap

    def no_analysis(*a, **k):
        raise AssertionError("the analysis ran on a model with NaN weights")

    monkeypatch.setattr(ap, "run_analysis", no_analysis)
    _, bad = ckpts
    rc, err = _main(capsys, "quantize", bad, "--no-eval", "--calibration-chunks", "2", "--ctx", "64", "--device", "cpu",
                    "-o", tmp_path / "o.gguf")
    assert rc == 2, err
    _assert_names_the_bad_tensor(err, bad)
    rc, err = _main(capsys, "analyze", bad, "-o", tmp_path / "an", "--sequences", "2", "--ctx", "64", "--device", "cpu")
    assert rc == 2, err
    _assert_names_the_bad_tensor(err, bad)
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "an" / "report.json").exists()


def test_nonfinite_weights_stream_refused_or_replaced_as_without(ckpts, tmp_path, capsys):
    """--stream: the weights are read block by block, each checked as it is read: refused (exit 2, the tensor and its
    file named, no output), or with --allow-nonfinite replaced as the whole-model run replaces them."""
    _, bad = ckpts
    args = ["--no-eval", "--calibration-chunks", "2", "--ctx", "64", "--device", "cpu"]
    rc, err = _main(capsys, "quantize", bad, *args, "--stream", "-o", tmp_path / "s.gguf")
    assert rc == 2, err
    _assert_names_the_bad_tensor(err, bad)
    assert not (tmp_path / "s.gguf").exists()
    rc, err = _main(capsys, "analyze", bad, "-o", tmp_path / "an", "--sequences", "2", "--ctx", "64", "--device", "cpu",
                    "--stream")
    assert rc == 2, err
    _assert_names_the_bad_tensor(err, bad)
    assert _main(capsys, "quantize", bad, *args, "--allow-nonfinite", "-o", tmp_path / "w.gguf")[0] == 0
    # (s.gguf.work, the refused run's folder, holds a run of other options: refused; another output)
    rc, err = _main(capsys, "quantize", bad, *args, "--allow-nonfinite", "--stream", "-o", tmp_path / "s.gguf")
    assert rc == 2 and "work folder of another run" in err and "allow_nonfinite" in err, err
    assert _main(capsys, "quantize", bad, *args, "--allow-nonfinite", "--stream", "-o", tmp_path / "t.gguf")[0] == 0
    got, want = _dequantized(tmp_path / "t.gguf"), _dequantized(tmp_path / "w.gguf")
    assert all(np.isfinite(v).all() for v in got.values()) and got.keys() == want.keys()
    # (the plans may differ: the block-wise analysis samples rows by output energy); the replaced values agree
    assert abs(got[BAD_GGUF][NAN_AT]) < 0.1 and abs(want[BAD_GGUF][NAN_AT]) < 0.1


def test_an_unchecked_skeleton_keeps_nonfinite_weights_for_the_caller(ckpts):
    """``build_skeleton(checked=False)`` (the whole-model load of a GGUF file, ``checkpoint._gguf_model``) gives the
    weights as stored, NaN and Inf included, for ``check_model_finite`` to refuse naming the tensor as after
    transformers' loader; a checked skeleton refuses them as it reads the part."""
    from dynaquant.errors import InputError
    from dynaquant.sources.checkpoint import resolve_source
    from dynaquant.sources.nonfinite import check_model_finite, source_names
    from dynaquant.sources.open import open_hf_source
    from dynaquant.sources.skeleton import OUTER, build_skeleton

    _, bad = ckpts
    source, ts = resolve_source(bad), open_hf_source(bad)
    sk = build_skeleton(source, ts, checked=False)
    for part in (OUTER, *range(sk.n_blocks)):
        sk.materialize(part)
    w = sk.model.get_parameter(BAD_HF)
    assert torch.isnan(w[NAN_AT]) and torch.isinf(w[INF_AT]) and int((~torch.isfinite(w)).sum()) == 2
    with pytest.raises(InputError) as e:
        check_model_finite(sk.model, source_names(ts), str(bad / "model.safetensors"))
    _assert_names_the_bad_tensor(str(e.value), bad)
    with pytest.raises(InputError) as e:
        build_skeleton(source, ts).materialize(0)
    _assert_names_the_bad_tensor(str(e.value), bad)


def test_allow_nonfinite_on_the_dynamic_path(ckpts, tmp_path, capsys):
    _, bad = ckpts
    out = tmp_path / "o.gguf"
    rc, err = _main(capsys, "quantize", bad, "--no-eval", "--calibration-chunks", "2", "--ctx", "64", "--device", "cpu",
                    "--allow-nonfinite", "-o", out)
    assert rc == 0, err
    assert all(np.isfinite(v).all() for v in _dequantized(out).values())


# -- plans ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8_plan(ckpts):
    """The good checkpoint's Q8_0 preset plan as a JSON dict."""
    from dynaquant.pipeline.source import model_info, tensor_infos
    from dynaquant.quant.planner import make_plan
    from dynaquant.sources.open import open_hf_source

    ts = open_hf_source(ckpts[0])
    return make_plan(tensor_infos(ts), model_info(ts), "tiny", preset="Q8_0").to_dict()


def _mutate(d: dict, how: str) -> dict:
    d = json.loads(json.dumps(d))
    t = d["tensors"]
    if how == "duplicate":
        t.append(dict(t[3], format="F16"))
    elif how == "format 5":
        t[3]["format"] = 5
    elif how == "format null":
        t[3]["format"] = None
    elif how == "tensors 5":
        d["tensors"] = 5
    elif how == "no name":
        del t[3]["name"]
    elif how == "no shape":
        del t[3]["shape"]
    elif how == "shape str":
        t[3]["shape"] = "256x512"
    elif how == "shape empty":
        t[3]["shape"] = []
    elif how == "shape negative":
        t[3]["shape"] = [-256, 512]
    elif how == "entry list":
        t[3] = ["blk.0.ffn_down.weight", "Q8_0"]
    elif how == "kld negative":
        t[3]["kld_pred"] = -0.5
    elif how == "kld nan":
        t[3]["kld_pred"] = float("nan")
    elif how == "hf_name int":
        t[3]["hf_name"] = 7
    elif how == "budget str":
        d["budget"] = {"bpw": "4.5"}
    elif how == "over budget":
        d["budget"] = {"bpw": 4.5}  # Q8_0 everywhere is 8.5 bpw
    elif how == "version 2":
        d["version"] = 2
    elif how == "rules dict":
        d["rules"] = {"a": 1}
    elif how == "no target":
        del d["target"]
    elif how == "top list":
        d = [d]
    return d


MUTATIONS = {  # mutation -> what the message must say (besides the file name)
    "duplicate": "appears twice", "format 5": "format must be a format name", "format null": "format must be",
    "tensors 5": "'tensors' must be a list", "no name": "tensor #3 lacks name", "no shape": "lacks shape",
    "shape str": "shape must be", "shape empty": "shape must be", "shape negative": "shape must be",
    "entry list": "tensor #3 is not an object", "kld negative": "kld_pred must be", "kld nan": "kld_pred must be",
    "hf_name int": "hf_name must be", "budget str": "budget bpw must be", "over budget": "above the plan's own budget",
    "version 2": "plan version 2", "rules dict": "'rules' must be a list", "no target": "missing 'target'",
    "top list": "not a plan",
}


@pytest.mark.parametrize("how", list(MUTATIONS))
def test_bad_plan_entries_are_named(q8_plan, tmp_path, how):
    from dynaquant.pipeline.plan import load_plan as _load_plan

    p = tmp_path / "plan.json"
    p.write_text(json.dumps(_mutate(q8_plan, how)))
    with pytest.raises(ValueError) as info:
        _load_plan(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: ") and MUTATIONS[how] in msg, msg
    if how in ("duplicate", "format 5", "format null", "shape str", "kld negative", "hf_name int"):
        assert q8_plan["tensors"][3]["name"] in msg  # the entry, by name


def test_plan_budget_message_names_budget_and_size(q8_plan, tmp_path):
    from dynaquant.quant.plan import Plan

    d = _mutate(q8_plan, "over budget")
    plan = Plan.from_dict(q8_plan)
    size = plan.size_bytes
    assert 8.5 < plan.bpw < 8.6  # Q8_0, norms in F32
    with pytest.raises(ValueError, match=rf"p\.json: the entries need {size} bytes of tensor data \({plan.bpw:.4f} bpw\), "
                                         r"above the plan's own budget of 4\.5 bpw"):
        Plan.from_dict(d, "p.json")
    d["budget"] = {"size_bytes": size - 1}
    with pytest.raises(ValueError, match=rf"above the plan's own budget of {size - 1} bytes"):
        Plan.from_dict(d, "p.json")
    d["budget"] = {"size_bytes": size}  # exactly at the budget: accepted
    assert Plan.from_dict(d, "p.json").size_bytes == size


def test_bad_plans_exit_2_from_the_cli(ckpts, q8_plan, tmp_path, capsys):
    good, _ = ckpts
    for how in ("duplicate", "format 5", "tensors 5", "over budget"):
        p = tmp_path / f"{how.replace(' ', '_')}.json"
        p.write_text(json.dumps(_mutate(q8_plan, how)))
        rc, err = _main(capsys, "quantize", good, "--plan", p, "--no-eval", "--no-imatrix", "-o", tmp_path / "o.gguf")
        assert rc == 2 and str(p) in err and "Traceback" not in err, (how, err)
    assert not (tmp_path / "o.gguf").exists()


def test_a_plans_missing_imatrix_is_refused(ckpts, q8_plan, tmp_path, capsys):
    good, _ = ckpts
    d = dict(q8_plan, sources={"imatrix": str(tmp_path / "gone" / "imatrix.gguf")})
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(d))
    out = tmp_path / "o.gguf"
    rc, err = _main(capsys, "quantize", good, "--plan", p, "--no-eval", "-o", out)
    assert rc == 2 and str(p) in err and str(tmp_path / "gone" / "imatrix.gguf") in err and "--imatrix" in err, err
    assert not out.exists()
    rc, err = _main(capsys, "quantize", good, "--plan", p, "--no-eval", "--no-imatrix", "-o", out)
    assert rc == 0, err
    assert out.is_file()


# -- reports -------------------------------------------------------------------------------------------------


def _report(**tensor_changes) -> dict:
    """A small valid report dict (two tensors, measured in Q8_0 and Q4_0), with ``tensor_changes`` applied to the first."""
    t = [{"name": "blk.0.ffn_down.weight", "hf_name": BAD_HF, "shape": [256, 512], "quantizable": True,
          "errors": {"Q4_0": {"size_bytes": 73728, "bpw": 4.5, "weighted_rel": 0.006, "output_rel": 0.08,
                              "kld_pred": 0.09},
                     "Q8_0": {"size_bytes": 139264, "bpw": 8.5, "weighted_rel": 2e-5, "output_rel": 0.004,
                              "kld_pred": 0.0003}}},
         {"name": "output_norm.weight", "hf_name": "model.norm.weight", "shape": [256], "quantizable": False, "errors": {}}]
    for k, v in tensor_changes.items():
        fmt, field = k.split("__")
        t[0]["errors"][fmt][field] = v
    return {"version": 1, "model": {"id": "tiny", "n_layers": 1, "gguf_overhead_bytes": 4096},
            "candidates": ["Q4_0", "Q8_0"], "tensors": t}


@pytest.mark.parametrize("field,value", [("kld_pred", -0.5), ("kld_pred", float("nan")), ("kld_pred", float("inf")),
                                         ("output_rel", -1.0), ("size_bytes", "big"), ("bpw", True)])
def test_reports_with_negative_or_nan_errors_are_refused(tmp_path, capsys, field, value):
    from dynaquant.analysis.report.schema import load_report
    from dynaquant.errors import InputError

    p = tmp_path / "report.json"
    p.write_text(json.dumps(_report(**{f"Q4_0__{field}": value})))  # NaN/Infinity as JSON writes them
    with pytest.raises(InputError, match=rf"^{re.escape(str(p))}: tensor blk\.0\.ffn_down\.weight: errors\.Q4_0\.{field} is "):
        load_report(p)
    rc, err = _main(capsys, "plan", p, "--bpw", "8", "-o", tmp_path / "plan.json")
    assert rc == 2 and f"{p}: tensor blk.0.ffn_down.weight: errors.Q4_0.{field}" in err, err
    assert not (tmp_path / "plan.json").exists()


def test_a_valid_report_still_plans(tmp_path, capsys):
    p = tmp_path / "report.json"
    p.write_text(json.dumps(_report()))
    rc, err = _main(capsys, "plan", p, "--bpw", "8", "--no-default-rules", "-o", tmp_path / "plan.json")
    assert rc == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [t["format"] for t in plan["tensors"]] == ["Q4_0", "F32"]  # 8 bpw leaves no room for Q8_0
    assert math.isclose(plan["kld_pred"], 0.09)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["tensors"].append(dict(d["tensors"][0])), "tensor blk.0.ffn_down.weight appears twice"),
    (lambda d: d.update(candidates=["Q9_9"]), "candidates must be a list of format names"),
    (lambda d: d.update(version=True), "report version True"),
    (lambda d: d["model"].update(n_layers="2"), "model.n_layers must be an integer"),
    (lambda d: d["tensors"][0].update(shape=[256.0, 512]), "shape must be"),
    (lambda d: d.update(sensitivity=[{"group": "blk.0.ffn", "kld": -1.0}]), "sensitivity[0] (blk.0.ffn).kld is -1.0"),
])
def test_malformed_reports_are_named(tmp_path, change, message):
    from dynaquant.analysis.report.schema import load_report
    from dynaquant.errors import InputError

    d = _report()
    change(d)
    p = tmp_path / "report.json"
    p.write_text(json.dumps(d))
    with pytest.raises(InputError) as info:
        load_report(p)
    assert str(info.value).startswith(f"{p}: ") and message in str(info.value), str(info.value)


@pytest.mark.parametrize("command", ["quantize", "analyze"])
def test_cli_passes_allow_nonfinite(monkeypatch, capsys, command):
    import importlib

    from dynaquant.errors import InputError

    seen = []

    def fake(*a, **k):
        seen.append(a[-1].allow_nonfinite)  # the stage's config
        raise InputError("stop here")

    # the CLI calls the pipeline stage's function with the config it built (it does not import the package's face)
    monkeypatch.setattr(importlib.import_module(f"dynaquant.pipeline.{command}"), f"run_{command}", fake)
    assert _main(capsys, command, "some-model", "--no-eval" if command == "quantize" else "--no-super-weights")[0] == 2
    assert _main(capsys, command, "some-model", "--allow-nonfinite")[0] == 2
    assert seen == [False, True]


def test_all_finite_is_isfinite_all():
    """The finiteness check by the tensor's sum (nonfinite.all_finite) agrees with ``isfinite(w).all()``: NaN, +-Inf,
    both Infs (sum NaN), finite values whose sum overflows (settled by the full check), half and double precision."""
    from dynaquant.sources.nonfinite import all_finite

    big = torch.full((4,), 3e38)
    cases = [torch.randn(1000), big, torch.full((3,), 60000.0, dtype=torch.float16), torch.randn(5, dtype=torch.float64),
             torch.randn(7, dtype=torch.bfloat16)]
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            x = torch.randn(1000, dtype=dtype)
            x[517] = bad
            cases.append(x)
    both = torch.randn(100)
    both[3], both[9] = float("inf"), -float("inf")
    cases += [both, torch.tensor([3e38, float("inf")])]
    for x in cases:
        assert all_finite(x) == bool(torch.isfinite(x).all()), x
    assert all_finite(big) and all_finite(cases[2]) and not all_finite(both)
