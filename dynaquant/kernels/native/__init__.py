"""Compiled CPU versions of the codecs' searches (C, built on first use, loaded through ctypes).

On the CPU the codecs' torch references make one pass over memory an operation, which left the K-quant searches
10-30x slower than llama.cpp's C encoders on the same cores (``benchmarks/encode_speed.py --device cpu``). This
package compiles small C versions of the heaviest searches (``kquant_search.c``: the K-quant steps 1 to 3;
``blockfit.c``: the one-scale searches of Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS's sub-blocks, MXFP4 and NVFP4, which for
the GGUF and FP4 block formats also write the block records themselves; ``lattice_search.c``: the
codeword searches of the grid i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M) with the system's C
compiler, once a machine, and :mod:`dynaquant.kernels` registers them as the CPU fast paths of
:mod:`dynaquant.quant.codecs.fastpaths` (``backend="auto"`` on CPU tensors, or ``"native"``). Each keeps its torch
reference's contract: the same float operations in the same order and precision, but for the order of the sums
over a sub-block's elements or a super-block's sub-blocks, so results agree to rounding, and exactly where those sums
are exact (``tests/test_kquant_native.py``).

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native -ffp-contract=off -fno-trapping-math`` (no contracted
multiply-adds and no fast-math: every float operation is IEEE's, so the bytes do not depend on the vector width; the
one fused multiply-add, ``fmaf`` in ``lattice_search.c``, is its torch reference's, ``addcmul_``, and rounds once
everywhere; ``blockfit.c`` is written on GCC's vector types, which GCC and Clang both take, one block a lane, with
AVX-512 permutes and gathers for its table lookups where the CPU has them, the same results either way),
into ``CACHE/native/<hash of the source, the flags and the CPU>/`` (CACHE: :func:`dynaquant.workdir.cache_root`; a
temporary folder when the cache is off), written under a temporary name and renamed, so concurrent first runs do not
collide. Without a compiler, or with ``DYNAQUANT_NATIVE=0``, :func:`library` raises RuntimeError, the registry logs
it once and the torch references run.

Threads: the rows (sub-blocks or super-blocks) are split over ``torch.get_num_threads()`` threads (ctypes releases
the GIL during a call); a row's result does not depend on the split.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dynaquant.workdir import cache_root

SOURCES = ("kquant_search.c", "blockfit.c", "lattice_search.c")  # (and the headers beside them, f16.h and lanes.h)
ENV = "DYNAQUANT_NATIVE"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=gnu11"]
_MIN_PER_THREAD = 64  # rows (sub-blocks or super-blocks) below which a call runs on one thread


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() + platform.machine()


def _compile(src: Path, out: Path, cc: str) -> None:
    """Compile ``src`` to the shared library ``out`` (a temporary name, then renamed); -march=native dropped if the
    compiler refuses it. Raises RuntimeError with the compiler's message."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        for flags in (FLAGS, [f for f in FLAGS if f != "-march=native"]):
            res = subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], capture_output=True, text=True)
            if res.returncode == 0:
                os.replace(tmp, out)
                return
        raise RuntimeError(f"{cc} could not compile {src}: {res.stderr.strip()[-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library(name: str = "kquant_search") -> ctypes.CDLL:
    """The compiled ``name``.c of this package, built on the first call (module docstring).

    Raises:
        RuntimeError: ``DYNAQUANT_NATIVE=0``, or no C compiler, or the build failed (its message).
    """
    if f"{name}.c" not in SOURCES:
        raise ValueError(f"no compiled search named {name!r}: {', '.join(SOURCES)}")
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        raise RuntimeError(f"{ENV}=0: the compiled CPU searches are off")
    src = Path(__file__).with_name(f"{name}.c")
    cc = os.environ.get("CC") or "cc"
    headers = [h.read_bytes() for h in sorted(src.parent.glob("*.h"))]  # what the sources include
    key = hashlib.sha256(b"\0".join([src.read_bytes(), *headers, " ".join([cc, *FLAGS]).encode(), _cpu_id().encode()]))
    root = cache_root()
    temp = Path(tempfile.gettempdir()) / f"dynaquant-native-{os.getuid()}"
    folders = [root / "native", temp] if root is not None else [temp]
    for i, folder in enumerate(folders):
        out = folder / key.hexdigest()[:16] / f"{name}.so"
        if not out.exists():
            if shutil.which(cc) is None:
                raise RuntimeError(f"no C compiler ({cc}) to build {src.name}")
            try:
                _compile(src, out, cc)
            except OSError:  # a cache folder that cannot be written: the temporary folder next
                if i + 1 == len(folders):
                    raise
                continue
        return ctypes.CDLL(str(out))
    raise AssertionError("unreachable")


@functools.cache
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix="dynaquant-native")


def split_rows(n: int, fn) -> None:
    """Run ``fn(start, stop)`` over ``[0, n)`` split into ``torch.get_num_threads()`` contiguous ranges, in threads
    of a pool of this module's own (not the encoders' chunk pool of :mod:`dynaquant.quant.codecs.base`: a chunk
    worker waiting on its own pool could wait for itself)."""
    t = max(1, min(torch.get_num_threads(), n // _MIN_PER_THREAD))
    if t == 1:
        fn(0, n)
        return
    bounds = [n * i // t for i in range(t + 1)]
    for f in [_pool(t).submit(fn, bounds[i], bounds[i + 1]) for i in range(t)]:
        f.result()


def ptr(t: torch.Tensor, offset: int = 0) -> ctypes.c_void_p:
    """The address of element ``offset`` of the contiguous tensor ``t``."""
    return ctypes.c_void_p(t.data_ptr() + offset * t.element_size())


def cpu_contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype`` (no copy when it already is one)."""
    if t.device.type != "cpu":
        raise ValueError(f"the compiled searches run on CPU tensors, got one on {t.device}")
    return t.to(dtype).contiguous()
