"""The program versions that hung: a call that ran past its time limit and did not stop when interrupted.

The watchdog (``guard.py``) ends the process then; before it does, the agent optimizer appends one line to
``hung.jsonl`` in its records folder (``<run>/opal/hung.jsonl`` in a formal run): the version, the call, the update,
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

HUNG_FILE = "hung.jsonl"


class Hangs:
    """The hangs recorded in one records folder (none without a folder: nothing survives the process then)."""

    def __init__(self, folder: Path | None):
        self.path = Path(folder) / HUNG_FILE if folder is not None else None
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


def resume_hint(argv: list[str] | None = None) -> str:
    """How to continue after the process ended: the ``opalctl run`` command line with ``--resume`` when that is
    what is running, else a sentence saying so."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        if "--resume" not in args:
            args.append("--resume")
        return f"continue with `opalctl {shlex.join(args)}`"
    return "continue from the last checkpoint (a formal run: `opalctl run ... --resume`)"
