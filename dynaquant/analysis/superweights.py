"""Super weights (Yu et al. 2024, "The Super Weight in Large Language Models", arXiv 2411.07191).

A super weight is a single scalar of an ``mlp.down_proj`` that creates a massive activation:
the down projection's *input* spikes at one channel (column ``c``) and its *output* spikes at one
channel (row ``r``), and ``W[r, c]`` carries the spike. Zeroing it alone raises perplexity sharply.

Detection follows the paper: from the per-channel ``max |x|`` of each down_proj's input and output
over the calibration text (:mod:`.stats`), layers whose output spike stands far above the typical
channel (``spike_ratio`` times the median channel maximum) give candidates ``(r, c)``. Each candidate
is confirmed by ablation: the weight is set to zero and the perplexity of a short text measured,
then restored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from dynaquant.analysis.stats import ModelStats
from dynaquant.names import TensorName


def down_proj_layer(module: str) -> int | None:
    """Block index of a text or vision MLP down projection module (``model.layers.3.mlp.down_proj`` -> 3,
    ``model.vision_tower.encoder.layers.1.mlp.down_proj`` -> 1), None for other modules (also
    those under ``blocks.N``)."""
    tn = TensorName.from_hf(module)
    if tn.block is None or tn.leaf != "mlp.down_proj" or tn.prefix.split(".")[-2] != "layers":
        return None
    return tn.block


@dataclass
class SuperWeight:
    """One super-weight candidate.

    Attributes:
        layer: block index; module: HF module name (``model.layers.2.mlp.down_proj``).
        row, column: position in the (out, in) torch weight.
        value: the weight's value.
        spike_in: max |input| at ``column``; spike_out: max |output| at ``row`` (over calibration).
        spike_ratio: ``spike_out`` / median over channels of max |output|.
        ppl_base, ppl_ablated: perplexity of the ablation text with the weight, and with it zeroed.
        confirmed: ``ppl_ablated / ppl_base >= confirm_ratio``.
        tensor: the GGUF tensor holding it (filled by the caller), or None.
    """

    layer: int
    module: str
    row: int
    column: int
    value: float
    spike_in: float
    spike_out: float
    spike_ratio: float
    ppl_base: float = math.nan
    ppl_ablated: float = math.nan
    confirmed: bool = False
    tensor: str | None = None

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_ablated / self.ppl_base

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ppl_ratio"] = self.ppl_ratio
        return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in d.items()}


def find_candidates(model, stats: ModelStats, *, spike_ratio: float = 50.0, max_candidates: int = 8,
                    layer: int | None = None, text: bool | None = None) -> list[SuperWeight]:
    """Super-weight candidates from down_proj input/output spikes, largest spike ratio first (``layer``: that block's
    only, whose weights alone need to be in memory; ``text``: the text model's only (True) or the vision tower's
    (False))."""
    mods = dict(model.named_modules())
    out = []
    want = layer
    for name, o in stats.outputs.items():
        layer = down_proj_layer(name)
        if layer is None or name not in stats.input_of or (want is not None and layer != want):
            continue
        if text is not None and (TensorName.from_hf(name).tower == "text") != text:
            continue
        ratio = float(o.absmax.max() / o.absmax.median().clamp_min(1e-12))
        if ratio < spike_ratio:
            continue
        inp = stats.input(name).absmax
        r, c = int(o.absmax.argmax()), int(inp.argmax())
        w = mods[name].weight.detach()
        out.append(SuperWeight(layer, name, r, c, float(w[r, c]), float(inp[c]), float(o.absmax[r]), ratio))
    out.sort(key=lambda s: -s.spike_ratio)
    return out[:max_candidates]


@torch.no_grad()
def perplexity(model, chunks: torch.Tensor) -> float:
    """Perplexity of a model on (n, T) token chunks (every position after the first scored)."""
    device = next(model.parameters()).device
    nll, n = 0.0, 0
    for ids in chunks:
        ids = ids.to(device)[None]
        logits = model(ids, use_cache=False).logits[0, :-1].to(torch.float32)
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        n += ids.shape[1] - 1
    return math.exp(nll / n)


def _block_list(mods: dict, module: str) -> torch.nn.ModuleList | None:
    """The ModuleList holding the block of ``module`` (``model.layers.11.mlp.down_proj`` -> ``model.layers``, by
    :class:`TensorName`'s parse of the name), or None."""
    tn = TensorName.from_hf(module)
    holder = mods.get(tn.prefix.rsplit(".", 1)[0]) if tn.block is not None else None
    return holder if isinstance(holder, torch.nn.ModuleList) and len(holder) > tn.block else None


class _Prefix:
    """Blocks before an ablated one replay their outputs of the unablated forward (an ablation changes nothing
    before its block), so each ablation runs its own block onwards only. Kept only where replaying gives the
    unablated perplexity bit for bit (checked once, every block replayed but the last): a model whose blocks are
    not a plain chain runs whole forwards as before."""

    def __init__(self, blocks: torch.nn.ModuleList):
        self.blocks = blocks
        self.outputs: list = []

    def record(self, model, chunks: torch.Tensor) -> float:
        """The unablated perplexity, each block's output kept (one chunk; several: nothing kept)."""
        if chunks.shape[0] != 1:
            return perplexity(model, chunks)
        hooks = [b.register_forward_hook(lambda _m, _a, out: self.outputs.append(out)) for b in self.blocks]
        try:
            base = perplexity(model, chunks)
        finally:
            for h in hooks:
                h.remove()
        if len(self.outputs) != len(self.blocks) or self.run(model, chunks, len(self.blocks) - 1) != base:
            self.outputs = []
        return base

    def run(self, model, chunks: torch.Tensor, first: int) -> float:
        """Perplexity with blocks ``0 .. first - 1`` replaying their kept outputs."""
        for i in range(first):
            self.blocks[i].forward = (lambda out: lambda *a, **k: out)(self.outputs[i])
        try:
            return perplexity(model, chunks)
        finally:
            for i in range(first):
                del self.blocks[i].forward


@torch.no_grad()
def confirm(model, candidates: list[SuperWeight], chunks: torch.Tensor, confirm_ratio: float = 1.1) -> list[SuperWeight]:
    """Ablate each candidate (zero it, measure perplexity on ``chunks``, restore it); fills the ppl fields. With one
    chunk, each ablation runs from its own block on (:class:`_Prefix`: the same perplexities bit for bit)."""
    mods = dict(model.named_modules())
    blocks = _block_list(mods, candidates[0].module) if candidates else None
    prefix = _Prefix(blocks) if blocks is not None else None
    base = prefix.record(model, chunks) if prefix is not None else perplexity(model, chunks)
    for s in candidates:
        w = mods[s.module].weight
        keep = w[s.row, s.column].clone()
        w[s.row, s.column] = 0
        try:
            replay = prefix is not None and prefix.outputs and _block_list(mods, s.module) is blocks
            s.ppl_ablated = prefix.run(model, chunks, s.layer) if replay else perplexity(model, chunks)
        finally:
            w[s.row, s.column] = keep
        s.ppl_base = base
        s.confirmed = s.ppl_ratio >= confirm_ratio
    return candidates


def confirm_blockwise(sk, candidates: list[SuperWeight], chunks: torch.Tensor, confirm_ratio: float = 1.1,
                      progress: bool = False) -> list[SuperWeight]:
    """:func:`confirm` on a model skeleton, one block in memory at a time: the original and every ablation run as
    variants of one block-wise pass (:func:`dynaquant.analysis.blockwise.stream_logits`; an ablation's states are
    the original's up to its block). Same perplexities as :func:`confirm` on the whole model."""
    from dynaquant.analysis.blockwise import stream_logits

    nll = [0.0] * (len(candidates) + 1)
    n = [0] * (len(candidates) + 1)

    def edit(v: int, i, _block):
        if v == 0 or candidates[v - 1].layer != i:
            return None
        s = candidates[v - 1]
        w = sk.model.get_submodule(s.module).weight
        keep = w[s.row, s.column].clone()
        w[s.row, s.column] = 0

        def undo():
            w[s.row, s.column] = keep
        return undo

    def reduce(s: int, v: int, lg: torch.Tensor):
        ids = chunks[s].to(lg.device)
        nll[v] += float(torch.nn.functional.cross_entropy(lg[:-1], ids[1:], reduction="sum"))
        n[v] += ids.shape[0] - 1

    stream_logits(sk, chunks, len(candidates) + 1, edit, reduce, progress=progress)
    base = math.exp(nll[0] / n[0])
    for k, s in enumerate(candidates, start=1):
        s.ppl_base, s.ppl_ablated = base, math.exp(nll[k] / n[k])
        s.confirmed = s.ppl_ratio >= confirm_ratio
    return candidates
