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
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

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


ARM_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
               "#bcbd22")
BAND = "min-max"  # what a seed band spans: the lowest to the highest seed at each point


def arm_colours(arms) -> dict[str, str]:
    """One colour per arm, the same in every figure of a page (the arms' order)."""
    return {arm: ARM_COLOURS[i % len(ARM_COLOURS)] for i, arm in enumerate(arms)}


def ema_span(points: int) -> int:
    """The smoothing of the loss curves: an exponential moving average over about 2 % of a run's updates (at
    least 5), so a 600-update run is smoothed over 12 updates and a 60-update one over 5."""
    return max(5, round(points / 50))


def ema(values: list[float], span: int) -> list[float]:
    """The exponential moving average with weight 2 / (span + 1), debiased at the start (as TensorBoard's
    smoothing), so the first points are not pulled towards zero."""
    alpha = 2.0 / (span + 1.0)
    out, average, weight = [], 0.0, 0.0
    for value in values:
        average = (1.0 - alpha) * average + alpha * value
        weight = (1.0 - alpha) * weight + alpha
        out.append(average / weight)
    return out


def _on_common_axis(series: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[list[float]]]:
    """Several seeds' (x, y) on the x of the longest one, cut to the range every seed covers; each seed's y there
    by linear interpolation (the seeds of an ``updates`` budget share their x, and nothing is interpolated)."""
    import numpy as np

    series = [(x, y) for x, y in series if len(x)]
    if not series:
        return [], []
    low, high = max(x[0] for x, _ in series), min(x[-1] for x, _ in series)
    grid = [v for v in max((x for x, _ in series), key=len) if low <= v <= high]
    return grid, [np.interp(grid, x, y).tolist() for x, y in series]


def _line_width(index: int) -> float:
    """The first arm's line the widest, each later one narrower and drawn above it, so an arm that follows
    another exactly (an agent arm until its first change) still shows both."""
    return max(1.0, 3.0 - 0.7 * index)


def _seed_band(axis, series, colour: str, label: str, linestyle: str = "-", width: float = 1.4) -> None:
    """The mean over seeds as a line and the seeds' min-max as a band (a single seed: its line alone)."""
    grid, ys = _on_common_axis(series)
    if not grid:
        return
    mean = [sum(column) / len(column) for column in zip(*ys)]
    axis.plot(grid, mean, color=colour, linewidth=width, linestyle=linestyle, label=label)
    if len(ys) > 1:
        axis.fill_between(grid, [min(c) for c in zip(*ys)], [max(c) for c in zip(*ys)], color=colour, alpha=0.18,
                          linewidth=0)


