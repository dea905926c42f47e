"""Which runs a grid holds, what each one needs (a fresh start, a resume, nothing), and in which order they start.

The order is the fairness rule of docs/grid.md: seed-major, so the arms of one seed are next to each other in the
queue and start side by side in the same wave, and rotated by the seed's position, so that no arm always starts
first (on a machine whose load changes during the grid, the arm that starts first would otherwise always train
under the same conditions). A run's folder decides what it needs: a ``report.json`` is a finished run (skipped),
a ``resume.pt`` or ``start.json`` an interrupted one (resumed), nothing a new one. The grid asks again when it
starts the run (another grid or a plain ``opalctl run`` may have run it meanwhile), and reads the outcome of its
own ``opalctl run`` from the folder too (``GridRun.outcome``), never from the exit code alone.

A lock of ``training.ranks`` above 1 runs each run under torchrun on one node (``GridRun.argv``), every rank with
the lock's ``budget.threads``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.choices import known_only
from opalctl.driver.ranks import torchrun_line
from opalctl.errors import EXIT_BAD_INPUT
from opalctl.grid.records import FAILED, RESUMED, SKIPPED, final_state
from opalctl.grid.records import FINISHED as RAN_TO_REPORT
from opalctl.layout import FINISHED, LockRuns, RunLayout, runs_dir_default
from opalctl.layout import NEW as LAYOUT_NEW
from opalctl.protocol.lock import read_lock

NEW, RESUME, DONE = "new", "resume", "done"


@dataclass(frozen=True)
class GridRun:
    """One (arm, seed) of the grid and the folder it lives in."""

    arm: str
    seed: int
    run_dir: Path
    ranks: int = 1  # the lock's training.ranks: more than one runs under torchrun

    @property
    def layout(self) -> RunLayout:
        return RunLayout.of(self.run_dir)

    @property
    def log(self) -> Path:
        return self.layout.grid_log

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"

    def need(self) -> str:
        """What this run needs now, by the state of its folder (opalctl/layout.py): ``done``, ``resume`` or
        ``new``."""
        state = self.layout.state
        return DONE if state == FINISHED else NEW if state == LAYOUT_NEW else RESUME

    def refused(self, exit_code: int | None) -> bool:
        """Whether its ``opalctl run`` ended refusing the folder (bad input, exit 2: busy, finished, or not
        startable as asked) rather than after training in it."""
        return exit_code == EXIT_BAD_INPUT

    def outcome(self, exit_code: int | None, resumed: bool) -> str:
        """The final state of this run after the grid's ``opalctl run`` of it ended with ``exit_code`` (None: no
        code, the task ended without one), by its folder: a finished folder is a finished run whatever the code (a
        stop signal that landed after its report), but one its run was refused in finished elsewhere (skipped);
        an unfinished folder is what the code says, and never finished."""
        if self.layout.state == FINISHED:
            return SKIPPED if self.refused(exit_code) else RESUMED if resumed else RAN_TO_REPORT
        if exit_code is None or exit_code == 0:
            return FAILED  # it ended without its report
        return final_state(exit_code, resumed)

    def argv(self, lock_path: Path, runs_dir: Path, resume: bool) -> list[str]:
        """The whole command line of this run: ``python -m opalctl run ...``, or torchrun's (standalone: each run
        its own rendezvous, so runs side by side never meet on one port) for a lock of several ranks."""
        words = ["opalctl", *self.command(lock_path, runs_dir, resume)]
        if self.ranks == 1:
            return [sys.executable, "-m", *words]

        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                *torchrun_line(self.ranks, words)[1:]]

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
    ranks: int = 1

    @property
    def cpus_per_run(self) -> int:
        """The cores one run uses: its threads on every rank."""
        return self.threads * self.ranks

    @property
    def arms(self) -> list[str]:
        return list(dict.fromkeys(run.arm for run in self.runs))

    @property
    def seeds(self) -> list[int]:
        return list(dict.fromkeys(run.seed for run in self.runs))


def plan_grid(lock_path: str | os.PathLike, *, arms: list[str] | None = None, seeds: list[int] | None = None,
              runs_dir: str | os.PathLike | None = None) -> GridPlan:
    """The grid of ``lock_path``: the chosen arms and seeds (default all of the lock's), in starting order."""
    lock = read_lock(Path(lock_path))
    resolved = lock.resolved
    chosen_arms = _chosen(list(resolved["arms"]), arms, "arm", lock.path)
    chosen_seeds = _chosen(list(resolved["seeds"]), seeds, "seed", lock.path)
    folder = runs_dir_default(runs_dir)
    runs_of = LockRuns.of(folder, lock)
    ranks = int(resolved["training"].get("ranks", 1))
    runs = tuple(GridRun(arm, seed, runs_of.run(arm, seed).root, ranks)
                 for arm, seed in ordered(chosen_arms, chosen_seeds))
    return GridPlan(lock_path=lock.path, runs_dir=folder, runs=runs, threads=int(resolved["budget"]["threads"]),
                    budget=dict(resolved["budget"]), ranks=ranks)


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
