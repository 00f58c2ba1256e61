"""Measured corrections: plan -> measure -> fit a factor per group -> re-plan, until predicted and measured agree.

The allocator minimises a sum of per-tensor predictions of the KL divergence (:func:`.plan.error_fn_from_report`);
at low sizes the model feels more than that sum. Each round measures the plan on held-out calibration sequences
(:func:`dynaquant.analysis.corrections.measure_plan`: the whole plan, and each group quantized alone at the plan's
formats), fits

- a factor per group: the geometric mean over every round (of every size) of measured / predicted of that group
  alone, the prediction being the uncorrected one (``error_fn_from_report(..., use_corrections=False)``), clamped to
  ``[FACTOR_MIN, FACTOR_MAX]``; groups never measured take the mean factor of their kind (the other blocks'
  ``attn`` / ``ffn``), else 1 (``analysis.corrections.factor_lookup``);
- one interaction factor: the geometric mean over the rounds of whole measured / the groups' measured alone summed
  (what the additive model misses: quantizing a block changes the inputs of the next), clamped alike;

stores them in the report's ``corrections`` section (``error_fn_from_report`` applies them: a later ``dynaquant plan
report.json`` reuses them) and re-plans. It stops when ``|predicted - measured| / measured <= tol`` (10 %) for the
whole plan, or after ``rounds`` re-plans. The plan returned is always one that was measured: of the plans measured,
the one with the lowest measured KL divergence (:func:`correct_plan`); when that is the last, the factors in the
section are those it was planned with, else they are fitted on every round and its prediction re-made with them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace

import torch

from dynaquant.analysis.calibration import CalibrationSpec, calibration_chunks
from dynaquant.analysis.corrections import Encodings, PlanMeasure, correction_group, measure_plan, measure_plan_blockwise
from dynaquant.analysis.sensitivity import ReferenceLogits, tf32_matmuls
from dynaquant.config import QuantizeConfig
from dynaquant.pipeline.plan import PlanStart, error_fn_from_report, plan_from_report
from dynaquant.pipeline.targets import Target
from dynaquant.quant.plan import Plan, TensorInfo
from dynaquant.quant.presets import ModelInfo

log = logging.getLogger(__name__)

FACTOR_MIN, FACTOR_MAX = 0.25, 8.0
TOLERANCE = 0.10
AUTO_ROUNDS_CUDA = 2

Measure = Callable[[Plan, str], PlanMeasure]


def auto_rounds(rounds: int | None, device: str | torch.device) -> int:
    """``rounds`` as given, or (None) :data:`AUTO_ROUNDS_CUDA` on a CUDA device and 0 (off) on the CPU.

    Raises:
        ValueError: a negative number of rounds.
    """
    if rounds is None:
        return AUTO_ROUNDS_CUDA if torch.device(device).type == "cuda" else 0
    if rounds < 0:
        raise ValueError(f"correct_rounds {rounds}: give 0 (off) or more rounds")
    return rounds


def check_options(rounds: int | None, sequences: int) -> None:
    """Refuse correction options before any work (``quantize``, ``analyze``).

    Raises:
        ValueError: ``rounds`` negative (None: automatic, allowed) or ``sequences`` below 1.
    """
    if (rounds is not None and rounds < 0) or sequences < 1:
        raise ValueError(f"correct_rounds {rounds}, correct_sequences {sequences}: give 0 (off) or more rounds, and at "
                         "least 1 held-out sequence")


def held_out_chunks(tokenizer, spec: CalibrationSpec, k: int) -> torch.Tensor:
    """(k, seq_len) int64 token ids of the calibration text AFTER the ``spec.n_sequences + 2`` chunks the statistics
    and the analysis's own held-out pair use (never the evaluation text). A text too short for all ``k`` gives the
    chunks it has beyond those (a warning), or the analysis's last two when it has none beyond.

    Raises:
        ValueError: ``k`` < 1, or the errors of ``calibration_chunks``.
    """
    if k < 1:
        raise ValueError(f"correct_sequences {k}: give at least 1 held-out sequence")
    used = spec.n_sequences + 2
    chunks = calibration_chunks(tokenizer, replace(spec, n_sequences=used + k))
    if chunks.shape[0] >= used + k:
        return chunks[-k:]
    extra = chunks[used:]
    log.warning("the calibration text has %d chunk(s) beyond the %d the statistics use; the corrections measure on %s",
                extra.shape[0], used, f"those {extra.shape[0]}" if extra.shape[0] else "the analysis's held-out pair")
    return extra if extra.shape[0] else chunks[-2:]


def fit_factors(rounds: list[dict], lo: float = FACTOR_MIN, hi: float = FACTOR_MAX) -> tuple[dict[str, float], float]:
    """(group -> factor, interaction factor) from round records (:func:`round_record`), as the module says.

    A group's factor is ``exp(mean(log(measured / predicted)))`` over the rounds where both are > 0, clamped to
    ``[lo, hi]``; the interaction is the same over ``kld_measured / groups_sum``; 1 when nothing was measured.
    """
    logs: dict[str, list[float]] = {}
    inter: list[float] = []
    for r in rounds:
        for g in r.get("groups", []):
            if (g.get("kld_pred") or 0) > 0 and (g.get("kld_measured") or 0) > 0:
                logs.setdefault(g["group"], []).append(math.log(g["kld_measured"] / g["kld_pred"]))
        if (r.get("groups_sum") or 0) > 0 and (r.get("kld_measured") or 0) > 0:
            inter.append(math.log(r["kld_measured"] / r["groups_sum"]))

    def clamp(v: list[float]) -> float:
        return min(max(math.exp(sum(v) / len(v)), lo), hi) if v else 1.0

    return {g: clamp(v) for g, v in logs.items()}, clamp(inter)


def round_record(i: int, label: str | None, plan: Plan, m: PlanMeasure) -> dict:
    """One measurement as the ``corrections.rounds`` section records it (:class:`~dynaquant.analysis.report.schema.
    Corrections`): ``kld_pred`` the plan's own (corrected) total, ``kld_pred_base`` the uncorrected one."""
    return {"round": i, "label": label, "size_bytes": plan.size_bytes, "kld_pred": plan.kld_pred,
            "kld_pred_base": m.kld_pred, "kld_measured": m.kld_measured, "groups_sum": m.kld_groups_sum,
            "interaction": m.interaction, "groups": [g.to_dict() for g in m.groups]}


