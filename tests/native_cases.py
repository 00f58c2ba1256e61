"""What the compiled CPU fast paths' tests share (tests/test_*_native.py)."""

from __future__ import annotations

import torch


def assert_threads_keep_bytes(codec, x: torch.Tensor, w: torch.Tensor) -> None:
    """``codec.encode_blocks(x, w)`` gives the same bytes on one torch thread as on several (the compiled searches
    split their blocks over ``torch.get_num_threads()`` threads); the thread count is restored after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.encode_blocks(x, w)
        torch.set_num_threads(max(2, before))
        assert torch.equal(codec.encode_blocks(x, w), one)
    finally:
        torch.set_num_threads(before)
