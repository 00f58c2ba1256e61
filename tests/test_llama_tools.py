"""tests/llama_tools.py: the pinned llama.cpp's tools are found where the build puts them, in a fixed order."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import llama_tools
import pytest


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_pinned_version_is_the_dev_extras_exact_pin(tmp_path):
    """The version comes from pyproject.toml's ``llama-cpp-python==`` pin (an exact one: a range would let a new
    llama.cpp change the preset tables); a pyproject without a pin is refused, naming the file."""
    text = (llama_tools.REPO / "pyproject.toml").read_text()
    (pin,) = re.findall(r"llama-cpp-python==([\w.]+)", text)
    assert llama_tools.pinned_version() == pin
    assert re.fullmatch(r"\d+\.\d+\.\d+", pin)
    bad = tmp_path / "pyproject.toml"
    bad.write_text('dev = ["llama-cpp-python>=0.3.16"]\n')
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        llama_tools.pinned_version(bad)


def test_installed_llama_cpp_python_is_the_pinned_version():
    """The llama_cpp the tests import (its ggml encoders are the codecs' reference) is the pinned one."""
    llama_cpp = pytest.importorskip("llama_cpp")
    assert llama_cpp.__version__ == llama_tools.pinned_version()


def test_find_tool_order_env_then_cache_then_path(tmp_path, monkeypatch):
    """$LLAMA_QUANTIZE wins, then the build of the pinned version under $XDG_CACHE_HOME, then PATH; None when
    there is none (or when the variable names a file that is not there: no silent fallback to another binary)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.delenv("LLAMA_QUANTIZE", raising=False)
    assert llama_tools.find_tool("llama-quantize") is None

    on_path = _exe(tmp_path / "path" / "llama-quantize")
    assert llama_tools.find_tool("llama-quantize") == on_path

    cached = _exe(tmp_path / "cache" / "dynaquant" / f"llama.cpp-{llama_tools.pinned_version()}" / "bin" / "llama-quantize")
    assert llama_tools.bin_dir() == cached.parent
    assert llama_tools.find_tool("llama-quantize") == cached
    assert llama_tools.find_tool("llama-perplexity") is None

    named = _exe(tmp_path / "elsewhere" / "my-quantize")
    monkeypatch.setenv("LLAMA_QUANTIZE", str(named))
    assert llama_tools.find_tool("llama-quantize") == named
    monkeypatch.setenv("LLAMA_QUANTIZE", str(tmp_path / "missing"))
    assert llama_tools.find_tool("llama-quantize") is None

    monkeypatch.delenv("LLAMA_QUANTIZE")
    os.chmod(cached, 0o644)  # not executable: not a tool
    assert llama_tools.find_tool("llama-quantize") == on_path


def test_build_skips_tools_already_built(tmp_path, monkeypatch):
    """A tool already in bin_dir is not rebuilt: nothing is installed, downloaded or compiled."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _exe(llama_tools.bin_dir() / "llama-quantize")

    def fail(*a, **k):
        raise AssertionError("nothing should run")

    monkeypatch.setattr(llama_tools, "_run", fail)
    monkeypatch.setattr(llama_tools, "_ensure_installed", fail)
    monkeypatch.setattr(llama_tools, "_download_sdist", fail)
    assert llama_tools.build(("llama-quantize",)) == llama_tools.bin_dir()


def test_built_llama_quantize_is_the_pinned_llama_cpp(tmp_path):
    """The llama-quantize the preset tests use runs (its libraries found) and is the llama.cpp commit of the pin."""
    import subprocess

    exe = llama_tools.find_tool("llama-quantize")
    if exe is None:
        pytest.skip("llama-quantize not found (build it: python tests/llama_tools.py)")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert "usage:" in r.stdout + r.stderr and "--dry-run" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    # the build info is printed before the model is opened: a missing file gives it and then fails
    r = subprocess.run([str(exe), "--dry-run", str(tmp_path / "missing.gguf"), "Q4_K_M"], capture_output=True, text=True,
                       timeout=60)
    m = re.search(r"version: .*commit (\w+)\)", r.stdout + r.stderr)
    assert m is not None, (r.stdout + r.stderr)[-2000:]
    assert m.group(1) == llama_tools.LLAMA_CPP_COMMIT


@pytest.mark.parametrize("installed", [None, "0.3.16", "PIN"])
def test_ensure_installed_installs_the_pin_only_when_needed(installed, monkeypatch):
    """Another or no llama-cpp-python: the pin is installed by requirement, built portable (GGML_NATIVE off, pip's
    wheel cache bypassed so that a native wheel is not reused); the pinned version already installed: nothing is
    installed."""
    pin = llama_tools.pinned_version()
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(llama_tools, "_installed_version", lambda: pin if installed == "PIN" else installed)
    ran = []
    monkeypatch.setattr(llama_tools, "_run", lambda cmd, **kw: ran.append((cmd, kw.get("env", {}).get("CMAKE_ARGS"))))
    monkeypatch.setattr(llama_tools.importlib.metadata, "distribution", lambda name: name)
    assert llama_tools._ensure_installed(pin) == "llama-cpp-python"
    if installed == "PIN":
        assert ran == []
    else:
        assert ran == [([llama_tools.sys.executable, "-m", "pip", "install", "--no-cache-dir", f"llama-cpp-python=={pin}"],
                        "-DGGML_NATIVE=OFF")]


def test_unpack_takes_only_llama_cpp_headers_common_and_the_tools(tmp_path):
    """From the sdist, only vendor/llama.cpp's include/, ggml/include/, common/ and the asked tools' folders come
    out, relative to llama.cpp's root; other folders and members outside vendor/llama.cpp stay in the archive."""
    import io
    import tarfile

    top = "llama_cpp_python-9.9.9"
    names = [f"{top}/vendor/llama.cpp/{n}" for n in (
        "include/llama.h", "ggml/include/ggml.h", "common/common.h", "common/parsers/x.cpp", "tools/quantize/quantize.cpp",
        "tools/perplexity/perplexity.cpp", "src/llama.cpp", "ggml/src/ggml.c", "include-not/x.h")]
    names += [f"{top}/llama_cpp/llama.py", f"{top}/include/llama.h", "other/vendor/llama.cpp/common/evil.h"]
    sdist = tmp_path / "s.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for i, n in enumerate(names):
            data = f"{i}\n".encode()
            info = tarfile.TarInfo(n)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    dest = llama_tools._unpack_llama_cpp(sdist, tmp_path / "out", ["quantize"])
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["common/common.h", "common/parsers/x.cpp", "ggml/include/ggml.h", "include/llama.h",
                   "tools/quantize/quantize.cpp"]
    assert (dest / "include" / "llama.h").read_text() == "0\n"
