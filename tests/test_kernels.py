"""dynaquant.kernels: packing, the torch reference, and the Triton kernels against it.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``triton_mode`` before the
kernels are first imported) on small shapes; on a CUDA machine the same tests run natively, and the
``cuda`` tests add full-size shapes (Llama-3-8B's) and every path.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from triton_mode import DEVICE, HAS_CUDA  # (imported before Triton: the interpreter without a GPU)

pytest.importorskip("triton")

from dynaquant.kernels import (  # noqa: E402
    DeviceInfo,
    KernelFormat,
    LaunchConfig,
    choose_config,
    dequantize,
    dequantize_packed_ref,
    dequantize_ref,
    gemm_candidates,
    gemv_candidates,
    linear,
    linear_ref,
    pack,
    unpack,
    uses_triton,
    valid_config,
)

INTERPRETED = not HAS_CUDA

FORMATS = ["INT4_G128", "INT4_G64_ASYM", "INT4_G32", "INT2_G128", "INT2_G32_ASYM", "INT3_G128", "INT3_G32_ASYM",
           "INT8_G64", "INT8_G128_ASYM", "MXFP4_G32", "NVFP4_G16"]


def random_weight(fmt: str, n: int, k: int, gen: torch.Generator, device=DEVICE):
    """Random codes/scales/zeros of a format (the unpacked contract), as (codes, scales, zeros, global_scale)."""
    f = KernelFormat.parse(fmt)
    g = f.group_size
    if f.kind == "int":
        b = f.bits
        if f.symmetric:
            codes = torch.randint(-(1 << (b - 1)), 1 << (b - 1), (n, k), generator=gen).to(torch.int8)
            zeros = None
        else:
            codes = torch.randint(0, 1 << b, (n, k), generator=gen).to(torch.uint8)
            zeros = torch.randint(0, 1 << b, (n, k // g), generator=gen).to(torch.uint8)
        sign = torch.where(torch.rand(n, k // g, generator=gen) < 0.1, -1.0, 1.0)  # symmetric scales may be negative
        scales = ((torch.rand(n, k // g, generator=gen) * 0.02 + 0.002) * (sign if f.symmetric else 1.0)).to(torch.float16)
        out = codes, scales, zeros, None
    else:
        codes = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
        if f.kind == "mxfp4":
            out = codes, torch.randint(118, 128, (n, k // g), generator=gen).to(torch.uint8), None, None
        else:
            scales = (torch.rand(n, k // g, generator=gen) * 440 + 2).to(torch.float8_e4m3fn)
            out = codes, scales, None, torch.tensor(2688.0 / 1.7)
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in out)


def packed_weight(fmt, n, k, gen, device=DEVICE, super_weights=None):
    codes, scales, zeros, gs = random_weight(fmt, n, k, gen, device)
    return pack(codes, scales, zeros, fmt, global_scale=gs, super_weights=super_weights)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(y).any()
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def tolerance(dtype) -> float:
    # one rounding of the output (fp16 2**-11, bf16 2**-8 relative); the interpreter rounds bf16 toward zero
    return 1.5e-3 if dtype == torch.float16 else 8e-3


def fp32_ref(x, pw, bias=None):
    y = x.float() @ dequantize_packed_ref(pw).to(x.device).t()
    return y if bias is None else y + bias.float()


# ----------------------------------------------------------------------------------------------
# formats, packing, reference


def test_format_names():
    assert KernelFormat.parse("int4_g128") == KernelFormat("int", 4, 128, True)
    assert KernelFormat.parse("INT2_G64_ASYM") == KernelFormat("int", 2, 64, False)
    assert KernelFormat.parse("MXFP4_G32").kind == "mxfp4" and KernelFormat.parse("NVFP4_G16").group_size == 16
    for name in FORMATS:
        assert KernelFormat.parse(name).name == name
    with pytest.raises(ValueError):
        KernelFormat.parse("Q4_K")
    with pytest.raises(ValueError):
        KernelFormat("int", 5, 128)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_roundtrip(fmt):
    gen = torch.Generator().manual_seed(1)
    codes, scales, zeros, gs = random_weight(fmt, 24, 256, gen, "cpu")
    pw = pack(codes, scales, zeros, fmt, global_scale=gs)
    c2, s2, z2 = unpack(pw)
    assert torch.equal(c2, codes) and c2.dtype == codes.dtype
    assert torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
    assert (z2 is None) == (zeros is None) and (zeros is None or torch.equal(z2, zeros))
    bits = KernelFormat.parse(fmt).bits
    assert pw.qweight.dtype == torch.int32 and pw.qweight.shape == (24, 256 * (2 if bits == 3 else bits) // 32)


def test_pack_rejects_bad_input():
    gen = torch.Generator().manual_seed(2)
    codes, scales, zeros, _ = random_weight("INT4_G64_ASYM", 8, 128, gen, "cpu")
    with pytest.raises(ValueError):
        pack(codes, scales, None, "INT4_G64_ASYM")  # missing zeros
    with pytest.raises(ValueError):
        pack(codes.to(torch.int8), scales, zeros, "INT4_G64_ASYM")  # wrong code dtype
    with pytest.raises(ValueError):
        pack(codes[:, :96], scales[:, :1], zeros[:, :1], "INT4_G64_ASYM")  # K not a multiple of the group
    with pytest.raises(ValueError):
        pack((codes.to(torch.int8) + 8), scales, None, "INT4_G64")  # symmetric codes out of range
    c, s, _, _ = random_weight("NVFP4_G16", 8, 64, gen, "cpu")
    with pytest.raises(ValueError):
        pack(c, s, None, "NVFP4_G16")  # no global scale


def test_dequantize_ref_values():
    # hand-computed values for each rule
    codes = torch.tensor([[-8, 7] * 16], dtype=torch.int8)
    scales = torch.tensor([[0.5]], dtype=torch.float16)
    w = dequantize_ref(codes, scales, None, "INT4_G32")
    assert w[0, 0] == -4.0 and w[0, 1] == 3.5
    codes = torch.tensor([[0, 15] * 16], dtype=torch.uint8)
    w = dequantize_ref(codes, scales, torch.tensor([[3]], dtype=torch.uint8), "INT4_G32_ASYM")
    assert w[0, 0] == -1.5 and w[0, 1] == 6.0
    codes = torch.arange(16, dtype=torch.uint8).repeat(2).reshape(1, 32)
    w = dequantize_ref(codes, torch.tensor([[128]], dtype=torch.uint8), None, "MXFP4_G32")
    assert w[0, :8].tolist() == [0, 1, 2, 3, 4, 6, 8, 12] and w[0, 15] == -12
    w = dequantize_ref(codes[:, :16], torch.tensor([[2.0]]).to(torch.float8_e4m3fn), None, "NVFP4_G16",
                       global_scale=4.0)
    assert w[0, 7] == 3.0 and w[0, 9] == -0.25


def test_reference_matches_runtime_decode():
    """The kernels' reference decodes the unpacked contract as dynaquant.quant.runtime does."""
    runtime = pytest.importorskip("dynaquant.quant.runtime")
    if not hasattr(runtime, "encode") or not hasattr(runtime, "decode"):
        pytest.skip("dynaquant.quant.runtime has no encode/decode")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=gen)
    for fmt in ["INT4_G128", "INT2_G64_ASYM", "INT3_G32", "INT8_G64_ASYM", "MXFP4_G32", "NVFP4_G16"]:
        rw = runtime.encode(w, fmt)
        codes, scales, zeros, gs = rw.unpacked()
        ours = dequantize_ref(codes, scales, zeros, fmt, global_scale=gs)
        assert torch.equal(ours, runtime.decode(rw)), fmt
        pw = pack(codes, scales, zeros, fmt, global_scale=gs)
        assert torch.allclose(dequantize_packed_ref(pw), ours)


