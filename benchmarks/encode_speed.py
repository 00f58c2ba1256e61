"""Encode speed and quality of the i-quant encoders against llama.cpp's, measured in one run.

For each type (``IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_XS NVFP4`` by default;
a type without a registered codec gets a row saying so) on one synthetic ``--rows`` x 14336
float32 weight (Gaussian rows with lognormal scales and 0.2% heavy-tailed outliers, fixed
seed) with a random positive (14336,) imatrix:

* ``ours_cpu``: ``dynaquant.quant.codecs.quantize`` on CPU (all torch threads) over the first
  ``--cpu-rows`` rows (the rate is per weight; the whole tensor would take minutes for the
  slow types), one warm-up, then the median of ``--repeats`` runs;
* ``ours_<device>``: the same on ``--device`` (default ``cuda`` when available) over the whole
  tensor, synchronized, warm-up first, median of ``--repeats``;
* ``llama_cpu``: llama.cpp's ``ggml_quantize_chunk`` through ctypes over the whole tensor,
  rows split into chunks run by a ThreadPoolExecutor of ``os.cpu_count()`` workers (ctypes
  releases the GIL), median of ``--repeats``. The library is ``--libggml PATH``, else
  ``$DYNAQUANT_LIBGGML``, else the libggml-base of llama-cpp-python (``tests/ggml_ref.py``);
* the importance-weighted error ``sum(imatrix * (W - Q(W))**2)`` of ours and llama.cpp's on
  the same rows (the device's output where there is a device, else the CPU slice) and their
  ratio.

Output (``--out``, default ``benchmarks/out/encode_speed.json``, rewritten after every type):
a JSON list, first ``{"row": "header", machine, versions, config, libggml}``, then one
``{"row": "result", "type": ...}`` per type with ``weights_per_s`` and ``median_s`` for each
encoder, ``speedup_<device>_vs_llama``, ``speedup_cpu_vs_llama`` and ``error_ratio``
(ours / llama.cpp).

Usage:
    python benchmarks/encode_speed.py --libggml /path/to/libggml-base.so [--types IQ2_XXS,IQ1_S]
    python benchmarks/encode_speed.py --rows 64 --device cpu        # a quick CPU smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from quality import machine_info, versions  # noqa: E402

import dynaquant.kernels  # noqa: E402,F401  (registers the Triton searches: ours_cuda runs them)
from dynaquant.quant.codecs import dequantize, get_codec, quantize  # noqa: E402
from dynaquant.quant.formats import get_format  # noqa: E402

TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "NVFP4")
K = 14336
SEED = 0

log = logging.getLogger("encode_speed")


def make_tensor(rows: int, k: int = K, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, k) float32 weight and (k,) float32 imatrix (> 0), deterministic for a seed.

    Weights: N(0, 0.02^2) times a lognormal row scale (sigma 0.3); 0.2% of them multiplied
    by 4 + |t_3| * 8 (Student-t with 3 degrees of freedom: heavy-tailed outliers).
    Imatrix: lognormal (sigma 1).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 0.02 * torch.exp(0.3 * torch.randn(rows, 1, generator=g))
    out = (torch.rand(rows, k, generator=g) < 0.002).nonzero(as_tuple=True)
    n_out = out[0].numel()
    t3 = torch.randn(n_out, generator=g) / torch.sqrt((torch.randn(n_out, 3, generator=g) ** 2).sum(1) / 3)
    x[out] *= 4 + t3.abs() * 8
    imatrix = torch.exp(torch.randn(k, generator=g))
    return x.contiguous(), imatrix


# --------------------------------------------------------------------------- llama.cpp


def load_libggml(path: str | None) -> tuple[ctypes.CDLL | None, str | None]:
    """(library, its path) from ``path``, ``$DYNAQUANT_LIBGGML`` or llama-cpp-python; (None, None) if none."""
    path = path or os.environ.get("DYNAQUANT_LIBGGML")
    if path:
        lib = ctypes.CDLL(path)
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        lib.ggml_quantize_init.restype = None
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        return lib, path
    from ggml_ref import libggml

    lib = libggml()
    return lib, (getattr(lib, "_name", None) if lib is not None else None)


def llama_quantize(lib: ctypes.CDLL, x: np.ndarray, name: str, imatrix: np.ndarray, threads: int) -> np.ndarray:
    """llama.cpp's encoder on (rows, k) float32, rows in chunks over ``threads`` workers -> (rows, row_bytes) uint8."""
    from gguf import GGMLQuantizationType

    t = int(GGMLQuantizationType[name])
    rows, k = x.shape
    out = np.zeros((rows, get_format(name).row_bytes(k)), dtype=np.uint8)
    lib.ggml_quantize_init(t)  # once, before the threads (it builds the grids)
    chunk = max(1, rows // (4 * threads))

    def run(r0: int) -> int:
        n = min(chunk, rows - r0)
        return lib.ggml_quantize_chunk(t, x.ctypes.data, out.ctypes.data, r0 * k, n, k, imatrix.ctypes.data)

    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(run, range(0, rows, chunk)))
    assert done == out.nbytes, (done, out.nbytes)
    return out


# --------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(fn, repeats: int, device: torch.device | None = None) -> tuple[list[float], object]:
    """Wall seconds of ``repeats`` calls of ``fn`` (after its own warm-up by the caller); returns (times, last result)."""
    times, res = [], None
    for _ in range(repeats):
        if device is not None:
            _sync(device)
        t0 = time.perf_counter()
        res = fn()
        if device is not None:
            _sync(device)
        times.append(time.perf_counter() - t0)
    return times, res


