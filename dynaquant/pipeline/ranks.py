"""The tensor loop and the option checks of a run over several ranks (``torchrun -m dynaquant quantize --stream``;
:mod:`dynaquant.distributed`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from dynaquant import distributed
from dynaquant.config import QuantizeConfig
from dynaquant.pipeline.run_state import RunState
from dynaquant.pipeline.targets import Target
from dynaquant.progress import stage_bar


def encode_planned(run: RunState, target: Target, t):
    """Tensor ``t`` read, GPTQ-rounded where the run asks and it wins, and encoded (or the corrections' bytes of it,
    :meth:`Target.reused`, where the run kept them; with GPTQ they are the plain rounding it is checked against):
    what the tensor loops hand to ``target`` (one process's :func:`dynaquant.pipeline.quantize.write_output` and
    :func:`write_output_ranks`)."""
    reused = target.reused(t) if run.encodings is not None else None
    if reused is not None and run.rounding is None:
        return reused
    w = target.read(t)
    rounded = target.gptq_round(t, w, plain=reused) if run.rounding is not None else None
    if rounded is None and reused is not None:
        return reused
    return target.encode(t, w, rounded)


def tensor_bar(run: RunState, label: str, n: int):
    """The tensor loop's progress: the run's display (its ``writing`` stage) when it has one, else a bar of its own."""
    if run.progress is not None:
        bar = stage_bar(run.progress, "writing", n, "tensor")
        bar.set_description(label)
        return bar
    return stage_bar(run.cfg.progress, label, n, "tensor")


def write_output_ranks(run: RunState, target: Target, path: Path) -> tuple[Path, int] | tuple[None, int]:
    """The tensor loop over several ranks. The work is split into items: a tensor, or one expert range of a stacked
    expert tensor the target encodes a group of experts at a time (``target.expert_groups``; a DeepSeek-V3 block's
    three expert tensors are ~15 items each). Each item is encoded by the rank that claims it first (a file created
    exclusively in the work folder's ``claims/``) and kept in the work folder (``target.encoded_name``; a resumed run's
    encodings are kept and not claimed again). The ranks
    other than 0 claim items largest first while any is left; rank 0 writes the output in order, each tensor as soon as
    all its items are there, and claims and encodes the earliest unclaimed item whenever the next tensor is not complete
    yet. The encoding of an item does not depend on who makes it: the bytes are the single process's. Returns what
    :func:`dynaquant.pipeline.quantize.write_output` returns on rank 0, ``(None, 0)`` on the others.

    Raises:
        TimeoutError: (rank 0) an item claimed by another rank is not in the work folder after the process group's
            timeout (``DYNAQUANT_DIST_TIMEOUT``).
        Any error of :func:`dynaquant.pipeline.quantize.write_output`.
    """
    grp = distributed.group()
    claims = run.rundir.file("claims/.keep").parent
    if grp.main:  # the claims of a stopped run are void
        for f in claims.glob("[0-9]*"):
            f.unlink()
        target.begin(run, path)
    else:
        target.prepare(run)
    grp.barrier()
    tensors = target.tensors()
    groups = getattr(target, "expert_groups", lambda t: None)
    items = []  # (tensor, expert range's index or None, the range or None)
    for i, t in enumerate(tensors):
        g = groups(t)
        items.extend([(i, None, None)] if g is None else [(i, k, r) for k, r in enumerate(g)])
    of = {}  # tensor -> its items' indices
    for n, (i, _, _) in enumerate(items):
        of.setdefault(i, []).append(n)
    bar = tensor_bar(run, target.progress_label() if grp.main else "encoding", len(tensors))
    claimed = [False] * len(items)

    def name(n: int) -> str:
        i, k, _ = items[n]
        return f"{i:05d}" if k is None else f"{i:05d}-{k:03d}"

    def claim(n: int) -> bool:
        if claimed[n]:
            return False
        claimed[n] = True
        try:
            os.close(os.open(claims / name(n), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def file_of(n: int) -> str:
        i, k, _ = items[n]
        return target.encoded_name(i, k)

    def saved(n: int) -> bool:
        return (run.rundir.path / file_of(n)).is_file()

    def encode(n: int):
        i, k, r = items[n]
        encoded = encode_planned(run, target, tensors[i]) if k is None else target.encode_group(tensors[i], *r)
        run.rundir.save_array(file_of(n), encoded)
        return encoded

    def complete(i: int):
        """Tensor ``i``'s encoding when all its items are in the work folder, else None."""
        if not all(saved(n) for n in of[i]):
            return None
        parts = [run.rundir.load_array(file_of(n)) for n in of[i]]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    try:
        if not grp.main:
            size = [tensors[i].numel * ((r[1] - r[0]) / tensors[i].shape[0] if r else 1) for i, _, r in items]
            for n in sorted(range(len(items)), key=lambda n: (-size[n], n)):  # largest first: no long tail
                if claim(n) and not saved(n):  # (claimed first: an item another rank encodes is not read here)
                    encode(n)
            for _ in tensors:
                bar.update(1)
            return None, 0
        added, nxt, deadline = 0, 0, time.monotonic() + distributed.timeout_s()

        def add(encoded) -> None:  # the next tensor into the file
            nonlocal added, deadline
            target.add(tensors[added], encoded)
            added += 1
            bar.update(1)
            deadline = time.monotonic() + distributed.timeout_s()

        while added < len(tensors):
            encoded = complete(added)
            if encoded is not None:
                add(encoded)
                continue
            nxt = max(nxt, of[added][0])
            while nxt < len(items) and not claim(nxt):
                nxt += 1
            if nxt < len(items):
                if not saved(nxt):
                    encoded = encode(nxt)
                    if items[nxt][1] is None and items[nxt][0] == added:  # the next to write: from memory
                        add(encoded)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run.rundir.path}: tensor {tensors[added].gguf_name} not encoded after "
                                   f"{distributed.timeout_s():.0f} s; did the rank that claimed it stop?")
            time.sleep(0.05)
        return target.finish()
    except BaseException:
        if grp.main:
            target.abort()
        raise
    finally:
        bar.close()


def check_distributed(cfg: QuantizeConfig, target: Target) -> None:
    """Several ranks run the stream pipeline to a GGUF file (before any work).

    Raises:
        ValueError: without ``stream``, with the safetensors target, or with ``card``.
    """
    if not cfg.stream:
        raise ValueError("several ranks (torchrun) run the block-by-block pipeline: add --stream")
    if target.name != "gguf":
        raise ValueError("several ranks (torchrun) write GGUF files for now: drop --target safetensors, or run one "
                         "process")
    if cfg.card:
        raise ValueError("several ranks (torchrun) write the model file without --card for now: quantize, then publish "
                         "from one process (dynaquant push), or run one process")
