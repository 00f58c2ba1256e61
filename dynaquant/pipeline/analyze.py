"""The analysis pipeline: source -> calibration pass -> per-tensor errors -> report.json + imatrix.gguf.

``analyze`` is what ``dynaquant analyze`` runs; ``run_analysis`` is the same on an already
loaded model (``quantize`` without a report calls it). See :mod:`dynaquant.analysis.report.schema`
for the report's layout.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dynaquant import distributed
from dynaquant.analysis import experts
from dynaquant.analysis.calibration import CalibrationSpec, calibration_chunks
from dynaquant.analysis.errors import SAMPLE_FRACTION, ErrorSample, measure_samples, sample_tensor
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.report.schema import save_report, tensor_group
from dynaquant.analysis.sensitivity import ReferenceLogits, group_sensitivity, kld_with_weights, tf32_matmuls
from dynaquant.analysis.stats import ModelStats, collect_stats
from dynaquant.analysis.superweights import confirm, find_candidates
from dynaquant.config import CORRECT_SEQUENCES, DEFAULT_CANDIDATES, FISHER_SEQUENCES, AnalyzeConfig
from dynaquant.names import TensorName
from dynaquant.pipeline.analysis_report import (
    AnalysisResult,
    build_report,
    layer_of,
    row_weights_of,
    tensor_entry,
    weight_of,
)
from dynaquant.pipeline.corrections import check_options as check_correct_options
from dynaquant.pipeline.corrections import correct_in_model
from dynaquant.pipeline.plan import error_fn_from_report
from dynaquant.pipeline.preflight import Output, analysis_bytes_bound, check_outputs, check_whole_model_gpu
from dynaquant.pipeline.source import default_device, kept_types, model_info, open_tensor_source, tensor_infos
from dynaquant.pipeline.targets import gguf_planning_overhead
from dynaquant.quant.codecs import get_codec
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan
from dynaquant.quant.planner import default_rules, make_plan
from dynaquant.sources.checkpoint import ModelSource, load_tokenizer, resolve_source
from dynaquant.sources.experts import stacked_name
from dynaquant.sources.gguf import TensorSource
from dynaquant.sources.model import load_model
from dynaquant.sources.nonfinite import check_model_finite, source_names

log = logging.getLogger(__name__)

# Sampled weights whose errors are measured in one call at least (consecutive decoder blocks gathered until then): a
# small model's block is a few hundred thousand sampled weights, and each call encodes them once per format. Held at
# once: the samples, their importance and one format's decoded copy (12 bytes a weight, ~200 MB).
GROUP_WEIGHTS = 1 << 24


def expand_formats(text: str) -> tuple[str, ...]:
    """Candidate formats from a comma-separated list of names, where ``gguf`` stands for the GGUF
    candidates and ``safetensors`` for the runtime ones (``"gguf,safetensors"``, ``"Q4_K,INT4_G128"``).

    Raises:
        KeyError: an unknown format name.
    """
    from dynaquant.quant.planner import RUNTIME_CANDIDATES

    out: list[str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        groups = {"GGUF": DEFAULT_CANDIDATES, "SAFETENSORS": RUNTIME_CANDIDATES}
        names = groups[item.upper()] if item.upper() in groups else (get_format(item).name,)
        out += [n for n in names if n not in out]
    return tuple(out)


def _error_groups(src_tensors) -> list[list[int]]:
    """Indices of the tensors whose errors are measured together: a decoder block's (per tower), else one tensor."""
    groups: dict[object, list[int]] = {}
    for i, t in enumerate(src_tensors):
        tn = TensorName.from_gguf(t.gguf_name)
        groups.setdefault((tn.tower, tn.block) if tn.block is not None else t.gguf_name, []).append(i)
    return list(groups.values())


