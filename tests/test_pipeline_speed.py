"""benchmarks/pipeline_speed.py on a tiny shape: the checkpoint maker, the quantize JSON parser and the anchors.

The benchmark itself runs on the device (benchmarks/device/pipeline.sh); these check its pieces cheaply (a 2-block
random checkpoint of hidden 64 with a 300-token BPE tokenizer, no quantize run).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pipeline_speed as ps  # noqa: E402
from test_gguf_export import _tiny_tokenizer  # noqa: E402


def test_checkpoint_maker_writes_a_random_bf16_llama(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _tiny_tokenizer(tok_dir)
    tok = ps.load_tokenizer(str(tok_dir))
    args = ps.argparse.Namespace(layers=2, hidden=64, ffn=96, heads=4, kv_heads=2, ctx=64)
    shape = ps.model_shape(args, tok)
    info = ps.make_checkpoint(tmp_path / "ckpt", shape, tok, "cpu", seed=3)

    cfg = AutoConfig.from_pretrained(tmp_path / "ckpt")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size) == (64, 2, 96, len(tok))
    assert cfg.num_key_value_heads == 2 and cfg.architectures == ["LlamaForCausalLM"] and not cfg.tie_word_embeddings
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file() and not (tmp_path / "ckpt.tmp").exists()
    sd = {}
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        sd |= load_file(f)
    assert info["parameters"] == sum(t.numel() for t in sd.values())
    assert info["size_bytes"] == sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.safetensors"))
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (64, 96)
    assert sd["lm_head.weight"].shape == (len(tok), 64)
    for name, t in sd.items():  # random everywhere: no zeros, no constant norms, the scales asked for
        assert t.dtype == torch.bfloat16, name
        assert t.float().std() > 0 and (t != 0).float().mean() > 0.99, name
        if "norm" in name:
            assert abs(t.float().mean() - 1) < 0.2 and 0.1 < t.float().std() < 0.3, name
        else:
            assert t.float().abs().mean() < 0.05, name


def test_quantize_json_parser_takes_the_last_object():
    res = {"output": "x.gguf", "time_s": 3.5, "timings_s": {"load_s": 1.0, "quantize_s": 2.0}}
    out = "some line\n{not json\n" + json.dumps(res, indent=1) + "\n"
    assert ps.parse_quantize_json(out) == res
    assert ps.parse_quantize_json(json.dumps(res)) == res
    with pytest.raises(ValueError, match="no JSON object"):
        ps.parse_quantize_json("error: nothing here\n")


def test_anchor_speedup_targets_and_summary(tmp_path):
    bench = ps.Bench(tmp_path / "rows.json", {"row": "header"}, resume=False)
    bench.add({"pipeline": "llama.cpp", "stage": "convert", "time_s": 60.0})
    bench.add({"pipeline": "llama.cpp", "stage": "imatrix", "time_s": 30.0})
    bench.add({"pipeline": "llama.cpp", "stage": "quantize", "mix": "Q4_K_M", "time_s": 90.0, "size_bytes": 10, "bpw": 4.9})
    bench.add({"pipeline": "llama.cpp", "stage": "quantize", "mix": "IQ2_XS", "skipped": True, "note": "no imatrix"})
    fast = {"pipeline": "dynaquant", "stage": "total", "mode": "bpw4.5", "time_s": 50.0, "startup_s": 2.0,
            "timings_s": {"calibration_s": 10.0, "quantize_s": 30.0}, "size_bytes": 9, "bpw": 4.5}
    slow = dict(fast, mode="gptq", time_s=170.0)
    low = dict(fast, mode="bpw2.5", time_s=10.0)
    for row in (fast, slow, low):
        row.update(ps.compare(row, bench))
    assert fast["anchor"] == "llama.cpp Q4_K_M" and fast["anchor_time_s"] == 180.0
    assert fast["speedup_vs_llama"] == pytest.approx(3.6) and fast["meets_target"]  # <= 60 s and >= 3x
    assert slow["meets_target"] is False  # over 150 s
    assert low["speedup_vs_llama"] is None and low["meets_target"] is False  # no IQ2_XS anchor measured
    assert fast["anchor_stages_s"] == {"convert_s": 60.0, "imatrix_s": 30.0, "quantize_s": 90.0}
    failed = {"row": "result", "pipeline": "dynaquant", "stage": "failed", "mode": "gptq", "error": "exit status 2"}
    table = ps.summary(bench.rows + [{"row": "result", **r} for r in (fast, slow, low)] + [failed])
    assert "| llama.cpp | Q4_K_M | convert 60.0, imatrix 30.0, quantize 90.0 | 180.0 |" in table
    assert "3.60x vs llama.cpp Q4_K_M" in table and "skipped: no imatrix" in table and "failed: exit status 2" in table
    # resume keeps measured rows (not the skipped one, which is re-examined)
    again = ps.Bench(tmp_path / "rows.json", {"row": "header"}, resume=True)
    assert again.find(stage="quantize", mix="Q4_K_M")["time_s"] == 90.0
    assert again.find(stage="quantize", mix="IQ2_XS") is None


def test_a_work_folder_holding_another_shape_is_refused(tmp_path, capsys):
    """--make-only (or a run) with a WORK whose checkpoint has another shape (a 16-layer cut, then the whole model)
    stops with an error naming the difference, instead of measuring the old checkpoint."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _tiny_tokenizer(tok_dir)
    common = ["--work", str(tmp_path / "w"), "--tokenizer", str(tok_dir), "--device", "cpu", "--hidden", "64", "--ffn", "96",
              "--heads", "4", "--kv-heads", "2", "--ctx", "64", "--make-only", "--no-llama"]
    assert ps.main([*common, "--layers", "2"]) == 0
    assert ps.main([*common, "--layers", "2"]) == 0  # the same shape: kept
    with pytest.raises(SystemExit) as exc:
        ps.main([*common, "--layers", "1"])
    assert exc.value.code == 2 and "num_hidden_layers 2 != 1" in capsys.readouterr().err


def test_python_steps_write_bytecode_and_see_the_repository(monkeypatch, tmp_path):
    """A container's PYTHONDONTWRITEBYTECODE would make every timed run compile transformers again: the steps drop it."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = ps.python_env(tmp_path)
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert "PYTHONDONTWRITEBYTECODE" not in ps.python_env(None) and ps.python_env(None)["PYTHONPATH"] == "/elsewhere"
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"  # the benchmark's own environment is left alone
