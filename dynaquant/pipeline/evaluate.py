"""The evaluate stage: a quantized GGUF file or safetensors checkpoint against its source (KLD, perplexity, top-1).

``evaluate`` is what ``dynaquant eval`` runs; ``quantize(..., evaluate=True)`` ends with the same measurement.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from dynaquant.analysis.calibration import tokenize_chunks
from dynaquant.analysis.evaluate import EvalResult, compare_models
from dynaquant.analysis.texts import default_eval_text, read_text
from dynaquant.config import QuantizeConfig
from dynaquant.pipeline.source import default_device, open_tensor_source
from dynaquant.sources.checkpoint import (
    ModelSource,
    SourceRecord,
    find_reference,
    load_tokenizer,
    resolve_source,
)
from dynaquant.sources.gguf import TensorSource
from dynaquant.sources.model import load_model
from dynaquant.sources.nonfinite import check_model_finite, source_names
from dynaquant.sources.readers import read_json_object


def evaluate_models(reference, quantized, tokenizer, text, n_ctx, chunks, progress) -> EvalResult:
    """KLD, perplexity and top-1 agreement of ``quantized`` against ``reference`` (two transformers models) on
    ``chunks`` chunks of ``n_ctx`` tokens of ``text`` (a file, or None: the default evaluation text)."""
    body, text_id = read_text(text, default_eval_text)
    ids = tokenize_chunks(tokenizer, body, n_ctx, chunks)
    return compare_models(reference, quantized, ids, text_id, progress=progress)


def evaluate_written(path: Path, source: ModelSource, ts: TensorSource, tokenizer, cfg: QuantizeConfig, device: str, *,
                     checkpoint: bool, reference=None) -> EvalResult:
    """A quantize run's evaluation of what it wrote (``path``: a GGUF file, or with ``checkpoint`` a safetensors
    folder) against its source: ``reference``, the run's source model (unchanged by the run; on ``device``), or
    None: loaded again here (NaN / Inf replaced as in the run when ``cfg.allow_nonfinite``); a GGUF is evaluated as
    a copy of that model holding the file's decoded weights (``runtime.decoded.load_decoded``, bit-exact with
    gguf-py's decoding), not loaded a second time.

    Raises:
        InputError: the source holds NaN or Inf weights and not ``cfg.allow_nonfinite``.
    """
    if reference is None:
        reference = load_model(source, device=device)
        check_model_finite(reference, source_names(ts), str(source.path), cfg.allow_nonfinite)
    if tokenizer is None:
        tokenizer = load_tokenizer(source)
    if checkpoint:
        from dynaquant.runtime.loader import load

        quantized = load(path, device=device, dtype=torch.float32)
    else:  # a copy of the reference with the file's decoded weights: no second load of the source (decoded.py)
        from dynaquant.runtime.decoded import load_decoded

        quantized = load_decoded(path, source, ts, device=device, model=copy.deepcopy(reference))
    return evaluate_models(reference, quantized, tokenizer, cfg.eval_text, cfg.n_ctx, cfg.eval_chunks, cfg.progress)


class DecodedVariant:
    """The ``edit`` of :func:`dynaquant.analysis.blockwise.stream_logits` that turns a skeleton's variant 1 into a
    GGUF file's decoded model: each part's tensors stored in a non-F32 type decoded (our codecs, bit-exact with
    gguf-py) and written over the source's values, undone after the part ran; the outer part's (embedding, head)
    decoded once and swapped in and out.

    Args:
        path: a GGUF file written from ``ts`` (a split GGUF: its first shard); sk: the source's skeleton.
    Raises:
        ValueError: a GGUF tensor the source does not list.
    """

    def __init__(self, path: Path, ts: TensorSource, sk):
        from dynaquant.sources.readers import open_gguf_shards

        self.path, self.ts, self.sk = Path(path), ts, sk
        by_name = {t.gguf_name: t for t in ts.tensors()}
        self.parts: dict[object, list] = {}
        for rt in (rt for r in open_gguf_shards(path) for rt in r.tensors):
            if rt.tensor_type.name == "F32":
                continue
            if rt.name not in by_name:
                raise ValueError(f"{path}: tensor {rt.name} is not in the source {ts.source_id}")
            self.parts.setdefault(sk.part_of(rt.name), []).append((by_name[rt.name], rt))
        self._outer: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] | None = None

    def _write(self, part) -> None:
        from dynaquant.runtime.decoded import decode_tensor
        from dynaquant.sources.params import ParamWriter

        writer = ParamWriter(self.sk.model, self.ts.arch, self.ts.n_head, self.ts.n_head_kv)
        for t, rt in self.parts[part]:
            writer.put(t, decode_tensor(rt), origin=f"{self.path} ({rt.tensor_type.name})")
        writer.flush()

    def __call__(self, v: int, part, _module):
        from dynaquant.sources.skeleton import OUTER

        if v == 0 or part not in self.parts:
            return None
        params = list(self.sk.parameters_of(part).values())
        if part == OUTER:
            if self._outer is None:
                saved = [p.data.clone() for p in params]
                self._write(part)
                self._outer = [(p, old, p.data) for p, old in zip(params, saved)]
            for p, _, new in self._outer:
                p.data = new

            def undo_outer():
                for p, old, _ in self._outer:
                    p.data = old
            return undo_outer
        saved = [p.data.clone() for p in params]
        self._write(part)

        def undo():
            for p, old in zip(params, saved):
                p.data.copy_(old)
        return undo


def evaluate_written_blockwise(path: Path, source: ModelSource, ts: TensorSource, tokenizer, cfg: QuantizeConfig,
                               device: str, progress=None) -> EvalResult:
    """:func:`evaluate_written` for a GGUF, block by block (``quantize --stream``): the source and the file's decoded
    weights run as two variants of one block-wise pass (:func:`dynaquant.analysis.blockwise.stream_logits`), one
    decoder block in memory at a time (twice: the source's and the decoded). Same figures as the whole-model
    evaluation."""
    from dynaquant.analysis.blockwise import stream_logits
    from dynaquant.analysis.evaluate import Scores
    from dynaquant.sources.skeleton import build_skeleton

    if tokenizer is None:
        tokenizer = load_tokenizer(source)
    body, text_id = read_text(cfg.eval_text, default_eval_text)
    ids = tokenize_chunks(tokenizer, body, cfg.n_ctx, cfg.eval_chunks)
    sk = build_skeleton(source, ts, device=device, allow_nonfinite=cfg.allow_nonfinite)
    scores = Scores(ids.shape[1], text_id)
    ref: list[torch.Tensor] = []

    def reduce(s: int, v: int, logits: torch.Tensor) -> None:
        if v == 0:
            ref[:] = [logits]
        else:
            scores.add(ids[s], ref[0], logits)

    stream_logits(sk, ids, 2, DecodedVariant(path, ts, sk), reduce,
                  progress=cfg.progress if progress is None else progress, desc="evaluation")
    return scores.result()


def source_of(path: str | os.PathLike) -> str | None:
    """The ``dynaquant.source`` label recorded in a GGUF written by dynaquant, or None."""
    rec = recorded_source(path)
    return rec.label if rec is not None else None


def recorded_source(path: str | os.PathLike) -> SourceRecord | None:
    """The source recorded in a GGUF written by dynaquant (kind and hash None in older files), or None.

    Raises:
        InputError: the file is not a readable GGUF, or a key holds another kind of value (names the file).
    """
    from dynaquant.sources.readers import gguf_field, open_gguf

    reader = open_gguf(path)
    got = {k: gguf_field(reader, path, f"dynaquant.{k}", str) for k in ("source", "source.kind", "source.sha256")}
    if got["source"] is None:
        return None
    return SourceRecord(got["source"], got["source.kind"], got["source.sha256"])


def evaluate(quantized: str | os.PathLike, reference: str | os.PathLike | None = None, *,
             text: str | os.PathLike | None = None, n_ctx: int = 512, chunks: int | None = 16,
             device: str | None = None, progress: bool = True) -> EvalResult:
    """Mean KLD, perplexity and top-1 agreement of a quantized GGUF (or safetensors checkpoint) against its original.

    Computed in PyTorch on the decoded weights, scoring tokens as ``llama-perplexity
    --kl-divergence`` does (see ``analysis.evaluate``).

    Args:
        quantized: a GGUF file, or a safetensors checkpoint folder (run by ``dynaquant.load``, float32).
        reference: the original model (default: the source recorded in the file, found as
            :func:`checkpoint.find_reference` says: a local source never on the hub); it must have the
            recorded content hash.
        text: evaluation text file (default: stdlib docstrings, disjoint from the calibration default).
        n_ctx: tokens per chunk; chunks: at most this many chunks (None: all).
    Raises:
        InputError: no reference given and none recorded in the file, the recorded local source not found, or
            a reference whose content hash differs from the recorded one (naming the model expected).
    """
    device = device or default_device()
    from dynaquant.runtime.loader import is_runtime_checkpoint

    if is_runtime_checkpoint(quantized):
        from dynaquant.runtime.loader import load

        qmodel = load(quantized, device=device, dtype=torch.float32)  # first: a damaged checkpoint fails before the reference loads
        rsrc = find_reference(recorded_source_of_checkpoint(quantized), quantized, reference)
        return evaluate_models(load_model(rsrc, device=device), qmodel, load_tokenizer(rsrc), text, n_ctx, chunks, progress)
    qsrc = resolve_source(quantized)
    # reads the header: a damaged file is refused before any model loads
    rsrc = find_reference(recorded_source(qsrc.path), quantized, reference)
    return evaluate_models(load_model(rsrc, device=device), quantized_model(qsrc.path, rsrc, None, device),
                            load_tokenizer(rsrc), text, n_ctx, chunks, progress)


def quantized_model(path, reference: ModelSource, ts: TensorSource | None, device):
    """A GGUF file as a transformers model: transformers' GGUF loader for the dense Llama family, else
    (MoE experts, MLA, VL language models) the reference's model with our decoded weights (``decoded.py``)."""
    from dynaquant.runtime.decoded import load_decoded, uses_own_decoder

    if reference.kind == "hf":
        ts = ts if ts is not None else open_tensor_source(reference)
        if uses_own_decoder(ts):
            return load_decoded(path, reference, ts, device=device)
    return load_model(resolve_source(path), device=device)


def source_of_checkpoint(path: str | os.PathLike) -> str | None:
    """The ``source`` label recorded in a dynaquant safetensors checkpoint's config extension, or None."""
    rec = recorded_source_of_checkpoint(path)
    return rec.label if rec is not None else None


def recorded_source_of_checkpoint(path: str | os.PathLike) -> SourceRecord | None:
    """The source recorded in a dynaquant safetensors checkpoint's config extension (``source``,
    ``source_kind``, ``source_sha256``; the last two None in older checkpoints), or None.

    Raises:
        InputError: config.json cannot be read or is not a JSON object (named).
    """
    qc = read_json_object(Path(path) / "config.json").get("quantization_config") or {}
    ext = qc.get("dynaquant") or {} if isinstance(qc, dict) else {}
    if not isinstance(ext, dict) or not ext.get("source"):
        return None
    return SourceRecord(str(ext["source"]), ext.get("source_kind"), ext.get("source_sha256"))
