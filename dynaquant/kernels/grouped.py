"""Mixture-of-experts products: every routed expert of a layer in one kernel launch.

The E experts' weights of one projection are one :class:`~dynaquant.kernels.packing.PackedWeight` of ``E * N`` rows
(expert ``e``'s rows ``e N .. e N + N - 1``, as :func:`~dynaquant.kernels.packing.pack` of the experts' codes
concatenated along N). A layer's T tokens with their top-k choices make ``S = T k`` slots (slot ``t k + j``: token
``t``'s ``j``-th choice); :func:`route` sorts the slots by expert (stable: token order within an expert) and cuts each
expert's run into blocks of ``block_m`` slots, the kernel's routing table. :func:`grouped_linear` then computes every
slot's product in expert-sorted order, one program per (N tile, block), the weight tile decoded once for all the
block's slots (the fused-MoE scheme of vLLM and SGLang, on this package's layout), or, for a few slots an expert
(``gemv``), one program per (N tile, slot) on the CUDA cores.

Pure torch here (importing it does not import Triton); the kernels are :mod:`.triton_grouped`'s, the torch
reference :func:`grouped_linear_ref`. Nothing waits for the device: the routing table has a fixed upper bound of
``ceil(S / block_m) + min(E, S)`` blocks, the unused ones empty.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dynaquant.kernels.ops import dequantize_packed_ref, triton_device, uses_triton
from dynaquant.kernels.packing import PackedWeight

__all__ = ["Routing", "route", "route_torch", "grouped_linear", "grouped_linear_ref"]


@dataclass(frozen=True)
class Routing:
    """A layer's token-to-expert slots sorted by expert, and the kernel's block table.

    Attributes:
        num_experts: E.
        order: (S,) int64, slot indices (``t k + j``) in expert order; skipped choices (an index outside
            ``0 .. E-1``) last.
        token: (S,) int64, the token of each sorted slot.
        expert: (S,) int64, the expert of each sorted slot (E for a skipped choice).
        block_expert: (B,) int64, each block's expert (``E - 1`` for the unused blocks at the end).
        expert_block: (E,) int64, each expert's first block.
        expert_bounds: (E + 1,) int64, expert ``e``'s slots are ``expert_bounds[e] .. expert_bounds[e + 1] - 1`` of
            the sorted order.
        block_m: slots a block at most. Block ``b`` of expert ``e`` holds slots ``start .. end - 1``, ``start =
            expert_bounds[e] + (b - expert_block[e]) * block_m``, ``end = min(start + block_m, expert_bounds[e + 1])``,
            none where ``end <= start`` (:meth:`blocks`).
    """

    num_experts: int
    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    block_expert: torch.Tensor
    expert_block: torch.Tensor
    expert_bounds: torch.Tensor
    block_m: int

    @property
    def slots(self) -> int:
        return self.order.numel()

    def blocks(self) -> list[tuple[int, int, int]]:
        """The used blocks as ``(expert, start, end)`` (waits for the device: for tests and references)."""
        e = self.block_expert
        b = torch.arange(e.numel(), device=e.device)
        start = self.expert_bounds[e] + (b - self.expert_block[e]) * self.block_m
        end = torch.minimum(start + self.block_m, self.expert_bounds[e + 1])
        return [(x, a, z) for x, a, z in zip(e.tolist(), start.tolist(), end.tolist()) if z > a]


# the routing kernel's bounds (one program): slots (T k; a bitonic sort in registers, the counts by an (E, S)
# comparison whose work grows as S E) and experts (E + 1 count lanes in 1024)
ROUTE_MAX_SLOTS = 1024
ROUTE_MAX_EXPERTS = 1023


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` kept per size and device (read only; one launch fewer a call, and safe in CUDA graphs)."""
    return torch.arange(n, device=device)


