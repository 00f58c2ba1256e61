"""The publishable output folder of a quantize run (``dynaquant quantize ... --card``).

Layout of the folder (all at its top level, nothing else)::

    <model files>        GGUF: NAME.gguf (or its split shards NAME-00001-of-0000N.gguf, ...), mmproj-NAME.gguf for a
                         vision model; safetensors: the checkpoint itself (config.json, model*.safetensors, tokenizer)
    README.md            the model card (:mod:`dynaquant.exporters.card`)
    plan.json            the plan used (``Plan.to_dict``)
    plan.png             the plan as a heat map (tensor kind x layer, by bits per weight)
    report.json          the analysis report, when one was made or given
    report.html          that report as ``dynaquant report`` renders it, with the plan
    layer_errors.png     the report's per-layer predicted KLD, per format and tensor kind
    imatrix.gguf         the imatrix used (llama.cpp's GGUF imatrix format), when there is one

With ``-o FILE.gguf`` the folder is ``FILE`` (holding ``FILE.gguf``); with ``-o OUTDIR`` (GGUF target, no
``.gguf`` suffix) it is ``OUTDIR`` holding ``OUTDIR.gguf``; with no ``-o``, the default GGUF name less ``.gguf``.
The folder is written atomically: everything goes into a staging folder in the run's work folder beside it
(:func:`dynaquant.workdir.run_workdir`), renamed onto the folder when complete; on any error nothing is left. An
earlier dynaquant folder there is replaced; any other non-empty folder is refused before any work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from dynaquant.analysis.evaluate import EvalResult
from dynaquant.analysis.imatrix_io import load_imatrix
from dynaquant.analysis.report.html import render_report_html
from dynaquant.analysis.report.plots import (
    fig_layer_errors,
    fig_plan,
    layer_error_curves,
    plan_from_json,
    plan_grid,
    sensitive_layers,
)
from dynaquant.analysis.report.schema import save_report, write_json, write_text
from dynaquant.config import QuantizeConfig
from dynaquant.exporters.card import CardFacts, MeasuredRow, build_card, plan_groups
from dynaquant.pipeline.analyze import save_imatrix
from dynaquant.pipeline.evaluate import evaluate_written
from dynaquant.pipeline.plan import check_imatrix_needs
from dynaquant.pipeline.preflight import Output, check_outputs
from dynaquant.pipeline.run_state import RunState
from dynaquant.pipeline.source import default_device, model_info, tensor_infos
from dynaquant.pipeline.targets import Target, target_of
from dynaquant.quant.plan import Plan
from dynaquant.quant.planner import make_plan, preset_size_bytes
from dynaquant.quant.presets import PRESETS
from dynaquant.sources.checkpoint import ModelSource
from dynaquant.sources.readers import GGUF_SHARD_NAME, open_gguf
from dynaquant.workdir import run_workdir

log = logging.getLogger(__name__)

UNIFORM_PRESETS = tuple(p for p in PRESETS if p not in ("F32", "F16", "BF16"))
PNG_DPI = 96

WriteFn = Callable[[RunState, Target, Path], tuple[Path, int]]


def check_card_options(cfg: QuantizeConfig) -> None:
    """Refuse contradictory publishing options (before any work).

    Raises:
        ValueError: ``compare_presets`` without ``card``, without ``evaluate``, or for the safetensors target.
    """
    if cfg.compare_presets and not cfg.card:
        raise ValueError("--compare-presets puts a row in the model card: give --card too")
    if cfg.compare_presets and not cfg.evaluate:
        raise ValueError("--compare-presets compares measured quality: it needs the evaluation (drop --no-eval)")
    if cfg.compare_presets and cfg.target != "gguf":
        raise ValueError("--compare-presets compares with llama.cpp presets: it is for the gguf target")


def check_folder(folder: Path) -> None:
    """Refuse a published folder that exists as a file, or a non-empty folder dynaquant did not write
    (its README.md names dynaquant, or its config.json does).

    Raises:
        ValueError: naming the folder.
    """
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"{folder}: exists and is not a folder")
    marks = [folder / "README.md", folder / "config.json"]
    ours = any(m.is_file() and "dynaquant" in m.read_text(errors="replace") for m in marks)
    if any(folder.iterdir()) and not ours:
        raise ValueError(f"{folder}: a non-empty folder that dynaquant did not write; not overwritten")


def python_command(model, cfg: QuantizeConfig) -> str:
    """The Python line equivalent to a run (``run_quantize(model, QuantizeConfig(...))`` with the fields that differ
    from the defaults; the command line and progress bars left out)."""
    def text(v) -> str:
        return repr(os.fspath(v)) if isinstance(v, os.PathLike) else repr(v)

    default = QuantizeConfig()
    args = [f"{f.name}={text(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)
            if f.name not in ("command", "progress") and getattr(cfg, f.name) != getattr(default, f.name)]
    return ("from dynaquant.config import QuantizeConfig\nfrom dynaquant.pipeline.quantize import run_quantize\n\n"
            f"run_quantize({text(model)}, QuantizeConfig({', '.join(args)}))")


def source_metadata(source: ModelSource) -> tuple[str | None, tuple[str, ...]]:
    """(license, languages) of the source: its README.md card metadata (HF folders), else its config.json
    ``license`` / ``language``, or a GGUF file's ``general.license`` / ``general.languages``; (None, ()) if none."""
    license_, language = None, ()
    if source.kind == "gguf":
        fields = open_gguf(source.path).fields  # the run's reader of the source, kept
        lic, lang = fields.get("general.license"), fields.get("general.languages")
        license_ = str(lic.contents()) if lic is not None else None
        language = tuple(str(x) for x in lang.contents()) if lang is not None else ()
        return license_, language
    readme = source.path / "README.md"
    if readme.is_file():
        from huggingface_hub import ModelCard

        data = ModelCard.load(readme, ignore_metadata_errors=True).data
        license_, lang = data.license, data.language
        language = (lang,) if isinstance(lang, str) else tuple(lang or ())
    config = source.path / "config.json"
    if (license_ is None or not language) and config.is_file():
        from dynaquant.sources.readers import read_json_object

        c = read_json_object(config, "config")
        license_ = license_ or (c.get("license") if isinstance(c.get("license"), str) else None)
        lang = c.get("language")
        language = language or ((lang,) if isinstance(lang, str) else tuple(str(x) for x in lang or ()))
    return license_, language


