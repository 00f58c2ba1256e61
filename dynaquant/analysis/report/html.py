"""The layer-sensitivity report as one self-contained HTML page.

Reads the dict of a ``report.json`` (version 1, written by ``dynaquant analyze``) and optionally a
``plan.json`` dict (the ``Plan.to_dict`` layout of ``dynaquant.quant.plan``) and writes a single
HTML file: every plot is a matplotlib figure (Agg canvas, no pyplot state) embedded as a base64
PNG ``<img class="dq-plot">``; tables are plain HTML; the style sheet is inline; there are no
scripts and no external URLs. A section whose data is missing or empty renders a short
"not measured" note; a section that fails to draw renders an error note (``class="error"``) and
is logged, so one bad field never loses the whole page.

The page: summary (model, calibration, timings, tensors, candidates); per-layer predicted KLD and
output error per format (all tensors of a layer, then one panel per tensor kind, layers adding
at least twice the median layer's error shaded); activation quantization error and magnitudes per
layer with massive-activation channels marked; the super-weight table; one bits-per-weight heat
map per plan; predicted against measured KLD.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from dynaquant.analysis.report.moe import experts_section
from dynaquant.analysis.report.schema import REPORT_VERSION, write_text
from dynaquant.analysis.report.vl import is_vision_name, vision_section
from dynaquant.names import TensorName
from dynaquant.quant.formats import get_format

log = logging.getLogger(__name__)

KIND_ORDER = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
              "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp")
_DPI = 96
_NAN = float("nan")
_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1250px;padding:0 1em;color:#222}
h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}h3{font-size:1.05em;margin-bottom:.3em}
figure{margin:1em 0 2em 0}img.dq-plot{max-width:100%;height:auto;display:block;border:1px solid #eee}
figcaption{font-size:.9em;color:#444;max-width:75em;margin-top:.4em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ccc;padding:.15em .5em;text-align:right}
th{background:#f3f3f3}.l{text-align:left}p.note{color:#666;font-style:italic}p.error{color:#a00}
nav a{margin-right:1em}code{background:#f5f5f5}"""


@dataclass
class ReportPage:
    """A rendered page.

    Attributes:
        html: the whole document.
        figures: ids of the embedded plots, in page order; each is one ``<img class="dq-plot">``.
        notes: the "not measured" / error notes shown, in page order.
    """

    html: str
    figures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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


def _num(x) -> float | None:
    """A finite float, or None (None, bools, strings, NaN, inf)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _fmt(x, spec: str = ".3g") -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    v = _num(x)
    if v is None:
        return "—"
    return format(int(v), spec) if spec.endswith("d") else format(v, spec)


def _bpw(name: str) -> float:
    try:
        return get_format(name).bpw
    except (KeyError, AttributeError):
        return _NAN


def _split_name(name: str) -> tuple[int | None, str]:
    """``blk.3.ffn_down.weight`` -> (3, "ffn_down"); ``token_embd.weight`` -> (None, "token_embd")."""
    tn = TensorName.from_gguf(name)
    if tn.tower == "text" and tn.block is not None and tn.leaf:
        return tn.block, tn.kind + (".bias" if tn.suffix == "bias" else "")
    return None, re.sub(r"\.weight$", "", name)


def _order_kinds(kinds) -> list[str]:
    kinds = set(kinds)
    return [k for k in KIND_ORDER if k in kinds] + sorted(kinds - set(KIND_ORDER))


def _format_order(report: dict, tensors: list[dict]) -> list[str]:
    """Formats measured for any of ``tensors``: the report's candidates order, then others by bpw."""
    return _order_formats(report, {f for t in tensors for f in (t.get("errors") or {})})


