"""Presets that mirror llama.cpp's named mixes (``llama_tensor_get_type`` in ``llama-quant.cpp``).

Each preset has a default type and per-tensor bumps decided by tensor category, layer
index and model shape, as llama.cpp decides them for dense models (no i-quants yet):
``Q8_0``, ``Q6_K``, ``Q5_K_M``, ``Q5_K_S``, ``Q4_K_M``, ``Q4_K_S``, ``Q3_K_M``, ``Q3_K_L``,
``Q2_K``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``F16``, ``BF16``, ``F32``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import LlamaFileType

from .formats import get_format
from .plan import TensorInfo


@dataclass(frozen=True)
class ModelInfo:
    """Model facts the presets use.

    Attributes:
        n_layers: transformer blocks.
        n_head, n_head_kv: attention heads and KV heads (n_gqa = n_head / n_head_kv).
        n_expert: routed experts per MoE layer (0 for dense).
        tied_embeddings: the output head reuses ``token_embd.weight``.
    """

    n_layers: int
    n_head: int = 1
    n_head_kv: int = 1
    n_expert: int = 0
    tied_embeddings: bool = False

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
}


def get_preset(name: str) -> tuple[str, LlamaFileType]:
    """(default format, file type) of a preset.

    Raises:
        KeyError: unknown preset; the message lists the known ones.
    """
    key = name.upper()
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key]


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    for cat in ("attn_v", "attn_k", "attn_q", "attn_output", "attn_qkv", "ffn_down", "ffn_gate", "ffn_up"):
        if f".{cat}" in name:
            return cat
    if name.startswith("token_embd"):
        return "token_embd"
    if name.startswith("output."):
        return "output"
    return "other"


def preset_format(preset: str, t: TensorInfo, m: ModelInfo) -> tuple[str, str]:
    """The format llama.cpp's mix ``preset`` gives a quantizable tensor (before fallbacks).

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
        return ("Q8_0", why) if base == "Q8_0" else ("Q6_K", f"{why}: output tensor")
    if cat == "attn_v":
        if p == "Q2_K":
            return ("Q4_K" if m.n_gqa >= 4 else "Q3_K"), f"{why}: attn_v"
        if p == "Q3_K_M":
            return ("Q5_K" if i < 2 else "Q4_K"), f"{why}: attn_v"
        if p == "Q3_K_L":
            return "Q5_K", f"{why}: attn_v"
        if p in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            return "Q6_K", f"{why}: attn_v use_more_bits"
        if p == "Q4_K_S" and i < 4:
            return "Q5_K", f"{why}: attn_v first layers"
        return base, why
    if cat == "ffn_down":
        if p == "Q2_K":
            return "Q3_K", f"{why}: ffn_down"
        if p == "Q3_K_M":
            return ("Q5_K" if i < n // 16 else "Q4_K"), f"{why}: ffn_down"
        if p == "Q3_K_L":
            return "Q5_K", f"{why}: ffn_down"
        if p in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            return "Q6_K", f"{why}: ffn_down use_more_bits"
        if p == "Q4_K_S" and i < n // 8:
            return "Q5_K", f"{why}: ffn_down first layers"
        return base, why
    if cat == "attn_output":
        bump = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(p)
        return (bump, f"{why}: attn_output") if bump else (base, why)
    if cat == "attn_qkv":
        bump = {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(p)
        return (bump, f"{why}: attn_qkv") if bump else (base, why)
    return base, why
