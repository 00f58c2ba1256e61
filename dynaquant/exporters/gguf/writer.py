"""Streaming GGUF writer: one tensor in memory at a time, an atomic rename at the end.

File format: GGUF v3 (llama.cpp ``docs/gguf.md``) through gguf-py's ``GGUFWriter``: the
tensor infos are declared up front (name, GGML type, shape), then header, key/values and
tensor infos are written, then each tensor's bytes in declaration order, each aligned to
``general.alignment`` (32 by default). Shapes: a tensor of torch shape ``(rows, K)`` is
stored with ``ne = [K, rows]`` (GGUFReader's ``shape`` lists ``ne``, row length first) and
``rows * K / block_size * type_size`` bytes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, SHARD_NAME_FORMAT, GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter, WriterState
from tqdm import tqdm

from dynaquant.quant.formats import Format
from dynaquant.sources.gguf import SourceTensor, TensorSource
from dynaquant.sources.nonfinite import check_finite, tensor_label
from dynaquant.sources.readers import GGUF_SHARD_NAME
from dynaquant.workdir import run_workdir, writing

logger = logging.getLogger(__name__)

EncodeFn = Callable[[SourceTensor, torch.Tensor, Format], np.ndarray]


class ArrayPackingWriter(GGUFWriter):
    """gguf-py's writer, also accepting empty arrays when their element type is given, and packing an array of
    strings or numbers in one pass (:meth:`_pack_array`)."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None) -> bytes:
        if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        if vtype == GGUFValueType.ARRAY and isinstance(val, (list, tuple)) and len(val) > 1:
            body = self._pack_array(val, sub_type)
            if body is not None:
                return (self._pack("I", vtype) if add_vtype else b"") + body
        return super()._pack_val(val, vtype, add_vtype, sub_type)

    def _pack_array(self, val: Sequence, sub_type: GGUFValueType | None) -> bytes | None:
        """gguf-py's bytes of a non-empty array of strings or numbers (element type, count, elements), or None for
        anything else (nested arrays, mixed types: gguf-py's own packing and errors). gguf-py packs element by element
        (~6 calls an element: a 49k-token vocabulary, its scores and types took ~0.4 s to write and as long to count
        for the planning's header size); one ``struct.pack`` of all the numbers, and a join of the strings, give the
        same bytes (``tests/test_gguf_array_packing.py`` compares them)."""
        ltype = sub_type if sub_type is not None else GGUFValueType.get_type(val[0])
        if ltype == GGUFValueType.ARRAY or (sub_type is None and any(GGUFValueType.get_type(v) is not ltype for v in val)):
            return None
        order = "<" if self.endianess == GGUFEndian.LITTLE else ">"  # (gguf-py's _pack prefix)
        head = self._pack("I", ltype) + self._pack("Q", len(val))
        if ltype == GGUFValueType.STRING:
            enc = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
            lengths = struct.pack(f"{order}{len(enc)}Q", *map(len, enc))
            return head + b"".join(lengths[8 * i : 8 * i + 8] + e for i, e in enumerate(enc))
        fmt = self._simple_value_packing.get(ltype)
        return None if fmt is None else head + struct.pack(f"{order}{len(val)}{fmt}", *val)


def header_bytes(writer: GGUFWriter) -> int:
    """Bytes of the header, key-value data and tensor infos ``writer`` holds, as ``write_header_to_file``,
    ``write_kv_data_to_file`` and ``write_ti_data_to_file`` would write them, counted in memory (no file).

    ``writer`` must be a fresh one (created without a path, nothing written); it is used up by this call.
    """
    buf = io.BytesIO()
    writer.fout = [buf]
    writer.state = WriterState.EMPTY
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.fout = None
    writer.state = WriterState.NO_FILE
    return buf.getbuffer().nbytes


