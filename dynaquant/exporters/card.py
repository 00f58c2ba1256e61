"""The model card (``README.md``) of a published output folder, built with ``huggingface_hub``'s ``ModelCard``.

The metadata (the YAML front matter the Hugging Face hub reads) is a ``huggingface_hub.ModelCardData``:
``base_model``, ``base_model_relation: quantized``, ``library_name``, ``tags``, ``license``, ``language`` and
``pipeline_tag`` (the hub's model card spec: https://huggingface.co/docs/hub/model-cards). The body is markdown
composed here from a :class:`CardFacts`, plain data the pipeline collects from the run (this module reads and
writes no files and imports neither the analysis nor the runtime).

``library_name``: ``gguf`` for GGUF files (the hub's own library id for GGUF repositories, whose files it
lists with their types and offers to llama.cpp and the other local apps); ``dynaquant`` for the safetensors target:
its compressed-tensors checkpoints hold dynaquant's runtime formats and are run by ``dynaquant.load``, so the
hub's ``transformers`` snippet (``AutoModelForCausalLM.from_pretrained``) would not load them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynaquant.names import TensorName
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan

if TYPE_CHECKING:  # (imported where used: huggingface_hub's import is ~0.3 s of every run's start-up otherwise)
    from huggingface_hub import ModelCard, ModelCardData

LIBRARY_NAMES = {"gguf": "gguf", "safetensors": "dynaquant"}
NOT_MEASURED = "not measured"
# tensor groups of the plan summary, in the card's order
GROUPS = ("attention", "dense MLP", "routed experts", "shared experts", "embeddings", "vision", "other")


@dataclass(frozen=True)
class MeasuredRow:
    """One row of the card's quality table.

    Attributes:
        label: what was measured (``"this model (dynamic 5bpw)"``, ``"Q5_K_M (uniform preset)"``).
        size_bytes: bytes of the model files (GGUF: all shards; safetensors: the shards).
        bpw: average bits per weight over the tensor data (scales included, metadata excluded).
        kld_mean: mean KL(original || quantized) per scored token, nats; None: not measured.
        ppl: perplexity of the quantized model on the evaluation text; None: not measured.
        top1_agreement: fraction in [0, 1] of scored positions where both models' argmax agree; None: not measured.
    """

    label: str
    size_bytes: int
    bpw: float
    kld_mean: float | None = None
    ppl: float | None = None
    top1_agreement: float | None = None


@dataclass(frozen=True)
class GroupRow:
    """The plan's choices for one group of tensors (:func:`tensor_group`).

    Attributes:
        group: one of :data:`GROUPS`.
        tensors: tensors in the group. n_elements: their weights.
        formats: format name -> tensors in that format (largest count first).
        bpw: average bits per weight over the group's tensor data.
    """

    group: str
    tensors: int
    n_elements: int
    formats: tuple[tuple[str, int], ...]
    bpw: float


@dataclass(frozen=True)
class CardFacts:
    """Everything the card says, as plain data.

    Attributes:
        target: ``gguf`` or ``safetensors``.
        base_model: the source's hub id, or its folder / file name for a local source.
        architecture: the model's architecture (GGUF ``general.architecture``, e.g. ``llama``).
        model_files: the model's files in the folder, first (the one to load) first: GGUF file(s), or the
            checkpoint's ``*.safetensors`` shards.
        command: the exact command as run (shell-quoted), or its Python equivalent.
        method: the plan's method (``allocation bpw<=5``, ``preset Q4_K_M``, ...).
        calibration: calibration data in words (names, sequences x tokens), or None: no calibration.
        calibration_tokens: calibration tokens (sequences x context), 0 when unknown or none.
        eval_text: the evaluation text's id, or None: not measured. eval_tokens: tokens scored.
        ppl_reference: the original's perplexity on the evaluation text, or None.
        rows: the quality table (this model first; the uniform preset after it with ``--compare-presets``).
        groups: the plan by tensor group (:func:`plan_groups`).
        plots: PNG files in the folder, (file name, caption).
        files: the other files in the folder, (file name, what it is).
        license, language: copied from the source's card or metadata (None: not known).
        vision: a vision-language model (``pipeline_tag`` ``image-text-to-text``). mmproj: its projector GGUF, if any.
        assumptions: what a memory-fit target assumed (name -> value), or None.
        source_revision: the source's resolved hub commit, or None.
    """

    target: str
    base_model: str
    architecture: str
    model_files: tuple[str, ...]
    command: str
    method: str
    calibration: str | None = None
    calibration_tokens: int = 0
    eval_text: str | None = None
    eval_tokens: int = 0
    ppl_reference: float | None = None
    rows: tuple[MeasuredRow, ...] = ()
    groups: tuple[GroupRow, ...] = ()
    plots: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    license: str | None = None
    language: tuple[str, ...] = ()
    vision: bool = False
    mmproj: str | None = None
    assumptions: dict = field(default_factory=dict)
    source_revision: str | None = None


def tensor_group(name: str) -> str:
    """The group of a GGUF (or HF) tensor name in the card's plan summary (one of :data:`GROUPS`).

    ``blk.N.attn_*`` -> attention; ``blk.N.ffn_*_exps`` -> routed experts; ``blk.N.ffn_*_shexp`` -> shared experts;
    other ``blk.N.ffn_*`` -> dense MLP; ``token_embd`` / ``output`` (the head) -> embeddings; the vision tower and
    projector -> vision; anything else (norms, routers' gates of other names, ...) -> other.
    """
    t = TensorName.from_gguf(name)
    if t.block is None and t.tower == "text":  # outside GGUF's blocks: maybe an HF name
        hf = TensorName.from_hf(name)
        t = hf if hf.kind is not None or hf.block is not None or hf.tower != "text" else t
    kind = t.kind or ""
    if t.tower != "text":
        return "vision"
    if kind in ("token_embd", "output", "per_layer_token_embd"):
        return "embeddings"
    if t.block is None:
        return "other"
    if kind.endswith("_exps") or t.expert is not None:
        return "routed experts"
    if kind.endswith("_shexp"):
        return "shared experts"
    if kind.startswith("attn_") and not kind.endswith("_norm"):
        return "attention"
    if kind.startswith("ffn_") and not kind.endswith("_norm") and kind != "ffn_gate_inp":
        return "dense MLP"
    return "other"


def plan_groups(plan: Plan) -> tuple[GroupRow, ...]:
    """The plan summarised by :func:`tensor_group`: per group the formats (tensor counts) and the mean bpw."""
    acc: dict[str, dict] = {}
    for e in plan.entries:
        g = acc.setdefault(tensor_group(e.name), {"n": 0, "el": 0, "bytes": 0, "fmt": {}})
        g["n"] += 1
        g["el"] += e.n_elements
        g["bytes"] += e.size_bytes
        g["fmt"][e.format] = g["fmt"].get(e.format, 0) + 1
    rows = []
    for name in GROUPS:
        if name in acc:
            g = acc[name]
            fmts = tuple(sorted(g["fmt"].items(), key=lambda kv: (-kv[1], kv[0])))
            rows.append(GroupRow(name, g["n"], g["el"], fmts, 8 * g["bytes"] / max(g["el"], 1)))
    return tuple(rows)


def card_data(facts: CardFacts) -> ModelCardData:
    """The card's metadata (front matter) for ``facts``."""
    from huggingface_hub import ModelCardData

    tags = [facts.target, "quantized", "dynaquant"] + ([facts.architecture] if facts.architecture else [])
    if facts.vision:
        tags.append("vision")
    language = list(facts.language) or None
    return ModelCardData(base_model=facts.base_model, base_model_relation="quantized",
                         library_name=LIBRARY_NAMES[facts.target], tags=tags, license=facts.license,
                         language=language[0] if language and len(language) == 1 else language,
                         pipeline_tag="image-text-to-text" if facts.vision else "text-generation")


def _num(x: float | None, spec: str) -> str:
    return NOT_MEASURED if x is None or not math.isfinite(x) else format(x, spec)


def quality_table(rows: Iterable[MeasuredRow]) -> list[str]:
    """Markdown lines of the quality table: size (MB, 10^6 bytes, and exact bytes), bpw, mean KLD (nats, 6 places),
    perplexity (4 places) and top-1 agreement (percent, 2 places); ``not measured`` where a value is None."""
    lines = ["| model | size | bpw | mean KLD | perplexity | top-1 agreement |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        top1 = NOT_MEASURED if r.top1_agreement is None else f"{100 * r.top1_agreement:.2f}%"
        lines.append(f"| {r.label} | {r.size_bytes / 1e6:.2f} MB ({r.size_bytes} bytes) | {r.bpw:.4f} | "
                     f"{_num(r.kld_mean, '.6f')} | {_num(r.ppl, '.4f')} | {top1} |")
    return lines


def _group_lines(groups: Iterable[GroupRow]) -> list[str]:
    lines = ["| tensors | count | weights | types (tensors) | bpw |", "|---|---:|---:|---|---:|"]
    for g in groups:
        types = ", ".join(f"{f} ({n}, {get_format(f).bpw:.4g} bits)" for f, n in g.formats)
        lines.append(f"| {g.group} | {g.tensors} | {g.n_elements} | {types} | {g.bpw:.3f} |")
    return lines


def _usage(facts: CardFacts) -> list[str]:
    first = facts.model_files[0] if facts.model_files else "MODEL"
    if facts.target == "gguf":
        mm = f" --mmproj {facts.mmproj}" if facts.mmproj else ""
        extra = (" (the other shards beside it are found by llama.cpp)" if len(facts.model_files) > 1 else "")
        return [f"With llama.cpp{extra}:", "", "```sh", f"llama-cli -m {first}{mm}", "```"]
    return ["In PyTorch, with dynaquant (its kernels run the packed formats):", "", "```python", "import dynaquant",
            "", "model = dynaquant.load(\"PATH_OR_REPO_FOLDER\")  # a transformers causal LM", "```"]


def card_body(facts: CardFacts) -> str:
    """The card's markdown body (everything after the front matter)."""
    what = "GGUF" if facts.target == "gguf" else "safetensors (compressed-tensors)"
    out = [f"# {facts.base_model} ({what}, quantized by dynaquant)", "",
           f"A mixed-precision quantization of `{facts.base_model}` made by dynaquant: `{facts.method}`.", ""]
    if facts.source_revision:
        out += [f"Source revision: `{facts.source_revision}`.", ""]
    out += ["## How it was made", "", "```sh" if not facts.command.startswith(("run_quantize", "from ")) else "```python",
            facts.command, "```", ""]
    if facts.calibration:
        tok = f" ({facts.calibration_tokens} tokens)" if facts.calibration_tokens else ""
        out += [f"Calibration data: {facts.calibration}{tok}.", ""]
    else:
        out += ["Calibration data: none (no imatrix, no analysis).", ""]
    if facts.assumptions:
        out += ["Memory-fit assumptions:", ""] + [f"- {k}: {v}" for k, v in facts.assumptions.items()] + [""]
    out += ["## Quality against the original", ""]
    if facts.eval_text:
        ref = f"; the original's perplexity is {facts.ppl_reference:.4f}" if facts.ppl_reference is not None else ""
        out += [f"Measured at the end of the run on `{facts.eval_text}` ({facts.eval_tokens} scored tokens){ref}.", ""]
    else:
        out += [f"Evaluation: {NOT_MEASURED}.", ""]
    out += quality_table(facts.rows) + [""]
    out += ["## The plan by tensor kind", ""] + _group_lines(facts.groups) + [""]
    for png, caption in facts.plots:
        out += [f"![{caption}]({png})", "", f"*{caption}*", ""]
    out += ["## How to run it", ""] + _usage(facts) + [""]
    files = [(f, "model file") for f in facts.model_files] + ([(facts.mmproj, "vision projector (llama.cpp --mmproj)")]
                                                               if facts.mmproj else []) + list(facts.files)
    out += ["## Files", ""] + [f"- `{f}`: {what_}" for f, what_ in files] + [""]
    return "\n".join(out)


def build_card(facts: CardFacts) -> ModelCard:
    """The model card: :func:`card_data` as front matter, :func:`card_body` below it.

    Raises:
        KeyError: an unknown ``facts.target``.
    """
    from huggingface_hub import ModelCard

    data = card_data(facts)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{card_body(facts)}")
