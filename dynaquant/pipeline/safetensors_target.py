"""The safetensors target: a compressed-tensors checkpoint folder in the runtime formats, written from the loaded model
or, with ``stream``, from the model's meta-device skeleton one part at a time (:mod:`dynaquant.pipeline.part_weights`).
The Target protocol and the GGUF target: :mod:`dynaquant.pipeline.targets`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from dynaquant.exporters.safetensors.writer import (
    SafetensorsFolderWriter,
    check_output_folder,
    safetensors_overhead_bytes,
    unquantized_linears,
)
from dynaquant.pipeline.preflight import Output, side_files_bytes_bound
from dynaquant.pipeline.run_state import RunState
from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import PlanEntry, TensorInfo
from dynaquant.quant.planner import RUNTIME_CANDIDATES, default_rules
from dynaquant.quant.runtime import RuntimeWeight, from_records
from dynaquant.quant.runtime import encode as encode_runtime
from dynaquant.runtime.moe import checkpoint_weights, encode_experts, in_memory_plan
from dynaquant.sources.checkpoint import ModelSource
from dynaquant.sources.gguf import TensorSource


def super_weights_of(report: dict | None) -> dict[str, list[tuple[int, int]]]:
    """HF module -> [(row, col)] of the report's confirmed super weights."""
    out: dict[str, list[tuple[int, int]]] = {}
    for s in (report or {}).get("super_weights", []):
        if s.get("confirmed") and s.get("module"):
            out.setdefault(s["module"], []).append((int(s["row"]), int(s["column"])))
    return out


class _EntryNames:
    """The names ``GPTQRounding.encode`` reads from a source tensor, of a plan entry."""

    def __init__(self, e: PlanEntry):
        self.gguf_name, self.hf_name = e.name, e.hf_name


