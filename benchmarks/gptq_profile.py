"""Where a ``dynaquant quantize --gptq`` run's tensor loop spends its time: per GGML type and weight shape.

Runs ``dynaquant quantize ARGS`` in this process with :func:`dynaquant.quant.gptq.gptq_round` and the plain encoder of
the GPTQ step (``dynaquant.pipeline.gptq.encode_tensor``, called only where the corrections' bytes were not kept)
wrapped: each call timed (on CUDA synchronized before and after, so a call's time is its own), summed per (kind,
type, shape). The run's own JSON (``--json`` among ARGS) is printed as the CLI prints it.

Output (``--out``): a JSON object ``{"elapsed_s", "calls", "args", "rows": {"gptq|Q4_K|4096x4096": [calls, seconds],
...}}``, rows by descending time, rewritten every 10 calls, so that a run stopped at a time limit still leaves what it
measured.

usage: python benchmarks/gptq_profile.py --out prof.json -- quantize CKPT --bpw 4.5 --gptq --device cuda --no-eval --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path


class CallTimes:
    """Seconds and calls per (kind, type, shape), written to ``out`` every ``every`` calls."""

    def __init__(self, out: Path, args: list[str], every: int = 10):
        self.out, self.args, self.every = out, args, every
        self.rows: dict[tuple[str, str, str], list] = defaultdict(lambda: [0, 0.0])
        self.calls, self.t0 = 0, time.perf_counter()

    def wrap(self, kind: str, fn):
        import torch

        def sync():
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def timed(w, fmt, *a, **k):
            sync()
            t = time.perf_counter()
            r = fn(w, fmt, *a, **k)
            sync()
            row = self.rows[(kind, fmt if isinstance(fmt, str) else fmt.name, "x".join(map(str, w.shape)))]
            row[0] += 1
            row[1] += time.perf_counter() - t
            self.calls += 1
            if self.calls % self.every == 0:
                self.write()
            return r
        return timed

    def write(self) -> None:
        rows = {"|".join(k): [v[0], round(v[1], 6)] for k, v in sorted(self.rows.items(), key=lambda kv: -kv[1][1])}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"elapsed_s": round(time.perf_counter() - self.t0, 3), "calls": self.calls,
                                   "args": self.args, "rows": rows}, indent=1))
        tmp.replace(self.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON of the per-type times")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the dynaquant command line (after --)")
    a = p.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not args or args[0] != "quantize" or "--gptq" not in args:
        p.error("give a dynaquant quantize command line with --gptq after --")
    import dynaquant.pipeline.gptq as step
    from dynaquant.cli import main as cli

    times = CallTimes(a.out, args)
    step.gptq_round = times.wrap("gptq", step.gptq_round)
    step.encode_tensor = times.wrap("plain", step.encode_tensor)
    try:
        return cli(args)
    finally:
        times.write()


if __name__ == "__main__":
    sys.exit(main())
