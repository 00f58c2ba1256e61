"""The one calibration collector: a single pass over the calibration sequences gathers what is asked.

What to gather is a :class:`Collect`. :func:`compute_imatrix` asks for the imatrix alone (as llama.cpp's
``llama-imatrix`` accumulates it: per module the sum of x^2 per input column and the rows seen, no (K, K)
matrix); :func:`collect_stats` asks for everything the analysis needs:

for each distinct input of the model's ``nn.Linear`` layers (q/k/v projections read one
input, gate/up another; detected by tensor identity on the first sequence):

- the second-moment matrix ``H = sum_t x_t x_t^T`` (K, K), from which the imatrix
  (``diag H / tokens``, what ``llama-imatrix`` collects), the layer-output error
  ``||dW X|| / ||W X||`` and GPTQ's Hessian all follow;
- per-channel ``max |x|`` (outlier / massive-activation channels, Sun et al. 2024);
- the relative error of per-token absmax activation quantization at 8 and 4 bits.

For each linear layer's output: per-channel ``max |y|`` (super-weight spikes, Yu et al. 2024; the output head's
only on the Fisher sequences: the other sequences stop at the head, whose logits nobody reads, ~20 % of a small
model's forward) and, on the first ``fisher_sequences`` sequences, the empirical Fisher diagonal of the output,
``sum_t g_t**2`` with ``g_t = d log p(y) / d out_t`` for labels ``y`` *sampled from the model*
(so ``1/2 dW^T F dW`` estimates the KL divergence a weight change ``dW`` adds; Kunstner et al.
2019 on true vs empirical Fisher). The token embedding gets the same Fisher on its output and
the token counts of the calibration text. MoE experts modules get routing counts and per-expert statistics
(:mod:`.experts`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from dynaquant.analysis import experts as moe
from dynaquant.analysis.imatrix import Imatrix
from dynaquant.analysis.moments import gram
from dynaquant.sources.experts import PROJS


@dataclass
class InputStats:
    """Statistics of one linear-layer input (shared by the modules that read it).

    Attributes:
        modules: HF module names reading this input, in call order.
        hessian_sum: (K, K) float32, sum over tokens of x x^T; None once dropped (:meth:`drop_hessian`).
        tokens: tokens accumulated.
        absmax: (K,) float32 max |x| per channel.
        sq_sum: float, sum of x^2 over tokens and channels.
        qerr_sum: {"int8": float, "int4": float}, sum of squared per-token absmax quantization errors.
        rows: with ``Collect(rows=True)``: each call's (tokens, K) float32 input rows, in call order, kept instead of
            ``hessian_sum`` (None); :attr:`hessian` and :meth:`diag` form the sum from them on demand.
    """

    modules: list[str]
    hessian_sum: torch.Tensor | None
    tokens: int = 0
    absmax: torch.Tensor | None = None
    sq_sum: float = 0.0
    qerr_sum: dict = field(default_factory=lambda: {"int8": 0.0, "int4": 0.0})
    diag_sum: torch.Tensor | None = None  # (K,) the diagonal of a dropped hessian_sum
    rows: list[torch.Tensor] | None = None

    def _sum(self) -> torch.Tensor | None:
        """``hessian_sum``, or its sum formed from :attr:`rows` (each call's x x^T, added in call order: the
        operations of the accumulation, so the same bits); None when neither is kept."""
        if self.hessian_sum is not None or not self.rows:
            return self.hessian_sum
        h = gram(self.rows[0])
        for x in self.rows[1:]:
            h += gram(x)
        return h

    @property
    def hessian(self) -> torch.Tensor:
        """(K, K) float32 E[x x^T].

        Raises:
            ValueError: the matrix was dropped (:meth:`drop_hessian`).
        """
        return self.hessian_on(None)

    def hessian_on(self, device) -> torch.Tensor:
        """:attr:`hessian` formed on ``device`` (None: where the sums are): the sum moved, then divided (a sum kept
        in host memory divided on the GPU; one correctly rounded division, the same bits on either)."""
        h = self._sum()
        if h is None:
            raise ValueError(f"the second moments of {self.modules[0]}'s input were dropped after its block")
        return (h if device is None else h.to(device)) / max(self.tokens, 1)

    def diag(self) -> torch.Tensor:
        """(K,) float32 the sum over tokens of x^2 per column (the diagonal of ``hessian_sum``, kept when dropped)."""
        if self.hessian_sum is None and self.rows:
            return torch.diagonal(self._sum()).clone()
        return torch.diagonal(self.hessian_sum) if self.hessian_sum is not None else self.diag_sum

    @property
    def imatrix(self) -> torch.Tensor:
        """(K,) float32 E[x^2] per column."""
        return self.diag() / max(self.tokens, 1)

    def drop_hessian(self) -> None:
        """Free the (K, K) matrix (or the rows it is formed from), keeping its diagonal (the imatrix)."""
        if self.hessian_sum is not None or self.rows:
            self.diag_sum = self.diag().clone()
            self.hessian_sum, self.rows = None, None

    def quant_rel_error(self) -> dict[str, float]:
        """Relative error ``||Q(x) - x|| / ||x||`` of per-token absmax quantization, per bit width."""
        return {k: (v / self.sq_sum) ** 0.5 if self.sq_sum > 0 else 0.0 for k, v in self.qerr_sum.items()}


@dataclass
class OutputStats:
    """Statistics of one linear layer's output.

    Attributes:
        absmax: (N,) float32 max |y| per output channel over all calibration tokens (the output head's: over the
            Fisher sequences, zeros without any).
        fisher_sum: (N,) float64 sum over Fisher tokens of (d log p / d y)^2, or None.
        fisher_tokens: tokens in ``fisher_sum``.
    """

    absmax: torch.Tensor
    fisher_sum: torch.Tensor | None = None
    fisher_tokens: int = 0

    @property
    def fisher(self) -> torch.Tensor | None:
        """(N,) float32 mean squared output gradient per channel, or None."""
        return None if self.fisher_sum is None else (self.fisher_sum / max(self.fisher_tokens, 1)).float()


@dataclass
class ModelStats:
    """Everything one calibration pass measured.

    Attributes:
        inputs: input key (the first module reading it) -> InputStats.
        input_of: HF module name -> input key.
        outputs: HF module name -> OutputStats.
        embed_fisher_sum: (hidden,) float64 sum of squared gradients at the embedding output, or None.
        token_counts: (vocab,) int64 occurrences of each token id in the calibration chunks.
        sequences, tokens: calibration sequences and tokens seen; fisher_sequences: with gradients.
        fisher_tokens: tokens with gradients.
        experts: experts module name -> per-expert statistics (MoE models; :mod:`.experts`).
        imatrix: llama-imatrix's own accumulation (sums on CPU), when :attr:`Collect.imatrix` asked for it;
            else None (:meth:`to_imatrix` derives one from H instead).
    """

    inputs: dict[str, InputStats] = field(default_factory=dict)
    input_of: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, OutputStats] = field(default_factory=dict)
    embed_fisher_sum: torch.Tensor | None = None
    token_counts: torch.Tensor | None = None
    sequences: int = 0
    tokens: int = 0
    fisher_sequences: int = 0
    fisher_tokens: int = 0
    experts: dict[str, moe.ExpertStats] = field(default_factory=dict)
    imatrix: Imatrix | None = None

    def drop_hessians(self, modules) -> None:
        """Free the (K, K) second moments of the inputs read by ``modules`` (HF module names) and of the experts
        modules among them, keeping the diagonals (the imatrix): the block-by-block analysis keeps one block's
        matrices at a time."""
        modules = set(modules)
        for mod in modules & self.input_of.keys():
            self.inputs[self.input_of[mod]].drop_hessian()
        for name in modules & self.experts.keys():
            self.experts[name].drop_hessians()

    def input(self, module: str) -> InputStats:
        """The InputStats of a module's input. Raises KeyError for an unknown module."""
        return self.inputs[self.input_of[module]]

    @property
    def embed_fisher(self) -> torch.Tensor | None:
        """(hidden,) float32 mean squared gradient at the embedding output, or None."""
        if self.embed_fisher_sum is None:
            return None
        return (self.embed_fisher_sum / max(self.fisher_tokens, 1)).float()

    def to_imatrix(self, dataset: str = "") -> Imatrix:
        """The imatrix (diag of H, as llama-imatrix sums it) keyed by HF module name; MoE experts as
        ``{experts module}.{gate_proj|up_proj|down_proj}`` with (n_expert, K) sums and (n_expert,) counts."""
        im = Imatrix(dataset=dataset, chunks=self.sequences)
        for mod, key in self.input_of.items():
            s = self.inputs[key]
            im.sums[mod] = s.diag().to(torch.float64).cpu()
            im.counts[mod] = s.tokens
        for name, es in self.experts.items():
            for proj in PROJS:
                im.sums[f"{name}.{proj}"], im.counts[f"{name}.{proj}"] = es.imatrix(proj)
        return im


