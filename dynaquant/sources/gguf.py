"""Tensor sources for the GGUF exporter, and the source that reads an existing GGUF file.

A :class:`TensorSource` lists a model's tensors under their llama.cpp names, reads them one
at a time as float32 (so memory stays at one tensor), and writes the model's metadata
(architecture hyper-parameters, tokenizer) into a ``gguf.GGUFWriter``. Two sources exist:
:func:`open_gguf_source` here (re-quantizing a GGUF file) and
:func:`dynaquant.sources.open.open_hf_source` (a HF checkpoint folder).

File format: GGUF v3 as read by gguf-py's ``GGUFReader`` (llama.cpp ``docs/gguf.md``).
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGUFValueType, GGUFWriter

from dynaquant.errors import InputError
from dynaquant.names import gguf_to_hf_name, is_router
from dynaquant.sources.readers import gguf_field, gguf_shard_paths, open_gguf, open_gguf_shards

logger = logging.getLogger(__name__)


# Stored float types :meth:`GGUFFileSource.read` converts with torch (the stored bytes viewed as this dtype)
_PLAIN_FLOATS = {gguf.GGMLQuantizationType.BF16: torch.bfloat16, gguf.GGMLQuantizationType.F16: torch.float16,
                 gguf.GGMLQuantizationType.F32: torch.float32}


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a source model.

    Attributes:
        gguf_name: llama.cpp name, e.g. ``"blk.3.ffn_down.weight"``.
        hf_name: HF parameter name, e.g. ``"model.layers.3.mlp.down_proj.weight"``; None if
            unknown (``rope_freqs.weight``, or a GGUF of an unknown layout).
        shape: torch order ``(rows, row_size)`` for matrices, ``(n_expert, rows, row_size)``
            for stacked MoE experts, ``(n,)`` for norms and biases; the LAST axis is the GGUF
            row (``ne[0]``), the axis blocks run along.
        quantizable: True for matmul weights of 2 or more dims (``token_embd``, ``output``
            and the stacked 3-D experts ``ffn_*_exps`` included); False for norms, biases,
            other 1-D tensors and MoE routers (``ffn_gate_inp*``, F32 in llama.cpp).
    """

    gguf_name: str
    hf_name: str | None
    shape: tuple[int, ...]
    quantizable: bool

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_size(self) -> int:
        """Length of one GGUF row (the last axis)."""
        return self.shape[-1]


