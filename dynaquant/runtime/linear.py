"""The quantized linear layer that runs dynaquant's safetensors checkpoints: :class:`DynaLinear`, and the fusion of
sibling layers into one kernel call (:func:`fuse_projections`, :func:`fuse_experts`).

A :class:`DynaLinear` holds the compressed-tensors tensors as stored (``weight_packed``, ``weight_scale``, ...; see
:mod:`dynaquant.quant.runtime`) and computes ``x @ dequant(W).T + b``:

- on CUDA, with the Triton kernel that :mod:`dynaquant.kernels` provides for the format, if any;
- otherwise (CPU, no kernel, float32 inputs) with the torch reference: decode the weight in
  float32 (:func:`dynaquant.quant.runtime.decode`, super weights restored), cast it to the
  input's dtype and call ``F.linear``; the same checkpoint runs everywhere.

Under ``torch.compile`` each call is one ``dynaquant::linear`` node (:mod:`.custom_ops`): no graph break.

Kernel hook (:func:`kernel_op`, looked up lazily: ``dynaquant.kernels`` is never imported at load
time of this module). An op is any object with::

    op.prepare(weight: RuntimeWeight) -> packed | None   # once per layer, tensors on its CUDA device, super
                                                         # weights included; None: no kernel for this shape
    op.linear(x: Tensor, packed, bias) -> Tensor         # x (..., K) bf16/fp16 -> (..., N) in x.dtype,
                                                         # bias and super weights applied
    op.unprepare(packed) -> (codes, scales, zeros, global_scale)   # optional: the inverse of prepare, bit for bit
                                                                   # (super weights aside)

found as ``dynaquant.kernels.KERNELS[format]`` when the kernels package has such a registry, else made
from its ``pack(codes, scales, zeros, fmt, *, global_scale, super_weights)`` and ``linear(x, packed, bias)``
functions for every format ``KernelFormat.parse`` accepts.

With ``unprepare`` a prepared layer keeps one copy of its weight on the GPU, the kernel's layout: the checkpoint
buffers are released (zero-element placeholders) and rebuilt from the layout when read (``state_dict``,
:meth:`DynaLinear.runtime_weight`, :meth:`DynaLinear.dequantize`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from dynaquant.quant.runtime import (
    RuntimeWeight,
    decode,
    from_compressed_tensors,
    runtime_format,
    to_compressed_tensors,
)
from dynaquant.runtime import custom_ops

log = logging.getLogger(__name__)


class _PackLinearOp:
    """The op made from ``dynaquant.kernels.pack`` / ``linear`` (module docstring)."""

    def __init__(self, kernels):
        self.kernels = kernels

    def prepare(self, weight: RuntimeWeight):
        codes, scales, zeros, gs = weight.unpacked()
        return self.kernels.pack(codes, scales, zeros, weight.format, global_scale=gs, super_weights=weight.super_weights)

    def linear(self, x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.linear(x, packed, bias)

    def unprepare(self, packed):
        codes, scales, zeros = self.kernels.unpack(packed)
        gs = torch.tensor(packed.global_scale, dtype=torch.float32, device=codes.device) \
            if packed.fmt.kind == "nvfp4" else None
        return codes, scales, zeros, gs


def kernel_op(fmt: str):
    """The kernel op for a runtime format (module docstring), or None: no kernels package (no Triton on
    this platform), or no kernel for the format."""
    try:
        from dynaquant import kernels
    except ImportError as exc:
        log.debug("dynaquant.kernels unavailable: %s", exc)
        return None
    registry = getattr(kernels, "KERNELS", None)
    if registry is not None:
        return registry.get(fmt)
    if not (hasattr(kernels, "pack") and hasattr(kernels, "linear")):
        return None
    parse = getattr(getattr(kernels, "KernelFormat", None), "parse", None)
    if parse is not None:
        try:
            parse(fmt)
        except ValueError:
            return None
    return _PackLinearOp(kernels)


def _kernel_device(t: torch.Tensor) -> bool:
    """Whether kernels may run on ``t``'s device (CUDA)."""
    return t.is_cuda


def _kernel_input(x: torch.Tensor) -> bool:
    """Whether a kernel takes this input: on its device, bf16 or fp16."""
    return _kernel_device(x) and x.dtype in (torch.float16, torch.bfloat16)


