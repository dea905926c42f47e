"""``opalctl show RUN_DIR``: one run read back from its records: stages, promotions and their reasons.

It only reads files; a run still in progress (or interrupted) shows the stages written so far.
"""

from __future__ import annotations

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
    decisions = folder / "opal" / "events.jsonl"
    out["agent_events"] = decisions.read_text().count("\n") if decisions.exists() else None
    return out
