"""benchmarks/gptq_speed.py runs (a smoke version; on a CPU the kernel in Triton's interpreter) and writes its rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import triton_mode  # noqa: F401  (before Triton: the interpreter without a GPU)

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_gptq_speed_smoke(tmp_path, one_cpu_thread):
    import gptq_speed

    out = tmp_path / "g.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert gptq_speed.main(["--device", device, "--rows", "8", "--cols", "512", "--shapes", "q_o", "--formats",
                            "Q4_K,Q6_K", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["row"] == "header" and [r["format"] for r in rows[1:]] == ["Q4_K", "Q6_K"]
    for r in rows[1:]:
        assert r["n"] == 8 and r["k"] == 512 and r["torch_s"] > 0 and r["kernel_s"] > 0
        if device == "cpu":  # the interpreter: the same floats
            assert r["bytes_equal"] and r["output_error_ratio"] == 1.0
