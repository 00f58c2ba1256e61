"""Hopper (sm_90) fused dequant-GEMM in Gluon: the next weight tile decodes while the tensor cores multiply this one.

``y (M, N) = x (M, K) @ dequant(W).T`` on the layout of :mod:`dynaquant.kernels.packing`, for M >= 64 token rows
(``LaunchConfig(path="gemm", gluon=True)``; off by default until measured). The Triton kernel of
:mod:`dynaquant.kernels.triton_gemm` waits for every ``wgmma`` before it decodes the next tile
(``wgmma.wait_group 0``; NOTES.md, "Fused GEMM variants"), so a program's decode and its matrix multiply never
overlap. This kernel is written in Gluon (Triton's explicit-layout dialect) to control that order. A program owns a
(BLOCK_M tokens) x (BLOCK_N weight rows) output tile and walks its K slice in tiles of BLOCK_K:

- the activations' tiles come by TMA (``STAGES`` shared-memory slots, one mbarrier each, ``STAGES - 2`` tiles
  ahead), zero-filled past M;
- the packed words (and scales, zeros, INT3's high-bit plane) of tile ``i + 1`` (``i + 2`` with ``cfg.prefetch``:
  the loads' latency can exceed one tile's MMA) are loaded into registers while tile ``i`` decodes, with the
  decoders of the Triton path (:func:`dynaquant.kernels.triton_gemm.scaled_tile`: the same
  ``round((code - zero) * scale)`` weight values as dequantize-then-cuBLAS);
- the decoded tile is stored to one of three shared-memory slots in the ``wgmma`` operand layout (NVMMA swizzle),
  fenced for the async proxy, and every warp passes one barrier;
- ``acc (BLOCK_M, BLOCK_N) += X_tile @ W_tile^T`` is issued asynchronously (``warpgroup_mma``, x from shared memory
  as A, the weight tile's transposed view as B) and waited for only down to one in flight: tile ``i``'s ``wgmma``
  runs while tile ``i + 1`` decodes. Slot reuse: a weight slot is rewritten three tiles later and an activation
  slot refilled ``STAGES - 2`` tiles ahead, both after the barrier that follows every warp group's wait for the
  ``wgmma`` two tiles back.

The float32 accumulator is multiplied by the format's output multiplier (NVFP4's global scale) and stored; a K
split (``split_k``) reduces float32 partials in a workspace, the last program of a tile adding them (the counters
of ``PackedWeight.counters``, reset for the next call), as the Triton path does. Only the float32 summation order
differs from dequantize-then-cuBLAS.

Needs Triton's Gluon (3.5+) and a CUDA device of compute capability 9.x; bf16 / fp16 activations whose rows are
16-byte aligned (TMA). Imported lazily by :func:`dynaquant.kernels.linear`. :func:`compile_sm90`
compiles it without a GPU (the CPU tests' check that it builds, and builds pipelined).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dynaquant.kernels.packing import PackedWeight
from dynaquant.kernels.triton_gemm import scaled_tile, store_tile, tile_words
from dynaquant.kernels.triton_linear import (
    MAGIC,
    call_buffers,
    format_constants,
    out_multiplier,
)
from dynaquant.kernels.tuning import LaunchConfig

# TMA's global-to-shared copy: ``async_load`` from Triton 3.7 (3.9 removed the old name), ``async_copy_global_to_shared``
# before (the device's 3.6)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a CTA-wide barrier: ``thread_barrier`` to Triton 3.6, ``barrier`` in 3.9
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _words(qw_ptr, qh_ptr, s_ptr, z_ptr, row, rw, t, KW, KH, NG, KIND: gl.constexpr, BITS: gl.constexpr,
           ASYM: gl.constexpr, ZC: gl.constexpr, KWT: gl.constexpr, WPG: gl.constexpr, ONE_GROUP: gl.constexpr):
    """:func:`~dynaquant.kernels.triton_gemm.tile_words` and the zero offsets: the loaded zeros, or the symmetric
    constant as a tensor (a loop-carried value keeps its type)."""
    w, goff, sc, hsrc = tile_words(qw_ptr, qh_ptr, s_ptr, row, rw, t, KW, KH, NG, KIND, BITS, KWT, WPG, ONE_GROUP)
    if ASYM:
        zoff = gl.load(z_ptr + goff).to(gl.float32)
    else:
        zoff = gl.full(sc.shape, ZC, gl.float32, sc.type.layout)
    return w, sc, zoff, hsrc


@gluon.jit
def _gluon_gemm_kernel(x_desc, qw_ptr, qh_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                       M, N, KW, KH, NG, stride_ym, out_mul, magic, NKT,
                       KIND: gl.constexpr, BITS: gl.constexpr, G: gl.constexpr, ASYM: gl.constexpr, ZC: gl.constexpr,
                       HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                       AHEAD: gl.constexpr, WORD_LAYOUT: gl.constexpr, W_LAYOUT: gl.constexpr, MMA_LAYOUT: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    DT: gl.constexpr = x_desc.dtype
    EPW: gl.constexpr = 16 if BITS == 3 else 32 // BITS
    WPG: gl.constexpr = G // EPW  # words a group
    KWT: gl.constexpr = BLOCK_K // EPW  # words a K tile
    ONE_GROUP: gl.constexpr = KWT <= WPG
    pid_m = gl.program_id(0)  # fastest: the programs of one weight tile run together
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    off_m = pid_m * BLOCK_M
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WORD_LAYOUT))
    row = gl.minimum(rn, N - 1)[:, None]
    rw = gl.arange(0, KWT, layout=gl.SliceLayout(0, WORD_LAYOUT))
    t0 = pid_k * NKT
    gl.assume(NKT > 0)  # no zero-trip path: it would redefine the accumulator after the wgmmas (ptxas serializes them)

    x_smem = gl.allocate_shared_memory(DT, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(DT, [3, BLOCK_N, BLOCK_K], W_LAYOUT)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    for b in gl.static_range(STAGES - 2):  # the first activation tiles
        mbarrier.expect(bars.index(b), x_desc.block_type.nbytes, pred=b < NKT)
        _tma_load(x_desc, [off_m, (t0 + b) * BLOCK_K], bars.index(b), x_smem.index(b), pred=b < NKT)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA_LAYOUT)
    w, sc, zoff, hsrc = _words(qw_ptr, qh_ptr, s_ptr, z_ptr, row, rw, t0, KW, KH, NG, KIND, BITS, ASYM, ZC, KWT, WPG,
                               ONE_GROUP)
    if AHEAD == 2:  # tile 1's words too (tile 0's again where there is one tile)
        w1, sc1, zoff1, hsrc1 = _words(qw_ptr, qh_ptr, s_ptr, z_ptr, row, rw, t0 + gl.minimum(1, NKT - 1), KW, KH, NG,
                                       KIND, BITS, ASYM, ZC, KWT, WPG, ONE_GROUP)
    for i in range(NKT):
        # tile i + AHEAD's words in flight (past the end the last tile reloads itself: no branch in the carried values)
        tn = t0 + gl.minimum(i + AHEAD, NKT - 1)
        w_n, sc_n, zoff_n, hsrc_n = _words(qw_ptr, qh_ptr, s_ptr, z_ptr, row, rw, tn, KW, KH, NG, KIND, BITS, ASYM, ZC,
                                           KWT, WPG, ONE_GROUP)
        wt = scaled_tile(w, hsrc, zoff, sc, magic, KIND, BITS, EPW, DT)  # [BLOCK_N, BLOCK_K]
        w_slot = w_smem.index(i % 3)
        w_slot.store(wt)
        fence_async_shared()
        _cta_barrier()  # every warp group has stored its part and waited for the wgmma of tile i - 2
        j = i + STAGES - 2
        sj = j % STAGES
        mbarrier.expect(bars.index(sj), x_desc.block_type.nbytes, pred=j < NKT)
        _tma_load(x_desc, [off_m, (t0 + j) * BLOCK_K], bars.index(sj), x_smem.index(sj), pred=j < NKT)
        si = i % STAGES
        mbarrier.wait(bars.index(si), (i // STAGES) & 1)
        acc = warpgroup_mma(x_smem.index(si), w_slot.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if AHEAD == 2:
            w, sc, zoff, hsrc = w1, sc1, zoff1, hsrc1
            w1, sc1, zoff1, hsrc1 = w_n, sc_n, zoff_n, hsrc_n
        else:
            w, sc, zoff, hsrc = w_n, sc_n, zoff_n, hsrc_n
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))

    out = acc * out_mul
    ym = (off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA_LAYOUT)))[:, None]
    yn = (pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA_LAYOUT)))[None, :]
    store_tile(out, ym, yn, pid_m * gl.cdiv(N, BLOCK_N) + pid_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, cnt_ptr, stride_ym,
               HAS_BIAS, SPLIT_K)


def _gl_dtype(dtype: torch.dtype):
    if dtype == torch.bfloat16:
        return gl.bfloat16
    if dtype == torch.float16:
        return gl.float16
    raise ValueError(f"the Gluon GEMM takes bfloat16 or float16 activations, not {dtype}")


def layouts(cfg: LaunchConfig, bits: int, dtype: torch.dtype) -> dict:
    """The kernel's constexpr layouts for a launch configuration: the packed words' register layout (a row's words
    across up to 32 lanes, rows across the rest and the warps), the decoded tile's shared layout and the
    ``wgmma`` accumulator's (warp groups stacked along the tokens while the token tile allows, the instruction's N
    as wide as the weight tile allows: Gluon's Hopper tutorial's rule).

    Raises ValueError for fewer than 4 warps (a warp group) or a token tile under 64 (``wgmma``'s M)."""
    if cfg.num_warps < 4 or cfg.num_warps % 4 or cfg.block_m < 64:
        raise ValueError(f"the Gluon GEMM needs whole warp groups and token tiles of 64+: {cfg}")
    epw = 16 if bits == 3 else 32 // bits
    kwt = cfg.block_k // epw
    tk = min(kwt, 32)
    word = gl.BlockedLayout([1, 1], [32 // tk, tk], [cfg.num_warps, 1], [1, 0])
    warps = [4, 1]
    while warps[0] * warps[1] != cfg.num_warps:
        if cfg.block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n_reps = -(-cfg.num_warps // -(-cfg.block_m // 16))
    max_n = max(cfg.block_n // n_reps, 8)
    instr_n = 256
    while instr_n > max_n or cfg.block_n % instr_n:
        instr_n -= 8
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, instr_n, 16])
    w = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], _gl_dtype(dtype))
    return dict(WORD_LAYOUT=word, W_LAYOUT=w, MMA_LAYOUT=mma)


def x_layout(cfg: LaunchConfig, dtype: torch.dtype):
    """The activations' tile layout in shared memory (TMA's and ``wgmma``'s A): NVMMA, the widest swizzle."""
    return gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], _gl_dtype(dtype))


