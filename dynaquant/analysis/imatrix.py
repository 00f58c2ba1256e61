"""The importance matrix (imatrix): per input column E[x^2] of every linear layer.

Collected with forward hooks over calibration chunks, as llama.cpp's ``llama-imatrix``
does (it accumulates the sum of squared activations per input column of each matmul
and the number of rows seen). Keys are HF module names (``model.layers.3.mlp.down_proj``);
``imatrix_by_gguf_name`` re-keys them to llama.cpp's tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm


@dataclass
class Imatrix:
    """Per-column activation statistics.

    Attributes:
        sums: module name -> (K,) float64 sum over tokens of x^2 for each input column; for a MoE
            experts projection (``model.layers.3.mlp.experts.down_proj``) (n_expert, K), one row per expert.
        counts: module name -> number of tokens (rows) accumulated; (n_expert,) int64 for experts.
        chunks: calibration chunks seen.
        dataset: what the calibration text was (file path or default id).
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int | torch.Tensor] = field(default_factory=dict)
    chunks: int = 0
    dataset: str = ""

    def mean(self, name: str) -> torch.Tensor:
        """(K,) float32 E[x^2] of a module's inputs ((n_expert, K) for experts; zero rows for unrouted ones).

        Raises:
            KeyError: no statistics for that module.
        """
        c = self.counts[name]
        if isinstance(c, torch.Tensor):
            return (self.sums[name] / c.clamp_min(1).to(self.sums[name].dtype)[:, None]).to(torch.float32)
        return (self.sums[name] / max(c, 1)).to(torch.float32)

    def names(self) -> list[str]:
        return list(self.sums)


def _linear_modules(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@torch.no_grad()
def compute_imatrix(model, chunks: torch.Tensor, dataset: str = "", progress: bool = True,
                    batch_size: int = 1) -> Imatrix:
    """Run calibration chunks through a model and collect the imatrix of every nn.Linear.

    Args:
        model: a transformers causal LM (any device/dtype; statistics are kept in float64 on CPU... device).
        chunks: (n, n_ctx) int64 token ids (see ``tokenize_chunks``).
        dataset: recorded in the result.
        progress: show a progress bar.
        batch_size: chunks per forward pass.
    Returns:
        An Imatrix keyed by module name; the lm_head is included (llama.cpp collects
        ``output.weight``, or ``token_embd.weight`` when the embedding is tied).
    """
    mods = _linear_modules(model)
    im = Imatrix(dataset=dataset)
    device = next(model.parameters()).device

    def hook(name):
        def fn(_mod, inputs, _out):
            x = inputs[0].detach()
            x = x.reshape(-1, x.shape[-1]).to(torch.float32)
            s = (x * x).sum(0).to(torch.float64)
            if name in im.sums:
                im.sums[name] += s
            else:
                im.sums[name] = s
            im.counts[name] = im.counts.get(name, 0) + x.shape[0]
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
    try:
        for i in tqdm(range(0, chunks.shape[0], batch_size), desc="imatrix", disable=not progress, unit="chunk"):
            model(chunks[i : i + batch_size].to(device), use_cache=False)
            im.chunks += min(batch_size, chunks.shape[0] - i)
    finally:
        for h in handles:
            h.remove()
    im.sums = {k: v.cpu() for k, v in im.sums.items()}
    return im
