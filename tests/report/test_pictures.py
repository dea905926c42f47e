"""The report's pictures, looked at in a real headless Chromium: the session's finished runs (tests/conftest.py's
``finished_runs``: digits on a tiny ``updates`` budget, fixed AdamW arms and the heuristic agent, whose decisions
both changed and kept the program, on two seeds), their page and one run's page.

What a machine can judge is asserted: the page loads with no error, every figure is drawn at a size, the
learning-rate figure is there, the single-seed sentence is said at most once, the decisions that kept the program
are folded under one line that counts them. The rest is for eyes: with ``OPALCTL_SCREENSHOTS=DIR`` the tests
write the screenshots there (``grid-page.png``, ``run-page.png``) for a person to look at.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.support.files import SEEDS

SINGLE_SEED = "a single seed says nothing about spread"
# every figure of the page: its name, its drawn width and height in CSS pixels
FIGURES = ("Array.from(document.querySelectorAll('figure')).map(f => {const r = f.querySelector('svg')"
           ".getBoundingClientRect(); return [f.dataset.figure || '', r.width, r.height];})")


@pytest.fixture(scope="module")
def pages(grid, tmp_path_factory) -> dict[str, Path]:
    from opalctl.report.grid_page import write_grid_page
    from opalctl.report.run_page import write_run_page

    out = tmp_path_factory.mktemp("pages")
    run_dir = next(grid["runs"].glob("*/agent/seed-1"))
    return {"grid": write_grid_page(grid["lock"], runs_dir=grid["runs"], out=out),
            "run": write_run_page(run_dir, out / "run.html")}


def _keep_screenshot(name: str, png: bytes) -> None:
    folder = os.environ.get("OPALCTL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_bytes(png)


def _size(png: bytes) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(png)).size


@pytest.mark.parametrize("which", ["grid", "run"])
def test_the_page_loads_and_every_figure_is_drawn_at_a_size(browser, pages, which):
    loaded = browser.load(pages[which].as_uri(), measure=FIGURES)
    _keep_screenshot(f"{which}-page.png", loaded["png"])
    assert loaded["errors"] == [] and [m for m in loaded["console"] if m["type"] in ("error", "warning")] == []
    figures = loaded["measured"]
    expected = {"grid": ["loss", "lr", "final", "stages", "forest", "timeline"],
                "run": ["loss", "lr", "stages", "timeline"]}[which]
    assert [name for name, _, _ in figures] == expected
    assert all(width > 300 and height > 100 for _, width, height in figures), figures
    width, height = _size(loaded["png"])
    assert width >= 1000 and height > sum(h for _, _, h in figures)


def test_the_grid_page_says_the_single_seed_sentence_once_and_folds_the_kept_decisions(browser, pages, grid):
    dom = browser.load(pages["grid"].as_uri())["dom"]
    assert dom.count(SINGLE_SEED) <= 1
    assert f"agent: {len(SEEDS)}" in dom and f"high: {len(SEEDS)}" in dom, "the seeds each arm has, said once"
    kept = sum(1 for path in grid["runs"].glob("*/agent/seed-*/training/opal/events.jsonl")
               for line in path.read_text().splitlines() if json.loads(line)["kind"] == "kept")
    assert kept, "the heuristic agent keeps the program at some decisions in this protocol"
    assert f'<details class="kept"><summary>{kept} decision{"s" if kept != 1 else ""} kept the program' in dom
    table = dom.index('<section id="decisions">')
    assert dom.index("applied", table) < dom.index('<details class="kept">', table), "the changes come first"


def test_the_run_page_keeps_its_own_single_seed_sentence(pages):
    text = pages["run"].read_text(encoding="utf-8")
    assert text.count(SINGLE_SEED) == 1


def test_runs_recorded_before_the_learning_rate_still_draw_their_loss(grid, tmp_path):
    """A steps file of an opalctl older than the ``lrs`` field: the loss is drawn, the learning rate is said to be
    missing (the page itself is refused, as ``show`` refuses a steps file that no longer matches its digest)."""
    import gzip

    from opalctl.report import figures
    from opalctl.report.runs import loss_curve
    from opalctl.report.sections import loss_and_lr_figures

    run_dir = tmp_path / "run"
    shutil.copytree(next(grid["runs"].glob("*/adamw/seed-2")), run_dir)
    updates = int(json.loads((run_dir / "report.json").read_text())["updates"])
    steps = run_dir / "training" / "steps.jsonl.gz"
    lines = [json.loads(line) for line in gzip.decompress(steps.read_bytes()).decode().splitlines()]
    assert all(len(line["lrs"]) == 1 for line in lines)
    old = "".join(json.dumps({k: v for k, v in line.items() if k != "lrs"}, separators=(",", ":"),
                             sort_keys=True) + "\n" for line in lines)
    steps.write_bytes(gzip.compress(old.encode(), mtime=0))
    curve = loss_curve(run_dir)
    assert len(curve.losses) == updates and curve.lrs == [None] * updates
    run = {"seed": 2, "curve": curve, "stages": [], "marks": []}
    parts = loss_and_lr_figures(figures, {"adamw": [run]}, "updates")
    assert len(parts) == 2 and "<svg" in parts[0] and "hold no learning rates" in parts[1]


def test_under_a_clock_that_charges_time_the_loss_has_a_second_panel_against_the_charge():
    """Two seeds on the cpu clock, whose updates cost different seconds: the loss is drawn against updates and
    against the budget charged, and the learning rate of two groups against updates."""
    import re as regex

    from opalctl.report import figures
    from opalctl.report.runs import Curve
    from opalctl.report.sections import loss_and_lr_figures

    def run(seed, cost):
        updates = list(range(1, 201))
        curve = Curve(updates=updates, losses=[3.0 / u ** 0.5 for u in updates], used=[cost * u for u in updates],
                      lrs=[[1e-3, 1e-4 * (1 - u / 200)] for u in updates])
        return {"seed": seed, "curve": curve, "stages": [{"update": 100, "used": cost * 100, "promoted": True}],
                "marks": [{"update": 120, "used": cost * 120, "kind": "applied"}]}

    loss, lr = loss_and_lr_figures(figures, {"adamw": [run(1, 0.01), run(2, 0.012)]}, "cpu")
    # glyphs are drawn as paths, so the SVG holds no label text: its panels are counted
    assert len(regex.findall(r'<g id="axes_\d+"', loss)) == 2, "updates, and the budget charged"
    assert "Right: the same against the budget the clock charged." in loss
    assert 'data-figure="lr"' in lr and "the seeds&#x27; min-max" in lr
    assert len(regex.findall(r'<g id="axes_\d+"', lr)) == 1
