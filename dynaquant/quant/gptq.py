"""GPTQ: error-compensating rounding to the GGUF block formats, layout unchanged.

GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", arXiv 2210.17323) quantizes the columns (input features) of a
weight ``W`` (N, K) one at a time and, after each, spreads its rounding error over the
columns not yet quantized so that the layer output error ``tr(dW H dW^T)`` stays small,
with ``H = E[x x^T]`` (K, K) the second moment of the layer's inputs:

1. dead inputs (``H_jj == 0``) get ``H_jj = 1`` and their weights set to 0 (they never
   touch the calibration output), then ``H += damp * mean(diag H) * I``;
2. ``U`` = upper Cholesky factor of ``H^-1``; column ``j`` is rounded to ``q_j`` and the
   columns after it are updated ``W[:, j+1:] -= (w_j - q_j) / U_jj * U[j, j+1:]``;
3. updates are applied lazily in batches of ``block_columns`` columns (the rest of ``W``
   is updated once per batch with one matrix product).

Block formats (every GGUF quantized type with a per-weight grid: ``Q8_0``, ``Q4_0``, ``Q4_1``,
``Q5_0``, ``Q5_1``, ``IQ4_NL``, ``MXFP4``, ``NVFP4``, ``IQ4_XS``, ``Q2_K`` ... ``Q6_K``) fix a grid per block of 32, 64 or 256
consecutive columns: as GPTQ with groups does, a block's grid (its stored scales, mins
and K-quant sub-block scales) is chosen when the algorithm reaches the block's first
column, from the block's weights *as updated so far*, by the codec's own importance-
weighted search (:meth:`Codec.fit_params`, the same search ``quantize`` runs); each of the
block's columns is then rounded to the nearest value of that grid
(:meth:`Codec.round_to_grid`). Batches are rounded up to a whole number of blocks so a
block's columns are all current when its grid is chosen. At the end the codes and grid
parameters are written in the GGUF layout (:meth:`Codec.pack`), so decoding the bytes
(our codec or ``gguf.quants.dequantize``) gives exactly the values GPTQ worked with.

Act-order (GPTQ's columns by descending ``H_jj``) is offered in the only form the layout
allows: whole blocks in descending ``sum(H_jj)`` over the block, and the columns of each
block (contiguous) in descending ``H_jj``; the bytes keep the layout's column order.
The grid search weighs the columns of a block by GPTQ's own cost of an error in each,
``1 / [U_jj]**2`` (unless an imatrix is given).

Vector-quantized formats (the lattice i-quants ``IQ3_*``, ``IQ2_*``, ``IQ1_*``: groups of 4 or 8
weights share one codebook entry, sub-block scales share a super-block scale) have no per-weight
grid, so there is no column to round alone (their codecs' :meth:`Codec.fit_params` raises
NotImplementedError). GPTQ rounds them a super-block of columns at a time (block GPTQ): the
block's 256 columns, error-compensated by every block before it, are encoded by the codec's own
search (so each group's lattice point and every scale are chosen on the compensated weights),
and the block's error ``E`` (N, 256) is then spread over the later columns at once,
``W[:, R] -= E U_BB^-1 U_BR`` (what the column-by-column updates add up to for the same
rounded values: the GPTQ paper's lazy batch, with the batch rounded jointly). The importance
the search weighs a block's columns by is the diagonal of ``(U_BB^T U_BB)^-1 = U_BB^-1 U_BB^-T``,
the error cost of each column once the later columns compensate (unless an imatrix is given).
Within a block nothing is compensated, so the gain is smaller than for the per-weight grids;
act-order moves whole blocks only.

Everything runs on the device of the weight, vectorised over all rows (the Python loop is
over columns, or over super-blocks for the i-quants; on CUDA a block's columns are one kernel launch,
:mod:`dynaquant.kernels.gptq_block`, for every grid :meth:`Codec.column_grid` gives).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

import torch

from dynaquant.quant.codecs.base import ColumnGrid, LevelGrid, block_importance, get_codec
from dynaquant.quant.codecs.fastpaths import BACKENDS, fast_path
from dynaquant.quant.formats import Format, get_format

logger = logging.getLogger(__name__)

# Damping is multiplied by this factor (up to _MAX_DAMP_TRIES times) when H + damp is not
# numerically positive definite.
_DAMP_GROWTH = 10.0
_MAX_DAMP_TRIES = 4


@dataclass
class GPTQResult:
    """What GPTQ rounding produced.

    Attributes:
        data: (N, row_bytes) uint8, the GGUF rows (as :func:`dynaquant.quant.codecs.quantize` returns them).
        decoded: (N, K) float32, the rounded weights; equal bit for bit to decoding ``data``.
        damp: the relative damping finally used (larger than asked if ``H`` needed more).
    """

    data: torch.Tensor
    decoded: torch.Tensor
    damp: float


# The vector-quantized formats GPTQ rounds a whole block of columns at a time (module docstring).
_BLOCK_GPTQ = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"})


@cache
def _has_weight_grid(name: str) -> bool:
    codec, bs = get_codec(name), get_format(name).block_size
    x = torch.linspace(-1.0, 1.0, bs).reshape(1, bs)
    try:
        codec.fit_params(x, torch.ones_like(x))
    except NotImplementedError:
        return False
    return True


def supports_gptq(fmt: str | Format) -> bool:
    """Whether GPTQ can round to a format: a quantized format whose codec rounds weight by weight, or
    one of the lattice i-quants (IQ3_XXS, IQ3_S, IQ2_*, IQ1_*: rounded a super-block at a time).

    False for plain floats and for other formats without a per-weight grid.

    Raises:
        KeyError: unknown format, or no codec registered for it.
    """
    fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
    return fmt.kind != "float" and (fmt.name in _BLOCK_GPTQ or _has_weight_grid(fmt.name))


def _inverse_cholesky(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1`` (float64), and the damp used.

    Raises:
        ValueError: still not positive definite after raising the damping.
    """
    k = h.shape[0]
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    mean_diag = float(torch.diagonal(h).mean())
    for _ in range(_MAX_DAMP_TRIES):
        lower, info = torch.linalg.cholesky_ex(h + damp * mean_diag * eye)
        if int(info) == 0:
            u, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0 and torch.isfinite(u).all():
                return u, damp
        logger.warning("GPTQ: H + %.3g * mean(diag H) is not positive definite; damping more", damp)
        damp *= _DAMP_GROWTH
    raise ValueError(f"GPTQ: the Hessian is not positive definite even with damp {damp / _DAMP_GROWTH:.3g}")


