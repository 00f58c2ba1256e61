"""Runtime weights: the unpacked form of the safetensors target's formats, and its torch reference.

A weight ``W`` (N, K) (torch ``nn.Linear`` orientation: N outputs, K inputs) in a runtime format
(``formats.RUNTIME_FORMATS``; group size ``g`` = the format's ``block_size``) is a
:class:`RuntimeWeight`. This is the contract between the encoders here, the safetensors
exporter / loader and the kernels of :mod:`dynaquant.kernels` (which keep their own packed
layouts and build them from these tensors)::

    codes         (N, K)    int8   symmetric INT{b}: signed levels -2**(b-1) .. 2**(b-1)-1
                            uint8  INT{b}_ASYM: unsigned codes 0 .. 2**b - 1
                            uint8  MXFP4_G32 / NVFP4_G16: E2M1 codes 0..15 (bit 3 sign, bits 0-2
                                   index into 0, 0.5, 1, 1.5, 2, 3, 4, 6)
    scales        (N, K/g)  float16 (or bfloat16)  INT formats (may be negative when symmetric)
                            uint8  MXFP4_G32: E8M0 biased exponents, scale = 2**(e - 127)
                            float8_e4m3fn  NVFP4_G16
    zeros         (N, K/g)  uint8 for INT{b}_ASYM, else None
    global_scale  ()        float32 for NVFP4_G16, else None

    W[n, k] = scale[n, k // g] * codes[n, k]                          symmetric INT
            = scale[n, k // g] * (codes[n, k] - zeros[n, k // g])     INT_ASYM
            = e2m1(codes[n, k]) * 2**(scales[n, k // g] - 127)        MXFP4_G32
            = e2m1(codes[n, k]) * (float(scales[n, k // g]) / global_scale)   NVFP4_G16

computed in float32 (:func:`decode`; bit for bit what compressed-tensors computes in float32),
then the super weights (``super_weights``: (n,) rows, (n,) columns, (n,) float32 values) are
written over it. :meth:`RuntimeWeight.unpacked` gives ``(codes, scales, zeros, global_scale)``.

The file layout (:func:`to_compressed_tensors` / :func:`from_compressed_tensors`) is
compressed-tensors 0.20's, per module: ``weight_packed`` (INT: int32 (N, ceil(K b / 32)), 32
codes densely in b words, unsigned ``level + 2**(b-1)`` for symmetric formats; FP4: uint8 (N, K/2),
two codes a byte, low nibble first), ``weight_scale``, ``weight_zero_point`` (INT_ASYM: int32
(ceil(N b / 32), K/g), packed along N), ``weight_global_scale`` (NVFP4: float32 (1,)) and
``weight_shape`` (INT: int64 [N, K]). :func:`compressed_tensors_scheme` gives the
``config_groups`` entry of each format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaquant.quant.codecs import get_codec
from dynaquant.quant.codecs.base import CHUNK_WEIGHTS, block_importance
from dynaquant.quant.codecs.runtime_fp4 import e2m1_values, nvfp4_global_scale, pack_pairs, unpack_pairs
from dynaquant.quant.formats import Format, get_format


def runtime_format(fmt: str | Format) -> Format:
    """The format row of a runtime format.

    Raises:
        KeyError: unknown name; ValueError: not a runtime (safetensors target) format.
    """
    f = fmt if isinstance(fmt, Format) else get_format(fmt)
    if f.target != "safetensors":
        raise ValueError(f"{f.name} is not a runtime (safetensors) format")
    return f


@dataclass
class RuntimeWeight:
    """A weight in a runtime format, unpacked (module docstring for dtypes and the decoding rule).

    Attributes:
        format: the format name (``INT4_G128``, ``MXFP4_G32``, ...).
        shape: (N, K).
        codes: (N, K) int8 (symmetric INT) or uint8.
        scales: (N, K / g) float16 / bfloat16, uint8 (E8M0) or float8_e4m3fn.
        zeros: (N, K / g) uint8 (asymmetric INT) or None.
        global_scale: () float32 (NVFP4) or None.
        super_weights: ``(rows, cols, values)``: (n,) int64, (n,) int64, (n,) float32 weights restored
            exactly after decoding, or None.
    """

    format: str
    shape: tuple[int, int]
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    super_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(codes, scales, zeros, global_scale)``, what the kernels consume."""
        return self.codes, self.scales, self.zeros, self.global_scale

    def to(self, device) -> RuntimeWeight:
        """A copy with every tensor on ``device``."""
        def mv(t):
            return None if t is None else t.to(device)
        sw = None if self.super_weights is None else tuple(t.to(device) for t in self.super_weights)
        return RuntimeWeight(self.format, self.shape, self.codes.to(device), self.scales.to(device), mv(self.zeros),
                             mv(self.global_scale), sw)

    def to_state(self) -> dict:
        """The weight as a plain dict of strings, ints and tensors (``torch.load(weights_only=True)`` reads it back;
        :meth:`from_state` inverts it, tensor for tensor)."""
        state = {"format": self.format, "shape": [int(s) for s in self.shape], "codes": self.codes, "scales": self.scales}
        for k in ("zeros", "global_scale"):
            if getattr(self, k) is not None:
                state[k] = getattr(self, k)
        if self.super_weights is not None:
            state["super_weights"] = list(self.super_weights)
        return state

    @classmethod
    def from_state(cls, state: dict) -> RuntimeWeight:
        """The weight :meth:`to_state` gave."""
        sw = state.get("super_weights")
        return cls(state["format"], tuple(state["shape"]), state["codes"], state["scales"], state.get("zeros"),
                   state.get("global_scale"), None if sw is None else tuple(sw))

    @property
    def nbytes(self) -> int:
        """Bytes of the packed file tensors (codes at their bit width, scales, zero points, global scale)."""
        f = get_format(self.format)
        n, k = self.shape
        return n * f.row_bytes(k) + (4 if self.global_scale is not None else 0)


