"""DynaLinear under ``torch.compile``: one ``dynaquant::linear`` node a call (dynaquant.runtime.custom_ops), so a
quantized model compiles as one graph (``fullgraph=True``), fused q/k/v and gate/up stay one call each, and
transformers' ``generate`` with a static cache compiles it whole. On the CPU with a stand-in kernel op (the same
contract as the Triton kernels' op: ``prepare`` / ``linear``), and with the torch reference path."""

from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dynaquant.quant.runtime import encode, to_compressed_tensors
from dynaquant.runtime import custom_ops
from dynaquant.runtime.linear import DynaLinear, fuse_projections
from dynaquant.runtime.moe import DynaExperts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

IDS = torch.tensor([[1, 5, 9, 200, 7], [3, 4, 5, 6, 7]])


def _model(dtype: torch.dtype, fmt: str = "INT4_G64") -> LlamaForCausalLM:
    """A 2-layer Llama whose every linear layer (lm_head too) is a prepared DynaLinear in ``fmt``."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            lin = DynaLinear(mod.in_features, mod.out_features, fmt, dtype=dtype)
            for k, v in to_compressed_tensors(encode(mod.weight.detach().float(), fmt)).items():
                getattr(lin, k).copy_(v)
            lin.prepare()
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, lin)
    return model


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_model_compiles_as_one_graph_with_one_call_a_group(stand_in_kernel, backend):
    """fullgraph=True holds; the compiled model makes the same kernel calls as eager (q/k/v one, gate/up one:
    9 for 2 layers and lm_head), and its logits equal eager's (bit for bit through aot_eager; Inductor computes
    the norms in its own order). Batch 2 x 5 tokens: the members' slices are strided views."""
    model = _model(torch.bfloat16)
    assert fuse_projections(model) == 4
    with torch.no_grad():
        stand_in_kernel.clear()
        ref = model(IDS).logits
        eager_calls = list(stand_in_kernel)
        torch._dynamo.reset()
        breaks = _graph_breaks()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        compiled(IDS)
        stand_in_kernel.clear()
        out = compiled(IDS).logits
    assert eager_calls == [256, 128, 512, 128] * 2 + [320]  # q/k/v, o, gate/up, down; lm_head
    assert sorted(stand_in_kernel) == sorted(eager_calls)
    assert _graph_breaks() == breaks
    groups = {m._fused[0] for m in model.modules() if isinstance(m, DynaLinear) and m._fused is not None}
    assert len(groups) == 4 and all(g._traced is None for g in groups)  # the trace-time record is cleared
    if backend == "aot_eager":
        assert torch.equal(out, ref)
    else:
        assert (out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_reference_path_compiles_as_one_graph():
    """No kernel (CPU float32: the torch reference): one graph as well, equal to eager."""
    model = _model(torch.float32, "INT3_G32_ASYM")
    with torch.no_grad():
        ref = model(IDS).logits
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(IDS).logits
    assert torch.equal(out, ref)


def test_static_cache_generate_compiles_whole():
    """transformers' generate with a static cache, compiled with fullgraph=True (its auto-compile path, which on
    CUDA takes mode reduce-overhead): one graph, the same greedy tokens as without compiling."""
    from transformers.generation.configuration_utils import CompileConfig

    model = _model(torch.float32)
    ids = IDS[:1]
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static", disable_compile=True)
    torch._dynamo.reset()
    breaks = _graph_breaks()
    cc = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cc._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static", compile_config=cc)
    assert torch.equal(out, ref) and _graph_breaks() == breaks


def test_op_fake_matches_real_and_copies_are_layers_of_their_own():
    """opcheck (fake vs real, schema); a deep copy gets its own handle; a deleted layer's handle is refused."""
    lin = _model(torch.float32).model.layers[0].mlp.down_proj
    x = torch.randn(3, 256)
    torch.library.opcheck(torch.ops.dynaquant.linear.default, (x, lin._handle, 128),
                          test_utils=("test_schema", "test_faketensor"))
    dup = copy.deepcopy(lin)
    assert dup._handle != lin._handle
    with torch.no_grad():
        torch.nn.init.zeros_(dup.weight_scale)  # (the copy's weight only: every output 0)
        dup.prepare()
        assert torch.equal(torch.ops.dynaquant.linear(x, lin._handle, 128), lin(x))
        assert torch.equal(torch.ops.dynaquant.linear(x, dup._handle, 128), torch.zeros(3, 128))
    handle = dup._handle
    del dup
    gc.collect()
    with pytest.raises(RuntimeError, match=f"layer {handle} no longer exists"):
        torch.ops.dynaquant.linear(x, handle, 128)
    with pytest.raises(RuntimeError, match=r"returned \(3, 128\), not \(3, 64\)"):
        custom_ops.linear(x, lin._handle, 64)


def test_decode_benchmark_counts_no_graph_breaks(tmp_path):
    """benchmarks/decode.py's dry run compiled: every row says 0 graph breaks (DynaLinear layers included)."""
    import json

    import decode as bench

    out = tmp_path / "decode.json"
    assert bench.main(["--dry-run", "--compile", "yes", "--compile-mode", "default", "--batch", "1", "--steps", "2",
                       "--reps", "1", "--plans", "bf16,INT4_G128", "--prompt", "4", "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text()) if r["row"] == "decode"]
    assert [r["plan"] for r in rows] == ["bf16", "INT4_G128"] and all(r["graph_breaks"] == 0 for r in rows)


def test_moe_model_compiles_as_one_graph(tmp_path):
    """A loaded mixture-of-experts checkpoint (tiny gpt-oss, INT2 routed experts, the per-expert loop on the CPU):
    each experts layer is one ``dynaquant::experts`` node (the routing's data-dependent shapes stay inside it), so
    fullgraph=True holds; logits equal eager's."""
    import test_moe_runtime as moe_t

    import dynaquant
    from dynaquant.exporters.safetensors.writer import unquantized_linears, write_safetensors

    model = moe_t._direct_model("gpt_oss")
    weights = moe_t.checkpoint_weights(model)
    plan = moe_t._direct_plan(model, weights, bpw=moe_t.BPW["gpt_oss"])

    def enc(e, w):
        return moe_t.encode_experts(w, e.format, None) if w.ndim == 3 else encode(w, e.format)

    write_safetensors(tmp_path / "q", plan, weights, enc, model.config.to_dict(), progress=False,
                      ignore=unquantized_linears(model, plan))
    q = dynaquant.load(tmp_path / "q", device="cpu")
    ids = IDS[:1]
    with torch.no_grad():
        ref = q(ids).logits
        torch._dynamo.reset()
        out = torch.compile(q, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(out, ref)
    layer = next(m for m in q.modules() if isinstance(m, DynaExperts))
    hidden = torch.randn(3, layer.expert(0).gate_proj.in_features)
    index, weights = torch.tensor([[0, 1], [2, 3], [1, 1]]), torch.rand(3, 2)
    torch.library.opcheck(torch.ops.dynaquant.experts.default, (hidden, index, weights, layer._handle),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the Triton kernels compiled")
@pytest.mark.parametrize("fmt", ["INT4_G128", "MXFP4_G32"])
def test_cuda_compiled_model_matches_eager(fmt):
    """On CUDA with the Triton kernels: fused q/k/v and gate/up, compiled by Inductor with fullgraph=True, at 1
    and 5 tokens a sequence (the GEMV and the GEMM paths); logits close to eager's and the same greedy tokens."""
    model = _model(torch.bfloat16, fmt).cuda()
    for m in model.modules():
        if isinstance(m, DynaLinear):
            m.prepare()
    assert fuse_projections(model) == 4
    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        for ids in (IDS[:, :1], IDS):
            ref = model(ids.cuda()).logits.float()
            out = compiled(ids.cuda()).logits.float()
            assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
            assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name, kind", [
    ("_gemv_kernel", "dynaquant"), ("_gluon_gemm_kernel", "dynaquant"), ("_grouped_gemv_kernel", "dynaquant"),
    ("triton_poi_fused_add_mul_0", "inductor"), ("triton_red_fused__to_copy_mean_pow_1", "inductor"),
    ("triton_tem_fused_mm_2", "matmul"), ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matmul"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<...>>", "attention"),
    ("Memset (Device)", "other"),
])
def test_decode_profile_kinds(name, kind):
    """benchmarks/decode.py --profile's split of a step's kernels: ours, bf16 matmuls, attention, Inductor's."""
    import decode as bench

    assert bench.kernel_kind(name) == kind
