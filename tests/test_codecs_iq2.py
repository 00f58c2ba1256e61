"""IQ2 grid i-quants IQ2_XXS, IQ2_XS, IQ2_S: layout parity with gguf-py, search optimality, quality.

Parity: our decode equals ``gguf.quants.dequantize`` bit for bit, on random bytes and on
our own encodings (odd row counts, rows of 256, 1536 and 2304, zero and one-sided blocks).

Search: every group's codeword and signs are the exact optimum under the stored scales
(checked by brute force over the whole codebook and every sign pattern the format allows).

Quality: the importance-weighted error of our encoding against llama.cpp's
``ggml_quantize_chunk`` (``tests/ggml_ref.py``) with the same imatrix, on dithered SmolLM2
weights and on synthetic ones.
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
from dynaquant.quant.codecs._lattice import gguf_grid

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

IQ2 = ("IQ2_XXS", "IQ2_XS", "IQ2_S")
SUB_LEN = {"IQ2_XXS": 32, "IQ2_XS": 16, "IQ2_S": 16}


def _weights(rows: int, k: int, seed: int, heavy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (rows, k) float32 weights with hard blocks, and a (k,) lognormal imatrix.

    Gaussian rows with a lognormal scale and 0.3% outliers (x10), or Student-t (3 dof) when
    ``heavy``; with more than one block the first row's first block is all zero, its second
    (when there is one) all negative with an outlier, a third all positive.
    """
    g = torch.Generator().manual_seed(seed)
    if heavy:
        z = torch.randn(rows, k, generator=g)
        chi2 = sum(torch.randn(rows, k, generator=g) ** 2 for _ in range(3)) / 3
        w = z / chi2.sqrt()
    else:
        w = torch.randn(rows, k, generator=g)
        w = torch.where(torch.rand(rows, k, generator=g) < 0.003, w * 10, w)
    w = w * torch.exp(0.7 * torch.randn(rows, 1, generator=g))
    if rows * k > 256:
        w[0, :256] = 0
    if k >= 512:
        w[0, 256:512] = -w[0, 256:512].abs() * 2
        w[0, 300] = -40.0
    if k >= 768:
        w[0, 512:768] = w[0, 512:768].abs() + 0.1
    imatrix = torch.exp(1.5 * torch.randn(k, generator=g))
    return w, imatrix


