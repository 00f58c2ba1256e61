"""Checks a run makes before any work: its budget, its output paths and the free disk space they need.

A run that would fail at its end because of where it writes fails at its start instead, in well under a
second, with an :class:`~dynaquant.errors.InputError` naming the output and the reason:

- an output is not an input (the source file, a plan, a report, an imatrix, a calibration or evaluation
  text; compared by resolved path and ``os.path.samefile``, so symlinks and hard links count), is not inside
  the source checkpoint folder (Hugging Face folder sources), and a folder output (the safetensors target,
  which replaces the folder as a whole) holds no input;
- its folder exists or can be created, and a file can be created there (tried, then removed);
- the file system has room for an upper bound of what the run writes there (:func:`tensor_bytes_bound`
  and friends: computed from the source's shapes, nothing read), after the stale temporary files of earlier
  killed runs of the same outputs are removed (:func:`dynaquant.workdir.remove_stale`).

``quantize``, ``analyze``, ``make_dynamic_plan`` and the HTML report call :func:`check_outputs`, the
pipelines also :func:`check_budget`; ``quantize`` and ``analyze`` without ``--stream`` on a GPU
:func:`check_whole_model_gpu` (a model whose weights and input moments cannot fit the GPU is refused before it is
loaded).
"""

from __future__ import annotations

import math
import numbers
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynaquant.errors import InputError
from dynaquant.exporters.gguf.writer import is_output_file
from dynaquant.sources.readers import GGUF_SHARD_NAME, gguf_shard_paths
from dynaquant.workdir import remove_stale

MAX_BPW = 32.0  # F32, the widest format: no budget above it changes a plan
MAX_SIZE_BYTES = 2**63 - 1  # no file is larger (off_t)
F32_BYTES = 4  # the widest element any target writes
GIB = 2**30


def check_budget(bpw: Any = None, size: Any = None, *, bpw_name: str = "bpw", size_name: str = "size") -> None:
    """Refuse budgets no plan can meet or that overflow the planner's arithmetic.

    Args:
        bpw: bits per weight: a finite number in (0, 32] (32: F32, the widest format), or None.
        size: bytes: a finite number in (0, 2**63), or None.
        bpw_name / size_name: the argument's name in the message (``--bpw`` on the command line).
    Raises:
        InputError: naming the argument, its value and the range allowed.
    """
    def bad(v) -> bool:
        return isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)

    if bpw is not None and (bad(bpw) or not 0 < bpw <= MAX_BPW):
        raise InputError(f"{bpw_name}={bpw!r}: bits per weight must be a finite number above 0 and at most "
                         f"{MAX_BPW:g} (F32)")
    if size is not None and (bad(size) or not 0 < size <= MAX_SIZE_BYTES):
        raise InputError(f"{size_name}={size!r}: the size must be a finite number of bytes above 0 and below 2**63")


@dataclass(frozen=True)
class Output:
    """One path a run writes.

    Attributes:
        path: the file (or, ``folder``, the folder) the run writes.
        max_bytes: upper bound of the bytes written there (None: no disk space check).
        folder: a folder the run replaces as a whole (safetensors checkpoint): no input may be inside it.
        shards: a GGUF file that may be written as llama.cpp shards beside ``path`` (``NAME-00001-of-00003.gguf``),
            replacing an earlier output's shards of any count: no input may have such a name either.
    """

    path: Path
    max_bytes: int | None = None
    folder: bool = False
    shards: bool = False


def tensor_bytes_bound(tensors: Iterable[Any], overhead_bytes: int, *, bpw: float | None = None, size: int | None = None,
                       plan_bytes: int | None = None) -> int:
    """Upper bound of a quantized model file's (or checkpoint's) bytes, from the source's shapes alone.

    The smallest of: every tensor in F32 (no format is wider) plus ``overhead_bytes``; and, as given,
    ``size`` (the whole-file budget), ``plan_bytes + overhead_bytes`` (a known plan's tensor data), or
    ``ceil(bpw * n_weights / 8) + overhead_bytes`` (the plan's tensor data is at most that).

    Args:
        tensors: items with ``shape`` (``quant.plan.TensorInfo``).
        overhead_bytes: an upper bound of what the file adds to its tensor data (header, metadata, alignment).
    """
    n = sum(math.prod(t.shape) for t in tensors)
    bound = F32_BYTES * n + overhead_bytes
    if size is not None:
        bound = min(bound, int(size))
    if plan_bytes is not None:
        bound = min(bound, int(plan_bytes) + overhead_bytes)
    if bpw is not None:
        bound = min(bound, math.ceil(bpw * n / 8) + overhead_bytes)
    return bound


