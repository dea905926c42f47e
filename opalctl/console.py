"""Output conventions: data on stdout, messages and progress on stderr, rich only on a terminal.

Rich tables and progress bars appear only when the stream is a terminal, ``--json`` is off and ``NO_COLOR`` is
unset; otherwise output is plain text that pipes and diffs well. ``--json`` prints one canonical JSON document
on stdout and nothing else there.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

REDRAW_SECONDS = 0.25  # the most often a progress bar is drawn


def rich_enabled(stream=None, json_mode: bool = False) -> bool:
    stream = stream or sys.stdout
    return not json_mode and "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, sort_keys=True, indent=2, default=str) + "\n")
    sys.stdout.flush()


def message(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def table(title: str, columns: list[str], rows: Iterable[list[Any]], json_mode: bool = False,
          header: bool = True) -> None:
    rows = [[cell(v) for v in row] for row in rows]
    if rich_enabled(sys.stdout, json_mode):
        from rich.table import Table

        shown = Table(title=title, show_header=header)
        for column in columns:
            shown.add_column(column)
        for row in rows:
            shown.add_row(*row)
        _stdout_console().print(shown)
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = [title] if title else []
    if header:
        lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    sys.stdout.write("\n".join(lines) + "\n")


def cell(value: Any) -> str:
    """A value as a table shows it: - for None, thousands grouped, four significant digits."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if abs(value) >= 1000 or value == int(value):
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"
        return f"{value:.4g}"
    return str(value)


def pairs(title: str, items: list[tuple[str, Any]]) -> None:
    """A two-column key/value listing."""
    table(title, ["", ""], [[k, v] for k, v in items], header=False)


@contextmanager
def progress(description: str, json_mode: bool = False):
    """Yields ``update(done, total, **fields)``; draws a bar on a terminal (stderr), nothing otherwise.

    ``stage`` (the stages done) with ``stages`` (how many there are) shows as ``stage 1/4``, the stage being
    trained toward, numbered as the run's own lines number it (``stage 1/4 at update 300``).

    The bar is drawn by ``update`` itself, in the caller's thread and at most ``REDRAW_SECONDS`` apart, never by
    a refresh thread: a formal run calls ``update`` between two updates, and a thread drawing while an update runs
    would have its CPU time charged to training by the ``cpu`` clock, which counts every thread of the process.
    """
    if not rich_enabled(sys.stderr, json_mode):
        yield lambda done, total, **fields: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"),
                  TimeElapsedColumn(), transient=True, console=_stderr_console(), auto_refresh=False) as bar:
        task = bar.add_task(description, total=1.0, status="")
        drawn = -REDRAW_SECONDS

        def update(done: float, total: float, **fields: Any) -> None:
            nonlocal drawn
            now = time.monotonic()
            if now - drawn < REDRAW_SECONDS and done < total:
                return
            drawn = now
            status = "  ".join(f"{k} {cell(v)}" for k, v in status_fields(fields).items())
            bar.update(task, completed=done / total if total else 0.0, status=status)
            bar.refresh()

        yield update


def status_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The bar's fields as shown: ``stage`` done of ``stages`` becomes ``stage 1/4`` (never past the last)."""
    shown = dict(fields)
    if "stages" in shown:
        stages = shown.pop("stages")
        if "stage" in shown and stages:
            shown["stage"] = f"{min(int(shown['stage']) + 1, int(stages))}/{int(stages)}"
    return shown


def _stdout_console():
    from rich.console import Console

    return Console()


def terminal_width() -> int | None:
    """The width of the terminal stdout shows, or None when it is piped (then nothing is cut or wrapped)."""
    return _stdout_console().width if rich_enabled(sys.stdout) else None


def paragraph(text: str, indent: str = "") -> None:
    """A sentence of data on stdout: wrapped to the terminal's width, whole on one line when piped."""
    width = terminal_width()
    if width is None:
        sys.stdout.write(indent + text + "\n")
        return
    sys.stdout.write(textwrap.fill(text, width=width - 1, initial_indent=indent,
                                   subsequent_indent=indent + "  ") + "\n")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def size(value: float | int | None) -> str:
    if value is None:
        return "-"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
