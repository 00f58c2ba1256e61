"""Small constant tables of the codecs' searches (candidate steps, shifts, moves, bit shifts) as device tensors,
made once a process per (values, dtype, device).

On a GPU, ``torch.tensor(values, device="cuda")`` copies from pageable host memory, which waits for the stream:
made per chunk, these tables stalled every chunk's launch queue (a 4096 x 14336 Q3_K encode on an H200 synchronized
24 times, 20 of them such copies). The cached tensors are shared: callers must not write to them.
"""

from __future__ import annotations

import functools

import torch


def device_constant(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, made once per (values, dtype, device).

    Args:
        values: a number or a (nested) sequence of numbers; lists are taken by value (converted to tuples).
        dtype: the tensor's dtype.
        device: where it lives.
    Returns:
        A read-only-by-contract tensor of the values' shape (shared between callers).
    """
    return _cached(_frozen(values), dtype, torch.device(device))


def _frozen(values):
    if isinstance(values, (list, tuple)):
        return tuple(_frozen(v) for v in values)
    return values


@functools.lru_cache(maxsize=512)
def _cached(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)