# ----------------------------------------------------------------------------------------------
# kernels against the reference


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5])
def test_linear_matches_reference(fmt, m):
    gen = torch.Generator().manual_seed(10 + m)
    n, k = 40, 256  # N not a multiple of the row block, K = 2..16 groups
    pw = packed_weight(fmt, n, k, gen)
    dtype = torch.float16 if m == 5 else torch.bfloat16
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype) if fmt.startswith("INT4") else None
    y = linear(x, pw, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, fp32_ref(x, pw, bias)) < tolerance(dtype)
    assert rel_err(y, linear_ref(x, pw, bias)) < 2 * tolerance(dtype)


@pytest.mark.parametrize("fmt", ["INT4_G128", "INT2_G32_ASYM", "MXFP4_G32"])
@pytest.mark.parametrize("cfg", [LaunchConfig("gemv", 1, 32, 1, 1), LaunchConfig("gemv", 1, 16, 1, 4),
                                 LaunchConfig("mm", 16, 16, 1, 2), LaunchConfig("mm", 16, 32, 2, 1),
                                 LaunchConfig("dequant", 1, 16, 2, 1)])
def test_paths_and_split_k(fmt, cfg):
    """Every path, with and without split-K (the last program reduces; counters reset for the next call)."""
    gen = torch.Generator().manual_seed(20)
    n, k = 24, 512
    pw = packed_weight(fmt, n, k, gen)
    m = 1 if cfg.path == "gemv" else 3
    for _ in range(2):  # a second call checks the split-K counters were reset
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
        y = linear(x, pw, config=cfg)
        assert rel_err(y, fp32_ref(x, pw)) < tolerance(torch.float16)
    assert int(pw.counters.abs().sum()) == 0


