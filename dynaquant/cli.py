"""The ``dynaquant`` command: a thin shell over the public functions in ``dynaquant``.

Exit status (:func:`main`): 0 success; 2 bad input or environment, one line on stderr naming the file (or
option) and the problem; 130 interrupted (Ctrl-C); 1 a bug in dynaquant (traceback and a request to report it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import signal
import sys
import traceback

import dynaquant.config as config
from dynaquant import distributed

log = logging.getLogger("dynaquant")

EXIT_OK, EXIT_BUG, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
BUG_REPORT = ("this is a bug in dynaquant: please report it at the project's issue tracker, with the command line "
              "and the traceback above")


def _memory_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-cpu-memory", type=_size, metavar="SIZE",
                   help="with --stream: memory the calibration's hidden states may take before they go to files "
                        "(default: half the available memory)")
    p.add_argument("--max-gpu-memory", type=_size, metavar="SIZE",
                   help="with --stream: refuse before any work when the embedding, head and largest block need more")
    p.add_argument("--offload-dir", metavar="DIR",
                   help="with --stream: where hidden states beyond --max-cpu-memory go (default: the work folder's "
                        "offload/)")


def _size(text: str) -> int:
    """``80MB``, ``1.5GiB``, ``95000000`` -> bytes: a positive whole number below 2**63 (argparse type)."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "B": 1}
    t = text.strip().upper().replace("_", "")
    unit = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), "")
    number = t[: len(t) - len(unit)].strip()
    try:
        value = int(number) * units.get(unit, 1) if number.isdigit() else float(number) * units.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a size (bytes, or with a unit: 80MB, 1.5GiB)") from None
    if not math.isfinite(value) or not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte and below 2**63 bytes")
    return int(value)


def _size_or_zero(text: str) -> int:
    """``0`` or a :func:`_size` (argparse type)."""
    return 0 if text.strip() == "0" else _size(text)


def _bpw(text: str) -> float:
    """Bits per weight: a finite number above 0 and at most 32 (F32, the widest format) (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not math.isfinite(value) or not 0 < value <= 32:
        raise argparse.ArgumentTypeError(f"{text!r}: bits per weight must be a finite number above 0 and at most 32 (F32)")
    return value


def _count(minimum: int):
    """An argparse type: a whole number, at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {minimum}")
        return value

    return parse


