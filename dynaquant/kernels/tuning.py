"""Launch configurations: chosen per (format, shape, device) by :func:`choose_config`, cached.

No global switches: the choice is a pure function of its arguments (memoised with
``functools.lru_cache``), and :func:`dynaquant.kernels.linear` takes an explicit ``config`` to
override it (the benchmark's sweeps do). Paths:

- ``gemv`` (M = 1): CUDA-core dot products, tiles of rows x whole groups, split-K so that every
  SM has work; the last program of a tile reduces the split partials (no extra launch).
- ``mm`` (small batches): dequantize a (BLOCK_N, group) tile to bf16/fp16 in registers and
  multiply on the tensor cores with the tokens as the narrow side (``W_tile @ X_tile^T``), one
  group per ``tl.dot``, scales applied to the fp32 partial products; split-K as above.
- ``dequant`` (large batches): dequantize to the activation dtype, then ``torch`` matmul (cuBLAS).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dynaquant.kernels.formats import KernelFormat

__all__ = ["LaunchConfig", "DeviceInfo", "device_info", "choose_config", "valid_config", "gemv_candidates",
           "mm_candidates"]


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is launched.

    Attributes:
        path: ``gemv``, ``mm`` or ``dequant``.
        block_m: tokens per program (``mm``; 1 for ``gemv``).
        block_n: output rows (weight rows) per program.
        groups: quantization groups per loop iteration (the K tile is ``groups * group_size``).
        split_k: programs along K per output tile (partials in float32, reduced by the last one).
        num_warps, num_stages: Triton's launch options.
        prefetch: ``gemv``: load the next K tile's words before decoding the current one (registers).
    """

    path: str
    block_m: int = 1
    block_n: int = 64
    groups: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = False


@dataclass(frozen=True)
class DeviceInfo:
    """What the tuning looks at: name, multiprocessor count and compute capability (``cpu`` for the interpreter)."""

    name: str
    sm_count: int
    capability: tuple[int, int] = (0, 0)


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(p.name, p.multi_processor_count, (p.major, p.minor))


