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
Many tensors are measured together (:func:`measure_samples`: a decoder block's tensors, an MoE
layer's experts): each format encodes the sampled rows of all of them in one sequence of codec
calls, and the results equal those of measuring each tensor alone (:func:`measure_errors`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dynaquant.quant.codecs import dequantize, get_codec, quantize
from dynaquant.quant.codecs.base import block_importance, chunk_weights
from dynaquant.quant.formats import Format, get_format

# Sampled weights measured together at most (:func:`measure_samples`): the samples, their importance and one
# format's decoded copy are held at once.
BATCH_WEIGHTS = 1 << 27
# Rows of an (N, K) tensor whose errors are measured (:func:`sample_size`): N // SAMPLE_FRACTION, between 512 // and
# 32768 // SAMPLE_FRACTION rows (32 and 2048), every row of a tensor of at most 64. A quantize run on the CPU measures
# half as many (CPU_SAMPLE_FRACTION in dynaquant.config).
SAMPLE_FRACTION = 16


def sample_size(n_rows: int, fraction: int = SAMPLE_FRACTION) -> int:
    """Rows sampled of a tensor of ``n_rows`` rows: all up to 64, else ``n_rows // fraction`` clamped to
    ``[512 // fraction, 32768 // fraction]`` (``fraction`` 16: 32 to 2048 rows).

    Raises:
        ValueError: ``fraction`` is not between 1 and 512.
    """
    if not 1 <= fraction <= 512:
        raise ValueError(f"sample fraction {fraction}: expected 1 to 512")
    return n_rows if n_rows <= 64 else min(32768 // fraction, max(512 // fraction, n_rows // fraction))


# Formats whose encoder looks across blocks, measured one tensor at a time (as quantize encodes it): NVFP4_G16
# takes its global scale from the largest magnitude of the blocks it is given.
PER_TENSOR_FORMATS = frozenset({"NVFP4_G16"})


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
        hessian: (K, K) float32 E[x x^T] of the inputs (required with ``fisher``), or its (K,) diagonal alone (H taken
            as diagonal: the MoE experts beyond :data:`dynaquant.analysis.experts.EXPERT_HESSIAN_BYTES`).
        lookup: (N,) float32 frequency of each row as an embedding lookup, or None.
        lookup_fisher: (K,) float32 Fisher per column at the embedding output (required with ``lookup``).
    """

    fisher: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    lookup: torch.Tensor | None = None
    lookup_fisher: torch.Tensor | None = None


@dataclass
class ErrorSample:
    """The sampled rows of one tensor and what their errors need (:func:`sample_tensor`), on one device.

    Attributes:
        rows: (n, K) float32 sampled rows of the weight.
        weights: (n,) float64 estimator weights (:func:`sample_rows`).
        n_rows: N, the whole tensor's rows (for its size in bytes).
        imatrix: the (K,) importance as given (None: none), for the encoders.
        importance: (K,) float32 importance the encoders get (``block_importance``: floored, ones without imatrix).
        constant: ``importance`` is constant (the IQ1/IQ2 encoders then use their no-imatrix weighting, decided
            over the whole chunk encoded together, so such a tensor is encoded on its own).
        imp: (K,) float32 column weights of ``weighted_rel``.
        hessian: (K, K) float32 H of ``output_rel`` (or its (K,) diagonal).
        row_weights: the RowWeights of the sampled rows (predicted KLD).
        ref: (2,) float64 the estimated ``sum H_jj W_ij^2`` and ``tr(W H W^T)`` (denominators of the relative errors).
        index: (n,) int64 the sampled rows' indices in the weight.
        stored: the GGML type name the source stores the weight in, when the weight is the decoding of those bytes
            (a GGUF source); that format's error is 0 without encoding: the file keeps the source's bytes
            (:meth:`dynaquant.pipeline.targets.GGUFTarget.source_records`). None: not known.
    """

    rows: torch.Tensor
    weights: torch.Tensor
    n_rows: int
    imatrix: torch.Tensor | None
    importance: torch.Tensor
    constant: bool
    imp: torch.Tensor
    hessian: torch.Tensor
    row_weights: RowWeights
    ref: torch.Tensor
    index: torch.Tensor | None = None
    stored: str | None = None


@dataclass(frozen=True)
class RowErrors:
    """One tensor's errors in one format with the predicted KL divergence left for a Fisher diagonal known later.

    The block-by-block analysis measures a block's errors in its forward sweep, before the backward sweep has
    produced the block's output Fisher: ``kld_pred = 1/2 sum_i G_i dW_i H dW_i^T`` (see the module docstring) is
    then a weighted sum of each sampled row's output error ``dW_i H dW_i^T``, weighted by a ``G`` given later.

    Attributes:
        error: the TensorError with ``kld_pred`` from the row weights known when measured (0.0 without).
        index: (n,) int64 sampled rows; weights: (n,) float64 their estimator weights.
        out_err: (n,) float64 ``dW_i H dW_i^T`` of each sampled row.
    """

    error: TensorError
    index: torch.Tensor
    weights: torch.Tensor
    out_err: torch.Tensor

    def with_fisher(self, fisher: torch.Tensor | None, scale: float = 1.0) -> TensorError:
        """The TensorError with ``kld_pred = scale / 2 * sum_k weights_k * fisher[index_k] * out_err_k``.

        Args:
            fisher: (N,) output Fisher per row of the whole tensor (None: keep ``error.kld_pred``).
            scale: a factor on the Fisher (an expert's routing share).
        """
        if fisher is None:
            return self.error
        g = fisher.detach().to(torch.float64).cpu()[self.index]
        kld = 0.5 * scale * float((self.weights * g * self.out_err).sum())
        e = self.error
        return TensorError(e.size_bytes, e.bpw, e.weighted_rel, e.output_rel, kld + e.kld_pred)


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


def quad_rows(W: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """(N,) float64 ``W_i H W_i^T`` of each row of W (N, K); ``H`` (K, K), or (K,) for a diagonal H."""
    if H.dim() == 1:
        return (W * W * H).sum(1).double()
    return ((W @ H) * W).sum(1).double()


def _row_terms(W: torch.Tensor, rw: RowWeights, quad: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) float64 per-row ``1/2 * sum`` weight of W's rows under rw (used for errors and sampling); ``quad``: the
    caller's ``quad_rows(W, rw.hessian)`` where it has it."""
    t = torch.zeros(W.shape[0], dtype=torch.float64, device=W.device)
    if rw.fisher is not None:
        q = quad if quad is not None else quad_rows(W, rw.hessian.to(W.device))
        t += 0.5 * rw.fisher.to(W.device, torch.float64) * q
    if rw.lookup is not None:
        t += 0.5 * rw.lookup.to(W.device, torch.float64) * (W * W * rw.lookup_fisher.to(W.device)).sum(1).double()
    return t


def sample_tensor(weight: torch.Tensor, rw: RowWeights, *, imatrix: torch.Tensor | None = None,
                  hessian: torch.Tensor | None = None, rows: int | None = None, seed: int = 0,
                  score: str = "kld", stored: str | None = None, fraction: int = SAMPLE_FRACTION) -> ErrorSample:
    """Draw the rows of one tensor whose errors :func:`measure_samples` measures (the weight itself is not kept).

    Args: as :func:`measure_errors`, and
        score: what the strata follow: ``"kld"`` each row's term of the predicted KL divergence under ``rw``;
            ``"output"`` its output energy ``W_i H W_i^T`` (the Fisher not known yet: :class:`RowErrors`).
        stored: :attr:`ErrorSample.stored`.
        fraction: with ``rows`` None, :func:`sample_size`'s.
    Returns:
        ErrorSample on the weight's device.
    Raises:
        ValueError: the imatrix does not have K entries, or is not finite and non-negative.
    """
    W = weight.to(torch.float32)
    N, K = W.shape
    H = hessian if hessian is not None else rw.hessian
    if H is None:
        H = torch.diag(imatrix if imatrix is not None else torch.ones(K))
    H = H.to(W.device, torch.float32)
    imp = imatrix.to(W.device, torch.float32) if imatrix is not None else (torch.diagonal(H) if H.dim() == 2 else H).clone()
    if rows is None:
        rows = sample_size(N, fraction)
    if score == "output":
        score_v = quad_rows(W, H) + 1e-30 * (W * W).sum(1).double()
    elif score == "kld":
        score_v = _row_terms(W, rw) + 1e-30 * (W * W).sum(1).double()
    else:
        raise ValueError(f"sample_tensor: unknown score {score!r} (kld, output)")
    idx, sw = sample_rows(score_v, rows, max(1, rows // 16), seed)
    idx, sw = idx.to(W.device), sw.to(W.device)
    Ws = W[idx]
    ref = torch.stack([(sw * (Ws * Ws * imp).sum(1).double()).sum(), (sw * quad_rows(Ws, H)).sum()])
    sub = RowWeights(None if rw.fisher is None else rw.fisher.to(W.device)[idx],
                     None if rw.hessian is None else rw.hessian.to(W.device),
                     None if rw.lookup is None else rw.lookup.to(W.device)[idx],
                     None if rw.lookup_fisher is None else rw.lookup_fisher.to(W.device))
    enc = block_importance(imatrix, 1, K, W.device).reshape(K)  # what quantize() gives the encoders
    return ErrorSample(Ws, sw, N, imatrix, enc, bool((enc == enc[0]).all()), imp, H, sub, ref, idx, stored)


def measure_samples(samples: list[ErrorSample], formats: list[str], *, batch_weights: int = BATCH_WEIGHTS,
                    per_row: bool = False) -> list[dict[str, TensorError]] | list[dict[str, RowErrors]]:
    """Errors of many tensors in each format, their sampled rows encoded together.

    For each format, the sampled rows of every tensor it fits are cut into the format's blocks and
    encoded and decoded as one sequence of blocks (in chunks of whole rows of at most
    ``chunk_weights`` weights, as :func:`~dynaquant.quant.codecs.quantize` chunks one tensor), each
    block with its own tensor's importance; the decoded rows are split back per tensor and their
    errors summed as :func:`measure_errors` does. The results equal per-tensor measurement
    (``measure_errors`` on each, same rows) as long as each block's encoding depends on that block
    only; the exceptions are encoded one tensor at a time (:data:`PER_TENSOR_FORMATS`, and tensors
    whose importance is constant, for which the IQ1/IQ2 encoders switch to their no-imatrix
    weighting). A sample's own stored type (:attr:`ErrorSample.stored`) is not encoded: its rows are
    that type's decoding, error 0. The host waits for the device once per batch, not once per format.

    Args:
        samples: from :func:`sample_tensor` (one device).
        formats: format names; a tensor gets those whose block size divides its rows.
        batch_weights: sampled weights measured together at most (a memory bound; a tensor is never split).
        per_row: return :class:`RowErrors` (each sampled row's output error kept, on the CPU) instead.
    Returns:
        One dict per sample, format name -> TensorError, or RowErrors with ``per_row`` (in ``formats`` order).
    """
    out: list[dict[str, TensorError]] = [{} for _ in samples]
    for batch in _batches(samples, batch_weights):
        sums: dict[tuple[int, str], torch.Tensor] = {}
        rows_out: dict[tuple[int, str], torch.Tensor] = {}
        # on a CPU 1M-weight chunks across tensors on torch's own threads (faster here than quantize's threaded
        # 128K chunks on the many small samples: README's first command 77 against 89 s, 2-core box)
        step = chunk_weights(samples[batch[0]].rows.device, large=True)
        for name in formats:
            f = get_format(name)
            fit = [i for i in batch if f.fits(samples[i].rows.shape[1])]
            dec = {i: samples[i].rows for i in fit if samples[i].stored == f.name}  # the source's own bytes: exact
            todo = [i for i in fit if i not in dec]
            if f.kind == "float":
                dec.update({i: dequantize(quantize(samples[i].rows, f), f) for i in todo})
            else:
                alone = [i for i in todo if f.name in PER_TENSOR_FORMATS or samples[i].constant]
                together = [i for i in todo if i not in alone]
                for g in ([together] if together else []) + [[i] for i in alone]:
                    dec.update(zip(g, _decode_rows([samples[i] for i in g], f, step)))
            for i in fit:  # in format order, as measure_errors returns them
                sums[i, f.name], rows_out[i, f.name] = _error_sums(samples[i], dec[i])
        if not sums:
            continue
        dev = samples[batch[0]].rows.device
        refs = torch.stack([samples[i].ref.to(dev) for i in batch]).tolist()
        vals = torch.stack([v.to(dev) for v in sums.values()]).tolist()  # the one wait for the device
        ref_of = dict(zip(batch, refs))
        for (i, name), (e_w, e_o, kld) in zip(sums, vals):
            f, s = get_format(name), samples[i]
            ref_w, ref_o = ref_of[i]
            te = TensorError(s.n_rows * f.row_bytes(s.rows.shape[1]), f.bpw, e_w / ref_w if ref_w > 0 else 0.0,
                             (e_o / ref_o) ** 0.5 if ref_o > 0 else 0.0, kld)
            out[i][name] = RowErrors(te, s.index.cpu(), s.weights.cpu(), rows_out[i, name].cpu()) if per_row else te
    return out


def measure_errors(weight: torch.Tensor, formats: list[str], rw: RowWeights, *, imatrix: torch.Tensor | None = None,
                   hessian: torch.Tensor | None = None, rows: int | None = None, seed: int = 0) -> dict[str, TensorError]:
    """Errors of one tensor in each format whose block size divides its rows.

    Args:
        weight: (N, K) float weight (torch orientation, rows = output channels or vocabulary).
        formats: format names to try; those that do not fit K are left out of the result.
        rw: row weights for the predicted KL divergence.
        imatrix: (K,) float32 importance passed to the encoders (and used for ``weighted_rel``).
        hessian: (K, K) float32 E[x x^T] for ``output_rel``, or its (K,) diagonal (default: ``rw.hessian``; None:
            diag(imatrix)).
        rows: rows to measure (default :func:`sample_size`: all when N <= 64, else max(32, N // 16) capped at 2048).
        seed: row sampling seed.
    Returns:
        format name -> TensorError (sizes for the whole tensor, errors estimated from the sampled rows).
    Raises:
        ValueError: the imatrix does not have K entries, or is not finite and non-negative.
    """
    return measure_samples([sample_tensor(weight, rw, imatrix=imatrix, hessian=hessian, rows=rows, seed=seed)], formats)[0]


def _error_sums(s: ErrorSample, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((3,) float64 estimated sums of the error ``q - rows``: imatrix-weighted, output (H), predicted KLD;
    (n,) float64 each sampled row's output error ``d H d^T``)."""
    d = q - s.rows
    per_row = quad_rows(d, s.hessian)
    same = s.row_weights.hessian is s.hessian  # (sample_tensor's: one H for both sums)
    return torch.stack([(s.weights * (d * d * s.imp).sum(1).double()).sum(), (s.weights * per_row).sum(),
                        (s.weights * _row_terms(d, s.row_weights, per_row if same else None)).sum()]), per_row


def _batches(samples: list[ErrorSample], limit: int) -> list[list[int]]:
    """Consecutive sample indices, at most ``limit`` sampled weights a batch (at least one sample)."""
    out: list[list[int]] = []
    total = 0
    for i, s in enumerate(samples):
        n = s.rows.numel()
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def _chunks(samples: list[ErrorSample], block_size: int, max_blocks: int):
    """(first, end) block ranges of the samples' concatenated rows: whole rows, at most ``max_blocks`` blocks
    (at least one row), as :func:`~dynaquant.quant.codecs.quantize` chunks one tensor."""
    pos = cur = 0
    for s in samples:
        per_row = s.rows.shape[1] // block_size
        left = s.rows.shape[0]
        while left:
            take = min(left, (max_blocks - cur) // per_row)
            if take == 0:
                if cur:
                    yield pos - cur, pos
                    cur = 0
                    continue
                take = 1
            cur, pos, left = cur + take * per_row, pos + take * per_row, left - take
    if cur:
        yield pos - cur, pos


def _decode_rows(samples: list[ErrorSample], f: Format, step: int) -> list[torch.Tensor]:
    """Each sample's rows encoded to ``f`` and decoded, all samples' blocks in one sequence of codec calls."""
    codec = get_codec(f.name)
    opts = {"backend": "auto", "variant": None} if codec.fast_paths else {}
    bs = f.block_size
    xb = torch.cat([s.rows.reshape(-1) for s in samples]).view(-1, bs)
    wb = torch.cat([s.importance.expand(s.rows.shape).reshape(-1) for s in samples]).view(-1, bs)
    dec = torch.empty_like(xb)
    for b0, b1 in _chunks(samples, bs, max(1, step // bs)):
        dec[b0:b1] = codec.decode_blocks(codec.encode_blocks(xb[b0:b1], wb[b0:b1], **opts))
    flat, out, pos = dec.view(-1), [], 0
    for s in samples:
        out.append(flat[pos:pos + s.rows.numel()].view(s.rows.shape))
        pos += s.rows.numel()
    return out
