"""Making a plan: presets, ordered user rules, and a budget allocation.

Order of decisions for each quantizable tensor (as ``llama-quantize`` does):
1. user rules ``(regex, format)``, matched with ``re.search`` against the GGUF name, first
   match wins (``--rule 'ffn_down=Q6_K'``, like ``--tensor-type``);
2. otherwise the preset's choice (``presets.preset_format``), or, with a budget
   (``bpw``/``size_bytes``), the allocator;
3. block-size fallback (``formats.resolve_for_row``), recorded in the reason.
Norms, biases and other 1-D tensors are stored as F32.

Plans for the ``safetensors`` target choose among the runtime formats (``RUNTIME_CANDIDATES``);
presets do not apply (they are llama.cpp mixes), so a budget is required. The token embedding and
tensors that are not 2-D stay BF16 there (compressed-tensors and vLLM quantize linear layers), except
stacked MoE experts (3-D ``ffn_{gate,up,down}_exps``: one format for all experts of the tensor, written
as one linear module per expert), and the allocator gives the tensors vLLM fuses (``tie_groups``: a
block's q/k/v, its gate/up, its gate/up experts) one format together, so the checkpoint loads in vLLM.
Bound rules (``>=`` / ``<=``) compare bits per weight, so GGUF-named bounds (``attn_v>=Q8_0``: at
least 8.5 bpw) apply on both targets; an upper bound below every candidate that fits (the MoE expert
caps IQ2_XXS, 2.06 bpw, against INT2_G128, 2.125 bpw) allows the cheapest of them.

The allocation minimises the summed predicted error within the budget: a multiple-choice knapsack whose items are
the allocation units (a tensor, or a tie group with one format for all its members) and whose options are the unit's
allowed formats with a finite predicted error. ``solver="exact"`` (the default) solves it with ``quant.knapsack``
(a Lagrangian sweep, reduced-cost fixing and a dynamic program: optimal, or the gap to a proved lower bound when its
state cap is reached); ``solver="greedy"`` is the allocator after exllamav3's ``optimize_model``: every free tensor
starts at its cheapest candidate format; the upgrade along the unit's lower convex hull with the largest predicted
error reduction per extra byte is taken until the budget is spent; ties broken by tensor name. Either way the plan
records the solver, the predicted error, the Lagrangian lower bound and the gap (``Plan.solver``). The predicted
error comes from ``error_fn(tensor, format)``; without measurements the default prior is
``n_elements * priority(tensor) * rel_mse(format)``, where ``rel_mse`` is each codec's
relative squared error on Gaussian weights (measured once with the codecs themselves).

A budget below what the default rules' floors allow (``defaults``; a dense Llama-3-8B at 2.5 bpw) relaxes those floors
(``rules.floor_relaxations``: the token embedding and attention as llama.cpp's IQ2 mixes first, the first layers last),
the fewest steps that make it feasible, then allocates as usual; ``Plan.relaxed`` names the steps, each entry's reason
the relaxed rule that bound it, and a warning is logged. User rules are never relaxed; a plan whose budget the
unrelaxed floors allow is made exactly as without this.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from functools import cache

import torch

from dynaquant.names import TensorName
from dynaquant.quant import knapsack
from dynaquant.quant.codecs import get_codec
from dynaquant.quant.formats import RUNTIME_FORMATS, get_format, resolve_for_row
from dynaquant.quant.plan import Plan, PlanEntry, TensorInfo
from dynaquant.quant.presets import ModelInfo, preset_format, requires_imatrix
from dynaquant.quant.rules import (
    EXPERT_CAP,
    Rule,
    default_rules,  # noqa: F401  (its callers import it here)
    relaxation_levels,
)

log = logging.getLogger(__name__)

ErrorFn = Callable[[TensorInfo, str], float]
SOLVERS = ("exact", "greedy")


def _registered(names: Sequence[str]) -> tuple[str, ...]:
    """The formats of ``names`` that have a codec (a codec module still being written is left out)."""
    out = []
    for f in names:
        try:
            get_codec(f)
        except KeyError:
            continue
        out.append(f)
    return tuple(out)


# Formats the allocator may choose for GGUF tensors (llama.cpp's quantized types with a codec here).
# The i-quants IQ3_XXS, IQ2_* and IQ1_* need an imatrix (presets.requires_imatrix): make_plan drops
# them unless ``has_imatrix``.
GGUF_CANDIDATES = _registered((
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K", "IQ3_XXS", "IQ3_S", "Q3_K", "MXFP4", "Q4_0",
    "IQ4_NL", "IQ4_XS", "NVFP4", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0",
))
# Formats the allocator may choose for safetensors tensors: every runtime format, cheapest first.
RUNTIME_CANDIDATES = tuple(sorted(RUNTIME_FORMATS, key=lambda f: (get_format(f).bpw, f)))


class BudgetError(ValueError):
    """The target is smaller than the fixed rules allow; ``min_bytes`` is the smallest possible."""

    def __init__(self, message: str, min_bytes: int):
        super().__init__(message)
        self.min_bytes = min_bytes


# gaussian_rel_mse of every quantized format, as measure_gaussian_rel_mse gives it on the 2-core CPU machine
# (2026-11-27): measuring the 47 formats takes ~9 s there, paid by every plan that uses the prior (the budget check of
# each dynamic run); tests/test_plan.py measures them again and compares.
GAUSSIAN_REL_MSE: dict[str, float] = {
    'Q8_0': 2.4042125005507842e-05,
    'Q5_1': 0.001138794468715787,
    'Q5_0': 0.001603928511030972,
    'Q4_1': 0.004779028240591288,
    'Q4_0': 0.006695461925119162,
    'IQ4_NL': 0.005369367077946663,
    'MXFP4': 0.012376667931675911,
    'Q6_K': 0.0002653700939845294,
    'Q5_K': 0.0011326915118843317,
    'Q4_K': 0.004754255060106516,
    'Q3_K': 0.020464951172471046,
    'Q2_K': 0.06624356657266617,
    'IQ4_XS': 0.005396285094320774,
    'IQ3_S': 0.0170193649828434,
    'IQ3_XXS': 0.03198457509279251,
    'IQ2_S': 0.06768833100795746,
    'IQ2_XS': 0.09340213984251022,
    'IQ2_XXS': 0.1259731650352478,
    'IQ1_M': 0.26977384090423584,
    'IQ1_S': 0.30990809202194214,
    'NVFP4': 0.006571299396455288,
    'INT2_G128': 0.13194958865642548,
    'INT2_G128_ASYM': 0.1328311413526535,
    'INT2_G64': 0.12284915149211884,
    'INT2_G64_ASYM': 0.1233324408531189,
    'INT2_G32': 0.1093020811676979,
    'INT2_G32_ASYM': 0.10946852713823318,
    'INT3_G128': 0.03422166034579277,
    'INT3_G128_ASYM': 0.034724872559309006,
    'INT3_G64': 0.030809013172984123,
    'INT3_G64_ASYM': 0.030704565346240997,
    'INT3_G32': 0.026227552443742752,
    'INT3_G32_ASYM': 0.02554217353463173,
    'INT4_G128': 0.009254311211407185,
    'INT4_G128_ASYM': 0.008988219313323498,
    'INT4_G64': 0.008012070320546627,
    'INT4_G64_ASYM': 0.007500218693166971,
    'INT4_G32': 0.0065306625328958035,
    'INT4_G32_ASYM': 0.005865459330379963,
    'INT8_G128': 3.7138528568902984e-05,
    'INT8_G128_ASYM': 3.4082000638591126e-05,
    'INT8_G64': 2.9400138373603113e-05,
    'INT8_G64_ASYM': 2.727420360315591e-05,
    'INT8_G32': 2.1939544240012765e-05,
    'INT8_G32_ASYM': 2.0766381567227654e-05,
    'MXFP4_G32': 0.012376667931675911,
    'NVFP4_G16': 0.007352444343268871,
}


def measure_gaussian_rel_mse(fmt: str) -> float:
    """Relative squared error ``sum (Q(x) - x)**2 / sum x**2`` of a quantized format's encoder (no imatrix) on 64 i.i.d.
    standard Gaussian rows of 1536 (a fixed seed, float32 on the CPU, the torch reference search: the same number on
    every machine, compiled fast paths or not)."""
    from dynaquant.quant.codecs import dequantize, quantize

    f = get_format(fmt)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 1536, generator=g)
    err = (dequantize(quantize(x, f, backend="torch"), f) - x).pow(2).sum() / x.pow(2).sum()
    return float(err)


@cache
def gaussian_rel_mse(fmt: str) -> float:
    """Relative squared error of a format on i.i.d. Gaussian rows (:func:`measure_gaussian_rel_mse`; the float
    formats a fixed small value): :data:`GAUSSIAN_REL_MSE`'s entry, measured for a format it lacks."""
    f = get_format(fmt)
    if f.kind == "float":
        return {"F32": 0.0, "F16": 1e-7, "BF16": 4e-6}[f.name]
    return GAUSSIAN_REL_MSE[f.name] if f.name in GAUSSIAN_REL_MSE else measure_gaussian_rel_mse(f.name)