def module_of(param_name: str | None) -> str | None:
    """HF module of a weight parameter (``model.layers.3.mlp.down_proj.weight`` -> ``model.layers.3.mlp.down_proj``)."""
    return param_name[: -len(".weight")] if param_name and param_name.endswith(".weight") else None


@dataclass(frozen=True)
class Collect:
    """What one calibration pass gathers; each part costs time and memory only when asked.

    Attributes:
        imatrix: llama-imatrix's accumulation for every ``nn.Linear`` (:attr:`ModelStats.imatrix`): per module and
            forward pass the float32 sum over rows of x^2 per input column, added into a (K,) float64 sum, and the
            rows seen. No (K, K) matrix.
        hessian: for every distinct linear input H (K, K) float32 and the activation statistics
            (:class:`InputStats`); for every linear output max |y| (:class:`OutputStats`); the token counts.
        experts: routing counts and per-expert H of every MoE experts module (:mod:`.experts`); the experts
            modules then run a per-expert loop whose outputs equal transformers' up to rounding, so the other
            statistics of a MoE model differ in the last bits from those of a pass without it.
        fisher_sequences: the first this many sequences also get a backward pass for the Fisher diagonals
            (labels sampled from the model's own next-token distribution); needs ``hessian``.
        rows: with ``hessian``, every call's float32 input rows are kept (:attr:`InputStats.rows`) instead of their
            x x^T added into H: tokens x K floats a call, not K x K a module, for a pass of few sequences over a whole
            model (GPTQ's two held-out sequences: 1024 rows of a Llama-3-8B down_proj input are 59 MB, its H 822 MB;
            the 32 blocks' H 32 GB, their rows 3.5 GB). H is formed from them on demand, the same bits. One process
            only (not with ``partial``).
    """

    imatrix: bool = False
    hessian: bool = True
    experts: bool = True
    fisher_sequences: int = 0
    rows: bool = False

    def __post_init__(self):
        if self.fisher_sequences > 0 and not self.hessian:
            raise ValueError("the Fisher diagonals are kept with the activation statistics: Collect(hessian=True)")
        if self.rows and not self.hessian:
            raise ValueError("the input rows stand in for H: Collect(hessian=True)")


