"""A source's transformers model, whole, in one dtype on one device (the whole-model paths: the analysis, the
quantize run's reference, the evaluation; the block-wise paths build :mod:`.skeleton` parts instead).

A single GGUF file's model is built from its cached config and filled tensor by tensor from dynaquant's own reader
(:mod:`.skeleton`); a split GGUF is merged into one temporary file for transformers' GGUF loader; a folder loads with
transformers' ``from_pretrained`` through :func:`.checkpoint.from_pretrained` (``trust_remote_code`` as the source
says).
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
    the file (:mod:`.skeleton`: the reader dynaquant already keeps for it, each tensor dequantized straight into its
    parameter); the same parameters as transformers' GGUF loader gives (which parses the file again, builds gguf's
    name map once per tensor and holds a whole dequantized state dict), NaN and Inf included, left for the caller to
    check. None where dynaquant's name map does not cover the file (transformers' loader is used)."""
    ts = open_gguf_source(source.path)
    try:
        sk = build_skeleton(source, ts, dtype=dtype, device=device, checked=False)
        for part in (OUTER, *range(sk.n_blocks)):
            sk.materialize(part)
    except ValueError as e:
        log.debug("%s: built by transformers' GGUF loader (%s)", source.path, e)
        return None
    for p in sk.model.parameters():  # (as from_pretrained leaves them)
        p.requires_grad_(p.is_floating_point())
    sk.model.config._name_or_path = sk.model.name_or_path = str(source.folder)
    return sk.model
