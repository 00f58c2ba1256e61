"""Whole-pipeline wall time: ``dynaquant quantize`` stage by stage beside llama.cpp's own pipeline, in one run.

On one checkpoint (by default Llama-3-8B-shaped: hidden 4096, 32 blocks, 32 / 8 heads, FFN 14336, SmolLM2's
49152-token tokenizer, 7.4 B parameters, BF16, made on ``--device`` by ``decode.build`` with every value random
and none zero, saved as safetensors shards; ``--checkpoint DIR`` uses an existing folder) and one calibration
text (``--calibration``, default dynaquant's own default text, written to the work folder), ``--calibration-chunks``
x ``--ctx`` tokens (32 x 512) for both tools:

* ``dynaquant``: ``python -m dynaquant quantize DIR --device D --no-eval --json --calibration FILE ...`` for each
  ``--modes`` entry (``bpw4.5``: ``--bpw 4.5``; ``gptq``: ``--bpw 4.5 --gptq``; ``bpw2.5``: ``--bpw 2.5``); the
  row has the wall time of the command (``time_s``; ``startup_s`` is the part outside the run's own clock: the
  interpreter, the imports and what follows the encode) and the run's stage times from its JSON (``timings_s``: ``load_s``,
  ``calibration_s``, ``super_weights_s``, ``errors_s``, ``corrections_s``, ``gptq*``, ``quantize_s`` = encode
  and write), the file's size and bits per weight;
* ``llama.cpp``: ``convert_hf_to_gguf.py DIR --outtype bf16`` (``--llama-src``, the vendored tree), then
  ``llama-imatrix -ngl --ngl`` on the same text, ctx and chunks, then ``llama-quantize --imatrix`` to each mode's
  anchor mix (``Q4_K_M`` for ``bpw4.5`` and ``gptq``, ``IQ2_XS`` for ``bpw2.5``) with ``--threads`` (all CPU
  threads); the convert and imatrix steps are run once and counted in every mix's total.

A missing tool gives a row saying so (``note``) and the steps that need it are skipped (``llama-quantize`` to
Q4_K_M without an imatrix when only ``llama-imatrix`` is missing, noted). ``--repeats N`` runs every step N times
and reports medians (``runs_s`` keeps each run). Every dynaquant row names its anchor and gives
``speedup_vs_llama`` (the anchor pipeline's total / ours) and the issue's target (``target_time_s``,
``target_speedup``, ``meets_target``).

Output: ``--out`` (default ``WORK/pipeline_speed.json``), rewritten after every step: a JSON list, first
``{"row": "header", machine, versions, config, llama}``, then ``{"row": "result", "pipeline": "checkpoint" |
"llama.cpp" | "dynaquant", "stage": ..., "time_s": ...}`` rows; the step logs are ``WORK/logs/*.log``.
``--resume`` keeps the rows of an existing ``--out`` and the work folder's files (checkpoint, BF16 GGUF, imatrix)
and runs only what is missing (an IQ2_XS anchor in a second call, say). ``--summary`` prints the table of ``--out``.

    python benchmarks/pipeline_speed.py --work /root/dq/pipe --llama-src /root/dq/llama.cpp \\
        --llama-bin /root/dq/llama.cpp/build-cuda/bin --device cuda                    # H100: see device/pipeline.sh
    python benchmarks/pipeline_speed.py --device cpu --layers 1 --hidden 256 --ffn 512 --heads 4 --kv-heads 2 \\
        --calibration-chunks 2 --ctx 64 --modes bpw4.5 --work /tmp/pipe               # CPU smoke run, tiny shape
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

from decode import LLAMA3_8B, build  # noqa: E402
from quality import file_stats, machine_info, versions  # noqa: E402

log = logging.getLogger("pipeline_speed")

# mode -> (dynaquant quantize arguments, llama.cpp anchor mix, target wall s or None, target speed-up or None)
MODES = {
    "bpw4.5": (["--bpw", "4.5"], "Q4_K_M", 60.0, 3.0),
    "gptq": (["--bpw", "4.5", "--gptq"], "Q4_K_M", 150.0, None),
    "bpw2.5": (["--bpw", "2.5"], "IQ2_XS", None, 8.0),
}
TOOLS = ("llama-imatrix", "llama-quantize")


# --------------------------------------------------------------------------- checkpoint


def load_tokenizer(spec: str | None):
    """A transformers tokenizer from a folder, from a GGUF file's vocabulary, or (None) from the default model's GGUF
    (SmolLM2-135M-Instruct: 49152 tokens)."""
    from transformers import AutoTokenizer

    if spec is None:
        from dynaquant.sources.checkpoint import default_model_path

        spec = str(default_model_path())
    p = Path(spec)
    if p.is_file():
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return AutoTokenizer.from_pretrained(p)


def model_shape(args, tokenizer) -> dict:
    """The LlamaConfig keywords of the checkpoint: Llama-3-8B's, scaled down by the options, SmolLM2's vocabulary."""
    shape = dict(LLAMA3_8B, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, max_position_embeddings=max(8192, args.ctx))
    for key, opt in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("intermediate_size", "ffn"),
                     ("num_attention_heads", "heads"), ("num_key_value_heads", "kv_heads")):
        if getattr(args, opt) is not None:
            shape[key] = getattr(args, opt)
    return shape


def make_checkpoint(folder: Path, shape: dict, tokenizer, device: str, seed: int = 0) -> dict:
    """A random BF16 LlamaForCausalLM of ``shape`` saved to ``folder`` (safetensors shards of at most 5 GB, the
    tokenizer beside them), made on ``device``; returns {parameters, size_bytes, time_s}.

    Values: every projection and the embeddings ``N(0, 0.02^2)``, every norm ``1 + 0.2 N(0, 1)`` (so no tensor is
    zeros or ones; a misplaced norm shows), drawn with a fixed seed on the device.
    """
    t0 = time.perf_counter()
    model = build(shape, torch.device(device), torch.bfloat16, None)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            p.copy_(1 + 0.2 * r if "norm" in name else 0.02 * r)
    model.config.architectures = ["LlamaForCausalLM"]
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="5GB")
    tokenizer.save_pretrained(tmp)
    n = sum(p.numel() for p in model.parameters())
    del model
    tmp.rename(folder)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"parameters": n, "size_bytes": size, "time_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------- steps


def python_env(path: Path | None) -> dict:
    """The environment of a Python step (dynaquant, ``convert_hf_to_gguf.py``): ``path`` first on ``PYTHONPATH``, and
    without ``PYTHONDONTWRITEBYTECODE`` (set in some container images): each run would compile transformers' and
    torch's modules from source again (~10 s of an 8B run on the device machine), where an installed package has its
    bytecode (pip writes it)."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH")) if p)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_step(cmd: list[str], log_path: Path, env: dict | None = None, timeout: float | None = None) -> tuple[float, str]:
    """Run ``cmd`` (stdout and stderr to ``log_path``), return (wall seconds, stdout). Raises CalledProcessError."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("$ %s", " ".join(cmd))
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=timeout)
        dt = time.perf_counter() - t0
        f.write(proc.stdout)
    if proc.returncode:  # the output: the end of the log (stderr, then stdout)
        raise subprocess.CalledProcessError(proc.returncode, cmd, log_path.read_text(errors="replace")[-4000:])
    return dt, proc.stdout


def parse_quantize_json(stdout: str) -> dict:
    """The JSON object ``dynaquant quantize --json`` printed (the last top-level ``{...}`` of stdout).

    Raises:
        ValueError: stdout holds no JSON object.
    """
    start = stdout.rfind("\n{")
    start = 0 if stdout.startswith("{") and start < 0 else start + 1
    if start < 0 or not stdout[start:].lstrip().startswith("{"):
        raise ValueError(f"no JSON object in the quantize output: {stdout[-300:]!r}")
    return json.loads(stdout[start:])


@contextlib.contextmanager
def failure_row(bench: Bench, pipeline: str, what: str):
    """A failed step (non-zero exit, timeout) becomes a row with the end of its output; the next steps still run."""
    try:
        yield
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        log.error("%s %s failed: %s", pipeline, what, e)
        bench.add({"pipeline": pipeline, "stage": "failed", "mode": what, "error": str(e)[-500:],
                   "output_tail": (e.output or "")[-2000:] if isinstance(e.output, str) else None})


def _median_row(times: list[float], **extra) -> dict:
    return {"time_s": statistics.median(times), "runs_s": [round(t, 3) for t in times], **extra}


class Bench:
    """The result list, its file, and the lookups ``--resume`` needs."""

    def __init__(self, out: Path, header: dict, resume: bool):
        self.out, self.rows = out, [header]
        if resume and out.exists():
            self.rows += [r for r in json.loads(out.read_text())[1:] if r.get("row") == "result" and "time_s" in r]

    def find(self, **keys) -> dict | None:
        for r in self.rows[1:]:
            if all(r.get(k) == v for k, v in keys.items()):
                return r
        return None

    def add(self, row: dict) -> dict:
        self.rows.append({"row": "result", **row})
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.rows, indent=1))
        log.info("%s", json.dumps({k: v for k, v in row.items() if not isinstance(v, (dict, list))}))
        return self.rows[-1]


def convert_env(work: Path) -> tuple[dict | None, str | None]:
    """The environment of ``convert_hf_to_gguf.py``: without the ``sentencepiece`` package, a stub of it on
    PYTHONPATH (the script imports it before it looks for ``tokenizer.model``; a folder without one, as here, then
    takes the ``tokenizer.json`` path as it would with the package); (:func:`python_env`, None) when the package is
    there."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        return python_env(None), None
    stub = work / "stub" / "sentencepiece"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text("class SentencePieceProcessor:  # stub: the folder has no tokenizer.model\n    pass\n")
    env = python_env(stub.parent)
    return env, "sentencepiece not installed: convert_hf_to_gguf.py ran with a stub of it (no tokenizer.model here)"


