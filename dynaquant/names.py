"""Tensor names between Hugging Face checkpoints and GGUF (llama.cpp) files.

:class:`TensorName` is the one parser of what a name says (block, kind, expert, tower); the maps below
translate names.

The forward map (HF -> GGUF) is gguf-py's ``TensorNameMap``, the table llama.cpp's
``convert_hf_to_gguf.py`` uses; nothing is retyped here. The reverse map (GGUF -> HF) needs
one canonical HF name per GGUF tensor, which that table cannot give (it lists every alias
of every architecture), so :data:`CANONICAL_HF_MODULES` names the transformers modules of
the Llama family (Llama, Mistral, Qwen2, Qwen3), the MoE experts and routers (stacked experts
under the fused in-memory module's name, ``model.layers.{i}.mlp.experts.gate_proj``) and, in
:data:`ARCH_HF_BLOCK_MODULES`, the modules one architecture adds (Qwen2-MoE's shared expert,
DeepSeek's MLA, gpt-oss's router and sinks); the reverse map is built by running those names
through the forward map, so both directions always agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import gguf

# HF ``architectures[0]`` -> gguf architecture string, for the checkpoints we convert.
HF_ARCH_TO_GGUF: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "deepseek2",
    "GptOssForCausalLM": "gpt-oss",
    # language model only (hf_vl.py); the vision tower goes to an mmproj GGUF (mmproj.py)
    "Qwen2VLForConditionalGeneration": "qwen2vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2vl",
}

# Canonical transformers module names of the Llama family, global then per block
# (``{bid}`` is the block index). Qwen2 adds q/k/v biases (same modules, ".bias"),
# Qwen3 adds q_norm/k_norm; llama.cpp permutes nothing else.
CANONICAL_HF_MODULES: tuple[str, ...] = (
    "model.embed_tokens",
    "model.norm",
    "lm_head",
)
CANONICAL_HF_BLOCK_MODULES: tuple[str, ...] = (
    "model.layers.{bid}.input_layernorm",
    "model.layers.{bid}.self_attn.q_proj",
    "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj",
    "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.self_attn.q_norm",
    "model.layers.{bid}.self_attn.k_norm",
    "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.mlp.gate_proj",
    "model.layers.{bid}.mlp.up_proj",
    "model.layers.{bid}.mlp.down_proj",
    # mixture of experts: the stacked experts under the in-memory experts module's name (the
    # HF source's convention for every architecture), the router, shared experts
    "model.layers.{bid}.mlp.experts.gate_proj",
    "model.layers.{bid}.mlp.experts.up_proj",
    "model.layers.{bid}.mlp.experts.down_proj",
    "model.layers.{bid}.mlp.gate",
)
# Per-architecture block modules, looked up before the common ones (first name wins).
ARCH_HF_BLOCK_MODULES: dict[str, tuple[str, ...]] = {
    "qwen2moe": (
        "model.layers.{bid}.mlp.shared_expert.gate_proj",
        "model.layers.{bid}.mlp.shared_expert.up_proj",
        "model.layers.{bid}.mlp.shared_expert.down_proj",
        "model.layers.{bid}.mlp.shared_expert_gate",
    ),
    "deepseek2": (
        "model.layers.{bid}.self_attn.q_a_proj",
        "model.layers.{bid}.self_attn.q_a_layernorm",
        "model.layers.{bid}.self_attn.q_b_proj",
        "model.layers.{bid}.self_attn.kv_a_proj_with_mqa",
        "model.layers.{bid}.self_attn.kv_a_layernorm",
        # attn_k_b/attn_v_b: the converter's names for the two halves of kv_b_proj
        "model.layers.{bid}.self_attn.k_b_proj",
        "model.layers.{bid}.self_attn.v_b_proj",
        "model.layers.{bid}.mlp.shared_experts.gate_proj",
        "model.layers.{bid}.mlp.shared_experts.up_proj",
        "model.layers.{bid}.mlp.shared_experts.down_proj",
        # exp_probs_b.bias <-> e_score_correction_bias (see _SPECIAL_REVERSE)
    ),
    "gpt-oss": (
        "model.layers.{bid}.mlp.router",
        "model.layers.{bid}.self_attn.sinks",
    ),
}
# GGUF name suffix -> (HF parameter suffix, the name gguf-py's map knows for it), where the HF
# parameter is not ``module.weight``/``module.bias`` (the converter renames these two)
_SPECIAL_REVERSE = {
    ".exp_probs_b.bias": (".mlp.gate.e_score_correction_bias", ".mlp.gate.e_score_correction.bias"),
    ".attn_sinks.weight": (".self_attn.sinks", ".self_attn.sinks.weight"),
}

_SUFFIXES = (".weight", ".bias")

# GGUF names of MoE router tensors, kept in F32 by llama.cpp's converter and llama-quantize
ROUTER_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_inp_shexp.weight")


def is_router(gguf_name: str) -> bool:
    """True for MoE router tensors (``ffn_gate_inp``, ``ffn_gate_inp_shexp``), which stay F32."""
    return gguf_name.endswith(ROUTER_SUFFIXES)


def gguf_arch(arch: str) -> gguf.MODEL_ARCH:
    """The gguf-py ``MODEL_ARCH`` of an architecture string (``"llama"``).

    Raises:
        ValueError: gguf-py knows no such architecture.
    """
    for key, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return key
    raise ValueError(f"unknown GGUF architecture {arch!r}")


@lru_cache(maxsize=16)
def _name_map(arch: str, n_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(gguf_arch(arch), n_layers)


def hf_to_gguf_name(arch: str, n_layers: int, hf_name: str) -> str | None:
    """The llama.cpp name of a HF parameter or module.

    Args:
        arch: gguf architecture string (``"llama"``, ``"qwen2"``, ``"qwen3"``, or any other
            gguf-py knows).
        n_layers: number of transformer blocks (``num_hidden_layers``).
        hf_name: a module name (``"model.layers.3.mlp.down_proj"`` -> ``"blk.3.ffn_down"``)
            or a parameter name; a ``.weight``/``.bias`` suffix is kept
            (``"model.layers.3.mlp.down_proj.weight"`` -> ``"blk.3.ffn_down.weight"``).
    Returns:
        The GGUF name, or None when the name has no GGUF tensor for this architecture
        (e.g. ``rotary_emb.inv_freq``, or a block index >= n_layers).
    Raises:
        ValueError: unknown architecture.
    """
    return _name_map(arch, n_layers).get_name(hf_name, try_suffixes=_SUFFIXES)


@lru_cache(maxsize=16)
def _reverse_map(arch: str, n_layers: int) -> dict[str, str]:
    rev: dict[str, str] = {}
    modules = list(CANONICAL_HF_MODULES)
    block = ARCH_HF_BLOCK_MODULES.get(arch, ()) + CANONICAL_HF_BLOCK_MODULES
    modules += [m.format(bid=b) for b in range(n_layers) for m in block]
    for hf in modules:
        name = hf_to_gguf_name(arch, n_layers, hf)
        if name is not None:
            rev.setdefault(name, hf)
    return rev


def gguf_to_hf_name(arch: str, n_layers: int, gguf_name: str) -> str | None:
    """The canonical transformers name of a GGUF tensor (the inverse of :func:`hf_to_gguf_name`).

    ``"blk.3.ffn_down.weight"`` -> ``"model.layers.3.mlp.down_proj.weight"``; a name without
    suffix maps to the module name. Only the Llama-family modules of
    :data:`CANONICAL_HF_BLOCK_MODULES` are known.

    Returns:
        The HF name, or None for tensors with no HF counterpart (``rope_freqs.weight``) or
        of other architectures' layouts.
    Raises:
        ValueError: unknown architecture.
    """
    rev = _reverse_map(arch, n_layers)
    parts = gguf_name.split(".")
    for g_suffix, (hf_suffix, lookup) in _SPECIAL_REVERSE.items():
        if gguf_name.endswith(g_suffix) and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers:
            if hf_to_gguf_name(arch, n_layers, f"model.layers.{parts[1]}{lookup}") == gguf_name:
                return f"model.layers.{parts[1]}{hf_suffix}"
    for suffix in _SUFFIXES:
        if gguf_name.endswith(suffix) and (hf := rev.get(gguf_name[: -len(suffix)])) is not None:
            return hf + suffix
    return rev.get(gguf_name)


_GGUF_BLOCK = re.compile(r"(v\.(global\.)?)?blk\.(\d+)\.")
_HF_VISION = ("visual.", "vision_tower.", "vision_model.")
_HF_PROJECTOR = ("multi_modal_projector.", "visual.merger.")
# HF leaf module -> GGUF base name (the Llama family, MoE experts, routers, shared experts)
_HF_KINDS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_HF_GLOBAL_KINDS = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}


def _split_suffix(name: str, keep_one: bool = True) -> tuple[str, str]:
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and (len(name) > len(suffix) or not keep_one):
            return name[: -len(suffix)], suffix[1:]
    return name, ""


@dataclass(frozen=True)
class TensorName:
    """What a tensor's name says, for GGUF (llama.cpp) and Hugging Face names alike.

    GGUF (:meth:`from_gguf`)::

        blk.3.ffn_down.weight       -> tower "text",      block 3,    kind "ffn_down"
        blk.3.ffn_down_exps.weight  -> tower "text",      block 3,    kind "ffn_down_exps" (experts stacked)
        v.blk.2.attn_q.weight       -> tower "vision",    block 2,    kind "attn_q"
        v.global.blk.1.ffn_up.bias  -> tower "vision",    block 1,    kind "ffn_up", global_stack True
        token_embd.weight           -> tower "text",      block None, kind "token_embd"
        mm.0.weight                 -> tower "projector", block None, kind "mm.0"

    Hugging Face (:meth:`from_hf`)::

        model.layers.3.mlp.down_proj.weight            -> "text",   block 3, kind "ffn_down"
        model.layers.3.mlp.experts.5.down_proj.weight  -> "text",   block 3, kind "ffn_down_exps", expert 5
        model.visual.blocks.2.attn.qkv.weight          -> "vision", block 2, kind None (no table entry)
        lm_head.weight                                 -> "text",   block None, kind "output"

    Attributes:
        name: the name parsed.
        tower: ``"text"``, ``"vision"`` (vision tower) or ``"projector"`` (multimodal projector).
        block: the transformer block index (``blk.N`` / ``layers.N`` / ``blocks.N``), None outside the blocks.
        kind: the GGUF base name: in a block the name after ``blk.N.`` less ``.weight``/``.bias``; outside,
            the whole name less that suffix; from HF names the GGUF base name of the module (None when unknown).
        expert: the expert index of a per-expert HF tensor (``experts.5.``), else None (GGUF stacks experts).
        suffix: ``"weight"``, ``"bias"`` or ``""``.
        prefix: the block prefix as written (``"blk.3"``, ``"v.global.blk.1"``, ``"model.layers.3"``), else ``""``.
        leaf: the rest of the name after the block prefix and its dot (the whole name outside the blocks).
        global_stack: Mllama's global vision stack (``v.global.blk.N``).
    """

    name: str
    tower: str
    block: int | None
    kind: str | None
    expert: int | None = None
    suffix: str = ""
    prefix: str = ""
    leaf: str = ""
    global_stack: bool = False

    @classmethod
    def from_gguf(cls, name: str) -> TensorName:
        """Parse a GGUF tensor name (any string: names outside the patterns get block None)."""
        m = _GGUF_BLOCK.match(name)
        if m:
            leaf = name[m.end():]
            kind, suffix = _split_suffix(leaf)
            tower = "vision" if m.group(1) else "text"
            return cls(name, tower, int(m.group(3)), kind, None, suffix, name[: m.end() - 1], leaf, bool(m.group(2)))
        kind, suffix = _split_suffix(name, keep_one=False)
        tower = "projector" if name.startswith("mm.") else "vision" if name.startswith("v.") else "text"
        return cls(name, tower, None, kind, None, suffix, "", name)

    @classmethod
    def from_hf(cls, name: str) -> TensorName:
        """Parse a Hugging Face parameter or module name (transformers 4 or 5 layout; any string)."""
        path = name.removeprefix("model.")
        tower = ("projector" if path.startswith(_HF_PROJECTOR) else "vision" if path.startswith(_HF_VISION)
                 else "text")
        stem, suffix = _split_suffix(name)
        parts = name.split(".")
        block = expert = None
        prefix, leaf = "", name
        for i in range(len(parts) - 2):
            if parts[i] in ("layers", "blocks") and re.fullmatch(r"\d+", parts[i + 1]):
                block = int(parts[i + 1])
                prefix = ".".join(parts[: i + 2])
                leaf = name[len(prefix) + 1:]
                break
        rest = leaf.removesuffix("." + suffix) if suffix else leaf
        if (m := re.match(r"^(.*\.experts)\.(\d+)\.(.+)$", rest)) is not None:
            expert, rest = int(m.group(2)), f"{m.group(1)}.{m.group(3)}"
        kind = _HF_KINDS.get(rest) if block is not None else _HF_GLOBAL_KINDS.get(stem)
        return cls(name, tower, block, kind if tower == "text" else None, expert, suffix, prefix, leaf)