def _fraction(text: str) -> float:
    """A finite number, at least 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number, at least 0")
    return value


_positive = _count(1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynaquant", description="Dynamic low-bit quantization of LLM checkpoints.")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a model to a mixed-precision GGUF file or safetensors checkpoint")
    q.add_argument("model", nargs="?", help="HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    q.add_argument("--format", dest="target", default="gguf", choices=["gguf", "safetensors"],
                   help="output: a GGUF file (default) or a compressed-tensors safetensors folder run by dynaquant.load "
                        "(with --bpw, --size or --plan; no presets)")
    g = q.add_mutually_exclusive_group()
    g.add_argument("--preset", help="llama.cpp mix: Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, ... (default: a "
                   "dynamic plan at the Q4_K_M mix's size; Q3_K_M's for an already-quantized GGUF)")
    g.add_argument("--bpw", type=_bpw, help="average bits per weight over all tensor data, at most")
    g.add_argument("--size", type=_size, help="whole output file size, at most (bytes, or 80MB, 1.5GiB)")
    g.add_argument("--plan", help="plan.json to use as is")
    q.add_argument("--rule", action="append", default=[], metavar="REGEX=FORMAT",
                   help="override, matched against GGUF tensor names; first match wins (repeatable); "
                        "REGEX>=FORMAT / REGEX<=FORMAT bound the allocator")
    q.add_argument("--no-default-rules", action="store_true", help="dynamic plans without the default rules")
    q.add_argument("--report", help="analysis report.json for dynamic plans (default: analyse here)")
    q.add_argument("--imatrix", help="imatrix file (llama.cpp GGUF or .dat) for the encoders")
    q.add_argument("--gptq", action="store_true",
                   help="error-compensating (GPTQ) rounding where it lowers the held-out layer-output error")
    q.add_argument("--gptq-damp", type=_fraction, default=config.GPTQ_DAMP,
                   help=f"GPTQ damping, relative to mean diag(H) (default {config.GPTQ_DAMP})")
    q.add_argument("--calibration", help="calibration text file (default: Python stdlib docstrings)")
    q.add_argument("--calibration-chunks", type=_positive, default=None,
                   help=f"chunks of --ctx tokens (default {config.CALIBRATION_CHUNKS} on a GPU, {config.CPU_CALIBRATION_CHUNKS} "
                        f"on the CPU, of which {config.FISHER_SEQUENCES} / {config.CPU_FISHER_SEQUENCES} with a backward pass)")
    q.add_argument("--calibration-images", action="append", default=[], metavar="FILE|FOLDER",
                   help="vision-language models: calibration images (repeatable; default: synthetic images)")
    q.add_argument("--ctx", type=_positive, default=config.N_CTX, help=f"tokens per chunk (default {config.N_CTX})")
    q.add_argument("--no-imatrix", action="store_true", help="encode without an imatrix")
    q.add_argument("--eval", dest="evaluate", action="store_true",
                   help="measure KLD against the source afterwards (on by default with no arguments)")
    q.add_argument("--no-eval", action="store_true", help="never evaluate")
    q.add_argument("--text", help="evaluation text file (default: stdlib docstrings, not the calibration ones)")
    q.add_argument("--chunks", type=_positive, default=None,
                   help=f"evaluation chunks (default {config.EVAL_CHUNKS} on a GPU, {config.CPU_EVAL_CHUNKS} on the CPU)")
    q.add_argument("-o", "--output", help="output .gguf, or folder with --format safetensors (default: named after "
                                           "the model and target, here)")
    q.add_argument("--save-plan", help="also write the plan as JSON here (as soon as it is made)")
    q.add_argument("--allow-pickle", action="store_true", help="read *.bin/*.pt weights (torch.load weights_only)")
    q.add_argument("--trust-remote-code", action="store_true")
    q.add_argument("--allow-nonfinite", action="store_true",
                   help="write NaN weights as 0 and +-Inf as +-the tensor's largest finite |value| "
                        "(default: refuse them, naming the tensor)")
    q.add_argument("--device", help="torch device (default: cuda if available)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.add_argument("--push-to-hub", metavar="ORG/NAME", help="upload the output folder (card, model files, report, plan, "
                                                              "imatrix) to this hub model repository at the end")
    q.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    q.add_argument("--hub-branch", metavar="BRANCH", help="with --push-to-hub: commit to this branch (created if missing)")
    g.add_argument("--fit-memory", type=_size, metavar="SIZE",
                   help="the largest file that runs in this memory (24GiB) with llama.cpp: file + KV cache at "
                        "--fit-ctx tokens + --margin")
    q.add_argument("--fit-ctx", type=_positive, metavar="TOKENS",
                   help=f"--fit-memory: context of the KV cache (default {config.FIT_CTX}; --ctx is the calibration's)")
    q.add_argument("--kv-type", choices=["f16", "q8_0"], help="--fit-memory: KV cache type (default f16)")
    q.add_argument("--margin", type=_size_or_zero, metavar="SIZE",
                   help="--fit-memory: compute margin (default 0.5 GiB + 4%% of the memory)")
    q.add_argument("--card", action="store_true",
                   help="write a publishable folder: the model file(s), README.md (model card), plan, report, imatrix "
                        "and plots (-o FILE.gguf: folder FILE; turns on --eval unless --no-eval)")
    q.add_argument("--compare-presets", action="store_true",
                   help="with --card: also measure the uniform llama.cpp preset of the nearest size, for the card")
    q.add_argument("--split-max-size", type=_size, default=config.QuantizeConfig.split_max_size, metavar="SIZE",
                   help="GGUF: split into llama.cpp shards of at most SIZE of tensor data each (K/M/G = 1000-based, "
                        "as llama-gguf-split; default 50G, the hub's file limit)")
    q.add_argument("--split-max-tensors", type=_count(0), default=0, metavar="N",
                   help="GGUF: split into shards of at most N tensors each (default 0: no limit)")
    q.add_argument("--source-revision", metavar="REV", help="hub source: the branch, tag or commit to fetch (recorded)")
    q.add_argument("--correct", type=_count(0), metavar="N", help="dynamic plans: measure the plan's KLD on held-out "
                   "calibration sequences, fit per-group corrections and re-plan, at most N times (default: 2 on CUDA, "
                   "0 = off on the CPU)")
    q.add_argument("--correct-sequences", type=_positive, default=config.CORRECT_SEQUENCES, metavar="K",
                   help=f"held-out calibration sequences the corrections measure on (default {config.CORRECT_SEQUENCES})")
    q.add_argument("--solver", choices=["exact", "greedy"], default="exact",
                   help="dynamic plans: exact allocation (default; the plan records its gap) or the greedy one")
    q.add_argument("--stream", action="store_true",
                   help="analysis, imatrix and evaluation block by block: one decoder block's weights in memory at a "
                        "time (models larger than memory; resumable: --work-dir); with --target safetensors the "
                        "checkpoint is written a part at a time too (embedding and head, or one block), without "
                        "--gptq and evaluation for now")
    q.add_argument("--work-dir", metavar="DIR",
                   help="with --stream: the resumable work folder (default OUTPUT.work beside the output): a killed "
                        "run started again with the same arguments continues from it")
    q.add_argument("--keep-work-dir", action="store_true", help="with --stream: keep the work folder after success")
    _memory_options(q)

    a = sub.add_parser("analyze", help="measure per-tensor errors, activations and super weights: DIR/report.json")
    a.add_argument("model", nargs="?", help="HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    a.add_argument("-o", "--output", default="analysis", help="output folder (default: ./analysis)")
    a.add_argument("--calibration", action="append", default=[], metavar="FILE|hf:ID[:SPLIT[:COLUMN]]",
                   help="calibration text file or HF dataset (repeatable; default: Python stdlib docstrings)")
    a.add_argument("--sequences", type=_positive, default=64, help="calibration sequences (default 64)")
    a.add_argument("--calibration-images", action="append", default=[], metavar="FILE|FOLDER",
                   help="vision-language models: calibration images (repeatable; default: synthetic images)")
    a.add_argument("--ctx", type=_positive, default=config.N_CTX, help=f"tokens per sequence (default {config.N_CTX})")
    a.add_argument("--chat-template", action="store_true", help="wrap the text in the model's chat template")
    a.add_argument("--fisher-sequences", type=_count(0), default=config.FISHER_SEQUENCES,
                   help=f"sequences with a backward pass (default {config.FISHER_SEQUENCES})")
    a.add_argument("--formats", help="comma-separated candidate formats; 'gguf' and 'safetensors' stand for each "
                                     "target's candidates (default: gguf)")
    a.add_argument("--sensitivity", metavar="FORMATS", help="also measure end-to-end KLD per block group in these formats")
    a.add_argument("--validate", metavar="PRESETS", help="check dynamic plans at these presets' sizes (e.g. Q4_K_M,Q2_K)")
    a.add_argument("--correct", type=_count(0), default=0, metavar="N",
                   help="with --validate: correct each plan by measurement, at most N re-plans (report: corrections)")
    a.add_argument("--correct-sequences", type=_positive, default=config.CORRECT_SEQUENCES, metavar="K",
                   help=f"held-out calibration sequences the corrections measure on (default {config.CORRECT_SEQUENCES})")
    a.add_argument("--stream", action="store_true",
                   help="block by block: one decoder block's weights in memory at a time (models larger than memory)")
    _memory_options(a)
    a.add_argument("--no-super-weights", action="store_true")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a.add_argument("--device")
    a.add_argument("--allow-pickle", action="store_true")
    a.add_argument("--trust-remote-code", action="store_true")
    a.add_argument("--allow-nonfinite", action="store_true",
                   help="write NaN weights as 0 and +-Inf as +-the tensor's largest finite |value| "
                        "(default: refuse them, naming the tensor)")
    a.add_argument("--json", action="store_true")

    pl = sub.add_parser("plan", help="a dynamic plan from an analysis report, within a budget")
    pl.add_argument("report", help="report.json written by dynaquant analyze (with --llama-quantize and no budget: "
                                   "a plan.json)")
    g = pl.add_mutually_exclusive_group()
    g.add_argument("--bpw", type=_bpw, help="average bits per weight over all tensor data, at most")
    g.add_argument("--size", type=_size, help="whole output file size, at most (bytes, or 80MB, 1.5GiB)")
    pl.add_argument("--target", default="gguf", choices=["gguf", "safetensors"])
    pl.add_argument("--rule", action="append", default=[], metavar="REGEX=FORMAT")
    pl.add_argument("--no-default-rules", action="store_true")
    pl.add_argument("-o", "--output", default="plan.json")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--llama-quantize", action="store_true",
                    help="also print the plan as llama-quantize arguments (JSON with --json); without --bpw/--size, "
                         "REPORT is a plan.json to print")
    pl.add_argument("--solver", choices=["exact", "greedy"], default="exact",
                    help="allocation solver: exact (default; the plan records its gap) or greedy")
    pl.set_defaults(subparser=pl)

    r = sub.add_parser("report", help="render an analysis report as a self-contained HTML page")
    r.add_argument("report", help="report.json")
    r.add_argument("--plan", help="also show this plan.json as a heat map")
    r.add_argument("-o", "--output", help="HTML file (default: report.html beside report.json)")

    e = sub.add_parser("eval", help="KLD, perplexity and top-1 agreement of a quantized GGUF (or safetensors folder) "
                                    "against its original")
    e.add_argument("quantized", help="GGUF file or safetensors checkpoint folder")
    e.add_argument("--reference", help="original model (default: the dynaquant.source recorded in the file)")
    e.add_argument("--text", help="evaluation text file (default: stdlib docstrings)")
    e.add_argument("--ctx", type=_positive, default=config.N_CTX)
    e.add_argument("--chunks", type=_positive, default=None, help="at most N chunks (default: all)")
    e.add_argument("--device")
    e.add_argument("--json", action="store_true")

    i = sub.add_parser("inspect", help="types, sizes and bpw per tensor and per layer of a GGUF file")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")

    pu = sub.add_parser("push", help="upload a finished output folder (card, model files, report, plan, imatrix) to the hub")
    pu.add_argument("folder", help="the output folder: README.md card, .gguf shards or safetensors checkpoint, side files")
    pu.add_argument("repo_id", metavar="ORG/NAME", help="hub model repository (created if missing)")
    pu.add_argument("--private", action="store_true", help="create the repository private")
    pu.add_argument("--revision", metavar="BRANCH", help="commit to this branch (created if missing; default: main)")
    return p


def _print_eval(ev) -> None:
    print(f"  eval: {ev.tokens} tokens ({ev.chunks} chunks x {ev.n_ctx}, second halves scored) of {ev.text_id}")
    print(f"  mean KLD {ev.kld_mean:.5f}  p99 KLD {ev.kld_p99:.5f}  top-1 agreement {100 * ev.top1_agreement:.2f}%")
    print(f"  perplexity {ev.ppl:.4f} (reference {ev.ppl_reference:.4f})")


def _quantize(a, bare: bool, argv: list[str]) -> int:
    from dynaquant.config import QuantizeConfig
    from dynaquant.pipeline.quantize import run_quantize

    evaluate = (a.evaluate or bare or a.card or bool(a.push_to_hub)) and not a.no_eval
    calibration = a.calibration
    if a.calibration_images:
        from dynaquant.analysis.calibration import CalibrationSpec

        chunks = a.calibration_chunks or config.CALIBRATION_CHUNKS
        calibration = CalibrationSpec((a.calibration,) if a.calibration else (), chunks, a.ctx,
                                      images=tuple(a.calibration_images))
    cfg = QuantizeConfig(output=a.output, preset=a.preset, bpw=a.bpw, size=a.size, rules=a.rule, plan=a.plan,
                         report=a.report, imatrix=a.imatrix, default_rules_on=not a.no_default_rules,
                         calibration=calibration, calibration_chunks=a.calibration_chunks, n_ctx=a.ctx,
                         use_imatrix=not a.no_imatrix, evaluate=evaluate, eval_text=a.text, eval_chunks=a.chunks,
                         allow_pickle=a.allow_pickle, trust_remote_code=a.trust_remote_code, device=a.device,
                         progress=not a.json, gptq=a.gptq, gptq_damp=a.gptq_damp, target=a.target, save_plan=a.save_plan,
                         allow_nonfinite=a.allow_nonfinite, push_to_hub=a.push_to_hub, push_private=a.private,
                         push_branch=a.hub_branch, split_max_size=a.split_max_size,
                         split_max_tensors=a.split_max_tensors, source_revision=a.source_revision, solver=a.solver,
                         correct_rounds=a.correct, correct_sequences=a.correct_sequences, stream=a.stream,
                         work_dir=a.work_dir, keep_work_dir=a.keep_work_dir, max_cpu_memory=a.max_cpu_memory,
                         max_gpu_memory=a.max_gpu_memory, offload_dir=a.offload_dir, **_fit_options(a))
    if cfg.push_to_hub:
        from dynaquant.pipeline.push import check_push_target

        check_push_target(cfg.push_to_hub)  # before the run: a bad id or no token fails now, not after it
    if a.card or a.compare_presets or a.push_to_hub:  # --push-to-hub publishes the folder --card makes
        cfg = dataclasses.replace(cfg, card=a.card or bool(a.push_to_hub), compare_presets=a.compare_presets,
                                  command=shlex.join(["dynaquant", *argv]))
    res = run_quantize(a.model, cfg)
    if res is None:  # a rank other than 0 of several (torchrun): rank 0 reports
        return 0
    url = _push_output(res, cfg) if cfg.push_to_hub else None
    if a.json:
        print(json.dumps(res.to_dict() | ({"hub_url": url} if url else {}), indent=1))
        return 0
    print(f"wrote {res.output}" + (f" (shard 1 of {len(res.files)}: {', '.join(p.name for p in res.files)})"
                                   if len(res.files) > 1 else "")
          + (f" in the folder {res.folder} (model card: README.md)" if res.folder else ""))
    print(f"  {res.size_bytes / 1e6:.2f} MB, {res.bpw:.3f} bpw over tensor data, {res.time_s:.1f} s ({res.plan.method})")
    if res.source_bytes:
        saved = res.source_bytes - res.size_bytes
        print(f"  {abs(saved) / 1e6:.2f} MB ({100 * abs(saved) / res.source_bytes:.1f}%) {'smaller' if saved >= 0 else 'larger'} "
              f"than the source ({res.source_bytes / 1e6:.2f} MB)")
    mix = ", ".join(f"{f} {100 * n / res.plan.n_elements:.1f}%" for f, n in
                    sorted(res.plan.count_by_format().items(), key=lambda kv: -kv[1]))
    print(f"  formats by weights: {mix}")
    if res.gptq:
        for f, g in res.gptq.items():
            if g.get("plain_only"):
                print(f"  GPTQ {f}: not supported, {g['tensors']} tensors rounded plainly")
            else:
                print(f"  GPTQ {f}: {g['gptq']}/{g['tensors']} tensors, held-out output error x{g['mean_ratio']:.3f} vs plain")
    if res.fit:
        print(f"  fits {res.fit.describe()}")
    if res.eval:
        _print_eval(res.eval)
    if url:
        print(f"published {url}" + (f" (branch {cfg.push_branch})" if cfg.push_branch else ""))
    return 0


def _push_output(res, cfg) -> str:
    """Upload the run's output folder (``QuantizeResult.folder``, made for --card / --push-to-hub)."""
    from dynaquant.errors import InputError
    from dynaquant.pipeline.push import push_folder

    folder = getattr(res, "folder", None)
    if folder is None:
        raise InputError(f"--push-to-hub {cfg.push_to_hub}: this run made no output folder to publish ({res.output})")
    return push_folder(folder, cfg.push_to_hub, private=cfg.push_private, revision=cfg.push_branch)


