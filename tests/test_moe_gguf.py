"""Mixture-of-experts HF checkpoints -> GGUF, run in llama.cpp.

Oracles: transformers (the reference model, on the very weights written) and llama.cpp through
llama-cpp-python (the written files must load and compute the same logits); gguf-py's
dequantizer for a 3-D quantized expert tensor.

Each case is a tiny random checkpoint (hidden 256, 2 blocks, 4 experts, top-2, rows multiples
of 256 so the 256-block K/i-quants apply), every value random (norms near 1).

Router margins: random routers leave near-ties between the k-th and (k+1)-th expert, and the
last bits of the hidden state (which differ between llama.cpp and torch) then flip the choice.
The test routers are scaled up (std 1.0 instead of 0.15; see ``ROUTER_STD``), so router logits
spread by several units, and :func:`_router_margin` checks on the transformers side that the
k-th and (k+1)-th choices of every token are at least ``MIN_MARGIN`` apart.
"""

from __future__ import annotations

import json
import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from test_gguf_export import _tiny_tokenizer, encode

from dynaquant.exporters.gguf.writer import write_gguf
from dynaquant.names import gguf_to_hf_name, hf_to_gguf_name
from dynaquant.quant import get_format
from dynaquant.sources.gguf import open_gguf_source
from dynaquant.sources.open import open_hf_source

logger = logging.getLogger(__name__)

ROUTER_STD = 1.0
MIN_MARGIN = 1e-2
IDS = [1, 40, 7, 266, 290, 99, 283, 5, 299, 12]

_BASE = dict(vocab_size=320, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)

