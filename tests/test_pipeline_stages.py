"""The quantize pipeline's stages: the plan made once per run, the GGUF overhead counted in memory."""

from __future__ import annotations

import os
import signal
import tempfile

import gguf
import numpy as np
import pytest

from dynaquant.analysis.imatrix import Imatrix
from dynaquant.pipeline.source import open_tensor_source, tensor_infos
from dynaquant.pipeline.targets import gguf_extra_kv, gguf_overhead_bytes
from dynaquant.quant.plan import Plan
from dynaquant.sources.checkpoint import resolve_source


def _overhead_bytes_in_a_file(ts, tensors, extra_kv: dict) -> int:
    """The estimate as it was computed before (a header written to a temporary file): the reference."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "h.gguf")
        w = gguf.GGUFWriter(path, ts.arch)
        ts.add_metadata(w)
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
        for k, v in extra_kv.items():
            if isinstance(v, list):
                if v:
                    w.add_array(k, v)
            elif isinstance(v, str):
                w.add_string(k, v + " " * 64)
            else:
                w.add_uint32(k, 0)
        for t in tensors:
            w.add_tensor_info(t.name, list(t.shape), np.dtype(np.float32), 4, raw_dtype=gguf.GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        header = os.path.getsize(path)
    return header + 32 * (len(tensors) + 1)


def test_gguf_overhead_counted_in_memory_is_the_temp_file_number():
    source = resolve_source(None)  # the default model
    ts = open_tensor_source(source)
    tensors = tensor_infos(ts)
    empty = Plan("gguf", "", [], "allocation size<=000000000000")  # the empty plan the estimate used
    for im in (Imatrix(dataset=" " * 64, chunks=0), None):
        kv = gguf_extra_kv(source, None, im)
        assert kv == gguf_extra_kv(source, empty, im)
        assert gguf_overhead_bytes(ts, tensors, kv) == _overhead_bytes_in_a_file(ts, tensors, kv)
    assert gguf_overhead_bytes(ts, tensors, {}) == _overhead_bytes_in_a_file(ts, tensors, {})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_gguf_export import _tiny_checkpoint

    d = tmp_path_factory.mktemp("tiny")
    _tiny_checkpoint(d / "ckpt", "llama")
    return d / "ckpt"


def _plans_made(monkeypatch, args: list[str]) -> int:
    """How many times ``make_plan`` runs in ``dynaquant ARGS``."""
    import dynaquant.pipeline.analyze
    import dynaquant.pipeline.plan
    from dynaquant.cli import main

    calls = []
    real = dynaquant.pipeline.plan.make_plan

    def counting(*a, **k):
        calls.append(k.get("preset") or k.get("bpw") or k.get("size_bytes"))
        return real(*a, **k)

    monkeypatch.setattr(dynaquant.pipeline.plan, "make_plan", counting)
    monkeypatch.setattr(dynaquant.pipeline.analyze, "make_plan", counting)
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert main([str(a) for a in args]) == 0
    finally:
        signal.signal(signal.SIGTERM, old)
    return len(calls)


def test_the_plan_is_made_once_per_run(tiny, tmp_path, monkeypatch):
    small = ["--no-eval", "--calibration-chunks", "2", "--ctx", "64", "--device", "cpu", "--json"]
    # the default target: the Q4_K_M mix's size and the rules' check before the model loads are sizes, not plans
    # (planner.preset_size_bytes, planner.min_plan_bytes); the plan from the analysis, once
    assert _plans_made(monkeypatch, ["quantize", tiny, "-o", tmp_path / "a.gguf", *small]) == 1
    # an explicit budget: the rules' check before the model loads (min_plan_bytes), the plan from the analysis
    assert _plans_made(monkeypatch, ["quantize", tiny, "--format", "safetensors", "--bpw", "8", "-o", tmp_path / "st",
                                     *small]) == 1
    # a report given with a budget: the plan itself, before the model loads, once
    assert _plans_made(monkeypatch, ["analyze", tiny, "-o", tmp_path / "an", "--sequences", "2", "--ctx", "64",
                                     "--device", "cpu", "--json", "--no-super-weights"]) == 0
    assert _plans_made(monkeypatch, ["quantize", tiny, "--report", tmp_path / "an" / "report.json", "--bpw", "8",
                                     "-o", tmp_path / "b.gguf", *small]) == 1


def test_default_target_is_below_an_already_quantized_source(tiny):
    """The default model (a Q4_1 GGUF, token embedding Q8_0) is re-encoded by default at the Q3_K_M mix's size, below
    the source's file; an unquantized source (an HF folder) keeps the Q4_K_M mix's size."""
    from dynaquant.pipeline.plan import default_size_bytes
    from dynaquant.pipeline.source import model_info, quantized_source, source_bytes
    from dynaquant.quant.planner import preset_size_bytes

    src = resolve_source(None)
    ts = open_tensor_source(src)
    tensors, info = tensor_infos(ts), model_info(ts)
    assert quantized_source(ts) and source_bytes(ts) == os.path.getsize(src.path)
    size = default_size_bytes(ts, tensors, info, 1000)
    assert size == preset_size_bytes(tensors, info, "Q3_K_M") + 1000 < source_bytes(ts)
    assert size < preset_size_bytes(tensors, info, "Q4_K_M") + 1000
    hf = open_tensor_source(resolve_source(str(tiny)))
    hf_tensors, hf_info = tensor_infos(hf), model_info(hf)
    assert not quantized_source(hf)
    assert default_size_bytes(hf, hf_tensors, hf_info, 1000) == preset_size_bytes(hf_tensors, hf_info, "Q4_K_M") + 1000


def test_counts_left_unset_follow_the_device():
    """A quantize run's calibration / evaluation / Fisher counts: the GPU defaults on CUDA, fewer on the CPU (issue 16:
    README's first command on 2 cores), and a given count always wins."""
    from dynaquant import config
    from dynaquant.config import QuantizeConfig

    gpu, cpu = QuantizeConfig().for_device("cuda:0"), QuantizeConfig().for_device("cpu")
    assert (gpu.calibration_chunks, gpu.eval_chunks, gpu.fisher_sequences) == (
        config.CALIBRATION_CHUNKS, config.EVAL_CHUNKS, config.FISHER_SEQUENCES)
    assert (cpu.calibration_chunks, cpu.eval_chunks, cpu.fisher_sequences) == (
        config.CPU_CALIBRATION_CHUNKS, config.CPU_EVAL_CHUNKS, config.CPU_FISHER_SEQUENCES)
    assert cpu.calibration_chunks < gpu.calibration_chunks and cpu.spec().n_sequences == config.CPU_CALIBRATION_CHUNKS
    assert (gpu.sample_fraction, cpu.sample_fraction) == (config.SAMPLE_FRACTION, config.CPU_SAMPLE_FRACTION)
    given = QuantizeConfig(calibration_chunks=5, eval_chunks=3, fisher_sequences=0, sample_fraction=8).for_device("cpu")
    assert (given.calibration_chunks, given.eval_chunks, given.fisher_sequences, given.sample_fraction) == (5, 3, 0, 8)


def test_sample_size_keeps_the_sixteenth_and_scales_with_the_fraction():
    """sample_size: 1/16 of the rows between 32 and 2048 by default (every row up to 64); other fractions scale all
    three; sample_tensor draws that many."""
    import pytest
    import torch

    from dynaquant.analysis.errors import RowWeights, sample_size, sample_tensor

    assert [sample_size(n) for n in (10, 64, 65, 576, 1536, 49152)] == [10, 64, 32, 36, 96, 2048]
    assert [sample_size(n, 32) for n in (10, 64, 65, 576, 1536, 49152)] == [10, 64, 16, 18, 48, 1024]
    for bad in (0, 513):
        with pytest.raises(ValueError, match="sample fraction"):
            sample_size(100, bad)
    w = torch.randn(1536, 64)
    s16, s32 = (sample_tensor(w, RowWeights(), imatrix=torch.ones(64), fraction=f) for f in (16, 32))
    assert s16.rows.shape == (96, 64) and s32.rows.shape == (48, 64)
