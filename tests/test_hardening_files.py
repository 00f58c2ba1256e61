"""Corrupt or missing input files end in exit status 2 and one line on stderr naming the file and the problem
(issue 13, defect 4): damaged safetensors shards, damaged GGUF models (``inspect``, ``eval``, ``quantize``), a
GGUF whose counts would make gguf-py loop for ever, a missing ``--imatrix``, and ``dynaquant.load`` on a
checkpoint with a damaged shard or index."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

import dynaquant
from dynaquant.cli import main
from dynaquant.errors import InputError
from dynaquant.exporters.gguf.writer import write_gguf
from dynaquant.quant import get_format, quantize
from dynaquant.sources.open import open_hf_source


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama checkpoint folder and a Q8_0/F32 GGUF of it (dynaquant's writer, with a tokenizer)."""
    from test_gguf_export import _tiny_checkpoint

    root = tmp_path_factory.mktemp("hardening")
    ckpt = root / "ckpt"
    _tiny_checkpoint(ckpt, "llama", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
    src = open_hf_source(ckpt)
    plan = {t.gguf_name: get_format("Q8_0" if t.quantizable else "F32") for t in src.tensors()}
    out = root / "tiny.gguf"
    write_gguf(out, src, plan, lambda t, x, fmt: quantize(x, fmt).numpy(), {"dynaquant.source": str(ckpt)},
               file_type=gguf.LlamaFileType.MOSTLY_Q8_0, progress=False)
    return {"ckpt": ckpt, "gguf": out}


def _exit_2(capsys, argv: list[str], *needles: str) -> str:
    """Run the command line; it must exit 2 with one stderr line holding every needle and no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # tqdm bars aside
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _folder_with_shard(tiny, tmp_path: Path, shard: bytes) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny["ckpt"], folder)
    (folder / "model.safetensors").write_bytes(shard)
    return folder


def _gguf_key_offset(path: Path, key: str) -> int:
    """Offset of a key/value pair's value type field (after the key string)."""
    return int(gguf.GGUFReader(path).fields[key].offset) + 8 + len(key)


@pytest.mark.parametrize("damage, reason", [
    ("truncated", "incomplete metadata"),
    ("json", "invalid JSON in header"),
    ("header_length", "header too large"),
])
def test_damaged_safetensors_shard_exits_2_naming_it(tiny, tmp_path, capsys, damage, reason):
    raw = (tiny["ckpt"] / "model.safetensors").read_bytes()
    shard = {"truncated": raw[: len(raw) // 2], "json": raw[:8] + b"x" + raw[9:],
             "header_length": struct.pack("<Q", 2**62) + raw[8:]}[damage]
    folder = _folder_with_shard(tiny, tmp_path, shard)
    out = tmp_path / "out.gguf"
    _exit_2(capsys, ["quantize", str(folder), "--preset", "Q8_0", "-o", str(out), "--no-eval"],
            str(folder / "model.safetensors"), reason)
    assert not out.exists()


def test_damaged_gguf_exits_2_naming_it_in_eval_inspect_and_quantize(tiny, tmp_path, capsys):
    raw = tiny["gguf"].read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(raw[:5000])
    # eval: before, gguf-py's message alone ("GGUF magic invalid", a numpy dtype message), without the file
    _exit_2(capsys, ["eval", str(bad), "--reference", str(tiny["ckpt"]), "--device", "cpu"], str(bad), "truncated")
    _exit_2(capsys, ["inspect", str(bad)], str(bad), "runs past the end of the file")
    _exit_2(capsys, ["quantize", str(bad), "--preset", "Q8_0", "-o", str(tmp_path / "o.gguf"), "--no-eval"], str(bad))
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("not a GGUF file\n" * 4)
    _exit_2(capsys, ["eval", str(not_gguf), "--reference", str(tiny["ckpt"]), "--device", "cpu"], str(not_gguf),
            "not a GGUF file")


def test_gguf_counts_beyond_the_file_are_refused_before_reading(tiny, tmp_path, capsys):
    """An array length of 2^40 over UINT8 made gguf-py loop for ever (growing without bound); a tensor count of
    2^62 raised IndexError with a traceback. Both are refused from the header walk, naming the file."""
    at = _gguf_key_offset(tiny["gguf"], "tokenizer.ggml.token_type")
    b = bytearray(tiny["gguf"].read_bytes())
    assert struct.unpack_from("<II", b, at) == (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    struct.pack_into("<IQ", b, at + 4, gguf.GGUFValueType.UINT8, 2**40)
    hang = tmp_path / "hang.gguf"
    hang.write_bytes(bytes(b))
    # in a child process with a time limit and a memory cap: were the check gone, this would hang the test run
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    run = subprocess.run([sys.executable, "-m", "dynaquant.cli", "inspect", str(hang)], capture_output=True, text=True,
                         timeout=180, preexec_fn=cap, env={**os.environ, "PYTHONPATH": str(Path(dynaquant.__file__).parents[1])})
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert str(hang) in run.stderr and "'tokenizer.ggml.token_type': 1099511627776 elements" in run.stderr, run.stderr

    b = bytearray(tiny["gguf"].read_bytes())
    struct.pack_into("<Q", b, 8, 2**62)
    count = tmp_path / "count.gguf"
    count.write_bytes(bytes(b))
    _exit_2(capsys, ["inspect", str(count)], str(count), f"tensor count {2**62}")


def test_missing_imatrix_exits_2_naming_it(tiny, tmp_path, capsys):
    missing = tmp_path / "missing.dat"
    line = _exit_2(capsys, ["quantize", str(tiny["gguf"]), "--preset", "Q4_K_M", "--imatrix", str(missing),
                            "-o", str(tmp_path / "o.gguf"), "--no-eval"], "No such file")
    assert line.startswith(f"dynaquant quantize: error: {missing}: "), line  # the file first, as every message


def test_runtime_load_refuses_damaged_shard_and_index(tiny, tmp_path, capsys):
    from dynaquant import load
    from dynaquant.runtime.loader import is_runtime_checkpoint

    raw = (tiny["ckpt"] / "model.safetensors").read_bytes()
    folder = _folder_with_shard(tiny, tmp_path, raw[: len(raw) // 2])
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert is_runtime_checkpoint(folder)
    with pytest.raises(InputError, match="model.safetensors: not a valid safetensors file"):
        load(folder, device="cpu", kernels=False)
    _exit_2(capsys, ["eval", str(folder), "--reference", str(tiny["ckpt"]), "--device", "cpu"],
            str(folder / "model.safetensors"), "not a valid safetensors file")
    # a shard whose header swaps a tensor's dimensions (same bytes): was loaded as is, failing only when run
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["model.embed_tokens.weight"]["shape"] = header["model.embed_tokens.weight"]["shape"][::-1]
    body = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    with pytest.raises(InputError, match=r"model\.safetensors: tensor model\.embed_tokens\.weight has shape \[32, 320\]"):
        load(folder, device="cpu", kernels=False)
    (folder / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(InputError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
        load(folder, device="cpu", kernels=False)
    (folder / "config.json").write_text("[]")  # valid JSON, not an object: not a checkpoint, no AttributeError
    assert not is_runtime_checkpoint(folder)
