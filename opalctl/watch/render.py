"""How ``opalctl watch`` shows what it read (watch/reader.py): a view redrawn in place on a terminal, one JSON line
per change otherwise, or the view printed once.

The view: one row per run (state, budget used, updates, ETA, the last training loss, a sparkline of the recent
loss, the current learning rate of each parameter group, the last decision), like the grid's live table
(grid/display.py); for one run, its stages and decisions in full under it; for a lock, a feed of the latest
events (a stage judged, a decision made, a run's new state) under the table.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from typing import Any

from opalctl import console
from opalctl.grid.display import duration

BARS = "▁▂▃▄▅▆▇█"
CURVE_WIDTH = 16  # sparkline characters: each the mean of an equal share of the recent steps lines
FEED_LINES = 10  # the latest events under a lock's table
DECISIONS_SHOWN = 8  # the latest decisions under one run's stages


def display_for(subject, *, json_mode: bool, once: bool):
    """A live view on a terminal (``--json`` off), the view printed once with ``once``, else JSON lines."""
    if once:
        return PrintedView(subject)
    if console.rich_enabled(sys.stdout, json_mode):
        return LiveView(subject)
    return JsonFeed(subject, sys.stdout)


class JsonFeed:
    """One canonical JSON line per change (sorted keys), then one ``"event": "end"`` line with every run's state
    (``stopped``: Ctrl-C ended the watch before the runs ended)."""

    def __init__(self, subject, stream):
        self.subject, self.stream = subject, stream

    def show(self, changes: list[dict[str, Any]]) -> None:
        for change in changes:
            self._write(change)

    def close(self, stopped: bool) -> None:
        self._write({"event": "end", "stopped": stopped, "target": self.subject.title,
                     "runs": [{"arm": run.arm, "seed": run.seed, "state": run.state} for run in self.subject.runs]})

    def _write(self, line: dict[str, Any]) -> None:
        self.stream.write(json.dumps(line, sort_keys=True, default=str) + "\n")
        self.stream.flush()


class Feed:
    """The latest stage, decision and state changes, each told in one line with the time it was seen."""

    def __init__(self, size: int = FEED_LINES):
        self.lines: deque[str] = deque(maxlen=size)

    def add(self, changes: list[dict[str, Any]], first: bool) -> None:
        at = time.strftime("%H:%M:%S")
        for change in changes:
            told = event_line(change)
            if told and not (first and change["event"] == "state"):  # a state on the first look is no event
                self.lines.append(f"{at}  {_label(change)}  {told}")


class LiveView:
    """The view, redrawn in place (rich Live) at every look; it stays on the screen when the watch ends."""

    def __init__(self, subject):
        from rich.console import Console
        from rich.live import Live

        self.subject, self.feed, self.first = subject, Feed(), True
        self.console = Console()
        self.live = Live(renderable(subject, self.feed), console=self.console, auto_refresh=False)
        self.live.start()

    def show(self, changes: list[dict[str, Any]]) -> None:
        self.feed.add(changes, self.first)
        self.first = False
        self.live.update(renderable(self.subject, self.feed), refresh=True)

    def close(self, stopped: bool) -> None:
        self.live.update(renderable(self.subject, self.feed), refresh=True)
        self.live.stop()
        self.console.print(ending(self.subject, stopped))


class PrintedView:
    """The view as it stands, printed once (``--once``)."""

    def __init__(self, subject):
        self.subject, self.feed = subject, Feed()

    def show(self, changes: list[dict[str, Any]]) -> None:
        self.feed.add(changes, first=True)

    def close(self, stopped: bool) -> None:
        from rich.console import Console

        Console(width=console.terminal_width() or 120).print(renderable(self.subject, self.feed))


def ending(subject, stopped: bool) -> str:
    """The sentence under the view when the watch ends."""
    counts: dict[str, int] = {}
    for run in subject.runs:
        counts[run.state] = counts.get(run.state, 0) + 1
    states = ", ".join(f"{count} {state}" for state, count in sorted(counts.items()))
    if stopped:
        return f"stopped watching ({states}); the runs were left as they are"
    return f"every watched run has ended ({states})"


# -- the pieces of the view ----------------------------------------------------------------------------------------

def renderable(subject, feed: Feed):
    from rich.console import Group
    from rich.text import Text

    parts = [runs_table(subject)]
    if not subject.lock and subject.runs:
        run = subject.runs[0].view()
        parts += [stages_table(run["stages"]), decisions_table(run["decisions"])]
    if feed.lines:
        parts += [Text("latest events", style="bold"), *(Text(line, overflow="ellipsis", no_wrap=True)
                                                         for line in feed.lines)]
    problems = [f"{run.label}: {run.problem}" for run in subject.runs if run.problem]
    parts += [Text(problem, style="yellow") for problem in problems]
    return Group(*parts)


def runs_table(subject):
    from rich import box
    from rich.table import Table

    # the last decision takes what the other columns leave, cut short: the feed and the run's view tell it whole
    table = Table(title=f"opalctl watch {subject.title}", title_justify="left", expand=True, box=box.SIMPLE_HEAD)
    for column in ("run", "state", "budget", "updates", "eta", "loss", "recent loss", "lr"):
        table.add_column(column, no_wrap=True)
    table.add_column("last decision", overflow="ellipsis", no_wrap=True, ratio=1, min_width=12)
    for watch in subject.runs:
        table.add_row(*run_row(watch.view()))
    return table


def run_row(run: dict[str, Any]) -> list[str]:
    fraction, eta, state = run.get("fraction"), run.get("eta_seconds"), run.get("state") or "-"
    last = run["decisions"][-1] if run["decisions"] else None
    return [f"{run['arm']} seed {run['seed']}" if run["seed"] is not None else run["arm"], state,
            "-" if fraction is None else f"{100 * fraction:5.1f} %",
            "-" if run.get("updates") is None else str(run["updates"]),
            "-" if eta is None or state != "running" else duration(eta),
            "-" if run.get("loss") is None else f"{run['loss']:.4g}",
            sparkline(run["recent_losses"]) or "-", learning_rates(run.get("lrs")),
            "-" if last is None else f"#{last['decision']} {last['outcome']}: {_without_outcome(last['said'])}"]


def _without_outcome(said: str) -> str:
    """A summary without its first word where that word repeats the outcome (``Kept:``, ``Changed:``)."""
    head, _, rest = said.partition(": ")
    return rest if rest and head.lower() in ("kept", "changed") else said


def stages_table(stages: list[dict[str, Any]]):
    from rich import box
    from rich.table import Table

    table = Table(title="stages", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("stage", "update", "metrics", "promoted"):
        table.add_column(column, no_wrap=column != "metrics")
    table.add_column("why", overflow="fold")
    for stage in stages:
        table.add_row(str(stage["stage"]), str(stage["update"]), metrics_text(stage["metrics"]),
                      "yes" if stage["promoted"] else "no", stage_why(stage))
    return table


def decisions_table(decisions: list[dict[str, Any]]):
    from rich import box
    from rich.table import Table

    table = Table(title="decisions" + (f" (the last {DECISIONS_SHOWN} of {len(decisions)})"
                                       if len(decisions) > DECISIONS_SHOWN else ""), title_justify="left",
                  box=box.SIMPLE_HEAD)
    for column in ("#", "asked at", "outcome"):
        table.add_column(column, no_wrap=True)
    table.add_column("rule or rationale", overflow="fold")
    for decision in decisions[-DECISIONS_SHOWN:]:
        table.add_row(str(decision["decision"]), str(decision.get("asked_at") or "-"), decision["outcome"],
                      decision["said"])
    return table


def event_line(change: dict[str, Any]) -> str | None:
    """A change told in a line of the feed; None for what the feed does not tell (progress)."""
    event = change["event"]
    if event == "state":
        return f"now {change['state']}"
    if event == "stage":
        where = f"stage {change['stage']} ({100 * change['fraction']:.0f} %)"
        return f"{where}: {'promoted, ' if change['promoted'] else 'refused '}{stage_why(change)}"
    if event == "decision":
        return f"decision {change['decision']} at update {change.get('asked_at')}: {change['outcome']}: " \
               f"{_without_outcome(change['said'])}"
    return None


def stage_why(stage: dict[str, Any]) -> str:
    """The promotion's reason in a line: the rules that refused it and their first reason, or why it won."""
    reasons = stage.get("reasons") or []
    first = reasons[0] if reasons else ""
    if stage.get("promoted"):
        return f"incumbent now stage {stage.get('incumbent_after')}" + (f" ({first})" if first else "")
    refused = ", ".join(str(rule) for rule in stage.get("refused_by") or [])
    return (f"by {refused}: " if refused else "") + (first or "no reason recorded") + \
        (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else "")


