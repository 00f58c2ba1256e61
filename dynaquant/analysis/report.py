"""The analysis report (``report.json``): what ``dynaquant analyze`` measured, per tensor.

Layout (version 1; every float finite or null):

- ``model``: ``id``, ``revision``, ``arch``, ``n_layers``, ``tied_embeddings``, ``n_parameters``;
- ``calibration``: ``id``, ``sources``, ``n_sequences``, ``seq_len``, ``tokens``, ``chat_template``,
  ``fisher_sequences``, ``device``, ``dtype``;
- ``candidates``: GGUF format names measured, cheapest first;
- ``tensors``: one per tensor of the GGUF target, file order: ``name`` (GGUF), ``hf_name``, ``shape``,
  ``n_elements``, ``layer``, ``kind`` (``attn_q`` ... ``ffn_down``, ``token_embd``, ``output``),
  ``group`` (``attn``/``ffn``/``embd``/``output``/``norm``/``other``), ``quantizable``,
  ``super_weight`` (holds a confirmed super weight), ``errors``: format -> ``size_bytes``, ``bpw``,
  ``weighted_rel``, ``output_rel``, ``kld_pred`` (see :mod:`.errors`);
- ``activations``: one per distinct linear-layer input: ``module``, ``layer``, ``kind``, ``tensors``,
  ``absmax``, ``rms``, ``top_channels`` ([channel, max |x|], up to 8), ``massive_channels`` (max |x|
  above 100x the median channel's), ``quant_rel_error`` (``int8``, ``int4``: per-token absmax);
- ``super_weights``: see :class:`.superweights.SuperWeight` (+ ``tensor``, ``ppl_ratio``);
- ``sensitivity``: optional end-to-end rows ``group``, ``layer``, ``kind``, ``format``, ``kld``, ``kld_pred``;
- ``plans``: dynamic plans checked during analysis: ``label``, ``size_bytes``, ``bpw``, ``kld_pred``,
  ``kld_measured``, ``formats`` (GGUF name -> format);
- ``timings_s``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from ..workdir import run_workdir, writing

REPORT_VERSION = 1
_BLK = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.weight|\.bias)?$")


def tensor_kind(name: str) -> str:
    """``blk.3.ffn_down.weight`` -> ``ffn_down``; ``token_embd.weight`` -> ``token_embd``."""
    m = _BLK.match(name)
    if m:
        return m.group(2)
    return re.sub(r"\.(weight|bias)$", "", name)


def tensor_group(name: str) -> str:
    """The layer group of a GGUF tensor: ``attn``, ``ffn``, ``embd``, ``output``, ``norm`` or ``other``."""
    kind = tensor_kind(name)
    if kind.endswith("norm"):
        return "norm"
    if kind.startswith("attn"):
        return "attn"
    if kind.startswith("ffn"):
        return "ffn"
    if kind == "token_embd":
        return "embd"
    if kind == "output":
        return "output"
    return "other"


def activation_entry(module: str, layer: int | None, kind: str, tensors: list[str], absmax,
                     sq_sum: float, tokens: int, quant_rel_error: dict) -> dict:
    """One ``activations`` row from an input's statistics (absmax (K,) torch tensor, sum of x^2, token count)."""
    import torch

    a = absmax.float().cpu()
    top = torch.argsort(a, descending=True)[:8]
    med = float(a.median())
    massive = [int(c) for c in torch.nonzero(a > 100 * max(med, 1e-12)).flatten()]
    return {
        "module": module, "layer": layer, "kind": kind, "tensors": tensors,
        "absmax": float(a.max()), "rms": math.sqrt(sq_sum / max(tokens * a.numel(), 1)),
        "top_channels": [[int(c), float(a[c])] for c in top], "massive_channels": massive,
        "quant_rel_error": {k: float(v) for k, v in quant_rel_error.items()},
    }


def _clean(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def save_report(report: dict, path: str | os.PathLike) -> Path:
    """Write a report as JSON (non-finite floats become null), through a temporary file renamed at the end."""
    return write_json(_clean(report), path)


def write_json(d: dict, path: str | os.PathLike) -> Path:
    """Write JSON (indent 1) as ``write_text`` does."""
    return write_text(json.dumps(d, indent=1), path)


def write_text(text: str, path: str | os.PathLike) -> Path:
    """Write UTF-8 text through a temporary file in the run's work folder beside ``path``
    (:func:`dynaquant.workdir.run_workdir`), renamed at the end (no partial output).

    The file is world-readable (0644) like any other output.

    Raises:
        InputError: the file cannot be written (unwritable folder, full disk), naming ``path``.
    """
    path = Path(path)
    with writing(path), run_workdir(path) as work:
        tmp = work / path.name
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    return path


def load_report(path: str | os.PathLike) -> dict:
    """Read and check a report.json.

    Raises:
        ValueError: unreadable, not JSON, not a dynaquant report, or an unknown version (the message names the file).
    """
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: cannot read report: {exc}") from exc
    if not isinstance(d, dict) or "tensors" not in d or "candidates" not in d:
        raise ValueError(f"{p}: not a dynaquant analysis report (no 'tensors'/'candidates')")
    if d.get("version") != REPORT_VERSION:
        raise ValueError(f"{p}: report version {d.get('version')!r}, this dynaquant reads version {REPORT_VERSION}")
    for t in d["tensors"]:
        if "name" not in t or "shape" not in t:
            raise ValueError(f"{p}: a tensor entry lacks name/shape: {str(t)[:80]}")
    return d
