"""IQ3_XXS / IQ3_S encode on CUDA: the fused search's configurations against the former defaults (issue 16).

Configurations of dynaquant.kernels.iq3_search (module flags, set per run):
  old          PACKED=False, SUMS=False, CONSIDER=False, LISTS_FROM=512, BLOCK 128 / 4 warps: the defaults before
               2026-12-07 (float-table loads, (n, 8, 32) terms written and summed by torch, step 1's update in torch; IQ3_XXS
               walks the whole grid, IQ3_S its candidate lists)
  new          PACKED=True, SUMS=True, CONSIDER=True, LISTS_FROM=512, BLOCK 128 / 4 warps (packed words, sub-block
               sums and step 1's running best in the kernel)
  new_lists    as new with LISTS_FROM=256 (IQ3_XXS walks its exact candidate lists too): today's defaults
  new_lists64  as new_lists with BLOCK 64 / 2 warps (smaller programs: shorter list walks)
  new_lists32  as new_lists with BLOCK 32 / 1 warp
  prefetch     as new_lists with PREFETCH=True: a list walk loads candidate k + 1's word before it scores candidate k
  prefetch64   as prefetch with BLOCK 64 / 2 warps
  prefetch32   as prefetch with BLOCK 32 / 1 warp (the default since session 34)
  levels       as prefetch32 with dynaquant.quant.codecs.iq3.FUSED_LEVELS (a round's levels l, l + 1, l - 1 in one
               launch, iq3.exact_levels; the same bytes): built in session 36 without a GPU, to be measured
  step1        as prefetch32 with iq3.FUSED_STEP1 (step 1's candidate scales and Lloyd steps in one launch, iq3.step1;
               the same bytes): likewise
  fused        both
Session 35 also built and measured (H100, out/iq3-configs-order-merge-h100.json; the code was removed): the lanes
taken in the order of their counted list-walk work (a stable argsort once a chunk, the sub-block sums then added by a
second kernel), and a lane's list walks merged into one loop (the halves and IQ3_XXS's flipped variants one after the
other: 90 SASS instructions a step against the separate walk's 53). Counted on a random tensor's scales a warp's
loop steps fall from 140-152 to 75-112 in that order, and to 28-47 merged in that order, yet every variant was slower
than prefetch32: IQ3_XXS 8.85e8 (prefetch32) / 7.06e8 (ordered) / 6.68e8 (merged) / 6.17e8 (both), IQ3_S 1.54e9 /
1.06e9 / 1.22e9 / 1.07e9 (the same bytes merged; ordered, the sub-block sums add in another order on CUDA: 99 % of
rows equal). So the walk's time is not its loop steps; a likely reason, not measured: neighbouring groups in memory
order walk the same candidate rows (one L2 sector serves many lanes), which sorted or merged lanes no longer share.
The first configuration is the base of the ratios and byte comparisons (``old`` by default; ``--configs
new_lists,prefetch,prefetch64`` compares the prefetching walk with the plain one). Session 33 also tried walks taking
4, 8 or 16 candidates a step as a (lanes, C) tile, the tile's leftmost maximum (the same bytes): IQ3_XXS 3.3e8 /
2.6e8 / 1.2e8 weights/s against the plain walk's 8.1e8 (out/iq3-configs-tiles-h100.json): the code was removed.
Times ``dynaquant.quant.codecs.quantize`` of a random 4096 x 14336 float32 tensor with a random positive imatrix
(median of 7 runs after 2 warm-ups, CUDA synchronized), prints weights/s, the weighted error ratio to the base, the
bytes / rows equal to the base, a gguf-py decode check of the new bytes, a torch.profiler top-15 CUDA kernel table of one
encode under the fastest new configuration, and one JSON line at the end.

``--breakdown``: one encode of each type under the defaults, its search launches' CUDA time by kind and the time
outside them (H100, session 35, out/iq3-breakdown-h100-s35.json, the code before session 36: IQ3_XXS 66.5 ms wall,
47.6 ms in 72 assignment launches: step 1's 40 candidate scales 24.6 ms, 24 exact-error assignments 15.0 ms, 4
full-flip ones 5.5 ms, 4 with indices 2.5 ms; ~19 ms outside them). Session 36 (no GPU) moved most of those 19 ms
into the launches, by the byte counts of the torch ops a chunk of 65 520 super-blocks runs around them (IQ3_XXS, a
CPU stand-in of the CUDA path: ``--op-bytes``): 6.2 GB in 257 ops before, 1.9 GB in 177 after (IQ3_S 6.5 GB / 246
ops -> 2.3 GB / 167), with the ``levels`` configuration 1.1 GB in 105 (IQ3_S 1.5 GB / 95); the exact
errors' launches now also form the least-squares sums the next round starts from (no torch pass over the points),
the fp16 scale pick is one launch that makes its candidates and keeps the winner (no (n, C, 8) float64 errors written
and summed), the rounds select uint8 / int16 indices, not int64.

``--choose CONFIGS_TXT``: the ``--iq3-fused`` value for encode_speed.py from a ``--configs`` run's output (no GPU).

usage: python3 benchmarks/iq3_configs.py [--configs old,new,new_lists,new_lists64,new_lists32] [--breakdown] (GPU)
       python3 benchmarks/iq3_configs.py --op-bytes (CPU)
H100 runs: benchmarks/out/iq3-configs-h100.json (2026-12-07, old .. new_lists32), iq3-configs-tiles-h100.json (tiles).
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

import dynaquant.kernels  # noqa: F401  (registers the fast paths)
from dynaquant.kernels import iq3_scales
from dynaquant.kernels import iq3_search as ks
from dynaquant.quant.codecs import dequantize, iq3, quantize

_BASE = dict(PACKED=True, SUMS=True, CONSIDER=True, LISTS_FROM=256, _BLOCK=128, _WARPS=4, PREFETCH=False)  # "new_lists"


def _cfg(**kw):
    return {**_BASE, **kw}


CONFIGS = {
    "old": _cfg(PACKED=False, SUMS=False, CONSIDER=False, LISTS_FROM=512),
    "new": _cfg(LISTS_FROM=512),
    "new_lists": _cfg(),
    "new_lists64": _cfg(_BLOCK=64, _WARPS=2),
    "new_lists32": _cfg(_BLOCK=32, _WARPS=1),
    "prefetch": _cfg(PREFETCH=True),
    "prefetch64": _cfg(PREFETCH=True, _BLOCK=64, _WARPS=2),
    "prefetch32": _cfg(PREFETCH=True, _BLOCK=32, _WARPS=1),
    "levels": _cfg(PREFETCH=True, _BLOCK=32, _WARPS=1, FUSED_LEVELS=True),
    "step1": _cfg(PREFETCH=True, _BLOCK=32, _WARPS=1, FUSED_STEP1=True),
    "fused": _cfg(PREFETCH=True, _BLOCK=32, _WARPS=1, FUSED_LEVELS=True, FUSED_STEP1=True),
}
DEFAULT_CONFIGS = ("old", "new", "new_lists", "new_lists64")  # --configs to choose (each compiles its own kernels)
CODEC_FLAGS = iq3.FUSED_FLAGS  # flags of dynaquant.quant.codecs.iq3 (the rest are iq3_search's)
DEFAULTS = {k: getattr(iq3 if k in CODEC_FLAGS else ks, k) for k in CONFIGS["fused"]}


def configure(name):
    for k, v in {**dict.fromkeys(CODEC_FLAGS, False), **CONFIGS[name]}.items():
        setattr(iq3 if k in CODEC_FLAGS else ks, k, v)


def timed(x, fmt, imp, reps=7, warm=2):
    for _ in range(warm):
        quantize(x, fmt, imp)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        b = quantize(x, fmt, imp)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), b


def werr(x, b, fmt, imp):
    y = dequantize(b, fmt).reshape(x.shape)
    return float((imp * (x - y).double() ** 2).sum())


def gguf_ok(b, fmt, rows=64):
    import gguf

    qt = getattr(gguf.GGMLQuantizationType, fmt)
    ref = gguf.quants.dequantize(b[:rows].cpu().numpy(), qt)
    ours = dequantize(b[:rows], fmt).cpu().numpy()
    return bool(np.array_equal(ref.view(np.uint32), ours.reshape(ref.shape).view(np.uint32)))


def breakdown(x, imp):
    """One encode of each IQ3 type under today's defaults: its wall time and the CUDA time of its search launches by
    kind, by CUDA events around each launch: ``assign`` (V variants, OUT 0 stats / 1 error, IDX, SUMS, BEST, STATS:
    step 1's candidates are (V, 0, False, True, True, False), the exact errors with their sums (V, 1, True, True, False,
    True)), ``pick`` (the fp16 scale pick) and ``levels`` (a round's levels in one launch, where on); ``outside_ms``:
    the wall time not in them (torch ops, launch gaps)."""
    import collections

    kernels = {"assign": (ks, "assign_kernel"), "levels": (ks, "exact_levels_kernel"), "step1": (ks, "step1_kernel"),
               "pick": (iq3_scales, "pick_kernel")}
    origs = {name: getattr(mod, attr) for name, (mod, attr) in kernels.items()}
    rec = []

    class Timed:  # kernel[grid](...) with events around the launch
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*a, **k):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                origs[self.name][grid](*a, **k)
                e1.record()
                key = self.name
                if self.name == "assign":
                    key += str((k["V"], k["OUT"], k["IDX"], k["SUMS"], k["BEST"], k["STATS"]))
                rec.append((key, e0, e1))
            return launch

    out = {}
    for fmt in ("IQ3_XXS", "IQ3_S"):
        quantize(x, fmt, imp)
        torch.cuda.synchronize()
        rec.clear()
        for name, (mod, attr) in kernels.items():
            setattr(mod, attr, Timed(name))
        try:
            t = time.perf_counter()
            quantize(x, fmt, imp)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        finally:
            for name, (mod, attr) in kernels.items():
                setattr(mod, attr, origs[name])
        agg = collections.defaultdict(lambda: [0, 0.0])
        for key, e0, e1 in rec:
            agg[key][0] += 1
            agg[key][1] += e0.elapsed_time(e1)
        inside = sum(v[1] for v in agg.values())
        out[fmt] = {"wall_ms": round(wall * 1e3, 2), "launches_ms": round(inside, 2),
                    "outside_ms": round(wall * 1e3 - inside, 2),
                    "by_kind": {k: {"calls": v[0], "ms": round(v[1], 2)} for k, v in agg.items()}}
    return out


def op_bytes(fmt: str, n: int = 256, chunk: int = 65520) -> dict:
    """The torch ops an encode runs around its fast paths, counted on the CPU (no GPU needed): ``fmt``'s full search
    (the knobs other devices run) on ``n`` random super-blocks, each fast path replaced by its torch reference (not
    counted: a launch on CUDA), every other aten op's operand and result bytes (views excluded) scaled to a CUDA chunk
    of ``chunk`` super-blocks (16.7M weights). Returns the launches by fast path, the op count and the bytes."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from dynaquant.quant.codecs import _lattice as lat
    from dynaquant.quant.codecs import fastpaths, get_codec

    views = {"view", "slice", "unsqueeze", "squeeze", "detach", "permute", "expand", "select", "alias", "t",
             "transpose", "_unsafe_view", "as_strided", "lift_fresh"}
    paused, ops, launches = [False], collections.Counter(), collections.Counter()
    nbytes = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if not paused[0] and name not in views:
                ops[name] += 1
                nbytes[name] += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                    if isinstance(t, torch.Tensor))
            return out

    def reference(name):
        module, attr = fastpaths.NAMES[name].rsplit(".", 1)
        fn = getattr(__import__(module, fromlist=[attr]), attr)

        def run(*a, **k):
            paused[0] = True
            launches[name] += 1
            try:
                return fn(*a, **k)
            finally:
                paused[0] = False
        return run

    codec = get_codec(fmt)
    real_fast, real_knob = lat.fast_path, type(codec)._knob
    lat.fast_path = lambda name, x, backend="auto": reference(name) if name.startswith("iq3.") else None
    type(codec)._knob = lambda self, name, device: getattr(self, name)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 256, generator=g) * torch.rand(n, 1, generator=g)
        w = torch.rand(n, 256, generator=g) + 0.1
        with Count():
            codec.encode_blocks(x, w)
    finally:
        lat.fast_path, type(codec)._knob = real_fast, real_knob
    scale = chunk / n
    return {"launches": dict(launches), "torch_ops": sum(ops.values()),
            "MB_per_chunk": round(sum(nbytes.values()) * scale / 1e6, 1),
            "largest_MB": {k: round(v * scale / 1e6, 1) for k, v in nbytes.most_common(8)}}


