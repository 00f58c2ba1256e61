"""A source's transformers model, whole, in one dtype on one device (the whole-model paths: the analysis, the
quantize run's reference, the evaluation; the block-wise paths build :mod:`.skeleton` parts instead).

A single GGUF file's model is built from its cached config and filled tensor by tensor from dynaquant's own reader
(:mod:`.skeleton`); a split GGUF is merged into one temporary file for transformers' GGUF loader; a folder's model is
filled the same way from its safetensors, each tensor converted on the target device; what dynaquant's readers do not
open (a vision-language model, ``*.bin`` weights, an architecture they do not name) loads with transformers'
``from_pretrained`` through :func:`.checkpoint.from_pretrained` (``trust_remote_code`` as the source says).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from dynaquant.sources.checkpoint import ModelSource, from_pretrained, from_pretrained_kwargs, gguf_cached
from dynaquant.sources.gguf import is_split_gguf, merge_gguf_shards, open_gguf_source
from dynaquant.sources.skeleton import OUTER, build_skeleton
from dynaquant.sources.vl_archs import vl_full_arch

log = logging.getLogger(__name__)


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *,
               cache: bool = True):
    """Load a transformers causal LM from a source, in ``dtype`` on ``device``, in eval mode.

    A GGUF file's config comes from the cache (:mod:`.gguf_hf_cache`; converted from the file and kept there the first
    time; ``cache`` False: from the file).

    A vision-language folder (Qwen2-VL / Qwen2.5-VL / LLaVA / Mllama: ``sources.vl_archs.VL_FULL_ARCHS``) loads with
    ``AutoModelForImageTextToText``; called on token ids alone it is its language model. A split GGUF (its first
    shard) is merged into one temporary file first (transformers' GGUF loader reads one file), removed once loaded.

    Raises:
        RemoteCodeError: the checkpoint needs its own code and ``source.trust_remote_code`` is off.
        InputError: a split GGUF with a shard missing or damaged.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.kind == "gguf" and is_split_gguf(source.path):
        with tempfile.TemporaryDirectory(prefix="dynaquant-merged-") as tmp:
            merged = merge_gguf_shards(source.path, Path(tmp) / source.path.name)
            return load_model(replace(source, path=merged), dtype=dtype, device=device, cache=False)
    kw = from_pretrained_kwargs(source)
    if source.kind == "hf":
        if vl_full_arch(source.path):
            from transformers import AutoModelForImageTextToText

            model = from_pretrained(AutoModelForImageTextToText, source.folder, dtype=dtype, **kw)
            return model.to(device).eval()
    if source.kind == "gguf" and cache and (model := _gguf_model(source, dtype, device)) is not None:
        return model
    if source.kind == "hf" and (model := _folder_model(source, dtype, device)) is not None:
        return model
    if source.kind == "gguf":
        try:
            from transformers import GgufConfig

            kw["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # older transformers always dequantize
            pass
        if (config := gguf_cached(source, "config", AutoConfig, cache)) is not None:
            kw["config"] = config  # (not parsed from the file again)
    try:
        model = from_pretrained(AutoModelForCausalLM, source.folder, dtype=dtype, **kw)
    except TypeError:
        kw.pop("quantization_config", None)
        model = from_pretrained(AutoModelForCausalLM, source.folder, dtype=dtype, **kw)
    return model.to(device).eval()


def _gguf_model(source: ModelSource, dtype: torch.dtype, device: str | torch.device):
    """A single GGUF file's model built from its cached config (:func:`load_config`) and filled tensor by tensor from
    the file (:func:`_skeleton_model`); the same parameters as transformers' GGUF loader gives (which parses the file
    again, builds gguf's name map once per tensor and holds a whole dequantized state dict). None where dynaquant's
    name map does not cover the file (transformers' loader is used)."""
    return _skeleton_model(source, open_gguf_source(source.path), dtype, device, "transformers' GGUF loader")


def _folder_model(source: ModelSource, dtype: torch.dtype, device: str | torch.device):
    """A checkpoint folder's model filled tensor by tensor from its safetensors (:func:`_skeleton_model`, the reader of
    the block-wise paths): each tensor moves to ``device`` as stored (BF16: half the bytes of float32) and is converted
    there, so a whole float32 model on a GPU never passes through host memory (``from_pretrained`` builds it in host
    memory, then copies it: ~24 s of a Llama-3-8B's load on an H200, and 30 GB of RAM). The same float32 values as
    ``from_pretrained`` gives. None where dynaquant's reader does not open the folder (an architecture it does not
    name, ``*.bin`` weights) or does not fill every parameter: ``from_pretrained`` is used."""
    from dynaquant.sources.open import open_hf_source

    try:
        ts = open_hf_source(source.folder, trust_remote_code=source.trust_remote_code)
    except ValueError as e:
        log.debug("%s: built by from_pretrained (%s)", source.folder, e)
        return None
    return _skeleton_model(source, ts, dtype, device, "from_pretrained")


def _skeleton_model(source: ModelSource, ts, dtype: torch.dtype, device: str | torch.device, fallback: str):
    """The source's model on the meta device (:func:`build_skeleton`), every part materialized from ``ts`` on
    ``device``, NaN and Inf included (left for the caller to check); None (``fallback`` is used) where a parameter
    is not filled or the name map does not cover the source."""
    try:
        sk = build_skeleton(source, ts, dtype=dtype, device=device, checked=False)
        for part in (OUTER, *range(sk.n_blocks)):
            sk.materialize(part)
    except ValueError as e:
        log.debug("%s: built by %s (%s)", ts.source_id, fallback, e)
        return None
    for p in sk.model.parameters():  # (as from_pretrained leaves them)
        p.requires_grad_(p.is_floating_point())
    sk.model.config._name_or_path = sk.model.name_or_path = str(source.folder)
    return sk.model
