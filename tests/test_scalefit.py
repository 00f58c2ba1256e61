"""The fused one-scale block search (Triton, :mod:`dynaquant.kernels.scalefit`) against its torch reference
:func:`dynaquant.quant.codecs._blockfit.fit_scale_torch`.

The kernel repeats the reference's float operations in the same order except inside the sums over a block, so a
block whose two best candidates are within rounding may keep the other one: the tests hold most blocks to
equality, every block's codes to the nearest levels under its stored scale, and the total error to the
reference's. On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first
imported); on CUDA compiled, on larger inputs.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, HAS_CUDA  # (imported before Triton: the interpreter without a GPU)

pytest.importorskip("triton")

import dynaquant.kernels  # noqa: E402,F401  (registers the kernels as the codecs' fast paths)
from dynaquant.quant.codecs import _blockfit as bf  # noqa: E402
from dynaquant.quant.codecs import dequantize, fastpaths, get_codec, quantize  # noqa: E402
from dynaquant.quant.codecs.runtime_int import _SYM_SEARCH  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _blocks(n_blocks: int, n: int, seed: int = 0):
    """(n_blocks, n) weights of mixed scales with hard cases, and their importance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, n, generator=g) * torch.exp(torch.randn(n_blocks, 1, generator=g))
    w = torch.exp(torch.randn(n_blocks, n, generator=g)) + 0.01
    x[0] = 0.0  # an all-zero block
    x[1, : n // 2] = 0.0
    x[2] = x[2].abs()  # one sign only
    x[3] *= 1e4
    x[4] *= 1e-6
    x[5, 3] = 40.0  # an outlier
    x[6] = 1.0  # ties everywhere
    return x.to(DEVICE), w.to(DEVICE)


def _int_search(bits: int):
    grid = bf.Grid(range(-(1 << (bits - 1)), 1 << (bits - 1)))
    targets, anchors = _SYM_SEARCH[bits]
    return grid, targets, anchors, 1, (-1, 1)


def _codec_search(name: str, lloyd: int | None = None, ulps=None):
    c = get_codec(name)
    return c.grid, c.targets, c.anchor_offsets, c.lloyd_steps if lloyd is None else lloyd, c.ulps if ulps is None else ulps


SEARCHES = {  # name: (block size, search arguments)
    "Q4_0": (32, lambda: _codec_search("Q4_0")),
    "Q5_0": (32, lambda: _codec_search("Q5_0")),
    "Q8_0": (32, lambda: _codec_search("Q8_0")),
    "IQ4_NL": (32, lambda: _codec_search("IQ4_NL")),
    "IQ4_XS step 1": (32, lambda: _codec_search("IQ4_XS", 2, ())),
    "INT2_G32": (32, lambda: _int_search(2)),
    "INT3_G128": (128, lambda: _int_search(3)),
    "INT4_G128": (128, lambda: _int_search(4)),
    "INT8_G64": (64, lambda: _int_search(8)),
}


def _error(x, w, grid, d, codes):
    lv = grid.level_tensor(x.device)
    return (w * (x - d.float()[:, None] * lv[codes]) ** 2).sum(1).double()


def _check_errors(e_t: torch.Tensor, e_k: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The kernel's per-block errors against the reference's: the candidates' least-squares scores carry float32
    rounding of the block's energy ``sum(w x^2)`` (the affine gain cancels terms far larger than the error), so a
    near-tie may fall either way, by at most that rounding; on average the kernel is no worse."""
    energy = (w * x * x).sum(1).double()
    bad = (~(e_k <= e_t * 1.02 + 2e-4 * energy)).nonzero().flatten().tolist()
    assert not bad, "blocks (index, reference error, kernel error, energy): " + ", ".join(
        f"({i}, {e_t[i].item():.6g}, {e_k[i].item():.6g}, {energy[i].item():.6g})" for i in bad[:8])
    floor = 1e-6 * energy + 1e-30  # (a block the reference fits exactly: a rounding of its scale away)
    ratio = (e_k + floor) / (e_t + floor)
    assert ratio.log().mean().exp() <= 1.002


def test_registered():
    from dynaquant.kernels import scalefit

    assert fastpaths.lookup("blockfit.fit_scale") is scalefit.fit_scale
    assert fastpaths.lookup("blockfit.encode_scale") is scalefit.encode_scale


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL"])
def test_encode_scale_writes_the_records(name):
    """The kernel that writes the block records itself gives, byte for byte, the records of its own search's scale
    and codes packed in torch (``pack_record``, each codec's ``pack``), and the codec takes it under ``"triton"``."""
    from dynaquant.kernels import scalefit
    from dynaquant.quant.codecs._records import pack_record

    codec = get_codec(name)
    grid, targets, anchors, lloyd, ulps = _codec_search(name)
    x, w = _blocks(192 if HAS_CUDA else 40, 32, seed=3)
    rec = scalefit.encode_scale(x, w, grid, targets, anchors, lloyd, ulps, codec.record)
    d, codes = scalefit.fit_scale(x, w, grid, targets, anchors, lloyd, ulps)
    assert rec.dtype == torch.uint8 and rec.shape == (x.shape[0], codec.format.type_size)
    assert torch.equal(rec, pack_record(codec.record, bf.half_bytes(d), codes))
    assert torch.equal(rec, codec.pack((d,), codes))
    assert torch.equal(codec.encode_blocks(x, w, backend="triton"), rec)
    assert scalefit.encode_scale(x[:0], w[:0], grid, targets, anchors, lloyd, ulps, codec.record).shape == (0, rec.shape[1])


def test_a_fast_path_that_does_not_load_is_logged(monkeypatch, caplog):
    """A loader that raises leaves the torch reference in charge (lookup gives None), and says so in the log."""
    def broken():
        raise ImportError("no module named 'triton.language'")
    monkeypatch.setattr(fastpaths, "_LOADERS", {**fastpaths._LOADERS, "blockfit.fit_scale": broken})
    monkeypatch.setattr(fastpaths, "_LOADED", {})
    with caplog.at_level("WARNING", logger=fastpaths.__name__):
        assert fastpaths.lookup("blockfit.fit_scale") is None
    assert "blockfit.fit_scale" in caplog.text and "no module named" in caplog.text


@pytest.mark.parametrize("name", list(SEARCHES))
def test_matches_reference(name):
    """Most blocks equal the reference's scale and codes; the codes are the nearest levels under the kernel's
    stored scale; no block is worse than the reference's beyond a near-tie, and the total is no worse."""
    from dynaquant.kernels import scalefit

    n, args = SEARCHES[name]
    grid, targets, anchors, lloyd, ulps = args()
    x, w = _blocks(192 if HAS_CUDA else (64 if n <= 32 else 24), n)
    d_t, c_t = bf.fit_scale_torch(x, w, grid, targets, anchors, lloyd, ulps)
    d_k, c_k = scalefit.fit_scale(x, w, grid, targets, anchors, lloyd, ulps)
    assert d_k.dtype == torch.float16 and c_k.dtype == torch.int64 and c_k.shape == x.shape
    assert torch.equal(c_k, bf.scale_codes(x, d_k, grid))
    same = (d_k == d_t) & (c_k == c_t).all(1)
    assert same.float().mean() >= 0.9, f"{(~same).sum()} of {len(same)} blocks differ"
    assert d_k[0] == 0 and (c_k[0] == grid.zero_code()).all()  # the all-zero block
    _check_errors(_error(x, w, grid, d_t, c_t), _error(x, w, grid, d_k, c_k), x, w)


def test_dispatch_and_fallback():
    """``backend="triton"`` runs the kernel on any device; a grid the kernel does not take (midpoints off the
    half-integers) runs the reference, bit for bit."""
    x, w = _blocks(16, 32, seed=1)
    grid = bf.Grid([-3.0, -1.0, 0.5, 2.0])
    for name in ("blockfit.fit_scale", "blockfit.fit_affine", "blockfit.fit_int_zero"):
        assert fastpaths.lookup(name) is not None, name
    ref = bf.fit_scale_torch(x, w, grid, [2.0, -3.0], (0,), 1, (-1, 1))
    got = bf.fit_scale(x, w, grid, [2.0, -3.0], (0,), 1, (-1, 1), backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    ref = bf.fit_affine_torch(x, w, 15, [0.0, 1.0], 2, 1, (-1, 1))  # two anchors, fp16 neighbours: the reference
    got = bf.fit_affine(x, w, 15, [0.0, 1.0], 2, 1, (-1, 1), backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    with pytest.raises(ValueError, match="backend"):
        bf.fit_scale(x, w, grid, [2.0], backend="cuda")


@pytest.mark.parametrize("name", ["Q4_1", "Q5_1"])
def test_affine_matches_reference(name):
    """``fit_affine``: as :func:`test_matches_reference`, for ``d * code + m``."""
    from dynaquant.kernels import scalefit

    c = get_codec(name)
    x, w = _blocks(192 if HAS_CUDA else 64, 32, seed=3)
    x[7] = -x[7].abs()  # one sign only, negative
    args = (c.nmax, c.steps, c.n_anchor, c.lloyd_steps, c.ulps)
    r_t, r_k = bf.fit_affine_torch(x, w, *args), scalefit.fit_affine(x, w, *args)
    d_k, m_k, q_k = r_k
    assert d_k.dtype == m_k.dtype == torch.float16 and q_k.dtype == torch.int64
    assert torch.equal(q_k, bf.affine_codes(x, d_k, m_k, c.nmax))
    same = (r_t[0] == d_k) & (r_t[1] == m_k) & (r_t[2] == q_k).all(1)
    assert same.float().mean() >= 0.9, f"{(~same).sum()} of {len(same)} blocks differ"

    def err(d, m, q):
        return (w * (x - (d.float()[:, None] * q.float() + m.float()[:, None])) ** 2).sum(1).double()

    _check_errors(err(*r_t), err(*r_k), x, w)


@pytest.mark.parametrize("bits,group", [(2, 128), (3, 32), (4, 128), (8, 64)])
def test_int_zero_matches_reference(bits, group):
    """``fit_int_zero`` (the asymmetric INT search): as :func:`test_matches_reference`, for ``d * (code - z)``."""
    from dynaquant.kernels import scalefit
    from dynaquant.quant.codecs import runtime_int as ri

    x, w = _blocks(192 if HAS_CUDA else (48 if group <= 32 else 24), group, seed=4)
    nmax = (1 << bits) - 1
    r_t = ri.fit_int_zero_torch(x, w, nmax, ri._ASYM_FACTORS[bits])
    r_k = scalefit.fit_int_zero(x, w, nmax, ri._ASYM_FACTORS[bits])
    assert r_k[0].dtype == torch.float16 and r_k[1].dtype == torch.int64
    assert (r_k[0] >= 0).all() and ((r_k[1] >= 0) & (r_k[1] <= nmax)).all()
    same = (r_t[0] == r_k[0]) & (r_t[1] == r_k[1])
    assert same.float().mean() >= 0.9, f"{(~same).sum()} of {len(same)} blocks differ"

    def err(d, z):
        c = ri.int_zero_codes(x, d, z, nmax)
        return (w * (x - d.float()[:, None] * (c - z[:, None]).float()) ** 2).sum(1).double()

    _check_errors(err(*r_t), err(*r_k), x, w)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS", "INT4_G128", "INT2_G128_ASYM"])
def test_codec_backends(name):
    """The codecs take the kernels through ``quantize(..., backend=)``: most rows' bytes equal the reference's,
    and the decoded error is no worse in total."""
    g = torch.Generator().manual_seed(2)
    rows = 8 if HAS_CUDA else 2
    x = (torch.randn(rows, 1024, generator=g) * 0.02).to(DEVICE)
    imat = (torch.exp(torch.randn(1024, generator=g)) + 0.01).to(DEVICE)
    b_t = quantize(x, name, imat, backend="torch")
    b_k = quantize(x, name, imat, backend="triton")
    e_t = (imat * (x - dequantize(b_t, name)) ** 2).sum()
    e_k = (imat * (x - dequantize(b_k, name)) ** 2).sum()
    assert e_k <= e_t * (1 + 1e-5)
    blocks = b_t.reshape(rows, -1)
    assert (blocks == b_k.reshape(rows, -1)).float().mean() >= 0.9
