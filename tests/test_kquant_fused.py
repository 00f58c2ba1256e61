"""The fused K-quant scale searches (Triton, :mod:`dynaquant.kernels.kquant_search`) against their
torch references in :mod:`dynaquant.quant.codecs._kquant_search`.

Each step's kernel repeats the reference's float operations in the same order except inside the
sums over a sub-block, so results agree to rounding: a candidate that wins in one may lose by a
rounding to a tie in the other, and step 1's refits may then settle on another optimum nearby.
The tests hold each step to the reference's own objective (the kernel's choice no worse than
the reference's beyond rounding, in total) and most results to equality. On CPU the kernels
run in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported); on
CUDA compiled, on larger inputs.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, HAS_CUDA  # (imported before Triton: the interpreter without a GPU)

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kquant_cases import (  # noqa: E402
    KQUANTS,
    clip_pick_inputs,
    hard_blocks,
    outlier_blocks,
    split,
    step1,
    step2,
    step3,
    two_level_blocks,
)

import dynaquant.kernels  # noqa: E402,F401  (registers the kernels as the codecs' fast paths)
from dynaquant.kernels.kquant_sym_triton import tree16  # noqa: E402
from dynaquant.kernels.kquant_triton import round_clamp, round_clamp_low  # noqa: E402
from dynaquant.quant.codecs import _kquant_search as kqs  # noqa: E402
from dynaquant.quant.codecs import dequantize, fastpaths, get_codec, quantize  # noqa: E402

N_SUPER = 96 if HAS_CUDA else 12


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@triton.jit
def _tree16_rows(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(out_ptr + tl.arange(0, N), tree16(tl.load(x_ptr + offs), N))


@triton.jit
def _both_roundings(x_ptr, a_ptr, b_ptr, n, LO: tl.constexpr, HI: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(a_ptr + i, round_clamp(v, LO, HI), mask=i < n)
    tl.store(b_ptr + i, round_clamp_low(v, LO, HI), mask=i < n)


def _blocks(n: int, seed: int = 0):
    return hard_blocks(n, seed, DEVICE)


@pytest.mark.parametrize("name", KQUANTS)
def test_step1_matches_reference(name):
    """Step 1: the kernel's continuous scales are the reference's to rounding, and where they
    differ its least-squares error is no worse (a tie broken the other way)."""
    from dynaquant.kernels import kquant_search as ks

    codec, x3, w3 = split(name, *_blocks(N_SUPER))
    sp = codec.search
    impl = ks.aff_search_scales if isinstance(sp, kqs.AffSearch) else ks.sym_search_scales
    a_f, a_t, e_f, e_t, close = step1(sp, x3, w3, impl)
    assert a_f.dtype == torch.float64 and a_f.shape == a_t.shape
    assert close.float().mean() >= 0.9, close.float().mean()
    # a near-tie taken the other way can lead the refits to another nearby optimum: never far
    # from the reference's on any sub-block, and no worse in total
    scale = e_t.amax(-1, keepdim=True).clamp_min(1e-30)
    assert ((e_f - e_t) / scale).max() <= 2e-3
    assert e_f.sum() <= e_t.sum() * (1 + 1e-4)


@pytest.mark.parametrize("name", KQUANTS)
def test_steps_2_and_3_match_reference(name):
    """Steps 2 and 3 on the same inputs: the same candidate and sub-scales as the reference's
    (to ties), never a higher error."""
    codec, x3, w3 = split(name, *_blocks(N_SUPER, seed=1))
    sp = codec.search
    pick = fastpaths.lookup("kquant.aff_pick" if isinstance(sp, kqs.AffSearch) else "kquant.sym_pick")
    refine = fastpaths.lookup("kquant.aff_refine" if isinstance(sp, kqs.AffSearch) else "kquant.sym_refine")
    assert pick is not None and refine is not None
    got, want, e_got, e_want, cfg = step2(sp, x3, w3, pick)
    assert all(g.dtype == t.dtype and g.shape == t.shape for g, t in zip(got, want))
    same = (got[0] == want[0]) & (got[-1] == want[-1]).all(-1)
    assert same.float().mean() >= 0.95, same.float().mean()
    assert (e_got <= e_want + 1e-5 * e_want.abs().clamp_min(1e-30)).all()
    # step 3 from the reference's step-2 configuration
    (c_got, err_got), (c_want, err_want), same = step3(sp, x3, w3, cfg, refine)
    assert err_got.dtype == torch.float64 and err_got.shape == (x3.shape[0],)
    assert same.float().mean() >= 0.95, same.float().mean()
    assert torch.allclose(err_got[same], err_want[same], rtol=1e-5, atol=1e-30)
    assert (err_got <= err_want * (1 + 1e-4) + 1e-30).all()


def test_clip_step_pick_matches_reference():
    """Q3_K's clip steps (``sym_pick_kernel`` with ``CLIP``: a clamped sub-block's exact error) on blocks with a
    low-importance outlier sub-block, where those errors decide: the reference's candidate and integer scales but for
    near-ties, never a higher ranking error."""
    from dynaquant.kernels import kquant_search as ks

    codec, x3, w3 = split("Q3_K", *outlier_blocks(N_SUPER, 2, DEVICE))
    args = clip_pick_inputs(codec.search, x3, w3)
    (d_f, k_f), (d_t, k_t) = ks.sym_pick(*args), kqs.sym_pick_torch(*args)
    assert d_f.dtype == torch.float32 and k_f.dtype == torch.int64 and k_f.shape == k_t.shape
    same = (d_f == d_t) & (k_f == k_t).all(-1)
    assert same.float().mean() >= 0.9, same.float().mean()
    cand = args[5]
    e = kqs.sym_clip_error(*args[:5], cand, torch.ones_like(cand, dtype=torch.bool))
    quad = kqs.sym_eval_error(args[2], args[3], codec.search.klo, codec.search.khi, cand)

    def err(d, e):
        return e.gather(1, (cand == d[:, None]).float().argmax(1, keepdim=True))[:, 0]

    assert (err(d_f, e) <= err(d_t, e) * (1 + 1e-5)).all()
    assert (err(d_t, e) < err(d_t, quad)).float().mean() >= 0.5  # the exact errors decided most picks


@pytest.mark.parametrize("name", KQUANTS)
def test_encode_matches_reference(name):
    """The whole encoder with the kernels (backend="triton") against the torch search: mostly the
    same bytes and the same weighted error to rounding; the bytes decode as gguf-py does."""
    x, w = _blocks(N_SUPER, seed=2)
    codec = get_codec(name)
    b_t = codec.encode_blocks(x, w, backend="torch")
    b_f = codec.encode_blocks(x, w, backend="triton")
    assert b_f.dtype == torch.uint8 and b_f.shape == b_t.shape
    assert (b_f == b_t).all(1).float().mean() >= 0.8
    e_t = (w * (x - codec.decode_blocks(b_t)) ** 2).sum().item()
    e_f = (w * (x - codec.decode_blocks(b_f)) ** 2).sum().item()
    assert e_f <= e_t * (1 + 1e-4)
    assert b_f.shape == (N_SUPER, codec.format.type_size)
    assert torch.isfinite(dequantize(b_f, name)).all()


def test_q2k_two_level_sub_blocks_encode_as_the_reference():
    """Q2_K on all-negative blocks with one outlier (a sub-block whose step-1 fits tie at any code spacing, as in
    tests/test_codecs_kquants.py ``test_device``): the kernels (backend="triton"), the torch search and the compiled
    one agree, same bytes and errors. Before ``AffSearch.widen`` the tie went either way by rounding, and the wide
    spacing set the super-block's scale: 5925 (triton) against 3941 (torch) and 4764 (compiled) here, 13% apart on
    CUDA in ``test_device``."""
    x, w = two_level_blocks(N_SUPER, 0, DEVICE)
    codec = get_codec("Q2_K")
    b = {be: codec.encode_blocks(x, w, backend=be) for be in ("triton", "torch")}
    if not HAS_CUDA:
        b["native"] = codec.encode_blocks(x, w, backend="native")
    e = {be: (w * (x - codec.decode_blocks(v)) ** 2).sum().item() for be, v in b.items()}
    for be, v in b.items():
        assert (v == b["torch"]).all(1).float().mean() >= 0.9, be
        assert abs(e[be] - e["torch"]) <= 1e-4 * e["torch"], e


def test_auto_runs_kernels_only_on_cuda(monkeypatch):
    """``backend="auto"`` runs the kernels on CUDA tensors only; ``"torch"`` never."""
    calls = []
    real = fastpaths.lookup("kquant.aff_search_scales")

    def spy(*a, **k):
        calls.append(a[0].device.type)
        return real(*a, **k)

    monkeypatch.setitem(fastpaths._LOADED, "kquant.aff_search_scales", spy)
    x, w = _blocks(8, seed=3)
    quantize(x.cpu(), "Q4_K", None)
    get_codec("Q4_K").encode_blocks(x, w, backend="torch")
    assert calls == []
    get_codec("Q4_K").encode_blocks(x, w, backend="triton")
    assert calls == [DEVICE]
    if HAS_CUDA:
        quantize(x, "Q4_K", None)
        assert calls[-1] == "cuda"


def test_bad_shapes_raise():
    from dynaquant.kernels import kquant_search as ks

    x = torch.zeros(2, 8, 30)
    with pytest.raises(ValueError, match="powers of two"):
        ks.aff_search_scales(x, x, get_codec("Q4_K").search)
    with pytest.raises(ValueError, match="n_super, n_sub, sub_size"):
        ks.sym_search_scales(x[0], x[0], get_codec("Q6_K").search)


@pytest.mark.parametrize(("qlo", "qhi", "sub"), [(-4, 3, 16), (-2, 1, 16), (-4, 3, 8), (-3, 2, 16)])
def test_breakpoints_sorted_in_registers_equal_the_torch_sort(qlo, qhi, sub):
    """Q3_K's exhaustive step 1: the kernel's sorted breakpoints are the reference's exactly (the same products;
    zeros, ties and a partial last tile included); a count that is not a power of two (3 levels) takes the torch
    sort."""
    from dynaquant.kernels import kquant_search as ks

    g = torch.Generator().manual_seed(3)
    x = torch.randn(203, sub, generator=g)
    x[0] = 0.0
    x[1, ::2] = 0.0
    x[2] = x[2, :1]  # ties everywhere in one row
    x = x.to(DEVICE)
    got = ks.sym_breakpoints(x, qlo, qhi)
    want = kqs.exhaustive_breakpoints(x, qlo, qhi)
    assert got.shape == (203, sub * max(-qlo, qhi))
    assert torch.equal(got, want)
    assert torch.equal(want[:, 1:] >= want[:, :-1], torch.ones_like(want[:, 1:], dtype=torch.bool))


def test_pick_with_eight_sub_blocks_as_iq4_xs_uses_it():
    """IQ4_XS's step 2 is the K-quants' symmetric pick over 8 sub-blocks of 32 (integer scales -32..31, 136
    candidates): the kernel picks the reference's candidate, or one of equal ranking error to rounding."""
    from dynaquant.kernels import kquant_search as ks
    from dynaquant.quant.codecs.iq4 import IQ4_XS

    g = torch.Generator().manual_seed(5)
    n = 64 if HAS_CUDA else 24
    a = (torch.randn(n, 8, generator=g) * torch.rand(n, 1, generator=g) * 3).to(DEVICE)
    sqq = (torch.rand(n, 8, generator=g) * 50 + 0.1).to(DEVICE)
    a[0] = 0.0  # an all-zero block
    am = a.double().gather(1, a.abs().argmax(1, keepdim=True))
    ts = torch.tensor(IQ4_XS.d_steps, dtype=torch.float64, device=DEVICE)
    cand = kqs.f16_candidates(torch.cat([am / ts, -am / ts], 1))
    x3 = torch.randn(n, 8, 32, generator=g).to(DEVICE)  # (read only by clip candidates)
    spec = IQ4_XS._pick_spec
    got, want = ks.sym_pick(x3, x3.abs(), a, sqq, spec, cand), kqs.sym_pick_torch(x3, x3.abs(), a, sqq, spec, cand)
    e_got = kqs.sym_eval_error(a, sqq, -32, 31, got[0][:, None])[:, 0]
    e_want = kqs.sym_eval_error(a, sqq, -32, 31, want[0][:, None])[:, 0]
    same = (got[0] == want[0]) & (got[1] == want[1]).all(1)
    assert same.float().mean() >= 0.95
    assert torch.all(e_got <= e_want * (1 + 1e-5) + 1e-12)