def kv_value_type(key: str, value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """The GGUF value type of an ``extra_kv`` value.

    ``bool`` -> BOOL; ``int`` -> INT64 (any Python int up to 2**63, one type whatever the
    value); ``float`` -> FLOAT64 (lossless for Python floats); ``str`` -> STRING; a list or
    tuple of ``str`` -> ARRAY of STRING (lists of bool/int/float -> ARRAY of BOOL/INT64/FLOAT64
    likewise; an empty list is an empty STRING array). numpy scalars count as their Python type, but ``np.uint32``
    -> UINT32 (llama.cpp's type for some keys, e.g. ``quantize.imatrix.chunks_count``).

    Returns:
        (value, type, element type or None).
    Raises:
        ValueError: any other type, or a list of mixed types.
    """

    def scalar(v: Any) -> tuple[Any, GGUFValueType]:
        if isinstance(v, np.uint32):
            return int(v), GGUFValueType.UINT32
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, bool):
            return v, GGUFValueType.BOOL
        if isinstance(v, int):
            if not -(2**63) <= v < 2**63:
                raise ValueError(f"extra_kv[{key!r}]: int {v} does not fit in int64")
            return v, GGUFValueType.INT64
        if isinstance(v, float):
            return v, GGUFValueType.FLOAT64
        if isinstance(v, str):
            return v, GGUFValueType.STRING
        raise ValueError(f"extra_kv[{key!r}]: unsupported value type {type(v).__name__}")

    if isinstance(value, (list, tuple)):
        if not value:
            return [], GGUFValueType.ARRAY, GGUFValueType.STRING
        items = [scalar(v) for v in value]
        types = {t for _, t in items}
        if len(types) != 1:
            raise ValueError(f"extra_kv[{key!r}]: list mixes types {sorted(t.name for t in types)}")
        return [v for v, _ in items], GGUFValueType.ARRAY, types.pop()
    v, t = scalar(value)
    return v, t, None


def _byte_shape(t: SourceTensor, fmt: Format) -> tuple[int, ...]:
    return (*t.shape[:-1], fmt.row_bytes(t.shape[-1]))


def _check_plan(source: TensorSource, tensors: Sequence[SourceTensor], types: Mapping[str, Format]) -> None:
    names = [t.gguf_name for t in tensors]
    missing = [n for n in names if n not in types]
    extra = sorted(set(types) - set(names))
    if missing or extra:
        raise ValueError(
            f"{source.source_id}: the format map does not match the source's tensors"
            + (f"; no format for: {', '.join(missing[:10])}" if missing else "")
            + (f"; not in the source: {', '.join(extra[:10])}" if extra else "")
        )
    for t in tensors:
        fmt = types[t.gguf_name]
        if fmt.ggml_type is None:
            raise ValueError(f"{t.gguf_name}: format {fmt.name} has no GGML type and cannot be written to GGUF")
        if not t.quantizable and fmt.name != "F32":
            # llama.cpp's converter keeps every 1-D tensor (norms, biases) in F32; its kernels
            # abort on a quantized norm
            raise ValueError(f"{t.gguf_name}: not a matmul weight, must stay F32 (got {fmt.name})")
        if not fmt.fits(t.shape[-1]):
            raise ValueError(f"{t.gguf_name}: row of {t.shape[-1]} is not a multiple of {fmt.name}'s block size {fmt.block_size}")


def _as_bytes(t: SourceTensor, fmt: Format, out: Any) -> np.ndarray:
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().numpy()
    out = np.ascontiguousarray(out)
    if out.dtype != np.uint8:
        out = out.reshape(-1).view(np.uint8)
    expected = _byte_shape(t, fmt)
    if out.size != int(np.prod(expected, dtype=np.int64)):
        raise ValueError(
            f"{t.gguf_name}: encode returned {out.size} bytes for {fmt.name} of shape {t.shape}, "
            f"expected {int(np.prod(expected, dtype=np.int64))}"
        )
    return out.reshape(expected)


def _verify(path: Path, tensors: Sequence[SourceTensor], types: Mapping[str, Format], file_type: int | None) -> None:
    """Read ``path``'s tensor table back: its tensors (names, types, shapes, in order) and, unless None,
    ``general.file_type`` (:func:`dynaquant.sources.readers.gguf_tensor_table`: the layout walk, every length checked,
    without parsing the metadata's values; whoever reads the file next parses them)."""
    from dynaquant.sources.readers import gguf_tensor_table

    table, ft = gguf_tensor_table(path)
    if len(table) != len(tensors):
        raise ValueError(f"{path}: read back {len(table)} tensors, wrote {len(tensors)}")
    for (name, raw_type, dims), t in zip(table, tensors):
        fmt = types[t.gguf_name]
        shape = tuple(reversed(dims))
        if name != t.gguf_name or raw_type != int(fmt.ggml_type) or shape != t.shape:
            raise ValueError(f"{path}: tensor read back as {name} {GGMLQuantizationType(raw_type).name} {shape}, "
                             f"wrote {t.gguf_name} {fmt.name} {t.shape}")
    if file_type is not None and ft != file_type:
        raise ValueError(f"{path}: general.file_type did not read back as {file_type}")


