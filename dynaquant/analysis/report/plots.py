"""The report page's data reductions and figures, shared by :mod:`.html`, :mod:`.moe` and :mod:`.vl`.

Data: :func:`layer_error_curves` (per-layer error of every format, from the report's tensors),
:func:`sensitive_layers`, :func:`plan_grid` (a plan as a layer x kind grid of bits per weight),
:func:`plan_from_json`. Figures: matplotlib ``Figure`` objects on an Agg canvas (:func:`new_figure`, no pyplot
state), turned into base64 PNG by :func:`png_b64`. matplotlib and numpy are imported inside the functions that
draw, so importing this module is cheap.
"""

from __future__ import annotations

import base64
import io
import math
import re
from dataclasses import dataclass

from dynaquant.names import TensorName
from dynaquant.quant.formats import get_format

KIND_ORDER = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
              "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp")
_DPI = 96
_NAN = float("nan")


@dataclass
class LayerCurves:
    """Per-layer error of every format, from ``report["tensors"][*]["errors"]``.

    Attributes:
        metric: ``"kld_pred"`` (summed over tensors: nats/token) or ``"output_rel"`` (mean
            over tensors weighted by ``n_elements``; a ratio).
        layers: block indices, ascending.
        formats: formats with any value, the report's candidates order first (cheapest first).
        total: format -> one value per layer over all quantizable tensors of the layer; NaN where
            some tensor of the layer lacks that format.
        by_kind: tensor kind -> format -> one value per layer (NaN where not measured).
    """

    metric: str
    layers: list[int]
    formats: list[str]
    total: dict[str, list[float]]
    by_kind: dict[str, dict[str, list[float]]]


@dataclass
class PlanGrid:
    """A plan laid out as a layer x tensor-kind grid of bits per weight.

    Attributes:
        layers: block indices (grid rows), ascending.
        kinds: tensor kinds (grid columns), ``KIND_ORDER`` first.
        names: ``names[i][j]`` format of layer ``layers[i]``, kind ``kinds[j]`` ("" where absent;
            distinct formats of several tensors of one cell joined by "/").
        bpw: the format's bits per weight (``get_format(name).bpw``; NaN where absent or unknown).
        other: (kind, format, bpw) of the quantizable tensors outside the blocks (token_embd, output).
    """

    layers: list[int]
    kinds: list[str]
    names: list[list[str]]
    bpw: list[list[float]]
    other: list[tuple[str, str, float]]


# ---------------------------------------------------------------------------------------------- data


def num(x) -> float | None:
    """A finite float, or None (None, bools, strings, NaN, inf)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def fmt(x, spec: str = ".3g") -> str:
    """``x`` as text: booleans as yes/no, numbers with ``spec`` (integers when it ends in ``d``), "—" otherwise."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    v = num(x)
    if v is None:
        return "—"
    return format(int(v), spec) if spec.endswith("d") else format(v, spec)


def format_bpw(name: str) -> float:
    """Bits per weight of the format ``name`` (``get_format(name).bpw``); NaN for an unknown name."""
    try:
        return get_format(name).bpw
    except (KeyError, AttributeError):
        return _NAN


def split_name(name: str) -> tuple[int | None, str]:
    """``blk.3.ffn_down.weight`` -> (3, "ffn_down"); ``token_embd.weight`` -> (None, "token_embd")."""
    tn = TensorName.from_gguf(name)
    if tn.tower == "text" and tn.block is not None and tn.leaf:
        return tn.block, tn.kind + (".bias" if tn.suffix == "bias" else "")
    return None, re.sub(r"\.weight$", "", name)


def order_kinds(kinds) -> list[str]:
    """The distinct ``kinds``: those of ``KIND_ORDER`` in its order, then the rest sorted."""
    kinds = set(kinds)
    return [k for k in KIND_ORDER if k in kinds] + sorted(kinds - set(KIND_ORDER))


def format_order(report: dict, tensors: list[dict]) -> list[str]:
    """Formats measured for any of ``tensors``: the report's candidates order, then others by bpw."""
    return order_formats(report, {f for t in tensors for f in (t.get("errors") or {})})


def order_formats(report: dict, seen: set[str]) -> list[str]:
    """``seen`` ordered: the report's candidates order, then others by bits per weight and name."""
    cands = [c for c in report.get("candidates") or [] if isinstance(c, str)]
    extra = sorted(seen - set(cands), key=lambda f: (format_bpw(f) if not math.isnan(format_bpw(f)) else math.inf, f))
    return [c for c in cands if c in seen] + extra


