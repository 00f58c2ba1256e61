"""Weight formats as the kernels see them.

A :class:`KernelFormat` names what the kernels need to know of a runtime format
(:mod:`dynaquant.quant.runtime`, the safetensors target's rows of :mod:`dynaquant.quant.formats`):
the element kind, the code width, the group size and whether a zero point is stored, all read
from the format's row (:meth:`KernelFormat.from_format`). :meth:`KernelFormat.parse` takes the
table's names (``INT{b}_G{g}``, ``INT{b}_G{g}_ASYM``, ``MXFP4_G32``, ``NVFP4_G16``) in any case,
and the aliases ``INT{b}_G{g}_SYM``, ``MXFP4`` and ``NVFP4_CT``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynaquant.quant.formats import Format, get_format

INT_BITS = (2, 3, 4, 8)
GROUP_SIZES = (16, 32, 64, 128)
# Names parse also takes, and the row each stands for (the GGUF MXFP4 row has the same values).
_ALIASES = {"MXFP4": "MXFP4_G32", "NVFP4_CT": "NVFP4_G16"}
# A runtime row's scale type -> the kernels' element kind.
_KIND_OF_SCALE = {"fp16": "int", "e8m0": "mxfp4", "e4m3": "nvfp4"}


@dataclass(frozen=True)
class KernelFormat:
    """A runtime weight format, as the kernels see it.

    Attributes:
        kind: ``int`` (group-wise integer codes), ``mxfp4`` (OCP Microscaling MXFP4: E2M1 elements,
            one E8M0 scale per 32) or ``nvfp4`` (NVIDIA NVFP4 as compressed-tensors stores it: E2M1
            elements, one E4M3 scale per 16, one float32 global scale per tensor).
        bits: code width in bits (2, 3, 4 or 8 for ``int``; 4 for the FP4 kinds).
        group_size: weights per scale along a row (the K axis).
        symmetric: no zero point (``w = scale * code``); False: ``w = scale * (code - zero)``.
    """

    kind: str
    bits: int
    group_size: int
    symmetric: bool = True

    def __post_init__(self):
        if self.kind == "int":
            if self.bits not in INT_BITS:
                raise ValueError(f"integer formats take {INT_BITS} bits, not {self.bits}")
            if self.group_size not in GROUP_SIZES or self.group_size < 32:
                raise ValueError(f"integer formats take group sizes 32, 64 or 128, not {self.group_size}")
        elif self.kind == "mxfp4":
            if (self.bits, self.group_size, self.symmetric) != (4, 32, True):
                raise ValueError("MXFP4 is 4-bit, symmetric, group 32")
        elif self.kind == "nvfp4":
            if (self.bits, self.group_size, self.symmetric) != (4, 16, True):
                raise ValueError("NVFP4 is 4-bit, symmetric, group 16")
        else:
            raise ValueError(f"unknown kernel format kind {self.kind!r}")

    @property
    def name(self) -> str:
        """The format table's name (``INT4_G128``, ``INT2_G64_ASYM``, ``MXFP4_G32``, ``NVFP4_G16``)."""
        if self.kind == "mxfp4":
            return "MXFP4_G32"
        if self.kind == "nvfp4":
            return "NVFP4_G16"
        return f"INT{self.bits}_G{self.group_size}" + ("" if self.symmetric else "_ASYM")

    @property
    def is_fp4(self) -> bool:
        return self.kind in ("mxfp4", "nvfp4")

    @property
    def packed_bits_per_weight(self) -> float:
        """Bits per weight of the kernel layout (codes, scales and zero points; global scale not counted)."""
        scale_bits = 8 if self.is_fp4 else 16
        zero_bits = 0 if self.symmetric else 8
        return self.bits + (scale_bits + zero_bits) / self.group_size

    @classmethod
    def parse(cls, fmt: str | KernelFormat) -> KernelFormat:
        """A KernelFormat from a format name (case-insensitive) or a KernelFormat (returned as is).

        Raises:
            ValueError: not a runtime format name.
        """
        if isinstance(fmt, KernelFormat):
            return fmt
        name = getattr(fmt, "name", fmt)  # a dynaquant.quant.formats.Format row works too
        if not isinstance(name, str):
            raise ValueError(f"not a format: {fmt!r}")
        up = name.upper()
        if up.startswith("INT") and up.endswith("_SYM"):  # INT4_G128_SYM: the symmetric row
            up = up.removesuffix("_SYM")
        try:
            row = get_format(_ALIASES.get(up, up))
        except KeyError:
            row = None
        if row is None or row.target != "safetensors":
            raise ValueError(f"not a runtime format name: {name!r} (expected INT{{b}}_G{{g}}[_ASYM], MXFP4_G32, NVFP4_G16)")
        return cls.from_format(row)

    @classmethod
    def from_format(cls, row: Format) -> KernelFormat:
        """The KernelFormat of a runtime row of :mod:`dynaquant.quant.formats`: kind from its
        ``scale_type``, ``bits``, ``group_size = block_size``, symmetric when ``zero_bits == 0``.

        Raises:
            ValueError: not a runtime (safetensors) row.
        """
        if row.target != "safetensors" or row.scale_type not in _KIND_OF_SCALE:
            raise ValueError(f"{row.name} is not a runtime format")
        return cls(_KIND_OF_SCALE[row.scale_type], row.bits, row.block_size, row.zero_bits == 0)
