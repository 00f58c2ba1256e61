"""Mixture-of-experts layers in safetensors checkpoints: per-expert layout, encoding, and :class:`DynaExperts`.

transformers (>= 5) holds a MoE layer's routed experts as fused 3-D parameters of one experts module
(``model.layers.N.mlp.experts``; layouts ``fused`` and ``gpt-oss``, see :mod:`dynaquant.analysis.experts`).
The planner sees each projection of all experts as one stacked tensor (GGUF ``blk.N.ffn_{gate,up,down}_exps``,
hf_name ``model.layers.N.mlp.experts.{gate,up,down}_proj.weight``, shape (E, N, K) in ``nn.Linear``
orientation), planned in one format for all experts.

Checkpoint layout (what vLLM and llm-compressor read and write for MoE models in compressed-tensors): one
linear module per expert and projection,

    model.layers.N.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight_packed / .weight_scale / ...
    model.layers.N.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight      (experts kept BF16)
    model.layers.N.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.bias        (gpt-oss: its expert biases)

for every architecture. Mixtral's original on-disk names (``block_sparse_moe.experts.{e}.w1/w3/w2``) are not
used: transformers 5 itself names Mixtral's experts module ``mlp.experts`` (its loader converts the old
names), the plan's stacked tensors carry that canonical name for every architecture, and one naming lets
:func:`dynaquant.load` and the ``config_groups`` targets treat all MoE families alike. (vLLM's Mixtral loader
expects the old names; such a checkpoint needs the rename ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` ->
``block_sparse_moe.experts.{e}.w1/w3/w2`` there.)

:func:`dynaquant.load` replaces each experts module whose checkpoint holds per-expert tensors by a
:class:`DynaExperts`: E children ``0 .. E-1``, each with ``gate_proj``, ``up_proj``, ``down_proj`` linear
layers (:class:`~dynaquant.runtime.linear.DynaLinear` where quantized, else ``nn.Linear``), and a forward with
transformers' signature ``forward(hidden_states, top_k_index, top_k_weights)`` and semantics (fused:
``down(act(gate x) * up x)``; gpt-oss: biases and the module's own ``_apply_gate`` on the interleaved
gate/up output), so the model's own MoE block and router run unchanged. On CUDA each expert's gate and up run
as one kernel call (:func:`dynaquant.runtime.linear.fuse_projections` finds them as siblings).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from dynaquant.quant.runtime import RuntimeWeight, encode
from dynaquant.runtime import custom_ops
from dynaquant.sources.experts import PROJS, dispatch, expert_weight, find_experts, layout_of

log = logging.getLogger(__name__)

# a per-expert linear module of the checkpoint: (experts module, expert, proj)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def checkpoint_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights to write for ``model``: its ``state_dict`` with every experts module's fused parameters
    replaced by stacked views per projection (no copies).

    For experts module ``m`` (any layout): ``m.{gate,up,down}_proj.weight`` (E, N, K) (gate/up (E, I, H),
    down (E, H, I); :func:`dynaquant.sources.experts.expert_weight`) and, for gpt-oss,
    ``m.{gate,up}_proj.bias`` (E, I) (the interleaved ``gate_up_proj_bias`` split) and ``m.down_proj.bias``
    (E, H). A dense model's ``state_dict`` is returned unchanged.
    """
    sd = model.state_dict()
    experts = find_experts(model)
    if not experts:
        return sd
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for key, value in sd.items():
        mod = key.rpartition(".")[0]
        if mod not in experts:
            out[key] = value
            continue
        if mod in done:
            continue
        done.add(mod)
        m = experts[mod]
        for proj in PROJS:
            out[f"{mod}.{proj}.weight"] = expert_weight(m, proj).detach()
        if layout_of(m) == "gpt-oss":
            b = m.gate_up_proj_bias.detach()
            out[f"{mod}.gate_proj.bias"], out[f"{mod}.up_proj.bias"] = b[..., 0::2], b[..., 1::2]
            out[f"{mod}.down_proj.bias"] = m.down_proj_bias.detach()
    return out


