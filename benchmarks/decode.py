"""Decode throughput in transformers: a Llama-3-8B-shaped model, bf16 against dynaquant runtime plans.

For each plan (``bf16``, ``INT4_G128``, ``INT2_G128``, ...) and batch size (1, 16): a LlamaForCausalLM of
Llama-3-8B's shapes (hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336, vocab 128256) with random
weights (transformers' normal init, never zeros), its linear layers replaced by
:class:`dynaquant.runtime.linear.DynaLinear` in the plan's format (encoded on the GPU by the reference encoder;
``lm_head`` in ``--head-format`` where given, default the plan's format at 4 bits and above, INT4_G128
below), q/k/v and gate/up fused as ``dynaquant.load`` does (``--no-fuse``: separate calls). A prompt of
``--prompt`` tokens is prefilled into a transformers ``StaticCache``; then greedy decoding of ``--steps``
tokens as one CUDA graph per step (argmax and position update inside the graph), timed over replays:
tokens per second = batch * steps / median time. ``--compile yes|both`` also times the step through
``torch.compile`` (mode ``--compile-mode``, default ``max-autotune-no-cudagraphs`` as issue 17 defines compiled bf16)
inside the same CUDA graph; each DynaLinear call is then one ``dynaquant::linear`` node, and a row's
``graph_breaks`` counts the compile's graph breaks (0 expected). One JSON row per (plan, batch) with the speedup
against bf16 measured in the same run, and the GPU memory the built model holds (weights only, before any cache or graph)
against its checkpoint's bytes (``held_vs_checkpoint``; issue 17's target: at most 1.1 for INT4).

    python benchmarks/decode.py --out benchmarks/out/decode.json            # H100: about 3 minutes
    python benchmarks/decode.py --dry-run                                   # CPU: tiny model, eager, checks the script
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
try:  # an installed (or PYTHONPATH) dynaquant first, else this checkout
    import dynaquant  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent))

from dynaquant.quant.formats import get_format  # noqa: E402
from dynaquant.quant.runtime import encode, to_compressed_tensors  # noqa: E402
from dynaquant.runtime.linear import DynaLinear, fuse_projections  # noqa: E402

log = logging.getLogger("decode")

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
# issue 17's "compiled bf16": torch.compile in this mode, plus one CUDA graph a decode step (both sides)
COMPILE_MODE = "max-autotune-no-cudagraphs"
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


def build(shape: dict, device: torch.device, dtype: torch.dtype, layers: int | None):
    """A random-initialised LlamaForCausalLM of ``shape`` built directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**shape, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def quantize_linears(model: nn.Module, fmt: str, head_fmt: str) -> int:
    """Replace every nn.Linear by a prepared DynaLinear in ``fmt`` (``lm_head`` in ``head_fmt``); returns
    the bytes of the quantized weights (codes, scales, zero points).

    Speed is what is measured, so each projection of layer 0 is encoded once and every other layer gets
    its own copy of those bytes (distinct memory: every step reads all of them from HBM)."""
    nbytes = 0
    encoded: dict[str, object] = {}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        f = head_fmt if name == "lm_head" else fmt
        key = name.rpartition(".")[2] if ".layers." in name else name
        if key not in encoded:
            encoded[key] = to_compressed_tensors(encode(mod.weight.detach(), f))
        lin = DynaLinear(mod.in_features, mod.out_features, f, mod.bias is not None, device=mod.weight.device,
                         dtype=mod.weight.dtype)
        for k, v in encoded[key].items():
            getattr(lin, k).copy_(v)
            nbytes += v.numel() * v.element_size() if k != "weight_shape" else 0
        if mod.bias is not None:
            lin.bias.data.copy_(mod.bias.detach())
        lin.prepare()
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, lin)
        del mod
    return nbytes


