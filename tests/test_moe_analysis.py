"""Mixture-of-experts analysis, planning and the whole GGUF path on tiny random checkpoints.

Oracles: transformers' own experts forward (our statistics-collecting forward must give the same
outputs), the routing counts (every token goes to exactly top-k experts), the imatrix definition
(diag of the per-expert second moment), llama.cpp (the quantized file must run and match
transformers on the decoded weights).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_moe_gguf import _BASE, IDS, MOE, _decided_agreement, _llama_logits, _router_margin, _tiny_moe

from dynaquant.analysis import experts as moe
from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.analysis.stats import collect_stats
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import TensorInfo
from dynaquant.quant.planner import EXPERT_CAP, default_rules, make_plan
from dynaquant.quant.presets import ModelInfo, requires_imatrix
from dynaquant.sources.experts import PROJS, layout_of

# cheap candidates for the tests' analyses (the i-quants' CPU encoders are slow): one per class
CANDIDATES = ("IQ2_XXS", "Q2_K", "Q4_K", "Q8_0")


def _model(case: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    arch, cfg, _ = MOE[case]
    cls = getattr(transformers, arch)
    config = cls.config_class(**{**_BASE, **cfg})
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("case", list(MOE))
def test_collecting_forward_matches_transformers(case):
    model = _model(case)
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits

    class Col:
        fisher = False

    found: dict = {}
    undo = moe.install(model, found, Col())
    assert found and all(layout_of(model.get_submodule(n)) for n in found)
    with torch.no_grad():
        got = model(ids).logits
    moe.uninstall(undo)
    assert all("forward" not in model.get_submodule(n).__dict__ for n in found)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))
    for name, st in found.items():
        k = model.config.num_experts_per_tok
        assert int(st.tokens.sum()) == k * ids.numel(), name  # every token reaches exactly top-k experts


def test_expert_statistics():
    model = _model("qwen2moe")
    chunks = torch.randint(0, 320, (3, 32), generator=torch.Generator().manual_seed(2))
    st = collect_stats(model, chunks, fisher_sequences=2, progress=False)
    assert set(st.experts) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    es = st.experts["model.layers.1.mlp.experts"]
    E, H, inter = 4, 256, 256
    assert es.hessian_sum["gate_up"].shape == (E, H, H) and es.hessian_sum["down"].shape == (E, inter, inter)
    assert int(es.tokens.sum()) == 2 * st.tokens and int(es.fisher_tokens.sum()) == 2 * st.fisher_tokens
    for proj in PROJS:
        f = es.fisher_sum[proj]
        assert f.shape == (E, H if proj == "down_proj" else inter) and torch.isfinite(f).all() and (f > 0).all()
    # the per-expert H really is the sum over the tokens routed to that expert: recompute expert 0's
    mod = model.get_submodule("model.layers.1.mlp.experts")
    xs = []
    h = mod.register_forward_pre_hook(lambda m, a: xs.append((a[0].reshape(-1, H).clone(), a[1].reshape(a[0].numel() // H, -1))))
    with torch.no_grad():
        for i in range(3):
            model(chunks[i : i + 1])
    h.remove()
    x0 = torch.cat([x[(idx == 0).any(-1)] for x, idx in xs])
    torch.testing.assert_close(es.hessian_sum["gate_up"][0], x0.T @ x0, rtol=1e-4, atol=1e-3)
    assert int(es.tokens[0]) == x0.shape[0]
    im = st.to_imatrix()
    sums, counts = im.sums["model.layers.1.mlp.experts.down_proj"], im.counts["model.layers.1.mlp.experts.down_proj"]
    assert sums.shape == (E, inter) and torch.equal(counts, es.tokens.cpu())
    torch.testing.assert_close(im.mean("model.layers.1.mlp.experts.gate_proj")[0], torch.diagonal(x0.T @ x0) / x0.shape[0],
                               rtol=1e-4, atol=1e-6)


def _force_routing(model, experts=(0, 1)):
    """Hooks every router so each token picks exactly ``experts`` (the others are never routed)."""
    hooks = []
    for name, mod in model.named_modules():
        if name.endswith(".mlp.gate"):
            def hook(_m, _a, out):
                logits, weights, idx = out
                idx = torch.tensor(experts).expand_as(idx).contiguous()
                return logits, torch.full_like(weights, 1 / len(experts)), idx
            hooks.append(mod.register_forward_hook(hook))
    return hooks


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """qwen2moe checkpoint + its analysis (cheap candidates)."""
    import dynaquant

    root = tmp_path_factory.mktemp("moe")
    _tiny_moe(root / "ckpt", "qwen2moe")
    spec = CalibrationSpec((), 6, 64)
    res = dynaquant.analyze(root / "ckpt", root / "an", calibration=spec, candidates=CANDIDATES, super_weights=False,
                            progress=False)
    return root, res


def test_analysis_report_has_routing_and_expert_errors(analysed):
    root, res = analysed
    r = res.report
    rows = {x["layer"]: x for x in r["experts"]}
    assert set(rows) == {0, 1}
    for x in rows.values():
        assert x["n_expert"] == 4 and sum(x["tokens"]) == 2 * r["calibration"]["tokens"]
        assert abs(sum(x["frequency"]) - 2.0) < 1e-4
    by = {t["name"]: t for t in r["tensors"]}
    for i in (0, 1):
        for proj in ("gate", "up", "down"):
            t = by[f"blk.{i}.ffn_{proj}_exps.weight"]
            assert t["experts"]["n_expert"] == 4 and set(t["errors"]) == set(CANDIDATES)
            klds = [t["errors"][f]["kld_pred"] for f in ("IQ2_XXS", "Q2_K", "Q4_K", "Q8_0")]
            assert all(np.isfinite(klds)) and klds == sorted(klds, reverse=True) and klds[-1] > 0
            assert t["errors"]["Q4_K"]["size_bytes"] == 4 * 256 * get_format("Q4_K").row_bytes(256)
    # the imatrix file holds llama.cpp's per-expert layout
    from dynaquant.analysis.imatrix_io import load_imatrix

    data = load_imatrix(root / "an" / "imatrix.gguf")
    s, c = data.sums["blk.1.ffn_down_exps.weight"], data.counts["blk.1.ffn_down_exps.weight"]
    assert tuple(s.shape) == (4, 256) and [int(v) for v in c] == rows[1]["tokens"]
    # the HTML report draws the routing
    from dynaquant.analysis.report.html import build_report_page

    page = build_report_page(r)
    assert "fig-routing" in page.figures


def test_unrouted_experts_fall_back(tmp_path):
    from dynaquant.pipeline.analyze import run_analysis
    from dynaquant.sources.checkpoint import load_tokenizer, resolve_source
    from dynaquant.sources.model import load_model
    from dynaquant.sources.open import open_hf_source

    _tiny_moe(tmp_path / "ckpt", "qwen2moe")
    source = resolve_source(str(tmp_path / "ckpt"))
    model = load_model(source)
    hooks = _force_routing(model)
    res = run_analysis(source, open_hf_source(source.path), model, load_tokenizer(source), CalibrationSpec((), 4, 32),
                       candidates=("Q2_K", "Q8_0"), super_weights=False, progress=False)
    for h in hooks:
        h.remove()
    assert [x["unrouted"] for x in res.report["experts"]] == [[2, 3], [2, 3]]
    for t in res.report["tensors"]:
        if "_exps" in t["name"]:
            assert t["experts"]["fallback"] == [2, 3]
            for err in t["errors"].values():
                assert all(np.isfinite(v) for v in err.values()) and err["kld_pred"] > 0
    # the fallback importance is small: an unrouted expert weighs less than a routed one
    es = res.stats.experts["model.layers.1.mlp.experts"]
    rw2, imp2, fb2 = es.row_weights("down_proj", 2, res.stats.tokens, res.stats.fisher_tokens)
    rw0, _, fb0 = es.row_weights("down_proj", 0, res.stats.tokens, res.stats.fisher_tokens)
    assert fb2 and not fb0 and float(rw2.fisher.sum()) < float(rw0.fisher.sum())
    assert torch.isfinite(imp2).all() and (imp2 > 0).all()


def _moe_tensors(n_layers=4, n_exp=8, h=256, i=256) -> list[TensorInfo]:
    out = [TensorInfo("token_embd.weight", "model.embed_tokens.weight", (320, h))]
    for b in range(n_layers):
        for n, shape in (("attn_q", (h, h)), ("attn_k", (h // 2, h)), ("attn_v", (h // 2, h)), ("attn_output", (h, h)),
                         ("ffn_gate_inp", (n_exp, h)), ("ffn_gate_exps", (n_exp, i, h)), ("ffn_up_exps", (n_exp, i, h)),
                         ("ffn_down_exps", (n_exp, h, i)), ("ffn_gate_shexp", (i, h)), ("ffn_down_shexp", (h, i))):
            out.append(TensorInfo(f"blk.{b}.{n}.weight", None, shape))
        out.append(TensorInfo(f"blk.{b}.attn_norm.weight", None, (h,), False))
    out.append(TensorInfo("output.weight", "lm_head.weight", (320, h)))
    return out


def test_moe_expert_caps_on_rows_no_2bit_format_fits():
    """Hidden size 576 (SmolLM2 upcycled): no 256-block format takes the gate/up experts' rows, so the
    2-bit caps fall back on the cheapest formats that do (as llama-quantize does) instead of failing."""
    tensors = _moe_tensors(n_layers=2, n_exp=4, h=576, i=1536)
    info = ModelInfo(n_layers=2, n_head=9, n_head_kv=3, n_expert=4)
    plan = make_plan(tensors, info, bpw=4.6, defaults=default_rules(info), has_imatrix=True, lift_expert_caps=False)
    fmt = {e.name: e.format for e in plan.entries}
    for b in range(2):
        gate = get_format(fmt[f"blk.{b}.ffn_gate_exps.weight"])  # the cheapest 32-block formats (MXFP4, Q4_0 ...)
        assert gate.fits(576) and gate.bpw <= 4.5
        assert get_format(fmt[f"blk.{b}.ffn_down_exps.weight"]).bpw <= get_format("IQ2_XS").bpw  # rows of 1536
    assert all(get_format(f).fits(576) for n, f in fmt.items() if "down" not in n)


def test_moe_default_rules():
    tensors = _moe_tensors()
    info = ModelInfo(n_layers=4, n_head=4, n_head_kv=2, n_expert=8)
    rules = default_rules(info)
    plan = make_plan(tensors, info, bpw=2.6, defaults=rules, has_imatrix=True)
    fmt = {e.name: e.format for e in plan.entries}
    for b in range(4):
        assert get_format(fmt[f"blk.{b}.ffn_gate_exps.weight"]).bpw <= get_format("IQ2_XXS").bpw
        assert get_format(fmt[f"blk.{b}.ffn_down_exps.weight"]).bpw <= get_format("IQ2_XS").bpw
        assert fmt[f"blk.{b}.ffn_gate_inp.weight"] == "F32"
        assert get_format(fmt[f"blk.{b}.attn_q.weight"]).bpw >= get_format("Q5_K").bpw
        assert get_format(fmt[f"blk.{b}.ffn_down_shexp.weight"]).bpw >= get_format("Q5_K").bpw
    assert "lifted" not in plan.method
    # without an imatrix the i-quants are out: Q2_K / Q3_K caps
    plan = make_plan(tensors, info, bpw=3.6, defaults=default_rules(info, has_imatrix=False), has_imatrix=False)
    fmt = {e.name: e.format for e in plan.entries}
    assert fmt["blk.1.ffn_up_exps.weight"] == "Q2_K"
    assert get_format(fmt["blk.1.ffn_down_exps.weight"]).bpw <= get_format("Q3_K").bpw
    assert not any(requires_imatrix(n, f) for n, f in fmt.items())
    # a budget far above the caps lifts them; the default target keeps them
    big = make_plan(tensors, info, bpw=5.0, defaults=rules, has_imatrix=True)
    assert "lifted" in big.method and big.bpw > 4.5
    assert get_format({e.name: e.format for e in big.entries}["blk.1.ffn_up_exps.weight"]).bpw > 3
    kept = make_plan(tensors, info, bpw=5.0, defaults=rules, has_imatrix=True, lift_expert_caps=False)
    assert "lifted" not in kept.method and kept.bpw < 3.5
    assert any(r.origin == EXPERT_CAP for r in rules)
    # experts stored in MXFP4 (gpt-oss) stay MXFP4
    mx = ModelInfo(n_layers=4, n_head=4, n_head_kv=2, n_expert=8, expert_format="MXFP4")
    plan = make_plan(tensors, mx, bpw=5.0, defaults=default_rules(mx), has_imatrix=True)
    assert all(e.format == "MXFP4" for e in plan.entries if "_exps" in e.name)
    # dense models get none of it
    assert not any(r.origin == EXPERT_CAP for r in default_rules(ModelInfo(n_layers=4)))


def _decoded_model(ckpt, gguf_path):
    """The transformers model of ``ckpt`` holding the GGUF file's decoded weights, and the file's types."""
    from gguf import GGUFReader

    from dynaquant.runtime.decoded import load_decoded
    from dynaquant.sources.checkpoint import resolve_source
    from dynaquant.sources.open import open_hf_source

    formats = {rt.name: rt.tensor_type.name for rt in GGUFReader(gguf_path).tensors}
    return load_decoded(gguf_path, resolve_source(str(ckpt)), open_hf_source(ckpt)), formats


@pytest.mark.parametrize("case", [c for c in MOE if not c.endswith("-yarn")])  # one DeepSeek-V3 case suffices
def test_dynamic_moe_gguf_runs_in_llama_cpp(case, tmp_path, reference_encoders):
    """The whole path per architecture: analysis -> dynamic plan (routed experts at ~2 bits) -> GGUF -> llama.cpp,
    whose logits match transformers' on the decoded weights."""
    pytest.importorskip("llama_cpp")
    import dynaquant

    _tiny_moe(tmp_path / "ckpt", case)
    an = dynaquant.analyze(tmp_path / "ckpt", tmp_path / "an", calibration=CalibrationSpec((), 4, 64),
                           candidates=CANDIDATES, super_weights=False, progress=False)
    assert an.report["experts"] and all(not x["unrouted"] or True for x in an.report["experts"])
    out = tmp_path / "moe.gguf"
    # the default target (the Q4_K_M mix's size) keeps the expert caps
    rules = ()
    q = dynaquant.quantize(tmp_path / "ckpt", output=out, report=tmp_path / "an" / "report.json", rules=rules,
                           progress=False)
    assert "lifted" not in q.plan.method
    _check_runs_in_llama_cpp(tmp_path / "ckpt", out, [x["layer"] for x in an.report["experts"]])


