"""Where a quantize run writes: the Target protocol, the GGUF target, and :func:`target_of` for both (the safetensors
target: :mod:`dynaquant.pipeline.safetensors_target`).

A target is told the run (:class:`RunState`: the plan, the source, the importance weights, the GPTQ rounding),
encodes each planned tensor in its container's layout and writes the output atomically (a temporary file or folder
in the run's work folder, renamed onto the output when complete: :mod:`dynaquant.exporters`). What differs between
targets is said here and only here: the formats a plan may use, the default rules' options, the overhead bytes a
size budget must leave, the output's default name, how MoE expert stacks and super weights are encoded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np
import torch

from dynaquant.analysis.imatrix import Imatrix
from dynaquant.config import DEFAULT_CANDIDATES, QuantizeConfig
from dynaquant.exporters.gguf.writer import ArrayPackingWriter, GGUFFileWriter, header_bytes
from dynaquant.pipeline.preflight import Output
from dynaquant.pipeline.run_state import RunState
from dynaquant.pipeline.source import kept_types
from dynaquant.quant.codecs import quantize as encode_tensor
from dynaquant.quant.codecs.base import fill_unrouted
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan, TensorInfo
from dynaquant.quant.planner import GGUF_CANDIDATES, default_rules
from dynaquant.quant.presets import PRESETS, ModelInfo
from dynaquant.sources.checkpoint import ModelSource
from dynaquant.sources.gguf import SourceTensor, TensorSource
from dynaquant.sources.nonfinite import check_finite, tensor_label
from dynaquant.version import __version__

# llama.cpp file type that best describes a file whose bulk is in a format.
_FILE_TYPE_OF_FORMAT = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M, "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "IQ4_NL": gguf.LlamaFileType.MOSTLY_IQ4_NL, "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M, "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS, "NVFP4": gguf.LlamaFileType.MOSTLY_NVFP4,
    "IQ3_S": gguf.LlamaFileType.MOSTLY_IQ3_S, "IQ3_XXS": gguf.LlamaFileType.MOSTLY_IQ3_XXS,
    "IQ2_S": gguf.LlamaFileType.MOSTLY_IQ2_M, "IQ2_XS": gguf.LlamaFileType.MOSTLY_IQ2_XS,
    "IQ2_XXS": gguf.LlamaFileType.MOSTLY_IQ2_XXS, "IQ1_M": gguf.LlamaFileType.MOSTLY_IQ1_M,
    "IQ1_S": gguf.LlamaFileType.MOSTLY_IQ1_S,
}


class Target(Protocol):
    """One output container (GGUF file, safetensors checkpoint folder).

    Attributes:
        name: ``gguf`` or ``safetensors`` (``Plan.target`` of its plans).
        full_vl: a vision-language source is read whole (vision tower and projector too).
        folder_output: the output is a folder.
        analysis_candidates: formats the analysis run here measures.
        needs_model: the write reads a loaded transformers model (not only the tensor source); with ``stream``, its
            skeleton read a part at a time instead.
        written: set by :meth:`finish`: the files (or folder) written, the first being the output (a split GGUF: its
            shards in order).
    """

    name: str
    full_vl: bool
    folder_output: bool
    analysis_candidates: tuple[str, ...]
    needs_model: bool

    def overhead_bytes(self, source: ModelSource, ts: TensorSource, tensors: list[TensorInfo], cfg: QuantizeConfig) -> int:
        """Bytes the container adds to the tensor data (an upper bound), for a size budget."""

    def bound_overhead(self, ts: TensorSource, tensors: list[TensorInfo], rules) -> int:
        """The overhead's upper bound for the preflight when no dynamic plan is made (a preset or a given plan)."""

    def plan_options(self, info: ModelInfo, super_weights: list[str], report: dict | None, cfg: QuantizeConfig) -> dict:
        """``make_plan`` keyword arguments of this target (candidates, default rules, target); ``report`` None:
        the fail-fast check before any analysis."""

    def default_output(self, source: ModelSource, cfg: QuantizeConfig, size: int | None) -> Path:
        """The output's path when none is given."""

    def output(self, path: Path, bound: int | None, source: ModelSource, ts: TensorSource) -> Output:
        """The output's preflight check, with ``bound`` the tensor bytes' upper bound."""

    def check_output(self, path: Path) -> None:
        """Refuse an output the writer would not replace (a non-empty folder that is not a dynaquant checkpoint).

        Raises:
            ValueError: naming the output.
        """

    def progress_label(self) -> str:
        """The progress bar's label."""

    def prepare(self, run: RunState) -> None:
        """Ready to read and encode ``run``'s tensors without writing anything (a rank other than 0 of several)."""

    def begin(self, run: RunState, path: Path) -> None:
        """Start writing ``path`` for ``run`` (header or folder in the run's work folder; nothing at ``path`` yet)."""

    def tensors(self) -> list:
        """The tensors :meth:`add` takes, in order (GGUF: the source's; safetensors: the model's weight names)."""

    def read(self, t) -> torch.Tensor:
        """Tensor ``t``'s weight (GGUF: float32 from the source, NaN/Inf checked; safetensors: the model's, with
        ``stream`` its skeleton part materialized)."""

    def reused(self, t) -> Any | None:
        """``t``'s encoding as the run's corrections made it (:attr:`RunState.encodings`), or None: encoded here."""

    def gptq_round(self, t, w: torch.Tensor, plain: Any | None = None) -> Any | None:
        """``t`` GPTQ-rounded in its planned format when the run asked for GPTQ and it beats plain rounding, else None
        (``plain``: that plain rounding when already at hand, :meth:`reused`; else it is encoded here)."""

    def encode(self, t, w: torch.Tensor, rounded: Any | None) -> Any:
        """``t``'s encoding for :meth:`add`: ``rounded`` when given, else plain rounding (as is when not encoded)."""

    def add(self, t, encoded: Any) -> None:
        """Write tensor ``t``'s encoding (the next in :meth:`tensors`' order)."""

    def save_encoded(self, rundir, i: int, encoded: Any) -> None:
        """Keep the ``i``-th tensor's encoding in the work folder (:class:`dynaquant.pipeline.rundir.RunDir`)."""

    def load_encoded(self, rundir, i: int) -> tuple[bool, Any]:
        """``(True, encoding)`` of the ``i``-th tensor as :meth:`save_encoded` kept it, ``(False, None)`` when absent."""

    def finish(self) -> tuple[Path, int]:
        """Complete the output and move it onto its path atomically; (path written, bytes counted for the budget)."""

    def abort(self) -> None:
        """Remove what :meth:`begin` and :meth:`add` wrote (the output's path is left as it was)."""

    def discard(self, path: Path) -> None:
        """Remove a written output (over budget)."""

    def extras(self, run: RunState, path: Path) -> Path | None:
        """Files written beside the output (a vision GGUF), or None."""


