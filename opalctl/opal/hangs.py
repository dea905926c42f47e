"""What the guards found, in the records: the program versions that hung (a call that ran past its time limit and
did not stop when interrupted), torch's global state a program changed, and versions failed at a resume.

The watchdog (``guard.py``) ends the process then; before it does, the agent optimizer appends one line to
``hung.jsonl`` in its records folder (``<run>/training/opal/hung.jsonl`` in a formal run): the version, the call, the update,
the time limit and the sha256 of the version's two files. Unlike ``events.jsonl`` this file is never cut back when
a run resumes: a resumed run reads it, so that a version that hung is never loaded again (a resume checkpoint that
holds it as the running version hands over to its fallback at once, and the same files proposed again are
refused). A run therefore loses at most one resume-checkpoint interval to a hang.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from opalctl.formats import Event
from opalctl.layout import HUNG


class Hangs:
    """The hangs recorded in one records folder (none without a folder: nothing survives the process then)."""

    def __init__(self, folder: Path | None):
        self.path = Path(folder) / HUNG if folder is not None else None
        self.entries: list[dict[str, Any]] = self._read()

    def _read(self) -> list[dict[str, Any]]:
        if self.path is None or not self.path.is_file():
            return []
        entries = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # a line cut short by the end of the process: the hang it names is lost
                continue
            if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
                entries.append(entry)
        return entries

    @property
    def digests(self) -> set[str]:
        return {entry["sha256"] for entry in self.entries}

    def record(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` and make it durable (the process ends right after)."""
        self.entries.append(entry)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def how_to_continue(argv: list[str] | None = None) -> str:
    """How to continue after the process ended: the ``opalctl run`` command line with ``--resume`` when that is
    what is running, else a sentence saying so."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        if "--resume" not in args:
            args.append("--resume")
        return f"continue with `opalctl {shlex.join(args)}`"
    return "continue from the last checkpoint (a formal run: `opalctl run ... --resume`)"


class GuardFindings:
    """Writes what the guards found into the agent's records (events, and the errors the agent is shown at its
    next decision): torch's global state a program changed (once per version, call and setting), a hang, a
    version failed at a resume."""

    def __init__(self, hangs: Hangs, records, observer):
        self.hangs = hangs
        self.records = records
        self.observer = observer
        self.noted: set[tuple[Any, str, str]] = set()  # (version, call, setting) already recorded

    def torch_state_changed(self, guard, t: int) -> None:
        """Record the changes the guard put back since the last time (``guard.take_changes()``)."""
        for version, call, changed in guard.take_changes():
            number = getattr(version, "number", None)
            new = [what for what in changed if (number, call, what) not in self.noted]
            if not new:
                continue
            self.noted.update((number, call, what) for what in new)
            message = (f"{call} changed torch's global state ({', '.join(new)}); it was put back after the call. "
                       f"Leave it alone (use torch.no_grad() blocks and a torch.Generator of your own)")
            self.records.event(Event.LOG, update=t, values={"torch_state_restored": new, "version": number,
                                                             "call": call, "message": message})
            self.observer.record_error("torch_state", t, number, message)

    def hung(self, version, call: str, limit: float, t: int, slots) -> str:
        """A line of ``hung.jsonl`` (the version never runs again in this folder) and a ``reverted`` event, written
        from the watchdog's thread; returns the end of the sentence the watchdog prints."""
        number = version.number if version is not None else None
        fallback = (slots.fallback_for(version) if version is not None else slots.versions[0]).number
        self.hangs.record({"version": number, "call": call, "update": t, "limit": limit,
                           "sha256": version.digest if version is not None else ""})
        self.records.event(Event.REVERTED, update=t, version=number, to=fallback, reason="hung",
                           message=f"{call} ran past its time limit of {limit:g} s and did not stop",
                           traceback="", restored="none (the process ended)")
        self.records.flush()
        where = f"recorded in {self.hangs.path}, it never runs again; " if self.hangs.path is not None else ""
        return where + how_to_continue()

    def failed_at_resume(self, failures, t: int, slots) -> None:
        """The versions that could not run on from a resume checkpoint (they hung since, or could not be installed
        or take their state again; ``ProgramSlots.load_state_dict``): a ``reverted`` event each, and an error
        shown to the agent."""
        for version, message in failures:
            reason = "hung" if version.digest in slots.hung else "resume"
            self.records.event(Event.REVERTED, update=t, version=version.number,
                               to=slots.fallback_for(version).number, reason=reason, message=message, traceback="",
                               restored="none (resumed from the checkpoint)")
            self.observer.record_error(reason, t, version.number, message)
