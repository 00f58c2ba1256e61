"""Quality benchmark: dynaquant presets against llama.cpp's own quantizer, same mixes, same data.

Source model: a dithered BF16 copy of the default model (see ``make_dithered.py``), so that
no format gets the original Q4_1 grid for free. Calibration on ``--calibration``, evaluation
on ``--eval-text`` (never the reverse), ``--chunks`` chunks of ``--n-ctx`` tokens for both.

For each mix (``Q8_0 Q6_K Q5_K_M Q4_K_M Q3_K_M Q2_K`` by default):

* dynaquant: ``dynaquant.quantize(dithered, preset=mix, calibration=...)``; quality measured
  by ``dynaquant.evaluate`` (PyTorch, ``kld_mean_torch`` ...) and by ``llama-perplexity
  --kl-divergence`` against the dithered model's logits (``kld_mean`` ...).
* llama.cpp: ``llama-imatrix`` on the same calibration text (once), then ``llama-quantize
  --imatrix``; measured by ``llama-perplexity --kl-divergence`` the same way.

With ``--methods ...,hand,dynamic,dynamic-greedy`` (the planner's benchmark, issue 19), at each size of
``--dynamic-mixes`` (the llama.cpp mix's file size; default the six sizes Q4_K_M .. IQ1_S):

* hand: ``llama-quantize --imatrix`` with a careful person's per-tensor overrides (:data:`HAND`);
* dynamic: ``dynaquant.quantize(size=...)`` from one shared analysis, exact solver, ``--correct-rounds`` rounds of
  measured corrections on ``--correct-sequences`` held-out calibration sequences (the row keeps the solver's gap
  and each round's predicted / measured KLD on those sequences: ``heldout_first``, ``heldout_final``);
* dynamic-exact: the exact solver without measured corrections;
* dynamic-greedy: the same analysis planned as before issue 19 (greedy allocation, no corrections);
* dynamic-gptq: as dynamic, GPTQ-rounded;
* dynamic-stream: as dynamic-exact, from the block-by-block analysis (``analyze(stream=True)``, its own report):
  the check that streaming keeps the plans' quality.

``--eval-text2`` adds a second, different evaluation text for the hand and dynamic rows (``*_eval2``), the check
that a dynamic plan's gain is the method's and not one text's.

Output: a JSON list of rows, written after every row to ``--out``: first a header row
(``"row": "header"``: machine, versions, configuration, the dithered model's perplexity,
whether llama.cpp ran and, at the end, ``ratios``: per mix dynaquant/llama.cpp for KLD mean,
KLD p99 and size, all measured in this run), then one ``"row": "result"`` per (method, mix).
A readable table is printed at the end. Without the llama.cpp tools (``--llama-bin``) the
llama.cpp rows and the llama-perplexity figures are skipped and the header says why.

Usage (CPU-heavy; be nice to neighbours):
    python tests/llama_tools.py --all   # once: the pinned llama.cpp's tools into the default --llama-bin
    nice python benchmarks/quality.py [--llama-bin /path/to/llama.cpp/build/bin] [--chunks 32] [--mixes Q4_K_M,Q2_K]
    python benchmarks/quality.py --device cuda --methods llama.cpp,hand,dynamic,dynamic-greedy --mixes '' \
        --eval-text2 /usr/share/common-licenses/GPL-3     # the planner's six sizes
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.metadata
import json
import logging
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # llama_tools: the pinned llama.cpp's tools

import llama_tools  # noqa: E402
from make_dithered import DEFAULT_OUT as DEFAULT_DITHERED  # noqa: E402
from make_dithered import make_dithered  # noqa: E402

import dynaquant  # noqa: E402

MIXES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # ../shared/data beside the checkout
DEFAULT_LLAMA_BIN = llama_tools.bin_dir()  # built by `python tests/llama_tools.py --all`
LLAMA_TOOLS = ("llama-quantize", "llama-perplexity", "llama-imatrix")

log = logging.getLogger("quality")


# ---------------------------------------------------------------------------------------------
# environment


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit(repo: Path) -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info() -> dict:
    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(), "machine": platform.machine(), "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(), "cpu_affinity": affinity, "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "niceness": os.nice(0), "loadavg_start": list(os.getloadavg()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def llama_tools(bin_dir: Path | None) -> tuple[dict[str, Path] | None, str | None]:
    """({tool: path}, None) when every tool is there, else (None, why not)."""
    if bin_dir is None:
        return None, "no --llama-bin given"
    missing = [t for t in LLAMA_TOOLS if not os.access(bin_dir / t, os.X_OK)]
    if missing:
        return None, (f"{bin_dir}: missing {', '.join(missing)} "
                      f"(python tests/llama_tools.py --all builds them into {DEFAULT_LLAMA_BIN})")
    return {t: bin_dir / t for t in LLAMA_TOOLS}, None


def llama_version(tools: dict[str, Path]) -> str | None:
    """llama.cpp's ``version: N (commit)`` line, e.g. ``"1 (0c1e570)"``."""
    try:
        p = subprocess.run([str(tools["llama-perplexity"]), "--version"], capture_output=True, text=True, timeout=60,
                           check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version:\s*(.+)", p.stdout + p.stderr)
    return m.group(1).strip() if m else None


def versions(tools: dict[str, Path] | None) -> dict:
    import torch

    return {
        "dynaquant": dynaquant.__version__, "dynaquant_git": _git_commit(HERE.parent),
        "torch": torch.__version__, "gguf": _version("gguf"), "transformers": _version("transformers"),
        "numpy": _version("numpy"), "llama_cpp": llama_version(tools) if tools else None,
    }


# ---------------------------------------------------------------------------------------------
# files


def file_stats(path: Path) -> dict:
    """Size, bits per weight over tensor data (metadata excluded; the same count for every file)
    and the number of tensors per GGML type."""
    reader = gguf.GGUFReader(str(path))
    n_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    n_elem = sum(int(t.n_elements) for t in reader.tensors)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"size_bytes": path.stat().st_size, "bpw": 8 * n_bytes / n_elem, "tensor_types": dict(sorted(types.items()))}