class TensorSource(ABC):
    """A model whose tensors are read one at a time for the GGUF writer.

    Attributes:
        arch: gguf architecture string (``"llama"``, ``"qwen2"``, ``"qwen3"``).
        n_layers: number of transformer blocks.
        source_id: the path (or hub id) the model came from, recorded in the output metadata.
    """

    arch: str
    n_layers: int
    source_id: str

    @abstractmethod
    def tensors(self) -> list[SourceTensor]:
        """Every tensor to write, in output order."""

    @abstractmethod
    def read(self, t: SourceTensor) -> torch.Tensor:
        """One tensor as float32 (CPU), shape ``t.shape``, ready to quantize.

        For HF sources q/k are already permuted as llama.cpp expects; for GGUF sources the
        values are the dequantized stored values.
        """

    @abstractmethod
    def add_metadata(self, writer: GGUFWriter) -> None:
        """Add every key/value pair except ``general.architecture`` (the writer's constructor
        adds it), ``general.file_type``, ``general.quantization_version`` and ``dynaquant.*``
        (the GGUF writer and the pipeline add those)."""

    def file_of(self, t: SourceTensor) -> str:
        """The file holding a tensor's data, for messages (default: the source itself)."""
        return self.source_id

    def model_rows(self, t: SourceTensor) -> tuple[str, torch.Tensor | None] | None:
        """How :meth:`read` of ``t`` relates to the transformers model's parameter: ``(parameter name, rows)`` where it
        is that parameter's rows ``rows`` ((N,) int64 on the CPU; None: the parameter as it is), bit for bit; None
        where it is not known to be one parameter's rows (the default)."""
        return None

    def read_to(self, t: SourceTensor, device: str | torch.device) -> torch.Tensor:
        """:meth:`read` onto ``device``, the same values bit for bit; a source may move the stored bytes (BF16, FP8)
        and decode them there, which on a GPU halves the copy and spares the CPU the conversion (default: read, then
        move)."""
        return self.read(t).to(device)

    def read_stored(self, t: SourceTensor, lo: int = 0, hi: int | None = None):
        """Experts ``lo .. hi - 1`` of a stacked expert tensor (``ffn_{gate,up,down}_exps``, (E, rows, row)) as the
        checkpoint stores them (:class:`dynaquant.sources.experts.Stored`: BF16 / FP16 / FP8 with block scales, on
        the CPU); decoded, they equal ``read(t)[lo:hi]`` bit for bit. Default: that float32 slice (read whole)."""
        from dynaquant.sources.experts import Stored

        return Stored(self.read(t)[lo:hi].clone())

    def stored_bytes(self, t: SourceTensor) -> int:
        """Bytes :meth:`read_stored` of the whole tensor holds (default: float32)."""
        return 4 * t.numel

    def reads_experts(self, t: SourceTensor) -> bool:
        """Whether :meth:`read_stored` reads only the experts asked for (default: no, it reads the whole tensor)."""
        return False

    def stored_records(self, t: SourceTensor, lo: int = 0, hi: int | None = None) -> tuple[str, np.ndarray] | None:
        """The tensor as the file stores it in a GGUF type: ``(GGML type name, uint8 (..., row_bytes))``, the bytes in
        the GGUF layout of that type (experts ``lo .. hi - 1`` of a stacked expert tensor), whose decoding is
        :meth:`read`'s values bit for bit. Default: None (the source does not store GGUF types)."""
        return None

    def stored_types(self) -> dict[str, str]:
        """GGUF name -> GGML type name of each tensor :meth:`stored_records` gives (none by default)."""
        return {t.gguf_name: got[0] for t in self.tensors() if (got := self.stored_records(t)) is not None}

    def tensor(self, gguf_name: str) -> SourceTensor:
        """Look a tensor up by GGUF name.

        Raises:
            KeyError: no such tensor.
        """
        for t in self.tensors():
            if t.gguf_name == gguf_name:
                return t
        raise KeyError(f"{self.source_id}: no tensor {gguf_name!r}")


# Keys a re-quantized file must not inherit from its source: written anew by the GGUF writer
# (architecture, file type, quantization version), alignment (we write the default alignment),
# the source's own quantization provenance (imatrix) and split bookkeeping.
_DROPPED_KEYS = frozenset(
    {
        gguf.Keys.General.ARCHITECTURE,
        gguf.Keys.General.FILE_TYPE,
        gguf.Keys.General.QUANTIZATION_VERSION,
        gguf.Keys.General.ALIGNMENT,
    }
)
_DROPPED_PREFIXES = ("GGUF.", "dynaquant.", "quantize.", "split.")


def _field_value(field) -> tuple[object, GGUFValueType, GGUFValueType | None]:
    """(value, type, sub_type) of a reader field, strings kept as raw bytes."""
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:
            raise NotImplementedError("nested arrays")
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return field.contents(), main, sub
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]), main, None
    return field.contents(), main, None


def gguf_int(reader: gguf.GGUFReader, path: str | os.PathLike, key: str) -> int | None:
    """An integer metadata key of a GGUF file (a per-layer array: its largest value), or None when absent.

    Raises:
        InputError: the key holds something else, or an empty or non-integer array (names the file and key).
    """
    f = reader.fields.get(key)
    if f is None:
        return None
    if not (f.types and f.types[0] == GGUFValueType.ARRAY):
        return int(gguf_field(reader, path, key, int))
    v = gguf_field(reader, path, key, list)
    if not v or not all(isinstance(x, int) for x in v):
        raise InputError(f"{path}: GGUF key {key} is not an integer or a non-empty array of integers")
    return max(v)


