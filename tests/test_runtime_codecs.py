"""Runtime formats (safetensors target): table rows, codec round trips, error against plain rounding,
compressed-tensors' packing and decoders as oracles, super weights, GPTQ and error measurement."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationScheme

from dynaquant.quant.codecs import dequantize, quantize
from dynaquant.quant.formats import FORMATS, RUNTIME_FORMATS, formats_for, get_format, resolve_for_row
from dynaquant.quant.runtime import (
    compressed_tensors_scheme,
    decode,
    encode,
    format_of_scheme,
    from_compressed_tensors,
    from_records,
    pack_int32,
    to_compressed_tensors,
    unpack_int32,
)

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian weights with 1 % outliers (x4) and a heavy-tailed positive imatrix."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w = torch.where(torch.rand(n, k, generator=g) < 0.01, w * 4, w)
    imp = torch.rand(k, generator=g).pow(4) * 10 + 0.01
    return w, imp


def test_table_rows_derive_bpw_and_targets():
    assert get_format("INT4_G128").bpw == 4 + 16 / 128
    assert get_format("INT4_G128_ASYM").bpw == 4 + (16 + 4) / 128
    assert get_format("INT3_G32_ASYM").bpw == 3 + (16 + 3) / 32
    assert get_format("MXFP4_G32").bpw == 4.25 and get_format("NVFP4_G16").bpw == 4.5
    assert get_format("MXFP4").bpw == 4.25 and get_format("MXFP4").target == "gguf"  # GGUF's row is another row
    assert len(RUNTIME_FORMATS) == 4 * 3 * 2 + 2
    assert set(formats_for("safetensors")) == set(RUNTIME_FORMATS) | {"F32", "F16", "BF16"}
    assert not set(formats_for("gguf")) & set(RUNTIME_FORMATS)
    f = get_format("INT3_G32_ASYM")
    assert f.row_bytes(576) == -(-576 // 32 * (32 * 3 + 16 + 3) // 8) and f.record_bytes(576) == 18 * 35
    assert resolve_for_row("INT4_G128", 576)[0].name == "INT4_G64"  # 576 = 9 x 64
    assert resolve_for_row("INT4_G128_ASYM", 96)[0].name == "INT4_G32_ASYM"
    fmt, why = resolve_for_row("INT8_G128", 48)
    assert fmt.name == "BF16" and "INT8_G128->INT8_G64->INT8_G32->BF16" in why
    with pytest.raises(ValueError, match="multiple"):
        get_format("INT2_G64").row_bytes(100)


@pytest.mark.parametrize("name", RUNTIME_FORMATS)
def test_round_trip_layouts_and_contract(name):
    f = get_format(name)
    n, k = 37, 3 * max(f.block_size, 32)  # odd row count, several groups
    w, imp = _weights(n, k, seed=len(name))
    rw = encode(w, name, imp)
    d = decode(rw)
    # the reference codec's records decode to the same values, bit for bit
    assert torch.equal(d, dequantize(quantize(w, name, imp), name))
    # the file layout round-trips exactly
    ct = to_compressed_tensors(rw)
    back = from_compressed_tensors(name, ct, (n, k))
    assert torch.equal(decode(back), d)
    assert sum(t.numel() * t.element_size() for t in ct.values()) <= n * f.row_bytes(k) + 16 + 4 * k // f.block_size + 4
    # the unpacked contract the kernels consume
    codes, scales, zeros, gs = rw.unpacked()
    assert codes.shape == (n, k) and scales.shape == (n, k // f.block_size)
    if f.kind == "int":
        assert scales.dtype == torch.float16 and gs is None
        if f.zero_bits:
            assert codes.dtype == zeros.dtype == torch.uint8 and int(codes.max()) < 2 ** f.bits
            assert zeros.shape == scales.shape and int(zeros.max()) < 2 ** f.bits
            per_group = zeros.float().repeat_interleave(f.block_size, 1)
            ref = (codes.float() - per_group) * scales.float().repeat_interleave(f.block_size, 1)
        else:
            assert codes.dtype == torch.int8 and zeros is None
            assert -(2 ** (f.bits - 1)) <= int(codes.min()) and int(codes.max()) < 2 ** (f.bits - 1)
            ref = codes.float() * scales.float().repeat_interleave(f.block_size, 1)
    else:
        assert codes.dtype == torch.uint8 and int(codes.max()) < 16 and zeros is None
        vals = E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
        if name == "MXFP4_G32":
            assert scales.dtype == torch.uint8 and gs is None
            ref = vals * torch.exp2(scales.double() - 127).float().repeat_interleave(32, 1)
        else:
            assert scales.dtype == torch.float8_e4m3fn and gs.dtype == torch.float32 and gs.ndim == 0
            ref = vals * (scales.float() / gs).repeat_interleave(16, 1)
    assert torch.equal(ref, d)
    with pytest.raises(ValueError, match="multiple"):
        encode(w[:, : k - 8], name)


def _rtn(w: torch.Tensor, name: str) -> torch.Tensor:
    """Plain round-to-nearest with compressed-tensors' min-max observer formulas (no search)."""
    f = get_format(name)
    n, k = w.shape
    x = w.reshape(n, -1, f.block_size)
    if f.kind == "int":
        qmin, qmax = -(2 ** (f.bits - 1)), 2 ** (f.bits - 1) - 1
        lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
        if f.zero_bits:
            s = (hi - lo) / (qmax - qmin)
            zp = torch.round(qmin - lo / s).clamp(qmin, qmax)
            return ((torch.round(x / s) + zp).clamp(qmin, qmax) - zp).mul(s).reshape(n, k)
        s = torch.maximum(-lo, hi) / ((qmax - qmin) / 2)
        return torch.round(x / s).clamp(qmin, qmax).mul(s).reshape(n, k)
    amax = x.abs().amax(-1, keepdim=True)
    if name == "MXFP4_G32":
        s = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    else:
        g = 448 * 6 / w.abs().max()
        s = (amax / 6 * g).to(torch.float8_e4m3fn).float() / g
    t = (x / s).clamp(-6, 6)
    near = E2M1[(t.abs()[..., None] - E2M1).abs().argmin(-1)] * t.sign()
    return (near * s).reshape(n, k)


