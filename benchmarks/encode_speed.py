"""Encode speed and quality of every encoder against llama.cpp's, measured in one run.

For each type (by default every GGUF type with a codec: ``Q4_0 .. Q8_0``, ``Q2_K .. Q6_K``, ``IQ4_NL IQ4_XS IQ3_XXS
IQ3_S IQ2_XXS IQ2_XS IQ2_S IQ1_S IQ1_M MXFP4 NVFP4``, then the runtime formats ``INT{2,3,4,8}_G128[_ASYM]``,
``MXFP4_G32``, ``NVFP4_G16``; ``--types gguf|runtime|all`` or a comma list; a type without a registered codec
gets a row saying so) on one synthetic ``--rows`` x 14336 float32 weight (Gaussian rows with lognormal scales and
0.2% heavy-tailed outliers, fixed seed) with a random positive (14336,) imatrix:

* ``ours_cpu``: ``dynaquant.quant.codecs.quantize`` on CPU with ``--cpu-threads`` torch threads (default: torch's)
  over the first rows (at most ``--cpu-rows``, fewer where a run would take over ``--cpu-seconds``, estimated from
  a timed one-row probe after the warm-up; the rate is per weight), median of ``--repeats`` runs;
* ``ours_<device>``: the same on ``--device`` (default ``cuda`` when available) over the whole tensor, the weight
  and imatrix already on the device, synchronized, warm-up first, median of ``--repeats``; the host-to-device copy
  of the weight (``h2d_s``) and the device-to-host copy of the bytes (``d2h_s``) are timed on their own (medians)
  and only enter ``weights_per_s_with_transfers``;
* ``llama_cpu``: llama.cpp's ``ggml_quantize_chunk`` through ctypes over the whole tensor, rows split into chunks
  run by a ThreadPoolExecutor of ``--cpu-threads`` (else ``--threads``, else ``os.cpu_count()``) workers (ctypes
  releases the GIL), median of ``--repeats``; only for GGUF types the library knows (``ggml_type_name``), so
  the runtime formats have no anchor. The library is ``--libggml PATH``, else ``$DYNAQUANT_LIBGGML``, else the
  libggml-base of llama-cpp-python (``tests/ggml_ref.py``);
* the importance-weighted error ``sum(imatrix * (W - Q(W))**2)`` of ours and of llama.cpp's on the same rows (the
  device's output where there is a device, else the CPU slice), both decoded by ``dynaquant.quant.codecs.dequantize``
  on the device (bit-exact with gguf-py's decoders: the oracle tests in ``tests/test_codecs_*``), its ratio, and
  each relative to ``sum(imatrix * W**2)``; ``error_ratio_cpu`` compares ours on CPU with llama.cpp on the CPU slice.

Output (``--out``, default ``benchmarks/out/encode_speed.json``, rewritten after every type): a JSON list, first
``{"row": "header", machine, versions, config, libggml}``, then one ``{"row": "result", "type": ...}`` per type
with ``weights_per_s`` and ``median_s`` for each encoder, ``speedup_<device>_vs_llama``, ``speedup_cpu_vs_llama``,
``error_ratio`` (ours / llama.cpp), ``relative_error_ours`` / ``relative_error_llama``, and on CUDA the issue's
targets (``target_weights_per_s``: 1e9 GGUF, 2e9 runtime; ``target_speedup``: 15 for legacy and K-quants) with
``meets_target``. ``--resume`` keeps the rows of an existing ``--out`` (same shape) and runs only the missing types,
so one list can be measured over several calls. ``--summary`` prints the table of an existing ``--out`` (markdown)
and runs nothing.

Usage:
    python benchmarks/encode_speed.py --libggml /path/to/libggml-base.so --cpu-threads 16          # every type, H100
    python benchmarks/encode_speed.py --device cpu --cpu-threads 2 --rows 256 --cpu-rows 256      # CPU vs llama.cpp
    python benchmarks/encode_speed.py --summary --out benchmarks/out/encode_speed.json
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

GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
              "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4", "NVFP4")
RUNTIME_TYPES = (*(f"INT{b}_G128{s}" for b in (2, 3, 4, 8) for s in ("", "_ASYM")), "MXFP4_G32", "NVFP4_G16")
TYPE_SETS = {"gguf": GGUF_TYPES, "runtime": RUNTIME_TYPES, "all": GGUF_TYPES + RUNTIME_TYPES}
TYPES = TYPE_SETS["all"]
K = 14336
SEED = 0
# issue 16's targets on an H100: weights/s of every GGUF / runtime encoder, and the speed-up over llama.cpp's
# threads for the legacy types and K-quants
TARGET_GGUF, TARGET_RUNTIME, TARGET_SPEEDUP = 1e9, 2e9, 15.0

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


def parse_types(spec: str) -> list[str]:
    """``gguf``, ``runtime``, ``all`` or a comma list of format names (the sets may be mixed in: ``gguf,INT4_G32``)."""
    out: list[str] = []
    for part in (s.strip() for s in spec.split(",")):
        for name in TYPE_SETS.get(part.lower(), (part,) if part else ()):
            if name not in out:
                out.append(name)
    return out


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
    else:
        from ggml_ref import libggml

        lib = libggml()
        path = getattr(lib, "_name", None) if lib is not None else None
    if lib is not None:
        lib.ggml_type_name.restype = ctypes.c_char_p
        lib.ggml_type_name.argtypes = [ctypes.c_int]
    return lib, path


def llama_has_type(lib: ctypes.CDLL, name: str) -> bool:
    """Whether the library's type table has GGUF type ``name`` under the id gguf-py gives it (so a type added to
    llama.cpp after the library was built is skipped, not an abort inside ``ggml_quantize_chunk``)."""
    from gguf import GGMLQuantizationType

    if get_format(name).ggml_type is None or name not in GGMLQuantizationType.__members__:
        return False
    got = lib.ggml_type_name(int(GGMLQuantizationType[name]))
    return got is not None and got.decode().upper() == name


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


def weighted_error(x: torch.Tensor, y: torch.Tensor, imatrix: torch.Tensor) -> float:
    """``sum(imatrix * (x - y)**2)`` in float64 on x's device, in blocks of 256 rows (bounded memory)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    im = imatrix.to(x.device, torch.float64)
    for r0 in range(0, x.shape[0], 256):
        d = x[r0 : r0 + 256].to(torch.float64) - y[r0 : r0 + 256].to(x.device, torch.float64)
        total += (d * d * im).sum()
    return float(total)


