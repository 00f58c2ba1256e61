"""dynaquant: dynamic low-bit quantization of LLM checkpoints.

Public API (the package's face; nothing inside the package imports it):
    quantize(model=None, *, output=None, preset=None, bpw=None, size=None, rules=(), plan=None, ...)
        -> QuantizeResult
    evaluate(quantized, reference=None, *, text=None, n_ctx=512, chunks=16) -> EvalResult
    inspect_gguf(path) -> GGUFSummary
    analyze(model=None, output_dir=None, *, calibration=None, ...) -> AnalysisResult
    make_dynamic_plan(report, *, bpw=None, size=None, rules=(), target="gguf", output=None) -> Plan
    load(path, *, device=None, dtype=None, kernels=True) -> transformers model (safetensors checkpoints)

The stages, one subpackage each (ARCHITECTURE.md): dynaquant.sources (checkpoint readers),
dynaquant.analysis (calibration, errors, report), dynaquant.quant (formats, codecs, plans, planner),
dynaquant.pipeline (the run: analyze, plan, quantize, evaluate), dynaquant.exporters (GGUF,
safetensors), dynaquant.kernels (Triton), dynaquant.runtime (DynaLinear, DynaExperts, load).
"""

from dynaquant.exporters.gguf.inspect import inspect_gguf
from dynaquant.pipeline.analyze import AnalysisResult, analyze
from dynaquant.pipeline.evaluate import evaluate
from dynaquant.pipeline.plan import make_dynamic_plan
from dynaquant.pipeline.quantize import QuantizeResult, quantize
from dynaquant.runtime.loader import load
from dynaquant.version import __version__

__all__ = ["AnalysisResult", "QuantizeResult", "analyze", "evaluate", "inspect_gguf", "load", "make_dynamic_plan", "quantize",
           "__version__"]
