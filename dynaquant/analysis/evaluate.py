"""Quality of a quantized model against its original: KL divergence, perplexity, top-1 agreement.

Tokens are scored as ``llama-perplexity --kl-divergence`` scores them, so the two tools'
numbers are comparable: the text is tokenized once and cut into chunks of ``n_ctx``
tokens; in each chunk only the second half is scored (the logits at positions
``n_ctx/2 .. n_ctx-2`` predicting the next token), each position with the full first half
as context.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from dynaquant.analysis.reference_cache import ReferenceLogits


@dataclass
class EvalResult:
    """Figures of one evaluation.

    Attributes:
        kld_mean: mean KL(reference || quantized) over scored tokens, in nats.
        kld_p99: 99th percentile of the per-token KL divergence, nats.
        kld_max: largest per-token KL divergence, nats.
        ppl: perplexity of the quantized model on the scored tokens.
        ppl_reference: perplexity of the reference model.
        top1_agreement: fraction of scored positions where both models' argmax agree.
        tokens: scored tokens; chunks: chunks; n_ctx: tokens per chunk; text_id: the text used.
    """

    kld_mean: float
    kld_p99: float
    kld_max: float
    ppl: float
    ppl_reference: float
    top1_agreement: float
    tokens: int
    chunks: int
    n_ctx: int
    text_id: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def _logits(model, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """(T, V) float32 logits of ``ids`` (T,) on the CPU; ``keep`` > 0: of the last ``keep`` positions alone, (keep, V),
    where the model's forward takes transformers' ``logits_to_keep`` (the output head, a vocabulary-wide matmul, then
    runs on those positions only), else all T."""
    device = next(model.parameters()).device
    kw = {"logits_to_keep": keep} if keep and "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    return model(ids.to(device)[None], use_cache=False, **kw).logits[0].to(torch.float32).cpu()


class Scores:
    """The running sums of one evaluation: add each chunk's two logit matrices, then :meth:`result`.

    Args:
        n_ctx: tokens per chunk (the second half is scored); text_id: recorded in the result.
    """

    def __init__(self, n_ctx: int, text_id: str = ""):
        self.n_ctx, self.text_id = n_ctx, text_id
        self.klds: list[torch.Tensor] = []
        self.nll_q = self.nll_r = 0.0
        self.agree = self.chunks = 0

    @torch.no_grad()
    def add(self, ids: torch.Tensor, lr: torch.Tensor, lq: torch.Tensor) -> None:
        """One chunk: ``ids`` (n_ctx,) int64, the reference's and the quantized model's logits: (n_ctx, vocab), or
        those of the last ``n_ctx - n_ctx // 2`` positions (the scored half) alone.

        Raises:
            ValueError: the two vocabularies differ in size.
        """
        first, n_ctx = self.n_ctx // 2, self.n_ctx
        scored = slice(first - n_ctx, -1)  # positions first .. n_ctx - 2 of either
        lr, lq = lr[scored].to(torch.float32).cpu(), lq[scored].to(torch.float32).cpu()
        if lr.shape[-1] != lq.shape[-1]:
            raise ValueError(f"vocabularies differ: reference {lr.shape[-1]}, quantized {lq.shape[-1]}")
        target = ids.cpu()[first + 1 :]
        pr, pq = torch.log_softmax(lr.double(), -1), torch.log_softmax(lq.double(), -1)
        self.klds.append((pr.exp() * (pr - pq)).sum(-1).clamp_min(0))
        self.nll_q -= float(pq.gather(1, target[:, None]).sum())
        self.nll_r -= float(pr.gather(1, target[:, None]).sum())
        self.agree += int((lr.argmax(-1) == lq.argmax(-1)).sum())
        self.chunks += 1

    def result(self) -> EvalResult:
        k = torch.cat(self.klds)
        tokens = k.numel()
        return EvalResult(
            kld_mean=float(k.mean()), kld_p99=float(torch.quantile(k, 0.99)), kld_max=float(k.max()),
            ppl=math.exp(self.nll_q / tokens), ppl_reference=math.exp(self.nll_r / tokens),
            top1_agreement=self.agree / tokens, tokens=tokens, chunks=self.chunks, n_ctx=self.n_ctx,
            text_id=self.text_id,
        )


@torch.no_grad()
def compare_models(reference, quantized, chunks: torch.Tensor, text_id: str = "", progress: bool = True,
                   reference_cache: bool = True) -> EvalResult:
    """Score ``quantized`` against ``reference`` on token chunks.

    Args:
        reference, quantized: transformers causal LMs with the same vocabulary (any device).
        chunks: (n, n_ctx) int64 token ids (``calibration.tokenize_chunks``).
        reference_cache: keep the reference's hidden states at its output head between runs, and use kept ones
            (:mod:`dynaquant.analysis.reference_cache`: a CPU reference only; the same logits bit for bit).
    Returns:
        EvalResult.
    Raises:
        ValueError: the two models' vocabularies differ in size.
    """
    scores = Scores(chunks.shape[1], text_id)
    keep = chunks.shape[1] - chunks.shape[1] // 2  # the scored half
    ref = ReferenceLogits(reference, chunks, keep, _logits, cached=reference_cache)
    for c in tqdm(range(chunks.shape[0]), desc="eval", disable=not progress, unit="chunk"):
        scores.add(chunks[c], ref(c, chunks[c]), _logits(quantized, chunks[c], keep))
    ref.close()
    return scores.result()