def within(pred: float | None, measured: float, tol: float = TOLERANCE) -> bool:
    """``|pred - measured| / measured <= tol`` (a plan measured at 0 agrees with any prediction: nothing to fit)."""
    if measured <= 0:
        return True
    return pred is not None and abs(pred - measured) / measured <= tol


def correct_plan(report: dict, replan: Callable[[dict], Plan], measure: Measure, *, rounds: int, held_out: dict,
                 label: str | None = None, tol: float = TOLERANCE,
                 repredict: Callable[[dict, Plan], None] | None = None, first: Plan | None = None) -> tuple[Plan, dict]:
    """The loop (module docstring): ``rounds`` re-plans at most, each plan measured.

    Args:
        report: the analysis report dict; its ``corrections`` section, if any, is continued (its rounds count in the
            factors); the dict itself is not changed.
        replan: report dict -> plan (``plan_from_report`` / ``make_plan`` with ``error_fn_from_report``).
        measure: (plan, progress label) -> PlanMeasure, groups' ``kld_pred`` UNcorrected (:func:`model_measure`).
        rounds: re-plans at most (>= 1); a run measures ``rounds + 1`` plans at most.
        held_out: ``{"sequences", "tokens"}`` measured on, recorded in the section.
        label: names the plan's rounds in the section (``"Q2_K size"``).
        repredict: (report dict, plan) -> None: sets the plan's entries' ``kld_pred`` from the report's error function
            (:func:`correct_in_model` gives it); used when the plan returned is not the last one measured.
        first: the plan ``replan`` makes of ``report`` as it is, when the caller has it already (not planned again).
    Returns:
        (the plan, its ``corrections`` recorded: ``Plan.corrections``; the report's new ``corrections`` section).

    The plan returned is the measured plan with the lowest measured KL divergence (the later one on a tie): a re-plan
    with fitted factors is not always better (on the default model at the IQ2_XXS size the corrected plan measured
    0.1008 against the first plan's 0.0974). When that is an earlier plan, the factors are fitted on every round and
    its ``kld_pred`` re-predicted with them (``repredict``), so its prediction is the corrected one; its record says
    which round it is (``chosen``).
    """
    old = report.get("corrections") or {}
    section = {"held_out": dict(held_out), "rounds": list(old.get("rounds") or []),
               "factors": dict(old.get("factors") or {}), "interaction": old.get("interaction") or 1.0}
    plan = first if first is not None else replan({**report, "corrections": section})
    mine, measured = [], []
    for i in range(1, rounds + 2):
        m = measure(plan, f"corrections round {i}")
        rec = round_record(i, label, plan, m)
        section["rounds"].append(rec)
        mine.append({k: rec[k] for k in ("round", "kld_pred", "kld_measured", "groups_sum", "interaction")})
        measured.append((m.kld_measured, plan))
        log.info("corrections round %d: predicted %.5g, measured %.5g, groups alone %.5g", i, plan.kld_pred or 0.0,
                 m.kld_measured, m.kld_groups_sum)
        if within(plan.kld_pred, m.kld_measured, tol) or i > rounds:
            break
        section["factors"], section["interaction"] = fit_factors(section["rounds"])
        plan = replan({**report, "corrections": section})
    best = min(range(len(measured)), key=lambda j: (measured[j][0], -j))
    chosen = {"chosen": best + 1, "kld_measured": measured[best][0]}
    if best != len(measured) - 1:
        plan = measured[best][1]
        section["factors"], section["interaction"] = fit_factors(section["rounds"])
        if repredict is not None:
            repredict({**report, "corrections": section}, plan)
        log.info("corrections: round %d's plan kept (lowest measured KLD); re-predicted %.5g", best + 1,
                 plan.kld_pred or 0.0)
    plan.corrections = {"held_out": dict(held_out), "rounds": mine, **chosen, "kld_pred": plan.kld_pred}
    return plan, section


