"""The evaluation's scoring (dynaquant.analysis.evaluate): the output head runs on the scored half of each chunk only
(transformers' ``logits_to_keep``), and the figures are those of the whole chunk's logits."""

from __future__ import annotations

import functools

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


def test_a_kept_reference_gives_the_same_figures_and_a_changed_one_is_not_reused(models, tmp_path, monkeypatch):
    """The reference's hidden states at its head are kept between evaluations (analysis.reference_cache): the second
    evaluation reads them and runs no reference forward, with figures equal bit for bit to an uncached one; a
    reference with one weight changed, or other chunks, is a new entry; DYNAQUANT_CACHE=off keeps nothing."""
    from dynaquant.analysis import reference_cache

    ref, other = models
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path))
    chunks = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(5))
    plain = compare_models(ref, other, chunks, progress=False, reference_cache=False)
    first = compare_models(ref, other, chunks, progress=False)
    entries = list((tmp_path / "eval-reference").glob("*.pt"))
    assert len(entries) == 1
    calls = []
    handle = ref.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        second = compare_models(ref, other, chunks, progress=False)
    finally:
        handle.remove()
    assert calls == []  # the reference's body did not run
    assert plain.to_dict() == first.to_dict() == second.to_dict()
    # another weight, other chunks: other keys
    key = reference_cache.fingerprint(ref, chunks, 16)
    changed = transformers.LlamaForCausalLM(ref.config).eval()
    changed.load_state_dict(ref.state_dict())
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight[3, 7] += 1e-3
    assert reference_cache.fingerprint(changed, chunks, 16) != key
    assert reference_cache.fingerprint(ref, chunks.flip(0), 16) != key
    assert compare_models(changed, other, chunks, progress=False).to_dict() == \
        compare_models(changed, other, chunks, progress=False, reference_cache=False).to_dict()
    assert len(list((tmp_path / "eval-reference").glob("*.pt"))) == 2
    monkeypatch.setenv("DYNAQUANT_CACHE", "off")
    compare_models(ref, other, chunks.flip(0), progress=False)
    assert len(list((tmp_path / "eval-reference").glob("*.pt"))) == 2


def test_a_model_whose_logits_are_not_its_heads_output_is_not_cached(models, tmp_path, monkeypatch):
    """A model that changes the logits after its head (here: scaled, as a logit soft-cap or scale would) keeps no
    entry and scores as without the cache."""
    ref, other = models
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path))
    forward = ref.forward

    @functools.wraps(forward)
    def capped(*args, **kwargs):  # the logits changed after the head, as a soft-cap does
        out = forward(*args, **kwargs)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0)
        return out

    monkeypatch.setattr(ref, "forward", capped)
    chunks = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(6))
    got = compare_models(ref, other, chunks, progress=False)
    assert not list(tmp_path.glob("eval-reference/*.pt"))
    assert got.to_dict() == compare_models(ref, other, chunks, progress=False, reference_cache=False).to_dict()