def device_info(device: torch.device | str) -> DeviceInfo:
    """The DeviceInfo of a torch device (cached per CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    return DeviceInfo("cpu", 4)


def _words_per_group(fmt: KernelFormat) -> int:
    epw = 16 if fmt.bits == 3 else 32 // fmt.bits
    return fmt.group_size // epw


def valid_config(cfg: LaunchConfig, fmt: KernelFormat, m: int, n: int, k: int) -> bool:
    """Whether ``cfg`` can run this shape: the K split and the K tile divide the row's groups."""
    n_groups = k // fmt.group_size
    if cfg.split_k < 1 or n_groups % cfg.split_k or (n_groups // cfg.split_k) % cfg.groups:
        return False
    if cfg.path == "gemv":  # asymmetric formats: one group per K tile
        return m == 1 and cfg.block_n >= 16 and (fmt.symmetric or cfg.groups == 1)
    if cfg.path == "mm":
        return cfg.block_n >= 16 and cfg.block_m >= 16 and (cfg.split_k == 1 or m <= cfg.block_m)
    return cfg.path == "dequant" and cfg.split_k == 1


def _pow2_at_least(v: int, lo: int) -> int:
    p = lo
    while p < v:
        p *= 2
    return p


def _split_for(n_groups: int, groups: int, tiles: int, target_programs: int, max_split: int = 16) -> int:
    """The smallest split of the row's groups (in whole K tiles) that brings the programs up to the target."""
    best = 1
    for s in range(1, max_split + 1):
        if n_groups % s or (n_groups // s) % groups:
            continue
        best = s
        if tiles * s >= target_programs:
            break
    return best


def _gemv_rows(fmt: KernelFormat, warps: int, rows_per_thread: int, groups: int = 1) -> int:
    """BLOCK_N giving each thread ``rows_per_thread`` rows of 16-byte word vectors (K tile: ``groups`` groups)."""
    words = _words_per_group(fmt) * groups
    threads_per_row = max(1, words // 4)
    return max(16, rows_per_thread * 32 * warps // threads_per_row)


def _gemv_config(fmt: KernelFormat, n: int, k: int, dev: DeviceInfo) -> LaunchConfig:
    n_groups = k // fmt.group_size
    if dev.name == "cpu":  # the interpreter: small tiles, and exercise split-K
        return LaunchConfig("gemv", 1, 16, 1, _split_for(n_groups, 1, 1, 2, 2), 4, 1)
    # measured on an H100 (benchmarks/kernels.py --sweep, M = 1, Llama-3-8B shapes): 4 rows a thread
    # for groups of 8+ words, 2 rows a thread (BLOCK_N 256) for smaller groups (MXFP4: 10-20 % faster
    # than 4); K split until about 2 programs per SM
    # Third run (2026-11-22, 264 candidates): 2-group K tiles with prefetch for int 16-word groups
    # (INT4_G128: 2-8 % on q/o, gate/up, down), 32-word tiles for MXFP4 up to N = 8192 (6-18 %);
    # more programs per SM (4, 8), 8 warps or num_stages 3 did not help
    wpg = _words_per_group(fmt)
    groups, prefetch = 1, False
    if fmt.symmetric and fmt.kind == "int" and wpg == 16 and n_groups % 2 == 0:
        groups, prefetch = 2, True
    elif fmt.symmetric and fmt.kind == "mxfp4" and n <= 8192 and n_groups % (32 // wpg) == 0:
        groups = 32 // wpg
    rows = 4 if (wpg >= 8 or groups > 1) else 2
    block_n = _gemv_rows(fmt, 4, rows, groups)
    split = _split_for(n_groups, groups, -(-n // block_n), 2 * dev.sm_count, 32)
    return LaunchConfig("gemv", 1, block_n, groups, split, 4, 1, prefetch)


def _mm_config(fmt: KernelFormat, m: int, n: int, k: int, dev: DeviceInfo) -> LaunchConfig:
    n_groups = k // fmt.group_size
    block_m = _pow2_at_least(m, 16)
    if dev.name == "cpu":
        block_m = min(block_m, 32)
        return LaunchConfig("mm", block_m, 16, 1, _split_for(n_groups, 1, 1, 2, 2) if m <= block_m else 1, 4, 1)
    block_m = min(block_m, 64)
    block_n = 128 if (m > 32 or fmt.is_fp4) else 64  # measured at M = 16: 64 for integers, 128 for FP4
    groups = max(1, 128 // fmt.group_size)
    while n_groups % groups:
        groups //= 2
    tiles = -(-n // block_n) * -(-m // block_m)
    split = _split_for(n_groups, groups, tiles, dev.sm_count) if m <= block_m else 1
    return LaunchConfig("mm", block_m, block_n, groups, split, 4, 3)


@functools.lru_cache(maxsize=4096)
def choose_config(fmt: KernelFormat, m: int, n: int, k: int, dev: DeviceInfo) -> LaunchConfig:
    """The launch configuration for ``y (m, n) = x (m, k) @ dequant(W (n, k)).T`` on ``dev`` (cached).

    Args:
        fmt: the weight format; m: tokens; n: output features; k: input features; dev: :func:`device_info`.
    Returns:
        A LaunchConfig valid for the shape (:func:`valid_config`).
    """
    if m == 1:
        return _gemv_config(fmt, n, k, dev)
    if m <= 64 or dev.name == "cpu":
        return _mm_config(fmt, m, n, k, dev)
    if fmt.kind == "int" and fmt.symmetric and fmt.group_size == 128 and n >= 14336 and m >= 128:
        # H100 sweep at M = 256 (int2/int4, group 128): a (256 x 64) tile a program beat dequantize + cuBLAS by 5-7 %
        # on gate/up, lost on the smaller shapes
        return LaunchConfig("mm", 256 if m > 128 else 128, 64, 1, 1, 8, 3)
    return LaunchConfig("dequant", 1, 64, max(1, 128 // fmt.group_size) if (k // fmt.group_size) % 2 == 0 else 1)


def gemv_candidates(fmt: KernelFormat, n: int, k: int, dev: DeviceInfo) -> list[LaunchConfig]:
    """GEMV configurations worth timing for a shape (the benchmark's sweep): rows a thread, warps, K split,
    and (symmetric formats) K tiles of 32 words and prefetching."""
    n_groups = k // fmt.group_size
    wpg = _words_per_group(fmt)
    out = []
    for warps, rows, targets in ((4, 1, (2, 4, 8)), (4, 2, (2, 4, 8)), (4, 4, (2, 4, 8)), (4, 8, (1, 2)),
                                 (8, 1, (2, 4)), (8, 2, (2, 4))):
        block_n = _gemv_rows(fmt, warps, rows)
        if block_n > 1024:
            continue
        tiles = -(-n // block_n)
        for target in targets:  # programs per SM: more resident warps keep more loads in flight
            split = _split_for(n_groups, 1, tiles, target * dev.sm_count, 32)
            out.append(LaunchConfig("gemv", 1, block_n, 1, split, warps, 1))
            if warps == 4 and rows in (2, 4) and target in (2, 4):
                out.append(LaunchConfig("gemv", 1, block_n, 1, split, warps, 1, True))
            if warps == 4 and rows == 4 and target in (2, 4):
                out.append(LaunchConfig("gemv", 1, block_n, 1, split, warps, 3))
    if fmt.symmetric and wpg < 32:
        groups = 32 // wpg
        for rows in (2, 4):
            block_n = _gemv_rows(fmt, 4, rows, groups)
            if n_groups % groups or block_n > 1024:
                continue
            for target in (2, 4):
                split = _split_for(n_groups, groups, -(-n // block_n), target * dev.sm_count, 32)
                for prefetch in (False, True):
                    out.append(LaunchConfig("gemv", 1, block_n, groups, split, 4, 1, prefetch))
    return [c for c in dict.fromkeys(out) if valid_config(c, fmt, 1, n, k)]


def mm_candidates(fmt: KernelFormat, m: int, n: int, k: int, dev: DeviceInfo) -> list[LaunchConfig]:
    """Small-batch configurations worth timing for a shape (the benchmark's sweep)."""
    n_groups = k // fmt.group_size
    block_m = min(_pow2_at_least(m, 16), 128)
    out = []
    for block_n in (64, 128):
        groups = max(1, 128 // fmt.group_size)
        while n_groups % groups:
            groups //= 2
        tiles = -(-n // block_n) * -(-m // block_m)
        split = _split_for(n_groups, groups, tiles, dev.sm_count) if m <= block_m else 1
        out.append(LaunchConfig("mm", block_m, block_n, groups, split, 4, 3))
        if split > 1:
            out.append(LaunchConfig("mm", block_m, block_n, groups, 1, 4, 3))
    if m > 64:  # large batches: wide tiles decode each weight tile for more tokens (8 warps hold the accumulator)
        for bm, bn, warps in ((64, 128, 4), (64, 256, 8), (128, 64, 8), (128, 128, 8), (256, 64, 8)):
            for stages in (2, 3):
                out.append(LaunchConfig("mm", min(bm, _pow2_at_least(m, 16)), bn, groups, 1, warps, stages))
    return list(dict.fromkeys(out))
