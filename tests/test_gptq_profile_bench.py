"""benchmarks/gptq_profile.py runs a --gptq quantize of a tiny checkpoint and writes per-type times that count every
tensor GPTQ rounded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_gptq_profile_smoke(tmp_path, capsys):
    import gptq_profile
    from test_gguf_export import _tiny_checkpoint

    ckpt = tmp_path / "tiny"
    _tiny_checkpoint(ckpt, "llama", hidden_size=256, intermediate_size=512)
    out = tmp_path / "prof.json"
    argv = ["--out", str(out), "--", "quantize", str(ckpt), "--bpw", "7", "--gptq", "--calibration-chunks", "3",
            "--ctx", "64", "--device", "cpu", "--no-eval", "--json", "-o", str(tmp_path / "t.gguf")]
    assert gptq_profile.main(argv) == 0
    run = json.loads(capsys.readouterr().out)
    prof = json.loads(out.read_text())
    assert prof["args"][0] == "quantize" and (tmp_path / "t.gguf").is_file()
    tried = sum(v["tensors"] for v in run["gptq"].values() if v.get("mean_ratio") is not None)
    gptq_rows = {k: v for k, v in prof["rows"].items() if k.startswith("gptq|")}
    assert tried > 0 and sum(c for c, _ in gptq_rows.values()) == tried
    assert all(s > 0 for _, s in prof["rows"].values()) and prof["calls"] == sum(c for c, _ in prof["rows"].values())
    times = [s for _, s in prof["rows"].values()]
    assert times == sorted(times, reverse=True)
