"""dynaquant.kernels.gluon_gemm: the Hopper dequant-GEMM in Gluon.

Without a GPU the kernel cannot run (Gluon has no interpreter): it is compiled for sm_90 here and its machine code
checked for what the kernel exists for (the tensor cores' ``wgmma``s left in flight while the next tile decodes,
no spills, the shared memory its configuration check allows). On a Hopper GPU the ``cuda`` test runs it against the
float32 reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_kernels import fp32_ref, packed_weight, rel_err, tolerance
from triton_mode import DEVICE, HAS_CUDA  # (imported before Triton: the interpreter without a GPU)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from dynaquant.kernels import (  # noqa: E402
    DeviceInfo,
    KernelFormat,
    LaunchConfig,
    choose_config,
    gluon_gemm,  # noqa: E402
    linear,
    valid_config,
)
from dynaquant.kernels.tuning import GLUON_SMEM, gemm_candidates, gluon_candidates  # noqa: E402

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0))
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def gemm(bm, bn, bk, warps, stages, split=1, ahead2=False):
    return LaunchConfig("gemm", bm, bn, 1, split, warps, stages, ahead2, bk, gluon=True)


CASES = [  # format, (token tile, weight rows, K tile, warps, stages, K split, words 2 tiles ahead), activations, bias
    ("INT4_G128", (256, 128, 64, 8, 4, 1, 1), "bfloat16", False),
    ("INT2_G128", (256, 128, 64, 8, 4, 1, 0), "bfloat16", False),
    ("MXFP4_G32", (128, 128, 128, 8, 3, 2, 1), "bfloat16", True),
    ("NVFP4_G16", (128, 256, 64, 8, 4, 1, 0), "bfloat16", False),
    ("INT3_G128", (128, 128, 64, 8, 3, 1, 1), "float16", False),
    ("INT4_G64_ASYM", (64, 64, 128, 4, 4, 4, 1), "float16", True),
]

# Run in a child without TRITON_INTERPRET (the interpreter's jit functions cannot be compiled into a Gluon kernel):
# compiles every case for sm_90 and reports what the test checks, as JSON.
_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import torch
from dynaquant.kernels import KernelFormat, LaunchConfig
from dynaquant.kernels import gluon_gemm

cuobjdump, benchmarks = sys.argv[1], sys.argv[3]
sys.path.insert(0, benchmarks)
from kernel_speed import dummy_packed
out = []
for fmt, tile, dtype, bias in json.loads(sys.argv[2]):
    f = KernelFormat.parse(fmt)
    bm, bn, bk, warps, stages, split, ahead = tile
    cfg = LaunchConfig("gemm", bm, bn, 1, split, warps, stages, bool(ahead), bk, gluon=True)
    dt = getattr(torch, dtype)
    pw = dummy_packed(fmt, 14336, 4096, device="cpu")
    kernel = gluon_gemm.compile_sm90(pw, 256, cfg, dt, bias)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(kernel.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", fh.name], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([cuobjdump, "-res-usage", fh.name], capture_output=True, text=True, check=True).stdout
    os.unlink(fh.name)
    mma = gluon_gemm.layouts(cfg, f.bits, dt)["MMA_LAYOUT"]
    (wm, wn), instr_n = mma.warps_per_cta, mma.instr_shape[1]
    out.append({"hgmma": len(re.findall(r"HGMMA\.", sass)), "waits": re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass),
                "per_tile": bm // (16 * wm) * (bn // (instr_n * wn)) * (bk // 16),
                "stack0": bool(re.search(r"STACK:0\b", res)), "shared": kernel.metadata.shared})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sm90_reports():
    if not os.path.exists(CUOBJDUMP):
        pytest.skip("Triton without its CUDA tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    run = subprocess.run([sys.executable, "-c", _COMPILE, CUOBJDUMP, json.dumps(CASES), benchmarks], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in CASES])
def test_compiles_for_sm90_pipelined(case, sm90_reports):
    """The sm_90 machine code: one K tile's ``wgmma``s issued once in the loop and waited for down to one in flight
    (``WARPGROUP.DEPBAR.LE gsb0, 0x1``), all of them once after it; ptxas serializes them instead (a ``0x0`` wait
    after every one) where the pipeline is ill formed, as a zero-trip path through the loop made it. No stack
    (spills), and at most the shared memory the configuration check allows (valid here)."""
    fmt, (bm, bn, bk, warps, stages, split, _), _, _ = CASES[case]
    assert valid_config(gemm(bm, bn, bk, warps, stages, split), KernelFormat.parse(fmt), 256, 14336, 4096)
    r = sm90_reports[case]
    assert r["hgmma"] == r["per_tile"], r
    assert sorted(r["waits"]) == ["0", "1"], r
    assert r["stack0"], r
    assert r["shared"] <= GLUON_SMEM, r


def test_gluon_config_checks():
    """What the configuration check lets through, the candidates (Hopper only, valid, never a default), and the
    errors of a call that cannot run."""
    f = KernelFormat.parse("INT4_G128")
    assert valid_config(gemm(256, 128, 64, 8, 4), f, 256, 28672, 4096)
    assert valid_config(gemm(64, 128, 128, 4, 3, 4), f, 16, 4096, 4096)  # 16 tokens in a 64-token tile
    assert not valid_config(gemm(32, 128, 64, 4, 3), f, 16, 4096, 4096)  # wgmma's M is 64
    assert not valid_config(gemm(128, 128, 64, 2, 3), f, 256, 4096, 4096)  # a warp group is 4 warps
    assert not valid_config(gemm(128, 128, 64, 8, 2), f, 256, 4096, 4096)  # activation tiles stages - 2 ahead
    assert not valid_config(gemm(256, 128, 128, 8, 3), f, 256, 4096, 4096)  # 288 KiB of shared memory
    assert not valid_config(LaunchConfig("gemm", 128, 128, 1, 1, 8, 3, False, 64, xa=True, gluon=True), f, 256, 4096,
                            4096)
    assert not valid_config(LaunchConfig("mm", 64, 64, 1, 1, 4, 3, gluon=True), f, 64, 4096, 4096)
    for fmt in ("INT4_G128", "INT2_G128", "MXFP4_G32"):
        fm = KernelFormat.parse(fmt)
        for m, n, k in ((16, 4096, 4096), (256, 28672, 4096), (256, 4096, 14336)):
            cands = gluon_candidates(fm, m, n, k, H100)
            assert cands and all(c.gluon and valid_config(c, fm, m, n, k) for c in cands)
            assert set(cands) <= set(gemm_candidates(fm, m, n, k, H100))
            assert not gluon_candidates(fm, m, n, k, DeviceInfo("NVIDIA A100", 108, (8, 0)))
            assert not choose_config(fm, m, n, k, H100).gluon
    with pytest.raises(ValueError, match="whole warp groups"):
        gluon_gemm.layouts(gemm(32, 64, 64, 4, 3), 4, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        gluon_gemm.x_layout(gemm(64, 64, 64, 4, 3), torch.float32)
    if DEVICE == "cpu":
        gen = torch.Generator().manual_seed(3)
        pw = packed_weight("INT4_G128", 64, 256, gen)
        x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
        with pytest.raises(ValueError, match="compute capability 9"):
            linear(x, pw, config=gemm(64, 64, 64, 4, 3))


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")
@pytest.mark.parametrize("fmt", ["INT4_G128", "INT2_G128", "MXFP4_G32", "NVFP4_G16", "INT3_G128", "INT4_G64_ASYM",
                                 "INT8_G128_ASYM"])
@pytest.mark.parametrize("cfg", [gemm(256, 128, 64, 8, 4), gemm(128, 128, 128, 8, 3, 2, True),
                                 gemm(64, 128, 64, 4, 4, 4, True), gemm(128, 256, 64, 8, 4)])
def test_cuda_gluon_gemm(fmt, cfg):
    """Against the float32 reference on a Hopper GPU: partial token and row tiles (19 and 300 tokens, 1000 rows),
    a full one, bias, K splits (counters reset after each call), bf16 and fp16, and a CUDA graph replay."""
    gen = torch.Generator().manual_seed(61)
    k = 2048
    for n, m, dtype, bias in ((1000, 19, torch.bfloat16, True), (1024, 300, torch.float16, False),
                              (4096, 256, torch.bfloat16, False)):
        pw = packed_weight(fmt, n, k, gen)
        if not valid_config(cfg, pw.fmt, m, n, k):
            continue
        b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
        for _ in range(2):
            x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
            assert rel_err(linear(x, pw, b, config=cfg), fp32_ref(x, pw, b)) < tolerance(dtype), (n, m, dtype)
        assert int(pw.counters.abs().sum()) == 0
    x = torch.randn(256, k, generator=gen).to(DEVICE, torch.bfloat16)
    y0 = linear(x, pw, config=cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, pw, config=cfg)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, fp32_ref(x, pw)) < tolerance(torch.bfloat16)
    assert rel_err(y, y0) < 1e-6 or cfg.split_k > 1
