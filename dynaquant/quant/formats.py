"""The format table: one frozen row per storage format.

Each row describes how a weight of shape (N, K) is stored: blocks of ``block_size``
consecutive values along a row (the K axis), each block taking ``type_size`` bytes.
Bits per weight are derived from the row (``bpw = 8 * type_size / block_size``), never
typed twice. GGUF rows follow llama.cpp's ``ggml-common.h`` and gguf-py's
``GGML_QUANT_SIZES``; the table is checked against the latter in the tests.

Each row also names the target file it is written to (``target``): ``gguf`` rows only go
to GGUF files, ``safetensors`` rows (the runtime formats of :mod:`dynaquant.quant.runtime`,
stored as compressed-tensors stores them) only to safetensors checkpoints, and the plain
float rows to either. Runtime rows give their code, scale and zero-point bits per block
(``bits``, ``scale_bits``, ``zero_bits``) and take their bits per weight from those (the
file packs codes densely, so a block need not be a whole number of bytes); their
``type_size`` is the size of the reference codec's byte record of a block
(:meth:`Format.record_bytes`), not of the file layout.

Runtime rows (group size ``g`` in 32, 64, 128; a row that ``g`` does not divide falls back to
the next smaller group, then to BF16):

- ``INT{b}_G{g}``, b in 2, 3, 4, 8: symmetric, ``w = scale * code``, signed codes
  ``-2**(b-1) .. 2**(b-1)-1``, one fp16 scale per group (bpw ``b + 16 / g``);
- ``INT{b}_G{g}_ASYM``: ``w = scale * (code - zero)``, unsigned codes and an integer zero
  point ``0 .. 2**b - 1`` per group, stored with ``b`` bits (bpw ``b + (16 + b) / g``);
- ``MXFP4_G32``: OCP Microscaling MXFP4, E2M1 elements and one E8M0 scale per 32 (4.25 bpw);
  the same values as GGUF's ``MXFP4`` row in compressed-tensors' byte order;
- ``NVFP4_G16``: NVFP4 as compressed-tensors and NVIDIA define it, E2M1 elements, one E4M3
  scale per 16 and one float32 global scale per tensor (4.5 bpw, the global scale not
  counted); not GGUF's NVFP4 (GGML type 40).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

# FP4 E2M1 (OCP Microscaling v1.0) code -> value: bit 3 the sign, then 2 exponent bits and 1
# mantissa bit; codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives (8 is -0.0).
# The element type of MXFP4, MXFP4_G32 and NVFP4_G16; the one copy of the table.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Format:
    """One storage format.

    Attributes:
        name: the format's name, for GGUF types exactly as llama.cpp spells it (``Q4_K``).
        block_size: weights per block along a row (1 for plain floats).
        type_size: bytes per block, scales included.
        kind: ``float`` (plain float), ``legacy`` (32-element blocks with one scale),
            ``nonlinear`` (32-element blocks on a non-uniform grid), ``kquant``
            (256-element super-blocks with quantized sub-block scales).
        ggml_type: the GGML type id written in GGUF files, or None for non-GGUF formats.
        fallback: the format llama.cpp uses when a row's length is not a multiple of
            ``block_size`` (``tensor_type_fallback`` in ``llama-quant.cpp``: Q2_K/Q3_K -> Q4_0,
            Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, 32-element types -> F16); runtime
            rows fall back to the next smaller group size, then BF16.
        target: ``gguf``, ``safetensors`` (runtime formats: ``kind`` ``int`` or ``fp4``) or
            ``any`` (plain floats).
        bits, scale_bits, zero_bits: runtime rows only: bits per code, per group scale and per
            group zero point (0 when symmetric) in the safetensors file.
        scale_type: runtime rows only: the group scale's number format, ``fp16`` (the ``INT``
            rows), ``e8m0`` (``MXFP4_G32``: a power of two) or ``e4m3`` (``NVFP4_G16``, beside
            one float32 global scale per tensor); ``""`` elsewhere.
    """

    name: str
    block_size: int
    type_size: int
    kind: str
    ggml_type: GGMLQuantizationType | None
    fallback: str | None = None
    target: str = "gguf"
    bits: int = 0
    scale_bits: int = 0
    zero_bits: int = 0
    scale_type: str = ""

    @property
    def block_bits(self) -> int:
        """Bits one block takes in its target file (codes, scales and zero points)."""
        if self.target == "safetensors":
            return self.block_size * self.bits + self.scale_bits + self.zero_bits
        return 8 * self.type_size

    @property
    def bpw(self) -> float:
        """Bits per weight, scale overhead included."""
        return self.block_bits / self.block_size

    def allowed_in(self, target: str) -> bool:
        """Whether the format can be written to a ``target`` (``gguf`` / ``safetensors``) file."""
        return self.target in (target, "any")

    def fits(self, row_size: int) -> bool:
        """Whether a row of ``row_size`` weights is a whole number of blocks."""
        return row_size % self.block_size == 0

    def row_bytes(self, row_size: int) -> int:
        """Bytes taken by one row of ``row_size`` weights in the target file (runtime rows:
        the row's bits rounded up to whole bytes).

        Raises:
            ValueError: the row is not a whole number of blocks.
        """
        if not self.fits(row_size):
            raise ValueError(f"{self.name}: row of {row_size} is not a multiple of block size {self.block_size}")
        return -(-row_size // self.block_size * self.block_bits // 8)

    def record_bytes(self, row_size: int) -> int:
        """Bytes of one row in the codecs' byte layout (``quantize`` / ``dequantize``): whole
        ``type_size`` records; equal to :meth:`row_bytes` for GGUF and float rows.

        Raises:
            ValueError: the row is not a whole number of blocks.
        """
        if not self.fits(row_size):
            raise ValueError(f"{self.name}: row of {row_size} is not a multiple of block size {self.block_size}")
        return row_size // self.block_size * self.type_size


_T = GGMLQuantizationType

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("F32", 1, 4, "float", _T.F32, target="any"),
        Format("F16", 1, 2, "float", _T.F16, target="any"),
        Format("BF16", 1, 2, "float", _T.BF16, target="any"),
        Format("Q8_0", 32, 34, "legacy", _T.Q8_0, "F16"),
        Format("Q5_1", 32, 24, "legacy", _T.Q5_1, "F16"),
        Format("Q5_0", 32, 22, "legacy", _T.Q5_0, "F16"),
        Format("Q4_1", 32, 20, "legacy", _T.Q4_1, "F16"),
        Format("Q4_0", 32, 18, "legacy", _T.Q4_0, "F16"),
        Format("IQ4_NL", 32, 18, "nonlinear", _T.IQ4_NL, "F16"),
        Format("MXFP4", 32, 17, "nonlinear", _T.MXFP4, "F16"),
        Format("Q6_K", 256, 210, "kquant", _T.Q6_K, "Q8_0"),
        Format("Q5_K", 256, 176, "kquant", _T.Q5_K, "Q5_1"),
        Format("Q4_K", 256, 144, "kquant", _T.Q4_K, "Q5_0"),
        Format("Q3_K", 256, 110, "kquant", _T.Q3_K, "Q4_0"),
        Format("Q2_K", 256, 84, "kquant", _T.Q2_K, "Q4_0"),
        Format("IQ4_XS", 256, 136, "iquant", _T.IQ4_XS, "IQ4_NL"),
        Format("IQ3_S", 256, 110, "iquant", _T.IQ3_S, "IQ4_NL"),
        Format("IQ3_XXS", 256, 98, "iquant", _T.IQ3_XXS, "IQ4_NL"),
        Format("IQ2_S", 256, 82, "iquant", _T.IQ2_S, "IQ4_NL"),
        Format("IQ2_XS", 256, 74, "iquant", _T.IQ2_XS, "IQ4_NL"),
        Format("IQ2_XXS", 256, 66, "iquant", _T.IQ2_XXS, "IQ4_NL"),
        Format("IQ1_M", 256, 56, "iquant", _T.IQ1_M, "IQ4_NL"),
        Format("IQ1_S", 256, 50, "iquant", _T.IQ1_S, "IQ4_NL"),
        Format("NVFP4", 64, 36, "nonlinear", _T.NVFP4, "F16"),
        *(
            Format(f"INT{b}_G{g}{sfx}", g, g + 2 + (sfx != ""), "int", None,
                   f"INT{b}_G{g // 2}{sfx}" if g > 32 else "BF16", "safetensors", b, 16, b if sfx else 0, "fp16")
            for b in (2, 3, 4, 8) for g in (128, 64, 32) for sfx in ("", "_ASYM")
        ),
        Format("MXFP4_G32", 32, 17, "fp4", None, "BF16", "safetensors", 4, 8, 0, "e8m0"),
        Format("NVFP4_G16", 16, 13, "fp4", None, "BF16", "safetensors", 4, 8, 0, "e4m3"),
    )
}

# The runtime formats (safetensors target), in table order.
RUNTIME_FORMATS: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if f.target == "safetensors")


def formats_for(target: str) -> list[str]:
    """Names of the formats a ``target`` file can hold (``gguf`` or ``safetensors``), table order.

    Raises:
        ValueError: an unknown target.
    """
    if target not in ("gguf", "safetensors"):
        raise ValueError(f"unknown target {target!r} (known: gguf, safetensors)")
    return [n for n, f in FORMATS.items() if f.allowed_in(target)]


def get_format(name: str) -> Format:
    """Look a format up by name (case-insensitive).

    Raises:
        KeyError: no such format; the message lists the known ones.
    """
    key = name.upper()
    if key not in FORMATS:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")
    return FORMATS[key]


def resolve_for_row(name: str, row_size: int) -> tuple[Format, str | None]:
    """The format actually used for rows of ``row_size`` weights, following fallbacks.

    Returns:
        (format, reason): reason is None when ``name`` fits as is, else a short text
        naming the fallback chain (``"Q4_K->Q5_0: row 576 not a multiple of 256"``).
    """
    fmt = get_format(name)
    chain = [fmt.name]
    while not fmt.fits(row_size):
        fmt = get_format(fmt.fallback or "F16")
        chain.append(fmt.name)
    if len(chain) == 1:
        return fmt, None
    return fmt, f"{'->'.join(chain)}: row {row_size} not a multiple of {get_format(name).block_size}"