@pytest.mark.parametrize("fmt", ["INT4_G64", "INT3_G32", "MXFP4_G32", "NVFP4_G16", "INT4_G128_ASYM"])
@pytest.mark.parametrize("groups,prefetch,split", [(1, True, 2), (2, False, 1), (4, True, 2)])
def test_gemv_tiles_and_prefetch(fmt, groups, prefetch, split):
    """GEMV K tiles of several groups, and the prefetch of the next tile (last tile masked)."""
    f = KernelFormat.parse(fmt)
    gen = torch.Generator().manual_seed(25)
    n, k = 24, 16 * f.group_size
    pw = packed_weight(fmt, n, k, gen)
    cfg = LaunchConfig("gemv", 1, 16, groups, split, 4, 1, prefetch)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.float16)
    if not valid_config(cfg, f, 1, n, k):
        assert not f.symmetric and groups > 1  # asymmetric formats take one group a tile
        with pytest.raises(ValueError):
            linear(x, pw, config=cfg)
        return
    assert rel_err(linear(x, pw, config=cfg), fp32_ref(x, pw)) < tolerance(torch.float16)


@pytest.mark.parametrize("fmt", ["INT4_G128", "INT4_G32", "INT2_G128", "INT2_G64", "MXFP4_G32", "NVFP4_G16"])
@pytest.mark.parametrize("groups,prefetch,split,runs,pairs", [(1, False, 2, 4, False), (2, True, 1, 1, False),
                                                              (8, False, 1, 4, False), (4, False, 2, 1, False),
                                                              (2, False, 2, 4, True), (8, True, 1, 2, True)])
def test_gemv_half2(fmt, groups, prefetch, split, runs, pairs):
    """The packed-fp16 word products (``half2``): every code position paired with its activation (E2M1 codes: every
    magnitude and both signs), bf16 and fp16 inputs, activations up to 3000 in magnitude (fp16 partial sums stay
    finite), bias, a K tile of the whole row (8 groups), a scale a word or a run of words, two words an f16x2 sum
    (``pairs``); natively the PTX."""
    f = KernelFormat.parse(fmt)
    gen = torch.Generator().manual_seed(28)
    n, k = 40, 8 * f.group_size
    pw = packed_weight(fmt, n, k, gen)
    cfg = LaunchConfig("gemv", 1, 16, groups, split, 4, 1, prefetch, half2=True, scale_words=runs, pairs=pairs)
    assert valid_config(cfg, f, 1, n, k)
    bias = torch.randn(n, generator=gen)
    for dtype, scale in ((torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.bfloat16, 1000.0)):
        x = torch.randn(1, k, generator=gen) * scale
        x[0, 7] = 3000.0  # a massive activation (Sun et al. 2024)
        x = x.to(DEVICE, dtype)
        b = bias.to(DEVICE, dtype)
        for _ in range(2):
            assert rel_err(linear(x, pw, b, config=cfg), fp32_ref(x, pw, b)) < tolerance(dtype) * 2
    assert int(pw.counters.abs().sum()) == 0


