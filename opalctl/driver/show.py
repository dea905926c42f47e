"""``opalctl show RUN_DIR``: one run read back from its records: stages, promotions and their reasons.

It only reads files; a run still in progress (or interrupted) shows the stages written so far. The folder is
read and its chain of digests checked as ``opalctl verify`` checks it (verify/folder.py, verify/chain.py), the
checkpoints hashed but not opened: a record that cannot be read (exit 1) or no longer matches its digest (exit 3)
is refused in one sentence naming the file, so ``show`` never shows what ``compare`` would not. An events line
damaged in the middle of the file is refused the same way; only a last events line cut short by a crash is
skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.errors import BadInput, OpalctlError
from opalctl.formats import Event, RecordDamaged, StageRecord, StartRecord, read_jsonl
from opalctl.layout import RunLayout
from opalctl.opal.records import DecisionRecord, line_changes
from opalctl.verify.folder import checked_run_folder, is_run_folder

NOT_IN_EVENTS = "not in the events"  # a decision the agent host answered that the training process's events omit


def show(run_dir: str | Path) -> dict[str, Any]:
    folder = Path(run_dir)
    layout = RunLayout.of(folder)
    if folder.is_dir() and not is_run_folder(folder) and (layout.held() or layout.grid_log.exists()):
        # a grid made it, or a run holds it, and its first record is not written yet: a run starting, not an error
        why = "a process holds its folder" if layout.held() else f"it holds only {layout.grid_log.name}"
        raise OpalctlError(f"{folder} is a run that has not started yet ({why}, and no start.json); show it again "
                           f"once it has started")
    if not folder.is_dir() or not is_run_folder(folder):
        raise BadInput(f"{folder} is not a run folder (it has no start.json); give runs/<name>-<sha>/<arm>/seed-<S>")
    read = checked_run_folder(folder)
    start = StartRecord.from_json(read.start.value)
    stages = [StageRecord.from_json(record.value) for record in read.stages]
    return {
        "run_dir": str(folder),
        "arm": start.arm,
        "seed": start.seed,
        "lock_sha256": start.lock_sha256,
        "budget": start.budget,
        "status": "finished" if read.report.sha256 is not None else "unfinished",
        "stages": [stage_row(stage) for stage in stages],
        "selected": read.selected.value,
        "report": read.report.value,
        "decisions": agent_decisions(layout.events, layout.decisions),
    }


def stage_row(stage: StageRecord) -> dict[str, Any]:
    """A stage as show (and watch) tell it: its figures, promoted or not, the reasons and the rules that refused."""
    return {"stage": stage.stage, "fraction": stage.fraction, "update": stage.update,
            "budget_used": stage.budget_used, "metrics": stage.metrics, "promoted": stage.promoted,
            "incumbent_after": stage.incumbent_after, "reasons": list(stage.decision.get("reasons") or []),
            "refused_by": _refused_by(stage.decision)}


def _refused_by(decision: dict[str, Any]) -> list[str]:
    """The promotion rules whose checks failed, each once, in the order checked."""
    rules: list[str] = []
    for check in decision.get("checks") or []:
        if isinstance(check, dict) and not check.get("passed", True) and check.get("rule") not in rules:
            rules.append(check.get("rule"))
    return rules


def agent_decisions(events_path: Path, decisions: Path | None = None) -> list[dict[str, Any]] | None:
    """Each decision of an agent arm: when asked, what became of it, the rationale's first line, seconds, cost,
    and for an applied one the files it changed with lines added and removed (``diff``).

    When and what became of it are the training process's account (``events_path``); what the agent answered
    (rationale, seconds, cost, the files changed) is the agent host's record where there is one (``decisions``, a
    run folder's ``RunLayout.decisions``), which the training process cannot rewrite. A decision the host recorded
    and the events do not mention is shown too (``outcome`` "not in the events")."""
    entries = None
    if events_path.exists():
        try:
            entries = _decisions(read_jsonl(events_path))
        except (KeyError, TypeError, AttributeError):
            raise RecordDamaged(f"{events_path} holds an event without the fields of its kind; the record is "
                                f"damaged, so its decisions cannot be shown") from None
    if decisions is not None and decisions.is_dir():
        entries = _as_the_host_saw_them(entries or [], decisions)
    return entries


def _as_the_host_saw_them(entries: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """``entries`` with what the agent host recorded of each decision in ``folder`` in place of the events' word."""
    by_number = {entry["decision"]: entry for entry in entries}
    for path in sorted(folder.glob("[0-9][0-9][0-9]")):
        record = DecisionRecord(path)
        answer = record.answer()
        if answer is None:
            continue
        entry = by_number.setdefault(int(path.name), {"decision": int(path.name), "asked_at": None, "reason": None,
                                                      "outcome": NOT_IN_EVENTS})
        lines = [line.strip() for line in (record.rationale or "").strip().splitlines() if line.strip()]
        entry.update(rationale=lines[0] if lines else "", seconds=answer.seconds, cost_usd=answer.cost_usd,
                     summary=next((line for line in lines if line.lower().startswith(("changed", "kept"))), ""),
                     answered_by=_answered_by(answer.remote))
        if answer.remote is not None:
            entry["round_trip_seconds"] = answer.remote.get("round_trip_seconds")
        if answer.failed:
            entry["message"] = answer.failed.splitlines()[0] if answer.failed.strip() else answer.failed
        elif entry["outcome"] in (Event.APPLIED, NOT_IN_EVENTS):
            running, answered = record.running(), record.answered()
            changed = [name for name in answered if answered[name] != running[name]]
            entry.update(files=changed, diff={name: line_changes(running[name], answered[name]) for name in changed})
    return [by_number[number] for number in sorted(by_number)]


def _answered_by(remote: dict[str, Any] | None) -> str:
    """Where a decision was worked: the agent host, or the server that answered its mailbox request."""
    if remote is None:
        return "agent host"
    if remote.get("server"):
        return f"opalctl agent serve on {remote.get('host')} ({remote['server']}) through {remote.get('mailbox')}"
    return f"no server (mailbox {remote.get('mailbox')})"


def _decisions(events) -> list[dict[str, Any]]:
    decisions: dict[int, dict[str, Any]] = {}
    reverted: dict[int, dict[str, Any]] = {}
    for event in events:
        kind = event.get("kind")
        if kind == Event.REQUESTED:
            decisions[event["decision"]] = {"decision": event["decision"], "asked_at": event["update"],
                                            "reason": event.get("reason"), "outcome": "pending"}
            if isinstance(event.get("notes"), list):  # the notes a person left that this decision showed
                decisions[event["decision"]]["notes"] = event["notes"]
        elif kind in Event.OUTCOMES and event.get("decision") in decisions:
            decisions[event["decision"]].update(_outcome(kind, event))
        elif kind == Event.REVERTED:
            reverted[event["version"]] = event
    for entry in decisions.values():
        if entry.get("outcome") == Event.APPLIED and entry.get("version") in reverted:
            entry["reverted_at"] = reverted[entry["version"]]["update"]
            entry["revert_reason"] = reverted[entry["version"]].get("message")
    return [decisions[k] for k in sorted(decisions)]


def _outcome(kind: str, event: dict[str, Any]) -> dict[str, Any]:
    """What an outcome event adds to its decision's entry."""
    return {"outcome": kind, "answered_at": event["update"], "rationale": event.get("rationale", ""),
            "summary": event.get("summary", ""), "seconds": event.get("seconds"), "cost_usd": event.get("cost_usd"),
            "version": event.get("version"), "files": event.get("files"), "diff": event.get("diff"),
            "message": event.get("message")}