# ---------------------------------------------------------------------------------------------
# llama.cpp


class ToolError(RuntimeError):
    pass


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_tool(cmd: list[str], log_path: Path, timeout_s: float | None) -> tuple[str, float, float]:
    """Run a llama.cpp tool, output (stdout+stderr) to ``log_path``; (output, wall seconds, CPU seconds)."""
    log.info("$ %s", " ".join(cmd))
    t0, c0 = time.perf_counter(), _children_cpu_s()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                           timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        log_path.write_text(out)
        raise ToolError(f"{Path(cmd[0]).name} timed out after {timeout_s} s (log: {log_path})") from e
    dt, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
    log_path.write_text(p.stdout)
    if p.returncode != 0:
        tail = "\n".join(p.stdout.splitlines()[-15:])
        raise ToolError(f"{Path(cmd[0]).name} exited {p.returncode} (log: {log_path}):\n{tail}")
    return p.stdout, dt, cpu


_NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf)"
_KLD_PATTERNS = {
    "ppl": rf"Mean PPL\(Q\)\s*:\s*{_NUM}",
    "ppl_base": rf"Mean PPL\(base\)\s*:\s*{_NUM}",
    "kld_mean": rf"Mean\s+KLD:\s*{_NUM}",
    "kld_max": rf"Maximum KLD:\s*{_NUM}",
    "kld_p99": rf"99\.0%\s+KLD:\s*{_NUM}",
    "top1": rf"Same top p:\s*{_NUM}",
}


def parse_kld_output(text: str) -> dict:
    """Figures of a ``llama-perplexity --kl-divergence`` run; ``top1`` as a fraction.

    Raises:
        ToolError: a figure is missing (fewer than 100 scored tokens prints no statistics).
    """
    out = {}
    for key, pat in _KLD_PATTERNS.items():
        m = re.search(pat, text)
        if m is None:
            raise ToolError(f"llama-perplexity output has no {key!r} line ({pat})")
        out[key] = float(m.group(1))
    out["top1"] /= 100.0
    return out


def parse_ppl_output(text: str) -> float | None:
    m = re.search(rf"Final estimate: PPL = {_NUM}", text)
    return float(m.group(1)) if m else None


