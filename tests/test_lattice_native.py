"""The compiled CPU lattice searches (:mod:`dynaquant.kernels.native.lattice`, C) against their torch references:
``lattice.nearest_codewords``, ``lattice.candidate_terms``, ``lattice.subset_min_costs`` of
:mod:`dynaquant.quant.codecs._lattice` (IQ2_XXS, IQ2_XS, IQ2_S), ``iq3.nearest_variants`` of
:mod:`dynaquant.quant.codecs.iq3` (IQ3_XXS, IQ3_S) and ``iq1.ternary_nearest`` (IQ1_S, IQ1_M: the same operations
as :func:`dynaquant.quant.codecs.iq1.nearest_points`, so the same indices bit for bit on any weights).

The C code forms each codeword's ``B``, ``C`` (and the flip's ``M``) with sums over a group's elements in element
order and costs with subset_min_costs's float operations (one fused multiply-add, as torch's addcmul_); the
references form the whole-codebook costs by a matmul and IQ3's off-grid points by a whole-grid matmul (or, on the
CPU path of ``backend="torch"``, a batched product over the same exact candidate lists). So:

* on weights, importances and scales whose products and sums are exact in float32 (multiples of 1/8, importance 1
  or 2, power-of-two scales), every primitive's result equals the reference's bit for bit, and so do the encoded
  bytes of every covered type (the encoders' own scales then round the same way on both sides);
* on random weights the primitives agree to rounding (most indices equal, a differing one a near-tie) and the
  encoders' weighted errors are the reference's to 1e-4.
"""

from __future__ import annotations

import logging
import os
import shutil

import gguf.quants
import numpy as np
import pytest
import torch

import dynaquant.kernels  # noqa: F401  (registers the CPU fast paths)
from dynaquant.quant.codecs import _lattice as lat
from dynaquant.quant.codecs import fastpaths, get_codec, iq1, iq3

if shutil.which(os.environ.get("CC") or "cc") is None:
    pytest.skip("no C compiler: the compiled CPU searches cannot be built here", allow_module_level=True)

from native_cases import assert_threads_keep_bytes  # noqa: E402

from dynaquant.kernels.native import lattice as nl  # noqa: E402

IQ2 = ["IQ2_XXS", "IQ2_XS", "IQ2_S"]
IQ3 = ["IQ3_XXS", "IQ3_S"]
IQ1 = ["IQ1_S", "IQ1_M"]
# (grid, parity flip): the IQ2 grids (D = 8; IQ2_XXS/IQ2_XS flip a sign for parity), and IQ3_XXS's (D = 4)
GRIDS = [("IQ2_XXS", True), ("IQ2_XS", True), ("IQ2_S", False), ("IQ3_XXS", False)]
NAMES = ["lattice.nearest_codewords", "lattice.candidate_terms", "lattice.subset_min_costs", "iq3.nearest_variants",
         "iq1.ternary_nearest"]


def _exact_groups(n: int, d: int, seed: int):
    """(n, d) weights k/8 (k in 1..63) and importance 1 or 2, a zero group and a group without importance: every
    product with a grid value, and every sum of d of them, exact in float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 64, (n, d), generator=g).float() / 8
    w = torch.randint(1, 3, (n, d), generator=g).float()
    x[1] = 0.0
    w[2] = 0.0
    return x, w, torch.rand(n, generator=g) < 0.5


def _random_groups(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).abs()
    w = torch.exp(torch.randn(n, d, generator=g))
    return x, w, torch.rand(n, generator=g) < 0.5


def _exact_blocks(n: int, seed: int):
    """(n, 256) weights k/8 with distinct |k| in every 16 and random signs, importance 1 or 2 (sums of products
    exact in any order, no ties in ``w x^2``); one block of one sign, one of mixed magnitudes."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.stack([torch.randperm(64, generator=g)[:16] + 1 for _ in range(n * 16)]).reshape(n, 256).float()
    sign = torch.randint(0, 2, (n, 256), generator=g).float() * 2 - 1
    x = mags * sign / 8
    x[1] = x[1].abs()
    x[2, 100:] *= 0.125
    return x, torch.randint(1, 3, (n, 256), generator=g).float()


