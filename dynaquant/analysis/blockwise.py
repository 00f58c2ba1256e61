"""The calibration pass block by block: the statistics of :func:`.stats.collect` without the whole model in memory.

The model is a :class:`~dynaquant.sources.skeleton.ModelSkeleton` (meta-device parameters); at any moment only the
outer part (token embedding, final norm, output head) and one decoder block hold real weights. The sequences'
hidden states between blocks are kept (on ``store_device``), so the calibration text crosses each block once:

1. **inputs**: the model's own forward runs with every decoder block replaced by a pass-through that records its
   arguments (attention masks, RoPE tables, positions: whatever the architecture's forward gives its blocks) and
   the first block's input; the token counts are taken here;
2. **forward sweep**: for each block in turn, load it, run every sequence through it (the collector's hooks gather
   H, activation statistics, output maxima, MoE routing and per-expert statistics, exactly as in the
   whole-model pass), keep the outputs as the next block's inputs, free it; the Fisher sequences' inputs of every
   block are kept too;
3. **head**: the model's forward again, the blocks passing the final hidden states through: the output head's
   statistics; on the Fisher sequences the logits, labels sampled from them (the same generator as the
   whole-model pass) and the gradient reaching the last block's output;
4. **backward sweep** (Fisher sequences only): from the last block to the first, load it, recompute it from its
   stored input and back-propagate the gradient (the collector adds each linear output's squared gradient, no
   forward statistic twice), then the embedding's.

The statistics equal the whole-model pass's (same operations in the same order per module; tested). Memory:
one block's and the outer part's weights, plus ``n_seq * T * hidden`` floats of hidden states and, for the
Fisher sequences, ``(n_blocks + 1) * fisher_sequences * T * hidden`` (:func:`hidden_bytes`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from dynaquant.analysis.fold import merge_stats
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.stats import Collect, Collector, ModelStats, label_generator, sample_labels, stats_from_state, stats_state
from dynaquant.distributed import group
from dynaquant.progress import RunProgress, stage_bar
from dynaquant.sources.skeleton import OUTER, ModelSkeleton


class _Caught(Exception):  # noqa: N818 - a signal: the embedding pass ends at the first block
    def __init__(self, hidden: torch.Tensor, kwargs: dict):
        super().__init__("first block reached")
        self.hidden, self.kwargs = hidden, kwargs


class _Blocks:
    """Replaces the decoder blocks' forwards (instance attribute; undone by :meth:`restore`).

    A block the model's forward does not call for a sequence (Mllama's cross-attention layers on text-only
    sequences) has no arguments recorded (``None``): the sweeps pass that sequence's hidden states (and gradients)
    through it unchanged, as the whole model does."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers
        self.calls: list[tuple[tuple, dict] | None] = [None] * len(layers)
        self.first: list | None = None

    def record(self):
        """Blocks record their arguments and pass their input through; the first block called appends its input to
        :attr:`first` (when set)."""
        for i, layer in enumerate(self.layers):
            def fwd(hidden_states, *args, _i=i, **kwargs):
                if self.first is not None and all(c is None for c in self.calls):
                    self.first.append(hidden_states)
                self.calls[_i] = (args, kwargs)
                return hidden_states
            layer.forward = fwd

    def output(self, final: torch.Tensor):
        """Every block returns ``final`` (so the last block the forward calls does)."""
        for layer in self.layers:
            layer.forward = lambda hidden_states, *a, **k: final

    def catch(self):
        """The first block called raises :class:`_Caught` with its input and keyword arguments."""
        def fwd(hidden_states, *args, **kwargs):
            raise _Caught(hidden_states, kwargs)
        for layer in self.layers:
            layer.forward = fwd

    def restore(self):
        for layer in self.layers:
            layer.__dict__.pop("forward", None)


