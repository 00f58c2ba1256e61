"""The vision tower and projector of a Qwen2-VL / Qwen2.5-VL checkpoint as an mmproj GGUF.

llama.cpp runs a vision-language model from two files: the language model (architecture
``qwen2vl``, :mod:`.hf_vl`) and an "mmproj" file (architecture ``clip``, ``general.type =
mmproj``) that libmtmd loads beside it to turn images into embeddings.

Spec: llama.cpp's ``convert_hf_to_gguf.py --mmproj`` (``conversion/base.py`` ``MmprojModel``,
``conversion/qwenvl.py`` ``Qwen2VLVisionModel``) for what is written, and ``tools/mtmd/clip.cpp``
/ ``clip-impl.h`` / ``models/qwen2vl.cpp`` for what is read:

- keys: ``clip.has_vision_encoder``, ``clip.projector_type`` (``qwen2vl_merger`` /
  ``qwen2.5vl_merger``), ``clip.vision.{image_size, patch_size, embedding_length,
  feed_forward_length, block_count, attention.head_count, attention.layer_norm_epsilon,
  projection_dim (the text model's hidden size), image_mean, image_std, spatial_merge_size}``;
  Qwen2.5-VL adds ``clip.use_silu`` and ``clip.vision.n_wa_pattern`` (a full-attention block
  every n blocks, from ``fullatt_block_indexes``).
- tensors (gguf-py's ``MODEL_ARCH.MMPROJ`` name map): ``v.patch_embd.weight`` and
  ``v.patch_embd.weight.1``, the two temporal slices of the Conv3d patch embedding
  ``(embed, 3, 2, P, P)`` each ``(embed, 3, P, P)``; per block ``v.blk.N.{ln1, ln2, attn_q,
  attn_k, attn_v, attn_out, ffn_up, ffn_down[, ffn_gate]}`` with ``attn.qkv`` split in three
  along its rows; ``v.post_ln`` (``merger.ln_q``), ``mm.0`` and ``mm.2`` (the merger MLP).
- types: F32 for 1-D tensors (norms, biases); F16 (or F32 on request) for the rest, as the
  converter's ``--outtype f16``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFWriter

from dynaquant.exporters.gguf.writer import write_gguf
from dynaquant.quant.formats import get_format
from dynaquant.sources.gguf import SourceTensor, TensorSource
from dynaquant.sources.hf_vl import HFQwen2VLSource, is_vision_tensor, vl_legacy_name, vl_param_name
from dynaquant.sources.readers import open_safetensors, read_json_object

logger = logging.getLogger(__name__)

# HF vision config ``model_type`` (or the top-level one) -> clip projector type.
_PROJECTOR = {
    "qwen2_vl": gguf.VisionProjectorType.QWEN2VL,
    "qwen2_5_vl": gguf.VisionProjectorType.QWEN25VL,
}
_MMPROJ_FILE_TYPES = {"F16": gguf.LlamaFileType.MOSTLY_F16, "F32": gguf.LlamaFileType.ALL_F32}
# The window Qwen2.5-VL's clip graph assumes (clip.cpp: attn_window_size defaults to 112 and the
# qwen2.5vl_merger loader reads no window key).
_CLIP_QWEN25_WINDOW = 112


class MmprojSource(TensorSource):
    """The vision tower + projector of a Qwen2-VL / Qwen2.5-VL folder (see :func:`open_mmproj_source`).

    Attributes:
        arch: ``"clip"``.
        n_layers: vision blocks (``vision_config.depth``).
        model_type: ``"qwen2_vl"`` or ``"qwen2_5_vl"``.
        vision: the vision config (transformers' defaults filled in).
        preprocessor: the image processor config (``preprocessor_config.json``, merged with
            ``processor_config.json``'s ``image_processor`` when present).
    """

    arch = "clip"

    def __init__(self, folder: str | os.PathLike):
        self.lm = HFQwen2VLSource(folder)
        self.folder = self.lm.folder
        self.source_id = self.lm.source_id
        hp = self.lm._load_hparams_raw()
        self.model_type = str(hp.get("model_type", ""))
        if self.model_type not in _PROJECTOR:
            raise ValueError(f"{self.folder / 'config.json'}: model_type {self.model_type!r} has no mmproj "
                             f"conversion (known: {', '.join(_PROJECTOR)})")
        self.vision: dict[str, Any] = dict(hp.get("vision_config") or {})
        if not self.vision:
            raise ValueError(f"{self.folder / 'config.json'}: no vision_config")
        self.n_layers = int(self.vision["depth"])
        self.n_embd_text = int(self.lm.hparams.get("out_hidden_size") or self.lm.hparams["hidden_size"])
        self.preprocessor = self._load_preprocessor()
        self._tensors, self._read_of = self._index()
        logger.info("%s: %s vision tower -> mmproj (%s), %d blocks, %d tensors", self.folder, self.model_type,
                    _PROJECTOR[self.model_type], self.n_layers, len(self._tensors))

    # -- config ----------------------------------------------------------------------------

    def _load_preprocessor(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {}
        pre = self.folder / "preprocessor_config.json"
        if pre.is_file():
            cfg.update(read_json_object(pre))
        proc = self.folder / "processor_config.json"
        if proc.is_file():
            p = read_json_object(proc)
            cfg.update(p.get("image_processor") or {})
        if "image_mean" not in cfg or "image_std" not in cfg:
            raise ValueError(f"{self.folder}: no image_mean/image_std in preprocessor_config.json or "
                             "processor_config.json (the mmproj file needs the image normalisation)")
        return cfg

    @property
    def is_qwen25(self) -> bool:
        return self.model_type == "qwen2_5_vl"

    def _width(self) -> int:
        # Qwen2-VL: embed_dim is the vision width and hidden_size the text one; Qwen2.5-VL: hidden_size
        return int(self.vision["embed_dim"] if "embed_dim" in self.vision else self.vision["hidden_size"])

    def _ffn_length(self) -> int:
        if self.is_qwen25:
            return int(self.vision["intermediate_size"])
        return int(self._width() * float(self.vision.get("mlp_ratio", 4)))

    # -- tensors ---------------------------------------------------------------------------

    def _index(self) -> tuple[list[SourceTensor], dict[str, tuple[str, Any]]]:
        """(tensors in output order, gguf name -> (file key, slice of the stored tensor))."""
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(self.n_layers, 3))  # merger.mlp.{0,2}
        files = self.lm._files
        out: list[tuple[tuple, SourceTensor]] = []
        read_of: dict[str, tuple[str, Any]] = {}
        unmapped = []

        def add(gname: str, key: str, shape: tuple[int, ...], part: Any) -> None:
            st = SourceTensor(gname, vl_param_name(key), shape, quantizable=len(shape) >= 2)
            parts = gname.split(".")
            order = (1, int(parts[2]), gname) if parts[1] == "blk" else ((0 if "patch" in gname else 2), 0, gname)
            out.append((order, st))
            read_of[gname] = (key, part)

        for key, path in files.items():
            if not is_vision_tensor(key):
                continue
            with open_safetensors(path) as f:
                shape = tuple(int(n) for n in f.get_slice(key).get_shape())
            gname = name_map.get_name(vl_legacy_name(key), try_suffixes=(".weight", ".bias"))
            if gname is None:
                unmapped.append(key)
                continue
            if ".attn_qkv." in gname:
                if shape[0] % 3:
                    raise ValueError(f"{path}: {key} has {shape[0]} rows, not a multiple of 3 (fused q/k/v)")
                c = shape[0] // 3
                for i, which in enumerate(("attn_q", "attn_k", "attn_v")):
                    add(gname.replace("attn_qkv", which), key, (c, *shape[1:]), ("rows", i * c, (i + 1) * c))
            elif gname == "v.patch_embd.weight":
                if len(shape) != 5 or shape[2] != 2:
                    raise ValueError(f"{path}: {key} has shape {shape}; expected a Conv3d (embed, C, 2, P, P) "
                                     "(llama.cpp supports temporal_patch_size 2 only)")
                kshape = (shape[0], shape[1], shape[3], shape[4])
                add("v.patch_embd.weight", key, kshape, ("temporal", 0))
                add("v.patch_embd.weight.1", key, kshape, ("temporal", 1))
            else:
                add(gname, key, shape, None)
        if unmapped:
            raise ValueError(f"{self.folder}: vision tensors with no mmproj name: {', '.join(sorted(unmapped)[:10])}")
        names = {st.gguf_name for _, st in out}
        for need in ("v.patch_embd.weight", "mm.0.weight", "mm.2.weight", "v.blk.0.attn_q.weight"):
            if need not in names:
                raise ValueError(f"{self.folder}: no {need} among the vision tensors")
        out.sort(key=lambda kt: kt[0])
        return [st for _, st in out], read_of

    def tensors(self) -> list[SourceTensor]:
        return list(self._tensors)

    def read(self, t: SourceTensor) -> torch.Tensor:
        """One tensor as float32 of shape ``t.shape`` (q/k/v rows of the fused ``attn.qkv``; one
        temporal slice of the patch embedding).

        Raises:
            KeyError: not a tensor of this source.
        """
        key, part = self._read_of[t.gguf_name]
        with open_safetensors(self.lm._files[key]) as f:
            x = f.get_tensor(key).to(torch.float32)
        if part is not None and part[0] == "rows":
            x = x[part[1]:part[2]]
        elif part is not None and part[0] == "temporal":
            x = x[:, :, part[1]]
        if tuple(x.shape) != t.shape:
            raise ValueError(f"{key}: read shape {tuple(x.shape)}, expected {t.shape}")
        return x.contiguous()

    # -- metadata --------------------------------------------------------------------------

    def add_metadata(self, w: GGUFWriter) -> None:
        """general.* and the clip keys of the module doc.

        Raises:
            ValueError: a Qwen2.5-VL config whose ``fullatt_block_indexes`` are not evenly spaced,
                or whose ``window_size`` is not the 112 llama.cpp's graph assumes; an
                activation llama.cpp's clip graph does not have.
        """
        v = self.vision
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_name(f"{self.folder.name} vision")
        w.add_clip_has_vision_encoder(True)
        w.add_clip_projector_type(_PROJECTOR[self.model_type])
        w.add_vision_projection_dim(self.n_embd_text)
        w.add_vision_image_size(int(v.get("image_size", 560)))
        w.add_vision_patch_size(int(v["patch_size"]))
        w.add_vision_embedding_length(self._width())
        w.add_vision_feed_forward_length(self._ffn_length())
        w.add_vision_block_count(self.n_layers)
        w.add_vision_head_count(int(v["num_heads"]))
        # Qwen2-VL's LayerNorm and Qwen2.5-VL's RMSNorm both use eps 1e-6 in transformers
        w.add_vision_attention_layernorm_eps(float(v.get("layer_norm_eps", 1e-6)))
        w.add_vision_image_mean([float(x) for x in self.preprocessor["image_mean"]])
        w.add_vision_image_std([float(x) for x in self.preprocessor["image_std"]])
        w.add_vision_spatial_merge_size(int(v.get("spatial_merge_size", 2)))
        act = str(v.get("hidden_act", "quick_gelu"))
        if act == "silu":
            w.add_vision_use_silu(True)
        elif act == "gelu":
            w.add_vision_use_gelu(True)
        elif act != "quick_gelu":  # clip's default FFN op
            raise ValueError(f"{self.folder / 'config.json'}: vision hidden_act {act!r} has no llama.cpp clip op")
        if self.is_qwen25:
            full = [int(i) for i in v.get("fullatt_block_indexes") or []]
            if not full:
                raise ValueError(f"{self.folder / 'config.json'}: Qwen2.5-VL needs vision_config.fullatt_block_indexes")
            n_wa = full[0] + 1
            if any(b - a != n_wa for a, b in zip(full, full[1:])):
                raise ValueError(f"{self.folder / 'config.json'}: fullatt_block_indexes {full} are not every "
                                 f"{n_wa} blocks, which is all llama.cpp's n_wa_pattern can say")
            w.add_vision_n_wa_pattern(n_wa)
            if int(v.get("window_size", _CLIP_QWEN25_WINDOW)) != _CLIP_QWEN25_WINDOW:
                raise ValueError(f"{self.folder / 'config.json'}: window_size {v['window_size']}; llama.cpp's "
                                 f"qwen2.5vl_merger graph assumes {_CLIP_QWEN25_WINDOW}")


def open_mmproj_source(folder: str | os.PathLike) -> MmprojSource:
    """Open the vision tower + projector of a Qwen2-VL / Qwen2.5-VL checkpoint folder.

    Raises:
        ValueError: not a Qwen2-VL/Qwen2.5-VL folder, no vision_config, no image mean/std, or
            vision tensors missing or with no mmproj name (messages name the folder or file).
    """
    return MmprojSource(folder)


def mmproj_path_for(model_path: str | os.PathLike) -> Path:
    """Where the mmproj file of a language-model GGUF goes: ``mmproj-<name>`` beside it."""
    p = Path(model_path)
    return p.with_name(f"mmproj-{p.name}")


def write_mmproj(folder: str | os.PathLike, out_path: str | os.PathLike, ftype: str = "F16",
                 progress: bool = False) -> Path:
    """Write the mmproj GGUF of a Qwen2-VL / Qwen2.5-VL checkpoint folder.

    Args:
        folder: the HF checkpoint folder (``config.json``, safetensors, ``preprocessor_config.json``).
        out_path: the GGUF to write (temporary file, read back, renamed; see :func:`write_gguf`).
        ftype: ``"F16"`` (matrices and the patch embedding in F16) or ``"F32"``; 1-D tensors
            are F32 either way.
        progress: a tqdm bar over tensors.
    Returns:
        ``out_path`` as a Path.
    Raises:
        ValueError: an unknown ``ftype``, or any error of :func:`open_mmproj_source`.
    """
    if ftype not in _MMPROJ_FILE_TYPES:
        raise ValueError(f"mmproj ftype {ftype!r}: choose one of {', '.join(_MMPROJ_FILE_TYPES)}")
    src = open_mmproj_source(folder)
    f32, big = get_format("F32"), get_format(ftype)
    types = {t.gguf_name: (big if t.quantizable else f32) for t in src.tensors()}

    def encode(t: SourceTensor, x: torch.Tensor, fmt) -> np.ndarray:
        return x.numpy().astype(np.float16 if fmt.name == "F16" else np.float32)

    write_gguf(out_path, src, types, encode, {}, file_type=int(_MMPROJ_FILE_TYPES[ftype]), progress=progress)
    logger.info("%s: wrote mmproj %s (%s)", folder, out_path, ftype)
    return Path(out_path)