class Llama:
    """The llama.cpp side: base logits, imatrix, quantize and KLD runs."""

    def __init__(self, tools: dict[str, Path], work: Path, n_ctx: int, chunks: int, threads: int,
                 timeout_s: float | None, base_suffix: str = ""):
        self.tools, self.work, self.n_ctx, self.chunks, self.threads = tools, work, n_ctx, chunks, threads
        self.timeout_s = timeout_s
        self.base_kld = work / f"base{base_suffix}.kld"
        self.imatrix = work / "imatrix.gguf"

    def _common(self) -> list[str]:
        return ["-c", str(self.n_ctx), "--chunks", str(self.chunks), "-t", str(self.threads)]

    def make_base(self, model: Path, eval_text: Path, reuse: bool) -> dict:
        if reuse and self.base_kld.is_file():
            return {"reused": str(self.base_kld)}
        out, dt, cpu = run_tool([str(self.tools["llama-perplexity"]), "-m", str(model), "-f", str(eval_text),
                            "--kl-divergence-base", str(self.base_kld), *self._common()],
                           self.work / f"base{self.base_kld.stem.removeprefix('base')}.log", self.timeout_s)
        return {"ppl": parse_ppl_output(out), "time_s": round(dt, 2), "cpu_s": round(cpu, 2)}

    def make_imatrix(self, model: Path, calibration: Path, reuse: bool) -> dict:
        if reuse and self.imatrix.is_file():
            return {"reused": str(self.imatrix)}
        _, dt, cpu = run_tool([str(self.tools["llama-imatrix"]), "-m", str(model), "-f", str(calibration),
                               "-o", str(self.imatrix), *self._common()], self.work / "imatrix.log", self.timeout_s)
        return {"time_s": round(dt, 2), "cpu_s": round(cpu, 2)}

    def quantize(self, model: Path, mix: str, out: Path, extra: list[str] = (), label: str = "") -> tuple[float, float]:
        """(wall seconds, CPU seconds) of ``llama-quantize --imatrix [extra overrides]``."""
        _, dt, cpu = run_tool([str(self.tools["llama-quantize"]), "--imatrix", str(self.imatrix), *extra, str(model), str(out),
                               mix, str(self.threads)], self.work / f"quantize-{label or 'llama.cpp-' + mix}.log",
                              self.timeout_s)
        return dt, cpu

    def kld(self, model: Path, label: str) -> dict:
        out, dt, cpu = run_tool([str(self.tools["llama-perplexity"]), "-m", str(model),
                                 "--kl-divergence-base", str(self.base_kld), "--kl-divergence", *self._common()],
                           self.work / f"kld-{label}.log", self.timeout_s)
        res = parse_kld_output(out)
        res["kld_time_s"], res["kld_cpu_s"] = round(dt, 2), round(cpu, 2)
        return res


# ---------------------------------------------------------------------------------------------
# the benchmark


def _row(method: str, mix: str) -> dict:
    return {"row": "result", "method": method, "mix": mix, "size_bytes": None, "bpw": None, "kld_mean": None,
            "kld_p99": None, "ppl": None, "top1": None, "kld_mean_torch": None, "quantize_time_s": None,
            "quantize_cpu_s": None}


def ratios(rows: list[dict], mixes: list[str]) -> dict:
    """Per mix: dynaquant / llama.cpp for KLD mean, KLD p99 (llama-perplexity both), size, quantize wall and CPU time."""
    by = {(r["method"], r["mix"]): r for r in rows if r.get("row") == "result"}
    out = {}
    for mix in mixes:
        dq, lc = by.get(("dynaquant", mix)), by.get(("llama.cpp", mix))
        if not dq or not lc:
            continue
        entry = {}
        for key, name in (("kld_mean", "kld_mean"), ("kld_p99", "kld_p99"), ("size_bytes", "size"),
                          ("quantize_time_s", "quantize_time"), ("quantize_cpu_s", "quantize_cpu")):
            a, b = dq.get(key), lc.get(key)
            entry[name] = round(a / b, 4) if a is not None and b else None
        out[mix] = entry
    for mix in mixes:  # dynamic plans against the llama.cpp mix, the hand allocation and the greedy planner at that size
        for m in DYNAMIC_METHODS:
            dyn = by.get((m, mix))
            if not dyn:
                continue
            for base in ("llama.cpp", "hand", "dynamic-greedy"):
                b = by.get((base, mix))
                if base == m:
                    continue
                for key in ("kld_mean", "kld_p99", "kld_mean_eval2", "top1"):
                    if b and dyn.get(key) is not None and b.get(key):
                        out.setdefault(f"{m}/{base} {mix}", {})[key] = round(dyn[key] / b[key], 4)
    return out


def write_json(path: Path, header: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps([header, *rows], indent=1) + "\n")
    os.replace(tmp, path)