def _check_super(super_weights, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if super_weights is None:
        return None
    rows, cols, vals = (torch.as_tensor(t) for t in super_weights)
    rows, cols, vals = rows.reshape(-1).long(), cols.reshape(-1).long(), vals.reshape(-1).to(torch.float32)
    if not (rows.numel() == cols.numel() == vals.numel()):
        raise ValueError("super weights: rows, cols and values differ in length")
    n, k = shape
    if rows.numel() and (rows.min() < 0 or rows.max() >= n or cols.min() < 0 or cols.max() >= k):
        raise ValueError(f"super weights: an index lies outside the weight's shape {list(shape)}")
    return rows, cols, vals


def encode(weight: torch.Tensor, fmt: str | Format, imatrix: torch.Tensor | None = None, *,
           super_weights=None) -> RuntimeWeight:
    """Quantize a weight to a runtime format (reference encoder, vectorised, on the weight's device).

    Args:
        weight: (N, K) float tensor, K a multiple of the group size.
        fmt: a runtime format name or row.
        imatrix: optional (K,) per-column importance (E[x^2] of the inputs); the encoders minimise
            ``sum_jk imatrix[k] * (W - decode)[j, k]**2`` per group.
        super_weights: optional ``(rows, cols)`` (values taken from ``weight``) or ``(rows, cols, values)``
            kept exactly.
    Returns:
        The RuntimeWeight; :func:`decode` of it equals ``codecs.dequantize(codecs.quantize(...))`` for
        every format but NVFP4 (whose global scale comes from the whole tensor here, from each chunk of
        rows there), with the super weights written over.
    Raises:
        ValueError: not 2-D, K not a multiple of the group size, a bad imatrix or super weight index.
    """
    f = runtime_format(fmt)
    if weight.ndim != 2:
        raise ValueError(f"{f.name}: runtime formats take 2-D weights, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if not f.fits(k):
        raise ValueError(f"{f.name}: rows of {k} are not a multiple of the group size {f.block_size}")
    if super_weights is not None and len(super_weights) == 2:
        r, c = (torch.as_tensor(t).reshape(-1).long() for t in super_weights)
        super_weights = (r, c, weight.detach()[r.to(weight.device), c.to(weight.device)].float().cpu())
    sw = _check_super(super_weights, (n, k))
    x = weight.detach().to(torch.float32)
    if f.name == "NVFP4_G16":  # one global scale for the whole tensor, rows encoded in chunks
        codec = get_codec(f.name)
        g = nvfp4_global_scale(x.abs().max())
        records = torch.empty(n, f.record_bytes(k), dtype=torch.uint8, device=x.device)
        step = max(1, CHUNK_WEIGHTS // k)
        for r0 in range(0, n, step):
            xb = x[r0 : r0 + step].reshape(-1, f.block_size)
            wb = block_importance(imatrix, xb.shape[0] * f.block_size // k, k, x.device).reshape(-1, f.block_size)
            params = codec.fit_params(xb, wb, global_scale=g)
            codes, _ = codec.round_to_grid(xb, params)
            records[r0 : r0 + step] = codec.pack(params, codes).reshape(-1, records.shape[1])
    else:
        from dynaquant.quant.codecs import quantize

        records = quantize(x, f, imatrix)
    rw = from_records(records, f, (n, k))
    rw.super_weights = None if sw is None else tuple(t.to(x.device) for t in sw)
    return rw


def from_records(records: torch.Tensor, fmt: str | Format, shape: tuple[int, int]) -> RuntimeWeight:
    """A RuntimeWeight from the reference codec's records (``codecs.quantize`` output, or GPTQ's).

    Args:
        records: (N, K / g * type_size) uint8.
        fmt: the runtime format; shape: (N, K).
    Raises:
        ValueError: the records do not fit the shape, or (NVFP4) their global scales differ.
    """
    f = runtime_format(fmt)
    n, k = shape
    if tuple(records.shape) != (n, f.record_bytes(k)) or records.dtype != torch.uint8:
        raise ValueError(f"{f.name}: records of shape {tuple(records.shape)} ({records.dtype}) do not fit a "
                         f"({n}, {k}) weight")
    b = records.reshape(-1, f.type_size)
    groups = k // f.block_size
    if f.kind == "int":
        scales = b[:, :2].contiguous().view(torch.float16).reshape(n, groups)
        if f.zero_bits:
            zeros = b[:, 2].reshape(n, groups).contiguous()
            codes = b[:, 3:].reshape(n, k).contiguous()
            return RuntimeWeight(f.name, (n, k), codes, scales, zeros)
        codes = (b[:, 2:].to(torch.int16) - (1 << (f.bits - 1))).to(torch.int8).reshape(n, k)
        return RuntimeWeight(f.name, (n, k), codes, scales)
    if f.name == "MXFP4_G32":
        return RuntimeWeight(f.name, (n, k), unpack_pairs(b[:, 1:]).reshape(n, k), b[:, 0].reshape(n, groups).contiguous())
    s = b[:, 0].contiguous().view(torch.float8_e4m3fn).reshape(n, groups)
    g = b[:, 1:5].contiguous().view(torch.float32).reshape(-1)
    if g.numel() and not bool((g == g[0]).all()):
        raise ValueError("NVFP4_G16: the records hold different global scales; encode the whole tensor at once")
    return RuntimeWeight(f.name, (n, k), unpack_pairs(b[:, 5:]).reshape(n, k), s, None, g[0].clone())


def e8m0_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponents (uint8, any shape) -> float32 ``2**(e - 127)`` exactly (255 -> NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 0x00400000))
    return torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits).view(torch.float32)


def decode(rw: RuntimeWeight) -> torch.Tensor:
    """Decode a RuntimeWeight: (N, K) float32 on its device (module docstring), super weights restored."""
    f = runtime_format(rw.format)
    n, k = rw.shape
    g = f.block_size

    def per_group(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n, k // g, 1)

    if f.kind == "int":
        q = rw.codes.to(torch.int32)
        if rw.zeros is not None:
            q = q.reshape(n, k // g, g) - per_group(rw.zeros.to(torch.int32))
        w = q.reshape(n, k // g, g).to(torch.float32) * per_group(rw.scales.to(torch.float32))
    elif f.name == "MXFP4_G32":
        w = e2m1_values(rw.codes).reshape(n, k // g, g) * per_group(e8m0_scale(rw.scales))
    else:
        scale = rw.scales.to(torch.float32) / rw.global_scale.to(torch.float32)
        w = e2m1_values(rw.codes).reshape(n, k // g, g) * per_group(scale)
    w = w.reshape(n, k)
    if rw.super_weights is not None and rw.super_weights[0].numel():
        rows, cols, vals = (t.to(w.device) for t in rw.super_weights)
        w[rows, cols] = vals
    return w


# ----------------------------------------------------------------------------------------------
# compressed-tensors layout


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Dense packing of unsigned ``bits``-bit values along the last axis, compressed-tensors 0.20's
    ``pack_to_int32``: element i of a row at bit ``i * bits`` of the row's little-endian bit stream.

    Args:
        values: (R, C) integer tensor with values in ``0 .. 2**bits - 1``.
    Returns:
        (R, ceil(C * bits / 32)) int32.
    """
    r, c = values.shape
    v = values.to(torch.int64)
    pad = -c % 32
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(r, -1, 32)
    pos = torch.arange(32, device=v.device) * bits
    word, off = pos // 32, pos % 32
    out = torch.zeros(r, v.shape[1], bits + 1, dtype=torch.int64, device=v.device)
    out.scatter_add_(2, word.expand_as(v), v << off)  # bits that overflow the word stay above bit 31
    spill = out[..., :bits] >> 32
    words = (out[..., :bits] & 0xFFFFFFFF) + torch.nn.functional.pad(spill, (1, 0))[..., :bits]
    words = words.reshape(r, -1)[:, : -(-c * bits // 32)]
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: (R, W) int32 -> (R, cols) int64 values in ``0 .. 2**bits - 1``."""
    r, nw = packed.shape
    w = packed.to(torch.int64) & 0xFFFFFFFF
    pad = -nw % bits
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    w = w.reshape(r, -1, bits)
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=2)
    pos = torch.arange(32, device=w.device) * bits
    word, off = pos // 32, pos % 32
    lo = w.gather(2, word.expand(r, w.shape[1], 32)) >> off
    hi = w.gather(2, (word + 1).expand(r, w.shape[1], 32)) << (32 - off)
    vals = (lo | torch.where(off + bits > 32, hi, torch.zeros_like(hi))) & ((1 << bits) - 1)
    return vals.reshape(r, -1)[:, :cols]


def compressed_tensors_scheme(fmt: str | Format) -> dict:
    """The compressed-tensors ``config_groups`` entry of a runtime format (without ``targets``)."""
    f = runtime_format(fmt)
    if f.kind == "int":
        weights = {"num_bits": f.bits, "type": "int", "symmetric": not f.zero_bits, "group_size": f.block_size,
                   "strategy": "group", "dynamic": False}
        ct_format = "pack-quantized"
    elif f.name == "MXFP4_G32":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
                   "dynamic": False, "scale_dtype": "torch.uint8"}
        ct_format = "mxfp4-pack-quantized"
    else:
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
                   "dynamic": False}
        ct_format = "nvfp4-pack-quantized"
    return {"format": ct_format, "input_activations": None, "output_activations": None, "weights": weights}


def format_of_scheme(scheme: dict) -> str:
    """The runtime format of a compressed-tensors ``config_groups`` entry.

    Raises:
        ValueError: quantized activations, or weights in a scheme no runtime format matches (named).
    """
    w = scheme.get("weights") or {}
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise ValueError(f"activation quantization is not supported: {scheme}")
    bits, typ, gs, strategy = w.get("num_bits"), w.get("type", "int"), w.get("group_size"), w.get("strategy") or "group"
    if typ == "int" and strategy == "group" and bits in (2, 3, 4, 8) and gs in (32, 64, 128):
        return f"INT{bits}_G{gs}" + ("" if w.get("symmetric", True) else "_ASYM")
    if typ == "float" and bits == 4 and gs == 32 and strategy == "group":
        return "MXFP4_G32"
    if typ == "float" and bits == 4 and gs == 16 and strategy == "tensor_group":
        return "NVFP4_G16"
    raise ValueError(f"no runtime format for compressed-tensors weights {w}")


def to_compressed_tensors(rw: RuntimeWeight) -> dict[str, torch.Tensor]:
    """The module's tensors in compressed-tensors' layout (module docstring), keyed ``weight_packed``,
    ``weight_scale``, ... (no module prefix), contiguous, on the weight's device. Super weights are
    not included (they go in the config's ``dynaquant`` extension)."""
    f = runtime_format(rw.format)
    n, k = rw.shape
    if f.kind == "int":
        off = 0 if f.zero_bits else 1 << (f.bits - 1)
        out = {"weight_packed": pack_int32(rw.codes.to(torch.int64) + off, f.bits),
               "weight_scale": rw.scales.contiguous(),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if rw.zeros is not None:
            out["weight_zero_point"] = pack_int32(rw.zeros.to(torch.int64).T, f.bits).T.contiguous()
        return out
    out = {"weight_packed": pack_pairs(rw.codes.reshape(n, k)), "weight_scale": rw.scales.contiguous()}
    if rw.global_scale is not None:
        out["weight_global_scale"] = rw.global_scale.reshape(1).to(torch.float32)
    return out


def from_compressed_tensors(fmt: str | Format, tensors: dict[str, torch.Tensor], shape: tuple[int, int] | None = None,
                            super_weights=None) -> RuntimeWeight:
    """A RuntimeWeight from one module's compressed-tensors tensors (inverse of :func:`to_compressed_tensors`).

    Args:
        fmt: the runtime format (``format_of_scheme`` of the module's config group).
        tensors: ``weight_packed``, ``weight_scale`` and, by format, ``weight_zero_point``,
            ``weight_global_scale``, ``weight_shape`` (no module prefix).
        shape: (N, K) when ``weight_shape`` is absent (FP4 formats: default from the packed shape).
        super_weights: optional ``(rows, cols, values)``.
    Raises:
        ValueError: a missing tensor or shapes that do not fit the format (named).
    """
    f = runtime_format(fmt)
    try:
        packed, scales = tensors["weight_packed"], tensors["weight_scale"]
    except KeyError as exc:
        raise ValueError(f"{f.name}: missing tensor {exc}") from exc
    if "weight_shape" in tensors:
        shape = tuple(int(v) for v in tensors["weight_shape"].reshape(-1).tolist())
    elif shape is None:
        shape = (packed.shape[0], packed.shape[1] * 2)
    n, k = shape
    groups = k // f.block_size
    if not f.fits(k) or tuple(scales.shape) != (n, groups):
        raise ValueError(f"{f.name}: weight_scale of shape {tuple(scales.shape)} does not fit a ({n}, {k}) weight")
    if f.kind == "int":
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k * f.bits // 32)):
            raise ValueError(f"{f.name}: weight_packed {tuple(packed.shape)} {packed.dtype} does not fit ({n}, {k})")
        u = unpack_int32(packed, f.bits, k)
        zeros = None
        if f.zero_bits:
            if "weight_zero_point" not in tensors:
                raise ValueError(f"{f.name}: missing tensor 'weight_zero_point'")
            zp = tensors["weight_zero_point"]
            zeros = unpack_int32(zp.T.contiguous(), f.bits, n).T.to(torch.uint8).contiguous()
            codes = u.to(torch.uint8)
        else:
            codes = (u - (1 << (f.bits - 1))).to(torch.int8)
        if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{f.name}: weight_scale has dtype {scales.dtype}")
        rw = RuntimeWeight(f.name, (n, k), codes, scales, zeros)
    else:
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
            raise ValueError(f"{f.name}: weight_packed {tuple(packed.shape)} {packed.dtype} does not fit ({n}, {k})")
        g = None
        if f.name == "NVFP4_G16":
            if "weight_global_scale" not in tensors:
                raise ValueError(f"{f.name}: missing tensor 'weight_global_scale'")
            g = tensors["weight_global_scale"].reshape(()).to(torch.float32)
        rw = RuntimeWeight(f.name, (n, k), unpack_pairs(packed), scales, None, g)
    rw.super_weights = _check_super(super_weights, (n, k))
    return rw
