"""The compiled CPU one-scale block search (:mod:`dynaquant.kernels.native.blockfit`, C) against its torch reference
:func:`dynaquant.quant.codecs._blockfit.fit_scale_torch` (Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS's sub-blocks).

The C code repeats the reference's float32 operations in its order except the sums over a block's elements (added
in element order), and rounds scales to float16 with its own round-to-nearest-even: where the sums are exact the
bytes are the reference's bit for bit, including scales in float16's subnormal range; elsewhere they agree to
rounding.
"""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch
from native_cases import assert_threads_keep_bytes

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


RECORD_TYPES = ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4", "MXFP4_G32", "NVFP4"]


def _random_blocks(n: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, m) weights with lognormal block scales, an all-zero block, a zero sub-block and an outlier; importance > 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[n // 2] = 0.0
    x[n // 3, :16] = 0.0
    x[-1, 3] = 40.0
    return x, torch.exp(torch.randn(n, m, generator=g)) + 0.01


@pytest.mark.parametrize("name", RECORD_TYPES)
def test_records_as_data_write_the_codecs_pack(name):
    """The record description (``_records.pack_record``, the fused writer's reference) writes the codec's own ``pack``
    of the same parameters and codes, byte for byte."""
    from dynaquant.quant.codecs._blockfit import half_bytes
    from dynaquant.quant.codecs._records import pack_record

    codec = get_codec(name)
    x, w = _random_blocks(37, codec.format.block_size, 8)
    params = codec.fit_params(x, w, backend="torch")
    codes, _ = codec.round_to_grid(x, params)
    s = params[0]
    scale = half_bytes(s) if s.dtype == torch.float16 else s.to(torch.uint8).reshape(-1, 1)
    sub = codec.record.sub_blocks
    level_idx = codes if codec.record.code_map is None else _level_indices(codec, codes)
    got = pack_record(codec.record, scale, level_idx.reshape(x.shape[0] * sub, -1))
    assert torch.equal(got, codec.pack(params, codes))


def _level_indices(codec, codes: torch.Tensor) -> torch.Tensor:
    """Stored E2M1 nibbles -> indices into the codec's grid (the inverse of the record's code_map; -0, nibble 8, is
    never written)."""
    inv = torch.full((16,), -1, dtype=torch.int64)
    inv[torch.tensor(codec.record.code_map)] = torch.arange(len(codec.record.code_map))
    idx = inv[codes]
    assert (idx >= 0).all()
    return idx


@pytest.mark.parametrize("name", RECORD_TYPES)
@pytest.mark.parametrize("n", [1, 37, 300])
def test_fused_records_are_the_search_then_the_pack(name, n):
    """The compiled search writing the records (``blockfit.encode_scale`` / ``encode_pow2``) gives the bytes of the
    compiled search's parameters and codes packed by the codec (odd block counts: lanes past the end), of the torch
    reference where the sums are exact, and the same bytes on one thread as on several."""
    codec = get_codec(name)
    m = codec.format.block_size
    x, w = _random_blocks(n, m, n)
    fused = codec.encode_blocks(x, w)
    assert fused.shape == (n, codec.format.type_size) and fused.dtype == torch.uint8
    params = codec.fit_params(x, w)  # the compiled search alone (int64 codes), then torch's round and pack
    assert torch.equal(fused, codec.pack(params, codec.round_to_grid(x, params)[0]))
    xe, we = (t.reshape(-1, m)[:n] for t in _exact_blocks(n * m // 256 + 3, 5))
    assert torch.equal(codec.encode_blocks(xe, we, backend="native"), codec.encode_blocks(xe, we, backend="torch"))
    assert_threads_keep_bytes(codec, x, w)


def test_fused_paths_registered():
    assert fastpaths.lookup("blockfit.encode_scale", "cpu") is nb.encode_scale
    assert fastpaths.lookup("blockfit.encode_pow2", "cpu") is nb.encode_pow2
    assert fastpaths.fused_path("blockfit.encode_pow2", torch.zeros(1), "triton") is None  # (no Triton version)
    assert fastpaths.fused_path("blockfit.encode_scale", torch.zeros(1), "torch") is None


def test_switched_off_by_the_environment(fresh_registry, monkeypatch):
    """With ``DYNAQUANT_NATIVE=0`` no fused writer loads and the codecs run their torch references (the search, then
    ``pack``); ``backend="native"`` raises."""
    monkeypatch.setenv("DYNAQUANT_NATIVE", "0")
    x, w = _random_blocks(40, 64, 2)
    for name in RECORD_TYPES:
        codec = get_codec(name)
        xb, wb = x.reshape(-1, codec.format.block_size), w.reshape(-1, codec.format.block_size)
        assert torch.equal(codec.encode_blocks(xb, wb), codec.encode_blocks(xb, wb, backend="torch"))
        with pytest.raises(RuntimeError, match="native"):
            codec.encode_blocks(xb, wb, backend="native")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths")
@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-march=x86-64"]], ids=["avx2", "sse2"])
def test_bytes_do_not_depend_on_the_vector_width(flags, fresh_registry, monkeypatch):
    """blockfit.c built for 8 lanes (AVX, no AVX-512: no register tables, lane-by-lane gathers) or 4 (SSE2) writes
    the bytes of the default build, on random blocks of every record format."""
    from dynaquant.kernels import native

    blocks = {name: _random_blocks(301, get_codec(name).format.block_size, 4) for name in RECORD_TYPES}
    want = {name: get_codec(name).encode_blocks(*blocks[name], backend="native") for name in RECORD_TYPES}
    base = [f for f in native.FLAGS if f != "-march=native"] if flags[0].startswith("-march") else list(native.FLAGS)
    monkeypatch.setattr(native, "FLAGS", base + flags)
    native.library.cache_clear()
    for name in RECORD_TYPES:
        assert torch.equal(get_codec(name).encode_blocks(*blocks[name], backend="native"), want[name]), name
