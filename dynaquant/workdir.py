"""The work folder of a run: where an output's temporary files live until the output is complete.

Every writer of dynaquant (GGUF, safetensors checkpoint, imatrix, JSON and HTML) writes into a work folder
beside its output, ``.<output name>.<pid>.<hex>.dynaquant-work/``, and renames the finished file or folder
onto the output (an atomic ``os.replace``: the work folder is in the output's own folder, so on its file
system). :func:`run_workdir` creates that folder and removes it however the run ends (success, error,
Ctrl-C, SIGTERM through the command line's handler). A run killed with SIGKILL cannot clean up: the next run
with the same output removes the work folders (and the ``.<output name>.<pid>.<hex>.tmp`` files of earlier
dynaquant versions) whose process is no longer alive (:func:`remove_stale`). The pid in the name is what
tells a dead run's leftovers from a concurrent live run's.

A later resumable ``--work-dir`` extends this: a work folder given by the user, kept on failure, passed to
the writers as their ``work_dir`` argument.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dynaquant.errors import InputError

log = logging.getLogger(__name__)

WORK_SUFFIX = ".dynaquant-work"
# what follows ".<output name>." in the name of a temporary entry: pid, random hex, kind
_TAIL = re.compile(r"^(?P<pid>\d+)\.[0-9a-f]+(?:\.tmp|" + re.escape(WORK_SUFFIX) + r")$")


CACHE_ENV = "DYNAQUANT_CACHE"


def cache_root() -> Path | None:
    """dynaquant's cache folder: ``$DYNAQUANT_CACHE``, else ``$XDG_CACHE_HOME/dynaquant``, else
    ``~/.cache/dynaquant`` (it may not exist yet); None when ``DYNAQUANT_CACHE=off`` (or ``0`` or empty)."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("off", "0", "") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dynaquant"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (a process of another user counts as alive)."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def is_temporary(name: str) -> bool:
    """Whether a file or folder name is one of dynaquant's temporary entries, of a live or a dead run:
    ``.<output name>.<pid>.<hex>.dynaquant-work`` (a work folder) or ``.<output name>.<pid>.<hex>.tmp``."""
    if not name.startswith("."):
        return False
    # ".<output name>." then the tail; the output name may itself hold dots: try each split
    return any(_TAIL.match(name[i + 1:]) for i in range(1, len(name)) if name[i] == ".")


def stale_entries(output: str | os.PathLike) -> list[Path]:
    """Temporary files and work folders of ``output`` left by runs whose process is gone (oldest name first)."""
    output = Path(output)
    parent = output.parent
    if not parent.is_dir():
        return []
    prefix = f".{output.name}."
    out = []
    try:
        names = sorted(e.name for e in os.scandir(parent) if e.name.startswith(prefix))
    except OSError:
        return []
    for name in names:
        m = _TAIL.match(name[len(prefix):])
        if m is not None and not pid_alive(int(m.group("pid"))):
            out.append(parent / name)
    return out


def remove_stale(output: str | os.PathLike) -> list[Path]:
    """Remove what :func:`stale_entries` finds; returns the paths removed (entries that cannot be removed are logged)."""
    removed = []
    for p in stale_entries(output):
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError as exc:
            log.warning("%s: cannot remove a stale temporary file of an earlier run: %s", p, exc)
            continue
        log.info("%s: removed a stale temporary file of an earlier run", p)
        removed.append(p)
    return removed


@contextmanager
def run_workdir(output: str | os.PathLike) -> Iterator[Path]:
    """A fresh work folder for ``output``, in ``output``'s folder (created if needed), removed on exit.

    Stale work folders of ``output`` (:func:`remove_stale`) are removed first.

    Yields:
        The folder, ``<output folder>/.<output name>.<pid>.<hex>.dynaquant-work``; a file written there
        can be moved onto ``output`` with ``os.replace`` (same file system).
    Raises:
        OSError: the folder cannot be created (unwritable or missing parent).
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(output)
    work = output.parent / f".{output.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{WORK_SUFFIX}"
    work.mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def writing(output: str | os.PathLike) -> Iterator[None]:
    """Turn an OSError raised while writing ``output`` (or its temporary file) into an InputError naming ``output``.

    The temporary file's name means nothing to the user; the output's does. A full disk (ENOSPC, or numpy's
    errno-less ``... requested and ... written``), a file size limit (EFBIG), an unwritable or vanished folder
    all end here.
    """
    try:
        yield
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        if exc.errno is None and "requested and" in str(exc):  # numpy's tofile: no errno
            why = f"the disk is full or a file size limit was reached ({exc})"
        raise InputError(f"{output}: cannot write: {why}") from exc
