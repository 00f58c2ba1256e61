"""``quantize --stream --work-dir``: a run killed with SIGKILL mid-analysis or mid-encode and started again with the
same arguments writes the bytes of an uninterrupted run; a work folder of another run is refused; the default
folder is removed after success."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_moe_gguf import _tiny_moe

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--stream", "--bpw", "6.5", "--calibration-chunks", "4", "--ctx", "32", "--no-eval", "--device", "cpu",
        "--json"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume") / "ckpt"
    _tiny_moe(folder, "qwen2moe")
    return folder


def _proc(args: list[str], cwd: Path, slow: str = "") -> subprocess.Popen:
    """``dynaquant quantize ARGS`` in a child; ``slow``: "blocks" sleeps 0.7 s in each block of the block-wise
    calibration, "encode" 0.7 s before each tensor's encoding."""
    code = ("import sys, time\n"
            "import dynaquant.analysis.blockwise as b, dynaquant.pipeline.targets as t\n"
            f"if {slow!r} == 'blocks':\n"
            "    real = b._hidden\n"
            "    b._hidden = lambda out: (time.sleep(0.7), real(out))[1]\n"
            f"if {slow!r} == 'encode':\n"
            "    enc = t.encode_tensor\n"
            "    t.encode_tensor = lambda *a, **k: (time.sleep(0.7), enc(*a, **k))[1]\n"
            "from dynaquant.cli import main\n"
            "sys.exit(main(['quantize', *sys.argv[1:]]))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "DYNAQUANT_CHECKPOINT_S": "0"}  # (a checkpoint after every block: the kill comes after the first)
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    p = _proc(args, cwd)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def _kill_when(p: subprocess.Popen, ready, timeout_s: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if ready():
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
            return
        if p.poll() is not None:
            pytest.fail(f"the run ended before it was killed: {p.communicate()}")
        time.sleep(0.05)
    p.kill()
    pytest.fail("the run never reached the point to kill it at")


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory):
    """An uninterrupted run (its work folder kept) and the bytes it wrote."""
    cwd = tmp_path_factory.mktemp("ref")
    _run([str(ckpt), *ARGS, "-o", "ref.gguf", "--work-dir", "w", "--keep-work-dir"], cwd)
    return cwd, (cwd / "ref.gguf").read_bytes()


def test_uninterrupted_runs_are_byte_identical_and_clean_up(ckpt, reference, tmp_path):
    cwd, want = reference
    assert (cwd / "w" / "run.json").is_file() and len(list((cwd / "w" / "tensors").iterdir())) > 10  # kept
    _run([str(ckpt), *ARGS, "-o", "again.gguf"], tmp_path)
    assert (tmp_path / "again.gguf").read_bytes() == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.gguf"]  # the default work folder is gone


@pytest.mark.parametrize("where", ["analysis", "encode"])
def test_sigkill_then_rerun_writes_the_same_bytes(ckpt, reference, tmp_path, where):
    _, want = reference
    work = tmp_path / "w"
    args = [str(ckpt), *ARGS, "-o", "out.gguf", "--work-dir", str(work)]
    p = _proc(args, tmp_path, slow="blocks" if where == "analysis" else "encode")
    if where == "analysis":  # after the first block's checkpoint, before the forward sweep ends
        _kill_when(p, lambda: (work / "analysis" / "forward.pt").is_file())
        assert not (work / "analysis" / "head.pt").exists()
    else:  # a few tensors encoded
        _kill_when(p, lambda: (work / "tensors").is_dir() and len(list((work / "tensors").glob("*.npy"))) >= 3)
    assert not (tmp_path / "out.gguf").exists()  # no output until complete
    res = _run(args, tmp_path)
    assert "resuming" in res.stderr
    assert (tmp_path / "out.gguf").read_bytes() == want
    assert not work.exists()


def test_work_dir_of_another_run_is_refused(ckpt, reference, tmp_path):
    cwd, _ = reference
    p = _proc([str(ckpt), *[a if a != "6.5" else "6.0" for a in ARGS], "-o", "x.gguf", "--work-dir", str(cwd / "w")],
              tmp_path)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "work folder of another run" in err and "bpw" in err, err
    assert not (tmp_path / "x.gguf").exists()


def test_hidden_states_in_files_beyond_max_cpu_memory(ckpt, reference, tmp_path):
    """--max-cpu-memory below the hidden states' size: they go to files (the work folder's offload/), same bytes."""
    _, want = reference
    _run([str(ckpt), *ARGS, "-o", "out.gguf", "--max-cpu-memory", "1KiB", "--work-dir", "w", "--keep-work-dir"],
         tmp_path)
    assert (tmp_path / "out.gguf").read_bytes() == want
    assert sorted(p.name for p in (tmp_path / "w" / "offload").iterdir()) == ["hidden-0", "hidden-1", "hidden-in"]


def test_max_gpu_memory_refuses_a_block_that_does_not_fit(ckpt):
    from dynaquant.errors import InputError
    from dynaquant.pipeline.analyze_blocks import memory_plan
    from dynaquant.sources.checkpoint import resolve_source
    from dynaquant.sources.open import open_hf_source
    from dynaquant.sources.skeleton import build_skeleton

    sk = build_skeleton(resolve_source(str(ckpt)), open_hf_source(ckpt), device="cuda")  # nothing materialized
    need = sk.part_bytes("outer") + max(sk.part_bytes(i) for i in range(sk.n_blocks))
    kw = dict(max_cpu_memory=None, offload_dir=None, checkpoints=False)
    assert memory_plan(sk, 4, 32, 2, max_gpu_memory=need, **kw) is None
    with pytest.raises(InputError, match="do not fit --max-gpu-memory"):
        memory_plan(sk, 4, 32, 2, max_gpu_memory=need - 1, **kw)
    with pytest.raises(InputError, match="give --offload-dir"):
        memory_plan(sk, 4, 32, 2, max_gpu_memory=None, **{**kw, "max_cpu_memory": 1})