def layer_error_curves(report: dict, metric: str = "kld_pred") -> LayerCurves:
    """Aggregate one error metric per layer, per format and per tensor kind.

    Only quantizable tensors inside the blocks count. ``kld_pred`` adds up over tensors (the
    predicted KLDs of independent perturbations add); ``output_rel`` and ``weighted_rel`` are
    averaged weighted by ``n_elements``. A layer's total for a format is NaN unless that format
    was measured for every tensor of the layer.
    """
    tensors = [t for t in report.get("tensors") or []
               if isinstance(t, dict) and t.get("quantizable") and isinstance(t.get("errors"), dict)
               and split_name(str(t.get("name", "")))[0] is not None]
    groups: dict[int, list[dict]] = {}
    for t in tensors:
        layer = t.get("layer") if isinstance(t.get("layer"), int) else split_name(t["name"])[0]
        groups.setdefault(layer, []).append(t)
    layers = sorted(groups)
    formats = format_order(report, tensors)
    kinds = order_kinds(t.get("kind") or split_name(t["name"])[1] for t in tensors)

    def reduce(ts: list[dict], f: str) -> float:
        pairs = []
        for t in ts:
            e = t["errors"].get(f)
            v = num(e.get(metric)) if isinstance(e, dict) else None
            if v is None:
                return _NAN
            pairs.append((v, num(t.get("n_elements")) or 1.0))
        if metric == "kld_pred":
            return sum(v for v, _ in pairs)
        return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)

    total = {f: [reduce(groups[la], f) for la in layers] for f in formats}
    by_kind: dict[str, dict[str, list[float]]] = {}
    for k in kinds:
        cells = {la: [t for t in groups[la] if (t.get("kind") or split_name(t["name"])[1]) == k] for la in layers}
        series = {f: [reduce(cells[la], f) if cells[la] else _NAN for la in layers] for f in formats}
        series = {f: ys for f, ys in series.items() if any(not math.isnan(y) for y in ys)}
        if series:
            by_kind[k] = series
    used = [f for f in formats if any(not math.isnan(y) for y in total[f])
            or any(f in s for s in by_kind.values())]
    return LayerCurves(metric, layers, used, {f: total[f] for f in used}, by_kind)