def _priority(t: TensorInfo, m: ModelInfo) -> float:
    """Prior importance per weight when nothing is measured (llama.cpp's bumps, as weights)."""
    w = 1.0
    if t.name.startswith("output.") or (t.name.startswith("token_embd") and m.tied_embeddings):
        w *= 4.0
    elif t.name.startswith("token_embd"):
        w *= 0.5
    if ".attn_v." in t.name or ".ffn_down." in t.name:
        w *= 1.5
    if t.layer is not None and (t.layer < m.n_layers // 8 or t.layer >= 7 * m.n_layers // 8):
        w *= 1.5
    return w


def prior_error(m: ModelInfo) -> ErrorFn:
    """The default predicted-error function (no measurements)."""
    return lambda t, fmt: t.n_elements * _priority(t, m) * gaussian_rel_mse(fmt)


def _bytes(t: TensorInfo, fmt: str) -> int:
    return t.n_elements // t.row_size * get_format(fmt).row_bytes(t.row_size)


def _entry(t: TensorInfo, requested: str, reason: str) -> PlanEntry:
    fmt, fb = resolve_for_row(requested, t.row_size)
    return PlanEntry(t.name, t.hf_name, tuple(t.shape), fmt.name, requested, f"{reason}; fallback {fb}" if fb else reason)


def _candidates(ts: Sequence[TensorInfo], names: Sequence[str], error_fn: ErrorFn) -> list[tuple[int, float, str]]:
    """(bytes, error, format) on the lower convex hull of the formats that fit the rows, cheapest first.

    ``ts`` is one tensor, or the tensors of a tie group (one format for all: bytes and errors summed).

    Dominated formats (no cheaper and no better) and formats whose error is not finite are removed;
    so are those below the hull, so the error reduction per extra byte decreases along the list
    (what makes the greedy allocation optimal for the convexified problem).
    """
    opts = _fitting(ts, names, error_fn)
    return [opts[j] for j in knapsack.hull(opts, knapsack.nondominated(opts))]  # nondominated: finite errors only


def _fitting(ts: Sequence[TensorInfo], names: Sequence[str], error_fn: ErrorFn) -> list[tuple[int, float, str]]:
    """(bytes, error, format) of each of ``names`` that fits the rows of every tensor of ``ts`` (bytes and errors
    summed over them), sorted: cheapest first. Errors may be infinite (not measured)."""
    return sorted({(sum(_bytes(t, f) for t in ts), sum(error_fn(t, f) for t in ts), f) for f in names
                   if all(get_format(f).fits(t.row_size) for t in ts)})


def _options(ts: Sequence[TensorInfo], names: Sequence[str], error_fn: ErrorFn) -> list[tuple[int, float, str]]:
    """(bytes, error, format) of every format that fits the rows with a finite error and that no other dominates (no
    more bytes and no higher error), cheapest first: the exact solver's options (``_candidates`` keeps the hull)."""
    opts = _fitting(ts, names, error_fn)
    return [opts[j] for j in knapsack.nondominated(opts)]  # finite errors only


def _bounded(names: Sequence[str], rule: Rule | None, row: int, target: str = "gguf") -> list[str]:
    """Candidates allowed by a bound rule (``>=`` / ``<=`` on bits per weight)."""
    if rule is None or rule.op == "=":
        return list(names)
    bound = get_format(rule.format).bpw
    if rule.op == ">=":
        out = [f for f in names if get_format(f).bpw >= bound - 1e-9]
        if out:
            return out
        fmt = resolve_for_row(rule.format, row)[0]
        if fmt.allowed_in(target):
            return [fmt.name]
        fits = [f for f in names if get_format(f).fits(row)]  # the rule's format is another target's: the best there is
        return [max(fits, key=lambda f: (get_format(f).bpw, f))] if fits else []
    out = [f for f in names if get_format(f).bpw <= bound + 1e-9]
    if target == "gguf":
        if not out or any(get_format(f).fits(row) for f in out):
            return out
        # no format under the bound takes these rows (a 2-bit MoE expert cap on rows of 576: no 256-block
        # format fits): the cheapest formats that do, as llama-quantize falls back
        fits = [f for f in names if get_format(f).fits(row)]
        low = min((get_format(f).bpw for f in fits), default=None)
        return [f for f in fits if get_format(f).bpw <= low + 1e-9] if fits else out
    fits = [f for f in names if get_format(f).fits(row)]  # the bound is another target's format: the closest
    return [min(fits, key=lambda f: (get_format(f).bpw, f))] if fits else []


def _stacked_experts(t: TensorInfo) -> bool:
    """A stacked MoE expert tensor (E, N, K): ``blk.N.ffn_{gate,up,down}_exps.weight``."""
    return len(t.shape) == 3 and re.search(r"\.ffn_(gate|up|down)_exps\.weight$", t.name) is not None


def tie_groups(t: TensorInfo) -> str | None:
    """The vLLM fused-module group of a tensor (``blk.3.attn_qkv``, ``blk.3.ffn_gate_up``, ``blk.3.ffn_gate_up_exps``:
    vLLM's fused MoE holds each expert's gate and up as one ``w13`` weight), or None."""
    tn = TensorName.from_gguf(t.name)
    tied = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_gate_exps", "ffn_up_exps")
    if tn.tower != "text" or tn.block is None or tn.suffix != "weight" or tn.kind not in tied:
        return None
    if tn.kind.endswith("_exps"):
        return f"{tn.prefix}.ffn_gate_up_exps"
    return f"{tn.prefix}." + ("attn_qkv" if tn.kind.startswith("attn") else "ffn_gate_up")


def make_plan(tensors: Sequence[TensorInfo], model: ModelInfo, model_id: str = "", *, preset: str | None = None,
              rules: Sequence[Rule | str] = (), bpw: float | None = None, size_bytes: int | None = None,
              overhead_bytes: int = 0, error_fn: ErrorFn | None = None,
              candidates: Sequence[str] | None = None, defaults: Sequence[Rule] = (),
              error_source: str = "prior error", target: str = "gguf",
              has_imatrix: bool = False, lift_expert_caps: bool = True, solver: str = "exact", relax_floors: bool = True) -> Plan:
    """Plan every tensor of a GGUF (or safetensors) target.

    Args:
        tensors: the target file's tensors, in file order.
        model: model facts for the presets and priors.
        model_id: recorded in the plan.
        preset: a llama.cpp mix name (``Q4_K_M``); the default when no budget is given.
        rules: user rules (``Rule`` or ``'REGEX=FORMAT'``, ``'REGEX>=FORMAT'``, ``'REGEX<=FORMAT'``).
        bpw: budget as average bits per weight over all tensor data (upper bound).
        size_bytes: budget as the whole file's bytes (upper bound); ``overhead_bytes`` is
            the metadata and alignment the file adds to the tensor data.
        error_fn: predicted error of a tensor in a format (default: ``prior_error``); the
            allocator minimises its sum. ``error_source`` names it in the reasons.
        candidates: formats the allocator may choose (default: ``GGUF_CANDIDATES``, or
            ``RUNTIME_CANDIDATES`` for the safetensors target).
        defaults: rules applied after the user's (``default_rules``); for each tensor the first
            matching rule of all (user rules first) decides.
        target: ``gguf`` or ``safetensors`` (module docstring: no presets, a budget required).
        has_imatrix: the encoders will have an imatrix. Without one the allocator never picks a
            format llama.cpp refuses to write without one (``presets.requires_imatrix``: IQ3_XXS,
            IQ2_*, IQ1_*), and the presets decide as ``llama-quantize`` without ``--imatrix``.
            Presets and ``=`` rules are not checked here: ``quantize`` refuses such a plan.
        lift_expert_caps: with a budget, also plan without the default MoE expert caps
            (``default_rules``) and keep that plan when its predicted error is lower (the method
            records it). False keeps them (the default target of a MoE model).
        solver: the allocation's solver (module docstring): ``exact`` (``quant.knapsack``) or ``greedy``.
        relax_floors: a budget below what ``defaults`` allow relaxes their floors, step by step in
            ``rules.floor_relaxations``' order, until it fits (module docstring); False: ``BudgetError`` (the default
            target of a quantize run, which drops to the floors' minimum instead).
    Returns:
        The plan; with a budget, its tensor data fits ``bpw`` or ``size_bytes - overhead_bytes``, and ``solver``
        records the solver, the predicted error of the allocated tensors, its lower bound and the gap.
    Raises:
        ValueError: both or neither of preset/budget given (a preset for safetensors), a bad rule,
            or a candidate or ``=`` rule format not allowed in the target's files, an unknown solver.
        BudgetError: the fixed choices (rules, unquantized tensors, cheapest candidates) exceed the budget, with
            ``relax_floors`` even with every default floor relaxed (``min_bytes`` then that relaxed minimum).
    """
    args = dict(preset=preset, rules=rules, bpw=bpw, size_bytes=size_bytes, overhead_bytes=overhead_bytes,
                error_fn=error_fn, candidates=candidates, defaults=defaults, error_source=error_source, target=target,
                has_imatrix=has_imatrix, lift_expert_caps=lift_expert_caps, solver=solver)
    try:
        return _make_plan(tensors, model, model_id, **args)
    except BudgetError:
        levels = relaxation_levels(defaults, model) if relax_floors and (bpw is not None or size_bytes is not None) else []
        if not levels:
            raise
    for names, relaxed in levels:  # the least relaxed defaults that fit
        try:
            min_plan_bytes(tensors, model, **{**args, "defaults": relaxed}, relax_floors=False)
        except BudgetError:
            continue
        log.warning("the budget is below what the default floors allow; relaxed: %s", "; ".join(names))
        plan = _make_plan(tensors, model, model_id, **{**args, "defaults": relaxed})
        # short: the GGUF's dynaquant.plan.method has room for ~90 characters (targets.gguf_extra_kv's estimate)
        plan.method += f"; default floors relaxed ({len(names)} step{'s' if len(names) > 1 else ''})"
        plan.relaxed = list(names)
        return plan
    min_plan_bytes(tensors, model, **args)  # raises: the fully relaxed minimum
    raise AssertionError("unreachable: the fully relaxed defaults fit")


def _make_plan(tensors, model, model_id, *, preset, rules, bpw, size_bytes, overhead_bytes, error_fn, candidates, defaults,
               error_source, target, has_imatrix, lift_expert_caps, solver) -> Plan:
    """``make_plan`` with ``defaults`` as given (no floor relaxed)."""
    if bpw is not None and size_bytes is not None:
        raise ValueError("give at most one of bpw and size_bytes")
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r} (known: {', '.join(SOLVERS)})")
    capped = [r for r in defaults if r.origin == EXPERT_CAP]
    if lift_expert_caps and capped and (bpw is not None or size_bytes is not None):
        args = dict(preset=preset, rules=rules, bpw=bpw, size_bytes=size_bytes, overhead_bytes=overhead_bytes,
                    error_fn=error_fn, candidates=candidates, error_source=error_source, target=target,
                    has_imatrix=has_imatrix, lift_expert_caps=False, solver=solver)
        plan = _make_plan(tensors, model, model_id, defaults=defaults, **args)
        try:
            lifted = _make_plan(tensors, model, model_id, defaults=[r for r in defaults if r not in capped], **args)
        except BudgetError:  # without the caps other rules (first layers) bind the experts: keep the capped plan
            return plan
        err, by = error_fn or prior_error(model), {t.name: t for t in tensors}

        def predicted(p: Plan) -> float:
            vals = (err(by[e.name], e.format) for e in p.entries if by[e.name].quantizable)
            return sum(v for v in vals if math.isfinite(v))

        if predicted(lifted) < predicted(plan):
            lifted.method += "; MoE expert caps lifted (lower predicted error within the budget)"
            return lifted
        return plan
    budgeted = bpw is not None or size_bytes is not None
    preset, parsed, entries, free, candidates = _decide(tensors, model, preset, rules, budgeted, candidates, defaults,
                                                        target, has_imatrix)
    method = f"preset {preset.upper()}" if preset else ""
    budget: dict = {}
    info = None
    if budgeted:
        total = sum(t.n_elements for t in tensors)
        if bpw is not None:
            limit, budget, method = int(bpw * total / 8), {"bpw": bpw}, f"allocation bpw<={bpw}"
        else:
            limit, budget, method = size_bytes - overhead_bytes, {"size_bytes": size_bytes}, f"allocation size<={size_bytes}"
        info = _allocate(free, entries, limit, error_fn or prior_error(model), candidates, overhead_bytes, total, bpw,
                         error_source, predicted=error_fn is not None, target=target,
                         tie=tie_groups if target == "safetensors" else None, has_imatrix=has_imatrix, solver=solver)
        method += f", {solver} (gap {100 * info['gap_rel']:.2f}%)"
    ordered = [entries[t.name] for t in tensors]
    if error_fn is not None:  # measured errors: every quantized entry records its prediction
        for t, e in zip(tensors, ordered):
            if t.quantizable and e.kld_pred is None:
                v = error_fn(t, e.format)
                e.kld_pred = v if math.isfinite(v) else None
    return Plan(target, model_id, ordered, method, [str(r) for r in parsed], budget, solver=info)


