"""The model card and the publishable output folder (``quantize --card``): metadata, numbers, layout, atomicity."""

from __future__ import annotations

import json
import re

import gguf
import pytest
from huggingface_hub import ModelCard, ModelCardData

from dynaquant.analysis.imatrix_io import load_imatrix
from dynaquant.cli import main
from dynaquant.config import QuantizeConfig
from dynaquant.exporters.card import CardFacts, GroupRow, MeasuredRow, build_card, tensor_group
from dynaquant.pipeline import publish
from dynaquant.pipeline.quantize import run_quantize

README = "---\nlicense: mit\nlanguage:\n- en\n- fr\n---\n# a tiny random model\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-block Llama checkpoint (rows of 256) whose README.md front matter names a license and languages."""
    from test_gguf_export import _tiny_checkpoint

    ckpt = tmp_path_factory.mktemp("card") / "tiny-llama"
    _tiny_checkpoint(ckpt, "llama", hidden_size=256, intermediate_size=512)
    (ckpt / "README.md").write_text(README)
    return ckpt


@pytest.fixture(scope="module")
def published(tiny, tmp_path_factory):
    """One published run: a dynamic 5 bpw plan with an analysis here, evaluated, beside the nearest preset."""
    out = tmp_path_factory.mktemp("pub") / "m.gguf"
    cfg = QuantizeConfig(output=out, bpw=6, calibration_chunks=3, n_ctx=64, evaluate=True, eval_chunks=2, device="cpu",
                         progress=False, fisher_sequences=1, card=True, compare_presets=True,
                         command="dynaquant quantize tiny-llama --bpw 6 --card")
    return run_quantize(str(tiny), cfg)