def _order_formats(report: dict, seen: set[str]) -> list[str]:
    cands = [c for c in report.get("candidates") or [] if isinstance(c, str)]
    extra = sorted(seen - set(cands), key=lambda f: (_bpw(f) if not math.isnan(_bpw(f)) else math.inf, f))
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
               and _split_name(str(t.get("name", "")))[0] is not None]
    groups: dict[int, list[dict]] = {}
    for t in tensors:
        layer = t.get("layer") if isinstance(t.get("layer"), int) else _split_name(t["name"])[0]
        groups.setdefault(layer, []).append(t)
    layers = sorted(groups)
    formats = _format_order(report, tensors)
    kinds = _order_kinds(t.get("kind") or _split_name(t["name"])[1] for t in tensors)

    def reduce(ts: list[dict], f: str) -> float:
        pairs = []
        for t in ts:
            e = t["errors"].get(f)
            v = _num(e.get(metric)) if isinstance(e, dict) else None
            if v is None:
                return _NAN
            pairs.append((v, _num(t.get("n_elements")) or 1.0))
        if metric == "kld_pred":
            return sum(v for v, _ in pairs)
        return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)

    total = {f: [reduce(groups[la], f) for la in layers] for f in formats}
    by_kind: dict[str, dict[str, list[float]]] = {}
    for k in kinds:
        cells = {la: [t for t in groups[la] if (t.get("kind") or _split_name(t["name"])[1]) == k] for la in layers}
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
        layer, kind = _split_name(name)
        fmt = str(fmt)
        if layer is None:
            other.append((kind, fmt, _bpw(fmt)))
        else:
            names = cells.setdefault((layer, kind), [])
            if fmt not in names:
                names.append(fmt)
    layers = sorted({la for la, _ in cells})
    kinds = _order_kinds(k for _, k in cells)
    names = [["/".join(cells.get((la, k), [])) for k in kinds] for la in layers]
    bpw = [[max((_bpw(f) for f in cells.get((la, k), [])), default=_NAN) for k in kinds] for la in layers]
    return PlanGrid(layers, kinds, names, bpw, other)


def _plan_from_json(plan: dict) -> tuple[dict[str, str], dict[str, bool]]:
    """(formats, quantizable) from a plan.json dict; tensors with 1-D shapes count as not quantizable."""
    formats, quant = {}, {}
    for t in plan.get("tensors") or []:
        if isinstance(t, dict) and "name" in t and "format" in t:
            formats[t["name"]] = t["format"]
            if isinstance(t.get("shape"), list):
                quant[t["name"]] = len(t["shape"]) >= 2
    return formats, quant


# ----------------------------------------------------------------------------------------- figures


def _new_figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png_b64(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _masked(ys) -> list[float]:
    """Values for a log axis: non-positive and missing become NaN (gaps in the line)."""
    return [y if (v := _num(y)) is not None and v > 0 else _NAN for y in ys]


def _format_colors(formats: list[str]) -> dict[str, tuple]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    n = max(len(formats) - 1, 1)
    return {f: cmap(0.9 * i / n) for i, f in enumerate(formats)}


_MARKERS = "os^vD<>phX*"


def _fig_layer_errors(curves: LayerCurves, sensitive: list[int], ylabel: str):
    from matplotlib.ticker import MaxNLocator

    panels = [("all tensors of the layer", curves.total)] + list(curves.by_kind.items())
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = _new_figure(3.4 * ncols + 1.4, 2.6 * nrows + 0.5)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True)
    colors = _format_colors(curves.formats)
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
                        label=f"{f} ({_fmt(_bpw(f), '.3g')})")
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
            ((k, out[k]) for k in _order_kinds(out))}


def _fig_act_error(acts: list[dict]):
    fig = _new_figure(11, 3.6)
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