def needs_split(tensor_bytes: Sequence[int], split_max_size: int = 0, split_max_tensors: int = 0) -> bool:
    """Whether gguf-py's ``GGUFWriter(split_max_size=, split_max_tensors=)`` makes more than one shard of tensors of
    these byte sizes: a shard is closed before a tensor that would take its tensor data past ``split_max_size`` bytes
    or its count past ``split_max_tensors`` (0: no limit), every shard holding at least one tensor."""
    n = len(tensor_bytes)
    return n > 1 and ((split_max_size > 0 and sum(tensor_bytes) > split_max_size)
                      or (split_max_tensors > 0 and n > split_max_tensors))


def shard_paths_like(path: Path, count: int) -> list[Path]:
    """The files a GGUF output ``path`` of ``count`` shards is written as: ``[path]`` for one, else gguf-py's
    ``SHARD_NAME_FORMAT`` names beside it (``NAME-00001-of-00003.gguf`` ...), as ``GGUFWriter.format_shard_names``."""
    if count <= 1:
        return [path]
    return [path.with_name(SHARD_NAME_FORMAT.format(path.stem, i + 1, count)) for i in range(count)]


def is_output_file(path: Path, other: Path) -> bool:
    """Whether ``other`` is a file a GGUF output ``path`` may be written as: ``path`` itself or, in its folder, a
    shard of any split set named after it (``STEM-NNNNN-of-MMMMM.gguf``); compared by name, nothing read."""
    if other.name == path.name:
        return other.parent.resolve() == path.parent.resolve()
    m = GGUF_SHARD_NAME.match(other.name)
    return m is not None and m["stem"] == path.stem and other.parent.resolve() == path.parent.resolve()


def stale_shards(path: Path) -> list[Path]:
    """Files beside ``path`` that are an output of that name written earlier: ``path`` itself and the shards of any
    split set named after it (:func:`is_output_file`)."""
    folder = path.parent
    found = [p for p in folder.glob(glob_escape(path.stem) + "-*-of-*.gguf") if is_output_file(path, p)] if folder.is_dir() else []
    return ([path] if path.exists() else []) + sorted(found)


