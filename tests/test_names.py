"""dynaquant.names.TensorName, the one parser of tensor names, against the ad hoc parsers it replaced.

Oracle: copies of the old regexes, run over every tensor name (GGUF and HF) of the default model, of the tiny
MoE checkpoints of test_moe_gguf and of the tiny Qwen2-VL checkpoint of test_vl_gguf (text and full VL
sources), plus edge cases; the new helpers must give the old results on all of them.
"""

from __future__ import annotations

import re

import pytest
from test_moe_gguf import MOE, _tiny_moe
from test_vl_gguf import _tiny_vl_checkpoint
from test_vl_runtime import _build

from dynaquant.analysis.report.plots import split_name as _split_name
from dynaquant.analysis.report.schema import tensor_group, tensor_kind
from dynaquant.analysis.superweights import down_proj_layer
from dynaquant.exporters.gguf.inspect import inspect_gguf
from dynaquant.names import TensorName
from dynaquant.pipeline.analysis_report import layer_of, layer_of_module
from dynaquant.quant.plan import TensorInfo
from dynaquant.quant.planner import tie_groups
from dynaquant.sources.hf_vl_full import vision_plan_name

EDGE = ["blk.3.", "blk.3..weight", "blk.3.x.weight.weight", "blk.03.attn_q.bias", "blk.3", ".weight", ".bias", "x.bias",
        "v.blk.2.attn_q.weight", "v.global.blk.1.ffn_up.bias", "v.blk.2.", "v.patch_embd.weight", "mm.0.weight", "mm.2.bias",
        "token_embd.weight", "output_norm.weight", "rope_freqs.weight", "blk.1.exp_probs_b.bias", "blk.10.ffn_gate_inp.weight",
        "model.layers.5.weight", "layers.2.mlp.down_proj", "model.visual.blocks.3.mlp.down_proj", "a.layers.7.mlp.down_proj",
        "model.vision_tower.encoder.layers.1.mlp.down_proj", "model.layers.3.",
        "model.layers.12.mlp.experts.3.down_proj.weight", "lm_head.weight", ""]


@pytest.fixture(scope="module")
def names(tmp_path_factory) -> tuple[list[str], list[str]]:
    """(GGUF names, HF names) of every source the tests build."""
    from safetensors import safe_open

    from dynaquant.sources.checkpoint import default_model_path
    from dynaquant.sources.gguf import open_gguf_source
    from dynaquant.sources.hf_vl_full import open_vl_full_source
    from dynaquant.sources.open import open_hf_source

    gg, hf = list(EDGE), list(EDGE)
    sources = [open_gguf_source(default_model_path())]
    folders = []
    for case in MOE:
        folders.append(tmp_path_factory.mktemp(case))
        _tiny_moe(folders[-1], case)
        sources.append(open_hf_source(folders[-1]))
    vl = tmp_path_factory.mktemp("qwen2vl")
    _tiny_vl_checkpoint(vl)
    folders.append(vl)
    sources += [open_hf_source(vl), open_vl_full_source(vl)]
    for arch in ("llava", "mllama"):
        folders.append(_build(arch, tmp_path_factory.mktemp(arch)))
        sources.append(open_vl_full_source(folders[-1]))
    for src in sources:
        for t in src.tensors():
            gg.append(t.gguf_name)
            hf += [t.hf_name] if t.hf_name else []
    for folder in folders:
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                hf += list(h.keys())
    assert any(n.startswith("v.blk.") for n in gg) and any(n.startswith("mm.") for n in gg)
    assert any(".experts.0." in n for n in hf) and any("_exps" in n for n in gg)
    return gg, hf


def _old_tensor_kind(name: str) -> str:
    m = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.weight|\.bias)?$").match(name)
    if m:
        return m.group(2)
    return re.sub(r"\.(weight|bias)$", "", name)


def _old_split_name(name: str) -> tuple[int | None, str]:
    m = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.weight)?$").match(name)
    if m:
        return int(m.group(1)), m.group(2)
    return None, re.sub(r"\.weight$", "", name)


