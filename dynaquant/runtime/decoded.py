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

import numpy as np
import torch

log = logging.getLogger(__name__)


def uses_own_decoder(ts) -> bool:
    """Whether a source's GGUF files need :func:`load_decoded` (anything transformers' GGUF loader does not
    map back: experts, MLA splits, architectures outside the dense Llama family)."""
    return ts.arch not in ("llama", "qwen2", "qwen3") or any(
        "_exps." in t.gguf_name or "_b.weight" in t.gguf_name for t in ts.tensors())


def decode_tensor(rt) -> torch.Tensor:
    """A GGUF reader tensor decoded by our codecs (bit-exact with ``gguf.quants.dequantize``): float32 in torch
    orientation (``ne`` reversed), as the source reads it (GGUF row order)."""
    from dynaquant.quant.codecs import dequantize
    from dynaquant.quant.formats import get_format

    fmt = rt.tensor_type.name
    shape = tuple(int(n) for n in reversed(rt.shape.tolist()))
    raw = np.array(rt.data).view(np.uint8).reshape(-1, get_format(fmt).row_bytes(shape[-1]))
    return dequantize(raw, fmt).reshape(shape)


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
    from dynaquant.sources.model import load_model
    from dynaquant.sources.params import ParamWriter
    from dynaquant.sources.readers import open_gguf_shards

    if model is None:
        model = load_model(source, dtype=torch.float32, device="cpu")
    by_name = {t.gguf_name: t for t in ts.tensors()}
    writer = ParamWriter(model, ts.arch, ts.n_head, ts.n_head_kv)
    for rt in (rt for r in open_gguf_shards(gguf_path) for rt in r.tensors):
        fmt = rt.tensor_type.name
        if fmt == "F32":
            continue
        t = by_name.get(rt.name)
        if t is None:
            raise ValueError(f"{gguf_path}: tensor {rt.name} is not in the source {ts.source_id}")
        writer.put(t, decode_tensor(rt), origin=f"{gguf_path} ({fmt})")
    writer.flush()
    return model.to(device=device, dtype=dtype).eval()
