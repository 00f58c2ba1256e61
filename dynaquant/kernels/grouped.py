"""Mixture-of-experts products: every routed expert of a layer in one kernel launch.

The E experts' weights of one projection are one :class:`~dynaquant.kernels.packing.PackedWeight` of ``E * N`` rows
(expert ``e``'s rows ``e N .. e N + N - 1``, as :func:`~dynaquant.kernels.packing.pack` of the experts' codes
concatenated along N). A layer's T tokens with their top-k choices make ``S = T k`` slots (slot ``t k + j``: token
``t``'s ``j``-th choice); :func:`route` sorts the slots by expert (stable: token order within an expert) and cuts each
expert's run into blocks of ``block_m`` slots, the kernel's routing table. :func:`grouped_linear` then computes every
slot's product in expert-sorted order, one program per (N tile, block), the weight tile decoded once for all the
block's slots (the fused-MoE scheme of vLLM and SGLang, on this package's layout).

Pure torch here (importing it does not import Triton); the kernel is :func:`.triton_linear.run_grouped`, the torch
reference :func:`grouped_linear_ref`. Nothing waits for the device: the routing table has a fixed upper bound of
``ceil(S / block_m) + min(E, S)`` blocks, the unused ones empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaquant.kernels.ops import dequantize_packed_ref, uses_triton
from dynaquant.kernels.packing import PackedWeight

__all__ = ["Routing", "route", "grouped_linear", "grouped_linear_ref"]


@dataclass(frozen=True)
class Routing:
    """A layer's token-to-expert slots sorted by expert, and the kernel's block table.

    Attributes:
        num_experts: E.
        order: (S,) int64, slot indices (``t k + j``) in expert order; skipped choices (an index outside
            ``0 .. E-1``) last.
        token: (S,) int64, the token of each sorted slot.
        expert: (S,) int64, the expert of each sorted slot (E for a skipped choice).
        block_expert, block_start, block_end: (B,) int32, each block's expert and its slots ``start .. end - 1``
            of the sorted order (``end == start`` for the unused blocks at the end).
        block_m: slots a block at most.
    """

    num_experts: int
    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_end: torch.Tensor
    block_m: int

    @property
    def slots(self) -> int:
        return self.order.numel()


def route(top_k_index: torch.Tensor, num_experts: int, block_m: int = 16) -> Routing:
    """The slots of ``top_k_index`` (T, k) sorted by expert, and their blocks of at most ``block_m`` (a power of two,
    at least 16: the kernel's ``tl.dot`` tile). Torch operations on the index's device; no host synchronisation.

    Raises:
        ValueError: ``top_k_index`` not 2-D integer, or ``block_m`` not a power of two >= 16.
    """
    if top_k_index.ndim != 2 or top_k_index.is_floating_point():
        raise ValueError(f"top_k_index must be (T, k) integers, got {tuple(top_k_index.shape)} {top_k_index.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    dev = top_k_index.device
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    first = torch.cumsum(counts, 0) - counts  # each expert's first sorted slot
    blocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    n_blocks = -(-(t * k) // block_m) + min(num_experts, t * k)
    b = torch.arange(n_blocks, device=dev)
    be = torch.searchsorted(ends, b, right=True)
    used = be < num_experts
    e = be.clamp(max=num_experts - 1)
    start = first[e] + (b - (ends[e] - blocks[e])) * block_m
    end = torch.minimum(start + block_m, first[e] + counts[e])
    start = torch.where(used, start, 0)
    end = torch.where(used, end, 0)
    i32 = torch.int32
    return Routing(num_experts, order, order // k, key[order], e.to(i32), start.to(i32), end.to(i32), block_m)


def _check(x2: torch.Tensor, packed: PackedWeight, routing: Routing) -> int:
    e = routing.num_experts
    if packed.out_features % e:
        raise ValueError(f"the stacked weight's {packed.out_features} rows are not {e} experts' rows")
    if x2.ndim != 2 or x2.shape[1] != packed.in_features:
        raise ValueError(f"x must be (rows, {packed.in_features}), got {tuple(x2.shape)}")
    return packed.out_features // e


def grouped_linear(x2: torch.Tensor, packed: PackedWeight, routing: Routing, *, sorted_input: bool = False,
                   block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """Each sorted slot's expert product: ``y[s] = x2[r] @ dequant(W_e).T`` for slot ``s`` of ``routing`` (expert
    ``e``), ``r`` its token (``sorted_input``: ``r = s``, x2 already in sorted slot order), super weights added.

    Args:
        x2: (T, K) activations, or (S, K) in sorted slot order with ``sorted_input``; bfloat16 / float16 run the
            Triton kernel (CUDA, or the interpreter), other dtypes the torch reference.
        packed: the experts' stacked weight, (E N, K) (module docstring).
        routing: from :func:`route`.
    Returns:
        (S, N) in x2's dtype, in sorted slot order; the rows of skipped choices are unspecified (the caller masks
        them).
    Raises:
        ValueError: shapes that do not fit.
    """
    n = _check(x2, packed, routing)
    if not uses_triton(x2):
        return grouped_linear_ref(x2, packed, routing, sorted_input=sorted_input)
    from dynaquant.kernels import triton_linear

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = torch.arange(routing.slots, device=x2.device) if sorted_input else routing.token
    y = triton_linear.run_grouped(x2, rows, packed, routing.num_experts, routing.block_expert, routing.block_start,
                                  routing.block_end, routing.slots, routing.block_m, block_n, num_warps)
    return _add_super(y, x2[rows], packed, routing, n)


def _add_super(y: torch.Tensor, xs: torch.Tensor, packed: PackedWeight, routing: Routing, n: int) -> torch.Tensor:
    """Super weights of the stacked layout (global rows ``e N + r``) added to the slots routed to their expert."""
    if packed.super_weights is None:
        return y
    rows, cols, delta = packed.super_weights
    hit = routing.expert[:, None] == (rows // n)[None, :]  # (S, J)
    corr = xs[:, cols].to(torch.float32) * delta * hit
    return y.index_add_(1, rows % n, corr.to(y.dtype))


def grouped_linear_ref(x2: torch.Tensor, packed: PackedWeight, routing: Routing, *,
                       sorted_input: bool = False) -> torch.Tensor:
    """Torch reference of :func:`grouped_linear` (the routed experts one at a time, each weight decoded in float32;
    skipped choices' rows zero). Waits for the device (it looks up which experts have slots)."""
    n = _check(x2, packed, routing)
    xs = x2 if sorted_input else x2[routing.token]
    y = torch.zeros(routing.slots, n, dtype=x2.dtype, device=x2.device)
    for e in torch.unique(routing.expert).tolist():
        if e >= routing.num_experts:
            continue
        w = dequantize_packed_ref(packed.rows(e * n, (e + 1) * n))  # (N, K) float32, super weights restored
        sel = routing.expert == e
        y[sel] = (xs[sel].to(torch.float32) @ w.T).to(x2.dtype)
    return y
