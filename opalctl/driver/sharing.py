"""How much of the machine a run had: how many runs trained beside it, the load, the cores, and where it ran.

A CPU-second costs more when another run shares the caches and the memory bus, so a run trained alone and one
trained beside a neighbour are not at equal compute even on the ``cpu`` clock (docs/grid.md has this machine's
figure). The evaluator process keeps a ``MachineWatch`` for as long as the run lives (it is the one process of a
run that no agent code reaches), samples it at each stage, and writes ``to_json()`` into ``report.json``'s
``machine``; ``opalctl compare`` warns when the arms of one seed trained under different concurrency.

``concurrent_runs`` counts the live ``opalctl run`` processes on this machine (this run's own training process
included, even when it is not a CLI process); where ``/proc`` cannot be read, it is the number of runs the grid
started side by side (``OPALCTL_GRID_WAVE_SIZE``), or 1. ``load`` is the one-minute load average. The Slurm job,
array task and node come from Slurm's environment, which a job's processes inherit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WAVE_SIZE_VARIABLE = "OPALCTL_GRID_WAVE_SIZE"  # set by the grid in each run's environment (grid/local.py)
EXECUTOR_VARIABLE = "OPALCTL_GRID_EXECUTOR"


def is_run_command(words: list[str]) -> bool:
    """Whether a command line is ``opalctl run ...`` (``python -m opalctl run`` or the ``opalctl`` script)."""
    for index, word in enumerate(words[:-1]):
        if os.path.basename(word) == "opalctl":  # the module after -m, or the script's path
            return words[index + 1] == "run"
    return False


def live_runs(proc: Path = Path("/proc"), own_training: int | None = None) -> set[int] | None:
    """The ids of the ``opalctl run`` processes alive now (with ``own_training`` even when it is not one), or None
    where the process table cannot be read."""
    try:
        entries = [entry for entry in proc.iterdir() if entry.name.isdigit()]
    except OSError:
        return None
    found = set()
    for entry in entries:
        try:
            words = [w.decode("utf-8", "replace") for w in (entry / "cmdline").read_bytes().split(b"\0") if w]
        except OSError:
            continue
        if is_run_command(words):
            found.add(int(entry.name))
    if own_training is not None:
        found.add(own_training)
    return found


def _figures(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "max": max(values), "mean": round(sum(values) / len(values), 4)}


class MachineWatch:
    """Samples of the machine a run trains on, from its start (construction) to its close."""

    def __init__(self, environ: Mapping[str, str] | None = None, proc: Path = Path("/proc"),
                 own_training: int | None = None):
        self.environ = dict(os.environ if environ is None else environ)
        self.proc = proc
        # the evaluator is a child of the training process: that process is this run, whatever it is
        self.own_training = os.getppid() if own_training is None else own_training
        self.runs: list[float] = []
        self.loads: list[float] = []
        self.sample()

    def sample(self) -> None:
        runs = live_runs(self.proc, self.own_training)
        self.runs.append(float(len(runs) if runs is not None else self._wave_size() or 1))
        try:
            self.loads.append(round(os.getloadavg()[0], 3))
        except OSError:
            pass

    def _wave_size(self) -> int | None:
        try:
            return int(self.environ[WAVE_SIZE_VARIABLE])
        except (KeyError, ValueError):
            return None

    def executor(self) -> str | None:
        named = self.environ.get(EXECUTOR_VARIABLE)
        if named:
            return named
        return "slurm" if "SLURM_JOB_ID" in self.environ else None

    def slurm(self) -> dict[str, Any] | None:
        env = self.environ
        if "SLURM_JOB_ID" not in env:
            return None
        return {"job_id": env.get("SLURM_JOB_ID"), "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
                "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
                "node": env.get("SLURMD_NODENAME") or env.get("SLURM_NODELIST"),
                "restarts": int(env.get("SLURM_RESTART_COUNT", 0) or 0)}

    def to_json(self) -> dict[str, Any]:
        self.sample()
        return {"concurrent_runs": _figures(self.runs), "load": _figures(self.loads), "cores": os.cpu_count(),
                "wave_size": self._wave_size(), "executor": self.executor(), "slurm": self.slurm()}
