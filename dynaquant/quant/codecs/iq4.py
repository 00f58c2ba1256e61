"""IQ4_XS: IQ4_NL's non-linear 4-bit grid on super-blocks of 256 with 6-bit sub-block scales.

Layout (llama.cpp ``ggml-common.h``, ``block_iq4_xs``, 136 bytes, 4.25 bpw):

======  =====  =================================================================
offset  bytes  field
======  =====  =================================================================
0       2      ``d`` (fp16) super-block scale
2       2      ``scales_h`` (uint16 LE): bits ``2j, 2j+1`` = high 2 bits of ``l_j + 32``
4       4      ``scales_l``: byte ``j // 2``, nibble ``j % 2`` = low 4 bits of ``l_j + 32``
8       128    ``qs``: sub-block ``j`` (32 weights) owns bytes ``16 j .. 16 j + 15``; byte
               ``i`` holds element ``32 j + i`` (low nibble) and ``32 j + 16 + i`` (high)
======  =====  =================================================================

Decoded weight: ``y = (d * l_j) * kvalues_iq4nl[q]`` with ``l_j`` in ``-32..31``, in
float32 in that order (as ``gguf.quants.IQ4_XS``, so decode equals it bit for bit).

The encoder minimises ``sum(w * (x - y)**2)`` per super-block, batched over all blocks:

1. per sub-block of 32, the best continuous scale ``A_j``: IQ4_NL's candidate search
   (:func:`._blockfit.fit_scale`: scales that map the max to either end of the grid,
   clipping candidates, scales that put the most important weight on a level, least-
   squares refits), then ``A_j`` refit by weighted least squares to its codes;
2. the fp16 ``d``: ``+-max|A| / t`` for many ``t`` (both signs: the grid is asymmetric and
   ``l`` reaches -32 but only +31), each with the better integer ``l_j`` (floor or ceil of
   ``A_j / d``), ranked by the codes' quadratic error ``Sqq_j (d l_j - A_j)**2``;
3. the codes re-rounded to the nearest level under the stored ``d * l_j``, ``l_j +- 1``
   tried on the exact error, the best kept; steps 2-3 repeat once from the new codes, with
   the least-squares ``d`` for the kept ``l_j`` as an extra candidate.

llama.cpp's ``quantize_row_iq4_nl_impl`` tries 15 scales per sub-block and sets
``d = -max_scale / 32`` with rounded ``l_j`` (weights ``imatrix * sqrt(sigma2 + x**2)``).
Measured weighted error ours / llama.cpp (``tests/test_codecs_iq34.py``, same imatrix):
dithered SmolLM2-135M test tensors mean 0.825, worst 0.927; synthetic Gaussian + outliers
with a lognormal imatrix 0.83; no imatrix (plain squared error) 0.92-0.93. CPU, one thread:
about 7e5 weights/s (llama.cpp 4e6).
"""

from __future__ import annotations

import torch

from dynaquant.quant.codecs import _kquant_search as kqs
from dynaquant.quant.codecs._blockfit import fit_scale, in_subchunks, scale_targets
from dynaquant.quant.codecs.base import Codec, LevelGrid, register
from dynaquant.quant.codecs.consts import device_constant
from dynaquant.quant.codecs.nonlinear import IQ4_NL, KVALUES_IQ4NL

QK_K = 256
_N_SUB = 8
_SUB = 32
_KLO, _KHI = -32, 31


def _d_steps() -> tuple[float, ...]:
    return tuple(16.0 + 0.25 * i for i in range(67))  # 16 .. 32.5


class IQ4XSConfig(kqs.SymConfig):
    """IQ4_XS block parameters: ``d`` (n,) float32 holding the stored fp16 values, ``k`` (n, 8)
    int64 sub-block scales ``l_j`` in ``-32..31``; ``sub_scales()`` = decode's ``d * l_j``."""


