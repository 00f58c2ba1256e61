"""Mixture-of-experts models through the safetensors target: plan, per-expert checkpoint, ``dynaquant.load``.

Cases: the tiny checkpoints of ``test_moe_gguf.py`` (Qwen2-MoE with a shared expert, Qwen3-MoE, Mixtral,
DeepSeek-V3 (MLA, a dense first block, sigmoid group routing, a shared expert), gpt-oss (expert biases,
interleaved gate/up, clamped SwiGLU)), quantized through the real pipeline (``dynaquant.analyze`` on 4
sequences of 64 tokens with a few runtime candidates, then ``dynaquant.quantize(target="safetensors",
bpw=...)``); and gpt-oss once more through the planner and writer directly on the transformers model
(:func:`dynaquant.runtime.moe.checkpoint_weights`, default rules, a per-expert imatrix with an unrouted expert).

Oracle: the transformers model holding the weights ``dynaquant.load`` decoded (every quantized linear and
expert, the BF16 / F32 tensors as stored), run in float32. The two differ only in summation order (each
expert's gate and up as two products instead of one fused product), so the logits agree to float32
rounding: ``LOGIT_RTOL`` of the largest logit. Routers are scaled up (``test_moe_gguf.ROUTER_STD``) so that
no top-k choice is a near-tie a last-bit difference could flip.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from test_moe_gguf import IDS, MOE, ROUTER_STD, _router_margin, _router_names, _tiny_moe

import dynaquant
import dynaquant.runtime.loader as rt
from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.exporters.safetensors.writer import unquantized_linears, write_safetensors
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import TensorInfo
from dynaquant.quant.planner import default_rules, make_plan
from dynaquant.quant.presets import ModelInfo
from dynaquant.quant.runtime import encode
from dynaquant.runtime.loader import DynaLinear
from dynaquant.runtime.moe import DynaExperts, checkpoint_weights, encode_experts
from dynaquant.sources.experts import PROJS, expert_weight, find_experts

LOGIT_RTOL = 1e-5
CANDIDATES = ("INT2_G128", "INT2_G64", "INT3_G128", "INT4_G128", "INT4_G32", "INT8_G128", "INT8_G32")
SPEC = CalibrationSpec((), 4, 64)


def _reference(src, q):
    """The transformers model of ``src`` (a model or a folder) holding ``q``'s decoded weights, float32."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32) if not isinstance(src, torch.nn.Module) \
        else type(src)(src.config).eval()
    experts = find_experts(ref)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            mod_name, _, attr = name.rpartition(".")
            if mod_name in experts:
                continue
            qm = q.get_submodule(mod_name)
            p.copy_(qm.dequantize() if isinstance(qm, DynaLinear) and attr == "weight" else getattr(qm, attr))
        for name, mod in experts.items():
            dq = q.get_submodule(name)
            assert isinstance(dq, DynaExperts)
            for e in range(dq.num_experts):
                ex = dq.expert(e)
                for proj in PROJS:
                    lin = getattr(ex, proj)
                    expert_weight(mod, proj)[e].copy_(lin.dequantize() if isinstance(lin, DynaLinear) else lin.weight)
                if dq.layout == "gpt-oss":
                    mod.gate_up_proj_bias[e, 0::2] = ex.gate_proj.bias
                    mod.gate_up_proj_bias[e, 1::2] = ex.up_proj.bias
                    mod.down_proj_bias[e] = ex.down_proj.bias
    return ref.eval()


def _tensor_bytes(folder, pattern: str) -> tuple[int, int]:
    """(bytes stored, elements of the weights) of the checkpoint tensors whose name matches ``pattern``."""
    stored = 0
    elements = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if re.search(pattern, k):
                t = f.get_tensor(k)
                stored += t.numel() * t.element_size()
                if k.endswith(".weight_shape"):
                    elements += int(t.prod())
                elif k.endswith(".weight"):
                    elements += t.numel()
    return stored, elements