@pytest.mark.parametrize("name", ["Q3_K", "Q6_K"])
def test_fused_sym_encode_matches_the_step_kernels(name):
    """``kquant.sym_encode`` (the glue between the step kernels fused) gives the configurations of
    ``sym_encode_torch`` with the step kernels: bit for bit where torch sums in the fused kernels' order (CUDA); on CPU
    torch's sums may differ in the last bit, so nearly every block and the same error to rounding."""
    from dynaquant.kernels import kquant_search as ks

    x, w = _blocks(N_SUPER, seed=4)
    sp = get_codec(name).search
    x3, w3 = x.reshape(-1, 16, 16), w.reshape(-1, 16, 16)
    got, want = ks.sym_encode(x3, w3, sp), kqs.sym_encode_torch(x3, w3, sp, "triton")
    same = (got.d == want.d) & (got.k == want.k).all(1)
    assert same.float().mean() >= (1.0 if HAS_CUDA else 0.9)

    def err(c):
        dl = c.sub_scales()
        return kqs.sym_error(x3, w3, dl, kqs.sym_codes(x3, dl, sp.qlo, sp.qhi)).sum()

    assert err(got) <= err(want) * (1 + 1e-6)
    assert got.k.dtype == torch.int64 and got.d.dtype == torch.float32


