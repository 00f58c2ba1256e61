"""2-bit grid i-quants IQ2_XXS, IQ2_XS and IQ2_S: super-blocks of 256 weights.

Each group of 8 weights is one point of a fixed codebook (values 8, 25, 43; 256, 512 or
1024 points, gguf-py's ``iq2xxs_grid``/``iq2xs_grid``/``iq2s_grid``, loaded once by
:func:`._lattice.gguf_grid`), with its own signs, times a sub-block scale
``db = d * (0.5 + s) * 0.25`` (``d`` the block's fp16 scale, ``s`` a 4-bit code). Layouts
follow llama.cpp ``ggml-common.h``:

=======  =====  ======================================================================
type     bytes  layout (offsets in bytes)
=======  =====  ======================================================================
IQ2_XXS  66     ``d`` (fp16); ``qs`` uint32[16]: for sub-block ``j`` (32 weights, 4
                groups), ``qs[2j]`` = the 4 groups' 8-bit grid indices (byte k: group k),
                ``qs[2j+1]`` = 4 x 7 sign bits (group k at bit 7k) | ``s`` << 28
IQ2_XS   74     ``d``; ``qs`` uint16[32]: group ``i`` = 9-bit grid index | 7 sign bits << 9;
                ``scales[8]``: sub-block ``j`` (16 weights, 2 groups) in nibble ``j % 2``
                of byte ``j // 2``
IQ2_S    82     ``d``; ``qs[32]`` low 8 bits of the 10-bit grid index of group ``i``;
                ``signs[32]`` 8 sign bits of group ``i``; ``qh[8]``: index bits 8-9 of
                group ``i`` at bits ``2 (i % 4)`` of byte ``i // 4``; ``scales[8]`` as IQ2_XS
=======  =====  ======================================================================

The 7 stored sign bits of IQ2_XXS/IQ2_XS are those of elements 0..6; element 7's is their
parity (``ksigns``), so a group always has an even number of negative values. Decoding
repeats gguf-py's float32 operations in the same order (``db * grid * sign``), so it equals
``gguf.quants.dequantize`` bit for bit.

Encoder (all blocks at once, torch on the input's device; minimises
``sum(w * (x - decode)**2)`` with ``w`` the importance it is given):

0. signs are those of ``x`` and codewords fit ``|x|``. With the parity constraint, a group
   with an odd number of negative weights must get one sign wrong; flipping element ``i``
   costs ``4 S w_i |x_i| g_i``, so codeword ``g`` costs its plain error plus
   ``4 S min_i w_i |x_i| g_i`` (:func:`._lattice.flip_penalty`, exact), and the flip is part
   of the codeword choice;
1. per sub-block a continuous scale ``S = max|x| / t``: 8 coarse ``t`` over [12, 100] on the
   whole codebook (:func:`._lattice.nearest_codewords`: one matmul per ``t`` in torch, one
   fused Triton kernel for all ``t`` on CUDA); each group's argmins there are its candidate
   codewords for steps 1-2; then 24 finer ``t`` and two least-squares refits on those
   candidates (:func:`._lattice.candidate_terms`, :func:`._lattice.subset_min_costs`, also
   fused on CUDA);
2. per block a batch of fp16 ``d`` (``8 max(S) / 31`` times 6 factors, then the
   least-squares ``d`` given the chosen codes and codewords, and its two fp16 neighbours);
   for each, every sub-block tries the 4 stored codes ``s`` nearest its continuous scale,
   under the exact stored scale; the best block total is kept;
3. under the stored scales, each group's codeword is the exact optimum over the whole
   codebook (with the optimal flip), so no group is ever left at a neighbourhood optimum.

On CPU the coarse scales of step 1 are five instead of eight (``cpu_search``); the parity
penalty (:func:`._lattice.flip_penalty`) is a running minimum with no indexing. With
:mod:`dynaquant.kernels` imported (and a C compiler) the three searches run as compiled C on CPU
tensors (:mod:`dynaquant.kernels.native.lattice`; the same bytes as the torch reference on the tests'
weights, 6-10x faster encodes).

With ``exhaustive = True`` (class attribute; a slower reference) every codeword is a
candidate in steps 1-2 too.

Speed (benchmarks/encode_speed.py, 4096 x 14336 synthetic weight, H100 vs llama.cpp's
``ggml_quantize_chunk`` on the machine's 16 CPU threads): IQ2_XXS 1.27 G weights/s (50-76x
llama.cpp's 17-25 M/s), IQ2_XS 1.02 G/s (84-114x its 9-12 M/s); the torch-only path on the
same GPU ran at 114 and 79 M/s. On CUDA a slice is the whole chunk the caller passes (no
(groups, G) tensor is held).

Without an imatrix (``quantize`` then passes a uniform importance, which carries no
information), the importance is llama.cpp's no-imatrix weighting of IQ2_S,
``0.25 sigma2 + x**2`` with ``sigma2 = 2 mean(x**2)`` over the block, for all three types
(llama.cpp itself refuses IQ2_XXS and IQ2_XS without an imatrix). A uniform imatrix is
treated the same way.

Measured quality, importance-weighted error ours / llama.cpp (``ggml_quantize_chunk`` with the
same imatrix; 9 dithered SmolLM2-135M tensors, 48 rows each, with the calibration imatrix
of tests/conftest.py; mean and worst tensor), and on synthetic Gaussian / Student-t weights
with a lognormal imatrix:

=======  ==============  ==============  ===================
type     SmolLM2 mean    SmolLM2 worst   synthetic (2 sets)
=======  ==============  ==============  ===================
IQ2_XXS  0.731           0.887           0.597, 0.701
IQ2_XS   0.749           0.875           0.609, 0.673
IQ2_S    0.779           0.895           0.652, 0.720
=======  ==============  ==============  ===================

(part of the gap is the objective: llama.cpp weights each error by
``imatrix * sqrt(sigma2 + x**2)``, not by the imatrix alone.)
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from dynaquant.quant.codecs import _lattice as lat
from dynaquant.quant.codecs.base import Codec, register
from dynaquant.quant.codecs.consts import device_constant
from dynaquant.quant.codecs.fastpaths import fast_path

QK_K = 256
GROUP = 8
N_GROUPS = QK_K // GROUP

FP16_MAX = 65504.0
# Candidate divisors t of a sub-block's max |x| for its first scale S = max|x| / t (the
# grid's largest value is 43; t < 43 clips the max, t > 43 leaves headroom). The coarse ones
# run on the whole codebook and pick each group's candidate codewords; the others run on
# those candidates only.
_COARSE_T = tuple(float(t) for t in np.geomspace(12.0, 100.0, 8))
_T_CANDIDATES = tuple(float(t) for t in np.geomspace(12.0, 100.0, 24))
# Factors applied to d = 8 max(S) / 31 (the largest sub-block at s = 15).
_D_FACTORS = (1.0, 0.96, 0.92, 0.88, 0.84, 0.78)


_KSIGNS: dict[str, torch.Tensor] = {}


def _ksigns(device) -> torch.Tensor:
    """(128,) int64: llama.cpp's ``ksigns_iq2xs`` (7 sign bits -> 8 with even parity), as
    gguf-py holds it; cached per device."""
    key = str(device)
    if key not in _KSIGNS:
        import gguf.quants

        _KSIGNS[key] = torch.frombuffer(bytearray(gguf.quants.IQ2_XXS.ksigns), dtype=torch.uint8).long().to(device)
    return _KSIGNS[key]


def _bits_of(pattern: torch.Tensor) -> torch.Tensor:
    """(...,) int64 8-bit patterns -> (..., 8) bool, bit i = element i."""
    return (pattern[..., None] >> torch.arange(8, device=pattern.device)) & 1 == 1


def _pattern_of(bits: torch.Tensor) -> torch.Tensor:
    """(..., 8) bool -> (...,) int64, inverse of :func:`_bits_of`."""
    return (bits.long() << torch.arange(8, device=bits.device)).sum(dim=-1)


def _le_bytes(v: torch.Tensor, n: int) -> torch.Tensor:
    """(..., k) int64 -> (..., k * n) uint8, each value little-endian in ``n`` bytes."""
    sh = torch.arange(0, 8 * n, 8, device=v.device)
    return ((v[..., None] >> sh) & 255).to(torch.uint8).reshape(*v.shape[:-1], -1)


def _from_le(b: torch.Tensor, n: int) -> torch.Tensor:
    """(..., k * n) uint8 -> (..., k) int64, inverse of :func:`_le_bytes`."""
    sh = torch.arange(0, 8 * n, 8, device=b.device)
    return (b.long().reshape(*b.shape[:-1], -1, n) << sh).sum(dim=-1)


def _sub_scale(d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Stored sub-block scale as gguf-py computes it: ``d * (0.5 + s) * 0.25`` in float32.

    d: (n, 1) float32 (fp16 values); s: (n, m) int64 -> (n, m) float32.
    """
    return d * (0.5 + s.to(torch.float32)) * 0.25


