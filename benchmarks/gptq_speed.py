"""GPTQ rounding speed: the column loop in torch against the fused block kernel (issue 16's `--gptq` target).

Times :func:`dynaquant.quant.gptq.gptq_round` of random weights of Llama-3-8B's shapes (q/o 4096 x 4096, gate/up 14336
x 4096, down 4096 x 14336) with H from correlated random inputs, per type (the K-quants unless ``--formats`` names
others), with ``backend="torch"`` (the loop, ~20 torch calls a column) and ``backend="triton"`` (one launch a block,
:mod:`dynaquant.kernels.gptq_block`), ``--repeats`` runs each (the median), in the same run; the speed-up is torch's
time over the kernel's. Each row also says whether the two gave the same bytes (natively torch's ``addr_`` may
contract a multiply-add that the kernel does not, so a near-tie can round the other way) and the ratio of their
layer-output errors. The Cholesky factor is computed in both (the same work), so the times are whole ``gptq_round``
calls.

Output: JSON rows (``--out``), a header row (device, versions) then one row per (type, shape).

usage: python benchmarks/gptq_speed.py [--formats Q4_K,Q6_K] [--shapes q_o,down] [--repeats 3] [--out JSON]
       (CUDA; ``--device cpu --rows 8 --cols 512`` runs a smoke version, the kernel in Triton's interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {"q_o": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}
FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"]


def _problem(n: int, k: int, device: str):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, generator=g) * torch.exp(0.5 * torch.randn(n, 1, device=device, generator=g))
    mix = torch.eye(k, device=device) + 0.3 * torch.randn(k, k, device=device, generator=g) / k ** 0.5
    x = torch.randn(2 * k, k, device=device, generator=g) @ mix
    return w, x.T @ x / x.shape[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, help="cut every shape to this many rows (a smoke run)")
    p.add_argument("--cols", type=int, help="cut every shape to this many columns, a multiple of 256 (a smoke run)")
    p.add_argument("--out", type=Path, default=HERE / "out" / "gptq_speed.json")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    import torch
    import triton

    import dynaquant.kernels  # noqa: F401  (registers the fast paths)
    from dynaquant.quant.gptq import gptq_round, output_error

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("needs CUDA (or --device cpu for a smoke run)")

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    rows = [{"row": "header", "script": "benchmarks/gptq_speed.py", "device": torch.cuda.get_device_name()
             if args.device == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
             "repeats": args.repeats, "timing": "median wall time of whole gptq_round calls, synchronized"}]
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        n, k = args.rows or n, args.cols or k
        w, h = _problem(n, k, args.device)
        for fmt in args.formats.split(","):
            res = {}
            for backend in ("torch", "triton"):
                gptq_round(w[: min(n, 64), :256], fmt, h[:256, :256], backend=backend)  # compile / warm up
                times = []
                for _ in range(args.repeats):
                    sync()
                    t = time.perf_counter()
                    r = gptq_round(w, fmt, h, backend=backend)
                    sync()
                    times.append(time.perf_counter() - t)
                res[backend] = (statistics.median(times), r)
            (tt, rt), (tk, rk) = res["torch"], res["triton"]
            row = {"row": "result", "format": fmt, "shape": shape, "n": n, "k": k, "torch_s": tt, "kernel_s": tk,
                   "speedup": tt / tk, "columns_per_s_kernel": k / tk, "bytes_equal": bool(torch.equal(rt.data, rk.data)),
                   "output_error_ratio": output_error(w, rk.decoded, h) / output_error(w, rt.decoded, h)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
