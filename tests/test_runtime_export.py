"""Safetensors export of mixed plans, ``dynaquant.load`` (torch fallback), transformers' own loader, and
safetensors plans (planner, plan files, dynamic plans from a report). Toy Llama models: fast, CPU.

Tolerance of transformers' compressed-tensors loader: in float32 its integer decode is ours bit for bit,
so the logits are equal; in bfloat16 it rounds the fp16 scales to bf16 before multiplying (and both
sides round the weights to bf16), so logits may differ by a few bf16 steps: at most 2 % of the largest
logit here, with the same greedy tokens. Asymmetric checkpoints do not load through transformers 5.23
with compressed-tensors 0.20 (its packed zero points do not fit the unpacked parameter it creates, for
compressed-tensors' own checkpoints too); compressed-tensors' decompressor reads ours exactly
(``test_runtime_codecs.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_plan import SMOL, smollm2_tensors
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import dynaquant.runtime.linear as rt_linear
from dynaquant.exporters.safetensors.writer import module_regexes, unquantized_linears, write_safetensors
from dynaquant.quant.plan import Plan, PlanEntry
from dynaquant.quant.planner import BudgetError, Rule, default_rules, make_plan
from dynaquant.quant.runtime import decode, encode
from dynaquant.runtime.linear import DynaLinear
from dynaquant.runtime.loader import load

MIXED = ("INT4_G128", "INT3_G32_ASYM", "INT2_G64_ASYM", "INT8_G32", "MXFP4_G32", "NVFP4_G16", "INT4_G64_ASYM", "INT2_G32")


def _toy(tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def _plan(model, formats=MIXED) -> Plan:
    entries, i = [], 0
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if v.ndim == 2 and "embed" not in k:
            f, i = formats[i % len(formats)], i + 1
        else:
            f = "BF16" if "embed" in k else "F32"
        entries.append(PlanEntry(k, k, tuple(v.shape), f, f, "test"))
    return Plan("safetensors", "toy", entries)


def _export(model, out, plan=None, super_weights=None, **kw):
    """Export; returns {hf_name: decoded float32 weight} of the quantized tensors."""
    decoded: dict[str, torch.Tensor] = {}
    kept: dict[str, list] = {}

    def enc(e, w):
        module = e.hf_name.removesuffix(".weight")
        sw = (super_weights or {}).get(module)
        rw = encode(w, e.format, super_weights=sw)
        decoded[e.hf_name] = decode(rw)
        if rw.super_weights is not None:
            kept[module] = [[int(r), int(c), float(v)] for r, c, v in zip(*(t.tolist() for t in rw.super_weights))]
        return rw

    plan = plan or _plan(model)
    res = write_safetensors(out, plan, model.state_dict(), enc, model.config.to_dict(), super_weights=kept,
                            ignore=unquantized_linears(model, plan), progress=False, **kw)
    return res, decoded


def _reference(model, decoded, dtype=torch.float32):
    ref = LlamaForCausalLM(model.config).eval()
    sd = model.state_dict()
    plan_float = {k: v.to(torch.bfloat16).float() if "embed" in k else v for k, v in sd.items()}
    tied = model.config.tie_word_embeddings
    ref.load_state_dict({k: decoded.get(k, plan_float[k]) for k in sd if not (tied and k == "lm_head.weight")}, strict=False)
    ref.tie_weights()
    return ref.to(dtype)


def test_export_load_logits_equal_reference_and_generate(tmp_path):
    model = _toy()
    sw = {"model.layers.1.mlp.down_proj": ([5, 100], [7, 200])}
    res, decoded = _export(model, tmp_path / "ckpt", super_weights=sw, max_shard_bytes=60_000)
    assert len(res.shards) > 1 and (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.0.self_attn.q_proj.weight_packed"] in res.shards
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    assert set(qc["config_groups"]) == set(MIXED) and qc["dynaquant"]["super_weights"]["model.layers.1.mlp.down_proj"]
    assert decoded["model.layers.1.mlp.down_proj.weight"][5, 7] == model.model.layers[1].mlp.down_proj.weight[5, 7]

    q = load(tmp_path / "ckpt", device="cpu")
    assert sum(isinstance(m, DynaLinear) for m in q.modules()) == 2 * 7 + 1  # every linear, lm_head included
    assert q.model.layers[1].mlp.down_proj.super_weights is not None
    ref = _reference(model, decoded)
    ids = torch.randint(0, 320, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(q(ids).logits, ref(ids).logits)
        out = q.generate(ids[:1, :6], max_new_tokens=6, do_sample=False)
        assert torch.equal(out, ref.generate(ids[:1, :6], max_new_tokens=6, do_sample=False))


def test_tied_embedding_checkpoint(tmp_path):
    model = _toy(tied=True)
    _, decoded = _export(model, tmp_path / "tied")
    cfg = json.loads((tmp_path / "tied" / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == ["lm_head"]
    q = load(tmp_path / "tied", device="cpu")
    assert q.lm_head.weight.data_ptr() == q.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 320, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(q(ids).logits, _reference(model, decoded)(ids).logits)


def test_transformers_compressed_tensors_loader_agrees(tmp_path):
    model = _toy(seed=3)
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(2))
    # float32, symmetric integer formats: the same weights, so the same logits
    _export(model, tmp_path / "int", _plan(model, ("INT4_G128", "INT3_G32", "INT2_G64", "INT8_G32", "INT4_G64")))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "int", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "int", device="cpu")(ids).logits, theirs(ids).logits)
    # bfloat16 (compressed-tensors decodes FP4 to bf16): within a few bf16 steps (module docstring)
    _export(model, tmp_path / "fp4", _plan(model, ("MXFP4_G32", "NVFP4_G16", "INT4_G128")))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "fp4", dtype=torch.bfloat16)
    with torch.no_grad():
        a = load(tmp_path / "fp4", device="cpu", dtype=torch.bfloat16)(ids).logits.float()
        b = theirs(ids).logits.float()
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_output_is_replaced_only_when_complete(tmp_path):
    model = _toy()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="not a dynaquant checkpoint"):
        _export(model, foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    out = tmp_path / "ckpt"
    _export(model, out)
    before = sorted(p.name for p in out.iterdir())

    def failing(e, w):
        if "layers.1" in e.hf_name:
            raise RuntimeError("boom")
        return encode(w, e.format)

    with pytest.raises(RuntimeError, match="boom"):
        write_safetensors(out, _plan(model), model.state_dict(), failing, model.config.to_dict(), progress=False)
    assert sorted(p.name for p in out.iterdir()) == before  # the earlier checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "foreign"]  # no temporary folders left
    _export(model, out, _plan(model, ("INT8_G128",)))  # an earlier dynaquant checkpoint is replaced
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"


def test_dynalinear_bias_and_kernel_hook(monkeypatch):
    """Bias and super weights on the torch path; the kernel hook's contract with a stand-in op."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(4))
    rw = encode(w, "INT4_G64", super_weights=([1, 40], [3, 60]))
    from dynaquant.quant.runtime import to_compressed_tensors

    lin = DynaLinear(64, 48, "INT4_G64", bias=True)
    for k, v in to_compressed_tensors(rw).items():
        getattr(lin, k).copy_(v)
    lin.bias.data = torch.randn(48)
    lin.set_super_weights([[1, 3, float(w[1, 3])], [40, 60, float(w[40, 60])]])
    lin.prepare()
    x = torch.randn(3, 5, 64)
    ref = torch.nn.functional.linear(x, decode(rw), lin.bias)
    assert torch.equal(lin(x), ref)

    calls = []

    class FakeOp:  # the op contract: prepare(RuntimeWeight with super weights) -> packed; linear(x, packed, bias)
        @staticmethod
        def prepare(weight):
            calls.append(weight.format)
            return decode(weight)

        @staticmethod
        def linear(x, packed, bias):
            return torch.nn.functional.linear(x, packed.to(x.dtype), bias)

    monkeypatch.setattr(rt_linear, "_kernel_device", lambda t: True)
    monkeypatch.setattr(rt_linear, "kernel_op", lambda fmt: FakeOp)
    lin.prepare()
    assert calls == ["INT4_G64"] and lin._op is FakeOp and lin._rw is None
    assert torch.allclose(lin(x.to(torch.bfloat16)).float(), ref, atol=0.05, rtol=0.02)
    assert torch.equal(lin(x), ref)  # float32 input: the torch reference