def sensitive_layers(curves: LayerCurves, factor: float = 2.0) -> list[int]:
    """Layers whose total error is at least ``factor`` x the median layer's, in most formats.

    For each format with positive totals on 3 or more layers, every layer's total is divided by
    that format's median over layers; a layer is sensitive when the median of these ratios over
    formats is >= ``factor``.
    """
    ratios: dict[int, list[float]] = {}
    for ys in curves.total.values():
        pos = sorted(y for y in ys if y > 0)
        if len(pos) < 3:
            continue
        med = pos[len(pos) // 2] if len(pos) % 2 else 0.5 * (pos[len(pos) // 2 - 1] + pos[len(pos) // 2])
        for la, y in zip(curves.layers, ys):
            if y > 0:
                ratios.setdefault(la, []).append(y / med)
    out = []
    for la, rs in sorted(ratios.items()):
        rs.sort()
        mid = rs[len(rs) // 2] if len(rs) % 2 else 0.5 * (rs[len(rs) // 2 - 1] + rs[len(rs) // 2])
        if mid >= factor:
            out.append(la)
    return out


def plan_grid(formats: dict[str, str], quantizable: dict[str, bool] | None = None) -> PlanGrid:
    """Lay a plan's ``{tensor name: format}`` out as a layer x kind grid of bits per weight.

    Args:
        formats: GGUF tensor name -> format name (``report["plans"][i]["formats"]``).
        quantizable: tensor name -> whether it is a quantizable matmul weight; tensors marked
            False (norms, biases) are left out. Names absent from it are kept.
    """
    quantizable = quantizable or {}
    cells: dict[tuple[int, str], list[str]] = {}
    other: list[tuple[str, str, float]] = []
    for name, fmt in formats.items():
        if quantizable.get(name, True) is False:
            continue
        layer, kind = split_name(name)
        fmt = str(fmt)
        if layer is None:
            other.append((kind, fmt, format_bpw(fmt)))
        else:
            names = cells.setdefault((layer, kind), [])
            if fmt not in names:
                names.append(fmt)
    layers = sorted({la for la, _ in cells})
    kinds = order_kinds(k for _, k in cells)
    names = [["/".join(cells.get((la, k), [])) for k in kinds] for la in layers]
    bpw = [[max((format_bpw(f) for f in cells.get((la, k), [])), default=_NAN) for k in kinds] for la in layers]
    return PlanGrid(layers, kinds, names, bpw, other)


def plan_from_json(plan: dict) -> tuple[dict[str, str], dict[str, bool]]:
    """(formats, quantizable) from a plan.json dict; tensors with 1-D shapes count as not quantizable."""
    formats, quant = {}, {}
    for t in plan.get("tensors") or []:
        if isinstance(t, dict) and "name" in t and "format" in t:
            formats[t["name"]] = t["format"]
            if isinstance(t.get("shape"), list):
                quant[t["name"]] = len(t["shape"]) >= 2
    return formats, quant


# ----------------------------------------------------------------------------------------- figures


def new_figure(w: float, h: float):
    """An empty matplotlib Figure, ``w`` x ``h`` inches, constrained layout, on its own Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_b64(fig) -> str:
    """``fig`` as a PNG (96 dpi, no software stamp: the same figure gives the same bytes), base64 ASCII."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _masked(ys) -> list[float]:
    """Values for a log axis: non-positive and missing become NaN (gaps in the line)."""
    return [y if (v := num(y)) is not None and v > 0 else _NAN for y in ys]


def format_colors(formats: list[str]) -> dict[str, tuple]:
    """format -> RGBA colour, viridis from dark (first, cheapest) to yellow (last)."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    n = max(len(formats) - 1, 1)
    return {f: cmap(0.9 * i / n) for i, f in enumerate(formats)}


_MARKERS = "os^vD<>phX*"


def fig_layer_errors(curves: LayerCurves, sensitive: list[int], ylabel: str):
    """Per-layer error lines, one per format, log y: the layer total, then one panel per kind; ``sensitive`` layers
    shaded. A matplotlib Figure."""
    from matplotlib.ticker import MaxNLocator

    panels = [("all tensors of the layer", curves.total)] + list(curves.by_kind.items())
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = new_figure(3.4 * ncols + 1.4, 2.6 * nrows + 0.5)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True)
    colors = format_colors(curves.formats)
    for i, ax in enumerate(axes.flat):
        if i >= len(panels):
            ax.set_visible(False)
            continue
        title, series = panels[i]
        drawn = False
        for j, f in enumerate(curves.formats):
            ys = _masked(series.get(f, []))
            if any(not math.isnan(y) for y in ys):
                ax.plot(curves.layers, ys, marker=_MARKERS[j % len(_MARKERS)], ms=3, lw=1.2, color=colors[f],
                        label=f"{f} ({fmt(format_bpw(f), '.3g')})")
                drawn = True
        for la in sensitive:
            ax.axvspan(la - 0.5, la + 0.5, color="tab:red", alpha=0.13, lw=0)
        if drawn:
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no positive values", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title, fontsize=10, fontweight="bold" if i == 0 else "normal")
        ax.grid(True, which="major", alpha=0.35)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if sensitive:
        from matplotlib.patches import Patch

        handles.append(Patch(color="tab:red", alpha=0.13))
        labels.append("≥2× median layer")
    fig.legend(handles, labels, loc="outside right upper", title="format (bpw)", fontsize=8)
    fig.supxlabel("layer")
    fig.supylabel(ylabel)
    return fig


def _layer_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.35)


def _by_kind(acts: list[dict], key) -> dict[str, tuple[list[int], list[float]]]:
    """kind -> (layers, values) over the per-layer activation entries, layers ascending."""
    out: dict[str, list] = {}
    for a in sorted(acts, key=lambda a: a["layer"]):
        out.setdefault(a.get("kind") or "?", []).append((a["layer"], key(a)))
    return {k: ([la for la, _ in v], [y for _, y in v]) for k, v in
            ((k, out[k]) for k in order_kinds(out))}


def fig_act_error(acts: list[dict]):
    """int8 / int4 per-token activation quantization error per layer (``activations`` rows with an integer
    ``layer``), one line per input kind, log y. A matplotlib Figure."""
    fig = new_figure(11, 3.6)
    axes = fig.subplots(1, 2, sharex=True)
    for ax, bits in zip(axes, ("int8", "int4")):
        series = _by_kind(acts, lambda a, b=bits: (a.get("quant_rel_error") or {}).get(b))
        drawn = False
        for k, (xs, ys) in series.items():
            ys = _masked(ys)
            if any(not math.isnan(y) for y in ys):
                ax.plot(xs, ys, marker="o", ms=3, label=k)
                drawn = True
        if drawn:
            ax.set_yscale("log")
            ax.legend(fontsize=8, title="input of")
        ax.set_title(f"{bits} per-token absmax: ‖Q(x) − x‖ / ‖x‖", fontsize=10)
        _layer_axis(ax)
    return fig


def fig_act_magnitude(acts: list[dict], max_labels: int = 12):
    """Input absmax and RMS per layer, one line per input kind, log y; massive-channel inputs ringed and (the first
    ``max_labels``) labelled. A matplotlib Figure."""
    fig = new_figure(11, 3.8)
    axes = fig.subplots(1, 2, sharex=True)
    for ax, key in zip(axes, ("absmax", "rms")):
        for k, (xs, ys) in _by_kind(acts, lambda a, key=key: a.get(key)).items():
            ax.plot(xs, _masked(ys), marker="o", ms=3, label=k)
        ax.set_yscale("log")
        ax.set_title(f"input {key} per layer", fontsize=10)
        _layer_axis(ax)
    axes[0].margins(y=0.12)
    massive = [a for a in acts if a.get("massive_channels") and (num(a.get("absmax")) or 0) > 0]
    for n, a in enumerate(massive):
        axes[0].scatter([a["layer"]], [a["absmax"]], s=90, facecolors="none", edgecolors="tab:red", lw=1.6, zorder=5,
                        label="massive channels" if n == 0 else None)
        if n < max_labels:
            chans = ",".join(str(c) for c in a["massive_channels"][:3]) + ("…" if len(a["massive_channels"]) > 3 else "")
            axes[0].annotate(f"{a.get('kind', '')} ch {chans}", (a["layer"], a["absmax"]), textcoords="offset points",
                             xytext=(9, -3 - 9 * (n % 3)), fontsize=7, color="tab:red")
    axes[0].legend(fontsize=8, title="input of")
    return fig


def fig_plan(grid: PlanGrid, title: str):
    """Heat map of a :class:`PlanGrid`: cells named by format and coloured by bits per weight (log scale); the
    tensors outside the blocks in a row below. A matplotlib Figure."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    vals = [v for row in grid.bpw for v in row] + [b for _, _, b in grid.other]
    finite = [v for v in vals if not math.isnan(v)] or [4.0]
    norm = LogNorm(vmin=min(2.0, min(finite)), vmax=max(16.0, max(finite)))
    cmap = colormaps["viridis"].with_extremes(bad="#e4e4e4")
    n_l, n_k, n_o = len(grid.layers), len(grid.kinds), len(grid.other)
    top = 0.24 * max(n_l, 1) + 0.9
    fig = new_figure(max(6.5, 0.95 * max(n_k, n_o) + 2.6), top + (0.9 if n_o else 0) + 0.6)
    gs = fig.add_gridspec(2 if n_o else 1, 1, height_ratios=[top, 0.7] if n_o else [1])
    axes = []

    def draw(ax, data, names):
        arr = np.array(data, dtype=float)
        im = ax.imshow(np.ma.masked_invalid(arr), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        small = 6 if max(arr.shape[1], 1) > 8 or arr.shape[0] > 40 else 7
        for (i, j), v in np.ndenumerate(arr):
            if names[i][j]:
                r, g, b, _ = cmap(norm(v)) if not math.isnan(v) else (1, 1, 1, 1)
                ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
                ax.text(j, i, names[i][j], ha="center", va="center", fontsize=small, color=ink)
        axes.append(ax)
        return im

    im = None
    if n_l:
        ax = fig.add_subplot(gs[0])
        im = draw(ax, grid.bpw, grid.names)
        ax.set_xticks(range(n_k), grid.kinds, fontsize=8)
        ax.xaxis.tick_top()
        ax.set_yticks(range(n_l), [str(la) for la in grid.layers], fontsize=7 if n_l <= 40 else 5)
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=10)
    if n_o:
        ax = fig.add_subplot(gs[-1])
        im = draw(ax, [[b for _, _, b in grid.other]], [[f for _, f, _ in grid.other]])
        ax.set_xticks(range(n_o), [k for k, _, _ in grid.other], fontsize=8)
        ax.set_yticks([])
        ax.set_xlabel("tensors outside the blocks")
        if not n_l:
            ax.set_title(title, fontsize=10)
    ticks = sorted({round(v, 4) for v in finite})
    cb = fig.colorbar(im, ax=axes, label="bits per weight", ticks=ticks, shrink=0.9)
    cb.ax.minorticks_off()
    cb.ax.set_yticklabels([f"{t:.3g}" for t in ticks], fontsize=7)
    return fig


def rank_corr(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties broken by order), or None under 3 points."""
    if len(xs) < 3:
        return None
    import numpy as np

    rx, ry = np.argsort(np.argsort(xs)), np.argsort(np.argsort(ys))
    c = np.corrcoef(rx, ry)[0, 1]
    return float(c) if math.isfinite(c) else None


def scatter_pred(points: list[tuple], xlabel: str, ylabel: str, annotate: bool):
    """points: (pred, measured, point label, legend entry or None, scatter kwargs); log-log with the y = x line."""
    fig = new_figure(6.8 if annotate else 7.6, 5.2)
    loglog_pred(fig.subplots(), points, xlabel, ylabel, annotate)
    return fig


def loglog_pred(ax, points: list[tuple], xlabel: str, ylabel: str, annotate: bool) -> None:
    """Draw :func:`scatter_pred`'s points (> 0) on the axes ``ax``: log-log, the y = x line, a legend."""
    seen = set()
    for x, y, label, leg, style in points:
        ax.scatter([x], [y], label=leg if leg not in seen else None, zorder=3, **style)
        seen.add(leg)
        if annotate:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    lo = min(min(p[0], p[1]) for p in points) / 1.6
    hi = max(max(p[0], p[1]) for p in points) * 1.6
    ax.plot([lo, hi], [lo, hi], color="gray", ls="--", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncols=2 if len(seen) > 8 else 1)


def correction_points(section: dict) -> tuple[list[tuple], list[tuple]]:
    """The report's ``corrections`` section as :func:`scatter_pred` points (both coordinates > 0 only).

    Returns:
        (groups, plans): per group, before (the first round: uncorrected prediction of the group alone, blue) and
        after (the last round: its prediction times the section's group factor, orange) against the measured KLD;
        per round, the whole plan's prediction as planned (corrected from the second round on) against its measured
        KLD, labelled ``label r<round>``, the first and last round coloured as before / after.
    """
    from dynaquant.analysis.corrections import factor_lookup

    rounds = [r for r in section.get("rounds") or [] if isinstance(r, dict)]
    if not rounds:
        return [], []
    factor = factor_lookup({g: f for g, f in (section.get("factors") or {}).items() if (num(f) or 0) > 0})
    before = {"color": "tab:blue", "s": 22, "marker": "o"}
    after = {"color": "tab:orange", "s": 22, "marker": "s"}
    groups = []
    for r, leg, style, scale in ((rounds[0], "before (round 1)", before, False), (rounds[-1], "after (final)", after, True)):
        for g in r.get("groups") or []:
            x, y = num(g.get("kld_pred")), num(g.get("kld_measured"))
            if x and y and x > 0 and y > 0:
                groups.append((x * (factor(str(g.get("group"))) if scale else 1.0), y, str(g.get("group")), leg, style))
    plans = []
    for i, r in enumerate(rounds):
        x, y = num(r.get("kld_pred")), num(r.get("kld_measured"))
        if x and y and x > 0 and y > 0:
            style = before if i == 0 else after if i == len(rounds) - 1 else {"color": "tab:gray", "s": 26}
            leg = "round 1" if i == 0 else "final" if i == len(rounds) - 1 else "between"
            plans.append((x, y, f"{r.get('label') or ''} r{r.get('round', i + 1)}".strip(), leg, style))
    return groups, plans


def fig_corrections(section: dict):
    """Two log-log panels of predicted vs measured KLD (nats/token) from a ``corrections`` section
    (:func:`correction_points`): the groups alone, before and after, and the whole plan per round; None when the
    section has no point to draw."""
    groups, plans = correction_points(section)
    if not groups and not plans:
        return None
    fig = new_figure(12.0, 5.2)
    axes = fig.subplots(1, 2)
    for ax, pts, title, annotate in ((axes[0], groups, "groups quantized alone", False),
                                     (axes[1], plans, "whole plan, each round", True)):
        if pts:
            loglog_pred(ax, pts, "predicted KLD (nats/token)", "measured KLD (nats/token)", annotate)
        ax.set_title(title, fontsize=9)
    return fig