MOE = {
    # case -> (architecture, config, GGUF arch)
    "qwen2moe": ("Qwen2MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=256, shared_expert_intermediate_size=512, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False), "qwen2moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=512, num_experts=4, num_experts_per_tok=2, head_dim=64,
        norm_topk_prob=True), "qwen3moe"),
    # llama arch: q/k permuted, w1/w3/w2 -> gate/up/down
    "mixtral": ("MixtralForCausalLM", dict(
        intermediate_size=512, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), "llama"),
    # MLA (kv_b_proj split into attn_k_b/attn_v_b), one leading dense block, a shared expert,
    # sigmoid routing with e_score_correction_bias, routed_scaling_factor
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=256, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        q_lora_rank=256, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        routed_scaling_factor=2.5, norm_topk_prob=True), "deepseek2"),
    # DeepSeek-V3's released RoPE: YaRN with mscale/mscale_all_dim (attention scale and the
    # rope.scaling.yarn_log_multiplier key)
    "deepseek-v3-yarn": ("DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=256, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        q_lora_rank=256, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096 * 40,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096}), "deepseek2"),
    # attention sinks, biases everywhere, sliding window on even layers, fused interleaved gate_up
    # experts, clamped SwiGLU, YaRN as the config's default but with truncate=True: llama.cpp always
    # rounds YaRN's correction range to whole dims (ggml_rope_yarn_corr_dims), gpt-oss's own
    # truncate=False does not, which moves these logits by ~0.05 from the 4th token on
    "gpt-oss": ("GptOssForCausalLM", dict(
        intermediate_size=512, num_local_experts=4, num_experts_per_tok=2, head_dim=64, sliding_window=6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": True}), "gpt-oss"),
}


def _llama_logits(path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits (len(ids), vocab), one thread, F32 KV cache (the default F16 cache
    alone moves these logits by ~0.3% of their range)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        llm.eval(ids)
        return np.asarray(llm.scores[: len(ids)])
    finally:
        llm.close()


def _router_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if n.endswith((".mlp.gate", ".mlp.router"))]


def _tiny_moe(folder, case: str, seed: int = 0, tokenizer=None, **overrides) -> torch.nn.Module:
    """A random checkpoint of MOE[case] saved with ``save_pretrained`` plus a tiny BPE tokenizer (or
    ``tokenizer``, a transformers tokenizer saved beside it; ``overrides`` change the config)."""
    import transformers

    arch, cfg, _ = MOE[case]
    cls = getattr(transformers, arch)
    config = cls.config_class(**{**_BASE, **cfg, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = cls(config).eval()
    routers = tuple(n + "." for n in _router_names(model))
    sigmoid_routed = case.startswith("deepseek-v3")
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "rotary" in name:
                continue
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.startswith(routers) and not sigmoid_routed:
                p.copy_(ROUTER_STD * torch.randn_like(p))
            else:
                # sigmoid routers keep small weights (a saturated sigmoid ties at 1.0); their
                # choices are separated by the random e_score_correction_bias instead
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    if tokenizer is None:
        _tiny_tokenizer(folder)
    else:
        tokenizer.save_pretrained(folder)
    return model


def _decided_agreement(got: np.ndarray, ref: np.ndarray, tol: float) -> tuple[float, int]:
    """Argmax agreement of ``got`` (llama.cpp's logits, (tokens, vocab)) with ``ref`` over the tokens whose
    reference top-2 gap exceeds ``tol`` (logit units), and how many such tokens there are. A near-tie (gap within
    the deviation a test allows, e.g. that of llama.cpp's 8-bit activations) may flip either way without any
    error in the file; a token the reference decides by more than ``tol`` may not."""
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > tol
    agree = got.argmax(-1)[decided] == ref.argmax(-1)[decided]
    return (float(agree.mean()) if decided.any() else 0.0), int(decided.sum())


def _router_margin(model, ids: list[int]) -> float:
    """Smallest gap, over tokens and MoE layers, between the k-th and (k+1)-th router logit
    (transformers' forward, from the router's input)."""
    k = model.config.num_experts_per_tok
    gaps: list[float] = []
    hooks = []
    for name in _router_names(model):
        mod = model.get_submodule(name)

        def hook(m, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            logits = x.float() @ m.weight.float().T + (m.bias if getattr(m, "bias", None) is not None else 0)
            if getattr(m, "e_score_correction_bias", None) is not None:  # DeepSeek-V3: sigmoid + bias selects
                logits = logits.sigmoid() + m.e_score_correction_bias
            top = logits.sort(-1, descending=True).values
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))

        hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert gaps, "no router found"
    return min(gaps)


@pytest.mark.parametrize("case", list(MOE))
def test_tiny_moe_runs_in_llama_cpp(case, tmp_path):
    pytest.importorskip("llama_cpp")
    arch, cfg, gguf_arch = MOE[case]
    ckpt = tmp_path / "ckpt"
    model = _tiny_moe(ckpt, case)
    src = open_hf_source(ckpt)
    assert src.arch == gguf_arch
    by_name = {t.gguf_name: t for t in src.tensors()}
    c = model.config
    n_exp = next(getattr(c, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if hasattr(c, k))
    moe_layers = [i for i in range(model.config.num_hidden_layers) if f"blk.{i}.ffn_gate_exps.weight" in by_name]
    assert moe_layers
    state = model.state_dict()
    for i in moe_layers:
        for proj in ("gate", "up", "down"):
            t = by_name[f"blk.{i}.ffn_{proj}_exps.weight"]
            assert t.hf_name == f"model.layers.{i}.mlp.experts.{proj}_proj.weight" and t.quantizable
            assert t.shape[0] == n_exp and len(t.shape) == 3
            assert hf_to_gguf_name(gguf_arch, src.n_layers, t.hf_name) == t.gguf_name
            assert gguf_to_hf_name(gguf_arch, src.n_layers, t.gguf_name) == t.hf_name
        # the stacked tensors are transformers' fused in-memory experts, split into gate and up
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        down = state[f"model.layers.{i}.mlp.experts.down_proj"]
        if case == "gpt-oss":  # (E, H, 2I), gate/up interleaved; down (E, I, H)
            gate, up = gate_up.transpose(1, 2)[:, 0::2], gate_up.transpose(1, 2)[:, 1::2]
            down = down.transpose(1, 2)
        else:  # (E, 2I, H), gate then up
            gate, up = gate_up.chunk(2, dim=1)
        torch.testing.assert_close(src.read(by_name[f"blk.{i}.ffn_gate_exps.weight"]), gate, rtol=0, atol=0)
        torch.testing.assert_close(src.read(by_name[f"blk.{i}.ffn_up_exps.weight"]), up, rtol=0, atol=0)
        torch.testing.assert_close(src.read(by_name[f"blk.{i}.ffn_down_exps.weight"]), down, rtol=0, atol=0)
        assert not by_name[f"blk.{i}.ffn_gate_inp.weight"].quantizable
    if case == "gpt-oss":
        for i in moe_layers:
            for proj, sl in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                b = by_name[f"blk.{i}.ffn_{proj}_exps.bias"]
                assert b.shape == (n_exp, cfg["intermediate_size"]) and not b.quantizable
                assert b.hf_name == f"model.layers.{i}.mlp.experts.{proj}_proj.bias"
                torch.testing.assert_close(src.read(b), state[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"][:, sl])
            assert gguf_to_hf_name(gguf_arch, 2, f"blk.{i}.attn_sinks.weight") == by_name[f"blk.{i}.attn_sinks.weight"].hf_name
    if case.startswith("deepseek-v3"):
        assert "blk.0.ffn_gate.weight" in by_name and "blk.0.ffn_gate_exps.weight" not in by_name
        kv_b = state["model.layers.1.self_attn.kv_b_proj.weight"].view(4, 128, 256)
        torch.testing.assert_close(src.read(by_name["blk.1.attn_k_b.weight"]), kv_b[:, :64].transpose(1, 2))
        torch.testing.assert_close(src.read(by_name["blk.1.attn_v_b.weight"]), kv_b[:, 64:])
        for name in ("blk.1.exp_probs_b.bias", "blk.1.ffn_gate_shexp.weight", "blk.1.attn_kv_a_mqa.weight"):
            assert gguf_to_hf_name(gguf_arch, 2, name) == by_name[name].hf_name, name

    out = tmp_path / "tiny-moe.gguf"
    _write_f32(src, out)
    # every hf_name is the transformers parameter name (stacked experts: the fused experts module's
    # canonical names), and re-reading the GGUF file names every tensor the same way
    params = set(state)
    for t in src.tensors():
        if "_exps." in t.gguf_name or ".attn_k_b." in t.gguf_name or ".attn_v_b." in t.gguf_name:
            continue
        assert t.hf_name in params, t.hf_name
    assert {t.gguf_name: t.hf_name for t in open_gguf_source(out).tensors()} == {t.gguf_name: t.hf_name for t in src.tensors()}
    r = GGUFReader(out)
    f = r.fields
    assert f[f"{gguf_arch}.expert_count"].contents() == n_exp
    assert f[f"{gguf_arch}.expert_used_count"].contents() == 2
    if case.startswith("qwen"):
        assert f[f"{gguf_arch}.expert_feed_forward_length"].contents() == cfg["moe_intermediate_size"]
    if case == "qwen2moe":
        assert f["qwen2moe.expert_shared_feed_forward_length"].contents() == cfg["shared_expert_intermediate_size"]
    if case.startswith("deepseek-v3"):
        expect = {"leading_dense_block_count": 1, "expert_shared_count": 1, "expert_feed_forward_length": 256,
                  "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID, "expert_weights_norm": True,
                  "expert_weights_scale": 2.5, "attention.kv_lora_rank": 256, "attention.q_lora_rank": 256,
                  "attention.head_count_kv": 1, "attention.key_length": 256 + 64, "attention.value_length": 256,
                  "attention.key_length_mla": 128, "attention.value_length_mla": 64, "rope.dimension_count": 64,
                  "expert_group_count": 1, "expert_group_used_count": 1}
        assert {k: f[f"deepseek2.{k}"].contents() for k in expect} == expect
        if case == "deepseek-v3-yarn":  # the converter writes 0.1 * mscale_all_dim; llama.cpp divides it back
            assert f["deepseek2.rope.scaling.yarn_log_multiplier"].contents() == pytest.approx(0.1)
            assert f["deepseek2.rope.scaling.type"].contents() == "yarn"
    if case == "gpt-oss":
        assert f["gpt-oss.attention.sliding_window"].contents() == cfg["sliding_window"]
        assert f["gpt-oss.expert_feed_forward_length"].contents() == 512
        assert f["gpt-oss.rope.scaling.type"].contents() == "yarn"
    del r

    logger.info("%s: llama.cpp vs transformers max |diff| %.2e, max |logit| %.2f", case, *_logits_match(out, model))


# ---------------------------------------------------------------------------------------------
# quantized files


def _hf_state(src, decoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict (Qwen2/3-MoE, DeepSeek-V3) from GGUF tensors (decoded, torch order):
    stacked gate/up become the fused in-memory ``experts.gate_up_proj`` (E, 2I, H), gate first;
    DeepSeek's attn_k_b/attn_v_b are joined back into ``kv_b_proj``."""
    state = {}
    for t in src.tensors():
        if "_exps." in t.gguf_name or ".attn_k_b." in t.gguf_name or ".attn_v_b." in t.gguf_name:
            continue
        state[t.hf_name] = decoded[t.gguf_name]
    for i in range(src.n_layers):
        if f"blk.{i}.ffn_gate_exps.weight" in decoded:
            gate, up = decoded[f"blk.{i}.ffn_gate_exps.weight"], decoded[f"blk.{i}.ffn_up_exps.weight"]
            state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
            state[f"model.layers.{i}.mlp.experts.down_proj"] = decoded[f"blk.{i}.ffn_down_exps.weight"]
        if f"blk.{i}.attn_k_b.weight" in decoded:
            k_b, v_b = decoded[f"blk.{i}.attn_k_b.weight"], decoded[f"blk.{i}.attn_v_b.weight"]
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # (n_head, nope + v, rank)
            state[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    return state


def _decoded(path, src) -> dict[str, torch.Tensor]:
    r = GGUFReader(path)
    try:
        return {rt.name: torch.from_numpy(gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(
            src.tensor(rt.name).shape).copy()) for rt in r.tensors}
    finally:
        del r


# others' format -> (rel. RMS bound, min argmax agreement on decided tokens, min correlation); measured 0.014 / 1.0 / 0.9999
# with F32 around the two 3-D tensors, 0.087 / 0.7 / 0.996 with Q8_0 everywhere: llama.cpp multiplies
# quantized weights with 8-bit-quantized activations (Q8_0/Q8_K), and this random MoE (sharp routers)
# amplifies that; a misplaced expert, row or block moves the logits by O(1) rel. RMS
QUANT_BOUNDS = {"F32": (0.03, 1.0, 0.9995), "Q8_0": (0.15, 0.6, 0.99)}


@pytest.mark.parametrize("others", list(QUANT_BOUNDS))
def test_tiny_moe_quantized_3d_kquant_and_iquant(others, tmp_path, reference_encoders):
    """Qwen2-MoE with two stacked expert tensors in 256-block formats, Q2_K and IQ4_XS ((E, rows, row)
    bytes), every other matmul weight in F32 or Q8_0: gguf-py decodes the file's bytes exactly as our
    codecs do, and llama.cpp's logits match transformers' on the decoded weights."""
    pytest.importorskip("llama_cpp")
    from dynaquant.quant import dequantize, quantize

    ckpt = tmp_path / "ckpt"
    model = _tiny_moe(ckpt, "qwen2moe")
    src = open_hf_source(ckpt)
    special = {"blk.1.ffn_down_exps.weight": "Q2_K", "blk.0.ffn_gate_exps.weight": "IQ4_XS"}
    plan = {t.gguf_name: get_format(special.get(t.gguf_name, others) if t.quantizable else "F32") for t in src.tensors()}
    out = tmp_path / f"tiny-moe-{others}.gguf"
    write_gguf(out, src, plan, encode, {}, file_type=gguf.LlamaFileType.MOSTLY_Q8_0, progress=False)

    r = GGUFReader(out)
    decoded = {}
    for rt in r.tensors:
        t, fmt = src.tensor(rt.name), plan[rt.name]
        assert rt.tensor_type == fmt.ggml_type and tuple(reversed(rt.shape.tolist())) == t.shape, rt.name
        theirs = torch.from_numpy(gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(t.shape).copy())
        if fmt.name != "F32":
            ours = dequantize(np.array(rt.data).reshape(*t.shape[:-1], -1), fmt)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=rt.name)  # bit for bit
            if rt.name in special:
                # the 3-D bytes are the 2-D encoding of the (E * rows, row) matrix: nothing per expert is reordered
                x = src.read(t)
                flat = quantize(x.reshape(-1, x.shape[-1]), fmt).reshape(-1).numpy()
                assert np.array_equal(np.ascontiguousarray(rt.data).reshape(-1).view(np.uint8), flat)
        decoded[rt.name] = theirs
    del r

    missing = model.load_state_dict(_hf_state(src, decoded), strict=False).missing_keys
    assert missing == []
    # the decoded model's routing still has a clear margin (llama.cpp's 8-bit activations move
    # the router's inputs, so ask for more than in the F32 test)
    assert _router_margin(model, IDS) > 0.25
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    got = _llama_logits(out, IDS)
    rel_rms = float(np.sqrt(((got - ref) ** 2).mean() / (ref**2).mean()))
    corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    # argmax agreement on the tokens the reference decides by more than twice the RMS deviation allowed when
    # only the experts are quantized (near-ties of these random logits flip with llama.cpp's 8-bit activations)
    tol = 2 * QUANT_BOUNDS["F32"][0] * float(np.sqrt((ref**2).mean()))
    agree, n_decided = _decided_agreement(got, ref, tol)
    logger.info("qwen2moe %s + Q2_K/IQ4_XS experts: rel. RMS %.4f, argmax agreement %.2f on %d decided tokens, "
                "correlation %.5f", others, rel_rms, agree, n_decided, corr)
    max_rms, min_agree, min_corr = QUANT_BOUNDS[others]
    assert rel_rms < max_rms and corr > min_corr
    assert n_decided >= len(IDS) // 2 and agree >= min_agree, (agree, n_decided, tol)


def test_quantize_pipeline_q4_k_m_on_moe(tmp_path):
    """``dynaquant.quantize(<Qwen2-MoE folder>, preset="Q4_K_M")`` (calibration, imatrix, plan, 3-D
    encoders) writes llama-quantize's Q4_K_M types and llama.cpp's logits match transformers' on
    the file's decoded weights. (Qwen2-MoE: its softmax routers keep a clear margin after 4-bit
    rounding; the sigmoid-routed DeepSeek-V3 tiny model gets near-ties there.)"""
    pytest.importorskip("llama_cpp")
    import dynaquant

    ckpt = tmp_path / "ckpt"
    model = _tiny_moe(ckpt, "qwen2moe")
    res = dynaquant.quantize(str(ckpt), preset="Q4_K_M", output=tmp_path / "moe-q4_k_m.gguf",
                             calibration_chunks=2, progress=False)
    src = open_hf_source(ckpt)
    r = GGUFReader(res.output)
    types = {rt.name: rt.tensor_type.name for rt in r.tensors}
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    del r
    # llama-quantize's Q4_K_M: ffn_down "use_more_bits" layers (here the last of 2) in Q6_K
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    assert types["blk.1.ffn_gate_inp.weight"] == "F32" and types["blk.1.ffn_gate_inp_shexp.weight"] == "F32"
    decoded = _decoded(res.output, src)
    assert model.load_state_dict(_hf_state(src, decoded), strict=False).missing_keys == []
    assert _router_margin(model, IDS) > 0.25
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    got = _llama_logits(res.output, IDS)
    rel_rms = float(np.sqrt(((got - ref) ** 2).mean() / (ref**2).mean()))
    corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    logger.info("qwen2moe Q4_K_M: rel. RMS %.4f, correlation %.5f", rel_rms, corr)
    # as the Q8_0 file above: llama.cpp's 8-bit activations, no misplaced tensor
    assert rel_rms < 0.15 and corr > 0.99


@pytest.mark.parametrize("preset", ["Q4_K_M", "Q2_K", "IQ2_XS", "IQ3_M"])
@pytest.mark.parametrize("case", ["qwen2moe", "deepseek-v3"])
def test_moe_presets_match_llama_quantize(case, preset, tmp_path):
    """Our preset plan for a MoE file, from the HF folder and from its F32 GGUF, equals the types
    ``llama-quantize --dry-run`` picks (expert-aware ffn_down rules, F32 routers, MLA tensors)."""
    from test_gguf_export import _llama_quantize, _llama_quantize_types

    from dynaquant.pipeline.source import model_info, tensor_infos
    from dynaquant.quant.planner import make_plan

    exe = _llama_quantize()
    _tiny_moe(tmp_path / "ckpt", case)
    hf = open_hf_source(tmp_path / "ckpt")
    f32 = tmp_path / "f32.gguf"
    _write_f32(hf, f32)
    theirs, _ = _llama_quantize_types(exe, f32, preset, None)
    assert any("_exps" in n for n in theirs)
    for src in (hf, open_gguf_source(f32)):
        plan = make_plan(tensor_infos(src), model_info(src), preset=preset, has_imatrix=True)
        assert {e.name: e.format for e in plan.entries if e.format != "F32"} == theirs


@pytest.mark.parametrize("fmt", ["Q4_K", "IQ4_XS", "Q2_K"])
def test_stacked_weight_with_per_expert_imatrix_encodes_each_expert_alone(fmt):
    """A (n_expert, rows, K) weight with a (n_expert, K) imatrix (llama.cpp's layout for ffn_*_exps)
    gives the bytes of each expert quantized alone with its own importance row."""
    from dynaquant.quant import quantize

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 512, generator=g)
    im = torch.rand(3, 512, generator=g) ** 4 * 100
    im[1, :7] = 0  # unseen columns of one expert: floored within that expert
    got = quantize(x, fmt, im)
    assert got.shape[:2] == (3, 5)
    for e in range(3):
        assert torch.equal(got[e], quantize(x[e], fmt, im[e])), e
    assert not torch.equal(got[0], quantize(x[0], fmt, im[1]))  # the rows do matter
    assert torch.equal(quantize(x, fmt, im[0]), torch.stack([quantize(x[e], fmt, im[0]) for e in range(3)]))


def test_quantize_pipeline_iquant_with_moe_imatrix_file(tmp_path):
    """``dynaquant.quantize(<Mixtral folder>, preset="IQ2_XS", imatrix=<llama.cpp imatrix>)``: the
    imatrix's (n_expert, K) expert entries reach the encoders (IQ2_XS needs one for every tensor
    it is used on) and llama.cpp runs the file."""
    pytest.importorskip("llama_cpp")
    import dynaquant
    from dynaquant.analysis.imatrix_io import save_imatrix_gguf

    ckpt = tmp_path / "ckpt"
    _tiny_moe(ckpt, "mixtral")
    src = open_hf_source(ckpt)
    g = torch.Generator().manual_seed(1)
    entries = {}
    for t in src.tensors():
        if t.quantizable and t.gguf_name.startswith("blk."):
            n_mat = t.shape[0] if len(t.shape) == 3 else None
            sums = 100 * torch.rand(*(() if n_mat is None else (n_mat,)), t.shape[-1], generator=g) + 1
            entries[t.gguf_name] = (sums, 100 if n_mat is None else torch.full((n_mat,), 100))
    imatrix = save_imatrix_gguf(tmp_path / "imatrix.gguf", entries, datasets=["random"], chunk_count=1, chunk_size=100)
    res = dynaquant.quantize(str(ckpt), preset="IQ2_XS", imatrix=imatrix, output=tmp_path / "moe-iq2_xs.gguf",
                             progress=False)
    r = GGUFReader(res.output)
    types = {rt.name: rt.tensor_type.name for rt in r.tensors}
    del r
    assert types["blk.0.ffn_gate_exps.weight"] == "IQ2_XS" and types["blk.0.ffn_up_exps.weight"] == "IQ2_XS"
    got = _llama_logits(res.output, IDS)
    assert np.isfinite(got).all() and got.std() > 0.1


# ---------------------------------------------------------------------------------------------
# release-checkpoint storage: block-FP8 (DeepSeek-V3) and MXFP4 experts (gpt-oss)


def _rewrite_checkpoint(folder, tensors: dict[str, torch.Tensor], drop: set[str], quantization_config: dict) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = {k: v for k, v in load_file(path).items() if k not in drop}
    save_file({**state, **tensors}, path, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))


def _write_f32(src, out) -> None:
    """Every tensor of ``src`` as F32 in the GGUF file ``out``."""
    write_gguf(out, src, {t.gguf_name: get_format("F32") for t in src.tensors()}, encode, {},
               file_type=gguf.LlamaFileType.ALL_F32, progress=False)


def _logits_match(out, model, ids: list[int] = IDS, margin: float = MIN_MARGIN) -> tuple[float, float]:
    """Assert llama.cpp's logits of the GGUF ``out`` on ``ids`` match ``model``'s (argmax equal, within
    2e-3 of the largest logit; routers at least ``margin`` apart); returns (max |diff|, max |logit|)."""
    assert _router_margin(model, ids) > margin
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    got = _llama_logits(out, ids)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
    return float(np.abs(got - ref).max()), float(np.abs(ref).max())


def _f32_logits_match(src, model, tmp_path, margin: float = MIN_MARGIN) -> float:
    out = tmp_path / "model-f32.gguf"
    _write_f32(src, out)
    return _logits_match(out, model, IDS, margin)[0]


def test_block_fp8_deepseek_checkpoint(tmp_path):
    """DeepSeek-V3 as released: every layer matmul weight in float8_e4m3fn with a weight_scale_inv per
    128x128 block (kv_a_proj_with_mqa's 320 rows end in a partial block). The source lists no scale
    tensor, reads weight * scale, and llama.cpp runs the F32 file like transformers on those values."""
    pytest.importorskip("llama_cpp")
    ckpt = tmp_path / "ckpt"
    model = _tiny_moe(ckpt, "deepseek-v3")
    fp8, deq = {}, {}
    for name, w in model.state_dict().items():
        if not (name.startswith("model.layers.") and name.endswith(".weight") and w.ndim == 2) or "norm" in name \
                or name.endswith("mlp.gate.weight"):
            continue
        n, k = w.shape
        blocks = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128)).reshape(-(-n // 128), 128, -(-k // 128), 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # e4m3's largest value
        full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, scale
        deq[name] = q.float() * full
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in fp8
    assert fp8["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 2)
    # the in-memory experts are fused (not in the loop above); the checkpoint has them per expert
    assert not [n for n in fp8 if ".mlp.experts." in n]
    per_expert = {}
    from safetensors import safe_open

    with safe_open(ckpt / "model.safetensors", "pt") as f:
        disk = {k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." in k}  # noqa: SIM118
    for name, w in disk.items():
        n, k = w.shape
        scale = w.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448.0
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        q = (w / full).to(torch.float8_e4m3fn)
        per_expert[name], per_expert[name + "_scale_inv"] = q, scale
        deq[name] = q.float() * full
    _rewrite_checkpoint(ckpt, {**fp8, **per_expert, "model.layers.1.self_attn.kv_b_proj.activation_scale": torch.ones(())},
                        set(), {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic"})
    src = open_hf_source(ckpt)
    assert not [t for t in src.tensors() if "scale" in (t.hf_name or "")]
    # reference: transformers on the dequantized values (experts fused as in memory)
    state = {k: v for k, v in deq.items() if ".mlp.experts." not in k}
    for i in range(1, 2):
        pre = f"model.layers.{i}.mlp.experts."
        stack = {p: torch.stack([deq[f"{pre}{e}.{p}_proj.weight"] for e in range(4)]) for p in ("gate", "up", "down")}
        state[pre + "gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        state[pre + "down_proj"] = stack["down"]
        torch.testing.assert_close(src.read(src.tensor(f"blk.{i}.ffn_up_exps.weight")), stack["up"], rtol=0, atol=0)
    assert model.load_state_dict(state, strict=False).unexpected_keys == []
    torch.testing.assert_close(src.read(src.tensor("blk.1.attn_kv_a_mqa.weight")),
                               deq["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"], rtol=0, atol=0)
    logger.info("deepseek-v3 fp8: max |diff| %.2e", _f32_logits_match(src, model, tmp_path))


def test_mxfp4_gpt_oss_checkpoint(tmp_path):
    """gpt-oss as released: experts in MXFP4 (``*_blocks`` uint8 (E, rows, G, 16), ``*_scales`` E8M0);
    our decoding equals transformers' ``convert_moe_packed_tensors`` and llama.cpp runs the F32 file
    like transformers on those values."""
    pytest.importorskip("llama_cpp")
    ckpt = tmp_path / "ckpt"
    model, state = _mxfp4_gpt_oss(ckpt)
    src = open_hf_source(ckpt)
    for i in range(2):
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(1, 2)  # (E, 2I, H)
        torch.testing.assert_close(src.read(src.tensor(f"blk.{i}.ffn_gate_exps.weight")), gate_up[:, 0::2], rtol=0, atol=0)
        torch.testing.assert_close(src.read(src.tensor(f"blk.{i}.ffn_up_exps.weight")), gate_up[:, 1::2], rtol=0, atol=0)
        torch.testing.assert_close(src.read(src.tensor(f"blk.{i}.ffn_down_exps.weight")),
                                   state[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2), rtol=0, atol=0)
    assert model.load_state_dict(state, strict=False).unexpected_keys == []
    logger.info("gpt-oss mxfp4: max |diff| %.2e", _f32_logits_match(src, model, tmp_path))


def test_mxfp4_experts_stay_mxfp4(tmp_path):
    """The default rules keep gpt-oss's MXFP4 experts in MXFP4 (GGUF type MXFP4, our runtime's MXFP4_G32),
    and re-encoding them (with any imatrix) gives back exactly the released values: no second rounding."""
    from dynaquant.pipeline.source import model_info, tensor_infos
    from dynaquant.quant.codecs import dequantize, quantize
    from dynaquant.quant.planner import default_rules, make_plan

    _mxfp4_gpt_oss(tmp_path / "ckpt")
    src = open_hf_source(tmp_path / "ckpt")
    info = model_info(src)
    assert info.expert_format == "MXFP4"
    for target, fmt, bpw in (("gguf", "MXFP4", 6.0), ("safetensors", "MXFP4_G32", 6.5)):
        plan = make_plan(tensor_infos(src), info, bpw=bpw, defaults=default_rules(info, target=target), target=target,
                         has_imatrix=True)
        exps = [e for e in plan.entries if e.name.endswith("_exps.weight")]
        assert len(exps) == 6 and all(e.format == fmt for e in exps), [(e.name, e.format) for e in exps]
    g = torch.Generator().manual_seed(0)
    for t in src.tensors():
        if t.gguf_name.endswith("_exps.weight"):
            w = src.read(t)
            imp = torch.rand(w.shape[0], w.shape[-1], generator=g) + 0.01
            for fmt in ("MXFP4", "MXFP4_G32"):
                assert torch.equal(dequantize(quantize(w, fmt, imp), fmt).reshape(w.shape), w), (t.gguf_name, fmt)


def _mxfp4_gpt_oss(ckpt):
    """A tiny gpt-oss checkpoint whose experts are stored as released (MXFP4 blocks + E8M0 scales); returns
    (the transformers model, its state with the experts' decoded values, as transformers' own converter gives)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = _tiny_moe(ckpt, "gpt-oss")
    g = torch.Generator().manual_seed(5)
    packed, state = {}, {}
    for i in range(2):
        pre = f"model.layers.{i}.mlp.experts."
        for proj, rows, k in (("gate_up_proj", 1024, 256), ("down_proj", 256, 512)):
            blocks = torch.randint(0, 256, (4, rows, k // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(122, 126, (4, rows, k // 32), generator=g, dtype=torch.uint8)
            packed[pre + proj + "_blocks"], packed[pre + proj + "_scales"] = blocks, scales
            state[pre + proj] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, K, rows)
    drop = {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    _rewrite_checkpoint(ckpt, packed, drop, {"quant_method": "mxfp4", "modules_to_not_convert": keep})
    return model, state


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """SmolLM2's tokenizer, read from the embedded default model's GGUF by transformers."""
    from transformers import AutoTokenizer

    from dynaquant.sources.checkpoint import SourceError, default_model_path

    try:
        path = default_model_path()
    except SourceError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("case", [c for c in MOE if not c.endswith("-yarn")])
def test_moe_with_smollm2_tokenizer_runs_in_llama_cpp(case, smollm_tokenizer, tmp_path):
    """Each architecture with a tokenizer llama.cpp knows (SmolLM2's 49k BPE, pre-tokenizer ``smollm``):
    llama.cpp tokenizes text as transformers does, and its logits on those tokens match."""
    import llama_cpp

    ckpt = tmp_path / "ckpt"
    model = _tiny_moe(ckpt, case, tokenizer=smollm_tokenizer, vocab_size=len(smollm_tokenizer),
                      bos_token_id=smollm_tokenizer.bos_token_id,
                      eos_token_id=smollm_tokenizer.eos_token_id)
    src = open_hf_source(ckpt)
    out = tmp_path / "moe.gguf"
    _write_f32(src, out)
    r = GGUFReader(out)
    assert r.fields["tokenizer.ggml.pre"].contents() == "smollm"
    del r
    text = "Mixture-of-experts layers route each token to a few experts."
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_threads=1, verbose=False, vocab_only=True)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
    finally:
        llm.close()
    _logits_match(out, model, ids)
