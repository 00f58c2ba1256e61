"""analysis.moments.gram: the input second moments, float32 and split bfloat16."""

import pytest
import torch

from dynaquant.analysis.moments import gram


def _x(t=300, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 2, k)  # channels over four decades, as activations are
    x[:, 5] *= 30  # an outlier channel
    return x


def test_float32_path_is_the_earlier_addmm_bit_for_bit():
    x = _x()
    assert torch.equal(gram(x), torch.zeros(96, 96).addmm_(x.T, x))
    assert torch.equal(gram(x, split=False), gram(x))


def test_split_is_close_to_float64_and_far_better_than_bfloat16():
    x = _x()
    ref = (x.double().T @ x.double())
    scale = torch.sqrt(torch.diagonal(ref)[:, None] * torch.diagonal(ref)[None, :])  # |x_i| |x_j| sums
    split = gram(x, split=True)
    assert split.dtype == torch.float32 and split.shape == (96, 96)
    err = ((split.double() - ref).abs() / scale).max().item()
    hi = x.to(torch.bfloat16).float()
    err_bf16 = (((hi.T @ hi).double() - ref).abs() / scale).max().item()
    assert err < 2e-5, err  # ~2**-16 at most per product
    assert err_bf16 > 50 * err, (err_bf16, err)  # the lo terms matter: without them the error is bfloat16's
    assert ((split - split.T).abs().double() / scale).max().item() < 1e-6  # hi.T lo + lo.T hi is symmetric


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the tensor-core path)")
def test_cuda_split_matches_the_cpu_split():
    x = _x(t=512, k=256)
    ref = (x.double().T @ x.double())
    scale = torch.sqrt(torch.diagonal(ref)[:, None] * torch.diagonal(ref)[None, :])
    got = gram(x.cuda()).cpu()
    assert ((got.double() - ref).abs() / scale).max().item() < 2e-5
    assert torch.allclose(got, gram(x, split=True), rtol=1e-5, atol=1e-6 * float(scale.max()))
