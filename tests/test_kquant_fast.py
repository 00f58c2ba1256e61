"""The fast K-quant searches (``kquant_fast``, ``thorough=False``) against the thorough ones (the default).

The exact error profile behind Q3_K's search equals the brute-force error of nearest codes;
on random blocks, the fast search's weighted error stays close to the thorough search's
(``fit_params(thorough=True)``), and both encodings decode as gguf-py decodes them.
(The comparison with llama.cpp's encoders is in ``test_codecs_kquants.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from dynaquant.quant.codecs import get_codec, kquant_fast

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# fast error / thorough error on the blocks below, at most (measured: 0.93 .. 1.06)
SLACK = {"Q2_K": 1.15, "Q3_K": 1.05, "Q4_K": 1.08, "Q5_K": 1.08, "Q6_K": 1.10}


def _blocks(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 256) heavy-tailed weights with a lognormal scale per block, and lognormal importance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 256, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    x = torch.where(torch.rand(n, 256, generator=g) < 0.005, x * 8, x)
    x[0, 32:64] = 0  # a zero sub-block (two of 16)
    w = torch.exp(torch.randn(n, 256, generator=g))
    return x, w


def test_profile_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, 16, generator=g)
    x[0, 0] = 0
    w = torch.rand(5, 16, 16, generator=g) + 0.1
    t, sxq, sqq = kquant_fast._profile(x, w, -4, 3)
    s = torch.randn(5, 16, 7, generator=g) * 0.6
    e = kquant_fast._profile_error((t, sxq.flatten(-2), sqq.flatten(-2)), s)
    q = (x.unsqueeze(-2) / s.unsqueeze(-1)).round().clamp(-4, 3)
    ref = (w.unsqueeze(-2) * (x.unsqueeze(-2) - s.unsqueeze(-1) * q) ** 2).sum(-1) - (w * x * x).sum(-1, keepdim=True)
    assert torch.allclose(e, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(SLACK))
def test_fast_close_to_thorough(name):
    codec = get_codec(name)
    x, w = _blocks(48, seed=len(name) * 7 + int(name[1]))
    errs = {}
    for thorough in (False, True):
        data = codec.encode_blocks(x, w, thorough=thorough)
        dec = codec.decode_blocks(data)
        assert np.array_equal(dec.numpy(), gguf_dequantize(data.numpy(), GGMLQuantizationType[name]).reshape(48, 256))
        assert (dec[0, 32:64] == 0).all()
        errs[thorough] = float((w * (x - dec) ** 2).sum())
    assert errs[False] <= SLACK[name] * errs[True], errs