def published_plan(plan: Plan, folder: Path) -> dict:
    """The plan as the folder's ``plan.json``: ``sources`` names the folder's own ``report.json`` and ``imatrix.gguf``
    (relative names, resolved beside the plan file by ``quantize --plan`` and ``plan --llama-quantize``), never the
    local paths of the machine that made it."""
    d = plan.to_dict()
    d["sources"] = {k: name for k, name in (("report", "report.json"), ("imatrix", "imatrix.gguf"))
                    if (folder / name).is_file()}
    return d


def model_files(staging: Path, output: Path, target: str) -> tuple[str, ...]:
    """The model's files in the staging folder, the one to load first: a GGUF file (or all shards of its split set),
    or the checkpoint's ``*.safetensors`` shards."""
    if target != "gguf":
        return tuple(sorted(p.name for p in staging.glob("*.safetensors")))
    m = GGUF_SHARD_NAME.match(output.name)
    if m is None:
        return (output.name,)
    return tuple(sorted(p.name for p in staging.iterdir() if (s := GGUF_SHARD_NAME.match(p.name)) and s["stem"] == m["stem"]
                        and s["count"] == m["count"]))


class Publisher:
    """A quantize run's published folder: where the target writes (:meth:`stage`), the card and the side files,
    and the rename that publishes them (:meth:`finish`). A context manager: its work folder is removed on exit.

    Without ``cfg.card`` it does nothing: :meth:`stage` returns the output and :meth:`finish` the result.
    """

    def __init__(self, cfg: QuantizeConfig, model, write: WriteFn):
        check_card_options(cfg)
        self.model, self.write = model, write
        self.explicit, self.given = cfg.output is not None, cfg
        if cfg.card and cfg.target == "gguf" and cfg.output is not None:
            out = Path(cfg.output)
            folder = out.with_suffix("") if out.suffix == ".gguf" else out
            cfg = dataclasses.replace(cfg, output=folder / (out.name if out.suffix == ".gguf" else f"{out.name}.gguf"))
        self.config = cfg.for_device(cfg.device or default_device())  # the run's counts; ``given``: as asked
        self.folder: Path | None = None
        self.stack = ExitStack()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def stage(self, output: Path, target: Target, inputs: dict, source: ModelSource) -> Path:
        """Where the target writes ``output`` (checked by the caller): in the staging folder when publishing.

        Raises:
            InputError: the folder is an input, holds one, or cannot be written (``preflight.check_outputs``).
            ValueError: the folder exists and is not an earlier dynaquant folder.
        """
        if not self.config.card:
            return output
        if target.name == "gguf":
            folder = output.parent if self.explicit else output.with_suffix("")
        else:
            folder = output
        check_outputs([Output(folder, folder=True)], inputs=inputs, source=source)
        check_folder(folder)
        self.folder = folder
        self.work = self.stack.enter_context(run_workdir(folder))
        self.staging = self.work / folder.name
        if target.name == "gguf":
            self.staging.mkdir()
            return self.staging / output.name
        return self.staging

    def finish(self, result, run: RunState, target: Target, imat_path: Path | None):
        """Write the card and the side files beside the model files, then rename the staging folder onto the
        published folder; ``result`` (a ``QuantizeResult``) then names the published paths (``folder`` set).

        Raises:
            Any error of the preset comparison, the evaluation or the writing; nothing is published then.
        """
        if not self.config.card:
            return result
        cfg, staging = self.config, self.staging
        rows = [MeasuredRow(f"this model ({result.plan.method})", result.size_bytes, result.bpw,
                            *_eval_numbers(result.eval))]
        if cfg.compare_presets:
            rows.append(self.preset_row(run, result.plan))
        files: list[tuple[str, str]] = []
        files.append(("plan.json", "the plan: each tensor's format and why"))
        plots = [("plan.png", "Formats chosen per layer and tensor kind")]
        _save_png(fig_plan(plan_grid(*plan_from_json(result.plan.to_dict())), "plan"), staging / "plan.png")
        if run.report is not None:
            save_report(run.report, staging / "report.json")
            render_report_html(run.report, staging / "report.html", plan=result.plan.to_dict(), plan_label="this plan")
            files += [("report.json", "the analysis report"), ("report.html", "the analysis report as a page")]
            curves = layer_error_curves(run.report)
            if curves.layers:
                _save_png(fig_layer_errors(curves, sensitive_layers(curves), "predicted KLD (nats)"),
                          staging / "layer_errors.png")
                plots.append(("layer_errors.png", "Predicted KL divergence per layer, per format and tensor kind"))
        if run.im is not None:
            save_imatrix(staging / "imatrix.gguf", run.im, run.ts, cfg.spec())
        elif imat_path is not None and cfg.use_imatrix:
            load_imatrix(imat_path).save(staging / "imatrix.gguf")
        if (staging / "imatrix.gguf").is_file():
            files.append(("imatrix.gguf", "the importance matrix used (llama.cpp GGUF imatrix format)"))
        write_json(published_plan(result.plan, staging), staging / "plan.json")
        files = [(p, c) for p, c in plots] + files
        facts = self.facts(result, run, target, imat_path, tuple(rows), tuple(plots), tuple(files))
        write_text(str(build_card(facts)), staging / "README.md")
        self.publish()
        return self.published(result)

    def facts(self, result, run: RunState, target: Target, imat_path: Path | None, rows, plots, files) -> CardFacts:
        """The card's facts from the run."""
        cfg, source = self.config, run.source
        calibration, tokens = _calibration(run, imat_path)
        ev: EvalResult | None = result.eval
        license_, language = source_metadata(source)
        fit = getattr(result, "fit", None)
        if hasattr(fit, "to_dict"):  # --fit-memory's assumptions (quant.fit.MemoryFit)
            fit = fit.to_dict()
        elif dataclasses.is_dataclass(fit):
            fit = dataclasses.asdict(fit)
        return CardFacts(
            target=target.name, base_model=source.model_id if source.origin == "hub" else source.path.name,
            architecture=run.ts.arch, model_files=model_files(self.staging, result.output, target.name),
            command=cfg.command or python_command(self.model, self.given), method=result.plan.method,
            calibration=calibration, calibration_tokens=tokens, eval_text=ev.text_id if ev else None,
            eval_tokens=ev.tokens if ev else 0, ppl_reference=ev.ppl_reference if ev else None, rows=rows,
            groups=plan_groups(result.plan), plots=plots, files=files, license=license_, language=language,
            vision=result.mmproj is not None or bool(getattr(run.ts, "has_vision", False)),
            mmproj=result.mmproj.name if result.mmproj is not None else None, assumptions=dict(fit or {}),
            source_revision=getattr(source, "revision", None))

    def preset_row(self, run: RunState, plan: Plan) -> MeasuredRow:
        """The uniform llama.cpp preset whose tensor data is nearest in size to ``plan``'s (those needing an imatrix
        only when one is used), written to a temporary GGUF, evaluated on the same text as the run, then removed."""
        tensors, info = tensor_infos(run.ts), model_info(run.ts)
        order = sorted(UNIFORM_PRESETS, key=lambda p: (abs(preset_size_bytes(tensors, info, p) - plan.size_bytes), p))
        for name in order:
            preset = make_plan(tensors, info, run.source.model_id, preset=name, has_imatrix=bool(run.imat))
            try:
                check_imatrix_needs(preset, set(run.imat))
            except ValueError:
                continue
            break
        prun = dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, preset=name), plan=preset, loaded_plan=False,
                                   rounding=None, model=None)
        path, nbytes = self.write(prun, target_of("gguf"), self.work / f"preset-{name}.gguf")
        try:
            ev = evaluate_written(path, run.source, run.ts, run.tokenizer, run.cfg, str(run.device), checkpoint=False)
        finally:
            path.unlink(missing_ok=True)
        log.info("preset %s for comparison: %d bytes, mean KLD %.6f", name, nbytes, ev.kld_mean)
        return MeasuredRow(f"{name} (uniform llama.cpp preset, nearest size)", nbytes, preset.bpw, *_eval_numbers(ev))

    def publish(self) -> None:
        """Rename the staging folder onto the published folder (an earlier one moves into the work folder, removed
        with it)."""
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.staging, 0o777 & ~umask)
        if self.folder.exists():
            os.replace(self.folder, self.work / "old")
        os.replace(self.staging, self.folder)

    def published(self, result):
        """``result`` with the published paths."""
        result.folder = self.folder
        result.output = self.folder / result.output.name if result.output.parent == self.staging else self.folder
        if result.mmproj is not None:
            result.mmproj = self.folder / result.mmproj.name
        result.files = [self.folder / p.name if p.parent == self.staging else p for p in result.files]
        return result