def test_module_regexes_match_exactly():
    import re

    mods = ["model.layers.0.mlp.down_proj", "model.layers.11.mlp.down_proj", "lm_head", "model.layers.1.self_attn.q_proj"]
    pats = module_regexes(mods)
    hits = lambda n: any(re.match(p[3:], n) for p in pats)  # noqa: E731
    assert all(hits(m) for m in mods)
    assert not hits("model.layers.1.mlp.down_proj") and not hits("model.layers.110.mlp.down_proj")
    assert not hits("model.layers.0.mlp.down_proj_x") and not hits("lm_head2")


# --- plans for the safetensors target ---------------------------------------------------------------


def test_safetensors_plans_choose_runtime_formats_in_budget():
    ts = smollm2_tensors()
    plan = make_plan(ts, SMOL, bpw=6.0, target="safetensors", defaults=default_rules(SMOL))
    assert plan.target == "safetensors" and plan.bpw <= 6.0
    f = plan.formats()
    assert f["token_embd.weight"] == "BF16" and f["blk.0.attn_norm.weight"] == "F32"
    assert all(get_fmt(f[t.name]).target == "safetensors" for t in ts if t.quantizable and t.name != "token_embd.weight")
    for i in range(30):  # vLLM fuses q/k/v and gate/up: one format each
        assert f[f"blk.{i}.attn_q.weight"] == f[f"blk.{i}.attn_k.weight"] == f[f"blk.{i}.attn_v.weight"]
        assert f[f"blk.{i}.ffn_gate.weight"] == f[f"blk.{i}.ffn_up.weight"]
    assert get_fmt(f["blk.0.ffn_down.weight"]).bpw >= 8.5  # default rule: first block >= Q8_0's bits
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).formats() == f
    with pytest.raises(ValueError, match="budget"):
        make_plan(ts, SMOL, preset="Q4_K_M", target="safetensors")
    with pytest.raises(ValueError, match="budget"):
        make_plan(ts, SMOL, target="safetensors")
    with pytest.raises(ValueError, match="not allowed"):
        make_plan(ts, SMOL, bpw=5.5, target="safetensors", rules=["ffn_down=Q4_K"])
    with pytest.raises(ValueError, match="not allowed"):
        make_plan(ts, SMOL, bpw=5.5, rules=["ffn_down=INT4_G128"])  # a runtime format in a GGUF plan
    with pytest.raises(BudgetError):
        make_plan(ts, SMOL, bpw=4.0, target="safetensors")  # the BF16 embedding alone is 3.4 bpw


