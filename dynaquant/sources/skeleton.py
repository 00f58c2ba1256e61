"""A model's skeleton on the meta device, materialized one part at a time from its tensor source.

Models larger than memory run block by block (:mod:`dynaquant.analysis.blockwise`): the transformers model is
built from its config on the meta device, as transformers' own ``from_pretrained`` builds it (transformers 5: under
``torch.device("meta")``, no parameter ever allocated, even a DeepSeek-V3 layer's 30 GB of stacked experts; the
buffers such as RoPE frequencies then recomputed by the model's ``initialize_weights``; older transformers and
models whose buffers that does not recompute: accelerate's ``init_empty_weights``, buffers computed as usual), so
every architecture keeps transformers' own module classes and
forward code. A *part* is then given real weights, read tensor by tensor from the
:class:`~dynaquant.sources.gguf.TensorSource` (memory-mapped safetensors or GGUF, release formats decoded per
tensor) through :class:`~dynaquant.sources.params.ParamWriter`, and released back to the meta device when done.

Parts: ``"outer"`` (everything outside the text decoder blocks: token embedding, final norm, output head, a vision
tower) and each decoder block ``0 .. n_blocks - 1``. The memory a part holds is its parameters' bytes in the
skeleton's dtype (:meth:`ModelSkeleton.part_bytes`), computed from the shapes. With ``pack_experts`` (set by
:meth:`ModelSkeleton.fit` when a MoE block does not fit the GPU limit otherwise) a block's routed experts are kept as
the checkpoint stores them (BF16, or FP8 with its block scales: DeepSeek-V3's 11 B expert weights a layer take 11 GB
instead of 45 GB in float32), read a group of experts at a time, and decoded one expert at a time when they run
(:mod:`dynaquant.sources.experts`): the same values, bit for bit.
"""

from __future__ import annotations

import logging

import torch

from dynaquant.names import TensorName
from dynaquant.sources import experts as xp
from dynaquant.sources.gguf import SourceTensor, TensorSource
from dynaquant.sources.nonfinite import check_finite, tensor_label
from dynaquant.sources.params import ParamWriter

log = logging.getLogger(__name__)

OUTER = "outer"
GROUP_BYTES = 1 << 30  # packed experts are read (and checked in float32 on the device) this many float32 bytes at a time


def _block_of_param(name: str) -> int | None:
    tn = TensorName.from_hf(name)
    return tn.block if tn.tower == "text" else None


