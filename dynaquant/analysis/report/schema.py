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

from dynaquant.errors import InputError
from dynaquant.names import TensorName
from dynaquant.quant.formats import FORMATS
from dynaquant.workdir import run_workdir, writing

REPORT_VERSION = 1


def tensor_kind(name: str) -> str:
    """``blk.3.ffn_down.weight`` -> ``ffn_down``; ``token_embd.weight`` -> ``token_embd``."""
    tn = TensorName.from_gguf(name)
    if tn.block is None or (tn.tower == "text" and tn.leaf):
        return tn.kind
    return re.sub(r"\.(weight|bias)$", "", name)  # vision blocks keep their whole name


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


_ERROR_FIELDS = ("size_bytes", "bpw", "weighted_rel", "output_rel", "kld_pred")


def _short(x, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def _nonneg(v) -> bool:
    """A finite number >= 0 (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _check_model(p: Path, m) -> None:
    if m is None:
        return
    if not isinstance(m, dict):
        raise InputError(f"{p}: 'model' must be an object, got {_short(m)}")
    for k in ("n_layers", "n_head", "n_head_kv", "n_expert", "gguf_overhead_bytes", "n_parameters"):
        v = m.get(k)
        if v is not None and (type(v) is not int or v < 0):
            raise InputError(f"{p}: model.{k} must be an integer >= 0 or null, got {_short(v)}")
    for k in ("id", "revision", "arch"):
        if m.get(k) is not None and not isinstance(m[k], str):
            raise InputError(f"{p}: model.{k} must be a string or null, got {_short(m[k])}")
    ef = m.get("expert_format")
    if ef is not None and (not isinstance(ef, str) or ef.upper() not in FORMATS):
        raise InputError(f"{p}: model.expert_format must be a format name or null, got {_short(ef)}")


def _check_tensor(p: Path, i: int, t, seen: set[str]) -> None:
    if not isinstance(t, dict):
        raise InputError(f"{p}: tensors[{i}] is not an object: {_short(t)}")
    name, shape = t.get("name"), t.get("shape")
    if not isinstance(name, str) or not name:
        raise InputError(f"{p}: tensors[{i}] has no name (a non-empty string), got {_short(name)}")
    where = f"{p}: tensor {name if len(name) <= 100 else name[:97] + '...'}"
    if name in seen:
        raise InputError(f"{where} appears twice")
    seen.add(name)
    if (not isinstance(shape, list) or not 0 < len(shape) <= 8 or not all(type(x) is int and x > 0 for x in shape)
            or math.prod(shape) > 2**53):
        raise InputError(f"{where}: shape must be a list of 1 to 8 positive integers, got {_short(shape)}")
    if t.get("hf_name") is not None and not isinstance(t["hf_name"], str):
        raise InputError(f"{where}: hf_name must be a string or null, got {_short(t['hf_name'])}")
    for k in ("quantizable", "super_weight"):
        if t.get(k) is not None and not isinstance(t[k], bool):
            raise InputError(f"{where}: {k} must be true or false, got {_short(t[k])}")
    errors = t.get("errors", {})
    if errors is None:
        return
    if not isinstance(errors, dict):
        raise InputError(f"{where}: errors must be an object (format -> measurements), got {_short(errors)}")
    for fmt, e in errors.items():
        fmt = fmt if len(fmt) <= 20 else fmt[:17] + "..."
        if not isinstance(e, dict):
            raise InputError(f"{where}: errors.{fmt} must be an object, got {_short(e)}")
        for k in _ERROR_FIELDS:
            if e.get(k) is not None and not _nonneg(e[k]):
                raise InputError(f"{where}: errors.{fmt}.{k} is {_short(e[k])}; a measured error "
                                 "is a finite number >= 0 (or null when not measured)")


def load_report(path: str | os.PathLike) -> dict:
    """Read and check a report.json.

    Checked (what the planner and the quantize pipeline read): ``version``; ``candidates`` known format names;
    ``model.n_layers`` (and the other integer facts) integers >= 0 where present; every tensor an object with a unique
    ``name``, a ``shape`` of positive integers, and ``errors`` whose ``size_bytes``, ``bpw``, ``weighted_rel``,
    ``output_rel`` and ``kld_pred`` are finite numbers >= 0 or null (a negative or NaN error would be planned
    with as if it were the best); ``sensitivity`` rows' ``kld`` / ``kld_pred`` likewise; confirmed
    ``super_weights`` with a module and integer row and column; ``imatrix`` a string.

    Raises:
        InputError: unreadable, not UTF-8 or not JSON, not a dynaquant report, an unknown version, or any
            check above failing (the message names the file, the tensor and the field).
    """
    p = Path(path)
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON, UTF-8, or a 4300+ digit integer
        raise InputError(f"{p}: cannot read report: {exc}") from exc
    if not isinstance(d, dict) or "tensors" not in d or "candidates" not in d:
        raise InputError(f"{p}: not a dynaquant analysis report (no 'tensors'/'candidates')")
    version = d.get("version")
    if type(version) is not int or version != REPORT_VERSION:
        raise InputError(f"{p}: report version {_short(version)}, this dynaquant reads version {REPORT_VERSION}")
    cands = d["candidates"]
    if not isinstance(cands, list) or not all(isinstance(c, str) and c.upper() in FORMATS for c in cands):
        raise InputError(f"{p}: candidates must be a list of format names, got {_short(cands)}")
    _check_model(p, d.get("model"))
    if not isinstance(d["tensors"], list):
        raise InputError(f"{p}: 'tensors' must be a list, got {_short(d['tensors'])}")
    seen: set[str] = set()
    for i, t in enumerate(d["tensors"]):
        _check_tensor(p, i, t, seen)
    sens = d.get("sensitivity")
    if sens is not None:
        if not isinstance(sens, list) or not all(isinstance(r, dict) for r in sens):
            raise InputError(f"{p}: sensitivity must be a list of rows, got {_short(sens)}")
        for i, r in enumerate(sens):
            if not isinstance(r.get("group"), str):
                raise InputError(f"{p}: sensitivity[{i}].group must be a string, got {_short(r.get('group'))}")
            for k in ("kld", "kld_pred"):
                if r.get(k) is not None and not _nonneg(r[k]):
                    raise InputError(f"{p}: sensitivity[{i}] ({r['group']}).{k} is {_short(r[k])}; "
                                     "expected a finite number >= 0 or null")
    sws = d.get("super_weights")
    if sws is not None:
        if not isinstance(sws, list) or not all(isinstance(r, dict) for r in sws):
            raise InputError(f"{p}: super_weights must be a list of objects, got {_short(sws)}")
        for i, r in enumerate(sws):
            for k in ("row", "column"):
                if r.get(k) is not None and (type(r[k]) is not int or r[k] < 0):
                    raise InputError(f"{p}: super_weights[{i}].{k} must be an integer >= 0, got {_short(r[k])}")
            if r.get("confirmed") and not (isinstance(r.get("module"), str) and type(r.get("row")) is int
                                           and type(r.get("column")) is int):
                raise InputError(f"{p}: super_weights[{i}] is confirmed but lacks module/row/column")
    if d.get("imatrix") is not None and not isinstance(d["imatrix"], str):
        raise InputError(f"{p}: imatrix must be a file name, got {_short(d['imatrix'])}")
    return d