def _token_quant_err(x: torch.Tensor, levels: int) -> torch.Tensor:
    """0-d float32 (on ``x``'s device): the summed squared error of ``x`` (tokens, K) rounded per token to
    ``levels`` steps of its absmax (symmetric integer activation quantization)."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / levels
    return ((torch.round(x / s) * s - x) ** 2).sum()


def _grad_sq_sum(g: torch.Tensor) -> tuple[torch.Tensor, int]:
    """((N,) float64 sum over tokens of the squared gradient ``g`` (..., N), tokens)."""
    g = g.detach().reshape(-1, g.shape[-1]).to(torch.float64)
    return (g * g).sum(0), g.shape[0]


class _HeadReached(Exception):  # noqa: N818 - a signal, not an error: ends a forward pass at the output head
    """Raised by the output head's pre-hook in a forward pass that needs no logits; carries the head's input."""

    def __init__(self, x: torch.Tensor):
        super().__init__("output head reached")
        self.x = x


class Collector:
    """The forward hooks (and MoE experts forwards) that fill one ModelStats as ``what`` asks (driven by
    :func:`collect` on a whole model, or block by block by :func:`dynaquant.analysis.blockwise.collect_blockwise`).

    Every call's contribution to a sum (a module's ``x x^T``, ``x^2`` column sums, squared gradients) is computed on
    its own and then added to the total, in sequence order. In partial mode (several ranks,
    :mod:`dynaquant.distributed`) the hooks fill one sequence's statistics (:meth:`begin` .. :meth:`end`) and the
    caller adds them to the totals in sequence order (:func:`dynaquant.analysis.fold.merge_stats`): each module is
    called once per sequence, so both modes add the same numbers in the same order and give the same bits.
    """

    def __init__(self, model, st: ModelStats, what: Collect, device: torch.device | None = None,
                 partial: bool = False):
        if what.rows and partial:
            raise ValueError("Collect(rows=True) keeps one process's rows: not in partial mode")
        self.main, self.what, self.partial = st, what, partial
        self.st: ModelStats | None = None if partial else st
        self.fisher = False  # True while a Fisher sequence runs (read by the experts forwards too)
        # False while a block is recomputed for its gradients alone (the block-wise backward sweep): forward
        # statistics are not gathered twice (read by the experts forwards too)
        self.accumulate = True
        self.count_tokens = True  # False while the embedding runs again (block-wise: the head and Fisher passes)
        self.last: tuple[torch.Tensor, str] | None = None
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in linears.items()]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = next(((n, m) for n, m in linears.items() if m is head), None)  # (name, module) or None
        if what.hessian:
            emb = model.get_input_embeddings()
            self.vocab = emb.weight.shape[0]
            if st.token_counts is None:  # (a resumed block-wise run brings its counts)
                st.token_counts = torch.zeros(self.vocab, dtype=torch.int64)
            self.handles.append(emb.register_forward_hook(self._embed_hook))
        self.experts_undo = moe.install(model, st.experts, self, device=device) if what.experts else []

    def begin(self) -> None:
        """Start one sequence: in partial mode the hooks fill a new, empty ModelStats (else the totals, as always)."""
        self.last = None
        if self.partial:
            self.st = ModelStats(imatrix=Imatrix() if self.what.imatrix else None)

    def end(self) -> ModelStats | None:
        """Partial mode: the statistics since :meth:`begin` (the hooks fill nothing until the next ``begin``);
        else None (the totals have them)."""
        if not self.partial:
            return None
        part, self.st = self.st, None
        return part

    def expert_stats(self, name: str, n_expert: int, device) -> moe.ExpertStats:
        """The ExpertStats the experts forward of ``name`` fills now (created empty in a partial)."""
        es = self.st.experts.get(name)
        if es is None:
            es = self.st.experts[name] = moe.new_expert_stats(name, n_expert, device)
        return es

    def remove(self):
        for h in self.handles:
            h.remove()
        moe.uninstall(self.experts_undo)

    def _hook(self, name):
        def fn(_mod, inputs, out):
            x = inputs[0]
            if self.st is None:
                return
            if not self.accumulate:
                if self.fisher and self.what.hessian and out is not None and name in self.main.outputs:
                    o = self.st.outputs.get(name)
                    if o is None:  # a partial: its own Fisher sums (absmax zeros: max-merged)
                        o = self.st.outputs[name] = OutputStats(torch.zeros_like(self.main.outputs[name].absmax))
                    self._fisher_hook(o, out)
                return
            if self.what.imatrix:
                self._accumulate_imatrix(name, x.detach())
            if not self.what.hessian:
                return
            st = self.st
            if name not in st.input_of:  # first call (a vision module may first run after text-only sequences)
                shared = self.last is not None and self.last[0] is x
                st.input_of[name] = self.last[1] if shared else name
                if shared:
                    st.inputs[self.last[1]].modules.append(name)
            self.last = (x, st.input_of[name])
            key = st.input_of[name]
            if key == name:
                self._accumulate_input(name, x.detach())
            if out is not None:
                self._accumulate_output(name, out)
        return fn

    def forward_without_logits(self, model, batch: dict, collect: bool = True) -> None:
        """A no-grad forward pass that stops at the output head: the head's input is gathered as its forward hook
        would gather it (imatrix, H, activation statistics; not with ``collect`` False), its (vocabulary-wide)
        matmul and output statistics are skipped. Without an ``nn.Linear`` output head: the whole forward pass."""
        if self.head is None:
            model(**batch, use_cache=False)
            return
        name, head = self.head

        def stop(_mod, args):
            raise _HeadReached(args[0])

        handle = head.register_forward_pre_hook(stop)
        try:
            model(**batch, use_cache=False)
        except _HeadReached as reached:
            if not collect:
                return
            self._hook(name)(head, (reached.x,), None)
            if self.what.hessian and name not in self.st.outputs:  # its max |y| comes from the Fisher sequences
                self.st.outputs[name] = OutputStats(torch.zeros(head.out_features, device=reached.x.device))
        finally:
            handle.remove()

    @torch.no_grad()
    def _accumulate_imatrix(self, name, x):
        im = self.st.imatrix
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        s = (x * x).sum(0).to(torch.float64)
        if name in im.sums:
            im.sums[name] += s
        else:
            im.sums[name] = s
        im.counts[name] = im.counts.get(name, 0) + x.shape[0]

    @torch.no_grad()
    def _accumulate_input(self, name, inp):
        x = inp.reshape(-1, inp.shape[-1]).to(torch.float32)
        s = self.st.inputs.get(name)
        k = x.shape[1]
        if self.what.rows:  # this call's rows kept (a copy: the model's activation may be reused in place)
            r = x.clone() if x.data_ptr() == inp.data_ptr() else x
            if s is None:
                s = self.st.inputs[name] = InputStats([name], None, absmax=torch.zeros(k, dtype=torch.float32,
                                                                                       device=x.device), rows=[r])
            else:
                s.rows.append(r)
        elif s is None:
            s = self.st.inputs[name] = InputStats([name], gram(x), absmax=torch.zeros(k, dtype=torch.float32,
                                                                                      device=x.device))
        else:
            s.hessian_sum += gram(x)  # this call's, then added
        s.tokens += x.shape[0]
        s.absmax = torch.maximum(s.absmax, x.abs().amax(0))
        sq, q8, q4 = torch.stack([(x * x).sum(), _token_quant_err(x, 127), _token_quant_err(x, 7)]).tolist()  # one sync
        s.sq_sum += sq
        s.qerr_sum["int8"] += q8
        s.qerr_sum["int4"] += q4

    def _accumulate_output(self, name, out):
        with torch.no_grad():
            y = out.detach().reshape(-1, out.shape[-1]).to(torch.float32)
            o = self.st.outputs.get(name)
            if o is None:
                o = self.st.outputs[name] = OutputStats(torch.zeros(y.shape[1], device=y.device))
            o.absmax = torch.maximum(o.absmax, y.abs().amax(0))
        if self.fisher:
            self._fisher_hook(o, out)

    @staticmethod
    def _fisher_hook(o: OutputStats, out: torch.Tensor) -> None:
        """Add the squared gradient reaching ``out`` to ``o``'s Fisher sums when the backward pass runs."""
        if not out.requires_grad:
            return

        def grad_hook(g, o=o):
            s, n = _grad_sq_sum(g)
            o.fisher_sum = s if o.fisher_sum is None else o.fisher_sum + s
            o.fisher_tokens += n
        out.register_hook(grad_hook)

    def _embed_hook(self, _mod, inputs, out):
        st = self.st
        if st is None:
            return None
        if self.count_tokens:
            if st.token_counts is None:
                st.token_counts = torch.zeros(self.vocab, dtype=torch.int64)
            st.token_counts += torch.bincount(inputs[0].reshape(-1).cpu(), minlength=st.token_counts.numel())
        if not self.fisher:
            return None
        out = out.detach().requires_grad_(True)

        def grad_hook(g):
            s, _ = _grad_sq_sum(g)
            st.embed_fisher_sum = s if st.embed_fisher_sum is None else st.embed_fisher_sum + s
        out.register_hook(grad_hook)
        return out