FUSED_CHOICES = ("prefetch32", "levels", "step1", "fused")  # the default's configuration and its one-launch variants


def fused_value(name: str) -> str:
    """``encode_speed.py --iq3-fused``'s value for configuration ``name``: its codec switches that are on, without
    ``FUSED_`` (``levels,step1``), or ``none``."""
    on = [k[len("FUSED_"):].lower() for k in CODEC_FLAGS if CONFIGS[name].get(k)]
    return ",".join(on) or "none"


def choose_fused(configs_txt: str) -> str:
    """``encode_speed.py --iq3-fused``'s value for the configuration fastest on IQ3_XXS among ``prefetch32`` (the
    default), ``levels``, ``step1`` and ``fused`` whose bytes equal the base's, read from a ``--configs`` run's output
    (its last line, the JSON summary); ``none`` where there is no summary or none qualifies."""
    try:
        r = json.loads(configs_txt.strip().splitlines()[-1])["results"]["IQ3_XXS"]
    except (IndexError, KeyError, ValueError):
        return "none"
    ok = [c for c in FUSED_CHOICES if "s" in r.get(c, {}) and r[c]["bytes_equal_base"]]
    return fused_value(min(ok, key=lambda c: r[c]["s"])) if ok else "none"


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--breakdown", action="store_true", help="only the assignment launches' times by kind (defaults)")
    ap.add_argument("--op-bytes", action="store_true",
                    help="only count the torch ops around the fast paths (CPU; bytes scaled to a CUDA chunk)")
    ap.add_argument("--choose", metavar="CONFIGS_TXT",
                    help="print encode_speed.py --iq3-fused's value from a --configs run's output (device scripts)")
    args = ap.parse_args()
    if args.choose:
        print(choose_fused(open(args.choose).read()))
        return
    if args.op_bytes:
        print(json.dumps({fmt: op_bytes(fmt) for fmt in ("IQ3_XXS", "IQ3_S")}))
        return
    configs = args.configs.split(",")
    assert all(c in CONFIGS for c in configs), f"configs: of {list(CONFIGS)} (the first one the base)"
    assert torch.cuda.is_available(), "needs CUDA"
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 14336, device="cuda", generator=g)
    x *= torch.exp(0.5 * torch.randn(4096, 1, device="cuda", generator=g))
    imp = torch.rand(14336, device="cuda", generator=g) + 0.05
    if args.breakdown:
        print(json.dumps({"device": torch.cuda.get_device_name(), "shape": list(x.shape), **breakdown(x, imp)}))
        return
    summary = {"device": torch.cuda.get_device_name(), "shape": list(x.shape), "results": {}}
    try:
        for fmt in ("IQ3_XXS", "IQ3_S"):
            res = {}
            base = None
            for cfg in configs:
                if fmt == "IQ3_S" and cfg == "new_lists" and cfg != configs[0]:
                    continue  # IQ3_S walks lists under "new" already (LISTS_FROM=512)
                configure(cfg)
                t0 = time.perf_counter()
                try:
                    quantize(x[:64], fmt, imp)  # compile
                except Exception as e:  # (a configuration that does not compile here: recorded, the rest run)
                    if cfg == configs[0]:
                        raise
                    res[cfg] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(fmt, cfg, res[cfg], flush=True)
                    continue
                torch.cuda.synchronize()
                comp = time.perf_counter() - t0
                s, b = timed(x, fmt, imp)
                e = werr(x, b, fmt, imp)
                if base is None:
                    base = (b, e)
                r = {"s": round(s, 5), "weights_per_s": x.numel() / s, "werr_ratio_vs_base": e / base[1],
                     "bytes_equal_base": bool(torch.equal(b, base[0])),
                     "rows_equal_base": float((b == base[0]).all(1).float().mean()), "gguf_decode_ok": gguf_ok(b, fmt),
                     "compile_s": round(comp, 2)}
                res[cfg] = r
                print(fmt, cfg, {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
                del b
            best = min((c for c in res if c != configs[0] and "s" in res[c]), key=lambda c: res[c]["s"],
                       default=configs[0])
            res["base"] = configs[0]
            res["best_new"] = best
            res["speedup_best_vs_base"] = res[configs[0]]["s"] / res[best]["s"]
            summary["results"][fmt] = res
            # profile one encode of the fastest new configuration
            configure(best)
            quantize(x, fmt, imp)
            torch.cuda.synchronize()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                quantize(x, fmt, imp)
                torch.cuda.synchronize()
            print(f"--- {fmt} ({best}) top-15 CUDA kernels of one encode")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    finally:
        for k, v in DEFAULTS.items():
            setattr(ks, k, v)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
