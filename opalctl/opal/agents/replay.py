"""Replay of a recorded agent run (``backend: replay:<run folder>``): the same program versions, with no agent.

The original run's events say, for each decision, what became of it (``opal/events.jsonl``: ``applied`` and
``load_failed`` name a version, ``kept`` and ``decision_failed`` name none). The programs are the ones the
original's agent host answered at that decision (``agent/decisions/NNN/updater.py``, ``analysis.py``, checked
against the host's ``answer.json``); a folder made before the host kept records gives them from the training
process's versions (``opal/programs/vNNN/``). At decision N the replay writes into the workspace the programs the
original's host answered at its decision N, leaves the workspace as it is when the original kept its programs, and
fails the decision when the original's failed, so the replayed run meets the same outcomes in the same order. Its
rationale is the original's (the host's record of it), under a first line naming the source.

Decisions are matched by number. When the original was blocking and ran on the ``updates`` clock, its decisions
fall at the same updates in the replay, which then ends bit for bit where the original ended (same arithmetic,
same programs at the same updates). A non-blocking original applied its answers some updates after asking;
its replay applies them when asked, so it is close to, not equal to, the original.

The folder is a formal run's folder (``runs/<name>-<sha>/<arm>/seed-<S>``, holding ``training/opal/`` and
``agent/``) or an ``opal`` records folder itself (``wrap(..., run_dir=...)``, with the host's records in its
``agent/``). A relative path is taken from the current folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.formats import Event, read_jsonl
from opalctl.layout import AGENT, DECISIONS, OPAL_STREAM_FILES, PROGRAMS, RunLayout, version_name
from opalctl.opal.agents.base import Answer, Backend, BackendKind
from opalctl.opal.agents.workspace import write_file_here
from opalctl.opal.programs import PROGRAM_FILES
from opalctl.opal.records import DecisionRecord

# the outcomes a replay reproduces (a decision the original answered ``late`` is not in the plan: the replay keeps)
REPLAYED = (Event.APPLIED, Event.LOAD_FAILED, Event.KEPT, Event.DECISION_FAILED)
# the outcomes whose event names the version the original wrote
WITH_VERSION = (Event.APPLIED, Event.LOAD_FAILED)


class ReplayBackend(Backend):
    name = "replay"
    runs_in = "host"  # it reads another run's folder, which a confined training process may not read

    def __init__(self, source: str | Path):
        given = str(source)
        folder = Path(given).expanduser()
        layout = RunLayout.of(folder)
        if layout.events.is_file():
            records, host = layout.opal, layout.host_decisions
        else:
            records, host = folder, folder / AGENT / DECISIONS
        events_path = records / OPAL_STREAM_FILES["events"]
        if not events_path.is_file():
            raise BadInput(f"replay:{given}: there is no recorded agent run there (no {events_path}); give the run "
                           f"folder of an agent arm, runs/<name>-<sha>/<arm>/seed-<S>, relative to the current folder")
        self.source = folder.resolve()
        self.records = records.resolve()
        # the host's records where the original had a host; else the training process's (a legacy folder, keep)
        self.decisions = host.resolve() if host.is_dir() else self.records / DECISIONS
        # a last line cut short by a crash of the original is skipped; damage elsewhere is refused
        self.plan: dict[int, dict[str, Any]] = {
            event["decision"]: event for event in read_jsonl(events_path)
            if event.get("kind") in REPLAYED and isinstance(event.get("decision"), int)}
        self.programs = {number: self._program_files(given, event)
                         for number, event in self.plan.items() if event["kind"] in WITH_VERSION}

    def _program_files(self, given: str, event: dict[str, Any]) -> dict[str, str]:
        """The programs of the decision an ``applied`` or ``load_failed`` event names: the ones the original's host
        answered, else (no host record) the files of the version it names; refused when one is missing."""
        record = DecisionRecord(self.decisions / f"{event['decision']:03d}")
        if record.by_host:
            return record.answered()
        version = int(event["version"])
        folder = self.records / PROGRAMS / version_name(version)
        missing = [name for name in PROGRAM_FILES if not (folder / name).is_file()]
        if missing:
            raise BadInput(f"replay:{given}: version {version} of decision {event['decision']} has no "
                           f"{', '.join(missing)} under {folder}; the run's records are incomplete")
        return {name: (folder / name).read_text(encoding="utf-8") for name in PROGRAM_FILES}

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "source": str(self.source), "decisions": len(self.plan)}

    def recipe(self) -> dict[str, Any]:
        return {"backend": f"{self.name}:{self.source}", "options": {}}

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        number = int(facts.get("decision") or 0)
        event = self.plan.get(number)
        if event is None:
            return Answer(rationale=f"Replay of {self.source}: the original run answered no decision {number}.\n"
                                    f"Kept: the programs as they are.")
        kind = event["kind"]
        original = self._original_rationale(number, event)
        if kind == Event.DECISION_FAILED:
            return Answer(rationale="", failed=f"replayed: decision {number} failed in the original run "
                                               f"({event.get('message') or 'no message'})")
        if kind in WITH_VERSION:
            for name, text in self.programs[number].items():
                write_file_here(Path(workspace) / name, text.encode("utf-8"))
            head = f"Replay of {self.source}: decision {number} {kind.replace('_', ' ')} version {event['version']}."
        else:
            head = f"Replay of {self.source}: decision {number} kept the programs."
        return Answer(rationale=head + ("\n" + original if original else ""))

    def _original_rationale(self, number: int, event: dict[str, Any]) -> str:
        text = DecisionRecord(self.decisions / f"{number:03d}").rationale
        return text.strip() if text is not None else str(event.get("rationale") or "")


# a relative run folder is taken from the current folder
KIND = BackendKind(name="replay", waits=False, factory=ReplayBackend, argument="run folder")