def _batch(chunks, i: int, n: int, device) -> dict:
    """Model inputs of calibration items ``i .. i+n-1``: ``{"input_ids": (n, T)}`` from a token tensor, or a
    processor's batch (a dict of tensors: images of a VL model; ``n`` is 1) moved to ``device``."""
    if isinstance(chunks, (list, tuple)):
        return {k: v.to(device) for k, v in chunks[i].items()}
    return {"input_ids": chunks[i : i + n].to(device)}


def collect(model, chunks, what: Collect = Collect(), *, seed: int = 0, progress: bool = True,
            batch_size: int = 1) -> ModelStats:
    """Run calibration sequences through a model once and gather what ``what`` asks for.

    Args:
        model: a transformers causal LM in eval mode (any device / dtype; statistics in float32/64).
        chunks: (n, seq_len) int64 token ids, or a list of model-input dicts (``input_ids`` (1, T) int64
            plus, for a vision-language model, the processor's image tensors; :mod:`.vl_calibration`).
        what: the statistics to gather.
        seed: label-sampling seed of the Fisher sequences.
        progress: show a progress bar.
        batch_size: sequences per forward pass (token tensors without Fisher sequences only).
    Returns:
        ModelStats (tensors on the model's device; ``token_counts`` and the imatrix sums on CPU).
    Raises:
        ValueError: ``batch_size`` > 1 with Fisher sequences or model-input dicts.
    """
    if batch_size > 1 and (what.fisher_sequences > 0 or isinstance(chunks, (list, tuple))):
        raise ValueError("batch_size > 1 needs token-id chunks and no Fisher sequences")
    st = ModelStats(imatrix=Imatrix() if what.imatrix else None)
    device = next(model.parameters()).device
    col = Collector(model, st, what)
    req = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    n_seq = len(chunks) if isinstance(chunks, (list, tuple)) else chunks.shape[0]
    desc, unit = ("calibration", "seq") if what.hessian or what.experts else ("imatrix", "chunk")
    try:
        for i in tqdm(range(0, n_seq, batch_size), desc=desc, disable=not progress, unit=unit):
            batch = _batch(chunks, i, batch_size, device)
            ids = batch["input_ids"]
            col.fisher = i < what.fisher_sequences
            col.begin()
            if col.fisher:
                with torch.enable_grad():
                    if batch.get("pixel_values") is not None and batch["pixel_values"].is_floating_point():
                        # gradients reach the vision tower's linears through its input
                        batch["pixel_values"] = batch["pixel_values"].detach().requires_grad_(True)
                    logits = model(**batch, use_cache=False).logits[0].to(torch.float32)
                    logp = torch.log_softmax(logits, -1)
                    with torch.no_grad():
                        y = sample_labels(logp, label_generator(device, seed, i))
                    logp.gather(1, y).sum().backward()
                st.fisher_sequences += 1
                st.fisher_tokens += ids.numel()
            else:
                with torch.no_grad():
                    col.forward_without_logits(model, batch)
            st.sequences += ids.shape[0]
            st.tokens += ids.numel()
            if st.imatrix is not None:
                st.imatrix.chunks += ids.shape[0]
    finally:
        col.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(req[n])
    if st.imatrix is not None:
        st.imatrix.sums = {k: v.cpu() for k, v in st.imatrix.sums.items()}
    return st


