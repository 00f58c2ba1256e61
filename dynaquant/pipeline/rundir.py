"""The resumable work directory of a block-by-block run (``quantize --stream --work-dir DIR``).

A run killed at any moment (SIGKILL included) and started again with the same arguments continues from what the
folder holds and writes the same bytes as an uninterrupted run. The folder holds:

- ``run.json``: what the run is (dynaquant version, the source's files with sizes and modification times, the
  calibration text's, the options that change the result). A folder of another run is refused, never reused;
- ``analysis/``: the block-by-block analysis's checkpoints (:mod:`dynaquant.analysis.blockwise`: after each block of
  the forward sweep the hidden states and statistics, each block's Fisher-sequence inputs, after each block of the
  backward sweep the gradients), then ``report.json`` and the imatrix when the analysis is complete;
- ``plan.json``: the plan (for the reader; it is recomputed from the report);
- ``tensors/NNNNN.npy``: each encoded tensor, in the file's tensor order, as it is done (the safetensors target:
  ``tensors/NNNNN.pt``, its runtime encodings, or a weight written as it is, as plain dicts and tensors).

Every file is written under a temporary name and renamed when complete, so a file present is whole. Checkpoints are
``torch.save`` files of plain dicts and tensors, read back with ``weights_only=True`` (no code runs on loading).
The default folder is ``OUTPUT.work`` beside the output, removed after success unless kept (``--keep-work-dir``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from dynaquant.errors import InputError

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
CHECKPOINT_EVERY_S = 60.0  # the block-wise calibration's checkpoint interval (DYNAQUANT_CHECKPOINT_S)


def checkpoint_interval_s() -> float:
    """Seconds between the block-wise calibration's checkpoints of in-memory hidden states (``DYNAQUANT_CHECKPOINT_S``,
    default :data:`CHECKPOINT_EVERY_S`; 0: after every block): a stopped run redoes at most this much calibration.

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    raw = os.environ.get("DYNAQUANT_CHECKPOINT_S", "")
    try:
        v = float(raw) if raw else CHECKPOINT_EVERY_S
    except ValueError:
        v = -1.0
    if not v >= 0:
        raise ValueError(f"DYNAQUANT_CHECKPOINT_S={raw!r}: give seconds, a number >= 0")
    return v


def default_work_dir(output: Path) -> Path:
    """``OUTPUT.work`` beside the output."""
    return output.with_name(output.name + ".work")


def file_identity(path: str | os.PathLike) -> dict:
    """What ``run.json`` records of an input file or folder: each file's relative name, size and modification time
    (nanoseconds); a folder's files sorted by name. Cheap for any size (no content read)."""
    p = Path(path)
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    out = {}
    for q in files:
        st = q.stat()
        out[str(q.relative_to(p)) if p.is_dir() else q.name] = [st.st_size, st.st_mtime_ns]
    return {"path": str(p.resolve()), "files": out}


