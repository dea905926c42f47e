"""``opalctl show RUN_DIR``: one run read back from its records: stages, promotions and their reasons.

It only reads files; a run still in progress (or interrupted) shows the stages written so far.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.files import read_json


def show(run_dir: str | Path) -> dict[str, Any]:
    folder = Path(run_dir)
    if not (folder / "start.json").is_file():
        raise BadInput(f"{folder} is not a run folder (it has no start.json); give runs/<name>-<sha>/<arm>/seed-<S>")
    start = read_json(folder / "start.json")
    stages = [read_json(path) for path in sorted(folder.glob("stage-*.json"))]
    out: dict[str, Any] = {
        "run_dir": str(folder),
        "arm": start["arm"],
        "seed": start["seed"],
        "lock_sha256": start["lock_sha256"],
        "budget": start["budget"],
        "status": "finished" if (folder / "report.json").exists() else "unfinished",
        "stages": [{
            "stage": s["stage"], "fraction": s["fraction"], "update": s["update"], "budget_used": s["budget_used"],
            "metrics": s["metrics"], "promoted": s["promoted"], "incumbent_after": s["incumbent_after"],
            "reasons": s["decision"]["reasons"],
        } for s in stages],
        "selected": read_json(folder / "selected.json") if (folder / "selected.json").exists() else None,
        "report": read_json(folder / "report.json") if (folder / "report.json").exists() else None,
    }
    out["decisions"] = agent_decisions(folder / "opal" / "events.jsonl")
    return out


def agent_decisions(events_path: Path) -> list[dict[str, Any]] | None:
    """Each decision of an agent arm: when asked, what became of it, the rationale's first line, seconds, cost,
    and for an applied one the files it changed with lines added and removed (``diff``)."""
    if not events_path.exists():
        return None
    decisions: dict[int, dict[str, Any]] = {}
    reverted: dict[int, dict[str, Any]] = {}
    for line in events_path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        kind = event.get("kind")
        if kind == "requested":
            decisions[event["decision"]] = {"decision": event["decision"], "asked_at": event["update"],
                                            "reason": event.get("reason"), "outcome": "pending"}
        elif kind in ("applied", "kept", "load_failed", "decision_failed", "late") and event.get("decision") in decisions:
            entry = decisions[event["decision"]]
            entry.update(outcome=kind, answered_at=event["update"], rationale=event.get("rationale", ""),
                         summary=event.get("summary", ""),
                         seconds=event.get("seconds"), cost_usd=event.get("cost_usd"), version=event.get("version"),
                         files=event.get("files"), diff=event.get("diff"), message=event.get("message"))
        elif kind == "reverted":
            reverted[event["version"]] = event
    for entry in decisions.values():
        if entry.get("outcome") == "applied" and entry.get("version") in reverted:
            entry["reverted_at"] = reverted[entry["version"]]["update"]
            entry["revert_reason"] = reverted[entry["version"]].get("message")
    return [decisions[k] for k in sorted(decisions)]
