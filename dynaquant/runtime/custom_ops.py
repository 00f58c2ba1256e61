"""dynaquant's PyTorch custom ops, so that ``torch.compile`` traces a model with quantized layers as one graph
(``fullgraph=True`` holds): each quantized call is an opaque node that runs the module's own forward (its Triton
kernels, or the torch reference).

- ``dynaquant::linear(x: Tensor, handle: int, n: int) -> Tensor``: a
  :class:`~dynaquant.runtime.linear.DynaLinear` call, or one fused projection group's call (q/k/v, gate/up: the
  members slice its output in the traced code); (..., K) -> (..., n) contiguous in x's dtype.
- ``dynaquant::experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, handle: int) -> Tensor``: a
  :class:`~dynaquant.runtime.moe.DynaExperts` call (its grouped launches, or its loop over the routed experts,
  whose data-dependent shapes stay inside the op); the output has ``hidden``'s shape and dtype, contiguous.

Without them every quantized call was a graph break: a compiled Llama was cut into ~4 graphs a decoder layer, and
transformers' ``generate`` with a static cache (which compiles the forward with ``mode="reduce-overhead"``, CUDA
graphs) ran the kernel calls eagerly between the captured pieces.

``handle`` names the caller in a process-wide table of weak references (:func:`register`). ``handle`` and ``n`` are
constants of the compiled graph, and the output's shape follows from the arguments alone, so a graph that
Inductor's cache holds for an identical trace lays its buffers out as this process's modules return them.

The ops declare no mutated inputs (the kernels' split-K counters are workspaces, not inputs). Inference only: no
autograd formula.
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["experts", "linear", "register"]

_CALLERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def register(caller) -> int:
    """A new handle for ``caller`` (held weakly): an object with ``op_forward(x)`` for ``dynaquant::linear``, or
    ``op_forward(hidden, top_k_index, top_k_weights)`` for ``dynaquant::experts``.

    Returns:
        The handle, a non-negative int unique in this process.
    """
    handle = next(_NEXT)
    _CALLERS[handle] = caller
    return handle


def _caller(op: str, handle: int):
    caller = _CALLERS.get(handle)
    if caller is None:
        raise RuntimeError(f"dynaquant::{op}: layer {handle} no longer exists (a graph compiled for a deleted model "
                           "was called)")
    return caller


def _check(op: str, handle: int, y: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(y.shape) != shape:
        raise RuntimeError(f"dynaquant::{op}: layer {handle} returned {tuple(y.shape)}, not {shape}")
    return y


@torch.library.custom_op("dynaquant::linear", mutates_args=())
def linear(x: torch.Tensor, handle: int, n: int) -> torch.Tensor:
    """``x @ dequant(W).T + b`` of the layer or group ``handle``: its ``op_forward`` (kernel or torch reference).

    Args:
        x: (..., K) activations, any float dtype.
        handle: from :func:`register`.
        n: the output features N.
    Returns:
        (..., n) contiguous, in x's dtype.
    Raises:
        RuntimeError: the caller was garbage-collected (a graph compiled for a deleted model), or returned
            another shape.
    """
    return _check("linear", handle, _caller("linear", handle).op_forward(x), (*x.shape[:-1], n))


@linear.register_fake
def _linear_fake(x: torch.Tensor, handle: int, n: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n)


@torch.library.custom_op("dynaquant::experts", mutates_args=())
def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, handle: int) -> torch.Tensor:
    """A mixture-of-experts layer's routed experts, ``sum_j w[t, j] * expert_{idx[t, j]}(x_t)``: the
    :class:`~dynaquant.runtime.moe.DynaExperts` ``handle``'s ``op_forward``.

    Args:
        hidden: (..., H) tokens; top_k_index: (T, k) int64 chosen experts; top_k_weights: (T, k) their weights.
        handle: from :func:`register`.
    Returns:
        ``hidden``'s shape and dtype, contiguous.
    Raises:
        RuntimeError: as :func:`linear`.
    """
    y = _caller("experts", handle).op_forward(hidden, top_k_index, top_k_weights)
    return _check("experts", handle, y, tuple(hidden.shape))


@experts.register_fake
def _experts_fake(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  handle: int) -> torch.Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)
