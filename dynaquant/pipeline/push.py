"""Publish a finished output folder to a Hugging Face hub model repository (``dynaquant push DIR ORG/NAME``).

Two steps, in this order:

1. :func:`check_folder`: the folder is complete before a single byte leaves the machine: a model card
   (``README.md``, parsed by ``huggingface_hub``'s ``ModelCard.load``, with ``base_model`` in its metadata), at
   least one model file (a ``.gguf``, or a safetensors checkpoint: ``*.safetensors`` + ``config.json``), every
   split GGUF set whole (llama.cpp's ``NAME-0000i-of-0000n.gguf``: all n shards, their ``split.count`` /
   ``split.no`` keys agreeing with their names), every GGUF and safetensors file readable to its end, and no
   temporary or partial file (a run's work folder, ``*.tmp``, ``*.incomplete``, ``*.part``).
2. :func:`push_folder`: ``create_repo`` (``exist_ok``), ``create_branch`` when a branch is given (``exist_ok``),
   then the folder's files in one upload: ``HfApi.upload_large_folder`` where the installed ``huggingface_hub``
   has it (0.25 to 1.x: resumable, several commits, bookkeeping in ``DIR/.cache/huggingface``), else
   ``HfApi.upload_folder`` (2.x, where it replaced ``upload_large_folder``: with ``hf_xet`` installed a streamed,
   resumable, multi-commit upload; without Xet, or with ``HF_HUB_DISABLE_XET=1``, one commit of LFS objects).

The token is whatever ``huggingface_hub`` resolves (``HF_TOKEN``, the token stored by ``hf auth login`` /
``huggingface-cli login``), or ``token=``; it is handed to ``HfApi`` and never printed, logged or written.
A failed upload leaves the folder as it was and raises :class:`PushError`, whose message gives the command
that retries (and, with a resumable upload, resumes) it.

``DIR/.cache/huggingface``: ``upload_large_folder`` keeps there which files it has hashed, uploaded and
committed, so a rerun of the same command skips them; ``huggingface_hub`` never uploads that folder
(``DEFAULT_IGNORE_PATTERNS``) and :func:`check_folder` ignores it. It may be deleted once the upload is done
(a later push then hashes every file again). ``.git`` folders are ignored in the same way.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gguf import SHARD_NAME_FORMAT

from dynaquant.errors import InputError
from dynaquant.sources.readers import GGUF_SHARD_NAME, gguf_field, open_gguf, open_safetensors, read_json_object
from dynaquant.version import __version__
from dynaquant.workdir import is_temporary

log = logging.getLogger(__name__)

CARD = "README.md"
SIDE_FILES = ("report.json", "plan.json", "imatrix.gguf", "report.html")  # published when present; *.png too
PARTIAL_SUFFIXES = (".tmp", ".incomplete", ".part", ".partial")
_IGNORED = ((".cache", "huggingface"), (".git",))  # never uploaded by huggingface_hub (DEFAULT_IGNORE_PATTERNS)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PushError(InputError):
    """The upload failed after the folder passed its checks; the folder is unchanged.

    Attributes:
        retry: the command line that retries the upload (``dynaquant push DIR ORG/NAME ...``).
    """

    def __init__(self, message: str, retry: str):
        super().__init__(message)
        self.retry = retry


@dataclass(frozen=True)
class CheckedFolder:
    """What :func:`check_folder` found.

    Attributes:
        folder: the folder (absolute).
        files: every file to upload, as POSIX paths relative to ``folder``, sorted.
        model_files: the model files among them: GGUF files (the first shard of a split set stands for the set)
            and safetensors checkpoints (their ``config.json``).
        base_model: the card's ``base_model`` metadata (a hub id or a name; a list for a merge).
    """

    folder: Path
    files: tuple[str, ...]
    model_files: tuple[str, ...]
    base_model: str | list[str]


def _ignored(rel: tuple[str, ...]) -> bool:
    return any(any(rel[i:i + len(p)] == p for i in range(len(rel) - len(p) + 1)) for p in _IGNORED)


def _list_files(folder: Path) -> list[str]:
    """Files under ``folder`` (POSIX, relative), without the ignored folders; temporary entries raise."""
    out = []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder).parts
        for name in sorted(dirs + files):
            where = Path(root) / name
            if _ignored(rel_root + (name,)):
                continue
            if is_temporary(name) or (name in files and name.endswith(PARTIAL_SUFFIXES)):
                raise InputError(f"{where}: a temporary or partial file (an unfinished or killed run's): the folder is "
                                 "not complete; finish or rerun the run that writes it, or remove it")
        dirs[:] = [d for d in dirs if not _ignored(rel_root + (d,))]
        out += [Path(*rel_root, f).as_posix() for f in files if not _ignored(rel_root + (f,))]
    return sorted(out)


def _check_card(path: Path) -> str | list[str]:
    from huggingface_hub import ModelCard

    if not path.is_file():
        raise InputError(f"{path}: missing: a published folder needs its model card (README.md; quantize with --card)")
    try:
        card = ModelCard.load(path)  # a local file: read, never fetched
    except Exception as exc:  # noqa: BLE001 - yaml and huggingface_hub raise several kinds on a bad card
        raise InputError(f"{path}: not a valid model card ({type(exc).__name__}: {exc})") from exc
    base = card.data.to_dict().get("base_model")
    if not base:
        raise InputError(f"{path}: the model card's metadata has no base_model (the model this one quantizes)")
    return base


def _gguf_kind(path: Path, reader) -> str:
    """``model``, ``imatrix`` or ``mmproj`` (gguf-py ``GGUFType``: ``general.type``, else the file name)."""
    kind = gguf_field(reader, path, "general.type", str)
    if kind in ("imatrix", "mmproj"):
        return kind
    if path.name == "imatrix.gguf":
        return "imatrix"
    return "mmproj" if path.name.startswith("mmproj") else "model"


def _check_ggufs(folder: Path, files: list[str]) -> list[str]:
    """Open every GGUF (layout checked to its end); check split sets. Returns the model GGUFs (first shards)."""
    models, sets = [], {}
    for rel in (f for f in files if f.endswith(".gguf")):
        path = folder / rel
        reader = open_gguf(path)
        count = gguf_field(reader, path, "split.count", int)
        m = GGUF_SHARD_NAME.match(path.name)
        if m is None:
            if count is not None and count > 1:
                raise InputError(f"{path}: a shard of a split GGUF (split.count {count}) not named "
                                 "NAME-0000i-of-0000n.gguf: llama.cpp would not find the other shards")
            if _gguf_kind(path, reader) == "model":
                models.append(rel)
            continue
        no, n = int(m.group("no")), int(m.group("count"))
        if count != n or gguf_field(reader, path, "split.no", int) != no - 1:
            raise InputError(f"{path}: its split keys (split.no {gguf_field(reader, path, 'split.no', int)}, split.count "
                             f"{count}) do not match its name (shard {no} of {n}, split.no {no - 1})")
        sets.setdefault((str(Path(rel).parent / m.group("stem")), n), set()).add(no)
        if no == 1 and _gguf_kind(path, reader) == "model":
            models.append(rel)
    for (stem, n), have in sorted(sets.items()):
        missing = [SHARD_NAME_FORMAT.format(Path(stem).name, i, n) for i in range(1, n + 1) if i not in have]
        if missing:
            raise InputError(f"{folder / Path(stem).parent / missing[0]}: missing: split GGUF set {Path(stem).name} has "
                             f"{len(have)} of its {n} shards (missing: {', '.join(missing)})")
    return models


def _check_safetensors(folder: Path, files: list[str]) -> list[str]:
    """Open every safetensors file (header); each checkpoint folder needs config.json and its index's shards."""
    dirs = sorted({Path(f).parent for f in files if f.endswith(".safetensors")})
    for rel in (f for f in files if f.endswith(".safetensors")):
        with open_safetensors(folder / rel) as f:
            f.keys()
    for d in dirs:
        if not (folder / d / "config.json").is_file():
            raise InputError(f"{folder / d / 'config.json'}: missing: a safetensors checkpoint needs its config.json")
        index = folder / d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InputError(f"{index}: no weight_map object")
            for shard in sorted(set(map(str, weight_map.values()))):
                if not (folder / d / shard).is_file():
                    raise InputError(f"{folder / d / shard}: missing: a shard named in {index.name}")
    return [(d / "config.json").as_posix() for d in dirs]


