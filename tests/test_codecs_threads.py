"""CPU encoding in chunks on threads of their own (``dynaquant.quant.codecs.base.for_each_chunk``).

The bytes must not depend on the thread count (the chunks are a function of the shape; a ``cross_block``
codec keeps its 1M-weight chunks), torch's thread count is restored, and a chunk's error reaches the caller.
"""

from __future__ import annotations

import pytest
import torch

from dynaquant.quant.codecs import base, get_codec, quantize

FORMATS = ["Q8_0", "Q4_1", "Q5_0", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ2_XXS", "IQ1_M", "MXFP4",
           "INT4_G128", "NVFP4_G16"]


@pytest.fixture
def weight():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(24, 2048, generator=gen) * 0.02
    x[3, 100] = 0.9  # an outlier in one chunk only
    return x, torch.rand(2048, generator=gen) + 0.05


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_do_not_depend_on_threads(fmt, weight, monkeypatch):
    """Chunks run on two threads or one give the same bytes: the chunks are a function of the shape only."""
    x, im = weight
    old = torch.get_num_threads()
    got = {}
    try:
        for rows in (24, 12):  # one chunk; two chunks of 12 rows, one a thread
            monkeypatch.setattr(base, "CPU_CHUNK_WEIGHTS", rows * 2048)
            for threads in (2, 1):
                torch.set_num_threads(threads)
                got[rows, threads] = quantize(x, fmt, im)
                assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got[24, 2], got[24, 1]) and torch.equal(got[12, 2], got[12, 1])
    if fmt == "NVFP4_G16":  # cross_block: never cut below 1M weights, so its global scale is the tensor's
        assert torch.equal(got[24, 1], got[12, 1])


def test_chunk_sizes():
    assert base.chunk_weights("cpu") == base.CPU_CHUNK_WEIGHTS  # whatever the thread count: the same bytes everywhere
    assert base.chunk_weights("cpu", large=True) == base.CHUNK_WEIGHTS
    assert get_codec("NVFP4_G16").cross_block and not get_codec("Q4_K").cross_block


def test_chunk_error_reaches_the_caller_and_threads_restored(weight, monkeypatch):
    x, im = weight
    codec = get_codec("Q8_0")
    calls = []

    def failing(xb, wb, **opts):  # (Q8_0 has fast paths: quantize passes backend= and variant=)
        calls.append(xb.shape[0])
        if len(calls) == 2:
            raise RuntimeError("chunk failed")
        return type(codec).encode_blocks(codec, xb, wb, **opts)

    monkeypatch.setattr(codec, "encode_blocks", failing)
    monkeypatch.setattr(base, "CPU_CHUNK_WEIGHTS", 12 * 2048)  # two chunks
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="chunk failed"):
            quantize(x, "Q8_0", im)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("fmt", ["Q8_0", "MXFP4", "Q4_K", "F16"])
def test_a_bfloat16_weight_is_converted_a_chunk_at_a_time(fmt, weight, monkeypatch):
    """A bfloat16 weight, converted to float32 in the chunk workers, gives the bytes of its float32 copy (several
    chunks on two threads); an imatrix with unseen (zero) columns is floored as before, at 1e-3 of its smallest
    positive entry."""
    x, im = weight
    im = im.clone()
    im[::5] = 0.0
    xb = x.to(torch.bfloat16)
    monkeypatch.setattr(base, "CPU_CHUNK_WEIGHTS", 5 * 2048)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(quantize(xb, fmt, im), quantize(xb.float(), fmt, im))
    finally:
        torch.set_num_threads(old)
    floored = base.block_importance(im, 1, 2048, "cpu")[0]
    assert torch.equal(floored, im.clamp_min(im[im > 0].min() * 1e-3))


def test_the_setup_runs_on_one_intra_op_thread(weight, monkeypatch):
    """The imatrix's floor and repeat before the chunks run with torch's intra-op threads at one (an OpenMP team
    started there spins on the chunk workers' cores), and the thread count is restored after."""
    x, im = weight
    seen = []
    real = base.block_importance

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "block_importance", spy)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        quantize(x, "Q8_0", im)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