class GGUFFileSource(TensorSource):
    """A GGUF file as a tensor source (see :func:`open_gguf_source`); a split GGUF given its first shard reads the
    tensors of every shard (:func:`dynaquant.sources.readers.open_gguf_shards`).

    Attributes:
        path: the file (a split GGUF: its first shard).
        reader: its ``gguf.GGUFReader`` (memory-mapped; fields and tensor data read lazily),
            for callers that want the stored metadata or types as they are (a split GGUF: the first shard's).
        files: the files read (``[path]``, or every shard in order).
        n_head, n_head_kv: attention heads and key/value heads (``{arch}.attention.head_count[_kv]``; per-layer
            arrays: the largest; absent: 1 and ``n_head``), as an HF source has them.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        readers = open_gguf_shards(self.path)
        self.reader = readers[0]
        self.files = [self.path] if len(readers) == 1 else gguf_shard_paths(self.path, len(readers))
        if (arch := gguf_field(self.reader, self.path, gguf.Keys.General.ARCHITECTURE, str)) is None:
            raise InputError(f"{self.path}: no general.architecture key")
        self.arch = arch
        self.n_layers = gguf_field(self.reader, self.path, f"{self.arch}.block_count", int) or 0
        self.n_head = gguf_int(self.reader, self.path, f"{self.arch}.attention.head_count") or 1
        self.n_head_kv = gguf_int(self.reader, self.path, f"{self.arch}.attention.head_count_kv") or self.n_head
        n_tensors = sum(len(r.tensors) for r in readers)
        if not 0 <= self.n_layers <= n_tensors:  # every block holds tensors: no bigger name maps
            raise InputError(f"{self.path}: {self.arch}.block_count {self.n_layers} but {n_tensors} tensors")
        self.source_id = str(self.path)
        self._tensors: list[SourceTensor] = []
        self._by_name = {}
        self._file_of: dict[str, Path] = {}
        for file, rt in ((f, rt) for f, r in zip(self.files, readers) for rt in r.tensors):
            self._file_of[rt.name] = file
            shape = tuple(int(n) for n in reversed(rt.shape.tolist()))
            try:
                hf = gguf_to_hf_name(self.arch, self.n_layers, rt.name) if self.n_layers else None
            except ValueError as e:  # an architecture gguf-py does not know
                raise InputError(f"{self.path}: {e}") from e
            quantizable = len(shape) >= 2 and rt.name.endswith(".weight") and not is_router(rt.name)
            st = SourceTensor(rt.name, hf, shape, quantizable=quantizable)
            self._tensors.append(st)
            self._by_name[rt.name] = rt
        logger.info("%s: GGUF %s, %d blocks, %d tensors", self.path, self.arch, self.n_layers, len(self._tensors))

    def tensors(self) -> list[SourceTensor]:
        return list(self._tensors)

    def file_of(self, t: SourceTensor) -> str:
        return str(self._file_of.get(t.gguf_name, self.path))

    def stored_type(self, t: SourceTensor) -> gguf.GGMLQuantizationType:
        """The GGML type the tensor is stored in, in the source file."""
        return self._by_name[t.gguf_name].tensor_type

    def stored_records(self, t: SourceTensor, lo: int = 0, hi: int | None = None) -> tuple[str, np.ndarray]:
        """As :meth:`TensorSource.stored_records`: the file's own bytes (memory-mapped, not copied)."""
        rt = self._by_name[t.gguf_name]
        data = rt.data[lo:hi] if len(t.shape) == 3 else rt.data
        return rt.tensor_type.name, data.view(np.uint8).reshape(*data.shape[:-1], -1)

    def read(self, t: SourceTensor) -> torch.Tensor:
        """One tensor as float32: a quantized type dequantized with ``gguf.quants.dequantize``, BF16 / F16 / F32
        converted by torch (the same values).

        Returns:
            float32 tensor of shape ``t.shape`` (a copy; the file stays memory-mapped).
        Raises:
            KeyError: the tensor is not in this file.
            NotImplementedError: gguf-py cannot dequantize the stored type.
        """
        rt = self._by_name[t.gguf_name]
        data = rt.data
        plain = _PLAIN_FLOATS.get(rt.tensor_type)
        if plain is not None:
            # a float type: converted by torch from one copy of the stored bytes (the same float32 values as gguf-py's
            # dequantize, which made two float32 copies in numpy: ~5x the time for a BF16 model on a CPU)
            raw = torch.from_numpy(np.array(data, copy=True).view(np.uint8)).view(plain)
            return raw.reshape(t.shape).to(torch.float32)
        x = gguf.quants.dequantize(data, rt.tensor_type)
        x = np.array(x, dtype=np.float32, copy=True).reshape(t.shape)
        return torch.from_numpy(x)

    def add_metadata(self, writer: GGUFWriter) -> None:
        """Copy every key of the source file (tokenizer included) with its own value type,
        except the architecture, ``general.file_type``, ``general.quantization_version``,
        ``general.alignment``, ``quantize.*`` (the source's imatrix provenance), ``split.*``
        and ``dynaquant.*``."""
        n = 0
        for key, field in self.reader.fields.items():
            if key in _DROPPED_KEYS or key.startswith(_DROPPED_PREFIXES):
                if not key.startswith("GGUF."):
                    logger.debug("%s: not copying %s", self.path, key)
                continue
            try:
                value, vtype, sub = _field_value(field)
            except NotImplementedError:
                logger.warning("%s: skipping key %s (nested arrays are not supported)", self.path, key)
                continue
            writer.add_key_value(key, value, vtype, sub_type=sub)
            n += 1
        logger.info("%s: copied %d metadata keys", self.path, n)


