"""Presets that mirror llama.cpp's named mixes (``llama_tensor_get_type`` in ``llama-quant.cpp``).

Each preset has a default type and per-tensor bumps decided by tensor category, layer
index, model shape and whether an imatrix is given, as llama.cpp decides them for dense
models: ``Q8_0``, ``Q6_K``, ``Q5_K_M``, ``Q5_K_S``, ``Q4_K_M``, ``Q4_K_S``, ``Q3_K_M``, ``Q3_K_L``,
``Q2_K``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``F16``, ``BF16``, ``F32`` and the i-quant mixes
``IQ4_XS``, ``IQ3_M``, ``IQ3_S``, ``IQ3_XS``, ``IQ3_XXS``, ``IQ2_M``, ``IQ2_S``, ``IQ2_XS``, ``IQ2_XXS``,
``IQ1_M``, ``IQ1_S``. Fused ``attn_qkv`` weights are treated as ``attn_v`` (``category_is_attn_v``).
:func:`requires_imatrix` is llama.cpp's rule for the types it refuses to write without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import LlamaFileType

from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import TensorInfo


@dataclass(frozen=True)
class ModelInfo:
    """Model facts the presets use.

    Attributes:
        n_layers: transformer blocks.
        n_head, n_head_kv: attention heads and KV heads (n_gqa = n_head / n_head_kv).
        n_expert: routed experts per MoE layer (0 for dense).
        tied_embeddings: the output head reuses ``token_embd.weight``.
        expert_format: the format the source stores routed experts in when it is one of ours
            (``"MXFP4"`` for gpt-oss checkpoints), else None.
    """

    n_layers: int
    n_head: int = 1
    n_head_kv: int = 1
    n_expert: int = 0
    tied_embeddings: bool = False
    expert_format: str | None = None

    @property
    def n_gqa(self) -> int:
        return max(1, self.n_head // max(self.n_head_kv, 1))


# preset -> (default format, llama.cpp file type)
PRESETS: dict[str, tuple[str, LlamaFileType]] = {
    "F32": ("F32", LlamaFileType.ALL_F32),
    "F16": ("F16", LlamaFileType.MOSTLY_F16),
    "BF16": ("BF16", LlamaFileType.MOSTLY_BF16),
    "Q8_0": ("Q8_0", LlamaFileType.MOSTLY_Q8_0),
    "Q6_K": ("Q6_K", LlamaFileType.MOSTLY_Q6_K),
    "Q5_1": ("Q5_1", LlamaFileType.MOSTLY_Q5_1),
    "Q5_0": ("Q5_0", LlamaFileType.MOSTLY_Q5_0),
    "Q5_K_M": ("Q5_K", LlamaFileType.MOSTLY_Q5_K_M),
    "Q5_K_S": ("Q5_K", LlamaFileType.MOSTLY_Q5_K_S),
    "Q4_1": ("Q4_1", LlamaFileType.MOSTLY_Q4_1),
    "Q4_0": ("Q4_0", LlamaFileType.MOSTLY_Q4_0),
    "Q4_K_M": ("Q4_K", LlamaFileType.MOSTLY_Q4_K_M),
    "Q4_K_S": ("Q4_K", LlamaFileType.MOSTLY_Q4_K_S),
    "Q3_K_L": ("Q3_K", LlamaFileType.MOSTLY_Q3_K_L),
    "Q3_K_M": ("Q3_K", LlamaFileType.MOSTLY_Q3_K_M),
    "Q2_K": ("Q2_K", LlamaFileType.MOSTLY_Q2_K),
    "IQ4_XS": ("IQ4_XS", LlamaFileType.MOSTLY_IQ4_XS),
    "IQ3_M": ("IQ3_S", LlamaFileType.MOSTLY_IQ3_M),
    "IQ3_S": ("IQ3_S", LlamaFileType.MOSTLY_IQ3_S),
    "IQ3_XS": ("IQ3_S", LlamaFileType.MOSTLY_IQ3_XS),
    "IQ3_XXS": ("IQ3_XXS", LlamaFileType.MOSTLY_IQ3_XXS),
    "IQ2_M": ("IQ2_S", LlamaFileType.MOSTLY_IQ2_M),
    "IQ2_S": ("IQ2_XS", LlamaFileType.MOSTLY_IQ2_S),
    "IQ2_XS": ("IQ2_XS", LlamaFileType.MOSTLY_IQ2_XS),
    "IQ2_XXS": ("IQ2_XXS", LlamaFileType.MOSTLY_IQ2_XXS),
    "IQ1_M": ("IQ1_M", LlamaFileType.MOSTLY_IQ1_M),
    "IQ1_S": ("IQ1_S", LlamaFileType.MOSTLY_IQ1_S),
}

# Formats llama.cpp refuses to write without an imatrix (``tensor_requires_imatrix``), except in
# the token embedding and the output head.
IMATRIX_FORMATS = frozenset({"IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"})

# The very low i-quant mixes (one branch of llama_tensor_get_type_impl).
_LOW_IQ = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")


def get_preset(name: str) -> tuple[str, LlamaFileType]:
    """(default format, file type) of a preset.

    Raises:
        KeyError: unknown preset; the message lists the known ones.
    """
    key = name.upper()
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key]


def requires_imatrix(tensor_name: str, fmt: str) -> bool:
    """Whether llama.cpp refuses to write this tensor in ``fmt`` without an imatrix
    (``tensor_requires_imatrix``: the IQ3_XXS, IQ2 and IQ1 types, except in ``token_embd.weight``,
    ``per_layer_token_embd.weight`` and ``output.weight``)."""
    if tensor_name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return fmt.upper() in IMATRIX_FORMATS


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    if ".attn_qkv." in name or ".attn_kv_b." in name:
        return "attn_v"  # llama.cpp's category_is_attn_v
    # llama.cpp's tensor_get_category: attention tensors by their exact "attn_v.weight" (so MLA's
    # attn_v_b/attn_k_b/attn_q_a/attn_q_b are "other"), FFN tensors by substring (so the MoE
    # ffn_*_exps/ffn_*_shexp count as ffn_*)
    for cat in ("attn_v", "attn_k", "attn_q", "attn_output"):
        if f".{cat}.weight" in name:
            return cat
    for cat in ("ffn_up", "ffn_gate", "ffn_down"):
        if f".{cat}" in name:
            return cat
    if name.startswith("token_embd"):
        return "token_embd"
    if name.startswith("output."):
        return "output"
    return "other"


def preset_format(preset: str, t: TensorInfo, m: ModelInfo, has_imatrix: bool = False) -> tuple[str, str]:
    """The format llama.cpp's mix ``preset`` gives a quantizable tensor (before fallbacks).

    Args:
        has_imatrix: an imatrix will be used (``llama-quantize --imatrix``); the IQ3_XXS and IQ4_XS
            mixes bump some tensors only without one, Q4_0 and Q5_0 only with one.
    Returns:
        (format name, reason).
    """
    base, _ = get_preset(preset)
    p = preset.upper()
    if get_format(base).kind == "float":
        return base, f"preset {p}"
    cat = _category(t.name)
    i = t.layer if t.layer is not None else 0
    n = m.n_layers
    why = f"preset {p}"
    if cat == "output" or (cat == "token_embd" and m.tied_embeddings):
        if t.row_size % get_format(base).block_size:
            return "Q8_0", f"{why}: output tensor, row {t.row_size} not a multiple of {get_format(base).block_size}"
        if p in _LOW_IQ or p == "IQ3_XXS":
            return "Q5_K", f"{why}: output tensor"
        return ("Q8_0", why) if base == "Q8_0" else ("Q6_K", f"{why}: output tensor")
    if cat == "token_embd":
        if p in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return "Q2_K", f"{why}: token_embd"
        if p in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return "IQ3_S", f"{why}: token_embd"
        return base, why
    if p in _LOW_IQ:
        hi = "IQ3_S" if p in ("IQ2_S", "IQ2_M") else "Q2_K"
        if cat == "attn_v":
            return ("Q4_K" if m.n_gqa >= 4 or m.n_expert >= 4 else hi), f"{why}: attn_v"
        if cat == "ffn_down" and i < n // 8:
            return hi, f"{why}: ffn_down first layers"
        if cat == "attn_output" and p != "IQ2_XXS" and p != "IQ2_XS":
            return ("IQ2_XXS" if p in ("IQ1_S", "IQ1_M") else "IQ3_S"), f"{why}: attn_output"
        return base, why
    if cat == "attn_v":
        if p == "Q2_K":
            return ("Q4_K" if m.n_gqa >= 4 else "Q3_K"), f"{why}: attn_v"
        if p == "IQ3_XXS":
            return ("Q4_K" if m.n_gqa >= 4 else "IQ3_XXS" if has_imatrix else "IQ3_S"), f"{why}: attn_v"
        if (p in ("IQ3_XS", "IQ3_S") and m.n_gqa >= 4) or p == "IQ3_M":
            return "Q4_K", f"{why}: attn_v"
        if p == "Q3_K_M":
            return ("Q5_K" if i < 2 else "Q4_K"), f"{why}: attn_v"
        if p == "Q3_K_L":
            return "Q5_K", f"{why}: attn_v"
        if p == "IQ4_XS" and m.n_gqa >= 4:
            return "Q5_K", f"{why}: attn_v"
        if p in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            return "Q6_K", f"{why}: attn_v use_more_bits"
        if p == "Q4_K_S" and i < 4:
            return "Q5_K", f"{why}: attn_v first layers"
        return base, why
    if cat in ("attn_k", "attn_q"):
        bump = {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(p)
        return (bump, f"{why}: {cat}") if bump else (base, why)
    if cat == "ffn_down":
        if p == "Q2_K":
            return "Q3_K", f"{why}: ffn_down"
        if p == "IQ3_XXS" and not has_imatrix:
            return ("Q4_K" if i < n // 8 else "Q3_K"), f"{why}: ffn_down without imatrix"
        if p == "Q3_K_M":
            return ("Q5_K" if i < n // 16 else "Q4_K"), f"{why}: ffn_down"
        if p == "IQ3_M" and i < n // 8:
            return "Q4_K", f"{why}: ffn_down first layers"
        if p == "Q3_K_L":
            return "Q5_K", f"{why}: ffn_down"
        if p in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            return "Q6_K", f"{why}: ffn_down use_more_bits"
        if p == "IQ4_XS" and i < n // 8 and not has_imatrix:
            return "Q5_K", f"{why}: ffn_down first layers without imatrix"
        if p == "Q4_K_S" and i < n // 8:
            return "Q5_K", f"{why}: ffn_down first layers"
        if p in ("Q4_0", "Q5_0") and has_imatrix and i < n // 8:
            return ("Q4_1" if p == "Q4_0" else "Q5_1"), f"{why}: ffn_down first layers with imatrix"
        return base, why
    if cat == "attn_output":
        bump = {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}.get(p)
        return (bump, f"{why}: attn_output") if bump else (base, why)
    if cat in ("ffn_gate", "ffn_up") and p == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
        return "IQ3_XXS", f"{why}: {cat} middle layers"
    return base, why
