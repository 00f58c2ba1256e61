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

import dynaquant.kernels  # noqa: E402,F401  (registers the kernels as the codecs' fast paths)
from dynaquant.quant.codecs import _kquant_search as kqs  # noqa: E402
from dynaquant.quant.codecs import dequantize, fastpaths, get_codec, quantize  # noqa: E402

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
N_SUPER = 96 if HAS_CUDA else 12


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _blocks(n: int, seed: int = 0):
    """(n, 256) weights of mixed scales with hard cases, and their importance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 256, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    w = torch.exp(torch.randn(n, 256, generator=g)) + 0.01
    x[0] = 0.0  # an all-zero block
    x[1, :100] = 0.0  # zero sub-blocks
    x[2] = x[2].abs()  # one sign only
    x[3] *= 1e4
    x[4] *= 1e-6
    x[5, 7] = 40.0  # an outlier
    return x.to(DEVICE), w.to(DEVICE)


def _split(name, x, w):
    codec = get_codec(name)
    n = x.shape[0]
    return codec, x.reshape(n, codec.n_sub, -1), w.reshape(n, codec.n_sub, -1)


def _sub_error(x3, w3, codes_fn):
    return ((w3 * (x3 - codes_fn()) ** 2).sum(-1)).double()


@pytest.mark.parametrize("name", KQUANTS)
def test_step1_matches_reference(name):
    """Step 1: the kernel's continuous scales are the reference's to rounding, and where they
    differ its least-squares error is no worse (a tie broken the other way)."""
    from dynaquant.kernels import kquant_search as ks

    codec, x3, w3 = _split(name, *_blocks(N_SUPER))
    sp = codec.search
    if isinstance(sp, kqs.AffSearch):
        a_t, b_t = kqs.aff_search_scales_torch(x3, w3, sp)
        a_f, b_f = ks.aff_search_scales(x3, w3, sp)

        def err(a, b):  # least-squares error of x ~ a q + b with the nearest codes
            q = kqs.aff_codes(x3, a.float(), (-b).float(), sp.qmax)
            return _sub_error(x3, w3, lambda: a.float().unsqueeze(-1) * q + b.float().unsqueeze(-1))

        e_t, e_f = err(a_t, b_t), err(a_f, b_f)
        close = torch.isclose(a_f, a_t, rtol=1e-5, atol=0) & torch.isclose(b_f, b_t, rtol=1e-5, atol=1e-30)
    else:
        a_t = kqs.sym_search_scales_torch(x3, w3, sp)
        a_f = ks.sym_search_scales(x3, w3, sp)

        def err(a):
            return _sub_error(x3, w3, lambda: a.float().unsqueeze(-1) * kqs.sym_codes(x3, a.float(), sp.qlo, sp.qhi))

        e_t, e_f = err(a_t), err(a_f)
        close = torch.isclose(a_f, a_t, rtol=1e-5, atol=0)
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
    codec, x3, w3 = _split(name, *_blocks(N_SUPER, seed=1))
    sp = codec.search
    pick = fastpaths.lookup("kquant.aff_pick" if isinstance(sp, kqs.AffSearch) else "kquant.sym_pick")
    refine = fastpaths.lookup("kquant.aff_refine" if isinstance(sp, kqs.AffSearch) else "kquant.sym_refine")
    assert pick is not None and refine is not None
    if isinstance(sp, kqs.AffSearch):
        a, b = kqs.aff_search_scales_torch(x3, w3, sp)
        q = kqs.aff_codes(x3, a.float(), (-b).float(), sp.qmax)
        wx = w3 * x3
        sw, sx = w3.sum(-1).double(), wx.sum(-1).double()
        ts = torch.tensor(sp.d_steps, dtype=torch.float32, device=x3.device)
        ref, dc, mc, _ = kqs.aff_round_candidates(w3, wx, q, sw, sx, ts, sp.kmax, None)
        got = pick(ref, sp.kmax, dc, mc)
        want = kqs.aff_pick_torch(ref, sp.kmax, dc, mc)
        e_got = kqs.aff_eval_error(ref, sp.kmax, got[0][:, None], got[1][:, None])[:, 0]
        e_want = kqs.aff_eval_error(ref, sp.kmax, want[0][:, None], want[1][:, None])[:, 0]
        cfg = kqs.AffConfig(*want)
    else:
        a = kqs.sym_search_scales_torch(x3, w3, sp)
        q = kqs.sym_codes(x3, a.float(), sp.qlo, sp.qhi)
        sxq, sqq = (w3 * x3 * q).sum(-1).double(), (w3 * q * q).sum(-1).double()
        a = kqs.safe_div(sxq, sqq)
        am = a.gather(1, a.abs().argmax(1, keepdim=True))
        ts = torch.tensor(sp.d_steps, dtype=torch.float64, device=x3.device)
        cand = kqs.f16_candidates(torch.cat([am / ts, -am / ts], 1))
        got = pick(a.float(), sqq.float(), sp.klo, sp.khi, cand)
        want = kqs.sym_pick_torch(a.float(), sqq.float(), sp.klo, sp.khi, cand)
        e_got = kqs.sym_eval_error(a.float(), sqq.float(), sp.klo, sp.khi, got[0][:, None])[:, 0]
        e_want = kqs.sym_eval_error(a.float(), sqq.float(), sp.klo, sp.khi, want[0][:, None])[:, 0]
        cfg = kqs.SymConfig(*want)
    assert all(g.dtype == t.dtype and g.shape == t.shape for g, t in zip(got, want))
    same = (got[0] == want[0]) & (got[-1] == want[-1]).all(-1)
    assert same.float().mean() >= 0.95, same.float().mean()
    assert (e_got <= e_want + 1e-5 * e_want.abs().clamp_min(1e-30)).all()
    # step 3 from the reference's step-2 configuration
    if isinstance(sp, kqs.AffSearch):
        (c_got, err_got), (c_want, err_want) = refine(x3, w3, cfg, sp), kqs.aff_refine_torch(x3, w3, cfg, sp)
        same = (c_got.ks == c_want.ks).all(-1) & (c_got.km == c_want.km).all(-1)
    else:
        (c_got, err_got), (c_want, err_want) = refine(x3, w3, cfg, sp), kqs.sym_refine_torch(x3, w3, cfg, sp)
        same = (c_got.k == c_want.k).all(-1)
    assert err_got.dtype == torch.float64 and err_got.shape == (x3.shape[0],)
    assert same.float().mean() >= 0.95, same.float().mean()
    assert torch.allclose(err_got[same], err_want[same], rtol=1e-5, atol=1e-30)
    assert (err_got <= err_want * (1 + 1e-4) + 1e-30).all()


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
