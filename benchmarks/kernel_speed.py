"""Kernel benchmark: dynaquant.kernels.linear against torch bf16 F.linear (cuBLAS), same run, same GPU.

For each runtime format, each linear-layer shape of Llama-3-8B (q/o, k/v, gate/up, down, lm_head) and
each batch M (1, 4, 16, 64, 256): the median time per call and the achieved bandwidth (bytes of the
packed weight, scales and zero points included, over the time), as a fraction of the read-bandwidth
ceiling measured in the same run (a ``torch.sum`` over 4 GiB), and the speed-up over bf16 ``F.linear``.
Calls are timed as CUDA-graph replays of a sequence of calls over distinct copies of the weight (at
least 512 MiB of weights per sequence, so nothing is served from the 50 MB L2), divided by the number
of calls: what a decode step sees. Weights are random codes (never zeros); activations random normal.

``--sweep`` first times the candidate launch configurations of the priority formats (INT4_G128,
INT2_G128, MXFP4_G32) per shape at the M it is given (default 1), and reports the best next to the
default choice of ``choose_config``.

Output: a JSON list (``--out``, default ``benchmarks/out/kernels.json``), rewritten after every row:
a header row (device, versions, ceiling), ``bf16`` rows, ``kernel`` rows, ``sweep`` rows and ``step``
rows (one decode step's linear layers summed: 32 x (q, k, v, o, gate, up, down) + lm_head), ``step_fused``
rows (32 x (qkv, o, gate+up, down) + lm_head: the calls ``dynaquant.load`` makes, q/k/v and gate/up
stacked), both against bf16 called as transformers calls it, and a table printed at the end.

``--pdl`` launches the M = 1 GEMV with programmatic dependent launch (``triton_linear.PDL``): a call's programs load
their first weight tile while the previous call finishes (consecutive calls of a sequence overlap).

``--gemv-xpre`` runs the M = 1 rows on the resident-activation GEMV (``tuning.resident_gemv_config``) where the
format has it (symmetric INT4 / INT2, MXFP4, NVFP4), whatever ``choose_config`` picks.

Usage (on a CUDA machine):
    python benchmarks/kernel_speed.py [--formats INT4_G128,MXFP4_G32] [--m 1,4,16] [--sweep] [--gemv-xpre] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
try:  # an installed (or PYTHONPATH) dynaquant first, else this checkout
    import dynaquant.kernels  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent))

from dynaquant.kernels import KernelFormat, PackedWeight, choose_config, device_info, linear, pack  # noqa: E402
from dynaquant.kernels.ops import dequantize_packed_ref  # noqa: E402
from dynaquant.kernels.tuning import (  # noqa: E402
    LaunchConfig,
    gemm_candidates,
    gemv_candidates,
    mm_candidates,
    resident_gemv_config,
    valid_config,
)

log = logging.getLogger("kernels")

# Llama-3-8B: hidden 4096, 32 heads x 128 (8 KV heads), FFN 14336, vocab 128256, 32 layers
SHAPES = {  # name: (N, K, calls per decode step as transformers makes them)
    "q_o": (4096, 4096, 64),
    "k_v": (1024, 4096, 64),
    "gate_up": (14336, 4096, 64),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
    "qkv": (6144, 4096, 0),  # q/k/v stacked, as dynaquant.load fuses them
    "gate_up2": (28672, 4096, 0),  # gate/up stacked
}
# One decode step's calls: separate (transformers' layers) and fused (dynaquant.load's default).
STEPS = {"step": {"q_o": 64, "k_v": 64, "gate_up": 64, "down": 32, "lm_head": 1},
         "step_fused": {"qkv": 32, "q_o": 32, "gate_up2": 32, "down": 32, "lm_head": 1}}
FORMATS = ["INT4_G128", "INT2_G128", "MXFP4_G32", "INT4_G128_ASYM", "INT4_G64", "INT4_G32", "INT2_G64",
           "INT2_G32_ASYM", "INT3_G128", "INT8_G128", "NVFP4_G16"]
PRIORITY = ["INT4_G128", "INT2_G128", "MXFP4_G32"]
MS = [1, 4, 16, 64, 256]
MIN_BYTES = 512 << 20
DEVICE = "cuda"
DRY_SHAPES = {"q_o": (64, 256, 64), "k_v": (32, 256, 64), "gate_up": (96, 256, 64), "down": (64, 512, 32),
              "lm_head": (128, 256, 1), "qkv": (128, 256, 0), "gate_up2": (192, 256, 0)}


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE.parent), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def bench_graph(fns, warmup_ms: int = 10, rep_ms: int = 60) -> float:
    """Median seconds per call of a list of zero-argument callables, captured in one CUDA graph."""
    import triton

    if DEVICE == "cpu":  # --dry-run: the interpreter, one call each, wall clock
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) / len(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # compile and warm up outside the capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    ms = triton.testing.do_bench(g.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return ms * 1e-3 / len(fns)


def read_ceiling(gib: float = 4.0) -> dict:
    """Read bandwidth of a torch.sum over ``gib`` GiB (float32), and of a device-to-device copy (read + write)."""
    import triton

    n = int(gib * (1 << 30)) // 4
    a = torch.rand(n, device=DEVICE)
    if DEVICE == "cpu":
        return {"sum_bytes": 4 * n, "sum_time_s": 1.0, "read_bandwidth_gbps": 4 * n / 1e9, "copy_bandwidth_gbps": 0.0}
    t = triton.testing.do_bench(lambda: a.sum(), warmup=50, rep=300, return_mode="median") * 1e-3
    b = torch.empty_like(a)
    tc = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median") * 1e-3
    a = b = None
    _empty_cache()
    return {"sum_bytes": 4 * n, "sum_time_s": t, "read_bandwidth_gbps": 4 * n / t / 1e9,
            "copy_bandwidth_gbps": 2 * 4 * n / tc / 1e9}


def random_packed(fmt: str, n: int, k: int, gen: torch.Generator):
    """A random PackedWeight on the GPU (codes uniform over the format's range, realistic scales)."""
    f = KernelFormat.parse(fmt)
    g = f.group_size
    dev = DEVICE
    if f.kind == "int":
        b = f.bits
        if f.symmetric:
            codes = torch.randint(-(1 << (b - 1)), 1 << (b - 1), (n, k), device=dev, generator=gen, dtype=torch.int8)
            zeros = None
        else:
            codes = torch.randint(0, 1 << b, (n, k), device=dev, generator=gen, dtype=torch.uint8)
            zeros = torch.randint(0, 1 << b, (n, k // g), device=dev, generator=gen, dtype=torch.uint8)
        scales = (torch.rand(n, k // g, device=dev, generator=gen) * 0.01 + 0.001).to(torch.float16)
        return pack(codes, scales, zeros, f)
    codes = torch.randint(0, 16, (n, k), device=dev, generator=gen, dtype=torch.uint8)
    if f.kind == "mxfp4":
        return pack(codes, torch.randint(118, 124, (n, k // g), device=dev, generator=gen, dtype=torch.uint8), None, f)
    scales = (torch.rand(n, k // g, device=dev, generator=gen) * 400 + 8).to(torch.float8_e4m3fn)
    return pack(codes, scales, None, f, global_scale=torch.tensor(1000.0))


def copies_of(packed, count: int) -> list:
    """``count`` independent copies (own buffers and split-K counters) of a PackedWeight."""
    out = [packed]
    for _ in range(count - 1):
        out.append(dataclasses.replace(
            packed, qweight=packed.qweight.clone(), scales=packed.scales.clone(),
            qweight_hi=None if packed.qweight_hi is None else packed.qweight_hi.clone(),
            zeros=None if packed.zeros is None else packed.zeros.clone(), counters=torch.zeros_like(packed.counters)))
    return out


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def n_copies(nbytes: int) -> int:
    return max(1, min(256, math.ceil(MIN_BYTES / nbytes)))


def dummy_packed(fmt: str, n: int, k: int, device: str | None = None) -> PackedWeight:
    """A PackedWeight of the right shapes and dtypes on ``device`` (default :data:`DEVICE`), contents uninitialised
    (for compiling only)."""
    f = KernelFormat.parse(fmt)
    dev = device or DEVICE
    g = f.group_size
    bits = 2 if f.bits == 3 else f.bits
    sdt = torch.uint8 if f.is_fp4 else torch.float16
    return PackedWeight(f, n, k, torch.empty(n, k * bits // 32, dtype=torch.int32, device=dev),
                        torch.empty(n, k // 32, dtype=torch.int32, device=dev) if f.bits == 3 else None,
                        torch.empty(n, k // g, dtype=sdt, device=dev),
                        None if f.symmetric else torch.empty(n, k // g, dtype=torch.uint8, device=dev), 1.0, None,
                        torch.zeros(-(-n // 16), dtype=torch.int32, device=dev))


def prewarm(jobs, threads: int = 16) -> float:
    """Compile the kernels of ``jobs`` [(fmt, n, k, m, config)] in a thread pool; returns seconds taken."""
    from concurrent.futures import ThreadPoolExecutor

    from dynaquant.kernels.triton_gemm import compile_gemm
    from dynaquant.kernels.triton_linear import compile_linear
    from dynaquant.kernels.triton_resident import compile_resident

    t0 = time.time()
    uniq = list(dict.fromkeys(jobs))
    if DEVICE == "cpu":
        return 0.0

    def one(job):
        fmt, n, k, m, cfg = job
        try:
            x = torch.empty(m, k, dtype=torch.bfloat16, device=DEVICE)
            if cfg.path == "gemm" and cfg.gluon:
                from dynaquant.kernels.gluon_gemm import compile_gluon_gemm as compile_
            else:
                compile_ = compile_gemm if cfg.path == "gemm" else compile_resident if cfg.resident else compile_linear
            compile_(x, dummy_packed(fmt, n, k), None, cfg)
        except Exception as e:  # reported when the call runs
            log.warning("prewarm %s: %r", job, e)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, uniq))
    log.info("compiled %d kernels in %.0f s", len(uniq), time.time() - t0)
    return time.time() - t0


class Writer:
    def __init__(self, path: Path, header: dict):
        self.path = path
        self.rows = [header]
        path.parent.mkdir(parents=True, exist_ok=True)
        self.flush()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.flush()

    def flush(self) -> None:
        self.path.write_text(json.dumps(self.rows, indent=1))


def time_kernel(weights, xs, config) -> float:
    fns = [(lambda w=w, x=x: linear(x, w, config=config)) for w, x in zip(weights, xs)]
    return bench_graph(fns)


def check(packed, w_ref: torch.Tensor, m: int, gen: torch.Generator, config=None) -> float:
    x = torch.randn(m, packed.in_features, device=DEVICE, generator=gen).to(torch.bfloat16)
    ref = x.float() @ w_ref.t()
    y = linear(x, packed, config=config).float()
    return float((y - ref).norm() / ref.norm())


def forced_gemm(f, m: int, n: int, k: int, cfg, options: list[str], info):
    """``cfg`` with the gemm ``options`` switched on; a non-gemm ``cfg`` first becomes a gemm tile (16 x 64 rows, K
    tiles of 128, split 4 at M <= 16; 128 x 128, K tiles of 64, 8 warps, 3 stages above); ``post_scale`` narrows the
    K tile to one group. ``cfg`` unchanged where the result does not fit the shape."""
    base = cfg
    if cfg.path != "gemm":
        base = (LaunchConfig("gemm", 16, 64, 1, 4, 4, 3, False, 128) if m <= 16 else
                LaunchConfig("gemm", min(128, max(16, 1 << (m - 1).bit_length())), 128, 1, 1, 8, 3, False, 64))
    new = dataclasses.replace(base, **{o.split("=")[0]: int(o.split("=")[1]) if "=" in o else True for o in options})
    if new.post_scale and new.block_k > f.group_size:
        new = dataclasses.replace(new, block_k=f.group_size)
    if new.split_k > 1 and (k // new.block_k) % new.split_k:
        new = dataclasses.replace(new, split_k=1)
    return new if valid_config(new, f, m, n, k) else cfg


def main(argv=None) -> int:
    global MIN_BYTES, DEVICE, SHAPES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--sweep", action="store_true", help="time launch-config candidates of the priority formats")
    ap.add_argument("--sweep-m", default="1")
    ap.add_argument("--sweep-formats", default=",".join(PRIORITY))
    ap.add_argument("--gemv-xpre", "--gemv-resident", dest="gemv_xpre", action="store_true",
                    help="M = 1 rows on the resident-activation GEMV (tuning.resident_gemv_config) where the format has "
                         "it, instead of choose_config's")
    ap.add_argument("--force-gemm", default="",
                    help="comma list of LaunchConfig gemm options (xa, post_scale, warp_spec, max_regs=128, "
                         "block_k=32, ...) forced on every call with M >= 16 (on the default gemm tile, else a "
                         "128 x 128 / 16 x 64 one); in a sweep it is the default the candidates are compared with")
    ap.add_argument("--pdl", action="store_true",
                    help="launch the M = 1 GEMV with programmatic dependent launch (triton_linear.PDL; Hopper+)")
    ap.add_argument("--quick", action="store_true", help="fewer copies and shorter timing (a smoke run)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new rows after this many seconds")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the script on CPU: tiny shapes, Triton's interpreter, no timing worth reading")
    ap.add_argument("--out", default=str(HERE / "out" / "kernels.json"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE, SHAPES, MIN_BYTES = "cpu", DRY_SHAPES, 1 << 16
    elif not torch.cuda.is_available():
        log.error("needs a CUDA device")
        return 2
    import triton

    if args.quick:
        MIN_BYTES = 64 << 20
    if args.pdl:
        from dynaquant.kernels import triton_linear

        triton_linear.PDL = True
    t_start = time.time()
    dev = torch.device(DEVICE)
    info = device_info(dev)
    if DEVICE == "cpu":
        props = argparse.Namespace(name="cpu (dry run)", multi_processor_count=0)
    else:
        props = torch.cuda.get_device_properties(dev)
    ceiling = read_ceiling(0.01 if args.dry_run else 1.0 if args.quick else 4.0)
    header = {"row": "header", "device": props.name, "sm_count": props.multi_processor_count,
              "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "git": _git(),
              "ceiling": ceiling, "min_bytes_per_sequence": MIN_BYTES, "gemv_xpre": args.gemv_xpre,
              "pdl": args.pdl,
              "timing": "median of CUDA-graph replays of a sequence of calls over distinct weight copies, / calls"}
    out = Writer(Path(args.out), header)
    log.info("device %s, read ceiling %.0f GB/s (sum), copy %.0f GB/s", props.name, ceiling["read_bandwidth_gbps"],
             ceiling["copy_bandwidth_gbps"])
    ceil = ceiling["read_bandwidth_gbps"] * 1e9
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shapes = [s for s in args.shapes.split(",") if s]
    ms = [int(v) for v in args.m.split(",") if v]
    formats = [f for f in args.formats.split(",") if f]
    sweep_ms = [int(v) for v in args.sweep_m.split(",") if v]
    sweep_formats = [f for f in args.sweep_formats.split(",") if f] if args.sweep else []
    table = []

    def over_budget() -> bool:
        return time.time() - t_start > args.budget_s

    # bf16 baseline
    bf16 = {}
    for sname in shapes:
        n, k, _ = SHAPES[sname]
        w0 = torch.randn(n, k, device=DEVICE, generator=gen).to(torch.bfloat16) * 0.02
        cnt = n_copies(w0.numel() * 2)
        ws = [w0] + [w0.clone() for _ in range(cnt - 1)]
        for m in sorted(set(ms) | (set(sweep_ms) if args.sweep else set())):
            xs = [torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in ws]
            t = bench_graph([(lambda w=w, x=x: torch.nn.functional.linear(x, w)) for w, x in zip(ws, xs)])
            bf16[(sname, m)] = t
            row = {"row": "bf16", "shape": sname, "n": n, "k": k, "m": m, "time_s": t, "weight_bytes": n * k * 2,
                   "bandwidth_gbps": n * k * 2 / t / 1e9, "fraction_of_ceiling": n * k * 2 / t / ceil, "copies": cnt}
            out.add(row)
        del ws, w0
        _empty_cache()
    log.info("bf16 done (%.0f s)", time.time() - t_start)


    forced = [o for o in args.force_gemm.split(",") if o]

    def chosen(f, m, n, k):
        """The configuration a row runs: choose_config's; with --gemv-xpre the resident GEMV's at M = 1; with
        --force-gemm its options on a gemm tile (the default one where it is a gemm) at M >= 16."""
        if args.gemv_xpre and m == 1:
            cfg = resident_gemv_config(f, n, k, info)
            if cfg is not None:
                return cfg
        cfg = choose_config(f, m, n, k, info)
        if not forced or m < 16:
            return cfg
        return forced_gemm(f, m, n, k, cfg, forced, info)

    def candidates(f, m, n, k):
        default = chosen(f, m, n, k)
        cands = gemv_candidates(f, n, k, info) if m == 1 else []
        cands += [c for c in mm_candidates(f, max(m, 2), n, k, info)
                  if (c.num_warps == 4 or m > 64) and c.groups * f.group_size <= 128]
        cands += gemm_candidates(f, m, n, k, info) if m >= 16 else []
        return [c for c in dict.fromkeys([default] + cands) if valid_config(c, f, m, n, k)]

    def jobs_for(fmt: str, sweep: bool) -> list:
        f = KernelFormat.parse(fmt)
        jobs = []
        for sname in shapes:
            n, k, _ = SHAPES[sname]
            if sweep:
                if sname != "lm_head":
                    jobs += [(fmt, n, k, m, c) for m in sweep_ms for c in candidates(f, m, n, k)]
            else:
                jobs += [(fmt, n, k, m, chosen(f, m, n, k)) for m in ms]
        return jobs

    compile_s = {}

    best_cfg = {}

    def run_sweep(fmt: str) -> None:
        """Time the candidate configurations of one format at the sweep's M, per shape (not lm_head)."""
        f = KernelFormat.parse(fmt)
        compile_s[fmt + " sweep"] = prewarm(jobs_for(fmt, True))
        for sname in [s for s in shapes if s != "lm_head"]:
            if over_budget():
                return
            n, k, _ = SHAPES[sname]
            p0 = random_packed(fmt, n, k, gen)
            w_ref = dequantize_packed_ref(p0)
            ws = copies_of(p0, n_copies(p0.nbytes))
            for m in sweep_ms:
                xs = [torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in ws]
                default = chosen(f, m, n, k)
                results = []
                for cfg in candidates(f, m, n, k):
                    if over_budget():
                        break
                    row = {"row": "sweep", "format": fmt, "shape": sname, "n": n, "k": k, "m": m,
                           "config": dataclasses.asdict(cfg), "default": cfg == default}
                    try:
                        row["rel_err"] = check(p0, w_ref, m, gen, cfg)
                        t = time_kernel(ws, xs, cfg)
                    except Exception as e:  # a config that does not compile or run is reported, not fatal
                        row["error"] = repr(e)[:300]
                        out.add(row)
                        continue
                    results.append((t, cfg))
                    row.update(time_s=t, bandwidth_gbps=p0.nbytes / t / 1e9, speedup_vs_bf16=bf16[(sname, m)] / t)
                    out.add(row)
                if results:
                    t, cfg = min(results, key=lambda r: r[0])
                    best_cfg[(fmt, sname, m)] = cfg
                    t_def = next((r[0] for r in results if r[1] == default), float("nan"))
                    log.info("sweep %s %s m=%d: best %.1f us %s (default %.1f us)", fmt, sname, m, t * 1e6, cfg, t_def * 1e6)
            del ws, p0, w_ref
            _empty_cache()

    def run_format(fmt: str) -> None:
        """Every shape and M of one format with the default configuration (and the sweep's best where it ran)."""
        f = KernelFormat.parse(fmt)
        if over_budget():
            return
        compile_s[fmt] = prewarm(jobs_for(fmt, False))
        for sname in shapes:
            if over_budget():
                return
            n, k, _ = SHAPES[sname]
            p0 = random_packed(fmt, n, k, gen)
            w_ref = dequantize_packed_ref(p0)
            ws = copies_of(p0, n_copies(p0.nbytes))
            for m in ms:
                xs = [torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in ws]
                cfg = chosen(f, m, n, k)
                row = {"row": "kernel", "format": fmt, "shape": sname, "n": n, "k": k, "m": m,
                       "config": dataclasses.asdict(cfg), "weight_bytes": p0.nbytes, "copies": len(ws)}
                try:
                    row["rel_err"] = check(p0, w_ref, m, gen, cfg)
                    t = time_kernel(ws, xs, cfg)
                    row.update(time_s=t, bandwidth_gbps=p0.nbytes / t / 1e9, fraction_of_ceiling=p0.nbytes / t / ceil,
                               bf16_time_s=bf16[(sname, m)], speedup_vs_bf16=bf16[(sname, m)] / t)
                    best = best_cfg.get((fmt, sname, m))
                    if best is not None and best != cfg:
                        tb = time_kernel(ws, xs, best)
                        row.update(best_config=dataclasses.asdict(best), best_time_s=tb,
                                   best_speedup_vs_bf16=bf16[(sname, m)] / tb)
                except Exception as e:
                    row["error"] = repr(e)[:300]
                out.add(row)
                if "time_s" in row:
                    table.append(row)
            del ws, p0, w_ref
            _empty_cache()
        log.info("%s done (%.0f s)", fmt, time.time() - t_start)

    # the sweep of the priority formats, then their table, then the other formats, as the budget allows
    for fmt in sweep_formats:
        run_sweep(fmt)
    for fmt in [f for f in formats if f in PRIORITY] + [f for f in formats if f not in PRIORITY]:
        run_format(fmt)

    out.rows[0]["compile_s"] = compile_s
    # one decode step's linear layers: separate calls and fused q/k/v, gate/up; against bf16 as transformers
    # calls it (separate), and bf16 fused too
    for kind, calls in STEPS.items():
        for fmt in formats:
            for m in ms:
                rows = {r["shape"]: r for r in table if r["format"] == fmt and r["m"] == m}
                if not set(calls) <= set(rows) or not all((s, m) in bf16 for s in STEPS["step"]):
                    continue
                tq = sum(c * rows[s]["time_s"] for s, c in calls.items())
                tb = sum(c * bf16[(s, m)] for s, c in STEPS["step"].items())
                nbytes = sum(c * rows[s]["weight_bytes"] for s, c in calls.items())
                step = {"row": kind, "format": fmt, "m": m, "time_s": tq, "bf16_time_s": tb, "speedup_vs_bf16": tb / tq,
                        "weight_bytes": nbytes, "fraction_of_ceiling": nbytes / tq / ceil, "calls": sum(calls.values())}
                if all((s, m) in bf16 for s in calls):
                    step["bf16_same_calls_time_s"] = sum(c * bf16[(s, m)] for s, c in calls.items())
                if any("best_time_s" in rows[s] for s in calls):
                    tbest = sum(c * rows[s].get("best_time_s", rows[s]["time_s"]) for s, c in calls.items())
                    step.update(best_time_s=tbest, best_speedup_vs_bf16=tb / tbest)
                out.add(step)

    # table
    print(f"\n{props.name}  read ceiling {ceiling['read_bandwidth_gbps']:.0f} GB/s   torch {torch.__version__} "
          f"triton {triton.__version__}")
    print(f"{'format':16s} {'shape':8s} {'m':>4s} {'us':>8s} {'bf16 us':>8s} {'x bf16':>7s} {'GB/s':>6s} {'%ceil':>6s} {'err':>8s}")
    for r in table:
        print(f"{r['format']:16s} {r['shape']:8s} {r['m']:4d} {r['time_s'] * 1e6:8.1f} {r['bf16_time_s'] * 1e6:8.1f} "
              f"{r['speedup_vs_bf16']:7.2f} {r['bandwidth_gbps']:6.0f} {100 * r['fraction_of_ceiling']:6.1f} "
              f"{r['rel_err']:8.1e}")
    print("\ndecode step (32 layers + lm_head; step_fused: q/k/v and gate/up one call each), against bf16 as "
          "transformers calls it:")
    for r in out.rows:
        if r.get("row") in STEPS:
            extra = f"  best configs {r['best_speedup_vs_bf16']:.2f}x" if "best_speedup_vs_bf16" in r else ""
            print(f"  {r['row']:10s} {r['format']:16s} m={r['m']:<4d} {r['time_s'] * 1e6:9.1f} us "
                  f"vs bf16 {r['bf16_time_s'] * 1e6:9.1f} us"
                  f"  {r['speedup_vs_bf16']:.2f}x  {100 * r['fraction_of_ceiling']:.0f}% of ceiling{extra}")
    log.info("wrote %s (%.0f s)", args.out, time.time() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