def _spread_weight(fmt: str, n: int, gen: torch.Generator):
    """A weight of 16 groups a row whose scales differ by up to 2**17 between groups, with activations of the inverse
    magnitude per group (every group adds about as much to a row's sum), NVFP4 scales that include subnormal E4M3
    values; returns (packed, x fp16 (1, K), the same weight with its scales rolled by one group)."""
    f = KernelFormat.parse(fmt)
    g, ng = f.group_size, 16
    k = g * ng
    t = torch.linspace(-9, 8, ng)[torch.randperm(ng, generator=gen)].round()  # log2 of each group's scale
    codes, _, _, gs = random_weight(fmt, n, k, gen, "cpu")
    jitter = torch.randint(-1, 2, (n, ng), generator=gen).float()
    if f.kind == "mxfp4":
        scales = (127 + t + jitter).to(torch.uint8)  # 2**-10 .. 2**9
    elif f.kind == "nvfp4":
        scales = (2.0 ** (t + jitter).clamp(-9, 8) * 1.25).to(torch.float8_e4m3fn)
        scales[:, t == -9] = torch.tensor([1, 3, 5, 7], dtype=torch.uint8).repeat(n)[:n, None].view(
            torch.float8_e4m3fn)  # subnormal E4M3: m * 2**-9
    else:
        sign = torch.where(torch.rand(n, ng, generator=gen) < 0.3, -1.0, 1.0)
        scales = (sign * 2.0 ** (t + jitter - 4)).to(torch.float16)
    # activations 2**-7 .. 2**10 (fp16 products stay normal)
    x = torch.randn(1, k, generator=gen) * (2.0 ** (1 - t)).repeat_interleave(g)[None, :]
    x = x.to(torch.float16)
    pw = pack(codes.to(DEVICE), scales.to(DEVICE), None, fmt, global_scale=gs)
    rolled = pack(codes.to(DEVICE), scales.roll(1, dims=1).to(DEVICE), None, fmt, global_scale=gs)
    return pw, x.to(DEVICE), rolled


@pytest.mark.parametrize("fmt", ["MXFP4_G32", "NVFP4_G16", "INT4_G128", "INT2_G128"])
@pytest.mark.parametrize("pairs", [False, True])
def test_gemv_half2_group_scales(fmt, pairs):
    """Each run of words meets its own group's scale: groups whose scales differ by up to 2**17, from
    subnormal E4M3 values (NVFP4) and of both signs (INT), each group adding about as much to the sum (activations
    of the inverse magnitude); the same weight with its scales rolled by one group is far off (the test sees a
    wrong group); K tiles of 1, 2 and all 16 groups, split-K, a scale a run of 4 or 2 words or a word."""
    f = KernelFormat.parse(fmt)
    gen = torch.Generator().manual_seed(29)
    n = 40
    pw, x, rolled = _spread_weight(fmt, n, gen)
    ref = fp32_ref(x, pw)
    assert rel_err(fp32_ref(x, rolled), ref) > 0.5
    for groups, split, runs in ((1, 2, 4), (2, 1, 2), (16, 1, 4), (2, 2, 1)):
        cfg = LaunchConfig("gemv", 1, 16, groups, split, 4, 1, False, half2=True, scale_words=runs, pairs=pairs)
        if not valid_config(cfg, f, 1, n, pw.in_features):
            assert pairs and runs == 1
            continue
        assert rel_err(linear(x, pw, config=cfg), ref) < tolerance(torch.float16), (groups, split, runs)


