"""The plan stage: analysis report (or preset, or a given plan.json) -> plan, made once per run.

``make_dynamic_plan`` is what ``dynaquant plan`` runs. ``plan_before_model`` and ``plan_from_report`` are the two
halves of a quantize run's planning: the checks that need no model (a given plan, a preset, the budget against the
rules) and the dynamic plan once the report is there.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from dynaquant.analysis.corrections import correction_group, factor_lookup
from dynaquant.analysis.report import schema
from dynaquant.analysis.report.schema import Report, write_json
from dynaquant.config import DEFAULT_SIZE_PRESET, QUANTIZED_SOURCE_SIZE_PRESETS, QuantizeConfig
from dynaquant.errors import InputError
from dynaquant.exporters.safetensors.writer import safetensors_overhead_bytes
from dynaquant.pipeline.preflight import Output, check_budget, check_outputs, plan_json_bytes_bound
from dynaquant.pipeline.source import quantized_source, source_bytes
from dynaquant.pipeline.targets import Target
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan, TensorInfo
from dynaquant.quant.planner import ErrorFn, default_rules, make_plan, min_plan_bytes, preset_size_bytes
from dynaquant.quant.presets import ModelInfo, requires_imatrix

log = logging.getLogger(__name__)


def load_plan(plan: Plan | str | os.PathLike) -> Plan:
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


def check_imatrix_needs(plan: Plan, have: set[str]) -> None:
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


def check_report(report: Report, tensors: list[TensorInfo], where) -> None:
    """Refuse a report that does not match the model (a quantizable tensor missing or of another shape).

    Raises:
        ValueError: naming ``where`` and the tensor.
    """
    have = {t.name: tuple(t.shape) for t in report.tensors}
    for t in tensors:
        if t.quantizable and have.get(t.name) != tuple(t.shape):
            raise ValueError(f"{where}: the report does not match the model: tensor {t.name} "
                             f"{'missing' if t.name not in have else f'has shape {list(have[t.name])}'}")


def super_weight_tensors(report: Report) -> list[str]:
    """The GGUF names of the report's tensors holding a super weight, in report order."""
    return [t.name for t in report.tensors if t.super_weight]


def error_fn_from_report(report: Report | dict, use_sensitivity: bool = True, use_corrections: bool = True) -> ErrorFn:
    """The allocator's error function from an analysis report (a dict is typed as is: ``Report.typed``).

    The predicted KL divergence ``kld_pred`` of each tensor in each measured format; formats not
    measured for a tensor are infinite (never chosen). With end-to-end sensitivity rows in the
    report, each block's attention / MLP predictions are scaled by the geometric mean over the
    measured formats of measured / predicted KL divergence for that group. With a ``corrections``
    section (``use_corrections``; :mod:`dynaquant.pipeline.corrections`), each prediction is also multiplied by
    its group's factor (``analysis.corrections.factor_lookup``: a group never measured takes its kind's mean) and
    by the interaction factor (the same for every tensor: it changes the predicted totals, not the allocation).
    """
    rep = Report.typed(report) if isinstance(report, dict) else report
    errs = {t.name: t.errors for t in rep.tensors}
    scale: dict[str, float] = {}
    if use_sensitivity and rep.sensitivity:
        logs: dict[str, list[float]] = {}
        for r in rep.sensitivity:
            if r.kld and r.kld_pred and r.kld > 0 and r.kld_pred > 0:
                logs.setdefault(r.group, []).append(math.log(r.kld / r.kld_pred))
        scale = {g: math.exp(sum(v) / len(v)) for g, v in logs.items()}

    corr = rep.corrections if use_corrections else None
    factor, inter = factor_lookup(corr.factors or {}) if corr else None, float(corr.interaction or 1.0) if corr else 1.0
    groups: dict[str, float] = {}  # tensor name -> its group's factor times the interaction

    def fn(t: TensorInfo, fmt: str) -> float:
        e = errs.get(t.name, {}).get(fmt)
        if e is None or e.kld_pred is None:
            return math.inf
        group = f"blk.{t.layer}.{'attn' if '.attn_' in t.name else 'ffn'}" if t.layer is not None else ""
        v = float(e.kld_pred) * scale.get(group, 1.0)
        if factor is not None:
            if t.name not in groups:
                groups[t.name] = factor(correction_group(t.name)) * inter
            v *= groups[t.name]
        return v

    return fn