def _fig_act_magnitude(acts: list[dict], max_labels: int = 12):
    fig = _new_figure(11, 3.8)
    axes = fig.subplots(1, 2, sharex=True)
    for ax, key in zip(axes, ("absmax", "rms")):
        for k, (xs, ys) in _by_kind(acts, lambda a, key=key: a.get(key)).items():
            ax.plot(xs, _masked(ys), marker="o", ms=3, label=k)
        ax.set_yscale("log")
        ax.set_title(f"input {key} per layer", fontsize=10)
        _layer_axis(ax)
    axes[0].margins(y=0.12)
    massive = [a for a in acts if a.get("massive_channels") and (_num(a.get("absmax")) or 0) > 0]
    for n, a in enumerate(massive):
        axes[0].scatter([a["layer"]], [a["absmax"]], s=90, facecolors="none", edgecolors="tab:red", lw=1.6, zorder=5,
                        label="massive channels" if n == 0 else None)
        if n < max_labels:
            chans = ",".join(str(c) for c in a["massive_channels"][:3]) + ("…" if len(a["massive_channels"]) > 3 else "")
            axes[0].annotate(f"{a.get('kind', '')} ch {chans}", (a["layer"], a["absmax"]), textcoords="offset points",
                             xytext=(9, -3 - 9 * (n % 3)), fontsize=7, color="tab:red")
    axes[0].legend(fontsize=8, title="input of")
    return fig


def _fig_plan(grid: PlanGrid, title: str):
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    vals = [v for row in grid.bpw for v in row] + [b for _, _, b in grid.other]
    finite = [v for v in vals if not math.isnan(v)] or [4.0]
    norm = LogNorm(vmin=min(2.0, min(finite)), vmax=max(16.0, max(finite)))
    cmap = colormaps["viridis"].with_extremes(bad="#e4e4e4")
    n_l, n_k, n_o = len(grid.layers), len(grid.kinds), len(grid.other)
    top = 0.24 * max(n_l, 1) + 0.9
    fig = _new_figure(max(6.5, 0.95 * max(n_k, n_o) + 2.6), top + (0.9 if n_o else 0) + 0.6)
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