@pytest.mark.parametrize("pairs", [False, True])
def test_gemv_half2_e8m0_extremes(pairs):
    """MXFP4 rows whose every scale is an E8M0 extreme: 2**-127 (e = 0, a float32 subnormal, not flushed),
    2**-126 .. 2**-124, and 2**124 .. 2**127 (e = 254); bf16 outputs of about 2**-120 and 2**120, each row within
    a bf16 rounding of its sum of |x w|."""
    gen = torch.Generator().manual_seed(30)
    fmt, k = "MXFP4_G32", 512
    cfg = LaunchConfig("gemv", 1, 16, 4, 2, 4, 1, False, half2=True, pairs=pairs)
    for exps, mag in (([0, 1, 2, 3], 16.0), ([251, 252, 253, 254], 2.0 ** -10)):
        n = 2 * len(exps)
        codes = torch.randint(0, 8, (n, k), generator=gen).to(torch.uint8)  # positive E2M1 values (sums of one sign)
        e = torch.tensor(exps, dtype=torch.uint8).repeat(2)[:, None].expand(n, k // 32).contiguous()
        pw = pack(codes.to(DEVICE), e.to(DEVICE), None, fmt)
        w = dequantize_packed_ref(pw).cpu()
        x = (torch.randn(1, k, generator=gen).abs() * mag).to(torch.bfloat16)
        y = linear(x.to(DEVICE), pw, config=cfg).float()[0].cpu()
        ref = (x.float() @ w.t())[0]
        bound = (x.float().abs() @ w.abs().t())[0]
        assert torch.isfinite(y).all() and (y != 0).all()
        assert ((y - ref).abs() <= 8e-3 * bound).all(), exps


def test_half2_config_checks():
    """``half2`` only on the GEMV path of symmetric INT4 / INT2 and FP4 formats."""
    cfg = LaunchConfig("gemv", 1, 64, 1, 1, half2=True)
    for fmt, ok in (("INT4_G128", True), ("INT2_G32", True), ("INT4_G128_ASYM", False), ("INT3_G128", False),
                    ("INT8_G128", False), ("MXFP4_G32", True), ("NVFP4_G16", True)):
        assert valid_config(cfg, KernelFormat.parse(fmt), 1, 256, 4096) is ok, fmt
    f = KernelFormat.parse("INT4_G128")
    assert not valid_config(LaunchConfig("mm", 16, 64, 1, 1, half2=True), f, 16, 256, 4096)
    assert valid_config(LaunchConfig("gemv", 1, 64, 1, 1, half2=True, pairs=True), f, 1, 256, 4096)
    assert not valid_config(LaunchConfig("gemv", 1, 64, 1, 1, pairs=True), f, 1, 256, 4096)  # pairs needs half2
    assert not valid_config(LaunchConfig("gemv", 1, 64, 1, 1, half2=True, scale_words=1, pairs=True), f, 1, 256, 4096)
    assert not valid_config(LaunchConfig("gemv", 1, 64, 1, 1, half2=True, scale_words=3), f, 1, 256, 4096)
    dev = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0))
    assert any(c.half2 for c in gemv_candidates(f, 4096, 4096, dev))
    assert not any(c.half2 for c in gemv_candidates(KernelFormat.parse("INT8_G128"), 4096, 4096, dev))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_k,split", [(32, 2), (128, 1)])
def test_gemm_path(fmt, block_k, split):
    """The fused dequant-GEMM: K tiles inside one group and across several, a K split (counters reset for
    the next call), a partial token tile and a partial row tile (masked stores, clamped loads), bias."""
    f = KernelFormat.parse(fmt)
    gen = torch.Generator().manual_seed(27)
    n, k, m = 56, 512, 19  # 2 x 2 output tiles, one semaphore each (ceil(56 / 16) = 4)
    pw = packed_weight(fmt, n, k, gen)
    cfg = LaunchConfig("gemm", 16, 32, 1, split, 4, 2, False, block_k)
    assert valid_config(cfg, f, m, n, k)
    bias = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)
    for _ in range(2):
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        assert rel_err(linear(x, pw, bias, config=cfg), fp32_ref(x, pw, bias)) < tolerance(torch.bfloat16)
    assert int(pw.counters.abs().sum()) == 0