def _rows(text: str) -> dict[str, list[str]]:
    """The quality table's rows: label -> cells."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].endswith("bytes)"):
            rows[cells[0]] = cells
    return rows


def test_published_folder_holds_exactly_the_outputs(published):
    folder = published.folder
    assert folder.name == "m" and published.output == folder / "m.gguf"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["m.gguf", "README.md", "plan.json", "plan.png", "report.json", "report.html", "layer_errors.png", "imatrix.gguf"])
    assert sorted(p.name for p in folder.parent.iterdir()) == ["m"]  # no work folder, no temporary preset file
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(published.output).tensors} == published.plan.formats()
    plan_json = json.loads((folder / "plan.json").read_text())
    # the run's plan, naming the folder's own report and imatrix (relative: no local path of this machine)
    assert plan_json["sources"] == {"report": "report.json", "imatrix": "imatrix.gguf"}
    assert plan_json == json.loads(json.dumps(published.plan.to_dict() | {"sources": plan_json["sources"]}))
    rep = json.loads((folder / "report.json").read_text())
    assert rep["calibration"]["n_sequences"] == 3 and rep["calibration"]["seq_len"] == 64
    im = load_imatrix(folder / "imatrix.gguf")
    assert "blk.0.attn_q.weight" in im.names() and im.chunk_count == 3 and im.chunk_size == 64
    for png in ("plan.png", "layer_errors.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<html" in (folder / "report.html").read_text()[:500].lower()
    assert published.to_dict()["folder"] == str(folder)
    from dynaquant.pipeline.push import check_folder as check_publishable  # what 'dynaquant push' checks first

    checked = check_publishable(folder)
    assert checked.model_files == ("m.gguf",) and checked.base_model == "tiny-llama"


def test_card_metadata_parses_back_and_round_trips(published):
    card = ModelCard.load(published.folder / "README.md")
    d = card.data.to_dict()
    assert ModelCardData(**d).to_dict() == d
    assert d["base_model"] == "tiny-llama" and d["base_model_relation"] == "quantized"
    assert d["library_name"] == "gguf" and d["pipeline_tag"] == "text-generation"
    assert d["license"] == "mit" and d["language"] == ["en", "fr"]  # copied from the source's own card
    assert d["tags"] == ["gguf", "quantized", "dynaquant", "llama"]


def test_card_numbers_equal_the_run(published):
    text = (published.folder / "README.md").read_text()
    ev, rows = published.eval, _rows(text)
    ours = rows[f"this model ({published.plan.method})"]
    assert ours[1] == f"{published.size_bytes / 1e6:.2f} MB ({published.size_bytes} bytes)"
    assert ours[2:] == [f"{published.bpw:.4f}", f"{ev.kld_mean:.6f}", f"{ev.ppl:.4f}", f"{100 * ev.top1_agreement:.2f}%"]
    (label, preset), = [(k, v) for k, v in rows.items() if "uniform llama.cpp preset" in k]
    name = label.split()[0]
    assert name in publish.UNIFORM_PRESETS and float(preset[3]) >= 0 and preset[4] != "not measured"
    assert "dynaquant quantize tiny-llama --bpw 6 --card" in text
    assert f"({3 * 64} tokens)" in text and f"{ev.tokens} scored tokens" in text
    assert "llama-cli -m m.gguf" in text and "![" in text and "(layer_errors.png)" in text
    assert re.search(r"\| attention \| 8 \| \d+ \| ", text) and "| dense MLP | 6 |" in text


@pytest.fixture
def cheap(tiny, tmp_path):
    """A preset Q8_0 run (no imatrix, no analysis, no evaluation) into ``tmp_path/out``."""
    return QuantizeConfig(output=tmp_path / "out", preset="Q8_0", use_imatrix=False, device="cpu", progress=False,
                          card=True)


def test_card_without_eval_says_not_measured(tiny, cheap, tmp_path):
    res = run_quantize(str(tiny), cheap)
    folder = tmp_path / "out"
    assert res.folder == folder and res.output == folder / "out.gguf"  # -o OUTDIR: OUTDIR/OUTDIR.gguf
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "out.gguf", "plan.json", "plan.png"]
    text = (folder / "README.md").read_text()
    assert "Evaluation: not measured." in text and "| not measured | not measured | not measured |" in text
    assert "Calibration data: none" in text
    assert f"run_quantize({str(tiny)!r}, QuantizeConfig(output={str(tmp_path / 'out')!r}, preset='Q8_0', use_imatrix=False, " \
        "device='cpu', card=True))" in text  # the Python equivalent, with the output as given
    from dynaquant.pipeline.push import check_folder as check_publishable

    assert check_publishable(folder).files == ("README.md", "out.gguf", "plan.json", "plan.png")
    res2 = run_quantize(str(tiny), cheap)  # an earlier dynaquant folder is replaced
    assert res2.folder == folder and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_nothing_is_left_when_the_run_fails_mid_way(tiny, cheap, tmp_path, monkeypatch):
    def boom(facts):
        raise RuntimeError("card failed")

    monkeypatch.setattr(publish, "build_card", boom)
    with pytest.raises(RuntimeError, match="card failed"):
        run_quantize(str(tiny), cheap)
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_foreign_folder_and_contradictory_options(tiny, cheap, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not overwritten"):
        run_quantize(str(tiny), cheap)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
    assert main(["quantize", str(tiny), "--preset", "Q8_0", "--compare-presets", "-o", str(tmp_path / "x.gguf")]) == 2
    assert main(["quantize", str(tiny), "--preset", "Q8_0", "--card", "--compare-presets", "--no-eval",
                 "-o", str(tmp_path / "x.gguf")]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.gguf").exists()


def test_cli_card_with_a_gguf_name_makes_that_folder(tiny, tmp_path, capsys):
    argv = ["quantize", str(tiny), "--preset", "Q8_0", "--no-imatrix", "--card", "--no-eval", "-o",
            str(tmp_path / "my model.gguf"), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    folder = tmp_path / "my model"
    assert out["folder"] == str(folder) and out["output"] == str(folder / "my model.gguf")
    text = (folder / "README.md").read_text()
    assert f"dynaquant quantize {tiny} --preset Q8_0 --no-imatrix --card --no-eval -o '{tmp_path}/my model.gguf' --json" \
        in text


FACTS = CardFacts(target="safetensors", base_model="org/model", architecture="qwen2vl", model_files=("model.safetensors",),
                  command="dynaquant quantize org/model --format safetensors --bpw 4 --card", method="allocation bpw<=4",
                  rows=(MeasuredRow("this model", 123_456_789, 4.25),),
                  groups=(GroupRow("attention", 4, 1024, (("NVFP4_G16", 3), ("INT8_G128", 1)), 4.5),),
                  vision=True, assumptions={"memory": "24 GiB", "ctx": 8192})


def test_card_builder_on_hand_made_facts():
    card = build_card(FACTS)
    d = ModelCard(str(card)).data.to_dict()
    assert ModelCardData(**d).to_dict() == d
    assert d["library_name"] == "dynaquant" and d["pipeline_tag"] == "image-text-to-text"
    assert "license" not in d and "language" not in d and d["tags"] == ["safetensors", "quantized", "dynaquant", "qwen2vl",
                                                                        "vision"]
    assert "dynaquant.load(" in card.text and "llama-cli" not in card.text
    assert "| this model | 123.46 MB (123456789 bytes) | 4.2500 | not measured | not measured | not measured |" in card.text
    assert "- memory: 24 GiB" in card.text and "- ctx: 8192" in card.text
    assert "NVFP4_G16 (3, 4.5 bits), INT8_G128 (1, 8.125 bits)" in card.text


@pytest.mark.parametrize("name, group", [
    ("blk.3.attn_q.weight", "attention"), ("blk.3.attn_norm.weight", "other"), ("blk.3.ffn_down.weight", "dense MLP"),
    ("blk.3.ffn_down_exps.weight", "routed experts"), ("blk.3.ffn_up_shexp.weight", "shared experts"),
    ("blk.1.ffn_gate_inp.weight", "other"), ("token_embd.weight", "embeddings"), ("output.weight", "embeddings"),
    ("output_norm.weight", "other"), ("v.blk.2.attn_q.weight", "vision"), ("mm.0.weight", "vision"),
    ("model.layers.3.mlp.experts.5.down_proj.weight", "routed experts"), ("lm_head.weight", "embeddings"),
])
def test_tensor_groups(name, group):
    assert tensor_group(name) == group


def test_safetensors_checkpoint_gets_its_card_beside_its_shards(tiny, tmp_path):
    """``--format safetensors --card``: the checkpoint folder itself holds README.md, plan.json and plan.png."""
    from dynaquant.pipeline.source import model_info, open_tensor_source, tensor_infos
    from dynaquant.quant.planner import make_plan
    from dynaquant.sources.checkpoint import resolve_source

    ts = open_tensor_source(resolve_source(tiny))
    plan = make_plan(tensor_infos(ts), model_info(ts), "tiny", bpw=12.0, target="safetensors", rules=[r".*=INT8_G32"])
    res = run_quantize(str(tiny), QuantizeConfig(output=tmp_path / "ckpt", target="safetensors", plan=plan,
                                                 use_imatrix=False, device="cpu", progress=False, card=True))
    folder = tmp_path / "ckpt"
    assert res.folder == folder and res.output == folder and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    names = {p.name for p in folder.iterdir()}
    assert {"README.md", "plan.json", "plan.png", "config.json", "model.safetensors"} <= names
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "dynaquant" and card.data.tags[0] == "safetensors" and card.data.license == "mit"
    assert "dynaquant.load(" in card.text and "`model.safetensors`: model file" in card.text


def test_default_model_card_metadata_from_its_gguf(tmp_path):
    """The default model (a GGUF source): license and language from its ``general.license`` / ``general.languages``,
    ``base_model`` its file name; the card parses back and its size and bpw are the run's."""
    res = run_quantize(None, QuantizeConfig(output=tmp_path / "smol.gguf", preset="Q8_0", use_imatrix=False,
                                            progress=False, card=True))
    card = ModelCard.load(res.folder / "README.md")
    d = card.data.to_dict()
    assert ModelCardData(**d).to_dict() == d
    assert d["base_model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and d["license"] == "apache-2.0" and d["language"] == "en"
    assert d["tags"] == ["gguf", "quantized", "dynaquant", "llama"] and d["library_name"] == "gguf"
    row = _rows(card.text)[f"this model ({res.plan.method})"]
    assert row[1] == f"{res.size_bytes / 1e6:.2f} MB ({res.size_bytes} bytes)" and row[2] == f"{res.bpw:.4f}"
    assert res.output == tmp_path / "smol" / "smol.gguf" and res.output.stat().st_size == res.size_bytes


def test_published_plan_finds_its_imatrix_beside_it(published, tmp_path, capsys):
    """``plan --llama-quantize`` and ``quantize --plan`` on the folder's plan.json use the folder's imatrix.gguf,
    wherever the folder was moved (the relative name is resolved beside the plan file, not in the current folder)."""
    import shutil

    from dynaquant.pipeline.plan import imatrix_path, load_plan

    moved = shutil.copytree(published.folder, tmp_path / "moved")
    plan = load_plan(moved / "plan.json")
    assert imatrix_path(None, None, None, plan, str(moved / "plan.json")) == moved / "imatrix.gguf"
    assert main(["plan", str(moved / "plan.json"), "--llama-quantize", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["imatrix"] == str(moved / "imatrix.gguf")