@pytest.mark.parametrize("name", IQ2)
def test_block_size_matches_gguf(name):
    codec = get_codec(name)
    assert (codec.format.block_size, codec.format.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", IQ2)
def test_decode_random_bytes_matches_gguf(name):
    """Any byte pattern (with a finite float16 d) decodes exactly as gguf-py decodes it."""
    ts = get_codec(name).format.type_size
    g = torch.Generator().manual_seed(1)
    b = torch.randint(0, 256, (37, ts), dtype=torch.uint8, generator=g)
    b[:, :2] = (torch.randn(37, generator=g) * 0.05).to(torch.float16).view(torch.uint8).reshape(37, 2)
    ours = get_codec(name).decode_blocks(b)
    ref = gguf_dequantize(b.numpy(), GGMLQuantizationType[name]).reshape(37, 256)
    assert ours.dtype == torch.float32 and ours.shape == (37, 256)
    assert np.array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("name", IQ2)
@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (5, 1536), (3, 2304)])
def test_encode_roundtrip_matches_gguf(name, shape):
    w, imatrix = _weights(*shape, seed=shape[0] * 31 + shape[1])
    data = quantize(w, name, imatrix)
    fmt = get_codec(name).format
    assert data.dtype == torch.uint8 and data.shape == (shape[0], shape[1] // 256 * fmt.type_size)
    ours = dequantize(data, name)
    assert np.array_equal(ours.numpy(), gguf_dequantize(data.numpy(), GGMLQuantizationType[name]))
    assert torch.isfinite(ours).all()
    if w.numel() > 256:
        assert (ours[0, :256] == 0).all()  # the zero block stays exactly zero
    # well below the error of the zero encoding, and of the order of a 2-bit code's
    rel = weighted_error(w, ours, imatrix) / weighted_error(w, torch.zeros_like(w), imatrix)
    assert rel < 0.2


def _brute_force_group_error(x, w, db, grid, parity):
    """(n, 8) weights, importance and stored scales (n,) -> (n,) least error over every codeword
    and every allowed sign pattern, by enumeration (float64, independent of the encoder)."""
    x, w, db, grid = (t.to(torch.float64) for t in (x, w, db, grid))
    patterns = torch.tensor(list(itertools.product((1.0, -1.0), repeat=8)), dtype=torch.float64)  # (256, 8)
    if parity:
        patterns = patterns[(patterns < 0).sum(dim=1) % 2 == 0]
    best = torch.full((x.shape[0],), float("inf"), dtype=torch.float64)
    for gi in range(grid.shape[0]):
        vals = db[:, None, None] * grid[gi] * patterns[None]  # (n, P, 8)
        err = (w[:, None, :] * (x[:, None, :] - vals) ** 2).sum(dim=2).amin(dim=1)
        best = torch.minimum(best, err)
    return best


@pytest.mark.parametrize("name", IQ2)
def test_codewords_and_signs_are_optimal_for_stored_scales(name):
    """Given the stored d and sub-block scales, each group's codeword and signs (with the
    parity flip for IQ2_XXS/IQ2_XS) are the exact optimum over the whole codebook."""
    w, imatrix = _weights(2, 256, seed=3)
    data = quantize(w, name, imatrix)
    dec = dequantize(data, name).reshape(-1, 8).to(torch.float64)
    b = data.reshape(-1, get_codec(name).format.type_size)
    d, s, _, _ = get_codec(name)._unpack(b)
    db = (d * (0.5 + s.to(torch.float32)) * 0.25).repeat_interleave(SUB_LEN[name] // 8, dim=1).reshape(-1)
    x, imp = w.reshape(-1, 8), imatrix.expand(2, 256).reshape(-1, 8)
    ours = (imp.to(torch.float64) * (x.to(torch.float64) - dec) ** 2).sum(dim=1)
    best = _brute_force_group_error(x, imp, db, gguf_grid(name), name != "IQ2_S")
    assert torch.all(ours <= best * (1 + 1e-5) + 1e-9), (ours - best).max()


@pytest.mark.parametrize("name", IQ2)
def test_candidate_search_close_to_exhaustive(name, monkeypatch):
    """Restricting the scale search to each group's coarse argmins costs little error."""
    w, imatrix = _weights(4, 1536, seed=13)
    fast = weighted_error(w, dequantize(quantize(w, name, imatrix), name), imatrix)
    monkeypatch.setattr(type(get_codec(name)), "exhaustive", True)
    full = weighted_error(w, dequantize(quantize(w, name, imatrix), name), imatrix)
    assert fast <= full * 1.03, (fast, full)


def test_parity_flip_is_taken_where_cheapest():
    """One group with one negative weight: IQ2_XXS must flip exactly one sign, and the best
    choice is the weight with the least ``w |x| g`` (here the tiny negative one itself)."""
    x = torch.full((1, 256), 0.3)
    x[0, 1::2] = 0.8
    x[0, 5] = -0.01  # odd count of negatives in group 0; flipping it to + costs almost nothing
    dec = dequantize(quantize(x, "IQ2_XXS", torch.ones(256) * 2.0), "IQ2_XXS")
    assert (dec[0, :8] >= 0).all()
    assert (dec > 0).all()


def test_error_decreases_with_bits():
    w, imatrix = _weights(8, 1536, seed=5)
    errs = [weighted_error(w, dequantize(quantize(w, n, imatrix), n), imatrix) for n in IQ2]
    assert all(a > b for a, b in itertools.pairwise(errs)), errs


@pytest.mark.parametrize("name", IQ2)
def test_importance_is_used(name):
    """Raising the importance of some columns lowers their error (the encoder follows w)."""
    w, _ = _weights(4, 1536, seed=7)
    heavy = torch.zeros(1536, dtype=torch.bool)
    heavy[torch.randperm(1536, generator=torch.Generator().manual_seed(0))[:96]] = True
    imatrix = torch.where(heavy, 100.0, 1.0)
    uniform = dequantize(quantize(w, name, torch.ones(1536)), name)
    weighted = dequantize(quantize(w, name, imatrix), name)
    e_uniform = float(((w - uniform) ** 2)[:, heavy].sum())
    e_weighted = float(((w - weighted) ** 2)[:, heavy].sum())
    assert e_weighted < 0.7 * e_uniform
    assert weighted_error(w, weighted, imatrix) < weighted_error(w, uniform, imatrix)


@pytest.mark.parametrize("name", IQ2)
def test_no_imatrix_uses_llama_cpp_default_weighting(name):
    """Without an imatrix the encoder uses ``0.25 sigma2 + x**2`` (llama.cpp's IQ2_S fallback)."""
    w, _ = _weights(3, 512, seed=9)
    codec = get_codec(name)
    plain = quantize(w, name)
    explicit = codec.encode_blocks(w.reshape(-1, 256), codec.default_importance(w.reshape(-1, 256)))
    assert torch.equal(plain.reshape(-1, codec.format.type_size), explicit)
    # the default weighting favours large weights: their error is lower than under (almost) uniform weights
    near_uniform = torch.rand(6, 256, generator=torch.Generator().manual_seed(0)) * 1e-3 + 1
    flat = dequantize(codec.encode_blocks(w.reshape(-1, 256), near_uniform).reshape(3, -1), name)
    x2 = w * w
    assert weighted_error(w, dequantize(plain, name), x2) < weighted_error(w, flat, x2)


@pytest.mark.parametrize("name", IQ2)
def test_vector_quantizer_has_no_per_weight_grid(name):
    """GPTQ needs per-weight rounding: these codecs say they have none."""
    codec = get_codec(name)
    with pytest.raises(NotImplementedError):
        codec.fit_params(torch.zeros(1, 256), torch.ones(1, 256))


@pytest.mark.parametrize("name", IQ2)
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
@pytest.mark.parametrize("name", IQ2)
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


def _rows_of_256(tensors, max_rows: int = 48):
    """SmolLM2 test tensors as (rows, K) matrices with K a multiple of 256, and their imatrix.

    ``ffn_down`` (K = 1536) is used as is; K = 576 rows are joined four at a time,
    ``W.reshape(N/4, 2304)`` with the imatrix repeated, so every weight keeps its own
    importance. Every ``N // max_rows``-th row is kept to bound the test time.
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


@pytest.mark.parametrize("name", IQ2)
def test_quality_vs_llama_cpp_smollm2(name, smollm2_rows):
    """On average over the (dithered) SmolLM2 tensors no worse than llama.cpp, never 2% worse."""
    pytest.importorskip("llama_cpp")
    ratios = error_ratios(smollm2_rows, name)
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios


@pytest.mark.parametrize("name", IQ2)
def test_quality_vs_llama_cpp_synthetic(name):
    """Gaussian and heavy-tailed weights with a lognormal imatrix."""
    pytest.importorskip("llama_cpp")
    tensors = [_weights(24, 1536, seed=1536), _weights(16, 2304, seed=2304, heavy=True)]
    ratios = error_ratios(tensors, name)
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios


def test_no_imatrix_quality_vs_llama_cpp_iq2_s():
    """IQ2_S is the one type llama.cpp encodes without an imatrix (with the weighting we copy):
    ours is no worse, in plain squared error and in that weighting."""
    pytest.importorskip("llama_cpp")
    from ggml_ref import ggml_quantize

    for seed, heavy in ((21, False), (22, True)):
        w, _ = _weights(16, 1536, seed=seed, heavy=heavy)
        ours = dequantize(quantize(w, "IQ2_S"), "IQ2_S")
        ref = torch.from_numpy(gguf_dequantize(ggml_quantize(w.numpy(), "IQ2_S", None), GGMLQuantizationType.IQ2_S))
        blocks = w.reshape(-1, 256)
        weight = get_codec("IQ2_S").default_importance(blocks).reshape(w.shape)
        for imp in (torch.ones_like(w), weight):
            e_ours = float((imp * (w - ours) ** 2).sum())
            e_ref = float((imp * (w - ref) ** 2).sum())
            assert e_ours <= e_ref, (seed, e_ours / e_ref)