def _push(a) -> int:
    from dynaquant.pipeline.push import push_folder

    url = push_folder(a.folder, a.repo_id, private=a.private, revision=a.revision)
    print(f"published {a.folder} to {url}" + (f" (branch {a.revision})" if a.revision else ""))
    return 0


def _fit_options(a) -> dict:
    """QuantizeConfig's fit_* fields from --fit-memory / --fit-ctx / --kv-type / --margin.

    Raises:
        ValueError: --fit-ctx, --kv-type or --margin without --fit-memory.
    """
    given = {k: v for k, v in (("fit_ctx", a.fit_ctx), ("kv_type", a.kv_type), ("margin", a.margin)) if v is not None}
    if a.fit_memory is None:
        if given:
            raise ValueError("--fit-ctx, --kv-type and --margin go with --fit-memory")
        return {}
    return {"fit_memory": a.fit_memory, **given}


def _names(text: str | None) -> tuple[str, ...]:
    """``'q4_k, Q8_0'`` -> ``('Q4_K', 'Q8_0')``; None -> ()."""
    return tuple(n.strip().upper() for n in text.split(",") if n.strip()) if text else ()


def _analyze(a) -> int:
    from dynaquant.analysis.calibration import CalibrationSpec
    from dynaquant.config import AnalyzeConfig
    from dynaquant.pipeline.analyze import run_analyze

    spec = CalibrationSpec(tuple(a.calibration), a.sequences, a.ctx, a.chat_template,
                           images=tuple(a.calibration_images))
    kw = {}
    if a.formats:
        from dynaquant.pipeline.analyze import expand_formats

        kw["candidates"] = expand_formats(a.formats)
    cfg = AnalyzeConfig(calibration=spec, fisher_sequences=a.fisher_sequences, super_weights=not a.no_super_weights,
                        sensitivity_formats=_names(a.sensitivity), validate_presets=_names(a.validate), device=a.device,
                        dtype=a.dtype, allow_pickle=a.allow_pickle, trust_remote_code=a.trust_remote_code,
                        progress=not a.json, allow_nonfinite=a.allow_nonfinite, correct_rounds=a.correct,
                        correct_sequences=a.correct_sequences, stream=a.stream, max_cpu_memory=a.max_cpu_memory,
                        max_gpu_memory=a.max_gpu_memory, offload_dir=a.offload_dir, **kw)
    res = run_analyze(a.model, a.output, cfg)
    if not distributed.group().main:  # a rank other than 0 of several (torchrun): rank 0 reports
        return 0
    rep = res.report
    if a.json:
        print(json.dumps({"report": str(res.report_path), "imatrix": str(res.imatrix_path),
                          "timings_s": rep["timings_s"], "super_weights": rep["super_weights"]}, indent=1))
        return 0
    print(f"wrote {res.report_path} and {res.imatrix_path}")
    c = rep["calibration"]
    print(f"  {c['n_sequences']} sequences x {c['seq_len']} tokens of {c['id']}, {len(rep['tensors'])} tensors, "
          f"{len(rep['candidates'])} candidate formats, {rep['timings_s']['total_s']:.1f} s")
    for sw in rep["super_weights"]:
        print(f"  super weight {'(confirmed) ' if sw['confirmed'] else '(rejected)  '}{sw['tensor']} [{sw['row']}, "
              f"{sw['column']}] = {sw['value']:.3f}: perplexity {sw['ppl_base']:.2f} -> {sw['ppl_ablated']:.2f} when zeroed")
    for p in rep["plans"]:
        print(f"  plan at {p['label']}: {p['size_bytes']} bytes, KLD predicted {p['kld_pred']:.5f}, "
              f"measured {p['kld_measured']:.5f}")
        if p.get("corrected"):
            c = p["corrected"]
            print(f"    corrected ({c['rounds']} measurements): {c['size_bytes']} bytes, KLD predicted {c['kld_pred']:.5f}, "
                  f"measured {c['kld_measured']:.5f}")
    return 0


