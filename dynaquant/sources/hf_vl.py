"""The language model of a Qwen2-VL / Qwen2.5-VL checkpoint as a GGUF tensor source.

Spec: llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/qwenvl.py`` ``Qwen2VLModel``, a
``TextModel`` of architecture ``qwen2vl``; ``conversion/base.py`` ``TextModel.filter_tensors``
drops the ``visual.`` tensors and ``set_gguf_parameters`` writes ``rope.dimension_sections``)
and llama.cpp's loader (``src/models/qwen2vl.cpp``: the four M-RoPE sections are required).
Qwen2-VL and Qwen2.5-VL share the text model: Qwen2 blocks (q/k/v biases, NEOX RoPE, no q/k
permutation) whose rotary dimensions are split into temporal/height/width sections
(``rope_parameters.mrope_section``, padded to four with zeros).

Tensor names. Checkpoints store either the transformers 4 layout (``model.layers.N...``,
``visual.blocks.N...``; what the hub's Qwen2-VL files and transformers 5's ``save_pretrained``
write) or the transformers 5 module layout (``model.language_model.layers.N...``,
``model.visual.blocks.N...``). :func:`vl_param_name` turns either into the parameter name of the
loaded transformers 5 model (``SourceTensor.hf_name``, what ``model.get_parameter`` finds) and
:func:`vl_legacy_name` into the layout gguf-py's ``TensorNameMap`` knows.

The vision tower and projector go to a separate ``clip`` GGUF: :mod:`dynaquant.exporters.gguf.mmproj`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dynaquant.names import hf_to_gguf_name
from dynaquant.sources.checkpoint import RemoteCodeError, from_pretrained
from dynaquant.sources.gguf import SourceTensor
from dynaquant.sources.hf import SKIPPED_TENSOR_SUFFIXES, HFCheckpointSource

logger = logging.getLogger(__name__)

def vl_param_name(name: str) -> str:
    """The transformers 5 parameter name of a Qwen2-VL checkpoint tensor.

    ``model.layers.0.mlp.up_proj.weight`` -> ``model.language_model.layers.0.mlp.up_proj.weight``;
    ``visual.blocks.0.attn.qkv.weight`` -> ``model.visual.blocks.0.attn.qkv.weight``;
    names already in that layout, and ``lm_head.weight``, are returned unchanged.
    """
    if name.startswith(("model.language_model.", "model.visual.", "lm_head.")):
        return name
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def vl_legacy_name(name: str) -> str:
    """The transformers 4 name (``model.layers...``, ``visual....``) of a checkpoint tensor in either
    layout: the names gguf-py's ``TensorNameMap`` maps."""
    p = vl_param_name(name)
    if p.startswith("model.language_model."):
        return "model." + p[len("model.language_model."):]
    if p.startswith("model.visual."):
        return p[len("model."):]
    return p


def is_vision_tensor(name: str) -> bool:
    """True for the vision tower and projector (``visual.*`` in either layout)."""
    return vl_param_name(name).startswith("model.visual.")


def merged_text_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """A VL config dict with ``text_config`` lifted to the top level (as the converter's
    ``TextModel`` does); ``vision_config`` and the other top-level keys stay. Raises nothing:
    a config without ``text_config`` (transformers 4 Qwen2-VL) is returned as a copy."""
    hp = dict(config)
    text = hp.get("text_config") or {}
    hp.update({k: v for k, v in text.items() if v is not None or k not in hp})
    return hp