def _rank_corr(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties broken by order), or None under 3 points."""
    if len(xs) < 3:
        return None
    import numpy as np

    rx, ry = np.argsort(np.argsort(xs)), np.argsort(np.argsort(ys))
    c = np.corrcoef(rx, ry)[0, 1]
    return float(c) if math.isfinite(c) else None


def _scatter_pred(points: list[tuple], xlabel: str, ylabel: str, annotate: bool):
    """points: (pred, measured, point label, legend entry or None, scatter kwargs); log-log with the y = x line."""
    fig = _new_figure(6.8 if annotate else 7.6, 5.2)
    ax = fig.subplots()
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
    return fig


# -------------------------------------------------------------------------------------------- page


class _Page:
    def __init__(self):
        self.parts: list[str] = []
        self.figures: list[str] = []
        self.notes: list[str] = []
        self.toc: list[tuple[str, str]] = []

    def section(self, anchor: str, heading: str) -> None:
        self.toc.append((anchor, heading))
        self.parts.append(f'<h2 id="{anchor}">{html.escape(heading)}</h2>')

    def h3(self, text: str) -> None:
        self.parts.append(f"<h3>{html.escape(text)}</h3>")

    def note(self, text: str, cls: str = "note") -> None:
        self.notes.append(text)
        self.parts.append(f'<p class="{cls}">{html.escape(text)}</p>')

    def para(self, text: str) -> None:
        self.parts.append(f"<p>{html.escape(text)}</p>")

    def figure(self, fig_id: str, fig, heading: str, caption: str) -> None:
        data = _png_b64(fig)
        self.figures.append(fig_id)
        self.parts.append(f'<figure id="{fig_id}"><h3>{html.escape(heading)}</h3>'
                          f'<img class="dq-plot" alt="{html.escape(heading)}" src="data:image/png;base64,{data}">'
                          f"<figcaption>{html.escape(caption)}</figcaption></figure>")

    def table(self, headers: list[str], rows: list[list], n_left: int = 1) -> None:
        def cell(tag, i, v):
            return f'<{tag}{" class=l" if i < n_left else ""}>{html.escape(str(v))}</{tag}>'

        head = "".join(cell("th", i, h) for i, h in enumerate(headers))
        body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
        self.parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _summary(p: _Page, r: dict) -> None:
    m, c = r.get("model") or {}, r.get("calibration") or {}
    p.section("summary", "Summary")
    tensors = [t for t in r.get("tensors") or [] if isinstance(t, dict)]
    quant = [t for t in tensors if t.get("quantizable")]
    rows = [["model", m.get("id", "—")], ["revision", m.get("revision") or "—"], ["architecture", m.get("arch", "—")],
            ["layers", _fmt(m.get("n_layers"), "d")], ["parameters", _fmt(m.get("n_parameters"), ",.0f")],
            ["tied embeddings", _fmt(m.get("tied_embeddings")) if "tied_embeddings" in m else "—"],
            ["tensors (quantizable)", f"{len(tensors)} ({len(quant)})"],
            ["tensors holding a super weight", str(sum(bool(t.get("super_weight")) for t in tensors))],
            ["candidates (bpw)", ", ".join(f"{f} ({_fmt(_bpw(f))})" for f in r.get("candidates") or []) or "—"]]
    p.table(["model", ""], rows, n_left=2)
    if c:
        p.table(["calibration", ""], [
            ["id", c.get("id", "—")], ["sources", ", ".join(map(str, c.get("sources") or [])) or "—"],
            ["tokens", _fmt(c.get("tokens"), ",.0f")],
            ["sequences × length", f"{_fmt(c.get('n_sequences'), 'd')} × {_fmt(c.get('seq_len'), 'd')}"],
            ["chat template", _fmt(c.get("chat_template")) if "chat_template" in c else "—"],
            ["Fisher sequences", _fmt(c.get("fisher_sequences"), "d")],
            ["device / dtype", f"{c.get('device', '—')} / {c.get('dtype', '—')}"]], n_left=2)
    else:
        p.note("Calibration: not recorded.")
    t = {k: v for k, v in (r.get("timings_s") or {}).items() if _num(v) is not None}
    if t:
        rows = [[k, _fmt(v, ".1f")] for k, v in t.items()]
        total = [] if any(k.startswith("total") for k in t) else [["total", _fmt(sum(t.values()), ".1f")]]
        p.table(["timing", "s"], rows + total)
    else:
        p.note("Timings: not recorded.")


def _weight_errors(p: _Page, r: dict) -> None:
    p.section("weights", "Weight quantization error per layer")
    for metric, label, how in (
            ("kld_pred", "predicted KLD (nats/token)", "summed over the layer's tensors"),
            ("output_rel", "output error ‖ΔW·X‖ / ‖W·X‖", "averaged over the layer's tensors, weighted by size")):
        curves = layer_error_curves(r, metric)
        if not curves.layers or not curves.formats:
            p.note(f"Per-layer {metric}: not measured.")
            continue
        sens = sensitive_layers(curves)
        hint = (f"Shaded layers ({', '.join(map(str, sens))}) add at least twice the median layer's error in most "
                "formats: keep them at higher bit widths." if sens else "No layer stands out at twice the median.")
        p.figure(f"fig-layer-{metric}", _fig_layer_errors(curves, sens, label), f"{label} per layer and format",
                 f"x: layer; y (log): {label} of each candidate format (colour from cheapest, dark, to widest, yellow). "
                 f"The first panel is {how}, drawn only where the format was measured for every tensor of the layer; "
                 f"the other panels show one tensor kind each. A curve that rises at a layer means that layer "
                 f"loses more from the same format. {hint}")
    outside = [t for t in r.get("tensors") or [] if isinstance(t, dict) and t.get("quantizable")
               and isinstance(t.get("errors"), dict) and _split_name(str(t.get("name", "")))[0] is None
               and not is_vision_name(str(t.get("name", "")))]  # the vision section shows those
    if outside:
        fmts = _format_order(r, outside)
        p.h3("Tensors outside the blocks: predicted KLD (nats/token)")
        p.table(["tensor", "shape"] + fmts, [[t["name"], "×".join(map(str, t.get("shape") or []))]
                                            + [_fmt((t["errors"].get(f) or {}).get("kld_pred")) for f in fmts]
                                            for t in outside], n_left=2)


def _activations(p: _Page, r: dict) -> None:
    p.section("activations", "Activations")
    acts = [a for a in r.get("activations") or [] if isinstance(a, dict) and isinstance(a.get("layer"), int)]
    if not acts:
        p.note("Activation statistics: not measured.")
        return
    p.figure("fig-act-error", _fig_act_error(acts), "Activation quantization error per layer",
             "x: layer; y (log): relative error of quantizing each linear layer's input per token to int8 (left) and "
             "int4 (right) with one absmax scale per token; one line per input (q/k/v share attn_q's, gate/up share "
             "ffn_gate's). Large values mean outlier channels dominate the scale: such inputs resist "
             "activation quantization.")
    p.figure("fig-act-magnitude", _fig_act_magnitude(acts), "Activation magnitudes per layer",
             "x: layer; y (log): largest |x| (left) and RMS (right) of each linear layer's input over the calibration "
             "tokens. Red rings mark inputs with massive channels (a channel's absmax over 100× the median channel's; "
             "Sun et al. 2024, 'Massive Activations in Large Language Models'), "
             "labelled with the channel indices; a wide gap between absmax and RMS is the outlier signature.")
    massive = [a for a in acts if a.get("massive_channels")]
    if massive:
        p.h3("Massive-activation channels")
        p.table(["module", "layer", "channels", "absmax", "top channels (channel: absmax)"],
                [[a.get("module", "?"), a["layer"], ", ".join(map(str, a["massive_channels"])), _fmt(a.get("absmax")),
                  ", ".join(f"{c[0]}: {_fmt(c[1])}" for c in (a.get("top_channels") or [])[:4]
                            if isinstance(c, (list, tuple)) and len(c) == 2)] for a in massive])
    else:
        p.note("No massive-activation channels found.")


def _super_weights(p: _Page, r: dict) -> None:
    p.section("super-weights", "Super weights")
    sw = [s for s in r.get("super_weights") or [] if isinstance(s, dict)]
    if "super_weights" not in r:
        p.note("Super-weight search: not measured.")
        return
    if not sw:
        p.note("Super weights: none found.")
        return
    p.para("A super weight is one scalar whose removal breaks the model (Yu et al. 2024, 'The Super Weight in Large "
           "Language Models'): row and column in torch (out, in) order; spike_in / spike_out are the largest |input| "
           "at the column and |output| at the row; ppl ratio = perplexity with the weight zeroed / without.")
    p.table(["layer", "tensor", "row", "column", "value", "spike_in", "spike_out", "ppl_base", "ppl_ablated", "ratio",
             "confirmed"],
            [[_fmt(s.get("layer"), "d"), s.get("tensor", "?"), _fmt(s.get("row"), "d"), _fmt(s.get("column"), "d"),
              _fmt(s.get("value"), ".4g"), _fmt(s.get("spike_in")), _fmt(s.get("spike_out")), _fmt(s.get("ppl_base"), ".4g"),
              _fmt(s.get("ppl_ablated"), ".4g"), _fmt(s.get("ppl_ratio")), _fmt(bool(s.get("confirmed")))] for s in sw],
            n_left=2)


def _plans(p: _Page, r: dict, plan: dict | None, plan_label: str | None) -> None:
    p.section("plans", "Plans")
    plans = [x for x in r.get("plans") or [] if isinstance(x, dict)]
    if plans:
        p.table(["plan", "size (MiB)", "bpw", "kld_pred", "kld_measured", "measured / predicted"],
                [[x.get("label", f"plan {i}"), _fmt((_num(x.get("size_bytes")) or _NAN) / 2**20, ".2f"),
                  _fmt(x.get("bpw"), ".3f"), _fmt(x.get("kld_pred"), ".4g"), _fmt(x.get("kld_measured"), ".4g"),
                  _fmt((_num(x.get("kld_measured")) or _NAN) / (_num(x.get("kld_pred")) or _NAN))]
                 for i, x in enumerate(plans)])
    quant = {t["name"]: bool(t.get("quantizable")) for t in r.get("tensors") or [] if isinstance(t, dict) and "name" in t}
    todo = [(x.get("label", f"plan {i}"), x.get("formats") or {}, quant, x) for i, x in enumerate(plans)]
    if plan is not None:
        formats, q = _plan_from_json(plan)
        todo.append((plan_label or f"plan.json ({plan.get('method') or 'file'})", formats, {**quant, **q}, plan))
    if not todo:
        p.note("Plans: none in the report.")
        return
    for i, (label, formats, q, meta) in enumerate(todo):
        formats = {k: v for k, v in formats.items() if not is_vision_name(k)} if isinstance(formats, dict) else {}
        grid = plan_grid(formats, q)  # vision tower / projector: the vision section's heat map
        if not grid.layers and not grid.other:
            p.note(f"Plan {label}: no tensors.")
            continue
        title = f"{label}: {_fmt(meta.get('bpw'), '.3f')} bpw"
        if _num(meta.get("kld_pred")) is not None:
            title += f", predicted KLD {_fmt(meta.get('kld_pred'), '.3g')}"
        p.figure(f"fig-plan-{i}", _fig_plan(grid, title), f"Plan heat map: {label}",
                 "Rows: layers; columns: tensor kinds; each cell names the format chosen and is coloured by its bits per "
                 "weight (log colour scale, dark = fewest bits). The bottom row holds the tensors outside the blocks "
                 "(token embedding, output). Norms and other unquantized tensors are left out; grey = no such tensor.")


def _predicted_vs_measured(p: _Page, r: dict) -> None:
    p.section("kld", "Predicted vs measured KLD")
    plans = [x for x in r.get("plans") or [] if isinstance(x, dict)]
    pts = [(x["kld_pred"], x["kld_measured"], str(x.get("label", i)), None, {"color": "tab:blue", "s": 30})
           for i, x in enumerate(plans) if (_num(x.get("kld_pred")) or 0) > 0 and (_num(x.get("kld_measured")) or 0) > 0]
    if pts:
        p.figure("fig-kld-plans", _scatter_pred(pts, "predicted KLD (nats/token)", "measured KLD (nats/token)", True),
                 "Plans: predicted vs measured KLD",
                 "Each point is one plan made during analysis: x = the sum of its tensors' predicted KLD, y = the KLD "
                 "measured end to end against the unquantized model. Points on the dashed y = x line mean the additive "
                 "prediction holds; points above it mean the tensors' errors compound.")
    else:
        p.note("Plans: no measured KLD (kld_measured is null for every plan, or there are no plans).")
    rows = [s for s in r.get("sensitivity") or [] if isinstance(s, dict)
            and (_num(s.get("kld")) or 0) > 0 and (_num(s.get("kld_pred")) or 0) > 0]
    if not rows:
        p.note("End-to-end sensitivity (one layer group quantized at a time): not measured.")
        return
    fmts = _order_formats(r, {str(s.get("format", "?")) for s in rows})
    colors = _format_colors(fmts)
    rows.sort(key=lambda s: (fmts.index(str(s.get("format", "?"))), str(s.get("kind", ""))))
    pts = [(s["kld_pred"], s["kld"], str(s.get("group", "")), f"{s.get('format', '?')} {s.get('kind', '')}",
            {"color": colors[str(s.get("format", "?"))], "marker": "o" if s.get("kind") == "attn" else "s", "s": 24})
           for s in rows]
    rho = _rank_corr([q[0] for q in pts], [q[1] for q in pts])
    p.figure("fig-kld-sensitivity", _scatter_pred(pts, "predicted KLD (nats/token)", "measured KLD (nats/token)", False),
             "Layer groups: predicted vs measured KLD",
             "Each point quantizes one layer group (circles: attention, squares: MLP) to one format (colour), the rest "
             "unquantized: x = predicted KLD summed over the group's tensors, y = measured KLD. "
             + (f"Rank correlation ρ = {rho:.2f} over {len(pts)} points." if rho is not None else ""))


def build_report_page(report: dict, *, title: str | None = None, plan: dict | None = None,
                      plan_label: str | None = None) -> ReportPage:
    """Render the report into an HTML string (see ``render_report_html``), without writing it."""
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict (report.json contents), got {type(report).__name__}")
    model_id = (report.get("model") or {}).get("id") or "unknown model"
    title = title or f"dynaquant layer-sensitivity report: {model_id}"
    p = _Page()
    for name, fn in (("summary", lambda: _summary(p, report)), ("weights", lambda: _weight_errors(p, report)),
                     ("activations", lambda: _activations(p, report)), ("super weights", lambda: _super_weights(p, report)),
                     ("experts", lambda: experts_section(p, report)),
                     ("vision", lambda: vision_section(p, report, plan)),
                     ("plans", lambda: _plans(p, report, plan, plan_label)),
                     ("kld", lambda: _predicted_vs_measured(p, report))):
        try:
            fn()
        except Exception as exc:  # a malformed field loses its section, not the page
            log.exception("report section %s failed", name)
            p.note(f"Section {name} could not be drawn: {type(exc).__name__}: {exc}", cls="error")
    nav = "".join(f'<a href="#{a}">{html.escape(h)}</a>' for a, h in p.toc)
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width, initial-scale=1">'
           f'<meta name="dynaquant-figures" content="{len(p.figures)}">'
           f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
           f"<body><h1>{html.escape(title)}</h1><nav>{nav}</nav>\n" + "\n".join(p.parts) + "\n</body></html>\n")
    return ReportPage(doc, p.figures, p.notes)


def render_report_html(report: dict, path, *, title: str | None = None, plan: dict | None = None,
                       plan_label: str | None = None) -> Path:
    """Write the report as one self-contained HTML page.

    Args:
        report: a ``report.json`` dict (version 1). Missing or empty optional sections render a
            "not measured" note.
        path: the HTML file to write; written to a temporary file beside it, then renamed.
        title: page title (default: "dynaquant layer-sensitivity report: <model id>").
        plan: an optional ``plan.json`` dict (``Plan.to_dict`` layout) drawn as one more heat map.
        plan_label: its heading (default: "plan.json (<method>)").

    Returns:
        The path written. The page's ``<meta name="dynaquant-figures">`` holds the number of plots.

    Raises:
        TypeError: ``report`` is not a dict. OSError: the file cannot be written.
    """
    page = build_report_page(report, title=title, plan=plan, plan_label=plan_label)
    path = write_text(page.html, path)
    log.info("wrote %s (%d plots, %d notes)", path, len(page.figures), len(page.notes))
    return path


def _read_json(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc}); expected {what}") from exc
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected {what} (a JSON object), got {type(d).__name__}")
    return d


def render_report_cli(report_json_path, out_html=None, plan_json=None) -> Path:
    """Read ``report.json`` (and optionally ``plan.json``) and write the HTML page.

    Args:
        report_json_path: the report written by ``dynaquant analyze``.
        out_html: output path (default: ``report.html`` beside the report).
        plan_json: an optional plan file to draw as one more heat map.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is not JSON, the report's ``version`` is not 1, or the plan has no
            ``tensors`` list; the message names the file.
        errors.InputError: the output is the report or the plan, or cannot be written.
    """
    from dynaquant.pipeline.preflight import Output, check_outputs

    rp = Path(report_json_path)
    check_outputs([Output(Path(out_html) if out_html is not None else rp.with_name("report.html"))],
                  inputs={"report": rp, "plan": plan_json})  # before reading: the page must not replace an input
    report = _read_json(rp, "a dynaquant report.json")
    if report.get("version") != REPORT_VERSION:
        raise ValueError(f"{rp}: not a dynaquant report.json version {REPORT_VERSION} "
                         f"(version field: {report.get('version')!r})")
    plan = label = None
    if plan_json is not None:
        pp = Path(plan_json)
        plan = _read_json(pp, "a dynaquant plan.json")
        if not isinstance(plan.get("tensors"), list):
            raise ValueError(f"{pp}: not a dynaquant plan.json (no 'tensors' list)")
        label = f"{pp.name} ({plan.get('method') or 'file'})"
    out = Path(out_html) if out_html is not None else rp.with_name("report.html")
    return render_report_html(report, out, plan=plan, plan_label=label)
