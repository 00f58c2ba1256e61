"""The quantize pipeline for the safetensors target: source -> imatrix -> plan -> compressed-tensors checkpoint.

``dynaquant.quantize(..., target="safetensors")`` (``dynaquant quantize --format safetensors``) runs
:func:`quantize_safetensors`. It shares the GGUF pipeline's steps (model source, calibration,
analysis, plans, GPTQ rounding; :mod:`dynaquant.pipeline.quantize`) and differs in what it writes: the
source model is loaded with transformers (Hugging Face tensor names and orientation, whatever the
source), every planned weight is encoded to its runtime format (:func:`dynaquant.quant.runtime.encode`,
imatrix-weighted, super weights of the analysis kept exactly) and the checkpoint is written by
:func:`dynaquant.exporters.safetensors.writer.write_safetensors`. A ``size`` budget counts the bytes of
the safetensors shards.

Mixture-of-experts models: the stacked expert tensors of the plan are read from the model's experts modules
(:func:`dynaquant.runtime.moe.checkpoint_weights`), encoded expert by expert with each expert's own imatrix
row (:func:`dynaquant.runtime.moe.encode_experts`; plain rounding, GPTQ does not apply to them, nor do
super weights) and written per expert.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.analysis.stats import compute_imatrix
from dynaquant.exporters.safetensors.writer import (
    DEFAULT_SHARD_BYTES,
    check_output_folder,
    safetensors_overhead_bytes,
    unquantized_linears,
    write_safetensors,
)
from dynaquant.pipeline.preflight import (
    Output,
    check_budget,
    check_outputs,
    plan_json_bytes_bound,
    side_files_bytes_bound,
    tensor_bytes_bound,
)
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan, PlanEntry
from dynaquant.quant.planner import RUNTIME_CANDIDATES, default_rules, error_fn_from_report, make_plan
from dynaquant.quant.runtime import RuntimeWeight, from_records
from dynaquant.quant.runtime import encode as encode_runtime
from dynaquant.runtime.moe import checkpoint_weights, encode_experts, in_memory_plan
from dynaquant.sources.checkpoint import SourceRecord, load_model, load_tokenizer, read_json_object, resolve_source
from dynaquant.sources.nonfinite import check_model_finite, source_names

log = logging.getLogger(__name__)


def _super_weights(report: dict | None) -> dict[str, list[tuple[int, int]]]:
    """HF module -> [(row, col)] of the report's confirmed super weights."""
    out: dict[str, list[tuple[int, int]]] = {}
    for s in (report or {}).get("super_weights", []):
        if s.get("confirmed") and s.get("module"):
            out.setdefault(s["module"], []).append((int(s["row"]), int(s["column"])))
    return out


class _Tensor:
    """The names ``_GPTQRounding.encode`` reads from a source tensor."""

    def __init__(self, e: PlanEntry):
        self.gguf_name, self.hf_name = e.name, e.hf_name


