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

from collections.abc import Callable

# How a codec runs a search that has a fast path (``_lattice.fast_path``): the fast path on CUDA
# tensors when one is registered and loads ("auto"), the torch reference ("torch"), the fast path
# on any device ("triton").
BACKENDS = ("auto", "torch", "triton")

# The searches that may have a fast path, and their torch references.
NAMES = {
    "lattice.nearest_codewords": "dynaquant.quant.codecs._lattice.nearest_codewords_torch",
    "lattice.candidate_terms": "dynaquant.quant.codecs._lattice.candidate_terms_torch",
    "lattice.subset_min_costs": "dynaquant.quant.codecs._lattice.subset_min_costs_torch",
    "iq1.ternary_nearest": "dynaquant.quant.codecs.iq1.nearest_points (its indices)",
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
    """The fast implementation of search ``name``, or None (none registered, or its loader failed)."""
    if name not in _LOADED:
        loader = _LOADERS.get(name)
        if loader is None:
            return None  # not cached: a later registration is seen
        try:
            _LOADED[name] = loader()
        except Exception:  # no Triton, or no usable backend: the torch reference serves
            _LOADED[name] = None
    return _LOADED[name]