def plan_imatrix(plan: Plan, plan_file: str | os.PathLike | None) -> Path | None:
    """The imatrix file a plan names (``sources["imatrix"]``), or None: a relative name is taken beside the plan file
    (a published folder's ``plan.json`` names ``imatrix.gguf``), an absolute one as it is."""
    named = plan.sources.get("imatrix")
    if not named:
        return None
    path = Path(named)
    if not path.is_absolute() and plan_file is not None and Path(plan_file).is_file():
        return Path(plan_file).parent / path
    return path


def imatrix_path(imatrix, report, report_d, plan: Plan | None, plan_file: str = "plan",
                  use_imatrix: bool = True) -> Path | None:
    """The imatrix file to use: given, named by the plan, or beside the report.

    Raises:
        InputError: the plan names an imatrix that does not exist, no ``imatrix`` is given and ``use_imatrix``
            (computing another one silently would give other bytes than the plan was made for).
    """
    if imatrix is not None:
        return Path(imatrix)
    if plan is not None and plan.sources.get("imatrix"):
        named = plan_imatrix(plan, plan_file)
        if named.is_file():
            return named
        if use_imatrix:
            raise InputError(f"{plan_file}: the imatrix the plan was made with, {named}, does not exist; give it (or "
                             "another) with --imatrix, or quantize without one with --no-imatrix")
    if report_d is not None and report is not None and not isinstance(report, dict) and report_d.get("imatrix"):
        p = Path(report).parent / report_d["imatrix"]
        return p if p.exists() else None
    return None


def make_dynamic_plan(report: dict | str | os.PathLike, *, bpw: float | None = None, size: int | None = None,
                      rules: tuple[str, ...] | list[str] = (), target: str = "gguf", default_rules_on: bool = True,
                      output: str | os.PathLike | None = None, solver: str = "exact") -> Plan:
    """A dynamic plan from an analysis report: minimise the predicted KL divergence within a budget.

    Args:
        report: ``report.json`` path (read with ``Report.load``), or its dict (typed as is: ``Report.typed``).
        bpw / size: the budget (exactly one): average bits per weight of the tensor data, or whole-file bytes.
        rules: user rules (``REGEX=FORMAT``, ``REGEX>=FORMAT``, ``REGEX<=FORMAT``), before the default rules.
        target: ``gguf`` or ``safetensors`` (the report must have measured that target's formats: ``analyze
            --formats safetensors``; a safetensors ``size`` counts the safetensors shards' bytes).
        output: write the plan JSON here (temporary file, then renamed); checked first (``preflight``): not the
            report nor its imatrix, writable, room on the disk.
        solver: the allocation's solver, ``exact`` or ``greedy`` (``quant.planner.make_plan``).
    Returns:
        The Plan (``sources`` names the report and the imatrix beside it).
    Raises:
        ValueError: bad report, budget, rule or target; planner.BudgetError: budget below the fixed rules' minimum;
        errors.InputError: a non-finite or non-positive budget, or an output that fails the checks.
    """
    if target not in ("gguf", "safetensors"):
        raise ValueError(f"unknown target {target!r} (known: gguf, safetensors)")
    if (bpw is None) == (size is None):
        raise ValueError("give exactly one of bpw and size")
    check_budget(bpw, size)
    path = None if isinstance(report, dict) else Path(report)
    if output is not None:
        check_outputs([Output(Path(output))], inputs={"report": path})
    rep = Report.typed(report) if isinstance(report, dict) else Report.load(path)
    if output is not None:
        imatrix = path.parent / rep.imatrix if path is not None and rep.imatrix else None
        check_outputs([Output(Path(output), plan_json_bytes_bound(len(rep.tensors)))],
                      inputs={"report": path, "imatrix": imatrix})
    tensors = [TensorInfo(t.name, t.hf_name, tuple(t.shape), bool(t.quantizable)) for t in rep.tensors]
    if target == "gguf":  # a VL report's vision tower / projector go to the mmproj file, not the planned GGUF
        tensors = [t for t in tensors if not t.name.startswith(("v.", "mm."))]
    m = rep.model
    if m is None or m.n_layers is None:
        raise InputError(f"{path or 'report'}: no model.n_layers in the report; re-run 'dynaquant analyze'")
    # the MoE facts (older reports lack them: counted from the stacked expert tensors' shapes), so that the
    # default rules here are those dynaquant.quantize applies (expert caps, MoE attention)
    n_expert = m.n_expert
    if n_expert is None:
        n_expert = max((t.shape[0] for t in tensors if len(t.shape) == 3 and "_exps." in t.name), default=0)
    info = ModelInfo(n_layers=int(m.n_layers), n_head=int(m.n_head or 1), n_head_kv=int(m.n_head_kv or 1),
                     n_expert=int(n_expert), tied_embeddings=bool(m.tied_embeddings), expert_format=m.expert_format)
    overhead = int(m.gguf_overhead_bytes or 0)
    if target == "safetensors":
        overhead = safetensors_overhead_bytes(tensors)
    if size is not None and not overhead:
        raise ValueError(f"{path or 'report'}: no gguf_overhead_bytes in the report; plan with --bpw")
    candidates = [c for c in rep.candidates if get_format(c).allowed_in(target)]
    if not candidates:
        raise ValueError(f"{path or 'report'}: the analysis measured no {target} formats; "
                         f"run 'dynaquant analyze --formats {target}'")
    model_id = m.id if m.present is None or "id" in m.present else ""
    plan = make_plan(tensors, info, model_id, rules=rules, bpw=bpw, size_bytes=size, overhead_bytes=overhead,
                     error_fn=error_fn_from_report(rep), candidates=candidates,
                     defaults=default_rules(info, super_weight_tensors(rep), target=target) if default_rules_on else (),
                     error_source="measured kld", target=target,
                     has_imatrix=True, solver=solver)  # the analysis had an imatrix; quantize refuses the plan without one
    if path is not None:
        plan.sources["report"] = str(path.resolve())
        if rep.imatrix:
            plan.sources["imatrix"] = str((path.parent / rep.imatrix).resolve())
    if output is not None:
        write_json(plan.to_dict(), output)
    return plan