def _errors(x: torch.Tensor, imatrix: torch.Tensor, ours: torch.Tensor, ref: np.ndarray | None, name: str) -> dict:
    """Weighted errors of ours (and llama.cpp's ``ref`` bytes, when given) on x's rows, decoded on x's device."""
    dev = x.device
    scale = weighted_error(x, torch.zeros_like(x[:1]).expand_as(x), imatrix)
    e_ours = weighted_error(x, dequantize(ours.to(dev), name), imatrix)
    out = {"error_rows": x.shape[0], "weighted_error_ours": e_ours, "relative_error_ours": e_ours / scale}
    if ref is not None:
        e_ref = weighted_error(x, dequantize(torch.from_numpy(ref).to(dev), name), imatrix)
        out.update(weighted_error_llama=e_ref, relative_error_llama=e_ref / scale,
                   error_ratio=e_ours / e_ref if e_ref > 0 else None)
    return out


# --------------------------------------------------------------------------- one type


def bench_cpu(name: str, x: torch.Tensor, imatrix: torch.Tensor, args) -> tuple[dict, torch.Tensor]:
    """Ours on CPU over the first rows (at most ``--cpu-rows``, a run of about ``--cpu-seconds`` at most)."""
    k = x.shape[1]
    quantize(x[:1], name, imatrix)  # warm-up: tables, caches
    t0 = time.perf_counter()
    quantize(x[:1], name, imatrix)  # probe: the rate that sizes the timed slice (one row: slow paths stay cheap)
    probe_s = time.perf_counter() - t0
    rows = min(x.shape[0], args.cpu_rows or x.shape[0])
    if args.cpu_seconds and probe_s > 0:
        rows = max(1, min(rows, int(args.cpu_seconds / probe_s)))
    xs = x[:rows].contiguous()
    times, out = time_runs(lambda: quantize(xs, name, imatrix), args.repeats)
    return _stats(times, rows * k, rows=rows, threads=torch.get_num_threads(), probe_s=round(probe_s, 4)), out