def check_folder(folder: str | os.PathLike) -> CheckedFolder:
    """Check that ``folder`` can be published as it is (see the module's docstring for what is checked).

    Reads headers only (GGUF layouts and keys, safetensors headers, the card): no tensor data, no network.

    Returns:
        :class:`CheckedFolder`: the files that would be uploaded.
    Raises:
        InputError: the first problem found, naming the file (missing card or shard, a damaged GGUF or
            safetensors file, a temporary file, no model file).
    """
    folder = Path(folder).absolute()
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder")
    files = _list_files(folder)
    base = _check_card(folder / CARD)
    models = _check_ggufs(folder, files) + _check_safetensors(folder, files)
    if not models:
        raise InputError(f"{folder}: no model file (a .gguf, or *.safetensors with config.json) to publish")
    side = [f for f in files if f in SIDE_FILES or f.endswith(".png")]
    log.info("%s: %d files to publish: model %s; side files %s", folder, len(files), ", ".join(models),
             ", ".join(side) or "none")
    return CheckedFolder(folder, tuple(files), tuple(models), base)


def check_push_target(repo_id: str, token: str | None = None) -> None:
    """Check, without a request, what an upload needs besides the folder: ``repo_id`` is ``ORG/NAME`` and a token
    is at hand (``token``, else ``HF_TOKEN`` or a stored login, as ``huggingface_hub.get_token`` finds them).
    ``dynaquant quantize --push-to-hub`` calls it before the run, so a long run does not end in an upload that
    cannot start.

    Raises:
        InputError: a bad repository id, or no token.
    """
    if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
        raise InputError(f"{repo_id}: not a hub repository id (ORG/NAME: letters, digits, '-', '_', '.')")
    if token is None:
        from huggingface_hub import get_token

        if get_token() is None:
            raise InputError(f"{repo_id}: no hub token to upload with: set HF_TOKEN, or log in once with `hf auth login` "
                             "(`huggingface-cli login`)")


