"""Image + text calibration for vision-language models.

The analysis of a VL checkpoint (:class:`dynaquant.sources.hf_vl_full.VLFullSource`) runs each
image through the model's processor together with a piece of the text calibration (wrapped in the
processor's chat template when it has one, else the image placeholder in front of the text), so the
vision tower, the projector, the language model (and Mllama's cross-attention layers) all see
activations and receive gradients; the plain text sequences follow as for a text model.

Images: the user's files (``CalibrationSpec.images``: image files and/or folders, read with PIL, RGB),
else :func:`synthetic_images`: deterministic smooth gradients, shapes, a checkerboard and noise at the
processor's native size.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def synthetic_images(n: int, height: int, width: int) -> list:
    """``n`` deterministic RGB PIL images of ``height`` x ``width``: a colour gradient, filled shapes on a
    gradient, a checkerboard, and smooth noise, in turn (image ``i`` varies with ``i``)."""
    from PIL import Image, ImageDraw

    out = []
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    for i in range(n):
        g = np.random.default_rng(1000 + i)
        kind = i % 4
        if kind == 0:
            a = np.stack([xx / max(width - 1, 1), yy / max(height - 1, 1), 1 - xx / max(width - 1, 1)], -1)
            img = Image.fromarray((255 * a).astype(np.uint8))
        elif kind == 1:
            base = np.stack([yy / max(height - 1, 1)] * 3, -1) * np.array([0.3, 0.6, 0.9])
            img = Image.fromarray((255 * base).astype(np.uint8))
            d = ImageDraw.Draw(img)
            for _ in range(3):
                x0, y0 = int(g.integers(0, width // 2)), int(g.integers(0, height // 2))
                box = [x0, y0, x0 + int(g.integers(width // 4, width // 2)), y0 + int(g.integers(height // 4, height // 2))]
                colour = tuple(int(c) for c in g.integers(0, 256, 3))
                (d.ellipse if g.random() < 0.5 else d.rectangle)(box, fill=colour)
        elif kind == 2:
            cell = max(2, min(height, width) // 8)
            a = (((yy // cell) + (xx // cell)) % 2)[..., None] * g.integers(64, 256, 3)
            img = Image.fromarray(a.astype(np.uint8))
        else:
            small = g.integers(0, 256, (max(height // 8, 2), max(width // 8, 2), 3)).astype(np.uint8)
            img = Image.fromarray(small).resize((width, height), Image.BILINEAR)
        out.append(img.convert("RGB"))
    return out


def load_images(paths) -> list:
    """RGB PIL images from files and folders (a folder: its image files, sorted by name).

    Raises:
        ValueError: a path that does not exist, a folder without images, or a file PIL cannot read (named).
    """
    from PIL import Image

    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise ValueError(f"{p}: no image files ({', '.join(IMAGE_SUFFIXES)}) in the calibration image folder")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"{p}: calibration image not found")
    out = []
    for f in files:
        try:
            with Image.open(f) as im:
                out.append(im.convert("RGB"))
        except Exception as exc:  # noqa: BLE001 - PIL raises many types; name the file
            raise ValueError(f"{f}: cannot be read as an image: {exc}") from exc
    return out


class Qwen2VLPromptProcessor:
    """A minimal Qwen2-VL processor (image processor + tokenizer), for environments where
    ``AutoProcessor`` cannot be built (transformers' Qwen2-VL processor needs torchvision for its video
    processor). ``__call__(text=..., images=[...])`` expands each ``<|image_pad|>`` to the image's
    ``grid.prod() / merge_size**2`` tokens as ``Qwen2VLProcessor`` does, and returns ``input_ids``,
    ``attention_mask``, ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (1 on image tokens)."""

    image_token = "<|image_pad|>"
    chat_template = None

    def __init__(self, image_processor, tokenizer):
        self.image_processor, self.tokenizer = image_processor, tokenizer

    def __call__(self, text: str, images=None, return_tensors: str = "pt") -> dict:
        px = self.image_processor(images=images, return_tensors="pt") if images else {}
        merge = int(getattr(self.image_processor, "merge_size", 2)) ** 2
        for grid in (px.get("image_grid_thw") if images else []):
            text = text.replace(self.image_token, "<|placeholder|>" * (int(grid.prod()) // merge), 1)
        text = text.replace("<|placeholder|>", self.image_token)
        ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])
        pad = self.tokenizer.convert_tokens_to_ids(self.image_token)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad).long()}
        out.update({k: px[k] for k in ("pixel_values", "image_grid_thw") if k in px})
        return out


def load_processor(folder: str | os.PathLike, tokenizer=None, *, trust_remote_code: bool = False):
    """The checkpoint's processor (``AutoProcessor``), or :class:`Qwen2VLPromptProcessor` for a Qwen2-VL
    folder whose processor transformers cannot build here. ``trust_remote_code``: the user's flag.

    Raises:
        ValueError: no processor can be loaded (names the folder and the cause).
        checkpoint.RemoteCodeError: the processor needs the checkpoint's own code and the flag is off.
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from dynaquant.sources.checkpoint import RemoteCodeError, from_pretrained

    trust = {"trust_remote_code": trust_remote_code}
    try:
        return from_pretrained(AutoProcessor, folder, **trust)
    except RemoteCodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - missing optional deps raise ImportError/AttributeError/...
        try:
            ip = from_pretrained(AutoImageProcessor, folder, **trust)
        except RemoteCodeError:
            raise
        except Exception as exc2:  # noqa: BLE001
            raise ValueError(f"{folder}: no processor or image processor can be loaded: {exc}; {exc2}") from exc2
        if type(ip).__name__.startswith(("Qwen2VLImageProcessor", "Qwen2_5_VL")):
            log.info("%s: AutoProcessor unavailable (%s); using the image processor and tokenizer", folder, exc)
            return Qwen2VLPromptProcessor(ip, tokenizer or from_pretrained(AutoTokenizer, folder, **trust))
        raise ValueError(f"{folder}: the processor cannot be loaded: {exc}") from exc


