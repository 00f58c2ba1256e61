"""The evaluation's reference half, kept between runs: the reference model's hidden states at its output head.

An evaluation (:func:`dynaquant.analysis.evaluate.compare_models`) runs the reference and the quantized model on the
same chunks. Run after run the reference (the source model) and the chunks are the same, so on a CPU, where a
512-token forward of SmolLM2-135M takes about a second, half of the evaluation repeats itself. This cache keeps, for
each chunk, the input of the reference's output head on the scored positions ((keep, hidden) in the model's dtype:
4.7 MB for SmolLM2's 8 chunks of 255 float32 positions) in ``CACHE/eval-reference/KEY.pt``; a later evaluation runs
the head alone on them (a 255 x 576 x 49 152 product, ~0.05 s) instead of the whole model.

KEY is a SHA-256 of everything the reference's logits depend on: every parameter's and buffer's name, dtype, shape
and bytes (0.5 s for SmolLM2's 135 M float32 weights), the model's class and config, the chunks' token ids, the
scored length, and the torch and transformers versions. An entry is made only where the head of the kept states gives
the forward's logits bit for bit (checked on the first chunk): a model that changes its logits after the head
(soft-capping, a logit scale) is not cached and runs as before. Only for a reference on the CPU: on a GPU the forward
costs less than reading the weights back to hash them.

CACHE is :func:`dynaquant.workdir.cache_root` (``DYNAQUANT_CACHE=off`` turns it off); an entry is
written to a temporary file and renamed into place; a cache that cannot be read or written is skipped (a debug log
line), never an error.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from dynaquant.workdir import cache_root

log = logging.getLogger(__name__)


def fingerprint(model, chunks: torch.Tensor, keep: int) -> str | None:
    """The cache key of ``model``'s logits on ``chunks`` (n, n_ctx) int64 with ``keep`` scored positions (module
    docstring), or None where the model is not all on the CPU."""
    import transformers

    tensors = list(itertools.chain(model.named_parameters(), model.named_buffers()))
    if any(t.device.type != "cpu" for _, t in tensors):
        return None
    config = model.config.to_json_string() if hasattr(model, "config") else ""
    h = hashlib.sha256(json.dumps([type(model).__qualname__, config, keep, list(chunks.shape), torch.__version__,
                                   transformers.__version__]).encode())
    h.update(chunks.to(torch.int64).contiguous().numpy().tobytes())
    for name, t in tensors:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()[:32]


class ReferenceLogits:
    """The reference's logits of each chunk: from the kept hidden states (a hit) or from its forward, whose head
    inputs are recorded and kept at :meth:`close` (a miss).

    Args:
        model: the reference (a transformers causal LM with an output embedding).
        chunks: (n, n_ctx) int64 token ids; keep: scored positions (the ``logits_to_keep`` of each forward).
        forward: ``forward(model, ids, keep)`` -> (keep, vocab) float32 logits on the CPU (``evaluate._logits``).
        cached: False: every chunk from the forward, nothing read or kept.
    """

    def __init__(self, model, chunks: torch.Tensor, keep: int, forward, cached: bool = True):
        self.model, self.keep, self.forward, self.n = model, keep, forward, chunks.shape[0]
        self.head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.path: Path | None = None
        self.states: list[torch.Tensor] | None = None  # kept (hit) or recorded (miss) head inputs
        self.hit = False
        root = cache_root() if cached else None
        key = fingerprint(model, chunks, keep) if root is not None and self.head is not None else None
        if key is None:
            return
        self.path = root / "eval-reference" / f"{key}.pt"
        try:
            states = torch.load(self.path, weights_only=True) if self.path.is_file() else None
        except Exception as exc:  # a damaged entry is read as a miss and written again
            log.debug("%s: not read (%s)", self.path, exc)
            states = None
        if isinstance(states, list) and len(states) == chunks.shape[0]:
            self.states, self.hit = states, True
        else:
            self.states = []

    @torch.no_grad()
    def __call__(self, c: int, ids: torch.Tensor) -> torch.Tensor:
        """Chunk ``c``'s (keep, vocab) float32 logits (``ids``: its (n_ctx,) token ids)."""
        if self.hit:
            return self.head(self.states[c][None])[0].to(torch.float32)
        if self.states is None:
            return self.forward(self.model, ids, self.keep)
        seen: list[torch.Tensor] = []
        handle = self.head.register_forward_hook(lambda _m, args, _out: seen.append(args[0][0].detach().clone()))
        try:
            logits = self.forward(self.model, ids, self.keep)
        finally:
            handle.remove()
        if len(seen) != 1 or (c == 0 and not torch.equal(self.head(seen[0][None])[0].to(torch.float32), logits)):
            self.states = None  # the head's input alone does not give these logits: not cached
        else:
            self.states.append(seen[0])
        return logits

    def close(self) -> None:
        """Keep the recorded states (after every chunk ran)."""
        if self.hit or self.path is None or self.states is None or len(self.states) != self.n:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix="part-", suffix=".tmp", dir=self.path.parent)
            os.close(fd)
            try:
                torch.save(self.states, tmp)
                os.replace(tmp, self.path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except (OSError, RuntimeError) as exc:  # (torch.save's zip writer raises RuntimeError)
            log.debug("%s: not kept (%s)", self.path, exc)
