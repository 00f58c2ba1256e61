"""transformers' mixture-of-experts module layouts: where a MoE layer's routed experts live.

transformers (>= 5) holds a MoE layer's routed experts as fused 3-D parameters of one experts
module (``model.layers.N.mlp.experts``) and runs them in one call. Two layouts exist:

- ``fused`` (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3): ``gate_up_proj`` (E, 2I, H) with the
  gate rows first, ``down_proj`` (E, H, I), ``act_fn``; ``y = down(act(gate x) * up x)``;
- ``gpt-oss``: ``gate_up_proj`` (E, H, 2I) with gate/up columns interleaved, ``down_proj``
  (E, I, H), biases, and the module's own ``_apply_gate`` (clamped SwiGLU).

The GGUF tensors ``ffn_{gate,up,down}_exps`` stack the experts as (E, rows, row_size): see
:func:`expert_weight`; the HF sources name them after the experts module
(:func:`stacked_name`). :func:`dispatch` is transformers' routing, shared by the calibration
forward (:mod:`dynaquant.analysis.experts`) and the quantized runtime (:mod:`dynaquant.runtime.moe`).
"""

from __future__ import annotations

import re

import torch

PROJS = ("gate_proj", "up_proj", "down_proj")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def stacked_name(hf_name: str | None) -> tuple[str, str] | None:
    """``"model.layers.3.mlp.experts.down_proj.weight"`` -> (experts module, ``"down_proj"``), else None."""
    m = _STACKED.match(hf_name or "")
    return (m.group(1), m.group(2)) if m else None


def layout_of(module: torch.nn.Module) -> str | None:
    """``"fused"``, ``"gpt-oss"`` or None (not a transformers experts module)."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gu, torch.nn.Parameter) or not isinstance(dn, torch.nn.Parameter) or gu.dim() != 3:
        return None
    if hasattr(module, "_apply_gate") and getattr(module, "gate_up_proj_bias", None) is not None:
        return "gpt-oss"
    return "fused" if hasattr(module, "act_fn") else None


def find_experts(model) -> dict[str, torch.nn.Module]:
    """Experts modules of a transformers model by name (empty for a dense model)."""
    return {n: m for n, m in model.named_modules() if layout_of(m) is not None}


def expert_weight(module: torch.nn.Module, proj: str) -> torch.Tensor:
    """One projection of all experts as GGUF stacks them.

    Args:
        module: an experts module (see :func:`layout_of`).
        proj: ``gate_proj``, ``up_proj`` or ``down_proj``.
    Returns:
        A view (E, N, K): gate/up (E, I, H), down (E, H, I) (torch orientation, rows = outputs).
    """
    gu, dn = module.gate_up_proj, module.down_proj
    if layout_of(module) == "gpt-oss":
        if proj == "down_proj":
            return dn.transpose(1, 2)
        start = 0 if proj == "gate_proj" else 1
        return gu[..., start::2].transpose(1, 2)
    if proj == "down_proj":
        return dn
    i = gu.shape[1] // 2
    return gu[:, :i] if proj == "gate_proj" else gu[:, i:]


def dispatch(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_expert: int,
             expert_fn) -> torch.Tensor:
    """transformers' experts routing: ``out_t = sum_j w[t, j] * expert_{idx[t, j]}(x_t)``.

    Args:
        hidden_states: (T, H) tokens (any leading shape that flattens to T).
        top_k_index: (T, k) int64 chosen experts; values outside ``0 .. n_expert-1`` (masked choices) are skipped.
        top_k_weights: (T, k) routing weights.
        expert_fn: ``(e, x (n, H), w (n,)) -> y (n, H)``, expert ``e`` on the n tokens routed to it (``w``: their
            routing weights, for statistics; the weighting is done here).
    Returns:
        Same shape and dtype as ``hidden_states``.
    """
    shape = hidden_states.shape
    x_all = hidden_states.reshape(-1, shape[-1])
    idx = top_k_index.reshape(x_all.shape[0], -1)
    w = top_k_weights.reshape(x_all.shape[0], -1)
    out = torch.zeros_like(x_all)
    for e in torch.unique(idx).tolist():
        if not 0 <= e < n_expert:
            continue
        tok, pos = torch.where(idx == e)
        y = expert_fn(e, x_all[tok], w[tok, pos])
        out.index_add_(0, tok, (y * w[tok, pos, None]).to(out.dtype))
    return out.reshape(shape)
