"""Planner rules: :class:`Rule` (a regex on GGUF tensor names and a format bound, as
``llama-quantize --tensor-type``) and the dynamic planner's default rules (:func:`default_rules`),
ordered data, first match wins; :mod:`dynaquant.quant.planner` applies them.

Vision-language models (names of :mod:`dynaquant.sources.hf_vl_full`):

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

import re
from collections.abc import Sequence
from dataclasses import dataclass

from dynaquant.quant.formats import FORMATS
from dynaquant.quant.presets import ModelInfo

VISION_FLOOR = "INT8_G128"


@dataclass(frozen=True)
class Rule:
    """A rule on tensors whose GGUF name matches ``pattern`` (``re.search``).

    ``op`` is ``"="`` (the tensor gets ``format``, as ``llama-quantize --tensor-type``), ``">="``
    (with a budget, the allocator only considers formats with at least ``format``'s bits per
    weight; without one, the tensor gets ``format`` unless another rule fixes it) or ``"<="``
    (at most ``format``'s bits per weight).
    """

    pattern: str
    format: str
    op: str = "="
    origin: str = "user"

    @classmethod
    def parse(cls, text: str, origin: str = "user") -> Rule:
        """Parse ``'REGEX=FORMAT'``, ``'REGEX>=FORMAT'`` or ``'REGEX<=FORMAT'``.

        Raises:
            ValueError: no operator, an invalid regex, or an unknown format (named in the message).
        """
        m = re.match(r"^(.*?)(>=|<=|=)([A-Za-z0-9_]+)$", text)
        if not m or not m.group(1):
            raise ValueError(f"rule {text!r}: expected REGEX=FORMAT (or REGEX>=FORMAT, REGEX<=FORMAT), e.g. 'ffn_down=Q6_K'")
        pattern, op, fmt = m.groups()
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"rule {text!r}: invalid regex: {exc}") from exc
        if fmt.upper() not in FORMATS:
            raise ValueError(f"rule {text!r}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
        return cls(pattern, fmt.upper(), op, origin)

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None

    def __str__(self) -> str:
        return f"{self.pattern}{self.op}{self.format}"


def vision_rules() -> list[Rule]:
    """The vision tower / projector floor; :func:`default_rules` puts it before the attention floor (first
    match wins, and ``\\.attn_`` matches ``v.blk.N.attn_q``)."""
    return [Rule(r"^(v|mm)\.", VISION_FLOOR, ">=", "default: vision tower and projector")]


def cross_attention_rules() -> list[Rule]:
    """Mllama's cross-attention floor (after the first-layers rule, so block 0 keeps its higher floor)."""
    return [Rule(r"\.cross_attn_(q|k|v|o)\.", "Q4_0", ">=", "default: cross-attention")]


EXPERT_CAP = "default: MoE routed experts"


def default_rules(model: ModelInfo, super_weight_tensors: Sequence[str] = (), has_imatrix: bool = True,
                  target: str = "gguf") -> list[Rule]:
    """The dynamic planner's default rules (after any user rule; each overridable by one).

    - vision-language models: vision tower and projector at least the Q8_0 class, cross-attention at
      the attention floor (:func:`vision_rules`, :func:`cross_attention_rules`);
    - tensors holding a confirmed super weight, and the first block(s): at least Q8_0
      (Yu et al. 2024; llama.cpp and Unsloth keep the first layers high too);
    - token embedding, output head and attention: "high", at least 4.5 bpw (Q4_0 / Q4_K class);
    - MoE routers (``ffn_gate_inp``, Qwen2-MoE's shared-expert gate ``ffn_gate_inp_shexp``)
      unquantized (F32), shared experts at least Q5_K class.
    - MoE models (``model.n_expert > 0``), after Unsloth's dynamic quants (DeepSeek-R1 at 1.58 bits):
      routed experts stored in MXFP4 (gpt-oss) stay MXFP4 (``MXFP4_G32`` for the ``safetensors``
      ``target``: the same OCP MX layout, so re-encoding is exact); otherwise routed gate/up experts at most
      IQ2_XXS (2.06 bpw) and down experts at most IQ2_XS (2.31 bpw, one step higher: the allocator
      chooses from IQ1_S up to these by the measurements), or Q2_K / Q3_K without an imatrix (the
      i-quants need one); attention (MLA included) and dense FFN blocks at least Q5_K. With an
      explicit budget ``make_plan`` also plans without the expert caps (origin :data:`EXPERT_CAP`)
      and keeps whichever plan has the lower predicted error.
    Norms, biases and 1-D tensors are never quantized (not rules: they are not candidates).
    """
    rules = [Rule(re.escape(n), "Q8_0", ">=", "default: super weight") for n in super_weight_tensors]
    rules.append(Rule(r"ffn_gate_inp(_shexp)?\.", "F32", "=", "default: MoE router"))
    rules += vision_rules()  # vision tower / projector floor, before the attention rules
    if model.n_expert > 0:  # before the first-layers rule: routed experts are capped in every block
        if model.expert_format:
            fmt = {"MXFP4": "MXFP4_G32"}.get(model.expert_format, model.expert_format) if target == "safetensors" \
                else model.expert_format
            rules.append(Rule(r"_exps\.weight", fmt, "=", "default: MoE experts kept in their stored format"))
        rules.append(Rule(r"ffn_(gate|up)_exps\.", "IQ2_XXS" if has_imatrix else "Q2_K", "<=", EXPERT_CAP))
        rules.append(Rule(r"ffn_down_exps\.", "IQ2_XS" if has_imatrix else "Q3_K", "<=", EXPERT_CAP))
    first = max(1, model.n_layers // 32)
    rules.append(Rule(r"^blk\.(" + "|".join(str(i) for i in range(first)) + r")\.", "Q8_0", ">=", "default: first layers"))
    rules.append(Rule(r"_shexp\.", "Q5_K", ">=", "default: shared experts"))
    if model.n_expert > 0:
        rules.append(Rule(r"\.attn_", "Q5_K", ">=", "default: MoE attention"))
        rules.append(Rule(r"\.ffn_(gate|up|down)\.", "Q5_K", ">=", "default: MoE dense FFN blocks"))
    rules.append(Rule(r"^(token_embd|output)\.", "Q4_0", ">=", "default: embeddings and output"))
    rules.append(Rule(r"\.attn_", "Q4_0", ">=", "default: attention"))
    rules += cross_attention_rules()  # Mllama
    return rules
