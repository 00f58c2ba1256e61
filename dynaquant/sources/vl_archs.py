"""Which vision-language architecture a checkpoint folder holds: facts of its ``config.json``.

Two sets: :data:`VL_ARCHS`, whose language model converts to a GGUF (:mod:`.hf_vl`; the vision tower goes to
an mmproj file), and :data:`VL_FULL_ARCHS`, whose every tensor the analysis and the safetensors target read
(:mod:`.hf_vl_full`); :data:`SAFETENSORS_ONLY_ARCHS` have no GGUF export. The sources, ``model.load_model``
and the pipeline ask here which source class or transformers auto class a folder needs.
"""

from __future__ import annotations

import os
from pathlib import Path

from dynaquant.sources.readers import read_json_object

# HF ``architectures[0]`` of the vision-language checkpoints whose language model converts to GGUF -> GGUF
# architecture of their language model.
VL_ARCHS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "qwen2vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2vl",
}
# HF ``architectures[0]`` of the vision-language checkpoints read whole (hf_vl_full) -> GGUF architecture of
# the text model's tensor names.
VL_FULL_ARCHS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "qwen2vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2vl",
    "LlavaForConditionalGeneration": "llama",
    "MllamaForConditionalGeneration": "llama",  # cross-attention layers named here (gguf-py has no mllama)
}
# VL architectures analysed, planned and run through safetensors only (no GGUF writer).
SAFETENSORS_ONLY_ARCHS = ("LlavaForConditionalGeneration", "MllamaForConditionalGeneration")


def config_architectures(folder: str | os.PathLike):
    """``architectures`` of ``folder/config.json`` as the file has it (``[]`` when absent, empty, or there is no
    config.json: the caller's own checks report that).

    Raises:
        InputError: config.json cannot be read or is not a JSON object.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        return []
    return read_json_object(path).get("architectures") or []


def is_vl_checkpoint(folder: str | os.PathLike) -> bool:
    """True when ``folder/config.json`` names an architecture of :data:`VL_ARCHS` (False when
    there is no config.json: the caller's own checks report that)."""
    archs = config_architectures(folder)
    return bool(archs) and archs[0] in VL_ARCHS


def vl_full_arch(folder: str | os.PathLike) -> str | None:
    """``architectures[0]`` of ``folder/config.json`` when it is one of :data:`VL_FULL_ARCHS`, else None."""
    archs = config_architectures(folder)
    return archs[0] if archs and archs[0] in VL_FULL_ARCHS else None
