"""K-quant codecs Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: layout parity with gguf-py, encoder quality.

Parity: our decode equals ``gguf.quants.dequantize`` bit for bit, on random bytes and on
our own encodings of random weights of several shapes (odd row counts, rows of 256, 1536
and 2304, outliers, zero and negative-heavy blocks).

Quality: the importance-weighted error of our encoding against llama.cpp's
``ggml_quantize_chunk`` (``tests/ggml_ref.py``) with the same imatrix, on SmolLM2 weights
and on synthetic ones.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from ggml_ref import error_ratios
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from dynaquant.quant.codecs import dequantize, get_codec, quantize, weighted_error

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Offsets of the float16 super-block scales (d, and dmin where there is one) in each block.
F16_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _weights(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (rows, k) float32 weights with hard blocks, and a (k,) lognormal imatrix.

    Rows get a lognormal scale and 0.3% outliers (x10); with more than one block, the first
    row's first block is all zero, its second (when there is one) is all negative with a
    large outlier, a third is all positive; one 16-weight sub-block of the last row is zero.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * torch.exp(0.7 * torch.randn(rows, 1, generator=g))
    out = torch.rand(rows, k, generator=g) < 0.003
    w = torch.where(out, w * 10, w)
    if rows * k > 256:
        w[0, :256] = 0
    if k >= 512:
        w[0, 256:512] = -w[0, 256:512].abs() * 2
        w[0, 300] = -40.0
    if k >= 768:
        w[0, 512:768] = w[0, 512:768].abs() + 0.1
    w[-1, 16:32] = 0
    imatrix = torch.exp(1.5 * torch.randn(k, generator=g))
    return w, imatrix


@pytest.mark.parametrize("name", KQUANTS)
def test_block_size_matches_gguf(name):
    codec = get_codec(name)
    assert (codec.format.block_size, codec.format.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", KQUANTS)
def test_decode_random_bytes_matches_gguf(name):
    """Any byte pattern (with finite float16 scales) decodes exactly as gguf-py decodes it."""
    ts = get_codec(name).format.type_size
    g = torch.Generator().manual_seed(1)
    b = torch.randint(0, 256, (37, ts), dtype=torch.uint8, generator=g)
    for off in F16_OFFSETS[name]:
        d = (torch.randn(37, generator=g) * 0.05).to(torch.float16)
        b[:, off : off + 2] = d.view(torch.uint8).reshape(37, 2)
    ours = get_codec(name).decode_blocks(b)
    ref = gguf_dequantize(b.numpy(), GGMLQuantizationType[name]).reshape(37, 256)
    assert ours.dtype == torch.float32 and ours.shape == (37, 256)
    assert np.array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (5, 1536), (3, 2304)])
def test_encode_roundtrip_matches_gguf(name, shape):
    w, imatrix = _weights(*shape, seed=shape[0] * 31 + shape[1])
    data = quantize(w, name, imatrix)
    fmt = get_codec(name).format
    assert data.dtype == torch.uint8 and data.shape == (shape[0], shape[1] // 256 * fmt.type_size)
    ours = dequantize(data, name)
    ref = gguf_dequantize(data.numpy(), GGMLQuantizationType[name])
    assert np.array_equal(ours.numpy(), ref)
    assert torch.isfinite(ours).all()
    if w.numel() > 256:
        assert (ours[0, :256] == 0).all()  # the zero block stays exactly zero
    # relative error of the order of a b-bit uniform code's, (range / 2**b)**2 / 12, on this data
    bits = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[name]
    rel = weighted_error(w, ours, imatrix) / weighted_error(w, torch.zeros_like(w), imatrix)
    assert rel < 3.0 * 4.0**-bits


def test_error_decreases_with_bits():
    w, imatrix = _weights(16, 1536, seed=5)
    errs = [weighted_error(w, dequantize(quantize(w, n, imatrix), n), imatrix) for n in KQUANTS]
    assert all(a > b for a, b in itertools.pairwise(errs)), errs


@pytest.mark.parametrize("name", KQUANTS)
def test_importance_is_used(name):
    """Raising the importance of some columns lowers their error (the encoder follows w)."""
    w, _ = _weights(8, 1536, seed=7)
    heavy = torch.zeros(1536, dtype=torch.bool)
    heavy[torch.randperm(1536, generator=torch.Generator().manual_seed(0))[:96]] = True
    imatrix = torch.where(heavy, 100.0, 1.0)
    uniform = dequantize(quantize(w, name), name)
    weighted = dequantize(quantize(w, name, imatrix), name)
    e_uniform = float(((w - uniform) ** 2)[:, heavy].sum())
    e_weighted = float(((w - weighted) ** 2)[:, heavy].sum())
    assert e_weighted < 0.7 * e_uniform
    assert weighted_error(w, weighted, imatrix) < weighted_error(w, uniform, imatrix)


@pytest.mark.parametrize("name", KQUANTS)
def test_bad_shapes_raise(name):
    codec = get_codec(name)
    with pytest.raises(ValueError):
        codec.encode_blocks(torch.zeros(2, 128), torch.ones(2, 128))
    with pytest.raises(ValueError):
        codec.encode_blocks(torch.zeros(2, 256), torch.ones(1, 256))
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 576), name)
    with pytest.raises(ValueError):
        codec.decode_blocks(torch.zeros(2, codec.format.type_size + 1, dtype=torch.uint8))


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("name", KQUANTS)
def test_device(name, device):
    """Encode and decode run on the input's device; results match the CPU's."""
    w, imatrix = _weights(6, 1536, seed=11)
    data = quantize(w.to(device), name, imatrix.to(device))
    assert data.device.type == device
    dec = dequantize(data, name)
    assert dec.device.type == device
    assert np.array_equal(dec.cpu().numpy(), gguf_dequantize(data.cpu().numpy(), GGMLQuantizationType[name]))
    e_dev = weighted_error(w, dec.cpu(), imatrix)
    e_cpu = weighted_error(w, dequantize(quantize(w, name, imatrix), name), imatrix)
    assert e_dev <= e_cpu * 1.01


# --------------------------------------------------------------------------- against llama.cpp


def _kquant_rows(tensors, max_rows: int = 96):
    """SmolLM2 test tensors as K-quant-able (rows, K) matrices with their (K,) imatrix.

    ``ffn_down`` (K = 1536) is used as is. The other tensors have K = 576, which is not a
    multiple of 256: their rows are joined four at a time, ``W.reshape(N/4, 2304)`` with the
    imatrix repeated four times, so every weight keeps its own importance and both encoders
    see the same values. Every ``N // max_rows``-th row is kept to bound the test time.
    """
    out = []
    for _, w, imatrix in tensors:
        if w.shape[1] % 256:
            w, imatrix = w.reshape(-1, 4 * w.shape[1]), imatrix.repeat(4)
        step = max(1, w.shape[0] // max_rows)
        out.append((w[::step].contiguous(), imatrix))
    return out


@pytest.fixture(scope="module")
def smollm2_kquant_rows(smollm2_weights):
    return _kquant_rows(smollm2_weights)


@pytest.mark.parametrize("name", KQUANTS)
def test_quality_vs_llama_cpp_smollm2(name, smollm2_kquant_rows):
    """On average over the SmolLM2 tensors no worse than llama.cpp, and never 2% worse."""
    pytest.importorskip("llama_cpp")
    ratios = error_ratios(smollm2_kquant_rows, name)
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios


@pytest.mark.parametrize("name", KQUANTS)
def test_quality_vs_llama_cpp_synthetic(name):
    pytest.importorskip("llama_cpp")
    tensors = [_weights(48, k, seed=k) for k in (1536, 2304)]
    ratios = error_ratios(tensors, name)
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios
