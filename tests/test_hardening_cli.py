"""The command line's exit-code contract, output paths checked before any work, free disk space, temporary files.

Issue 13, defects 2, 4 (unwritable folder, full disk, Ctrl-C), 6 (temporary files, --save-plan) and 8 (late
failures). Every case runs on a tiny random checkpoint (two layers, hidden size 64); the subprocess cases run
the real command line.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest

from dynaquant import cli
from dynaquant.errors import InputError
from dynaquant.pipeline.preflight import Output, check_outputs, tensor_bytes_bound
from dynaquant.workdir import WORK_SUFFIX, pid_alive, run_workdir, stale_entries

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Llama checkpoint folder, the same model as an F32 GGUF file)."""
    from test_gguf_export import _tiny_checkpoint, all_f32, encode

    from dynaquant.exporters.gguf.writer import write_gguf
    from dynaquant.sources.open import open_hf_source

    d = tmp_path_factory.mktemp("tiny")
    _tiny_checkpoint(d / "ckpt", "llama")
    src = open_hf_source(d / "ckpt")
    write_gguf(d / "tiny.gguf", src, all_f32(src), encode, {}, file_type=gguf.LlamaFileType.ALL_F32, progress=False)
    return d / "ckpt", d / "tiny.gguf"


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a pipeline loads a model (the checks must come first)."""
    import dynaquant.pipeline.analyze
    import dynaquant.pipeline.evaluate
    import dynaquant.pipeline.quantize

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the outputs were checked")

    for mod in (dynaquant.pipeline.quantize, dynaquant.pipeline.analyze, dynaquant.pipeline.evaluate):
        monkeypatch.setattr(mod, "load_model", refuse)


@pytest.fixture(autouse=True)
def _keep_sigterm():
    """``cli.main`` installs a SIGTERM handler; give the test process its own back."""
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def _digest(p: Path) -> bytes:
    return p.read_bytes() if p.is_file() else b"".join(f.read_bytes() for f in sorted(p.iterdir()))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# --- the option parser: numbers no run can use are refused with the option named, exit 2 ------------------------

@pytest.mark.parametrize("args, option", [
    (["quantize", "--bpw", "inf"], "--bpw"), (["quantize", "--bpw", "1e308"], "--bpw"), (["quantize", "--bpw", "nan"], "--bpw"),
    (["quantize", "--bpw", "-1"], "--bpw"), (["quantize", "--bpw", "0"], "--bpw"), (["quantize", "--bpw", "33"], "--bpw"),
    (["quantize", "--size", "0"], "--size"), (["quantize", "--size=-5MB"], "--size"), (["quantize", "--size", "1e400"], "--size"),
    (["quantize", "--size", "1e30GB"], "--size"), (["quantize", "--size", "lots"], "--size"),
    (["quantize", "--ctx", "0"], "--ctx"), (["quantize", "--chunks", "0"], "--chunks"),
    (["quantize", "--calibration-chunks", "0"], "--calibration-chunks"), (["quantize", "--gptq-damp", "nan"], "--gptq-damp"),
    (["plan", "r.json", "--bpw", "inf"], "--bpw"), (["plan", "r.json", "--size", "0"], "--size"),
    (["analyze", "--sequences", "0"], "--sequences"), (["analyze", "--ctx", "-3"], "--ctx"),
    (["analyze", "--fisher-sequences", "-1"], "--fisher-sequences"), (["eval", "q.gguf", "--ctx", "0"], "--ctx"),
    (["eval", "q.gguf", "--chunks", "0"], "--chunks"),
])
def test_option_parser_refuses_unusable_numbers(args, option, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"argument {option}" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"dynaquant {args[0]}: error: argument {option}")


def test_option_parser_keeps_good_numbers():
    assert cli._size("95MB") == 95_000_000 and cli._size("1.5GiB") == int(1.5 * 2**30) and cli._size("123") == 123
    assert cli._size("80_000_000") == 80_000_000 and cli._size("2KiB") == 2048
    assert cli._bpw("4.5") == 4.5 and cli._bpw("32") == 32.0
    a = cli._parser().parse_args(["quantize", "--ctx", "64", "--chunks", "3", "--calibration-chunks", "2"])
    assert (a.ctx, a.chunks, a.calibration_chunks) == (64, 3, 2)


@pytest.mark.parametrize("kw", [dict(bpw=float("inf")), dict(bpw=1e308), dict(bpw=float("nan")), dict(bpw=0.0),
                                dict(bpw=-2.0), dict(size=0), dict(size=-1), dict(size=float("inf")), dict(size=1e400)])
def test_library_refuses_unusable_budgets_before_any_work(kw, monkeypatch):
    import dynaquant.pipeline.plan
    import dynaquant.pipeline.quantize
    from dynaquant import make_dynamic_plan, quantize

    def refuse(*a, **k):
        raise AssertionError("the source was opened before the budget was checked")

    monkeypatch.setattr(dynaquant.pipeline.quantize, "resolve_source", refuse)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"^{name}=") as e:
        quantize("anything", **kw)
    assert isinstance(e.value, InputError)
    with pytest.raises(ValueError, match=f"^{name}="):
        quantize("anything", target="safetensors", **kw)
    monkeypatch.setattr(dynaquant.pipeline.plan, "get_format", refuse)
    with pytest.raises(ValueError, match=f"^{name}="):
        make_dynamic_plan({"tensors": []}, **kw)


# --- the exit-code contract -------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc, rc, line", [
    (InputError("m.gguf: GGUF magic invalid"), 2, "dynaquant inspect: error: m.gguf: GGUF magic invalid"),
    (ValueError("plan.json: bad entry"), 2, "dynaquant inspect: error: plan.json: bad entry"),
    (KeyError("unknown format 'Q9_Z'"), 2, "dynaquant inspect: error: unknown format 'Q9_Z'"),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/out.gguf"), 2,
     "dynaquant inspect: error: /ro/out.gguf: Permission denied"),
    (OSError(errno.ENOSPC, "No space left on device", "/full/out.gguf"), 2,
     "dynaquant inspect: error: /full/out.gguf: No space left on device"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "x.dat"), 2,
     "dynaquant inspect: error: x.dat: No such file or directory"),
    (KeyboardInterrupt(), 130, "dynaquant inspect: interrupted"),
])
def test_exit_status_and_one_line(exc, rc, line, monkeypatch, capsys):
    import dynaquant.exporters.gguf.inspect as gguf_inspect

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(gguf_inspect, "inspect_gguf", boom)
    assert cli.main(["inspect", "m.gguf"]) == rc
    out = capsys.readouterr()
    assert out.err.splitlines() == [line] and out.out == ""


def test_a_bug_exits_1_with_the_traceback_and_a_request_to_report_it(monkeypatch, capsys):
    import dynaquant.exporters.gguf.inspect as gguf_inspect

    def boom(*a, **k):
        raise RuntimeError("internal invariant broken")

    monkeypatch.setattr(gguf_inspect, "inspect_gguf", boom)
    assert cli.main(["inspect", "m.gguf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "RuntimeError: internal invariant broken" in err
    assert err.splitlines()[-1] == f"dynaquant inspect: {cli.BUG_REPORT}" and "report" in cli.BUG_REPORT


# --- an output that is an input, or inside the source folder: refused before any work, inputs intact -------------

def test_output_that_is_the_source_gguf_is_refused(tiny, tmp_path, no_model_load):
    from dynaquant import quantize

    _, src = tiny
    g = tmp_path / "m.gguf"
    g.write_bytes(src.read_bytes())
    before = g.read_bytes()
    (tmp_path / "hard.gguf").hardlink_to(g)
    (tmp_path / "soft.gguf").symlink_to(g)
    for out in (g, tmp_path / "hard.gguf", tmp_path / "soft.gguf", tmp_path / "sub" / ".." / "m.gguf"):
        with pytest.raises(InputError, match="is the source model") as e:
            quantize(str(g), preset="Q8_0", use_imatrix=False, output=out, progress=False)
        assert str(e.value).startswith(str(out))
    assert g.read_bytes() == before


@pytest.mark.parametrize("target, rel", [("gguf", "model.safetensors"), ("gguf", "sub/x.gguf"), ("safetensors", "."),
                                         ("safetensors", "out")])
def test_output_inside_the_source_folder_is_refused(tiny, tmp_path, target, rel, no_model_load):
    import shutil

    from dynaquant import quantize

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny[0], ckpt)
    before = _digest(ckpt)
    kw = dict(preset="Q8_0") if target == "gguf" else dict(bpw=8.0)
    with pytest.raises(InputError, match="inside the source checkpoint folder"):
        quantize(str(ckpt), output=ckpt / rel, target=target, use_imatrix=False, progress=False, **kw)
    assert _digest(ckpt) == before and sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in tiny[0].iterdir())


def test_folder_output_holding_the_source_or_an_input_is_refused(tiny, tmp_path, no_model_load):
    import shutil

    from dynaquant import quantize

    shutil.copytree(tiny[0], tmp_path / "models" / "ckpt")
    with pytest.raises(InputError, match="source checkpoint folder .* is inside this output folder"):
        quantize(str(tmp_path / "models" / "ckpt"), output=tmp_path / "models", target="safetensors", bpw=8.0,
                 progress=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "plan.json").write_text("{}")
    with pytest.raises(InputError, match="the plan .* is inside this output folder"):
        quantize(str(tiny[1]), output=tmp_path / "out", target="safetensors", plan=tmp_path / "out" / "plan.json",
                 progress=False)


def test_foreign_output_folder_is_refused_before_any_work(tiny, tmp_path, no_model_load):
    from dynaquant import quantize

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a dynaquant checkpoint; not overwritten"):
        quantize(str(tiny[0]), output=tmp_path / "notes", target="safetensors", bpw=8.0, progress=False)
    (tmp_path / "file.gguf").write_text("x")
    with pytest.raises(InputError, match="is a folder; give a file name"):
        quantize(str(tiny[1]), output=tmp_path / "notes", preset="Q8_0", progress=False)
    with pytest.raises(InputError, match="is a file; give a folder"):
        quantize(str(tiny[0]), output=tmp_path / "file.gguf", target="safetensors", bpw=8.0, progress=False)
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]


@pytest.mark.parametrize("role, arg", [("plan", "plan"), ("report", "report"), ("imatrix", "imatrix"),
                                       ("calibration text", "calibration"), ("evaluation text", "eval_text")])
@pytest.mark.parametrize("which", ["output", "save_plan"])
def test_output_that_is_an_input_file_is_refused(tiny, tmp_path, role, arg, which, no_model_load):
    from dynaquant import quantize

    f = tmp_path / f"{arg}.input"
    f.write_text("precious")
    kw = {arg: str(f), which: f}
    if arg != "plan":
        kw["preset"] = "Q8_0"
    if which == "save_plan":
        kw["output"] = tmp_path / "out.gguf"
    with pytest.raises(InputError, match=f"is the {role} "):
        quantize(str(tiny[1]), progress=False, **kw)
    assert f.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == [f.name]


def test_save_plan_equal_to_the_output_is_refused(tiny, tmp_path, no_model_load):
    from dynaquant import quantize

    with pytest.raises(InputError, match="given for two outputs"):
        quantize(str(tiny[1]), preset="Q8_0", output=tmp_path / "o.gguf", save_plan=tmp_path / "o.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_analyze_plan_and_report_refuse_their_inputs_as_outputs(tiny, tmp_path, no_model_load):
    from dynaquant import analyze, make_dynamic_plan
    from dynaquant.analysis.calibration import CalibrationSpec
    from dynaquant.cli import render_report_cli

    rep = tmp_path / "report.json"
    rep.write_text("precious report")
    plan = tmp_path / "plan.json"
    plan.write_text("precious plan")
    with pytest.raises(InputError, match="is the report"):
        make_dynamic_plan(rep, bpw=4.0, output=rep)
    with pytest.raises(InputError, match="is the report"):
        render_report_cli(rep, rep)
    with pytest.raises(InputError, match="is the plan"):
        render_report_cli(rep, plan, plan)
    with pytest.raises(InputError, match="is the calibration text"):
        analyze(str(tiny[1]), tmp_path, calibration=CalibrationSpec((str(rep),)), progress=False)
    with pytest.raises(InputError, match="inside the source checkpoint folder"):
        analyze(str(tiny[0]), tiny[0] / "analysis", progress=False)
    assert rep.read_text() == "precious report" and plan.read_text() == "precious plan"
    assert not (tiny[0] / "analysis").exists()


def test_plan_refuses_the_imatrix_beside_the_report(tmp_path, monkeypatch):
    import dynaquant.pipeline.plan
    from dynaquant import make_dynamic_plan

    rep = tmp_path / "report.json"
    rep.write_text("{}")
    (tmp_path / "imatrix.gguf").write_bytes(b"imatrix")
    from dynaquant.analysis.report.schema import Report

    monkeypatch.setattr(Report, "load", staticmethod(lambda p: Report.typed({"imatrix": "imatrix.gguf", "tensors": []})))
    monkeypatch.setattr(dynaquant.pipeline.plan, "make_plan", lambda *a, **k: pytest.fail("planned"))
    with pytest.raises(InputError, match="is the imatrix"):
        make_dynamic_plan(rep, bpw=4.0, output=tmp_path / "imatrix.gguf")
    assert (tmp_path / "imatrix.gguf").read_bytes() == b"imatrix"


# --- unwritable output folders and missing disk space: exit 2 before any work (defect 8) -------------------------

def _unwritable(tmp_path: Path) -> list[Path]:
    """Output folders no process can write, root included: a path under a regular file, and /proc."""
    (tmp_path / "afile").write_text("")
    return [tmp_path / "afile" / "sub", Path("/proc")]


def test_unwritable_output_folder_fails_before_any_work(tiny, tmp_path, no_model_load):
    from dynaquant import analyze, make_dynamic_plan, quantize

    for folder in _unwritable(tmp_path):
        out = folder / "out.gguf"
        o = re.escape(str(out))
        with pytest.raises(InputError, match=f"^{o}: (cannot write in|cannot create the output)"):
            quantize(str(tiny[1]), preset="Q8_0", output=out, progress=False)
        with pytest.raises(InputError, match=f"^{o}: "):
            quantize(str(tiny[0]), bpw=5.0, output=tmp_path / "ok.gguf", save_plan=out, progress=False)
        with pytest.raises(InputError, match=f"^{re.escape(str(folder / 'report.json'))}: "):
            analyze(str(tiny[0]), folder, progress=False)  # the analysis of the issue ran 87 s before failing here
        with pytest.raises(InputError, match=f"^{o}: "):
            make_dynamic_plan(tmp_path / "missing-report.json", bpw=4.0, output=out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_cli_unwritable_output_exit_2_one_line(tiny, tmp_path, capsys, no_model_load):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "sub" / "out.gguf"
    assert cli.main(["quantize", str(tiny[1]), "--preset", "Q8_0", "-o", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dynaquant quantize: error: {out}: cannot create the output: {tmp_path / 'afile'} is not a folder"]
    assert cli.main(["analyze", str(tiny[0]), "-o", "/proc/analysis"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dynaquant analyze: error: /proc/analysis/report.json: cannot write in /proc")


def test_missing_disk_space_fails_before_any_work(tiny, tmp_path, monkeypatch, no_model_load):
    import shutil

    from dynaquant import quantize

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=200_000))
    out = tmp_path / "out.gguf"
    with pytest.raises(InputError, match=rf"^{re.escape(str(out))}: not enough free disk space in {re.escape(str(tmp_path))}: "
                                         r"the run writes up to (\d+) bytes .*, 200000 bytes .* are free") as e:
        quantize(str(tiny[1]), preset="F32", use_imatrix=False, output=out, progress=False)
    need = int(str(e.value).split("up to ")[1].split()[0])
    assert need >= tiny[1].stat().st_size  # F32 of the F32 source: at least as large
    with pytest.raises(InputError, match="the run writes up to 300000 bytes"):  # --size bounds the file
        quantize(str(tiny[1]), size=300_000, use_imatrix=False, output=out, progress=False)
    check_outputs([Output(out, 150_000)])
    with pytest.raises(InputError, match="up to 210000 bytes"):  # outputs on one file system add up
        check_outputs([Output(out, 150_000), Output(tmp_path / "p.json", 60_000)])
    res = quantize(str(tiny[1]), preset="Q4_0", use_imatrix=False, output=out, progress=False)  # fits
    assert res.size_bytes < 200_000 and out.is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]


@pytest.mark.parametrize("preset", ["F32", "Q8_0", "Q4_K_M"])
def test_disk_bound_is_an_upper_bound(tiny, tmp_path, preset, monkeypatch):
    import dynaquant.pipeline.quantize
    from dynaquant import quantize

    seen: list[Output] = []
    real = dynaquant.pipeline.quantize.check_outputs

    def spy(outputs, **kw):
        seen.extend(outputs)
        return real(outputs, **kw)

    monkeypatch.setattr(dynaquant.pipeline.quantize, "check_outputs", spy)
    res = quantize(str(tiny[1]), preset=preset, use_imatrix=False, output=tmp_path / "o.gguf", progress=False)
    bound = [o.max_bytes for o in seen if o.max_bytes is not None]
    assert len(bound) == 1 and res.size_bytes <= bound[0] <= res.size_bytes + 64 * 1024


def test_tensor_bytes_bound():
    class T:
        def __init__(self, *shape):
            self.shape = shape

    ts = [T(64, 320), T(96, 64), T(64)]
    n = 64 * 320 + 96 * 64 + 64
    assert tensor_bytes_bound(ts, 1000) == 4 * n + 1000
    assert tensor_bytes_bound(ts, 1000, bpw=4.5) == -(-45 * n // 80) + 1000
    assert tensor_bytes_bound(ts, 1000, size=5000) == 5000
    assert tensor_bytes_bound(ts, 1000, size=10**15) == 4 * n + 1000  # never above every tensor in F32
    assert tensor_bytes_bound(ts, 1000, plan_bytes=777) == 1777


# --- writes that fail midway: exit 2 naming the output, nothing partial left (defect 4) --------------------------

@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), OSError("24576 requested and 16320 written")])
def test_full_disk_mid_file_names_the_output_and_leaves_nothing(tiny, tmp_path, monkeypatch, error):
    from dynaquant import quantize
    from dynaquant.exporters.gguf import writer as gguf_writer

    calls = []
    real = gguf_writer.ArrayPackingWriter.write_tensor_data

    def filling(self, data, *a):
        calls.append(1)
        if len(calls) == 4:
            raise error
        return real(self, data, *a)

    monkeypatch.setattr(gguf_writer.ArrayPackingWriter, "write_tensor_data", filling)
    out = tmp_path / "out.gguf"
    with pytest.raises(InputError, match=f"^{re.escape(str(out))}: cannot write: ") as e:
        quantize(str(tiny[1]), preset="Q8_0", use_imatrix=False, output=out, progress=False)
    assert ("No space left on device" in str(e.value)) == (error.errno == errno.ENOSPC)
    assert ("the disk is full" in str(e.value)) == (error.errno is None)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary file


def test_full_disk_in_the_safetensors_writer_names_the_output(tmp_path, monkeypatch):
    import torch
    from safetensors import SafetensorError

    import dynaquant.exporters.safetensors.writer as sw
    from dynaquant.quant.plan import Plan, PlanEntry

    plan = Plan("safetensors", "m", [PlanEntry("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", (8, 32), "F16",
                                               "F16", "rule")], "file")

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })')

    monkeypatch.setattr("safetensors.torch.save_file", full)
    out = tmp_path / "ckpt"
    with pytest.raises(InputError, match=f"^{re.escape(str(out))}: cannot write: .*StorageFull"):
        sw.write_safetensors(out, plan, {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 32)}, None, {}, progress=False)
    assert list(tmp_path.iterdir()) == []


def _cli_proc(args: list[str], cwd: Path, slow_s: float = 0.0, fsize: int | None = None, **kw) -> subprocess.Popen:
    """``python -m dynaquant.cli ARGS`` (each tensor's encoding slowed by ``slow_s``; file size limit ``fsize``)."""
    code = ("import signal, sys, time\n"
            # a user's command starts with Python's own Ctrl-C handling, whatever this test process inherited or set
            # (an ignored SIGINT would be inherited across exec)
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "import dynaquant.pipeline.targets as p\n"
            f"if {slow_s}:\n"
            "    real = p.encode_tensor\n"
            f"    p.encode_tensor = lambda *a, **k: (time.sleep({slow_s}), real(*a, **k))[1]\n"
            "from dynaquant.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")

    def limit():
        if fsize is not None:
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit, **kw)


def _own_lines(stderr: str) -> list[str]:
    """stderr without the log's warnings (the tiny tokenizer's pre-tokenizer warning)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("WARNING ")]


def test_cli_file_size_limit_exit_2_no_partial_file(tiny, tmp_path):
    p = _cli_proc(["quantize", str(tiny[1]), "--preset", "F32", "--no-imatrix", "--json", "-o", "out.gguf"], tmp_path,
                  fsize=100_000)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err
    lines = _own_lines(err)
    assert len(lines) == 1 and lines[0].startswith("dynaquant quantize: error: out.gguf: cannot write: "), err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def _wait_for_work_folder(folder: Path, p: subprocess.Popen, timeout_s: float = 240) -> Path:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        hits = [q for q in folder.iterdir() if q.name.endswith(WORK_SUFFIX)]
        if hits and any(hits[0].iterdir()):
            return hits[0]
        if p.poll() is not None:
            pytest.fail(f"the run ended before writing: {p.communicate()}")
        time.sleep(0.05)
    p.kill()
    pytest.fail("no work folder appeared")


def test_ctrl_c_exits_130_one_line_no_temporary_files(tiny, tmp_path):
    p = _cli_proc(["quantize", str(tiny[1]), "--preset", "Q8_0", "--no-imatrix", "--json", "-o", "out.gguf"], tmp_path,
                  slow_s=0.5)
    _wait_for_work_folder(tmp_path, p)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert _own_lines(err) == ["dynaquant quantize: interrupted"] and "Traceback" not in err and out == ""
    assert list(tmp_path.iterdir()) == []


def test_a_killed_run_leftovers_are_removed_by_the_next_run(tiny, tmp_path):
    from dynaquant import quantize

    p = _cli_proc(["quantize", str(tiny[1]), "--preset", "Q8_0", "--no-imatrix", "--json", "-o", "out.gguf"], tmp_path,
                  slow_s=0.5)
    work = _wait_for_work_folder(tmp_path, p)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    assert work.is_dir() and not pid_alive(p.pid)  # what SIGKILL leaves
    old_style = tmp_path / f".out.gguf.{p.pid}.1a2b3c4d.tmp"  # an earlier version's temporary file of a killed run
    old_style.write_bytes(b"partial")
    live = tmp_path / f".out.gguf.{os.getpid()}.1a2b3c4d.tmp"  # a live process's: kept
    live.write_bytes(b"in progress")
    other = tmp_path / f".other.gguf.{p.pid}.1a2b3c4d.tmp"  # another output's: kept
    other.write_bytes(b"other")
    assert stale_entries(tmp_path / "out.gguf") == sorted([old_style, work])
    res = quantize(str(tiny[1]), preset="Q8_0", use_imatrix=False, output=tmp_path / "out.gguf", progress=False)
    assert res.output.is_file()
    assert _leftovers(tmp_path) == sorted([live.name, other.name])


def test_run_workdir_is_removed_on_success_error_and_interrupt(tmp_path):
    out = tmp_path / "deep" / "out.bin"
    with run_workdir(out) as w:
        assert w.parent == out.parent and w.name.startswith(f".out.bin.{os.getpid()}.") and w.is_dir()
        (w / "x").write_bytes(b"1")
    assert not w.exists()
    for exc in (ValueError("bad"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with run_workdir(out) as w:
                (w / "x").write_bytes(b"1")
                raise exc
        assert not w.exists()
    assert list(out.parent.iterdir()) == []


# --- --save-plan: atomic, and written before the encoding (defect 6) ---------------------------------------------

def test_save_plan_is_written_before_the_encoding(tiny, tmp_path, monkeypatch):
    import dynaquant.pipeline.targets
    from dynaquant import quantize

    saved = tmp_path / "plan.json"

    def stop(path, *a, **k):
        assert json.loads(saved.read_text())["tensors"]  # complete, before the first tensor is encoded
        raise KeyboardInterrupt

    monkeypatch.setattr(dynaquant.pipeline.targets, "GGUFFileWriter", stop)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny[1]), preset="Q8_0", use_imatrix=False, output=tmp_path / "o.gguf", save_plan=saved, progress=False)
    d = json.loads(saved.read_text())
    assert {e["format"] for e in d["tensors"] if e["name"].endswith("attn_q.weight")} == {"Q8_0"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_save_plan_on_a_full_disk_keeps_the_previous_file(tiny, tmp_path, monkeypatch):
    from dynaquant import quantize

    saved = tmp_path / "plan.json"
    saved.write_text("previous")
    real = Path.write_text

    def full(self, text, *a, **k):
        if self.name == "plan.json":
            real(self, text[:10], *a, **k)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(InputError, match=f"^{re.escape(str(saved))}: cannot write: No space left on device"):
        quantize(str(tiny[1]), preset="Q8_0", use_imatrix=False, output=tmp_path / "o.gguf", save_plan=saved, progress=False)
    assert saved.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_check_outputs_accepts_a_plain_new_output(tmp_path):
    check_outputs([Output(tmp_path / "new" / "deeper" / "o.gguf", 1000)], inputs={"plan": None, "report": {"x": 1}})
    assert list(tmp_path.iterdir()) == []  # nothing created by the check


# --- a whole-model run that cannot fit its GPU: refused before the model is loaded -----------------------------------

def _llama8b_infos():
    from dynaquant.quant.plan import TensorInfo

    t = [TensorInfo("token_embd.weight", None, (128256, 4096)), TensorInfo("output.weight", None, (128256, 4096)),
         TensorInfo("output_norm.weight", None, (4096,), False)]
    for i in range(32):
        for name, shape in (("attn_q", (4096, 4096)), ("attn_k", (1024, 4096)), ("attn_v", (1024, 4096)),
                            ("attn_output", (4096, 4096)), ("ffn_gate", (14336, 4096)), ("ffn_up", (14336, 4096)),
                            ("ffn_down", (4096, 14336))):
            t.append(TensorInfo(f"blk.{i}.{name}.weight", None, shape))
        t += [TensorInfo(f"blk.{i}.attn_norm.weight", None, (4096,), False),
              TensorInfo(f"blk.{i}.ffn_norm.weight", None, (4096,), False)]
    return t


class _Props:
    def __init__(self, total):
        self.total_memory = total


def test_whole_model_gpu_bytes_of_the_8b_shape():
    """Llama-3-8B's shapes: 8.03 B parameters in float32, and per block one (K, K) float32 input sum a distinct
    width (4096 and 14336; q/k/v, o and gate/up counted once between them)."""
    from dynaquant.pipeline.preflight import whole_model_gpu_bytes

    infos = _llama8b_infos()
    n = sum(math.prod(t.shape) for t in infos)
    assert 8.0e9 < n < 8.1e9
    assert whole_model_gpu_bytes(infos, moments=False) == (4 * n, 0)
    assert whole_model_gpu_bytes(infos, moments=True) == (4 * n, 4 * 32 * (4096**2 + 14336**2))


def test_whole_model_gpu_check_refuses_what_cannot_fit(monkeypatch):
    """On a 24 GiB GPU the 8B shape is refused (naming the source, the parts and --stream); on an 80 GiB one it
    passes; a CPU run asks nothing of CUDA."""
    import torch

    from dynaquant.pipeline.preflight import check_whole_model_gpu

    infos = _llama8b_infos()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(24 * 2**30))
    with pytest.raises(InputError, match=r"^/m/llama: a whole-model run needs at least 56\.4 GiB on cuda .*"
                                         r"29\.\d GiB of float32 weights \+ 2\d\.\d GiB of calibration input moments.*"
                                         r"24\.0 GiB: add --stream"):
        check_whole_model_gpu(infos, "cuda", True, "/m/llama")
    with pytest.raises(InputError, match="needs at least 29.9 GiB"):
        check_whole_model_gpu(infos, "cuda", False, "/m/llama")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(80 * 2**30))
    check_whole_model_gpu(infos, "cuda:0", True, "/m/llama")

    def no_cuda(d):
        raise AssertionError("CUDA asked on a CPU run")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    check_whole_model_gpu(infos, "cpu", True, "/m/llama")


def test_quantize_refuses_a_model_too_large_for_the_gpu_before_loading_it(tiny, tmp_path, no_model_load, monkeypatch):
    """``quantize`` on a CUDA device whose memory cannot hold the model: an InputError naming the source and
    ``--stream`` before the model is loaded, no output written."""
    import torch

    from dynaquant import quantize

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(2**10))  # below the tiny model's bytes
    ckpt, _ = tiny
    out = tmp_path / "o.gguf"
    with pytest.raises(InputError, match="add --stream") as e:
        quantize(str(ckpt), bpw=6.0, output=out, device="cuda", progress=False)
    assert str(ckpt) in str(e.value) and not out.exists()


def test_analyze_refuses_a_model_too_large_for_the_gpu_before_loading_it(tiny, tmp_path, no_model_load, monkeypatch):
    """``analyze`` (whole model) likewise, its weights counted in its ``dtype`` (bfloat16: half the bytes)."""
    import torch

    from dynaquant import analyze
    from dynaquant.pipeline.preflight import whole_model_gpu_bytes

    ckpt, _ = tiny
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(2**10))
    with pytest.raises(InputError, match="bfloat16 weights.*add --stream"):
        analyze(str(ckpt), tmp_path / "rep", device="cuda", dtype="bfloat16", progress=False)
    assert not (tmp_path / "rep").exists()
    infos = _llama8b_infos()
    assert 2 * whole_model_gpu_bytes(infos, False, 2)[0] == whole_model_gpu_bytes(infos, False)[0]