def held_memory(model: nn.Module, linear_bytes: int, device: torch.device) -> dict:
    """What the built model holds on the GPU (``torch.cuda.memory_allocated`` after the build, before any cache or
    graph: weights only) against its checkpoint's bytes: the linear layers' stored bytes (quantized: codes, scales,
    zero points; bf16: 2 a weight) plus every other parameter's (embeddings, norms) at its dtype. Empty on a CPU."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    linear_ids = {id(p) for m in model.modules() if isinstance(m, (nn.Linear, DynaLinear)) for p in m.parameters()}
    other = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in linear_ids)
    held = torch.cuda.memory_allocated(device)
    ckpt = linear_bytes + other
    return {"gpu_held_bytes": held, "checkpoint_bytes": ckpt, "held_vs_checkpoint": held / ckpt}


# kernel-name patterns -> the part of a decode step they are (first match wins; --profile's per-step breakdown)
KERNEL_KINDS = (
    ("dynaquant", ("_gemv_kernel", "_gemm_kernel", "_resident_kernel", "_grouped", "_route", "_dequant", "_mm_kernel")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("matmul", ("triton_tem", "gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90_", "splitk")),  # cuBLAS, mm templates
    ("inductor", ("triton_",)),
)


def kernel_kind(name: str) -> str:
    """The part of a decode step a CUDA kernel named ``name`` belongs to (:data:`KERNEL_KINDS`), else ``other``."""
    low = name.lower()
    return next((kind for kind, pats in KERNEL_KINDS if any(p in low for p in pats)), "other")


def profile_steps(run, rewind, steps: int) -> dict:
    """CUDA kernel time a decode step, by :func:`kernel_kind` and by kernel (the 25 longest), from torch.profiler
    over ``steps`` replays of ``run`` (a CUDA graph's kernels are reported one by one): microseconds a step."""
    from torch.profiler import ProfilerActivity, profile

    rewind()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    top = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not us:
            continue
        kind = kernel_kind(ev.key)
        kinds[kind] = kinds.get(kind, 0.0) + us / steps
        top.append((us / steps, ev.count / steps, ev.key))
    top.sort(reverse=True)
    return {"us_per_step": {k: round(v, 1) for k, v in sorted(kinds.items())},
            "total_us_per_step": round(sum(kinds.values()), 1),
            "top": [{"kernel": k[:120], "us_per_step": round(u, 1), "calls_per_step": round(c, 2)} for u, c, k in top[:25]]}


def decode_time(model: nn.Module, batch: int, prompt: int, steps: int, graphs: bool, reps: int,
                compile_: bool = False, compile_mode: str = COMPILE_MODE, profile: bool = False) -> dict:
    """Median seconds for ``steps`` greedy decode steps after a ``prompt``-token prefill (static cache);
    ``compile_``: the decode step's forward through ``torch.compile`` in ``compile_mode`` (each DynaLinear call one
    ``dynaquant::linear`` node running its Triton kernel; ``graph_breaks`` counts the breaks), all of it then
    captured as one CUDA graph. ``profile`` (CUDA): also the step's kernel time by part (:func:`profile_steps`)."""
    from transformers import StaticCache

    dev = next(model.parameters()).device
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=prompt + steps + 8)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=gen).to(dev)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        tok = logits[:, -1:].argmax(-1)

        breaks0 = sum(torch._dynamo.utils.counters["graph_break"].values())
        fwd = torch.compile(model, dynamic=False, mode=None if compile_mode == "default" else compile_mode) \
            if compile_ else model

        def step():  # the static cache advances its own on-device length (positions and mask follow it)
            out = fwd(input_ids=tok, past_key_values=cache, use_cache=True).logits
            tok.copy_(out[:, -1:].argmax(-1))

        def rewind():  # back to the end of the prompt, in place (the graph keeps the tensors' addresses)
            for layer in cache.layers:
                layer.cumulative_length.fill_(prompt)

        mode = "eager"
        run = step
        if graphs and dev.type == "cuda":
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream().wait_stream(s)
                rewind()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
                run, mode = g.replay, "cuda graph"
            except Exception as exc:  # a capture failure is reported, and the eager loop timed instead
                log.warning("CUDA graph capture failed (%s): timing eager decoding", exc)
                torch.cuda.synchronize()
        times = []
        for _ in range(reps + 1):
            rewind()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        prof = profile_steps(run, rewind, min(steps, 16)) if profile and dev.type == "cuda" else None
    t = statistics.median(times[1:])
    breaks = None
    if compile_:
        mode += f" + torch.compile ({compile_mode})"
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks0
    return {"time_s": t, "tokens_per_s": batch * steps / t, "ms_per_step": 1e3 * t / steps, "mode": mode,
            "graph_breaks": breaks, "times_s": times[1:], **({"profile": prof} if prof else {})}