def _stats(times: list[float], n_weights: int, **extra) -> dict:
    med = statistics.median(times)
    return {
        "weights": n_weights,
        "median_s": med,
        "runs_s": [round(t, 4) for t in times],
        "weights_per_s": n_weights / med if med > 0 else None,
        **extra,
    }


def weighted_error_np(x: np.ndarray, y: np.ndarray, imatrix: np.ndarray) -> float:
    """``sum(imatrix * (x - y)**2)`` in float64, row by row blocks (bounded memory)."""
    total = 0.0
    for r0 in range(0, x.shape[0], 256):
        d = x[r0 : r0 + 256].astype(np.float64) - y[r0 : r0 + 256].astype(np.float64)
        total += float((d * d * imatrix.astype(np.float64)).sum())
    return total


def bench_type(name: str, x: torch.Tensor, imatrix: torch.Tensor, args, lib, device: torch.device) -> dict:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    row: dict = {"row": "result", "type": name}
    try:
        get_codec(name)
    except KeyError:
        row["note"] = "no codec registered for this type yet: skipped"
        return row
    rows = x.shape[0]
    xn, imn = x.numpy(), imatrix.numpy()

    # (a) ours on CPU, over a slice
    cpu_rows = min(rows, args.cpu_rows)
    xs = x[:cpu_rows].contiguous()
    quantize(xs[: min(cpu_rows, 8)], name, imatrix)  # warm-up: tables, caches
    times, ours_cpu = time_runs(lambda: quantize(xs, name, imatrix), args.repeats)
    row["ours_cpu"] = _stats(times, xs.numel(), rows=cpu_rows, threads=torch.get_num_threads())

    # (b) ours on the device, whole tensor
    ours_bytes, err_rows = ours_cpu, cpu_rows
    if device.type != "cpu":
        xd, imd = x.to(device), imatrix.to(device)
        quantize(xd[: min(rows, 256)], name, imd)  # warm-up
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, ours_dev = time_runs(lambda: quantize(xd, name, imd), args.repeats, device)
        extra = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)}
        if device.type == "cuda":
            extra["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        row[f"ours_{device.type}"] = _stats(times, x.numel(), rows=rows, **extra)
        ours_bytes, err_rows = ours_dev.cpu(), rows
        del xd, imd, ours_dev

    # (c) llama.cpp, all CPU threads, whole tensor
    if lib is None:
        row["llama_note"] = "no libggml-base: pass --libggml or set DYNAQUANT_LIBGGML (or install llama-cpp-python)"
    else:
        threads = args.threads or os.cpu_count() or 1
        llama_quantize(lib, xn[: min(rows, 8)], name, imn, threads)  # warm-up (grid init)
        times, ref = time_runs(lambda: llama_quantize(lib, xn, name, imn, threads), args.repeats)
        row["llama_cpu"] = _stats(times, x.numel(), rows=rows, threads=threads)
        llama_rate = row["llama_cpu"]["weights_per_s"]
        for key in sorted({"ours_cpu", f"ours_{device.type}"}):
            if key in row and llama_rate:
                row[f"speedup_{key[5:]}_vs_llama"] = row[key]["weights_per_s"] / llama_rate
        # quality on the rows ours covered
        y_ours = dequantize(ours_bytes, name).numpy()
        y_ref = gguf_dequantize(ref[:err_rows], GGMLQuantizationType[name])
        e_ours = weighted_error_np(xn[:err_rows], y_ours, imn)
        e_ref = weighted_error_np(xn[:err_rows], y_ref, imn)
        row.update(
            error_rows=err_rows,
            weighted_error_ours=e_ours,
            weighted_error_llama=e_ref,
            error_ratio=e_ours / e_ref if e_ref > 0 else None,
        )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated GGML type names")
    p.add_argument("--rows", type=int, default=4096, help="rows of the (rows, 14336) test weight")
    p.add_argument("--cpu-rows", type=int, default=128, help="rows our CPU encoder is timed on")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device of our full-tensor run ('cpu' skips it)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per encoder (median reported)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp worker threads (default os.cpu_count())")
    p.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads for our encoder (default torch's)")
    p.add_argument("--libggml", default=None, help="path of libggml-base (else $DYNAQUANT_LIBGGML, else llama-cpp-python's)")
    p.add_argument("--out", type=Path, default=HERE / "out" / "encode_speed.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    lib, lib_path = load_libggml(args.libggml)
    x, imatrix = make_tensor(args.rows)
    header = {
        "row": "header",
        "machine": machine_info(),
        "versions": versions(None),
        "libggml": lib_path,
        "config": {
            "types": args.types.split(","),
            "shape": list(x.shape),
            "seed": SEED,
            "cpu_rows": args.cpu_rows,
            "device": str(device),
            "repeats": args.repeats,
            "llama_threads": args.threads or os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
    }
    rows: list[dict] = [header]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.types.split(","):
        name = name.strip()
        log.info("=== %s", name)
        row = bench_type(name, x, imatrix, args, lib, device)
        rows.append(row)
        args.out.write_text(json.dumps(rows, indent=1))
        log.info("%s", json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}))
    cols = ["ours_cpu"] + ([f"ours_{device.type}"] if device.type != "cpu" else []) + ["llama_cpu"]
    print("type     " + "".join(f"{c + ' w/s':>16s}" for c in cols) + "   error ours/llama")
    for r in rows[1:]:
        rates = [r.get(c, {}).get("weights_per_s") for c in cols]
        er = r.get("error_ratio")
        print(
            f"{r['type']:8s} "
            + "".join(f"{v:16.3g}" if v else " " * 16 for v in rates)
            + f"   {'' if er is None else f'{er:.4f}'} {r.get('note', '')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
