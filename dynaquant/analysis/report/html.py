"""The layer-sensitivity report as one self-contained HTML page.

Figures and data reductions live in :mod:`.plots`; the mixture-of-experts and vision sections in :mod:`.moe`
and :mod:`.vl`. Reads the dict of a ``report.json`` (version 1, written by ``dynaquant analyze``) and optionally a
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

import html
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from dynaquant.analysis.report.moe import experts_section
from dynaquant.analysis.report.plots import (
    fig_act_error,
    fig_act_magnitude,
    fig_corrections,
    fig_layer_errors,
    fig_plan,
    fmt,
    format_bpw,
    format_colors,
    format_order,
    layer_error_curves,
    num,
    order_formats,
    plan_from_json,
    plan_grid,
    png_b64,
    rank_corr,
    scatter_pred,
    sensitive_layers,
    split_name,
)
from dynaquant.analysis.report.schema import REPORT_VERSION, Report, write_text
from dynaquant.analysis.report.vl import is_vision_name, vision_section

log = logging.getLogger(__name__)

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


# -------------------------------------------------------------------------------------------- page


class Page:
    """The page being built: HTML ``parts`` in order, embedded figure ids, notes shown, and the table of contents
    (anchor, heading). Sections (here, :mod:`.moe`, :mod:`.vl`) add to it with ``section``, ``h3``, ``note``,
    ``para``, ``figure`` (a matplotlib Figure, embedded as PNG) and ``table``."""

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
        data = png_b64(fig)
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


def _summary(p: Page, r: dict) -> None:
    m, c = r.get("model") or {}, r.get("calibration") or {}
    p.section("summary", "Summary")
    tensors = [t for t in r.get("tensors") or [] if isinstance(t, dict)]
    quant = [t for t in tensors if t.get("quantizable")]
    rows = [["model", m.get("id", "—")], ["revision", m.get("revision") or "—"], ["architecture", m.get("arch", "—")],
            ["layers", fmt(m.get("n_layers"), "d")], ["parameters", fmt(m.get("n_parameters"), ",.0f")],
            ["tied embeddings", fmt(m.get("tied_embeddings")) if "tied_embeddings" in m else "—"],
            ["tensors (quantizable)", f"{len(tensors)} ({len(quant)})"],
            ["tensors holding a super weight", str(sum(bool(t.get("super_weight")) for t in tensors))],
            ["candidates (bpw)", ", ".join(f"{f} ({fmt(format_bpw(f))})" for f in r.get("candidates") or []) or "—"]]
    p.table(["model", ""], rows, n_left=2)
    if c:
        p.table(["calibration", ""], [
            ["id", c.get("id", "—")], ["sources", ", ".join(map(str, c.get("sources") or [])) or "—"],
            ["tokens", fmt(c.get("tokens"), ",.0f")],
            ["sequences × length", f"{fmt(c.get('n_sequences'), 'd')} × {fmt(c.get('seq_len'), 'd')}"],
            ["chat template", fmt(c.get("chat_template")) if "chat_template" in c else "—"],
            ["Fisher sequences", fmt(c.get("fisher_sequences"), "d")],
            ["device / dtype", f"{c.get('device', '—')} / {c.get('dtype', '—')}"]], n_left=2)
    else:
        p.note("Calibration: not recorded.")
    t = {k: v for k, v in (r.get("timings_s") or {}).items() if num(v) is not None}
    if t:
        rows = [[k, fmt(v, ".1f")] for k, v in t.items()]
        total = [] if any(k.startswith("total") for k in t) else [["total", fmt(sum(t.values()), ".1f")]]
        p.table(["timing", "s"], rows + total)
    else:
        p.note("Timings: not recorded.")


def _weight_errors(p: Page, r: dict) -> None:
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
        p.figure(f"fig-layer-{metric}", fig_layer_errors(curves, sens, label), f"{label} per layer and format",
                 f"x: layer; y (log): {label} of each candidate format (colour from cheapest, dark, to widest, yellow). "
                 f"The first panel is {how}, drawn only where the format was measured for every tensor of the layer; "
                 f"the other panels show one tensor kind each. A curve that rises at a layer means that layer "
                 f"loses more from the same format. {hint}")
    outside = [t for t in r.get("tensors") or [] if isinstance(t, dict) and t.get("quantizable")
               and isinstance(t.get("errors"), dict) and split_name(str(t.get("name", "")))[0] is None
               and not is_vision_name(str(t.get("name", "")))]  # the vision section shows those
    if outside:
        fmts = format_order(r, outside)
        p.h3("Tensors outside the blocks: predicted KLD (nats/token)")
        p.table(["tensor", "shape"] + fmts, [[t["name"], "×".join(map(str, t.get("shape") or []))]
                                            + [fmt((t["errors"].get(f) or {}).get("kld_pred")) for f in fmts]
                                            for t in outside], n_left=2)


def _activations(p: Page, r: dict) -> None:
    p.section("activations", "Activations")
    acts = [a for a in r.get("activations") or [] if isinstance(a, dict) and isinstance(a.get("layer"), int)]
    if not acts:
        p.note("Activation statistics: not measured.")
        return
    p.figure("fig-act-error", fig_act_error(acts), "Activation quantization error per layer",
             "x: layer; y (log): relative error of quantizing each linear layer's input per token to int8 (left) and "
             "int4 (right) with one absmax scale per token; one line per input (q/k/v share attn_q's, gate/up share "
             "ffn_gate's). Large values mean outlier channels dominate the scale: such inputs resist "
             "activation quantization.")
    p.figure("fig-act-magnitude", fig_act_magnitude(acts), "Activation magnitudes per layer",
             "x: layer; y (log): largest |x| (left) and RMS (right) of each linear layer's input over the calibration "
             "tokens. Red rings mark inputs with massive channels (a channel's absmax over 100× the median channel's; "
             "Sun et al. 2024, 'Massive Activations in Large Language Models'), "
             "labelled with the channel indices; a wide gap between absmax and RMS is the outlier signature.")
    massive = [a for a in acts if a.get("massive_channels")]
    if massive:
        p.h3("Massive-activation channels")
        p.table(["module", "layer", "channels", "absmax", "top channels (channel: absmax)"],
                [[a.get("module", "?"), a["layer"], ", ".join(map(str, a["massive_channels"])), fmt(a.get("absmax")),
                  ", ".join(f"{c[0]}: {fmt(c[1])}" for c in (a.get("top_channels") or [])[:4]
                            if isinstance(c, (list, tuple)) and len(c) == 2)] for a in massive])
    else:
        p.note("No massive-activation channels found.")


def _super_weights(p: Page, r: dict) -> None:
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
            [[fmt(s.get("layer"), "d"), s.get("tensor", "?"), fmt(s.get("row"), "d"), fmt(s.get("column"), "d"),
              fmt(s.get("value"), ".4g"), fmt(s.get("spike_in")), fmt(s.get("spike_out")), fmt(s.get("ppl_base"), ".4g"),
              fmt(s.get("ppl_ablated"), ".4g"), fmt(s.get("ppl_ratio")), fmt(bool(s.get("confirmed")))] for s in sw],
            n_left=2)


def _plans(p: Page, r: dict, plan: dict | None, plan_label: str | None) -> None:
    p.section("plans", "Plans")
    plans = [x for x in r.get("plans") or [] if isinstance(x, dict)]
    if plans:
        p.table(["plan", "size (MiB)", "bpw", "kld_pred", "kld_measured", "measured / predicted"],
                [[x.get("label", f"plan {i}"), fmt((num(x.get("size_bytes")) or _NAN) / 2**20, ".2f"),
                  fmt(x.get("bpw"), ".3f"), fmt(x.get("kld_pred"), ".4g"), fmt(x.get("kld_measured"), ".4g"),
                  fmt((num(x.get("kld_measured")) or _NAN) / (num(x.get("kld_pred")) or _NAN))]
                 for i, x in enumerate(plans)])
    quant = {t["name"]: bool(t.get("quantizable")) for t in r.get("tensors") or [] if isinstance(t, dict) and "name" in t}
    todo = [(x.get("label", f"plan {i}"), x.get("formats") or {}, quant, x) for i, x in enumerate(plans)]
    if plan is not None:
        formats, q = plan_from_json(plan)
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
        title = f"{label}: {fmt(meta.get('bpw'), '.3f')} bpw"
        if num(meta.get("kld_pred")) is not None:
            title += f", predicted KLD {fmt(meta.get('kld_pred'), '.3g')}"
        p.figure(f"fig-plan-{i}", fig_plan(grid, title), f"Plan heat map: {label}",
                 "Rows: layers; columns: tensor kinds; each cell names the format chosen and is coloured by its bits per "
                 "weight (log colour scale, dark = fewest bits). The bottom row holds the tensors outside the blocks "
                 "(token embedding, output). Norms and other unquantized tensors are left out; grey = no such tensor.")


def _predicted_vs_measured(p: Page, r: dict) -> None:
    p.section("kld", "Predicted vs measured KLD")
    plans = [x for x in r.get("plans") or [] if isinstance(x, dict)]
    pts = [(x["kld_pred"], x["kld_measured"], str(x.get("label", i)), None, {"color": "tab:blue", "s": 30})
           for i, x in enumerate(plans) if (num(x.get("kld_pred")) or 0) > 0 and (num(x.get("kld_measured")) or 0) > 0]
    if pts:
        p.figure("fig-kld-plans", scatter_pred(pts, "predicted KLD (nats/token)", "measured KLD (nats/token)", True),
                 "Plans: predicted vs measured KLD",
                 "Each point is one plan made during analysis: x = the sum of its tensors' predicted KLD, y = the KLD "
                 "measured end to end against the unquantized model. Points on the dashed y = x line mean the additive "
                 "prediction holds; points above it mean the tensors' errors compound.")
    else:
        p.note("Plans: no measured KLD (kld_measured is null for every plan, or there are no plans).")
    rows = [s for s in r.get("sensitivity") or [] if isinstance(s, dict)
            and (num(s.get("kld")) or 0) > 0 and (num(s.get("kld_pred")) or 0) > 0]
    if not rows:
        p.note("End-to-end sensitivity (one layer group quantized at a time): not measured.")
        return
    fmts = order_formats(r, {str(s.get("format", "?")) for s in rows})
    colors = format_colors(fmts)
    rows.sort(key=lambda s: (fmts.index(str(s.get("format", "?"))), str(s.get("kind", ""))))
    pts = [(s["kld_pred"], s["kld"], str(s.get("group", "")), f"{s.get('format', '?')} {s.get('kind', '')}",
            {"color": colors[str(s.get("format", "?"))], "marker": "o" if s.get("kind") == "attn" else "s", "s": 24})
           for s in rows]
    rho = rank_corr([q[0] for q in pts], [q[1] for q in pts])
    p.figure("fig-kld-sensitivity", scatter_pred(pts, "predicted KLD (nats/token)", "measured KLD (nats/token)", False),
             "Layer groups: predicted vs measured KLD",
             "Each point quantizes one layer group (circles: attention, squares: MLP) to one format (colour), the rest "
             "unquantized: x = predicted KLD summed over the group's tensors, y = measured KLD. "
             + (f"Rank correlation ρ = {rho:.2f} over {len(pts)} points." if rho is not None else ""))


def _corrections(p: Page, r: dict) -> None:
    """The ``corrections`` section's plot and rounds (nothing when the report has none)."""
    c = r.get("corrections")
    if not isinstance(c, dict) or not c.get("rounds"):
        return
    p.section("corrections", "Measured corrections")
    held = c.get("held_out") or {}
    p.para(f"Each round measures the plan's KLD in PyTorch on {held.get('sequences', '?')} held-out calibration "
           f"sequences ({held.get('tokens', '?')} tokens), and each layer group quantized alone at the plan's formats; "
           f"the factors measured / predicted (per group) and whole / sum of the groups alone (interaction, now "
           f"{fmt(num(c.get('interaction')) or 1.0)}) correct the predictions before the next plan.")
    fig = fig_corrections(c)
    if fig is not None:
        p.figure("fig-corrections", fig, "Predicted vs measured KLD, before and after the corrections",
                 "Left: each point is one layer group quantized alone: x = its predicted KLD (blue: the first round, "
                 "uncorrected; orange: the final round, times the group's factor), y = measured. Right: the whole "
                 "plan of each round: x = its predicted KLD as planned, y = measured. On the dashed line y = x the "
                 "prediction holds.")
    rows = [[x.get("label") or "", x.get("round"), x.get("size_bytes"), fmt(num(x.get("kld_pred"))),
             fmt(num(x.get("kld_measured"))), fmt(num(x.get("groups_sum"))), fmt(num(x.get("interaction")))]
            for x in c["rounds"] if isinstance(x, dict)]
    p.table(["plan", "round", "bytes", "KLD predicted", "KLD measured", "groups alone, summed", "interaction"], rows, 1)