def model_measure(model, ref: ReferenceLogits | torch.Tensor, tensors: list[TensorInfo], report: dict,
                  imatrix_of: Callable[[str], torch.Tensor | None], progress: bool = True, sk=None,
                  encodings: Encodings | None = None) -> Measure:
    """The measure of :func:`correct_plan` on a loaded model: the plan's quantizable tensors that are parameters of
    ``model`` (a tied output head is the embedding's), grouped by ``correction_group``, predicted uncorrected.

    Args:
        tensors: the plan's tensors (their shapes and layers); imatrix_of: HF parameter name -> (K,) or None.
        sk: a model skeleton (``stream``) instead: ``model`` is its model and ``ref`` the held-out token ids, measured
            block by block (:func:`dynaquant.analysis.corrections.measure_plan_blockwise`).
        encodings: where a loaded model's measured plans keep their bytes for the writer (``measure_plan``).
    """
    base = error_fn_from_report(report, use_corrections=False)
    info = {t.name: t for t in tensors}
    params = {n for n, _ in model.named_parameters()}
    keep: dict[str, tuple[str, torch.Tensor]] = {}  # decoded weights reused across the rounds (measure_plan)

    def measure(plan: Plan, desc: str) -> PlanMeasure:
        fmts, groups, pred = {}, {}, {}
        for e in plan.entries:
            t = info[e.name]
            if t.quantizable and e.hf_name in params:
                fmts[e.hf_name], groups[e.hf_name] = e.format, correction_group(e.name)
                v = base(t, e.format)
                pred[e.hf_name] = v if math.isfinite(v) else 0.0
        if sk is not None:
            return measure_plan_blockwise(sk, ref, fmts, groups, pred, imatrix_of, progress=progress)
        return measure_plan(model, ref, fmts, groups, pred, imatrix_of, progress=progress, desc=desc, keep=keep,
                            encodings=encodings)

    return measure


