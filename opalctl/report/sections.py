"""The parts both pages share: one run read for the page (``RunView``), the agent's decisions with rationale,
the rule that decided each (the offline heuristic's) and diff, the limitations, the figure inputs built from a set
of runs, and the table of paired figures with the legend of its columns (``compare.columns``)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.driver.budget import clock_spec
from opalctl.driver.show import show
from opalctl.driver.show_render import rule_of
from opalctl.errors import OpalctlError
from opalctl.report import html
from opalctl.report.runs import Curve, decision_marks, loss_curve, program_diff


@dataclass
class RunView:
    """One run as the page shows it: ``show``'s reading of the folder and its loss curve."""

    arm: str
    seed: int
    run_dir: Path
    shown: dict[str, Any]  # opalctl.driver.show.show(run_dir)
    curve: Curve

    @classmethod
    def read(cls, run_dir: Path) -> RunView:
        shown = show(run_dir)
        return cls(shown["arm"], shown["seed"], Path(run_dir), shown, loss_curve(run_dir))

    @property
    def report(self) -> dict[str, Any]:
        return self.shown["report"] or {}

    def loss_input(self) -> dict[str, Any]:
        """What ``figures.loss_figure`` and ``figures.lr_figure`` draw of this run."""
        stages = [{"update": s["update"], "used": s.get("budget_used", s["update"]), "promoted": s["promoted"]}
                  for s in self.report.get("stages", [])]
        return {"seed": self.seed, "curve": self.curve, "stages": stages,
                "marks": decision_marks(self.shown["decisions"], self.curve)}

    def timeline_input(self) -> dict[str, Any]:
        stages = self.report.get("stages", [])
        selected = self.report.get("selected") or {"source": "anchor"}
        fraction = next((s["fraction"] for s in stages if selected["source"] == "stage"
                         and s["stage"] == selected["stage"]), 0.0)
        return {"label": f"{self.arm} s{self.seed}", "stages": [(s["fraction"], s["promoted"]) for s in stages],
                "selected_fraction": fraction}

    def metric_series(self, metric: str) -> list[float]:
        """The metric at the anchor, then at every stage."""
        return [self.report["anchor_metrics"].get(metric),
                *[s["metrics"].get(metric) for s in self.report.get("stages", [])]]


def load_figures():
    """The figures module, which needs matplotlib; without it, one sentence saying what to install."""
    try:
        from opalctl.report import figures
    except ImportError as error:
        if getattr(error, "name", "") and not error.name.startswith("matplotlib"):
            raise
        raise OpalctlError("the report page's figures need matplotlib, which is not installed; install it with "
                           "`pip install matplotlib`") from None
    return figures


def charge_label(clock: str) -> str | None:
    """The x label of the loss against the budget the protocol's clock charged; None under a clock that counts
    updates, where that axis is the updates axis already."""
    unit = clock_spec(clock).unit
    return None if unit == "updates" else f"budget charged by the {clock} clock ({unit})"


def loss_and_lr_figures(figures, by_arm: dict[str, list[dict[str, Any]]], clock: str) -> list[str]:
    """The loss figure and, where the steps records hold them, the learning-rate figure, with their captions."""
    loss, span = figures.loss_figure(by_arm, charge_label(clock))
    seeds = max(len(runs) for runs in by_arm.values())
    several = len(by_arm) > 1 or seeds > 1
    smoothing = f"an exponential moving average with a span of {span} updates (debiased at the start)"
    if several:
        what = (f"Training loss against updates{', every arm on one axis' if len(by_arm) > 1 else ''}: each seed "
                f"smoothed by {smoothing}, the line the mean over seeds, "
                + (f"the band the seeds' {figures.BAND} of the smoothed curves." if seeds > 1 else "one seed each: "
                   "no band."))
    else:
        what = f"Training loss against updates, smoothed by {smoothing}."
    marks = (" Dotted lines: stages; triangles along the bottom: agent decisions that changed the program (a cross: "
             "reverted).")
    axis = (" Right: the same against the budget the clock charged." if charge_label(clock) else
            f" The {clock} clock charges one per update, so updates are the budget's own axis.")
    parts = [html.figure(loss, what + marks + axis, "loss")]
    lr = figures.lr_figure(by_arm)
    if lr is None:
        parts.append("<p class=\"muted\">These runs' steps records hold no learning rates (written by an opalctl "
                     "older than that record).</p>")
        return parts
    spread = (f" The line is the mean over seeds, the band the seeds' {figures.BAND}." if seeds > 1 else "")
    parts.append(html.figure(lr, "Learning rate of each parameter group as each update's step used it (after an "
                                 f"agent's program scaled it), against updates.{spread}", "lr"))
    return parts


