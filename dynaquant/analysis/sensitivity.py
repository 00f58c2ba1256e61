"""End-to-end checks: the KL divergence of the final logits when some weights are quantized.

Used two ways: per layer group (attention / MLP of one block) and format, the optional
end-to-end sensitivity that exllamav3 measures, which corrects the per-tensor predictions of
:mod:`.errors`; and for whole plans, to check predicted against measured KL divergence.
Weights are swapped in place (``Q(W)`` decoded to float) and restored afterwards; the KL
divergence is scored on held-out calibration sequences, every position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from dynaquant.quant.codecs import dequantize, quantize
from dynaquant.quant.formats import get_format, resolve_for_row


class ReferenceLogits:
    """Log-probabilities of the unmodified model on a few sequences, for KL divergence against it.

    Args:
        model: transformers causal LM; chunks: (n, T) int64 token ids.
        prefix_states: also keep the output of every decoder layer on every sequence (:attr:`states`), so that a
            model whose weights differ only from decoder layer ``b`` on is measured from there (``kld(model,
            start=b)``): the layers before ``b`` are skipped and layer ``b - 1``'s output is the kept one. The
            result is the full forward's bit for bit: checked once here (a pass from the middle layer with the
            weights unchanged must give the reference itself), else the states are dropped and every pass is whole
            (as for models whose decoder layers cannot be found, or return more than a tensor, or whose states
            would take more than :data:`PREFIX_STATES_FRACTION` of the device's free memory).
        batch: sequences per forward pass (the reference's and every measured pass's alike, so that an unchanged
            model measures 0 bit for bit); None: :func:`reference_batch` (1 off CUDA; on CUDA as many as
            :data:`LOGITS_BATCH_BYTES` of logits allow: the 8 held-out sequences of a Llama-3-8B's corrections in one
            pass instead of eight, each pass's matmuls 8x taller and one host sync a measurement instead of one a
            sequence).

    The reference log-probabilities stay on the model's device (n x T x vocab float32: 8 x 512 x 49152 x 4 bytes =
    0.8 GB for SmolLM2, 2.1 GB for a 128k vocabulary), so each KL divergence is computed where the logits are, not
    copied to the host and reduced there (which dominated the measured corrections' time on a GPU). The prefix states
    take ``n_layers x n x T x hidden`` of the model's dtype (8 x 512 tokens of a float32 Llama-3-8B: 2.1 GB).
    """

    @torch.no_grad()
    def __init__(self, model, chunks: torch.Tensor, prefix_states: bool = False, batch: int | None = None):
        self.chunks = chunks
        self.device = next(model.parameters()).device
        self.batch = batch if batch is not None else reference_batch(model, chunks, self.device)
        if self.batch < 1:
            raise ValueError(f"batch {self.batch}: at least one sequence a pass")
        self.batches = [chunks[i : i + self.batch] for i in range(0, chunks.shape[0], self.batch)]
        self.layers = decoder_layers(model) if prefix_states else None
        self.states: list[list[torch.Tensor]] | None = None
        if self.layers is not None and _states_fit(model, chunks, len(self.layers[1]), self.device):
            self.states = [[] for _ in self.batches]
            self.logp = []
            for i, c in enumerate(self.batches):
                with _recording(self.layers[1], self.states[i]) as ok:
                    self.logp.append(self._logp(model, c))
                if not ok[0]:
                    self.states = None
            if self.states is not None and not self._check(model):
                self.states = None
        else:
            self.logp = [self._logp(model, c) for c in self.batches]
        self._batch = 0

    def _logp(self, model, c: torch.Tensor) -> torch.Tensor:
        """(B, T, vocab) float32 log-probabilities of ``model`` on (B, T) chunks, on the model's device."""
        return torch.log_softmax(model(c.to(self.device), use_cache=False).logits.float(), -1)

    def _check(self, model) -> bool:
        """A pass from the middle layer, weights unchanged, gives the reference bit for bit."""
        b = max(1, len(self.layers[1]) // 2)
        with self._skipping(b):
            self._batch = 0
            return torch.equal(self._logp(model, self.batches[0]), self.logp[0])

    def start_of(self, model, names: Iterable[str]) -> int:
        """The first decoder layer the parameters ``names`` (HF names) can change: their layers' least index; the
        number of layers for an untied output head (only the final norm and the head run after the kept states);
        0 (the whole pass) for anything else, and always without :attr:`states`."""
        if self.states is None:
            return 0
        prefix, layers = self.layers[0] + ".", self.layers[1]
        head = model.get_output_embeddings()
        head = head.weight if head is not None else None
        embed = model.get_input_embeddings().weight
        params = dict(model.named_parameters())
        start = len(layers)
        for n in names:
            if n.startswith(prefix):
                start = min(start, int(n[len(prefix):].split(".", 1)[0]))
            elif not (head is not None and params.get(n) is head and head is not embed):
                return 0
        return start

    @contextmanager
    def _skipping(self, b: int):
        """Decoder layers ``0 .. b - 1`` pass their input through, and layer ``b - 1`` gives its kept output for the
        batch :attr:`_batch` (``b`` = 0: nothing changed)."""
        if not b:
            yield
            return
        layers = self.layers[1]
        saved, handle = {}, None
        try:
            for i in range(b):
                saved[i] = layers[i].__dict__.get("forward")
                layers[i].forward = _pass_through
            handle = layers[b - 1].register_forward_hook(lambda m, a, out: self.states[self._batch][b - 1])
            yield
        finally:
            if handle is not None:
                handle.remove()
            for i, f in saved.items():
                if f is None:
                    del layers[i].forward
                else:
                    layers[i].forward = f

    @torch.no_grad()
    def kld(self, model, start: int = 0) -> float:
        """Mean KL(reference || model) per token (nats) over all positions of the chunks; ``start``: the first decoder
        layer whose weights differ from the reference's (:meth:`start_of`; used only with :attr:`states`). Each
        sequence's sum is float32, the total float64 on the device (one host sync a call)."""
        tot, n = torch.zeros((), dtype=torch.float64, device=self.device), 0
        with self._skipping(start if self.states is not None else 0):
            for i, (c, lp) in enumerate(zip(self.batches, self.logp)):
                self._batch = i
                lq = self._logp(model, c)
                for j in range(lq.shape[0]):  # a sequence at a time: the temporaries are one (T, vocab) each
                    tot += (lp[j].exp() * (lp[j] - lq[j])).sum(-1).clamp_min(0).sum()
                n += lp.shape[0] * lp.shape[1]
        return float(tot) / n


# Logits bytes a ReferenceLogits batch may take on CUDA (each sequence: its float32 logits and log-probabilities).
LOGITS_BATCH_BYTES = 4 << 30


def reference_batch(model, chunks: torch.Tensor, device: torch.device) -> int:
    """Sequences per :class:`ReferenceLogits` pass: 1 off CUDA (the CPU's passes gain nothing from it), else all of
    ``chunks`` as far as their logits (2 x T x vocab x 4 bytes a sequence) fit in :data:`LOGITS_BATCH_BYTES` and an
    eighth of the free memory, at least 1."""
    if device.type != "cuda":
        return 1
    vocab = getattr(model.config.get_text_config(), "vocab_size", None) or 1
    per_seq = 2 * chunks.shape[1] * vocab * 4
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(chunks.shape[0], min(LOGITS_BATCH_BYTES, free // 8) // per_seq))


@contextmanager
def tf32_matmuls(device: str | torch.device, enabled: bool = True):
    """``with``: float32 matmuls on ``device`` run on CUDA's TF32 tensor cores (operands rounded to a 10-bit mantissa,
    float32 accumulation), restored on exit (also on error); on other devices nothing changes. ``enabled=False``: in
    full float32 instead (IEEE), e.g. for a measurement made inside a TF32 pass.

    For KL divergence measurements whose reference and measured passes both run inside: the rounding (relative
    ~2**-11 per operand, 8x finer than bf16's) is far below the quantization errors measured (Q8_0's ~2**-8 per
    weight), and the float32 passes run several times faster (a Llama-3-8B pass over 8 x 512 tokens: ~60 TFLOP)."""
    if torch.device(device).type != "cuda":
        yield
        return
    mm = torch.backends.cuda.matmul
    attr = "fp32_precision" if hasattr(mm, "fp32_precision") else "allow_tf32"  # (torch >= 2.9: the first)
    old = getattr(mm, attr)
    setattr(mm, attr, ("tf32" if enabled else "ieee") if attr == "fp32_precision" else enabled)
    try:
        yield
    finally:
        setattr(mm, attr, old)


# The prefix states of ReferenceLogits take at most this fraction of the device's free memory (else none are kept).
PREFIX_STATES_FRACTION = 0.25


def _pass_through(hidden_states, *args, **kwargs):
    return hidden_states


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList] | None:
    """The model's decoder layers: (qualified name, ModuleList) of the one ``ModuleList`` named ``*layers`` with
    ``num_hidden_layers`` members (of the config's text config: transformers' ``get_text_config``), or None when there
    is not exactly one."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and name.endswith("layers") and len(m) == n]
    return found[0] if n and len(found) == 1 else None


def _states_fit(model, chunks: torch.Tensor, n_layers: int, device: torch.device) -> bool:
    hidden = getattr(model.config.get_text_config(), "hidden_size", None)
    if not hidden:
        return False
    nbytes = n_layers * chunks.numel() * hidden * next(model.parameters()).element_size()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return nbytes <= PREFIX_STATES_FRACTION * free
    return nbytes <= 2 << 30


@contextmanager
def _recording(layers: torch.nn.ModuleList, into: list):
    """Hooks keeping each layer's output (a tensor) in ``into``, in layer order; yields ``[ok]``: False once a layer
    returned anything else."""
    ok = [True]

    def keep(m, a, out):
        if isinstance(out, torch.Tensor):
            into.append(out)
        else:
            ok[0] = False

    handles = [m.register_forward_hook(keep) for m in layers]
    try:
        yield ok
    finally:
        for h in handles:
            h.remove()
    ok[0] = ok[0] and len(into) == len(layers)


@torch.no_grad()
def decoded_weight(p: torch.Tensor, fmt: str, imatrix: torch.Tensor | None) -> torch.Tensor:
    """``Q(p)`` decoded: ``p`` (any shape, rows on the last axis) encoded in ``fmt`` (the block-size fallback applied
    as llama.cpp does) with the importance ``imatrix`` ((K,), ignored by float formats), decoded back to ``p``'s
    dtype, shape and device."""
    return encoded_weight(p, fmt, imatrix)[2]


def encoded_weight(p: torch.Tensor, fmt: str, imatrix: torch.Tensor | None) -> tuple[str, torch.Tensor, torch.Tensor]:
    """:func:`decoded_weight` with what it decoded: (the format encoded, after the block-size fallback; its bytes,
    ``quantize``'s (..., row bytes) uint8 on ``p``'s device, which the GGUF writer writes for the same weight, format
    and importance; the decoded weight)."""
    f, _ = resolve_for_row(fmt, p.shape[-1])
    codes = quantize(p.detach().float(), f, imatrix if f.kind != "float" else None)
    return f.name, codes, dequantize(codes, f).to(p.dtype).reshape(p.shape)


@torch.no_grad()
def kld_with_weights(model, ref: ReferenceLogits, formats: dict[str, str],
                     imatrix_of: Callable[[str], torch.Tensor | None]) -> float:
    """KL divergence of the model with some parameters quantized, then restored.

    Args:
        formats: HF parameter name -> format name (block-size fallbacks applied as llama.cpp does).
        imatrix_of: HF parameter name -> (K,) importance for the encoder, or None.
    """
    params = dict(model.named_parameters())
    decoded = {name: decoded_weight(params[name], fmt, imatrix_of(name)) for name, fmt in formats.items()}
    with SwappedWeights(params, decoded, list(decoded)):
        return ref.kld(model)


class SwappedWeights:
    """``with``: the storage of ``params[n]`` exchanged with ``tensors[n]`` (same shape and dtype) for each of
    ``names``, and exchanged back on exit (also on error). No copy of the weights is made where ``tensors[n]`` is on
    the parameter's device; one that lives elsewhere (the CPU, so that a whole plan's decoded weights need no second
    model's worth of GPU memory) is copied to the parameter's device and the parameter's own storage to
    ``tensors[n]``'s device while swapped: the GPU then holds one copy of each weight, plus one tensor in flight."""

    def __init__(self, params: dict, tensors: dict[str, torch.Tensor], names: list[str]):
        self.params, self.tensors, self.names = params, tensors, names

    def _swap(self):
        for n in self.names:
            p, t = self.params[n], self.tensors[n]
            if t.device == p.device:
                p.data, self.tensors[n] = t, p.data
            else:
                self.tensors[n] = p.data.to(t.device)
                p.data = t.to(p.device)

    def __enter__(self):
        self._swap()
        return self

    def __exit__(self, *exc):
        self._swap()


def group_sensitivity(model, ref: ReferenceLogits, groups: dict[str, list[str]], fmts: Iterable[str],
                      imatrix_of: Callable[[str], torch.Tensor | None], progress: bool = True) -> list[dict]:
    """KL divergence when only one group is quantized, for each group and format.

    Args:
        groups: group label (``blk.3.attn``) -> HF parameter names in it.
        fmts: format names (each tensor falls back by row size as llama.cpp does).
    Returns:
        rows ``{"group", "format", "kld"}``.
    """
    fmts = [get_format(f).name for f in fmts]  # unknown names fail before any work
    rows = []
    jobs = [(g, f) for g in groups for f in fmts]
    for g, f in tqdm(jobs, desc="sensitivity", disable=not progress, unit="group"):
        rows.append({"group": g, "format": f, "kld": kld_with_weights(model, ref, {n: f for n in groups[g]}, imatrix_of)})
    return rows