def _measure_tensors(model, src_tensors, stats: ModelStats, tied: bool, candidates: tuple[str, ...], sw_tensors: set,
                     progress: bool, stored: dict[str, str], fraction: int = SAMPLE_FRACTION,
                     ) -> tuple[list[dict], dict[str, torch.Tensor | None]]:
    """The report's tensor entries with the errors of every candidate format, and the encoder imatrix of each
    measured tensor (by HF name). A decoder block's tensors, and all experts of its MoE layer, are measured
    together (:func:`dynaquant.analysis.errors.measure_samples`), with the results of one tensor at a time; a
    tensor's stored GGUF type (``stored``, by GGUF name) is its source bytes, error 0; ``fraction``: the rows
    sampled (:func:`dynaquant.analysis.errors.sample_size`)."""
    entries = [tensor_entry(t, sw_tensors) for t in src_tensors]
    enc_imatrix: dict[str, torch.Tensor | None] = {}
    bar = tqdm(total=len(src_tensors), desc="errors", disable=not progress, unit="tensor")
    samples: list[ErrorSample] = []
    owners = []  # (entry index, its samples' range, the experts' statistics or None)
    pending = 0  # tensors of the groups whose samples wait

    def measure():  # the samples gathered so far, in one measure_samples call
        nonlocal pending
        results = measure_samples(samples, list(candidates))
        for i, a, b, st in owners:
            errs = results[a] if st is None else experts.combine_expert_errors(st, results[a:b])
            entries[i]["errors"] = {f: v.to_dict() for f, v in errs.items()}
        bar.update(pending)
        samples.clear()
        owners.clear()
        pending = 0

    for group in _error_groups(src_tensors):
        for i in group:
            t, e = src_tensors[i], entries[i]
            stacked = stacked_name(t.hf_name)
            if t.quantizable and stacked and stacked[0] in stats.experts:
                st = stats.experts[stacked[0]]
                ss, fallback = experts.expert_samples(model.get_submodule(stacked[0]), stacked[1], st,
                                                      total_tokens=stats.tokens, fisher_total=stats.fisher_tokens,
                                                      fraction=fraction)
                owners.append((i, len(samples), len(samples) + len(ss), st))
                samples += ss
                e["experts"] = {"n_expert": st.n_expert, "fallback": fallback}
                if fallback:
                    log.warning("%s: experts %s saw no calibration tokens (or none with gradients): measured with the "
                                "layer's pooled statistics", t.gguf_name, fallback)
            elif t.quantizable:
                w = weight_of(model, t)
                rw, imp = row_weights_of(t, stats, tied, stats.token_counts)
                if w is not None and rw is not None and tuple(w.shape) == tuple(t.shape):
                    owners.append((i, len(samples), len(samples) + 1, None))
                    samples.append(sample_tensor(w.detach(), rw, imatrix=imp, stored=stored.get(t.gguf_name),
                                                 fraction=fraction))
                    if t.hf_name:
                        enc_imatrix[t.hf_name] = imp
                else:
                    log.warning("%s: no calibration statistics or weight shape mismatch; not measured", t.gguf_name)
        pending += len(group)
        # several small groups in one call (fewer, larger codec calls; the same results): until GROUP_WEIGHTS
        if sum(x.rows.numel() for x in samples) >= GROUP_WEIGHTS:
            measure()
    if pending:
        measure()
    bar.close()
    return entries, enc_imatrix


