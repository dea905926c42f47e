"""What the report page reads of one run beyond its report: the loss and the learning rates from the steps
records, against updates and against the budget the protocol's clock charged, and the agent's decisions.

Each kept point has its update number, the budget used after it (``used``: the clock's charge summed, in the
clock's unit: updates, cpu seconds, ...), its loss and the learning rate of each parameter group its step used
(``lrs``; None in a steps file written before opalctl recorded them). ``seconds`` (the running sum of each
update's cpu charge under the ``cpu`` clock, of its wall seconds otherwise; ``Curve.seconds_key`` names the stage
records' field on that axis) is what TensorBoard's wall time reads.
A long run's curve is thinned to at most ``CURVE_POINTS`` points by taking every k-th update, plus the last, so a
20-run page stays small and renders in seconds; the thinning never averages (the points are updates that ran).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opalctl.driver.records import read_steps
from opalctl.files import read_plain
from opalctl.formats import PROGRAM_MAX_BYTES, Event, RecordDamaged
from opalctl.layout import RunLayout, version_name
from opalctl.opal.records import PROGRAM_FILES, DecisionRecord

CURVE_POINTS = 1500


@dataclass
class Curve:
    """A run's training loss: update numbers, seconds and losses of the kept points, and seconds of every
    update number asked for with ``seconds_at``."""

    seconds_key: str = "train_wall_seconds"
    updates: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    used: list[float] = field(default_factory=list)
    lrs: list[list[float | None] | None] = field(default_factory=list)
    _all_seconds: dict[int, float] = field(default_factory=dict)
    _all_used: dict[int, float] = field(default_factory=dict)

    def seconds_at(self, update: int | None) -> float | None:
        return None if update is None else self._all_seconds.get(int(update))

    def used_at(self, update: int | None) -> float | None:
        """The budget used after update ``update``, in the clock's unit."""
        return None if update is None else self._all_used.get(int(update))


def loss_curve(run_dir: Path, every_update: bool = False) -> Curve:
    """The run's loss against training seconds, thinned to ``CURVE_POINTS`` unless ``every_update``; empty
    without records. A finished run's steps file was checked against its digest already (``show``); an
    unfinished run's that does not decode is refused naming it."""
    path = RunLayout.of(run_dir).steps
    if not path.is_file():
        return Curve()
    try:
        return _curve(path, every_update)
    except (ValueError, KeyError, TypeError, RecursionError):
        raise RecordDamaged(f"{path} holds a line that is not a steps record; the record is damaged, so the loss "
                            f"cannot be drawn") from None
    except OSError as error:
        raise RecordDamaged(f"{path} cannot be read ({error}); the record is damaged, so the loss cannot be "
                            f"drawn") from None


def _curve(path: Path, every_update: bool) -> Curve:
    lines = list(read_steps(path))
    on_cpu = bool(lines) and lines[0].get("cpu") is not None
    curve = Curve(seconds_key="train_cpu_seconds" if on_cpu else "train_wall_seconds")
    stride = 1 if every_update else max(1, -(-len(lines) // CURVE_POINTS))
    total = 0.0
    for index, line in enumerate(lines):
        total += (line.get("cpu") or 0.0) if on_cpu else line["wall"]
        curve._all_seconds[line["update"]] = total
        curve._all_used[line["update"]] = float(line.get("used", line["update"]))
        loss = line["loss"]
        if (index % stride == 0 or index == len(lines) - 1) and isinstance(loss, (int, float)) and loss - loss == 0:
            curve.updates.append(line["update"])
            curve.seconds.append(total)
            curve.losses.append(float(loss))
            curve.used.append(curve._all_used[line["update"]])
            curve.lrs.append(_rates(line.get("lrs")))
    return curve


def _rates(value: Any) -> list[float | None] | None:
    """A line's learning rates as drawn: None for a line without them (an older opalctl's, or a step of no torch
    optimizer), and None for a group whose value is not a finite number."""
    if not isinstance(value, list):
        return None
    return [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v - v == 0 else None
            for v in value]


def program_diff(run_dir: Path, decision: int, version: int | None, files: list[str] | None) -> str:
    """The unified diff an applied decision made to the agent's programs: from the running programs the agent host
    was given to the ones it answered (its record of decision ``decision``); in a folder without the host's records,
    from the training process's versions (``version - 1 -> version``); '' if the program files are not there."""
    layout = RunLayout.of(run_dir)
    record = DecisionRecord(layout.decision_folder(decision))
    if record.by_host:
        running, answered = record.running(), record.answered()
        parts = []
        for name in running:
            if running[name] != answered[name]:
                parts.extend(difflib.unified_diff(running[name].splitlines(keepends=True),
                                                  answered[name].splitlines(keepends=True),
                                                  fromfile=f"running/{name}", tofile=f"decision {decision:03d}/{name}"))
        return "".join(parts)
    if not version or not files:
        return ""

    parts = []
    for name in files:
        if name not in PROGRAM_FILES:  # the events are the training process's account: only its program files
            continue
        old = _program_text(layout.program_version(version - 1) / name)
        new = _program_text(layout.program_version(version) / name)
        if new is None:
            continue
        parts.extend(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                          fromfile=f"{version_name(version - 1)}/{name}",
                                          tofile=f"{version_name(version)}/{name}"))
    return "".join(parts)


def _program_text(path: Path) -> str | None:
    """A program file of the training process's records, or None when it is not a readable one (``read_plain``)."""
    try:
        return read_plain(path, PROGRAM_MAX_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def decision_marks(decisions: list[dict[str, Any]] | None, curve: Curve) -> list[dict[str, Any]]:
    """Each decision as a mark: its update, the budget used there and what became of it (a reverted one twice:
    applied when answered, reverted when rolled back)."""
    marks = []
    for decision in decisions or []:
        if decision["outcome"] == "pending" or decision.get("answered_at") is None:
            continue
        kind = decision["outcome"] if decision["outcome"] in (Event.APPLIED, Event.KEPT) else "other"
        marks.append({"update": decision["answered_at"], "used": curve.used_at(decision["answered_at"]), "kind": kind})
        if decision.get("reverted_at") is not None:
            marks.append({"update": decision["reverted_at"], "used": curve.used_at(decision["reverted_at"]),
                          "kind": Event.REVERTED})
    return marks