def _buffer_specs(fmt: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The compressed-tensors tensors of an (n, k) weight in ``fmt``: name -> (shape, dtype)."""
    f = runtime_format(fmt)
    groups = k // f.block_size
    if f.kind == "int":
        specs = {"weight_packed": ((n, -(-k * f.bits // 32)), torch.int32), "weight_scale": ((n, groups), torch.float16),
                 "weight_shape": ((2,), torch.int64)}
        if f.zero_bits:
            specs["weight_zero_point"] = ((-(-n * f.bits // 32), groups), torch.int32)
        return specs
    specs = {"weight_packed": ((n, k // 2), torch.uint8),
             "weight_scale": ((n, groups), torch.uint8 if f.name == "MXFP4_G32" else torch.float8_e4m3fn)}
    if f.name == "NVFP4_G16":
        specs["weight_global_scale"] = ((1,), torch.float32)
    return specs


class DynaLinear(nn.Module):
    """A linear layer whose weight is stored in a runtime format (module docstring).

    Args:
        in_features, out_features: K and N.
        fmt: the runtime format name; K must be a multiple of its group size.
        bias: whether the layer has a bias (kept in the model dtype).
        device, dtype: of the (empty) buffers / bias; the checkpoint tensors are loaded over them.
    Buffers (persistent, compressed-tensors names and layouts): ``weight_packed``, ``weight_scale``
        and by format ``weight_zero_point``, ``weight_global_scale``, ``weight_shape``.
    Raises:
        ValueError: not a runtime format, or K not a multiple of its group size.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False, *,
                 device=None, dtype: torch.dtype | None = None):
        super().__init__()
        f = runtime_format(fmt)
        if not f.fits(in_features):
            raise ValueError(f"{f.name}: {in_features} input features are not a multiple of {f.block_size}")
        self.in_features, self.out_features, self.format = in_features, out_features, f.name
        for name, (shape, dt) in _buffer_specs(f.name, out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        self.super_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.use_kernels = True
        self._rw: RuntimeWeight | None = None
        self._op = None
        self._packed = None
        self._fused: tuple[_FusedProjection, int] | None = None
        self._released = False  # the checkpoint buffers are placeholders; the kernel layout holds the weight
        self._handle = custom_ops.register(self)  # this layer in compiled graphs (dynaquant::linear)
        _state_dict_hook(self, _released_state)
        self._register_load_state_dict_pre_hook(_before_load, with_module=True)

    def __setstate__(self, state) -> None:  # (copy.deepcopy, pickle: the copy is a layer of its own)
        super().__setstate__(state)
        self._handle = custom_ops.register(self)

    def extra_repr(self) -> str:
        fused = f", fused={self._fused[0].names[self._fused[1]]}" if self._fused is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, " \
               f"bias={self.bias is not None}, kernel={self._op is not None or self._fused is not None}{fused}"

    def set_super_weights(self, items) -> None:
        """Weights kept exactly: ``[[row, col, value], ...]`` (torch (out, in) indices). Call :meth:`prepare` after."""
        items = list(items)
        if not items:
            self.super_weights = None
            return
        rows = torch.tensor([int(r) for r, _, _ in items], dtype=torch.int64)
        cols = torch.tensor([int(c) for _, c, _ in items], dtype=torch.int64)
        vals = torch.tensor([float(v) for _, _, v in items], dtype=torch.float32)
        self.super_weights = (rows, cols, vals)

    def runtime_weight(self) -> RuntimeWeight:
        """The weight unpacked from the buffers (on their device), or from the kernel layout once the buffers are
        released (on its device), super weights included."""
        if self._released:
            return self._from_layout()
        tensors = {n: b for n, b in self.named_buffers(recurse=False)}
        sw = None if self.super_weights is None else tuple(t.to(self.weight_packed.device) for t in self.super_weights)
        return from_compressed_tensors(self.format, tensors, (self.out_features, self.in_features), sw)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 decoded weight, super weights restored."""
        return decode(self._rw if self._rw is not None else self.runtime_weight())

    def prepare(self) -> None:
        """Unpack the buffers once, and on CUDA build the kernel's layout when a kernel exists; when the kernel can
        give the weight back (``op.unprepare``), release the buffers: one copy of the weight on the GPU. Called by
        :func:`load`; call again after changing buffers (``load_state_dict`` restores them) or moving the module."""
        rw = self.runtime_weight()
        if self._released:  # (from the layout: the buffers again, should no kernel take it now)
            self._restore(to_compressed_tensors(rw))
        if self._fused is not None:  # (its group no longer holds this layer's weight)
            self._fused[0].intact = False
        self._op = self._packed = self._fused = None
        self._rw = rw
        if _kernel_device(rw.codes) and self.use_kernels:
            op = kernel_op(self.format)
            packed = op.prepare(rw) if op is not None else None
            if packed is not None:
                self._op, self._packed = op, packed
                self._rw = None  # the kernel layout replaces the unpacked copy on the GPU
                if hasattr(op, "unprepare"):
                    self._release()

    def _release(self) -> None:
        for name in _RELEASED:
            b = self._buffers.get(name)
            if b is not None:
                self._buffers[name] = b.new_empty(0)
        self._released = True

    def _restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """The buffers from ``tensors`` (compressed-tensors names), after a release."""
        for name in _RELEASED:
            if name in self._buffers:
                self._buffers[name] = tensors[name]
        self._released = False

    def _from_layout(self) -> RuntimeWeight:
        """The weight from the kernel layout that holds it (its own, or its fused group's rows)."""
        if self._fused is not None:
            group, i = self._fused
            op, packed, (a, b) = group.op, group.packed, group.bounds[i]
            if hasattr(packed, "rows"):  # (a kernels layout: this member's rows only, not a whole experts layer's)
                packed, (a, b) = packed.rows(a, b), (0, b - a)
        else:
            op, packed, (a, b) = self._op, self._packed, (0, self.out_features)
        codes, scales, zeros, gs = op.unprepare(packed)
        sw = None if self.super_weights is None else tuple(t.to(codes.device) for t in self.super_weights)
        return RuntimeWeight(self.format, (self.out_features, self.in_features), codes[a:b].contiguous(),
                             scales[a:b].contiguous(), None if zeros is None else zeros[a:b].contiguous(), gs, sw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # dynaquant::linear nodes of the compiled graph: no graph break
            return _traced_forward(self, x)
        return _dyna_forward(self, x)

    def op_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward as ``dynaquant::linear`` runs it: (..., N) contiguous in x's dtype."""
        return _dyna_forward(self, x).contiguous()


_RELEASED = ("weight_packed", "weight_scale", "weight_zero_point")  # the weight's bytes (the shape, global scale: kept)


def _state_dict_hook(module: nn.Module, hook) -> None:
    register = getattr(module, "register_state_dict_post_hook", None)
    (register or module._register_state_dict_hook)(hook)


def _released_state(module: DynaLinear, state_dict, prefix: str, local_metadata) -> None:
    """``state_dict`` of a layer whose buffers are released: the checkpoint's tensors, rebuilt from the layout."""
    if not module._released:
        return
    tensors = to_compressed_tensors(module.runtime_weight())
    for name in _RELEASED:
        if prefix + name in state_dict:
            state_dict[prefix + name] = tensors[name]


def _before_load(module: DynaLinear, state_dict, prefix, *args) -> None:
    """``load_state_dict`` into a released layer: empty buffers of the checkpoint's shapes to load into; the kernel
    layout is dropped (:meth:`DynaLinear.prepare` builds it again)."""
    if not module._released:
        return
    dev = module.weight_scale.device
    specs = _buffer_specs(module.format, module.out_features, module.in_features)
    module._restore({n: torch.empty(shape, dtype=dt, device=dev) for n, (shape, dt) in specs.items()})
    module._op = module._packed = module._fused = module._rw = None


def _traced_forward(self: DynaLinear, x: torch.Tensor) -> torch.Tensor:
    """The forward as ``torch.compile`` traces it (:mod:`.custom_ops`): a member of a fused group on the kernel path
    takes its columns of the group's one call, any other layer is one call of its own."""
    if self._fused is not None and not self._fused[0].separate and _kernel_input(x):
        group, index = self._fused
        return group.traced_output(index, x)
    return torch.ops.dynaquant.linear(x, self._handle, self.out_features)


def _dyna_forward(self: DynaLinear, x: torch.Tensor) -> torch.Tensor:
    if self._fused is not None and _kernel_input(x):
        group, index = self._fused
        return group.output(index, x)
    if self._op is not None and _kernel_input(x):
        return self._op.linear(x, self._packed, None if self.bias is None else self.bias.to(x.dtype))
    w = self.dequantize().to(device=x.device, dtype=x.dtype)
    return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


# Sibling projections that read the same input, in the order transformers calls them (Llama, Mistral,
# Qwen2/3 and most decoder families): fused into one kernel call each by :func:`fuse_projections`.
FUSED_PROJECTIONS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _FusedProjection:
    """One kernel call for several :class:`DynaLinear` siblings that take the same input tensor.

    The first member called with ``x`` runs the concatenated weight and keeps the other members' column
    slices (views, no copy); a member called with that same tensor object takes its slice. A member called
    with another tensor, or twice, recomputes, so the result never depends on the call order.
    """

    def __init__(self, names: tuple[str, ...], op, packed, bounds: list[tuple[int, int]], bias: torch.Tensor | None,
                 separate: bool = False):
        self.names, self.op, self.packed, self.bounds, self.bias = names, op, packed, bounds, bias
        self.intact = True  # every member still reads its rows here (False once one is prepared again)
        self.separate = separate  # members take different inputs (experts): each runs on its own rows (views)
        self._views: dict[int, object] = {}
        self._x: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}
        self._traced: tuple | None = None  # (x, output, members taken) while torch.compile traces the group
        self.handle = custom_ops.register(self)  # the group's one call in compiled graphs (dynaquant::linear)

    def __setstate__(self, state) -> None:  # (copy.deepcopy, pickle: the copy is a group of its own)
        self.__dict__.update(state)
        self.handle = custom_ops.register(self)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.separate:
            if index not in self._views:
                self._views[index] = self.packed.rows(*self.bounds[index])
            return self.op.linear(x, self._views[index], None)
        if self._x is not x or index not in self._pending:
            y = self.op.linear(x, self.packed, None if self.bias is None else self.bias.to(x.dtype))
            self._x, self._pending = x, {i: y[..., a:b] for i, (a, b) in enumerate(self.bounds)}
        out = self._pending.pop(index)
        if not self._pending:
            self._x = None
        return out

    def op_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The group's one kernel call, (..., N_group) contiguous (``dynaquant::linear``)."""
        return self.op.linear(x, self.packed, None if self.bias is None else self.bias.to(x.dtype)).contiguous()

    def traced_output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """:meth:`output` as ``torch.compile`` traces it: the first member traced with ``x`` adds the group's
        ``dynaquant::linear`` node, the others slice its output (a trace-time record, cleared once every member
        has taken its columns; the compiler need not share x's buffer between the calls)."""
        t = self._traced
        if t is None or t[0] is not x or index in t[2]:
            t = (x, torch.ops.dynaquant.linear(x, self.handle, self.bounds[-1][1]), ())
        taken = t[2] + (index,)
        self._traced = None if len(taken) == len(self.bounds) else (t[0], t[1], taken)
        a, b = self.bounds[index]
        return t[1][..., a:b]


def _concat(rws: list[RuntimeWeight]) -> RuntimeWeight | None:
    """The weights stacked along N (one format, one K, one global scale), or None where they cannot be."""
    f, k = rws[0].format, rws[0].shape[1]
    if any(r.format != f or r.shape[1] != k for r in rws):
        return None
    gs = rws[0].global_scale
    if gs is not None and any(r.global_scale is None or not torch.equal(r.global_scale, gs) for r in rws):
        return None
    offsets = [0]
    for r in rws:
        offsets.append(offsets[-1] + r.shape[0])
    sw = [(r.super_weights[0] + o, r.super_weights[1], r.super_weights[2])
          for r, o in zip(rws, offsets) if r.super_weights is not None]
    return RuntimeWeight(f, (offsets[-1], k), torch.cat([r.codes for r in rws]), torch.cat([r.scales for r in rws]),
                         None if rws[0].zeros is None else torch.cat([r.zeros for r in rws]), gs,
                         tuple(torch.cat(parts) for parts in zip(*sw)) if sw else None)


def fuse_projections(model: nn.Module, groups: tuple[tuple[str, ...], ...] = FUSED_PROJECTIONS) -> int:
    """Run sibling projections that read the same input (q/k/v, gate/up) as one kernel call each.

    For every module whose children named by a group are all :class:`DynaLinear` layers with a kernel, one
    format, one K (and, for NVFP4, one global scale), the kernel layout of their stacked weight replaces
    theirs (same memory); each member returns its slice of the one product. Fewer, larger calls are what a
    memory-bound decode step needs (Llama-3-8B: 129 calls a token instead of 225). The checkpoint buffers
    are untouched; :meth:`DynaLinear.prepare` on a member undoes its group's fusion for that member.

    Args:
        model: a model from :func:`load` (layers prepared).
        groups: child names read with one input, in call order.
    Returns:
        The number of groups fused.
    """
    fused = 0
    for _, parent in model.named_modules():
        for names in groups:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, DynaLinear) and m._op is not None and m._fused is None for m in members):
                continue
            ops = {type(m._op) for m in members}
            rw = _concat([m.runtime_weight() for m in members]) if len(ops) == 1 else None
            packed = members[0]._op.prepare(rw) if rw is not None else None
            if packed is None:
                continue
            bounds = _row_bounds(members)
            ref = next((m.bias for m in members if m.bias is not None), None)
            bias = None if ref is None else torch.cat([
                m.bias.detach() if m.bias is not None else ref.new_zeros(m.out_features) for m in members])
            _join(_FusedProjection(names, members[0]._op, packed, bounds, bias), members)
            fused += 1
    return fused


