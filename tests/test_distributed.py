"""``torchrun --nproc-per-node 2 -m dynaquant quantize --stream`` (two CPU ranks, gloo) writes the single process's bytes.

Oracles: the same command in one process (one thread each, as torchrun gives its ranks) on a tiny Qwen2-MoE checkpoint
(routed experts: the per-expert statistics are folded too, GPTQ on): the GGUF file and the saved plan byte for byte,
the analysis report (kept in the work folder) equal but for its timings; and a run whose rank 1 dies mid-encode stops
with an error, then the same command again continues from the work folder to the same bytes. Without GPTQ, the
stacked expert tensors encoded a range of experts at a time are split between the ranks by range: the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_moe_gguf import _tiny_moe

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--stream", "--bpw", "6.5", "--calibration-chunks", "5", "--ctx", "32", "--no-eval", "--device", "cpu",
        "--gptq", "--json"]
# rank 1 (of a torchrun) exits hard after encoding DQ_DIE_AFTER tensors, or once calibration step DQ_DIE_AT_STEP is
# committed (the hooks of the resume tests); each rank says at which committed step its calibration starts
SCRIPT = """import os, sys
import dynaquant.pipeline.rundir as rd
init, save = rd.RankCheckpoints.__init__, rd.RankCheckpoints.save
def init_(self, *a, **k):
    init(self, *a, **k)
    print(f"calibration from step {self.step}", file=sys.stderr, flush=True)
def save_(self, name, state):
    save(self, name, state)
    if os.environ.get("RANK") == "1" and self.step == int(os.environ.get("DQ_DIE_AT_STEP", "-1")):
        os._exit(3)
rd.RankCheckpoints.__init__, rd.RankCheckpoints.save = init_, save_
if os.environ.get("DQ_GROUP_BYTES"):
    import dynaquant.pipeline.targets as t
    t.EXPERT_GROUP_BYTES = int(os.environ["DQ_GROUP_BYTES"])
if os.environ.get("DQ_DIE_AFTER") and os.environ.get("RANK") == "1":
    import dynaquant.pipeline.targets as t
    enc, n = t.encode_tensor, [0]
    def encode(*a, **k):
        n[0] += 1
        if n[0] > int(os.environ["DQ_DIE_AFTER"]):
            os._exit(3)
        return enc(*a, **k)
    t.encode_tensor = encode
from dynaquant.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env(**more) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "DYNAQUANT_DIST_TIMEOUT": "120", "DYNAQUANT_RANK_THREADS": "1",
           "DYNAQUANT_CHECKPOINT_S": "0", **more}
    return env


