"""Every tensor of a vision-language checkpoint (language model, vision tower, projector) as a tensor
source, for the analysis and the safetensors target.

Architectures (transformers 5 modelling code, :data:`.vl_archs.VL_FULL_ARCHS`):

- ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``: Qwen2 text model,
  ViT (``model.visual.blocks.N``) and patch merger (``model.visual.merger``);
- ``LlavaForConditionalGeneration``: Llama/Mistral text model, CLIP or SigLIP vision tower
  (``model.vision_tower``), two-layer MLP projector (``model.multi_modal_projector``);
- ``MllamaForConditionalGeneration`` (Llama 3.2 Vision): Llama text model whose layers in
  ``text_config.cross_attention_layers`` are cross-attention layers, a local and a global ViT stack
  (``model.vision_model.transformer`` / ``global_transformer``), one linear projector.

Design: the GGUF path is untouched. :class:`~.hf_vl.HFQwen2VLSource` (``open_hf_source``) still lists
only Qwen2-VL's language model, which is what the main GGUF holds (the vision tower goes to the mmproj
file); :class:`VLFullSource` is a separate source that ``analyze`` and ``quantize --format safetensors``
open (``pipeline.open_tensor_source(source, full_vl=True)``). LLaVA and Mllama have no GGUF export:
:func:`refuse_gguf` names the file and says to use ``--format safetensors``.

Plan names (``SourceTensor.gguf_name``):

- text model: the GGUF names of the text architecture (``blk.N.attn_q.weight``, ``token_embd.weight``);
  Mllama's cross-attention layers ``blk.N.cross_attn_{q,k,v,o}.weight``, ``blk.N.cross_attn_{q,k}_norm.weight``
  and the gates ``blk.N.cross_attn_attn_gate`` / ``blk.N.cross_attn_mlp_gate``;
- vision tower: ``v.blk.N.<kind>.weight`` (Qwen2-VL: the mmproj GGUF names gguf-py gives, e.g.
  ``v.blk.0.attn_qkv.weight``; other towers ``attn_q/attn_k/attn_v/attn_out/ffn_up/ffn_down/ln1/ln2``),
  Mllama's global stack ``v.global.blk.N.<kind>.weight``, other vision tensors ``v.<path>``;
- projector: ``mm.<i>.weight`` (LLaVA ``linear_1`` -> ``mm.0``, ``linear_2`` -> ``mm.2``, as llama.cpp's
  llava mmproj; Qwen2-VL ``merger.mlp.0/2`` -> ``mm.0/2``; Mllama's single linear -> ``mm.0``).

``SourceTensor.hf_name`` is the parameter name of the model transformers 5 loads
(``model.get_parameter`` finds it); tensors are quantizable when their module is an ``nn.Linear``
that the runtime can swap for a DynaLinear (not the ``out_proj`` of an ``nn.MultiheadAttention``, which
reads the weight itself: SigLIP's pooling head), plus the token embedding, as for text models.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from dynaquant.names import TensorName, hf_to_gguf_name
from dynaquant.sources.checkpoint import from_config, from_pretrained
from dynaquant.sources.gguf import SourceTensor, TensorSource
from dynaquant.sources.readers import open_safetensors, read_json_object
from dynaquant.sources.vl_archs import SAFETENSORS_ONLY_ARCHS, VL_FULL_ARCHS, vl_full_arch

logger = logging.getLogger(__name__)

# HF architectures[0] -> GGUF-style architecture used for the text model's names.
_VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.vision_model.")
_PROJECTOR_PREFIX = "model.multi_modal_projector"
_CROSS = re.compile(r"^model\.layers\.(\d+)\.cross_attn(?:_(attn|mlp)_gate|\.(q|k|v|o)_proj\.weight|\.(q|k)_norm\.weight)$")
_VISION_LEAF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out", "self_attn.o_proj": "attn_out", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
    "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "layer_norm1": "ln1", "layer_norm2": "ln2", "norm1": "ln1", "norm2": "ln2",
    "input_layernorm": "ln1", "post_attention_layernorm": "ln2", "gate_attn": "attn_gate", "gate_ffn": "ffn_gate_scalar",
}


def refuse_gguf(folder: str | os.PathLike) -> None:
    """Raise for a LLaVA / Mllama folder sent to the GGUF writer.

    Raises:
        ValueError: naming ``config.json`` and the architecture, pointing to ``--format safetensors``.
    """
    arch = vl_full_arch(folder)
    if arch in SAFETENSORS_ONLY_ARCHS:
        why = ("the llama.cpp of llama-cpp-python has no Mllama support" if arch.startswith("Mllama")
               else "LLaVA GGUF export (language model + CLIP mmproj) is not implemented")
        raise ValueError(
            f"{Path(folder) / 'config.json'}: {arch} has no GGUF export in dynaquant ({why}); quantize it with "
            "'--format safetensors' (target='safetensors') and run it with dynaquant.load")


def file_key_to_param(key: str) -> str:
    """The transformers 5 parameter name of a checkpoint key in either layout.

    ``language_model.model.layers.0...`` -> ``model.language_model.layers.0...``;
    ``language_model.lm_head.weight`` -> ``lm_head.weight``; ``vision_tower.*`` / ``vision_model.*`` /
    ``visual.*`` / ``multi_modal_projector.*`` -> ``model.<same>``; Qwen2-VL's ``model.layers.*`` ->
    ``model.language_model.layers.*``; names already in the new layout unchanged.
    """
    if key.startswith("language_model.model."):
        return "model.language_model." + key[len("language_model.model."):]
    if key.startswith("language_model.lm_head."):
        return key[len("language_model."):]
    if key.startswith(("vision_tower.", "vision_model.", "visual.", "multi_modal_projector.")):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", *_VISION_PREFIXES, _PROJECTOR_PREFIX)):
        return "model.language_model." + key[len("model."):]
    return key


def _mmproj_map(n_layers: int):
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(n_layers, 3))


def vision_plan_name(param: str, qwen_map=None) -> str:
    """The plan name of a vision-tower or projector parameter (module docstring), e.g.
    ``model.vision_tower.encoder.layers.1.mlp.fc2.weight`` -> ``v.blk.1.ffn_down.weight``."""
    if param.startswith(_PROJECTOR_PREFIX):
        rest = param[len(_PROJECTOR_PREFIX):].lstrip(".")
        rest = rest.replace("linear_1.", "0.").replace("linear_2.", "2.")
        return "mm." + (rest if rest[:1].isdigit() else "0." + rest if rest in ("weight", "bias") else rest)
    if param.startswith("model.visual.merger."):
        rest = param[len("model.visual.merger."):]
        return "mm." + rest[len("mlp."):] if rest.startswith("mlp.") else "mm." + rest
    if qwen_map is not None and param.startswith("model.visual."):
        g = qwen_map.get_name(param[len("model."):], try_suffixes=(".weight", ".bias"))
        if g is not None:
            return g
    prefix = next(p for p in _VISION_PREFIXES if param.startswith(p))
    rest = param[len(prefix):]
    tn = TensorName.from_hf(rest)
    if tn.block is not None and tn.leaf:
        leaf, _, suffix = tn.leaf.rpartition(".")
        *stack_path, _, block = tn.prefix.split(".")  # the block index as written
        stack = "v.global.blk" if stack_path == ["global_transformer"] else "v.blk"
        if not leaf:  # a bare parameter of the layer (Mllama's gate_attn / gate_ffn)
            return f"{stack}.{block}.{_VISION_LEAF.get(suffix, suffix)}"
        return f"{stack}.{block}.{_VISION_LEAF.get(leaf, leaf.replace('.', '_'))}.{suffix}"
    return "v." + rest


class VLFullSource(TensorSource):
    """All tensors of a VL checkpoint folder (module docstring). Attributes as ``HFCheckpointSource``'s
    that the planner reads: ``folder``, ``config``, ``hf_arch``, ``arch`` (text naming architecture),
    ``n_layers``, ``n_head``, ``n_head_kv``, ``n_expert`` (0), ``tied``; ``vision`` is True (the analysis
    calibrates with images)."""

    vision = True
    n_expert = 0
    hf_orientation = True  # tensors read as the model holds them (no llama.cpp q/k permutation)

    def __init__(self, folder: str | os.PathLike, *, trust_remote_code: bool = False):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForImageTextToText

        self.folder = Path(folder)
        self.trust_remote_code = trust_remote_code
        self.source_id = str(self.folder)
        self.hf_arch = vl_full_arch(self.folder)
        if self.hf_arch is None:
            raise ValueError(f"{self.folder / 'config.json'}: not a vision-language architecture of {', '.join(VL_FULL_ARCHS)}")
        self.config = read_json_object(self.folder / "config.json")
        self.arch = VL_FULL_ARCHS[self.hf_arch]
        cfg = from_pretrained(AutoConfig, self.folder, trust_remote_code=trust_remote_code)
        text = cfg.get_text_config()
        self.n_layers = int(text.num_hidden_layers)
        self.n_head = int(text.num_attention_heads)
        self.n_head_kv = int(getattr(text, "num_key_value_heads", None) or self.n_head)
        self.tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False))
        with init_empty_weights():
            model = from_config(AutoModelForImageTextToText, cfg, trust_remote_code=trust_remote_code, folder=self.folder)
        self._tensors, self._key_of = self._index(model)
        logger.info("%s: %s, %d tensors (language model, vision tower, projector)", self.folder, self.hf_arch,
                    len(self._tensors))

    def _files(self) -> dict[str, Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            return {k: self.folder / v for k, v in (read_json_object(index).get("weight_map") or {}).items()}
        files: dict[str, Path] = {}
        for p in sorted(self.folder.glob("*.safetensors")):
            with open_safetensors(str(p)) as f:
                files.update({k: p for k in f.keys()})  # noqa: SIM118 - safe_open has keys(), no __iter__
        if not files:
            raise ValueError(f"{self.folder}: no *.safetensors files")
        return files

    def _text_name(self, param: str) -> str | None:
        legacy = "model." + param[len("model.language_model."):] if param.startswith("model.language_model.") else param
        if (m := _CROSS.match(legacy)) is not None:
            layer, gate, proj, norm = m.groups()
            kind = f"{gate}_gate" if gate else f"{proj}.weight" if proj else f"{norm}_norm.weight"
            return f"blk.{layer}.cross_attn_{kind}"
        return hf_to_gguf_name(self.arch, self.n_layers, legacy)

    def _index(self, model) -> tuple[list[SourceTensor], dict[str, tuple[str, Path]]]:
        files = self._files()
        key_of = {file_key_to_param(k): (k, p) for k, p in files.items()}
        linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        # nn.MultiheadAttention (SigLIP's pooling head) reads its out_proj.weight directly: not swappable
        linear -= {f"{n}.out_proj" for n, m in model.named_modules() if isinstance(m, torch.nn.MultiheadAttention)}
        qwen_map = _mmproj_map(8) if self.arch == "qwen2vl" else None
        out: list[tuple[tuple, SourceTensor]] = []
        unmapped, missing = [], []
        for param, p in model.named_parameters(remove_duplicate=True):
            if param.startswith("lm_head.") and self.tied:
                continue
            if param.startswith(_VISION_PREFIXES + (_PROJECTOR_PREFIX,)):
                name = vision_plan_name(param, qwen_map)
                order = (3 if name.startswith("v.") else 4, name)
            else:
                name = self._text_name(param)
                order = (0 if name == "token_embd.weight" else 2 if name and not name.startswith("blk.") else 1,
                         int(name.split(".")[1]) if name and name.startswith("blk.") else 0, name)
            if name is None:
                unmapped.append(param)
                continue
            if param not in key_of:
                missing.append(param)
            shape = tuple(int(n) for n in p.shape)
            quantizable = name == "token_embd.weight" or (len(shape) == 2 and param.removesuffix(".weight") in linear
                                                          and param.endswith(".weight"))
            out.append((order, SourceTensor(name, param, shape, quantizable)))
        if unmapped:
            raise ValueError(f"{self.folder}: parameters with no plan name: {', '.join(unmapped[:8])}")
        if missing:
            raise ValueError(f"{self.folder}: parameters of {self.hf_arch} not in the safetensors files: "
                             f"{', '.join(missing[:8])}")
        names = [st.gguf_name for _, st in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{self.folder}: plan names given twice: {', '.join(dup[:8])}")
        out.sort(key=lambda x: x[0])
        return [st for _, st in out], key_of

    # -- TensorSource ---------------------------------------------------------------------

    def tensors(self) -> list[SourceTensor]:
        return list(self._tensors)

    def read(self, t: SourceTensor) -> torch.Tensor:
        """One tensor as float32, torch orientation (no GGUF permutation: this source feeds the analysis and
        the safetensors writer). Raises KeyError for a tensor not in the files."""
        key, path = self._key_of[t.hf_name]
        with open_safetensors(str(path)) as f:
            return f.get_tensor(key).to(torch.float32)

    def add_metadata(self, writer: Any) -> None:
        """Only ``general.name``: this source is never written to a GGUF (used to size a header estimate)."""
        writer.add_name(self.folder.name)


def open_vl_full_source(folder: str | os.PathLike, *, trust_remote_code: bool = False) -> VLFullSource:
    """Open every tensor of a Qwen2-VL / Qwen2.5-VL / LLaVA / Mllama folder (module docstring).

    ``trust_remote_code``: the user's flag, passed to transformers' config and model classes.

    Raises:
        ValueError: not one of :data:`VL_FULL_ARCHS`, no safetensors, or parameters the files lack (named).
        checkpoint.RemoteCodeError: the checkpoint needs its own code and the flag is off.
    """
    return VLFullSource(folder, trust_remote_code=trust_remote_code)


# Files of a VL checkpoint's processor, copied beside a quantized checkpoint (the tokenizer's own files
# are written by ``tokenizer.save_pretrained``).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "chat_template.json",
                   "video_preprocessor_config.json")


def copy_processor_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the processor files of :data:`PROCESSOR_FILES` that ``src`` has into ``dst`` (byte copies).

    Returns:
        The names copied.
    """
    import shutil

    done = []
    for name in PROCESSOR_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            done.append(name)
    return done
