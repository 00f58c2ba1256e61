"""The checks :func:`dynaquant.analysis.report.schema.load_report` and ``Report.from_dict`` run on a report.json dict.

What the planner and the quantize pipeline read must be well formed: a bad value raises
:class:`~dynaquant.errors.InputError` naming the file, the tensor and the field.
"""

from __future__ import annotations

import math

from dynaquant.errors import InputError
from dynaquant.quant.formats import FORMATS

_ERROR_FIELDS = ("size_bytes", "bpw", "weighted_rel", "output_rel", "kld_pred")


def short(x, n: int = 60) -> str:
    """``repr(x)`` cut to ``n`` characters (with "...") for an error message."""
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def _nonneg(v) -> bool:
    """A finite number >= 0 (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _check_model(p, m) -> None:
    if m is None:
        return
    if not isinstance(m, dict):
        raise InputError(f"{p}: 'model' must be an object, got {short(m)}")
    for k in ("n_layers", "n_head", "n_head_kv", "n_expert", "gguf_overhead_bytes", "n_parameters"):
        v = m.get(k)
        if v is not None and (type(v) is not int or v < 0):
            raise InputError(f"{p}: model.{k} must be an integer >= 0 or null, got {short(v)}")
    for k in ("id", "revision", "arch"):
        if m.get(k) is not None and not isinstance(m[k], str):
            raise InputError(f"{p}: model.{k} must be a string or null, got {short(m[k])}")
    ef = m.get("expert_format")
    if ef is not None and (not isinstance(ef, str) or ef.upper() not in FORMATS):
        raise InputError(f"{p}: model.expert_format must be a format name or null, got {short(ef)}")


def _check_tensor(p, i: int, t, seen: set[str]) -> None:
    if not isinstance(t, dict):
        raise InputError(f"{p}: tensors[{i}] is not an object: {short(t)}")
    name, shape = t.get("name"), t.get("shape")
    if not isinstance(name, str) or not name:
        raise InputError(f"{p}: tensors[{i}] has no name (a non-empty string), got {short(name)}")
    where = f"{p}: tensor {name if len(name) <= 100 else name[:97] + '...'}"
    if name in seen:
        raise InputError(f"{where} appears twice")
    seen.add(name)
    if (not isinstance(shape, list) or not 0 < len(shape) <= 8 or not all(type(x) is int and x > 0 for x in shape)
            or math.prod(shape) > 2**53):
        raise InputError(f"{where}: shape must be a list of 1 to 8 positive integers, got {short(shape)}")
    if t.get("hf_name") is not None and not isinstance(t["hf_name"], str):
        raise InputError(f"{where}: hf_name must be a string or null, got {short(t['hf_name'])}")
    for k in ("quantizable", "super_weight"):
        if t.get(k) is not None and not isinstance(t[k], bool):
            raise InputError(f"{where}: {k} must be true or false, got {short(t[k])}")
    errors = t.get("errors", {})
    if errors is None:
        return
    if not isinstance(errors, dict):
        raise InputError(f"{where}: errors must be an object (format -> measurements), got {short(errors)}")
    for fmt, e in errors.items():
        fmt = fmt if len(fmt) <= 20 else fmt[:17] + "..."
        if not isinstance(e, dict):
            raise InputError(f"{where}: errors.{fmt} must be an object, got {short(e)}")
        for k in _ERROR_FIELDS:
            if e.get(k) is not None and not _nonneg(e[k]):
                raise InputError(f"{where}: errors.{fmt}.{k} is {short(e[k])}; a measured error "
                                 "is a finite number >= 0 (or null when not measured)")


def check_report(p, d, version: int) -> None:
    """Check a report.json dict ``d`` read from ``p`` (a path or a name: the messages' prefix); ``version``: the one
    this dynaquant reads.

    Checked: ``version``; ``candidates`` known format names; ``model`` integer facts integers >= 0 where present;
    every tensor an object with a unique ``name``, a ``shape`` of positive integers, and ``errors`` whose fields are
    finite numbers >= 0 or null; ``sensitivity`` rows' ``kld`` / ``kld_pred`` likewise; confirmed ``super_weights``
    with a module and integer row and column; ``imatrix`` a string; ``corrections`` (optional) an object whose
    ``factors`` are finite numbers > 0 by group and ``interaction`` a finite number > 0 or null.

    Raises:
        InputError: not a dynaquant report (no 'tensors'/'candidates'), another version, or a check failing.
    """
    if not isinstance(d, dict) or "tensors" not in d or "candidates" not in d:
        raise InputError(f"{p}: not a dynaquant analysis report (no 'tensors'/'candidates')")
    got = d.get("version")
    if type(got) is not int or got != version:
        raise InputError(f"{p}: report version {short(got)}, this dynaquant reads version {version}")
    cands = d["candidates"]
    if not isinstance(cands, list) or not all(isinstance(c, str) and c.upper() in FORMATS for c in cands):
        raise InputError(f"{p}: candidates must be a list of format names, got {short(cands)}")
    _check_model(p, d.get("model"))
    if not isinstance(d["tensors"], list):
        raise InputError(f"{p}: 'tensors' must be a list, got {short(d['tensors'])}")
    seen: set[str] = set()
    for i, t in enumerate(d["tensors"]):
        _check_tensor(p, i, t, seen)
    sens = d.get("sensitivity")
    if sens is not None:
        if not isinstance(sens, list) or not all(isinstance(r, dict) for r in sens):
            raise InputError(f"{p}: sensitivity must be a list of rows, got {short(sens)}")
        for i, r in enumerate(sens):
            if not isinstance(r.get("group"), str):
                raise InputError(f"{p}: sensitivity[{i}].group must be a string, got {short(r.get('group'))}")
            for k in ("kld", "kld_pred"):
                if r.get(k) is not None and not _nonneg(r[k]):
                    raise InputError(f"{p}: sensitivity[{i}] ({r['group']}).{k} is {short(r[k])}; "
                                     "expected a finite number >= 0 or null")
    sws = d.get("super_weights")
    if sws is not None:
        if not isinstance(sws, list) or not all(isinstance(r, dict) for r in sws):
            raise InputError(f"{p}: super_weights must be a list of objects, got {short(sws)}")
        for i, r in enumerate(sws):
            for k in ("row", "column"):
                if r.get(k) is not None and (type(r[k]) is not int or r[k] < 0):
                    raise InputError(f"{p}: super_weights[{i}].{k} must be an integer >= 0, got {short(r[k])}")
            if r.get("confirmed") and not (isinstance(r.get("module"), str) and type(r.get("row")) is int
                                           and type(r.get("column")) is int):
                raise InputError(f"{p}: super_weights[{i}] is confirmed but lacks module/row/column")
    _check_corrections(p, d.get("corrections"))
    if d.get("imatrix") is not None and not isinstance(d["imatrix"], str):
        raise InputError(f"{p}: imatrix must be a file name, got {short(d['imatrix'])}")


def _check_corrections(p, c) -> None:
    """The planner multiplies predictions by these: each must be a finite number > 0."""
    if c is None:
        return
    if not isinstance(c, dict):
        raise InputError(f"{p}: corrections must be an object, got {short(c)}")
    factors = c.get("factors") or {}
    if not isinstance(factors, dict):
        raise InputError(f"{p}: corrections.factors must be an object (group -> factor), got {short(factors)}")
    for g, f in factors.items():
        if not _nonneg(f) or f == 0:
            raise InputError(f"{p}: corrections.factors[{short(g, 40)}] is {short(f)}; expected a finite number > 0")
    inter = c.get("interaction")
    if inter is not None and (not _nonneg(inter) or inter == 0):
        raise InputError(f"{p}: corrections.interaction is {short(inter)}; expected a finite number > 0 or null")
    if c.get("rounds") is not None and not isinstance(c["rounds"], list):
        raise InputError(f"{p}: corrections.rounds must be a list, got {short(c['rounds'])}")