def seconds_label(seconds_key: str) -> str:
    return "training cpu seconds" if seconds_key == "train_cpu_seconds" else "training wall seconds"


def decisions_section(runs: list[RunView]) -> str:
    """Every agent decision of these runs: when, what became of it, the rule that decided it (the heuristic's: which
    rule fired on which signal), the whole rationale and the diff. The decisions that changed something (applied,
    reverted, failed) come first; those that kept the program are folded under one line that counts them."""
    changes, kept = [], []
    for run in runs:
        for d in run.shown["decisions"] or []:
            outcome = d["outcome"] + (f" (reverted at update {d['reverted_at']}: {d.get('revert_reason') or ''})"
                                      if d.get("reverted_at") is not None else "")
            diff = (program_diff(run.run_dir, d["decision"], d.get("version"), d.get("files"))
                    if d["outcome"] == "applied" else "")
            rationale = "\n\n".join(p for p in (d.get("summary"), d.get("rationale"), d.get("message")) if p)
            rule = rule_of(run.run_dir, d["decision"])
            row = [f"<td>{html.text(run.arm)} s{run.seed}</td>", html.number_cell(d["decision"]),
                   html.number_cell(d["asked_at"]), f"<td>{html.text(d['reason'])}</td>",
                   f"<td>{html.text(outcome)}</td>", html.number_cell(d.get("answered_at")),
                   f"<td>{html.text(rule.words() if rule is not None else '-')}</td>",
                   f"<td><pre>{html.text(rationale)}</pre></td>",
                   f"<td>{'<details><summary>diff</summary><pre>' + html.text(diff) + '</pre></details>' if diff else '-'}</td>"]
            (kept if d["outcome"] == "kept" else changes).append((row, rule))
    if not changes and not kept:
        return html.section("Agent decisions", "<p class=\"muted\">No run here has an agent.</p>", anchor="decisions")
    columns = ["run", "#", "asked at", "why asked", "outcome", "answered at", "rule (signal, value, threshold)",
               "rationale", "diff"]
    parts = [html.table(columns, [row for row, _ in changes], cells_ready=True) if changes else
             "<p>No decision changed the program.</p>"]
    if kept:
        why = Counter("no rule recorded" if rule is None else rule.signal if rule.rule == "none" else rule.rule
                      for _, rule in kept)
        reasons = (next(iter(why)) if len(why) == 1 else
                   "; ".join(f"{text}: {count}" for text, count in why.most_common()))
        summary = (f"{len(kept)} decision{'s' if len(kept) != 1 else ''} kept the program"
                   f" ({html.text(reasons)})")
        parts.append(f'<details class="kept"><summary>{summary}</summary>'
                     f"{html.table(columns, [row for row, _ in kept], cells_ready=True)}</details>")
    return html.section("Agent decisions", *parts, anchor="decisions")


SINGLE_SEED = re.compile(r"^One run of arm '(?P<arm>[^']*)' on seed -?\d+: a single seed says nothing about spread; ")