def open_gguf_source(path: str | os.PathLike) -> GGUFFileSource:
    """Open a GGUF file as a tensor source (tensors in file order, metadata copied).

    Raises:
        InputError: naming the file, when it is missing, unreadable, damaged (see
            :func:`dynaquant.sources.readers.open_gguf`), a shard of a split GGUF other than the first or a missing
            shard, lacks ``general.architecture`` or has a ``block_count`` larger than its tensor count.
    """
    return GGUFFileSource(path)


def is_split_gguf(path: str | os.PathLike) -> bool:
    """Whether a GGUF file is the first shard of a split set (``split.count`` > 1), read from its header only.

    Raises:
        InputError: not a readable GGUF file (named).
    """
    n = gguf_field(open_gguf(path), path, gguf.Keys.Split.LLM_KV_SPLIT_COUNT, int)
    return n is not None and n > 1


def merge_gguf_shards(path: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Write the split GGUF whose first shard is ``path`` as one GGUF file ``dest`` (what ``llama-gguf-split --merge``
    does): the first shard's metadata without ``split.*`` (and without empty or nested arrays, which gguf-py's writer
    cannot write), every shard's tensors in order with their stored bytes and types; for readers that take one file
    only (transformers' GGUF loader). ``dest`` is written as is (the caller puts it in a temporary folder).

    Raises:
        InputError: a shard missing or damaged (see :func:`dynaquant.sources.readers.open_gguf_shards`).
    """
    readers = open_gguf_shards(path)
    first, dest = readers[0], Path(dest)
    writer = GGUFWriter(dest, gguf_field(first, path, gguf.Keys.General.ARCHITECTURE, str) or "")
    for key, field in first.fields.items():
        if key.startswith(("GGUF.", "split.")) or key == gguf.Keys.General.ARCHITECTURE:
            continue
        if field.types == [GGUFValueType.ARRAY]:  # an empty array: gguf-py's writer cannot write one; no loader needs it
            logger.debug("%s: not copying the empty array %s", path, key)
            continue
        try:
            value, vtype, sub = _field_value(field)
        except NotImplementedError:
            logger.debug("%s: not copying %s (nested arrays)", path, key)
            continue
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.data_alignment = first.alignment
    tensors = [rt for r in readers for rt in r.tensors]
    for rt in tensors:
        block, type_bytes = gguf.GGML_QUANT_SIZES[rt.tensor_type]
        ne = [int(n) for n in rt.shape.tolist()]
        byte_shape = [*reversed(ne[1:]), ne[0] // block * type_bytes]
        writer.add_tensor_info(rt.name, byte_shape, np.dtype(np.uint8), int(rt.n_bytes), raw_dtype=rt.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for rt in tensors:
        writer.write_tensor_data(np.ascontiguousarray(rt.data).reshape(-1).view(np.uint8))
    writer.close()
    return dest
