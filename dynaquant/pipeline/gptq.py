"""GPTQ rounding in the tensor loop: per tensor, the rounding (GPTQ or plain) with the lower layer-output error on two
held-out calibration sequences (Frantar et al. 2022; :mod:`dynaquant.quant.gptq`)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from dynaquant.analysis.calibration import CalibrationSpec
from dynaquant.analysis.calibration import calibration_chunks as calibration_ids
from dynaquant.analysis.stats import Collect, collect, collect_stats, module_of
from dynaquant.distributed import group
from dynaquant.pipeline.source import kept_types
from dynaquant.quant.codecs import dequantize
from dynaquant.quant.codecs import quantize as encode_tensor
from dynaquant.quant.formats import Format
from dynaquant.quant.gptq import gptq_round, output_error, supports_gptq


class GPTQRounding:
    """GPTQ rounding per tensor, kept where it lowers the layer-output error on held-out calibration inputs."""

    def __init__(self, model, tokenizer, spec: CalibrationSpec, stats, damp: float, device, progress: bool,
                 timings: dict, *, fit=None, check=None):
        if model is None:  # statistics given (the block-wise sweep sets them block by block)
            self.fit, self.check, self.damp, self.device = fit, check, damp, device
            self.ratios, self.used, self.plain_only = {}, {}, {}
            return
        t0 = time.perf_counter()
        chunks = calibration_ids(tokenizer, replace(spec, n_sequences=spec.n_sequences + 2))
        if chunks.shape[0] < 3:
            raise ValueError(f"GPTQ needs at least 3 calibration sequences of {spec.seq_len} tokens; the text gives "
                             f"{chunks.shape[0]}")
        self.fit = stats if stats is not None else collect_stats(model, chunks[:-2], fisher_sequences=0, progress=progress)
        # the held-out check keeps its two sequences' input rows, not their H (a Llama-3-8B's 32 blocks: 3.5 GB
        # against 32 GB beside the fit's H, which overflowed an 80 GB GPU); H formed per tensor, the same bits
        self.check = collect(model, chunks[-2:], Collect(fisher_sequences=0, rows=True), progress=False)
        self.damp, self.device = damp, device
        self.offloaded = hessians_to_host(self.fit, device)
        if self.offloaded:
            timings["gptq_h_on_host_bytes"] = self.offloaded
        self.ratios: dict[str, list[float]] = {}
        self.used: dict[str, int] = {}
        self.plain_only: dict[str, int] = {}  # formats GPTQ does not round (supports_gptq False): encoded plainly
        timings["gptq_stats_s"] = time.perf_counter() - t0

    def encode(self, t, w: torch.Tensor, fmt: Format, imp, plain: torch.Tensor | None = None) -> torch.Tensor | None:
        """GGUF bytes of one tensor, or None where GPTQ does not apply (the caller encodes plainly). ``plain``: the
        tensor's plain rounding (``encode_tensor(w, fmt, imp)``'s bytes, (N, row bytes) uint8 on ``w``'s device)
        when the caller has it (the corrections' bytes); else it is encoded here."""
        module = module_of(t.hf_name)
        if module is None or module not in self.fit.input_of or w.ndim != 2 or t.gguf_name.startswith("token_embd"):
            return None
        if module not in self.check.input_of:  # a VL vision module: the held-out check is text only; plain rounding
            return None
        if not supports_gptq(fmt):
            self.record(fmt.name, None, False)
            return None
        h_fit = self.fit.input(module).hessian_on(self.device)
        h_check = self.check.input(module).hessian_on(self.device)
        plain = encode_tensor(w, fmt, imp) if plain is None else plain
        g = gptq_round(w, fmt, h_fit, imp, damp=self.damp)
        e_plain = output_error(w, dequantize(plain, fmt).to(w.device), h_check)
        e_gptq = output_error(w, g.decoded.to(w.device), h_check)
        self.record(fmt.name, e_gptq / e_plain if e_plain > 0 else 1.0, e_gptq < e_plain)
        return g.data if e_gptq < e_plain else plain

    def record(self, fmt: str, ratio: float | None, used: bool) -> None:
        """Count one tensor for :meth:`summary` (``ratio`` None: a format GPTQ does not round); the last one is
        :attr:`last` (the block-wise sweep over several ranks gathers them and replays them in order)."""
        self.last = (fmt, ratio, used)
        if ratio is None:
            self.plain_only[fmt] = self.plain_only.get(fmt, 0) + 1
            return
        self.ratios.setdefault(fmt, []).append(ratio)
        if used:
            self.used[fmt] = self.used.get(fmt, 0) + 1

    def summary(self) -> dict:
        """Per format: tensors tried, tensors that took GPTQ, mean held-out output-error ratio GPTQ / plain.

        Formats GPTQ does not round (``quant.gptq.supports_gptq``) appear with ``gptq`` 0, ``mean_ratio`` None
        and ``plain_only`` True: all their tensors were encoded plainly.
        """
        out = {f: {"tensors": len(r), "gptq": self.used.get(f, 0), "mean_ratio": round(sum(r) / len(r), 4)}
               for f, r in self.ratios.items()}
        for f, n in self.plain_only.items():
            out[f] = {"tensors": n, "gptq": 0, "mean_ratio": None, "plain_only": True}
        return out


def hessians_to_host(stats, device) -> int:
    """Move the whole-model GPTQ's (K, K) input sums to host memory when the GPU could not hold them twice over:
    its free memory (``torch.cuda.mem_get_info``, with them and the model on it) below their bytes, the room the later
    stages (the corrections' decoded weights, each tensor's rounding) then lack. Each goes back to the GPU when its
    tensors are rounded (:meth:`GPTQRounding.encode`): the same values. A float32 Llama-3-8B's are 33 GB beside its
    30 GB of weights: moved on an 80 GB H100, kept on a 141 GB H200. Returns the bytes moved (0: kept; not a CUDA
    device)."""
    dev = torch.device(device)
    held = [s for s in stats.inputs.values() if s.hessian_sum is not None and s.hessian_sum.device.type == "cuda"]
    total = sum(s.hessian_sum.numel() * s.hessian_sum.element_size() for s in held)
    if dev.type != "cuda" or not held or torch.cuda.mem_get_info(dev)[0] >= total:
        return 0
    for s in held:
        s.hessian_sum = s.hessian_sum.cpu()
    torch.cuda.empty_cache()
    return total


class StoredRounding:
    """The GPTQ rounding of a ``stream`` run, done block by block beforehand (:func:`gptq_blockwise`): ``encode``
    hands back the bytes kept in the work folder (None: plain rounding), ``summary`` the sweep's."""

    def __init__(self, rundir, summary: dict):
        self.rundir, self._summary = rundir, summary

    def encode(self, t, w: torch.Tensor, fmt: Format, imp, plain: torch.Tensor | None = None) -> torch.Tensor | None:
        """The sweep's bytes of ``t`` (GPTQ's where it won), or None (plain rounding); ``plain`` is not used: the
        sweep compared GPTQ with plain rounding already (:meth:`GPTQRounding.encode`'s signature)."""
        a = self.rundir.load_array(f"gptq/{t.gguf_name}.npy")
        return None if a is None else torch.from_numpy(a)

    def summary(self) -> dict:
        return self._summary


def gptq_blockwise(source, ts, tokenizer, spec: CalibrationSpec, plan, importance: dict, damp: float, device,
                   rundir, progress: bool, timings: dict, allow_nonfinite: bool = False) -> StoredRounding:
    """GPTQ rounding block by block (``stream``): one more block-wise pass over the calibration sequences (H of each
    block's inputs) carrying the two held-out sequences (their H: the check), each block's planned tensors rounded as
    :class:`GPTQRounding` rounds them while the block's statistics are at hand, the output head's at the end; the
    bytes go to the work folder (``gptq/NAME.npy``), where the tensor loop finds them. Same bytes as the whole-model
    rounding. A finished sweep (``gptq/summary.pt``) is not run again."""
    from dynaquant.analysis.blockwise import collect_blockwise
    from dynaquant.analysis.stats import Collect, ModelStats
    from dynaquant.names import TensorName
    from dynaquant.quant.formats import get_format
    from dynaquant.sources.nonfinite import check_finite, tensor_label
    from dynaquant.sources.skeleton import build_skeleton

    done = rundir.load("gptq/summary.pt")
    if done is not None:
        return StoredRounding(rundir, done["summary"])
    t0 = time.perf_counter()
    chunks = calibration_ids(tokenizer, replace(spec, n_sequences=spec.n_sequences + 2))
    if chunks.shape[0] < 3:
        raise ValueError(f"GPTQ needs at least 3 calibration sequences of {spec.seq_len} tokens; the text gives "
                         f"{chunks.shape[0]}")
    sk = build_skeleton(source, ts, device=device, allow_nonfinite=allow_nonfinite)
    check = ModelStats()
    rounding = GPTQRounding(None, None, spec, None, damp, device, progress, timings, check=check)
    by_name = {t.gguf_name: t for t in ts.tensors()}
    planned = {e.name: get_format(e.format) for e in plan.entries}

    def block_of(name: str):
        tn = TensorName.from_gguf(name)
        return tn.block if tn.tower == "text" else None

    order = {n: k for k, n in enumerate(sorted(planned, key=lambda n: (block_of(n) is None, block_of(n) or 0)))}
    grp = group()  # several ranks: each block's tensors split between them, their counts replayed in order
    records: list[tuple[int, tuple]] = []  # (position in the single process's order, GPTQRounding.last)

    kept = kept_types(ts, allow_nonfinite)  # the file keeps the source's bytes of those in their stored type

    # several ranks: seconds and weights each format's tensors took so far, every rank's (gathered after each block,
    # so the same on all): a tensor's cost is its weights times its format's seconds a weight (GPTQ's scale search
    # makes a K-quant tensor many times slower than a Q8_0 one of the same size); before a format's first tensor, the
    # mean over the formats timed, or 1 (the assignment does not change the bytes, only the ranks' balance)
    spent: dict[str, list[float]] = {}

    def cost(name: str) -> float:
        rates = {f: s / w for f, (s, w) in spent.items() if w > 0}
        rate = rates.get(planned[name].name, sum(rates.values()) / len(rates) if rates else 1.0)
        return by_name[name].numel * rate

    def round_tensors(names: list[str]) -> None:
        names = [n for n in names if planned[n].kind != "float" and kept.get(n) != planned[n].name]
        took: dict[str, list[float]] = {}
        for k in grp.mine([cost(n) for n in names]):
            name = names[k]
            t, fmt = by_name[name], planned[name]
            t0 = time.perf_counter()
            w = check_finite(ts.read(t), tensor_label(t.hf_name, t.gguf_name), ts.file_of(t), allow_nonfinite)
            rounding.last = None
            q = rounding.encode(t, w.to(device), fmt, importance.get(name))
            if rounding.last is not None:
                records.append((order[name], rounding.last))
            if q is not None:
                rundir.save_array(f"gptq/{name}.npy", q.cpu().numpy())
            if grp.active:
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize(device)
                d = took.setdefault(fmt.name, [0.0, 0.0])
                d[0], d[1] = d[0] + time.perf_counter() - t0, d[1] + t.numel
        for part in grp.gather(took) if grp.active else ():
            for f, (sec, n) in part.items():
                d = spent.setdefault(f, [0.0, 0.0])
                d[0], d[1] = d[0] + sec, d[1] + n

    def on_block(i: int, st) -> None:
        rounding.fit = st
        round_tensors([n for n in planned if block_of(n) == i])
        modules = [m for m in st.input_of if TensorName.from_hf(m).block == i]
        st.drop_hessians(modules)
        check.drop_hessians([m for m in check.input_of if TensorName.from_hf(m).block == i])

    st = collect_blockwise(sk, chunks[:-2], Collect(fisher_sequences=0), progress=progress,
                           on_block=on_block, riders=(chunks[-2:], check))
    rounding.fit = st
    round_tensors([n for n in planned if block_of(n) is None])
    if grp.active:  # the counts of every rank's tensors, in the single process's order (the gather: all are done)
        rounding.ratios, rounding.used, rounding.plain_only = {}, {}, {}
        for _, rec in sorted(x for part in grp.gather(records) for x in part):
            rounding.record(*rec)
    summary = rounding.summary()
    if grp.main:
        rundir.save("gptq/summary.pt", {"summary": summary})
    timings["gptq_s"] = time.perf_counter() - t0
    return StoredRounding(rundir, summary)