def min_plan_bytes(tensors: Sequence[TensorInfo], model: ModelInfo, *, rules: Sequence[Rule | str] = (),
                   bpw: float | None = None, size_bytes: int | None = None, overhead_bytes: int = 0,
                   error_fn: ErrorFn | None = None, candidates: Sequence[str] | None = None, defaults: Sequence[Rule] = (),
                   target: str = "gguf", has_imatrix: bool = False, relax_floors: bool = True, **_ignored) -> int:
    """The smallest whole-file size (bytes, ``overhead_bytes`` included) a budgeted ``make_plan`` with these arguments
    can have: the fixed rules' and unquantized tensors' bytes plus each free tensor's (or tie group's) cheapest
    allowed format with a finite ``error_fn`` error, with ``relax_floors`` every default floor relaxed
    (``rules.relaxation_levels``). Exactly ``BudgetError.min_bytes``; no allocation is run.

    Args:
        as ``make_plan`` (its other keyword arguments, ``error_source``, ``lift_expert_caps``, are ignored: a budget
        below the capped plan's minimum fails there first); ``bpw`` / ``size_bytes``: also check that budget.
    Raises:
        BudgetError: ``bpw`` or ``size_bytes`` is below the minimum (the message ``make_plan`` gives).
        ValueError: as ``make_plan`` for a bad rule, candidate or target.
    """
    if bpw is not None and size_bytes is not None:
        raise ValueError("give at most one of bpw and size_bytes")
    levels = relaxation_levels(defaults, model) if relax_floors else []
    _, _, entries, free, candidates = _decide(tensors, model, None, rules, True, candidates,
                                              levels[-1][1] if levels else defaults, target, has_imatrix)
    _, used = _cheapest(free, entries, candidates, error_fn or prior_error(model), target,
                        tie_groups if target == "safetensors" else None, has_imatrix)
    if bpw is not None or size_bytes is not None:
        total = sum(t.n_elements for t in tensors)
        _check_limit(used, int(bpw * total / 8) if bpw is not None else size_bytes - overhead_bytes, overhead_bytes, total, bpw,
                     " even with the default floors relaxed" if levels else "")
    return used + overhead_bytes