class RunDir:
    """A resumable work folder (see the module docstring).

    Args:
        path: the folder (created if missing).
        identity: the run's ``run.json`` content (JSON-serialisable).
    Raises:
        InputError: the folder holds another run (its ``run.json`` differs: the first differing key is named), or it
            exists and is not a work folder of dynaquant (no ``run.json``, not empty).
    """

    def __init__(self, path: str | os.PathLike, identity: dict):
        self.path = Path(path)
        self.identity = json.loads(json.dumps(identity))
        run = self.path / RUN_FILE
        if run.is_file():
            try:
                held = json.loads(run.read_text())
            except (OSError, ValueError) as e:
                raise InputError(f"{run}: not readable as a dynaquant run ({e}); remove the folder or give another "
                                 "--work-dir") from e
            if held != self.identity:
                key = _first_difference(held, self.identity)
                raise InputError(f"{self.path}: the work folder of another run (differs in {key}); remove it or give "
                                 "another --work-dir")
            self.resumed = True
            log.warning("%s: resuming the run this work folder holds", self.path)
        else:
            if self.path.exists() and any(self.path.iterdir()):
                raise InputError(f"{self.path}: exists and is not a dynaquant work folder (no {RUN_FILE}); give an "
                                 "empty or new --work-dir")
            self.path.mkdir(parents=True, exist_ok=True)
            self._write(run, json.dumps(self.identity, indent=1, sort_keys=True).encode())
            self.resumed = False

    def file(self, name: str) -> Path:
        """The path of an entry (its folder created)."""
        p = self.path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def save(self, name: str, state: dict) -> None:
        """Write a checkpoint (plain dicts, lists, numbers, strings, tensors) atomically."""
        p = self.file(name)
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
        try:
            torch.save(state, tmp)
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)

    def load(self, name: str, device: str | torch.device = "cpu") -> dict | None:
        """A checkpoint written by :meth:`save` (tensors onto ``device``), or None when absent."""
        p = self.path / name
        if not p.is_file():
            return None
        return torch.load(p, map_location=device, weights_only=True)

    def save_array(self, name: str, a: np.ndarray) -> None:
        """Write a numpy array atomically (``.npy``)."""
        p = self.file(name)
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.save(f, a, allow_pickle=False)
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)

    def load_array(self, name: str) -> np.ndarray | None:
        p = self.path / name
        return np.load(p, allow_pickle=False) if p.is_file() else None

    def write_text(self, name: str, text: str) -> None:
        """Write a small text file atomically."""
        self._write(self.file(name), text.encode())

    def remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def delete(self) -> None:
        """Remove the whole folder (after success)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def _write(self, p: Path, data: bytes) -> None:
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)


def _first_difference(a, b, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{where}.{k}" if where else k)
    return where or "run.json"


class RankCheckpoints:
    """The block-wise calibration's checkpoints of one rank of several (:mod:`dynaquant.distributed`), in ``rundir``'s
    ``analysis/ranks-N/R/``: each rank's hidden states are its own, so a restart must take the same step on every
    rank. A stage checkpoint (forward / head / backward) is step ``k``, written to ``ckpt-{k % 2}.pt`` (the step before
    it stays whole); once every rank has written it (a barrier), rank 0 records ``k`` in ``analysis/ranks-N/commit.json``
    and the ranks go on after a second barrier.
    A restart loads the committed step on every rank; a rank stopped between its write and the commit leaves the
    previous step, whose files are still there. Other names (the Fisher inputs of a block) are written as they are, in
    the rank's folder. Same interface as :class:`RunDir` for :func:`dynaquant.analysis.blockwise.collect_blockwise`.
    """

    STAGES = ("analysis/forward.pt", "analysis/head.pt", "analysis/backward.pt")

    def __init__(self, rundir: RunDir, group):
        self.rundir, self.group = rundir, group
        self.top = f"analysis/ranks-{group.world}"
        self.own = f"{self.top}/{group.rank}"
        commit = rundir.path / self.top / "commit.json"
        self.step = json.loads(commit.read_text())["step"] if commit.is_file() else 0
        self._resume = self.step

    def save(self, name: str, state: dict) -> None:
        if name not in self.STAGES:
            self.rundir.save(f"{self.own}/{name}", state)
            return
        self.step += 1
        self.rundir.save(f"{self.own}/ckpt-{self.step % 2}.pt", {"name": name, "step": self.step, "state": state})
        self.group.barrier()
        if self.group.main:
            self.rundir.write_text(f"{self.top}/commit.json", json.dumps({"step": self.step}))
        self.group.barrier()  # no rank overwrites the step before (its files, its hidden states) until this is committed

    def load(self, name: str, device: str | torch.device = "cpu") -> dict | None:
        if name not in self.STAGES:
            return self.rundir.load(f"{self.own}/{name}", device)
        if self._resume == 0:
            return None
        held = self.rundir.load(f"{self.own}/ckpt-{self._resume % 2}.pt", device)
        if held is None or held["step"] != self._resume:
            raise InputError(f"{self.rundir.path}: rank {self.group.rank}'s checkpoint of step {self._resume} is "
                             "missing; remove the work folder's analysis/ranks-* to restart the calibration")
        return held["state"] if held["name"] == name else None

    def remove(self, name: str) -> None:
        self.rundir.remove(f"{self.own}/{name}")