def gguf_overhead_bytes(ts: TensorSource, tensors: list[TensorInfo], extra_kv: dict) -> int:
    """Bytes a GGUF file adds to its tensor data: header, metadata, tensor infos, alignment (upper bound).

    Counted in memory on the header gguf-py writes for ``ts``'s metadata, ``extra_kv`` (strings with 64 spare
    characters, numbers as UINT32) and an F32 tensor info per tensor, plus 32 alignment bytes per tensor and one more.
    """
    w = ArrayPackingWriter(None, ts.arch)
    ts.add_metadata(w)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    for k, v in extra_kv.items():
        if isinstance(v, list):
            if v:
                w.add_array(k, v)
        elif isinstance(v, str):
            w.add_string(k, v + " " * 64)  # room for longer values
        else:
            w.add_uint32(k, 0)
    for t in tensors:
        w.add_tensor_info(t.name, list(t.shape), np.dtype(np.float32), 4, raw_dtype=gguf.GGMLQuantizationType.F32)
    return header_bytes(w) + 32 * (len(tensors) + 1)


def gguf_extra_kv(source: ModelSource, plan: Plan | None, im: Imatrix | None) -> dict:
    """The ``dynaquant.*`` keys of a GGUF file (``plan`` None: an empty plan, for the overhead estimate)."""
    rec = source.record()  # a label, never a local path: the bytes do not depend on where the run happened
    kv = {
        "general.quantized_by": "dynaquant",
        "dynaquant.version": __version__,
        "dynaquant.source": rec.label,
        "dynaquant.source.kind": rec.kind,
        "dynaquant.source.sha256": rec.sha256,
        "dynaquant.plan.method": plan.method if plan is not None else "allocation size<=000000000000",
        "dynaquant.plan.rules": list(plan.rules) if plan is not None else [],
    }
    if im is not None:
        kv["dynaquant.imatrix.dataset"] = im.dataset
        kv["dynaquant.imatrix.chunks"] = im.chunks
    return kv