def fuse_experts(model: nn.Module) -> int:
    """Run each mixture-of-experts layer's routed experts as two grouped kernel launches (:mod:`dynaquant.kernels.grouped`)
    instead of a loop over experts: for every :class:`~dynaquant.runtime.moe.DynaExperts` (layout ``fused``) whose
    experts' projections are all :class:`DynaLinear` layers with the kernels' layout, one format, one K (and, for
    NVFP4, one global scale) per projection kind, the experts' layouts are stacked (gate and up of expert ``e`` at rows
    ``2 e I .. 2 e I + 2 I - 1``, down at ``e H ..``; :func:`dynaquant.kernels.stack`, no unpacking) and replace
    theirs: one copy of the weights. Each expert layer still answers alone (its rows of the group) and its
    ``state_dict`` is its checkpoint tensors, bit for bit.

    Args:
        model: a model from :func:`load` (layers prepared), before :func:`fuse_projections`.
    Returns:
        The number of experts modules grouped.
    """
    from dynaquant.runtime.moe import DynaExperts

    done = 0
    for _, mod in model.named_modules():
        if not isinstance(mod, DynaExperts) or mod.layout != "fused":
            continue
        experts = [mod.expert(e) for e in range(mod.num_experts)]
        gate_up = [getattr(x, p) for x in experts for p in ("gate_proj", "up_proj")]
        down = [x.down_proj for x in experts]
        groups = [_stacked_group(gate_up, ("gate_proj", "up_proj")), _stacked_group(down, ("down_proj",))]
        if None in groups:
            continue
        for group, members in zip(groups, (gate_up, down)):
            _join(group, members)
        mod.grouped = tuple(groups)
        done += 1
    return done


def _stacked_group(members: list, names: tuple[str, ...]) -> _FusedProjection | None:
    """The members' kernel layouts stacked along N as one group, or None where they are not all stackable."""
    if not all(isinstance(m, DynaLinear) and isinstance(m._op, _PackLinearOp) and m._fused is None
               and m.bias is None for m in members):
        return None
    op = members[0]._op
    try:
        packed = op.kernels.stack([m._packed for m in members])
    except (AttributeError, ValueError):  # (a kernels package without stack; formats or scales that differ)
        return None
    return _FusedProjection(names, op, packed, _row_bounds(members), None, separate=True)


def _row_bounds(members: list) -> list[tuple[int, int]]:
    """Each member's rows ``(start, stop)`` in the members' weights stacked along N, in order."""
    bounds, start = [], 0
    for m in members:
        bounds.append((start, start + m.out_features))
        start += m.out_features
    return bounds


def _join(group: _FusedProjection, members: list) -> None:
    """The members give up their own kernel layouts and read their rows of the group's."""
    for i, m in enumerate(members):
        m._op = m._packed = None
        m._fused = (group, i)
