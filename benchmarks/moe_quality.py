"""MoE quality benchmark: dynaquant's dynamic MoE plans against llama.cpp's ``--imatrix`` mixes at the same size.

No MoE checkpoint can be downloaded here, so the benchmark builds one by *sparse upcycling*
(Komatsuzaki et al. 2022) the dithered dense SmolLM2-135M-Instruct of ``quality.py``
(``make_dithered.py``): a ``MixtralForCausalLM`` with the dense model's embeddings, attention and
norms, ``--experts`` experts per layer (top ``--top-k``), each expert the dense MLP plus independent
Gaussian noise of ``--noise`` times the weight's standard deviation (so experts differ and their
quantization errors do not cancel), and a random router (``N(0, s^2)`` with ``s`` chosen so that
the router logits have standard deviation ``--router-std`` on the RMS-normalised hidden state:
spread, not uniform). The checkpoint keeps most of the dense model's quality; both perplexities
are measured on the evaluation text and reported.

Hidden size 576 is not a multiple of 256: the 256-block formats (K-quants, i-quants) cannot take
rows of 576, so ``ffn_gate_exps``/``ffn_up_exps`` (and attention) fall back on 32-block formats
(llama.cpp: IQ4_NL / Q5_0 / Q8_0 ...); only ``ffn_down_exps`` (rows of 1536) can take IQ2_*/Q2_K.
The fallbacks are reported per file (``tensor_types``, ``expert_types``).

Methods, at the exact file size of each llama.cpp mix (``--mixes``):

* ``llama.cpp``: ``llama-imatrix`` on the calibration text, then ``llama-quantize --imatrix MIX``.
* ``dynamic``: ``dynaquant.quantize(folder, size=<llama.cpp file size>, report=<one analysis>)``.
* ``hand``: ``llama-quantize --imatrix`` with ``--tensor-type`` overrides in the Unsloth spirit
  (routed experts lowest, attention / embeddings higher), sized to fit the llama.cpp file.
* ``prior-plan``: dynaquant's planner (default rules, prior error model, no analysis) at that size, written
  by ``llama-quantize`` with one override per tensor: dynaquant's allocation with llama.cpp's encoders,
  for machines where the analysis and dynaquant's encoders take too long.
* ``--dynamic-plan-only``: the measured dynamic plans from the analysis, not encoded.

Measured by ``llama-perplexity --kl-divergence`` against the BF16 upcycled model's logits on the
evaluation text (``quality.py``'s ``Llama`` class). JSON: ``benchmarks/out/moe-quality.json``.

Usage:
    nice -n 10 python benchmarks/moe_quality.py [--chunks 16] [--n-ctx 256] [--mixes Q2_K,IQ2_XS,IQ2_XXS]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import gguf
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import quality as Q  # noqa: E402  (file_stats, Llama, run_tool, machine_info, versions, write_json ...)

import dynaquant  # noqa: E402

DEFAULT_DITHERED = Q.DEFAULT_DITHERED
DEFAULT_WORK = Path("/tmp/moebench")
# formats measured by the analysis (a restricted set, to keep a CPU run short): the 32-block ones every
# tensor can take (rows of 576) and the K-quants only ffn_down_exps (rows of 1536) can; no i-quants: on a
# small shared CPU dynaquant's lattice encoders (IQ2_*) are far too slow for this model (see the README)
CANDIDATES = ("Q2_K", "Q3_K", "Q4_K", "MXFP4", "Q4_0", "IQ4_NL", "Q5_0", "Q8_0")

log = logging.getLogger("moe_quality")


# ---------------------------------------------------------------------------------------------
# the upcycled model


def make_upcycled(dense_gguf: Path, out_dir: Path, experts: int = 4, top_k: int = 2, noise: float = 0.10,
                  router_std: float = 1.0, seed: int = 0) -> dict:
    """Write a MixtralForCausalLM safetensors folder upcycled from a dense Llama GGUF (see the module doc).

    Returns:
        a dict describing the construction (for the JSON header).
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    dense = LlamaForCausalLM.from_pretrained(str(dense_gguf.parent), gguf_file=dense_gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(dense_gguf.parent), gguf_file=dense_gguf.name)
    cfg = dense.config
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, w in dense.state_dict().items():
        if ".mlp." in name or name == "lm_head.weight":
            continue
        sd[name] = w
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        mlp = {p: dense.state_dict()[f"{pre}mlp.{p}_proj.weight"] for p in ("gate", "up", "down")}
        for e in range(experts):
            for p, wname in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                w = mlp[p]
                sd[f"{pre}block_sparse_moe.experts.{e}.{wname}.weight"] = (
                    w + noise * w.std() * torch.randn(w.shape, generator=g))
        # router logits' std on h = rmsnorm(x) * gamma is ~ s * ||gamma||: s = router_std / ||gamma||
        gamma = dense.state_dict()[f"{pre}post_attention_layernorm.weight"]
        s = router_std / float(gamma.norm())
        sd[f"{pre}block_sparse_moe.gate.weight"] = s * torch.randn((experts, cfg.hidden_size), generator=g)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    d = cfg.to_dict()
    conf = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta")),
        "tie_word_embeddings": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "num_local_experts": experts, "num_experts_per_tok": top_k,
        "sliding_window": None, "router_aux_loss_coef": 0.001, "output_router_logits": False,
        "torch_dtype": "bfloat16", "use_cache": True,
    }
    (out_dir / "config.json").write_text(json.dumps(conf, indent=1) + "\n")
    tok.save_pretrained(str(out_dir))
    n_params = sum(v.numel() for v in sd.values())
    return {"dense_source": str(dense_gguf), "architecture": "MixtralForCausalLM", "experts": experts, "top_k": top_k,
            "expert_noise": f"{noise} x std(W) Gaussian, independent per expert and weight", "router_std": router_std,
            "router": "N(0, s^2), s = router_std / ||post_attention_layernorm.weight||", "seed": seed,
            "parameters": n_params, "config": conf}