def _inputs(chunks, s: int, device) -> dict:
    """Model inputs of calibration item ``s``: ``{"input_ids": (1, T)}`` of a token tensor, or a processor's batch
    (a VL model's image + text item) on ``device``."""
    if isinstance(chunks, (list, tuple)):
        return {k: v.to(device) for k, v in chunks[s].items()}
    return {"input_ids": chunks[s : s + 1].to(device)}


def _grad_keys(kwargs: dict) -> list[str]:
    """The keyword arguments of a block call that carry gradients to the outer part (Mllama's
    ``cross_attention_states``, computed by the vision tower from ``pixel_values``)."""
    return sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad)


def hidden_bytes(n_seq: int, seq_len: int, hidden: int, n_blocks: int, fisher_sequences: int) -> int:
    """Bytes of float32 hidden states the block-wise pass keeps: every sequence's current hidden states plus the
    Fisher sequences' input of every block and their gradient."""
    per_seq = seq_len * hidden * 4
    return per_seq * (n_seq + fisher_sequences * (n_blocks + 1))


class SpillList:
    """A list of per-sequence tensors kept as files in ``folder`` (``NNNNN.pt``, each written atomically), read back
    one at a time: the hidden states beyond a memory limit (``--max-cpu-memory``)."""

    def __init__(self, folder: Path, n: int):
        self.folder, self.n = Path(folder), n
        self.folder.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: int) -> torch.Tensor:
        return torch.load(self.folder / f"{s:05d}.pt", weights_only=True)

    def __setitem__(self, s: int, x: torch.Tensor) -> None:
        p = self.folder / f"{s:05d}.pt"
        tmp = p.with_name(f".{p.name}.tmp")
        torch.save(x.detach().cpu().clone(), tmp)
        os.replace(tmp, p)

    def __iter__(self):
        return (self[s] for s in range(self.n))


