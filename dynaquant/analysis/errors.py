"""Per-tensor quantization error of each candidate format, and the KL divergence it predicts.

For a weight ``W`` (N, K) read by inputs with second moment ``H = E[x x^T]`` (K, K) and whose
outputs have Fisher diagonal ``G`` (N,) (mean squared gradient of the sampled-label log
likelihood, see :mod:`.stats`), quantizing to a format with error ``dW = Q(W) - W`` adds, to
second order, a mean KL divergence per token of::

    kld_pred = 1/2 * sum_i G_i * dW_i H dW_i^T          (nats / token)

(the Fisher quadratic form ``1/2 dθ^T F dθ`` with ``F`` approximated as ``diag(G) ⊗ H``, the
K-FAC factorisation of Martens & Grosse 2015, with the true Fisher so that it predicts KL
divergence). The same quantities give the reported proxies:

- ``weighted_rel = sum_ij H_jj dW_ij^2 / sum_ij H_jj W_ij^2`` (imatrix-weighted relative error);
- ``output_rel = ||dW X|| / ||W X||`` over all calibration inputs X (= ``sqrt(tr(dW H dW^T) / tr(W H W^T))``).

A token embedding (rows looked up, not multiplied) gets ``1/2 sum_v f_v sum_j G^emb_j dW_vj^2``,
``f_v`` the token's calibration frequency (add-half smoothed, so unseen tokens count a little);
a tied embedding adds both terms.

Errors are measured on a sample of rows, stratified by each row's weight in the sum (rows with
the largest weight are always measured; one random row per stratum of the rest, weighted by the
stratum's size), which is unbiased and keeps the analysis of every format of every tensor fast.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dynaquant.quant.codecs import dequantize, quantize
from dynaquant.quant.formats import get_format


@dataclass(frozen=True)
class TensorError:
    """Errors of one tensor in one format (see the module docstring for definitions).

    Attributes:
        size_bytes: the tensor's bytes in this format.
        bpw: bits per weight of the format (scales included).
        weighted_rel, output_rel: relative errors (dimensionless).
        kld_pred: predicted mean KL divergence added, nats/token.
    """

    size_bytes: int
    bpw: float
    weighted_rel: float
    output_rel: float
    kld_pred: float

    def to_dict(self) -> dict:
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class RowWeights:
    """How much each row of a tensor counts in the predicted KL divergence.

    Attributes:
        fisher: (N,) float32 output Fisher per row (a linear layer's output channel), or None.
        hessian: (K, K) float32 E[x x^T] of the inputs (required with ``fisher``).
        lookup: (N,) float32 frequency of each row as an embedding lookup, or None.
        lookup_fisher: (K,) float32 Fisher per column at the embedding output (required with ``lookup``).
    """

    fisher: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    lookup: torch.Tensor | None = None
    lookup_fisher: torch.Tensor | None = None


def sample_rows(score: torch.Tensor, n: int, top: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stratified sample of rows by ``score``.

    Args:
        score: (N,) float, each row's expected share of the error.
        n: rows to draw (all rows when n >= N).
        top: rows with the largest score always included (weight 1).
        seed: random pick inside each stratum.
    Returns:
        (indices (n,) int64, weights (n,) float64): an unbiased estimator of ``sum_i v_i`` is
        ``sum_k weights[k] * v[indices[k]]``.
    """
    N = score.numel()
    if n >= N:
        return torch.arange(N), torch.ones(N, dtype=torch.float64)
    order = torch.argsort(score.float().cpu(), descending=True, stable=True)
    top = min(top, n - 1)
    head, rest = order[:top], order[top:]
    k = n - top
    edges = torch.linspace(0, rest.numel(), k + 1).round().long()
    sizes = (edges[1:] - edges[:-1]).clamp_min(1)
    g = torch.Generator().manual_seed(seed)
    offs = (torch.rand(k, generator=g) * sizes).long().clamp_max(sizes - 1)
    picks = rest[(edges[:-1] + offs).clamp_max(rest.numel() - 1)]
    idx = torch.cat([head, picks])
    w = torch.cat([torch.ones(top, dtype=torch.float64), sizes.to(torch.float64)])
    return idx, w


def _row_terms(W: torch.Tensor, rw: RowWeights) -> torch.Tensor:
    """(n,) float64 per-row ``1/2 * sum`` weight of W's rows under rw (used for errors and sampling)."""
    t = torch.zeros(W.shape[0], dtype=torch.float64, device=W.device)
    if rw.fisher is not None:
        t += 0.5 * rw.fisher.to(W.device, torch.float64) * ((W @ rw.hessian.to(W.device)) * W).sum(1).double()
    if rw.lookup is not None:
        t += 0.5 * rw.lookup.to(W.device, torch.float64) * (W * W * rw.lookup_fisher.to(W.device)).sum(1).double()
    return t


def measure_errors(weight: torch.Tensor, formats: list[str], rw: RowWeights, *, imatrix: torch.Tensor | None = None,
                   hessian: torch.Tensor | None = None, rows: int | None = None, seed: int = 0) -> dict[str, TensorError]:
    """Errors of one tensor in each format whose block size divides its rows.

    Args:
        weight: (N, K) float weight (torch orientation, rows = output channels or vocabulary).
        formats: format names to try; those that do not fit K are left out of the result.
        rw: row weights for the predicted KL divergence.
        imatrix: (K,) float32 importance passed to the encoders (and used for ``weighted_rel``).
        hessian: (K, K) float32 E[x x^T] for ``output_rel`` (default: ``rw.hessian``; None: diag(imatrix)).
        rows: rows to measure (default: all when N <= 64, else max(32, N // 16) capped at 2048).
        seed: row sampling seed.
    Returns:
        format name -> TensorError (sizes for the whole tensor, errors estimated from the sampled rows).
    """
    W = weight.to(torch.float32)
    N, K = W.shape
    H = hessian if hessian is not None else rw.hessian
    if H is None:
        H = torch.diag(imatrix if imatrix is not None else torch.ones(K))
    H = H.to(W.device, torch.float32)
    imp = imatrix.to(W.device, torch.float32) if imatrix is not None else torch.diagonal(H).clone()
    if rows is None:
        rows = N if N <= 64 else min(2048, max(32, N // 16))
    score = _row_terms(W, rw) + 1e-30 * (W * W).sum(1).double()
    idx, sw = sample_rows(score, rows, max(1, rows // 16), seed)
    idx, sw = idx.to(W.device), sw.to(W.device)
    Ws = W[idx]
    ref_w = float((sw * (Ws * Ws * imp).sum(1).double()).sum())
    ref_o = float((sw * ((Ws @ H) * Ws).sum(1).double()).sum())
    sub = RowWeights(None if rw.fisher is None else rw.fisher.to(W.device)[idx], rw.hessian,
                     None if rw.lookup is None else rw.lookup.to(W.device)[idx], rw.lookup_fisher)
    out: dict[str, TensorError] = {}
    for name in formats:
        f = get_format(name)
        if not f.fits(K):
            continue
        q = dequantize(quantize(Ws, f, imatrix if f.kind != "float" else None), f).to(W.device)
        d = q - Ws
        e_w = float((sw * (d * d * imp).sum(1).double()).sum())
        e_o = float((sw * ((d @ H) * d).sum(1).double()).sum())
        kld = float((sw * _row_terms(d, sub)).sum())
        out[f.name] = TensorError(N * f.row_bytes(K), f.bpw, e_w / ref_w if ref_w > 0 else 0.0,
                                  (e_o / ref_o) ** 0.5 if ref_o > 0 else 0.0, kld)
    return out
