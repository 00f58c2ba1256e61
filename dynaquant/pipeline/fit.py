"""``--fit-memory``: a source's KV-cache shape (from its config.json or GGUF metadata) and the memory fit of a run.

The arithmetic is :mod:`dynaquant.quant.fit`'s; this module reads the facts it needs from the tensor source without
loading any weights, and turns a :class:`QuantizeConfig` with ``fit_memory`` into the ``size`` budget it plans for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import gguf

from dynaquant.config import QuantizeConfig
from dynaquant.errors import InputError
from dynaquant.quant.fit import KVShape, MemoryFit, fit_error_message, memory_fit
from dynaquant.quant.planner import BudgetError
from dynaquant.sources.gguf import TensorSource

_ATT = gguf.Keys.Attention


def _gguf_value(reader, arch: str, key: str):
    """An integer (or, for per-layer keys, a list of integers) of a GGUF metadata key, or None when absent."""
    f = reader.fields.get(key.format(arch=arch))
    if f is None:
        return None
    v = f.contents()
    return [int(x) for x in v] if isinstance(v, list) else int(v)


def _per_layer(value, n_layers: int, where: str, key: str) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) != n_layers:
            raise InputError(f"{where}: {key} has {len(value)} values for {n_layers} layers")
        return tuple(value)
    return (int(value),) * n_layers


def gguf_kv_shape(reader, arch: str, where: str) -> KVShape:
    """The KV cache shape from a GGUF file's metadata, read as llama.cpp reads it (``llama-model.cpp``):
    ``{arch}.block_count``; ``{arch}.attention.head_count_kv`` (a number, or one per layer; default the head count);
    ``{arch}.attention.key_length`` / ``value_length`` (default ``embedding_length / head_count``); MLA when
    ``{arch}.attention.key_length_mla`` and ``value_length_mla`` are set (then ``key_length`` is
    ``kv_lora_rank + rope.dimension_count`` and only K is cached).

    Raises:
        InputError: ``block_count``, the head count or the embedding length missing or not positive (names ``where``).
    """
    n_layers = _gguf_value(reader, arch, gguf.Keys.LLM.BLOCK_COUNT)
    heads = _gguf_value(reader, arch, _ATT.HEAD_COUNT)
    if not n_layers or not heads:
        raise InputError(f"{where}: no {arch}.block_count / {arch}.attention.head_count: cannot size the KV cache")
    n_head = max(heads) if isinstance(heads, list) else heads
    kv = _gguf_value(reader, arch, _ATT.HEAD_COUNT_KV)
    n_kv = _per_layer(heads if kv is None else kv, n_layers, where, _ATT.HEAD_COUNT_KV.format(arch=arch))
    k_len, v_len = _gguf_value(reader, arch, _ATT.KEY_LENGTH), _gguf_value(reader, arch, _ATT.VALUE_LENGTH)
    if k_len is None or v_len is None:
        n_embd = _gguf_value(reader, arch, gguf.Keys.LLM.EMBEDDING_LENGTH)
        if not n_embd or not n_head:
            raise InputError(f"{where}: no {arch}.attention.key_length and no embedding_length: cannot size the KV cache")
        k_len = n_embd // n_head if k_len is None else k_len
        v_len = n_embd // n_head if v_len is None else v_len
    mla = bool(_gguf_value(reader, arch, _ATT.KEY_LENGTH_MLA)) and bool(_gguf_value(reader, arch, _ATT.VALUE_LENGTH_MLA))
    return KVShape(n_kv, k_len, 0 if mla else v_len, mla)


def config_kv_shape(hp: dict, where: str) -> KVShape:
    """The KV cache shape of the GGUF llama.cpp runs for a HF config (``config.json``, text part), as dynaquant
    writes its metadata: ``num_hidden_layers`` layers of ``num_key_value_heads`` (default ``num_attention_heads``)
    heads of ``head_dim`` (default ``hidden_size / num_attention_heads``; V: ``v_head_dim`` where the config has
    one); MLA (``kv_lora_rank`` set: DeepSeek-V2/V3) one head of ``kv_lora_rank + qk_rope_head_dim``, K only.
    Sliding-window layers count as full ones (an upper bound).

    Raises:
        InputError: a needed key missing or not a positive whole number (names ``where`` and the key).
    """
    def num(key: str, default=None) -> int:
        v = hp.get(key, default)
        if v is None or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(f"{where}: {key!r} is {v!r}; a positive whole number is needed to size the KV cache")
        return v

    n_layers = num("num_hidden_layers")
    if hp.get("kv_lora_rank"):
        return KVShape((1,) * n_layers, num("kv_lora_rank") + num("qk_rope_head_dim"), 0, mla=True)
    n_head = num("num_attention_heads")
    head_dim = num("head_dim") if hp.get("head_dim") is not None else num("hidden_size") // n_head
    n_kv = num("num_key_value_heads") if hp.get("num_key_value_heads") is not None else n_head
    v_dim = num("v_head_dim") if hp.get("v_head_dim") is not None else head_dim
    return KVShape((n_kv,) * n_layers, head_dim, v_dim)


def kv_shape(ts: TensorSource) -> KVShape:
    """The KV cache shape of a tensor source: a GGUF file's metadata, or a HF folder's config
    (:func:`gguf_kv_shape`, :func:`config_kv_shape`).

    Raises:
        InputError: the facts are missing (names the file).
    """
    reader = getattr(ts, "reader", None)
    if reader is not None:
        return gguf_kv_shape(reader, ts.arch, str(getattr(ts, "path", ts.source_id)))
    hp = getattr(ts, "hparams", None)
    if hp is None:
        raise InputError(f"{ts.source_id}: no config to size the KV cache from")
    return config_kv_shape(hp, f"{ts.source_id}/config.json")


def fit_target(cfg: QuantizeConfig, ts: TensorSource) -> MemoryFit | None:
    """The memory fit ``cfg.fit_memory`` asks for (None without one): ``cfg.fit_ctx`` tokens of ``cfg.kv_type``
    cache, ``cfg.margin`` (None: the default margin). Its ``size_bytes`` may be <= 0: :func:`fit_errors` says so
    once the smallest plan is known.

    Raises:
        InputError: the source lacks the facts; ValueError: as :func:`dynaquant.quant.fit.memory_fit`.
    """
    if cfg.fit_memory is None:
        return None
    return memory_fit(kv_shape(ts), cfg.fit_memory, cfg.fit_ctx, cfg.kv_type, cfg.margin)


@contextmanager
def fit_errors(fit: MemoryFit | None) -> Iterator[None]:
    """Within it, the planner's ``BudgetError`` (the file budget below the smallest plan) is restated with the fit's
    numbers (KV cache, margin, the budget left, the smallest plan, the memory needed); nothing changes without a fit.

    Raises:
        planner.BudgetError: the restated error (same ``min_bytes``).
    """
    try:
        yield
    except BudgetError as exc:
        if fit is None:
            raise
        raise BudgetError(fit_error_message(fit, exc.min_bytes), exc.min_bytes) from None
