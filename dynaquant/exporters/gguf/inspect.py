"""Summaries of a GGUF file: types, sizes and bits per weight per tensor and per layer."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import gguf

from dynaquant.names import TensorName
from dynaquant.sources.readers import gguf_field, gguf_shard_paths, open_gguf_shards


@dataclass
class TensorSummary:
    """One tensor: GGUF name, GGML type name, shape (torch order), elements, bytes, bpw."""

    name: str
    type: str
    shape: list[int]
    n_elements: int
    size_bytes: int
    bpw: float


@dataclass
class GGUFSummary:
    """A whole file.

    Attributes:
        path, file_size_bytes (a split GGUF: all shards), file_type (``general.file_type`` as a name or number),
        tensors (file order), layers (``blk.N`` or ``other`` -> {bytes, elements, bpw, types}),
        size_bytes (tensor data), bpw (over tensor data), types (type -> weights),
        files (the files read: ``[path]``, or a split GGUF's shards in order).
    """

    path: str
    file_size_bytes: int
    file_type: str
    tensors: list[TensorSummary]
    layers: dict
    size_bytes: int
    bpw: float
    types: dict
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def inspect_gguf(path: str | os.PathLike) -> GGUFSummary:
    """Read a GGUF file's tensor table (a split GGUF given its first shard: every shard's, in order).

    Raises:
        InputError: a missing, unreadable or damaged GGUF file, or a missing shard (the message names it; see
            :func:`dynaquant.sources.readers.open_gguf_shards`).
    """
    readers = open_gguf_shards(path)
    reader = readers[0]
    tensors = []
    for t in (t for r in readers for t in r.tensors):
        shape = [int(x) for x in reversed(t.shape)]
        tensors.append(TensorSummary(t.name, t.tensor_type.name, shape, int(t.n_elements), int(t.n_bytes),
                                     8.0 * int(t.n_bytes) / max(int(t.n_elements), 1)))
    layers: dict[str, dict] = {}
    types: dict[str, int] = {}
    for t in tensors:
        tn = TensorName.from_gguf(t.name)
        key = tn.prefix if tn.tower == "text" and tn.block is not None else "other"
        lay = layers.setdefault(key, {"size_bytes": 0, "n_elements": 0, "types": {}})
        lay["size_bytes"] += t.size_bytes
        lay["n_elements"] += t.n_elements
        lay["types"][t.type] = lay["types"].get(t.type, 0) + t.n_elements
        types[t.type] = types.get(t.type, 0) + t.n_elements
    for lay in layers.values():
        lay["bpw"] = 8.0 * lay["size_bytes"] / max(lay["n_elements"], 1)
    v = gguf_field(reader, path, "general.file_type", int)
    ft_name = ""
    if v is not None:
        try:
            ft_name = gguf.LlamaFileType(v).name
        except ValueError:
            ft_name = str(v)
    size = sum(t.size_bytes for t in tensors)
    n = sum(t.n_elements for t in tensors)
    files = [str(path)] if len(readers) == 1 else [str(p) for p in gguf_shard_paths(path, len(readers))]
    return GGUFSummary(str(path), sum(os.path.getsize(f) for f in files), ft_name, tensors, layers, size,
                       8.0 * size / max(n, 1), types, files)