def stored_scale_costs_torch(
    b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, cont: torch.Tensor, offsets: torch.Tensor, gps: int, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's best stored code ``s`` near its continuous scale, for a batch of block scales (step 2 of
    the module docstring). Reference of fast path ``iq2.stored_scale_costs``.

    Args:
        b, c: (n n_sub gps, K) float32 terms of each group's candidate codewords (:func:`._lattice.candidate_terms`).
        d: (F, n) float32 block scales as stored (fp16 values, >= 0).
        cont: (n, n_sub) float32 continuous sub-block scales.
        offsets: (O,) int64 codes tried around ``floor((8 cont / d - 1) / 2)`` (clamped to 0..15).
        gps: groups a sub-block.
        backend: how the candidate costs run (:func:`._lattice.subset_min_costs`).
    Returns:
        (cost, s): (F, n, n_sub) float32 the sub-block's least cost (less ``sum(w x**2)``) over the offsets under
        the stored scale ``d (0.5 + s) / 4``, and (F, n, n_sub) int64 its code (the first offset on a tie).
    """
    d = d[..., None]  # (F, n, 1)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    s = (torch.floor((8.0 * cont / safe - 1.0) * 0.5).to(torch.int64) + offsets[:, None, None, None]).clamp(0, 15)
    scale = _sub_scale(d, s)  # (O, F, n, n_sub)
    cost = lat.subset_min_costs(b, c, scale.reshape(*scale.shape[:2], -1), backend, gps).view(s.shape)
    sub_best, o = cost.min(dim=0)  # (F, n, n_sub)
    return sub_best, s.gather(0, o[None])[0]


def stored_scale_costs(
    b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, cont: torch.Tensor, offsets: torch.Tensor, gps: int, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stored_scale_costs_torch`, or its fast path (a Triton kernel; sub-blocks of 2 groups) as ``backend``
    chooses (:func:`._lattice.fast_path`); the compiled CPU path runs the reference on its compiled costs."""
    kernel = fast_path("iq2.stored_scale_costs", b, backend) if gps == 2 and backend in ("auto", "triton") else None
    if kernel is not None:
        return kernel(b, c, d, cont, offsets, gps)
    return stored_scale_costs_torch(b, c, d, cont, offsets, gps, backend)