def _check(q, ref, folder, case):
    """Logits against the reference, experts stored per expert and quantized, generate."""
    assert any(isinstance(m, DynaExperts) for m in q.modules())
    ids = torch.tensor([IDS])
    assert _router_margin(ref, IDS) > 1e-3
    with torch.no_grad():
        got, want = q(ids).logits, ref(ids).logits
        diff = float((got - want).abs().max())
        scale = float(want.abs().max())
        print(f"{case}: max |logit diff| {diff:.3e} (max |logit| {scale:.2f}, tolerance {LOGIT_RTOL * scale:.2e})")
        assert diff <= LOGIT_RTOL * scale
        out = q.generate(ids[:, :5], max_new_tokens=5, do_sample=False)
        assert out.shape == (1, 10)
        assert torch.equal(out, ref.generate(ids[:, :5], max_new_tokens=5, do_sample=False))
    stored, elements = _tensor_bytes(folder, r"\.experts\.\d+\.")
    print(f"{case}: experts {stored} bytes on disk, {2 * elements} in BF16 ({8 * stored / elements:.3f} bits/weight)")
    assert elements > 0 and 8 * stored / elements < 3.0
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    # the config_groups targets alone (what vLLM / compressed-tensors match) give the extension's formats
    ext = rt.module_formats(qc, q)
    groups = [(rt.format_of_scheme(g), g["targets"]) for g in qc["config_groups"].values()]
    for name, m in q.named_modules():
        if isinstance(m, (torch.nn.Linear, DynaLinear)):
            assert next((f for f, t in groups if rt._match(name, t, m)), None) == ext.get(name), name
    assert any(re.search(r"experts\.\d+\.gate_proj$", n) for n in ext)


@pytest.mark.parametrize("case", [c for c in MOE if not c.endswith("-yarn")])  # one DeepSeek-V3 case suffices
def test_pipeline_quantizes_experts_and_loads(case, tmp_path):
    _tiny_moe(tmp_path / "src", case)
    dynaquant.analyze(str(tmp_path / "src"), tmp_path / "an", calibration=SPEC, candidates=CANDIDATES, fisher_sequences=1,
                      super_weights=False, progress=False)
    bpw = 7.6 if case.startswith("deepseek") else 5.5  # a little above the smallest the default rules allow
    res = dynaquant.quantize(str(tmp_path / "src"), output=tmp_path / "q", target="safetensors", bpw=bpw,
                             report=tmp_path / "an" / "report.json", calibration=SPEC, progress=False)
    formats = res.plan.formats()
    exps = {n: f for n, f in formats.items() if "_exps.weight" in n}
    # INT2 under the default caps; with this explicit budget the planner keeps a plan without them when that
    # predicts a lower error (DeepSeek-V3 here: INT3 gate/up); either way well below BF16
    assert exps and all(get_format(f).bpw <= 4.5 for f in exps.values()), exps
    assert all(formats[n] == "F32" for n in formats if ".ffn_gate_inp" in n)
    for i in {int(n.split(".")[1]) for n in exps}:
        assert formats[f"blk.{i}.ffn_gate_exps.weight"] == formats[f"blk.{i}.ffn_up_exps.weight"]
    q = dynaquant.load(tmp_path / "q", device="cpu")
    _check(q, _reference(tmp_path / "src", q), tmp_path / "q", case)
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:  # routers stored F32, in-memory names
        routers = [k for k in f.keys() if re.search(r"\.mlp\.(gate|router)\.weight$", k)]
        n_moe = len({n.split(".")[1] for n in exps})
        assert len(routers) == n_moe and all(f.get_tensor(k).dtype == torch.float32 for k in routers)
    total, _ = _tensor_bytes(tmp_path / "q", r".")
    bf16 = 2 * sum(p.numel() for p in _reference(tmp_path / "src", q).parameters())
    print(f"{case}: checkpoint {total} bytes, BF16 {bf16}")
    # DeepSeek-V3's tiny model is mostly its dense first block and MLA (kept >= Q8-class), not experts
    assert total < (0.5 if case.startswith("deepseek") else 0.45) * bf16


# ---------------------------------------------------------------------------------------------------
# gpt-oss: the planner and writer on the transformers model directly

