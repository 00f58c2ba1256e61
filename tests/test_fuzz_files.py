"""Fuzzing the file readers: mutated GGUF models, imatrix files (GGUF and legacy ``.dat``) and safetensors
checkpoints must give a correct result or :class:`dynaquant.errors.InputError` naming the file.

Valid small files are made once per module (a GGUF written by dynaquant's own writer from a tiny random
checkpoint, with F32, F16, Q8_0 and Q4_0 tensors and a tokenizer; the imatrix files of ``tests/data``; the
tiny checkpoint's ``model.safetensors``). Hypothesis strategies mutate them (byte flips, truncation, inserted
garbage, a 32- or 64-bit count or length overwritten with a huge, negative or off-by-a-little value, a
safetensors header length or JSON entry changed) and each example runs the reader path the command line uses
(``inspect_gguf``; ``open_gguf_source`` + every tensor read + the metadata copy; ``load_imatrix`` + ``means``;
``open_hf_source`` + every tensor read; ``is_runtime_checkpoint``).

Each example runs in a forked child process (:func:`_in_child`) with an address-space cap
(``RLIMIT_AS`` = the parent's current virtual size + 2 GiB) and a 10 s ``alarm``, so a hang or a huge
allocation fails the example instead of the machine; the child reports through a pipe: ``ok``,
``input_error`` (the message must name the file) or ``fail`` with the traceback. Settings are derandomized
with bounded ``max_examples`` so CI runs the same examples every time.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import struct
import traceback
from pathlib import Path

import gguf
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dynaquant.analysis.imatrix_io import load_imatrix  # noqa: E402
from dynaquant.errors import InputError  # noqa: E402
from dynaquant.exporters.gguf.inspect import inspect_gguf  # noqa: E402
from dynaquant.exporters.gguf.writer import write_gguf  # noqa: E402
from dynaquant.quant import get_format, quantize  # noqa: E402
from dynaquant.sources.gguf import open_gguf_source  # noqa: E402
from dynaquant.sources.open import open_hf_source  # noqa: E402

DATA = Path(__file__).parent / "data"
TIME_LIMIT_S = 10
MEMORY_HEADROOM = 2 << 30
FUZZ = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------- the child process


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _in_child(probe, path: Path) -> tuple[str, str]:
    """Run ``probe(path)`` in a forked child with a memory cap and a time limit.

    Returns:
        ("ok", "") when it returned, ("input_error", message) for an InputError, ("value_error", message) for
        another ValueError, ("fail", why) for any other exception, a signal (the alarm: a hang) or a child
        that died.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(r)
        try:
            limit = _vm_bytes() + MEMORY_HEADROOM
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
            signal.alarm(TIME_LIMIT_S)
            try:
                probe(path)
                out = ("ok", "")
            except ValueError as e:  # InputError is one; the parent decides which are accepted
                out = ("input_error" if isinstance(e, InputError) else "value_error", str(e))
            except BaseException:  # noqa: BLE001 - reported to the parent, which fails the example
                out = ("fail", traceback.format_exc())
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return "fail", f"child killed by signal {sig}" + (" (the time limit: a hang)" if sig == signal.SIGALRM else "")
    if not chunks:
        return "fail", "child exited without a result"
    kind, msg = json.loads(b"".join(chunks))
    return kind, msg


def _check(probe, path: Path, accept: tuple[str, ...] = ("input_error",)) -> str:
    """Run one example; it must succeed (the probe checked the result) or raise an accepted error naming ``path``."""
    kind, msg = _in_child(probe, path)
    event(kind)
    assert kind == "ok" or kind in accept, msg
    if kind != "ok":
        assert str(path) in msg, f"the error does not name the file: {msg}"
    return kind


# ---------------------------------------------------------------------------------------------- mutations


@st.composite
def mutated(draw, data: bytes, hot: int | None = None) -> bytes:
    """``data`` with one to three mutations; ``hot``: the length of the header region most mutations target."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        n = len(b)
        region = hot if hot is not None and draw(st.booleans()) else n
        region = max(1, min(region, n))
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "u32", "u64"]))
        at = draw(st.integers(0, max(0, region - 1)))
        if kind == "flip" and n:
            b[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del b[at:]
        elif kind == "insert":
            b[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del b[at : at + draw(st.integers(1, 16))]
        else:  # a count, length, type or offset field overwritten
            size, fmt = (4, "<I") if kind == "u32" else (8, "<Q")
            value = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 9, 13, 255, 2**31 - 1, 2**31, 2**32 - 1,
                                                    2**63 - 1, 2**63, 2**64 - 1][: 11 if size == 4 else None]),
                                   st.integers(0, 2 ** (8 * size) - 1)))
            value %= 2 ** (8 * size)
            if at + size <= len(b):
                b[at : at + size] = struct.pack(fmt, value)
    return bytes(b)


def _write(tmp: Path, name: str, data: bytes) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / name
    p.write_bytes(data)
    return p


@functools.cache
def _valid(path: Path) -> tuple[bytes, int]:
    """A valid file's bytes and the length of its header (where most mutations go), read once."""
    raw = path.read_bytes()
    if raw[:4] == b"GGUF":
        return raw, int(gguf.GGUFReader(path).data_offset)
    if path.suffix == ".safetensors":
        return raw, 8 + struct.unpack("<Q", raw[:8])[0]
    return raw, 64


