"""What an analysis produces and how its report is assembled, shared by the whole-model analysis
(:mod:`.analyze`) and the block-by-block one (:mod:`.analyze_blocks`): the result type, each tensor's report entry,
the row weights and encoder imatrix of a tensor from the calibration statistics, and the report dict
(:mod:`dynaquant.analysis.report.schema` for its layout)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dynaquant.analysis import experts
from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.analysis.errors import RowWeights
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.report.schema import activation_entry, tensor_group, tensor_kind
from dynaquant.analysis.stats import ModelStats, module_of
from dynaquant.names import TensorName
from dynaquant.pipeline.source import model_info
from dynaquant.sources.checkpoint import ModelSource
from dynaquant.sources.gguf import TensorSource
from dynaquant.version import __version__


@dataclass
class AnalysisResult:
    """What an analysis produced.

    Attributes:
        report: the report dict (``report.json`` layout).
        stats: the calibration statistics (not serialised; for GPTQ and the encoders in the same run).
        imatrix: the imatrix keyed by HF module name.
        report_path, imatrix_path: files written (None when no output folder was given).
    """

    report: dict
    stats: ModelStats
    imatrix: Imatrix
    report_path: Path | None = None
    imatrix_path: Path | None = None


def row_weights_of(t, stats: ModelStats, tied: bool, vocab_counts: torch.Tensor):
    """(RowWeights, encoder imatrix (K,) or None) of a GGUF tensor; (None, None) without statistics."""
    kind = tensor_kind(t.gguf_name)
    if kind == "token_embd":
        counts = vocab_counts.to(torch.float64)
        freq = ((counts + 0.5) / (counts.sum() + 0.5 * counts.numel())).float()
        rw = RowWeights(lookup=freq, lookup_fisher=stats.embed_fisher)
        if tied and "lm_head" in stats.outputs:
            inp = stats.input("lm_head")
            rw.fisher, rw.hessian = stats.outputs["lm_head"].fisher, inp.hessian
            return rw, inp.imatrix
        return rw, None
    module = "lm_head" if kind == "output" else module_of(t.hf_name)
    if module is None or module not in stats.input_of:
        return None, None
    inp = stats.input(module)
    return RowWeights(fisher=stats.outputs[module].fisher, hessian=inp.hessian), inp.imatrix


def weight_of(model, t) -> torch.Tensor | None:
    kind = tensor_kind(t.gguf_name)
    if kind == "token_embd":
        return model.get_input_embeddings().weight
    if kind == "output":
        return model.get_output_embeddings().weight
    try:
        return model.get_parameter(t.hf_name) if t.hf_name else None
    except AttributeError:
        return None


def tensor_entry(t, sw_tensors: set) -> dict:
    """The report's entry of one source tensor, its ``errors`` still empty."""
    return {"name": t.gguf_name, "hf_name": t.hf_name, "shape": list(t.shape), "n_elements": t.numel,
            "layer": layer_of(t.gguf_name), "kind": tensor_kind(t.gguf_name), "group": tensor_group(t.gguf_name),
            "quantizable": t.quantizable, "super_weight": t.gguf_name in sw_tensors, "errors": {}}


def build_report(source: ModelSource, ts: TensorSource, spec: CalibrationSpec, stats: ModelStats, entries: list[dict],
                 sws: list, candidates: tuple[str, ...], *, device, dtype: torch.dtype, overhead_bytes: int,
                 timings: dict) -> dict:
    """The report dict (``report.json`` layout, :mod:`dynaquant.analysis.report.schema`) of one analysis: the tensor
    entries with their errors, the activation statistics, the super weights, the MoE routing; no sensitivity rows
    or plans yet."""
    info = model_info(ts)
    src_tensors = ts.tensors()
    gguf_of_param = {t.hf_name: t.gguf_name for t in src_tensors if t.hf_name}
    activations = []
    for key, s in stats.inputs.items():
        names = [gguf_of_param.get(m + ".weight", "output.weight" if m == "lm_head" else m) for m in s.modules]
        activations.append(activation_entry(key, layer_of(names[0]), tensor_kind(names[0]), names, s.absmax, s.sq_sum,
                                            s.tokens, s.quant_rel_error()))

    report = {
        "version": 1,
        "dynaquant_version": __version__,
        "model": {"id": source.model_id, "revision": hub_revision(source), "arch": ts.arch, "n_layers": ts.n_layers,
                  "tied_embeddings": info.tied_embeddings, "n_head": info.n_head, "n_head_kv": info.n_head_kv,
                  "n_expert": info.n_expert, "expert_format": info.expert_format,
                  "n_parameters": sum(t.numel for t in src_tensors),
                  "gguf_overhead_bytes": overhead_bytes or None},
        "calibration": {"id": spec.id, "sources": list(spec.sources), "n_sequences": stats.sequences,
                        "seq_len": spec.seq_len, "tokens": stats.tokens, "chat_template": spec.chat_template,
                        "fisher_sequences": stats.fisher_sequences, "device": str(device),
                        "dtype": str(dtype).replace("torch.", "")},
        "candidates": list(candidates),
        "tensors": entries,
        "activations": activations,
        "super_weights": [s.to_dict() for s in sws],
        "experts": [experts.routing_entry(es, layer_of_module(name), stats.tokens) for name, es in stats.experts.items()],
        "sensitivity": [],
        "plans": [],
        "timings_s": timings,
    }
    return report


def layer_of_module(name: str) -> int | None:
    prefix = TensorName.from_hf(name).prefix.split(".")  # [..., "layers", N] after at least one module
    return int(prefix[-1]) if len(prefix) > 2 and prefix[-2] == "layers" else None


def layer_of(name: str) -> int | None:
    tn = TensorName.from_gguf(name)
    return tn.block if tn.tower == "text" else None


def hub_revision(source: ModelSource) -> str | None:
    """The hub revision (snapshot commit) when the source is a hub cache folder, else None."""
    parts = Path(source.path).parts
    if "snapshots" in parts:
        i = parts.index("snapshots")
        return parts[i + 1] if i + 1 < len(parts) else None
    return None