def native_size(processor) -> tuple[int, int]:
    """(height, width) in pixels the image processor keeps as is: ``crop_size`` / ``size`` of CLIP, SigLIP
    and Mllama processors (one tile), or for Qwen2-VL four merged patches a side (``patch_size *
    merge_size * 4``, 112 for the 14-pixel patches)."""
    ip = getattr(processor, "image_processor", processor)
    for attr in ("crop_size", "size"):
        s = getattr(ip, attr, None)
        s = s if isinstance(s, dict) else (vars(s) if s is not None and hasattr(s, "__dict__") else {})
        if s.get("height") and s.get("width"):
            return int(s["height"]), int(s["width"])
        if s.get("shortest_edge") and not s.get("longest_edge"):
            return int(s["shortest_edge"]), int(s["shortest_edge"])
    side = int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2)) * 4
    return side, side


def _prompt(processor, text: str) -> str:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(msgs, add_generation_prompt=False)
    token = getattr(processor, "image_token", None) or "<image>"
    if token == "<|image_pad|>":
        token = "<|vision_start|><|image_pad|><|vision_end|>"
    return token + text


def vl_calibration_samples(folder: str | os.PathLike, tokenizer, chunks: torch.Tensor, images=(), n_images: int = 2,
                           text_tokens: int = 48, *, trust_remote_code: bool = False) -> list[dict]:
    """Calibration batches for a VL model: one image + text batch per image, then the text chunks.

    Args:
        folder: the checkpoint folder (its processor is loaded from there).
        tokenizer: the checkpoint's tokenizer (decodes the text that goes with each image).
        chunks: (n, seq_len) int64 text calibration chunks.
        images: image files / folders (:func:`load_images`); empty: ``n_images`` :func:`synthetic_images`.
        text_tokens: tokens of text decoded from a chunk to go with each image.
        trust_remote_code: the user's flag, for the processor classes.
    Returns:
        ``[{"input_ids": (1, T) int64, "pixel_values": ..., ...}, ...]``: the processor's outputs for each
        image (keys depend on the architecture), then ``{"input_ids": (1, seq_len)}`` per text chunk.
    Raises:
        ValueError: as :func:`load_images` / :func:`load_processor`.
    """
    processor = load_processor(folder, tokenizer, trust_remote_code=trust_remote_code)
    pics = load_images(images) if images else synthetic_images(n_images, *native_size(processor))
    out = []
    for i, img in enumerate(pics):
        text = tokenizer.decode(chunks[i % chunks.shape[0], :text_tokens].tolist(), skip_special_tokens=True)
        batch = processor(text=_prompt(processor, text), images=[img], return_tensors="pt")
        out.append({k: v for k, v in dict(batch).items() if isinstance(v, torch.Tensor)})
    log.info("VL calibration: %d image+text batches (%s), %d text chunks", len(pics),
             "user images" if images else "synthetic images", chunks.shape[0])
    return out + [{"input_ids": c[None]} for c in chunks]
