"""The pieces of ``dynaquant.distributed`` a 2-rank run rests on, in one process: the balance of tensors between ranks,
the structure sent with a partial sum, and the claim the fold rests on (one sequence's statistics as a partial sum,
added in sequence order, are the bits of the totals filled directly)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from test_moe_analysis import _model

from dynaquant.analysis.fold import merge_stats
from dynaquant.analysis.stats import Collect, Collector, ModelStats, collect, label_generator, sample_labels
from dynaquant.distributed import Group, _join, _split, rank_threads


def test_assign_is_longest_first_and_the_same_on_every_rank():
    costs = [16.7, 4.2, 4.2, 16.7, 58.7, 58.7, 58.7]  # one Llama-3-8B block's tensors (M weights), in order
    ranks = [Group(r, 2) for r in range(2)]
    owner = ranks[0].assign(costs)
    assert owner == ranks[1].assign(costs)
    assert sorted(ranks[0].mine(costs) + ranks[1].mine(costs)) == list(range(len(costs)))
    load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(2)]
    assert max(load) - min(load) <= max(costs)  # (in-order greedy gave 134 vs 84 here)
    assert max(load) < 0.55 * sum(costs)
    assert Group(0, 1).assign(costs) == [0] * len(costs)


def test_rank_threads_share_the_cores_unless_told(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.delenv("DYNAQUANT_RANK_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun sets for several ranks a node
    assert rank_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert rank_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the user's choice stands
    assert rank_threads() == torch.get_num_threads()
    monkeypatch.setenv("DYNAQUANT_RANK_THREADS", "5")
    assert rank_threads() == 5


@dataclass
class _Box:
    name: str
    t: torch.Tensor
    more: dict


def test_a_structure_splits_into_its_layout_and_tensors_and_joins_back():
    obj = {"a": _Box("x", torch.arange(6).reshape(2, 3), {"y": [torch.ones(2, dtype=torch.float64), 3.5, None]}),
           "b": (1, torch.zeros(0))}
    layout, tensors = _split(obj)
    assert [s[0] for s in layout["tensors"]] == [(2, 3), (2,), (0,)]
    assert not any(isinstance(v, torch.Tensor) for v in (layout["obj"]["a"].t, layout["obj"]["b"][1]))
    back = _join(layout["obj"], [t.clone() for t in tensors])
    assert back["a"].name == "x" and torch.equal(back["a"].t, obj["a"].t) and back["a"].more["y"][1:] == [3.5, None]
    assert back["a"] is not obj["a"] and back["b"][0] == 1
    # no reference cycle holds the tensors: they go with their last reference, not when the cycle collector runs
    n = (1 << 16) + 7  # a size no other tensor here has
    gc.collect()
    gc.disable()
    try:
        layout, tensors = _split({"h": [torch.empty(n)]})
        _join(layout["obj"], tensors)
        del layout, tensors
        assert not [o for o in gc.get_objects() if type(o) is torch.Tensor and o.numel() == n]
    finally:
        gc.enable()


def test_partial_sums_merged_in_order_equal_the_direct_totals():
    model = _model("qwen2moe")
    chunks = torch.randint(0, 320, (4, 24), generator=torch.Generator().manual_seed(3))
    what = Collect(fisher_sequences=2, imatrix=True)
    direct = collect(model, chunks, what, progress=False)
    folded = ModelStats()
    col = Collector(model, folded, what, partial=True)
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        for s in range(chunks.shape[0]):  # collect()'s loop, each sequence's statistics merged after it
            col.fisher = s < what.fisher_sequences
            col.begin()
            part = col.st
            ids = chunks[s : s + 1]
            if col.fisher:
                with torch.enable_grad():
                    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
                    y = sample_labels(logp, label_generator(ids.device, 0, s))
                    logp.gather(1, y).sum().backward()
                part.fisher_sequences += 1
                part.fisher_tokens += ids.numel()
            else:
                with torch.no_grad():
                    col.forward_without_logits(model, {"input_ids": ids})
            part.sequences += 1
            part.tokens += ids.numel()
            part.imatrix.chunks += 1
            merge_stats(folded, col.end())
    finally:
        col.remove()
    assert folded.sequences == direct.sequences and folded.fisher_tokens == direct.fisher_tokens
    assert set(folded.inputs) == set(direct.inputs) and folded.experts.keys() == direct.experts.keys()
    for k, a in direct.inputs.items():
        b = folded.inputs[k]
        assert torch.equal(a.hessian_sum, b.hessian_sum) and torch.equal(a.absmax, b.absmax), k
        assert (a.tokens, a.sq_sum, a.qerr_sum, a.modules) == (b.tokens, b.sq_sum, b.qerr_sum, b.modules), k
    for k, a in direct.outputs.items():
        b = folded.outputs[k]
        assert torch.equal(a.absmax, b.absmax) and a.fisher_tokens == b.fisher_tokens, k
        assert (a.fisher_sum is None) == (b.fisher_sum is None) and (a.fisher_sum is None or torch.equal(a.fisher_sum,
                                                                                                         b.fisher_sum))
    assert torch.equal(direct.embed_fisher_sum, folded.embed_fisher_sum)
    assert torch.equal(direct.token_counts, folded.token_counts)
    for name, a in direct.experts.items():
        b = folded.experts[name]
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.weight_sum, b.weight_sum)
        assert all(torch.equal(a.hessian_sum[k], b.hessian_sum[k]) for k in a.hessian_sum)
        assert all(torch.equal(a.fisher_sum[k], b.fisher_sum[k]) for k in a.fisher_sum)
    assert all(torch.equal(direct.imatrix.sums[k], folded.imatrix.sums[k].cpu()) for k in direct.imatrix.sums)
    assert direct.imatrix.counts == folded.imatrix.counts and direct.imatrix.chunks == folded.imatrix.chunks


def _fold_rank(rank: int, world: int, port: int, out: str) -> None:
    import json
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = Group(rank, world, torch.device("cpu"), joined=True)
        seen = []

        def run(s: int):
            assert g.owns(s)
            if s == 2:
                return None  # nothing to add
            return {"s": s, "x": torch.full((3,), float(s)), "n": [torch.arange(s + 1)]}

        g.fold(5, run, lambda p: seen.append([p["s"], p["x"].tolist(), p["n"][0].tolist()]))
        with open(f"{out}.{rank}", "w") as f:
            json.dump(seen, f)
    finally:
        torch.distributed.destroy_process_group()


def test_a_fold_over_ranks_merges_every_item_in_item_order_on_every_rank(tmp_path):
    """Two ranks (gloo): each rank's items are merged on both in item order; a round
    short of ``world`` items (5 items, 2 ranks) and an item with nothing to add (None) included."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_fold_rank, args=(2, port, str(tmp_path / "seen")), nprocs=2)
    want = [[s, [float(s)] * 3, list(range(s + 1))] for s in (0, 1, 3, 4)]
    assert [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(2)] == [want, want]
