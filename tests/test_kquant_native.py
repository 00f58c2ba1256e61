"""The compiled CPU K-quant searches (:mod:`dynaquant.kernels.native.kquant`, C) against their torch references in
:mod:`dynaquant.quant.codecs._kquant_search`.

The C code repeats the references' float operations in the same order and precision except the sums over a
sub-block's elements (and a super-block's sub-blocks), which it adds in order where torch vectorises; for the
whole search is C (``kquant.sym_encode`` for Q3_K and Q6_K, ``kquant.aff_encode`` for Q2_K, Q4_K and Q5_K), the
steps between the searches too. So:

* on weights and importances whose sums are exact in float32 (multiples of 1/8 and small integers, no ties in
  ``w x^2``), every step and the encoded bytes equal the reference's bit for bit;
* on random weights the steps agree to rounding (the tests of the Triton fast paths: most results equal, a near-tie
  taken the other way never costs in total), and the encoders' errors are the reference's to 1e-4.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import dynaquant.kernels  # noqa: F401  (registers the CPU fast paths)
from dynaquant.kernels import native
from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs import fastpaths, get_codec, kquants

if shutil.which(os.environ.get("CC") or "cc") is None:
    pytest.skip("no C compiler: the compiled CPU searches cannot be built here", allow_module_level=True)

from kquant_cases import KQUANTS, hard_blocks, split, step1, step2, step3  # noqa: E402
from native_cases import assert_threads_keep_bytes  # noqa: E402

from dynaquant.kernels.native import kquant as nk  # noqa: E402


def _exact_blocks(n: int, seed: int):
    """(n, 256) weights k/8 with distinct |k| in every 16 and random signs, importance 1 or 2: float32 sums of
    products exact in any order, and ``w x^2`` without ties (2 a^2 = b^2 has no integer solution)."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.stack([torch.randperm(64, generator=g)[:16] + 1 for _ in range(n * 16)]).reshape(n, 256).float()
    sign = torch.randint(0, 2, (n, 256), generator=g).float() * 2 - 1
    x = mags * sign / 8
    w = torch.randint(1, 3, (n, 256), generator=g).float()
    x[1] = x[1].abs()  # one sign only
    x[2, 100:] *= 0.125  # mixed magnitudes
    return x, w


def test_registered_as_the_cpu_fast_paths():
    for step in ("sym_search_scales", "aff_search_scales", "sym_pick", "aff_pick", "sym_refine", "aff_refine",
                 "sym_encode", "aff_encode"):
        assert fastpaths.lookup(f"kquant.{step}", "cpu") is getattr(nk, step)
        assert kqs.fast_path(f"kquant.{step}", torch.zeros(1), "auto") is getattr(nk, step)
        assert kqs.fast_path(f"kquant.{step}", torch.zeros(1), "native") is getattr(nk, step)
        assert kqs.fast_path(f"kquant.{step}", torch.zeros(1), "torch") is None


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_sums_give_the_reference_bit_for_bit(name, seed):
    """Where every sum is exact, each step's result and the encoded bytes are the torch reference's."""
    x, w = _exact_blocks(48, seed)
    codec, x3, w3 = split(name, x, w)
    sp = codec.search
    if isinstance(sp, kqs.AffSearch):
        for got, want in zip(nk.aff_search_scales(x3, w3, sp), kqs.aff_search_scales_torch(x3, w3, sp)):
            assert got.dtype == want.dtype and torch.equal(got, want)
    else:
        got, want = nk.sym_search_scales(x3, w3, sp), kqs.sym_search_scales_torch(x3, w3, sp)
        assert got.dtype == want.dtype and torch.equal(got, want)
    native_bytes = codec.encode_blocks(x, w, backend="native")
    assert torch.equal(native_bytes, codec.encode_blocks(x, w, backend="torch"))
    assert torch.equal(native_bytes, codec.encode_blocks(x, w))  # "auto" on CPU is the compiled search


