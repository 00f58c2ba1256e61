"""Making a plan: presets, ordered user rules, and a budget allocation.

Order of decisions for each quantizable tensor (as ``llama-quantize`` does):
1. user rules ``(regex, format)``, matched with ``re.search`` against the GGUF name, first
   match wins (``--rule 'ffn_down=Q6_K'``, like ``--tensor-type``);
2. otherwise the preset's choice (``presets.preset_format``), or, with a budget
   (``bpw``/``size_bytes``), the allocator;
3. block-size fallback (``formats.resolve_for_row``), recorded in the reason.
Norms, biases and other 1-D tensors are stored as F32.

The allocator (after exllamav3's ``optimize_model``): every free tensor starts at its
cheapest candidate format; the upgrade with the largest predicted error reduction per
extra byte is taken until the budget is spent; ties broken by tensor name. The predicted
error comes from ``error_fn(tensor, format)``; without measurements the default prior is
``n_elements * priority(tensor) * rel_mse(format)``, where ``rel_mse`` is each codec's
relative squared error on Gaussian weights (measured once with the codecs themselves).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from .formats import FORMATS, get_format, resolve_for_row
from .plan import Plan, PlanEntry, TensorInfo
from .presets import ModelInfo, preset_format

ErrorFn = Callable[[TensorInfo, str], float]

# Formats the allocator may choose for GGUF tensors (those that llama.cpp runs on every backend).
GGUF_CANDIDATES = ("Q2_K", "Q3_K", "MXFP4", "Q4_0", "IQ4_NL", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


@dataclass(frozen=True)
class Rule:
    """A user rule: tensors whose GGUF name matches ``pattern`` (``re.search``) get ``format``."""

    pattern: str
    format: str

    @classmethod
    def parse(cls, text: str) -> Rule:
        """Parse ``'REGEX=FORMAT'``.

        Raises:
            ValueError: no ``=``, an invalid regex, or an unknown format (named in the message).
        """
        pattern, sep, fmt = text.rpartition("=")
        if not sep or not pattern or not fmt:
            raise ValueError(f"rule {text!r}: expected REGEX=FORMAT, e.g. 'ffn_down=Q6_K'")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"rule {text!r}: invalid regex: {exc}") from exc
        if fmt.upper() not in FORMATS:
            raise ValueError(f"rule {text!r}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
        return cls(pattern, fmt.upper())

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None

    def __str__(self) -> str:
        return f"{self.pattern}={self.format}"


class BudgetError(ValueError):
    """The target is smaller than the fixed rules allow; ``min_bytes`` is the smallest possible."""

    def __init__(self, message: str, min_bytes: int):
        super().__init__(message)
        self.min_bytes = min_bytes


@cache
def gaussian_rel_mse(fmt: str) -> float:
    """Relative squared error of a format on i.i.d. Gaussian rows of 1536 (float, deterministic)."""
    from .codecs import dequantize, quantize

    f = get_format(fmt)
    if f.kind == "float":
        return {"F32": 0.0, "F16": 1e-7, "BF16": 4e-6}[f.name]
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 1536, generator=g)
    err = (dequantize(quantize(x, f), f) - x).pow(2).sum() / x.pow(2).sum()
    return float(err)


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


def _candidates(t: TensorInfo, names: Sequence[str], error_fn: ErrorFn) -> list[tuple[int, float, str]]:
    """(bytes, error, format) for the formats that fit the rows, dominated ones removed, cheapest first."""
    opts = sorted({(_bytes(t, f), error_fn(t, f), f) for f in names if get_format(f).fits(t.row_size)})
    hull: list[tuple[int, float, str]] = []
    for b, e, f in opts:
        if hull and e >= hull[-1][1]:
            continue  # costs more and is no better than a cheaper one
        while hull and hull[-1][0] == b:
            hull.pop()
        hull.append((b, e, f))
    return hull


def make_plan(tensors: Sequence[TensorInfo], model: ModelInfo, model_id: str = "", *, preset: str | None = None,
              rules: Sequence[Rule | str] = (), bpw: float | None = None, size_bytes: int | None = None,
              overhead_bytes: int = 0, error_fn: ErrorFn | None = None,
              candidates: Sequence[str] = GGUF_CANDIDATES) -> Plan:
    """Plan every tensor of a GGUF target.

    Args:
        tensors: the target file's tensors, in file order.
        model: model facts for the presets and priors.
        model_id: recorded in the plan.
        preset: a llama.cpp mix name (``Q4_K_M``); the default when no budget is given.
        rules: user rules (``Rule`` or ``'REGEX=FORMAT'``), first match wins.
        bpw: budget as average bits per weight over all tensor data (upper bound).
        size_bytes: budget as the whole file's bytes (upper bound); ``overhead_bytes`` is
            the metadata and alignment the file adds to the tensor data.
        error_fn: predicted error of a tensor in a format (default: ``prior_error``).
        candidates: formats the allocator may choose.
    Returns:
        The plan; with a budget, its tensor data fits ``bpw`` or ``size_bytes - overhead_bytes``.
    Raises:
        ValueError: both or neither of preset/budget given, or a bad rule.
        BudgetError: the fixed choices (rules, unquantized tensors, cheapest candidates) exceed the budget.
    """
    if bpw is not None and size_bytes is not None:
        raise ValueError("give at most one of bpw and size_bytes")
    budgeted = bpw is not None or size_bytes is not None
    if budgeted and preset is not None:
        raise ValueError("give a preset or a budget (bpw / size_bytes), not both")
    if not budgeted and preset is None:
        preset = "Q4_K_M"
    parsed = [r if isinstance(r, Rule) else Rule.parse(r) for r in rules]
    entries: dict[str, PlanEntry] = {}
    free: list[TensorInfo] = []
    for t in tensors:
        if not t.quantizable:
            entries[t.name] = PlanEntry(t.name, t.hf_name, tuple(t.shape), "F32", "F32", "not quantized (norm, bias or 1-D)")
            continue
        hit = next((i for i, r in enumerate(parsed) if r.matches(t.name)), None)
        if hit is not None:
            entries[t.name] = _entry(t, parsed[hit].format, f"rule {hit + 1}: {parsed[hit]}")
        elif preset is not None:
            entries[t.name] = _entry(t, *preset_format(preset, t, model))
        else:
            free.append(t)
    method = f"preset {preset.upper()}" if preset else ""
    budget: dict = {}
    if budgeted:
        total = sum(t.n_elements for t in tensors)
        if bpw is not None:
            limit, budget, method = int(bpw * total / 8), {"bpw": bpw}, f"allocation bpw<={bpw}"
        else:
            limit, budget, method = size_bytes - overhead_bytes, {"size_bytes": size_bytes}, f"allocation size<={size_bytes}"
        _allocate(free, entries, limit, error_fn or prior_error(model), candidates, overhead_bytes, total, bpw)
    ordered = [entries[t.name] for t in tensors]
    return Plan("gguf", model_id, ordered, method, [str(r) for r in parsed], budget)


def _allocate(free, entries, limit, error_fn, candidates, overhead, total, bpw) -> None:
    fixed = sum(e.size_bytes for e in entries.values())
    options = {t.name: _candidates(t, candidates, error_fn) for t in free}
    for t in free:
        if not options[t.name]:
            raise ValueError(f"tensor {t.name}: no candidate format fits rows of {t.row_size}")
    level = {t.name: 0 for t in free}
    used = fixed + sum(options[t.name][0][0] for t in free)
    if used > limit:
        unit = f"{8 * used / total:.4f} bpw" if bpw is not None else f"{used + overhead} bytes"
        raise BudgetError(f"the target is too small: the fixed rules and the cheapest formats need at least {unit} "
                          f"({used + overhead} bytes with metadata)", used + overhead)

    def push(heap, t):
        opts, i = options[t.name], level[t.name]
        if i + 1 < len(opts):
            db = opts[i + 1][0] - opts[i][0]
            de = opts[i][1] - opts[i + 1][1]
            heapq.heappush(heap, (-de / db, t.name, i))

    by_name = {t.name: t for t in free}
    heap: list = []
    for t in free:
        push(heap, t)
    steps = 0
    while heap:
        _, name, i = heapq.heappop(heap)
        if level[name] != i:
            continue
        opts = options[name]
        db = opts[i + 1][0] - opts[i][0]
        if used + db > limit:
            continue  # this upgrade does not fit; smaller ones may
        used += db
        level[name] = i + 1
        steps += 1
        push(heap, by_name[name])
    for t in free:
        opts = options[t.name]
        entries[t.name] = _entry(t, opts[level[t.name]][2],
                                 f"allocation: {level[t.name]} upgrade(s) from {opts[0][2]}, prior error")
