"""The transformers config and tokenizer of a GGUF file, kept in a cache folder after their first conversion.

transformers derives a GGUF file's config and tokenizer from its metadata, parsing the whole file's key-value
section with gguf-py's reader each time (3.5 s for SmolLM2-135M's 49 152-token vocabulary on the 2-core CPU box, and
``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` parses it once more for the config before the weights). Here
each is converted once, saved with ``save_pretrained`` into ``CACHE/gguf-hf/KEY/{config,tokenizer}/`` (a temporary
folder renamed into place, so a folder there is whole), and loaded from there on later runs:
``AutoConfig.from_pretrained`` of the saved config is the same config, and the saved ``tokenizer.json`` gives the same
token ids (tested).

KEY is a SHA-256 of the file's resolved path, size and modification time (nanoseconds) and the transformers version:
a file changed in place or another transformers gets a new entry. CACHE is :func:`dynaquant.workdir.cache_root`
(``$DYNAQUANT_CACHE``, else ``$XDG_CACHE_HOME/dynaquant``, else ``~/.cache/dynaquant``); ``DYNAQUANT_CACHE=off`` turns
the cache off, and a cache that cannot be written is skipped (a debug log line), never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from dynaquant.workdir import cache_root

log = logging.getLogger(__name__)


def entry(path: str | os.PathLike) -> Path | None:
    """The cache folder of a GGUF file (it may not exist yet), or None without a cache."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    p = Path(path).resolve()
    st = p.stat()
    key = json.dumps([str(p), st.st_size, st.st_mtime_ns, transformers.__version__])
    return root / "gguf-hf" / hashlib.sha256(key.encode()).hexdigest()[:32]


def cached(path: str | os.PathLike, part: str, convert: Callable[[], object]) -> Path | None:
    """The folder holding ``part`` (``"config"`` or ``"tokenizer"``) of the GGUF file ``path``: from the cache, or
    ``convert()`` (the transformers object read from the file) saved there first. None: no cache, or it cannot be
    written (the caller reads the file itself)."""
    folder = entry(path)
    if folder is None:
        return None
    done = folder / part
    if done.is_dir():
        return done
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{part}-", dir=folder))
    except OSError as exc:
        log.debug("cache %s not writable (%s): %s read from the GGUF file", folder, exc, part)
        return None
    try:
        convert().save_pretrained(tmp)
        os.replace(tmp, done)  # (another process may have put it there first: then theirs stays)
    except OSError as exc:
        log.debug("cache %s: %s not kept (%s)", folder, part, exc)
        return done if done.is_dir() else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return done
