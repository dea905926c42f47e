"""The progress bar: drawn only on a terminal, by the caller's own thread, at most every REDRAW_SECONDS."""

from __future__ import annotations

import io
import threading

from rich.console import Console

from opalctl import console


def test_the_bar_is_drawn_by_the_caller_and_no_thread_draws_while_training_runs(monkeypatch):
    """A refresh thread would draw while an update runs, and the ``cpu`` clock would charge its CPU to training."""
    screen = io.StringIO()
    monkeypatch.setattr(console, "rich_enabled", lambda stream=None, json_mode=False: not json_mode)
    monkeypatch.setattr(console, "_stderr_console", lambda: Console(file=screen, force_terminal=True, width=100))
    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    threads = set(threading.enumerate())
    with console.progress("adamw seed 1") as update:
        assert set(threading.enumerate()) == threads, "no thread was started to draw the bar"
        update(10, 100, stage=0, loss=2.5)
        drawn = screen.getvalue()
        assert "adamw seed 1" in drawn and "loss 2.5" in drawn
        clock[0] += console.REDRAW_SECONDS / 2
        update(20, 100, stage=0, loss=1.25)
        assert screen.getvalue() == drawn, "not drawn again sooner than REDRAW_SECONDS"
        clock[0] += console.REDRAW_SECONDS
        update(30, 100, stage=1, loss=0.75)
        assert "loss 0.75" in screen.getvalue()[len(drawn):]
        before = screen.getvalue()
        update(100, 100, stage=4, loss=0.5)  # the end is always drawn
        assert "loss 0.5" in screen.getvalue()[len(before):]


def test_no_bar_off_a_terminal_or_with_json(monkeypatch):
    monkeypatch.setattr(console, "_stderr_console", lambda: (_ for _ in ()).throw(AssertionError("drawn")))
    with console.progress("adamw seed 1", json_mode=True) as update:
        update(1, 2, stage=0)


def test_the_bar_numbers_stages_as_the_run_lines_do_from_1_of_4_to_4_of_4(monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(console, "rich_enabled", lambda stream=None, json_mode=False: not json_mode)
    monkeypatch.setattr(console, "_stderr_console", lambda: Console(file=screen, force_terminal=True, width=100))
    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    shown = []
    with console.progress("adamw seed 1") as update:
        for done, stage in ((10, 0), (30, 1), (60, 2), (80, 3), (100, 4)):
            before = len(screen.getvalue())
            update(done, 100, stage=stage, stages=4, loss=0.5)
            shown.append(screen.getvalue()[before:])
            clock[0] += console.REDRAW_SECONDS
    # training toward stage 1 is "stage 1/4"; once every stage is done (the end) it stays "stage 4/4"
    for text, expected in zip(shown, ["1/4", "2/4", "3/4", "4/4", "4/4"]):
        assert f"stage {expected}" in text and "stage 0" not in text and "stages" not in text
    assert console.status_fields({"stage": 2, "loss": 1.0}) == {"stage": 2, "loss": 1.0}  # without a count: as given