def build_report_page(report: Report | dict, *, title: str | None = None, plan: dict | None = None,
                      plan_label: str | None = None) -> ReportPage:
    """Render the report into an HTML string (see ``render_report_html``), without writing it.

    The sections read the report's dict (``Report.to_dict()``): the page also draws partial and malformed
    reports, which a checked :class:`Report` refuses, one section at a time.
    """
    if isinstance(report, Report):
        report = report.to_dict()
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict (report.json contents), got {type(report).__name__}")
    model_id = (report.get("model") or {}).get("id") or "unknown model"
    title = title or f"dynaquant layer-sensitivity report: {model_id}"
    p = Page()
    for name, fn in (("summary", lambda: _summary(p, report)), ("weights", lambda: _weight_errors(p, report)),
                     ("activations", lambda: _activations(p, report)), ("super weights", lambda: _super_weights(p, report)),
                     ("experts", lambda: experts_section(p, report)),
                     ("vision", lambda: vision_section(p, report, plan)),
                     ("plans", lambda: _plans(p, report, plan, plan_label)),
                     ("kld", lambda: _predicted_vs_measured(p, report)),
                     ("corrections", lambda: _corrections(p, report))):
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


def render_report_html(report: Report | dict, path, *, title: str | None = None, plan: dict | None = None,
                       plan_label: str | None = None) -> Path:
    """Write the report as one self-contained HTML page.

    Args:
        report: a :class:`Report` or a ``report.json`` dict (version 1). Missing or empty optional sections render a
            "not measured" note.
        path: the HTML file to write; written to a temporary file beside it, then renamed.
        title: page title (default: "dynaquant layer-sensitivity report: <model id>").
        plan: an optional ``plan.json`` dict (``Plan.to_dict`` layout) drawn as one more heat map.
        plan_label: its heading (default: "plan.json (<method>)").

    Returns:
        The path written. The page's ``<meta name="dynaquant-figures">`` holds the number of plots.

    Raises:
        TypeError: ``report`` is neither a Report nor a dict. OSError: the file cannot be written.
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


def render_report_files(report_json_path, out_html=None, plan_json=None) -> Path:
    """Read ``report.json`` (and optionally ``plan.json``) and write the HTML page.

    The caller checks first that the page replaces neither input (``dynaquant.cli.render_report_cli``).

    Args:
        report_json_path: the report written by ``dynaquant analyze``.
        out_html: output path (default: ``report.html`` beside the report).
        plan_json: an optional plan file to draw as one more heat map.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is not JSON, the report's ``version`` is not 1, or the plan has no
            ``tensors`` list; the message names the file.
        errors.InputError: the output cannot be written.
    """
    rp = Path(report_json_path)
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