def _readable_log_axis(axis, values: list[float]) -> None:
    """A log y axis only where the values span more than a decade, with ticks at 1, 2 and 5 times a power of ten
    written as plain numbers (never "2x10^0"); a linear one otherwise."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    finite = [v for v in values if v > 0]
    if not finite or max(finite) / min(finite) < 10:
        return
    axis.set_yscale("log")
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.yaxis.set_minor_formatter(NullFormatter())


def loss_figure(arms: dict[str, list[dict[str, Any]]], charge_label: str | None) -> tuple[str, int]:
    """The training loss of every arm on one axis against updates: each seed smoothed (``ema``), the mean over
    seeds as a line, the seeds' min-max as a band; stages as dotted verticals, each agent decision that changed
    the program as a triangle along the bottom (a cross where it was reverted). ``charge_label``: a second panel
    against the budget the clock charged, in its unit (None under an ``updates`` clock, where it is the first).
    Returns the SVG and the smoothing span."""
    panels = [("updates", "update", "updates")] + ([("used", "used", charge_label)] if charge_label else [])
    figure = Figure(figsize=(WIDTH, 3.8), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False).ravel().tolist()
    colours = arm_colours(arms)
    span = ema_span(max((len(run["curve"].updates) for runs in arms.values() for run in runs), default=0))
    values = [v for runs in arms.values() for run in runs for v in run["curve"].losses]
    for axis, (field, key, label) in zip(axes, panels):
        marks = blended_transform_factory(axis.transData, axis.transAxes)
        stages = sorted({stage[key] for runs in arms.values() for run in runs for stage in run["stages"]})
        for x in stages:
            axis.axvline(x, color="#bbbbbb", linestyle=":", linewidth=0.9)
        for index, (arm, runs) in enumerate(arms.items()):
            colour = colours[arm]
            _seed_band(axis, [(getattr(run["curve"], field), ema(run["curve"].losses, span)) for run in runs],
                       colour, f"{arm} ({len(runs)} seed{'s' if len(runs) != 1 else ''})", width=_line_width(index))
            for kind, marker in (("applied", "^"), ("reverted", "x")):
                xs = [mark[key] for run in runs for mark in run["marks"] if mark["kind"] == kind
                      and mark.get(key) is not None]
                axis.plot(xs, [0.03] * len(xs), marker, color=colour, markersize=7, transform=marks,
                          linestyle="none")
        _readable_log_axis(axis, values)
        axis.set_xlabel(label, fontsize=9)
        axis.set_ylabel("training loss (smoothed)", fontsize=9)
        axis.tick_params(labelsize=8)
        axis.grid(True, which="major", color="#eeeeee", linewidth=0.8)
    axes[0].legend(fontsize=8, loc="upper right")
    return _svg(figure, "loss"), span


def lr_figure(arms: dict[str, list[dict[str, Any]]]) -> str | None:
    """The learning rate of each parameter group as each update's step used it, against updates: the arms on one
    axis, the mean over seeds as a line and the seeds' min-max as a band, one line style per group. None when no
    run recorded learning rates (an older opalctl's steps records)."""
    styles = ("-", "--", ":", "-.")
    figure = Figure(figsize=(WIDTH, 3.0), layout="constrained")
    axis = figure.subplots()
    colours = arm_colours(arms)
    drawn = False
    for index, (arm, runs) in enumerate(arms.items()):
        groups = max((len(lrs) for run in runs for lrs in run["curve"].lrs if lrs), default=0)
        for group in range(groups):
            series = []
            for run in runs:
                points = [(u, lrs[group]) for u, lrs in zip(run["curve"].updates, run["curve"].lrs)
                          if lrs and group < len(lrs) and lrs[group] is not None]
                series.append(([u for u, _ in points], [v for _, v in points]))
            label = arm if groups == 1 else f"{arm}, group {group}"
            _seed_band(axis, series, colours[arm], label, styles[group % len(styles)], _line_width(index))
            drawn = True
    if not drawn:
        return None
    axis.set_xlabel("updates", fontsize=9)
    axis.set_ylabel("learning rate", fontsize=9)
    axis.set_ylim(bottom=0)
    axis.yaxis.set_major_locator(MaxNLocator(5))
    axis.yaxis.set_major_formatter(FuncFormatter(_short))
    axis.tick_params(labelsize=8)
    axis.grid(True, color="#eeeeee", linewidth=0.8)
    axis.legend(fontsize=8, loc="best")
    return _svg(figure, "lr")


def final_figure(values: dict[str, dict[str, list[float]]], directions: dict[str, str], stage: str) -> str:
    """One panel per metric, each on its own scale: every seed's value at the compared stage as a dot per arm,
    and the arms' mean as a bar; the title says which way is better. ``values[metric][arm]`` holds the seeds'."""
    figure, axes = _grid(len(values), 3, 0.9 + 0.32 * max((len(a) for a in values.values()), default=1))
    for axis, (metric, arms) in zip(axes, values.items()):
        colours = arm_colours(arms)
        names = list(arms)
        for y, arm in enumerate(names):
            seeds = arms[arm]
            axis.plot(seeds, [y] * len(seeds), "o", color=colours[arm], markersize=4, alpha=0.8)
            if seeds:
                mean = sum(seeds) / len(seeds)
                axis.plot([mean, mean], [y - 0.3, y + 0.3], color=colours[arm], linewidth=2)
        axis.set_yticks(range(len(names)), names, fontsize=8)
        axis.set_ylim(-0.6, len(names) - 0.4)
        axis.invert_yaxis()
        axis.xaxis.set_major_locator(MaxNLocator(4))
        axis.xaxis.set_major_formatter(FuncFormatter(_short))
        better = directions.get(metric)
        axis.set_title(f"{metric} ({better} is better)" if better else metric, fontsize=9)
        axis.tick_params(axis="x", labelsize=8)
        axis.grid(True, axis="x", color="#eeeeee", linewidth=0.8)
    return _svg(figure, "final")


def _short(value: float, _pos=None) -> str:
    """A tick label of at most four significant digits."""
    return f"{value:.4g}"


def stages_figure(series: dict[str, dict[str, list[list[float]]]], fractions: list[float]) -> str:
    """One panel per metric: each arm's mean across seeds at every stage, the seeds' range as a band, on the
    stages' own scale; the anchor's value is in the title, not on the axis, where it would squash the stages
    together. ``series[metric][arm]`` holds one list of values per seed, anchor first."""
    figure, axes = _grid(len(series), 3, 2.6)
    colours = arm_colours(dict.fromkeys(arm for arms in series.values() for arm in arms))  # the page's order
    for axis, (metric, arms) in zip(axes, series.items()):
        anchors = []
        for arm, seeds in arms.items():
            index = list(colours).index(arm)
            anchors.extend(seed[0] for seed in seeds if seed)
            columns = [[seed[i + 1] for seed in seeds if i + 1 < len(seed)] for i in range(len(fractions))]
            keep = [i for i, column in enumerate(columns) if column]
            means = [sum(columns[i]) / len(columns[i]) for i in keep]
            axis.plot([fractions[i] for i in keep], means, marker=".", linewidth=_line_width(index), label=arm,
                      color=colours[arm])
            if len(seeds) > 1:
                axis.fill_between([fractions[i] for i in keep], [min(columns[i]) for i in keep],
                                  [max(columns[i]) for i in keep], color=colours[arm], alpha=0.18, linewidth=0)
        anchor = f"; anchor {_short(sum(anchors) / len(anchors))}" if anchors else ""
        axis.set_title(f"{metric}{anchor}", fontsize=9)
        axis.set_xlabel("budget fraction", fontsize=8)
        axis.yaxis.set_major_locator(MaxNLocator(5))
        axis.yaxis.set_major_formatter(FuncFormatter(_short))
        axis.tick_params(labelsize=8)
    if axes:
        axes[0].legend(fontsize=7)
    return _svg(figure, "stages")


def forest_figure(rows: dict[str, list[dict[str, Any]]], baseline: str, directions: dict[str, str]) -> str:
    """One panel per metric: each arm's mean paired difference to the baseline with its interval; a hollow
    marker where the seeds are too few for the exact test to decide; an arrow under the axis points to the better
    side (right when higher is better)."""
    figure, axes = _grid(len(rows), 2, max(1.9, 1.1 + 0.35 * max((len(r) for r in rows.values()), default=1)))
    for axis, (metric, entries) in zip(axes, rows.items()):
        for y, entry in enumerate(entries):
            if entry["mean"] is None:
                continue
            axis.errorbar([entry["mean"]], [y], xerr=[[entry["mean"] - entry["low"]], [entry["high"] - entry["mean"]]],
                          fmt="o", color="#1f4e79", capsize=3, markersize=5,
                          markerfacecolor="#1f4e79" if entry["reliable"] else "white")
        axis.axvline(0.0, color="#999999", linewidth=0.8)
        axis.set_yticks(range(len(entries)), [e["arm"] for e in entries], fontsize=8)
        axis.set_ylim(-0.6, len(entries) - 0.4)
        axis.invert_yaxis()
        axis.xaxis.set_major_locator(MaxNLocator(5))
        axis.margins(x=0.08)
        axis.xaxis.set_major_formatter(FuncFormatter(_short))
        axis.tick_params(axis="x", labelsize=8)
        better = directions.get(metric)
        if better:
            arrow = "better →" if better == "higher" else "← better"
            axis.set_xlabel(f"{arrow} ({better} is better)", fontsize=8)
        axis.set_title(f"{metric} (arm − {baseline})", fontsize=9)
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


def profile_figure(steps: dict[str, list[list[float]]], tau_max: float) -> str:
    """The performance profile of each arm across a suite's tasks: the fraction of tasks on which its time-to-target
    is within tau of the fastest arm's, a step function of tau from 1 to ``tau_max`` (compare/profiles.py)."""
    figure = Figure(figsize=(WIDTH * 0.7, 3.6), layout="constrained")
    axis = figure.subplots()
    colours = arm_colours(steps)
    for index, (arm, points) in enumerate(steps.items()):
        taus = [tau for tau, _ in points]
        values = [value for _, value in points]
        axis.step(taus, values, where="post", color=colours[arm], linewidth=_line_width(index), label=arm)
    axis.set_xlim(1.0, tau_max)
    axis.set_ylim(-0.03, 1.03)
    axis.set_xlabel("tau: time-to-target within tau times the fastest arm's", fontsize=9)
    axis.set_ylabel("fraction of tasks", fontsize=9)
    axis.grid(True, color="#eeeeee", linewidth=0.8)
    axis.tick_params(labelsize=8)
    axis.legend(fontsize=8, loc="lower right")
    return _svg(figure, "profiles")
