"""``opalctl suite report``: the suite's page, one offline HTML file (the report page's document, its content
security policy, its numbers with their exact values): the suite lock and its tasks, each arm's score with its range
over seeds, the performance profiles as a figure, what the scores can and cannot say, and every task's tables as
``opalctl report`` shows them (arms, metrics, paired figures, time to target)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.files import atomic_write_text, storage
from opalctl.report import html
from opalctl.report.sections import load_figures

PAGE_NAME = "suite.html"


def write_suite_page(summary: dict[str, Any], out: str | Path) -> Path:
    figures = load_figures()
    steps = {arm: summary["profiles"]["arms"][arm]["steps"] for arm in summary["arms"]}
    page = html.document(
        f"opalctl suite: {summary['name']}",
        _identity(summary),
        html.section("Scores", _scores(summary),
                     html.figure(figures.profile_figure(steps, summary["profiles"]["tau_max"]),
                                 "Performance profiles: for each arm, the fraction of the suite's tasks on which its "
                                 "median time-to-target is within tau times the fastest arm's; the score is the area "
                                 "under it from 1 to 4, divided by 3.", "profiles"),
                     html.paragraphs(summary["statement"]), html.paragraphs(summary["notes"], "muted"),
                     anchor="scores"),
        *[_task(task, entry) for task, entry in summary["tasks"].items()])
    path = Path(out) / PAGE_NAME
    with storage(path, then="run `opalctl suite report` again (or give --out a folder that can be written)"):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, page)
    return path


def _identity(summary: dict[str, Any]) -> str:
    rows = [["suite lock", html.text(summary["suite_lock"])],
            ["sha256", f"<code>{html.text(summary['suite_sha256'])}</code>"],
            ["baseline", html.text(summary["baseline"])], ["arms", html.text(", ".join(summary["arms"]))]]
    rows += [[f"task {html.text(task)}", html.text(entry["lock"])] for task, entry in summary["tasks"].items()]
    return html.section("The suite", html.table(["", ""], [[f"<td>{k}</td>", f"<td>{v}</td>"] for k, v in rows],
                                                 cells_ready=True), anchor="suite")


def _scores(summary: dict[str, Any]) -> str:
    tasks = list(summary["tasks"])
    rows = []
    for arm in summary["arms"]:
        figure = summary["profiles"]["arms"][arm]
        seeds = list(summary["seed_scores"][arm].values())
        rows.append([f"<td>{html.text(arm)}{' (baseline)' if arm == summary['baseline'] else ''}</td>",
                     html.number_cell(figure["score"], arm=arm, field="score"),
                     html.number_cell(min(seeds) if seeds else None, arm=arm, field="score_min"),
                     html.number_cell(max(seeds) if seeds else None, arm=arm, field="score_max"),
                     *[_ratio_cell(figure["ratios"][task], arm, task) for task in tasks],
                     *[_time_cell(summary["tasks"][task]["times"][arm], arm, task) for task in tasks]])
    return html.table(["arm", "score", "lowest seed's", "highest seed's", *[f"ratio {t}" for t in tasks],
                       *[f"median time {t}" for t in tasks]], rows, cells_ready=True)


def _ratio_cell(value: float | None, arm: str, task: str) -> str:
    if value is None:
        return f'<td class="n" data-arm="{html.text(arm)}" data-task="{html.text(task)}" data-field="ratio">never</td>'
    return html.number_cell(value, arm=arm, task=task, field="ratio")


def _time_cell(value: float | None, arm: str, task: str) -> str:
    if value is None:
        return f'<td class="n" data-arm="{html.text(arm)}" data-task="{html.text(task)}" data-field="time">never</td>'
    return html.number_cell(value, arm=arm, task=task, field="time")


def _task(task: str, entry: dict[str, Any]) -> str:
    from opalctl.report.grid_page import compare_tables

    result = entry["compare"]
    sentences = list(dict.fromkeys(f["verdict"] for arm in result["arms"] for f in arm["paired"].values()))
    return html.section(f"Task {task}", html.paragraphs([f"Lock {result['lock']}; its own page: opalctl report "
                                                         f"{result['lock']}."], "muted"),
                        html.paragraphs(sentences), compare_tables(result),
                        anchor=f"task-{task}")