def run_analysis(source: ModelSource, ts: TensorSource, model, tokenizer, spec: CalibrationSpec, *,
                 candidates: tuple[str, ...] = DEFAULT_CANDIDATES, fisher_sequences: int = 16,
                 super_weights: bool = True, sensitivity_formats: tuple[str, ...] = (),
                 validate: tuple[tuple[str, int], ...] = (), overhead_bytes: int = 0,
                 progress: bool = True, timings: dict | None = None, correct_rounds: int = 0,
                 correct_sequences: int = CORRECT_SEQUENCES, allow_nonfinite: bool = False,
                 sample_fraction: int = SAMPLE_FRACTION) -> AnalysisResult:
    """Analyse a loaded model (see ``analyze``); ``validate`` is (label, size_bytes) pairs of plans to check, each
    also corrected (:mod:`dynaquant.pipeline.corrections`) with ``correct_rounds`` > 0 (the report's ``corrections``
    section gathers the rounds of every size; each ``plans`` row gets ``corrected``: the final plan's figures). A
    tensor of a GGUF source planned in its stored type keeps the source's bytes, so that format's error is 0 (not with
    ``allow_nonfinite``: the model's weights may then differ from the stored ones); ``sample_fraction``: the rows
    of each tensor whose errors are measured (:func:`dynaquant.analysis.errors.sample_size`). On CUDA the calibration
    passes run their float32 matmuls on TF32 tensor cores (:func:`~dynaquant.analysis.sensitivity.tf32_matmuls`; the
    input moments: :func:`dynaquant.analysis.moments.gram`), as llama.cpp's imatrix runs its GPU matmuls in half
    precision."""
    timings = {} if timings is None else timings
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    all_chunks = calibration_chunks(tokenizer, replace(spec, n_sequences=spec.n_sequences + 2))
    held = all_chunks[-2:] if all_chunks.shape[0] > 2 else all_chunks[:1]
    chunks = all_chunks[:-2] if all_chunks.shape[0] > 2 else all_chunks
    samples = chunks
    if getattr(ts, "vision", False):  # a VL source: image + text batches first (hf_vl_full)
        from dynaquant.analysis.vl_calibration import vl_calibration_samples

        samples = vl_calibration_samples(ts.folder, tokenizer, chunks, spec.images, spec.n_images,
                                         trust_remote_code=source.trust_remote_code)
    with tf32_matmuls(device):  # the calibration forward (and Fisher backward) passes; the moments: stats' gram
        stats = collect_stats(model, samples, fisher_sequences=fisher_sequences, progress=progress)
    timings["calibration_s"] = time.perf_counter() - t0
    info = model_info(ts)
    src_tensors = ts.tensors()

    gguf_of_param = {t.hf_name: t.gguf_name for t in src_tensors if t.hf_name}
    t1 = time.perf_counter()
    sws = []
    if super_weights:
        sws = confirm(model, find_candidates(model, stats), held[:1])
        for s in sws:
            s.tensor = gguf_of_param.get(s.module + ".weight")
    timings["super_weights_s"] = time.perf_counter() - t1
    sw_tensors = {s.tensor for s in sws if s.confirmed and s.tensor}

    t2 = time.perf_counter()
    entries, enc_imatrix = _measure_tensors(model, src_tensors, stats, info.tied_embeddings, candidates, sw_tensors,
                                            progress, kept_types(ts, allow_nonfinite), sample_fraction)
    timings["errors_s"] = time.perf_counter() - t2

    report = build_report(source, ts, spec, stats, entries, sws, candidates, device=device,
                          dtype=next(model.parameters()).dtype, overhead_bytes=overhead_bytes, timings=timings)
    imatrix_of = enc_imatrix.get
    tensors = tensor_infos(ts)
    by_gguf = {t.gguf_name: t for t in src_tensors}
    if sensitivity_formats or validate:
        ref = ReferenceLogits(model, held)
    if sensitivity_formats:
        t3 = time.perf_counter()
        groups: dict[str, list[str]] = {}
        for t in src_tensors:
            g = tensor_group(t.gguf_name)
            if t.quantizable and t.hf_name and g in ("attn", "ffn") and layer_of(t.gguf_name) is not None:
                groups.setdefault(f"blk.{layer_of(t.gguf_name)}.{g}", []).append(t.hf_name)
        rows = group_sensitivity(model, ref, groups, sensitivity_formats, imatrix_of, progress)
        pred = {e["name"]: e["errors"] for e in entries}
        for r in rows:
            layer, kind = int(r["group"].split(".")[1]), r["group"].split(".")[2]
            r.update(layer=layer, kind=kind, kld_pred=_group_pred(r["group"], r["format"], src_tensors, pred))
        report["sensitivity"] = rows
        timings["sensitivity_s"] = time.perf_counter() - t3
    if validate:
        t4 = time.perf_counter()
        def plan_at(size: int, err_fn) -> Plan:
            return make_plan(tensors, info, source.model_id, size_bytes=size, overhead_bytes=overhead_bytes,
                             error_fn=err_fn, defaults=default_rules(info, sorted(sw_tensors)),
                             candidates=[c for c in candidates if get_format(c).allowed_in("gguf")] or None,
                             error_source="measured kld", has_imatrix=True)

        err_fn = error_fn_from_report(report)
        for label, size in validate:
            plan = plan_at(size, err_fn)
            params = dict(model.named_parameters())  # a tied output head has no parameter of its own
            fmts = {by_gguf[e.name].hf_name: e.format for e in plan.entries
                    if by_gguf[e.name].quantizable and by_gguf[e.name].hf_name in params}
            report["plans"].append({"label": label, "size_bytes": plan.size_bytes + overhead_bytes, "bpw": plan.bpw,
                                    "kld_pred": plan.kld_pred, "kld_measured": kld_with_weights(model, ref, fmts, imatrix_of),
                                    "formats": plan.formats()})
            if correct_rounds > 0:
                fixed, report["corrections"] = correct_in_model(
                    model, tokenizer, spec, report, tensors, lambda rep, size=size: plan_at(size, error_fn_from_report(rep)),
                    imatrix_of, rounds=correct_rounds, sequences=correct_sequences, label=label, progress=progress)
                report["plans"][-1]["corrected"] = {"kld_pred": fixed.kld_pred,
                                                    "kld_measured": fixed.corrections["kld_measured"],
                                                    "rounds": len(fixed.corrections["rounds"]),
                                                    "size_bytes": fixed.size_bytes + overhead_bytes}
        timings["validate_s"] = time.perf_counter() - t4
    return AnalysisResult(report, stats, stats.to_imatrix(spec.id))


