"""Launch configurations: chosen per (format, shape, device) by :func:`choose_config`, cached.

No global switches: the choice is a pure function of its arguments (memoised with
``functools.lru_cache``), and :func:`dynaquant.kernels.linear` takes an explicit ``config`` to
override it (the benchmark's sweeps do). Paths:

- ``gemv`` (M = 1): CUDA-core dot products, tiles of rows x whole groups, split-K so that every
  SM has work; the last program of a tile reduces the split partials (no extra launch).
- ``mm`` (small batches): dequantize a (BLOCK_N, group) tile to bf16/fp16 in registers and
  multiply on the tensor cores with the tokens as the narrow side (``W_tile @ X_tile^T``), one
  group per ``tl.dot``, scales applied to the fp32 partial products; split-K as above.
- ``gemm`` (large batches): the fused dequant-GEMM of :mod:`dynaquant.kernels.triton_gemm`, each weight
  tile decoded and scaled in registers and multiplied for a wide token tile, one float32 accumulator.
- ``dequant`` (large batches): dequantize to the activation dtype, then ``torch`` matmul (cuBLAS).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from dynaquant.kernels.formats import KernelFormat

__all__ = ["LaunchConfig", "DeviceInfo", "device_info", "choose_config", "valid_config", "gemv_candidates",
           "mm_candidates", "gemm_candidates", "resident_gemv_config", "resident_candidates", "resident_grid",
           "gemm_variant_candidates"]


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is launched.

    Attributes:
        path: ``gemv``, ``mm``, ``gemm`` or ``dequant``.
        block_m: tokens per program (``mm``, ``gemm``; 1 for ``gemv``).
        block_n: output rows (weight rows) per program.
        groups: quantization groups per loop iteration (the K tile is ``groups * group_size``).
        split_k: programs along K per output tile (partials in float32, reduced by the last one).
        num_warps, num_stages: Triton's launch options.
        prefetch: ``gemv``: load the next K tile's words before decoding the current one (registers); ``gemm`` with
            ``gluon``: load them two K tiles ahead instead of one.
        block_k: ``gemm``: weights along K a loop iteration (at least 32, a power-of-two number of packed
            words that divides a group or is made of whole groups; 0 elsewhere).
        half2: ``gemv``, symmetric INT4 / INT2 and FP4: each packed word's dot product in fp16 pairs
            (:mod:`dynaquant.kernels.triton_half2`), float32 across words.
        scale_words: ``half2``: runs of this many words (1, 2 or 4; at most a group's) summed in float32 before
            their group's scale multiplies them: the scale is loaded and converted once a run (1: once a word).
        pairs: ``half2``: two words' products summed in fp16 before the float32 conversion (runs of 2+ words).
        resident: ``gemv`` with ``half2``: the resident-activation GEMV (:mod:`dynaquant.kernels.triton_resident`)
            with at most this many programs an SM (one wave; 0: off). Each program keeps one K slice's activation
            pairs in registers (the K tile is the slice: ``split_k * groups`` is the row's groups) and loops over
            row tiles of ``block_n`` rows, ``prefetch`` loading the next tile's words first.
        xa: ``gemm``: the tokens as the ``tl.dot``'s A operand (``acc (BLOCK_M, BLOCK_N) += X_tile @ W_tile^T``), the
            decoded weight tile as B (on Hopper: stored once to shared memory, where every warp group's ``wgmma``
            reads it; the default puts the weight tile in A, in registers, and the tokens in B).
        post_scale: ``gemm``, K tiles inside one group (``block_k <= group_size``): the tile's exact codes
            (``code - zero``, E2M1 values) enter the dot and the group's float32 scale multiplies its float32
            product (one multiply an output instead of one a weight; a second accumulator's registers).
        warp_spec: ``gemm``: ``tl.range(..., warp_specialize=True)`` on the K loop (Triton's producer / consumer
            warp partitions, where the compiler supports them for the target; 4+ warps).
        max_regs: ``gemm``: Triton's ``maxnreg`` (registers a thread; 0: the compiler's choice). 128 at 8 warps lets
            two programs share a multiprocessor, so one program's decode runs while the other's ``wgmma`` does.
        gluon: ``gemm`` on Hopper: the Gluon kernel (:mod:`dynaquant.kernels.gluon_gemm`: activation tiles by TMA,
            the next weight tile decoded while the tensor cores multiply this one); token tiles of 64+ (zero-filled
            past M), whole warp groups, 3+ stages; none of the Triton kernel's options above.
    """

    path: str
    block_m: int = 1
    block_n: int = 64
    groups: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = False
    block_k: int = 0
    half2: bool = False
    scale_words: int = 4
    pairs: bool = False
    resident: int = 0
    xa: bool = False
    post_scale: bool = False
    warp_spec: bool = False
    max_regs: int = 0
    gluon: bool = False


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


