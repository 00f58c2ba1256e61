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
import re
from dataclasses import asdict, dataclass, field

from .formats import FORMATS, get_format

TARGETS = ("gguf", "safetensors")

PLAN_VERSION = 1


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
        m = re.match(r"blk\.(\d+)\.", self.name)
        return int(m.group(1)) if m else None


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
    """

    target: str
    model: str
    entries: list[PlanEntry]
    method: str = ""
    rules: list[str] = field(default_factory=list)
    budget: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)

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
            "sources": dict(self.sources),
            "size_bytes": self.size_bytes,
            "bpw": round(self.bpw, 4),
            "kld_pred": self.kld_pred,
            "tensors": [
                {k: (list(v) if k == "shape" else v) for k, v in asdict(e).items()} for e in self.entries
            ],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> Plan:
        """Build and validate a plan from its dict.

        Raises:
            ValueError: a missing field, an unknown target or format name, a format not allowed in the
                target's files, or a format whose block size does not divide the tensor's rows; the
                message names ``source`` and the tensor.
        """
        try:
            target = d["target"]
            tensors = d["tensors"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{source}: not a plan (missing {exc})") from exc
        if target not in TARGETS:
            raise ValueError(f"{source}: unknown target {target!r} (known: {', '.join(TARGETS)})")
        entries = []
        for i, t in enumerate(tensors):
            try:
                name, fmt = t["name"], t["format"]
                shape = tuple(int(x) for x in t["shape"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{source}: tensor #{i} lacks name/format/shape ({exc})") from exc
            if fmt.upper() not in FORMATS:
                raise ValueError(f"{source}: tensor {name}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
            f = get_format(fmt)
            if not f.allowed_in(target):
                raise ValueError(f"{source}: tensor {name}: {f.name} is a {f.target} format, not allowed in a {target} plan")
            if not f.fits(shape[-1]):
                raise ValueError(f"{source}: tensor {name}: {f.name} needs rows that are a multiple of "
                                 f"{f.block_size}, the tensor's rows have {shape[-1]}")
            entries.append(PlanEntry(name, t.get("hf_name"), shape, f.name, t.get("requested", f.name),
                                     t.get("reason", "edited"), t.get("kld_pred")))
        return cls(target, d.get("model", ""), entries, d.get("method", "file"), list(d.get("rules", [])),
                   dict(d.get("budget", {})), dict(d.get("sources", {})))

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