@pytest.mark.parametrize("case", ["qwen2moe", "deepseek-v3"])
def test_streamed_moe_gguf_runs_in_llama_cpp(case, tmp_path, monkeypatch):
    """``quantize --stream`` (analysis, plan and tensor loop block by block) of the MoE and MLA checkpoints: the GGUF
    runs in llama.cpp, its logits matching transformers' on the decoded weights, as the whole-model run's do."""
    pytest.importorskip("llama_cpp")
    import dynaquant
    from dynaquant.pipeline.targets import GGUFTarget

    monkeypatch.setattr(GGUFTarget, "analysis_candidates", CANDIDATES)
    _tiny_moe(tmp_path / "ckpt", case)
    out = tmp_path / "moe.gguf"
    q = dynaquant.quantize(tmp_path / "ckpt", output=out, stream=True, calibration=CalibrationSpec((), 4, 64),
                           device="cpu", correct_rounds=0, progress=False)
    assert "lifted" not in q.plan.method
    assert 0 < q.timings_s["write_s"] < q.timings_s["quantize_s"]  # the tensor loop's writing, reported apart
    _check_runs_in_llama_cpp(tmp_path / "ckpt", out, sorted({int(e.name.split(".")[1]) for e in q.plan.entries
                                                              if "_exps." in e.name}))


