"""Per-expert calibration statistics of mixture-of-experts layers.

transformers (>= 5) runs a MoE layer's routed experts in one call of one experts module (layouts:
:mod:`dynaquant.sources.experts`), so there is no ``nn.Linear`` per expert to hook.

During calibration :func:`install` replaces each experts module's ``forward`` with an equivalent
per-expert loop that also accumulates, per expert ``e``:

- the routing: tokens routed to it and the sum of their routing weights;
- the input second moments ``H_e = sum x x^T`` of gate/up (over the tokens routed to ``e``) and of
  down (``act(gate x) * up x``), from which the per-expert imatrix (llama.cpp's ``(n_expert, K)``
  imatrix layout) and the errors of :mod:`.errors` follow;
- on Fisher sequences, the squared gradients of the sampled-label log likelihood at each
  expert's gate, up and down outputs (before the routing weight), as for linear layers.

The GGUF tensors ``ffn_{gate,up,down}_exps`` stack the experts as (E, rows, row_size): see
:func:`dynaquant.sources.experts.expert_weight`. An expert calibration never routes to gets the
layer's pooled statistics and an add-half smoothed frequency (:meth:`ExpertStats.row_weights`), so
its errors are finite, its importance small but not zero; the report flags it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dynaquant.analysis.errors import (
    SAMPLE_FRACTION,
    ErrorSample,
    RowErrors,
    RowWeights,
    TensorError,
    measure_samples,
    sample_size,
    sample_tensor,
)
from dynaquant.analysis.moments import gram
from dynaquant.sources.experts import dispatch, expert_linear, expert_matrix, expert_weight, find_experts, layout_of

# Per experts module and input (gate/up's, down's), the full per-expert second moments (E, K, K) float32 are kept
# up to this many bytes (Qwen3-30B-A3B's gate/up: 128 x 2048^2 x 4 = 2 GiB); beyond it (DeepSeek-V3's gate/up:
# 256 x 7168^2 x 4 = 49 GiB a layer) only their diagonals (E, K), the per-expert imatrix: the experts' errors then
# take H as diagonal (``output_rel`` and the predicted KLD weigh each input column by its E[x^2] alone).
EXPERT_HESSIAN_BYTES = 4 << 30

# Rows sampled of each expert of a stack (:func:`expert_sample_rows`) at least: the stack's sample is spread over its
# experts, each expert a stratum of at least this many rows (its own largest rows among them).
EXPERT_MIN_ROWS = 16


@dataclass
class ExpertStats:
    """Statistics of one experts module (tensors on the model's device).

    Attributes:
        module: HF name of the experts module.
        n_expert: E.
        hessian_sum: ``"gate_up"`` (E, H, H) and ``"down"`` (E, I, I) float32 sums of x x^T over routed tokens, or
            (E, K) sums of x^2 alone where the full matrices exceed :data:`EXPERT_HESSIAN_BYTES` (emptied by
            :meth:`drop_hessians`, which keeps their diagonals in ``diag_sum``).
        tokens: (E,) int64 tokens routed to each expert.
        weight_sum: (E,) float64 sum of their routing weights.
        fisher_sum: proj -> (E, N) float64 sum of squared output gradients (Fisher sequences).
        fisher_tokens: (E,) int64 routed tokens with gradients.
    """

    module: str
    n_expert: int
    hessian_sum: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: torch.Tensor | None = None
    weight_sum: torch.Tensor | None = None
    fisher_sum: dict[str, torch.Tensor] = field(default_factory=dict)
    fisher_tokens: torch.Tensor | None = None
    diag_sum: dict[str, torch.Tensor] = field(default_factory=dict)

    def drop_hessians(self) -> None:
        """Free the (E, K, K) matrices, keeping their diagonals (the per-expert imatrix)."""
        for key, h in self.hessian_sum.items():
            self.diag_sum[key] = torch.diagonal(h, dim1=1, dim2=2).clone() if h.dim() == 3 else h
        self.hessian_sum.clear()

    @staticmethod
    def input_of(proj: str) -> str:
        return "down" if proj == "down_proj" else "gate_up"

    def unrouted(self) -> list[int]:
        """Experts no calibration token was routed to."""
        return [int(e) for e in torch.nonzero(self.tokens == 0).flatten()]

    def frequency(self, total_tokens: int) -> torch.Tensor:
        """(E,) float32 share of tokens routed to each expert (sums to top-k)."""
        return (self.tokens.double() / max(total_tokens, 1)).float().cpu()

    def imatrix(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """((E, K) float64 sums of x^2, (E,) int64 tokens): llama.cpp's per-expert imatrix entry."""
        key = self.input_of(proj)
        h = self.hessian_sum.get(key)
        d = self.diag_sum[key] if h is None else torch.diagonal(h, dim1=1, dim2=2) if h.dim() == 3 else h
        return d.double().cpu(), self.tokens.cpu()

    def row_weights(self, proj: str, e: int, total_tokens: int, fisher_total: int) -> tuple[RowWeights, torch.Tensor, bool]:
        """What expert ``e``'s rows weigh in the predicted KL divergence (see :mod:`.errors`).

        ``G_e = (Fisher per routed token of e) * (share of tokens routed to e)`` and
        ``H_e = E[x x^T]`` over e's tokens, so ``1/2 sum_i G_i dW_i H dW_i^T`` is e's term of the
        mean KL divergence per token. Experts without tokens (or without Fisher tokens) take the
        layer's pooled H (Fisher) and an add-half smoothed share ``0.5 / total_tokens``.

        Returns:
            (RowWeights, (K,) float32 encoder imatrix, True when a fallback was used).
        """
        key = self.input_of(proj)
        hs, tok = self.hessian_sum[key], self.tokens
        fallback = bool(tok[e] == 0 or self.fisher_tokens[e] == 0)
        if tok[e] > 0:
            h = hs[e] / tok[e]
        else:
            h = hs.sum(0) / tok.sum().clamp_min(1)
        g = self.fisher(proj, e, total_tokens, fisher_total)
        hf = h.float()  # (K, K), or (K,): the diagonal alone
        return (RowWeights(fisher=None if g is None else g.float(), hessian=hf),
                (torch.diagonal(hf) if hf.dim() == 2 else hf).clone(), fallback)

    def fisher(self, proj: str, e: int, total_tokens: int, fisher_total: int) -> torch.Tensor | None:
        """(N,) float64 ``G_e``: expert ``e``'s output Fisher per routed token times its share of the tokens (the
        layer's pooled Fisher for an expert without Fisher tokens, half a token's share for an unrouted one; see
        :meth:`row_weights`), or None without Fisher sequences."""
        tok = self.tokens
        share = (tok[e].double() if tok[e] > 0 else torch.tensor(0.5, dtype=torch.float64)) / max(total_tokens, 1)
        fs, ft = self.fisher_sum.get(proj), self.fisher_tokens
        if fs is None or fisher_total == 0:
            return None
        if ft[e] > 0:
            return (fs[e] / ft[e]) * share
        return (fs.sum(0) / ft.sum().clamp_min(1)) * share


class _ExpertsForward:
    """The replacement forward of one experts module (equivalent output, statistics on the side)."""

    def __init__(self, name: str, module: torch.nn.Module, n_expert: int, device, collector, experts: dict):
        self.name, self.m, self.n, self.dev, self.col, self.experts = name, module, n_expert, device, collector, experts
        self.layout = layout_of(module)

    @property
    def st(self) -> ExpertStats:
        """The statistics filled now: the collector's (``expert_stats``: one sequence's in its partial mode), else
        the ``experts`` dict given to :func:`install`."""
        get = getattr(self.col, "expert_stats", None)
        return get(self.name, self.n, self.dev) if get is not None else self.experts[self.name]

    @property
    def live(self) -> bool:
        """False while the collector gathers nothing (between a partial's ``end`` and the next ``begin``)."""
        return getattr(self.col, "st", True) is not None

    def _grad_hook(self, proj: str, e: int, n: int, sl=None):
        st = self.st

        def fn(g):
            g = g.detach().reshape(-1, g.shape[-1]).to(torch.float64)
            if sl is not None:
                g = g[:, sl]
            s = st.fisher_sum.get(proj)
            if s is None:
                s = st.fisher_sum[proj] = torch.zeros(st.n_expert, g.shape[1], dtype=torch.float64, device=g.device)
            s[e] += (g * g).sum(0)
            if proj == "down_proj":
                st.fisher_tokens[e] += n
        return fn

    def __call__(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        return dispatch(hidden_states, top_k_index, top_k_weights, self.n, self._expert)

    def _expert(self, e: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m = self.m
        gpt = self.layout == "gpt-oss"
        if gpt:
            gu = x @ m.gate_up_proj[e] + m.gate_up_proj_bias[e]
            h = m._apply_gate(gu)
        else:
            gu = expert_linear(m, e, "gate_up", x)  # (a packed module's weights decoded for the call)
            gate, up = gu.chunk(2, dim=-1)
            h = m.act_fn(gate) * up
        y = h @ m.down_proj[e] + m.down_proj_bias[e] if gpt else expert_linear(m, e, "down", h)
        if self.col.fisher and gu.requires_grad and self.live:
            i, n = gu.shape[-1] // 2, x.shape[0]
            gu.register_hook(self._grad_hook("gate_proj", e, n, slice(0, None, 2) if gpt else slice(0, i)))
            gu.register_hook(self._grad_hook("up_proj", e, n, slice(1, None, 2) if gpt else slice(i, None)))
            y.register_hook(self._grad_hook("down_proj", e, n))
        if getattr(self.col, "accumulate", True) and self.live:
            with torch.no_grad():
                self._accumulate(e, x, h, w)
        return y

    @torch.no_grad()
    def _accumulate(self, e: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        st = self.st
        for key, v in (("gate_up", x), ("down", h)):
            v = v.detach().to(torch.float32)
            hs = st.hessian_sum.get(key)
            if hs is None:
                k = v.shape[1]
                shape = (st.n_expert, k, k) if st.n_expert * k * k * 4 <= EXPERT_HESSIAN_BYTES else (st.n_expert, k)
                hs = st.hessian_sum[key] = torch.zeros(shape, dtype=torch.float32, device=v.device)
            if hs.dim() == 3:  # this call's, then added (the same bits as a partial sum merged: stats.Collector)
                hs[e] += gram(v)
            else:
                hs[e] += (v * v).sum(0)
        st.tokens[e] += x.shape[0]
        st.weight_sum[e] += w.detach().double().sum()  # (on the device: no wait for the GPU an expert)


def new_expert_stats(name: str, n_expert: int, device) -> ExpertStats:
    """An empty ExpertStats (zero counts on ``device``)."""
    st = ExpertStats(name, n_expert)
    st.tokens = torch.zeros(n_expert, dtype=torch.int64, device=device)
    st.weight_sum = torch.zeros(n_expert, dtype=torch.float64, device=device)
    st.fisher_tokens = torch.zeros(n_expert, dtype=torch.int64, device=device)
    return st


def install(model, experts: dict[str, ExpertStats], collector, device: torch.device | None = None) -> list:
    """Replace every experts module's forward with the collecting one.

    Args:
        model: a transformers model.
        experts: filled with one :class:`ExpertStats` per experts module (by module name).
        collector: has a boolean ``fisher`` attribute (True while a Fisher sequence runs) and may have a boolean
            ``accumulate`` (False: a recomputation for gradients only, no forward statistics).
        device: where the statistics live (default: the experts' device; give it for a meta-device skeleton).
    Returns:
        Undo handles: call :func:`uninstall` with them.
    """
    undo = []
    for name, mod in find_experts(model).items():
        dev = device if device is not None else mod.gate_up_proj.device
        n = mod.gate_up_proj.shape[0]
        if name not in experts:
            experts[name] = new_expert_stats(name, n, dev)
        had = "forward" in mod.__dict__
        old = mod.__dict__.get("forward")
        mod.forward = _ExpertsForward(name, mod, n, dev, collector, experts)
        undo.append((mod, had, old))
    return undo


def uninstall(undo: list) -> None:
    """Restore the forwards :func:`install` replaced."""
    for mod, had, old in undo:
        if had:
            mod.forward = old
        else:
            del mod.forward


def expert_sample_rows(n_expert: int, n_rows: int, fraction: int = SAMPLE_FRACTION) -> int:
    """Rows sampled of each expert of a stack of ``n_expert`` experts of ``n_rows`` rows.

    One GGUF type holds the whole stack (``ffn_{gate,up,down}_exps``), so its error is one estimate: the stack is
    sampled as a tensor of ``n_expert * n_rows`` rows (:func:`.errors.sample_size`) stratified by expert, each
    expert's share ``ceil(sample_size(E * N) / E)`` rows, at least :data:`EXPERT_MIN_ROWS` and at most what the expert
    alone would get (``sample_size(N)``: every row of an expert of at most 64). DeepSeek-V3 (256 experts of 2048 and
    7168 rows, fraction 16): 16 rows an expert, 4096 a stack, where sampling each expert as a tensor took 128 and
    448; Mixtral (8 of 14336): 256 an expert.

    Raises:
        ValueError: ``fraction`` out of range (:func:`.errors.sample_size`).
    """
    alone = sample_size(n_rows, fraction)
    if alone >= n_rows:
        return n_rows
    return min(alone, max(EXPERT_MIN_ROWS, -(-sample_size(n_expert * n_rows, fraction) // n_expert)))


def expert_samples(module: torch.nn.Module, proj: str, st: ExpertStats, *, total_tokens: int, fisher_total: int,
                   seed: int = 0, defer_fisher: bool = False,
                   fraction: int = SAMPLE_FRACTION) -> tuple[list[ErrorSample], list[int]]:
    """The sampled rows of each expert of a stacked expert tensor (``ffn_{gate,up,down}_exps``).

    Each expert is sampled as a linear layer with its own statistics (:meth:`ExpertStats.row_weights`,
    :func:`.errors.sample_tensor`, seed ``seed + e``), :func:`expert_sample_rows` rows each; measure them (with other tensors) by
    :func:`.errors.measure_samples` and add them up by :func:`combine_expert_errors`.

    Args:
        module: the experts module; proj: ``gate_proj``, ``up_proj`` or ``down_proj``.
        st: its statistics.
        total_tokens: calibration tokens; fisher_total: tokens of the Fisher sequences.
        defer_fisher: the Fisher is not known yet (the block-by-block forward sweep): rows are sampled by their
            output energy and measured with ``per_row``; weigh them later with :meth:`ExpertStats.fisher`
            (:func:`combine_expert_errors` ``fisher_of``).
        fraction: the stack's sampled rows (:func:`expert_sample_rows`).
    Returns:
        (one ErrorSample per expert, experts that used a fallback).
    """
    samples, fallback = [], []
    rows = expert_sample_rows(st.n_expert, expert_weight(module, proj).shape[1], fraction)
    for e in range(st.n_expert):
        w = expert_matrix(module, proj, e).detach()  # one expert at a time (decoded if packed)
        rw, imp, fb = st.row_weights(proj, e, total_tokens, fisher_total)
        if fb and (not defer_fisher or st.tokens[e] == 0):  # deferred: no Fisher token is counted yet
            fallback.append(e)
        if defer_fisher:
            rw = RowWeights(hessian=rw.hessian)
        samples.append(sample_tensor(w, rw, imatrix=imp, seed=seed + e, score="output" if defer_fisher else "kld",
                                     rows=rows))
    return samples, fallback


def combine_expert_errors(st: ExpertStats, per_expert: list[dict[str, TensorError]]) -> dict[str, TensorError]:
    """The errors of a whole expert stack from its experts' (in expert order): sizes and predicted KL
    divergences add up over experts, the relative errors are averaged with each expert's routing share
    as weight (an unrouted expert counts half a token)."""
    share = st.tokens.double().cpu().clamp_min(0.5)
    share = share / share.sum()
    sums: dict[str, list[float]] = {}
    for e, errs in enumerate(per_expert):
        for f, te in errs.items():
            s = sums.setdefault(f, [0, 0.0, 0.0, 0.0, 0.0])
            s[0] += te.size_bytes
            s[1] += float(share[e]) * te.weighted_rel
            s[2] += float(share[e]) * te.output_rel
            s[3] += te.kld_pred
            s[4] = te.bpw
    return {f: TensorError(int(s[0]), s[4], s[1], s[2], s[3]) for f, s in sums.items()}


def expert_errors_with_fisher(st: ExpertStats, proj: str, per_expert: list[dict[str, RowErrors]], *,
                              total_tokens: int, fisher_total: int) -> dict[str, TensorError]:
    """:func:`combine_expert_errors` of errors measured before the Fisher was known (``expert_samples(...,
    defer_fisher=True)``, ``measure_samples(..., per_row=True)``), each expert weighted by its
    :meth:`ExpertStats.fisher`."""
    out = []
    for e, errs in enumerate(per_expert):
        g = st.fisher(proj, e, total_tokens, fisher_total)
        out.append({f: re.with_fisher(g) for f, re in errs.items()})
    return combine_expert_errors(st, out)


def measure_expert_errors(module: torch.nn.Module, proj: str, st: ExpertStats, formats: list[str], *,
                          total_tokens: int, fisher_total: int, seed: int = 0) -> tuple[dict, list[int]]:
    """Errors of a stacked expert tensor (``ffn_{gate,up,down}_exps``) in each format, all experts
    measured together (:func:`expert_samples`, :func:`.errors.measure_samples`, :func:`combine_expert_errors`).

    Args:
        module: the experts module; proj: ``gate_proj``, ``up_proj`` or ``down_proj``.
        st: its statistics; formats: candidate format names.
        total_tokens: calibration tokens; fisher_total: tokens of the Fisher sequences.
    Returns:
        (format name -> :class:`.errors.TensorError` for the whole stack, experts that used a fallback).
    """
    samples, fallback = expert_samples(module, proj, st, total_tokens=total_tokens, fisher_total=fisher_total, seed=seed)
    return combine_expert_errors(st, measure_samples(samples, formats)), fallback


def routing_entry(st: ExpertStats, layer: int | None, total_tokens: int) -> dict:
    """The report's row for one MoE layer: tokens, share and mean routing weight per expert, unrouted experts."""
    tok = st.tokens.cpu()
    return {
        "module": st.module, "layer": layer, "n_expert": st.n_expert,
        "tokens": [int(v) for v in tok],
        "frequency": [float(f"{v:.6g}") for v in st.frequency(total_tokens).tolist()],
        "mean_weight": [float(f"{v:.6g}") for v in (st.weight_sum.cpu() / tok.clamp_min(1)).tolist()],
        "unrouted": st.unrouted(),
    }