def _random_blocks(n: int, seed: int):
    """(n, 256) Gaussian weights with lognormal row scales and a few outliers, lognormal importance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 256, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[:, ::97] *= 6.0
    return x, torch.exp(torch.randn(n, 256, generator=g))


def test_registered_as_the_cpu_fast_paths():
    for name in NAMES:
        impl = getattr(nl, name.split(".")[1])
        assert fastpaths.lookup(name, "cpu") is impl
        assert fastpaths.fast_path(name, torch.zeros(1), "auto") is impl
        assert fastpaths.fast_path(name, torch.zeros(1), "native") is impl
        assert fastpaths.fast_path(name, torch.zeros(1), "torch") is None
    assert lat.fused(torch.zeros(1))


# ------------------------------------------------------------------------------------------------ primitives


@pytest.mark.parametrize("name,parity", GRIDS)
@pytest.mark.parametrize("n_scales", [1, 5, 11])  # 11: two passes over the codebook (8 scales a pass)
def test_nearest_codewords_exact(name, parity, n_scales):
    """Exact products and sums (power-of-two scales): costs and indices bit for bit, 37 groups (a partial lane
    group), zero scales included."""
    grid = lat.gguf_grid(name)
    x, w, odd = _exact_groups(37, grid.shape[1], n_scales)
    g = torch.Generator().manual_seed(100 + n_scales)
    scale = 2.0 ** torch.randint(-7, -1, (n_scales, 37), generator=g).float()
    scale[0, 3] = 0.0
    odd = odd if parity else None
    cost, idx = nl.nearest_codewords(x, w, grid, scale, odd)
    ref_cost, ref_idx = lat.nearest_codewords_torch(x, w, grid, scale, odd)
    assert cost.dtype == torch.float32 and idx.dtype == torch.int64 and cost.shape == (n_scales, 37)
    assert torch.equal(cost, ref_cost) and torch.equal(idx, ref_idx)
    c3, i3 = nl.nearest_codewords(x, w, grid, scale.reshape(1, n_scales, 37), odd)  # leading axes kept
    assert c3.shape == (1, n_scales, 37) and torch.equal(i3[0], idx)


@pytest.mark.parametrize("name,parity", GRIDS)
def test_nearest_codewords_random(name, parity):
    """Random groups: costs to float32 rounding, indices equal but for near-ties (whose reference cost is the
    minimum to rounding)."""
    grid = lat.gguf_grid(name)
    x, w, odd = _random_groups(500, grid.shape[1], 1)
    scale = x.amax(1)[None, :] / torch.tensor([12.0, 30.0, 43.0, 70.0])[:, None]
    odd = odd if parity else None
    cost, idx = nl.nearest_codewords(x, w, grid, scale, odd)
    ref_cost, ref_idx = lat.nearest_codewords_torch(x, w, grid, scale, odd)
    mag = scale**2 * (w @ (grid * grid).T).amax(1) + 2 * scale * ((w * x) @ grid.T).amax(1)
    tol = 1e-5 * mag
    assert ((cost - ref_cost).abs() <= tol).all()
    assert (idx == ref_idx).float().mean() >= 0.95  # (the Triton kernel's bound, tests/test_lattice_search.py)
    b, c = lat.candidate_terms_torch(x, w, grid, idx.T.contiguous(), odd)  # each index's cost is the minimum
    at = c.T * scale**2 - 2 * scale * b.T
    assert ((at - ref_cost).abs() <= tol).all()


@pytest.mark.parametrize("name,parity", GRIDS)
@pytest.mark.parametrize("exact", [True, False])
def test_candidate_terms(name, parity, exact):
    """B and C of a few candidates a group: bit for bit where the sums are exact, to rounding elsewhere."""
    grid = lat.gguf_grid(name)
    x, w, odd = (_exact_groups if exact else _random_groups)(53, grid.shape[1], 2)
    idx = torch.randint(0, grid.shape[0], (53, 7), generator=torch.Generator().manual_seed(3))
    odd = odd if parity else None
    b, c = nl.candidate_terms(x, w, grid, idx, odd)
    rb, rc = lat.candidate_terms_torch(x, w, grid, idx, odd)
    if exact:
        assert torch.equal(b, rb) and torch.equal(c, rc)
    else:
        assert torch.allclose(b, rb, rtol=1e-6, atol=0) and torch.allclose(c, rc, rtol=1e-6, atol=0)
    with pytest.raises(IndexError):
        nl.candidate_terms(x, w, grid, idx + grid.shape[0], odd)


@pytest.mark.parametrize("k,n_scales", [(5, 24), (40, 3), (7, 70)])  # more than 32 candidates / 64 scales a pass
def test_subset_min_costs_is_the_reference(k, n_scales):
    """The same float operations as the reference (c (s s), then one fused multiply-add): bit for bit on random
    terms and scales."""
    g = torch.Generator().manual_seed(k)
    b, c = torch.randn(45, k, generator=g), torch.rand(45, k, generator=g)
    scale = torch.rand(n_scales, 45, generator=g)
    got = nl.subset_min_costs(b, c, scale)
    assert got.shape == (n_scales, 45) and torch.equal(got, lat.subset_min_costs_torch(b, c, scale))
    assert torch.equal(nl.subset_min_costs(b, c, scale[None]), got[None])
    sub = scale[:, ::3]  # one scale a sub-block of 3 groups: the reference's repeat and sum, bit for bit
    assert torch.equal(nl.subset_min_costs(b, c, sub, 3), lat.subset_min_costs_torch(b, c, sub, 3))


def _iq3_inputs(name: str, n: int, exact: bool, seed: int):
    """IQ3's search features: f = [2 w v, -A w], t = v / A (A a power of two where ``exact``), odd, flip_at, and the
    codec's tables."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        v = torch.randint(0, 64, (n, 4), generator=g).float() / 8
        w = torch.randint(1, 3, (n, 4), generator=g).float()
        a = 2.0 ** torch.randint(-6, -2, (n, 1), generator=g).float()
    else:
        v = torch.randn(n, 4, generator=g).abs() * torch.exp(torch.randn(n, 1, generator=g))
        w = torch.exp(torch.randn(n, 4, generator=g))
        a = v.amax(1, keepdim=True) / (10 + 60 * torch.rand(n, 1, generator=g))
    f = torch.cat([2 * w * v, -a * w], 1)
    t = v * (1 / a)
    odd = torch.rand(n, generator=g) < 0.5
    flip_at = torch.randint(0, 4, (n,), generator=g)
    tables = (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu"))
    return f, t, odd, flip_at, tables


@pytest.mark.parametrize("name", IQ3)
@pytest.mark.parametrize("variants", [1, 2, 5])
def test_iq3_nearest_variants_exact(name, variants):
    """Exact features (power-of-two scales): the scores of the whole-grid reference bit for bit, and the same
    points but for exact ties (two points of one score: the reference's is as good)."""
    f, t, odd, flip_at, tables = _iq3_inputs(name, 3000, True, variants)
    args = (None, None) if variants == 1 else (odd, None if variants == 5 else flip_at)
    score, idx = nl.nearest_variants(f, t, *args, *tables)
    ref_score, ref_idx = iq3.nearest_variants_torch(f, t, *args, *tables)
    assert score.shape == (3000, variants) and idx.dtype == torch.int64
    assert torch.equal(score, ref_score)
    assert (idx == ref_idx).float().mean() >= 0.99


@pytest.mark.parametrize("name", IQ3)
@pytest.mark.parametrize("variants", [1, 2, 5])
def test_iq3_nearest_variants_random(name, variants):
    f, t, odd, flip_at, tables = _iq3_inputs(name, 3000, False, 10 + variants)
    args = (None, None) if variants == 1 else (odd, None if variants == 5 else flip_at)
    score, idx = nl.nearest_variants(f, t, *args, *tables)
    ref_score, ref_idx = iq3.nearest_variants_torch(f, t, *args, *tables)
    fin = torch.isfinite(ref_score)
    assert torch.equal(fin, torch.isfinite(score)) and torch.equal(idx[~fin], ref_idx[~fin])
    assert torch.allclose(score[fin], ref_score[fin], rtol=1e-5, atol=1e-6 * ref_score[fin].abs().max())
    assert (idx == ref_idx).float().mean() >= 0.99


def test_ternary_nearest_is_the_torch_search():
    """IQ1's nearest ternary point: the indices of the torch search bit for bit (random weights, zero scales and
    importances, both delta signs), and so the same errors."""
    g = torch.Generator().manual_seed(7)
    m = 5000
    x = torch.randn(m, 8, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    w = torch.exp(torch.randn(m, 8, generator=g))
    w[:50, :3] = 0.0
    t = x.abs().amax(1) * (0.3 + torch.rand(m, generator=g))
    t[50:60] = 0.0
    sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
    idx, err = iq1.nearest_points(x, w, t, sign, backend="native")
    ref_idx, ref_err = iq1.nearest_points(x, w, t, sign, backend="torch")
    assert idx.dtype == torch.int64 and torch.equal(idx, ref_idx) and torch.equal(err, ref_err)
    assert torch.equal(nl.ternary_nearest(x, w, t, sign, *iq1._kernel_tables(torch.device("cpu")), iq1.DELTA), idx)


# ------------------------------------------------------------------------------------------------ encoders


@pytest.mark.parametrize("name", IQ2 + IQ3 + IQ1)
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_blocks_give_the_reference_bytes(name, seed):
    """Where every sum is exact, the encoded bytes are the torch reference's bit for bit, and "auto" on CPU is the
    compiled search."""
    x, w = _exact_blocks(40, seed)
    codec = get_codec(name)
    native_bytes = codec.encode_blocks(x, w, backend="native")
    assert torch.equal(native_bytes, codec.encode_blocks(x, w, backend="torch"))
    assert torch.equal(native_bytes, codec.encode_blocks(x, w))


@pytest.mark.parametrize("name", IQ2 + IQ3 + IQ1)
def test_encoders_error_is_the_references(name):
    """Random weights: the weighted error is the reference's to 1e-4 (most blocks the same bytes), and the bytes
    decode with gguf-py's dequantize to our decoder's values bit for bit."""
    x, w = _random_blocks(64, 4)
    codec = get_codec(name)
    b_n, b_t = codec.encode_blocks(x, w, backend="native"), codec.encode_blocks(x, w, backend="torch")
    y = codec.decode_blocks(b_n)
    e_n = (w * (x - y) ** 2).sum().item()
    e_t = (w * (x - codec.decode_blocks(b_t)) ** 2).sum().item()
    assert e_n <= e_t * (1 + 1e-4), (e_n, e_t)
    assert (b_n == b_t).all(1).float().mean() >= 0.9
    qtype = getattr(gguf.GGMLQuantizationType, name)
    oracle = gguf.quants.dequantize(b_n.numpy(), qtype).reshape(y.shape)
    assert np.array_equal(oracle.astype(np.float32), y.numpy())


@pytest.mark.parametrize("name", ["IQ2_XS", "IQ3_XXS"])
def test_threads_do_not_change_the_bytes(name):
    assert_threads_keep_bytes(get_codec(name), *_random_blocks(300, 5))


def test_shape_errors_name_the_shapes():
    grid = lat.gguf_grid("IQ2_XS")
    with pytest.raises(ValueError, match="scale"):
        nl.nearest_codewords(torch.zeros(4, 8), torch.ones(4, 8), grid, torch.ones(2, 5))
    with pytest.raises(ValueError, match="D <= 8"):
        nl.candidate_terms(torch.zeros(4, 16), torch.ones(4, 16), torch.zeros(3, 16), torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="odd"):
        nl.candidate_terms(torch.zeros(4, 8), torch.ones(4, 8), grid, torch.zeros(4, 2, dtype=torch.int64),
                           torch.zeros(5, dtype=torch.bool))


def test_empty_inputs():
    grid = lat.gguf_grid("IQ2_XXS")
    x = torch.zeros(0, 8)
    cost, idx = nl.nearest_codewords(x, x, grid, torch.zeros(2, 0))
    assert cost.shape == idx.shape == (2, 0)
    assert nl.subset_min_costs(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(4, 0)).shape == (4, 0)
    assert get_codec("IQ2_S").encode_blocks(torch.zeros(0, 256), torch.ones(0, 256)).shape == (0, 82)


def test_switched_off_by_the_environment(fresh_registry, monkeypatch, caplog):
    """``DYNAQUANT_NATIVE=0``: no CPU fast path loads (logged), and the encoders run their torch references."""
    monkeypatch.setenv("DYNAQUANT_NATIVE", "0")
    with caplog.at_level(logging.WARNING):
        for name in NAMES:
            assert fastpaths.lookup(name, "cpu") is None
    assert "DYNAQUANT_NATIVE=0" in caplog.text
    x, w = _random_blocks(6, 6)
    for name in ("IQ2_XS", "IQ3_S", "IQ1_M"):
        codec = get_codec(name)
        assert torch.equal(codec.encode_blocks(x, w), codec.encode_blocks(x, w, backend="torch"))
        with pytest.raises(RuntimeError, match="native"):
            codec.encode_blocks(x, w, backend="native")