def expert_types(path: Path) -> dict:
    """GGML type of every ``ffn_*_exps`` / attention tensor kind, as {kind: {type: count}}."""
    reader = gguf.GGUFReader(str(path))
    out: dict[str, dict[str, int]] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        kind = parts[2] if t.name.startswith("blk.") else parts[0]
        d = out.setdefault(kind, {})
        d[t.tensor_type.name] = d.get(t.tensor_type.name, 0) + 1
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# hand allocations (llama-quantize overrides); first match wins, as llama-quantize applies them.
# Unsloth spirit: routed experts at the lowest the rows allow (gate/up: 576-wide rows, so the lowest
# 32-block type; down: the 2-bit i-quant of the mix), attention and embeddings higher.
HAND = {
    # llama.cpp Q2_K: token_embd Q8_0, attention Q4_0 (fallback), gate/up Q4_0 (fallback), down Q3_K.
    # By hand: down to Q2_K (-10.8 MB), gate/up IQ4_NL (same size), attn_v/k/output to Q8_0, attn_q Q5_0 (+9.5 MB).
    "Q2_K": {"token_embd": "q8_0", "tensor_types": ["attn_v=q8_0", "attn_k=q8_0", "attn_output=q8_0", "attn_q=q5_0",
                                                   "ffn_down_exps=q2_k", "ffn_gate_exps=iq4_nl",
                                                   "ffn_up_exps=iq4_nl"]},
    # llama.cpp IQ2_XS: token_embd Q8_0, attn_v Q5_0, other attention IQ4_NL, gate/up IQ4_NL, down IQ2_XS (3 Q2_K).
    # By hand: down to IQ2_XXS (-3.7 MB), attn_v and attn_k to Q8_0 (+2.9 MB).
    "IQ2_XS": {"token_embd": "q8_0", "tensor_types": ["attn_v=q8_0", "attn_k=q8_0", "attn_q=iq4_nl",
                                                     "attn_output=iq4_nl", "ffn_down_exps=iq2_xxs",
                                                     "ffn_gate_exps=iq4_nl", "ffn_up_exps=iq4_nl"]},
    # llama.cpp IQ2_XXS: as IQ2_XS with down IQ2_XXS (3 Q2_K). Nothing is left to take from the experts (down all
    # IQ2_XXS: -0.75 MB; IQ1 below Unsloth's down_proj practice), so the tied embedding goes to Q5_1 (-8.85 MB)
    # and attn_v/attn_k/attn_output to Q8_0 (+7.9 MB), as the dense benchmark's hand allocations do
    "IQ2_XXS": {"token_embd": "q5_1", "tensor_types": ["attn_v=q8_0", "attn_k=q8_0", "attn_output=q8_0",
                                                      "attn_q=iq4_nl", "ffn_down_exps=iq2_xxs",
                                                      "ffn_gate_exps=iq4_nl", "ffn_up_exps=iq4_nl"]},
}