def preset_size_bytes(tensors: Sequence[TensorInfo], model: ModelInfo, preset: str = "Q4_K_M") -> int:
    """The tensor data bytes of a preset mix without rules or imatrix (``make_plan(..., preset=preset).size_bytes``).

    Raises:
        KeyError / ValueError: an unknown preset.
    """
    _, _, entries, _, _ = _decide(tensors, model, preset, (), False, None, (), "gguf", False)
    return sum(entries[t.name].size_bytes for t in tensors)


def _decide(tensors, model, preset, rules, budgeted, candidates, defaults, target, has_imatrix):
    """The choices before any allocation: (preset, parsed user rules, fixed entries by name, free tensors
    [(tensor, bound rule, label)], candidates)."""
    if budgeted and preset is not None:
        raise ValueError("give a preset or a budget (bpw / size_bytes), not both")
    st = target == "safetensors"
    if target not in ("gguf", "safetensors"):
        raise ValueError(f"unknown target {target!r} (known: gguf, safetensors)")
    if st and not budgeted:
        raise ValueError("presets are llama.cpp mixes: a safetensors plan needs a budget (bpw or size_bytes)")
    if not budgeted and preset is None:
        preset = "Q4_K_M"
    candidates = list(candidates if candidates is not None else (RUNTIME_CANDIDATES if st else GGUF_CANDIDATES))
    for f in candidates:
        if not get_format(f).allowed_in(target):
            raise ValueError(f"candidate {f} is a {get_format(f).target} format, not allowed in a {target} plan")
    parsed = [r if isinstance(r, Rule) else Rule.parse(r) for r in rules]
    for r in parsed:
        if r.op == "=" and not get_format(r.format).allowed_in(target):
            raise ValueError(f"rule {r}: {r.format} is a {get_format(r.format).target} format, not allowed in a {target} plan")
    all_rules = parsed + list(defaults)
    entries: dict[str, PlanEntry] = {}
    free: list[tuple[TensorInfo, Rule | None, str]] = []
    for t in tensors:
        if not t.quantizable:
            entries[t.name] = PlanEntry(t.name, t.hf_name, tuple(t.shape), "F32", "F32", "not quantized (norm, bias or 1-D)")
            continue
        if st and (t.name.startswith("token_embd.") or (len(t.shape) != 2 and not _stacked_experts(t))):
            entries[t.name] = PlanEntry(t.name, t.hf_name, tuple(t.shape), "BF16", "BF16",
                                        "kept BF16: the safetensors runtime quantizes linear weights and experts only")
            continue
        hit = next((r for r in all_rules if r.matches(t.name)), None)
        label = "" if hit is None else (f"rule {parsed.index(hit) + 1}: {hit}" if hit in parsed else f"{hit.origin} ({hit})")
        if hit is not None and hit.op == "=" and get_format(hit.format).allowed_in(target):
            entries[t.name] = _entry(t, hit.format, label)
        elif preset is not None:
            fmt, why = preset_format(preset, t, model, has_imatrix)
            if hit is not None and ((hit.op == ">=" and get_format(fmt).bpw < get_format(hit.format).bpw)
                                    or (hit.op == "<=" and get_format(fmt).bpw > get_format(hit.format).bpw)):
                fmt, why = hit.format, label
            entries[t.name] = _entry(t, fmt, why)
        else:
            free.append((t, hit, label))
    return preset, parsed, entries, free, candidates