def _eval_numbers(ev: EvalResult | None) -> tuple[float | None, float | None, float | None]:
    return (ev.kld_mean, ev.ppl, ev.top1_agreement) if ev is not None else (None, None, None)


def _calibration(run: RunState, imat_path: Path | None) -> tuple[str | None, int]:
    """(calibration data in words, tokens) of the run: the report's, this run's imatrix, or the imatrix file's."""
    c = (run.report or {}).get("calibration")
    if isinstance(c, dict) and c.get("n_sequences"):
        n, ctx = int(c["n_sequences"]), int(c.get("seq_len") or 0)
        return f"{c.get('id', 'unknown')}, {n} sequences x {ctx} tokens", n * ctx
    if run.im is not None:
        ctx = run.cfg.spec().seq_len
        return f"{run.im.dataset or 'unknown'}, {run.im.chunks} sequences x {ctx} tokens", run.im.chunks * ctx
    if imat_path is not None and run.cfg.use_imatrix:
        d = load_imatrix(imat_path)
        names = ", ".join(d.datasets) or "unknown text"
        return (f"{names} (imatrix file {imat_path.name}: {d.chunk_count} chunks x {d.chunk_size or '?'} tokens)",
                d.chunk_count * d.chunk_size)
    return None, 0


def _save_png(fig, path: Path) -> None:
    """``fig`` as a PNG at ``path`` (96 dpi, no software stamp)."""
    with run_workdir(path) as work:
        tmp = work / path.name
        fig.savefig(tmp, format="png", dpi=PNG_DPI, metadata={"Software": None})
        os.replace(tmp, path)