def _torchrun(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    script = cwd / "rank.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), "quantize", *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=900)


def _single(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynaquant", "quantize", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=900)


def _report(work: Path) -> dict:
    report = torch.load(work / "analysis" / "done.pt", weights_only=True)["report"]
    report.pop("timings_s", None)
    return report


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist") / "ckpt"
    _tiny_moe(folder, "qwen2moe")
    return folder


@pytest.fixture(scope="module")
def single(ckpt, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("single")
    p = _single([str(ckpt), *ARGS, "-o", "one.gguf", "--save-plan", "plan.json", "--work-dir", "w", "--keep-work-dir"],
                cwd)
    assert p.returncode == 0, p.stderr
    return cwd, json.loads(p.stdout)


def test_two_ranks_write_the_single_process_bytes(ckpt, single, tmp_path):
    one, res_one = single
    p = _torchrun([str(ckpt), *ARGS, "-o", "two.gguf", "--save-plan", "plan.json", "--work-dir", "w",
                   "--keep-work-dir"], tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout)  # rank 0 alone reports
    assert (tmp_path / "two.gguf").read_bytes() == (one / "one.gguf").read_bytes()
    assert (tmp_path / "plan.json").read_bytes() == (one / "plan.json").read_bytes()
    assert res["gptq"] == res_one["gptq"] and res["size_bytes"] == res_one["size_bytes"]
    assert any(g["tensors"] for g in res["gptq"].values())
    rep, rep_one = _report(tmp_path / "w"), _report(one / "w")
    assert rep == rep_one  # every error, super weight and routing count: exactly the single process's
    assert any(t.get("experts") for t in rep["tensors"])  # the experts were measured (their statistics folded)
    # each rank encoded its share: both wrote tensors, rank 1's too (the balance is by size)
    assert len(list((tmp_path / "w" / "tensors").iterdir())) == len(list((one / "w" / "tensors").iterdir()))


def test_two_ranks_split_the_expert_ranges_of_a_stacked_tensor(ckpt, tmp_path):
    args = [str(ckpt), *[a for a in ARGS if a != "--gptq"], "--work-dir", "w", "--keep-work-dir"]
    (tmp_path / "one").mkdir()
    p = _single([*args, "-o", "one.gguf"], tmp_path / "one")
    assert p.returncode == 0, p.stderr[-4000:]
    p = _torchrun([*args, "-o", "two.gguf"], tmp_path, DQ_GROUP_BYTES="1")  # every stacked tensor: ranges of 2 experts
    assert p.returncode == 0, p.stderr[-4000:]
    parts = sorted(f.name for f in (tmp_path / "w" / "tensors").glob("*-*.npy"))
    assert len(parts) > 4 and len({f.split("-")[0] for f in parts}) > 1  # several ranges of several tensors
    assert (tmp_path / "two.gguf").read_bytes() == (tmp_path / "one" / "one.gguf").read_bytes()


def test_a_rank_that_dies_stops_the_run_and_the_restart_resumes(ckpt, single, tmp_path):
    one, _ = single
    args = [str(ckpt), *ARGS, "-o", "two.gguf", "--work-dir", "w"]
    # (rank 1 dies at its second encode: with "3", a rank 1 slowed by a busy machine once encoded no more than three
    # tensors before rank 0 had claimed the rest, and the run finished)
    p = _torchrun(args, tmp_path, DQ_DIE_AFTER="1")
    assert p.returncode != 0, "rank 1 did not die: it encoded at most one tensor"
    assert "exitcode" in p.stderr and "3" in p.stderr  # torchrun names the failed rank and its exit code
    assert not (tmp_path / "two.gguf").exists()  # no partial output
    kept = list((tmp_path / "w" / "tensors").iterdir())
    assert kept and (tmp_path / "w" / "analysis" / "done.pt").is_file()  # the analysis and some tensors were kept
    p = _torchrun(args, tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    assert (tmp_path / "two.gguf").read_bytes() == (one / "one.gguf").read_bytes()
    assert not (tmp_path / "w").exists()  # removed after success (no --keep-work-dir)


def test_a_rank_that_dies_mid_calibration_resumes_at_the_committed_step(ckpt, single, tmp_path):
    one, _ = single
    args = [str(ckpt), *ARGS, "-o", "two.gguf", "--work-dir", "w"]
    p = _torchrun(args, tmp_path, DQ_DIE_AT_STEP="3")  # steps: 2 blocks forward, the head (3), 2 blocks back
    assert p.returncode != 0 and not (tmp_path / "two.gguf").exists()
    assert "calibration from step 0" in p.stderr
    commit = json.loads((tmp_path / "w" / "analysis" / "ranks-2" / "commit.json").read_text())
    assert commit["step"] in (2, 3)  # rank 0 may not have committed step 3 before rank 1 was gone
    p = _torchrun(args, tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"calibration from step {commit['step']}" in p.stderr
    assert (tmp_path / "two.gguf").read_bytes() == (one / "one.gguf").read_bytes()


def test_several_ranks_refuse_what_they_cannot_do(ckpt, tmp_path):
    p = _torchrun([str(ckpt), "--bpw", "6.5", "--no-eval", "--device", "cpu", "-o", "x.gguf"], tmp_path)
    assert p.returncode != 0 and "add --stream" in p.stderr
    assert not (tmp_path / "x.gguf").exists()
