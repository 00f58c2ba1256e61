"""benchmarks/first_command.py's parser of what ``dynaquant quantize`` prints (the benchmark itself is timed by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import first_command  # noqa: E402

OUT = """wrote /tmp/x/SmolLM2-135M-Instruct-dynamic-94MB.gguf
  91.84 MB, 5.356 bpw over tensor data, 62.7 s (allocation size<=93520485, exact (gap 0.00%))
  6.52 MB (6.6%) smaller than the source (98.36 MB)
  formats by weights: Q4_1 75.0%, Q5_1 21.0%, Q8_0 3.9%, F32 0.0%
  eval: 2040 tokens (8 chunks x 512, second halves scored) of stdlib-docstrings:eval
  mean KLD 0.00429  p99 KLD 0.01675  top-1 agreement 96.47%
  perplexity 9.9178 (reference 9.8505)
"""


def test_parse_output_reads_size_time_and_quality():
    r = first_command.parse_output(OUT)
    assert r == {"mb": 91.84, "bpw": 5.356, "printed_s": 62.7, "kld_mean": 0.00429, "kld_p99": 0.01675,
                 "top1": pytest.approx(0.9647)}


def test_parse_output_refuses_a_run_without_evaluation():
    with pytest.raises(ValueError, match="no KLD line"):
        first_command.parse_output(OUT.split("  eval:")[0])


def test_parse_output_of_a_preset_run_without_evaluation():
    """--preset runs are not evaluated: size and time only."""
    r = first_command.parse_output(OUT.split("  eval:")[0], evaluated=False)
    assert r == {"mb": 91.84, "bpw": 5.356, "printed_s": 62.7}
    with pytest.raises(ValueError, match="no size line"):
        first_command.parse_output("wrote x.gguf\n", evaluated=False)
