"""Reading stored checkpoints fast: safetensors handles kept between reads (``SafetensorsReader``), block-FP8
dequantized without a weight-sized copy of its scales, and a MoE stack's error sample spread over its experts."""

import math
import pickle

import pytest
import torch
from safetensors.torch import save_file

from dynaquant.analysis.errors import sample_size
from dynaquant.analysis.experts import EXPERT_MIN_ROWS, expert_sample_rows
from dynaquant.errors import InputError
from dynaquant.sources.readers import SafetensorsReader
from dynaquant.sources.release import dequant_block_fp8


def _repeat_reference(weight, scale_inv, block):
    """The converter's dequant_simple: each scale repeated over its block, cut to the weight's shape."""
    s = scale_inv.to(torch.float32)
    lead = s.ndim - len(block)
    for i, size in enumerate(block):
        s = s.repeat_interleave(size, lead + i)
    s = s[tuple(slice(0, n) for n in weight.shape[weight.ndim - s.ndim:])]
    return weight.to(torch.float32) * s


@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((3, 256, 384), (128, 128)),
                                          ((200, 300), (128, 128)), ((64, 96), (32, 16))])
def test_block_fp8_equals_the_repeated_scales(shape, block):
    g = torch.Generator().manual_seed(0)
    w = (3 * torch.randn(shape, generator=g)).to(torch.float8_e4m3fn)
    lead = shape[:-2]
    s = torch.rand(*lead, math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]), generator=g) + 0.1
    got = dequant_block_fp8(w, s, list(block))
    assert got.dtype == torch.float32 and torch.equal(got, _repeat_reference(w, s, block))
    with pytest.raises(ValueError, match="do not cover"):
        dequant_block_fp8(w, s[..., :-1], list(block))


def test_reader_keeps_handles_and_remaps(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ta = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}  # 1 KiB each
    save_file(ta, a)
    save_file({"u": torch.arange(4.0)}, b)
    r = SafetensorsReader(max_open=1, remap_bytes=3 * 1024)
    for i in range(6):  # a handle serves 3 KiB, then is reopened
        assert torch.equal(r.get_tensor(a, f"t{i}"), ta[f"t{i}"])
    assert r.opens == 2
    assert torch.equal(r.get_tensor(b, "u"), torch.arange(4.0)) and r.opens == 3
    r.get_tensor(a, "t6")  # max_open 1: b's handle closed a's
    assert r.opens == 4
    r.close()
    r.get_tensor(a, "t7")
    assert r.opens == 5
    copy = pickle.loads(pickle.dumps(r))  # no handle travels
    assert copy.opens == 0 and (copy.max_open, copy.remap_bytes) == (1, 3 * 1024)
    assert torch.equal(copy.get_tensor(a, "t1"), ta["t1"])


def test_reader_errors_name_the_file(tmp_path):
    r = SafetensorsReader()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(InputError, match="bad.safetensors: not a valid safetensors file"):
        r.get_tensor(bad, "x")
    with pytest.raises(InputError, match="missing.safetensors: cannot read"):
        r.get_tensor(tmp_path / "missing.safetensors", "x")


def test_expert_sample_rows_spread_the_stack_sample():
    # DeepSeek-V3: 256 experts of 2048 (gate/up) and 7168 (down) rows; the stack sampled as one tensor of E * N rows
    assert expert_sample_rows(256, 2048) == expert_sample_rows(256, 7168) == EXPERT_MIN_ROWS == 16
    assert 256 * 16 >= sample_size(256 * 2048)
    assert expert_sample_rows(8, 14336) == sample_size(8 * 14336) // 8 == 256  # Mixtral
    assert expert_sample_rows(60, 1408) == -(-sample_size(60 * 1408) // 60) == 35  # Qwen1.5-MoE
    assert expert_sample_rows(8, 64) == 64 and expert_sample_rows(4, 32) == 32  # small experts: every row
    assert expert_sample_rows(2, 1000) == sample_size(1000)  # never more than an expert alone
    assert expert_sample_rows(256, 2048, 32) == 16 and expert_sample_rows(8, 14336, 32) == 128