def _plan(a) -> int:
    from dynaquant.pipeline.plan import load_plan, make_dynamic_plan

    if a.bpw is None and a.size is None:
        if not a.llama_quantize:
            a.subparser.error("one of the arguments --bpw --size is required (or --llama-quantize with a plan.json)")
        return _print_llama_quantize(load_plan(a.report), a.report, a.json)
    if a.llama_quantize and a.target != "gguf":
        a.subparser.error("--llama-quantize needs a gguf plan (llama-quantize writes GGUF files only)")
    plan = make_dynamic_plan(a.report, bpw=a.bpw, size=a.size, rules=a.rule, target=a.target,
                             default_rules_on=not a.no_default_rules, output=a.output, solver=a.solver)
    if a.json and not a.llama_quantize:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    if not a.json:
        print(f"wrote {a.output}: {plan.size_bytes} bytes of tensor data, {plan.bpw:.3f} bpw, "
              f"predicted KLD {plan.kld_pred or 0:.5f} ({plan.method})")
    return _print_llama_quantize(plan, a.output, a.json) if a.llama_quantize else 0


def _print_llama_quantize(plan, where, as_json: bool) -> int:
    """The plan as llama-quantize arguments: the shell command (MODEL-BF16.gguf / OUTPUT.gguf to replace), or JSON."""
    from dynaquant.exporters.gguf.llama_quantize import llama_quantize_args
    from dynaquant.pipeline.plan import plan_imatrix

    imatrix = plan_imatrix(plan, where)  # a relative sources.imatrix lies beside the plan file
    args = llama_quantize_args(plan, source=str(where), imatrix=str(imatrix) if imatrix is not None else None)
    if as_json:
        print(json.dumps(args.to_dict(), indent=1))
        return 0
    print(f"# {where} with llama.cpp: MODEL-BF16.gguf is the unquantized model (BF16/F16/F32 GGUF)")
    print(args.command())
    return 0


