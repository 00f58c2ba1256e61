"""The resident-activation GEMV (``LaunchConfig.resident``, :mod:`dynaquant.kernels.triton_resident`).

Without a GPU the kernel runs in Triton's interpreter on small shapes (odd N, several K slices, persistent programs
over many row tiles); there its outputs must equal the half2 GEMV's bit for bit where the math is the same (same rows
a tile, K tile = the resident K slice, same runs of words: the same word products and float32 sums in the same order).
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, HAS_CUDA  # (imported before Triton: the interpreter without a GPU)

pytest.importorskip("triton")

from test_kernels import fp32_ref, packed_weight, rel_err, tolerance  # noqa: E402

from dynaquant.kernels import DeviceInfo, KernelFormat, LaunchConfig, gemv_candidates, linear, valid_config  # noqa: E402
from dynaquant.kernels.tuning import (  # noqa: E402
    device_info,
    resident_candidates,
    resident_gemv_config,
    resident_grid,
)

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0))
LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def resident(groups: int, split: int, block_n: int = 16, per_sm: int = 1, prefetch: bool = True,
             runs: int = 4, warps: int = 4) -> LaunchConfig:
    return LaunchConfig("gemv", 1, block_n, groups, split, warps, 1, prefetch, 0, True, runs, False, per_sm)


def half2_twin(cfg: LaunchConfig) -> LaunchConfig:
    """The half2 GEMV whose K tile is the resident config's K slice (same rows a tile, runs, split)."""
    return LaunchConfig("gemv", 1, cfg.block_n, cfg.groups, cfg.split_k, cfg.num_warps, 1, False, 0, True,
                        cfg.scale_words)


def check_against_half2(x, pw, bias, cfg, dtype):
    y = linear(x, pw, bias, config=cfg)
    assert y.shape == (1, pw.out_features) and y.dtype == dtype
    assert rel_err(y, fp32_ref(x, pw, bias)) < tolerance(dtype)
    y0 = linear(x, pw, bias, config=half2_twin(cfg))
    if HAS_CUDA:  # natively the two kernels' register layouts (so their float32 sums' order) may differ
        assert rel_err(y, y0) < 1e-3
    else:
        assert torch.equal(y, y0), (cfg, (y.float() - y0.float()).abs().max())


@pytest.mark.parametrize("fmt", ["INT4_G128", "INT2_G128", "MXFP4_G32", "NVFP4_G16", "INT4_G32", "INT2_G64"])
@pytest.mark.parametrize("slices,block_n,per_sm,prefetch,runs", [(1, 16, 1, True, 4), (2, 32, 1, False, 1),
                                                                  (4, 16, 2, True, 4), (8, 16, 1, True, 2)])