class SafetensorsTarget:
    """A compressed-tensors checkpoint folder in the runtime formats
    (:class:`dynaquant.exporters.safetensors.writer.SafetensorsFolderWriter`), tensors read from the loaded model, or
    with ``stream`` from the model's skeleton on the meta device one part at a time (:mod:`dynaquant.pipeline.part_weights`:
    the outer part or one decoder block holds real weights, read from the tensor source; the same names, order and
    bytes as the loaded model's).

    Mixture-of-experts models: stacked expert tensors are read from the model's experts modules
    (:func:`dynaquant.runtime.moe.checkpoint_weights`), encoded expert by expert with each expert's own imatrix row
    (:func:`dynaquant.runtime.moe.encode_experts`; plain rounding, no GPTQ, no super weights) and written per expert.
    Confirmed super weights of the report are kept exactly (``keep_super_weights``).
    """

    name, full_vl, folder_output, needs_model = "safetensors", True, True, True
    analysis_candidates = RUNTIME_CANDIDATES

    def overhead_bytes(self, source, ts, tensors, cfg) -> int:
        return safetensors_overhead_bytes(tensors)

    def bound_overhead(self, ts: TensorSource, tensors: list[TensorInfo], rules) -> int:
        return safetensors_overhead_bytes(tensors)

    def plan_options(self, info, super_weights, report, cfg) -> dict:
        opts = dict(defaults=default_rules(info, super_weights, target="safetensors") if cfg.default_rules_on else (),
                    target="safetensors", relax_floors=cfg.explicit_target)
        if report is not None:
            opts.update(candidates=[c for c in report["candidates"] if get_format(c).allowed_in("safetensors")],
                        error_source="measured kld")
        return opts

    def default_output(self, source, cfg, size) -> Path:
        label = f"{cfg.bpw:g}bpw" if cfg.bpw is not None else (f"{size / 1e6:.0f}MB" if size is not None else "plan")
        return Path.cwd() / f"{source.name}-{label}-safetensors"

    def output(self, path, bound, source, ts) -> Output:
        return Output(path, bound + side_files_bytes_bound(source, ts), folder=True)

    def check_output(self, path: Path) -> None:
        check_output_folder(path)

    def begin(self, run: RunState, path: Path) -> None:
        self.run = run
        self.parts = None
        tied = None
        if run.cfg.stream:  # the skeleton, float32 as load_model's (the same bytes as the whole-model run)
            from dynaquant.pipeline.part_weights import PartWeights
            from dynaquant.sources.skeleton import build_skeleton

            self.parts = PartWeights(build_skeleton(run.source, run.ts, device="cpu", allow_nonfinite=run.cfg.allow_nonfinite))
            model, weights, tied = self.parts.model, self.parts.meta, self.parts.tied
            self.generation_config = _generation_config(model, run.source)
        else:
            model = run.model
            weights = checkpoint_weights(model)
            self.generation_config = getattr(model, "generation_config", None)
        self.keep = super_weights_of(run.report) if run.cfg.keep_super_weights else {}
        self.kept: dict[str, list] = {}
        config = model.config.to_dict()
        config["dtype"] = "bfloat16"
        config.pop("torch_dtype", None)
        config.pop("_name_or_path", None)  # the local path transformers loaded it from: never published
        config["architectures"] = config.get("architectures") or [type(model).__name__]  # vLLM picks the class by it
        self.config = config
        write_plan = in_memory_plan(run.plan, weights)  # the source's on-disk names -> the model's (Mixtral's router)
        self.ignore = unquantized_linears(model, write_plan)
        self.writer = SafetensorsFolderWriter(path, write_plan, weights, max_shard_bytes=run.cfg.max_shard_bytes,
                                              tied=tied)
        self.names = list(weights)
        self._resumed: dict[str, torch.Tensor] = {}  # weights written as they are, kept by a stopped run (load_encoded)

    def progress_label(self) -> str:
        return "safetensors"

    def tensors(self) -> list[str]:
        return list(self.names)

    def read(self, name: str) -> torch.Tensor:
        """The model's weight (``stream``: its part materialized, the part held before released)."""
        return self.parts.get(name) if self.parts is not None else self.writer.weights[name]

    def reused(self, name: str) -> None:
        """None: the safetensors target encodes every weight itself (its quantize runs keep no corrections' bytes)."""
        return None

    def gptq_round(self, name: str, w: torch.Tensor, plain: Any | None = None) -> Any | None:
        """GPTQ records of a planned 2-D runtime weight (NVFP4's global scale is per tensor: plain rounding), or None
        (``plain`` is always None here: :meth:`reused` keeps nothing)."""
        run, e = self.run, self.writer.to_encode(name, w)
        if run.rounding is None or e is None or w.ndim == 3 or get_format(e.format).name == "NVFP4_G16":
            return None
        return run.rounding.encode(_EntryNames(e), w.to(run.device, torch.float32), get_format(e.format), run.imat.get(e.name))

    def encode(self, name: str, w: torch.Tensor, rounded: Any | None) -> RuntimeWeight | list[RuntimeWeight] | None:
        """The runtime encoding of a planned weight (stacked experts: one per expert), None for any other weight;
        confirmed super weights of the report kept exactly."""
        run, e = self.run, self.writer.to_encode(name, w)
        if e is None:
            return None
        fmt = get_format(e.format)
        if w.ndim == 3:  # stacked experts
            return encode_experts(w, fmt.name, run.imat.get(e.name), device=run.device)
        module = e.hf_name.removesuffix(".weight")
        sw = self.keep.get(module)
        if rounded is not None:
            rw = from_records(rounded, fmt, tuple(w.shape))
            if sw:
                r, c = zip(*sw)
                rw.super_weights = (torch.tensor(r), torch.tensor(c), w.detach()[list(r), list(c)].float().cpu())
        else:
            rw = encode_runtime(w.to(run.device, torch.float32), fmt, run.imat.get(e.name),
                                super_weights=tuple(zip(*sw)) if sw else None)
        return rw.to("cpu")

    def add(self, name: str, encoded: RuntimeWeight | list[RuntimeWeight] | None) -> None:
        """Write the weight: its encoding, or (None) the weight itself (``stream``: as the work folder kept it for a
        resumed run, else read here; an encoded weight's or a skipped tied copy's values are not read: the meta tensor
        gives the shape)."""
        if encoded is not None or self.writer.is_tied_copy(name):
            w = self.writer.weights[name]
        else:
            w = self._resumed.pop(name, None)
            w = self.read(name) if w is None else w
        if isinstance(encoded, RuntimeWeight) and encoded.super_weights is not None:  # kept in the config's extension
            self.kept[name.removesuffix(".weight")] = [[int(r), int(c), float(v)]
                                                       for r, c, v in zip(*(t.tolist() for t in encoded.super_weights))]
        self.writer.add(name, w, encoded)

    def save_encoded(self, rundir, i: int, encoded: RuntimeWeight | list[RuntimeWeight] | None) -> None:
        """Kept as a checkpoint of plain dicts and tensors (``RuntimeWeight.to_state``), read with ``weights_only``; a
        weight written as it is (None) is kept too (its float32 values, a copy of its own), so that a resumed run
        reads no part again for it (a tied copy: nothing kept, nothing read)."""
        if encoded is None:
            name = self.names[i]
            state = {"kind": "none"}
            if not self.writer.is_tied_copy(name):
                state["weight"] = self.read(name).detach().clone(memory_format=torch.contiguous_format)
        elif isinstance(encoded, RuntimeWeight):
            state = {"kind": "weight", "weight": encoded.to_state()}
        else:
            state = {"kind": "experts", "experts": [rw.to_state() for rw in encoded]}
        rundir.save(f"tensors/{i:05d}.pt", state)

    def load_encoded(self, rundir, i: int) -> tuple[bool, RuntimeWeight | list[RuntimeWeight] | None]:
        state = rundir.load(f"tensors/{i:05d}.pt")
        if state is None:
            return False, None
        if state["kind"] == "weight":
            return True, RuntimeWeight.from_state(state["weight"])
        if state["kind"] == "experts":
            return True, [RuntimeWeight.from_state(x) for x in state["experts"]]
        if "weight" in state:  # taken by add
            self._resumed[self.names[i]] = state["weight"]
        return True, None

    def finish(self) -> tuple[Path, int]:
        run = self.run
        if self.parts is not None:
            self.parts.release()
        written = self.writer.finish(self.config, ignore=self.ignore, super_weights=self.kept, extension={
            "source": run.source.model_id, "source_kind": run.source.origin, "source_sha256": run.source.sha256,
            "plan_method": run.plan.method, "bpw": round(run.plan.bpw, 4)},
            extra_files=lambda folder: self._extra_files(run, folder))
        self.written = [written.path]
        return written.path, written.size_bytes

    def abort(self) -> None:
        if getattr(self, "parts", None) is not None:
            self.parts.release()
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.abort()

    def _extra_files(self, run: RunState, folder: Path) -> None:
        run.tokenizer.save_pretrained(str(folder))
        if getattr(run.ts, "vision", False):  # processor configs, chat template (VL models)
            from dynaquant.sources.hf_vl_full import copy_processor_files

            copy_processor_files(run.source.path, folder)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(str(folder))

    def discard(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def extras(self, run: RunState, path: Path) -> Path | None:
        return None


def _generation_config(model, source: ModelSource):
    """The generation config ``from_pretrained`` would give the model: the folder's ``generation_config.json`` when it
    has one, else the one made from the model's config (``model.generation_config``, None for a model that does not
    generate)."""
    if getattr(model, "generation_config", None) is None:
        return None
    folder = Path(source.folder) if source.kind == "hf" else None
    if folder is not None and (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(str(folder))
    return model.generation_config