# a stacked expert tensor larger than this in float32 is read and encoded a group of experts (this many bytes) at a time
# (DeepSeek-V3's ffn_gate_exps: 15 GB in float32)
EXPERT_GROUP_BYTES = 1 << 30
SHARD_OVERHEAD_BYTES = 256  # a shard's own header, split.* keys and alignment (an upper bound)


def split_overhead_bytes(tensors: list[TensorInfo], cfg: QuantizeConfig) -> int:
    """Bytes a split GGUF adds over one file (an upper bound; 0 when no split can happen): each shard's header,
    ``split.*`` keys and alignment, for at most ``2 * ceil(F32 bytes / split_max_size) + 1`` shards (two neighbours
    hold more than the limit together) or ``ceil(n / split_max_tensors)``, and never more than one a tensor."""
    n, data = len(tensors), sum(4 * math.prod(t.shape) for t in tensors)
    bounds = []
    if cfg.split_max_size > 0 and data > cfg.split_max_size:
        bounds.append(2 * -(-data // cfg.split_max_size) + 1)
    if cfg.split_max_tensors > 0 and n > cfg.split_max_tensors:
        bounds.append(-(-n // cfg.split_max_tensors))
    return SHARD_OVERHEAD_BYTES * min(n, max(bounds)) if bounds else 0


IMATRIX_COMPUTED_HERE = "(computed by dynaquant in this run)"  # quantize.imatrix.file of an imatrix made in the run


def provenance_kv(source: ModelSource, im: Imatrix | None, imatrix_file: Path | None, used: bool) -> dict:
    """The provenance keys of a GGUF file, as llama.cpp's ``llama-quantize`` writes them (tools/quantize/quantize.cpp)
    when an imatrix is used: ``quantize.imatrix.file`` (STRING: the file's name, or :data:`IMATRIX_COMPUTED_HERE`),
    ``quantize.imatrix.dataset`` (STRING: the first dataset it names; this run's: the calibration spec's id),
    ``quantize.imatrix.entries_count`` and ``quantize.imatrix.chunks_count`` (UINT32, as llama.cpp >= b5700 writes
    them); for a hub source, ``general.source.repo_url`` and ``dynaquant.source.revision`` (the resolved commit).

    Args:
        im: this run's imatrix, or None; imatrix_file: the file the encoders read, or None; used: an imatrix
            weighted the encoders (no ``quantize.*`` keys otherwise).
    """
    kv: dict = {}
    if used and im is not None:
        kv.update({"quantize.imatrix.file": IMATRIX_COMPUTED_HERE, "quantize.imatrix.dataset": im.dataset[:127],
                   "quantize.imatrix.entries_count": np.uint32(len(im.sums)),
                   "quantize.imatrix.chunks_count": np.uint32(im.chunks)})
    elif used and imatrix_file is not None:
        from dynaquant.analysis.imatrix_io import load_imatrix

        data = load_imatrix(imatrix_file)
        kv["quantize.imatrix.file"] = Path(imatrix_file).name[:127]
        if data.datasets:
            kv["quantize.imatrix.dataset"] = data.datasets[0][:127]
        kv["quantize.imatrix.entries_count"] = np.uint32(len(data.sums))
        if data.chunk_count > 0:
            kv["quantize.imatrix.chunks_count"] = np.uint32(data.chunk_count)
    if source.origin == "hub":
        kv["general.source.repo_url"] = f"https://huggingface.co/{source.model_id}"
        if source.revision:
            kv["dynaquant.source.revision"] = source.revision
    return kv


def gguf_planning_overhead(source: ModelSource, ts: TensorSource, tensors: list[TensorInfo], use_imatrix: bool) -> int:
    """The overhead a dynamic GGUF plan is made with (an empty plan's keys; a 64-character imatrix dataset; the
    provenance keys, strings 64 characters longer than this run's)."""
    im = Imatrix(dataset=" " * 64, chunks=0) if use_imatrix else None
    kv = gguf_extra_kv(source, None, im)
    longest = Imatrix(dataset=" " * 127, chunks=0) if use_imatrix else None  # llama.cpp's 127-character strings
    kv.update({k: v + " " * 127 if k == "quantize.imatrix.file" else v
               for k, v in provenance_kv(source, longest, None, use_imatrix).items()})
    return gguf_overhead_bytes(ts, tensors, kv)


def file_type_of(plan: Plan, preset: str | None) -> int:
    """``general.file_type`` for a plan: the preset's, else the format holding most quantized weights."""
    if preset:
        return int(PRESETS[preset.upper()][1])
    counts = {f: n for f, n in plan.count_by_format().items() if f != "F32"} or {"F32": 1}
    bulk = max(sorted(counts), key=lambda f: counts[f])
    return int(_FILE_TYPE_OF_FORMAT.get(bulk, gguf.LlamaFileType.GUESSED))


class GGUFTarget:
    """A GGUF file (:class:`dynaquant.exporters.gguf.writer.GGUFFileWriter`), tensors read from the tensor source."""

    name, full_vl, folder_output, needs_model = "gguf", False, False, False
    analysis_candidates = DEFAULT_CANDIDATES

    def overhead_bytes(self, source, ts, tensors, cfg) -> int:
        return gguf_planning_overhead(source, ts, tensors, cfg.use_imatrix) + split_overhead_bytes(tensors, cfg)

    def bound_overhead(self, ts: TensorSource, tensors: list[TensorInfo], rules) -> int:
        """The overhead's upper bound for a preset or given plan (no dynamic overhead was computed)."""
        return gguf_overhead_bytes(ts, tensors, {}) + 4096 + sum(len(str(r)) + 64 for r in rules)

    def plan_options(self, info, super_weights, report, cfg) -> dict:
        opts = dict(defaults=default_rules(info, super_weights, cfg.use_imatrix) if cfg.default_rules_on else (),
                    has_imatrix=cfg.use_imatrix, lift_expert_caps=cfg.explicit_target, relax_floors=cfg.explicit_target)
        if report is not None:
            opts.update(candidates=[c for c in report["candidates"] if c in GGUF_CANDIDATES] or GGUF_CANDIDATES,
                        error_source="measured kld")
        return opts

    def default_output(self, source, cfg, size) -> Path:
        if cfg.preset:
            label = cfg.preset.upper()
        elif cfg.bpw is not None:
            label = f"{cfg.bpw:g}bpw"
        elif size is not None:
            label = f"dynamic-{size / 1e6:.0f}MB"
        else:
            label = "plan"
        return Path.cwd() / f"{source.name}-{label}.gguf"

    def output(self, path, bound, source, ts) -> Output:
        return Output(path, bound, shards=True)

    def check_output(self, path: Path) -> None:
        pass

    def prepare(self, run: RunState) -> None:
        """Ready to read and encode ``run``'s tensors without writing (a rank other than 0 of several)."""
        self.run = run
        self.types = {e.name: get_format(e.format) for e in run.plan.entries}
        self._tensors = run.ts.tensors()
        self._kept = kept_types(run.ts, run.cfg.allow_nonfinite)

    def begin(self, run: RunState, path: Path) -> None:
        self.prepare(run)
        cfg = run.cfg
        kv = {**gguf_extra_kv(run.source, run.plan, run.im),
              **provenance_kv(run.source, run.im, run.imatrix_file, bool(run.imat))}
        self.writer = GGUFFileWriter(path, run.ts, self.types, kv,
                                     file_type_of(run.plan, None if run.loaded_plan else cfg.preset),
                                     split_max_size=cfg.split_max_size, split_max_tensors=cfg.split_max_tensors)

    def progress_label(self) -> str:
        return f"writing {self.writer.path.name}"

    def tensors(self) -> list[SourceTensor]:
        return self._tensors

    def read(self, t: SourceTensor) -> torch.Tensor | None:
        """The float32 weight, NaN/Inf checked; None for a stacked expert tensor over :data:`EXPERT_GROUP_BYTES` that
        the source reads an expert at a time (:meth:`encode` reads and encodes it a group of experts at a time).

        On a CUDA run it is read onto the GPU as stored (``TensorSource.read_to``: BF16 moves half the bytes and is
        converted, q/k permuted and checked there; the same values bit for bit), where the encoder takes it."""
        run, ts = self.run, self.run.ts
        if self._grouped(t) or self.source_records(t) is not None:
            return None
        w = ts.read_to(t, run.device) if run.device.type == "cuda" else ts.read(t)
        return check_finite(w, tensor_label(t.hf_name, t.gguf_name), ts.file_of(t), run.cfg.allow_nonfinite)

    def _grouped(self, t: SourceTensor) -> bool:
        return (len(t.shape) == 3 and t.shape[0] > 2 and 4 * t.numel > EXPERT_GROUP_BYTES and self.run.rounding is None
                and self.run.ts.reads_experts(t))

    def source_records(self, t: SourceTensor, lo: int = 0, hi: int | None = None) -> np.ndarray | None:
        """The source's own bytes of ``t`` (experts ``lo .. hi - 1``) where the plan gives it the GGUF type the source
        stores it in (a GGUF source): their decoding is the source's weight itself, error 0, which no encoding betters,
        and the analysis measured that format's error as 0 (:attr:`dynaquant.analysis.errors.ErrorSample.stored`).
        None otherwise (:func:`dynaquant.pipeline.source.kept_types`)."""
        if self._kept.get(t.gguf_name) != self.types[t.gguf_name].name:
            return None
        return self.run.ts.stored_records(t, lo, hi)[1]

    def reused(self, t: SourceTensor) -> np.ndarray | None:
        """The corrections' bytes of ``t`` in its planned format (:class:`dynaquant.analysis.corrections.Encodings`:
        encoded from the loaded model's parameter with the same importance and encoder), rows put in the GGUF's order
        (``TensorSource.model_rows``: llama's q/k permuted; the encoders work row by row); None where they were not
        kept, the source's own bytes are written (:meth:`source_records`) or ``t`` is not one parameter's rows."""
        enc = self.run.encodings
        if enc is None or self.source_records(t) is not None or (where := self.run.ts.model_rows(t)) is None:
            return None
        fmt = self.types[t.gguf_name]
        codes = enc.take(where[0], fmt.name)
        if codes is None or tuple(codes.shape) != (*t.shape[:-1], fmt.record_bytes(t.shape[-1])):
            return None
        return np.ascontiguousarray((codes if where[1] is None else codes[where[1]]).numpy())

    def gptq_round(self, t: SourceTensor, w: torch.Tensor | None, plain: np.ndarray | None = None) -> np.ndarray | None:
        run, fmt = self.run, self.types[t.gguf_name]
        if run.rounding is None or fmt.kind == "float" or w is None:
            return None
        if plain is not None:  # (reused: a contiguous array)
            plain = torch.from_numpy(plain).to(run.device)
        q = run.rounding.encode(t, w.to(run.device), fmt, run.imat.get(t.gguf_name), plain=plain)
        return q.cpu().numpy() if q is not None else None

    def encode(self, t: SourceTensor, w: torch.Tensor | None, rounded: np.ndarray | None) -> np.ndarray:
        if rounded is not None:
            return rounded
        kept = self.source_records(t)
        if kept is not None:
            return np.ascontiguousarray(kept)
        if w is None:
            return self._encode_groups(t)
        run, fmt = self.run, self.types[t.gguf_name]
        imp = run.imat.get(t.gguf_name) if fmt.kind != "float" else None
        return encode_tensor(w.to(run.device), fmt, imp).cpu().numpy()

    def expert_groups(self, t: SourceTensor) -> list[tuple[int, int]] | None:
        """The expert ranges ``[lo, hi)`` a stacked expert tensor over :data:`EXPERT_GROUP_BYTES` is read and encoded
        in (:meth:`read` gives None for it), in order; None for any other tensor (read and encoded whole). A range holds
        at least two experts (a group of one would take the imatrix as a shared one)."""
        if not self._grouped(t):
            return None
        n = t.shape[0]
        group = max(2, EXPERT_GROUP_BYTES // (4 * t.numel // n))
        bounds = list(range(0, n, group)) + [n]
        if bounds[-1] - bounds[-2] < 2:
            del bounds[-2]
        return list(zip(bounds, bounds[1:]))

    def encode_group(self, t: SourceTensor, lo: int, hi: int) -> np.ndarray:
        """Experts ``[lo, hi)`` of a stacked expert tensor (a range of :meth:`expert_groups`) read and encoded: their
        rows of the whole tensor's encoding. Each expert is encoded with its own imatrix row; an unrouted expert's row,
        the mean of the routed ones over all experts, is filled as the whole-tensor encoder fills it."""
        kept = self.source_records(t, lo, hi)
        if kept is not None:
            return np.ascontiguousarray(kept)
        run, ts, fmt = self.run, self.run.ts, self.types[t.gguf_name]
        imp = run.imat.get(t.gguf_name) if fmt.kind != "float" else None
        n = t.shape[0]
        if imp is not None and torch.as_tensor(imp).numel() == n * t.shape[-1]:
            imp = fill_unrouted(torch.as_tensor(imp, dtype=torch.float32).reshape(n, t.shape[-1]))
        # (moved as stored, decoded on the device: the same float32 values, a quarter of the transfer for FP8)
        w = check_finite(ts.read_stored(t, lo, hi).to(run.device).decode(slice(None)), tensor_label(t.hf_name, t.gguf_name),
                         ts.file_of(t), run.cfg.allow_nonfinite)
        part = imp[lo:hi] if isinstance(imp, torch.Tensor) and imp.dim() == 2 else imp
        return encode_tensor(w, fmt, part).cpu().numpy()

    def _encode_groups(self, t: SourceTensor) -> np.ndarray:
        """A stacked expert tensor encoded a group of experts at a time (:meth:`expert_groups`): the bytes of the whole
        tensor's encoding."""
        return np.concatenate([self.encode_group(t, lo, hi) for lo, hi in self.expert_groups(t)])

    def add(self, t: SourceTensor, encoded: np.ndarray) -> None:
        self.writer.add(t, encoded)

    @staticmethod
    def encoded_name(i: int, part: int | None = None) -> str:
        """The work-folder file of the ``i``-th tensor's encoding, or of its expert range ``part`` (a range of
        :meth:`expert_groups`, encoded on its own by a run of several ranks)."""
        return f"tensors/{i:05d}.npy" if part is None else f"tensors/{i:05d}-{part:03d}.npy"

    def save_encoded(self, rundir, i: int, encoded: np.ndarray) -> None:
        rundir.save_array(self.encoded_name(i), encoded)

    def load_encoded(self, rundir, i: int) -> tuple[bool, np.ndarray | None]:
        a = rundir.load_array(self.encoded_name(i))
        return a is not None, a

    def finish(self) -> tuple[Path, int]:
        self.writer.finish()
        self.written = list(self.writer.paths)
        return self.written[0], sum(p.stat().st_size for p in self.written)

    def abort(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.abort()

    def discard(self, path: Path) -> None:
        for p in getattr(self, "written", [path]):
            p.unlink(missing_ok=True)

    def extras(self, run: RunState, path: Path) -> Path | None:
        """The vision GGUF beside ``path`` for a Qwen2-VL source (llama.cpp's ``--mmproj``), else None."""
        if not getattr(run.ts, "has_vision", False):
            return None
        from dynaquant.exporters.gguf.mmproj import mmproj_path_for, write_mmproj

        return write_mmproj(run.source.path, mmproj_path_for(self.writer.path), ftype="F16", progress=run.cfg.progress)


def target_of(name: str) -> Target:
    """The target named ``gguf`` or ``safetensors`` (:class:`dynaquant.pipeline.safetensors_target.SafetensorsTarget`).

    Raises:
        ValueError: another name.
    """
    if name == "gguf":
        return GGUFTarget()
    if name == "safetensors":
        from dynaquant.pipeline.safetensors_target import SafetensorsTarget

        return SafetensorsTarget()
    raise ValueError(f"unknown target {name!r} (known: gguf, safetensors)")