def get_fmt(name):
    from dynaquant.quant.formats import get_format

    return get_format(name)


def test_safetensors_rules_and_fallbacks():
    ts = smollm2_tensors()
    plan = make_plan(ts, SMOL, bpw=7.0, target="safetensors",
                     rules=[r"ffn_down=INT4_G128", Rule(r"attn_output", "Q8_0", ">=")])
    e = {x.name: x for x in plan.entries}
    assert e["blk.3.ffn_down.weight"].format == "INT4_G128"  # rows of 1536
    assert e["blk.3.ffn_up.weight"].format != "INT4_G128"
    assert get_fmt(e["blk.3.attn_output.weight"].format).bpw >= 8.5
    p2 = make_plan(ts, SMOL, bpw=7.0, target="safetensors", rules=[r"ffn_up=INT4_G128"])
    up = {x.name: x for x in p2.entries}["blk.3.ffn_up.weight"]
    assert up.format == "INT4_G64" and up.requested == "INT4_G128" and "INT4_G128->INT4_G64" in up.reason


def test_plan_files_check_the_target():
    d = make_plan(smollm2_tensors(), SMOL, bpw=6.0, target="safetensors").to_dict()
    assert Plan.from_dict(d).target == "safetensors"
    bad = dict(d, target="gguf")
    with pytest.raises(ValueError, match="not allowed in a gguf plan"):
        Plan.from_dict(bad, "p.json")
    g = make_plan(smollm2_tensors(), SMOL, preset="Q4_0").to_dict()
    with pytest.raises(ValueError, match="not allowed in a safetensors plan"):
        Plan.from_dict(dict(g, target="safetensors"), "p.json")
    with pytest.raises(ValueError, match="unknown target"):
        Plan.from_dict(dict(d, target="onnx"), "p.json")