def _row(method: str, mix: str) -> dict:
    return {"row": "result", "method": method, "mix": mix, "size_bytes": None, "bpw": None, "kld_mean": None,
            "kld_p99": None, "ppl": None, "top1": None, "quantize_time_s": None}


def run_llama(mix: str, model: Path, llama: Q.Llama) -> dict:
    """quality.py's llama.cpp row, plus the GGML types per tensor kind of the file."""
    row = Q.run_llama(mix, model, llama)
    row["types_by_kind"] = expert_types(llama.work / f"llama.cpp-{mix}.gguf")
    return row


def run_hand(mix: str, model: Path, llama: Q.Llama, size_limit: int | None) -> dict:
    """quality.py's hand row with this benchmark's :data:`HAND` overrides, plus the types per tensor kind."""
    row = Q.run_hand(mix, model, llama, size_limit, hand=HAND)
    row["types_by_kind"] = expert_types(llama.work / f"hand-{mix}.gguf")
    return row


def run_analysis(folder: Path, args) -> dict:
    from dynaquant.analysis.calibration import CalibrationSpec

    t0 = time.perf_counter()
    res = dynaquant.analyze(str(folder), args.work_dir / "analysis",
                            calibration=CalibrationSpec((str(args.calibration),), args.analysis_chunks or args.chunks,
                                                        args.n_ctx),
                            candidates=tuple(args.candidates), fisher_sequences=args.fisher_sequences,
                            device=args.device, progress=False)
    out = {"time_s": round(time.perf_counter() - t0, 2), "candidates": list(args.candidates),
           "fisher_sequences": args.fisher_sequences, "device": args.device,
           "calibration_chunks": args.analysis_chunks or args.chunks, "n_ctx": args.n_ctx, "loadavg_after": list(os.getloadavg()),
           "timings_s": {k: round(v, 2) for k, v in res.report.get("timings_s", {}).items()}}
    (args.work_dir / "analysis" / "run.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def run_dynamic(mix: str, folder: Path, args, llama: Q.Llama, size_limit: int) -> dict:
    row = _row("dynamic", mix)
    out = args.work_dir / f"dynamic-{mix}.gguf"
    t0 = time.perf_counter()
    res = dynaquant.quantize(str(folder), size=size_limit, report=args.work_dir / "analysis" / "report.json",
                             output=out, device=args.device, progress=False, calibration=args.calibration,
                             calibration_chunks=args.chunks, n_ctx=args.n_ctx)
    row["quantize_time_s"] = round(time.perf_counter() - t0, 2)
    row["size_limit"] = size_limit
    row["kld_pred"] = res.plan.kld_pred
    row["formats"] = res.plan.count_by_format()
    row.update(Q.file_stats(out))
    row["fits"] = row["size_bytes"] <= size_limit
    row["types_by_kind"] = expert_types(out)
    row.update(llama.kld(out, f"dynamic-{mix}"))
    return row


def run_dynamic_plan(mix: str, args, size_limit: int) -> dict:
    """The dynamic plan at ``size_limit`` from the analysis report, not encoded (``--dynamic-plan-only``:
    dynaquant's CPU encoders need far longer than llama-quantize for this model on a small machine)."""
    row = _row("dynamic-plan", mix)
    t0 = time.perf_counter()
    plan = dynaquant.make_dynamic_plan(args.work_dir / "analysis" / "report.json", size=size_limit)
    row["plan_time_s"] = round(time.perf_counter() - t0, 2)
    row["size_limit"] = size_limit
    row["plan_size_bytes"] = plan.size_bytes
    row["plan_bpw"] = round(plan.bpw, 4)
    row["kld_pred"] = plan.kld_pred
    row["method_detail"] = plan.method
    row["formats"] = plan.count_by_format()
    kinds: dict[str, dict[str, int]] = {}
    for e in plan.entries:
        parts = e.name.split(".")
        d = kinds.setdefault(parts[2] if e.name.startswith("blk.") else parts[0], {})
        d[e.format] = d.get(e.format, 0) + 1
    row["types_by_kind"] = dict(sorted(kinds.items()))
    row["encoded"] = False
    return row


def run_prior_plan(mix: str, folder: Path, model: Path, llama: Q.Llama, size_limit: int, caps: bool = True) -> dict:
    """``prior-plan``: dynaquant's planner at ``size_limit`` with its default rules and *prior* error model
    (no analysis), written by ``llama-quantize --imatrix`` with one ``--tensor-type`` override per tensor.
    A stand-in for the dynamic row when dynaquant's encoders are too slow on the machine: the allocation is
    dynaquant's, the encoders llama.cpp's."""
    from dynaquant.pipeline.source import model_info, open_tensor_source, tensor_infos
    from dynaquant.quant.planner import EXPERT_CAP, GGUF_CANDIDATES, default_rules, make_plan
    from dynaquant.sources.checkpoint import resolve_source

    method = "prior-plan" if caps else "prior-plan-nocap"
    row = _row(method, mix)
    ts = open_tensor_source(resolve_source(str(folder)))
    tensors, info = tensor_infos(ts), model_info(ts)
    overhead = Q.file_stats(model)["size_bytes"] - sum(int(t.n_bytes) for t in gguf.GGUFReader(str(model)).tensors)
    defaults = [r for r in default_rules(info, [], True) if caps or r.origin != EXPERT_CAP]
    plan = make_plan(tensors, info, "upcycled", size_bytes=size_limit, overhead_bytes=overhead,
                     candidates=list(GGUF_CANDIDATES), defaults=defaults, has_imatrix=True)
    row.update({"size_limit": size_limit, "plan_size_bytes": plan.size_bytes, "plan_method": plan.method,
                "formats": plan.count_by_format()})
    extra = []
    for e in plan.entries:
        if e.format == "F32":
            continue
        if e.name == "token_embd.weight":
            extra += ["--token-embedding-type", e.format.lower(), "--output-tensor-type", e.format.lower()]
        else:
            extra += ["--tensor-type", f"^{e.name.replace('.', chr(92) + '.')}$={e.format.lower()}"]
    out = llama.work / f"{method}-{mix}.gguf"
    dt, cpu = llama.quantize(model, mix, out, extra, label=f"{method}-{mix}")
    row["quantize_time_s"], row["quantize_cpu_s"] = round(dt, 2), round(cpu, 2)
    row.update(Q.file_stats(out))
    row["types_by_kind"] = expert_types(out)
    row["fits"] = row["size_bytes"] <= size_limit
    row.update(llama.kld(out, f"{method}-{mix}"))
    return row


def table(rows: list[dict]) -> str:
    cols = ("method", "mix", "MiB", "bpw", "KLD", "KLD p99", "PPL", "top1", "quant s")
    lines = [" ".join(f"{c:>10}" for c in cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:>10} {r['mix']:>10} ERROR: {r['error'].splitlines()[0][:90]}")
            continue
        size = (r.get("size_bytes") or r.get("plan_size_bytes") or 0) / 2**20 or None
        cells = (r["method"], r["mix"], Q._fmt(size, ".2f"), Q._fmt(r.get("bpw"), ".3f"), Q._fmt(r.get("kld_mean"), ".4f"),
                 Q._fmt(r.get("kld_p99"), ".3f"), Q._fmt(r.get("ppl"), ".2f"), Q._fmt(r.get("top1"), ".4f"),
                 Q._fmt(r.get("quantize_time_s"), ".1f"))
        lines.append(" ".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="dynaquant dynamic MoE plans vs llama.cpp imatrix mixes (upcycled SmolLM2)")
    p.add_argument("--dense", type=Path, default=DEFAULT_DITHERED, help="dithered dense BF16 GGUF (made if missing)")
    p.add_argument("--llama-bin", type=Path, default=Q.DEFAULT_LLAMA_BIN)
    p.add_argument("--calibration", type=Path, default=Q.DATA / "calibration.txt")
    p.add_argument("--eval-text", type=Path, default=Q.DATA / "eval.txt")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--n-ctx", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.10)
    p.add_argument("--router-std", type=float, default=1.0)
    p.add_argument("--mixes", default="Q2_K,IQ2_XS,IQ2_XXS")
    p.add_argument("--methods", default="llama.cpp,hand,dynamic")
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--fisher-sequences", type=int, default=4)
    p.add_argument("--analysis-chunks", type=int, default=None, help="calibration chunks of the analysis (default --chunks)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="cpu", help="torch device for dynaquant (analysis, quantize)")
    p.add_argument("--source", type=Path, default=None, help="GGUF to dither when --dense is missing (default: embedded)")
    p.add_argument("--reuse", action="store_true", help="reuse the upcycled model, base logits, imatrix, analysis")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    p.add_argument("--out", type=Path, default=HERE / "out" / "moe-quality.json")
    p.add_argument("--dynamic-plan-only", action="store_true",
                   help="dynamic rows: the plan at each size from the analysis (predicted KLD), not encoded or measured")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of an existing --out (errors excepted) and run only the missing ones (implies --reuse)")
    p.add_argument("--print", dest="print_only", action="store_true")
    args = p.parse_args(argv)
    if args.print_only:
        _, *rows = json.loads(args.out.read_text())
        print(table(rows))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("gguf", "transformers", "dynaquant.exporters"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.calibration.resolve() == args.eval_text.resolve():
        p.error("calibration and evaluation texts must differ")
    args.candidates = [c.strip().upper() for c in args.candidates.split(",") if c.strip()]
    mixes = [m.strip().upper() for m in args.mixes.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tools, why_not = Q.llama_tools(args.llama_bin)
    if tools is None:
        p.error(f"llama.cpp tools needed: {why_not}")

    header: dict = {
        "row": "header", "benchmark": "moe-quality", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": Q.machine_info(), "versions": Q.versions(tools),
        "config": {"calibration": str(args.calibration), "eval_text": str(args.eval_text), "chunks": args.chunks,
                   "n_ctx": args.n_ctx, "mixes": mixes, "methods": methods, "llama_threads": args.threads,
                   "dynaquant_device": args.device,
                   "bpw": "8 * tensor data bytes / weights, from the GGUF file (metadata excluded)",
                   "kld": "llama-perplexity --kl-divergence against the BF16 upcycled model's logits (kld_*, ppl, "
                          "top1 = 'Same top p')",
                   "row_576_note": "hidden size 576 is not a multiple of 256: ffn_gate_exps/ffn_up_exps and attention "
                                   "rows take only 32-block formats (llama.cpp falls back, e.g. IQ2_*/Q2_K -> IQ4_NL); "
                                   "only ffn_down_exps (rows of 1536) can take IQ2_*/Q2_K"},
        "upcycled": {}, "dense": {},
    }
    rows: list[dict] = []
    if args.resume and args.out.is_file():
        args.reuse = True
        prev_header, *prev_rows = json.loads(args.out.read_text())
        rows = [r for r in prev_rows if "error" not in r]
        header["resumed_from"] = {"started": prev_header.get("started"), "rows": len(rows),
                                  "upcycled": prev_header.get("upcycled"), "total_time_s": prev_header.get("total_time_s")}
    t_start = time.perf_counter()
    folder = args.work_dir / "upcycled"
    bf16 = args.work_dir / "upcycled-bf16.gguf"
    if not args.dense.is_file():
        Q.make_dithered(args.source, args.dense, progress=False)
    if not (args.reuse and (folder / "model.safetensors").is_file()):
        t0 = time.perf_counter()
        header["upcycled"] = make_upcycled(args.dense, folder, args.experts, args.top_k, args.noise, args.router_std)
        header["upcycled"]["make_time_s"] = round(time.perf_counter() - t0, 2)
        (folder / "upcycle.json").write_text(json.dumps(header["upcycled"], indent=1) + "\n")
    elif (folder / "upcycle.json").is_file():
        header["upcycled"] = json.loads((folder / "upcycle.json").read_text())
    if not (args.reuse and bf16.is_file()):
        t0 = time.perf_counter()
        dynaquant.quantize(str(folder), preset="BF16", output=bf16, device=args.device, progress=False, use_imatrix=False)
        header["upcycled"]["bf16_gguf_time_s"] = round(time.perf_counter() - t0, 2)
    header["upcycled"]["bf16_gguf"] = Q.file_stats(bf16)
    Q.write_json(args.out, header, rows)

    # dense model's perplexity on the same chunks (its own work folder: its base logits are not ours)
    dense_llama = Q.Llama(tools, args.work_dir / "dense", args.n_ctx, args.chunks, args.threads, 3600)
    dense_llama.work.mkdir(exist_ok=True)
    dense_llama.base_kld = dense_llama.work / "dense.kld"
    header["dense"] = {"model": str(args.dense), **dense_llama.make_base(args.dense, args.eval_text, args.reuse)}
    header["dense"]["ppl"] = Q.parse_ppl_output((dense_llama.work / "base.log").read_text())
    header["dense"]["file"] = Q.file_stats(args.dense)
    llama = Q.Llama(tools, args.work_dir, args.n_ctx, args.chunks, args.threads, 3600)
    header["upcycled"]["base"] = llama.make_base(bf16, args.eval_text, args.reuse)
    header["upcycled"]["ppl"] = Q.parse_ppl_output((args.work_dir / "base.log").read_text())
    header["upcycled"]["imatrix"] = llama.make_imatrix(bf16, args.calibration, args.reuse)
    Q.write_json(args.out, header, rows)

    jobs = [(m, mix) for m in ("llama.cpp", "hand", "prior-plan", "prior-plan-nocap") if m in methods for mix in mixes]
    if "dynamic" in methods:
        jobs += [("analysis", "-")] + [("dynamic-plan" if args.dynamic_plan_only else "dynamic", mix) for mix in mixes]
    done = {(r["method"], r["mix"]) for r in rows}
    jobs = [j for j in jobs if j not in done]
    signal.signal(signal.SIGTERM, Q._raise_interrupt)
    try:
        for method, mix in jobs:
            log.info("=== %s %s (load average %s)", method, mix, os.getloadavg())
            if method == "analysis":
                if args.reuse and (args.work_dir / "analysis" / "report.json").is_file():
                    prev = args.work_dir / "analysis" / "run.json"  # the run that made it (time, candidates)
                    header["analysis"] = {"reused": True, **(json.loads(prev.read_text()) if prev.is_file() else {})}
                else:
                    header["analysis"] = run_analysis(folder, args)
                Q.write_json(args.out, header, rows)
                continue
            limit = next((r["size_bytes"] for r in rows if r["method"] == "llama.cpp" and r["mix"] == mix
                          and r.get("size_bytes")), None)
            try:
                if method == "llama.cpp":
                    row = run_llama(mix, bf16, llama)
                elif method == "hand":
                    row = run_hand(mix, bf16, llama, limit)
                elif method.startswith("prior-plan"):
                    row = run_prior_plan(mix, folder, bf16, llama, limit, caps=method == "prior-plan")
                else:
                    if limit is None:
                        raise RuntimeError(f"no llama.cpp {mix} row to take the size from")
                    row = (run_dynamic_plan(mix, args, limit) if method == "dynamic-plan"
                           else run_dynamic(mix, folder, args, llama, limit))
            except Exception as e:  # one failing row must not lose the others
                log.exception("%s %s failed", method, mix)
                row = _row(method, mix)
                row["error"] = f"{type(e).__name__}: {e}"
            row["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(row)
            Q.write_json(args.out, header, rows)
            log.info("%s %s: %s", method, mix, {k: row.get(k) for k in ("size_bytes", "kld_mean", "kld_p99", "top1",
                                                                        "quantize_time_s", "error")})
    except KeyboardInterrupt:
        done = {(r["method"], r["mix"]) for r in rows}
        header["stopped"] = {"reason": "interrupted", "not_run": [f"{m} {x}" for m, x in jobs if (m, x) not in done]}
    header["total_time_s"] = round(time.perf_counter() - t_start, 1)
    Q.write_json(args.out, header, rows)
    print(table(rows))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
