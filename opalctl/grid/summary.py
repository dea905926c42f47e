"""The end of a grid: every run's outcome, the comparison of what has finished, how to go on, the exit code."""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

from opalctl import console
from opalctl.compare.decisions import agent_warnings, never_answered
from opalctl.errors import EXIT_AGENT_NEVER_ANSWERED, EXIT_FAILURE, OpalctlError
from opalctl.grid.records import DONE_STATES, FAILED, FINAL, INTERRUPTED, GridResult, resume_hint


def closing_compare(result: GridResult) -> tuple[dict[str, Any] | None, str | None]:
    """``opalctl compare`` of the lock's finished runs, or None and the sentence that says why there is none."""
    from opalctl.compare.aggregate import compare

    try:
        return compare(result.lock, runs_dir=result.runs_dir), None
    except OpalctlError as error:
        return None, error.message


def exit_code(result: GridResult, comparison: dict[str, Any] | None = None) -> int:
    """0 when every run finished; 5 when they all finished but the agent of one never answered (as that run's own
    exit, compare/decisions.py); 128 + the signal when the grid was stopped (as a run's own); else 1."""
    if result.ok:
        return EXIT_AGENT_NEVER_ANSWERED if never_answered(comparison) else 0
    if result.stopped_by is not None:
        return 128 + signal.Signals[result.stopped_by]
    return EXIT_FAILURE


def render_end(result: GridResult, comparison: dict[str, Any] | None, note: str | None) -> None:
    """The outcome table, the compare table, then what to do next, on stderr."""
    from opalctl.compare.render import render_compare

    counts = ", ".join(f"{result.count(state)} {state}" for state in FINAL if result.count(state))
    console.paragraph(f"opalctl grid {result.lock}: {len(result.outcomes)} run(s), {counts} ({result.executor}, "
                      f"{result.jobs} at a time, {result.wall_seconds:.1f} s)")
    unfinished = [o for o in result.outcomes if o.state not in DONE_STATES]
    if unfinished:  # the live table (or the JSON lines) showed the others already
        console.table("runs not finished", ["arm", "seed", "state", "exit", "log"],
                      [[o.arm, o.seed, o.state, o.exit_code, o.log] for o in unfinished])
    if comparison is not None:
        render_compare(comparison)
    elif note:
        console.message(f"no comparison yet: {note}")
    advise(result, comparison)


def advise(result: GridResult, comparison: dict[str, Any] | None = None) -> None:
    """What to do next, on stderr: which agent arms did not act, which runs failed and where their output is, how
    to continue."""
    for warning in agent_warnings(comparison):
        console.message("warning: " + warning)
    failed = [o for o in result.outcomes if o.state == FAILED]
    for outcome in failed:
        console.message(f"failed: {outcome.arm} seed {outcome.seed} (exit {outcome.exit_code}); its output is "
                        f"in {outcome.log}")
    interrupted = result.count(INTERRUPTED)
    if result.stopped_by is not None:
        console.message(f"opalctl: grid stopped ({result.stopped_by}); {resume_hint(result)}")
    elif failed:
        also = f" and {interrupted} interrupted" if interrupted else ""
        console.message(f"{len(failed)} run(s) failed{also}; after fixing the cause, {resume_hint(result)}")
    elif interrupted:  # stopped by a signal from outside the grid (a kill, a cancelled Slurm task): nothing to fix
        console.message(f"{interrupted} run(s) interrupted; {resume_hint(result)}")


def print_json_end(result: GridResult, comparison: dict[str, Any] | None, note: str | None) -> None:
    """The last JSON line of ``--json``: the grid's result and its comparison."""
    sys.stdout.write(json.dumps({"event": "grid", **result.to_json(), "compare": comparison, "compare_note": note,
                                 "agent_warnings": agent_warnings(comparison)}, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
    advise(result, comparison)
