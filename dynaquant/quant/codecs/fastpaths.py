"""Registry of fast implementations of the codecs' searches, filled from the layers above.

``quant/`` is pure torch and imports nothing of :mod:`dynaquant.kernels`; the kernels register
their versions of the searches here by name and device when :mod:`dynaquant.kernels` is imported
(the pipeline, the analysis and the runtime import it), and the codecs look them up: Triton
kernels for CUDA tensors (``device="cuda"``), compiled C for CPU tensors (``device="cpu"``,
:mod:`dynaquant.kernels.native`). A fast path has the signature and the contract of its torch
reference (named in :data:`NAMES`).

The registry holds loaders, not functions: a loader imports (or builds) the implementation on the
first :func:`lookup`, so registering costs nothing; a loader that raises (no Triton, no usable
backend, no C compiler) leaves the torch reference in charge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# How a codec runs a search that has a fast path (:func:`fast_path`): the fast path of the tensor's
# device when one is registered and loads ("auto": Triton on CUDA, compiled C on CPU), the torch
# reference ("torch"), the Triton fast path on any device ("triton"), the compiled CPU one ("native").
BACKENDS = ("auto", "torch", "triton", "native")
DEVICES = ("cuda", "cpu")

# The searches that may have a fast path, and their torch references.
NAMES = {
    "lattice.nearest_codewords": "dynaquant.quant.codecs._lattice.nearest_codewords_torch",
    "lattice.candidate_terms": "dynaquant.quant.codecs._lattice.candidate_terms_torch",
    "lattice.subset_min_costs": "dynaquant.quant.codecs._lattice.subset_min_costs_torch",
    "iq2.stored_scale_costs": "dynaquant.quant.codecs.iq2.stored_scale_costs_torch",
    "iq1.ternary_nearest": "dynaquant.quant.codecs.iq1.nearest_points (its indices)",
    "iq1.ternary_search": "dynaquant.quant.codecs.iq1.ternary_search_torch",
    "iq1.sub_scales": "dynaquant.quant.codecs.iq1.sub_scales_torch",
    "iq3.nearest_variants": "dynaquant.quant.codecs._iq3_search.nearest_variants_torch",
    "iq3.assign": "dynaquant.quant.codecs._iq3_search.assign_torch",
    "iq3.pick": "dynaquant.quant.codecs._iq3_search.pick_torch",
    "iq3.exact": "dynaquant.quant.codecs._iq3_search.exact_torch",
    "iq3.exact_levels": "dynaquant.quant.codecs._iq3_search.exact_levels_torch",
    "iq3.step1": "dynaquant.quant.codecs._iq3_search.step1_torch",
    "iq3.consider": "dynaquant.quant.codecs._iq3_search.consider_torch",
    "blockfit.fit_scale": "dynaquant.quant.codecs._blockfit.fit_scale_torch",
    "blockfit.fit_affine": "dynaquant.quant.codecs._blockfit.fit_affine_torch",
    "blockfit.fit_int_zero": "dynaquant.quant.codecs.runtime_int.fit_int_zero_torch",
    "blockfit.fit_pow2": "dynaquant.quant.codecs._blockfit.fit_pow2_torch",
    "blockfit.encode_scale": "dynaquant.quant.codecs._records.encode_scale_torch",
    "blockfit.encode_pow2": "dynaquant.quant.codecs._records.encode_pow2_torch",
    "kquant.aff_search_scales": "dynaquant.quant.codecs._kquant_search.aff_search_scales_torch",
    "kquant.aff_pick": "dynaquant.quant.codecs._kquant_search.aff_pick_torch",
    "kquant.aff_refine": "dynaquant.quant.codecs._kquant_search.aff_refine_torch",
    "kquant.sym_search_scales": "dynaquant.quant.codecs._kquant_search.sym_search_scales_torch",
    "kquant.sym_pick": "dynaquant.quant.codecs._kquant_search.sym_pick_torch",
    "kquant.sym_refine": "dynaquant.quant.codecs._kquant_search.sym_refine_torch",
    "kquant.sym_encode": "dynaquant.quant.codecs._kquant_search.sym_encode_torch",
    "kquant.aff_encode": "dynaquant.quant.codecs._kquant_search.aff_encode_torch",
    "kquant.sym_bytes": "dynaquant.quant.codecs.kquants.sym_bytes_torch",
    "gptq.round_block": "dynaquant.quant.gptq.round_block_torch",
}

_LOADERS: dict[str, Callable[[], Callable]] = {}  # CUDA (Triton): the names alone, as tests patch them
_LOADED: dict[str, Callable | None] = {}
_CPU_LOADERS: dict[str, Callable[[], Callable]] = {}
_CPU_LOADED: dict[str, Callable | None] = {}


def _tables(device: str):
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    return (_LOADERS, _LOADED) if device == "cuda" else (_CPU_LOADERS, _CPU_LOADED)


def register(name: str, loader: Callable[[], Callable], device: str = "cuda") -> None:
    """Register the fast implementation of search ``name`` for ``device``'s tensors.

    Args:
        name: one of :data:`NAMES`.
        loader: zero-argument callable returning the implementation (called once, on the first
            :func:`lookup`; it may import Triton or build a library).
        device: ``"cuda"`` (Triton kernels; also what ``backend="triton"`` runs on any device) or ``"cpu"``.
    Raises:
        KeyError: ``name`` is not one of :data:`NAMES`.
        ValueError: an unknown device.
    """
    if name not in NAMES:
        raise KeyError(f"no search named {name!r}; searches: {', '.join(NAMES)}")
    loaders, loaded = _tables(device)
    loaders[name] = loader
    loaded.pop(name, None)


def lookup(name: str, device: str = "cuda") -> Callable | None:
    """The fast implementation of search ``name`` for ``device``, or None (none registered, or its loader failed:
    logged once as a warning, since the torch reference is many times slower)."""
    loaders, loaded = _tables(device)
    if name not in loaded:
        loader = loaders.get(name)
        if loader is None:
            return None  # not cached: a later registration is seen
        try:
            loaded[name] = loader()
        except Exception as exc:  # no Triton, no backend, no compiler: the torch reference serves, and the log says so
            loaded[name] = None
            logging.getLogger(__name__).warning("fast path %s (%s) does not load (%s: %s); its torch reference runs instead",
                                                name, device, type(exc).__name__, exc)
    return loaded[name]


def fast_path(name: str, x: torch.Tensor, backend: str = "auto"):
    """The registered fast implementation of search ``name`` to run on ``x``'s device, or None
    for the torch reference.

    Args:
        name: a search of :data:`NAMES`.
        x: a tensor the search takes (its device decides under ``"auto"``).
        backend: ``"auto"`` (the fast path of ``x``'s device, CUDA or CPU, when one is registered
            and loads, else None), ``"torch"`` (None), ``"triton"`` (the Triton fast path on any
            device; on CPU it needs ``TRITON_INTERPRET=1``) or ``"native"`` (the compiled CPU one;
            CPU tensors).
    Raises:
        ValueError: an unknown backend.
        RuntimeError: ``"triton"`` or ``"native"`` and no such fast path is registered (import
            :mod:`dynaquant.kernels`) or it does not load (no Triton, no C compiler).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    if backend == "auto":
        dev = x.device.type
        return lookup(name, dev) if dev in DEVICES else None
    fn = lookup(name, "cuda" if backend == "triton" else "cpu")
    if fn is None:
        what = "Triton" if backend == "triton" else "compiled CPU (a C compiler)"
        raise RuntimeError(f"backend={backend!r}: no fast {name} is registered or it does not load "
                           f"(import dynaquant.kernels; {what})")
    return fn


def fused_path(name: str, x: torch.Tensor, backend: str = "auto"):
    """:func:`fast_path` for a search fused with the write of its block records (``blockfit.encode_scale``,
    ``blockfit.encode_pow2``): None under ``"torch"``; under ``"triton"`` the Triton version where one is registered,
    else None (the codec then runs its search's own fast path and packs); else as :func:`fast_path`."""
    if backend == "triton":
        return lookup(name, "cuda")
    return fast_path(name, x, backend) if backend in ("auto", "native") else None
