"""One sequence's statistics added into the totals: the fold behind a calibration spread over ranks
(:mod:`dynaquant.distributed`, :class:`dynaquant.analysis.stats.Collector`'s partial mode)."""

from __future__ import annotations

import torch

from dynaquant.analysis.experts import ExpertStats
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.stats import ModelStats


def _add(a, b):
    """``a + b`` for the statistics' sums (in place into ``a``; None: absent)."""
    if b is None:
        return a
    if a is None:
        return b
    if isinstance(a, torch.Tensor):
        return a.add_(b.to(a.device))
    return a + b


def merge_stats(acc: ModelStats, part: ModelStats) -> None:
    """Add ``part`` (one sequence's statistics: :meth:`Collector.begin`) into ``acc`` in place: sums added, maxima
    taken, a module or experts module seen first in ``part`` taken over (its tensors then belong to ``acc``). The
    calibration adds its sequences' statistics in sequence order this way, in one process or spread over ranks
    (:meth:`dynaquant.distributed.Group.fold`), so the sums are the same bits whatever the number of ranks.

    Raises:
        ValueError: ``part`` brings the second moments of an input whose matrix ``acc`` has dropped.
    """
    for name, key in part.input_of.items():
        acc.input_of.setdefault(name, key)
    for key, p in part.inputs.items():
        a = acc.inputs.get(key)
        if a is None:
            acc.inputs[key] = p
            continue
        if a.hessian_sum is None and p.hessian_sum is not None:
            raise ValueError(f"{key}: statistics added after its second moments were dropped")
        a.modules.extend(m for m in p.modules if m not in a.modules)
        a.hessian_sum = _add(a.hessian_sum, p.hessian_sum)
        a.diag_sum = _add(a.diag_sum, p.diag_sum)
        a.tokens += p.tokens
        a.absmax = p.absmax if a.absmax is None else torch.maximum(a.absmax, p.absmax.to(a.absmax.device))
        a.sq_sum += p.sq_sum
        for k in a.qerr_sum:
            a.qerr_sum[k] += p.qerr_sum[k]
    for name, p in part.outputs.items():
        a = acc.outputs.get(name)
        if a is None:
            acc.outputs[name] = p
            continue
        a.absmax = torch.maximum(a.absmax, p.absmax.to(a.absmax.device))
        a.fisher_sum = _add(a.fisher_sum, p.fisher_sum)
        a.fisher_tokens += p.fisher_tokens
    acc.embed_fisher_sum = _add(acc.embed_fisher_sum, part.embed_fisher_sum)
    acc.token_counts = _add(acc.token_counts, part.token_counts)
    for attr in ("sequences", "tokens", "fisher_sequences", "fisher_tokens"):
        setattr(acc, attr, getattr(acc, attr) + getattr(part, attr))
    for name, es in part.experts.items():
        if name in acc.experts:
            _merge_experts(acc.experts[name], es)
        else:
            acc.experts[name] = es
    if part.imatrix is not None:
        if acc.imatrix is None:
            acc.imatrix = Imatrix()
        im = acc.imatrix
        for k, v in part.imatrix.sums.items():
            im.sums[k] = _add(im.sums.get(k), v)
            im.counts[k] = im.counts.get(k, 0) + part.imatrix.counts.get(k, 0)
        im.chunks += part.imatrix.chunks


def _merge_experts(acc: ExpertStats, part: ExpertStats) -> None:
    """Add ``part`` (one sequence's statistics of the same experts module) into ``acc`` in place."""
    for key, h in part.hessian_sum.items():
        acc.hessian_sum[key] = _add(acc.hessian_sum.get(key), h)
    for key, h in part.fisher_sum.items():
        acc.fisher_sum[key] = _add(acc.fisher_sum.get(key), h)
    for attr in ("tokens", "weight_sum", "fisher_tokens"):
        setattr(acc, attr, _add(getattr(acc, attr), getattr(part, attr)))
