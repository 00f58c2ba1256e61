"""The analysis block by block: the report of :func:`dynaquant.pipeline.analyze.run_analysis` without the whole model
in memory (issue 15, models larger than memory).

The model is a meta-device skeleton (:mod:`dynaquant.sources.skeleton`); the calibration runs block by block
(:func:`dynaquant.analysis.blockwise.collect_blockwise`). Each decoder block, while it is in memory after its
forward sweep, has its tensors' errors measured for every candidate format (rows sampled by output energy, each
sampled row's output error kept: :class:`dynaquant.analysis.errors.RowErrors`), its super-weight candidates taken,
and its (K, K) second moments dropped (the diagonals, the imatrix, are kept). Once the backward sweep has the
Fisher diagonals, every block's predicted KL divergences follow; the token embedding and output head (the outer
part, in memory throughout) are measured last, as the whole-model analysis measures them. Super-weight candidates
are confirmed by ablation in one more block-wise pass (:func:`dynaquant.analysis.superweights.confirm_blockwise`).

Memory: the outer part, one block's weights, one block's (K, K) matrices and the hidden states
(:func:`dynaquant.analysis.blockwise.hidden_bytes`). Not yet block-wise (they need the whole model): sensitivity
rows, plan validation and measured corrections. A vision-language model's vision tower and projector belong to the
outer part (in memory throughout, its statistics gathered by the image + text items of the calibration and measured
last, with the embedding and head).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from dynaquant.analysis import experts
from dynaquant.analysis.blockwise import collect_blockwise, hidden_bytes
from dynaquant.analysis.calibration import CalibrationSpec, calibration_chunks
from dynaquant.analysis.errors import SAMPLE_FRACTION, RowErrors, RowWeights, TensorError, measure_samples, sample_tensor
from dynaquant.analysis.sensitivity import tf32_matmuls
from dynaquant.analysis.stats import Collect, ModelStats, module_of, stats_from_state, stats_state
from dynaquant.analysis.superweights import SuperWeight, confirm_blockwise, find_candidates
from dynaquant.config import DEFAULT_CANDIDATES
from dynaquant.distributed import group
from dynaquant.errors import InputError
from dynaquant.names import TensorName
from dynaquant.pipeline.analysis_report import (
    AnalysisResult,
    build_report,
    layer_of,
    row_weights_of,
    tensor_entry,
    weight_of,
)
from dynaquant.pipeline.source import kept_types, model_info
from dynaquant.sources.experts import stacked_name
from dynaquant.sources.gguf import TensorSource
from dynaquant.sources.skeleton import build_skeleton

log = logging.getLogger(__name__)

MAX_SUPER_WEIGHTS = 8  # candidates confirmed by ablation (find_candidates' default)
DONE = "analysis/done.pt"  # the finished analysis in a work folder: report and statistics


def _module_block(module: str) -> int | None:
    tn = TensorName.from_hf(module)
    return tn.block if tn.tower == "text" else None


def run_blockwise_analysis(source, ts: TensorSource, tokenizer, spec: CalibrationSpec, *, device: str,
                           dtype: torch.dtype = torch.float32, candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
                           fisher_sequences: int = 16, super_weights: bool = True, overhead_bytes: int = 0,
                           progress: bool = True, timings: dict | None = None, rundir=None,
                           max_cpu_memory: int | None = None, max_gpu_memory: int | None = None,
                           offload_dir: str | os.PathLike | None = None, allow_nonfinite: bool = False,
                           sample_fraction: int = SAMPLE_FRACTION) -> AnalysisResult:
    """Analyse a model block by block (see the module docstring); the arguments are ``run_analysis``'s, the model
    being built here from ``source`` and ``ts`` on ``device`` in ``dtype``; ``rundir`` (a
    :class:`dynaquant.pipeline.rundir.RunDir`): checkpoints there, continuing from the latest (the result is an
    uninterrupted run's, bit for bit), and the finished analysis kept there (reused as is). Memory
    (:func:`memory_plan`): the hidden states go to files in ``offload_dir`` (default: ``rundir``'s ``offload``) when
    they would exceed ``max_cpu_memory`` bytes (default: half the memory available now); a MoE block whose weights exceed
    ``max_gpu_memory`` (with the outer part) keeps its experts as stored, and one that still exceeds it is refused
    before any work. NaN / Inf weights: refused when read
    (``InputError`` naming the tensor), or replaced with ``allow_nonfinite``.

    Returns:
        AnalysisResult: the same report layout as ``run_analysis``; its ``stats`` hold no (K, K) matrices (GPTQ
        recomputes them block by block).
    Raises:
        ValueError: what ``run_analysis`` raises.
    """
    timings = {} if timings is None else timings
    if rundir is not None and (done := rundir.load(DONE)) is not None:
        stats = stats_from_state(done["stats"])
        return AnalysisResult(done["report"], stats, stats.to_imatrix(spec.id))
    t0 = time.perf_counter()
    stored = kept_types(ts, allow_nonfinite)  # a GGUF source's stored types: error 0
    all_chunks = calibration_chunks(tokenizer, replace(spec, n_sequences=spec.n_sequences + 2))
    held = all_chunks[-2:] if all_chunks.shape[0] > 2 else all_chunks[:1]
    chunks = all_chunks[:-2] if all_chunks.shape[0] > 2 else all_chunks
    samples = chunks
    if getattr(ts, "vision", False):  # a VL source: image + text items first, as the whole-model analysis
        from dynaquant.analysis.vl_calibration import vl_calibration_samples

        samples = vl_calibration_samples(ts.folder, tokenizer, chunks, spec.images, spec.n_images,
                                         trust_remote_code=source.trust_remote_code)
    grp = group()  # several ranks: the sequences and each block's tensors split between them (dynaquant.distributed)
    sk = build_skeleton(source, ts, dtype=dtype, device=device, allow_nonfinite=allow_nonfinite)
    if offload_dir is None and rundir is not None:
        offload_dir = rundir.file("offload")
    if offload_dir is not None and grp.active:
        offload_dir = Path(offload_dir) / f"rank-{grp.rank}"
    longest = max(x["input_ids"].shape[1] for x in samples) if isinstance(samples, list) else chunks.shape[1]
    offload = memory_plan(sk, len(samples), longest, min(fisher_sequences, len(samples)),
                          max_cpu_memory=max_cpu_memory, max_gpu_memory=max_gpu_memory,
                          offload_dir=offload_dir, checkpoints=rundir is not None)
    info = model_info(ts)
    src_tensors = ts.tensors()
    entries = [tensor_entry(t, set()) for t in src_tensors]
    by_block: dict[int, list[int]] = {}
    for j, t in enumerate(src_tensors):
        if (b := layer_of(t.gguf_name)) is not None:
            by_block.setdefault(b, []).append(j)
    pending: list[tuple[int, str | None, object]] = []  # (entry, module or None for experts, RowErrors / per expert)
    cands = []
    spent = [0.0]

    fmt_cost = {f: 1.0 for f in candidates}  # seconds each format took on the last block, the same on every rank

    def measure(samples: list, per_row: bool) -> list[dict]:
        """measure_samples; with several ranks the candidate formats are split between them by the time each took on
        the last block (a format's results do not depend on the others measured with it) and gathered."""
        if not grp.active:
            return measure_samples(samples, list(candidates), per_row=per_row)
        order = grp.assign([fmt_cost[f] for f in candidates])
        res: list[dict] = [{} for _ in samples]
        took = {}
        for f in [f for f, r in zip(candidates, order) if r == grp.rank]:
            t0 = time.perf_counter()
            for d, r in zip(res, measure_samples(samples, [f], per_row=per_row)):
                d.update(r)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            took[f] = time.perf_counter() - t0
        parts = grp.gather((res, took))
        for _, t in parts:
            fmt_cost.update(t)
        out = []
        for a in range(len(samples)):  # each sample's formats from every rank, in the candidates' order
            got = {k: v for rr, _ in parts for k, v in rr[a].items()}
            out.append({f: got[f] for f in candidates if f in got})
        return out

    def on_block(i: int, st: ModelStats) -> None:
        t1 = time.perf_counter()
        if super_weights:  # the text block's (a vision tower's layers: once, below)
            cands.extend(find_candidates(sk.model, st, layer=i, max_candidates=1 << 30, text=True))
        samples, owners, modules = [], [], set()
        work = [j for j in by_block.get(i, []) if src_tensors[j].quantizable]
        for j in work:  # (several ranks: every tensor sampled here, the candidate formats split in measure)
            t = src_tensors[j]
            stacked = stacked_name(t.hf_name)
            modules.add(stacked[0] if stacked else module_of(t.hf_name))
            if stacked and stacked[0] in st.experts:
                es = st.experts[stacked[0]]
                ss, _ = experts.expert_samples(sk.model.get_submodule(stacked[0]), stacked[1], es, total_tokens=0,
                                               fisher_total=0, defer_fisher=True, fraction=sample_fraction)
                owners.append((j, None, len(samples), len(samples) + len(ss)))
                samples += ss
                continue
            w = weight_of(sk.model, t)
            rw, imp = row_weights_of(t, st, info.tied_embeddings, st.token_counts)
            if w is None or rw is None or tuple(w.shape) != tuple(t.shape):
                log.warning("%s: no calibration statistics or weight shape mismatch; not measured", t.gguf_name)
                continue
            owners.append((j, module_of(t.hf_name), len(samples), len(samples) + 1))
            samples.append(sample_tensor(w.detach(), RowWeights(hessian=rw.hessian), imatrix=imp, score="output",
                                         stored=stored.get(t.gguf_name), fraction=sample_fraction))
        with tf32_matmuls(device, enabled=False):  # the errors in full float32, as the whole-model analysis measures
            results = measure(samples, per_row=True)
        pending.extend((j, module, results[a] if module is not None else results[a:b]) for j, module, a, b in owners)
        st.drop_hessians(modules | {m for m in [*st.input_of, *st.experts] if _module_block(m) == i})  # routers too
        spent[0] += time.perf_counter() - t1

    def get_state() -> dict:
        return {"pending": [[j, module, _rows_state(res)] for j, module, res in pending],
                "candidates": [dataclasses.asdict(c) for c in cands], "spent": spent[0]}

    def set_state(state: dict) -> None:
        pending[:] = [(j, module, _rows_from_state(res)) for j, module, res in state["pending"]]
        cands[:] = [SuperWeight(**c) for c in state["candidates"]]
        spent[0] = state["spent"]

    from dynaquant.pipeline.rundir import RankCheckpoints, checkpoint_interval_s

    ckpts = rundir  # (several ranks: each its own, restarting at a step all of them completed)
    if rundir is not None and grp.active:
        ckpts = RankCheckpoints(rundir, grp)
    with tf32_matmuls(device):  # the calibration passes on TF32, as run_analysis's (the errors: full float32, above)
        stats = collect_blockwise(sk, samples, Collect(fisher_sequences=fisher_sequences), progress=progress,
                                  on_block=on_block, checkpoints=ckpts, checkpoint_every=checkpoint_interval_s(),
                                  extra=(get_state, set_state), offload_dir=offload)
    timings["calibration_s"] = time.perf_counter() - t0 - spent[0]
    log_gpu_peak(device, "calibration and the blocks' errors")
    t2 = time.perf_counter()
    for j, module, res in pending:  # the Fisher is known now: the predicted KL divergences
        t = src_tensors[j]
        if module is None:
            name, proj = stacked_name(t.hf_name)
            es = stats.experts[name]
            errs = experts.expert_errors_with_fisher(es, proj, res, total_tokens=stats.tokens,
                                                     fisher_total=stats.fisher_tokens)
            fallback = [e for e in range(es.n_expert) if es.tokens[e] == 0 or es.fisher_tokens[e] == 0]
            entries[j]["experts"] = {"n_expert": es.n_expert, "fallback": fallback}
            if fallback:
                log.warning("%s: experts %s saw no calibration tokens (or none with gradients): measured with the "
                            "layer's pooled statistics", t.gguf_name, fallback)
        else:
            fisher = stats.outputs[module].fisher
            errs = {f: re.with_fisher(fisher) for f, re in res.items()}
        entries[j]["errors"] = {f: v.to_dict() for f, v in errs.items()}
    outer = [j for j, t in enumerate(src_tensors) if layer_of(t.gguf_name) is None and t.quantizable]
    samples, owners = [], []
    for j in outer:  # token embedding, output head (in memory throughout): measured with their Fisher at hand
        t = src_tensors[j]
        w = weight_of(sk.model, t)
        rw, imp = row_weights_of(t, stats, info.tied_embeddings, stats.token_counts)
        if w is not None and rw is not None and tuple(w.shape) == tuple(t.shape):
            owners.append(j)
            samples.append(sample_tensor(w.detach(), rw, imatrix=imp, stored=stored.get(t.gguf_name),
                                         fraction=sample_fraction))
        else:
            log.warning("%s: no calibration statistics or weight shape mismatch; not measured", t.gguf_name)
    for j, errs in zip(owners, measure(samples, per_row=False)):
        entries[j]["errors"] = {f: v.to_dict() for f, v in errs.items()}
    timings["errors_s"] = spent[0] + time.perf_counter() - t2
    t3 = time.perf_counter()
    sws = []
    if super_weights:  # a vision tower's candidates (outer part: its statistics are complete)
        cands.extend(find_candidates(sk.model, stats, max_candidates=1 << 30, text=False))
    if super_weights and cands:
        cands.sort(key=lambda s: -s.spike_ratio)
        sws = confirm_blockwise(sk, cands[:MAX_SUPER_WEIGHTS], held[:1])
        gguf_of_param = {t.hf_name: t.gguf_name for t in src_tensors if t.hf_name}
        for s in sws:
            s.tensor = gguf_of_param.get(s.module + ".weight")
        confirmed = {s.tensor for s in sws if s.confirmed and s.tensor}
        for e in entries:
            e["super_weight"] = e["name"] in confirmed
    timings["super_weights_s"] = time.perf_counter() - t3
    report = build_report(source, ts, spec, stats, entries, sws, candidates, device=device, dtype=dtype,
                          overhead_bytes=overhead_bytes, timings=timings)
    report["calibration"]["blockwise"] = True
    if rundir is not None and grp.main:
        rundir.save(DONE, {"report": report, "stats": stats_state(stats)})
    return AnalysisResult(report, stats, stats.to_imatrix(spec.id))


def log_gpu_peak(device, stage: str) -> None:
    """Log the peak GPU memory allocated so far (``torch.cuda.max_memory_allocated``) after ``stage``."""
    if torch.device(device).type == "cuda":
        log.info("peak GPU memory after %s: %.2f GiB", stage, torch.cuda.max_memory_allocated(device) / 2**30)


def available_memory() -> int:
    """Bytes of physical memory available now (``/proc/meminfo`` MemAvailable; else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_plan(sk, n_seq: int, seq_len: int, fisher_sequences: int, *, max_cpu_memory: int | None,
                max_gpu_memory: int | None, offload_dir, checkpoints: bool):
    """Where the block-wise pass keeps its hidden states: None (in memory) or ``offload_dir`` (files), computed from the
    shapes: the current hidden states, plus the Fisher sequences' input of every block unless checkpoints keep those
    on disk (:func:`dynaquant.analysis.blockwise.hidden_bytes`), against ``max_cpu_memory`` (default: half of
    :func:`available_memory`).

    On a CUDA device with ``max_gpu_memory``, the skeleton's parts are fitted to it
    (:meth:`dynaquant.sources.skeleton.ModelSkeleton.fit`: a MoE block's routed experts kept as the checkpoint stores
    them where the block does not fit in float32).

    Raises:
        InputError: on a CUDA device, the outer part plus the largest block exceed ``max_gpu_memory`` even with its
            experts as stored (named, with their sizes); or the hidden states must be offloaded and no folder was
            given.
    """
    hidden = sk.model.get_input_embeddings().weight.shape[1]
    need = hidden_bytes(n_seq, seq_len, hidden, 0 if checkpoints else sk.n_blocks, 0 if checkpoints else fisher_sequences)
    limit = max_cpu_memory if max_cpu_memory is not None else available_memory() // 2
    if max_gpu_memory is not None and sk.device.type == "cuda":
        sk.fit(max_gpu_memory)  # MoE experts kept as stored where a block does not fit otherwise
    if need <= limit:
        return None
    if offload_dir is None:
        raise InputError(f"the calibration's hidden states need {need / 2**30:.2f} GiB, over --max-cpu-memory "
                         f"{limit / 2**30:.2f} GiB: give --offload-dir (or --work-dir)")
    log.info("hidden states (%.2f GiB) kept in files under %s", need / 2**30, offload_dir)
    return Path(offload_dir)


def _rows_state(res):
    """RowErrors (a format -> RowErrors dict, or a list of them: experts) as plain state."""
    if isinstance(res, list):
        return [_rows_state(r) for r in res]
    return {f: {"error": dataclasses.asdict(r.error), "index": r.index, "weights": r.weights, "out_err": r.out_err}
            for f, r in res.items()}


def _rows_from_state(state):
    if isinstance(state, list):
        return [_rows_from_state(r) for r in state]
    return {f: RowErrors(TensorError(**r["error"]), r["index"], r["weights"], r["out_err"]) for f, r in state.items()}
