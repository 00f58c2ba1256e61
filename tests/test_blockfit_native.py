"""The compiled CPU one-scale block search (:mod:`dynaquant.kernels.native.blockfit`, C) against its torch reference
:func:`dynaquant.quant.codecs._blockfit.fit_scale_torch` (Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS's sub-blocks).

The C code repeats the reference's float32 operations in its order except the sums over a block's elements (added
in element order), and rounds scales to float16 with its own round-to-nearest-even: where the sums are exact the
bytes are the reference's bit for bit, including scales in float16's subnormal range; elsewhere they agree to
rounding.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import dynaquant.kernels  # noqa: F401  (registers the CPU fast paths)
from dynaquant.quant.codecs import _blockfit, fastpaths, get_codec

if shutil.which(os.environ.get("CC") or "cc") is None:
    pytest.skip("no C compiler: the compiled CPU searches cannot be built here", allow_module_level=True)

from dynaquant.kernels.native import blockfit as nb  # noqa: E402

TYPES = ["Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS"]


def _rows(name: str) -> int:
    return 256 if name == "IQ4_XS" else 32


def _exact_blocks(n: int, seed: int):
    """(n, 256) weights k/8 (distinct |k| in every 32, random signs) times a power of two a row (2^-20: scales in
    float16's subnormal range; 2^10: large), importance 1 or 2: every float32 sum exact in any order, no ties in
    ``w x^2`` or ``|x|``."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.stack([torch.randperm(64, generator=g)[:32] + 1 for _ in range(n * 8)]).reshape(n, 256).float()
    sign = torch.randint(0, 2, (n, 256), generator=g).float() * 2 - 1
    x = mags * sign / 8
    x[0] *= 2.0**-20
    x[1] *= 2.0**10
    x[2] = x[2].abs()
    return x, torch.randint(1, 3, (n, 256), generator=g).float()


def test_registered_as_the_cpu_fast_path():
    assert fastpaths.lookup("blockfit.fit_scale", "cpu") is nb.fit_scale
    assert _blockfit.fast_path("blockfit.fit_scale", torch.zeros(1)) is nb.fit_scale


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_sums_give_the_reference_bit_for_bit(name, seed):
    codec, m = get_codec(name), _rows(name)
    x, w = (t.reshape(-1, m) for t in _exact_blocks(24, seed))
    native = codec.encode_blocks(x, w, backend="native")
    assert torch.equal(native, codec.encode_blocks(x, w, backend="torch"))
    assert torch.equal(native, codec.encode_blocks(x, w))  # "auto" on CPU is the compiled search


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "IQ4_NL"])
def test_search_matches_the_reference(name):
    """Random weights: the same scales and codes as the reference on most blocks (Q8_0's 255 levels meet near-ties
    most often: 2 % of its blocks differ), and the same weighted error to 1e-4 (a near-tie in a sum taken the other
    way)."""
    codec = get_codec(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 32, generator=g) * torch.exp(torch.randn(4096, 1, generator=g))
    w = torch.exp(torch.randn(4096, 32, generator=g)) + 0.01
    x[0] = 0.0
    x[1, 5] = 1e3
    args = (codec.grid, codec.targets, codec.anchor_offsets, codec.lloyd_steps, codec.ulps)
    d_n, c_n = nb.fit_scale(x, w, *args)
    d_t, c_t = _blockfit.fit_scale_torch(x, w, *args)
    assert d_n.dtype == d_t.dtype == torch.float16 and c_n.dtype == c_t.dtype == torch.int64 and c_n.shape == c_t.shape
    same = (d_n == d_t) & (c_n == c_t).all(1)
    assert same.float().mean() >= 0.95, same.float().mean()
    lv = codec.grid.level_tensor("cpu")

    def err(d, c):
        return (w * (x - d.float()[:, None] * lv[c]) ** 2).sum()

    assert abs(err(d_n, c_n) - err(d_t, c_t)) <= 1e-4 * err(d_t, c_t)
    assert d_n[0] == 0 and (c_n[0] == codec.grid.zero_code()).all()  # the all-zero block


def test_what_it_does_not_cover_runs_the_reference():
    """ulps, and a grid rounded by bucketize: the torch reference's result, exactly."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(64, 32, generator=g), torch.rand(64, 32, generator=g) + 0.1
    odd = _blockfit.Grid([-3.0, -1.2, 0.0, 0.7, 2.9])
    for grid, ulps in ((get_codec("Q4_0").grid, (-1, 1)), (odd, ())):
        got = nb.fit_scale(x, w, grid, [2.9, -3.0], (), 1, ulps)
        want = _blockfit.fit_scale_torch(x, w, grid, [2.9, -3.0], (), 1, ulps)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("name", ["MXFP4", "NVFP4", "MXFP4_G32"])
def test_pow2_scale_search_matches_the_reference(name):
    """The power-of-two scale search (fit_pow2): the reference's bytes bit for bit where the sums are exact, and on
    random weights on nearly every block with the same weighted error to 1e-4 (all-zero blocks and sub-blocks
    included)."""
    codec = get_codec(name)
    m = 64 if name == "NVFP4" else 32
    x, w = (t.reshape(-1, m) for t in _exact_blocks(16, 5))
    assert torch.equal(codec.encode_blocks(x, w, backend="native"), codec.encode_blocks(x, w, backend="torch"))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2048, m, generator=g) * torch.exp(torch.randn(2048, 1, generator=g))
    w = torch.exp(torch.randn(2048, m, generator=g)) + 0.01
    x[0] = 0.0
    x[1, :16] = 0.0
    b_n, b_t = codec.encode_blocks(x, w), codec.encode_blocks(x, w, backend="torch")
    assert (b_n == b_t).all(1).float().mean() >= 0.95
    e_n = (w * (x - codec.decode_blocks(b_n)) ** 2).sum()
    e_t = (w * (x - codec.decode_blocks(b_t)) ** 2).sum()
    assert abs(e_n - e_t) <= 1e-4 * e_t
    params = codec.fit_params(x, w)  # the two-step path (fit, then round) writes the same bytes
    assert torch.equal(codec.pack(params, codec.round_to_grid(x, params)[0]), b_n)
