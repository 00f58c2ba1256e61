"""Formats, codecs, plans and allocation. Pure torch: no model files are read or written here."""

from dynaquant.quant.codecs import dequantize, get_codec, quantize, weighted_error
from dynaquant.quant.formats import FORMATS, Format, get_format, resolve_for_row

__all__ = ["FORMATS", "Format", "dequantize", "get_codec", "get_format", "quantize", "resolve_for_row", "weighted_error"]