def _hidden(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # transformers >= 5 blocks return the hidden states


class Checkpoints(Protocol):
    """Where a resumable run keeps its checkpoints (:class:`dynaquant.pipeline.rundir.RunDir`)."""

    def save(self, name: str, state: dict) -> None: ...
    def load(self, name: str, device: str | torch.device = "cpu") -> dict | None: ...
    def remove(self, name: str) -> None: ...


_FORWARD, _HEAD, _BACKWARD = "analysis/forward.pt", "analysis/head.pt", "analysis/backward.pt"


def _fisher_in_name(i: int) -> str:
    return f"analysis/fisher-in-{i:05d}.pt"


def collect_blockwise(sk: ModelSkeleton, chunks: torch.Tensor, what: Collect | None = None, *, seed: int = 0,
                      progress: bool | RunProgress = True, store_device: str | torch.device = "cpu",
                      on_block: Callable[[int, ModelStats], None] | None = None,
                      checkpoints: Checkpoints | None = None,
                      extra: tuple[Callable[[], dict], Callable[[dict], None]] | None = None,
                      offload_dir: str | os.PathLike | None = None,
                      riders: tuple[torch.Tensor, ModelStats] | None = None,
                      checkpoint_every: float = 0.0) -> ModelStats:
    """:func:`.stats.collect` on a skeleton, one decoder block in memory at a time (see the module docstring).

    Args:
        sk: the model's skeleton (parts are materialized and released here; the outer part stays materialized).
        chunks: (n, seq_len) int64 token ids, or a list of model-input dicts (``input_ids`` (1, T) int64 plus, for a
            vision-language model, the processor's image tensors: :mod:`.vl_calibration`), as :func:`.stats.collect`.
            Image items: the vision tower (outer part) runs once in the first step (its statistics) and once more in
            the last (its Fisher diagonals, the gradients reaching the first block's input and, for Mllama, every
            cross-attention layer's ``cross_attention_states``); the head step runs on the token ids alone.
        what: the statistics to gather (as :func:`.stats.collect`; default ``Collect()``).
        seed: label-sampling seed of the Fisher sequences.
        progress: show a progress bar (one step per block and sweep), or the run's
            (:class:`dynaquant.progress.RunProgress`, stage ``"calibration"``).
        store_device: where the hidden states between blocks are kept.
        on_block: called as ``on_block(i, stats)`` after the forward sweep of block ``i``, the block still
            materialized: its statistics are complete but for the Fisher diagonals (the analysis measures the
            block's errors here and may then drop its H, :meth:`.stats.ModelStats.drop_hessians`).
        checkpoints: keep a checkpoint after every block of both sweeps and after the head there (hidden states or
            gradients, the statistics, ``extra``'s state), the Fisher sequences' block inputs too (on disk, not in
            memory), and continue from the latest one found: the result is bit for bit an uninterrupted run's.
        extra: (get, set) of the caller's own state, saved with each checkpoint and handed back on resuming.
        checkpoint_every: seconds: a checkpoint whose hidden states or gradients are in memory is written only once
            this long has passed since the last one (or the start); a restart continues from the last one written,
            redoing what came after (the same bits). 0: after every block. A checkpoint of hidden states in files
            (``offload_dir``) names their folder and is written after every block. Several ranks: rank 0's clock
            decides for all. Each in-memory checkpoint writes every sequence's hidden states (a Llama-3-8B block's
            32 x 512 tokens: 268 MB).
        offload_dir: keep the hidden states between blocks (and without ``checkpoints`` the Fisher sequences' block
            inputs) as files there, one sequence in memory at a time (:class:`SpillList`; the caller decides, e.g.
            when :func:`hidden_bytes` exceeds ``--max-cpu-memory``); None: in memory on ``store_device``.
        riders: (ids (m, seq_len), stats): more sequences carried through the forward sweep whose H and activation
            statistics go to ``stats`` instead (GPTQ's held-out check), complete for block ``i`` when ``on_block(i,
            ...)`` runs; each runs with its own block arguments. Not with ``checkpoints``.
    Returns:
        ModelStats equal to ``collect(model, chunks, what, seed=seed)`` on the whole model (tensors on the
        skeleton's device; ``token_counts`` and the imatrix sums on CPU).
    Raises:
        ValueError: ``chunks`` is not a 2-D token tensor.
    """
    items = isinstance(chunks, (list, tuple))
    if items and not all(isinstance(c, dict) and isinstance(c.get("input_ids"), torch.Tensor) for c in chunks):
        raise ValueError("block-wise calibration takes model-input dicts with input_ids")
    if not items and (not isinstance(chunks, torch.Tensor) or chunks.dim() != 2):
        raise ValueError("block-wise calibration takes (n, seq_len) token ids or a list of model-input dicts")
    if riders is not None and (checkpoints is not None or items or riders[0].shape[1] != chunks.shape[1]):
        raise ValueError("riders: sequences of the calibration's length, token ids, without checkpoints")
    what = Collect() if what is None else what
    model, dev = sk.model, sk.device
    n_seq = len(chunks) if items else chunks.shape[0]
    nf = min(what.fisher_sequences, n_seq)
    n_tokens = sum(c["input_ids"].numel() for c in chunks) if items else chunks.numel()
    resume, stage = None, None
    for kind, name in (("backward", _BACKWARD), ("head", _HEAD), ("forward", _FORWARD)):
        if checkpoints is not None and (resume := checkpoints.load(name, dev)) is not None:
            stage = kind  # the latest checkpoint: continue after it
            break
    if resume is not None:
        st = stats_from_state(resume["stats"])
        if st.token_counts is not None:
            st.token_counts = st.token_counts.cpu()
        if extra is not None:
            extra[1](resume["extra"])
    else:
        st = ModelStats(imatrix=Imatrix() if what.imatrix else None)
    grp = group()  # several ranks: each runs its sequences (s % world), the statistics folded in order on all

    def merge(part: ModelStats) -> None:
        merge_stats(st, part)

    sk.materialize(OUTER)
    col = Collector(model, st, what, device=dev, partial=grp.active)  # (one process: the totals directly)
    rider_col = None
    if riders is not None:
        rider_col = Collector(model, riders[1], Collect(hessian=True, experts=False), device=dev)
        rider_col.accumulate = rider_col.count_tokens = False
    blocks = _Blocks(sk.layers)
    bar = stage_bar(progress, "calibration", 2 * sk.n_blocks + 2, "step")

    last_save = [time.monotonic()]

    def save(name: str, always: bool = False, **state) -> None:
        if checkpoints is None:
            return
        due = always or checkpoint_every <= 0 or time.monotonic() - last_save[0] >= checkpoint_every
        if not grp.share(due, 0):  # (several ranks: rank 0's decision, so that every rank writes the same step)
            return
        checkpoints.save(name, {**state, "stats": stats_state(st), "extra": extra[0]() if extra else {}})
        last_save[0] = time.monotonic()

    try:
        # 1. the first block's inputs and every block's arguments, per sequence (the token counts: once); this
        # rank's sequences only (the others' entries stay None)
        hidden: list = [None] * n_seq
        calls: list = [None] * n_seq
        blocks.record()
        col.count_tokens = resume is None

        def inputs(s: int):
            col.begin()
            first: list[torch.Tensor] = []
            with torch.no_grad():
                calls[s] = _forward_to_head(model, col, _inputs(chunks, s, dev), blocks, first)
            hidden[s] = first[-1].to(store_device)
            part = col.end()
            return part if resume is None else None  # (resumed: its statistics are in the checkpoint's)

        grp.fold(n_seq, inputs, merge)
        rider_h: list[torch.Tensor] = []
        rider_calls: list = []  # (each rank runs every rider: their own block arguments)
        for r in range(riders[0].shape[0] if riders is not None else 0):
            with torch.no_grad():
                rider_calls.append(_forward_to_head(model, None, {"input_ids": riders[0][r : r + 1].to(dev)}, blocks,
                                                    rider_h))
        bar.update(1)
        col.count_tokens = False
        # 2. forward sweep
        start = resume["block"] + 1 if stage == "forward" else (sk.n_blocks if resume is not None else 0)
        spill = Path(offload_dir) if offload_dir is not None else None
        if stage == "forward":
            hidden = SpillList(resume["hidden_dir"], n_seq) if "hidden_dir" in resume else \
                [h.to(store_device) if h is not None else None for h in resume["hidden"]]
        elif spill is not None:  # the first block's inputs to files
            first, hidden = hidden, SpillList(spill / "hidden-in", n_seq)
            for s, h in enumerate(first):
                if h is not None:
                    hidden[s] = h
            del first
        fisher_in: list = [[] for _ in range(sk.n_blocks)]
        bar.update(start)
        for i in range(start, sk.n_blocks):
            t_block = time.perf_counter()
            bar.set_description(f"calibration: block {i + 1} of {sk.n_blocks}, forward")
            blocks.restore()
            sk.materialize(i)
            layer = sk.layers[i]
            if checkpoints is not None and nf:
                checkpoints.save(_fisher_in_name(i), {"x": [hidden[s] if grp.owns(s) else None for s in range(nf)]})
            elif spill is not None and nf:
                fisher_in[i] = SpillList(spill / f"fisher-in-{i:05d}", nf)
                for s in range(nf):
                    if grp.owns(s):
                        fisher_in[i][s] = hidden[s]
            else:
                fisher_in[i] = [hidden[s] if grp.owns(s) else None for s in range(nf)]
            # outputs into new storage (files: the other of two folders), so that the last checkpoint's stay whole
            out = SpillList(spill / f"hidden-{i % 2}", n_seq) if spill is not None else [None] * n_seq

            def forward(s: int, out=out, layer=layer, i=i, hidden=hidden):
                x = hidden[s]
                if calls[s][i] is None:  # not called for this sequence (module docstring)
                    out[s] = x
                    return None
                args, kwargs = calls[s][i]
                col.begin()
                with torch.no_grad():
                    out[s] = _hidden(layer(x.to(dev), *args, **kwargs)).to(store_device)
                return col.end()

            grp.fold(n_seq, forward, merge)
            hidden = out
            if rider_col is not None and rider_calls[0][i] is not None:  # the riders through the block, own statistics
                col.accumulate, rider_col.accumulate = False, True
                for r, x in enumerate(rider_h):
                    args, kwargs = rider_calls[r][i]
                    rider_col.last = None
                    with torch.no_grad():
                        rider_h[r] = _hidden(layer(x.to(dev), *args, **kwargs)).to(store_device)
                col.accumulate, rider_col.accumulate = True, False
            if on_block is not None:
                on_block(i, st)
            sk.release(i)
            if isinstance(hidden, SpillList):
                save(_FORWARD, always=True, block=i, hidden_dir=str(hidden.folder))
            else:
                save(_FORWARD, block=i, hidden=hidden)
            bar.set_postfix_str(f"{n_tokens / (time.perf_counter() - t_block):.0f} tokens/s")
            bar.update(1)
        # 3. the head: its statistics; logits, labels and the last block's output gradient of the Fisher sequences
        grads: list = [None] * nf
        if stage in ("head", "backward"):
            grads = [g.to(store_device) if g is not None else None for g in resume["grads"]]
        else:
            def head(s: int):  # (the blocks give the final states: the token ids alone, no image, suffice)
                col.begin()
                part = col.st
                ids = (chunks[s]["input_ids"] if items else chunks[s : s + 1]).to(dev)
                if s < nf:
                    h = hidden[s].to(dev).requires_grad_(True)
                    blocks.output(h)
                    col.fisher = True
                    with torch.enable_grad():
                        logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
                        logp = torch.log_softmax(logits, -1)
                        with torch.no_grad():
                            y = sample_labels(logp, label_generator(dev, seed, s))
                        logp.gather(1, y).sum().backward()
                    grads[s] = h.grad.to(store_device)
                    col.fisher = False
                    part.fisher_sequences += 1
                    part.fisher_tokens += ids.numel()
                else:
                    blocks.output(hidden[s].to(dev))
                    with torch.no_grad():
                        col.forward_without_logits(model, {"input_ids": ids})
                part.sequences += 1
                part.tokens += ids.numel()
                if part.imatrix is not None:
                    part.imatrix.chunks += 1
                return col.end()

            grp.fold(n_seq, head, merge)
            save(_HEAD, grads=grads)
        if rider_col is not None:  # the riders' head input (its H for GPTQ's check)
            col.accumulate, rider_col.accumulate = False, True
            for r, h in enumerate(rider_h):
                rider_col.last = None
                blocks.output(h.to(dev))
                with torch.no_grad():
                    rider_col.forward_without_logits(model, {"input_ids": riders[0][r : r + 1].to(dev)})
            col.accumulate, rider_col.accumulate = True, False
        hidden = None  # (freed)
        bar.update(1)
        # 4. backward sweep over the Fisher sequences, then the embedding (and a VL model's vision tower)
        col.fisher, col.accumulate = True, False
        keys = [_outer_grad_keys(model, blocks, chunks[s], dev, col) if items and grp.owns(s) else []
                for s in range(nf)]
        outer_grads: list[dict] = [{} for _ in range(nf)]  # per sequence: key -> gradient of a block argument
        if stage == "backward":
            outer_grads = [{k: v.to(store_device) for k, v in g.items()} for g in resume.get("outer_grads", outer_grads)]
        top = resume["block"] - 1 if stage == "backward" else sk.n_blocks - 1
        bar.set_postfix_str("")
        bar.update(sk.n_blocks - 1 - top)
        for i in range(top, -1, -1):
            bar.set_description(f"calibration: block {i + 1} of {sk.n_blocks}, Fisher backward")
            if nf:
                blocks.restore()
                sk.materialize(i)
                layer = sk.layers[i]
                xs = fisher_in[i] if checkpoints is None else checkpoints.load(_fisher_in_name(i), dev)["x"]

                def backward(s: int, xs=xs, layer=layer, i=i):
                    if calls[s][i] is None:  # not called: the gradient passes through
                        return None
                    col.begin()
                    x = xs[s].to(dev).requires_grad_(True)
                    args, kwargs = calls[s][i]
                    leaves = {k: kwargs[k].detach().requires_grad_(True) for k in keys[s] if k in kwargs}
                    with torch.enable_grad():
                        torch.autograd.backward(_hidden(layer(x, *args, **{**kwargs, **leaves})), grads[s].to(dev))
                    grads[s] = x.grad.to(store_device)
                    for k, v in leaves.items():
                        if v.grad is not None:
                            g = v.grad.to(store_device)
                            outer_grads[s][k] = g if k not in outer_grads[s] else outer_grads[s][k] + g
                    return col.end()

                grp.fold(nf, backward, merge)
                sk.release(i)
                save(_BACKWARD, block=i, grads=grads, outer_grads=outer_grads)
            fisher_in[i] = []
            bar.update(1)
        blocks.restore()
        blocks.catch()

        def embedding(s: int):
            col.begin()
            with torch.enable_grad():
                try:
                    model(**_with_pixel_grad(_inputs(chunks, s, dev)), use_cache=False)
                except _Caught as caught:
                    more = sorted(outer_grads[s].items())
                    torch.autograd.backward([caught.hidden] + [caught.kwargs[k] for k, _ in more],
                                            [grads[s].to(dev)] + [g.to(dev) for _, g in more])
            return col.end()

        grp.fold(nf, embedding, merge)
        bar.update(1)
    finally:
        bar.close()
        blocks.restore()
        col.remove()
        if rider_col is not None:
            rider_col.remove()
    if st.imatrix is not None:
        st.imatrix.sums = {k: v.cpu() for k, v in st.imatrix.sums.items()}
    return st


class _Stop(Exception):  # noqa: N818 - a signal: the forward pass ends at the output head
    pass


def _stop(*_):
    raise _Stop()


def _forward_to_head(model, col: Collector | None, batch: dict, blocks: _Blocks, first: list) -> list:
    """The model's forward with recording blocks (:meth:`_Blocks.record`), stopped before the output head; the
    first block's input is appended to ``first``; returns the blocks' recorded arguments (None: a block not called).
    With a collector: its ``forward_without_logits`` (the embedding hook counts the tokens), gathering nothing at
    the head."""
    blocks.calls, blocks.first = [None] * len(blocks.layers), first
    try:
        if col is not None:
            col.forward_without_logits(model, batch, collect=False)
        else:
            handle = model.get_output_embeddings().register_forward_pre_hook(_stop)
            try:
                model(**batch, use_cache=False)
            except _Stop:
                pass
            finally:
                handle.remove()
    finally:
        blocks.first = None
    return list(blocks.calls)


def _with_pixel_grad(batch: dict) -> dict:
    """``batch`` with floating ``pixel_values`` requiring gradients (they reach the vision tower's linears), as the
    whole-model pass does for its Fisher sequences."""
    pv = batch.get("pixel_values")
    if pv is not None and pv.is_floating_point():
        batch["pixel_values"] = pv.detach().requires_grad_(True)
    return batch


def _outer_grad_keys(model, blocks: _Blocks, item: dict, dev, col: Collector) -> list[str]:
    """The block arguments through which an item's gradients reach the outer part besides the hidden states
    (:func:`_grad_keys`), found by a forward of the outer part that stops at the first block (nothing collected)."""
    if "pixel_values" not in item:
        return []
    blocks.catch()
    fisher, col.fisher = col.fisher, False
    try:
        with torch.enable_grad():
            model(**_with_pixel_grad(_inputs([item], 0, dev)), use_cache=False)
    except _Caught as caught:
        return _grad_keys(caught.kwargs)
    finally:
        col.fisher = fisher
        blocks.restore()
    return []


@torch.no_grad()
def stream_logits(sk: ModelSkeleton, chunks: torch.Tensor, n_variants: int,
                  edit: Callable[[int, object, torch.nn.Module | None], Callable[[], None] | None],
                  reduce: Callable[[int, int, torch.Tensor], None], *, progress: bool | RunProgress = False,
                  store_device: str | torch.device = "cpu", desc: str = "blocks") -> None:
    """Run token sequences through variants of a model, block by block, and hand the variants' logits on.

    Variant 0 is the model as the source holds it; ``edit(v, part, module)`` may change a materialized part's
    weights for variant ``v`` (a super-weight ablation, a quantized copy) and returns the undo, or None for no
    change. ``part`` is a block index (``module`` the block) or :data:`~dynaquant.sources.skeleton.OUTER`
    (``module`` None: the embedding and head; called once before the blocks and once per sequence at the end, so
    it should be cheap, e.g. swap cached tensors). A variant's hidden states are the original's until its first
    edit (not computed twice). Memory: one block's weights and ``n_variants * n * T * hidden`` floats at most.

    Args:
        sk: the skeleton (the outer part stays materialized).
        chunks: (n, T) int64 token ids.
        n_variants: V >= 1.
        edit: see above; per block called once per variant, in block order, variant 0 included.
        reduce: ``reduce(s, v, logits)`` with variant ``v``'s (T, vocab) float32 logits of sequence ``s``; for each
            sequence in order, variants in order (variant 0 first: a caller comparing with it keeps that one).
        progress: show a progress bar (one step per block), or the run's (:class:`dynaquant.progress.RunProgress`;
            ``desc`` names the stage).
        store_device: where the hidden states between blocks are kept.
    """
    model, dev = sk.model, sk.device
    sk.materialize(OUTER)
    blocks = _Blocks(sk.layers)
    hidden: list[list[torch.Tensor] | None] = [None] * n_variants
    calls: list[list[tuple[tuple, dict]]] = []
    try:
        blocks.record()
        for v in range(n_variants):
            undo = edit(v, OUTER, None)
            if v > 0 and undo is None:
                continue
            first: list[torch.Tensor] = []
            try:
                for s in range(chunks.shape[0]):
                    called = _forward_to_head(model, None, {"input_ids": chunks[s : s + 1].to(dev)}, blocks, first)
                    first[-1] = first[-1].to(store_device)
                    if v == 0:
                        calls.append(called)
            finally:
                if undo is not None:
                    undo()
            hidden[v] = first
        bar = stage_bar(progress, desc, sk.n_blocks, "block")
        for i in range(sk.n_blocks):
            bar.set_description(f"{desc}: block {i + 1} of {sk.n_blocks}")
            blocks.restore()
            sk.materialize(i)
            layer = sk.layers[i]
            base_in = list(hidden[0])
            for v in range(n_variants):
                undo = edit(v, i, layer)
                if hidden[v] is None and undo is None:
                    continue  # still the original's states
                states = hidden[v] if hidden[v] is not None else list(base_in)
                try:
                    for s, x in enumerate(states):
                        if calls[s][i] is None:  # not called for this sequence: passed through
                            continue
                        args, kwargs = calls[s][i]
                        states[s] = _hidden(layer(x.to(dev), *args, **kwargs)).to(store_device)
                finally:
                    if undo is not None:
                        undo()
                hidden[v] = states
            sk.release(i)
            bar.update(1)
        bar.close()
        for s in range(chunks.shape[0]):
            ids = chunks[s : s + 1].to(dev)
            for v in range(n_variants):
                blocks.output((hidden[v] if hidden[v] is not None else hidden[0])[s].to(dev))
                undo = edit(v, OUTER, None)
                try:
                    logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
                finally:
                    if undo is not None:
                        undo()
                reduce(s, v, logits)
    finally:
        blocks.restore()