def _constexprs(cfg: LaunchConfig, packed: PackedWeight, dtype: torch.dtype, has_bias: bool) -> dict:
    """The kernel's compile-time arguments for a launch configuration, weight format and activation dtype."""
    return dict(HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, SPLIT_K=cfg.split_k, STAGES=cfg.num_stages,
                AHEAD=2 if cfg.prefetch else 1, **layouts(cfg, packed.fmt.bits, dtype), **format_constants(packed))


def _launch(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig):
    if not (x2.is_cuda and torch.cuda.get_device_capability(x2.device)[0] == 9):
        raise ValueError(f"the Gluon GEMM runs on CUDA devices of compute capability 9.x, not on {x2.device}")
    if cfg.num_stages < 3:
        raise ValueError(f"the Gluon GEMM needs num_stages >= 3 (activation tiles {cfg.num_stages} - 2 ahead): {cfg}")
    m, k = x2.shape
    n = packed.out_features
    split = cfg.split_k
    kw, kh, ng, y, ws, qh, z, b = call_buffers(x2, packed, bias, split)
    if x2.data_ptr() % 16 or (x2.stride(0) * x2.element_size()) % 16:
        x2 = x2.clone()  # TMA: 16-byte aligned base and rows
    x_desc = TensorDescriptor.from_tensor(x2, [cfg.block_m, cfg.block_k], x_layout(cfg, x2.dtype))
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    args = (x_desc, packed.qweight, qh, packed.scales, z, b, y, ws, packed.counters, m, n, kw, kh, ng, y.stride(0),
            out_multiplier(packed, False), MAGIC, k // cfg.block_k // split)
    return grid, args, dict(_constexprs(cfg, packed, x2.dtype, bias is not None), num_warps=cfg.num_warps), y


def run_gluon_gemm(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> torch.Tensor:
    """``x2 (M, K) @ dequant(W).T + bias`` (M, N) in x2's dtype, by the Gluon kernel (``cfg.gluon``).

    Args:
        x2: (M, K) bfloat16 / float16 on a CUDA device of compute capability 9.x, rows contiguous.
        packed: the weight (N, K), any runtime format (super weights are the caller's).
        bias: (N,) or None.
        cfg: a ``gemm`` configuration that :func:`dynaquant.kernels.tuning.valid_config` accepts, with
            ``num_warps`` a multiple of 4, ``block_m >= 64`` and ``num_stages >= 3``.
    Raises:
        ValueError: the configuration or the activations' dtype does not fit the kernel."""
    grid, args, kwargs, y = _launch(x2, packed, bias, cfg)
    _gluon_gemm_kernel[grid](*args, **kwargs)
    return y


def compile_gluon_gemm(x2: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, cfg: LaunchConfig) -> None:
    """Compile (without running) the kernel :func:`run_gluon_gemm` would launch."""
    grid, args, kwargs, _ = _launch(x2, packed, bias, cfg)
    _gluon_gemm_kernel.warmup(*args, grid=grid, **kwargs)


_PTR = {torch.int32: "*i32", torch.uint8: "*u8", torch.float16: "*fp16", torch.bfloat16: "*bf16",
        torch.float32: "*fp32"}


def compile_sm90(packed: PackedWeight, m: int, cfg: LaunchConfig, dtype: torch.dtype = torch.bfloat16,
                 bias: bool = False):
    """Compile the kernel for sm_90 without a GPU (``triton.compile`` on the Gluon source, the launch's argument
    types and constexprs): the CompiledKernel, whose ``asm`` holds ``ttgir``, ``ptx`` and ``cubin``. ``packed``
    supplies the dtypes and format only (its tensors may live on the CPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    class _Desc:  # a stand-in for the activations (TMA descriptors read the base's dtype and address only)
        def __init__(self):
            self.dtype = dtype

        def data_ptr(self):
            return 0

    k = packed.in_features
    desc = TensorDescriptor(_Desc(), [m, k], [k, 1], [cfg.block_m, cfg.block_k], x_layout(cfg, dtype))
    qh = packed.qweight_hi if packed.qweight_hi is not None else packed.qweight
    z = packed.zeros if packed.zeros is not None else packed.scales
    sig = {"x_desc": mangle_type(desc), "qw_ptr": _PTR[packed.qweight.dtype], "qh_ptr": _PTR[qh.dtype],
           "s_ptr": _PTR[packed.scales.dtype], "z_ptr": _PTR[z.dtype], "b_ptr": _PTR[dtype], "y_ptr": _PTR[dtype],
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "KW": "i32", "KH": "i32", "NG": "i32",
           "stride_ym": "i32", "out_mul": "fp32", "magic": "i32", "NKT": "i32"}
    constexprs = _constexprs(cfg, packed, dtype, bias)
    sig.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(_gluon_gemm_kernel, sig, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
