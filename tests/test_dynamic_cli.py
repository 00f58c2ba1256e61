"""The dynamic workflow from the command line: analyze -> plan -> quantize --plan -> llama.cpp, and report."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest

from dynaquant.analysis.imatrix_io import load_imatrix
from dynaquant.checkpoint import resolve_source

llama_cpp = pytest.importorskip("llama_cpp")


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dynaquant.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    d = tmp_path_factory.mktemp("analysis")
    r = _cli("analyze", "-o", str(d), "--sequences", "3", "--ctx", "128", "--fisher-sequences", "1",
             "--formats", "Q2_K,MXFP4,Q4_0,Q4_K,Q5_0,Q6_K,Q8_0", "--json")
    assert r.returncode == 0, r.stderr
    return d, json.loads(r.stdout)


def test_analyze_writes_report_and_llama_cpp_imatrix(analysis):
    d, out = analysis
    rep = json.loads((d / "report.json").read_text())
    assert rep["version"] == 1 and rep["calibration"]["tokens"] == 3 * 128 and rep["calibration"]["seq_len"] == 128
    assert rep["candidates"] == ["Q2_K", "MXFP4", "Q4_0", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    t = {e["name"]: e for e in rep["tensors"]}
    assert set(t["blk.3.ffn_down.weight"]["errors"]) == set(rep["candidates"])  # rows of 1536 take every type
    assert set(t["blk.3.ffn_up.weight"]["errors"]) == {"MXFP4", "Q4_0", "Q5_0", "Q8_0"}  # rows of 576: 32-blocks
    e = t["blk.3.ffn_down.weight"]["errors"]
    assert e["Q8_0"]["kld_pred"] < e["Q4_K"]["kld_pred"] < e["Q2_K"]["kld_pred"]
    assert t["token_embd.weight"]["errors"]["Q4_0"]["kld_pred"] > 0
    assert not t["output_norm.weight"]["quantizable"] and t["output_norm.weight"]["errors"] == {}
    assert len(rep["activations"]) == 4 * 30 + 1
    assert any(s["confirmed"] and s["tensor"] == "blk.11.ffn_down.weight" for s in out["super_weights"])
    im = load_imatrix(d / "imatrix.gguf")
    assert "blk.0.attn_q.weight" in im.names() and im.chunk_size == 128
    assert int(im.counts["blk.0.attn_q.weight"]) == 3 * 128


def test_plan_quantize_and_run_in_llama_cpp(analysis, tmp_path):
    d, _ = analysis
    plan_path = tmp_path / "plan.json"
    r = _cli("plan", str(d / "report.json"), "--size", "90MB", "-o", str(plan_path), "--rule", "attn_v>=Q8_0")
    assert r.returncode == 0, r.stderr
    plan = json.loads(plan_path.read_text())
    fmts = {t["name"]: t["format"] for t in plan["tensors"]}
    assert fmts["blk.11.ffn_down.weight"] == "Q8_0"  # super weight: default rule
    assert all(fmts[f"blk.{i}.attn_v.weight"] == "Q8_0" for i in range(30))  # user rule
    assert fmts["blk.0.ffn_gate.weight"] == "Q8_0"  # first block
    assert plan["kld_pred"] > 0 and plan["sources"]["imatrix"].endswith("imatrix.gguf")
    out = tmp_path / "dyn.gguf"
    r = _cli("quantize", "--plan", str(plan_path), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["imatrix_chunks"] == 0  # the analysis' imatrix file was used, nothing recomputed
    assert out.stat().st_size <= 90_000_000
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == fmts
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=128, verbose=False, seed=0)
    text = llm("The Python standard library", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert len(text.strip()) > 0


def test_report_renders(analysis, tmp_path):
    d, _ = analysis
    r = _cli("report", str(d / "report.json"), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "r.html").read_text()
    assert html.count("<img") >= 4 and "blk.11.ffn_down.weight" in html  # layer errors, activations (x2), ...


def test_bad_report_and_plan_inputs_exit_2(tmp_path):
    bad = tmp_path / "report.json"
    bad.write_text("{not json")
    r = _cli("plan", str(bad), "--bpw", "4")
    assert r.returncode == 2 and "report.json" in r.stderr
    r = _cli("report", str(bad), "-o", str(tmp_path / "x.html"))
    assert r.returncode == 2 and "report.json" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_quantize_reads_a_llama_imatrix_file(tmp_path):
    """An imatrix made by llama-imatrix (test fixture) drives the encoders; nothing is recomputed."""
    from pathlib import Path

    import dynaquant

    fixture = Path(__file__).parent / "data" / "imatrix_smollm2.gguf"
    res = dynaquant.quantize(None, preset="Q4_0", imatrix=fixture, output=tmp_path / "q.gguf", progress=False)
    assert res.imatrix_chunks == 0 and res.output.exists()
    assert resolve_source(res.output).kind == "gguf"


def test_quantize_with_gptq_rounding(tmp_path):
    """GPTQ rounding is kept where it lowers the held-out output error; the file stays llama.cpp's layout."""
    import dynaquant

    res = dynaquant.quantize(None, preset="Q4_0", gptq=True, calibration_chunks=4, n_ctx=128,
                             output=tmp_path / "g.gguf", progress=False)
    g = res.gptq["Q4_0"]
    assert g["tensors"] == 7 * 30 and g["gptq"] > 0.5 * g["tensors"] and g["mean_ratio"] < 1.0  # 512 tokens: some overfit
    llm = llama_cpp.Llama(model_path=str(res.output), n_ctx=128, verbose=False, seed=0)
    assert llm("Python is", max_tokens=4, temperature=0)["choices"][0]["text"].strip()
