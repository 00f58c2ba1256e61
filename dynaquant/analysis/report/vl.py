"""The vision-tower section of the HTML report (:mod:`.html`) for vision-language models.

The text model's figures take the ``blk.N.*`` tensors (Mllama's cross-attention projections appear
there as their own kinds, ``cross_attn_q`` ... ``cross_attn_o``). The vision tower's tensors
(``v.blk.N.*``, Mllama's global stack ``v.global.blk.N.*``) and the projector (``mm.*``, names of
:mod:`dynaquant.sources.hf_vl_full`) get this section: per-layer error curves of the vision layers
and the plan heat map of the vision layers plus the projector. Vision names are mapped onto the
page layout (:mod:`.plots`): ``v.blk.N.attn_q.weight`` -> ``blk.N.attn_q.weight``; the global stack follows the
local one (``v.global.blk.M.kind`` -> ``blk.{n_local + M}.global_kind``), so its rows stay apart.
"""

from __future__ import annotations

import re

from dynaquant.analysis.report.plots import fig_layer_errors, fig_plan, layer_error_curves, plan_from_json, plan_grid

_VBLK = re.compile(r"^v\.(global\.)?blk\.(\d+)\.(.+)$")


def is_vision_name(name: str) -> bool:
    """True for vision tower and projector plan names (``v.*``, ``mm.*``)."""
    return name.startswith(("v.", "mm."))


def vision_name_map(names) -> dict[str, str]:
    """Plan name -> page name for the vision-tower block tensors among ``names`` (module docstring);
    projector names map to themselves; other names are left out."""
    names = list(names)
    local = [int(m.group(2)) for n in names if (m := _VBLK.match(n)) and not m.group(1)]
    n_local = max(local) + 1 if local else 0
    out = {}
    for n in names:
        m = _VBLK.match(n)
        if m:
            layer = int(m.group(2)) + (n_local if m.group(1) else 0)
            out[n] = f"blk.{layer}.{'global_' if m.group(1) else ''}{m.group(3)}"
        elif n.startswith("mm."):
            out[n] = n
    return out


def vision_report(report: dict) -> dict:
    """A copy of ``report`` whose tensors are only the vision block tensors, renamed (module docstring)."""
    tensors = [t for t in report.get("tensors") or [] if isinstance(t, dict) and _VBLK.match(str(t.get("name", "")))]
    names = vision_name_map(t["name"] for t in tensors)
    out = []
    for t in tensors:
        new = names[t["name"]]
        kind = new.split(".", 2)[2].removesuffix(".weight").removesuffix(".bias")
        out.append({**t, "name": new, "layer": int(new.split(".")[1]), "kind": kind})
    return {**report, "tensors": out}


def vision_section(p, report: dict, plan: dict | None = None) -> None:
    """Add the vision section to a report page ``p`` (:class:`.html.Page`); nothing when the report has no vision tensors."""
    vr = vision_report(report)
    if not vr["tensors"]:
        return
    p.section("vision", "Vision tower and projector")
    for metric, label in (("kld_pred", "predicted KLD (nats/token)"), ("output_rel", "output error ‖ΔW·X‖ / ‖W·X‖")):
        curves = layer_error_curves(vr, metric)
        if not curves.layers or not curves.formats:
            p.note(f"Vision tower {metric}: not measured.")
            continue
        p.figure(f"fig-vision-layer-{metric}", fig_layer_errors(curves, [], label),
                 f"Vision tower: {label} per layer and format",
                 "x: vision layer (the global stack, where there is one, after the local layers; its kinds start with "
                 "global_); y (log): error of each candidate format, from image + text calibration. The first panel "
                 "sums the layer's tensors, the others show one tensor kind each.")
    quant = {t["name"]: bool(t.get("quantizable")) for t in report.get("tensors") or [] if isinstance(t, dict) and "name" in t}
    todo = [(x.get("label", f"plan {i}"), x.get("formats") or {}, quant) for i, x in enumerate(report.get("plans") or [])
            if isinstance(x, dict)]
    if plan is not None:
        formats, q = plan_from_json(plan)
        todo.append(("plan.json", formats, {**quant, **q}))
    for i, (label, formats, q) in enumerate(todo):
        names = vision_name_map(formats)
        grid = plan_grid({names[n]: f for n, f in formats.items() if n in names},
                         {names[n]: v for n, v in q.items() if n in names})
        if grid.layers or grid.other:
            p.figure(f"fig-vision-plan-{i}", fig_plan(grid, f"{label}: vision tower and projector"),
                     f"Plan heat map, vision tower: {label}",
                     "Rows: vision layers; columns: tensor kinds; bottom row: the projector (mm.*). Colour: bits per "
                     "weight of the format chosen (the default rules keep these at INT8 / Q8_0 class or wider).")