def _check_runs_in_llama_cpp(ckpt, out, moe_layers: list[int]) -> None:
    """The GGUF's routed experts at ~2 bits and its llama.cpp logits matching transformers' on its decoded weights
    (within llama.cpp's 8-bit activation effect)."""
    assert moe_layers
    model, formats = _decoded_model(ckpt, out)
    for i in moe_layers:
        assert formats[f"blk.{i}.ffn_up_exps.weight"] in ("IQ2_XXS", "Q2_K")
        assert formats[f"blk.{i}.ffn_gate_inp.weight"] == "F32"
    assert _router_margin(model, IDS) > 1e-2
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    got = _llama_logits(out, IDS)
    # llama.cpp quantizes the activations to 8 bits for quantized dot products, which alone moves the logits
    # (a lot for the random gpt-oss, whose attention is saturated: ~0.17 of their spread); the bound allows that
    # effect, simulated in torch, on top of 0.1
    rel = np.sqrt(((got - ref) ** 2).mean()) / ref.std()
    act, ref_q8 = _activation_quantization_effect(model, ref)
    assert rel < 0.1 + act, (rel, act)
    # every token that the model with llama.cpp's 8-bit activations (simulated in torch: what llama.cpp computes, up to
    # its arithmetic) decides by more than twice that activation effect keeps its argmax (near-ties of these random
    # logits may flip: measured on DeepSeek-V3, gaps 0.03-0.17 against per-token shifts of 0.2-0.5; against the
    # unquantized activations a Qwen3-MoE token decided by 0.52 moved by 0.55 in llama.cpp and by 0.37 in the
    # simulation, which llama.cpp's argmax then followed)
    agree, n_decided = _decided_agreement(got, ref_q8, 2 * act * float(ref.std()))
    assert n_decided >= len(IDS) // 2 and agree == 1.0, (agree, n_decided)