class ModelSkeleton:
    """A transformers model with meta-device parameters whose parts are materialized on demand.

    Args:
        model: a transformers model built under ``accelerate.init_empty_weights(include_buffers=False)``
            (see :func:`build_skeleton`).
        ts: the tensor source holding its weights.
        dtype: dtype of materialized parameters (float32 for the analysis).
        device: where materialized parts live.
        allow_nonfinite: NaN / Inf weights replaced as :mod:`dynaquant.sources.nonfinite` says, instead of refused
            (``InputError`` naming the tensor and its file) when their part is materialized.
        checked: False: weights as stored, NaN and Inf included, unchecked (as transformers' loader gives them, for a
            caller that checks the whole model after, :func:`dynaquant.sources.nonfinite.check_model_finite`).
    Attributes:
        pack_experts: a block's routed experts (``fused`` layout) are kept as stored and decoded per expert (set by
            :meth:`fit`; off by default).
    Raises:
        ValueError: the model has no decoder blocks the source's tensors map to.
    """

    def __init__(self, model, ts: TensorSource, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", allow_nonfinite: bool = False, checked: bool = True):
        self.model, self.ts, self.dtype, self.device = model, ts, dtype, torch.device(device)
        self.allow_nonfinite, self.checked = allow_nonfinite, checked
        self._tensors: dict[object, list[SourceTensor]] = {}
        for t in ts.tensors():
            if t.hf_name is None:  # llama.cpp-only tensors (rope_freqs): nothing in the model
                continue
            self._tensors.setdefault(self.part_of(t.gguf_name), []).append(t)
        # a tower the source does not hold (a VL model's vision tower behind a language-model-only source) stays on the
        # meta device: text-only forward passes never reach it
        towers = {TensorName.from_gguf(t.gguf_name).tower for t in ts.tensors()}
        self._params: dict[object, list[str]] = {}
        for name, _ in model.named_parameters(remove_duplicate=False):
            if TensorName.from_hf(name).tower not in towers:
                continue
            b = _block_of_param(name)
            self._params.setdefault(OUTER if b is None else b, []).append(name)
        self.n_blocks = sum(1 for k in self._params if k != OUTER)
        if self.n_blocks == 0:
            raise ValueError(f"{ts.source_id}: the model has no decoder blocks")
        self.layers = self._find_layers()
        self._live: set = set()
        self.pack_experts = False  # see fit()
        self._fused: dict | None = None  # block -> its fused experts modules by name (_fused_modules)

    def _find_layers(self) -> torch.nn.ModuleList:
        name = next(n for n in self._params[0])
        prefix = TensorName.from_hf(name).prefix  # e.g. "model.layers.0"
        layers = self.model.get_submodule(prefix.rsplit(".", 1)[0])
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) != self.n_blocks:
            raise ValueError(f"{self.ts.source_id}: decoder blocks not found under {prefix.rsplit('.', 1)[0]}")
        return layers

    def part_bytes(self, part, packed: bool | None = None) -> int:
        """Bytes the part's parameters take when materialized (in the skeleton's dtype; shared ones counted once);
        ``packed`` (default: :attr:`pack_experts`): routed experts of the ``fused`` layout counted as stored
        (``TensorSource.stored_bytes``)."""
        packed = self.pack_experts if packed is None else packed
        params = dict(self.model.named_parameters())
        item = torch.empty((), dtype=self.dtype).element_size()
        skip = self._packed_params(part) if packed else set()
        n = sum(params[p].numel() * item for p in dict.fromkeys(self._params.get(part, [])) if p in params and p not in skip)
        return n + sum(self.ts.stored_bytes(t) for t in self._tensors.get(part, []) if packed and self._packs(t, part))

    def check_bytes(self, part) -> int:
        """Bytes a packed read of the part's experts decodes at once on the device (:meth:`_read_packed`: a group of
        experts in float32, checked for NaN / Inf), the largest over its stacked tensors; 0 without packed experts."""
        return max((min(self._read_group(t), t.shape[0]) * 4 * (t.numel // t.shape[0])
                    for t in self._tensors.get(part, []) if self._packs(t, part)), default=0)

    def _read_group(self, t: SourceTensor) -> int:
        """Experts a packed read of the stacked tensor ``t`` takes at a time (:data:`GROUP_BYTES` in float32; all of
        them from a source that reads the stack whole)."""
        if not self.ts.reads_experts(t):
            return t.shape[0]
        return max(1, GROUP_BYTES // max(1, t.numel // t.shape[0] * 4))

    def _fused_modules(self, part) -> dict[str, torch.nn.Module]:
        """The part's experts modules of the ``fused`` layout, by name (found once for the model)."""
        if self._fused is None:
            self._fused = {}
            for n, m in xp.find_experts(self.model).items():
                if xp.layout_of(m) == "fused" and (b := _block_of_param(n + ".x")) is not None:
                    self._fused.setdefault(b, {})[n] = m
        return self._fused.get(part, {}) if part != OUTER else {}

    def _packed_params(self, part) -> set[str]:
        return {f"{n}.{p}" for n in self._fused_modules(part) for p in ("gate_up_proj", "down_proj")}

    def _packs(self, t: SourceTensor, part) -> bool:
        st = xp.stacked_name(t.hf_name)
        return st is not None and st[0] in self._fused_modules(part)

    def fit(self, max_gpu_memory: int) -> None:
        """Choose how the parts live within ``max_gpu_memory`` bytes: unpacked where the outer part and the largest
        block fit it in the skeleton's dtype, else with the experts packed (:attr:`pack_experts`; the block as stored
        plus a group of experts decoded to check it, :meth:`check_bytes`).

        Raises:
            InputError: neither fits (names the block and both sizes).
        """
        from dynaquant.errors import InputError

        outer = self.part_bytes(OUTER, packed=False)
        block = max(range(self.n_blocks), key=lambda b: self.part_bytes(b, packed=False))
        self.pack_experts = False
        if outer + self.part_bytes(block, packed=False) <= max_gpu_memory:
            return
        packed = max(self.part_bytes(b, packed=True) + self.check_bytes(b) for b in range(self.n_blocks))
        if outer + packed <= max_gpu_memory and not self.allow_nonfinite:
            log.info("MoE experts kept as stored (%.2f GiB a block instead of %.2f GiB) to fit %.2f GiB of GPU memory",
                     packed / 2**30, self.part_bytes(block, packed=False) / 2**30, max_gpu_memory / 2**30)
            self.pack_experts = True
            return
        raise InputError(f"{self.ts.source_id}: block {block} ({self.part_bytes(block, packed=False) / 2**30:.2f} GiB "
                         f"of weights, {packed / 2**30:.2f} GiB with its experts as stored) and the embedding and head "
                         f"({outer / 2**30:.2f} GiB) do not fit --max-gpu-memory {max_gpu_memory / 2**30:.2f} GiB")

    def materialize(self, part) -> None:
        """Give ``part``'s parameters real values from the source, on the skeleton's device.

        Raises:
            ValueError: a parameter of the part that no source tensor fills (named), or a shape mismatch.
        """
        if part in self._live:
            return
        names = self._params.get(part, [])
        packed = self._packed_params(part) if self.pack_experts else set()
        names = [n for n in names if n not in packed]
        with torch.no_grad():
            # NaN marks what no source tensor fills; a tied parameter (lm_head = embed_tokens) stays one object
            self._replace(names, lambda p: torch.full(p.shape, float("nan"), dtype=self.dtype, device=self.device))
            for mod in self._modules_of(part):
                for bname, buf in list(mod._buffers.items()):
                    if buf is not None and buf.device != self.device:
                        mod._buffers[bname] = buf.to(self.device)
            writer = ParamWriter.of(self.model, self.ts)
            stored: dict[str, dict[str, xp.Stored]] = {}
            for t in self._tensors.get(part, []):
                if packed and self._packs(t, part):
                    name, proj = xp.stacked_name(t.hf_name)
                    stored.setdefault(name, {})[proj] = self._read_packed(t)
                    continue
                where = self.ts.file_of(t)
                x = self.ts.read_to(t, self.device)
                if self.checked:
                    x = check_finite(x, tensor_label(t.hf_name, t.gguf_name), where, self.allow_nonfinite)
                writer.put(t, x, origin=where)
            writer.flush()
            params = dict(self.model.named_parameters(remove_duplicate=False))
            # (a NaN makes the sum NaN: one pass; the exact check only then, Inf - Inf too; unchecked weights may hold
            # NaN: only a parameter left all NaN is unfilled)
            unfilled = torch.Tensor.any if self.checked else torch.Tensor.all
            for name in names:
                if torch.isnan(params[name].sum()) and unfilled(torch.isnan(params[name])):
                    raise ValueError(f"{self.ts.source_id}: parameter {name} of the model is not filled by any tensor "
                                     "of the source (or the source holds NaN in it)")
            for name, mod in self._fused_modules(part).items() if packed else ():
                if set(stored.get(name, {})) != set(xp.PROJS):
                    raise ValueError(f"{self.ts.source_id}: experts {name}: the source holds "
                                     f"{sorted(stored.get(name, {}))}, not gate, up and down")
                xp.pack(mod, stored[name])
                if "forward" not in mod.__dict__:  # (a collector's own forward reads packed experts itself)
                    mod.forward = xp.PackedForward(mod)
        self._live.add(part)

    def _read_packed(self, t: SourceTensor) -> xp.Stored:
        """A stacked expert tensor as stored, on the device, read and checked a group of experts at a time."""
        group = self._read_group(t)
        out = None
        for lo in range(0, t.shape[0], group):
            g = self.ts.read_stored(t, lo, min(lo + group, t.shape[0])).to(self.device)  # (checked where it runs)
            check_finite(g.decode(slice(None)), tensor_label(t.hf_name, t.gguf_name), self.ts.file_of(t))
            if out is None:
                scale = None if g.scale is None else \
                    torch.empty((t.shape[0], *g.scale.shape[1:]), dtype=g.scale.dtype, device=self.device)
                out = xp.Stored(torch.empty(t.shape, dtype=g.values.dtype, device=self.device), scale, g.block)
            out.values[lo : lo + g.values.shape[0]].copy_(g.values)
            if g.scale is not None:
                out.scale[lo : lo + g.values.shape[0]].copy_(g.scale)
        return out

    def release(self, part) -> None:
        """Put ``part``'s parameters back on the meta device (their memory is freed)."""
        if part not in self._live:
            return
        for mod in self._fused_modules(part).values():
            if xp.packed(mod) is not None:
                xp.unpack(mod)
                if isinstance(mod.__dict__.get("forward"), xp.PackedForward):
                    del mod.forward
        self._replace(self._params.get(part, []), lambda p: p if p.is_meta else torch.empty_like(p, device="meta"))
        self._live.discard(part)

    def _replace(self, names: list[str], make) -> None:
        """Replace each named parameter by ``Parameter(make(old))``, once per distinct old parameter (ties kept)."""
        done: dict[int, torch.nn.Parameter] = {}
        for name in names:
            mod_name, _, pname = name.rpartition(".")
            mod = self.model.get_submodule(mod_name) if mod_name else self.model
            p = mod._parameters[pname]
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(make(p), requires_grad=False)
            mod._parameters[pname] = done[id(p)]

    def parameters_of(self, part) -> dict[str, torch.nn.Parameter]:
        """The part's parameters by name (meta tensors unless materialized; a tied one once)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        out, seen = {}, set()
        for n in self._params.get(part, []):
            if id(params[n]) not in seen:
                seen.add(id(params[n]))
                out[n] = params[n]
        return out

    def part_of(self, gguf_name: str):
        """The part a source tensor belongs to: its block index, or :data:`OUTER`."""
        tn = TensorName.from_gguf(gguf_name)
        return tn.block if tn.tower == "text" and tn.block is not None else OUTER

    def part_of_weight(self, name: str):
        """The part a model weight belongs to, by its HF name (a parameter, a buffer, or a stacked expert name of
        :func:`dynaquant.runtime.moe.checkpoint_weights` such as ``model.layers.3.mlp.experts.gate_proj.weight``): its
        decoder block index, or :data:`OUTER` (embedding, final norm, head, a vision tower)."""
        b = _block_of_param(name)
        return OUTER if b is None else b

    def _modules_of(self, part) -> list[torch.nn.Module]:
        if part == OUTER:
            return [m for n, m in self.model.named_modules() if _block_of_param(n + ".x") is None]
        return list(self.layers[part].modules())

    @property
    def live(self) -> set:
        """The parts materialized now."""
        return set(self._live)


def _unset(dtype: torch.dtype):
    """The value marking a buffer ``initialize_weights`` has not set: NaN, the smallest integer, or False."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _left_unset(buf: torch.Tensor) -> bool:
    """``buf`` still holds :func:`_unset`'s mark somewhere (NaN, complex ones included, is found by ``isnan``)."""
    if buf.is_floating_point() or buf.is_complex():
        return bool(torch.isnan(buf).any())
    return bool((buf == _unset(buf.dtype)).any())


def _on_meta(build):
    """The model built under ``torch.device("meta")`` (no parameter allocated, not even transiently) with its buffers
    recomputed on the CPU by ``initialize_weights`` (transformers >= 5, as its ``from_pretrained`` does); None where
    that is unavailable or leaves a buffer unset (filled with :func:`_unset` beforehand: CLIP's integer
    ``position_ids`` are not recomputed), so the caller builds it the older way."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    model = build(torch.device("meta"))
    if not hasattr(model, "initialize_weights"):
        return None
    buffers = list(model.named_buffers())
    for name, buf in buffers:
        mod_name, _, bname = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        mod._buffers[bname] = torch.full(buf.shape, _unset(buf.dtype), dtype=buf.dtype)
    model.initialize_weights()
    if any(_left_unset(b) for _, b in model.named_buffers()):
        log.debug("meta build: initialize_weights left a buffer unset; building with init_empty_weights")
        return None
    return model


def build_skeleton(source, ts: TensorSource, *, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", allow_nonfinite: bool = False, checked: bool = True) -> ModelSkeleton:
    """The source's transformers model with every parameter on the meta device (no weight read).

    Args:
        source: a ``checkpoint.ModelSource`` (HF folder or GGUF file; its config gives the architecture).
        ts: its tensor source.
        dtype, device, allow_nonfinite, checked: of the parts materialized later (:class:`ModelSkeleton`).
    Raises:
        RemoteCodeError: the checkpoint needs its own code and ``source.trust_remote_code`` is off.
        ValueError: see :class:`ModelSkeleton`.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from dynaquant.sources.checkpoint import from_config, load_config
    from dynaquant.sources.vl_archs import vl_full_arch

    config = load_config(source)
    if hasattr(config, "_experts_implementation"):
        # transformers' own loop over experts (newer releases default to a grouped GEMM where one is available): the
        # operations a packed block's forward repeats expert by expert (sources.experts.PackedForward), so a block
        # gives the same numbers packed or not, on any transformers release
        config._experts_implementation = "eager"
    auto = AutoModelForCausalLM
    if source.kind == "hf" and vl_full_arch(source.path):  # as load_model: the vision tower is part of the outer part
        from transformers import AutoModelForImageTextToText as auto
    def build(ctx):
        with ctx:
            return from_config(auto, config, trust_remote_code=source.trust_remote_code, folder=source.folder,
                               dtype=dtype)

    model = _on_meta(build) or build(init_empty_weights(include_buffers=False))
    model.tie_weights()  # as from_pretrained does (init_empty_weights builds the head untied)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return ModelSkeleton(model, ts, dtype=dtype, device=device, allow_nonfinite=allow_nonfinite, checked=checked)