def _write(out: Path, rows: list) -> None:
    """Rewrite the JSON output (after every row, so a run cut short keeps what it measured)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="bf16,INT4_G128,INT2_G128", help="bf16 and/or runtime formats")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, help="fewer layers (smoke runs)")
    ap.add_argument("--head-format", help="lm_head's format in the quantized plans")
    ap.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up calls")
    ap.add_argument("--no-graphs", action="store_true", help="eager decoding (no CUDA graph)")
    ap.add_argument("--compile", default="no", choices=("no", "yes", "both"),
                    help="torch.compile the decode step (both: time with and without)")
    ap.add_argument("--compile-mode", default=COMPILE_MODE, choices=("default", "max-autotune-no-cudagraphs"),
                    help="torch.compile's mode (default: issue 17's definition of compiled bf16; the CUDA graph is "
                         "this script's own, so no mode that makes its own)")
    ap.add_argument("--profile", action="store_true", help="CUDA: each row also gets the step's kernel time by part "
                    "(our kernels, bf16 matmuls, attention, Inductor's other kernels) and its 25 longest kernels")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, eager (checks the script)")
    ap.add_argument("--out", default=str(HERE / "out" / "decode.json"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    shape = TINY if args.dry_run else LLAMA3_8B
    if device.type == "cpu" and not args.dry_run:
        log.warning("no CUDA device: running the tiny model (as --dry-run)")
        shape = TINY
    dtype = torch.bfloat16
    batches = [int(b) for b in args.batch.split(",") if b]
    import transformers

    header = {"row": "header", "benchmark": "decode", "device": torch.cuda.get_device_name() if device.type == "cuda"
              else platform.processor() or "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
              "model": "Llama-3-8B shapes, random" if shape is LLAMA3_8B else "tiny Llama, random",
              "layers": args.layers or shape["num_hidden_layers"], "prompt": args.prompt, "steps": args.steps,
              "fused": not args.no_fuse, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        header["triton"] = triton.__version__
    except ImportError:
        header["triton"] = None
    rows = [header]
    out = Path(args.out)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    base: dict[int, float] = {}
    for plan in [p for p in args.plans.split(",") if p]:
        t0 = time.time()
        model = build(shape, device, dtype, args.layers)
        weight_bytes = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
        fused = 0
        if plan != "bf16":
            head = args.head_format or (plan if get_format(plan).bits >= 4 else "INT4_G128")
            weight_bytes = quantize_linears(model, plan, head)
            probe = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                before = model(input_ids=probe.to(device)).logits.float()
                fused = 0 if args.no_fuse else fuse_projections(model)
                after = model(input_ids=probe.to(device)).logits.float()
            fuse_diff = (after - before).abs().max().item() / before.abs().max().item()
            fuse_top1 = (after.argmax(-1) == before.argmax(-1)).float().mean().item()
            del before, after  # (not counted in the memory held below)
        else:
            head, fuse_diff, fuse_top1 = "BF16", None, None
        build_s = time.time() - t0
        memory = held_memory(model, weight_bytes, device)
        log.info("%s: built in %.0f s, %.2f GB of linear weights, %d fused groups (logits vs separate calls: max "
                 "rel diff %s); GPU memory held %s", plan, build_s, weight_bytes / 1e9, fused, fuse_diff,
                 memory.get("held_vs_checkpoint"))
        for b, comp in [(b, c) for c in {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
                        for b in batches]:
            r = decode_time(model, b, args.prompt, args.steps, not args.no_graphs, args.reps, comp, args.compile_mode,
                            args.profile)
            if plan == "bf16":
                base[(b, comp)] = r["tokens_per_s"]
            row = {"row": "decode", "plan": plan, "head_format": head, "batch": b, "compiled": comp, **r,
                   "linear_weight_bytes": weight_bytes, "fused_groups": fused,
                   "fused_vs_separate_max_rel_diff": fuse_diff, "fused_vs_separate_top1_agreement": fuse_top1,
                   "build_s": build_s, **memory,
                   "speedup_vs_bf16": r["tokens_per_s"] / base[(b, comp)] if (b, comp) in base else None}
            rows.append(row)
            _write(out, rows)
            log.info("%s batch %d: %.1f tokens/s (%.2f ms a step, %s)%s", plan, b, r["tokens_per_s"], r["ms_per_step"],
                     r["mode"], f", {row['speedup_vs_bf16']:.2f}x bf16" if row["speedup_vs_bf16"] else "")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _write(out, rows)
    print(f"\n{header['device']}  torch {header['torch']}  transformers {header['transformers']}  ({header['model']})")
    print(f"{'plan':12s} {'batch':>5s} {'tok/s':>9s} {'ms/step':>8s} {'x bf16':>7s}  mode (against bf16 in the same mode)")
    for r in rows[1:]:
        sp = f"{r['speedup_vs_bf16']:7.2f}" if r["speedup_vs_bf16"] else "      -"
        print(f"{r['plan']:12s} {r['batch']:5d} {r['tokens_per_s']:9.1f} {r['ms_per_step']:8.2f} {sp}  {r['mode']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
