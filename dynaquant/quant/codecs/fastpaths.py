"""Registry of fast implementations of the codecs' searches, filled from the layers above.

``quant/`` is pure torch and imports nothing of :mod:`dynaquant.kernels`; the kernels register
their Triton versions of the searches here by name when :mod:`dynaquant.kernels` is imported
(the pipeline, the analysis and the runtime import it), and the codecs look them up. A fast
path has the signature and the contract of its torch reference (named in :data:`NAMES`).

The registry holds loaders, not functions: a loader imports the implementation (Triton) on the
first :func:`lookup`, so registering costs nothing; a loader that raises (no Triton, or no usable
backend) leaves the torch reference in charge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# How a codec runs a search that has a fast path (:func:`fast_path`): the fast path on CUDA
# tensors when one is registered and loads ("auto"), the torch reference ("torch"), the fast path
# on any device ("triton").
BACKENDS = ("auto", "torch", "triton")

# The searches that may have a fast path, and their torch references.
NAMES = {
    "lattice.nearest_codewords": "dynaquant.quant.codecs._lattice.nearest_codewords_torch",
    "lattice.candidate_terms": "dynaquant.quant.codecs._lattice.candidate_terms_torch",
    "lattice.subset_min_costs": "dynaquant.quant.codecs._lattice.subset_min_costs_torch",
    "iq1.ternary_nearest": "dynaquant.quant.codecs.iq1.nearest_points (its indices)",
    "iq3.nearest_variants": "dynaquant.quant.codecs.iq3.nearest_variants_torch",
    "blockfit.fit_scale": "dynaquant.quant.codecs._blockfit.fit_scale_torch",
    "blockfit.fit_affine": "dynaquant.quant.codecs._blockfit.fit_affine_torch",
    "blockfit.fit_int_zero": "dynaquant.quant.codecs.runtime_int.fit_int_zero_torch",
    "kquant.aff_search_scales": "dynaquant.quant.codecs._kquant_search.aff_search_scales_torch",
    "kquant.aff_pick": "dynaquant.quant.codecs._kquant_search.aff_pick_torch",
    "kquant.aff_refine": "dynaquant.quant.codecs._kquant_search.aff_refine_torch",
    "kquant.sym_search_scales": "dynaquant.quant.codecs._kquant_search.sym_search_scales_torch",
    "kquant.sym_pick": "dynaquant.quant.codecs._kquant_search.sym_pick_torch",
    "kquant.sym_refine": "dynaquant.quant.codecs._kquant_search.sym_refine_torch",
    "gptq.round_block": "dynaquant.quant.gptq.round_block_torch",
}

_LOADERS: dict[str, Callable[[], Callable]] = {}
_LOADED: dict[str, Callable | None] = {}


def register(name: str, loader: Callable[[], Callable]) -> None:
    """Register the fast implementation of search ``name``.

    Args:
        name: one of :data:`NAMES`.
        loader: zero-argument callable returning the implementation (called once, on the first
            :func:`lookup`; it may import Triton).
    Raises:
        KeyError: ``name`` is not one of :data:`NAMES`.
    """
    if name not in NAMES:
        raise KeyError(f"no search named {name!r}; searches: {', '.join(NAMES)}")
    _LOADERS[name] = loader
    _LOADED.pop(name, None)


def lookup(name: str) -> Callable | None:
    """The fast implementation of search ``name``, or None (none registered, or its loader failed: logged once as a
    warning, since the torch reference is many times slower on a GPU)."""
    if name not in _LOADED:
        loader = _LOADERS.get(name)
        if loader is None:
            return None  # not cached: a later registration is seen
        try:
            _LOADED[name] = loader()
        except Exception as exc:  # no Triton, or no usable backend: the torch reference serves, and the log says so
            _LOADED[name] = None
            logging.getLogger(__name__).warning("fast path %s does not load (%s: %s); its torch reference runs instead",
                                                name, type(exc).__name__, exc)
    return _LOADED[name]


def fast_path(name: str, x: torch.Tensor, backend: str = "auto"):
    """The registered fast implementation of search ``name`` (:mod:`.fastpaths`) to run on
    ``x``'s device, or None for the torch reference.

    Args:
        name: a search of :data:`NAMES`.
        x: a tensor the search takes (its device decides under ``"auto"``).
        backend: ``"auto"`` (the fast path on CUDA tensors when one is registered and loads,
            else None), ``"torch"`` (None) or ``"triton"`` (the fast path on any device; on CPU
            it needs ``TRITON_INTERPRET=1``).
    Raises:
        ValueError: an unknown backend.
        RuntimeError: ``"triton"`` and no fast path is registered (import
            :mod:`dynaquant.kernels`) or it does not load (no Triton).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return None
    fn = lookup(name)
    if fn is None and backend == "triton":
        raise RuntimeError(f"backend='triton': no fast {name} is registered or it does not load (import dynaquant.kernels; Triton)")
    return fn
