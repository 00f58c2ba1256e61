"""The former entry of the safetensors target, kept for one release: use ``quantize(..., target="safetensors")``
(:class:`dynaquant.pipeline.safetensors_target.SafetensorsTarget` says what the target does)."""

from __future__ import annotations

from dynaquant.config import QuantizeConfig
from dynaquant.pipeline.quantize import QuantizeResult, run_quantize


def quantize_safetensors(model=None, **kwargs) -> QuantizeResult:
    """``quantize(model, target="safetensors", **kwargs)``; also takes ``keep_super_weights`` and ``max_shard_bytes``
    (:class:`dynaquant.config.QuantizeConfig`). Deprecated: one release more.

    Raises:
        ValueError, InputError, planner.BudgetError: as ``dynaquant.quantize``.
    """
    return run_quantize(model, QuantizeConfig(target="safetensors", **kwargs))
