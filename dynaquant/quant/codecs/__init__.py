"""Torch reference codecs for every format in the format table.

Importing this package registers every codec. Public entry points:
``quantize(weight, fmt, imatrix)``, ``dequantize(data, fmt)``, ``get_codec(name)``.
"""

from dynaquant.quant.codecs import floats  # noqa: F401  (registers codecs)
from dynaquant.quant.codecs.base import Codec, dequantize, get_codec, quantize, register, weighted_error

for _mod in ("legacy", "nonlinear", "kquants", "iq4", "iq3", "iq2", "iq1", "runtime_int", "runtime_fp4"):
    try:
        __import__(f"{__name__}.{_mod}")
    except ModuleNotFoundError as _e:  # pragma: no cover - while codecs are being written
        if _e.name != f"{__name__}.{_mod}":
            raise

__all__ = ["Codec", "dequantize", "get_codec", "quantize", "register", "weighted_error"]