@pytest.mark.parametrize("name", ["Q3_K", "Q6_K"])
def test_sym_bytes_kernel_equals_the_torch_packing(name):
    """``kquant.sym_bytes`` on the search's configurations and on random ones (every integer scale, a zero ``d``):
    the bytes of ``sym_bytes_torch``, exactly."""
    from dynaquant.kernels import kquant_search as ks
    from dynaquant.quant.codecs.kquants import sym_bytes_torch

    x, w = _blocks(N_SUPER, seed=5)
    codec = get_codec(name)
    cfg = codec.fit_params(x, w, backend="triton")
    assert torch.equal(ks.sym_bytes(name, x, cfg), sym_bytes_torch(name, x, cfg))
    g = torch.Generator().manual_seed(6)
    sp = codec.search
    k = torch.randint(sp.klo, sp.khi + 1, (N_SUPER, 16), generator=g).to(DEVICE)
    d = kqs.f16_candidates(torch.rand(N_SUPER, generator=g).to(DEVICE) * 0.01)
    d[0] = 0
    cfg = kqs.SymConfig(d, k)
    assert torch.equal(ks.sym_bytes(name, x, cfg), sym_bytes_torch(name, x, cfg))
    with pytest.raises(ValueError):
        ks.sym_bytes("Q4_K", x, cfg)