def run_dynaquant(mix: str, dithered: Path, args, llama: Llama | None) -> dict:
    row = _row("dynaquant", mix)
    out = args.work_dir / f"dynaquant-{mix}.gguf"
    kw = {"preset": mix, "calibration": args.calibration, "calibration_chunks": args.chunks, "n_ctx": args.n_ctx,
          "output": out, "device": args.device, "progress": False}
    t0, c0 = time.perf_counter(), time.process_time()
    if args.profile:
        prof = cProfile.Profile()
        res = prof.runcall(dynaquant.quantize, str(dithered), **kw)
        prof.dump_stats(str(args.work_dir / f"quantize-{mix}.prof"))
    else:
        res = dynaquant.quantize(str(dithered), **kw)
    row["quantize_time_s"] = round(time.perf_counter() - t0, 2)
    row["quantize_cpu_s"] = round(time.process_time() - c0, 2)  # all threads of this process
    row["quantize_timings_s"] = {k: round(v, 2) for k, v in res.timings_s.items()}
    row["bpw_plan"] = round(res.bpw, 4)
    row.update(file_stats(out))
    log.info("dynaquant %s: %d bytes in %.1f s %s", mix, row["size_bytes"], row["quantize_time_s"],
             row["quantize_timings_s"])
    if llama is not None:
        try:
            row.update(llama.kld(out, f"dynaquant-{mix}"))
        except ToolError as e:
            row["error_llama_perplexity"] = str(e)
            log.error("%s", e)
    if not args.no_torch_eval:
        t1, c1 = time.perf_counter(), time.process_time()
        ev = dynaquant.evaluate(out, dithered, text=args.eval_text, n_ctx=args.n_ctx, chunks=args.chunks,
                                device=args.device, progress=False)
        row.update({"kld_mean_torch": ev.kld_mean, "kld_p99_torch": ev.kld_p99, "ppl_torch": ev.ppl,
                    "ppl_reference_torch": ev.ppl_reference, "top1_torch": ev.top1_agreement,
                    "tokens_torch": ev.tokens, "eval_time_s": round(time.perf_counter() - t1, 2),
                    "eval_cpu_s": round(time.process_time() - c1, 2)})
    return row


def run_llama(mix: str, dithered: Path, llama: Llama) -> dict:
    row = _row("llama.cpp", mix)
    out = llama.work / f"llama.cpp-{mix}.gguf"
    dt, cpu = llama.quantize(dithered, mix, out)
    row["quantize_time_s"], row["quantize_cpu_s"] = round(dt, 2), round(cpu, 2)
    row.update(file_stats(out))
    row.update(llama.kld(out, f"llama.cpp-{mix}"))
    return row


# Hand allocations with llama-quantize's per-tensor overrides, one per target size: what a careful
# person does today (the tied embedding out of Q8_0, bytes moved into attn_v and ffn_down). On
# SmolLM2 only ffn_down (rows of 1536) takes 256-blocks; the rest choose among 32-block types.
# Patterns are matched in order (first match wins), as llama-quantize applies --tensor-type.
HAND = {
    "Q4_K_M": {"token_embd": "q5_1", "tensor_types": ["attn_v=q8_0", "attn_k=q5_1", "attn_q=q5_1", "attn_output=q5_0",
                                                     "ffn_down=q6_k", "ffn_gate=q5_1", "ffn_up=q5_1"]},
    "Q3_K_M": {"token_embd": "q5_0", "tensor_types": ["attn_v=q5_1", "attn_k=q5_0", "attn_q=q5_0", "attn_output=q5_0",
                                                     "ffn_down=q5_k", "ffn_gate=q4_1", "ffn_up=q5_0"]},
    "Q2_K": {"token_embd": "q5_0", "tensor_types": ["attn_v=q5_1", "attn_k=q4_1", "attn_q=q4_1", "attn_output=q5_1",
                                                   "ffn_down=q4_k", "ffn_gate=q4_1", "ffn_up=q4_1"]},
    # the i-quant mixes' sizes (llama.cpp keeps the tied embedding at Q8_0 there: a third of the file); no i-quants by
    # hand: on SmolLM2 only ffn_down could take them, and Q4_K there is what a careful person keeps
    "IQ2_XS": {"token_embd": "q5_0", "tensor_types": ["attn_v=q8_0", "attn_k=q5_0", "attn_q=q4_1", "attn_output=q4_1",
                                                     "ffn_down=q4_k", "ffn_gate=iq4_nl", "ffn_up=iq4_nl"]},
    "IQ2_XXS": {"token_embd": "q5_0", "tensor_types": ["attn_v=q8_0", "attn_k=q5_0", "attn_q=q4_1", "attn_output=iq4_nl",
                                                      "ffn_down=q4_k", "ffn_gate=iq4_nl", "ffn_up=iq4_nl"]},
    "IQ1_S": {"token_embd": "q4_1", "tensor_types": ["attn_v=q8_0", "attn_k=q5_0", "attn_q=q4_1", "attn_output=iq4_nl",
                                                    "ffn_down=q4_k", "ffn_gate=iq4_nl", "ffn_up=iq4_nl"]},
}


