"""Summaries of a GGUF file: types, sizes and bits per weight per tensor and per layer."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import gguf

from dynaquant.names import TensorName
from dynaquant.sources.readers import gguf_field, open_gguf


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
        path, file_size_bytes, file_type (``general.file_type`` as a name or number),
        tensors (file order), layers (``blk.N`` or ``other`` -> {bytes, elements, bpw, types}),
        size_bytes (tensor data), bpw (over tensor data), types (type -> weights).
    """

    path: str
    file_size_bytes: int
    file_type: str
    tensors: list[TensorSummary]
    layers: dict
    size_bytes: int
    bpw: float
    types: dict

    def to_dict(self) -> dict:
        return asdict(self)


def inspect_gguf(path: str | os.PathLike) -> GGUFSummary:
    """Read a GGUF file's tensor table.

    Raises:
        InputError: a missing, unreadable or damaged GGUF file (the message names it; see
            :func:`dynaquant.sources.readers.open_gguf`).
    """
    reader = open_gguf(path)
    tensors = []
    for t in reader.tensors:
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
    return GGUFSummary(str(path), os.path.getsize(path), ft_name, tensors, layers, size, 8.0 * size / max(n, 1), types)
