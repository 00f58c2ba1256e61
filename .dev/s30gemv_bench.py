"""s30gemv: the resident-activation GEMV (LaunchConfig.resident) against the default M = 1 GEMV and bf16 F.linear.

For Llama-3-8B's fused decode shapes (q/k/v stacked 6144 x 4096, o 4096 x 4096, gate/up stacked 28672 x 4096, down
4096 x 14336, lm_head 128256 x 4096) and INT4_G128 / INT2_G128 / MXFP4_G32: CUDA-graph replays (median, a sequence
of calls over distinct weight copies, benchmarks/kernel_speed.py's bench_graph) of choose_config's GEMV and of several
resident configurations, plus bf16 F.linear (the shapes transformers calls: q/o, k/v, gate/up, down, lm_head);
us a call, GB/s, rel_err against the float32 reference, and the decode step (32 x (qkv, o, gate+up, down) + lm_head)
against bf16 as transformers calls it (32 x (2 q/o, 2 k/v, 2 gate/up, down) + lm_head). One JSON line at the end.

    PYTHONPATH=$PWD python3 .dev/s30gemv_bench.py            # on the GPU (< 3 min)
    PYTHONPATH=$PWD python3 .dev/s30gemv_bench.py --dry-run  # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernel_speed as kb  # noqa: E402  (benchmarks/kernel_speed.py)
from dynaquant.kernels import KernelFormat, LaunchConfig, choose_config, device_info, linear, valid_config  # noqa: E402
from dynaquant.kernels.ops import dequantize_packed_ref  # noqa: E402
from dynaquant.kernels.tuning import resident_gemv_config, resident_grid  # noqa: E402

FORMATS = ["INT4_G128", "INT2_G128", "MXFP4_G32"]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up2": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
STEP = {"qkv": 32, "o": 32, "gate_up2": 32, "down": 32, "lm_head": 1}
BF16 = {"q_o": ((4096, 4096), 64), "k_v": ((1024, 4096), 64), "gate_up": ((14336, 4096), 64),
        "down": ((4096, 14336), 32), "lm_head": ((128256, 4096), 1)}
DRY_SHAPES = {"qkv": (48, 512), "o": (32, 512), "gate_up2": (80, 512), "down": (32, 1024), "lm_head": (100, 512)}
DRY_BF16 = {"q_o": ((32, 512), 64), "k_v": ((16, 512), 64), "gate_up": ((40, 512), 64), "down": ((32, 1024), 32),
            "lm_head": ((100, 512), 1)}
# resident variants: (label, K-slice words, rows a tile, warps, programs an SM, prefetch)
VARIANTS = [("r128x32w4p4", 128, 32, 4, 4, True), ("r64x32w4p4", 64, 32, 4, 4, True),
            ("r128x16w4p8", 128, 16, 4, 8, True), ("r64x16w4p8", 64, 16, 4, 8, True),
            ("r64x16w4p4", 64, 16, 4, 4, True), ("r256x32w8p2", 256, 32, 8, 2, True),
            ("r128x32w8p4", 128, 32, 8, 4, True), ("r128x16w4p4_nopf", 128, 16, 4, 4, False)]


def resident_cfg(f: KernelFormat, k: int, words: int, block_n: int, warps: int, per_sm: int, prefetch: bool):
    wpg = f.group_size // (32 // f.bits)
    groups = max(1, words // wpg)
    split = max(1, (k // f.group_size) // groups)
    return LaunchConfig("gemv", 1, block_n, groups, split, warps, 1, prefetch, 0, True, 4, False, per_sm)


def half2_twin(cfg: LaunchConfig) -> LaunchConfig:
    return LaunchConfig("gemv", 1, cfg.block_n, cfg.groups, cfg.split_k, cfg.num_warps, 1, False, 0, True,
                        cfg.scale_words)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--min-mib", type=int, default=256, help="weights a graph sequence (beyond the 50 MB L2)")
    args = ap.parse_args()
    t0 = time.time()
    if args.dry_run:
        kb.DEVICE, kb.MIN_BYTES = "cpu", 1  # one copy a shape
        shapes, bf16_shapes = DRY_SHAPES, DRY_BF16
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --dry-run)")
            return 2
        kb.MIN_BYTES = args.min_mib << 20
        shapes, bf16_shapes = SHAPES, BF16
    dev = torch.device(kb.DEVICE)
    info = device_info(dev)
    gen = torch.Generator(device=kb.DEVICE).manual_seed(0)
    formats = [f for f in args.formats.split(",") if f]
    name = torch.cuda.get_device_name() if not args.dry_run else "cpu (interpreter)"
    ceiling = kb.read_ceiling(0.01 if args.dry_run else 1.0)["read_bandwidth_gbps"]
    print(f"device {name}, {info.sm_count} SMs, read ceiling {ceiling:.0f} GB/s", flush=True)

    # bf16, as transformers calls it
    bf16 = {}
    for sname, ((n, k), _) in bf16_shapes.items():
        w0 = (torch.randn(n, k, device=kb.DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
        ws = [w0] + [w0.clone() for _ in range(kb.n_copies(w0.numel() * 2) - 1)]
        xs = [torch.randn(1, k, device=kb.DEVICE, generator=gen).to(torch.bfloat16) for _ in ws]
        bf16[sname] = kb.bench_graph([(lambda w=w, x=x: torch.nn.functional.linear(x, w)) for w, x in zip(ws, xs)])
        print(f"bf16 {sname:8s} {n:6d}x{k:<5d} {bf16[sname] * 1e6:8.1f} us {n * k * 2 / bf16[sname] / 1e9:6.0f} GB/s",
              flush=True)
        del ws, xs, w0
        kb._empty_cache()
    bf16_step = sum(c * bf16[s] for s, (_, c) in bf16_shapes.items())

    # configs and their compilation (threads)
    plan = {}
    for fmt in formats:
        f = KernelFormat.parse(fmt)
        for sname, (n, k) in shapes.items():
            cfgs = {"default": choose_config(f, 1, n, k, info)}
            fixed = resident_gemv_config(f, n, k, info)
            if fixed is not None:
                cfgs["resident_default"] = fixed
            for label, words, bn, warps, per_sm, pf in VARIANTS:
                c = resident_cfg(f, k, words, bn, warps, per_sm, pf)
                if valid_config(c, f, 1, n, k) and c not in cfgs.values():
                    cfgs[label] = c
            if args.dry_run:  # one resident config is enough to check the script
                cfgs = {key: c for key, c in cfgs.items() if key in ("default", "resident_default")}
            plan[(fmt, sname)] = cfgs
    jobs = [(fmt, *shapes[s], 1, c) for (fmt, s), cfgs in plan.items() for c in cfgs.values()]
    jobs += [(fmt, *shapes[s], 1, half2_twin(cfgs["resident_default"])) for (fmt, s), cfgs in plan.items()
             if "resident_default" in cfgs]
    compile_s = kb.prewarm(jobs)
    print(f"compiled {len(set(jobs))} kernels in {compile_s:.0f} s", flush=True)

    rows, summary = [], {}
    for fmt in formats:
        f = KernelFormat.parse(fmt)
        best = {}
        for sname, (n, k) in shapes.items():
            p0 = kb.random_packed(fmt, n, k, gen)
            w_ref = dequantize_packed_ref(p0)
            ws = kb.copies_of(p0, kb.n_copies(p0.nbytes))
            xs = [torch.randn(1, k, device=kb.DEVICE, generator=gen).to(torch.bfloat16) for _ in ws]
            xc = torch.randn(1, k, device=kb.DEVICE, generator=gen).to(torch.bfloat16)
            ref = xc.float() @ w_ref.t()
            y_def = linear(xc, p0, config=plan[(fmt, sname)]["default"]).float()
            for label, cfg in plan[(fmt, sname)].items():
                row = {"format": fmt, "shape": sname, "n": n, "k": k, "label": label, "config": dataclasses.asdict(cfg)}
                try:
                    y = linear(xc, p0, config=cfg).float()
                    row["rel_err"] = float((y - ref).norm() / ref.norm())
                    row["rel_diff_default"] = float((y - y_def).norm() / y_def.norm())
                    if cfg.resident:
                        row["grid"] = resident_grid(n, cfg, info.sm_count)
                    if label == "resident_default":  # (natively the register layouts may order the sums otherwise)
                        y2 = linear(xc, p0, config=half2_twin(cfg)).float()
                        row["equal_half2_twin"] = bool(torch.equal(y, y2))
                    t = kb.time_kernel(ws, xs, cfg)
                except Exception as e:  # reported, not fatal
                    row["error"] = repr(e)[:300]
                    rows.append(row)
                    print(f"{fmt:10s} {sname:8s} {label:18s} ERROR {row['error']}", flush=True)
                    continue
                bf = bf16.get({"qkv": "q_o", "o": "q_o", "gate_up2": "gate_up"}.get(sname, sname))
                row.update(time_us=t * 1e6, gbps=p0.nbytes / t / 1e9, fraction_of_ceiling=p0.nbytes / t / 1e9 / ceiling)
                rows.append(row)
                print(f"{fmt:10s} {sname:8s} {label:18s} {t * 1e6:8.1f} us {row['gbps']:6.0f} GB/s "
                      f"{100 * row['fraction_of_ceiling']:5.1f}%  err {row['rel_err']:.1e}"
                      f"{'  (bf16 same-K shape %.1f us)' % (bf * 1e6) if bf else ''}"
                      f"{'  twin-equal' if row.get('equal_half2_twin') else ''}", flush=True)
            del ws, xs, p0, w_ref
            kb._empty_cache()
        ok = [r for r in rows if r["format"] == fmt and "time_us" in r]
        by = {}
        for r in ok:
            by.setdefault(r["shape"], {})[r["label"]] = r["time_us"]
        if set(by) != set(shapes) or any("default" not in v for v in by.values()):
            continue

        def step(pick):
            return sum(c * pick(by[s]) for s, c in STEP.items())

        t_def = step(lambda v: v["default"])
        t_res = step(lambda v: min([t for lb, t in v.items() if lb != "default"] or [v["default"]]))
        t_any = step(lambda v: min(v.values()))
        t_fix = step(lambda v: v.get("resident_default", v["default"]))
        for s in shapes:
            best[s] = min(by[s], key=by[s].get)
        b = bf16_step * 1e6
        summary[fmt] = {"step_default_us": t_def, "step_resident_default_us": t_fix, "step_best_resident_us": t_res,
                        "step_best_us": t_any, "x_bf16_default": b / t_def, "x_bf16_resident_default": b / t_fix,
                        "x_bf16_best_resident": b / t_res, "x_bf16_best": b / t_any, "best_label": best,
                        "max_rel_err": max(r["rel_err"] for r in ok),
                        "correct": max(r["rel_err"] for r in ok) < 5e-3 and not any("error" in r for r in rows
                                                                                   if r["format"] == fmt),
                        "all_resident_twin_equal": all(r.get("equal_half2_twin", True) for r in ok)}
        print(f"STEP {fmt}: default {t_def:.0f} us ({b / t_def:.2f}x bf16), resident_default {t_fix:.0f} us "
              f"({b / t_fix:.2f}x), best resident per shape {t_res:.0f} us ({b / t_res:.2f}x), best {t_any:.0f} us "
              f"({b / t_any:.2f}x); best per shape {best}", flush=True)
    print(json.dumps({"bench": "s30gemv", "device": name, "sm_count": info.sm_count, "ceiling_gbps": ceiling,
                      "bf16_step_us": bf16_step * 1e6, "bf16_us": {s: v * 1e6 for s, v in bf16.items()},
                      "summary": summary, "rows": [{k: v for k, v in r.items() if k != "config"} for r in rows],
                      "wall_s": time.time() - t0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