@dataclass
class PlanStart:
    """A quantize run's planning before any model is loaded.

    Attributes:
        loaded: the plan given (``plan``), or None.
        plan: the plan when it is known now (given, a preset's, or a dynamic one made from a report given up front),
            else None (made from the report of the analysis this run does: :func:`plan_from_report`).
        dynamic: the plan is (or will be) a dynamic one.
        report: the analysis report (dict) given, or None.
        size: the size budget in bytes (the default target's, when none was given), or None (``bpw`` or no budget).
        overhead: the container's bytes beside the tensor data the dynamic plan is made for (0: not dynamic).
        where: how the given plan is named in messages.
    """

    loaded: Plan | None
    plan: Plan | None
    dynamic: bool
    report: dict | None
    size: int | None
    overhead: int
    where: str


def plan_before_model(cfg: QuantizeConfig, target: Target, source, ts, tensors: list[TensorInfo], info: ModelInfo) -> PlanStart:
    """Everything of the plan that needs no model: a given plan read and checked, a preset's plan, the default size,
    the budget checked against the rules (or the whole dynamic plan, when a report is given with a budget).

    Raises:
        InputError, quant.plan.PlanError: an unreadable or invalid plan.json. planner.BudgetError: the budget is below
        what the rules need. ValueError: a plan of another target or model, a report without the target's formats
        or of another model, a plan needing an imatrix that is not used.
    """
    where = str(cfg.plan) if cfg.plan is not None and not isinstance(cfg.plan, Plan) else "plan"
    loaded = load_plan(cfg.plan) if cfg.plan is not None else None
    if loaded is not None:
        if target.name == "safetensors" and loaded.target != "safetensors":
            raise ValueError(f"{where}: a {loaded.target} plan; make one with 'dynaquant plan --target safetensors'")
        loaded.check_tensors(tensors, where)
    report = schema.load_report(cfg.report) if cfg.report is not None and not isinstance(cfg.report, dict) else cfg.report
    if report is None and loaded is not None and target.name == "safetensors" and loaded.sources.get("report"):
        p = Path(loaded.sources["report"])  # the super weights the plan's analysis found
        report = schema.load_report(p) if p.is_file() else None
    dynamic = loaded is None and cfg.preset is None
    start = PlanStart(loaded, loaded, dynamic, report, cfg.size, 0, where)
    if dynamic:
        start.overhead = target.overhead_bytes(source, ts, tensors, cfg)
        if cfg.bpw is None and cfg.size is None:
            start.size = default_size_bytes(ts, tensors, info, start.overhead)
        if report is not None and cfg.explicit_target:  # the plan itself, once (it fails as the check below would)
            try:
                start.plan, start.size = plan_from_report(cfg, target, start, tensors, info, source.model_id)
            except ValueError:
                _check_budget(cfg, target, tensors, info, start)  # its error first, as before this shortcut
                raise
        else:
            start.size = _check_budget(cfg, target, tensors, info, start)
            _check_candidates(cfg, target, info, report)
    elif cfg.preset is not None:
        start.plan = make_plan(tensors, info, source.model_id, preset=cfg.preset, rules=cfg.rules, has_imatrix=cfg.use_imatrix)
    if not cfg.use_imatrix and not dynamic:
        check_imatrix_needs(start.plan, set())
    return start