_BASE = dict(vocab_size=320, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
DIRECT = {
    "gpt_oss": ("GptOssForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, head_dim=64, num_key_value_heads=2,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
}

BPW = {"gpt_oss": 5.5}  # a little above the smallest the default rules allow


def _direct_model(case: str) -> torch.nn.Module:
    import transformers

    arch, cfg = DIRECT[case]
    cls = getattr(transformers, arch)
    config = cls.config_class(**{**_BASE, **cfg})
    config.architectures = [arch]
    torch.manual_seed(0)
    model = cls(config).eval()
    routers = tuple(n + "." for n in _router_names(model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.startswith(routers):
                p.copy_(ROUTER_STD * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _gguf_like(hf: str, routers: tuple[str, ...]) -> str:
    """A GGUF-style planner name for an HF tensor name (the planner's rules read GGUF names)."""
    if m := re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate|up|down)_proj\.(weight|bias)$", hf):
        return f"blk.{m.group(1)}.ffn_{m.group(2)}_exps.{m.group(3)}"
    if hf.startswith(routers):
        return re.sub(r"^model\.layers\.(\d+)\..*\.(\w+)$", r"blk.\1.ffn_gate_inp.\2", hf)
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    name = re.sub(r"^model\.layers\.(\d+)\.", r"blk.\1.", hf)
    name = re.sub(r"\.mlp\.shared_experts?\.(gate|up|down)_proj\.", r".ffn_\1_shexp.", name)
    name = re.sub(r"\.mlp\.(gate|up|down)_proj\.", r".ffn_\1.", name)
    return name.replace(".self_attn.", ".attn_")


def _direct_plan(model, weights, bpw: float):
    routers = tuple(n + "." for n in _router_names(model))
    tensors = []
    for hf, w in weights.items():
        name = _gguf_like(hf, routers)
        q = w.ndim >= 2 and hf.endswith(".weight") and ".ffn_gate_inp." not in name
        tensors.append(TensorInfo(name, hf, tuple(w.shape), q))
    n_exp = next(getattr(model.config, k) for k in ("n_routed_experts", "num_local_experts") if hasattr(model.config, k))
    info = ModelInfo(n_layers=model.config.num_hidden_layers, n_expert=n_exp)
    return make_plan(tensors, info, "tiny", bpw=bpw, target="safetensors", defaults=default_rules(info))


@pytest.mark.parametrize("case", list(DIRECT))
def test_planner_writer_loader_on_transformers_experts(case, tmp_path):
    model = _direct_model(case)
    weights = checkpoint_weights(model)
    plan = _direct_plan(model, weights, bpw=BPW[case])
    formats = plan.formats()
    exps = {n: f for n, f in formats.items() if re.search(r"_exps\.weight$", n)}
    assert exps and all(f.startswith("INT2_") for f in exps.values())
    assert all(formats[n] in ("F32", "BF16") for n in formats if ".ffn_gate_inp." in n)
    gen = torch.Generator().manual_seed(0)

    def enc(e, w):
        if w.ndim == 3:  # a per-expert imatrix; expert 0 unrouted (zero row: plain rounding)
            imp = torch.rand(w.shape[0], w.shape[2], generator=gen) + 0.1
            imp[0] = 0
            return encode_experts(w, e.format, imp)
        return encode(w, e.format)

    write_safetensors(tmp_path / "q", plan, weights, enc, model.config.to_dict(), ignore=unquantized_linears(model, plan),
                      progress=False)
    q = dynaquant.load(tmp_path / "q", device="cpu")
    _check(q, _reference(model, q), tmp_path / "q", case)
    if case == "gpt_oss":
        with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
            torch.testing.assert_close(f.get_tensor("model.layers.1.mlp.experts.2.up_proj.bias"),
                                       model.model.layers[1].mlp.experts.gate_up_proj_bias[2, 1::2], rtol=0, atol=0)


def test_unquantized_experts_are_written_per_expert_in_bf16(tmp_path):
    model = _direct_model("gpt_oss")
    weights = checkpoint_weights(model)
    plan = _direct_plan(model, weights, bpw=BPW["gpt_oss"])
    for e in plan.entries:
        if "_exps." in e.name:
            e.format = "BF16"
    write_safetensors(tmp_path / "q", plan, weights, lambda e, w: encode(w, e.format), model.config.to_dict(),
                      progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert "expert_formats" not in qc["dynaquant"]
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight")
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, expert_weight(model.model.layers[0].mlp.experts, "down_proj")[3].to(torch.bfloat16))
    q = dynaquant.load(tmp_path / "q", device="cpu")
    assert isinstance(q.model.layers[0].mlp.experts, DynaExperts)
    assert not isinstance(q.model.layers[0].mlp.experts.expert(3).down_proj, DynaLinear)
    _check_logits_only(q, _reference(model, q))


def _check_logits_only(q, ref):
    ids = torch.tensor([IDS])
    with torch.no_grad():
        got, want = q(ids).logits, ref(ids).logits
    assert float((got - want).abs().max()) <= LOGIT_RTOL * float(want.abs().max())


def test_expert_caps_find_runtime_candidates():
    """The default MoE caps are GGUF formats below every runtime format (IQ2_XXS, 2.06 bpw): the allocator
    takes the cheapest runtime format that fits instead, gate and up together; routers stay F32; a larger
    budget lifts the caps where the plan without them fits."""
    info = ModelInfo(n_layers=2, n_expert=8)
    tensors = [TensorInfo("token_embd.weight", "model.embed_tokens.weight", (320, 256)),
               TensorInfo("output.weight", "lm_head.weight", (320, 256))]
    for i in range(2):
        tensors += [TensorInfo(f"blk.{i}.attn_q.weight", f"model.layers.{i}.self_attn.q_proj.weight", (256, 256)),
                    TensorInfo(f"blk.{i}.ffn_gate_inp.weight", f"model.layers.{i}.mlp.gate.weight", (8, 256), False),
                    *(TensorInfo(f"blk.{i}.ffn_{p}_exps.weight", f"model.layers.{i}.mlp.experts.{p}_proj.weight",
                                 (8, 512, 256) if p != "down" else (8, 256, 512)) for p in ("gate", "up", "down"))]
    # 3 bpw: the capped plan uses less than 90 % of it, but without the caps the first-layers rule (>= Q8_0)
    # binds blk.0's experts and nothing fits: the capped plan stays
    plan = make_plan(tensors, info, bpw=3.0, target="safetensors", defaults=default_rules(info))
    assert "caps lifted" not in plan.method and plan.bpw < 0.9 * 3.0
    low = plan.formats()
    assert low["blk.0.ffn_gate_exps.weight"] == low["blk.0.ffn_up_exps.weight"] == "INT2_G128"
    assert get_format(low["blk.1.ffn_down_exps.weight"]).bpw <= get_format("IQ2_XS").bpw
    assert low["blk.0.ffn_gate_inp.weight"] == "F32" and low["token_embd.weight"] == "BF16"
    high = make_plan(tensors, info, bpw=6.0, target="safetensors", defaults=default_rules(info))
    assert "caps lifted" in high.method
    assert get_format(high.formats()["blk.1.ffn_up_exps.weight"]).bpw > 3


def test_is_silu_finds_the_activations_the_gate_up_epilogue_computes():
    from transformers.activations import ACT2FN

    from dynaquant.runtime.moe import is_silu

    assert is_silu(ACT2FN["silu"]) and is_silu(ACT2FN["swish"]) and is_silu(torch.nn.SiLU())
    assert is_silu(torch.nn.functional.silu)
    assert not any(is_silu(a) for a in (ACT2FN["gelu"], ACT2FN["relu"], torch.nn.GELU(), torch.sigmoid))


def test_grouped_launch_takes_half2_where_measured(monkeypatch):
    """The MoE layer's launch: up to 16 tokens the grouped GEMV, with the packed-fp16 products and 64-word tiles only
    for symmetric INT4 / INT2 group 128 on sm_90+; above 16 tokens tensor-core tiles."""
    import dynaquant.kernels as kernels
    from dynaquant.kernels import DeviceInfo, KernelFormat
    from dynaquant.runtime.moe import grouped_launch

    cpu = torch.device("cpu")
    assert grouped_launch(1, KernelFormat.parse("INT2_G128"), cpu) == dict(gemv=True, block_n=64, num_warps=2)
    monkeypatch.setattr(kernels, "device_info", lambda device: DeviceInfo("NVIDIA H200", 132, (9, 0)))
    fast = grouped_launch(16, KernelFormat.parse("INT2_G128"), cpu)
    assert fast["half2"] and fast["words"] == 64 and fast["gemv"]
    assert grouped_launch(1, KernelFormat.parse("INT4_G128"), cpu)["half2"]
    for fmt in ("INT4_G128_ASYM", "INT4_G64", "MXFP4_G32"):
        assert "half2" not in grouped_launch(1, KernelFormat.parse(fmt), cpu), fmt
    assert "gemv" not in grouped_launch(17, KernelFormat.parse("INT2_G128"), cpu)
