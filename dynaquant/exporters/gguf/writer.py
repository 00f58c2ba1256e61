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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGUFReader, GGUFValueType, GGUFWriter, WriterState
from tqdm import tqdm

from dynaquant.quant.formats import Format
from dynaquant.sources.gguf import SourceTensor, TensorSource
from dynaquant.sources.nonfinite import check_finite, tensor_label
from dynaquant.workdir import run_workdir, writing

logger = logging.getLogger(__name__)

EncodeFn = Callable[[SourceTensor, torch.Tensor, Format], np.ndarray]


class _Writer(GGUFWriter):
    """gguf-py's writer, also accepting empty arrays when their element type is given."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None) -> bytes:
        if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


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
    likewise; an empty list is an empty STRING array). numpy scalars count as their Python type.

    Returns:
        (value, type, element type or None).
    Raises:
        ValueError: any other type, or a list of mixed types.
    """

    def scalar(v: Any) -> tuple[Any, GGUFValueType]:
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


def _verify(path: Path, tensors: Sequence[SourceTensor], types: Mapping[str, Format], file_type: int) -> None:
    reader = GGUFReader(path)
    try:
        if len(reader.tensors) != len(tensors):
            raise ValueError(f"{path}: read back {len(reader.tensors)} tensors, wrote {len(tensors)}")
        for rt, t in zip(reader.tensors, tensors):
            fmt = types[t.gguf_name]
            shape = tuple(int(n) for n in reversed(rt.shape.tolist()))
            if rt.name != t.gguf_name or rt.tensor_type != fmt.ggml_type or shape != t.shape:
                raise ValueError(
                    f"{path}: tensor read back as {rt.name} {rt.tensor_type.name} {shape}, "
                    f"wrote {t.gguf_name} {fmt.name} {t.shape}"
                )
        ft = reader.fields.get("general.file_type")
        if ft is None or int(ft.contents()) != file_type:
            raise ValueError(f"{path}: general.file_type did not read back as {file_type}")
    finally:
        del reader


class GGUFFileWriter:
    """An incremental GGUF file writer: the header at once, then :meth:`add` per tensor in the source's order, then
    :meth:`finish` (or :meth:`abort` on an error). :func:`write_gguf` documents the arguments and the errors.

    The constructor checks the format map, declares every tensor (name, GGML type, byte shape) and writes header,
    key/values and tensor infos into a temporary file in the run's work folder; :meth:`finish` reads it back
    and renames it onto ``path``; :meth:`abort` removes it (``path`` is left as it was). An OSError of the writing
    itself becomes an InputError naming ``path``.

    Attributes:
        path: the output file. tensors: the source's tensors, in the order :meth:`add` takes them.
        types: GGUF name -> format. total_bytes: tensor bytes added so far.
    """

    def __init__(self, path: str | os.PathLike, source: TensorSource, types: Mapping[str, Format],
                 extra_kv: Mapping[str, Any], file_type: int, work_dir: str | os.PathLike | None = None):
        self.path = Path(path)
        self.tensors = source.tensors()
        self.types = types
        self.file_type = int(file_type)
        self.total_bytes = 0
        _check_plan(source, self.tensors, types)
        reserved = {"general.architecture", "general.file_type", "general.alignment"} & set(extra_kv)
        if reserved:
            raise ValueError(f"extra_kv may not set {', '.join(sorted(reserved))} (the writer owns them)")
        typed_kv = {k: kv_value_type(k, v) for k, v in extra_kv.items()}

        writer = _Writer(None, source.arch)
        source.add_metadata(writer)
        kv = writer.kv_data[0]
        writer.add_uint32("general.file_type", self.file_type)
        writer.add_uint32("general.quantization_version", GGML_QUANT_VERSION)
        for key, (value, vtype, sub) in typed_kv.items():
            kv.pop(key, None)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t in self.tensors:
            fmt = types[t.gguf_name]
            shape = _byte_shape(t, fmt)
            writer.add_tensor_info(t.gguf_name, shape, np.dtype(np.uint8), int(np.prod(shape, dtype=np.int64)),
                                   raw_dtype=fmt.ggml_type)
        self._writer = writer
        self._stack = contextlib.ExitStack()
        try:
            if work_dir is None:
                with writing(self.path):
                    work_dir = self._stack.enter_context(run_workdir(self.path))
            self.tmp = Path(work_dir) / self.path.name
            with writing(self.path):
                writer.write_header_to_file(self.tmp)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
        except BaseException:
            self.abort()
            raise

    def add(self, t: SourceTensor, data: Any) -> None:
        """Write the next tensor's bytes (``data``: the format's GGUF layout, uint8 ``(..., row_bytes)`` or any dtype
        whose raw bytes are that layout), aligned as the header says.

        Raises:
            ValueError: ``data`` has the wrong number of bytes. InputError: the file cannot be written.
        """
        data = _as_bytes(t, self.types[t.gguf_name], data)
        with writing(self.path):
            self._writer.write_tensor_data(data)
        self.total_bytes += data.nbytes

    def finish(self) -> None:
        """Close the file, read it back (tensor count, names, types, shapes, file type) and rename it onto ``path``.

        Raises:
            ValueError: the file did not read back as written. InputError: it cannot be written.
        """
        with writing(self.path):
            self._writer.close()
        _verify(self.tmp, self.tensors, self.types, self.file_type)
        with writing(self.path):
            os.replace(self.tmp, self.path)
        self._stack.close()
        logger.info("%s: wrote %d tensors, %.1f MiB of tensor data", self.path, len(self.tensors), self.total_bytes / 2**20)

    def abort(self) -> None:
        """Remove the temporary file (and the work folder made here); ``path`` is left as it was."""
        try:
            self._writer.close()
        except OSError:  # flushing what is left fails again on a full disk
            pass
        tmp = getattr(self, "tmp", None)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
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
