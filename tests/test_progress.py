"""One progress display for a stream run (issue 15): the stages' bars are views of the run's one bar, each moving it
by the stage's share; the block-wise calibration names the block, the sweep and the rate."""

from __future__ import annotations

import torch
from test_blockwise import _checkpoint

from dynaquant.analysis.blockwise import collect_blockwise
from dynaquant.analysis.stats import Collect
from dynaquant.progress import RESOLUTION, RunProgress, StageBar, stage_bar
from dynaquant.sources.skeleton import build_skeleton


def test_stage_bars_move_the_run_bar_by_their_shares():
    run = RunProgress({"a": 3.0, "b": 1.0}, enabled=False)
    a = stage_bar(run, "a", 4, "block")
    assert isinstance(a, StageBar)
    seen = []
    for _ in range(4):
        a.update(1)
        seen.append(run.n)
    assert seen == sorted(seen) and seen[-1] == round(0.75 * RESOLUTION)
    a.close()
    b = stage_bar(run, "b", 10, "tensor")
    b.update(5)
    assert run.n == round(0.875 * RESOLUTION)
    b.set_description("writing x.gguf")
    assert run.desc.startswith("writing x.gguf [tensor 5/10]")
    b.update(5)
    b.close()
    assert run.n == RESOLUTION
    other = stage_bar(run, "unlisted", 3, "step")  # no share: shows its steps, does not move the bar
    other.update(3)
    assert run.n == RESOLUTION
    assert stage_bar(False, "x", 3, "step").disable  # without a run: a tqdm bar of its own, silent when False


def test_blockwise_calibration_reports_block_sweep_and_rate(tmp_path, monkeypatch):
    source, ts = _checkpoint(tmp_path / "ckpt", "llama")
    sk = build_skeleton(source, ts)
    run = RunProgress({"calibration": 1.0}, enabled=False)
    descs, posts = [], []
    real_d, real_p = StageBar.set_description, StageBar.set_postfix_str
    monkeypatch.setattr(StageBar, "set_description", lambda self, d: (descs.append(d), real_d(self, d))[1])
    monkeypatch.setattr(StageBar, "set_postfix_str", lambda self, p: (posts.append(p), real_p(self, p))[1])
    chunks = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(0))
    collect_blockwise(sk, chunks, Collect(fisher_sequences=1), progress=run)
    n = sk.n_blocks
    assert [d for d in descs if d.endswith("forward")] == [f"calibration: block {i + 1} of {n}, forward" for i in range(n)]
    assert [d for d in descs if d.endswith("backward")] == \
        [f"calibration: block {i + 1} of {n}, Fisher backward" for i in reversed(range(n))]
    assert sum(p.endswith("tokens/s") for p in posts) == n
    assert run.n == RESOLUTION  # the stage's whole share
