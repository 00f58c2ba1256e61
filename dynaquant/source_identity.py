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

from .errors import InputError


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
    else:
        try:
            with open(path, "rb") as fh:
                n = _gguf_data_offset(fh, os.fstat(fh.fileno()).st_size)
                fh.seek(0)
                h.update(fh.read(n))
        except OSError as exc:
            raise InputError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
        except (ValueError, struct.error) as exc:
            raise InputError(f"{path}: not a GGUF file ({exc})") from exc
    return h.hexdigest()


# GGUF value type -> size in bytes (fixed-size scalars); 8 is a string, 9 an array (GGUF spec, gguf-py GGUFValueType)
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_data_offset(f, size: int) -> int:
    """Offset of a GGUF file's tensor data (header, metadata and tensor infos walked, values skipped; gguf-py's
    GGUFReader parses every value, seconds for a tokenizer's 50k strings)."""
    def read(fmt: str):
        raw = f.read(struct.calcsize("<" + fmt))
        return struct.unpack("<" + fmt, raw)

    def skip_string() -> None:
        (n,) = read("Q")
        if n > size:
            raise ValueError(f"a string of {n} bytes at offset {f.tell()}")
        f.seek(n, 1)

    def skip_value(vtype: int) -> None:
        if vtype in _GGUF_SCALAR:
            f.seek(_GGUF_SCALAR[vtype], 1)
        elif vtype == 8:
            skip_string()
        elif vtype == 9:
            etype, count = read("IQ")
            if count > size:
                raise ValueError(f"an array of {count} values at offset {f.tell()}")
            if etype in _GGUF_SCALAR:
                f.seek(_GGUF_SCALAR[etype] * count, 1)
            else:
                for _ in range(count):
                    skip_value(etype)
        else:
            raise ValueError(f"unknown value type {vtype} at offset {f.tell()}")

    if f.read(4) != b"GGUF":
        raise ValueError("no GGUF magic")
    version, n_tensors, n_kv = read("IQQ")
    if version not in (2, 3) or n_tensors > size or n_kv > size:
        raise ValueError(f"version {version}, {n_tensors} tensors, {n_kv} keys")
    alignment = 32
    for _ in range(n_kv):
        (n,) = read("Q")
        if n > size:
            raise ValueError(f"a key of {n} bytes")
        key = f.read(n)
        (vtype,) = read("I")
        if key == b"general.alignment" and vtype == 4:
            (alignment,) = read("I")
        else:
            skip_value(vtype)
    for _ in range(n_tensors):
        skip_string()
        (n_dims,) = read("I")
        if n_dims > 8:
            raise ValueError(f"a tensor of {n_dims} dimensions")
        f.seek(8 * n_dims + 4 + 8, 1)
    end = f.tell()
    if end > size or alignment <= 0:
        raise ValueError(f"the header ends at {end}, past the end of the file ({size} bytes)")
    return end + (-end) % alignment


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