# on-disk module names that transformers 5 renames when it loads a checkpoint (its conversion mapping):
# Mixtral's ``block_sparse_moe`` is ``mlp`` in memory (experts and router alike)
_ON_DISK_RENAMES: tuple[tuple[str, str], ...] = ((".block_sparse_moe.", ".mlp."),)


def in_memory_plan(plan, weights: Mapping[str, torch.Tensor]):
    """A copy of ``plan`` whose ``hf_name`` are the model's in-memory names (the keys of ``weights``,
    :func:`checkpoint_weights`), where the tensor source gave on-disk names transformers renames on load
    (Mixtral's router ``model.layers.N.block_sparse_moe.gate.weight`` -> ``model.layers.N.mlp.gate.weight``).
    Names already in ``weights``, and names with no renamed match, are kept.

    Args:
        plan: a :class:`dynaquant.quant.plan.Plan`.
    Returns:
        A new Plan (entries copied); ``plan`` is not changed.
    """
    import copy
    import dataclasses

    entries = []
    for e in plan.entries:
        name = e.hf_name
        mla = re.match(r"^(.*\.self_attn\.)(k|v)_b_proj\.weight$", name or "")
        if mla and name not in weights and mla.group(1) + "kv_b_proj.weight" in weights:
            # MLA's kv_b_proj, split into attn_k_b / attn_v_b for llama.cpp only: written whole, unquantized
            # (the safetensors target keeps the 3-D split tensors BF16 anyway)
            if mla.group(2) == "k":
                kv = mla.group(1) + "kv_b_proj.weight"
                entries.append(dataclasses.replace(e, name=e.name.replace("attn_k_b", "attn_kv_b"), hf_name=kv,
                                                   shape=tuple(weights[kv].shape), format="BF16", requested="BF16",
                                                   reason="MLA kv_b_proj (llama.cpp's attn_k_b/attn_v_b): kept BF16"))
            continue
        if name and name not in weights:
            for old, new in _ON_DISK_RENAMES:
                if old in name and name.replace(old, new) in weights:
                    name = name.replace(old, new)
                    break
        entries.append(dataclasses.replace(e, hf_name=name))
    out = copy.copy(plan)
    out.entries = entries
    return out


def encode_experts(weight: torch.Tensor, fmt: str, imatrix: torch.Tensor | None = None, *,
                   device: str | torch.device | None = None) -> list[RuntimeWeight]:
    """Quantize a stacked expert tensor expert by expert (:func:`dynaquant.quant.runtime.encode`), one expert
    in float32 at a time.

    Args:
        weight: (E, N, K) float tensor, K a multiple of the format's group size.
        fmt: a runtime format name (one for all experts).
        imatrix: None, (K,) shared by all experts, or (E, K) per expert (llama.cpp's per-expert imatrix;
            an unrouted expert's all-zero row means plain rounding for it).
        device: where the encoder runs (default: the weight's device).
    Returns:
        E RuntimeWeights of shape (N, K), on the CPU.
    Raises:
        ValueError: not 3-D, an imatrix of another shape, or what ``encode`` raises.
    """
    if weight.ndim != 3:
        raise ValueError(f"{fmt}: stacked experts are (E, N, K), got shape {tuple(weight.shape)}")
    n_exp, _, k = weight.shape
    if imatrix is not None and tuple(imatrix.shape) not in ((k,), (n_exp, k)):
        raise ValueError(f"{fmt}: imatrix of shape {tuple(imatrix.shape)} for experts of shape {tuple(weight.shape)}")
    dev = torch.device(device) if device is not None else weight.device
    out = []
    for e in range(n_exp):
        imp = imatrix if imatrix is None or imatrix.ndim == 1 else imatrix[e]
        if imp is not None and not bool((imp > 0).any()):
            imp = None
        out.append(encode(weight[e].to(dev, torch.float32), fmt, None if imp is None else imp.to(dev)).to("cpu"))
    return out


