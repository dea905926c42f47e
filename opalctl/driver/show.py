"""``opalctl show RUN_DIR``: one run read back from its records: stages, promotions and their reasons.

It only reads files; a run still in progress (or interrupted) shows the stages written so far. Every record is
read through ``opalctl.formats``: a stage file that lacks a field, or an events line damaged in the middle of the
file, is refused in one sentence naming the file; only a last events line cut short by a crash is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.files import read_json
from opalctl.formats import Event, StageRecord, read_jsonl


def show(run_dir: str | Path) -> dict[str, Any]:
    folder = Path(run_dir)
    if not (folder / "start.json").is_file():
        raise BadInput(f"{folder} is not a run folder (it has no start.json); give runs/<name>-<sha>/<arm>/seed-<S>")
    start = read_json(folder / "start.json")
    stages = [StageRecord.from_json(read_json(path), what=str(path)) for path in sorted(folder.glob("stage-*.json"))]
    return {
        "run_dir": str(folder),
        "arm": start["arm"],
        "seed": start["seed"],
        "lock_sha256": start["lock_sha256"],
        "budget": start["budget"],
        "status": "finished" if (folder / "report.json").exists() else "unfinished",
        "stages": [_stage_row(stage) for stage in stages],
        "selected": _optional_json(folder / "selected.json"),
        "report": _optional_json(folder / "report.json"),
        "decisions": agent_decisions(folder / "opal" / "events.jsonl"),
    }


def _stage_row(stage: StageRecord) -> dict[str, Any]:
    return {"stage": stage.stage, "fraction": stage.fraction, "update": stage.update,
            "budget_used": stage.budget_used, "metrics": stage.metrics, "promoted": stage.promoted,
            "incumbent_after": stage.incumbent_after, "reasons": stage.decision["reasons"],
            "refused_by": _refused_by(stage.decision)}


def _refused_by(decision: dict[str, Any]) -> list[str]:
    """The promotion rules whose checks failed, each once, in the order checked."""
    rules: list[str] = []
    for check in decision.get("checks", []):
        if not check.get("passed", True) and check.get("rule") not in rules:
            rules.append(check.get("rule"))
    return rules


def _optional_json(path: Path) -> Any:
    return read_json(path) if path.exists() else None


def agent_decisions(events_path: Path) -> list[dict[str, Any]] | None:
    """Each decision of an agent arm: when asked, what became of it, the rationale's first line, seconds, cost,
    and for an applied one the files it changed with lines added and removed (``diff``)."""
    if not events_path.exists():
        return None
    decisions: dict[int, dict[str, Any]] = {}
    reverted: dict[int, dict[str, Any]] = {}
    for event in read_jsonl(events_path):
        kind = event.get("kind")
        if kind == Event.REQUESTED:
            decisions[event["decision"]] = {"decision": event["decision"], "asked_at": event["update"],
                                            "reason": event.get("reason"), "outcome": "pending"}
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
