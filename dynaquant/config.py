"""Run configuration: the frozen dataclasses both the CLI and the Python API build, the one place for the defaults.

``dynaquant.analyze(...)`` and ``dynaquant.quantize(...)`` keep their keyword signatures and build these; the CLI
builds them from its options; the stage functions (:func:`dynaquant.pipeline.analyze.run_analyze`,
:func:`dynaquant.pipeline.quantize.run_quantize`) take them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.analysis.errors import SAMPLE_FRACTION
from dynaquant.exporters.safetensors.writer import DEFAULT_SHARD_BYTES
from dynaquant.quant.fit import FIT_CTX
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan
from dynaquant.quant.planner import GGUF_CANDIDATES

# Formats measured for every tensor by default: the allocator's GGUF candidates (those with a codec), by size.
DEFAULT_CANDIDATES = tuple(sorted(GGUF_CANDIDATES, key=lambda f: (get_format(f).bpw, f)))

CALIBRATION_CHUNKS = 32  # calibration sequences of a quantize run (the analysis' own default: CalibrationSpec's)
N_CTX = 512  # tokens per calibration / evaluation sequence
EVAL_CHUNKS = 16  # evaluation chunks
GPTQ_DAMP = 0.01  # GPTQ's damping, a fraction of the mean Hessian diagonal
SPLIT_MAX_SIZE = 50_000_000_000  # GGUF shards: the hub's file size limit (bytes); 0: never split
FISHER_SEQUENCES = 8  # sequences that also get a backward pass (Fisher diagonals) in an analysis
CORRECT_SEQUENCES = 8  # held-out calibration sequences the measured corrections use
# On a CPU (no GPU) the forward passes dominate a run (a 512-token forward of the 135M default model is ~140 GFLOP), so a
# quantize run whose counts are not given uses fewer: README's first command in ~90 s on 2 cores (issue 16; the plan's
# measured KLD against the counts above: README "Speed").
CPU_CALIBRATION_CHUNKS = 8
CPU_FISHER_SEQUENCES = 2
CPU_EVAL_CHUNKS = 8
CPU_SAMPLE_FRACTION = 32  # ... and measures the errors on half the rows (dynaquant.analysis.errors.sample_size)
TARGETS = ("gguf", "safetensors")
DEFAULT_SIZE_PRESET = "Q4_K_M"  # the default target of a dynamic plan: this llama.cpp mix's file size ...
QUANTIZED_SOURCE_SIZE_PRESETS = ("Q3_K_M", "Q2_K")  # ... of an already-quantized source: the first of these below it

PathLike = str | os.PathLike


@dataclass(frozen=True)
class AnalyzeConfig:
    """What ``dynaquant analyze`` does (arguments of :func:`dynaquant.pipeline.analyze.analyze`, same meaning).

    Attributes:
        calibration: what to calibrate on (None: ``CalibrationSpec()``, 64 sequences of 512 tokens of the default).
        candidates: format names measured for every tensor.
        fisher_sequences: sequences that also get a backward pass (>= 0).
        super_weights: detect and confirm super weights.
        sensitivity_formats: end-to-end sensitivity per block group in these formats.
        validate_presets: llama.cpp presets whose file sizes get a dynamic plan and a measured KLD.
        device: torch device (None: CUDA when present); dtype: ``float32``, ``bfloat16`` or ``float16``.
        allow_pickle, trust_remote_code: as :func:`dynaquant.sources.checkpoint.resolve_source`.
        progress: progress bars. allow_nonfinite: replace NaN / Inf weights instead of refusing them.
        correct_rounds, correct_sequences: measured corrections (:mod:`dynaquant.pipeline.corrections`) of the
            ``validate_presets`` plans, at most this many re-plans each (0: off), measured on this many held-out
            calibration sequences; the fitted factors go into the report's ``corrections`` section.
        stream: run block by block, one decoder block's weights in memory at a time
            (:mod:`dynaquant.pipeline.analyze_blocks`; no sensitivity, validation or corrections yet).
        max_cpu_memory, max_gpu_memory, offload_dir: with ``stream``, bytes the hidden states may take in memory before
            they go to files in ``offload_dir`` (None: half the available memory), and the GPU memory the embedding,
            head and largest block must fit (``analyze_blocks.memory_plan``).
    """

    calibration: CalibrationSpec | None = None
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    fisher_sequences: int = FISHER_SEQUENCES
    super_weights: bool = True
    sensitivity_formats: tuple[str, ...] = ()
    validate_presets: tuple[str, ...] = ()
    device: str | None = None
    dtype: str = "float32"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    progress: bool = True
    allow_nonfinite: bool = False
    correct_rounds: int = 0
    correct_sequences: int = CORRECT_SEQUENCES
    stream: bool = False
    max_cpu_memory: int | None = None
    max_gpu_memory: int | None = None
    offload_dir: PathLike | None = None


@dataclass(frozen=True)
class QuantizeConfig:
    """What ``dynaquant quantize`` does (arguments of :func:`dynaquant.pipeline.quantize.quantize`, same meaning).

    Attributes:
        output: the GGUF file or checkpoint folder (None: named after the model and the target in the cwd).
        preset / bpw / size / plan: the target size or mix (at most one; None: the ``Q4_K_M`` preset's size, or for an
            already-quantized source the ``Q3_K_M`` one's: :func:`dynaquant.pipeline.plan.default_size_bytes`).
        rules: ``REGEX=FORMAT`` (``>=``, ``<=``) user rules, first match wins, before the default rules.
        report: an analysis report (path or dict); imatrix: an imatrix file.
        calibration: a text file or CalibrationSpec; calibration_chunks sequences of n_ctx tokens.
        use_imatrix, default_rules_on: as their names say.
        evaluate, eval_text, eval_chunks: measure KLD / perplexity / top-1 at the end.
        calibration_chunks, eval_chunks, fisher_sequences, sample_fraction: None: the device's default
            (:meth:`for_device`: 32, 16, 8, 16 on a GPU; 8, 8, 2, 32 on the CPU); sample_fraction: the analysis
            measures each tensor's errors on about 1 / sample_fraction of its rows
            (:func:`dynaquant.analysis.errors.sample_size`).
        gptq, gptq_damp: error-compensating rounding and its damping.
        target: ``gguf`` or ``safetensors``.
        save_plan: also write the plan JSON here.
        keep_super_weights, max_shard_bytes: safetensors only (super weights kept exactly; shard size).
        fisher_sequences: Fisher sequences of the analysis run here when no report is given.
        push_to_hub, push_private, push_branch: upload the output folder to this hub repository (``ORG/NAME``),
            created private with ``push_private``, on this branch (None: the default branch); see
            :func:`dynaquant.pipeline.push.push_folder`.
        fit_memory: a size target in memory (bytes; GGUF only, instead of preset/bpw/size/plan): the file is planned
            as ``size = fit_memory - KV cache at fit_ctx tokens of kv_type - margin`` (:mod:`dynaquant.quant.fit`);
            fit_ctx: the context in tokens (default 4096; not ``n_ctx``, the calibration sequences' length);
            kv_type: ``f16`` or ``q8_0``; margin: bytes for compute buffers (None: 0.5 GiB + 4 % of fit_memory).
        card, compare_presets, command: publish a folder with a model card (:mod:`dynaquant.pipeline.publish`);
            also measure the uniform preset of the nearest size for it; the command line the card shows (None:
            the Python equivalent).
        split_max_size, split_max_tensors: GGUF only: split the file into llama.cpp shards (``NAME-00001-of-00003.gguf``)
            of at most this many bytes of tensor data / tensors each (0: no limit); under them, one file.
        source_revision: a hub source's branch, tag or commit to fetch (None: the default branch).
        correct_rounds, correct_sequences: measured corrections of a dynamic plan (:mod:`dynaquant.pipeline.corrections`):
            at most this many re-plans (None: 2 on CUDA, 0 = off on the CPU), measured on this many held-out
            calibration sequences (after those the statistics use).
        solver: the dynamic plan's allocation solver, ``exact`` or ``greedy`` (``quant.planner.make_plan``).
        stream: analysis, imatrix, corrections, GPTQ and evaluation block by block, one decoder block's weights in memory at a time
            (models larger than memory; GPTQ and measured corrections too); GGUF target, no compare_presets yet.
        work_dir: with ``stream``, the resumable work folder (:mod:`dynaquant.pipeline.rundir`; None: ``OUTPUT.work``
            beside the output); keep_work_dir: keep it after success.
        max_cpu_memory, max_gpu_memory, offload_dir: with ``stream``, as :class:`AnalyzeConfig` (``offload_dir``
            None: the work folder's ``offload``).
    """

    output: PathLike | None = None
    preset: str | None = None
    bpw: float | None = None
    size: int | None = None
    rules: tuple[str, ...] = ()
    plan: Plan | PathLike | None = None
    report: dict | PathLike | None = None
    imatrix: PathLike | None = None
    calibration: PathLike | CalibrationSpec | None = None
    calibration_chunks: int | None = None
    n_ctx: int = N_CTX
    use_imatrix: bool = True
    default_rules_on: bool = True
    evaluate: bool = False
    eval_text: PathLike | None = None
    eval_chunks: int | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    device: str | None = None
    progress: bool = True
    gptq: bool = False
    gptq_damp: float = GPTQ_DAMP
    target: str = "gguf"
    save_plan: PathLike | None = None
    allow_nonfinite: bool = False
    keep_super_weights: bool = True
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    fisher_sequences: int | None = None
    sample_fraction: int | None = None
    push_to_hub: str | None = None
    push_private: bool = False
    push_branch: str | None = None
    fit_memory: int | None = None
    fit_ctx: int = FIT_CTX
    kv_type: str = "f16"
    margin: int | None = None
    card: bool = False
    compare_presets: bool = False
    command: str | None = None
    split_max_size: int = SPLIT_MAX_SIZE
    split_max_tensors: int = 0
    source_revision: str | None = None
    correct_rounds: int | None = None
    correct_sequences: int = CORRECT_SEQUENCES
    solver: str = "exact"
    stream: bool = False
    work_dir: PathLike | None = None
    keep_work_dir: bool = False
    max_cpu_memory: int | None = None
    max_gpu_memory: int | None = None
    offload_dir: PathLike | None = None

    @property
    def explicit_target(self) -> bool:
        """A size was asked for (``bpw`` or ``size``), not the default one."""
        return self.bpw is not None or self.size is not None

    def for_device(self, device: str) -> QuantizeConfig:
        """This config with the counts left None set for ``device`` (a torch device string): on a CUDA device
        :data:`CALIBRATION_CHUNKS`, :data:`EVAL_CHUNKS`, :data:`FISHER_SEQUENCES`, :data:`SAMPLE_FRACTION`; elsewhere
        the ``CPU_`` ones."""
        gpu = str(device).startswith("cuda")
        counts = {"calibration_chunks": CALIBRATION_CHUNKS if gpu else CPU_CALIBRATION_CHUNKS,
                  "eval_chunks": EVAL_CHUNKS if gpu else CPU_EVAL_CHUNKS,
                  "fisher_sequences": FISHER_SEQUENCES if gpu else CPU_FISHER_SEQUENCES,
                  "sample_fraction": SAMPLE_FRACTION if gpu else CPU_SAMPLE_FRACTION}
        return replace(self, **{k: v for k, v in counts.items() if getattr(self, k) is None})

    def spec(self) -> CalibrationSpec:
        """The calibration spec: ``calibration`` if it is one, else ``calibration_chunks`` x ``n_ctx`` of the file / default
        (``calibration_chunks`` None: :data:`CALIBRATION_CHUNKS`; :meth:`for_device` sets it first in a run)."""
        if isinstance(self.calibration, CalibrationSpec):
            return self.calibration
        chunks = self.calibration_chunks if self.calibration_chunks is not None else CALIBRATION_CHUNKS
        return CalibrationSpec((str(self.calibration),) if self.calibration is not None else (), chunks, self.n_ctx)
