"""llama.cpp's own encoders, through ctypes, as the quality reference for our codecs.

``llama-cpp-python`` ships libggml-base (``llama_cpp/lib/libggml-base.so``), whose
``ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix)`` is what
``llama-quantize`` calls for every tensor. Used by tests and benchmarks only.
"""

from __future__ import annotations

import ctypes
import glob
import os
from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@lru_cache(maxsize=1)
def libggml() -> ctypes.CDLL | None:
    """The loaded libggml-base, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    paths = sorted(glob.glob(os.path.join(libdir, "libggml-base.*")))
    if not paths:
        return None
    lib = ctypes.CDLL(paths[0])
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
    ]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def ggml_quantize(x: np.ndarray, type_name: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize (nrows, n_per_row) float32 with llama.cpp; returns (nrows, row_bytes) uint8.

    Raises:
        RuntimeError: libggml-base is not available.
    """
    lib = libggml()
    if lib is None:
        raise RuntimeError("llama-cpp-python (libggml-base) is not installed")
    t = GGMLQuantizationType[type_name]
    bs, ts = GGML_QUANT_SIZES[t]
    x = np.ascontiguousarray(x, dtype=np.float32)
    nrows, k = x.shape
    out = np.zeros((nrows, k // bs * ts), dtype=np.uint8)
    imp = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    lib.ggml_quantize_init(int(t))
    n = lib.ggml_quantize_chunk(
        int(t), x.ctypes.data, out.ctypes.data, 0, nrows, k,
        None if imp is None else imp.ctypes.data,
    )
    assert n == out.nbytes, (n, out.nbytes)
    return out


def llama_error(w, name: str, imatrix=None) -> float:
    """Importance-weighted error of llama.cpp's encoding of ``w`` ((rows, K) float32 torch tensor) in ``name``."""
    import torch
    from gguf.quants import dequantize as gguf_dequantize

    from dynaquant.quant.codecs import weighted_error

    data = ggml_quantize(w.numpy(), name, None if imatrix is None else imatrix.numpy())
    return weighted_error(w, torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType[name])), imatrix)


def error_ratios(tensors, name: str) -> np.ndarray:
    """Per ``(w, imatrix)`` pair: our weighted error / llama.cpp's, same imatrix (may be None)."""
    from dynaquant.quant.codecs import dequantize, quantize, weighted_error

    out = []
    for w, imatrix in tensors:
        ours = weighted_error(w, dequantize(quantize(w, name, imatrix), name), imatrix)
        out.append(ours / llama_error(w, name, imatrix))
    return np.array(out)
