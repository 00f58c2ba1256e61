"""Legacy (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and non-linear (IQ4_NL, MXFP4) block codecs.

Decoders are checked bit for bit against gguf-py's numpy ``dequantize``; encoders against
llama.cpp's own ``ggml_quantize_chunk`` (importance-weighted error on real SmolLM2 weights
with their imatrix) and against gguf-py's reference quantizers.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dynaquant.quant.codecs import dequantize, get_codec, quantize, weighted_error
from dynaquant.quant.formats import get_format

LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
NONLINEAR = ["IQ4_NL", "MXFP4"]
ALL = LEGACY + NONLINEAR
# gguf-py has a reference (llama.cpp ``quantize_row_*_ref``) encoder for these.
GGUF_PY_ENCODERS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _weights(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (rows, k) weight: randn times a lognormal row scale, a few 20x outliers,
    one all-zero block; and a lognormal (k,) imatrix."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(0.7 * torch.randn(rows, 1, generator=g)) * 0.02
    n_out = max(1, rows * k // 500)
    idx = torch.randint(0, rows * k, (n_out,), generator=g)
    x.view(-1)[idx] *= 20.0
    x[rows // 2, :32] = 0.0
    imatrix = torch.exp(1.5 * torch.randn(k, generator=g))
    return x, imatrix


def _gguf_decode(b: torch.Tensor, fmt: str) -> np.ndarray:
    return gguf.quants.dequantize(b.cpu().numpy(), GGMLQuantizationType[fmt])


SHAPES = [(1, 32), (3, 32), (5, 576), (7, 1536), (64, 576)]


@pytest.mark.parametrize("fmt", ALL)
def test_format_row_matches_gguf(fmt):
    f = get_format(fmt)
    assert (f.block_size, f.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_decode_bit_exact_on_encoded(fmt, shape):
    x, imatrix = _weights(*shape, seed=shape[0] * 7 + shape[1])
    b = quantize(x, fmt, imatrix)
    assert b.dtype == torch.uint8 and b.shape == (shape[0], shape[1] // 32 * get_format(fmt).type_size)
    ours = dequantize(b, fmt)
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    assert np.array_equal(ours.numpy(), _gguf_decode(b, fmt))


@pytest.mark.parametrize("fmt", ALL)
def test_decode_bit_exact_on_random_bytes(fmt):
    # Any byte pattern: subnormal/huge/inf/NaN fp16 scales, every E8M0 exponent, every code.
    g = torch.Generator().manual_seed(1)
    b = torch.randint(0, 256, (257, 3 * get_format(fmt).type_size), generator=g, dtype=torch.uint8)
    if fmt == "MXFP4":
        b[:256, 0] = torch.arange(256, dtype=torch.uint8)
    ours = dequantize(b, fmt).numpy()
    with np.errstate(all="ignore"):
        ref = _gguf_decode(b, fmt)
    assert np.array_equal(ours, ref, equal_nan=True)


@pytest.mark.parametrize("fmt", ALL)
def test_encode_shape_contract_and_zero_block(fmt):
    codec = get_codec(fmt)
    x, _ = _weights(4, 64, seed=3)
    x[1] = 0.0
    blocks = x.reshape(-1, 32)
    b = codec.encode_blocks(blocks, torch.ones_like(blocks))
    assert b.dtype == torch.uint8 and b.shape == (blocks.shape[0], get_format(fmt).type_size)
    y = codec.decode_blocks(b)
    assert y.shape == blocks.shape and y.dtype == torch.float32
    assert torch.equal(y[2:4], torch.zeros(2, 32))  # row 1 = blocks 2, 3


@pytest.mark.parametrize("fmt", ALL)
def test_never_worse_than_zero_and_scale_equivariant(fmt):
    # Every block's weighted error is at most that of decoding to all zeros; scaling the
    # input by 2**k scales the decoded output by exactly 2**k (all float steps are exact
    # under power-of-two scaling, so the search makes the same choices).
    codec = get_codec(fmt)
    x, imatrix = _weights(32, 576, seed=4)
    blocks = x.reshape(-1, 32)
    w = imatrix.expand(32, -1).reshape(-1, 32).contiguous()
    y = codec.decode_blocks(codec.encode_blocks(blocks, w))
    err = (w * (blocks - y) ** 2).sum(1)
    assert (err <= (w * blocks**2).sum(1)).all()
    y8 = codec.decode_blocks(codec.encode_blocks(blocks * 8.0, w))
    assert torch.equal(y8, y * 8.0)


def _representable(fmt: str, n_blocks: int, seed: int) -> torch.Tensor:
    """Blocks whose values lie exactly on the format's grid, every block using both extreme codes."""
    g = torch.Generator().manual_seed(seed)
    codec = get_codec(fmt)
    if fmt == "MXFP4":
        e = torch.randint(110, 130, (n_blocks, 1), generator=g, dtype=torch.uint8)
        q = torch.randint(0, 16, (n_blocks, 32), generator=g)
        q[:, 0] = 7  # +12: the largest magnitude sets the exponent
        nib = (q[:, :16] | (q[:, 16:] << 4)).to(torch.uint8)
        return codec.decode_blocks(torch.cat([e, nib], dim=1))
    d = (torch.rand(n_blocks, 1, generator=g) * 0.01 + 0.001).half().float()
    if fmt in ("Q4_1", "Q5_1"):
        nmax = 15 if fmt == "Q4_1" else 31
        q = torch.randint(0, nmax + 1, (n_blocks, 32), generator=g).float()
        q[:, 0], q[:, 1] = 0, nmax
        m = (torch.randn(n_blocks, 1, generator=g) * 0.01).half().float()
        return d * q + m
    levels = torch.tensor(codec.grid.levels)
    idx = torch.randint(0, len(levels), (n_blocks, 32), generator=g)
    idx[:, 0], idx[:, 1] = 0, len(levels) - 1
    return d * levels[idx]


