"""The format table: one frozen row per storage format.

Each row describes how a weight of shape (N, K) is stored: blocks of ``block_size``
consecutive values along a row (the K axis), each block taking ``type_size`` bytes.
Bits per weight are derived from the row (``bpw = 8 * type_size / block_size``), never
typed twice. GGUF rows follow llama.cpp's ``ggml-common.h`` and gguf-py's
``GGML_QUANT_SIZES``; the table is checked against the latter in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType


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
            Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, 32-element types -> F16).
    """

    name: str
    block_size: int
    type_size: int
    kind: str
    ggml_type: GGMLQuantizationType | None
    fallback: str | None = None

    @property
    def bpw(self) -> float:
        """Bits per weight, scale overhead included."""
        return 8.0 * self.type_size / self.block_size

    def fits(self, row_size: int) -> bool:
        """Whether a row of ``row_size`` weights is a whole number of blocks."""
        return row_size % self.block_size == 0

    def row_bytes(self, row_size: int) -> int:
        """Bytes taken by one row of ``row_size`` weights.

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
        Format("F32", 1, 4, "float", _T.F32),
        Format("F16", 1, 2, "float", _T.F16),
        Format("BF16", 1, 2, "float", _T.BF16),
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
    )
}


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