def quantize_safetensors(model=None, *, output=None, bpw=None, size=None, rules=(), plan=None, report=None, imatrix=None,
                         calibration=None, calibration_chunks: int = 32, n_ctx: int = 512, use_imatrix: bool = True,
                         default_rules_on: bool = True, evaluate: bool = False, eval_text=None, eval_chunks: int = 16,
                         allow_pickle: bool = False, trust_remote_code: bool = False, device: str | None = None,
                         progress: bool = True, gptq: bool = False, gptq_damp: float = 0.01, keep_super_weights: bool = True,
                         max_shard_bytes: int = DEFAULT_SHARD_BYTES, save_plan=None, allow_nonfinite: bool = False):
    """Quantize a model to a safetensors checkpoint in runtime formats (arguments as ``dynaquant.quantize``).

    Targets (at most one): ``bpw`` or ``size`` (a dynamic plan over ``RUNTIME_CANDIDATES``: the analysis
    report must have measured runtime formats, ``dynaquant analyze --formats safetensors``; without a
    report the analysis runs here), or ``plan`` (a safetensors plan, used as is). None: a dynamic plan at
    the GGUF ``Q4_K_M`` file size. Presets do not apply.

    Args:
        keep_super_weights: keep the analysis' confirmed super weights exactly (config extension).
        max_shard_bytes: shard size of the checkpoint.
        save_plan: also write the plan as JSON here (atomically), as soon as it is made: before the encoding.
    Returns:
        pipeline.QuantizeResult: ``output`` is the checkpoint folder, ``size_bytes`` its shards' bytes.
    Raises:
        checkpoint.SourceError, planner.BudgetError, ValueError: as ``dynaquant.quantize``; also a GGUF plan,
        or a report without runtime formats.
        errors.InputError: as ``dynaquant.quantize`` (budget, outputs and free disk space checked before any work).
    """
    from dynaquant.analysis.report.schema import load_report, write_json
    from dynaquant.pipeline.quantize import (
        QuantizeResult,
        _check_report,
        _evaluate_models,
        _GPTQRounding,
        _imatrix_from_file,
        _imatrix_path,
        _load_plan,
        calibration_ids,
        default_device,
        imatrix_by_gguf_name,
        model_info,
        open_tensor_source,
        tensor_infos,
    )
    from dynaquant.runtime.loader import load

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    if sum(x is not None for x in (bpw, size, plan)) > 1:
        raise ValueError("give at most one of bpw, size and plan")
    check_budget(bpw, size)
    inputs = {"plan": plan, "report": report, "imatrix": imatrix, "calibration text": calibration, "evaluation text": eval_text}
    check_outputs(([Output(Path(output), folder=True)] if output is not None else [])
                  + ([Output(Path(save_plan))] if save_plan is not None else []), inputs=inputs, source=model)
    device = device or default_device()
    source = resolve_source(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    ts = open_tensor_source(source, full_vl=True)
    tensors = tensor_infos(ts)
    info = model_info(ts)
    spec = calibration if isinstance(calibration, CalibrationSpec) else CalibrationSpec(
        (str(calibration),) if calibration is not None else (), calibration_chunks, n_ctx)
    loaded_plan = _load_plan(plan) if plan is not None else None
    where = str(plan) if plan is not None and not isinstance(plan, Plan) else "plan"
    if loaded_plan is not None:
        if loaded_plan.target != "safetensors":
            raise ValueError(f"{where}: a {loaded_plan.target} plan; make one with 'dynaquant plan --target safetensors'")
        loaded_plan.check_tensors(tensors, where)
    report_d = load_report(report) if report is not None and not isinstance(report, dict) else report
    if report_d is None and loaded_plan is not None and loaded_plan.sources.get("report"):
        p = Path(loaded_plan.sources["report"])
        report_d = load_report(p) if p.is_file() else None
    dynamic = loaded_plan is None
    overhead = safetensors_overhead_bytes(tensors)
    defaults = default_rules(info, target="safetensors") if default_rules_on else ()
    if dynamic:
        if bpw is None and size is None:
            size = make_plan(tensors, info, preset="Q4_K_M").size_bytes + overhead
        make_plan(tensors, info, rules=rules, bpw=bpw, size_bytes=size, overhead_bytes=overhead, defaults=defaults,
                  target="safetensors")  # fails fast on an impossible budget or a bad rule
        if report_d is not None and not [c for c in report_d["candidates"] if get_format(c).allowed_in("safetensors")]:
            raise ValueError(f"{report if not isinstance(report, dict) else 'report'}: the analysis measured no "
                             "safetensors formats; run 'dynaquant analyze --formats safetensors'")
    imat_path = _imatrix_path(imatrix, report, report_d, loaded_plan, where, use_imatrix)
    needs_analysis = dynamic and report_d is None
    needs_imatrix = use_imatrix and imat_path is None and not needs_analysis
    if output is None:
        label = f"{bpw:g}bpw" if bpw is not None else (f"{size / 1e6:.0f}MB" if size is not None else "plan")
        output = Path.cwd() / f"{source.name}-{label}-safetensors"
    bound = tensor_bytes_bound(tensors, overhead, bpw=bpw, size=size, plan_bytes=None if dynamic else loaded_plan.size_bytes)
    check_outputs([Output(Path(output), bound + side_files_bytes_bound(source, ts), folder=True)]
                  + ([Output(Path(save_plan), plan_json_bytes_bound(len(tensors)))] if save_plan is not None else []),
                  inputs=inputs, source=source)
    check_output_folder(output)
    if save_plan is not None and not dynamic:
        write_json(loaded_plan.to_dict(), save_plan)
    hf_model = load_model(source, device=device)
    check_model_finite(hf_model, source_names(ts), str(source.path), allow_nonfinite)  # before any forward pass
    tokenizer = load_tokenizer(source)
    timings["load_s"] = time.perf_counter() - t0
    im = stats = None
    if needs_analysis:
        from dynaquant.pipeline.analyze import run_analysis

        res = run_analysis(source, ts, hf_model, tokenizer, spec, candidates=RUNTIME_CANDIDATES, fisher_sequences=8,
                           progress=progress, timings=timings)
        report_d, im, stats = res.report, res.imatrix, res.stats
    elif needs_imatrix:
        t1 = time.perf_counter()
        im = compute_imatrix(hf_model, calibration_ids(tokenizer, spec), spec.id, progress=progress)
        timings["imatrix_s"] = time.perf_counter() - t1
    if dynamic:
        _check_report(report_d, tensors, report if report is not None and not isinstance(report, dict) else "report")
        sw_tensors = [t["name"] for t in report_d["tensors"] if t.get("super_weight")]
        the_plan = make_plan(tensors, info, source.model_id, rules=rules, bpw=bpw, size_bytes=size, overhead_bytes=overhead,
                             error_fn=error_fn_from_report(report_d),
                             candidates=[c for c in report_d["candidates"] if get_format(c).allowed_in("safetensors")],
                             defaults=default_rules(info, sw_tensors, target="safetensors") if default_rules_on else (),
                             error_source="measured kld", target="safetensors")
        if save_plan is not None:
            write_json(the_plan.to_dict(), save_plan)
    else:
        the_plan = loaded_plan
    if not use_imatrix:
        imat = {}
    elif im is not None:
        imat = imatrix_by_gguf_name(im, ts)
    else:
        imat = _imatrix_from_file(imat_path, ts, info) if imat_path is not None else {}
    rounding = _GPTQRounding(hf_model, tokenizer, spec, stats, gptq_damp, device, progress, timings) if gptq else None
    keep = _super_weights(report_d) if keep_super_weights else {}
    kept: dict[str, list] = {}
    dev = torch.device(device)

    def encode(e: PlanEntry, w: torch.Tensor) -> RuntimeWeight | list[RuntimeWeight]:
        fmt = get_format(e.format)
        if w.ndim == 3:  # stacked experts
            return encode_experts(w, fmt.name, imat.get(e.name), device=dev)
        module = e.hf_name.removesuffix(".weight")
        imp = imat.get(e.name)
        sw = keep.get(module)
        rw = None
        if rounding is not None and fmt.name != "NVFP4_G16":  # NVFP4's global scale is per tensor: plain rounding
            q = rounding.encode(_Tensor(e), w.to(dev, torch.float32), fmt, imp)
            if q is not None:
                rw = from_records(q, fmt, tuple(w.shape))
                if sw:
                    r, c = zip(*sw)
                    rw.super_weights = (torch.tensor(r), torch.tensor(c), w.detach()[list(r), list(c)].float().cpu())
        if rw is None:
            rw = encode_runtime(w.to(dev, torch.float32), fmt, imp, super_weights=tuple(zip(*sw)) if sw else None)
        if rw.super_weights is not None:
            kept[module] = [[int(r), int(c), float(v)] for r, c, v in zip(*(t.tolist() for t in rw.super_weights))]
        return rw.to("cpu")

    config = hf_model.config.to_dict()
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    config.pop("_name_or_path", None)  # the local path transformers loaded it from: never published
    config["architectures"] = config.get("architectures") or [type(hf_model).__name__]  # vLLM picks the class by it
    weights = checkpoint_weights(hf_model)
    write_plan = in_memory_plan(the_plan, weights)  # the source's on-disk names -> the model's (Mixtral's router)
    ignore = unquantized_linears(hf_model, write_plan)

    def extra_files(folder: Path) -> None:
        tokenizer.save_pretrained(str(folder))
        if getattr(ts, "vision", False):  # processor configs, chat template (VL models)
            from dynaquant.sources.hf_vl_full import copy_processor_files

            copy_processor_files(source.path, folder)
        if getattr(hf_model, "generation_config", None) is not None:
            hf_model.generation_config.save_pretrained(str(folder))

    t2 = time.perf_counter()
    written = write_safetensors(output, write_plan, weights, encode, config, ignore=ignore, super_weights=kept,
                                extension={"source": source.model_id, "source_kind": source.origin,
                                           "source_sha256": source.sha256, "plan_method": the_plan.method,
                                           "bpw": round(the_plan.bpw, 4)},
                                extra_files=extra_files, max_shard_bytes=max_shard_bytes, progress=progress)
    timings["quantize_s"] = time.perf_counter() - t2
    result = QuantizeResult(written.path, the_plan, written.size_bytes, the_plan.bpw, time.perf_counter() - t0,
                            im.chunks if im else 0, timings_s=timings, gptq=rounding.summary() if rounding else None)
    if size is not None and result.size_bytes > size:  # the overhead estimate is an upper bound; never expected
        import shutil

        shutil.rmtree(written.path, ignore_errors=True)
        raise RuntimeError(f"{written.path}: {result.size_bytes} bytes exceeds the target {size}; removed")
    if evaluate:
        result.eval = _evaluate_models(hf_model, load(written.path, device=device, dtype=torch.float32), tokenizer,
                                       eval_text, n_ctx, eval_chunks, progress)
    return result


def source_of_checkpoint(path: str | os.PathLike) -> str | None:
    """The ``source`` label recorded in a dynaquant safetensors checkpoint's config extension, or None."""
    rec = recorded_source_of_checkpoint(path)
    return rec.label if rec is not None else None


def recorded_source_of_checkpoint(path: str | os.PathLike) -> SourceRecord | None:
    """The source recorded in a dynaquant safetensors checkpoint's config extension (``source``,
    ``source_kind``, ``source_sha256``; the last two None in older checkpoints), or None.

    Raises:
        InputError: config.json cannot be read or is not a JSON object (named).
    """
    qc = read_json_object(Path(path) / "config.json").get("quantization_config") or {}
    ext = qc.get("dynaquant") or {} if isinstance(qc, dict) else {}
    if not isinstance(ext, dict) or not ext.get("source"):
        return None
    return SourceRecord(str(ext["source"]), ext.get("source_kind"), ext.get("source_sha256"))