def bench_device(name: str, x: torch.Tensor, imatrix: torch.Tensor, args, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Ours on ``device`` over the whole tensor, already there; the transfers timed apart."""
    h2d, _ = time_runs(lambda: x.to(device), args.repeats, device)
    xd, imd = x.to(device), imatrix.to(device)
    quantize(xd[: min(x.shape[0], 256)], name, imd)  # warm-up
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, out = time_runs(lambda: quantize(xd, name, imd), args.repeats, device)
    d2h, _ = time_runs(lambda: out.cpu(), args.repeats, device)
    extra = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)}
    if device.type == "cuda":
        extra["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    h2d_s, d2h_s = statistics.median(h2d), statistics.median(d2h)
    st = _stats(times, x.numel(), rows=x.shape[0], h2d_s=h2d_s, h2d_bytes=x.numel() * x.element_size(),
                d2h_s=d2h_s, d2h_bytes=out.numel(), **extra)
    st["weights_per_s_with_transfers"] = x.numel() / (st["median_s"] + h2d_s + d2h_s)
    if args.torch_baseline and get_codec(name).fast_paths:  # the torch reference on the same device: the before
        quantize(xd[: min(x.shape[0], 256)], name, imd, backend="torch")
        t_times, t_out = time_runs(lambda: quantize(xd, name, imd, backend="torch"), args.repeats, device)
        st["torch_reference"] = _stats(t_times, x.numel(), rows=x.shape[0])
        st["speedup_vs_torch_reference"] = st["weights_per_s"] / st["torch_reference"]["weights_per_s"]
        st["torch_reference"].update(_errors(xd, imd, t_out, None, name))
        del t_out
    return st, out


def bench_type(name: str, x: torch.Tensor, imatrix: torch.Tensor, args, lib, device: torch.device) -> dict:
    row: dict = {"row": "result", "type": name}
    try:
        get_codec(name)
        fmt = get_format(name)
    except KeyError:
        row["note"] = "no codec registered for this type yet: skipped"
        return row
    row["target"] = fmt.target
    rows = x.shape[0]

    row["ours_cpu"], ours_cpu = bench_cpu(name, x, imatrix, args)
    cpu_rows = row["ours_cpu"]["rows"]
    ours_dev = None
    dev_key = f"ours_{device.type}"
    if device.type != "cpu":
        row[dev_key], ours_dev = bench_device(name, x, imatrix, args, device)

    ref = None
    if fmt.ggml_type is None:
        row["llama_note"] = "runtime format: no llama.cpp encoder"
    elif lib is None:
        row["llama_note"] = "no libggml-base: pass --libggml or set DYNAQUANT_LIBGGML (or install llama-cpp-python)"
    elif not llama_has_type(lib, name):
        row["llama_note"] = f"this libggml has no {name}"
    else:
        xn, imn = x.numpy(), imatrix.numpy()
        threads = args.llama_threads
        llama_quantize(lib, xn[: min(rows, 8)], name, imn, threads)  # warm-up (grid init)
        times, ref = time_runs(lambda: llama_quantize(lib, xn, name, imn, threads), args.repeats)
        row["llama_cpu"] = _stats(times, x.numel(), rows=rows, threads=threads)
        llama_rate = row["llama_cpu"]["weights_per_s"]
        for key in sorted({"ours_cpu", dev_key}):
            if key in row and llama_rate:
                row[f"speedup_{key[5:]}_vs_llama"] = row[key]["weights_per_s"] / llama_rate

    # quality: ours on the device's rows (else the CPU slice) against llama.cpp on the same rows
    err_dev = device if ours_dev is not None else torch.device("cpu")
    err_rows = rows if ours_dev is not None else cpu_rows
    row.update(_errors(x[:err_rows].to(err_dev), imatrix, ours_dev if ours_dev is not None else ours_cpu,
                       None if ref is None else ref[:err_rows], name))
    if ours_dev is not None and ref is not None:  # ours on CPU against llama.cpp on the CPU slice
        cpu_err = _errors(x[:cpu_rows], imatrix, ours_cpu, ref[:cpu_rows], name)
        row["error_ratio_cpu"] = cpu_err.get("error_ratio")
    if device.type == "cuda":
        row.update(_targets(row, fmt, dev_key))
    return row


def _targets(row: dict, fmt, dev_key: str) -> dict:
    """The issue's H100 targets for this type and whether the row meets them."""
    rate = row.get(dev_key, {}).get("weights_per_s") or 0.0
    out = {"target_weights_per_s": TARGET_GGUF if fmt.ggml_type is not None else TARGET_RUNTIME}
    ok = rate >= out["target_weights_per_s"]
    if fmt.kind in ("legacy", "kquant"):
        out["target_speedup"] = TARGET_SPEEDUP
        ok = ok and (row.get(f"speedup_{dev_key[5:]}_vs_llama") or 0.0) >= TARGET_SPEEDUP
    if row.get("error_ratio") is not None:
        ok = ok and row["error_ratio"] <= 1.0
    out["meets_target"] = ok
    return out


# --------------------------------------------------------------------------- table


def summary(rows: list[dict]) -> str:
    """The markdown table of a result list: rates, speed-ups, error ratios, targets."""
    head = rows[0] if rows and rows[0].get("row") == "header" else {}
    dev = head.get("config", {}).get("device", "cpu").split(":")[0]
    thr = head.get("config", {}).get("llama_threads")

    def g(v, f="{:.3g}"):
        return "" if v is None else f.format(v)

    cols = [("type", lambda r: r["type"])]
    if dev != "cpu":
        cols += [(f"ours, {dev} w/s", lambda r: g(r.get(f"ours_{dev}", {}).get("weights_per_s"))),
                 ("h2d s", lambda r: g(r.get(f"ours_{dev}", {}).get("h2d_s"), "{:.3f}"))]
    cols += [("ours, CPU w/s", lambda r: g(r.get("ours_cpu", {}).get("weights_per_s"))),
             (f"llama.cpp, {thr} threads w/s", lambda r: g(r.get("llama_cpu", {}).get("weights_per_s")) or r.get("llama_note", "")),
             *([(f"ratio {dev}", lambda r: g(r.get(f"speedup_{dev}_vs_llama"), "{:.2f}x"))] if dev != "cpu" else []),
             ("ratio CPU", lambda r: g(r.get("speedup_cpu_vs_llama"), "{:.2f}x")),
             ("weighted error ours / llama.cpp", lambda r: g(r.get("error_ratio"), "{:.3f}")),
             ("relative error ours", lambda r: g(r.get("relative_error_ours"), "{:.3e}")),
             ("meets target", lambda r: {None: "", True: "yes", False: "no"}[r.get("meets_target")]),
             ("note", lambda r: r.get("note", ""))]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in rows if r.get("row") == "result"]
    return "\n".join(lines)


