"""MoE layer benchmark: dynaquant's grouped experts kernel against bf16 experts, same run, same GPU.

One routed-experts layer (the experts module alone: router and shared experts excluded) of a Qwen3-30B-A3B shape
(hidden 2048, 128 experts of 768, top-8) and a DeepSeek-V3 shape (hidden 7168, 256 experts of 2048, top-8), at
M = 1, 16 and 256 tokens:

- ``ours``: :class:`dynaquant.runtime.moe.DynaExperts` with its experts' layouts stacked (as ``dynaquant.load``
  leaves a MoE checkpoint: :func:`dynaquant.runtime.linear.fuse_experts`), random codes of the format (never zeros):
  routing, two grouped launches (:mod:`dynaquant.kernels.grouped`), the activation and the weighted sum;
- ``hf_eager``: the installed transformers' experts module (bf16 3-D parameters) with its ``eager`` implementation,
  a Python loop over the routed experts;
- ``hf_default``: the same module with transformers' default implementation (what ``from_pretrained`` picks:
  ``grouped_mm``, ``torch._grouped_mm``, where the installed torch has it), the bf16 grouped GEMM;
- ``ours_torch_ops``: the same layer and launches with the routing as ``route_torch``'s dozen torch operations and
  the activation as torch operations after the gate/up launch (the path before the one-launch routing and the
  epilogue activation, 2026-11-29; it lacks only that path's memset of the down launch's output);
- ``ours_graph``: ours captured in one CUDA graph (nothing in it waits for the device), timed by replays: the GPU
  time without Python's launch overhead, which a decode step under CUDA graphs sees; ``hf_default_graph`` the same
  for the default implementation where it can be captured (``graph_speedup_vs_hf_default_graph``: graph against
  graph, one routing; ``graph_speedup_vs_hf_*`` otherwise against the eager baselines); ``ours_torch_ops_graph``
  likewise (``graph_speedup_vs_ours_torch_ops_graph``: what the routing kernel and the epilogue gain).

Each rep draws a new random routing (top-k of random logits; the same routings for every method) and writes 256 MiB
to flush the 50 MB L2 before the timed call (CUDA events around the call only). Medians over ``--reps``. A check
row per shape and format gives the relative error of ours against the bf16 dequantized weights through the eager
module on one routing.

Output: JSON rows (``--out``, default ``benchmarks/out/moe_kernels.json``): a header (device, versions), then one row
per shape, format and M with each method's median microseconds, the weight bytes the routed experts read, and the
speed-ups ``ours`` over each bf16 baseline. ``--dry-run`` runs tiny shapes on the CPU (Triton's interpreter).

Usage (on a CUDA machine): python benchmarks/moe_kernels.py [--formats INT2_G128,INT4_G128] [--m 1,16,256]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

try:  # an installed (or PYTHONPATH) dynaquant first, else this checkout
    import dynaquant.kernels  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent))

from dynaquant.kernels import KernelFormat, pack, stack  # noqa: E402
from dynaquant.kernels.ops import dequantize_packed_ref  # noqa: E402

SHAPES = {"qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
          "deepseek-v3": dict(hidden=7168, inter=2048, experts=256, top_k=8)}
DRY = {"tiny": dict(hidden=256, inter=128, experts=8, top_k=2)}


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def random_packed(fmt: str, n: int, k: int, gen: torch.Generator, device) -> object:
    """A random weight of the format in the kernels' layout (codes and scales never all zero)."""
    f = KernelFormat.parse(fmt)
    g = f.group_size
    if f.kind == "int":
        b = f.bits
        lo, hi = (-(1 << (b - 1)), 1 << (b - 1)) if f.symmetric else (0, 1 << b)
        kw = dict(generator=gen, device=device)
        codes = torch.randint(lo, hi, (n, k), **kw).to(torch.int8 if f.symmetric else torch.uint8)
        zeros = None if f.symmetric else torch.randint(0, 1 << b, (n, k // g), **kw).to(torch.uint8)
        scales = (torch.rand(n, k // g, **kw) * 0.02 + 0.002).to(torch.float16)
        return pack(codes, scales, zeros, fmt)
    codes = torch.randint(0, 16, (n, k), generator=gen, device=device).to(torch.uint8)
    if f.kind == "mxfp4":
        return pack(codes, torch.randint(118, 124, (n, k // g), generator=gen, device=device).to(torch.uint8), None, fmt)
    scales = (torch.rand(n, k // g, generator=gen, device=device) * 440 + 2).to(torch.float8_e4m3fn)
    return pack(codes, scales, None, fmt, global_scale=torch.tensor(2688.0 / 1.7))


def build(shape: dict, fmt: str, device, seed: int = 0):
    """(ours: DynaExperts with stacked layouts, hf: transformers' experts module in bf16 with the same weights
    dequantized (eager), hf_default: the same parameters with transformers' default implementation, weight bytes a
    routed expert reads)."""
    from types import SimpleNamespace

    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from dynaquant.runtime.moe import DynaExperts

    h, i, e = shape["hidden"], shape["inter"], shape["experts"]
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=shape["top_k"])
    with torch.device("meta"):
        meta = Qwen3MoeExperts(cfg)
    ours = DynaExperts(meta, device="meta", dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    gu = [random_packed(fmt, i, h, gen, device) for _ in range(2 * e)]  # gate_0, up_0, gate_1, ...
    dn = [random_packed(fmt, h, i, gen, device) for _ in range(e)]
    ours.grouped = (SimpleNamespace(packed=stack(gu), intact=True), SimpleNamespace(packed=stack(dn), intact=True))
    per_expert = sum(p.nbytes for p in gu[:2]) + dn[0].nbytes
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # (the parameters made in bf16 on the device: no float32 copy)
    try:
        with torch.device(device):
            hf = Qwen3MoeExperts(cfg)
            cfg_default = Qwen3MoeConfig(**cfg.to_dict())
            hf_default = Qwen3MoeExperts(cfg_default)
    finally:
        torch.set_default_dtype(default)
    cfg._experts_implementation = "eager"
    cfg_default._experts_implementation = "grouped_mm"  # what from_pretrained picks where torch._grouped_mm exists
    with torch.no_grad():
        for x in range(e):
            hf.gate_up_proj[x] = torch.cat([dequantize_packed_ref(gu[2 * x]), dequantize_packed_ref(gu[2 * x + 1])])
            hf.down_proj[x] = dequantize_packed_ref(dn[x])
    hf_default.gate_up_proj, hf_default.down_proj = hf.gate_up_proj, hf.down_proj  # (shared: no second copy)
    del gu, dn
    return ours, hf, hf_default, per_expert


def torch_ops_forward(ours):
    """``ours``' grouped forward with the routing and the activation as torch operations (``ours_torch_ops``):
    :func:`dynaquant.kernels.grouped.route_torch`, the gate/up launch's (S, 2 I) product, ``act_fn(gate) * up``."""
    from dynaquant.kernels.grouped import grouped_linear, route_torch
    from dynaquant.runtime.moe import grouped_launch

    def forward(x, idx, w):
        t, k = idx.shape
        per_expert = t * k // ours.num_experts
        r = route_torch(idx, ours.num_experts, block_m=16 if per_expert <= 16 else 32 if per_expert <= 32 else 64)
        launch = grouped_launch(t, ours.grouped[0].packed.fmt, x.device)
        gu = grouped_linear(x, ours.grouped[0].packed, r, **launch)
        h = ours.act_fn(gu[:, :ours.inter]) * gu[:, ours.inter:]
        y = grouped_linear(h, ours.grouped[1].packed, r, sorted_input=True, slot_weights=w.reshape(-1), **launch)
        return y.view(t, k, -1).sum(1).to(x.dtype)

    return forward


def routings(n: int, m: int, shape: dict, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        logits = torch.randn(m, shape["experts"], generator=gen, device=device)
        w, idx = torch.topk(torch.softmax(logits, -1), shape["top_k"], dim=-1)
        out.append((idx, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)))
    return out


def time_method(fn, xs, routes, flush) -> float:
    """Median microseconds of ``fn(x, idx, w)`` over the routings, L2 flushed before each (CUDA events)."""
    if xs[0].device.type == "cpu":
        import time

        t0 = time.perf_counter()
        fn(xs[0], *routes[0])
        return (time.perf_counter() - t0) * 1e6
    for x, (idx, w) in zip(xs[:3], routes[:3]):  # warm-up (compiles)
        fn(x, idx, w)
    times = []
    for x, (idx, w) in zip(xs, routes):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x, idx, w)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def time_graph(fn, x, idx, w) -> float:
    """Median microseconds of one replay of ``fn(x, idx, w)`` captured in a CUDA graph (launch overhead gone; the
    L2 cleared before each replay by ``triton.testing.do_bench``): the GPU time alone. One routing."""
    import triton

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, idx, w)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x, idx, w)
    return triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median") * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="INT2_G128,INT4_G128,MXFP4_G32")
    ap.add_argument("--m", default="1,16,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "moe_kernels.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    shapes = DRY if dry else {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = [1, 4] if dry else [int(x) for x in args.m.split(",")]
    reps = 1 if dry else args.reps
    import transformers

    rows = [dict(kind="header", device=str(torch.cuda.get_device_name() if not dry else "cpu (dry run)"),
                 torch=torch.__version__, triton=_version("triton"), transformers=transformers.__version__,
                 hf_default="grouped_mm",
                 grouped_mm=hasattr(torch, "_grouped_mm"), python=platform.python_version(), reps=reps)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    flush = torch.empty(1 if dry else 64 << 20, dtype=torch.float32, device=device)
    for sname, shape in shapes.items():
        for fmt in args.formats.split(","):
            ours, hf, hf_default, per_expert = build(shape, fmt, device)
            impls = {"ours": ours, "ours_torch_ops": torch_ops_forward(ours), "hf_eager": hf, "hf_default": hf_default}
            if dry or not hasattr(torch, "_grouped_mm"):
                impls.pop("hf_default")
            with torch.no_grad():
                gen = torch.Generator(device=device).manual_seed(1)
                x = torch.randn(16, shape["hidden"], generator=gen, device=device).to(torch.bfloat16)
                idx, w = routings(1, 16, shape, device, 5)[0]
                want = impls["hf_eager"](x, idx, w).double()
                got = impls["ours"](x, idx, w).double()
                rel = float((got - want).norm() / want.norm())
                before = impls["ours_torch_ops"](x, idx, w).double()
                rel_before = float((got - before).norm() / before.norm())
                rows.append(dict(kind="check", shape=sname, format=fmt, rel_error_vs_bf16=rel,
                                 rel_diff_vs_torch_ops=rel_before))
                print(f"{sname} {fmt}: relative error vs bf16 {rel:.2e}, vs ours_torch_ops {rel_before:.2e}", flush=True)
                for m in ms:
                    gen = torch.Generator(device=device).manual_seed(2 + m)
                    xs = [torch.randn(m, shape["hidden"], generator=gen, device=device).to(torch.bfloat16)
                          for _ in range(reps + 3)]
                    routes = routings(reps + 3, m, shape, device, 7 + m)
                    n_hit = statistics.median(int(torch.unique(i).numel()) for i, _ in routes)
                    us = {k: time_method(f, xs, routes, flush) for k, f in impls.items()}
                    if not dry:
                        us["ours_graph"] = time_graph(ours, xs[0], *routes[0])
                        us["ours_torch_ops_graph"] = time_graph(impls["ours_torch_ops"], xs[0], *routes[0])
                        if "hf_default" in impls:
                            try:  # (where its implementation captures: nothing in it waits for the device)
                                us["hf_default_graph"] = time_graph(hf_default, xs[0], *routes[0])
                            except Exception as exc:  # noqa: BLE001 - a baseline that cannot be captured: no row
                                print(f"hf_default in a CUDA graph: {type(exc).__name__}: {exc}", flush=True)
                    ratio = {f"speedup_vs_{k}": us[k] / us["ours"] for k in ("hf_eager", "hf_default") if k in us}
                    ratio["speedup_vs_ours_torch_ops"] = us["ours_torch_ops"] / us["ours"]
                    if "ours_graph" in us:
                        ratio.update({f"graph_speedup_vs_{k}": us[k] / us["ours_graph"] for k in us
                                      if k.startswith("hf") or k == "ours_torch_ops_graph"})
                    row = dict(kind="moe", shape=sname, format=fmt, m=m, experts_hit=n_hit,
                               ours_weight_bytes=int(n_hit * per_expert),
                               **{f"{k}_us": round(v, 2) for k, v in us.items()}, **ratio)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    args.out.write_text(json.dumps(rows, indent=1))
            del ours, hf, hf_default, impls
            if not dry:
                torch.cuda.empty_cache()
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
