"""benchmarks/iq3_configs.py's --choose (the device scripts' pick of encode_speed.py --iq3-fused) and
encode_speed.py's --iq3-fused switches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import triton_mode  # noqa: F401  (before Triton: the interpreter without a GPU)

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _summary(**secs_equal):
    res = {c: {"s": s, "bytes_equal_base": eq} for c, (s, eq) in secs_equal.items()}
    return "IQ3_XXS prefetch32 {...}\n" + json.dumps({"device": "x", "results": {"IQ3_XXS": res, "IQ3_S": {}}})


def test_choose_fused_takes_the_fastest_with_the_default_bytes():
    import iq3_configs

    txt = _summary(prefetch32=(0.066, True), levels=(0.060, True), step1=(0.058, True), fused=(0.050, False))
    assert iq3_configs.choose_fused(txt) == "step1"  # fused is faster but its bytes differ
    assert iq3_configs.choose_fused(_summary(prefetch32=(0.066, True), fused=(0.050, True))) == "levels,step1"
    assert iq3_configs.choose_fused(_summary(prefetch32=(0.066, True), levels=(0.050, True))) == "levels"
    assert iq3_configs.choose_fused(_summary(prefetch32=(0.05, True), levels=(0.06, True))) == "none"
    assert iq3_configs.choose_fused("Traceback ...\nRuntimeError: CUDA") == "none"  # a failed run
    assert iq3_configs.choose_fused("") == "none"


def test_encode_speed_iq3_fused_sets_and_records_the_switches(tmp_path, monkeypatch):
    import encode_speed

    from dynaquant.quant.codecs import iq3

    monkeypatch.setattr(iq3, "FUSED_LEVELS", False)
    monkeypatch.setattr(iq3, "FUSED_STEP1", False)
    out = tmp_path / "e.json"
    assert encode_speed.main(["--types", "Q8_0", "--rows", "4", "--cpu-seconds", "0.01", "--repeats", "1",
                              "--iq3-fused", "step1", "--out", str(out)]) == 0
    head = json.loads(out.read_text())[0]
    assert head["config"]["iq3_fused"] == {"FUSED_LEVELS": False, "FUSED_STEP1": True}
    assert (iq3.FUSED_LEVELS, iq3.FUSED_STEP1) == (False, True)
    assert encode_speed.main(["--types", "Q8_0", "--rows", "4", "--cpu-seconds", "0.01", "--repeats", "1",
                              "--iq3-fused", "none", "--out", str(out)]) == 0
    assert (iq3.FUSED_LEVELS, iq3.FUSED_STEP1) == (False, False)
    with pytest.raises(SystemExit):  # not a switch: argparse's error, exit 2
        encode_speed.main(["--types", "Q8_0", "--iq3-fused", "level", "--out", str(out)])