@pytest.mark.parametrize("fmt", ["INT4_G128", "INT2_G128", "MXFP4_G32", "INT4_G64_ASYM", "INT3_G128", "NVFP4_G16"])
@pytest.mark.parametrize("xa,post,ws,split,regs", [(True, False, False, 1, 0), (False, True, False, 2, 0),
                                                   (True, True, False, 2, 128), (True, False, True, 1, 0)])
def test_gemm_variants(fmt, xa, post, ws, split, regs):
    """The fused GEMM's variants (tokens as A, the scale on the product, warp specialization, a register cap) against
    the float32 reference: a partial token tile and a partial row tile (19 tokens, 56 rows), a K split, bias,
    counters reset; ``post_scale`` takes K tiles of one group (32 for MXFP4), and is refused for wider ones."""
    f = KernelFormat.parse(fmt)
    gen = torch.Generator().manual_seed(31)
    n, k, m = 56, 512, 19
    pw = packed_weight(fmt, n, k, gen)
    bk = min(64, f.group_size) if post else 64
    cfg = LaunchConfig("gemm", 16, 32, 1, split, 4, 2, False, bk, xa=xa, post_scale=post, warp_spec=ws, max_regs=regs)
    if post and f.group_size < 32:  # NVFP4: K tiles of 32 hold two groups
        assert not valid_config(cfg, f, m, n, k)
        return
    assert valid_config(cfg, f, m, n, k)
    assert not valid_config(LaunchConfig("gemm", 16, 32, 1, 1, 4, 2, False, 2 * f.group_size, post_scale=True), f, m,
                            n, 4 * f.group_size)
    bias = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)
    for _ in range(2):
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        assert rel_err(linear(x, pw, bias, config=cfg), fp32_ref(x, pw, bias)) < tolerance(torch.bfloat16)
    assert int(pw.counters.abs().sum()) == 0


def test_gemm_variant_candidates():
    """The variants are sweep candidates (valid, off by default), and only the gemm path takes them."""
    dev = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0))
    for fmt in ("INT4_G128", "INT2_G128", "MXFP4_G32"):
        f = KernelFormat.parse(fmt)
        for m, n, k in ((16, 4096, 4096), (256, 28672, 4096), (256, 4096, 14336)):
            cands = gemm_candidates(f, m, n, k, dev)
            assert any(c.xa for c in cands)
            assert any(c.post_scale for c in cands) == (m <= 16)
            assert any(c.warp_spec for c in cands) == (m > 16)
            assert any(c.max_regs for c in cands) == (m > 16)
            assert all(valid_config(c, f, m, n, k) for c in cands)
            assert not any(c.xa or c.post_scale or c.warp_spec for c in (choose_config(f, m, n, k, dev),))
    f = KernelFormat.parse("INT4_G128")
    assert not valid_config(LaunchConfig("mm", 16, 64, 1, 1, 4, 3, xa=True), f, 16, 256, 4096)
    assert not valid_config(LaunchConfig("gemm", 16, 64, 1, 1, 2, 3, False, 128, warp_spec=True), f, 16, 256, 4096)
    assert not valid_config(LaunchConfig("gemm", 16, 64, 1, 1, 4, 3, False, 128, max_regs=300), f, 16, 256, 4096)
    assert not valid_config(LaunchConfig("mm", 16, 64, 1, 1, 4, 3, max_regs=128), f, 16, 256, 4096)