def _units(free, candidates, error_fn, target, tie, has_imatrix=True,
           options=_candidates) -> dict[str, tuple[list, list[tuple[int, float, str]]]]:
    """Allocation units: unit name -> (members [(tensor, rule, label)], options: ``options(tensors, formats, error_fn)``,
    the hull by default). A unit is one tensor, or a tie group whose members share at least one allowed format (else
    its members alone)."""
    groups: dict[str, list] = {}
    for item in free:
        key = tie(item[0]) if tie is not None else None
        groups.setdefault(key if key is not None else item[0].name, []).append(item)
    def usable(t):  # without an imatrix, never a format llama.cpp refuses to write without one
        return [f for f in candidates if has_imatrix or not requires_imatrix(t.name, f)]

    units: dict[str, tuple[list, list]] = {}
    for members in groups.values():
        allowed = [set(_bounded(usable(t), rule, t.row_size, target)) for t, rule, _ in members]
        names = [f for f in candidates if all(f in a for a in allowed)]
        opts = options([t for t, _, _ in members], names, error_fn) if len(members) > 1 else []
        if len(members) > 1 and opts:
            units[members[0][0].name] = (members, opts)
            continue
        for t, rule, label in members:
            units[t.name] = ([(t, rule, label)], options([t], _bounded(usable(t), rule, t.row_size, target), error_fn))
    return units


