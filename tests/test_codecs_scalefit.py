"""The batched one-scale searches of ``_blockfit`` (legacy types, IQ4_NL, MXFP4, NVFP4, runtime INT):
on synthetic weights with an imatrix, each encoder's weighted error is at most llama.cpp's
(where libggml is available) and below plain max-based rounding's (runtime INT formats)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_ref import error_ratios

from dynaquant.quant.codecs import dequantize, quantize, weighted_error

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _weights(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(0.5 * torch.randn(rows, 1, generator=g)) * 0.02
    x = torch.where(torch.rand(rows, k, generator=g) < 0.003, x * 12, x)
    return x, torch.exp(torch.randn(k, generator=g))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "IQ4_NL", "MXFP4", "NVFP4"])
def test_error_at_most_llama_cpp(name):
    pytest.importorskip("llama_cpp")
    ratios = error_ratios([_weights(16, 2048, seed=1), _weights(8, 4096, seed=2)], name)
    assert np.all(ratios <= 1.0), ratios


@pytest.mark.parametrize("name", ["INT4_G128", "INT8_G32", "INT3_G64_ASYM", "INT4_G128_ASYM"])
def test_runtime_int_beats_max_rounding(name):
    x, imatrix = _weights(8, 1024, seed=3)
    ours = weighted_error(x, dequantize(quantize(x, name, imatrix), name), imatrix)
    bits, g = int(name[3]), int(name.split("_G")[1].split("_")[0])
    xb = x.reshape(-1, g)
    if name.endswith("ASYM"):
        lo, hi = xb.min(1, keepdim=True).values.clamp(max=0), xb.max(1, keepdim=True).values.clamp(min=0)
        d = ((hi - lo) / (2**bits - 1)).half().float()
        z = torch.round(-lo / d)
        ref = (torch.round(xb / d + z).clamp(0, 2**bits - 1) - z) * d
    else:
        d = (xb.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)).half().float()
        ref = torch.round(xb / d).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * d
    assert ours < 0.97 * weighted_error(x, ref.reshape(x.shape), imatrix)
