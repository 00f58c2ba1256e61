"""dynaquant: dynamic low-bit quantization of LLM checkpoints.

Public API:
    quantize(model=None, *, output=None, preset=None, bpw=None, size=None, rules=(), plan=None, ...)
        -> QuantizeResult
    evaluate(quantized, reference=None, *, text=None, n_ctx=512, chunks=16) -> EvalResult
    inspect_gguf(path) -> GGUFSummary
Subpackages: dynaquant.quant (formats, codecs, plans), dynaquant.analysis (calibration,
imatrix, evaluation), dynaquant.exporters (GGUF), dynaquant.kernels (Triton, later).
"""

__version__ = "0.1.0"

from .exporters.gguf_inspect import inspect_gguf  # noqa: E402
from .pipeline import QuantizeResult, evaluate, quantize  # noqa: E402

__all__ = ["QuantizeResult", "evaluate", "inspect_gguf", "quantize", "__version__"]