def run_hand(mix: str, dithered: Path, llama: Llama, size_limit: int | None, hand: dict | None = None,
             llama2: Llama | None = None) -> dict:
    """llama-quantize --imatrix with the hand overrides for a mix's size (``hand``, default :data:`HAND`);
    the row notes whether it fits."""
    row = _row("hand", mix)
    h = (HAND if hand is None else hand)[mix]
    out = llama.work / f"hand-{mix}.gguf"
    extra = ["--token-embedding-type", h["token_embd"], "--output-tensor-type", h["token_embd"]]
    for tt in h["tensor_types"]:
        extra += ["--tensor-type", tt]
    dt, cpu = llama.quantize(dithered, mix, out, extra, label=f"hand-{mix}")
    row["quantize_time_s"], row["quantize_cpu_s"] = round(dt, 2), round(cpu, 2)
    row["overrides"] = extra
    row.update(file_stats(out))
    row["size_limit"] = size_limit
    row["fits"] = size_limit is None or row["size_bytes"] <= size_limit
    row.update(llama.kld(out, f"hand-{mix}"))
    if llama2 is not None:
        row.update({f"{k}_eval2": v for k, v in llama2.kld(out, f"hand-{mix}-eval2").items()})
    return row


DYNAMIC_METHODS = {
    # method: (solver, measured-correction rounds or None for the command-line default, GPTQ, block-wise analysis)
    "dynamic": ("exact", None, False, False),
    "dynamic-exact": ("exact", 0, False, False),  # the exact solver alone, no measured corrections
    "dynamic-greedy": ("greedy", 0, False, False),  # the planner before issue 19: greedy, no measured corrections
    "dynamic-gptq": ("exact", None, True, False),
    "dynamic-stream": ("exact", 0, False, True),  # as dynamic-exact from the block-wise analysis (analyze --stream)
}


