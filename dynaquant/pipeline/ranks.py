"""The tensor loop and the option checks of a run over several ranks (``torchrun -m dynaquant quantize --stream``;
:mod:`dynaquant.distributed`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dynaquant import distributed
from dynaquant.config import QuantizeConfig
from dynaquant.pipeline.run_state import RunState
from dynaquant.pipeline.targets import Target
from dynaquant.progress import stage_bar


def encode_planned(run: RunState, target: Target, t):
    """Tensor ``t`` read, GPTQ-rounded where the run asks and it wins, and encoded: what the tensor loops hand to
    ``target`` (one process's :func:`dynaquant.pipeline.quantize.write_output` and :func:`write_output_ranks`)."""
    w = target.read(t)
    rounded = target.gptq_round(t, w) if run.rounding is not None else None
    return target.encode(t, w, rounded)


def tensor_bar(run: RunState, label: str, n: int):
    """The tensor loop's progress: the run's display (its ``writing`` stage) when it has one, else a bar of its own."""
    if run.progress is not None:
        bar = stage_bar(run.progress, "writing", n, "tensor")
        bar.set_description(label)
        return bar
    return stage_bar(run.cfg.progress, label, n, "tensor")


def write_output_ranks(run: RunState, target: Target, path: Path) -> tuple[Path, int] | tuple[None, int]:
    """The tensor loop over several ranks. Each tensor is encoded by the rank that claims it first (a file created
    exclusively in the work folder's ``claims/``), kept in the work folder (``target.save_encoded``; a resumed run's
    encodings are kept and not claimed again): the ranks other than 0 claim tensors in order while any is left; rank 0
    writes the output from the work folder in order, each tensor as soon as it is there, and claims and encodes the
    earliest unclaimed one whenever the next to write is not there yet. The encoding of a tensor does not depend on
    who makes it: the bytes are the single process's. Returns what :func:`dynaquant.pipeline.quantize.write_output`
    returns on rank 0, ``(None, 0)`` on the others.

    Raises:
        TimeoutError: (rank 0) a tensor claimed by another rank is not in the work folder after the process group's
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
    bar = tensor_bar(run, target.progress_label() if grp.main else "encoding", len(tensors))
    claimed = [False] * len(tensors)

    def claim(i: int) -> bool:
        if claimed[i]:
            return False
        claimed[i] = True
        try:
            os.close(os.open(claims / f"{i:05d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def encode(i: int):
        encoded = encode_planned(run, target, tensors[i])
        target.save_encoded(run.rundir, i, encoded)
        return encoded

    try:
        if not grp.main:
            for i in range(len(tensors)):  # (claimed first: a tensor another rank encodes is not read here)
                if claim(i) and not target.load_encoded(run.rundir, i)[0]:
                    encode(i)
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
            done, encoded = target.load_encoded(run.rundir, added)
            if done:
                add(encoded)
                continue
            nxt = max(nxt, added)
            while nxt < len(tensors) and not claim(nxt):
                nxt += 1
            if nxt < len(tensors):
                if not target.load_encoded(run.rundir, nxt)[0]:
                    encoded = encode(nxt)
                    if nxt == added:  # the next to write: from memory, not read back
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