def iq3_fused_flags() -> dict:
    """The IQ3 encoder's one-launch switches in force (``dynaquant.quant.codecs.iq3.FUSED_FLAGS``)."""
    from dynaquant.quant.codecs import iq3

    return {k: getattr(iq3, k) for k in iq3.FUSED_FLAGS}


def set_iq3_fused(value: str) -> None:
    """Set the IQ3 one-launch switches from ``--iq3-fused``: ``none`` or comma-separated names of
    ``iq3.FUSED_FLAGS`` without ``FUSED_`` (``levels,step1``); the named ones on, the others off.

    Raises ValueError for a name that is not a switch."""
    from dynaquant.quant.codecs import iq3

    on = {"FUSED_" + n.strip().upper() for n in value.split(",") if n.strip() and n.strip() != "none"}
    if on - set(iq3.FUSED_FLAGS):
        raise ValueError(f"--iq3-fused: {sorted(on - set(iq3.FUSED_FLAGS))} not of {list(iq3.FUSED_FLAGS)}")
    for k in iq3.FUSED_FLAGS:
        setattr(iq3, k, k in on)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="all", help="gguf, runtime, all (default) or comma-separated format names")
    p.add_argument("--rows", type=int, default=4096, help="rows of the (rows, 14336) test weight")
    p.add_argument("--cpu-rows", type=int, default=128, help="rows our CPU encoder is timed on, at most (0: all)")
    p.add_argument("--cpu-seconds", type=float, default=5.0,
                   help="fewer CPU rows where one run would take longer than this (from a one-row probe; 0: off)")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device of our full-tensor run ('cpu' skips it)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per encoder (median reported)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU threads of both llama.cpp and our CPU encoder (the same cores; default: see the next two)")
    p.add_argument("--threads", type=int, default=None,
                   help="llama.cpp worker threads (default --cpu-threads, else os.cpu_count())")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch CPU threads for our encoder (default --cpu-threads, else torch's)")
    p.add_argument("--libggml", default=None, help="path of libggml-base (else $DYNAQUANT_LIBGGML, else llama-cpp-python's)")
    p.add_argument("--torch-baseline", action="store_true",
                   help="also time the torch reference on the device for codecs with fast paths (backend='torch')")
    p.add_argument("--iq3-fused", default=None, metavar="none|levels,step1",
                   help="the IQ3 one-launch switches on for this run (dynaquant.quant.codecs.iq3.FUSED_FLAGS without "
                        "FUSED_, comma-separated; the others off; default: the module's)")
    p.add_argument("--out", type=Path, default=HERE / "out" / "encode_speed.json")
    p.add_argument("--resume", action="store_true", help="keep the result rows of an existing --out, run the missing types")
    p.add_argument("--summary", action="store_true", help="print the table of an existing --out and exit")
    args = p.parse_args(argv)
    if args.summary:
        print(summary(json.loads(args.out.read_text())))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    torch_threads = args.torch_threads or args.cpu_threads
    if torch_threads:
        torch.set_num_threads(torch_threads)
    args.llama_threads = args.threads or args.cpu_threads or os.cpu_count() or 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    lib, lib_path = load_libggml(args.libggml)
    types = parse_types(args.types)
    if args.iq3_fused is not None:
        try:
            set_iq3_fused(args.iq3_fused)
        except ValueError as e:
            p.error(str(e))
    x, imatrix = make_tensor(args.rows)
    header = {
        "row": "header",
        "machine": machine_info(),
        "versions": versions(None),
        "libggml": lib_path,
        "config": {
            "types": types,
            "shape": list(x.shape),
            "seed": SEED,
            "cpu_rows": args.cpu_rows,
            "cpu_seconds": args.cpu_seconds,
            "device": str(device),
            "repeats": args.repeats,
            "llama_threads": args.llama_threads,
            "torch_threads": torch.get_num_threads(),
            "error_decoder": "dynaquant.quant.codecs.dequantize on the device (both encoders' bytes)",
            "iq3_fused": iq3_fused_flags(),
        },
    }
    rows: list[dict] = [header]
    if args.resume and args.out.exists():
        old = json.loads(args.out.read_text())
        if old and old[0].get("config", {}).get("shape") == header["config"]["shape"]:
            rows += [r for r in old[1:] if r.get("row") == "result" and r.get("type") in types]
            header["resumed_from"] = old[0].get("machine", {}).get("loadavg_start")
    done = {r["type"] for r in rows[1:]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in types:
        if name in done:
            continue
        log.info("=== %s", name)
        rows.append(bench_type(name, x, imatrix, args, lib, device))
        rows[1:] = sorted(rows[1:], key=lambda r: types.index(r["type"]))
        args.out.write_text(json.dumps(rows, indent=1))
        log.info("%s", json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, dict)}))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(rows, indent=1))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