def _gemm_valid(cfg: LaunchConfig, fmt: KernelFormat, m: int, n: int, k: int) -> bool:
    """K tiles of 32 or more weights in a power-of-two number of words that divide a group or hold whole
    ones; a K split of whole
    tiles, with a split-K semaphore for every output tile (``ceil(N / 16)`` of them)."""
    epw = 16 if fmt.bits == 3 else 32 // fmt.bits
    bk, g, s = cfg.block_k, fmt.group_size, cfg.split_k
    words = bk // epw if bk % epw == 0 else 0
    tiles = -(-m // max(cfg.block_m, 1)) * -(-n // max(cfg.block_n, 1))
    if cfg.gluon and not _gluon_valid(cfg):
        return False
    return (min(cfg.block_m, cfg.block_n) >= 16 and bk >= 32 and k % bk == 0 and words > 0 and words & (words - 1) == 0
            and (g % bk == 0 or bk % g == 0) and s >= 1 and (k // bk) % s == 0 and (s == 1 or tiles <= -(-n // 16))
            and (not cfg.post_scale or bk <= g) and (not cfg.warp_spec or cfg.num_warps >= 4)
            and (cfg.max_regs == 0 or 24 <= cfg.max_regs <= 255))


GLUON_SMEM = 227 * 1024  # shared memory a Hopper block may take (bytes)


def _gluon_valid(cfg: LaunchConfig) -> bool:
    """The Gluon GEMM's limits: ``wgmma``'s 64-row M and warp groups, activation tiles ``num_stages - 2`` ahead, a
    weight tile of at most 256 rows (one instruction's N), the slots in shared memory (16-bit activations: ``stages``
    token tiles and 3 decoded weight tiles), and none of the Triton kernel's options."""
    smem = 2 * cfg.block_k * (cfg.num_stages * cfg.block_m + 3 * cfg.block_n)
    return (cfg.block_m >= 64 and cfg.num_warps in (4, 8) and cfg.num_stages >= 3 and 16 <= cfg.block_n <= 256
            and smem <= GLUON_SMEM - 1024 and not (cfg.xa or cfg.post_scale or cfg.warp_spec or cfg.max_regs))


def has_half2(fmt: KernelFormat) -> bool:
    """Whether the format's codes have the packed-fp16 word products (:mod:`dynaquant.kernels.triton_half2`):
    symmetric INT4 / INT2 and FP4."""
    return fmt.symmetric and (fmt.is_fp4 or fmt.bits in (2, 4))


def valid_config(cfg: LaunchConfig, fmt: KernelFormat, m: int, n: int, k: int) -> bool:
    """Whether ``cfg`` can run this shape: the K split and the K tile divide the row's groups."""
    if cfg.path == "gemm":
        return _gemm_valid(cfg, fmt, m, n, k)
    if cfg.xa or cfg.post_scale or cfg.warp_spec or cfg.max_regs or cfg.gluon:
        return False
    n_groups = k // fmt.group_size
    if cfg.split_k < 1 or n_groups % cfg.split_k or (n_groups // cfg.split_k) % cfg.groups:
        return False
    if cfg.resident and not _resident_valid(cfg, fmt, m, n_groups):
        return False
    if cfg.half2 and not (cfg.path == "gemv" and has_half2(fmt)):
        return False
    if cfg.scale_words not in (1, 2, 4) or (cfg.pairs and not (cfg.half2 and min(cfg.scale_words,
                                                                                      _words_per_group(fmt)) >= 2)):
        return False
    if cfg.path == "gemv":  # asymmetric formats: one group per K tile
        return m == 1 and cfg.block_n >= 16 and (fmt.symmetric or cfg.groups == 1)
    if cfg.path == "mm":
        return cfg.block_n >= 16 and cfg.block_m >= 16 and (cfg.split_k == 1 or m <= cfg.block_m)
    return cfg.path == "dequant" and cfg.split_k == 1


def _resident_valid(cfg: LaunchConfig, fmt: KernelFormat, m: int, n_groups: int) -> bool:
    """The resident GEMV: M = 1, half2 formats, the K split in slices of one K tile each (a power-of-two number of
    words), row tiles of 16+ rows (a split-K counter each), a power of two."""
    words = cfg.groups * _words_per_group(fmt)
    return (cfg.path == "gemv" and m == 1 and cfg.half2 and has_half2(fmt) and not cfg.pairs and cfg.resident >= 1
            and cfg.split_k * cfg.groups == n_groups and words & (words - 1) == 0
            and cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0)


def resident_grid(n: int, cfg: LaunchConfig, sm_count: int) -> tuple[int, int, int]:
    """The resident GEMV's row tiles, programs along N and row tiles a program: ``(tiles, P, per)`` with ``P *
    split_k`` at most ``resident * sm_count`` (at least ``P = 1``) and ``P * per >= tiles``, ``P`` as small as
    ``per`` allows (every program ``per`` tiles, or ``per - 1``)."""
    tiles = -(-n // cfg.block_n)
    target = max(1, min(tiles, cfg.resident * sm_count // cfg.split_k))
    progs = -(-tiles // -(-tiles // target))
    return tiles, progs, -(-tiles // progs)


def _resident(fmt: KernelFormat, k: int, words: int, block_n: int, warps: int, per_sm: int, runs: int = 4,
              prefetch: bool = True) -> LaunchConfig:
    """A resident-GEMV config of K slices of ``words`` words (the split follows)."""
    groups = max(1, words // _words_per_group(fmt))
    split = max(1, (k // fmt.group_size) // groups)
    return LaunchConfig("gemv", 1, block_n, groups, split, warps, 1, prefetch, 0, True, runs, False, per_sm)


def resident_gemv_config(fmt: KernelFormat, n: int, k: int, dev: DeviceInfo) -> LaunchConfig | None:
    """A resident-GEMV configuration for the shape (``benchmarks/kernel_speed.py --gemv-xpre``; not yet the default
    anywhere, unmeasured): K slices of 128 words (64 where 128 do not divide the row), 16-row tiles, 4 warps, 4
    programs an SM (80-104 registers on sm_90 with the prefetch, so 4 fit), prefetch, a scale a run of 4 words; None
    for formats without the packed-fp16 products or rows no slice divides."""
    if not has_half2(fmt):
        return None
    for words in (128, 64, 32):
        cfg = _resident(fmt, k, words, 16, 4, 4)
        if valid_config(cfg, fmt, 1, n, k):
            return cfg
    return None


def resident_candidates(fmt: KernelFormat, n: int, k: int, dev: DeviceInfo) -> list[LaunchConfig]:
    """Resident-GEMV configurations worth timing (the sweep): K slices of 64, 128 or 256 words, 16 rows on 4 warps
    or 32 rows on 4 or 8, 4 or 8 programs an SM, prefetch, runs of 4 words; 2 programs an SM for the widest tiles
    (256 words x 32 rows, 8 warps, ~80 registers on sm_90), a scale a word, and one without prefetch."""
    if not has_half2(fmt):
        return []
    out = [_resident(fmt, k, words, bn, warps, per_sm)
           for words, (bn, warps), per_sm in itertools.product((64, 128, 256), ((16, 4), (32, 4), (32, 8)), (4, 8))]
    out += [_resident(fmt, k, 256, 32, 8, 2), _resident(fmt, k, 128, 32, 4, 4, runs=1),
            _resident(fmt, k, 128, 32, 4, 4, prefetch=False)]
    return [c for c in dict.fromkeys(out) if valid_config(c, fmt, 1, n, k)]


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


def _half2_gemv_config(fmt: KernelFormat, n: int, k: int, dev: DeviceInfo) -> LaunchConfig | None:
    """Wide K tiles with the packed-fp16 word products for symmetric INT4 / INT2 at group 128 and for MXFP4 / NVFP4
    on sm_90+ (the formats measured; H200 sweeps 2026-11-28, M = 1, Llama-3-8B shapes): 128 words (512 bytes) of a
    row an iteration, 32 rows (64 from 28672 rows; 16 for FP4), split to about 8 programs an SM; INT2 at K <= 4096
    and N < 28672 takes 256 words, 16 rows and 8 warps. Decode step (sweep): INT4_G128 2.06x -> 2.42x bf16,
    INT2_G128 2.24x -> 2.81x, MXFP4_G32 1.25x -> 1.36x, NVFP4_G16 0.78x -> 1.33x; then scales once a run of words
    (``scale_words``, below; INT2's wide layers from a sweep with them)."""
    fits = fmt.is_fp4 or (fmt.kind == "int" and fmt.symmetric and fmt.bits in (2, 4) and fmt.group_size == 128)
    if dev.capability < (9, 0) or not fits:
        return None
    wpg = _words_per_group(fmt)
    # a scale a run of 4 words (H200, 2026-11-29): FP4 1.0-2.1x faster a call (step 1.38x -> 2.30x bf16 MXFP4,
    # 1.36x -> 2.22x NVFP4); integers only at the vocabulary's size (lm_head INT4 94.9 -> 86.4 us, INT2 94.0 ->
    # 74.8), 4-8 % slower on q/o, k/v, qkv
    words, block_n, warps, runs, per_sm = 128, (64 if n >= 28672 else 32), 4, 4 if n >= 65536 else 1, 8
    if fmt.is_fp4:
        block_n, runs = 16, 4
    elif fmt.bits == 2 and n < 65536 and (n > 4096 or k >= 8192):
        # INT2 sweep with the runs (H200, 2026-11-29, benchmarks/out/kernels-h200-int2-sweep-s27.json): 16 rows, 4
        # warps, runs of 4, about 4 programs an SM: gate/up 14.9 -> 12.1 us, stacked gate+up 23.3 -> 19.2, down
        # 14.6 -> 14.0, q/k/v 7.6 -> 7.3 (256 words below 8192 rows and columns, else 128)
        words, block_n, warps, runs, per_sm = (256 if (n < 8192 and k < 8192) else 128), 16, 4, 4, 4
    elif fmt.bits == 2 and k < 8192 and n < 28672:  # (INT2's q/o and k/v)
        words, block_n, warps = 256, 16, 8
    elif fmt.bits == 4 and (k // fmt.group_size) % (512 // wpg) == 0 and k <= 4096:
        words, block_n = 512, 16  # a whole 4096-wide row (2 KB) a loop iteration: 3-10 % faster than 128 words
    groups = words // wpg
    split = _split_for(k // fmt.group_size, groups, -(-n // block_n), per_sm * dev.sm_count, 32)
    return LaunchConfig("gemv", 1, block_n, groups, split, warps, 1, False, 0, True, runs)


def _gemv_config(fmt: KernelFormat, n: int, k: int, dev: DeviceInfo) -> LaunchConfig:
    n_groups = k // fmt.group_size
    if dev.name == "cpu":  # the interpreter: small tiles, and exercise split-K
        return LaunchConfig("gemv", 1, 16, 1, _split_for(n_groups, 1, 1, 2, 2), 4, 1)
    # measured on an H100 (benchmarks/kernel_speed.py --sweep, M = 1, Llama-3-8B shapes): 4 rows a thread
    # for groups of 8+ words, 2 rows a thread (BLOCK_N 256) for smaller groups (MXFP4: 10-20 % faster
    # than 4); K split until about 2 programs per SM
    # Third run (2026-11-22, 264 candidates): 2-group K tiles with prefetch for int 16-word groups
    # (INT4_G128: 2-8 % on q/o, gate/up, down), 32-word tiles for MXFP4 up to N = 8192 (6-18 %);
    # more programs per SM (4, 8), 8 warps or num_stages 3 did not help
    wpg = _words_per_group(fmt)
    wide = _half2_gemv_config(fmt, n, k, dev)
    if wide is not None and valid_config(wide, fmt, 1, n, k):
        return wide
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
    if m > 32 and n < 28672 and dev.capability >= (9, 0):  # H200 sweep at M = 64: 64 rows and a K split, 4-20 %
        block_n = 64
    groups = max(1, 128 // fmt.group_size)
    while n_groups % groups:
        groups //= 2
    tiles = -(-n // block_n) * -(-m // block_m)
    split = _split_for(n_groups, groups, tiles, dev.sm_count) if m <= block_m else 1
    return LaunchConfig("mm", block_m, block_n, groups, split, 4, 3)


def _split_to(tiles: int, k_tiles: int, dev: DeviceInfo, most: int = 8) -> int:
    """The smallest power-of-two K split (at most ``most``, dividing ``k_tiles``) giving one program an SM."""
    split = 1
    while tiles * split < dev.sm_count and k_tiles % (2 * split) == 0 and split < most:
        split *= 2
    return split


def _gemm(m: int, n: int, k: int, bm: int, bn: int, bk: int, warps: int, stages: int, dev: DeviceInfo,
          split: bool) -> LaunchConfig:
    bm = min(bm, _pow2_at_least(m, 16))
    s = _split_to(-(-m // bm) * -(-n // bn), k // bk, dev) if split else 1
    return LaunchConfig("gemm", bm, bn, 1, s, warps, stages, False, bk)


def _gemm16(n: int, k: int, split: int) -> LaunchConfig:
    """M = 9..16 on the fused GEMM: 64-row weight tiles, K tiles of 128, 4 warps, 3 stages, K split ``split``
    (halved until it divides the K tiles). The H200 sweep of 2026-11-29 (``benchmarks/kernel_speed.py --sweep
    --sweep-m 16``: splits 1-8 and 32-128-row tiles, Llama-3-8B shapes;
    ``benchmarks/out/kernels-h200-sweep16-s28.json``) put the split where the programs number ~400-900: q/o and
    down 8, q/k/v and gate/up 4, stacked gate+up 2 for INT4 / INT2 (step 1.44x -> 1.50x and 1.59x -> 1.67x bf16),
    and 8 (stacked gate+up 4) for MXFP4 (0.81x -> 0.93x); the former choice split only below one program an SM."""
    while split > 1 and (k // 128) % split:
        split //= 2
    return LaunchConfig("gemm", 16, 64, 1, split, 4, 3, False, 128)


def _fused_gemm_config(fmt: KernelFormat, m: int, n: int, k: int, dev: DeviceInfo) -> LaunchConfig | None:
    """The fused dequant-GEMM where it beat the mm and dequant paths in the H200 sweep (2026-11-28,
    ``benchmarks/kernel_speed.py --sweep --sweep-m 16,64,256``, Llama-3-8B shapes; INT4/INT2 group 128 and
    MXFP4) and, for MXFP4 at M = 65..256 on the large shapes, in the H100 variants run of 2026-12-07; None
    elsewhere (other formats and devices keep the earlier paths until measured)."""
    if dev.capability < (9, 0) or m < 9:
        return None
    int_g128 = fmt.kind == "int" and fmt.symmetric and fmt.group_size == 128 and fmt.bits in (2, 4)
    if int_g128:
        if m <= 16:  # K splits from the 2026-11-29 sweep (below); k/v stays on mm
            return _gemm16(n, k, 2 if n >= 28672 else 4 if n >= 6144 else 8) if n > 2048 else None
        if m <= 64:  # k/v 35 %, gate/up 7-14 %, down 6-12 % faster; gate+up stacked, q/o and q/k/v stay on mm
            if n >= 28672:
                return None
            if n >= 8192:
                return _gemm(m, n, k, 64, 64, 128, 4, 3, dev, False)
            if k >= 8192:
                return _gemm(m, n, k, 64, 128, 128, 8, 3, dev, True)
            if n <= 2048:
                return _gemm(m, n, k, 64, 64, 128, 4, 3, dev, True)
            return None
        if n >= 14336:  # M = 256: gate/up 20-22 % faster than dequantize + cuBLAS
            return _gemm(m, n, k, 128, 128, 64, 8, 4, dev, False) if fmt.bits == 4 else \
                _gemm(m, n, k, 128, 64, 128, 4, 3, dev, False)
        if k >= 8192:  # down 2-4 %
            return LaunchConfig("gemm", min(128, _pow2_at_least(m, 16)), 64, 1, 2 if (k // 128) % 2 == 0 else 1, 4, 3,
                                False, 128)
        return None
    if fmt.kind != "mxfp4" or fmt.group_size != 32:
        return None
    if m <= 64:  # 8-20 % at M = 16, 13-22 % at M = 64
        if m <= 16:
            return _gemm16(n, k, 4 if n >= 28672 else 8)
        if n <= 2048:
            return _gemm(m, n, k, 64, 64, 128, 4, 3, dev, True)
        if n * k <= 4096 * 4096:
            return None
        return _gemm(m, n, k, 64, 128, 64, 4, 3, dev, True)
    if m <= 256 and n * k >= 14336 * 4096:
        # M = 256 on an H100 (2026-12-07, the fused GEMM's variants, benchmarks/out/kernels-h100-gemm-variants.json):
        # 128 x 128 tiles, K tiles of 32, 8 warps, 4 stages beat dequantize + cuBLAS on gate+up (277 -> 235 us), down
        # (137 -> 119) and lm_head (1777 -> 909; the dequantized copy is 1 GB): step 0.47x -> 0.56x bf16; q/k/v and o
        # stay (56 -> 88, 39 -> 43 us)
        return _gemm(m, n, k, 128, 128, 32, 8, 4, dev, True)
    return None


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
    fused = _fused_gemm_config(fmt, m, n, k, dev)
    if fused is not None and valid_config(fused, fmt, m, n, k):
        return fused
    if m <= 64 or dev.name == "cpu":
        return _mm_config(fmt, m, n, k, dev)
    return LaunchConfig("dequant", 1, 64, max(1, 128 // fmt.group_size) if (k // fmt.group_size) % 2 == 0 else 1)


def gemv_candidates(fmt: KernelFormat, n: int, k: int, dev: DeviceInfo) -> list[LaunchConfig]:
    """GEMV configurations worth timing for a shape (the benchmark's sweep): rows a thread, warps, K split,
    (symmetric formats) K tiles of 32 words and prefetching, and (:func:`has_half2` formats) wide K tiles of 128
    and 256 words with the packed-fp16 products, a scale a word or a run of words (``scale_words``; ``pairs`` is left
    out: 1.1-2.8x slower on an H200), and the resident-activation GEMV's (:func:`resident_candidates`)."""
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
    if has_half2(fmt):  # wide K tiles, packed-fp16 products
        for words, block_n, warps, target, runs in itertools.product((128, 256), (16, 32, 64), (4, 8), (4, 8), (1, 4)):
            groups = max(1, words // wpg)
            split = _split_for(n_groups, groups, -(-n // block_n), target * dev.sm_count, 32)
            out.append(LaunchConfig("gemv", 1, block_n, groups, split, warps, 1, False, 0, True, runs))
    out += resident_candidates(fmt, n, k, dev)  # the resident-activation GEMV
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


def gemm_candidates(fmt: KernelFormat, m: int, n: int, k: int, dev: DeviceInfo) -> list[LaunchConfig]:
    """Fused dequant-GEMM configurations worth timing for a shape (the benchmark's sweep; M >= 16):
    token tiles up to 256, weight tiles of 64-128 rows, K tiles of 64 or 128 weights, 4 or 8 warps, and a
    K split where the output tiles are fewer than the multiprocessors; at M <= 16 every split 1-8 of 32-128-row
    tiles."""
    top = min(_pow2_at_least(m, 16), 256)
    tiles = ((64, 64, 128, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 128, 8, 3), (128, 64, 128, 4, 3),
             (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3))
    out = []
    for bm, bn, bk, warps, stages in tiles:
        bm = min(bm, top)
        for s in dict.fromkeys((1, _split_to(-(-m // bm) * -(-n // bn), k // bk, dev))):
            out.append(LaunchConfig("gemm", bm, bn, 1, s, warps, stages, False, bk))
    if m <= 16:  # every split at one token tile: the programs, not the SMs, decide (see _gemm16)
        for bn, bk, warps in ((32, 128, 4), (64, 128, 4), (64, 64, 4), (128, 128, 8), (128, 64, 4)):
            out += [LaunchConfig("gemm", 16, bn, 1, s, warps, 3, False, bk) for s in (1, 2, 4, 8)]
    out += gemm_variant_candidates(fmt, m, n, k, dev)
    out += gluon_candidates(fmt, m, n, k, dev)
    return [c for c in dict.fromkeys(out) if valid_config(c, fmt, m, n, k)]


def gluon_candidates(fmt: KernelFormat, m: int, n: int, k: int, dev: DeviceInfo) -> list[LaunchConfig]:
    """The Gluon GEMM's tiles worth timing on Hopper (none measured yet, none a default; empty elsewhere): token
    tiles of 64 (at M <= 64: one tile, K split 1-8 for a memory-bound shape) to 256 (at M = 256 every weight tile
    decoded once), 64-256 weight rows, K tiles of 64 or 128, 4-8 warps, 3-4 stages, a K split where the output
    tiles are fewer than the multiprocessors, the words one or two tiles ahead (``prefetch``). Offline sm_90
    compiles (Triton 3.6 and 3.9): no spills up to 256 x 128 x 128 and 128 x 256 x 64 (INT4 252 / 250 registers);
    256 x 256 spills."""
    if dev.capability[0] != 9:
        return []
    top = min(max(_pow2_at_least(m, 64), 64), 256)
    tiles = ((64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
             (128, 256, 64, 8, 4), (256, 128, 64, 8, 4), (256, 64, 128, 8, 3), (256, 128, 64, 8, 3))
    out = []
    for bm, bn, bk, warps, stages in tiles:
        bm = min(bm, top)
        splits = (1, 2, 4, 8) if m <= 64 else (1, _split_to(-(-m // bm) * -(-n // bn), k // bk, dev))
        for s in dict.fromkeys(splits):
            out += [LaunchConfig("gemm", bm, bn, 1, s, warps, stages, pf, bk, gluon=True) for pf in (False, True)]
    return [c for c in dict.fromkeys(out) if valid_config(c, fmt, m, n, k)]


def gemm_variant_candidates(fmt: KernelFormat, m: int, n: int, k: int, dev: DeviceInfo) -> list[LaunchConfig]:
    """The fused GEMM's operand and pipelining variants (``xa``, ``post_scale``, ``warp_spec``; none measured yet,
    none a default): at M <= 16 one 16-token tile, 64 or 128 weight rows, K splits 2-8, the codes' exact values
    with the scale on the product (K tiles of one group, at most 128) and / or the tokens as A, and K tiles of 256
    weights (with and without xa); above, token tiles of 128-256 over 64-128 weight rows, mostly K tiles of 32 (no
    spills), with and without the tokens as A, 128 registers on some (two programs a multiprocessor), 3-4 stages,
    and Triton's warp specialization on one."""
    out = []
    if m <= 16:
        bk = min(128, fmt.group_size)
        for bn, s, (xa, post) in itertools.product((64, 128), (2, 4, 8), ((False, True), (True, False), (True, True))):
            out.append(LaunchConfig("gemm", 16, bn, 1, s, 4, 3, False, bk, xa=xa, post_scale=post))
        for s, xa in itertools.product((2, 4, 8), (False, True)):  # more bytes of a row in flight a K tile
            out.append(LaunchConfig("gemm", 16, 64, 1, s, 4, 3, False, 256, xa=xa))
        return [c for c in out if valid_config(c, fmt, m, n, k)]
    top = min(_pow2_at_least(m, 16), 256)
    # (token tile, weight rows, K tile, warps, stages, xa, registers): offline sm_90 compiles (Triton 3.9) spill
    # at K tiles of 64 from 128 x 64 tokens x rows up (4 warps) and 256 x 64 (8 warps); K tiles of 32 do not, and
    # 128 x 128 x 32 on 8 warps fits 128 registers (two programs a multiprocessor); 128 x 256 with xa fails to compile
    tiles = ((128, 128, 64, 8, 3, True, 0), (256, 128, 32, 8, 4, True, 0), (256, 128, 32, 8, 4, False, 0),
             (256, 64, 32, 8, 4, True, 0), (256, 64, 32, 8, 4, True, 128), (256, 64, 32, 8, 4, False, 128),
             (128, 128, 32, 8, 4, True, 0), (128, 128, 32, 8, 4, True, 128), (128, 128, 32, 8, 3, False, 128),
             (128, 128, 32, 8, 4, False, 128), (128, 64, 32, 4, 4, True, 0), (128, 64, 32, 4, 4, False, 0))
    for bm, bn, bk, warps, stages, xa, regs in tiles:
        bm = min(bm, top)
        for s in dict.fromkeys((1, _split_to(-(-m // bm) * -(-n // bn), k // bk, dev))):
            out.append(LaunchConfig("gemm", bm, bn, 1, s, warps, stages, False, bk, xa=xa, max_regs=regs))
    # warp specialization: no partitions on sm_90 in Triton 3.9's compile of this loop (same code); one to confirm
    out.append(LaunchConfig("gemm", min(128, top), 128, 1, 1, 8, 4, False, 32, xa=True, warp_spec=True))
    return [c for c in dict.fromkeys(out) if valid_config(c, fmt, m, n, k)]
