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

Relaxing the floors (:func:`relaxation_levels`): an explicit budget below the minimum the default floors allow (a dense
Llama-3-8B at 2.5 bpw: the floors alone need about 2.6 bpw with an imatrix) makes the planner step the default floors
down, one :class:`Relaxation` after another in :func:`floor_relaxations`' fixed order, lowest impact first, to the
low-bit classes llama.cpp's IQ2 mixes give those tensors (``llama_tensor_get_type`` for ``IQ2_XS``: token embedding
Q2_K; attn_q/k/output the mix's base type; attn_v Q4_K when n_gqa >= 4, else Q2_K; output Q5_K; no first-layers
floor), just far enough for the budget: user rules, super weights, vision, MoE and router rules are never relaxed.
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
EMBD_OUTPUT = "default: embeddings and output"
ATTENTION = "default: attention"
FIRST_LAYERS = "default: first layers"
_OUTPUT = "default: output head"
_ATTN_V = "default: attn_v, relaxed from the attention floor (attn_q/k/output free, as llama.cpp's IQ2 mixes)"
_FIRST_Q4 = "default: first layers, relaxed to the Q4_0 class"


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
    rules.append(Rule(_first_layers(model), "Q8_0", ">=", FIRST_LAYERS))
    rules.append(Rule(r"_shexp\.", "Q5_K", ">=", "default: shared experts"))
    if model.n_expert > 0:
        rules.append(Rule(r"\.attn_", "Q5_K", ">=", "default: MoE attention"))
        rules.append(Rule(r"\.ffn_(gate|up|down)\.", "Q5_K", ">=", "default: MoE dense FFN blocks"))
    rules.append(Rule(r"^(token_embd|output)\.", "Q4_0", ">=", EMBD_OUTPUT))
    rules.append(Rule(r"\.attn_", "Q4_0", ">=", ATTENTION))
    rules += cross_attention_rules()  # Mllama
    return rules


def _first_layers(model: ModelInfo) -> str:
    """The first-layers rule's pattern: blocks 0 .. max(1, n_layers // 32) - 1."""
    return r"^blk\.(" + "|".join(str(i) for i in range(max(1, model.n_layers // 32))) + r")\."


@dataclass(frozen=True)
class Relaxation:
    """One step of relaxing the default floors: for each ``(origin, rules)`` of ``changes``, every default rule of that
    origin is replaced by ``rules`` (none: the floor is gone). ``name`` says what was relaxed (the plan's
    ``relaxed_floors``, the log)."""

    name: str
    changes: tuple[tuple[str, tuple[Rule, ...]], ...]


def floor_relaxations(model: ModelInfo) -> list[Relaxation]:
    """The dense default floors' relaxations, in the order they are applied (lowest impact first, first layers last):

    1. llama.cpp's IQ2 mixes (``IQ2_XS``, ``IQ2_XXS``, ``IQ1_*``): the token embedding Q4_0 -> Q2_K class (not with
       tied embeddings, where it is the output head); attn_q, attn_k, attn_output lose their floor (the mixes' base
       type); attn_v keeps the Q4_0 class when ``model.n_gqa >= 4`` (the mixes' Q4_K), else the Q2_K class. One step:
       relaxing the embedding alone leaves the FFN at ~1.6 bpw on a Llama-3-8B at 2.5 bpw (the prior's predicted
       error 2.1x the step's);
    2. attn_v -> Q2_K class (when step 1 kept Q4_0);
    3. output head (and a tied embedding) Q4_0 -> Q2_K class (the mixes keep Q5_K: high impact, late);
    4. first layers Q8_0 -> Q4_0 class, then 5. -> Q2_K class (the mixes' first ffn_down).

    None for MoE models (``model.n_expert > 0``): their floors stay, the expert caps keep their plans small.
    """
    def rule(pattern, fmt, what):
        return Rule(pattern, fmt, ">=", f"default: {what}")

    if model.n_expert > 0:
        return []
    tied, gqa = model.tied_embeddings, model.n_gqa >= 4
    out = EMBD_OUTPUT if tied else _OUTPUT
    iq2 = ((ATTENTION, (Rule(r"\.attn_v\.", "Q4_0" if gqa else "Q2_K", ">=", _ATTN_V),)),)
    if not tied:
        iq2 = ((EMBD_OUTPUT, (Rule(r"^output\.", "Q4_0", ">=", _OUTPUT),
                              rule(r"^token_embd\.", "Q2_K", "token embedding, relaxed to the Q2_K class"))),) + iq2
    steps = [Relaxation(("" if tied else "token embedding: Q2_K class; ") + "attention: attn_q/k/output no floor, attn_v "
                        + ("Q4_0" if gqa else "Q2_K") + " class (llama.cpp's IQ2 mixes)", iq2)]
    if gqa:
        attn_v = rule(r"\.attn_v\.", "Q2_K", "attn_v, relaxed to the Q2_K class")
        steps.append(Relaxation("attn_v: Q2_K class", ((_ATTN_V, (attn_v,)),)))
    head = "output head (the tied token embedding)" if tied else "output head"
    pattern = r"^(token_embd|output)\." if tied else r"^output\."
    steps.append(Relaxation(f"{head}: Q2_K class", ((out, (rule(pattern, "Q2_K", f"{head}, relaxed to the Q2_K class"),)),)))
    first = _first_layers(model)
    steps.append(Relaxation("first layers: Q4_0 class", ((FIRST_LAYERS, (Rule(first, "Q4_0", ">=", _FIRST_Q4),)),)))
    steps.append(Relaxation("first layers: Q2_K class",
                            ((_FIRST_Q4, (rule(first, "Q2_K", "first layers, relaxed to the Q2_K class"),)),)))
    return steps


def relaxation_levels(defaults: Sequence[Rule], model: ModelInfo) -> list[tuple[tuple[str, ...], list[Rule]]]:
    """The default rules after each step of :func:`floor_relaxations` that changes them, cumulatively: [(the names of
    the steps applied so far, the rules then)], least relaxed first; [] when ``defaults`` holds none of the floors
    (``--no-default-rules``, or rules of the caller's own). Only rules whose ``origin`` a step names are replaced."""
    rules, names, out = list(defaults), (), []
    for step in floor_relaxations(model):
        changes = dict(step.changes)
        if not any(r.origin in changes for r in rules):
            continue
        rules = [x for r in rules for x in changes.get(r.origin, (r,))]
        names += (step.name,)
        out.append((names, rules))
    return out