class _IQ2(Codec):
    """Shared encoder/decoder of the three IQ2 grid types (subclasses set the layout).

    ``encode_blocks(x, w)``: x, w (n_blocks, 256) float32 (w >= 0) -> (n_blocks, type_size)
    uint8; ``decode_blocks(b)``: (n_blocks, type_size) uint8 -> (n_blocks, 256) float32.
    Both raise ValueError on other shapes or dtypes. These are vector quantizers: there is no
    per-weight rounding, so :meth:`fit_params`/:meth:`round_to_grid` raise NotImplementedError
    (GPTQ cannot use them).
    """

    grid_name: ClassVar[str]
    sub_len: ClassVar[int]  # weights per sub-block scale
    parity: ClassVar[bool]  # the 8th sign bit is the parity of the other 7
    fast_paths = True
    # search knobs (module docstring)
    t_candidates: ClassVar[tuple[float, ...]] = _T_CANDIDATES
    n_refine: ClassVar[int] = 2
    coarse_t: ClassVar[tuple[float, ...]] = _COARSE_T
    exhaustive: ClassVar[bool] = False  # every codeword at every candidate scale (slow, memory-hungry reference)
    d_factors: ClassVar[tuple[float, ...]] = _D_FACTORS
    s_offsets: ClassVar[tuple[int, ...]] = (-1, 0, 1, 2)
    # The CPU search: overrides of the knobs above. Five coarse scales instead of eight (each a
    # full-codebook pass, most of the CPU time; three cost 5-9% error against the exhaustive
    # candidate search of tests/test_codecs_iq2.py, five about 1%). Other devices run eight.
    cpu_search: ClassVar[dict] = {"coarse_t": tuple(float(t) for t in np.geomspace(12.0, 100.0, 5))}

    def _knob(self, name: str, device: torch.device):
        """Search knob ``name`` for a search on ``device`` (:attr:`cpu_search` on CPU)."""
        if device.type == "cpu" and name in self.cpu_search:
            return self.cpu_search[name]
        return getattr(self, name)

    # ------------------------------------------------------------------ layout (subclasses)

    def _pack(self, d16: torch.Tensor, s: torch.Tensor, idx: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """(n,) float16, (n, n_sub) int64 in 0..15, (n, 32) int64 grid indices, (n, 32) int64
        8-bit sign patterns (even parity where the format demands) -> (n, type_size) uint8."""
        raise NotImplementedError

    def _unpack(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`_pack`: d (n, 1) float32, s (n, n_sub), idx (n, 32), patterns (n, 32)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ public

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, *, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """Encode (n, 256) blocks (class docstring); ``backend`` and ``variant`` choose how the
        codeword searches run (:func:`._lattice.fast_path`, :func:`._lattice.nearest_codewords`):
        the default runs the fused Triton kernels on CUDA and the compiled C searches on CPU when
        :mod:`dynaquant.kernels` has registered them, else the torch reference."""
        if x.ndim != 2 or x.shape[1] != QK_K or w.shape != x.shape:
            raise ValueError(
                f"{self.format_name}: expected x and w of shape (n_blocks, 256), got {tuple(x.shape)} and {tuple(w.shape)}"
            )
        x = x.to(torch.float32)
        w = w.to(device=x.device, dtype=torch.float32)
        if w.numel():  # a torch.where on the device: no host sync
            w = torch.where((w == w.reshape(-1)[0]).all(), self.default_importance(x), w)
        grid = lat.gguf_grid(self.grid_name, x.device)
        # The fused search (CUDA + Triton, or compiled C on CPU) holds no (groups, G) tensor: the largest temporaries
        # are (candidates x groups x 8), so the chunk the caller passes is one slice.
        step = max(1, x.shape[0]) if lat.fused(x, backend) else lat.group_chunk(N_GROUPS, grid.shape[0], x.device)
        out = [
            self._pack(*self._search(x[i : i + step], w[i : i + step], grid, backend, variant)) for i in range(0, x.shape[0], step)
        ]
        if not out:
            return torch.empty(0, self.format.type_size, dtype=torch.uint8, device=x.device)
        return torch.cat(out, dim=0)

    def default_importance(self, x: torch.Tensor) -> torch.Tensor:
        """llama.cpp's no-imatrix weighting (IQ2_S's): ``0.25 sigma2 + x**2``, ``sigma2 = 2 mean(x**2)``.

        x: (n, 256) float32 -> (n, 256) float32 (> 0 unless the whole block is zero; a zero
        block gets ones).
        """
        sigma2 = 2.0 * (x * x).mean(dim=1, keepdim=True)
        w = 0.25 * sigma2 + x * x
        return torch.where(sigma2 > 0, w, torch.ones_like(w))

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        ts = self.format.type_size
        if b.dtype != torch.uint8 or b.ndim != 2 or b.shape[1] != ts:
            raise ValueError(f"{self.format_name}: expected (n_blocks, {ts}) uint8, got {tuple(b.shape)} {b.dtype}")
        n = b.shape[0]
        d, s, idx, pattern = self._unpack(b)
        grid = lat.gguf_grid(self.grid_name, b.device)
        db = _sub_scale(d, s).repeat_interleave(self.sub_len // GROUP, dim=1)  # (n, 32)
        vals = db[:, :, None] * grid[idx]  # (n, 32, 8)
        sign = torch.where(_bits_of(pattern), -1.0, 1.0)
        return (vals * sign).reshape(n, QK_K)

    # ------------------------------------------------------------------ search

    def _search(self, x: torch.Tensor, w: torch.Tensor, grid: torch.Tensor, backend: str = "auto", variant: str | None = None):
        """Best (d16, s, idx, sign pattern) of (n, 256) blocks; see the module docstring
        (``backend``, ``variant``: as :meth:`encode_blocks`).

        Returns d16 (n,) float16, s (n, n_sub) int64, idx (n, 32) int64, patterns (n, 32) int64.
        """
        n = x.shape[0]
        gps = self.sub_len // GROUP  # groups per sub-block
        n_sub = QK_K // self.sub_len
        xg, wg = x.reshape(-1, GROUP), w.reshape(-1, GROUP)
        a = xg.abs()
        neg = xg < 0
        wa = wg * a
        odd = ((neg.sum(dim=1) % 2) == 1) if self.parity else None  # groups that must flip one sign
        amax = a.reshape(-1, self.sub_len).amax(dim=1)

        def sub_sum(cost: torch.Tensor) -> torch.Tensor:  # (..., groups) -> (..., sub-blocks)
            return lat.last_sum(cost.view(*cost.shape[:-1], -1, gps))

        def sub_cost(scale_sub: torch.Tensor, bb: torch.Tensor, cc: torch.Tensor, want_idx: bool = False):
            if not want_idx:
                return lat.subset_min_costs(bb, cc, scale_sub, backend, gps), None
            cost, idx = lat.scaled_costs(bb, cc, scale_sub.repeat_interleave(gps), want_idx)
            return sub_sum(cost), idx

        def keep_better(sc, cost, best_s, best_c):
            better = cost < best_c
            return torch.where(better, sc, best_s), torch.where(better, cost, best_c)

        # 1. continuous sub-block scales S = max|x| / t. S = 0 (all zero) costs 0 and starts
        # the search. The coarse t run on the whole codebook; each group's argmins there are
        # its candidate codewords for everything up to the final pass (or, with
        # ``exhaustive``, every codeword is a candidate).
        best_s, best_c = torch.zeros_like(amax), torch.zeros_like(amax)
        sc = amax[None, :] / device_constant(self._knob("coarse_t", x.device), torch.float32, x.device)[:, None]  # (T, sub-blocks)
        cost, picks = lat.nearest_codewords(a, wg, grid, sc.repeat_interleave(gps, dim=1), odd, backend, variant)  # (T, groups)
        cost = sub_sum(cost)
        pick = cost.argmin(dim=0, keepdim=True)
        best_s, best_c = keep_better(sc.gather(0, pick)[0], cost.gather(0, pick)[0], best_s, best_c)
        cand = torch.arange(grid.shape[0], device=x.device).expand(a.shape[0], -1) if self.exhaustive else picks.T
        if self.exhaustive:
            bk, ck = lat.subset_terms(a, wg, grid, cand)
            rows = odd.nonzero().squeeze(1) if self.parity else cand[:0, 0]
            if rows.numel():
                bk[rows] -= 2.0 * lat.flip_penalty(wa[rows], grid)
        else:  # (groups, K) terms of the candidates, the parity flip in bk
            bk, ck = lat.candidate_terms(a, wg, grid, cand, odd, backend)
        # all fine t at once: (T, sub-blocks)
        sc = amax[None, :] / device_constant(self.t_candidates, torch.float32, x.device)[:, None]
        cost = lat.subset_min_costs(bk, ck, sc, backend, gps)
        pick = cost.argmin(dim=0, keepdim=True)
        best_s, best_c = keep_better(sc.gather(0, pick)[0], cost.gather(0, pick)[0], best_s, best_c)
        for _ in range(self.n_refine):
            _, idx = sub_cost(best_s, bk, ck, want_idx=True)
            sc = lat.lsq_scale(bk.gather(1, idx[:, None]).view(-1, gps), ck.gather(1, idx[:, None]).view(-1, gps))
            best_s, best_c = keep_better(sc, sub_cost(sc, bk, ck)[0], best_s, best_c)

        # 2. block scale d (fp16) and stored sub-block codes s: for a batch of candidate d
        # (F, n), every sub-block tries the codes s nearest its continuous scale.
        cont = best_s.view(n, n_sub)
        offsets = device_constant(self.s_offsets, torch.int64, x.device)  # (O,)

        def try_d(d: torch.Tensor):
            """d: (F, n) float32 -> (total (F, n), d as stored (F, n), s (F, n, n_sub)), best s per d."""
            d = d.clamp(0, FP16_MAX).to(torch.float16).to(torch.float32)  # (F, n) as stored
            sub_best, s = stored_scale_costs(bk, ck, d, cont, offsets, gps, backend)  # (F, n, n_sub)
            return sub_best.sum(dim=2), d, s

        def keep_block(total, d, s, blk):
            f = total.argmin(dim=0, keepdim=True)  # (1, n)
            cand_t, cand_d = total.gather(0, f)[0], d.gather(0, f)[0]
            cand_s = s.gather(0, f[..., None].expand(1, n, n_sub))[0]
            if blk is None:
                return cand_t, cand_d, cand_s
            better = cand_t < blk[0]
            return (
                torch.where(better, cand_t, blk[0]),
                torch.where(better, cand_d, blk[1]),
                torch.where(better[:, None], cand_s, blk[2]),
            )

        smax = cont.amax(dim=1)
        factors = device_constant(self.d_factors, torch.float32, x.device)[:, None]
        blk = keep_block(*try_d(smax[None, :] * (8.0 / 31.0) * factors), None)
        # least-squares d given the chosen codes and codewords, and its fp16 neighbours
        _, blk_d, blk_s = blk
        _, idx = sub_cost(_sub_scale(blk_d[:, None], blk_s).reshape(-1), bk, ck, want_idx=True)
        u = ((2 * blk_s + 1).to(torch.float32) / 8.0).reshape(-1)  # S = d * u
        bs = lat.last_sum(bk.gather(1, idx[:, None]).view(-1, gps)) * u
        cs = lat.last_sum(ck.gather(1, idx[:, None]).view(-1, gps)) * u * u
        num, den = bs.view(n, n_sub).sum(dim=1), cs.view(n, n_sub).sum(dim=1)
        d_ls = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), blk_d).clamp_min(0)
        bits = d_ls.clamp(0, FP16_MAX).to(torch.float16).view(torch.int16)
        near = torch.stack([(bits + k).clamp(0, 0x7BFF).view(torch.float16) for k in (0, -1, 1)]).to(torch.float32)
        _, blk_d, blk_s = keep_block(*try_d(near), blk)

        # 3. final codewords (whole codebook) and signs under the stored scales.
        scale = _sub_scale(blk_d[:, None], blk_s).reshape(-1).repeat_interleave(gps)
        _, idx = lat.nearest_codewords(a, wg, grid, scale, odd, backend, variant)
        if self.parity:
            flip = (wa * grid[idx]).argmin(dim=1)
            neg = neg ^ (odd[:, None] & (torch.arange(GROUP, device=x.device) == flip[:, None]))
        return blk_d.to(torch.float16), blk_s, idx.view(n, N_GROUPS), _pattern_of(neg).view(n, N_GROUPS)


@register
class IQ2_XXS(_IQ2):
    """IQ2_XXS (``block_iq2_xxs``, 2.0625 bpw): 66 bytes = fp16 ``d`` + uint32 ``qs[16]``.

    Sub-blocks of 32 weights (4 groups of 8) with a 4-bit scale; 256-point grid; 7 sign bits
    per group, the 8th their parity (module docstring).
    """

    format_name = "IQ2_XXS"
    grid_name = "IQ2_XXS"
    sub_len = 32
    parity = True

    def _pack(self, d16, s, idx, neg):
        n = idx.shape[0]
        sub_idx = idx.view(n, 8, 4).to(torch.uint8)  # bytes of qs[2j]
        s7 = (neg & 127).view(n, 8, 4)
        aux = (s7 << device_constant((0, 7, 14, 21), torch.int64, idx.device)).sum(dim=2) | (s << 28)  # (n, 8)
        words = torch.cat([sub_idx, _le_bytes(aux, 4).view(n, 8, 4)], dim=2).reshape(n, 64)
        return torch.cat([d16.contiguous().view(torch.uint8).reshape(n, 2), words], dim=1)

    def _unpack(self, b):
        n = b.shape[0]
        d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
        q = b[:, 2:].reshape(n, 8, 8)
        idx = q[:, :, :4].long().reshape(n, 32)
        aux = _from_le(q[:, :, 4:].reshape(n, 32), 4)  # (n, 8)
        s = aux >> 28
        s7 = (aux[:, :, None] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127
        return d, s, idx, _ksigns(b.device)[s7.reshape(n, 32)]


@register
class IQ2_XS(_IQ2):
    """IQ2_XS (``block_iq2_xs``, 2.3125 bpw): 74 bytes = fp16 ``d`` + uint16 ``qs[32]`` + ``scales[8]``.

    Sub-blocks of 16 weights (2 groups) with a 4-bit scale; 512-point grid; 7 sign bits per
    group, the 8th their parity (module docstring).
    """

    format_name = "IQ2_XS"
    grid_name = "IQ2_XS"
    sub_len = 16
    parity = True

    def _pack(self, d16, s, idx, neg):
        n = idx.shape[0]
        qs = _le_bytes(idx | ((neg & 127) << 9), 2)  # (n, 64)
        sc = (s[:, 0::2] | (s[:, 1::2] << 4)).to(torch.uint8)
        return torch.cat([d16.contiguous().view(torch.uint8).reshape(n, 2), qs, sc], dim=1)

    def _unpack(self, b):
        n = b.shape[0]
        d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
        q = _from_le(b[:, 2:66], 2)  # (n, 32)
        sc = b[:, 66:74].long()
        s = torch.stack([sc & 15, sc >> 4], dim=2).reshape(n, 16)
        return d, s, q & 511, _ksigns(b.device)[q >> 9]


@register
class IQ2_S(_IQ2):
    """IQ2_S (``block_iq2_s``, 2.5625 bpw): 82 bytes = fp16 ``d`` + ``qs[64]`` + ``qh[8]`` + ``scales[8]``.

    Sub-blocks of 16 weights (2 groups) with a 4-bit scale; 1024-point grid; 8 free sign bits
    per group (module docstring).
    """

    format_name = "IQ2_S"
    grid_name = "IQ2_S"
    sub_len = 16
    parity = False

    def _pack(self, d16, s, idx, neg):
        n = idx.shape[0]
        lo = (idx & 255).to(torch.uint8)
        hi = ((idx >> 8) & 3).view(n, 8, 4)
        qh = (hi << device_constant((0, 2, 4, 6), torch.int64, idx.device)).sum(dim=2).to(torch.uint8)
        sc = (s[:, 0::2] | (s[:, 1::2] << 4)).to(torch.uint8)
        return torch.cat([d16.contiguous().view(torch.uint8).reshape(n, 2), lo, neg.to(torch.uint8), qh, sc], dim=1)

    def _unpack(self, b):
        n = b.shape[0]
        d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
        lo = b[:, 2:34].long()
        signs = b[:, 34:66].long()
        qh = b[:, 66:74].long()
        hi = ((qh[:, :, None] >> torch.tensor([0, 2, 4, 6], device=b.device)) & 3).reshape(n, 32)
        sc = b[:, 74:82].long()
        s = torch.stack([sc & 15, sc >> 4], dim=2).reshape(n, 16)
        return d, s, lo | (hi << 8), signs
