"""s30mm: the fused GEMM's variants (xa, post_scale, warp_spec) against the default path and bf16 F.linear.

Llama-3-8B decode step's fused calls (qkv 6144x4096, o 4096x4096, gate+up 28672x4096, down 4096x14336,
lm_head 128256x4096), INT4_G128 / INT2_G128 / MXFP4_G32, M = 16 and 256. Per shape: median per-call time of
CUDA-graph replays over distinct weight copies (benchmarks/kernel_speed.py's bench_graph) for bf16, the default
config (choose_config) and each variant; rel_err of each against the float32 reference and against the default's
output. Step = 32 x (qkv + o + gate_up2 + down) + lm_head; bf16 both on the same fused calls and as transformers
calls it (q, k, v, o, gate, up, down separately). Warp-specialized configs are compiled in a child process first
(a compiler crash there drops them instead of the run). One JSON line at the end.

    PYTHONPATH=$PWD python3 .dev/s30mm_bench.py [--formats ...] [--m 16,256] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import kernel_speed as kb  # noqa: E402  (benchmarks/kernel_speed.py)

from dynaquant.kernels import KernelFormat, choose_config, device_info, linear  # noqa: E402
from dynaquant.kernels.ops import dequantize_packed_ref  # noqa: E402
from dynaquant.kernels.tuning import LaunchConfig, valid_config  # noqa: E402

FUSED = {"qkv": (6144, 4096, 32), "o": (4096, 4096, 32), "gate_up2": (28672, 4096, 32), "down": (4096, 14336, 32),
         "lm_head": (128256, 4096, 1)}
DEV = "cuda"
SEPARATE = {"q_o": (4096, 4096, 64), "k_v": (1024, 4096, 64), "gate_up": (14336, 4096, 64), "down": (4096, 14336, 32),
            "lm_head": (128256, 4096, 1)}


def split_to(tiles: int, k_tiles: int, sms: int, most: int = 8) -> int:
    s = 1
    while tiles * s < sms and k_tiles % (2 * s) == 0 and s < most:
        s *= 2
    return s


def gemm(m, n, k, bm, bn, bk, warps, stages, sms, **opts) -> LaunchConfig:
    bm = min(bm, max(16, 1 << (m - 1).bit_length()))
    s = split_to(-(-m // bm) * -(-n // bn), k // bk, sms)
    return LaunchConfig("gemm", bm, bn, 1, s, warps, stages, False, bk, **opts)


def variants(f: KernelFormat, m: int, n: int, k: int, default: LaunchConfig, sms: int) -> dict[str, LaunchConfig]:
    """Named variant configurations of one call (those valid for the shape)."""
    out = {}
    if m <= 16:
        base = default if default.path == "gemm" else LaunchConfig("gemm", 16, 64, 1, 4, 4, 3, False, 128)
        bk = min(128, f.group_size)
        out["post"] = dataclasses.replace(base, post_scale=True, block_k=bk)
        out["xa"] = dataclasses.replace(base, xa=True)
        out["xa_post"] = dataclasses.replace(base, xa=True, post_scale=True, block_k=bk)
        out["post_bn128"] = dataclasses.replace(base, post_scale=True, block_k=bk, block_n=128)
        out["bk256"] = dataclasses.replace(base, block_k=256)
        out["xa_bk256"] = dataclasses.replace(base, block_k=256, xa=True)
    else:
        out["w_128x128x32"] = gemm(m, n, k, 128, 128, 32, 8, 4, sms)
        out["xa_128x128x32"] = gemm(m, n, k, 128, 128, 32, 8, 4, sms, xa=True)
        out["xa_128x128x32_r128"] = gemm(m, n, k, 128, 128, 32, 8, 4, sms, xa=True, max_regs=128)
        out["w_128x128x32_r128"] = gemm(m, n, k, 128, 128, 32, 8, 4, sms, max_regs=128)
        out["xa_256x128x32"] = gemm(m, n, k, 256, 128, 32, 8, 4, sms, xa=True)
        out["w_256x128x32"] = gemm(m, n, k, 256, 128, 32, 8, 4, sms)
        out["xa_256x64x32"] = gemm(m, n, k, 256, 64, 32, 8, 4, sms, xa=True)
        out["xa_256x64x32_r128"] = gemm(m, n, k, 256, 64, 32, 8, 4, sms, xa=True, max_regs=128)
        out["xa_128x64x32_w4"] = gemm(m, n, k, 128, 64, 32, 4, 4, sms, xa=True)
        out["ws_xa_128x128x32"] = gemm(m, n, k, 128, 128, 32, 8, 4, sms, xa=True, warp_spec=True)
    return {name: c for name, c in out.items() if valid_config(c, f, m, n, k)}


def probe_ws(formats: list[str], ms: list[int]) -> dict:
    """Child process: compile every warp_spec variant; prints one JSON line {format: [errors]}."""
    from dynaquant.kernels.triton_gemm import compile_gemm

    info = device_info(DEV)
    errs = {}
    for fmt in formats:
        f = KernelFormat.parse(fmt)
        for m in ms:
            for sname, (n, k, _) in FUSED.items():
                for name, c in variants(f, m, n, k, choose_config(f, m, n, k, info), info.sm_count).items():
                    if c.warp_spec:
                        x = torch.empty(m, k, dtype=torch.bfloat16, device=DEV)
                        try:
                            compile_gemm(x, kb.dummy_packed(fmt, n, k), None, c)
                        except Exception as e:  # reported
                            errs.setdefault(fmt, []).append(f"{sname} m={m} {name}: {repr(e)[:200]}")
    print(json.dumps(errs))
    return errs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="INT4_G128,INT2_G128,MXFP4_G32")
    ap.add_argument("--m", default="16,256")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--probe-ws", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes (checks the script)")
    args = ap.parse_args()
    if args.dry_run:
        global DEV
        os.environ["TRITON_INTERPRET"] = "1"
        DEV = kb.DEVICE = "cpu"
        for table in (FUSED, SEPARATE):
            for s, (n, k, c) in table.items():
                table[s] = (min(n, 96), min(k, 512), c)
    formats = args.formats.split(",")
    ms = [int(v) for v in args.m.split(",")]
    if args.probe_ws:
        probe_ws(formats, ms)
        return 0
    import triton

    t_start = time.time()
    kb.MIN_BYTES = 1 << 16 if args.dry_run else (64 if args.quick else 128) << 20
    info = device_info(DEV)
    sms = info.sm_count
    dev_name = "cpu" if args.dry_run else torch.cuda.get_device_name()
    print(f"device {dev_name} sms {sms} torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    ws_ok, ws_note = True, ""
    try:
        if args.dry_run:
            raise subprocess.TimeoutExpired("dry run", 0)
        r = subprocess.run([sys.executable, __file__, "--probe-ws", "--formats", args.formats, "--m", args.m],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ))
        ws_note = (r.stdout.strip().splitlines() or [""])[-1]
        ws_ok = r.returncode == 0
        if not ws_ok:
            ws_note = f"rc {r.returncode}: " + r.stderr[-300:]
    except subprocess.TimeoutExpired:
        ws_ok, ws_note = False, "probe timed out"
    print(f"warp_spec probe ok={ws_ok}: {ws_note[:500]}", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)

    bf16 = {}
    for table in (FUSED, SEPARATE):
        for sname, (n, k, _) in table.items():
            if sname in bf16 or (sname, ms[0]) in bf16:
                continue
            w0 = torch.randn(n, k, device=DEV, generator=gen).to(torch.bfloat16) * 0.02
            ws = [w0] + [w0.clone() for _ in range(kb.n_copies(w0.numel() * 2) - 1)]
            for m in ms:
                xs = [torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16) for _ in ws]
                bf16[(sname, m)] = kb.bench_graph([(lambda w=w, x=x: torch.nn.functional.linear(x, w))
                                                   for w, x in zip(ws, xs)])
            del ws, w0
            kb._empty_cache()
    print(f"bf16 done {time.time() - t_start:.0f} s", flush=True)

    rows = []
    for fmt in formats:
        f = KernelFormat.parse(fmt)
        jobs = []
        for n, k, _ in FUSED.values():
            for m in ms:
                d = choose_config(f, m, n, k, info)
                jobs += [(fmt, n, k, m, c) for c in [d, *variants(f, m, n, k, d, sms).values()]
                         if ws_ok or not c.warp_spec]
        if not args.dry_run:  # (the interpreter's kernels are not thread-safe to warm up)
            kb.prewarm(jobs)
        for sname, (n, k, calls) in FUSED.items():
            p0 = kb.random_packed(fmt, n, k, gen)
            w_ref = dequantize_packed_ref(p0)
            wcopies = kb.copies_of(p0, kb.n_copies(p0.nbytes))
            for m in ms:
                x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
                ref = x.float() @ w_ref.t()
                xs = [torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16) for _ in wcopies]
                d = choose_config(f, m, n, k, info)
                y_def = linear(x, p0, config=d).float()
                cfgs = {"default": d, **{nm: c for nm, c in variants(f, m, n, k, d, sms).items()
                                         if ws_ok or not c.warp_spec}}
                for name, c in cfgs.items():
                    row = {"format": fmt, "shape": sname, "m": m, "variant": name, "config": dataclasses.asdict(c),
                           "calls": calls, "bf16_us": bf16[(sname, m)] * 1e6}
                    try:
                        y = linear(x, p0, config=c).float()
                        row["rel_err"] = float((y - ref).norm() / ref.norm())
                        row["rel_diff_default"] = float((y - y_def).norm() / y_def.norm())
                        row["ok"] = row["rel_err"] < 1e-2
                        t = kb.bench_graph([(lambda w=w, x=x, c=c: linear(x, w, config=c))
                                            for w, x in zip(wcopies, xs)], warmup_ms=5, rep_ms=40)
                        row.update(us=t * 1e6, x_bf16=bf16[(sname, m)] / t)
                    except Exception as e:  # reported, not fatal
                        import traceback

                        row["error"] = repr(e)[:300] + " | " + traceback.format_exc()[-600:].replace("\n", " / ")
                    rows.append(row)
                    if "us" in row:
                        print(f"{fmt:10s} {sname:8s} m={m:<3d} {name:15s} {row['us']:8.1f} us  bf16 "
                              f"{row['bf16_us']:8.1f}  {row['x_bf16']:5.2f}x  err {row['rel_err']:.1e} "
                              f"{'' if row['ok'] else 'BAD'}", flush=True)
                    else:
                        print(f"{fmt:10s} {sname:8s} m={m:<3d} {name:15s} ERROR {row['error'][:900]}", flush=True)
            del p0, w_ref, wcopies
            kb._empty_cache()
        print(f"{fmt} done {time.time() - t_start:.0f} s", flush=True)

    summary = {"device": dev_name, "triton": triton.__version__, "warp_spec_compiles": ws_ok,
               "steps": {}, "wall_s": round(time.time() - t_start, 1)}
    for fmt in formats:
        for m in ms:
            rs = [r for r in rows if r["format"] == fmt and r["m"] == m and "us" in r and r["ok"]]
            t_bf16_sep = sum(c * bf16[(s, m)] for s, (_, _, c) in SEPARATE.items())
            t_bf16_same = sum(c * bf16[(s, m)] for s, (_, _, c) in FUSED.items())
            per = {}
            for s in FUSED:
                per[s] = {r["variant"]: r["us"] for r in rs if r["shape"] == s}
            if not all("default" in per[s] for s in FUSED):
                continue
            names = sorted({v for s in FUSED for v in per[s]})
            step = {}
            for v in names:  # each variant where it runs, the default elsewhere
                t = sum(c * per[s].get(v, per[s]["default"]) for s, (_, _, c) in FUSED.items()) * 1e-6
                step[v] = {"us": round(t * 1e6, 1), "x_bf16_sep": round(t_bf16_sep / t, 3),
                           "x_bf16_same": round(t_bf16_same / t, 3)}
            tb = sum(c * min(per[s].values()) for s, (_, _, c) in FUSED.items()) * 1e-6
            best = {s: min(per[s], key=per[s].get) for s in FUSED}
            step["best_per_shape"] = {"us": round(tb * 1e6, 1), "x_bf16_sep": round(t_bf16_sep / tb, 3),
                                      "x_bf16_same": round(t_bf16_same / tb, 3), "which": best}
            summary["steps"][f"{fmt} m={m}"] = step
            print(f"step {fmt} m={m}: default {step['default']['x_bf16_sep']:.2f}x (same calls "
                  f"{step['default']['x_bf16_same']:.2f}x), best per shape {step['best_per_shape']['x_bf16_sep']:.2f}x "
                  f"({step['best_per_shape']['x_bf16_same']:.2f}x) {best}", flush=True)
    summary["bad"] = [f"{r['format']} {r['shape']} m={r['m']} {r['variant']}" for r in rows
                      if ("us" in r and not r["ok"]) or "error" in r]
    out = ROOT / ".dev" / "s30mm_bench.json"
    out.write_text(json.dumps(rows, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
