"""Read and write llama.cpp importance-matrix files (``llama-imatrix`` output, ``llama-quantize --imatrix`` input).

Two formats exist, both read here; the GGUF one is also written:

* **GGUF imatrix** (the default of ``llama-imatrix`` since 2025; spec: ``tools/imatrix/imatrix.cpp``
  ``save_imatrix`` and ``common/imatrix-loader.cpp`` in llama.cpp). Metadata: ``general.type = "imatrix"``
  (string), ``imatrix.datasets`` (array of strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size``
  (uint32). No ``general.architecture``. For each weight, in byte order of the names:
  ``<name>.in_sum2``, F32, ggml shape ``[K, n_mat]`` (raw sums over tokens of x^2 per input column, one
  row per expert of a 3-D MoE tensor) and ``<name>.counts``, F32, ggml shape ``[1, n_mat]`` (tokens seen
  per matrix). ggml drops trailing dimensions of 1, so a dense weight has ``[K]`` and ``[1]``.
  ``<name>`` is the GGUF weight name with its suffix: ``blk.3.ffn_down.weight``.
* **Legacy ``.dat``** (``--output-format dat``): little-endian int32 ``n_entries``, then per entry int32
  name length, the name bytes, int32 ``ncall``, int32 ``nval`` and ``nval`` float32 values, then an
  optional trailer: int32 chunk count, int32 dataset-name length, the name bytes. The values are not
  sums: they are ``sum / count * ncall`` with ``ncall = ceil(max count / chunk_size)``, so the mean is
  ``value / ncall``; the token counts, the chunk size and the expert split of a 3-D tensor are lost.

Our own statistics (:class:`dynaquant.analysis.imatrix.Imatrix`) are keyed by HF module name;
:func:`imatrix_entries` re-keys them for :func:`save_imatrix_gguf`.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from dynaquant.analysis.imatrix import Imatrix
from dynaquant.errors import InputError
from dynaquant.sources.readers import gguf_field, open_gguf
from dynaquant.workdir import run_workdir, writing

logger = logging.getLogger(__name__)

IMATRIX_TYPE = "imatrix"
KEY_DATASETS = gguf.Keys.IMatrix.DATASETS  # "imatrix.datasets"
KEY_CHUNK_COUNT = gguf.Keys.IMatrix.CHUNK_COUNT  # "imatrix.chunk_count"
KEY_CHUNK_SIZE = gguf.Keys.IMatrix.CHUNK_SIZE  # "imatrix.chunk_size"
SUFFIX_SUMS = ".in_sum2"
SUFFIX_COUNTS = ".counts"

_GGUF_MAGIC = b"GGUF"
_MAX_COUNT_F32 = 1 << 24  # counts are stored as float32 by llama-imatrix: exact up to 2^24 tokens

# (sum of x^2: (K,) or (n_expert, K) float, tokens: int or (n_expert,) ints)
Entry = tuple[torch.Tensor | np.ndarray, int | torch.Tensor | np.ndarray]


@dataclass
class ImatrixData:
    """An importance matrix read from (or to be written to) a llama.cpp imatrix file.

    Attributes:
        sums: GGUF weight name (``"blk.3.ffn_down.weight"``) -> float64 sums over tokens of x^2 per
            input column: ``(K,)`` for a dense weight, ``(n_expert, K)`` for a 3-D MoE expert weight.
            From a legacy ``.dat`` file these are the stored ``mean * ncall`` values, flat
            ``(n_expert * K,)`` for experts (see :func:`load_imatrix`).
        counts: same keys -> int64 tokens accumulated, shape ``sums[name].shape[:-1]`` (a 0-d tensor
            for a dense weight, ``(n_expert,)`` per expert). From a legacy file: ``ncall`` (chunks), or
            tokens when a chunk size was given.
        datasets: the calibration text files named in the file (may be empty).
        chunk_count: chunks the statistics were accumulated over.
        chunk_size: tokens per chunk (0 when unknown: legacy files do not record it).
        legacy: read from the legacy ``.dat`` format.
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False

    def names(self) -> list[str]:
        """GGUF weight names, in byte order (the order llama-imatrix writes)."""
        return sorted(self.sums, key=lambda s: s.encode())

    def mean(self, name: str) -> torch.Tensor:
        """E[x^2] per input column of one weight, as llama-quantize computes it.

        Returns:
            float32 ``(K,)`` (``(n_expert, K)`` for expert weights); a matrix that saw no tokens gets
            ones, as in llama-quantize.
        Raises:
            KeyError: no entry of that name.
        """
        s, c = self.sums[name], self.counts[name].to(torch.float64).unsqueeze(-1)
        return torch.where(c > 0, s / c.clamp(min=1), torch.ones_like(s)).to(torch.float32)

    def means(self) -> dict[str, torch.Tensor]:
        """{GGUF weight name: :meth:`mean`}: the form the quantizers take (``imatrix_by_gguf_name``)."""
        return {n: self.mean(n) for n in self.names()}

    def entries(self) -> dict[str, Entry]:
        """{name: (sums, counts)}: the input of :func:`save_imatrix_gguf`."""
        return {n: (self.sums[n], self.counts[n]) for n in self.names()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write these statistics as a GGUF imatrix (see :func:`save_imatrix_gguf`)."""
        return save_imatrix_gguf(path, self.entries(), datasets=self.datasets, chunk_count=self.chunk_count,
                                 chunk_size=self.chunk_size)


# ---------------------------------------------------------------------------------------------- writing


def _entry_arrays(name: str, sums, counts) -> tuple[np.ndarray, np.ndarray]:
    """Validated float32 (n_mat, K) sums and (n_mat,) counts of one entry."""
    s = sums.detach().cpu().to(torch.float64).numpy() if isinstance(sums, torch.Tensor) else np.asarray(sums, np.float64)
    c = counts.detach().cpu().numpy() if isinstance(counts, torch.Tensor) else np.asarray(counts)
    if s.ndim not in (1, 2) or s.shape[-1] < 1 or s.size == 0:
        raise ValueError(f"imatrix entry {name!r}: sums must have shape (K,) or (n_expert, K), got {tuple(s.shape)}")
    n_mat = 1 if s.ndim == 1 else s.shape[0]
    if c.size != n_mat or c.ndim > 1:
        raise ValueError(f"imatrix entry {name!r}: counts of shape {tuple(c.shape)} do not match sums {tuple(s.shape)}")
    c = c.reshape(n_mat)
    if not np.issubdtype(c.dtype, np.integer):
        if not np.all(np.isfinite(c)) or np.any(c != np.round(c)):
            raise ValueError(f"imatrix entry {name!r}: counts must be whole numbers, got {c.tolist()[:4]}")
        c = c.astype(np.int64)
    if np.any(c < 0):
        raise ValueError(f"imatrix entry {name!r}: negative count")
    if np.any(c > _MAX_COUNT_F32):
        logger.warning("imatrix entry %s: count %d above 2^24 is rounded to float32 (as llama-imatrix does)", name, c.max())
    s32 = s.reshape(n_mat, -1).astype(np.float32)
    if not np.all(np.isfinite(s32)) or np.any(s32 < 0):
        raise ValueError(f"imatrix entry {name!r}: sums of squares must be finite and >= 0 in float32")
    return s32, c.astype(np.float32)


def save_imatrix_gguf(path: str | os.PathLike, entries: Mapping[str, Entry], *, datasets: list[str],
                      chunk_count: int, chunk_size: int) -> Path:
    """Write an imatrix in llama.cpp's GGUF imatrix format, as ``llama-imatrix`` writes it.

    Same metadata keys, value types, tensor names, order, dtypes, shapes and alignment as
    ``IMatrixCollector::save_imatrix`` (module docstring); ``llama-quantize --imatrix`` reads it.
    The file appears only when complete (written in a work folder beside it, then renamed).

    Args:
        path: output file (by convention ``*.gguf``).
        entries: GGUF weight name with suffix (``"blk.3.ffn_down.weight"``) -> (sums, counts): sums of
            x^2 over tokens, float ``(K,)`` for a dense weight or ``(n_expert, K)`` for a 3-D expert
            weight (one row per expert; ``n_expert == 1`` is written as dense, as ggml does); counts,
            the tokens accumulated, an int (dense) or ``(n_expert,)`` ints. Stored as float32, as
            llama.cpp does (counts exact up to 2^24).
        datasets: calibration text names for ``imatrix.datasets``; at least one (gguf-py cannot write
            an empty array).
        chunk_count: chunks processed (``imatrix.chunk_count``, uint32).
        chunk_size: tokens per chunk (``imatrix.chunk_size``, uint32; llama-imatrix's ``n_ctx / n_parallel``).
    Returns:
        The path written.
    Raises:
        ValueError: no entries, an entry of bad shape, negative or non-finite values, non-whole
            counts, no datasets, or chunk numbers outside uint32.
        InputError: the file cannot be written (unwritable folder, full disk), naming ``path``.
    """
    path = Path(path)
    if not entries:
        raise ValueError(f"{path}: no imatrix entries to write")
    if not datasets:
        raise ValueError(f"{path}: imatrix.datasets needs at least one name (gguf-py cannot write an empty array)")
    for what, v in (("chunk_count", chunk_count), ("chunk_size", chunk_size)):
        if not 0 <= int(v) < 1 << 32:
            raise ValueError(f"{path}: {what}={v} does not fit a uint32")
    bad = [n for n in entries if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"{path}: bad imatrix entry name {bad[0]!r}")
    arrays = {}
    for name in sorted(entries, key=lambda s: s.encode()):  # llama-imatrix: std::sort of the names
        arrays[name] = _entry_arrays(name, *entries[name])

    with writing(path), run_workdir(path) as work:  # same folder: the rename is atomic
        tmp = work / path.name
        w = gguf.GGUFWriter(tmp, IMATRIX_TYPE)  # opens nothing until write_header_to_file
        try:
            # GGUFWriter always adds general.architecture; an imatrix file has none.
            for kv in w.kv_data:
                kv.pop(gguf.Keys.General.ARCHITECTURE, None)
            w.add_type(IMATRIX_TYPE)
            w.add_array(KEY_DATASETS, [str(d) for d in datasets])
            w.add_uint32(KEY_CHUNK_COUNT, int(chunk_count))
            w.add_uint32(KEY_CHUNK_SIZE, int(chunk_size))
            for name, (s, c) in arrays.items():
                n_mat = s.shape[0]
                w.add_tensor(name + SUFFIX_SUMS, s if n_mat > 1 else s.reshape(-1))
                w.add_tensor(name + SUFFIX_COUNTS, c.reshape(n_mat, 1) if n_mat > 1 else c)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        except BaseException:
            try:
                w.close()
            except OSError:  # flushing fails again on a full disk
                pass
            raise
        os.replace(tmp, path)
    logger.info("wrote imatrix %s: %d entries, %d chunks of %d tokens", path, len(arrays), chunk_count, chunk_size)
    return path


def imatrix_entries(im: Imatrix, name_map: Callable[[str], str | None]) -> dict[str, Entry]:
    """Our HF-keyed :class:`Imatrix` as :func:`save_imatrix_gguf` entries.

    Args:
        im: statistics keyed by HF module name (``"model.layers.3.mlp.down_proj"``).
        name_map: HF module name -> GGUF weight name with suffix (``"blk.3.ffn_down.weight"``), or
            None to leave the module out. llama-imatrix itself records only ``blk.*`` weights, and
            ``output.weight`` with ``--process-output``.
    Returns:
        {GGUF name: ((K,) float64 sums, int tokens)}.
    Raises:
        ValueError: two modules map to the same GGUF name.
    """
    out: dict[str, Entry] = {}
    source: dict[str, str] = {}
    for hf in im.names():
        g = name_map(hf)
        if g is None:
            continue
        if g in out:
            raise ValueError(f"imatrix: modules {source[g]!r} and {hf!r} both map to {g!r}")
        c = im.counts[hf]
        out[g] = (im.sums[hf], c if isinstance(c, torch.Tensor) else int(c))
        source[g] = hf
    return out


def save_imatrix(path: str | os.PathLike, im: Imatrix, name_map: Callable[[str], str | None], *,
                 chunk_size: int | None = None) -> Path:
    """Write our :class:`Imatrix` as a llama.cpp GGUF imatrix (:func:`imatrix_entries` + :func:`save_imatrix_gguf`).

    Args:
        chunk_size: tokens per calibration chunk; default: the largest count divided by ``im.chunks``.
    Raises:
        ValueError: as :func:`save_imatrix_gguf`; also when nothing maps to a GGUF name.
    """
    entries = imatrix_entries(im, name_map)
    if chunk_size is None:
        top = max((int(c) for c in im.counts.values()), default=0)
        chunk_size = top // im.chunks if im.chunks else 0
    return save_imatrix_gguf(path, entries, datasets=[im.dataset or "unknown"], chunk_count=im.chunks,
                             chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------- reading


def load_imatrix(path: str | os.PathLike, *, legacy_chunk_size: int | None = None) -> ImatrixData:
    """Read a llama.cpp imatrix file, GGUF or legacy ``.dat`` (told apart by the GGUF magic, as llama.cpp does).

    Args:
        path: the file.
        legacy_chunk_size: for a legacy file only: tokens per chunk it was computed with. Given, sums
            and counts are scaled to tokens (``value * chunk_size``, ``ncall * chunk_size``), as
            ``llama-imatrix --in-file`` does; otherwise sums are the stored values and counts ``ncall``
            (a zero ``ncall`` reads as 1: llama-quantize then uses the values as they are). Either way
            :meth:`ImatrixData.mean` is what llama-quantize uses.
    Returns:
        An :class:`ImatrixData`. Legacy expert entries are flat ``(n_expert * K,)``: the file does not
        record the split.
    Raises:
        InputError: naming the file, when it is missing or unreadable, a GGUF but not an imatrix (e.g. a
            model), has no entries, a ``.in_sum2`` without its ``.counts`` (or the reverse), non-F32
            tensors, inconsistent shapes or bad values, or is damaged, truncated or not an imatrix at all.
        ValueError: ``legacy_chunk_size`` below 1.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"{path}: cannot read imatrix file: {e.strerror or e}") from e
    if magic == _GGUF_MAGIC:
        return _load_gguf(path)
    return _load_legacy(path, legacy_chunk_size)


def _load_gguf(path: Path) -> ImatrixData:
    reader = open_gguf(path)

    def value(key, kind):
        return gguf_field(reader, path, key, kind)

    gtype = value(gguf.Keys.General.TYPE, str)
    if gtype is not None and gtype != IMATRIX_TYPE:
        raise InputError(f"{path}: a GGUF of general.type {gtype!r}, not an imatrix")
    pairs: dict[str, list] = {}
    for t in reader.tensors:
        for k, suffix in enumerate((SUFFIX_SUMS, SUFFIX_COUNTS)):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[: -len(suffix)], [None, None])[k] = t
    if not pairs:
        arch = value(gguf.Keys.General.ARCHITECTURE, str)
        what = f"a model GGUF (general.architecture {arch!r})" if arch is not None else "a GGUF without imatrix tensors"
        raise InputError(f"{path}: {what}, not an imatrix: no '*{SUFFIX_SUMS}' tensors")

    out = ImatrixData(legacy=False)
    datasets = value(KEY_DATASETS, list)
    out.datasets = [str(d) for d in datasets] if isinstance(datasets, list) else []
    out.chunk_count = int(value(KEY_CHUNK_COUNT, int) or 0)
    out.chunk_size = int(value(KEY_CHUNK_SIZE, int) or 0)
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in reader.fields]
    if missing:  # llama-quantize refuses such a file ("missing imatrix metadata")
        logger.warning("%s: imatrix metadata missing: %s", path, ", ".join(missing))

    for name, (ts, tc) in pairs.items():
        if ts is None or tc is None:
            raise InputError(f"{path}: imatrix entry {name!r} has {'no' if ts is None else 'a'} {SUFFIX_SUMS} "
                             f"and {'no' if tc is None else 'a'} {SUFFIX_COUNTS} tensor")
        for t in (ts, tc):
            if t.tensor_type != gguf.GGMLQuantizationType.F32:
                raise InputError(f"{path}: {t.name} is {t.tensor_type.name}; imatrix tensors are F32")
            if t.data.size != int(t.n_elements):
                raise InputError(f"{path}: {t.name} runs past the end of the file (truncated?)")
        n_mat, n_val = int(tc.n_elements), int(ts.n_elements)
        if n_mat < 1 or n_val % n_mat:
            raise InputError(f"{path}: imatrix entry {name!r}: {n_val} sums do not split into {n_mat} matrices")
        if int(ts.shape[0]) != n_val // n_mat or int(tc.shape[0]) != 1:
            raise InputError(f"{path}: imatrix entry {name!r}: shapes {list(map(int, ts.shape))} and "
                             f"{list(map(int, tc.shape))} are not [K, n_mat] and [1, n_mat]")
        s = torch.from_numpy(np.array(ts.data, dtype=np.float64).reshape(n_mat, n_val // n_mat))
        c = np.array(tc.data, dtype=np.float64).reshape(n_mat)
        if not np.all(np.isfinite(c)) or np.any(c < 0):
            raise InputError(f"{path}: imatrix entry {name!r}: bad counts {c.tolist()[:4]}")
        if not torch.isfinite(s).all() or (s < 0).any():
            raise InputError(f"{path}: imatrix entry {name!r}: sums of squares must be finite and >= 0")
        counts = torch.from_numpy(np.rint(c).astype(np.int64))  # llama.cpp: std::lround
        out.sums[name] = s[0] if n_mat == 1 else s
        out.counts[name] = counts[0] if n_mat == 1 else counts
    out.sums = {n: out.sums[n] for n in out.names()}
    out.counts = {n: out.counts[n] for n in out.names()}
    return out


class _Cursor:
    """Bounds-checked little-endian reads of a legacy imatrix file."""

    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.pos = path, data, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left():
            raise InputError(f"{self.path}: not a GGUF imatrix, and not a legacy imatrix (.dat) either: {what} "
                             f"needs {n} bytes at offset {self.pos}, {self.left()} left (truncated?)")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]


def _load_legacy(path: Path, chunk_size: int | None) -> ImatrixData:
    cur = _Cursor(path, path.read_bytes())
    n_entries = cur.i32("the entry count")
    # smallest entry: 4 (name length) + 1 (name) + 4 (ncall) + 4 (nval) + 4 (one value)
    if n_entries < 1 or n_entries * 17 > cur.left():
        raise InputError(f"{path}: not a GGUF imatrix, and not a legacy imatrix (.dat): entry count {n_entries} "
                         f"does not fit its {len(cur.data)} bytes")
    out = ImatrixData(legacy=True)
    scale = 1 if chunk_size is None else int(chunk_size)
    if scale < 1:
        raise ValueError(f"legacy_chunk_size must be >= 1, got {chunk_size}")
    for i in range(n_entries):
        n = cur.i32(f"entry {i + 1} name length")
        if n < 1:
            raise InputError(f"{path}: legacy imatrix entry {i + 1} has name length {n}")
        try:
            name = cur.take(n, f"entry {i + 1} name").decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not an imatrix: entry {i + 1} name is not UTF-8") from e
        ncall = cur.i32(f"entry {name!r} ncall")
        nval = cur.i32(f"entry {name!r} value count")
        if nval < 1 or ncall < 0:
            raise InputError(f"{path}: legacy imatrix entry {name!r}: ncall={ncall}, nval={nval}")
        if name in out.sums:
            raise InputError(f"{path}: legacy imatrix entry {name!r} appears twice")
        vals = np.frombuffer(cur.take(4 * nval, f"entry {name!r} values"), dtype="<f4").astype(np.float64)
        if not np.all(np.isfinite(vals)) or np.any(vals < 0):
            raise InputError(f"{path}: legacy imatrix entry {name!r} has non-finite or negative values")
        out.sums[name] = torch.from_numpy(vals * scale)
        out.counts[name] = torch.tensor(max(ncall, 1) * scale, dtype=torch.int64)
    if cur.left():  # optional trailer: chunk count, then dataset name (length-prefixed)
        out.chunk_count = cur.i32("the trailing chunk count")
        if cur.left():
            n = cur.i32("the dataset name length")
            if n > 0:
                out.datasets = [cur.take(n, "the dataset name").decode("utf-8", errors="replace")]
        if cur.left():
            raise InputError(f"{path}: legacy imatrix has {cur.left()} unexpected bytes after its trailer")
    out.chunk_size = 0 if chunk_size is None else scale
    out.sums = {n: out.sums[n] for n in out.names()}
    out.counts = {n: out.counts[n] for n in out.names()}
    return out
