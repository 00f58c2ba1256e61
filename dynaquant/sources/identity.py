"""What outputs record to identify their source: a label (never a local path) and a cheap content hash.

:func:`source_label` turns a local path as typed into the label; :func:`content_sha256` hashes a checkpoint
folder's ``config.json`` and safetensors tensor index, or a GGUF file's bytes before its tensor data, without
reading any weights. ``checkpoint.ModelSource.record`` uses both.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path, PurePath

from dynaquant.errors import InputError
from dynaquant.sources.readers import check_gguf_layout


def source_label(text: str) -> str:
    """The label outputs record for a local path as typed: its trailing components with no absolute
    prefix, ``~`` or ``.``/``..`` part (``models/tiny`` -> ``models/tiny``, ``/data/models/tiny`` ->
    ``tiny``, ``../x/tiny`` -> ``x/tiny``), so that the bytes of an output never depend on where the run
    happened nor leak a local path."""
    p = PurePath(text)
    parts = [x for x in p.parts if x not in (".", "")]
    if p.is_absolute() or (parts and parts[0].startswith("~")):
        parts = parts[-1:]
    if ".." in parts:
        parts = parts[len(parts) - parts[::-1].index(".."):]
    return "/".join(parts) or PurePath(os.path.abspath(text)).name


def content_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) identifying a model's content cheaply, without reading its weights.

    A folder: its ``config.json`` bytes and the tensor index of its ``*.safetensors`` files (name, dtype,
    shape, data offsets of each tensor, by name); a ``.safetensors`` file: its tensor index; a GGUF file:
    its bytes before the tensor data (header, metadata, tensor infos).

    Raises:
        InputError: a file that cannot be read or whose header is corrupt (named).
    """
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        cfg = path / "config.json"
        h.update(b"config.json\0" + (_read_bytes(cfg) if cfg.is_file() else b""))
        index: list = []
        for f in sorted(path.glob("*.safetensors")):
            index.extend(_safetensors_index(f))
        h.update(json.dumps(sorted(index), separators=(",", ":")).encode())
    elif path.suffix == ".safetensors":
        h.update(json.dumps(sorted(_safetensors_index(path)), separators=(",", ":")).encode())
    else:  # the header walk checks every count against the file's size; values are skipped, not parsed
        try:
            n = check_gguf_layout(path)
        except InputError as exc:
            raise InputError(f"{path}: not a GGUF file whose header can be read ({str(exc).removeprefix(f'{path}: ')})") from exc
        try:
            with open(path, "rb") as fh:
                h.update(fh.read(n))
        except OSError as exc:
            raise InputError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    return h.hexdigest()


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot be read: {exc.strerror or exc}") from exc


def _safetensors_index(path: Path) -> list:
    """[[name, dtype, shape, [begin, end]], ...] from a safetensors file's header (nothing else read)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < n <= os.fstat(f.fileno()).st_size - 8:
                raise InputError(f"{path}: not a safetensors file (header length {n} does not fit the file)")
            header = json.loads(f.read(n))
        return [[k, v["dtype"], list(v["shape"]), list(v["data_offsets"])] for k, v in header.items()
                if k != "__metadata__"]
    except OSError as exc:
        raise InputError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{path}: corrupt safetensors header ({exc})") from exc
