"""Measured KL divergence of a whole plan and of each of its groups quantized alone (exllamav3's measured ΔKL).

The predicted KL divergence of a plan is a sum of per-tensor predictions (:mod:`.errors`); at low sizes it
undershoots what the model feels. :func:`measure_plan` measures, on held-out calibration sequences
(:class:`~dynaquant.analysis.sensitivity.ReferenceLogits`, every position), the KL divergence of

- each group (:func:`correction_group`) quantized ALONE at the plan's formats, the rest of the model exact, and
- the whole plan, every group quantized at once;

so that the pipeline (:mod:`dynaquant.pipeline.corrections`) can fit a correction factor per group
(measured / predicted) and one interaction factor (whole / sum of the groups alone: what the additive model misses
when quantizing a block changes the inputs of the next).

Memory: each parameter's decoded weight ``Q(W)`` (the model's dtype, on its device) is computed once per
measurement and kept until it returns, so that the whole-plan measurement reuses the groups' decodes: one extra
copy of the plan's quantized parameters at most (for a float32 135M model, ~0.5 GB). Weights are swapped in by
exchanging the parameters' storage with the cache (no further copy) and swapped back before the next group.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from dynaquant.analysis.report.schema import tensor_group
from dynaquant.analysis.sensitivity import ReferenceLogits, SwappedWeights, decoded_weight, encoded_weight
from dynaquant.names import TensorName

VISION_GROUP = "vision"


def correction_group(name: str) -> str:
    """The correction group of a GGUF tensor name.

    ``blk.N.attn`` (attention of text block N), ``blk.N.ffn`` (the rest of the block: MLP, MoE experts, shared
    experts and router), ``token_embd`` (a tied embedding too: it is also the output head), ``output``, ``vision``
    (every tensor of a vision tower and projector: ``v.*``, ``mm.*``, one group), else the tensor's kind.
    """
    if name.startswith(("v.", "mm.")):
        return VISION_GROUP
    tn = TensorName.from_gguf(name)
    if tn.block is not None and tn.tower == "text":
        return f"blk.{tn.block}.{'attn' if tensor_group(name) == 'attn' else 'ffn'}"
    return re.sub(r"\.(weight|bias)$", "", name)


def group_kind(group: str) -> str:
    """``blk.3.attn`` -> ``attn``; any other group is its own kind (``token_embd``, ``output``, ``vision``)."""
    m = re.fullmatch(r"blk\.\d+\.(attn|ffn)", group)
    return m.group(1) if m else group


@dataclass
class GroupMeasure:
    """One group quantized alone: ``kld_pred`` (sum of its tensors' predictions, nats/token), ``kld_measured``."""

    group: str
    kld_pred: float
    kld_measured: float

    def to_dict(self) -> dict:
        return {"group": self.group, "kld_pred": self.kld_pred, "kld_measured": self.kld_measured}


@dataclass
class PlanMeasure:
    """A plan measured: ``kld_pred`` (sum of all its tensors' predictions), ``kld_measured`` (every group at once),
    ``kld_groups_sum`` (sum of the groups' measured alone: the additive model's figure), ``groups``."""

    kld_pred: float
    kld_measured: float
    kld_groups_sum: float
    groups: list[GroupMeasure] = field(default_factory=list)

    @property
    def interaction(self) -> float | None:
        """Whole measured / sum of the groups measured alone (1: additive), or None when the sum is 0."""
        return self.kld_measured / self.kld_groups_sum if self.kld_groups_sum > 0 else None


@dataclass
class Encodings:
    """The bytes of the last measured plan's parameters (HF name -> (format, (rows, row bytes) uint8 on the host)),
    kept for the quantize run's writer: the plan it writes is one that was measured, so each parameter whose
    format did not change since is written from here instead of encoded again (the same bytes: the same weight,
    format and importance through the same encoder). What it holds is at most the plan's bytes (its size, known
    from the shapes) and never more than ``limit`` (parameters beyond it are encoded again by the writer)."""

    limit: int
    codes: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes kept."""
        return sum(c.numel() for _, c in self.codes.values())

    def keep_only(self, formats: dict[str, str]) -> None:
        """Drop the entries of parameters not planned in ``formats`` at their format (a new plan measured)."""
        self.codes = {n: v for n, v in self.codes.items() if formats.get(n) == v[0]}

    def offer(self, name: str, fmt: str, codes: torch.Tensor) -> None:
        """Keep ``codes`` (copied to the host) if they fit the limit."""
        self.codes.pop(name, None)
        if self.nbytes + codes.numel() <= self.limit:
            self.codes[name] = (fmt, codes.cpu())

    def take(self, name: str, fmt: str) -> torch.Tensor | None:
        """The kept bytes of ``name`` in ``fmt`` (given up: each is written once), or None."""
        got = self.codes.get(name)
        if got is None or got[0] != fmt:
            return None
        return self.codes.pop(name)[1]


# Kept free on a CUDA device beside the decoded weights of a measured plan: the encoders' chunks (sized by the free
# memory, ``chunk_weights``: 1 GiB at the least) and the held-out forward passes (a sequence's activations and logits).
DEVICE_RESERVE_BYTES = 8 << 30


def device_room(device: torch.device | str) -> int:
    """Bytes of ``device`` memory that :func:`measure_plan` may fill with decoded weights: on CUDA the free memory (the
    driver's free bytes plus the caching allocator's reserved but unused ones) less :data:`DEVICE_RESERVE_BYTES` (or
    a quarter of a smaller device's total), at least 0; 0 on other devices (the host holds them: on the CPU that is
    no copy)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, free + cached - min(DEVICE_RESERVE_BYTES, total // 4))


@torch.no_grad()
def measure_plan(model, ref: ReferenceLogits, formats: dict[str, str], groups: dict[str, str],
                 kld_pred: dict[str, float], imatrix_of: Callable[[str], torch.Tensor | None], *,
                 progress: bool = True, desc: str = "corrections",
                 keep: dict[str, tuple[str, torch.Tensor]] | None = None,
                 encodings: Encodings | None = None) -> PlanMeasure:
    """Measure a plan's KL divergence as a whole and per group quantized alone.

    Args:
        model: transformers causal LM (its weights are restored before this returns, also on error).
        ref: the unmodified model's log-probabilities on the held-out sequences.
        formats: HF parameter name -> format name (block-size fallbacks applied as llama.cpp does); the
            parameters the plan quantizes (``run_analysis``'s ``validate`` builds it the same way).
        groups: HF parameter name -> correction group (:func:`correction_group` of its GGUF name).
        kld_pred: HF parameter name -> predicted KL divergence (nats/token) in its planned format (0 when absent).
        imatrix_of: HF parameter name -> (K,) importance for the encoder, or None.
        progress: a tqdm bar over the groups (``desc``).
        keep: the decoded weights of an earlier call of the same run (HF name -> (format, tensor)), filled
            by this call: a parameter planned in the same format as then is not encoded again (a round of
            corrections changes a few tensors' formats; the imatrix and the model are the run's own). It holds
            this plan's decoded weights when the call returns (the entries of other formats and parameters
            dropped), so one model's worth is kept, as within a call; emptied on error.
        encodings: where the bytes of this plan's parameters are kept for the writer (:class:`Encodings`: those of
            parameters whose format did not change stay, the others are replaced as they are encoded).
    Returns:
        PlanMeasure, groups in first-appearance order of ``formats``. Cost: ``len(groups) + 1`` forward passes over
        the held-out sequences (a group's from its first decoder layer on where ``ref`` keeps prefix states:
        :meth:`ReferenceLogits.start_of`; about half the layers on average), one encode and decode per parameter
        (not kept in ``keep`` in its format); memory: the decoded weights (one model's worth) on the model's device
        as far as :func:`device_room` allows (swapped in and out by pointer), the rest on the host (copied in and out
        at each swap, the device holding each of those weights once: :class:`SwappedWeights`).
    Raises:
        KeyError: a parameter of ``formats`` not in the model, or without a group.
    """
    params = dict(model.named_parameters())
    members: dict[str, list[str]] = {}
    for name in formats:
        members.setdefault(groups[name], []).append(name)
    cache: dict[str, torch.Tensor] = {}  # decoded weights: on the model's device while it has room, else the host
    earlier = {n: t for n, (f, t) in (keep or {}).items() if formats.get(n) == f}
    if keep is not None:
        keep.clear()  # the entries of other formats go now, before this plan's are made
    if encodings is not None:
        encodings.keep_only(formats)
    room = device_room(next(iter(params.values())).device) if params else 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal room
        nbytes = t.numel() * t.element_size()
        if nbytes <= room:
            room -= nbytes
            return t
        return t.cpu()

    out = []
    try:
        for g, names in tqdm(members.items(), desc=desc, disable=not progress, unit="group"):
            for n in names:
                hit = earlier.pop(n, None)
                if hit is None:
                    fmt, codes, decoded = encoded_weight(params[n], formats[n], imatrix_of(n))
                    if encodings is not None:
                        encodings.offer(n, fmt, codes)
                    hit = place(decoded)
                    del codes, decoded
                cache[n] = hit
            with SwappedWeights(params, cache, names):
                kld = ref.kld(model, start=ref.start_of(model, names))
            out.append(GroupMeasure(g, sum(float(kld_pred.get(n) or 0.0) for n in names), kld))
        with SwappedWeights(params, cache, list(cache)):
            whole = ref.kld(model)
        if keep is not None:
            keep.update({n: (formats[n], t) for n, t in cache.items()})
    finally:
        cache.clear()
    return PlanMeasure(sum(m.kld_pred for m in out), whole, sum(m.kld_measured for m in out), out)


@torch.no_grad()
def measure_plan_blockwise(sk, chunks: torch.Tensor, formats: dict[str, str], groups: dict[str, str],
                           kld_pred: dict[str, float], imatrix_of: Callable[[str], torch.Tensor | None], *,
                           progress: bool = True) -> PlanMeasure:
    """:func:`measure_plan` on a model skeleton, one block in memory at a time: the original, the whole plan and each
    group quantized alone run as variants of one block-wise pass (:func:`dynaquant.analysis.blockwise.stream_logits`;
    a group's states are the original's up to its block). Each planned parameter is encoded and decoded once per pass.
    Same figures as :func:`measure_plan` on the whole model.

    Args:
        sk: the model's :class:`~dynaquant.sources.skeleton.ModelSkeleton`; chunks: (n, T) held-out token ids; the
            rest as :func:`measure_plan`.
    """
    from dynaquant.analysis.blockwise import stream_logits
    from dynaquant.names import TensorName
    from dynaquant.sources.skeleton import OUTER

    members: dict[str, list[str]] = {}
    for name in formats:
        members.setdefault(groups[name], []).append(name)
    order = list(members)
    part_of = {}
    for name in formats:
        tn = TensorName.from_hf(name)
        part_of[name] = tn.block if tn.tower == "text" and tn.block is not None else OUTER
    decoded: dict[object, dict[str, torch.Tensor]] = {}  # part -> its planned parameters decoded (this part only)

    def edit(v: int, part, _module):
        if v == 0:
            return None
        names = [n for n in (formats if v == 1 else members[order[v - 2]]) if part_of[n] == part]
        if not names:
            return None
        params = sk.parameters_of(part)
        if part not in decoded:
            if part != OUTER:
                decoded.clear()  # the previous block's are no longer needed
            decoded[part] = {n: decoded_weight(params[n], formats[n], imatrix_of(n)) for n in formats
                             if part_of[n] == part}
        saved = {n: params[n].data for n in names}
        for n in names:
            params[n].data = decoded[part][n]

        def undo():
            for n in names:
                params[n].data = saved[n]
        return undo

    tot = [0.0] * (len(order) + 2)
    count = [0]
    ref: list[torch.Tensor] = []

    def reduce(s: int, v: int, logits: torch.Tensor) -> None:
        lq = torch.log_softmax(logits, -1)
        if v == 0:
            ref[:] = [lq]
            count[0] += lq.shape[0]
            return
        lp = ref[0]
        tot[v] += float((lp.exp() * (lp - lq)).sum(-1).clamp_min(0).sum())

    stream_logits(sk, chunks, len(order) + 2, edit, reduce, progress=progress)
    n = max(count[0], 1)
    out = [GroupMeasure(g, sum(float(kld_pred.get(x) or 0.0) for x in members[g]), tot[k + 2] / n)
           for k, g in enumerate(order)]
    return PlanMeasure(sum(m.kld_pred for m in out), tot[1] / n, sum(m.kld_measured for m in out), out)


def factor_lookup(factors: dict[str, float]) -> Callable[[str], float]:
    """group -> correction factor: the group's fitted factor; a group never measured takes the geometric mean of the
    factors of its kind (:func:`group_kind`: the other blocks' ``attn`` or ``ffn``), else 1."""
    logs: dict[str, list[float]] = {}
    for g, f in factors.items():
        logs.setdefault(group_kind(g), []).append(math.log(f))
    by_kind = {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}
    return lambda g: factors[g] if g in factors else by_kind.get(group_kind(g), 1.0)