def _group_pred(group: str, fmt: str, src_tensors, pred: dict) -> float | None:
    from dynaquant.quant.formats import resolve_for_row

    tot = 0.0
    for t in src_tensors:
        if t.quantizable and t.gguf_name.startswith(group.rsplit(".", 1)[0] + ".") and \
                tensor_group(t.gguf_name) == group.rsplit(".", 1)[1]:
            f = resolve_for_row(fmt, t.row_size)[0].name
            e = pred.get(t.gguf_name, {}).get(f)
            if e is None:
                return None
            tot += e["kld_pred"]
    return tot


def analyze(model: str | os.PathLike | None = None, output_dir: str | os.PathLike | None = None, *,
            calibration: CalibrationSpec | None = None, candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
            fisher_sequences: int = FISHER_SEQUENCES, super_weights: bool = True, sensitivity_formats: tuple[str, ...] = (),
            validate_presets: tuple[str, ...] = (), device: str | None = None, dtype: str = "float32",
            allow_pickle: bool = False, trust_remote_code: bool = False, progress: bool = True,
            allow_nonfinite: bool = False, correct_rounds: int = 0,
            correct_sequences: int = CORRECT_SEQUENCES, stream: bool = False, max_cpu_memory: int | None = None,
            max_gpu_memory: int | None = None, offload_dir: str | os.PathLike | None = None) -> AnalysisResult:
    """Analyse a model: calibration statistics, per-tensor errors of every candidate format, super weights.

    Args:
        model: HF checkpoint folder, hub id, ``.gguf`` file, or None for the embedded default.
        output_dir: where ``report.json`` and ``imatrix.gguf`` (llama.cpp's GGUF imatrix format) are
            written (created if needed); None writes nothing.
        calibration: what to calibrate on (default: 64 sequences of 512 tokens of the offline default).
        candidates: GGUF formats to measure for every tensor (default: the planner's, those with a codec).
        fisher_sequences: sequences that also get a backward pass for the Fisher diagonals.
        super_weights: detect and confirm super weights (Yu et al. 2024).
        sensitivity_formats: optional end-to-end sensitivity per block attention / MLP group in these formats.
        validate_presets: make dynamic plans at these llama.cpp presets' file sizes and measure their KLD.
        device: torch device (default CUDA when present); dtype: ``float32`` or ``bfloat16`` for the forward passes.
        allow_nonfinite: NaN and Inf weights are refused (``InputError`` naming the tensor and its file) right after
            the model is loaded; with this they are replaced as :mod:`dynaquant.sources.nonfinite` documents.
        correct_rounds, correct_sequences: measured corrections of the ``validate_presets`` plans (at most this many
            re-plans each, 0: off; on this many held-out calibration sequences): the report's ``corrections`` section,
            which later ``dynaquant plan`` runs on the report use.
        stream: block by block, one decoder block's weights in memory at a time (models larger than memory;
            :mod:`dynaquant.pipeline.analyze_blocks`): not with sensitivity, validation, corrections or a
            vision-language model with images yet.
        max_cpu_memory, max_gpu_memory, offload_dir: with ``stream``, see :func:`.analyze_blocks.memory_plan`.
    Returns:
        AnalysisResult.
    Raises:
        checkpoint.SourceError / ValueError: the model or calibration source cannot be used (named).
        errors.InputError: before any work (``preflight``): ``output_dir``'s files are inputs, are inside the
            source checkpoint folder, cannot be written, or lack the free disk space they need.
        KeyError: a candidate format is unknown or has no codec registered.
    """
    return run_analyze(model, output_dir, AnalyzeConfig(
        calibration=calibration, candidates=candidates, fisher_sequences=fisher_sequences, super_weights=super_weights,
        sensitivity_formats=sensitivity_formats, validate_presets=validate_presets, device=device, dtype=dtype,
        allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, progress=progress, allow_nonfinite=allow_nonfinite,
        correct_rounds=correct_rounds, correct_sequences=correct_sequences, stream=stream,
        max_cpu_memory=max_cpu_memory, max_gpu_memory=max_gpu_memory, offload_dir=offload_dir))


