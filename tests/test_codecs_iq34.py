"""IQ4_XS, NVFP4, IQ3_XXS and IQ3_S codecs: layout parity with gguf-py, encoder quality.

Parity: our decode equals ``gguf.quants.dequantize`` bit for bit, on random bytes and on
our own encodings of random weights of several shapes (odd row counts, rows of 256, 1536
and 2304, outliers, zero and one-signed blocks).

Quality: the importance-weighted error of our encoding against llama.cpp's
``ggml_quantize_chunk`` (``tests/ggml_ref.py``) with the same imatrix, on dithered SmolLM2
weights and on synthetic ones (mean ratio <= 1, no tensor more than 2% worse).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_ref import error_ratios
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from dynaquant.quant.codecs import dequantize, get_codec, quantize, weighted_error

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TYPES = ("IQ4_XS", "NVFP4", "IQ3_XXS", "IQ3_S")
# Offset of the fp16 super-block scale d (NVFP4 has none: 4 UE4M3 bytes, any value valid).
F16_OFFSET = {"IQ4_XS": 0, "IQ3_XXS": 0, "IQ3_S": 0}
# Bits per weight of the codes, for the error bound of a b-bit code (range / 2**b)**2 / 12.
BITS = {"IQ4_XS": 4, "NVFP4": 4, "IQ3_XXS": 3, "IQ3_S": 3}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _weights(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (rows, k) float32 weights with hard blocks, and a (k,) lognormal imatrix.

    Rows get a lognormal scale and 0.3% outliers (x10); with more than one block the first
    row's first 256 weights are zero, the next 256 all negative with a large outlier, the
    next all positive; 16 weights of the last row are zero.
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
    imatrix = torch.exp(1.5 * torch.randn(k, generator=g))
    return w, imatrix


@pytest.mark.parametrize("name", TYPES)
def test_block_size_matches_gguf(name):
    fmt = get_codec(name).format
    assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", TYPES)
def test_decode_random_bytes_matches_gguf(name):
    """Any byte pattern (with a finite fp16 d) decodes exactly as gguf-py decodes it."""
    fmt = get_codec(name).format
    g = torch.Generator().manual_seed(1)
    b = torch.randint(0, 256, (37, fmt.type_size), dtype=torch.uint8, generator=g)
    if name in F16_OFFSET:
        o = F16_OFFSET[name]
        b[:, o : o + 2] = (torch.randn(37, generator=g) * 0.05).to(torch.float16).view(torch.uint8).reshape(37, 2)
    else:  # every UE4M3 code, including 0x7F, 0x80.. (top bit ignored) and 0xFF
        b[:, :4] = torch.arange(37 * 4, dtype=torch.int64).reshape(37, 4).mul(7).remainder(256).to(torch.uint8)
        b[0, :4] = torch.tensor([0x7F, 0xFF, 0x80, 0x7E], dtype=torch.uint8)
    ours = get_codec(name).decode_blocks(b)
    ref = gguf_dequantize(b.numpy(), GGMLQuantizationType[name]).reshape(37, fmt.block_size)
    assert ours.dtype == torch.float32 and ours.shape == (37, fmt.block_size)
    assert np.array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (5, 1536), (3, 2304)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_encode_roundtrip_matches_gguf(name, shape):
    w, imatrix = _weights(*shape, seed=shape[0] * 31 + shape[1])
    data = quantize(w, name, imatrix)
    fmt = get_codec(name).format
    assert data.dtype == torch.uint8 and data.shape == (shape[0], fmt.row_bytes(shape[1]))
    ours = dequantize(data, name)
    assert np.array_equal(ours.numpy(), gguf_dequantize(data.numpy(), GGMLQuantizationType[name]))
    assert torch.isfinite(ours).all()
    if w.numel() > 256:
        assert (ours[0, :256] == 0).all()  # the zero super-block stays exactly zero
    rel = weighted_error(w, ours, imatrix) / weighted_error(w, torch.zeros_like(w), imatrix)
    assert rel < 3.0 * 4.0 ** -BITS[name], rel


@pytest.mark.parametrize("name", TYPES)
def test_scale_equivariant(name):
    """Scaling the input by 8 scales the decoded output by exactly 8 (every float step of the
    search is exact under power-of-two scaling, so it makes the same choices)."""
    w, imatrix = _weights(4, 1536, seed=3)
    y = dequantize(quantize(w, name, imatrix), name)
    y8 = dequantize(quantize(w * 8.0, name, imatrix), name)
    assert torch.equal(y8, y * 8.0)


@pytest.mark.parametrize("name", TYPES)
def test_internal_chunking_does_not_change_bytes(name, monkeypatch):
    """Forcing tiny internal sub-chunks (blocks per pass, rows per score matmul) gives the
    same bytes as the default chunking."""
    from dynaquant.quant.codecs import _blockfit, iq3

    w, imatrix = _weights(5, 1536, seed=12)
    ref = quantize(w, name, imatrix)
    monkeypatch.setattr(_blockfit, "CPU_SUBCHUNK_BLOCKS", 7)
    monkeypatch.setattr(iq3, "_CPU_BLOCKS", 3)
    monkeypatch.setattr(iq3, "_SCORE_ELEMS", {"cpu": 1000, "other": 1000})
    assert torch.equal(quantize(w, name, imatrix), ref)


@pytest.mark.parametrize("name", TYPES)
def test_never_worse_than_zero(name):
    codec = get_codec(name)
    w, imatrix = _weights(8, 1536, seed=4)
    bs = codec.format.block_size
    x = w.reshape(-1, bs)
    wi = imatrix.expand(8, -1).reshape(-1, bs).contiguous()
    y = codec.decode_blocks(codec.encode_blocks(x, wi))
    err = (wi * (x - y) ** 2).sum(1)
    assert (err <= (wi * x * x).sum(1) * (1 + 1e-6)).all()


def _representable(name: str, n: int, seed: int) -> torch.Tensor:
    """Blocks decoded from random valid bytes, with one sub-block at the largest scale (NVFP4:
    one weight of each sub-block at level +-8 or 12)."""
    codec = get_codec(name)
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, codec.format.type_size), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, generator=g) * 0.01 + 0.001).to(torch.float16).view(torch.uint8).reshape(n, 2)
    if name == "IQ4_XS":
        b[:, :2] = d
        b[:, 2:4] = 0xFF  # high bits of l + 32 = 3: l in 16..31
        b[:, 4] = (b[:, 4] & 0xF0) | 0x0F  # sub-block 0: l = 31
    elif name == "IQ3_XXS":
        b[:, :2] = d
        b[:, 69] |= 0xF0  # sub-block 0: l = 15
    elif name == "IQ3_S":
        b[:, :2] = d
        b[:, 106] |= 0x0F
    else:
        b[:, :4] = torch.randint(40, 110, (n, 4), dtype=torch.uint8, generator=g)
        b[:, 4::8] = (b[:, 4::8] & 0xF0) | torch.where(torch.rand(n, 4, generator=g) < 0.5, 6, 15).to(torch.uint8)
    return codec.decode_blocks(b)


@pytest.mark.parametrize("name", TYPES)
def test_representable_blocks_nearly_reproduced(name):
    """Blocks that some bytes decode to exactly are found again (error tiny or zero)."""
    codec = get_codec(name)
    x = _representable(name, 64, seed=5)
    w = torch.exp(torch.randn(x.shape, generator=torch.Generator().manual_seed(6)))
    y = codec.decode_blocks(codec.encode_blocks(x, w))
    rel = float((w * (x - y) ** 2).sum() / (w * x * x).sum())
    exact = int((y == x).all(1).sum())
    assert rel < 1e-3, (rel, exact)
    if name in ("IQ4_XS", "NVFP4"):
        assert exact == x.shape[0]


@pytest.mark.parametrize("name", TYPES)
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
    assert e_weighted < 0.8 * e_uniform
    assert weighted_error(w, weighted, imatrix) < weighted_error(w, uniform, imatrix)


@pytest.mark.parametrize("name", TYPES)
def test_bad_shapes_raise(name):
    codec = get_codec(name)
    bs, ts = codec.format.block_size, codec.format.type_size
    with pytest.raises(ValueError):
        codec.encode_blocks(torch.zeros(2, bs // 2), torch.ones(2, bs // 2))
    with pytest.raises(ValueError):
        codec.encode_blocks(torch.zeros(2, bs), torch.ones(1, bs))
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, bs + 32), name)
    with pytest.raises(ValueError):
        codec.decode_blocks(torch.zeros(2, ts + 1, dtype=torch.uint8))


@pytest.mark.parametrize("name", ["IQ4_XS", "NVFP4"])
def test_block_grid_steps_compose_to_encode(name):
    """Scalar types expose fit_params / round_to_grid / pack (GPTQ's steps): composing them,
    column slices included, gives encode_blocks' bytes and the decoder's values."""
    codec = get_codec(name)
    w, imatrix = _weights(3, 1536, seed=8)
    bs = codec.format.block_size
    x = w.reshape(-1, bs)
    wi = imatrix.expand(3, -1).reshape(-1, bs).contiguous()
    params = codec.fit_params(x, wi)
    codes, values = codec.round_to_grid(x, params)
    data = codec.pack(params, codes)
    assert torch.equal(data, codec.encode_blocks(x, wi))
    assert torch.equal(values, codec.decode_blocks(data))
    c2, v2 = codec.round_to_grid(x[:, 40:57], params, start=40)
    assert torch.equal(c2, codes[:, 40:57]) and torch.equal(v2, values[:, 40:57])


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ3_S"])
def test_vector_types_have_no_per_weight_rounding(name):
    with pytest.raises(NotImplementedError):
        get_codec(name).fit_params(torch.zeros(1, 256), torch.ones(1, 256))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", TYPES)
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


@pytest.fixture(scope="module")
def smollm2_rows(smollm2_weights):
    """SmolLM2 test tensors (dithered) as (rows, K) with K a multiple of 256, and their imatrix.

    ``ffn_down`` (K = 1536) as is; the others (K = 576) joined four rows at a time into rows of
    2304 with the imatrix repeated, so each weight keeps its importance. Every
    ``N // 48``-th row is kept to bound the time.
    """
    out = []
    for _, w, imatrix in smollm2_weights:
        if w.shape[1] % 256:
            w, imatrix = w.reshape(-1, 4 * w.shape[1]), imatrix.repeat(4)
        step = max(1, w.shape[0] // 48)
        out.append((w[::step].contiguous(), imatrix))
    return out


@pytest.mark.parametrize("name", TYPES)
def test_quality_vs_llama_cpp_smollm2(name, smollm2_rows):
    """On average over the SmolLM2 tensors no worse than llama.cpp, and never 2% worse."""
    pytest.importorskip("llama_cpp")
    ratios = error_ratios(smollm2_rows, name)
    print(name, "smollm2 ratios", np.round(ratios, 4), "mean", ratios.mean())
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios


@pytest.mark.parametrize("name", TYPES)
def test_quality_vs_llama_cpp_synthetic(name):
    pytest.importorskip("llama_cpp")
    tensors = [_weights(32, k, seed=k) for k in (1536, 2304)]
    ratios = error_ratios(tensors, name)
    print(name, "synthetic ratios", np.round(ratios, 4))
    assert ratios.mean() <= 1.0, ratios
    assert ratios.max() <= 1.02, ratios


@pytest.mark.parametrize("name", TYPES)
def test_quality_vs_llama_cpp_without_imatrix(name, smollm2_rows):
    """Without an imatrix (w = 1) our plain squared error is no worse than llama.cpp's
    (which then weighs by x**2 for these types, or ignores weights: NVFP4)."""
    pytest.importorskip("llama_cpp")
    tensors = [(w[:16].contiguous(), None) for w, _ in smollm2_rows[::2]]
    ratios = error_ratios(tensors, name)
    print(name, "no-imatrix ratios", np.round(ratios, 4))
    assert ratios.mean() <= 1.0, ratios
