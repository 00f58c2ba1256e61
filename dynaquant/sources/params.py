"""Source tensors (GGUF names and orientation) written into a transformers model's parameters.

A :class:`~dynaquant.sources.gguf.TensorSource` reads tensors as llama.cpp stores them: the ``llama``
architecture's q/k rows permuted, MoE experts stacked per projection (``ffn_{gate,up,down}_exps``, (E, rows,
row)), DeepSeek's ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b``. :class:`ParamWriter` undoes these
transforms and copies each tensor into the parameter (or the slice of the fused parameter) transformers holds it
in. The decoded model of a GGUF (:mod:`dynaquant.runtime.decoded`) and the block-by-block skeleton
(:mod:`.skeleton`) both write through it.
"""

from __future__ import annotations

import re

import torch

from dynaquant.sources.experts import expert_weight, stacked_name
from dynaquant.sources.gguf import SourceTensor
from dynaquant.sources.hf import unpermute_qk

_MLA = re.compile(r"^(.*\.self_attn\.)(k|v)_b_proj\.weight$")
_EXPERT_BIAS = re.compile(r"^(.*\.experts)\.(gate|up|down)_proj\.bias$")  # gpt-oss: (E, 2I) gate/up alternate


class ParamWriter:
    """Writes source tensors into a model's parameters (in place, under ``torch.no_grad``).

    Args:
        model: a transformers model whose parameters the tensors go to (real tensors where written).
        arch: the source's GGUF architecture (``"llama"`` un-permutes q/k rows; None: no un-permutation).
        n_head, n_head_kv: attention heads (for the q/k un-permutation).
    """

    def __init__(self, model, arch: str | None, n_head: int | None, n_head_kv: int | None):
        self.model, self.arch, self.n_head, self.n_head_kv = model, arch, n_head, n_head_kv
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self._kv_parts: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, model, ts) -> ParamWriter:
        """A writer of tensor source ``ts``'s tensors: q/k un-permuted where the source reads them in llama.cpp's
        orientation (a vision-language source read whole, ``hf_orientation`` True, gives them as the model holds
        them, vision tower included)."""
        arch = None if getattr(ts, "hf_orientation", False) else ts.arch
        return cls(model, arch, getattr(ts, "n_head", None), getattr(ts, "n_head_kv", None))

    def put(self, t: SourceTensor, x: torch.Tensor, origin: str = "") -> None:
        """Write one tensor.

        Args:
            t: the source tensor (its ``hf_name`` says where it goes).
            x: its values, shape ``t.shape``, as the source reads them (GGUF orientation); cast to the parameter's
                dtype and device.
            origin: names the file in errors.
        Raises:
            ValueError: the tensor has no parameter in the model, or its shape does not match.
        """
        where = origin or "source"
        if self.arch == "llama" and t.gguf_name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            x = unpermute_qk(x, self.n_head if "attn_q" in t.gguf_name else self.n_head_kv)
        mla = _MLA.match(t.hf_name or "")
        with torch.no_grad():
            if (stacked := stacked_name(t.hf_name)) is not None:
                self._copy(expert_weight(self.model.get_submodule(stacked[0]), stacked[1]), x, t, where)
            elif mla is not None:
                self._kv_parts.setdefault(mla.group(1) + "kv_b_proj.weight", {})[mla.group(2)] = x
            elif t.hf_name == "model.embed_tokens.weight":
                self._copy(self.model.get_input_embeddings().weight, x, t, where)
            elif t.hf_name == "lm_head.weight":
                self._copy(self.model.get_output_embeddings().weight, x, t, where)
            elif (bias := _EXPERT_BIAS.match(t.hf_name or "")) is not None:
                m = self.model.get_submodule(bias.group(1))
                dst = m.down_proj_bias if bias.group(2) == "down" else m.gate_up_proj_bias[:, bias.group(2) == "up"::2]
                self._copy(dst, x, t, where)
            elif t.hf_name in self.params:
                self._copy(self.params[t.hf_name], x, t, where)
            elif t.hf_name in self.buffers:  # DeepSeek's e_score_correction_bias
                self._copy(self.buffers[t.hf_name], x, t, where)
            else:
                raise ValueError(f"{where}: {t.gguf_name} has no parameter {t.hf_name} in the model")

    def flush(self) -> None:
        """Write the pending MLA halves into ``kv_b_proj`` (attn_k_b (H, rank, nope), attn_v_b (H, v, rank)); a
        half not given keeps the parameter's values."""
        with torch.no_grad():
            for name, parts in self._kv_parts.items():
                w = self.params[name]
                n_head = next(iter(parts.values())).shape[0]
                kv = w.view(n_head, w.shape[0] // n_head, w.shape[1])  # (H, nope + v, rank)
                nope = parts["k"].shape[2] if "k" in parts else kv.shape[1] - parts["v"].shape[1]
                if "k" in parts:
                    kv[:, :nope].copy_(parts["k"].transpose(1, 2))
                if "v" in parts:
                    kv[:, nope:].copy_(parts["v"])
        self._kv_parts.clear()

    @staticmethod
    def _copy(dst: torch.Tensor, x: torch.Tensor, t: SourceTensor, where: str) -> None:
        if tuple(dst.shape) != tuple(x.shape):
            raise ValueError(f"{where}: {t.gguf_name} has shape {tuple(x.shape)}, its parameter {t.hf_name} "
                             f"{tuple(dst.shape)}")
        dst.copy_(x.to(dst.device, dst.dtype))
