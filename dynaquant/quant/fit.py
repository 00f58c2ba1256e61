"""Memory-fit targets: the largest file whose weights, KV cache and a compute margin fit a memory size.

``--fit-memory 24GiB`` becomes a ``--size`` budget::

    size = memory - kv_cache_bytes(shape, ctx, kv_type) - margin      (margin default: 0.5 GiB + 4 % of memory)

The KV cache is counted as llama.cpp allocates it (``llama-kv-cache.cpp``, llama-cpp-python 0.3.36's vendored
llama.cpp): for every layer with KV heads, a K tensor of ``n_kv_heads * key_length`` and a V tensor of
``n_kv_heads * value_length`` elements per cell, ``ctx`` cells (llama.cpp pads the context to a multiple of 256),
each row stored in the cache type (``f16``: 2 bytes an element; ``q8_0``: 34 bytes a block of 32). With MLA
(DeepSeek-V2/V3: the GGUF's ``key_length_mla``/``value_length_mla`` set) llama.cpp keeps only the compressed K
(``kv_lora_rank + qk_rope_head_dim`` per cell, one "head") and reads V as a view of it: no V tensor. Sliding-window
layers are counted with the full context: an upper bound (llama.cpp gives them a smaller cache unless
``--swa-full``). Pure arithmetic: no files read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from dynaquant.quant.formats import get_format

GIB = 2**30
KV_TYPES = {"f16": "F16", "q8_0": "Q8_0"}  # --kv-type -> the format row of a cache element (llama.cpp's type_k/v)
FIT_CTX = 4096  # default context (tokens) of a memory fit
CTX_PAD = 256  # llama.cpp pads the context (its KV cells) to a multiple of this (llama-context.cpp)
MARGIN_FIXED_BYTES = GIB // 2  # the default compute margin: 0.5 GiB ...
MARGIN_PERCENT = 4  # ... plus 4 % of the memory


@dataclass(frozen=True)
class KVShape:
    """What a model keeps in its KV cache per token, as llama.cpp lays it out.

    Attributes:
        n_kv_heads: KV heads of each layer, in layer order (0: a layer without KV cache, e.g. recurrent).
        key_length: elements of one K head (``head_dim``; MLA: ``kv_lora_rank + qk_rope_head_dim``).
        value_length: elements of one V head (``head_dim``; 0 for MLA: V is a view of the compressed K).
        mla: the cache is MLA's compressed one (one head of ``key_length``, no V).
    """

    n_kv_heads: tuple[int, ...]
    key_length: int
    value_length: int
    mla: bool = False

    def __post_init__(self):
        if not self.n_kv_heads or any(type(n) is not int or n < 0 for n in self.n_kv_heads):
            raise ValueError(f"KV heads per layer must be whole numbers >= 0, got {self.n_kv_heads!r}")
        if self.key_length <= 0 or self.value_length < 0 or (self.value_length == 0 and not self.mla):
            raise ValueError(f"key_length {self.key_length} / value_length {self.value_length}: head sizes must be > 0")

    @property
    def n_layers(self) -> int:
        """Layers that hold a KV cache."""
        return sum(n > 0 for n in self.n_kv_heads)

    def describe(self) -> str:
        """One line, e.g. ``30 layers x 3 KV heads x (64 + 64)`` or ``61 layers x MLA 576``."""
        heads = sorted({n for n in self.n_kv_heads if n})
        if self.mla:
            return f"{self.n_layers} layers x MLA {self.key_length}"
        h = "/".join(map(str, heads))
        return f"{self.n_layers} layers x {h} KV heads x ({self.key_length} + {self.value_length})"


def padded_ctx(ctx: int) -> int:
    """The KV cells llama.cpp allocates for a context of ``ctx`` tokens: ``ctx`` rounded up to a multiple of 256."""
    return -(-ctx // CTX_PAD) * CTX_PAD


def kv_cache_bytes(shape: KVShape, ctx: int, kv_type: str = "f16") -> int:
    """Bytes of llama.cpp's KV cache for one sequence of ``ctx`` tokens (one stream).

    ``sum over layers of padded_ctx(ctx) * (row_bytes(n_kv * key_length) + row_bytes(n_kv * value_length))``,
    a row's bytes from the cache type's format row (``f16``: 2 per element; ``q8_0``: 34 per 32).

    Raises:
        ValueError: ``ctx`` < 1, an unknown ``kv_type``, or a quantized cache whose head sizes are not a multiple of
            its block (llama.cpp refuses those too).
    """
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r} (known: {', '.join(KV_TYPES)})")
    if type(ctx) is not int or ctx < 1:
        raise ValueError(f"context {ctx!r}: must be a whole number of tokens, at least 1")
    fmt = get_format(KV_TYPES[kv_type])
    for what, n in (("key", shape.key_length), ("value", shape.value_length)):
        if n and n % fmt.block_size:
            raise ValueError(f"a {kv_type} KV cache needs {what} heads of a multiple of {fmt.block_size} elements; "
                             f"this model's have {n}: use --kv-type f16")
    per_cell = sum(fmt.row_bytes(n * shape.key_length) + (fmt.row_bytes(n * shape.value_length) if shape.value_length else 0)
                   for n in shape.n_kv_heads if n)
    return padded_ctx(ctx) * per_cell


def default_margin_bytes(memory_bytes: int) -> int:
    """The default compute margin (llama.cpp's compute buffers, the runtime, fragmentation): 0.5 GiB + 4 % of
    ``memory_bytes``, in whole bytes (rounded down)."""
    return MARGIN_FIXED_BYTES + memory_bytes * MARGIN_PERCENT // 100


@dataclass(frozen=True)
class MemoryFit:
    """The assumptions of a memory-fit target and the file size they leave.

    Attributes:
        memory_bytes: the memory to fit (bytes).
        ctx: context (tokens) of the KV cache.
        kv_type: the cache's element type (``f16`` or ``q8_0``).
        kv_bytes: the KV cache's bytes at ``ctx`` (:func:`kv_cache_bytes`).
        margin_bytes: the compute margin (bytes).
        size_bytes: the whole file's budget, ``memory_bytes - kv_bytes - margin_bytes`` (may be <= 0: does not fit).
        kv_shape: how the cache was counted (:meth:`KVShape.describe`).
    """

    memory_bytes: int
    ctx: int
    kv_type: str
    kv_bytes: int
    margin_bytes: int
    size_bytes: int
    kv_shape: str = ""

    def to_dict(self) -> dict:
        """JSON-ready dict (the plan's and the result's ``fit``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d, source: str = "fit") -> MemoryFit:
        """Read :meth:`to_dict`'s layout back.

        Raises:
            ValueError: not an object, a field missing or of the wrong type (names ``source``).
        """
        if not isinstance(d, dict):
            raise ValueError(f"{source}: 'fit' must be an object, got {type(d).__name__}")
        kw = {}
        for f in fields(cls):
            want = str if f.name in ("kv_type", "kv_shape") else int
            v = d.get(f.name, "" if f.name == "kv_shape" else None)
            if type(v) is not want:
                raise ValueError(f"{source}: fit.{f.name} must be a{'n integer' if want is int else ' string'}, got {v!r}")
            kw[f.name] = v
        return cls(**kw)

    def describe(self) -> str:
        """One line: the memory, the KV cache, the margin and the file budget, in GiB."""
        return (f"{self.memory_bytes / GIB:.2f} GiB = file <= {self.size_bytes / GIB:.3f} GiB + KV cache "
                f"{self.kv_bytes / GIB:.3f} GiB ({self.kv_type}, {self.ctx} tokens; {self.kv_shape}) + margin "
                f"{self.margin_bytes / GIB:.3f} GiB")


def memory_fit(shape: KVShape, memory_bytes: int, ctx: int = FIT_CTX, kv_type: str = "f16",
               margin_bytes: int | None = None) -> MemoryFit:
    """The file budget for ``memory_bytes``: ``memory - kv_cache_bytes(shape, ctx, kv_type) - margin``.

    Args:
        memory_bytes: memory (bytes) > 0; margin_bytes: >= 0, None: :func:`default_margin_bytes`.
    Returns:
        MemoryFit (``size_bytes`` <= 0 when the cache and margin alone fill the memory; the caller says so).
    Raises:
        ValueError: as :func:`kv_cache_bytes`; a memory <= 0 or a negative margin.
    """
    if type(memory_bytes) is not int or memory_bytes <= 0:
        raise ValueError(f"memory {memory_bytes!r}: must be a positive number of bytes")
    margin = default_margin_bytes(memory_bytes) if margin_bytes is None else margin_bytes
    if type(margin) is not int or margin < 0:
        raise ValueError(f"margin {margin!r}: must be a number of bytes >= 0")
    kv = kv_cache_bytes(shape, ctx, kv_type)
    return MemoryFit(memory_bytes, ctx, kv_type, kv, margin, memory_bytes - kv - margin, shape.describe())


def fit_error_message(fit: MemoryFit, min_bytes: int) -> str:
    """The message for a memory that cannot hold the cache, the margin and the smallest possible file."""
    need = fit.kv_bytes + fit.margin_bytes + min_bytes
    return (f"--fit-memory {fit.memory_bytes} bytes ({fit.memory_bytes / GIB:.3f} GiB) is too small: the KV cache at "
            f"{fit.ctx} tokens ({fit.kv_type}; {fit.kv_shape}) takes {fit.kv_bytes} bytes and the margin "
            f"{fit.margin_bytes} bytes, leaving {fit.size_bytes} bytes for the file, below the smallest plan's "
            f"{min_bytes} bytes; at least {need} bytes ({need / GIB:.3f} GiB) are needed (or a smaller --fit-ctx, "
            f"--kv-type q8_0, --margin)")