def route(top_k_index: torch.Tensor, num_experts: int, block_m: int = 16) -> Routing:
    """The slots of ``top_k_index`` (T, k) sorted by expert, and their blocks of at most ``block_m`` (a power of two,
    at least 16: the kernel's ``tl.dot`` tile). No host synchronisation (the block count is the fixed bound
    ``ceil(S / block_m) + min(E, S)``): on CUDA (or in Triton's interpreter) one launch of
    :func:`dynaquant.kernels.triton_grouped.run_route` for up to ``ROUTE_MAX_SLOTS`` slots and ``ROUTE_MAX_EXPERTS``
    experts, else :func:`route_torch`'s dozen torch operations; the same tables either way.

    Raises:
        ValueError: ``top_k_index`` not 2-D integer, or ``block_m`` not a power of two >= 16.
    """
    _check_route(top_k_index, block_m)
    t, k = top_k_index.shape
    if _routes_in_triton(top_k_index, num_experts):
        from dynaquant.kernels import triton_grouped

        order, token, expert, bounds, first, block_expert = triton_grouped.run_route(
            top_k_index.reshape(-1).contiguous(), k, num_experts, block_m, _n_blocks(t * k, num_experts, block_m))
        return Routing(num_experts, order, token, expert, block_expert, first, bounds, block_m)
    return route_torch(top_k_index, num_experts, block_m)


def _routes_in_triton(top_k_index: torch.Tensor, num_experts: int) -> bool:
    """Whether :func:`route` takes the one-launch kernel: CUDA (or the CPU with ``TRITON_INTERPRET=1``), 1 to
    ``ROUTE_MAX_SLOTS`` slots, at most ``ROUTE_MAX_EXPERTS`` experts."""
    return (triton_device(top_k_index) and 0 < top_k_index.numel() <= ROUTE_MAX_SLOTS
            and 0 < num_experts <= ROUTE_MAX_EXPERTS)


def _check_route(top_k_index: torch.Tensor, block_m: int) -> None:
    if top_k_index.ndim != 2 or top_k_index.is_floating_point():
        raise ValueError(f"top_k_index must be (T, k) integers, got {tuple(top_k_index.shape)} {top_k_index.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")