# ---------------------------------------------------------------------------------------------- valid files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama checkpoint folder and a GGUF of it written by dynaquant (mixed types, tokenizer)."""
    from test_gguf_export import _tiny_checkpoint

    root = tmp_path_factory.mktemp("fuzz")
    ckpt = root / "ckpt"
    _tiny_checkpoint(ckpt, "llama", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
    src = open_hf_source(ckpt)
    plan = {}
    for t in src.tensors():
        fmt = {"token_embd.weight": "Q8_0", "blk.0.ffn_down.weight": "Q4_0", "blk.0.attn_q.weight": "F16"}.get(t.gguf_name, "F32")
        plan[t.gguf_name] = get_format(fmt)
    out = root / "tiny.gguf"
    write_gguf(out, src, plan, lambda t, x, fmt: quantize(x, fmt).numpy(), {"dynaquant.source": "models/tiny"},
               file_type=gguf.LlamaFileType.MOSTLY_Q8_0, progress=False)
    return {"ckpt": ckpt, "gguf": out, "root": root}


# ---------------------------------------------------------------------------------------------- probes (run in the child)


def _probe_inspect(path: Path) -> None:
    s = inspect_gguf(path)
    size = os.path.getsize(path)
    assert s.file_size_bytes == size
    for t in s.tensors:
        n = 1
        for d in t.shape:
            n *= d
        assert n == t.n_elements, t
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]]
        assert t.size_bytes == t.n_elements // block * type_bytes <= size, t
    assert s.size_bytes <= size


def _probe_gguf_source(path: Path) -> None:
    src = open_gguf_source(path)
    for t in src.tensors():
        x = src.read(t)
        assert x.dtype == torch.float32 and tuple(x.shape) == t.shape, (t, x.shape)
    w = gguf.GGUFWriter(None, src.arch)
    src.add_metadata(w)


def _probe_imatrix(path: Path) -> None:
    im = load_imatrix(path)
    assert im.sums, "an imatrix without entries was accepted"
    for name in im.names():
        s, c = im.sums[name], im.counts[name]
        assert s.dtype == torch.float64 and torch.isfinite(s).all() and (s >= 0).all(), name
        assert c.dtype == torch.int64 and (c >= 0).all() and tuple(c.shape) == tuple(s.shape[:-1]), name
        m = im.mean(name)
        assert torch.isfinite(m).all() and m.shape == s.shape, name


def _probe_hf_source(folder: Path) -> None:
    src = open_hf_source(folder)
    for t in src.tensors():
        x = src.read(t)
        assert x.dtype == torch.float32 and tuple(x.shape) == t.shape, (t, x.shape)


# ---------------------------------------------------------------------------------------------- GGUF model files


def test_fuzz_baseline_files_are_read(tiny):
    """The unmutated files pass every probe (so the fuzz tests below start from valid files)."""
    runtime = _runtime_folder(tiny, tiny["root"] / "runtime", (tiny["ckpt"] / "model.safetensors").read_bytes())
    for probe, path in [(_probe_inspect, tiny["gguf"]), (_probe_gguf_source, tiny["gguf"]),
                        (_probe_imatrix, DATA / "imatrix_moe.gguf"), (_probe_imatrix, DATA / "imatrix_moe.dat"),
                        (_probe_hf_source, tiny["ckpt"]),
                        (_probe_runtime_load, runtime)]:
        assert _in_child(probe, path) == ("ok", ""), (probe.__name__, path)


@FUZZ
@given(data=st.data())
def test_fuzz_inspect_gguf(tiny, tmp_path_factory, data):
    raw, header = _valid(tiny["gguf"])
    p = _write(tmp_path_factory.mktemp("g"), "bad.gguf", data.draw(mutated(raw, header)))
    _check(_probe_inspect, p)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_source(tiny, tmp_path_factory, data):
    raw, header = _valid(tiny["gguf"])
    p = _write(tmp_path_factory.mktemp("g"), "bad.gguf", data.draw(mutated(raw, header)))
    _check(_probe_gguf_source, p)


# ---------------------------------------------------------------------------------------------- imatrix files