def test_resident_matches_half2(fmt, slices, block_n, per_sm, prefetch, runs):
    """Odd N (a partial last row tile), 1 to 8 K slices (the split), programs persistent over 1-3 row tiles (some
    past the last tile), prefetch on and off, a scale a word or a run; bf16, then fp16 with bias (the split-K
    counters reset between), activations up to 3000."""
    f = KernelFormat.parse(fmt)
    gen = torch.Generator().manual_seed(31)
    n, k = 41, 8 * f.group_size
    pw = packed_weight(fmt, n, k, gen)
    cfg = resident(8 // slices, slices, block_n, per_sm, prefetch, runs)
    assert valid_config(cfg, f, 1, n, k)
    tiles, progs, per = resident_grid(n, cfg, device_info(DEVICE).sm_count)
    assert progs * per >= tiles and progs <= tiles
    for dtype in (torch.bfloat16, torch.float16):  # (the second call also checks the counters were reset)
        x = torch.randn(1, k, generator=gen)
        x[0, 5] = 3000.0  # a massive activation
        x = x.to(DEVICE, dtype)
        b = torch.randn(n, generator=gen).to(DEVICE, dtype) if dtype == torch.float16 else None
        check_against_half2(x, pw, b, cfg, dtype)
    assert int(pw.counters.abs().sum()) == 0


@pytest.mark.parametrize("split", [1, 2])
def test_resident_many_tiles(split):
    """A program over more row tiles than one reduction step takes (RB = 8): 40 tiles of 16 rows (the last partial),
    10 or 20 a program in the interpreter (4 programs in all)."""
    fmt = "INT4_G128"
    f = KernelFormat.parse(fmt)
    gen = torch.Generator().manual_seed(32)
    n, k = 39 * 16 + 5, 2 * f.group_size
    pw = packed_weight(fmt, n, k, gen)
    cfg = resident(2 // split, split, 16, 1)
    sm = device_info(DEVICE).sm_count
    tiles, progs, per = resident_grid(n, cfg, sm)
    assert tiles == 40
    if not HAS_CUDA:
        assert per > 8  # (interpreter: 4 "SMs")
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    for _ in range(2):
        check_against_half2(x, pw, None, cfg, torch.bfloat16)
    assert int(pw.counters.abs().sum()) == 0


def test_resident_grid():
    """One wave: at most ``resident`` programs an SM (P x split), every tile owned, programs' tile counts differing by
    at most one, a split-K counter for every column (P <= ceil(N / 16))."""
    for n in (1, 15, 16, 17, 1000, 4096, 6144, 28672, 128256):
        for block_n in (16, 32):
            for split in (1, 2, 4, 14):
                for per_sm in (1, 2, 4, 8):
                    cfg = resident(1, split, block_n, per_sm)
                    tiles, p, per = resident_grid(n, cfg, 132)
                    assert tiles == -(-n // block_n) and 1 <= p <= tiles and p <= -(-n // 16)
                    assert p * split <= max(split, per_sm * 132)
                    counts = [len(range(q, tiles, p)) for q in range(p)]
                    assert sum(counts) == tiles and max(counts) == per and max(counts) - min(counts) <= 1


def test_resident_config_checks():
    """Resident configs: M = 1, the half2 formats, the K split in slices of one K tile (a power of two words),
    row tiles of 16+ rows (a power of two); the defaults and candidates fit Llama-3-8B's shapes."""
    f = KernelFormat.parse("INT4_G128")
    n, k = 4096, 4096  # 32 groups
    assert valid_config(resident(8, 4), f, 1, n, k)
    assert not valid_config(resident(8, 2), f, 1, n, k)  # 2 K tiles a slice
    assert not valid_config(resident(8, 4), f, 2, n, k)  # M = 2
    assert not valid_config(LaunchConfig("gemv", 1, 16, 8, 4, resident=4), f, 1, n, k)  # no half2
    assert not valid_config(resident(8, 4, block_n=8), f, 1, n, k)
    assert not valid_config(resident(8, 4, block_n=48), f, 1, n, k)
    assert not valid_config(LaunchConfig("gemv", 1, 16, 8, 4, 4, 1, True, 0, True, 4, True, 4), f, 1, n, k)  # pairs
    assert not valid_config(resident(3, 1), f, 1, n, 3 * 128)  # 48 words
    for fmt in ("INT4_G128_ASYM", "INT8_G128", "INT3_G128"):
        g = KernelFormat.parse(fmt)
        assert resident_gemv_config(g, n, k, H100) is None and not resident_candidates(g, n, k, H100)
        assert not valid_config(resident(1, 32), g, 1, n, k)
    for fmt in ("INT4_G128", "INT2_G128", "MXFP4_G32", "NVFP4_G16"):
        g = KernelFormat.parse(fmt)
        for n, k in LLAMA:
            cfg = resident_gemv_config(g, n, k, H100)
            assert cfg is not None and cfg.resident and valid_config(cfg, g, 1, n, k), (fmt, n, k)
            cands = [c for c in gemv_candidates(g, n, k, H100) if c.resident]
            assert len(cands) >= 8 and all(valid_config(c, g, 1, n, k) for c in cands), (fmt, n, k)
