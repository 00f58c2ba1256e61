"""One progress display for a whole run (issue 15): the stage, block i of n (or tensor i of n), the rate, and an
estimate of the time left for the run, on one tqdm bar.

A stage asks for its bar with :func:`stage_bar`. Given ``True`` / ``False`` it gets a tqdm bar of its own (as before
runs had one display); given a :class:`RunProgress` it gets a view of the run's one bar: its steps advance the run's
bar by the stage's share of the run (``RunProgress(shares)``: a stage's expected fraction of the run's time, from the
measured stage times of the 8B shape in ``benchmarks/scale.py``), and tqdm's remaining-time estimate is the run's.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

RESOLUTION = 10_000  # the run's bar counts in 1/RESOLUTION of the run


class RunProgress:
    """The run's bar.

    Args:
        shares: stage name -> its expected share of the run's time (any positive numbers: normalized); stages not
            listed take a share of 0 (their steps show, the bar does not move).
        enabled: False: nothing is shown (the stage bars are silent).
    """

    def __init__(self, shares: dict[str, float], *, enabled: bool = True):
        total = sum(shares.values()) or 1.0
        self.shares = {k: v / total for k, v in shares.items()}
        self.enabled = enabled
        self.bar = tqdm(total=RESOLUTION, disable=not enabled, unit="", dynamic_ncols=True,
                        bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")
        self.base = 0.0  # the finished stages' share
        self.n, self.desc = 0, ""  # the bar's position (1/RESOLUTION of the run) and text, also when not shown

    def __bool__(self) -> bool:
        return self.enabled

    def stage(self, name: str, total: int, unit: str) -> StageBar:
        """The bar of stage ``name`` of ``total`` steps of ``unit`` (block, tensor, step)."""
        return StageBar(self, name, total, unit)

    def _show(self, fraction: float, desc: str, postfix: str) -> None:
        n = round(min(1.0, fraction) * RESOLUTION)
        if n > self.n:
            self.bar.update(n - self.n)
            self.n = n
        self.desc = desc
        self.bar.set_description_str(desc, refresh=False)
        self.bar.set_postfix_str(postfix)

    def close(self) -> None:
        self._show(1.0, "done", "")
        self.bar.close()


class StageBar:
    """One stage's view of the run's bar (tqdm's ``update``, ``set_description``, ``set_postfix_str``, ``close``)."""

    def __init__(self, run: RunProgress, name: str, total: int, unit: str):
        self.run, self.name, self.total, self.unit = run, name, max(total, 1), unit
        self.n, self.t0, self.desc, self.postfix = 0, time.perf_counter(), name, ""
        self._refresh()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._refresh()

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self._refresh()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        self._refresh()

    def close(self) -> None:
        self.run.base += self.run.shares.get(self.name, 0.0)

    def _refresh(self) -> None:
        share = self.run.shares.get(self.name, 0.0)
        dt = time.perf_counter() - self.t0
        rate = f"{self.n / dt:.2f} {self.unit}/s" if dt > 0 and self.n else ""
        extra = ", ".join(x for x in (rate, self.postfix) if x)
        self.run._show(self.run.base + share * min(self.n, self.total) / self.total,
                       f"{self.desc} [{self.unit} {min(self.n, self.total)}/{self.total}]", f" {extra}" if extra else "")


def stage_bar(progress: bool | RunProgress, desc: str, total: int, unit: str):
    """A stage's bar: a view of the run's bar (``progress`` a :class:`RunProgress`; ``desc`` is the stage's name in
    its shares), else a tqdm bar of its own, shown when ``progress`` is true."""
    if isinstance(progress, RunProgress):
        return progress.stage(desc, total, unit)
    return tqdm(total=total, desc=desc, unit=unit, disable=not progress)