def _activation_quantization_effect(model, ref: np.ndarray) -> tuple[float, np.ndarray]:
    """Relative RMS change of the logits when every nn.Linear input (and the fused experts' input) is rounded to 8
    bits per block of 32 (llama.cpp's Q8_0 activations), as a fraction of the logits' spread; and those logits
    (tokens, vocab)."""
    def q8(_mod, args):
        x = args[0]
        b = x.reshape(*x.shape[:-1], -1, 32)
        d = b.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
        return ((b / d).round() * d).reshape(x.shape), *args[1:]

    # nn.Linear inputs, and the hidden states entering transformers' fused experts modules (3-D parameters, no
    # nn.Linear: Qwen2/3-MoE, DeepSeek-V3 since transformers 5), whose gate/up llama.cpp multiplies in Q8 as well
    hooks = [m.register_forward_pre_hook(q8) for m in model.modules()
             if (isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0 and m.out_features > 16)
             or (type(m).__name__.endswith("Experts") and not isinstance(m, torch.nn.ModuleList))]
    try:
        with torch.no_grad():
            got = model(torch.tensor([IDS])).logits[0].numpy()
    finally:
        for h in hooks:
            h.remove()
    return float(np.sqrt(((got - ref) ** 2).mean()) / ref.std()), got


@pytest.mark.parametrize("case", ["qwen2moe", "deepseek-v3"])
def test_eval_of_moe_gguf(case, tmp_path):
    """``dynaquant eval`` on MoE GGUF files (transformers cannot load them: our decoder rebuilds the model). A
    F16 file is the original to within F16 rounding; a mapping error (an expert, a transposed MLA half) would not
    be; a 2-bit file is far from it."""
    import dynaquant

    _tiny_moe(tmp_path / "ckpt", case)
    text = tmp_path / "eval.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Quantization maps weights to fewer bits. " * 40)
    kld = {}
    for preset in ("F16", "Q2_K"):
        out = tmp_path / f"{preset}.gguf"
        dynaquant.quantize(tmp_path / "ckpt", output=out, preset=preset, use_imatrix=False, progress=False)
        kld[preset] = dynaquant.evaluate(out, tmp_path / "ckpt", text=text, n_ctx=64, chunks=2, progress=False).kld_mean
    assert 0 < kld["F16"] < 1e-3 and kld["Q2_K"] > 100 * kld["F16"], kld


