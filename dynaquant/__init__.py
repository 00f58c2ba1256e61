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

Threads: imported before torch, dynaquant sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it. dynaquant
runs its own CPU threads beside torch's OpenMP ones (the encoders' pool, reading and writing beside encoding), and
OpenMP's default keeps idle workers spinning after every parallel torch op: on a 2-core machine the spinning took the
cores from the threads with work (README's first command 272 s against 95 s passive on a busy 2-core box; a
``--preset`` run 12.1 against 7.2 s of CPU time). Set ``OMP_WAIT_POLICY`` yourself to override; imported after torch,
the setting cannot apply.
"""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:  # (OpenMP reads it once, when torch loads its runtime)
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dynaquant.exporters.gguf.inspect import inspect_gguf  # noqa: E402
from dynaquant.pipeline.analyze import AnalysisResult, analyze  # noqa: E402
from dynaquant.pipeline.evaluate import evaluate  # noqa: E402
from dynaquant.pipeline.plan import make_dynamic_plan  # noqa: E402
from dynaquant.pipeline.quantize import QuantizeResult, quantize  # noqa: E402
from dynaquant.runtime.loader import load  # noqa: E402
from dynaquant.version import __version__  # noqa: E402

__all__ = ["AnalysisResult", "QuantizeResult", "analyze", "evaluate", "inspect_gguf", "load", "make_dynamic_plan", "quantize",
           "__version__"]