class GGUFFileWriter:
    """An incremental GGUF file writer: the header at once, then :meth:`add` per tensor in the source's order, then
    :meth:`finish` (or :meth:`abort` on an error). :func:`write_gguf` documents the arguments and the errors.

    The constructor checks the format map, declares every tensor (name, GGML type, byte shape) and writes header,
    key/values and tensor infos into a temporary file in the run's work folder; :meth:`finish` reads it back
    and renames it onto ``path``; :meth:`abort` removes it (``path`` is left as it was). An OSError of the writing
    itself becomes an InputError naming ``path``.

    Split output (llama.cpp's ``gguf-split`` layout): when the tensor data passes ``split_max_size`` bytes or the
    tensor count passes ``split_max_tensors`` (0: no limit; :func:`needs_split`), gguf-py's ``GGUFWriter`` splitting
    lays the tensors out over shards named ``NAME-00001-of-00003.gguf`` ... beside ``path`` (its
    ``format_shard_names``), each shard holding ``split.no`` (UINT16, from 0), ``split.count`` (UINT16) and
    ``split.tensors.count`` (INT32), the metadata in the first. Every shard is a temporary file in the work folder,
    filled as the tensors come (:meth:`add` writes each into its shard); :meth:`finish` reads each back, then
    renames the shards into place, the first shard last (a reader that sees it sees the whole set), and removes the
    outputs of that name an earlier run left that are not part of the new set (the single file or shards of another
    count: :func:`stale_shards`). On any error no shard is left (those renamed already are removed).
    Under the limits the file is the single ``path``, byte for byte as without them.

    Attributes:
        path: the output as asked for. paths: the files written (``[path]``, or the shards in order; the first is
            what llama.cpp and ``dynaquant`` read). tensors: the source's tensors, in the order :meth:`add` takes them.
        types: GGUF name -> format. total_bytes: tensor bytes added so far.
    """

    def __init__(self, path: str | os.PathLike, source: TensorSource, types: Mapping[str, Format],
                 extra_kv: Mapping[str, Any], file_type: int, work_dir: str | os.PathLike | None = None,
                 split_max_size: int = 0, split_max_tensors: int = 0):
        self.path = Path(path)
        self.tensors = source.tensors()
        self.types = types
        self.file_type = int(file_type)
        self.total_bytes = 0
        self._placed: list[Path] = []
        _check_plan(source, self.tensors, types)
        reserved = {"general.architecture", "general.file_type", "general.alignment"} & set(extra_kv)
        if reserved:
            raise ValueError(f"extra_kv may not set {', '.join(sorted(reserved))} (the writer owns them)")
        if split_max_size < 0 or split_max_tensors < 0:
            raise ValueError(f"split_max_size {split_max_size} and split_max_tensors {split_max_tensors} must be >= 0")
        typed_kv = {k: kv_value_type(k, v) for k, v in extra_kv.items()}
        sizes = [int(np.prod(_byte_shape(t, types[t.gguf_name]), dtype=np.int64)) for t in self.tensors]
        split = needs_split(sizes, split_max_size, split_max_tensors)

        writer = ArrayPackingWriter(None, source.arch, split_max_tensors=split_max_tensors if split else 0,
                         split_max_size=split_max_size if split else 0)
        source.add_metadata(writer)
        kv = writer.kv_data[0]
        writer.add_uint32("general.file_type", self.file_type)
        writer.add_uint32("general.quantization_version", GGML_QUANT_VERSION)
        for key, (value, vtype, sub) in typed_kv.items():
            kv.pop(key, None)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t, nbytes in zip(self.tensors, sizes):
            writer.add_tensor_info(t.gguf_name, _byte_shape(t, types[t.gguf_name]), np.dtype(np.uint8), nbytes,
                                   raw_dtype=types[t.gguf_name].ggml_type)
        by_name = {t.gguf_name: t for t in self.tensors}
        self._shard_tensors = [[by_name[n] for n in shard] for shard in writer.tensors]
        self.paths = shard_paths_like(self.path, len(writer.tensors))
        self._writer = writer
        self._stack = contextlib.ExitStack()
        try:
            if work_dir is None:
                with writing(self.path):
                    work_dir = self._stack.enter_context(run_workdir(self.path))
            self.tmp = Path(work_dir) / self.path.name
            self.tmps = shard_paths_like(self.tmp, len(self.paths))
            with writing(self.path):
                writer.write_header_to_file(self.tmp)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
        except BaseException:
            self.abort()
            raise

    def add(self, t: SourceTensor, data: Any) -> None:
        """Write the next tensor's bytes (``data``: the format's GGUF layout, uint8 ``(..., row_bytes)`` or any dtype
        whose raw bytes are that layout), aligned as the header says, into its shard.

        Raises:
            ValueError: ``data`` has the wrong number of bytes. InputError: the file cannot be written.
        """
        data = _as_bytes(t, self.types[t.gguf_name], data)
        with writing(self.path):
            self._writer.write_tensor_data(data)
        self.total_bytes += data.nbytes

    def finish(self) -> None:
        """Close the file(s), read each back (tensor count, names, types, shapes; the first: file type) and rename
        them into place, the first last; then remove an earlier run's outputs of that name not in the new set.

        Raises:
            ValueError: a file did not read back as written. InputError: it cannot be written.
        """
        with writing(self.path):
            self._writer.close()
        for i, (tmp, tensors) in enumerate(zip(self.tmps, self._shard_tensors)):
            _verify(tmp, tensors, self.types, self.file_type if i == 0 else None)
        stale = [p for p in stale_shards(self.path) if p not in self.paths]
        with writing(self.path):
            for tmp, final in list(zip(self.tmps, self.paths))[::-1]:
                os.replace(tmp, final)
                self._placed.append(final)
        self._placed = []  # the set is in place: nothing to undo
        for p in stale:
            try:
                p.unlink(missing_ok=True)
                logger.info("%s: removed, an earlier output of this name", p)
            except OSError as exc:
                logger.warning("%s: an earlier output of this name, could not be removed: %s", p, exc.strerror or exc)
        self._stack.close()
        where = f"{len(self.paths)} shards, first {self.paths[0]}" if len(self.paths) > 1 else str(self.path)
        logger.info("%s: wrote %d tensors, %.1f MiB of tensor data", where, len(self.tensors), self.total_bytes / 2**20)

    def abort(self) -> None:
        """Remove the temporary files (and the work folder made here) and any shard already renamed into place;
        ``path`` is left as it was (for a single file)."""
        try:
            self._writer.close()
        except OSError:  # flushing what is left fails again on a full disk
            pass
        for tmp in getattr(self, "tmps", [getattr(self, "tmp", None)]):
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        for p in self._placed:
            p.unlink(missing_ok=True)
        self._placed = []
        self._stack.close()