@register
class IQ4_XS(Codec):
    """IQ4_XS (``block_iq4_xs``): 136 bytes per 256 weights (module docstring).

    ``encode_blocks(x, w)``: x, w (n_blocks, 256) float32 (w > 0) -> (n_blocks, 136) uint8;
    ``decode_blocks`` -> (n_blocks, 256) float32. Both raise ValueError on other shapes.

    Block parameters (:meth:`fit_params`): :class:`IQ4XSConfig`. Codes: indices into
    ``kvalues_iq4nl`` (the stored nibbles). Each weight is rounded on its own, so GPTQ
    (:mod:`dynaquant.quant.gptq`) can use this codec.
    """

    format_name = "IQ4_XS"
    grid = IQ4_NL.grid
    # Step 1 (per 32-sub-block): fewer candidates than the IQ4_NL codec; step 2 refits.
    targets = scale_targets([-127, 113], 10, 5, (0.8, 1.1), 2.5)
    anchor_offsets = (-2, -1, 0, 1, 2)
    d_steps = _d_steps()
    rounds = 2
    # step 2's ranges for kquant's symmetric pick (no clip candidates: only the integer sub-scale range is read)
    _pick_spec = kqs.SymSearch(qlo=0, qhi=0, klo=_KLO, khi=_KHI, d_steps=d_steps)

    # ------------------------------------------------------------------ search

    def _values(self, x3: torch.Tensor, dl: torch.Tensor) -> torch.Tensor:
        """Level values (float32) nearest to ``x3 / dl``; x3 (n, S, 32), dl (n, S)."""
        safe = torch.where(dl == 0, torch.ones_like(dl), dl)
        return self.grid.values_of(x3 / safe.unsqueeze(-1))

    def _error(self, x3, w3, dl, q) -> torch.Tensor:
        """``sum(w * (x - dl * q)**2)`` per sub-block, (n, S) float64, decode's float32 products."""
        r = x3 - dl.unsqueeze(-1) * q
        return (w3 * r * r).sum(-1).double()

    def _refine(self, x3, w3, cfg: kqs.SymConfig) -> tuple[kqs.SymConfig, torch.Tensor]:
        """Step 3: exact error of ``cfg`` and of ``l_j +- 1``; returns (config, error (n,))."""
        dl = cfg.sub_scales()
        err = self._error(x3, w3, dl, self._values(x3, dl))
        k = cfg.k
        for delta in (1, -1):
            kt = (k + delta).clamp(_KLO, _KHI)
            dlt = cfg.d.unsqueeze(-1) * kt.float()
            et = self._error(x3, w3, dlt, self._values(x3, dlt))
            take = et < err
            err = torch.where(take, et, err)
            k = torch.where(take, kt, k)
        return kqs.SymConfig(cfg.d, k), err.sum(-1)

    def _search(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        x3, w3 = x.reshape(n, _N_SUB, _SUB), w.reshape(n, _N_SUB, _SUB)
        lv = self.grid.level_tensor(x.device)
        _, codes = fit_scale(x.reshape(-1, _SUB), w.reshape(-1, _SUB), self.grid, self.targets, self.anchor_offsets, 2, (),
                             backend)
        q = lv[codes].reshape(n, _N_SUB, _SUB)
        wx = w3 * x3
        ts = device_constant(self.d_steps, torch.float64, x.device)
        best: kqs.SymConfig | None = None
        best_err = None
        for r in range(self.rounds):
            sxq = (wx * q).sum(-1).double()
            sqq = (w3 * q * q).sum(-1).double()
            a = kqs.safe_div(sxq, sqq)
            am = a.gather(1, a.abs().argmax(1, keepdim=True))
            cand = [am / ts, -am / ts]
            if best is not None:
                kf = best.k.double()
                d_ls = kqs.safe_div((kf * sxq).sum(1), (kf * kf * sqq).sum(1))
                cand += [best.d.double().unsqueeze(1), d_ls.unsqueeze(1)]
            cand = kqs.f16_candidates(torch.cat(cand, 1))
            # the K-quants' step 2 (its fused kernel on a GPU: the (n, candidates, sub-blocks) float64 errors of the
            # torch reference were most of this search's time on an H200)
            d, k = kqs.sym_pick(x3, w3, a.float(), sqq.float(), self._pick_spec, cand, backend=backend)
            cfg, err = self._refine(x3, w3, kqs.SymConfig(d, k))
            if best is None:
                best, best_err = cfg, err
            else:
                take = err < best_err
                best = kqs.SymConfig(torch.where(take, cfg.d, best.d), torch.where(take.unsqueeze(-1), cfg.k, best.k))
                best_err = torch.where(take, err, best_err)
            if r + 1 < self.rounds:
                q = self._values(x3, best.sub_scales())
        # An all-zero block: d = 0 (and l = 0), as llama.cpp writes it.
        zero = best.d == 0
        return best.d, torch.where(zero.unsqueeze(-1), 0, best.k)

    fast_paths = True  # step 1's fused scale search (blockfit.fit_scale)

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto", variant: str | None = None) -> torch.Tensor:
        """As :meth:`Codec.encode_blocks`; ``backend`` chooses step 1's fused kernel (:func:`._blockfit.fit_scale`);
        ``variant`` is unused."""
        params = self.fit_params(x, w, backend)
        return self.pack(params, self.round_to_grid(x, params)[0])

    def fit_params(self, x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> IQ4XSConfig:
        """Search ``d`` and ``l_j`` of (n, 256) blocks (``backend``: step 1's fast path); raises ValueError on
        other shapes."""
        if x.ndim != 2 or x.shape[1] != QK_K or w.shape != x.shape:
            raise ValueError(f"IQ4_XS: expected x and w of shape (n_blocks, 256), got {tuple(x.shape)} and {tuple(w.shape)}")
        d, k = in_subchunks(self._search, x.to(torch.float32), w.to(torch.float32), backend=backend)
        return IQ4XSConfig(d, k)

    def round_to_grid(self, x: torch.Tensor, params, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        n, m = x.shape
        if start < 0 or start + m > QK_K:
            raise ValueError(f"IQ4_XS: columns {start}..{start + m - 1} are outside a 256-block")
        dl = params.sub_scales()[:, (torch.arange(start, start + m, device=x.device) // _SUB)]
        safe = torch.where(dl == 0, torch.ones_like(dl), dl)
        codes = self.grid.codes_of(x.to(torch.float32) / safe)
        codes = torch.where(dl == 0, self.grid.zero_code(), codes)
        return codes, dl * self.grid.level_tensor(x.device)[codes]

    def column_grid(self, params) -> LevelGrid:
        """As :meth:`Codec.column_grid`: every column's sub-block scale and safe divisor once a super-block,
        (256, n_super) so that a column's are contiguous."""
        dl = params.sub_scales()
        return self.grid.level_grid(dl[:, torch.arange(QK_K, device=dl.device) // _SUB].t().contiguous())

    # ------------------------------------------------------------------ bytes

    def pack(self, params, codes: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        d16 = params.d.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2)
        s = (params.k + 32).to(torch.int32)  # 0..63
        sh = ((s >> 4) << (2 * torch.arange(_N_SUB, device=s.device, dtype=torch.int32))).sum(1)
        sh_bytes = torch.stack([sh & 255, sh >> 8], 1)
        sl = (s[:, 0::2] & 15) | ((s[:, 1::2] & 15) << 4)
        c = codes.to(torch.int32).reshape(n, _N_SUB, 2, 16)
        qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, 128)
        return torch.cat([d16, torch.cat([sh_bytes, sl, qs], 1).to(torch.uint8)], 1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        """(n, 136) uint8 -> (n, 256) float32; raises ValueError on other shapes or dtypes."""
        if b.dtype != torch.uint8 or b.ndim != 2 or b.shape[1] != 136:
            raise ValueError(f"IQ4_XS: expected (n_blocks, 136) uint8, got {tuple(b.shape)} {b.dtype}")
        n = b.shape[0]
        d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)  # (n, 1)
        bi = b.to(torch.int32)
        sh = bi[:, 2] | (bi[:, 3] << 8)
        j = torch.arange(_N_SUB, device=b.device, dtype=torch.int32)
        hi = (sh.unsqueeze(1) >> (2 * j)) & 3
        lo = (bi[:, 4:8].unsqueeze(2) >> torch.tensor([0, 4], device=b.device, dtype=torch.int32)).reshape(n, 8) & 15
        lsc = (lo | (hi << 4)) - 32
        dl = (d * lsc.to(torch.float32)).unsqueeze(-1)  # (n, 8, 1)
        qs = bi[:, 8:].reshape(n, _N_SUB, 1, 16) >> torch.tensor([0, 4], device=b.device, dtype=torch.int32).reshape(1, 1, 2, 1)
        q = (qs & 15).reshape(n, _N_SUB, 32).long()
        lut = device_constant(KVALUES_IQ4NL, torch.float32, b.device)
        return (dl * lut[q]).reshape(n, QK_K)