def limitations_section(runs: list[RunView], notes: list[str]) -> str:
    """Each run's limitations once, with how many runs state it, then the statistical notes. Each run's report
    says that one seed says nothing about spread: on a page of several runs that is said once, with the seeds
    each arm has here."""
    counts: Counter = Counter(item for run in runs for item in run.report.get("limitations", []))
    items = []
    if len(runs) > 1:
        single = [text for text in counts if SINGLE_SEED.match(text)]
        for text in single:
            del counts[text]
        if single:
            seeds = Counter(run.arm for run in runs)
            items.append("Each run's report says a single seed says nothing about spread; this page compares the "
                         "arms across seeds (" + ", ".join(f"{arm}: {n}" for arm, n in seeds.items()) + ").")
    items += [f"{text} ({count} of {len(runs)} runs)" if len(runs) > 1 else text for text, count in counts.items()]
    body = "<ul>" + "".join(f"<li>{html.text(item)}</li>" for item in [*items, *notes]) + "</ul>"
    return html.section("Limitations", body, anchor="limitations")


def stage_series(runs: list[RunView], metrics: list[str]) -> dict[str, dict[str, list[list[float]]]]:
    """metric -> arm -> one list per seed (anchor, then each stage), for ``figures.stages_figure``."""
    series: dict[str, dict[str, list[list[float]]]] = {}
    for metric in metrics:
        for run in runs:
            values = run.metric_series(metric)
            if any(v is None for v in values):
                continue
            series.setdefault(metric, {}).setdefault(run.arm, []).append([float(v) for v in values])
    return series


def fractions(runs: list[RunView]) -> list[float]:
    return max(([s["fraction"] for s in run.report.get("stages", [])] for run in runs), key=len, default=[])


def paired_table(result: dict[str, Any]) -> str:
    """Compare's paired figures, one row per arm and metric and one cell per figure (``columns.REPORT``, each
    with its exact value), then the legend of every column (``columns.FIELDS``)."""
    from opalctl.compare.columns import FIELDS, REPORT, UNDEFINED, d_z_text
    from opalctl.compare.significance import TEST_MIN_SEEDS

    rows = []
    for arm in result["arms"]:
        for metric, figure in arm["paired"].items():
            cells = []
            for _, key in REPORT:
                if key == "wins":
                    cells.append(f"<td>{figure['wins']}/{figure['ties']}/{figure['losses']}</td>")
                elif key == "d_z" and figure["d_z"] is None and d_z_text(figure) != "-":
                    cells.append(f'<td class="n" data-arm="{html.text(arm["arm"])}" data-metric="{html.text(metric)}" '
                                 f'data-field="d_z">{d_z_text(figure)}</td>')
                else:
                    cells.append(html.number_cell(figure[key], arm=arm["arm"], metric=metric, field=key))
            note = f"n={figure['n']}" if figure["n"] < TEST_MIN_SEEDS else ""
            shown = arm["arm"] + (" (post-hoc)" if arm.get("post_hoc") else "")
            rows.append([f"<td>{html.text(shown)}</td>", f"<td>{html.text(metric)}</td>", *cells,
                         f"<td>{note}</td>"])
    words = [f"<dt>{html.text(header)}</dt><dd>{html.text(_words(FIELDS, key))}</dd>" for header, key in REPORT]
    words.append(f"<dt>note</dt><dd>n, the seeds paired, where it is below {TEST_MIN_SEEDS}: what so few seeds "
                 f"cannot say is under Limitations</dd>")
    words.append(f"<dt>-</dt><dd>{html.text(UNDEFINED.removeprefix('- = '))}</dd>")
    return (f"<h3>Paired by seed against {html.text(result['baseline'])}</h3>"
            + html.table(["arm", "metric", *[header for header, _ in REPORT], "note"], rows, cells_ready=True)
            + f'<dl class="legend">{"".join(words)}</dl>')


def _words(fields: dict[str, str], key: str) -> str:
    """A column's legend from the words of its figure, with the page's "-" for the JSON's null."""
    if key == "wins":
        return f"wins / ties / losses: {fields['wins']}; {fields['ties']}; {fields['losses']}"
    return fields[key].replace("null", "-")