def write_gguf(
    path: str | os.PathLike,
    source: TensorSource,
    types: Mapping[str, Format],
    encode: EncodeFn,
    extra_kv: Mapping[str, Any],
    file_type: int,
    progress: bool = True,
    work_dir: str | os.PathLike | None = None,
    allow_nonfinite: bool = False,
) -> None:
    """Write a GGUF file from a source, one tensor at a time.

    Args:
        path: output file; written to a temporary file in the run's work folder beside it
            (:func:`dynaquant.workdir.run_workdir`, which also removes the leftovers of killed
            runs), read back with ``GGUFReader`` (tensor count, names, types, shapes, file type
            checked) and renamed onto ``path`` only then.
        source: the model; its ``add_metadata`` writes every key but the ones below.
        types: GGUF name -> format, one entry for every source tensor (nothing else); each
            format must have a GGML type and fit the tensor's row length, and tensors that
            are not ``quantizable`` (norms, biases) must be F32, as llama.cpp expects.
        encode: ``encode(tensor, weight, format)`` -> the tensor's bytes in the format's GGUF
            layout, e.g. ``quantize(weight, format).numpy()``: uint8 of ``(..., row_bytes)``
            (any dtype whose raw bytes are that layout is accepted); ``weight`` is float32 of
            ``tensor.shape``.
        extra_kv: more keys (the pipeline's ``dynaquant.*``), typed by :func:`kv_value_type`
            (bool BOOL, int INT64, float FLOAT64, str STRING, list of str ARRAY of STRING);
            a key the source already wrote is replaced; ``general.architecture``,
            ``general.file_type`` and ``general.alignment`` may not be set here.
        file_type: ``general.file_type`` (a ``gguf.LlamaFileType`` value), written as UINT32.
            ``general.quantization_version`` is written as gguf-py's ``GGML_QUANT_VERSION``.
        progress: show a tqdm bar over tensors.
        work_dir: an existing work folder on ``path``'s file system to write the temporary file in
            (kept); default: a fresh one beside ``path``, removed at the end.
        allow_nonfinite: each tensor read is checked for NaN and Inf before it is encoded; by default one
            raises ``InputError`` (naming the tensor and its file), with this the values are replaced as
            :mod:`dynaquant.sources.nonfinite` documents (NaN -> 0, +-Inf -> +-the tensor's largest finite |value|).
    Raises:
        InputError: a tensor holds NaN or Inf values and not ``allow_nonfinite``.
        ValueError: the format map does not match the source, a format does not fit (or is
            not F32 for a non-quantizable tensor), an encoder returned the wrong number of
            bytes, an ``extra_kv`` key is reserved or its value has an unsupported type, or
            the file did not read back as written.
        InputError: the file cannot be written (unwritable folder, full disk, file size limit):
            names ``path`` and the system's reason; no partial file is left.
        Any error of ``source.read`` or ``encode`` propagates. On any error the temporary file
        is removed and ``path`` is left as it was (absent, or the previous file).
    """
    out = GGUFFileWriter(path, source, types, extra_kv, file_type, work_dir)
    try:
        for t in tqdm(out.tensors, desc=f"writing {out.path.name}", unit="tensor", disable=not progress):
            fmt = types[t.gguf_name]
            w = check_finite(source.read(t), tensor_label(t.hf_name, t.gguf_name), source.file_of(t), allow_nonfinite)
            out.add(t, encode(t, w, fmt))
            del w
        out.finish()
    except BaseException:
        out.abort()
        raise
