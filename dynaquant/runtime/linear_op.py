"""``dynaquant::linear``: a quantized linear layer's call as one PyTorch custom op, so that ``torch.compile`` traces
a model with :class:`~dynaquant.runtime.linear.DynaLinear` layers as one graph (``fullgraph=True`` holds), each
call an opaque node that runs the layer's own forward (its Triton kernel, or the torch reference).

Without it every DynaLinear call was a graph break: a compiled Llama was cut into ~4 graphs a decoder layer, and
transformers' ``generate`` with a static cache (which compiles the forward with ``mode="reduce-overhead"``, CUDA
graphs) ran the kernel calls eagerly between the captured pieces.

The op is ``linear(x: Tensor, handle: int, n: int) -> Tensor``, (..., K) -> (..., n) contiguous in x's dtype.
``handle`` names the caller in a process-wide table of weak references (:func:`register`): a layer, or a fused
projection group (q/k/v, gate/up: one call, whose output the members slice in the traced code). ``handle`` and
``n`` are constants of the compiled graph, and ``n`` is all the fake (meta) implementation needs, so a graph that
Inductor's cache holds for an identical trace lays its buffers out as this process's layers return them.

The op declares no mutated inputs (the kernels' split-K counters are workspaces, not inputs). Inference only: no
autograd formula.
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["linear", "register"]

_CALLERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def register(caller) -> int:
    """A new handle for ``caller``, an object with ``op_forward(x) -> (..., n) contiguous``, held weakly.

    Returns:
        The handle, a non-negative int unique in this process.
    """
    handle = next(_NEXT)
    _CALLERS[handle] = caller
    return handle


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
    caller = _CALLERS.get(handle)
    if caller is None:
        raise RuntimeError(f"dynaquant::linear: layer {handle} no longer exists (a graph compiled for a deleted "
                           "model was called)")
    y = caller.op_forward(x)
    if y.shape != (*x.shape[:-1], n):
        raise RuntimeError(f"dynaquant::linear: layer {handle} returned {tuple(y.shape)}, not (..., {n})")
    return y


@linear.register_fake
def _linear_fake(x: torch.Tensor, handle: int, n: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n)
