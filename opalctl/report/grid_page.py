"""``opalctl report LOCK``: the page of a whole grid: the lock and whether it still verifies, the verdicts, the
compare tables (each number with its exact value), the loss of every run with its stages and the agent's
decisions, each metric across stages per arm, the paired differences as a forest plot, the promotion timeline,
the decisions with rationale and diff, and the limitations.

Every figure on it comes from ``compare`` (the same call as ``opalctl compare --json``) and the runs' own records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl import __version__
from opalctl.compare.decisions import COUNTS, LEGEND
from opalctl.compare.significance import TEST_MIN_SEEDS
from opalctl.compare.values import TRAIN_LOSS
from opalctl.files import atomic_write_text, storage
from opalctl.layout import REPORT_PAGE
from opalctl.report import html
from opalctl.report.sections import (
    RunView,
    decisions_section,
    fractions,
    limitations_section,
    load_figures,
    loss_and_lr_figures,
    paired_table,
    seconds_label,
    stage_series,
)
from opalctl.report.targets import target_table


def write_grid_page(lock_path: str | Path, *, runs_dir=None, out: str | Path | None = None) -> Path:
    """Write the page to ``out/report.html`` (default: the lock's runs folder) and return its path."""
    from opalctl.compare.aggregate import compare
    from opalctl.verify.command import verify

    result = compare(lock_path, runs_dir=runs_dir)
    verification = verify(lock_path)
    runs = [RunView.read(Path(row.get("runs") or result["runs"]) / row["arm"] / f"seed-{seed}")
            for row in result["arms"] for seed in row["seeds"]]
    page = html.document(f"opalctl report: {Path(result['lock']).name}",
                         _identity(result, verification), _verdicts(result), compare_tables(result),
                         _decision_counts(result),
                         _figures(result, runs), decisions_section(runs),
                         limitations_section(runs, _notes(result)))
    path = (Path(out) if out is not None else Path(result["runs"])) / REPORT_PAGE
    with storage(path, then="run `opalctl report` again (or give --out a folder that can be written)"):
        atomic_write_text(path, page)  # a page already there stays whole until the new one replaces it
    return path


def _identity(result: dict[str, Any], verification: dict[str, Any]) -> str:
    if verification["ok"]:
        status = f'<span class="ok">verifies: all {verification["checked"]} records match</span>'
    else:
        changed = "; ".join(f"{p['role']} {p['path']} {p['status']}" for p in verification["problems"])
        status = f'<span class="bad">does not verify: {html.text(changed)}</span>'
    rows = [["lock", html.text(result["lock"])], ["sha256", f"<code>{html.text(result['lock_sha256'])}</code>"],
            ["still verifies", status], ["runs", html.text(result["runs"])],
            ["baseline", html.text(result["baseline"])], ["clock", html.text(result["clock"])],
            ["compared", html.text(result["stage"])], ["opalctl", html.text(__version__)]]
    return html.section("The lock", html.table(["", ""], [[f"<td>{k}</td>", f"<td>{v}</td>"] for k, v in rows],
                                                cells_ready=True), anchor="lock")


def _verdicts(result: dict[str, Any]) -> str:
    # each sentence once: an agent arm that never acted has the same one in place of every metric's verdict
    sentences = list(dict.fromkeys(f["verdict"] for arm in result["arms"] for f in arm["paired"].values()))
    anchors = [arm["anchor_note"] for arm in result["arms"] if arm["anchor_note"]]
    controls = ["Controls: " + c["sentence"] for c in result.get("controls") or []]  # compare/controls.py
    return html.section("Verdicts", html.paragraphs(sentences) or "<p>Only the baseline has runs.</p>",
                        html.paragraphs(controls), html.paragraphs(anchors, "muted"), anchor="verdicts")


def compare_tables(result: dict[str, Any]) -> str:
    arms = result["arms"]
    overview = [[f"<td>{html.text(a['arm'])}{' (baseline)' if a['baseline'] else ''}"
                 f"{' (post-hoc)' if a.get('post_hoc') else ''}</td>",
                 html.number_cell(len(a["seeds"]), arm=a["arm"], field="seeds"),
                 html.number_cell(a["updates"]["mean"], arm=a["arm"], field="updates"),
                 html.number_cell(a[result["seconds_key"]]["mean"], arm=a["arm"], field=result["seconds_key"]),
                 html.number_cell(a["promoted_stages"]["mean"], arm=a["arm"], field="promoted_stages"),
                 html.number_cell(a["selected_anchor"], arm=a["arm"], field="selected_anchor")] for a in arms]
    metrics = [[f"<td>{html.text(m)}</td>", f"<td>{html.text(d)}</td>",
                *[cell for a in arms for cell in (html.number_cell(a["metrics"][m]["mean"], arm=a["arm"], metric=m,
                                                                   field="mean"),
                                                  html.number_cell(a["metrics"][m]["std"], arm=a["arm"], metric=m,
                                                                   field="std"))]]
               for m, d in result["metrics"].items()]
    return html.section(
        "Arms", html.table(["arm", "seeds", "updates", seconds_label(result["seconds_key"]), "promoted stages",
                            "anchor kept"], overview, cells_ready=True),
        f"<h3>Metrics of the {html.text(result['stage'])} models (mean and sd over seeds)</h3>",
        html.table(["metric", "better", *[f"{a['arm']} {x}" for a in arms for x in ("mean", "sd")]], metrics,
                   cells_ready=True),
        paired_table(result),
        target_table(result),
        anchor="tables")


def _forest_row(arm: dict[str, Any], figure: dict[str, Any]) -> dict[str, Any]:
    """An arm's point on the forest plot: the mean paired difference and its t-interval, as the table gives them
    (no interval where the t-test has none: one seed, or no spread)."""
    mean = figure["mean_difference"]
    low, high = figure.get("t_ci_low"), figure.get("t_ci_high")
    return {"arm": arm["arm"] + (" (post-hoc)" if arm.get("post_hoc") else ""), "mean": mean,
            "low": mean if low is None else low, "high": mean if high is None else high,
            "reliable": figure["n"] >= TEST_MIN_SEEDS}


def _decision_counts(result: dict[str, Any]) -> str:
    """The agent arms' decisions counted from their run folders (compare/decisions.py), summed over seeds, with
    each count defined; a fixed arm has no row (no decisions, not zero of them)."""
    arms = [a for a in result["arms"] if a.get("decisions")]
    if not arms:
        return ""
    rows = [[f"<td>{html.text(a['arm'])}</td>",
             *[html.number_cell(a["decisions"]["total"][key], arm=a["arm"], field=f"decisions_{key}")
               for key in COUNTS],
             f"<td>{len(a['decisions']['acted_seeds'])} of {len(a['seeds'])}</td>",
             f"<td>{html.text(a['decisions']['no_verdict'] or a['decisions']['note'] or '')}</td>"] for a in arms]
    legend = "".join(f"<li><b>{key.replace('_', ' ')}</b>: {html.text(LEGEND[key])}</li>" for key in COUNTS)
    return html.section(
        "Did the agent act?",
        html.table(["arm", *[key.replace("_", " ") for key in COUNTS], "seeds acted on", "what follows"], rows,
                   cells_ready=True),
        f"<ul class=\"muted\">{legend}<li><b>seeds acted on</b>: seeds where at least one decision was applied; an "
        f"arm that acted on none gets no verdict, and a seed whose agent never answered is left out of the paired "
        f"figures</li></ul>", anchor="acted")


def _figures(result: dict[str, Any], runs: list[RunView]) -> str:
    figures = load_figures()
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_arm.setdefault(run.arm, []).append(run.loss_input())
    directions = result["metrics"]
    metrics = [m for m in directions if m != TRAIN_LOSS]
    forest = {m: [_forest_row(a, a["paired"][m]) for a in result["arms"] if m in a["paired"]] for m in directions}
    forest = {m: rows for m, rows in forest.items() if rows}
    final = {m: {a["arm"]: list(a["values"][m].values()) for a in result["arms"] if a["values"].get(m)}
             for m in directions}
    final = {m: arms for m, arms in final.items() if arms}
    parts = loss_and_lr_figures(figures, by_arm, result["clock"])
    if final:
        parts.append(html.figure(figures.final_figure(final, directions, result["stage"]),
                                 f"Each metric of the {result['stage']} models on its own scale: a dot per seed, a "
                                 f"bar at the arm's mean; the title says which way is better.", "final"))
    parts.append(html.figure(figures.stages_figure(stage_series(runs, metrics), fractions(runs)),
                             f"Each metric across stages per arm: the mean over seeds, the band from the lowest to the "
                             f"highest seed ({figures.BAND}); the anchor's value is in each title.", "stages"))
    if forest:
        parts.append(html.figure(figures.forest_figure(forest, result["baseline"], directions),
                                 "Paired differences to the baseline with their 95 % t-intervals (the table's); the "
                                 "arrow under each panel points to the better side; a hollow marker: fewer than "
                                 f"{TEST_MIN_SEEDS} seeds, where the exact test that decides cannot reach p < 0.05.",
                                 "forest"))
    parts.append(html.figure(figures.timeline_figure([run.timeline_input() for run in runs]),
                             "Promotion timeline: every stage of every run and the model each run selected.", "timeline"))
    return html.section("Figures", *parts, anchor="figures")


def _notes(result: dict[str, Any]) -> list[str]:
    return sorted({f["note"] for arm in result["arms"] for f in arm["paired"].values() if f["note"]})