def expand_expert_formats(expert_formats: Mapping[str, str], model: nn.Module) -> dict[str, str]:
    """Per-expert module -> format, from the config extension's ``expert_formats`` (stacked module ->
    format for all its experts), over ``model``'s per-expert linear modules (after :func:`replace_experts`).

    Raises:
        ValueError: a stacked module of the extension with no per-expert module in the model (named).
    """
    out: dict[str, str] = {}
    seen: set[str] = set()
    for name, _ in model.named_modules():
        m = _PER_EXPERT.match(name)
        if m is None:
            continue
        key = f"{m.group(1)}.{m.group(3)}"
        if key in expert_formats:
            out[name] = expert_formats[key]
            seen.add(key)
    missing = sorted(set(expert_formats) - seen)
    if missing:
        raise ValueError(f"quantized experts not in the model: {', '.join(missing[:5])}")
    return out


class _Expert(nn.Module):
    """One expert's projections (``nn.Linear``, replaced by DynaLinear where quantized)."""

    def __init__(self, hidden: int, inter: int, bias: bool, device, dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=bias, device=device, dtype=dtype)


class DynaExperts(nn.Module):
    """A transformers experts module with one linear layer per expert and projection (module docstring).

    Args:
        source: the transformers experts module replaced (layout ``fused`` or ``gpt-oss``; may be on the
            meta device): its shapes, ``act_fn`` or ``_apply_gate`` (with ``alpha`` / ``limit``) are taken.
        device, dtype: of the (empty) expert linears; the checkpoint is loaded over them.
    Children:
        ``"0" .. "E-1"``: each with ``gate_proj`` (H -> I), ``up_proj`` (H -> I), ``down_proj`` (I -> H), biases
        for gpt-oss.
    Raises:
        ValueError: ``source`` is not a transformers experts module.
    """

    def __init__(self, source: nn.Module, *, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.layout = layout_of(source)
        if self.layout is None:
            raise ValueError(f"{type(source).__name__}: not a transformers experts module")
        gate = expert_weight(source, "gate_proj")
        self.num_experts, inter, hidden = (int(s) for s in gate.shape)
        gpt = self.layout == "gpt-oss"
        for e in range(self.num_experts):
            self.add_module(str(e), _Expert(hidden, inter, gpt, device, dtype))
        if gpt:
            self.alpha, self.limit = source.alpha, source.limit
            self._gate_fn = type(source)._apply_gate
        else:
            self.act_fn = source.act_fn
        self.inter = inter
        # (gate/up group, down group) of the experts' stacked kernel layouts, set by linear.fuse_experts
        self.grouped = None
        self._handle = custom_ops.register(self)  # this layer in compiled graphs (dynaquant::experts)

    def __setstate__(self, state) -> None:  # (copy.deepcopy, pickle: the copy is a layer of its own)
        super().__setstate__(state)
        self._handle = custom_ops.register(self)

    def expert(self, e: int) -> nn.Module:
        """Expert ``e``'s module (``gate_proj``, ``up_proj``, ``down_proj``)."""
        return self._modules[str(e)]

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, layout={self.layout}"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts forward.

        Args:
            hidden_states: (T, H) tokens (any leading shape that flattens to T).
            top_k_index: (T, k) int64 chosen experts; values outside ``0 .. E-1`` (masked choices) are skipped.
            top_k_weights: (T, k) routing weights.
        Returns:
            (same shape as hidden_states) ``sum_j w[t, j] * expert_{idx[t, j]}(x_t)`` in the input's dtype. Under
            ``torch.compile``, one ``dynaquant::experts`` node (:mod:`.custom_ops`) that runs :meth:`op_forward`.
        """
        if torch.compiler.is_compiling():
            return torch.ops.dynaquant.experts(hidden_states, top_k_index, top_k_weights, self._handle)
        return self.op_forward(hidden_states, top_k_index, top_k_weights)

    def op_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """The forward run eagerly (grouped launches, or the loop over routed experts), contiguous."""
        g = self.grouped
        if g is not None and g[0].intact and g[1].intact:
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights).contiguous()
        return dispatch(hidden_states, top_k_index, top_k_weights, self.num_experts, self._expert).contiguous()

    def _grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
        """The forward as two grouped launches over all routed experts (:mod:`dynaquant.kernels.grouped`): tokens
        sorted by expert (one routing launch up to 1024 slots), gate/up of every slot with the activation in its
        epilogue (SiLU; another ``act_fn`` as torch ops after it), down of every slot weighted and written back in
        slot order by the kernel, then each token's k outputs summed in choice order (deterministic: no atomics)."""
        from dynaquant.kernels.grouped import grouped_linear, route

        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        t = x.shape[0]
        idx = top_k_index.reshape(t, -1)
        k, e, inter = idx.shape[1], self.num_experts, self.inter
        per_expert = t * k // e
        r = route(idx, e, block_m=16 if per_expert <= 16 else 32 if per_expert <= 32 else 64)
        launch = grouped_launch(t, self.grouped[0].packed.fmt, x.device)
        if is_silu(self.act_fn):  # (S, I): silu(gate) * up in the launch's epilogue, slots in expert order
            h = grouped_linear(x, self.grouped[0].packed, r, act="silu", **launch)
        else:
            gu = grouped_linear(x, self.grouped[0].packed, r, **launch)  # (S, 2I): gate then up
            h = self.act_fn(gu[:, :inter]) * gu[:, inter:]
        y = grouped_linear(h, self.grouped[1].packed, r, sorted_input=True, slot_weights=top_k_weights.reshape(-1),
                           **launch)  # (S, H): each slot's output times its weight, in slot order t k + j
        return y.view(t, k, -1).sum(1).to(hidden_states.dtype).reshape(shape)

    def _expert(self, e: int, x: torch.Tensor, _w: torch.Tensor) -> torch.Tensor:
        ex = self.expert(e)
        gate, up = ex.gate_proj(x), ex.up_proj(x)
        if self.layout == "gpt-oss":
            h = self._gate_fn(self, torch.stack((gate, up), dim=-1).flatten(-2))
        else:
            h = self.act_fn(gate) * up
        return ex.down_proj(h)


def is_silu(act) -> bool:
    """Whether the activation ``act`` is SiLU (``torch.nn.SiLU``, ``torch.nn.functional.silu``, or transformers'
    ``SiLUActivation``, ``ACT2FN["silu"]``): the grouped gate/up launch then computes it in its epilogue."""
    cls = type(act)
    return (act is torch.nn.functional.silu or cls is nn.SiLU
            or (cls.__name__ == "SiLUActivation" and cls.__module__ == "transformers.activations"))


def grouped_launch(tokens: int, fmt, device: torch.device) -> dict:
    """Launch shape of a MoE layer's two grouped calls (:func:`dynaquant.kernels.grouped.grouped_linear` keywords)
    for ``tokens`` tokens of experts in ``fmt`` (a :class:`dynaquant.kernels.KernelFormat`) on ``device``. Measured
    with ``benchmarks/moe_kernels.py`` (kernels/NOTES.md): up to 16 tokens one program a slot on the CUDA cores
    (H100), above that tensor-core tiles of a routing block; on sm_90+ symmetric INT4 / INT2 group-128 experts take
    the packed-fp16 word products with 64-word K tiles and 32-row N tiles (H200: Qwen3-30B-A3B and DeepSeek-V3
    layers at 1 and 16 tokens 1.10-1.47x faster than 64 rows of 16 words)."""
    from dynaquant.kernels import device_info

    if tokens > 16:
        return dict(block_n=128, num_stages=3)
    if (fmt.kind == "int" and fmt.symmetric and fmt.bits in (2, 4) and fmt.group_size == 128
            and device_info(device).capability >= (9, 0)):
        return dict(gemv=True, block_n=32, num_warps=2, half2=True, words=64)
    return dict(gemv=True, block_n=64, num_warps=2)


def replace_experts(model: nn.Module, checkpoint_keys: Iterable[str], *, dtype: torch.dtype | None = None) -> list[str]:
    """Replace each experts module whose experts the checkpoint stores per expert (a key
    ``{module}.0.gate_proj.…``) by a :class:`DynaExperts` on the meta device.

    Args:
        model: a transformers model (built on the meta device by :func:`dynaquant.load`).
        checkpoint_keys: the tensor names of the checkpoint's shards.
        dtype: of the expert linears.
    Returns:
        The names of the replaced modules.
    """
    prefixes = {m.group(1) for k in checkpoint_keys if (m := _PER_EXPERT.match(k.rpartition(".")[0]))}
    replaced = []
    for name, mod in find_experts(model).items():
        if name not in prefixes:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, DynaExperts(mod, device="meta", dtype=dtype))
        replaced.append(name)
    return replaced
