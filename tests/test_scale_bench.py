"""benchmarks/scale.py's pieces on tiny shapes: the FP8 release format it writes reads back through the HF source,
and the per-block extrapolation is linear in the blocks. (The benchmark itself runs on the device.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scale  # noqa: E402
from test_gguf_export import _tiny_tokenizer  # noqa: E402


def test_fp8_checkpoint_reads_back_as_its_bf16_values(tmp_path):
    """A tiny DeepSeek-V3 cut to 2 blocks, made as the benchmark makes it (BF16, then FP8 e4m3 with 128 x 128 block
    scales as the release stores it): the HF source dequantizes each projection to within FP8's rounding of the BF16
    value, and leaves embeddings, norms and routers as they were."""
    from safetensors import safe_open

    from dynaquant.sources.open import open_hf_source

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _tiny_tokenizer(tok_dir)
    tok = scale.load_tokenizer(str(tok_dir))
    made = scale.make_checkpoint(tmp_path / "ds", "tiny-deepseek", 2, tok, "cpu")
    assert made["parameters"] > 0 and made["size_bytes"] > 0
    folder = tmp_path / "ds"
    with safe_open(next(folder.glob("*.safetensors")), "pt") as f:
        keys = set(f.keys())
        q = "model.layers.0.self_attn.q_a_proj.weight"
        assert f.get_tensor(q).dtype == torch.float8_e4m3fn and q + "_scale_inv" in keys
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert not any(k.endswith("mlp.gate.weight_scale_inv") for k in keys)
    src = open_hf_source(folder)
    t = next(t for t in src.tensors() if t.gguf_name == "blk.0.attn_q_a.weight")
    x = src.read(t)
    assert x.dtype == torch.float32 and x.abs().max() > 0
    assert float((x.abs() / x.abs().max()).max()) <= 1.0 and x.std() == pytest.approx(0.02, rel=0.2)
    assert len({t.gguf_name for t in src.tensors() if "_exps" in t.gguf_name}) == 3  # block 1 is MoE
    # read_to (stored bytes moved, then decoded: a block's materialization) equals read, FP8 and BF16 alike
    assert [t.gguf_name for t in src.tensors() if not torch.equal(src.read_to(t, "cpu"), src.read(t))] == []
    experts = next(t for t in src.tensors() if t.gguf_name == "blk.1.ffn_up_exps.weight")
    stored = src.read_stored(experts, 1, 3)
    assert stored.values.dtype == torch.float8_e4m3fn and torch.equal(stored.decode(slice(None)), src.read(experts)[1:3])


def test_extrapolation_is_linear_in_the_blocks():
    rows = [{"shape": "s", "blocks": 2, "time_s": 30.0, "timings_s": {"calibration_s": 10.0, "quantize_s": 4.0}},
            {"shape": "s", "blocks": 4, "time_s": 50.0, "timings_s": {"calibration_s": 16.0, "quantize_s": 8.0}}]
    got = scale.extrapolate(rows, 80, 160e9, 3.0)
    assert got["per_block_s"] == 10.0 and got["time_s"] == 30.0 + 10.0 * 78
    assert got["stages_s"] == {"calibration_s": 10.0 + 3.0 * 78, "quantize_s": 4.0 + 2.0 * 78}
    assert got["read_s"] == pytest.approx(160 / 3, abs=0.1)
    assert got["total_with_read_s"] == pytest.approx(got["time_s"] + got["read_s"], abs=0.1)


def test_speedup_compares_each_rank_count_with_the_single_process():
    row = {"shape": "s", "blocks": 32, "mode": "stream"}
    rows = [{**row, "nproc": 1, "time_s": 300.0, "sha256": "a", "timings_s": {"calibration_s": 90.0, "quantize_s": 120.0}},
            {**row, "nproc": 1, "torchrun": True, "time_s": 310.0, "sha256": "a",
             "timings_s": {"calibration_s": 90.0, "quantize_s": 125.0}},
            {**row, "nproc": 2, "time_s": 160.0, "sha256": "a", "timings_s": {"calibration_s": 45.0, "quantize_s": 80.0}}]
    got = scale.speedup(rows)
    assert got["same_bytes"] and got["nproc_2"] == {"wall": 1.88, "stages": {"calibration_s": 2.0, "quantize_s": 1.5}}
    assert got["nproc_1_torchrun"]["wall"] == round(300 / 310, 2)
    rows[2]["sha256"] = "b"
    assert scale.speedup(rows)["same_bytes"] is False
    assert scale.speedup(rows[:1]) is None  # nothing to compare with


def test_append_brings_an_earlier_runs_rows_into_the_speedup(tmp_path, monkeypatch):
    """``--nproc 2 --append EARLIER.json``: the single process's row of an earlier call (the same cut) is copied in and
    the speedup row compares with it, so that each device call stays within its time limit."""
    made = {"parameters": 1, "size_bytes": 2, "time_s": 0.1}
    monkeypatch.setattr(scale, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(scale, "make_checkpoint", lambda *a, **k: made)

    def fake_run(ckpt, out, work, args, mode="stream", nproc=1, torchrun=False):
        t = 300.0 / nproc
        return {"nproc": nproc, "time_s": t, "sha256": "same", "timings_s": {"calibration_s": t / 3}}
    monkeypatch.setattr(scale, "run_quantize", fake_run)
    first, second = tmp_path / "one.json", tmp_path / "two.json"
    common = ["--shape", "tiny-llama", "--blocks", "2", "--device", "cpu", "--work", str(tmp_path / "w")]
    assert scale.main([*common, "--nproc", "1", "--out", str(first)]) == 0
    assert scale.main([*common, "--nproc", "2", "--out", str(second), "--append", str(first)]) == 0
    rows = json.loads(second.read_text())
    results = [r for r in rows if r["row"] == "result"]
    assert [r["nproc"] for r in results] == [1, 2] and results[0]["appended_from"] == str(first)
    sp = next(r for r in rows if r["row"] == "speedup")
    assert sp["same_bytes"] and sp["nproc_2"]["wall"] == 2.0


def test_append_of_another_cut_gives_the_extrapolation(tmp_path, monkeypatch):
    """``--blocks 5 --append THE-4-BLOCK-RUN``: the appended cut and this run's make the two points of the full model's
    extrapolation (each cut within one device call's time limit), as one run of ``--blocks 4,5`` would."""
    monkeypatch.setattr(scale, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(scale, "make_checkpoint", lambda ckpt, shape, n, *a, **k: {"parameters": n, "size_bytes": 10 * n,
                                                                                   "time_s": 0.1})

    def fake_run(ckpt, out, work, args, mode="stream", nproc=1, torchrun=False):
        n = int(ckpt.name.rsplit("-", 1)[1])
        return {"nproc": nproc, "time_s": 100.0 * n + 50, "timings_s": {"quantize_s": 60.0 * n}}
    monkeypatch.setattr(scale, "run_quantize", fake_run)
    first, second, both = tmp_path / "one.json", tmp_path / "two.json", tmp_path / "both.json"
    common = ["--shape", "tiny-llama", "--device", "cpu", "--work", str(tmp_path / "w")]
    assert scale.main([*common, "--blocks", "2", "--out", str(first)]) == 0
    assert not [r for r in json.loads(first.read_text()) if r["row"] == "extrapolated"]  # one cut: nothing to extrapolate
    assert scale.main([*common, "--blocks", "3", "--out", str(second), "--append", str(first)]) == 0
    assert scale.main([*common, "--blocks", "2,3", "--out", str(both)]) == 0
    rows = json.loads(second.read_text())
    assert sorted(r["blocks"] for r in rows if r["row"] == "result") == [2, 3]
    ext = next(r for r in rows if r["row"] == "extrapolated")
    full = scale.SHAPES["tiny-llama"][1]["num_hidden_layers"]
    assert ext["from_blocks"] == [2, 3] and ext["per_block_s"] == 100.0 and ext["time_s"] == 100.0 * full + 50
    assert ext["stages_s"] == {"quantize_s": 60.0 * full}
    assert ext == next(r for r in json.loads(both.read_text()) if r["row"] == "extrapolated")


def test_warmup_runs_the_first_cut_once_untimed_and_a_cold_extrapolation_is_flagged(tmp_path, monkeypatch):
    """``--warmup`` quantizes the first cut once before its timed run (row ``warmup``, not a cut of the
    extrapolation); without it a first run slowed by compiles can make the larger cut faster, and the extrapolated
    row then says so (``error``) instead of standing as a negative time."""
    monkeypatch.setattr(scale, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(scale, "make_checkpoint", lambda ckpt, shape, n, *a, **k: {"parameters": n, "size_bytes": 10 * n,
                                                                                   "time_s": 0.1})
    calls = []

    def fake_run(ckpt, out, work, args, mode="stream", nproc=1, torchrun=False):
        n = int(ckpt.name.rsplit("-", 1)[1])
        cold = not calls
        calls.append((n, out.name))
        return {"nproc": nproc, "time_s": 100.0 * n + (500 if cold else 0), "timings_s": {"errors_s": 10.0 * n}}
    monkeypatch.setattr(scale, "run_quantize", fake_run)
    common = ["--shape", "tiny-llama", "--device", "cpu", "--work", str(tmp_path / "w"), "--blocks", "2,3"]
    assert scale.main([*common, "--out", str(tmp_path / "cold.json")]) == 0
    ext = next(r for r in json.loads((tmp_path / "cold.json").read_text()) if r["row"] == "extrapolated")
    assert ext["per_block_s"] < 0 and "warmup" in ext["error"]
    calls.clear()
    assert scale.main([*common, "--warmup", "--out", str(tmp_path / "warm.json")]) == 0
    assert [n for n, _ in calls] == [2, 2, 3] and "warmup" in calls[0][1]
    rows = json.loads((tmp_path / "warm.json").read_text())
    assert [r["time_s"] for r in rows if r["row"] == "warmup"] == [700.0]
    ext = next(r for r in rows if r["row"] == "extrapolated")
    assert ext["per_block_s"] == 100.0 and "error" not in ext