def test_gemm_config_checks():
    f = KernelFormat.parse("INT4_G128")
    ok = LaunchConfig("gemm", 64, 128, 1, 1, 4, 3, False, 128)
    assert valid_config(ok, f, 256, 4096, 4096)
    assert not valid_config(LaunchConfig("gemm", 64, 128, 1, 1, 4, 3), f, 256, 4096, 4096)  # no K tile
    assert not valid_config(LaunchConfig("gemm", 64, 128, 1, 1, 4, 3, False, 16), f, 256, 4096, 4096)  # 2 words, 16
    assert not valid_config(LaunchConfig("gemm", 64, 128, 1, 1, 4, 3, False, 192), f, 256, 4096, 4096)  # 24 words
    assert valid_config(LaunchConfig("gemm", 64, 128, 1, 1, 4, 3, False, 256), f, 256, 4096, 4096)
    assert not valid_config(LaunchConfig("gemm", 64, 128, 1, 1, 4, 3, False, 256), f, 256, 4096, 4224)  # 16.5 tiles
    assert valid_config(LaunchConfig("gemm", 64, 128, 1, 4, 4, 3, False, 128), f, 256, 4096, 4096)
    assert not valid_config(LaunchConfig("gemm", 64, 128, 1, 3, 4, 3, False, 128), f, 256, 4096, 4096)  # 32 tiles / 3
    assert not valid_config(LaunchConfig("gemm", 16, 16, 1, 2, 4, 3, False, 128), f, 256, 4096, 4096)  # 4096 tiles
    dev = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0))
    for fmt in FORMATS:
        cands = gemm_candidates(KernelFormat.parse(fmt), 256, 4096, 4096, dev)
        assert cands and all(c.path == "gemm" and c.block_m <= 256 for c in cands)
        assert any(c.split_k > 1 for c in cands)  # 4096 rows of 256 tokens: too few tiles of 128 x 128


def test_batched_input_and_super_weights():
    gen = torch.Generator().manual_seed(30)
    n, k = 20, 128
    rows, cols = torch.tensor([3, 3, 17]), torch.tensor([5, 100, 0])
    vals = torch.tensor([40.0, -25.0, 60.0])
    pw = packed_weight("INT4_G64", n, k, gen, super_weights=(rows, cols, vals))
    w = dequantize_packed_ref(pw).cpu()
    assert torch.equal(w[rows, cols], vals)
    x = torch.randn(2, 3, k, generator=gen).to(DEVICE, torch.float16)
    y = linear(x, pw)
    assert y.shape == (2, 3, n)
    assert rel_err(y, (x.float() @ w.to(DEVICE).t())) < tolerance(torch.float16)
    wd = dequantize(pw, torch.float32)
    assert torch.allclose(wd, w.to(wd.device), rtol=0, atol=1e-6)


def test_fallback_and_errors():
    gen = torch.Generator().manual_seed(40)
    pw = packed_weight("INT2_G64", 16, 128, gen)
    x = torch.randn(3, 128, generator=gen).to(DEVICE)
    assert not uses_triton(x)  # float32 takes the torch path
    assert torch.allclose(linear(x, pw), x @ dequantize_packed_ref(pw).to(DEVICE).t(), atol=1e-5)
    with pytest.raises(ValueError):
        linear(x[:, :64], pw)
    with pytest.raises(ValueError):
        linear(x.half(), pw, config=LaunchConfig("gemv", 1, 16, 1, 3))  # split does not divide the groups
    assert linear(x[:0].half(), pw).shape == (0, 16)


def test_import_does_not_load_triton(tmp_path):
    code = "import sys, dynaquant, dynaquant.kernels; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_choose_config_llama_shapes():
    dev = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0))
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1024, 4096)]
    for fmt in FORMATS:
        f = KernelFormat.parse(fmt)
        for n, k in shapes:
            for m in (1, 4, 16, 64, 256):
                cfg = choose_config(f, m, n, k, dev)
                assert valid_config(cfg, f, m, n, k), (fmt, m, n, k, cfg)
    assert choose_config(KernelFormat.parse("INT4_G128"), 1, 4096, 4096, dev).path == "gemv"