def llama_steps(bench: Bench, args, ckpt: Path, cal: Path, mixes: list[str]) -> None:
    """convert, imatrix and one quantize per mix (skipped with a row saying why where a tool is missing)."""
    work, logs = args.work, args.work / "logs"
    bf16, imat = work / "llama-bf16.gguf", work / "llama-imatrix.gguf"
    bins = {t: Path(args.llama_bin) / t for t in TOOLS} if args.llama_bin else {}
    missing = [t for t in TOOLS if t not in bins or not bins[t].is_file()]
    for t in missing:
        if not bench.find(pipeline="llama.cpp", stage=t.removeprefix("llama-"), skipped=True):
            bench.rows.append({"row": "result", "pipeline": "llama.cpp", "stage": t.removeprefix("llama-"), "skipped": True,
                               "note": f"{t} not found in --llama-bin {args.llama_bin}: its steps are skipped"})
    convert = Path(args.llama_src or "") / "convert_hf_to_gguf.py"
    if not (args.llama_src and convert.is_file()):
        bench.add({"pipeline": "llama.cpp", "stage": "convert", "skipped": True,
                   "note": f"no convert_hf_to_gguf.py in --llama-src {args.llama_src}: llama.cpp's pipeline skipped"})
        return
    if not (bench.find(pipeline="llama.cpp", stage="convert", skipped=None) and bf16.exists()):
        env, note = convert_env(work)
        times = []
        for _ in range(args.repeats):
            bf16.unlink(missing_ok=True)
            times.append(run_step([sys.executable, str(convert), str(ckpt), "--outtype", "bf16", "--outfile", str(bf16)],
                                  logs / "convert.log", env=env)[0])
        bench.add({"pipeline": "llama.cpp", "stage": "convert", **_median_row(times, **file_stats(bf16)),
                   **({"note": note} if note else {})})
    have_imat = "llama-imatrix" not in missing
    if have_imat and not (bench.find(pipeline="llama.cpp", stage="imatrix", skipped=None) and imat.exists()):
        cmd = [str(bins["llama-imatrix"]), "-m", str(bf16), "-f", str(cal), "-c", str(args.ctx), "--chunks",
               str(args.calibration_chunks), "-ngl", str(args.ngl), "-t", str(args.threads), "-o", str(imat)]
        times = [run_step(cmd, logs / "imatrix.log")[0] for _ in range(args.repeats)]
        bench.add({"pipeline": "llama.cpp", "stage": "imatrix", "ngl": args.ngl, **_median_row(times)})
    if "llama-quantize" in missing:
        return
    for mix in mixes:
        if bench.find(pipeline="llama.cpp", stage="quantize", mix=mix):
            continue
        if not have_imat and mix.startswith("IQ"):
            bench.add({"pipeline": "llama.cpp", "stage": "quantize", "mix": mix, "skipped": True,
                       "note": f"{mix} needs an imatrix and llama-imatrix is missing"})
            continue
        out = work / f"llama-{mix}.gguf"
        cmd = [str(bins["llama-quantize"]), *(["--imatrix", str(imat)] if have_imat else []), str(bf16), str(out), mix,
               str(args.threads)]
        times = [run_step(cmd, logs / f"quantize-{mix}.log")[0] for _ in range(args.repeats)]
        row = {"pipeline": "llama.cpp", "stage": "quantize", "mix": mix, "threads": args.threads,
               **_median_row(times, **file_stats(out))}
        if not have_imat:
            row["note"] = "without an imatrix (llama-imatrix missing)"
        bench.add(row)
        if not args.keep:
            out.unlink()


