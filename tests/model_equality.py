"""One check of two loads of a model (tests of ``load_model``'s own fills against transformers' loaders)."""

from __future__ import annotations

import torch


def assert_same_model(ours, theirs, ids: torch.Tensor) -> None:
    """``ours`` and ``theirs`` (transformers causal LMs) are the same model: the same parameter and buffer names, every
    value bit for bit with the same ``requires_grad``, the output head tied alike, the same class, both in eval mode,
    and the same logits bit for bit on ``ids`` ((B, T) int64 token ids)."""
    pa, pb = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert pa.keys() == pb.keys()
    assert [k for k in pa if not (torch.equal(pa[k], pb[k]) and pa[k].requires_grad == pb[k].requires_grad)] == []
    ba, bb = dict(ours.named_buffers()), dict(theirs.named_buffers())
    assert ba.keys() == bb.keys() and [k for k in ba if not torch.equal(ba[k], bb[k])] == []
    assert (ours.get_output_embeddings().weight is ours.get_input_embeddings().weight) == \
        (theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight)
    assert type(ours) is type(theirs) and not ours.training and not theirs.training
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
