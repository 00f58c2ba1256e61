"""The one place each file format a user gives us is opened: GGUF (:func:`open_gguf`), safetensors
(:func:`open_safetensors`, :class:`SafetensorsReader`) and JSON objects (:func:`read_json_object`: ``config.json``,
tokenizer files, indexes).

Both readers we build on trust the file: gguf-py's ``GGUFReader`` raises whatever numpy or ``struct`` raises
on a damaged file (``IndexError``, ``KeyError``, ``UnicodeDecodeError``, ...) and loops over counts read from
the file (an array length of 2^63 is a hang), and ``safetensors`` raises its own ``SafetensorError``. Here a
GGUF file's header is first walked with every count and length checked against the bytes left in the file
(:func:`check_gguf_layout`: GGUF v2/v3 as in llama.cpp ``docs/gguf.md`` and ``ggml/src/gguf.cpp``), so the
reader then allocates no more than a small multiple of the file's size; whatever either reader still raises
becomes :class:`~dynaquant.errors.InputError` naming the file, which the command line turns into exit 2.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np

from dynaquant.errors import InputError

# GGUFValueType -> bytes of one scalar (llama.cpp gguf.cpp GGUF_TYPE_SIZE); STRING (8) and ARRAY (9) have none.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions


class _Cursor:
    """Little-endian reads from a GGUF header, each checked against the end of the file."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise InputError(f"{self.path}: damaged or truncated GGUF file: {what} ({n} bytes at offset {self.pos}) runs "
                             f"past the end of the file ({self.size - self.pos} bytes left)")

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", f"{what} length")
        self.need(n, what)
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b

    def skip_value(self, vtype: int, what: str) -> None:
        if vtype in _SCALAR_BYTES:
            self.need(_SCALAR_BYTES[vtype], what)
            self.pos += _SCALAR_BYTES[vtype]
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            itype = self.unpack("<I", f"{what} element type")
            count = self.unpack("<Q", f"{what} length")
            if itype in _SCALAR_BYTES:
                self.need(count * _SCALAR_BYTES[itype], f"{what}: {count} elements")
                self.pos += count * _SCALAR_BYTES[itype]
            elif itype == _STRING:
                self.need(count * 8, f"{what}: {count} strings")  # each string has at least its 8-byte length
                pos, size, length = self.pos, self.size, _U64.unpack_from
                for i in range(count):  # self.string(f"{what}[{i}]") without copying the bytes (a vocabulary's loop)
                    n = length(self.buf, pos)[0] if size - pos >= 8 else size
                    if n > size - pos - 8:
                        self.pos = pos
                        self.string(f"{what}[{i}]")  # raises, naming the string
                    pos += 8 + n
                self.pos = pos
            else:  # llama.cpp reads no arrays of arrays either
                raise InputError(f"{self.path}: damaged GGUF file: {what} is an array of value type {itype}")
        else:
            raise InputError(f"{self.path}: damaged GGUF file: {what} has unknown value type {vtype}")


def check_gguf_layout(path: str | os.PathLike) -> int:
    """Walk a GGUF file's header and tensor table, checking every count, length and tensor extent against the
    file's size, before gguf-py (which trusts them) reads it. Returns the offset of the tensor data (bytes of
    header, metadata, tensor infos and alignment padding), without parsing any value.

    Checked: the magic, version 2 or 3, key/value and tensor counts that fit the bytes left, known value
    types, no nested arrays, ``general.alignment`` a power of two, 1 to 4 dimensions per tensor, a known GGML
    type, dimensions and element counts within int64, a row length divisible by the type's block size, and
    each tensor's data inside the file.

    Raises:
        InputError: naming the file and the first problem found (also for a missing or unreadable file).
    """
    return _walk_file(Path(path))