def metrics_text(metrics: dict[str, Any]) -> str:
    """A stage's metrics but the totals, compactly (the totals are the same at every stage)."""
    return ", ".join(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
                     for name, value in metrics.items() if not name.endswith(".total"))


def sparkline(values: list[float | None], width: int = CURVE_WIDTH) -> str:
    """The recent values as a line of block characters: each the mean of an equal share, low to high."""
    values = [value for value in values if value is not None]
    if not values:
        return ""
    shares = min(width, len(values))
    means = []
    for share in range(shares):
        part = values[share * len(values) // shares:(share + 1) * len(values) // shares]
        means.append(sum(part) / len(part))
    low, high = min(means), max(means)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return BARS[len(BARS) // 2] * len(means)
    return "".join(BARS[round((mean - low) / (high - low) * (len(BARS) - 1))] for mean in means)


def learning_rates(lrs: list[float | None] | None) -> str:
    """The learning rate of each parameter group (one figure when they agree); ``-`` before a step ran."""
    if not lrs:
        return "-"
    shown = ["?" if lr is None else f"{lr:.3g}" for lr in lrs]
    return shown[0] if len(set(shown)) == 1 else "/".join(shown)


def _label(change: dict[str, Any]) -> str:
    return change["arm"] if change.get("seed") is None else f"{change['arm']} seed {change['seed']}"
