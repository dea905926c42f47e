"""``opalctl show RUN --html PATH``: the page of one run: its identity, its stages with every reason, its loss
with stages and decisions, each metric across stages, its promotion timeline, its decisions and limitations.

A run folder does not say where its lock is, so the page names the lock's digest and leaves verifying it to
``opalctl verify LOCK`` (the grid's page, ``opalctl report LOCK``, shows the check).
"""

from __future__ import annotations

from pathlib import Path

from opalctl.files import atomic_write_text, storage
from opalctl.report import html
from opalctl.report.sections import (
    RunView,
    decisions_section,
    fractions,
    limitations_section,
    load_figures,
    loss_and_lr_figures,
    stage_series,
)


def write_run_page(run_dir: str | Path, path: str | Path) -> Path:
    run = RunView.read(Path(run_dir))
    clock = run.shown["budget"]["clock"]
    metrics = sorted({m for s in run.shown["stages"] for m in s["metrics"] if not m.endswith(".total")})
    page = html.document(f"opalctl show: {run.arm} seed {run.seed}", _identity(run, clock), _stages(run, metrics),
                         html.section("Figures", *_figures(run, metrics), anchor="figures"),
                         decisions_section([run]), limitations_section([run], []))
    target = Path(path)
    with storage(target, then="run `opalctl show --html` again with a path that can be written"):
        atomic_write_text(target, page)  # a page already there stays whole until the new one replaces it
    return target


def _identity(run: RunView, clock: str) -> str:
    shown = run.shown
    selected = shown["selected"]
    chosen = ("-" if selected is None else f"stage {selected['stage']}" if selected["source"] == "stage"
              else "the anchor (flagged: no stage qualified)")
    rows = [["run folder", shown["run_dir"]], ["arm", shown["arm"]], ["seed", shown["seed"]],
            ["status", shown["status"]], ["lock sha256", shown["lock_sha256"]], ["clock", clock],
            ["selected", chosen], ["verify", "opalctl verify LOCK re-hashes the lock's records"]]
    return html.section("The run", html.table(["", ""], rows), anchor="run")


def _stages(run: RunView, metrics: list[str]) -> str:
    rows = [[html.number_cell(s["stage"]), html.number_cell(s["fraction"]), html.number_cell(s["update"]),
             *[html.number_cell(s["metrics"].get(m), metric=m, stage=s["stage"]) for m in metrics],
             f"<td>{'yes' if s['promoted'] else 'no'}</td>", f"<td>{html.text('; '.join(s['reasons']) or '-')}</td>"]
            for s in run.shown["stages"]]
    # a zero-width space after each dot lets a long metric name break there, so the reasons keep room to read
    names = [m.replace(".", ".\u200b") for m in metrics]
    return html.section("Stages", html.table(["stage", "fraction", "update", *names, "promoted", "reasons"], rows,
                                             cells_ready=True), anchor="stages")


def _figures(run: RunView, metrics: list[str]) -> list[str]:
    figures = load_figures()
    parts = loss_and_lr_figures(figures, {run.arm: [run.loss_input()]}, run.shown["budget"]["clock"])
    if run.report:
        parts.append(html.figure(figures.stages_figure(stage_series([run], metrics), fractions([run])),
                                 "Each metric at every stage, on the stages' own scale; the anchor's value is in "
                                 "each title.", "stages"))
        parts.append(html.figure(figures.timeline_figure([run.timeline_input()]),
                                 "Promotion timeline: every stage and the model the run selected.", "timeline"))
    return parts
