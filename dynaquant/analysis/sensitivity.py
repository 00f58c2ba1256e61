"""End-to-end checks: the KL divergence of the final logits when some weights are quantized.

Used two ways: per layer group (attention / MLP of one block) and format, the optional
end-to-end sensitivity that exllamav3 measures, which corrects the per-tensor predictions of
:mod:`.errors`; and for whole plans, to check predicted against measured KL divergence.
Weights are swapped in place (``Q(W)`` decoded to float) and restored afterwards; the KL
divergence is scored on held-out calibration sequences, every position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm

from dynaquant.quant.codecs import dequantize, quantize
from dynaquant.quant.formats import get_format, resolve_for_row


class ReferenceLogits:
    """Log-probabilities of the unmodified model on a few sequences, for KL divergence against it.

    Args:
        model: transformers causal LM; chunks: (n, T) int64 token ids.

    The reference log-probabilities stay on the model's device (n x T x vocab float32: 8 x 512 x 49152 x 4 bytes =
    0.8 GB for SmolLM2, 2.1 GB for a 128k vocabulary), so each KL divergence is computed where the logits are, not
    copied to the host and reduced there (which dominated the measured corrections' time on a GPU).
    """

    @torch.no_grad()
    def __init__(self, model, chunks: torch.Tensor):
        self.chunks = chunks
        self.device = next(model.parameters()).device
        self.logp = [self._logp(model, c) for c in chunks]

    def _logp(self, model, c: torch.Tensor) -> torch.Tensor:
        """(T, vocab) float32 log-probabilities of ``model`` on one (T,) chunk, on the model's device."""
        return torch.log_softmax(model(c.to(self.device)[None], use_cache=False).logits[0].float(), -1)

    @torch.no_grad()
    def kld(self, model) -> float:
        """Mean KL(reference || model) per token (nats) over all positions of the chunks."""
        tot, n = 0.0, 0
        for c, lp in zip(self.chunks, self.logp):
            lq = self._logp(model, c)
            tot += float((lp.exp() * (lp - lq)).sum(-1).clamp_min(0).sum())
            n += lp.shape[0]
        return tot / n


@torch.no_grad()
def decoded_weight(p: torch.Tensor, fmt: str, imatrix: torch.Tensor | None) -> torch.Tensor:
    """``Q(p)`` decoded: ``p`` (any shape, rows on the last axis) encoded in ``fmt`` (the block-size fallback applied
    as llama.cpp does) with the importance ``imatrix`` ((K,), ignored by float formats), decoded back to ``p``'s
    dtype, shape and device."""
    f, _ = resolve_for_row(fmt, p.shape[-1])
    q = dequantize(quantize(p.detach().float(), f, imatrix if f.kind != "float" else None), f)
    return q.to(p.dtype).reshape(p.shape)


@torch.no_grad()
def kld_with_weights(model, ref: ReferenceLogits, formats: dict[str, str],
                     imatrix_of: Callable[[str], torch.Tensor | None]) -> float:
    """KL divergence of the model with some parameters quantized, then restored.

    Args:
        formats: HF parameter name -> format name (block-size fallbacks applied as llama.cpp does).
        imatrix_of: HF parameter name -> (K,) importance for the encoder, or None.
    """
    params = dict(model.named_parameters())
    decoded = {name: decoded_weight(params[name], fmt, imatrix_of(name)) for name, fmt in formats.items()}
    with SwappedWeights(params, decoded, list(decoded)):
        return ref.kld(model)


class SwappedWeights:
    """``with``: the storage of ``params[n]`` exchanged with ``tensors[n]`` (same shape and dtype) for each of
    ``names``, and exchanged back on exit (also on error). No copy of the weights is made where ``tensors[n]`` is on
    the parameter's device; one that lives elsewhere (the CPU, so that a whole plan's decoded weights need no second
    model's worth of GPU memory) is copied to the parameter's device and the parameter's own storage to
    ``tensors[n]``'s device while swapped: the GPU then holds one copy of each weight, plus one tensor in flight."""

    def __init__(self, params: dict, tensors: dict[str, torch.Tensor], names: list[str]):
        self.params, self.tensors, self.names = params, tensors, names

    def _swap(self):
        for n in self.names:
            p, t = self.params[n], self.tensors[n]
            if t.device == p.device:
                p.data, self.tensors[n] = t, p.data
            else:
                self.tensors[n] = p.data.to(t.device)
                p.data = t.to(p.device)

    def __enter__(self):
        self._swap()
        return self

    def __exit__(self, *exc):
        self._swap()


def group_sensitivity(model, ref: ReferenceLogits, groups: dict[str, list[str]], fmts: Iterable[str],
                      imatrix_of: Callable[[str], torch.Tensor | None], progress: bool = True) -> list[dict]:
    """KL divergence when only one group is quantized, for each group and format.

    Args:
        groups: group label (``blk.3.attn``) -> HF parameter names in it.
        fmts: format names (each tensor falls back by row size as llama.cpp does).
    Returns:
        rows ``{"group", "format", "kld"}``.
    """
    fmts = [get_format(f).name for f in fmts]  # unknown names fail before any work
    rows = []
    jobs = [(g, f) for g in groups for f in fmts]
    for g, f in tqdm(jobs, desc="sensitivity", disable=not progress, unit="group"):
        rows.append({"group": g, "format": f, "kld": kld_with_weights(model, ref, {n: f for n in groups[g]}, imatrix_of)})
    return rows
