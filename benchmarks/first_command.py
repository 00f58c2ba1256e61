"""README's first command on this machine: ``dynaquant quantize`` with no arguments, timed whole, beside llama.cpp.

The command analyses the embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF), plans it at llama.cpp's Q3_K_M
mix's size, writes the GGUF and evaluates it (issue 16's CPU target: at most 90 s of wall time on the 2-core box,
caches warm, installation not counted). Each repeat runs it as a user does, a new process in a new empty folder,
``python -m dynaquant.cli quantize`` (what the ``dynaquant`` script runs); ``--code DIR`` runs another checkout's
code instead (``PYTHONPATH=DIR``: before / after in one run). One warm-up run first (not counted) fills the caches
(``~/.cache/dynaquant``: the GGUF's converted config and tokenizer, the evaluation's reference states).

Baseline in the same run: ``llama-quantize --allow-requantize SOURCE OUT Q3_K_M THREADS`` on the same file with all
cores (the pinned llama.cpp's tool, ``python tests/llama_tools.py`` builds it): llama.cpp's encoding alone, no
imatrix, analysis or evaluation, so the ratio is an upper bound of what dynaquant's extra work costs.

Output (``--out``, JSON list): a header row (machine, CPU model, cores, torch, commit, load average before and after),
one row per method with every repeat's wall seconds and their median (``wall_s``, ``median_s``; for dynaquant also
the printed run time, bytes, mean KLD and top-1 agreement of each run), and ``ratio_median``: dynaquant's median over
llama-quantize's.

``--preset MIX`` times a llama.cpp mix instead (issue 16's second CPU target: within 2x of ``llama-quantize``'s wall
time): ``dynaquant quantize SOURCE --preset MIX --no-eval -o OUT`` (``--source``, default the embedded model; with
``--imatrix FILE`` both tools get it) against ``llama-quantize [--imatrix FILE] --allow-requantize SOURCE OUT MIX``;
the rows then carry no KLD (nothing is evaluated). The quality benchmark's source is the one to use
(``benchmarks/make_dithered.py``: the dithered BF16 copy of the default model, off the Q4_1 grid), with its imatrix
from ``dynaquant analyze``.

Usage::

    python benchmarks/first_command.py --repeats 3 --out benchmarks/out/first_command-cpu.json
    python benchmarks/first_command.py --code /path/to/older/checkout --out before.json   # the same for other code
    python benchmarks/first_command.py --against /path/to/older/checkout    # interleaved: this code, that code, ...
    python benchmarks/first_command.py --preset Q3_K_M --source dithered.gguf --imatrix imatrix.gguf --out preset.json

``--against DIR`` runs DIR's code too, alternating with this code's runs (a warm-up of each first), so that both see
the same load (this box's speed drifts by 20-40 % within an hour); its row is ``dynaquant quantize (against)`` and the
header gets ``ratio_against``: this code's median over DIR's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent / "tests"))  # llama_tools: the pinned llama.cpp's tools

import llama_tools  # noqa: E402

_SIZE = re.compile(r"^\s+([\d.]+) MB, ([\d.]+) bpw over tensor data, ([\d.]+) s \(", re.M)
_KLD = re.compile(r"mean KLD ([\d.eE+-]+)\s+p99 KLD ([\d.eE+-]+)\s+top-1 agreement ([\d.]+)%")
_WROTE = re.compile(r"^wrote (.+\.gguf)$", re.M)


def parse_output(text: str, evaluated: bool = True) -> dict:
    """The figures ``dynaquant quantize`` prints: ``{"mb", "bpw", "printed_s"}`` and, when ``evaluated``,
    ``{"kld_mean", "kld_p99", "top1"}``.

    Raises:
        ValueError: the text has no size line, or no KLD line when ``evaluated`` (the run failed or did not evaluate).
    """
    size, kld = _SIZE.search(text), _KLD.search(text)
    if size is None or (evaluated and kld is None):
        raise ValueError(f"no {'size' if size is None else 'KLD'} line in the output:\n{text[-2000:]}")
    out = {"mb": float(size[1]), "bpw": float(size[2]), "printed_s": float(size[3])}
    if evaluated:
        out.update({"kld_mean": float(kld[1]), "kld_p99": float(kld[2]), "top1": float(kld[3]) / 100})
    return out


def run_dynaquant(code: Path | None, args: list[str] | None = None) -> dict:
    """One ``dynaquant quantize [args]`` of ``code``'s checkout (None: this one) in a new temporary folder: wall
    seconds, the printed figures, the file's bytes. ``args`` None: README's first command (no arguments, evaluated)."""
    env = dict(os.environ, PYTHONPATH=str(code or HERE.parent))  # this checkout's code, whatever is installed
    with tempfile.TemporaryDirectory(prefix="dq-first-") as d:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "dynaquant.cli", "quantize", *(args or [])], cwd=d, env=env,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            raise RuntimeError(f"dynaquant quantize exited {p.returncode}:\n{p.stderr[-3000:]}")
        row = {"wall_s": wall, **parse_output(p.stdout, evaluated=args is None)}
        wrote = _WROTE.search(p.stdout)
        row["bytes"] = Path(d, wrote[1]).stat().st_size if wrote else None
    return row


def run_llama_quantize(tool: Path, source: Path, threads: int, mix: str = "Q3_K_M", imatrix: Path | None = None) -> float:
    """Wall seconds of ``llama-quantize [--imatrix FILE] --allow-requantize source OUT mix threads``."""
    im = ["--imatrix", str(imatrix)] if imatrix is not None else []
    with tempfile.TemporaryDirectory(prefix="dq-first-") as d:
        t = time.perf_counter()
        subprocess.run([str(tool), *im, "--allow-requantize", str(source), str(Path(d, "out.gguf")), mix, str(threads)],
                       check=True, capture_output=True)
        return time.perf_counter() - t


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--code", type=Path, default=None, help="run this checkout's dynaquant (PYTHONPATH) instead")
    p.add_argument("--against", type=Path, default=None, help="also run this checkout's code, interleaved")
    p.add_argument("--llama-bin", type=Path, default=llama_tools.bin_dir())
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=HERE / "out" / "first_command-cpu.json")
    p.add_argument("--preset", help="time `dynaquant quantize SOURCE --preset MIX --no-eval` against llama-quantize MIX")
    p.add_argument("--source", type=Path, help="with --preset: the GGUF to quantize (default: the embedded model)")
    p.add_argument("--imatrix", type=Path, help="with --preset: an imatrix file both tools get")
    a = p.parse_args(argv)
    if (a.source or a.imatrix) and not a.preset:
        p.error("--source and --imatrix go with --preset")

    import torch

    from dynaquant.sources.checkpoint import resolve_source

    source = a.source.resolve() if a.source else Path(resolve_source(None).path)
    dq_args = None
    if a.preset:
        dq_args = [str(source), "--preset", a.preset, "--no-eval", "-o", "out.gguf"]
        dq_args += ["--imatrix", str(a.imatrix.resolve())] if a.imatrix else []
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.code or HERE.parent, capture_output=True,
                            text=True).stdout.strip() or None
    header = {"row": "header", "machine": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count(),
              "torch": torch.__version__, "commit": commit, "code": str(a.code or HERE.parent),
              "source": str(source), "repeats": a.repeats, "loadavg_before": os.getloadavg(),
              "dynaquant_args": dq_args, "mix": a.preset or "Q3_K_M", "imatrix": str(a.imatrix) if a.imatrix else None}
    codes = [a.code] + ([a.against] if a.against is not None else [])
    for code in codes:
        run_dynaquant(code, dq_args)  # warm-up: the caches a user's second run finds (and the compiled searches)
    runs: list[list[dict]] = [[] for _ in codes]
    for _ in range(a.repeats):
        for i, code in enumerate(codes):
            runs[i].append(run_dynaquant(code, dq_args))
    rows = [header] + [{"row": "dynaquant quantize" + (" (against)" if i else ""), "code": str(code or HERE.parent),
                        "median_s": statistics.median(r["wall_s"] for r in rr), "wall_s": [r["wall_s"] for r in rr],
                        "runs": rr} for i, (code, rr) in enumerate(zip(codes, runs))]
    if a.against is not None:
        header["ratio_against"] = rows[1]["median_s"] / rows[2]["median_s"]
    tool = a.llama_bin / "llama-quantize"
    if tool.is_file():
        mix = a.preset or "Q3_K_M"
        walls = [run_llama_quantize(tool, source, a.threads, mix, a.imatrix) for _ in range(a.repeats)]
        rows.append({"row": f"llama-quantize {mix}", "threads": a.threads, "wall_s": walls,
                     "median_s": statistics.median(walls)})
        header["ratio_median"] = rows[1]["median_s"] / rows[-1]["median_s"]
    else:
        header["llama"] = f"no {tool} (python tests/llama_tools.py builds it)"
    header["loadavg_after"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(a.out)
    for r in rows[1:]:
        print(f"{r['row']:34s} median {r['median_s']:7.1f} s  runs {', '.join(f'{w:.1f}' for w in r['wall_s'])}")
    for k in ("ratio_median", "ratio_against"):
        if k in header:
            print(f"{k} {header[k]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