def side_files_bytes_bound(source: Any, ts: Any = None) -> int:
    """Upper bound of what a checkpoint output holds beside its weights (config, tokenizer, generation and
    processor configs): twice the source's own such files (a Hugging Face folder: every file but the weights;
    a GGUF file: its metadata, ``ts.reader.data_offset``), plus 1 MiB.
    """
    own = 0
    path = Path(source.path)
    if source.kind == "gguf":
        reader = getattr(ts, "reader", None)
        own = int(getattr(reader, "data_offset", 0) or 0) if reader is not None else path.stat().st_size
    else:
        weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
        own = sum(f.stat().st_size for f in path.iterdir() if f.is_file() and not f.name.endswith(weights))
    return 2 * own + 2**20


def plan_json_bytes_bound(n_tensors: int) -> int:
    """Upper bound of a plan.json's bytes (an entry is a few hundred bytes: name, HF name, shape, format, why)."""
    return 16384 + 2048 * n_tensors


def analysis_bytes_bound(tensors: Sequence[Any], n_candidates: int) -> tuple[int, int]:
    """Upper bounds of ``(report.json, imatrix.gguf)`` bytes of an analysis.

    The imatrix holds float32 sums of squares per input column and matrix (experts: per expert) and a count per
    matrix; the report per tensor its facts and one error record per candidate format.
    """
    imatrix = 65536
    for t in tensors:
        if getattr(t, "quantizable", True) and len(t.shape) >= 2:
            n_mat = math.prod(t.shape[:-2]) if len(t.shape) > 2 else 1
            imatrix += F32_BYTES * n_mat * (t.shape[-1] + 1) + 512
    report = 65536 + len(tensors) * (2048 + 512 * n_candidates)
    return report, imatrix


def _input_paths(value: Any) -> list[Path]:
    """The local paths in an input argument: a path, an iterable of paths, or an object with ``sources`` /
    ``images`` (a CalibrationSpec); dicts, plans and ``hf:`` dataset ids are not files."""
    if value is None or isinstance(value, (dict, bytes)):
        return []
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        return [] if not text or text.startswith("hf:") else [Path(text).expanduser()]
    if hasattr(value, "sources") or hasattr(value, "images"):
        return _input_paths(getattr(value, "sources", ())) + _input_paths(getattr(value, "images", ()))
    if isinstance(value, Iterable):
        return [p for v in value for p in _input_paths(v)]
    return []