def llama_total(bench: Bench, mix: str) -> dict | None:
    """The llama.cpp pipeline's total for ``mix``: convert + imatrix (where run) + quantize; None if not measured."""
    q = bench.find(pipeline="llama.cpp", stage="quantize", mix=mix, skipped=None)
    c = bench.find(pipeline="llama.cpp", stage="convert", skipped=None)
    if q is None or c is None:
        return None
    i = bench.find(pipeline="llama.cpp", stage="imatrix", skipped=None)
    stages = {"convert_s": c["time_s"], **({"imatrix_s": i["time_s"]} if i else {}), "quantize_s": q["time_s"]}
    return {"stages_s": stages, "time_s": sum(stages.values()), "size_bytes": q.get("size_bytes"), "bpw": q.get("bpw")}


def dynaquant_mode(bench: Bench, args, ckpt: Path, cal: Path, mode: str) -> dict:
    """One ``dynaquant quantize`` run per repeat; the row of medians (stage times: each stage's median)."""
    extra = list(MODES[mode][0])
    if mode in args.mode_bpw:
        extra[extra.index("--bpw") + 1] = args.mode_bpw[mode]
    out = args.work / f"dynaquant-{mode}.gguf"
    env = python_env(ROOT)
    cmd = [sys.executable, "-m", "dynaquant", "quantize", str(ckpt), *extra, "--device", args.device, "--no-eval", "--json",
           "--calibration", str(cal), "--calibration-chunks", str(args.calibration_chunks), "--ctx", str(args.ctx),
           "-o", str(out), *args.dynaquant_arg]
    walls, results = [], []
    if args.warmup:  # untimed: Triton compiles its kernels into its cache, Python writes the bytecode
        out.unlink(missing_ok=True)
        wall, stdout = run_step(cmd, args.work / "logs" / f"dynaquant-{mode}-warmup.log", env=env)
        warm = {"warmup_time_s": wall, "warmup_timings_s": parse_quantize_json(stdout).get("timings_s")}
    for i in range(args.repeats):
        out.unlink(missing_ok=True)
        wall, stdout = run_step(cmd, args.work / "logs" / f"dynaquant-{mode}-{i}.log", env=env)
        walls.append(wall)
        results.append(parse_quantize_json(stdout))
    res = results[-1]
    stages = {k: statistics.median(r["timings_s"].get(k, 0.0) for r in results) for k in res["timings_s"]}
    run_s = statistics.median(r["time_s"] for r in results)
    row = {"pipeline": "dynaquant", "stage": "total", "mode": mode, "args": extra, **_median_row(walls),
           "run_time_s": run_s, "startup_s": statistics.median(walls) - run_s, "timings_s": stages,
           "runs_run_time_s": [r["time_s"] for r in results], "runs_timings_s": [r["timings_s"] for r in results],
           **file_stats(out), "formats": res.get("formats"), "gptq": res.get("gptq"), **(warm if args.warmup else {})}
    if not args.keep:
        out.unlink()
    return row