def default_size_bytes(ts, tensors: list[TensorInfo], info: ModelInfo, overhead: int) -> int:
    """The default target of a dynamic plan (whole-file bytes, ``overhead`` included): the file size of llama.cpp's
    ``Q4_K_M`` mix (``config.DEFAULT_SIZE_PRESET``). For an already-quantized source (most weights in a quantized GGML
    type: ``source.quantized_source``, such as the default model, a Q4_1 GGUF), re-encoding at that size could give
    a file larger than the source; its default is the first of the ``Q3_K_M`` and ``Q2_K`` mixes' sizes below the
    source's files (``config.QUANTIZED_SOURCE_SIZE_PRESETS``; none below: the last), so that the allocation has bits
    to take away. The rules' minimum still applies (``_check_budget``)."""
    if not quantized_source(ts):
        return preset_size_bytes(tensors, info, DEFAULT_SIZE_PRESET) + overhead
    have = source_bytes(ts)
    sizes = [preset_size_bytes(tensors, info, p) + overhead for p in QUANTIZED_SOURCE_SIZE_PRESETS]
    return next((s for s in sizes if have is None or s < have), sizes[-1])


def _check_budget(cfg: QuantizeConfig, target: Target, tensors, info, start: PlanStart) -> int | None:
    """The budget against the rules alone (no report): fails fast, before any model is loaded, on an explicit budget
    below what the rules need; the default target drops to the rules' minimum (GGUF). Returns the size budget."""
    args = dict(rules=cfg.rules, overhead_bytes=start.overhead, **target.plan_options(info, (), None, cfg))
    if cfg.explicit_target or target.name != "gguf":
        min_plan_bytes(tensors, info, bpw=cfg.bpw, size_bytes=start.size, **args)  # BudgetError as make_plan's
        return start.size
    least = min_plan_bytes(tensors, info, **args)
    if least > start.size:
        log.info("the default target's size is below what the default rules need; default target %d bytes", least)
        return least
    return start.size


def _check_candidates(cfg: QuantizeConfig, target: Target, info: ModelInfo, report: dict | None) -> None:
    if report is not None and not target.plan_options(info, (), report, cfg)["candidates"]:
        raise ValueError(f"{cfg.report if not isinstance(cfg.report, dict) else 'report'}: the analysis measured no "
                         f"{target.name} formats; run 'dynaquant analyze --formats {target.name}'")


def plan_from_report(cfg: QuantizeConfig, target: Target, start: PlanStart, tensors: list[TensorInfo], info: ModelInfo,
                     model_id: str) -> tuple[Plan, int | None]:
    """The dynamic plan from the analysis report (``start.report``): the measured errors of the target's formats.

    Returns:
        (plan, size budget used): the default target (GGUF) drops to the smallest size the rules allow with the
        measured formats when its size is below it.
    Raises:
        ValueError: the report does not match the model or measured none of the target's formats.
        planner.BudgetError: an explicit budget below what the rules need.
    """
    report = start.report
    _check_candidates(cfg, target, info, report)
    rep = Report.typed(report)  # the run's report dict: loaded and checked, or the analysis's own
    check_report(rep, tensors, cfg.report if cfg.report is not None and not isinstance(cfg.report, dict) else "report")
    args = dict(overhead_bytes=start.overhead, error_fn=error_fn_from_report(rep),
                **target.plan_options(info, super_weight_tensors(rep), report, cfg))
    size = start.size
    if not cfg.explicit_target and target.name == "gguf":  # at least the smallest the rules allow with the measured formats
        size = max(size, min_plan_bytes(tensors, info, rules=cfg.rules, **args))
    return make_plan(tensors, info, model_id, rules=cfg.rules, bpw=cfg.bpw, size_bytes=size, solver=cfg.solver, **args), size
