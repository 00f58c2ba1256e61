"""The dynamic workflow from the command line: analyze -> plan -> quantize --plan -> llama.cpp, and report."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest
import torch

from dynaquant.analysis.imatrix_io import load_imatrix
from dynaquant.sources.checkpoint import default_model_path, resolve_source

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
    # llama.cpp's Q4_0 mix with an imatrix puts ffn_down of blocks 0-2 (n_layer / 8) in Q4_1, the type the default
    # model stores them in: the source's bytes are kept (error 0), not GPTQ-rounded
    assert "Q4_1" not in res.gptq and res.plan.formats()["blk.2.ffn_down.weight"] == "Q4_1"
    src = {t.name: t for t in gguf.GGUFReader(default_model_path()).tensors}
    out = {t.name: t for t in gguf.GGUFReader(res.output).tensors}
    assert all(out[f"blk.{i}.ffn_down.weight"].data.tobytes() == src[f"blk.{i}.ffn_down.weight"].data.tobytes()
               for i in range(3))
    assert g["tensors"] == 7 * 30 - 3 and g["gptq"] > 0.5 * g["tensors"] and g["mean_ratio"] < 1.0  # 512 tokens: some overfit
    llm = llama_cpp.Llama(model_path=str(res.output), n_ctx=128, verbose=False, seed=0)
    assert llm("Python is", max_tokens=4, temperature=0)["choices"][0]["text"].strip()


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory):
    """A random 2-block Llama checkpoint (tiny BPE tokenizer) whose rows are multiples of 256, and a plan
    for it: Q4_0 (preset) with ``ffn_down`` in IQ3_XXS."""
    from test_gguf_export import _tiny_checkpoint

    from dynaquant.pipeline.source import model_info, open_tensor_source, tensor_infos
    from dynaquant.quant.planner import make_plan

    ckpt = tmp_path_factory.mktemp("tiny256") / "ckpt"
    _tiny_checkpoint(ckpt, "llama", hidden_size=256, intermediate_size=512)
    ts = open_tensor_source(resolve_source(ckpt))
    plan = make_plan(tensor_infos(ts), model_info(ts), preset="Q4_0", rules=["ffn_down=IQ3_XXS"], has_imatrix=True)
    assert plan.formats()["blk.1.ffn_down.weight"] == "IQ3_XXS"
    return ckpt, plan


def test_gptq_rounds_lattice_iquants_by_blocks(tiny256, tmp_path):
    """IQ3_XXS has no per-weight grid: GPTQ rounds it a 256-column super-block at a time (quant.gptq), the rest
    column by column; each tensor keeps the rounding with the lower held-out error; floats are refused."""
    import dynaquant
    from dynaquant.quant.codecs import dequantize
    from dynaquant.quant.gptq import gptq_round, supports_gptq

    assert supports_gptq("IQ3_XXS") and supports_gptq("IQ1_S") and not supports_gptq("F16") and supports_gptq("IQ4_XS")
    assert supports_gptq("NVFP4") and supports_gptq("Q4_0")
    with pytest.raises(ValueError, match="quantized block format"):
        gptq_round(torch.randn(4, 256), "F16", torch.eye(256))
    r = gptq_round(torch.randn(4, 512), "IQ3_S", torch.eye(512))
    assert torch.equal(dequantize(r.data, "IQ3_S").reshape(4, 512), r.decoded)
    ckpt, plan = tiny256
    res = dynaquant.quantize(str(ckpt), plan=plan, gptq=True, calibration_chunks=3, n_ctx=64, device="cpu",
                             output=tmp_path / "g.gguf", progress=False)
    iq = res.gptq["IQ3_XXS"]
    assert iq["tensors"] == 2 and not iq.get("plain_only") and iq["mean_ratio"] is not None
    assert res.gptq["Q4_0"]["tensors"] == 2 * 6  # attention and ffn_gate/up; token_embd is not GPTQ'd
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(res.output)).tensors}
    assert types == plan.formats()


def test_quantize_refuses_imatrix_formats_without_an_imatrix(tiny256, tmp_path):
    """As llama-quantize: IQ3_XXS/IQ2_*/IQ1_* tensors (outside token_embd/output) need an imatrix."""
    import dynaquant

    ckpt, plan = tiny256
    with pytest.raises(ValueError, match=r"2 tensor\(s\) .* need an imatrix .*blk\.0\.ffn_down\.weight \(IQ3_XXS\)"):
        dynaquant.quantize(str(ckpt), plan=plan, use_imatrix=False, output=tmp_path / "a.gguf", progress=False)
    with pytest.raises(ValueError, match="need an imatrix"):
        dynaquant.quantize(str(ckpt), preset="IQ2_XXS", use_imatrix=False, output=tmp_path / "b.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []
    # without an imatrix the IQ3_S / IQ4_XS mixes need none, and dynamic plans avoid those formats
    res = dynaquant.quantize(str(ckpt), preset="IQ4_XS", use_imatrix=False, output=tmp_path / "c.gguf", progress=False)
    assert "IQ4_XS" in res.plan.count_by_format()
