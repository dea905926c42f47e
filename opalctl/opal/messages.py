"""What the agent reads at a decision: the prompt, then the facts of the run in a fixed order.

The same facts go to ``.opal/facts.json`` in the workspace as data (the heuristic agent reads that file), so an
offline agent and an LLM decide from exactly the same information. ``losses_observed`` counts the losses seen
since the last decision (``Observer.observed_since``); at 0 the message says so in words, never as a trend.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

MAX_BINS = 16
NO_LOSS = ("No loss was observed since the last decision: step() ran without one, so nothing can be said of the "
           "loss or its trend.")


def prompt_text(name: str) -> str:
    if name not in ("neutral", "aggressive"):
        raise ValueError(f"unknown prompt {name!r}; use 'neutral' or 'aggressive'")
    return resources.files("opalctl.opal").joinpath("prompts", f"{name}.md").read_text("utf-8")


def rebin(bins: list[dict[str, Any]], limit: int = MAX_BINS) -> list[dict[str, Any]]:
    """Merge consecutive loss bins so that at most ``limit`` remain (means weighted by count)."""
    if len(bins) <= limit:
        return [dict(b) for b in bins]
    size = -(-len(bins) // limit)
    merged = []
    for start in range(0, len(bins), size):
        group = bins[start:start + size]
        counted = [b for b in group if b.get("mean") is not None]
        total = sum(b["count"] - b.get("nonfinite", 0) for b in counted)
        merged.append({
            "start": group[0]["start"], "end": group[-1]["end"],
            "mean": (sum(b["mean"] * (b["count"] - b.get("nonfinite", 0)) for b in counted) / total) if total else None,
            "min": min((b["min"] for b in counted), default=None),
            "max": max((b["max"] for b in counted), default=None),
            "count": sum(b["count"] for b in group),
            "nonfinite": sum(b.get("nonfinite", 0) for b in group),
        })
    return merged


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render(facts: dict[str, Any], sources: dict[str, str]) -> str:
    lines = [f"# Decision {facts['decision']} ({facts['reason']})", ""]
    lines.append(f"Goal: {facts.get('goal') or 'lower the training loss without losing generality'}")
    total = facts.get("total_steps")
    lines.append(f"Run: update {facts['update']}" + (f" of {total}" if total else "") +
                 f", {100 * facts['progress']:.1f} % of the budget used; {facts['remaining']} scheduled decision(s) "
                 f"remain after this one.")
    lines.append(f"Learning rates now: {', '.join(_number(x) for x in facts.get('lrs', []))}")
    if facts.get("notes"):  # a person watching the run left these (opalctl say; opal/notes.py)
        lines += ["", "## Notes from a person watching this run", "",
                  "Shown once, at this decision; weigh them as you see fit.", ""]
        lines += [f"- note {note['note']}, from {note['who']} at {note['at']}: {note['text']}"
                  for note in facts["notes"]]
    lines += ["", "## Loss since the last decision", ""]
    observed = facts.get("losses_observed")
    if observed == 0:
        lines += [NO_LOSS, ""]
    elif observed is not None:
        lines += [f"{observed} loss(es) observed since the last decision.", ""]
    lines += ["| updates | mean | min | max | non-finite |", "|---|---|---|---|---|"]
    for b in facts["losses"]["bins"]:
        lines.append(f"| {b['start']}-{b['end']} | {_number(b['mean'])} | {_number(b['min'])} | {_number(b['max'])} "
                     f"| {b.get('nonfinite', 0)} |")
    if not facts["losses"]["bins"]:
        lines.append("| (no losses recorded yet) | | | | |")
    lines += ["", "## Latest analysis report", "", "```json", json.dumps(facts.get("report"), indent=1, sort_keys=True),
              "```", "", "## What became of your last change", ""]
    last = facts.get("last_change")
    lines.append(json.dumps(last, sort_keys=True) if last else "No change has been made yet.")
    lines += ["", "## Errors since the last decision", ""]
    if facts.get("errors"):
        for error in facts["errors"]:
            lines.append(f"- update {error.get('update')}, version {error.get('version')}: {error.get('kind')}: "
                         f"{error.get('message')}")
            if error.get("traceback"):
                lines += ["```", error["traceback"].rstrip(), "```"]
    else:
        lines.append("None.")
    timing = facts.get("timing") or {}
    lines += ["", "## Timing of your programs", "",
              f"updater step: {_number(timing.get('updater_ms'))} ms on average; analysis: "
              f"{_number(timing.get('analysis_ms'))} ms per call.", ""]
    audit = facts.get("audit") or {}
    if audit:
        lines += ["## Operator calls per update (profiled once, at each version's second update)", ""]
        for version, counts in audit.items():
            top = ", ".join(f"{name} x{count}" for name, count in (counts.get("top") or [])[:6])
            syncs = counts.get("syncs")
            lines.append(f"- {version}: {counts.get('ops')} operator calls"
                         + (f", {syncs} host synchronisations" if syncs is not None else "") + (f" ({top})" if top else ""))
        lines.append("")
    for name in ("updater.py", "analysis.py"):
        lines += [f"## {name} (now running)", "", "```python", sources[name].rstrip(), "```", ""]
    lines.append("Edit the files in your workspace, then end with your rationale.")
    return "\n".join(lines) + "\n"