def _same(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or below it (resolved)."""
    p, f = path.resolve(), folder.resolve()
    return p == f or f in p.parents


def _existing_ancestor(path: Path) -> Path:
    """The nearest existing ancestor of ``path`` (``path``'s folder if it exists)."""
    p = path.parent.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe_writable(out: Path, folder: Path) -> None:
    if not folder.is_dir():
        raise InputError(f"{out}: cannot create the output: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dynaquant-probe-", dir=folder)
    except OSError as exc:
        raise InputError(f"{out}: cannot write in {folder}: {exc.strerror or exc}") from exc
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass


def source_files(path: Path) -> list[Path]:
    """A GGUF source's files: ``[path]``, or, for a first shard ``NAME-00001-of-00003.gguf``, every shard of its set
    (by name, nothing read)."""
    m = GGUF_SHARD_NAME.match(path.name)
    return gguf_shard_paths(path, int(m["count"])) if m is not None and int(m["no"]) == 1 and int(m["count"]) > 1 else [path]


def _source_roles(source: Any) -> tuple[Path | None, Path | None]:
    """(source file, source folder) of a ModelSource or of the model argument as typed (only if it exists)."""
    if source is None:
        return None, None
    if hasattr(source, "kind") and hasattr(source, "path"):
        return (Path(source.path), None) if source.kind == "gguf" else (None, Path(source.path))
    if isinstance(source, (str, os.PathLike)):
        p = Path(os.fspath(source)).expanduser()
        if p.is_file():
            return p, None
        if p.is_dir():
            return None, p
    return None, None


def check_outputs(outputs: Sequence[Output], *, inputs: Mapping[str, Any] | None = None, source: Any = None) -> None:
    """Check a run's outputs before it starts (module docstring).

    Args:
        outputs: what the run writes; ``max_bytes`` None skips the disk space check for that output.
        inputs: role (``"plan"``, ``"report"``, ``"imatrix"``, ``"calibration text"``, ...) -> a path, paths,
            or a CalibrationSpec (its text files and images); None and non-path values (dicts, plans) skipped.
        source: the model: a ``checkpoint.ModelSource``, or the model argument as typed (a local file or
            folder; anything else, e.g. a hub id not yet fetched, is skipped).
    Raises:
        InputError: the first output at fault, named, and why: it is an input, is inside the source folder,
            holds an input (folder output), is given twice, is a folder (file output) or a file (folder output),
            cannot be created, or its file system lacks the bytes (needed and free are said).
    """
    roles: list[tuple[str, Path]] = [(role, p) for role, v in (inputs or {}).items() for p in _input_paths(v)]
    src_file, src_folder = _source_roles(source)
    if src_file is not None:
        roles += [("source model", p) for p in source_files(src_file)]
    seen: list[Path] = []
    for o in outputs:
        out = Path(o.path).expanduser()
        for role, p in roles:
            if _same(out, p):
                raise InputError(f"{out}: is the {role} ({p}); writing it would destroy an input; choose another output")
            if o.shards and is_output_file(out, p):
                raise InputError(f"{out}: the {role} {p} is a shard of this output's name, which the run writes or "
                                 "removes; choose another output")
            if o.folder and _inside(p, out):
                raise InputError(f"{out}: the {role} {p} is inside this output folder, which the run replaces; "
                                 "choose another output folder")
        if src_folder is not None:
            if _inside(out, src_folder):
                raise InputError(f"{out}: is inside the source checkpoint folder {src_folder}; write the output elsewhere")
            if o.folder and _inside(src_folder, out):
                raise InputError(f"{out}: the source checkpoint folder {src_folder} is inside this output folder, "
                                 "which the run replaces; choose another output folder")
        if any(_same(out, s) for s in seen):
            raise InputError(f"{out}: given for two outputs of the run")
        seen.append(out)
        if out.is_dir() and not o.folder:
            raise InputError(f"{out}: is a folder; give a file name")
        if out.exists() and not out.is_dir() and o.folder:
            raise InputError(f"{out}: is a file; give a folder")
        _probe_writable(out, _existing_ancestor(out))
    need: dict[int, tuple[Path, Path, int]] = {}  # device -> (an output, its folder, bytes)
    for o in outputs:
        if o.max_bytes is None:
            continue
        out = Path(o.path).expanduser()
        remove_stale(out)  # a killed run's leftovers count against the free space
        folder = _existing_ancestor(out)
        dev = folder.stat().st_dev
        first, _, total = need.get(dev, (out, folder, 0))
        need[dev] = (first, folder, total + int(o.max_bytes))
    for out, folder, total in need.values():
        free = shutil.disk_usage(folder).free
        if total > free:
            raise InputError(f"{out}: not enough free disk space in {folder}: the run writes up to {total} bytes "
                             f"({total / 1e6:.1f} MB), {free} bytes ({free / 1e6:.1f} MB) are free")


def whole_model_gpu_bytes(tensors: Iterable[Any], moments: bool, weight_bytes: int = F32_BYTES) -> tuple[int, int]:
    """Lower bounds of what a whole-model run (no ``--stream``) holds on its GPU at once, from the shapes alone:
    (the model's tensors at ``weight_bytes`` an element: float32 as ``sources.model.load_model`` loads them by default;
    with ``moments``, the calibration's float32 (K, K) input sums: per block, one for each distinct input width of its
    matmul weights, the analysis' and GPTQ's). Both only count what certainly is there (shared inputs counted once,
    experts' moments not at all).

    Args:
        tensors: items with ``shape``, ``quantizable`` and ``layer`` (``quant.plan.TensorInfo``).
    """
    tensors = list(tensors)
    weights = weight_bytes * sum(math.prod(t.shape) for t in tensors)
    widths: set[tuple[int, int]] = set()
    if moments:
        widths = {(t.layer, t.shape[-1]) for t in tensors if t.quantizable and len(t.shape) == 2 and t.layer is not None}
    return weights, F32_BYTES * sum(k * k for _, k in widths)


def check_whole_model_gpu(tensors: Iterable[Any], device: Any, moments: bool, source: Any, dtype: Any = None) -> None:
    """Refuse a whole-model run that cannot fit its GPU, before the model is loaded.

    Args:
        tensors: as :func:`whole_model_gpu_bytes`.
        device: the run's device; nothing is checked off CUDA.
        moments: the run collects the calibration's input moments (an analysis or GPTQ).
        source: the model's path or name, for the message.
        dtype: the torch dtype the model is loaded in (None: float32).
    Raises:
        InputError: :func:`whole_model_gpu_bytes`' lower bound above the GPU's memory, naming the source, both parts
            and ``--stream`` (block by block: a GPU holds one block's tensors and moments).
    """
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return
    dtype = dtype or torch.float32
    weights, h = whole_model_gpu_bytes(tensors, moments, dtype.itemsize)
    total = torch.cuda.get_device_properties(dev).total_memory
    if weights + h > total:
        parts = f"{weights / GIB:.1f} GiB of {str(dtype).removeprefix('torch.')} weights"
        if h:
            parts += f" + {h / GIB:.1f} GiB of calibration input moments"
        raise InputError(f"{source}: a whole-model run needs at least {(weights + h) / GIB:.1f} GiB on {dev} ({parts}); "
                         f"the GPU has {total / GIB:.1f} GiB: add --stream (block by block)")