def _cheapest(free, entries, candidates, error_fn, target, tie, has_imatrix, options=_candidates) -> tuple[dict, int]:
    """The allocation units with options (tensors no format can be measured for are fixed in ``entries``), and the
    tensor bytes with every unit at its cheapest option (the same with ``_candidates`` and ``_options``)."""
    units = _units(free, candidates, error_fn, target, tie, has_imatrix, options)
    for u, (members, opts) in list(units.items()):
        if opts:
            continue
        for t, rule, label in members:
            fits = [f for f in _bounded(candidates, rule, t.row_size, target) if get_format(f).fits(t.row_size)]
            if not fits:
                raise ValueError(f"tensor {t.name}: no candidate format fits rows of {t.row_size}")
            # no finite predicted error (a tensor the analysis could not measure, e.g. MLA's attn_k_b / attn_v_b,
            # which llama.cpp derives from kv_b_proj): kept high rather than guessed
            fmt = "Q8_0" if "Q8_0" in fits else max(fits, key=lambda f: (get_format(f).bpw, f))
            entries[t.name] = _entry(t, fmt, f"not measured: kept at {fmt}" + (f"; {label}" if rule is not None else ""))
        del units[u]
    return units, sum(e.size_bytes for e in entries.values()) + sum(opts[0][0] for _, opts in units.values())


