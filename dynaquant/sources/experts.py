"""transformers' mixture-of-experts module layouts: where a MoE layer's routed experts live.

transformers (>= 5) holds a MoE layer's routed experts as fused 3-D parameters of one experts
module (``model.layers.N.mlp.experts``) and runs them in one call. Two layouts exist:

- ``fused`` (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3): ``gate_up_proj`` (E, 2I, H) with the
  gate rows first, ``down_proj`` (E, H, I), ``act_fn``; ``y = down(act(gate x) * up x)``;
- ``gpt-oss``: ``gate_up_proj`` (E, H, 2I) with gate/up columns interleaved, ``down_proj``
  (E, I, H), biases, and the module's own ``_apply_gate`` (clamped SwiGLU).

The GGUF tensors ``ffn_{gate,up,down}_exps`` stack the experts as (E, rows, row_size): see
:func:`expert_weight`; the HF sources name them after the experts module
(:func:`stacked_name`). A block-by-block run whose MoE block does not fit ``--max-gpu-memory`` in the analysis
dtype keeps a ``fused`` module's experts *packed*: as the checkpoint stores them (:class:`Stored`: BF16 / FP16, or
FP8 with its block scales), each expert decoded to float32 when it runs (:func:`pack`, :func:`expert_matrix`,
:func:`expert_linear`); the decoded values are the ones an unpacked read gives, bit for bit. :func:`dispatch` is
transformers' routing, shared by the calibration forward (:mod:`dynaquant.analysis.experts`) and the quantized
runtime (:mod:`dynaquant.runtime.moe`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    # each expert's (choice position, token) pairs in that order (transformers' eager loop's rows, ``torch.where((idx
    # == e).T)``): one stable sort of the choices for all experts, one transfer of the experts and counts to the host
    n_tok = idx.shape[0]
    flat = idx.T.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    pos_all, tok_all = order // n_tok, order % n_tok
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist(), strict=True):
        pos, tok = pos_all[start : start + c], tok_all[start : start + c]
        start += c
        if not 0 <= e < n_expert:
            continue
        y = expert_fn(e, x_all[tok], w[tok, pos])
        out.index_add_(0, tok, (y * w[tok, pos, None]).to(out.dtype))
    return out.reshape(shape)


@dataclass
class Stored:
    """Experts of one stacked projection as the checkpoint stores them.

    Attributes:
        values: (n, N, K) in the stored dtype (bfloat16, float16, float8_e4m3fn or float32), GGUF orientation.
        scale: block-scaled FP8 (DeepSeek-V3's release): (n, ceil(N / b0), ceil(K / b1)) float32 multipliers
            (``weight_scale_inv``); None otherwise.
        block: the FP8 block size (b0, b1), or None.
    """

    values: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, ...] | None = None

    def decode(self, i: int | slice) -> torch.Tensor:
        """Expert(s) ``i`` in float32 on the values' device, as :func:`dynaquant.sources.release.dequant_block_fp8`
        (or a cast) decodes them on reading."""
        from dynaquant.sources.release import dequant_block_fp8

        x = self.values[i]
        if self.scale is None:
            return x.to(torch.float32)
        return dequant_block_fp8(x, self.scale[i], self.block)

    def to(self, device) -> Stored:
        return Stored(self.values.to(device), None if self.scale is None else self.scale.to(device), self.block)

    @property
    def nbytes(self) -> int:
        s = self.values.numel() * self.values.element_size()
        return s + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())


_PACKED = "_dq_packed"  # the experts module's attribute: proj -> Stored (all E experts, on the module's device)


def pack(module: torch.nn.Module, stored: dict[str, Stored]) -> None:
    """Keep a ``fused`` experts module's weights packed (``gate_proj``, ``up_proj``, ``down_proj`` -> all E experts);
    its ``gate_up_proj`` / ``down_proj`` parameters stay on the meta device. :func:`unpack` undoes it."""
    if layout_of(module) != "fused":
        raise ValueError("only the fused experts layout is kept packed")
    setattr(module, _PACKED, stored)


def unpack(module: torch.nn.Module) -> None:
    module.__dict__.pop(_PACKED, None)


def packed(module: torch.nn.Module) -> dict[str, Stored] | None:
    """The module's packed experts (:func:`pack`), or None."""
    return module.__dict__.get(_PACKED)


def expert_matrix(module: torch.nn.Module, proj: str, e: int) -> torch.Tensor:
    """Expert ``e``'s ``proj`` weight (N, K) as GGUF stacks it (:func:`expert_weight`), decoded to float32 where the
    module is packed."""
    st = packed(module)
    return st[proj].decode(e) if st is not None else expert_weight(module, proj)[e]


class _DecodedLinear(torch.autograd.Function):
    """``linear(x, decode())`` whose backward decodes the weight again instead of keeping it (the weight needs no
    gradient): a packed block's Fisher backward keeps its inputs, not 45 GB of decoded experts. The gradient is
    autograd's own for ``linear`` (``grad @ weight``)."""

    @staticmethod
    def forward(ctx, x, decode):
        ctx.decode = decode
        return torch.nn.functional.linear(x, decode())

    @staticmethod
    def backward(ctx, grad):
        return grad.matmul(ctx.decode()), None


def expert_linear(module: torch.nn.Module, e: int, which: str, x: torch.Tensor) -> torch.Tensor:
    """``linear(x, W)`` for expert ``e`` of a ``fused`` module, ``which`` ``"gate_up"`` (W (2I, H)) or ``"down"``
    (W (H, I)); a packed module's W is decoded for the call (and again in the backward, not kept)."""
    st = packed(module)
    if st is None:
        return torch.nn.functional.linear(x, (module.gate_up_proj if which == "gate_up" else module.down_proj)[e])

    def decode() -> torch.Tensor:
        if which == "down":
            return st["down_proj"].decode(e)
        return torch.cat([st["gate_proj"].decode(e), st["up_proj"].decode(e)])
    if torch.is_grad_enabled() and x.requires_grad:
        return _DecodedLinear.apply(x, decode)
    return torch.nn.functional.linear(x, decode())


class PackedForward:
    """The forward of a packed ``fused`` experts module: transformers' (same routing order, same operations), each
    expert decoded when it runs."""

    def __init__(self, module: torch.nn.Module):
        self.m = module

    def __call__(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        m = self.m

        def run(e: int, x: torch.Tensor, _w: torch.Tensor) -> torch.Tensor:
            gate, up = expert_linear(m, e, "gate_up", x).chunk(2, dim=-1)
            return expert_linear(m, e, "down", m.act_fn(gate) * up)
        return dispatch(hidden_states, top_k_index, top_k_weights, m.gate_up_proj.shape[0], run)
