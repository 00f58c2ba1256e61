"""The importance matrix (imatrix): per input column E[x^2] of every linear layer.

Collected by the calibration collector (:func:`dynaquant.analysis.stats.compute_imatrix`) with
forward hooks over calibration chunks, as llama.cpp's ``llama-imatrix`` does (it accumulates the
sum of squared activations per input column of each matmul and the number of rows seen). Keys are
HF module names (``model.layers.3.mlp.down_proj``); ``imatrix_by_gguf_name`` re-keys them to
llama.cpp's tensor names; :mod:`.imatrix_io` reads and writes imatrix files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