def _check_limit(used: int, limit: int, overhead: int, total: int, bpw: float | None, relaxed: str = "") -> None:
    if used > limit:
        unit = f"{8 * used / total:.4f} bpw" if bpw is not None else f"{used + overhead} bytes"
        raise BudgetError(f"the target is too small: the fixed rules and the cheapest formats need at least {unit}{relaxed} "
                          f"({used + overhead} bytes with metadata)", used + overhead)


def _allocate(free, entries, limit, error_fn, candidates, overhead, total, bpw, error_source, predicted,
              target="gguf", tie=None, has_imatrix=True, solver="exact") -> dict:
    """Choose the free units' formats within ``limit`` bytes (into ``entries``); returns ``Plan.solver``'s record."""
    units, used = _cheapest(free, entries, candidates, error_fn, target, tie, has_imatrix,
                            _options if solver == "exact" else _candidates)
    _check_limit(used, limit, overhead, total, bpw)
    fixed = used - sum(opts[0][0] for _, opts in units.values())
    items = [opts for _, opts in units.values()]
    if solver == "exact":
        res = knapsack.solve(items, limit - fixed)
        choice, info = res.choice, dict(exact=res.exact, bound=res.bound, states=res.states, time_s=res.time_s)
    else:
        t0 = time.perf_counter()
        choice = _greedy(units, limit - fixed)
        info = dict(exact=False, bound=knapsack.lower_bound(items, limit - fixed), states=0, time_s=time.perf_counter() - t0)
    pred = sum(opts[j][1] for opts, j in zip(items, choice))
    if info["exact"]:
        info["bound"] = pred  # proved optimal: the bound is the optimum (summed in this order)
    gap = max(pred - info["bound"], 0.0)
    for (members, opts), j in zip(units.values(), choice):
        fmt = opts[j][2]
        for t, rule, label in members:
            others = [m.name for m, _, _ in members if m.name != t.name]
            tied = f" (tied with {', '.join(others)})" if others else ""
            bound = f"; {label}" if rule is not None else ""
            how = (f"option {j + 1} of {len(opts)} from {opts[0][2]} (exact solver)" if solver == "exact"
                   else f"{j} upgrade(s) from {opts[0][2]}")
            entry = _entry(t, fmt, f"allocation: {how} by {error_source}{tied}{bound}")
            entry.kld_pred = error_fn(t, fmt) if predicted else None
            entries[t.name] = entry
    return {"method": solver, "predicted": _round(pred), "bound": _round(info["bound"]), "gap": _round(gap),
            "gap_rel": _round(gap / pred if pred > 0 else 0.0, 4), "exact": bool(info["exact"] or gap == 0),
            "states": int(info["states"]), "time_s": round(info["time_s"], 3)}


def _round(x: float, digits: int = 8) -> float:
    """``x`` to ``digits`` significant digits (a plan.json readable by a person, the same on every machine)."""
    return float(f"{x:.{digits}g}")


def _greedy(units, limit: int) -> list[int]:
    """The greedy allocation (module docstring) along each unit's hull (its options: ``_candidates``), ``limit`` the
    bytes the units may take: the chosen option index per unit, in ``units``' order. Ties go by unit name."""
    names = sorted(units)
    items = [units[u][1] for u in names]
    _, choice = knapsack.hull_greedy(items, [range(len(opts)) for opts in items], limit)
    by_name = dict(zip(names, choice))
    return [by_name[u] for u in units]
