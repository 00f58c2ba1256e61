"""Default planner rules for vision-language models (names of :mod:`dynaquant.sources.hf_vl_full`).

- the vision tower (``v.*``) and the projector (``mm.*``): at least INT8_G128 (8.125 bpw), i.e. the Q8_0
  class: INT8 or BF16 on the safetensors target, Q8_0 or wider on GGUF. Vision encoders are small next
  to the language model and their errors reach every image token, so the budget allocator may lift them
  but never lowers them; a user rule (``--rule 'v\\.blk\\.3\\.=INT4_G128'``, matched first) is the
  measured exception;
- Mllama's cross-attention projections (``blk.N.cross_attn_{q,k,v,o}``): the attention floor (at least
  Q4_0 class, 4.5 bpw), as the self-attention projections (``\\.attn_`` does not match them).

The rules match only those names, so text models are unaffected.
"""

from __future__ import annotations

VISION_FLOOR = "INT8_G128"


def vision_rules() -> list:
    """The vision tower / projector floor as :class:`dynaquant.quant.planner.Rule` objects; ``default_rules``
    puts it before the attention floor (first match wins, and ``\\.attn_`` matches ``v.blk.N.attn_q``)."""
    from dynaquant.quant.planner import Rule

    return [Rule(r"^(v|mm)\.", VISION_FLOOR, ">=", "default: vision tower and projector")]


def cross_attention_rules() -> list:
    """Mllama's cross-attention floor (after the first-layers rule, so block 0 keeps its higher floor)."""
    from dynaquant.quant.planner import Rule

    return [Rule(r"\.cross_attn_(q|k|v|o)\.", "Q4_0", ">=", "default: cross-attention")]
