"""Turn a text into fixed-length token chunks, as llama.cpp's imatrix and perplexity tools do."""

from __future__ import annotations

import torch


def tokenize_chunks(tokenizer, text: str, n_ctx: int = 512, n_chunks: int | None = None,
                    add_bos: bool | None = None) -> torch.Tensor:
    """Tokenize ``text`` and cut it into consecutive chunks of ``n_ctx`` tokens.

    Like ``llama-perplexity``, the whole text is tokenized once and cut into chunks; when
    the model adds a BOS token (``add_bos``, default: the tokenizer's own setting), the
    first token of each chunk is replaced by BOS.

    Args:
        tokenizer: a transformers tokenizer.
        text: the text.
        n_ctx: tokens per chunk.
        n_chunks: at most this many chunks (the first ones); None for all.
    Returns:
        (n, n_ctx) int64 token ids.
    Raises:
        ValueError: the text gives fewer than ``n_ctx`` tokens.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // n_ctx
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {n_ctx}")
    if n_chunks is not None:
        n = min(n, n_chunks)
    chunks = torch.tensor(ids[: n * n_ctx], dtype=torch.long).reshape(n, n_ctx)
    if add_bos is None:
        add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and tokenizer.bos_token_id is not None
    if add_bos:
        chunks[:, 0] = tokenizer.bos_token_id
    return chunks