def render_report_cli(report_json_path, out_html=None, plan_json=None):
    """Check that the page (``out_html``, default ``report.html`` beside the report) replaces neither input, then
    write it with :func:`dynaquant.analysis.report.html.render_report_files` (same arguments); returns its Path.

    Raises:
        errors.InputError: the output is the report or the plan; and what ``render_report_files`` raises.
    """
    from pathlib import Path

    from dynaquant.analysis.report.html import render_report_files
    from dynaquant.pipeline.preflight import Output, check_outputs

    rp = Path(report_json_path)
    check_outputs([Output(Path(out_html) if out_html is not None else rp.with_name("report.html"))],
                  inputs={"report": rp, "plan": plan_json})  # before reading: the page must not replace an input
    return render_report_files(rp, out_html, plan_json)


def _report(a) -> int:
    out = render_report_cli(a.report, a.output, a.plan)
    print(f"wrote {out}")
    return 0


def _eval(a) -> int:
    from dynaquant.pipeline.evaluate import evaluate

    ev = evaluate(a.quantized, a.reference, text=a.text, n_ctx=a.ctx, chunks=a.chunks, device=a.device,
                  progress=not a.json)
    if a.json:
        print(json.dumps(ev.to_dict(), indent=1))
    else:
        print(f"{a.quantized}")
        _print_eval(ev)
    return 0