def run_dynamic(mix: str, dithered: Path, args, llama: Llama | None, size_limit: int, method: str = "dynamic",
                llama2: Llama | None = None) -> dict:
    """A dynamic plan at ``size_limit`` bytes from one shared analysis of the dithered model, planned as ``method``
    says (:data:`DYNAMIC_METHODS`: solver, measured corrections, GPTQ rounding)."""
    from dynaquant.analysis.calibration import CalibrationSpec

    solver, rounds, gptq, stream = DYNAMIC_METHODS[method]
    rounds = args.correct_rounds if rounds is None else rounds
    report = args.work_dir / ("analysis-stream" if stream else "analysis") / "report.json"
    row = _row(method, mix)
    if not report.is_file() or not (args.reuse or report in args.analysed):
        t0 = time.perf_counter()
        res = dynaquant.analyze(str(dithered), report.parent, calibration=CalibrationSpec((str(args.calibration),),
                                args.chunks, args.n_ctx), device=args.device, progress=False, stream=stream)
        row["analysis_time_s"] = round(time.perf_counter() - t0, 2)
        row["analysis_timings_s"] = {k: round(v, 2) for k, v in res.report["timings_s"].items()}
        args.analysed.add(report)  # one analysis (of each kind) serves every dynamic row of the run
    out = args.work_dir / f"{method}-{mix}.gguf"
    t0 = time.perf_counter()
    res = dynaquant.quantize(str(dithered), size=size_limit, report=report, output=out, device=args.device, progress=False,
                             gptq=gptq, calibration=args.calibration, calibration_chunks=args.chunks, n_ctx=args.n_ctx,
                             solver=solver, correct_rounds=rounds, correct_sequences=args.correct_sequences)
    row["gptq"] = res.gptq
    row["quantize_time_s"] = round(time.perf_counter() - t0, 2)
    row["quantize_timings_s"] = {k: round(v, 2) for k, v in res.timings_s.items()}
    row["size_limit"] = size_limit
    row["kld_pred"] = res.plan.kld_pred
    row["solver"] = getattr(res.plan, "solver", None)
    corr = getattr(res.plan, "corrections", None)
    row["corrections"] = corr
    final = (corr or {}).get("rounds") or []
    if final:  # predicted against measured on the held-out calibration sequences, first and final plan
        row["heldout_first"] = {k: final[0].get(k) for k in ("kld_pred", "kld_measured", "groups_sum")}
        row["heldout_final"] = {k: final[-1].get(k) for k in ("kld_pred", "kld_measured", "groups_sum")}
    row["formats"] = res.plan.count_by_format()
    row.update(file_stats(out))
    if llama is not None:
        row.update(llama.kld(out, f"{method}-{mix}"))
    if llama2 is not None:
        row.update({f"{k}_eval2": v for k, v in llama2.kld(out, f"{method}-{mix}-eval2").items()})
    return row


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(header: dict, rows: list[dict]) -> str:
    cols = ("method", "mix", "MiB", "bpw", "KLD", "KLD p99", "PPL", "top1", "KLD torch", "quant s", "quant cpu",
            "pred", "held meas", "KLD eval2")
    lines = [" ".join(f"{c:>10}" for c in cols)]
    for r in rows:
        if r.get("row") != "result":
            continue
        if "error" in r:
            lines.append(f"{r['method']:>10} {r['mix']:>10} ERROR: {r['error'].splitlines()[0][:90]}")
            continue
        size = r["size_bytes"] / 2**20 if r.get("size_bytes") else None
        cells = (r["method"], r["mix"], _fmt(size, ".2f"), _fmt(r.get("bpw"), ".3f"), _fmt(r.get("kld_mean"), ".5f"),
                 _fmt(r.get("kld_p99"), ".4f"), _fmt(r.get("ppl"), ".3f"), _fmt(r.get("top1"), ".4f"),
                 _fmt(r.get("kld_mean_torch"), ".5f"), _fmt(r.get("quantize_time_s"), ".1f"),
                 _fmt(r.get("quantize_cpu_s"), ".1f"), _fmt(r.get("kld_pred"), ".5f"),
                 _fmt((r.get("heldout_final") or {}).get("kld_measured"), ".5f"), _fmt(r.get("kld_mean_eval2"), ".5f"))
        lines.append(" ".join(f"{c:>10}" for c in cells))
    rat = header.get("ratios") or {}
    if rat:
        lines.append("")
        names = ("KLD mean", "KLD p99", "size", "quant time", "quant cpu")
        keys = ("kld_mean", "kld_p99", "size", "quantize_time", "quantize_cpu")
        lines.append("dynaquant / llama.cpp (same run): " + " ".join(f"{c:>13}" for c in names))
        for mix, e in rat.items():
            if mix.startswith("dynamic"):
                lines.append(f"{mix:>33}: KLD mean {_fmt(e.get('kld_mean'), '.3f')}  KLD p99 {_fmt(e.get('kld_p99'), '.3f')}"
                             f"  KLD eval2 {_fmt(e.get('kld_mean_eval2'), '.3f')}")
                continue
            lines.append(f"{mix:>33}: " + " ".join(f"{_fmt(e.get(k), '.3f'):>13}" for k in keys))
    if header.get("stopped"):
        lines.append(f"run stopped early; not run: {', '.join(header['stopped']['not_run'])}")
    if header.get("llama_cpp", {}).get("skipped"):
        lines.append(f"llama.cpp rows skipped: {header['llama_cpp']['skipped']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="dynaquant vs llama.cpp quantization quality on a dithered model")
    p.add_argument("--source", type=Path, default=None, help="GGUF to dither (default: embedded SmolLM2 Q4_1)")
    p.add_argument("--dithered", type=Path, default=DEFAULT_DITHERED, help="dithered BF16 model (made if missing)")
    p.add_argument("--remake-dithered", action="store_true", help="rewrite the dithered model even if present")
    p.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN if DEFAULT_LLAMA_BIN.is_dir() else None,
                   help="folder with llama-quantize, llama-perplexity, llama-imatrix (llama.cpp rows skipped without)")
    p.add_argument("--calibration", type=Path, default=DATA / "calibration.txt")
    p.add_argument("--eval-text", type=Path, default=DATA / "eval.txt")
    p.add_argument("--eval-text2", type=Path, default=None,
                   help="a second evaluation text (another domain) for the hand and dynamic rows: *_eval2 figures")
    p.add_argument("--correct-rounds", type=int, default=None,
                   help="measured-correction rounds of the dynamic rows (default: quantize's, 2 on CUDA, 0 on CPU)")
    p.add_argument("--correct-sequences", type=int, default=8, help="held-out calibration sequences of the corrections")
    p.add_argument("--chunks", type=int, default=32, help="chunks for calibration and evaluation")
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--mixes", default=",".join(MIXES), help="comma-separated presets")
    p.add_argument("--dynaquant-mixes", default=None,
                   help="comma-separated presets for dynaquant only (default: --mixes); llama.cpp still runs --mixes")
    p.add_argument("--methods", default="dynaquant,llama.cpp",
                   help="comma-separated: dynaquant (presets), llama.cpp, hand (llama-quantize overrides), "
                        "dynamic (dynaquant plans at the llama.cpp files' sizes), dynamic-greedy (the greedy planner "
                        "without measured corrections, for comparison), dynamic-gptq")
    p.add_argument("--dynamic-mixes", default="Q4_K_M,Q3_K_M,Q2_K,IQ2_XS,IQ2_XXS,IQ1_S", help="sizes for hand and dynamic rows")
    p.add_argument("--no-torch-eval", action="store_true", help="skip dynaquant.evaluate (PyTorch KLD)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    p.add_argument("--device", default="cpu", help="torch device for dynaquant")
    p.add_argument("--tool-timeout-s", type=float, default=3600)
    p.add_argument("--reuse", action="store_true", help="reuse base.kld and imatrix.gguf from --work-dir")
    p.add_argument("--profile", action="store_true", help="cProfile each dynaquant.quantize to WORK/quantize-MIX.prof")
    p.add_argument("--work-dir", type=Path, default=HERE / "out" / "quality")
    p.add_argument("--keep", action="store_true", help="keep the quantized GGUF files")
    p.add_argument("--out", type=Path, default=HERE / "out" / "quality.json")
    p.add_argument("--print", dest="print_only", action="store_true", help="only print the table of an existing --out")
    args = p.parse_args(argv)
    if args.print_only:
        header, *rows = json.loads(args.out.read_text())
        print(table(header, rows))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("gguf", "transformers", "dynaquant.exporters"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    mixes = [m.strip().upper() for m in args.mixes.split(",") if m.strip()]
    if "dynamic" in args.methods or "hand" in args.methods:  # (dynamic-gptq, dynamic-greedy included)
        mixes += [m.strip().upper() for m in args.dynamic_mixes.split(",") if m.strip().upper() not in mixes]
    dq_mixes = [m.strip().upper() for m in (args.dynaquant_mixes or args.mixes).split(",") if m.strip()]
    methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    known = {"dynaquant", "llama.cpp", "hand", *DYNAMIC_METHODS}
    if not methods <= known:
        p.error(f"unknown method(s): {', '.join(sorted(methods - known))}")
    dyn_mixes = [m.strip().upper() for m in args.dynamic_mixes.split(",") if m.strip()]
    if args.calibration.resolve() == args.eval_text.resolve():
        p.error("calibration and evaluation texts must differ")
    args.work_dir.mkdir(parents=True, exist_ok=True)

    tools, why_not = llama_tools(args.llama_bin)
    header: dict = {
        "row": "header", "benchmark": "quality", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(), "versions": versions(tools),
        "config": {"source": str(args.source or dynaquant.sources.checkpoint.default_model_path()),
                   "dithered": str(args.dithered), "dither": "dynaquant.analysis.dither.dither(w, 32, seed=tensor index)",
                   "calibration": str(args.calibration), "eval_text": str(args.eval_text),
                   "eval_text2": str(args.eval_text2) if args.eval_text2 else None, "chunks": args.chunks,
                   "correct_rounds": args.correct_rounds, "correct_sequences": args.correct_sequences,
                   "n_ctx": args.n_ctx, "mixes": mixes, "dynaquant_mixes": dq_mixes, "methods": sorted(methods),
                   "device": args.device, "llama_threads": args.threads,
                   "bpw": "8 * tensor data bytes / weights, from the GGUF file (metadata excluded)",
                   "kld": "llama-perplexity --kl-divergence against the dithered model (kld_*, ppl, top1 = 'Same top p'); "
                          "*_torch: dynaquant.evaluate"},
        "llama_cpp": {"bin": str(args.llama_bin) if args.llama_bin else None, "skipped": why_not},
        "dithered_model": {}, "ratios": {},
    }
    rows: list[dict] = []
    t_start = time.perf_counter()

    if args.remake_dithered or not args.dithered.is_file():
        t0 = time.perf_counter()
        make_dithered(args.source, args.dithered, progress=False)
        header["dithered_model"]["make_time_s"] = round(time.perf_counter() - t0, 2)
    header["dithered_model"].update(file_stats(args.dithered))
    write_json(args.out, header, rows)

    llama = llama2 = None
    args.analysed = set()
    if tools is not None:
        llama = Llama(tools, args.work_dir, args.n_ctx, args.chunks, args.threads, args.tool_timeout_s)
        try:
            header["llama_cpp"]["base"] = llama.make_base(args.dithered, args.eval_text, args.reuse)
            if methods & {"llama.cpp", "hand"}:
                header["llama_cpp"]["imatrix"] = llama.make_imatrix(args.dithered, args.calibration, args.reuse)
            if args.eval_text2 is not None:
                llama2 = Llama(tools, args.work_dir, args.n_ctx, args.chunks, args.threads, args.tool_timeout_s, "-eval2")
                header["llama_cpp"]["base_eval2"] = llama2.make_base(args.dithered, args.eval_text2, args.reuse)
        except ToolError as e:
            log.error("%s", e)
            header["llama_cpp"]["skipped"] = f"setup failed: {e}"
            llama = None
        write_json(args.out, header, rows)

    # llama.cpp first (minutes), then dynaquant (much slower on CPU): a run stopped early
    # still has every baseline, and each dynaquant row its ratio.
    jobs = []
    if "llama.cpp" in methods and llama is not None:
        jobs += [("llama.cpp", mix) for mix in mixes]
    if "hand" in methods and llama is not None:
        jobs += [("hand", mix) for mix in dyn_mixes]
    if "dynaquant" in methods:
        jobs += [("dynaquant", mix) for mix in dq_mixes]
    for m in DYNAMIC_METHODS:
        if m in methods:
            jobs += [(m, mix) for mix in dyn_mixes]
    # SIGTERM (kill PID) ends the run like Ctrl-C: the rows so far are kept and the header says so.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for method, mix in jobs:
            log.info("=== %s %s (load average %s)", method, mix, os.getloadavg())
            try:
                limit = next((r["size_bytes"] for r in rows if r["method"] == "llama.cpp" and r["mix"] == mix
                              and r.get("size_bytes")), None)
                if method == "llama.cpp":
                    row = run_llama(mix, args.dithered, llama)
                elif method == "hand":
                    row = run_hand(mix, args.dithered, llama, limit, llama2=llama2)
                elif method.startswith("dynamic"):
                    if limit is None:
                        raise RuntimeError(f"no llama.cpp {mix} row to take the size from; add llama.cpp to --methods")
                    row = run_dynamic(mix, args.dithered, args, llama, limit, method, llama2=llama2)
                else:
                    row = run_dynaquant(mix, args.dithered, args, llama)
            except Exception as e:  # one failing mix must not lose the others; the row says what failed
                log.exception("%s %s failed", method, mix)
                row = _row(method, mix)
                row["error"] = f"{type(e).__name__}: {e}"
            row["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(row)
            header["ratios"] = ratios(rows, mixes)
            write_json(args.out, header, rows)
            if not args.keep:
                (args.work_dir / f"{method}-{mix}.gguf").unlink(missing_ok=True)
            log.info("%s %s: %s", method, mix, {k: row.get(k) for k in ("size_bytes", "kld_mean", "kld_p99", "top1",
                                                                        "kld_mean_torch", "quantize_time_s", "quantize_cpu_s")})

    except KeyboardInterrupt:
        done = {(r["method"], r["mix"]) for r in rows}
        header["stopped"] = {"reason": "interrupted", "not_run": [f"{m} {x}" for m, x in jobs if (m, x) not in done]}
        log.warning("interrupted; not run: %s", ", ".join(header["stopped"]["not_run"]))

    header["total_time_s"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, header, rows)
    print(table(header, rows))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