def _report(candidates):
    from dynaquant.quant.formats import get_format

    tensors = []
    for t in smollm2_tensors():
        errs = {}
        if t.quantizable:
            for c in candidates:
                f = get_format(c)
                if f.fits(t.row_size):
                    errs[c] = {"kld_pred": t.n_elements * 2.0 ** (-2 * f.bpw) * (3.0 if "ffn_down" in t.name else 1.0)}
        tensors.append({"name": t.name, "hf_name": None, "shape": list(t.shape), "quantizable": t.quantizable,
                        "super_weight": t.name == "blk.2.ffn_down.weight", "errors": errs})
    return {"model": {"id": "toy", "n_layers": 30, "tied_embeddings": True}, "candidates": list(candidates),
            "tensors": tensors}


def test_dynamic_plan_for_safetensors_from_a_report(tmp_path):
    from dynaquant import make_dynamic_plan
    from dynaquant.pipeline.analyze import expand_formats

    cands = expand_formats("Q4_K,safetensors")
    assert cands[0] == "Q4_K" and "INT4_G128" in cands and "NVFP4_G16" in cands
    rep = _report(cands)
    plan = make_dynamic_plan(rep, bpw=6.0, target="safetensors", output=tmp_path / "plan.json")
    assert plan.target == "safetensors" and plan.bpw <= 6.0 and plan.kld_pred > 0
    f = plan.formats()
    assert get_fmt(f["blk.2.ffn_down.weight"]).bpw >= 8.5  # the super weight's tensor
    assert Plan.from_dict(json.loads((tmp_path / "plan.json").read_text())).formats() == f
    by_size = make_dynamic_plan(rep, size=100_000_000, target="safetensors")
    assert by_size.size_bytes < 100_000_000
    with pytest.raises(ValueError, match="no safetensors formats"):
        make_dynamic_plan(_report(("Q4_K", "Q8_0")), bpw=6.0, target="safetensors")


@pytest.mark.parametrize("name", ["INT4_G128", "INT3_G32_ASYM", "INT2_G64", "INT8_G32_ASYM", "MXFP4_G32", "NVFP4_G16"])
def test_kernels_package_takes_runtime_weights(name):
    """dynaquant.kernels' pack/linear consume the RuntimeWeight contract (torch path on CPU, float32)."""
    op = rt_linear.kernel_op(name)
    assert op is not None
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(9))
    rw = encode(w, name, super_weights=([2, 39], [5, 255]))
    packed = op.prepare(rw)
    x, bias = torch.randn(3, 256), torch.randn(40)
    y = op.linear(x, packed, bias)
    assert torch.allclose(y, torch.nn.functional.linear(x, decode(rw), bias), rtol=1e-5, atol=1e-5)