def _inspect(a) -> int:
    from dynaquant.exporters.gguf.inspect import inspect_gguf

    s = inspect_gguf(a.file)
    if a.json:
        print(json.dumps(s.to_dict(), indent=1))
        return 0
    print(f"{s.path}: {s.file_size_bytes / 1e6:.2f} MB, {len(s.tensors)} tensors, {s.bpw:.3f} bpw, "
          f"file type {s.file_type}")
    print(f"{'tensor':40s} {'type':7s} {'shape':>16s} {'bytes':>11s} {'bpw':>6s}")
    for t in s.tensors:
        print(f"{t.name:40s} {t.type:7s} {'x'.join(map(str, t.shape)):>16s} {t.size_bytes:11d} {t.bpw:6.2f}")
    print(f"\n{'layer':10s} {'bytes':>11s} {'bpw':>6s}  types")
    for k, lay in s.layers.items():
        types = ", ".join(f"{ty}" for ty in sorted(lay["types"]))
        print(f"{k:10s} {lay['size_bytes']:11d} {lay['bpw']:6.2f}  {types}")
    return 0


def _error_message(exc: BaseException) -> str:
    """One line for a bad-input error: the file (or option) and the problem."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if isinstance(exc, OSError) and exc.filename is not None:
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
        return f"{where}: {exc.strerror or exc}"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split()) if "\n" in text else text


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the exit status:

    - 0: success.
    - 2: bad input or environment: an ``errors.InputError`` (``checkpoint.SourceError``, ...), any other
      ``ValueError`` (``planner.BudgetError``, ...), a ``KeyError`` (an unknown format or preset), an ``OSError``
      (unwritable folder, full disk, missing file, ...), or a bad option (argparse); one line on stderr,
      ``dynaquant CMD: error: FILE: PROBLEM``, no traceback.
    - 130: interrupted (Ctrl-C): one line, ``dynaquant CMD: interrupted``; temporary files are removed
      (the writers' work folders unwind). SIGTERM unwinds the same way and exits 143.
    - 1: anything else is a bug in dynaquant: the traceback, then one line asking to report it.
    """
    argv = sys.argv[1:] if argv is None else argv
    a = _parser().parse_args(argv)
    # On SIGTERM, unwind normally so temporary output files are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rank = int(os.environ.get("RANK", "0"))  # torchrun: the ranks other than 0 log errors only, with their rank
    logging.basicConfig(level=logging.ERROR if rank else logging.INFO if a.verbose else logging.WARNING,
                        format=(f"[rank {rank}] " if rank else "") + "%(levelname)s %(name)s: %(message)s")
    try:
        if a.command == "quantize":
            bare = argv == ["quantize"]
            return _quantize(a, bare, argv)
        if a.command == "eval":
            return _eval(a)
        if a.command == "analyze":
            return _analyze(a)
        if a.command == "plan":
            return _plan(a)
        if a.command == "report":
            return _report(a)
        if a.command == "push":
            return _push(a)
        return _inspect(a)
    except (ValueError, KeyError, OSError) as exc:
        print(f"dynaquant {a.command}: error: {_error_message(exc)}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print(f"dynaquant {a.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:
        traceback.print_exc()
        print(f"dynaquant {a.command}: {BUG_REPORT}", file=sys.stderr)
        return EXIT_BUG
    finally:
        distributed.finish()


if __name__ == "__main__":
    sys.exit(main())
