"""Shared fixtures: the default model, its dithered weights and their imatrix."""

from __future__ import annotations

import os
import sys

# OpenMP threads that spin while waiting starve each other on small, busy machines.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# GGUF files' converted configs and tokenizers (dynaquant.sources.gguf_hf_cache) go to a folder of this session, not
# the user's cache (subprocesses inherit it)
if "DYNAQUANT_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["DYNAQUANT_CACHE"] = tempfile.mkdtemp(prefix="dynaquant-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DYNAQUANT_CACHE"], ignore_errors=True)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

# Weight tensors of SmolLM2 used by codec quality tests: every tensor kind, early/middle/late layers.
SMOLLM2_TEST_TENSORS = (
    "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.20.attn_v.weight", "blk.3.attn_output.weight",
    "blk.5.ffn_gate.weight", "blk.10.ffn_up.weight",
    "blk.2.ffn_down.weight", "blk.15.ffn_down.weight", "blk.29.ffn_down.weight",
)


@pytest.fixture
def one_cpu_thread():
    """Run a test's CPU work on one thread, restoring the setting afterwards (codec tests use it
    through ``pytestmark``).

    The encoders issue many small tensor ops; on a shared machine whose cores are busy,
    OpenMP's thread hand-offs make two threads many times slower than one. Function scope,
    so wider fixtures (the SmolLM2 imatrix) are built with the default threads.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def reference_encoders(monkeypatch):
    """Encode with the codecs' torch references on the CPU (no compiled fast path) for the test.

    For the tests that hold llama.cpp's logits on a random tiny model to transformers' on the decoded weights: that
    agreement moves with any equally good change of the bytes (the compiled searches break near-ties of the sums the
    other way on 1-2 % of Q8_0 blocks, the same weighted error, and moved qwen2moe's llama.cpp rel. RMS from 0.078 to
    0.22 and one of gpt-oss's decided tokens), so they pin the reference search; the compiled searches are held to
    it by tests/test_kquant_native.py and tests/test_blockfit_native.py."""
    from dynaquant.quant.codecs import fastpaths

    monkeypatch.setattr(fastpaths, "_CPU_LOADERS", {})
    monkeypatch.setattr(fastpaths, "_CPU_LOADED", {})


@pytest.fixture
def fresh_registry(monkeypatch):
    """The CPU fast paths and the compiled libraries unloaded, as in a new process (and again after the test)."""
    from dynaquant.kernels import native
    from dynaquant.quant.codecs import fastpaths

    monkeypatch.setattr(fastpaths, "_CPU_LOADED", {})
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.fixture(scope="session")
def default_source():
    from dynaquant.sources.checkpoint import resolve_source

    return resolve_source(None)


@pytest.fixture(scope="session")
def default_model(default_source):
    from dynaquant.sources.model import load_model

    return load_model(default_source)


@pytest.fixture(scope="session")
def default_tokenizer(default_source):
    from dynaquant.sources.checkpoint import load_tokenizer

    return load_tokenizer(default_source)


@pytest.fixture(scope="session")
def default_imatrix(default_model, default_tokenizer):
    """Imatrix of the default model on 8 chunks of 512 tokens of the default calibration text."""
    from dynaquant.analysis.calibration import tokenize_chunks
    from dynaquant.analysis.stats import compute_imatrix
    from dynaquant.analysis.texts import default_calibration_text

    chunks = tokenize_chunks(default_tokenizer, default_calibration_text(), 512, 8)
    return compute_imatrix(default_model, chunks, "stdlib-docstrings:calibration", progress=False)


@pytest.fixture(scope="session")
def smollm2_weights(default_source, default_imatrix):
    """[(gguf_name, weight (N, K) float32 dithered, imatrix (K,) float32)] for SMOLLM2_TEST_TENSORS."""
    import gguf

    from dynaquant.analysis.dither import dither

    reader = gguf.GGUFReader(str(default_source.path))
    by_name = {t.name: t for t in reader.tensors}
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    hf_for = {}
    for hf in default_imatrix.names():
        g = tmap.get_name(hf)
        if g:
            hf_for[g + ".weight"] = hf
    out = []
    for i, name in enumerate(SMOLLM2_TEST_TENSORS):
        t = by_name[name]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        out.append((name, dither(w, 32, seed=i), default_imatrix.mean(hf_for[name])))
    return out


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """A stand-in kernel op for DynaLinear on the CPU (``dynaquant.runtime.linear``'s kernel hook: bf16 inputs take
    it, as CUDA bf16 inputs take the Triton kernels; the weight decoded, ``F.linear``); yields the list of output
    widths of its calls."""
    import dynaquant.runtime.linear as rt_linear
    from dynaquant.quant.runtime import decode

    calls: list[int] = []

    class StandIn:
        @staticmethod
        def prepare(weight):
            return decode(weight)

        @staticmethod
        def linear(x, packed, bias):
            calls.append(packed.shape[0])
            return torch.nn.functional.linear(x, packed.to(x.dtype), bias)

    monkeypatch.setattr(rt_linear, "_kernel_device", lambda t: True)
    monkeypatch.setattr(rt_linear, "kernel_op", lambda fmt: StandIn)
    yield calls