def test_make_dynamic_plan_applies_the_moe_rules():
    """make_dynamic_plan (``dynaquant plan``) plans a MoE report with the rules dynaquant.quantize uses:
    the expert caps and MoE attention, from the report's n_expert (or, for older reports, the expert shapes)."""
    from dynaquant import make_dynamic_plan

    cands = ["IQ2_XXS", "IQ2_XS", "Q2_K", "Q4_K", "Q5_K", "Q8_0"]
    tensors = []
    for t in _moe_tensors():
        errs = {c: {"kld_pred": t.n_elements * 2.0 ** (-2 * get_format(c).bpw)} for c in cands
                if t.quantizable and get_format(c).fits(t.row_size)}
        tensors.append({"name": t.name, "shape": list(t.shape), "quantizable": t.quantizable, "errors": errs})
    for model in ({"n_layers": 4, "n_expert": 8}, {"n_layers": 4}):  # new reports, and older ones without n_expert
        rep = {"model": {"id": "toy", "tied_embeddings": False, **model}, "candidates": cands, "tensors": tensors}
        plan = make_dynamic_plan(rep, bpw=3.0)
        fmt = {e.name: e.format for e in plan.entries}
        assert get_format(fmt["blk.1.ffn_up_exps.weight"]).bpw <= get_format("IQ2_XXS").bpw
        assert get_format(fmt["blk.1.ffn_down_exps.weight"]).bpw <= get_format("IQ2_XS").bpw
        assert get_format(fmt["blk.1.attn_q.weight"]).bpw >= get_format("Q5_K").bpw