def retry_command(folder: str | os.PathLike, repo_id: str, *, private: bool = False, revision: str | None = None) -> str:
    """The command line that (re)publishes ``folder`` as :func:`push_folder` was asked to."""
    import shlex

    return " ".join(["dynaquant", "push", shlex.quote(str(folder)), shlex.quote(repo_id)] + (["--private"] if private else [])
                    + (["--revision", shlex.quote(revision)] if revision is not None else []))


def push_folder(folder: str | os.PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
                token: str | None = None, endpoint: str | None = None) -> str:
    """Check ``folder`` (:func:`check_folder`), then upload it to the hub model repository ``repo_id``.

    Args:
        folder: a finished output folder (card, model files, side files).
        repo_id: ``ORG/NAME``; created if missing, private with ``private`` (else the owner's default
            visibility); an existing repository keeps its visibility.
        revision: a branch to commit to, created from the default branch if missing (None: the default branch).
        token: a hub token (None: ``huggingface_hub`` resolves ``HF_TOKEN`` or the stored login); never logged.
        endpoint: the hub's URL (None: ``HF_ENDPOINT`` or https://huggingface.co), for mirrors and tests.
    Returns:
        The repository's URL.
    Raises:
        InputError: ``repo_id`` is not ``ORG/NAME``, no token is found (:func:`check_push_target`), or the folder
            is incomplete (:func:`check_folder`); all before any request is made.
        PushError: an upload request failed (HTTP error, network, server answer); the folder is unchanged and
            the message ends with the retry command (:func:`retry_command`).
    """
    check_push_target(repo_id, token)
    checked = check_folder(folder)
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token, library_name="dynaquant", library_version=__version__)
    retry = retry_command(folder, repo_id, private=private, revision=revision)
    visibility = True if private else None  # None: the owner's default
    try:
        url = api.create_repo(repo_id, private=visibility, exist_ok=True, repo_type="model")
        if revision is not None:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        large = getattr(api, "upload_large_folder", None)
        if large is not None:  # huggingface_hub 0.25 to 1.x
            large(repo_id=repo_id, folder_path=checked.folder, repo_type="model", revision=revision, private=visibility)
        else:  # 2.x: upload_folder is the resumable one
            api.upload_folder(repo_id=repo_id, folder_path=checked.folder, repo_type="model", revision=revision,
                              commit_message=f"Upload {checked.folder.name} (dynaquant {__version__})")
    except KeyboardInterrupt:
        log.warning("upload to %s interrupted; the folder is unchanged: retry with `%s`", repo_id, retry)
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the upload calls (HTTP, network, a server's answer)
        why = " ".join(str(exc).split()) or "no message"  # the hub's answer included (permissions, quota, ...)
        raise PushError(f"{repo_id}: upload of {checked.folder} failed ({type(exc).__name__}: {why}); the folder is "
                        f"unchanged: retry with `{retry}`", retry) from exc
    log.info("published %s to %s%s", checked.folder, url, f" (branch {revision})" if revision else "")
    return str(url)
