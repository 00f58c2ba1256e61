"""Default calibration and evaluation texts that need no download.

Both are assembled at run time from the Python standard library's own docstrings
(module, class and function docs of a fixed list of pure-Python modules). The modules
are split in two disjoint sets, so calibration and evaluation never share a sentence:
``default_calibration_text()`` uses the first set, ``default_eval_text()`` the second.
Deterministic for a given Python version.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from functools import lru_cache
from pathlib import Path

# Pure-Python modules with rich docstrings and no import side effects.
_CALIBRATION_MODULES = (
    "argparse", "asyncio", "collections", "configparser", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools",
    "http.client", "importlib", "inspect", "ipaddress", "json", "logging", "mailbox",
    "pathlib", "pickle", "shutil", "socket", "string", "subprocess", "tarfile", "threading",
    "typing", "unittest", "urllib.parse", "zipfile",
)
_EVAL_MODULES = (
    "abc", "ast", "base64", "bisect", "calendar", "codecs", "copy", "dis", "doctest",
    "fnmatch", "ftplib", "getopt", "gettext", "glob", "heapq", "hmac", "imaplib", "io",
    "locale", "numbers", "operator", "optparse", "os", "pdb", "platform", "pprint",
    "queue", "random", "re", "sched", "selectors", "shlex", "smtplib", "statistics",
    "tempfile", "textwrap", "tokenize", "trace", "traceback", "uuid", "wave", "weakref",
)


def _module_text(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except ImportError:  # a module missing from a trimmed Python
        return ""
    parts = []
    doc = inspect.getdoc(mod)
    if doc:
        parts.append(doc)
    for attr in sorted(vars(mod)):
        if attr.startswith("_"):
            continue
        obj = getattr(mod, attr)
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(f"{attr}: {doc}")
            if inspect.isclass(obj):
                for mname in sorted(vars(obj)):
                    m = vars(obj)[mname]
                    mdoc = inspect.getdoc(m) if inspect.isfunction(m) and not mname.startswith("_") else None
                    if mdoc and len(mdoc) > 80:
                        parts.append(f"{attr}.{mname}: {mdoc}")
    return "\n\n".join(parts)


@lru_cache(maxsize=2)
def _assemble(modules: tuple[str, ...]) -> str:
    with warnings.catch_warnings():  # some modules warn on attribute access (typing.io)
        warnings.simplefilter("ignore")
        return "\n\n".join(t for t in (_module_text(m) for m in modules) if t)


def default_calibration_text() -> str:
    """Calibration text: docstrings of one half of a fixed list of stdlib modules (str, ~1 MB)."""
    return _assemble(_CALIBRATION_MODULES)


def default_eval_text() -> str:
    """Evaluation text: docstrings of the other half, minus any paragraph the calibration text has."""
    seen = set(default_calibration_text().split("\n\n"))
    return "\n\n".join(p for p in _assemble(_EVAL_MODULES).split("\n\n") if p not in seen)


def read_text(path: str | Path | None, default) -> tuple[str, str]:
    """Read a UTF-8 text file, or call ``default()`` when path is None.

    Returns:
        (text, text_id): text_id names the file, or ``stdlib-docstrings:<kind>`` for a default.
    Raises:
        ValueError: the file is missing, unreadable, not UTF-8 or empty (the message names it).
    """
    if path is None:
        return default(), f"stdlib-docstrings:{default.__name__.split('_')[1]}"
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: cannot read text: {exc}") from exc
    if not text.strip():
        raise ValueError(f"{p}: the text file is empty")
    return text, str(p)
