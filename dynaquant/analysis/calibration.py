"""Calibration data: text sources, and fixed-length token chunks as llama.cpp's imatrix and perplexity tools cut them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaquant.analysis.texts import default_calibration_text, read_text


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


HF_DATASET_PREFIX = "hf:"


@dataclass(frozen=True)
class CalibrationSpec:
    """What to calibrate on.

    Attributes:
        sources: text files (UTF-8), and/or Hugging Face datasets written ``hf:<id>[:<split>[:<column>]]``
            (needs the optional ``datasets`` package; default split ``train``, column ``text``). Empty: the
            offline default (Python standard-library docstrings, no download).
        n_sequences: sequences (chunks) of ``seq_len`` tokens; fewer when the text is shorter.
        seq_len: tokens per sequence (llama-imatrix's ``-c``; default 512).
        chat_template: wrap the text in the tokenizer's chat template (consecutive paragraphs become
            user / assistant turns), for instruct models.
        images: image files and/or folders for vision-language models (each image goes through the
            processor with a piece of the text; :mod:`.vl_calibration`). Empty: ``n_images`` synthetic images.
        n_images: synthetic images when ``images`` is empty (VL models only).
    """

    sources: tuple[str, ...] = ()
    n_sequences: int = 64
    seq_len: int = 512
    chat_template: bool = False
    images: tuple[str, ...] = ()
    n_images: int = 2

    @property
    def id(self) -> str:
        base = "+".join(self.sources) if self.sources else "stdlib-docstrings:calibration"
        return base + (" (chat template)" if self.chat_template else "") + (
            " + images " + "+".join(self.images) if self.images else "")


def _dataset_text(source: str) -> str:
    spec = source[len(HF_DATASET_PREFIX):]
    parts = spec.split(":")
    name, split, column = parts[0], parts[1] if len(parts) > 1 else "train", parts[2] if len(parts) > 2 else "text"
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(f"calibration source {source!r} needs the optional 'datasets' package "
                         "(pip install datasets), or give a text file") from exc
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; report which source failed
        raise ValueError(f"calibration dataset {name!r} (split {split!r}) cannot be loaded: {exc}") from exc
    if column not in ds.column_names:
        raise ValueError(f"calibration dataset {name!r} has no column {column!r}; columns: {', '.join(ds.column_names)}")
    return "\n\n".join(str(t) for t in ds[column] if str(t).strip())


def calibration_text(spec: CalibrationSpec) -> str:
    """The calibration text of a spec (sources joined by blank lines).

    Raises:
        ValueError: a file is missing, unreadable or empty; a dataset cannot be loaded (messages name it).
    """
    if not spec.sources:
        return default_calibration_text()
    texts = []
    for s in spec.sources:
        texts.append(_dataset_text(s) if s.startswith(HF_DATASET_PREFIX) else read_text(s, default_calibration_text)[0])
    return "\n\n".join(texts)


def apply_chat_template(tokenizer, text: str) -> str:
    """Render paragraphs as alternating user / assistant turns with the tokenizer's chat template.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; calibrate without --chat-template")
    paras = []
    for p in text.split("\n\n"):
        p = p.strip()
        paras += [p[i : i + 2000] for i in range(0, len(p), 2000)]  # long paragraphs become several turns
    out = []
    for i in range(0, len(paras), 2):
        msgs = [{"role": "user", "content": paras[i]}]
        if i + 1 < len(paras):
            msgs.append({"role": "assistant", "content": paras[i + 1]})
        out.append(tokenizer.apply_chat_template(msgs, tokenize=False))
    return "".join(out)


def calibration_chunks(tokenizer, spec: CalibrationSpec) -> torch.Tensor:
    """(n, seq_len) int64 token ids for a spec, n <= ``spec.n_sequences``.

    Raises:
        ValueError: as ``calibration_text``; or the text is shorter than one sequence.
    """
    text = calibration_text(spec)
    if spec.chat_template:
        text = apply_chat_template(tokenizer, text)
    return tokenize_chunks(tokenizer, text, spec.seq_len, spec.n_sequences,
                           add_bos=False if spec.chat_template else None)
