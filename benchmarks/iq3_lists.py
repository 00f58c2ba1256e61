"""IQ3 encode on CUDA: off-grid variants through their exact candidate lists against the whole-grid walk (issue 16).

Times ``dynaquant.quant.codecs.quantize`` of a random 4096 x 14336 float32 tensor with an importance vector, per
IQ3 type, with the fused assignment's ``lists=True`` and ``lists=False`` (:func:`dynaquant.kernels.iq3_search.
nearest_variants`), 3 runs each (the median), and compares the two encodings' bytes (both are exact searches;
they can differ only where float32 rounding breaks a near-tie the other way).

usage: python benchmarks/iq3_lists.py [--out JSON]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

import dynaquant.kernels  # noqa: F401  (registers the fast paths)
from dynaquant.kernels import iq3_search
from dynaquant.quant.codecs import fastpaths, quantize

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "out" / "iq3-lists.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 14336, device="cuda", generator=g)
    imp = torch.rand(14336, device="cuda", generator=g) + 0.05
    out = {}
    try:
        for fmt in ["IQ3_XXS", "IQ3_S"]:
            res = {}
            for lists in (True, False):
                fastpaths.register("iq3.nearest_variants",
                                   lambda lists=lists: functools.partial(iq3_search.nearest_variants, lists=lists))
                quantize(x[:512], fmt, imp)
                torch.cuda.synchronize()
                ts = []
                for _ in range(3):
                    t = time.perf_counter()
                    b = quantize(x, fmt, imp)
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t)
                res[lists] = (sorted(ts)[1], b)
            out[fmt] = {"lists_s": res[True][0], "whole_grid_s": res[False][0],
                        "weights_per_s_lists": x.numel() / res[True][0],
                        "weights_per_s_whole_grid": x.numel() / res[False][0],
                        "bytes_equal": torch.equal(res[True][1], res[False][1]),
                        "rows_equal": (res[True][1] == res[False][1]).all(1).float().mean().item()}
            print(fmt, out[fmt], flush=True)
    finally:
        fastpaths.register("iq3.nearest_variants", lambda: iq3_search.nearest_variants)  # the default again
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "script": "benchmarks/iq3_lists.py",
                                    "shape": list(x.shape), "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