def _old_plan_layer(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _old_inspect_key(name: str) -> str:
    m = re.match(r"(blk\.\d+)\.", name)
    return m.group(1) if m else "other"


def _old_hf_layer(name: str) -> int | None:
    m = re.compile(r"^model\.layers\.(\d+)\.").match(name)
    return int(m.group(1)) if m else None


def test_examples():
    t = TensorName.from_gguf("blk.3.ffn_down_exps.weight")
    assert (t.tower, t.block, t.kind, t.expert, t.suffix, t.prefix) == ("text", 3, "ffn_down_exps", None, "weight", "blk.3")
    t = TensorName.from_gguf("v.global.blk.1.ffn_up.bias")
    assert (t.tower, t.block, t.kind, t.global_stack, t.suffix) == ("vision", 1, "ffn_up", True, "bias")
    assert TensorName.from_gguf("mm.0.weight").tower == "projector"
    assert (TensorName.from_gguf("token_embd.weight").block, TensorName.from_gguf("token_embd.weight").kind) == (None, "token_embd")
    t = TensorName.from_hf("model.layers.3.mlp.experts.5.down_proj.weight")
    assert (t.tower, t.block, t.kind, t.expert) == ("text", 3, "ffn_down_exps", 5)
    assert TensorName.from_hf("model.layers.3.mlp.down_proj.weight").kind == "ffn_down"
    t = TensorName.from_hf("model.visual.blocks.2.attn.qkv.weight")
    assert (t.tower, t.block) == ("vision", 2)
    assert TensorName.from_hf("model.multi_modal_projector.linear_1.weight").tower == "projector"
    assert TensorName.from_hf("lm_head.weight").kind == "output"


def test_report_schema_tensor_kind_and_group(names):
    gg, _ = names
    for n in gg:
        assert tensor_kind(n) == _old_tensor_kind(n), n
    group = {n: tensor_group(n) for n in gg}
    assert group == {n: _old_group(n) for n in gg}


def _old_group(name: str) -> str:
    kind = _old_tensor_kind(name)
    for test, g in ((kind.endswith("norm"), "norm"), (kind.startswith("attn"), "attn"), (kind.startswith("ffn"), "ffn"),
                    (kind == "token_embd", "embd"), (kind == "output", "output")):
        if test:
            return g
    return "other"


def test_report_html_split_name(names):
    for n in names[0]:
        assert _split_name(n) == _old_split_name(n), n


def test_plan_tensor_layer(names):
    for n in names[0]:
        assert TensorInfo(n, None, (4, 4)).layer == _old_plan_layer(n), n


def test_inspect_layer_key(names):
    for n in names[0]:
        t = TensorName.from_gguf(n)
        assert (t.prefix if t.tower == "text" and t.block is not None else "other") == _old_inspect_key(n), n


def test_hf_source_layer(names):
    for n in names[1]:
        new = TensorName.from_hf(n).block if n.startswith("model.layers.") else None
        assert new == _old_hf_layer(n), n


def _old_layer_of_module(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _old_down_layer(name: str) -> int | None:
    m = re.compile(r"^(?:.*\.)?layers\.(\d+)\.mlp\.down_proj$").match(name)
    return int(m.group(1)) if m else None


def _old_tie_group(name: str) -> str | None:
    m = re.match(r"^(blk\.\d+\.)(attn_q|attn_k|attn_v|ffn_gate|ffn_up|ffn_gate_exps|ffn_up_exps)\.weight$", name)
    if m is None:
        return None
    if m.group(2).endswith("_exps"):
        return m.group(1) + "ffn_gate_up_exps"
    return m.group(1) + ("attn_qkv" if m.group(2).startswith("attn") else "ffn_gate_up")


def _modules(hf_names: list[str]) -> list[str]:
    out = list(hf_names)
    for n in hf_names:
        parts = n.split(".")
        out += [".".join(parts[:i]) for i in range(1, len(parts))]
    return sorted(set(out))


def test_analyze_layers(names):
    gg, hf = names
    for n in gg:
        if n.startswith("blk.") and n.count(".") >= 2 and n.split(".")[1].isdigit():  # old _layer: int of the 2nd field
            assert layer_of(n) == int(n.split(".")[1]), n
        elif not n.startswith("blk."):
            assert layer_of(n) is None, n
    for n in _modules(hf):
        assert layer_of_module(n) == _old_layer_of_module(n), n


def test_superweight_down_proj_layer(names):
    for n in _modules(names[1]):
        assert down_proj_layer(n) == _old_down_layer(n), n


def test_planner_tie_groups(names):
    for n in names[0]:
        assert tie_groups(TensorInfo(n, None, (4, 4))) == _old_tie_group(n), n


def test_inspect_gguf_layers():
    from dynaquant.sources.checkpoint import default_model_path

    s = inspect_gguf(default_model_path())
    assert sorted(s.layers) == sorted({_old_inspect_key(t.name) for t in s.tensors})


def _old_vision_plan_name_layer(rest: str):
    """The layer branch of hf_vl_full.vision_plan_name before TensorName (None: not a layer parameter)."""
    m = re.compile(r"^(?:(global_transformer)\.|[\w.]*?)(?:layers|blocks)\.(\d+)\.(.+)$").match(rest)
    if not m:
        return None
    from dynaquant.sources.hf_vl_full import _VISION_LEAF

    leaf, _, suffix = m.group(3).rpartition(".")
    stack = "v.global.blk" if m.group(1) else "v.blk"
    if not leaf:
        return f"{stack}.{m.group(2)}.{_VISION_LEAF.get(suffix, suffix)}"
    return f"{stack}.{m.group(2)}.{_VISION_LEAF.get(leaf, leaf.replace('.', '_'))}.{suffix}"


def test_vision_plan_name(names):
    prefixes = ("model.visual.", "model.vision_tower.", "model.vision_model.")
    params = [n for n in names[1] if n.startswith(prefixes) and not n.startswith("model.visual.merger.")]
    params += ["model.vision_model.global_transformer.layers.3.gate_attn",
               "model.vision_model.global_transformer.x.layers.1.y.weight", "model.vision_tower.encoder.layers.03.mlp.fc2.weight"]
    assert any("global_transformer" in n for n in params) and any("vision_tower" in n for n in params)
    for p in params:
        rest = p[len(next(x for x in prefixes if p.startswith(x))):]
        old = _old_vision_plan_name_layer(rest)
        assert vision_plan_name(p) == (old if old is not None else "v." + rest), p
