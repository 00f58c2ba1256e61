"""Scale benchmark: ``dynaquant quantize --stream`` on random checkpoints of real shapes, wall time per stage, peak
host RSS and peak GPU memory, and the full models' times extrapolated per block.

Checkpoints (made on ``--device``; every value random, none zero: projections ``N(0, 0.02^2)``, norms
``1 + 0.2 N(0, 1)``; SmolLM2's 49152-token tokenizer; safetensors shards of at most 5 GB):

* ``llama-1b`` / ``llama-8b`` (hidden 4096, FFN 14336, 32 / 8 heads, 32 blocks) / ``llama-70b`` (hidden 8192,
  FFN 28672, 64 / 8 heads, 80 blocks), BF16;
* ``deepseek-v3``: transformers' DeepseekV3Config (hidden 7168, MLA, 3 dense blocks of FFN 18432, then MoE blocks of
  256 routed experts of 2048 and one shared expert, top-8, 61 blocks), stored as the release is: every projection in
  FP8 (e4m3) with 128 x 128 block scales (``weight_scale_inv``), ``quantization_config.quant_method = fp8``;
* ``tiny-llama`` / ``tiny-deepseek``: the same code on shapes a CPU runs in seconds (smoke test).

``--blocks N[,M]`` cuts the model to N (and M) blocks. With two cuts the full model's time is extrapolated per block
and stage: ``t(full) = t(N) + (t(M) - t(N)) / (M - N) * (L - N)``; reading the full checkpoint is reported apart at
an assumed ``--read-gbps`` (3 GB/s: the benchmark reads from the page cache, a real 70B or DeepSeek-V3 run reads from
disk). Each run: ``python -m dynaquant quantize DIR --stream --bpw B --device D --no-eval --correct 0 --json`` in a
child process (peak RSS of the child; peak GPU memory: ``torch.cuda.max_memory_allocated`` at its end);
``--modes stream,whole`` adds the whole-model pipeline on the same checkpoint for comparison.

``--nproc 1,2`` (issue 21) runs each stream quantize once per count: 1 is the single process, N > 1 ``torchrun
--standalone --nproc-per-node N`` on the same checkpoint (one GPU a rank, ``dynaquant.distributed``); each row records
every rank's peak GPU memory and RSS and the output's SHA-256 (the outputs of all counts must be the same bytes), and
a ``speedup`` row per cut gives the single process's wall time and stage times over each count's. ``--gptq`` adds
``--gptq`` to every run.

Output: ``--out`` (JSON rows, rewritten after each run): a header (machine, versions, config), one row per run
(shape, blocks, parameters, checkpoint bytes, wall time, the run's stage times (``write_s``: the tensor loop's
writing, a part of ``quantize_s``), peak RSS and GPU bytes, file bytes),
one ``extrapolated`` row per shape with two cuts. Peak RSS: the child's own ``ru_maxrss``.

    python benchmarks/scale.py --shape tiny-llama --blocks 2,4 --device cpu --bpw 6.5 --work /tmp/scale  # smoke test
    python benchmarks/scale.py --shape llama-70b --blocks 2,4 --device cuda --work /root/dq/scale   # H100
    python benchmarks/scale.py --shape deepseek-v3 --blocks 4,5 --device cuda --work /root/dq/scale
    python benchmarks/scale.py --shape llama-8b --blocks 32 --nproc 1,2 --device cuda --work /root/dq/scale  # 2 GPUs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from pipeline_speed import load_tokenizer  # noqa: E402
from quality import machine_info, versions  # noqa: E402

log = logging.getLogger("scale")

LLAMA = dict(num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
             max_position_embeddings=8192, tie_word_embeddings=False)
SHAPES = {
    "llama-1b": ("llama", dict(LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16)),
    "llama-8b": ("llama", dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32)),
    "llama-70b": ("llama", dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                num_hidden_layers=80)),
    "deepseek-v3": ("deepseek", dict(num_hidden_layers=61)),  # DeepseekV3Config's defaults are V3's
    "tiny-llama": ("llama", dict(LLAMA, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=6)),
    "tiny-deepseek": ("deepseek", dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                       n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                                       first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                                       kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32,
                                       v_head_dim=32, n_group=1, topk_group=1, num_hidden_layers=6)),
}
FP8_BLOCK = 128


def make_config(shape: str, blocks: int, tokenizer):
    """The transformers config of ``shape`` cut to ``blocks`` blocks, with the tokenizer's vocabulary."""
    from transformers import DeepseekV3Config, LlamaConfig

    kind, kw = SHAPES[shape]
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if kind == "llama":
        cfg = LlamaConfig(**{**kw, **common, "num_hidden_layers": blocks})
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = DeepseekV3Config(**{**kw, **common, "num_hidden_layers": blocks, "tie_word_embeddings": False})
        cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def make_checkpoint(folder: Path, shape: str, blocks: int, tokenizer, device: str, seed: int = 0) -> dict:
    """A random checkpoint (see the module docstring) in ``folder``; {parameters, size_bytes, full_*, time_s}."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = make_config(shape, blocks, tokenizer)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            for part in (p.unbind(0) if p.ndim == 3 else [p]):  # stacked experts one at a time (28 GB in fp32)
                r = torch.randn(part.shape, generator=g, device=p.device, dtype=torch.float32)
                part.copy_(1 + 0.2 * r if "norm" in name else 0.02 * r)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="5GB")
    n = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the quantize child needs the GPU memory this process would keep cached
    if SHAPES[shape][0] == "deepseek":
        to_fp8(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"parameters": n, "size_bytes": size, "time_s": round(time.perf_counter() - t0, 2)}


def _fp8_weight(name: str, x: torch.Tensor) -> bool:
    return (x.ndim == 2 and name.endswith(".weight") and "norm" not in name and "embed_tokens" not in name
            and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight"))


def to_fp8(folder: Path) -> None:
    """Rewrite a BF16 checkpoint's projections as DeepSeek's release stores them: float8_e4m3fn with a float32
    ``weight_scale_inv`` per 128 x 128 block (``w = fp8 * scale_inv``), shard by shard; config.json gets the
    release's ``quantization_config``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    fmax = torch.finfo(torch.float8_e4m3fn).max
    for shard in sorted(folder.glob("*.safetensors")):
        out = {}
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                x = f.get_tensor(name)
                if not _fp8_weight(name, x):
                    out[name] = x
                    continue
                n, k = x.shape
                pad = torch.zeros(math.ceil(n / FP8_BLOCK) * FP8_BLOCK, math.ceil(k / FP8_BLOCK) * FP8_BLOCK)
                pad[:n, :k] = x.float()
                b = pad.view(pad.shape[0] // FP8_BLOCK, FP8_BLOCK, pad.shape[1] // FP8_BLOCK, FP8_BLOCK)
                scale = (b.abs().amax(dim=(1, 3)) / fmax).clamp_min(1e-12)
                q = (b / scale[:, None, :, None]).view_as(pad)[:n, :k].to(torch.float8_e4m3fn)
                out[name], out[name + "_scale_inv"] = q, scale
        save_file(out, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        for name, file in list(idx["weight_map"].items()):
            with safe_open(folder / file, "pt") as f:
                if name + "_scale_inv" in f.keys():
                    idx["weight_map"][name + "_scale_inv"] = file
        index.write_text(json.dumps(idx, indent=2))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    cfg.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


CHILD = """
import cProfile, io, json, os, pstats, resource, sys, torch
from dynaquant.cli import main
prof = cProfile.Profile() if os.environ.get("DQ_SCALE_PROFILE") else None
rc = main(sys.argv[1:]) if prof is None else prof.runcall(main, sys.argv[1:])
if prof is not None:  # the host's view: where each rank's Python spent (or waited for the GPU)
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        top, folder, tag = os.environ["DQ_SCALE_PROFILE"].split(":", 2)
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(int(top))
        rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        with open(os.path.join(folder, f"profile-{tag}-n{world}-r{rank}-{key}.txt"), "w") as f:
            f.write(buf.getvalue())
    prof.dump_stats(os.path.join(folder, f"profile-{tag}-n{world}-r{rank}.pstats"))  # (for pstats queries later)
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rank = int(os.environ.get("RANK", "0"))
with open(os.environ["DQ_SCALE_CHILD"] + f".{rank}", "w") as f:
    json.dump({"rank": rank, "rc": rc, "gpu_peak_bytes": int(peak), "peak_rss_bytes": rss}, f)
sys.exit(rc)
"""


def run_quantize(ckpt: Path, out: Path, work: Path, args, mode: str = "stream", nproc: int = 1,
                 torchrun: bool = False) -> dict:
    """One ``quantize --stream`` (``mode`` "stream") or whole-model ``quantize`` ("whole") in a child (``nproc`` > 1
    or ``torchrun``: torchrun with that many ranks); the row's measurements."""
    stream = ["--stream", "--work-dir", str(work)] if mode == "stream" else []
    if mode == "stream" and args.max_gpu_memory:
        stream += ["--max-gpu-memory", args.max_gpu_memory]
    script = work.parent / "scale_child.py"
    script.write_text(CHILD)
    measured = work.parent / f"{out.stem}.child"
    launch = [sys.executable] if nproc == 1 and not torchrun else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node", str(nproc)]
    # -v: the stream pipeline logs its stages' GPU peaks
    cmd = [*launch, str(script), "-v", "quantize", str(ckpt), *stream, "--bpw", str(args.bpw), "--device",
           args.device, "--no-eval", "--json", "-o", str(out), "--correct", str(args.correct),
           "--calibration-chunks", str(args.calibration_chunks), "--ctx", str(args.ctx),
           *(["--gptq"] if args.gptq else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "DQ_SCALE_CHILD": str(measured),
                            **({"DQ_SCALE_PROFILE": f"{args.profile}:{args.profile_dir}:{out.stem}"} if args.profile else {})})
    row: dict = {"nproc": nproc, **({"torchrun": True} if torchrun else {}), "time_s": round(time.perf_counter() - t0, 2)}
    if p.returncode != 0:
        row["error"] = (p.stderr + p.stdout)[-3000:]
        return row
    ranks = [json.loads(Path(f"{measured}.{r}").read_text()) for r in range(nproc)]
    res = json.loads(p.stdout[p.stdout.index("{"):])
    peaks = [ln.split("peak GPU memory after ", 1)[1] for ln in p.stderr.splitlines() if "peak GPU memory after " in ln]
    if peaks:
        row["gpu_peak_by_stage"] = peaks  # cumulative maxima, logged by the stream pipeline (rank 0)
    row.update(gpu_peak_bytes=max(r["gpu_peak_bytes"] for r in ranks), peak_rss_bytes=max(r["peak_rss_bytes"] for r in ranks),
               timings_s=res.get("timings_s"), file_bytes=res.get("size_bytes"), bpw=res.get("bpw"), gptq=res.get("gptq"),
               sha256=hashlib.sha256(out.read_bytes()).hexdigest())
    if nproc > 1:
        row.update(gpu_peak_bytes_by_rank=[r["gpu_peak_bytes"] for r in ranks],
                   peak_rss_bytes_by_rank=[r["peak_rss_bytes"] for r in ranks])
    return row


def speedup(rows: list[dict]) -> dict | None:
    """The single process's wall and stage times over each rank count's (rows of one cut), and whether every count
    wrote the same bytes."""
    one = next((r for r in rows if r.get("nproc") == 1 and not r.get("torchrun") and "error" not in r), None)
    more = [r for r in rows if (r.get("nproc", 1) > 1 or r.get("torchrun")) and "error" not in r]
    if one is None or not more:
        return None
    out = {"row": "speedup", "shape": one["shape"], "blocks": one["blocks"],
           "same_bytes": len({r["sha256"] for r in [one, *more]}) == 1}
    for r in more:
        st = {k: round(v / r["timings_s"][k], 2) for k, v in (one.get("timings_s") or {}).items()
              if (r.get("timings_s") or {}).get(k)}
        out[f"nproc_{r['nproc']}{'_torchrun' * (r['nproc'] == 1)}"] = {"wall": round(one["time_s"] / r["time_s"], 2), "stages": st}
    return out


def extrapolate(rows: list[dict], full_blocks: int, full_bytes: float, read_gbps: float) -> dict:
    """The full model's times per stage from two cuts (linear in the blocks), and reading at ``read_gbps``."""
    a, b = sorted(rows, key=lambda r: r["blocks"])[:2]
    out = {"row": "extrapolated", "shape": a["shape"], "blocks": full_blocks, "from_blocks": [a["blocks"], b["blocks"]]}
    stages = {}
    for k in sorted(set(a.get("timings_s") or {}) & set(b.get("timings_s") or {})):
        per = (b["timings_s"][k] - a["timings_s"][k]) / (b["blocks"] - a["blocks"])
        stages[k] = round(a["timings_s"][k] + per * (full_blocks - a["blocks"]), 1)
    per_wall = (b["time_s"] - a["time_s"]) / (b["blocks"] - a["blocks"])
    out.update(stages_s=stages, time_s=round(a["time_s"] + per_wall * (full_blocks - a["blocks"]), 1),
               read_s=round(full_bytes / (read_gbps * 1e9), 1), read_assumption_gbps=read_gbps,
               per_block_s=round(per_wall, 2))
    out["total_with_read_s"] = round(out["time_s"] + out["read_s"], 1)
    if per_wall <= 0:
        out["error"] = "the larger cut ran no slower than the smaller: a cold first run (compiles)? use --warmup"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", choices=list(SHAPES), required=True)
    p.add_argument("--blocks", default="2,4", help="blocks of the cut checkpoints (one or two numbers)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bpw", type=float, default=4.5)
    p.add_argument("--calibration-chunks", type=int, default=32)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--tokenizer", help="tokenizer folder or GGUF (default: the default model's)")
    p.add_argument("--read-gbps", type=float, default=3.0, help="assumed disk read speed for the full model (GB/s)")
    p.add_argument("--work", type=Path, default=HERE / "out" / "scale")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", action="store_true", help="keep checkpoints and outputs")
    p.add_argument("--modes", default="stream",
                   help="comma-separated: stream (quantize --stream), whole (the whole-model pipeline, for comparison)")
    p.add_argument("--max-gpu-memory", help="quantize --stream's --max-gpu-memory (e.g. 40GiB: a DeepSeek-V3 MoE block "
                   "then keeps its experts in FP8 as stored)")
    p.add_argument("--nproc", default="1", help="stream runs with these rank counts (1: one process; N: torchrun "
                   "--nproc-per-node N, one GPU a rank; 1t: torchrun with one rank), e.g. 1,2")
    p.add_argument("--gptq", action="store_true", help="quantize with --gptq")
    p.add_argument("--append", type=Path, action="append", default=[], metavar="JSON",
                   help="result rows of an earlier scale.py run on the same cut (the same seed makes the same "
                   "checkpoint): copied into this run's rows and its speedup row (e.g. --nproc 1 on one device call, "
                   "--nproc 2 --append THAT on the next, each call within the device's time limit; or --blocks 5 "
                   "--append THE-4-BLOCK-RUN: the two cuts' extrapolation)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="run each quantize under cProfile: the N top functions by cumulative and own time, per rank, "
                   "in --out's folder (profile-OUTPUT-nN-rR-cumulative.txt, ...; the whole profile: profile-OUTPUT-nN-rR.pstats); "
                   "the timings then include its overhead")
    p.add_argument("--warmup", action="store_true",
                   help="quantize the first cut once before the timed runs (row 'warmup'): on a fresh machine the first "
                   "run holds Triton's compiles and autotuning (a 70B 4-block cut: errors 39.6 s cold, 10.7 s at 6 "
                   "blocks warm), which can make the extrapolation's per-block time negative")
    p.add_argument("--correct", type=int, default=0,
                   help="measured-correction rounds (default 0: they re-measure whole plans, minutes each on 8B)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or args.work / "scale.json"
    args.profile_dir = out.parent.resolve()
    tokenizer = load_tokenizer(args.tokenizer)
    rows: list[dict] = [{"row": "header", "benchmark": "scale", "machine": machine_info(),
                         "versions": versions(None), "config": {k: str(v) for k, v in vars(args).items()}}]

    def write():
        out.write_text(json.dumps(rows, indent=1))

    cuts = [int(x) for x in args.blocks.split(",")]
    earlier = [{**r, "appended_from": str(f)} for f in args.append for r in json.loads(f.read_text())
               if r.get("row") == "result"]
    for shape in args.shape:
        # the extrapolation's cuts: this run's single-process stream rows, and an appended one of a cut not run here
        # (--blocks 5 --append THE-4-BLOCK-RUN: each cut within one device call's limit)
        done = [r for r in earlier if r.get("shape") == shape and r.get("mode") == "stream" and r.get("nproc", 1) == 1
                and not r.get("torchrun") and r.get("blocks") not in cuts]
        rows.extend(done)
        full_blocks = SHAPES[shape][1].get("num_hidden_layers") or make_config(shape, 61, tokenizer).num_hidden_layers
        for n in cuts:
            ckpt = args.work / f"{shape}-{n}"
            log.info("=== %s cut to %d blocks: checkpoint", shape, n)
            made = make_checkpoint(ckpt, shape, n, tokenizer, args.device)
            cut_rows = [r for r in earlier if r.get("shape") == shape and r.get("blocks") == n]
            rows.extend(cut_rows)
            runs = [(m, x) for m in args.modes.split(",") for x in (args.nproc.split(",") if m == "stream" else ["1"])]
            if args.warmup and n == cuts[0]:  # Triton's first compiles and autotuning, not timed as a cut
                log.info("=== %s cut to %d blocks: warm-up quantize (not used)", shape, n)
                warm = run_quantize(ckpt, args.work / f"{shape}-{n}-warmup.gguf", args.work / f"{shape}-{n}-warmup.work",
                                    args, "stream", 1, False)
                rows.append({"row": "warmup", "shape": shape, "blocks": n, "time_s": warm.get("time_s"),
                             "timings_s": warm.get("timings_s")})
                (args.work / f"{shape}-{n}-warmup.gguf").unlink(missing_ok=True)
            for mode, x in runs:
                k, tr = int(x.rstrip("t")), x.endswith("t")
                log.info("=== %s cut to %d blocks: quantize (%s, %s process%s)", shape, n, mode, x, "es" * (k > 1))
                gguf = args.work / f"{shape}-{n}-{mode}-{x}.gguf"
                row = {"row": "result", "shape": shape, "blocks": n, "mode": mode, "checkpoint": made,
                       **run_quantize(ckpt, gguf, args.work / f"{shape}-{n}-{mode}-{x}.work", args, mode, k, tr)}
                rows.append(row)
                cut_rows.append(row)
                if mode == "stream" and k == 1 and not tr:
                    done.append(row)
                write()
                if not args.keep:
                    gguf.unlink(missing_ok=True)
            if (sp := speedup([r for r in cut_rows if r["mode"] == "stream"])) is not None:
                rows.append(sp)
                write()
            if not args.keep:
                shutil.rmtree(ckpt, ignore_errors=True)
        if len(done) == 2 and all("error" not in r for r in done):
            a, b = sorted(done, key=lambda r: r["blocks"])
            per_block_bytes = (b["checkpoint"]["size_bytes"] - a["checkpoint"]["size_bytes"]) / (b["blocks"] - a["blocks"])
            full_bytes = a["checkpoint"]["size_bytes"] + per_block_bytes * (full_blocks - a["blocks"])
            rows.append(extrapolate(done, full_blocks, full_bytes, args.read_gbps))
            write()
    for r in rows[1:]:
        print(json.dumps({**{k: r.get(k) for k in ("row", "shape", "blocks", "mode", "nproc", "time_s", "peak_rss_bytes",
                                                   "gpu_peak_bytes", "read_s", "total_with_read_s", "same_bytes",
                                                   "nproc_2", "error")},
                          "stages_s": r.get("stages_s") or r.get("timings_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
