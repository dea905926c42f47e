"""Replay of a recorded agent run (``backend: replay:<run folder>``): the same program versions, with no agent.

The original run's records say, for each decision, what became of it (``opal/events.jsonl``: ``applied`` and
``load_failed`` name the version, ``kept`` and ``decision_failed`` name none) and hold every version's files
(``opal/programs/vNNN/``). At decision N the replay writes into the workspace the files of the version the
original made at its decision N, leaves the workspace as it is when the original kept its programs, and fails
the decision when the original's failed, so the replayed run meets the same outcomes in the same order. Its
rationale is the original's, under a first line naming the source.

Decisions are matched by number. When the original was blocking and ran on the ``updates`` clock, its decisions
fall at the same updates in the replay, which then ends bit for bit where the original ended (same arithmetic,
same programs at the same updates). A non-blocking original applied its answers some updates after asking;
its replay applies them when asked, so it is close to, not equal to, the original.

The folder is a formal run's folder (``runs/<name>-<sha>/<arm>/seed-<S>``, holding ``opal/``) or an ``opal``
records folder itself (``wrap(..., run_dir=...)``). A relative path is taken from the current folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.opal.agents.base import Answer, Backend

PROGRAM_FILES = ("updater.py", "analysis.py")
OUTCOMES = ("applied", "load_failed", "kept", "decision_failed")


class ReplayBackend(Backend):
    name = "replay"
    runs_in = "thread"  # it copies two files

    def __init__(self, source: str | Path):
        given = str(source)
        folder = Path(given).expanduser()
        records = folder / "opal" if (folder / "opal" / "events.jsonl").is_file() else folder
        events_path = records / "events.jsonl"
        if not events_path.is_file():
            raise BadInput(f"replay:{given}: there is no recorded agent run there (no {events_path}); give the run "
                           f"folder of an agent arm, runs/<name>-<sha>/<arm>/seed-<S>, relative to the current folder")
        self.source = folder.resolve()
        self.records = records.resolve()
        self.plan: dict[int, dict[str, Any]] = {}
        for line in events_path.read_text(encoding="utf-8").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash of the original
            if event.get("kind") in OUTCOMES and isinstance(event.get("decision"), int):
                self.plan[event["decision"]] = event
        self.programs: dict[int, dict[str, str]] = {}
        for event in self.plan.values():
            if event["kind"] in ("applied", "load_failed"):
                version = int(event["version"])
                folder_v = self.records / "programs" / f"v{version:03d}"
                missing = [name for name in PROGRAM_FILES if not (folder_v / name).is_file()]
                if missing:
                    raise BadInput(f"replay:{given}: version {version} of decision {event['decision']} has no "
                                   f"{', '.join(missing)} under {folder_v}; the run's records are incomplete")
                self.programs[version] = {name: (folder_v / name).read_text(encoding="utf-8")
                                          for name in PROGRAM_FILES}

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "source": str(self.source), "decisions": len(self.plan)}

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        number = int(facts.get("decision") or 0)
        event = self.plan.get(number)
        if event is None:
            return Answer(rationale=f"Replay of {self.source}: the original run answered no decision {number}.\n"
                                    f"Kept: the programs as they are.")
        kind = event["kind"]
        original = self._original_rationale(number, event)
        if kind == "decision_failed":
            return Answer(rationale="", failed=f"replayed: decision {number} failed in the original run "
                                               f"({event.get('message') or 'no message'})")
        if kind in ("applied", "load_failed"):
            version = int(event["version"])
            for name, text in self.programs[version].items():
                (Path(workspace) / name).write_text(text, encoding="utf-8")
            head = f"Replay of {self.source}: decision {number} {kind.replace('_', ' ')} version {version}."
        else:
            head = f"Replay of {self.source}: decision {number} kept the programs."
        return Answer(rationale=head + ("\n" + original if original else ""))

    def _original_rationale(self, number: int, event: dict[str, Any]) -> str:
        path = self.records / "decisions" / f"{number:03d}" / "response.md"
        if path.is_file():
            return path.read_text(encoding="utf-8").strip()
        return str(event.get("rationale") or "")
