"""The report's figures, drawn with matplotlib (Agg, no display) and returned as SVG text to inline in the page.

Each figure is a ``matplotlib.figure.Figure`` of its own (no pyplot state), saved without a date and with a salt
of its own for the ids inside the SVG, so two figures on one page never share an id and the same records give
the same bytes. Glyphs are drawn as paths, so the page needs no font file.
"""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402 (after choosing the backend)
from matplotlib.transforms import blended_transform_factory  # noqa: E402

MARK_COLOURS = {"applied": "#1b7f3b", "kept": "#7a7a7a", "reverted": "#c0392b", "other": "#d68910"}
WIDTH = 10.0  # inches: the page's figure width at 100 dpi


def _svg(figure: Figure, name: str) -> str:
    with matplotlib.rc_context({"svg.hashsalt": f"opalctl-{name}", "svg.fonttype": "path"}):
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg", metadata={"Date": None})  # the layout is constrained already
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _grid(count: int, columns: int, row_height: float) -> tuple[Figure, list]:
    rows = max(1, -(-count // columns))
    figure = Figure(figsize=(WIDTH, row_height * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel().tolist()
    for unused in axes[count:]:
        unused.set_visible(False)
    return figure, axes[:count]


def loss_figure(arms: dict[str, list[dict[str, Any]]], seconds_label: str) -> str:
    """One panel per arm: each seed's training loss against training seconds, its stages as dotted verticals
    (a dot on top when promoted) and the agent's decisions as ticks along the bottom."""
    figure, axes = _grid(len(arms), 2 if len(arms) > 1 else 1, 3.0)
    positive = all(v > 0 for runs in arms.values() for run in runs for v in run["curve"].losses)
    for axis, (arm, runs) in zip(axes, arms.items()):
        ticks = blended_transform_factory(axis.transData, axis.transAxes)
        for run in runs:
            line, = axis.plot(run["curve"].seconds, run["curve"].losses, linewidth=0.9, label=f"seed {run['seed']}")
            colour = line.get_color()
            for seconds, _promoted in run["stages"]:
                axis.axvline(seconds, color=colour, linestyle=":", linewidth=0.8)
            promoted = [seconds for seconds, was in run["stages"] if was]
            axis.plot(promoted, [0.97] * len(promoted), "o", color=colour, markersize=4, transform=ticks)
            for kind, mark_colour in MARK_COLOURS.items():  # one line of markers per kind, not one per decision
                xs = [mark["seconds"] for mark in run["marks"] if mark["kind"] == kind]
                axis.plot(xs, [0.03] * len(xs), "|", color=mark_colour, markersize=10, transform=ticks)
        if positive:
            axis.set_yscale("log")
        axis.set_title(arm, fontsize=10)
        axis.set_xlabel(seconds_label, fontsize=8)
        axis.set_ylabel("training loss", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=7, loc="upper right")
    return _svg(figure, "loss")


def stages_figure(series: dict[str, dict[str, list[list[float]]]], fractions: list[float]) -> str:
    """One panel per metric: each arm's mean across seeds at the anchor (0) and every stage, the seeds' range
    as a band. ``series[metric][arm]`` holds one list of values per seed, anchor first."""
    figure, axes = _grid(len(series), 3, 2.6)
    xs = [0.0, *fractions]
    for axis, (metric, arms) in zip(axes, series.items()):
        for arm, seeds in arms.items():
            columns = [[seed[i] for seed in seeds if i < len(seed)] for i in range(len(xs))]
            keep = [i for i, column in enumerate(columns) if column]
            means = [sum(columns[i]) / len(columns[i]) for i in keep]
            line, = axis.plot([xs[i] for i in keep], means, marker=".", linewidth=1.0, label=arm)
            if max(len(seeds), 1) > 1:
                axis.fill_between([xs[i] for i in keep], [min(columns[i]) for i in keep],
                                  [max(columns[i]) for i in keep], color=line.get_color(), alpha=0.2)
        axis.set_title(metric, fontsize=9)
        axis.set_xlabel("budget fraction (0 = anchor)", fontsize=7)
        axis.tick_params(labelsize=7)
    if axes:
        axes[0].legend(fontsize=7)
    return _svg(figure, "stages")


def forest_figure(rows: dict[str, list[dict[str, Any]]], baseline: str) -> str:
    """One panel per metric: each arm's mean paired difference to the baseline with its bootstrap interval;
    a hollow marker where the interval is unreliable (too few seeds)."""
    figure, axes = _grid(len(rows), 3, max(1.6, 0.5 + 0.35 * max((len(r) for r in rows.values()), default=1)))
    for axis, (metric, entries) in zip(axes, rows.items()):
        for y, entry in enumerate(entries):
            if entry["mean"] is None:
                continue
            axis.errorbar([entry["mean"]], [y], xerr=[[entry["mean"] - entry["low"]], [entry["high"] - entry["mean"]]],
                          fmt="o", color="#1f4e79", capsize=3, markersize=5,
                          markerfacecolor="#1f4e79" if entry["reliable"] else "white")
        axis.axvline(0.0, color="#999999", linewidth=0.8)
        axis.set_yticks(range(len(entries)), [e["arm"] for e in entries], fontsize=7)
        axis.set_ylim(-0.6, len(entries) - 0.4)
        axis.set_title(f"{metric} (arm − {baseline})", fontsize=9)
        axis.tick_params(labelsize=7)
    return _svg(figure, "forest")


def timeline_figure(runs: list[dict[str, Any]]) -> str:
    """One row per run: each stage at its budget fraction, a filled dot when promoted, a cross when refused, a
    ring around the selected stage; a run that kept the anchor is ringed at 0."""
    figure = Figure(figsize=(WIDTH, 0.9 + 0.3 * len(runs)), layout="constrained")
    axis = figure.subplots()
    for y, run in enumerate(runs):
        for fraction, promoted in run["stages"]:
            axis.plot([fraction], [y], "o" if promoted else "x", color="#1b7f3b" if promoted else "#7a7a7a",
                      markersize=6)
        selected = run["selected_fraction"]
        axis.plot([selected], [y], "o", markersize=12, markerfacecolor="none", markeredgecolor="#1f4e79")
    axis.set_yticks(range(len(runs)), [run["label"] for run in runs], fontsize=7)
    axis.set_xlim(-0.05, 1.05)
    axis.set_ylim(-0.6, len(runs) - 0.4)
    axis.invert_yaxis()
    axis.set_xlabel("budget fraction (0 = anchor); ● promoted, × refused, ○ selected", fontsize=8)
    axis.tick_params(labelsize=7)
    return _svg(figure, "timeline")
