"""The HTML report: every plot renders and is visible in headless Chromium; missing sections degrade to notes.

Chromium is required (Debian: ``apt-get install -y chromium``); the visibility checks fail, not skip, without it.
"""

from __future__ import annotations

import base64
import html as html_lib
import json
import math
import re
import shutil
import subprocess

import numpy as np
import pytest

from dynaquant.analysis.report.html import build_report_page, render_report_html
from dynaquant.analysis.report.plots import layer_error_curves, plan_grid, sensitive_layers
from dynaquant.cli import render_report_cli
from dynaquant.quant.formats import get_format

N_LAYERS = 5
HIDDEN, FFN = 256, 512
CANDIDATES = ["Q2_K", "Q3_K", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"]
KINDS = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (64, HIDDEN), "attn_v": (64, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
         "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
SENSITIVE = (0, 1)  # layers whose synthetic error is 10x the others'


def make_report(seed: int = 0, n_layers: int = N_LAYERS, kinds: tuple[str, ...] = tuple(KINDS)) -> dict:
    """A schema-complete report.json dict (version 1): ``n_layers`` layers of ``kinds``, 8 candidates, layers 0-1
    sensitive, one super weight, massive channels at layer 1, sensitivity rows, two plans (one measured)."""
    rng = np.random.default_rng(seed)
    tensors = [{"name": "token_embd.weight", "hf_name": "model.embed_tokens.weight", "shape": [1000, HIDDEN],
                "n_elements": 1000 * HIDDEN, "layer": None, "kind": "token_embd", "group": "embd", "quantizable": True,
                "super_weight": False}]
    for i in range(n_layers):
        tensors.append({"name": f"blk.{i}.attn_norm.weight", "hf_name": None, "shape": [HIDDEN], "n_elements": HIDDEN,
                        "layer": i, "kind": "attn_norm", "group": "norm", "quantizable": False, "super_weight": False})
        for kind in kinds:
            shape = KINDS[kind]
            tensors.append({"name": f"blk.{i}.{kind}.weight", "hf_name": f"model.layers.{i}.x.{kind}.weight",
                            "shape": list(shape), "n_elements": shape[0] * shape[1], "layer": i, "kind": kind,
                            "group": kind.split("_")[0], "quantizable": True, "super_weight": (i, kind) == (1, "ffn_down")})
    tensors += [{"name": "output_norm.weight", "hf_name": "model.norm.weight", "shape": [HIDDEN], "n_elements": HIDDEN,
                 "layer": None, "kind": "output_norm", "group": "norm", "quantizable": False, "super_weight": False},
                {"name": "output.weight", "hf_name": "lm_head.weight", "shape": [1000, HIDDEN], "n_elements": 1000 * HIDDEN,
                 "layer": None, "kind": "output", "group": "output", "quantizable": True, "super_weight": False}]
    for t in tensors:
        if not t["quantizable"]:
            continue
        boost = 10.0 if t["layer"] in SENSITIVE else 1.0
        t["errors"] = {}
        for f in CANDIDATES:
            fmt = get_format(f)
            rel = 2.0 ** (-fmt.bpw) * float(rng.uniform(0.8, 1.25))
            t["errors"][f] = {"size_bytes": t["n_elements"] * fmt.type_size // fmt.block_size, "bpw": fmt.bpw,
                              "weighted_rel": rel ** 2, "output_rel": rel * math.sqrt(boost),
                              "kld_pred": 1e-3 * boost * rel ** 2 * 100}
    for t in tensors:
        if t["name"] == "blk.0.attn_k.weight":
            del t["errors"]["Q2_K"]  # not measured -> layer 0 has no Q2_K total
    acts = []
    for i in range(n_layers):
        for kind, module in (("attn_q", "self_attn.q_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_down", "mlp.down_proj")):
            massive = [17, 203] if (i, kind) == (1, "ffn_down") else []
            absmax = 2000.0 if massive else float(rng.uniform(3, 30))
            acts.append({"module": f"model.layers.{i}.{module}", "layer": i, "kind": kind,
                         "tensors": [f"blk.{i}.{kind}.weight"], "absmax": absmax, "rms": float(rng.uniform(0.2, 1.5)),
                         "top_channels": [[17, absmax], [203, absmax / 2], [5, 3.0]], "massive_channels": massive,
                         "quant_rel_error": {"int8": float(rng.uniform(0.003, 0.02)) * (5 if massive else 1),
                                             "int4": float(rng.uniform(0.05, 0.3)) * (3 if massive else 1)}})
    acts.append({"module": "lm_head", "layer": None, "kind": "output", "tensors": ["output.weight"], "absmax": 9.0, "rms": 1.0,
                 "top_channels": [[3, 9.0]], "massive_channels": [], "quant_rel_error": {"int8": 0.004, "int4": 0.08}})
    names = [t["name"] for t in tensors]
    base = {n: ("F32" if n.endswith("norm.weight") else "Q4_K") for n in names}
    high = dict(base, **{n: "Q6_K" for n in names if re.match(r"blk\.[01]\.", n) and "norm" not in n},
                **{"output.weight": "Q8_0", "token_embd.weight": "Q4_0"})
    return {
        "version": 1,
        "model": {"id": "test/tiny-llama", "revision": "abc123", "arch": "llama", "n_layers": n_layers,
                  "tied_embeddings": False, "n_parameters": sum(t["n_elements"] for t in tensors)},
        "calibration": {"id": "mix-v1", "sources": ["wiki", "code"], "n_sequences": 16, "seq_len": 256, "tokens": 4096,
                        "chat_template": True, "fisher_sequences": 4, "device": "cpu", "dtype": "float32"},
        "candidates": CANDIDATES,
        "tensors": tensors,
        "activations": acts,
        "super_weights": [{"layer": 1, "tensor": "blk.1.ffn_down.weight", "module": "model.layers.1.mlp.down_proj",
                           "row": 123, "column": 17, "value": -3.75, "spike_in": 2000.0, "spike_out": 1500.0,
                           "ppl_base": 12.5, "ppl_ablated": 4321.0, "ppl_ratio": 345.68, "confirmed": True}],
        "sensitivity": [{"group": f"blk.{i}.{k}", "layer": i, "kind": k, "format": f, "kld": float(rng.uniform(0.5, 2.0)) * pred,
                         "kld_pred": pred}
                        for i in range(n_layers) for k in ("attn", "ffn") for f in ("Q2_K", "Q4_K")
                        for pred in [0.01 * (10 if i in SENSITIVE else 1) * 2.0 ** (4 - get_format(f).bpw)]],
        "plans": [{"label": "Q4_K_M size", "size_bytes": 123456, "bpw": 4.9, "kld_pred": 0.031, "kld_measured": 0.042,
                   "formats": high},
                  {"label": "uniform Q4_K", "size_bytes": 110000, "bpw": 4.5, "kld_pred": 0.05, "kld_measured": None,
                   "formats": base}],
        "timings_s": {"load_s": 1.5, "calibration_s": 12.25, "errors_s": 30.0},
    }


# Plots of the full fixture: kld_pred + output_rel curves, activation error + magnitude, 2 report plans, kld scatters x 2.
N_PLOTS = 8

_CHECK_JS = """<script>
window.addEventListener('load', () => {
  const doc = document.documentElement, W = doc.scrollWidth, H = doc.scrollHeight;
  const rows = [...document.images].map(img => {
    const r = img.getBoundingClientRect(), s = getComputedStyle(img);
    const x = r.left + window.scrollX, y = r.top + window.scrollY;
    return {id: img.closest('figure') ? img.closest('figure').id : '', complete: img.complete, nw: img.naturalWidth,
            nh: img.naturalHeight, w: r.width, h: r.height,
            inside: x >= 0 && y >= 0 && x + r.width <= W + 1 && y + r.height <= H + 1,
            shown: s.display !== 'none' && s.visibility !== 'hidden' && parseFloat(s.opacity) > 0};
  });
  const meta = document.querySelector('meta[name=dynaquant-figures]');
  const out = document.createElement('pre');
  out.id = 'dq-check';
  out.textContent = JSON.stringify({declared: meta ? +meta.content : -1, images: rows});
  document.body.appendChild(out);
});
</script>"""


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium not found on PATH: the HTML report test needs headless Chromium. "
                    "Install it with `apt-get install -y chromium` (Debian/Ubuntu: chromium or chromium-browser).")
    return exe


def _run_chromium(tmp_path, *args: str) -> str:
    cmd = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=10000", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, f"chromium failed ({res.returncode}): {res.stderr[-2000:]}"
    return res.stdout


def _check_in_chromium(html: str, tmp_path, name: str = "checked.html") -> dict:
    """Load ``html`` (plus the check script) in headless Chromium; return what the page saw of its images."""
    assert "</body>" in html
    page = tmp_path / name
    page.write_text(html.replace("</body>", _CHECK_JS + "</body>"), encoding="utf-8")
    dom = _run_chromium(tmp_path, "--dump-dom", page.as_uri())
    m = re.search(r'<pre id="dq-check">(.*?)</pre>', dom, re.S)
    assert m, f"the check script did not run; DOM tail: {dom[-500:]}"
    return json.loads(html_lib.unescape(m.group(1)))


def _visible(row: dict) -> bool:
    return row["complete"] and row["nw"] > 0 and row["nh"] > 0 and row["w"] > 50 and row["h"] > 50 and row["inside"] \
        and row["shown"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    report = make_report()
    out = render_report_html(report, tmp_path_factory.mktemp("report") / "report.html")
    return report, out, out.read_text(encoding="utf-8")


def test_every_plot_is_visible_in_chromium(rendered, tmp_path):
    _, _, html = rendered
    assert 'class="error"' not in html, re.findall(r'<p class="error">(.*?)</p>', html)
    figures = re.findall(r'<figure id="([^"]+)">', html)
    assert figures == ["fig-layer-kld_pred", "fig-layer-output_rel", "fig-act-error", "fig-act-magnitude", "fig-plan-0",
                       "fig-plan-1", "fig-kld-plans", "fig-kld-sensitivity"]
    seen = _check_in_chromium(html, tmp_path)
    assert seen["declared"] == len(figures) == N_PLOTS  # what the renderer says it drew
    assert [r["id"] for r in seen["images"]] == figures
    bad = [r for r in seen["images"] if not _visible(r)]
    assert not bad, bad
    assert sum(_visible(r) for r in seen["images"]) == seen["declared"]
    # Self-contained: no scripts, no external resources.
    assert "<script" not in html and "<link" not in html
    assert not re.search(r'(src|href)\s*=\s*"(?!data:image/png;base64,|#)', html)


def test_corrupted_image_is_detected(rendered, tmp_path):
    _, _, html = rendered
    data = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    png = bytearray(base64.b64decode(data[2]))
    png[40:200] = bytes(160)  # wreck the IHDR/IDAT chunks; the browser cannot decode it
    broken = html.replace(data[2], base64.b64encode(bytes(png)).decode())
    seen = _check_in_chromium(broken, tmp_path, "broken.html")
    visible = [_visible(r) for r in seen["images"]]
    assert visible.count(False) == 1 and not visible[2], seen["images"]


def test_screenshot_is_not_blank(rendered, tmp_path):
    from matplotlib.image import imread

    _, out, _ = rendered
    shot = tmp_path / "shot.png"
    _run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2400", out.as_uri())
    img = imread(shot)[..., :3]
    assert img.shape[0] >= 2000 and img.shape[1] >= 1200
    non_white = (img < 0.9).any(axis=-1).mean()
    colours = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert non_white > 0.03 and colours > 100, (non_white, colours)


def test_content_of_tables_and_notes(rendered):
    report, _, html = rendered
    assert report == make_report()  # the renderer leaves its input alone
    for text in ("test/tiny-llama", "4,096", "16 × 256", "blk.1.ffn_down.weight", ">123<", ">17<", "-3.75", "346", ">yes<",
                 "Q4_K_M size", "0.042", "Massive-activation channels", "17, 203", "load_s", "43.8"):
        assert text in html, text
    assert "not measured" not in html


def test_missing_sections_render_notes():
    minimal = {"version": 1, "model": {"id": "m"}, "candidates": [], "tensors": [], "activations": [], "super_weights": [],
               "sensitivity": [], "plans": [], "timings_s": {}}
    page = build_report_page(minimal)
    assert page.figures == [] and 'class="error"' not in page.html
    assert "Super weights: none found." in page.notes
    assert sum("not measured" in n for n in page.notes) >= 4
    bare = build_report_page({"version": 1})
    assert bare.figures == [] and "Super-weight search: not measured." in bare.notes
    # Plans without measured KLD and without sensitivity rows: heat maps drawn, scatters replaced by notes.
    r = make_report(n_layers=3, kinds=("attn_q", "ffn_down"))
    r["sensitivity"] = []
    for p in r["plans"]:
        p["kld_measured"] = None
    del r["activations"]
    page = build_report_page(r)
    assert page.figures == ["fig-layer-kld_pred", "fig-layer-output_rel", "fig-plan-0", "fig-plan-1"]
    assert any("no measured KLD" in n for n in page.notes) and any("sensitivity" in n for n in page.notes)
    # Malformed fields: drawn around, the section survives.
    r = make_report(n_layers=3, kinds=("attn_q", "ffn_down"))
    r["activations"][0]["layer"] = 0
    r["activations"][0]["absmax"] = "big"
    r["plans"][0]["formats"] = {"blk.0.attn_q.weight": "Q9_Z"}
    page = build_report_page(r)
    assert 'class="error"' not in page.html and len(page.figures) == N_PLOTS


def test_layer_curves_and_sensitive_layers():
    r = make_report()
    c = layer_error_curves(r, "kld_pred")
    assert c.layers == list(range(N_LAYERS)) and c.formats == CANDIDATES
    assert set(c.by_kind) == set(KINDS)
    # Q2_K is missing for blk.0.attn_k: no layer-0 total, but the other kinds keep it.
    assert math.isnan(c.total["Q2_K"][0]) and not math.isnan(c.total["Q2_K"][1])
    assert math.isnan(c.by_kind["attn_k"]["Q2_K"][0]) and not math.isnan(c.by_kind["attn_q"]["Q2_K"][0])
    layer3 = [t for t in r["tensors"] if t["layer"] == 3 and t["quantizable"]]
    assert c.total["Q4_K"][3] == pytest.approx(sum(t["errors"]["Q4_K"]["kld_pred"] for t in layer3))
    o = layer_error_curves(r, "output_rel")
    n = sum(t["n_elements"] for t in layer3)
    assert o.total["Q4_K"][3] == pytest.approx(sum(t["errors"]["Q4_K"]["output_rel"] * t["n_elements"] for t in layer3) / n)
    assert sensitive_layers(c) == list(SENSITIVE)


def test_plan_grid_uses_format_bpw():
    r = make_report()
    quant = {t["name"]: t["quantizable"] for t in r["tensors"]}
    g = plan_grid(r["plans"][0]["formats"], quant)
    assert g.layers == list(range(N_LAYERS)) and g.kinds == list(KINDS)  # norms left out
    assert g.names[0][0] == "Q6_K" and g.bpw[0][0] == get_format("Q6_K").bpw
    assert g.names[4][6] == "Q4_K" and g.bpw[4][6] == 4.5
    assert g.other == [("token_embd", "Q4_0", 4.5), ("output", "Q8_0", 8.5)]
    g = plan_grid({"blk.0.attn_q.weight": "Q9_Z", "blk.2.ffn_up.weight": "Q8_0"})
    assert g.layers == [0, 2] and math.isnan(g.bpw[0][0]) and math.isnan(g.bpw[0][1]) and g.bpw[1][1] == 8.5


def test_render_report_cli(tmp_path):
    r = make_report(n_layers=3, kinds=("attn_q", "ffn_down"))
    r["activations"], r["sensitivity"] = [], []  # fewer plots: this test is about the files
    for t in r["tensors"]:
        t.pop("errors", None)
    rp = tmp_path / "report.json"
    rp.write_text(json.dumps(r))
    plan = {"version": 1, "target": "gguf", "model": "m", "method": "allocation bpw<=4.5", "rules": [], "budget": {},
            "tensors": [{"name": t["name"], "hf_name": None, "shape": t["shape"], "format": "Q5_K" if t["quantizable"] else "F32",
                         "requested": "Q5_K", "reason": "test"} for t in r["tensors"]]}
    pp = tmp_path / "plan.json"
    pp.write_text(json.dumps(plan))
    out = render_report_cli(rp, plan_json=pp)
    assert out == tmp_path / "report.html"
    html = out.read_text(encoding="utf-8")
    assert re.findall(r'<figure id="([^"]+)">', html) == ["fig-plan-0", "fig-plan-1", "fig-plan-2", "fig-kld-plans"]
    assert "Plan heat map: plan.json (allocation bpw&lt;=4.5)" in html
    assert not list(tmp_path.glob("*.tmp"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a JSON file"):
        render_report_cli(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(dict(r, version=0)))
    with pytest.raises(ValueError, match="old.json: not a dynaquant report.json version 1"):
        render_report_cli(old)
    with pytest.raises(ValueError, match="bad.json: not a JSON file"):
        render_report_cli(rp, plan_json=bad)
    nope = tmp_path / "nope.json"
    nope.write_text(json.dumps({"formats": {}}))
    with pytest.raises(ValueError, match="nope.json: not a dynaquant plan.json"):
        render_report_cli(rp, plan_json=nope)
    rp.write_text(json.dumps({"version": 1}))
    assert render_report_cli(rp, out_html=tmp_path / "x.html") == tmp_path / "x.html"
    assert "Super-weight search: not measured." in (tmp_path / "x.html").read_text(encoding="utf-8")
