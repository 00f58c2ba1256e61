"""Mixture-of-experts conversion for :class:`~dynaquant.sources.hf.HFCheckpointSource`.

Spec: llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/qwen.py`` ``Qwen2MoeModel``/
``Qwen3MoeModel``, ``conversion/llama.py`` ``LlamaModel`` for Mixtral, ``conversion/base.py``
``TextModel.set_gguf_parameters`` for the ``expert_*`` keys); ``src/llama-model.cpp`` and
``src/models/*.cpp`` for what llama.cpp loads.

Routed experts are stored per expert on disk by transformers
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``; Mixtral
``model.layers.{i}.block_sparse_moe.experts.{e}.w1/w2/w3.weight``). llama.cpp wants one 3-D
tensor per projection: ``blk.{i}.ffn_{gate,up,down}_exps.weight`` of torch shape
``(n_expert, rows, row_size)`` (gate/up ``(E, I, H)``, down ``(E, H, I)``), expert ``e`` at
index ``e``. Those :class:`SourceTensor` carry the canonical name of the in-memory experts
module, ``model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight``, for every architecture,
and :meth:`ExpertStack.read` stacks the per-expert tensors, reading them one at a time.

Other GGUF tensors that are not a plain rename are :class:`Composite` too: DeepSeek's MLA
``kv_b_proj`` split into ``attn_k_b``/``attn_v_b`` (:class:`KvBSplit`, ``conversion/deepseek.py``)
and gpt-oss's fused, interleaved experts (:class:`FusedExperts`, ``conversion/gpt_oss.py``).
Architecture keys: :func:`add_moe_hparams` (all), :func:`add_deepseek2_hparams`,
:func:`add_gpt_oss_hparams`.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from gguf import GGUFWriter

from dynaquant.names import is_router  # noqa: F401 - re-exported for the HF source
from dynaquant.sources.gguf import SourceTensor
from dynaquant.sources.release import dequant_mxfp4

logger = logging.getLogger(__name__)

# per-expert parameter names on disk: (layer, experts module prefix, expert, projection)
_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
# Mixtral's w1/w3/w2 are gate/up/down (MixtralBlockSparseTop2MLP: w2(act(w1 x) * w3 x))
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def canonical_expert_name(layer: int, proj: str) -> str:
    """``model.layers.{layer}.mlp.experts.{proj}_proj.weight``, the hf_name of a stacked expert
    tensor whatever the architecture (``proj`` is ``"gate"``, ``"up"`` or ``"down"``)."""
    return f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"


def stacked_gguf_name(layer: int, proj: str, suffix: str = "weight") -> str:
    """``blk.{layer}.ffn_{proj}_exps.{suffix}``."""
    return f"blk.{layer}.ffn_{proj}_exps.{suffix}"


ReadHF = Callable[[str], torch.Tensor]


class Composite:
    """A GGUF tensor built from checkpoint tensors (stacked, split or transposed).

    Attributes:
        tensor: the GGUF tensor it produces.
        consumes: the checkpoint tensor names it reads (not written on their own).
    """

    tensor: SourceTensor
    consumes: tuple[str, ...]

    def read(self, read_hf: ReadHF) -> torch.Tensor:
        """The float32 tensor of shape ``self.tensor.shape``, from ``read_hf(hf_name)``."""
        raise NotImplementedError


def _check(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: read shape {tuple(x.shape)}, expected {tuple(shape)}")
    return x.contiguous()


@dataclass(frozen=True)
class ExpertStack(Composite):
    """Per-expert 2-D tensors stacked along a new first axis.

    Attributes:
        tensor: the stacked tensor, shape ``(n_expert, rows, row_size)``.
        members: HF names of experts ``0 .. n_expert-1``, each of shape ``(rows, row_size)``.
    """

    tensor: SourceTensor
    members: tuple[str, ...]

    @property
    def consumes(self) -> tuple[str, ...]:
        return self.members

    def read(self, read_hf: ReadHF) -> torch.Tensor:
        """Stacked float32 ``(n_expert, rows, row_size)``, one expert read at a time.

        Raises:
            ValueError: an expert read back in another shape.
        """
        out = torch.empty(self.tensor.shape, dtype=torch.float32)
        for e, name in enumerate(self.members):
            out[e] = _check(name, read_hf(name), self.tensor.shape[1:])
        return out


def stack_per_expert(
    shapes: dict[str, tuple[int, ...]], n_layers: int, source_id: str
) -> tuple[list[ExpertStack], set[str]]:
    """Group per-expert parameters into stacked tensors.

    Args:
        shapes: every HF tensor name of the checkpoint -> its shape.
        n_layers: ``num_hidden_layers``; experts of layers beyond it (MTP) are left alone.
        source_id: the folder, for error messages.
    Returns:
        (the stacks in (layer, gate/up/down) order, the HF names they consume).
    Raises:
        ValueError: a layer's expert indices are not ``0..E-1``, or experts differ in shape.
    """
    groups: dict[tuple[int, str], dict[int, str]] = {}
    for name in shapes:
        m = _PER_EXPERT.match(name)
        if m is None or int(m.group(1)) >= n_layers:
            continue
        layer, expert, proj = int(m.group(1)), int(m.group(3)), _PROJ[m.group(4)]
        groups.setdefault((layer, proj), {})[expert] = name
    stacks: list[ExpertStack] = []
    used: set[str] = set()
    order = {"gate": 0, "up": 1, "down": 2}
    for (layer, proj), by_expert in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        n = len(by_expert)
        if sorted(by_expert) != list(range(n)):
            raise ValueError(f"{source_id}: layer {layer} {proj} experts are not numbered 0..{n - 1}: {sorted(by_expert)}")
        members = tuple(by_expert[e] for e in range(n))
        member_shapes = {shapes[m] for m in members}
        if len(member_shapes) != 1:
            raise ValueError(f"{source_id}: layer {layer} {proj} experts differ in shape: {sorted(member_shapes)}")
        rows, row_size = member_shapes.pop()
        st = SourceTensor(stacked_gguf_name(layer, proj), canonical_expert_name(layer, proj), (n, rows, row_size), True)
        stacks.append(ExpertStack(st, members))
        used.update(members)
    return stacks, used


def _first(hp: dict, keys: Iterable[str]):
    for k in keys:
        if hp.get(k) is not None:
            return hp[k]
    return None


def expert_count(hp: dict) -> int:
    """Routed experts per MoE layer of a config (0 for a dense model)."""
    return int(_first(hp, ("num_local_experts", "num_experts", "n_routed_experts")) or 0)


def add_moe_hparams(w: GGUFWriter, arch: str, hp: dict) -> None:
    """The ``{arch}.expert_*`` keys, as ``TextModel.set_gguf_parameters`` and the MoE model
    classes of the converter write them (nothing is written for a dense config).

    Keys: expert_count (``num_local_experts``/``num_experts``/``n_routed_experts``),
    expert_used_count (``num_experts_per_tok``), expert_group_count / expert_group_used_count
    (``n_group``/``topk_group``), expert_gating_func (``scoring_func``),
    expert_feed_forward_length (``moe_intermediate_size``) and
    expert_shared_feed_forward_length (``shared_expert_intermediate_size``).

    Raises:
        ValueError: an unknown ``scoring_func``.
    """
    import gguf

    if (n := _first(hp, ("num_local_experts", "num_experts", "n_routed_experts"))) is not None:
        w.add_expert_count(int(n))
    if (n := _first(hp, ("num_experts_per_tok", "num_experts_per_token"))) is not None:
        w.add_expert_used_count(int(n))
    if (n := hp.get("n_group")) is not None:
        w.add_expert_group_count(int(n))
    if (n := hp.get("topk_group")) is not None:
        w.add_expert_group_used_count(int(n))
    if (f := _first(hp, ("scoring_func", "score_function"))) is not None:
        funcs = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
        if f not in funcs:
            raise ValueError(f"unsupported expert scoring function {f!r}")
        w.add_expert_gating_func(funcs[f])
    if arch in ("qwen2moe", "qwen3moe"):
        if (n := hp.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(int(n))
        if (n := hp.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(int(n))


# -- DeepSeek-V2/V3 (GGUF ``deepseek2``): MLA ------------------------------------------------


@dataclass(frozen=True)
class KvBSplit(Composite):
    """MLA's ``kv_b_proj`` split for the absorbed attention llama.cpp runs (the converter's
    ``DeepseekV2Model.modify_tensors``).

    ``kv_b_proj.weight`` is ``(n_head * (qk_nope + v_head), kv_lora_rank)``; viewed as
    ``(n_head, qk_nope + v_head, kv_lora_rank)`` and split on the middle axis it gives
    ``attn_k_b.weight`` = the first ``qk_nope`` rows of each head, transposed to
    ``(n_head, kv_lora_rank, qk_nope)``, and ``attn_v_b.weight`` = the last ``v_head`` rows,
    ``(n_head, v_head, kv_lora_rank)``.

    Attributes:
        tensor: ``blk.{i}.attn_k_b.weight`` or ``blk.{i}.attn_v_b.weight``.
        source: the checkpoint's ``model.layers.{i}.self_attn.kv_b_proj.weight``.
        part: ``"k"`` or ``"v"``.
        n_head, qk_nope, v_head: ``num_attention_heads``, ``qk_nope_head_dim``, ``v_head_dim``.
    """

    tensor: SourceTensor
    source: str
    part: str
    n_head: int
    qk_nope: int
    v_head: int

    @property
    def consumes(self) -> tuple[str, ...]:
        return (self.source,)

    def read(self, read_hf: ReadHF) -> torch.Tensor:
        x = read_hf(self.source)
        rank = x.shape[-1]
        x = _check(self.source, x, (self.n_head * (self.qk_nope + self.v_head), rank))
        k_b, v_b = x.view(self.n_head, self.qk_nope + self.v_head, rank).split([self.qk_nope, self.v_head], dim=1)
        return (k_b.transpose(1, 2) if self.part == "k" else v_b).contiguous()


def _deepseek_composites(shapes: dict[str, tuple[int, ...]], hp: dict, n_layers: int) -> list[Composite]:
    n_head, nope, v = int(hp["num_attention_heads"]), int(hp["qk_nope_head_dim"]), int(hp["v_head_dim"])
    out: list[Composite] = []
    for i in range(n_layers):
        name = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        if name not in shapes:
            continue
        rank = shapes[name][-1]
        # hf_name: the converter's intermediate names (gguf-py maps them to attn_k_b/attn_v_b)
        k = SourceTensor(f"blk.{i}.attn_k_b.weight", f"model.layers.{i}.self_attn.k_b_proj.weight", (n_head, rank, nope), True)
        vt = SourceTensor(f"blk.{i}.attn_v_b.weight", f"model.layers.{i}.self_attn.v_b_proj.weight", (n_head, v, rank), True)
        out += [KvBSplit(k, name, "k", n_head, nope, v), KvBSplit(vt, name, "v", n_head, nope, v)]
    return out


def add_deepseek2_hparams(w: GGUFWriter, hp: dict, hf_arch: str | None) -> None:
    """The ``deepseek2.*`` keys of ``DeepseekV2Model.set_gguf_parameters`` beyond the common
    ones: MLA as MQA (head_count_kv 1; key_length ``kv_lora_rank + qk_rope_head_dim``,
    value_length ``kv_lora_rank``, key/value_length_mla the decompressed head sizes),
    q/kv LoRA ranks, leading_dense_block_count (``first_k_dense_replace``),
    expert_feed_forward_length, expert_shared_count, expert_weights_scale
    (``routed_scaling_factor``), expert_weights_norm (``norm_topk_prob``),
    rope_dimension_count (``qk_rope_head_dim``) and the YaRN log multiplier
    (``0.1 * mscale_all_dim``, as the converter writes it for llama.cpp to divide back).

    DeepSeek-V3 always routes with a sigmoid; transformers' config does not keep
    ``scoring_func``, so for ``DeepseekV3ForCausalLM`` the gating function defaults to sigmoid
    (llama.cpp would otherwise assume softmax).
    """
    import gguf

    has_moe = hp.get("n_routed_experts") is not None
    dense = hp.get("first_k_dense_replace")
    if dense is None:
        dense = 0 if has_moe else int(hp["num_hidden_layers"])
    w.add_leading_dense_block_count(int(dense))
    kv_lora_rank = int(hp.get("kv_lora_rank") or 512)
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(int(hp["q_lora_rank"]))
    w.add_head_count_kv(1)
    w.add_kv_lora_rank(kv_lora_rank)
    w.add_key_length(kv_lora_rank + int(hp["qk_rope_head_dim"]))
    w.add_value_length(kv_lora_rank)
    w.add_key_length_mla(int(hp["qk_nope_head_dim"]) + int(hp["qk_rope_head_dim"]))
    w.add_value_length_mla(int(hp["v_head_dim"]))
    w.add_expert_feed_forward_length(int(_first(hp, ("moe_intermediate_size", "intermediate_size"))))
    w.add_expert_shared_count(int(hp.get("n_shared_experts") or 0))
    if (scale := hp.get("routed_scaling_factor")) is not None:
        w.add_expert_weights_scale(float(scale))
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if _first(hp, ("scoring_func", "score_function")) is None and hf_arch == "DeepseekV3ForCausalLM":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(int(hp["qk_rope_head_dim"]))
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    if (mscale_all := rope.get("mscale_all_dim")) is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all))


# -- gpt-oss (GGUF ``gpt-oss``): fused, interleaved, transposed experts ------------------------


@dataclass(frozen=True)
class FusedExperts(Composite):
    """One of gpt-oss's fused expert tensors as llama.cpp's layout (the converter's
    ``GptOssModel.modify_tensors`` and ``generate_extra_tensors``).

    Checkpoint, unquantized: ``mlp.experts.gate_up_proj`` ``(E, H, 2I)`` with gate and up in
    alternating columns (gate at even, up at odd), ``gate_up_proj_bias`` ``(E, 2I)`` likewise,
    ``down_proj`` ``(E, I, H)``, ``down_proj_bias`` ``(E, H)``; weights are transposed to
    ``(E, I, H)`` (gate/up) and ``(E, H, I)`` (down). MXFP4 (the release checkpoints):
    ``gate_up_proj_blocks``/``_scales`` decode to ``(E, 2I, H)`` with gate and up in
    alternating rows, ``down_proj_blocks``/``_scales`` to ``(E, H, I)``
    (:func:`~dynaquant.sources.release.dequant_mxfp4`); nothing is transposed.

    Attributes:
        tensor: ``blk.{i}.ffn_{gate,up,down}_exps.{weight,bias}``.
        source: the fused checkpoint tensor (``*_blocks`` for MXFP4).
        part: ``"gate"``, ``"up"`` or ``"down"``.
        scales: the MXFP4 ``*_scales`` tensor, or None for an unquantized source.
    """

    tensor: SourceTensor
    source: str
    part: str
    scales: str | None = None

    @property
    def consumes(self) -> tuple[str, ...]:
        return (self.source,) if self.scales is None else (self.source, self.scales)

    def read(self, read_hf: ReadHF) -> torch.Tensor:
        if self.scales is not None:
            x = dequant_mxfp4(read_hf(self.source), read_hf(self.scales))  # (E, rows, K)
        else:
            x = read_hf(self.source)
            if self.tensor.gguf_name.endswith(".weight"):
                x = x.transpose(-1, -2)
        # gate and up alternate along axis 1: rows of (E, 2I, H) weights, entries of (E, 2I) biases
        if self.part == "gate":
            x = x[:, 0::2]
        elif self.part == "up":
            x = x[:, 1::2]
        return _check(self.source, x, self.tensor.shape)


def _add_fused(out: list[Composite], layer: int, proj: str, suffix: str, shape: tuple[int, ...], source: str,
               scales: str | None = None) -> None:
    hf = canonical_expert_name(layer, proj) if suffix == "weight" else f"model.layers.{layer}.mlp.experts.{proj}_proj.bias"
    st = SourceTensor(stacked_gguf_name(layer, proj, suffix), hf, shape, suffix == "weight")
    out.append(FusedExperts(st, source, proj, scales))


def _gpt_oss_composites(shapes: dict[str, tuple[int, ...]], n_layers: int, source_id: str) -> list[Composite]:
    out: list[Composite] = []
    for i in range(n_layers):
        pre = f"model.layers.{i}.mlp.experts."
        add = functools.partial(_add_fused, out, i)
        if pre + "gate_up_proj_blocks" in shapes:  # MXFP4: (E, 2I, G, 16) -> (E, 2I, G * 32)
            e, i2, g, _ = shapes[pre + "gate_up_proj_blocks"]
            for proj in ("gate", "up"):
                add(proj, "weight", (e, i2 // 2, g * 32), pre + "gate_up_proj_blocks", pre + "gate_up_proj_scales")
        elif pre + "gate_up_proj" in shapes:
            e, h, i2 = shapes[pre + "gate_up_proj"]
            for proj in ("gate", "up"):
                add(proj, "weight", (e, i2 // 2, h), pre + "gate_up_proj")
        else:
            continue
        if pre + "gate_up_proj_bias" in shapes:
            e, i2 = shapes[pre + "gate_up_proj_bias"]
            for proj in ("gate", "up"):
                add(proj, "bias", (e, i2 // 2), pre + "gate_up_proj_bias")
        if pre + "down_proj_blocks" in shapes:  # MXFP4: (E, H, G, 16) -> (E, H, G * 32)
            e, h, g, _ = shapes[pre + "down_proj_blocks"]
            add("down", "weight", (e, h, g * 32), pre + "down_proj_blocks", pre + "down_proj_scales")
        elif pre + "down_proj" in shapes:
            e, n_ff_d, h = shapes[pre + "down_proj"]
            add("down", "weight", (e, h, n_ff_d), pre + "down_proj")
        if pre + "down_proj_bias" in shapes:
            add("down", "bias", shapes[pre + "down_proj_bias"], pre + "down_proj_bias")
        missing = [n for c in out for n in c.consumes if n not in shapes]
        if missing:
            raise ValueError(f"{source_id}: layer {i} gpt-oss experts lack {', '.join(missing)}")
    return out


def add_gpt_oss_hparams(w: GGUFWriter, hp: dict) -> None:
    """``gpt-oss.attention.sliding_window`` and ``expert_feed_forward_length``
    (``intermediate_size``), as ``GptOssModel.set_gguf_parameters``. llama.cpp's gpt-oss
    graph hard-codes the rest: every other layer sliding (layer 0 first, pattern 2, as
    transformers' default ``layer_types``), SwiGLU with alpha 1.702 and limit 7.0.

    Raises:
        ValueError: ``layer_types`` that llama.cpp's fixed pattern would not reproduce, or a
            SwiGLU alpha/limit other than 1.702/7.0.
    """
    w.add_sliding_window(int(hp["sliding_window"]))
    w.add_expert_feed_forward_length(int(hp["intermediate_size"]))
    types = hp.get("layer_types")
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(int(hp["num_hidden_layers"]))]
    if types is not None and list(types) != want:
        raise ValueError(f"gpt-oss layer_types {types} differ from llama.cpp's fixed sliding/full alternation")
    for key, value in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        if hp.get(key) is not None and abs(float(hp[key]) - value) > 1e-6:
            raise ValueError(f"gpt-oss {key}={hp[key]}: llama.cpp hard-codes {value}")


# -- entry points ------------------------------------------------------------------------------


def composite_tensors(arch: str, shapes: dict[str, tuple[int, ...]], hp: dict, n_layers: int,
                      source_id: str) -> list[Composite]:
    """Every GGUF tensor of the checkpoint that is not a plain rename: stacked per-expert
    tensors (any architecture), DeepSeek's split ``kv_b_proj``, gpt-oss's fused experts.

    Raises:
        ValueError: see :func:`stack_per_expert`; gpt-oss experts stored in MXFP4.
    """
    out: list[Composite] = list(stack_per_expert(shapes, n_layers, source_id)[0])
    if arch == "deepseek2":
        out += _deepseek_composites(shapes, hp, n_layers)
    elif arch == "gpt-oss":
        out += _gpt_oss_composites(shapes, n_layers, source_id)
    return out


def memory_name(hf_arch: str | None, hf_name: str) -> str:
    """The parameter's name in the transformers model (``named_parameters``) where it differs from
    the checkpoint's: Mixtral's ``block_sparse_moe.gate.weight`` (on disk) is
    ``mlp.gate.weight`` in transformers 5. :class:`SourceTensor` ``hf_name`` uses this name."""
    if hf_arch == "MixtralForCausalLM":
        return hf_name.replace(".block_sparse_moe.", ".mlp.")
    return hf_name


def lookup_name(hf_name: str) -> str:
    """The name gguf-py's ``TensorNameMap`` knows for a checkpoint tensor (the converter's
    renames): ``*.e_score_correction_bias`` -> ``*.e_score_correction.bias`` (GGUF
    ``exp_probs_b.bias``), gpt-oss ``self_attn.sinks`` -> ``self_attn.sinks.weight``."""
    if hf_name.endswith("e_score_correction_bias"):
        return hf_name[: -len("_bias")] + ".bias"
    if hf_name.endswith(".self_attn.sinks"):
        return hf_name + ".weight"
    return hf_name