def sample_labels(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One label a row drawn from ``softmax`` of ``logp`` (T, V) float32 log-probabilities: (T, 1) int64.

    Inverse-CDF sampling (a uniform draw per row placed in the row's cumulative probabilities), the distribution
    ``torch.multinomial(logp.exp(), 1)`` draws from at a fraction of its cost on a CPU (0.7 s against ~0.05 s for
    512 x 49 152 on the 2-core machine); deterministic for a given generator."""
    c = logp.detach().exp().cumsum(-1)
    u = torch.rand(c.shape[0], 1, generator=generator, device=c.device, dtype=c.dtype) * c[:, -1:]
    return torch.searchsorted(c, u, right=True).clamp_max(c.shape[-1] - 1)


def label_generator(device, seed: int, s: int) -> torch.Generator:
    """The generator of Fisher sequence ``s``'s sampled labels: its own seed (``seed`` and ``s``), so that a sequence's
    labels do not depend on which sequences ran before it (on this rank)."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + s)


def collect_stats(model, chunks, *, fisher_sequences: int = 16, seed: int = 0,
                  progress: bool = True) -> ModelStats:
    """Run calibration sequences through a model once and collect the activation statistics the analysis needs:
    H and activation statistics, output maxima, token counts, MoE experts, Fisher diagonals (:func:`collect`).

    Args:
        model, chunks, seed, progress: as :func:`collect`.
        fisher_sequences: how many of the first sequences also get a backward pass for the Fisher diagonals.
    Returns:
        ModelStats (tensors on the model's device; ``token_counts`` on CPU).
    """
    return collect(model, chunks, Collect(fisher_sequences=fisher_sequences), seed=seed, progress=progress)


def compute_imatrix(model, chunks: torch.Tensor, dataset: str = "", progress: bool = True,
                    batch_size: int = 1) -> Imatrix:
    """Run calibration chunks through a model and collect the imatrix of every nn.Linear, as llama-imatrix does.

    Only the imatrix is gathered (no H, no MoE experts forward: :func:`collect` with ``Collect(imatrix=True,
    hessian=False, experts=False)``).

    Args:
        model: a transformers causal LM (any device / dtype; sums kept in float64).
        chunks: (n, n_ctx) int64 token ids (see ``tokenize_chunks``).
        dataset: recorded in the result.
        progress: show a progress bar.
        batch_size: chunks per forward pass.
    Returns:
        An Imatrix keyed by module name, sums on CPU; the lm_head is included (llama.cpp collects
        ``output.weight``, or ``token_embd.weight`` when the embedding is tied).
    """
    what = Collect(imatrix=True, hessian=False, experts=False)
    im = collect(model, chunks, what, progress=progress, batch_size=batch_size).imatrix
    im.dataset = dataset
    return im


def _state_classes() -> dict:
    return {c.__name__: c for c in (ModelStats, InputStats, OutputStats, moe.ExpertStats, Imatrix)}


def _to_state(v):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"__class__": type(v).__name__, **{f.name: _to_state(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, dict):
        return {k: _to_state(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_to_state(x) for x in v]
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _from_state(v, classes: dict):
    if isinstance(v, dict) and "__class__" in v:
        cls = classes[v["__class__"]]
        return cls(**{k: _from_state(x, classes) for k, x in v.items() if k != "__class__"})
    if isinstance(v, dict):
        return {k: _from_state(x, classes) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_state(x, classes) for x in v]
    return v


def stats_state(st: ModelStats) -> dict:
    """A ModelStats as plain dicts, lists, numbers, strings and tensors (copied): what ``torch.load(weights_only=True)``
    reads back (a resumable run's checkpoint), restored exactly by :func:`stats_from_state`."""
    return _to_state(st)


def stats_from_state(state: dict) -> ModelStats:
    """The ModelStats :func:`stats_state` describes (tensors as stored: load them onto the device they came from).

    Raises:
        KeyError: a class this module does not know.
    """
    return _from_state(state, _state_classes())
