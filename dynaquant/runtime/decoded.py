"""A GGUF file's decoded weights in the transformers model of its source checkpoint.

transformers' own GGUF loader knows the dense Llama family but not llama.cpp's stacked MoE experts
(``ffn_*_exps``), MLA's split ``attn_k_b``/``attn_v_b`` or other layouts we export. For evaluating
what we wrote, :func:`load_decoded` builds the source checkpoint's model and overwrites every tensor
the GGUF stores in a non-F32 type with its decoded values, undoing the exporter's transforms (the
``llama`` architecture's q/k row permutation, expert stacking, the ``kv_b_proj`` split). Decoding is
our codecs' (bit-exact with ``gguf.quants.dequantize``, tested).
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import torch

log = logging.getLogger(__name__)


def uses_own_decoder(ts) -> bool:
    """Whether a source's GGUF files need :func:`load_decoded` (anything transformers' GGUF loader does not
    map back: experts, MLA splits, architectures outside the dense Llama family)."""
    return ts.arch not in ("llama", "qwen2", "qwen3") or any(
        "_exps." in t.gguf_name or "_b.weight" in t.gguf_name for t in ts.tensors())


def load_decoded(gguf_path: str | os.PathLike, source, ts, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, model=None):
    """The source's transformers model holding the GGUF file's decoded weights.

    Args:
        gguf_path: a GGUF file written from ``ts`` (tensor names must be ``ts``'s; a split GGUF: its first shard).
        source: the checkpoint's ``checkpoint.ModelSource`` (the model to build).
        ts: its ``TensorSource`` (GGUF name -> HF name, architecture, heads).
        model: the source's model already loaded (float32, on the CPU or ``device``), overwritten in place instead of
            loading another (None: loaded here).
    Returns:
        The model in eval mode on ``device``; tensors stored as F32 in the file keep the source's values.
    Raises:
        ValueError: a GGUF tensor the source does not list, or whose HF counterpart the model lacks.
    """
    from dynaquant.quant.codecs import dequantize
    from dynaquant.quant.formats import get_format
    from dynaquant.sources.checkpoint import load_model
    from dynaquant.sources.experts import expert_weight, stacked_name
    from dynaquant.sources.hf import unpermute_qk
    from dynaquant.sources.readers import open_gguf_shards

    if model is None:
        model = load_model(source, dtype=torch.float32, device="cpu")
    by_name = {t.gguf_name: t for t in ts.tensors()}
    params = dict(model.named_parameters())
    kv_parts: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for rt in (rt for r in open_gguf_shards(gguf_path) for rt in r.tensors):
            fmt = rt.tensor_type.name
            if fmt == "F32":
                continue
            t = by_name.get(rt.name)
            if t is None:
                raise ValueError(f"{gguf_path}: tensor {rt.name} is not in the source {ts.source_id}")
            shape = tuple(int(n) for n in reversed(rt.shape.tolist()))
            raw = np.array(rt.data).view(np.uint8).reshape(-1, get_format(fmt).row_bytes(shape[-1]))
            x = dequantize(raw, fmt).reshape(shape).to(next(model.parameters()).device)
            if ts.arch == "llama" and rt.name.endswith(("attn_q.weight", "attn_k.weight")):
                x = unpermute_qk(x, ts.n_head if "attn_q" in rt.name else ts.n_head_kv)
            mla = re.match(r"^(.*\.self_attn\.)(k|v)_b_proj\.weight$", t.hf_name or "")
            if (stacked := stacked_name(t.hf_name)) is not None:
                expert_weight(model.get_submodule(stacked[0]), stacked[1]).copy_(x)
            elif mla is not None:
                kv_parts.setdefault(mla.group(1) + "kv_b_proj.weight", {})[mla.group(2)] = x
            elif t.hf_name == "model.embed_tokens.weight":
                model.get_input_embeddings().weight.copy_(x)
            elif t.hf_name == "lm_head.weight":
                model.get_output_embeddings().weight.copy_(x)
            elif t.hf_name in params:
                params[t.hf_name].copy_(x)
            else:
                raise ValueError(f"{gguf_path}: {rt.name} ({fmt}) has no parameter {t.hf_name} in the model")
        for name, parts in kv_parts.items():  # MLA: attn_k_b (H, rank, nope), attn_v_b (H, v, rank) -> kv_b_proj
            w = params[name]
            n_head = next(iter(parts.values())).shape[0]
            kv = w.view(n_head, w.shape[0] // n_head, w.shape[1])  # (H, nope + v, rank); a part stored F32 stays
            nope = parts["k"].shape[2] if "k" in parts else kv.shape[1] - parts["v"].shape[1]
            if "k" in parts:
                kv[:, :nope].copy_(parts["k"].transpose(1, 2))
            if "v" in parts:
                kv[:, nope:].copy_(parts["v"])
    return model.to(device=device, dtype=dtype).eval()
