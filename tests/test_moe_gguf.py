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

import logging

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from test_gguf_export import _tiny_tokenizer, encode

import gguf
from dynaquant.exporters import open_hf_source, write_gguf
from dynaquant.exporters.gguf_names import gguf_to_hf_name, hf_to_gguf_name
from dynaquant.quant import get_format

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


def _tiny_moe(folder, case: str, seed: int = 0) -> torch.nn.Module:
    """A random checkpoint of MOE[case] saved with ``save_pretrained`` plus a tiny BPE tokenizer."""
    import transformers

    arch, cfg, _ = MOE[case]
    cls = getattr(transformers, arch)
    config = cls.config_class(**{**_BASE, **cfg})
    config.architectures = [arch]
    torch.manual_seed(seed)
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
    model.save_pretrained(folder)
    _tiny_tokenizer(folder)
    return model


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
            logits = x @ m.weight.T + (m.bias if getattr(m, "bias", None) is not None else 0)
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
        gate, up = gate_up.chunk(2, dim=1)
        torch.testing.assert_close(src.read(by_name[f"blk.{i}.ffn_gate_exps.weight"]), gate, rtol=0, atol=0)
        torch.testing.assert_close(src.read(by_name[f"blk.{i}.ffn_up_exps.weight"]), up, rtol=0, atol=0)
        torch.testing.assert_close(src.read(by_name[f"blk.{i}.ffn_down_exps.weight"]),
                                   state[f"model.layers.{i}.mlp.experts.down_proj"], rtol=0, atol=0)
        assert not by_name[f"blk.{i}.ffn_gate_inp.weight"].quantizable

    out = tmp_path / "tiny-moe.gguf"
    plan = {t.gguf_name: get_format("F32") for t in src.tensors()}
    write_gguf(out, src, plan, encode, {}, file_type=gguf.LlamaFileType.ALL_F32, progress=False)
    r = GGUFReader(out)
    f = r.fields
    assert f[f"{gguf_arch}.expert_count"].contents() == n_exp
    assert f[f"{gguf_arch}.expert_used_count"].contents() == 2
    if case.startswith("qwen"):
        assert f[f"{gguf_arch}.expert_feed_forward_length"].contents() == cfg["moe_intermediate_size"]
    if case == "qwen2moe":
        assert f["qwen2moe.expert_shared_feed_forward_length"].contents() == cfg["shared_expert_intermediate_size"]
    del r

    assert _router_margin(model, IDS) > MIN_MARGIN
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    got = _llama_logits(out, IDS)
    logger.info("%s: llama.cpp vs transformers max |diff| %.2e, max |logit| %.2f", case, np.abs(got - ref).max(),
                np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