def correct_in_model(model, tokenizer, spec: CalibrationSpec, report: dict, tensors: list[TensorInfo],
                     replan: Callable[[dict], Plan], imatrix_of: Callable[[str], torch.Tensor | None], *, rounds: int,
                     sequences: int, label: str | None = None, progress: bool = True,
                     first: Plan | None = None, sk=None, encodings: Encodings | None = None) -> tuple[Plan, dict]:
    """:func:`correct_plan` on a loaded model, on ``sequences`` held-out calibration chunks (:func:`held_out_chunks`);
    with ``sk`` (a model skeleton; ``model`` None) block by block, the same figures.

    Cost: one forward pass over the held-out chunks for the reference (keeping every decoder layer's output on a
    loaded model: :class:`ReferenceLogits` ``prefix_states``), then per measured plan one per group (``2 * n_layers``
    + embedding / output; on a loaded model from the group's first layer on) and one for the whole plan, and one
    encode + decode per quantized parameter (on a loaded model, only the parameters whose format changed since the
    last plan measured: the decoded weights are kept between rounds, one model's worth, on the device as far as it
    has room, else on the host); at most ``rounds + 1`` plans are measured. On CUDA every pass (the reference's
    too) runs its float32 matmuls on TF32 tensor cores (:func:`tf32_matmuls`). ``encodings``: see
    :func:`model_measure` (a loaded model only).
    """
    held = held_out_chunks(tokenizer, spec, sequences)
    device = sk.device if sk is not None else next(model.parameters()).device
    with tf32_matmuls(device):
        return _correct_in_model(model, held, report, tensors, replan, imatrix_of, rounds, label, progress, first, sk,
                                 encodings)


def _correct_in_model(model, held: torch.Tensor, report: dict, tensors: list[TensorInfo], replan, imatrix_of, rounds: int,
                      label: str | None, progress: bool, first: Plan | None, sk,
                      encodings: Encodings | None = None) -> tuple[Plan, dict]:
    if sk is not None:
        measure = model_measure(sk.model, held, tensors, report, imatrix_of, progress, sk=sk)
    else:
        measure = model_measure(model, ReferenceLogits(model, held, prefix_states=True), tensors, report, imatrix_of, progress,
                                encodings=encodings)
    info = {t.name: t for t in tensors}

    def repredict(rep: dict, plan: Plan) -> None:
        fn = error_fn_from_report(rep)
        for e in plan.entries:
            if e.kld_pred is not None:
                v = fn(info[e.name], e.format)
                e.kld_pred = v if math.isfinite(v) else None

    return correct_plan(report, replan, measure, rounds=rounds, label=label, repredict=repredict, first=first,
                        held_out={"sequences": int(held.shape[0]), "tokens": int(held.numel())})


def correct_in_run(cfg: QuantizeConfig, target: Target, start: PlanStart, tensors: list[TensorInfo], info: ModelInfo,
                   model_id: str, model, tokenizer, importance: dict[str, torch.Tensor], rounds: int,
                   first: Plan, sk=None, encodings: Encodings | None = None) -> tuple[Plan, dict]:
    """A quantize run's dynamic plan corrected (:func:`correct_in_model`), re-planned as ``plan_from_report`` plans it;
    with ``sk`` (``stream``: a model skeleton, ``model`` None) measured block by block.

    Args:
        importance: GGUF name -> (K,) importance the run's encoders use. rounds: ``auto_rounds``' answer (>= 1).
        first: the run's plan (``plan_from_report`` of ``start``): the first round measures it.
        encodings: where the measured plans keep their bytes for the run's writer (``model_measure``), or None.
    Returns:
        (the plan, the report dict with its ``corrections`` section: a copy, ``start.report`` is not changed).
    """
    hf_to_gguf = {t.hf_name: t.name for t in tensors if t.hf_name}

    def replan(rep: dict) -> Plan:
        return plan_from_report(cfg, target, replace(start, report=rep), tensors, info, model_id)[0]

    plan, section = correct_in_model(model, tokenizer, cfg.spec(), start.report, tensors, replan,
                                     lambda n: importance.get(hf_to_gguf.get(n, "")), rounds=rounds,
                                     sequences=cfg.correct_sequences, label="this plan", progress=cfg.progress,
                                     first=first, sk=sk, encodings=encodings)
    return plan, {**start.report, "corrections": section}