def test_fused_projections_equal_separate_calls(tmp_path, stand_in_kernel):
    """q/k/v and gate/up fused into one call each (stand-in kernel op): same logits as separate calls,
    any call order, biases and super weights kept; a format mismatch leaves that group unfused."""
    calls = stand_in_kernel
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)  # Qwen2: q/k/v have biases, which the fused call keeps
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for n in ("q_proj", "k_proj", "v_proj"):
                layer.self_attn.get_submodule(n).bias.normal_(0, 0.1)
    formats = ("INT4_G64",) * 9 + ("INT8_G32",) + ("INT4_G64",) * 5  # layer 1: v differs -> q/k/v not fused
    plan = _plan(model, formats)
    out = tmp_path / "ckpt"
    _export(model, out, plan, super_weights={"model.layers.0.self_attn.k_proj": ([1], [2])})
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    sep = load(out, device="cpu", dtype=torch.bfloat16, fuse=False)
    fused = load(out, device="cpu", dtype=torch.bfloat16)
    assert rt_linear.fuse_projections(fused) == 0  # already fused
    groups = {m._fused[0] for m in fused.modules() if isinstance(m, DynaLinear) and m._fused is not None}
    assert len(groups) == 3  # layer 0 q/k/v, both gate/up; layer 1 q/k/v mixes INT4_G64 and INT8_G32
    calls.clear()
    with torch.no_grad():
        a = sep(ids).logits
        n_sep = len(calls)
        calls.clear()
        b = fused(ids).logits
    assert n_sep == 15 and len(calls) == 15 - 2 - 1 - 1  # 3 -> 1 once, 2 -> 1 twice
    assert torch.equal(a, b)
    attn = fused.model.layers[0].self_attn
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    ref = [sep.model.layers[0].self_attn.get_submodule(n)(x) for n in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(attn.v_proj(x), ref[2]) and torch.equal(attn.q_proj(x), ref[0])  # out of order
    assert torch.equal(attn.k_proj(x), ref[1])
    assert torch.equal(attn.k_proj(x.clone()), ref[1])  # another tensor: recomputed


def _real_kernel_op(monkeypatch):
    """The kernels package's pack / linear / unpack as the op, on the CPU (its torch fallback): the release path."""
    import dynaquant.kernels as kernels

    monkeypatch.setattr(rt_linear, "_kernel_device", lambda t: True)
    monkeypatch.setattr(rt_linear, "kernel_op", lambda fmt: rt_linear._PackLinearOp(kernels))


@pytest.mark.parametrize("fmt", MIXED)
def test_dynalinear_keeps_one_copy_the_kernel_layout(monkeypatch, fmt):
    """With a kernel that gives its weight back (``op.unprepare``), a prepared layer releases its checkpoint buffers:
    the kernel layout is the one copy of the weight. ``state_dict`` still gives the checkpoint's tensors bit for bit
    (rebuilt from the layout), the decoded weight is the checkpoint's, ``load_state_dict`` and ``prepare`` without
    kernels bring the buffers back."""
    from dynaquant.quant.runtime import to_compressed_tensors

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(7))
    rw = encode(w, fmt, super_weights=([2, 50], [5, 100]))
    lin = DynaLinear(128, 96, fmt, bias=True)
    for k, v in to_compressed_tensors(rw).items():
        getattr(lin, k).copy_(v)
    lin.bias.data = torch.randn(96)
    lin.set_super_weights([[2, 5, float(w[2, 5])], [50, 100, float(w[50, 100])]])
    want = {k: v.clone() for k, v in lin.state_dict().items()}
    _real_kernel_op(monkeypatch)
    lin.prepare()
    assert lin._released and lin._op is not None
    assert all(getattr(lin, n).numel() == 0 for n in rt_linear._RELEASED if hasattr(lin, n))  # one copy: the layout
    got = lin.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                                             for k in want)
    assert torch.equal(lin.dequantize(), decode(rw))
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.allclose(lin(x).float(), torch.nn.functional.linear(x.float(), decode(rw), lin.bias), atol=0.1,
                          rtol=0.05)
    lin.load_state_dict(want)  # into a released layer: the buffers again, then prepared once more
    assert not lin._released and torch.equal(lin.weight_packed, want["weight_packed"])
    lin.prepare()
    assert lin._released
    lin.use_kernels = False
    lin.prepare()  # no kernel now: the buffers are rebuilt from the layout
    assert not lin._released and lin._op is None
    assert all(torch.equal(v, want[k]) for k, v in lin.state_dict().items())


def test_loaded_model_releases_its_buffers_and_saves_the_checkpoint(tmp_path, monkeypatch):
    """``load`` with kernels that unprepare: every quantized layer (fused q/k/v and gate/up included) holds only its
    kernel layout, and the model's ``state_dict`` is the checkpoint's tensors bit for bit."""
    from safetensors.torch import load_file

    model = _toy()
    out = tmp_path / "ckpt"
    _export(model, out, _plan(model, ("INT4_G64",)), super_weights={"model.layers.0.self_attn.k_proj": ([1], [2])})
    stored = {}
    for f in sorted(out.glob("*.safetensors")):
        stored.update(load_file(f))
    _real_kernel_op(monkeypatch)
    m = load(out, device="cpu", dtype=torch.bfloat16)
    layers = [x for x in m.modules() if isinstance(x, DynaLinear)]
    assert layers and all(x._released for x in layers) and any(x._fused is not None for x in layers)
    sd = m.state_dict()
    quantized = [k for k in stored if k.rpartition(".")[2] in rt_linear._RELEASED]
    assert quantized and all(torch.equal(sd[k], stored[k]) for k in quantized)
    ref = load(out, device="cpu", dtype=torch.bfloat16, kernels=False)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        assert torch.allclose(m(ids).logits.float(), ref(ids).logits.float(), atol=0.1, rtol=0.05)