def _column_order(diag: torch.Tensor, bs: int, act_order: bool) -> list[int]:
    """Processing order of the columns: identity, or blocks by descending ``sum(diag H)`` over
    the block and, inside each block, columns by descending ``diag H`` (blocks stay contiguous)."""
    k = diag.shape[0]
    if not act_order:
        return list(range(k))
    d = diag.reshape(k // bs, bs).cpu()
    blocks = d.sum(1).argsort(descending=True, stable=True)
    inside = d.argsort(dim=1, descending=True, stable=True)
    return (blocks[:, None] * bs + inside[blocks]).reshape(-1).tolist()


def round_block_torch(w1: torch.Tensor, u1: torch.Tensor, rnd, i: int, local: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's column loop over one block (module docstring, step 2): round columns ``i .. i + len(local) - 1`` of
    the batch ``w1`` one at a time, each spreading its error over the batch's later columns.

    Args:
        w1: (N, B) float32, the batch's weights as updated so far, contiguous; updated in place (columns after
            each rounded one).
        u1: (B, B) float32, the batch's part of the upper Cholesky factor of ``H^-1`` (any strides).
        rnd: the block's :meth:`Codec.column_rounder` (a :class:`ColumnGrid` or :class:`LevelGrid` where it is one).
        i: the block's first column in the batch.
        local: each column's place in its block (its layout order), as ``rnd`` takes it.
    Returns:
        (codes, values, errors): (N, len(local)) int64, float32, float32 in processing order; ``errors`` are the
        scaled errors ``(w - value) / U_jj`` the later batches are updated with.
    The fast path ``gptq.round_block`` (:mod:`dynaquant.quant.codecs.fastpaths`) takes the same arguments with a
    :class:`ColumnGrid` or :class:`LevelGrid` and returns the same.
    """
    cs, vs, es = [], [], []
    for t, j in enumerate(local):
        x = w1[:, i + t]
        c, v = rnd(x, j)
        e = (x - v) / u1[i + t, i + t]
        w1[:, i + t + 1 :].addr_(e, u1[i + t, i + t + 1 :], alpha=-1.0)
        cs.append(c)
        vs.append(v)
        es.append(e)
    return torch.stack(cs, 1), torch.stack(vs, 1), torch.stack(es, 1)


def gptq_round(
    weight: torch.Tensor,
    fmt: str | Format,
    hessian: torch.Tensor,
    imatrix: torch.Tensor | None = None,
    *,
    damp: float = 0.01,
    block_columns: int = 128,
    act_order: bool = False,
    backend: str = "auto",
) -> GPTQResult:
    """GPTQ-round a weight to a GGUF block format (module docstring).

    Args:
        weight: (N, K) float tensor, any device; K a multiple of the format's block size.
        fmt: a quantized GGUF format name or row (not a plain float format).
        hessian: (K, K) float tensor, ``E[x x^T]`` of the layer's inputs over calibration
            tokens (any positive scale; symmetric positive semi-definite).
        imatrix: (K,) per-column importance for the choice of each block's grid. None (the
            default, and better in our measurements than ``diag H``): GPTQ's own cost of a
            rounding error in column ``j``, ``1 / [U_jj]**2`` (``U`` the upper Cholesky factor
            of ``H^-1`` in processing order: ``H_jj`` less what the later columns can absorb).
        damp: diagonal damping, relative to the mean of ``diag H`` (GPTQ's ``percdamp``).
        block_columns: lazy-update batch, in columns; rounded up to a multiple of the block size.
        act_order: process whole blocks in descending order of ``sum(diag H)`` over the block,
            and the columns of a block in descending ``diag H`` (GPTQ's act-order, restricted
            to orders that keep each block's columns together, as the layout demands).
        backend: the column loop of a block on a :class:`ColumnGrid` or :class:`LevelGrid` (the K-quants, the legacy
            symmetric types, IQ4_NL, IQ4_XS): ``"auto"`` (the default: the kernel on CUDA, the torch loop elsewhere),
            ``"torch"`` (:func:`round_block_torch`) or ``"triton"`` (the fused kernel ``gptq.round_block``, one launch
            a block; on the CPU under ``TRITON_INTERPRET=1``). On an H200 the kernel is 3.9-7.2x faster than the loop
            on Llama-3-8B's shapes, at the same layer-output error (ratios 0.9998-1.0001;
            ``benchmarks/out/gptq_speed-h200.json``); its bytes can differ from the loop's natively where the compiler
            contracts a multiply-add, a near-tie rounding the other way.
    Returns:
        GPTQResult with the bytes and the decoded weight, both on the weight's device.
    Raises:
        ValueError: bad shapes, a float format, an unknown backend, non-finite inputs, or ``H`` not
            positive definite even after more damping.
        NotImplementedError: a format :func:`supports_gptq` refuses.
    """
    fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
    if fmt.kind == "float":
        raise ValueError(f"GPTQ needs a quantized block format, not {fmt.name}")
    if not supports_gptq(fmt):
        raise NotImplementedError(f"GPTQ: {fmt.name} has no per-weight grid; encode it with quantize()")
    if weight.ndim != 2:
        raise ValueError(f"GPTQ takes a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    bs, ts = fmt.block_size, fmt.type_size
    row_bytes = fmt.record_bytes(k)  # raises ValueError when K is not a multiple of the block size
    if hessian.shape != (k, k):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({k}, {k})")
    if damp < 0 or block_columns < 1:
        raise ValueError(f"need damp >= 0 and block_columns >= 1, got {damp} and {block_columns}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    device = weight.device
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(device=device, dtype=torch.float64)
    if not (torch.isfinite(w).all() and torch.isfinite(h).all()):
        raise ValueError("GPTQ: weight and hessian must be finite")
    imp = None if imatrix is None else block_importance(imatrix, 1, k, device)[0]
    h = (h + h.T) * 0.5
    diag = torch.diagonal(h).clamp_min(0)
    dead = diag == 0
    if dead.any():
        # GPTQ: an input never active in calibration is pinned to 0 and decoupled.
        h[dead, :] = 0
        h[:, dead] = 0
        h[dead, dead] = 1
        w[:, dead] = 0
    order = _column_order(diag, bs, act_order)
    if fmt.name in _BLOCK_GPTQ:  # whole blocks only, each in its layout order
        order = [c - c % bs + i for c in order[::bs] for i in range(bs)]
    if act_order:
        perm = torch.tensor(order, device=device)
        w, h, dead = w[:, perm], h[perm][:, perm], dead[perm]
        imp = None if imp is None else imp[perm]
    u, used_damp = _inverse_cholesky(h, damp)
    u = u.to(torch.float32)
    if fmt.name in _BLOCK_GPTQ:
        return _block_gptq(w, u, imp, dead, fmt, order, used_damp)
    if imp is None:
        imp = torch.diagonal(u).square().reciprocal()
        if dead.any():  # a dead column's error costs nothing: the least importance, not H_jj = 1's
            imp = torch.where(dead, imp[~dead].min() * 1e-3 if (~dead).any() else 1.0, imp)

    codec = get_codec(fmt.name)
    batch = -(-block_columns // bs) * bs
    decoded = torch.empty(n, k, dtype=torch.float32, device=device)
    data = torch.empty(n, row_bytes, dtype=torch.uint8, device=device)
    for i1 in range(0, k, batch):
        i2 = min(i1 + batch, k)
        w1 = w[:, i1:i2].clone()
        u1 = u[i1:i2, i1:i2]
        values, errors = [], []
        for p0 in range(i1, i2, bs):  # the batch's blocks (whole: the batch is a multiple of the block size)
            i = p0 - i1
            local = [c % bs for c in order[p0 : p0 + bs]]  # each processed column's place in its block
            # The block's grid, from its updated weights (put back in layout order).
            xb, wb, back = w1[:, i : i + bs], imp[p0 : p0 + bs], None
            if act_order:
                back = torch.tensor(local, device=device).argsort()
                xb, wb = xb[:, back], wb[back]
            params = codec.fit_params(xb, wb.expand(n, bs))
            rnd = codec.column_rounder(params)
            fast = fast_path("gptq.round_block", w1, backend) if isinstance(rnd, ColumnGrid | LevelGrid) else None
            codes, v, e = (fast or round_block_torch)(w1, u1, rnd, i, local)
            b0 = order[p0] - local[0]
            data[:, b0 // bs * ts : (b0 // bs + 1) * ts] = codec.pack(params, codes if back is None else codes[:, back])
            values.append(v)
            errors.append(e)
        if act_order:
            decoded[:, torch.tensor(order[i1:i2], device=device)] = torch.cat(values, 1)
        else:
            decoded[:, i1:i2] = torch.cat(values, 1)
        if i2 < k:
            w[:, i2:].addmm_(torch.cat(errors, 1), u[i1:i2, i2:], alpha=-1.0)
    return GPTQResult(data, decoded, used_damp)


def _block_gptq(w: torch.Tensor, u: torch.Tensor, imp: torch.Tensor | None, dead: torch.Tensor, fmt: Format,
                order: list[int], damp: float) -> GPTQResult:
    """Block GPTQ for the vector-quantized formats (module docstring): ``w`` (N, K) float32 in processing order,
    updated in place; ``u`` (K, K) float32 upper Cholesky factor of ``H^-1`` in that order; ``imp`` (K,) imatrix or
    None; ``order[p]`` the layout column at processing position ``p`` (whole blocks). Returns bytes and decoded
    weight in layout order."""
    n, k = w.shape
    bs, ts = fmt.block_size, fmt.type_size
    codec = get_codec(fmt.name)
    data = torch.empty(n, k // bs * ts, dtype=torch.uint8, device=w.device)
    decoded = torch.empty(n, k, dtype=torch.float32, device=w.device)
    for b0 in range(0, k, bs):
        b1 = b0 + bs
        u_bb = u[b0:b1, b0:b1]
        if imp is None:  # the cost of each column's error once the later columns compensate: diag(U_BB^-1 U_BB^-T)
            eye = torch.eye(bs, dtype=u.dtype, device=u.device)
            wb = torch.linalg.solve_triangular(u_bb, eye, upper=True).square().sum(1)
            live = ~dead[b0:b1]
            if not live.all():  # a dead column's error costs nothing: the least importance
                wb = torch.where(live, wb, wb[live].min() * 1e-3 if live.any() else torch.ones_like(wb))
        else:
            wb = imp[b0:b1]
        xb = w[:, b0:b1].contiguous()
        blk = codec.encode_blocks(xb, wb.expand(n, bs).contiguous())
        v = codec.decode_blocks(blk)
        lb = order[b0] // bs  # the block's place in the layout
        data[:, lb * ts : (lb + 1) * ts] = blk
        decoded[:, lb * bs : (lb + 1) * bs] = v
        if b1 < k:
            spread = torch.linalg.solve_triangular(u_bb, u[b0:b1, b1:], upper=True)  # U_BB^-1 U_BR
            w[:, b1:].addmm_(xb - v, spread, alpha=-1.0)
    return GPTQResult(data, decoded, damp)


def gptq_quantize(
    weight: torch.Tensor,
    fmt: str | Format,
    hessian: torch.Tensor,
    imatrix: torch.Tensor | None = None,
    *,
    damp: float = 0.01,
    block_columns: int = 128,
    act_order: bool = False,
) -> torch.Tensor:
    """GPTQ-quantize a weight to a GGUF format's bytes (arguments and errors as :func:`gptq_round`).

    Returns:
        (N, K // block_size * type_size) uint8 on the weight's device: the GGUF layout, a
        drop-in replacement for ``quantize(weight, fmt, imatrix)``.
    """
    return gptq_round(weight, fmt, hessian, imatrix, damp=damp, block_columns=block_columns, act_order=act_order).data


def output_error(weight: torch.Tensor, decoded: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative layer-output error ``tr(dW H dW^T) / tr(W H W^T)``, ``dW = weight - decoded``.

    Args:
        weight, decoded: (N, K) float tensors on one device.
        hessian: (K, K) ``E[x x^T]``.
    Returns:
        float (float64 arithmetic): the mean squared output error over the calibration
        inputs relative to the mean squared output.
    Raises:
        ValueError: shapes disagree, or the reference output ``tr(W H W^T)`` is 0.
    """
    if weight.shape != decoded.shape or weight.ndim != 2 or hessian.shape != (weight.shape[1],) * 2:
        raise ValueError(f"shapes {tuple(weight.shape)}, {tuple(decoded.shape)}, {tuple(hessian.shape)} do not fit")
    w = weight.to(torch.float64)
    h = hessian.to(device=w.device, dtype=torch.float64)
    dw = w - decoded.to(device=w.device, dtype=torch.float64)
    den = float(((w @ h) * w).sum())
    if den == 0:
        raise ValueError("the reference output tr(W H W^T) is 0")
    return float(((dw @ h) * dw).sum()) / den