def _walk_file(path: Path, table: dict | None = None) -> int:
    """:func:`_check_layout` on the file at ``path``, memory-mapped."""
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < 24:
                raise InputError(f"{path}: not a GGUF file ({os.fstat(fh.fileno()).st_size} bytes, shorter than a GGUF header)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _check_layout(path, buf, table)
    except OSError as e:
        raise InputError(f"{path}: cannot read GGUF file: {e.strerror or e}") from e


def gguf_tensor_table(path: str | os.PathLike) -> tuple[list[tuple[str, int, tuple[int, ...]]], int | None]:
    """A GGUF file's tensors as ``(name, GGML type, dims in GGUF order)`` and its ``general.file_type`` (None when
    absent or not a UINT32), read by :func:`check_gguf_layout`'s walk (every count, length and extent checked, no
    metadata value parsed): a writer's read-back check without gguf-py's parse of a 49k-token vocabulary.

    Raises:
        InputError: as :func:`check_gguf_layout`.
    """
    table: dict = {}
    _walk_file(Path(path), table)
    return table["tensors"], table.get("file_type")


def _check_layout(path: Path, buf, table: dict | None = None) -> int:
    """:func:`check_gguf_layout`'s walk; fills ``table`` (when given) with ``tensors`` and ``file_type``."""
    cur = _Cursor(path, buf)
    if bytes(buf[:4]) != b"GGUF":
        raise InputError(f"{path}: not a GGUF file (no GGUF magic at its start)")
    cur.pos = 4
    version = cur.unpack("<I", "the version")
    if version not in (2, 3):
        raise InputError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_kv = cur.unpack("<Q", "the key count")
    cur.need(n_kv * 13, f"the key count {n_kv}")  # smallest key/value: 8-byte key length, 1 key byte, 4-byte type
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"key {i + 1}").decode("utf-8", errors="replace")
        vtype = cur.unpack("<I", f"the type of key {key!r}")
        if key == "general.alignment" and vtype == _UINT32:
            alignment = cur.unpack("<I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise InputError(f"{path}: damaged GGUF file: general.alignment {alignment} is not a power of two")
        elif key == "general.file_type" and vtype == _UINT32 and table is not None:
            table["file_type"] = cur.unpack("<I", "general.file_type")
        else:
            cur.skip_value(vtype, f"the value of key {key!r}")
    cur.need(n_tensors * 24, f"the tensor count {n_tensors}")  # name length, dimension count, type, offset
    extents = []
    for i in range(n_tensors):
        name = cur.string(f"tensor {i + 1} name").decode("utf-8", errors="replace")
        n_dims = cur.unpack("<I", f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise InputError(f"{path}: damaged GGUF file: tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = [cur.unpack("<Q", f"tensor {name!r} dimensions") for _ in range(n_dims)]
        raw_type = cur.unpack("<I", f"tensor {name!r} type")
        offset = cur.unpack("<Q", f"tensor {name!r} data offset")
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise InputError(f"{path}: damaged GGUF file: tensor {name!r} has unknown GGML type {raw_type}") from None
        if dims[0] % block:
            raise InputError(f"{path}: damaged GGUF file: tensor {name!r} rows of {dims[0]} do not split into "
                             f"blocks of {block}")
        n_elements = 1
        for d in dims:
            n_elements *= d
        if max(dims) >= 1 << 63 or n_elements >= 1 << 63:  # llama.cpp: int64 dimensions and element count
            raise InputError(f"{path}: damaged GGUF file: tensor {name!r} has dimensions {dims}, past int64")
        extents.append((name, offset, n_elements // block * type_bytes))
        if table is not None:
            table.setdefault("tensors", []).append((name, raw_type, tuple(dims)))
    if table is not None:
        table.setdefault("tensors", [])
    data_start = -(-cur.pos // alignment) * alignment
    for name, offset, n_bytes in extents:
        if data_start + offset + n_bytes > cur.size:
            raise InputError(f"{path}: damaged or truncated GGUF file: tensor {name!r} ({n_bytes} bytes at offset "
                             f"{data_start + offset}) runs past the end of the file ({cur.size} bytes)")
    return data_start


class FastGGUFReader(gguf.GGUFReader):
    """gguf-py's ``GGUFReader`` with the same fields, parts, types and tensors, parsed ~4x faster.

    gguf-py slices its ``np.memmap`` once or twice per metadata value, and every memmap slice runs numpy's
    ``memmap.__array_finalize__`` (a 49k-token vocabulary and its merges, ~250 000 parts, took 3.4 s of a 4.1 s
    parse on a 2-core CPU). Here the slices are taken from a plain ``ndarray`` view of the same map (still zero-copy,
    read-only) and an array of strings is walked in one loop; anything else (other arrays, a byte-swapped file) goes
    through gguf-py's own code. ``tests/test_gguf_reader.py`` compares every field and tensor with ``GGUFReader``'s.
    """

    @functools.cached_property
    def _plain(self) -> np.ndarray:  # (gguf-py's __init__ parses: set on first use, after self.data)
        return self.data.view(np.ndarray)

    def _get(self, offset, dtype, count=1, override_order=None):
        count, dt = int(count), np.dtype(dtype)
        arr = self._plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if raw_itype[0] != gguf.GGUFValueType.STRING or alen[0] == 0:
            return super()._get_field_parts(orig_offs, raw_type)
        plain, u64 = self._plain, np.dtype(np.uint64)
        view = memoryview(plain)
        parts, offs = [raw_itype, alen], orig_offs + 12
        for _ in range(int(alen[0])):  # as gguf-py: each string's length (uint64 [1]) and its bytes (uint8 [n])
            n = int.from_bytes(view[offs : offs + 8], sys.byteorder)  # byte_order "I": the host's
            if offs + 8 + n > len(plain):
                raise ValueError(f"string at offset {offs} runs past the end of the file")
            parts += (plain[offs : offs + 8].view(u64), plain[offs + 8 : offs + 8 + n])
            offs += 8 + n
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]


# The last few GGUFReaders opened, by (path, device, inode, size, digest of the header bytes): gguf-py parses every
# metadata field in Python
# (a 49k-token vocabulary takes seconds), and one run opens its source several times. Only files up to
# _READERS_MAX_BYTES are kept (a kept reader maps its file: a large one removed meanwhile would hold its disk space).
_READERS: dict[tuple, gguf.GGUFReader] = {}
_READERS_KEPT = 4
_READERS_MAX_BYTES = 4 << 30


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file with gguf-py's ``GGUFReader`` (:class:`FastGGUFReader`; memory-mapped, read-only), after
    :func:`check_gguf_layout`.

    The reader of a file (up to 4 GiB) opened recently is returned again while the file is the same (inode, size,
    and a digest of its header, metadata and tensor table: what the reader parsed; the tensor data stays mapped),
    under any name (the GGUF writer's read-back of its temporary file serves the evaluation of the file renamed into
    place); callers must not modify it.

    Raises:
        InputError: the file is missing, unreadable, not a GGUF file, or damaged; the message names it.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such GGUF file")
    data_start = check_gguf_layout(path)
    st = path.stat()
    with open(path, "rb") as f:
        digest = hashlib.blake2b(f.read(data_start), digest_size=16).digest()
    key = (st.st_dev, st.st_ino, st.st_size, digest)  # (not the name: a file verified, then renamed, is found again)
    if key in _READERS:
        return _READERS[key]
    try:
        reader = FastGGUFReader(path)
    except (MemoryError, RecursionError):
        raise
    except Exception as e:  # noqa: BLE001 - gguf-py raises KeyError, ValueError, UnicodeDecodeError, ... on damaged files
        raise InputError(f"{path}: damaged GGUF file ({type(e).__name__}: {e})") from e
    if st.st_size <= _READERS_MAX_BYTES:
        while len(_READERS) >= _READERS_KEPT:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = reader
    return reader


# a llama.cpp split GGUF's file names: gguf-py's SHARD_NAME_FORMAT (NAME-00001-of-00003.gguf), as llama_split_path
# names them; groups stem, no (from 1) and count
GGUF_SHARD_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def gguf_shard_paths(path: str | os.PathLike, count: int) -> list[Path]:
    """The files of a llama.cpp split GGUF of ``count`` shards whose first shard is ``path``: gguf-py's
    ``SHARD_NAME_FORMAT`` (``NAME-00001-of-00003.gguf`` ...), as llama.cpp's ``llama_split_path`` names them.

    Raises:
        InputError: ``path`` is not named as the first of ``count`` shards.
    """
    path = Path(path)
    m = GGUF_SHARD_NAME.match(path.name)
    if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
        raise InputError(f"{path}: a split GGUF of {count} shards, but not named as its first shard "
                         f"({gguf.SHARD_NAME_FORMAT.format('NAME', 1, count)})")
    return [path.with_name(gguf.SHARD_NAME_FORMAT.format(m["stem"], i + 1, count)) for i in range(count)]


def open_gguf_shards(path: str | os.PathLike) -> list[gguf.GGUFReader]:
    """A GGUF file, or every shard of a llama.cpp split GGUF given its first shard, opened with :func:`open_gguf`.

    A split GGUF (llama.cpp ``gguf-split`` / gguf-py ``GGUFWriter(split_max_size=...)``) holds ``split.no``,
    ``split.count`` and ``split.tensors.count`` in every shard; the metadata is in the first, the tensors are
    spread over all of them in order. Each shard is checked: its ``split.no`` and ``split.count``, and the tensor
    count over all shards against ``split.tensors.count``.

    Returns:
        One reader per file, in shard order (``[reader]`` for a file that is not split).
    Raises:
        InputError: a file is missing (named), unreadable or damaged; ``path`` is not the first shard; a shard's
            split keys do not match its place in the set.
    """
    path = Path(path)
    first = open_gguf(path)
    count = gguf_field(first, path, gguf.Keys.Split.LLM_KV_SPLIT_COUNT, int)
    if count is None or count <= 1:
        return [first]
    if (no := gguf_field(first, path, gguf.Keys.Split.LLM_KV_SPLIT_NO, int)) != 0:
        raise InputError(f"{path}: is shard {no} (counting from 0) of a split GGUF of {count}; give the first shard")
    paths = gguf_shard_paths(path, count)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise InputError(f"{path}: split GGUF of {count} shards: {', '.join(str(p) for p in missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing")
    readers = [first] + [open_gguf(p) for p in paths[1:]]
    for i, (p, r) in enumerate(zip(paths, readers)):
        got = (gguf_field(r, p, gguf.Keys.Split.LLM_KV_SPLIT_NO, int), gguf_field(r, p, gguf.Keys.Split.LLM_KV_SPLIT_COUNT, int))
        if got != (i, count):
            raise InputError(f"{p}: split.no / split.count read {got[0]} / {got[1]}, expected {i} / {count} "
                             "(a shard of another split set?)")
    expected = gguf_field(first, path, gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, int)
    total = sum(len(r.tensors) for r in readers)
    if expected is not None and total != expected:
        raise InputError(f"{path}: split GGUF of {count} shards holds {total} tensors, split.tensors.count says {expected}")
    return readers


def gguf_field(reader: gguf.GGUFReader, path: str | os.PathLike, key: str, kind: type):
    """The value of one metadata key of a GGUF file opened with :func:`open_gguf`, or None when absent.

    Args:
        kind: ``int`` (any integer type), ``str`` (a string) or ``list`` (an array).
    Raises:
        InputError: the key holds another kind of value, or a string that is not UTF-8 (names the file and key).
    """
    f = reader.fields.get(key)
    if f is None:
        return None
    main = f.types[0] if f.types else None
    ints = {gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16, gguf.GGUFValueType.INT16,
            gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32, gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64}
    ok = {int: main in ints, str: main == gguf.GGUFValueType.STRING, list: main == gguf.GGUFValueType.ARRAY}[kind]
    if not ok:
        raise InputError(f"{path}: GGUF key {key} is {getattr(main, 'name', main)}, expected {kind.__name__}")
    try:
        return f.contents()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: GGUF key {key} holds text that is not UTF-8") from e


@contextmanager
def open_safetensors(path: str | os.PathLike, device: str = "cpu") -> Iterator:
    """``safetensors.safe_open(path, "pt", device)``, with the library's errors (a damaged header, invalid
    JSON, offsets outside the file), while opening or while reading tensors inside the block, raised as
    :class:`InputError` naming the file.

    Yields:
        The open handle (``keys()``, ``get_slice(name)``, ``get_tensor(name)``, ``metadata()``).
    Raises:
        InputError: the file is missing, unreadable or not a valid safetensors file.
    """
    handle = _safe_open(path, device)
    with _damaged_as_input_error(path), handle as f:
        yield f


def _safe_open(path: str | os.PathLike, device: str = "cpu"):
    """``safetensors.safe_open(path, "pt", device)``, its opening errors raised as :class:`InputError` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device=device)
    except SafetensorError as e:
        raise InputError(f"{path}: not a valid safetensors file ({e})") from e
    except OSError as e:
        raise InputError(f"{path}: cannot read safetensors file: {e.strerror or e}") from e


@contextmanager
def _damaged_as_input_error(path: str | os.PathLike) -> Iterator[None]:
    """The library's errors while reading tensors of an open file raised as :class:`InputError` naming the file."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise InputError(f"{path}: damaged safetensors file ({e})") from e


class SafetensorsReader:
    """Tensors read from safetensors files through ``safe_open`` handles kept open between reads.

    Opening a file parses its JSON header: a DeepSeek-V3 shard lists about 560 tensors, and a block's
    256 routed experts are 1536 tensors (weights and FP8 scales) read one at a time, so opening per
    tensor costs more than the reads. A handle here is reused until ``remap_bytes`` have been read
    through it, then closed (its file mapping released) and reopened on the next read: the file pages a
    handle maps while open stay within about ``remap_bytes``, and at most ``max_open`` handles are kept
    (least recently used closed first), so the mapped pages the reads add to the process stay within
    about ``max_open * remap_bytes`` (default 2 x 512 MiB). Thread-safe (one read at a time).
    A reader is not pickled with its owner (:meth:`__getstate__`: a copy opens its own handles).
    """

    def __init__(self, max_open: int = 2, remap_bytes: int = 512 << 20):
        import threading
        from collections import OrderedDict

        self.max_open, self.remap_bytes = max_open, remap_bytes
        self._open: OrderedDict[str, list] = OrderedDict()  # path -> [handle, bytes read through it]
        self._lock = threading.Lock()
        self.opens = 0  # files opened (for tests and benchmarks)

    def __getstate__(self) -> dict:
        return {"max_open": self.max_open, "remap_bytes": self.remap_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_open"], state["remap_bytes"])

    def get_tensor(self, path: str | os.PathLike, name: str):
        """Tensor ``name`` of the safetensors file ``path`` (a torch tensor on the CPU, as stored).

        Raises:
            InputError: the file is missing, unreadable, not a valid safetensors file, or damaged (names the file).
        """
        key = str(path)
        with self._lock:
            entry = self._open.pop(key, None)
            if entry is None:
                entry = [_safe_open(path), 0]
                self.opens += 1
            with _damaged_as_input_error(path):
                x = entry[0].get_tensor(name)
            entry[1] += x.numel() * x.element_size()
            if entry[1] < self.remap_bytes:  # kept (most recently used last)
                self._open[key] = entry
                while len(self._open) > self.max_open:
                    self._open.popitem(last=False)
            return x

    def close(self) -> None:
        """Close every handle (their mappings released); later reads reopen."""
        with self._lock:
            self._open.clear()


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file that must hold an object (``config.json``, ``tokenizer_config.json``, an index ...).

    Raises:
        InputError: the file cannot be read, is not JSON, or is not an object (the message names it).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a JSON object (a {type(data).__name__} at the top level)")
    return data
