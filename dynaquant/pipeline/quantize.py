"""The quantize pipeline: source -> imatrix -> plan -> GGUF, one tensor at a time.

``quantize`` is what ``dynaquant quantize`` runs; ``evaluate`` what ``dynaquant eval`` runs.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np
import torch

# quantize()'s ``calibration_chunks`` argument (a count) shadows the function's name inside it.
from dynaquant.analysis.calibration import CalibrationSpec, tokenize_chunks
from dynaquant.analysis.calibration import calibration_chunks as calibration_ids
from dynaquant.analysis.evaluate import EvalResult, compare_models
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.report.schema import load_report, write_json
from dynaquant.analysis.stats import collect_stats, compute_imatrix, module_of
from dynaquant.analysis.texts import default_eval_text, read_text
from dynaquant.errors import InputError
from dynaquant.exporters.gguf.writer import write_gguf
from dynaquant.names import hf_to_gguf_name
from dynaquant.pipeline.preflight import Output, check_budget, check_outputs, plan_json_bytes_bound, tensor_bytes_bound
from dynaquant.quant.codecs import quantize as encode_tensor
from dynaquant.quant.formats import Format, get_format
from dynaquant.quant.plan import Plan, TensorInfo
from dynaquant.quant.planner import GGUF_CANDIDATES, BudgetError, default_rules, error_fn_from_report, make_plan
from dynaquant.quant.presets import PRESETS, ModelInfo, requires_imatrix
from dynaquant.sources.checkpoint import ModelSource, SourceRecord, find_reference, load_model, load_tokenizer, resolve_source
from dynaquant.sources.gguf import SourceTensor, TensorSource, open_gguf_source
from dynaquant.sources.nonfinite import check_model_finite, source_names
from dynaquant.version import __version__

log = logging.getLogger(__name__)

# llama.cpp file type that best describes a file whose bulk is in a format.
_FILE_TYPE_OF_FORMAT = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M, "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "IQ4_NL": gguf.LlamaFileType.MOSTLY_IQ4_NL, "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M, "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS, "NVFP4": gguf.LlamaFileType.MOSTLY_NVFP4,
    "IQ3_S": gguf.LlamaFileType.MOSTLY_IQ3_S, "IQ3_XXS": gguf.LlamaFileType.MOSTLY_IQ3_XXS,
    "IQ2_S": gguf.LlamaFileType.MOSTLY_IQ2_M, "IQ2_XS": gguf.LlamaFileType.MOSTLY_IQ2_XS,
    "IQ2_XXS": gguf.LlamaFileType.MOSTLY_IQ2_XXS, "IQ1_M": gguf.LlamaFileType.MOSTLY_IQ1_M,
    "IQ1_S": gguf.LlamaFileType.MOSTLY_IQ1_S,
}


@dataclass
class QuantizeResult:
    """What ``quantize`` produced.

    Attributes:
        output: the GGUF file written.
        plan: the plan used.
        size_bytes: the output file's size.
        bpw: average bits per weight over all tensor data (metadata excluded).
        time_s: wall time of the whole run (evaluation excluded).
        imatrix_chunks: calibration chunks behind the imatrix (0: none used).
        eval: quality against the source, when asked for.
        mmproj: the vision GGUF written beside ``output`` for a vision-language checkpoint
            (``mmproj-<output name>``, F16; llama.cpp's ``--mmproj``), else None.
    """

    output: Path
    plan: Plan
    size_bytes: int
    bpw: float
    time_s: float
    imatrix_chunks: int = 0
    eval: EvalResult | None = None
    timings_s: dict = field(default_factory=dict)
    gptq: dict | None = None
    mmproj: Path | None = None

    def to_dict(self) -> dict:
        return {
            "output": str(self.output), "size_bytes": self.size_bytes, "bpw": round(self.bpw, 4),
            "time_s": round(self.time_s, 2), "timings_s": {k: round(v, 2) for k, v in self.timings_s.items()},
            "imatrix_chunks": self.imatrix_chunks, "method": self.plan.method,
            "formats": self.plan.count_by_format(), "eval": self.eval.to_dict() if self.eval else None,
            "gptq": self.gptq, **({"mmproj": str(self.mmproj)} if self.mmproj else {}),
        }


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def open_tensor_source(source: ModelSource, full_vl: bool = False) -> TensorSource:
    """The exporter's tensor source for a model source (GGUF file or HF folder).

    ``full_vl``: for a vision-language folder, every tensor (language model, vision tower, projector;
    :mod:`.exporters.hf_vl_full`), as the analysis and the safetensors target use; otherwise what the GGUF
    writer takes (Qwen2-VL's language model; LLaVA / Mllama refused, naming the file).
    """
    if source.kind == "gguf":
        return open_gguf_source(source.path)
    from dynaquant.sources.open import open_hf_source

    if full_vl:
        from dynaquant.sources.hf_vl_full import open_vl_full_source, vl_full_arch

        if vl_full_arch(source.path):
            return open_vl_full_source(source.path, trust_remote_code=source.trust_remote_code)

    return open_hf_source(source.path, trust_remote_code=source.trust_remote_code)


def tensor_infos(ts: TensorSource) -> list[TensorInfo]:
    return [TensorInfo(t.gguf_name, t.hf_name, tuple(t.shape), t.quantizable) for t in ts.tensors()]


def _gguf_int(reader, key: str) -> int | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    v = f.contents()
    return int(max(v)) if isinstance(v, list) else int(v)


def model_info(ts: TensorSource) -> ModelInfo:
    """Model facts for the planner, from the source's metadata (no model is loaded)."""
    names = {t.gguf_name for t in ts.tensors()}
    reader = getattr(ts, "reader", None)
    expert_format = None
    if reader is not None:
        n_head = _gguf_int(reader, f"{ts.arch}.attention.head_count") or 1
        n_head_kv = _gguf_int(reader, f"{ts.arch}.attention.head_count_kv") or n_head
        n_expert = _gguf_int(reader, f"{ts.arch}.expert_count") or 0
    else:
        n_head, n_head_kv = getattr(ts, "n_head", 1), getattr(ts, "n_head_kv", 1)
        cfg = getattr(ts, "config", {})
        n_expert = int(getattr(ts, "n_expert", 0) or cfg.get("num_local_experts") or cfg.get("num_experts")
                       or cfg.get("n_routed_experts") or 0)
        qc = cfg.get("quantization_config") or {}
        if n_expert and str(qc.get("quant_method", "")).lower() == "mxfp4":
            expert_format = "MXFP4"  # gpt-oss: routed experts stored as OCP MXFP4
    return ModelInfo(n_layers=ts.n_layers, n_head=n_head, n_head_kv=n_head_kv, n_expert=n_expert,
                     tied_embeddings="output.weight" not in names, expert_format=expert_format)


def imatrix_by_gguf_name(im: Imatrix, ts: TensorSource) -> dict[str, torch.Tensor]:
    """Re-key an imatrix from HF module names to GGUF tensor names ((K,) float32 each).

    The lm_head's statistics go to ``output.weight``, or to ``token_embd.weight`` when the
    embedding is tied (llama.cpp's imatrix does the same: the output matmul reads it).
    """
    names = {t.gguf_name for t in ts.tensors()}
    # the source's own names first (a VL language model's modules are model.language_model.*)
    by_module = {t.hf_name[: -len(".weight")]: t.gguf_name for t in ts.tensors() if t.hf_name and t.hf_name.endswith(".weight")}
    out: dict[str, torch.Tensor] = {}
    for hf in im.names():
        g = by_module.get(hf) or hf_to_gguf_name(ts.arch, ts.n_layers, hf)
        if g is None:
            continue
        g = g if g.endswith(".weight") else g + ".weight"
        if g == "output.weight" and g not in names:
            g = "token_embd.weight"
        if g in names:
            out[g] = im.mean(hf)
    return out


def _extra_kv(source: ModelSource, plan: Plan, im: Imatrix | None) -> dict:
    rec = source.record()  # a label, never a local path: the bytes do not depend on where the run happened
    kv = {
        "general.quantized_by": "dynaquant",
        "dynaquant.version": __version__,
        "dynaquant.source": rec.label,
        "dynaquant.source.kind": rec.kind,
        "dynaquant.source.sha256": rec.sha256,
        "dynaquant.plan.method": plan.method,
        "dynaquant.plan.rules": list(plan.rules),
    }
    if im is not None:
        kv["dynaquant.imatrix.dataset"] = im.dataset
        kv["dynaquant.imatrix.chunks"] = im.chunks
    return kv


def _overhead_bytes(ts: TensorSource, tensors: list[TensorInfo], extra_kv: dict) -> int:
    """Bytes a GGUF file adds to its tensor data: header, metadata, tensor infos, alignment (upper bound)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "h.gguf")
        w = gguf.GGUFWriter(path, ts.arch)
        ts.add_metadata(w)
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
        for k, v in extra_kv.items():
            if isinstance(v, list):
                if v:
                    w.add_array(k, v)
            elif isinstance(v, str):
                w.add_string(k, v + " " * 64)  # room for longer values
            else:
                w.add_uint32(k, 0)
        for t in tensors:
            w.add_tensor_info(t.name, list(t.shape), np.dtype(np.float32), 4, raw_dtype=gguf.GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        header = os.path.getsize(path)
    return header + 32 * (len(tensors) + 1)


def file_type_of(plan: Plan, preset: str | None) -> int:
    """``general.file_type`` for a plan: the preset's, else the format holding most quantized weights."""
    if preset:
        return int(PRESETS[preset.upper()][1])
    counts = {f: n for f, n in plan.count_by_format().items() if f != "F32"} or {"F32": 1}
    bulk = max(sorted(counts), key=lambda f: counts[f])
    return int(_FILE_TYPE_OF_FORMAT.get(bulk, gguf.LlamaFileType.GUESSED))


def quantize(model: str | os.PathLike | None = None, *, output: str | os.PathLike | None = None,
             preset: str | None = None, bpw: float | None = None, size: int | None = None,
             rules: list[str] | tuple[str, ...] = (), plan: Plan | str | os.PathLike | None = None,
             report: dict | str | os.PathLike | None = None, imatrix: str | os.PathLike | None = None,
             calibration: str | os.PathLike | CalibrationSpec | None = None, calibration_chunks: int = 32,
             n_ctx: int = 512, use_imatrix: bool = True, default_rules_on: bool = True, evaluate: bool = False,
             eval_text: str | os.PathLike | None = None, eval_chunks: int = 16, allow_pickle: bool = False,
             trust_remote_code: bool = False, device: str | None = None, progress: bool = True,
             gptq: bool = False, gptq_damp: float = 0.01, target: str = "gguf",
             save_plan: str | os.PathLike | None = None, allow_nonfinite: bool = False) -> QuantizeResult:
    """Quantize a model to a mixed-precision GGUF file (or, ``target="safetensors"``, a safetensors checkpoint).

    Targets (at most one): ``preset`` (a llama.cpp mix, tensor by tensor as llama-quantize decides),
    ``bpw`` or ``size`` (a dynamic plan: every tensor's format chosen to minimise the KL divergence
    predicted by the analysis within the budget), or ``plan`` (used as is). None: a dynamic plan at the
    file size of the ``Q4_K_M`` preset (or the smallest size the default rules allow, if larger; for MoE
    models the routed experts stay within the default rules' caps, ~2 bits, so the file comes out smaller).

    Args:
        model: HF checkpoint folder, hub id, ``.gguf`` file, or None for the embedded default.
        output: the GGUF path; default ``<model>-<target>.gguf`` in the current folder. A vision-language
            checkpoint also gets ``mmproj-<output name>`` beside it (``QuantizeResult.mmproj``).
        rules: ``'REGEX=FORMAT'`` (or ``>=``, ``<=``) matched against GGUF tensor names, first match wins,
            before the default rules (``planner.default_rules``; off with ``default_rules_on=False``).
        report: an analysis report (``report.json`` path or dict) for dynamic plans; without one, the
            analysis runs here on ``calibration_chunks`` sequences.
        imatrix: an imatrix file (llama.cpp GGUF or legacy ``.dat``) for the encoders; default: the one
            beside the report or named by the plan, else computed on the calibration text.
        calibration: calibration text file, or a CalibrationSpec; default: stdlib docstrings.
        use_imatrix: encoders minimise the imatrix-weighted error.
        evaluate: also measure KLD/perplexity/top-1 against the source on ``eval_text`` (``eval_chunks`` chunks).
        device: torch device for calibration and encoding (default: CUDA when present).
        gptq: error-compensating rounding (GPTQ, Frantar et al. 2022) for every matmul weight, using
            each layer's input second moments from the calibration text (damping ``gptq_damp``); for each
            tensor the rounding (GPTQ or plain) with the lower layer-output error on two held-out
            calibration sequences is written. The GGUF layout is unchanged. Vector-quantized formats
            (IQ3_XXS, IQ3_S, IQ2_*, IQ1_*) have no per-weight rounding: their tensors are rounded plainly.
        target: ``gguf``, or ``safetensors``: a compressed-tensors checkpoint folder in the runtime formats,
            planned by ``bpw`` / ``size`` / ``plan`` (no presets), run by ``dynaquant.load``
            (:func:`dynaquant.pipeline.safetensors.quantize_safetensors`).
        save_plan: also write the plan as JSON here (atomically), as soon as it is made: before the encoding.
        allow_nonfinite: NaN and Inf weights are refused (``InputError`` naming the tensor and its file; a model
            loaded for calibration is checked before its first forward pass); with this they are written as
            :mod:`dynaquant.sources.nonfinite` documents (NaN -> 0, +-Inf -> +-the tensor's largest finite |value|).
    Returns:
        QuantizeResult (``gptq`` says per format how many tensors took GPTQ and the mean error ratio,
        or ``plain_only`` for the vector-quantized formats).
    Raises:
        checkpoint.SourceError: the model cannot be found or read.
        errors.InputError: before any work (``preflight``): a non-finite or non-positive ``bpw`` / ``size``;
            an output (``output``, ``save_plan``) that is an input or inside the source checkpoint folder,
            cannot be written, or lacks the free disk space its upper bound needs; later, a write that fails.
        planner.BudgetError: the target is below what the fixed rules need.
        ValueError: bad rules, plan, report, imatrix or options (messages name the culprit); a plan or
            preset with formats llama.cpp writes only with an imatrix (IQ3_XXS, IQ2_*, IQ1_*:
            ``presets.requires_imatrix``) when no imatrix is used or it lacks one of those tensors.
    """
    if target == "safetensors":
        if preset is not None:
            raise ValueError("presets are llama.cpp mixes; for the safetensors target give bpw, size or plan")
        from dynaquant.pipeline.safetensors import quantize_safetensors

        return quantize_safetensors(
            model, output=output, bpw=bpw, size=size, rules=rules, plan=plan, report=report, imatrix=imatrix,
            calibration=calibration, calibration_chunks=calibration_chunks, n_ctx=n_ctx, use_imatrix=use_imatrix,
            default_rules_on=default_rules_on, evaluate=evaluate, eval_text=eval_text, eval_chunks=eval_chunks,
            allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, device=device, progress=progress,
            gptq=gptq, gptq_damp=gptq_damp, save_plan=save_plan, allow_nonfinite=allow_nonfinite)
    if target != "gguf":
        raise ValueError(f"unknown target {target!r} (known: gguf, safetensors)")
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    if sum(x is not None for x in (preset, bpw, size, plan)) > 1:
        raise ValueError("give at most one of preset, bpw, size and plan")
    if preset is not None and preset.upper() not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    check_budget(bpw, size)
    inputs = {"plan": plan, "report": report, "imatrix": imatrix, "calibration text": calibration, "evaluation text": eval_text}
    check_outputs([Output(Path(p)) for p in (output, save_plan) if p is not None], inputs=inputs, source=model)
    device = device or default_device()
    source = resolve_source(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    ts = open_tensor_source(source)
    tensors = tensor_infos(ts)
    info = model_info(ts)
    spec = calibration if isinstance(calibration, CalibrationSpec) else CalibrationSpec(
        (str(calibration),) if calibration is not None else (), calibration_chunks, n_ctx)
    # Plan first where possible: a bad plan or an impossible budget fails before any model is loaded.
    loaded_plan = _load_plan(plan) if plan is not None else None
    report_d = load_report(report) if report is not None and not isinstance(report, dict) else report
    dynamic = loaded_plan is None and preset is None
    overhead = 0
    explicit_target = bpw is not None or size is not None
    if dynamic:
        kv = _extra_kv(source, _empty_plan(), Imatrix(dataset=" " * 64, chunks=0) if use_imatrix else None)
        overhead = _overhead_bytes(ts, tensors, kv)
        if bpw is None and size is None:
            size = make_plan(tensors, info, preset="Q4_K_M").size_bytes + overhead
        try:  # fails fast on an explicit target below what the rules need
            make_plan(tensors, info, rules=rules, bpw=bpw, size_bytes=size, overhead_bytes=overhead,
                      defaults=default_rules(info, (), use_imatrix) if default_rules_on else (),
                      has_imatrix=use_imatrix, lift_expert_caps=explicit_target)
        except BudgetError as e:
            if explicit_target:
                raise
            log.info("the Q4_K_M mix's size is below what the default rules need; default target %d bytes", e.min_bytes)
            size = e.min_bytes
    if loaded_plan is not None:
        loaded_plan.check_tensors(tensors, str(plan) if not isinstance(plan, Plan) else "plan")
        the_plan = loaded_plan
    elif preset is not None:
        the_plan = make_plan(tensors, info, source.model_id, preset=preset, rules=rules, has_imatrix=use_imatrix)
    if not use_imatrix and not dynamic:
        _check_imatrix_needs(the_plan, set())
    imat_path = _imatrix_path(imatrix, report, report_d, loaded_plan,
                              str(plan) if not isinstance(plan, Plan) else "plan", use_imatrix)
    needs_imatrix = use_imatrix and imat_path is None and (
        dynamic or any(get_format(e.format).kind != "float" for e in the_plan.entries))
    needs_analysis = dynamic and report_d is None
    # the outputs, with upper bounds of their bytes, before any weights are read (preflight)
    output = Path(output) if output is not None else Path.cwd() / f"{source.name}-{_target_label(None, preset, bpw, size)}.gguf"
    bound = tensor_bytes_bound(tensors, overhead or _overhead_bytes(ts, tensors, {}) + 4096 + sum(len(str(r)) + 64 for r in rules),
                               bpw=bpw, size=size, plan_bytes=None if dynamic else the_plan.size_bytes)
    check_outputs([Output(output, bound)] + ([Output(Path(save_plan), plan_json_bytes_bound(len(tensors)))] if save_plan else []),
                  inputs=inputs, source=source)
    if save_plan is not None and not dynamic:
        write_json(the_plan.to_dict(), save_plan)
    hf_model = load_model(source, device=device) if needs_imatrix or needs_analysis or evaluate or gptq else None
    if hf_model is not None:  # NaN/Inf: refused (or replaced) before any forward pass
        check_model_finite(hf_model, source_names(ts), str(source.path), allow_nonfinite)
    tokenizer = load_tokenizer(source) if hf_model is not None else None
    timings["load_s"] = time.perf_counter() - t0
    im = None
    stats = None
    if needs_analysis:
        from dynaquant.pipeline.analyze import run_analysis

        res = run_analysis(source, ts, hf_model, tokenizer, spec, fisher_sequences=8, progress=progress, timings=timings)
        report_d, im, stats = res.report, res.imatrix, res.stats
    elif needs_imatrix:
        t1 = time.perf_counter()
        if gptq:  # one pass gives the imatrix and GPTQ's second moments (held-out sequences excluded, as in the analysis)
            fit = calibration_ids(tokenizer, replace(spec, n_sequences=spec.n_sequences + 2))
            stats = collect_stats(hf_model, fit[:-2] if fit.shape[0] > 2 else fit, fisher_sequences=0, progress=progress)
            im = stats.to_imatrix(spec.id)
        else:
            im = compute_imatrix(hf_model, calibration_ids(tokenizer, spec), spec.id, progress=progress)
        timings["imatrix_s"] = time.perf_counter() - t1
    if dynamic:
        _check_report(report_d, tensors, report if not isinstance(report, dict) else "report")
        sw = [t["name"] for t in report_d["tensors"] if t.get("super_weight")]
        args = dict(overhead_bytes=overhead, error_fn=error_fn_from_report(report_d),
                    candidates=[c for c in report_d["candidates"] if c in GGUF_CANDIDATES] or GGUF_CANDIDATES,
                    defaults=default_rules(info, sw, use_imatrix) if default_rules_on else (),
                    error_source="measured kld", has_imatrix=use_imatrix, lift_expert_caps=explicit_target)
        try:
            the_plan = make_plan(tensors, info, source.model_id, rules=rules, bpw=bpw, size_bytes=size, **args)
        except BudgetError as e:
            if explicit_target:
                raise
            size = e.min_bytes  # the default target: the smallest the rules allow with the measured formats
            the_plan = make_plan(tensors, info, source.model_id, rules=rules, size_bytes=size, **args)
        if save_plan is not None:
            write_json(the_plan.to_dict(), save_plan)
    rounding = _GPTQRounding(hf_model, tokenizer, spec, stats, gptq_damp, device, progress, timings) if gptq else None
    if not evaluate:
        hf_model = None
    if im is not None:
        imat = imatrix_by_gguf_name(im, ts)
    elif imat_path is not None and use_imatrix:
        imat = _imatrix_from_file(imat_path, ts, info)
    else:
        imat = {}
    _check_imatrix_needs(the_plan, set(imat))
    dev = torch.device(device)

    def encode(t: SourceTensor, w: torch.Tensor, fmt: Format) -> np.ndarray:
        imp = imat.get(t.gguf_name) if fmt.kind != "float" else None
        if rounding is not None and fmt.kind != "float":
            q = rounding.encode(t, w.to(dev), fmt, imp)
            if q is not None:
                return q.cpu().numpy()
        q = encode_tensor(w.to(dev), fmt, imp)
        return q.cpu().numpy()

    t2 = time.perf_counter()
    write_gguf(output, ts, {e.name: get_format(e.format) for e in the_plan.entries}, encode,
               _extra_kv(source, the_plan, im), file_type_of(the_plan, preset if loaded_plan is None else None),
               progress=progress, allow_nonfinite=allow_nonfinite)
    timings["quantize_s"] = time.perf_counter() - t2
    result = QuantizeResult(output, the_plan, output.stat().st_size, the_plan.bpw, time.perf_counter() - t0,
                            im.chunks if im else 0, timings_s=timings, gptq=rounding.summary() if rounding else None)
    if size is not None and result.size_bytes > size:  # the overhead estimate is an upper bound; never expected
        output.unlink(missing_ok=True)
        raise RuntimeError(f"{output}: {result.size_bytes} bytes exceeds the target {size}; removed")
    if getattr(ts, "has_vision", False):  # Qwen2-VL: the vision tower goes to its own clip GGUF
        from dynaquant.exporters.gguf.mmproj import mmproj_path_for, write_mmproj

        result.mmproj = write_mmproj(source.path, mmproj_path_for(output), ftype="F16", progress=progress)
    if evaluate:
        result.eval = _evaluate_models(hf_model, _quantized_model(output, source, ts, device),
                                       tokenizer, eval_text, n_ctx, eval_chunks, progress)
    return result


class _GPTQRounding:
    """GPTQ rounding per tensor, kept where it lowers the layer-output error on held-out calibration inputs."""

    def __init__(self, model, tokenizer, spec: CalibrationSpec, stats, damp: float, device, progress: bool,
                 timings: dict):
        t0 = time.perf_counter()
        chunks = calibration_ids(tokenizer, replace(spec, n_sequences=spec.n_sequences + 2))
        if chunks.shape[0] < 3:
            raise ValueError(f"GPTQ needs at least 3 calibration sequences of {spec.seq_len} tokens; the text gives "
                             f"{chunks.shape[0]}")
        self.fit = stats if stats is not None else collect_stats(model, chunks[:-2], fisher_sequences=0, progress=progress)
        self.check = collect_stats(model, chunks[-2:], fisher_sequences=0, progress=False)
        self.damp, self.device = damp, device
        self.ratios: dict[str, list[float]] = {}
        self.used: dict[str, int] = {}
        self.plain_only: dict[str, int] = {}  # vector-quantized formats: no per-weight rounding, encoded plainly
        timings["gptq_stats_s"] = time.perf_counter() - t0

    def encode(self, t: SourceTensor, w: torch.Tensor, fmt: Format, imp) -> torch.Tensor | None:
        """GGUF bytes of one tensor, or None where GPTQ does not apply (the caller encodes plainly)."""
        from dynaquant.quant.codecs import dequantize
        from dynaquant.quant.gptq import gptq_round, output_error, supports_gptq

        module = module_of(t.hf_name)
        if module is None or module not in self.fit.input_of or w.ndim != 2 or t.gguf_name.startswith("token_embd"):
            return None
        if module not in self.check.input_of:  # a VL vision module: the held-out check is text only; plain rounding
            return None
        if not supports_gptq(fmt):
            self.plain_only[fmt.name] = self.plain_only.get(fmt.name, 0) + 1
            return None
        h_fit = self.fit.input(module).hessian.to(self.device)
        h_check = self.check.input(module).hessian.to(self.device)
        plain = encode_tensor(w, fmt, imp)
        g = gptq_round(w, fmt, h_fit, imp, damp=self.damp)
        e_plain = output_error(w, dequantize(plain, fmt).to(w.device), h_check)
        e_gptq = output_error(w, g.decoded.to(w.device), h_check)
        self.ratios.setdefault(fmt.name, []).append(e_gptq / e_plain if e_plain > 0 else 1.0)
        if e_gptq < e_plain:
            self.used[fmt.name] = self.used.get(fmt.name, 0) + 1
            return g.data
        return plain

    def summary(self) -> dict:
        """Per format: tensors tried, tensors that took GPTQ, mean held-out output-error ratio GPTQ / plain.

        Vector-quantized formats (no per-weight rounding) appear with ``gptq`` 0, ``mean_ratio`` None
        and ``plain_only`` True: all their tensors were encoded plainly.
        """
        out = {f: {"tensors": len(r), "gptq": self.used.get(f, 0), "mean_ratio": round(sum(r) / len(r), 4)}
               for f, r in self.ratios.items()}
        for f, n in self.plain_only.items():
            out[f] = {"tensors": n, "gptq": 0, "mean_ratio": None, "plain_only": True}
        return out


def _check_imatrix_needs(plan: Plan, have: set[str]) -> None:
    """Refuse, as ``llama-quantize`` does, tensors planned in a format that needs an imatrix
    (``presets.requires_imatrix``) when the imatrix used has no entry for them.

    Raises:
        ValueError: names the first such tensors and their formats.
    """
    bad = [f"{e.name} ({e.format})" for e in plan.entries if requires_imatrix(e.name, e.format) and e.name not in have]
    if bad:
        why = "no imatrix is used" if not have else "the imatrix has no entry for them"
        raise ValueError(f"{len(bad)} tensor(s) are planned in formats that need an imatrix (IQ3_XXS, IQ2_*, IQ1_*; "
                         f"llama-quantize refuses them too) but {why}: {', '.join(bad[:5])}"
                         + (" ..." if len(bad) > 5 else "") + "; give an imatrix (or calibration) or choose other formats")


def _check_report(report: dict, tensors: list[TensorInfo], where) -> None:
    have = {t["name"]: tuple(t["shape"]) for t in report["tensors"]}
    for t in tensors:
        if t.quantizable and have.get(t.name) != tuple(t.shape):
            raise ValueError(f"{where}: the report does not match the model: tensor {t.name} "
                             f"{'missing' if t.name not in have else f'has shape {list(have[t.name])}'}")


def _imatrix_path(imatrix, report, report_d, plan: Plan | None, plan_file: str = "plan",
                  use_imatrix: bool = True) -> Path | None:
    """The imatrix file to use: given, named by the plan, or beside the report.

    Raises:
        InputError: the plan names an imatrix that does not exist, no ``imatrix`` is given and ``use_imatrix``
            (computing another one silently would give other bytes than the plan was made for).
    """
    if imatrix is not None:
        return Path(imatrix)
    if plan is not None and plan.sources.get("imatrix"):
        named = Path(plan.sources["imatrix"])
        if named.is_file():
            return named
        if use_imatrix:
            raise InputError(f"{plan_file}: the imatrix the plan was made with, {named}, does not exist; give it (or "
                             "another) with --imatrix, or quantize without one with --no-imatrix")
    if report_d is not None and report is not None and not isinstance(report, dict) and report_d.get("imatrix"):
        p = Path(report).parent / report_d["imatrix"]
        return p if p.exists() else None
    return None


def _imatrix_from_file(path: Path, ts: TensorSource, info: ModelInfo) -> dict[str, torch.Tensor]:
    """GGUF name -> (K,) importance from an imatrix file; ``output.weight`` serves a tied ``token_embd``."""
    from dynaquant.analysis.imatrix_io import load_imatrix

    means = load_imatrix(path).means()
    names = {t.gguf_name for t in ts.tensors()}
    if info.tied_embeddings and "output.weight" in means:
        means["token_embd.weight"] = means.pop("output.weight")
    return {k: v for k, v in means.items() if k in names}


def _empty_plan() -> Plan:
    return Plan("gguf", "", [], "allocation size<=000000000000")


def _target_label(plan: Plan, preset, bpw, size) -> str:
    if preset:
        return preset.upper()
    if bpw is not None:
        return f"{bpw:g}bpw"
    if size is not None:
        return f"dynamic-{size / 1e6:.0f}MB"
    return "plan"


def _load_plan(plan: Plan | str | os.PathLike) -> Plan:
    """A plan object as is, or a plan.json read and validated (``Plan.from_dict``).

    Raises:
        InputError: unreadable, not UTF-8 or not JSON (names the file); quant.plan.PlanError: not a valid plan.
    """
    if isinstance(plan, Plan):
        return plan
    p = Path(plan)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON, UTF-8, or a 4300+ digit integer
        raise InputError(f"{p}: cannot read plan: {exc}") from exc
    return Plan.from_dict(data, str(p))


def _evaluate_models(reference, quantized, tokenizer, text, n_ctx, chunks, progress) -> EvalResult:
    body, text_id = read_text(text, default_eval_text)
    ids = tokenize_chunks(tokenizer, body, n_ctx, chunks)
    return compare_models(reference, quantized, ids, text_id, progress=progress)


def source_of(path: str | os.PathLike) -> str | None:
    """The ``dynaquant.source`` label recorded in a GGUF written by dynaquant, or None."""
    rec = recorded_source(path)
    return rec.label if rec is not None else None


def recorded_source(path: str | os.PathLike) -> SourceRecord | None:
    """The source recorded in a GGUF written by dynaquant (kind and hash None in older files), or None.

    Raises:
        InputError: the file is not a readable GGUF, or a key holds another kind of value (names the file).
    """
    from dynaquant.sources.readers import gguf_field, open_gguf

    reader = open_gguf(path)
    got = {k: gguf_field(reader, path, f"dynaquant.{k}", str) for k in ("source", "source.kind", "source.sha256")}
    if got["source"] is None:
        return None
    return SourceRecord(got["source"], got["source.kind"], got["source.sha256"])


def evaluate(quantized: str | os.PathLike, reference: str | os.PathLike | None = None, *,
             text: str | os.PathLike | None = None, n_ctx: int = 512, chunks: int | None = 16,
             device: str | None = None, progress: bool = True) -> EvalResult:
    """Mean KLD, perplexity and top-1 agreement of a quantized GGUF (or safetensors checkpoint) against its original.

    Computed in PyTorch on the decoded weights, scoring tokens as ``llama-perplexity
    --kl-divergence`` does (see ``analysis.evaluate``).

    Args:
        quantized: a GGUF file, or a safetensors checkpoint folder (run by ``dynaquant.load``, float32).
        reference: the original model (default: the source recorded in the file, found as
            :func:`checkpoint.find_reference` says: a local source never on the hub); it must have the
            recorded content hash.
        text: evaluation text file (default: stdlib docstrings, disjoint from the calibration default).
        n_ctx: tokens per chunk; chunks: at most this many chunks (None: all).
    Raises:
        InputError: no reference given and none recorded in the file, the recorded local source not found, or
            a reference whose content hash differs from the recorded one (naming the model expected).
    """
    device = device or default_device()
    from dynaquant.runtime.loader import is_runtime_checkpoint

    if is_runtime_checkpoint(quantized):
        from dynaquant.pipeline.safetensors import recorded_source_of_checkpoint
        from dynaquant.runtime.loader import load

        qmodel = load(quantized, device=device, dtype=torch.float32)  # first: a damaged checkpoint fails before the reference loads
        rsrc = find_reference(recorded_source_of_checkpoint(quantized), quantized, reference)
        return _evaluate_models(load_model(rsrc, device=device), qmodel, load_tokenizer(rsrc), text, n_ctx, chunks, progress)
    qsrc = resolve_source(quantized)
    # reads the header: a damaged file is refused before any model loads
    rsrc = find_reference(recorded_source(qsrc.path), quantized, reference)
    return _evaluate_models(load_model(rsrc, device=device), _quantized_model(qsrc.path, rsrc, None, device),
                            load_tokenizer(rsrc), text, n_ctx, chunks, progress)


def _quantized_model(path, reference: ModelSource, ts: TensorSource | None, device):
    """A GGUF file as a transformers model: transformers' GGUF loader for the dense Llama family, else
    (MoE experts, MLA, VL language models) the reference's model with our decoded weights (``decoded.py``)."""
    from dynaquant.runtime.decoded import load_decoded, uses_own_decoder

    if reference.kind == "hf":
        ts = ts if ts is not None else open_tensor_source(reference)
        if uses_own_decoder(ts):
            return load_decoded(path, reference, ts, device=device)
    return load_model(resolve_source(path), device=device)
