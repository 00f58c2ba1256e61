"""Write a dithered BF16 copy of a GGUF model (the quality benchmark's source model).

The default model (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF: each block of 32 weights
lies exactly on a 16-level grid, which any format containing that grid reproduces almost
exactly. The benchmark therefore quantizes a dithered copy: every quantized tensor of the
source (Q4_1 matrices, the Q8_0 ``token_embd``) is dequantized, dithered with
``dynaquant.analysis.dither.dither(w, 32, seed=i)`` (i = the tensor's index in the source
file, 0-based, counting every tensor) and stored as BF16; 1-D tensors (norms) are stored as
F32 unchanged. Metadata (architecture, tokenizer, chat template) is the source's, plus
``dynaquant.dither.*`` keys saying how the copy was made.

Usage:
    python benchmarks/make_dithered.py [--source SRC.gguf] [--out benchmarks/out/smollm2-dithered-bf16.gguf]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from dynaquant.analysis.dither import dither
from dynaquant.exporters.gguf.writer import write_gguf
from dynaquant.quant.codecs import quantize as encode_tensor
from dynaquant.quant.formats import Format, get_format
from dynaquant.sources.checkpoint import default_model_path
from dynaquant.sources.gguf import SourceTensor, open_gguf_source

GROUP_SIZE = 32
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "smollm2-dithered-bf16.gguf"

log = logging.getLogger("make_dithered")


def make_dithered(source: str | Path | None = None, out: str | Path = DEFAULT_OUT, group_size: int = GROUP_SIZE,
                  progress: bool = True) -> Path:
    """Write the dithered BF16 copy of ``source`` (default: the embedded SmolLM2 Q4_1 GGUF) to ``out``.

    Args:
        source: a GGUF file; None for ``dynaquant.sources.checkpoint.default_model_path()``.
        out: output GGUF path (parent folders are created).
        group_size: dither group, the source format's block size (32 for Q4_1 and Q8_0).
    Returns:
        ``out`` as a Path.
    Raises:
        ValueError: the source is unreadable, or a quantized tensor's row is not a multiple of ``group_size``.
    """
    src_path = Path(source) if source is not None else default_model_path()
    ts = open_gguf_source(src_path)
    tensors = ts.tensors()
    index = {t.gguf_name: i for i, t in enumerate(tensors)}
    quantized = {t.gguf_name for t in tensors
                 if ts.stored_type(t) not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                              gguf.GGMLQuantizationType.BF16)}
    bf16, f32 = get_format("BF16"), get_format("F32")
    types: dict[str, Format] = {}
    for t in tensors:
        if t.gguf_name in quantized and len(t.shape) >= 2:
            types[t.gguf_name] = bf16
        elif len(t.shape) == 1:
            types[t.gguf_name] = f32
        else:  # a full-precision matrix in the source: keep it, as BF16 like the rest
            types[t.gguf_name] = bf16

    def encode(t: SourceTensor, w: torch.Tensor, fmt: Format) -> np.ndarray:
        if t.gguf_name in quantized:
            w = dither(w, group_size, seed=index[t.gguf_name])
        return encode_tensor(w, fmt).numpy()

    extra_kv = {
        "dynaquant.dither.source": src_path.name,
        "dynaquant.dither.group_size": group_size,
        "dynaquant.dither.seed": "tensor index in the source file",
        "dynaquant.dither.tensors": len(quantized),
    }
    out = Path(out)
    write_gguf(out, ts, types, encode, extra_kv, int(gguf.LlamaFileType.MOSTLY_BF16), progress=progress)
    log.info("%s: %d tensors dithered, %d bytes", out, len(quantized), out.stat().st_size)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=None, help="source GGUF (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--group-size", type=int, default=GROUP_SIZE)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    make_dithered(args.source, args.out, args.group_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
