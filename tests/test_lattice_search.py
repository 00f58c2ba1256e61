"""The fused Triton nearest-codeword search against its torch reference.

:func:`dynaquant.kernels.lattice_search.nearest_codewords` (Triton) and
:func:`dynaquant.quant.codecs._lattice.nearest_codewords_torch` must give the same costs (to
float32 rounding) and the same indices except where two codewords tie to rounding. On CPU the
kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``triton_mode`` before Triton is first
imported, as tests/test_kernels.py does); on CUDA it runs compiled, on larger inputs too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from triton_mode import DEVICE, HAS_CUDA  # (imported before Triton: the interpreter without a GPU)

pytest.importorskip("triton")

import dynaquant.kernels  # noqa: E402,F401  (registers the kernels as the codecs' fast paths: backend="triton")
from dynaquant.quant.codecs import _lattice as lat  # noqa: E402

# (grid name, parity): IQ2_XXS/IQ2_XS carry the sign-parity flip; IQ2_S and IQ3_XXS (D = 4) do not.
CASES = [("IQ2_XXS", True), ("IQ2_XS", True), ("IQ2_S", False), ("IQ3_XXS", False)]


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def interpreted():
    """The kernel module (under Triton's interpreter when there is no GPU)."""
    from dynaquant.kernels import lattice_search

    return lattice_search


def _inputs(n: int, d: int, t: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * 0.03).abs()
    w = torch.exp(torch.randn(n, d, generator=g))
    w[0] = 0.0  # a group without importance: every codeword ties
    x[1] = 0.0  # a zero group
    amax = x.amax(dim=1)
    ts = torch.tensor([12.0, 30.0, 43.0, 70.0, 15.0, 20.0, 25.0, 35.0, 50.0, 60.0][:t])[:, None]
    scale = amax[None, :] / ts
    scale[:, 2] = 0.0  # zero scale: every codeword ties at cost 0
    odd = torch.rand(n, generator=g) < 0.5
    return x.to(device), w.to(device), scale.to(device), odd.to(device)


def _check(cost, idx, ref_cost, ref_idx, x, w, grid, scale, odd):
    assert cost.shape == ref_cost.shape == idx.shape
    assert idx.dtype == torch.int64
    # tolerance: float32 rounding of terms of size S**2 C and 2 S B
    mag = scale**2 * (w @ (grid * grid).T).amax(dim=1) + 2 * scale * ((w * x) @ grid.T).amax(dim=1)
    tol = 1e-5 * mag + 1e-30
    assert torch.all((cost - ref_cost).abs() <= tol), float(((cost - ref_cost).abs() - tol).max())
    diff = idx != ref_idx
    if diff.any():
        # a differing index must be a tie to rounding: its reference cost equals the minimum
        g = grid[idx]  # (..., n, D)
        b = (w * x * g).sum(-1)
        if odd is not None:
            b = b - 2.0 * torch.where(odd, (w * x * g).amin(-1), torch.zeros_like(b))
        c = (w * g * g).sum(-1)
        at = scale * scale * c - 2 * scale * b
        assert torch.all(((at - ref_cost).abs() <= tol)[diff])
    assert diff.float().mean() < 0.05


@pytest.mark.parametrize("name,parity", CASES)
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("variant", ["rows", "tile"])
def test_kernel_matches_reference(interpreted, name, parity, t, variant):
    grid = lat.gguf_grid(name, DEVICE)
    n = 37  # not a multiple of the block of groups
    x, w, scale, odd = _inputs(n, grid.shape[1], t, DEVICE)
    odd = odd if parity else None
    sc = scale if t > 1 else scale[0]
    cost, idx = interpreted.nearest_codewords(x, w, grid, sc, odd, variant=variant)
    ref_cost, ref_idx = lat.nearest_codewords_torch(x, w, grid, sc, odd)
    assert cost.shape == sc.shape
    _check(cost, idx, ref_cost, ref_idx, x, w, grid, sc, odd)
    assert idx[..., 2].eq(0).all()  # all-tie group: the lowest index


@pytest.mark.parametrize("name,parity", CASES)
def test_candidate_terms_match_reference(interpreted, name, parity):
    grid = lat.gguf_grid(name, DEVICE)
    x, w, _, odd = _inputs(29, grid.shape[1], 1, DEVICE)
    odd = odd if parity else None
    idx = torch.randint(0, grid.shape[0], (29, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    b, c = interpreted.candidate_terms(x, w, grid, idx.T.contiguous().T, odd)  # non-contiguous idx too
    rb, rc = lat.candidate_terms_torch(x, w, grid, idx, odd)
    torch.testing.assert_close(b, rb, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(c, rc, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_subset_min_costs_match_reference(interpreted, lead):
    g = torch.Generator().manual_seed(4)
    b, c = torch.randn(23, 6, generator=g).to(DEVICE), torch.rand(23, 6, generator=g).to(DEVICE)
    scale = torch.rand(*lead, 23, generator=g).to(DEVICE)
    got = interpreted.subset_min_costs(b, c, scale)
    ref = lat.subset_min_costs_torch(b, c, scale)
    assert got.shape == ref.shape == scale.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gps", [2, 4])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_subset_min_costs_per_sub_block(interpreted, gps, lead):
    """One scale a sub-block of ``gps`` groups: bit for bit the per-group kernel on the repeated scales, its
    minima summed by torch (what the IQ2 codecs did before), and close to the reference; odd sub-block count,
    a zero scale, K not a power of two."""
    g = torch.Generator().manual_seed(5)
    n = 13 * gps
    b, c = torch.randn(n, 6, generator=g).to(DEVICE), torch.rand(n, 6, generator=g).to(DEVICE)
    scale = torch.rand(*lead, n // gps, generator=g).to(DEVICE)
    scale[..., 3] = 0.0
    got = interpreted.subset_min_costs(b, c, scale, gps)
    per_group = interpreted.subset_min_costs(b, c, scale.repeat_interleave(gps, dim=-1))
    before = per_group.view(*lead, n // gps, gps).sum(dim=-1)
    assert got.shape == scale.shape and torch.equal(got, before)
    torch.testing.assert_close(got, lat.subset_min_costs_torch(b, c, scale, gps), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        interpreted.subset_min_costs(b, c, scale[..., :-1], gps)


def test_iq2_stored_scale_costs_equal_the_reference(interpreted):
    """IQ2's fused choice of stored sub-block codes: bit for bit the reference's torch steps over the Triton
    sub-block costs (codes, the first offset on a tie, costs), with a zero block scale, a zero sub-block, codes
    clamped at 0 and 15, and a tie (a zero-cost sub-block: every offset ties)."""
    from dynaquant.quant.codecs import iq2

    g = torch.Generator().manual_seed(7)
    n, n_sub, k = 5, 16, 8
    b, c = torch.rand(n * n_sub * 2, k, generator=g).to(DEVICE), torch.rand(n * n_sub * 2, k, generator=g).to(DEVICE)
    b[6:8] = 0.0  # sub-block 3 of block 0: all costs +0 at any scale
    c[6:8] = 0.0
    cont = torch.rand(n, n_sub, generator=g).to(DEVICE)
    cont[1, 2] = 0.0
    cont[2, 5] = 50.0  # past code 15
    d = (torch.rand(3, n, generator=g) * 0.2).to(torch.float16).to(torch.float32).to(DEVICE)
    d[1, 4] = 0.0
    offsets = torch.tensor([-1, 0, 1, 2]).to(DEVICE)
    cost, s = interpreted.stored_scale_costs(b, c, d, cont, offsets, 2)
    ref_cost, ref_s = iq2.stored_scale_costs_torch(b, c, d, cont, offsets, 2, backend="triton")
    assert cost.shape == (3, n, n_sub) and s.dtype == torch.int64
    assert torch.equal(cost, ref_cost) and torch.equal(s, ref_s)
    assert s.eq(15).any() and s.eq(0).any()
    with pytest.raises(ValueError):
        interpreted.stored_scale_costs(b, c, d, cont, offsets, 4)


def test_rows_kernel_more_than_eight_scales(interpreted):
    grid = lat.gguf_grid("IQ2_XXS", DEVICE)
    x, w, scale, odd = _inputs(40, 8, 10, DEVICE)
    cost, idx = interpreted.nearest_codewords(x, w, grid, scale, odd, variant="rows")
    ref_cost, ref_idx = lat.nearest_codewords_torch(x, w, grid, scale, odd)
    _check(cost, idx, ref_cost, ref_idx, x, w, grid, scale, odd)


def test_ternary_nearest_matches_iq1_search(interpreted):
    """The IQ1 kernel returns the torch search's indices exactly (same costs, same order)."""
    from dynaquant.quant.codecs import iq1

    g = torch.Generator().manual_seed(5)
    m = 300
    x = torch.randn(m, 8, generator=g) * 0.02
    x[:40] = torch.round(x[:40] / 0.01) * 0.01  # values on a lattice: exact ties
    w = torch.exp(torch.randn(m, 8, generator=g))
    w[5] = 0.0
    t = x.abs().amax(1) * torch.rand(m, generator=g) * 1.5
    t[7] = 0.0
    sign = torch.where(torch.rand(m, generator=g) < 0.5, 1.0, -1.0)
    ref_idx, _ = iq1.nearest_points(x, w, t, sign)  # torch on CPU
    xd, wd, td, sd = (v.to(DEVICE) for v in (x, w, t, sign))
    got = interpreted.ternary_nearest(xd, wd, td, sd, *iq1._kernel_tables(torch.device(DEVICE)), iq1.DELTA)
    assert torch.equal(got.cpu(), ref_idx)


@pytest.mark.parametrize("name", ["IQ1_S", "IQ1_M"])
def test_iq1_encoder_on_fused_path(interpreted, name):
    """IQ1 through the kernel (forced on CPU, interpreted) gives the same bytes as through torch."""
    from dynaquant.quant.codecs import quantize

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 256, generator=g) * 0.02).to(DEVICE)
    im = torch.exp(torch.randn(256, generator=g)).to(DEVICE)
    ref = quantize(x, name, im, backend="torch").cpu()
    assert torch.equal(quantize(x, name, im, backend="triton").cpu(), ref)


def _iq1_inputs(n: int, seed: int):
    """(n, 256) weights with exact ties (values on a lattice), a zero sub-block and a zero-importance group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 256, generator=g) * 0.02 * torch.exp(torch.randn(n, 1, generator=g))
    x[0, :64] = torch.round(x[0, :64] / 0.01) * 0.01
    x[1, 32:64] = 0.0
    w = torch.exp(torch.randn(n, 256, generator=g))
    w[2, :8] = 0.0
    return x, w


@pytest.mark.parametrize("sub,per_group", [(32, False), (16, True)])
def test_iq1_sub_scales_match_reference(sub, per_group):
    """IQ1's step-1 kernel equals its torch reference bit for bit (IQ1_S and IQ1_M layouts)."""
    from dynaquant.kernels import iq1_search
    from dynaquant.quant.codecs import iq1

    x, w = _iq1_inputs(5, 7)  # 40 or 80 sub-blocks: not a multiple of the kernel's tile
    ref_t, ref_h = iq1.sub_scales_torch(x, w, sub, per_group)
    ratios = torch.tensor(iq1._RATIOS, dtype=torch.float32, device=DEVICE)  # the encoder's trial scale ratios
    t, h = iq1_search.sub_scales(x.to(DEVICE), w.to(DEVICE), ratios, sub, per_group, iq1.DELTA)
    assert t.shape == h.shape == (5, 256 // sub)
    assert torch.equal(t.cpu(), ref_t) and torch.equal(h.cpu(), ref_h)
    assert (ref_t[1, 32 // sub : 64 // sub] == 0).all()  # the zero sub-block(s): scale 0


@pytest.mark.parametrize("rep,gps", [(2, 4), (1, 2)])
def test_iq1_ternary_search_matches_reference(interpreted, rep, gps):
    """Both delta signs, the trial scales read per group, and the errors: equal to the torch reference."""
    from dynaquant.quant.codecs import iq1

    x, w = _iq1_inputs(3, 8)
    n, s = 3, 256 // (8 * gps)
    xg, wg = x.view(n, s, gps, 8), w.view(n, s, gps, 8)
    g = torch.Generator().manual_seed(9)
    amax = x.view(n, s, -1).abs().amax(2)
    t = (amax[..., None] * torch.rand(n, s, rep, generator=g) * 0.5).unsqueeze(3).expand(n, s, rep, gps).reshape(-1).contiguous()
    t[5] = 0.0
    ref_idx, ref_err = iq1.ternary_search_torch(xg, wg, t, rep, backend="torch")
    dev = torch.device(DEVICE)
    tables = (*iq1._kernel_tables(dev), iq1._grid_digits(dev))
    xd, wd = x.view(-1, 8).to(DEVICE), w.view(-1, 8).to(DEVICE)
    idx, err = interpreted.ternary_search(xd, wd, t.to(DEVICE), *tables, iq1.DELTA, rep, gps)
    assert torch.equal(idx.cpu(), ref_idx) and torch.equal(err.cpu(), ref_err)
    # the indices are nearest_points' (one sign at a time)
    xf = xg.unsqueeze(2).expand(n, s, rep, gps, 8).reshape(-1, 8)
    wf = wg.unsqueeze(2).expand(n, s, rep, gps, 8).reshape(-1, 8)
    for row, sign in ((0, 1.0), (1, -1.0)):
        i1, e1 = iq1.nearest_points(xf, wf, t, torch.full_like(t, sign), backend="torch")
        assert torch.equal(idx[row].cpu(), i1) and torch.equal(err[row].cpu(), e1)


@pytest.mark.parametrize("name", ["IQ1_S", "IQ1_M"])
def test_iq1_full_search_on_fused_path(interpreted, name, monkeypatch):
    """The GPU's full search (second scale code, refit of d) through the kernels gives the torch reference's bytes."""
    from dynaquant.quant.codecs import iq1, quantize

    monkeypatch.setitem(iq1.CPU_SEARCH, "second_code", True)
    monkeypatch.setitem(iq1.CPU_SEARCH, "refit", True)
    x, _ = _iq1_inputs(4, 10)
    x = x.reshape(2, 512).to(DEVICE)
    im = torch.exp(torch.randn(512, generator=torch.Generator().manual_seed(11))).to(DEVICE)
    for imatrix in (im, None):
        ref = quantize(x, name, imatrix, backend="torch").cpu()
        assert torch.equal(quantize(x, name, imatrix, backend="triton").cpu(), ref)


def test_empty(interpreted):
    grid = lat.gguf_grid("IQ2_XXS", DEVICE)
    x = torch.zeros(0, 8, device=DEVICE)
    cost, idx = interpreted.nearest_codewords(x, x, grid, torch.zeros(2, 0, device=DEVICE), None)
    assert cost.shape == idx.shape == (2, 0)


def test_cpu_dispatch_is_not_triton():
    """On CPU tensors the codecs' entry point is the CPU fast path (the compiled C search of
    :mod:`dynaquant.kernels.native.lattice`, tests/test_lattice_native.py), or the torch reference where it does not
    load; never the Triton kernel."""
    from dynaquant.quant.codecs import fastpaths

    grid = lat.gguf_grid("IQ2_XXS")
    x, w, scale, odd = _inputs(9, 8, 2, "cpu")
    cpu = fastpaths.lookup("lattice.nearest_codewords", "cpu")
    assert lat.fused(x) == (cpu is not None)
    a = lat.nearest_codewords(x, w, grid, scale, odd)
    b = (cpu or lat.nearest_codewords_torch)(x, w, grid, scale, odd)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_subset_penalty():
    grid = lat.gguf_grid("IQ2_XS")
    x, w, _, _ = _inputs(11, 8, 1, "cpu")
    idx = torch.randint(0, grid.shape[0], (11, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(lat.subset_penalty(w * x, grid, idx), lat.flip_penalty(w * x, grid).gather(1, idx))


def test_import_does_not_load_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import sys, dynaquant, dynaquant.kernels, dynaquant.quant.codecs; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,parity", CASES + [("IQ1_S", False)])
@pytest.mark.parametrize("variant", ["rows", "tile"])
def test_cuda_matches_reference(name, parity, variant):
    from dynaquant.kernels.lattice_search import nearest_codewords

    grid = lat.gguf_grid(name, "cuda")
    n = 5003
    x, w, scale, odd = _inputs(n, grid.shape[1], 4, "cuda")
    if name == "IQ1_S":
        x = x - 0.01  # signed weights on a signed grid (no parity)
    odd = odd if parity else None
    cost, idx = nearest_codewords(x, w, grid, scale, odd, variant=variant)
    ref_cost, ref_idx = lat.nearest_codewords_torch(x, w, grid, scale, odd)
    _check(cost, idx, ref_cost, ref_idx, x, w, grid, scale, odd)


def _assert_as_good_as_torch(x, im, name, ours, ref):
    """The fused path's bytes ``ours`` decode as gguf-py decodes them, at most 0.1 % more weighted error than the
    torch path's ``ref`` on weights ``x`` with importance ``im``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from dynaquant.quant.codecs import dequantize

    x, im = x.cpu(), im.cpu()
    y = dequantize(ours, name)
    assert torch.equal(y, torch.from_numpy(gguf_dequantize(ours.numpy(), GGMLQuantizationType[name])))
    e_ours = float((im * (x - y) ** 2).sum())
    e_ref = float((im * (x - dequantize(ref, name)) ** 2).sum())
    assert e_ours <= e_ref * 1.001


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS"])
def test_iq2_encoder_on_fused_path(interpreted, name):
    """The IQ2 encoder through the kernel (forced on CPU, interpreted) gives valid bytes of
    the same quality as through the torch reference."""
    from dynaquant.quant.codecs import quantize

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 512, generator=g) * 0.02).to(DEVICE)
    im = torch.exp(torch.randn(512, generator=g)).to(DEVICE)
    ref = quantize(x, name, im, backend="torch").cpu()
    ours = quantize(x, name, im, backend="triton").cpu()  # all three kernels
    _assert_as_good_as_torch(x, im, name, ours, ref)


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ3_S"])
@pytest.mark.parametrize("variants", ["none", "full", "one"])
@pytest.mark.parametrize("lists", [True, False])
def test_iq3_nearest_variants_against_the_reference(interpreted, name, variants, lists):
    """The fused IQ3 assignment gives the torch reference's grid points for every variant (unflipped; every weight
    flipped, or the named one, on the odd groups; -inf / 0 on the even ones), scores equal up to float32 rounding;
    off-grid variants through their exact candidate lists (the default) or the whole grid."""
    from dynaquant.kernels.iq3_search import nearest_variants
    from dynaquant.quant.codecs import iq3

    g = torch.Generator().manual_seed(5)
    r = 300  # three programs of 128, the last one partial
    v = torch.rand(r, 4, generator=g) * 60
    v[:50] = torch.tensor([4.0, 12.0, 20.0, 4.0]) * (1 + 0.01 * torch.rand(50, 4, generator=g))  # near grid points
    w = torch.rand(r, 4, generator=g) + 0.1
    a = torch.rand(r, 1, generator=g) * 2 + 0.5
    a[:50] = 1.0 if name == "IQ3_XXS" else 4.0
    f, t = torch.cat([2 * w * v, -a * w], 1), v / a
    odd = None if variants == "none" else torch.rand(r, generator=g) < 0.5
    at = torch.randint(0, 4, (r,), generator=g) if variants == "one" else None
    tables = (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu"))
    s_ref, i_ref = iq3.nearest_variants_torch(f, t, odd, at, *tables)
    s, i = nearest_variants(f.to(DEVICE), t.to(DEVICE), None if odd is None else odd.to(DEVICE),
                            None if at is None else at.to(DEVICE), *(x.to(DEVICE) for x in tables), lists=lists)
    s, i = s.cpu(), i.cpu()
    assert s.shape == i.shape == (r, {"none": 1, "full": 5, "one": 2}[variants])
    assert torch.equal(i, i_ref)
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), fin) and (variants == "none" or not fin[:, 1:][~odd].any())
    torch.testing.assert_close(s[fin], s_ref[fin], rtol=1e-5, atol=1e-2)
    # on-grid rows exist and the reference's exhaustive search agrees with their lookups
    kmap, mids = tables[:2]
    lev = torch.bucketize(t, mids)
    assert (kmap[(lev << (3 * torch.arange(4))).sum(1)] >= 0).sum() >= 20


@pytest.mark.parametrize("name,parity,full", [("IQ3_XXS", True, False), ("IQ3_XXS", True, True), ("IQ3_S", False, False)])
@pytest.mark.parametrize("out", ["stats", "error"])
def test_iq3_assign_equals_the_composition(interpreted, name, parity, full, out):
    """The fused assignment (one launch: features, every variant's search, the parity choice, the per-weight terms)
    equals, bit for bit, its torch reference composed with the fused search (the encoder's former fast path: the
    same operations, so the same bytes) and with the torch search; with and without the assignment returned."""
    from dynaquant.kernels.iq3_search import assign, nearest_variants
    from dynaquant.quant.codecs import _iq3_search as steps
    from dynaquant.quant.codecs import iq3

    g = torch.Generator().manual_seed(7)
    n = 3  # 96 lanes: one partial program
    x = torch.randn(n, 8, 32, generator=g) * 0.02 * torch.exp(torch.randn(n, 8, 1, generator=g))
    w = torch.exp(torch.randn(n, 8, 32, generator=g))
    x[1, 2] = 0.0  # a zero sub-block
    a = x.abs().amax(-1) / (50.0 if name == "IQ3_XXS" else 13.0) * (1 + 0.2 * torch.rand(n, 8, generator=g))
    a[1, 2] = 0.0  # its scale 0
    tables = tuple(t.to(DEVICE) for t in (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu")))
    xd, wd, ad = x.to(DEVICE), w.to(DEVICE), a.to(DEVICE)
    got = [t.cpu() for t in assign(xd, wd, ad, parity, full, out, True, *tables) if t is not None]
    comp = [t.cpu() for t in steps.assign_torch(xd, wd, ad, parity, full, out, True, *tables, nearest=nearest_variants)
            if t is not None]
    ref = [t for t in steps.assign_torch(x, w, a, parity, full, out, True, *(t.cpu() for t in tables)) if t is not None]
    assert len(got) == (4 if out == "stats" else 3)
    for u, v, r in zip(got, comp, ref):
        assert u.dtype == v.dtype and torch.equal(u, v) and torch.equal(u, r)
    flip = got[1]
    assert flip.any() == parity and not flip.reshape(n, 8, 4, 8).sum(-1).gt(1).any()  # one flip an 8-group at most
    short = assign(xd, wd, ad, parity, full, out, False, *tables)
    assert short[0] is None and short[1] is None and torch.equal(short[2].cpu(), got[2])


def _iq3_assign_inputs(name: str, seed: int):
    """IQ3 assignment inputs of 5 rows (160 lanes: two programs, the last partial): x, w (5, 8, 32) and per
    sub-block scales a (5, 8) near the type's, one of them 0."""
    g = torch.Generator().manual_seed(seed)
    n = 5
    x = torch.randn(n, 8, 32, generator=g) * 0.02 * torch.exp(torch.randn(n, 8, 1, generator=g))
    w = torch.exp(torch.randn(n, 8, 32, generator=g))
    a = x.abs().amax(-1) / (50.0 if name == "IQ3_XXS" else 13.0) * (1 + 0.3 * torch.rand(n, 8, generator=g))
    a[1, 2] = 0.0
    return x, w, a


@pytest.mark.parametrize("name,parity,full", [("IQ3_XXS", True, False), ("IQ3_XXS", True, True), ("IQ3_S", False, False)])
@pytest.mark.parametrize("lists", [True, False])
def test_iq3_packed_tables_change_nothing(interpreted, name, parity, full, lists):
    """The fused assignment reading packed words (map, candidate lists, chosen points) equals the one reading the
    float tables, bit for bit (the same coordinates, the same operations), for both terms, both walks and all variants;
    the packed words decode to the grid and the map."""
    from dynaquant.kernels.iq3_search import assign
    from dynaquant.kernels.iq3_tables import candidate_lists, packed_points
    from dynaquant.quant.codecs import iq3

    kmap, mids, grid, g8 = (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu"))
    cand, _ = candidate_lists(grid, "cpu")
    pts, kpk, cpk, fb, step = packed_points(grid, kmap, cand)
    fields = (pts[:, None].long() >> (fb * torch.arange(4))) & ((1 << fb) - 1)
    assert torch.equal(fields.float() * step, grid) and torch.equal(pts.long() >> (4 * fb), torch.arange(grid.shape[0]))
    assert torch.equal(torch.where(kmap >= 0, kpk.long() >> (4 * fb), -1), kmap) and torch.equal(cpk, pts[cand.long()])
    assert packed_points(grid + 0.5, kmap, cand) is None
    x, w, a = _iq3_assign_inputs(name, 11)
    tables = tuple(t.to(DEVICE) for t in (kmap, mids, grid, g8))
    xd, wd, ad = x.to(DEVICE), w.to(DEVICE), a.to(DEVICE)
    for out in ("stats", "error"):
        new = [t for t in assign(xd, wd, ad, parity, full, out, True, *tables, lists=lists, packed=True) if t is not None]
        old = [t for t in assign(xd, wd, ad, parity, full, out, True, *tables, lists=lists, packed=False) if t is not None]
        assert all(u.dtype == v.dtype and torch.equal(u.cpu(), v.cpu()) for u, v in zip(new, old))


@pytest.mark.parametrize("name,parity,full", [("IQ3_XXS", True, False), ("IQ3_XXS", True, True), ("IQ3_S", False, False)])
def test_iq3_walk_with_prefetch_changes_nothing(interpreted, name, parity, full, monkeypatch):
    """A list walk that loads candidate k + 1's word before it scores candidate k (``prefetch``) chooses what the
    plain walk chooses, bit for bit, in programs of the same size (32 groups, the CUDA default; off CUDA also 128,
    the interpreter's): the assignment (points and flips), its terms and sums, step 1's update, and the bare
    search's scores; lists shorter than 8 and longer than 40 candidates are walked. (Across program sizes the
    in-kernel sub-block sums may add in another order on CUDA: the H100 gave other IQ3_XXS results for 32 and 128.)"""
    from dynaquant.kernels import iq3_search
    from dynaquant.quant.codecs import iq3

    def sized(fn, blk, *args, **kwargs):  # fn run in programs of blk groups (whatever the device)
        with monkeypatch.context() as m:
            m.setattr(iq3_search, "_BLOCK", blk)
            m.setattr(iq3_search, "_INTERPRETED_BLOCK", blk)
            return fn(*args, **kwargs)

    x, w, a = _iq3_assign_inputs(name, 13)
    x[2] *= 40.0  # far-off targets: long lists
    tables = tuple(t.to(DEVICE) for t in (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu")))
    xd, wd, ad = x.to(DEVICE), w.to(DEVICE), a.to(DEVICE)
    bg = torch.full(a.shape, -1.0, dtype=torch.float64, device=DEVICE)
    ba = torch.zeros_like(ad)
    for blk in (32,) if DEVICE == "cuda" else (32, 128):
        for out, sums in (("stats", False), ("error", True)):
            plain = sized(iq3_search.assign, blk, xd, wd, ad, parity, full, out, True, *tables, sums=sums,
                          prefetch=False)
            pf = sized(iq3_search.assign, blk, xd, wd, ad, parity, full, out, True, *tables, sums=sums, prefetch=True)
            plain, pf = [t for t in plain if t is not None], [t for t in pf if t is not None]
            assert len(plain) == (4 if out == "stats" else 3)
            assert all(u.dtype == v.dtype and torch.equal(u.cpu(), v.cpu()) for u, v in zip(pf, plain)), (blk, out)
        plain = sized(iq3_search.consider, blk, xd, wd, ad, parity, bg, ba, *tables, prefetch=False)
        pf = sized(iq3_search.consider, blk, xd, wd, ad, parity, bg, ba, *tables, prefetch=True)
        assert all(torch.equal(u.cpu(), v.cpu()) for u, v in zip(pf, plain)), blk
    v = x.abs().reshape(-1, 8, 8, 4)
    big_a = a.clamp_min(1e-8)[:, :, None, None].expand_as(v)  # the groups' sub-block scales (the zero one tiny)
    wg = w.reshape(v.shape)
    f = torch.cat([2 * wg * v, -big_a * wg], -1).reshape(-1, 8)
    t = (v / big_a).reshape(-1, 4)
    odd = torch.rand(f.shape[0], generator=torch.Generator().manual_seed(3)) < 0.5
    args = (f.to(DEVICE), t.to(DEVICE), odd.to(DEVICE) if parity else None, None, *tables)
    plain = sized(iq3_search.nearest_variants, 32, *args, prefetch=False)
    pf = sized(iq3_search.nearest_variants, 32, *args, prefetch=True)
    assert all(torch.equal(u.cpu(), v.cpu()) for u, v in zip(pf, plain))
    cnt = iq3._candidates(name)[1]
    kmap, mids = iq3._grid_map(name, "cpu")
    u = (torch.bucketize(t, mids) << (3 * torch.arange(4))).sum(1)
    walked = cnt[u][kmap[u] < 0]
    assert walked.min() < 8 and walked.max() > 40  # short lists and long ones (past any 32-lane warp's worth)


@pytest.mark.parametrize("name,parity,full", [("IQ3_XXS", True, True), ("IQ3_S", False, False)])
def test_iq3_assign_sums(interpreted, name, parity, full):
    """``sums=True``: the fused assignment's (n, 8) sub-block sums formed in the kernel equal the reference's
    ``sum(-1)`` of its terms to float32 rounding (the same assignment: idx and flip bit for bit); summed by torch
    (``fused_sums=False``) they are the reference's bit for bit (both summed by torch on the kernel's device)."""
    from dynaquant.kernels.iq3_search import assign
    from dynaquant.quant.codecs import _iq3_search as steps
    from dynaquant.quant.codecs import iq3

    x, w, a = _iq3_assign_inputs(name, 12)
    n = x.shape[0]
    tables = tuple(t.to(DEVICE) for t in (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu")))
    xd, wd, ad = x.to(DEVICE), w.to(DEVICE), a.to(DEVICE)
    for out in ("stats", "error"):
        # the reference on the kernel's device: torch's sum(-1) on a GPU need not add in the CPU's order
        ref = [None if t is None else t.cpu()
               for t in steps.assign_torch(xd, wd, ad, parity, full, out, True, *tables, sums=True)]
        assert ref[2].shape == (n, 8)
        fused = [None if t is None else t.cpu()
                 for t in assign(xd, wd, ad, parity, full, out, True, *tables, sums=True, fused_sums=True)]
        torch_sums = [None if t is None else t.cpu()
                      for t in assign(xd, wd, ad, parity, full, out, True, *tables, sums=True, fused_sums=False)]
        assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])
        for k in (2, 3):
            if ref[k] is None:
                assert fused[k] is None and torch_sums[k] is None
                continue
            assert fused[k].shape == (n, 8) and torch.equal(torch_sums[k], ref[k])
            torch.testing.assert_close(fused[k], ref[k], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name,parity,full,idx_dtype", [("IQ3_XXS", True, False, torch.uint8),
                                                         ("IQ3_XXS", True, True, torch.int64),
                                                         ("IQ3_S", False, False, torch.int16)])
def test_iq3_exact_is_the_assignments_error_and_sums(interpreted, name, parity, full, idx_dtype):
    """``iq3.exact`` (one launch: the exact error's sub-block sums and the same assignment's least-squares sums) gives
    bit for bit what the fused assignment gives for ``out="error"`` and for ``out="stats"`` with in-kernel sums, its
    points and flips (in the narrow index type asked for) equal the reference's, and its sums equal the reference's
    torch sums to float32 rounding; an index type too narrow for the grid is refused."""
    from dynaquant.kernels.iq3_search import assign, exact
    from dynaquant.quant.codecs import _iq3_search as steps
    from dynaquant.quant.codecs import iq3

    x, w, a = _iq3_assign_inputs(name, 21)
    tables = tuple(t.to(DEVICE) for t in (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu")))
    xd, wd, ad = x.to(DEVICE), w.to(DEVICE), a.to(DEVICE)
    idx, flip, err, sxg, sgg = (t.cpu() for t in exact(xd, wd, ad, parity, full, *tables, idx_dtype=idx_dtype))
    assert idx.dtype == idx_dtype and flip.dtype == torch.bool and err.shape == sxg.shape == sgg.shape == (5, 8)
    e_idx, e_flip, e_err, _ = (None if t is None else t.cpu()
                               for t in assign(xd, wd, ad, parity, full, "error", True, *tables, sums=True, fused_sums=True))
    s_idx, s_flip, s_x, s_g = (None if t is None else t.cpu()
                               for t in assign(xd, wd, ad, parity, full, "stats", True, *tables, sums=True, fused_sums=True))
    assert torch.equal(idx.long(), e_idx) and torch.equal(flip, e_flip) and torch.equal(idx.long(), s_idx)
    assert torch.equal(err, e_err) and torch.equal(sxg, s_x) and torch.equal(sgg, s_g)
    ref = [t.cpu() for t in steps.exact_torch(xd, wd, ad, parity, full, *tables, idx_dtype=idx_dtype)]
    assert ref[0].dtype == idx_dtype and torch.equal(idx, ref[0]) and torch.equal(flip, ref[1])
    for got, want in zip((err, sxg, sgg), ref[2:]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
    assert (sgg > 0).float().mean() > 0.9 and sgg[1, 2] > 0 and err[1, 2] > 0  # (scale 0: the points still count)
    if name == "IQ3_S":
        with pytest.raises(ValueError, match="idx_dtype"):
            exact(xd, wd, ad, parity, full, *tables, idx_dtype=torch.uint8)


@pytest.mark.parametrize("name,parity,kind,deltas", [("IQ3_XXS", True, "half", (1, -1)), ("IQ3_S", False, "odd", (1, -1)),
                                                      ("IQ3_XXS", True, "half", (-1,)), ("IQ3_S", False, "odd", ())])
def test_iq3_exact_levels_keep_the_better_level(interpreted, name, parity, kind, deltas):
    """``iq3.exact_levels`` (a round's levels l, l + 1, l - 1 in one launch) equals, bit for bit, ``best_levels`` over
    one ``iq3.exact`` launch a level with the scales torch computes (levels at 0 and 15 clamped, a zero ``d``), keeps
    a later level only where its error is strictly less, and agrees with its torch reference (same points; sums to
    float32 rounding)."""
    from dynaquant.kernels.iq3_search import exact, exact_levels
    from dynaquant.quant.codecs import _iq3_search as steps
    from dynaquant.quant.codecs import iq3

    x, w, _ = _iq3_assign_inputs(name, 31)
    n = x.shape[0]
    g = torch.Generator().manual_seed(31)
    amax = x.abs().amax(-1).amax(-1)
    d = (amax / (0.25 * 62 if name == "IQ3_XXS" else 15.0 * 15)).half().float()
    d[4] = 0.0
    lsc = torch.randint(0, 16, (n, 8), generator=g)
    lsc[0, :4] = torch.tensor([0, 15, 0, 15])
    tables = tuple(t.to(DEVICE) for t in (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu")))
    xd, wd, dd, ld = (t.to(DEVICE) for t in (x, w, d, lsc))
    dt = torch.uint8 if name == "IQ3_XXS" else torch.int16
    got = [t.cpu() for t in exact_levels(xd, wd, dd, ld, deltas, kind, parity, *tables, idx_dtype=dt)]

    def one(lt):
        i, f, e, sx, sg = exact(xd, wd, steps.sub_scale(dd, lt, kind), parity, False, *tables, idx_dtype=dt)
        return e, i, f, sx, sg

    want = [t.cpu() for t in steps.best_levels(one, ld, deltas)]
    assert got[1].dtype == dt and got[2].dtype == torch.bool and got[5].dtype == torch.int64
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if deltas:
        assert (got[5] != lsc).any() and (got[5] == lsc).any()
    else:
        assert torch.equal(got[5], lsc)
    errs = [one(torch.clamp(ld + dl, 0, 15))[0].cpu() for dl in (0, *deltas)]
    assert torch.equal(got[0], torch.stack(errs).min(0).values)
    ref = steps.exact_levels_torch(xd, wd, dd, ld, deltas, kind, parity, *tables, idx_dtype=dt)
    ref = [t.cpu() for t in ref]
    assert torch.equal(got[5], ref[5]) and torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    for a, b in zip((got[0], got[3], got[4]), (ref[0], ref[3], ref[4])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name,parity,lloyd", [("IQ3_XXS", True, 2), ("IQ3_S", False, 2), ("IQ3_XXS", True, 0)])
def test_iq3_step1_in_one_launch(interpreted, name, parity, lloyd):
    """``iq3.step1`` (step 1's candidate scales and Lloyd steps in one launch) equals, bit for bit, ``step1_torch``
    over the fused ``iq3.consider`` a candidate (with a zero sub-block and a zero candidate), and is close to the pure
    torch reference (its own float order can take another point on a near-tie)."""
    from dynaquant.kernels import iq3_search
    from dynaquant.quant.codecs import _iq3_search as steps
    from dynaquant.quant.codecs import iq3

    x, w, _ = _iq3_assign_inputs(name, 41)
    x[2, 5] = 0.0
    amax = x.abs().amax(-1)
    ts = (44.0, 53.7, 62.0, 78.0) if name == "IQ3_XXS" else (11.0, 14.6, 19.5)
    cand = torch.stack([amax / t for t in ts], -1)
    cand[3, 1, 0] = 0.0
    tables = tuple(t.to(DEVICE) for t in (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu")))
    xd, wd, cd = x.to(DEVICE), w.to(DEVICE), cand.to(DEVICE)
    got = iq3_search.step1(xd, wd, cd, lloyd, parity, *tables).cpu()

    def fused(a, bg, ba):
        return iq3_search.consider(xd, wd, a, parity, bg, ba, *tables)

    want = steps.step1_torch(xd, wd, cd, lloyd, parity, *tables, consider=fused).cpu()
    assert got.dtype == torch.float32 and got.shape == (5, 8) and torch.equal(got, want)
    assert got[2, 5] == 0 and (got > 0).float().mean() > 0.9
    ref = steps.step1_torch(x, w, cand, lloyd, parity, *(t.cpu() for t in tables))
    assert ((ref - got).abs() <= 1e-3 * ref.abs()).float().mean() > 0.8
    if lloyd:  # the Lloyd steps move the scales off the candidates
        assert not torch.equal(got, steps.step1_torch(xd, wd, cd, 0, parity, *tables, consider=fused).cpu())


@pytest.mark.parametrize("name,parity", [("IQ3_XXS", True), ("IQ3_S", False)])
def test_iq3_consider_updates_as_the_reference(interpreted, name, parity, monkeypatch):
    """Step 1's fused candidate (``iq3.consider``: assignment, sums and the running best's update in one launch) gives
    the reference's update (float64, bit for bit) of the kernel's own sums, and with the kernel update switched off
    (``CONSIDER``) the same; torch's sums of the same assignment agree to their rounding (the reference
    ``consider_torch`` searches by its own float order: a near-tie may take another point); a taken gain is larger, a
    kept one unchanged."""
    from dynaquant.kernels import iq3_search
    from dynaquant.quant.codecs import _iq3_search as steps
    from dynaquant.quant.codecs import iq3

    monkeypatch.setattr(iq3_search, "CONSIDER", True)  # (the defaults; set in case a run switched them off)
    monkeypatch.setattr(iq3_search, "SUMS", True)
    g = torch.Generator().manual_seed(13)
    n = 5  # 160 lanes: two programs, the last partial
    x = torch.randn(n, 8, 32, generator=g) * 0.02 * torch.exp(torch.randn(n, 8, 1, generator=g))
    w = torch.exp(torch.randn(n, 8, 32, generator=g))
    x[1, 2] = 0.0  # a zero sub-block: sxg 0, never taken
    a = x.abs().amax(-1) / (50.0 if name == "IQ3_XXS" else 13.0)
    best_gain = torch.rand(n, 8, generator=g, dtype=torch.float64) * 1e-3
    best_gain[0] = -1.0  # the first candidate's start: taken wherever sxg > 0
    best_a = torch.rand(n, 8, generator=g)
    tables = tuple(t.to(DEVICE) for t in (*iq3._grid_map(name, "cpu"), *iq3._grid_table(name, "cpu")))
    xd, wd, ad, bgd, bad = (t.to(DEVICE) for t in (x, w, a, best_gain, best_a))
    gain, scale = (t.cpu() for t in iq3_search.consider(xd, wd, ad, parity, bgd, bad, *tables))
    p, q = (t.cpu() for t in iq3_search.assign(xd, wd, ad, parity, False, "stats", False, *tables, sums=True)[2:])
    ref = steps.best_scale_update(p.double(), q.double(), best_gain, best_a)
    assert gain.dtype == torch.float64 and scale.dtype == torch.float32
    assert torch.equal(gain, ref[0]) and torch.equal(scale, ref[1])
    monkeypatch.setattr(iq3_search, "CONSIDER", False)
    off = [t.cpu() for t in iq3_search.consider(xd, wd, ad, parity, bgd, bad, *tables)]
    assert torch.equal(off[0], gain) and torch.equal(off[1], scale)
    # torch's sums of the same assignment (the fused search's points): equal to the sums' rounding
    p, q = steps.assign_torch(xd, wd, ad, parity, False, "stats", False, *tables, nearest=iq3_search.nearest_variants,
                              sums=True)[2:]
    tg, ta = steps.best_scale_update(p.cpu().double(), q.cpu().double(), best_gain, best_a)
    torch.testing.assert_close(gain, tg, rtol=1e-5, atol=0)
    torch.testing.assert_close(scale, ta, rtol=1e-5, atol=0)
    tg, ta = steps.consider_torch(x, w, a, parity, best_gain, best_a, *(t.cpu() for t in tables))  # the reference
    assert tg.shape == ta.shape == (n, 8) and ((tg - gain).abs() <= 1e-2 * gain.abs()).float().mean() > 0.8
    taken = gain != best_gain
    assert taken[0].sum() >= 7 and not taken[1, 2] and (gain[taken] > best_gain[taken]).all()
    assert torch.equal(scale[~taken], best_a[~taken])


@pytest.mark.parametrize("c", [0.25, 1.0])
@pytest.mark.parametrize("n_extra", [0, 2])
def test_iq3_pick_equals_the_reference(interpreted, c, n_extra):
    """The fp16 ``d`` search's pick from the kernel (the candidates made there: ``max A / (c t)`` and the extra ones,
    rounded to fp16, tiny ones kept at 2**-24, negative ones 0; each candidate's 8 sub-block errors in float64, summed
    pairwise; the first least total; its levels) equals the torch reference's bit for bit, with a zero scale, a
    sub-block without importance (every candidate ties: the first is taken), an all-zero super-block, extra candidates
    that are negative, tiny, past float16's range or a copy of a step's candidate, candidates past the last level
    (l = 15), and candidate counts that are not powers of two; the levels are those the errors name."""
    from dynaquant.kernels.iq3_scales import pick
    from dynaquant.quant.codecs import _iq3_search as steps
    from dynaquant.quant.codecs import _kquant_search as kqs

    g = torch.Generator().manual_seed(1)
    n = 37  # a partial last program
    a = torch.rand(n, 8, generator=g) * 3
    a[0, 3] = 0.0
    a[2] = 0.0
    sgg = (torch.rand(n, 8, generator=g) * 5).double()
    sgg[1] = 0.0
    ts = torch.linspace(18.0, 33.0, 61, dtype=torch.float64)
    extra = None
    if n_extra:
        extra = (torch.rand(n, n_extra, generator=g) * a.amax(1, keepdim=True) / (c * 25)).double()
        extra[3, 0], extra[4, 1], extra[5, 0], extra[6, 1] = -0.01, 1e-9, 1e6, 0.0
        extra[7, 0] = float(kqs.f16_candidates(a[7].amax() / (c * ts[5:6])))  # equals step 5's candidate
    ref_d, ref_lsc = steps.pick_torch(a, sgg, ts, extra, c)
    d, lsc = (t.cpu() for t in pick(a.to(DEVICE), sgg.to(DEVICE), ts.to(DEVICE),
                                    None if extra is None else extra.to(DEVICE), c))
    assert d.dtype == torch.float32 and lsc.dtype == torch.int64 and d.shape == (n,) and lsc.shape == (n, 8)
    assert torch.equal(d, ref_d) and torch.equal(lsc, ref_lsc)
    assert torch.equal(d.half().float(), d) and (d >= 0).all() and lsc.min() >= 0 and lsc.max() <= 15
    assert (lsc == 15).any() and d[2] == 0
    # the reference is today's candidates and errors: d is the first candidate of least pairwise total
    am = a.amax(1, keepdim=True)
    cand = kqs.f16_candidates(torch.cat([am / (c * ts), *([] if extra is None else [extra])], 1)).clamp_min(0)
    totals = steps.pairwise8(steps.pick_errors_torch(a, sgg, cand, c))
    best = totals.argmin(1)
    assert torch.equal(d, cand.gather(1, best[:, None]).squeeze(1)) and best[1] == 0
    e, ls, i = steps._pick_terms(a, sgg, d[:, None], c)
    assert torch.equal(lsc, ls.gather(-1, i.unsqueeze(-1)).squeeze(-1).squeeze(1).long())
    assert torch.equal(steps.pairwise8(torch.arange(8.0).expand(2, 8)), torch.full((2,), 28.0))


def _spy(monkeypatch, name):
    from dynaquant.quant.codecs import fastpaths

    calls = []
    real = fastpaths.lookup(name)

    def spy(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setitem(fastpaths._LOADED, name, spy)
    return calls


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ3_S"])
@pytest.mark.parametrize("knobs", ["cpu", "full"])
def test_iq3_encoder_on_fused_path(interpreted, name, knobs, monkeypatch):
    """IQ3's assignment through the fused kernels (forced on CPU, interpreted; the torch side on CPU searches the exact
    candidate lists), with the CPU's short search or the full one other devices run (two rounds, ``l`` +- 1, IQ3_XXS's
    final flip pass): the fused assignment ``iq3.assign`` is called for the scale search, ``iq3.exact`` for the exact
    errors (with their least-squares sums, the next round's start) and ``iq3.pick`` for ``d``; the bytes decode as
    gguf-py does and are as good as torch's; with a round's levels in one launch (``iq3.exact_levels``) and step 1 in
    one launch (``iq3.step1``) the bytes are the same; with ``iq3.assign`` and ``iq3.exact`` taken away the assignment runs the
    fused search ``iq3.nearest_variants`` and the torch steps around it, and the bytes are the same."""
    from dynaquant.quant.codecs import fastpaths, get_codec, quantize

    if knobs == "full":
        monkeypatch.setattr(type(get_codec(name)), "cpu_search", {})
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 512, generator=g) * 0.02).to(DEVICE)
    x[0, :32] = 0.0  # a zero sub-block (scale 0)
    im = torch.exp(torch.randn(512, generator=g)).to(DEVICE)
    calls, exact, picks, considers = (_spy(monkeypatch, k) for k in ("iq3.assign", "iq3.exact", "iq3.pick",
                                                                      "iq3.consider"))
    ref = quantize(x, name, im, backend="torch").cpu()
    assert not calls and not exact and not picks
    ours = quantize(x, name, im, backend="triton").cpu()
    assert {c[5] for c in calls} == {"stats"} and all(c[3] == (name == "IQ3_XXS") for c in calls + exact)
    full = knobs == "full" or DEVICE != "cpu"  # (off the CPU the full search runs whatever cpu_search says)
    rounds, deltas = (2, 2) if full else (1, 0)
    assert len(picks) == rounds and len(exact) == rounds * (1 + deltas) + (full and name == "IQ3_XXS")
    assert all(c[4] for c in exact[rounds * (1 + deltas):]) and not any(c[4] for c in exact[:rounds * (1 + deltas)])
    _assert_as_good_as_torch(x, im, name, ours, ref)
    if full:  # a round's levels in one launch (iq3.exact_levels): the same bytes
        from dynaquant.quant.codecs import iq3

        monkeypatch.setattr(iq3, "FUSED_LEVELS", True)
        monkeypatch.setattr(iq3, "FUSED_STEP1", True)
        levels, step1 = _spy(monkeypatch, "iq3.exact_levels"), _spy(monkeypatch, "iq3.step1")
        n_exact, n_consider = len(exact), len(considers)
        assert torch.equal(quantize(x, name, im, backend="triton").cpu(), ours)
        assert len(levels) == rounds and len(exact) - n_exact == (name == "IQ3_XXS")  # (only the final flip pass)
        assert len(step1) == 1 and len(considers) == n_consider
        monkeypatch.setattr(iq3, "FUSED_LEVELS", False)
        monkeypatch.setattr(iq3, "FUSED_STEP1", False)
    monkeypatch.setitem(fastpaths._LOADED, "iq3.assign", None)
    monkeypatch.setitem(fastpaths._LOADED, "iq3.exact", None)
    searches = _spy(monkeypatch, "iq3.nearest_variants")
    unfused = quantize(x, name, im, backend="triton").cpu()
    assert searches and all((c[2] is None, c[3] is None) == ((True, True) if name == "IQ3_S" else (False, c[3] is None))
                            for c in searches)
    assert torch.equal(ours, unfused)


def test_backend_argument(monkeypatch):
    """``backend`` chooses the implementation: "auto" is the CPU fast path on CPU (the compiled search), "torch" the
    reference always, an unknown name is refused; "triton" with no fast path registered is an error, not a silent
    fallback."""
    from dynaquant.quant.codecs import fastpaths, quantize

    x = torch.zeros(3, 8)
    assert lat.fast_path("lattice.nearest_codewords", x, "auto") is fastpaths.lookup("lattice.nearest_codewords", "cpu")
    assert lat.fast_path("lattice.nearest_codewords", x, "torch") is None
    assert lat.fast_path("lattice.nearest_codewords", x, "triton") is not None  # registered by dynaquant.kernels
    with pytest.raises(ValueError, match="backend"):
        lat.fast_path("lattice.nearest_codewords", x, "cuda")
    with pytest.raises(ValueError, match="backend"):
        quantize(torch.zeros(2, 256), "Q4_0", backend="fast")
    with pytest.raises(KeyError):
        fastpaths.register("lattice.no_such_search", lambda: None)
    for table in ("_LOADERS", "_LOADED", "_CPU_LOADERS", "_CPU_LOADED"):  # nothing registered
        monkeypatch.setattr(fastpaths, table, {})
    assert lat.fast_path("lattice.nearest_codewords", x, "auto") is None
    with pytest.raises(RuntimeError, match="triton"):
        lat.fast_path("lattice.nearest_codewords", x, "triton")
