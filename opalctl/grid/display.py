"""What the grid shows while it works: a live table on a terminal, one JSON line per state change otherwise.

Both take the grid's events (grid/records.py). The table redraws at most every ``console.REDRAW_SECONDS`` (the
grid process trains nothing, so drawing costs no run any budget) and stays on the screen when the grid ends; the
JSON lines are one canonical object each (sorted keys), printed when a run's state changes and when a running run
passes the next tenth of its budget, not at every progress figure.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from opalctl import console
from opalctl.errors import EXIT_AGENT_NEVER_ANSWERED
from opalctl.grid.records import FINAL


def live_display(json_mode: bool = False):
    """The display the CLI uses: a live table when stdout is a terminal (and ``--json`` is off), else JSON lines."""
    if console.rich_enabled(sys.stdout, json_mode):
        return LiveTable()
    return JsonLines(sys.stdout)


class RunStates:
    """The last state seen of each run, for displays that show only a run's changes of state."""

    def __init__(self):
        self.states: dict[tuple[str, int], str] = {}

    def changed(self, change: dict[str, Any]) -> bool:
        """Whether ``change`` brings its run a new state (it is then remembered)."""
        key = (change["arm"], change["seed"])
        if self.states.get(key) == change["state"]:
            return False
        self.states[key] = change["state"]
        return True


class JsonLines:
    """One JSON line per state change of a run on ``stream`` (``"event": "run"``), and one each time a running
    run passes the next tenth of its budget (``"event": "progress"``, with its fraction, updates and ETA), so a
    script reading the pipe sees a long run move without a line per progress figure."""

    STEPS = 10  # progress lines per run: at 10 %, 20 %, ... of its budget

    def __init__(self, stream):
        self.stream = stream
        self.runs = RunStates()
        self.passed: dict[tuple[str, int], int] = {}  # the tenths of its budget each run was last said to pass

    def __call__(self, change: dict[str, Any]) -> None:
        if self.runs.changed(change):
            self._write({"event": "run", **change})
            return
        fraction, key = change.get("fraction"), (change["arm"], change["seed"])
        if change["state"] != "running" or fraction is None:
            return
        tenths = int(fraction * self.STEPS)
        if tenths > self.passed.get(key, 0):
            self.passed[key] = tenths
            self._write({"event": "progress", **change})

    def _write(self, line: dict[str, Any]) -> None:
        self.stream.write(json.dumps(line, sort_keys=True, default=str) + "\n")
        self.stream.flush()


def row(change: dict[str, Any]) -> list[str]:
    """One run's line of the live table: run, state, progress, updates, ETA."""
    fraction, eta = change.get("fraction"), change.get("eta_seconds")
    state = change["state"] + (" (resume)" if change.get("resumed") and change["state"] not in FINAL else "")
    if change["state"] in FINAL and change.get("exit_code") == EXIT_AGENT_NEVER_ANSWERED:
        state += " (its agent never answered)"  # a finished folder with no agent in it (compare/decisions.py)
    return [f"{change['arm']} seed {change['seed']}", state,
            "-" if fraction is None else f"{100 * fraction:5.1f} %",
            "-" if change.get("updates") is None else str(change["updates"]),
            "-" if eta is None or change["state"] in FINAL else duration(eta)]


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour: an ETA as the live tables show it."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class LiveTable:
    """A rich table of every run, redrawn in place as events arrive."""

    COLUMNS = ("run", "state", "progress", "updates", "eta")

    def __init__(self):
        from rich.console import Console
        from rich.live import Live

        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.live = Live(self._table(), console=Console(), auto_refresh=False)
        self.live.start()
        self.drawn = 0.0

    def __call__(self, change: dict[str, Any]) -> None:
        key = (change["arm"], change["seed"])
        self.rows[key] = {**self.rows.get(key, {}), **{k: v for k, v in change.items() if v is not None},
                          "eta_seconds": change.get("eta_seconds"), "state": change["state"]}
        now = time.monotonic()
        if now - self.drawn >= console.REDRAW_SECONDS or change["state"] in FINAL:
            self.drawn = now
            self.live.update(self._table(), refresh=True)

    def _table(self):
        from rich.table import Table

        table = Table(title="opalctl grid")
        for column in self.COLUMNS:
            table.add_column(column)
        for change in self.rows.values():
            table.add_row(*row(change))
        return table

    def close(self) -> None:
        self.live.update(self._table(), refresh=True)
        self.live.stop()
