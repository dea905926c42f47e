"""Which runs a grid holds, what each one needs (a fresh start, a resume, nothing), and in which order they start.

The order is the fairness rule of docs/grid.md: seed-major, so the arms of one seed are next to each other in the
queue and start side by side in the same wave, and rotated by the seed's position, so that no arm always starts
first (on a machine whose load changes during the grid, the arm that starts first would otherwise always train
under the same conditions). A run's folder decides what it needs: a ``report.json`` is a finished run (skipped),
a ``resume.pt`` or ``start.json`` an interrupted one (resumed), nothing a new one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.choices import known_only
from opalctl.layout import FINISHED, LockRuns, RunLayout, runs_dir_default
from opalctl.layout import NEW as LAYOUT_NEW

NEW, RESUME, DONE = "new", "resume", "done"


@dataclass(frozen=True)
class GridRun:
    """One (arm, seed) of the grid and the folder it lives in."""

    arm: str
    seed: int
    run_dir: Path

    @property
    def log(self) -> Path:
        return RunLayout.of(self.run_dir).grid_log

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"

    def need(self) -> str:
        """What this run needs now, by the state of its folder (opalctl/layout.py): ``done``, ``resume`` or
        ``new``."""
        state = RunLayout.of(self.run_dir).state
        return DONE if state == FINISHED else NEW if state == LAYOUT_NEW else RESUME

    def command(self, lock_path: Path, runs_dir: Path, resume: bool) -> list[str]:
        """The ``opalctl run`` arguments of this run (after ``python -m opalctl``)."""
        return ["run", str(lock_path), "--arm", self.arm, "--seed", str(self.seed), "--runs-dir", str(runs_dir),
                *(["--resume"] if resume else [])]


@dataclass(frozen=True)
class GridPlan:
    """The grid's runs in starting order, and what every run is given."""

    lock_path: Path
    runs_dir: Path
    runs: tuple[GridRun, ...]
    threads: int
    budget: dict[str, Any]

    @property
    def arms(self) -> list[str]:
        return list(dict.fromkeys(run.arm for run in self.runs))

    @property
    def seeds(self) -> list[int]:
        return list(dict.fromkeys(run.seed for run in self.runs))


def plan_grid(lock_path: str | os.PathLike, *, arms: list[str] | None = None, seeds: list[int] | None = None,
              runs_dir: str | os.PathLike | None = None) -> GridPlan:
    """The grid of ``lock_path``: the chosen arms and seeds (default all of the lock's), in starting order."""
    from opalctl.protocol.lock import read_lock

    lock = read_lock(Path(lock_path))
    resolved = lock.resolved
    chosen_arms = _chosen(list(resolved["arms"]), arms, "arm", lock.path)
    chosen_seeds = _chosen(list(resolved["seeds"]), seeds, "seed", lock.path)
    folder = runs_dir_default(runs_dir)
    runs_of = LockRuns.of(folder, lock)
    runs = tuple(GridRun(arm, seed, runs_of.run(arm, seed).root)
                 for arm, seed in ordered(chosen_arms, chosen_seeds))
    return GridPlan(lock_path=lock.path, runs_dir=folder, runs=runs, threads=int(resolved["budget"]["threads"]),
                    budget=dict(resolved["budget"]))


def _chosen(known: list, asked: list | None, what: str, lock_path: Path) -> list:
    if not asked:
        return known
    return known_only(asked, known, lambda value, values: f"{what} {value} is not in lock {lock_path} (its "
                      f"{what}s: {', '.join(map(str, values))}); choose from those")


def ordered(arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Seed-major, the arms of the k-th seed rotated by k: every arm starts first in some wave."""
    pairs = []
    for position, seed in enumerate(seeds):
        shift = position % len(arms)
        pairs.extend((arm, seed) for arm in arms[shift:] + arms[:shift])
    return pairs


def default_jobs(threads: int, cores: int | None = None) -> int:
    """Runs side by side: the cores this process may use divided by the threads of each run, at least one."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, threads))