def compare(row: dict, bench: Bench) -> dict:
    """The anchor's total, the speed-up over it and the issue's targets for a dynaquant row."""
    _, mix, t_time, t_speedup = MODES[row["mode"]]
    tot = llama_total(bench, mix)
    out = {"anchor": f"llama.cpp {mix}", "anchor_time_s": tot["time_s"] if tot else None,
           "anchor_stages_s": tot["stages_s"] if tot else None,
           "speedup_vs_llama": tot["time_s"] / row["time_s"] if tot else None,
           "target_time_s": t_time, "target_speedup": t_speedup}
    ok = [row["time_s"] <= t_time] if t_time else []
    if t_speedup:
        ok.append(out["speedup_vs_llama"] is not None and out["speedup_vs_llama"] >= t_speedup)
    out["meets_target"] = all(ok)
    return out


# --------------------------------------------------------------------------- table


def summary(rows: list[dict]) -> str:
    """Markdown table: every pipeline's total and stages (seconds), speed-ups and targets."""
    lines = ["| pipeline | mode / mix | stages (s) | total s | speed-up vs llama.cpp | size bytes | bpw | meets target |",
             "|---|---|---|---|---|---|---|---|"]
    res = [r for r in rows if r.get("row") == "result"]
    for r in res:
        if r.get("skipped"):
            lines.append(f"| {r['pipeline']} | {r.get('stage')} {r.get('mix', '')} | skipped: {r.get('note', '')} | | | | | |")
        elif r.get("stage") == "failed":
            lines.append(f"| {r['pipeline']} | {r.get('mode')} | failed: {r.get('error', '')[-120:]} | | | | | |")
    mixes = [r["mix"] for r in res if r.get("stage") == "quantize" and not r.get("skipped")]
    conv = next((r for r in res if r.get("stage") == "convert" and not r.get("skipped")), None)
    imat = next((r for r in res if r.get("stage") == "imatrix" and not r.get("skipped")), None)
    for mix in mixes:
        q = next(r for r in res if r.get("stage") == "quantize" and r.get("mix") == mix)
        st = {"convert": conv and conv["time_s"], "imatrix": imat and imat["time_s"], "quantize": q["time_s"]}
        tot = sum(v for v in st.values() if v)
        lines.append(f"| llama.cpp | {mix} | " + ", ".join(f"{k} {v:.1f}" for k, v in st.items() if v)
                     + f" | {tot:.1f} | | {q.get('size_bytes', '')} | {q.get('bpw', 0):.3f} | |")
    for r in res:
        if r.get("pipeline") == "dynaquant" and r.get("stage") == "total":
            st = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in r["timings_s"].items() if v >= 0.05)
            sp, anchor = r.get("speedup_vs_llama"), r.get("anchor")
            mt = r.get("meets_target")
            lines.append(f"| dynaquant | {r['mode']} | {st}, startup {r['startup_s']:.1f} | {r['time_s']:.1f} | "
                         f"{'' if sp is None else f'{sp:.2f}x vs {anchor}'} | {r.get('size_bytes')} "
                         f"| {r.get('bpw', 0):.3f} | {'' if mt is None else ('yes' if mt else 'no')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=HERE / "out" / "pipeline", help="work folder (checkpoint, GGUFs, logs)")
    p.add_argument("--out", type=Path, help="JSON rows (default WORK/pipeline_speed.json)")
    p.add_argument("--modes", default="bpw4.5,gptq,bpw2.5", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--no-llama", action="store_true", help="dynaquant only (no llama.cpp anchor)")
    p.add_argument("--no-dynaquant", action="store_true", help="llama.cpp only")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of the checkpoint maker and of dynaquant")
    p.add_argument("--checkpoint", type=Path, help="an existing HF folder to use instead of making one")
    p.add_argument("--make-only", action="store_true", help="make the checkpoint (WORK/checkpoint) and stop")
    p.add_argument("--tokenizer", help="tokenizer folder or GGUF file (default: the default model's GGUF)")
    p.add_argument("--save-tokenizer", type=Path, metavar="DIR", help="write the tokenizer to DIR and stop")
    p.add_argument("--layers", type=int, help="blocks (default 32)")
    p.add_argument("--hidden", type=int, help="hidden size (default 4096)")
    p.add_argument("--ffn", type=int, help="FFN size (default 14336)")
    p.add_argument("--heads", type=int, help="attention heads (default 32)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default 8)")
    p.add_argument("--calibration", type=Path, help="calibration text (default: dynaquant's default, written to WORK)")
    p.add_argument("--calibration-chunks", type=int, default=32, help="calibration chunks, both tools (default 32)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk, both tools (default 512)")
    p.add_argument("--llama-src", help="llama.cpp source tree (convert_hf_to_gguf.py)")
    p.add_argument("--llama-bin", help="folder of llama-imatrix and llama-quantize")
    p.add_argument("--ngl", type=int, default=99, help="llama-imatrix GPU layers (default 99)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads (default all)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every step (medians reported)")
    p.add_argument("--warmup", action="store_true",
                   help="one untimed dynaquant run per mode first (its wall and stages kept as warmup_*): Triton's "
                        "kernel cache and Python's bytecode filled, as on a machine that has run dynaquant before")
    p.add_argument("--mode-bpw", action="append", default=[], metavar="MODE=BPW",
                   help="another --bpw for a mode (tiny smoke shapes, whose embeddings need more: bpw4.5=6)")
    p.add_argument("--dynaquant-arg", action="append", default=[], help="one more dynaquant quantize argument (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the quantized files")
    p.add_argument("--resume", action="store_true", help="keep the rows and files of an earlier run; run what is missing")
    p.add_argument("--summary", action="store_true", help="print the table of --out and stop")
    args = p.parse_args(argv)
    args.out = args.out or args.work / "pipeline_speed.json"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.mode_bpw = dict(kv.split("=", 1) for kv in args.mode_bpw)
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"unknown --modes {bad}: choose from {list(MODES)}")
    if args.summary:
        print(summary(json.loads(args.out.read_text())))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tok = load_tokenizer(args.tokenizer)
    if args.save_tokenizer:
        tok.save_pretrained(args.save_tokenizer)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    shape = model_shape(args, tok)
    header = {"row": "header", "machine": machine_info(), "versions": versions(None),
              "config": {"modes": modes, "shape": shape, "device": args.device, "calibration_chunks": args.calibration_chunks,
                         "ctx": args.ctx, "threads": args.threads, "ngl": args.ngl, "repeats": args.repeats,
                         "dynaquant_args": args.dynaquant_arg, "mode_bpw": args.mode_bpw},
              "llama": {"src": args.llama_src, "bin": args.llama_bin,
                        "build": (Path(args.llama_bin).parent / "CMakeCache.txt").is_file() and _cmake_flags(args.llama_bin)
                        if args.llama_bin else None}}
    bench = Bench(args.out, header, args.resume)

    ckpt = args.checkpoint or args.work / "checkpoint"
    if args.checkpoint is None and (ckpt / "config.json").is_file():
        kept = json.loads((ckpt / "config.json").read_text())
        differ = {k: (kept.get(k), v) for k, v in shape.items() if k in kept and kept.get(k) != v}
        if differ:  # a WORK's checkpoint of another shape (another --layers, say) would be measured silently
            p.error(f"{ckpt} holds a checkpoint of another shape ({', '.join(f'{k} {a} != {b}' for k, (a, b) in differ.items())}):"
                    " use another --work, or remove it")
    if args.checkpoint is None and not (ckpt / "config.json").is_file():
        bench.add({"pipeline": "checkpoint", "stage": "make", "device": args.device,
                   **make_checkpoint(ckpt, shape, tok, args.device)})
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the GPU's memory back for llama-imatrix and dynaquant
    if args.make_only:
        return 0
    cal = args.calibration or args.work / "calibration.txt"
    if args.calibration is None:
        from dynaquant.analysis.texts import default_calibration_text

        cal.write_text(default_calibration_text())
    n_tok = len(tok(cal.read_text())["input_ids"])
    header["config"].update(calibration=str(cal), calibration_tokens=n_tok)
    if n_tok < args.calibration_chunks * args.ctx:
        log.warning("%s: %d tokens, fewer than %d x %d: both tools use what there is", cal, n_tok, args.calibration_chunks,
                    args.ctx)

    mixes = list(dict.fromkeys(MODES[m][1] for m in modes))
    if not args.no_llama:
        with failure_row(bench, "llama.cpp", "pipeline"):
            llama_steps(bench, args, ckpt, cal, mixes)
    if not args.no_dynaquant:
        for mode in modes:
            if not bench.find(pipeline="dynaquant", mode=mode):
                with failure_row(bench, "dynaquant", mode):
                    bench.add(dynaquant_mode(bench, args, ckpt, cal, mode))
    for r in bench.rows[1:]:  # anchors: every row against the llama.cpp totals of this run (or the resumed one)
        if r.get("pipeline") == "dynaquant" and r.get("stage") == "total":
            r.update(compare(r, bench))
    args.out.write_text(json.dumps(bench.rows, indent=1))
    print(summary(bench.rows))
    return 0


def _cmake_flags(bin_dir: str) -> dict:
    """The CUDA-relevant settings of the llama.cpp build behind ``bin_dir`` (its CMakeCache.txt)."""
    flags = {}
    for line in (Path(bin_dir).parent / "CMakeCache.txt").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("GGML_CUDA", "CMAKE_CUDA_ARCHITECTURES", "GGML_NATIVE", "CMAKE_BUILD_TYPE", "BUILD_SHARED_LIBS"):
            flags[key] = line.split("=", 1)[1]
    return flags


if __name__ == "__main__":
    sys.exit(main())
