"""dynaquant: dynamic low-bit quantization of LLM checkpoints.

Public API:
    quantize(model=None, *, output=None, preset=None, bpw=None, size=None, rules=(), plan=None, ...)
        -> QuantizeResult
    evaluate(quantized, reference=None, *, text=None, n_ctx=512, chunks=16) -> EvalResult
    inspect_gguf(path) -> GGUFSummary
    analyze(model=None, output_dir=None, *, calibration=None, ...) -> AnalysisResult
    make_dynamic_plan(report, *, bpw=None, size=None, rules=(), target="gguf", output=None) -> Plan
    load(path, *, device=None, dtype=None, kernels=True) -> transformers model (safetensors checkpoints)
Subpackages: dynaquant.quant (formats, codecs, plans, runtime weights), dynaquant.analysis
(calibration, imatrix, evaluation), dynaquant.exporters (GGUF, safetensors), dynaquant.kernels (Triton).
"""

__version__ = "0.1.0"

from .analyze_pipeline import AnalysisResult, analyze, make_dynamic_plan  # noqa: E402
from .exporters.gguf_inspect import inspect_gguf  # noqa: E402
from .pipeline import QuantizeResult, evaluate, quantize  # noqa: E402
from .runtime import load  # noqa: E402

__all__ = ["AnalysisResult", "QuantizeResult", "analyze", "evaluate", "inspect_gguf", "load", "make_dynamic_plan", "quantize",
           "__version__"]
