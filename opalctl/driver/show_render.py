"""How ``opalctl show RUN`` prints, legible at 100 columns: the stages with short metric labels and the rules that
refused each (the full reasons with ``--reasons``), the agent's decisions (the rationale whole when piped, cut to
fit on a terminal) and, for the offline heuristic, which rule decided each on which signal, then ``selected:``. Everything is data and goes to stdout; only hints go to stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl import console
from opalctl.compare.labels import legend, short_labels
from opalctl.layout import RunLayout
from opalctl.opal.agents.heuristic import Check, decided_by

RATIONALE_ON_TERMINAL = 48  # characters of a rationale shown in the table on a terminal


def render_show(result: dict[str, Any], *, reasons: bool = False) -> None:
    metrics = sorted({m for s in result["stages"] for m in s["metrics"] if not m.endswith(".total")})
    labels = short_labels(metrics)
    console.table(f"{result['arm']} seed {result['seed']} ({result['status']})",
                  ["stage", "frac", "update", *[labels[m] for m in metrics], "promoted", "refused"],
                  [[s["stage"], s["fraction"], s["update"], *[s["metrics"].get(m) for m in metrics],
                    "yes" if s["promoted"] else "no", ", ".join(s["refused_by"]) or "-"] for s in result["stages"]])
    if legend(labels):
        console.paragraph("legend: " + legend(labels))
    if reasons:
        for stage in result["stages"]:
            for reason in stage["reasons"]:
                console.paragraph(f"stage {stage['stage']}: {reason}")
    elif any(s["reasons"] for s in result["stages"]):
        console.message("(--reasons prints every refusal's reason in full)")
    if result["decisions"]:
        _decisions(result["decisions"])
        _rules(result)
    _closing_lines(result)


def _decisions(decisions: list[dict[str, Any]]) -> None:
    cut = console.terminal_width() is not None
    rows = []
    for d in decisions:
        text = d.get("summary") or d.get("rationale") or d.get("message") or ""
        if cut and len(text) > RATIONALE_ON_TERMINAL:
            text = text[:RATIONALE_ON_TERMINAL - 1] + "…"
        rows.append([d["decision"], d["asked_at"], d["reason"],
                     d["outcome"] + (f" (reverted at {d['reverted_at']})" if d.get("reverted_at") else ""),
                     d.get("answered_at"), d.get("seconds"), d.get("cost_usd"), changed(d), text])
    console.table("agent decisions", ["decision", "asked at", "reason", "outcome", "answered", "s", "$", "changed",
                                      "rationale"], rows)
    if cut:
        console.message("(piped, or with --json, the rationale is printed whole)")
    for d in decisions:  # a person in the loop (opalctl say): which decision saw which note
        for note in d.get("notes") or []:
            if isinstance(note, dict):
                console.message(f"decision {d['decision']} was shown note {note.get('note')} from {note.get('who')} "
                                f"({note.get('at')})")


def rule_of(run_dir: str | Path, decision: int) -> Check | None:
    """The rule that decided decision ``decision`` of a formal run's agent (the heuristic records one; other
    backends do not), from the decision's record (the agent host's, where there is one: ``RunLayout.decisions``)."""
    return decided_by(RunLayout.of(run_dir).decision_folder(decision))


def _rules(result: dict[str, Any]) -> None:
    rows = []
    for d in result["decisions"]:
        check = rule_of(result["run_dir"], d["decision"])
        if check is not None:
            rows.append([d["decision"], d.get("answered_at"), check.rule, check.signal, check.value,
                         f"{check.comparison} {console.cell(check.threshold)}" if check.threshold is not None else "-"])
    if rows:
        console.table("heuristic rules (the one that decided each decision)",
                      ["decision", "at", "rule", "signal", "value", "threshold"], rows)


def _closing_lines(result: dict[str, Any]) -> None:
    integrity = ((result.get("report") or {}).get("agent") or {}).get("eval_integrity")
    if integrity:
        console.paragraph(f"evaluation integrity: {integrity['flagged']} flagged round trip(s)"
                          + (f" in {', '.join(integrity['tensors'])}" if integrity["tensors"] else "")
                          + f", {integrity['information']} lasting jump(s) recorded as information")
    if result["selected"]:
        selected = result["selected"]
        console.paragraph("selected: " + (f"stage {selected['stage']}" if selected["source"] == "stage"
                                          else "the anchor (flagged: no stage qualified)"))


def changed(decision: dict) -> str:
    """The files an applied decision changed, with lines added and removed: ``updater.py +3 -1``."""
    diff = decision.get("diff") or {}
    return ", ".join(f"{name} +{diff[name]['added']} -{diff[name]['removed']}" if name in diff else name
                     for name in decision.get("files") or []) or "-"