def _n_blocks(slots: int, num_experts: int, block_m: int) -> int:
    """The routing table's fixed block count: ``ceil(S / block_m) + min(E, S)``."""
    return -(-slots // block_m) + min(num_experts, slots)


def route_torch(top_k_index: torch.Tensor, num_experts: int, block_m: int = 16) -> Routing:
    """:func:`route` in a dozen torch operations on the index's device (the reference, and the path for any size):
    one stable sort of the keys (skipped choices E), the bounds by ``searchsorted``, the blocks by ``cumsum``.

    Raises:
        ValueError: as :func:`route`.
    """
    _check_route(top_k_index, block_m)
    dev = top_k_index.device
    t, k = top_k_index.shape
    e = num_experts
    key = top_k_index.reshape(-1).to(torch.int64).clamp(-1, e).remainder_(e + 1)  # skipped choices (< 0, >= E): E
    expert, order = torch.sort(key, stable=True)
    bounds = torch.searchsorted(expert, _arange(e + 1, dev))  # each expert's first sorted slot; [E]: the skipped
    blocks = (bounds[1:] - bounds[:-1] + (block_m - 1)).floor_divide_(block_m)
    ends = torch.cumsum(blocks, 0)
    block_expert = torch.searchsorted(ends, _arange(_n_blocks(t * k, e, block_m), dev), right=True).clamp_(max=e - 1)
    return Routing(e, order, order // k, expert, block_expert, ends - blocks, bounds, block_m)


def _check(x2: torch.Tensor, packed: PackedWeight, routing: Routing) -> int:
    e = routing.num_experts
    if packed.out_features % e:
        raise ValueError(f"the stacked weight's {packed.out_features} rows are not {e} experts' rows")
    if x2.ndim != 2 or x2.shape[1] != packed.in_features:
        raise ValueError(f"x must be (rows, {packed.in_features}), got {tuple(x2.shape)}")
    return packed.out_features // e


def grouped_linear(x2: torch.Tensor, packed: PackedWeight, routing: Routing, *, sorted_input: bool = False,
                   slot_weights: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 4,
                   num_stages: int = 1, gemv: bool = False, half2: bool = False, words: int = 16,
                   act: str | None = None) -> torch.Tensor:
    """Each sorted slot's expert product: ``y[s] = x2[r] @ dequant(W_e).T`` for slot ``s`` of ``routing`` (expert
    ``e``), ``r`` its token (``sorted_input``: ``r = s``, x2 already in sorted slot order), super weights added.

    Args:
        x2: (T, K) activations, or (S, K) in sorted slot order with ``sorted_input``; bfloat16 / float16 run the
            Triton kernel (CUDA, or the interpreter), other dtypes the torch reference.
        packed: the experts' stacked weight, (E N, K) (module docstring).
        routing: from :func:`route`.
        slot_weights: (S,) routing weights in the original slot order (``t k + j``), or None. Given, each product
            is multiplied by its slot's weight and written back to the original slot order (the kernel's epilogue:
            no gather or scatter of its own), skipped choices' rows zero: a MoE layer's output is then the sum over
            each token's k rows.
        block_n, num_warps, num_stages: the kernel's launch shape.
        gemv: one program a slot (and N tile) on the CUDA cores instead of tensor-core tiles of a routing block:
            for a few slots an expert (decoding), where a 16-slot tile would decode its weights for one live row.
        half2, words: ``gemv`` only: the packed-fp16 word products (symmetric INT4 / INT2;
            :mod:`dynaquant.kernels.triton_half2`) and the most words of a row a loop iteration.
        act: None, or ``"silu"``: each expert's N rows are its gate (the first N / 2) then its up projection (the
            stacked gate/up layout of :func:`dynaquant.runtime.linear.fuse_experts`), and the result is
            ``act(gate) * up`` (the kernel's epilogue where it runs without super weights, rounded as the torch ops
            on the (S, N) product round; else those torch ops). Not with ``slot_weights``.
    Returns:
        (S, N) in x2's dtype ((S, N / 2) with ``act``): in sorted slot order, the rows of skipped choices
        unspecified (the caller masks them); with ``slot_weights``, in the original slot order (above).
    Raises:
        ValueError: shapes that do not fit; ``half2`` for a format without that decode; ``act`` unknown, with
            ``slot_weights`` or an odd N.
    """
    n = _check(x2, packed, routing)
    if slot_weights is not None and slot_weights.shape != (routing.slots,):
        raise ValueError(f"slot_weights must be ({routing.slots},), got {tuple(slot_weights.shape)}")
    if act is not None and (act not in ACTIVATIONS or slot_weights is not None or n % 2):
        raise ValueError(f"act must be one of {sorted(ACTIVATIONS)} with an even N ({n}) and no slot weights, "
                         f"got {act!r}")
    if not uses_triton(x2):
        y = grouped_linear_ref(x2, packed, routing, sorted_input=sorted_input)
        return _act_mul(y, act) if act is not None else _weighted(y, routing, slot_weights)
    from dynaquant.kernels import triton_grouped

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = _arange(routing.slots, x2.device) if sorted_input else routing.token
    fused = packed.super_weights is None  # (super weights are added to the product in torch, after the kernel)
    scatter = slot_weights is not None and fused
    y = triton_grouped.run_grouped(x2, rows, packed, routing, block_n, num_warps, num_stages,
                                  slot_weights=slot_weights if scatter else None, gemv=gemv, half2=half2,
                                  words=words, act=act if fused else None)
    if fused and (scatter or act is not None):
        return y
    y = _add_super(y, x2[rows], packed, routing, n)
    return _act_mul(y, act) if act is not None else _weighted(y, routing, slot_weights)


ACTIVATIONS = {"silu": torch.nn.functional.silu}  # grouped_linear's ``act``: the gate/up epilogue's activations


def _act_mul(y: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` of a (S, 2 I) gate/up product in torch (the kernel's epilogue's reference)."""
    half = y.shape[1] // 2
    return ACTIVATIONS[act](y[:, :half]) * y[:, half:]


def _weighted(y: torch.Tensor, routing: Routing, slot_weights: torch.Tensor | None) -> torch.Tensor:
    """Sorted products weighted and put back in the original slot order (skipped choices zero), as the kernel's
    epilogue does; ``y`` itself without weights."""
    if slot_weights is None:
        return y
    w = slot_weights[routing.order].to(y.dtype)
    out = torch.zeros_like(y)
    out[routing.order] = torch.where((routing.expert < routing.num_experts)[:, None], y * w[:, None], 0)
    return out


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
