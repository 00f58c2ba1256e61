"""Source facts the stages share: the tensor source of a model, its tensors, the planner's model facts, and the
imatrix re-keyed to the source's GGUF names. Nothing here loads a model or reads tensor data."""

from __future__ import annotations

from pathlib import Path

import torch

from dynaquant.analysis.imatrix import Imatrix
from dynaquant.names import hf_to_gguf_name
from dynaquant.quant.plan import TensorInfo
from dynaquant.quant.presets import ModelInfo
from dynaquant.sources.checkpoint import ModelSource
from dynaquant.sources.gguf import TensorSource, gguf_int, open_gguf_source


def default_device() -> str:
    """``cuda`` when a CUDA device is present, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def open_tensor_source(source: ModelSource, full_vl: bool = False) -> TensorSource:
    """The exporter's tensor source for a model source (GGUF file or HF folder).

    ``full_vl``: for a vision-language folder, every tensor (language model, vision tower, projector;
    :mod:`.exporters.hf_vl_full`), as the analysis and the safetensors target use; otherwise what the GGUF
    writer takes (Qwen2-VL's language model; LLaVA / Mllama refused, naming the file).
    """
    if source.kind == "gguf":
        return open_gguf_source(source.path)
    from dynaquant.sources.open import open_hf_source

    if full_vl:
        from dynaquant.sources.hf_vl_full import open_vl_full_source
        from dynaquant.sources.vl_archs import vl_full_arch

        if vl_full_arch(source.path):
            return open_vl_full_source(source.path, trust_remote_code=source.trust_remote_code)

    return open_hf_source(source.path, trust_remote_code=source.trust_remote_code)


def tensor_infos(ts: TensorSource) -> list[TensorInfo]:
    """The planner's view of every source tensor: GGUF name, HF name, shape, quantizable."""
    return [TensorInfo(t.gguf_name, t.hf_name, tuple(t.shape), t.quantizable) for t in ts.tensors()]


FLOAT_TYPES = frozenset({"F64", "F32", "F16", "BF16"})  # GGML types that store weights unquantized


def source_bytes(ts: TensorSource) -> int | None:
    """The bytes of the files holding the source's tensors (a GGUF, its shards, or a folder's ``*.safetensors``), or
    None when a tensor's file is not known (``file_of`` names a folder or a hub id)."""
    files = {Path(ts.file_of(t)) for t in ts.tensors()}
    return sum(f.stat().st_size for f in files) if files and all(f.is_file() for f in files) else None


def quantized_source(ts: TensorSource) -> bool:
    """True when most of the source's weights (by count) are stored in a quantized GGML type: a GGUF of Q4_1, Q8_0,
    IQ2_XS, ... (an F16 / BF16 / F32 GGUF or an HF folder: False)."""
    stored = getattr(ts, "stored_type", None)
    if stored is None:
        return False
    tensors = ts.tensors()
    quantized = sum(t.numel for t in tensors if stored(t).name not in FLOAT_TYPES)
    return 2 * quantized > sum(t.numel for t in tensors)


def kept_types(ts: TensorSource, allow_nonfinite: bool) -> dict[str, str]:
    """GGUF name -> the GGML type a GGUF source stores the tensor in: a tensor planned in that type keeps the source's
    bytes (their decoding is the source weight itself, error 0; the analysis measures it so, the GGUF target writes
    them, GPTQ leaves them). Empty with ``allow_nonfinite`` (the run's weights may then differ from the stored ones)
    and for sources that do not store GGUF types."""
    return {} if allow_nonfinite else ts.stored_types()


def model_info(ts: TensorSource) -> ModelInfo:
    """Model facts for the planner, from the source's metadata (no model is loaded)."""
    names = {t.gguf_name for t in ts.tensors()}
    reader = getattr(ts, "reader", None)
    expert_format = None
    n_head, n_head_kv = getattr(ts, "n_head", 1), getattr(ts, "n_head_kv", 1)
    if reader is not None:
        n_expert = gguf_int(reader, ts.path, f"{ts.arch}.expert_count") or 0
    else:
        cfg = getattr(ts, "config", {})
        n_expert = int(getattr(ts, "n_expert", 0) or cfg.get("num_local_experts") or cfg.get("num_experts")
                       or cfg.get("n_routed_experts") or 0)
        qc = cfg.get("quantization_config") or {}
        if n_expert and str(qc.get("quant_method", "")).lower() == "mxfp4":
            expert_format = "MXFP4"  # gpt-oss: routed experts stored as OCP MXFP4
    return ModelInfo(n_layers=ts.n_layers, n_head=n_head, n_head_kv=n_head_kv, n_expert=n_expert,
                     tied_embeddings="output.weight" not in names, expert_format=expert_format)


def imatrix_by_gguf_name(im: Imatrix, ts: TensorSource) -> dict[str, torch.Tensor]:
    """Re-key an imatrix from HF module names to GGUF tensor names ((K,) float32 each).

    The lm_head's statistics go to ``output.weight``, or to ``token_embd.weight`` when the
    embedding is tied (llama.cpp's imatrix does the same: the output matmul reads it).
    """
    names = {t.gguf_name for t in ts.tensors()}
    # the source's own names first (a VL language model's modules are model.language_model.*)
    by_module = {t.hf_name[: -len(".weight")]: t.gguf_name for t in ts.tensors() if t.hf_name and t.hf_name.endswith(".weight")}
    out: dict[str, torch.Tensor] = {}
    for hf in im.names():
        g = by_module.get(hf) or hf_to_gguf_name(ts.arch, ts.n_layers, hf)
        if g is None:
            continue
        g = g if g.endswith(".weight") else g + ".weight"
        if g == "output.weight" and g not in names:
            g = "token_embd.weight"
        if g in names:
            out[g] = im.mean(hf)
    return out


def imatrix_from_file(path: Path, ts: TensorSource, info: ModelInfo) -> dict[str, torch.Tensor]:
    """GGUF name -> (K,) importance from an imatrix file; ``output.weight`` serves a tied ``token_embd``."""
    from dynaquant.analysis.imatrix_io import load_imatrix

    means = load_imatrix(path).means()
    names = {t.gguf_name for t in ts.tensors()}
    if info.tied_embeddings and "output.weight" in means:
        means["token_embd.weight"] = means.pop("output.weight")
    return {k: v for k, v in means.items() if k in names}
