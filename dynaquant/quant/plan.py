"""Plans: which format every tensor of a target file gets, and why.

A plan is made for one target (``gguf`` or ``safetensors``) and maps every tensor, by
llama.cpp's tensor names (as ``llama-quantize --tensor-type`` matches them, on both targets so
that rules and analysis reports apply to either; ``hf_name`` is the Hugging Face name, the
safetensors file's), to a format allowed in that target's files (``Format.allowed_in``), with
the reason: the preset rule, the user rule, the allocation step or the block-size fallback
that chose it.
Plans convert to and from JSON-ready dicts (human-editable) and are validated on load.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dynaquant.names import TensorName
from dynaquant.quant.fit import MemoryFit
from dynaquant.quant.formats import FORMATS, get_format

TARGETS = ("gguf", "safetensors")

PLAN_VERSION = 1


# A tensor of more elements than this is no real tensor (and would overflow the float bpw arithmetic).
MAX_ELEMENTS = 2**53


class PlanError(ValueError):
    """A plan that cannot be used; the message names the plan file (or ``"plan"``) and the entry."""


def _short(x, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _opt(d: dict, key: str, typ: type, default, source: str):
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, typ):
        raise PlanError(f"{source}: {key!r} must be a {typ.__name__}, got {_short(v)}")
    return v


def _budget(d: dict, source: str) -> dict:
    """``{}``, ``{"bpw": x}`` (finite, > 0) or ``{"size_bytes": n}`` (int > 0), as ``planner.make_plan`` records it."""
    b = _opt(d, "budget", dict, {}, source)
    if not b:
        return {}
    if len(b) != 1 or not set(b) <= {"bpw", "size_bytes"}:
        raise PlanError(f"{source}: 'budget' must be {{}}, {{\"bpw\": X}} or {{\"size_bytes\": N}}, got {_short(b)}")
    (k, v), = b.items()
    ok = (_is_number(v) and math.isfinite(v) and v > 0) if k == "bpw" else (type(v) is int and v > 0)
    if not ok:
        raise PlanError(f"{source}: budget {k} must be a positive {'number' if k == 'bpw' else 'integer'}, got {_short(v)}")
    return {k: v}


def _solver(d: dict, source: str) -> dict | None:
    """``Plan.solver`` as ``to_dict`` writes it (optional): a known method, finite numbers, ``exact`` a bool."""
    v = _opt(d, "solver", dict, None, source)
    if v is None:
        return None
    if v.get("method") not in ("exact", "greedy"):
        raise PlanError(f"{source}: solver method must be 'exact' or 'greedy', got {_short(v.get('method'))}")
    for k in ("predicted", "bound", "gap", "gap_rel", "time_s"):
        if k in v and not (_is_number(v[k]) and math.isfinite(v[k])):
            raise PlanError(f"{source}: solver {k} must be a finite number, got {_short(v[k])}")
    if not isinstance(v.get("exact", False), bool) or not (type(v.get("states", 0)) is int and v.get("states", 0) >= 0):
        raise PlanError(f"{source}: solver exact must be true or false and states an integer >= 0")
    return dict(v)


def _entry_from_dict(t, i: int, target: str, source: str) -> PlanEntry:
    if not isinstance(t, dict):
        raise PlanError(f"{source}: tensor #{i} is not an object with name, format and shape: {_short(t)}")
    lacking = [k for k in ("name", "format", "shape") if k not in t]
    if lacking:
        raise PlanError(f"{source}: tensor #{i} lacks {'/'.join(lacking)}")
    name, fmt, shape = t["name"], t["format"], t["shape"]
    if not isinstance(name, str) or not name:
        raise PlanError(f"{source}: tensor #{i}: name must be a non-empty string, got {_short(name)}")
    where = f"{source}: tensor {_short(name, 100) if len(name) > 100 else name}"
    if not isinstance(fmt, str):
        raise PlanError(f"{where}: format must be a format name (a string), got {_short(fmt)}")
    if not isinstance(shape, list) or not 0 < len(shape) <= 8 or not all(type(x) is int and x > 0 for x in shape):
        raise PlanError(f"{where}: shape must be a list of 1 to 8 positive integers, got {_short(shape)}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise PlanError(f"{where}: shape {_short(shape)} has more than 2**53 elements")
    if fmt.upper() not in FORMATS:
        raise PlanError(f"{where}: unknown format {_short(fmt)}; known: {', '.join(FORMATS)}")
    f = get_format(fmt)
    if not f.allowed_in(target):
        raise PlanError(f"{where}: {f.name} is a {f.target} format, not allowed in a {target} plan")
    if not f.fits(shape[-1]):
        raise PlanError(f"{where}: {f.name} needs rows that are a multiple of {f.block_size}, the tensor's rows have "
                        f"{shape[-1]}")
    hf_name = t.get("hf_name")
    if hf_name is not None and not isinstance(hf_name, str):
        raise PlanError(f"{where}: hf_name must be a string or null, got {_short(hf_name)}")
    requested = t.get("requested", f.name)
    if not isinstance(requested, str) or requested.upper() not in FORMATS:
        raise PlanError(f"{where}: requested must be a format name, got {_short(requested)}")
    reason = t.get("reason", "edited")
    if not isinstance(reason, str):
        raise PlanError(f"{where}: reason must be a string, got {_short(reason)}")
    kld = t.get("kld_pred")
    if kld is not None and not (_is_number(kld) and math.isfinite(kld) and kld >= 0):
        raise PlanError(f"{where}: kld_pred must be a finite number >= 0 or null, got {_short(kld)}")
    return PlanEntry(name, hf_name, tuple(shape), f.name, get_format(requested).name, reason,
                     None if kld is None else float(kld))


@dataclass(frozen=True)
class TensorInfo:
    """What a planner knows about one tensor of the target file.

    Attributes:
        name: target name (GGUF: ``blk.3.ffn_down.weight``).
        hf_name: Hugging Face parameter name, or None.
        shape: torch order; the last axis is the row (GGUF ne[0]).
        quantizable: a 2-D (or 3-D expert) matmul weight; False for norms, biases, 1-D tensors.
    """

    name: str
    hf_name: str | None
    shape: tuple[int, ...]
    quantizable: bool = True

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_size(self) -> int:
        return self.shape[-1]

    @property
    def layer(self) -> int | None:
        """Block index parsed from ``blk.N.``, or None for tensors outside the blocks."""
        tn = TensorName.from_gguf(self.name)
        return tn.block if tn.tower == "text" else None


@dataclass
class PlanEntry:
    """One tensor's decision.

    Attributes:
        name, hf_name, shape: as in TensorInfo.
        format: the format written (after any block-size fallback).
        requested: the format the rule or allocator asked for (differs from ``format`` after a fallback).
        reason: why (``"preset Q4_K_M: attn_v use_more_bits"``, ``"rule 1: ffn_down=Q6_K"``,
            ``"allocation: step 12"``; a fallback appends ``"; fallback Q4_K->Q5_0: row 576 ..."``).
        kld_pred: the KL divergence (nats/token) the analysis predicts this tensor adds in this format, if known.
    """

    name: str
    hf_name: str | None
    shape: tuple[int, ...]
    format: str
    requested: str
    reason: str
    kld_pred: float | None = None

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def size_bytes(self) -> int:
        """Bytes of tensor data (no alignment padding)."""
        fmt = get_format(self.format)
        return self.n_elements // self.shape[-1] * fmt.row_bytes(self.shape[-1])


@dataclass
class Plan:
    """A whole plan.

    Attributes:
        target: ``"gguf"`` or ``"safetensors"``.
        model: the source model id.
        entries: one per tensor of the target file, in file order.
        method: how it was made (``"preset Q4_K_M"``, ``"allocation bpw<=4.5"``, ``"file"``).
        rules: the user rules applied (``"ffn_down=Q6_K"``), in order.
        budget: the target given (``{"bpw": 4.5}`` or ``{"size_bytes": 100_000_000}``), or {}.
        sources: the analysis artifacts the plan was made from (``{"report": path, "imatrix": path}``), or {}.
        fit: the memory-fit assumptions behind ``budget`` (``--fit-memory``), or None (then absent from the JSON).
        corrections: the measured corrections behind the entries' ``kld_pred`` (``{"held_out": {...}, "rounds":
            [{"round", "kld_pred", "kld_measured", "groups_sum", "interaction"}, ...], "chosen": the round whose plan
            this is (the lowest measured), "kld_measured", "kld_pred": its figures}``, KL divergence in nats/token;
            ``dynaquant.pipeline.corrections``), or None (then absent from the JSON).
        solver: the allocation's solver record, or None (no allocation; then absent from the JSON):
            ``{"method": "exact" | "greedy", "predicted": summed predicted error of the allocated tensors,
            "bound": a proved lower bound of it (the Lagrangian bound, or the optimum when exact), "gap":
            predicted - bound, "gap_rel": gap / predicted, "exact": proved optimal, "states": the exact solver's
            dynamic-program states, "time_s": seconds}`` (``planner``, ``quant.knapsack``). ``time_s`` is not
            written to the JSON (a plan.json is the same on every run).
        relaxed: the default floors relaxed to make ``budget`` feasible (``quant.rules.floor_relaxations``' step
            names, in the order applied), or None (none relaxed; then absent from the JSON, ``relaxed_floors`` there).
    """

    target: str
    model: str
    entries: list[PlanEntry]
    method: str = ""
    rules: list[str] = field(default_factory=list)
    budget: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    fit: MemoryFit | None = None
    corrections: dict | None = None
    solver: dict | None = None
    relaxed: list[str] | None = None

    @property
    def size_bytes(self) -> int:
        """Bytes of tensor data (metadata and padding excluded)."""
        return sum(e.size_bytes for e in self.entries)

    @property
    def n_elements(self) -> int:
        return sum(e.n_elements for e in self.entries)

    @property
    def kld_pred(self) -> float | None:
        """Sum of the entries' predicted KL divergence, or None when no entry has a prediction."""
        vals = [e.kld_pred for e in self.entries if e.kld_pred is not None]
        return sum(vals) if vals else None

    @property
    def bpw(self) -> float:
        """Average bits per weight over all tensor data (metadata excluded)."""
        return 8.0 * self.size_bytes / max(self.n_elements, 1)

    def formats(self) -> dict[str, str]:
        """Tensor name -> format name."""
        return {e.name: e.format for e in self.entries}

    def count_by_format(self) -> dict[str, int]:
        """Format name -> number of weights stored in it."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.format] = out.get(e.format, 0) + e.n_elements
        return out

    def to_dict(self) -> dict:
        """JSON-ready dict (the plan.json layout)."""
        return {
            "version": PLAN_VERSION,
            "target": self.target,
            "model": self.model,
            "method": self.method,
            "rules": list(self.rules),
            "budget": dict(self.budget),
            **({"relaxed_floors": list(self.relaxed)} if self.relaxed is not None else {}),
            **({"fit": self.fit.to_dict()} if self.fit is not None else {}),
            **({"solver": {k: v for k, v in self.solver.items() if k != "time_s"}} if self.solver is not None else {}),
            "sources": dict(self.sources),
            "size_bytes": self.size_bytes,
            "bpw": round(self.bpw, 4),
            "kld_pred": self.kld_pred,
            "tensors": [
                {k: (list(v) if k == "shape" else v) for k, v in asdict(e).items()} for e in self.entries
            ],
            **({"corrections": self.corrections} if self.corrections is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> Plan:
        """Build and validate a plan from its dict (``to_dict``'s layout; ``version``, ``model``, ``method``,
        ``rules``, ``budget``, ``relaxed_floors``, ``fit``, ``sources``, ``corrections``, ``solver`` and each entry's ``hf_name``,
        ``requested``, ``reason``, ``kld_pred`` optional; the derived ``size_bytes``, ``bpw`` and ``kld_pred`` totals are
        recomputed).

        Raises:
            PlanError: ``source`` is not a plan object, a field has the wrong type, an entry lacks ``name``,
                ``format`` or ``shape`` or has a non-positive dimension, a tensor appears twice, an unknown
                target or format name, a format not allowed in the target's files, a format whose block size
                does not divide the tensor's rows, a ``kld_pred`` that is negative or not finite, a bad
                ``budget``, ``fit`` or ``solver``, or entries whose tensor data exceeds the plan's own ``budget``; the message names
                ``source`` and the entry.
        """
        if not isinstance(d, dict):
            raise PlanError(f"{source}: not a plan (a JSON object with 'target' and 'tensors' expected, "
                            f"got {type(d).__name__})")
        missing = [k for k in ("target", "tensors") if k not in d]
        if missing:
            raise PlanError(f"{source}: not a plan (missing {', '.join(map(repr, missing))})")
        version = d.get("version", PLAN_VERSION)
        if type(version) is not int or version != PLAN_VERSION:
            raise PlanError(f"{source}: plan version {_short(version)}, this dynaquant reads version {PLAN_VERSION}")
        target, tensors = d["target"], d["tensors"]
        if not isinstance(target, str) or target not in TARGETS:
            raise PlanError(f"{source}: unknown target {_short(target)} (known: {', '.join(TARGETS)})")
        if not isinstance(tensors, list):
            raise PlanError(f"{source}: 'tensors' must be a list of entries, got {type(tensors).__name__}")
        entries: list[PlanEntry] = []
        seen: dict[str, int] = {}
        for i, t in enumerate(tensors):
            e = _entry_from_dict(t, i, target, source)
            if e.name in seen:
                raise PlanError(f"{source}: tensor {e.name} appears twice (tensors #{seen[e.name]} and #{i}); "
                                "a plan gives each tensor one format")
            seen[e.name] = i
            entries.append(e)
        model, method = _opt(d, "model", str, "", source), _opt(d, "method", str, "file", source)
        rules = _opt(d, "rules", list, [], source)
        if not all(isinstance(r, str) for r in rules):
            raise PlanError(f"{source}: 'rules' must be a list of strings (REGEX=FORMAT)")
        sources = _opt(d, "sources", dict, {}, source)
        if not all(isinstance(v, str) for v in sources.values()):
            raise PlanError(f"{source}: 'sources' values must be file paths (strings)")
        try:
            fit = MemoryFit.from_dict(d["fit"], source) if d.get("fit") is not None else None
        except ValueError as e:
            raise PlanError(str(e)) from None
        corrections = _opt(d, "corrections", dict, None, source)
        relaxed = _opt(d, "relaxed_floors", list, None, source)
        if relaxed is not None and not all(isinstance(r, str) for r in relaxed):
            raise PlanError(f"{source}: 'relaxed_floors' must be a list of strings (the relaxed floors' names)")
        plan = cls(target, model, entries, method, list(rules), _budget(d, source), dict(sources), fit,
                   corrections=corrections, solver=_solver(d, source), relaxed=relaxed)
        plan._check_budget(source)
        return plan

    def _check_budget(self, source: str) -> None:
        """The entries' tensor data within the recorded budget, as the allocator made it: ``bpw`` bounds
        ``size_bytes * 8 / n_elements``; ``size_bytes`` (the whole file) bounds the tensor data alone."""
        size = self.size_bytes
        if "bpw" in self.budget and size > self.budget["bpw"] * self.n_elements / 8:
            limit = f"{self.budget['bpw']:g} bpw"
        elif "size_bytes" in self.budget and size > self.budget["size_bytes"]:
            limit = f"{self.budget['size_bytes']} bytes"
        else:
            return
        raise PlanError(f"{source}: the entries need {size} bytes of tensor data ({self.bpw:.4f} bpw), above the "
                        f"plan's own budget of {limit}; choose cheaper formats, or change or remove 'budget'")

    def check_tensors(self, tensors: list[TensorInfo], source: str = "plan") -> None:
        """Check the plan covers exactly these tensors with these shapes.

        Raises:
            ValueError: an unknown tensor name, a missing tensor or a shape mismatch (named).
        """
        have = {t.name: t for t in tensors}
        mine = {e.name: e for e in self.entries}
        unknown = sorted(set(mine) - set(have))
        if unknown:
            raise ValueError(f"{source}: tensors not in the model: {', '.join(unknown[:5])}"
                             + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
        missing = sorted(set(have) - set(mine))
        if missing:
            raise ValueError(f"{source}: no format for tensors: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        for name, e in mine.items():
            if tuple(have[name].shape) != tuple(e.shape):
                raise ValueError(f"{source}: tensor {name} has shape {list(have[name].shape)} in the model, "
                                 f"{list(e.shape)} in the plan")