def test_tree16_sums_in_torch_cuda_order():
    """The fused kernels' sums over 16: ``0 + v`` then lanes 8, 4, 2, 1 apart added (``Reduce.cuh``'s shuffle-down
    tree), float32 and float64; values chosen so that another order gives another sum."""
    g = torch.Generator().manual_seed(7)
    for dt in (torch.float32, torch.float64):
        v = (torch.randn(64, 16, generator=g, dtype=dt) * torch.logspace(0, 12, 16, dtype=dt)).to(DEVICE)
        want = v + 0.0
        for h in (8, 4, 2, 1):
            want = want[:, :h] + want[:, h : 2 * h]
        out = torch.empty(64, dtype=dt, device=DEVICE)
        _tree16_rows[(1,)](v, out, N=64)
        assert torch.equal(out, want[:, 0])
        seq = v.cumsum(1)[:, -1]
        assert not torch.equal(out, seq)  # the data tells the orders apart


def test_round_clamp_low_equals_round_clamp():
    """``round_clamp_low`` (step 1's rounding in 4 operations) gives ``round_clamp``'s value on ties, the range
    edges, large values and infinities."""
    edge = [-0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -3.5, -4.5, -5.0, 3.49, 3.5, 4.5, 31.5, -32.5, 2.0**22, 2.0**23 + 1,
            -(2.0**24), 1e30, -1e30, float("inf"), float("-inf")]
    g = torch.Generator().manual_seed(8)
    v = torch.cat([torch.tensor(edge), torch.randn(1000, generator=g) * 40]).to(DEVICE)
    for lo, hi in ((-4, 3), (-32, 31)):
        a, b = torch.empty_like(v), torch.empty_like(v)
        _both_roundings[(1,)](v, a, b, v.numel(), LO=lo, HI=hi, BLOCK=2048)
        assert torch.equal(a, b)
        assert torch.equal(a, v.round().clamp(lo, hi))
