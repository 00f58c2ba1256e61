"""The typed report.json (``analysis.report.schema.Report``): the documented layout is the dataclasses', a real report
round-trips key for key with no key unknown to the schema, and ``Report.from_dict`` / ``Report.load`` refuse what
``load_report`` refuses, with the same message."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from test_report_html import make_report

from dynaquant.analysis.report import schema
from dynaquant.analysis.report.schema import Record, Report, load_report, save_report
from dynaquant.errors import InputError

CANDIDATES = ("Q4_0", "Q8_0")


def _records(cls, seen=None) -> set:
    """``cls`` and every record class its fields hold."""
    seen = set() if seen is None else seen
    seen.add(cls)
    for f in dataclasses.fields(cls):
        for key in ("list_of", "one", "map_of"):
            sub = f.metadata.get(key)
            if sub is not None and sub not in seen:
                _records(sub, seen)
    return seen


def test_the_documented_layout_is_the_dataclasses():
    layout = schema.schema_layout()
    assert layout in schema.__doc__, ("the module docstring's layout differs from the dataclasses: paste "
                                      "schema_layout() into it\n" + layout)
    documented = {line.split(":")[0][2:] for line in layout.splitlines() if line.startswith("- ")}
    assert documented == {c.__name__ for c in _records(Report)}  # every record class is documented
    for cls in _records(Report):  # and every one of its fields, in order
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("present", "extra")]
        line = next(x for x in layout.split("\n- ") if x.lstrip("- ").startswith(cls.__name__ + ":"))
        assert [w.split("``")[0] for w in line.split("``")[1::2]] == names


def test_a_field_added_to_a_record_changes_the_layout(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Wider(schema.PlanCheck):
        extra_field: int | None = None

    before = schema.schema_layout()
    monkeypatch.setattr(schema, "PlanCheck", Wider)
    assert "``extra_field``" not in before
    assert schema.schema_layout() != before  # so the docstring check above fails until the docstring follows


def _unknown_keys(rec: Record, where: str = "report") -> list[str]:
    out = [f"{where}.{k}" for k in rec.extra]
    for f in dataclasses.fields(rec):
        v = getattr(rec, f.name)
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, tuple) else [(None, v)]
        for k, x in items:
            if isinstance(x, Record):
                out += _unknown_keys(x, f"{where}.{f.name}" + (f"[{k}]" if k is not None else ""))
    return out


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    """A tiny Llama checkpoint analysed with sensitivity rows and a validated plan: (report dict, report.json path)."""
    from test_gguf_export import _tiny_checkpoint

    import dynaquant
    from dynaquant.analysis.calibration import CalibrationSpec

    root = tmp_path_factory.mktemp("schema")
    _tiny_checkpoint(root / "ckpt", "llama")
    res = dynaquant.analyze(root / "ckpt", root / "an", calibration=CalibrationSpec((), 3, 32), candidates=CANDIDATES,
                            fisher_sequences=1, sensitivity_formats=("Q4_0",), validate_presets=("Q8_0",), progress=False)
    return res.report, res.report_path


def test_a_real_report_round_trips(real_report):
    d, path = real_report
    written = json.loads(path.read_text(encoding="utf-8"))
    for r in (Report.load(path), Report.from_dict(copy.deepcopy(written), path)):
        assert r.to_dict() == written and list(r.to_dict()) == list(written)
        assert json.dumps(r.to_dict(), indent=1) == json.dumps(written, indent=1)  # key order too
        assert _unknown_keys(r) == []  # every key the analysis writes is in the schema
        assert r.version == schema.SCHEMA_VERSION and r.candidates == list(CANDIDATES)
        assert r.model.n_layers == d["model"]["n_layers"] and len(r.tensors) == len(d["tensors"])
        t = next(t for t in r.tensors if t.quantizable)
        assert t.errors["Q4_0"].kld_pred == written["tensors"][r.tensors.index(t)]["errors"]["Q4_0"]["kld_pred"]
        assert r.sensitivity and r.sensitivity[0].format == "Q4_0" and r.plans and r.plans[0].label == "Q8_0 size"
        assert r.imatrix == "imatrix.gguf" and r.activations and r.activations[0].module
    assert load_report(path) == written


def test_the_html_fixture_and_sparse_dicts_round_trip(tmp_path):
    full = json.loads(json.dumps(make_report()))
    assert Report.from_dict(copy.deepcopy(full)).to_dict() == full
    sparse = {"tensors": [{"shape": [4, 4], "name": "blk.0.attn_q.weight", "mine": {"a": [1]}}], "candidates": [],
              "version": 1, "model": None, "activations": [1, 2], "sensitivity": [{"group": "g", "kld": None}]}
    r = Report.from_dict(copy.deepcopy(sparse))
    assert r.to_dict() == sparse and list(r.to_dict()) == list(sparse)  # absent stays absent, null stays null
    assert r.model is None and r.activations == () and r.extra == {"model": None, "activations": [1, 2]}
    assert r.tensors[0].errors == {} and r.tensors[0].extra == {"mine": {"a": [1]}}
    assert r.tensors[0].quantizable is True and r.tensors[0].hf_name is None  # absent: as the planner reads it
    built = Report(candidates=["Q4_0"], tensors=(schema.TensorEntry(name="x", shape=[2]),))
    d = built.to_dict()
    assert d["version"] == 1 and d["tensors"][0]["name"] == "x" and Report.from_dict(d).to_dict() == d
    save_report(d, tmp_path / "r.json")
    assert Report.load(tmp_path / "r.json").to_dict() == d


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("tensors"), "not a dynaquant analysis report"),
    (lambda d: d["tensors"].append(dict(d["tensors"][0])), "tensor blk.0.ffn_down.weight appears twice"),
    (lambda d: d.update(candidates=["Q9_9"]), "candidates must be a list of format names"),
    (lambda d: d.update(version=True), "report version True"),
    (lambda d: d.update(version=2), "report version 2, this dynaquant reads version 1"),
    (lambda d: d["model"].update(n_layers="2"), "model.n_layers must be an integer"),
    (lambda d: d["tensors"][0].update(shape=[256.0, 512]), "shape must be"),
    (lambda d: d["tensors"][0]["errors"]["Q4_0"].update(kld_pred=-0.5), "errors.Q4_0.kld_pred is -0.5"),
    (lambda d: d.update(sensitivity=[{"group": "blk.0.ffn", "kld": -1.0}]), "sensitivity[0] (blk.0.ffn).kld is -1.0"),
    (lambda d: d.update(super_weights=[{"confirmed": True}]), "super_weights[0] is confirmed but lacks"),
    (lambda d: d.update(imatrix=3), "imatrix must be a file name"),
])
def test_typed_loading_refuses_what_load_report_refuses(tmp_path, change, message):
    d = {"version": 1, "model": {"id": "tiny", "n_layers": 1}, "candidates": ["Q4_0", "Q8_0"],
         "tensors": [{"name": "blk.0.ffn_down.weight", "shape": [256, 512],
                      "errors": {"Q4_0": {"size_bytes": 73728, "bpw": 4.5, "kld_pred": 0.09}}}]}
    change(d)
    p = tmp_path / "report.json"
    p.write_text(json.dumps(d))
    with pytest.raises(InputError) as old:
        load_report(p)
    with pytest.raises(InputError) as new:
        Report.load(p)
    with pytest.raises(InputError) as from_dict:
        Report.from_dict(d, p)
    assert str(old.value).startswith(f"{p}: ") and message in str(old.value), str(old.value)
    assert str(new.value) == str(old.value) == str(from_dict.value)
    p.write_text("{not json")
    with pytest.raises(InputError, match="cannot read report"):
        Report.load(p)


def test_the_page_draws_a_typed_report_as_its_dict():
    from dynaquant.analysis.report.html import build_report_page

    d = make_report(n_layers=2, kinds=("attn_q", "ffn_down"))
    d["activations"], d["sensitivity"], d["plans"] = [], [], d["plans"][:1]
    d = json.loads(json.dumps(d))
    assert build_report_page(Report.from_dict(copy.deepcopy(d))).html == build_report_page(d).html
