"""The evaluation's scoring (dynaquant.analysis.evaluate): the output head runs on the scored half of each chunk only
(transformers' ``logits_to_keep``), and the figures are those of the whole chunk's logits."""

from __future__ import annotations

import pytest
import torch
import transformers

from dynaquant.analysis.evaluate import Scores, _logits, compare_models


@pytest.fixture(scope="module")
def models():
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(cfg).eval()
    return ref, other


def test_kept_logits_are_the_last_positions(models):
    ref, _ = models
    ids = torch.randint(0, 300, (33,), generator=torch.Generator().manual_seed(2))
    full, kept = _logits(ref, ids), _logits(ref, ids, keep=17)
    assert full.shape == (33, 300) and kept.shape == (17, 300)
    torch.testing.assert_close(kept, full[-17:], rtol=1e-5, atol=1e-5)


def test_scores_of_the_kept_half_equal_those_of_whole_chunks(models):
    """compare_models (the scored half's logits alone) gives the figures of Scores fed the whole chunks' logits, for
    an even and an odd chunk length (positions n_ctx // 2 .. n_ctx - 2 scored)."""
    ref, other = models
    for n_ctx in (32, 33):
        chunks = torch.randint(0, 300, (3, n_ctx), generator=torch.Generator().manual_seed(n_ctx))
        got = compare_models(ref, other, chunks, progress=False)
        want = Scores(n_ctx)
        for c in chunks:
            want.add(c, _logits(ref, c), _logits(other, c))
        w = want.result()
        assert got.tokens == w.tokens == 3 * (n_ctx - n_ctx // 2 - 1)
        for f in ("kld_mean", "kld_p99", "kld_max", "ppl", "ppl_reference", "top1_agreement"):
            assert getattr(got, f) == pytest.approx(getattr(w, f), rel=1e-5, abs=1e-7), f
