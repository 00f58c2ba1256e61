"""Mixture-of-experts conversion for :class:`~dynaquant.exporters.hf_source.HFCheckpointSource`.

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
and :meth:`StackedExperts.read` stacks the per-expert tensors, reading them one at a time.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from gguf import GGUFWriter

from .gguf_source import SourceTensor

logger = logging.getLogger(__name__)

# per-expert parameter names on disk: (layer, experts module prefix, expert, projection)
_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
# Mixtral's w1/w3/w2 are gate/up/down (MixtralBlockSparseTop2MLP: w2(act(w1 x) * w3 x))
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}

# GGUF names of MoE router tensors llama.cpp keeps in F32 (the converter's and llama-quantize's rule)
ROUTER_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_inp_shexp.weight")


def canonical_expert_name(layer: int, proj: str) -> str:
    """``model.layers.{layer}.mlp.experts.{proj}_proj.weight``, the hf_name of a stacked expert
    tensor whatever the architecture (``proj`` is ``"gate"``, ``"up"`` or ``"down"``)."""
    return f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"


def stacked_gguf_name(layer: int, proj: str, suffix: str = "weight") -> str:
    """``blk.{layer}.ffn_{proj}_exps.{suffix}``."""
    return f"blk.{layer}.ffn_{proj}_exps.{suffix}"


@dataclass(frozen=True)
class ExpertStack:
    """How one stacked tensor is read: the per-expert HF names, expert order.

    Attributes:
        tensor: the stacked tensor, shape ``(n_expert, rows, row_size)``.
        members: HF names of experts ``0 .. n_expert-1``, each of shape ``(rows, row_size)``.
    """

    tensor: SourceTensor
    members: tuple[str, ...]


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


def read_stack(stack: ExpertStack, read_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The stacked float32 tensor of shape ``stack.tensor.shape``, reading one expert at a time
    with ``read_hf(hf_name) -> tensor``.

    Raises:
        ValueError: an expert read back in another shape.
    """
    out = torch.empty(stack.tensor.shape, dtype=torch.float32)
    for e, name in enumerate(stack.members):
        x = read_hf(name)
        if tuple(x.shape) != tuple(out.shape[1:]):
            raise ValueError(f"{name}: read shape {tuple(x.shape)}, expected {tuple(out.shape[1:])}")
        out[e] = x
    return out


def is_router(gguf_name: str) -> bool:
    """True for router tensors (``ffn_gate_inp``, ``ffn_gate_inp_shexp``), which stay F32."""
    return gguf_name.endswith(ROUTER_SUFFIXES)


def _first(hp: dict, keys: Iterable[str]):
    for k in keys:
        if hp.get(k) is not None:
            return hp[k]
    return None


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