@FUZZ
@given(data=st.data())
def test_fuzz_imatrix_gguf(tmp_path_factory, data):
    raw, header = _valid(DATA / "imatrix_moe.gguf")
    p = _write(tmp_path_factory.mktemp("i"), "bad.gguf", data.draw(mutated(raw, header)))
    _check(_probe_imatrix, p)


@FUZZ
@given(data=st.data())
def test_fuzz_imatrix_dat(tmp_path_factory, data):
    raw, header = _valid(DATA / "imatrix_moe.dat")
    p = _write(tmp_path_factory.mktemp("i"), "bad.dat", data.draw(mutated(raw, header)))
    _check(_probe_imatrix, p)


# ---------------------------------------------------------------------------------------------- safetensors checkpoints


# The HF source's own checks of what the shards hold (names, shapes against config.json) raise ValueError naming
# the folder, which the command line maps to exit 2 as well; the shard files themselves raise InputError.
HF_ACCEPT = ("input_error", "value_error")


def _folder_with(tiny, tmp: Path, shard: bytes) -> Path:
    """A copy of the tiny checkpoint folder (small files linked) whose model.safetensors is ``shard``."""
    folder = tmp / "ckpt"
    folder.mkdir(parents=True)
    for f in tiny["ckpt"].iterdir():
        if f.name != "model.safetensors":
            os.symlink(f, folder / f.name)
    (folder / "model.safetensors").write_bytes(shard)
    return folder


@st.composite
def header_edits(draw, raw: bytes) -> bytes:
    """The safetensors file with one header entry changed (shape, dtype or offsets), the header re-serialized."""
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    entry = header[name]
    what = draw(st.sampled_from(["shape", "dtype", "offsets", "drop"]))
    if what == "shape":
        entry["shape"] = draw(st.one_of(st.just(list(reversed(entry["shape"]))),
                                        st.lists(st.integers(0, 2**40), min_size=0, max_size=4)))
    elif what == "dtype":
        entry["dtype"] = draw(st.sampled_from(["F16", "BF16", "I32", "I8", "U8", "F64", "BOOL", "F8_E4M3", "X"]))
    elif what == "offsets":
        entry["data_offsets"] = draw(st.lists(st.integers(-1, 2**64), min_size=0, max_size=3))
    else:
        del header[name]
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + raw[8 + n :]


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_bytes(tiny, tmp_path_factory, data):
    raw, header = _valid(tiny["ckpt"] / "model.safetensors")
    folder = _folder_with(tiny, tmp_path_factory.mktemp("s"), data.draw(mutated(raw, header)))
    _check(_probe_hf_source, folder, HF_ACCEPT)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header_entries(tiny, tmp_path_factory, data):
    raw, _ = _valid(tiny["ckpt"] / "model.safetensors")
    folder = _folder_with(tiny, tmp_path_factory.mktemp("s"), data.draw(header_edits(raw)))
    _check(_probe_hf_source, folder, HF_ACCEPT)


def _runtime_folder(tiny, tmp: Path, shard: bytes) -> Path:
    """The tiny checkpoint as a compressed-tensors checkpoint with nothing quantized (what ``dynaquant.load``
    reads: config, then every shard tensor), its model.safetensors replaced by ``shard``."""
    folder = _folder_with(tiny, tmp, shard)
    cfg = json.loads((tiny["ckpt"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _probe_runtime_load(folder: Path) -> None:
    from dynaquant import load
    from dynaquant.runtime.loader import is_runtime_checkpoint

    assert is_runtime_checkpoint(folder)
    model = load(folder, device="cpu", kernels=False)
    ref = {k: tuple(v.shape) for k, v in _tiny_state_shapes(folder).items()}
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == ref, "loaded shapes differ from the model's"


@functools.cache
def _tiny_state_shapes(folder: Path) -> dict:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg).state_dict()


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_fuzz_runtime_load(tiny, tmp_path_factory, data):
    raw, header = _valid(tiny["ckpt"] / "model.safetensors")
    edit = data.draw(st.sampled_from([mutated(raw, header), header_edits(raw)]))
    folder = _runtime_folder(tiny, tmp_path_factory.mktemp("r"), data.draw(edit))
    _check(_probe_runtime_load, folder, HF_ACCEPT)


def test_fuzz_harness_catches_hangs_and_huge_allocations(tmp_path):
    """The child process really enforces the limits (else the fuzz tests above could pass a hang)."""
    p = _write(tmp_path, "x", b"x")

    def hang(_):
        signal.alarm(1)
        while True:
            pass

    def allocate(_):
        bytearray(4 * MEMORY_HEADROOM)

    assert _in_child(hang, p)[0] == "fail"
    kind, msg = _in_child(allocate, p)
    assert kind == "fail" and "MemoryError" in msg
    shutil.rmtree(tmp_path)
