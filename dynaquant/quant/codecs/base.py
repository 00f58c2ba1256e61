"""The codec interface: an encode/decode pair on blocks, as gguf-py's quantize_blocks.

A codec works on ``(n_blocks, block_size)`` float32 tensors. The module-level
``quantize``/``dequantize`` functions handle rows, reshaping, importance weights,
chunking (to bound memory) and devices; a codec only sees blocks.

On a CPU, ``quantize`` runs its chunks in a pool of ``torch.get_num_threads()`` Python threads with torch's own
intra-op threads set to one for the call (restored after): the searches are long chains of small element-wise
ops, and intra-op parallelism on them waits at a barrier after every op, which on a machine shared with other
jobs costs a scheduler slice each time (measured on a loaded 2-core box: an op on 262 144 floats 0.09 ms on one
thread, 8 ms on two; Q6_K 20x faster on one). Chunks of :data:`CPU_CHUNK_WEIGHTS` keep the temporaries in cache.
The setup before the chunks (the imatrix floored and repeated over a chunk's rows) runs on one intra-op thread too:
an OpenMP region there leaves its idle workers spinning (OpenMP's default wait policy, where torch was imported
before dynaquant) on the cores the chunk workers then need (Q8_0 on 2 threads, 256 x 14336: 27 against 16 ms of CPU
time a call).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from dynaquant.quant.codecs.fastpaths import BACKENDS
from dynaquant.quant.formats import Format, get_format


@dataclass(frozen=True)
class ColumnGrid:
    """A block's grid column by column where it is linear: what GPTQ's column loop rounds to, given to a fast
    path as plain tensors (:func:`dynaquant.quant.gptq.round_block_torch`).

    Attributes:
        dl: (block_size, n_blocks) float32, each column's scale (a K-quant's sub-block ``d * k``), contiguous.
        iv: (block_size, n_blocks) float32, ``1 / dl`` (0 where ``dl`` is 0).
        ml: (block_size, n_blocks) float32 mins of an affine grid (values ``dl * q - ml``, codes ``q`` in
            ``0 .. qhi``), or None for a symmetric one (values ``dl * q``, ``q`` in ``qlo .. qhi``, codes ``q - qlo``).
        qlo, qhi: the integer range of ``q``.

    Called as ``grid(x, j)`` it is a :meth:`Codec.column_rounder`: ``q = clamp(round((x + ml) * iv))`` (ties to
    even), or ``clamp(round(x * iv))``.
    """

    dl: torch.Tensor
    iv: torch.Tensor
    ml: torch.Tensor | None
    qlo: int
    qhi: int

    def __call__(self, x: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ml is not None:
            q = ((x.float() + self.ml[j]) * self.iv[j]).round_().clamp_(self.qlo, self.qhi)
            return q.to(torch.int64), self.dl[j] * q - self.ml[j]
        q = (x.float() * self.iv[j]).round_().clamp_(self.qlo, self.qhi)
        return (q - self.qlo).to(torch.int64), self.dl[j] * q


@dataclass(frozen=True)
class LevelGrid:
    """A block's grid column by column where each column is a scale times a fixed table of levels (the legacy
    symmetric types' integers, IQ4_NL's and IQ4_XS's ``kvalues_iq4nl``): what GPTQ's column loop rounds to, given
    to a fast path as plain tensors (:func:`dynaquant.quant.gptq.round_block_torch`).

    Attributes:
        dl: float32 scales, contiguous: (n_blocks,), one a block for every column (Q4_0, Q8_0, IQ4_NL), or
            (block_size, n_blocks), each column's own (IQ4_XS's sub-block scales).
        safe: ``dl`` with zeros replaced by 1 (the divisor), same shape.
        levels: (L,) float32, strictly increasing.
        mids: (L - 1,) float32, the midpoints of consecutive levels.
        linear: the levels are consecutive integers (rounded by ``round``, ties to even, and a clamp).
        zero_code: the code of a block whose scale is 0 (the level nearest 0).
        lo, hi: the first and last level (floats on the host: no device sync a column).

    Called as ``grid(x, j)`` it is a :meth:`Codec.column_rounder`: ``t = x / safe``; codes
    ``clamp(round(t)) - levels[0]`` (linear) or the number of midpoints ``<= t`` (the nearest level, ties to the
    upper one, as ggml's ``best_index_int8``); ``zero_code`` where ``dl == 0``; values ``dl * levels[codes]``.
    """

    dl: torch.Tensor
    safe: torch.Tensor
    levels: torch.Tensor
    mids: torch.Tensor
    linear: bool
    zero_code: int
    lo: float
    hi: float

    def __call__(self, x: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        dl, safe = (self.dl, self.safe) if self.dl.ndim == 1 else (self.dl[j], self.safe[j])
        t = x.to(torch.float32) / safe
        if self.linear:
            codes = (t.round_().clamp_(self.lo, self.hi) - self.lo).to(torch.int64)
        else:
            codes = torch.bucketize(t, self.mids, right=True)
        codes = torch.where(dl == 0, self.zero_code, codes)
        return codes, dl * self.levels[codes]


class Codec:
    """Encode/decode pair for one format.

    Subclasses set ``format_name`` and implement ``encode_blocks``/``decode_blocks``.
    Both run on whatever device their inputs are on. A codec whose search has fast paths
    (:mod:`dynaquant.quant.codecs.fastpaths`) sets ``fast_paths`` and its ``encode_blocks``
    takes the keywords ``backend`` (``"auto"``, ``"torch"``, ``"triton"``) and ``variant``
    (the kernel's implementation, None for its default), which :func:`quantize` passes on.
    """

    format_name: ClassVar[str]
    fast_paths: ClassVar[bool] = False
    # True where a block's encoding depends on the other blocks of the call (NVFP4_G16's global scale from
    # their largest magnitude): such codecs keep :data:`CHUNK_WEIGHTS` chunks on every device but CUDA
    cross_block: ClassVar[bool] = False

    @property
    def format(self) -> Format:
        return get_format(self.format_name)

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Encode blocks.

        The block formats compose the three steps below (``pack(params, codes)`` with
        ``params = fit_params(x, w)`` and ``codes = round_to_grid(x, params)[0]``); other
        error-compensating encoders (GPTQ, :mod:`dynaquant.quant.gptq`) reuse the steps with
        their own rounding.

        Args:
            x: (n_blocks, block_size) float32 weights.
            w: (n_blocks, block_size) float32 importance, > 0; the encoder minimises
               ``sum(w * (x - decode(encode(x)))**2)`` per block (or comes close).
        Returns:
            (n_blocks, type_size) uint8, the GGUF block layout.
        """
        params = self.fit_params(x, w)
        codes, _ = self.round_to_grid(x, params)
        return self.pack(params, codes)

    def fit_params(self, x: torch.Tensor, w: torch.Tensor):
        """Choose each block's grid: its scales (and mins) exactly as stored.

        Args:
            x: (n_blocks, block_size) float32 weights.
            w: (n_blocks, block_size) float32 importance, > 0.
        Returns:
            The codec's parameter object (its class docstring says which), every tensor in it
            with the block axis first; the same search as :meth:`encode_blocks`.
        Raises:
            NotImplementedError: the format has no block grid (plain floats).
        """
        raise NotImplementedError(f"{self.format_name} has no block grid")

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Round weights to the nearest value of their block's grid.

        Args:
            x: (n_blocks, m) float32: columns ``start .. start + m - 1`` of each block.
            params: from :meth:`fit_params` for the same blocks.
            start: index in the block of ``x``'s first column (sub-block scales of the
                K-quants depend on it).
        Returns:
            (codes, values): (n_blocks, m) int64 codes as :meth:`pack` takes them and
            (n_blocks, m) float32 values, equal bit for bit to what :meth:`decode_blocks`
            gives for them.
        """
        raise NotImplementedError(f"{self.format_name} has no block grid")

    def column_rounder(self, params) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`round_to_grid` one column at a time, as GPTQ's inner loop rounds (:mod:`dynaquant.quant.gptq`).

        Args:
            params: from :meth:`fit_params`.
        Returns:
            ``f(x, j)``: ``x`` (n_blocks,) float32, column ``j`` (0 .. block_size - 1) of each block ->
            ``(codes, values)``, (n_blocks,) int64 and float32, equal bit for bit to column 0 of
            ``round_to_grid(x[:, None], params, j)``: the codec's :meth:`column_grid` where it gives one (what a
            block's columns share computed once, and a form the fast path ``gptq.round_block`` takes), else
            :meth:`round_to_grid` a column at a time.
        Raises:
            NotImplementedError: the format has no block grid.
        """
        grid = self.column_grid(params)
        if grid is not None:
            return grid

        def one(x: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
            codes, values = self.round_to_grid(x[:, None], params, j)
            return codes[:, 0], values[:, 0]
        return one

    def column_grid(self, params) -> ColumnGrid | LevelGrid | None:
        """The block's grid column by column as plain tensors: a :class:`ColumnGrid` where every column's is linear
        with its own scale (and min), as the K-quants' are; a :class:`LevelGrid` where it is a scale times a table of
        levels (the legacy symmetric types, IQ4_NL, IQ4_XS); None for other grids (the default)."""
        return None

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        """Write blocks: :meth:`fit_params` parameters + (n_blocks, block_size) int64 codes ->
        (n_blocks, type_size) uint8, the GGUF block layout."""
        raise NotImplementedError(f"{self.format_name} has no block grid")

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        """Decode blocks: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32.

        Equal bit for bit to ``gguf.quants.dequantize`` on the same bytes.
        """
        raise NotImplementedError


_CODECS: dict[str, Codec] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry under its format name."""
    _CODECS[cls.format_name] = cls()
    return cls


def get_codec(name: str) -> Codec:
    """The codec of a format name.

    Raises:
        KeyError: no codec is registered for that format.
    """
    fmt = get_format(name)
    if fmt.name not in _CODECS:
        raise KeyError(f"no codec for format {fmt.name}; codecs exist for: {', '.join(_CODECS)}")
    return _CODECS[fmt.name]


# Rows per encode chunk are chosen so a chunk holds about this many weights; codecs
# that search many candidates multiply memory by their candidate count.
CHUNK_WEIGHTS = 1 << 20
# On CUDA a chunk is larger (fewer, bigger kernels: the searches are launch-bound on 1M
# weights), up to CUDA_CHUNK_WEIGHTS, and at most the free device memory divided by
# CUDA_BYTES_PER_WEIGHT (a bound on the search temporaries per weight), never below
# CHUNK_WEIGHTS.
CUDA_CHUNK_WEIGHTS = 1 << 24
CUDA_BYTES_PER_WEIGHT = 1024
# On a CPU: chunks small enough for their temporaries to stay in cache and large enough that the Python
# between ops stays small beside the ops (2-core box, idle, two threads, 2M weights: Q4_K 6.0e5 / 8.3e5 /
# 6.8e5 weights/s with 64K / 128K / 256K-weight chunks, Q6_K 7.3e5 / 8.4e5 / 9.3e5, Q8_0 1.6e7 / 1.5e7 /
# 1.4e7); a multiple of the blockfit codecs' own CPU sub-chunk (2048 blocks of 32).
CPU_CHUNK_WEIGHTS = 1 << 17


def chunk_weights(device: torch.device | str, large: bool = False) -> int:
    """Weights per encode chunk on ``device``: :data:`CHUNK_WEIGHTS`; on CUDA up to
    :data:`CUDA_CHUNK_WEIGHTS` as free memory allows (``torch.cuda.mem_get_info``); on a CPU
    :data:`CPU_CHUNK_WEIGHTS`, or :data:`CHUNK_WEIGHTS` when ``large`` (a ``cross_block`` codec (:class:`Codec`);
    the analysis's batched samples, faster in large chunks on torch's own threads).

    On a CPU the size is fixed, not taken from the thread count: a block's bytes can depend, in the last
    float bits, on where it lies in its call (torch's vectorised reductions add the tail lanes in another
    order), so the chunks must be the same on every machine for the same bytes."""
    device = torch.device(device)
    if device.type == "cpu" and not large:
        return CPU_CHUNK_WEIGHTS
    if device.type != "cuda":
        return CHUNK_WEIGHTS
    free, _ = torch.cuda.mem_get_info(device)
    return max(CHUNK_WEIGHTS, min(CUDA_CHUNK_WEIGHTS, free // CUDA_BYTES_PER_WEIGHT))


def block_importance(imatrix: torch.Tensor | None, rows: int, k: int, device, dtype=torch.float32) -> torch.Tensor:
    """(rows, k) ``dtype`` per-weight importance: ``imatrix`` ((k,) E[x^2] per input column) floored and repeated over
    ``rows``, or all ones without one. Raises ValueError when the imatrix does not have k entries."""
    if imatrix is None:
        return torch.ones(rows, k, device=device, dtype=dtype)
    imatrix = torch.as_tensor(imatrix, dtype=dtype, device=device).reshape(-1)
    if imatrix.numel() != k:
        raise ValueError(f"imatrix has {imatrix.numel()} entries, the weight's rows have {k}")
    return _floored(imatrix).expand(rows, k)


def _floored(imatrix: torch.Tensor) -> torch.Tensor:
    if (~torch.isfinite(imatrix) | (imatrix < 0)).any():  # one host sync (on a GPU each bool() waits for the stream)
        raise ValueError("imatrix must be finite and non-negative")
    # A column never seen in calibration (0) keeps a small weight so its values are not arbitrary. (The smallest
    # positive entry by where/min, not a boolean index: on a CPU that one starts OpenMP's team for a 14K-entry row,
    # whose idle workers then spin, by default, on the cores the chunk workers need: Q8_0 22.8 against 17.9 ms of
    # CPU time on 2 threads, 256x14336.)
    pos = imatrix > 0
    floor = torch.where(pos.any(), torch.where(pos, imatrix, torch.inf).min() * 1e-3, 1.0)  # (no host decision)
    return imatrix.clamp_min(floor)


def _expert_importance(imatrix, shape: torch.Size, device) -> torch.Tensor | None:
    """(n_expert, K) floored importance when ``imatrix`` holds one row per expert of a stacked
    ``(n_expert, rows, K)`` weight (llama.cpp's imatrix for ``ffn_*_exps``), else None."""
    if imatrix is None or len(shape) != 3:
        return None
    im = torch.as_tensor(imatrix, dtype=torch.float32, device=device)
    if im.numel() != shape[0] * shape[-1] or shape[0] == 1:
        return None
    return torch.stack([_floored(row) for row in fill_unrouted(im.reshape(shape[0], shape[-1]))])


def fill_unrouted(imatrix: torch.Tensor) -> torch.Tensor:
    """(n_expert, K) per-expert imatrix with each all-zero row (an expert calibration never routed to) replaced by the
    mean of the other rows (unchanged when none or all are zero)."""
    seen = imatrix.sum(-1) > 0
    if seen.any() and not seen.all():
        return torch.where(seen[:, None], imatrix, imatrix[seen].mean(0))
    return imatrix


def quantize(
    weight: torch.Tensor,
    fmt: str | Format,
    imatrix: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    variant: str | None = None,
) -> torch.Tensor:
    """Quantize a 2-D weight (or any tensor, by its last axis) to a format's bytes.

    Args:
        weight: (..., K) float tensor on any device; K must be a multiple of the block size.
        fmt: format name or row.
        imatrix: optional (K,) per-column importance (E[x^2] of the layer's inputs); the
            encoder minimises the importance-weighted squared error. For a stacked MoE expert
            weight (n_expert, N, K), an (n_expert, K) imatrix gives each expert its own (the
            llama.cpp imatrix layout); an expert whose row is all zero (never routed to in
            calibration) gets the mean of the others.
        backend: how a codec with fast paths (``Codec.fast_paths``: the lattice i-quants) runs
            its search: ``"auto"`` (default: the fast path registered by :mod:`dynaquant.kernels`
            on CUDA tensors, else torch), ``"torch"``, or ``"triton"`` (the fast path on any
            device); other codecs ignore it (:func:`dynaquant.quant.codecs._lattice.fast_path`).
        variant: the fused nearest-codeword kernel's implementation, ``"rows"`` or ``"tile"``
            (None: ``"rows"``); only the IQ2 codecs' fast path uses it.
    Returns:
        (..., K // block_size * type_size) uint8 tensor on the weight's device, the GGUF
        byte layout (as ``gguf.quants.quantize`` returns it); for the runtime formats the
        reference codec's block records (see :mod:`dynaquant.quant.runtime`).
    Raises:
        ValueError: K is not a multiple of the block size, the imatrix does not fit, or an
            unknown backend.
        RuntimeError: ``backend="triton"`` for a codec with fast paths and none is registered.
    """
    fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
    codec = get_codec(fmt.name)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    opts = {"backend": backend, "variant": variant} if codec.fast_paths else {}
    shape = weight.shape
    k = shape[-1]
    row_bytes = fmt.record_bytes(k)  # the codecs' records (= the GGUF row for GGUF formats)
    x = weight.reshape(-1, k)  # (converted to float32 a chunk at a time, in the chunk workers: no whole-tensor copy)
    rows = x.shape[0]
    out = torch.empty(rows, row_bytes, dtype=torch.uint8, device=x.device)
    if fmt.kind == "float":  # plain conversion: no search, no importance
        xf = x.to(torch.float32).reshape(-1, 1)
        blocks = codec.encode_blocks(xf, xf)
        return blocks.reshape(*shape[:-1], row_bytes)
    step = max(1, chunk_weights(x.device, large=codec.cross_block) // k)
    with intra_op_threads(1) if x.device.type == "cpu" else contextlib.nullcontext():  # (module docstring: OpenMP)
        per_expert = _expert_importance(imatrix, shape, x.device)
        shared = None
        if per_expert is None:  # floored once, and repeated over a chunk's rows once: each chunk takes a prefix of it
            shared = block_importance(imatrix, 1, k, x.device).expand(min(step, rows), k).reshape(-1, fmt.block_size)
            shared = shared.contiguous()

    def encode(r0: int) -> None:
        xr = x[r0 : r0 + step].to(torch.float32)
        if per_expert is None:
            wb = shared[: xr.shape[0] * (k // fmt.block_size)]
        else:
            wr = per_expert[torch.arange(r0, r0 + xr.shape[0], device=x.device) // shape[1]]
            wb = wr.reshape(-1, fmt.block_size).contiguous()
        xb = xr.reshape(-1, fmt.block_size).contiguous()
        blocks = codec.encode_blocks(xb, wb, **opts)
        out[r0 : r0 + step] = blocks.reshape(xr.shape[0], row_bytes)

    for_each_chunk(encode, range(0, rows, step), x.device)
    return out.reshape(*shape[:-1], row_bytes)


def encode_workers(device: torch.device | str) -> int:
    """How many chunks :func:`for_each_chunk` runs at once on ``device``: torch's thread count on a CPU, else 1."""
    return torch.get_num_threads() if torch.device(device).type == "cpu" else 1


def for_each_chunk(fn, starts, device: torch.device | str) -> None:
    """``fn(start)`` for each chunk start, in order on a GPU; on a CPU on :func:`encode_workers` threads of
    their own with torch's intra-op threads at one (module docstring). ``fn`` writes disjoint outputs; a
    chunk's exception is raised here. Each chunk's result does not depend on the others, so the output is
    the same whatever the thread count."""
    starts = list(starts)
    if torch.device(device).type != "cpu":
        for s in starts:
            fn(s)
        return
    workers = min(encode_workers(device), len(starts))
    with intra_op_threads(1):
        if workers > 1 and not threading.current_thread().name.startswith(_POOL_PREFIX):  # (inside: no nested waits)
            for _ in _encode_pool(workers).map(fn, starts):
                pass
        else:
            for s in starts:
                fn(s)


_POOL_PREFIX = "dynaquant-encode"


@functools.cache
def _encode_pool(workers: int) -> ThreadPoolExecutor:
    """The encoders' thread pool of ``workers`` threads, made once a process (a pool a tensor started two threads for
    each of a small model's hundreds of tensors). Callers wait for their own chunks only, so concurrent callers (the
    pipeline's threads) share it safely."""
    return ThreadPoolExecutor(workers, thread_name_prefix=_POOL_PREFIX)


@contextmanager
def intra_op_threads(n: int):
    """Run the block with ``torch.set_num_threads(n)`` (process-wide), restoring the previous count after."""
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if old != n:
            torch.set_num_threads(old)


def dequantize(data: torch.Tensor | np.ndarray, fmt: str | Format) -> torch.Tensor:
    """Decode a format's bytes.

    Args:
        data: (..., B) uint8 with B a multiple of the format's type size.
    Returns:
        (..., B // type_size * block_size) float32 tensor on the data's device.
    """
    fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
    data = torch.as_tensor(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data)
    if data.dtype != torch.uint8:
        raise ValueError(f"dequantize takes uint8 bytes, got {data.dtype}")
    nbytes = data.shape[-1]
    if nbytes % fmt.type_size:
        raise ValueError(f"{fmt.name}: {nbytes} bytes per row is not a multiple of {fmt.type_size}")
    k = nbytes // fmt.type_size * fmt.block_size
    blocks = get_codec(fmt.name).decode_blocks(data.reshape(-1, fmt.type_size).contiguous())
    return blocks.reshape(*data.shape[:-1], k)


def weighted_error(weight: torch.Tensor, decoded: torch.Tensor, imatrix: torch.Tensor | None = None) -> float:
    """Importance-weighted squared error ``sum_ij imatrix[j] * (W - Q(W))_ij ** 2`` (float)."""
    d = (weight.to(torch.float64) - decoded.to(torch.float64)) ** 2
    if imatrix is not None:
        d = d * torch.as_tensor(imatrix, dtype=torch.float64, device=d.device)
    return float(d.sum())
