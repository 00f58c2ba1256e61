"""What a quantize run hands its target (:class:`RunState`): shared by the targets (:mod:`dynaquant.pipeline.targets`,
:mod:`dynaquant.pipeline.safetensors_target`) and the run (:mod:`dynaquant.pipeline.quantize`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynaquant.analysis.corrections import Encodings
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.config import QuantizeConfig
from dynaquant.pipeline.gptq import GPTQRounding
from dynaquant.quant.plan import Plan
from dynaquant.sources.checkpoint import ModelSource
from dynaquant.sources.gguf import TensorSource


@dataclass
class RunState:
    """What a target writes from: the run's source, plan and encoders.

    Attributes:
        cfg: the run's configuration. source, ts: the model and its tensor source.
        plan: the plan. loaded_plan: the plan was given (not made from a preset or a report here).
        im: the imatrix computed in this run (HF module names), or None.
        imat: GGUF tensor name -> (K,) float32 importance for the encoders (empty: plain error).
        rounding: GPTQ rounding, or None. device: torch device of the encoding.
        report: the analysis report (dict) when one was used, else None.
        model, tokenizer: the loaded transformers model and tokenizer (None when not loaded).
        imatrix_file: the imatrix file the encoders read (when ``im`` is None), else None.
        rundir: the resumable work folder (``stream``): each encoded tensor is kept there and reused, else None.
        progress: the run's one progress display (:class:`dynaquant.progress.RunProgress`), or None (the tensor loop
            shows a bar of its own when ``cfg.progress``).
        encodings: the corrections' bytes of the final plan's parameters (:class:`dynaquant.analysis.corrections.
            Encodings`, HF names), which the GGUF writer writes instead of encoding them again; or None.
        write_s: seconds the one-process tensor loop spent writing (each encoded tensor kept in the work folder,
            handed to the target, the target finished), a part of its ``quantize_s``.
    """

    cfg: QuantizeConfig
    source: ModelSource
    ts: TensorSource
    plan: Plan
    loaded_plan: bool
    im: Imatrix | None
    imat: dict[str, torch.Tensor]
    rounding: GPTQRounding | None
    device: torch.device
    report: dict | None = None
    model: Any = None
    tokenizer: Any = None
    imatrix_file: Path | None = None
    rundir: Any = None
    progress: Any = None
    encodings: Encodings | None = None
    write_s: float = 0.0