class HFQwen2VLSource(HFCheckpointSource):
    """The language model of a Qwen2-VL / Qwen2.5-VL folder (see :func:`open_hf_vl_source`).

    Attributes (besides :class:`HFCheckpointSource`'s):
        mrope_section: the four M-RoPE sections (rotary pairs per temporal/height/width/extra
            axis; they sum to ``head_dim / 2``).
    """

    def __init__(self, folder: str | os.PathLike, *, trust_remote_code: bool = False):
        super().__init__(folder, trust_remote_code=trust_remote_code)
        section = list(self.rope.get("mrope_section") or [])
        if not section:
            raise ValueError(f"{self.folder / 'config.json'}: no rope_parameters.mrope_section in the text config")
        if len(section) > 4:
            raise ValueError(f"{self.folder / 'config.json'}: mrope_section {section} has more than 4 sections")
        self.mrope_section = [int(s) for s in section] + [0] * (4 - len(section))
        if 2 * sum(self.mrope_section) != self._rope_dim():
            raise ValueError(
                f"{self.folder / 'config.json'}: mrope_section {section} sums to {sum(section)}, "
                f"expected head_dim / 2 = {self._rope_dim() // 2}"
            )
        # "mrope" (transformers 4) / "default" (transformers 5) are plain RoPE per section
        if str(self.rope.get("rope_type", self.rope.get("type", ""))) in ("mrope", "default"):
            self.rope["rope_type"] = "default"

    def _load_hparams(self) -> dict[str, Any]:
        hp = merged_text_hparams(self._load_hparams_raw())
        for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
            if key not in hp:
                raise ValueError(f"{self.folder / 'config.json'}: missing {key!r} (top level or text_config)")
        return hp

    def _load_hparams_raw(self) -> dict[str, Any]:
        # transformers' config class fills defaults; the raw JSON is the fallback
        try:
            from transformers import AutoConfig

            return from_pretrained(AutoConfig, self.folder, trust_remote_code=self.trust_remote_code).to_dict()
        except RemoteCodeError:
            raise  # the checkpoint's own code is needed: never fall back silently
        except Exception as e:  # noqa: BLE001 - any failure falls back to the raw file
            logger.warning("%s: transformers could not load the config (%s); using config.json as is", self.folder, e)
            return dict(self.config)

    def _index_tensors(self) -> tuple[list[SourceTensor], dict[str, str]]:
        from dynaquant.sources.readers import open_safetensors

        by_file: dict = {}
        for name, p in self._files.items():
            by_file.setdefault(p, []).append(name)
        tensors: list[tuple[tuple, SourceTensor]] = []
        hf_of: dict[str, str] = {}
        unmapped = []
        for p, names in by_file.items():
            with open_safetensors(p) as f:
                for key in names:
                    if key.endswith(SKIPPED_TENSOR_SUFFIXES) or is_vision_tensor(key):
                        continue
                    param = vl_param_name(key)
                    if param.startswith("lm_head.") and self.tied:
                        continue
                    gguf_name = hf_to_gguf_name(self.arch, self.n_layers, vl_legacy_name(key))
                    if gguf_name is None:
                        unmapped.append(key)
                        continue
                    shape = tuple(int(n) for n in f.get_slice(key).get_shape())
                    st = SourceTensor(gguf_name, param, shape, quantizable=len(shape) >= 2 and gguf_name.endswith(".weight"))
                    tensors.append((self._order_key(gguf_name), st))
                    hf_of[gguf_name] = key  # the file's own name: read() opens it by this
        self._check_index(tensors, unmapped, what="text tensors")
        tensors.sort(key=lambda kt: kt[0])
        return [st for _, st in tensors], hf_of

    def _add_hparams(self, w) -> None:
        super()._add_hparams(w)
        w.add_rope_dimension_sections(self.mrope_section)

    @property
    def has_vision(self) -> bool:
        """True when the checkpoint holds a vision tower (``write_mmproj`` can write it)."""
        return any(is_vision_tensor(k) for k in self._files)


def open_hf_vl_source(folder: str | os.PathLike, *, trust_remote_code: bool = False) -> HFQwen2VLSource:
    """Open the language model of a Qwen2-VL / Qwen2.5-VL checkpoint folder as a tensor source
    (GGUF architecture ``qwen2vl``; vision tensors left out, see :mod:`.mmproj`).

    Raises:
        ValueError: no config.json, not a VL architecture of :data:`.vl_archs.VL_ARCHS`, no safetensors,
            tensors with no GGUF name, or a missing/invalid ``mrope_section``.
    """
    return HFQwen2VLSource(folder, trust_remote_code=trust_remote_code)
