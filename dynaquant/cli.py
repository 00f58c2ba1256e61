"""The ``dynaquant`` command: a thin shell over the public functions in ``dynaquant``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

log = logging.getLogger("dynaquant")


def _size(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper().replace("_", "")
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * units[u])
    return int(t.rstrip("B"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynaquant", description="Dynamic low-bit quantization of LLM checkpoints.")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a model to a mixed-precision GGUF file")
    q.add_argument("model", nargs="?", help="HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    g = q.add_mutually_exclusive_group()
    g.add_argument("--preset", help="llama.cpp mix: Q8_0, Q6_K, Q5_K_M, Q4_K_M (default), Q3_K_M, Q2_K, ...")
    g.add_argument("--bpw", type=float, help="average bits per weight over all tensor data, at most")
    g.add_argument("--size", type=_size, help="whole output file size, at most (bytes, or 80MB, 1.5GiB)")
    g.add_argument("--plan", help="plan.json to use as is")
    q.add_argument("--rule", action="append", default=[], metavar="REGEX=FORMAT",
                   help="override, matched against GGUF tensor names; first match wins (repeatable)")
    q.add_argument("--calibration", help="calibration text file (default: Python stdlib docstrings)")
    q.add_argument("--calibration-chunks", type=int, default=32, help="chunks of --ctx tokens (default 32)")
    q.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    q.add_argument("--no-imatrix", action="store_true", help="encode without an imatrix")
    q.add_argument("--eval", dest="evaluate", action="store_true",
                   help="measure KLD against the source afterwards (on by default with no arguments)")
    q.add_argument("--no-eval", action="store_true", help="never evaluate")
    q.add_argument("--text", help="evaluation text file (default: stdlib docstrings, not the calibration ones)")
    q.add_argument("--chunks", type=int, default=16, help="evaluation chunks (default 16)")
    q.add_argument("-o", "--output", help="output .gguf (default: <model>-<target>.gguf here)")
    q.add_argument("--save-plan", help="also write the plan as JSON here")
    q.add_argument("--allow-pickle", action="store_true", help="read *.bin/*.pt weights (torch.load weights_only)")
    q.add_argument("--trust-remote-code", action="store_true")
    q.add_argument("--device", help="torch device (default: cuda if available)")
    q.add_argument("--json", action="store_true", help="machine-readable output")

    e = sub.add_parser("eval", help="KLD, perplexity and top-1 agreement of a quantized GGUF against its original")
    e.add_argument("quantized")
    e.add_argument("--reference", help="original model (default: the dynaquant.source recorded in the file)")
    e.add_argument("--text", help="evaluation text file (default: stdlib docstrings)")
    e.add_argument("--ctx", type=int, default=512)
    e.add_argument("--chunks", type=int, default=None, help="at most N chunks (default: all)")
    e.add_argument("--device")
    e.add_argument("--json", action="store_true")

    i = sub.add_parser("inspect", help="types, sizes and bpw per tensor and per layer of a GGUF file")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    return p


def _print_eval(ev) -> None:
    print(f"  eval: {ev.tokens} tokens ({ev.chunks} chunks x {ev.n_ctx}, second halves scored) of {ev.text_id}")
    print(f"  mean KLD {ev.kld_mean:.5f}  p99 KLD {ev.kld_p99:.5f}  top-1 agreement {100 * ev.top1_agreement:.2f}%")
    print(f"  perplexity {ev.ppl:.4f} (reference {ev.ppl_reference:.4f})")


def _quantize(a, bare: bool) -> int:
    from . import quantize

    evaluate = (a.evaluate or bare) and not a.no_eval
    res = quantize(a.model, output=a.output, preset=a.preset, bpw=a.bpw, size=a.size, rules=a.rule, plan=a.plan,
                   calibration=a.calibration, calibration_chunks=a.calibration_chunks, n_ctx=a.ctx,
                   use_imatrix=not a.no_imatrix, evaluate=evaluate, eval_text=a.text, eval_chunks=a.chunks,
                   allow_pickle=a.allow_pickle, trust_remote_code=a.trust_remote_code, device=a.device,
                   progress=not a.json)
    if a.save_plan:
        from pathlib import Path

        Path(a.save_plan).write_text(json.dumps(res.plan.to_dict(), indent=1))
    if a.json:
        print(json.dumps(res.to_dict(), indent=1))
        return 0
    print(f"wrote {res.output}")
    print(f"  {res.size_bytes / 1e6:.2f} MB, {res.bpw:.3f} bpw over tensor data, {res.time_s:.1f} s ({res.plan.method})")
    mix = ", ".join(f"{f} {100 * n / res.plan.n_elements:.1f}%" for f, n in
                    sorted(res.plan.count_by_format().items(), key=lambda kv: -kv[1]))
    print(f"  formats by weights: {mix}")
    if res.eval:
        _print_eval(res.eval)
    return 0


def _eval(a) -> int:
    from . import evaluate

    ev = evaluate(a.quantized, a.reference, text=a.text, n_ctx=a.ctx, chunks=a.chunks, device=a.device,
                  progress=not a.json)
    if a.json:
        print(json.dumps(ev.to_dict(), indent=1))
    else:
        print(f"{a.quantized}")
        _print_eval(ev)
    return 0


def _inspect(a) -> int:
    from . import inspect_gguf

    s = inspect_gguf(a.file)
    if a.json:
        print(json.dumps(s.to_dict(), indent=1))
        return 0
    print(f"{s.path}: {s.file_size_bytes / 1e6:.2f} MB, {len(s.tensors)} tensors, {s.bpw:.3f} bpw, "
          f"file type {s.file_type}")
    print(f"{'tensor':40s} {'type':7s} {'shape':>16s} {'bytes':>11s} {'bpw':>6s}")
    for t in s.tensors:
        print(f"{t.name:40s} {t.type:7s} {'x'.join(map(str, t.shape)):>16s} {t.size_bytes:11d} {t.bpw:6.2f}")
    print(f"\n{'layer':10s} {'bytes':>11s} {'bpw':>6s}  types")
    for k, lay in s.layers.items():
        types = ", ".join(f"{ty}" for ty in sorted(lay["types"]))
        print(f"{k:10s} {lay['size_bytes']:11d} {lay['bpw']:6.2f}  {types}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the exit status: 0 on success, 2 on bad input, 1 on other failures."""
    argv = sys.argv[1:] if argv is None else argv
    a = _parser().parse_args(argv)
    # On SIGTERM, unwind normally so temporary output files are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if a.command == "quantize":
            bare = argv == ["quantize"]
            return _quantize(a, bare)
        if a.command == "eval":
            return _eval(a)
        return _inspect(a)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"dynaquant {a.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
