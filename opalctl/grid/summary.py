"""The end of a grid: every run's outcome, the comparison of what has finished, how to go on, the exit code."""

from __future__ import annotations

import signal
import sys
from typing import Any

from opalctl import console
from opalctl.errors import EXIT_FAILURE, OpalctlError
from opalctl.grid.records import FAILED, INTERRUPTED, GridResult, resume_hint


def closing_compare(result: GridResult) -> tuple[dict[str, Any] | None, str | None]:
    """``opalctl compare`` of the lock's finished runs, or None and the sentence that says why there is none."""
    from opalctl.compare.aggregate import compare

    try:
        return compare(result.lock, runs_dir=result.runs_dir), None
    except OpalctlError as error:
        return None, error.message


def exit_code(result: GridResult) -> int:
    """0 when every run finished; 128 + the signal when the grid was stopped (as a run's own); else 1."""
    if result.ok:
        return 0
    if result.stopped_by is not None:
        return 128 + signal.Signals[result.stopped_by]
    return EXIT_FAILURE


def render_end(result: GridResult, comparison: dict[str, Any] | None, note: str | None) -> None:
    """The outcome table, the compare table, then what to do next, on stderr."""
    from opalctl.compare.render import render_compare

    console.table(f"opalctl grid {result.lock} ({result.executor}, {result.jobs} at a time, "
                  f"{result.wall_seconds:.1f} s)", ["arm", "seed", "state", "exit", "log"],
                  [[o.arm, o.seed, o.state, o.exit_code, o.log if o.state == FAILED else ""] for o in result.outcomes])
    if comparison is not None:
        render_compare(comparison)
    elif note:
        console.message(f"no comparison yet: {note}")
    advise(result)


def advise(result: GridResult) -> None:
    """What to do next, on stderr: which runs failed and where their output is, how to continue."""
    failed = [o for o in result.outcomes if o.state == FAILED]
    for outcome in failed:
        console.message(f"failed: {outcome.arm} seed {outcome.seed} (exit {outcome.exit_code}); its output is "
                        f"in {outcome.log}")
    if result.stopped_by is not None:
        console.message(f"opalctl: grid stopped ({result.stopped_by}); {resume_hint(result)}")
    elif failed or result.count(INTERRUPTED):
        console.message(f"{len(failed)} run(s) failed; after fixing the cause, {resume_hint(result)}")


def print_json_end(result: GridResult, comparison: dict[str, Any] | None, note: str | None) -> None:
    """The last JSON line of ``--json``: the grid's result and its comparison."""
    import json

    sys.stdout.write(json.dumps({"event": "grid", **result.to_json(), "compare": comparison, "compare_note": note},
                                sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
    advise(result)