@pytest.mark.parametrize("fmt", ALL)
def test_representable_blocks_are_reproduced_exactly(fmt):
    codec = get_codec(fmt)
    x = _representable(fmt, 256, seed=5)
    for w in (torch.ones_like(x), torch.exp(torch.randn(x.shape, generator=torch.Generator().manual_seed(6)))):
        y = codec.decode_blocks(codec.encode_blocks(x, w))
        assert torch.equal(y, x)


@pytest.mark.parametrize("fmt", ALL)
def test_importance_is_used(fmt):
    # Encoding with the imatrix must beat encoding without it, on the imatrix-weighted error.
    x, imatrix = _weights(32, 1536, seed=7)
    with_im = weighted_error(x, dequantize(quantize(x, fmt, imatrix), fmt), imatrix)
    without = weighted_error(x, dequantize(quantize(x, fmt), fmt), imatrix)
    assert with_im <= without * (0.999 if fmt != "MXFP4" else 1.0)


@pytest.mark.parametrize("fmt", GGUF_PY_ENCODERS)
def test_better_than_gguf_py_reference_encoder(fmt):
    # gguf-py's quantizers reproduce llama.cpp's ``quantize_row_*_ref`` (max-based scale).
    x, imatrix = _weights(32, 1536, seed=8)
    for im in (None, imatrix):
        ours = weighted_error(x, dequantize(quantize(x, fmt, im), fmt), im)
        ref_bytes = gguf.quants.quantize(x.numpy(), GGMLQuantizationType[fmt])
        ref = weighted_error(x, torch.from_numpy(gguf.quants.dequantize(ref_bytes, GGMLQuantizationType[fmt])), im)
        assert ours <= ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ALL)
def test_device_agnostic(fmt, device):
    x, imatrix = _weights(16, 576, seed=9)
    b = quantize(x.to(device), fmt, imatrix.to(device))
    assert b.device.type == device
    y = dequantize(b, fmt)
    assert y.device.type == device
    assert np.array_equal(y.cpu().numpy(), _gguf_decode(b, fmt))
    if device != "cpu":
        # Same search, other float reductions: the error may differ by rounding only.
        e_dev = weighted_error(x, y.cpu(), imatrix)
        e_cpu = weighted_error(x, dequantize(quantize(x, fmt, imatrix), fmt), imatrix)
        assert e_dev <= e_cpu * 1.01


# ---------------------------------------------------------------- against llama.cpp

# Rows per real tensor in the llama.cpp comparison (keeps the file fast on 2 cores).
QUALITY_ROWS = 256


def _ggml_error(fmt: str, x: torch.Tensor, imatrix: torch.Tensor | None) -> float:
    from ggml_ref import ggml_quantize

    b = ggml_quantize(x.numpy(), fmt, None if imatrix is None else imatrix.numpy())
    return weighted_error(x, torch.from_numpy(gguf.quants.dequantize(b, GGMLQuantizationType[fmt])), imatrix)


@pytest.mark.parametrize("fmt", ALL)
def test_quality_vs_llama_cpp_with_imatrix(fmt, request):
    """Our imatrix-weighted error is no worse than llama.cpp's on average over the real
    tensors, and never more than 2% worse on any one."""
    pytest.importorskip("llama_cpp")
    ratios = []
    for _name, w, imatrix in request.getfixturevalue("smollm2_weights"):
        x = w[:QUALITY_ROWS].contiguous()
        ours = weighted_error(x, dequantize(quantize(x, fmt, imatrix), fmt), imatrix)
        ratios.append(ours / _ggml_error(fmt, x, imatrix))
    ratios = np.array(ratios)
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios


@pytest.mark.parametrize("fmt", ALL)
def test_quality_vs_llama_cpp_without_imatrix(fmt, request):
    """Without an imatrix (w = 1) our plain squared error is within 2% of llama.cpp's on average."""
    pytest.importorskip("llama_cpp")
    ratios = []
    for _name, w, _ in request.getfixturevalue("smollm2_weights"):
        x = w[: QUALITY_ROWS // 2].contiguous()
        ours = weighted_error(x, dequantize(quantize(x, fmt), fmt))
        ratios.append(ours / _ggml_error(fmt, x, None))
    assert np.mean(ratios) <= 1.02, ratios