def test_mxfp4_m256_large_shapes_take_the_fused_gemm():
    """MXFP4 at M = 65..256 (H100, 2026-12-07): gate+up, down and lm_head on the fused GEMM's 128 x 128 x 32 tiles
    (0.47x -> 0.56x bf16 a step), q/k/v and o on dequantize + cuBLAS, which were faster there; above 256 tokens the
    dequantized path as before (unmeasured)."""
    dev = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0))
    f = KernelFormat.parse("MXFP4_G32")
    for n, k in [(28672, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]:
        cfg = choose_config(f, 256, n, k, dev)
        assert (cfg.path, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == \
            ("gemm", 128, 128, 32, 8, 4), (n, k, cfg)
        assert valid_config(cfg, f, 256, n, k) and cfg.split_k >= 1
        assert choose_config(f, 512, n, k, dev).path == "dequant"
    for n, k in [(6144, 4096), (4096, 4096)]:
        assert choose_config(f, 256, n, k, dev).path == "dequant"
    assert choose_config(f, 256, 28672, 4096, DeviceInfo("NVIDIA A100", 108, (8, 0))).path != "gemm"


# ----------------------------------------------------------------------------------------------
# full size, on a GPU


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_full_size(fmt):
    gen = torch.Generator().manual_seed(50)
    for n, k in [(6144, 4096), (4096, 14336), (1000, 4096)]:
        pw = packed_weight(fmt, n, k, gen)
        w = dequantize_packed_ref(pw)
        for m in (1, 4, 16, 64, 256):
            x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
            y = linear(x, pw)
            ref = x.float() @ w.t()
            assert rel_err(y, ref) < 5e-3, (fmt, n, k, m)
        assert torch.allclose(dequantize(pw, torch.float32), w, rtol=1e-6, atol=0)  # NVFP4: s * (1 / gs) vs s / gs


def test_pdl_is_off_off_hopper(monkeypatch):
    """Programmatic dependent launch (``triton_linear.PDL``) is never asked of Triton's interpreter or a CPU tensor:
    the GEMV there is the usual one whatever the flag."""
    from dynaquant.kernels import triton_linear

    monkeypatch.setattr(triton_linear, "PDL", True)
    x = torch.randn(1, 256)
    assert triton_linear._pdl(x) == {}
    if INTERPRETED:
        f = "INT4_G128"
        gen = torch.Generator().manual_seed(26)
        pw = packed_weight(f, 16, 256, gen)
        xd = x.to(DEVICE, torch.float16)
        assert rel_err(linear(xd, pw, config=LaunchConfig("gemv", 1, 16, 1, 1, 4, 1, True)), fp32_ref(xd, pw)) < \
            tolerance(torch.float16)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["INT4_G128", "INT2_G128", "MXFP4_G32", "INT4_G128_ASYM"])
@pytest.mark.parametrize("split", [1, 2])
def test_cuda_gemv_pdl_changes_nothing(fmt, split, monkeypatch):
    """The GEMV launched with programmatic dependent launch gives, bit for bit, what the usual launch gives: eager and
    as a CUDA graph of consecutive calls (each call's first weight tile loaded before the previous call ends), the
    split-K counters reset after every call."""
    from dynaquant.kernels import triton_linear

    if torch.cuda.get_device_capability()[0] < 9 or not triton_linear.HAS_GDC:
        pytest.skip("programmatic dependent launch needs Hopper and Triton 3.4+")
    gen = torch.Generator().manual_seed(27)
    n, k = 4096, 4096
    pws = [packed_weight(fmt, n, k, gen) for _ in range(3)]
    cfg = LaunchConfig("gemv", 1, 16, 1, split, 4, 1, True)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)

    def chain(x):  # each call's input is the previous call's output, directly (the dependency the wait honours)
        for pw in pws:
            x = linear(x, pw, config=cfg)
        return x

    base = chain(x)
    monkeypatch.setattr(triton_linear, "PDL", True)
    assert triton_linear._pdl(x) == {"PDL": True, "launch_pdl": True}
    assert torch.equal(chain(x), base)
    chain(x)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    xs = x.clone()
    with torch.cuda.graph(g):
        ys = chain(xs)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(ys, base)
    assert all(int(pw.counters.abs().sum()) == 0 for pw in pws)