def test_cpu_quantize_samples_every_tensor_at_the_cpu_fraction(tmp_path, monkeypatch):
    """A quantize run on the CPU measures every tensor's errors, the routed experts' too, on the CPU's share of its
    rows (``QuantizeConfig.for_device``), in the whole-model and the block-by-block analysis alike."""
    import dynaquant
    from dynaquant import config
    from dynaquant.analysis import errors, experts
    from dynaquant.pipeline import analyze, analyze_blocks
    from dynaquant.pipeline.targets import GGUFTarget

    monkeypatch.setattr(GGUFTarget, "analysis_candidates", CANDIDATES)
    _tiny_moe(tmp_path / "ckpt", "qwen2moe")
    seen = []

    def spy(module):
        def sample_tensor(*args, **kw):
            if module != experts.__name__:  # (each expert: its share of the stack's sample, below)
                seen.append((module, kw.get("fraction")))
            return errors.sample_tensor(*args, **kw)
        return sample_tensor

    def expert_rows(n_expert, n_rows, fraction):
        seen.append((experts.__name__, fraction))
        return expert_sample_rows(n_expert, n_rows, fraction)

    expert_sample_rows = experts.expert_sample_rows
    for mod in (analyze, analyze_blocks, experts):
        monkeypatch.setattr(mod, "sample_tensor", spy(mod.__name__))
    monkeypatch.setattr(experts, "expert_sample_rows", expert_rows)
    for stream in (False, True):
        seen.clear()
        dynaquant.quantize(tmp_path / "ckpt", output=tmp_path / f"moe-{stream}.gguf", stream=stream, device="cpu",
                           calibration=CalibrationSpec((), 4, 64), correct_rounds=0, progress=False)
        assert {m for m, _ in seen} == {experts.__name__, (analyze_blocks if stream else analyze).__name__}
        assert {f for _, f in seen} == {config.CPU_SAMPLE_FRACTION}
