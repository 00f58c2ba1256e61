"""GPTQ's column loop of a block in one Triton launch (:mod:`dynaquant.kernels.gptq_block`, the fast path
``gptq.round_block``) against its torch reference :func:`dynaquant.quant.gptq.round_block_torch`.

The kernel repeats the reference's float operations element for element; on CPU it runs in Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is first imported), where every byte and value must be equal. On CUDA
(compiled) torch's own kernels may contract a multiply-add the kernel does not, so a near-tie may round the other
way: there the tests hold the bytes to their decode and the layer-output error to the reference's.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE  # (imported before Triton: the interpreter without a GPU)

pytest.importorskip("triton")

import dynaquant.kernels  # noqa: E402,F401  (registers the kernels as fast paths)
from dynaquant.quant.codecs import dequantize, fastpaths, get_codec  # noqa: E402
from dynaquant.quant.codecs.base import ColumnGrid, LevelGrid  # noqa: E402
from dynaquant.quant.gptq import gptq_round, output_error, round_block_torch  # noqa: E402

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # ColumnGrid
LEVELS = ["Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS"]  # LevelGrid: linear (a scale a block), kvalues (IQ4_XS: a column)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _problem(n: int, k: int, seed: int):
    """(n, k) weight with row scales, a zero row and a zero sub-block; H from correlated inputs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    w[1] = 0
    w[2, 32:64] = 0
    x = torch.randn(4 * k, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k ** 0.5)
    return w.to(DEVICE), (x.T @ x / x.shape[0]).to(DEVICE)


def test_registered():
    from dynaquant.kernels import gptq_block

    assert fastpaths.lookup("gptq.round_block") is gptq_block.round_block


@pytest.mark.parametrize("fmt", KQUANTS + LEVELS)
def test_block_equals_the_column_loop(fmt):
    """One block: codes, values, errors and the updated later columns of the batch, as the torch loop gives them
    (bit for bit in the interpreter), with the columns in a permuted (act-order) order and a partial row tile."""
    from dynaquant.kernels.gptq_block import round_block

    codec = get_codec(fmt)
    n, b = 37, 512
    w, h = _problem(n, b, seed=1)
    damped = h.double() + 0.1 * torch.eye(b, device=DEVICE, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True).float()
    assert u.stride(1) != 1  # (column-major, as GPTQ's factor is: the kernel takes any strides)
    bs = codec.format.block_size
    local = torch.randperm(bs, generator=torch.Generator().manual_seed(2)).tolist()
    grid = codec.column_rounder(codec.fit_params(w[:, :bs].contiguous(), torch.ones(n, bs, device=DEVICE)))
    assert isinstance(grid, ColumnGrid if fmt in KQUANTS else LevelGrid)
    w_ref, w_ker = w.clone(), w.clone()
    ref = round_block_torch(w_ref, u, grid, 0, local)
    ker = round_block(w_ker, u, grid, 0, local)
    if DEVICE == "cpu":
        for a, r in zip(ker, ref):
            assert a.dtype == r.dtype and torch.equal(a, r)
        assert torch.equal(w_ker, w_ref)  # the later columns updated alike (the block's own left as they were)
    else:
        assert (ker[0] == ref[0]).float().mean() > 0.99
        torch.testing.assert_close(w_ker, w_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
@pytest.mark.parametrize("fmt", KQUANTS + LEVELS)
def test_gptq_with_the_kernel(fmt, act_order):
    """Whole GPTQ (two batches of one block each) with the kernel: the same bytes and values as the torch loop in
    the interpreter; natively bytes that decode to the values, and the layer-output error of the torch loop's."""
    w, h = _problem(24, 512, seed=3)
    ref = gptq_round(w, fmt, h, act_order=act_order, backend="torch")
    got = gptq_round(w, fmt, h, act_order=act_order, backend="triton")
    assert torch.equal(dequantize(got.data, fmt).to(got.decoded.device).reshape(got.decoded.shape), got.decoded)
    if DEVICE == "cpu":
        assert torch.equal(got.data, ref.data) and torch.equal(got.decoded, ref.decoded)
    else:
        assert output_error(w, got.decoded, h) <= 1.01 * output_error(w, ref.decoded, h)


def test_refuses_a_rounder_that_is_not_a_grid():
    from dynaquant.kernels.gptq_block import round_block

    w = torch.zeros(4, 256, device=DEVICE)
    with pytest.raises(TypeError, match="ColumnGrid or LevelGrid"):
        round_block(w, torch.eye(256, device=DEVICE), lambda x, j: (x, x), 0, [0])