@pytest.mark.parametrize("name", RUNTIME_FORMATS)
def test_encoder_beats_plain_rounding_on_weighted_error(name):
    w, imp = _weights(64, 384, seed=7)
    ours = ((decode(encode(w, name, imp)) - w).pow(2) * imp).sum()
    rtn = ((_rtn(w, name) - w).pow(2) * imp).sum()
    assert ours < (0.97 if get_format(name).bits < 8 else 1.0) * rtn
    # without an imatrix the unweighted error is no worse either
    plain = (decode(encode(w, name)) - w).pow(2).sum()
    assert plain <= (_rtn(w, name) - w).pow(2).sum()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("cols", [32, 100, 257])
def test_dense_int32_packing_matches_compressed_tensors(bits, cols):
    g = torch.Generator().manual_seed(bits * cols)
    v = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (7, cols), generator=g, dtype=torch.int8)
    u = v.to(torch.int64) + 2 ** (bits - 1)
    packed = pack_int32(u, bits)
    assert torch.equal(packed, pack_to_int32(v, bits))
    assert torch.equal(unpack_int32(packed, bits, cols), u)
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size([7, cols])), v)
    assert torch.equal(pack_int32(u.T, bits).T, pack_to_int32(v, bits, packed_dim=0))  # zero points: along N


@pytest.mark.parametrize("name", ["INT2_G64", "INT3_G32", "INT4_G128", "INT8_G32", "INT2_G32_ASYM", "INT3_G128_ASYM",
                                  "INT4_G64_ASYM", "INT8_G128_ASYM", "MXFP4_G32", "NVFP4_G16"])
def test_compressed_tensors_decompressors_read_our_tensors(name):
    """compressed-tensors' own scheme validation and decompressor on our config entry and tensors."""
    w, imp = _weights(33, 256, seed=3)
    rw = encode(w, name, imp)
    scheme = QuantizationScheme.model_validate({"targets": ["Linear"], **compressed_tensors_scheme(name)})
    assert format_of_scheme(compressed_tensors_scheme(name)) == name
    sd = to_compressed_tensors(rw)
    if rw.scales.dtype == torch.float16:
        sd["weight_scale"] = sd["weight_scale"].float()  # as transformers loads them into a float32 model
    out = BaseCompressor.get_value_from_registry(scheme.format).decompress(sd, scheme)["weight"]
    ours = decode(rw)
    if get_format(name).kind == "int":
        assert torch.equal(out.float(), ours)  # float32 arithmetic on both sides
    else:
        assert out.dtype == torch.bfloat16 and torch.equal(out, ours.to(torch.bfloat16))  # compressed-tensors ends in bf16


def test_super_weights_are_restored_exactly():
    w, imp = _weights(40, 128, seed=5)
    w[3, 17], w[30, 100] = 1.7, -2.3  # outliers a 4-bit grid would clip
    rw = encode(w, "INT4_G128", imp, super_weights=([3, 30], [17, 100]))
    d = decode(rw)
    assert d[3, 17] == w[3, 17] and d[30, 100] == w[30, 100]
    plain = decode(encode(w, "INT4_G128", imp))
    mask = torch.ones_like(w, dtype=torch.bool)
    mask[3, 17] = mask[30, 100] = False
    assert torch.equal(d[mask], plain[mask])
    with pytest.raises(ValueError, match="outside"):
        encode(w, "INT4_G128", super_weights=([40], [0], [1.0]))


def test_gptq_rounds_to_runtime_formats():
    from dynaquant.quant.gptq import gptq_round

    w, _ = _weights(48, 256, seed=11)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=g) @ (torch.eye(256) + 0.3 * torch.randn(256, 256, generator=g) / 16)
    h = x.T @ x / 512
    for name in ("INT4_G128", "INT3_G64_ASYM", "MXFP4_G32"):
        res = gptq_round(w, name, h)
        rw = from_records(res.data, name, tuple(w.shape))
        assert torch.equal(decode(rw), res.decoded)
        out_gptq = ((res.decoded - w) @ h * (res.decoded - w)).sum()
        out_plain = ((decode(encode(w, name)) - w) @ h * (decode(encode(w, name)) - w)).sum()
        assert out_gptq < out_plain


def test_error_measurement_covers_runtime_formats():
    from dynaquant.analysis.errors import RowWeights, measure_errors

    w, imp = _weights(96, 576, seed=2)
    names = ["INT2_G64", "INT4_G128", "INT4_G64", "INT8_G32", "NVFP4_G16", "Q4_0"]
    errs = measure_errors(w, names, RowWeights(fisher=torch.ones(96), hessian=torch.diag(imp)), imatrix=imp)
    assert "INT4_G128" not in errs  # 576 is not a multiple of 128
    assert errs["INT4_G64"].size_bytes == 96 * get_format("INT4_G64").row_bytes(576)
    assert errs["INT8_G32"].kld_pred < errs["INT4_G64"].kld_pred < errs["INT2_G64"].kld_pred
    assert abs(errs["INT4_G64"].bpw - 4.25) < 1e-12 and set(FORMATS) >= set(errs)