def _tied_topk(first: bool):
    """``Tensor.topk`` whose ties go to the first index (``first``) or the last: the tie rule made explicit."""

    def topk(t, k, dim=-1, largest=True, sorted=True):  # noqa: A002  (Tensor.topk's own keywords)
        src = t if first else t.flip(dim)
        idx = src.sort(dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((t.gather(dim, idx if first else t.shape[dim] - 1 - idx),
                                        idx if first else t.shape[dim] - 1 - idx))

    return topk


def test_step1_ties_in_importance_take_the_first_index(monkeypatch):
    """Q6_K's step 1 puts its ``n_elem`` largest ``w x^2`` on every level; where three tie (x 1/2, 1/4, 1/8 with w
    1, 4, 16: sums exact), the compiled selection takes the first two indices, bit for bit the reference with such a
    topk, and the last two would have given other scales (so the rule is what the test sees)."""
    x, w = _exact_blocks(32, 5)
    x = (x * 0.25).clamp(-0.34375, 0.34375)  # every other w x^2 below the tie's 1/4 (w <= 2)
    for j, (xv, wv) in enumerate(((0.5, 1.0), (0.25, 4.0), (-0.125, 16.0))):
        x[:, 3 + 4 * j :: 16], w[:, 3 + 4 * j :: 16] = xv, wv
    codec, x3, w3 = split("Q6_K", x, w)
    sp = codec.search
    assert sp.n_elem == 2
    got = nk.sym_search_scales(x3, w3, sp)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", _tied_topk(True))
        want = kqs.sym_search_scales_torch(x3, w3, sp)
        m.setattr(torch.Tensor, "topk", _tied_topk(False))
        last = kqs.sym_search_scales_torch(x3, w3, sp)
    assert torch.equal(got, want)
    assert not torch.equal(got, last)


@pytest.mark.parametrize("name", KQUANTS)
def test_step1_matches_reference(name):
    """Step 1 on random weights: the continuous scales are the reference's to rounding, and where a near-tie went
    the other way the least-squares error is no worse in total."""
    codec, x3, w3 = split(name, *hard_blocks(96, 0))
    sp = codec.search
    impl = nk.aff_search_scales if isinstance(sp, kqs.AffSearch) else nk.sym_search_scales
    a_n, a_t, e_n, e_t, close = step1(sp, x3, w3, impl)
    assert a_n.shape == a_t.shape and a_n.dtype == torch.float64
    assert close.float().mean() >= 0.95, close.float().mean()
    assert e_n.sum() <= e_t.sum() * (1 + 1e-4)


@pytest.mark.parametrize("name", KQUANTS)
def test_steps_2_and_3_match_reference(name):
    """Steps 2 and 3 from the reference's step 1: the same candidate and integer scales (to ties), never a higher
    ranking error; refinement from the same configuration ends at the same configuration and error."""
    codec, x3, w3 = split(name, *hard_blocks(96, 1))
    sp = codec.search
    aff = isinstance(sp, kqs.AffSearch)
    got, want, e_got, e_want, cfg = step2(sp, x3, w3, nk.aff_pick if aff else nk.sym_pick)
    (_, r_n), (_, r_t), same_cfg = step3(sp, x3, w3, cfg, nk.aff_refine if aff else nk.sym_refine)
    assert all(g.dtype == t.dtype and g.shape == t.shape for g, t in zip(got, want))
    same = (got[0] == want[0]) & (got[-1] == want[-1]).all(-1)
    assert same.float().mean() >= 0.95, same.float().mean()
    assert (e_got <= e_want + 1e-5 * e_want.abs().clamp_min(1e-30)).all()
    assert same_cfg.float().mean() >= 0.95, same_cfg.float().mean()
    assert r_n.dtype == torch.float64 and torch.allclose(r_n, r_t, rtol=1e-5, atol=0)
    assert torch.equal(cfg.k if isinstance(cfg, kqs.SymConfig) else cfg.ks, want[-1] if len(want) == 2 else want[2])


@pytest.mark.parametrize("name", KQUANTS)
def test_encoders_error_is_the_references(name):
    """Whole encodes of random weights: the compiled search's weighted error is the reference's to 1e-4, and its
    bytes decode to the same grid (the block layout is unchanged)."""
    x, w = hard_blocks(64, 2)
    x = x[6:]  # the hard cases above weigh on totals only through their scale; here the ordinary blocks
    w = w[6:]
    codec = get_codec(name)
    b_n, b_t = codec.encode_blocks(x, w, backend="native"), codec.encode_blocks(x, w, backend="torch")
    e_n = (w * (x - codec.decode_blocks(b_n)) ** 2).sum().item()
    e_t = (w * (x - codec.decode_blocks(b_t)) ** 2).sum().item()
    assert abs(e_n - e_t) <= 1e-4 * e_t, (e_n, e_t)
    assert (b_n == b_t).all(1).float().mean() >= 0.9


@pytest.mark.parametrize("name", KQUANTS)
def test_whole_search_glue_matches_the_reference_glue(name):
    """The compiled whole search (``kquant.sym_encode`` / ``aff_encode``) against the torch glue running the same
    compiled steps: only the glue's sums differ in order, so the configurations are the same but for near-ties."""
    codec, x3, w3 = split(name, *hard_blocks(128, 4))
    sp = codec.search
    aff = isinstance(sp, kqs.AffSearch)
    got = (nk.aff_encode if aff else nk.sym_encode)(x3, w3, sp)
    want = (kqs.aff_encode_torch if aff else kqs.sym_encode_torch)(x3, w3, sp, "native")
    fields = ("d", "dmin", "ks", "km") if aff else ("d", "k")
    same = torch.ones(x3.shape[0], dtype=torch.bool)
    for f in fields:
        g, t = getattr(got, f), getattr(want, f)
        assert g.dtype == t.dtype and g.shape == t.shape, f
        same &= (g == t) if g.ndim == 1 else (g == t).all(-1)
    assert same.float().mean() >= 0.95, same.float().mean()


@pytest.mark.parametrize("name", ["Q3_K", "Q6_K"])
def test_block_bytes_are_the_torch_packing(name):
    """``kquant.sym_bytes`` (codes and packing in C) against the torch codes and ``pack``, bit for bit: searched
    configurations of hard blocks and random ones with the integer scales at both ends of their range and zeros."""
    codec = get_codec(name)
    sp = codec.search
    x, w = hard_blocks(70, 5)
    g = torch.Generator().manual_seed(6)
    k = torch.randint(sp.klo, sp.khi + 1, (70, 16), generator=g)
    k[:, 0], k[:, 1], k[:, 2] = sp.klo, sp.khi, 0
    d = kqs.f16_candidates(x.abs().amax(1) / (sp.khi * sp.qhi) * torch.rand(70, generator=g) * 3)
    searched = codec.fit_params(x, w)
    for cfg in (searched, kqs.SymConfig(d, k)):
        got = nk.sym_bytes(name, x, cfg)
        assert got.dtype == torch.uint8 and got.shape == (70, codec.format.type_size)
        assert torch.equal(got, kquants.sym_bytes_torch(name, x, cfg))
    assert torch.equal(codec.encode_blocks(x, w), kquants.sym_bytes_torch(name, x, searched))  # "auto": the C bytes
    assert fastpaths.lookup("kquant.sym_bytes", "cpu") is nk.sym_bytes


def test_block_bytes_only_for_the_symmetric_types():
    x = torch.randn(2, 256)
    cfg = kqs.SymConfig(torch.ones(2), torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="Q4_K"):
        nk.sym_bytes("Q4_K", x, cfg)
    with pytest.raises(ValueError, match="Q4_K"):
        kquants.sym_bytes_torch("Q4_K", x, cfg)
    with pytest.raises(ValueError, match=r"\(3, 256\)"):
        nk.sym_bytes("Q6_K", torch.randn(3, 256), cfg)


def test_threads_do_not_change_the_bytes():
    assert_threads_keep_bytes(get_codec("Q4_K"), *hard_blocks(300, 3))


def test_shape_errors_name_the_shape():
    with pytest.raises(ValueError, match="sub_size"):
        nk.sym_search_scales(torch.zeros(2, 4, 64), torch.ones(2, 4, 64), get_codec("Q6_K").search)


def test_without_a_compiler_the_reference_runs(fresh_registry, monkeypatch, tmp_path, caplog):
    """No C compiler (and no library built for this one): the loader fails, the registry logs it once and the
    codecs run their torch references."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert fastpaths.lookup("kquant.sym_pick", "cpu") is None
    assert "no C compiler" in caplog.text
    x, w = hard_blocks(8, 4)
    codec = get_codec("Q6_K")
    assert torch.equal(codec.encode_blocks(x, w), codec.encode_blocks(x, w, backend="torch"))
    with pytest.raises(RuntimeError, match="native"):
        kqs.fast_path("kquant.sym_pick", x, "native")


def test_switched_off_by_the_environment(fresh_registry, monkeypatch):
    monkeypatch.setenv("DYNAQUANT_NATIVE", "0")
    assert fastpaths.lookup("kquant.aff_pick", "cpu") is None


def test_built_once_into_the_cache(fresh_registry, monkeypatch, tmp_path):
    """The library is built into CACHE/native/<key>/ under a temporary name and renamed; a second process (here:
    the cleared cache of loaded libraries) finds it there instead of compiling again."""
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path))
    lib = native.library("kquant_search")
    built = list((tmp_path / "native").glob("*/kquant_search.so"))
    assert len(built) == 1 and lib._name == str(built[0])
    assert not list((tmp_path / "native").glob("*/*.tmp"))
    mtime = built[0].stat().st_mtime_ns
    native.library.cache_clear()
    def no_build(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(native, "_compile", no_build)
    assert native.library("kquant_search")._name == str(built[0]) and built[0].stat().st_mtime_ns == mtime


def test_an_unwritable_cache_builds_in_the_temporary_folder(fresh_registry, monkeypatch, tmp_path):
    """A cache folder that cannot be created (here: under a file) does not stop the build: the library goes to the
    temporary folder instead."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    lib = native.library("kquant_search")
    assert lib._name.startswith(str(tmp_path / "tmp" / f"dynaquant-native-{os.getuid()}"))
