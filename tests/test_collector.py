"""The one calibration collector gives, bit for bit, what the two collectors it replaced gave.

Oracles: frozen copies of the old code (``compute_imatrix`` before the collectors were merged, verbatim;
the old ``collect_stats`` reduced to its accumulation of H, run the same way: same hooks, same forward and
backward passes, same dtypes and order). GGUF bytes depend on the imatrix values, so equality is exact.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_analysis import _model as _tiny_moe

from dynaquant.analysis import experts as moe
from dynaquant.analysis.stats import Collect, collect, collect_stats, compute_imatrix


def _tiny_llama() -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


MODELS = {"llama": _tiny_llama, "qwen2moe": lambda: _tiny_moe("qwen2moe")}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.fixture(scope="module")
def chunks():
    return torch.randint(0, 320, (5, 29), generator=torch.Generator().manual_seed(3))  # odd length, odd count


@torch.no_grad()
def _frozen_compute_imatrix(model, chunks, batch_size=1):
    """dynaquant.analysis.imatrix.compute_imatrix before the merge (returns sums, counts, chunks)."""
    mods = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    sums, counts = {}, {}
    device = next(model.parameters()).device

    def hook(name):
        def fn(_mod, inputs, _out):
            x = inputs[0].detach()
            x = x.reshape(-1, x.shape[-1]).to(torch.float32)
            s = (x * x).sum(0).to(torch.float64)
            if name in sums:
                sums[name] += s
            else:
                sums[name] = s
            counts[name] = counts.get(name, 0) + x.shape[0]
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
    n_chunks = 0
    try:
        for i in range(0, chunks.shape[0], batch_size):
            model(chunks[i : i + batch_size].to(device), use_cache=False)
            n_chunks += min(batch_size, chunks.shape[0] - i)
    finally:
        for h in handles:
            h.remove()
    return {k: v.cpu() for k, v in sums.items()}, counts, n_chunks


def _frozen_hessians(model, chunks, fisher_sequences: int, seed: int = 0):
    """H of every linear input and of every expert as the old collect_stats accumulated it: one sequence a pass,
    parameters frozen, the embedding output made to require gradients on Fisher sequences, labels sampled."""
    hs: dict[str, torch.Tensor] = {}

    class Col:
        fisher = False

    col = Col()

    def hook(name):
        def fn(_mod, inputs, _out):
            with torch.no_grad():
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float32)
                if name not in hs:
                    hs[name] = torch.zeros((x.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
                hs[name].addmm_(x.T, x)
        return fn

    def embed_hook(_mod, _inputs, out):
        return out.detach().requires_grad_(True) if col.fisher else None

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    handles.append(model.get_input_embeddings().register_forward_hook(embed_hook))
    experts: dict = {}
    undo = moe.install(model, experts, col)
    req = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    try:
        for i in range(chunks.shape[0]):
            ids = chunks[i : i + 1]
            col.fisher = i < fisher_sequences
            if col.fisher:
                with torch.enable_grad():
                    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].to(torch.float32), -1)
                    with torch.no_grad():
                        y = torch.multinomial(logp.exp(), 1, generator=gen)
                    logp.gather(1, y).sum().backward()
            else:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        moe.uninstall(undo)
        for n, p in model.named_parameters():
            p.requires_grad_(req[n])
    return hs, {k: (st.hessian_sum, st.tokens) for k, st in experts.items()}


@pytest.mark.parametrize("batch_size", [1, 2])
def test_imatrix_is_bit_identical_to_the_old_compute_imatrix(model, chunks, batch_size):
    sums, counts, n_chunks = _frozen_compute_imatrix(model, chunks, batch_size)
    im = compute_imatrix(model, chunks, "calib.txt", progress=False, batch_size=batch_size)
    assert list(im.sums) == list(sums) and list(im.counts) == list(counts)  # same order: same GGUF bytes
    for name, s in sums.items():
        assert im.sums[name].dtype == torch.float64 and im.sums[name].device.type == "cpu"
        assert torch.equal(im.sums[name], s), name
        assert im.counts[name] == counts[name] == chunks.numel(), name
    assert (im.chunks, im.dataset) == (n_chunks, "calib.txt") == (chunks.shape[0], "calib.txt")


def test_imatrix_only_pass_gathers_no_hessian(model, chunks):
    st = collect(model, chunks, Collect(imatrix=True, hessian=False, experts=False), progress=False)
    assert st.inputs == {} and st.outputs == {} and st.experts == {} and st.token_counts is None
    assert st.imatrix is not None and st.imatrix.names() and st.sequences == chunks.shape[0]
    assert all("forward" not in m.__dict__ for m in model.modules())  # experts forwards restored / never replaced


@pytest.mark.parametrize("fisher_sequences", [0, 2])
def test_hessians_are_bit_identical_to_the_old_collect_stats(model, chunks, fisher_sequences):
    hs, experts = _frozen_hessians(model, chunks, fisher_sequences)
    st = collect_stats(model, chunks, fisher_sequences=fisher_sequences, progress=False)
    assert set(st.input_of) == set(hs)
    for name, h in hs.items():
        assert torch.equal(st.input(name).hessian_sum, h), name
        assert st.input(name).tokens == chunks.numel()
    assert set(st.experts) == set(experts) and (bool(experts) == (moe.find_experts(model) != {}))
    for name, (eh, tokens) in experts.items():
        assert set(st.experts[name].hessian_sum) == set(eh) and torch.equal(st.experts[name].tokens, tokens)
        for key, h in eh.items():
            assert torch.equal(st.experts[name].hessian_sum[key], h), (name, key)
    im = st.to_imatrix()
    for name, h in hs.items():
        assert torch.equal(im.sums[name], torch.diagonal(h).to(torch.float64)), name


def test_both_at_once_equal_each_alone(model, chunks):
    """Without the experts forward (it rounds differently from transformers' own, so later layers see other bits)."""
    both = collect(model, chunks, Collect(imatrix=True, experts=False), progress=False)
    im = compute_imatrix(model, chunks, progress=False)
    st = collect(model, chunks, Collect(experts=False), progress=False)
    for name, s in im.sums.items():
        assert torch.equal(both.imatrix.sums[name], s) and both.imatrix.counts[name] == im.counts[name], name
    for key, s in st.inputs.items():
        assert torch.equal(both.inputs[key].hessian_sum, s.hessian_sum), key


def test_collect_refuses_what_it_cannot_do(model, chunks):
    with pytest.raises(ValueError, match="hessian=True"):
        Collect(hessian=False, fisher_sequences=1)
    with pytest.raises(ValueError, match="batch_size"):
        collect(model, chunks, Collect(fisher_sequences=1), batch_size=2, progress=False)


@pytest.mark.parametrize("fisher_sequences", [0, 2])
def test_output_head_runs_only_where_its_logits_are_read(model, chunks, fisher_sequences):
    """Sequences without a backward pass stop at the output head: its matmul runs on the Fisher sequences only, and
    its input statistics are still those of every sequence (the H tests above compare them bit for bit too)."""
    head = model.get_output_embeddings()
    calls = []
    handle = head.register_forward_hook(lambda m, i, o: calls.append(o.shape[-1]))
    try:
        st = collect_stats(model, chunks, fisher_sequences=fisher_sequences, progress=False)
        im = compute_imatrix(model, chunks, progress=False)
    finally:
        handle.remove()
    assert calls == [head.out_features] * fisher_sequences
    assert st.input("lm_head").tokens == im.counts["lm_head"] == chunks.numel()
    assert st.outputs["lm_head"].absmax.shape == (head.out_features,)
    assert (st.outputs["lm_head"].fisher is not None) == (fisher_sequences > 0)


def test_rows_give_the_same_hessians_as_the_sums(model, chunks):
    """``Collect(rows=True)`` (GPTQ's held-out check) keeps every call's input rows instead of adding their x x^T:
    the H formed from them on demand equals the accumulated one bit for bit, for every input (shared ones too), as do
    the token counts, the diagonals and the activation statistics; what it holds is tokens x K a call, not K x K; a
    dropped input keeps its diagonal. Partial mode (several ranks) refuses it."""
    from dynaquant.analysis.stats import Collector, ModelStats

    sums = collect(model, chunks[:2], Collect(fisher_sequences=0), progress=False)
    rows = collect(model, chunks[:2], Collect(fisher_sequences=0, rows=True), progress=False)
    assert sums.input_of == rows.input_of and set(sums.inputs) == set(rows.inputs)
    for key, s in sums.inputs.items():
        r = rows.inputs[key]
        assert r.hessian_sum is None and len(r.rows) == 2 and r.rows[0].shape == (chunks.shape[1], s.hessian_sum.shape[0])
        assert r.tokens == s.tokens and r.modules == s.modules
        assert torch.equal(r.hessian, s.hessian) and torch.equal(r.diag(), s.diag())
        assert torch.equal(r.absmax, s.absmax) and r.sq_sum == s.sq_sum and r.qerr_sum == s.qerr_sum
    key = next(iter(rows.inputs))
    diag = sums.inputs[key].diag().clone()
    rows.inputs[key].drop_hessian()
    assert rows.inputs[key].rows is None and torch.equal(rows.inputs[key].diag(), diag)
    with pytest.raises(ValueError, match="dropped"):
        rows.inputs[key].hessian_on(None)
    with pytest.raises(ValueError, match="hessian=True"):
        Collect(hessian=False, rows=True)
    with pytest.raises(ValueError, match="partial"):
        Collector(model, ModelStats(), Collect(rows=True), partial=True)