def run_analyze(model: str | os.PathLike | None, output_dir: str | os.PathLike | None, cfg: AnalyzeConfig) -> AnalysisResult:
    """Analyse ``model`` as ``cfg`` says, writing into ``output_dir`` (:func:`analyze`: result and errors)."""
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {cfg.dtype!r}: use float32, bfloat16 or float16")
    check_correct_options(cfg.correct_rounds, cfg.correct_sequences)
    if cfg.correct_rounds and not cfg.validate_presets:
        raise ValueError(f"correct_rounds {cfg.correct_rounds}: the corrections correct the validate_presets plans: "
                         "give them")
    if not cfg.stream and (cfg.max_cpu_memory or cfg.max_gpu_memory or cfg.offload_dir is not None):
        raise ValueError("max_cpu_memory, max_gpu_memory and offload_dir belong to a stream (block by block) run: add "
                         "stream")
    if cfg.stream and (cfg.sensitivity_formats or cfg.validate_presets):
        raise ValueError("sensitivity rows and plan validation need the whole model: not available with stream (block "
                         "by block) yet")
    if distributed.launched():  # torchrun: this process is one rank of several (dynaquant.distributed)
        if not cfg.stream:
            raise ValueError("several ranks (torchrun) run the block-by-block analysis: add --stream")
        if not distributed.init_from_env(cfg.device or default_device()).main:
            cfg = replace(cfg, progress=False)
    spec = cfg.calibration or CalibrationSpec()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    outs = (Path(output_dir) / "report.json", Path(output_dir) / "imatrix.gguf") if output_dir is not None else ()
    check_outputs([Output(p) for p in outs], inputs={"calibration text": spec}, source=model)
    source = resolve_source(model, allow_pickle=cfg.allow_pickle, trust_remote_code=cfg.trust_remote_code)
    ts = open_tensor_source(source, full_vl=True)
    for f in cfg.candidates:
        get_codec(f)  # KeyError (named) for an unknown format or one without a codec
    if outs:  # with upper bounds of their bytes, before the model is loaded
        sizes = analysis_bytes_bound(tensor_infos(ts), len(cfg.candidates))
        check_outputs([Output(p, b) for p, b in zip(outs, sizes)], inputs={"calibration text": spec}, source=source)
    tensors = tensor_infos(ts)
    overhead = gguf_planning_overhead(source, ts, tensors, use_imatrix=True)  # as quantize() estimates it
    if cfg.stream:
        from dynaquant.pipeline.analyze_blocks import run_blockwise_analysis

        res = run_blockwise_analysis(source, ts, load_tokenizer(source), spec,
                                     device=distributed.rank_device(cfg.device or default_device()),
                                     dtype=getattr(torch, cfg.dtype), candidates=cfg.candidates,
                                     fisher_sequences=cfg.fisher_sequences, super_weights=cfg.super_weights,
                                     overhead_bytes=overhead, progress=cfg.progress, timings=timings,
                                     max_cpu_memory=cfg.max_cpu_memory, max_gpu_memory=cfg.max_gpu_memory,
                                     offload_dir=cfg.offload_dir, allow_nonfinite=cfg.allow_nonfinite)
        return _finish_analysis(res, output_dir, ts, spec, timings, t0)
    device, dtype = cfg.device or default_device(), getattr(torch, cfg.dtype)
    check_whole_model_gpu(tensors, device, True, source.path, dtype)
    hf_model = load_model(source, dtype=dtype, device=device)
    check_model_finite(hf_model, source_names(ts), str(source.path), cfg.allow_nonfinite)  # before any forward pass
    tokenizer = load_tokenizer(source)
    timings["load_s"] = time.perf_counter() - t0
    validate = tuple((f"{p} size", make_plan(tensors, model_info(ts), preset=p, has_imatrix=True).size_bytes + overhead)
                     for p in cfg.validate_presets)
    res = run_analysis(source, ts, hf_model, tokenizer, spec, candidates=cfg.candidates,
                       fisher_sequences=cfg.fisher_sequences, super_weights=cfg.super_weights,
                       sensitivity_formats=cfg.sensitivity_formats, validate=validate, overhead_bytes=overhead,
                       progress=cfg.progress, timings=timings, correct_rounds=cfg.correct_rounds,
                       correct_sequences=cfg.correct_sequences, allow_nonfinite=cfg.allow_nonfinite)
    return _finish_analysis(res, output_dir, ts, spec, timings, t0)


def _finish_analysis(res: AnalysisResult, output_dir, ts: TensorSource, spec: CalibrationSpec, timings: dict,
                     t0: float) -> AnalysisResult:
    """Write the report and the imatrix into ``output_dir`` (when given)."""
    timings["total_s"] = time.perf_counter() - t0
    if output_dir is not None and distributed.group().main:  # (several ranks: rank 0 writes)
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        res.imatrix_path = save_imatrix(out / "imatrix.gguf", res.imatrix, ts, spec)
        res.report["imatrix"] = res.imatrix_path.name
        res.report_path = save_report(res.report, out / "report.json")
    return res


def save_imatrix(path: Path, im: Imatrix, ts: TensorSource, spec: CalibrationSpec) -> Path:
    """Write the imatrix in llama.cpp's GGUF imatrix format (``llama-quantize --imatrix`` reads it)."""
    from dynaquant.analysis.imatrix_io import save_imatrix as write
    from dynaquant.names import hf_to_gguf_name

    # the source's own names first (a VL model's modules are model.language_model.* / vision tower / projector)
    own = {t.hf_name.removesuffix(".weight"): t.gguf_name for t in ts.tensors() if t.hf_name and t.hf_name.endswith(".weight")}

    def name_map(module: str) -> str | None:
        if module == "lm_head":
            return "output.weight"  # also when tied: dynaquant reads it back for token_embd
        g = own.get(module) or hf_to_gguf_name(ts.arch, ts.n_layers, module)
        if not g or not g.startswith(("blk.", "v.", "mm.")):  # v./mm.: a VL model's vision tower and projector
            return None  # llama-imatrix records only the blocks' matmuls (and the output head)
        return g if g.endswith(".weight") else g + ".weight"

    return write(path, im, name_map, chunk_size=spec.seq_len)
