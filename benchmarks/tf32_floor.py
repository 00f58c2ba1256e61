"""TF32 against float32 in the measured corrections' KL divergence passes (issue 16).

The corrections (:mod:`dynaquant.pipeline.corrections`) run their passes inside
:func:`dynaquant.analysis.sensitivity.tf32_matmuls` on CUDA. This measures what that costs on a checkpoint: the
floor (the TF32 pass against the float32 reference, weights unchanged), the time of a reference pass both ways,
and a few groups' measured KL divergence both ways (each against the reference made the same way), on the last
``--sequences`` x ``--ctx`` tokens of the calibration text.

usage: python benchmarks/tf32_floor.py CHECKPOINT --calibration FILE [--out JSON]
Writes a JSON list: a header row (machine, versions, config), then one row per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality import machine_info, versions  # noqa: E402

from dynaquant.analysis.sensitivity import ReferenceLogits, kld_with_weights, tf32_matmuls  # noqa: E402
from dynaquant.sources.checkpoint import load_tokenizer, resolve_source  # noqa: E402
from dynaquant.sources.model import load_model  # noqa: E402

# (parameter, format): a large and a small error, in the first, middle and a late layer of a Llama-shaped model
GROUPS = [("model.layers.0.mlp.down_proj.weight", "Q4_K"), ("model.layers.15.self_attn.q_proj.weight", "Q8_0"),
          ("model.layers.15.mlp.gate_proj.weight", "IQ3_S")]


def _reference(model, chunks: torch.Tensor) -> tuple[ReferenceLogits, float]:
    t = time.perf_counter()
    ref = ReferenceLogits(model, chunks)
    torch.cuda.synchronize()
    return ref, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--calibration", required=True, help="text file; its last tokens are the held-out sequences")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--out", type=Path, default=HERE / "out" / "corrections-tf32-floor.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA (TF32 is a CUDA tensor-core mode)")
    src = resolve_source(args.checkpoint)
    model = load_model(src, device="cuda")
    ids = load_tokenizer(src)(Path(args.calibration).read_text())["input_ids"]
    n = args.sequences * args.ctx
    if len(ids) < n:
        p.error(f"{args.calibration}: {len(ids)} tokens, fewer than {args.sequences} x {args.ctx}")
    chunks = torch.tensor(ids[-n:]).reshape(args.sequences, args.ctx)
    rows: list[dict] = [{"row": "header", "machine": machine_info(), "versions": versions(None),
                         "config": {"checkpoint": args.checkpoint, "sequences": args.sequences, "ctx": args.ctx}}]
    ref32, s32 = _reference(model, chunks)
    with tf32_matmuls("cuda"):
        ref_tf, s_tf = _reference(model, chunks)
    floor = sum(float((a.exp() * (a - b)).sum(-1).clamp_min(0).sum()) for a, b in zip(ref32.logp, ref_tf.logp))
    rows.append({"row": "result", "measure": "reference pass", "fp32_s": s32, "tf32_s": s_tf,
                 "kld_tf32_vs_fp32": floor / chunks.numel()})
    for name, fmt in GROUPS:
        k32 = kld_with_weights(model, ref32, {name: fmt}, lambda _: None)
        with tf32_matmuls("cuda"):
            ktf = kld_with_weights(model, ref_tf, {name: fmt}, lambda _: None)
        rows.append({"row": "result", "measure": "group kld", "parameter": name, "format": fmt, "kld_fp32": k32,
                     "kld_tf32": ktf})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows[1:], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
