"""A model's checkpoint weights read one skeleton part at a time (``quantize --stream --target safetensors``).

The safetensors target writes the weights :func:`dynaquant.runtime.moe.checkpoint_weights` gives for the loaded model
(its ``state_dict`` with every experts module's fused parameters as stacked views per projection). Here the same names,
in the same order, come from the model's skeleton on the meta device (:mod:`dynaquant.sources.skeleton`); a weight's
values are those of its part (the outer part, or one decoder block), materialized from the tensor source when the
weight is asked for, the part held before released first: at most one part holds real weights at any time.
"""

from __future__ import annotations

import torch

from dynaquant.exporters.safetensors.writer import tied_weights
from dynaquant.runtime.moe import checkpoint_weights
from dynaquant.sources.skeleton import ModelSkeleton


class PartWeights:
    """The checkpoint weights of a skeleton's model, one part live at a time.

    Args:
        sk: the skeleton (no part live; its dtype and device are the weights').
    Attributes:
        model: the skeleton's model (meta parameters but for the live part).
        meta: weight name -> meta tensor: the names in :func:`checkpoint_weights`' order and their shapes, no data.
        tied: weight name -> the names sharing its parameter (:func:`tied_weights`; a tied head).
    """

    def __init__(self, sk: ModelSkeleton):
        self.sk, self.model = sk, sk.model
        self.meta = checkpoint_weights(sk.model)
        self.tied = tied_weights(sk.model)
        self._part = None
        self._weights: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        """Weight ``name`` with its values (its part materialized, the part held before released).

        Raises:
            KeyError: not a weight of the model. ValueError: what :meth:`ModelSkeleton.materialize` raises.
        """
        if name not in self.meta:
            raise KeyError(name)
        part = self.sk.part_of_weight(name)
        if part != self._part:
            self.release()
            self.sk.materialize(part)
            self._part = part
            self._weights = {k: v for k, v in checkpoint_weights(self.model).items() if self.sk.part_of_weight(k) == part}
        return self._weights[name]

    def release(self) -> None:
        """Release the live part (nothing of the model's weights is held here after)."""
        self._weights = {}
        if self._part is not None:
            self.sk.release(self._part)
            self._part = None
