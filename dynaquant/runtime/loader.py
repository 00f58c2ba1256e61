"""Run safetensors checkpoints in PyTorch: :func:`load`.

``load(path)`` builds the checkpoint's transformers model with its quantized linear layers replaced by
:class:`~dynaquant.runtime.linear.DynaLinear` modules (the tensors as stored; the Triton kernels on CUDA, the torch
reference elsewhere), its mixture-of-experts layers by :class:`~dynaquant.runtime.moe.DynaExperts`, and on CUDA
sibling projections fused into one kernel call each (:func:`~dynaquant.runtime.linear.fuse_projections`,
:func:`~dynaquant.runtime.linear.fuse_experts`). Any compressed-tensors checkpoint whose schemes map onto runtime
formats (``quant.runtime.format_of_scheme``) loads too; dynaquant's config extension adds exact format names and
super weights.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from torch import nn

from dynaquant.errors import InputError
from dynaquant.quant.formats import get_format
from dynaquant.quant.runtime import format_of_scheme
from dynaquant.runtime.linear import DynaLinear, fuse_experts, fuse_projections

__all__ = ["DynaLinear", "fuse_experts", "fuse_projections", "is_runtime_checkpoint", "load", "module_formats"]

log = logging.getLogger(__name__)


def _match(name: str, targets, module: nn.Module) -> bool:
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], name):
                return True
        elif t == name or t == type(module).__name__:
            return True
    return False


def module_formats(qc: dict, model: nn.Module) -> dict[str, str]:
    """Quantized linear module -> runtime format, from a ``quantization_config`` (compressed-tensors).

    dynaquant's extension (``qc["dynaquant"]["formats"]``, and ``["expert_formats"]`` expanded to the per-expert
    modules of ``model``'s :class:`~dynaquant.runtime.moe.DynaExperts`) when present, else each config group's
    ``targets`` (``re:`` regexes, names or class names) minus ``ignore``, as compressed-tensors matches them.

    Raises:
        ValueError: not compressed-tensors, or a group in a scheme no runtime format matches.
    """
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"quant_method {qc.get('quant_method')!r}: dynaquant.load reads compressed-tensors checkpoints")
    ext = qc.get("dynaquant") or {}
    if ext.get("formats") or ext.get("expert_formats"):
        from dynaquant.runtime.moe import expand_expert_formats

        out = {m: get_format(f).name for m, f in (ext.get("formats") or {}).items()}
        out.update({m: get_format(f).name for m, f in expand_expert_formats(ext.get("expert_formats") or {}, model).items()})
        return out
    ignore = qc.get("ignore") or []
    groups = [(format_of_scheme(g), g.get("targets") or []) for g in (qc.get("config_groups") or {}).values()]
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _match(name, ignore, module):
            continue
        for fmt, targets in groups:
            if _match(name, targets, module):
                out[name] = fmt
                break
    return out


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted({str(n) for n in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{index}: not a safetensors index with a 'weight_map' object ({type(e).__name__}: {e})") from e
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    return files


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = value
    else:
        raise KeyError(name)


def load(path: str | os.PathLike, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
         kernels: bool = True, fuse: bool = True, trust_remote_code: bool = False):
    """Load a safetensors checkpoint written by ``dynaquant quantize --format safetensors`` (or any
    compressed-tensors checkpoint in runtime formats) as a transformers causal LM.

    Args:
        path: the checkpoint folder.
        device: where the model runs (default: CUDA when available, else CPU).
        dtype: of activations and unquantized weights (default: bfloat16 on CUDA, float32 on CPU).
        kernels: use ``dynaquant.kernels`` where it has a kernel (CUDA only); False: torch reference everywhere.
        fuse: with kernels, run q/k/v and gate/up as one call each (:func:`fuse_projections`), and each MoE layer's
            experts as two grouped launches (:func:`fuse_experts`).
        trust_remote_code: allow the checkpoint's own code (``auto_map``) in transformers' classes.
    Returns:
        The model in eval mode, quantized linear layers replaced by :class:`DynaLinear`, MoE experts modules
        stored per expert by :class:`~dynaquant.runtime.moe.DynaExperts`; ``generate`` works.
        A vision-language checkpoint (``exporters.hf_vl_full.VL_FULL_ARCHS``) loads with
        ``AutoModelForImageTextToText`` (vision tower, projector and language model).
    Raises:
        ValueError: not a checkpoint folder, not compressed-tensors, unsupported schemes, or tensors missing
            from / unexpected in the shards (named); ``checkpoint.RemoteCodeError`` (one) when the checkpoint
            needs its own code and ``trust_remote_code`` is off.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from dynaquant.sources.checkpoint import from_config, from_pretrained
    from dynaquant.sources.readers import open_safetensors, read_json_object

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json (not a checkpoint folder)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    raw = read_json_object(folder / "config.json")
    qc = raw.get("quantization_config") or {}
    config = from_pretrained(AutoConfig, folder, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    auto = AutoModelForCausalLM
    if (raw.get("architectures") or [None])[0] in _vl_archs():
        from transformers import AutoModelForImageTextToText as auto  # vision-language: the whole model
    with init_empty_weights():
        try:
            model = from_config(auto, config, trust_remote_code=trust_remote_code, folder=folder, dtype=dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = from_config(auto, config, trust_remote_code=trust_remote_code, folder=folder, torch_dtype=dtype)
    shards = _shards(folder)
    keys: set[str] = set()
    for shard in shards:
        with open_safetensors(shard) as f:
            keys.update(f.keys())
    from dynaquant.runtime.moe import replace_experts

    moe = replace_experts(model, keys, dtype=dtype)
    formats = module_formats(qc, model) if qc else {}
    for name, fmt in formats.items():
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{name}: quantized in the checkpoint but not a linear layer in the model")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                DynaLinear(old.in_features, old.out_features, fmt, old.bias is not None, device="meta", dtype=dtype))
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for shard in shards:
        with open_safetensors(shard) as f:
            for key in f.keys():
                if key not in expected:
                    unexpected.append(key)
                    continue
                t = f.get_tensor(key)
                mod = model.get_submodule(key.rpartition(".")[0])
                old = getattr(mod, key.rpartition(".")[2])
                if not isinstance(mod, DynaLinear) and tuple(t.shape) != tuple(old.shape):  # packed layouts differ
                    raise InputError(f"{shard}: tensor {key} has shape {list(t.shape)}, the model expects {list(old.shape)}")
                if t.is_floating_point() and not (isinstance(mod, DynaLinear) and key.rpartition(".")[2] != "bias"):
                    t = t.to(dtype)
                _set_tensor(model, key, t.to(device))
                loaded.add(key)
    if unexpected:
        raise ValueError(f"{folder}: tensors not in the model: {', '.join(sorted(unexpected)[:5])}")
    model.tie_weights()
    missing = sorted(n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta")
    if missing:
        raise ValueError(f"{folder}: tensors missing from the checkpoint: {', '.join(missing[:5])}")
    model.to(device)
    sw = (qc.get("dynaquant") or {}).get("super_weights") or {}
    for name, module in model.named_modules():
        if isinstance(module, DynaLinear):
            module.use_kernels = kernels
            module.set_super_weights(sw.get(name, ()))
            module.prepare()
    n_grouped = fuse_experts(model) if kernels and fuse else 0
    n_fused = fuse_projections(model) if kernels and fuse else 0
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    log.info("loaded %s: %d quantized linear layers (%d experts modules, %d grouped), %d with kernels (%d fused groups)",
             folder, len(formats), len(moe), n_grouped,
             sum(isinstance(m, DynaLinear) and (m._op is not None or m._fused is not None) for m in model.modules()),
             n_fused)
    return model.eval()


def _vl_archs() -> dict:
    from dynaquant.sources.hf_vl_full import VL_FULL_ARCHS

    return VL_FULL_ARCHS


def is_runtime_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a folder holds a compressed-tensors checkpoint (what :func:`load` reads)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"
