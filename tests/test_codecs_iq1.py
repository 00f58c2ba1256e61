"""IQ1_S and IQ1_M codecs: layout parity with gguf-py, exact grid search, encoder quality.

Parity: our decode equals ``gguf.quants.dequantize`` bit for bit, on random bytes (with
finite float16 scales) and on our own encodings of random weights of several shapes.

Search: :func:`nearest_points` (candidate sets of non-dominated grid points) returns the
same point and error as a brute-force search of all 2048 grid points.

Quality: the importance-weighted error of our encoding against llama.cpp's
``ggml_quantize_chunk`` (``tests/ggml_ref.py``) with the same imatrix, on SmolLM2 weights
(dithered, see ``conftest.py``) and on synthetic ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_ref import error_ratios
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from dynaquant.quant.codecs import dequantize, get_codec, quantize, weighted_error
from dynaquant.quant.codecs.iq1 import DELTA, grid_values, nearest_points

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

IQ1 = ("IQ1_S", "IQ1_M")


def _weights(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (rows, k) weights with hard blocks, and a (k,) lognormal imatrix.

    Lognormal row scales, 0.3% outliers (x10); with more than one block the first row's
    first block is zero, its second all negative with a large outlier, a third all
    positive; one 16-weight sub-block of the last row is zero.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * torch.exp(0.7 * torch.randn(rows, 1, generator=g))
    w = torch.where(torch.rand(rows, k, generator=g) < 0.003, w * 10, w)
    if rows * k > 256:
        w[0, :256] = 0
    if k >= 512:
        w[0, 256:512] = -w[0, 256:512].abs() * 2
        w[0, 300] = -40.0
    if k >= 768:
        w[0, 512:768] = w[0, 512:768].abs() + 0.1
    w[-1, 16:32] = 0
    return w, torch.exp(1.5 * torch.randn(k, generator=g))


def _random_blocks(name: str, n: int, seed: int) -> torch.Tensor:
    """Random bytes of ``n`` blocks whose float16 ``d`` is finite."""
    ts = get_codec(name).format.type_size
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, ts), dtype=torch.uint8, generator=g)
    d = (torch.randn(n, generator=g) * 0.05).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    if name == "IQ1_S":
        b[:, 0], b[:, 1] = (d & 255).to(torch.uint8), (d >> 8).to(torch.uint8)
    else:  # the top nibble of scale word i (bytes 48 + 2 i, 49 + 2 i) is nibble i of d
        for i in range(4):
            hi = b[:, 49 + 2 * i].to(torch.int32)
            b[:, 49 + 2 * i] = ((hi & 15) | (((d >> (4 * i)) & 15) << 4)).to(torch.uint8)
    return b


@pytest.mark.parametrize("name", IQ1)
def test_block_size_matches_gguf(name):
    codec = get_codec(name)
    assert (codec.format.block_size, codec.format.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", IQ1)
def test_decode_random_bytes_matches_gguf(name):
    b = _random_blocks(name, 37, seed=1)
    ours = get_codec(name).decode_blocks(b)
    ref = gguf_dequantize(b.numpy(), GGMLQuantizationType[name]).reshape(37, 256)
    assert ours.dtype == torch.float32 and ours.shape == (37, 256)
    assert np.isfinite(ref).all()
    assert np.array_equal(ours.numpy(), ref)


def test_grid_is_gguf_grid():
    import gguf.quants

    gguf.quants.IQ1_S.init_grid()
    g = grid_values()
    assert g.shape == (2048, 8)
    assert np.array_equal(g.numpy(), gguf.quants.IQ1_S.grid.reshape(2048, 8))


def test_nearest_points_is_exhaustive():
    """The candidate-set search finds the same optimum as trying all 2048 points."""
    g = torch.Generator().manual_seed(3)
    m = 3000
    x = torch.randn(m, 8, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    w = torch.exp(torch.randn(m, 8, generator=g))
    w[:50, :3] = 0  # zero importance keeps the search well defined
    t = x.abs().amax(1) * (0.05 + torch.rand(m, generator=g))
    sign = torch.where(torch.rand(m, generator=g) < 0.5, 1.0, -1.0)
    idx, err = nearest_points(x, w, t, sign)
    y = t[:, None, None] * (grid_values()[None] + (sign * DELTA)[:, None, None])
    full = (w[:, None] * (x[:, None] - y) ** 2).sum(2)
    best = full.min(1).values
    assert torch.allclose(err, best, rtol=1e-5, atol=0)
    assert torch.allclose(full.gather(1, idx[:, None]).squeeze(1), best, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", IQ1)
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
    # About 1.6-1.8 bits: a ternary code with a shared scale leaves 10-25% of the energy.
    rel = weighted_error(w, ours, imatrix) / weighted_error(w, torch.zeros_like(w), imatrix)
    assert rel < 0.3, rel


def test_iq1_m_beats_iq1_s():
    w, imatrix = _weights(16, 1536, seed=5)
    e = {n: weighted_error(w, dequantize(quantize(w, n, imatrix), n), imatrix) for n in IQ1}
    assert e["IQ1_M"] < e["IQ1_S"], e


@pytest.mark.parametrize("name", IQ1)
def test_importance_is_used(name):
    """Raising the importance of some columns lowers their error (the encoder follows w)."""
    w, _ = _weights(8, 1536, seed=7)
    heavy = torch.zeros(1536, dtype=torch.bool)
    heavy[torch.randperm(1536, generator=torch.Generator().manual_seed(0))[:96]] = True
    imatrix = torch.where(heavy, 100.0, 1.0)
    flat = torch.ones(1536) + 1e-3 * torch.rand(1536, generator=torch.Generator().manual_seed(1))
    uniform = dequantize(quantize(w, name, flat), name)
    weighted = dequantize(quantize(w, name, imatrix), name)
    e_uniform = float(((w - uniform) ** 2)[:, heavy].sum())
    e_weighted = float(((w - weighted) ** 2)[:, heavy].sum())
    assert e_weighted < 0.7 * e_uniform
    assert weighted_error(w, weighted, imatrix) < weighted_error(w, uniform, imatrix)


@pytest.mark.parametrize("name", IQ1)
def test_no_imatrix_weights_by_square(name):
    """Without an imatrix the encoder weights by x**2 (llama.cpp's IQ1_M default)."""
    w, _ = _weights(8, 1536, seed=9)
    plain = dequantize(quantize(w, name), name)
    # a nearly flat imatrix (not constant, so taken as given) weights all columns alike
    flat = torch.ones(1536) + 1e-3 * torch.rand(1536, generator=torch.Generator().manual_seed(1))
    uniform = dequantize(quantize(w, name, flat), name)
    e_sq = lambda dec: float((w * w * (w - dec) ** 2).sum())  # noqa: E731
    assert e_sq(plain) < e_sq(uniform)
    assert weighted_error(w, uniform) < weighted_error(w, plain)


@pytest.mark.parametrize("name", IQ1)
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


@pytest.mark.parametrize("name", IQ1)
def test_no_per_column_rounding(name):
    """Vector-quantised: the per-column steps GPTQ uses are not offered."""
    with pytest.raises(NotImplementedError):
        get_codec(name).fit_params(torch.zeros(1, 256), torch.ones(1, 256))


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("name", IQ1)
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
#
# Measured ours / llama.cpp weighted error (this test's data, at most 48 rows a tensor):
#   SmolLM2 (9 tensors, dithered):  IQ1_S mean 0.779, worst 0.835;  IQ1_M mean 0.768, worst 0.837
#   synthetic (Gaussian 1536 and 2304 columns, Student t 1024):  IQ1_S 0.67-0.72;  IQ1_M 0.70-0.75


def _rows_of_256(tensors, max_rows: int = 48):
    """SmolLM2 tensors as (rows, K) with K a multiple of 256, and their (K,) imatrix.

    ``ffn_down`` (K = 1536) as is; K = 576 tensors join four rows, ``W.reshape(N/4, 2304)``
    with the imatrix repeated four times (every weight keeps its importance). Every
    ``N // max_rows``-th row is kept to bound the test time.
    """
    out = []
    for _, w, imatrix in tensors:
        if w.shape[1] % 256:
            w, imatrix = w.reshape(-1, 4 * w.shape[1]), imatrix.repeat(4)
        step = max(1, w.shape[0] // max_rows)
        out.append((w[::step].contiguous(), imatrix))
    return out


@pytest.fixture(scope="module")
def smollm2_rows(smollm2_weights):
    return _rows_of_256(smollm2_weights)


@pytest.mark.parametrize("name", IQ1)
def test_quality_vs_llama_cpp_smollm2(name, smollm2_rows):
    """On average over the SmolLM2 tensors no worse than llama.cpp, and never 2% worse."""
    pytest.importorskip("llama_cpp")
    ratios = error_ratios(smollm2_rows, name)
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios


@pytest.mark.parametrize("name", IQ1)
def test_quality_vs_llama_cpp_synthetic(name):
    pytest.importorskip("llama_cpp")
    tensors = [_weights(32, k, seed=k) for k in (1536, 2304)]
    # a heavy-tailed (Student t, 3 dof) tensor with its own imatrix
    g = torch.Generator().manual_seed(17)
    chi2 = (torch.randn(3, 32, 1024, generator=g) ** 2).mean(0)
    t3 = torch.randn(32, 1024, generator=g) / chi2.sqrt() * 0.02
    tensors.append((t3, torch.exp(torch.randn(1024, generator=g))))
    ratios = error_ratios(tensors, name)
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios
