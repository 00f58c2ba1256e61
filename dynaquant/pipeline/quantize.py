"""The quantize stage: source -> (calibration) -> plan -> encoded tensors -> GGUF file or safetensors checkpoint.

``quantize`` is what ``dynaquant quantize`` runs; ``run_quantize`` is the same on a :class:`QuantizeConfig`. One flow
serves both targets (:mod:`dynaquant.pipeline.targets`): the target says what differs (formats, overhead, layout).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dynaquant import distributed
from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.analysis.calibration import calibration_chunks as calibration_ids
from dynaquant.analysis.corrections import Encodings
from dynaquant.analysis.evaluate import EvalResult
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.report.schema import write_json
from dynaquant.analysis.stats import ModelStats, collect_stats, compute_imatrix
from dynaquant.config import CORRECT_SEQUENCES, GPTQ_DAMP, N_CTX, SPLIT_MAX_SIZE, QuantizeConfig
from dynaquant.pipeline import analyze as analysis_stage
from dynaquant.pipeline.corrections import auto_rounds, correct_in_run
from dynaquant.pipeline.corrections import check_options as check_correct_options
from dynaquant.pipeline.evaluate import evaluate_written
from dynaquant.pipeline.fit import fit_errors, fit_target
from dynaquant.pipeline.gptq import GPTQRounding
from dynaquant.pipeline.plan import PlanStart, check_imatrix_needs, imatrix_path, plan_before_model, plan_from_report
from dynaquant.pipeline.preflight import (
    Output,
    check_budget,
    check_outputs,
    check_whole_model_gpu,
    plan_json_bytes_bound,
    tensor_bytes_bound,
)
from dynaquant.pipeline.publish import Publisher
from dynaquant.pipeline.ranks import check_distributed, encode_planned, tensor_bar, write_output_ranks
from dynaquant.pipeline.run_state import RunState
from dynaquant.pipeline.source import (
    default_device,
    imatrix_by_gguf_name,
    imatrix_from_file,
    model_info,
    open_tensor_source,
    source_bytes,
    tensor_infos,
)
from dynaquant.pipeline.targets import Target, target_of
from dynaquant.progress import RunProgress
from dynaquant.quant.fit import FIT_CTX, KV_TYPES, MemoryFit
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan
from dynaquant.quant.planner import SOLVERS
from dynaquant.quant.presets import PRESETS
from dynaquant.sources.checkpoint import ModelSource, load_tokenizer, resolve_source
from dynaquant.sources.gguf import TensorSource
from dynaquant.sources.model import load_model
from dynaquant.sources.nonfinite import check_model_finite, source_names

log = logging.getLogger(__name__)


@dataclass
class QuantizeResult:
    """What ``quantize`` produced.

    Attributes:
        output: the GGUF file (or safetensors checkpoint folder) written.
        plan: the plan used.
        size_bytes: the output file's size (a checkpoint: its shards' bytes).
        bpw: average bits per weight over all tensor data (metadata excluded).
        time_s: wall time of the whole run (evaluation excluded).
        imatrix_chunks: calibration chunks behind the imatrix (0: none used).
        eval: quality against the source, when asked for.
        mmproj: the vision GGUF written beside ``output`` for a vision-language checkpoint
            (``mmproj-<output name>``, F16; llama.cpp's ``--mmproj``), else None.
        fit: the memory-fit assumptions of a ``fit_memory`` run (:class:`dynaquant.quant.fit.MemoryFit`), else None.
        folder: the published folder (``card``: model files, README.md, plan, report, imatrix), else None.
        files: the files written (``[output]``; a split GGUF: its shards in order, ``output`` the first; ``mmproj``
            not included); ``size_bytes`` is their sum.
        source_bytes: the source's files' bytes (``pipeline.source.source_bytes``), or None when not known.
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
    fit: MemoryFit | None = None
    folder: Path | None = None
    files: list[Path] = field(default_factory=list)
    source_bytes: int | None = None

    def to_dict(self) -> dict:
        return {
            "output": str(self.output), "size_bytes": self.size_bytes, "bpw": round(self.bpw, 4),
            "time_s": round(self.time_s, 2), "timings_s": {k: round(v, 2) for k, v in self.timings_s.items()},
            "imatrix_chunks": self.imatrix_chunks, "method": self.plan.method,
            "formats": self.plan.count_by_format(), "eval": self.eval.to_dict() if self.eval else None,
            "gptq": self.gptq, **({"mmproj": str(self.mmproj)} if self.mmproj else {}),
            **({"fit": self.fit.to_dict()} if self.fit is not None else {}),
            **({"folder": str(self.folder)} if self.folder else {}),
            **({"files": [str(p) for p in self.files]} if len(self.files) > 1 else {}),
            **({"source_size_bytes": self.source_bytes} if self.source_bytes is not None else {}),
        }


def quantize(model: str | os.PathLike | None = None, *, output: str | os.PathLike | None = None,
             preset: str | None = None, bpw: float | None = None, size: int | None = None,
             rules: list[str] | tuple[str, ...] = (), plan: Plan | str | os.PathLike | None = None,
             report: dict | str | os.PathLike | None = None, imatrix: str | os.PathLike | None = None,
             calibration: str | os.PathLike | CalibrationSpec | None = None, calibration_chunks: int | None = None,
             n_ctx: int = N_CTX, use_imatrix: bool = True, default_rules_on: bool = True, evaluate: bool = False,
             eval_text: str | os.PathLike | None = None, eval_chunks: int | None = None, allow_pickle: bool = False,
             trust_remote_code: bool = False, device: str | None = None, progress: bool = True,
             gptq: bool = False, gptq_damp: float = GPTQ_DAMP, target: str = "gguf",
             save_plan: str | os.PathLike | None = None, allow_nonfinite: bool = False,
             fit_memory: int | None = None, fit_ctx: int = FIT_CTX, kv_type: str = "f16",
             margin: int | None = None, card: bool = False, compare_presets: bool = False,
             split_max_size: int = SPLIT_MAX_SIZE, split_max_tensors: int = 0,
             source_revision: str | None = None, correct_rounds: int | None = None,
             correct_sequences: int = CORRECT_SEQUENCES, solver: str = "exact", stream: bool = False,
             work_dir: str | os.PathLike | None = None, keep_work_dir: bool = False, max_cpu_memory: int | None = None,
             max_gpu_memory: int | None = None, offload_dir: str | os.PathLike | None = None) -> QuantizeResult:
    """Quantize a model to a mixed-precision GGUF file (or, ``target="safetensors"``, a safetensors checkpoint).

    Targets (at most one): ``preset`` (a llama.cpp mix, tensor by tensor as llama-quantize decides),
    ``bpw`` or ``size`` (a dynamic plan: every tensor's format chosen to minimise the KL divergence
    predicted by the analysis within the budget), or ``plan`` (used as is). None: a dynamic plan at the
    file size of the ``Q4_K_M`` preset, or for an already-quantized source (a GGUF of mostly quantized weights, such as
    the default model) of the ``Q3_K_M`` preset, below the source (:func:`dynaquant.pipeline.plan.default_size_bytes`)
    (or the smallest size the default rules allow, if larger; for MoE models the routed experts stay within the
    default rules' caps, ~2 bits, so the file comes out smaller).

    Args:
        model: HF checkpoint folder, hub id, ``.gguf`` file, or None for the embedded default.
        output: the GGUF path; default ``<model>-<target>.gguf`` in the current folder. A vision-language
            checkpoint also gets ``mmproj-<output name>`` beside it (``QuantizeResult.mmproj``).
        rules: ``'REGEX=FORMAT'`` (or ``>=``, ``<=``) matched against GGUF tensor names, first match wins,
            before the default rules (``planner.default_rules``; off with ``default_rules_on=False``).
        report: an analysis report (``report.json`` path or dict) for dynamic plans; without one, the
            analysis runs here on ``calibration_chunks`` sequences (None: 32 on a GPU, 8 on the CPU; with 8 / 2 of
            them also given a backward pass for the Fisher diagonals, and the errors measured on 1 / 16 / 1 / 32 of
            each tensor's rows: ``QuantizeConfig.for_device``).
        imatrix: an imatrix file (llama.cpp GGUF or legacy ``.dat``) for the encoders; default: the one
            beside the report or named by the plan, else computed on the calibration text.
        calibration: calibration text file, or a CalibrationSpec; default: stdlib docstrings.
        use_imatrix: encoders minimise the imatrix-weighted error.
        evaluate: also measure KLD/perplexity/top-1 against the source on ``eval_text`` (``eval_chunks`` chunks;
            None: 16 on a GPU, 8 on the CPU).
        device: torch device for calibration and encoding (default: CUDA when present).
        gptq: error-compensating rounding (GPTQ, Frantar et al. 2022) for every matmul weight, using
            each layer's input second moments from the calibration text (damping ``gptq_damp``); for each
            tensor the rounding (GPTQ or plain) with the lower layer-output error on two held-out
            calibration sequences is written. The GGUF layout is unchanged. The lattice i-quants (IQ3_XXS,
            IQ3_S, IQ2_*, IQ1_*) are GPTQ-rounded a super-block of columns at a time (``quant.gptq``).
        target: ``gguf``, or ``safetensors``: a compressed-tensors checkpoint folder in the runtime formats,
            planned by ``bpw`` / ``size`` / ``plan`` (no presets), run by ``dynaquant.load``
            (:class:`dynaquant.pipeline.safetensors_target.SafetensorsTarget`).
        save_plan: also write the plan as JSON here (atomically), as soon as it is made: before the encoding.
        allow_nonfinite: NaN and Inf weights are refused (``InputError`` naming the tensor and its file; a model
            loaded for calibration is checked before its first forward pass); with this they are written as
            :mod:`dynaquant.sources.nonfinite` documents (NaN -> 0, +-Inf -> +-the tensor's largest finite |value|).
        fit_memory: a size target in memory (bytes; GGUF; instead of preset/bpw/size/plan): planned as
            ``size = fit_memory - KV cache - margin``, the KV cache llama.cpp's at ``fit_ctx`` tokens (default 4096;
            ``n_ctx`` is the calibration's) in ``kv_type`` (``f16`` or ``q8_0``) from the model's config or GGUF
            metadata, ``margin`` (bytes; None: 0.5 GiB + 4 % of ``fit_memory``); see :mod:`dynaquant.quant.fit`.
            The assumptions are recorded in the plan's and the result's ``fit``; a memory below KV cache + margin +
            the smallest possible plan raises ``planner.BudgetError`` with those numbers, before any analysis.
        card: write a publishable folder (model files, README.md model card, plan, report, imatrix, plots;
            ``output`` FILE.gguf -> folder FILE; :mod:`dynaquant.pipeline.publish`), its path in ``QuantizeResult.folder``;
            the card's numbers are the evaluation's, so give ``evaluate=True`` too. compare_presets: also quantize and
            evaluate the uniform llama.cpp preset nearest in size, for a second row of the card's table.
        split_max_size, split_max_tensors: GGUF: split into llama.cpp shards (``NAME-00001-of-0000N.gguf``) of at
            most this many bytes of tensor data (default 50 GB, the hub's limit) / tensors each (0: no limit);
            ``QuantizeResult.files`` lists them, ``output`` is the first.
        source_revision: a hub source's branch, tag or commit (recorded in the file as ``dynaquant.source.revision``).
        correct_rounds: measured corrections of a dynamic plan (:mod:`dynaquant.pipeline.corrections`): the plan's KL
            divergence measured in PyTorch (the whole plan and each block group alone) on ``correct_sequences``
            held-out calibration sequences, per-group factors fitted, re-planned, at most this many times (None: 2 on
            CUDA, 0 = off on the CPU); the rounds are in ``plan.corrections`` and the report's ``corrections``.
        solver: a dynamic plan's allocation solver: ``exact`` (the optimum of the predicted error, or a gap to a proved
            bound, recorded in ``plan.solver``) or ``greedy`` (``quant.planner``).
        stream: analysis, imatrix, measured corrections, GPTQ and evaluation block by block, one decoder block's
            weights in memory at a time (models larger than memory; :mod:`dynaquant.pipeline.analyze_blocks`). With
            ``target="safetensors"`` the checkpoint is written from the model's skeleton on the meta device, one part
            holding real weights at a time (the embedding, final norm, head and a vision tower, or one decoder block,
            in float32; :mod:`dynaquant.pipeline.part_weights`), tensors encoded and shards filled and closed as they
            come: the same files, byte for byte, as the whole-model run; there without ``gptq`` and ``evaluate`` yet
            (``ValueError`` before any work). Without compare_presets yet (``ValueError``).
        work_dir, keep_work_dir: with ``stream``, the resumable work folder (:mod:`dynaquant.pipeline.rundir`; None:
            ``OUTPUT.work`` beside the output; a killed run started again with the same arguments continues from it
            and writes the same bytes), kept after success with ``keep_work_dir``.
        max_cpu_memory, max_gpu_memory, offload_dir: with ``stream``, the memory bounds
            (:func:`dynaquant.pipeline.analyze_blocks.memory_plan`; ``offload_dir`` None: the work folder's ``offload``).
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
    return run_quantize(model, QuantizeConfig(
        output=output, preset=preset, bpw=bpw, size=size, rules=rules, plan=plan, report=report, imatrix=imatrix,
        calibration=calibration, calibration_chunks=calibration_chunks, n_ctx=n_ctx, use_imatrix=use_imatrix,
        default_rules_on=default_rules_on, evaluate=evaluate, eval_text=eval_text, eval_chunks=eval_chunks,
        allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, device=device, progress=progress, gptq=gptq,
        gptq_damp=gptq_damp, target=target, save_plan=save_plan, allow_nonfinite=allow_nonfinite,
        fit_memory=fit_memory, fit_ctx=fit_ctx, kv_type=kv_type, margin=margin, card=card,
        compare_presets=compare_presets, split_max_size=split_max_size, split_max_tensors=split_max_tensors,
        source_revision=source_revision, correct_rounds=correct_rounds, correct_sequences=correct_sequences,
        solver=solver, stream=stream, work_dir=work_dir, keep_work_dir=keep_work_dir, max_cpu_memory=max_cpu_memory,
        max_gpu_memory=max_gpu_memory, offload_dir=offload_dir))


def run_quantize(model: str | os.PathLike | None, cfg: QuantizeConfig) -> QuantizeResult:
    """Quantize ``model`` as ``cfg`` says (:func:`quantize`: arguments, result and errors); ``cfg.card``: into a
    published folder (:mod:`dynaquant.pipeline.publish`: the layout, and ``ValueError`` on contradictory options)."""
    with Publisher(cfg, model, write_output) as pub:  # pub.config: the counts left None set for the device
        return _run_quantize(model, pub.config, pub)


def _run_quantize(model: str | os.PathLike | None, cfg: QuantizeConfig, pub: Publisher) -> QuantizeResult | None:
    target = _check_options(cfg)
    grp = distributed.group()
    if distributed.launched():  # torchrun: this process is one rank of several (dynaquant.distributed)
        check_distributed(cfg, target)
        grp = distributed.init_from_env(cfg.device or default_device())
        if not grp.main:
            cfg = replace(cfg, progress=False)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    inputs = {"plan": cfg.plan, "report": cfg.report, "imatrix": cfg.imatrix, "calibration text": cfg.calibration,
              "evaluation text": cfg.eval_text}
    first = [Output(Path(cfg.output), folder=target.folder_output)] if cfg.output is not None else []
    check_outputs(first + ([Output(Path(cfg.save_plan))] if cfg.save_plan is not None else []), inputs=inputs, source=model)
    device = distributed.rank_device(cfg.device or default_device())
    source = resolve_source(model, allow_pickle=cfg.allow_pickle, trust_remote_code=cfg.trust_remote_code,
                            revision=cfg.source_revision)
    ts = open_tensor_source(source, full_vl=target.full_vl)
    tensors, info = tensor_infos(ts), model_info(ts)
    fit = fit_target(cfg, ts)  # --fit-memory: planned as --size memory - KV cache - margin
    cfg = replace(cfg, size=max(fit.size_bytes, 1)) if fit is not None else cfg
    with fit_errors(fit):
        start = plan_before_model(cfg, target, source, ts, tensors, info)
    if fit is not None and start.plan is not None:
        start.plan.fit = fit
    imat_path = imatrix_path(cfg.imatrix, cfg.report, start.report, start.loaded, start.where, cfg.use_imatrix)
    needs_analysis = start.dynamic and start.report is None
    needs_imatrix = cfg.use_imatrix and imat_path is None and not needs_analysis and (
        start.dynamic or target.name == "safetensors" or any(get_format(e.format).kind != "float" for e in start.plan.entries))
    final = _check_output(cfg, target, source, ts, tensors, start, inputs)
    rundir = None
    if cfg.stream:  # (several ranks: rank 0 makes the folder, the others open it after)
        if grp.main:
            rundir = _open_rundir(cfg, source, final)
        grp.barrier()
        if not grp.main:
            rundir = _open_rundir(cfg, source, final)
    # one progress display for a stream run (shares: the stages' times on the 8B shape, benchmarks/scale.py)
    run_bar = RunProgress({"calibration": 0.55, "writing": 0.45, "evaluation": 0.3 if cfg.evaluate else 0.0},
                          enabled=cfg.progress) if cfg.stream else None
    progress = run_bar if run_bar is not None else cfg.progress
    output = pub.stage(final, target, inputs, source)
    rounds = auto_rounds(cfg.correct_rounds, device) if start.dynamic else 0  # measured corrections of the plan
    model_needed = target.needs_model or needs_imatrix or needs_analysis or cfg.gptq or rounds > 0
    hf_model = None
    if model_needed and not cfg.stream:  # refused before loading when the weights (and moments) cannot fit the GPU
        check_whole_model_gpu(tensors, device, needs_analysis or cfg.gptq, source.path)
        hf_model = load_model(source, device=device)
    tokenizer = None
    if hf_model is not None:  # NaN/Inf: refused (or replaced) before any forward pass
        check_model_finite(hf_model, source_names(ts), str(source.path), cfg.allow_nonfinite)
        tokenizer = load_tokenizer(source)
    elif cfg.stream and model_needed:
        tokenizer = load_tokenizer(source)
    timings["load_s"] = time.perf_counter() - t0
    im, stats = None, None
    if cfg.stream and (needs_analysis or needs_imatrix):
        if needs_analysis:
            from dynaquant.pipeline.analyze_blocks import run_blockwise_analysis

            res = run_blockwise_analysis(source, ts, tokenizer, cfg.spec(), device=device,
                                         candidates=target.analysis_candidates, fisher_sequences=cfg.fisher_sequences,
                                         progress=progress, timings=timings, rundir=rundir,
                                         max_cpu_memory=cfg.max_cpu_memory, max_gpu_memory=cfg.max_gpu_memory,
                                         offload_dir=cfg.offload_dir, allow_nonfinite=cfg.allow_nonfinite,
                                         sample_fraction=cfg.sample_fraction)
            start.report, im = res.report, res.imatrix
        else:
            im = _imatrix_blockwise(cfg, source, ts, tokenizer, device, timings)
    elif needs_analysis:
        res = analysis_stage.run_analysis(source, ts, hf_model, tokenizer, cfg.spec(), candidates=target.analysis_candidates,
                           fisher_sequences=cfg.fisher_sequences, progress=cfg.progress, timings=timings,
                           allow_nonfinite=cfg.allow_nonfinite, sample_fraction=cfg.sample_fraction)
        start.report, im, stats = res.report, res.imatrix, res.stats
    elif needs_imatrix:
        im, stats = _imatrix(cfg, target, hf_model, tokenizer, timings)
    plan, size = start.plan, start.size
    if plan is None:
        with fit_errors(fit):
            plan, size = plan_from_report(cfg, target, start, tensors, info, source.model_id)
        plan.fit = fit
        if cfg.save_plan is not None and rounds == 0 and grp.main:  # corrected: saved once, below
            write_json(plan.to_dict(), cfg.save_plan)
        if rundir is not None and grp.main:
            write_json(plan.to_dict(), rundir.file("plan.json"))
    rounding = None
    if cfg.gptq and not cfg.stream:
        rounding = GPTQRounding(hf_model, tokenizer, cfg.spec(), stats, cfg.gptq_damp, device, cfg.progress, timings)
    # the calibration's (K, K) input moments serve the analysis and GPTQ (whose rounding holds what it needs): let go
    # here, so the corrections' decoded weights can use the device memory they held (~33 GB for a float32 8B)
    res = stats = None
    imat = _importance(cfg, target, im, imat_path, ts, info)
    encodings = None
    if rounds > 0:
        t1 = time.perf_counter()
        sk = None
        if cfg.stream:  # measured block by block
            from dynaquant.sources.skeleton import build_skeleton

            sk = build_skeleton(source, ts, device=device, allow_nonfinite=cfg.allow_nonfinite)
        encodings = reusable_encodings(cfg, target)
        plan, start.report = correct_in_run(cfg, target, start, tensors, info, source.model_id, hf_model, tokenizer, imat,
                                            rounds, plan, sk=sk, encodings=encodings)
        plan.fit, timings["corrections_s"] = fit, time.perf_counter() - t1
        if cfg.save_plan is not None and grp.main:
            write_json(plan.to_dict(), cfg.save_plan)
    check_imatrix_needs(plan, set(imat))
    if cfg.gptq and cfg.stream:  # block by block, on the final plan; the bytes wait in the work folder
        from dynaquant.pipeline.gptq import gptq_blockwise

        rounding = gptq_blockwise(source, ts, tokenizer, cfg.spec(), plan, imat, cfg.gptq_damp, device, rundir,
                                  cfg.progress, timings, allow_nonfinite=cfg.allow_nonfinite)
    run = RunState(cfg, source, ts, plan, start.loaded is not None, im, imat, rounding, torch.device(device), start.report,
                   hf_model if target.needs_model else None, tokenizer, imat_path if im is None and cfg.use_imatrix else None,
                   rundir, run_bar, encodings)
    # the whole-model path's source model is the evaluation's reference (not loaded a second time): kept through the
    # writing, where it adds less than the evaluation's two models do (the reference and its decoded copy); not for a
    # target that writes from the model (safetensors: loaded again, as before)
    reference = hf_model if cfg.evaluate and grp.main and not target.needs_model else None
    hf_model = None
    t2 = time.perf_counter()
    path, nbytes = write_output(run, target, output)
    timings["quantize_s"] = time.perf_counter() - t2
    if run.write_s:
        timings["write_s"] = run.write_s  # (a part of quantize_s: the tensor loop's writing)
    if not grp.main:  # its share of the tensors is in the work folder; rank 0 wrote the file
        return None
    if cfg.stream:
        from dynaquant.pipeline.analyze_blocks import log_gpu_peak

        log_gpu_peak(device, "quantize")
    result = QuantizeResult(path, plan, nbytes, plan.bpw, time.perf_counter() - t0, im.chunks if im else 0,
                            timings_s=timings, gptq=rounding.summary() if rounding else None, fit=fit,
                            files=target.written, source_bytes=source_bytes(ts))
    if size is not None and nbytes > size:  # the overhead estimate is an upper bound; never expected
        target.discard(path)
        raise RuntimeError(f"{path}: {nbytes} bytes exceeds the target {size}; removed")
    result.mmproj = target.extras(run, path)
    if cfg.evaluate:
        run.model = None
        if cfg.stream:
            from dynaquant.pipeline.evaluate import evaluate_written_blockwise

            result.eval = evaluate_written_blockwise(path, source, ts, tokenizer, cfg, device, progress=progress)
        else:
            result.eval = evaluate_written(path, source, ts, tokenizer, cfg, device, checkpoint=target.name == "safetensors",
                                           reference=reference)
            reference = None
    if run_bar is not None:
        run_bar.close()
    done = pub.finish(result, run, target, imat_path)
    if rundir is not None and not cfg.keep_work_dir:  # (several ranks: the others have finished their share)
        rundir.delete()
    return done


def _open_rundir(cfg: QuantizeConfig, source: ModelSource, output: Path):
    """The resumable work folder of a ``stream`` run, with what identifies the run (inputs and the options that change
    the result): a folder of another run is refused (``InputError``)."""
    import dataclasses

    from dynaquant.pipeline.rundir import RunDir, default_work_dir, file_identity
    from dynaquant.version import __version__

    skip = {"output", "progress", "work_dir", "keep_work_dir", "command", "push_to_hub", "push_private", "push_branch",
            "card", "save_plan", "max_cpu_memory", "max_gpu_memory", "offload_dir"}  # (no effect on the bytes)
    options = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}
    files = {k: file_identity(v) for k, v in (("calibration", cfg.calibration), ("plan", cfg.plan),
                                              ("report", cfg.report), ("imatrix", cfg.imatrix))
             if isinstance(v, (str, os.PathLike)) and Path(v).exists()}
    identity = {"dynaquant": __version__, "source": file_identity(source.path), "inputs": files,
                "options": json.loads(json.dumps(options, default=str))}
    return RunDir(Path(cfg.work_dir) if cfg.work_dir is not None else default_work_dir(output), identity)


def reusable_encodings(cfg: QuantizeConfig, target: Target) -> Encodings | None:
    """Where a whole-model run's corrections keep the bytes of the plans they measure for the GGUF writer
    (:class:`dynaquant.analysis.corrections.Encodings`), at most a quarter of the host memory available now; with
    ``gptq`` they are the plain rounding GPTQ's rounding is checked against (not encoded a second time). None where
    the writer's bytes would not be the corrections' (``allow_nonfinite`` replaces values per tensor) or nothing
    would be kept (``stream`` measures block by block; the safetensors target encodes its own records)."""
    from dynaquant.pipeline.analyze_blocks import available_memory

    if target.name != "gguf" or cfg.stream or cfg.allow_nonfinite:
        return None
    return Encodings(limit=available_memory() // 4)


def write_output(run: RunState, target: Target, path: Path) -> tuple[Path, int] | tuple[None, int]:
    """The one tensor loop: each planned tensor read, GPTQ-rounded where asked, encoded and handed to ``target``,
    which writes ``path`` atomically; (path written, bytes counted for the budget). With several ranks
    (:mod:`dynaquant.distributed`): :func:`dynaquant.pipeline.ranks.write_output_ranks`.

    Raises:
        Any error of the reading, encoding or writing; the target's partial output is removed first
        (``path`` is left as it was).
    """
    if distributed.group().active:
        return write_output_ranks(run, target, path)
    target.begin(run, path)
    tensors = target.tensors()
    bar = tensor_bar(run, target.progress_label(), len(tensors))
    try:
        for i, t in enumerate(tensors):
            # (a resumed run: encoded before it was stopped, kept in the work folder)
            done, encoded = target.load_encoded(run.rundir, i) if run.rundir is not None else (False, None)
            if not done:
                encoded = encode_planned(run, target, t)
            t0 = time.perf_counter()
            if not done and run.rundir is not None:
                target.save_encoded(run.rundir, i, encoded)
            target.add(t, encoded)
            run.write_s += time.perf_counter() - t0
            bar.update(1)
        t0 = time.perf_counter()
        out = target.finish()
        run.write_s += time.perf_counter() - t0
        return out
    except BaseException:
        target.abort()
        raise
    finally:
        bar.close()


def _check_options(cfg: QuantizeConfig) -> Target:
    """The target, once the options are checked (before any work).

    Raises:
        ValueError: a preset for safetensors, an unknown target, preset or solver, more than one of preset/bpw/size/plan.
        InputError: a non-finite or non-positive ``bpw`` / ``size``.
    """
    if cfg.target == "safetensors" and cfg.preset is not None:
        raise ValueError("presets are llama.cpp mixes; for the safetensors target give bpw, size or plan")
    target = target_of(cfg.target)
    if sum(x is not None for x in (cfg.preset, cfg.bpw, cfg.size, cfg.plan)) > 1:
        raise ValueError("give at most one of preset, bpw, size and plan" if target.name == "gguf"
                         else "give at most one of bpw, size and plan")
    if cfg.preset is not None and cfg.preset.upper() not in PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; known presets: {', '.join(PRESETS)}")
    check_budget(cfg.bpw, cfg.size)
    check_correct_options(cfg.correct_rounds, cfg.correct_sequences)
    if (cfg.work_dir is not None or cfg.keep_work_dir or cfg.max_cpu_memory or cfg.max_gpu_memory
            or cfg.offload_dir is not None) and not cfg.stream:
        raise ValueError("work_dir, keep_work_dir, max_cpu_memory, max_gpu_memory and offload_dir belong to a stream "
                         "(block by block) run: add stream")
    if cfg.stream and cfg.compare_presets:
        raise ValueError("stream (block by block) runs without compare_presets for now: drop compare_presets or stream")
    if cfg.stream and target.name == "safetensors" and (cfg.gptq or cfg.evaluate):
        # GPTQ block by block rounds the tensor source's GGUF-oriented weights (llama's q/k rows permuted), not the
        # model's; the block-by-block evaluation reads GGUF files
        asked = " and ".join(k for k in ("gptq", "evaluate") if getattr(cfg, k))
        raise ValueError(f"stream with target safetensors writes the checkpoint without gptq and evaluate for now: drop "
                         f"{asked} (--gptq; the evaluation: --no-eval, which --card and a bare run turn on), or stream, "
                         "or target safetensors")
    if cfg.solver not in SOLVERS:
        raise ValueError(f"unknown solver {cfg.solver!r} (known: {', '.join(SOLVERS)})")
    if cfg.fit_memory is not None:
        if target.name != "gguf" or any(x is not None for x in (cfg.preset, cfg.bpw, cfg.size, cfg.plan)):
            raise ValueError("fit_memory sizes a GGUF file for llama.cpp's memory: give it alone, without preset, bpw, "
                             "size or plan, and without target safetensors")
        if cfg.kv_type not in KV_TYPES or cfg.fit_ctx < 1 or cfg.fit_memory < 1 or (cfg.margin or 0) < 0:
            raise ValueError(f"fit_memory {cfg.fit_memory}, fit_ctx {cfg.fit_ctx}, margin {cfg.margin}, kv_type "
                             f"{cfg.kv_type!r}: memory and context must be positive, the margin >= 0, the KV type one "
                             f"of {', '.join(KV_TYPES)}")
    return target


def _check_output(cfg: QuantizeConfig, target: Target, source: ModelSource, ts: TensorSource, tensors, start: PlanStart,
                  inputs: dict) -> Path:
    """The output path, checked with the upper bound of its bytes before any weights are read (``preflight``); a plan
    known now is saved (``save_plan``)."""
    output = Path(cfg.output) if cfg.output is not None else target.default_output(source, cfg, start.size)
    bound = tensor_bytes_bound(tensors, start.overhead or target.bound_overhead(ts, tensors, cfg.rules), bpw=cfg.bpw,
                               size=start.size, plan_bytes=None if start.dynamic else start.plan.size_bytes)
    plan_out = [Output(Path(cfg.save_plan), plan_json_bytes_bound(len(tensors)))] if cfg.save_plan is not None else []
    check_outputs([target.output(output, bound, source, ts)] + plan_out, inputs=inputs, source=source)
    target.check_output(output)
    if cfg.save_plan is not None and start.plan is not None and distributed.group().main:
        write_json(start.plan.to_dict(), cfg.save_plan)
    return output


def _imatrix(cfg: QuantizeConfig, target: Target, model, tokenizer, timings: dict) -> tuple[Imatrix, ModelStats | None]:
    """The imatrix on the calibration text; for GGUF with GPTQ, one pass gives it and GPTQ's second moments too
    (the two held-out sequences excluded, as in the analysis)."""
    t1 = time.perf_counter()
    spec = cfg.spec()
    stats = None
    if cfg.gptq and target.name == "gguf":
        fit = calibration_ids(tokenizer, replace(spec, n_sequences=spec.n_sequences + 2))
        stats = collect_stats(model, fit[:-2] if fit.shape[0] > 2 else fit, fisher_sequences=0, progress=cfg.progress)
        im = stats.to_imatrix(spec.id)
    else:
        im = compute_imatrix(model, calibration_ids(tokenizer, spec), spec.id, progress=cfg.progress)
    timings["imatrix_s"] = time.perf_counter() - t1
    return im, stats


def _imatrix_blockwise(cfg: QuantizeConfig, source: ModelSource, ts: TensorSource, tokenizer, device: str,
                       timings: dict) -> Imatrix:
    """The imatrix on the calibration text, block by block (``stream``): llama-imatrix's accumulation only."""
    from dynaquant.analysis.blockwise import collect_blockwise
    from dynaquant.analysis.stats import Collect
    from dynaquant.sources.skeleton import build_skeleton

    t1 = time.perf_counter()
    spec = cfg.spec()
    sk = build_skeleton(source, ts, device=device, allow_nonfinite=cfg.allow_nonfinite)
    im = collect_blockwise(sk, calibration_ids(tokenizer, spec), Collect(imatrix=True, hessian=False, experts=False),
                           progress=cfg.progress).imatrix
    im.dataset = spec.id
    timings["imatrix_s"] = time.perf_counter() - t1
    return im


def _importance(cfg: QuantizeConfig, target: Target, im: Imatrix | None, path: Path | None, ts: TensorSource,
                info) -> dict[str, torch.Tensor]:
    """GGUF name -> (K,) importance: this run's imatrix (GGUF: also with ``use_imatrix`` off, when the analysis ran
    here), else the imatrix file, else none."""
    if im is not None and (cfg.use_imatrix or target.name == "gguf"):
        return imatrix_by_gguf_name(im, ts)
    if im is None and path is not None and cfg.use_imatrix:
        return imatrix_from_file(path, ts, info)
    return {}
