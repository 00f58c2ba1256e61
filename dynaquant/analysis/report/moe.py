"""The report page's mixture-of-experts section: expert routing per layer.

Reads the report's ``experts`` rows (:func:`dynaquant.analysis.experts.routing_entry`): tokens
routed to each expert of each MoE layer during calibration. Drawn as a layer x expert heat map of
the routing share (the share of calibration tokens that chose the expert; the shares of a layer
sum to top-k), with the experts calibration never reached listed (their errors were measured
with the layer's pooled statistics, see :mod:`.experts`).
"""

from __future__ import annotations

from dynaquant.analysis.report.plots import new_figure


def fig_routing(rows: list[dict]):
    """Heat map (layers x experts) of routing shares; a matplotlib Figure."""
    import numpy as np
    from matplotlib.colors import LogNorm

    n_exp = max(int(r.get("n_expert") or len(r.get("frequency") or [])) for r in rows)
    grid = np.full((len(rows), n_exp), np.nan)
    for i, r in enumerate(rows):
        f = [float(v) for v in r.get("frequency") or []]
        grid[i, : len(f)] = f
    positive = grid[np.isfinite(grid) & (grid > 0)]
    fig = new_figure(min(14.0, 4.5 + 0.12 * n_exp), min(10.0, 1.5 + 0.3 * len(rows)))
    ax = fig.add_subplot()
    shown = np.where(np.isfinite(grid) & (grid > 0), grid, np.nan)
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size and positive.min() < positive.max() else None
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="magma", norm=norm)
    zero = np.argwhere(np.isfinite(grid) & (grid == 0))
    if zero.size:
        ax.scatter(zero[:, 1], zero[:, 0], marker="x", color="tab:cyan", s=16, label="never routed")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_yticks(range(len(rows)), [str(r.get("layer", i)) for i, r in enumerate(rows)])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, label="share of calibration tokens")
    return fig


def experts_section(p, r: dict) -> None:
    """Add the section to a report page (``:class:`dynaquant.analysis.report.html.Page```); nothing for a dense model."""
    rows = [x for x in r.get("experts") or [] if isinstance(x, dict)]
    if not rows:
        return
    p.section("experts", "Expert routing")
    p.figure("fig-routing", fig_routing(rows), "Routing share per expert",
             "Rows: MoE layers; columns: routed experts; colour: the share of calibration tokens routed to the expert "
             "(log scale; a layer's shares sum to its top-k). Crosses mark experts calibration never reached: their "
             "errors use the layer's pooled statistics and a small fallback importance.")
    unrouted = [x for x in rows if x.get("unrouted")]
    if unrouted:
        p.table(["layer", "module", "experts never routed"],
                [[x.get("layer"), x.get("module", "?"), ", ".join(map(str, x["unrouted"]))] for x in unrouted])
    else:
        p.note("Every expert received calibration tokens.")
